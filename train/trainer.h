/* trainer.h — the LoRA fine-tuning loop of `winattn train`, after mlx-lm's trainer
 * (notes/gemma.md §2): batches of consecutive records in file order whose order is re-permuted
 * every pass, the remainder dropped; token-weighted mean cross-entropy over each batch; Adam or
 * AdamW on the adapters only; held-out loss and next-token agreement. */
#ifndef WA_TRAIN_TRAINER_H
#define WA_TRAIN_TRAINER_H

#include "model.h"
#include "model_cuda.h"

typedef struct train_options {
    const char *model_dir;     /* config.json + safetensors */
    const char *data_dir;      /* train.jsonl and valid.jsonl */
    const char *out_dir;       /* adapters, adapter_config.json, optimizer state, log; NULL = none */
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
    int adamw;                 /* decoupled weight decay */
    int bias_correction;       /* off by default, as in MLX's Adam */
    lora_config lora;
    uint64_t seed;
    int eval_only;
    int eval_at_end;
    int eval_every;            /* 0 = never during training */
    int max_len;
    int pad_target;
    const char *log_path;      /* JSON lines per step and evaluation; NULL = out_dir/log.jsonl or none */
    wa_device device;          /* WA_DEVICE_CPU (the reference) or WA_DEVICE_CUDA (model_cuda.h) */
    gemma_precision precision; /* on the GPU: bf16 weights and activations (default) or f32 */
    int random_init;           /* on the GPU: base weights drawn from init_seed, the checkpoint's unread */
    uint64_t init_seed;
} train_options;

/* Zeroes *o and sets the defaults: the write-up's job (LoRA r = 32 on q, k, v, o of every layer,
 * batch 4, 2 epochs) with mlx-lm's defaults where it says nothing (scale 20, lr 1e-5, Adam
 * without bias correction, seed 0), fused attention, batches packed. */
void train_defaults(train_options *o);

/* Run training and/or evaluation as o says, printing progress to stdout (and a live line to
 * stderr when it is a terminal). 0 on success; -1 with a one-line message in err. */
int train_run(const train_options *o, char *err, size_t errlen);

/* Adapters in mlx-lm's file layout: "model.layers.N.self_attn.q_proj.lora_a" [in, r] and
 * ".lora_b" [r, out], F32, plus adapter_config.json beside them. */
int adapters_save(const gemma_model_f32 *m, const char *dir, char *err, size_t errlen);
/* Loads A and B for every slot of m from path (names with the "model.", "language_model.model."
 * or "model.language_model." prefix); every slot must be present with the right shape, and
 * the file must hold no adapters m has no slot for. */
int adapters_load(gemma_model_f32 *m, const char *path, char *err, size_t errlen);
/* lora_config from an adapter_config.json written by adapters_save or mlx-lm. */
int adapter_config_load(const char *path, int layers, lora_config *lc, char *err, size_t errlen);

#endif
