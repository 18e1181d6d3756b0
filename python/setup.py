"""Builds libwinattn with the repository's Makefile and bundles the shared library in the
package, so that importing winattn needs no compiler. Run from a clone: pip install ./python
With torch importable at build time (`pip install --no-build-isolation ./python` in an environment
that has torch), winattn.torch's C++ eager path is built for that torch and bundled too; without
it, winattn.torch takes its Python path. WINATTN_BUILD names the Makefile's build folder (default
build/ of the clone).

The wheel holds a shared library for one platform, so it is tagged py3-none-PLATFORM (any
Python 3, no Python ABI: the library is loaded with ctypes), not py3-none-any. The version is
include/winattn.h's (WINATTN_VERSION_*), which wa_version() and winattn.__version__ report too."""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 has its own; before that, the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:  # no wheel can be built here anyway (pip installs one when it builds)
        _bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def version():
    """MAJOR.MINOR.PATCH from include/winattn.h"""
    with open(os.path.join(ROOT, "include", "winattn.h"), encoding="utf-8") as f:
        text = f.read()
    parts = [re.search(r"^#define WINATTN_VERSION_%s (\d+)$" % p, text, re.M) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError("include/winattn.h has no WINATTN_VERSION_MAJOR, _MINOR and _PATCH")
    return ".".join(m.group(1) for m in parts)


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


class build_with_make(build_py):
    def run(self):
        build_dir = os.path.abspath(os.environ.get("WINATTN_BUILD") or os.path.join(ROOT, "build"))
        subprocess.check_call(["make", "-C", ROOT, "BUILD=" + build_dir, "lib", "-j2"])
        shutil.copy(os.path.join(build_dir, "libwinattn.so"), os.path.join(HERE, "winattn", "libwinattn.so"))
        # optional: status 2 means no torch (or no compiler) here, anything else is reported
        status = subprocess.call([sys.executable, os.path.join(HERE, "build_torch_ext.py"), "--build", build_dir])
        if status == 0:
            for module in glob.glob(os.path.join(build_dir, "torch_ext", "torch-*", "_torch_ext*.so")):
                dest = os.path.join(HERE, "winattn", "torch_ext", os.path.basename(os.path.dirname(module)))
                os.makedirs(dest, exist_ok=True)
                shutil.copy(module, dest)
        elif status != 2:
            print("note: winattn.torch's C++ path did not build; winattn.torch will take its Python path")
        super().run()


class BinaryDistribution(Distribution):
    """a distribution with a platform's binary in it: the wheel's files go to its root (platlib),
    not under .data/purelib"""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": build_with_make}

if _bdist_wheel is not None:
    class bdist_wheel_platform(_bdist_wheel):
        """py3-none-PLATFORM: the package holds libwinattn.so for this platform and no extension
        module, so any Python 3 may load it, on this platform only."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = bdist_wheel_platform

if __name__ == "__main__":  # pip's build backend runs this file as __main__; the tests import it
    setup(version=version(), long_description=readme(), long_description_content_type="text/markdown",
          cmdclass=cmdclass, distclass=BinaryDistribution)
