"""test_f32_accuracy.py — winattn's CPU float32 against PyTorch's float32, both measured against a
float64 oracle, with FlashAttention's criterion (docs/algorithm.md section 5). One line per case
and tensor (PASS|FAIL), closing "N passed, N failed"; exit 1 on failure. SKIP without torch.
Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_f32_accuracy.py

For each case: float32 q, k, v, do drawn from N(0, 1) with a fixed seed; the oracle is PyTorch
autograd in float64 on the upcast inputs; the baseline is the same math in float32, eagerly, one
op after another over whole tensors (the KV heads expanded to the query heads, so autograd sums
dk and dv over the group, as a framework's GQA does); winattn runs through the numpy binding on
the CPU. Per tensor (o, dq, dk, dv), with err = max|x - oracle| and
atol = 2 max|fl32(oracle + 0.3) - 0.3 - oracle|: pass when err_winattn <= 2 err_torch + atol; a
gradient between 2x and 3x passes under FlashAttention-2's gradient bound and says so; above
fails. bench/f32_accuracy.py runs the same comparison over larger shapes.
"""
import math
import os
import sys
import time

import winattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish, report, skip  # noqa: E402

try:
    import torch
except ImportError as e:
    torch, torch_missing = None, e

TENSORS = ("o", "dq", "dk", "dv")

# name, Hq, Hkv, N, D, (left, right), softcap, scale (None = 1/sqrt(D)); Nq = Nk = N
CASES = [
    ("GQA 16:1, the long-sum case", 16, 1, 513, 256, (499, 0), 0.0, None),
    ("GQA 32:1", 32, 1, 600, 64, (511, 0), 0.0, None),
    ("GQA 4:1", 8, 2, 1024, 128, (255, 0), 0.0, None),
    ("MHA causal", 4, 4, 1024, 64, (-1, 0), 0.0, None),
    ("long causal rows", 2, 1, 4096, 32, (-1, 0), 0.0, None),
    ("rows of 1000 keys, softcap 2", 2, 2, 1200, 64, (999, 0), 2.0, None),
    ("rows of 1000 flat keys, softcap 2, scale 0.02", 2, 2, 1200, 64, (999, 0), 2.0, 0.02),
    ("full rows of 8192 keys", 1, 1, 8192, 16, (-1, -1), 0.0, None),
]


def visible(rows, Nq, Nk, left, right):
    """[len(rows), Nk] bool on rows' device: key j visible from query row i iff
    i' - left <= j <= i' + right with i' = i + Nk - Nq (bottom-right aligned), -1 = unbounded on
    that side; None when all are"""
    if left < 0 and right < 0:
        return None
    i = rows[:, None] + (Nk - Nq)
    j = torch.arange(Nk, device=rows.device)[None, :]
    m = torch.ones(len(rows), Nk, dtype=torch.bool, device=rows.device)
    if left >= 0:
        m &= j >= i - left
    if right >= 0:
        m &= j <= i + right
    return m


def attend(q, k, v, rows, Nq, left, right, scale, softcap):
    """o for query rows `rows` (q holds just those rows), the plain math in q's dtype: scores,
    softcap c tanh(s / c), mask, softmax, P V; the KV heads expanded to the query heads."""
    B, Hq, _, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    kk = k[:, :, None].expand(B, Hkv, rep, Nk, D).reshape(B, Hq, Nk, D)
    vv = v[:, :, None].expand(B, Hkv, rep, Nk, D).reshape(B, Hq, Nk, D)
    s = (q @ kk.transpose(-2, -1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    m = visible(rows, Nq, Nk, left, right)
    if m is not None:
        s = s.masked_fill(~m, -math.inf)
    return torch.softmax(s, dim=-1) @ vv


def run_torch(q, k, v, do, window, scale, softcap, dtype, rows_per_chunk=None):
    """(o, dq, dk, dv) in dtype through autograd. rows_per_chunk splits the query rows (the
    oracle's memory; its float64 sums do not care); None: all rows in one graph."""
    Nq = q.shape[2]
    q, k, v, do = (t.detach().to(dtype) for t in (q, k, v, do))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    step = rows_per_chunk or Nq
    outs = []
    for r0 in range(0, Nq, step):
        rows = torch.arange(r0, min(Nq, r0 + step), device=q.device)
        o = attend(q[:, :, r0:r0 + len(rows)], k, v, rows, Nq, window[0], window[1], scale, softcap)
        o.backward(do[:, :, r0:r0 + len(rows)])
        outs.append(o.detach())
    return torch.cat(outs, dim=2), q.grad, k.grad, v.grad


def run_winattn(q, k, v, do, window, scale, softcap):
    """(o, dq, dk, dv) from winattn's float32 kernels: CPU tensors through the numpy binding,
    CUDA tensors through the torch binding (its autograd, deterministic dQ)"""
    if q.is_cuda:
        import winattn.torch as wt
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = wt.attention(q, k, v, window=window, scale=scale, softcap=softcap, deterministic=True)
        o.backward(do)
        return o.detach(), q.grad, k.grad, v.grad
    q, k, v, do = (t.numpy() for t in (q, k, v, do))
    o, lse = winattn.attention(q, k, v, window=window, scale=scale, softcap=softcap, return_lse=True)
    dq, dk, dv = winattn.attention_backward(q, k, v, o, lse, do, window=window, scale=scale, softcap=softcap)
    return tuple(torch.from_numpy(x) for x in (o, dq, dk, dv))


def rounding_atol(ref):
    """2 max|fl32(ref + 0.3) - 0.3 - ref| (src/ref/case.c: wa_rounding_atol)"""
    return 2 * ((ref + 0.3).float().double() - 0.3 - ref).abs().max().item()


def max_err(x, ref):
    return (x.double() - ref).abs().max().item()


def compare(Hq, Hkv, Nq, Nk, D, window, softcap=0.0, scale=None, seed=0, oracle_rows=None, device="cpu"):
    """float32 inputs drawn with `seed` (on the CPU, then moved to `device`, where all three
    computations run); returns {tensor: (winattn err, torch err, atol)} and the seconds each of
    oracle, torch f32 and winattn took"""
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, H, N, D, generator=g, dtype=torch.float32).to(device)
                   for H, N in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk), (Hq, Nq)))
    if oracle_rows is None:  # about 32M float64 scores per chunk
        oracle_rows = max(1, (1 << 25) // (Hq * Nk))
    t0 = time.perf_counter()
    ref = run_torch(q, k, v, do, window, scale, softcap, torch.float64, oracle_rows)
    t1 = time.perf_counter()
    pt = run_torch(q, k, v, do, window, scale, softcap, torch.float32)
    t2 = time.perf_counter()
    wa = run_winattn(q, k, v, do, window, scale, softcap)
    t3 = time.perf_counter()
    errs = {name: (max_err(a, r), max_err(b, r), rounding_atol(r)) for name, a, b, r in zip(TENSORS, wa, pt, ref)}
    return errs, (t1 - t0, t2 - t1, t3 - t2)


def ieee_f32_products():
    """PyTorch's CUDA float32 products in full float32, not TF32 (the yardstick is float32)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def verdict(name, wa, pt, atol):
    """'pass', 'pass at 3x' (gradients only) or 'FAIL' under FlashAttention's criterion"""
    if wa <= 2 * pt + atol:
        return "pass"
    if name != "o" and wa <= 3 * pt + atol:
        return "pass at 3x"
    return "FAIL"


def main():
    print("winattn %s" % winattn.version())
    if torch is None:
        skip("f32 accuracy against PyTorch", "PyTorch is not installed (%s)" % torch_missing)
        finish()
    start = time.perf_counter()
    for seed, (title, Hq, Hkv, N, D, window, softcap, scale) in enumerate(CASES):
        errs, secs = compare(Hq, Hkv, N, N, D, window, softcap, scale, seed=seed)
        label = "f32 vs torch f32: %s (Hq=%d Hkv=%d N=%d D=%d win=(%d,%d)%s%s)" % (
            title, Hq, Hkv, N, D, window[0], window[1], " cap=%g" % softcap if softcap else "",
            " scale=%g" % scale if scale else "")
        for name in TENSORS:
            wa, pt, atol = errs[name]
            v = verdict(name, wa, pt, atol)
            report(v != "FAIL", "%s %s" % (label, name), "winattn %.2e torch %.2e ratio %.2f atol %.1e%s" % (
                wa, pt, wa / pt if pt else math.inf, atol, " (needs FlashAttention-2's 3x gradient bound)"
                if v == "pass at 3x" else ""))
        print("   (%.1f s: oracle %.1f, torch f32 %.1f, winattn %.1f)" % ((sum(secs),) + secs), flush=True)
    print("%.0f s in all" % (time.perf_counter() - start))
    finish()


if __name__ == "__main__":
    main()
