/* portable/attn.cu — the kernels that are correct for everything in docs/design.md section 1
 * (f32/f16/bf16, any D up to 512, windows, causal, GQA, Nq != Nk, softcap, empty rows, zero dK/dV
 * for unvisited keys) on CUDA cores, in linear memory, deterministic: the fallback for every call
 * the tensor-core kernels do not take (dispatch.cu decides).
 *
 * They mirror the CPU backend (src/cpu/attn_cpu.c, docs/algorithm.md) one CTA per tile:
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
 * partials in f64 (docs/algorithm.md section 6).
 *
 * Packed variable-length batches (wa_problem.cu_q): each kernel is compiled a second time with
 * VARLEN set: the grid is sized by B and the longest sequence (the offsets are never read on the
 * host), each CTA reads its sequence's offsets and sees that sequence alone (seq_view,
 * common.cuh), and CTAs past their sequence's end leave at once.
 */
#include "../common.cuh"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

static const int kThreads = kPortableThreads;

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

/* ---- host side ---- */

/* The four kernels, each with its own tile: the dK/dV kernel holds four [keys][D]
 * accumulators (dK and dV as compensated pairs), so it is the first to be halved (with Hopper's
 * 227 KB a block: 16 rows at D = 218 to 256, where the others keep 32, and 8 at D = 449 to 512,
 * where they keep 16) */
enum kernel_kind { K_FORWARD, K_ROWSTATS, K_DKDV, K_DQ, K_KINDS };

/* shared-memory bytes of each kernel, matching the carving at the top of each */
static size_t smem_bytes(kernel_kind kind, int Bt, int D) {
    const size_t rows = (size_t)Bt * (D + 1), acc = (size_t)Bt * D, scores = (size_t)Bt * (Bt + 1);
    switch (kind) {
    case K_FORWARD: return sizeof(float) * (2 * rows + 3 * acc + scores + 4 * Bt); /* Q K; V, O pair; S; 4 row arrays */
    case K_ROWSTATS: return sizeof(float) * (4 * rows + 2 * scores + 5 * Bt);      /* Q dO K V; S dP; lse, 2 pairs */
    case K_DKDV: return sizeof(float) * (4 * rows + 4 * acc + 2 * scores + 3 * Bt); /* K V Q dO; dK, dV pairs; S dP; stats */
    default: return sizeof(float) * (4 * rows + 2 * acc + 2 * scores + 3 * Bt);      /* Q dO K V; dQ pair; S dP; stats */
    }
}

/* Rows per tile: 64 at D <= 64, 32 at D <= 256, 16 above, halved (down to 4) while the kernel
 * needs more shared memory than a block may have: e.g. dK/dV at D = 512 takes 8 rows on Hopper
 * and on 8.0 (163 KB), 4 on 8.6 / 8.9 (99 KB). At 4 rows every kernel fits 99 KB at every D. */
static int tile_for(kernel_kind kind, long long D, size_t smem_optin) {
    int Bt = D <= 64 ? 64 : D <= 256 ? 32 : 16;
    while (Bt > 4 && smem_bytes(kind, Bt, (int)D) > smem_optin) Bt /= 2;
    return Bt;
}

/* the most any launch on a device with smem_optin asks for (at the tiles tile_for picks there) */
static size_t max_smem_bytes(size_t smem_optin) {
    size_t worst = 0;
    for (int k = 0; k < K_KINDS; k++)
        for (int D = 1; D <= WA_MAX_HEAD_DIM; D++) {
            const kernel_kind kind = (kernel_kind)k;
            worst = std::max(worst, smem_bytes(kind, tile_for(kind, D, smem_optin), D));
        }
    return std::min(worst, smem_optin);
}

/* kp with the tile for `kind` and the tile counts that follow from it */
static kparams for_kernel(const kparams &kp, kernel_kind kind, const cuda_target &t) {
    kparams k = kp;
    k.tile = tile_for(kind, kp.D, t.smem_optin);
    k.n_qtiles = (int)((kp.Nq + k.tile - 1) / k.tile);
    k.n_ktiles = (int)((kp.Nk + k.tile - 1) / k.tile);
    return k;
}


/* The dynamic shared-memory limit is a property of each kernel, shared by every host thread.
 * Setting it per launch to that launch's size raced between threads with different sizes
 * (compute-sanitizer caught "too many resources requested"), so raise_smem_limits() raises it
 * once per device, for every kernel, to the largest size any head dim needs there (at the device's
 * own limit: WINATTN_CUDA=sm80 / sm86 pick tiles no larger); every launch asks for less. */

typedef void (*kernel_fn)(const kparams);
template <typename T> static cudaError_t raise_for_dtype(int bytes) {
    cudaError_t e = cudaSuccess;
    kernel_fn kernels[8] = {forward_kernel<T, false>, rowstats_kernel<T, false>, dkdv_kernel<T, false>, dq_kernel<T, false>,
                            forward_kernel<T, true>,  rowstats_kernel<T, true>,  dkdv_kernel<T, true>,  dq_kernel<T, true>};
    for (int i = 0; i < 8 && e == cudaSuccess; i++)
        e = cudaFuncSetAttribute(kernels[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    return e;
}

static wa_status raise_smem_limits(const cuda_target &t) {
    static volatile unsigned long long done = 0; /* bit per device; racing first calls set the same values: harmless */
    int dev = 0;
    CUDA_TRY(cudaGetDevice(&dev));
    const unsigned long long bit = dev < 64 ? 1ull << dev : 0;
    if (done & bit) return WA_OK;
    int bytes = (int)max_smem_bytes(t.smem_device);
    CUDA_TRY(raise_for_dtype<float>(bytes));
    CUDA_TRY(raise_for_dtype<__half>(bytes));
    CUDA_TRY(raise_for_dtype<__nv_bfloat16>(bytes));
    done |= bit;
    return WA_OK;
}

/* rect on a (tiles, heads, B) grid, or varlen over the sequences of a varlen call (over_sequences) */
static wa_status launch(kernel_fn rect, kernel_fn varlen, unsigned tiles, unsigned heads, size_t smem, const cuda_target &t,
                        cudaStream_t stream, const kparams &kp) {
    if (tiles == 0 || heads == 0) return WA_OK;
    wa_status st = raise_smem_limits(t);
    if (st != WA_OK) return st;
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        if (z == 0) return WA_OK;
        (c.cu_q ? varlen : rect)<<<dim3(tiles, heads, z), kThreads, smem, stream>>>(c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

/* WA_ERR_UNSUPPORTED when the kernel at its smallest tile still needs more shared memory than the
 * device allows (a device with less than 99 KB a block, none of 8.0 and up) */
static wa_status check_fits(kernel_kind kind, long long D, const cuda_target &t) {
    const int Bt = tile_for(kind, D, t.smem_optin);
    if (smem_bytes(kind, Bt, (int)D) <= t.smem_optin) return WA_OK;
    return wa_fail(WA_ERR_UNSUPPORTED, "CUDA backend: D = %lld needs %zu bytes of shared memory a block, the device allows %zu", D,
                   smem_bytes(kind, Bt, (int)D), t.smem_optin);
}

wa_status portable_check_fits(long long D, int backward, size_t smem_optin) {
    cuda_target t = {};
    t.smem_optin = smem_optin;
    if (!backward) return check_fits(K_FORWARD, D, t);
    for (int k = K_ROWSTATS; k < K_KINDS; k++) {
        const wa_status fits = check_fits((kernel_kind)k, D, t);
        if (fits != WA_OK) return fits;
    }
    return WA_OK;
}

template <typename T> static wa_status forward_t(const kparams &kp, const cuda_target &t, cudaStream_t s) {
    const kparams kf = for_kernel(kp, K_FORWARD, t);
    return launch(forward_kernel<T, false>, forward_kernel<T, true>, kf.n_qtiles, (unsigned)kp.Hq, smem_bytes(K_FORWARD, kf.tile, (int)kp.D),
                  t, s, kf);
}

template <typename T> static wa_status backward_t(const kparams &kp, bool f32, const cuda_target &t, cudaStream_t s) {
    const size_t rows = (size_t)(kp.B * kp.Hq * kp.Nq);
    const kparams kr = for_kernel(kp, K_ROWSTATS, t), kk = for_kernel(kp, K_DKDV, t), kq = for_kernel(kp, K_DQ, t);
    wa_status st = WA_OK;
    if (f32) {
        st = launch(rowstats_kernel<T, false>, rowstats_kernel<T, true>, kr.n_qtiles, (unsigned)kp.Hq,
                    smem_bytes(K_ROWSTATS, kr.tile, (int)kp.D), t, s, kr);
    } else if (rows && !kp.cu_q) {
        unsigned blocks = (unsigned)((rows + 255) / 256);
        delta_kernel<T, false><<<blocks < 65535u ? blocks : 65535u, 256, 0, s>>>(kp);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) st = wa_fail(WA_ERR_CUDA, "delta kernel launch: %s", cudaGetErrorString(e));
    } else if (rows) {
        st = over_sequences(kp, [&](const kparams &c, unsigned z) {
            delta_kernel<T, true><<<dim3((unsigned)((kp.Nq + 255) / 256), (unsigned)kp.Hq, z), 256, 0, s>>>(c);
            CUDA_TRY(cudaGetLastError());
            return WA_OK;
        });
    }
    if (st == WA_OK)
        st = launch(dkdv_kernel<T, false>, dkdv_kernel<T, true>, kk.n_ktiles, (unsigned)kp.Hkv, smem_bytes(K_DKDV, kk.tile, (int)kp.D), t,
                    s, kk);
    if (st == WA_OK)
        st = launch(dq_kernel<T, false>, dq_kernel<T, true>, kq.n_qtiles, (unsigned)kp.Hq, smem_bytes(K_DQ, kq.tile, (int)kp.D), t, s, kq);
    return st;
}

wa_status portable_forward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s) {
    switch (dt) {
    case WA_F32: return forward_t<float>(kp, t, s);
    case WA_F16: return forward_t<__half>(kp, t, s);
    case WA_BF16: return forward_t<__nv_bfloat16>(kp, t, s);
    }
    return wa_fail(WA_ERR_DTYPE, "unknown dtype");
}

wa_status portable_backward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s) {
    switch (dt) {
    case WA_F32: return backward_t<float>(kp, true, t, s);
    case WA_F16: return backward_t<__half>(kp, false, t, s);
    case WA_BF16: return backward_t<__nv_bfloat16>(kp, false, t, s);
    }
    return wa_fail(WA_ERR_DTYPE, "unknown dtype");
}
