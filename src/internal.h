/* internal.h — what the library's parts share and callers never see: error recording and
 * allocation (status.h), the context, the thread pool, and the normalised description of one
 * attention call (wa_problem) that validation produces and every backend consumes.
 */
#ifndef WA_INTERNAL_H
#define WA_INTERNAL_H

#include "winattn.h"
#include "status.h" /* wa_fail, wa_clear_error, wa_alloc, wa_free (src/status.c) */
#include "tile_geometry.h"

#include <stddef.h>
#include <stdint.h>

/* ---- thread pool: persistent workers, units handed out by an atomic counter. Each unit writes
 * its own outputs, so results never depend on which worker ran it. ---- */
typedef struct wa_pool wa_pool;
typedef void (*wa_unit_fn)(void *arg, int64_t unit, int worker);
wa_pool *wa_pool_create(int threads); /* NULL on failure; threads includes the caller */
void wa_pool_destroy(wa_pool *pool);
int wa_pool_threads(const wa_pool *pool);
/* Run fn(arg, u, worker) for u in [0, units); returns when all are done. worker < threads. */
void wa_pool_run(wa_pool *pool, int64_t units, wa_unit_fn fn, void *arg);

struct wa_context {
    wa_context_params params;
    int threads;
    int tile_q, tile_k;
    wa_pool *pool;
    /* the CUDA backward's workspace, kept between calls (the largest so far, on cuda_ws_device):
     * allocating it per call from the stream-ordered pool cost 0.17 ms a call, because the pool
     * returns freed memory to the driver at every synchronisation (docs/cuda.md) */
    void *cuda_ws;
    size_t cuda_ws_bytes;
    int cuda_ws_device;
    int busy; /* 1 while a call runs (atomic exchange in winattn.c): one thread at a time */
};

/* Exact memory-overlap tests for strided views (overlap.c); they may allocate through ctx. */
wa_status wa_views_overlap(wa_context *ctx, const wa_tensor *x, const wa_tensor *y, int *overlap);
wa_status wa_view_aliases_itself(wa_context *ctx, const wa_tensor *t, int *aliases);

/* One validated attention call, dimensions resolved, scale defaulted. */
typedef struct wa_problem {
    int64_t B, Hq, Hkv, Nq, Nk, D;
    int64_t group; /* Hq / Hkv */
    float scale, softcap;
    wa_window win;
    wa_dtype dtype;
    wa_device device;
    const wa_tensor *q, *k, *v, *o, *lse, *do_, *dq, *dk, *dv;
    /* Packed variable-length batches (wa_forward_varlen): NULL for rectangular calls. Otherwise
     * the tensors have batch 1 and Tq (Tk) token rows in dimension 2, cu_q and cu_k hold B + 1
     * int32 offsets on p->device (checked on the CPU, clamped by the CUDA kernels), Nq and Nk are
     * the longest sequence lengths, and win.Nq, win.Nk hold those maxima: each backend rebuilds
     * the window for sequence b with wa_seq_window(). */
    const int32_t *cu_q, *cu_k;
    int64_t Tq, Tk;
} wa_problem;

/* Sequence b of a varlen problem (both ends clamped into [0, T] and its length to the stated
 * maximum, so that malformed offsets on a device never address outside the tensors; the CPU path
 * has checked them already, so there the clamps change nothing). */
WA_HD static inline void wa_seq_rows(const int32_t *cu, int64_t b, int64_t T, int64_t max_len, int64_t *start,
                               int64_t *len) {
    int64_t s = cu[b], e = cu[b + 1];
    s = s < 0 ? 0 : s > T ? T : s;
    e = e < s ? s : e > T ? T : e;
    *start = s;
    *len = e - s < max_len ? e - s : max_len;
}

/* Address of element (b, h, n, 0) of a tensor. */
static inline void *wa_row_ptr(const wa_tensor *t, int64_t b, int64_t h, int64_t n) {
    int64_t e = b * t->stride[0] + h * t->stride[1] + n * t->stride[2];
    return (char *)t->data + e * (int64_t)wa_dtype_size(t->dtype);
}

/* ---- CPU backend (src/cpu) ---- */
size_t wa_cpu_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward);
wa_status wa_cpu_forward(wa_context *ctx, const wa_problem *p);
wa_status wa_cpu_backward(wa_context *ctx, const wa_problem *p);
const char *wa_cpu_isa(void); /* "avx512", "avx2" or "generic": the kernels this CPU runs */
/* NULL, or the value of WINATTN_ISA when it names no kernel build at all */
const char *wa_cpu_isa_env_error(void);

/* ---- dense baseline (src/cpu/dense.c) ---- */
size_t wa_dense_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward);
wa_status wa_dense_forward(wa_context *ctx, const wa_problem *p);
wa_status wa_dense_backward(wa_context *ctx, const wa_problem *p);

/* ---- CUDA backend (src/cuda, or src/cuda/stub.c without nvcc) ---- */
int wa_cuda_available(void);
size_t wa_cuda_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward);
wa_status wa_cuda_forward(wa_context *ctx, const wa_problem *p);
wa_status wa_cuda_backward(wa_context *ctx, const wa_problem *p);
wa_status wa_cuda_malloc(size_t bytes, void **ptr);
void wa_cuda_free(void *ptr);
/* kind: 0 host->device, 1 device->host, 2 device->device */
wa_status wa_cuda_memcpy(wa_context *ctx, void *dst, const void *src, size_t bytes, int kind);
wa_status wa_cuda_synchronize(wa_context *ctx);
wa_status wa_cuda_memory_impl(wa_context *ctx, size_t *in_use, size_t *workspace_peak);
/* frees what the context holds on the GPU (its backward workspace) */
void wa_cuda_context_release(wa_context *ctx);

#endif /* WA_INTERNAL_H */
