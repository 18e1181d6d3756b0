/* platform.c — see platform.h. */
#define _GNU_SOURCE
#include "platform.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *platform_argv0;

/* getrusage's ru_maxrss is in bytes on macOS, in kilobytes on Linux and the BSDs */
#if defined(__APPLE__)
#define RU_MAXRSS_UNIT 1
#else
#define RU_MAXRSS_UNIT 1024
#endif

#if defined(__linux__) && !defined(WA_PLATFORM_GENERIC)
static size_t proc_field_kb(const char *file, const char *field) {
    FILE *f = fopen(file, "r");
    if (!f) return 0;
    char line[256];
    size_t n = strlen(field), kb = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':') {
            kb = (size_t)strtoull(line + n + 1, NULL, 10);
            break;
        }
    fclose(f);
    return kb;
}

size_t peak_rss_bytes(void) { return proc_field_kb("/proc/self/status", "VmHWM") * 1024; }
size_t current_rss_bytes(void) { return proc_field_kb("/proc/self/status", "VmRSS") * 1024; }
size_t mem_available_bytes(void) { return proc_field_kb("/proc/meminfo", "MemAvailable") * 1024; }
static void exec_self(char *const argv[]) { execv("/proc/self/exe", argv); }
#else
size_t peak_rss_bytes(void) {
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (size_t)ru.ru_maxrss * RU_MAXRSS_UNIT : 0;
}
size_t current_rss_bytes(void) { return 0; }
size_t mem_available_bytes(void) {
#if defined(_SC_PHYS_PAGES)
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) return (size_t)pages * (size_t)page;
#endif
    return 0;
}
static void exec_self(char *const argv[]) {
    if (!platform_argv0) {
        errno = ENOENT;
        return;
    }
    if (strchr(platform_argv0, '/')) execv(platform_argv0, argv);
    else execvp(platform_argv0, argv);
}
#endif

pid_t spawn_self(char *const argv[], int out_fd) {
    pid_t pid = fork();
    if (pid != 0) return pid; /* the parent, or -1 */
    if (out_fd != 1) {
        if (dup2(out_fd, 1) < 0) _exit(127);
        close(out_fd);
    }
    exec_self(argv);
    _exit(127);
}

int wait_child(pid_t pid, int *status, size_t *peak_bytes) {
    struct rusage ru;
    pid_t got;
    do got = wait4(pid, status, 0, &ru);
    while (got < 0 && errno == EINTR);
    if (got < 0) return -1;
    *peak_bytes = (size_t)ru.ru_maxrss * RU_MAXRSS_UNIT;
    return 0;
}

