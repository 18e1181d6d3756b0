/* status.c — the library's leaf helpers (status.h): the per-thread error record behind
 * wa_last_error(), the names of statuses, the sizes of dtypes, and the context's allocator.
 * Every other part of the library calls these; they call nothing in it, so the entry points
 * (winattn.c) and the backends (src/cpu, src/cuda) depend on them without depending on each
 * other in a circle.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

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

/* ---- allocation ---- */

void *wa_alloc(wa_context *ctx, size_t bytes) {
    if (bytes == 0) bytes = 64;
    if (ctx->params.alloc) return ctx->params.alloc(ctx->params.alloc_user, bytes);
    void *p = NULL;
    /* no object may be larger than PTRDIFF_MAX (pointer differences inside it would overflow);
     * that bound also keeps the rounding below from wrapping to a tiny block */
    if (bytes > PTRDIFF_MAX) return NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    return p;
}

void wa_free(wa_context *ctx, void *ptr) {
    if (!ptr) return;
    if (ctx->params.free) ctx->params.free(ctx->params.alloc_user, ptr);
    else free(ptr);
}
