#!/usr/bin/env python3
"""dq_order_sim.py — the ordered dQ's step orders on paper: for the version-4 dK/dV kernel (key
tiles of 128, query tiles of 64, the group's query heads per CTA) at a window geometry, each CTA
(key tile, KV head) launched across heads (heaviest_first<true>; --bands G: across G heads at a
time, band after band, as -DWA_DKDV_HEAD_BAND=G, 1 head-major), one per SM at a time on 132 SMs,
each step one unit of time. A step's dQ share may be added only after the lower key tile's share
of the same block is counted in (WA_DQ_ORDER_LAG 1: when that CTA issues its next share), so a
CTA can wait; the script prints, per step order,
  - the makespan over the ideal (all steps / SMs), with the waits and without them (the fused form);
  - the share of block touches (the Q, dO and dQ accumulator tiles of one query head and tile:
    64 KB at D = 128) that miss an LRU cache of the L2's 50 MB, touches taken in time order on the
    schedule without the waits: the dQ reduce-adds and the Q / dO loads of a block that left L2 go
    to HBM.
Orders: `fused` (the default form, no order: head by head, each head's tiles from the first); `N`
(each CTA's tiles from the last, the group's heads in chunks of N, each chunk tile by tile with its
heads inside: `4` is all of a group of four inside, `1` head by head); `N/M` (M for the walks that
end at the last query tile). bwd_hopper.cu's step_walk is `1/4` at a group of four (`4` before
33455c4); the fused form's walk has no waits, so its row shows the time without them alone.
No GPU needed:
    python3 dev/cuda/dq_order_sim.py [--n 8192,32768] [--window 4096] [--hq 32 --hkv 8] [--orders ...] [--bands 0,4,2,1]"""
import argparse
import heapq
from collections import OrderedDict


def walk(n_key_tile, nq_tiles, left, right, keys=128, tq=64):
    """the query tiles a key tile's CTA visits (a window of `left` keys back, `right` ahead)"""
    j0, j1 = n_key_tile * keys, n_key_tile * keys + keys - 1
    lo = max(0, (j0 - right) // tq) if right >= 0 else 0
    hi = min(nq_tiles - 1, (j1 + left) // tq) if left >= 0 else nq_tiles - 1
    return list(range(lo, hi + 1))


def steps_of(order, tiles, group, clipped):
    """order: fused, or "HI" / "HI/HC": the query tiles from the last with HI of the group's heads
    inside (the heads in groups of HI, each group's tiles in turn), HC inside for clipped walks"""
    if order == "fused":
        return [(h, t) for h in range(group) for t in tiles]
    hi, _, hc = order.partition("/")
    inside = int(hc) if (hc and clipped) else int(hi)
    return [(g + h, t) for g in range(0, group, inside) for t in reversed(tiles) for h in range(inside)]


def simulate(n, window, hq, hkv, order, ordered, sms=132, l2_blocks=800, count_misses=True, band=0, tail=0):
    keys, tq = 128, 64
    nq_tiles, nk_tiles, group = n // tq, n // keys, hq // hkv
    walks = [walk(k, nq_tiles, window - 1, 0) for k in range(nk_tiles)]
    last = nq_tiles - 1
    # CTAs in launch order: each key tile in every KV head of the band before the next key tile
    # (band 0: one band of all heads); the last `tail` key tiles of every head after all bands,
    # across all heads
    g = band if band > 0 else hkv
    banded = max(0, nk_tiles - tail)
    ctas = [(k, hk) for h0 in range(0, hkv, g) for k in range(banded) for hk in range(h0, min(h0 + g, hkv))]
    ctas += [(k, hk) for k in range(banded, nk_tiles) for hk in range(hkv)]
    # count[(hk, h, t)] -> list of (key tile, time counted)
    counted = {}
    touches = []  # (time, block)
    free = [0.0] * sms
    heapq.heapify(free)
    done_total = 0
    for k, hk in ctas:
        start = heapq.heappop(free)
        seq = steps_of(order, walks[k], group, walks[k][-1] == last)
        # one staging buffer per warpgroup: the consumers stage share i once its products are done
        # and the writer has issued share i - 1; the writer issues share i once it is staged and
        # the lower key tile's share of the block is counted
        staged, issued = start, start
        issue = []
        for h, qt in seq:
            staged = max(staged + 1.0, issued)
            issued = staged
            if ordered and k > 0:
                prev = counted.get((hk, h, qt))
                if prev is not None and prev[0] == k - 1:  # the lower key tile adds to this block
                    issued = max(issued, prev[1])
            issue.append(issued)
            touches.append((issued, (hk, h, qt)))
        t = issued
        # LAG 1: a share is counted when the CTA issues its next share (the last at its end)
        for i, (h, qt) in enumerate(seq):
            counted[(hk, h, qt)] = (k, issue[i + 1] if i + 1 < len(seq) else issue[i])
        done_total += len(seq)
        heapq.heappush(free, t)
    makespan = max(free) / (done_total / sms)
    if not count_misses:
        return makespan, float("nan")
    # LRU over the touches in time order
    touches.sort(key=lambda x: x[0])
    lru, miss = OrderedDict(), 0
    for _, blk in touches:
        if blk in lru:
            lru.move_to_end(blk)
        else:
            miss += 1
            lru[blk] = True
            if len(lru) > l2_blocks:
                lru.popitem(last=False)
    return makespan, miss / len(touches)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="8192,32768")
    ap.add_argument("--window", type=int, default=4096, help="keys a query sees (0: causal, no left bound)")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--orders", default="fused,4,1,2,1/4,2/4")
    ap.add_argument("--l2-blocks", type=int, default=800)
    ap.add_argument("--bands", default="0", help="CTA launch orders: G KV heads at a time (0: all, the default order; 1: head-major)")
    ap.add_argument("--tails", default="0", help="with bands: the last R key tiles of every head after all bands, across heads")
    a = ap.parse_args()

    def ints(flag, text, what):
        """the comma-separated integers of a flag, or its one-line error"""
        try:
            return [int(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag} takes {what} separated by commas, not {text!r}")

    lengths = ints("--n", a.n, "lengths")
    if any(n < 128 for n in lengths):
        ap.error("--n: every length is at least 128 (one key tile)")
    if a.hkv < 1 or a.hq < a.hkv or a.hq % a.hkv:
        ap.error(f"--hq {a.hq} is not a positive multiple of --hkv {a.hkv}")
    if a.window < 0 or a.l2_blocks < 1:
        ap.error("--window is 0 (causal) or more, --l2-blocks 1 or more")
    bands = ints("--bands", a.bands, "head counts")
    if any(b < 0 for b in bands):
        ap.error("--bands: 0 (all heads) or a positive head count")
    tails = ints("--tails", a.tails, "key tile counts")
    if any(t < 0 for t in tails):
        ap.error("--tails: 0 or more key tiles")
    for order in a.orders.split(","):
        parts = order.split("/")
        if order != "fused" and not (len(parts) <= 2 and all(p.isdigit() and int(p) > 0 for p in parts)):
            ap.error(f"--orders: {order!r} is not fused, N or N/M (N, M positive)")
    print(f"Hq {a.hq}, Hkv {a.hkv}, window {a.window}: makespan / ideal (fused form | ordered), L2 misses per block touch")
    for n in lengths:
        for band in bands:
            for tail in tails if band else [0]:
                for order in a.orders.split(","):
                    m0, miss = simulate(n, a.window, a.hq, a.hkv, order, False, l2_blocks=a.l2_blocks, band=band, tail=tail)
                    m1, _ = (simulate(n, a.window, a.hq, a.hkv, order, True, count_misses=False, band=band, tail=tail)
                             if order != "fused" else (float("nan"), 0))
                    bname = "all" if band == 0 else str(band)
                    print(f"  N {n:6d}  band {bname:3s} tail {tail:3d}  {order:8s}  {m0:5.3f} | {m1:5.3f}   misses {miss:6.1%}")


if __name__ == "__main__":
    main()
