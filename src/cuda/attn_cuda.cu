/* attn_cuda.cu — the CUDA backend's entry points and version 1, the kernels that are correct for
 * everything in DESIGN.md section 1 (f32/f16/bf16, any D up to 512, windows, causal, GQA,
 * Nq != Nk, softcap, empty rows, zero dK/dV for unvisited keys), linear memory, deterministic, but
 * slow. f16/bf16 calls at D = 64/128/256/512 with 16-byte-aligned rows go to the tensor-core
 * kernels in attn_mma.cu instead (mma_supports() decides, and the same test dispatches), on any GPU
 * of compute capability 8.0 and up where their shared memory fits (cuda_target_now below: what
 * the device runs, read once per device).
 *
 * It mirrors the CPU backend (src/cpu/attn_cpu.c, docs/algorithm.md) one CTA per tile:
 *   forward   one CTA per (query tile, q head, batch): online softmax over the key tiles that
 *             tile_geometry.h says the window lets it see, edge tiles masked.
 *   backward  delta (or, for f32, the row statistics pass) then one CTA per (key tile, kv head,
 *             batch) owning dK and dV, and one per (query tile, q head, batch) owning dQ.
 *             No atomics, no f32 dQ copy: every output has one owner, so results are
 *             bit-identical run to run.
 * Tiles are staged in shared memory as f32; all arithmetic is f32 on CUDA cores with explicit
 * fmaf in a fixed order. The dot products for dP and delta use the same order, which keeps the
 * one-key window exact (dS = 0), as on the CPU. Sums longer than a tile (O and the softmax sum
 * over a row's key tiles, dQ over key tiles, dK and dV over the GQA group's heads times the query
 * tiles) add each tile's f32 partial into a compensated pair (pair_add below), as the CPU adds its
 * partials in f64 (docs/algorithm.md section 6). docs/cuda.md has the measurements of every
 * version.
 *
 * Packed variable-length batches (wa_problem.cu_q) run on every version's kernels, each compiled
 * a second time with VARLEN set: the grid is sized by B and the longest sequence (the offsets are
 * never read on the host), each CTA reads its sequence's offsets and sees that sequence alone
 * (seq_view, common.cuh), and CTAs past their sequence's end leave at once.
 */
#include "common.cuh"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <mutex>

/* Threads of a version-1 CTA. These kernels are chains of dependent fmaf with shared-memory loads
 * between, one CTA an SM at the larger D: latency-bound, so warps are what hides it. 512 against
 * 128 (`sh dev/cuda/f32_accumulation.sh threads`, H200, the table in docs/cuda.md, version 1): f32
 * backward 2.1-2.5x faster, forward 2.0-2.8x. A lab build may set WA_V1_THREADS; results do not
 * depend on it (every element's sums run in one thread in a fixed order). */
#ifndef WA_V1_THREADS
#define WA_V1_THREADS 512
#endif
static const int kThreads = WA_V1_THREADS;

/* rows [row0, row0+nrows) of head (b, h) into dst[r*ld + d] as f32 */
template <typename T>
__device__ void load_rows(float *dst, int ld, const dev_tensor &t, long long b, long long h, long long row0, int nrows, int D) {
    for (int e = threadIdx.x; e < nrows * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        dst[r * ld + d] = to_f32(row_of<T>(t, b, h, row0 + r)[d]);
    }
}

__device__ __forceinline__ float dot_rows(const float *a, const float *b, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc = fmaf(a[d], b[d], acc);
    return acc;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Long sums as an unevaluated pair hi + lo of f32. Adding a tile's partial is Knuth's TwoSum: hi
 * takes the rounded sum and lo collects its exact rounding error, so thousands of partials (4 x
 * 32,768 query rows into one key's dK) lose no more than one f32 rounding, where a plain f32 chain
 * lost about as many ulp as it had terms. A pair rather than a double: GPUs of compute capability
 * 8.6 and 8.9 run float64 at 1/64 the f32 rate, where a double accumulator would slow this path
 * several times; the pair costs seven f32 operations per partial (TwoSum's six, then lo's add).
 * The result is RN(hi + lo). */
__device__ __forceinline__ void pair_add(float &hi, float &lo, float x) {
    const float s = hi + x, x_part = s - hi, err = (hi - (s - x_part)) + (x - x_part);
    hi = s, lo += err;
}
/* (hi + lo) * a, the product's rounding error kept in lo (exact for a = 1: the online softmax's
 * rescale once the row maximum has settled) */
__device__ __forceinline__ void pair_scale(float &hi, float &lo, float a) {
    const float p = hi * a, err = fmaf(hi, a, -p);
    hi = p, lo = fmaf(lo, a, err);
}

/* s = softcap(scale * q.k) for row i, key j, or -inf when the pair is masked */
__device__ __forceinline__ float score(const kparams &p, const float *qrow, const float *krow, long long i, long long j,
                                       int edge) {
    if (edge) {
        long long lo = wa_row_first_key(&p.win, i), hi = wa_row_last_key(&p.win, i);
        if (j < lo || j > hi) return -INFINITY;
    }
    float s = dot_rows(qrow, krow, (int)p.D) * p.scale;
    if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
    return s;
}

/* ---- forward ---- */

template <typename T, bool VARLEN> __global__ void __launch_bounds__(kThreads) forward_kernel(const kparams kp) {
    extern __shared__ float smem[];
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const int Bt = p.tile, D = (int)p.D, ld = D + 1, ls = Bt + 1;
    const long long qt = blockIdx.x, h = blockIdx.y, b = sv.b(), hk = h / p.group;
    const long long i0 = qt * Bt;
    if (VARLEN && i0 >= p.Nq) return; /* past this sequence's rows */
    const int m = (int)min((long long)Bt, p.Nq - i0);
    /* O and the softmax sum l as pairs (pair_add): o_hi, o_lo, l_hi, l_lo */
    float *Qs = smem, *Ks = Qs + Bt * ld, *Vs = Ks + Bt * ld, *o_hi = Vs + Bt * D, *o_lo = o_hi + Bt * D, *S = o_lo + Bt * D;
    float *row_max = S + Bt * ls, *l_hi = row_max + Bt, *l_lo = l_hi + Bt, *alpha = l_lo + Bt;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;

    load_rows<T>(Qs, ld, p.q, b, h, i0, m, D);
    for (int e = threadIdx.x; e < Bt * D; e += blockDim.x) o_hi[e] = o_lo[e] = 0.0f;
    for (int r = threadIdx.x; r < Bt; r += blockDim.x) row_max[r] = -INFINITY, l_hi[r] = l_lo[r] = 0.0f;
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, Bt, &kt0, &kt1);
    for (long long kt = kt0; kt < kt1; kt++) {
        const long long j0 = kt * Bt;
        const int n = (int)min((long long)Bt, p.Nk - j0);
        const int edge = wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        __syncthreads(); /* the previous tile's K, V, S are no longer read */
        load_rows<T>(Ks, ld, p.k, b, hk, j0, n, D);
        load_rows<T>(Vs, D, p.v, b, hk, j0, n, D);
        __syncthreads();
        for (int e = threadIdx.x; e < m * Bt; e += blockDim.x) {
            int r = e / Bt, c = e - r * Bt;
            S[r * ls + c] = c < n ? score(p, Qs + r * ld, Ks + c * ld, i0 + r, j0 + c, edge) : -INFINITY;
        }
        __syncthreads();
        for (int r = warp; r < m; r += warps) { /* one warp per row: online softmax update */
            float mx = -INFINITY, m_old = row_max[r];
            for (int c = lane; c < Bt; c += 32) mx = fmaxf(mx, S[r * ls + c]);
            float m_new = fmaxf(m_old, warp_max(mx));
            const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* masked: exp(-inf) = 0; a NaN score stays NaN */
            float sum = 0.0f;
            for (int c = lane; c < Bt; c += 32) {
                float e = expf(S[r * ls + c] - m_use);
                S[r * ls + c] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            __syncwarp(); /* every lane has read row_max[r] before lane 0 rewrites it */
            if (lane == 0) {
                float a = m_new == -INFINITY ? 1.0f : expf(m_old - m_new), hi = l_hi[r], lo = l_lo[r];
                pair_scale(hi, lo, a);
                pair_add(hi, lo, sum);
                alpha[r] = a, l_hi[r] = hi, l_lo[r] = lo;
                row_max[r] = m_new;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < m * D; e += blockDim.x) {
            int r = e / D, d = e - r * D;
            float part = 0.0f, hi = o_hi[e], lo = o_lo[e];
            for (int c = 0; c < n; c++) part = fmaf(S[r * ls + c], Vs[c * D + d], part);
            pair_scale(hi, lo, alpha[r]);
            pair_add(hi, lo, part);
            o_hi[e] = hi, o_lo[e] = lo;
        }
    }
    __syncthreads();
    /* o = O / l, rounded once; a row that sees keys divides even when l is 0 or NaN (softmax's NaN) */
    for (int e = threadIdx.x; e < m * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        const double l = (double)l_hi[r] + l_lo[r];
        const bool sees = wa_row_sees_keys(&p.win, i0 + r);
        row_of<T>(p.o, b, h, i0 + r)[d] = from_f32<T>(sees ? (float)(((double)o_hi[e] + o_lo[e]) / l) : 0.0f);
    }
    if (p.lse.data)
        for (int r = threadIdx.x; r < m; r += blockDim.x) {
            const float l = l_hi[r] + l_lo[r];
            *row_of<float>(p.lse, b, h, i0 + r) = wa_row_sees_keys(&p.win, i0 + r) ? row_max[r] + logf(l) : -INFINITY;
        }
}

/* ---- backward ---- */

/* delta_i = dO_i . O_i, one thread per row, fmaf in the order dot_rows uses for dP */
template <typename T> __device__ __forceinline__ float delta_of(const kparams &p, long long b, long long h, long long i) {
    const T *o = row_of<T>(p.o, b, h, i), *g = row_of<T>(p.dout, b, h, i);
    float acc = 0.0f;
    for (int d = 0; d < p.D; d++) acc = fmaf(to_f32(g[d]), to_f32(o[d]), acc);
    return acc;
}
/* rectangular: a grid-stride loop over all B·Hq·Nq rows; varlen: a (rows / 256, Hq, sequences) grid */
template <typename T, bool VARLEN> __global__ void delta_kernel(const kparams kp) {
    if constexpr (VARLEN) {
        const seq_view<T, true> sv(kp);
        const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x, h = blockIdx.y;
        if (i < sv.p.Nq) sv.p.delta[ws_head<true>(sv.p, 0, h, 0) + i] = delta_of<T>(sv.p, 0, h, i);
    } else {
        const kparams &p = kp;
        long long rows = p.B * p.Hq * p.Nq;
        for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < rows; r += (long long)gridDim.x * blockDim.x) {
            long long i = r % p.Nq, bh = r / p.Nq, b = bh / p.Hq, h = bh % p.Hq;
            p.delta[r] = delta_of<T>(p, b, h, i);
        }
    }
}

struct row_stats { /* per query row of the current tile, in shared memory */
    float *lse, *delta, *rnorm;
};

/* For query rows [i0, i0+m) x keys [j0, j0+n): P into S, dS (w.r.t. the raw q.k) into dP. */
__device__ void pair_grads(const kparams &p, const float *Qs, const float *dOs, const float *Ks, const float *Vs, float *S,
                           float *dP, long long i0, int m, long long j0, int n, row_stats rs, int with_rnorm) {
    const int Bt = p.tile, ld = (int)p.D + 1, ls = Bt + 1;
    const int edge = wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
    int64_t rb, re;
    wa_nonempty_rows(&p.win, &rb, &re);
    for (int e = threadIdx.x; e < Bt * Bt; e += blockDim.x) {
        int r = e / Bt, c = e - r * Bt;
        float pv = 0.0f, ds = 0.0f;
        long long i = i0 + r;
        if (r < m && c < n && i >= rb && i < re) {
            float s = score(p, Qs + r * ld, Ks + c * ld, i, j0 + c, edge);
            float dp = dot_rows(dOs + r * ld, Vs + c * ld, (int)p.D);
            pv = expf(s - rs.lse[r]);
            if (with_rnorm) pv *= rs.rnorm[r];
            ds = pv * (dp - rs.delta[r]);
            if (p.softcap > 0.0f && pv != 0.0f) {
                float t = s / p.softcap;
                ds *= 1.0f - t * t;
            }
            ds *= p.scale;
        }
        S[r * ls + c] = pv;
        dP[r * ls + c] = ds;
    }
}

template <bool VARLEN>
__device__ void load_row_stats(const kparams &p, long long b, long long h, long long i0, int m, row_stats rs, int with_rnorm) {
    for (int r = threadIdx.x; r < m; r += blockDim.x) {
        long long row = ws_head<VARLEN>(p, b, h, p.Nq) + i0 + r;
        rs.lse[r] = *row_of<float>(p.lse, b, h, i0 + r);
        rs.delta[r] = p.delta[row];
        rs.rnorm[r] = with_rnorm ? p.rnorm[row] : 1.0f;
    }
}

/* f32 only: r_i and delta_i from the recomputed scores (docs/algorithm.md section 3) */
template <typename T, bool VARLEN> __global__ void __launch_bounds__(kThreads) rowstats_kernel(const kparams kp) {
    extern __shared__ float smem[];
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const int Bt = p.tile, D = (int)p.D, ld = D + 1, ls = Bt + 1;
    const long long qt = blockIdx.x, h = blockIdx.y, b = sv.b(), hk = h / p.group, i0 = qt * Bt;
    if (VARLEN && i0 >= p.Nq) return;
    const int m = (int)min((long long)Bt, p.Nq - i0);
    float *Qs = smem, *dOs = Qs + Bt * ld, *Ks = dOs + Bt * ld, *Vs = Ks + Bt * ld, *S = Vs + Bt * ld, *dP = S + Bt * ls;
    float *lse = dP + Bt * ls, *sum_hi = lse + Bt, *sum_lo = sum_hi + Bt, *dot_hi = sum_lo + Bt, *dot_lo = dot_hi + Bt;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    load_rows<T>(Qs, ld, p.q, b, h, i0, m, D);
    load_rows<T>(dOs, ld, p.dout, b, h, i0, m, D);
    for (int r = threadIdx.x; r < m; r += blockDim.x)
        lse[r] = *row_of<float>(p.lse, b, h, i0 + r), sum_hi[r] = sum_lo[r] = dot_hi[r] = dot_lo[r] = 0.0f;
    int64_t kt0, kt1, rb, re;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, Bt, &kt0, &kt1);
    wa_nonempty_rows(&p.win, &rb, &re);
    for (long long kt = kt0; kt < kt1; kt++) {
        const long long j0 = kt * Bt;
        const int n = (int)min((long long)Bt, p.Nk - j0);
        const int edge = wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        __syncthreads();
        load_rows<T>(Ks, ld, p.k, b, hk, j0, n, D);
        load_rows<T>(Vs, ld, p.v, b, hk, j0, n, D);
        __syncthreads();
        for (int e = threadIdx.x; e < m * Bt; e += blockDim.x) {
            int r = e / Bt, c = e - r * Bt;
            float pv = 0.0f, dp = 0.0f;
            if (c < n && i0 + r >= rb && i0 + r < re) {
                pv = expf(score(p, Qs + r * ld, Ks + c * ld, i0 + r, j0 + c, edge) - lse[r]);
                dp = dot_rows(dOs + r * ld, Vs + c * ld, D);
            }
            S[r * ls + c] = pv, dP[r * ls + c] = dp;
        }
        __syncthreads();
        for (int r = warp; r < m; r += warps) {
            float s = 0.0f, t = 0.0f;
            for (int c = lane; c < Bt; c += 32) s += S[r * ls + c], t = fmaf(S[r * ls + c], dP[r * ls + c], t);
            s = warp_sum(s), t = warp_sum(t);
            if (lane == 0) pair_add(sum_hi[r], sum_lo[r], s), pair_add(dot_hi[r], dot_lo[r], t);
        }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < m; r += blockDim.x) {
        long long row = ws_head<VARLEN>(p, b, h, p.Nq) + i0 + r;
        /* rn = 0 for a sum of 0 or NaN is harmless: such a row's lse is -inf or NaN, so its P is NaN */
        const float sum = sum_hi[r] + sum_lo[r], rn = sum > 0.0f ? 1.0f / sum : 0.0f;
        p.rnorm[row] = rn;
        p.delta[row] = (dot_hi[r] + dot_lo[r]) * rn;
    }
}

/* owner of dK, dV for keys [j0, j0+n) of kv head hk */
template <typename T, bool VARLEN> __global__ void __launch_bounds__(kThreads) dkdv_kernel(const kparams kp) {
    extern __shared__ float smem[];
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const int Bt = p.tile, D = (int)p.D, ld = D + 1, ls = Bt + 1;
    const long long kt = blockIdx.x, hk = blockIdx.y, b = sv.b(), j0 = kt * Bt;
    if (VARLEN && j0 >= p.Nk) return;
    const int n = (int)min((long long)Bt, p.Nk - j0);
    /* dK and dV as pairs (pair_add): dk_hi, dk_lo, dv_hi, dv_lo, each [keys][D] */
    float *Ks = smem, *Vs = Ks + Bt * ld, *Qs = Vs + Bt * ld, *dOs = Qs + Bt * ld, *dk_hi = dOs + Bt * ld, *dk_lo = dk_hi + Bt * D;
    float *dv_hi = dk_lo + Bt * D, *dv_lo = dv_hi + Bt * D, *S = dv_lo + Bt * D, *dP = S + Bt * ls;
    row_stats rs = {dP + Bt * ls, dP + Bt * ls + Bt, dP + Bt * ls + 2 * Bt};
    const int with_rnorm = p.rnorm != nullptr;
    load_rows<T>(Ks, ld, p.k, b, hk, j0, n, D);
    load_rows<T>(Vs, ld, p.v, b, hk, j0, n, D);
    for (int e = threadIdx.x; e < Bt * D; e += blockDim.x) dk_hi[e] = dk_lo[e] = dv_hi[e] = dv_lo[e] = 0.0f;
    int64_t qt0, qt1;
    wa_query_tiles_for_cols(&p.win, j0, j0 + n, Bt, &qt0, &qt1);
    for (long long g = 0; g < p.group; g++) {
        const long long h = hk * p.group + g;
        for (long long qt = qt0; qt < qt1; qt++) {
            const long long i0 = qt * Bt;
            const int m = (int)min((long long)Bt, p.Nq - i0);
            __syncthreads(); /* previous Q, dO, S, dP are no longer read */
            load_rows<T>(Qs, ld, p.q, b, h, i0, m, D);
            load_rows<T>(dOs, ld, p.dout, b, h, i0, m, D);
            load_row_stats<VARLEN>(p, b, h, i0, m, rs, with_rnorm);
            __syncthreads();
            pair_grads(p, Qs, dOs, Ks, Vs, S, dP, i0, m, j0, n, rs, with_rnorm);
            __syncthreads();
            for (int e = threadIdx.x; e < n * D; e += blockDim.x) { /* dV += P^T dO, dK += dS^T Q */
                int c = e / D, d = e - c * D;
                float pv = 0.0f, pk = 0.0f;
                for (int r = 0; r < m; r++) {
                    pv = fmaf(S[r * ls + c], dOs[r * ld + d], pv);
                    pk = fmaf(dP[r * ls + c], Qs[r * ld + d], pk);
                }
                pair_add(dv_hi[e], dv_lo[e], pv);
                pair_add(dk_hi[e], dk_lo[e], pk);
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
        int c = e / D, d = e - c * D;
        row_of<T>(p.dk, b, hk, j0 + c)[d] = from_f32<T>(dk_hi[e] + dk_lo[e]);
        row_of<T>(p.dv, b, hk, j0 + c)[d] = from_f32<T>(dv_hi[e] + dv_lo[e]);
    }
}

/* owner of dQ for rows [i0, i0+m) of query head h */
template <typename T, bool VARLEN> __global__ void __launch_bounds__(kThreads) dq_kernel(const kparams kp) {
    extern __shared__ float smem[];
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const int Bt = p.tile, D = (int)p.D, ld = D + 1, ls = Bt + 1;
    const long long qt = blockIdx.x, h = blockIdx.y, b = sv.b(), hk = h / p.group, i0 = qt * Bt;
    if (VARLEN && i0 >= p.Nq) return;
    const int m = (int)min((long long)Bt, p.Nq - i0);
    float *Qs = smem, *dOs = Qs + Bt * ld, *Ks = dOs + Bt * ld, *Vs = Ks + Bt * ld, *dq_hi = Vs + Bt * ld, *dq_lo = dq_hi + Bt * D;
    float *S = dq_lo + Bt * D, *dP = S + Bt * ls;
    row_stats rs = {dP + Bt * ls, dP + Bt * ls + Bt, dP + Bt * ls + 2 * Bt};
    const int with_rnorm = p.rnorm != nullptr;
    load_rows<T>(Qs, ld, p.q, b, h, i0, m, D);
    load_rows<T>(dOs, ld, p.dout, b, h, i0, m, D);
    load_row_stats<VARLEN>(p, b, h, i0, m, rs, with_rnorm);
    for (int e = threadIdx.x; e < Bt * D; e += blockDim.x) dq_hi[e] = dq_lo[e] = 0.0f;
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, Bt, &kt0, &kt1);
    for (long long kt = kt0; kt < kt1; kt++) {
        const long long j0 = kt * Bt;
        const int n = (int)min((long long)Bt, p.Nk - j0);
        __syncthreads();
        load_rows<T>(Ks, ld, p.k, b, hk, j0, n, D);
        load_rows<T>(Vs, ld, p.v, b, hk, j0, n, D);
        __syncthreads();
        pair_grads(p, Qs, dOs, Ks, Vs, S, dP, i0, m, j0, n, rs, with_rnorm);
        __syncthreads();
        for (int e = threadIdx.x; e < m * D; e += blockDim.x) { /* dQ += dS K */
            int r = e / D, d = e - r * D;
            float part = 0.0f;
            for (int c = 0; c < n; c++) part = fmaf(dP[r * ls + c], Ks[c * ld + d], part);
            pair_add(dq_hi[e], dq_lo[e], part);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < m * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        row_of<T>(p.dq, b, h, i0 + r)[d] = from_f32<T>(dq_hi[e] + dq_lo[e]);
    }
}

/* ---- host side: the device ---- */

/* What a device is, read once per device (a device from kMaxDevices on: every call): its compute
 * capability (10 major + minor), the shared memory a block may opt in to, its SMs, and whether the
 * sm_90a kernels are the code loaded there (hopper_code_loaded, fwd_hopper.cu) */
struct device_facts {
    int cc, smem_optin, sms, hopper_code;
};
constexpr int kMaxDevices = 64;

/* dev must be the current device (hopper_code_loaded asks about it) */
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
    f->cc = 10 * major + minor, f->smem_optin = optin, f->sms = sms, f->hopper_code = hopper_code_loaded();
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
 * running the sm_90a build gets every version; 8.x, and any other 8.0-or-newer GPU (Blackwell's
 * 10.x and 12.x, which run the compute_80 PTX through the driver's JIT: mma.sync, cp.async and
 * ldmatrix are all they need), the mma.sync kernels where their shared memory fits; so does a 9.0
 * GPU whose driver JIT-compiled the PTX (CUDA_FORCE_PTX_JIT=1), where the Hopper kernels are stubs.
 * WINATTN_CUDA, read per call, selects paths for comparisons (dev/cuda) and for checking on one GPU
 * what another runs:
 *   v1     every call on version 1;
 *   mma    no wgmma kernel: versions 2 and 5's mma.sync kernels, version 1 for the rest;
 *   sm80   what a compute-capability 8.0 GPU runs: mma, with no more than 163 KB a block;
 *   sm86   what 8.6 and 8.9 run: mma with 99 KB;
 *   v3     version 3's forward at D = 256 instead of version 4 (hopper_prims.cuh);
 *   v4a    version 4's forward without the in-warpgroup overlap (fwd_hopper.cu). */
static wa_status cuda_target_now(cuda_target *t) {
    int dev = 0;
    CUDA_TRY(cudaGetDevice(&dev));
    device_facts f;
    const wa_status st = device_facts_of(dev, &f);
    if (st != WA_OK) return st;
    if (f.cc < 80)
        return wa_fail(WA_ERR_UNSUPPORTED, "CUDA device %d has compute capability %d.%d; winattn's kernels need 8.0 or newer", dev,
                       f.cc / 10, f.cc % 10);
    const char *force = getenv("WINATTN_CUDA");
    const bool sm80 = force && !strcmp(force, "sm80"), sm86 = force && !strcmp(force, "sm86");
    t->tensor_cores = !(force && !strcmp(force, "v1"));
    t->hopper = f.hopper_code && !(force && !strcmp(force, "mma")) && !sm80 && !sm86;
    t->smem_optin = (size_t)f.smem_optin;
    t->sms = f.sms;
    if (sm80 || sm86) t->smem_optin = std::min(t->smem_optin, sm80 ? kSmemSm80 : kSmemSm86);
    return WA_OK;
}

/* ---- host side: version 1 ---- */

/* Version 1's four kernels, each with its own tile: the dK/dV kernel holds four [keys][D]
 * accumulators (dK and dV as compensated pairs), so it is the first to be halved (on the H200:
 * 16 rows at D = 218 to 256, where the others keep 32, and 8 at D = 449 to 512, where they keep
 * 16) */
enum v1_kernel_kind { V1_FORWARD, V1_ROWSTATS, V1_DKDV, V1_DQ, V1_KINDS };

/* shared-memory bytes of each kernel, matching the carving at the top of each */
static size_t v1_smem(v1_kernel_kind kind, int Bt, int D) {
    const size_t rows = (size_t)Bt * (D + 1), acc = (size_t)Bt * D, scores = (size_t)Bt * (Bt + 1);
    switch (kind) {
    case V1_FORWARD: return sizeof(float) * (2 * rows + 3 * acc + scores + 4 * Bt); /* Q K; V, O pair; S; 4 row arrays */
    case V1_ROWSTATS: return sizeof(float) * (4 * rows + 2 * scores + 5 * Bt);      /* Q dO K V; S dP; lse, 2 pairs */
    case V1_DKDV: return sizeof(float) * (4 * rows + 4 * acc + 2 * scores + 3 * Bt); /* K V Q dO; dK, dV pairs; S dP; stats */
    default: return sizeof(float) * (4 * rows + 2 * acc + 2 * scores + 3 * Bt);      /* Q dO K V; dQ pair; S dP; stats */
    }
}

/* Rows per tile: 64 at D <= 64, 32 at D <= 256, 16 above, halved (down to 4) while the kernel
 * needs more shared memory than a block may have: e.g. dK/dV at D = 512 takes 8 rows on the H200
 * and on 8.0 (163 KB), 4 on 8.6 / 8.9 (99 KB). At 4 rows every kernel fits 99 KB at every D. */
static int tile_for(v1_kernel_kind kind, long long D, size_t smem_optin) {
    int Bt = D <= 64 ? 64 : D <= 256 ? 32 : 16;
    while (Bt > 4 && v1_smem(kind, Bt, (int)D) > smem_optin) Bt /= 2;
    return Bt;
}

/* the most any launch on a device with smem_optin asks for (at the tiles tile_for picks there) */
static size_t max_smem_bytes(size_t smem_optin) {
    size_t worst = 0;
    for (int k = 0; k < V1_KINDS; k++)
        for (int D = 1; D <= WA_MAX_HEAD_DIM; D++) {
            const v1_kernel_kind kind = (v1_kernel_kind)k;
            worst = std::max(worst, v1_smem(kind, tile_for(kind, D, smem_optin), D));
        }
    return std::min(worst, smem_optin);
}

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
    k.tile = k.n_qtiles = k.n_ktiles = 0; /* version 1's, set per kernel by for_kernel */
    return k;
}

/* kp with version 1's tile for `kind` and the tile counts that follow from it */
static kparams for_kernel(const kparams &kp, v1_kernel_kind kind, const cuda_target &t) {
    kparams k = kp;
    k.tile = tile_for(kind, kp.D, t.smem_optin);
    k.n_qtiles = (int)((kp.Nq + k.tile - 1) / k.tile);
    k.n_ktiles = (int)((kp.Nk + k.tile - 1) / k.tile);
    return k;
}

static cudaStream_t stream_of(const wa_context *ctx) { return (cudaStream_t)ctx->params.cuda_stream; }

/* The dynamic shared-memory limit is a property of each kernel, shared by every host thread.
 * Setting it per launch to that launch's size raced between threads with different sizes
 * (compute-sanitizer caught "too many resources requested"), so raise_smem_limits() raises it
 * once per device, for every kernel, to the largest size any head dim needs there (at the device's
 * own limit: WINATTN_CUDA=sm80 / sm86 pick tiles no larger); every launch asks for less. */

typedef void (*v1_kernel)(const kparams);
template <typename T> static cudaError_t raise_for_dtype(int bytes) {
    cudaError_t e = cudaSuccess;
    v1_kernel kernels[8] = {forward_kernel<T, false>, rowstats_kernel<T, false>, dkdv_kernel<T, false>, dq_kernel<T, false>,
                            forward_kernel<T, true>,  rowstats_kernel<T, true>,  dkdv_kernel<T, true>,  dq_kernel<T, true>};
    for (int i = 0; i < 8 && e == cudaSuccess; i++)
        e = cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    return e;
}

static wa_status raise_smem_limits(void) {
    static volatile unsigned long long done = 0; /* bit per device; racing first calls set the same values: harmless */
    int dev = 0;
    CUDA_TRY(cudaGetDevice(&dev));
    const unsigned long long bit = dev < 64 ? 1ull << dev : 0;
    if (done & bit) return WA_OK;
    device_facts f;
    const wa_status st = device_facts_of(dev, &f);
    if (st != WA_OK) return st;
    int bytes = (int)max_smem_bytes((size_t)f.smem_optin);
    CUDA_TRY(raise_for_dtype<float>(bytes));
    CUDA_TRY(raise_for_dtype<__half>(bytes));
    CUDA_TRY(raise_for_dtype<__nv_bfloat16>(bytes));
    done |= bit;
    return WA_OK;
}

/* rect on a (tiles, heads, B) grid, or varlen over the sequences of a varlen call (over_sequences) */
static wa_status launch(v1_kernel rect, v1_kernel varlen, unsigned tiles, unsigned heads, size_t smem, cudaStream_t stream,
                        const kparams &kp) {
    if (tiles == 0 || heads == 0) return WA_OK;
    wa_status st = raise_smem_limits();
    if (st != WA_OK) return st;
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        if (z == 0) return WA_OK;
        (c.cu_q ? varlen : rect)<<<dim3(tiles, heads, z), kThreads, smem, stream>>>(c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

static wa_status check_grid(const wa_problem *p) {
    if (p->Hq > 65535 || (p->B > 65535 && !p->cu_q)) /* varlen launches take the sequences in chunks */
        return wa_fail(WA_ERR_UNSUPPORTED, "CUDA backend: B = %lld and Hq = %lld must each be at most 65535", (long long)p->B,
                       (long long)p->Hq);
    if ((p->Nq + 3) / 4 > 0x7fffffff || (p->Nk + 3) / 4 > 0x7fffffff) /* tiles of 4 rows at the least */
        return wa_fail(WA_ERR_UNSUPPORTED, "CUDA backend: sequence too long");
    return WA_OK;
}

/* version 1's kernel at its smallest tile still needing more shared memory than the device has (a
 * device with less than 99 KB a block, none of 8.0 and up) */
static wa_status check_v1_fits(v1_kernel_kind kind, long long D, const cuda_target &t) {
    const int Bt = tile_for(kind, D, t.smem_optin);
    if (v1_smem(kind, Bt, (int)D) <= t.smem_optin) return WA_OK;
    return wa_fail(WA_ERR_UNSUPPORTED, "CUDA backend: D = %lld needs %zu bytes of shared memory a block, the device allows %zu", D,
                   v1_smem(kind, Bt, (int)D), t.smem_optin);
}

static wa_status context_workspace(wa_context *ctx, size_t bytes, cudaStream_t s, void **ws, int *owned);
static wa_status release_workspace(void *ws, int owned, cudaStream_t s, wa_status st);

/* varlen calls: the TMA kernels' per-sequence tensor maps (kparams.seq_maps), B × kMaxSeqMaps maps
 * of 128 bytes; nothing for rectangular calls */
static size_t seq_map_bytes(const wa_problem *p) { return p->cu_q ? (size_t)p->B * kMaxSeqMaps * kTensorMapBytes : 0; }

template <typename T> static wa_status forward_t(wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    kparams kp = params_of(p);
    if (mma_supports(p, t, 0)) {
        cudaStream_t s = stream_of(ctx);
        if (!seq_map_bytes(p) || !t.hopper) return mma_forward(kp, p->dtype, t, s);
        void *ws = nullptr;
        int owned = 0;
        wa_status st = context_workspace(ctx, seq_map_bytes(p), s, &ws, &owned);
        if (st != WA_OK) return st;
        kp.seq_maps = ws;
        return release_workspace(ws, owned, s, mma_forward(kp, p->dtype, t, s));
    }
    const wa_status st = check_v1_fits(V1_FORWARD, p->D, t);
    if (st != WA_OK) return st;
    const kparams kf = for_kernel(kp, V1_FORWARD, t);
    return launch(forward_kernel<T, false>, forward_kernel<T, true>, kf.n_qtiles, (unsigned)p->Hq,
                  v1_smem(V1_FORWARD, kf.tile, (int)p->D), stream_of(ctx), kf);
}

/* dQ by atomic adds (unless the context asks for determinism) where the tensor-core kernels have
 * that form: version 4 at D <= 128 (dQ fused into the dK/dV kernel) and version 2; version 4 at
 * D = 256 has none and stays deterministic, as does version 5 at D = 512 (its atomic form is a lab
 * build: no faster) */
static int atomic_dq(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    if (ctx->params.cuda_deterministic || !mma_supports(p, t, 1)) return 0;
    if (p->D == 512) return wide_backward_atomic_dq();
    const kparams kp = params_of(p);
    return !t.hopper || !hopper_backward_supports(kp) || hopper_backward_fuses_dq(kp);
}
/* the deterministic form where version 4 fuses dQ and the ordered form measured faster (D = 128,
 * rectangular calls; bwd_hopper.cu, WA_DQ_ORDERED): the fused kernel with
 * each 64 × 64 block's shares added in a fixed order, in place of the dQ kernel that forms S and dP
 * again; it needs the accumulator and a counter per block */
static int ordered_dq(const wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    if (!ctx->params.cuda_deterministic || !t.hopper || !mma_supports(p, t, 1)) return 0;
    const kparams kp = params_of(p);
    return hopper_backward_supports(kp) && hopper_backward_fuses_dq(kp) && hopper_backward_orders_dq(kp);
}

/* backward workspace: two arrays of rows (delta, then rnorm for f32 or lse2 for the version-4
 * backward), plus the f32 dQ accumulator of the atomic-dQ option (ws_rows × D). Rectangular: rows
 * padded to 64 per (b, h), as version 4 writes and adds whole 64-row tiles; varlen: packed by
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

template <typename T> static wa_status backward_t(wa_context *ctx, const wa_problem *p, const cuda_target &t) {
    kparams kp = params_of(p);
    cudaStream_t s = stream_of(ctx);
    size_t rows = (size_t)(p->B * p->Hq * p->Nq);
    int f32 = p->dtype == WA_F32, atomic = atomic_dq(ctx, p, t), ordered = ordered_dq(ctx, p, t), tensor_cores = mma_supports(p, t, 1);
    for (int k = V1_ROWSTATS; k < V1_KINDS && !tensor_cores; k++) {
        const wa_status fits = check_v1_fits((v1_kernel_kind)k, p->D, t);
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
    wa_status st = WA_OK;
    if (tensor_cores) {
        st = mma_backward(kp, p->dtype, t, s); /* version 4 (bwd_hopper.cu), 5 (bwd_wide.cu) or 2 (attn_mma.cu) */
    } else {
        const kparams kr = for_kernel(kp, V1_ROWSTATS, t), kk = for_kernel(kp, V1_DKDV, t), kq = for_kernel(kp, V1_DQ, t);
        if (f32) {
            st = launch(rowstats_kernel<T, false>, rowstats_kernel<T, true>, kr.n_qtiles, (unsigned)p->Hq,
                        v1_smem(V1_ROWSTATS, kr.tile, (int)p->D), s, kr);
        } else if (rows && !p->cu_q) {
            unsigned blocks = (unsigned)((rows + 255) / 256);
            delta_kernel<T, false><<<blocks < 65535u ? blocks : 65535u, 256, 0, s>>>(kp);
            cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess) st = wa_fail(WA_ERR_CUDA, "delta kernel launch: %s", cudaGetErrorString(e));
        } else if (rows) {
            st = over_sequences(kp, [&](const kparams &c, unsigned z) {
                delta_kernel<T, true><<<dim3((unsigned)((p->Nq + 255) / 256), (unsigned)p->Hq, z), 256, 0, s>>>(c);
                CUDA_TRY(cudaGetLastError());
                return WA_OK;
            });
        }
        if (st == WA_OK)
            st = launch(dkdv_kernel<T, false>, dkdv_kernel<T, true>, kk.n_ktiles, (unsigned)p->Hkv, v1_smem(V1_DKDV, kk.tile, (int)p->D),
                        s, kk);
        if (st == WA_OK)
            st = launch(dq_kernel<T, false>, dq_kernel<T, true>, kq.n_qtiles, (unsigned)p->Hq, v1_smem(V1_DQ, kq.tile, (int)p->D), s, kq);
    }
    return release_workspace(ws, owned, s, st);
}

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
    if (!backward) return mma_supports(p, t, 0) && t.hopper ? seq_map_bytes(p) : 0;
    return backward_workspace_bytes(ctx, p, t);
}

wa_status wa_cuda_forward(wa_context *ctx, const wa_problem *p) {
    wa_status st = check_grid(p);
    if (st != WA_OK || p->B == 0 || p->Hq == 0 || p->Nq == 0) return st;
    cuda_target t;
    if ((st = cuda_target_now(&t)) != WA_OK) return st;
    switch (p->dtype) {
    case WA_F32: return forward_t<float>(ctx, p, t);
    case WA_F16: return forward_t<__half>(ctx, p, t);
    case WA_BF16: return forward_t<__nv_bfloat16>(ctx, p, t);
    }
    return wa_fail(WA_ERR_DTYPE, "unknown dtype");
}

wa_status wa_cuda_backward(wa_context *ctx, const wa_problem *p) {
    wa_status st = check_grid(p);
    if (st != WA_OK || p->B == 0 || p->Hq == 0) return st;
    cuda_target t;
    if ((st = cuda_target_now(&t)) != WA_OK) return st;
    switch (p->dtype) {
    case WA_F32: return backward_t<float>(ctx, p, t);
    case WA_F16: return backward_t<__half>(ctx, p, t);
    case WA_BF16: return backward_t<__nv_bfloat16>(ctx, p, t);
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
