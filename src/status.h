/* status.h — the library's leaf helpers, which every part of it (the entry points in winattn.c,
 * the CPU and CUDA backends, the overlap tests) calls and which call nothing back: the error
 * record behind wa_last_error() and the context's allocator. src/status.c defines them;
 * internal.h includes this header, so a backend that includes internal.h has them.
 */
#ifndef WA_STATUS_H
#define WA_STATUS_H

#include "winattn.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Record a one-line detail for wa_last_error() and return the status (printf-style). */
wa_status wa_fail(wa_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Empty the record: every public entry point starts with it. */
void wa_clear_error(void);

/* Host memory through the context's allocator (wa_context_params.alloc/free), else 64-byte
 * aligned from the C library; a request of 0 bytes still returns a distinct block. NULL when out
 * of memory; wa_free(ctx, NULL) does nothing. */
void *wa_alloc(wa_context *ctx, size_t bytes);
void wa_free(wa_context *ctx, void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* WA_STATUS_H */
