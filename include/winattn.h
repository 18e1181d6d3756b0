/* winattn.h — exact, memory-efficient attention with sliding windows, forward and backward.
 *
 * The only public header of libwinattn. C11, usable from C++ and from Python ctypes (plain structs,
 * no CUDA types: a CUDA stream travels as void *).
 *
 * Dimensions, named once here and everywhere in the code:
 *   B    batch                      Hq   query heads         Hkv  key/value heads (Hq % Hkv == 0)
 *   Nq   queries per sequence       Nk   keys per sequence   D    head dim, 1..512
 *   left, right                     the window, FlashAttention's (left, right) convention
 *
 * Tensors are described by logical shape and element strides, always in the logical order
 *   q, o, dq, do_ : [B, Hq,  Nq, D]      k, v, dk, dv : [B, Hkv, Nk, D]      lse : [B, Hq, Nq, 1] f32
 * so [B,H,N,D] and [B,N,H,D] memory both work without copies (pass the strides). The head-dim
 * stride must be 1, strides are non-negative, and data pointers are aligned to their element size
 * (4 bytes for f32, 2 for f16/bf16; a misaligned pointer returns WA_ERR_STRIDE). Each dimension is
 * at most 2^31 - 1 and each tensor at most 2^48 elements whose addresses span at most 2^60
 * elements: sizes the library derives from them can then never overflow (WA_ERR_SHAPE or
 * WA_ERR_STRIDE otherwise). Outputs may not share memory with each other, with any input, or with
 * themselves (two elements at one address): WA_ERR_STRIDE. The test is exact for strided views, so
 * disjoint interleaved views of one buffer (q and o as the halves of [B, N, 2H, D]) are accepted.
 *
 * Visibility (bottom-right aligned, as FlashAttention >= 2.1): with off = Nk - Nq, query row i
 * sees key j iff  i + off - left <= j <= i + off + right  and  0 <= j < Nk.  -1 on a side means
 * unbounded on that side. Full attention (-1,-1); causal (-1,0); a "sliding window of W keys
 * including self" (Hugging Face, Gemma, MLX, cuDNN) is (W-1, 0). README.md has the table. A side
 * at least as long as the sequence (left >= Nk - 1, right >= Nq - 1) is the same as unbounded and
 * is treated as -1, so any int64 window is valid.
 *
 * Scores s = scale * q.k, optionally softcapped s = c * tanh(s / c); o = softmax(s) v over the
 * visible keys; lse = log(sum exp(s)) (natural log, scale included). A row with no visible key
 * gets o = 0, lse = -inf, dq = 0, and contributes nothing to dk, dv.
 *
 * Non-finite inputs (CPU, every dtype, the tiled kernels and the dense path): a NaN or an
 * infinity in q, k, v or do_ reaches exactly the outputs that depend on it through visible
 * (query, key) pairs, as a dense float64 computation over the visible pairs would: never another
 * row, head or batch entry, never a key outside a row's window (a masked probability is skipped,
 * not multiplied by the NaN), and every other output is bit for bit what it is without it
 * (tests/test_nonfinite.c). On CUDA every output the dense computation makes non-finite is
 * non-finite, other batch entries and other KV-head groups are bit for bit unchanged, and an
 * output that does not depend on the value is either unchanged or non-finite: a tile product
 * multiplies a masked probability 0 by every key of the tile, so the value can also reach rows of
 * its group that do not see it (as in a dense framework's P·V). In a varlen call a value stays
 * inside its own sequence on every device: the other sequences' outputs are bit for bit
 * unchanged. tests/test_nonfinite.c checks both promises on the kernels the GPU takes
 * (WINATTN_CUDA=portable, mma, sm80, sm86, no-tma or no-overlap selects the other kernel paths).
 *
 * The library never prints and never exits: every function returns a wa_status and records a
 * one-line detail readable with wa_last_error().
 */
#ifndef WINATTN_H
#define WINATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WINATTN_VERSION_MAJOR 0
#define WINATTN_VERSION_MINOR 2
#define WINATTN_VERSION_PATCH 0

#define WA_MAX_HEAD_DIM 512
#define WA_UNBOUNDED (-1)   /* a window side with no limit */

typedef enum wa_status {
    WA_OK = 0,
    WA_ERR_INVALID_ARG,  /* NULL where a value is needed, window < -1, non-finite scale, bad option */
    WA_ERR_SHAPE,        /* shapes disagree, Hq % Hkv != 0, D outside 1..512, negative sizes */
    WA_ERR_STRIDE,       /* head-dim stride != 1, negative or oversized strides, misaligned data,
                          * outputs sharing memory with an input, another output or themselves */
    WA_ERR_DTYPE,        /* unknown dtype, tensors of different dtypes, lse not f32 */
    WA_ERR_DEVICE,       /* tensors on different devices, or an unknown device */
    WA_ERR_UNSUPPORTED,  /* valid request this build cannot run (e.g. CUDA without nvcc) */
    WA_ERR_NO_MEMORY,    /* the allocator returned NULL */
    WA_ERR_CUDA          /* a CUDA runtime call failed; wa_last_error() has the call and message */
} wa_status;

typedef enum wa_dtype { WA_F32 = 0, WA_F16 = 1, WA_BF16 = 2 } wa_dtype;

typedef enum wa_device { WA_DEVICE_CPU = 0, WA_DEVICE_CUDA = 1 } wa_device;

/* How the attention is computed. TILED is the product; DENSE materialises the whole
 * [B, Hq, Nq, Nk] score matrix in the input dtype the way a framework's fallback does (scores and
 * probabilities rounded to the dtype, softmax in f32). DENSE exists as the baseline the probe and
 * the parity sweep measure against and as the trainer's "dense" arm; it needs O(Nq*Nk) memory. */
typedef enum wa_algorithm { WA_ALGO_TILED = 0, WA_ALGO_DENSE = 1 } wa_algorithm;

/* A strided view of a 4-d tensor in logical order (see above). shape and stride in elements. */
typedef struct wa_tensor {
    void *data;
    wa_dtype dtype;
    wa_device device;
    int64_t shape[4];
    int64_t stride[4];
} wa_tensor;

/* The attention itself. Zero-initialise, then set what differs:
 *   scale         0 means 1/sqrt(D) (Gemma 4 passes 1.0)
 *   softcap       0 means off; c > 0 applies s = c * tanh(s / c) before masking
 *   window_left   keys allowed before the (bottom-right aligned) diagonal, -1 = unbounded
 *   window_right  keys allowed after it, -1 = unbounded; causal is window_right = 0
 * A zero-initialised descriptor is therefore window (0, 0): each query sees one key. Use
 * wa_attn_desc_full() / wa_attn_desc_causal() / wa_attn_desc_sliding() to start from the usual ones. */
typedef struct wa_attn_desc {
    float scale;
    float softcap;
    int64_t window_left;
    int64_t window_right;
} wa_attn_desc;

static inline wa_attn_desc wa_attn_desc_full(void) {
    wa_attn_desc d = {0.0f, 0.0f, WA_UNBOUNDED, WA_UNBOUNDED};
    return d;
}
static inline wa_attn_desc wa_attn_desc_causal(void) {
    wa_attn_desc d = {0.0f, 0.0f, WA_UNBOUNDED, 0};
    return d;
}
/* Causal sliding window of W keys including the query's own position (Hugging Face's and
 * Gemma's sliding_window, MLX's window_size): (W - 1, 0). */
static inline wa_attn_desc wa_attn_desc_sliding(int64_t W) {
    wa_attn_desc d = {0.0f, 0.0f, W - 1, 0};
    return d;
}

/* Stride products for the helpers below, in unsigned arithmetic so that absurd sizes cannot
 * overflow here (undefined behaviour in the caller); the calls then refuse such tensors. */
static inline int64_t wa_stride_of_(int64_t a, int64_t b, int64_t c) {
    return (int64_t)((uint64_t)a * (uint64_t)b * (uint64_t)c);
}

/* Contiguous [B, H, N, D] ("bhnd") and [B, N, H, D] ("bnhd") memory, described in logical order. */
static inline wa_tensor wa_tensor_bhnd(void *data, wa_dtype dt, int64_t B, int64_t H, int64_t N, int64_t D) {
    wa_tensor t = {data, dt, WA_DEVICE_CPU, {B, H, N, D}, {wa_stride_of_(H, N, D), wa_stride_of_(N, D, 1), D, 1}};
    return t;
}
static inline wa_tensor wa_tensor_bnhd(void *data, wa_dtype dt, int64_t B, int64_t H, int64_t N, int64_t D) {
    wa_tensor t = {data, dt, WA_DEVICE_CPU, {B, H, N, D}, {wa_stride_of_(N, H, D), D, wa_stride_of_(H, D, 1), 1}};
    return t;
}
/* The lse tensor: f32, contiguous [B, H, N, 1]. */
static inline wa_tensor wa_tensor_lse(float *data, int64_t B, int64_t H, int64_t N) {
    wa_tensor t = {data, WA_F32, WA_DEVICE_CPU, {B, H, N, 1}, {wa_stride_of_(H, N, 1), N, 1, 1}};
    return t;
}

typedef struct wa_context wa_context;

/* How a context runs. Zero-initialise for the defaults. */
typedef struct wa_context_params {
    int threads;            /* CPU worker threads including the caller; 0 = all online CPUs */
    int tile_q, tile_k;     /* CPU tile sizes in rows (queries, keys), 1..1024; 0 = defaults */
    wa_algorithm algorithm; /* WA_ALGO_TILED (default) or WA_ALGO_DENSE */
    void *cuda_stream;      /* cudaStream_t for CUDA tensors; NULL = the default stream */
    /* Optional allocator for all workspace (both NULL = malloc/free). alloc must return memory
     * aligned to at least 64 bytes or NULL. */
    void *(*alloc)(void *user, size_t bytes);
    void (*free)(void *user, void *ptr);
    void *alloc_user;
    /* CUDA backward, f16/bf16 on the tensor-core kernels. 0 (default) = the fastest form: at
     * D = 64 and 128 the key-tile kernel also adds its share of dQ into an f32 accumulator (five
     * tile products per visible pair instead of seven, 1.13-1.18x faster at Gemma-like shapes;
     * workspace grows by one f32 copy of dQ, B*Hq*Nq*D floats with Nq rounded up to 64), and
     * because those adds land in a varying order, dq can differ in its last bits from run to run
     * (dk, dv and the forward never do). 1 = bit-identical results run to run: on Hopper at
     * D = 128 (rectangular calls) the same fused kernel with each 64 x 64 block of the
     * accumulator summed in one fixed order (the accumulator and one int per block in the
     * workspace), elsewhere dQ in a kernel of its own, no atomics. The Hopper kernels at D = 256
     * have no atomic form (deterministic either way); the older tensor-core kernels that run when
     * TMA cannot describe the tensors add dQ atomically at every D unless this is 1
     * (docs/cuda.md). Replaced cuda_atomic_dq (0.1), whose
     * 0 meant deterministic: set this to 1 to keep that behaviour. */
    int cuda_deterministic;
} wa_context_params;

/* Create a context (thread pool, allocator, stream). params may be NULL for the defaults.
 * A context serves one calling thread at a time: a call that finds another thread's call still
 * running on the same context returns WA_ERR_INVALID_ARG ("context is in use by another thread")
 * without touching anything. Give each thread its own context. wa_context_destroy must not race
 * with a call on the same context. */
wa_status wa_context_create(const wa_context_params *params, wa_context **out);
void wa_context_destroy(wa_context *ctx);

/* Forward: writes (overwrites) o [B,Hq,Nq,D] and, if lse is not NULL, lse [B,Hq,Nq,1] f32.
 * q, k, v, o share one dtype and device. Deterministic: results do not depend on the thread
 * count. Workspace: O(threads * tile) scratch, nothing of size Nq*Nk (TILED).
 * Returns WA_OK or WA_ERR_{INVALID_ARG,SHAPE,STRIDE,DTYPE,DEVICE,UNSUPPORTED,NO_MEMORY,CUDA}. */
wa_status wa_forward(wa_context *ctx, const wa_attn_desc *desc,
                     const wa_tensor *q, const wa_tensor *k, const wa_tensor *v,
                     wa_tensor *o, wa_tensor *lse);

/* Backward: given the forward's o and lse and the incoming gradient do_ (like o), writes
 * (overwrites, never accumulates into) dq like q, dk like k, dv like v. With GQA, dk and dv sum
 * over the Hq/Hkv query heads of each group. Key rows no query sees get dk = dv = 0.
 * Workspace: O(B*Hq*Nq) f32 plus per-thread tiles (TILED); never anything of size Nq*Nk. On CUDA
 * the context keeps its backward workspace between calls (the largest so far, grown on the
 * context's stream; a call captured into a CUDA graph allocates its own) until
 * wa_context_destroy; with cuda_deterministic = 0 it holds an f32 dQ accumulator too, B*Hq*Nq*D
 * floats (Nq rounded up to 64), and so does the deterministic form on Hopper at D = 128.
 * Varlen calls on Hopper add 1 KB per sequence to it (tensor maps cut at each sequence's end; the forward takes them from the same workspace). Deterministic on
 * the CPU (bit-identical for any thread count) and on CUDA with cuda_deterministic = 1; see that
 * field for the default.
 * Same status codes as wa_forward. */
wa_status wa_backward(wa_context *ctx, const wa_attn_desc *desc,
                      const wa_tensor *q, const wa_tensor *k, const wa_tensor *v,
                      const wa_tensor *o, const wa_tensor *lse, const wa_tensor *do_,
                      wa_tensor *dq, wa_tensor *dk, wa_tensor *dv);

/* ---- packed variable-length batches ("varlen") ----
 *
 * B sequences of different lengths laid end to end along the token dimension, no padding:
 * sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key rows
 * [cu_seqlens_k[b], cu_seqlens_k[b+1]), and attends only within itself, with its own
 * bottom-right-aligned window (off_b = Nk_b - Nq_b), exactly as if it were called alone. This is
 * FlashAttention's flash_attn_varlen_func layout.
 *
 * The tensors are the same wa_tensor with batch dimension 1 and the tokens in dimension 2:
 *   q, o, dq, do_ : [1, Hq, Tq, D]     k, v, dk, dv : [1, Hkv, Tk, D]     lse : [1, Hq, Tq, 1] f32
 * wa_tensor_thd() describes packed [T, H, D] memory (any element strides work, head-dim stride 1).
 *
 * The offsets are int32 (so Tq, Tk < 2^31) and live on the tensors' device. They must start at 0,
 * never decrease, end at Tq (Tk), and no sequence may be longer than max_seqlen_q (max_seqlen_k).
 * On the CPU all of this is checked and a violation returns WA_ERR_SHAPE. On CUDA the offsets are
 * never read back to the host (the call stays asynchronous and CUDA-graph capturable): the kernels
 * clamp every offset into [0, T] and every length into [0, max_seqlen], so malformed offsets give
 * unspecified values in the outputs but never an access outside the tensors. Sequences of length 0
 * are allowed (an empty query sequence writes nothing; an empty key sequence gives its queries
 * o = 0, lse = -inf). Rows of q beyond what a sequence's window lets see follow the rectangular rules. */
typedef struct wa_varlen {
    int64_t batch;                      /* B, the number of sequences (0 allowed) */
    const int32_t *cu_seqlens_q;        /* B + 1 offsets into the query rows */
    const int32_t *cu_seqlens_k;        /* B + 1 offsets into the key rows */
    int64_t max_seqlen_q, max_seqlen_k; /* the longest sequence (an upper bound is fine) */
} wa_varlen;

/* Packed [T, H, D] memory as a varlen tensor [1, H, T, D]. */
static inline wa_tensor wa_tensor_thd(void *data, wa_dtype dt, int64_t T, int64_t H, int64_t D) {
    wa_tensor t = {data, dt, WA_DEVICE_CPU, {1, H, T, D}, {wa_stride_of_(T, H, D), D, wa_stride_of_(H, D, 1), 1}};
    return t;
}
/* The varlen lse: f32 [H, T] memory as [1, H, T, 1]. */
static inline wa_tensor wa_tensor_lse_varlen(float *data, int64_t H, int64_t T) {
    wa_tensor t = {data, WA_F32, WA_DEVICE_CPU, {1, H, T, 1}, {wa_stride_of_(H, T, 1), T, 1, 1}};
    return t;
}

/* wa_forward and wa_backward over a packed batch: same contracts, dtypes, head dims, windows,
 * softcap, GQA and determinism, per sequence. seqs describes the sequences; see above. */
wa_status wa_forward_varlen(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs,
                            const wa_tensor *q, const wa_tensor *k, const wa_tensor *v,
                            wa_tensor *o, wa_tensor *lse);
wa_status wa_backward_varlen(wa_context *ctx, const wa_attn_desc *desc, const wa_varlen *seqs,
                             const wa_tensor *q, const wa_tensor *k, const wa_tensor *v,
                             const wa_tensor *o, const wa_tensor *lse, const wa_tensor *do_,
                             wa_tensor *dq, wa_tensor *dk, wa_tensor *dv);

/* Bytes of workspace wa_forward (backward = 0) or wa_backward (backward = 1) would allocate
 * through the context's allocator for these shapes. Validates like the calls themselves. */
wa_status wa_workspace_size(wa_context *ctx, const wa_attn_desc *desc,
                            const wa_tensor *q, const wa_tensor *k, const wa_tensor *v,
                            int backward, size_t *bytes);

/* Memory helpers for tools and bindings that hold no CUDA headers of their own. dev selects
 * the device (CPU: aligned host memory from the context's allocator; CUDA: cudaMalloc).
 * wa_memcpy copies bytes between any two devices on the context's stream and waits for it. */
wa_status wa_malloc(wa_context *ctx, wa_device dev, size_t bytes, void **ptr);
void wa_free_memory(wa_context *ctx, wa_device dev, void *ptr);
wa_status wa_memcpy(wa_context *ctx, void *dst, wa_device dst_dev, const void *src, wa_device src_dev, size_t bytes);
/* Device memory as the CUDA driver reports it, for measurements: *in_use = total - free
 * (cudaMemGetInfo, the whole device), *workspace_peak = the high-water mark of the stream-ordered
 * pool the library's CUDA workspace comes from since the last call (which resets it).
 * WA_ERR_UNSUPPORTED on builds or machines without CUDA. */
wa_status wa_cuda_memory(wa_context *ctx, size_t *in_use, size_t *workspace_peak);
/* Wait until all work this context queued (CUDA) is done; reports an asynchronous failure. */
wa_status wa_synchronize(wa_context *ctx);

const char *wa_status_str(wa_status s);
/* One line describing the last failure on the calling thread ("" if none). */
const char *wa_last_error(void);
size_t wa_dtype_size(wa_dtype dt);
/* 1 if this build can run on the device (CUDA: built with nvcc and a GPU is present). */
int wa_device_available(wa_device dev);
const char *wa_version(void);
/* The CPU kernels this process runs: "avx512bf16", "avx512", "avx2", "neon" or "generic" (chosen
 * at run time; WINATTN_ISA in the environment can force one of these: one this build or CPU lacks
 * falls back to the best available, and any other value makes wa_context_create return
 * WA_ERR_INVALID_ARG). */
const char *wa_cpu_kernels(void);

#ifdef __cplusplus
}
#endif
#endif /* WINATTN_H */
