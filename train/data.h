/* data.h — training, validation and test records from JSONL, one JSON object per line:
 *   {"tokens": [2, 17, ...], "mask": [0, 0, 1, ...]}   pre-tokenized; optional per-token mask,
 *                                                      1 where the token is a training target
 *   {"tokens": [2, 17, ...], "offset": 12}             pre-tokenized with the prompt's length (what
 *                                                      train/prepare_data.py writes for prompt/completion
 *                                                      and chat records): under mask_prompt, token i is a
 *                                                      target only where i >= offset (mlx-lm's --mask-prompt);
 *                                                      otherwise every token is
 *   {"text": "..."}                                    byte-level tokens: BOS, each UTF-8 byte + 3, EOS
 * The byte-level vocabulary: 0 pad, 1 EOS, 2 BOS (Gemma's ids for them), byte b → b + 3, so a
 * model needs vocab ≥ 259 for text records. Byte tokens are read only when the model has no
 * tokenizer of its own or the user asks for them; otherwise {"text"} records are refused with the
 * command that tokenizes them. mlx-lm's other raw records ({"prompt", "completion"}, {"messages"},
 * with or without "tools") need the checkpoint's chat template, and are always refused with it. */
#ifndef WA_TRAIN_DATA_H
#define WA_TRAIN_DATA_H

#include "train.h"

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
    long targets;      /* masked targets over all sequences */
    int longest;
    int text_records;  /* {"text"} records read as byte tokens */
} dataset;

typedef struct data_options {
    int vocab;         /* tokens must be below this */
    int max_len;       /* truncate longer sequences (mlx-lm's max_seq_length); 0 = no limit */
    int pad_target;    /* append a pad token as one more target: mlx-lm's off-by-one (PR #1697) */
    int mask_prompt;   /* targets before a record's "offset" are not trained; a file none of whose
                        * records marks its prompt ("offset" or "mask") is refused, as is one with
                        * {"text"} records (mlx-lm refuses --mask-prompt on text data) */
    int refuse_text;   /* {"text"} records are refused with the prepare command (the model has a
                        * tokenizer and byte tokens were not asked for); 0 reads them as bytes */
    const char *model_dir; /* named in the prepare command; NULL writes MODEL */
    const char *data_path; /* the --data argument, named in the prepare command; NULL: the file read */
} data_options;

/* Read path; 0, or -1 with a one-line message naming the file, the line and the problem.
 * Records with fewer than two tokens (nothing to predict) are refused, as is a file with no
 * target left once masked. */
int dataset_load(const char *path, const data_options *opt, dataset *d, char *err, size_t errlen);
void dataset_free(dataset *d);

/* The files behind a --data argument: a folder's train.jsonl, valid.jsonl and test.jsonl (each
 * NULL where absent), or one JSONL file as the training set (no held-out or test set). Returns 0,
 * or -1 with a one-line message when path is neither a folder nor a regular file; data_paths_free
 * releases the strings either way. */
typedef struct data_paths {
    char *train, *valid, *test;
    int is_file; /* --data named one file */
} data_paths;
int data_files(const char *path, data_paths *p, char *err, size_t errlen);
void data_paths_free(data_paths *p);

/* Whether model_dir holds a tokenizer of its own: tokenizer.json, tokenizer.model or
 * tokenizer_config.json. */
int model_has_tokenizer(const char *model_dir);

/* The one-line shell command that prepares raw mlx-lm records of data_path for model_dir
 * (python3 train/prepare_data.py --model ... --data ... --out ...), paths quoted for the shell;
 * the folder or file it writes, which --data then takes, goes to prepared. */
void data_prepare_command(const char *model_dir, const char *data_path, char *cmd, size_t cmdlen, char *prepared,
                          size_t preparedlen);

/* Before anything is loaded: the files a run of o reads from o->data_dir are there (data_files;
 * the held-out set when evaluating: eval_only, eval_at_end or eval_every; test.jsonl under
 * o->test), and evaluation is not asked of one file. 0, or -1 with a one-line message. */
int data_check_run(const train_options *o, char *err, size_t errlen);

/* What a run reads from o->data_dir as o asks, for a model of this vocabulary: the training set
 * (unless eval_only), the held-out set (when evaluating: eval_only, eval_at_end or eval_every) and,
 * where test is not NULL, the test set (under o->test); each needs at least one batch of
 * o->batch records, and data_check_run's conditions hold. Byte tokens follow o->byte_tokens and
 * model_has_tokenizer(o->model_dir), and reading text as bytes is said once on stdout. 0, or -1
 * with a one-line message, the datasets freed. */
int data_load_run(const train_options *o, int vocab, dataset *train, dataset *valid, dataset *test, char *err,
                  size_t errlen);

/* Byte-level tokenization of UTF-8 text into out (len + 2 entries); returns the count. */
int tokenize_bytes(const char *text, size_t len, int32_t *out);

#endif
