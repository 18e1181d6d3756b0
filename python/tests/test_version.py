"""test_version.py — the package's version and wheel metadata. winattn.__version__ exists and is
the version of include/winattn.h (WINATTN_VERSION_*), its one source: the C library's wa_version()
and python/setup.py (the wheel's metadata) read the same macros. The wheel is tagged
py3-none-PLATFORM, never py3-none-any, because it carries libwinattn.so: checked on setup.py's
bdist_wheel class, without building a wheel (which would run make and write into the tree).
One line per case (PASS|FAIL|SKIP), closing "N passed, N failed". Run from the repository root:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_version.py
"""
import importlib.util
import os
import re
import sys
import sysconfig

import winattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(PY)


def header_version():
    with open(os.path.join(ROOT, "include", "winattn.h"), encoding="utf-8") as f:
        text = f.read()
    return ".".join(re.search(r"^#define WINATTN_VERSION_%s (\d+)$" % p, text, re.M).group(1)
                    for p in ("MAJOR", "MINOR", "PATCH"))


def load_setup():
    """python/setup.py as a module (its setup() call runs only as __main__); None without setuptools"""
    if importlib.util.find_spec("setuptools") is None:
        return None
    spec = importlib.util.spec_from_file_location("winattn_setup", os.path.join(PY, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pyproject():
    with open(os.path.join(PY, "pyproject.toml"), "rb") as f:
        data = f.read()
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        return None, data.decode()
    return tomllib.loads(data.decode()), data.decode()


@case("__version__")
def _():
    v = getattr(winattn, "__version__", None)
    report(isinstance(v, str) and re.fullmatch(r"\d+\.\d+\.\d+", v or "") is not None, "__version__ is MAJOR.MINOR.PATCH", repr(v))
    report(v == winattn.version(), "__version__ == winattn.version() (wa_version())", "%s, %s" % (v, winattn.version()))
    report(v == header_version(), "__version__ == include/winattn.h's WINATTN_VERSION_*", "%s, %s" % (v, header_version()))


setup_py = load_setup()


@case("setup.py version")
def _():
    if setup_py is None:
        return skip("setup.py version", "setuptools is not installed")
    report(setup_py.version() == winattn.__version__, "setup.py's version() == __version__",
           "%s, %s" % (setup_py.version(), winattn.__version__))


@case("pyproject metadata")
def _():
    meta, text = pyproject()
    if meta is None:
        report(re.search(r'^version\s*=', text, re.M) is None, "pyproject.toml states no version of its own")
        return skip("pyproject metadata", "tomllib needs Python 3.11")
    p = meta["project"]
    report("version" not in p and "version" in p.get("dynamic", []), "pyproject.toml: version dynamic (setup.py reads winattn.h)",
           str(p.get("dynamic")))
    report(p.get("license") == "MIT" and p.get("license-files") == ["LICENSE"], "pyproject.toml: license MIT, LICENSE shipped",
           "%r %r" % (p.get("license"), p.get("license-files")))
    with open(os.path.join(PY, "LICENSE"), encoding="utf-8") as f:
        lic = f.read()
    report(lic.startswith("MIT License") and "Copyright (c) 2026 the winattn authors" in lic,
           "python/LICENSE is the repository's MIT license")
    report(bool(p.get("authors")) and "readme" in p.get("dynamic", []) and len(p.get("classifiers", [])) >= 5,
           "pyproject.toml: authors, readme, classifiers", "%d classifiers" % len(p.get("classifiers", [])))
    report(not any(c.startswith("License ::") for c in p.get("classifiers", [])),
           "no License :: classifier beside the SPDX expression (PEP 639)")


@case("wheel tag")
def _():
    if setup_py is None or "bdist_wheel" not in setup_py.cmdclass:
        return skip("wheel tag", "no bdist_wheel here (setuptools >= 70.1 or the wheel package)")
    dist = setup_py.BinaryDistribution({"name": "winattn", "version": winattn.__version__, "packages": []})
    cmd = setup_py.cmdclass["bdist_wheel"](dist)
    cmd.ensure_finalized()
    tag = cmd.get_tag()
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    report(tag[:2] == ("py3", "none") and tag[2] != "any", "the wheel is tagged py3-none-PLATFORM", "-".join(tag))
    report(tag[2] == plat, "the wheel's platform is this one", "%s, %s" % (tag[2], plat))
    report(not cmd.root_is_pure, "the wheel is not pure (root_is_pure False)")


finish()
