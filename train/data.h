/* data.h — training and validation records from JSONL, one JSON object per line:
 *   {"tokens": [2, 17, ...], "mask": [0, 0, 1, ...]}   pre-tokenized; optional per-token mask,
 *                                                      1 where the token is a training target
 *   {"text": "..."}                                    byte-level tokens: BOS, each UTF-8 byte + 3, EOS
 * The byte-level vocabulary: 0 pad, 1 EOS, 2 BOS (Gemma's ids for them), byte b → b + 3, so a
 * model needs vocab ≥ 259 for text records. */
#ifndef WA_TRAIN_DATA_H
#define WA_TRAIN_DATA_H

#include <stddef.h>
#include <stdint.h>

enum { TOKEN_PAD = 0, TOKEN_EOS = 1, TOKEN_BOS = 2, TOKEN_BYTE0 = 3, BYTE_VOCAB = 259 };

typedef struct sequence {
    int32_t *tokens;
    int len;
    uint8_t *target_mask; /* [len - 1]: target t + 1 is trained where nonzero; NULL = all */
} sequence;

typedef struct dataset {
    sequence *seq;
    int count;
    long targets;  /* masked targets over all sequences */
    int longest;
} dataset;

typedef struct data_options {
    int vocab;         /* tokens must be below this */
    int max_len;       /* truncate longer sequences (mlx-lm's max_seq_length); 0 = no limit */
    int pad_target;    /* append a pad token as one more target: mlx-lm's off-by-one (PR #1697) */
} data_options;

/* Read path; 0, or -1 with a one-line message naming the file, the line and the problem.
 * Records with fewer than two tokens (nothing to predict) are refused. */
int dataset_load(const char *path, const data_options *opt, dataset *d, char *err, size_t errlen);
void dataset_free(dataset *d);

/* Byte-level tokenization of UTF-8 text into out (len + 2 entries); returns the count. */
int tokenize_bytes(const char *text, size_t len, int32_t *out);

#endif
