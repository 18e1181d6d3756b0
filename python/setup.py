"""Builds libwinattn with the repository's Makefile and bundles the shared library in the
package, so that importing winattn needs no compiler. Run from a clone: pip install ./python"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class build_with_make(build_py):
    def run(self):
        build_dir = os.path.join(ROOT, "build")
        subprocess.check_call(["make", "-C", ROOT, "lib", "-j2"])
        shutil.copy(os.path.join(build_dir, "libwinattn.so"), os.path.join(HERE, "winattn", "libwinattn.so"))
        super().run()


setup(cmdclass={"build_py": build_with_make})
