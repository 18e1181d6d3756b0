/* make_corpus.c — writes the seed files for fuzz_safetensors into a directory.
 *
 * A fuzzer starting from valid files reaches the deep checks (offsets, overlaps, holes) far
 * sooner than one starting from nothing, so the seeds cover each header feature once: several
 * dtypes, a scalar, zero-size tensors, metadata, rank 8, an empty file, and a hand-written header
 * with leading/trailing spaces, unsorted offsets and misaligned data (which st_write never
 * produces). Seeds are kept to a few hundred bytes so mutations stay cheap.
 *
 * Build and run from the repository root:
 *   gcc -std=c11 -O2 -Wall -Wextra -Iformats formats/safetensors.c formats/atomic_file.c tests/fuzz/make_corpus.c \
 *       -ljansson -o /tmp/make_corpus && /tmp/make_corpus tests/fuzz/corpus
 */
#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static unsigned char pattern[512];
static int failures;

static void seed(const char *dir, const char *name, const st_out *t, int count,
                 const char *const *meta)
{
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (st_write(path, t, count, meta, err, sizeof err) != 0) {
        fprintf(stderr, "make_corpus: %s\n", err);
        failures++;
    }
}

/* For layouts st_write cannot produce; verified with st_parse so a typo cannot slip in. */
static void raw_seed(const char *dir, const char *name, const char *header, size_t data_len)
{
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t hlen = strlen(header);
    size_t len = 8 + hlen + data_len;
    unsigned char *buf = malloc(len);
    if (buf == NULL) {
        fprintf(stderr, "make_corpus: out of memory\n");
        failures++;
        return;
    }
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(buf + 8, header, hlen);
    memcpy(buf + 8 + hlen, pattern, data_len);
    st_file f;
    if (st_parse(buf, len, &f, err, sizeof err) != 0) {
        fprintf(stderr, "make_corpus: %s is invalid: %s\n", name, err);
        failures++;
        free(buf);
        return;
    }
    st_close(&f);
    FILE *fp = fopen(path, "wb");
    if (fp == NULL) {
        fprintf(stderr, "make_corpus: cannot create %s: %s\n", path, strerror(errno));
        failures++;
    } else {
        int bad = fwrite(buf, 1, len, fp) != len;
        if (fclose(fp) != 0 || bad) {
            fprintf(stderr, "make_corpus: cannot write %s\n", path);
            failures++;
        }
    }
    free(buf);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_corpus DIR\n");
        return 2;
    }
    const char *dir = argv[1];
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "make_corpus: cannot create %s: %s\n", dir, strerror(errno));
        return 1;
    }
    for (size_t i = 0; i < sizeof pattern; i++)
        pattern[i] = (unsigned char)(i * 37 + 11);

    const st_out f32[] = {{"weight", ST_F32, 2, {2, 3}, pattern}};
    const char *const meta[] = {"format", "pt", "source", "winattn", NULL};
    seed(dir, "f32_with_metadata.safetensors", f32, 1, meta);

    const st_out mixed[] = {
        {"h", ST_F16, 1, {4}, pattern},          {"b", ST_BF16, 2, {2, 2}, pattern},
        {"i", ST_I64, 1, {1}, pattern},          {"u", ST_U8, 1, {3}, pattern},
        {"flag", ST_BOOL, 1, {2}, pattern},      {"s", ST_F64, 0, {0}, pattern},
        {"i32", ST_I32, 1, {2}, pattern},        {"i16", ST_I16, 1, {1}, pattern},
        {"i8", ST_I8, 1, {1}, pattern},
    };
    seed(dir, "mixed_dtypes.safetensors", mixed, (int)(sizeof mixed / sizeof mixed[0]), NULL);

    const st_out zero[] = {{"e", ST_F32, 2, {0, 4}, NULL},
                           {"x", ST_I8, 1, {2}, pattern},
                           {"z", ST_U8, 1, {0}, NULL}};
    seed(dir, "zero_size.safetensors", zero, 3, NULL);

    seed(dir, "empty.safetensors", NULL, 0, NULL);

    const st_out qkv[] = {{"q", ST_F16, 4, {1, 1, 4, 8}, pattern},
                          {"k", ST_F16, 4, {1, 1, 4, 8}, pattern + 64},
                          {"v", ST_F16, 4, {1, 1, 4, 8}, pattern + 128}};
    const char *const window[] = {"left", "3", "right", "0", NULL};
    seed(dir, "attention_qkv.safetensors", qkv, 3, window);

    const st_out r8[] = {{"r8", ST_U16, 8, {1, 2, 1, 1, 2, 1, 1, 2}, pattern}};
    seed(dir, "rank8.safetensors", r8, 1, NULL);

    raw_seed(dir, "unsorted_misaligned.safetensors",
             "  {\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[1,9]},"
             "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
             "\"\xce\xb1\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[9,9]},"
             "\"__metadata__\":{\"k\":\"v\\u00e9\\n\"}}     ",
             9);

    return failures != 0;
}
