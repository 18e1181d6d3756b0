"""Builds libwinattn with the repository's Makefile and bundles the shared library in the
package, so that importing winattn needs no compiler. Run from a clone: pip install ./python
With torch importable at build time (`pip install --no-build-isolation ./python` in an environment
that has torch), winattn.torch's C++ eager path is built for that torch and bundled too; without
it, winattn.torch takes its Python path."""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class build_with_make(build_py):
    def run(self):
        build_dir = os.path.join(ROOT, "build")
        subprocess.check_call(["make", "-C", ROOT, "lib", "-j2"])
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


setup(cmdclass={"build_py": build_with_make})
