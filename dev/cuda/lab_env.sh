# lab_env.sh — sourced (`. dev/cuda/lab_env.sh`) by the session-4 lab scripts, from the repository
# root: sets OUT (where logs go, the device tool's $OUT) and DEPS (the unpacked libjansson, see
# scripts/cuda_check.sh), and defines lab_build.
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
mkdir -p "$OUT"

# lab_build DIR "DEFINES" TARGET...: make the targets with BUILD=DIR and the nvcc defines (e.g.
# -DWA_FWD_NO_PINGPONG; the Makefile's CUDA_DEFINES); log in $OUT/DIR.txt; on failure print its
# tail and exit the script
lab_build() {
    dir=$1 defines=$2
    shift 2
    timeout 400 make -j16 BUILD="$dir" CUDA_DEFINES="$defines" JANSSON_CFLAGS="-I$DEPS/usr/include" \
        JANSSON_LIBS="$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a" "$@" >"$OUT/$dir.txt" 2>&1 ||
        { echo "build of $dir failed:"; tail -20 "$OUT/$dir.txt"; exit 1; }
}
