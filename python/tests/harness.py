"""The Python tests' report format (docs/design.md §4): one PASS|FAIL|SKIP line per case, a closing
"N passed, N failed" line, exit status 1 on any failure."""
import sys
import traceback

counts = {"passed": 0, "failed": 0, "skipped": 0}


def report(ok, name, detail=""):
    print("%s python %s%s" % ("PASS" if ok else "FAIL", name, (" " + detail) if detail else ""), flush=True)
    counts["passed" if ok else "failed"] += 1


def skip(name, why):
    counts["skipped"] += 1
    print("SKIP python %s: %s" % (name, why), flush=True)


def case(name):
    """Runs the decorated function at once; an exception is one failure, named after the case,
    with the traceback's last line."""
    def wrap(fn):
        try:
            fn()
        except Exception:
            report(False, name, traceback.format_exc().strip().splitlines()[-1])
        return fn
    return wrap


def expect_error(name, call, exc, text):
    """A case that passes when call() raises exc with text in its message."""
    try:
        call()
        report(False, name, "no error raised")
    except exc as e:
        report(text in str(e), "%s raises %s" % (name, exc.__name__), str(e).splitlines()[0])


def finish():
    c = counts
    print("%d passed, %d failed%s" % (c["passed"], c["failed"], ", %d skipped" % c["skipped"] if c["skipped"] else ""))
    sys.exit(1 if c["failed"] else 0)
