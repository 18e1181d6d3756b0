/* cmd_train.c — `winattn train`: LoRA fine-tuning of a Gemma 4 / Gemma 3 checkpoint through one
 * of three attention arms (train/train.h); and `winattn init-model`: a seeded random checkpoint
 * for a config, for demos and tests where no pretrained weights are reachable. */
#define _GNU_SOURCE
#include "tool.h"
#include "train.h" /* the trainer's one interface (libwinattn_train.a) */
#include "train_yaml.h" /* -c FILE: mlx-lm's config keys, through libyaml */

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char train_usage[] = "winattn train --model DIR --data DIR|FILE [options]; winattn train --help lists them";
static const char train_help[] =
    "usage: winattn train --model DIR --data DIR|FILE [options], or winattn train -c CONFIG.yaml [options]\n"
    "\n"
    "LoRA fine-tuning of a Gemma 4 / Gemma 3 checkpoint, after mlx-lm's trainer (mlx_lm.lora): its flag\n"
    "names and config file work here; the names in brackets are this command's own aliases.\n"
    "\n"
    "  -c, --config FILE  a YAML file of mlx-lm's LoRA config keys (below); flags override it\n"
    "  --model DIR        config.json + model.safetensors (or model.safetensors.index.json and shards)\n"
    "  --data DIR|FILE    a folder with train.jsonl, valid.jsonl (and test.jsonl), or one JSONL file;\n"
    "                     records {\"tokens\": [...], \"mask\": [...]} or mlx-lm's text, prompt/completion, messages\n"
    "  --train            train (the default; mlx-lm's flag); --eval-only evaluates instead\n"
    "  --iters N          batches to train on; or --epochs E, passes over train.jsonl (default 2):\n"
    "                     ceil(E * records / batch) batches\n"
    "  --batch-size B     records per batch (default 4); loss = token-weighted mean over the batch\n"
    "  --learning-rate LR [--lr] default 1e-5; Adam (MLX's, no bias correction) or AdamW\n"
    "  --lr-schedule S    constant (default), cosine or linear decay (mlx's cosine_decay, linear_schedule)\n"
    "                     from LR to --lr-end (default 0) over --decay-steps N updates (default 0: the\n"
    "                     rest of the run); --warmup N updates rising from --warmup-init (default 0) first\n"
    "  --grad-clip NORM   clip the gradient to this global L2 norm before each update (default 0: off)\n"
    "  --optimizer O      adam (default) or adamw; --weight-decay WD (AdamW's, default 0.01);\n"
    "                     --bias-correction\n"
    "  --grad-accumulation-steps K [--grad-accum] batches per optimizer update (default 1)\n"
    "  --num-layers N     [--lora-layers] adapt the last N layers (default, -1 or 0: all)\n"
    "  --lora-rank R      default 32; --lora-scale S default 20; --lora-keys q,k,v,o,gate,up,down\n"
    "                     (default q,k,v,o); in a config file: lora_parameters\n"
    "  --fine-tune-type lora  the only kind this trainer runs\n"
    "  --seed S           adapter initialisation and batch order (default 0)\n"
    "  --adapter-path DIR [--out] where checkpoints go (default adapters, as mlx-lm): adapters,\n"
    "                     adapter_config.json, optimizer state, log.jsonl (or --log FILE)\n"
    "  --adapter-format F mlx (default: adapters.safetensors, mlx_lm.load's layout) or peft\n"
    "                     (adapter_model.safetensors, PeftModel.from_pretrained's)\n"
    "  --save-every N     also a numbered checkpoint every N updates (default 0: at the end only)\n"
    "  --resume-adapter-file F [--adapters] start from (or with --eval-only, evaluate) these adapters:\n"
    "                     mlx-lm's or peft's weights file, or their folder (whose adapter_config.json\n"
    "                     then sets rank, scale, keys and layers)\n"
    "  --resume DIR       continue a run saved in DIR (adapters, optimizer state, step)\n"
    ;
/* the help in three pieces: ISO C's longest required string literal is 4,095 characters */
static const char train_help_eval[] =
    "  --steps-per-eval N [--eval-every] held-out loss on valid.jsonl before training and every N batches\n"
    "  --eval             held-out loss and next-token agreement on valid.jsonl at the end\n"
    "  --eval-only        just evaluate (a config file's train: false)\n"
    "  --val-batches N    batches of valid.jsonl per evaluation (default -1 or 0: all)\n"
    "  --test             after training, the loss on test.jsonl\n"
    "  --max-seq-length N truncate records (default: none); --pad-target adds mlx-lm's extra pad target\n"
    "  --mask-prompt      no loss on the prompt of records that mark one\n"
    "  --byte-tokens      {\"text\"} records as UTF-8 bytes even where the model has a tokenizer\n"
    "  --grad-checkpoint  accepted, changes nothing: the backward always recomputes each layer\n"
    "  --steps-per-report N  accepted, changes nothing: every step is reported\n"
    "  --attn A           fused (winattn, default), dense (full score matrices), chunked (query blocks of --chunk Q)\n"
    "  --pack 0|1         1 (default): a batch's records run as one packed sequence, attention kept within\n"
    "                     each record; 0: one record at a time (same losses)\n"
    "  --threads T        CPU threads\n"
    "  --device D         cpu (default, float32, the reference) or cuda: the model on one NVIDIA GPU,\n"
    "                     cuBLAS products and winattn's CUDA kernels (--attn is fused there)\n"
    "  --precision P      on cuda: bf16 (default) weights and activations, or f32 (checks the CPU path)\n"
    "  --base-dtype B     the frozen projections: bf16 (default: as the checkpoint stores them), mlx4\n"
    "                     (MLX's affine 4-bit, group 64), nf4 (bitsandbytes' NF4, blocks of 64,\n"
    "                     double-quantized absmax, as QLoRA) or fp8 (e4m3, a scale per output channel);\n"
    "                     cpu dequantizes them to f32 at load, cuda keeps them packed on the device and\n"
    "                     dequantizes a layer at a time. A folder from\n"
    "                     mlx_lm.convert -q, or a transformers checkpoint saved with a bitsandbytes\n"
    "                     4-bit quantization_config, is read as it is stored whatever this says\n"
    "  --init-random SEED on cuda: draw the base weights on the GPU (N(0, 0.02), norms 1) instead of\n"
    "                     reading model files; --model DIR then needs config.json only\n"
    "  --deterministic    on cuda: winattn's deterministic attention backward (a few % slower), so that\n"
    "                     a run, or one stopped and resumed, repeats bit for bit\n"
    "  --print-config     print the options as a config file (after -c and the flags) and exit\n"
    "  -h, --help         this help\n"
    ;
static const char train_help_config[] =
    "\n"
    "Config file keys (mlx-lm's; docs/train.md has the details): model, data, train, seed, num_layers\n"
    "(or lora_layers), batch_size, iters, val_batches, learning_rate, steps_per_eval, resume_adapter_file,\n"
    "adapter_path, save_every, test, max_seq_length, grad_accumulation_steps, mask_prompt, fine_tune_type\n"
    "(lora), optimizer (adam, adamw), optimizer_config {adam|adamw: {betas, eps, bias_correction,\n"
    "weight_decay}}, lr_schedule {name: cosine_decay|linear_schedule, arguments, warmup, warmup_init},\n"
    "lora_parameters {keys, rank, scale, dropout: 0}; this trainer's own: epochs, grad_clip, adapter_format,\n"
    "byte_tokens. Accepted without effect: steps_per_report, test_batches, grad_checkpoint,\n"
    "clear_cache_threshold, project_name, trust_remote_code. Refused: report_to, wandb, hf_dataset, and\n"
    "any other key (a misspelt key must not train with a default).\n";

static unsigned parse_keys(const char *v) {
    unsigned mask = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int found = train_lora_key(t);
        if (found < 0) usage_error(train_usage, "--lora-keys: '%s' is not one of q, k, v, o, gate, up, down", t);
        mask |= 1u << found;
    }
    if (!mask) usage_error(train_usage, "--lora-keys needs at least one projection");
    return mask;
}

/* a finite number, read as a double (as a config file's numbers are, so a flag and the file's
 * key give the same run) */
static double parse_positive(const char *flag, const char *v, int allow_zero) {
    char *end;
    errno = 0;
    double x = *v ? strtod(v, &end) : NAN;
    if (!*v || errno || *end || !isfinite(x) || x < 0 || (!allow_zero && x == 0))
        usage_error(train_usage, "%s '%s': a %s number", flag, v, allow_zero ? "non-negative" : "positive");
    return x;
}

static int parse_int_flag(const char *flag, const char *v, int64_t lo, int64_t hi) {
    int64_t x;
    if (parse_i64(v, lo, hi, &x)) usage_error(train_usage, "%s '%s': an integer in [%lld, %lld]", flag, v, (long long)lo,
                                              (long long)hi);
    return (int)x;
}

static int is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* a config file's refusal: one line, exit 2 as for a bad flag */
static _Noreturn void config_error(const char *msg) {
    fprintf(stderr, "winattn train: %s\n", msg);
    exit(2);
}

/* Flags that set one option under two names: mlx-lm's first, then this command's. */
static const char *flag_either(int argc, char **argv, int *i, const char *name, const char *alias) {
    const char *v = flag_value(argc, argv, i, name, train_usage);
    return v ? v : flag_value(argc, argv, i, alias, train_usage);
}

int cmd_train(int argc, char **argv) {
    train_options o;
    train_defaults(&o);
    train_file file;
    memset(&file, 0, sizeof file);
    const char *v, *config_path = NULL;
    char err[4096]; /* room for a message that quotes a whole prepare command */
    /* the config file first, wherever -c stands: every flag then overrides what it set */
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) {
            fputs(train_help, stdout);
            fputs(train_help_eval, stdout);
            show_help(train_help_config);
        }
        if ((v = flag_either(argc, argv, &i, "--config", "-c"))) {
            if (config_path) usage_error(train_usage, "one config file (-c) only");
            config_path = v;
        }
    }
    if (config_path && train_file_load(config_path, &o, &file, err, sizeof err) != 0) config_error(err);

    int saw_epochs = 0, saw_iters = 0, saw_precision = 0, saw_weight_decay = 0, saw_bias_correction = 0;
    int saw_train = 0, saw_eval_only = 0, saw_resume = 0, print_config = 0;
    int saw_lr_end = 0, saw_decay_steps = 0, saw_out = 0;
    for (int i = 1; i < argc; i++) {
        if ((v = flag_either(argc, argv, &i, "--config", "-c"))) continue;
        if ((v = flag_value(argc, argv, &i, "--model", train_usage))) o.model_dir = v;
        else if ((v = flag_value(argc, argv, &i, "--data", train_usage))) o.data_dir = v;
        else if ((v = flag_value(argc, argv, &i, "--attn", train_usage))) {
            if (strcmp(v, "fused") == 0) o.arm = ATTN_FUSED;
            else if (strcmp(v, "dense") == 0) o.arm = ATTN_DENSE;
            else if (strcmp(v, "chunked") == 0) o.arm = ATTN_CHUNKED;
            else usage_error(train_usage, "--attn '%s': fused, dense or chunked", v);
        } else if ((v = flag_value(argc, argv, &i, "--chunk", train_usage))) o.chunk = parse_int_flag("--chunk", v, 1, 1 << 20);
        else if ((v = flag_value(argc, argv, &i, "--epochs", train_usage))) o.epochs = parse_positive("--epochs", v, 0), saw_epochs = 1;
        else if ((v = flag_value(argc, argv, &i, "--iters", train_usage))) o.iters = parse_int_flag("--iters", v, 1, 1 << 30), saw_iters = 1;
        else if ((v = flag_value(argc, argv, &i, "--batch-size", train_usage))) o.batch = parse_int_flag("--batch-size", v, 1, 1 << 20);
        else if ((v = flag_value(argc, argv, &i, "--pack", train_usage))) o.pack = parse_int_flag("--pack", v, 0, 1);
        else if ((v = flag_either(argc, argv, &i, "--grad-accumulation-steps", "--grad-accum")))
            o.grad_accum = parse_int_flag("--grad-accumulation-steps", v, 1, 1 << 20);
        else if ((v = flag_either(argc, argv, &i, "--learning-rate", "--lr"))) o.lr = parse_positive("--learning-rate", v, 0);
        else if ((v = flag_value(argc, argv, &i, "--lr-schedule", train_usage))) {
            if (strcmp(v, "constant") == 0) o.schedule.decay = LR_CONSTANT;
            else if (strcmp(v, "cosine") == 0 || strcmp(v, "cosine_decay") == 0) o.schedule.decay = LR_COSINE;
            else if (strcmp(v, "linear") == 0 || strcmp(v, "linear_schedule") == 0) o.schedule.decay = LR_LINEAR;
            else usage_error(train_usage, "--lr-schedule '%s': cosine, linear or constant", v);
        } else if ((v = flag_value(argc, argv, &i, "--warmup", train_usage))) o.schedule.warmup = parse_int_flag("--warmup", v, 0, INT32_MAX);
        else if ((v = flag_value(argc, argv, &i, "--warmup-init", train_usage))) o.schedule.warmup_init = parse_positive("--warmup-init", v, 1);
        else if ((v = flag_value(argc, argv, &i, "--lr-end", train_usage))) o.schedule.end = parse_positive("--lr-end", v, 1), saw_lr_end = 1;
        else if ((v = flag_value(argc, argv, &i, "--decay-steps", train_usage)))
            o.schedule.steps = parse_int_flag("--decay-steps", v, 0, INT32_MAX), saw_decay_steps = 1;
        else if ((v = flag_value(argc, argv, &i, "--grad-clip", train_usage))) o.grad_clip = parse_positive("--grad-clip", v, 1);
        else if ((v = flag_value(argc, argv, &i, "--weight-decay", train_usage)))
            o.weight_decay = parse_positive("--weight-decay", v, 1), saw_weight_decay = 1;
        else if ((v = flag_value(argc, argv, &i, "--optimizer", train_usage))) {
            if (strcmp(v, "adam") == 0) o.adamw = 0;
            else if (strcmp(v, "adamw") == 0) o.adamw = 1;
            else usage_error(train_usage, "--optimizer '%s': adam or adamw", v);
        } else if (strcmp(argv[i], "--bias-correction") == 0) o.bias_correction = 1, saw_bias_correction = 1;
        else if ((v = flag_value(argc, argv, &i, "--fine-tune-type", train_usage))) {
            if (strcmp(v, "lora") != 0) usage_error(train_usage, "--fine-tune-type '%s': this trainer trains LoRA adapters only (lora)", v);
        } else if ((v = flag_value(argc, argv, &i, "--lora-rank", train_usage))) o.lora.rank = parse_int_flag("--lora-rank", v, 1, 4096);
        else if ((v = flag_value(argc, argv, &i, "--lora-scale", train_usage))) o.lora.scale = parse_positive("--lora-scale", v, 0);
        else if ((v = flag_value(argc, argv, &i, "--lora-keys", train_usage))) o.lora.proj_mask = parse_keys(v);
        else if ((v = flag_either(argc, argv, &i, "--num-layers", "--lora-layers"))) {
            /* mlx-lm's -1 (and 0) adapt every layer */
            o.lora.num_layers = parse_int_flag("--num-layers", v, -1, GEMMA_MAX_LAYERS);
            if (o.lora.num_layers < 0) o.lora.num_layers = 0;
        } else if ((v = flag_value(argc, argv, &i, "--seed", train_usage))) o.seed = (uint64_t)parse_int_flag("--seed", v, 0, INT32_MAX);
        else if ((v = flag_either(argc, argv, &i, "--resume-adapter-file", "--adapters"))) o.adapters_path = v;
        else if ((v = flag_value(argc, argv, &i, "--resume", train_usage))) o.resume_dir = v, saw_resume = 1;
        else if ((v = flag_either(argc, argv, &i, "--adapter-path", "--out"))) o.out_dir = v, saw_out = 1;
        else if ((v = flag_value(argc, argv, &i, "--adapter-format", train_usage))) {
            if (strcmp(v, "mlx") == 0) o.format = ADAPTERS_MLX;
            else if (strcmp(v, "peft") == 0) o.format = ADAPTERS_PEFT;
            else usage_error(train_usage, "--adapter-format '%s': mlx or peft", v);
        } else if ((v = flag_value(argc, argv, &i, "--save-every", train_usage))) o.save_every = parse_int_flag("--save-every", v, 0, 1 << 30);
        else if ((v = flag_value(argc, argv, &i, "--log", train_usage))) o.log_path = v;
        else if (strcmp(argv[i], "--train") == 0) saw_train = 1;
        else if (strcmp(argv[i], "--eval") == 0) o.eval_at_end = 1;
        else if ((v = flag_either(argc, argv, &i, "--steps-per-eval", "--eval-every")))
            o.eval_every = parse_int_flag("--steps-per-eval", v, 1, 1 << 30);
        else if ((v = flag_value(argc, argv, &i, "--val-batches", train_usage))) {
            o.val_batches = parse_int_flag("--val-batches", v, -1, 1 << 30);
            if (o.val_batches < 0) o.val_batches = 0;
        } else if (strcmp(argv[i], "--eval-only") == 0) saw_eval_only = 1;
        else if (strcmp(argv[i], "--test") == 0) o.test = 1;
        else if ((v = flag_value(argc, argv, &i, "--max-seq-length", train_usage))) o.max_len = parse_int_flag("--max-seq-length", v, 2, 1 << 30);
        else if (strcmp(argv[i], "--pad-target") == 0) o.pad_target = 1;
        else if (strcmp(argv[i], "--mask-prompt") == 0) o.mask_prompt = 1;
        else if (strcmp(argv[i], "--byte-tokens") == 0) o.byte_tokens = 1;
        else if (strcmp(argv[i], "--grad-checkpoint") == 0) continue; /* the backward always recomputes */
        else if ((v = flag_value(argc, argv, &i, "--steps-per-report", train_usage)))
            parse_int_flag("--steps-per-report", v, 1, 1 << 30); /* every step is reported */
        else if ((v = flag_value(argc, argv, &i, "--threads", train_usage))) o.threads = parse_int_flag("--threads", v, 1, 1024);
        else if ((v = flag_value(argc, argv, &i, "--device", train_usage))) {
            if (strcmp(v, "cpu") == 0) o.device = WA_DEVICE_CPU;
            else if (strcmp(v, "cuda") == 0) o.device = WA_DEVICE_CUDA;
            else usage_error(train_usage, "--device '%s': cpu or cuda", v);
        } else if ((v = flag_value(argc, argv, &i, "--base-dtype", train_usage))) {
            if (base_dtype_parse(v, &o.base) != 0)
                usage_error(train_usage, "--base-dtype '%s': bf16, mlx4, nf4 or fp8", v);
        } else if ((v = flag_value(argc, argv, &i, "--precision", train_usage))) {
            if (strcmp(v, "bf16") == 0) o.precision = PRECISION_BF16;
            else if (strcmp(v, "f32") == 0) o.precision = PRECISION_F32;
            else usage_error(train_usage, "--precision '%s': bf16 or f32", v);
            saw_precision = 1;
        } else if ((v = flag_value(argc, argv, &i, "--init-random", train_usage))) {
            o.random_init = 1;
            o.init_seed = (uint64_t)parse_int_flag("--init-random", v, 0, INT32_MAX);
        } else if (strcmp(argv[i], "--deterministic") == 0) o.deterministic = 1;
        else if (strcmp(argv[i], "--print-config") == 0) print_config = 1;
        else unknown_option(argv[i]);
    }
    if (saw_epochs && saw_iters) usage_error(train_usage, "--epochs and --iters exclude each other");
    if (saw_train && saw_eval_only) usage_error(train_usage, "--train and --eval-only exclude each other");
    /* a flag of one kind replaces the file's other kind; the trainer takes iters when set */
    if (saw_epochs) o.iters = 0;
    if (saw_eval_only) o.eval_only = 1;
    if (saw_train) o.eval_only = 0;
    /* `train: false` with no adapters named evaluates adapter_path's, as mlx-lm's --test alone does */
    if (file.eval_only && !saw_train && !saw_eval_only && !o.adapters_path && o.out_dir && !saw_resume)
        o.adapters_path = o.out_dir; /* the folder: its adapters in either layout, with their adapter_config.json */
    /* --resume DIR continues in DIR unless told to write elsewhere */
    if (o.resume_dir && !saw_out && !file.adapter_path) o.out_dir = o.resume_dir;
    train_file_apply_optimizer(&file, &o, saw_weight_decay, saw_bias_correction);
    if (o.schedule.decay == LR_CONSTANT && (saw_lr_end || saw_decay_steps))
        usage_error(train_usage, "--lr-end and --decay-steps set a decay: add --lr-schedule cosine or linear");
    if (!o.model_dir) usage_error(train_usage, "--model DIR is required (or model: in a config file)");
    if (!o.data_dir) usage_error(train_usage, "--data DIR|FILE is required (or data: in a config file)");
    if (o.resume_dir && o.adapters_path)
        usage_error(train_usage, "--resume and --resume-adapter-file (--adapters, a config file's resume_adapter_file) exclude each other");
    if (o.device != WA_DEVICE_CUDA && (saw_precision || o.random_init || o.deterministic))
        usage_error(train_usage, "--precision, --init-random and --deterministic apply to --device cuda (the CPU path "
                                 "is deterministic)");
    if (o.device == WA_DEVICE_CUDA && o.arm != ATTN_FUSED)
        usage_error(train_usage, "--device cuda runs attention through winattn only (--attn fused)");
    if (print_config) {
        if (train_file_print(stdout, &o) != 0) die("cannot write the config to stdout");
        train_file_free(&file);
        return 0;
    }
    struct stat sb;
    if (!is_dir(o.model_dir)) die("--model %s: not a directory", o.model_dir);
    if (stat(o.data_dir, &sb) != 0) die("--data %s: %s", o.data_dir, strerror(errno));
    int rc = train_run(&o, err, sizeof err);
    train_file_free(&file);
    if (rc == TRAIN_INTERRUPTED) { /* the shell's convention for a process a signal stopped: 128 + the signal */
        fprintf(stderr, "winattn train: %s\n", err);
        exit(128 + train_stop_signal);
    }
    if (rc != 0) die("%s", err);
    return 0;
}

/* ------------------------------------------------------------------------------------------- */

static const char init_usage[] = "winattn init-model CONFIG.json OUT_DIR [--seed S] [--dtype bf16|f32]";
static const char init_help[] =
    "usage: winattn init-model CONFIG.json OUT_DIR [--seed S] [--dtype bf16|f32]\n"
    "\n"
    "A seeded random checkpoint for a Gemma 4 / Gemma 3 config.json, for demos and tests where no\n"
    "pretrained weights are reachable: OUT_DIR gets model.safetensors and a copy of the config.\n"
    "\n"
    "  --seed S           the weights' seed (default 0)\n"
    "  --dtype bf16|f32   the weights' dtype (default bf16)\n"
    "  -h, --help         this help\n";

int cmd_init_model(int argc, char **argv) {
    const char *cfg_path = NULL, *out = NULL, *v;
    uint64_t seed = 0;
    int dtype_f32 = 0;
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) show_help(init_help);
        if ((v = flag_value(argc, argv, &i, "--seed", init_usage))) {
            int64_t x;
            if (parse_i64(v, 0, INT32_MAX, &x)) usage_error(init_usage, "--seed '%s'", v);
            seed = (uint64_t)x;
        } else if ((v = flag_value(argc, argv, &i, "--dtype", init_usage))) {
            if (strcmp(v, "bf16") == 0) dtype_f32 = 0;
            else if (strcmp(v, "f32") == 0) dtype_f32 = 1;
            else usage_error(init_usage, "--dtype '%s': bf16 or f32", v);
        } else if (argv[i][0] == '-') unknown_option(argv[i]);
        else if (!cfg_path) cfg_path = argv[i];
        else if (!out) out = argv[i];
        else unknown_option(argv[i]);
    }
    if (!cfg_path || !out) usage_error(init_usage, "needs CONFIG.json and OUT_DIR");
    char err[1024], desc[512];
    if (train_init_model(cfg_path, out, seed, dtype_f32, desc, sizeof desc, err, sizeof err) != 0) die("%s", err);
    printf("wrote %s/model.safetensors and config.json: %s, seed %llu\n", out, desc, (unsigned long long)seed);
    return 0;
}
