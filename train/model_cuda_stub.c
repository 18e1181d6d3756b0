/* model_cuda_stub.c — model_cuda.h in a build without CUDA kernels (no nvcc, or CUDA_ARCHS=auto on a
 * machine without a GPU): every entry point says so. */
#include "model_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

long gemma_cuda_token_budget(gemma_cuda *g, long largest_batch) {
    (void)g, (void)largest_batch;
    return 0;
}

long gemma_cuda_forward_token_budget(gemma_cuda *g) {
    (void)g;
    return 0;
}

const char *gemma_cuda_layer_inputs(const gemma_cuda *g) {
    (void)g;
    return "no CUDA";
}

int gemma_cuda_open(const gemma_model_f32 *host, const char *dir, const gemma_cuda_options *o, gemma_cuda **out,
                    char *err, size_t errlen) {
    (void)host, (void)dir, (void)o;
    *out = NULL;
    snprintf(err, errlen, "this build has no CUDA kernels (nvcc was missing, or CUDA_ARCHS=auto found no GPU, when it was built): --device cuda "
                           "is unavailable; rebuild with nvcc and CUDA_ARCHS=all (or a list such as CUDA_ARCHS=sm_90a)");
    return -1;
}

void gemma_cuda_close(gemma_cuda *g) { (void)g; }

int gemma_cuda_forward_batch(gemma_cuda *g, const gemma_model_f32 *host, const gemma_seq *seqs, int n,
                             gemma_stats *stats, float *logits, char *err, size_t errlen) {
    (void)g, (void)host, (void)seqs, (void)n, (void)stats, (void)logits;
    snprintf(err, errlen, "this build has no CUDA");
    return -1;
}

int gemma_cuda_backward_batch(gemma_cuda *g, gemma_model_f32 *host, const gemma_seq *seqs, int n, double grad_scale,
                              gemma_stats *stats, char *err, size_t errlen) {
    (void)g, (void)host, (void)seqs, (void)n, (void)grad_scale, (void)stats;
    snprintf(err, errlen, "this build has no CUDA");
    return -1;
}

static int no_cuda(char *err, size_t errlen) {
    snprintf(err, errlen, "this build has no CUDA");
    return -1;
}

int gemma_cuda_params_upload(gemma_cuda *g, const gemma_model_f32 *host, char *err, size_t errlen) {
    (void)g, (void)host;
    return no_cuda(err, errlen);
}

int gemma_cuda_params_download(gemma_cuda *g, gemma_model_f32 *host, char *err, size_t errlen) {
    (void)g, (void)host;
    return no_cuda(err, errlen);
}

int gemma_cuda_grads_download(gemma_cuda *g, float *grads, char *err, size_t errlen) {
    (void)g, (void)grads;
    return no_cuda(err, errlen);
}

int gemma_cuda_grads_zero(gemma_cuda *g, char *err, size_t errlen) {
    (void)g;
    return no_cuda(err, errlen);
}

int gemma_cuda_moments_upload(gemma_cuda *g, const float *m1, const float *m2, char *err, size_t errlen) {
    (void)g, (void)m1, (void)m2;
    return no_cuda(err, errlen);
}

int gemma_cuda_moments_download(gemma_cuda *g, float *m1, float *m2, char *err, size_t errlen) {
    (void)g, (void)m1, (void)m2;
    return no_cuda(err, errlen);
}

int gemma_cuda_grads_first_nonfinite(gemma_cuda *g, size_t *index, float *value, char *err, size_t errlen) {
    (void)g, (void)index, (void)value;
    return no_cuda(err, errlen);
}

int gemma_cuda_optimizer_step(gemma_cuda *g, const gemma_cuda_adam *a, double *grad_norm, int *nonfinite, char *err,
                              size_t errlen) {
    (void)g, (void)a, (void)grad_norm, (void)nonfinite;
    return no_cuda(err, errlen);
}

void gemma_cuda_memory(gemma_cuda *g, size_t *peak, size_t *device_in_use) {
    (void)g;
    if (peak) *peak = 0;
    if (device_in_use) *device_in_use = 0;
}

void gemma_cuda_reset_peak(gemma_cuda *g) { (void)g; }

int gemma_cuda_profile_take(gemma_cuda *g, gemma_cuda_profile *out) {
    (void)g;
    if (out) memset(out, 0, sizeof *out);
    return 0;
}

const char *gemma_cuda_describe(const gemma_cuda *g) {
    (void)g;
    return "no CUDA";
}

int gemma_cuda_quantize(base_dtype base, const st_tensor *t, const char *name, gemma_cuda_packed *out, char *err,
                        size_t errlen) {
    (void)base, (void)t, (void)name;
    memset(out, 0, sizeof *out);
    return no_cuda(err, errlen);
}

void gemma_cuda_packed_free(gemma_cuda_packed *p) {
    for (int k = 0; k < 3; k++) free(p->part[k]);
    memset(p, 0, sizeof *p);
}

int gemma_cuda_fp8_product(int input_grad, long rows, long n_out, long k_in, const uint8_t *codes,
                           const float *row_scale, const uint16_t *x, uint16_t *y, uint8_t *xq, float *x_scale,
                           int *compute_capability, char *err, size_t errlen) {
    (void)input_grad, (void)rows, (void)n_out, (void)k_in, (void)codes, (void)row_scale, (void)x, (void)y, (void)xq;
    (void)x_scale;
    *compute_capability = 0;
    return no_cuda(err, errlen);
}

int gemma_cuda_residual_norm(int bf16_rows, long rows, int n, const void *resid, const void *x, const float *w,
                             float scale, const float *w2, float eps, void *h, void *y2, char *err, size_t errlen) {
    (void)bf16_rows, (void)rows, (void)n, (void)resid, (void)x, (void)w, (void)scale, (void)w2, (void)eps, (void)h;
    (void)y2;
    return no_cuda(err, errlen);
}

int gemma_cuda_residual_norms_bwd(int bf16_rows, long rows, int n, const void *dout, float scalar, const void *h,
                                  const float *w_pre_ffw, const void *d_mi, const void *ao, const float *w_post_attn,
                                  float eps, void *dx, void *d_ao, char *err, size_t errlen) {
    (void)bf16_rows, (void)rows, (void)n, (void)dout, (void)scalar, (void)h, (void)w_pre_ffw, (void)d_mi, (void)ao;
    (void)w_post_attn, (void)eps, (void)dx, (void)d_ao;
    return no_cuda(err, errlen);
}

int gemma_cuda_qkv_heads(int bf16_rows, int T, int heads, int kv_heads, int D, int k_eq_v, int v_norm, float eps,
                         const void *qkv, const float *q_w, const float *k_w, const int32_t *pos, int positions,
                         const float *cosv, const float *sinv, const void *d_qr, const void *d_kr, const void *d_vn,
                         void *qr, void *kr, void *vn, void *d_qkv, char *err, size_t errlen) {
    (void)bf16_rows, (void)T, (void)heads, (void)kv_heads, (void)D, (void)k_eq_v, (void)v_norm, (void)eps, (void)qkv;
    (void)q_w, (void)k_w, (void)pos, (void)positions, (void)cosv, (void)sinv, (void)d_qr, (void)d_kr, (void)d_vn;
    (void)qr, (void)kr, (void)vn, (void)d_qkv;
    return no_cuda(err, errlen);
}

int gemma_cuda_rsqrt(const float *x, float *y, long n, char *err, size_t errlen) {
    (void)x, (void)y, (void)n;
    return no_cuda(err, errlen);
}
