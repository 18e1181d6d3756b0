#!/usr/bin/env python3
"""build_torch_ext.py — builds winattn.torch's C++ eager path (winattn/_torch_ext.cpp) against the
torch this Python imports, into BUILD/torch_ext/torch-VERSION/, where winattn.torch finds it next
to the library it loads (a module is tied to the torch it was built with, so each torch version
has a folder of its own). `make torch-ext` runs it; by hand, from the repository root:
    python3 python/build_torch_ext.py [--build build] [--quiet]
Needs a C++20 compiler (CXX, default c++), Python's headers and torch; about 30 s. The library
itself is not linked (winattn.torch hands the module its entry points), so the module is the same
for CPU-only and CUDA builds of torch. On failure a one-line reason and exit status 1, or 2 when
a prerequisite (torch, the compiler, Python's headers) is missing."""
import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SOURCE = os.path.join(HERE, "winattn", "_torch_ext.cpp")


def fail(message, status=1):
    print("build_torch_ext.py: " + message, file=sys.stderr)
    sys.exit(status)


def missing(message):
    """a prerequisite is absent (exit status 2, which `make test` reports as a skip, not a failure)"""
    fail(message, 2)


def ext_files():
    """winattn/_ext_files.py, loaded by its path: where winattn.torch looks for the module and the
    source hash it checks, without importing the package (which loads the library)"""
    spec = importlib.util.spec_from_file_location("_winattn_ext_files", os.path.join(HERE, "winattn", "_ext_files.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(torch, target, digest):
    cxx = shlex.split(os.environ.get("CXX", "c++"))  # "ccache g++" is a compiler too
    if not cxx or shutil.which(cxx[0]) is None:
        missing("no C++ compiler (%s); install g++ (Debian: build-essential) or set CXX" % os.environ.get("CXX", "c++"))
    python_include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(python_include, "Python.h")):
        missing("Python's headers are missing (%s/Python.h); install them (Debian: python3-dev)" % python_include)
    # torch's headers and libraries as torch.utils.cpp_extension finds them (without importing it,
    # which warns on a machine without CUDA)
    torch_home = os.path.dirname(os.path.abspath(torch.__file__))
    torch_include = os.path.join(torch_home, "include")
    torch_lib = os.path.join(torch_home, "lib")
    if not os.path.exists(os.path.join(torch_include, "torch", "extension.h")):
        missing("this torch has no C++ headers (%s/torch/extension.h)" % torch_include)
    # the flags torch's own extension builder passes: its C++ ABI and pybind11's, so that the module
    # and torch agree on std::string and on pybind11's internals
    defines = ["-DTORCH_EXTENSION_NAME=_torch_ext", "-DTORCH_API_INCLUDE_EXTENSION_H",
               '-DWA_TORCH_VERSION="%s"' % torch.__version__, '-DWA_EXT_SOURCE_HASH="%s"' % digest,
               "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI)]
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
        value = getattr(torch._C, "_PYBIND11_" + name, None)
        if value is not None:
            defines.append('-DPYBIND11_%s="%s"' % (name, value))
    return (cxx + ["-O2", "-shared", "-fPIC", "-std=c++20", "-fvisibility=hidden", "-w"] + defines +
            ["-I" + os.path.join(ROOT, "include"), "-I" + python_include] +
            ["-I" + torch_include, "-I" + os.path.join(torch_include, "torch", "csrc", "api", "include")] +
            [SOURCE, "-o", target, "-L" + torch_lib, "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
             "-Wl,-rpath," + torch_lib])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build folder (default: build)")
    ap.add_argument("--quiet", action="store_true", help="print nothing on success")
    ap.add_argument("--force", action="store_true", help="build even when the module is up to date")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        missing("torch is not importable (%s)" % e)
    files = ext_files()
    target = files.module_path(a.build, torch.__version__)
    out = os.path.dirname(target)
    stamp = target + ".source"  # the source hash it was built from
    digest = files.source_hash()
    if not a.force and os.path.exists(target) and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == digest:
                if not a.quiet:
                    print("%s is up to date for torch %s" % (os.path.relpath(target), torch.__version__))
                return
    # compiled beside its place and renamed into it: a failed or interrupted build leaves no module
    try:
        os.makedirs(out, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=".partial-", suffix=".so", dir=out)
    except OSError as e:
        fail("cannot write in %s: %s" % (out, e.strerror))
    os.close(fd)
    try:
        t = time.perf_counter()
        r = subprocess.run(command(torch, partial, digest), capture_output=True, text=True)
        if r.returncode != 0:
            errors = [line for line in r.stderr.splitlines() if "error" in line] or r.stderr.splitlines()
            fail("compiling %s failed: %s" % (os.path.relpath(SOURCE, ROOT), (errors or ["(no output)"])[0]))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o755 & ~umask)  # mkstemp made it private; a module is for every user
        os.replace(partial, target)
        with open(stamp, "w") as f:
            f.write(digest + "\n")
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    if not a.quiet:
        print("built %s for torch %s in %.0f s" % (os.path.relpath(target), torch.__version__, time.perf_counter() - t))


if __name__ == "__main__":
    main()
