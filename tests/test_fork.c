/* test_fork.c — a child of a process that used the library works. fork() copies a context's
 * thread pool but none of its worker threads; the child's calls must neither wait for workers it
 * does not have nor differ from the parent's results. Each child runs under alarm(), so a hang
 * fails the case instead of stopping the suite. */
#define _GNU_SOURCE
#include "check.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { B = 2, HQ = 4, HKV = 2, N = 300, D = 32 };
#define NQ_ELEMS (B * HQ * N * D)
#define NK_ELEMS (B * HKV * N * D)

static float q[NQ_ELEMS], k[NK_ELEMS], v[NK_ELEMS], go[NQ_ELEMS];
static float o_ref[NQ_ELEMS], dq_ref[NQ_ELEMS], dk_ref[NK_ELEMS], dv_ref[NK_ELEMS];

/* Forward + backward with a sliding window; 0 if every output equals the parent's bit for bit,
 * 1 on a difference, 2 if a call failed. */
static int run_and_compare(wa_context *ctx, int fill_reference) {
    static float o[NQ_ELEMS], lse[B * HQ * N], dq[NQ_ELEMS], dk[NK_ELEMS], dv[NK_ELEMS];
    wa_attn_desc desc = wa_attn_desc_causal();
    desc.window_left = 100;
    wa_tensor tq = wa_tensor_bhnd(q, WA_F32, B, HQ, N, D), tk = wa_tensor_bhnd(k, WA_F32, B, HKV, N, D);
    wa_tensor tv = wa_tensor_bhnd(v, WA_F32, B, HKV, N, D), tdo = wa_tensor_bhnd(go, WA_F32, B, HQ, N, D);
    wa_tensor to = wa_tensor_bhnd(o, WA_F32, B, HQ, N, D), tl = wa_tensor_lse(lse, B, HQ, N);
    wa_tensor tdq = wa_tensor_bhnd(dq, WA_F32, B, HQ, N, D), tdk = wa_tensor_bhnd(dk, WA_F32, B, HKV, N, D);
    wa_tensor tdv = wa_tensor_bhnd(dv, WA_F32, B, HKV, N, D);
    if (wa_forward(ctx, &desc, &tq, &tk, &tv, &to, &tl) != WA_OK ||
        wa_backward(ctx, &desc, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv) != WA_OK)
        return 2;
    if (fill_reference) {
        memcpy(o_ref, o, sizeof o), memcpy(dq_ref, dq, sizeof dq);
        memcpy(dk_ref, dk, sizeof dk), memcpy(dv_ref, dv, sizeof dv);
        return 0;
    }
    return memcmp(o, o_ref, sizeof o) || memcmp(dq, dq_ref, sizeof dq) || memcmp(dk, dk_ref, sizeof dk) ||
           memcmp(dv, dv_ref, sizeof dv);
}

/* Runs body in a child with a 10 s alarm; the child's exit status, or -signal. */
static int in_child(int (*body)(wa_context *), wa_context *ctx) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return -1000;
    if (pid == 0) {
        alarm(10);
        _exit(body(ctx));
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return -1001;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

static const char *outcome(int code) {
    switch (code) {
    case 0: return "bit-identical to the parent";
    case 1: return "results differ from the parent's";
    case 2: return "a call failed";
    case -SIGALRM: return "hung (killed after 10 s)";
    default: return "crashed";
    }
}

static int reuse_parent_context(wa_context *ctx) { return run_and_compare(ctx, 0); }
static int reuse_twice(wa_context *ctx) { return run_and_compare(ctx, 0) | run_and_compare(ctx, 0); }
static int destroy_without_use(wa_context *ctx) {
    wa_context_destroy(ctx);
    return 0;
}
static int new_context(wa_context *parent) {
    (void)parent;
    wa_context *ctx = NULL;
    wa_context_params params = {0};
    params.threads = 3;
    if (wa_context_create(&params, &ctx) != WA_OK) return 2;
    int r = run_and_compare(ctx, 0);
    wa_context_destroy(ctx);
    return r;
}
/* the child forks again: a grandchild of a child that restarted its workers */
static int fork_again(wa_context *ctx) {
    if (run_and_compare(ctx, 0) != 0) return 1;
    return in_child(reuse_parent_context, ctx);
}

int main(void) {
    wa_rng rng;
    wa_rng_seed(&rng, 7);
    wa_fill_normal(q, WA_F32, NQ_ELEMS, &rng, 1.0), wa_fill_normal(k, WA_F32, NK_ELEMS, &rng, 1.0);
    wa_fill_normal(v, WA_F32, NK_ELEMS, &rng, 1.0), wa_fill_normal(go, WA_F32, NQ_ELEMS, &rng, 1.0);
    for (int threads = 1; threads <= 4; threads += 3) {
        wa_context *ctx = NULL;
        wa_context_params params = {0};
        params.threads = threads;
        if (wa_context_create(&params, &ctx) != WA_OK || run_and_compare(ctx, 1) != 0) {
            check_fail("threads=%d: the parent's reference call failed: %s", threads, wa_last_error());
            continue;
        }
        int code = in_child(reuse_parent_context, ctx);
        check(code == 0, "threads=%d: the parent's context used in a forked child: %s", threads, outcome(code));
        code = in_child(reuse_twice, ctx);
        check(code == 0, "threads=%d: two calls in a forked child: %s", threads, outcome(code));
        code = in_child(destroy_without_use, ctx);
        check(code == 0, "threads=%d: the parent's context destroyed in a child that never used it: %s", threads,
              outcome(code));
        code = in_child(new_context, ctx);
        check(code == 0, "threads=%d: a new 3-thread context in a forked child: %s", threads, outcome(code));
        code = in_child(fork_again, ctx);
        check(code == 0, "threads=%d: a child that used the context forks again: %s", threads, outcome(code));
        code = run_and_compare(ctx, 0);
        check(code == 0, "threads=%d: the parent's context after its children: %s", threads, outcome(code));
        wa_context_destroy(ctx);
    }
    return check_summary();
}
