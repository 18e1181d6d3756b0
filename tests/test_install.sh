#!/bin/sh
# test_install.sh — `make install` into a scratch prefix, then build the README's example
# (examples/sliding_window.c) against it the way the README says for a non-system prefix: through
# PKG_CONFIG_PATH and pkg-config, with the shared library (run with LD_LIBRARY_PATH, and built
# with -Wl,-rpath and run without it) and statically, and run each.
BUILD=${1:-build}
P=$(mktemp -d)
trap 'rm -rf "$P"' EXIT
pass=0 fail=0
step() {
    name=$1; shift
    if out=$("$@" 2>&1); then echo "PASS install $name"; pass=$((pass + 1)); else echo "FAIL install $name: $(echo "$out" | tail -n 3)"; fail=$((fail + 1)); fi
}
step "make install PREFIX=<tmp>" make -s install PREFIX="$P" BUILD="$BUILD"
export PKG_CONFIG_PATH="$P/lib/pkgconfig"
if command -v pkg-config >/dev/null 2>&1; then
    step "pkg-config knows winattn" pkg-config --exists winattn
    step "example builds against the shared library" sh -c "cc examples/sliding_window.c \$(pkg-config --cflags --libs winattn) -o '$P/ex_shared'"
    step "example runs (shared)" env LD_LIBRARY_PATH="$P/lib" "$P/ex_shared"
    # the README's other way to a non-system prefix: -Wl,-rpath, then no LD_LIBRARY_PATH at all
    step "example builds with -Wl,-rpath" sh -c "cc examples/sliding_window.c \$(pkg-config --cflags --libs winattn) -Wl,-rpath,'$P/lib' -o '$P/ex_rpath'"
    step "example runs (rpath, the prefix's libwinattn.so)" sh -c "env -u LD_LIBRARY_PATH ldd '$P/ex_rpath' | grep -q '$P/lib/libwinattn.so' && env -u LD_LIBRARY_PATH '$P/ex_rpath'"
    step "example builds statically" sh -c "cc examples/sliding_window.c \$(pkg-config --cflags winattn) '$P/lib/libwinattn.a' \$(pkg-config --static --libs winattn | sed 's/-lwinattn//') -o '$P/ex_static'"
    step "example runs (static)" "$P/ex_static"
else
    echo "SKIP install pkg-config is not installed"
fi
step "installed winattn runs" "$P/bin/winattn" version
# one version everywhere: the header's WINATTN_VERSION_*, wa_version() (winattn version) and winattn.pc
if command -v pkg-config >/dev/null 2>&1; then
    step "winattn.pc's version is wa_version()'s" sh -c "\"$P/bin/winattn\" version | grep -q \"^winattn \$(pkg-config --modversion winattn) \""
fi
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
