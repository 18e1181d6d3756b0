/* test_nonfinite.c — a NaN or an infinity in q, k, v or do_ reaches exactly the outputs that
 * depend on it through visible pairs, and nothing else: not other rows, heads or batch entries,
 * not keys outside a row's window (in a plain GEMM a masked probability 0 times a NaN in v is
 * NaN), and the finite results of everything else do not change.
 *
 * Each plant is one value (NaN, +inf, -inf) at one element of one input. Expected, per output
 * element (o, lse, dq, dk, dv), from the float64 oracle, which sums over visible pairs only:
 *   - the dependency set: the elements the oracle changes when the same element is perturbed by a
 *     finite amount instead, and those it makes non-finite (a row that sees one key has o = v
 *     whatever q is, but a NaN in q is a NaN in its probability);
 *   - inside it, non-finite exactly where the oracle with the planted value is non-finite;
 *   - outside it, bit for bit the output of the same path without the plant.
 * Paths: the tiled kernels on every ISA this CPU runs (WINATTN_ISA, as in test_kernels.c) with
 * two tile configurations, and the dense path; f32, f16, bf16; B = 2, GQA 2; windows causal,
 * sliding, two-sided, one key, unbounded, Nq > Nk (rows that see no key) and Nq < Nk (keys no
 * query sees), and a softcap (which maps an infinite score to a finite one).
 *
 * CUDA, where a GPU is present: the same shapes at D = 40 (version 1) and at D = 64 to 512 (f16 and
 * bf16 take the tensor-core kernels), held to what include/winattn.h promises there. A tile product
 * multiplies a masked probability 0 by every key of the tile, so a plant may also make non-finite
 * outputs of its own batch entry and KV-head group that the oracle keeps finite; so: outside the
 * plant's (batch entry, KV head group), bit for bit the output without it; inside, non-finite
 * wherever the oracle is, and an output the oracle says is independent of the plant either
 * unchanged or non-finite (never another finite value). Every call returns. */
#define _GNU_SOURCE
#include "check.h"
#include "internal.h"
#include "ref/oracle.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, HQ = 4, HKV = 2 };

typedef struct shape {
    int64_t Nq, Nk, left, right, D;
    float softcap;
    const char *what;
} shape;

/* every path */
static const shape shapes[] = {
    {150, 150, -1, 0, 40, 0, "causal"},
    {150, 150, 20, 0, 40, 0, "sliding 21"},
    {150, 150, 10, 5, 40, 0, "two-sided"},
    {150, 150, 0, 0, 40, 0, "one key"},
    {150, 150, -1, -1, 40, 0, "unbounded"},
    {170, 100, -1, 0, 40, 0, "Nq > Nk, empty rows"},
    {100, 170, 30, 0, 40, 0, "Nq < Nk, unseen keys"},
    {150, 150, 40, 0, 40, 5.0f, "sliding 41, softcap 5"},
};
/* CUDA only: the head dims of the tensor-core kernels (f16 and bf16; f32 runs version 1 there) */
static const shape cuda_shapes[] = {
    {150, 150, -1, 0, 64, 0, "causal"},
    {150, 150, 20, 0, 128, 0, "sliding 21"},
    {150, 150, 10, 5, 64, 0, "two-sided"},
    {150, 150, 0, 0, 128, 0, "one key"},
    {170, 100, -1, 0, 64, 0, "Nq > Nk, empty rows"},
    {100, 170, 30, 0, 128, 0, "Nq < Nk, unseen keys"},
    {150, 150, 40, 0, 64, 5.0f, "sliding 41, softcap 5"},
    {150, 150, 60, 0, 256, 0, "sliding 61"},
    {150, 150, -1, 0, 512, 0, "causal"},
};

static const int tile_configs[2][2] = {{64, 64}, {16, 48}};
static const char *const isas[] = {"avx512bf16", "avx512", "avx2", "neon", "generic"};
enum { n_isas = sizeof isas / sizeof *isas };

enum { T_Q, T_K, T_V, T_DO };
static const char *const tensor_names[] = {"q", "k", "v", "do_"};
static const char *const value_names[] = {"nan", "+inf", "-inf"};
static const char *const out_names[] = {"o", "lse", "dq", "dk", "dv"};
static const char *const dtype_names[] = {"f32", "f16", "bf16"};

typedef struct plant {
    int tensor, value;
    int64_t b, h, row, d;
} plant;

/* the inputs of one case, in the dtype, contiguous [B, H, N, D] */
typedef struct inputs {
    wa_dtype dt;
    const shape *s;
    void *x[4]; /* q, k, v, do_ */
    size_t n[4];
} inputs;

/* the five outputs as doubles, contiguous */
typedef struct outs {
    double *v[5];
    size_t n[5];
} outs;

static size_t es(wa_dtype dt) { return dt == WA_F32 ? 4 : 2; }

static void outs_alloc(outs *o, const shape *s) {
    size_t nq = (size_t)(B * HQ * s->Nq * s->D), nk = (size_t)(B * HKV * s->Nk * s->D);
    size_t n[5] = {nq, (size_t)(B * HQ * s->Nq), nq, nk, nk};
    for (int t = 0; t < 5; t++) o->n[t] = n[t], o->v[t] = malloc(n[t] * sizeof(double) + 8);
}
static void outs_free(outs *o) {
    for (int t = 0; t < 5; t++) free(o->v[t]);
}

static wa_tensor tensor_of(const inputs *in, int t) {
    const shape *s = in->s;
    int64_t H = t == T_K || t == T_V ? HKV : HQ, N = t == T_K || t == T_V ? s->Nk : s->Nq;
    return wa_tensor_bhnd(in->x[t], in->dt, B, H, N, s->D);
}

static size_t plant_index(const inputs *in, const plant *pl) {
    int kv = pl->tensor == T_K || pl->tensor == T_V;
    int64_t H = kv ? HKV : HQ, N = kv ? in->s->Nk : in->s->Nq;
    return (size_t)(((pl->b * H + pl->h) * N + pl->row) * in->s->D + pl->d);
}

/* Element i of a buffer of dtype dt as raw bits (the low 16 for f16 and bf16). */
static uint32_t get_bits(wa_dtype dt, const void *x, size_t i) {
    uint32_t u = 0;
    if (dt == WA_F32) memcpy(&u, (const float *)x + i, 4);
    else u = ((const uint16_t *)x)[i];
    return u;
}
static void set_bits(wa_dtype dt, void *x, size_t i, uint32_t u) {
    if (dt == WA_F32) memcpy((float *)x + i, &u, 4);
    else ((uint16_t *)x)[i] = (uint16_t)u;
}
/* NaN, +inf, -inf in the dtype */
static uint32_t nonfinite_bits(wa_dtype dt, int value) {
    static const uint32_t bits[3][3] = {{0x7FC00000u, 0x7F800000u, 0xFF800000u}, /* f32 */
                                        {0x7E00u, 0x7C00u, 0xFC00u},             /* f16 */
                                        {0x7FC0u, 0x7F80u, 0xFF80u}};            /* bf16 */
    return bits[dt][value];
}
/* a finite neighbour: the top mantissa bit flipped (a normal stays normal and finite) */
static uint32_t perturbed_bits(wa_dtype dt, uint32_t u) {
    return u ^ (dt == WA_F32 ? 0x00400000u : dt == WA_F16 ? 0x0200u : 0x0040u);
}

static void oracle(const inputs *in, outs *o) {
    const shape *s = in->s;
    double *x[4];
    for (int t = 0; t < 4; t++) {
        wa_tensor tt = tensor_of(in, t);
        x[t] = malloc(in->n[t] * sizeof(double));
        wa_tensor_to_f64(&tt, x[t]);
    }
    wa_oracle_shape os = {B, HQ, HKV, s->Nq, s->Nk, s->D, (double)(float)(1.0 / sqrt((double)s->D)), s->softcap,
                          {s->Nq, s->Nk, s->left, s->right}};
    wa_oracle(&os, x[T_Q], x[T_K], x[T_V], x[T_DO], o->v[0], o->v[1], o->v[2], o->v[3], o->v[4]);
    for (int t = 0; t < 4; t++) free(x[t]);
}

/* where a case runs: the tiled kernels on a CPU ISA with a tile configuration, the dense path, or
 * the CUDA backend's own choice of kernels */
typedef struct path {
    const char *isa; /* NULL: dense, or CUDA */
    int cfg;
    wa_device dev;
} path;

/* A call's buffers on device dev: on the CPU the host buffers themselves; on CUDA device copies
 * of the n host buffers, those marked in `copied_in` (bit i for buffer i) copied in. 0 if an
 * allocation or copy failed (buf then holds what was made; free_buffers takes it). */
static int buffers_on(wa_context *ctx, wa_device dev, void *const *host, const size_t *sizes, int n, unsigned copied_in,
                      void **buf) {
    for (int i = 0; i < n; i++) {
        if (dev != WA_DEVICE_CUDA) buf[i] = host[i];
        else if (wa_malloc(ctx, WA_DEVICE_CUDA, sizes[i], &buf[i]) != WA_OK ||
                 ((copied_in >> i & 1u) && wa_memcpy(ctx, buf[i], WA_DEVICE_CUDA, host[i], WA_DEVICE_CPU, sizes[i]) != WA_OK))
            return 0;
    }
    return 1;
}
/* on CUDA the buffers marked in `outputs` (bit i for buffer i) copied back to their host buffers; 0 if a copy failed */
static int copy_back(wa_context *ctx, wa_device dev, void *const *host, const size_t *sizes, int n, unsigned outputs,
                     void *const *buf) {
    for (int i = 0; i < n && dev == WA_DEVICE_CUDA; i++)
        if ((outputs >> i & 1u) && wa_memcpy(ctx, host[i], WA_DEVICE_CPU, buf[i], WA_DEVICE_CUDA, sizes[i]) != WA_OK) return 0;
    return 1;
}
static void free_buffers(wa_context *ctx, wa_device dev, void *const *buf, int n) {
    for (int i = 0; i < n && dev == WA_DEVICE_CUDA; i++)
        if (buf[i]) wa_free_memory(ctx, WA_DEVICE_CUDA, buf[i]);
}

/* forward then backward on one path; 0 and a message if a call fails. CUDA: the inputs copied to
 * the device, the outputs back. */
static int run_path(const inputs *in, const path *pa, outs *o, char *err, size_t nerr) {
    const shape *s = in->s;
    const int64_t D = s->D;
    const int cuda = pa->dev == WA_DEVICE_CUDA;
    wa_context_params cp = {0};
    cp.threads = 2;
    if (pa->isa) {
        setenv("WINATTN_ISA", pa->isa, 1);
        cp.tile_q = tile_configs[pa->cfg][0], cp.tile_k = tile_configs[pa->cfg][1];
    } else if (!cuda) {
        unsetenv("WINATTN_ISA"); /* the dense path's GEMMs on the best ISA */
        cp.algorithm = WA_ALGO_DENSE;
    }
    cp.cuda_deterministic = 1; /* the atomic dQ's last bits vary run to run; the test compares bits */
    wa_context *ctx;
    if (wa_context_create(&cp, &ctx) != WA_OK) {
        snprintf(err, nerr, "context: %s", wa_last_error());
        return 0;
    }
    size_t nq = (size_t)(B * HQ * s->Nq * D), nk = (size_t)(B * HKV * s->Nk * D), e = es(in->dt);
    size_t nlse = (size_t)(B * HQ * s->Nq), sizes[9] = {nq * e, nk * e, nk * e, nq * e, nq * e, nlse * 4, nq * e, nk * e, nk * e};
    /* q, k, v, do_, then o, lse, dq, dk, dv: host buffers, and on CUDA device ones */
    void *host[9] = {in->x[T_Q], in->x[T_K], in->x[T_V], in->x[T_DO]}, *buf[9] = {0};
    for (int i = 4; i < 9; i++) host[i] = malloc(sizes[i]);
    int ok = buffers_on(ctx, pa->dev, host, sizes, 9, 0x0Fu, buf);
    if (ok) {
        wa_tensor x[9];
        for (int i = 0; i < 9; i++) {
            const int kv = i == 1 || i == 2 || i == 7 || i == 8;
            x[i] = i == 5 ? wa_tensor_lse(buf[i], B, HQ, s->Nq)
                          : wa_tensor_bhnd(buf[i], in->dt, B, kv ? HKV : HQ, kv ? s->Nk : s->Nq, D);
            x[i].device = pa->dev;
        }
        wa_attn_desc desc = {0, s->softcap, s->left, s->right};
        ok = wa_forward(ctx, &desc, &x[0], &x[1], &x[2], &x[4], &x[5]) == WA_OK &&
             wa_backward(ctx, &desc, &x[0], &x[1], &x[2], &x[4], &x[5], &x[3], &x[6], &x[7], &x[8]) == WA_OK;
        ok = ok && copy_back(ctx, pa->dev, host, sizes, 9, 0x1F0u, buf);
        for (int i = 4; i < 9 && ok; i++) {
            wa_tensor h = x[i];
            h.data = host[i], h.device = WA_DEVICE_CPU;
            wa_tensor_to_f64(&h, o->v[i - 4]);
        }
    }
    if (!ok) snprintf(err, nerr, "%s", wa_last_error());
    free_buffers(ctx, pa->dev, buf, 9);
    for (int i = 4; i < 9; i++) free(host[i]);
    wa_context_destroy(ctx);
    return ok;
}

/* the (batch entry, KV head) of element i of output t */
static void group_of(const shape *s, int t, size_t i, int64_t *b, int64_t *hk) {
    const int kv = t == 3 || t == 4;
    const int64_t H = kv ? HKV : HQ, N = kv ? s->Nk : s->Nq, per_head = t == 1 ? N : N * s->D;
    const int64_t bh = (int64_t)i / per_head, h = bh % H;
    *b = bh / H, *hk = kv ? h : h / (HQ / HKV);
}

/* element i of output t: 0 if as expected, else a description in msg. `relaxed` (CUDA): inside the
 * plant's (batch entry, KV head group) an independent output may also be non-finite, and a
 * dependent one may be non-finite where the oracle is finite (the file's comment). */
static int judge(const outs *got, const outs *clean, const outs *want, const outs *dep_a, const outs *dep_b, int t,
                 size_t i, int relaxed, int in_group, char *msg, size_t n) {
    int dep = (!(dep_a->v[t][i] == dep_b->v[t][i]) && !(isnan(dep_a->v[t][i]) && isnan(dep_b->v[t][i]))) ||
              !isfinite(want->v[t][i]);
    double g = got->v[t][i];
    const int leak_allowed = relaxed && in_group;
    if (!dep) {
        if (g == clean->v[t][i] || (isnan(g) && isnan(clean->v[t][i])) || (leak_allowed && !isfinite(g))) return 0;
        snprintf(msg, n, "%s[%zu] = %g, independent of the plant, but %g without it", out_names[t], i, g,
                 clean->v[t][i]);
        return 1;
    }
    if (!isfinite(g) == !isfinite(want->v[t][i]) || (leak_allowed && !isfinite(g))) return 0;
    snprintf(msg, n, "%s[%zu] = %g where the oracle has %g", out_names[t], i, g, want->v[t][i]);
    return 1;
}

/* a position in [0, n): uniform enough for picking where to plant */
static int64_t draw(wa_rng *g, int64_t n) { return (int64_t)(fabs(wa_rng_normal(g)) * 1e6) % n; }

/* one (dtype, shape): plants, the oracle, every path (cpu: the CPU ones; cuda: the CUDA one) */
static void run_shape(wa_dtype dt, const shape *s, uint64_t seed, int cpu, int cuda) {
    const int64_t D = s->D;
    inputs in = {dt, s, {0}, {0}};
    wa_rng g;
    wa_rng_seed(&g, seed);
    for (int t = 0; t < 4; t++) {
        int kv = t == T_K || t == T_V;
        in.n[t] = (size_t)(B * (kv ? HKV : HQ) * (kv ? s->Nk : s->Nq) * D);
        in.x[t] = malloc(in.n[t] * es(dt));
        wa_fill_normal(in.x[t], dt, in.n[t], &g, 1.0);
    }
    /* plants: every tensor and value, once at a row on either side of a tile boundary (of both
     * tile configurations) or at an end, once at a random row */
    enum { per = 2 };
    plant plants[4 * 3 * per];
    int np = 0;
    for (int t = 0; t < 4; t++)
        for (int v = 0; v < 3; v++)
            for (int k = 0; k < per; k++) {
                int kv = t == T_K || t == T_V;
                int64_t N = kv ? s->Nk : s->Nq;
                const int64_t edges[12] = {0, 15, 16, 47, 48, 63, 64, 95, 96, 127, 128, N - 1};
                int64_t row = k == 0 ? edges[t * 3 + v] % N : draw(&g, N);
                plants[np++] = (plant){t, v, draw(&g, B), draw(&g, kv ? HKV : HQ), row, draw(&g, D)};
            }

    /* paths: (isa, tiles) for each ISA the CPU runs, dense (isa = NULL), CUDA */
    path paths[2 * n_isas + 2];
    int npaths = 0;
    for (int i = 0; i < n_isas && cpu; i++) {
        setenv("WINATTN_ISA", isas[i], 1);
        if (strcmp(wa_cpu_isa(), isas[i]) != 0) continue; /* test_kernels.c says SKIP for these */
        for (int c = 0; c < 2; c++) paths[npaths++] = (path){isas[i], c, WA_DEVICE_CPU};
    }
    if (cpu) paths[npaths++] = (path){NULL, 0, WA_DEVICE_CPU};
    if (cuda) paths[npaths++] = (path){NULL, 0, WA_DEVICE_CUDA};

    outs clean[2 * n_isas + 2], want, dep_a, dep_b, got;
    int failed[2 * n_isas + 2] = {0};
    char first[2 * n_isas + 2][300];
    char err[256];
    for (int p = 0; p < npaths; p++) {
        outs_alloc(&clean[p], s);
        first[p][0] = 0;
        if (!run_path(&in, &paths[p], &clean[p], err, sizeof err)) {
            failed[p] = 1;
            snprintf(first[p], sizeof first[p], "clean run: %s", err);
        }
    }
    outs_alloc(&want, s), outs_alloc(&dep_a, s), outs_alloc(&dep_b, s), outs_alloc(&got, s);
    oracle(&in, &dep_a);
    for (int k = 0; k < np; k++) {
        const plant *pl = &plants[k];
        size_t idx = plant_index(&in, pl);
        const int64_t plant_hk = pl->tensor == T_K || pl->tensor == T_V ? pl->h : pl->h / (HQ / HKV);
        uint32_t old = get_bits(dt, in.x[pl->tensor], idx);
        set_bits(dt, in.x[pl->tensor], idx, perturbed_bits(dt, old));
        oracle(&in, &dep_b);
        set_bits(dt, in.x[pl->tensor], idx, nonfinite_bits(dt, pl->value));
        oracle(&in, &want);
        for (int p = 0; p < npaths; p++) {
            if (failed[p]) continue;
            char what[300] = "";
            const int relaxed = paths[p].dev == WA_DEVICE_CUDA;
            if (!run_path(&in, &paths[p], &got, err, sizeof err)) {
                snprintf(what, sizeof what, "%s", err);
            } else {
                for (int t = 0; t < 5 && !what[0]; t++)
                    for (size_t i = 0; i < got.n[t]; i++) {
                        int64_t b, hk;
                        group_of(s, t, i, &b, &hk);
                        if (judge(&got, &clean[p], &want, &dep_a, &dep_b, t, i, relaxed, b == pl->b && hk == plant_hk, what,
                                  sizeof what))
                            break;
                    }
            }
            if (what[0]) {
                failed[p] = 1;
                snprintf(first[p], sizeof first[p], "%s at %s[b=%lld h=%lld row=%lld d=%lld]: %s", value_names[pl->value],
                         tensor_names[pl->tensor], (long long)pl->b, (long long)pl->h, (long long)pl->row,
                         (long long)pl->d, what);
            }
        }
        set_bits(dt, in.x[pl->tensor], idx, old);
    }
    for (int p = 0; p < npaths; p++) {
        char label[64];
        if (paths[p].isa)
            snprintf(label, sizeof label, "%s tiles=%dx%d", paths[p].isa, tile_configs[paths[p].cfg][0], tile_configs[paths[p].cfg][1]);
        else snprintf(label, sizeof label, "%s", paths[p].dev == WA_DEVICE_CUDA ? "cuda" : "dense");
        check(!failed[p], "nonfinite %s %s B=%d Hq=%d Hkv=%d Nq=%lld Nk=%lld D=%lld win=(%lld,%lld)%s [%s]: %d plants%s%s", label,
              dtype_names[dt], B, HQ, HKV, (long long)s->Nq, (long long)s->Nk, (long long)D, (long long)s->left, (long long)s->right,
              s->softcap > 0 ? " cap=5" : "", s->what, np, first[p][0] ? " : " : "", first[p]);
        outs_free(&clean[p]);
    }
    outs_free(&want), outs_free(&dep_a), outs_free(&dep_b), outs_free(&got);
    for (int t = 0; t < 4; t++) free(in.x[t]);
}

/* ---- varlen: a plant stays inside its own sequence ----
 *
 * Three sequences packed end to end, lengths that are no multiple of any tile, so that a kernel
 * loading the last tile of one sequence reaches into the rows of the next. Each plant sits at a
 * sequence's first or last row (the rows a neighbour's edge tile would touch); every output of the
 * other sequences must be bit for bit what it is without the plant, on every device (the
 * promise of include/winattn.h for varlen calls; inside the planted sequence the rectangular
 * cases above hold the rules). */
enum { VL_SEQS = 3 };
static const int32_t vl_lengths[VL_SEQS] = {70, 45, 150};

typedef struct vl_case {
    int64_t left, right, D;
    float softcap;
} vl_case;
static const vl_case vl_cases[] = {{-1, 0, 40, 0}, {-1, 0, 64, 0}, {40, 0, 128, 0}, {-1, -1, 64, 5.0f},
                                   {60, 0, 256, 0}, {-1, 0, 512, 0}, {30, 0, 512, 0}};

/* forward then backward of the packed batch x[0..3] (q, k, v, do_, [1, H, T, D]) into out[0..4]
 * (o, lse, dq, dk, dv, same layouts; lse [1, HQ, T]); 0 and a message if a call fails */
static int vl_run(wa_dtype dt, const vl_case *c, wa_device dev, void *const x[4], const int32_t *cu, int64_t T,
                  void *out[5], char *err, size_t nerr) {
    wa_context_params cp = {0};
    cp.threads = 2;
    cp.cuda_deterministic = 1;
    wa_context *ctx;
    if (wa_context_create(&cp, &ctx) != WA_OK) {
        snprintf(err, nerr, "context: %s", wa_last_error());
        return 0;
    }
    const size_t nq = (size_t)(HQ * T * c->D) * es(dt), nk = (size_t)(HKV * T * c->D) * es(dt);
    const size_t sizes[10] = {nq, nk, nk, nq, nq, (size_t)(HQ * T) * 4, nq, nk, nk, sizeof(int32_t) * (VL_SEQS + 1)};
    void *host[10] = {x[0], x[1], x[2], x[3], out[0], out[1], out[2], out[3], out[4], (void *)cu}, *buf[10] = {0};
    int ok = buffers_on(ctx, dev, host, sizes, 10, 0x20Fu, buf); /* q, k, v, do_ and the offsets */
    if (ok) {
        wa_tensor t[9];
        for (int i = 0; i < 9; i++) {
            const int kv = i == 1 || i == 2 || i == 7 || i == 8;
            t[i] = i == 5 ? wa_tensor_lse_varlen(buf[i], HQ, T) : wa_tensor_bhnd(buf[i], dt, 1, kv ? HKV : HQ, T, c->D);
            t[i].device = dev;
        }
        const wa_varlen seqs = {VL_SEQS, buf[9], buf[9], 150, 150};
        const wa_attn_desc desc = {0, c->softcap, c->left, c->right};
        ok = wa_forward_varlen(ctx, &desc, &seqs, &t[0], &t[1], &t[2], &t[4], &t[5]) == WA_OK &&
             wa_backward_varlen(ctx, &desc, &seqs, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3], &t[6], &t[7], &t[8]) == WA_OK;
        ok = ok && copy_back(ctx, dev, host, sizes, 10, 0x1F0u, buf);
    }
    if (!ok) snprintf(err, nerr, "%s", wa_last_error());
    free_buffers(ctx, dev, buf, 10);
    wa_context_destroy(ctx);
    return ok;
}

static void run_varlen(wa_dtype dt, const vl_case *c, wa_device dev, uint64_t seed) {
    int32_t cu[VL_SEQS + 1] = {0};
    for (int s = 0; s < VL_SEQS; s++) cu[s + 1] = cu[s] + vl_lengths[s];
    const int64_t T = cu[VL_SEQS], D = c->D;
    const size_t e = es(dt), n_in[4] = {(size_t)(HQ * T * D), (size_t)(HKV * T * D), (size_t)(HKV * T * D), (size_t)(HQ * T * D)};
    const size_t n_out[5] = {n_in[0], (size_t)(HQ * T), n_in[0], n_in[1], n_in[1]};
    void *x[4], *clean[5], *got[5];
    wa_rng g;
    wa_rng_seed(&g, seed);
    for (int t = 0; t < 4; t++) {
        x[t] = malloc(n_in[t] * e);
        wa_fill_normal(x[t], dt, n_in[t], &g, 1.0);
    }
    for (int t = 0; t < 5; t++) {
        const size_t bytes = n_out[t] * (t == 1 ? 4 : e);
        clean[t] = calloc(1, bytes), got[t] = calloc(1, bytes);
    }
    char err[256], first[300] = "";
    int plants = 0;
    if (!vl_run(dt, c, dev, x, cu, T, clean, err, sizeof err)) snprintf(first, sizeof first, "clean run: %s", err);
    /* the first row of sequences 1 and 2 and the last row of sequences 0 and 1, in each input */
    for (int t = 0; t < 4 && !first[0]; t++)
        for (int at = 0; at < 4 && !first[0]; at++) {
            const int seq = at < 2 ? at + 1 : at - 2;
            const int64_t row = at < 2 ? cu[seq] : cu[seq + 1] - 1;
            const int64_t H = t == T_K || t == T_V ? HKV : HQ, h = draw(&g, H), d = draw(&g, D);
            const size_t i = (size_t)((h * T + row) * D + d);
            const uint32_t old = get_bits(dt, x[t], i);
            set_bits(dt, x[t], i, nonfinite_bits(dt, at & 1 ? 1 : 0)); /* NaN or +inf */
            plants++;
            if (!vl_run(dt, c, dev, x, cu, T, got, err, sizeof err)) snprintf(first, sizeof first, "%s", err);
            /* every output row of the other sequences, bit for bit */
            for (int o = 0; o < 5 && !first[0]; o++) {
                const size_t width = (size_t)(o == 1 ? 1 : D), elem = o == 1 ? 4 : e;
                const int64_t Ho = o == 3 || o == 4 ? HKV : HQ;
                for (int64_t ho = 0; ho < Ho && !first[0]; ho++)
                    for (int s = 0; s < VL_SEQS && !first[0]; s++) {
                        if (s == seq) continue;
                        const size_t off = ((size_t)(ho * T + cu[s]) * width) * elem, len = (size_t)(cu[s + 1] - cu[s]) * width * elem;
                        if (memcmp((char *)got[o] + off, (char *)clean[o] + off, len) != 0)
                            snprintf(first, sizeof first, "%s at %s[h=%lld row=%lld d=%lld] (sequence %d) changed %s of sequence %d",
                                     value_names[at & 1], tensor_names[t], (long long)h, (long long)row, (long long)d, seq,
                                     out_names[o], s);
                    }
            }
            set_bits(dt, x[t], i, old);
        }
    check(!first[0], "nonfinite varlen %s %s D=%lld win=(%lld,%lld)%s, sequences 70/45/150: %d plants stay in their sequence%s%s",
          dev == WA_DEVICE_CUDA ? "cuda" : "cpu", dtype_names[dt], (long long)D, (long long)c->left, (long long)c->right,
          c->softcap > 0 ? " cap=5" : "", plants, first[0] ? " : " : "", first);
    for (int t = 0; t < 4; t++) free(x[t]);
    for (int t = 0; t < 5; t++) free(clean[t]), free(got[t]);
}

int main(void) {
    for (int i = 0; i < n_isas; i++) {
        setenv("WINATTN_ISA", isas[i], 1);
        if (strcmp(wa_cpu_isa(), isas[i]) != 0) check_skip("nonfinite %s: this CPU cannot run it", isas[i]);
    }
    const int cuda = wa_device_available(WA_DEVICE_CUDA);
    if (!cuda) check_skip("nonfinite cuda: no usable CUDA device in this build or machine");
    uint64_t seed = 1;
    for (int d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) run_shape((wa_dtype)d, &shapes[s], seed++, 1, cuda);
    for (int d = 0; d < 3 && cuda; d++)
        for (size_t s = 0; s < sizeof cuda_shapes / sizeof *cuda_shapes; s++)
            run_shape((wa_dtype)d, &cuda_shapes[s], seed++, 0, 1);
    /* varlen: f32 on the CPU (its kernels at every D); f16 and bf16 on the GPU's tensor-core kernels */
    unsetenv("WINATTN_ISA");
    for (size_t c = 0; c < sizeof vl_cases / sizeof *vl_cases; c++) {
        if (vl_cases[c].D <= 256) run_varlen(WA_F32, &vl_cases[c], WA_DEVICE_CPU, seed++);
        for (int d = 1; d < 3 && cuda; d++) run_varlen((wa_dtype)d, &vl_cases[c], WA_DEVICE_CUDA, seed++);
    }
    unsetenv("WINATTN_ISA");
    return check_summary();
}
