/* platform.h — the project's only operating-system-specific code outside the library: what the
 * command and the trainer ask the system about this process (time, resident memory) and how the
 * command's probe starts itself again as a child. Below tools/ and train/; includes nothing of
 * the project.
 *
 * Linux reads /proc; every other POSIX system (macOS, the BSDs; Linux too when built with
 * -DWA_PLATFORM_GENERIC, which is how the other branch gets compiled and tested here) uses
 * getrusage, sysconf and wait4. docs/portability.md says what each answer means where.
 */
#ifndef WINATTN_FORMATS_PLATFORM_H
#define WINATTN_FORMATS_PLATFORM_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Seconds on the monotonic clock. */
double now_seconds(void);

extern const char *platform_argv0; /* argv[0] of main(), for spawn_self off Linux */
/* Peak resident set of this process in bytes (Linux: VmHWM; elsewhere ru_maxrss); 0 if unknown. */
size_t peak_rss_bytes(void);
/* Resident set now in bytes (Linux: VmRSS); 0 if unknown (always, off Linux). */
size_t current_rss_bytes(void);
/* Memory a new allocation can get, in bytes (Linux: MemAvailable; elsewhere the physical memory,
 * an upper bound); 0 if unknown. */
size_t mem_available_bytes(void);
/* Start this program again as a child running argv (argv[0] is the name it sees, argv ends with
 * NULL) with its stdout on out_fd (Linux: /proc/self/exe; elsewhere platform_argv0, searched in
 * PATH when it has no '/'). The child's pid, or -1 with errno set. */
pid_t spawn_self(char *const argv[], int out_fd);
/* Wait for the child pid: *status as waitpid gives it, *peak_bytes its peak resident set
 * (wait4's ru_maxrss). 0, or -1 with errno set. */
int wait_child(pid_t pid, int *status, size_t *peak_bytes);

#ifdef __cplusplus
}
#endif

#endif
