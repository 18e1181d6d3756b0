"""Context parallelism for winattn on torch.distributed: one sequence sharded across ranks, each rank
holding q, k and v of its own tokens ([B, H, N_local, D], as winattn.torch.attention takes them).

    import winattn.distributed as cp
    layout = cp.Layout.load_balanced(N, world)            # or Layout.contiguous(N, world)
    q, k, v = (layout.shard(t, rank) for t in (q_full, k_full, v_full))
    o = cp.attention(q, k, v, layout, window=(1023, 0))   # [B, Hq, N_local, D], differentiable

Two ways to get the keys a rank's queries need (docs/context-parallel.md has the derivations and
the numbers):

- halo (windows bounded on both sides): each of the rank's runs of tokens needs `left` keys
  before it and `right` after; these halos come point to point (isend/irecv) from the ranks that
  hold them, several ranks when the window is wider than their shards. The backward returns the
  halo's dK/dV to their owners, which add them to their own.
- gather (a side unbounded: causal global layers, full attention): K and V are all-gathered (they
  have few heads: Gemma 4's global layers have 4, or 1 in smaller models); the backward
  reduce-scatters dK/dV.

Each run of the rank's queries [a, b) then makes one rectangular winattn call against keys
[lo, hi) = [a - left, b + right] clipped to the sequence. winattn aligns the last query with the
last key (offset Nk - Nq = (a - lo) + (hi - b)); to keep query i seeing keys i - left .. i + right
the call's window is (left + (hi - b), right - (hi - b)), and unbounded sides stay -1.

Layouts: `contiguous` (rank r holds one run; for models with sliding layers only) or
`load_balanced` (the sequence cut into 2R chunks, rank r holding chunks r and 2R-1-r, so that
under a causal mask every rank has the same work). A model uses one layout for all its layers;
the sliding layers then fetch a halo for each of a rank's two runs (rank R-1's two chunks are
adjacent and run as one). Shards may be uneven (any sizes, including 0).

The transformers side: `register()` adds the attention implementation "winattn_cp"; inside
`use_layout(layout)` each attention layer of the model runs through attention() on the rank's
shard. `shard_causal_lm_batch` gives a rank's input_ids, position_ids (global positions) and
labels (shifted before sharding), `causal_lm_loss` the rank's share of the mean loss.
"""
import contextlib
import ctypes

import torch
import torch.distributed as dist

from . import _lib
from . import torch as _wt  # its library contexts (one per device and stream) and tensor descriptors
from .transformers import _refuse_unsupported, _window  # shared with the one-device backend

__all__ = ["Layout", "attention", "register", "use_layout", "attention_forward", "mask_builder",
           "shard_causal_lm_batch", "causal_lm_loss"]


# ---- layouts: which rank holds which tokens ----

class Layout:
    """Which rank holds which tokens of a sequence of n tokens, in which local order. Built from
    chunks (start, end, rank) in global order covering [0, n); a rank's local tokens are its
    chunks in ascending global order, end to end. Every rank must use an equal Layout."""

    def __init__(self, chunks, world):
        world = int(world)
        if world < 1:
            raise ValueError("winattn: world size must be >= 1, got %d" % world)
        merged, pos = [], 0
        for s, e, r in chunks:
            s, e, r = int(s), int(e), int(r)
            if s != pos or e < s or not 0 <= r < world:
                raise ValueError("winattn: layout chunks must cover [0, n) in order with ranks in [0, %d); "
                                 "got (%d, %d, %d) at position %d" % (world, s, e, r, pos))
            pos = e
            if e == s:
                continue
            if merged and merged[-1][2] == r:  # adjacent chunks of one rank are one run
                merged[-1] = (merged[-1][0], e, r)
            else:
                merged.append((s, e, r))
        self.n, self.world = pos, world
        self.runs = tuple(merged)  # (start, end, rank), global order, maximal
        self._local = [[] for _ in range(world)]  # per rank: (start, end, local offset)
        length = [0] * world
        for s, e, r in self.runs:
            self._local[r].append((s, e, length[r]))
            length[r] += e - s
        self._length = length
        self._key = (self.runs, world)

    @classmethod
    def contiguous(cls, n, world, sizes=None):
        """Rank r holds tokens [sum(sizes[:r]), sum(sizes[:r+1])); by default n split as evenly as
        possible (the first n % world ranks one token more)."""
        if sizes is None:
            sizes = [n // world + (r < n % world) for r in range(world)]
        if len(sizes) != world or sum(sizes) != n or min(sizes) < 0:
            raise ValueError("winattn: sizes %r do not split %d tokens over %d ranks" % (list(sizes), n, world))
        chunks, s = [], 0
        for r, size in enumerate(sizes):
            chunks.append((s, s + size, r))
            s += size
        return cls(chunks, world)

    @classmethod
    def load_balanced(cls, n, world):
        """The sequence cut into 2*world chunks (as evenly as possible, the first n % (2*world)
        one token longer); rank r holds chunks r and 2*world-1-r, so under a causal mask every
        rank has the same number of (query, key) pairs."""
        c = 2 * world
        sizes = [n // c + (i < n % c) for i in range(c)]
        chunks, s = [], 0
        for i, size in enumerate(sizes):
            chunks.append((s, s + size, i if i < world else c - 1 - i))
            s += size
        return cls(chunks, world)

    def __eq__(self, other):
        return isinstance(other, Layout) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return "Layout(n=%d, world=%d, runs=%r)" % (self.n, self.world, self.runs)

    def local_length(self, rank):
        return self._length[rank]

    def ranges(self, rank):
        """The rank's runs as (start, end, local offset), ascending."""
        return list(self._local[rank])

    def pieces(self, lo, hi):
        """(start, end, rank, local offset of start) for the runs' parts inside [lo, hi)."""
        out = []
        for s, e, r in self.runs:
            a, b = max(s, lo), min(e, hi)
            if a < b:
                off = next(o for s2, _, o in self._local[r] if s2 == s)
                out.append((a, b, r, off + a - s))
        return out

    def positions(self, rank, device=None):
        """The global positions of the rank's tokens (position_ids for RoPE), int64 [N_local]."""
        idx = [torch.arange(s, e) for s, e, _ in self._local[rank]]
        out = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
        return out.to(device) if device is not None else out

    def shard(self, x, rank, dim=2):
        """The rank's part of a full-sequence tensor x (tokens along dim), a new tensor."""
        if x.shape[dim] != self.n:
            raise ValueError("winattn: dim %d of x has %d tokens, the layout %d" % (dim, x.shape[dim], self.n))
        parts = [x.narrow(dim, s, e - s) for s, e, _ in self._local[rank]]
        return torch.cat(parts, dim) if parts else x.narrow(dim, 0, 0).clone()

    def unshard(self, parts, dim=2):
        """The full sequence from every rank's part (a list indexed by rank)."""
        if len(parts) != self.world:
            raise ValueError("winattn: %d parts for %d ranks" % (len(parts), self.world))
        pieces = []
        for s, e, r in self.runs:
            off = next(o for s2, _, o in self._local[r] if s2 == s)
            pieces.append(parts[r].narrow(dim, off, e - s))
        return torch.cat(pieces, dim)

    def gather(self, x, dim=2, group=None):
        """The full sequence of a sharded tensor, gathered from every rank (not differentiable):
        for logits, outputs, checks."""
        world = dist.get_world_size(group)
        n_max = max(self._length)
        x = x.movedim(dim, 0)
        buf = x.new_zeros((n_max,) + tuple(x.shape[1:]))
        buf[:x.shape[0]] = x
        out = x.new_empty((world, n_max) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out.flatten(0, 1), buf.contiguous(), group=group)
        return self.unshard([out[r, :self._length[r]] for r in range(world)], 0).movedim(0, dim)


# ---- plans: what each rank computes and exchanges ----

def _merge(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if lo >= hi:
            continue
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class _Call:
    """One rectangular winattn call: local query rows q0 .. q0+nq, keys [lo, hi) of the sequence,
    window (left, right) in the call's own (bottom-right) frame, and where each key comes from:
    pieces (start, end, source, offset) with source "own" (offset into the local k and v), a peer
    rank (offset into that peer's message) or "all" (the gathered sequence). direct: the keys are
    one run of the local k and v (offset k0), read in place; else they are assembled in a buffer."""

    def __init__(self, q0, nq, lo, hi, left, right, pieces):
        self.q0, self.nq, self.lo, self.hi = q0, nq, lo, hi
        self.left, self.right, self.pieces = left, right, pieces
        self.direct = len(pieces) == 1 and pieces[0][2] == "own"
        self.k0 = pieces[0][3] if self.direct else None


def _key_range(a, b, n, left, right):
    lo = 0 if left < 0 else max(0, a - left)
    hi = n if right < 0 else min(n, b + right)
    return lo, hi


def _call_window(b, hi, left, right):
    """The (left, right) of a call with queries ending at b and keys at hi (module docstring).
    Where the keys start does not enter: keys before a - left are outside the window anyway."""
    hr = hi - b
    return (-1 if left < 0 else left + hr), (-1 if right < 0 else right - hr)


# Edges are whole multiples of this many queries, so that the interior call's key offset
# (Nk - Nq) is a multiple of the kernels' tiles: at offset 1023 the forward of a 16K sliding
# layer's calls took 14 % longer than at 1024 on an H200 (docs/context-parallel.md).
_EDGE_ALIGN = 128


def _split(s, e, n, left, right):
    """The queries of run [s, e) cut into a left edge, an interior and a right edge, as
    (start, end, interior): interior queries see only keys of the run itself (query i's keys
    i - left .. i + right stay inside [s, e), or the sequence ends there), so their call reads the
    local k and v in place and runs while the halos travel; the edges' calls wait for them. One
    piece when nothing is interior."""
    def up(x):
        return -(-x // _EDGE_ALIGN) * _EDGE_ALIGN
    ia = s if s == 0 else s + up(left)
    ib = e if e == n else e - up(right)
    if ia >= ib:
        return [(s, e, False)]
    return [(a, b, mid) for a, b, mid in ((s, ia, False), (ia, ib, True), (ib, e, False)) if a < b]


def _wanted(layout, dst, src, left, right):
    """The intervals of src's tokens that dst's calls need (dst != src), ascending: the message
    from src to dst in the forward, and back in the backward."""
    need = _merge([_key_range(s, e, layout.n, left, right) for s, e, _ in layout.ranges(dst)])
    out = []
    for lo, hi in need:
        out.extend((a, b) for a, b, r, _ in layout.pieces(lo, hi) if r == src)
    return _merge(out)


class _Plan:
    """What one rank computes and exchanges for one layout and window; the same on every rank,
    computed from the layout alone."""

    def __init__(self, layout, rank, left, right, exchange):
        self.layout, self.rank, self.left, self.right = layout, rank, left, right
        n, world = layout.n, layout.world
        if exchange == "auto":
            exchange = "halo" if left >= 0 and right >= 0 and _halo_is_smaller(layout, left, right) else "gather"
        if exchange not in ("halo", "gather"):
            raise ValueError("winattn: exchange must be 'auto', 'halo' or 'gather', got %r" % (exchange,))
        if exchange == "halo" and (left < 0 or right < 0):
            raise ValueError("winattn: exchange='halo' needs a window bounded on both sides, got (%d, %d)"
                             % (left, right))
        self.exchange = exchange
        self.n_local = layout.local_length(rank)
        self.n_max = max(layout.local_length(r) for r in range(world))
        if left < 0 and right < 0:  # every query sees every key: one call over all local queries
            specs = [(0, self.n_local, 0, n, -1, -1)] if self.n_local else []
        else:  # (q0, nq, lo, hi, left, right) per query range
            specs = []
            for s, e, o in layout.ranges(rank):
                parts = _split(s, e, n, left, right) if exchange == "halo" else [(s, e, False)]
                for a, b, interior in parts:
                    lo, hi = _key_range(a, b, n, left, right)
                    if interior:  # from the run's first key, so that Nk - Nq is a multiple of _EDGE_ALIGN
                        lo = s    # (the call's window depends on hi only: see _call_window)
                    specs.append((o + a - s, b - a, lo, hi) + _call_window(b, hi, left, right))
        self.recv, self.send = [], []  # (peer, [(start, end, offset)], message length)
        msg = {}  # peer -> [(start, end, offset in the message)]
        if exchange == "halo":
            for peer in range(world):
                if peer == rank:
                    continue
                ivs = _wanted(layout, rank, peer, left, right)
                if ivs:
                    items, m = [], 0
                    for a, b in ivs:
                        items.append((a, b, m))
                        m += b - a
                    self.recv.append((peer, items, m))
                    msg[peer] = items
                ivs = _wanted(layout, peer, rank, left, right)
                if ivs:
                    items = [(a, b, _local_offset(layout, rank, a)) for a, b in ivs]
                    self.send.append((peer, items, sum(b - a for a, b in ivs)))
        self.calls = []
        for q0, nq, lo, hi, cl, cr in specs:
            pieces = []
            for s, e, r, off in layout.pieces(lo, hi):
                if exchange == "gather":
                    pieces.append((s, e, "all", s))
                elif r == rank:
                    pieces.append((s, e, "own", off))
                else:
                    a, _, m = next(it for it in msg[r] if it[0] <= s < it[1])
                    pieces.append((s, e, r, m + s - a))
            self.calls.append(_Call(q0, nq, lo, hi, cl, cr, pieces))
        # The backward's dK/dV: a direct call overwrites the rows of its keys; the other local rows
        # start from zero; everything else (edges' own keys, halo gradients) adds.
        covered = _merge([(c.k0, c.k0 + c.hi - c.lo) for c in self.calls if c.direct])
        self.zero_rows, at = [], 0
        for a, b in covered + [(self.n_local, self.n_local)]:
            if at < a:
                self.zero_rows.append((at, a))
            at = max(at, b)


def _local_offset(layout, rank, pos):
    for s, e, o in layout.ranges(rank):
        if s <= pos < e:
            return o + pos - s
    raise AssertionError("position %d is not on rank %d" % (pos, rank))


def _halo_is_smaller(layout, left, right):
    """Halos unless some rank would receive at least what an all-gather brings it."""
    n_max = max(layout.local_length(r) for r in range(layout.world))
    for dst in range(layout.world):
        got = sum(b - a for src in range(layout.world) if src != dst
                  for a, b in _wanted(layout, dst, src, left, right))
        if got >= (layout.world - 1) * n_max:
            return False
    return True


_plans = {}


def _plan(layout, rank, left, right, exchange):
    key = (layout, rank, left, right, exchange)
    if key not in _plans:
        if len(_plans) > 256:
            _plans.clear()
        _plans[key] = _Plan(layout, rank, left, right, exchange)
    return _plans[key]


# ---- communication ----

def _peer(rank, group):
    return rank if group is None else dist.get_global_rank(group, rank)


def _post(recvs, sends, group):
    """Posts every receive and send at once (batch_isend_irecv: NCCL runs them as one group, so
    no order between peers can deadlock) and returns the works to wait for."""
    ops = [dist.P2POp(dist.irecv, t, _peer(p, group), group) for p, t in recvs]
    ops += [dist.P2POp(dist.isend, t, _peer(p, group), group) for p, t in sends]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works):
    for w in works:
        w.wait()


# ---- the library's calls, writing into slices of outputs made here ----

def _forward_into(q, k, v, o, lse, left, right, scale, softcap):
    args = _wt._forward_args(q, k, v, o, lse)
    d = _wt._desc(left, right, scale, softcap)
    _wt._call(q, False, _lib.lib.wa_forward, ctypes.byref(d), *[ctypes.byref(a) for a in args])


def _backward_into(q, k, v, o, lse, do, dq, dk, dv, left, right, scale, softcap, deterministic):
    """Overwrites dq, dk, dv (views) with the call's gradients."""
    args = _wt._backward_args(q, k, v, o, lse, do, dq, dk, dv)
    d = _wt._desc(left, right, scale, softcap)
    _wt._call(q, deterministic, _lib.lib.wa_backward, ctypes.byref(d), *[ctypes.byref(a) for a in args])


def _rows(t, a, n):
    return t.narrow(2, a, n)


# ---- the op ----

class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, softcap, deterministic, group):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        B, Hq, n, D = q.shape
        Hkv = k.shape[1]
        new = dict(dtype=k.dtype, device=k.device)
        o = torch.empty((B, Hq, n, D), **new)
        lse = torch.empty((B, Hq, n), dtype=torch.float32, device=q.device)
        args = (scale, softcap)
        bufs = []  # the assembled keys of the calls that are not direct, in plan order
        if plan.exchange == "halo":
            # the messages: each peer's intervals of the local K and V, [2, B, Hkv, len, D]
            sends = []
            for peer, items, m in plan.send:
                msg = torch.empty((2, B, Hkv, m, D), **new)
                at = 0
                for a, b, off in items:
                    msg[0, :, :, at:at + b - a] = _rows(k, off, b - a)
                    msg[1, :, :, at:at + b - a] = _rows(v, off, b - a)
                    at += b - a
                sends.append((peer, msg))
            recvs = [(peer, torch.empty((2, B, Hkv, m, D), **new)) for peer, _, m in plan.recv]
            works = _post(recvs, sends, group)
            got = dict(recvs)
            for c in plan.calls:  # while the halos travel: the calls on local keys alone
                if c.direct:
                    _forward_into(_rows(q, c.q0, c.nq), _rows(k, c.k0, c.hi - c.lo), _rows(v, c.k0, c.hi - c.lo),
                                  _rows(o, c.q0, c.nq), lse.narrow(2, c.q0, c.nq), c.left, c.right, *args)
            _wait(works)
            for c in plan.calls:
                if c.direct:
                    continue
                kv = torch.empty((2, B, Hkv, c.hi - c.lo, D), **new)
                for s, e, src, off in c.pieces:
                    if src == "own":
                        kv[0, :, :, s - c.lo:e - c.lo] = _rows(k, off, e - s)
                        kv[1, :, :, s - c.lo:e - c.lo] = _rows(v, off, e - s)
                    else:
                        kv[:, :, :, s - c.lo:e - c.lo] = got[src][:, :, :, off:off + e - s]
                _forward_into(_rows(q, c.q0, c.nq), kv[0], kv[1], _rows(o, c.q0, c.nq), lse.narrow(2, c.q0, c.nq),
                              c.left, c.right, *args)
                bufs.append(kv)
        else:
            # all-gather [2, B, Hkv, n_max, D] per rank, then the sequence in global order
            mine = torch.zeros((2, B, Hkv, plan.n_max, D), **new)
            mine[0, :, :, :n] = k
            mine[1, :, :, :n] = v
            gathered = torch.empty((plan.layout.world,) + tuple(mine.shape), **new)
            dist.all_gather_into_tensor(gathered.flatten(0, 1), mine, group=group)  # gloo takes the cat form only
            del mine
            full = torch.empty((2, B, Hkv, plan.layout.n, D), **new)
            for r in range(plan.layout.world):
                for s, e, off in plan.layout.ranges(r):
                    full[:, :, :, s:e] = gathered[r, :, :, :, off:off + e - s]
            del gathered
            for c in plan.calls:
                _forward_into(_rows(q, c.q0, c.nq), full[0, :, :, c.lo:c.hi], full[1, :, :, c.lo:c.hi],
                              _rows(o, c.q0, c.nq), lse.narrow(2, c.q0, c.nq), c.left, c.right, *args)
            bufs.append(full)
        ctx.save_for_backward(q, k, v, o, lse, *bufs)
        ctx.plan, ctx.params, ctx.group = plan, (scale, softcap, deterministic), group
        return o

    @staticmethod
    def backward(ctx, do):
        plan, (scale, softcap, deterministic), group = ctx.plan, ctx.params, ctx.group
        q, k, v, o, lse, *bufs = ctx.saved_tensors
        do = do if do.stride(-1) == 1 else do.contiguous()
        B, Hq, n, D = q.shape
        Hkv = k.shape[1]
        new = dict(dtype=q.dtype, device=q.device)
        args = (scale, softcap, deterministic)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dkv = torch.empty((2, B, Hkv, n, D), **new)
        for a, b in plan.zero_rows:
            dkv[:, :, :, a:b] = 0

        def rows(t, c):
            return _rows(t, c.q0, c.nq)

        if plan.exchange == "halo":
            # the edges first: their halo gradients go back to the halos' owners
            grads = {peer: torch.zeros((2, B, Hkv, m, D), **new) for peer, _, m in plan.recv}
            owned = []
            assembled = iter(bufs)
            for c in plan.calls:
                if c.direct:
                    continue
                kv = next(assembled)
                dkvc = torch.empty_like(kv)
                _backward_into(rows(q, c), kv[0], kv[1], rows(o, c), lse.narrow(2, c.q0, c.nq), rows(do, c),
                               rows(dq, c), dkvc[0], dkvc[1], c.left, c.right, *args)
                for s, e, src, off in c.pieces:
                    piece = dkvc[:, :, :, s - c.lo:e - c.lo]
                    if src == "own":
                        owned.append((off, e - s, piece))
                    else:
                        grads[src][:, :, :, off:off + e - s] += piece
            recvs = [(peer, torch.empty((2, B, Hkv, m, D), **new)) for peer, _, m in plan.send]
            works = _post(recvs, list(grads.items()), group)
            for c in plan.calls:  # while the halo gradients travel
                if c.direct:
                    nk = c.hi - c.lo
                    _backward_into(rows(q, c), _rows(k, c.k0, nk), _rows(v, c.k0, nk), rows(o, c),
                                   lse.narrow(2, c.q0, c.nq), rows(do, c), rows(dq, c), dkv[0, :, :, c.k0:c.k0 + nk],
                                   dkv[1, :, :, c.k0:c.k0 + nk], c.left, c.right, *args)
            for off, m, piece in owned:
                dkv[:, :, :, off:off + m] += piece
            _wait(works)
            got = dict(recvs)
            for peer, items, _ in plan.send:
                at = 0
                for a, b, off in items:
                    dkv[:, :, :, off:off + b - a] += got[peer][:, :, :, at:at + b - a]
                    at += b - a
        else:
            full = bufs[0]
            world = plan.layout.world
            dgathered = torch.zeros((world, 2, B, Hkv, plan.n_max, D), **new)
            for c in plan.calls:
                dkvc = torch.empty((2, B, Hkv, c.hi - c.lo, D), **new)
                _backward_into(rows(q, c), full[0, :, :, c.lo:c.hi], full[1, :, :, c.lo:c.hi], rows(o, c),
                               lse.narrow(2, c.q0, c.nq), rows(do, c), rows(dq, c), dkvc[0], dkvc[1], c.left,
                               c.right, *args)
                for s, e, r, off in plan.layout.pieces(c.lo, c.hi):
                    dgathered[r, :, :, :, off:off + e - s] += dkvc[:, :, :, s - c.lo:e - c.lo]
                del dkvc
            mine = torch.empty((2, B, Hkv, plan.n_max, D), **new)
            dist.reduce_scatter_tensor(mine, dgathered.flatten(0, 1), group=group)
            dkv = mine[:, :, :, :n]
        return dq, dkv[0], dkv[1], None, None, None, None, None


def attention(q, k, v, layout, window=(-1, -1), causal=False, scale=None, softcap=0.0, group=None,
              exchange="auto", deterministic=False):
    """Context-parallel exact attention over a sequence sharded by `layout`: q [B, Hq, N_local, D],
    k and v [B, Hkv, N_local, D] hold this rank's tokens (layout.shard); returns this rank's
    output [B, Hq, N_local, D], differentiable in q, k and v. The arguments are
    winattn.torch.attention's, the window applied to global positions (query i sees keys
    i - left .. i + right); every rank of `group` (default: the world) must call it with the same
    layout, window, shapes and dtype. exchange: "halo" (point to point; windows bounded on both
    sides), "gather" (all-gather of K and V), or "auto" (halo when bounded and smaller than the
    gather). CPU tensors with gloo, CUDA tensors with NCCL (on the current stream)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError("winattn: %s must be a 4-d [B, H, N_local, D] torch.Tensor" % name)
    if not isinstance(layout, Layout):
        raise TypeError("winattn: layout must be a winattn.distributed.Layout, got %s" % type(layout).__name__)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if layout.world != world:
        raise ValueError("winattn: the layout is for %d ranks, the group has %d" % (layout.world, world))
    n = layout.local_length(rank)
    if q.shape[2] != n or k.shape[2] != n or v.shape[2] != n:
        raise ValueError("winattn: rank %d holds %d tokens in this layout; q, k, v have %d, %d, %d"
                         % (rank, n, q.shape[2], k.shape[2], v.shape[2]))
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError("winattn: q %s, k %s, v %s: k and v must match, and q share B and D"
                         % (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("winattn: q, k, v must share dtype and device")
    left, right, scale, softcap = _lib.window_args(window, causal, scale, softcap)
    plan = _plan(layout, rank, left, right, exchange)
    return _Attention.apply(q, k, v, plan, scale, softcap, bool(deterministic), group)


# ---- transformers: attn_implementation="winattn_cp" ----

_current = None  # (layout, group) while use_layout is active


@contextlib.contextmanager
def use_layout(layout, group=None):
    """Within this block, "winattn_cp" attention layers treat their inputs as this rank's shard
    of a sequence laid out by `layout`. The backward needs no block (each layer keeps its plan),
    except under gradient checkpointing, whose backward runs the layers' forward again: call
    backward() inside the block then."""
    global _current
    before = _current
    _current = (layout, group)
    try:
        yield
    finally:
        _current = before


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, **kwargs):
    """transformers' attention-function signature over this rank's shard (see use_layout):
    query [B, Hq, N_local, D], key and value [B, Hkv, N_local, D]; returns ([B, N_local, Hq, D], None)."""
    if _current is None:
        raise RuntimeError("winattn: attn_implementation 'winattn_cp' runs inside winattn.distributed.use_layout(...) "
                           "(with gradient checkpointing, call backward() inside it too: it runs the forward again)")
    layout, group = _current
    _refuse_unsupported(module, dropout, kwargs)
    if attention_mask is not None:
        raise ValueError("winattn: 'winattn_cp' takes no attention mask (no padding, no cache: one sequence sharded "
                         "by the layout)")
    if query.shape[2] != key.shape[2]:
        raise ValueError("winattn: 'winattn_cp' is for training and prefill without a cache (Nq=%d, Nk=%d)"
                         % (query.shape[2], key.shape[2]))
    left = _window(module, sliding_window)
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    o = attention(query, key, value, layout, window=(left, 0), scale=scaling, softcap=softcap or 0.0, group=group)
    return o.transpose(1, 2), None


def mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 allow_is_causal_skip=True, local_size=None, config=None, use_vmap=False, device="cpu", **kwargs):
    """No mask: each layer's band comes from its window and the layout. Refuses a padding mask
    and masks that add to the band (use_vmap: Gemma 3's bidirectional image blocks and the like)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("winattn: 'winattn_cp' takes unpadded sequences; the attention_mask has zeros")
    if use_vmap:
        raise ValueError("winattn: 'winattn_cp' computes the causal or sliding band only; this model adds to its "
                         "mask (bidirectional blocks?)")
    return None


def register(name="winattn_cp"):
    """Registers attention_forward and mask_builder under `name` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_builder)


def shard_causal_lm_batch(input_ids, layout, rank, labels=None, ignore_index=-100):
    """This rank's input_ids [B, N_local], position_ids [B, N_local] (the tokens' global
    positions, for RoPE) and labels [B, N_local], from full [B, N] input_ids. labels default to
    input_ids; either way they are shifted by one before sharding (label i is token i + 1, the
    last ignore_index), so no rank needs its neighbour's first token."""
    if labels is None:
        labels = input_ids
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    pos = layout.positions(rank, input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
    return {"input_ids": layout.shard(input_ids, rank, 1), "position_ids": pos,
            "labels": layout.shard(shifted, rank, 1)}


def causal_lm_loss(logits, labels, num_tokens, ignore_index=-100):
    """This rank's share of the mean next-token loss: the sum of its tokens' cross-entropies
    (labels from shard_causal_lm_batch) divided by num_tokens, the number of labels other than
    ignore_index over all ranks. Summed over ranks (all_reduce) it is the loss; its gradients,
    summed over ranks, are the loss's. Under DDP or FSDP, which average gradients over ranks,
    multiply by the world size."""
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum",
                                           ignore_index=ignore_index)
    return ce / num_tokens
