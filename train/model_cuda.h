/* model_cuda.h — the Gemma model of model.h on one NVIDIA GPU: the trainer's `--device cuda`.
 *
 * The host-side gemma_model_f32 gives the config and the LoRA layout, and receives the adapters
 * when the trainer saves them; this object holds the frozen base weights, the adapters, their
 * gradients and Adam's moments on the GPU and runs the forward, the backward and the optimizer
 * update there:
 *   - weights in bf16 (or f32 with precision f32), copied from the memory-mapped checkpoint
 *     without an f32 copy on the host, or drawn on the GPU (random_init, no file needed);
 *     RMSNorm weights and layer scalars in f32;
 *   - with a quantized base (options.base mlx4, nf4 or fp8, or a folder written by
 *     mlx_lm.convert -q or saved with a bitsandbytes 4-bit quantization_config) the decoder's
 *     projections stay on the device in their packed form: a float checkpoint's (or a drawn)
 *     projection is quantized on the device at load, one at a time, with train/quant.c's
 *     arithmetic (the CPU reference's codes and scales, bit for bit; nf4's double quantization of
 *     the n / 64 absmax on the host with quant.c's own functions), a packed one is copied as
 *     stored. Each layer's projections are dequantized into one E scratch right before its
 *     products; the backward's recomputation and the backward of a layer share one
 *     dequantization. The values the products see are the CPU reference's dequantized f32
 *     values, rounded to bf16 in bf16 precision and unchanged in f32. Except fp8
 *     in bf16 on compute capability 8.9 or more (where cuBLASLt, loaded at run time, takes
 *     outer-vector FP8 scaling): its products multiply the codes themselves, the activations and
 *     the weight-scaled gradients quantized to e4m3 a token a row on the fly, the codes transposed
 *     one layer at a time for the input gradient (model_cuda.cu: "FP8 products");
 *   - activations in the weights' precision, every reduction (norms, softmax, cross-entropy) in
 *     f32; LoRA A and B in f32 master copies with a bf16 copy for the products; gradients and Adam's
 *     moments f32;
 *   - matrix products through cuBLAS (loaded at run time: the command starts on machines without
 *     it), attention through winattn's CUDA kernels (one varlen call per layer), everything else
 *     in fused kernels of model_cuda.cu;
 *   - per-layer recomputation as on the CPU: the forward keeps the L+1 layer inputs only, all but
 *     the last in page-locked host memory, copied down and up on a second stream beside the
 *     computation (gemma_cuda_token_budget);
 *   - the head in chunks of rows: logits [chunk, vocab] in f32 and their gradient, never [T, vocab].
 * Precision f32 runs the same code with f32 everywhere and pure-f32 products (no TF32): it
 * agrees with the CPU model to float rounding and is what the tests compare against.
 *
 * Built when nvcc is found (model_cuda.cu); otherwise model_cuda_stub.c makes every entry point
 * report that the build has no CUDA. */
#ifndef WA_TRAIN_MODEL_CUDA_H
#define WA_TRAIN_MODEL_CUDA_H

#include "model.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gemma_cuda gemma_cuda;

typedef struct gemma_cuda_options {
    gemma_precision precision;
    int random_init;     /* 1: base weights drawn on the GPU from seed, the checkpoint's tensors unread */
    uint64_t seed;
    int logit_rows;      /* rows of the head per chunk; 0 = as many as fit 1 GiB of f32 logits */
    int deterministic;   /* 1: winattn's deterministic backward (wa_context_params.cuda_deterministic):
                          * with it every kernel of a step gives the same bits run to run */
    base_dtype base;     /* the frozen projections' format (train.h); BASE_BF16 (0) keeps them in E */
} gemma_cuda_options;

/* Put host's base weights on the GPU: from the checkpoint in dir (host must come from
 * gemma_model_layout_f32 or gemma_model_load_f32 on the same dir) or drawn from o->seed.
 * Non-finite weights are refused, naming the tensor. 0, or -1 with a one-line message. */
int gemma_cuda_open(const gemma_model_f32 *host, const char *dir, const gemma_cuda_options *o, gemma_cuda **out,
                    char *err, size_t errlen);
void gemma_cuda_close(gemma_cuda *g);

/* The adapters, their gradients and Adam's moments live on the device: the device copy is the
 * authoritative one on the GPU path, and nothing of it crosses to the host per step.
 *   - params: the f32 master copy and the E copy the products use. gemma_cuda_open uploads
 *     host->params as they are then; after that only gemma_cuda_params_upload does (a fresh
 *     initialisation, --adapters, --resume).
 *   - grads: f32, zero after open and after every optimizer step; every backward adds to them, so
 *     the passes of a batch and the batches of one update accumulate there.
 *   - Adam's first and second moments: f32, zero after open. */

/* As gemma_forward_batch_f32 / gemma_backward_batch_f32 with the device's adapters (host gives the
 * model's layout only): the forward adds to *stats (logits, if not NULL, receives [T, vocab] f32
 * in packed order); the backward also adds grad_scale · d(loss)/d(adapters) into the device's
 * gradients (host->grads is not touched). */
int gemma_cuda_forward_batch(gemma_cuda *g, const gemma_model_f32 *host, const gemma_seq *seqs, int n,
                             gemma_stats *stats, float *logits, char *err, size_t errlen);
int gemma_cuda_backward_batch(gemma_cuda *g, gemma_model_f32 *host, const gemma_seq *seqs, int n, double grad_scale,
                              gemma_stats *stats, char *err, size_t errlen);

/* The rare transfers. params: host->params (param_count f32) to the device (and its E copy) or
 * back; grads: the device's gradients into grads[0..param_count) (tests; the trainer never needs
 * them); moments: Adam's m and v, param_count f32 each, for a checkpoint or a resume. And
 * gemma_cuda_grads_zero, the start of an update's accumulation. Each returns when the device is
 * done: 0, or -1 with a one-line message. */
int gemma_cuda_params_upload(gemma_cuda *g, const gemma_model_f32 *host, char *err, size_t errlen);
int gemma_cuda_params_download(gemma_cuda *g, gemma_model_f32 *host, char *err, size_t errlen);
int gemma_cuda_grads_download(gemma_cuda *g, float *grads, char *err, size_t errlen);
int gemma_cuda_grads_zero(gemma_cuda *g, char *err, size_t errlen);
int gemma_cuda_moments_upload(gemma_cuda *g, const float *m1, const float *m2, char *err, size_t errlen);
int gemma_cuda_moments_download(gemma_cuda *g, float *m1, float *m2, char *err, size_t errlen);

/* The first non-finite entry of the device's gradients: *index (SIZE_MAX when all are finite) and
 * its value. The flat order is the host's (model.h: slot by slot, A then B). */
int gemma_cuda_grads_first_nonfinite(gemma_cuda *g, size_t *index, float *value, char *err, size_t errlen);

/* One optimizer update, as the trainer's host path makes it (train_clip_grad_norm, then Adam or
 * AdamW after MLX: trainer.c's train_optimizer_update), on the device's gradients. */
typedef struct gemma_cuda_adam {
    double lr;                /* the schedule's rate for this update */
    double beta1, beta2, eps;
    double weight_decay;      /* AdamW's decay, applied only with adamw */
    int adamw;
    int bias_correction;
    long update;              /* this update's count from 1 (the bias correction's exponent) */
    double grad_clip;         /* clip to this global L2 norm first; 0 = off */
} gemma_cuda_adam;

/* The global L2 norm of the gradients into *grad_norm (before clipping). A non-finite norm (which
 * happens exactly when some gradient is NaN or ±inf: squares of finite f32 values summed in double
 * cannot overflow) sets *nonfinite = 1 and changes nothing: params, moments and gradients stay as
 * they were. Otherwise *nonfinite = 0, the gradients are scaled by min(1, grad_clip / (norm +
 * 1e-6)) when grad_clip > 0, Adam(W) updates the params and moments, the E copy is refreshed and
 * the gradients are zeroed. The norm is deterministic (the same bits on every run of one build):
 * a fixed partition into blocks, each summed in double in a fixed order, then the block sums in a
 * fixed order. 0, or -1 with a one-line message. */
int gemma_cuda_optimizer_step(gemma_cuda *g, const gemma_cuda_adam *a, double *grad_norm, int *nonfinite, char *err,
                              size_t errlen);

/* How many packed tokens one forward + backward can hold in the device memory free now (with a
 * margin for winattn's and cuBLAS's workspace): the trainer runs a batch larger than this in
 * several passes. The backward keeps its layer inputs (all but the last) in page-locked host
 * memory: this allocates it for the largest pass to come, min(largest_batch, the budget) tokens
 * (largest_batch 0: the budget), and counts two [T, hidden] buffers on the device. Where the host
 * refuses that memory (cudaHostAlloc, or more than 80% of what the kernel calls available), the
 * inputs stay on the device, all L + 1, and the budget counts them there; gemma_cuda_layer_inputs
 * says which. A backward larger than the host memory held grows it, and fails with a one-line
 * message naming the bytes when the host refuses. */
long gemma_cuda_token_budget(gemma_cuda *g, long largest_batch);
/* "layer inputs in page-locked host memory (19.38 GB for 30553 tokens)", or "layer inputs on the
 * device (refused: ...)" with the host memory that was needed */
const char *gemma_cuda_layer_inputs(const gemma_cuda *g);
/* How many packed tokens one forward alone (an evaluation) can hold in the device memory free now,
 * with the margins of gemma_cuda_token_budget; no memory is allocated. */
long gemma_cuda_forward_token_budget(gemma_cuda *g);

/* Device memory: the peak since the last reset (weights, adapters, activations, winattn's and
 * cuBLAS's workspace), and what the whole device has in use now (cudaMemGetInfo). */
void gemma_cuda_memory(gemma_cuda *g, size_t *peak, size_t *device_in_use);
void gemma_cuda_reset_peak(gemma_cuda *g);

/* Where the device's time goes, with WINATTN_TRAIN_PROFILE=1 in the environment (events recorded
 * between the phases; off, nothing is recorded). The phases: the frozen projections' products (for
 * an fp8 base the FP8 products alone), the LoRA products, attention (winattn), the elementwise
 * kernels, the head (final norm, logits, cross-entropy and their backward), the FP8 inputs'
 * quantization, the waits for the layer inputs' copies, and the optimizer update. */
enum {
    GEMMA_PHASE_PRODUCTS,
    GEMMA_PHASE_LORA,
    GEMMA_PHASE_ATTENTION,
    GEMMA_PHASE_ELEMENTWISE,
    GEMMA_PHASE_HEAD,
    GEMMA_PHASE_FP8_QUANT,
    GEMMA_PHASE_COPY_WAITS,
    GEMMA_PHASE_OPTIMIZER,
    GEMMA_PHASES
};
typedef struct gemma_cuda_profile {
    int passes;                /* forward or forward + backward calls, and optimizer updates, summed */
    long tokens;               /* the forward and forward + backward calls' tokens */
    double ms[GEMMA_PHASES];   /* device milliseconds by phase */
    double flop[GEMMA_PHASES]; /* the products' floating-point operations (2·m·n·k each) by phase */
} gemma_cuda_profile;
/* The profile summed since the last take into *out (when out is not NULL), and the sum started
 * afresh: 1, or 0 when profiling is off or nothing ran since (*out then zero). */
int gemma_cuda_profile_take(gemma_cuda *g, gemma_cuda_profile *out);

/* "NVIDIA H200, 139.8 GiB, bf16" */
const char *gemma_cuda_describe(const gemma_cuda *g);

/* One float tensor quantized on the device as gemma_cuda_open quantizes a checkpoint's projection
 * (the same functions; for the tests, which hold it against train/quant.c): t is [rows, cols] of
 * F32, F16, BF16 or F64 as a checkpoint stores it, base BASE_MLX4, BASE_NF4 or BASE_FP8; the packed
 * form the device keeps, copied back:
 *   mlx4: part[0] the words (rows · cols / 8 uint32, eight codes a word, the first in the low bits),
 *         part[1] and part[2] the scales and biases [rows · cols / 64] in t's dtype (f32 for F64);
 *   nf4:  part[0] the codes two a byte (the first in the high nibble), part[1] the absmax codes
 *         [ceil(n / 64)], part[2] the nested absmax (f32 [ceil(n / 64 / 256)]), and offset;
 *   fp8:  part[0] the e4m3 codes [rows · cols], part[1] the row scales (f32 [rows]).
 * 0, or -1 with the loader's one-line message naming `name` (out then holds nothing). */
typedef struct gemma_cuda_packed {
    int count;             /* parts */
    unsigned char *part[3];
    size_t bytes[3];
    float offset;          /* nf4: the mean absmax subtracted before the 8-bit step */
} gemma_cuda_packed;
int gemma_cuda_quantize(base_dtype base, const st_tensor *t, const char *name, gemma_cuda_packed *out, char *err,
                        size_t errlen);
void gemma_cuda_packed_free(gemma_cuda_packed *p);

/* One FP8 product of the fp8 base's bf16 path alone, for tests: codes [n_out, k_in] e4m3 with
 * row_scale[n_out] (quant.h's fp8 format) are the weight W; x holds bf16 bits.
 *   input_grad 0, the forward:        y [rows, n_out] = x [rows, k_in] · Wᵀ;
 *   input_grad 1, the input gradient: y [rows, k_in] = x [rows, n_out] · W.
 * y receives bf16 bits; xq and x_scale (when not NULL) the operand's rows as the device quantized
 * them ([rows, k_in] or [rows, n_out] codes, [rows] scales; for the input gradient x times the
 * row scales first). *compute_capability gets the device's (90 for 9.0). 0; 1 where the device
 * takes no FP8 products (below 8.9, or cuBLASLt refuses outer-vector scaling there); -1 with a
 * one-line message. */
int gemma_cuda_fp8_product(int input_grad, long rows, long n_out, long k_in, const uint8_t *codes,
                           const float *row_scale, const uint16_t *x, uint16_t *y, uint8_t *xq, float *x_scale,
                           int *compute_capability, char *err, size_t errlen);

/* The decoder layer's residual kernels alone, for tests (which hold them against a host
 * implementation of the same f32 operations, byte for byte): rows [rows, n] of E, bf16 bits
 * (uint16_t) when bf16_rows, else f32; weights f32 [n]. Each row is one block of 256 threads, thread
 * i taking entries i, i + 256, … in order; a row's sums run per thread in that order (each term
 * fused into the running sum: fmaf), then over each warp of 32 as a butterfly (lane j adds lane
 * j ^ 16, then j ^ 8, … j ^ 1), then the 8 warp sums padded with zeros to 32 the same way; E
 * roundings are to nearest even. inv(v) = rsqrtf(v / n + eps) on the device (gemma_cuda_rsqrt).
 *   residual_norm, the close of a layer's attention or MLP half with the next norm:
 *     t = E(x · inv(Σx²) · w), s = E(resid + t) (in f32, where E is no rounding, s = fmaf(x · inv,
 *     w, resid)), with scale ≠ 1 s = E(s · scale), h = s, and with w2 (not NULL)
 *     y2 = E(h · inv(Σh²) · w2).
 *   residual_norms_bwd, the backward through h = x + norm(ao)·w_post_attn, mi = norm(h)·w_pre_ffw
 *     and out = (h + …)·scalar, for each norm norm'(x, w, dy) = fmaf(inv·dy, w, −(x·k)) with
 *     k = inv·inv·inv·Σfmaf(x, dy·w) / n:
 *     dx = E(E(dout · scalar) + norm'(h, w_pre_ffw, d_mi)), d_ao = E(0 + norm'(ao, w_post_attn, dx)).
 * 0, or -1 with a one-line message. */
int gemma_cuda_residual_norm(int bf16_rows, long rows, int n, const void *resid, const void *x, const float *w,
                             float scale, const float *w2, float eps, void *h, void *y2, char *err, size_t errlen);
int gemma_cuda_residual_norms_bwd(int bf16_rows, long rows, int n, const void *dout, float scalar, const void *h,
                                  const float *w_pre_ffw, const void *d_mi, const void *ao, const float *w_post_attn,
                                  float eps, void *dx, void *d_ao, char *err, size_t errlen);
/* The per-head kernels of a layer's fused q|k|v projection alone, forward then backward, for the
 * same tests: qkv [T, ld] of E (bf16 bits when bf16_rows, else f32) with ld = (heads + kv_heads +
 * (k_eq_v ? 0 : kv_heads)) · D, q's heads first, then k's, then v's (k_eq_v: none, the values are
 * the raw keys); q_w, k_w [D]; the RoPE tables cosv, sinv [positions, D / 2] f32 and each row's
 * position pos[T]. One warp per head vector: lane l takes entries l, l + 32, … (of D in the
 * forward, pairs (j, j + D/2) for j = l, l + 32, … < D/2 in the backward), its sums in that order,
 * then the butterfly of 32 lanes; inv = rsqrtf(Σ / D + eps); a·b + c·d is fmaf(a, b, c·d),
 * a·b − c·d is fmaf(a, b, −(c·d)), a weight of 1 (v) is no multiply.
 *   forward: qr, kr = E(rope(x · inv · w)) with rope (x1, x2) → (x1·c − x2·s, x2·c + x1·s) at the
 *     row's position; vn = E(v · inv) with v_norm, else E(v) ([T, heads or kv_heads, D]).
 *   backward, from d_qr, d_kr, d_vn into d_qkv (q|k|v as qkv): u = rope⁻¹(dy) = (a·c + b·s,
 *     b·c − a·s); Σx² as fmaf(x1, x1, x2·x2) a pair, g·x as u1·w1·x1 + u2·w2·x2 a pair; dx =
 *     inv·u·w − x·k with k = inv·inv·inv·Σg·x / D; with k_eq_v the k heads add the weightless norm
 *     backward of d_vn, inv·dv − x·k2 (k2 from Σ dv·x); v heads (separate) the weightless norm
 *     backward (v_norm) or dv as is.
 * 0, or -1 with a one-line message. */
int gemma_cuda_qkv_heads(int bf16_rows, int T, int heads, int kv_heads, int D, int k_eq_v, int v_norm, float eps,
                         const void *qkv, const float *q_w, const float *k_w, const int32_t *pos, int positions,
                         const float *cosv, const float *sinv, const void *d_qr, const void *d_kr, const void *d_vn,
                         void *qr, void *kr, void *vn, void *d_qkv, char *err, size_t errlen);
/* y[i] = the device's rsqrtf(x[i]) (the special function unit's approximation, which the host
 * cannot reproduce): the one device operation the tests' host implementations borrow. */
int gemma_cuda_rsqrt(const float *x, float *y, long n, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
