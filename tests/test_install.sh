#!/bin/sh
# test_install.sh — `make install` into a scratch prefix, then build the README's example
# (examples/sliding_window.c) against it the way a user would: through pkg-config, once with the
# shared library and once statically, and run both.
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
    step "example builds statically" sh -c "cc examples/sliding_window.c \$(pkg-config --cflags winattn) '$P/lib/libwinattn.a' \$(pkg-config --static --libs winattn | sed 's/-lwinattn//') -o '$P/ex_static'"
    step "example runs (static)" "$P/ex_static"
else
    echo "SKIP install pkg-config is not installed"
fi
step "installed winattn runs" "$P/bin/winattn" version
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
