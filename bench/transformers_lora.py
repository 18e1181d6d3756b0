"""transformers_lora.py — what the transformers-based benchmarks share: a Gemma 4 text config from
train/configs' JSON, and mlx-lm's LoRA (y = W x + scale (x A) B, A uniform in +-1/sqrt(in), B
zero) on a model's attention projections, frozen base weights. bench/train_gpu.py and
bench/cp_train.py import it."""
import torch


def gemma4_config(cfg_json, attn_implementation):
    """transformers' Gemma4TextConfig from a config.json dict (train/configs/gemma4-31b.json)"""
    import transformers
    cfg = transformers.Gemma4TextConfig(**{k: v for k, v in cfg_json.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = attn_implementation
    return cfg


class LoRA(torch.nn.Module):
    def __init__(self, base, rank, scale):
        super().__init__()
        self.base, self.scale = base, scale
        i, o = base.in_features, base.out_features
        w = base.weight
        self.A = torch.nn.Parameter(torch.empty(i, rank, device=w.device, dtype=w.dtype).uniform_(-i ** -0.5, i ** -0.5))
        self.B = torch.nn.Parameter(torch.zeros(rank, o, device=w.device, dtype=w.dtype))

    def forward(self, x):
        return self.base(x) + self.scale * ((x @ self.A) @ self.B)


def add_lora(model, rank=32, scale=20.0, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """Freezes the model and wraps each layer's attention projections in `targets` (those it
    has: Gemma 4's k = v layers have no v_proj) in a LoRA; returns the trainable parameters."""
    model.requires_grad_(False)
    for layer in model.model.layers:
        a = layer.self_attn
        for name in targets:
            if getattr(a, name, None) is not None:
                setattr(a, name, LoRA(getattr(a, name), rank, scale))
    return [p for p in model.parameters() if p.requires_grad]
