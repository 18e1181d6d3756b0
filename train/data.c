/* data.c — see data.h. */
#define _GNU_SOURCE
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int tokenize_bytes(const char *text, size_t len, int32_t *out) {
    int n = 0;
    out[n++] = TOKEN_BOS;
    for (size_t i = 0; i < len; i++) out[n++] = (unsigned char)text[i] + TOKEN_BYTE0;
    out[n++] = TOKEN_EOS;
    return n;
}

/* jansson's error text quotes the input near the error, control characters included: '?' for
 * those, so a message stays one line */
static const char *one_line(char *text) {
    for (char *c = text; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    return text;
}

/* A path for a shell command line: as is when it holds only characters the shell leaves alone,
 * else in single quotes (a quote inside as '\''); control characters become '?', so the line
 * stays one line. */
static void shell_word(const char *word, char *out, size_t outlen) {
    if (outlen == 0) return;
    int plain = *word != '\0';
    for (const char *c = word; *c; c++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-+=:,@%", *c)) plain = 0;
    size_t n = 0;
    const char *quote = "'\\''"; /* ends the quoted part, an escaped quote, starts another */
    if (!plain && n + 1 < outlen) out[n++] = '\'';
    for (const char *c = word; *c; c++) {
        if (*c == '\'') {
            for (const char *q = quote; *q && n + 1 < outlen; q++) out[n++] = *q;
        } else if (n + 1 < outlen) {
            out[n++] = (unsigned char)*c < 0x20 || *c == 0x7f ? '?' : *c;
        }
    }
    if (!plain && n + 1 < outlen) out[n++] = '\'';
    out[n] = '\0';
}

/* Where prepared data goes by default: beside the input, DIR-tokens for a folder, NAME.tokens.jsonl
 * for a file NAME.jsonl (train/prepare_data.py writes one file when --out names a .jsonl). */
static void prepared_path(const char *data_path, int is_file, char *out, size_t outlen) {
    size_t n = strlen(data_path);
    while (n > 1 && data_path[n - 1] == '/') n--;
    const char *base = data_path + n;
    while (base > data_path && base[-1] != '/') base--;
    size_t base_len = (size_t)(data_path + n - base);
    if (is_file) {
        size_t stem = n >= 6 && strncmp(data_path + n - 6, ".jsonl", 6) == 0 ? n - 6 : n;
        snprintf(out, outlen, "%.*s.tokens.jsonl", (int)stem, data_path);
    } else if (base_len == 0 || (base_len == 1 && *base == '.') || (base_len == 2 && strncmp(base, "..", 2) == 0)) {
        snprintf(out, outlen, "%.*s%sdata-tokens", (int)n, data_path, data_path[n - 1] == '/' ? "" : "/");
    } else {
        snprintf(out, outlen, "%.*s-tokens", (int)n, data_path);
    }
}

void data_prepare_command(const char *model_dir, const char *data_path, char *cmd, size_t cmdlen, char *prepared,
                          size_t preparedlen) {
    struct stat st;
    int is_file = stat(data_path, &st) == 0 && !S_ISDIR(st.st_mode);
    char out[1024], model_word[1100], data_word[1100], out_word[1100];
    prepared_path(data_path, is_file, out, sizeof out);
    shell_word(model_dir ? model_dir : "MODEL", model_word, sizeof model_word);
    shell_word(data_path, data_word, sizeof data_word);
    shell_word(out, out_word, sizeof out_word);
    snprintf(cmd, cmdlen, "python3 train/prepare_data.py --model %s --data %s --out %s", model_word, data_word,
             out_word);
    snprintf(prepared, preparedlen, "%s", out_word);
}

/* The message for a raw mlx-lm record this reader does not tokenize: what it needs and the exact
 * command that prepares the data. */
static const char *refuse_raw(const char *what, const char *needs, const char *path, const data_options *opt,
                              int text, char *msg, size_t msglen) {
    char cmd[3400], prepared[1100];
    data_prepare_command(opt->model_dir, opt->data_path ? opt->data_path : path, cmd, sizeof cmd, prepared,
                         sizeof prepared);
    snprintf(msg, msglen, "%s records need the checkpoint's %s: prepare them with %s, then train with --data %s%s",
             what, needs, cmd, prepared, text ? "; or pass --byte-tokens to train on UTF-8 bytes" : "");
    return msg;
}

/* One record → s; *marked is set when the record says where its prompt ends or carries a mask.
 * Returns NULL on success, else a message (static text or into msg). */
static const char *parse_record(const json_t *rec, const char *path, const data_options *opt, sequence *s, int *text_out,
                                int *marked, char *msg, size_t msglen) {
    memset(s, 0, sizeof *s);
    *text_out = *marked = 0;
    if (!json_is_object(rec)) return "a record must be a JSON object";
    const json_t *tokens = json_object_get(rec, "tokens"), *text = json_object_get(rec, "text");
    const json_t *mask = json_object_get(rec, "mask"), *offset = json_object_get(rec, "offset");
    size_t n;
    if (tokens) {
        if (!json_is_array(tokens)) return "\"tokens\" must be an array of integers";
        n = json_array_size(tokens);
    } else if (json_object_get(rec, "prompt") && json_object_get(rec, "completion")) {
        return refuse_raw("{\"prompt\", \"completion\"}", "chat template", path, opt, 0, msg, msglen);
    } else if (json_object_get(rec, "messages") || json_object_get(rec, "tools")) {
        return refuse_raw("{\"messages\"} (chat)", "chat template", path, opt, 0, msg, msglen);
    } else if (text) {
        if (!json_is_string(text)) return "\"text\" must be a string";
        if (opt->refuse_text) return refuse_raw("{\"text\"}", "tokenizer", path, opt, 1, msg, msglen);
        if (opt->vocab < BYTE_VOCAB) {
            snprintf(msg, msglen, "text records need a vocabulary of at least %d (byte-level), the model has %d",
                     BYTE_VOCAB, opt->vocab);
            return msg;
        }
        n = json_string_length(text) + 2;
        *text_out = 1;
    } else {
        return "a record needs \"tokens\" or \"text\" (mlx-lm's \"prompt\"/\"completion\" and \"messages\" records "
               "go through train/prepare_data.py first)";
    }
    if (offset && !tokens) return "\"offset\" belongs to records with \"tokens\"";
    if (n > (size_t)1 << 30) return "record too long";
    json_int_t prompt_len = 0;
    if (offset) {
        prompt_len = json_is_integer(offset) ? json_integer_value(offset) : -1;
        if (prompt_len < 0 || (size_t)prompt_len > n) {
            snprintf(msg, msglen, "\"offset\" (the prompt's token count) must be an integer in [0, %zu]", n);
            return msg;
        }
    }
    *marked = offset || mask;
    s->tokens = malloc((n + 1) * sizeof *s->tokens); /* + 1: room for the pad target */
    /* a per-token mask from "mask", or from "offset" under mask_prompt: 1 where a token is a target */
    int masked = mask || (offset && opt->mask_prompt);
    uint8_t *token_mask = masked ? malloc(n + 1) : NULL;
    if (!s->tokens || (masked && !token_mask)) return free(token_mask), "out of memory";
    if (tokens) {
        for (size_t i = 0; i < n; i++) {
            const json_t *v = json_array_get(tokens, i);
            json_int_t t = json_is_integer(v) ? json_integer_value(v) : -1;
            if (t < 0 || t >= opt->vocab) {
                free(token_mask);
                snprintf(msg, msglen, "tokens[%zu] must be an integer in [0, %d)", i, opt->vocab);
                return msg;
            }
            s->tokens[i] = (int32_t)t;
        }
    } else {
        n = (size_t)tokenize_bytes(json_string_value(text), json_string_length(text), s->tokens);
    }
    if (token_mask) memset(token_mask, 1, n);
    if (mask) {
        if (!json_is_array(mask) || json_array_size(mask) != n) {
            free(token_mask);
            return "\"mask\" must be an array as long as \"tokens\"";
        }
        for (size_t i = 0; i < n; i++) {
            const json_t *v = json_array_get(mask, i);
            if (!json_is_integer(v) && !json_is_boolean(v)) {
                free(token_mask);
                return "\"mask\" entries must be 0/1 or booleans";
            }
            token_mask[i] = json_is_true(v) || (json_is_integer(v) && json_integer_value(v) != 0);
        }
    }
    /* mlx-lm's loss trains token i where i >= offset (steps >= lengths[:, 0] in default_loss) */
    if (offset && opt->mask_prompt) memset(token_mask, 0, (size_t)prompt_len);
    if (opt->max_len > 0 && n > (size_t)opt->max_len) n = (size_t)opt->max_len;
    if (opt->pad_target) {
        s->tokens[n] = TOKEN_PAD;
        if (token_mask) token_mask[n] = 1;
        n++;
    }
    if (n < 2) {
        free(token_mask);
        return "a record needs at least two tokens (nothing to predict otherwise)";
    }
    s->len = (int)n;
    if (token_mask) { /* per-token mask → per-target mask: target t + 1 */
        s->target_mask = malloc(n - 1);
        if (!s->target_mask) return free(token_mask), "out of memory";
        memcpy(s->target_mask, token_mask + 1, n - 1);
        free(token_mask);
    }
    return NULL;
}

int dataset_load(const char *path, const data_options *opt, dataset *d, char *err, size_t errlen) {
    memset(d, 0, sizeof *d);
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno)), -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return snprintf(err, errlen, "%s: not a regular file", path), -1;
    }
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        return snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno)), -1;
    }
    char *line = NULL, msg[5120];
    size_t cap = 0;
    ssize_t got;
    int lineno = 0, cap_seq = 0, rc = 0, marked_records = 0;
    while (rc == 0 && (got = getline(&line, &cap, f)) != -1) {
        lineno++;
        size_t len = (size_t)got;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) len--;
        if (len == 0) continue;
        json_error_t je;
        json_t *rec = json_loadb(line, len, JSON_REJECT_DUPLICATES, &je);
        if (!rec) {
            snprintf(err, errlen, "%s:%d: not valid JSON (%s)", path, lineno, one_line(je.text));
            rc = -1;
            break;
        }
        if (d->count == cap_seq) {
            cap_seq = cap_seq ? 2 * cap_seq : 64;
            sequence *grown = realloc(d->seq, (size_t)cap_seq * sizeof *grown);
            if (!grown) {
                json_decref(rec);
                snprintf(err, errlen, "%s: out of memory", path);
                rc = -1;
                break;
            }
            d->seq = grown;
        }
        sequence *s = &d->seq[d->count];
        int is_text, marked;
        const char *problem = parse_record(rec, path, opt, s, &is_text, &marked, msg, sizeof msg);
        json_decref(rec);
        if (problem) {
            free(s->tokens);
            free(s->target_mask);
            snprintf(err, errlen, "%s:%d: %s", path, lineno, problem);
            rc = -1;
            break;
        }
        d->count++;
        d->text_records += is_text;
        marked_records += marked;
        if (s->len > d->longest) d->longest = s->len;
        for (int t = 0; t < s->len - 1; t++) d->targets += !s->target_mask || s->target_mask[t];
    }
    /* getline's -1 is also a read error or a line too long for memory: neither is the end */
    if (rc == 0 && (ferror(f) || !feof(f))) {
        snprintf(err, errlen, "%s:%d: read error: %s", path, lineno + 1, strerror(errno ? errno : EIO));
        rc = -1;
    }
    free(line);
    fclose(f);
    if (rc == 0 && d->count == 0) {
        snprintf(err, errlen, "%s: no records", path);
        rc = -1;
    }
    /* mlx-lm refuses --mask-prompt on text data; records that mark no prompt would train on every
     * token with nothing said */
    if (rc == 0 && opt->mask_prompt && d->text_records) {
        snprintf(err, errlen, "%s: --mask-prompt: its %d {\"text\"} records have no prompt to mask", path,
                 d->text_records);
        rc = -1;
    }
    if (rc == 0 && opt->mask_prompt && marked_records == 0) {
        snprintf(err, errlen, "%s: --mask-prompt: no record marks where its prompt ends (\"offset\", which "
                 "train/prepare_data.py writes for prompt/completion and chat records)", path);
        rc = -1;
    }
    if (rc == 0 && d->targets == 0) {
        snprintf(err, errlen, "%s: every target of its %d records is masked%s: nothing to learn or evaluate", path,
                 d->count, opt->mask_prompt ? " (with --mask-prompt)" : "");
        rc = -1;
    }
    if (rc) dataset_free(d);
    return rc;
}

void dataset_free(dataset *d) {
    for (int i = 0; i < d->count; i++) {
        free(d->seq[i].tokens);
        free(d->seq[i].target_mask);
    }
    free(d->seq);
    memset(d, 0, sizeof *d);
}

static int is_regular(const char *dir, const char *name) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int model_has_tokenizer(const char *model_dir) {
    return model_dir && (is_regular(model_dir, "tokenizer.json") || is_regular(model_dir, "tokenizer.model") ||
                         is_regular(model_dir, "tokenizer_config.json"));
}

void data_paths_free(data_paths *p) {
    free(p->train);
    free(p->valid);
    free(p->test);
    memset(p, 0, sizeof *p);
}

int data_files(const char *path, data_paths *p, char *err, size_t errlen) {
    memset(p, 0, sizeof *p);
    if (!path || !*path) return snprintf(err, errlen, "no --data given (a folder with train.jsonl, or one JSONL file)"), -1;
    struct stat st;
    if (stat(path, &st) != 0) return snprintf(err, errlen, "--data %s: %s", path, strerror(errno)), -1;
    if (S_ISREG(st.st_mode)) {
        p->is_file = 1;
        if (!(p->train = strdup(path))) return snprintf(err, errlen, "out of memory"), -1;
        return 0;
    }
    if (!S_ISDIR(st.st_mode)) return snprintf(err, errlen, "--data %s: neither a folder nor a JSONL file", path), -1;
    char **slot[] = {&p->train, &p->valid, &p->test};
    static const char *const names[] = {"train.jsonl", "valid.jsonl", "test.jsonl"};
    int len = (int)strnlen(path, 4096);
    while (len > 1 && path[len - 1] == '/') len--;
    for (int i = 0; i < 3; i++) {
        if (asprintf(slot[i], "%.*s/%s", len, path, names[i]) < 0) {
            *slot[i] = NULL;
            data_paths_free(p);
            return snprintf(err, errlen, "out of memory"), -1;
        }
        /* absent: NULL, so a caller says which file is missing; anything else there is dataset_load's to refuse */
        if (lstat(*slot[i], &st) != 0 && errno == ENOENT) {
            free(*slot[i]);
            *slot[i] = NULL;
        }
    }
    return 0;
}

/* The splits a run reads: the training set unless eval_only, the held-out set when evaluating,
 * the test set under o->test. */
static int run_needs(const train_options *o, int *train, int *valid, int *test) {
    *train = !o->eval_only;
    *valid = o->eval_only || o->eval_at_end || o->eval_every;
    *test = o->test;
    return *train + *valid + *test;
}

/* Each split the run reads is there; one file (no held-out or test set) only trains. */
static int check_files(const train_options *o, const data_paths *files, char *err, size_t errlen) {
    int train, valid, test;
    run_needs(o, &train, &valid, &test);
    if (files->is_file && (valid || test))
        return snprintf(err, errlen, "--data %s is one file, a training set only: evaluation needs a folder with "
                        "train.jsonl and valid.jsonl%s", o->data_dir, test ? " (and test.jsonl for --test)" : ""), -1;
    const char *missing = train && !files->train ? "train" : valid && !files->valid ? "valid" :
                          test && !files->test ? "test" : NULL;
    if (missing) return snprintf(err, errlen, "--data %s has no %s.jsonl", o->data_dir, missing), -1;
    return 0;
}

int data_check_run(const train_options *o, char *err, size_t errlen) {
    data_paths files;
    int rc = data_files(o->data_dir, &files, err, errlen);
    if (rc == 0) rc = check_files(o, &files, err, errlen);
    data_paths_free(&files);
    return rc;
}

/* One split: loaded, and at least one batch of records (whole batches only, as mlx-lm iterates). */
static int load_split(const char *path, const data_options *opt, int batch, dataset *d, char *err, size_t errlen) {
    if (dataset_load(path, opt, d, err, errlen) != 0) return -1;
    if (d->count < batch) {
        snprintf(err, errlen, "%s has %d records, fewer than one batch of %d", path, d->count, batch);
        dataset_free(d);
        return -1;
    }
    return 0;
}

int data_load_run(const train_options *o, int vocab, dataset *train, dataset *valid, dataset *test, char *err,
                  size_t errlen) {
    memset(train, 0, sizeof *train);
    memset(valid, 0, sizeof *valid);
    if (test) memset(test, 0, sizeof *test);
    data_paths files;
    if (data_files(o->data_dir, &files, err, errlen) != 0) return -1;
    int need_train, need_valid, need_test;
    run_needs(o, &need_train, &need_valid, &need_test);
    int has_tokenizer = model_has_tokenizer(o->model_dir);
    data_options opt = {vocab, o->max_len, o->pad_target, o->mask_prompt, has_tokenizer && !o->byte_tokens,
                        o->model_dir, o->data_dir};
    int rc = check_files(o, &files, err, errlen);
    if (rc == 0 && need_valid) rc = load_split(files.valid, &opt, o->batch, valid, err, errlen);
    if (rc == 0 && need_train) rc = load_split(files.train, &opt, o->batch, train, err, errlen);
    if (rc == 0 && need_test && test) rc = load_split(files.test, &opt, o->batch, test, err, errlen);
    data_paths_free(&files);
    if (rc != 0) {
        dataset_free(train);
        dataset_free(valid);
        if (test) dataset_free(test);
        return -1;
    }
    if (train->text_records || valid->text_records || (test && test->text_records))
        printf("data: {\"text\"} records read as UTF-8 bytes (BOS, byte + 3, EOS): %s\n",
               o->byte_tokens ? "--byte-tokens" : "the model folder has no tokenizer");
    return 0;
}
