/* cmd_attn.c — `winattn attn IN OUT [flags]`: attention on tensors from a safetensors file.
 *
 * IN holds q, k, v and optionally do (one dtype: F32, F16 or BF16; 4-d, [B,H,N,D] for
 * --layout bhnd, [B,N,H,D] for bnhd). OUT gets o (like q) and lse (F32 [B,Hq,Nq]), and with do
 * also dq, dk, dv. Inputs are memory-mapped and passed to the library through strides, without
 * copies (a misaligned tensor is the one exception: it is copied). OUT is written to a
 * temporary and renamed, so a failure never leaves a partial file. */
#define _GNU_SOURCE
#include "safetensors.h"
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char attn_usage[] =
    "winattn attn IN.safetensors OUT.safetensors [--window-left L] [--window-right R] [--causal] "
    "[--sliding-window W] [--scale S] [--softcap C] [--layout bhnd|bnhd] [--device cpu|cuda] [--deterministic] [--threads T]";
static const char attn_help[] =
    "usage: winattn attn IN.safetensors OUT.safetensors [options]\n"
    "\n"
    "Attention on the tensors of IN: q, k, v (and do for the backward), one dtype (F32, F16 or BF16),\n"
    "4-d. OUT gets o and lse, and with do also dq, dk, dv; it is written whole or not at all.\n"
    "\n"
    "  --window-left L      keys up to L before the query's diagonal (-1, the default: unbounded)\n"
    "  --window-right R     keys up to R after it (-1, the default: unbounded)\n"
    "  --causal             window-right 0 (with --window-left L: a sliding window of L + 1 keys)\n"
    "  --sliding-window W   W keys including the query itself: window (W - 1, 0)\n"
    "  --scale S            score scale (default 1/sqrt(D))\n"
    "  --softcap C          scores capped to C tanh(s / C) (default 0: off)\n"
    "  --layout bhnd|bnhd   the tensors' order: [B,H,N,D] (default) or [B,N,H,D]\n"
    "  --device cpu|cuda    where to run (default cpu; cuda copies IN to the GPU and OUT back)\n"
    "  --deterministic      on cuda: dq bit for bit the same run to run\n"
    "  --threads T          CPU threads (default 0: all)\n"
    "  -h, --help           this help\n";

typedef struct attn_opts {
    const char *in, *out;
    int64_t left, right, sliding;
    int has_left, has_right, causal, bnhd, threads, deterministic;
    float scale, softcap;
    wa_device device;
} attn_opts;

static void parse(int argc, char **argv, attn_opts *o) {
    memset(o, 0, sizeof *o);
    o->left = o->right = -1;
    const char *v;
    for (int i = 1; i < argc; i++) {
        int64_t x;
        if (is_help(argv[i])) show_help(attn_help);
        if ((v = flag_value(argc, argv, &i, "--window-left", attn_usage))) {
            if (parse_i64(v, -1, INT64_MAX, &x))
                usage_error(attn_usage, "--window-left '%s': need an integer from -1 (unbounded) to %lld", v, (long long)INT64_MAX);
            o->left = x, o->has_left = 1;
        } else if ((v = flag_value(argc, argv, &i, "--window-right", attn_usage))) {
            if (parse_i64(v, -1, INT64_MAX, &x))
                usage_error(attn_usage, "--window-right '%s': need an integer from -1 (unbounded) to %lld", v, (long long)INT64_MAX);
            o->right = x, o->has_right = 1;
        } else if ((v = flag_value(argc, argv, &i, "--sliding-window", attn_usage))) {
            if (parse_i64(v, 1, INT64_MAX, &x))
                usage_error(attn_usage, "--sliding-window '%s': need an integer from 1 to %lld (keys including self)", v,
                            (long long)INT64_MAX);
            o->sliding = x;
        } else if ((v = flag_value(argc, argv, &i, "--scale", attn_usage))) {
            if (parse_f32(v, &o->scale) || o->scale == 0) usage_error(attn_usage, "--scale '%s': need a finite non-zero number", v);
        } else if ((v = flag_value(argc, argv, &i, "--softcap", attn_usage))) {
            if (parse_f32(v, &o->softcap) || o->softcap < 0) usage_error(attn_usage, "--softcap '%s': need a number >= 0", v);
        } else if ((v = flag_value(argc, argv, &i, "--layout", attn_usage))) {
            if (strcmp(v, "bhnd") == 0) o->bnhd = 0;
            else if (strcmp(v, "bnhd") == 0) o->bnhd = 1;
            else usage_error(attn_usage, "--layout '%s': must be bhnd or bnhd", v);
        } else if ((v = flag_value(argc, argv, &i, "--device", attn_usage))) {
            if (strcmp(v, "cpu") == 0) o->device = WA_DEVICE_CPU;
            else if (strcmp(v, "cuda") == 0) o->device = WA_DEVICE_CUDA;
            else usage_error(attn_usage, "--device '%s': must be cpu or cuda", v);
        } else if (!strcmp(argv[i], "--deterministic")) { /* CUDA: dq bit-identical run to run */
            o->deterministic = 1;
        } else if ((v = flag_value(argc, argv, &i, "--threads", attn_usage))) {
            if (parse_i64(v, 0, 1024, &x)) usage_error(attn_usage, "--threads '%s': need 0 (all) to 1024", v);
            o->threads = (int)x;
        } else if (strcmp(argv[i], "--causal") == 0) {
            o->causal = 1;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            unknown_option(argv[i]);
        } else if (!o->in) {
            o->in = argv[i];
        } else if (!o->out) {
            o->out = argv[i];
        } else {
            unknown_option(argv[i]);
        }
    }
    if (!o->in || !o->out) usage_error(attn_usage, "need IN and OUT files");
    if (o->sliding) {
        if (o->has_left || (o->has_right && o->right != 0))
            usage_error(attn_usage, "--sliding-window W means window (W-1, 0); do not combine it with --window-left/--window-right");
        o->left = o->sliding - 1, o->right = 0;
    }
    if (o->causal) {
        if (o->has_right && o->right != 0)
            usage_error(attn_usage, "--causal means window_right = 0, but --window-right %lld was given", (long long)o->right);
        o->right = 0;
    }
}

static wa_dtype dtype_from_st(const st_tensor *t, const char *file) {
    switch (t->dtype) {
    case ST_F32: return WA_F32;
    case ST_F16: return WA_F16;
    case ST_BF16: return WA_BF16;
    default: die("%s: tensor '%s' is %s; winattn takes F32, F16 or BF16", file, t->name, st_dtype_name(t->dtype));
    }
}

/* Describe a 4-d safetensors tensor in logical [B,H,N,D] order for the chosen layout. */
static wa_tensor describe(const st_tensor *t, const attn_opts *o, void **copy) {
    if (t->rank != 4)
        die("%s: tensor '%s' has rank %d; expected 4 ([B,H,N,D] or, with --layout bnhd, [B,N,H,D])", o->in, t->name, t->rank);
    wa_dtype dt = dtype_from_st(t, o->in);
    const void *data = t->data;
    *copy = NULL;
    if (!st_is_aligned(t)) { /* safetensors does not promise alignment; copy only then */
        *copy = xmalloc(t->end - t->begin, t->name);
        memcpy(*copy, t->data, t->end - t->begin);
        data = *copy;
    }
    const int64_t *s = t->shape;
    return o->bnhd ? wa_tensor_bnhd((void *)data, dt, s[0], s[2], s[1], s[3]) : wa_tensor_bhnd((void *)data, dt, s[0], s[1], s[2], s[3]);
}

static wa_tensor output_like(const wa_tensor *ref, const attn_opts *o, void **buf, const char *what) {
    size_t n = (size_t)(ref->shape[0] * ref->shape[1] * ref->shape[2] * ref->shape[3]);
    *buf = xmalloc(n * wa_dtype_size(ref->dtype), what);
    const int64_t *s = ref->shape;
    return o->bnhd ? wa_tensor_bnhd(*buf, ref->dtype, s[0], s[1], s[2], s[3]) : wa_tensor_bhnd(*buf, ref->dtype, s[0], s[1], s[2], s[3]);
}

static st_out st_out_of(const char *name, const wa_tensor *t, int bnhd) {
    st_out so;
    memset(&so, 0, sizeof so);
    so.name = name;
    so.dtype = t->dtype == WA_F32 ? ST_F32 : t->dtype == WA_F16 ? ST_F16 : ST_BF16;
    so.rank = 4;
    so.shape[0] = t->shape[0];
    so.shape[1] = bnhd ? t->shape[2] : t->shape[1];
    so.shape[2] = bnhd ? t->shape[1] : t->shape[2];
    so.shape[3] = t->shape[3];
    so.data = t->data;
    return so;
}

int cmd_attn(int argc, char **argv) {
    attn_opts o;
    parse(argc, argv, &o);
    if (o.device == WA_DEVICE_CUDA && !wa_device_available(WA_DEVICE_CUDA))
        die("--device cuda: this build has no usable CUDA device");

    st_file f;
    char err[512];
    if (st_open(o.in, &f, err, sizeof err) != 0) die("%s", err);
    for (int i = 0; i < f.count; i++) {
        const char *n = f.tensors[i].name;
        if (strcmp(n, "q") && strcmp(n, "k") && strcmp(n, "v") && strcmp(n, "do"))
            die("%s: unexpected tensor '%s' (IN holds q, k, v and optionally do)", o.in, n);
    }
    const st_tensor *sq = st_find(&f, "q"), *sk = st_find(&f, "k"), *sv = st_find(&f, "v"), *sdo = st_find(&f, "do");
    if (!sq || !sk || !sv) die("%s: missing tensor '%s' (IN must hold q, k and v)", o.in, !sq ? "q" : !sk ? "k" : "v");

    void *copies[4] = {0};
    wa_tensor q = describe(sq, &o, &copies[0]), k = describe(sk, &o, &copies[1]), v = describe(sv, &o, &copies[2]);
    wa_tensor g;
    if (sdo) g = describe(sdo, &o, &copies[3]);

    wa_context_params cp = {0};
    cp.threads = o.threads;
    cp.cuda_deterministic = o.deterministic;
    wa_context *ctx;
    if (wa_context_create(&cp, &ctx) != WA_OK) die("%s", wa_last_error());
    wa_attn_desc desc = {o.scale, o.softcap, o.left, o.right};
    /* the shapes are checked (dimension limits, element counts, GQA, head dim) before anything is
     * allocated for the outputs: a tensor with a 0 dimension beside huge ones holds no bytes in
     * IN, yet the outputs' sizes are products of its dimensions */
    size_t ws_bytes;
    if (wa_workspace_size(ctx, &desc, &q, &k, &v, sdo != NULL, &ws_bytes) != WA_OK) die("%s: %s", o.in, wa_last_error());
    if (sdo)
        for (int d = 0; d < 4; d++)
            if (g.shape[d] != q.shape[d]) die("%s: tensor 'do' must have q's shape", o.in);

    void *ob, *dqb = NULL, *dkb = NULL, *dvb = NULL;
    wa_tensor out = output_like(&q, &o, &ob, "o");
    float *lseb = xmalloc((size_t)(q.shape[0] * q.shape[1] * q.shape[2]) * 4 + 4, "lse");
    wa_tensor lse = wa_tensor_lse(lseb, q.shape[0], q.shape[1], q.shape[2]);
    wa_tensor dq, dk, dv;
    if (sdo) dq = output_like(&q, &o, &dqb, "dq"), dk = output_like(&k, &o, &dkb, "dk"), dv = output_like(&v, &o, &dvb, "dv");

    /* with --device cuda every tensor gets a device twin; results come back into the host buffers */
    wa_tensor *all[9] = {&q, &k, &v, &g, &out, &lse, &dq, &dk, &dv};
    int n_all = sdo ? 9 : 6, is_input[9] = {1, 1, 1, 1, 0, 0, 0, 0, 0};
    void *host[9] = {0}, *dev[9] = {0};
    if (o.device == WA_DEVICE_CUDA) {
        for (int i = 0; i < n_all; i++) {
            if (i == 3 && !sdo) continue;
            wa_tensor *t = all[i];
            size_t bytes = (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]) * wa_dtype_size(t->dtype);
            host[i] = t->data;
            if (wa_malloc(ctx, WA_DEVICE_CUDA, bytes, &dev[i]) != WA_OK) die("%s", wa_last_error());
            if (is_input[i] && wa_memcpy(ctx, dev[i], WA_DEVICE_CUDA, host[i], WA_DEVICE_CPU, bytes) != WA_OK)
                die("%s", wa_last_error());
            t->data = dev[i], t->device = WA_DEVICE_CUDA;
        }
    }
    wa_status st = wa_forward(ctx, &desc, &q, &k, &v, &out, &lse);
    if (st != WA_OK) die("%s: %s", wa_status_str(st), wa_last_error());
    if (sdo) {
        st = wa_backward(ctx, &desc, &q, &k, &v, &out, &lse, &g, &dq, &dk, &dv);
        if (st != WA_OK) die("%s: %s", wa_status_str(st), wa_last_error());
    }
    if ((st = wa_synchronize(ctx)) != WA_OK) die("%s: %s", wa_status_str(st), wa_last_error());
    if (o.device == WA_DEVICE_CUDA) {
        for (int i = 0; i < n_all; i++) {
            if (!dev[i]) continue;
            wa_tensor *t = all[i];
            size_t bytes = (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]) * wa_dtype_size(t->dtype);
            if (!is_input[i] && wa_memcpy(ctx, host[i], WA_DEVICE_CPU, dev[i], WA_DEVICE_CUDA, bytes) != WA_OK)
                die("%s", wa_last_error());
            wa_free_memory(ctx, WA_DEVICE_CUDA, dev[i]);
            t->data = host[i], t->device = WA_DEVICE_CPU;
        }
    }
    wa_context_destroy(ctx);

    st_out outs[5];
    int n = 0;
    outs[n++] = st_out_of("o", &out, o.bnhd);
    memset(&outs[n], 0, sizeof outs[n]);
    outs[n].name = "lse", outs[n].dtype = ST_F32, outs[n].rank = 3;
    outs[n].shape[0] = q.shape[0], outs[n].shape[1] = q.shape[1], outs[n].shape[2] = q.shape[2], outs[n].data = lseb;
    n++;
    if (sdo) outs[n++] = st_out_of("dq", &dq, o.bnhd), outs[n++] = st_out_of("dk", &dk, o.bnhd), outs[n++] = st_out_of("dv", &dv, o.bnhd);
    char window[64];
    snprintf(window, sizeof window, "(%lld, %lld)", (long long)o.left, (long long)o.right);
    const char *meta[] = {"producer", "winattn", "window", window, "layout", o.bnhd ? "bnhd" : "bhnd", NULL};
    if (st_write(o.out, outs, n, meta, err, sizeof err) != 0) die("%s", err);

    st_close(&f);
    for (int i = 0; i < 4; i++) free(copies[i]);
    free(ob), free(lseb), free(dqb), free(dkb), free(dvb);
    return 0;
}
