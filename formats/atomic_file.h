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

/* Write text to path through out_open (temporary + rename for a file). 0, or -1 with a one-line
 * message in err ("cannot write PATH: REASON", or out_open's and out_commit's). */
int write_text_atomic(const char *path, const char *text, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
