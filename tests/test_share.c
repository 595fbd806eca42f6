/* test_share.c: the grouping of shared-prefix decode (src/cache/share.c, pkv__share_plan) on
 * synthetic block tables. The tables grow as a random tree (each a copy of an earlier one's first
 * blocks, then blocks of its own; some repeated whole), so a batch shares prefixes at several
 * depths. Every group must be two members or more, disjoint, and share `blocks` blocks that each
 * member may share (before its query, under the window), at least min_blocks. The plan's order
 * must put tables with a common prefix side by side (any two share what the neighbours between
 * them share), and for batches of up to 14 members its groups must save as many block reads as
 * the best partition of that order into runs, found by trying every one. (Groups that interleave
 * in the order can save more: a short table grouped with a long one across a run of deeper
 * sharers. The plan does not look for those.) A scratch of fewer rows cuts the groups at its
 * members; off, no group. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cache/cache_int.h"

#include <stdlib.h>
#include <string.h>

enum { NS = 48, MAXB = 40, BT = 4 };

static uint64_t g_rng = 7;
static uint32_t below(uint32_t n) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((g_rng >> 33) % n);
}

static int32_t g_tab[NS][MAXB];

/* The blocks item a's and item b's tables share within their first n. */
static uint32_t common(const int32_t *a, const int32_t *b, uint32_t n) {
    uint32_t p = 0;
    while (p < n && a[p] == b[p]) p++;
    return p;
}

/* The blocks members x and x + 1 of the plan's order share (as the plan counts them: within both
 * members' shareable blocks). */
static uint32_t order_lcp(const pkv_cache *c, const uint32_t *full, uint32_t x) {
    const uint32_t a = c->share.order[x], b = c->share.order[x + 1];
    return common(c->items[a].block_table, c->items[b].block_table, full[a] < full[b] ? full[a] : full[b]);
}

/* The most block reads a partition of the plan's order [0, n) into runs saves (a run of m members
 * whose neighbours share at least p >= min_blocks, and at most span members, saves (m - 1) x p),
 * by trying every partition: n - 1 cuts, each there or not. */
static uint64_t brute_force(const pkv_cache *c, const uint32_t *full, uint32_t n, uint32_t min_blocks, uint32_t span) {
    uint32_t lcp[NS];
    for (uint32_t x = 0; x + 1 < n; x++) lcp[x] = order_lcp(c, full, x);
    uint64_t best = 0;
    for (uint32_t cuts = 0; cuts < 1u << (n - 1); cuts++) {
        uint64_t v = 0;
        for (uint32_t a = 0; a < n;) {
            uint32_t b = a, p = UINT32_MAX;
            while (b + 1 < n && !(cuts >> b & 1u)) p = lcp[b] < p ? lcp[b] : p, b++;
            if (b > a && p >= min_blocks && b - a + 1 <= span) v += (uint64_t)(b - a) * p;
            a = b + 1;
        }
        if (v > best) best = v;
    }
    return best;
}

static void test_share_plan_optimum(void **state) {
    (void)state;
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = 2, cfg.head_dim = 16, cfg.block_tokens = BT, cfg.n_blocks = 4096;
    cfg.max_seqs = NS, cfg.max_blocks_per_seq = MAXB, cfg.n_threads = 1;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    uint32_t full[NS];
    uint64_t n_groups = 0, n_split = 0, n_brute = 0;
    for (int round = 0; round < 400; round++) {
        const uint32_t k = 2 + below(round & 1 ? NS - 1 : 13), window = below(4) ? 0 : 40 + below(120);
        const uint32_t min_blocks = 1 + below(6), nqh = 2 * (1 + below(4));
        int32_t next = 1;
        for (uint32_t i = 0; i < k; i++) {
            const uint32_t len = 1 + below(MAXB * BT - 1), nb = (len + BT - 1) / BT;
            uint32_t keep = 0;
            if (i && below(8)) { /* a copy of an earlier table's first blocks, or all of them */
                const uint32_t from = below(i), fb = (c->items[from].q_pos0 + BT) / BT;
                keep = below(3) ? below(fb + 1) : fb;
                if (keep > nb) keep = nb;
                memcpy(g_tab[i], g_tab[from], keep * sizeof(int32_t));
            }
            for (uint32_t b = keep; b < nb; b++) g_tab[i][b] = next++;
            c->items[i] = (pkv__attn_item){.block_table = g_tab[i], .q_pos0 = len - 1, .n_q = 1};
            full[i] = window && len > window ? 0 : (len - 1) / BT;
        }
        pkv__cache_test_share(c, min_blocks, 0);
        const uint32_t ng = pkv__share_plan(c, k, window, nqh);
        const pkv__share *sh = &c->share;
        bool used[NS] = {0};
        uint64_t saved = 0;
        for (uint32_t g = 0; g < ng; g++) {
            const pkv__share_group *gr = &sh->groups[g];
            assert_true(gr->n >= 2);
            assert_true(gr->blocks >= min_blocks);
            const uint32_t i0 = sh->order[gr->first];
            for (uint32_t j = 0; j < gr->n; j++) {
                const uint32_t i = sh->order[gr->first + j];
                assert_true(i < k);
                assert_false(used[i]);
                used[i] = true;
                assert_true(gr->blocks <= full[i]);
                assert_int_equal(common(g_tab[i], g_tab[i0], gr->blocks), gr->blocks);
            }
            saved += (uint64_t)(gr->n - 1) * gr->blocks;
        }
        n_groups += ng;
        /* the order: the eligible members (min_blocks shareable) in an order where any two share
           what all the neighbours between them share (tables with a common prefix side by side) */
        uint32_t n = 0;
        for (uint32_t i = 0; i < k; i++) n += full[i] >= min_blocks;
        for (uint32_t x = 0; x < n && n >= 2; x++) { /* (fewer: the plan stops before its order) */
            assert_true(full[sh->order[x]] >= min_blocks);
            uint32_t p = UINT32_MAX;
            for (uint32_t z = x + 1; z < n; z++) {
                const uint32_t a = sh->order[x], b = sh->order[z];
                p = PKV_MIN(p, order_lcp(c, full, z - 1));
                assert_int_equal(common(g_tab[a], g_tab[b], PKV_MIN(full[a], full[b])), p);
            }
        }
        if (n >= 2 && n <= 14) { /* the groups save what the best partition of that order does */
            const uint64_t best = brute_force(c, full, n, min_blocks, sh->rows / nqh);
            if (saved != best)
                fail_msg("round %d: %u tables, min_blocks %u, window %u: the groups save %llu block reads, the best %llu",
                         round, k, min_blocks, window, (unsigned long long)saved, (unsigned long long)best);
            n_brute++;
        }
        /* a scratch of 3 members' rows: the first group cut to 3, nothing after it */
        pkv__cache_test_share(c, min_blocks, 3 * nqh);
        const uint32_t ng3 = pkv__share_plan(c, k, window, nqh);
        uint32_t members = 0;
        for (uint32_t g = 0; g < ng3; g++) members += sh->groups[g].n, assert_true(sh->groups[g].n >= 2);
        assert_true(members <= 3);
        assert_int_equal(ng3 > 0, ng > 0);
        n_split += ng > 1;
        /* off: nothing */
        pkv__cache_test_share(c, 0, 0);
        assert_int_equal(pkv__share_plan(c, k, window, nqh), 0);
    }
    /* the batches really had groups, several at once in some */
    assert_true(n_groups > 200 && n_split > 50 && n_brute > 150);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_plan_optimum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
