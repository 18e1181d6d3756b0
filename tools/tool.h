/* tool.h — what the winattn subcommands share. Tools may exit (the library never does): every
 * exit on error prints one line "winattn <cmd>: <problem>" to stderr and returns status 1 (2 for
 * usage errors). */
#ifndef WA_TOOL_H
#define WA_TOOL_H

#include "winattn.h"
#include "atomic_file.h" /* formats/: out_open and friends, write_text_atomic */
#include "platform.h"    /* formats/: now_seconds, peak_rss_bytes, spawn_self, ... */

#include <stddef.h>
#include <stdint.h>

extern const char *tool_cmd; /* "attn", "probe", ... for messages */

_Noreturn void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
_Noreturn void usage_error(const char *usage, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* What every subcommand does with an argument (tests/test_cli.sh checks each): `--help` or `-h`
 * prints the subcommand's help on stdout and exits 0 (is_help, show_help); an option it does not
 * know, or a stray operand, exits 2 with one line on stderr, worded the same everywhere:
 *   winattn SUB: unknown option '--x' (winattn SUB --help lists the options)
 *   winattn SUB: unexpected argument 'x' (winattn SUB --help lists the options) */
int is_help(const char *arg);
_Noreturn void show_help(const char *text);
_Noreturn void unknown_option(const char *arg);

/* Strict parsers: the whole string must be a number in range. 0 on success, -1 otherwise. */
int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
int parse_f32(const char *s, float *out);

/* Flag matching for "--name value" and "--name=value". Returns the value (advancing *i) when
 * argv[*i] is the flag, NULL when it is a different argument; dies if the value is missing. */
const char *flag_value(int argc, char **argv, int *i, const char *name, const char *usage);

/* malloc that dies with a message naming what it was for. */
void *xmalloc(size_t bytes, const char *what);
const char *dtype_name(wa_dtype dt);
/* n elements uniform in [-2, 2), rounded to the dtype: fast inputs for timing and memory runs
 * (the correctness cases use src/ref/case.h's normal draws) */
void fill_uniform(void *data, wa_dtype dt, size_t n, uint64_t seed);

/* write_text_atomic (formats/atomic_file.h) that dies on failure. */
void write_file_atomic(const char *path, const char *text);

int cmd_attn(int argc, char **argv);
int cmd_probe(int argc, char **argv);
int cmd_probe_child(int argc, char **argv);
int cmd_parity(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_init_model(int argc, char **argv);

#endif
