"""qlora_peer.py — bench/train_gpu.py's "qlora" peer: QLoRA as transformers + peft + bitsandbytes
users run it, on Gemma 4 at a config's shape with random weights.

  * transformers' Gemma 4 (AutoModelForCausalLM from the config, bf16), its decoder projections
    (q, k, v, o, gate, up, down) bitsandbytes Linear4bit: NF4 in blocks of 64 with double
    quantization (compress_statistics), compute dtype bf16, as BitsAndBytesConfig(load_in_4bit,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16)
    gives them; the embedding (tied head) and the norms bf16;
  * peft's LoraConfig(r, lora_alpha = scale * r, so peft's lora_alpha / r is the C trainer's
    --lora-scale; q, k, v, o; dropout 0) through get_peft_model;
  * gradient checkpointing (non-reentrant) as peft's prepare_model_for_kbit_training enables it,
    without its cast of the bf16 embedding and norms to float32 (the product keeps them bf16).

The bf16 model is never whole anywhere: the model is built on the meta device, each projection's
bf16 weight is drawn on the target device alone and quantized there before the next is drawn (the
31B's projections are 61 GB in bf16, its NF4 base about a quarter), and the other tensors (the
embedding, norms, rotary tables) are allocated and initialized module by module by transformers'
own _init_weights. The weight source is a parameter, so a test can hand in weights it knows.
"""
import torch

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
NF4_BLOCK = 64


def normal_weights(std, seed, device):
    """The default weight source: N(0, std) in bf16 from one generator on `device`, drawn in the
    order the builder asks (layer by layer, q..down), as the C trainer's --init-random draws N(0, 0.02)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(name, shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=gen)
    return draw


def nf4_linear(weight, device):
    """A bitsandbytes Linear4bit holding `weight` ([out, in], bf16) quantized on `device`: NF4, blocks
    of 64, double quantization, bf16 compute. Params4bit quantizes when moved to a real device."""
    import bitsandbytes as bnb
    out_features, in_features = weight.shape
    linear = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.bfloat16,
                               compress_statistics=True, quant_type="nf4", device="meta")
    linear.weight = bnb.nn.Params4bit(weight.to(torch.bfloat16), requires_grad=False, blocksize=NF4_BLOCK,
                                      compress_statistics=True, quant_type="nf4", module=linear).to(device)
    return linear


def nf4_model(cfg, device, weight=None, seed=0):
    """transformers' causal LM for `cfg` (a config object with its attention implementation set) on
    `device`, its decoder projections NF4 from weight(name, (out, in)) -> bf16 tensor (default:
    normal_weights(cfg.initializer_range, seed, device)), everything else bf16 as from_config
    initializes it. Raises RuntimeError naming a tensor that transformers' _init_weights left unset."""
    from transformers import AutoModelForCausalLM
    device = torch.device(device)
    if weight is None:
        weight = normal_weights(cfg.initializer_range, seed, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.requires_grad_(False)
    quantized = set()
    for i, layer in enumerate(model.model.layers):
        for path in PROJECTIONS:
            parent_path, attr = path.rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            old = getattr(parent, attr, None)
            if old is None:  # Gemma 4's k = v layers have no v_proj
                continue
            w = weight("model.layers.%d.%s" % (i, path), (old.out_features, old.in_features))
            linear = nf4_linear(w, device)
            del w  # only one projection's bf16 weight lives at a time
            setattr(parent, attr, linear)
            quantized.add(linear)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and (head.weight is embedding.weight or getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        for name, module in model.named_modules():
            if module in quantized or (tied and module is head):
                continue
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            if not any(t.is_meta for _, t in own):
                continue
            module.to_empty(device=device, recurse=False)
            filled = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for _, t in filled:  # NaN marks what _init_weights must overwrite
                if t.is_floating_point():
                    t.fill_(float("nan"))
            model._init_weights(module)
            for tname, t in filled:
                if t.is_floating_point() and bool(torch.isnan(t).any()):
                    raise RuntimeError("qlora peer: %s.%s is not set by transformers' _init_weights" % (name, tname))
        if tied:
            head.weight = embedding.weight
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError("qlora peer: %d tensors left on the meta device, the first %s" % (len(left), left[0]))
    model.requires_grad_(False)
    model.is_loaded_in_4bit = True  # what transformers' bitsandbytes loader sets; peft's LoRA dispatch reads it
    model.config.use_cache = False
    return model


def qlora_model(cfg, device, rank, scale, weight=None, seed=0):
    """nf4_model with gradient checkpointing and peft's LoRA of `rank` on q, k, v, o scaled by
    `scale` (lora_alpha = scale * rank); returns (peft model, its trainable parameters)."""
    from peft import LoraConfig, get_peft_model
    model = nf4_model(cfg, device, weight, seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    return model, [p for p in model.parameters() if p.requires_grad]
