#!/usr/bin/env python3
"""sass_mix.py — the static SASS instruction mix of one kernel, on a machine without a GPU: compiles
a CUDA source for sm_90a (as the lab builds do), disassembles it with nvdisasm and counts the
kernel's instructions by kind, in the whole function and in its main loop (the shortest backward
branch span holding the most HGMMA instructions, with every path through it counted once: an
upper bound on one iteration). With two sets of defines it prints both and the difference, so that a
variant's cost in instructions is known before a GPU run. From the repository root:
    python3 dev/cuda/sass_mix.py --kernel "dkdv_ws_kernel<__nv_bfloat16, 128, (Cap)1, true, false>" \\
        [--source src/cuda/bwd_hopper.cu] [--defines="-DWA_BWD_STEP_OVERLAP=0"] [--against=""]
nvdisasm: $NVDISASM, else on PATH, else the PyPI wheel nvidia-cuda-nvdisasm installed for this
Python (`pip install nvidia-cuda-nvdisasm`: NVIDIA's own build; nvcc's toolkit here lacks it).
Static counts are not executed counts: Nsight Compute's smsp__inst_executed (dev/cuda/profile.sh)
is the measure; this says where the instructions of a loop iteration go.
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

# opcode (before the first dot) -> kind
KINDS = {
    "tensor": {"HGMMA", "WARPGROUP"},
    "float": {"FMUL", "FFMA", "FADD", "FMNMX", "FSEL", "FSETP", "MUFU", "F2FP", "F2F", "FCHK", "HADD2", "HMUL2", "HFMA2"},
    "shared memory": {"LDS", "STS", "LDSM", "STSM"},
    "global / async": {"LDG", "STG", "RED", "ATOM", "UBLKRED", "UBLKCP", "UTMALDG", "UTMASTG", "UTMACMDFLUSH", "LDGSTS",
                       "LDGDEPBAR", "DEPBAR"},
    "sync": {"BAR", "SYNCS", "MEMBAR", "FENCE", "ELECT", "WARPSYNC", "BSSY", "BSYNC", "NANOSLEEP", "VOTE", "VOTEU"},
    "control": {"BRA", "EXIT", "CALL", "RET", "NOP", "BPT", "YIELD"},
}


def kind_of(op):
    for k, ops in KINDS.items():
        if op in ops:
            return k
    return "uniform datapath" if op.startswith("U") or op in ("R2UR", "S2UR") else "integer / other"


def find_nvdisasm():
    if os.environ.get("NVDISASM"):
        if not os.access(os.environ["NVDISASM"], os.X_OK):
            sys.exit("sass_mix: NVDISASM=%s: no such program" % os.environ["NVDISASM"])
        return os.environ["NVDISASM"]
    found = shutil.which("nvdisasm")
    if found:
        return found
    for site in sys.path:
        for p in glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "nvdisasm")):
            return p
    sys.exit("sass_mix: no nvdisasm: set NVDISASM, put it on PATH, or `pip install nvidia-cuda-nvdisasm`")


def kernel_sass(source, defines, kernel, nvdisasm, workdir):
    """the disassembly lines of the function whose demangled name contains `kernel`"""
    cubin = os.path.join(workdir, "k.cubin")
    cmd = ["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Iinclude", "-Isrc", "-std=c++17", "-cubin",
           source, "-o", cubin] + defines.split()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit("sass_mix: nvcc failed:\n" + r.stderr[-2000:])
    r = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
    if r.returncode:
        sys.exit("sass_mix: nvdisasm could not read %s's cubin: %s" % (source, (r.stderr.strip().splitlines() or ["?"])[-1]))
    text = r.stdout
    sections = re.split(r"\n(?=\.text\.)", text)
    names = [s.split(":", 1)[0][len(".text."):] for s in sections if s.startswith(".text.")]
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    demangled = demangled.replace("(anonymous namespace)::", "").split("\n")
    hits = [(d, s) for d, s in zip(demangled, [s for s in sections if s.startswith(".text.")]) if kernel in d]
    if len(hits) != 1:
        sys.exit("sass_mix: %d kernels match %r%s" % (len(hits), kernel, "".join("\n  " + d for d, _ in hits[:8])))
    return hits[0][0], hits[0][1].split("\n")


def parse(lines):
    """[(address, opcode, branch target label or None)] and {label: address}"""
    out, labels, pending = [], {}, []
    for line in lines:
        m = re.match(r"^(\.L_\w+):", line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for p in pending:
            labels[p] = addr
        pending = []
        target = re.search(r"`\((\.L_\w+)\)", m.group(3))
        out.append((addr, m.group(2).split(".")[0], target.group(1) if target else None))
    return out, labels


def main_loop(ins, labels):
    """(start, end) addresses of the backward branch's span holding the most HGMMAs, the shortest
    such span (a wait's retry block placed after the function also branches back into the loop)"""
    best = None
    for addr, op, target in ins:
        if op == "BRA" and target in labels and labels[target] < addr:
            start = labels[target]
            n = sum(1 for a, o, _ in ins if start <= a <= addr and o == "HGMMA")
            if best is None or n > best[0] or (n == best[0] and addr - start < best[2] - best[1]):
                best = (n, start, addr)
    return (best[1], best[2]) if best else None


def mix(ops):
    by_kind = collections.Counter(kind_of(o) for o in ops)
    return by_kind, collections.Counter(ops)


def report(label, ins, labels):
    print("== %s" % label)
    loop = main_loop(ins, labels)
    parts = [("function", [o for _, o, _ in ins])]
    if loop:
        parts.append(("main loop (0x%x-0x%x, every path once)" % loop, [o for a, o, _ in ins if loop[0] <= a <= loop[1]]))
    result = {}
    for name, ops in parts:
        by_kind, by_op = mix(ops)
        result[name.split(" ")[0]] = (by_kind, by_op, len(ops))
        print("  %s: %d instructions" % (name, len(ops)))
        print("    " + ", ".join("%s %d" % kv for kv in by_kind.most_common()))
        print("    " + ", ".join("%s %d" % kv for kv in by_op.most_common(24)))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", required=True, help="a substring of the demangled kernel name")
    ap.add_argument("--source", default="src/cuda/bwd_hopper.cu")
    ap.add_argument("--defines", default="", help="nvcc defines of the build to count")
    ap.add_argument("--against", help="the defines of a second build, counted beside it")
    a = ap.parse_args()
    if not os.path.isfile(a.source):
        sys.exit("sass_mix: --source %s: no such file" % a.source)
    if not shutil.which("nvcc"):
        sys.exit("sass_mix: no nvcc on PATH")
    nvdisasm = find_nvdisasm()
    with tempfile.TemporaryDirectory() as wd:
        name, lines = kernel_sass(a.source, a.defines, a.kernel, nvdisasm, wd)
        print(name)
        first = report(a.defines or "default", *parse(lines))
        if a.against is None:
            return
        second = report(a.against or "default", *parse(kernel_sass(a.source, a.against, a.kernel, nvdisasm, wd)[1]))
    if "main" in first and "main" in second:
        (k1, o1, n1), (k2, o2, n2) = first["main"], second["main"]
        print("== main loop, second minus first: %+d instructions" % (n2 - n1))
        print("    " + ", ".join("%s %+d" % (k, k2[k] - k1[k]) for k in sorted(set(k1) | set(k2)) if k2[k] != k1[k]))
        print("    " + ", ".join("%s %+d" % (o, o2[o] - o1[o]) for o in sorted(set(o1) | set(o2)) if o2[o] != o1[o]))


if __name__ == "__main__":
    main()
