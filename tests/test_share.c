/* test_share.c: the grouping of shared-prefix decode (src/cache/share.c, pkv__share_plan) on
 * synthetic block tables. The tables grow as a random tree (each a copy of an earlier one's first
 * blocks, then blocks of its own; some repeated whole), so a batch shares prefixes at several
 * depths. The groups must nest: two are disjoint or one holds the other, and a group reads from
 * where the innermost group holding it ends (or 0); each group two members or more that share its
 * blocks from the same base (the first block their queries see: past 0 under chunks of local
 * attention of whole blocks), each member's shareable blocks (before its query, from its base,
 * none where a window or chunk starts inside a block) at least that, each
 * group reading min_blocks or more, and the members of all groups within the scratch's. With
 * groups of any block and room for all, what they save must be what reading every distinct
 * prefix once saves (the sum of the members' shareable blocks less the distinct (base, depth,
 * prefix) triples among them, counted by comparing every pair). The plan's order must put tables with a
 * common prefix side by side. Off, no group. */
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
static uint32_t g_base[NS]; /* an item's first visible block */

/* The blocks items a's and b's tables share within their first n from their bases (none where
 * their bases differ). */
static uint32_t common(uint32_t a, uint32_t b, uint32_t n) {
    if (g_base[a] != g_base[b]) return 0;
    const int32_t *ta = g_tab[a] + g_base[a], *tb = g_tab[b] + g_base[b];
    uint32_t p = 0;
    while (p < n && ta[p] == tb[p]) p++;
    return p;
}

/* The blocks members x and x + 1 of the plan's order share (as the plan counts them: within both
 * members' shareable blocks). */
static uint32_t order_lcp(const pkv_cache *c, const uint32_t *full, uint32_t x) {
    const uint32_t a = c->share.order[x], b = c->share.order[x + 1];
    return common(a, b, full[a] < full[b] ? full[a] : full[b]);
}

/* The block reads that reading each distinct prefix of the eligible items once saves: their
 * shareable blocks less the distinct (depth t, first t blocks) pairs among them. */
static uint64_t distinct_saving(const pkv_cache *c, const uint32_t *full, uint32_t k, uint32_t min_blocks) {
    uint64_t all = 0, distinct = 0;
    for (uint32_t i = 0; i < k; i++) {
        if (full[i] < min_blocks) continue;
        all += full[i];
        for (uint32_t t = 1; t <= full[i]; t++) { /* (t, prefix) new unless an earlier item has it */
            bool seen = false;
            for (uint32_t j = 0; j < i && !seen; j++)
                seen = full[j] >= min_blocks && full[j] >= t && common(i, j, t) == t;
            distinct += !seen;
        }
    }
    return all - distinct;
}

static void test_share_plan(void **state) {
    (void)state;
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = 2, cfg.head_dim = 16, cfg.block_tokens = BT, cfg.n_blocks = 4096;
    cfg.max_seqs = NS, cfg.max_blocks_per_seq = MAXB, cfg.n_threads = 1;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    uint32_t full[NS];
    uint64_t n_groups = 0, n_nested = 0, n_exact = 0, n_based = 0, n_based_groups = 0;
    for (int round = 0; round < 400; round++) {
        const uint32_t k = 2 + below(round & 1 ? NS - 1 : 13), window = below(4) ? 0 : 40 + below(120);
        /* chunks of whole blocks (a query past the first chunk shares from its chunk's block on), or
           of any size (past the first chunk: not shared where the chunk starts inside a block) */
        const uint32_t chunk = below(4) ? 0 : below(2) ? BT * (1 + below(30)) : 30 + below(200);
        const uint32_t min_blocks = round & 2 ? 1 : 1 + below(6), nqh = round & 2 ? 2 : 2 * (1 + below(4));
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
            /* the first key the query at len - 1 sees, by the window and the chunk */
            const uint32_t wlo = window && len > window ? len - window : 0, clo = chunk ? (len - 1) / chunk * chunk : 0;
            const uint32_t lo = wlo > clo ? wlo : clo;
            g_base[i] = lo % BT ? 0 : lo / BT;
            full[i] = lo % BT ? 0 : (len - 1) / BT - lo / BT;
            n_based += full[i] && lo;
        }
        pkv__cache_test_share(c, min_blocks, 0);
        const pkv__attn_call call = {.n_q_heads = nqh, .window = window, .chunk = chunk};
        const uint32_t ng = pkv__share_plan(c, k, &call);
        const pkv__share *sh = &c->share;
        uint32_t n = 0; /* the eligible items: min_blocks shareable */
        for (uint32_t i = 0; i < k; i++) n += full[i] >= min_blocks;
        uint64_t saved = 0, members = 0;
        bool nested = false;
        for (uint32_t g = 0; g < ng; g++) {
            const pkv__share_group *gr = &sh->groups[g];
            assert_true(gr->n >= 2 && gr->first + gr->n <= n);
            assert_true(gr->blocks - gr->from >= min_blocks && gr->blocks > gr->from);
            const uint32_t i0 = sh->order[gr->first];
            n_based_groups += g_base[i0] > 0;
            for (uint32_t j = 0; j < gr->n; j++) {
                const uint32_t i = sh->order[gr->first + j];
                assert_true(i < k && gr->blocks <= full[i]);
                assert_int_equal(common(i, i0, gr->blocks), gr->blocks);
            }
            /* nested or disjoint; it reads from where the innermost group holding it ends (or 0) */
            uint32_t from = 0;
            for (uint32_t h = 0; h < ng; h++) {
                const pkv__share_group *o = &sh->groups[h];
                if (h == g) continue;
                const bool apart = o->first + o->n <= gr->first || gr->first + gr->n <= o->first;
                const bool holds = o->first <= gr->first && gr->first + gr->n <= o->first + o->n;
                const bool inside = gr->first <= o->first && o->first + o->n <= gr->first + gr->n;
                assert_true(apart || holds || inside);
                assert_false(holds && inside);
                if (holds) assert_true(o->blocks < gr->blocks), from = PKV_MAX(from, o->blocks), nested = true;
            }
            assert_int_equal(gr->from, from);
            saved += (uint64_t)(gr->n - 1) * (gr->blocks - gr->from);
            members += gr->n;
        }
        const uint32_t cap = sh->rows / nqh;
        assert_true(members <= cap);
        n_groups += ng;
        n_nested += nested;
        /* the order: tables with a common prefix side by side (any two share what all the
           neighbours between them share) */
        for (uint32_t x = 0; x < n && n >= 2; x++) { /* (fewer: the plan stops before its order) */
            assert_true(full[sh->order[x]] >= min_blocks);
            uint32_t p = UINT32_MAX;
            for (uint32_t z = x + 1; z < n; z++) {
                const uint32_t a = sh->order[x], b = sh->order[z];
                p = PKV_MIN(p, order_lcp(c, full, z - 1));
                assert_int_equal(common(a, b, PKV_MIN(full[a], full[b])), p);
            }
        }
        /* groups of any block, none refused for room (room left for any group): every distinct
           prefix read once */
        if (min_blocks == 1 && members + n <= cap) {
            const uint64_t want = distinct_saving(c, full, k, 1);
            if (saved != want)
                fail_msg("round %d: %u tables, window %u: the groups save %llu block reads, distinct prefixes %llu",
                         round, k, window, (unsigned long long)saved, (unsigned long long)want);
            n_exact++;
        }
        /* a scratch of 3 members' rows: groups of 3 members in all at most */
        pkv__cache_test_share(c, min_blocks, 3 * nqh);
        const uint32_t ng3 = pkv__share_plan(c, k, &call);
        uint32_t m3 = 0;
        for (uint32_t g = 0; g < ng3; g++) m3 += sh->groups[g].n, assert_true(sh->groups[g].n >= 2);
        assert_true(m3 <= 3);
        /* off: nothing */
        pkv__cache_test_share(c, 0, 0);
        assert_int_equal(pkv__share_plan(c, k, &call), 0);
    }
    /* the batches really had groups, nested in some, and the exact check ran */
    print_message("  %llu groups, %llu nested, %llu checked exactly; %llu members past block 0, %llu groups of them\n",
                  (unsigned long long)n_groups, (unsigned long long)n_nested, (unsigned long long)n_exact,
                  (unsigned long long)n_based, (unsigned long long)n_based_groups);
    assert_true(n_groups > 200 && n_nested > 30 && n_exact > 100 && n_based_groups > 20);
    pkv_cache_destroy(c);
}

/* A cache of 64 blocks of BT tokens and 8 sequences, whose items the plans below fill by hand. */
static pkv_cache *small_cache(void) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = 2, cfg.head_dim = 16, cfg.block_tokens = BT, cfg.n_blocks = 64;
    cfg.max_seqs = 8, cfg.max_blocks_per_seq = MAXB, cfg.n_threads = 1;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    return c;
}

/* The scratch's rows go to the shallowest groups of the whole batch first, whichever order the
 * block ids give the subtrees: two families of three sharing 3 blocks, two of the second sharing
 * 6; with room for 6 members both families' groups are taken (2 x 3 + 2 x 3 = 12 block reads
 * saved) and the pair is not, with either family's ids the smaller. (Taking a subtree whole first,
 * the second family's group and its pair, then no room for the first family: 9.) */
static void test_share_plan_depth_order(void **state) {
    (void)state;
    pkv_cache *c = small_cache();
    for (int flip = 0; flip < 2; flip++) {
        const int32_t x = flip ? 100 : 1, y = flip ? 1 : 100; /* the families' first block ids */
        for (uint32_t i = 0; i < 6; i++) {
            for (uint32_t b = 0; b < 8; b++) g_tab[i][b] = 1000 + (int32_t)(10 * i + b); /* own blocks */
            for (uint32_t b = 0; b < 3; b++) g_tab[i][b] = (i < 3 ? x : y) + (int32_t)b;
            for (uint32_t b = 3; i >= 4 && b < 6; b++) g_tab[i][b] = y + (int32_t)b;
            c->items[i] = (pkv__attn_item){.block_table = g_tab[i], .q_pos0 = 7 * BT, .n_q = 1};
        }
        pkv__cache_test_share(c, 1, 6 * 2);
        const pkv__attn_call call = {.n_q_heads = 2};
        const uint32_t ng = pkv__share_plan(c, 6, &call);
        uint64_t saved = 0;
        for (uint32_t g = 0; g < ng; g++) {
            const pkv__share_group *gr = &c->share.groups[g];
            assert_true(gr->n == 3 && gr->from == 0 && gr->blocks == 3);
            saved += (uint64_t)(gr->n - 1) * (gr->blocks - gr->from);
        }
        assert_int_equal(ng, 2);
        assert_int_equal(saved, 12);
    }
    pkv_cache_destroy(c);
}

/* Bases apart: under chunks of 8 positions (2 blocks), a decode at 15 sees from block 2 on and
 * one at 23 from block 4 on. Tables whose blocks from their bases read alike (block 7, then 9:
 * tables no cache makes, a block sitting at one index in every table, but the plan must not lean
 * on that) are no group; at the same base they are one, over that block. */
static void test_share_plan_bases(void **state) {
    (void)state;
    pkv_cache *c = small_cache();
    static const int32_t ta[8] = {1, 2, 7, 9, 20, 21, 22, 23}, tb[8] = {3, 4, 5, 6, 7, 9, 30, 31};
    static const int32_t tc[8] = {3, 4, 7, 9, 40, 41, 42, 43};
    const pkv__attn_call call = {.n_q_heads = 2, .chunk = 2 * BT};
    pkv__cache_test_share(c, 1, 0);
    c->items[0] = (pkv__attn_item){.block_table = ta, .q_pos0 = 15, .n_q = 1};
    c->items[1] = (pkv__attn_item){.block_table = tb, .q_pos0 = 23, .n_q = 1};
    assert_int_equal(pkv__share_plan(c, 2, &call), 0);
    c->items[1] = (pkv__attn_item){.block_table = tc, .q_pos0 = 15, .n_q = 1};
    assert_int_equal(pkv__share_plan(c, 2, &call), 1);
    const pkv__share_group *g = &c->share.groups[0];
    assert_true(g->n == 2 && g->from == 0 && g->blocks == 1);
    assert_true(c->share.base[0] == 2 && c->share.base[1] == 2);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_plan),
        cmocka_unit_test(test_share_plan_depth_order),
        cmocka_unit_test(test_share_plan_bases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
