#!/usr/bin/env python3
"""schedule_sim.py — how evenly a grid of CTAs with unequal work fills the H200's 132 SMs, one CTA
per SM at a time, the next CTA in launch order taking the first SM that frees (a greedy list
schedule, as the hardware's block scheduler behaves to a first approximation). Prints the
makespan over the ideal (total work / SMs) for the version-4 dK/dV kernel at shape (b) (Hkv = 8,
key tiles of 128, window 4096) in the grid's own order (all tiles of head 0, then head 1, ...),
across heads (each tile index in every head before the next: heaviest_first<true> in
src/cuda/mma_prims.cuh) and sorted longest first; and the same for the forward (query tiles of
128, last first). Work of a CTA: the query tiles (dK/dV) or key tiles (forward) it visits, plus
half a tile for its start. Then the D = 512 forward (query tiles of 64, key tiles of 64, Hq = 32)
at (c) and with a 1024 window: the grid's CTAs scheduled greedily against the persistent kernel's
static deals (WA_FWD512_PERSIST in src/cuda/fwd_hopper.cu: CTA c takes items c, c + 132, ... of
order 1, head by head, or of order 2, tile by tile across heads, every other round reversed),
each item costing its key tiles plus a fixed cost in tiles (4.8: what the windowed shape's
figures imply for a non-persistent CTA; 1.5). No GPU needed:
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


def static_deal(works, sms=132, snake=False):
    """the largest CTA's work over the ideal when CTA c takes items r * sms + c (r * sms + sms - 1 - c
    in odd rounds with snake)"""
    load = [0.0] * sms
    for i, w in enumerate(works):
        r, c = divmod(i, sms)
        load[sms - 1 - c if snake and r % 2 else c] += w
    return max(load) / (sum(works) / sms)


def wide_fwd_items(n, window, heads=32, tile=64):
    """[head][query tile, last first] -> key tiles (causal, or a sliding window of `window` keys)"""
    def tiles(t):
        return t + 1 if window is None else t - max(0, (t * tile - window + 1) // tile) + 1
    return [[tiles(t) for t in reversed(range(n // tile))] for _ in range(heads)]


def main():
    for name, grid in (("dK/dV", dkdv_work), ("forward", fwd_work)):
        for n in (8192, 32768):
            w = grid(n, 4096)
            head_major = [x for head in w for x in head]
            across = [w[h][t] for t in range(len(w[0])) for h in range(len(w))]
            print("%-7s (b) N=%5d: grid order %.3f, across heads %.3f, longest first %.3f" % (
                name, n, makespan(head_major), makespan(across), makespan(sorted(head_major, reverse=True))))
    for label, n, window in (("(c) 8K", 8192, None), ("(c) 16K", 16384, None), ("w1024 16K", 16384, 1024)):
        w = wide_fwd_items(n, window)
        for fixed in (4.8, 1.5):
            order1 = [x + fixed for head in w for x in head]
            order2 = [w[h][t] + fixed for t in range(len(w[0])) for h in range(len(w))]
            print("D=512 forward %-9s fixed %.1f: grid, greedy %.3f; persistent order 1 %.3f, order 2 %.3f" % (
                label, fixed, makespan(order1), static_deal(order1), static_deal(order2, snake=True)))


if __name__ == "__main__":
    main()
