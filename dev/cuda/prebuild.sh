#!/bin/sh
# prebuild.sh — make a lab build on a CPU machine with nvcc and pack it for the GPU machine, where
# lab_build (lab_env.sh) unpacks it instead of building. From the repository root:
#   sh dev/cuda/prebuild.sh DIR "NVCC DEFINES" DIR/TARGET...
#   e.g. sh dev/cuda/prebuild.sh build-pair "-DWA_FWD512_CLUSTER" build-pair/winattn
# then carry .lab-prebuilt (ignored by git) to the GPU machine. The build is made afresh in
# .lab-prebuilt/DIR.tree (make does not track flags, so an old tree could hold other defines), sm_90a
# only (the lab scripts' LAB_SM90_FLAGS), links Debian's libjansson statically from .devdeps
# (scripts/cuda_check.sh says how to unpack it) and leaves OpenBLAS out (HAVE_CBLAS empty: the GPU
# machine has none), so the binaries need only libc, libm and libstdc++ there; a libc older than
# the GPU machine's (Debian 12's 2.36 against Ubuntu 24.04's 2.39) keeps them loadable.
[ $# -ge 3 ] || { echo "usage: sh dev/cuda/prebuild.sh DIR \"NVCC DEFINES\" DIR/TARGET..."; exit 2; }
set -e
dir=$1 defines=$2
shift 2
. dev/cuda/lab_env.sh # LAB_SM90_FLAGS, DEPS made absolute
tree=.lab-prebuilt/$dir.tree
rm -rf "$tree"
mkdir -p .lab-prebuilt
targets=$(for t in "$@"; do echo "$tree/${t#"$dir"/}"; done)
make -j"$(nproc)" BUILD="$tree" HAVE_CBLAS= \
    NVCCFLAGS="$LAB_SM90_FLAGS $defines" \
    JANSSON_CFLAGS="-I$DEPS/usr/include" JANSSON_LIBS="$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a" $targets >"$tree.log" 2>&1 ||
    { tail -20 "$tree.log"; exit 1; }
changed=$(git diff --quiet HEAD -- src include tools || echo ' with uncommitted changes')
echo "$defines (sm_90a, nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), at $(git rev-parse --short HEAD)$changed)" >"$tree/PREBUILT"
tar cJf ".lab-prebuilt/$dir.tar.xz" --transform "s,^$tree,$dir," "$tree/PREBUILT" $targets
rm -rf "$tree"
ls -l ".lab-prebuilt/$dir.tar.xz"
