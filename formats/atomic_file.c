/* atomic_file.c — output files written whole or not at all (see atomic_file.h). */
#define _GNU_SOURCE
#include "atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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

/* ---- temporaries a signal must not leave behind ----
 * out_open registers each temporary here and out_commit / out_abort take it out; on SIGINT or
 * SIGTERM, out_remove_temporaries() (async-signal-safe: it only reads these slots and calls
 * unlink) removes whatever is still registered. A slot's path is copied in before the slot is
 * marked live, and unmarked before it is reused, so the handler never reads a half-written
 * path. Beyond OUT_SLOTS open temporaries (the command holds one at a time, the trainer a few)
 * the rest are not covered. */
#define OUT_SLOTS 16
#define OUT_SLOT_PATH 4096
static char slot_path[OUT_SLOTS][OUT_SLOT_PATH];
static volatile sig_atomic_t slot_live[OUT_SLOTS];

static int slot_take(const char *tmp) {
    if (strlen(tmp) >= OUT_SLOT_PATH) return -1;
    for (int i = 0; i < OUT_SLOTS; i++) {
        sig_atomic_t free_slot = 0;
        /* 0 -> 2: claimed by this thread, path not yet in; 1 once the path is complete */
        if (__atomic_compare_exchange_n(&slot_live[i], &free_slot, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            memcpy(slot_path[i], tmp, strlen(tmp) + 1);
            __atomic_store_n(&slot_live[i], 1, __ATOMIC_RELEASE);
            return i;
        }
    }
    return -1;
}

static void slot_release(int i) {
    if (i >= 0 && i < OUT_SLOTS) __atomic_store_n(&slot_live[i], 0, __ATOMIC_RELEASE);
}

void out_remove_temporaries(void) {
    for (int i = 0; i < OUT_SLOTS; i++)
        if (__atomic_load_n(&slot_live[i], __ATOMIC_ACQUIRE) == 1) (void)unlink(slot_path[i]);
}

static void remove_and_reraise(int sig) {
    out_remove_temporaries();
    signal(sig, SIG_DFL);
    raise(sig);
}

void out_cleanup_on_signals(void) {
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction old;
        /* a signal the process was started with ignored (nohup) stays ignored */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN) continue;
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = remove_and_reraise;
        sigemptyset(&sa.sa_mask);
        sigaction(sigs[i], &sa, NULL);
    }
}

/* ---- descriptors named by path ----
 * /dev/stdout, /dev/stderr, /dev/fd/N and /proc/self/fd/N (and /proc/PID/fd/N for this process)
 * name a descriptor this process already holds: the shell's pipe, or a file it opened with > or
 * >>. Writing through that descriptor is what the shell promised; opening the path anew would
 * replace a >>'d file through a rename, fail on a pipe, or write to a new file beside a deleted
 * one. Returns the descriptor number, or -1 when path names none of these. */
static int named_descriptor(const char *path) {
    const char *num = NULL;
    char self[64];
    if (strcmp(path, "/dev/stdout") == 0) return 1;
    if (strcmp(path, "/dev/stderr") == 0) return 2;
    if (strncmp(path, "/dev/fd/", 8) == 0) num = path + 8;
    else if (strncmp(path, "/proc/self/fd/", 14) == 0) num = path + 14;
    else {
        int n = snprintf(self, sizeof self, "/proc/%ld/fd/", (long)getpid());
        if (n > 0 && strncmp(path, self, (size_t)n) == 0) num = path + n;
    }
    if (!num || !*num) return -1;
    long fd = 0;
    for (const char *c = num; *c; c++) {
        if (*c < '0' || *c > '9' || fd > 1 << 20) return -1;
        fd = fd * 10 + (*c - '0');
    }
    return (int)fd;
}

int out_open(out_file *of, const char *path, char *err, size_t errlen) {
    memset(of, 0, sizeof *of);
    of->fd = -1;
    of->path = path;
    of->slot = -1;
    if (!path || !path[0]) {
        out_err(err, errlen, "empty output path");
        return -1;
    }
    int named = named_descriptor(path);
    if (named >= 0) {
        of->fd = fcntl(named, F_DUPFD_CLOEXEC, 3);
        if (of->fd < 0) {
            out_err(err, errlen, "cannot write %s: descriptor %d is not open", path, named);
            return -1;
        }
        int mode = fcntl(of->fd, F_GETFL);
        if (mode < 0 || (mode & O_ACCMODE) == O_RDONLY) {
            out_err(err, errlen, "cannot write %s: descriptor %d is not open for writing", path, named);
            out_abort(of);
            return -1;
        }
        return 0;
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
    of->slot = slot_take(of->tmp);
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
    slot_release(of->slot), of->slot = -1;
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
    slot_release(of->slot), of->slot = -1;
    free(of->tmp), of->tmp = NULL;
    free(of->target), of->target = NULL;
}

int write_text_atomic(const char *path, const char *text, char *err, size_t errlen) {
    out_file of;
    if (out_open(&of, path, err, errlen) != 0) return -1;
    if (out_write(&of, text, strlen(text)) != 0) {
        int e = errno;
        out_abort(&of);
        out_err(err, errlen, "cannot write %s: %s", path, strerror(e));
        return -1;
    }
    return out_commit(&of, err, errlen);
}
