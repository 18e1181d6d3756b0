#!/bin/sh
# cuda_sass_diff.sh — compare the SASS of the CUDA objects of two revisions, function by function, to
# check that a change of source form (a kernel split into functions, a rename) leaves the machine code
# as it was. No GPU is needed: only nvcc and cuobjdump.
#   sh scripts/cuda_sass_diff.sh [-a ARCHS] [-s SOURCES] OLD [NEW]
#     OLD, NEW   git revisions (anything `git rev-parse` takes); NEW left out or "." is the working tree
#                (committed or not)
#     -a ARCHS   the Makefile's CUDA_ARCHS list (default "sm_90a sm_80")
#     -s SOURCES the .cu files to compare, paths from the repository root (default every
#                src/cuda/**/*.cu of either side); each nvcc compile of a Hopper file takes minutes,
#                so name only those a change touches while iterating
# Each side's objects are built with the Makefile's own CUDA rule and flags (make CUDA_ARCHS=...
# BUILD/src/cuda/....o) under $SASS_DIFF_CACHE (default /tmp/cuda_sass_diff): a revision's tree is
# exported once and its objects are kept (a commit's sources never change), the working tree's are
# rebuilt by make when their sources are newer. `cuobjdump -sass` of each object is compared with
# nothing normalised but what carries the source file: the identifier = ... header lines and the hash
# of the file in the anonymous namespace's name (_GLOBAL__N__<8 hex digits>_). CUOBJDUMP names the
# cuobjdump to use where it is not on PATH nor in /usr/local/cuda/bin.
# Prints one line per function and architecture:
#   identical | registers-only (same instructions but for register numbers) | differing | only in OLD/NEW
# with the instruction counts (and their delta), then a summary line. Exit status 0 only when every
# function is identical; 1 when any is not; 2 on a usage or build error.
set -eu

usage() {
    echo "usage: sh scripts/cuda_sass_diff.sh [-a ARCHS] [-s SOURCES] OLD [NEW]" >&2
    exit 2
}
die() {
    echo "cuda_sass_diff.sh: $*" >&2
    exit 2
}

archs="sm_90a sm_80"
sources=""
while getopts a:s: opt; do
    case $opt in
    a) archs=$OPTARG ;;
    s) sources=$OPTARG ;;
    *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] && [ $# -le 2 ] || usage
old_rev=$1
new_rev=${2:-.}

top=$(git rev-parse --show-toplevel) || die "not inside a git repository"
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
[ -x "$cuobjdump" ] || die "cuobjdump not found: set CUOBJDUMP (the CUDA toolkit's, or pip's nvidia-cuda-cuobjdump)"
filt=$(command -v cu++filt || command -v c++filt || echo cat)
cache=${SASS_DIFF_CACHE:-/tmp/cuda_sass_diff}
arch_key=$(echo "$archs" | tr -cs 'a-z0-9_' '-' | sed 's/-$//')
mkdir -p "$cache"

# tree_of REV: the directory holding REV's sources (exported once per commit); "." is the working tree
tree_of() {
    if [ "$1" = . ]; then
        echo "$top"
        return
    fi
    sha=$(git -C "$top" rev-parse --verify -q "$1^{commit}") || die "no such revision: $1"
    if [ ! -f "$cache/$sha/.exported" ]; then
        rm -rf "$cache/$sha/src"
        mkdir -p "$cache/$sha/src"
        git -C "$top" archive "$sha" | tar -x -C "$cache/$sha/src" || die "cannot export $1"
        touch "$cache/$sha/.exported"
    fi
    echo "$cache/$sha/src"
}

# build_dir_of REV: where REV's objects for these architectures go
build_dir_of() {
    if [ "$1" = . ]; then
        echo "$cache/tree-$(echo "$top" | cksum | cut -d' ' -f1)/build-$arch_key"
    else
        echo "$cache/$(git -C "$top" rev-parse "$1^{commit}")/build-$arch_key"
    fi
}

old_tree=$(tree_of "$old_rev")
new_tree=$(tree_of "$new_rev")
old_build=$(build_dir_of "$old_rev")
new_build=$(build_dir_of "$new_rev")

if [ -z "$sources" ]; then
    sources=$( (cd "$old_tree" && find src/cuda -name '*.cu'; cd "$new_tree" && find src/cuda -name '*.cu') | sort -u)
fi

# build TREE BUILD: the objects of $sources that TREE has, with the Makefile's CUDA rule
build() {
    targets=""
    for s in $sources; do
        [ -f "$1/$s" ] && targets="$targets $2/${s%.cu}.o"
    done
    [ -n "$targets" ] || return 0
    echo "building in $1 ($archs):$(echo "$targets" | sed "s|$2/||g")" >&2
    # shellcheck disable=SC2086 # the target list is split on purpose
    make -C "$1" --no-print-directory BUILD="$2" CUDA_ARCHS="$archs" -j2 $targets >"$2.log" 2>&1 ||
        die "the build in $1 failed: see $2.log"
}
mkdir -p "$old_build" "$new_build"
build "$old_tree" "$old_build"
build "$new_tree" "$new_build"

# split_sass OBJ DIR: one file per (architecture, function) under DIR, named by sequence, and DIR/index
# with "ARCH FUNCTION FILE" lines
split_sass() {
    mkdir -p "$2"
    "$cuobjdump" -sass "$1" | awk -v dir="$2" '
        /^[ \t]*identifier = / { next }              # the source file name
        # the anonymous namespace'"'"'s name carries a hash of the source file: _GLOBAL__N__<8 hex>_<file>_...
        { gsub(/_GLOBAL__N__[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]_/, "_GLOBAL__N__xxxxxxxx_") }
        /^Fatbin / { if (out != "") close(out); out = ""; next } # the next section'"'"'s header
        /^[ \t]*code for sm_/ { arch = $3; next }
        /^[ \t]*Function : / {
            if (out != "") close(out)
            n++
            out = dir "/" n ".sass"
            print arch, $3, n ".sass" > (dir "/index")
            next
        }
        out != "" { print > out }
    '
    [ -f "$2/index" ] || : >"$2/index"
}

# instruction count of a dumped function
count_of() { grep -c '/\*[0-9a-f]\{4,\}\*/' "$1" || true; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
total=0 same=0 regs=0 diff=0 only=0
for s in $sources; do
    o=${s%.cu}.o
    for side in old new; do
        eval "b=\$${side}_build"
        d="$work/$side/$o"
        if [ -f "$b/$o" ]; then split_sass "$b/$o" "$d"; else mkdir -p "$d" && : >"$d/index"; fi
    done
    # every (arch, function) of either side, in the order of the new side's dump then the old one's
    awk '{ print $1, $2 }' "$work/new/$o/index" "$work/old/$o/index" | awk '!seen[$0]++' >"$work/keys"
    while read -r arch fn; do
        total=$((total + 1))
        name=$(echo "$fn" | $filt)
        fo=$(awk -v a="$arch" -v f="$fn" '$1 == a && $2 == f { print $3; exit }' "$work/old/$o/index")
        fnew=$(awk -v a="$arch" -v f="$fn" '$1 == a && $2 == f { print $3; exit }' "$work/new/$o/index")
        if [ -z "$fo" ] || [ -z "$fnew" ]; then
            only=$((only + 1))
            [ -z "$fo" ] && where="only in NEW" || where="only in OLD"
            echo "$where  $o $arch $name"
            continue
        fi
        a="$work/old/$o/$fo" c="$work/new/$o/$fnew"
        na=$(count_of "$a") nc=$(count_of "$c")
        if cmp -s "$a" "$c"; then
            same=$((same + 1))
            echo "identical  $o $arch $name ($na instructions)"
        else
            # registers renumbered only: equal once R<n>, UR<n>, P<n>, UP<n> lose their numbers and the
            # encodings (which carry the register fields) are dropped
            strip='s|/\* 0x[0-9a-f]* \*/||g; s/\bU\{0,1\}[RP][0-9]\{1,3\}\b/R#/g'
            if [ "$(sed "$strip" "$a" | tr -s ' \t' ' ' | cksum)" = \
                "$(sed "$strip" "$c" | tr -s ' \t' ' ' | cksum)" ]; then
                regs=$((regs + 1))
                echo "registers-only  $o $arch $name ($na instructions)"
            else
                diff=$((diff + 1))
                echo "differing  $o $arch $name ($na -> $nc instructions, delta $((nc - na)))"
            fi
        fi
    done <"$work/keys"
done
[ "$new_rev" = . ] && new_label="the working tree" || new_label=$new_rev
echo "summary: $total functions ($old_rev vs $new_label, $archs): $same identical, $regs registers-only," \
    "$diff differing, $only only on one side"
[ "$total" -gt 0 ] || die "no CUDA functions found in the objects of: $sources"
[ "$same" -eq "$total" ]
