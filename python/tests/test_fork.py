"""test_fork.py — winattn in processes forked after the parent used it: Python's multiprocessing
with the "fork" start method (the default on Linux before Python 3.14). The child inherits the
library's context, whose worker threads it does not have; its calls must finish and give the
parent's results bit for bit. A hang fails the case after a timeout instead of stopping the suite.
Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_fork.py
"""
import multiprocessing
import os
import sys

import numpy as np

import winattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

TIMEOUT_S = 20


def inputs(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 300, 32), dtype=np.float32)
    k = rng.standard_normal((2, 2, 300, 32), dtype=np.float32)
    v = rng.standard_normal((2, 2, 300, 32), dtype=np.float32)
    do = rng.standard_normal((2, 4, 300, 32), dtype=np.float32)
    return q, k, v, do


def forward_backward(seed):
    q, k, v, do = inputs(seed)
    o, lse = winattn.attention(q, k, v, window=(99, 0), return_lse=True)
    dq, dk, dv = winattn.attention_backward(q, k, v, o, lse, do, window=(99, 0))
    return [a.tobytes() for a in (o, lse, dq, dk, dv)]


def in_children(method, seeds):
    """forward_backward(seed) for each seed in a pool of 2 processes started by method; the results,
    or the reason there are none."""
    ctx = multiprocessing.get_context(method)
    pool = ctx.Pool(2)
    try:
        return pool.map_async(forward_backward, seeds).get(timeout=TIMEOUT_S), None
    except multiprocessing.TimeoutError:
        return None, "hung: no result within %d s" % TIMEOUT_S
    finally:
        pool.terminate()
        pool.join()


def main():
    # forkserver and spawn children import this file again: everything runs from here only
    if "fork" not in multiprocessing.get_all_start_methods():
        skip("fork", "this platform has no fork start method")
    else:
        seeds = [1, 2, 3, 4]
        # the parent uses the library first, so its context (and worker threads) exist before the fork
        expected = [forward_backward(s) for s in seeds]

        @case("multiprocessing fork: children of a process that used winattn")
        def _():
            got, why = in_children("fork", seeds)
            if got is None:
                report(False, "multiprocessing fork: children of a process that used winattn", why)
                return
            same = all(g == e for g, e in zip(got, expected))
            report(same, "multiprocessing fork: children of a process that used winattn",
                   "bit-identical to the parent" if same else "results differ from the parent's")

        @case("multiprocessing fork: the parent after its children")
        def _():
            same = all(forward_backward(s) == e for s, e in zip(seeds, expected))
            report(same, "multiprocessing fork: the parent after its children",
                   "bit-identical" if same else "results differ")

        if "forkserver" in multiprocessing.get_all_start_methods():
            @case("multiprocessing forkserver")
            def _():
                got, why = in_children("forkserver", seeds[:2])
                ok = got is not None and all(g == e for g, e in zip(got, expected))
                report(ok, "multiprocessing forkserver", why or ("bit-identical" if ok else "results differ"))
    finish()


if __name__ == "__main__":
    main()
