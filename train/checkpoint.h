/* checkpoint.h — a Hugging Face checkpoint directory: config.json plus either one
 * model.safetensors or shards listed in model.safetensors.index.json.
 *
 * Tensors are looked up by their name inside the text model ("layers.3.self_attn.q_proj.weight",
 * "embed_tokens.weight", "norm.weight"); the prefix the checkpoint uses is found once from the
 * embedding: "model." (a text-only save), "model.language_model." (the multimodal Gemma 4/3
 * classes) or "language_model.model." (mlx-lm after sanitize). Other tensors (vision tower,
 * audio) are never touched. */
#ifndef WA_TRAIN_CHECKPOINT_H
#define WA_TRAIN_CHECKPOINT_H

#include "safetensors.h"

#include <stddef.h>
#include <stdint.h>

/* C linkage: the CUDA loader (a C++ translation unit) calls these too */
#ifdef __cplusplus
extern "C" {
#endif

typedef struct checkpoint {
    st_file *files;
    int file_count;
    char prefix[32];
} checkpoint;

/* 0 on success; -1 with a one-line message naming the file and problem. */
int checkpoint_open(const char *dir, checkpoint *ck, char *err, size_t errlen);
/* The tensor, or NULL; text_name is prefixed with the checkpoint's prefix ("lm_head.weight" is
 * also tried bare, where transformers writes it). */
const st_tensor *checkpoint_find(const checkpoint *ck, const char *text_name);
void checkpoint_close(checkpoint *ck);

/* The first element of a floating-point tensor (F64, F32, F16, BF16) that is NaN or ±inf: 1 with
 * *index its flat (row-major) index; 0 when every element is finite or the dtype is not one of
 * those four (integers are always finite). Tests the exponent bits of the raw little-endian
 * integers, so nothing is converted and unaligned data is fine. Meant for every loader to call on
 * each base tensor before use. */
int st_tensor_first_nonfinite(const st_tensor *t, uint64_t *index);
/* "NaN", "inf" or "-inf" for element index of t (as found above); "finite" otherwise. */
const char *st_tensor_value_kind(const st_tensor *t, uint64_t index);

#ifdef __cplusplus
}
#endif

#endif
