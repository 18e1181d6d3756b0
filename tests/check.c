/* check.c — see check.h. */
#define _GNU_SOURCE
#include "check.h"

#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_pass, n_fail, n_skip;

static void report(const char *tag, const char *fmt, va_list ap) {
    printf("%s ", tag);
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
}

void check_pass(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("PASS", fmt, ap);
    va_end(ap);
    n_pass++;
}
void check_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("FAIL", fmt, ap);
    va_end(ap);
    n_fail++;
}
void check_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("SKIP", fmt, ap);
    va_end(ap);
    n_skip++;
}
int check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report(ok ? "PASS" : "FAIL", fmt, ap);
    va_end(ap);
    if (ok) n_pass++;
    else n_fail++;
    return ok;
}
int check_summary(void) {
    if (n_skip) printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    else printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

void check_default_stop_signals(void) {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
}

int check_copy_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb"), *out = in ? fopen(to, "wb") : NULL;
    char buf[65536];
    size_t n;
    int rc = in && out ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, in)) > 0) rc = fwrite(buf, 1, n, out) == n ? 0 : -1;
    if (in) fclose(in);
    if (out && fclose(out) != 0) rc = -1;
    return rc;
}

int check_same_bytes(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
        if (ca == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}
