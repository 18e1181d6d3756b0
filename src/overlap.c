/* overlap.c — whether strided tensor views share memory, exactly.
 *
 * Every tensor the library takes has head-dim stride 1, so a view is a set of "rows": runs of
 * span = shape[3] * element-size contiguous bytes starting at base + b*s0 + h*s1 + n*s2 (strides in
 * bytes). Two views share memory iff some row of one intersects some row of the other; a view
 * aliases itself iff two of its rows intersect (or a stride-0 dimension repeats a row).
 *
 * The common case costs nothing: byte ranges that do not intersect cannot share memory. When they
 * do (interleaved views of one buffer, e.g. q and o as the two halves of a [B, N, 2H, D] buffer),
 * the rows of each view are walked in increasing address order and the two sorted sequences are
 * swept against each other, O(rows of both). A view whose dimensions are "nested" (each stride at
 * least the extent of the dimensions below it, the layout of every contiguous or sliced tensor) is
 * walked in order by nested loops; any other layout is listed and sorted first.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct row_view {
    uintptr_t base;
    int64_t span;      /* bytes per row */
    int ndims;         /* row dimensions with more than one entry, strides ascending */
    int64_t shape[3];
    int64_t stride[3]; /* bytes */
} row_view;

/* rows of t as a row_view; 0 when t touches no memory. Drops stride-0 dimensions when
 * drop_repeats (a repeated row cannot overlap another view more than the row itself does). */
static int make_row_view(const wa_tensor *t, int drop_repeats, row_view *r) {
    int64_t es = (int64_t)wa_dtype_size(t->dtype);
    for (int d = 0; d < 4; d++)
        if (t->shape[d] == 0) return 0;
    memset(r, 0, sizeof *r);
    r->base = (uintptr_t)t->data;
    r->span = t->shape[3] * es;
    for (int d = 0; d < 3; d++) {
        if (t->shape[d] == 1 || (drop_repeats && t->stride[d] == 0)) continue;
        int i = r->ndims++;
        /* insertion by stride, ascending */
        while (i > 0 && r->stride[i - 1] > t->stride[d] * es) {
            r->shape[i] = r->shape[i - 1], r->stride[i] = r->stride[i - 1];
            i--;
        }
        r->shape[i] = t->shape[d], r->stride[i] = t->stride[d] * es;
    }
    return 1;
}

static int64_t view_rows(const row_view *r) {
    int64_t n = 1;
    for (int d = 0; d < r->ndims; d++) n *= r->shape[d];
    return n;
}

/* Nested: each stride at least the extent of the dimensions below it. Then the nested loops
 * (largest stride outermost) visit rows in strictly increasing address order, none overlapping. */
static int is_nested(const row_view *r) {
    int64_t extent = r->span;
    for (int d = 0; d < r->ndims; d++) {
        if (r->stride[d] < extent) return 0;
        extent += (r->shape[d] - 1) * r->stride[d];
    }
    return 1;
}

/* Row starts in increasing order: nested loops, or a sorted list. */
typedef struct row_walk {
    const row_view *v;
    int64_t idx[3];
    int64_t *list, n_list, at; /* the sorted list, for views that are not nested */
    int done;
    uintptr_t cur;
} row_walk;

static int cmp_offset(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static wa_status walk_start(wa_context *ctx, const row_view *v, row_walk *w) {
    memset(w, 0, sizeof *w);
    w->v = v;
    w->cur = v->base;
    if (is_nested(v)) return WA_OK;
    int64_t n = view_rows(v);
    w->list = wa_alloc(ctx, (size_t)n * sizeof *w->list);
    if (!w->list) return wa_fail(WA_ERR_NO_MEMORY, "cannot allocate %lld row offsets for the overlap check", (long long)n);
    int64_t at = 0;
    for (int64_t i0 = 0; i0 < (v->ndims > 2 ? v->shape[2] : 1); i0++)
        for (int64_t i1 = 0; i1 < (v->ndims > 1 ? v->shape[1] : 1); i1++)
            for (int64_t i2 = 0; i2 < (v->ndims > 0 ? v->shape[0] : 1); i2++)
                w->list[at++] = (v->ndims > 2 ? i0 * v->stride[2] : 0) + (v->ndims > 1 ? i1 * v->stride[1] : 0) +
                                (v->ndims > 0 ? i2 * v->stride[0] : 0);
    qsort(w->list, (size_t)n, sizeof *w->list, cmp_offset);
    w->n_list = n;
    w->cur = v->base + (uintptr_t)w->list[0];
    return WA_OK;
}

static void walk_next(row_walk *w) {
    const row_view *v = w->v;
    if (w->list) {
        if (++w->at >= w->n_list) w->done = 1;
        else w->cur = v->base + (uintptr_t)w->list[w->at];
        return;
    }
    for (int d = 0; d < v->ndims; d++) { /* odometer, smallest stride fastest */
        if (++w->idx[d] < v->shape[d]) {
            w->cur += (uintptr_t)v->stride[d];
            return;
        }
        w->cur -= (uintptr_t)((v->shape[d] - 1) * v->stride[d]);
        w->idx[d] = 0;
    }
    w->done = 1;
}

static void walk_end(wa_context *ctx, row_walk *w) { wa_free(ctx, w->list); }

/* *overlap = whether two walks (each in increasing order, rows of fixed spans) meet. */
static void sweep(row_walk *a, row_walk *b, int64_t span_a, int64_t span_b, int *overlap) {
    *overlap = 0;
    while (!a->done && !b->done) {
        if (a->cur + (uintptr_t)span_a <= b->cur) walk_next(a);
        else if (b->cur + (uintptr_t)span_b <= a->cur) walk_next(b);
        else {
            *overlap = 1;
            return;
        }
    }
}

static void byte_range(const row_view *r, uintptr_t *lo, uintptr_t *hi) {
    int64_t last = 0;
    for (int d = 0; d < r->ndims; d++) last += (r->shape[d] - 1) * r->stride[d];
    *lo = r->base;
    *hi = r->base + (uintptr_t)(last + r->span);
}

wa_status wa_views_overlap(wa_context *ctx, const wa_tensor *x, const wa_tensor *y, int *overlap) {
    row_view a, b;
    *overlap = 0;
    if (!make_row_view(x, 1, &a) || !make_row_view(y, 1, &b)) return WA_OK;
    uintptr_t alo, ahi, blo, bhi;
    byte_range(&a, &alo, &ahi);
    byte_range(&b, &blo, &bhi);
    if (ahi <= blo || bhi <= alo) return WA_OK;
    row_walk wa, wb;
    wa_status st = walk_start(ctx, &a, &wa);
    if (st != WA_OK) return st;
    if ((st = walk_start(ctx, &b, &wb)) != WA_OK) {
        walk_end(ctx, &wa);
        return st;
    }
    sweep(&wa, &wb, a.span, b.span, overlap);
    walk_end(ctx, &wa);
    walk_end(ctx, &wb);
    return WA_OK;
}

wa_status wa_view_aliases_itself(wa_context *ctx, const wa_tensor *t, int *aliases) {
    row_view v;
    *aliases = 0;
    if (!make_row_view(t, 0, &v)) return WA_OK;
    for (int d = 0; d < v.ndims; d++)
        if (v.stride[d] == 0) return (*aliases = 1), WA_OK;
    if (is_nested(&v)) return WA_OK;
    row_walk w;
    wa_status st = walk_start(ctx, &v, &w);
    if (st != WA_OK) return st;
    uintptr_t prev_end = w.cur; /* the first row meets nothing before it */
    for (; !w.done; walk_next(&w)) {
        if (w.cur < prev_end) {
            *aliases = 1;
            break;
        }
        prev_end = w.cur + (uintptr_t)v.span;
    }
    walk_end(ctx, &w);
    return WA_OK;
}
