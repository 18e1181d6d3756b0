/* stub.c — the CUDA backend of a build without CUDA kernels (no nvcc, NO_CUDA=1, or
 * CUDA_ARCHS=auto on a machine without a GPU): every entry point reports that CUDA is not
 * available, so the library, the tools and the tests build and run everywhere. */
#include "../internal.h"

int wa_cuda_available(void) { return 0; }

size_t wa_cuda_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward) {
    (void)ctx, (void)p, (void)backward;
    return 0;
}

wa_status wa_cuda_forward(wa_context *ctx, const wa_problem *p) {
    (void)ctx, (void)p;
    return wa_fail(WA_ERR_UNSUPPORTED, "this build of winattn has no CUDA kernels (built without nvcc, with NO_CUDA=1, or where no GPU was found: make CUDA_ARCHS=all builds them)");
}

wa_status wa_cuda_backward(wa_context *ctx, const wa_problem *p) {
    (void)ctx, (void)p;
    return wa_fail(WA_ERR_UNSUPPORTED, "this build of winattn has no CUDA kernels (built without nvcc, with NO_CUDA=1, or where no GPU was found: make CUDA_ARCHS=all builds them)");
}

wa_status wa_cuda_malloc(size_t bytes, void **ptr) {
    (void)bytes;
    *ptr = NULL;
    return wa_fail(WA_ERR_UNSUPPORTED, "this build of winattn has no CUDA kernels (built without nvcc, with NO_CUDA=1, or where no GPU was found: make CUDA_ARCHS=all builds them)");
}

void wa_cuda_free(void *ptr) { (void)ptr; }

wa_status wa_cuda_memcpy(wa_context *ctx, void *dst, const void *src, size_t bytes, int kind) {
    (void)ctx, (void)dst, (void)src, (void)bytes, (void)kind;
    return wa_fail(WA_ERR_UNSUPPORTED, "this build of winattn has no CUDA kernels (built without nvcc, with NO_CUDA=1, or where no GPU was found: make CUDA_ARCHS=all builds them)");
}

wa_status wa_cuda_synchronize(wa_context *ctx) {
    (void)ctx;
    return WA_OK;
}

void wa_cuda_context_release(wa_context *ctx) { (void)ctx; }

wa_status wa_cuda_memory_impl(wa_context *ctx, size_t *in_use, size_t *workspace_peak) {
    (void)ctx, (void)in_use, (void)workspace_peak;
    return wa_fail(WA_ERR_UNSUPPORTED, "this build of winattn has no CUDA kernels (built without nvcc, with NO_CUDA=1, or where no GPU was found: make CUDA_ARCHS=all builds them)");
}
