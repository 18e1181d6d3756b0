#!/usr/bin/env python3
"""Build the long-document training corpus from Debian's python3.11-doc reST sources.

    python3 train/corpus/build_corpus.py [--out data/corpus] [--cache DIR] [--deb PATH]
                                         [--max-tokens 30553]

Writes <out>/train.jsonl (171 records) and <out>/valid.jsonl (21 records) of {"text": ...},
and <out>/summary.json. Lengths are counted in the trainer's byte-level tokens (one token
per UTF-8 byte, plus BOS and EOS), and the documents are picked so the profile matches the
write-up's job: mean about 8.7K tokens, longest about 30.5K (docs/design.md §6.7).
Needs only the Python standard library, apt-get and dpkg-deb (no root).
"""
import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

PACKAGE = "python3.11-doc"
SOURCES = "usr/share/doc/python3.11/html/_sources"
N_TRAIN, N_VALID = 171, 21
TARGET_MEAN = 8663       # the write-up's mean transcript length
MIN_TOKENS = 1024        # shorter pages are indexes and stubs, not documents


def tokens(text):
    return len(text.encode("utf-8")) + 2  # bytes + BOS + EOS


def fetch_deb(cache):
    """The newest cached .deb, else one fetched by apt-get download into the cache."""
    os.makedirs(cache, exist_ok=True)
    debs = sorted(glob.glob(os.path.join(cache, PACKAGE + "_*.deb")))
    if not debs:
        r = subprocess.run(["apt-get", "download", PACKAGE], cwd=cache,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        debs = sorted(glob.glob(os.path.join(cache, PACKAGE + "_*.deb")))
        if r.returncode != 0 or not debs:
            sys.exit(f"build_corpus: apt-get download {PACKAGE} failed:\n{r.stdout}")
    return debs[-1]


def read_sources(deb):
    """{relative path: text} of every .rst.txt page in the package."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["dpkg-deb", "-x", deb, tmp], stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.exit(f"build_corpus: dpkg-deb -x {deb} failed: {r.stderr.strip()}")
        root = os.path.join(tmp, SOURCES)
        paths = sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True))
        if not paths:
            sys.exit(f"build_corpus: no {SOURCES}/**/*.rst.txt in {deb}")
        docs = {}
        for p in paths:
            with open(p, encoding="utf-8") as f:
                docs[os.path.relpath(p, root)[:-len(".rst.txt")]] = f.read()
        return docs


def cut(text, max_tokens):
    """The longest prefix of whole paragraphs that fits in max_tokens (None if none does)."""
    if tokens(text) <= max_tokens:
        return text
    kept, used = [], 2
    for para in text.split("\n\n"):
        n = len(para.encode("utf-8")) + (2 if kept else 0)
        if used + n > max_tokens:
            break
        kept.append(para)
        used += n
    return "\n\n".join(kept).rstrip() + "\n" if kept else None


def unit(name, salt):
    """A uniform number in (0, 1) fixed by the document's name."""
    h = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return (int.from_bytes(h[:8], "big") + 0.5) / 2.0**64


def pick(cands, count, target, salt):
    """count documents, drawn without replacement with weight tokens^-alpha, alpha chosen by
    bisection so their mean is the target (Efraimidis-Spirakis keys u^(1/w), largest win,
    compared as log(u) / w to stay clear of underflow). Unweighted, the candidates average
    more than the target: cut long pages pile up just under max_tokens."""
    def draw(alpha):
        keyed = sorted(cands, key=lambda c: -math.log(unit(c[0], salt)) * c[1] ** alpha)
        chosen = keyed[:count]
        return chosen, statistics.mean(n for _, n, _ in chosen)

    lo, hi = -2.0, 4.0  # mean falls as alpha rises
    best = None
    for _ in range(60):
        mid = (lo + hi) / 2
        chosen, mean = draw(mid)
        if best is None or abs(mean - target) < abs(best[1] - target):
            best = (chosen, mean, mid)
        if mean > target:
            lo = mid
        else:
            hi = mid
    return best


def pick_near(cands, count, target, split):
    """pick() under successive salts until the mean is within 1.5% of the target: with 21
    documents one swap moves the mean by up to 1.4K tokens, so one draw may not land."""
    for attempt in range(50):
        chosen, mean, alpha = pick(cands, count, target, f"{split}:{attempt}")
        if abs(mean - target) <= 0.015 * target:
            break
    return chosen, alpha


def stats(rows):
    n = [r[1] for r in rows]
    return {"records": len(n), "tokens": sum(n), "mean": round(statistics.mean(n), 1),
            "median": statistics.median(n), "min": min(n), "max": max(n),
            "cut_at_paragraph": sum(1 for r in rows if r[2])}


def write_jsonl(path, rows, texts):
    with open(path, "w", encoding="utf-8") as f:
        for name, _, _ in rows:
            f.write(json.dumps({"text": texts[name]}, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/corpus", help="output directory (default data/corpus)")
    ap.add_argument("--cache", help="where the .deb is kept (default: --out)")
    ap.add_argument("--deb", help="use this already-downloaded python3.11-doc .deb")
    ap.add_argument("--max-tokens", type=int, default=30553,
                    help="longer documents are cut at a paragraph boundary (default 30553, "
                         "the write-up's longest transcript)")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    deb = args.deb or fetch_deb(args.cache or args.out)
    docs = read_sources(deb)

    texts, cands = {}, []
    for name, text in docs.items():
        fitted = cut(text, args.max_tokens)
        if fitted is None or tokens(fitted) < MIN_TOKENS:
            continue
        texts[name] = fitted
        cands.append((name, tokens(fitted), fitted != text))
    if len(cands) < N_TRAIN + N_VALID:
        sys.exit(f"build_corpus: only {len(cands)} documents of {MIN_TOKENS}..{args.max_tokens} tokens")

    # Validation first, from all candidates; training from the rest: disjoint by page.
    valid, alpha_v = pick_near(cands, N_VALID, TARGET_MEAN, "valid")
    taken = {name for name, _, _ in valid}
    train, alpha_t = pick_near([c for c in cands if c[0] not in taken], N_TRAIN, TARGET_MEAN, "train")

    # File order is batch order for an mlx-lm-style trainer (consecutive groups of 4),
    # so keep the pick's pseudo-random order rather than sorting by length.
    write_jsonl(os.path.join(args.out, "train.jsonl"), train, texts)
    write_jsonl(os.path.join(args.out, "valid.jsonl"), valid, texts)

    with open(deb, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    summary = {
        "source": {"deb": os.path.basename(deb), "sha256": sha, "pages": len(docs),
                   "candidates": len(cands)},
        "tokenizer": "byte-level: token = byte + 3, BOS 2 first, EOS 1 last, pad 0",
        "max_tokens": args.max_tokens, "min_tokens": MIN_TOKENS, "target_mean": TARGET_MEAN,
        "train": dict(stats(train), alpha=round(alpha_t, 4)),
        "valid": dict(stats(valid), alpha=round(alpha_v, 4)),
        "documents": {"train": [[n, t] for n, t, _ in train], "valid": [[n, t] for n, t, _ in valid]},
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    for split in ("train", "valid"):
        s = summary[split]
        print(f"{split}: {s['records']} records, {s['tokens']} tokens, mean {s['mean']}, "
              f"median {s['median']}, min {s['min']}, max {s['max']}, "
              f"{s['cut_at_paragraph']} cut at a paragraph")
    print(f"wrote {args.out}/train.jsonl, valid.jsonl, summary.json (from {os.path.basename(deb)})")


if __name__ == "__main__":
    main()
