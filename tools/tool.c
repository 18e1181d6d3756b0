/* tool.c — helpers shared by the winattn subcommands (see tool.h). */
#define _GNU_SOURCE
#include "tool.h"
#include "convert.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *tool_cmd = "";

void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "winattn%s%s: ", tool_cmd[0] ? " " : "", tool_cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

void usage_error(const char *usage, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "winattn%s%s: ", tool_cmd[0] ? " " : "", tool_cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (usage: %s)\n", usage);
    va_end(ap);
    exit(2);
}

int is_help(const char *arg) { return strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0; }

void show_help(const char *text) {
    fputs(text, stdout);
    exit(fflush(stdout) == 0 && !ferror(stdout) ? 0 : 1);
}

void unknown_option(const char *arg) {
    fprintf(stderr, "winattn %s: %s '%s' (winattn %s --help lists the options)\n", tool_cmd,
            arg[0] == '-' && arg[1] != '\0' ? "unknown option" : "unexpected argument", arg, tool_cmd);
    exit(2);
}

int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int parse_f32(const char *s, float *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v) || fabs(v) > 3.0e38) return -1;
    *out = (float)v;
    return 0;
}

const char *flag_value(int argc, char **argv, int *i, const char *name, const char *usage) {
    size_t n = strlen(name);
    const char *a = argv[*i];
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 >= argc) usage_error(usage, "%s needs a value", name);
    return argv[++*i];
}

void *xmalloc(size_t bytes, const char *what) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        die("out of memory allocating %zu bytes for %s", bytes, what);
    return p;
}

const char *dtype_name(wa_dtype dt) {
    static const char *const names[3] = {"f32", "f16", "bf16"};
    return (unsigned)dt < 3 ? names[dt] : "?";
}

void fill_uniform(void *data, wa_dtype dt, size_t n, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 7;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float x = (float)((double)(s >> 11) * (1.0 / 9007199254740992.0) * 4.0 - 2.0);
        if (dt == WA_F32) ((float *)data)[i] = x;
        else if (dt == WA_BF16) ((uint16_t *)data)[i] = wa_f32_to_bf16(x);
        else ((uint16_t *)data)[i] = wa_f32_to_f16(x);
    }
}

void write_file_atomic(const char *path, const char *text) {
    char err[1024];
    if (write_text_atomic(path, text, err, sizeof err) != 0) die("%s", err);
}
