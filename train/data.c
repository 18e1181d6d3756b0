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

/* One record → s. Returns NULL on success, else a message (static text or into msg). */
static const char *parse_record(const json_t *rec, const data_options *opt, sequence *s, char *msg, size_t msglen) {
    memset(s, 0, sizeof *s);
    if (!json_is_object(rec)) return "a record must be a JSON object";
    const json_t *tokens = json_object_get(rec, "tokens"), *text = json_object_get(rec, "text");
    const json_t *mask = json_object_get(rec, "mask");
    size_t n;
    if (tokens) {
        if (!json_is_array(tokens)) return "\"tokens\" must be an array of integers";
        n = json_array_size(tokens);
    } else if (text) {
        if (!json_is_string(text)) return "\"text\" must be a string";
        if (opt->vocab < BYTE_VOCAB) {
            snprintf(msg, msglen, "text records need a vocabulary of at least %d (byte-level), the model has %d",
                     BYTE_VOCAB, opt->vocab);
            return msg;
        }
        n = json_string_length(text) + 2;
    } else {
        return "a record needs \"tokens\" or \"text\"";
    }
    if (n > (size_t)1 << 30) return "record too long";
    s->tokens = malloc((n + 1) * sizeof *s->tokens); /* + 1: room for the pad target */
    uint8_t *token_mask = mask ? malloc(n + 1) : NULL;
    if (!s->tokens || (mask && !token_mask)) return free(token_mask), "out of memory";
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
    char *line = NULL, msg[256];
    size_t cap = 0;
    ssize_t got;
    int lineno = 0, cap_seq = 0, rc = 0;
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
        const char *problem = parse_record(rec, opt, s, msg, sizeof msg);
        json_decref(rec);
        if (problem) {
            free(s->tokens);
            free(s->target_mask);
            snprintf(err, errlen, "%s:%d: %s", path, lineno, problem);
            rc = -1;
            break;
        }
        d->count++;
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
    if (rc == 0 && d->targets == 0) {
        snprintf(err, errlen, "%s: every target of its %d records is masked: nothing to learn or evaluate", path, d->count);
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
