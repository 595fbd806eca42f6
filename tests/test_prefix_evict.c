/* test_prefix_evict.c: CACHED blocks after release and their reuse, eviction order under
 * pressure (FREE first, then LRU, leaves before parents, a match refreshes recency), and pins
 * (a pinned prefix survives pressure, counts as in use, and becomes evictable once unpinned).
 * Block ids are read from block tables, so each eviction is checked by name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "../fuzz/prefix_model.h"
#include "test_prefix_util.h"

void pkv__cache_test_tombs(pkv_cache *c, uint32_t n); /* cache_int.h */

static pkv_stats stats(pkv_cache *c) {
    pkv_stats st;
    assert_int_equal(pkv_cache_get_stats(c, &st), 0);
    return st;
}

/* Reused tokens of a probe match of toks[0 .. n); the probe is released again (which makes the
 * matched blocks the most recently used). */
static uint32_t probe(pkv_cache *c, int salt, const int32_t *toks, uint32_t n) {
    pkv_seq s = tp_seq(c, salt);
    uint32_t reused = 0xffffffffu;
    assert_int_equal(pkv_seq_match_prefix(c, s, toks, n, &reused), 0);
    tp_check(c);
    assert_int_equal(pkv_seq_release(c, s), 0);
    return reused;
}

/* Blocks of s's table, in order. */
static uint32_t table(pkv_cache *c, pkv_seq s, int32_t *out) { return tp_table(c, s, out, 64); }

static void test_prefix_cached_after_release(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 16, 2, PKV_DTYPE_F16, 1);
    int32_t p[33];
    tp_tokens(p, 33, 1);
    pkv_seq a = tp_seq(c, 0);
    tp_compute(c, a, 0, p, 0, 33);
    tp_commit(c, a, 33);
    int32_t ta[3], tb[3];
    assert_int_equal(table(c, a, ta), 3);
    assert_int_equal(pkv_seq_release(c, a), 0);
    pkv_stats s0 = stats(c);
    assert_int_equal(s0.n_cached, 2);
    assert_int_equal(s0.n_free, 14);
    assert_int_equal(s0.n_active, 0);
    tp_check(c);

    pkv_seq b = tp_seq(c, 0);
    uint32_t reused = 0;
    assert_int_equal(pkv_seq_match_prefix(c, b, p, 33, &reused), 0);
    assert_int_equal(reused, 32);
    assert_int_equal(table(c, b, tb), 2);
    assert_int_equal(tb[0], ta[0]);
    assert_int_equal(tb[1], ta[1]);
    tp_expect_kv(c, b, 0, p, 0, 32); /* the K/V a computed, kept while CACHED */
    pkv_stats s1 = stats(c);
    assert_int_equal(s1.n_cached, 0);
    assert_int_equal(s1.n_active, 2);
    assert_int_equal(s1.n_free, 14);
    assert_int_equal(s1.prefix_tokens_hit - s0.prefix_tokens_hit, 32);
    assert_int_equal(s1.evictions, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* Chains X, Y, Z (2 full blocks each, B = 4) released in that order; 6 FREE blocks. The first 6
 * new blocks come from FREE, then the evictions go X1, X0, Y1 (LRU, leaf before parent). */
static void test_prefix_evict_lru_order(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 12, 1, PKV_DTYPE_F16, 1);
    int32_t x[9], y[9], z[9];
    tp_tokens(x, 9, 11);
    tp_tokens(y, 9, 12);
    tp_tokens(z, 9, 13);
    pkv_seq sx = tp_seq(c, 0), sy = tp_seq(c, 0), sz = tp_seq(c, 0);
    tp_compute(c, sx, 0, x, 0, 8);
    tp_compute(c, sy, 0, y, 0, 8);
    tp_compute(c, sz, 0, z, 0, 8);
    tp_commit(c, sx, 8);
    tp_commit(c, sy, 8);
    tp_commit(c, sz, 8);
    int32_t tx[2], ty[2], tz[2], tw[16];
    table(c, sx, tx);
    table(c, sy, ty);
    table(c, sz, tz);
    assert_int_equal(pkv_seq_release(c, sx), 0);
    assert_int_equal(pkv_seq_release(c, sy), 0);
    assert_int_equal(pkv_seq_release(c, sz), 0);
    assert_int_equal(stats(c).n_cached, 6);

    int32_t fill[64];
    tp_tokens(fill, 64, 14);
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 24);
    assert_int_equal(stats(c).evictions, 0);
    assert_int_equal(stats(c).n_free, 0);
    assert_int_equal(table(c, w, tw), 6);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 2; j++) {
            assert_int_not_equal(tw[i], tx[j]);
            assert_int_not_equal(tw[i], ty[j]);
            assert_int_not_equal(tw[i], tz[j]);
        }
    tp_compute(c, w, 0, fill, 24, 4);
    assert_int_equal(table(c, w, tw), 7);
    assert_int_equal(tw[6], tx[1]); /* least recently released, leaf first */
    assert_int_equal(stats(c).evictions, 1);
    tp_check(c);
    tp_compute(c, w, 0, fill, 28, 4);
    table(c, w, tw);
    assert_int_equal(tw[7], tx[0]);
    tp_compute(c, w, 0, fill, 32, 4);
    table(c, w, tw);
    assert_int_equal(tw[8], ty[1]);
    pkv_stats st = stats(c);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.n_cached, 3);
    assert_int_equal(st.n_indexed, 3);
    tp_check(c);
    tp_expect_kv(c, w, 0, fill, 0, 36); /* evicted blocks were fully taken over */

    assert_int_equal(probe(c, 0, z, 9), 8);
    assert_int_equal(probe(c, 0, y, 9), 4);
    assert_int_equal(probe(c, 0, x, 9), 0);
    pkv_cache_destroy(c);
}

/* Recency is use, not creation: X released before Y, then X matched and released again; under
 * pressure Y goes first. */
static void test_prefix_evict_match_refreshes(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 8, 1, PKV_DTYPE_F16, 1);
    int32_t x[9], y[9], fill[32];
    tp_tokens(x, 9, 21);
    tp_tokens(y, 9, 22);
    tp_tokens(fill, 32, 23);
    pkv_seq sx = tp_seq(c, 0), sy = tp_seq(c, 0);
    tp_compute(c, sx, 0, x, 0, 8);
    tp_commit(c, sx, 8);
    tp_compute(c, sy, 0, y, 0, 8);
    tp_commit(c, sy, 8);
    int32_t tx[2], ty[2], tw[8];
    table(c, sx, tx);
    table(c, sy, ty);
    assert_int_equal(pkv_seq_release(c, sx), 0);
    assert_int_equal(pkv_seq_release(c, sy), 0);
    assert_int_equal(probe(c, 0, x, 9), 8); /* X is now the most recently used */
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 24); /* 4 FREE + 2 evicted */
    assert_int_equal(table(c, w, tw), 6);
    assert_int_equal(tw[4], ty[1]);
    assert_int_equal(tw[5], ty[0]);
    assert_int_equal(stats(c).evictions, 2);
    assert_int_equal(probe(c, 0, x, 9), 8);
    assert_int_equal(probe(c, 0, y, 9), 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A tree: C0 <- C1 <- C2 (sequence a) and C1 <- D2 (sequence b, matched C0 C1 then computed
 * its own third block). b released first, then a. LRU: D2, C2, C1, C0: a parent never goes
 * before its children, even the child released earlier than the parent's other child. */
static void test_prefix_evict_leaves_before_parents(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 8, 1, PKV_DTYPE_F16, 1);
    int32_t p[13], q[13], fill[32];
    tp_tokens(p, 13, 31);
    memcpy(q, p, 8 * sizeof(int32_t));
    tp_tokens(q + 8, 5, 32);
    tp_tokens(fill, 32, 33);
    pkv_seq a = tp_seq(c, 0);
    tp_compute(c, a, 0, p, 0, 12);
    tp_commit(c, a, 12);
    pkv_seq b = tp_seq(c, 0);
    uint32_t reused;
    assert_int_equal(pkv_seq_match_prefix(c, b, q, 13, &reused), 0);
    assert_int_equal(reused, 8);
    tp_compute(c, b, 0, q, 8, 4);
    tp_commit(c, b, 12);
    int32_t ta[3], tb[3], tw[8];
    table(c, a, ta);
    table(c, b, tb);
    assert_int_equal(tb[0], ta[0]);
    assert_int_equal(tb[1], ta[1]);
    assert_int_equal(stats(c).n_indexed, 4);
    assert_int_equal(pkv_seq_release(c, b), 0);
    assert_int_equal(pkv_seq_release(c, a), 0);
    assert_int_equal(stats(c).n_cached, 4);
    tp_check(c);

    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 16); /* the 4 FREE blocks */
    assert_int_equal(stats(c).evictions, 0);
    const int32_t want[4] = {tb[2], ta[2], ta[1], ta[0]};
    for (int i = 0; i < 4; i++) {
        tp_compute(c, w, 0, fill, 16 + 4 * (uint32_t)i, 4);
        assert_int_equal(table(c, w, tw), 5 + i);
        assert_int_equal(tw[4 + i], want[i]);
        assert_int_equal(stats(c).evictions, (uint64_t)i + 1);
        tp_check(c);
    }
    /* nothing left to evict, nothing FREE (w is at max_blocks_per_seq: ask with another) */
    pkv_seq e = tp_seq(c, 0);
    assert_int_equal(pkv_seq_append(c, e, fill, 1, NULL), PKV_ENOSPC);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* The block a new one-block sequence of fill's first 4 tokens takes (B = 4), computed and kept. */
static int32_t block_taken(pkv_cache *c, const int32_t *fill) {
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 4);
    int32_t t[1];
    assert_int_equal(table(c, w, t), 1);
    return t[0];
}

/* A front dropped a block a step (a window of one block: pkv_seq_drop_front after each step)
 * waits in the inner queue above the block still in use: eviction takes the LRU queue's leaves
 * first (a finished request's chain), then the dropped front from its deepest block up, whose
 * subtree (the block in use) leaves the index; the front's shallow part stays matchable, with
 * the K/V it had. One LRU queue took the front's first block first, and with it everything
 * (stop 84's review). */
static void test_prefix_evict_dropped_front(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 16, 1, PKV_DTYPE_F16, 1);
    pkv__cache_test_tombs(c, 0); /* no tombstone to leave: the subtree goes (test_prefix_evict_tombstone) */
    int32_t p[41], fill[28], other[8];
    tp_tokens(p, 41, 41);
    tp_tokens(fill, 28, 42);
    tp_tokens(other, 8, 43);
    pkv_seq o = tp_prompt(c, 0, other, 8);
    int32_t to[2], ts[10], tw[7];
    table(c, o, to);
    assert_int_equal(pkv_seq_release(c, o), 0); /* 2 CACHED leaves */
    pkv_seq s = tp_prompt(c, 0, p, 12);
    for (uint32_t len = 12; len < 40; len++) {
        tp_compute(c, s, 0, p, len, 1);
        tp_commit(c, s, len + 1);
        int32_t now[10]; /* s's ids, kept before each drop (dropped entries read -1) */
        assert_true(table(c, s, now) <= 10);
        for (uint32_t i = 0; i * 4 < len + 1; i++)
            if (now[i] >= 0) ts[i] = now[i];
        assert_int_equal(pkv_seq_drop_front(c, s, len + 2 - 4), 0); /* the next query sees from len + 2 - 4 */
        tp_check(c);
    }
    pkv_stats st = stats(c);
    assert_int_equal(st.n_cached, 2 + 9); /* o's, and s's blocks 0-8 (inner: s holds block 9) */
    assert_int_equal(st.n_active, 1);
    assert_int_equal(st.n_indexed, 12);
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 16); /* the 4 FREE blocks */
    assert_int_equal(stats(c).evictions, 0);
    tp_compute(c, w, 0, fill, 16, 8); /* o's two, leaf first */
    assert_int_equal(table(c, w, tw), 6);
    assert_true(tw[4] == to[1] && tw[5] == to[0]);
    assert_int_equal(stats(c).evictions, 2);
    tp_check(c);
    tp_compute(c, w, 0, fill, 24, 4); /* s's block 8, the deepest dropped; block 9 leaves the index */
    assert_int_equal(table(c, w, tw), 7);
    assert_int_equal(tw[6], ts[8]);
    st = stats(c);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.n_indexed, 8);
    assert_int_equal(st.n_cached, 8);
    tp_check(c);
    /* the next eviction takes block 7, now an LRU leaf (the front joined the LRU queue deepest
       first once nothing in use hung below it) */
    assert_int_equal(block_taken(c, fill), ts[7]);
    assert_int_equal(stats(c).n_indexed, 7);
    tp_check(c);
    /* s's first 28 positions still match, with their K/V; s indexes nothing more */
    assert_int_equal(pkv_seq_release(c, tp_match(c, 0, p, 41, 28)), 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* An inner block evicted with a CACHED block below it: s holds blocks f, a, g, h (committed); a
 * fork F keeps only a (truncated to two blocks, its front dropped past f); s drops f, then f, a
 * and g: f waits above a (F's), g above h (s's). With nothing in the LRU queue, eviction takes
 * the inner queue's head, f (its child a is in use, not waiting), and f's subtree goes: a (F's)
 * and h (s's) leave the index, g, CACHED below a, goes FREE with them (one append, two
 * evictions: the walk's CACHED descendant), and the checker passes (both sequences' chains
 * clamped at their fronts); their K/V stays. */
static void test_prefix_evict_inner_subtree(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 8, 1, PKV_DTYPE_F16, 1);
    pkv__cache_test_tombs(c, 0); /* every tombstone taken, as it were: the subtree goes */
    int32_t p[16], fill[16];
    tp_tokens(p, 16, 51);
    tp_tokens(fill, 16, 52);
    pkv_seq s = tp_prompt(c, 0, p, 16);
    int32_t ts[4];
    assert_int_equal(table(c, s, ts), 4); /* f, a, g, h */
    pkv_seq f2;
    assert_int_equal(pkv_seq_fork(c, s, &f2), 0);
    assert_int_equal(pkv_seq_truncate(c, f2, 8), 0);
    assert_int_equal(pkv_seq_drop_front(c, f2, 4), 0);
    assert_int_equal(pkv_seq_drop_front(c, s, 4), 0); /* f: nobody's, a in use below it */
    tp_check(c);
    assert_int_equal(pkv_seq_drop_front(c, s, 12), 0); /* a stays F's; g waits above h */
    tp_check(c);
    pkv_stats st = stats(c);
    assert_int_equal(st.n_cached, 2);
    assert_int_equal(st.n_active, 2);
    assert_int_equal(st.n_indexed, 4);
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 16); /* the 4 FREE blocks */
    assert_int_equal(stats(c).evictions, 0);
    assert_int_equal(block_taken(c, fill), ts[0]); /* f; g goes FREE with it */
    st = stats(c);
    assert_int_equal(st.evictions, 2);
    assert_int_equal(st.n_indexed, 0);
    assert_int_equal(st.n_cached, 0);
    assert_int_equal(st.n_free, 1);
    tp_check(c);
    tp_expect_kv(c, s, 0, p, 12, 4);
    tp_expect_kv(c, f2, 0, p, 4, 4);
    /* s's front stays where s put it */
    pkv_seq_info in;
    assert_int_equal(pkv_seq_get_info(c, s, &in), 0);
    assert_int_equal(in.n_dropped, 12);
    pkv_cache_destroy(c);
}

/* The inner_subtree scene (s: f, a, g, h; a fork F keeps a; s drops f, then g waits above h) with
 * tombstones: evicting f leaves a tombstone in its place (one eviction, nothing else leaves the
 * index, g stays CACHED). A plain match stops at it; a windowed one goes past it and takes only
 * what its window sees; a prompt computed again fills it; once nothing is indexed below one, it
 * goes, with REMOVED said after its children's. */
/* The inner_subtree scene before any eviction, in a new cache of 8 blocks of 4: s holds f, a, g, h
 * (ts), a fork F keeps a, s drops f (above a: the inner queue's head) and g (above h). */
static pkv_cache *dropped_scene(const int32_t *p, int32_t ts[4], pkv_seq *s, pkv_seq *f2) {
    pkv_cache *c = tp_cache(4, 8, 1, PKV_DTYPE_F16, 1);
    *s = tp_prompt(c, 0, p, 16);
    assert_int_equal(table(c, *s, ts), 4); /* f, a, g, h */
    assert_int_equal(pkv_seq_fork(c, *s, f2), 0);
    assert_int_equal(pkv_seq_truncate(c, *f2, 8), 0);
    assert_int_equal(pkv_seq_drop_front(c, *f2, 4), 0);
    assert_int_equal(pkv_seq_drop_front(c, *s, 4), 0);  /* f above a (F's): the inner queue's head */
    assert_int_equal(pkv_seq_drop_front(c, *s, 12), 0); /* g above h */
    return c;
}

static pkv_cache *tomb_scene(const int32_t *p, int32_t ts[4], pkv_seq *s, pkv_seq *f2, pkv_seq *w) {
    pkv_cache *c = dropped_scene(p, ts, s, f2);
    *w = tp_seq(c, 0);
    int32_t more[20];
    tp_tokens(more, 20, 53);
    tp_compute(c, *w, 0, more, 0, 16); /* the 4 FREE blocks */
    assert_int_equal(stats(c).evictions, 0);
    tp_compute(c, *w, 0, more, 16, 4); /* f, the inner queue's head: a tombstone in its place */
    int32_t tw[5];
    assert_int_equal(table(c, *w, tw), 5);
    assert_int_equal(tw[4], ts[0]);
    return c;
}

/* A new sequence matched under window: reused and the front (positions) as expected. */
static pkv_seq window_match(pkv_cache *c, const int32_t *p, uint32_t n, uint32_t window, uint32_t want,
                            uint32_t want_front) {
    pkv_seq m = tp_seq(c, 0);
    uint32_t reused = 0xffffffffu;
    assert_int_equal(pkv_seq_match_prefix_window(c, m, p, n, window, &reused), 0);
    assert_int_equal(reused, want);
    pkv_seq_info in;
    assert_int_equal(pkv_seq_get_info(c, m, &in), 0);
    assert_int_equal(in.n_dropped, want_front);
    assert_int_equal(in.n_reused, want);
    return m;
}

static void test_prefix_evict_tombstone(void **state) {
    (void)state;
    int32_t p[17], ts[4], tm[4];
    tp_tokens(p, 17, 51);
    pkv_seq s, f2, w;
    pkv_cache *c = tomb_scene(p, ts, &s, &f2, &w);
    pkv_stats st = stats(c);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.n_tombstones, 1);
    assert_int_equal(st.n_indexed, 3); /* a, g, h */
    assert_int_equal(st.n_cached, 1);  /* g */
    assert_int_equal(st.n_free, 0);
    tp_check(c);
    /* a plain match stops at the tombstone: its K/V is gone */
    const uint64_t miss = st.prefix_miss_evicted;
    assert_int_equal(probe(c, 0, p, 16), 0);
    assert_int_equal(stats(c).prefix_miss_evicted, miss + 1);
    /* under a window of 5 a query at 15 sees 11..15: blocks 2 and 3 (g, h) are taken, the front
       ends at 8, and the tombstone (block 0) is passed */
    pkv_seq m = window_match(c, p, 16, 5, 15, 8);
    assert_int_equal(table(c, m, tm), 4);
    assert_true(tm[0] == -1 && tm[1] == -1 && tm[2] == ts[2] && tm[3] == ts[3]);
    tp_expect_kv(c, m, 0, p, 8, 7);
    st = stats(c);
    assert_int_equal(st.prefix_tomb_hits, 1);
    assert_int_equal(st.n_cached, 0); /* g taken back */
    tp_check(c);
    /* a window of 9 (from 7 on) needs a too: the front ends at 4 */
    pkv_seq m2 = window_match(c, p, 16, 9, 15, 4);
    assert_int_equal(table(c, m2, tm), 4);
    assert_true(tm[0] == -1 && tm[1] == ts[1] && tm[2] == ts[2] && tm[3] == ts[3]);
    tp_expect_kv(c, m2, 0, p, 4, 11);
    tp_check(c);
    /* a window of 13 (from 3 on) would need block 0: the match ends before the tombstone, at 0 */
    const uint64_t miss2 = stats(c).prefix_miss_evicted;
    pkv_seq m3 = window_match(c, p, 16, 13, 0, 0);
    assert_int_equal(stats(c).prefix_miss_evicted, miss2 + 1);
    pkv_seq_info in;
    assert_int_equal(pkv_seq_get_info(c, m3, &in), 0);
    assert_int_equal(in.n_blocks, 0);
    uint32_t reused = 0;
    assert_int_equal(stats(c).prefix_tomb_hits, 2);
    /* window 0 is pkv_seq_match_prefix's: refused here, nothing changed */
    pkv_stats before = stats(c);
    assert_int_equal(pkv_seq_match_prefix_window(c, m3, p, 16, 0, &reused), PKV_EINVAL);
    st = stats(c);
    assert_memory_equal(&before, &st, sizeof st);
    /* the prompt computed again (m3, from 0) fills the tombstone at commit: its block 0 takes the
       tombstone's place and children, and the whole chain matches again */
    assert_int_equal(pkv_seq_release(c, w), 0); /* (its blocks were never committed: FREE) */
    tp_compute(c, m3, 0, p, 0, 16);
    tp_commit(c, m3, 16);
    st = stats(c);
    assert_int_equal(st.n_tombstones, 0);
    assert_int_equal(st.n_indexed, 4);
    assert_int_equal(table(c, m3, tm), 4);
    tp_check(c);
    pkv_seq all = tp_match(c, 0, p, 17, 16);
    int32_t ta[4];
    assert_int_equal(table(c, all, ta), 4);
    assert_true(ta[0] == tm[0] && ta[1] == ts[1] && ta[2] == ts[2] && ta[3] == ts[3]);
    tp_expect_kv(c, all, 0, p, 0, 16);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A tombstone goes once nothing is indexed below it: its children evicted as LRU leaves, the
 * last one takes it (test_events_random_world checks the events' order over such worlds). */
static void test_prefix_evict_tombstone_pruned(void **state) {
    (void)state;
    int32_t p[17], ts[4];
    tp_tokens(p, 17, 51);
    pkv_seq s, f2, w;
    pkv_cache *c = tomb_scene(p, ts, &s, &f2, &w);
    assert_int_equal(stats(c).n_tombstones, 1);
    assert_int_equal(pkv_seq_release(c, s), 0);  /* h: CACHED, a leaf; g with it */
    assert_int_equal(pkv_seq_release(c, f2), 0); /* a: CACHED above g */
    assert_int_equal(pkv_seq_release(c, w), 0);  /* 5 FREE (never committed) */
    pkv_stats st = stats(c);
    assert_int_equal(st.n_cached, 3);
    assert_int_equal(st.n_free, 5);
    assert_int_equal(st.n_tombstones, 1);
    tp_check(c);
    /* 5 FREE blocks, then h, g and a as leaves, deepest first: the tombstone goes with a */
    pkv_seq x = tp_seq(c, 0);
    int32_t more[32];
    tp_tokens(more, 32, 54);
    tp_compute(c, x, 0, more, 0, 20);
    assert_int_equal(stats(c).evictions, 1); /* (f's, when the scene made the tombstone) */
    tp_compute(c, x, 0, more, 20, 8);
    st = stats(c);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.n_tombstones, 1); /* a is still below it */
    tp_check(c);
    tp_compute(c, x, 0, more, 28, 4);
    st = stats(c);
    assert_int_equal(st.evictions, 4);
    assert_int_equal(st.n_tombstones, 0);
    assert_int_equal(st.n_indexed, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A registered partial that filled up beside its indexed twin stays a partial (its commit stops
 * at the twin), found only by a match's token-granular scan. When the twin, waiting in the inner
 * queue, is evicted, the partial takes its place: no tombstone, the identity stays indexed with
 * its K/V and subtree, and a plain match goes on through it. Before (the fuzz case of stop 92), a
 * tombstone stood beside the full copy: a plain match stopped there and copied the block, whose
 * commit filled the tombstone, so the same match again found 3 blocks more. The tomb_scene
 * (s: f, a, g, h; a fork F keeps a; f waits above a, g above h), with such a partial of f. */
static void test_prefix_evict_hand_over(void **state) {
    (void)state;
    int32_t p[17], ts[4], tq[1], tw[4], tm[4], more[16];
    tp_tokens(p, 17, 51);
    tp_tokens(more, 16, 53);
    pkv_seq s, f2;
    pkv_cache *c = dropped_scene(p, ts, &s, &f2);
    pkv_seq q = tp_seq(c, 0); /* f's tokens computed again, one position first: a registered partial */
    tp_compute(c, q, 0, p, 0, 1);
    tp_commit(c, q, 1);
    tp_compute(c, q, 0, p, 1, 3);
    tp_commit(c, q, 4); /* full, but f is indexed: it stays a partial */
    assert_int_equal(table(c, q, tq), 1);
    pkv_stats st = stats(c);
    assert_int_equal(st.n_indexed, 4);
    assert_int_equal(st.n_cached, 2); /* f and g */
    assert_int_equal(st.n_free, 3);
    tp_check(c);
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, more, 0, 12); /* the 3 FREE blocks */
    assert_int_equal(stats(c).evictions, 0);
    tp_compute(c, w, 0, more, 12, 4); /* f, the inner queue's head: q's block takes its place */
    assert_int_equal(table(c, w, tw), 4);
    assert_int_equal(tw[3], ts[0]);
    st = stats(c);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.n_tombstones, 0);
    assert_int_equal(st.n_indexed, 4); /* q's block, a, g, h */
    assert_int_equal(st.n_cached, 1);  /* g */
    tp_check(c);
    /* the whole prompt matches plainly, through q's block, and the same again */
    for (int i = 0; i < 2; i++) {
        pkv_seq m = tp_match(c, 0, p, 17, 16);
        assert_int_equal(table(c, m, tm), 4);
        assert_true(tm[0] == tq[0] && tm[1] == ts[1] && tm[2] == ts[2] && tm[3] == ts[3]);
        tp_check(c);
        assert_int_equal(pkv_seq_release(c, m), 0);
    }
    /* q goes on over its chain, now the index's: its second block's twin is a (indexed: the
       commit stops there); the block it takes is g's (a tombstone stays: h is below it) */
    tp_compute(c, q, 0, p, 4, 4);
    tp_commit(c, q, 8);
    tp_check(c);
    st = stats(c);
    assert_int_equal(st.n_indexed, 3); /* q's first block, a, h */
    assert_int_equal(st.n_tombstones, 1);
    assert_int_equal(st.evictions, 2);
    pkv_cache_destroy(c);
}

/* A windowed match whose token-granular copy is a whole block moves its front on by one block
 * (past the last block it found): the copy is indexed first, under the block it follows, so the
 * chain goes on from it. Before (the CI fuzz case after stop 92), the copy stayed out of the index
 * once the front passed its parent: the same match again, with no block free to copy into, found
 * one block where the first had found two. The copy's source is a registered partial that filled
 * up beside its indexed twin (y2), found only by the token-granular scan once that twin (y1), a
 * leaf, is evicted. */
static void test_prefix_window_full_copy(void **state) {
    (void)state;
    int32_t p[9], more[24], tq[2], tm[2], t1[2], t2[2];
    tp_tokens(p, 9, 61);
    tp_tokens(more, 24, 62);
    pkv_cache *c = tp_cache(4, 8, 1, PKV_DTYPE_F16, 1);
    pkv_seq s1 = tp_prompt(c, 0, p, 6); /* x, y1 (a partial of 2) */
    pkv_seq s2 = tp_match(c, 0, p, 7, 6); /* x, y2: a copy of y1's 2, registered */
    tp_compute(c, s1, 0, p, 6, 2);
    tp_commit(c, s1, 8); /* y1 full: indexed */
    tp_compute(c, s2, 0, p, 6, 2);
    tp_commit(c, s2, 8); /* y2 full beside its indexed twin: stays a partial */
    assert_int_equal(table(c, s1, t1), 2);
    assert_int_equal(table(c, s2, t2), 2);
    assert_true(t1[0] == t2[0] && t1[1] != t2[1]);
    assert_int_equal(pkv_seq_release(c, s1), 0); /* y1: CACHED, a leaf */
    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, more, 0, 24); /* the 5 FREE blocks, then y1 */
    pkv_stats st = stats(c);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.n_free, 0);
    assert_int_equal(pkv_seq_truncate(c, w, 20), 0); /* one block FREE */
    assert_int_equal(stats(c).n_free, 1);
    tp_check(c);
    /* under a window of 2: x found, y1 gone, y2's 4 positions copied into the FREE block; the
       front (4) passes x, which s2 keeps */
    pkv_seq q = window_match(c, p, 9, 2, 8, 4);
    assert_int_equal(table(c, q, tq), 2);
    assert_true(tq[0] == -1 && tq[1] != t2[1]);
    tp_expect_kv(c, q, 0, p, 4, 4);
    st = stats(c);
    assert_int_equal(st.n_free + st.n_cached, 0);
    tp_check(c);
    /* the same match again takes the copy, with no block free */
    for (int i = 0; i < 2; i++) {
        pkv_seq m = window_match(c, p, 9, 2, 8, 4);
        assert_int_equal(table(c, m, tm), 2);
        assert_true(tm[0] == -1 && tm[1] == tq[1]);
        tp_expect_kv(c, m, 0, p, 4, 4);
        tp_check(c);
        assert_int_equal(pkv_seq_release(c, m), 0);
    }
    /* and so does a plain match, through x */
    pkv_seq all = tp_match(c, 0, p, 9, 8);
    assert_int_equal(table(c, all, tm), 2);
    assert_true(tm[0] == t2[0] && tm[1] == tq[1]);
    tp_expect_kv(c, all, 0, p, 0, 8);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A pinned prefix survives any pressure, counts as ACTIVE, is reusable; unpinned, it is
 * CACHED and evictable. */
static void test_prefix_pin_survives_pressure(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 10, 1, PKV_DTYPE_F16, 1);
    int32_t p[13], fill[48];
    tp_tokens(p, 13, 41);
    tp_tokens(fill, 48, 42);
    pkv_seq a = tp_seq(c, 0);
    tp_compute(c, a, 0, p, 0, 12);
    tp_commit(c, a, 12);
    int32_t ta[3], tw[12];
    table(c, a, ta);
    pkv_seq pin;
    assert_int_equal(pkv_pin_create(c, a, 12, &pin), 0);
    assert_int_not_equal(pin, 0);
    assert_int_equal(pkv_seq_release(c, a), 0);
    pkv_stats st = stats(c);
    assert_int_equal(st.n_pins, 1);
    assert_int_equal(st.n_seqs, 0);
    assert_int_equal(st.n_active, 3); /* pinned blocks count as in use */
    assert_int_equal(st.n_cached, 0);
    assert_int_equal(st.n_free, 7);
    tp_check(c);

    pkv_seq w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 28); /* every FREE block */
    assert_int_equal(pkv_seq_append(c, w, fill + 28, 1, NULL), PKV_ENOSPC);
    assert_int_equal(stats(c).evictions, 0);
    assert_int_equal(table(c, w, tw), 7);
    for (int i = 0; i < 7; i++)
        for (int j = 0; j < 3; j++) assert_int_not_equal(tw[i], ta[j]);
    tp_check(c);
    assert_int_equal(pkv_seq_release(c, w), 0);

    pkv_seq b = tp_seq(c, 0);
    uint32_t reused = 0;
    assert_int_equal(pkv_seq_match_prefix(c, b, p, 13, &reused), 0);
    assert_int_equal(reused, 12);
    tp_expect_kv(c, b, 0, p, 0, 12);
    assert_int_equal(pkv_seq_release(c, b), 0);

    /* unpinned: CACHED, and all of the pool can be had again */
    assert_int_equal(pkv_pin_release(c, pin), 0);
    assert_int_equal(pkv_pin_release(c, pin), PKV_ENOENT);
    st = stats(c);
    assert_int_equal(st.n_pins, 0);
    assert_int_equal(st.n_active, 0);
    assert_int_equal(st.n_cached, 3);
    tp_check(c);
    w = tp_seq(c, 0);
    tp_compute(c, w, 0, fill, 0, 40);
    assert_int_equal(stats(c).evictions, 3);
    assert_int_equal(stats(c).n_indexed, 0);
    assert_int_equal(pkv_seq_release(c, w), 0);
    assert_int_equal(probe(c, 0, p, 13), 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* Pin of a partial range holds floor(min(n_pos, committed) / B) blocks, survives truncation
 * of its sequence, is not a sequence, and counts against max_seqs. */
static void test_prefix_pin_rules(void **state) {
    (void)state;
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1;
    cfg.n_kv_heads = TP_H;
    cfg.head_dim = TP_D;
    cfg.block_tokens = 4;
    cfg.n_blocks = 8;
    cfg.max_seqs = 3;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), 0);
    int32_t p[16];
    tp_tokens(p, 16, 51);
    pkv_seq a = tp_seq(c, 0);
    tp_compute(c, a, 0, p, 0, 16);
    tp_commit(c, a, 14); /* 3 full committed blocks */
    pkv_seq pin;
    assert_int_equal(pkv_pin_create(c, a, 11, &pin), 0); /* floor(11 / 4) = 2 blocks */
    assert_int_equal(pkv_seq_truncate(c, a, 0), 0);
    pkv_stats st = stats(c);
    assert_int_equal(st.n_active, 2);
    assert_int_equal(st.n_cached, 1); /* the third committed block */
    assert_int_equal(st.n_pins, 1);
    tp_check(c);
    /* a pin is not a sequence, a sequence not a pin */
    pkv_seq_info info;
    int32_t t = 1;
    assert_int_equal(pkv_seq_get_info(c, pin, &info), PKV_EINVAL);
    assert_int_equal(pkv_seq_append(c, pin, &t, 1, NULL), PKV_EINVAL);
    assert_int_equal(pkv_seq_release(c, pin), PKV_EINVAL);
    pkv_seq f;
    assert_int_equal(pkv_seq_fork(c, pin, &f), PKV_EINVAL);
    assert_int_equal(pkv_pin_release(c, a), PKV_EINVAL);
    /* max_seqs = 3: a, the pin and one more */
    pkv_seq b = tp_seq(c, 0), d;
    assert_int_equal(pkv_seq_create(c, NULL, 0, &d), PKV_ELIMIT);
    pkv_seq pin2;
    assert_int_equal(pkv_pin_create(c, b, 0, &pin2), PKV_ELIMIT);
    assert_int_equal(pkv_seq_release(c, b), 0);
    assert_int_equal(pkv_pin_create(c, a, 0, &pin2), 0); /* an empty pin is valid */
    assert_int_equal(stats(c).n_pins, 2);
    assert_int_equal(pkv_pin_release(c, pin2), 0);
    /* stale */
    assert_int_equal(pkv_pin_create(c, b, 4, &pin2), PKV_ENOENT);
    /* the pinned 8 tokens are reusable, the unpinned third block too while not evicted */
    assert_int_equal(probe(c, 0, p, 13), 12);
    assert_int_equal(pkv_pin_release(c, pin), 0);
    assert_int_equal(pkv_seq_release(c, a), 0);
    st = stats(c);
    assert_int_equal(st.n_active, 0);
    assert_int_equal(st.n_cached, 3);
    tp_check(c);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_cached_after_release),
        cmocka_unit_test(test_prefix_evict_lru_order),
        cmocka_unit_test(test_prefix_evict_match_refreshes),
        cmocka_unit_test(test_prefix_evict_leaves_before_parents),
        cmocka_unit_test(test_prefix_evict_dropped_front),
        cmocka_unit_test(test_prefix_evict_inner_subtree),
        cmocka_unit_test(test_prefix_evict_tombstone),
        cmocka_unit_test(test_prefix_evict_tombstone_pruned),
        cmocka_unit_test(test_prefix_evict_hand_over),
        cmocka_unit_test(test_prefix_window_full_copy),
        cmocka_unit_test(test_prefix_pin_survives_pressure),
        cmocka_unit_test(test_prefix_pin_rules),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
