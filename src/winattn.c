/* winattn.c — the public entry points: one validator every backend relies on, the context, and
 * the dispatch to the CPU tiled kernels, the dense baseline or CUDA. The backends call back only
 * into status.c (errors, allocation), never into this file.
 *
 * "The function that decides support is the function that dispatches": validate() fills a
 * wa_problem, and nothing downstream re-checks caller input.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the version has one source, the WINATTN_VERSION_* macros of winattn.h (the Python package's
 * version is read from them too: python/setup.py) */
#define WA_STR_(x) #x
#define WA_STR(x) WA_STR_(x)
const char *wa_version(void) {
    return WA_STR(WINATTN_VERSION_MAJOR) "." WA_STR(WINATTN_VERSION_MINOR) "." WA_STR(WINATTN_VERSION_PATCH);
}

const char *wa_cpu_kernels(void) { return wa_cpu_isa(); }

int wa_device_available(wa_device dev) {
    if (dev == WA_DEVICE_CPU) return 1;
    if (dev == WA_DEVICE_CUDA) return wa_cuda_available();
    return 0;
}

/* ---- context ---- */

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
    const char *isa = wa_cpu_isa_env_error();
    if (isa)
        return wa_fail(WA_ERR_INVALID_ARG, "WINATTN_ISA=%.40s is not one of avx512bf16, avx512, avx2, neon, generic", isa);

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

/* One thread at a time per context (its thread pool, its CUDA workspace): a second thread gets an
 * error instead of corrupting the first one's state. */
static wa_status enter(wa_context *ctx) {
    if (ctx && __atomic_exchange_n(&ctx->busy, 1, __ATOMIC_ACQUIRE))
        return wa_fail(WA_ERR_INVALID_ARG, "context is in use by another thread");
    return WA_OK;
}
static wa_status leave(wa_context *ctx, wa_status st) {
    if (ctx) __atomic_store_n(&ctx->busy, 0, __ATOMIC_RELEASE);
    return st;
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
    wa_status st = enter(ctx);
    return st != WA_OK ? st : leave(ctx, wa_cuda_memcpy(ctx, dst, src, bytes, kind));
}

wa_status wa_cuda_memory(wa_context *ctx, size_t *in_use, size_t *workspace_peak) {
    wa_clear_error();
    if (!ctx || !in_use || !workspace_peak) return wa_fail(WA_ERR_INVALID_ARG, "wa_cuda_memory: NULL argument");
    *in_use = *workspace_peak = 0;
    if (!wa_cuda_available()) return wa_fail(WA_ERR_UNSUPPORTED, "no usable CUDA device in this build or machine");
    wa_status st = enter(ctx);
    return st != WA_OK ? st : leave(ctx, wa_cuda_memory_impl(ctx, in_use, workspace_peak));
}

wa_status wa_synchronize(wa_context *ctx) {
    wa_clear_error();
    if (!ctx) return wa_fail(WA_ERR_INVALID_ARG, "wa_synchronize: context is NULL");
    wa_status st = enter(ctx);
    return st != WA_OK ? st : leave(ctx, wa_cuda_available() ? wa_cuda_synchronize(ctx) : WA_OK);
}

/* ---- validation ---- */

static const char *const shape_names[4] = {"B", "H", "N", "D"};

/* Limits that keep every size the library derives inside int64: a dimension fits in int32 (the
 * GPU kernels index rows with it), a tensor has at most 2^48 elements (so padded copies, f32
 * workspace and byte counts stay far from 2^63), and its bytes span at most 2^60. */
#define WA_MAX_DIM INT32_MAX
#define WA_MAX_ELEMENTS ((int64_t)1 << 48)
#define WA_MAX_SPAN ((int64_t)1 << 60)

/* a * b when both are >= 0 and the product is at most limit; -1 otherwise */
static int64_t mul_within(int64_t a, int64_t b, int64_t limit) {
    if (a == 0 || b == 0) return 0;
    return b <= limit / a ? a * b : -1;
}

static wa_status check_tensor(const char *name, const wa_tensor *t, int is_lse) {
    if (!t) return wa_fail(WA_ERR_INVALID_ARG, "%s is NULL", name);
    if ((unsigned)t->dtype > WA_BF16) return wa_fail(WA_ERR_DTYPE, "%s: unknown dtype %d", name, (int)t->dtype);
    if ((unsigned)t->device > WA_DEVICE_CUDA) return wa_fail(WA_ERR_DEVICE, "%s: unknown device %d", name, (int)t->device);
    int64_t elems = 1;
    for (int d = 0; d < 4; d++) {
        const char *dim = is_lse && d == 3 ? "1" : shape_names[d];
        if (t->shape[d] < 0)
            return wa_fail(WA_ERR_SHAPE, "%s: shape[%d] (%s) = %lld is negative", name, d, dim, (long long)t->shape[d]);
        if (t->shape[d] > WA_MAX_DIM)
            return wa_fail(WA_ERR_SHAPE, "%s: shape[%d] (%s) = %lld exceeds the limit of %d", name, d, dim,
                           (long long)t->shape[d], WA_MAX_DIM);
        if (t->stride[d] < 0)
            return wa_fail(WA_ERR_STRIDE, "%s: stride[%d] = %lld is negative", name, d, (long long)t->stride[d]);
        elems = mul_within(elems, t->shape[d], WA_MAX_ELEMENTS);
        if (elems < 0)
            return wa_fail(WA_ERR_SHAPE, "%s: %lld x %lld x %lld x %lld elements exceed the limit of 2^48", name,
                           (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2], (long long)t->shape[3]);
    }
    /* no elements: no memory is touched, so data and strides are never used (numpy gives such
     * arrays all-zero strides) */
    if (elems == 0) return WA_OK;
    if (!is_lse && t->shape[3] > 1 && t->stride[3] != 1)
        return wa_fail(WA_ERR_STRIDE, "%s: head-dim stride is %lld, must be 1", name, (long long)t->stride[3]);
    if (!t->data) return wa_fail(WA_ERR_INVALID_ARG, "%s: data is NULL", name);
    int64_t es = (int64_t)wa_dtype_size(t->dtype), last = 0;
    if ((uintptr_t)t->data % (uintptr_t)es != 0)
        return wa_fail(WA_ERR_STRIDE, "%s: data pointer %p is not aligned to its %lld-byte elements", name, t->data,
                       (long long)es);
    for (int d = 0; d < 4; d++) {
        int64_t reach = mul_within(t->shape[d] - 1, t->stride[d], WA_MAX_SPAN);
        if (reach < 0 || (last += reach) > WA_MAX_SPAN)
            return wa_fail(WA_ERR_STRIDE, "%s: strides [%lld,%lld,%lld,%lld] address beyond 2^60 elements", name,
                           (long long)t->stride[0], (long long)t->stride[1], (long long)t->stride[2],
                           (long long)t->stride[3]);
    }
    if ((uintptr_t)t->data > UINTPTR_MAX - (uintptr_t)((last + 1) * es))
        return wa_fail(WA_ERR_STRIDE, "%s: the tensor would extend past the end of the address space", name);
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

/* Outputs must not alias themselves (two logical elements at one address: the result would depend
 * on thread timing), each other, or any input. Exact for strided views (overlap.c): q and o as the
 * disjoint interleaved halves of one [B, N, 2H, D] buffer are fine. */
static wa_status check_outputs(wa_context *ctx, const wa_tensor *const *outs, const char *const *out_names, int n_outs,
                               const wa_tensor *const *ins, const char *const *in_names, int n_ins) {
    wa_status st;
    int hit;
    for (int i = 0; i < n_outs; i++) {
        if (!outs[i]) continue;
        if ((st = wa_view_aliases_itself(ctx, outs[i], &hit)) != WA_OK) return st;
        if (hit) return wa_fail(WA_ERR_STRIDE, "output %s: its strides place two elements at one address", out_names[i]);
        for (int j = 0; j < i; j++) {
            if (!outs[j]) continue;
            if ((st = wa_views_overlap(ctx, outs[i], outs[j], &hit)) != WA_OK) return st;
            if (hit) return wa_fail(WA_ERR_STRIDE, "outputs %s and %s share memory", out_names[j], out_names[i]);
        }
        for (int j = 0; j < n_ins; j++) {
            if (!ins[j]) continue;
            if ((st = wa_views_overlap(ctx, outs[i], ins[j], &hit)) != WA_OK) return st;
            if (hit) return wa_fail(WA_ERR_STRIDE, "output %s overlaps input %s in memory", out_names[i], in_names[j]);
        }
    }
    return WA_OK;
}

/* A side longer than any sequence allows every key on that side: it becomes -1, so no geometry
 * ever adds a huge window to a row index. Row i sees keys >= i + off - left, and i + off <= Nk - 1;
 * it sees keys <= i + off + right, and i + off >= Nk - Nq. */
static int64_t clamp_side(int64_t side, int64_t unbounded_from) {
    return side >= unbounded_from ? WA_UNBOUNDED : side;
}

/* Varlen offsets on the CPU: start at 0, never decrease, end at T, no sequence over max_len. */
static wa_status check_offsets(const char *name, const int32_t *cu, int64_t B, int64_t T, int64_t max_len) {
    if (cu[0] != 0) return wa_fail(WA_ERR_SHAPE, "%s[0] = %d, must be 0", name, (int)cu[0]);
    for (int64_t b = 0; b < B; b++) {
        if (cu[b + 1] < cu[b])
            return wa_fail(WA_ERR_SHAPE, "%s decreases at entry %lld (%d after %d)", name, (long long)(b + 1),
                           (int)cu[b + 1], (int)cu[b]);
        if ((int64_t)cu[b + 1] - cu[b] > max_len)
            return wa_fail(WA_ERR_SHAPE, "%s: sequence %lld has %lld rows, more than the stated maximum %lld", name,
                           (long long)b, (long long)cu[b + 1] - cu[b], (long long)max_len);
    }
    if (cu[B] != T)
        return wa_fail(WA_ERR_SHAPE, "%s[%lld] = %d, must equal the tensors' %lld token rows", name, (long long)B,
                       (int)cu[B], (long long)T);
    return WA_OK;
}

static wa_status validate_varlen(const wa_varlen *seqs, const wa_tensor *q, const wa_tensor *k, wa_problem *p) {
    if (q->shape[0] != 1)
        return wa_fail(WA_ERR_SHAPE, "varlen tensors have batch dimension 1 (tokens in dimension 2), q has %lld",
                       (long long)q->shape[0]);
    if (seqs->batch < 0 || seqs->batch >= WA_MAX_DIM)
        return wa_fail(WA_ERR_SHAPE, "varlen batch = %lld, must be 0 to %d", (long long)seqs->batch, WA_MAX_DIM - 1);
    if (!seqs->cu_seqlens_q || !seqs->cu_seqlens_k) return wa_fail(WA_ERR_INVALID_ARG, "varlen offsets are NULL");
    int64_t Tq = q->shape[2], Tk = k->shape[2];
    if (seqs->max_seqlen_q < 0 || seqs->max_seqlen_k < 0 || seqs->max_seqlen_q > WA_MAX_DIM || seqs->max_seqlen_k > WA_MAX_DIM)
        return wa_fail(WA_ERR_SHAPE, "varlen max_seqlen (%lld, %lld) must be 0 to %d", (long long)seqs->max_seqlen_q,
                       (long long)seqs->max_seqlen_k, WA_MAX_DIM);
    wa_status st;
    if (q->device == WA_DEVICE_CPU) {
        if ((st = check_offsets("cu_seqlens_q", seqs->cu_seqlens_q, seqs->batch, Tq, seqs->max_seqlen_q)) != WA_OK) return st;
        if ((st = check_offsets("cu_seqlens_k", seqs->cu_seqlens_k, seqs->batch, Tk, seqs->max_seqlen_k)) != WA_OK) return st;
    }
    p->B = seqs->batch;
    p->Tq = Tq, p->Tk = Tk;
    p->Nq = wa_min64(seqs->max_seqlen_q, Tq), p->Nk = wa_min64(seqs->max_seqlen_k, Tk);
    p->cu_q = seqs->cu_seqlens_q, p->cu_k = seqs->cu_seqlens_k;
    return WA_OK;
}

static wa_status validate(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs, const wa_tensor *q,
                          const wa_tensor *k, const wa_tensor *v, const wa_tensor *o, const wa_tensor *lse,
                          const wa_tensor *do_, const wa_tensor *dq, const wa_tensor *dk, const wa_tensor *dv,
                          int backward, int need_outputs, wa_problem *p) {
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
        const wa_tensor *outs[5] = {dq, dk, dv, NULL, NULL};
        static const char *const bwd_out_names[3] = {"dq", "dk", "dv"};
        static const char *const fwd_out_names[2] = {"o", "lse"};
        const wa_tensor *ins[6] = {q, k, v, o, lse, do_};
        if (!backward) outs[0] = o, outs[1] = lse, outs[2] = NULL;
        if ((st = check_outputs(ctx, outs, backward ? bwd_out_names : fwd_out_names, backward ? 3 : 2, ins, names,
                                backward ? 6 : 3)) != WA_OK)
            return st;
    }

    memset(p, 0, sizeof *p);
    p->B = B, p->Hq = Hq, p->Hkv = Hkv, p->Nq = Nq, p->Nk = Nk, p->D = D;
    if (seqs && (st = validate_varlen(seqs, q, k, p)) != WA_OK) return st;
    p->group = Hq / Hkv;
    p->scale = desc->scale != 0.0f ? desc->scale : (float)(1.0 / sqrt((double)D));
    p->softcap = desc->softcap;
    p->win.Nq = p->Nq, p->win.Nk = p->Nk;
    p->win.left = clamp_side(desc->window_left, wa_max64(p->Nk - 1, 0));
    p->win.right = clamp_side(desc->window_right, wa_max64(p->Nq - 1, 0));
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

typedef wa_status (*backend_fn)(wa_context *, const wa_problem *);

/* A varlen problem on the CPU: each sequence as a rectangular call on views into the packed
 * tensors (the offsets were checked), which is exactly the per-sequence semantics. */
static wa_tensor sequence_view(const wa_tensor *t, int64_t start, int64_t len) {
    wa_tensor view = *t;
    if (!t->data) return view;
    view.data = (char *)t->data + start * t->stride[2] * (int64_t)wa_dtype_size(t->dtype);
    view.shape[2] = len;
    return view;
}

static wa_status run_cpu_sequences(wa_context *ctx, const wa_problem *p, backend_fn fn) {
    for (int64_t b = 0; b < p->B; b++) {
        int64_t q0, nq, k0, nk;
        wa_seq_rows(p->cu_q, b, p->Tq, p->Nq, &q0, &nq);
        wa_seq_rows(p->cu_k, b, p->Tk, p->Nk, &k0, &nk);
        wa_tensor t[9];
        const wa_tensor *src[9] = {p->q, p->k, p->v, p->o, p->lse, p->do_, p->dq, p->dk, p->dv};
        const int keyed[9] = {0, 1, 1, 0, 0, 0, 0, 1, 1};
        for (int i = 0; i < 9; i++)
            if (src[i]) t[i] = keyed[i] ? sequence_view(src[i], k0, nk) : sequence_view(src[i], q0, nq);
        wa_problem s = *p;
        s.B = 1, s.Nq = nq, s.Nk = nk, s.win.Nq = nq, s.win.Nk = nk;
        s.cu_q = s.cu_k = NULL, s.Tq = s.Tk = 0;
        const wa_tensor **dst[9] = {&s.q, &s.k, &s.v, &s.o, &s.lse, &s.do_, &s.dq, &s.dk, &s.dv};
        for (int i = 0; i < 9; i++) *dst[i] = src[i] ? &t[i] : NULL;
        wa_status st = fn(ctx, &s);
        if (st != WA_OK) return st;
    }
    return WA_OK;
}

static wa_status run(wa_context *ctx, const wa_problem *p, int backward) {
    backend_fn fn = p->device == WA_DEVICE_CUDA ? (backward ? wa_cuda_backward : wa_cuda_forward)
                    : ctx->params.algorithm == WA_ALGO_DENSE ? (backward ? wa_dense_backward : wa_dense_forward)
                                                              : (backward ? wa_cpu_backward : wa_cpu_forward);
    if (p->cu_q && p->device == WA_DEVICE_CPU) return run_cpu_sequences(ctx, p, fn);
    return fn(ctx, p);
}

static wa_status forward_entry(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs, const wa_tensor *q,
                               const wa_tensor *k, const wa_tensor *v, wa_tensor *o, wa_tensor *lse) {
    wa_problem p;
    wa_clear_error();
    wa_status st = enter(ctx);
    if (st != WA_OK) return st;
    st = validate(ctx, desc, seqs, q, k, v, o, lse, NULL, NULL, NULL, NULL, 0, 1, &p);
    if (st == WA_OK) st = run(ctx, &p, 0);
    return leave(ctx, st);
}

static wa_status backward_entry(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs, const wa_tensor *q,
                                const wa_tensor *k, const wa_tensor *v, const wa_tensor *o, const wa_tensor *lse,
                                const wa_tensor *do_, wa_tensor *dq, wa_tensor *dk, wa_tensor *dv) {
    wa_problem p;
    wa_clear_error();
    wa_status st = enter(ctx);
    if (st != WA_OK) return st;
    st = validate(ctx, desc, seqs, q, k, v, o, lse, do_, dq, dk, dv, 1, 1, &p);
    if (st == WA_OK) st = run(ctx, &p, 1);
    return leave(ctx, st);
}

wa_status wa_forward(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                     const wa_tensor *v, wa_tensor *o, wa_tensor *lse) {
    return forward_entry(ctx, desc, NULL, q, k, v, o, lse);
}

wa_status wa_backward(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                      const wa_tensor *v, const wa_tensor *o, const wa_tensor *lse, const wa_tensor *do_, wa_tensor *dq,
                      wa_tensor *dk, wa_tensor *dv) {
    return backward_entry(ctx, desc, NULL, q, k, v, o, lse, do_, dq, dk, dv);
}

wa_status wa_forward_varlen(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs, const wa_tensor *q,
                            const wa_tensor *k, const wa_tensor *v, wa_tensor *o, wa_tensor *lse) {
    if (!seqs) return wa_clear_error(), wa_fail(WA_ERR_INVALID_ARG, "varlen descriptor is NULL");
    return forward_entry(ctx, desc, seqs, q, k, v, o, lse);
}

wa_status wa_backward_varlen(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs, const wa_tensor *q,
                             const wa_tensor *k, const wa_tensor *v, const wa_tensor *o, const wa_tensor *lse,
                             const wa_tensor *do_, wa_tensor *dq, wa_tensor *dk, wa_tensor *dv) {
    if (!seqs) return wa_clear_error(), wa_fail(WA_ERR_INVALID_ARG, "varlen descriptor is NULL");
    return backward_entry(ctx, desc, seqs, q, k, v, o, lse, do_, dq, dk, dv);
}

wa_status wa_workspace_size(wa_context *ctx, const wa_attn_desc *desc, const wa_tensor *q, const wa_tensor *k,
                            const wa_tensor *v, int backward, size_t *bytes) {
    wa_problem p;
    wa_clear_error();
    if (!bytes) return wa_fail(WA_ERR_INVALID_ARG, "bytes is NULL");
    *bytes = 0;
    wa_status st = enter(ctx);
    if (st != WA_OK) return st;
    /* Shapes of the outputs follow from q, k, v, so only the inputs are validated here. */
    st = validate(ctx, desc, NULL, q, k, v, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, &p);
    if (st == WA_OK) {
        if (p.device == WA_DEVICE_CUDA) *bytes = wa_cuda_workspace_bytes(ctx, &p, backward);
        else if (ctx->params.algorithm == WA_ALGO_DENSE) *bytes = wa_dense_workspace_bytes(ctx, &p, backward);
        else *bytes = wa_cpu_workspace_bytes(ctx, &p, backward);
    }
    return leave(ctx, st);
}
