#!/bin/sh
# deps.sh — what `make` and `make test` need, installed on a Debian or Ubuntu machine when it is
# missing: a C compiler and make (build-essential), libjansson-dev (the command's JSON),
# libyaml-dev (`winattn train -c`'s config files) and pkg-config (the install test). Debian
# packages named as arguments are added to the list (.ci/run adds libopenblas-dev and
# python3-venv); a package of another architecture (libjansson-dev:arm64) adds that architecture
# to dpkg first. --extra adds what `make test EXTRA=all` needs (tests/extra_checks.sh): clang and
# its libFuzzer runtime, the aarch64 cross compiler, qemu-user and jansson and libyaml for arm64.
# Does nothing when everything is there; otherwise installs with apt-get as root or through sudo,
# and without either prints the apt-get command and fails. The README's first command runs it
# before `make`.
# usage: sh scripts/deps.sh [--extra] [DEBIAN_PACKAGE...]
CC=${CC:-cc}
if [ "$1" = "--extra" ]; then
    shift
    set -- clang libclang-rt-dev gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user libjansson-dev:arm64 libyaml-dev:arm64 "$@"
fi
have() { command -v "$1" >/dev/null 2>&1; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q ' installed$'; }

missing=
have "$CC" && have make || missing="$missing build-essential"
# jansson as the Makefile checks it: a program that includes and links it (JANSSON_CFLAGS and
# JANSSON_LIBS may point at a copy outside the system, as on the GPU machine)
printf '#include <jansson.h>\nint main(void){return json_object()==0;}\n' |
    "$CC" $JANSSON_CFLAGS -x c - ${JANSSON_LIBS:--ljansson} -o /dev/null >/dev/null 2>&1 ||
    missing="$missing libjansson-dev"
# libyaml the same way (YAML_CFLAGS and YAML_LIBS as the Makefile takes them)
printf '#include <yaml.h>\nint main(void){yaml_parser_t p;return !yaml_parser_initialize(&p);}\n' |
    "$CC" $YAML_CFLAGS -x c - ${YAML_LIBS:--lyaml} -o /dev/null >/dev/null 2>&1 ||
    missing="$missing libyaml-dev"
have pkg-config || missing="$missing pkg-config"
for p in "$@"; do installed "$p" || missing="$missing $p"; done
[ -z "$missing" ] && exit 0

if ! have apt-get; then
    echo "deps.sh: missing (Debian names):$missing; install them with this system's package manager" >&2
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
    sudo=
elif have sudo; then
    sudo=sudo
else
    echo "deps.sh: missing:$missing; as root run: apt-get update && apt-get install -y$missing" >&2
    exit 1
fi
# architectures named in pkg:arch that dpkg does not know yet
archs=
for p in $missing; do
    case $p in *:*) a=${p##*:}
        [ "$a" = "$(dpkg --print-architecture)" ] || dpkg --print-foreign-architectures | grep -qx "$a" ||
            case " $archs " in *" $a "*) ;; *) archs="$archs $a" ;; esac ;;
    esac
done
for a in $archs; do
    echo "deps.sh: dpkg --add-architecture $a"
    $sudo dpkg --add-architecture "$a" || { echo "deps.sh: dpkg --add-architecture $a failed" >&2; exit 1; }
done
echo "deps.sh: installing$missing (apt-get)"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null ||
    { echo "deps.sh: apt-get install$missing failed" >&2; exit 1; }
