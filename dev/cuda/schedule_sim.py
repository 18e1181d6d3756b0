#!/usr/bin/env python3
"""schedule_sim.py — how evenly a grid of CTAs with unequal work fills the H200's 132 SMs, one CTA
per SM at a time, the next CTA in launch order taking the first SM that frees (a greedy list
schedule, as the hardware's block scheduler behaves to a first approximation). Prints the
makespan over the ideal (total work / SMs) for the version-4 dK/dV kernel at shape (b) (Hkv = 8,
key tiles of 128, window 4096) in the grid's own order (all tiles of head 0, then head 1, ...),
across heads (each tile index in every head before the next: heaviest_first<true> in
src/cuda/mma_prims.cuh) and sorted longest first; and the same for the forward (query tiles of
128, last first). Work of a CTA: the query tiles (dK/dV) or key tiles (forward) it visits, plus
half a tile for its start. No GPU needed:
    python3 dev/cuda/schedule_sim.py"""
import heapq


def makespan(works, sms=132):
    free = [0.0] * sms
    for w in works:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free) / (sum(works) / sms)


def dkdv_work(n, window, keys=128, heads=8, tile_q=64):
    """[head][key tile] -> query tiles visited (causal sliding window of `window` keys)"""
    return [[(min(n, kb * keys + keys + window) - kb * keys + tile_q - 1) // tile_q + 0.5 for kb in range(n // keys)]
            for _ in range(heads)]


def fwd_work(n, window, bm=128, bn=128, heads=32):
    return [[(qb * bm + bm - max(0, qb * bm - window)) / bn + 0.5 for qb in reversed(range(n // bm))] for _ in range(heads)]


def main():
    for name, grid in (("dK/dV", dkdv_work), ("forward", fwd_work)):
        for n in (8192, 32768):
            w = grid(n, 4096)
            head_major = [x for head in w for x in head]
            across = [w[h][t] for t in range(len(w[0])) for h in range(len(w))]
            print("%-7s (b) N=%5d: grid order %.3f, across heads %.3f, longest first %.3f" % (
                name, n, makespan(head_major), makespan(across), makespan(sorted(head_major, reverse=True))))


if __name__ == "__main__":
    main()
