/* test_atomic_file.c — formats/atomic_file.c where a path is not a plain file: paths that name a
 * descriptor the process holds (/dev/stdout under `>>` and `|`, /dev/fd/N, /proc/self/fd/N, a
 * deleted file behind stdout), and SIGINT / SIGTERM while a temporary exists. Each case runs in a
 * child so that its descriptors and signals stay its own. */
#define _GNU_SOURCE
#include "atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int passed, failed;

static void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s ", ok ? "PASS" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    ok ? passed++ : failed++;
}

/* text for a one-line report: newlines as \n */
static const char *shown(const char *text) {
    static char buf[4][256];
    static int next;
    char *out = buf[next++ % 4];
    size_t n = 0;
    for (const char *c = text ? text : "(missing)"; *c && n < sizeof buf[0] - 3; c++)
        if (*c == '\n') out[n++] = '\\', out[n++] = 'n';
        else out[n++] = *c;
    out[n] = '\0';
    return out;
}

static char dir[] = "/tmp/test_atomic_file.XXXXXX";

static char *slurp(const char *path) {
    static char buf[4096];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = '\0';
    return f ? buf : NULL;
}

static int count_entries(void) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += e->d_name[0] != '.';
    if (d) closedir(d);
    return n;
}

/* Runs fn in a child with stdout on fd (when fd >= 0); the child's exit status or -signal. */
static int in_child(int (*fn)(void *), void *arg, int fd) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        if (fd >= 0) dup2(fd, 1);
        alarm(10);
        _exit(fn(arg));
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

static int write_path(void *path) {
    char err[256];
    return write_text_atomic(path, "world\n", err, sizeof err) == 0 ? 0 : 1;
}

static void test_stdout_append(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/appended.txt", dir);
    FILE *f = fopen(path, "w");
    fputs("hello\n", f);
    fclose(f);
    int fd = open(path, O_WRONLY | O_APPEND);
    int rc = in_child(write_path, "/dev/stdout", fd);
    close(fd);
    const char *got = slurp(path);
    check(rc == 0 && got && strcmp(got, "hello\nworld\n") == 0, "/dev/stdout under >>: appended, earlier content kept (\"%s\")",
          shown(got));
    unlink(path);
}

static void test_pipe(const char *name_fmt) {
    int p[2];
    if (pipe(p) != 0) return check(0, "pipe");
    char path[64];
    snprintf(path, sizeof path, name_fmt, p[1]);
    int rc = in_child(write_path, path, -1);
    close(p[1]);
    char buf[64] = "";
    ssize_t n = read(p[0], buf, sizeof buf - 1);
    close(p[0]);
    buf[n > 0 ? n : 0] = '\0';
    check(rc == 0 && strcmp(buf, "world\n") == 0, "%s (a pipe): written through the descriptor (\"%s\")", path, shown(buf));
}

static void test_stdout_pipe(void) {
    int p[2];
    if (pipe(p) != 0) return check(0, "pipe");
    int rc = in_child(write_path, "/dev/stdout", p[1]);
    close(p[1]);
    char buf[64] = "";
    ssize_t n = read(p[0], buf, sizeof buf - 1);
    close(p[0]);
    buf[n > 0 ? n : 0] = '\0';
    check(rc == 0 && strcmp(buf, "world\n") == 0, "/dev/stdout into a pipe (| wc -c): \"%s\"", shown(buf));
}

static void test_closed_descriptor(void) {
    char err[256] = "", path[64];
    int fd = open("/dev/null", O_RDONLY);
    close(fd); /* fd is now a number nothing holds */
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rc = write_text_atomic(path, "x", err, sizeof err);
    check(rc != 0 && strstr(err, "is not open"), "%s, a closed descriptor: \"%s\"", path, err);
    snprintf(path, sizeof path, "/dev/fd/%d", 0);
    int saved = dup(0), ro = open("/dev/null", O_RDONLY);
    dup2(ro, 0);
    rc = write_text_atomic(path, "x", err, sizeof err);
    dup2(saved, 0);
    close(saved), close(ro);
    check(rc != 0 && strstr(err, "not open for writing"), "/dev/fd/0 open read-only: \"%s\"", err);
}

static void test_deleted_stdout(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/deleted.txt", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    unlink(path);
    int before = count_entries();
    int rc = in_child(write_path, "/dev/stdout", fd);
    struct stat sb;
    fstat(fd, &sb);
    close(fd);
    check(rc == 0 && count_entries() == before && sb.st_size == 6,
          "/dev/stdout on a deleted file: written there (%lld bytes), no new file beside it", (long long)sb.st_size);
}

/* opens a temporary for path, then receives the signal */
static int signal_while_open(void *arg) {
    const int *sig = arg;
    char path[256], err[256];
    snprintf(path, sizeof path, "%s/out.safetensors", dir);
    out_cleanup_on_signals();
    out_file of;
    if (out_open(&of, path, err, sizeof err) != 0) return 3;
    if (out_write(&of, "partial", 7) != 0) return 4;
    raise(*sig);
    return 5; /* not reached: the signal ends the process */
}

static void test_signals(void) {
    const int sigs[] = {SIGINT, SIGTERM};
    for (int i = 0; i < 2; i++) {
        int before = count_entries();
        int rc = in_child(signal_while_open, (void *)&sigs[i], -1);
        check(rc == -sigs[i] && count_entries() == before, "%s while a temporary is open: ended by it (%d), %d file(s) left",
              sigs[i] == SIGINT ? "SIGINT" : "SIGTERM", rc, count_entries() - before);
    }
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* the default actions the signal cases expect: a shell without job control starts a background
     * command with SIGINT ignored, which the atomic writer leaves alone (as it should) */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (!mkdtemp(dir)) return 1;
    test_stdout_append();
    test_stdout_pipe();
    test_pipe("/dev/fd/%d");
    test_pipe("/proc/self/fd/%d");
    test_closed_descriptor();
    test_deleted_stdout();
    test_signals();
    rmdir(dir);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
