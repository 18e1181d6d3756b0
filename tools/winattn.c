/* winattn.c — the command: `winattn <attn|probe|parity|bench|train|init-model|version|help> ...`.
 * Each subcommand lives in its own file (cmd_*.c); this one only dispatches. Every subcommand
 * takes --help (tool.h: is_help, show_help, unknown_option). */
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
    "  help [COMMAND]        this list, or COMMAND's options (as winattn COMMAND --help)\n"
    "\n"
    "winattn COMMAND --help lists a command's options; README.md has the full reference.\n";

static const char version_help[] =
    "usage: winattn version\n"
    "\n"
    "Prints the library's version, the CPU kernels this machine runs and whether CUDA is usable.\n";

typedef int (*command_fn)(int argc, char **argv);

static int cmd_version(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) show_help(version_help);
        unknown_option(argv[i]);
    }
    printf("winattn %s (CPU kernels: %s, CUDA: %s)\n", wa_version(), wa_cpu_kernels(),
           wa_device_available(WA_DEVICE_CUDA) ? "available" : "not available");
    return 0;
}

/* probe-child is probe's own: started by winattn probe, listed nowhere */
static const struct {
    const char *name;
    command_fn fn;
} commands[] = {
    {"attn", cmd_attn},     {"probe", cmd_probe},           {"probe-child", cmd_probe_child},
    {"parity", cmd_parity}, {"bench", cmd_bench},           {"train", cmd_train},
    {"init-model", cmd_init_model}, {"version", cmd_version}, {"--version", cmd_version},
};

static command_fn find(const char *name) {
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(commands[i].name, name) == 0) return commands[i].fn;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2 || is_help(argv[1]) || (strcmp(argv[1], "help") == 0 && argc == 2)) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    platform_argv0 = argv[0];
    /* Ctrl-C or a kill while an output file is being written leaves no temporary beside it */
    out_cleanup_on_signals();
    if (strcmp(argv[1], "help") == 0) { /* winattn help COMMAND: COMMAND's --help */
        command_fn fn = find(argv[2]);
        if (!fn || argc > 3) {
            fprintf(stderr, "winattn help: %s '%s' (winattn --help lists the commands)\n",
                    fn ? "unexpected argument" : "unknown command", fn ? argv[3] : argv[2]);
            return 2;
        }
        static char help_flag[] = "--help";
        char *help_argv[] = {argv[2], help_flag, NULL};
        tool_cmd = argv[2];
        return fn(2, help_argv);
    }
    command_fn fn = find(argv[1]);
    if (!fn) {
        fprintf(stderr, "winattn: unknown command '%s' (winattn --help lists the commands)\n", argv[1]);
        return 2;
    }
    tool_cmd = strcmp(argv[1], "--version") == 0 ? "version" : argv[1];
    return fn(argc - 1, argv + 1);
}
