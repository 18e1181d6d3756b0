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

#endif
