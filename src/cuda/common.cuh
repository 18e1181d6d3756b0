/* common.cuh — what the dispatcher (dispatch.cu) and the kernel files share: the kernel parameter
 * block, dtype conversions, the per-sequence view of a varlen call, the target a call runs on, and
 * the launch functions each kernel file exposes. */
#ifndef WA_CUDA_COMMON_CUH
#define WA_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>
#include <cuda_runtime.h>

extern "C" {
#include "../internal.h"
}

#include "traits.cuh"

#define CUDA_TRY(call)                                                                                        \
    do {                                                                                                      \
        cudaError_t err_ = (call);                                                                            \
        if (err_ != cudaSuccess)                                                                              \
            return wa_fail(WA_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(err_), __FILE__, __LINE__); \
    } while (0)

/* The sm90/ kernels (wgmma, TMA, mbarrier transactions, setmaxnreg) exist only in the sm_90a
 * compilation. Every other one (compute_80: the SASS for sm_80, sm_86, sm_89 and the PTX that newer
 * GPUs JIT-compile) gets bodies that trap, which the dispatcher never launches (cuda_target.hopper).
 * The host pass sees the real bodies. */
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
    float *dq_acc;        /* the fused dQ's f32 accumulator (else NULL), B*Hq*nq_pad*D floats: the
                           * sm80 kernels use [B, Hq, Nq, D], the sm90 ones their own order
                           * (sm90/bwd_dkdv.cu) */
    int *dq_order;        /* the sm90 ordered dQ (the deterministic form at kSm90OrderedDqD, rectangular
                           * calls): one counter per 64 × 64 block of dq_acc, the shares added so far
                           * (else NULL) */
    float *lse2;          /* sm90 backward: lse·log2(e) per row, +inf past Nq and for empty rows */
    long long nq_pad;     /* row stride of delta and lse2 in the sm90 backward (Nq rounded up to 64) */
    int tile, n_qtiles, n_ktiles; /* the portable kernels', per kernel (portable/attn.cu); 0 otherwise */
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
     * extent ends at the sequence's last row (prims/hopper.cuh: seq_maps_kernel); device memory of
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

/* What the current device runs, for every dispatch decision (dispatch.cu: cuda_target_now, the
 * device's facts read once per device, WINATTN_CUDA applied per call). Compute capability 8.0 and
 * up runs the portable and the mma.sync kernels; the wgmma kernels only where the sm_90a build is
 * the code loaded. */
struct cuda_target {
    bool tensor_cores; /* any mma.sync or wgmma kernel at all (WINATTN_CUDA=portable: no) */
    bool hopper;       /* the sm90/ kernels: compute capability 9.0 running the sm_90a kernels (not
                        * the compute_80 PTX JIT-compiled, whose sm90 kernels are stubs), unless
                        * WINATTN_CUDA=mma, sm80 or sm86 keeps them off */
    size_t smem_optin; /* dynamic shared memory a block may opt in to: the device's
                        * (cudaDevAttrMaxSharedMemoryPerBlockOptin), or less under WINATTN_CUDA=sm80
                        * (A100's 163 KB) or sm86 (99 KB, sm_86 / sm_89) */
    size_t smem_device; /* the device's own opt-in limit, whatever WINATTN_CUDA says: the portable
                         * kernels' limits are raised to what their tiles need there */
    int sms;           /* the device's SMs (cudaDevAttrMultiProcessorCount): a persistent kernel's grid */
    bool tma;          /* the TMA kernels may take calls (WINATTN_CUDA=no-tma: no; with hopper) */
    bool fwd_overlap;  /* the TMA forward overlaps within a warpgroup (WINATTN_CUDA=no-overlap: no) */
};

/* ---- launch functions of the kernel files. Each runs the kernels of its file for kp as the
 * dispatcher chose them (dtype, head dim, varlen or not), raising each kernel's shared-memory limit
 * once per device; none decides whether the call belongs to it. ---- */

/* portable/attn.cu: f32/f16/bf16, any D up to WA_MAX_HEAD_DIM. portable_check_fits: WA_OK when
 * every kernel of the direction fits smem_optin at its smallest tile. The backward needs kp.delta
 * (and for f32 kp.rnorm) with B*Hq*Nq floats (rectangular) or Hq*Tq (varlen). */
wa_status portable_check_fits(long long D, int backward, size_t smem_optin);
wa_status portable_forward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s);
wa_status portable_backward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s);

/* sm80/: f16/bf16, D in {64, 128, 256, 512}, rows 16-byte aligned. The dynamic shared memory of
 * the forward kernel and of the backward's largest at D; the forward; the backward at D <= 256
 * (dQ by f32 atomic adds into kp.dq_acc, [B, Hq, Nq, D], when it is set, else by the dQ kernel)
 * and at D = 512 (always the dQ kernel). kp.delta: B*Hq*Nq floats of workspace. */
size_t sm80_forward_smem(long long D);
size_t sm80_backward_smem(long long D);
size_t sm80_backward_d512_smem(void);
wa_status sm80_forward(const kparams &kp, wa_dtype dt, cudaStream_t s);
wa_status sm80_backward(const kparams &kp, wa_dtype dt, cudaStream_t s);
wa_status sm80_backward_d512(const kparams &kp, wa_dtype dt, cudaStream_t s);

/* sm90/: only where cuda_target.hopper. sm90_code_loaded: whether the current device runs the
 * sm_90a kernels (rather than the stubs of the compute_80 PTX). The TMA kernels take the tensor
 * maps the dispatcher encoded (dispatch.cu: the boxes from traits.cuh); maps of a varlen call are
 * copied per sequence into kp.seq_maps first. */
int sm90_code_loaded(void);
/* the D = 256 forward without TMA (cp.async loads) */
wa_status sm90_forward_cp_async(const kparams &kp, wa_dtype dt, cudaStream_t s);
/* maps: Q, K, V. pipelined: O += P V of one key tile overlapped with the next tile's softmax */
wa_status sm90_forward(const kparams &kp, wa_dtype dt, const CUtensorMap (&maps)[3], bool pipelined, int sms, cudaStream_t s);
wa_status sm90_forward_d512(const kparams &kp, wa_dtype dt, const CUtensorMap (&maps)[3], int sms, cudaStream_t s);
/* The backward's kernels, each launched on one chunk of sequences (over_sequences: z, c.seq0) with
 * maps Q, dO, K, V in the dK/dV kernel's boxes (0-3) and in the dQ kernel's (4-7), after
 * sm90_write_seq_maps. prep: δ and lse2 (and the fused form's accumulator zeroed: all of it, or
 * with zero_all false only the tiles no key tile writes first). dkdv: fused adds dQ into
 * c.dq_acc, ordered in a fixed order (c.dq_order). dq_convert: dq from the fused accumulator
 * (rectangular); dq_convert_rows the same for a varlen call, once for all its sequences. */
wa_status sm90_write_seq_maps(const kparams &kp, const CUtensorMap (&maps)[8], cudaStream_t s);
wa_status sm90_prep(const kparams &c, wa_dtype dt, bool zero_all, unsigned z, cudaStream_t s);
wa_status sm90_dkdv(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], bool fused, bool ordered, unsigned z,
                    cudaStream_t s);
wa_status sm90_dq(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], unsigned z, cudaStream_t s);
wa_status sm90_dq_convert(const kparams &c, wa_dtype dt, unsigned z, cudaStream_t s);
wa_status sm90_dq_convert_rows(const kparams &kp, wa_dtype dt, cudaStream_t s);
wa_status sm90_dkdv_d512(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], unsigned z, cudaStream_t s);
wa_status sm90_dq_d512(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], unsigned z, cudaStream_t s);

#endif /* WA_CUDA_COMMON_CUH */
