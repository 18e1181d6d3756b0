/* checkpoint.c — see checkpoint.h. */
#define _GNU_SOURCE
#include "checkpoint.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const text_prefixes[] = {"model.", "model.language_model.", "language_model.model.", ""};

static int open_index(const char *dir, const char *index_path, checkpoint *ck, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(index_path, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        snprintf(err, errlen, "%s: not valid JSON (line %d: %s)", index_path, je.line, je.text);
        return -1;
    }
    const json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map) || json_object_size(map) == 0) {
        snprintf(err, errlen, "%s: no \"weight_map\" object", index_path);
        json_decref(root);
        return -1;
    }
    /* the distinct shard names, in first-seen order */
    size_t cap = json_object_size(map);
    const char **names = calloc(cap, sizeof *names);
    int count = 0, rc = 0;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)map, key, val) {
        const char *file = json_string_value(val);
        if (!file || !*file || strchr(file, '/') || strcmp(file, "..") == 0) {
            snprintf(err, errlen, "%s: weight_map[\"%s\"] must be a file name in the same directory", index_path, key);
            rc = -1;
            break;
        }
        int seen = 0;
        for (int i = 0; i < count && !seen; i++) seen = strcmp(names[i], file) == 0;
        if (!seen) names[count++] = file;
    }
    ck->files = rc ? NULL : calloc((size_t)count, sizeof *ck->files);
    for (int i = 0; rc == 0 && i < count; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (st_open(path, &ck->files[i], err, errlen) != 0) rc = -1;
        else ck->file_count = i + 1;
    }
    /* every mapped tensor must be in the shard the index names */
    for (int i = 0; rc == 0 && i < count; i++) {
        json_object_foreach((json_t *)map, key, val) {
            if (strcmp(json_string_value(val), names[i]) == 0 && !st_find(&ck->files[i], key)) {
                snprintf(err, errlen, "%s/%s: tensor \"%s\" listed in the index is missing", dir, names[i], key);
                rc = -1;
                break;
            }
        }
    }
    free(names);
    json_decref(root);
    return rc;
}

int checkpoint_open(const char *dir, checkpoint *ck, char *err, size_t errlen) {
    memset(ck, 0, sizeof *ck);
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    int rc;
    if (stat(path, &sb) == 0) {
        rc = open_index(dir, path, ck, err, errlen);
    } else {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        ck->files = calloc(1, sizeof *ck->files);
        rc = st_open(path, &ck->files[0], err, errlen);
        if (rc == 0) ck->file_count = 1;
    }
    if (rc == 0) {
        rc = -1;
        for (size_t i = 0; i < sizeof text_prefixes / sizeof *text_prefixes && rc; i++) {
            snprintf(ck->prefix, sizeof ck->prefix, "%s", text_prefixes[i]);
            if (checkpoint_find(ck, "embed_tokens.weight")) rc = 0;
        }
        if (rc) snprintf(err, errlen, "%s: no embed_tokens.weight under any known prefix (model., model.language_model., language_model.model.)", dir);
    }
    if (rc) checkpoint_close(ck);
    return rc;
}

const st_tensor *checkpoint_find(const checkpoint *ck, const char *text_name) {
    char name[512];
    snprintf(name, sizeof name, "%s%s", ck->prefix, text_name);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < ck->file_count; i++) {
            const st_tensor *t = st_find(&ck->files[i], name);
            if (t) return t;
        }
        if (strcmp(text_name, "lm_head.weight") != 0) break;
        snprintf(name, sizeof name, "%s", text_name);
    }
    return NULL;
}

void checkpoint_close(checkpoint *ck) {
    for (int i = 0; i < ck->file_count; i++) st_close(&ck->files[i]);
    free(ck->files);
    memset(ck, 0, sizeof *ck);
}

/* An element is NaN or ±inf exactly when its exponent field is all ones. Blocks of elements are
 * first OR-reduced into one flag (a loop compilers vectorise); only a block that holds a bad one
 * is scanned again for its index. */
#define NONFINITE_SCAN(UINT, EXP_MASK)                                                              \
    do {                                                                                            \
        const unsigned char *p = t->data;                                                           \
        for (uint64_t start = 0; start < n; start += 4096) {                                        \
            uint64_t end = n - start < 4096 ? n : start + 4096;                                     \
            int bad = 0;                                                                            \
            for (uint64_t i = start; i < end; i++) {                                                \
                UINT v;                                                                             \
                memcpy(&v, p + i * sizeof v, sizeof v);                                             \
                bad |= (v & (EXP_MASK)) == (EXP_MASK);                                              \
            }                                                                                       \
            for (uint64_t i = start; bad && i < end; i++) {                                         \
                UINT v;                                                                             \
                memcpy(&v, p + i * sizeof v, sizeof v);                                             \
                if ((v & (EXP_MASK)) == (EXP_MASK)) return *index = i, 1;                           \
            }                                                                                       \
        }                                                                                           \
    } while (0)

int st_tensor_first_nonfinite(const st_tensor *t, uint64_t *index) {
    uint64_t n = st_numel(t);
    switch (t->dtype) {
    case ST_F64: NONFINITE_SCAN(uint64_t, 0x7ff0000000000000ULL); break;
    case ST_F32: NONFINITE_SCAN(uint32_t, 0x7f800000u); break;
    case ST_F16: NONFINITE_SCAN(uint16_t, 0x7c00u); break;
    case ST_BF16: NONFINITE_SCAN(uint16_t, 0x7f80u); break;
    default: break;
    }
    return 0;
}

const char *st_tensor_value_kind(const st_tensor *t, uint64_t index) {
    /* exponent mask, the rest below the sign bit (the mantissa), and the sign bit */
    uint64_t v = 0, exp, sign;
    const unsigned char *p = t->data;
    switch (t->dtype) {
    case ST_F64: memcpy(&v, p + 8 * index, 8); exp = 0x7ff0000000000000ULL; sign = 1ULL << 63; break;
    case ST_F32: { uint32_t w; memcpy(&w, p + 4 * index, 4); v = w; exp = 0x7f800000u; sign = 1u << 31; break; }
    case ST_F16: { uint16_t w; memcpy(&w, p + 2 * index, 2); v = w; exp = 0x7c00u; sign = 0x8000u; break; }
    case ST_BF16: { uint16_t w; memcpy(&w, p + 2 * index, 2); v = w; exp = 0x7f80u; sign = 0x8000u; break; }
    default: return "finite";
    }
    if ((v & exp) != exp) return "finite";
    if (v & (sign - 1) & ~exp) return "NaN";
    return v & sign ? "-inf" : "inf";
}
