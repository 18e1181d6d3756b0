/* check.c — see check.h. */
#define _GNU_SOURCE
#include "check.h"

#include <math.h>
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
