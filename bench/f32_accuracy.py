#!/usr/bin/env python3
"""f32_accuracy.py — winattn's float32 against PyTorch's float32 on the CPU (or, with --device
cuda, both on the GPU: PyTorch's products in full float32, TF32 off), both measured
against a float64 oracle, over GQA groups 1 to 32, rows of up to 32,768 keys, dK and dV over
4 x 32,768 query rows, softcap and long causal rows. The comparison of
python/tests/test_f32_accuracy.py (its compare() and verdict(): FlashAttention's criterion,
winattn err <= 2 x PyTorch err + atol, 3x allowed on gradients) on larger shapes; prints a
markdown table. Run from the repository root after `make`:
    python3 bench/f32_accuracy.py [--parity build/winattn] [--only TEXT] [--seed S] [--device cuda]
--parity adds the bound `winattn parity --case N` gives the same shape with src/ref's float32
baseline (wa_baseline, on its own random inputs) in place of PyTorch's. Needs torch and numpy;
docs/algorithm.md section 6 quotes its output."""
import argparse
import math
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

import test_f32_accuracy as acc  # noqa: E402

# name, Hq, Hkv, Nq, Nk, D, (left, right), softcap, scale (None = 1/sqrt(D)), parity case (the
# accumulation group's f32 case of the same shape, or None)
CASES = [
    ("GQA 1, causal", 8, 8, 2048, 2048, 128, (-1, 0), 0.0, None, None),
    ("GQA 4, window (1023,0)", 16, 4, 2048, 2048, 128, (1023, 0), 0.0, None, None),
    ("GQA 16, window (499,0): the long-sum case", 16, 1, 513, 513, 256, (499, 0), 0.0, None, 1077),
    ("GQA 16, causal", 32, 2, 300, 300, 128, (-1, 0), 0.0, None, 1079),
    ("GQA 32, window (1023,0)", 32, 1, 1100, 1100, 64, (1023, 0), 0.0, None, 1078),
    ("rows of 1000 keys, softcap 2", 4, 4, 2000, 2000, 64, (999, 0), 2.0, None, 1080),
    ("rows of 1000 keys", 4, 4, 2000, 2000, 64, (999, 0), 0.0, None, 1081),
    ("long causal rows, GQA 2", 2, 1, 4500, 4500, 32, (-1, 0), 0.0, None, 1082),
    ("long causal rows, softcap 2", 2, 1, 4500, 4500, 32, (-1, 0), 2.0, None, 1083),
    ("long causal rows, scale 0.02 (nearly uniform)", 2, 1, 4500, 4500, 32, (-1, 0), 0.0, 0.02, 1084),
    ("full rows of 4500 keys", 2, 2, 4500, 4500, 16, (-1, -1), 0.0, None, 1085),
    ("64 rows of 32768 keys", 2, 1, 64, 32768, 32, (-1, -1), 0.0, None, 1086),
    ("dK, dV over 4 x 32768 rows", 4, 1, 32768, 64, 16, (-1, -1), 0.0, None, 1087),
    ("causal rows of up to 16384 keys", 1, 1, 16384, 16384, 32, (-1, 0), 0.0, None, None),
    ("full rows of 16384 keys", 1, 1, 16384, 16384, 16, (-1, -1), 0.0, None, None),
]


def parity_bounds(tool, case):
    """{tensor: bound} from `tool parity --case N --verbose` (its line ends o=err/bound ...)"""
    out = subprocess.run([tool, "parity", "--case", str(case), "--verbose"], capture_output=True, text=True).stdout
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"\b(o|dq|dk|dv)=[^/\s]+/(\S+)", out)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parity", metavar="WINATTN", help="the winattn tool, for wa_baseline's bound (optional)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this text")
    ap.add_argument("--seed", type=int, default=0, help="added to each case's seed (its row in the table)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where all three computations run")
    a = ap.parse_args()
    if a.parity and not os.access(a.parity, os.X_OK):
        sys.exit("f32_accuracy: --parity %s is not an executable" % a.parity)
    import torch
    where = "%d threads" % torch.get_num_threads()
    if a.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("f32_accuracy: --device cuda, but torch sees no CUDA device")
        acc.ieee_f32_products()
        where = torch.cuda.get_device_name()
    print("winattn %s (%s), torch %s, %s" % (acc.winattn.version(), os.environ["WINATTN_LIBRARY"], torch.__version__,
                                           where))
    print()
    head = "| case | tensor | winattn err | PyTorch f32 err | ratio | atol | pass |"
    if a.parity:
        head += " wa_baseline bound (parity #) | PyTorch bound |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    worst, fails, start = 0.0, 0, time.perf_counter()
    for row, (title, Hq, Hkv, Nq, Nk, D, window, softcap, scale, case) in enumerate(CASES):
        if a.only not in title:
            continue
        t0 = time.perf_counter()
        errs, _ = acc.compare(Hq, Hkv, Nq, Nk, D, window, softcap, scale, seed=a.seed + row, device=a.device)
        bounds = parity_bounds(a.parity, case) if a.parity and case else {}
        name = "%s: Hq=%d Hkv=%d Nq=%d Nk=%d D=%d" % (title, Hq, Hkv, Nq, Nk, D)
        for tensor in acc.TENSORS:
            wa, pt, atol = errs[tensor]
            v = acc.verdict(tensor, wa, pt, atol)
            fails += v == "FAIL"
            worst = max(worst, wa / pt if pt else math.inf)
            line = "| %s | %s | %.2e | %.2e | %.2f | %.1e | %s |" % (name, tensor, wa, pt, wa / pt if pt else math.inf,
                                                                   atol, v)
            if a.parity:
                line += " %s | %.1e |" % ("%.1e (#%d)" % (bounds[tensor], case) if tensor in bounds else "",
                                          2 * pt + atol)
            print(line, flush=True)
            name = ""
        print("  %s: %.1f s" % (title, time.perf_counter() - t0), file=sys.stderr, flush=True)
    print()
    print("%d tensors fail; largest ratio winattn / PyTorch %.2f; %.0f s" % (fails, worst, time.perf_counter() - start))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
