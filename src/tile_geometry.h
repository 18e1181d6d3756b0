/* tile_geometry.h — the one source of truth for window geometry, shared by every backend.
 *
 * Given (Nq, Nk, left, right) it answers: which keys a query row sees, which queries see a key
 * column, which key tiles a query tile must visit (and the reverse), and whether a tile pair is
 * an edge tile that needs the element mask. Everything follows from the predicate in
 * wa_visible(); tests/test_geometry.c checks every function against it exhaustively on small
 * sizes. docs/semantics.md derives the formulas.
 *
 * Why the formulas are simple: the visible keys of row i form the interval
 * [row_first_key(i), row_last_key(i)], and both ends are non-decreasing in i. So the rows that
 * see anything form one interval, a tile of consecutive rows sees one contiguous interval of keys
 * (the union of overlapping, monotone intervals), and a tile pair is fully visible iff its
 * bottom-left and top-right corners are. The same holds for columns by symmetry.
 *
 * Plain C (static inline, int64 arithmetic) so that .c and .cu files include it alike.
 */
#ifndef WA_TILE_GEOMETRY_H
#define WA_TILE_GEOMETRY_H

#include <stdint.h>

#ifdef __CUDACC__
#define WA_HD __host__ __device__
#else
#define WA_HD
#endif

typedef struct wa_window {
    int64_t Nq, Nk;      /* queries, keys */
    int64_t left, right; /* -1 = unbounded */
} wa_window;

WA_HD static inline int64_t wa_min64(int64_t a, int64_t b) { return a < b ? a : b; }
WA_HD static inline int64_t wa_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Bottom-right alignment: the last query lines up with the last key. */
WA_HD static inline int64_t wa_offset(const wa_window *w) { return w->Nk - w->Nq; }

/* The definition. Everything else in this file is derived from it. */
WA_HD static inline int wa_visible(const wa_window *w, int64_t i, int64_t j) {
    int64_t off = wa_offset(w);
    if (i < 0 || i >= w->Nq || j < 0 || j >= w->Nk) return 0;
    if (w->left >= 0 && j < i + off - w->left) return 0;
    if (w->right >= 0 && j > i + off + w->right) return 0;
    return 1;
}

/* Visible keys of row i: [first, last]; empty when first > last. */
WA_HD static inline int64_t wa_row_first_key(const wa_window *w, int64_t i) {
    return w->left < 0 ? 0 : wa_max64(0, i + wa_offset(w) - w->left);
}
WA_HD static inline int64_t wa_row_last_key(const wa_window *w, int64_t i) {
    return w->right < 0 ? w->Nk - 1 : wa_min64(w->Nk - 1, i + wa_offset(w) + w->right);
}

/* Row i sees at least one key (else o = 0, lse = -inf, dq = 0 by definition; a row that sees keys
 * whose scores are all -inf or NaN gets what softmax gives, NaN) */
WA_HD static inline int wa_row_sees_keys(const wa_window *w, int64_t i) {
    return wa_row_first_key(w, i) <= wa_row_last_key(w, i);
}

/* Queries that see key j: [first, last]; empty when first > last. */
WA_HD static inline int64_t wa_col_first_query(const wa_window *w, int64_t j) {
    return w->right < 0 ? 0 : wa_max64(0, j - wa_offset(w) - w->right);
}
WA_HD static inline int64_t wa_col_last_query(const wa_window *w, int64_t j) {
    return w->left < 0 ? w->Nq - 1 : wa_min64(w->Nq - 1, j - wa_offset(w) + w->left);
}

/* Rows that see at least one key: [*begin, *end). Rows outside get o = 0, lse = -inf, dq = 0. */
WA_HD static inline void wa_nonempty_rows(const wa_window *w, int64_t *begin, int64_t *end) {
    int64_t off = wa_offset(w);
    int64_t b = w->right < 0 ? 0 : wa_max64(0, -off - w->right);
    int64_t e = w->left < 0 ? w->Nq : wa_min64(w->Nq, w->Nk - off + w->left);
    if (w->Nk <= 0 || e < b) e = b;
    *begin = b;
    *end = wa_max64(b, e);
}

/* Keys that at least one query sees: [*begin, *end). Keys outside get dk = dv = 0. */
WA_HD static inline void wa_nonempty_cols(const wa_window *w, int64_t *begin, int64_t *end) {
    int64_t off = wa_offset(w);
    int64_t b = w->left < 0 ? 0 : wa_max64(0, off - w->left);
    int64_t e = w->right < 0 ? w->Nk : wa_min64(w->Nk, w->Nq + off + w->right);
    if (w->Nq <= 0 || e < b) e = b;
    *begin = b;
    *end = wa_max64(b, e);
}

/* Key tiles (of tile_k keys) that query rows [i0, i1) must visit: [*kt_begin, *kt_end).
 * Empty (begin == end) when no row of the tile sees anything. Note kt_begin is not 0 in
 * general: that is the first of the two traps the published MLX fork hit. */
WA_HD static inline void wa_key_tiles_for_rows(const wa_window *w, int64_t i0, int64_t i1, int64_t tile_k,
                                               int64_t *kt_begin, int64_t *kt_end) {
    int64_t rb, re;
    wa_nonempty_rows(w, &rb, &re);
    int64_t a = wa_max64(i0, rb), b = wa_min64(i1, re);
    if (a >= b) {
        *kt_begin = *kt_end = 0;
        return;
    }
    *kt_begin = wa_row_first_key(w, a) / tile_k;
    *kt_end = wa_row_last_key(w, b - 1) / tile_k + 1;
}

/* Query tiles (of tile_q queries) that see key columns [j0, j1): [*qt_begin, *qt_end).
 * Empty for key tiles no query visits; their dk and dv must still be written as 0 (the second
 * trap). */
WA_HD static inline void wa_query_tiles_for_cols(const wa_window *w, int64_t j0, int64_t j1, int64_t tile_q,
                                                 int64_t *qt_begin, int64_t *qt_end) {
    int64_t cb, ce;
    wa_nonempty_cols(w, &cb, &ce);
    int64_t a = wa_max64(j0, cb), b = wa_min64(j1, ce);
    if (a >= b) {
        *qt_begin = *qt_end = 0;
        return;
    }
    *qt_begin = wa_col_first_query(w, a) / tile_q;
    *qt_end = wa_col_last_query(w, b - 1) / tile_q + 1;
}

/* 1 if some pair in rows [i0,i1) x cols [j0,j1) is invisible, so the tile needs the element
 * mask; 0 if every pair is visible (the tile runs unmasked). Ranges are clipped to the matrix
 * by the caller (ragged last tiles pass their real i1, j1). */
WA_HD static inline int wa_tile_needs_mask(const wa_window *w, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    int64_t rb, re;
    wa_nonempty_rows(w, &rb, &re);
    if (i0 < rb || i1 > re) return 1;
    return !(wa_row_first_key(w, i1 - 1) <= j0 && wa_row_last_key(w, i0) >= j1 - 1);
}

/* The key tiles (of tile_k keys) that rows [i0, i1) see whole: [*t0, *t1), empty when none. Tile
 * kt is in it exactly when the kernels' edge test for it is false, i.e. it is not the ragged last
 * tile (columns [kt·tile_k, (kt+1)·tile_k) all exist) and wa_tile_needs_mask says 0: the same
 * answer, worked out once per row range instead of once per tile (64-bit arithmetic that the
 * version-4 forward otherwise repeats on every key tile). */
WA_HD static inline void wa_unmasked_key_tiles(const wa_window *w, int64_t i0, int64_t i1, int64_t tile_k, int64_t *t0,
                                               int64_t *t1) {
    int64_t rb, re;
    wa_nonempty_rows(w, &rb, &re);
    *t0 = *t1 = 0;
    if (i0 >= i1 || i0 < rb || i1 > re) return;
    /* every row of the range sees keys [first_key(i1 - 1), last_key(i0)], both >= 0 here */
    int64_t a = (wa_row_first_key(w, i1 - 1) + tile_k - 1) / tile_k, b = (wa_row_last_key(w, i0) + 1) / tile_k;
    if (a < b) *t0 = a, *t1 = b;
}

/* The transposed view, for the backward's key tiles: the query tiles (of tile_q queries) whose
 * rows all see every key of [j0, j1): [*t0, *t1), empty when none. Query tile qt is in it exactly
 * when it is not the ragged last tile and wa_tile_needs_mask(qt·tile_q, (qt+1)·tile_q, j0, j1)
 * says 0. */
WA_HD static inline void wa_unmasked_query_tiles(const wa_window *w, int64_t j0, int64_t j1, int64_t tile_q, int64_t *t0,
                                                 int64_t *t1) {
    int64_t cb, ce;
    wa_nonempty_cols(w, &cb, &ce);
    *t0 = *t1 = 0;
    if (j0 >= j1 || j0 < cb || j1 > ce) return;
    /* the rows that see every key of the range: [first_query(j1 - 1), last_query(j0)] */
    int64_t a = (wa_col_first_query(w, j1 - 1) + tile_q - 1) / tile_q, b = (wa_col_last_query(w, j0) + 1) / tile_q;
    if (a < b) *t0 = a, *t1 = b;
}

/* Exact number of visible (query, key) pairs, for FLOP counts (docs/design.md §5). */
WA_HD static inline int64_t wa_visible_pairs(const wa_window *w) {
    int64_t rb, re, n = 0;
    wa_nonempty_rows(w, &rb, &re);
    for (int64_t i = rb; i < re; i++) n += wa_row_last_key(w, i) - wa_row_first_key(w, i) + 1;
    return n;
}

#endif /* WA_TILE_GEOMETRY_H */
