/* tool.c — helpers shared by the winattn subcommands (see tool.h). */
#define _GNU_SOURCE
#include "tool.h"
#include "convert.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *tool_cmd = "";

void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "winattn%s%s: ", tool_cmd[0] ? " " : "", tool_cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

void usage_error(const char *usage, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "winattn%s%s: ", tool_cmd[0] ? " " : "", tool_cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (usage: %s)\n", usage);
    va_end(ap);
    exit(2);
}

int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int parse_f32(const char *s, float *out) {
    if (!s || !*s) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v) || fabs(v) > 3.0e38) return -1;
    *out = (float)v;
    return 0;
}

const char *flag_value(int argc, char **argv, int *i, const char *name, const char *usage) {
    size_t n = strlen(name);
    const char *a = argv[*i];
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 >= argc) usage_error(usage, "%s needs a value", name);
    return argv[++*i];
}

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- platform (tool.h) ---- */

const char *tool_argv0;

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
    if (!tool_argv0) {
        errno = ENOENT;
        return;
    }
    if (strchr(tool_argv0, '/')) execv(tool_argv0, argv);
    else execvp(tool_argv0, argv);
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

void *xmalloc(size_t bytes, const char *what) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        die("out of memory allocating %zu bytes for %s", bytes, what);
    return p;
}

const char *dtype_name(wa_dtype dt) {
    static const char *const names[3] = {"f32", "f16", "bf16"};
    return (unsigned)dt < 3 ? names[dt] : "?";
}

void fill_uniform(void *data, wa_dtype dt, size_t n, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 7;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float x = (float)((double)(s >> 11) * (1.0 / 9007199254740992.0) * 4.0 - 2.0);
        if (dt == WA_F32) ((float *)data)[i] = x;
        else if (dt == WA_BF16) ((uint16_t *)data)[i] = wa_f32_to_bf16(x);
        else ((uint16_t *)data)[i] = wa_f32_to_f16(x);
    }
}

/* ---- output files (tool.h) ---- */

static void out_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void out_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* path with every symlink in its last component followed (relative targets are relative to the
 * link's directory); a malloc'ed string, or NULL with errno set (ELOOP after 40 links, as the
 * kernel counts). The target need not exist. */
static char *follow_links(const char *path) {
    char *cur = strdup(path);
    for (int hops = 0; cur; hops++) {
        struct stat sb;
        if (lstat(cur, &sb) != 0 || !S_ISLNK(sb.st_mode)) return cur; /* missing or not a link: done */
        if (hops == 40) {
            free(cur);
            errno = ELOOP;
            return NULL;
        }
        size_t cap = sb.st_size > 0 ? (size_t)sb.st_size + 1 : 4096;
        char *link = malloc(cap);
        ssize_t n = link ? readlink(cur, link, cap) : -1;
        if (n < 0 || (size_t)n >= cap) { /* the link changed under us, or out of memory */
            int e = !link ? ENOMEM : n < 0 ? errno : EAGAIN;
            free(link), free(cur);
            errno = e;
            return NULL;
        }
        link[n] = '\0';
        const char *slash = strrchr(cur, '/');
        if (link[0] == '/' || !slash) {
            free(cur);
            cur = link;
        } else {
            size_t dir = (size_t)(slash - cur) + 1;
            char *next = malloc(dir + (size_t)n + 1);
            if (next) memcpy(next, cur, dir), memcpy(next + dir, link, (size_t)n + 1);
            free(link), free(cur);
            cur = next;
        }
    }
    errno = ENOMEM;
    return NULL;
}

int out_open(out_file *of, const char *path, char *err, size_t errlen) {
    memset(of, 0, sizeof *of);
    of->fd = -1;
    of->path = path;
    if (!path || !path[0]) {
        out_err(err, errlen, "empty output path");
        return -1;
    }
    of->target = follow_links(path);
    if (!of->target) {
        out_err(err, errlen, "cannot resolve %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    int exists = stat(of->target, &sb) == 0;
    if (!exists && errno != ENOENT) {
        out_err(err, errlen, "cannot write %s: %s", path, strerror(errno));
        goto fail;
    }
    if (exists && S_ISDIR(sb.st_mode)) {
        out_err(err, errlen, "%s is a directory", path);
        goto fail;
    }
    if (exists && !S_ISREG(sb.st_mode)) {
        /* a device, FIFO or socket: no temporary can stand in for it. Opening a FIFO waits for
         * its reader, as a shell redirection does. */
        of->fd = open(of->target, O_WRONLY | O_NOCTTY | O_CLOEXEC);
        if (of->fd < 0) {
            out_err(err, errlen, "cannot open %s: %s", path, strerror(errno));
            goto fail;
        }
        return 0;
    }
    /* The name is unique per process and attempt; O_EXCL guards against anything left over. */
    size_t n = strlen(of->target) + 64;
    of->tmp = malloc(n);
    if (!of->tmp) {
        out_err(err, errlen, "out of memory");
        goto fail;
    }
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) ts.tv_nsec = 0; /* only a uniqueness hint */
    for (long attempt = 0; attempt < 100; attempt++) {
        snprintf(of->tmp, n, "%s.tmp.%ld.%ld", of->target, (long)getpid(), (long)ts.tv_nsec + attempt);
        of->fd = open(of->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (of->fd >= 0 || errno != EEXIST) break;
    }
    if (of->fd < 0) {
        out_err(err, errlen, "cannot create a temporary file for %s: %s", path, strerror(errno));
        free(of->tmp), of->tmp = NULL; /* nothing was created */
        goto fail;
    }
    /* a replaced file keeps its permission bits (a private 0600 file stays private) */
    if (exists && fchmod(of->fd, sb.st_mode & 0777) != 0) {
        out_err(err, errlen, "cannot set the permissions of %s: %s", path, strerror(errno));
        goto fail;
    }
    return 0;
fail:
    out_abort(of);
    return -1;
}

/* Chunks stay under 1 GiB because some kernels cap a single write. */
int out_write(out_file *of, const void *buf, size_t len) {
    const unsigned char *p = buf;
    while (len > 0) {
        size_t chunk = len > (1u << 30) ? (size_t)1 << 30 : len;
        ssize_t n = write(of->fd, p, chunk);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (n == 0) { /* no progress and no error: do not spin */
            errno = EIO;
            return -1;
        }
        p += n, len -= (size_t)n;
    }
    return 0;
}

int out_commit(out_file *of, char *err, size_t errlen) {
    /* fsync before rename: otherwise a crash could leave the path naming a file whose blocks were
     * never written, the half-written file the rename is meant to prevent. Devices and pipes
     * have nothing to sync (fsync fails there with EINVAL). */
    if (of->tmp && fsync(of->fd) != 0) {
        out_err(err, errlen, "cannot flush %s: %s", of->path, strerror(errno));
        goto fail;
    }
    int fd = of->fd;
    of->fd = -1;
    if (close(fd) != 0) {
        out_err(err, errlen, "cannot close %s: %s", of->path, strerror(errno));
        goto fail;
    }
    if (of->tmp && rename(of->tmp, of->target) != 0) {
        out_err(err, errlen, "cannot rename the temporary file to %s: %s", of->path, strerror(errno));
        goto fail;
    }
    free(of->tmp), of->tmp = NULL;
    free(of->target), of->target = NULL;
    return 0;
fail:
    out_abort(of);
    return -1;
}

void out_abort(out_file *of) {
    if (of->fd >= 0) (void)close(of->fd); /* already failing; the first error is the one reported */
    of->fd = -1;
    if (of->tmp) (void)unlink(of->tmp);
    free(of->tmp), of->tmp = NULL;
    free(of->target), of->target = NULL;
}

void write_file_atomic(const char *path, const char *text) {
    char err[1024];
    out_file of;
    if (out_open(&of, path, err, sizeof err) != 0) die("%s", err);
    if (out_write(&of, text, strlen(text)) != 0) {
        int e = errno;
        out_abort(&of);
        die("cannot write %s: %s", path, strerror(e));
    }
    if (out_commit(&of, err, sizeof err) != 0) die("%s", err);
}
