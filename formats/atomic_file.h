/* atomic_file.h — how the command and the trainer write an output path, so that a crash or a
 * full disk never leaves a half-written file: a temporary beside the file, fsync'ed and renamed
 * over it. Below tools/ and train/; includes nothing of the project.
 */
#ifndef WINATTN_FORMATS_ATOMIC_FILE_H
#define WINATTN_FORMATS_ATOMIC_FILE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Output files: the one place that decides how a path is written (st_write, write_text_atomic
 * and through it the command's and the trainer's text files all go through it). What the path names is followed, never clobbered:
 *   - a regular file or nothing: the bytes go to a temporary beside it (O_EXCL), which
 *     out_commit fsyncs and renames over it, keeping the old file's permission bits; a failure
 *     leaves the old file (or no file) and no temporary;
 *   - a symlink (or a chain of them): the same for its final target, with the temporary beside
 *     the target so the rename stays on one filesystem; the link stays a link. A dangling link
 *     gets its target created the same way, as a shell's `>` would do;
 *   - a character or block device, FIFO or other non-regular file: opened and written directly,
 *     so /dev/null and pipes work (and nothing can be undone there on failure);
 *   - a directory: refused ("PATH is a directory");
 *   - /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N: written through the descriptor the
 *     process already holds (a copy of it), so a pipe, a `>` and a `>>` behave as the shell
 *     promised; "descriptor N is not open" when it is not.
 * Nothing here prints or exits: failures return -1 with a one-line message in err. */
typedef struct out_file {
    int fd;        /* where to write(); -1 once closed */
    char *target;  /* the path renamed onto (path with its symlinks followed) */
    char *tmp;     /* the temporary; NULL when writing directly */
    const char *path; /* as given, for messages */
    int slot;         /* its entry among the temporaries a signal removes; -1 if none */
} out_file;
int out_open(out_file *of, const char *path, char *err, size_t errlen);
/* write(2) until done (retrying short writes and EINTR); -1 with errno set on error */
int out_write(out_file *of, const void *buf, size_t len);
/* fsync, close, rename into place; on failure everything out_abort does has been done */
int out_commit(out_file *of, char *err, size_t errlen);
/* close and remove the temporary (safe after a failed out_open or a commit) */
void out_abort(out_file *of);

/* SIGINT, SIGTERM and SIGHUP (unless ignored at start) remove every temporary out_open has
 * created and not yet committed or aborted, then end the process by the same signal. For a
 * program that handles those signals itself, out_remove_temporaries() does the removal and is
 * async-signal-safe. */
void out_cleanup_on_signals(void);
void out_remove_temporaries(void);

/* Write text to path through out_open (temporary + rename for a file). 0, or -1 with a one-line
 * message in err ("cannot write PATH: REASON", or out_open's and out_commit's). */
int write_text_atomic(const char *path, const char *text, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
