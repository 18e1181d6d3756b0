/* test_train_data.c — the trainer's data path (train/data.h):
 *   1. --data as a folder (train/valid/test.jsonl) or one JSONL file, and evaluation refused
 *      where one file leaves no held-out set;
 *   2. mlx-lm's raw records: {"text"} refused next to a tokenizer with the exact command that
 *      prepares it, read as bytes only under --byte-tokens or without a tokenizer (said on
 *      stdout); {"prompt", "completion"} and {"messages"} refused with the command always;
 *   3. the prompt's "offset" of prepared records: every token trained without --mask-prompt, the
 *      prompt's targets masked with it; --mask-prompt refused where no record marks a prompt or
 *      records are text, as mlx-lm refuses it; an all-masked dataset refused, after masking too;
 *   4. the same through train_run on the gemma4_smoke fixture (the evaluation's target count).
 * Usage: test_train_data [FIXTURES_DIR] (default train/fixtures). */
#define _GNU_SOURCE
#include "check.h"
#include "data.h"
#include "train.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *fixtures = "train/fixtures";

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) {
        check_fail("cannot write %s", path);
        return;
    }
    fputs(text, f);
    fclose(f);
}

static int one_line(const char *text) {
    return strchr(text, '\n') == NULL && strchr(text, '\r') == NULL;
}

/* stdout into a file between capture_begin and capture_end, which reads it back. */
typedef struct captured {
    char text[8192];
} captured;

static int capture_begin(const char *tmp, int *saved, char *path, size_t pathlen) {
    snprintf(path, pathlen, "%s/stdout.txt", tmp);
    fflush(stdout);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    *saved = dup(STDOUT_FILENO);
    if (fd < 0 || *saved < 0 || dup2(fd, STDOUT_FILENO) < 0) return -1;
    close(fd);
    return 0;
}

static void capture_end(int saved, const char *path, captured *c) {
    fflush(stdout);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    c->text[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t n = fread(c->text, 1, sizeof c->text - 1, f);
    c->text[n] = '\0';
    fclose(f);
}

/* ---------------------------------------------------------------------------------------------
 * 1. Folder or file */

static void test_data_files(const char *tmp) {
    char dir[1024], path[1100], err[512] = "";
    data_paths p;
    snprintf(dir, sizeof dir, "%s/folder", tmp);
    mkdir(dir, 0777);
    snprintf(path, sizeof path, "%s/train.jsonl", dir);
    write_text(path, "{\"tokens\": [2, 5]}\n");
    snprintf(path, sizeof path, "%s/valid.jsonl", dir);
    write_text(path, "{\"tokens\": [2, 5]}\n");
    int rc = data_files(dir, &p, err, sizeof err);
    char want[1100];
    snprintf(want, sizeof want, "%s/valid.jsonl", dir);
    check(rc == 0 && !p.is_file && p.train && p.valid && strcmp(p.valid, want) == 0 && p.test == NULL,
          "data_files: a folder gives train.jsonl and valid.jsonl, no test.jsonl where there is none %s", err);
    data_paths_free(&p);

    char slashed[1100];
    snprintf(slashed, sizeof slashed, "%s//", dir);
    rc = data_files(slashed, &p, err, sizeof err);
    check(rc == 0 && p.valid && strcmp(p.valid, want) == 0, "data_files: trailing slashes dropped (%s)",
          p.valid ? p.valid : err);
    data_paths_free(&p);

    rc = data_files(path, &p, err, sizeof err);
    check(rc == 0 && p.is_file && p.train && strcmp(p.train, path) == 0 && !p.valid && !p.test,
          "data_files: one file is the training set, with no held-out or test set %s", err);
    data_paths_free(&p);

    snprintf(path, sizeof path, "%s/missing", tmp);
    rc = data_files(path, &p, err, sizeof err);
    check(rc != 0 && strstr(err, path) && strstr(err, "No such file") && one_line(err),
          "data_files refuses a missing path: \"%s\"", err);
    data_paths_free(&p);

    rc = data_files(NULL, &p, err, sizeof err);
    check(rc != 0 && strstr(err, "no --data given"), "data_files refuses no path: \"%s\"", err);
    data_paths_free(&p);

    snprintf(path, sizeof path, "%s/fifo", tmp);
    if (mkfifo(path, 0600) == 0) {
        rc = data_files(path, &p, err, sizeof err);
        check(rc != 0 && strstr(err, "neither a folder nor a JSONL file"), "data_files refuses a FIFO: \"%s\"", err);
        data_paths_free(&p);
        unlink(path);
    } else check_skip("data_files: a FIFO (mkfifo failed)");
}

/* ---------------------------------------------------------------------------------------------
 * 2. Raw records and the prepare command */

static void test_raw_records(const char *tmp) {
    char path[1024], err[2048] = "";
    dataset d;
    snprintf(path, sizeof path, "%s/text.jsonl", tmp);
    write_text(path, "{\"text\": \"ab\"}\n");
    data_options refuse = {.vocab = 300, .refuse_text = 1, .model_dir = "ck", .data_path = path};
    int rc = dataset_load(path, &refuse, &d, err, sizeof err);
    char cmd[1500];
    snprintf(cmd, sizeof cmd, "python3 train/prepare_data.py --model ck --data %s --out %s/text.tokens.jsonl, then "
             "train with --data %s/text.tokens.jsonl", path, tmp, tmp);
    check(rc != 0 && one_line(err) && strstr(err, ":1: {\"text\"} records need the checkpoint's tokenizer") &&
              strstr(err, cmd) && strstr(err, "--byte-tokens"),
          "data: {\"text\"} next to a tokenizer refused with the command and --byte-tokens: \"%s\"", err);

    data_options bytes = {.vocab = 300, .model_dir = "ck"};
    rc = dataset_load(path, &bytes, &d, err, sizeof err);
    check(rc == 0 && d.count == 1 && d.text_records == 1 && d.seq[0].len == 4 && d.seq[0].tokens[1] == 'a' + TOKEN_BYTE0,
          "data: {\"text\"} as bytes where allowed, counted as text %s", rc ? err : "");
    if (rc == 0) dataset_free(&d);

    /* prompt/completion, chat and tools: refused whatever refuse_text says */
    const struct { const char *record, *needle; } raw[] = {
        {"{\"prompt\": \"q\", \"completion\": \"a\"}", "{\"prompt\", \"completion\"} records need the checkpoint's chat template"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}", "{\"messages\"} (chat) records need"},
        {"{\"messages\": [], \"tools\": [{\"name\": \"f\"}]}", "{\"messages\"} (chat) records need"},
        {"{\"text\": \"x\", \"tools\": []}", "chat template"},
    };
    for (size_t i = 0; i < sizeof raw / sizeof *raw; i++) {
        char line[512];
        snprintf(line, sizeof line, "{\"tokens\": [2, 5]}\n%s\n", raw[i].record);
        write_text(path, line);
        rc = dataset_load(path, &bytes, &d, err, sizeof err);
        check(rc != 0 && one_line(err) && strstr(err, ":2: ") && strstr(err, raw[i].needle) &&
                  strstr(err, "python3 train/prepare_data.py --model ck --data ") && !strstr(err, "--byte-tokens"),
              "data: %s refused with the prepare command, even with byte tokens allowed: \"%s\"", raw[i].record, err);
    }

    /* the command quotes what the shell would split, and points a folder at FOLDER-tokens */
    char prepared[512];
    data_prepare_command("my model", "it's/data/", cmd, sizeof cmd, prepared, sizeof prepared);
    check(strcmp(cmd, "python3 train/prepare_data.py --model 'my model' --data 'it'\\''s/data/' --out "
                      "'it'\\''s/data-tokens'") == 0 && strcmp(prepared, "'it'\\''s/data-tokens'") == 0,
          "data: the prepare command quotes paths for the shell: %s", cmd);
    data_prepare_command(NULL, tmp, cmd, sizeof cmd, prepared, sizeof prepared);
    char want[1500];
    snprintf(want, sizeof want, "python3 train/prepare_data.py --model MODEL --data %s --out %s-tokens", tmp, tmp);
    check(strcmp(cmd, want) == 0, "data: the prepare command for a folder: %s", cmd);

    /* what counts as a tokenizer */
    char model[1024], file[1100];
    snprintf(model, sizeof model, "%s/model", tmp);
    mkdir(model, 0777);
    int without = model_has_tokenizer(model);
    snprintf(file, sizeof file, "%s/tokenizer.model", model);
    write_text(file, "x");
    int with = model_has_tokenizer(model);
    unlink(file);
    snprintf(file, sizeof file, "%s/tokenizer_config.json", model);
    write_text(file, "{}");
    int with_config = model_has_tokenizer(model);
    unlink(file);
    check(!without && with && with_config && !model_has_tokenizer(NULL),
          "data: tokenizer.model or tokenizer_config.json in the model folder is a tokenizer (%d %d %d)", without, with,
          with_config);
}

/* ---------------------------------------------------------------------------------------------
 * 3. Prompt offsets, --mask-prompt, all-masked data */

static void test_offsets(const char *tmp) {
    char path[1024], err[2048] = "";
    dataset d;
    snprintf(path, sizeof path, "%s/offset.jsonl", tmp);
    /* 6 tokens, prompt 4: targets are tokens 1..5 (5) without masking, tokens 4..5 (2) with it */
    write_text(path, "{\"tokens\": [2, 10, 11, 12, 20, 1], \"offset\": 4}\n{\"tokens\": [2, 7, 8], \"offset\": 0}\n");
    data_options plain = {.vocab = 300};
    int rc = dataset_load(path, &plain, &d, err, sizeof err);
    check(rc == 0 && d.targets == 5 + 2 && d.seq[0].target_mask == NULL,
          "data: \"offset\" without --mask-prompt trains every token (%ld targets) %s", rc ? 0 : d.targets, rc ? err : "");
    if (rc == 0) dataset_free(&d);

    data_options masked = {.vocab = 300, .mask_prompt = 1};
    rc = dataset_load(path, &masked, &d, err, sizeof err);
    const uint8_t *m = rc == 0 ? d.seq[0].target_mask : NULL;
    check(rc == 0 && d.targets == 2 + 2 && m && !m[0] && !m[1] && !m[2] && m[3] && m[4],
          "data: --mask-prompt trains token i only where i >= offset (%ld targets) %s", rc ? 0 : d.targets,
          rc ? err : "");
    if (rc == 0) dataset_free(&d);

    /* truncation keeps the mask; the pad target stays a target */
    data_options cut = {.vocab = 300, .mask_prompt = 1, .max_len = 5, .pad_target = 1};
    rc = dataset_load(path, &cut, &d, err, sizeof err);
    m = rc == 0 ? d.seq[0].target_mask : NULL;
    check(rc == 0 && d.seq[0].len == 6 && m && !m[2] && m[3] && m[4] && d.seq[0].tokens[5] == TOKEN_PAD,
          "data: --mask-prompt with --max-seq-length and --pad-target %s", rc ? err : "");
    if (rc == 0) dataset_free(&d);

    /* an explicit mask is kept; the offset masks more under --mask-prompt only */
    write_text(path, "{\"tokens\": [2, 10, 11, 12], \"mask\": [0, 1, 1, 0], \"offset\": 2}\n");
    rc = dataset_load(path, &plain, &d, err, sizeof err);
    long t_plain = rc == 0 ? d.targets : -1;
    if (rc == 0) dataset_free(&d);
    rc = dataset_load(path, &masked, &d, err, sizeof err);
    long t_masked = rc == 0 ? d.targets : -1;
    if (rc == 0) dataset_free(&d);
    check(t_plain == 2 && t_masked == 1, "data: \"mask\" kept as given (2 targets: %ld), the offset on top under "
          "--mask-prompt (1: %ld) %s", t_plain, t_masked, err);

    const struct { const char *text, *needle; const data_options *opt; } bad[] = {
        {"{\"tokens\": [2, 5], \"offset\": 3}\n", "\"offset\" (the prompt's token count) must be an integer in [0, 2]", &plain},
        {"{\"tokens\": [2, 5], \"offset\": -1}\n", "must be an integer in [0, 2]", &plain},
        {"{\"tokens\": [2, 5], \"offset\": \"1\"}\n", "must be an integer", &plain},
        {"{\"text\": \"ab\", \"offset\": 1}\n", "\"offset\" belongs to records with \"tokens\"", &plain},
        {"{\"tokens\": [2, 5, 6]}\n{\"tokens\": [2, 5]}\n", "--mask-prompt: no record marks where its prompt ends", &masked},
        {"{\"tokens\": [2, 5], \"offset\": 1}\n{\"text\": \"ab\"}\n", "--mask-prompt: its 1 {\"text\"} records have no prompt", &masked},
        /* every target masked, by the prompt under --mask-prompt: nothing to learn */
        {"{\"tokens\": [2, 5, 6], \"offset\": 3}\n{\"tokens\": [2, 5], \"offset\": 2}\n",
         "every target of its 2 records is masked (with --mask-prompt)", &masked},
        {"{\"tokens\": [2, 5, 6], \"mask\": [1, 0, 0]}\n", "every target of its 1 records is masked", &plain},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(path, sizeof path, "%s/bad_offset%zu.jsonl", tmp, i);
        write_text(path, bad[i].text);
        rc = dataset_load(path, bad[i].opt, &d, err, sizeof err);
        check(rc != 0 && one_line(err) && strncmp(err, path, strlen(path)) == 0 && strstr(err, bad[i].needle),
              "data refused: \"%s\"", err);
    }
}

/* ---------------------------------------------------------------------------------------------
 * data_load_run: what a run asks for */

static void run_options(train_options *o, const char *model, const char *data) {
    train_defaults(o);
    o->model_dir = model;
    o->data_dir = data;
    o->batch = 2;
}

static void test_load_run(const char *tmp) {
    char model[1024], data[1024], path[1100], err[2048] = "", cap[1100];
    dataset train, valid, test;
    snprintf(model, sizeof model, "%s/run_model", tmp);
    mkdir(model, 0777);
    snprintf(data, sizeof data, "%s/run_data", tmp);
    mkdir(data, 0777);
    const char *text2 = "{\"text\": \"one\"}\n{\"text\": \"two\"}\n";
    snprintf(path, sizeof path, "%s/train.jsonl", data);
    write_text(path, text2);
    snprintf(path, sizeof path, "%s/valid.jsonl", data);
    write_text(path, text2);

    train_options o;
    run_options(&o, model, data);
    o.eval_at_end = 1;
    int saved;
    captured out;
    int rc = -1;
    if (capture_begin(tmp, &saved, cap, sizeof cap) == 0) {
        rc = data_load_run(&o, 300, &train, &valid, NULL, err, sizeof err);
        capture_end(saved, cap, &out);
    }
    check(rc == 0 && train.count == 2 && valid.count == 2 &&
              strstr(out.text, "records read as UTF-8 bytes (BOS, byte + 3, EOS): the model folder has no tokenizer") &&
              strchr(out.text, '\n') == strrchr(out.text, '\n'),
          "data_load_run: no tokenizer, text read as bytes, said once on stdout: \"%s\" %s", out.text, rc ? err : "");
    if (rc == 0) dataset_free(&train), dataset_free(&valid);

    snprintf(path, sizeof path, "%s/tokenizer.json", model);
    write_text(path, "{}");
    rc = data_load_run(&o, 300, &train, &valid, NULL, err, sizeof err);
    check(rc != 0 && one_line(err) && strstr(err, "valid.jsonl:1: {\"text\"} records need the checkpoint's tokenizer") &&
              strstr(err, "--model ") && strstr(err, model) && strstr(err, "-tokens"),
          "data_load_run: a tokenizer in the model folder refuses text: \"%s\"", err);

    o.byte_tokens = 1;
    rc = -1;
    if (capture_begin(tmp, &saved, cap, sizeof cap) == 0) {
        rc = data_load_run(&o, 300, &train, &valid, NULL, err, sizeof err);
        capture_end(saved, cap, &out);
    }
    check(rc == 0 && train.count == 2 && strstr(out.text, "read as UTF-8 bytes (BOS, byte + 3, EOS): --byte-tokens"),
          "data_load_run: --byte-tokens reads text as bytes beside a tokenizer: \"%s\" %s", out.text, rc ? err : "");
    if (rc == 0) dataset_free(&train), dataset_free(&valid);

    /* one file: training only; evaluation asked of it is refused */
    snprintf(path, sizeof path, "%s/train.jsonl", data);
    o.data_dir = path;
    rc = data_load_run(&o, 300, &train, &valid, NULL, err, sizeof err);
    check(rc != 0 && one_line(err) && strstr(err, "is one file, a training set only: evaluation needs a folder"),
          "data_load_run: --eval with one file refused: \"%s\"", err);
    o.eval_at_end = 0;
    o.eval_every = 5;
    o.test = 1;
    rc = data_load_run(&o, 300, &train, &valid, &test, err, sizeof err);
    check(rc != 0 && strstr(err, "test.jsonl for --test"), "data_load_run: --steps-per-eval and --test with one "
          "file refused: \"%s\"", err);
    o.eval_every = 0;
    o.test = 0;
    rc = data_load_run(&o, 300, &train, &valid, &test, err, sizeof err);
    check(rc == 0 && train.count == 2 && valid.count == 0 && test.count == 0,
          "data_load_run: one file trains %s", rc ? err : "");
    if (rc == 0) dataset_free(&train);

    /* data_check_run, before any load: the same refusals */
    o.eval_at_end = 1;
    check(data_check_run(&o, err, sizeof err) != 0 && strstr(err, "one file, a training set only"),
          "data_check_run: --eval with one file refused: \"%s\"", err);
    o.eval_at_end = 0;
    check(data_check_run(&o, err, sizeof err) == 0, "data_check_run: one file, training only %s", err);
    o.data_dir = model;
    o.eval_only = 1;
    check(data_check_run(&o, err, sizeof err) != 0 && strstr(err, "has no valid.jsonl"),
          "data_check_run: a folder without valid.jsonl, evaluating: \"%s\"", err);
    o.eval_only = 0;

    /* a folder without the split asked for; a split smaller than a batch */
    o.data_dir = data;
    o.test = 1;
    rc = data_load_run(&o, 300, &train, &valid, &test, err, sizeof err);
    check(rc != 0 && strstr(err, "has no test.jsonl"), "data_load_run: --test without test.jsonl: \"%s\"", err);
    snprintf(path, sizeof path, "%s/test.jsonl", data);
    write_text(path, text2);
    rc = data_load_run(&o, 300, &train, &valid, &test, err, sizeof err);
    check(rc == 0 && test.count == 2 && train.count == 2, "data_load_run: --test loads test.jsonl %s", rc ? err : "");
    if (rc == 0) dataset_free(&train), dataset_free(&test);
    o.test = 0;
    o.batch = 3;
    rc = data_load_run(&o, 300, &train, &valid, &test, err, sizeof err);
    check(rc != 0 && strstr(err, "has 2 records, fewer than one batch of 3"), "data_load_run: a split under one "
          "batch refused: \"%s\"", err);
}

/* ---------------------------------------------------------------------------------------------
 * 4. Through train_run on a fixture */

static void test_train_run(const char *tmp) {
    char model[1024], data[1024], path[1100], out_dir[1100], err[2048] = "", cap[1100];
    snprintf(model, sizeof model, "%s/gemma4_smoke", fixtures);
    snprintf(data, sizeof data, "%s/prepared", tmp);
    mkdir(data, 0777);
    /* prompt 3 of 6 tokens, twice: 10 targets, 6 under --mask-prompt */
    const char *records = "{\"tokens\": [2, 10, 11, 20, 21, 1], \"offset\": 3}\n"
                          "{\"tokens\": [2, 12, 13, 22, 23, 1], \"offset\": 3}\n";
    snprintf(path, sizeof path, "%s/train.jsonl", data);
    write_text(path, records);
    snprintf(path, sizeof path, "%s/valid.jsonl", data);
    write_text(path, records);
    snprintf(out_dir, sizeof out_dir, "%s/run_out", tmp);

    train_options o;
    run_options(&o, model, data);
    o.out_dir = out_dir;
    o.iters = 1;
    o.lora.rank = 2;
    o.threads = 1;
    o.eval_at_end = 1;
    for (int mask_prompt = 0; mask_prompt < 2; mask_prompt++) {
        o.mask_prompt = mask_prompt;
        int saved, rc = -1;
        captured out = {""};
        if (capture_begin(tmp, &saved, cap, sizeof cap) == 0) {
            rc = train_run(&o, err, sizeof err);
            capture_end(saved, cap, &out);
        }
        const char *eval = strstr(out.text, "eval after training: held-out loss ");
        int targets = -1;
        if (eval) {
            const char *over = strstr(eval, " over ");
            if (over) targets = atoi(over + 6);
        }
        check(rc == 0 && targets == (mask_prompt ? 6 : 10), "train_run: the evaluation counts %d targets%s "
              "(expected %d) %s", targets, mask_prompt ? " with --mask-prompt" : "", mask_prompt ? 6 : 10,
              rc ? err : "");
    }

    /* --data FILE trains; raw records beside no tokenizer read as bytes; chat refused */
    snprintf(path, sizeof path, "%s/one.jsonl", tmp);
    write_text(path, "{\"text\": \"first record\"}\n{\"text\": \"second record\"}\n");
    o.data_dir = path;
    o.mask_prompt = 0;
    o.eval_at_end = 0;
    int saved, rc = -1;
    captured out = {""};
    if (capture_begin(tmp, &saved, cap, sizeof cap) == 0) {
        rc = train_run(&o, err, sizeof err);
        capture_end(saved, cap, &out);
    }
    check(rc == 0 && strstr(out.text, "step 1/1") && strstr(out.text, "read as UTF-8 bytes"),
          "train_run: --data FILE of text records trains on bytes (the fixture has no tokenizer) %s", rc ? err : "");
    write_text(path, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
    rc = train_run(&o, err, sizeof err);
    check(rc != 0 && one_line(err) && strstr(err, "python3 train/prepare_data.py --model ") && strstr(err, model),
          "train_run: chat records refused with the prepare command: \"%s\"", err);
    /* refused before the model loads: nothing printed */
    o.eval_at_end = 1;
    rc = -1;
    out.text[0] = '\0';
    if (capture_begin(tmp, &saved, cap, sizeof cap) == 0) {
        rc = train_run(&o, err, sizeof err);
        capture_end(saved, cap, &out);
    }
    check(rc != 0 && strstr(err, "is one file, a training set only") && out.text[0] == '\0',
          "train_run: --eval with --data FILE refused before the model loads: \"%s\" (stdout \"%.60s\")", err, out.text);
}

int main(int argc, char **argv) {
    if (argc > 1) fixtures = argv[1];
    char tmp[] = "/tmp/test_train_data.XXXXXX";
    if (!mkdtemp(tmp)) return 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_data_files(tmp);
    test_raw_records(tmp);
    test_offsets(tmp);
    test_load_run(tmp);
    test_train_run(tmp);
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", tmp);
    return check_summary();
}
