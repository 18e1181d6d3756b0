"""winattn as a Hugging Face transformers attention implementation.

    import winattn.transformers
    winattn.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="winattn")
    # or, on a model already loaded: model.set_attn_implementation("winattn")

Each attention layer then calls winattn.torch.attention (CPU or CUDA tensors, float32, float16,
bfloat16, autograd) with its own window, scale and softcap, taken from what the model passes to
its attention function:

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

Masks. winattn computes the causal or sliding band itself, so the attention mask is only checked,
never applied. register() also registers a mask builder under the same name: transformers' SDPA
one, which hands over no mask at all in the plain cases, also leaving out the dense sliding-window
mask of a sequence without cache or padding (training), and otherwise a boolean mask. A given mask must equal the layer's own band, bottom-right aligned
(query i at position i + Nk - Nq), or that band over the first keys only with the rest hidden (a
static cache not yet full): that holds for training and for prefill and decoding with
transformers' dynamic and static caches. Anything else (padding, packed sequences, a custom 4-d
mask, a bidirectional layer) raises ValueError rather than silently computing something else.
For a right-padded batch, pass no attention_mask: causality already hides the padding from every
real token, and labels of -100 keep the padded positions out of the loss. Attention dropout and
attention sinks are refused the same way.
"""
import torch

from .torch import attention as _attention

__all__ = ["register", "attention_forward", "mask_builder"]


def _window(module, sliding_window):
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is None and getattr(module, "layer_type", None) == "sliding_attention":
        sliding_window = getattr(module.config, "sliding_window", None)
    if sliding_window is None:
        return -1
    if int(sliding_window) < 1:
        raise ValueError("winattn: sliding_window must be >= 1, got %r" % (sliding_window,))
    return int(sliding_window) - 1


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
    raise ValueError("winattn: attention_mask differs from this layer's %s mask (padding, packed sequences "
                     "or a custom mask?); winattn applies only the band itself. For right padding pass no "
                     "attention_mask and label padded positions -100; otherwise use attn_implementation='sdpa'"
                     % what)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, **kwargs):
    """transformers' attention-function signature: query [B, Hq, Nq, D], key and value
    [B, Hkv, Nk, D]; returns (output [B, Nq, Hq, D], None). No attention weights are formed,
    so none are returned."""
    if dropout:
        raise ValueError("winattn: attention dropout is not supported (got p=%g); set attention_dropout=0" % dropout)
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("winattn: attention sinks are not supported")
    if not getattr(module, "is_causal", True):
        raise ValueError("winattn: bidirectional attention layers are not supported (module.is_causal is False)")
    left = _window(module, sliding_window)
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    Nq, Nk = query.shape[2], key.shape[2]
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


def mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None,
                 allow_is_causal_skip=True, local_size=None, config=None, **kwargs):
    """transformers' SDPA mask builder, except that it also leaves out a sliding-window mask when
    attention_forward's own band is that mask: no cache or padding (training, a first prefill)
    and a window that is the config's sliding window (not, say, Llama 4's chunks). transformers
    would otherwise build a [B, 1, N, N] boolean mask for every sliding layer once N exceeds the
    window, N^2 bytes per sequence that winattn would only check."""
    padded = attention_mask is not None and (torch.compiler.is_compiling() or not bool(attention_mask.all()))
    sliding = local_size is None or (local_size == getattr(config, "sliding_window", None)
                                     and getattr(config, "attention_chunk_size", None) is None)
    if (allow_is_causal_skip and sliding and not padded and q_length == kv_length and isinstance(q_offset, int)
            and q_offset == 0 and kv_offset == 0):
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                     local_size=local_size, config=config, **kwargs)


def register(name="winattn"):
    """Registers attention_forward and mask_builder under `name`, so that attn_implementation=name
    selects them. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    # Without a mask builder registered under the same name, transformers hands custom
    # implementations no mask at all, so a padded batch would be computed as if unpadded.
    AttentionMaskInterface.register(name, mask_builder)
