/* safetensors.c — reader and writer for safetensors files (see safetensors.h).
 *
 * The reader treats every file as hostile: the JSON header is parsed with jansson and each field
 * checked for exact type and range, sizes are computed with overflow checks, and the tensors are
 * required to tile the data region exactly (no overlaps, no holes), as the reference
 * implementation does. Only after all of that does anyone get a pointer into the data.
 * The writer builds the header with jansson and hands the bytes to out_open (atomic_file.c): a file
 * is replaced atomically (temporary + fsync + rename) so a crash or a full disk never leaves a
 * half-written file behind; a symlink's target is replaced the same way, a device or FIFO is
 * written directly.
 */
#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"
#include "atomic_file.h" /* out_open: how an output path is written */

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * dtypes
 */

static const struct {
    const char *name;
    size_t size;
} dtype_table[ST_DTYPE_COUNT] = {
    [ST_F64] = {"F64", 8},          [ST_F32] = {"F32", 4},          [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2},        [ST_I64] = {"I64", 8},          [ST_I32] = {"I32", 4},
    [ST_I16] = {"I16", 2},          [ST_I8] = {"I8", 1},            [ST_U8] = {"U8", 1},
    [ST_BOOL] = {"BOOL", 1},        [ST_U16] = {"U16", 2},          [ST_U32] = {"U32", 4},
    [ST_U64] = {"U64", 8},          [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
};

/* The enum may be handed to us as any int (e.g. from a cast), so range-check before indexing. */
static int dtype_valid(st_dtype dtype)
{
    return (int)dtype >= 0 && (int)dtype < ST_DTYPE_COUNT;
}

size_t st_dtype_size(st_dtype dtype)
{
    return dtype_valid(dtype) ? dtype_table[dtype].size : 0;
}

const char *st_dtype_name(st_dtype dtype)
{
    return dtype_valid(dtype) ? dtype_table[dtype].name : NULL;
}

int st_dtype_parse(const char *name, st_dtype *out)
{
    if (name == NULL)
        return -1;
    for (int i = 0; i < ST_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_table[i].name) == 0) {
            if (out != NULL)
                *out = (st_dtype)i;
            return 0;
        }
    }
    return -1;
}

/* ---------------------------------------------------------------------------------------------
 * UTF-8
 */

/* Length of the valid UTF-8 sequence starting at p (1..4), or 0 if p does not start one. The
 * rules match jansson's: no overlong forms, no surrogates, nothing above U+10FFFF. A NUL inside a
 * sequence fails the continuation test, so this never reads past a terminator. */
static int utf8_seq_len(const unsigned char *p)
{
    unsigned char c = p[0];
    int extra;
    uint32_t cp;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        extra = 1;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        extra = 2;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        extra = 3;
        cp = c & 0x07;
    } else {
        return 0;
    }
    for (int i = 1; i <= extra; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    if ((extra == 2 && cp < 0x800) || (extra == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return extra + 1;
}

/* Jansson refuses strings that are not valid UTF-8 and reports only NULL; checking first lets
 * the writer tell the caller which name is bad instead of guessing "out of memory". */
static int utf8_valid(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p != 0) {
        int n = utf8_seq_len(p);
        if (n == 0)
            return 0;
        p += n;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * error messages
 */

/* Messages must stay on one line of valid UTF-8 even when they quote attacker-controlled names,
 * jansson's echo of the offending input, or are cut short by a small buffer, so control
 * characters and bytes that do not form a valid UTF-8 sequence are replaced after formatting. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 3, 4)))
#endif
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    if (n < 0) {
        err[0] = '\0';
        return;
    }
    unsigned char *p = (unsigned char *)err;
    while (*p != 0) {
        int len = utf8_seq_len(p);
        if (len == 0 || (len == 1 && (*p < 0x20 || *p == 0x7f))) {
            *p++ = '?';
            continue;
        }
        p += len;
    }
}

/* Names can be megabytes long; quoting them whole would push the actual problem out of a
 * fixed-size err buffer. Keep a prefix, cut on a UTF-8 character boundary. */
#define SHORT_NAME_MAX 64
typedef struct short_name {
    char s[SHORT_NAME_MAX + 4];
} short_name;

static short_name shorten(const char *name)
{
    short_name out;
    size_t len = strlen(name);
    if (len <= SHORT_NAME_MAX) {
        memcpy(out.s, name, len + 1);
        return out;
    }
    size_t cut = SHORT_NAME_MAX;
    /* Back up over continuation bytes so we never split a multi-byte character. */
    while (cut > 0 && ((unsigned char)name[cut] & 0xC0) == 0x80)
        cut--;
    memcpy(out.s, name, cut);
    memcpy(out.s + cut, "...", 4);
    return out;
}

/* ---------------------------------------------------------------------------------------------
 * small helpers
 */

static uint64_t load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static void store_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* 0 and *out = a * b, or -1 if that does not fit in 64 bits. */
static int mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a)
        return -1;
    *out = a * b;
    return 0;
}

static char *copy_string(const char *s)
{
    size_t len = strlen(s);
    char *p = malloc(len + 1);
    if (p != NULL)
        memcpy(p, s, len + 1);
    return p;
}

/* ---------------------------------------------------------------------------------------------
 * reading
 */

void st_close(st_file *f)
{
    if (f == NULL)
        return;
    if (f->tensors != NULL) {
        for (int i = 0; i < f->count; i++)
            free(f->tensors[i].name);
        free(f->tensors);
    }
    if (f->meta != NULL) {
        for (int i = 0; i < f->meta_count; i++) {
            free(f->meta[2 * i]);
            free(f->meta[2 * i + 1]);
        }
        free(f->meta);
    }
    /* munmap can only fail for arguments we did not get from mmap; nothing to report to. */
    if (f->map != NULL)
        (void)munmap(f->map, f->map_size);
    memset(f, 0, sizeof *f);
}

/* Read a JSON value that must be an exact, non-negative integer (jansson keeps 1 and 1.0
 * apart, so reals are refused here rather than silently truncated). */
static int get_nonneg_int(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v))
        return -1;
    json_int_t x = json_integer_value(v);
    if (x < 0)
        return -2;
    *out = (uint64_t)x;
    return 0;
}

static int parse_metadata(const json_t *obj, st_file *f, char *err, size_t errlen)
{
    /* MLX (mx.save_safetensors without metadata, as mlx-lm saves adapters) writes null: no entries */
    if (json_is_null(obj))
        return 0;
    if (!json_is_object(obj)) {
        set_err(err, errlen, "__metadata__ is not an object");
        return -1;
    }
    size_t n = json_object_size(obj);
    if (n == 0)
        return 0;
    if (n > INT_MAX / 2) {
        set_err(err, errlen, "__metadata__ has too many entries (%zu)", n);
        return -1;
    }
    f->meta = calloc(2 * n, sizeof *f->meta);
    if (f->meta == NULL) {
        set_err(err, errlen, "out of memory reading __metadata__");
        return -1;
    }
    const char *key;
    const json_t *value;
    json_object_foreach((json_t *)obj, key, value) {
        if (!json_is_string(value)) {
            set_err(err, errlen, "__metadata__ value for key \"%s\" is not a string",
                    shorten(key).s);
            return -1;
        }
        int i = f->meta_count;
        /* Count the slot before filling it so st_close frees a half-filled pair. */
        f->meta_count++;
        f->meta[2 * i] = copy_string(key);
        f->meta[2 * i + 1] = copy_string(json_string_value(value));
        if (f->meta[2 * i] == NULL || f->meta[2 * i + 1] == NULL) {
            set_err(err, errlen, "out of memory reading __metadata__");
            return -1;
        }
    }
    return 0;
}

static int parse_tensor(const char *name, const json_t *entry, uint64_t data_size, st_tensor *t,
                        char *err, size_t errlen)
{
    /* shorten() returns by value; keep the copy alive for the whole function. */
    short_name sn = shorten(name);
    const char *qn = sn.s;

    if (!json_is_object(entry)) {
        set_err(err, errlen, "tensor \"%s\": entry is not an object", qn);
        return -1;
    }
    const char *key;
    const json_t *value;
    json_object_foreach((json_t *)entry, key, value) {
        if (strcmp(key, "dtype") != 0 && strcmp(key, "shape") != 0 &&
            strcmp(key, "data_offsets") != 0) {
            set_err(err, errlen, "tensor \"%s\": unknown key \"%s\"", qn, shorten(key).s);
            return -1;
        }
    }

    const json_t *dtype = json_object_get(entry, "dtype");
    if (dtype == NULL) {
        set_err(err, errlen, "tensor \"%s\": missing \"dtype\"", qn);
        return -1;
    }
    if (!json_is_string(dtype)) {
        set_err(err, errlen, "tensor \"%s\": \"dtype\" is not a string", qn);
        return -1;
    }
    if (st_dtype_parse(json_string_value(dtype), &t->dtype) != 0) {
        set_err(err, errlen, "tensor \"%s\": unknown dtype \"%s\"", qn,
                shorten(json_string_value(dtype)).s);
        return -1;
    }

    const json_t *shape = json_object_get(entry, "shape");
    if (shape == NULL) {
        set_err(err, errlen, "tensor \"%s\": missing \"shape\"", qn);
        return -1;
    }
    if (!json_is_array(shape)) {
        set_err(err, errlen, "tensor \"%s\": \"shape\" is not an array", qn);
        return -1;
    }
    size_t rank = json_array_size(shape);
    if (rank > ST_MAX_RANK) {
        set_err(err, errlen, "tensor \"%s\": rank %zu exceeds the maximum of %d", qn, rank,
                ST_MAX_RANK);
        return -1;
    }
    t->rank = (int)rank;
    uint64_t numel = 1;
    int numel_overflow = 0;
    for (size_t i = 0; i < rank; i++) {
        uint64_t dim;
        int rc = get_nonneg_int(json_array_get(shape, i), &dim);
        if (rc == -1) {
            set_err(err, errlen, "tensor \"%s\": \"shape\"[%zu] is not an integer", qn, i);
            return -1;
        }
        if (rc == -2) {
            set_err(err, errlen, "tensor \"%s\": \"shape\"[%zu] is negative", qn, i);
            return -1;
        }
        t->shape[i] = (int64_t)dim;
        /* Keep checking the remaining dims for type errors before reporting overflow; a later
         * 0 does not excuse the overflow because consumers multiply in their own order. */
        if (mul_u64(numel, dim, &numel) != 0)
            numel_overflow = 1;
    }

    const json_t *offs = json_object_get(entry, "data_offsets");
    if (offs == NULL) {
        set_err(err, errlen, "tensor \"%s\": missing \"data_offsets\"", qn);
        return -1;
    }
    if (!json_is_array(offs) || json_array_size(offs) != 2) {
        set_err(err, errlen, "tensor \"%s\": \"data_offsets\" is not an array of two integers",
                qn);
        return -1;
    }
    for (size_t i = 0; i < 2; i++) {
        uint64_t v;
        int rc = get_nonneg_int(json_array_get(offs, i), &v);
        if (rc == -1) {
            set_err(err, errlen, "tensor \"%s\": \"data_offsets\"[%zu] is not an integer", qn, i);
            return -1;
        }
        if (rc == -2) {
            set_err(err, errlen, "tensor \"%s\": \"data_offsets\"[%zu] is negative", qn, i);
            return -1;
        }
        if (i == 0)
            t->begin = v;
        else
            t->end = v;
    }
    if (t->begin > t->end) {
        set_err(err, errlen, "tensor \"%s\": data_offsets begin %llu is after end %llu", qn,
                (unsigned long long)t->begin, (unsigned long long)t->end);
        return -1;
    }
    if (t->end > data_size) {
        set_err(err, errlen,
                "tensor \"%s\": data_offsets end %llu is beyond the data region of %llu bytes", qn,
                (unsigned long long)t->end, (unsigned long long)data_size);
        return -1;
    }

    if (numel_overflow) {
        set_err(err, errlen, "tensor \"%s\": element count overflows 64 bits", qn);
        return -1;
    }
    uint64_t nbytes;
    if (mul_u64(numel, st_dtype_size(t->dtype), &nbytes) != 0) {
        set_err(err, errlen, "tensor \"%s\": byte size of %llu %s elements overflows 64 bits", qn,
                (unsigned long long)numel, st_dtype_name(t->dtype));
        return -1;
    }
    if (nbytes != t->end - t->begin) {
        set_err(err, errlen,
                "tensor \"%s\": data_offsets span %llu bytes but %llu %s elements need %llu", qn,
                (unsigned long long)(t->end - t->begin), (unsigned long long)numel,
                st_dtype_name(t->dtype), (unsigned long long)nbytes);
        return -1;
    }
    return 0;
}

typedef struct span {
    uint64_t begin, end;
    int index;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The tensors must tile [0, data_size) exactly. Overlaps would let one tensor's writes alias
 * another's, and holes are bytes no tensor describes — both are rejected by the reference
 * implementation, so files we accept are files everyone accepts. */
static int check_coverage(const st_file *f, uint64_t data_size, char *err, size_t errlen)
{
    if (f->count == 0) {
        if (data_size != 0) {
            set_err(err, errlen,
                    "data region bytes [0, %llu) are not covered by any tensor (no tensors)",
                    (unsigned long long)data_size);
            return -1;
        }
        return 0;
    }
    span *spans = malloc((size_t)f->count * sizeof *spans);
    if (spans == NULL) {
        set_err(err, errlen, "out of memory checking tensor offsets");
        return -1;
    }
    for (int i = 0; i < f->count; i++) {
        spans[i].begin = f->tensors[i].begin;
        spans[i].end = f->tensors[i].end;
        spans[i].index = i;
    }
    qsort(spans, (size_t)f->count, sizeof *spans, span_cmp);

    uint64_t cursor = 0;
    int last = -1; /* the tensor that moved cursor to where it is */
    int rc = 0;
    for (int i = 0; i < f->count; i++) {
        const span *s = &spans[i];
        if (s->begin < cursor) {
            const st_tensor *a = &f->tensors[last];
            const st_tensor *b = &f->tensors[s->index];
            set_err(err, errlen, "tensors \"%s\" [%llu, %llu) and \"%s\" [%llu, %llu) overlap",
                    shorten(a->name).s, (unsigned long long)a->begin, (unsigned long long)a->end,
                    shorten(b->name).s, (unsigned long long)b->begin, (unsigned long long)b->end);
            rc = -1;
            break;
        }
        if (s->begin > cursor) {
            set_err(err, errlen, "data region bytes [%llu, %llu) are not covered by any tensor",
                    (unsigned long long)cursor, (unsigned long long)s->begin);
            rc = -1;
            break;
        }
        if (s->end > cursor || last < 0) {
            cursor = s->end;
            last = s->index;
        }
    }
    if (rc == 0 && cursor != data_size) {
        set_err(err, errlen, "data region bytes [%llu, %llu) are not covered by any tensor",
                (unsigned long long)cursor, (unsigned long long)data_size);
        rc = -1;
    }
    free(spans);
    return rc;
}

int st_parse(const void *buf, size_t len, st_file *f, char *err, size_t errlen)
{
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (f == NULL) {
        set_err(err, errlen, "st_parse: no st_file given");
        return -1;
    }
    memset(f, 0, sizeof *f);
    if (buf == NULL && len > 0) {
        set_err(err, errlen, "st_parse: NULL buffer of length %zu", len);
        return -1;
    }
    if (len < 8) {
        set_err(err, errlen, "file too short: %zu bytes, need at least 8 for the header length",
                len);
        return -1;
    }
    const unsigned char *bytes = buf;
    uint64_t hlen = load_le64(bytes);
    if (hlen == 0) {
        set_err(err, errlen, "header length is 0");
        return -1;
    }
    /* The limit comes first so a huge length is called what it is even in a huge file. */
    if (hlen > ST_MAX_HEADER_LEN) {
        set_err(err, errlen, "header length %llu exceeds the limit of %llu bytes",
                (unsigned long long)hlen, ST_MAX_HEADER_LEN);
        return -1;
    }
    if (hlen > len - 8) {
        set_err(err, errlen, "header length %llu exceeds file size %zu", (unsigned long long)hlen,
                len);
        return -1;
    }
    const unsigned char *data = bytes + 8 + hlen;
    uint64_t data_size = (uint64_t)(len - 8 - (size_t)hlen);

    json_error_t jerr;
    /* DECODE_ANY so a scalar header gets our "not an object" message rather than a parse error;
     * duplicates are refused because a later key would silently shadow an earlier tensor. */
    json_t *root = json_loadb((const char *)bytes + 8, (size_t)hlen,
                              JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (root == NULL) {
        set_err(err, errlen, "header is not valid JSON: %s at line %d column %d (header byte %d)",
                jerr.text, jerr.line, jerr.column, jerr.position);
        return -1;
    }
    int rc = -1;
    if (!json_is_object(root)) {
        set_err(err, errlen, "header is not a JSON object");
        goto done;
    }
    size_t nkeys = json_object_size(root);
    if (nkeys > INT_MAX) {
        set_err(err, errlen, "header has too many entries (%zu)", nkeys);
        goto done;
    }
    if (nkeys > 0) {
        f->tensors = calloc(nkeys, sizeof *f->tensors);
        if (f->tensors == NULL) {
            set_err(err, errlen, "out of memory for %zu tensors", nkeys);
            goto done;
        }
    }
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        if (strcmp(key, "__metadata__") == 0) {
            if (parse_metadata(value, f, err, errlen) != 0)
                goto done;
            continue;
        }
        st_tensor *t = &f->tensors[f->count];
        t->name = copy_string(key);
        if (t->name == NULL) {
            set_err(err, errlen, "out of memory for tensor names");
            goto done;
        }
        /* Counted now so st_close frees the name if validation below fails. */
        f->count++;
        if (parse_tensor(key, value, data_size, t, err, errlen) != 0)
            goto done;
    }
    if (check_coverage(f, data_size, err, errlen) != 0)
        goto done;
    /* Only now, with every range known to be inside the buffer, hand out pointers. */
    for (int i = 0; i < f->count; i++)
        f->tensors[i].data = data + f->tensors[i].begin;
    rc = 0;
done:
    json_decref(root);
    if (rc != 0)
        st_close(f);
    return rc;
}

int st_open(const char *path, st_file *f, char *err, size_t errlen)
{
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (f == NULL || path == NULL) {
        set_err(err, errlen, "st_open: NULL argument");
        return -1;
    }
    memset(f, 0, sizeof *f);
    /* O_NONBLOCK so a FIFO named by mistake fails below instead of hanging the open. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        set_err(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        set_err(err, errlen, "cannot stat %s: %s", path, strerror(errno));
        (void)close(fd); /* already failing; the stat error is the one to report */
        return -1;
    }
    if (!S_ISREG(sb.st_mode)) {
        set_err(err, errlen, "%s: not a regular file", path);
        (void)close(fd);
        return -1;
    }
    if (sb.st_size < 0 || (uintmax_t)sb.st_size > (uintmax_t)SIZE_MAX) {
        set_err(err, errlen, "%s: file too large to map", path);
        (void)close(fd);
        return -1;
    }
    size_t size = (size_t)sb.st_size;
    void *map = NULL;
    /* mmap refuses length 0; an empty file still goes through st_parse for its message. */
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            set_err(err, errlen, "cannot map %s: %s", path, strerror(errno));
            (void)close(fd);
            return -1;
        }
    }
    if (close(fd) != 0) {
        set_err(err, errlen, "cannot close %s: %s", path, strerror(errno));
        if (map != NULL)
            (void)munmap(map, size);
        return -1;
    }
    char msg[1024];
    static const char empty[1] = {0};
    if (st_parse(map != NULL ? map : empty, size, f, msg, sizeof msg) != 0) {
        set_err(err, errlen, "%s: %s", path, msg);
        if (map != NULL)
            (void)munmap(map, size);
        return -1;
    }
    f->map = map;
    f->map_size = size;
    return 0;
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    if (f == NULL || name == NULL)
        return NULL;
    for (int i = 0; i < f->count; i++) {
        if (strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    }
    return NULL;
}

const char *st_metadata(const st_file *f, const char *key)
{
    if (f == NULL || key == NULL)
        return NULL;
    for (int i = 0; i < f->meta_count; i++) {
        if (strcmp(f->meta[2 * i], key) == 0)
            return f->meta[2 * i + 1];
    }
    return NULL;
}

int st_metadata_count(const st_file *f)
{
    return f == NULL ? 0 : f->meta_count;
}

int st_metadata_at(const st_file *f, int i, const char **key, const char **value)
{
    if (f == NULL || i < 0 || i >= f->meta_count)
        return -1;
    if (key != NULL)
        *key = f->meta[2 * i];
    if (value != NULL)
        *value = f->meta[2 * i + 1];
    return 0;
}

int st_is_aligned(const st_tensor *t)
{
    if (t == NULL)
        return 0;
    size_t size = st_dtype_size(t->dtype);
    if (size == 0)
        return 0;
    return (uintptr_t)t->data % size == 0;
}

uint64_t st_numel(const st_tensor *t)
{
    if (t == NULL)
        return 0;
    uint64_t n = 1;
    for (int i = 0; i < t->rank; i++)
        n *= (uint64_t)t->shape[i];
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * writing
 */

/* Build the header object. Returns the root (caller decrefs) or NULL with err set. */
static json_t *build_header(const st_out *tensors, int count, const char *const *metadata_kv,
                            char *err, size_t errlen)
{
    json_t *root = json_object();
    if (root == NULL) {
        set_err(err, errlen, "out of memory building the header");
        return NULL;
    }
    /* Metadata goes first, as the reference writer does, so a reader peeking at the start of the
     * header finds it without scanning every tensor. */
    if (metadata_kv != NULL && metadata_kv[0] != NULL) {
        json_t *meta = json_object();
        if (json_object_set_new(root, "__metadata__", meta) != 0) {
            set_err(err, errlen, "out of memory building the header");
            goto fail;
        }
        for (size_t i = 0; metadata_kv[i] != NULL; i += 2) {
            const char *k = metadata_kv[i], *v = metadata_kv[i + 1];
            if (v == NULL) {
                set_err(err, errlen, "metadata key \"%s\" has no value", shorten(k).s);
                goto fail;
            }
            if (!utf8_valid(k) || !utf8_valid(v)) {
                set_err(err, errlen, "metadata entry \"%s\" is not valid UTF-8", shorten(k).s);
                goto fail;
            }
            if (json_object_get(meta, k) != NULL) {
                set_err(err, errlen, "duplicate metadata key \"%s\"", shorten(k).s);
                goto fail;
            }
            if (json_object_set_new(meta, k, json_string(v)) != 0) {
                set_err(err, errlen, "out of memory building the header");
                goto fail;
            }
        }
    }

    uint64_t offset = 0;
    for (int i = 0; i < count; i++) {
        const st_out *t = &tensors[i];
        if (t->name == NULL) {
            set_err(err, errlen, "tensor %d has no name", i);
            goto fail;
        }
        short_name qn = shorten(t->name);
        if (!utf8_valid(t->name)) {
            set_err(err, errlen, "tensor %d: name is not valid UTF-8", i);
            goto fail;
        }
        if (strcmp(t->name, "__metadata__") == 0) {
            set_err(err, errlen, "tensor %d: the name \"__metadata__\" is reserved", i);
            goto fail;
        }
        if (json_object_get(root, t->name) != NULL) {
            set_err(err, errlen, "duplicate tensor name \"%s\"", qn.s);
            goto fail;
        }
        if (!dtype_valid(t->dtype)) {
            set_err(err, errlen, "tensor \"%s\": invalid dtype %d", qn.s, (int)t->dtype);
            goto fail;
        }
        if (t->rank < 0 || t->rank > ST_MAX_RANK) {
            set_err(err, errlen, "tensor \"%s\": rank %d outside 0..%d", qn.s, t->rank,
                    ST_MAX_RANK);
            goto fail;
        }
        uint64_t numel = 1;
        for (int d = 0; d < t->rank; d++) {
            if (t->shape[d] < 0) {
                set_err(err, errlen, "tensor \"%s\": shape[%d] is negative", qn.s, d);
                goto fail;
            }
            if (mul_u64(numel, (uint64_t)t->shape[d], &numel) != 0) {
                set_err(err, errlen, "tensor \"%s\": element count overflows 64 bits", qn.s);
                goto fail;
            }
        }
        uint64_t nbytes;
        if (mul_u64(numel, st_dtype_size(t->dtype), &nbytes) != 0) {
            set_err(err, errlen, "tensor \"%s\": byte size overflows 64 bits", qn.s);
            goto fail;
        }
        if (nbytes > 0 && t->data == NULL) {
            set_err(err, errlen, "tensor \"%s\": no data for %llu bytes", qn.s,
                    (unsigned long long)nbytes);
            goto fail;
        }
        /* Offsets are JSON integers (json_int_t, signed 64-bit), so the total must fit there. */
        if (nbytes > (uint64_t)INT64_MAX - offset) {
            set_err(err, errlen, "total data size overflows at tensor \"%s\"", qn.s);
            goto fail;
        }

        json_t *entry = json_object();
        json_t *shape = json_array();
        json_t *offs = json_array();
        /* set_new/append_new take ownership even when they fail and refuse a NULL value, so one
         * combined check covers every allocation without leaking. */
        int bad = json_object_set_new(root, t->name, entry) != 0;
        bad |= json_object_set_new(entry, "dtype", json_string(st_dtype_name(t->dtype))) != 0;
        bad |= json_object_set_new(entry, "shape", shape) != 0;
        bad |= json_object_set_new(entry, "data_offsets", offs) != 0;
        if (bad) {
            set_err(err, errlen, "out of memory building the header");
            goto fail;
        }
        for (int d = 0; d < t->rank; d++)
            bad |= json_array_append_new(shape, json_integer((json_int_t)t->shape[d])) != 0;
        bad |= json_array_append_new(offs, json_integer((json_int_t)offset)) != 0;
        bad |= json_array_append_new(offs, json_integer((json_int_t)(offset + nbytes))) != 0;
        if (bad) {
            set_err(err, errlen, "out of memory building the header");
            goto fail;
        }
        offset += nbytes;
    }
    return root;
fail:
    json_decref(root);
    return NULL;
}

/* Data sizes from build_header, recomputed here rather than carried around: they are known not
 * to overflow by now. */
static uint64_t out_nbytes(const st_out *t)
{
    uint64_t n = st_dtype_size(t->dtype);
    for (int d = 0; d < t->rank; d++)
        n *= (uint64_t)t->shape[d];
    return n;
}

int st_write(const char *path, const st_out *tensors, int count, const char *const *metadata_kv,
             char *err, size_t errlen)
{
    if (err != NULL && errlen > 0)
        err[0] = '\0';
    if (path == NULL || count < 0 || (count > 0 && tensors == NULL)) {
        set_err(err, errlen, "st_write: invalid arguments");
        return -1;
    }
    json_t *root = build_header(tensors, count, metadata_kv, err, errlen);
    if (root == NULL)
        return -1;
    char *json = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (json == NULL) {
        set_err(err, errlen, "out of memory serializing the header");
        return -1;
    }
    size_t jlen = strlen(json);
    size_t hlen = (jlen + 7) & ~(size_t)7;
    if (hlen > ST_MAX_HEADER_LEN) {
        set_err(err, errlen, "header would be %zu bytes, over the limit of %llu", hlen,
                ST_MAX_HEADER_LEN);
        free(json);
        return -1;
    }
    unsigned char *head = malloc(8 + hlen);
    if (head == NULL) {
        set_err(err, errlen, "out of memory for the header");
        free(json);
        return -1;
    }
    store_le64(head, hlen);
    memcpy(head + 8, json, jlen);
    memset(head + 8 + jlen, ' ', hlen - jlen);
    free(json);

    /* out_open (atomic_file.c) decides how path is written: a temporary beside the file (or
     * beside a symlink's target) renamed over it by out_commit, or a device or FIFO written
     * directly; on failure out_abort removes the temporary. */
    out_file of;
    if (out_open(&of, path, err, errlen) != 0) {
        free(head);
        return -1;
    }
    if (out_write(&of, head, 8 + hlen) != 0)
        goto write_failed;
    for (int i = 0; i < count; i++) {
        uint64_t n = out_nbytes(&tensors[i]); /* in memory already, so it fits a size_t */
        if (n > 0 && out_write(&of, tensors[i].data, (size_t)n) != 0)
            goto write_failed;
    }
    free(head);
    return out_commit(&of, err, errlen); /* which cleans up after itself on failure */
write_failed:
    set_err(err, errlen, "cannot write %s: %s", path, strerror(errno));
    out_abort(&of);
    free(head);
    return -1;
}
