/* fuzz_data.c — libFuzzer target for the JSONL training-data reader (train/data.c).
 *
 * The input's first byte picks the reader's options (the vocabulary, max_len and pad_target, from
 * the small tables below; mask_prompt and refuse_text, its top bits); the rest is the file. It is written to a memfd and read through
 * /proc/self/fd/N with dataset_load itself, so the path the trainer takes (open, the regular-file
 * check, getline, the end-of-file and read-error checks) is the one fuzzed. The contract checked:
 *   -1: a non-empty message of one line that starts with the path; the dataset left empty;
 *    0: count >= 1 and targets >= 1; every sequence has len >= 2 (and <= max_len + pad_target
 *       when max_len is set), every token in [0, vocab), a target_mask of len - 1 entries or
 *       NULL; targets = the masked targets summed over the sequences; longest = the longest len.
 * A broken contract abort()s; ASan, UBSan and LeakSanitizer catch the rest.
 *
 * Build: make fuzz (into $(BUILD)/fuzz/); run: make fuzz-check, or see docs/fuzzing.md.
 */
#define _GNU_SOURCE
#include "data.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const int vocabs[8] = {1, 2, 3, 258, 259, 512, 262144, 1 << 24};
static const int max_lens[4] = {0, 1, 2, 7};

static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    data_options opt = {.vocab = vocabs[data[0] & 7], .max_len = max_lens[(data[0] >> 3) & 3],
                        .pad_target = (data[0] >> 5) & 1, .mask_prompt = (data[0] >> 6) & 1,
                        .refuse_text = (data[0] >> 7) & 1};
    data++;
    size--;
    int fd = memfd_create("fuzz_data", MFD_CLOEXEC);
    if (fd < 0 || write_all(fd, data, size) != 0) abort(); /* the harness, not the reader */
    char path[64], err[512];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    dataset d;
    err[0] = '\0';
    int rc = dataset_load(path, &opt, &d, err, sizeof err);
    close(fd);
    if (rc != 0) {
        size_t n = strlen(path);
        if (rc != -1 || strncmp(err, path, n) != 0 || (err[n] != ':') || strlen(err) <= n + 2 ||
            strchr(err, '\n') != NULL || strchr(err, '\r') != NULL || d.count != 0 || d.seq != NULL)
            abort();
        return 0;
    }
    if (d.count < 1 || d.targets < 1 || d.seq == NULL) abort();
    long targets = 0;
    int longest = 0;
    for (int i = 0; i < d.count; i++) {
        const sequence *s = &d.seq[i];
        if (s->len < 2 || !s->tokens) abort();
        if (opt.max_len > 0 && s->len > opt.max_len + opt.pad_target) abort();
        for (int t = 0; t < s->len; t++)
            if (s->tokens[t] < 0 || s->tokens[t] >= opt.vocab) abort();
        for (int t = 0; t < s->len - 1; t++) targets += !s->target_mask || s->target_mask[t];
        if (s->len > longest) longest = s->len;
    }
    if (targets != d.targets || longest != d.longest) abort();
    dataset_free(&d);
    if (d.count != 0 || d.seq != NULL) abort();
    return 0;
}
