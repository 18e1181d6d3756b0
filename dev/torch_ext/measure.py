#!/usr/bin/env python3
"""measure.py — what the Python layer of winattn.torch costs per call, against the same forward and
backward as a C++ autograd function (attention_ext.cpp, a lab prototype). Builds the extension with
the C++ compiler and this Python's torch (C++20, as torch 2.15's headers need; about 35 s; with
CUDA where torch has it and CUDA_HOME's headers are found), checks that o, dq, dk, dv match
winattn.torch.attention bit for bit, then times a forward + backward through:
winattn.torch.attention (the eager path), the extension, and the C library with ready arguments
(bench/binding_overhead.py's row: the library's own host work, and on the CPU the kernels).
  --device cpu (default): 1x2x16x64 bf16, window (7, 0), one thread; the fastest of seven batches;
  --device cuda: binding_overhead.py's shape (1x2x128x64, window (63, 0)) and host timing (each call
             timed on the host, the GPU drained every ten calls), microseconds of host time.
From the repository root after `make lib`, with torch installed:
    python3 dev/torch_ext/measure.py [--device cpu|cuda] [--calls N]
"""
import argparse
import os
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "build", "torch_ext")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

import torch  # noqa: E402
from torch.utils.cpp_extension import include_paths, library_paths  # noqa: E402


def build():
    """compile attention_ext.cpp into build/torch_ext (the library found there by its soname)"""
    os.makedirs(OUT, exist_ok=True)
    soname = os.path.join(OUT, "libwinattn.so.0")
    if not os.path.lexists(soname):
        os.symlink(os.path.join("..", "libwinattn.so"), soname)
    target = os.path.join(OUT, "attention_ext" + sysconfig.get_config_var("EXT_SUFFIX"))
    torch_lib = library_paths()[0]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cuda = torch.version.cuda is not None and os.path.exists(os.path.join(cuda_home, "include", "cuda_runtime_api.h"))
    cmd = (["c++", "-O2", "-shared", "-fPIC", "-std=c++20", "-DTORCH_EXTENSION_NAME=attention_ext",
            "-I" + os.path.join(ROOT, "include"), "-I" + sysconfig.get_paths()["include"]] +
           ["-I" + p for p in include_paths()] +
           (["-DWA_EXT_CUDA", "-I" + os.path.join(cuda_home, "include")] if cuda else []) +
           [os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_ext.cpp"), "-o", target,
            "-L" + torch_lib, "-ltorch", "-ltorch_cpu", "-lc10", "-ltorch_python"] +
           (["-ltorch_cuda", "-lc10_cuda"] if cuda else []) +
           ["-Wl,-rpath," + torch_lib, "-L" + OUT, "-l:libwinattn.so.0", "-Wl,-rpath,$ORIGIN"])
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("measure.py: the extension did not build:\n" + "\n".join(r.stderr.splitlines()[-15:]))
    print("built %s in %.0f s%s" % (os.path.relpath(target, ROOT), time.perf_counter() - t, " (with CUDA)" if cuda else ""))
    sys.path.insert(0, OUT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--calls", type=int, default=None, help="timed calls (2000 a batch on the CPU, 200 on CUDA)")
    a = ap.parse_args()
    if a.calls is not None and a.calls < 1:
        sys.exit("measure.py: --calls must be at least 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("measure.py: --device cuda needs a CUDA device, and torch sees none")
    if not os.path.exists(os.path.join(ROOT, "build", "libwinattn.so")):
        sys.exit("measure.py: build/libwinattn.so not found; run `make lib` first")
    build()
    import attention_ext
    import winattn.torch as wt
    from binding_overhead import best_us, c_library_step, cuda_inputs, host_us

    if a.device == "cuda":
        q, k, v, do = cuda_inputs()
        win, scale = (63, 0), 64 ** -0.5
        calls = a.calls or 200
    else:
        torch.set_num_threads(1)  # the Python path's CPU context then has one thread, as the extension's
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 16, 64, generator=g).bfloat16().requires_grad_() for h in (2, 1, 1))
        do = torch.randn(1, 2, 16, 64, generator=g).bfloat16()
        win, scale = (7, 0), 64 ** -0.5
        calls = a.calls or 2000

    def eager():
        o = wt.attention(q, k, v, window=win, scale=scale, deterministic=True)
        return [o.detach()] + list(torch.autograd.grad(o, (q, k, v), do))

    def ext():
        o = attention_ext.attention(q, k, v, win[0], win[1], scale, 0.0)
        return [o.detach()] + list(torch.autograd.grad(o, (q, k, v), do))

    same = all(torch.equal(x, y) for x, y in zip(eager(), ext()))
    print("o, dq, dk, dv of the extension and winattn.torch.attention (%s): %s"
          % (a.device, "bit-identical" if same else "DIFFERENT"))
    rows = [("winattn.torch.attention (eager path)", eager), ("the C++ autograd function", ext),
            ("the C library, arguments ready", c_library_step(q, k, v, do, win, scale))]
    print("| path | us per forward + backward%s |\n|---|---|" % (" (host)" if a.device == "cuda" else ""))
    for name, step in rows:
        us = host_us(step, calls) if a.device == "cuda" else best_us(step, calls, batches=7, warmup=100)
        print("| %s | %.1f |" % (name, us), flush=True)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
