/* model.h — Gemma 4 / Gemma 3 text model with LoRA adapters: forward, loss, and the backward
 * into the adapters, one sequence at a time with per-layer recomputation.
 *
 * The model exists in two precisions from one source (model.c, compiled twice like the CPU
 * attention kernels): float, which the trainer runs, and double, which the tests use for
 * finite differences against the float64 references. gemma_model_f32 / gemma_model_f64 and
 * their functions are declared by model_generic.h, included below once per precision.
 *
 * A batch of records runs packed: the records laid end to end as one sequence of T = Σ len rows,
 * no padding. Every per-token op (embedding, norms, projections with LoRA, MLP, head and loss)
 * runs once over the T rows; RoPE positions restart at 0 for each record; attention keeps each
 * record to itself: one winattn varlen call per layer for the fused arm, a loop over the records
 * for the dense and chunked arms. A batch of one record is the plain single-sequence model.
 *
 * Memory for T packed tokens: the L+1 layer inputs (T·hidden each) plus one layer's
 * activations, recomputed layer by layer during the backward (as mlx-lm's grad_checkpoint does),
 * plus what the attention arm needs: nothing quadratic for the fused arm (winattn); the full
 * score matrix of every head for the dense arm (what a framework's unfused fallback keeps); the
 * probabilities of each query block over its visible keys for the chunked arm (what autodiff
 * keeps for the model-side workaround); for these two, summed over the records of the batch. */
#ifndef WA_TRAIN_MODEL_H
#define WA_TRAIN_MODEL_H

#include "checkpoint.h"
#include "config.h"
#include "train.h" /* attn_arm, lora_config (proj_mask: a bit per gemma_proj) */
#include "winattn.h"

#include <stddef.h>
#include <stdint.h>

/* The linear layers of a decoder layer, in the order of the data flow. */
typedef enum gemma_proj { PROJ_Q, PROJ_K, PROJ_V, PROJ_O, PROJ_GATE, PROJ_UP, PROJ_DOWN, PROJ_COUNT } gemma_proj;

/* "self_attn.q_proj", ..., "mlp.down_proj": the module paths in checkpoints and adapter files */
extern const char *const gemma_proj_path[PROJ_COUNT];
/* "q", "k", "v", "o", "gate", "up", "down": the short names the command line takes */
extern const char *const gemma_proj_short[PROJ_COUNT];

const char *attn_arm_name(attn_arm arm);

/* One adapted projection: where its A and B live in the model's flat parameter vector. */
typedef struct lora_slot {
    int layer;
    gemma_proj proj;
    int in, out;
    size_t a, b;  /* offsets of A (in·r) and B (r·out) */
} lora_slot;

/* One record of a batch: tokens[0..len) and its target mask [len - 1] (NULL = every target). */
typedef struct gemma_seq {
    const int32_t *tokens;
    int len;
    const uint8_t *target_mask;
} gemma_seq;

/* What a forward over one sequence or batch measured on its masked targets. */
typedef struct gemma_stats {
    double loss_sum;  /* sum of per-token cross-entropy (nats) */
    long tokens;      /* masked target tokens */
    long agree;       /* of those, where argmax(logits) == target */
} gemma_stats;

#define REAL float
#define MT(name) name##_f32
#include "model_generic.h"
#undef REAL
#undef MT

#define REAL double
#define MT(name) name##_f64
#include "model_generic.h"
#undef REAL
#undef MT

#endif
