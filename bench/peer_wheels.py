#!/usr/bin/env python3
"""peer_wheels.py — the peers' wheels for a GPU machine that reaches no package registry, carried
there in pieces small enough for each transfer. Two sets, chosen by --set:
  peers  (the default) FlashAttention 4, ffpa-attn and cuDNN's frontend for bench/gpu_peers.py;
  qlora  bitsandbytes for bench/train_gpu.py's "qlora" peer (transformers + peft + bitsandbytes).

Where PyPI is reachable:
    python3 bench/peer_wheels.py fetch [--set S] [--dir DIR] [--group-mib 49]
downloads the set's pinned wheels (CPython 3.12, manylinux x86-64: the GPU machine's Python) into
DIR (.peer-wheels for peers, .qlora-wheels for qlora: both ignored by git, so carry can take them) and
lays them out as carry groups DIR/1, DIR/2, ..., each at most --group-mib MiB: a wheel larger than
what is left of a group is cut into pieces (the CUTLASS DSL's CUDA 13 libraries are 88 MB).
Each group holds manifest.json: every wheel's size, sha256 and pieces.

On the GPU machine, one group per transfer, back to back while the machine stays warm (its /tmp
survives between commands):
    python3 bench/peer_wheels.py stash [--set S] DIR/1
    ...
    python3 bench/peer_wheels.py stash [--set S] DIR/N && python3 bench/peer_wheels.py install [--set S]
stash copies a group's files into the set's staging folder (--stage; /tmp/winattn-peer-wheels for
peers, /tmp/winattn-qlora-wheels for qlora, so the two sets' manifests never meet); install checks
that every piece of every wheel is there, joins them, checks each wheel's size and sha256, and
installs them with pip (--no-deps --no-index) into --target (/tmp/winattn-peers, /tmp/winattn-qlora).
Then
    python3 bench/gpu_peers.py --peers-dir /tmp/winattn-peers --systems fa4,winattn,...
puts the target and the CUTLASS DSL's own package folder on sys.path (what the DSL's .pth file
does in a site-packages install, which --target skips).

Versions: ffpa-attn 0.2.4 pins quack-kernels 0.6.4 and nvidia-cutlass-dsl 4.6.2, which
flash-attn-4 4.0.0b40 accepts (>= 4.6.2, >= 0.5.3; its compat module picks the DSL's pre-4.8
allocator names), so one set serves both. The DSL's libs-cu12
requirement is not carried: on a CUDA 13 driver the DSL loads libs-cu13. The DSL's Python sources
(cutlass.cute) are in libs-core, its compiler bindings in libs-base, its CUDA 13 runtime in
libs-cu13: all three go into the one folder nvidia_cutlass_dsl/. torch, einops, numpy, protobuf
and cuda-python's bindings are on the GPU machine already.
nvidia-cudnn-frontend 1.32.0 (the graph API with the SDPA diagonal band) loads the libcudnn.so.9
that torch's nvidia-cudnn-cu13 installed (torch 2.11 pins cuDNN 9.19.0.56), which serves the
band, bf16, GQA and head dims 128 and 256 through its fused SDPA, so no cuDNN wheel is carried
(the newest, nvidia-cudnn-cu13 9.28.1.4, is 492 MiB). The frontend's requirement of
nvidia-cutlass-dsl >= 4.8 is for its own CuTe-DSL kernels, which gpu_peers does not build: below
the DSL version they check for (4.7) they decline, and gpu_peers builds only the library's plans.

The qlora set is bitsandbytes 0.50.2 alone (one wheel for every CUDA version, its CUDA 13 library
included): its requirements (torch, numpy, packaging) and transformers, peft and accelerate are on
the GPU machine already. python3 bench/train_gpu.py --peers qlora --peers-dir /tmp/winattn-qlora
puts the target on the peer's path.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

PEERS = [
    "flash-attn-4==4.0.0b40",
    "ffpa-attn==0.2.4",
    "quack-kernels==0.6.4",
    "nvidia-cutlass-dsl==4.6.2",
    "nvidia-cutlass-dsl-libs-base==4.6.2",
    "nvidia-cutlass-dsl-libs-core==4.6.2",
    "nvidia-cutlass-dsl-libs-cu13==4.6.2",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
    "nvidia-cudnn-frontend==1.32.0",
]
QLORA = ["bitsandbytes==0.50.2"]
# each set: its pinned wheels, the staging folder stash fills, the folder install fills and fetch's folder
# (apart, so that one set's download never counts as the other's stale wheels)
SETS = {
    "peers": (PEERS, "/tmp/winattn-peer-wheels", "/tmp/winattn-peers", ".peer-wheels"),
    "qlora": (QLORA, "/tmp/winattn-qlora-wheels", "/tmp/winattn-qlora", ".qlora-wheels"),
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any"]
MIB = 1 << 20


def add_to_path(target, tool):
    """sys.path gains what install put in `target`: the wheels, and the CUTLASS DSL's own package
    folder (what its .pth file adds in a site-packages install, which --target skips); `tool` names
    the caller in the error for a missing folder"""
    if not os.path.isdir(target):
        sys.exit("%s: --peers-dir %s: no such folder (bench/peer_wheels.py install puts the peers there)" % (tool, target))
    sys.path.insert(0, target)
    dsl = os.path.join(target, "nvidia_cutlass_dsl", "dsl_packages")
    if os.path.isdir(dsl):
        sys.path.insert(0, dsl)


def die(msg):
    print("peer_wheels: " + msg, file=sys.stderr)
    sys.exit(1)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def fetch(args):
    if args.group_mib < 1:
        die("--group-mib must be at least 1")
    pinned = SETS[args.set][0]
    download = os.path.join(args.dir, "download")
    os.makedirs(download, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", download] + sum([["--platform", p] for p in PLATFORMS], []) + pinned
    if subprocess.call(cmd) != 0:
        die("pip download failed (is PyPI reachable from here?)")
    wheels = sorted(f for f in os.listdir(download) if f.endswith(".whl"))
    if len(wheels) != len(pinned):
        die("expected %d wheels in %s, found %d (remove stale ones): %s" % (len(pinned), download, len(wheels), wheels))
    # fill groups in order, cutting a wheel where a group is full
    limit = args.group_mib * MIB
    groups, used, manifest = [[]], 0, {}
    for name in wheels:
        path = os.path.join(download, name)
        size, offset, pieces = os.path.getsize(path), 0, []
        while offset < size:
            if used == limit:
                groups.append([])
                used = 0
            take = min(size - offset, limit - used)
            piece = "%s.part%02d" % (name, len(pieces))
            groups[-1].append((path, offset, take, piece))
            pieces.append(piece)
            offset += take
            used += take
        manifest[name] = {"size": size, "sha256": sha256(path), "pieces": pieces}
    for i, group in enumerate(groups, 1):
        gdir = os.path.join(args.dir, str(i))
        shutil.rmtree(gdir, ignore_errors=True)
        os.makedirs(gdir)
        for path, offset, take, piece in group:
            with open(path, "rb") as src, open(os.path.join(gdir, piece), "wb") as dst:
                src.seek(offset)
                dst.write(src.read(take))
        with open(os.path.join(gdir, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        total = sum(t for _, _, t, _ in group)
        print("%s: %d pieces, %.1f MiB" % (gdir, len(group), total / MIB))
    print("carry each group in its own transfer (with the repository: keep both under the limit), then stash them "
          "there and install after the last")


def stash(args):
    if not os.path.isfile(os.path.join(args.group, "manifest.json")):
        die("%s: no manifest.json (not a group written by fetch)" % args.group)
    os.makedirs(args.stage, exist_ok=True)
    n = 0
    for name in os.listdir(args.group):
        shutil.copyfile(os.path.join(args.group, name), os.path.join(args.stage, name))
        n += 1
    print("stashed %d files of %s in %s" % (n, args.group, args.stage))


def install(args):
    mpath = os.path.join(args.stage, "manifest.json")
    if not os.path.isfile(mpath):
        die("%s: nothing stashed (run stash on each group first)" % args.stage)
    with open(mpath) as f:
        manifest = json.load(f)
    missing = [p for w in manifest.values() for p in w["pieces"] if not os.path.isfile(os.path.join(args.stage, p))]
    if missing:
        die("%d pieces missing from %s (stash every group while the machine stays warm): %s"
            % (len(missing), args.stage, ", ".join(missing[:4])))
    joined = os.path.join(args.stage, "wheels")
    os.makedirs(joined, exist_ok=True)
    for name, w in manifest.items():
        out = os.path.join(joined, name)
        with open(out, "wb") as dst:
            for p in w["pieces"]:
                with open(os.path.join(args.stage, p), "rb") as src:
                    shutil.copyfileobj(src, dst)
        if os.path.getsize(out) != w["size"] or sha256(out) != w["sha256"]:
            die("%s: size or sha256 differs from the manifest (a piece is damaged or from another fetch)" % name)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", args.target] + [os.path.join(joined, n) for n in sorted(manifest)]
    if subprocess.call(cmd) != 0:
        die("pip install into %s failed" % args.target)
    tool = "train_gpu.py --peers qlora" if args.set == "qlora" else "gpu_peers.py"
    print("installed %d wheels into %s; python3 bench/%s --peers-dir %s"
          % (len(manifest), args.target, tool, args.target))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the pinned wheels and cut them into carry groups (needs PyPI)")
    f.add_argument("--dir", default=None, help="default: the set's (.peer-wheels, .qlora-wheels)")
    f.add_argument("--group-mib", type=int, default=49, help="the most MiB in one group")
    s = sub.add_parser("stash", help="copy one carried group into the staging folder")
    s.add_argument("group")
    s.add_argument("--stage", default=None, help="default: the set's (peers /tmp/winattn-peer-wheels, "
                   "qlora /tmp/winattn-qlora-wheels)")
    i = sub.add_parser("install", help="join, verify and pip-install the stashed wheels")
    i.add_argument("--stage", default=None, help="default: the set's, as for stash")
    i.add_argument("--target", default=None,
                   help="default: the set's (peers /tmp/winattn-peers, qlora /tmp/winattn-qlora)")
    for p in (f, s, i):
        p.add_argument("--set", default="peers", choices=sorted(SETS), help="which wheels: peers (default) or qlora")
    args = ap.parse_args()
    if getattr(args, "stage", "") is None:
        args.stage = SETS[args.set][1]
    if getattr(args, "target", "") is None:
        args.target = SETS[args.set][2]
    if getattr(args, "dir", "") is None:
        args.dir = SETS[args.set][3]
    {"fetch": fetch, "stash": stash, "install": install}[args.cmd](args)


if __name__ == "__main__":
    main()
