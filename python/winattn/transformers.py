"""winattn as a Hugging Face transformers attention implementation.

    import winattn.transformers
    winattn.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="winattn")
    # or, on a model already loaded: model.set_attn_implementation("winattn")

Each attention layer then calls winattn.torch.attention, or attention_varlen for padded and packed
batches (CPU or CUDA tensors, float32, float16, bfloat16, autograd), with its own window, scale
and softcap, taken from what the model passes to its attention function:

- window: the `sliding_window` keyword (else `module.sliding_window`, else `config.sliding_window`
  on a layer whose `layer_type` is "sliding_attention"). transformers' sliding window of W keys
  (`sliding_window_overlay`: key kv visible to query q iff q - W < kv <= q) is winattn's window
  (W-1, 0); layers without one are causal, (-1, 0).
- scale: the `scaling` keyword (else `module.scaling`, else 1/sqrt(head_dim)), so Gemma 3's
  query_pre_attn_scalar and Gemma 4's 1.0 come through unchanged.
- softcap: the `softcap` keyword (Gemma 2 passes its attn_logit_softcapping). Gemma 3 keeps the
  field in its config but does not pass it, and its eager attention does not apply it; neither
  does this.
- GQA: key and value arrive with the model's KV heads and are used without repeating them.

Masks. winattn computes the causal or sliding band itself, so a mask is only read for what the
band cannot know, never applied element by element. register() also registers a mask builder
under the same name, which hands attention_forward one of:

- no mask, for a plain batch (training without padding, a first prefill): the band alone;
- a padded batch's [B, Nk] boolean padding mask (as transformers' FlashAttention builder does),
  when the model gives an attention_mask with zeros and there is no cache or a dynamic one:
  each row's real tokens (left, right or both sides padded; they must be one contiguous run)
  are gathered into a packed batch, run through winattn.torch.attention_varlen and scattered
  back, padded query rows getting 0;
- a PackedMask for a batch without attention_mask whose mask transformers would not skip (it
  found position_ids restarting within a row, as DataCollatorWithFlattening makes them): the
  sequences, taken from position_ids, run as one packed varlen batch;
- otherwise transformers' SDPA boolean mask, which must equal the layer's own band, bottom-right
  aligned (query i at position i + Nk - Nq), or that band over the first keys only with the rest
  hidden (a static cache not yet full): that holds for prefill and decoding with transformers'
  static caches.

The unpadded and packed paths need the sequence lengths on the host (for max_seqlen and the
gather indices), read from attention_mask or position_ids once per mask: a device sync, as
transformers' own FlashAttention varlen path does. A PackedMask is checked once per forward and
window against the mask transformers would have built (B*N^2 comparisons in row chunks of 16M
elements, never the whole [B, N, N] mask in memory), so a mask with
more in it than packing and the band (Gemma 3's bidirectional image blocks, say) raises
ValueError instead of being computed as something else. So do padding inside a row, a custom 4-d
mask and bidirectional layers. Attention dropout and attention sinks are refused the same way.
"""
import torch

from ._lib import HAS_VARLEN
from .torch import attention as _attention
from .torch import attention_varlen as _attention_varlen

__all__ = ["register", "attention_forward", "mask_builder", "PackedMask"]


def _window(module, sliding_window):
    """transformers' sliding window of W keys (key j visible iff i - W < j <= i) is (W-1, 0);
    layers without one are causal (-1). Shared with winattn.distributed."""
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is None and getattr(module, "layer_type", None) == "sliding_attention":
        sliding_window = getattr(module.config, "sliding_window", None)
    if sliding_window is None:
        return -1
    if int(sliding_window) < 1:
        raise ValueError("winattn: sliding_window must be >= 1, got %r" % (sliding_window,))
    return int(sliding_window) - 1


def _refuse_unsupported(module, dropout, kwargs):
    """What transformers may ask of an attention function that winattn does not do: ValueError.
    Shared with winattn.distributed."""
    if dropout:
        raise ValueError("winattn: attention dropout is not supported (got p=%g); set attention_dropout=0" % dropout)
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("winattn: attention sinks are not supported")
    if not getattr(module, "is_causal", True):
        raise ValueError("winattn: bidirectional attention layers are not supported (module.is_causal is False)")


def _band(Nq, Nk, left, device):
    """The visible (query, key) pairs of window (left, 0), bottom-right aligned."""
    i = torch.arange(Nq, device=device)[:, None] + (Nk - Nq)
    j = torch.arange(Nk, device=device)[None, :]
    band = j <= i
    if left >= 0:
        band &= j >= i - left
    return band


def _keys_used(mask, Nq, Nk, left):
    """How many leading keys the mask lets queries see, once it is checked to be this layer's
    band: Nk normally (bottom-right), fewer for a static cache whose tail is still empty (the
    band then ends early: query i sees up to key i + Nk_used - Nq). Raises ValueError for any
    other mask."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (Nq, Nk):
        raise ValueError("winattn: attention_mask must be None or a 4-d [B, 1, Nq, Nk] tensor with Nq=%d, Nk=%d; "
                         "got %s" % (Nq, Nk, type(mask).__name__ if not isinstance(mask, torch.Tensor)
                                     else tuple(mask.shape)))
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():  # additive: 0 where visible, a large negative number elsewhere
        visible = mask > torch.finfo(mask.dtype).min / 2
        if not torch.all(mask[visible] == 0):
            raise ValueError("winattn: an additive attention_mask with values other than 0 and -inf is not supported")
    else:
        raise ValueError("winattn: attention_mask has dtype %s (bool or floating point expected)" % mask.dtype)
    # The band's end, read off the first query's last visible key; the comparison below holds
    # every row, batch and head to it.
    first = visible.reshape(-1, Nq, Nk)[0, 0].nonzero()
    used = int(first[-1]) + Nq if len(first) else Nk
    if Nq <= used <= Nk:
        expected = torch.zeros(Nq, Nk, dtype=torch.bool, device=mask.device)
        expected[:, :used] = _band(Nq, used, left, mask.device)
        if torch.equal(visible, expected.expand_as(visible)):
            return used
    what = "sliding window of %d keys" % (left + 1) if left >= 0 else "causal"
    raise ValueError("winattn: attention_mask differs from this layer's %s mask (padding with a static cache, "
                     "or a custom mask?); winattn takes the band, padded batches without a cache or with a "
                     "dynamic one, and packed sequences; otherwise use attn_implementation='sdpa'" % what)


class _Plan:
    """A padded or packed batch as varlen: int32 offsets and the flat token rows ([B * Nq] queries,
    [B * Nk] keys) the packed batch takes (None: all of them, in order), on the tensors' device,
    and the longest lengths as ints."""

    def __init__(self, lens_q, lens_k, rows_q, rows_k, B, Nq, Nk):
        zero = lens_q.new_zeros(1)
        self.cu_q = torch.cat([zero, lens_q.cumsum(0)]).to(torch.int32)
        self.cu_k = torch.cat([zero, lens_k.cumsum(0)]).to(torch.int32)
        longest = torch.stack([lens_q.max(), lens_k.max()]) if lens_q.numel() else lens_q.new_zeros(2)
        # the host read: max_seqlen is an int, as flash_attn_varlen_func's (see the module docstring)
        self.max_q, self.max_k = longest.tolist()
        self.rows_q = None if rows_q.numel() == B * Nq else rows_q
        self.rows_k = None if rows_k.numel() == B * Nk else rows_k


def _padding_plan(mask, Nq, Nk):
    """The plan of a [B, Nk] padding mask whose queries are its last Nq positions. Each row's real
    tokens must be one run [s, e): then the window counted over the row's positions equals the
    window counted over the packed sequence, and query p (absolute) sits at p - s of its sequence,
    bottom-right aligned because the run ends at e for keys and queries alike."""
    if mask.dim() != 2 or mask.shape[1] != Nk or Nq > Nk:
        raise ValueError("winattn: a padding mask of shape %s does not fit keys of length %d and %d queries"
                         % (tuple(mask.shape), Nk, Nq))
    m = mask.to(torch.bool)
    runs = (m[:, 1:] & ~m[:, :-1]).sum(1) + m[:, 0]
    bad = (runs > 1).nonzero()
    if len(bad):
        raise ValueError("winattn: row %d of the attention_mask has padding between real tokens; winattn takes left "
                         "or right padding (one run of real tokens per row); use attn_implementation='sdpa'"
                         % int(bad[0]))
    real_q = m[:, Nk - Nq:]
    return _Plan(real_q.sum(1), m.sum(1), real_q.flatten().nonzero().flatten(), m.flatten().nonzero().flatten(),
                 m.shape[0], Nq, Nk)


class PackedMask:
    """What mask_builder hands attention_forward for a batch without attention_mask whose mask
    transformers would not skip (it found position_ids restarting within a row): the mask function
    and sizes, from which the mask is built and checked only in row chunks, once (per window) for
    all the layers that share it."""

    def __init__(self, mask_function, batch_size, length, device, sdpa_mask):
        self.mask_function, self.batch_size, self.length, self.device = mask_function, batch_size, length, device
        self._sdpa_mask = sdpa_mask
        self._plans = {}

    def __repr__(self):
        return "PackedMask(batch_size=%d, length=%d)" % (self.batch_size, self.length)

    def plan(self, left, position_ids):
        # The layers of one forward pass hand the same position_ids tensor, so the plan is cached on
        # that tensor: its storage address, view and version. The entry holds the tensor itself: an
        # address alone could be a freed tensor's, reused by another with other positions.
        key = (left, None if position_ids is None else
               (position_ids.data_ptr(), tuple(position_ids.shape), position_ids.stride(), position_ids._version))
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = (position_ids, self._make_plan(left, position_ids))
        return hit[1]

    def _make_plan(self, left, position_ids):
        B, N = self.batch_size, self.length
        if position_ids is None:
            seq = torch.zeros(B, N, dtype=torch.long, device=self.device)
        else:
            pos = position_ids.to(self.device).expand(B, N)
            # transformers' rule (masking_utils.find_packed_sequence_indices): a new sequence wherever the
            # position does not follow the previous one
            seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        i = torch.arange(N, device=self.device)
        rows = max(1, (1 << 24) // max(1, B * N))
        for r0 in range(0, N, rows):
            r1 = min(N, r0 + rows)
            got = self._sdpa_mask(batch_size=B, q_length=r1 - r0, kv_length=N, q_offset=r0, kv_offset=0,
                                  mask_function=self.mask_function, attention_mask=None, allow_is_causal_skip=False,
                                  use_vmap=False, device=self.device)
            q = i[r0:r1, None]
            want = (seq[:, r0:r1, None] == seq[:, None, :]) & (i[None, None, :] <= q)
            if left >= 0:
                want &= i[None, None, :] >= q - left
            if got is None or not torch.equal(got.reshape(B, r1 - r0, N), want):
                what = "sliding window of %d keys" % (left + 1) if left >= 0 else "causal"
                raise ValueError("winattn: the attention mask differs from this layer's %s mask over the packed "
                                 "sequences that position_ids describe (a custom or bidirectional mask?); use "
                                 "attn_implementation='sdpa'" % what)
        starts = torch.ones(B, N, dtype=torch.bool, device=self.device)
        starts[:, 1:] = seq[:, 1:] != seq[:, :-1]  # every row starts a sequence too
        first = starts.flatten().nonzero().flatten()
        lens = torch.diff(first, append=first.new_full((1,), B * N))
        every = torch.arange(B * N, device=self.device)
        return _Plan(lens, lens, every, every, B, N, N)


def _varlen_forward(query, key, value, plan, left, scaling, softcap):
    """attention_forward over a plan: [B, H, N, D] to packed [T, H, D] rows and back, as
    [B, Nq, Hq, D] with zeros in the rows the plan leaves out."""
    B, Hq, Nq, D = query.shape
    Hkv, Nk = key.shape[1], key.shape[2]
    q = query.transpose(1, 2).reshape(B * Nq, Hq, D)
    k = key.transpose(1, 2).reshape(B * Nk, Hkv, D)
    v = value.transpose(1, 2).reshape(B * Nk, Hkv, value.shape[3])
    if plan.rows_q is not None:
        q = q.index_select(0, plan.rows_q)
    if plan.rows_k is not None:
        k, v = k.index_select(0, plan.rows_k), v.index_select(0, plan.rows_k)
    o = _attention_varlen(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, window=(left, 0), scale=scaling,
                          softcap=softcap or 0.0)
    if plan.rows_q is not None:
        o = o.new_zeros(B * Nq, Hq, o.shape[2]).index_copy(0, plan.rows_q, o)
    return o.view(B, Nq, Hq, o.shape[2]), None


def _cached_padding_plan(mask, Nq, Nk):
    """_padding_plan, kept on the mask tensor for the other layers it is passed to"""
    key = (Nq, Nk, mask._version)
    cache = getattr(mask, "_winattn_plans", None)
    if cache is None:
        cache = {}
        mask._winattn_plans = cache
    if key not in cache:
        cache[key] = _padding_plan(mask, Nq, Nk)
    return cache[key]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, **kwargs):
    """transformers' attention-function signature: query [B, Hq, Nq, D], key and value
    [B, Hkv, Nk, D]; returns (output [B, Nq, Hq, D], None). No attention weights are formed,
    so none are returned."""
    _refuse_unsupported(module, dropout, kwargs)
    left = _window(module, sliding_window)
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    Nq, Nk = query.shape[2], key.shape[2]
    if isinstance(attention_mask, PackedMask):
        if (Nq, Nk) != (attention_mask.length, attention_mask.length):
            raise ValueError("winattn: a PackedMask for %d tokens, but Nq=%d, Nk=%d" % (attention_mask.length, Nq, Nk))
        plan = attention_mask.plan(left, kwargs.get("position_ids"))
        return _varlen_forward(query, key, value, plan, left, scaling, softcap)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return _varlen_forward(query, key, value, _cached_padding_plan(attention_mask, Nq, Nk), left, scaling, softcap)
    if attention_mask is not None:
        used = _keys_used(attention_mask, Nq, Nk, left)
    else:
        # No mask means SDPA's is_causal, which is top-left aligned: for 1 < Nq < Nk (a prefill
        # into a static cache whose tail is empty) query i sees keys up to i, none past Nq.
        used = Nq if 1 < Nq < Nk else Nk
    if used < Nk:
        key, value = key[:, :, :used], value[:, :, :used]
    o = _attention(query, key, value, window=(left, 0), scale=scaling, softcap=softcap or 0.0)
    return o.transpose(1, 2), None


def mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 allow_is_causal_skip=True, local_size=None, config=None, use_vmap=False, device="cpu", **kwargs):
    """What attention_forward is handed as attention_mask (see the module docstring): None for the
    plain band; the [B, Nk] padding mask of a padded batch; a PackedMask for packed sequences;
    else transformers' SDPA mask. The band alone serves when there is no cache or padding
    (training, a first prefill) and the window is the config's sliding window (not, say, Llama
    4's chunks); transformers would otherwise build a [B, 1, N, N] boolean mask for every sliding
    layer once N exceeds the window, N^2 bytes per sequence that winattn would only check."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    if mask_function is None:
        mask_function = causal_mask_function
    sliding = local_size is None or (local_size == getattr(config, "sliding_window", None)
                                     and getattr(config, "attention_chunk_size", None) is None)
    # A static cache passes its offset as a tensor; dynamic caches put the queries last among the keys.
    queries_last = (isinstance(q_offset, int) and isinstance(kv_offset, int)
                    and q_offset + q_length == kv_offset + kv_length)
    padded = attention_mask is not None and (torch.compiler.is_compiling() or not bool(attention_mask.all()))
    fresh = queries_last and q_offset == 0 and kv_offset == 0  # no cache, or an empty one: Nq == Nk
    # allow_is_causal_skip is False when the model adds to the band (or_mask_function and the like, which
    # also set use_vmap; block_sequence_ids, which does not) or transformers found packed sequences
    if sliding and not use_vmap:
        if padded and allow_is_causal_skip and HAS_VARLEN and queries_last and attention_mask.dim() == 2 \
                and attention_mask.shape[1] >= kv_offset + kv_length:
            return attention_mask[:, kv_offset:kv_offset + kv_length].bool()
        if fresh and not padded:
            # a PackedMask holds the mask function: attention_forward checks it, so block_sequence_ids
            # or anything else besides packing raises there
            if allow_is_causal_skip:
                return None
            if HAS_VARLEN:
                return PackedMask(mask_function, batch_size, q_length, device, sdpa_mask)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, local_size=local_size, config=config,
                     use_vmap=use_vmap, device=device, **kwargs)


def register(name="winattn"):
    """Registers attention_forward and mask_builder under `name`, so that attn_implementation=name
    selects them. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    # Without a mask builder registered under the same name, transformers hands custom
    # implementations no mask at all, so a padded batch would be computed as if unpadded.
    AttentionMaskInterface.register(name, mask_builder)
