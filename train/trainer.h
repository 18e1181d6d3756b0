/* trainer.h — the LoRA fine-tuning loop of `winattn train`, after mlx-lm's trainer
 * (docs/design.md §6.3): batches of consecutive records in file order whose order is re-permuted
 * every pass, the remainder dropped; token-weighted mean cross-entropy over each batch; Adam or
 * AdamW on the adapters only; held-out loss and next-token agreement. */
#ifndef WA_TRAIN_TRAINER_H
#define WA_TRAIN_TRAINER_H

#include "adapters.h" /* adapters_save, adapters_load, adapter_config_load: the adapter files */
#include "model.h"
#include "model_cuda.h"
#include "train.h" /* train_options, train_defaults, train_run: the interface this file implements */

/* The learning rate of optimizer update `update` (0 for the first) of a run of `updates` updates,
 * after o->lr and o->schedule (train.h gives the formulas; steps = 0 resolves to updates - warmup,
 * at least 1). */
double train_lr_at(const train_options *o, long update, long updates);

/* The global L2 norm of grads[0..n) (summed in double over fixed blocks, so the result does not
 * depend on the thread count); when max_norm > 0, grads are then scaled by
 * min(1, max_norm / (norm + 1e-6)), as mlx.optimizers.clip_grad_norm does. Returns the norm
 * before clipping. */
double train_clip_grad_norm(float *grads, size_t n, double max_norm, int threads);

/* For tests: when set, called after every trained batch (its update, log line and any
 * save_every checkpoint done) with the batches done so far. A hook may raise(SIGINT) to take the
 * interrupt path at a known step. NULL in normal use. */
extern void (*train_batch_hook)(long batches_done);

/* Adam's state for --resume: first and second moments of n entries each, and the update count. */
typedef struct optimizer {
    float *m1, *m2;
    size_t n;
    long updates;
} optimizer;
/* One Adam or AdamW update of params[0..opt->n) from grads at rate lr, after MLX (o gives the
 * betas, eps, weight decay, adamw and bias correction); opt->updates counts it. */
void train_optimizer_update(optimizer *opt, float *params, const float *grads, const train_options *o, double lr);
/* Reads dir/optimizer.safetensors into opt (m1 and m2 already allocated, n set): F32 m1 and m2 of
 * n entries, metadata "batches" (digits only, in [0, iters]: iters is the run's batch count) into
 * *batches_done and "updates" (digits only, in [0, batches]). 0, or -1 with a one-line message
 * naming the file; m1, m2 and updates change only on success (*batches_done may not). */
int optimizer_load(optimizer *opt, long *batches_done, long iters, const char *dir, char *err, size_t errlen);

#endif
