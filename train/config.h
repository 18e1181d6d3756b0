/* config.h — the Gemma text architecture as the trainer implements it, read from a Hugging
 * Face config.json (docs/design.md §6.1).
 *
 * Two families share one code path; the differences are switches here, not separate models:
 *                      Gemma 4                         Gemma 3
 *   RMSNorm            x·r·w                           x·r·(1+w)
 *   score scale        1.0 (q/k norms set it)          query_pre_attn_scalar^-1/2
 *   v_norm             RMSNorm without weight          none
 *   attention_k_eq_v   full layers: v = raw k_proj     no
 *   layer_scalar       one scalar per layer, stored    none
 *   RoPE               default / proportional          default / linear
 * Everything else (sandwich norms, q/k RMSNorm, tanh-GELU GeGLU, embedding × sqrt(hidden),
 * tied embeddings, optional final and attention logit softcaps) is common. Features the trainer
 * does not implement (KV sharing, per-layer embeddings, MoE, double-wide MLP) are refused when a
 * config enables them, never silently ignored. */
#ifndef WA_TRAIN_CONFIG_H
#define WA_TRAIN_CONFIG_H

#include "train.h" /* GEMMA_MAX_LAYERS */

#include <stddef.h>

typedef enum gemma_family { GEMMA_4, GEMMA_3 } gemma_family;
typedef enum gemma_layer_kind { LAYER_SLIDING, LAYER_FULL } gemma_layer_kind;

/* Rotary embedding of one layer kind: rotate-half (NeoX) pairs (j, j + D/2) with angle
 * position · inv_freq[j]. */
typedef struct gemma_rope {
    double theta;           /* base */
    double partial;         /* proportional: share of the pairs that rotate (1 = all) */
    double linear_factor;   /* linear: positions divided by this (1 = none) */
    int proportional;       /* exponent denominator is the full head dim, unrotated pairs keep angle 0 */
} gemma_rope;

/* The per-kind attention shape: sliding and full layers differ in heads and head dim. */
typedef struct gemma_attn_shape {
    int kv_heads;
    int head_dim;
    int k_eq_v;  /* no v_proj: values are v_norm(raw k_proj output) */
    gemma_rope rope;
} gemma_attn_shape;

typedef struct gemma_config {
    gemma_family family;
    int vocab;
    int hidden;
    int intermediate;
    int layers;
    int heads;                        /* query heads, both layer kinds */
    gemma_attn_shape kind[2];         /* indexed by gemma_layer_kind */
    gemma_layer_kind layer_kind[GEMMA_MAX_LAYERS];
    int sliding_window;               /* keys q-W < k <= q: W keys including the query itself */
    double norm_eps;
    double score_scale;               /* applied to q·k */
    double attn_softcap;              /* the tanh cap applied to scores; 0 = none (always, for now) */
    double attn_softcap_ignored;      /* config.json's attn_logit_softcapping (0 = null): read, checked,
                                       * and not applied, because transformers 5.x's Gemma 3 attention
                                       * never passes it on and Gemma 4's text attention has none */
    double final_softcap;             /* 0 = none */
    double embed_scale;               /* sqrt(hidden) */
    int tied_embeddings;
} gemma_config;

/* Parse config.json (a text config, or a multimodal one with "text_config"). 0 on success;
 * -1 with a one-line message naming the file and the problem. */
int gemma_config_load(const char *path, gemma_config *cfg, char *err, size_t errlen);

/* The same from JSON text already in memory (name is used in messages). */
int gemma_config_parse(const char *json_text, const char *name, gemma_config *cfg, char *err, size_t errlen);

/* One line describing the config, for logs. */
void gemma_config_describe(const gemma_config *cfg, char *buf, size_t buflen);

#endif
