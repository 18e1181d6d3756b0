#!/usr/bin/env python3
"""binding_overhead.py — the host-side cost of winattn.torch.attention, forward and backward, on
shapes so small that the kernels cost next to nothing. Run from the repository root after
`make lib`:
    python3 bench/binding_overhead.py [--calls 200]                     # CPU tensors
    python3 bench/binding_overhead.py --device cuda [--calls 50] [--peers-dir /tmp/winattn-peers]
Needs torch.

CPU: the time of a forward + backward (the fastest of five batches) through autograd on winattn's
eager path (the C++ one when `make torch-ext` built it, and then the Python one beside it) and on
its ops, through the C library with ready arguments (the kernels and the library's own host work:
what the rows above pay beyond it is the binding's), through SDPA, and for one multiply through
autograd (the least any op pays there).

CUDA (1x2x128x64 bf16, window (63, 0)): per forward + backward, in microseconds,
  host      the wall time of the calls alone: each call timed on the host, the GPU drained between
            batches so that a full launch queue never blocks a call; for winattn through autograd
            (attention + torch.autograd.grad: the eager path, C++ and Python autograd functions
            calling the library), through autograd on the ops (torch.ops.winattn.forward, what torch.compile
            traces), through the custom ops directly (no autograd), and
            through the C library's wa_forward / wa_backward called with ready arguments (the
            library's own host path: checks, tensor maps, launches);
  gpu       the kernels alone: the same forward + backward captured in a CUDA graph, replayed,
            timed with CUDA events;
  excess    host minus gpu: what a step pays beyond the kernels when the host cannot run ahead;
the same for SDPA's flash backend, (with --peers-dir) FlashAttention 4, and one multiply through
autograd (`q * 2`: one native op and one kernel each way, the least any op pays there), as
references. Then two checks, each printed as identical or not: the forward + backward captured in a CUDA graph and
replayed gives the eager call's o, dq, dk, dv bit for bit (deterministic=True), and so does
torch.compile(mode="reduce-overhead") of a function calling winattn.torch.attention (each capture
in a process of its own; exit status 1 if either check fails). --profile adds a cProfile of the
autograd path.
docs/gpu-peers.md and docs/cuda.md quote its results."""
import argparse
import ctypes
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

import torch  # noqa: E402
import winattn.torch as wt  # noqa: E402


def cpu(calls):
    """per forward + backward on CPU tensors (the kernels take a few microseconds at this size):
    the fastest of five batches of `calls`, for the eager path, the ops' path and SDPA"""
    torch.set_num_threads(1)  # the kernels on one thread: no pool wake-ups in the figures
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    print("binding overhead (CPU, 1x2x16x64 bf16, window (7, 0), best of 5 x %d calls): us per forward + backward"
          % calls)
    win, scale = (7, 0), 64 ** -0.5
    paths = autograd_steps(q, k, v, do, win, scale, cuda=False)
    paths.insert(len(paths) - 2, ("winattn, C library (the kernels)", c_library_step(q, k, v, do, win, scale)))
    for name, step in paths:
        print("  %-40s %6.1f" % (name, best_us(step, calls)))


def best_us(step, calls, batches=5, warmup=20):
    """microseconds per step() on the host: the fastest of `batches` batches of `calls` calls, after
    `warmup` calls (for steps whose work ends with the call: CPU tensors)"""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def c_library_step(q, k, v, do, win, scale):
    """a forward + backward through the C library's wa_forward / wa_backward with ready arguments:
    tensors, descriptor and context made once (the library's own host path: checks, tensor maps,
    launches, and on the CPU the kernels)"""
    from winattn import _lib

    o0, lse0 = torch.ops.winattn.forward(q, k, v, win[0], win[1], scale, 0.0, True)
    grads0 = [torch.empty_like(x) for x in (q, k, v)]
    ta = wt._backward_args(q, k, v, o0, lse0, do, *grads0)
    refs = [ctypes.byref(x) for x in ta]
    d = ctypes.byref(wt._desc(win[0], win[1], scale, 0.0))
    ctx = wt._context_for(q, True)

    # the structs hold only the addresses of o0, lse0 and the gradients: the step keeps them alive
    def c_step(_buffers=(o0, lse0, grads0)):
        ctx.call(_lib.lib.wa_forward, d, refs[0], refs[1], refs[2], refs[3], refs[4])
        ctx.call(_lib.lib.wa_backward, d, *refs)

    return c_step


def autograd_steps(q, k, v, do, win, scale, cuda):
    """a forward + backward through autograd: [(name, step)] for winattn's eager path (what
    attention() takes outside torch.compile), its ops (what torch.compile traces) and SDPA"""

    def eager_step():
        o = wt.attention(q, k, v, window=win, deterministic=True)
        return torch.autograd.grad(o, (q, k, v), do)

    def ops_autograd_step():
        o, lse = torch.ops.winattn.forward(q, k, v, win[0], win[1], scale, 0.0, True)
        return torch.autograd.grad(o, (q, k, v), do)

    def sdpa_step():
        o = sdpa_flash(q, k, v) if cuda else torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(o, (q, k, v), do)

    def python_path_step():  # the Python eager path even where the C++ one is built
        ext, wt._ext = wt._ext, None
        try:
            return eager_step()
        finally:
            wt._ext = ext

    def floor_step():  # the least any op pays through autograd: one native op, one kernel each way
        return torch.autograd.grad(q * 2.0, (q,), do)

    rows = [("winattn, autograd (%s path)" % wt.eager_path(), eager_step)]
    if wt.eager_path() != "Python":
        rows.append(("winattn, autograd (Python path)", python_path_step))
    return rows + [("winattn, autograd through the ops", ops_autograd_step),
                   ("torch: q * 2 through autograd (the floor)", floor_step),
                   ("sdpa flash (causal)" if cuda else "sdpa (causal)", sdpa_step)]


def host_us(step, calls, batch=10):
    """mean host time of step() in microseconds: timed call by call, the GPU drained every `batch`
    calls (a call that finds the launch queue full would wait for the GPU)"""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    total, done = 0.0, 0
    while done < calls:
        for _ in range(min(batch, calls - done)):
            t = time.perf_counter()
            step()
            total += time.perf_counter() - t
            done += 1
        torch.cuda.synchronize()
    return total / calls * 1e6


def gpu_us(step, reps=50):
    """the kernels of step() alone: captured in a CUDA graph (warmed up on a side stream first, as
    PyTorch's documentation does it), replayed, timed with CUDA events"""
    g = capture(step)
    for _ in range(5):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def capture(step, mode="global"):
    """step() captured in a CUDA graph, after three warm-up calls on a side stream; mode: the
    capture_error_mode (global: any unsafe CUDA call in any thread invalidates the capture)"""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        step()
    torch.cuda.synchronize()
    return g


def error_line(text):
    """the exception's own line of a child's output (not the generic hints CUDA errors add)"""
    lines = [t.strip() for t in text.strip().splitlines() if "Error:" in t or "error:" in t]
    return lines[-1] if lines else (text.strip().splitlines() or ["no output"])[-1]


def cuda_inputs():
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 2, 128, 64, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(1, 1, 128, 64, device=dev, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(1, 1, 128, 64, device=dev, dtype=dt, generator=g).requires_grad_()
    do = torch.randn(1, 2, 128, 64, device=dev, dtype=dt, generator=g)
    return q, k, v, do


WIN, SCALE = (63, 0), 64 ** -0.5


def sdpa_flash(q, k, v):
    """the reference: SDPA's flash backend, causal (no window)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def steps(q, k, v, do, peers_dir, with_c_library=True):
    """the timed paths, each a forward + backward: [(name, step, whether its kernels can be captured
    in a CUDA graph)]; the C-library row's context is bound to the stream it was made on, so that
    row takes the custom ops' kernel time (the same kernels)"""
    win, scale = WIN, SCALE
    *winattn_rows, floor_row, sdpa_row = autograd_steps(q, k, v, do, win, scale, cuda=True)

    def ops_step():
        o, lse = torch.ops.winattn.forward(q, k, v, win[0], win[1], scale, 0.0, True)
        return torch.ops.winattn.backward(q, k, v, o, lse, do, win[0], win[1], scale, 0.0, True)

    out = [(name, step, True) for name, step in winattn_rows] + [("winattn, custom ops", ops_step, True)]
    if with_c_library:
        out.append(("winattn, C library", c_library_step(q, k, v, do, win, scale), False))
    out += [sdpa_row + (True,), floor_row + (True,)]
    if peers_dir:
        from peer_wheels import add_to_path

        add_to_path(peers_dir, "binding_overhead")
        from flash_attn.cute import flash_attn_func

        qb, kb, vb = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dob = do.transpose(1, 2).contiguous()

        def fa4_step():
            r = flash_attn_func(qb, kb, vb, window_size=(win[0], win[1]), deterministic=True)
            o = r[0] if isinstance(r, tuple) else r
            return torch.autograd.grad(o, (qb, kb, vb), dob)

        out.append(("flash-attn-4", fa4_step, True))
    return out


def check(which, mode, system="winattn"):
    """one capture check in this process: o, dq, dk, dv of the captured / compiled forward +
    backward against the eager call's, bit for bit. which: graph (the capture first, in this fresh
    process, as PyTorch documents it: warm-up on a side stream), graph-after-eager (an eager call on
    the default stream first), compile"""
    q, k, v, do = cuda_inputs()

    def attn(q, k, v):
        return sdpa_flash(q, k, v) if system == "sdpa" else wt.attention(q, k, v, window=WIN, deterministic=True)

    def eager():
        o = attn(q, k, v)
        return [o.detach()] + list(torch.autograd.grad(o, (q, k, v), do))

    if which == "graph-after-eager":
        eager()
        which = "graph"
    if which == "graph":
        out = {}

        def step():
            o = attn(q, k, v)
            out["x"] = [o.detach()] + list(torch.autograd.grad(o, (q, k, v), do))

        g = capture(step, mode)
        for x in out["x"]:
            x.zero_()
        g.replay()
        torch.cuda.synchronize()
        got, what = out["x"], "captured in a CUDA graph (torch.cuda.graph, capture_error_mode=%s) and replayed" % mode
        want = eager()
    else:
        want = eager()
        f = torch.compile(lambda q, k, v: wt.attention(q, k, v, window=WIN, deterministic=True), mode="reduce-overhead")
        for _ in range(3):  # reduce-overhead records its CUDA graphs after warm-up calls
            oc = f(q, k, v)
            gc = torch.autograd.grad(oc, (q, k, v), do)
        got, what = [oc.detach()] + list(gc), 'through torch.compile(mode="reduce-overhead")'
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    print("forward + backward %s: %s to the eager call (o, dq, dk, dv)" % (what, "bit-identical" if same else "DIFFERENT"))
    return same


def cuda(calls, peers_dir, profile):
    import subprocess

    q, k, v, do = cuda_inputs()
    systems = steps(q, k, v, do, peers_dir)
    print("binding overhead (CUDA %s, 1x2x128x64 bf16, window (63, 0), %d calls): us per forward + backward"
          % (torch.cuda.get_device_name(), calls))
    print("| path | host | gpu (graph replay) | excess | note |\n|---|---|---|---|---|")
    kernels = None
    for name, step, capturable in systems:
        try:
            h = host_us(step, calls)
        except Exception as e:  # a reference that cannot run says why
            print("| %s | - | - | - | %s |" % (name, str(e).strip().splitlines()[0][:90]), flush=True)
            continue
        note, gk = "", None
        if capturable:
            # each capture in its own process: a failed capture can leave the next one failing
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", "cuda", "--kernel-time",
                                name] + (["--peers-dir", peers_dir] if peers_dir else []), capture_output=True, text=True)
            try:
                gk = float(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                note = "capture failed: " + error_line(r.stderr + r.stdout)[:120]
            if name == "winattn, custom ops" and gk is not None:
                kernels = gk
        else:
            gk, note = kernels, "kernel time of the custom ops row"
        print("| %s | %.1f | %s | %s | %s |" % (name, h, "%.1f" % gk if gk is not None else "-",
                                               "%.1f" % (h - gk) if gk is not None else "-", note.replace("|", "/")),
              flush=True)
    ok = True
    for which, system in (("graph", "winattn"), ("compile", "winattn"), ("graph-after-eager", "winattn"),
                          ("graph-after-eager", "sdpa")):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", "cuda", "--check", which,
                            "--check-system", system], capture_output=True, text=True)
        lines = r.stdout.strip().splitlines()
        if r.returncode == 0 and lines:
            print("%s, %s: %s" % (system, which, lines[-1]))
        else:
            print("%s, %s: FAILED: %s" % (system, which, error_line(r.stderr + r.stdout)[:240]))
            ok = ok and which == "graph-after-eager"  # a diagnostic: not held against the binding
    if profile:
        profile_steps(systems[0][1])
    return ok


def profile_steps(step, calls=200):
    """cProfile of `calls` calls of step() after a warm-up, the functions by own time"""
    import cProfile
    import pstats

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        step()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


def kernel_time(name, peers_dir):
    """--kernel-time NAME (a child process of cuda()): that row's graph-replay time alone"""
    q, k, v, do = cuda_inputs()
    found = [step for n, step, capturable in steps(q, k, v, do, peers_dir, with_c_library=False) if n == name and capturable]
    if not found:
        sys.exit("binding_overhead: --kernel-time %r: no such capturable path" % name)
    print("%.3f" % gpu_us(found[0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--calls", type=int, default=None, help="timed calls (200 on the CPU, 50 on CUDA)")
    ap.add_argument("--peers-dir", help="where bench/peer_wheels.py installed flash-attn-4 (CUDA only)")
    ap.add_argument("--profile", action="store_true", help="CUDA: cProfile of 200 autograd steps, by own time")
    ap.add_argument("--profile-only", action="store_true", help="CUDA: that profile alone, without the table and checks")
    ap.add_argument("--check", choices=["graph", "graph-after-eager", "compile"], help=argparse.SUPPRESS)
    ap.add_argument("--check-system", choices=["winattn", "sdpa"], default="winattn", help=argparse.SUPPRESS)
    ap.add_argument("--kernel-time", help=argparse.SUPPRESS)  # one row's graph replay, in a child process
    ap.add_argument("--capture-mode", default="global", help=argparse.SUPPRESS)
    a = ap.parse_args()
    calls = a.calls if a.calls is not None else (200 if a.device == "cpu" else 50)
    if calls < 1:
        sys.exit("binding_overhead: --calls must be at least 1")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("binding_overhead: --device cuda needs a CUDA device, and torch sees none")
        if a.check:
            sys.exit(0 if check(a.check, a.capture_mode, a.check_system) else 1)
        if a.kernel_time:
            kernel_time(a.kernel_time, a.peers_dir)
            return
        if a.profile_only:
            q, k, v, do = cuda_inputs()
            profile_steps(autograd_steps(q, k, v, do, WIN, SCALE, cuda=True)[0][1])
            return
        sys.exit(0 if cuda(calls, a.peers_dir, a.profile) else 1)
    cpu(calls)


if __name__ == "__main__":
    main()
