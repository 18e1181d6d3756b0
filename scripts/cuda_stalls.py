#!/usr/bin/env python3
"""cuda_stalls.py — the SASS instructions where a kernel's warps stall most, from the source page
Nsight Compute exports (`ncu -i REPORT --page source --csv --print-source sass`, as
scripts/cuda_stall_profile.sh writes it, gzipped or not):
    python3 scripts/cuda_stalls.py src_NAME.csv.gz [--top 25]
Prints the instructions by warp-stall samples (all samples), each with its share of the kernel's
samples and, where the export has per-reason columns (headers naming a stall reason), its three
largest reasons (a branch that closes an mbarrier wait loop names the barrier address it
polls, the operand of the SYNCS.PHASECHK just before it: the offsets tell the kernel's barriers
apart, so a wait's samples can be put to the barrier and role); then the instructions with excess shared-memory wavefronts (bank conflicts), where
the export has that column; then the samples summed by opcode. Columns are found by name, so that exports
of other Nsight Compute versions read the same."""
import argparse
import collections
import csv
import gzip
import io
import sys


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path):
    try:
        raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    except OSError as e:
        sys.exit("cuda_stalls.py: cannot read %s: %s" % (path, e.strerror))
    with raw:
        lines = [line for line in raw if line.strip() and not line.startswith("==")]  # ncu's own notices
    rows = list(csv.reader(io.StringIO("".join(lines))))
    # the header is the first row naming the sampling column; rows before it (the kernel's name,
    # in recent versions) are a preamble
    for i, row in enumerate(rows):
        if any("warp stall sampling" in name.lower() for name in row):
            return row, rows[i + 1:]
    if not rows:
        sys.exit("cuda_stalls.py: %s has no rows" % path)
    return rows[0], rows[1:]


def column(header, *needles, required=True):
    """the first column whose name contains every needle (case-insensitive)"""
    for i, name in enumerate(header):
        if all(n.lower() in name.lower() for n in needles):
            return i
    if required:
        sys.exit("cuda_stalls.py: no column named like %s among: %s" % (" ".join(needles), ", ".join(header)))
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    header, rows = read_rows(a.csv)
    samples = column(header, "warp stall sampling", "all")
    source = column(header, "source")
    address = column(header, "address", required=False)
    reasons = [i for i, name in enumerate(header)
               if i not in (samples, column(header, "warp stall sampling", "not", required=False))
               and ("stall" in name.lower() or name.lower().startswith("smsp__pcsamp"))
               and "not issued" not in name.lower()]
    rows = [r for r in rows if len(r) > max(samples, source)]
    total = sum(number(r[samples]) for r in rows) or 1.0
    position = {id(r): i for i, r in enumerate(rows)}  # the export's order: the kernel's

    def polled_barrier(r):
        """for a branch, the mbarrier address polled just before it (a wait loop's exit test)"""
        if "BRA" not in r[source]:
            return ""
        i = position[id(r)]
        for prev in rows[max(0, i - 4):i][::-1]:
            text = prev[source]
            if "SYNCS.PHASECHK" in text and "[" in text:
                return " (polls %s)" % text[text.index("["):text.index("]") + 1]
        return ""
    print("%d instructions, %.0f warp-stall samples" % (len(rows), total))
    print("| share | samples | address | instruction | largest reasons |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:a.top]:
        top = sorted(((number(r[i]), header[i]) for i in reasons if i < len(r) and number(r[i]) > 0), reverse=True)[:3]
        print("| %.1f %% | %.0f | %s | `%s` | %s |" % (
            100 * number(r[samples]) / total, number(r[samples]), r[address] if address is not None else "-",
            r[source].strip()[:70] + polled_barrier(r), ", ".join("%s %.0f" % (n, v) for v, n in top) or "-"))
    excess = column(header, "wavefronts shared excessive", required=False)
    if excess is not None:
        conflicted = sorted((r for r in rows if number(r[excess]) > 0), key=lambda r: -number(r[excess]))
        all_excess = sum(number(r[excess]) for r in conflicted) or 1.0
        print("\nshared-memory bank conflicts: %.0f excess wavefronts in %d instructions"
              % (sum(number(r[excess]) for r in conflicted), len(conflicted)))
        if conflicted:
            print("| share | excess wavefronts | address | instruction |\n|---|---|---|---|")
        for r in conflicted[:min(a.top, 12)]:
            print("| %.1f %% | %.0f | %s | `%s` |" % (100 * number(r[excess]) / all_excess, number(r[excess]),
                                                   r[address] if address is not None else "-", r[source].strip()[:70]))
    by_op = collections.Counter()
    for r in rows:
        op = r[source].strip().split()
        op = [t for t in op if not t.startswith("@")]  # a predicate is not the opcode
        by_op[op[0].split(".")[0] if op else "?"] += number(r[samples])
    print("\nby opcode: " + ", ".join("%s %.1f %%" % (op, 100 * n / total) for op, n in by_op.most_common(12)))


if __name__ == "__main__":
    main()
