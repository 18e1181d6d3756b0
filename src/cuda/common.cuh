/* common.cuh — what the CUDA translation units share: the kernel parameter block, dtype
 * conversions, and the entry points of the tensor-core kernels (attn_mma.cu) that the
 * dispatcher in attn_cuda.cu calls. */
#ifndef WA_CUDA_COMMON_CUH
#define WA_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "../internal.h"
}

#define CUDA_TRY(call)                                                                                        \
    do {                                                                                                      \
        cudaError_t err_ = (call);                                                                            \
        if (err_ != cudaSuccess)                                                                              \
            return wa_fail(WA_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(err_), __FILE__, __LINE__); \
    } while (0)

/* The Hopper kernels (version 4, version 5's forward, version 3's forward: wgmma, TMA, mbarrier
 * transactions, setmaxnreg) exist only in the sm_90a compilation. Every other one (compute_80: the
 * SASS for sm_80, sm_86, sm_89 and the PTX that newer GPUs JIT-compile) gets bodies that trap, which
 * the dispatcher never launches (cuda_target, attn_cuda.cu). The host pass sees the real bodies. */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WA_HOPPER_STUB 1
#else
#define WA_HOPPER_STUB 0
#endif

struct dev_tensor {
    char *data;
    long long s0, s1, s2; /* element strides of B, H, N; the D stride is 1 */
};

struct kparams {
    dev_tensor q, k, v, o, lse, dout, dq, dk, dv;
    long long B, Hq, Hkv, Nq, Nk, D, group;
    float scale, softcap;
    wa_window win;
    float *delta, *rnorm; /* [B, Hq, Nq]; rnorm only for f32 */
    float *dq_acc;        /* the atomic-dQ option's f32 accumulator (else NULL), B*Hq*nq_pad*D floats:
                           * version 2 uses [B, Hq, Nq, D], version 4 its own order (bwd_hopper.cu) */
    int *dq_order;        /* version 4's ordered fused dQ (the deterministic form where bwd_hopper.cu's
                           * hopper_backward_orders_dq says so, rectangular calls): one counter per
                           * 64 × 64 block of dq_acc, the shares added so far (else NULL) */
    float *lse2;          /* version-4 backward: lse·log2(e) per row, +inf past Nq and for empty rows */
    long long nq_pad;     /* row stride of delta and lse2 in the version-4 backward (Nq rounded up to 64) */
    int tile, n_qtiles, n_ktiles; /* version 1's, per kernel (attn_cuda.cu: for_kernel); 0 for the other versions */
    /* Packed variable-length batches (NULL cu_q: rectangular). The tensors are [1, H, T, D], B
     * counts sequences, Nq and Nk are the longest lengths (the grid's size); cu_q and cu_k hold
     * B + 1 offsets on the device, read by each CTA (seq_view below). The workspace is packed by
     * token: row t of head h of delta, rnorm and lse2 at h·ws_stride + t (ws_stride = Tq), and
     * the atomic-dQ accumulator row-major [Hq, Tq, D], whatever the kernels' rectangular order. */
    const int32_t *cu_q, *cu_k;
    long long Tq, Tk, ws_stride;
    long long seq0;           /* the first sequence of this launch (grid z holds at most 65535) */
    long long q_row0, k_row0; /* set by seq_view: the sequence's first rows (TMA coordinates) */
    /* varlen calls on the TMA kernels: per sequence, copies of the launch's tensor maps whose row
     * extent ends at the sequence's last row (hopper_prims.cuh: seq_maps_kernel); device memory of
     * B × kMaxSeqMaps × 128 bytes from the workspace, NULL otherwise */
    void *seq_maps;
};

/* the slots of kparams.seq_maps: the most tensor maps one varlen launch reads, and a map's size */
constexpr int kMaxSeqMaps = 8, kTensorMapBytes = 128;

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ T *row_of(const dev_tensor &t, long long b, long long h, long long n) {
    return (T *)t.data + b * t.s0 + h * t.s1 + n * t.s2;
}
/* whether t's base and strides keep every row 16-byte aligned (the staged epilogues' 16-byte stores) */
template <typename T> __device__ __forceinline__ bool rows_aligned16(const dev_tensor &t) {
    return (((uintptr_t)t.data | (uintptr_t)((t.s0 | t.s1 | t.s2) * (long long)sizeof(T))) & 15) == 0;
}

/* What one CTA sees of its batch entry: `p` and `b()` for the rest of the kernel.
 * Rectangular (VARLEN false): the launch's parameter block itself and b = blockIdx.z (nothing is
 * copied: every field is read from the kernel's parameter space). Varlen: a copy for sequence
 * seq0 + blockIdx.z, its offsets read here and clamped (wa_seq_rows: malformed offsets never
 * address outside the tensors); every tensor's data moved to the sequence's first row (T is the
 * element type of q, k, v, o and the gradients; lse is f32), Nq, Nk and the window the sequence's
 * own, the workspace pointers moved to its first row, and b() = 0. The caller exits the whole CTA,
 * before any barrier, when its tile starts at or past the sequence's end (VARLEN && i0 >= p.Nq,
 * or j0 >= p.Nk). */
template <typename T, bool VARLEN> struct seq_view;
template <typename T> struct seq_view<T, false> {
    const kparams &p;
    __device__ explicit seq_view(const kparams &kp) : p(kp) {}
    __device__ long long b() const { return blockIdx.z; }
};
template <typename T> struct seq_view<T, true> {
    kparams p;
    __device__ long long b() const { return 0; }
    __device__ explicit seq_view(const kparams &kp) : p(kp) {
        const long long seq = kp.seq0 + blockIdx.z;
        int64_t qs, nq, ks, nk;
        wa_seq_rows(kp.cu_q, seq, kp.Tq, kp.Nq, &qs, &nq);
        wa_seq_rows(kp.cu_k, seq, kp.Tk, kp.Nk, &ks, &nk);
        move(p.q, qs, sizeof(T)), move(p.o, qs, sizeof(T)), move(p.dout, qs, sizeof(T)), move(p.dq, qs, sizeof(T));
        move(p.lse, qs, sizeof(float));
        move(p.k, ks, sizeof(T)), move(p.v, ks, sizeof(T)), move(p.dk, ks, sizeof(T)), move(p.dv, ks, sizeof(T));
        p.Nq = p.win.Nq = nq, p.Nk = p.win.Nk = nk;
        p.q_row0 = qs, p.k_row0 = ks;
        if (p.delta) p.delta += qs;
        if (p.rnorm) p.rnorm += qs;
        if (p.lse2) p.lse2 += qs;
        if (p.dq_acc) p.dq_acc += qs * p.D;
    }
    static __device__ void move(dev_tensor &t, long long rows, long long elem_bytes) {
        if (t.data) t.data += rows * t.s2 * elem_bytes;
    }
};

/* The first workspace row (of delta, rnorm, lse2; times D, of the row-major dQ accumulator) of
 * head h of batch entry b: rectangular, rect_rows per (b, h) as each kernel lays it out (Nq or
 * nq_pad); varlen, ws_stride per head from the sequence's first row (seq_view moved the pointer). */
template <bool VARLEN>
__device__ __forceinline__ long long ws_head(const kparams &p, long long b, long long h, long long rect_rows) {
    return VARLEN ? h * p.ws_stride : (b * p.Hq + h) * rect_rows;
}

/* Grid z is at most 65535: f(kp', z) launches a (x, y, z) grid once with z = B for rectangular
 * calls (check_grid caps B), and for varlen once per chunk of at most 65535 sequences, kp'.seq0
 * its first. */
constexpr long long kMaxGridZ = 65535;
template <typename F> static wa_status over_sequences(const kparams &kp, F &&f) {
    if (!kp.cu_q) return f(kp, (unsigned)kp.B);
    for (long long s0 = 0; s0 < kp.B; s0 += kMaxGridZ) {
        kparams c = kp;
        c.seq0 = s0;
        const wa_status st = f(c, (unsigned)(kp.B - s0 < kMaxGridZ ? kp.B - s0 : kMaxGridZ));
        if (st != WA_OK) return st;
    }
    return WA_OK;
}

/* What the current device runs, for every dispatch decision below (attn_cuda.cu: cuda_target_now,
 * the device's facts read once per device, WINATTN_CUDA applied per call). Compute capability 8.0
 * and up runs versions 1, 2 and 5's mma.sync kernels; versions 3, 4 and 5's wgmma forward only
 * where the sm_90a build is the code loaded. */
struct cuda_target {
    bool tensor_cores; /* versions 2 to 5 at all (WINATTN_CUDA=v1: no) */
    bool hopper;       /* versions 3, 4 and 5's wgmma forward: compute capability 9.0 running the sm_90a
                        * kernels (not the compute_80 PTX JIT-compiled, whose Hopper kernels are
                        * stubs), unless WINATTN_CUDA=mma, sm80 or sm86 keeps them off */
    size_t smem_optin; /* dynamic shared memory a block may opt in to: the device's
                        * (cudaDevAttrMaxSharedMemoryPerBlockOptin), or less under WINATTN_CUDA=sm80
                        * (A100's 163 KB) or sm86 (99 KB, sm_86 / sm_89) */
    int sms;           /* the device's SMs (cudaDevAttrMultiProcessorCount): a persistent kernel's grid */
};

/* ---- tensor-core path (attn_mma.cu): f16/bf16, D in {64, 128, 256, 512}, 16-byte aligned rows ---- */
/* whether the call runs there on target t: on Hopper always (every fallback fits its 227 KB), elsewhere
 * when the mma.sync kernels of the direction (forward, or backward when `backward`) fit t.smem_optin;
 * the rest runs on version 1 */
int mma_supports(const wa_problem *p, const cuda_target &t, int backward);
/* forward into o and lse */
wa_status mma_forward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s);
/* whether the current device runs fwd_hopper.cu's kernels as built for sm_90a (rather than the stubs
 * of the compute_80 PTX) */
int hopper_code_loaded(void);
/* version 4's forward (fwd_hopper.cu: TMA, warp-specialised wgmma) when it applies (D = 64, 128,
 * 256, strides TMA can express), and version 5's at D = 512; *taken = 0 leaves the call to
 * mma_forward. Only where t.hopper */
wa_status hopper_forward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s, int *taken);
/* the Hopper backward (bwd_hopper.cu) when it applies (version 4 at D = 64, 128, 256; version 5's
 * wgmma kernels at D = 512; lse given, strides TMA can express); it needs
 * kp.delta and kp.lse2 with B*Hq*nq_pad floats each. *taken = 0 leaves the call to version 2 or
 * 5's mma.sync kernels in mma_backward. Only where t.hopper */
int hopper_backward_supports(const kparams &kp);
/* whether version 4 has the fused form (dQ added by the dK/dV kernel into kp.dq_acc) for kp's
 * head dim (D <= 128); elsewhere it ignores kp.dq_acc */
int hopper_backward_fuses_dq(const kparams &kp);
/* whether the deterministic form of kp (at those head dims) is the fused kernel with dQ's shares
 * added in a fixed order (kp.dq_order; rectangular calls) rather than the dQ kernel */
int hopper_backward_orders_dq(const kparams &kp);
wa_status hopper_backward(const kparams &kp, wa_dtype dt, cudaStream_t s, int *taken);
/* version 5's backward at D = 512 (bwd_wide.cu, mma.sync); dQ by atomic adds into kp.dq_acc
 * ([B, Hq, Nq, D] f32) when it is set, else by its own deterministic kernel; the dispatcher sets it
 * only where wide_backward_atomic_dq() says so (a lab build) */
int wide_backward_atomic_dq(void);
/* the dynamic shared memory of its largest kernel */
size_t wide_backward_smem(void);
wa_status wide_backward(const kparams &kp, wa_dtype dt, cudaStream_t s);
/* backward; kp.delta must point to B*Hq*Nq floats of workspace, which this fills */
wa_status mma_backward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s);

#endif /* WA_CUDA_COMMON_CUH */
