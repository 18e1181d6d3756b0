/* test_geometry.c — every function of src/tile_geometry.h against the predicate wa_visible(),
 * exhaustively over small sizes, windows and tile sizes: the tiles a query tile visits cover
 * exactly its visible pairs, the unmasked ones are fully visible, the reverse map (key tile ->
 * query tiles) agrees, the ranges of unmasked key tiles and query tiles match the per-tile test,
 * the ordered dQ's share counts follow from the ranges, and the pair count is exact. */
#include "check.h"
#include "tile_geometry.h"

#include <stdio.h>
#include <stdlib.h>

/* a range [u0, u1) of tiles said to need no mask, at tile t: it holds t exactly when t is visited
 * and not an edge tile (edge: the kernels' test, ragged or wa_tile_needs_mask) */
static int unmasked_range_ok(int64_t u0, int64_t u1, int64_t t, int visited, int edge) {
    return (t >= u0 && t < u1) == (visited && !edge);
}

static int check_config(const wa_window *w, int64_t Bq, int64_t Bk, char *why, size_t n) {
    int64_t Nq = w->Nq, Nk = w->Nk;
    int64_t rb, re, cb, ce;
    wa_nonempty_rows(w, &rb, &re);
    wa_nonempty_cols(w, &cb, &ce);
    int64_t pairs = 0;
    for (int64_t i = 0; i < Nq; i++) {
        int64_t cnt = 0, lo = wa_row_first_key(w, i), hi = wa_row_last_key(w, i);
        for (int64_t j = 0; j < Nk; j++) {
            int vis = wa_visible(w, i, j);
            cnt += vis;
            if (vis != (j >= lo && j <= hi)) return snprintf(why, n, "row range of %lld wrong at key %lld", (long long)i, (long long)j), 0;
            if (vis != (i >= wa_col_first_query(w, j) && i <= wa_col_last_query(w, j)))
                return snprintf(why, n, "column range of key %lld wrong at row %lld", (long long)j, (long long)i), 0;
        }
        pairs += cnt;
        if ((cnt > 0) != (i >= rb && i < re)) return snprintf(why, n, "nonempty rows wrong at %lld", (long long)i), 0;
    }
    for (int64_t j = 0; j < Nk; j++) {
        int seen = 0;
        for (int64_t i = 0; i < Nq; i++) seen |= wa_visible(w, i, j);
        if (seen != (j >= cb && j < ce)) return snprintf(why, n, "nonempty cols wrong at %lld", (long long)j), 0;
    }
    if (pairs != wa_visible_pairs(w)) return snprintf(why, n, "pair count %lld != %lld", (long long)wa_visible_pairs(w), (long long)pairs), 0;

    /* forward view: every visible pair lies in exactly one visited tile; unmasked tiles are full */
    for (int64_t i0 = 0; i0 < Nq; i0 += Bq) {
        int64_t i1 = wa_min64(i0 + Bq, Nq), kt0, kt1;
        wa_key_tiles_for_rows(w, i0, i1, Bk, &kt0, &kt1);
        for (int64_t kt = 0; kt * Bk < Nk; kt++) {
            int64_t j0 = kt * Bk, j1 = wa_min64(j0 + Bk, Nk), any = 0, all = 1;
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = j0; j < j1; j++) {
                    int vis = wa_visible(w, i, j);
                    any |= vis, all &= vis;
                }
            int visited = kt >= kt0 && kt < kt1;
            if (any && !visited) return snprintf(why, n, "query tile %lld skips key tile %lld with visible pairs", (long long)i0, (long long)kt), 0;
            if (visited && !any) return snprintf(why, n, "query tile %lld visits empty key tile %lld", (long long)i0, (long long)kt), 0;
            if (visited && wa_tile_needs_mask(w, i0, i1, j0, j1) == all)
                return snprintf(why, n, "mask flag wrong for tile (%lld, %lld)", (long long)i0, (long long)kt), 0;
            /* the kernels' edge test: ragged last tile or needs_mask; unmasked_key_tiles is its complement */
            int64_t ut0, ut1;
            wa_unmasked_key_tiles(w, i0, i1, Bk, &ut0, &ut1);
            if (!unmasked_range_ok(ut0, ut1, kt, visited, j0 + Bk > Nk || wa_tile_needs_mask(w, i0, i1, j0, j1)))
                return snprintf(why, n, "unmasked key tiles [%lld, %lld) wrong at tile (%lld, %lld)", (long long)ut0,
                                (long long)ut1, (long long)i0, (long long)kt), 0;
        }
    }
    /* backward view: key tile -> query tiles */
    for (int64_t j0 = 0; j0 < Nk; j0 += Bk) {
        int64_t j1 = wa_min64(j0 + Bk, Nk), qt0, qt1;
        wa_query_tiles_for_cols(w, j0, j1, Bq, &qt0, &qt1);
        for (int64_t qt = 0; qt * Bq < Nq; qt++) {
            int64_t i0 = qt * Bq, i1 = wa_min64(i0 + Bq, Nq), any = 0;
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = j0; j < j1; j++) any |= wa_visible(w, i, j);
            int visited = qt >= qt0 && qt < qt1;
            if (any != visited) return snprintf(why, n, "key tile %lld: query tile %lld visited=%d but visible=%d", (long long)j0, (long long)qt, visited, (int)any), 0;
            /* the ordered dQ (src/cuda/sm90/bwd_dkdv.cu): the key tiles before this one that add to query tile
             * qt number this tile's index less the first of wa_key_tiles_for_rows (unclipped rows,
             * as the kernel passes them); so that first one, with none before it, stores the block
             * (kOrderedFirstStores), and a query tile whose range is empty gets no share at all
             * (the forward view above: prep_kernel zeroes those) */
            if (visited) {
                int64_t before = 0, k0, k1, a0, a1;
                for (int64_t jj = 0; jj < j0; jj += Bk) {
                    wa_query_tiles_for_cols(w, jj, wa_min64(jj + Bk, Nk), Bq, &a0, &a1);
                    before += qt >= a0 && qt < a1;
                }
                wa_key_tiles_for_rows(w, qt * Bq, qt * Bq + Bq, Bk, &k0, &k1);
                if (before != j0 / Bk - k0)
                    return snprintf(why, n, "key tile %lld: %lld key tiles before it add to query tile %lld, not %lld", (long long)j0,
                                    (long long)before, (long long)qt, (long long)(j0 / Bk - k0)), 0;
            }
            /* the dK/dV kernels' edge test per query tile: ragged or needs_mask */
            int64_t ut0, ut1;
            wa_unmasked_query_tiles(w, j0, j1, Bq, &ut0, &ut1);
            if (!unmasked_range_ok(ut0, ut1, qt, visited, i0 + Bq > Nq || wa_tile_needs_mask(w, i0, i1, j0, j1)))
                return snprintf(why, n, "unmasked query tiles [%lld, %lld) wrong at tile (%lld, %lld)", (long long)ut0,
                                (long long)ut1, (long long)qt, (long long)j0), 0;
        }
    }
    return 1;
}

int main(void) {
    static const int64_t sizes[] = {0, 1, 2, 3, 5, 8, 13, 17};
    static const int64_t windows[] = {-1, 0, 1, 2, 3, 7, 16};
    static const int64_t tiles[][2] = {{1, 1}, {2, 3}, {4, 4}, {3, 8}, {16, 5}};
    int64_t configs = 0, bad = 0;
    char why[200];
    for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
        for (size_t b = 0; b < sizeof sizes / sizeof *sizes; b++)
            for (size_t l = 0; l < sizeof windows / sizeof *windows; l++)
                for (size_t r = 0; r < sizeof windows / sizeof *windows; r++)
                    for (size_t t = 0; t < sizeof tiles / sizeof *tiles; t++) {
                        wa_window w = {sizes[a], sizes[b], windows[l], windows[r]};
                        configs++;
                        if (!check_config(&w, tiles[t][0], tiles[t][1], why, sizeof why)) {
                            if (bad++ < 20)
                                check_fail("geometry Nq=%lld Nk=%lld win=(%lld,%lld) tiles=%lldx%lld: %s", (long long)w.Nq,
                                           (long long)w.Nk, (long long)w.left, (long long)w.right, (long long)tiles[t][0],
                                           (long long)tiles[t][1], why);
                        }
                    }
    check(bad == 0, "geometry: %lld configurations (sizes 0..17, windows -1..16, 5 tile shapes) against wa_visible, %lld wrong",
          (long long)configs, (long long)bad);
    /* the pair formula of docs/design.md §5 */
    wa_window w = {8192, 8192, 1023, 0};
    int64_t W = 1024, N = 8192;
    check(wa_visible_pairs(&w) == N * W - W * (W - 1) / 2, "pairs(N=8192, W=1024) = N*W - W(W-1)/2 = %lld",
          (long long)wa_visible_pairs(&w));
    return check_summary();
}
