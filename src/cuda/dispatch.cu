/* dispatch.cu — the CUDA backend's host layer: the wa_cuda_* entry points, what the device is,
 * which kernels take a call (shape, dtype, alignment, shared memory, what TMA can describe), the
 * workspace, and the order the kernels run in. The kernel files (portable/, sm80/, sm90/) only
 * launch what this file chose; common.cuh declares their launch functions.
 *
 * The paths, from the first that takes a call:
 *   sm90 TMA   f16/bf16 at D = 64, 128, 256, 512 on Hopper (the sm_90a build), tensors TMA can
 *              describe: sm90/fwd.cu, fwd_d512.cu; sm90/bwd_*.cu (the backward needs lse)
 *   sm90 cp.async  the forward at D = 256 on Hopper otherwise (sm90/fwd_cp_async.cu)
 *   sm80       f16/bf16 at D = 64, 128, 256, 512 with 16-byte-aligned rows, on any GPU of compute
 *              capability 8.0 and up where the kernels' shared memory fits (sm80/)
 *   portable   everything else: f32, any other D up to 512, rows not 16-byte aligned (portable/)
 * docs/cuda.md describes the kernels.
 */
#include "prims/tma.cuh"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <mutex>

/* ---- the device ---- */
/* What a device is, read once per device (a device from kMaxDevices on: every call): its compute
 * capability (10 major + minor), the shared memory a block may opt in to, its SMs, and whether the
 * sm_90a kernels are the code loaded there (sm90_code_loaded, sm90/fwd.cu) */
struct device_facts {
    int cc, smem_optin, sms, hopper_code;
};
constexpr int kMaxDevices = 64;

/* dev must be the current device (sm90_code_loaded asks about it) */
static wa_status device_facts_of(int dev, device_facts *f) {
    static device_facts cache[kMaxDevices];
    static std::atomic<int> ready[kMaxDevices];
    static std::mutex filling;
    const bool cached = dev >= 0 && dev < kMaxDevices;
    if (cached && ready[dev].load(std::memory_order_acquire)) {
        *f = cache[dev];
        return WA_OK;
    }
    int major = 0, minor = 0, optin = 0, sms = 0;
    CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    f->cc = 10 * major + minor, f->smem_optin = optin, f->sms = sms, f->hopper_code = sm90_code_loaded();
    if (cached) {
        std::lock_guard<std::mutex> hold(filling);
        cache[dev] = *f;
        ready[dev].store(1, std::memory_order_release);
    }
    return WA_OK;
}

/* the shared memory a block has on the GPUs WINATTN_CUDA=sm80 and sm86 stand for: compute
 * capability 8.0 (A100) and 8.6 / 8.9 (RTX 30x0 and 40x0, A10, A40, L4, L40) */
constexpr size_t kSmemSm80 = 166912, kSmemSm86 = 101376;

/* The target of a call on the current device (cuda_target, common.cuh). Compute capability 9.0
 * running the sm_90a build gets every kernel; 8.x, and any other 8.0-or-newer GPU (Blackwell's
 * 10.x and 12.x, which run the compute_80 PTX through the driver's JIT: mma.sync, cp.async and
 * ldmatrix are all they need), the mma.sync kernels where their shared memory fits; so does a 9.0
 * GPU whose driver JIT-compiled the PTX (CUDA_FORCE_PTX_JIT=1), where the sm90 kernels are stubs.
 * WINATTN_CUDA, read per call, selects paths for comparisons and for checking on one GPU what
 * another runs (cuda_force_of):
 *   portable    every call on the portable kernels (no tensor cores);
 *   mma         no wgmma kernel on any GPU: the sm80 (mma.sync) kernels, the portable ones for the rest;
 *   sm80        what a compute-capability 8.0 GPU runs: mma, with no more than 163 KB a block;
 *   sm86        what 8.6 and 8.9 run: mma with 99 KB;
 *   no-tma      no TMA kernel: on Hopper the cp.async wgmma forward at D = 256 and the sm80 kernels;
 *   no-overlap  the TMA forward (D <= 256, rectangular calls) without the in-warpgroup overlap.
 * Unset or empty selects the default; any other value fails the call with WA_ERR_INVALID_ARG, as an
 * unknown WINATTN_ISA fails wa_context_create (the library prints nothing). */
enum class cuda_force { none, portable, mma, sm80, sm86, no_tma, no_overlap, unknown };

static cuda_force cuda_force_of(const char *v) {
    static const struct {
        const char *name;
        cuda_force f;
    } names[] = {{"portable", cuda_force::portable}, {"mma", cuda_force::mma},       {"sm80", cuda_force::sm80},
                 {"sm86", cuda_force::sm86},         {"no-tma", cuda_force::no_tma}, {"no-overlap", cuda_force::no_overlap}};
    if (!v || !*v) return cuda_force::none;
    for (const auto &n : names)
        if (!strcmp(v, n.name)) return n.f;
    return cuda_force::unknown;
}

static wa_status cuda_target_now(cuda_target *t) {
    int dev = 0;
    CUDA_TRY(cudaGetDevice(&dev));
    device_facts f;
    const wa_status st = device_facts_of(dev, &f);
    if (st != WA_OK) return st;
    if (f.cc < 80)
        return wa_fail(WA_ERR_UNSUPPORTED, "CUDA device %d has compute capability %d.%d; winattn's kernels need 8.0 or newer", dev,
                       f.cc / 10, f.cc % 10);
    const char *force_name = getenv("WINATTN_CUDA");
    const cuda_force force = cuda_force_of(force_name);
    if (force == cuda_force::unknown)
        return wa_fail(WA_ERR_INVALID_ARG, "WINATTN_CUDA=%.64s is not one of portable, mma, sm80, sm86, no-tma, no-overlap (or unset)",
                       force_name);
    const bool sm80 = force == cuda_force::sm80, sm86 = force == cuda_force::sm86;
    t->tensor_cores = force != cuda_force::portable;
    t->hopper = f.hopper_code && force != cuda_force::mma && !sm80 && !sm86;
    t->tma = force != cuda_force::no_tma;
    t->fwd_overlap = force != cuda_force::no_overlap;
    t->smem_optin = (size_t)f.smem_optin;
    t->smem_device = (size_t)f.smem_optin;
    t->sms = f.sms;
    if (sm80 || sm86) t->smem_optin = std::min(t->smem_optin, sm80 ? kSmemSm80 : kSmemSm86);
    return WA_OK;
}

/* ---- the call ---- */

static dev_tensor dev_of(const wa_tensor *t) {
    dev_tensor d = {nullptr, 0, 0, 0};
    if (t) d.data = (char *)t->data, d.s0 = t->stride[0], d.s1 = t->stride[1], d.s2 = t->stride[2];
    return d;
}

static kparams params_of(const wa_problem *p) {
    kparams k;
    k.q = dev_of(p->q), k.k = dev_of(p->k), k.v = dev_of(p->v), k.o = dev_of(p->o), k.lse = dev_of(p->lse);
    k.dout = dev_of(p->do_), k.dq = dev_of(p->dq), k.dk = dev_of(p->dk), k.dv = dev_of(p->dv);
    k.B = p->B, k.Hq = p->Hq, k.Hkv = p->Hkv, k.Nq = p->Nq, k.Nk = p->Nk, k.D = p->D, k.group = p->group;
    k.scale = p->scale, k.softcap = p->softcap, k.win = p->win;
    k.delta = k.rnorm = k.dq_acc = k.lse2 = nullptr;
    k.dq_order = nullptr;
    k.nq_pad = 0;
    k.cu_q = p->cu_q, k.cu_k = p->cu_k, k.Tq = p->Tq, k.Tk = p->Tk;
    k.ws_stride = p->cu_q ? p->Tq : 0;
    k.seq0 = k.q_row0 = k.k_row0 = 0;
    k.tile = k.n_qtiles = k.n_ktiles = 0; /* the portable kernels', set per kernel there */
    return k;
}

static cudaStream_t stream_of(const wa_context *ctx) { return (cudaStream_t)ctx->params.cuda_stream; }

static wa_status check_grid(const wa_problem *p) {
    if (p->Hq > 65535 || (p->B > 65535 && !p->cu_q)) /* varlen launches take the sequences in chunks */
        return wa_fail(WA_ERR_UNSUPPORTED, "CUDA backend: B = %lld and Hq = %lld must each be at most 65535", (long long)p->B,
                       (long long)p->Hq);
    if ((p->Nq + 3) / 4 > 0x7fffffff || (p->Nk + 3) / 4 > 0x7fffffff) /* tiles of 4 rows at the least */
        return wa_fail(WA_ERR_UNSUPPORTED, "CUDA backend: sequence too long");
    return WA_OK;
}


/* ---- which kernels take a call ---- */

/* cp.async moves 16-byte chunks and the epilogues store 4-byte pairs (a varlen tensor's batch
 * stride is never used: one batch entry, the sequences along its rows) */
static int rows_aligned(const wa_tensor *t, int varlen) {
    if (!t) return 1;
    return ((uintptr_t)t->data % 16) == 0 && (varlen || t->stride[0] % 8 == 0) && t->stride[1] % 8 == 0 && t->stride[2] % 8 == 0;
}

/* Dynamic shared memory of the mma.sync kernels a call at head dim D launches: the forward, or the
 * backward's largest (dK/dV or dQ; δ uses none). On compute capability 8.0 (163 KB a block) the
 * forward and the backward fit at D = 64 and 128; on 8.6 and 8.9 (99 KB) the forward at D = 64 and
 * 128 and the backward at D = 64; D = 256 and 512 need Hopper's 227 KB. */
static size_t mma_sync_smem(long long D, int backward) {
    switch (D) {
    case 64:
    case 128:
    case 256: return backward ? sm80_backward_smem(D) : sm80_forward_smem(D);
    case 512: return backward ? sm80_backward_d512_smem() : sm80_forward_smem(D);
    }
    return SIZE_MAX;
}

/* Whether the call runs on the tensor cores at all (f16/bf16, D in {64, 128, 256, 512},
 * 16-byte-aligned rows): on Hopper always (every fallback fits its 227 KB), elsewhere when the
 * mma.sync kernels of the direction (forward, or backward when `backward`) fit t.smem_optin; the
 * rest runs on the portable kernels */
static int tensor_cores_take(const wa_problem *p, const cuda_target &t, int backward) {
    if (!t.tensor_cores) return 0;
    if (p->dtype != WA_F16 && p->dtype != WA_BF16) return 0;
    if (p->D != 64 && p->D != 128 && p->D != 256 && p->D != 512) return 0;
    const wa_tensor *all[9] = {p->q, p->k, p->v, p->o, p->lse, p->do_, p->dq, p->dk, p->dv};
    for (int i = 0; i < 9; i++)
        if (i != 4 && !rows_aligned(all[i], p->cu_q != NULL)) return 0;
    return mma_sync_smem(p->D, backward) <= t.smem_optin;
}

static bool sm90_tma_head_dim(long long D) { return D == 64 || D == 128 || D == 256 || D == kSm90D512; }

/* The TMA forward, before its tensor maps are encoded. Without a softcap the kernels fold the scale
 * into exp2's argument (prims/mma.cuh: softmax_scores), which needs it positive; a negative scale
 * (0 means 1/sqrt(D) by then), which no model uses, runs on the cp.async or the mma.sync forward. */
static int sm90_forward_takes(const kparams &kp, const cuda_target &t) {
    return t.tma && sm90_tma_head_dim(kp.D) && kp.Nq > 0 && kp.Nk > 0 && (kp.softcap > 0.0f || kp.scale > 0.0f) &&
           tensor_map_encoder() != nullptr;
}
/* the TMA backward, before its tensor maps are encoded (it reads lse) */
static int sm90_backward_takes(const kparams &kp, const cuda_target &t) {
    return t.tma && sm90_tma_head_dim(kp.D) && kp.Nq > 0 && kp.Nk > 0 && kp.lse.data && tensor_map_encoder() != nullptr;
}
/* whether the TMA backward has the fused form (dQ added by the dK/dV kernel into kp.dq_acc) for
 * kp's head dim; elsewhere it ignores kp.dq_acc */
static int sm90_fuses_dq(const kparams &kp) { return kp.D == 64 || kp.D == 128; }
/* whether its deterministic form is the fused kernel with dQ's shares added in a fixed order
 * (kp.dq_order; rectangular calls) rather than the dQ kernel */
static int sm90_orders_dq(const kparams &kp) { return !kp.cu_q && kp.D == kSm90OrderedDqD; }

/* the forward's maps: Q in boxes of the CTA's rows, K and V of its key tile; false when TMA cannot
 * describe the tensors */
static bool forward_maps(const kparams &kp, wa_dtype dt, CUtensorMap (&maps)[3]) {
    const int D = (int)kp.D, wide = D == kSm90D512;
    const int bm = wide ? kSm90FwdD512Rows : kSm90FwdRows;
    const int bn = wide ? kSm90FwdD512Keys : D == 256 ? sm90_fwd_keys<256>() : D == 128 ? sm90_fwd_keys<128>() : sm90_fwd_keys<64>();
    const long long nb = map_batch(kp), nq = map_q_rows(kp), nk = map_k_rows(kp);
    return tensor_map(&maps[0], kp.q, dt, nb, kp.Hq, nq, D, bm) && tensor_map(&maps[1], kp.k, dt, nb, kp.Hkv, nk, D, bn) &&
           tensor_map(&maps[2], kp.v, dt, nb, kp.Hkv, nk, D, bn);
}

/* the backward's maps: Q, dO in 64-row boxes and K, V in boxes of the dK/dV kernel's keys; then Q,
 * dO in the dQ kernel's rows (128, or 64 at D = 512) and K, V in its key tile */
static bool backward_maps(const kparams &kp, wa_dtype dt, CUtensorMap (&m)[8]) {
    const int D = (int)kp.D, wide = D == kSm90D512;
    const int bn = wide ? kSm90DqD512Keys : D == 256 ? sm90_dq_keys<256>() : sm90_dq_keys<128>();
    const int kv_rows = wide ? kSm90DkdvD512Keys : D == 256 ? sm90_dkdv_keys<256>() : sm90_dkdv_keys<128>();
    const int dq_rows = wide ? kSm90DqD512Rows : kSm90DqRows;
    const long long B = map_batch(kp), Nq = map_q_rows(kp), Nk = map_k_rows(kp);
    return tensor_map(&m[0], kp.q, dt, B, kp.Hq, Nq, D, 64) && tensor_map(&m[1], kp.dout, dt, B, kp.Hq, Nq, D, 64) &&
           tensor_map(&m[2], kp.k, dt, B, kp.Hkv, Nk, D, kv_rows) && tensor_map(&m[3], kp.v, dt, B, kp.Hkv, Nk, D, kv_rows) &&
           tensor_map(&m[4], kp.q, dt, B, kp.Hq, Nq, D, dq_rows) && tensor_map(&m[5], kp.dout, dt, B, kp.Hq, Nq, D, dq_rows) &&
           tensor_map(&m[6], kp.k, dt, B, kp.Hkv, Nk, D, bn) && tensor_map(&m[7], kp.v, dt, B, kp.Hkv, Nk, D, bn);
}

/* ---- workspace ---- */

static wa_status context_workspace(wa_context *ctx, size_t bytes, cudaStream_t s, void **ws, int *owned);
static wa_status release_workspace(void *ws, int owned, cudaStream_t s, wa_status st);

/* varlen calls: the TMA kernels' per-sequence tensor maps (kparams.seq_maps), B × kMaxSeqMaps maps
 * of 128 bytes; nothing for rectangular calls */
static size_t seq_map_bytes(const wa_problem *p) { return p->cu_q ? (size_t)p->B * kMaxSeqMaps * kTensorMapBytes : 0; }


/* dQ by f32 adds into an accumulator (unless the context asks for determinism) where the
 * tensor-core kernels have that form: the sm90 dK/dV kernel at D <= 128 (dQ fused into it) and the
 * sm80 kernels at D <= 256; the sm90 backward at D = 256 has none and stays deterministic, as does
 * D = 512 everywhere */
static int atomic_dq(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    if (ctx->params.cuda_deterministic || !tensor_cores_take(p, t, 1)) return 0;
    if (p->D == 512) return 0;
    const kparams kp = params_of(p);
    return !t.hopper || !sm90_backward_takes(kp, t) || sm90_fuses_dq(kp);
}
/* the deterministic form where the sm90 backward fuses dQ and orders its adds (sm90_orders_dq):
 * the fused kernel with each 64 × 64 block's shares added in a fixed order, in place of the dQ
 * kernel that forms S and dP again; it needs the accumulator and a counter per block */
static int ordered_dq(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    if (!ctx->params.cuda_deterministic || !t.hopper || !tensor_cores_take(p, t, 1)) return 0;
    const kparams kp = params_of(p);
    return sm90_backward_takes(kp, t) && sm90_fuses_dq(kp) && sm90_orders_dq(kp);
}

/* backward workspace: two arrays of rows (delta, then rnorm for f32 or lse2 for the sm90
 * backward), plus the f32 dQ accumulator of the fused dQ (ws_rows × D). Rectangular: rows
 * padded to 64 per (b, h), as the sm90 kernels write and add whole 64-row tiles; varlen: packed by
 * token, Tq rows per head and nothing per sequence (kparams.ws_stride; the kernels bound their
 * reads and writes by the sequence's own rows), rounded up to 64 rows in all so that each array
 * starts 256-byte aligned (the accumulator is zeroed and read by 16-byte vectors) */
static size_t ws_rows(const wa_problem *p) {
    if (p->cu_q) return (size_t)((p->Hq * p->Tq + 63) / 64 * 64);
    return (size_t)(p->B * p->Hq * ((p->Nq + 63) / 64 * 64));
}
/* the ordered form's counters: one per 64 rows and 64 columns (D <= 128: two at most), after the
 * accumulator */
static size_t order_counters(const wa_problem *p) { return ws_rows(p) / 64 * 2; }
static size_t workspace_floats(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    const int ordered = ordered_dq(ctx, p, t);
    size_t n = 2 * ws_rows(p) + (atomic_dq(ctx, p, t) || ordered ? ws_rows(p) * (size_t)p->D : 0) + (ordered ? order_counters(p) : 0);
    return n ? n : 1;
}
/* the backward's workspace: the floats, then (varlen) the tensor maps, 128-byte aligned */
static size_t seq_maps_offset(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    return (workspace_floats(ctx, p, t) * sizeof(float) + kTensorMapBytes - 1) / kTensorMapBytes * kTensorMapBytes;
}
static size_t backward_workspace_bytes(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    return seq_map_bytes(p) ? seq_maps_offset(ctx, p, t) + seq_map_bytes(p) : workspace_floats(ctx, p, t) * sizeof(float);
}

/* `bytes` of device workspace for a call on stream s: the context's, grown (stream-ordered) when
 * too small or on another device. Reused in stream order: a context serves one thread and one
 * stream at a time, so the next call's kernels start after this one's. Not while s is being
 * captured into a CUDA graph: the graph would keep pointing at a buffer a later, larger call may
 * free, so a captured call allocates and frees its own (*owned = 1; graph-owned memory nodes). */
static wa_status context_workspace(wa_context *ctx, size_t bytes, cudaStream_t s, void **ws, int *owned) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    *owned = capture != cudaStreamCaptureStatusNone;
    if (*owned) {
        CUDA_TRY(cudaMallocAsync(ws, bytes, s));
        return WA_OK;
    }
    int dev = 0; /* the stream's device: the pool cudaMallocAsync draws from */
    if (cudaStreamGetDevice(s, &dev) != cudaSuccess) {
        (void)cudaGetLastError(); /* not left behind for the launch checks */
        CUDA_TRY(cudaGetDevice(&dev));
    }
    if (ctx->cuda_ws && (ctx->cuda_ws_bytes < bytes || ctx->cuda_ws_device != dev)) {
        if (ctx->cuda_ws_device == dev) CUDA_TRY(cudaFreeAsync(ctx->cuda_ws, s));
        else wa_cuda_context_release(ctx);
        ctx->cuda_ws = nullptr, ctx->cuda_ws_bytes = 0;
    }
    if (!ctx->cuda_ws) {
        void *fresh = nullptr;
        CUDA_TRY(cudaMallocAsync(&fresh, bytes, s));
        ctx->cuda_ws = fresh, ctx->cuda_ws_bytes = bytes, ctx->cuda_ws_device = dev;
    }
    *ws = ctx->cuda_ws;
    return WA_OK;
}

/* after a call that ended with status st: a workspace the call owned (context_workspace during a
 * capture) freed on its stream; st, or the free's failure if st was WA_OK */
static wa_status release_workspace(void *ws, int owned, cudaStream_t s, wa_status st) {
    if (owned) {
        const cudaError_t e = cudaFreeAsync(ws, s);
        if (st == WA_OK && e != cudaSuccess) st = wa_fail(WA_ERR_CUDA, "cudaFreeAsync: %s", cudaGetErrorString(e));
    }
    return st;
}

/* ---- forward ---- */

/* f16/bf16 on the tensor cores: the TMA forward where it takes the call, else on Hopper the
 * cp.async wgmma forward at D = 256, else the mma.sync forward */
static wa_status forward_tensor_cores(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s) {
    if (t.hopper && sm90_forward_takes(kp, t)) {
        CUtensorMap maps[3];
        if (forward_maps(kp, dt, maps)) {
            if (kp.D == kSm90D512) return sm90_forward_d512(kp, dt, maps, t.sms, s);
            /* WINATTN_CUDA=no-overlap: without the in-warpgroup overlap (rectangular calls) */
            const bool pipelined = kp.cu_q || t.fwd_overlap;
            return sm90_forward(kp, dt, maps, pipelined, t.sms, s);
        }
    }
    if (t.hopper && kp.D == 256) return sm90_forward_cp_async(kp, dt, s);
    return sm80_forward(kp, dt, s);
}

static wa_status forward(wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    kparams kp = params_of(p);
    if (tensor_cores_take(p, t, 0)) {
        cudaStream_t s = stream_of(ctx);
        if (!seq_map_bytes(p) || !t.hopper) return forward_tensor_cores(kp, p->dtype, t, s);
        void *ws = nullptr;
        int owned = 0;
        wa_status st = context_workspace(ctx, seq_map_bytes(p), s, &ws, &owned);
        if (st != WA_OK) return st;
        kp.seq_maps = ws;
        return release_workspace(ws, owned, s, forward_tensor_cores(kp, p->dtype, t, s));
    }
    const wa_status st = portable_check_fits(p->D, 0, t.smem_optin);
    if (st != WA_OK) return st;
    return portable_forward(kp, p->dtype, t, stream_of(ctx));
}

/* ---- backward ---- */

/* The TMA backward, the maps encoded: prep, dK/dV and the dQ kernel (deterministic; D = 512, and
 * D = 256 always), or prep, dK/dV with dQ fused into kp.dq_acc and its conversion into dq (in a
 * fixed order where kp.dq_order is set: ordered_dq). Each chunk of sequences (over_sequences) runs
 * its kernels in that order. */
static wa_status backward_sm90(const kparams &kp, wa_dtype dt, const CUtensorMap (&m)[8], cudaStream_t s) {
    const wa_status maps_st = sm90_write_seq_maps(kp, m, s); /* varlen: every sequence's copies of the eight maps */
    if (maps_st != WA_OK) return maps_st;
    if (sm90_fuses_dq(kp) && kp.dq_acc) {
        const bool ordered = kp.dq_order && !kp.cu_q;
        const wa_status st = over_sequences(kp, [&](const kparams &c, unsigned z) {
            /* ordered: prep zeroes only the accumulator tiles no key tile stores first */
            wa_status e = sm90_prep(c, dt, !ordered, z, s);
            if (e == WA_OK) e = sm90_dkdv(c, dt, m, true, ordered, z, s);
            if (e == WA_OK && !kp.cu_q) e = sm90_dq_convert(c, dt, z, s);
            return e;
        });
        if (st != WA_OK || !kp.cu_q) return st;
        return sm90_dq_convert_rows(kp, dt, s); /* varlen: the row-major accumulator, once */
    }
    kparams dkp = kp;
    dkp.dq_acc = nullptr; /* not fused: prep has nothing to zero */
    return over_sequences(dkp, [&](const kparams &c, unsigned z) {
        wa_status e = sm90_prep(c, dt, true, z, s);
        if (e != WA_OK) return e;
        if (kp.D == kSm90D512) {
            e = sm90_dkdv_d512(c, dt, m, z, s);
            return e == WA_OK ? sm90_dq_d512(c, dt, m, z, s) : e;
        }
        e = sm90_dkdv(c, dt, m, false, false, z, s);
        return e == WA_OK ? sm90_dq(c, dt, m, z, s) : e;
    });
}

/* f16/bf16 on the tensor cores: the TMA backward where it takes the call, else the mma.sync one
 * (whose dQ accumulator, where the call has one, is the plain [B, Hq, Nq, D]: the ordered form's is
 * the TMA backward's alone, so a deterministic call keeps the dQ kernel there) */
static wa_status backward_tensor_cores(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s) {
    if (t.hopper && sm90_backward_takes(kp, t) && kp.lse2) {
        CUtensorMap maps[8];
        if (backward_maps(kp, dt, maps)) return backward_sm90(kp, dt, maps, s);
    }
    kparams k = kp;
    if (k.dq_order) k.dq_acc = nullptr, k.dq_order = nullptr;
    if (k.D == 512) return sm80_backward_d512(k, dt, s);
    return sm80_backward(k, dt, s);
}

static wa_status backward(wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    kparams kp = params_of(p);
    cudaStream_t s = stream_of(ctx);
    int f32 = p->dtype == WA_F32, atomic = atomic_dq(ctx, p, t), ordered = ordered_dq(ctx, p, t), tensor_cores = tensor_cores_take(p, t, 1);
    if (!tensor_cores) {
        const wa_status fits = portable_check_fits(p->D, 1, t.smem_optin);
        if (fits != WA_OK) return fits;
    }
    void *ws = nullptr;
    int owned = 0;
    const wa_status got = context_workspace(ctx, backward_workspace_bytes(ctx, p, t), s, &ws, &owned);
    if (got != WA_OK) return got;
    kp.delta = (float *)ws;
    kp.seq_maps = seq_map_bytes(p) ? (char *)ws + seq_maps_offset(ctx, p, t) : nullptr;
    kp.nq_pad = (p->Nq + 63) / 64 * 64;
    kp.rnorm = f32 ? kp.delta + ws_rows(p) : nullptr;
    kp.lse2 = f32 ? nullptr : kp.delta + ws_rows(p);
    kp.dq_acc = atomic || ordered ? kp.delta + 2 * ws_rows(p) : nullptr;
    kp.dq_order = ordered ? (int *)(kp.dq_acc + ws_rows(p) * (size_t)p->D) : nullptr;
    const wa_status st = tensor_cores ? backward_tensor_cores(kp, p->dtype, t, s) : portable_backward(kp, p->dtype, t, s);
    return release_workspace(ws, owned, s, st);
}

/* ---- entry points ---- */

extern "C" {

/* a GPU of compute capability 8.0 or newer is present (the call's own device is checked per call:
 * cuda_target_now) */
int wa_cuda_available(void) {
    static int cached = -1;
    if (cached < 0) {
        int n = 0, ok = 0;
        if (cudaGetDeviceCount(&n) == cudaSuccess)
            for (int dev = 0; dev < n && !ok; dev++) {
                int major = 0;
                ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 8;
            }
        cudaGetLastError(); /* clear the no-device error so it does not surface later */
        cached = ok;
    }
    return cached;
}

size_t wa_cuda_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward) {
    if (p->B * p->Hq * p->Nq == 0) return 0;
    cuda_target t;
    if (cuda_target_now(&t) != WA_OK) {
        (void)cudaGetLastError();
        wa_clear_error(); /* the call itself reports it */
        return backward ? 2 * ws_rows(p) * sizeof(float) : 0;
    }
    if (!backward) return tensor_cores_take(p, t, 0) && t.hopper ? seq_map_bytes(p) : 0;
    return backward_workspace_bytes(ctx, p, t);
}

wa_status wa_cuda_forward(wa_context *ctx, const wa_problem *p) {
    wa_status st = check_grid(p);
    if (st != WA_OK || p->B == 0 || p->Hq == 0 || p->Nq == 0) return st;
    cuda_target t;
    if ((st = cuda_target_now(&t)) != WA_OK) return st;
    switch (p->dtype) {
    case WA_F32:
    case WA_F16:
    case WA_BF16: return forward(ctx, p, t);
    }
    return wa_fail(WA_ERR_DTYPE, "unknown dtype");
}

wa_status wa_cuda_backward(wa_context *ctx, const wa_problem *p) {
    wa_status st = check_grid(p);
    if (st != WA_OK || p->B == 0 || p->Hq == 0) return st;
    cuda_target t;
    if ((st = cuda_target_now(&t)) != WA_OK) return st;
    switch (p->dtype) {
    case WA_F32:
    case WA_F16:
    case WA_BF16: return backward(ctx, p, t);
    }
    return wa_fail(WA_ERR_DTYPE, "unknown dtype");
}

wa_status wa_cuda_malloc(size_t bytes, void **ptr) {
    CUDA_TRY(cudaMalloc(ptr, bytes ? bytes : 1));
    return WA_OK;
}

void wa_cuda_free(void *ptr) { cudaFree(ptr); }

wa_status wa_cuda_memcpy(wa_context *ctx, void *dst, const void *src, size_t bytes, int kind) {
    cudaMemcpyKind k = kind == 0 ? cudaMemcpyHostToDevice : kind == 1 ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, k, stream_of(ctx)));
    CUDA_TRY(cudaStreamSynchronize(stream_of(ctx)));
    return WA_OK;
}

wa_status wa_cuda_memory_impl(wa_context *ctx, size_t *in_use, size_t *workspace_peak) {
    size_t free_b = 0, total_b = 0;
    int dev = 0;
    cudaMemPool_t pool;
    uint64_t high = 0, zero = 0; /* cuuint64_t in the driver API */
    CUDA_TRY(cudaStreamSynchronize(stream_of(ctx)));
    CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    CUDA_TRY(cudaGetDevice(&dev));
    CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, dev));
    CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    *in_use = total_b - free_b;
    *workspace_peak = (size_t)high;
    return WA_OK;
}

void wa_cuda_context_release(wa_context *ctx) {
    if (!ctx->cuda_ws) return;
    int dev = 0;
    const bool switch_device = cudaGetDevice(&dev) == cudaSuccess && dev != ctx->cuda_ws_device;
    if (switch_device) cudaSetDevice(ctx->cuda_ws_device);
    cudaFree(ctx->cuda_ws); /* waits for the work that may still use it */
    if (switch_device) cudaSetDevice(dev);
    ctx->cuda_ws = nullptr, ctx->cuda_ws_bytes = 0;
}

wa_status wa_cuda_synchronize(wa_context *ctx) {
    CUDA_TRY(cudaStreamSynchronize(stream_of(ctx)));
    return WA_OK;
}

} /* extern "C" */
