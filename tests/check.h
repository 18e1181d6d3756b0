/* check.h — the small harness every C test shares: one line per case
 * (PASS|FAIL|SKIP name detail), counters, a closing "N passed, N failed" line and the exit code.
 * Poisoned, guarded outputs live in the case runner (src/ref/case.c), which the tests share. */
#ifndef WA_CHECK_H
#define WA_CHECK_H

#include "winattn.h"

#include <stddef.h>
#include <stdint.h>

void check_pass(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void check_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void check_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* PASS or FAIL depending on ok; returns ok. */
int check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "N passed, N failed" and returns the process exit code. */
int check_summary(void);

/* SIGINT and SIGTERM back to their default action, for a test that stops work with them: a shell
 * without job control (a script's `cmd &`) starts a background command with SIGINT ignored, and
 * the library leaves a signal ignored on entry alone (as it should), which such a test would take
 * for a failure. */
void check_default_stop_signals(void);

/* Files for the trainer's tests: copies from to to (0, or -1 on any failure); 1 when both files
 * exist and hold the same bytes. */
int check_copy_file(const char *from, const char *to);
int check_same_bytes(const char *a, const char *b);

/* random inputs: wa_rng_seed / wa_rng_normal / wa_fill_normal from src/ref/case.h */
#include "ref/case.h"

#endif
