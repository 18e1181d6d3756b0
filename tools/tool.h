/* tool.h — what the winattn subcommands share. Tools may exit (the library never does): every
 * exit on error prints one line "winattn <cmd>: <problem>" to stderr and returns status 1 (2 for
 * usage errors). */
#ifndef WA_TOOL_H
#define WA_TOOL_H

#include "winattn.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

extern const char *tool_cmd; /* "attn", "probe", ... for messages */

_Noreturn void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
_Noreturn void usage_error(const char *usage, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Strict parsers: the whole string must be a number in range. 0 on success, -1 otherwise. */
int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
int parse_f32(const char *s, float *out);

/* Flag matching for "--name value" and "--name=value". Returns the value (advancing *i) when
 * argv[*i] is the flag, NULL when it is a different argument; dies if the value is missing. */
const char *flag_value(int argc, char **argv, int *i, const char *name, const char *usage);

double now_seconds(void);

/* ---- platform: the command's only operating-system-specific code (tool.c) ----
 * Linux reads /proc; every other POSIX system (macOS, the BSDs; Linux too when built with
 * -DWA_PLATFORM_GENERIC, which is how the other branch gets compiled and tested here) uses
 * getrusage, sysconf and wait4. docs/portability.md says what each answer means where. */
extern const char *tool_argv0; /* argv[0] of main(), for spawn_self off Linux */
/* Peak resident set of this process in bytes (Linux: VmHWM; elsewhere ru_maxrss); 0 if unknown. */
size_t peak_rss_bytes(void);
/* Resident set now in bytes (Linux: VmRSS); 0 if unknown (always, off Linux). */
size_t current_rss_bytes(void);
/* Memory a new allocation can get, in bytes (Linux: MemAvailable; elsewhere the physical memory,
 * an upper bound); 0 if unknown. */
size_t mem_available_bytes(void);
/* Start this program again as a child running argv (argv[0] is the name it sees, argv ends with
 * NULL) with its stdout on out_fd (Linux: /proc/self/exe; elsewhere tool_argv0, searched in
 * PATH when it has no '/'). The child's pid, or -1 with errno set. */
pid_t spawn_self(char *const argv[], int out_fd);
/* Wait for the child pid: *status as waitpid gives it, *peak_bytes its peak resident set
 * (wait4's ru_maxrss). 0, or -1 with errno set. */
int wait_child(pid_t pid, int *status, size_t *peak_bytes);

/* malloc that dies with a message naming what it was for. */
void *xmalloc(size_t bytes, const char *what);
const char *dtype_name(wa_dtype dt);
/* n elements uniform in [-2, 2), rounded to the dtype: fast inputs for timing and memory runs
 * (the correctness cases use src/ref/case.h's normal draws) */
void fill_uniform(void *data, wa_dtype dt, size_t n, uint64_t seed);

/* Output files: the one place that decides how a path is written (st_write and
 * write_file_atomic both go through it). What the path names is followed, never clobbered:
 *   - a regular file or nothing: the bytes go to a temporary beside it (O_EXCL), which
 *     out_commit fsyncs and renames over it, keeping the old file's permission bits; a failure
 *     leaves the old file (or no file) and no temporary;
 *   - a symlink (or a chain of them): the same for its final target, with the temporary beside
 *     the target so the rename stays on one filesystem; the link stays a link. A dangling link
 *     gets its target created the same way, as a shell's `>` would do;
 *   - a character or block device, FIFO or other non-regular file: opened and written directly,
 *     so /dev/null and pipes work (and nothing can be undone there on failure);
 *   - a directory: refused ("PATH is a directory").
 * Nothing here prints or exits: failures return -1 with a one-line message in err. */
typedef struct out_file {
    int fd;        /* where to write(); -1 once closed */
    char *target;  /* the path renamed onto (path with its symlinks followed) */
    char *tmp;     /* the temporary; NULL when writing directly */
    const char *path; /* as given, for messages */
} out_file;
int out_open(out_file *of, const char *path, char *err, size_t errlen);
/* write(2) until done (retrying short writes and EINTR); -1 with errno set on error */
int out_write(out_file *of, const void *buf, size_t len);
/* fsync, close, rename into place; on failure everything out_abort does has been done */
int out_commit(out_file *of, char *err, size_t errlen);
/* close and remove the temporary (safe after a failed out_open or a commit) */
void out_abort(out_file *of);

/* Write text to path through out_open (temporary + rename for a file); dies on failure. */
void write_file_atomic(const char *path, const char *text);

int cmd_attn(int argc, char **argv);
int cmd_probe(int argc, char **argv);
int cmd_probe_child(int argc, char **argv);
int cmd_parity(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_init_model(int argc, char **argv);

#endif
