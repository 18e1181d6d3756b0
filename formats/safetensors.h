/* safetensors.h — reader and writer for the safetensors file format, used by the winattn
 * command to load inputs and store outputs and by the trainer for checkpoints and adapters.
 *
 * A safetensors file is an 8-byte little-endian u64 header length N, then N bytes of JSON
 * header, then the raw little-endian data region. The header maps each tensor name to
 * {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data region) and may
 * hold a "__metadata__" object of string -> string (or null, as MLX writes it: no entries).
 *
 * The reader is meant for untrusted files: st_parse validates the whole header (types, exact
 * integers, overflow, overlaps, holes) before anything looks at tensor bytes, so a consumer may
 * read t->data[0 .. t->end - t->begin) for every tensor without further checks. Nothing here
 * prints or exits; failures come back as -1 plus a one-line message.
 */
#ifndef WINATTN_FORMATS_SAFETENSORS_H
#define WINATTN_FORMATS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum st_dtype {
    ST_F64,
    ST_F32,
    ST_F16,
    ST_BF16,
    ST_I64,
    ST_I32,
    ST_I16,
    ST_I8,
    ST_U8,
    ST_BOOL,
    ST_U16,
    ST_U32,
    ST_U64,
    ST_F8_E4M3,
    ST_F8_E5M2,
    ST_DTYPE_COUNT /* not a dtype: the number of them, for loops and range checks */
} st_dtype;

/* Bytes per element; 0 for a value outside the enum. */
size_t st_dtype_size(st_dtype dtype);
/* The header spelling ("F32", "BF16", ...); NULL for a value outside the enum. */
const char *st_dtype_name(st_dtype dtype);
/* 0 and *out set when name is a known dtype spelling (case-sensitive, as in the format), else -1. */
int st_dtype_parse(const char *name, st_dtype *out);

#define ST_MAX_RANK 8

/* Files whose header claims more than this many bytes are rejected (the reference
 * implementation uses the same limit), so a hostile length cannot make us allocate gigabytes. */
#define ST_MAX_HEADER_LEN 100000000ULL

typedef struct st_tensor {
    char *name;                  /* UTF-8, owned by the st_file */
    st_dtype dtype;
    int rank;                    /* 0 for a scalar */
    int64_t shape[ST_MAX_RANK];  /* entries past rank are 0 */
    uint64_t begin, end;         /* byte offsets within the data region; end - begin is the size */
    const void *data;            /* points into the mapping (or the caller's buffer for st_parse) */
} st_tensor;

typedef struct st_file {
    st_tensor *tensors;  /* in header order */
    int count;
    /* internal */
    void *map;           /* the mmap made by st_open, NULL after st_parse on a caller's buffer */
    size_t map_size;
    char **meta;         /* meta_count key,value pairs, flattened: meta[2i] key, meta[2i+1] value */
    int meta_count;
} st_file;

/* Parse and validate a complete file image held in memory. Does not take ownership of buf:
 * tensor data pointers point into it, so buf must outlive *f. *f is overwritten (it must not
 * hold an open file). Returns 0 on success; on failure -1, a one-line message in err (no
 * newline; err may be NULL or errlen 0), and *f left empty so st_close on it is harmless. */
int st_parse(const void *buf, size_t len, st_file *f, char *err, size_t errlen);

/* mmap path read-only (MAP_PRIVATE) and st_parse it; the mapping lives until st_close. Error
 * messages name the file. The file must not be truncated by someone else while it is open: that
 * would fault on access like any mapped file. */
int st_open(const char *path, st_file *f, char *err, size_t errlen);

/* The tensor called name, or NULL. */
const st_tensor *st_find(const st_file *f, const char *name);

/* The __metadata__ value for key, or NULL if absent. */
const char *st_metadata(const st_file *f, const char *key);

/* Number of __metadata__ entries, and the i-th (header order); st_metadata_at returns 0 and sets
 * *key and *value, or -1 when i is out of range. */
int st_metadata_count(const st_file *f);
int st_metadata_at(const st_file *f, int i, const char **key, const char **value);

/* Release everything; safe on a zeroed or failed st_file and idempotent. */
void st_close(st_file *f);

/* 1 if t->data is aligned to the element size, so it may be read through a typed pointer;
 * safetensors does not promise alignment, so otherwise copy (memcpy) the data first. */
int st_is_aligned(const st_tensor *t);

/* Number of elements (product of the shape; 1 for a scalar). Valid for parsed tensors, whose
 * product is known not to overflow. */
uint64_t st_numel(const st_tensor *t);

typedef struct st_out {
    const char *name;
    st_dtype dtype;
    int rank;
    int64_t shape[ST_MAX_RANK];
    const void *data;  /* numel * dtype size bytes; may be NULL when that is 0 */
} st_out;

/* Write tensors to path, in the given order with a contiguous data region; the header JSON is
 * padded with spaces to a multiple of 8 bytes so the data region starts 8-byte aligned.
 * metadata_kv is NULL or a NULL-terminated array of key, value, key, value, ... strings.
 * Written through atomic_file.h's out_open/out_commit: a regular file (or a new path) goes to a temporary
 * beside it, fsync'ed and renamed over it only when complete, so on any failure the temporary is
 * removed and a file already at path is left as it was; a symlink's target is replaced the same
 * way (the link stays); a device node or FIFO is written directly; a directory is refused.
 * Returns 0, or -1 with a one-line message in err. */
int st_write(const char *path, const st_out *tensors, int count, const char *const *metadata_kv,
             char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
