/* train.h — the trainer's one interface (libwinattn_train.a): what the command's `winattn train`
 * and `winattn init-model` call, and all they may include from train/. The trainer's own headers
 * (trainer.h, model.h, config.h, ...) take the types below from here; nothing here includes them.
 *
 * LoRA fine-tuning of a Gemma 4 / Gemma 3 checkpoint after mlx-lm's trainer, with attention
 * through one of three arms: winattn's kernels, dense score matrices, or query blocks. Nothing
 * here exits; failures come back as -1 with a one-line message in err.
 */
#ifndef WA_TRAIN_TRAIN_H
#define WA_TRAIN_TRAIN_H

#include "winattn.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GEMMA_MAX_LAYERS 256

typedef enum attn_arm {
    ATTN_FUSED,   /* winattn's kernels (float only) */
    ATTN_DENSE,   /* every head's full T×T scores and probabilities, masked: the stock fallback */
    ATTN_CHUNKED  /* query blocks against their visible keys with plain matmuls: the write-up's workaround */
} attn_arm;

/* mlx-lm's LoRA: y = W x + scale · (x A) B, A [in, r], B [r, out], on the projections in
 * proj_mask (bit per projection, in the order of train_lora_key) of the last num_layers layers
 * (0 = all). */
typedef struct lora_config {
    int rank;
    double scale;
    unsigned proj_mask;
    int num_layers;
} lora_config;

/* The learning rate per optimizer update, after mlx-lm's `lr_schedule` (mlx.optimizers'
 * schedules, joined as mlx-lm's build_schedule joins them): with warmup W > 0 the rate rises
 * linearly from warmup_init to lr over updates 0..W (linear_schedule(warmup_init, lr, W)), and the
 * decay then runs from update W + 1 as if from its own 0; without warmup the decay starts at 0.
 *   LR_CONSTANT  lr
 *   LR_COSINE    cosine_decay(lr, steps, end): end + (lr - end) · ½ (1 + cos(π · min(u, steps) / steps))
 *   LR_LINEAR    linear_schedule(lr, end, steps): lr + (end - lr) · min(u, steps) / steps
 * steps = 0 means the run's own update count less the warmup (at least 1). The update count u is
 * saved in every checkpoint, so a resumed run continues the schedule where it stopped. */
typedef enum lr_decay { LR_CONSTANT, LR_COSINE, LR_LINEAR } lr_decay;
typedef struct lr_schedule {
    lr_decay decay;
    int steps;          /* the decay's length in updates; 0 = the rest of the run */
    double end;         /* the rate the decay ends at (mlx's default 0) */
    int warmup;         /* updates of linear warmup; 0 = none */
    double warmup_init; /* the rate warmup starts from (mlx-lm's default 0) */
} lr_schedule;

/* The file layout adapters are written in: mlx-lm's (adapters.safetensors + its
 * adapter_config.json, loaded by mlx_lm.load(..., adapter_path=DIR)) or peft's
 * (adapter_model.safetensors + its adapter_config.json, loaded by PeftModel.from_pretrained).
 * Reading takes either, whatever this says. */
typedef enum adapter_format { ADAPTERS_MLX, ADAPTERS_PEFT } adapter_format;

/* The GPU model's precision (model_cuda.h). */
typedef enum gemma_precision { PRECISION_BF16, PRECISION_F32 } gemma_precision;

/* How the frozen decoder projections are held. BASE_BF16: as the checkpoint stores them (the
 * default). The others quantize them at load (train/quant.h): BASE_MLX4, MLX's affine 4-bit, group
 * 64; BASE_NF4, bitsandbytes' NF4, blocks of 64, double-quantized absmax; BASE_FP8, e4m3 with a
 * scale per output channel. On the CPU they train on the dequantized f32 values; on the GPU the
 * projections stay packed and each layer's are dequantized into bf16 (f32) before its products. */
typedef enum base_dtype { BASE_BF16, BASE_MLX4, BASE_NF4, BASE_FP8 } base_dtype;
/* "bf16", "mlx4", "nf4", "fp8", as --base-dtype and base_dtype: spell them */
const char *base_dtype_name(base_dtype base);
/* 0 and *base set for one of those names, -1 otherwise */
int base_dtype_parse(const char *name, base_dtype *base);

typedef struct train_options {
    const char *model_dir;     /* config.json + safetensors */
    const char *data_dir;      /* a folder with train.jsonl, valid.jsonl (and test.jsonl), or one JSONL
                                * file (training only: no held-out set) */
    const char *out_dir;       /* checkpoints (adapters, adapter_config.json, optimizer state,
                                * trainer state), log; train_defaults: "adapters", as mlx-lm
                                * (NULL means the same); missing parents are created */
    adapter_format format;     /* the layout adapters are written in (default ADAPTERS_MLX) */
    int save_every;            /* every N updates: the checkpoint, and the adapters also as
                                * NNNNNNN_adapters.safetensors (the update count, mlx-lm's name);
                                * 0 = at the end (and on a signal) only */
    const char *resume_dir;    /* continue from a previous out_dir (adapters + optimizer + step) */
    const char *adapters_path; /* start from (or evaluate) these adapters instead of a fresh init */
    attn_arm arm;
    int chunk;                 /* query block of the chunked arm */
    int threads;
    double epochs;             /* used when iters is 0: iters = ceil(epochs · records / batch) */
    int iters;                 /* batches to train on */
    int batch;
    int pack;                  /* 1: each batch's records packed into one sequence (default); 0: one by one */
    int grad_accum;            /* batches per optimizer update */
    double lr, beta1, beta2, eps, weight_decay;
    lr_schedule schedule;      /* default LR_CONSTANT: lr throughout */
    double grad_clip;          /* clip the gradient to this global L2 norm before each update; 0 = off */
    int adamw;                 /* decoupled weight decay */
    int bias_correction;       /* off by default, as in MLX's Adam */
    lora_config lora;
    uint64_t seed;
    int eval_only;
    int eval_at_end;
    int eval_every;            /* 0 = never during training */
    int val_batches;           /* batches of valid.jsonl per evaluation; 0 or -1 = all (mlx-lm: -1) */
    int test;                  /* after training, the loss on test.jsonl (mlx-lm's --test) */
    int byte_tokens;           /* {"text"} records as UTF-8 bytes even where the model has a tokenizer */
    int mask_prompt;           /* no loss on the prompt part of records that mark one (mlx-lm's --mask-prompt) */
    int max_len;
    int pad_target;
    const char *log_path;      /* JSON lines per step and evaluation; NULL = out_dir/log.jsonl or none */
    wa_device device;          /* WA_DEVICE_CPU (the reference) or WA_DEVICE_CUDA (model_cuda.h) */
    gemma_precision precision; /* on the GPU: bf16 weights and activations (default) or f32 */
    base_dtype base;           /* the frozen projections' format (default BASE_BF16) */
    int random_init;           /* on the GPU: base weights drawn from init_seed, the checkpoint's unread */
    uint64_t init_seed;
    int deterministic;         /* on the GPU: winattn's deterministic backward, so a run repeats bit for bit */
} train_options;

/* Zeroes *o and sets the defaults: the write-up's job (LoRA r = 32 on q, k, v, o of every layer,
 * batch 4, 2 epochs) with mlx-lm's defaults where it says nothing (scale 20, lr 1e-5, Adam
 * without bias correction, seed 0), fused attention, batches packed. */
void train_defaults(train_options *o);

/* What train_run returns when SIGINT, SIGTERM or SIGHUP stopped it: the checkpoint of the last
 * optimizer update is in out_dir, and err says so ("interrupted by SIGINT after step 12 of 86: the
 * checkpoint is in DIR; --resume DIR continues"). The command exits 128 + the signal's number
 * for it, as a shell reports a process the signal ended. */
#define TRAIN_INTERRUPTED 2

/* Run training and/or evaluation as o says, printing progress to stdout (and a live line to
 * stderr when it is a terminal). 0 on success; -1 with a one-line message in err;
 * TRAIN_INTERRUPTED (with its message in err, and the signal in *train_stop_signal) when a
 * signal stopped it. While it trains, the first SIGINT, SIGTERM or SIGHUP lets the current batch
 * finish, writes the checkpoint and returns; a second one ends the process at once (the last
 * checkpoint stays whole: checkpoints are written as one unit, docs/train.md). The previous
 * handlers are back in place when it returns. */
int train_run(const train_options *o, char *err, size_t errlen);
/* The signal behind the last TRAIN_INTERRUPTED (0 after any other return). */
extern volatile int train_stop_signal;

/* The bit (0..6) of lora_config.proj_mask for a projection's short name ("q", "k", "v", "o",
 * "gate", "up", "down"), or -1 for any other name. */
int train_lora_key(const char *name);

/* A seeded random checkpoint for the config.json at config_path, for demos and tests where no
 * pretrained weights are reachable: out_dir (created if missing) gets model.safetensors (bf16, or
 * f32 when f32 is set; transformers' initialisation: linear and embedding weights N(0, 0.02),
 * norms 1 for Gemma 4 and 0 for Gemma 3, layer scalars 1) and config.json copied byte for byte.
 * 0 with a one-line description of the config in summary; -1 with a one-line message in err. */
int train_init_model(const char *config_path, const char *out_dir, uint64_t seed, int f32, char *summary,
                     size_t summary_len, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
