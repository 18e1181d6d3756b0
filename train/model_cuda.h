/* model_cuda.h — the Gemma model of model.h on one NVIDIA GPU: the trainer's `--device cuda`.
 *
 * The host-side gemma_model_f32 keeps what the trainer works with (the config, the LoRA layout,
 * the adapters and their gradients, the optimizer's view); this object holds the frozen base
 * weights on the GPU and runs the forward and backward there:
 *   - weights in bf16 (or f32 with precision f32), copied from the memory-mapped checkpoint
 *     without an f32 copy on the host, or drawn on the GPU (random_init, no file needed);
 *     RMSNorm weights and layer scalars in f32;
 *   - activations in the weights' precision, every reduction (norms, softmax, cross-entropy) in
 *     f32; LoRA A and B in f32 master copies with a bf16 copy for the products; gradients f32;
 *   - matrix products through cuBLAS (loaded at run time: the command starts on machines without
 *     it), attention through winattn's CUDA kernels (one varlen call per layer), everything else
 *     in fused kernels of model_cuda.cu;
 *   - per-layer recomputation as on the CPU: the forward keeps the L+1 layer inputs only;
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
} gemma_cuda_options;

/* Put host's base weights on the GPU: from the checkpoint in dir (host must come from
 * gemma_model_layout_f32 or gemma_model_load_f32 on the same dir) or drawn from o->seed.
 * Non-finite weights are refused, naming the tensor. 0, or -1 with a one-line message. */
int gemma_cuda_open(const gemma_model_f32 *host, const char *dir, const gemma_cuda_options *o, gemma_cuda **out,
                    char *err, size_t errlen);
void gemma_cuda_close(gemma_cuda *g);

/* As gemma_forward_batch_f32 / gemma_backward_batch_f32 with host's current adapters: the
 * forward adds to *stats (logits, if not NULL, receives [T, vocab] f32 in packed order); the
 * backward also adds grad_scale · d(loss)/d(adapters) into host->grads. */
int gemma_cuda_forward_batch(gemma_cuda *g, const gemma_model_f32 *host, const gemma_seq *seqs, int n,
                             gemma_stats *stats, float *logits, char *err, size_t errlen);
int gemma_cuda_backward_batch(gemma_cuda *g, gemma_model_f32 *host, const gemma_seq *seqs, int n, double grad_scale,
                              gemma_stats *stats, char *err, size_t errlen);

/* How many packed tokens one forward + backward can hold in the device memory free now (with a
 * margin for winattn's and cuBLAS's workspace): the trainer runs a batch larger than this in
 * several passes. */
long gemma_cuda_token_budget(gemma_cuda *g);

/* Device memory: the peak since the last reset (weights, adapters, activations, winattn's and
 * cuBLAS's workspace), and what the whole device has in use now (cudaMemGetInfo). */
void gemma_cuda_memory(gemma_cuda *g, size_t *peak, size_t *device_in_use);
void gemma_cuda_reset_peak(gemma_cuda *g);
/* "NVIDIA H200, 139.8 GiB, bf16" */
const char *gemma_cuda_describe(const gemma_cuda *g);

#ifdef __cplusplus
}
#endif

#endif
