/* winattn.c — the public entry points: one validator every backend relies on, the context, and
 * the dispatch to the CPU tiled kernels, the dense baseline or CUDA.
 *
 * "The function that decides support is the function that dispatches": validate() fills a
 * wa_problem, and nothing downstream re-checks caller input.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- errors ---- */

static _Thread_local char last_error[512];

wa_status wa_fail(wa_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return s;
}

void wa_clear_error(void) { last_error[0] = '\0'; }

const char *wa_last_error(void) { return last_error; }

const char *wa_status_str(wa_status s) {
    switch (s) {
    case WA_OK: return "ok";
    case WA_ERR_INVALID_ARG: return "invalid argument";
    case WA_ERR_SHAPE: return "bad shape";
    case WA_ERR_STRIDE: return "bad stride";
    case WA_ERR_DTYPE: return "bad dtype";
    case WA_ERR_DEVICE: return "bad device";
    case WA_ERR_UNSUPPORTED: return "unsupported";
    case WA_ERR_NO_MEMORY: return "out of memory";
    case WA_ERR_CUDA: return "CUDA error";
    }
    return "unknown status";
}

size_t wa_dtype_size(wa_dtype dt) {
    switch (dt) {
    case WA_F32: return 4;
    case WA_F16:
    case WA_BF16: return 2;
    }
    return 0;
}

const char *wa_version(void) { return "0.2.0"; }

const char *wa_cpu_kernels(void) { return wa_cpu_isa(); }

int wa_device_available(wa_device dev) {
    if (dev == WA_DEVICE_CPU) return 1;
    if (dev == WA_DEVICE_CUDA) return wa_cuda_available();
    return 0;
}

/* ---- context ---- */

void *wa_alloc(wa_context *ctx, size_t bytes) {
    if (bytes == 0) bytes = 64;
    if (ctx->params.alloc) return ctx->params.alloc(ctx->params.alloc_user, bytes);
    void *p = NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    return p;
}

void wa_free(wa_context *ctx, void *ptr) {
    if (!ptr) return;
    if (ctx->params.free) ctx->params.free(ctx->params.alloc_user, ptr);
    else free(ptr);
}

#define WA_DEFAULT_TILE_Q 64
#define WA_DEFAULT_TILE_K 64
#define WA_MAX_TILE 1024
#define WA_MAX_THREADS 1024

wa_status wa_context_create(const wa_context_params *params, wa_context **out) {
    wa_clear_error();
    if (!out) return wa_fail(WA_ERR_INVALID_ARG, "wa_context_create: out is NULL");
    *out = NULL;
    wa_context_params p;
    memset(&p, 0, sizeof p);
    if (params) p = *params;
    if (p.threads < 0 || p.threads > WA_MAX_THREADS)
        return wa_fail(WA_ERR_INVALID_ARG, "threads = %d, must be 0 (all CPUs) to %d", p.threads, WA_MAX_THREADS);
    if (p.tile_q < 0 || p.tile_q > WA_MAX_TILE || p.tile_k < 0 || p.tile_k > WA_MAX_TILE)
        return wa_fail(WA_ERR_INVALID_ARG, "tile_q = %d, tile_k = %d, each must be 0 (default) to %d",
                       p.tile_q, p.tile_k, WA_MAX_TILE);
    if (p.algorithm != WA_ALGO_TILED && p.algorithm != WA_ALGO_DENSE)
        return wa_fail(WA_ERR_INVALID_ARG, "algorithm = %d is not WA_ALGO_TILED or WA_ALGO_DENSE", (int)p.algorithm);
    if (p.cuda_deterministic != 0 && p.cuda_deterministic != 1)
        return wa_fail(WA_ERR_INVALID_ARG, "cuda_deterministic = %d, must be 0 or 1", p.cuda_deterministic);
    if ((p.alloc == NULL) != (p.free == NULL))
        return wa_fail(WA_ERR_INVALID_ARG, "alloc and free must be given together");

    wa_context *ctx = p.alloc ? p.alloc(p.alloc_user, sizeof *ctx) : malloc(sizeof *ctx);
    if (!ctx) return wa_fail(WA_ERR_NO_MEMORY, "cannot allocate the context");
    memset(ctx, 0, sizeof *ctx);
    ctx->params = p;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    ctx->threads = p.threads ? p.threads : (online > 0 ? (int)wa_min64(online, WA_MAX_THREADS) : 1);
    ctx->tile_q = p.tile_q ? p.tile_q : WA_DEFAULT_TILE_Q;
    ctx->tile_k = p.tile_k ? p.tile_k : WA_DEFAULT_TILE_K;
    ctx->pool = wa_pool_create(ctx->threads);
    if (!ctx->pool) {
        if (p.free) p.free(p.alloc_user, ctx);
        else free(ctx);
        return wa_fail(WA_ERR_NO_MEMORY, "cannot start %d worker threads", ctx->threads);
    }
    *out = ctx;
    return WA_OK;
}

void wa_context_destroy(wa_context *ctx) {
    if (!ctx) return;
    wa_cuda_context_release(ctx);
    wa_pool_destroy(ctx->pool);
    if (ctx->params.free) ctx->params.free(ctx->params.alloc_user, ctx);
    else free(ctx);
}

/* ---- memory helpers ---- */

wa_status wa_malloc(wa_context *ctx, wa_device dev, size_t bytes, void **ptr) {
    wa_clear_error();
    if (!ctx || !ptr) return wa_fail(WA_ERR_INVALID_ARG, "wa_malloc: context or ptr is NULL");
    *ptr = NULL;
    if (dev == WA_DEVICE_CPU) {
        *ptr = wa_alloc(ctx, bytes);
        return *ptr ? WA_OK : wa_fail(WA_ERR_NO_MEMORY, "cannot allocate %zu bytes", bytes);
    }
    if (dev == WA_DEVICE_CUDA) return wa_cuda_malloc(bytes, ptr);
    return wa_fail(WA_ERR_DEVICE, "unknown device %d", (int)dev);
}

void wa_free_memory(wa_context *ctx, wa_device dev, void *ptr) {
    if (!ctx || !ptr) return;
    if (dev == WA_DEVICE_CPU) wa_free(ctx, ptr);
    else if (dev == WA_DEVICE_CUDA) wa_cuda_free(ptr);
}

wa_status wa_memcpy(wa_context *ctx, void *dst, wa_device dst_dev, const void *src, wa_device src_dev, size_t bytes) {
    wa_clear_error();
    if (!ctx) return wa_fail(WA_ERR_INVALID_ARG, "wa_memcpy: context is NULL");
    if (bytes == 0) return WA_OK;
    if (!dst || !src) return wa_fail(WA_ERR_INVALID_ARG, "wa_memcpy: NULL pointer");
    if ((unsigned)dst_dev > WA_DEVICE_CUDA || (unsigned)src_dev > WA_DEVICE_CUDA)
        return wa_fail(WA_ERR_DEVICE, "wa_memcpy: unknown device");
    if (dst_dev == WA_DEVICE_CPU && src_dev == WA_DEVICE_CPU) {
        memmove(dst, src, bytes);
        return WA_OK;
    }
    int kind = dst_dev == WA_DEVICE_CUDA ? (src_dev == WA_DEVICE_CUDA ? 2 : 0) : 1;
    return wa_cuda_memcpy(ctx, dst, src, bytes, kind);
}

wa_status wa_cuda_memory(wa_context *ctx, size_t *in_use, size_t *workspace_peak) {
    wa_clear_error();
    if (!ctx || !in_use || !workspace_peak) return wa_fail(WA_ERR_INVALID_ARG, "wa_cuda_memory: NULL argument");
    *in_use = *workspace_peak = 0;
    if (!wa_cuda_available()) return wa_fail(WA_ERR_UNSUPPORTED, "no usable CUDA device in this build or machine");
    return wa_cuda_memory_impl(ctx, in_use, workspace_peak);
}

wa_status wa_synchronize(wa_context *ctx) {
    wa_clear_error();
    if (!ctx) return wa_fail(WA_ERR_INVALID_ARG, "wa_synchronize: context is NULL");
    return wa_cuda_available() ? wa_cuda_synchronize(ctx) : WA_OK;
}

/* ---- validation ---- */

static const char *const shape_names[4] = {"B", "H", "N", "D"};

static wa_status check_tensor(const char *name, const wa_tensor *t, int is_lse) {
    if (!t) return wa_fail(WA_ERR_INVALID_ARG, "%s is NULL", name);
    if ((unsigned)t->dtype > WA_BF16) return wa_fail(WA_ERR_DTYPE, "%s: unknown dtype %d", name, (int)t->dtype);
    if ((unsigned)t->device > WA_DEVICE_CUDA) return wa_fail(WA_ERR_DEVICE, "%s: unknown device %d", name, (int)t->device);
    int64_t elems = 1;
    for (int d = 0; d < 4; d++) {
        if (t->shape[d] < 0)
            return wa_fail(WA_ERR_SHAPE, "%s: shape[%d] (%s) = %lld is negative", name, d,
                           is_lse && d == 3 ? "1" : shape_names[d], (long long)t->shape[d]);
        if (t->stride[d] < 0)
            return wa_fail(WA_ERR_STRIDE, "%s: stride[%d] = %lld is negative", name, d, (long long)t->stride[d]);
        elems *= t->shape[d];
    }
    if (!is_lse && t->shape[3] > 1 && t->stride[3] != 1)
        return wa_fail(WA_ERR_STRIDE, "%s: head-dim stride is %lld, must be 1", name, (long long)t->stride[3]);
    if (elems > 0 && !t->data) return wa_fail(WA_ERR_INVALID_ARG, "%s: data is NULL", name);
    return WA_OK;
}

static wa_status check_same_shape(const char *name, const wa_tensor *t, const char *ref_name, const wa_tensor *ref) {
    for (int d = 0; d < 4; d++)
        if (t->shape[d] != ref->shape[d])
            return wa_fail(WA_ERR_SHAPE, "%s has shape [%lld,%lld,%lld,%lld] but %s has [%lld,%lld,%lld,%lld]; they must match",
                           name, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2], (long long)t->shape[3],
                           ref_name, (long long)ref->shape[0], (long long)ref->shape[1], (long long)ref->shape[2],
                           (long long)ref->shape[3]);
    return WA_OK;
}

/* Byte range [lo, hi) a tensor touches; empty tensors touch nothing. */
static void tensor_extent(const wa_tensor *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t last = 0;
    for (int d = 0; d < 4; d++) {
        if (t->shape[d] == 0) {
            *lo = *hi = 0;
            return;
        }
        last += (t->shape[d] - 1) * t->stride[d];
    }
    *lo = (uintptr_t)t->data;
    *hi = *lo + (uintptr_t)((last + 1) * (int64_t)wa_dtype_size(t->dtype));
}

/* An output must not alias itself (stride 0 over a repeated dimension: two logical elements,
 * one address, and the result would depend on thread timing) nor overlap any input. */
static wa_status check_output(const char *name, const wa_tensor *out, const wa_tensor *const *inputs,
                              const char *const *input_names, int n_inputs) {
    int empty = out->shape[0] == 0 || out->shape[1] == 0 || out->shape[2] == 0 || out->shape[3] == 0;
    for (int d = 0; d < 3 && !empty; d++)
        if (out->shape[d] > 1 && out->stride[d] == 0)
            return wa_fail(WA_ERR_STRIDE, "%s: stride[%d] is 0 over %lld elements; an output cannot alias itself", name,
                           d, (long long)out->shape[d]);
    uintptr_t olo, ohi;
    tensor_extent(out, &olo, &ohi);
    for (int i = 0; i < n_inputs; i++) {
        if (!inputs[i]) continue;
        uintptr_t ilo, ihi;
        tensor_extent(inputs[i], &ilo, &ihi);
        if (olo < ohi && ilo < ihi && olo < ihi && ilo < ohi)
            return wa_fail(WA_ERR_STRIDE, "output %s overlaps input %s in memory", name, input_names[i]);
    }
    return WA_OK;
}

static wa_status validate(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                          const wa_tensor *v, const wa_tensor *o, const wa_tensor *lse, const wa_tensor *do_,
                          const wa_tensor *dq, const wa_tensor *dk, const wa_tensor *dv, int backward, int need_outputs,
                          wa_problem *p) {
    wa_status st;
    if (!ctx) return wa_fail(WA_ERR_INVALID_ARG, "context is NULL");
    if (!desc) return wa_fail(WA_ERR_INVALID_ARG, "attention descriptor is NULL");
    if (!isfinite(desc->scale)) return wa_fail(WA_ERR_INVALID_ARG, "scale %g is not finite", (double)desc->scale);
    if (!isfinite(desc->softcap) || desc->softcap < 0)
        return wa_fail(WA_ERR_INVALID_ARG, "softcap %g must be 0 (off) or a positive finite number", (double)desc->softcap);
    if (desc->window_left < -1 || desc->window_right < -1)
        return wa_fail(WA_ERR_INVALID_ARG, "window (%lld, %lld): each side must be -1 (unbounded) or >= 0",
                       (long long)desc->window_left, (long long)desc->window_right);

    const wa_tensor *all[9] = {q, k, v, o, lse, do_, dq, dk, dv};
    static const char *const names[9] = {"q", "k", "v", "o", "lse", "do", "dq", "dk", "dv"};
    int bwd_out = need_outputs && backward;
    int used[9] = {1, 1, 1, need_outputs, need_outputs && (backward || lse != NULL), bwd_out, bwd_out, bwd_out, bwd_out};
    for (int i = 0; i < 9; i++)
        if (used[i] && (st = check_tensor(names[i], all[i], i == 4)) != WA_OK) return st;

    for (int i = 1; i < 9; i++) {
        if (!used[i]) continue;
        if (all[i]->device != q->device)
            return wa_fail(WA_ERR_DEVICE, "%s is on %s but q is on %s", names[i], all[i]->device ? "cuda" : "cpu",
                           q->device ? "cuda" : "cpu");
        if (i == 4) {
            if (lse->dtype != WA_F32) return wa_fail(WA_ERR_DTYPE, "lse must be f32");
        } else if (all[i]->dtype != q->dtype) {
            static const char *const dtype_names[3] = {"f32", "f16", "bf16"};
            return wa_fail(WA_ERR_DTYPE, "%s is %s but q is %s; q, k, v, o, do, dq, dk, dv must share one dtype",
                           names[i], dtype_names[all[i]->dtype], dtype_names[q->dtype]);
        }
    }

    int64_t B = q->shape[0], Hq = q->shape[1], Nq = q->shape[2], D = q->shape[3];
    int64_t Hkv = k->shape[1], Nk = k->shape[2];
    if (D < 1 || D > WA_MAX_HEAD_DIM)
        return wa_fail(WA_ERR_SHAPE, "head dim D = %lld, must be 1 to %d", (long long)D, WA_MAX_HEAD_DIM);
    if (k->shape[0] != B || v->shape[0] != B)
        return wa_fail(WA_ERR_SHAPE, "batch sizes differ: q %lld, k %lld, v %lld", (long long)B, (long long)k->shape[0],
                       (long long)v->shape[0]);
    if (k->shape[3] != D || v->shape[3] != D)
        return wa_fail(WA_ERR_SHAPE, "head dims differ: q %lld, k %lld, v %lld", (long long)D, (long long)k->shape[3],
                       (long long)v->shape[3]);
    if ((st = check_same_shape("v", v, "k", k)) != WA_OK) return st;
    if (Hkv < 1) return wa_fail(WA_ERR_SHAPE, "k has %lld heads, needs at least 1", (long long)Hkv);
    if (Hq % Hkv != 0)
        return wa_fail(WA_ERR_SHAPE, "Hq = %lld is not a multiple of Hkv = %lld", (long long)Hq, (long long)Hkv);
    if (used[3] && (st = check_same_shape("o", o, "q", q)) != WA_OK) return st;
    if (used[5] && (st = check_same_shape("do", do_, "q", q)) != WA_OK) return st;
    if (used[6] && (st = check_same_shape("dq", dq, "q", q)) != WA_OK) return st;
    if (used[7] && (st = check_same_shape("dk", dk, "k", k)) != WA_OK) return st;
    if (used[8] && (st = check_same_shape("dv", dv, "v", v)) != WA_OK) return st;
    if (used[4] && (lse->shape[0] != B || lse->shape[1] != Hq || lse->shape[2] != Nq || lse->shape[3] != 1))
        return wa_fail(WA_ERR_SHAPE, "lse has shape [%lld,%lld,%lld,%lld], must be [B,Hq,Nq,1] = [%lld,%lld,%lld,1]",
                       (long long)lse->shape[0], (long long)lse->shape[1], (long long)lse->shape[2],
                       (long long)lse->shape[3], (long long)B, (long long)Hq, (long long)Nq);

    if (need_outputs) {
        if (!backward) {
            const wa_tensor *in[3] = {q, k, v};
            static const char *const in_names[3] = {"q", "k", "v"};
            if ((st = check_output("o", o, in, in_names, 3)) != WA_OK) return st;
            if (lse && (st = check_output("lse", lse, in, in_names, 3)) != WA_OK) return st;
        } else {
            const wa_tensor *in[6] = {q, k, v, o, lse, do_};
            static const char *const in_names[6] = {"q", "k", "v", "o", "lse", "do"};
            if ((st = check_output("dq", dq, in, in_names, 6)) != WA_OK) return st;
            if ((st = check_output("dk", dk, in, in_names, 6)) != WA_OK) return st;
            if ((st = check_output("dv", dv, in, in_names, 6)) != WA_OK) return st;
        }
    }

    memset(p, 0, sizeof *p);
    p->B = B, p->Hq = Hq, p->Hkv = Hkv, p->Nq = Nq, p->Nk = Nk, p->D = D;
    p->group = Hq / Hkv;
    p->scale = desc->scale != 0.0f ? desc->scale : (float)(1.0 / sqrt((double)D));
    p->softcap = desc->softcap;
    p->win.Nq = Nq, p->win.Nk = Nk, p->win.left = desc->window_left, p->win.right = desc->window_right;
    p->dtype = q->dtype;
    p->device = q->device;
    p->q = q, p->k = k, p->v = v, p->o = o, p->lse = lse, p->do_ = do_, p->dq = dq, p->dk = dk, p->dv = dv;

    if (p->device == WA_DEVICE_CUDA) {
        if (!wa_cuda_available())
            return wa_fail(WA_ERR_UNSUPPORTED, "CUDA tensors given but this build has no usable CUDA device");
        if (ctx->params.algorithm == WA_ALGO_DENSE)
            return wa_fail(WA_ERR_UNSUPPORTED, "the dense baseline runs on the CPU only");
    }
    return WA_OK;
}

/* ---- entry points ---- */

wa_status wa_forward(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                     const wa_tensor *v, wa_tensor *o, wa_tensor *lse) {
    wa_problem p;
    wa_clear_error();
    wa_status st = validate(ctx, desc, q, k, v, o, lse, NULL, NULL, NULL, NULL, 0, 1, &p);
    if (st != WA_OK) return st;
    if (p.device == WA_DEVICE_CUDA) return wa_cuda_forward(ctx, &p);
    if (ctx->params.algorithm == WA_ALGO_DENSE) return wa_dense_forward(ctx, &p);
    return wa_cpu_forward(ctx, &p);
}

wa_status wa_backward(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                      const wa_tensor *v, const wa_tensor *o, const wa_tensor *lse, const wa_tensor *do_, wa_tensor *dq,
                      wa_tensor *dk, wa_tensor *dv) {
    wa_problem p;
    wa_clear_error();
    wa_status st = validate(ctx, desc, q, k, v, o, lse, do_, dq, dk, dv, 1, 1, &p);
    if (st != WA_OK) return st;
    if (p.device == WA_DEVICE_CUDA) return wa_cuda_backward(ctx, &p);
    if (ctx->params.algorithm == WA_ALGO_DENSE) return wa_dense_backward(ctx, &p);
    return wa_cpu_backward(ctx, &p);
}

wa_status wa_workspace_size(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                            const wa_tensor *v, int backward, size_t *bytes) {
    wa_problem p;
    wa_clear_error();
    if (!bytes) return wa_fail(WA_ERR_INVALID_ARG, "bytes is NULL");
    *bytes = 0;
    /* Shapes of the outputs follow from q, k, v, so only the inputs are validated here. */
    wa_status st = validate(ctx, desc, q, k, v, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, &p);
    if (st != WA_OK) return st;
    if (p.device == WA_DEVICE_CUDA) *bytes = wa_cuda_workspace_bytes(ctx, &p, backward);
    else if (ctx->params.algorithm == WA_ALGO_DENSE) *bytes = wa_dense_workspace_bytes(ctx, &p, backward);
    else *bytes = wa_cpu_workspace_bytes(ctx, &p, backward);
    return WA_OK;
}
