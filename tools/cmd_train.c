/* cmd_train.c — `winattn train`: LoRA fine-tuning of a Gemma 4 / Gemma 3 checkpoint through one
 * of three attention arms (train/train.h); and `winattn init-model`: a seeded random checkpoint
 * for a config, for demos and tests where no pretrained weights are reachable. */
#define _GNU_SOURCE
#include "tool.h"
#include "train.h" /* the trainer's one interface (libwinattn_train.a) */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char train_usage[] = "winattn train --model DIR --data DIR [options]; winattn train --help lists them";
static const char train_help[] =
    "usage: winattn train --model DIR --data DIR [--attn fused|dense|chunked] [--chunk Q] [--epochs E | --iters N]\n"
    "       [--batch-size B] [--pack 0|1] [--grad-accum K] [--lr LR] [--optimizer adam|adamw] [--weight-decay WD]\n"
    "       [--bias-correction] [--lora-rank R] [--lora-scale S] [--lora-keys q,k,v,o,gate,up,down]\n"
    "       [--lora-layers N] [--seed S] [--adapters FILE|DIR] [--resume DIR] [--out DIR] [--adapter-format mlx|peft]\n"
    "       [--log FILE]\n"
    "       [--eval] [--eval-every N] [--eval-only] [--max-seq-length N] [--pad-target] [--threads T]\n"
    "       [--device cpu|cuda] [--precision bf16|f32] [--init-random SEED]\n"
    "\n"
    "  --model DIR        config.json + model.safetensors (or model.safetensors.index.json and shards)\n"
    "  --data DIR         train.jsonl and valid.jsonl: {\"tokens\": [...], \"mask\": [...]} or {\"text\": \"...\"}\n"
    "  --attn A           fused (winattn, default), dense (full score matrices), chunked (query blocks of --chunk)\n"
    "  --epochs E         passes over train.jsonl (default 2): ceil(E * records / batch) batches; or --iters N\n"
    "  --batch-size B     records per batch (default 4); loss = token-weighted mean over the batch\n"
    "  --pack 0|1         1 (default): a batch's records run as one packed sequence, attention\n"
    "                     kept within each record; 0: one record at a time (same losses)\n"
    "  --grad-accum K     batches per optimizer update (default 1)\n"
    "  --lr LR            learning rate (default 1e-5); Adam (MLX's, no bias correction) or AdamW\n"
    "  --lora-rank R      default 32; --lora-scale S default 20; --lora-keys default q,k,v,o;\n"
    "                     --lora-layers N adapts the last N layers (default all)\n"
    "  --adapters FILE    start from (or with --eval-only, evaluate) these adapters: mlx-lm's or peft's\n"
    "                     weights file, or their folder (its adapter_config.json then sets rank, scale,\n"
    "                     keys and layers)\n"
    "  --resume DIR       continue a run saved with --out DIR (adapters, optimizer state, step)\n"
    "  --out DIR          write adapters.safetensors, adapter_config.json (mlx-lm layout),\n"
    "                     optimizer.safetensors and log.jsonl (or --log FILE)\n"
    "  --adapter-format F mlx (default: adapters.safetensors for mlx_lm.load) or peft\n"
    "                     (adapter_model.safetensors for PeftModel.from_pretrained)\n"
    "  --eval             held-out loss and next-token agreement on valid.jsonl at the end;\n"
    "                     --eval-every N also every N batches; --eval-only just evaluates\n"
    "  --max-seq-length N truncate records (default: none); --pad-target adds mlx-lm's extra pad target\n"
    "  --seed S           adapter initialisation and batch order (default 0)\n"
    "  --device D         cpu (default, float32, the reference) or cuda: the model on one NVIDIA GPU,\n"
    "                     cuBLAS products and winattn's CUDA kernels (--attn is fused there)\n"
    "  --precision P      on cuda: bf16 (default) weights and activations, or f32 (checks the CPU path)\n"
    "  --init-random SEED on cuda: draw the base weights on the GPU (N(0, 0.02), norms 1) instead of\n"
    "                     reading model files; --model DIR then needs config.json only\n"
    "  -h, --help         this help\n";

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

static double parse_positive(const char *flag, const char *v, int allow_zero) {
    float x;
    if (parse_f32(v, &x) || x < 0 || (!allow_zero && x == 0)) usage_error(train_usage, "%s '%s': a %s number", flag, v,
                                                                           allow_zero ? "non-negative" : "positive");
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

int cmd_train(int argc, char **argv) {
    train_options o;
    train_defaults(&o);
    const char *v;
    int saw_epochs = 0, saw_iters = 0, saw_precision = 0;
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) show_help(train_help);
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
        else if ((v = flag_value(argc, argv, &i, "--grad-accum", train_usage))) o.grad_accum = parse_int_flag("--grad-accum", v, 1, 1 << 20);
        else if ((v = flag_value(argc, argv, &i, "--lr", train_usage))) o.lr = parse_positive("--lr", v, 1);
        else if ((v = flag_value(argc, argv, &i, "--weight-decay", train_usage))) o.weight_decay = parse_positive("--weight-decay", v, 1);
        else if ((v = flag_value(argc, argv, &i, "--optimizer", train_usage))) {
            if (strcmp(v, "adam") == 0) o.adamw = 0;
            else if (strcmp(v, "adamw") == 0) o.adamw = 1;
            else usage_error(train_usage, "--optimizer '%s': adam or adamw", v);
        } else if (strcmp(argv[i], "--bias-correction") == 0) o.bias_correction = 1;
        else if ((v = flag_value(argc, argv, &i, "--lora-rank", train_usage))) o.lora.rank = parse_int_flag("--lora-rank", v, 1, 4096);
        else if ((v = flag_value(argc, argv, &i, "--lora-scale", train_usage))) o.lora.scale = parse_positive("--lora-scale", v, 0);
        else if ((v = flag_value(argc, argv, &i, "--lora-keys", train_usage))) o.lora.proj_mask = parse_keys(v);
        else if ((v = flag_value(argc, argv, &i, "--lora-layers", train_usage))) o.lora.num_layers = parse_int_flag("--lora-layers", v, 1, GEMMA_MAX_LAYERS);
        else if ((v = flag_value(argc, argv, &i, "--seed", train_usage))) o.seed = (uint64_t)parse_int_flag("--seed", v, 0, INT32_MAX);
        else if ((v = flag_value(argc, argv, &i, "--adapters", train_usage))) o.adapters_path = v;
        else if ((v = flag_value(argc, argv, &i, "--resume", train_usage))) o.resume_dir = v;
        else if ((v = flag_value(argc, argv, &i, "--out", train_usage))) o.out_dir = v;
        else if ((v = flag_value(argc, argv, &i, "--log", train_usage))) o.log_path = v;
        else if ((v = flag_value(argc, argv, &i, "--adapter-format", train_usage))) {
            if (strcmp(v, "mlx") == 0) o.format = ADAPTERS_MLX;
            else if (strcmp(v, "peft") == 0) o.format = ADAPTERS_PEFT;
            else usage_error(train_usage, "--adapter-format '%s': mlx or peft", v);
        }
        else if (strcmp(argv[i], "--eval") == 0) o.eval_at_end = 1;
        else if ((v = flag_value(argc, argv, &i, "--eval-every", train_usage))) o.eval_every = parse_int_flag("--eval-every", v, 1, 1 << 30);
        else if (strcmp(argv[i], "--eval-only") == 0) o.eval_only = 1;
        else if ((v = flag_value(argc, argv, &i, "--max-seq-length", train_usage))) o.max_len = parse_int_flag("--max-seq-length", v, 2, 1 << 30);
        else if (strcmp(argv[i], "--pad-target") == 0) o.pad_target = 1;
        else if ((v = flag_value(argc, argv, &i, "--threads", train_usage))) o.threads = parse_int_flag("--threads", v, 1, 1024);
        else if ((v = flag_value(argc, argv, &i, "--device", train_usage))) {
            if (strcmp(v, "cpu") == 0) o.device = WA_DEVICE_CPU;
            else if (strcmp(v, "cuda") == 0) o.device = WA_DEVICE_CUDA;
            else usage_error(train_usage, "--device '%s': cpu or cuda", v);
        } else if ((v = flag_value(argc, argv, &i, "--precision", train_usage))) {
            if (strcmp(v, "bf16") == 0) o.precision = PRECISION_BF16;
            else if (strcmp(v, "f32") == 0) o.precision = PRECISION_F32;
            else usage_error(train_usage, "--precision '%s': bf16 or f32", v);
            saw_precision = 1;
        } else if ((v = flag_value(argc, argv, &i, "--init-random", train_usage))) {
            o.random_init = 1;
            o.init_seed = (uint64_t)parse_int_flag("--init-random", v, 0, INT32_MAX);
        } else unknown_option(argv[i]);
    }
    if (!o.model_dir) usage_error(train_usage, "--model DIR is required");
    if (!o.data_dir) usage_error(train_usage, "--data DIR is required");
    if (saw_epochs && saw_iters) usage_error(train_usage, "--epochs and --iters exclude each other");
    if (o.resume_dir && o.adapters_path) usage_error(train_usage, "--resume and --adapters exclude each other");
    if (o.device != WA_DEVICE_CUDA && (saw_precision || o.random_init))
        usage_error(train_usage, "--precision and --init-random apply to --device cuda");
    if (o.device == WA_DEVICE_CUDA && o.arm != ATTN_FUSED)
        usage_error(train_usage, "--device cuda runs attention through winattn only (--attn fused)");
    if (!is_dir(o.model_dir)) die("--model %s: not a directory", o.model_dir);
    if (!is_dir(o.data_dir)) die("--data %s: not a directory", o.data_dir);
    char err[1024];
    if (train_run(&o, err, sizeof err) != 0) die("%s", err);
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
