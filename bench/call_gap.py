#!/usr/bin/env python3
"""call_gap.py — where the per-call figure of bench/gpu_peers.py loses to its steady one: on the host
or on the GPU. For each system, case and pass, alternating the systems, medians over --reps of:
  - per call: one call between a pair of CUDA events, then a synchronisation (gpu_peers' "per call":
    the GPU waits for the host's work before the first kernel and between kernels it launches late);
  - hidden: the same call queued behind torch.cuda._sleep (--sleep-ms of GPU spinning), so that the
    host has issued all of it before the first event fires: the call's GPU time with no host wait;
  - steady: ten calls back to back between one pair (gpu_peers' "steady");
  - host: the wall time of the call's Python-level function alone (no synchronisation inside),
    from the per-call timings; host behind: the same from the hidden ones, where the GPU is still
    spinning: a host that waits for the call's own kernels waits for the spin too, and reads
    about --sleep-ms more.
per call minus hidden is the host's share of the per-call time; hidden against steady is the GPU's
(clocks: a call after an idle GPU against ten in a row). --cpu-ops N then lists, per system, case
and pass, the N host operations with the most time of their own over three calls (PyTorch's
profiler, CPU activity alone): where the host's time goes. From the repository root on the GPU
machine, the peers installed where --peers-dir says (bench/peer_wheels.py), after a build:
    python3 bench/call_gap.py [--systems winattn,fa4] [--cases b:32768,cw:16384] [--passes fwd,bwd]
        [--reps 5] [--sleep-ms 20] [--cpu-ops 12] [--peers-dir /tmp/winattn-peers]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import torch  # noqa: E402

import gpu_peers  # noqa: E402


def per_call(fn, sleep_ms=0.0):
    """(GPU ms between the events, host ms of fn) for one call, after a synchronisation; with
    sleep_ms the events and the call queue behind that much GPU spinning"""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep_ms:
        gpu_peers.spin_gpu(sleep_ms)
    a.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b), host


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="winattn")
    ap.add_argument("--cases", type=gpu_peers.shape_cases, default="b:32768,cw:16384",
                    help="SHAPE:N of bench/gpu_peers.py's shapes")
    ap.add_argument("--passes", default="fwd,bwd")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="GPU spinning ahead of a hidden call")
    ap.add_argument("--cpu-ops", type=int, default=0, help="list the host operations with the most time of their own")
    ap.add_argument("--peers-dir", help="where bench/peer_wheels.py installed the peers")
    a = ap.parse_args()
    passes = a.passes.split(",")
    if any(p not in ("fwd", "bwd") for p in passes) or a.reps < 1 or a.sleep_ms <= 0:
        ap.error("--passes is fwd and/or bwd, --reps 1 or more, --sleep-ms above 0")
    if a.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(a.peers_dir, "call_gap")
    print("call_gap: %s, torch %s" % (torch.cuda.get_device_name(), torch.__version__))
    print("| case | system | pass | per call ms | hidden ms | steady ms | host ms | host behind ms | per call − hidden | hidden − steady |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, n in a.cases:
        trials = gpu_peers.trials_at(a.systems.split(","), n, gpu_peers.SHAPE_OF[label],
                                     lambda name, error: print("| (%s) %d | %s | - | %s |" % (label, n, name, error)))
        for pname in passes:
            got = {t.name: {"call": [], "hidden": [], "steady": [], "host": [], "behind": []} for t in trials}
            for r in range(a.reps):
                for t in gpu_peers.rotated(trials, r):
                    fn = t.fwd if pname == "fwd" else t.bwd
                    ms, host = per_call(fn)
                    got[t.name]["call"].append(ms)
                    got[t.name]["host"].append(host)
                    ms, host = per_call(fn, a.sleep_ms)
                    got[t.name]["hidden"].append(ms)
                    got[t.name]["behind"].append(host)
                    got[t.name]["steady"].append(gpu_peers.time_once(fn, 10) * 1e3)
            for t in trials:
                m = {k: statistics.median(v) for k, v in got[t.name].items()}
                print("| (%s) %d | %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
                    label, n, t.name, pname, m["call"], m["hidden"], m["steady"], m["host"], m["behind"], m["call"] - m["hidden"],
                    m["hidden"] - m["steady"]), flush=True)
        for t in trials if a.cpu_ops > 0 else []:
            for pname in passes:
                fn = t.fwd if pname == "fwd" else t.bwd
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        fn()
                        torch.cuda.synchronize()
                print("\n(%s) %d, %s %s, three calls:" % (label, n, t.name, pname))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.cpu_ops), flush=True)
        del trials
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
