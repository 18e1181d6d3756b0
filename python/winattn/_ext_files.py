"""Where winattn.torch's C++ module (_torch_ext.cpp) lives and what it was built from. Shared by
winattn.torch, which loads the module, and python/build_torch_ext.py, which builds it and loads this
file by its path (so that building imports neither the package nor the library); the two must agree
on both or a fresh module would never load. Imports nothing but the standard library."""
import hashlib
import os
import sysconfig

MODULE_FILE = "_torch_ext" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = (os.path.join(_HERE, "..", "..", "include", "winattn.h"), os.path.join(_HERE, "_torch_ext.cpp"))


def module_path(home, torch_version):
    """the module built for that torch version under home (a build folder or the installed package;
    a version of "*" makes a glob pattern for any)"""
    return os.path.join(home, "torch_ext", "torch-" + torch_version, MODULE_FILE)


def source_hash():
    """a hash of winattn.h and _torch_ext.cpp, which the module carries from its build; None where
    they are not both there (an installed package has no header)"""
    if not all(os.path.exists(f) for f in SOURCES):
        return None
    h = hashlib.sha256()
    for f in SOURCES:
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]
