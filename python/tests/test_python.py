"""test_python.py — the Python package against a float64 numpy reference and, where installed,
PyTorch. One line per case (PASS|FAIL|SKIP), closing "N passed, N failed"; exit 1 on failure.
Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_python.py

Tolerances: winattn accumulates in f32 and rounds outputs to the dtype once, so its error against
float64 is a few units of the dtype's rounding at the values' scale (inputs are N(0, 1), outputs
and gradients O(1)): f32 2e-4, f16 4e-3, bf16 3e-2 absolute. The C test suite (`winattn parity`)
holds the kernels to FlashAttention's stricter relative criterion; this file tests the binding:
layouts, strides, dtypes, GQA, windows, errors and autograd, and the packed varlen calls against
the same reference run on each sequence alone (outputs poisoned with NaN beforehand).
"""
import os
import sys

import numpy as np

import winattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, expect_error, finish, report, skip  # noqa: E402

TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}


def reference(q, k, v, do, left, right, scale, softcap):
    """float64 forward and backward straight from the definitions (bottom-right aligned window)."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    i = np.arange(Nq)[:, None] + (Nk - Nq)
    j = np.arange(Nk)[None, :]
    mask = np.ones((Nq, Nk), bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    raw = scale * q @ kk.transpose(0, 1, 3, 2)
    s = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)
    o = p @ vv
    dp = do @ vv.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    if softcap > 0:
        ds = ds * (1 - np.tanh(raw / softcap) ** 2)
    ds *= scale
    dq = ds @ kk
    dk = (ds.transpose(0, 1, 3, 2) @ q).reshape(B, Hkv, rep, Nk, D).sum(2)
    dv = (p.transpose(0, 1, 3, 2) @ do).reshape(B, Hkv, rep, Nk, D).sum(2)
    return o, dq, dk, dv


def dtypes():
    out = [np.float32, np.float16]
    try:
        import ml_dtypes
        out.append(ml_dtypes.bfloat16)
    except ImportError:
        skip("bfloat16 arrays", "ml_dtypes is not installed")
    return out


def run_numpy_grid():
    rng = np.random.default_rng(0)
    shapes = [(1, 2, 2, 65, 65, 32), (2, 4, 2, 40, 97, 24), (1, 4, 1, 97, 40, 16), (1, 8, 2, 130, 130, 8)]
    windows = [(-1, -1), (-1, 0), (16, 0), (5, 3), (-1, 4), (0, 0), (20, -1)]
    n = 0
    for dt in dtypes():
        for (B, Hq, Hkv, Nq, Nk, D) in shapes:
            for (left, right) in windows:
                n += 1
                layout = "bnhd" if n % 2 else "bhnd"
                softcap = 5.0 if n % 5 == 0 else 0.0
                q, k, v, do = (rng.standard_normal((B, H, N, D)).astype(dt)
                               for H, N in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk), (Hq, Nq)))
                scale = 1.0 / np.sqrt(D)
                tr = (lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))) if layout == "bnhd" else (lambda x: x)
                o, lse = winattn.attention(tr(q), tr(k), tr(v), window=(left, right), softcap=softcap,
                                           return_lse=True, layout=layout)
                dq, dk, dv = winattn.attention_backward(tr(q), tr(k), tr(v), o, lse, tr(do), window=(left, right),
                                                        softcap=softcap, layout=layout)
                back = (lambda x: x.transpose(0, 2, 1, 3)) if layout == "bnhd" else (lambda x: x)
                ref = reference(q, k, v, do, left, right, scale, softcap)
                errs = [np.abs(back(x).astype(np.float64) - r).max() for x, r in zip((o, dq, dk, dv), ref)]
                tol = TOL[np.dtype(dt).name]
                report(max(errs) <= tol, "numpy %s B=%d Hq=%d Hkv=%d Nq=%d Nk=%d D=%d win=(%d,%d)%s %s" % (
                    np.dtype(dt).name, B, Hq, Hkv, Nq, Nk, D, left, right, " cap=5" if softcap else "", layout),
                    "max err o/dq/dk/dv %s (tol %g)" % ("/".join("%.1e" % e for e in errs), tol))


def varlen_reference(q, k, v, do, cu_q, cu_k, left, right, scale, softcap):
    """The float64 reference of a packed batch: each sequence alone through reference(), with
    o = 0, lse = -inf, dq = 0 for queries of a sequence without keys."""
    Tq, Hq, D = q.shape
    o, dq = np.zeros(q.shape), np.zeros(q.shape)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    lse = np.full((Hq, Tq), -np.inf)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        bhnd = [x[s].transpose(1, 0, 2)[None] for x, s in ((q, qs), (k, ks), (v, ks), (do, qs))]
        r = reference(*bhnd, left, right, scale, softcap)
        for out, got, s in zip((o, dq, dk, dv), r, (qs, qs, ks, ks)):
            out[s] = got[0].transpose(1, 0, 2)
        lse[:, qs] = reference_lse(*bhnd[:2], left, right, scale, softcap)[0]
    return o, lse, dq, dk, dv


def reference_lse(q, k, left, right, scale, softcap):
    """float64 log-sum-exp of the visible scores, [B, Hq, Nq] (-inf where a row sees no key)"""
    q, k = q.astype(np.float64), k.astype(np.float64)
    Nq, Nk = q.shape[2], k.shape[2]
    kk = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    i = np.arange(Nq)[:, None] + (Nk - Nq)
    j = np.arange(Nk)[None, :]
    mask = np.ones((Nq, Nk), bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    s = scale * q @ kk.transpose(0, 1, 3, 2)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m2 = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(s - m2).sum(-1)) + m2[..., 0]


def poisoned(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the binding's output arrays (np.empty) filled with NaN, so that an
    element the library does not write shows up as an error."""
    real = np.empty

    def empty(*a, **kw):
        out = real(*a, **kw)
        out.fill(np.nan)
        return out
    np.empty = empty
    try:
        return fn(*args, **kwargs)
    finally:
        np.empty = real


def run_varlen_grid():
    if not winattn._lib.HAS_VARLEN:
        skip("numpy varlen", "this libwinattn has no wa_forward_varlen")
        return
    rng = np.random.default_rng(5)
    # (query lengths, key lengths) per sequence: empty sequences on either side, single tokens,
    # Nq_b < Nk_b (a prefill after a cache) and Nq_b > Nk_b (rows that see no key), one long one
    mixes = [([5, 0, 1, 33, 17], [5, 0, 1, 33, 17]),
             ([0, 1, 40, 3], [4, 1, 70, 0]),
             ([70, 2, 0, 9, 1, 1], [30, 2, 3, 9, 0, 1]),
             ([1], [1]),
             ([0, 0], [0, 0])]
    heads = [(2, 2, 32), (4, 2, 24), (8, 1, 16), (4, 1, 64)]  # (Hq, Hkv, D)
    windows = [(-1, 0), (4, 0), (50, 0), (-1, -1), (3, 2), (0, 0)]  # (50, 0): longer than most sequences
    n = 0
    for dt in dtypes():
        for lq, lk in mixes:
            for left, right in windows:
                n += 1
                Hq, Hkv, D = heads[n % len(heads)]
                softcap = 4.0 if n % 4 == 0 else 0.0
                cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
                Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
                q, do = (rng.standard_normal((Tq, Hq, D)).astype(dt) for _ in range(2))
                # k and v as strided views into one [Tk, 2, Hkv, D] buffer, as a fused kv projection gives
                kv = rng.standard_normal((Tk, 2, Hkv, D)).astype(dt)
                k, v = kv[:, 0], kv[:, 1]
                scale = 1.0 / np.sqrt(D)
                name = "numpy varlen %s Hq=%d Hkv=%d D=%d lens q %s k %s win=(%d,%d)%s" % (
                    np.dtype(dt).name, Hq, Hkv, D, lq, lk, left, right, " cap=4" if softcap else "")

                @case(name)
                def _():
                    o, lse = poisoned(winattn.attention_varlen, q, k, v, cu_q, cu_k, window=(left, right),
                                      softcap=softcap, return_lse=True)
                    dq, dk, dv = poisoned(winattn.attention_varlen_backward, q, k, v, o, lse, do, cu_q, cu_k,
                                          window=(left, right), softcap=softcap)
                    ro, rlse, rdq, rdk, rdv = varlen_reference(q, k, v, do, cu_q, cu_k, left, right, scale, softcap)
                    errs = [np.abs(x.astype(np.float64) - r).max(initial=0.0)
                            for x, r in zip((o, dq, dk, dv), (ro, rdq, rdk, rdv))]
                    # GQA sums Hq/Hkv heads into dk and dv: their tolerance scales with it
                    tol = TOL[np.dtype(dt).name]
                    tols = [tol, tol, tol * Hq / Hkv, tol * Hq / Hkv]
                    same_inf = np.array_equal(np.isinf(lse), np.isinf(rlse))
                    finite = np.isfinite(rlse)
                    lse_err = np.abs(lse[finite] - rlse[finite]).max(initial=0.0)
                    ok = all(e <= t for e, t in zip(errs, tols)) and same_inf and lse_err <= 1e-3
                    ok = ok and o.shape == q.shape and dk.shape == k.shape and lse.shape == (Hq, Tq)
                    report(ok, name, "max err o/dq/dk/dv %s lse %.1e, -inf rows match %s (tol %g)" % (
                        "/".join("%.1e" % e for e in errs), lse_err, same_inf, tol))


@case("numpy varlen equals one rectangular call per sequence")
def _():
    if not winattn._lib.HAS_VARLEN:
        skip("numpy varlen vs rectangular", "this libwinattn has no wa_forward_varlen")
        return
    rng = np.random.default_rng(6)
    lq, lk = [7, 30, 1], [20, 30, 9]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]) for x in (lq, lk))  # int64: converted by the binding
    q = rng.standard_normal((cu_q[-1], 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 2, 32)).astype(np.float32) for _ in range(2))
    o = winattn.attention_varlen(q, k, v, cu_q, cu_k, window=(6, 0))
    same = True
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        r = winattn.attention(q[None, qs], k[None, ks], v[None, ks], window=(6, 0), layout="bnhd")
        same &= np.array_equal(o[qs], r[0])
    report(same, "numpy varlen: each sequence bit-identical to attention() on it alone (int64 offsets accepted)")


@case("numpy varlen bad input")
def _():
    if not winattn._lib.HAS_VARLEN:
        skip("numpy varlen bad input", "this libwinattn has no wa_forward_varlen")
        return
    q = np.zeros((10, 2, 8), np.float32)
    k = np.zeros((12, 2, 8), np.float32)
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 6, 12], np.int32)

    def call(cq=cu_q, ck=cu_k, **kw):
        return lambda: winattn.attention_varlen(kw.pop("q", q), k, k, cq, ck, **kw)
    for name, fn, exc, text in [
        ("float offsets", call(cq=cu_q.astype(np.float32)), TypeError, "integers"),
        ("bool offsets", call(cq=np.array([True, False])), TypeError, "integers"),
        ("2-d offsets", call(cq=cu_q[None]), ValueError, "1-d"),
        ("empty offsets", call(cq=np.zeros(0, np.int32)), ValueError, "1-d"),
        ("first offset 1", call(cq=np.array([1, 4, 10])), ValueError, "must be 0"),
        ("decreasing offsets", call(cq=np.array([0, 6, 4, 10]), ck=np.array([0, 4, 8, 12])), ValueError,
         "decreases"),
        ("last offset short of T", call(cq=np.array([0, 4, 9])), ValueError, "token rows"),
        ("last offset past T", call(ck=np.array([0, 6, 13])), ValueError, "token rows"),
        ("offset 2**32 (would wrap to 0 as int32)", call(cq=np.array([0, 4, 2 ** 32 + 10], np.int64)), ValueError,
         "int32"),
        ("negative offset", call(cq=np.array([0, -4, 10])), ValueError, "int32"),
        ("uint64 offset 2**63", call(cq=np.array([0, 2 ** 63], np.uint64)), ValueError, "int32"),
        ("B differs between q and k", call(ck=np.array([0, 12])), ValueError, "B + 1"),
        ("max_seqlen_q below the longest", call(max_seqlen_q=5), ValueError, "max_seqlen_q"),
        ("max_seqlen_k 2**64", call(max_seqlen_k=2 ** 64), ValueError, "outside"),
        ("max_seqlen_q 4.5", call(max_seqlen_q=4.5), TypeError, "integer"),
        ("q 4-d", call(q=q[None]), ValueError, "3-d"),
        ("window 2**64", call(window=(2 ** 64, 0)), ValueError, "outside"),
    ]:
        expect_error("numpy varlen bad input: %s" % name, fn, exc, text)
    o, lse = winattn.attention_varlen(q, k, k, cu_q, cu_k, return_lse=True)
    expect_error("numpy varlen backward: lse [Hq, Tq] required", lambda: winattn.attention_varlen_backward(
        q, k, k, o, lse[None], o, cu_q, cu_k), ValueError, "2-d")
    expect_error("numpy varlen backward: lse of the wrong length", lambda: winattn.attention_varlen_backward(
        q, k, k, o, lse[:, :5], o, cu_q, cu_k), winattn.WinattnError, "lse")


@case("numpy strided views need no copy and give identical results")
def _():
    rng = np.random.default_rng(1)
    big = rng.standard_normal((1, 3, 70, 40)).astype(np.float32)  # q, k, v interleaved in one buffer
    q, k, v = big[:, 0:1, :, :32], big[:, 1:2, :, :32], big[:, 2:3, :, :32]
    a = winattn.attention(q, k, v, window=(7, 0))
    b = winattn.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), window=(7, 0))
    report(np.array_equal(a, b), "numpy strided views need no copy and give identical results")


@case("numpy calls from several threads at once")
def _():
    # the C library lets one thread use a context at a time; the binding serialises on a lock
    import threading
    rng = np.random.default_rng(2)
    inputs = [tuple(rng.standard_normal((1, h, 300, 32)).astype(np.float32) for h in (4, 2, 2, 4)) for _ in range(6)]
    serial = [winattn.attention_backward(q, k, v, *winattn.attention(q, k, v, window=(40, 0), return_lse=True), do,
                                         window=(40, 0)) for q, k, v, do in inputs]
    results = [None] * len(inputs)

    def work(i):
        q, k, v, do = inputs[i]
        for _ in range(5):
            o, lse = winattn.attention(q, k, v, window=(40, 0), return_lse=True)
            results[i] = winattn.attention_backward(q, k, v, o, lse, do, window=(40, 0))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = all(r is not None and all(np.array_equal(a, b) for a, b in zip(r, s)) for r, s in zip(results, serial))
    report(same, "numpy: 6 threads calling at once give the serial results bit for bit")


@case("numpy bad input")
def _():
    x = np.zeros((1, 2, 8, 4), np.float32)
    for name, call, exc, text in [
        ("float64", lambda: winattn.attention(x.astype(np.float64), x, x), TypeError, "dtype"),
        ("rank 3", lambda: winattn.attention(x[0], x[0], x[0]), ValueError, "4-d"),
        ("Hq % Hkv", lambda: winattn.attention(np.zeros((1, 3, 8, 4), np.float32), x, x), winattn.WinattnError,
         "multiple"),
        ("window -2", lambda: winattn.attention(x, x, x, window=(-2, 0)), ValueError, "window"),
        ("window left 2**64 (would wrap to 0)", lambda: winattn.attention(x, x, x, window=(2 ** 64, 0)), ValueError,
         "outside"),
        ("window right 2**63", lambda: winattn.attention(x, x, x, window=(0, 2 ** 63)), ValueError, "outside"),
        ("window left -2**63-1", lambda: winattn.attention(x, x, x, window=(-2 ** 63 - 1, 0)), ValueError,
         "outside"),
        ("window 7.5", lambda: winattn.attention(x, x, x, window=(7.5, 0)), TypeError, "integer"),
        ("window not a pair", lambda: winattn.attention(x, x, x, window=7), ValueError, "pair"),
        ("scale 1e300 (inf as float32)", lambda: winattn.attention(x, x, x, scale=1e300), ValueError, "float32"),
        ("scale 2**1024", lambda: winattn.attention(x, x, x, scale=2 ** 1024), ValueError, "float32"),
        ("scale 1e-50 (0 = default as float32)", lambda: winattn.attention(x, x, x, scale=1e-50), ValueError,
         "float32"),
        ("scale nan", lambda: winattn.attention(x, x, x, scale=float("nan")), ValueError, "float32"),
        ("softcap -1", lambda: winattn.attention(x, x, x, softcap=-1.0), ValueError, "softcap"),
        ("backward window 2**64", lambda: winattn.attention_backward(x, x, x, x, x[..., 0], x, window=(2 ** 64, 0)),
         ValueError, "outside"),
        ("Context threads 2**32", lambda: winattn.Context(threads=2 ** 32), ValueError, "threads"),
        ("causal with right 3", lambda: winattn.attention(x, x, x, window=(4, 3), causal=True), ValueError, "causal"),
        ("mixed dtypes", lambda: winattn.attention(x, x.astype(np.float16), x), winattn.WinattnError, "dtype"),
        ("bad layout", lambda: winattn.attention(x, x, x, layout="nhd"), ValueError, "layout"),
    ]:
        try:
            call()
            report(False, "numpy bad input: %s" % name, "no error raised")
        except exc as e:
            report(text in str(e), "numpy bad input: %s raises %s" % (name, exc.__name__), str(e))


def run_torch():
    try:
        import torch
        import torch.nn.functional as F
        import winattn.torch as wt
    except ImportError as e:
        skip("torch", "PyTorch is not installed (%s)" % e)
        return
    torch.manual_seed(0)

    def dense_ref(q, k, v, left, right):
        Nq, Nk = q.shape[2], k.shape[2]
        i = torch.arange(Nq)[:, None] + (Nk - Nq)
        j = torch.arange(Nk)[None, :]
        m = torch.ones(Nq, Nk, dtype=torch.bool)
        if left >= 0:
            m &= j >= i - left
        if right >= 0:
            m &= j <= i + right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1])

    for dt, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)):
        for (Hq, Hkv, Nq, Nk, left, right) in ((4, 2, 70, 70, 15, 0), (2, 2, 50, 90, -1, 0), (8, 1, 64, 64, 4, 4)):
            q = torch.randn(1, Hq, Nq, 32, dtype=dt, requires_grad=True)
            k = torch.randn(1, Hkv, Nk, 32, dtype=dt, requires_grad=True)
            v = torch.randn(1, Hkv, Nk, 32, dtype=dt, requires_grad=True)
            g = torch.randn(1, Hq, Nq, 32, dtype=dt)
            o = wt.attention(q, k, v, window=(left, right))
            o.backward(g)
            q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
            o2 = dense_ref(q2, k2, v2, left, right)
            o2.backward(g.double())
            errs = [(a.double() - b).abs().max().item() for a, b in
                    ((o, o2), (q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad))]
            report(max(errs) <= tol, "torch autograd %s Hq=%d Hkv=%d Nq=%d Nk=%d win=(%d,%d) vs float64 SDPA with mask" % (
                str(dt).replace("torch.", ""), Hq, Hkv, Nq, Nk, left, right),
                "max err o/dq/dk/dv %s (tol %g)" % ("/".join("%.1e" % e for e in errs), tol))

    def small_qkv():
        """q [1, 4, 33, 16], k and v [1, 2, 33, 16] that want gradients"""
        return (torch.randn(1, h, 33, 16, requires_grad=True) for h in (4, 2, 2))

    @case("torch deterministic flag")
    def _():
        q, k, v = small_qkv()
        grads = []
        for det in (False, True):
            for t in (q, k, v):
                t.grad = None
            wt.attention(q, k, v, window=(7, 0), deterministic=det).sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
        report(all(torch.equal(a, b) for a, b in zip(*grads)),
               "torch deterministic=True on CPU: the same gradients (the CPU backward is deterministic anyway)")

    @case("torch release_workspace")
    def _():
        q, k, v = small_qkv()
        o1 = wt.attention(q, k, v, window=(7, 0))
        wt.release_workspace()
        o2 = wt.attention(q, k, v, window=(7, 0))
        o2.sum().backward()
        report(torch.equal(o1, o2) and q.grad is not None,
               "torch release_workspace(): contexts closed, the next calls make them again")

    @case("torch eager path")
    def _():
        # attention() called eagerly on plain tensors takes an autograd.Function that calls the
        # library directly; the ops (what torch.compile traces) must give the same bits
        q, k, v = small_qkv()
        do = torch.randn(1, 4, 33, 16)
        o = wt.attention(q, k, v, window=(7, 0))
        eager = [o] + list(torch.autograd.grad(o, (q, k, v), do))
        o2, _ = torch.ops.winattn.forward(q, k, v, 7, 0, 0.0, 0.0, False)
        ops = [o2] + list(torch.autograd.grad(o2, (q, k, v), do))
        report(type(o.grad_fn).__name__ != type(o2.grad_fn).__name__ and
               all(torch.equal(a, b) for a, b in zip(eager, ops)),
               "torch eager path (%s) and autograd through the ops (%s): o, dq, dk, dv bit-identical"
               % (type(o.grad_fn).__name__, type(o2.grad_fn).__name__))
        with torch.no_grad():
            o3 = wt.attention(q, k, v, window=(7, 0))
        report(o3.grad_fn is None and torch.equal(o3, o), "torch eager path under no_grad: no graph, same o")

        from torch.utils._python_dispatch import TorchDispatchMode

        class Seen(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = set()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.add(str(func))
                return func(*args, **(kwargs or {}))

        with Seen() as seen:
            o4 = wt.attention(q, k, v, window=(7, 0))
        report("winattn.forward.default" in seen.ops and torch.equal(o4, o),
               "torch under a dispatch mode: attention() goes through the op, which the mode sees")
        qm, km, vm = (t.detach().to("meta").requires_grad_() for t in (q, k, v))
        om = wt.attention(qm, km, vm, window=(7, 0))
        report(om.device.type == "meta" and om.shape == q.shape and om.grad_fn is not None,
               "torch meta tensors: attention() gives the output's shape through the op's fake kernel")

    @case("torch opcheck")
    def _():
        q, k, v = small_qkv()
        torch.library.opcheck(torch.ops.winattn.forward.default, (q, k, v, 7, 0, 0.0, 0.0, False))
        report(True, "torch.library.opcheck: schema, fake tensor, autograd registration of winattn::forward")

    @case("torch compile")
    def _():
        q = torch.randn(1, 4, 40, 16)
        k = torch.randn(1, 2, 40, 16)
        v = torch.randn(1, 2, 40, 16)
        f = torch.compile(lambda q, k, v: wt.attention(q, k, v, window=(9, 0)) * 2, backend="aot_eager", fullgraph=True)
        report(torch.equal(f(q, k, v), wt.attention(q, k, v, window=(9, 0)) * 2),
               "torch.compile(fullgraph=True, backend=aot_eager) traces winattn.torch.attention")

    @case("torch bad input")
    def _():
        x = torch.zeros(1, 2, 8, 4, dtype=torch.float64)
        expect_error("torch float64 input", lambda: wt.attention(x, x, x), TypeError, "dtype")
        x = x.float()
        expect_error("torch window 2**64", lambda: wt.attention(x, x, x, window=(2 ** 64, 0)), ValueError, "outside")
        expect_error("torch scale 1e300", lambda: wt.attention(x, x, x, scale=1e300), ValueError, "float32")

    @case("torch backward fills no zero gradient")
    def _():
        # lse is not differentiable and its gradient is never read: the eager paths turn off
        # autograd's materialised gradients, which filled a zero tensor for it before every
        # backward (host time that grew with the length; docs/experiments.md). The aten ops the
        # backward dispatches, seen by a dispatch mode: the three empty gradients, no zeros.
        from torch.utils._python_dispatch import TorchDispatchMode

        class Seen(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        q, k, v = (torch.randn(1, h, 48, 16, requires_grad=True) for h in (4, 2, 2))
        qt, kt, vt = (torch.randn(48, h, 16, requires_grad=True) for h in (4, 2, 2))  # packed [T, H, D]
        cu = torch.tensor([0, 20, 48], dtype=torch.int32)
        calls = {"rectangular": ((q, k, v), lambda: wt.attention(q, k, v, window=(7, 0))),
                 "varlen": ((qt, kt, vt), lambda: wt.attention_varlen(qt, kt, vt, cu, cu, 28, 28, window=(7, 0)))}
        ext = wt._ext
        for path in (["C++"] if ext is not None else []) + ["Python"]:
            for name, (inputs, call) in calls.items():
                wt._ext = ext if path == "C++" else None
                try:
                    o = call()
                    with Seen() as seen:
                        torch.autograd.grad(o, inputs, torch.ones_like(o))
                finally:
                    wt._ext = ext
                filled = [op for op in seen.ops if "zero" in op or "fill" in op]
                report(not filled and seen.ops.count("empty_like") == 3,
                       "torch %s path, %s: the backward fills no zero gradient (aten ops: %s)"
                       % (path, name, ", ".join(seen.ops)))

    run_torch_varlen(torch, wt)
    run_torch_cpp_path(torch, wt)

    if torch.cuda.is_available():
        q = torch.randn(1, 4, 70, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 2, 70, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 2, 70, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        o = wt.attention(q, k, v, window=(15, 0))
        o.sum().backward()
        oc = wt.attention(*(t.detach().cpu() for t in (q, k, v)), window=(15, 0))
        report((o.detach().cpu().float() - oc.float()).abs().max().item() < 3e-2, "torch CUDA tensors match CPU")

        # a batch of two through the tensor-core paths (D = 128: version 4, D = 512: version 5),
        # forward and gradients against the CPU kernels
        def cuda_against_cpu(d):
            g = torch.Generator().manual_seed(3)
            q, k, v, do = (torch.randn(2, h, 200, d, generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4))
            results = []
            for dev in ("cuda", "cpu"):
                qq, kk, vv = (t.to(dev).clone().requires_grad_() for t in (q, k, v))
                o = wt.attention(qq, kk, vv, window=(50, 0))
                o.backward(do.to(dev))
                results.append([t.detach().cpu().float() for t in (o, qq.grad, kk.grad, vv.grad)])
            errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results)]
            report(max(errs) < 3e-2, "torch CUDA B=2 D=%d GQA: o, dq, dk, dv match CPU" % d,
                   "max error relative to max |value| o/dq/dk/dv %s" % "/".join("%.1e" % e for e in errs))
            return q, k, v, do, results[1]

        cuda_against_cpu(512)
        q, k, v, do, cpu_results = cuda_against_cpu(128)

        # deterministic=True: the same gradients within rounding, and bit-identical run to run
        runs = []
        for _ in range(2):
            qq, kk, vv = (t.cuda().clone().requires_grad_() for t in (q, k, v))
            wt.attention(qq, kk, vv, window=(50, 0), deterministic=True).backward(do.cuda())
            runs.append([t.grad.detach().cpu().float() for t in (qq, kk, vv)])
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(runs[0], cpu_results[1:])]
        report(same and max(errs) < 3e-2, "torch CUDA deterministic=True: bit-identical twice, matches CPU",
               "identical %s, max error relative to max |value| dq/dk/dv %s" % (same, "/".join("%.1e" % e for e in errs)))

        # forward and backward captured in a CUDA graph (after eager calls, on a stream the library
        # has no context for yet: it is made inside the capture) and through
        # torch.compile(mode="reduce-overhead"): bit-identical to the eager call, then replayed on
        # new inputs
        qc, kc, vc = (t.cuda().clone().requires_grad_() for t in (q, k, v))
        doc = do.cuda()

        def step(qq, kk, vv):
            o = wt.attention(qq, kk, vv, window=(50, 0), deterministic=True)
            return [o.detach()] + list(torch.autograd.grad(o, (qq, kk, vv), doc))

        eager = step(qc, kc, vc)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(qc, kc, vc)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(qc, kc, vc)
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(captured, eager))
        with torch.no_grad():
            qc.copy_(torch.randn_like(qc))
        graph.replay()
        want = step(qc, kc, vc)
        torch.cuda.synchronize()
        report(same and all(torch.equal(a, b) for a, b in zip(captured, want)),
               "torch CUDA: forward + backward captured in a CUDA graph, bit-identical to eager, replayed on new q")
        f = torch.compile(lambda qq, kk, vv: wt.attention(qq, kk, vv, window=(50, 0), deterministic=True),
                          mode="reduce-overhead")
        for _ in range(3):  # reduce-overhead records its CUDA graphs after warm-up calls
            oc = f(qc, kc, vc)
            gc = torch.autograd.grad(oc, (qc, kc, vc), doc)
        report(all(torch.equal(a, b) for a, b in zip([oc.detach()] + list(gc), want)),
               "torch CUDA: torch.compile(mode=\"reduce-overhead\") forward + backward bit-identical to eager")
    else:
        skip("torch CUDA", "no CUDA device")


def run_torch_cpp_path(torch, wt):
    """The C++ eager path (winattn/_torch_ext.cpp, `make torch-ext`) against the Python one, which
    it replaces when built: the same kernels with the same arguments, so o, lse and the gradients
    must agree bit for bit, and errors must read the same."""
    if wt._ext is None:
        if os.environ.get("WINATTN_TORCH_EXT_REQUIRED"):  # tests/run_tests.sh built it: it must load
            report(False, "torch C++ path loads", "winattn.torch did not load the module built for torch %s"
                   % torch.__version__)
        else:
            skip("torch C++ path", "not built for torch %s (make torch-ext)" % torch.__version__)
        return
    ext = wt._ext

    def both(fn):
        """fn() through the C++ path, then through the Python path"""
        got = fn()
        wt._ext = None
        try:
            return got, fn()
        finally:
            wt._ext = ext

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    g = torch.Generator().manual_seed(5)

    def attention_and_grads(shapes, dtype, layout, window, softcap, deterministic, grad):
        (B, Hq, Hkv, Nq, Nk, D) = shapes
        q, k, v, do = (torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk),
                                                                                   (Hq, Nq)))
        if layout == "bnhd":  # [B, N, H, D] memory seen as [B, H, N, D]: strided, unit head-dim stride
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        elif layout == "d-strided":  # no unit head-dim stride: both paths copy it first
            q = q.transpose(2, 3).contiguous().transpose(2, 3)

        def run():
            qq, kk, vv = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
            o, lse = wt.attention(qq, kk, vv, window=window, softcap=softcap, return_lse=True,
                                  deterministic=deterministic)
            if not grad:
                return [o, lse]
            return [o, lse] + list(torch.autograd.grad(o, (qq, kk, vv), do))
        return run

    for shapes, dtype, layout, window, softcap, det, grad in [
            ((1, 4, 2, 70, 70, 32), torch.float32, "bhnd", (15, 0), 0.0, False, True),
            ((2, 8, 1, 33, 90, 64), torch.bfloat16, "bnhd", (-1, 0), 0.0, True, True),
            ((1, 2, 2, 64, 64, 16), torch.float16, "bhnd", (4, 4), 5.0, False, True),
            ((1, 4, 4, 40, 40, 128), torch.bfloat16, "d-strided", (-1, -1), 0.0, False, True),
            ((1, 4, 2, 50, 50, 32), torch.float32, "bhnd", (7, 0), 0.0, False, False)]:
        name = ("torch C++ path = Python path: B=%d Hq=%d Hkv=%d Nq=%d Nk=%d D=%d %s %s win=%s cap=%g det=%s %s"
                % (shapes + (str(dtype).replace("torch.", ""), layout, window, softcap, det,
                             "o, lse, dq, dk, dv" if grad else "o, lse without grad")))
        cpp, py = both(attention_and_grads(shapes, dtype, layout, window, softcap, det, grad))
        report(same(cpp, py), name)

    q, k, v = (torch.randn(1, h, 33, 16, requires_grad=True) for h in (4, 2, 2))
    o = wt.attention(q, k, v, window=(7, 0))
    report(type(o.grad_fn).__name__ == "CppFunction" and wt.eager_path() == "C++",
           "torch C++ path: attention() takes it (grad_fn %s, eager_path() %s)" % (type(o.grad_fn).__name__,
                                                                                   wt.eager_path()))

    def no_grad_call():
        with torch.no_grad():
            o = wt.attention(q, k, v, window=(7, 0))
        return [o, torch.tensor(o.grad_fn is None)]

    report(same(*both(no_grad_call)), "torch C++ path = Python path under no_grad: no graph, the same o")

    def some_grads(wanted):
        """only the inputs in `wanted` require gradients; o.sum()'s broadcast dO has stride 0"""
        def run():
            qq, kk, vv = (t.detach().clone().requires_grad_(n in wanted) for t, n in zip((q, k, v), "qkv"))
            o = wt.attention(qq, kk, vv, window=(7, 0))
            ins = [t for t, n in zip((qq, kk, vv), "qkv") if n in wanted]
            return [o] + list(torch.autograd.grad(o.sum(), ins))
        return run

    for wanted in ("k", "qv", "v"):
        report(same(*both(some_grads(wanted))), "torch C++ path = Python path: gradients of %s only, dO broadcast "
               "(stride 0)" % ", ".join(wanted))

    def penalty(loss_of, backward=False):
        """create_graph=True through attention (h = q w feeds it), then the gradient of |dL/dw|^2,
        by autograd.grad for w alone or by backward() into every leaf"""
        def run():
            w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
            o = wt.attention((q.detach() @ w).contiguous(), k.detach(), v.detach(), window=(7, 0))
            gw, = torch.autograd.grad(loss_of(o) + (w ** 2).sum(), w, create_graph=True)
            if backward:
                (gw * gw).sum().backward()
                return [w.grad]
            return [gw.detach()] + list(torch.autograd.grad((gw * gw).sum(), w))
        return run

    # once_differentiable's rules, which both paths follow: the backward's results are constants to a
    # second derivative that autograd.grad asks of w alone; backward() into every leaf, which
    # reaches the backward's own when its dO needs gradients (o * o), raises
    for name, loss_of in (("o.sum()", lambda o: o.sum()), ("(o * o).sum()", lambda o: (o * o).sum())):
        report(same(*both(penalty(loss_of))), "torch C++ path = Python path: create_graph=True through attention, "
               "loss %s, the second derivative for w alone" % name)
    for path in ("C++", "Python"):
        ext_now = wt._ext
        wt._ext = ext if path == "C++" else None
        try:
            penalty(lambda o: (o * o).sum(), backward=True)()
            report(False, "torch %s path: backward() through attention's backward raises" % path, "no error raised")
        except RuntimeError as e:
            report("not differentiable" in str(e) or "differentiate twice" in str(e),
                   "torch %s path: backward() through attention's backward raises" % path,
                   str(e).splitlines()[0][:90])
        finally:
            wt._ext = ext_now

    if winattn._lib.HAS_VARLEN:
        lq, lk = [9, 0, 20, 1, 33], [12, 3, 20, 1, 40]
        cu_q, cu_k = (torch.tensor([0] + list(np.cumsum(x)), dtype=torch.int32) for x in (lq, lk))
        qv, dov = (torch.randn(sum(lq), 4, 32, generator=g).bfloat16() for _ in range(2))
        kv, vv = (torch.randn(sum(lk), 2, 32, generator=g).bfloat16() for _ in range(2))

        def varlen():
            qq, kk, vvv = (t.clone().requires_grad_() for t in (qv, kv, vv))
            o, lse = wt.attention_varlen(qq, kk, vvv, cu_q, cu_k, max(lq), max(lk), window=(9, 0), return_lse=True)
            return [o, lse] + list(torch.autograd.grad(o, (qq, kk, vvv), dov))

        cpp, py = both(varlen)
        report(same(cpp, py), "torch C++ path = Python path: varlen bf16 GQA lens q %s k %s win=(9,0): o, lse, dq, dk, "
               "dv" % (lq, lk))

    @case("torch C++ path errors")
    def _():
        x64 = torch.zeros(1, 2, 8, 4, dtype=torch.float64)
        x3 = torch.zeros(2, 8, 4)
        mixed = torch.zeros(1, 1, 6, 1), torch.zeros(1, 1, 6, dtype=torch.bfloat16)
        cases = [("float64 input", lambda: wt.attention(x64, x64, x64), TypeError),
                 ("3-d q, k, v", lambda: wt.attention(x3, x3, x3), ValueError),
                 ("3-d k beside a 4-d q", lambda: wt.attention(mixed[0], mixed[1], mixed[1]), ValueError),
                 ("Hq % Hkv != 0 (the library's check)", lambda: wt.attention(
                     torch.zeros(1, 3, 8, 4), torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)), winattn.WinattnError)]
        if winattn._lib.HAS_VARLEN:
            cases.append(("varlen offsets past T (the library's check)", lambda: wt.attention_varlen(
                qv, kv, vv, cu_q + 1, cu_k, max(lq) + 1, max(lk)), winattn.WinattnError))

        def error_of(call):
            try:
                call()
                return "no error"
            except Exception as e:  # compared below
                return "%s: %s" % (type(e).__name__, e)

        for name, call, exc in cases:
            cpp, py = both(lambda: [error_of(call)])
            report(cpp == py and cpp[0].startswith(exc.__name__),
                   "torch C++ path = Python path, error: %s" % name, cpp[0][:100])

    @case("torch C++ path: a failing backward")
    def _():
        # the library's wa_backward replaced by one that fails as out of memory (status 7), on both
        # paths: the error reaches the caller of backward() as WinattnError with the same message
        import ctypes

        lib = winattn._lib.lib
        real = lib.wa_backward
        failing = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 11))(lambda *args: 7)
        names = ["wa_context_create", "wa_context_destroy", "wa_forward", "wa_backward", "wa_last_error"]
        names += ["wa_forward_varlen", "wa_backward_varlen"] if winattn._lib.HAS_VARLEN else []
        addresses = {n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names}

        def failing_backward():
            qq, kk, vv = (torch.randn(1, h, 20, 16, generator=g, requires_grad=True) for h in (2, 1, 1))
            o = wt.attention(qq, kk, vv, window=(5, 0))
            try:
                o.sum().backward()
                return ["no error"]
            except Exception as e:  # compared below
                return ["%s: %s" % (type(e).__name__, str(e).splitlines()[0])]

        try:
            ext.bind(dict(addresses, wa_backward=ctypes.cast(failing, ctypes.c_void_p).value), winattn.WinattnError,
                     winattn._lib.STATUS_NAMES)
            lib.wa_backward = failing
            cpp, py = both(failing_backward)
        finally:
            lib.wa_backward = real
            ext.bind(addresses, winattn.WinattnError, winattn._lib.STATUS_NAMES)
        report(cpp == py and cpp[0].startswith("WinattnError: winattn: out of memory"),
               "torch C++ path = Python path: a backward the library fails raises WinattnError", cpp[0][:80])

    @case("torch C++ path threads and release_workspace")
    def _():
        import threading

        q, k, v = (torch.randn(1, h, 300, 64, generator=g, requires_grad=True) for h in (4, 2, 2))
        want = [wt.attention(q, k, v, window=(31, 0))]
        want += list(torch.autograd.grad(want[0], (q, k, v), torch.ones_like(want[0])))
        results, errors = [], []

        def worker():
            try:
                for _ in range(20):
                    o = wt.attention(q, k, v, window=(31, 0))
                    results.append([o] + list(torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
                    wt.release_workspace()  # contexts dropped while other threads may be inside a call
            except Exception as e:  # reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report(not errors and len(results) == 80 and all(same(r, want) for r in results),
               "torch C++ path: 4 threads x 20 calls with release_workspace() between, all bit-identical",
               "; ".join(errors[:2]))


def run_torch_varlen(torch, wt):
    if not winattn._lib.HAS_VARLEN:
        skip("torch varlen", "this libwinattn has no wa_forward_varlen")
        return
    g = torch.Generator().manual_seed(11)

    def packed(lq, lk, Hq, Hkv, D, dtype, device="cpu"):
        cu_q, cu_k = (torch.tensor([0] + list(np.cumsum(x)), dtype=torch.int32, device=device) for x in (lq, lk))
        q, do = (torch.randn(sum(lq), Hq, D, generator=g).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(sum(lk), Hkv, D, generator=g).to(device, dtype) for _ in range(2))
        return q, k, v, do, cu_q, cu_k

    for dt, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)):
        for lq, lk, Hq, Hkv, D, window, softcap in (([5, 0, 1, 33, 17], [5, 0, 1, 33, 17], 4, 2, 32, (7, 0), 0.0),
                                                    ([0, 1, 40, 3], [4, 1, 70, 0], 8, 1, 16, (-1, 0), 5.0),
                                                    ([70, 2, 9], [30, 2, 9], 2, 2, 64, (50, 0), 0.0)):
            name = "torch varlen autograd %s Hq=%d Hkv=%d D=%d lens q %s k %s win=%s%s" % (
                str(dt).replace("torch.", ""), Hq, Hkv, D, lq, lk, window, " cap=5" if softcap else "")

            @case(name)
            def _():
                q, k, v, do, cu_q, cu_k = packed(lq, lk, Hq, Hkv, D, dt)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                o = wt.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), window=window, softcap=softcap)
                o.backward(do)
                ref = varlen_reference(*(t.detach().float().numpy() for t in (q, k, v, do)), cu_q.numpy(),
                                       cu_k.numpy(), window[0], window[1], D ** -0.5, softcap)
                got = (o, q.grad, k.grad, v.grad)
                errs = [np.abs(a.detach().double().numpy() - r).max(initial=0.0)
                        for a, r in zip(got, (ref[0],) + ref[2:])]
                tols = [tol, tol, tol * Hq / Hkv, tol * Hq / Hkv]
                report(all(e <= t for e, t in zip(errs, tols)), name + " vs the float64 reference per sequence",
                       "max err o/dq/dk/dv %s (tol %g)" % ("/".join("%.1e" % e for e in errs), tol))

    def small():
        q, k, v, do, cu_q, cu_k = packed([9, 0, 20, 1], [12, 3, 20, 1], 4, 2, 16, torch.float32)
        return [t.requires_grad_() for t in (q, k, v)] + [do, cu_q, cu_k]

    @case("torch varlen vs attention per sequence")
    def _():
        q, k, v, do, cu_q, cu_k = small()
        o = wt.attention_varlen(q, k, v, cu_q, cu_k, 20, 20, window=(5, 0))
        same = True
        for b in range(4):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            if qs.stop > qs.start and ks.stop > ks.start:
                r = wt.attention(*(t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))), window=(5, 0))
                same &= torch.equal(o[qs], r[0].transpose(0, 1))
            elif qs.stop > qs.start:
                same &= bool((o[qs] == 0).all())
        report(same, "torch varlen: each sequence bit-identical to winattn.torch.attention on it alone")

    @case("torch varlen opcheck")
    def _():
        q, k, v, do, cu_q, cu_k = small()
        torch.library.opcheck(torch.ops.winattn.forward_varlen.default, (q, k, v, cu_q, cu_k, 20, 20, 5, 0, 0.0, 0.0,
                                                                         False))
        o, lse = torch.ops.winattn.forward_varlen(q, k, v, cu_q, cu_k, 20, 20, 5, 0, 0.0, 0.0, False)
        torch.library.opcheck(torch.ops.winattn.backward_varlen.default,
                              (q.detach(), k.detach(), v.detach(), o.detach(), lse, do, cu_q, cu_k, 20, 20, 5, 0, 0.0,
                               0.0, False))
        report(True, "torch.library.opcheck: schema, fake tensor, autograd registration of winattn::forward_varlen "
               "and winattn::backward_varlen")

    @case("torch varlen compile")
    def _():
        q, k, v, do, cu_q, cu_k = small()
        f = torch.compile(lambda q, k, v, cu_q, cu_k, mq, mk: wt.attention_varlen(q, k, v, cu_q, cu_k, mq, mk,
                                                                                  window=(5, 0)),
                          backend="aot_eager", fullgraph=True, dynamic=True)
        o = f(q, k, v, cu_q, cu_k, 20, 20)
        o.backward(do)
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        o2 = wt.attention_varlen(q, k, v, cu_q, cu_k, 20, 20, window=(5, 0))
        o2.backward(do)
        report(torch.equal(o, o2) and all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v))),
               "torch.compile(fullgraph=True, dynamic=True, backend=aot_eager): winattn.torch.attention_varlen "
               "forward and backward, max_seqlen as traced ints")

    @case("torch varlen bad input")
    def _():
        q, k, v, do, cu_q, cu_k = small()
        for name, call, exc, text in [
            ("int64 offsets", lambda: wt.attention_varlen(q, k, v, cu_q.long(), cu_k, 20, 20), TypeError, "int32"),
            ("2-d offsets", lambda: wt.attention_varlen(q, k, v, cu_q[None], cu_k, 20, 20), ValueError, "1-d"),
            ("offsets of different B", lambda: wt.attention_varlen(q, k, v, cu_q[:-1], cu_k, 20, 20), ValueError,
             "B + 1"),
            ("max_seqlen as a tensor", lambda: wt.attention_varlen(q, k, v, cu_q, cu_k, torch.tensor(20), 20),
             TypeError, "Python int"),
            ("max_seqlen 2**40", lambda: wt.attention_varlen(q, k, v, cu_q, cu_k, 2 ** 40, 20), ValueError, "outside"),
            ("q 4-d", lambda: wt.attention_varlen(q[None], k, v, cu_q, cu_k, 20, 20), ValueError, "3-d"),
            ("offsets past T (checked by the library on the CPU)",
             lambda: wt.attention_varlen(q, k, v, cu_q + 1, cu_k, 21, 20), winattn.WinattnError, "cu_seqlens_q"),
            ("max_seqlen below the longest (CPU)", lambda: wt.attention_varlen(q, k, v, cu_q, cu_k, 19, 20),
             winattn.WinattnError, "maximum"),
        ]:
            expect_error("torch varlen bad input: %s" % name, call, exc, text)

    if not torch.cuda.is_available():
        skip("torch varlen CUDA", "no CUDA device")
        return

    @case("torch varlen CUDA")
    def _():
        q, k, v, do, cu_q, cu_k = packed([300, 0, 1, 77, 128], [300, 5, 1, 200, 128], 8, 2, 128, torch.bfloat16)
        results = []
        try:
            for dev in ("cuda", "cpu"):
                qq, kk, vv = (t.to(dev).clone().requires_grad_() for t in (q, k, v))
                o = wt.attention_varlen(qq, kk, vv, cu_q.to(dev), cu_k.to(dev), 300, 300, window=(63, 0))
                o.backward(do.to(dev))
                results.append([t.detach().cpu().float() for t in (o, qq.grad, kk.grad, vv.grad)])
        except winattn.WinattnError as e:
            if "unsupported" in str(e):
                skip("torch varlen CUDA", str(e))
                return
            raise
        errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results)]
        report(max(errs) < 3e-2, "torch varlen CUDA bf16 D=128 GQA: o, dq, dk, dv match CPU",
               "max error relative to max |value| o/dq/dk/dv %s" % "/".join("%.1e" % e for e in errs))

        # captured into a CUDA graph and replayed on new inputs: nothing may read the offsets back
        qc, kc, vc, cq, ck = (t.cuda() for t in (q, k, v, cu_q, cu_k))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            wt.attention_varlen(qc, kc, vc, cq, ck, 300, 300, window=(63, 0))  # the context, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = wt.attention_varlen(qc, kc, vc, cq, ck, 300, 300, window=(63, 0))
        qc.copy_(torch.randn_like(qc))
        graph.replay()
        torch.cuda.synchronize()
        want = wt.attention_varlen(qc, kc, vc, cq, ck, 300, 300, window=(63, 0))
        report(torch.equal(out, want), "torch varlen CUDA: captured into a CUDA graph, replayed on new q")


def run_empty():
    """Zero-size arrays, as include/winattn.h documents them for the C API: no keys (Nk = 0) gives
    o = 0, lse = -inf and zero gradients; no queries, no batch or no sequences give empty results.
    numpy gives such arrays all-zero strides, which once failed as "head-dim stride is 0"."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 4, 5, 16), dtype=np.float32)
    do = rng.standard_normal((1, 4, 5, 16), dtype=np.float32)
    k0 = np.empty((1, 2, 0, 16), np.float32)
    k = rng.standard_normal((1, 2, 7, 16), dtype=np.float32)

    @case("numpy Nk = 0")
    def _():
        o, lse = winattn.attention(q, k0, k0, window=(3, 0), return_lse=True)
        dq, dk, dv = winattn.attention_backward(q, k0, k0, o, lse, do, window=(3, 0))
        ok = (not o.any() and np.all(np.isneginf(lse)) and not dq.any() and dk.shape == k0.shape
              and dv.shape == k0.shape)
        report(ok, "numpy Nk = 0: o = 0, lse = -inf, dq = 0, empty dk and dv")

    @case("numpy Nq = 0, B = 0")
    def _():
        q0 = np.empty((1, 4, 0, 16), np.float32)
        o, lse = winattn.attention(q0, k, k, return_lse=True)
        dq, dk, dv = winattn.attention_backward(q0, k, k, o, lse, np.empty_like(q0))
        b0 = winattn.attention(np.empty((0, 4, 5, 16), np.float32), np.empty((0, 2, 5, 16), np.float32),
                               np.empty((0, 2, 5, 16), np.float32))
        report(o.shape == q0.shape and lse.shape == (1, 4, 0) and not dk.any() and not dv.any()
               and b0.shape == (0, 4, 5, 16), "numpy Nq = 0 (dk = dv = 0) and B = 0: empty results")

    @case("numpy varlen with no tokens")
    def _():
        cu = np.array([0, 0, 0], np.int32)
        o = winattn.attention_varlen(np.empty((0, 4, 16), np.float32), np.empty((0, 2, 16), np.float32),
                                     np.empty((0, 2, 16), np.float32), cu, cu)
        report(o.shape == (0, 4, 16), "numpy varlen: two sequences of length 0")

    expect_error("numpy head dim 0", lambda: winattn.attention(np.empty((1, 4, 5, 0), np.float32),
                                                               np.empty((1, 2, 5, 0), np.float32),
                                                               np.empty((1, 2, 5, 0), np.float32)),
                 winattn.WinattnError, "head dim D = 0")
    try:
        import torch
        import winattn.torch as wt
    except ImportError as e:
        skip("torch zero-size", "PyTorch is not installed (%s)" % e)
        return

    @case("torch Nk = 0")
    def _():
        tq = torch.from_numpy(q).requires_grad_()
        tk = torch.empty((1, 2, 0, 16), requires_grad=True)
        tv = torch.empty((1, 2, 0, 16), requires_grad=True)
        o = wt.attention(tq, tk, tv, window=(3, 0))
        o.backward(torch.from_numpy(do))
        report(not o.any() and not tq.grad.any() and tk.grad.shape == tk.shape,
               "torch Nk = 0 through autograd: o = 0, dq = 0, empty dk")


if __name__ == "__main__":
    print("winattn %s" % winattn.version())
    run_numpy_grid()
    run_varlen_grid()
    run_empty()
    run_torch()
    finish()
