/* test_safetensors.c — unit tests for formats/safetensors.c.
 *
 * The reader is the tool's first contact with untrusted input, so most cases here are malformed
 * files: each is built in memory, fed to st_parse, and must fail with a one-line message that
 * names the problem. Round trips through st_write/st_open check that what we write is what we
 * read, and the atomic-write promise (no file, no leftover temporary on failure) is checked by
 * listing the output directory. Prints one line per case and a final "N passed, N failed".
 *
 * Build: gcc -std=c11 -O2 -g -Wall -Wextra -Werror -fsanitize=address,undefined -Iformats \
 *          formats/safetensors.c formats/atomic_file.c tests/test_safetensors.c -ljansson -o /tmp/test_st
 */
#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static int n_pass, n_fail;

static void report(const char *name, int ok, const char *detail)
{
    if (ok) {
        printf("PASS %s\n", name);
        n_pass++;
    } else {
        printf("FAIL %s: %s\n", name, detail);
        n_fail++;
    }
}

/* Whole-file image: u64 header length, header bytes, data bytes (a recognisable pattern).
 * Allocated to the exact size so AddressSanitizer catches any read past the end. */
static unsigned char *build(const char *header, size_t hdr_len, size_t data_len, size_t *out_len)
{
    size_t len = 8 + hdr_len + data_len;
    unsigned char *buf = malloc(len ? len : 1);
    if (buf == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    uint64_t h = hdr_len;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(h >> (8 * i));
    memcpy(buf + 8, header, hdr_len);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + hdr_len + i] = (unsigned char)(i * 7 + 1);
    *out_len = len;
    return buf;
}

/* Structural UTF-8 check (lead byte announces the length, continuation bytes follow); enough to
 * catch a message cut in the middle of a character or echoing raw invalid input. */
static int utf8_ok(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        int extra = *p < 0x80 ? 0 : *p >= 0xC2 && *p <= 0xDF ? 1 : *p >= 0xE0 && *p <= 0xEF ? 2
                  : *p >= 0xF0 && *p <= 0xF4 ? 3 : -1;
        if (extra < 0)
            return 0;
        for (int i = 1; i <= extra; i++)
            if ((p[i] & 0xC0) != 0x80)
                return 0;
        p += extra + 1;
    }
    return 1;
}

/* A failure must come with a non-empty single-line message mentioning `expect`, and leave the
 * st_file empty. Returns 1 if so, else 0 with a reason in detail (quotes are length-limited so
 * the reason fits a 512-byte detail buffer). */
static int check_failure(int rc, const st_file *f, const char *err, const char *expect,
                         char *detail, size_t dlen)
{
    if (rc == 0) {
        snprintf(detail, dlen, "accepted, expected an error mentioning '%.120s'", expect);
        return 0;
    }
    if (rc != -1) {
        snprintf(detail, dlen, "returned %d, expected -1", rc);
        return 0;
    }
    if (err[0] == '\0') {
        snprintf(detail, dlen, "empty error message");
        return 0;
    }
    if (strchr(err, '\n') != NULL || strchr(err, '\r') != NULL) {
        snprintf(detail, dlen, "error message spans lines: %.300s", err);
        return 0;
    }
    if (!utf8_ok(err)) {
        snprintf(detail, dlen, "error message is not valid UTF-8");
        return 0;
    }
    if (strstr(err, expect) == NULL) {
        snprintf(detail, dlen, "message '%.300s' does not mention '%.120s'", err, expect);
        return 0;
    }
    if (f != NULL && (f->count != 0 || f->tensors != NULL || f->meta != NULL || f->map != NULL)) {
        snprintf(detail, dlen, "st_file not left empty after failure");
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * malformed headers, table-driven
 */

typedef struct bad_case {
    const char *name;
    const char *header;
    size_t header_len; /* 0: strlen(header); set for headers with embedded NUL bytes */
    size_t data_len;
    const char *expect; /* substring the error must contain */
} bad_case;

#define E10 "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"
#define T(dt, shape, offs) "{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":" offs "}"

static const bad_case bad_cases[] = {
    {"json_truncated", "{\"a\":", 0, 0, "not valid JSON"},
    {"json_trailing_garbage", "{} x", 0, 0, "not valid JSON"},
    {"json_duplicate_tensor", "{\"a\":" T("U8", "[1]", "[0,1]") ",\"a\":" T("U8", "[1]", "[1,2]") "}",
     0, 2, "duplicate"},
    {"json_big_integer", "{\"a\":" T("U8", "[1]", "[0,99999999999999999999]") "}", 0, 1,
     "not valid JSON"},
    {"json_invalid_utf8", "{\"a\xff\":" T("U8", "[1]", "[0,1]") "}", 0, 1, "not valid JSON"},
    {"json_embedded_nul", "{}\0   ", 6, 0, "not valid JSON"},
    {"json_escaped_nul_name", "{\"a\\u0000b\":" T("U8", "[1]", "[0,1]") "}", 0, 1,
     "not valid JSON"},
    {"json_only_spaces", "        ", 0, 0, "not valid JSON"},
    {"top_level_array", "[1,2]", 0, 0, "not a JSON object"},
    {"top_level_number", "3", 0, 0, "not a JSON object"},
    {"top_level_string", "\"x\"", 0, 0, "not a JSON object"},
    {"entry_not_object", "{\"a\":[1]}", 0, 0, "entry is not an object"},
    {"entry_null", "{\"a\":null}", 0, 0, "entry is not an object"},
    {"entry_name_with_newline", "{\"a\\nb\":5}", 0, 0, "entry is not an object"},
    {"entry_long_utf8_name_shortened",
     "{\"" E10 E10 E10 E10 E10 "\":5}", 0, 0, "\xc3\xa9...\": entry is not an object"},
    {"dtype_missing", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 0, 1, "missing \"dtype\""},
    {"dtype_not_string", "{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,1]}}", 0, 1,
     "\"dtype\" is not a string"},
    {"dtype_unknown", "{\"a\":" T("F128", "[1]", "[0,1]") "}", 0, 1, "unknown dtype \"F128\""},
    {"dtype_lowercase", "{\"a\":" T("f32", "[1]", "[0,4]") "}", 0, 4, "unknown dtype"},
    {"shape_missing", "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 0, 1,
     "missing \"shape\""},
    {"shape_not_array", "{\"a\":" T("U8", "1", "[0,1]") "}", 0, 1, "\"shape\" is not an array"},
    {"shape_real", "{\"a\":" T("U8", "[2.0]", "[0,2]") "}", 0, 2, "\"shape\"[0] is not an integer"},
    {"shape_string", "{\"a\":" T("U8", "[1,\"2\"]", "[0,2]") "}", 0, 2,
     "\"shape\"[1] is not an integer"},
    {"shape_bool", "{\"a\":" T("U8", "[true]", "[0,1]") "}", 0, 1, "is not an integer"},
    {"shape_negative", "{\"a\":" T("U8", "[-1]", "[0,1]") "}", 0, 1, "\"shape\"[0] is negative"},
    {"rank_too_large", "{\"a\":" T("U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 0, 1,
     "rank 9 exceeds"},
    {"offsets_missing", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 0, 1,
     "missing \"data_offsets\""},
    {"offsets_not_array", "{\"a\":" T("U8", "[1]", "{\"b\":0}") "}", 0, 1,
     "not an array of two integers"},
    {"offsets_one_element", "{\"a\":" T("U8", "[1]", "[1]") "}", 0, 1,
     "not an array of two integers"},
    {"offsets_three_elements", "{\"a\":" T("U8", "[1]", "[0,1,2]") "}", 0, 1,
     "not an array of two integers"},
    {"offsets_real", "{\"a\":" T("U8", "[1]", "[0,1.0]") "}", 0, 1,
     "\"data_offsets\"[1] is not an integer"},
    {"offsets_real_exponent", "{\"a\":" T("U8", "[1]", "[0,1e0]") "}", 0, 1, "is not an integer"},
    {"offsets_negative", "{\"a\":" T("U8", "[1]", "[-1,0]") "}", 0, 1,
     "\"data_offsets\"[0] is negative"},
    {"offsets_begin_after_end", "{\"a\":" T("U8", "[1]", "[4,3]") "}", 0, 4, "begin 4 is after end 3"},
    {"offsets_end_beyond_data", "{\"a\":" T("U8", "[5]", "[0,5]") "}", 0, 4,
     "end 5 is beyond the data region of 4 bytes"},
    {"offsets_huge", "{\"a\":" T("U8", "[1]", "[9223372036854775806,9223372036854775807]") "}", 0, 1,
     "beyond the data region"},
    {"numel_overflow", "{\"a\":" T("U8", "[4294967296,4294967296]", "[0,0]") "}", 0, 0,
     "element count overflows"},
    {"numel_overflow_before_zero", "{\"a\":" T("U8", "[4294967296,4294967296,0]", "[0,0]") "}", 0, 0,
     "element count overflows"},
    {"nbytes_overflow", "{\"a\":" T("F32", "[4611686018427387904]", "[0,0]") "}", 0, 0,
     "byte size of 4611686018427387904 F32 elements overflows"},
    {"nbytes_wraps_to_match", "{\"a\":" T("F64", "[2305843009213693952]", "[0,0]") "}", 0, 0,
     "overflows"},
    {"size_mismatch_small", "{\"a\":" T("F32", "[2]", "[0,4]") "}", 0, 4,
     "span 4 bytes but 2 F32 elements need 8"},
    {"size_mismatch_large", "{\"a\":" T("F16", "[2]", "[0,8]") "}", 0, 8, "need 4"},
    {"size_mismatch_zero_shape", "{\"a\":" T("F32", "[0,3]", "[0,4]") "}", 0, 4,
     "span 4 bytes but 0 F32 elements need 0"},
    {"size_mismatch_scalar", "{\"a\":" T("I64", "[]", "[0,0]") "}", 0, 0, "need 8"},
    {"overlap_partial",
     "{\"a\":" T("U8", "[8]", "[0,8]") ",\"b\":" T("U8", "[8]", "[4,12]") "}", 0, 12, "overlap"},
    {"overlap_identical",
     "{\"a\":" T("U8", "[8]", "[0,8]") ",\"b\":" T("U8", "[8]", "[0,8]") "}", 0, 8, "overlap"},
    {"overlap_contained",
     "{\"a\":" T("U8", "[2]", "[2,4]") ",\"b\":" T("U8", "[8]", "[0,8]") "}", 0, 8, "overlap"},
    {"overlap_empty_inside",
     "{\"a\":" T("U8", "[8]", "[0,8]") ",\"z\":" T("U8", "[0]", "[4,4]") "}", 0, 8,
     "\"a\" [0, 8) and \"z\" [4, 4) overlap"},
    {"hole_middle",
     "{\"a\":" T("U8", "[4]", "[0,4]") ",\"b\":" T("U8", "[4]", "[8,12]") "}", 0, 12,
     "bytes [4, 8) are not covered"},
    {"hole_start", "{\"a\":" T("U8", "[4]", "[4,8]") "}", 0, 8, "bytes [0, 4) are not covered"},
    {"hole_end", "{\"a\":" T("U8", "[4]", "[0,4]") "}", 0, 9, "bytes [4, 9) are not covered"},
    {"hole_no_tensors", "{}", 0, 3, "bytes [0, 3) are not covered"},
    {"hole_only_metadata", "{\"__metadata__\":{\"k\":\"v\"}}", 0, 1, "not covered"},
    {"metadata_not_object", "{\"__metadata__\":[\"k\",\"v\"]}", 0, 0,
     "__metadata__ is not an object"},
    {"metadata_string", "{\"__metadata__\":\"kv\"}", 0, 0, "__metadata__ is not an object"},
    {"metadata_value_number", "{\"__metadata__\":{\"k\":\"v\",\"n\":1}}", 0, 0,
     "value for key \"n\" is not a string"},
    {"metadata_value_null", "{\"__metadata__\":{\"k\":null}}", 0, 0, "is not a string"},
    {"metadata_value_object", "{\"__metadata__\":{\"k\":{}}}", 0, 0, "is not a string"},
    {"metadata_duplicate", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, 0, "duplicate"},
    {"entry_unknown_key",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"foo\":1}}", 0, 1,
     "unknown key \"foo\""},
    {"entry_unknown_key_only", "{\"a\":{\"bar\":1}}", 0, 1, "unknown key \"bar\""},
    {"second_tensor_bad",
     "{\"a\":" T("U8", "[1]", "[0,1]") ",\"b\":" T("U8", "[1]", "[1,2.5]") "}", 0, 2,
     "tensor \"b\""},
};

static void test_bad_headers(void)
{
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *c = &bad_cases[i];
        size_t hl = c->header_len ? c->header_len : strlen(c->header);
        size_t len;
        unsigned char *buf = build(c->header, hl, c->data_len, &len);
        st_file f;
        char err[512] = "";
        char detail[1024];
        int rc = st_parse(buf, len, &f, err, sizeof err);
        int ok = check_failure(rc, &f, err, c->expect, detail, sizeof detail);
        char name[128];
        snprintf(name, sizeof name, "bad_header/%s", c->name);
        report(name, ok, detail);
        st_close(&f);
        free(buf);
    }
}

/* Cases where the length prefix itself is wrong, which the header builder cannot express. */
static void test_bad_lengths(void)
{
    char err[512], detail[1024];
    st_file f;

    int ok = 1;
    detail[0] = '\0';
    for (size_t len = 0; len < 8 && ok; len++) {
        unsigned char *buf = malloc(len ? len : 1);
        if (buf == NULL)
            exit(2);
        memset(buf, 0, len ? len : 1);
        int rc = st_parse(len ? buf : NULL, len, &f, err, sizeof err);
        ok = check_failure(rc, &f, err, "too short", detail, sizeof detail);
        st_close(&f);
        free(buf);
    }
    report("bad_length/shorter_than_8", ok, detail);

    struct {
        const char *name;
        uint64_t hlen;
        size_t file_len;
        const char *expect;
    } rows[] = {
        {"zero", 0, 16, "header length is 0"},
        {"exceeds_file", 9999, 120, "header length 9999 exceeds file size 120"},
        {"exceeds_file_by_one", 113, 120, "header length 113 exceeds file size 120"},
        {"over_limit", 100000001, 120, "exceeds the limit of 100000000 bytes"},
        {"max_u64", UINT64_MAX, 120, "exceeds the limit"},
        {"high_bit", 1ULL << 63, 16, "exceeds the limit"},
    };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        unsigned char *buf = malloc(rows[r].file_len);
        if (buf == NULL)
            exit(2);
        memset(buf, ' ', rows[r].file_len);
        for (int i = 0; i < 8; i++)
            buf[i] = (unsigned char)(rows[r].hlen >> (8 * i));
        int rc = st_parse(buf, rows[r].file_len, &f, err, sizeof err);
        ok = check_failure(rc, &f, err, rows[r].expect, detail, sizeof detail);
        char name[128];
        snprintf(name, sizeof name, "bad_length/%s", rows[r].name);
        report(name, ok, detail);
        st_close(&f);
        free(buf);
    }
}

/* ---------------------------------------------------------------------------------------------
 * valid in-memory files
 */

static void test_good_headers(void)
{
    char err[512], detail[1024];
    st_file f;
    size_t len;
    unsigned char *buf;
    int ok;

    /* Empty file body: no tensors, no data. */
    buf = build("{}", 2, 0, &len);
    ok = st_parse(buf, len, &f, err, sizeof err) == 0 && f.count == 0;
    snprintf(detail, sizeof detail, "%s", err);
    report("good/empty_object", ok, detail);
    st_close(&f);
    free(buf);

    /* Padding with spaces, leading whitespace, scalar, zero-size tensors at shared offsets, and
     * header order unlike offset order: all legal. */
    const char *hdr = "  {\"s\":" T("F32", "[]", "[4,8]") ",\"z1\":" T("F16", "[3,0]", "[0,0]")
                      ",\"a\":" T("U8", "[2,2]", "[0,4]") ",\"z2\":" T("BF16", "[0]", "[4,4]")
                      ",\"z3\":" T("I64", "[0,5]", "[8,8]") "}        ";
    buf = build(hdr, strlen(hdr), 8, &len);
    ok = st_parse(buf, len, &f, err, sizeof err) == 0;
    if (!ok) {
        snprintf(detail, sizeof detail, "rejected: %s", err);
    } else {
        const st_tensor *s = st_find(&f, "s"), *a = st_find(&f, "a"), *z = st_find(&f, "z1");
        ok = f.count == 5 && s && a && z && s->rank == 0 && st_numel(s) == 1 &&
             s->dtype == ST_F32 && a->rank == 2 && a->shape[0] == 2 && a->shape[1] == 2 &&
             z->rank == 2 && z->shape[1] == 0 && st_numel(z) == 0 && z->begin == z->end &&
             (const unsigned char *)a->data == buf + 8 + strlen(hdr) &&
             (const unsigned char *)s->data == buf + 8 + strlen(hdr) + 4 &&
             strcmp(f.tensors[0].name, "s") == 0 && strcmp(f.tensors[4].name, "z3") == 0 &&
             st_find(&f, "missing") == NULL && st_metadata(&f, "x") == NULL;
        snprintf(detail, sizeof detail, "parsed but fields are wrong");
    }
    report("good/mixed_zero_size_scalar_padding", ok, detail);
    st_close(&f);
    free(buf);

    /* Metadata lookups, UTF-8 names, and a misaligned F32 after an odd U8. The header is padded to
     * 16 bytes so the data region starts at offset 24 of a malloc'ed (16-aligned) buffer. */
    const char *mh = "{\"__metadata__\":{\"format\":\"pt\",\"w\":\"\xc3\xa9t\xc3\xa9\"},"
                     "\"\xce\xb1\":" T("U8", "[1]", "[0,1]") ",\"b\":" T("F32", "[1]", "[1,5]") "}";
    size_t ml = strlen(mh);
    char *padded = malloc(ml + 16);
    if (padded == NULL)
        exit(2);
    memcpy(padded, mh, ml);
    size_t pl = (ml + 15) & ~(size_t)15;
    memset(padded + ml, ' ', pl - ml);
    buf = build(padded, pl, 5, &len);
    ok = st_parse(buf, len, &f, err, sizeof err) == 0;
    if (!ok) {
        snprintf(detail, sizeof detail, "rejected: %s", err);
    } else {
        const st_tensor *alpha = st_find(&f, "\xce\xb1"), *b = st_find(&f, "b");
        const char *k = NULL, *v = NULL;
        ok = alpha && b && st_is_aligned(alpha) && !st_is_aligned(b) &&
             st_metadata(&f, "format") && strcmp(st_metadata(&f, "format"), "pt") == 0 &&
             st_metadata(&f, "w") && strcmp(st_metadata(&f, "w"), "\xc3\xa9t\xc3\xa9") == 0 &&
             st_metadata(&f, "nope") == NULL && st_metadata_count(&f) == 2 &&
             st_metadata_at(&f, 1, &k, &v) == 0 && strcmp(k, "w") == 0 &&
             st_metadata_at(&f, 2, &k, &v) == -1 && ((uintptr_t)buf % 16) == 0;
        snprintf(detail, sizeof detail, "parsed but fields are wrong");
    }
    report("good/metadata_utf8_misaligned", ok, detail);
    st_close(&f);
    st_close(&f); /* idempotent */
    free(buf);
    free(padded);

    /* "__metadata__": null, as MLX writes it (mlx-lm's adapters): no entries, the tensors read */
    const char *nh = "{\"__metadata__\":null,\"a\":" T("F32", "[2]", "[0,8]") "}";
    buf = build(nh, strlen(nh), 8, &len);
    ok = st_parse(buf, len, &f, err, sizeof err) == 0;
    if (!ok) {
        snprintf(detail, sizeof detail, "rejected: %s", err);
    } else {
        ok = f.count == 1 && st_find(&f, "a") && st_metadata_count(&f) == 0 && st_metadata(&f, "format") == NULL;
        snprintf(detail, sizeof detail, "parsed but fields are wrong");
    }
    report("good/metadata_null", ok, detail);
    st_close(&f);
    free(buf);

    /* Rank exactly ST_MAX_RANK and every dtype name the reader knows. */
    ok = 1;
    detail[0] = '\0';
    for (int d = 0; d < ST_DTYPE_COUNT && ok; d++) {
        char h[256];
        size_t sz = st_dtype_size((st_dtype)d);
        snprintf(h, sizeof h,
                 "{\"t\":{\"dtype\":\"%s\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[0,%zu]}}",
                 st_dtype_name((st_dtype)d), 2 * sz);
        buf = build(h, strlen(h), 2 * sz, &len);
        ok = st_parse(buf, len, &f, err, sizeof err) == 0 && f.count == 1 &&
             f.tensors[0].dtype == (st_dtype)d && f.tensors[0].rank == 8;
        if (!ok)
            snprintf(detail, sizeof detail, "dtype %s: %s", st_dtype_name((st_dtype)d), err);
        st_close(&f);
        free(buf);
    }
    report("good/every_dtype_rank8", ok, detail);
}

static void test_dtypes(void)
{
    static const struct {
        const char *name;
        size_t size;
    } want[] = {{"F64", 8}, {"F32", 4},  {"F16", 2}, {"BF16", 2}, {"I64", 8},
                {"I32", 4}, {"I16", 2},  {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
    int ok = 1;
    char detail[256] = "";
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        st_dtype d;
        if (st_dtype_parse(want[i].name, &d) != 0 || st_dtype_size(d) != want[i].size ||
            strcmp(st_dtype_name(d), want[i].name) != 0) {
            ok = 0;
            snprintf(detail, sizeof detail, "dtype %s", want[i].name);
        }
    }
    st_dtype d;
    if (st_dtype_parse("F128", &d) != -1 || st_dtype_parse("", &d) != -1 ||
        st_dtype_parse(NULL, &d) != -1 || st_dtype_size((st_dtype)99) != 0 ||
        st_dtype_name((st_dtype)-1) != NULL) {
        ok = 0;
        snprintf(detail, sizeof detail, "unknown dtypes not refused");
    }
    report("dtype/names_sizes", ok, detail);
}

/* ---------------------------------------------------------------------------------------------
 * files: round trip, atomic write, st_open errors
 */

static char tmp_root[256];

/* Number of entries in dir other than . and .., or -1 on error. */
static int dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            n++;
    }
    if (closedir(d) != 0)
        return -1;
    return n;
}

static void make_dir(char *out, size_t n, const char *leaf)
{
    snprintf(out, n, "%s/%s", tmp_root, leaf);
    if (mkdir(out, 0700) != 0) {
        fprintf(stderr, "mkdir %s: %s\n", out, strerror(errno));
        exit(2);
    }
}

static int read_whole(const char *path, unsigned char **out, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (fp == NULL)
        return -1;
    size_t cap = 4096, n = 0;
    unsigned char *b = malloc(cap);
    if (b == NULL) {
        fclose(fp);
        return -1;
    }
    for (;;) {
        if (n == cap) {
            unsigned char *nb = realloc(b, cap * 2);
            if (nb == NULL) {
                free(b);
                fclose(fp);
                return -1;
            }
            b = nb;
            cap *= 2;
        }
        size_t r = fread(b + n, 1, cap - n, fp);
        n += r;
        if (r == 0)
            break;
    }
    int bad = ferror(fp);
    if (fclose(fp) != 0 || bad) {
        free(b);
        return -1;
    }
    *out = b;
    *len = n;
    return 0;
}

#define RT_COUNT 16
static unsigned char rt_bytes[RT_COUNT][256];
static st_out rt_tensors[RT_COUNT];

static void setup_round_trip_tensors(void)
{
    static const struct {
        const char *name;
        st_dtype dtype;
        int rank;
        int64_t shape[ST_MAX_RANK];
    } spec[RT_COUNT] = {
        {"q.weight", ST_F32, 2, {2, 3}},
        {"odd_u8", ST_U8, 1, {3}}, /* 3 bytes: everything after it is misaligned */
        {"half", ST_F16, 1, {4}},
        {"brain", ST_BF16, 4, {1, 1, 1, 2}},
        {"scalar", ST_F64, 0, {0}},
        {"i64", ST_I64, 1, {3}},
        {"i32", ST_I32, 2, {2, 2}},
        {"i16", ST_I16, 1, {5}},
        {"i8", ST_I8, 1, {7}},
        {"empty_f32", ST_F32, 2, {0, 4}},
        {"flags", ST_BOOL, 1, {2}},
        {"empty_u8", ST_U8, 1, {0}},
        {"u16", ST_U16, 1, {3}},
        {"rank8", ST_F32, 8, {1, 2, 1, 2, 1, 1, 1, 2}},
        {"\xce\xb1\xce\xb2 \"quoted\" \\ name", ST_U64, 1, {2}},
        {"tail_empty", ST_F64, 3, {2, 0, 2}},
    };
    for (int i = 0; i < RT_COUNT; i++) {
        rt_tensors[i].name = spec[i].name;
        rt_tensors[i].dtype = spec[i].dtype;
        rt_tensors[i].rank = spec[i].rank;
        memcpy(rt_tensors[i].shape, spec[i].shape, sizeof spec[i].shape);
        for (int b = 0; b < 256; b++)
            rt_bytes[i][b] = (unsigned char)(b * 31 + i * 17 + 3);
        /* Zero-size tensors pass NULL data: allowed, and worth exercising. */
        uint64_t n = st_dtype_size(spec[i].dtype);
        for (int d = 0; d < spec[i].rank; d++)
            n *= (uint64_t)spec[i].shape[d];
        rt_tensors[i].data = n ? rt_bytes[i] : NULL;
    }
}

static const char *const rt_meta[] = {"format", "pt", "note", "h\xc3\xa9llo \"world\"\n", "empty",
                                      "", NULL};

static int compare_to_spec(const st_file *f, const st_out *want, int count,
                           const char *const *meta, char *detail, size_t dlen)
{
    if (f->count != count) {
        snprintf(detail, dlen, "count %d, want %d", f->count, count);
        return 0;
    }
    for (int i = 0; i < count; i++) {
        const st_tensor *t = &f->tensors[i];
        const st_out *w = &want[i];
        if (strcmp(t->name, w->name) != 0 || st_find(f, w->name) != t) {
            snprintf(detail, dlen, "tensor %d name '%s', want '%s'", i, t->name, w->name);
            return 0;
        }
        if (t->dtype != w->dtype || t->rank != w->rank) {
            snprintf(detail, dlen, "tensor %s dtype/rank differ", w->name);
            return 0;
        }
        uint64_t n = st_dtype_size(w->dtype);
        for (int d = 0; d < w->rank; d++) {
            if (t->shape[d] != w->shape[d]) {
                snprintf(detail, dlen, "tensor %s shape[%d] differs", w->name, d);
                return 0;
            }
            n *= (uint64_t)w->shape[d];
        }
        if (t->end - t->begin != n || (n > 0 && memcmp(t->data, w->data, n) != 0)) {
            snprintf(detail, dlen, "tensor %s bytes differ", w->name);
            return 0;
        }
    }
    int nm = 0;
    for (int i = 0; meta != NULL && meta[i] != NULL; i += 2, nm++) {
        const char *v = st_metadata(f, meta[i]);
        if (v == NULL || strcmp(v, meta[i + 1]) != 0) {
            snprintf(detail, dlen, "metadata %s differs", meta[i]);
            return 0;
        }
    }
    if (st_metadata_count(f) != nm) {
        snprintf(detail, dlen, "metadata count %d, want %d", st_metadata_count(f), nm);
        return 0;
    }
    return 1;
}

static void test_round_trip(void)
{
    char dir[512], path[600], err[512], detail[1024] = "";
    make_dir(dir, sizeof dir, "roundtrip");
    snprintf(path, sizeof path, "%s/out.safetensors", dir);

    int ok = st_write(path, rt_tensors, RT_COUNT, rt_meta, err, sizeof err) == 0;
    if (!ok)
        snprintf(detail, sizeof detail, "st_write: %s", err);
    st_file f;
    if (ok && st_open(path, &f, err, sizeof err) != 0) {
        ok = 0;
        snprintf(detail, sizeof detail, "st_open: %s", err);
    } else if (ok) {
        ok = compare_to_spec(&f, rt_tensors, RT_COUNT, rt_meta, detail, sizeof detail);
        /* The header is padded so the data region, and hence the first tensor, is 8-aligned. */
        if (ok && (((const unsigned char *)f.tensors[0].data - (const unsigned char *)f.map) % 8 != 0 ||
                   !st_is_aligned(&f.tensors[0]))) {
            ok = 0;
            snprintf(detail, sizeof detail, "data region not 8-byte aligned");
        }
        st_close(&f);
    }
    if (ok && dir_entries(dir) != 1) {
        ok = 0;
        snprintf(detail, sizeof detail, "directory holds %d entries, want 1 (temp left?)",
                 dir_entries(dir));
    }
    report("file/round_trip_all_dtypes", ok, detail);

    /* Overwrite in place with different content; the reader must see only the new file. */
    const st_out one[1] = {{"only", ST_I32, 1, {2}, "\x01\x00\x00\x00\x02\x00\x00\x00"}};
    ok = st_write(path, one, 1, NULL, err, sizeof err) == 0;
    snprintf(detail, sizeof detail, "st_write: %s", err);
    if (ok) {
        ok = st_open(path, &f, err, sizeof err) == 0;
        snprintf(detail, sizeof detail, "st_open: %s", err);
        if (ok)
            ok = compare_to_spec(&f, one, 1, NULL, detail, sizeof detail);
        st_close(&f);
    }
    if (ok && dir_entries(dir) != 1) {
        ok = 0;
        snprintf(detail, sizeof detail, "leftover files after overwrite");
    }
    report("file/overwrite", ok, detail);

    /* No tensors at all is a valid (if useless) file. */
    char epath[600];
    snprintf(epath, sizeof epath, "%s/empty.safetensors", dir);
    ok = st_write(epath, NULL, 0, NULL, err, sizeof err) == 0;
    snprintf(detail, sizeof detail, "st_write: %s", err);
    if (ok) {
        ok = st_open(epath, &f, err, sizeof err) == 0 && f.count == 0;
        snprintf(detail, sizeof detail, "st_open: %s", err);
        st_close(&f);
    }
    report("file/no_tensors", ok, detail);
}

/* Every strict prefix of a valid file must be rejected cleanly, and every single-byte
 * corruption must either be rejected or yield tensors whose bytes are all readable. */
static void test_truncation_and_mutation(void)
{
    char dir[512], path[600], err[512], detail[1024] = "";
    make_dir(dir, sizeof dir, "trunc");
    snprintf(path, sizeof path, "%s/t.safetensors", dir);
    unsigned char *full = NULL;
    size_t full_len = 0;
    if (st_write(path, rt_tensors, RT_COUNT, rt_meta, err, sizeof err) != 0 ||
        read_whole(path, &full, &full_len) != 0) {
        report("file/truncation", 0, "could not produce the valid file");
        return;
    }
    int ok = 1;
    st_file f;
    for (size_t len = 0; len < full_len && ok; len++) {
        /* An exact-size copy, so reading one byte too far is an ASan error, not luck. */
        unsigned char *cut = malloc(len ? len : 1);
        if (cut == NULL)
            exit(2);
        memcpy(cut, full, len);
        int rc = st_parse(len ? cut : NULL, len, &f, err, sizeof err);
        char why[512];
        if (!check_failure(rc, &f, err, "", why, sizeof why)) {
            ok = 0;
            snprintf(detail, sizeof detail, "length %zu of %zu: %s", len, full_len, why);
        }
        st_close(&f);
        free(cut);
    }
    /* And the full length itself must still parse. */
    if (ok && st_parse(full, full_len, &f, err, sizeof err) != 0) {
        ok = 0;
        snprintf(detail, sizeof detail, "full file rejected: %s", err);
    }
    st_close(&f);
    char name[64];
    snprintf(name, sizeof name, "file/truncation_0_to_%zu", full_len - 1);
    report(name, ok, detail);

    static const unsigned char values[] = {0x00, 0x01, 0x20, '"', '0', '9', '[', ']', '{', '}',
                                           ',', '-', '.', 'e', 0x7f, 0x80, 0xff};
    ok = 1;
    unsigned accepted = 0, rejected = 0;
    unsigned char *copy = malloc(full_len);
    if (copy == NULL)
        exit(2);
    for (size_t pos = 0; pos < full_len && ok; pos++) {
        for (size_t v = 0; v < sizeof values && ok; v++) {
            memcpy(copy, full, full_len);
            copy[pos] = values[v];
            int rc = st_parse(copy, full_len, &f, err, sizeof err);
            if (rc == 0) {
                accepted++;
                volatile unsigned sum = 0;
                for (int i = 0; i < f.count; i++) {
                    const unsigned char *p = f.tensors[i].data;
                    for (uint64_t b = 0; b < f.tensors[i].end - f.tensors[i].begin; b++)
                        sum += p[b];
                }
                (void)sum;
            } else {
                rejected++;
                if (!check_failure(rc, &f, err, "", detail, sizeof detail))
                    ok = 0;
            }
            st_close(&f);
        }
    }
    free(copy);
    if (ok)
        snprintf(detail, sizeof detail, "%u accepted, %u rejected", accepted, rejected);
    report("file/single_byte_mutations", ok && rejected > 0, detail);
    free(full);
}

static void test_write_failures(void)
{
    char dir[512], path[600], err[512], detail[1024];
    make_dir(dir, sizeof dir, "wfail");

    /* A directory that does not exist: nothing may be created anywhere. */
    snprintf(path, sizeof path, "%s/missing/out.safetensors", dir);
    int rc = st_write(path, rt_tensors, RT_COUNT, rt_meta, err, sizeof err);
    int ok = check_failure(rc, NULL, err, "missing/out.safetensors", detail, sizeof detail);
    struct stat sb;
    if (ok && (stat(path, &sb) == 0 || dir_entries(dir) != 0)) {
        ok = 0;
        snprintf(detail, sizeof detail, "something was created");
    }
    report("write_fail/missing_directory", ok, detail);

    /* Invalid requests are refused before any file exists. */
    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    static const char bad_utf8[] = {'a', (char)0xc3, 0};
    struct {
        const char *name;
        st_out t[2];
        int count;
        const char *const *meta;
        const char *expect;
    } rows[] = {
        {"duplicate_name", {{"a", ST_U8, 1, {1}, "x"}, {"a", ST_U8, 1, {1}, "y"}}, 2, NULL,
         "duplicate tensor name \"a\""},
        {"reserved_name", {{"__metadata__", ST_U8, 1, {1}, "x"}}, 1, NULL, "reserved"},
        {"null_name", {{NULL, ST_U8, 1, {1}, "x"}}, 1, NULL, "no name"},
        {"bad_utf8_name", {{bad_utf8, ST_U8, 1, {1}, "x"}}, 1, NULL, "not valid UTF-8"},
        {"bad_dtype", {{"a", (st_dtype)77, 1, {1}, "x"}}, 1, NULL, "invalid dtype 77"},
        {"negative_rank", {{"a", ST_U8, -1, {1}, "x"}}, 1, NULL, "rank -1"},
        {"rank_9", {{"a", ST_U8, 9, {1}, "x"}}, 1, NULL, "rank 9"},
        {"negative_dim", {{"a", ST_U8, 2, {1, -3}, "x"}}, 1, NULL, "shape[1] is negative"},
        {"numel_overflow", {{"a", ST_U8, 2, {INT64_MAX, 4}, "x"}}, 1, NULL, "overflows"},
        {"null_data", {{"a", ST_F32, 1, {2}, NULL}}, 1, NULL, "no data for 8 bytes"},
        {"meta_missing_value", {{"a", ST_U8, 1, {1}, "x"}}, 1,
         (const char *const[]){"k", NULL, NULL}, "has no value"},
        {"meta_duplicate", {{"a", ST_U8, 1, {1}, "x"}}, 1,
         (const char *const[]){"k", "1", "k", "2", NULL}, "duplicate metadata key"},
        {"meta_bad_utf8", {{"a", ST_U8, 1, {1}, "x"}}, 1,
         (const char *const[]){"k", bad_utf8, NULL}, "not valid UTF-8"},
    };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        rc = st_write(path, rows[r].t, rows[r].count, rows[r].meta, err, sizeof err);
        ok = check_failure(rc, NULL, err, rows[r].expect, detail, sizeof detail);
        if (ok && dir_entries(dir) != 0) {
            ok = 0;
            snprintf(detail, sizeof detail, "a file was left behind");
        }
        char name[128];
        snprintf(name, sizeof name, "write_fail/%s", rows[r].name);
        report(name, ok, detail);
    }

    /* A failure after the temporary exists (file size limit hit mid-write) must remove it. */
    static unsigned char big[65536];
    const st_out bt[1] = {{"big", ST_U8, 1, {sizeof big}, big}};
    struct rlimit old;
    ok = 0;
    snprintf(detail, sizeof detail, "could not lower RLIMIT_FSIZE");
    if (getrlimit(RLIMIT_FSIZE, &old) == 0) {
        struct rlimit lim = old;
        lim.rlim_cur = 4096;
        void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
        if (setrlimit(RLIMIT_FSIZE, &lim) == 0) {
            rc = st_write(path, bt, 1, NULL, err, sizeof err);
            if (setrlimit(RLIMIT_FSIZE, &old) != 0) {
                fprintf(stderr, "cannot restore RLIMIT_FSIZE\n");
                exit(2);
            }
            ok = check_failure(rc, NULL, err, "cannot write", detail, sizeof detail);
            if (ok && dir_entries(dir) != 0) {
                ok = 0;
                snprintf(detail, sizeof detail, "temporary left behind after failed write");
            }
        }
        signal(SIGXFSZ, prev);
    }
    report("write_fail/file_size_limit_cleans_temp", ok, detail);
}

static void test_open_errors(void)
{
    char dir[512], path[600], err[512], detail[1024], want[700];
    make_dir(dir, sizeof dir, "open");
    st_file f;

    snprintf(path, sizeof path, "%s/absent.safetensors", dir);
    snprintf(want, sizeof want, "cannot open %s: No such file or directory", path);
    int rc = st_open(path, &f, err, sizeof err);
    int ok = check_failure(rc, &f, err, want, detail, sizeof detail);
    if (ok && strcmp(err, want) != 0) {
        ok = 0;
        snprintf(detail, sizeof detail, "got '%s'", err);
    }
    report("open/missing_file", ok, detail);
    st_close(&f);

    /* The file name leads the parser's message. */
    snprintf(path, sizeof path, "%s/q.safetensors", dir);
    unsigned char img[120];
    memset(img, ' ', sizeof img);
    uint64_t h = 9999;
    for (int i = 0; i < 8; i++)
        img[i] = (unsigned char)(h >> (8 * i));
    FILE *fp = fopen(path, "wb");
    ok = fp != NULL && fwrite(img, 1, sizeof img, fp) == sizeof img;
    if (fp != NULL && fclose(fp) != 0)
        ok = 0;
    snprintf(want, sizeof want, "%s: header length 9999 exceeds file size 120", path);
    if (ok) {
        rc = st_open(path, &f, err, sizeof err);
        ok = check_failure(rc, &f, err, want, detail, sizeof detail);
    } else {
        snprintf(detail, sizeof detail, "could not write the test file");
    }
    report("open/bad_header_names_file", ok, detail);
    st_close(&f);

    snprintf(path, sizeof path, "%s/empty.safetensors", dir);
    fp = fopen(path, "wb");
    ok = fp != NULL && fclose(fp) == 0;
    if (ok) {
        rc = st_open(path, &f, err, sizeof err);
        ok = check_failure(rc, &f, err, "empty.safetensors: file too short", detail, sizeof detail);
    }
    report("open/empty_file", ok, detail);
    st_close(&f);

    rc = st_open(dir, &f, err, sizeof err);
    ok = check_failure(rc, &f, err, "not a regular file", detail, sizeof detail);
    report("open/directory", ok, detail);
    st_close(&f);

    /* A tiny err buffer still gets a terminated (truncated) message; NULL err is tolerated. */
    char tiny[8];
    rc = st_open(path, &f, tiny, sizeof tiny);
    ok = rc == -1 && strlen(tiny) == 7 && st_open(path, &f, NULL, 0) == -1;
    report("open/small_error_buffer", ok, "not truncated or crashed");
    st_close(&f);
    st_file zero;
    memset(&zero, 0, sizeof zero);
    st_close(&zero);
    st_close(NULL);
}

static void remove_tree(const char *path)
{
    DIR *d = opendir(path);
    if (d != NULL) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            char sub[1024];
            snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
            remove_tree(sub);
        }
        if (closedir(d) != 0)
            fprintf(stderr, "warning: cannot close %s: %s\n", path, strerror(errno));
        if (rmdir(path) != 0)
            fprintf(stderr, "warning: cannot remove %s: %s\n", path, strerror(errno));
    } else if (unlink(path) != 0) {
        fprintf(stderr, "warning: cannot remove %s: %s\n", path, strerror(errno));
    }
}

int main(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(tmp_root, sizeof tmp_root, "%s/test_st_XXXXXX", base && *base ? base : "/tmp");
    if (mkdtemp(tmp_root) == NULL) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return 2;
    }
    setup_round_trip_tensors();

    test_dtypes();
    test_bad_lengths();
    test_bad_headers();
    test_good_headers();
    test_round_trip();
    test_truncation_and_mutation();
    test_write_failures();
    test_open_errors();

    remove_tree(tmp_root);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}
