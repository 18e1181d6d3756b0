/* winattn.c — the command: `winattn <attn|probe|parity|bench|train|init-model> ...`. Each subcommand lives in its own
 * file (cmd_*.c); this one only dispatches. */
#define _GNU_SOURCE
#include "tool.h"

#include <stdio.h>
#include <string.h>

static const char usage[] =
    "usage: winattn <command> [options]\n"
    "\n"
    "commands:\n"
    "  attn IN.safetensors OUT.safetensors [--window-left L] [--window-right R] [--causal]\n"
    "       [--sliding-window W] [--scale S] [--softcap C] [--layout bhnd|bnhd] [--device cpu|cuda]\n"
    "       [--threads T]    attention forward (and backward when IN holds `do`)\n"
    "  probe [--quick] [--json F] [--threads T]\n"
    "                        backward memory and time, tiled vs dense, measured by the OS\n"
    "  parity [--quick] [--device cpu|cuda] [--json F] [--threads T] [--verbose]\n"
    "                        gradient parity sweep against the float64 oracle\n"
    "  bench [--n N,...] [--dtype D] [--hq H --hkv H --d D] [--sliding-window W|--causal|--full]\n"
    "        [--threads T] [--tile-q Q --tile-k K] [--reps R] [--algo tiled|dense] [--device cpu|cuda] [--json F]\n"
    "                        time forward and backward, TFLOP/s on visible pairs\n"
    "  train --model DIR --data DIR [--attn fused|dense|chunked] [--epochs E|--iters N] [--eval] [--out DIR] ...\n"
    "                        LoRA fine-tuning of a Gemma 4/3 checkpoint through winattn (winattn train --help)\n"
    "  init-model CONFIG.json OUT_DIR [--seed S] [--dtype bf16|f32]\n"
    "                        a seeded random checkpoint for a config (demos, tests)\n"
    "  version               print the library version and the CPU kernels in use\n"
    "\n"
    "README.md has the full reference.\n";

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    tool_cmd = cmd;
    platform_argv0 = argv[0];
    if (strcmp(cmd, "attn") == 0) return cmd_attn(argc - 1, argv + 1);
    if (strcmp(cmd, "probe") == 0) return cmd_probe(argc - 1, argv + 1);
    if (strcmp(cmd, "probe-child") == 0) return cmd_probe_child(argc - 1, argv + 1);
    if (strcmp(cmd, "parity") == 0) return cmd_parity(argc - 1, argv + 1);
    if (strcmp(cmd, "bench") == 0) return cmd_bench(argc - 1, argv + 1);
    if (strcmp(cmd, "train") == 0) return cmd_train(argc - 1, argv + 1);
    if (strcmp(cmd, "init-model") == 0) return cmd_init_model(argc - 1, argv + 1);
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        printf("winattn %s (CPU kernels: %s, CUDA: %s)\n", wa_version(), wa_cpu_kernels(),
               wa_device_available(WA_DEVICE_CUDA) ? "available" : "not available");
        return 0;
    }
    tool_cmd = "";
    fprintf(stderr, "winattn: unknown command '%s' (try: winattn --help)\n", cmd);
    return 2;
}
