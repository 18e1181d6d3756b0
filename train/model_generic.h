/* model_generic.h — declarations for one precision of the model; included by model.h with
 * REAL (float or double) and MT(name) (name_f32 or name_f64) defined. No include guard on
 * purpose. */

/* A decoder layer's frozen weights (pointers into gemma_model.weights). */
typedef struct MT(gemma_layer) {
    gemma_layer_kind kind;
    const REAL *w[PROJ_COUNT];  /* [out, in] as in the checkpoint; w[PROJ_V] is NULL with k_eq_v */
    int in[PROJ_COUNT], out[PROJ_COUNT];
    const REAL *input_norm, *post_attn_norm, *pre_ffw_norm, *post_ffw_norm;  /* [hidden] */
    const REAL *q_norm, *k_norm;                                                /* [head_dim] */
    REAL layer_scalar;                                                          /* 1 for Gemma 3 */
    int lora[PROJ_COUNT];       /* slot index, -1 when the projection is not adapted */
} MT(gemma_layer);

typedef struct MT(gemma_model) {
    gemma_config cfg;
    lora_config lora;
    /* frozen base weights, one allocation, converted from the checkpoint's dtype */
    REAL *weights;
    size_t weight_count;
    const REAL *embed;       /* [vocab, hidden] */
    const REAL *lm_head;     /* [vocab, hidden]: the embedding when tied */
    const REAL *final_norm;  /* [hidden] */
    MT(gemma_layer) *layer;
    /* the trainable adapters and their gradients, flat */
    lora_slot *slots;
    int slot_count;
    size_t param_count;
    REAL *params;
    REAL *grads;
    /* how attention runs */
    attn_arm arm;
    int chunk;               /* query rows per block for ATTN_CHUNKED */
    wa_context *wa;          /* for ATTN_FUSED */
    size_t mem_limit;        /* bytes the dense/chunked arms may ask for at once; 0 = no check */
    char err[512];
} MT(gemma_model);

/* Load config.json and the weights from a checkpoint directory, check every tensor the config
 * implies for presence and shape, convert to this precision, and lay out zeroed adapters for
 * lora (rank 0 = none). 0 on success, -1 with a one-line message in err. */
int MT(gemma_model_load)(MT(gemma_model) *m, const char *dir, const lora_config *lora, char *err, size_t errlen);
/* The same with the decoder projections (q, k, v, o, gate, up, down) held as base says: BASE_MLX4,
 * BASE_NF4 and BASE_FP8 quantize and dequantize each (quant.h), so the model trains on the values
 * a quantized base holds; BASE_BF16 is gemma_model_load. A folder written by mlx_lm.convert -q
 * (config.json "quantization": bits 4, group 64) or a transformers checkpoint saved with a
 * bitsandbytes 4-bit nf4 "quantization_config" is read by dequantizing every packed weight,
 * whatever base. */
int MT(gemma_model_load_base)(MT(gemma_model) *m, const char *dir, const lora_config *lora, base_dtype base, char *err,
                              size_t errlen);
/* The same without the weights (w, norms and embeddings stay NULL, weight_count 0): for a model
 * whose base weights live on a GPU (model_cuda.h). config.json alone is read. */
int MT(gemma_model_layout)(MT(gemma_model) *m, const char *dir, const lora_config *lora, char *err, size_t errlen);
void MT(gemma_model_free)(MT(gemma_model) *m);

/* mlx-lm's initialisation: A uniform in ±1/sqrt(in), B zero. */
void MT(gemma_lora_init)(MT(gemma_model) *m, uint64_t seed);

/* Choose the attention arm; ATTN_FUSED creates a winattn context with `threads` threads
 * (float only). 0 or -1 with m->err. */
int MT(gemma_set_attention)(MT(gemma_model) *m, attn_arm arm, int chunk, int threads);

/* Forward over tokens[0..T): logits for positions 0..T-2 predict tokens 1..T-1; target t+1 counts
 * where target_mask is NULL or target_mask[t] != 0. Adds to *stats. If logits is not NULL it
 * receives [T, vocab] (after the final softcap). 0, or -1 with m->err. */
int MT(gemma_forward)(MT(gemma_model) *m, const int32_t *tokens, int T, const uint8_t *target_mask,
                      gemma_stats *stats, REAL *logits);

/* Forward and backward: adds grad_scale · d(sum of masked cross-entropy)/d(adapters) into
 * m->grads (the caller zeroes them per step and passes 1 / the batch's target count, for
 * mlx-lm's token-weighted mean). Adds to *stats. 0, or -1 with m->err. */
int MT(gemma_backward)(MT(gemma_model) *m, const int32_t *tokens, int T, const uint8_t *target_mask,
                       double grad_scale, gemma_stats *stats);

/* The same over a batch of n records packed into one sequence of T = Σ seqs[i].len rows (see
 * model.h): record i predicts only its own tokens, from positions 0..len-1 of its own. logits, if
 * not NULL, receives [T, vocab] in packed order. Loss sums, targets and gradients are those of
 * the n records run one by one, to float rounding. T must stay below 2^31. */
int MT(gemma_forward_batch)(MT(gemma_model) *m, const gemma_seq *seqs, int n, gemma_stats *stats, REAL *logits);
int MT(gemma_backward_batch)(MT(gemma_model) *m, const gemma_seq *seqs, int n, double grad_scale, gemma_stats *stats);
