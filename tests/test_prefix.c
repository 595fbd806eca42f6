/* test_prefix.c: automatic prefix caching, scripted: exact and token-granular reuse with K/V
 * compared against the sequence that computed it, tenant isolation (salts), forced hash
 * collisions, uncommitted / indexed / truncated blocks, the disabled cache, miss reasons.
 * Eviction order and pins live in test_prefix_evict.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "../fuzz/prefix_model.h" /* pm_val / pm_next / pm_root: K/V as a function of the prefix */
#include "test_prefix_util.h"

#include <sys/mman.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* Test-only switch of src/cache: every identity hash becomes the same value. */
void pkv__cache_test_const_hash(pkv_cache *c, int on);

/* ---- same 100-token prompt, B = 16 ------------------------------------------------------------ */

/* The first sequence is released before the second matches: its partial tail block went FREE,
 * so only the 6 full blocks (96 tokens) can be reused. */
static void test_prefix_same_prompt_full_blocks_only(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 3, PKV_DTYPE_F16, 1);
    int32_t p[100];
    tp_tokens(p, 100, 7);
    pkv_seq a = tp_prompt(c, 0, p, 100);
    tp_expect_kv(c, a, 0, p, 0, 100); /* the oracle itself holds for the computing sequence */
    int32_t ta[8];
    assert_int_equal(tp_table(c, a, ta, 8), 7);
    assert_int_equal(pkv_seq_release(c, a), 0);
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.n_cached, 6); /* the 6 indexed full blocks; the tail went FREE */
    assert_int_equal(st.n_indexed, 6);
    tp_check(c);

    pkv_seq b = tp_match(c, 0, p, 100, 96); /* K/V == what a computed over [0, 96), every layer */
    tp_check(c);
    int32_t tb[8];
    assert_int_equal(tp_table(c, b, tb, 8), 6);
    for (int i = 0; i < 6; i++) assert_int_equal(tb[i], ta[i]); /* the very same blocks */
    tp_expect_info(c, b, 96, 96);
    st = tp_stats(c);
    assert_int_equal(st.n_cached, 0);
    assert_int_equal(st.prefix_tokens_hit, 96);
    /* the engine computes the rest; the whole sequence then holds the oracle's K/V */
    tp_compute(c, b, 0, p, 96, 4);
    tp_commit(c, b, 100);
    tp_expect_kv(c, b, 0, p, 0, 100);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* The first sequence stays alive: its committed partial tail (4 tokens) is matchable, so the
 * second reuses 99 tokens (the last prompt token must be computed); K/V equal over [0, 99). */
static void test_prefix_same_prompt_token_granular(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 3, PKV_DTYPE_F16, 1);
    int32_t p[100];
    tp_tokens(p, 100, 7);
    pkv_seq a = tp_prompt(c, 0, p, 100);
    pkv_stats before = tp_stats(c);

    pkv_seq b = tp_match(c, 0, p, 100, 99);
    tp_check(c);
    tp_expect_info(c, b, 99, 99);
    tp_expect_same(c, a, b, 0, 99); /* every layer, K and V, against the first sequence */
    int32_t ta[8], tb[8];
    assert_int_equal(tp_table(c, a, ta, 8), 7);
    assert_int_equal(tp_table(c, b, tb, 8), 7);
    for (int i = 0; i < 6; i++) assert_int_equal(tb[i], ta[i]);
    assert_int_not_equal(tb[6], ta[6]); /* the 3 tail tokens were copied into a fresh block */
    pkv_stats after = tp_stats(c);
    assert_int_equal(after.prefix_tokens_hit - before.prefix_tokens_hit, 99);
    assert_int_equal(after.prefix_lookups - before.prefix_lookups, 1);
    assert_int_equal(after.prefix_tokens_queried - before.prefix_tokens_queried, 100);
    assert_int_equal(after.n_active - before.n_active, 1);

    /* computing the last token writes into b's own copy; a is untouched */
    tp_compute(c, b, 0, p, 99, 1);
    tp_commit(c, b, 100);
    tp_expect_kv(c, b, 0, p, 0, 100);
    tp_expect_kv(c, a, 0, p, 0, 100);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* The prompt diverges inside block 2 (position 40): blocks 0-1 are attached, and the 8 matching
 * leading tokens of the indexed block 2 are copied. Divergence inside block 0 (position 5): the
 * 5 leading tokens of the indexed root are copied (found on its root list). */
static void test_prefix_diverge_inside_block(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 2, PKV_DTYPE_F32, 1);
    int32_t p[64], q[64];
    tp_tokens(p, 64, 3);
    pkv_seq a = tp_prompt(c, 1, p, 64);

    memcpy(q, p, sizeof q);
    q[40] = 5000;
    pkv_seq b = tp_match(c, 1, q, 64, 40);
    tp_check(c);
    int32_t ta[4], tb[4];
    tp_table(c, a, ta, 4);
    assert_int_equal(tp_table(c, b, tb, 4), 3);
    assert_int_equal(tb[0], ta[0]);
    assert_int_equal(tb[1], ta[1]);
    assert_int_not_equal(tb[2], ta[2]);
    tp_expect_same(c, a, b, 0, 40);
    tp_compute(c, b, 1, q, 40, 24);
    tp_commit(c, b, 64);
    tp_expect_kv(c, b, 1, q, 0, 64);
    tp_expect_kv(c, a, 1, p, 0, 64);

    memcpy(q, p, sizeof q);
    q[5] = 5000;
    pkv_seq d = tp_match(c, 1, q, 64, 5);
    tp_expect_info(c, d, 5, 5);
    int32_t td[4];
    assert_int_equal(tp_table(c, d, td, 4), 1);
    assert_int_not_equal(td[0], ta[0]); /* a copy: d's block 0 is its own */
    tp_expect_same(c, a, d, 0, 5);
    tp_check(c);
    /* d computes its own tokens from position 5 on; a's root is untouched */
    tp_compute(c, d, 1, q, 5, 59);
    tp_commit(c, d, 64);
    tp_expect_kv(c, d, 1, q, 0, 64);
    tp_expect_kv(c, a, 1, p, 0, 64);
    /* the same divergence in another namespace reuses nothing */
    (void)tp_match(c, 2, q, 64, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A full match reaching the whole prompt attaches every block but reuses n - 1 tokens; the
 * first append then copy-on-writes the indexed tail block, leaving the original untouched. */
static void test_prefix_full_match_then_cow(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 32, 2, PKV_DTYPE_F16, 1);
    int32_t p[48];
    tp_tokens(p, 48, 11);
    pkv_seq a = tp_prompt(c, 0, p, 48);
    pkv_seq b = tp_match(c, 0, p, 48, 47);
    tp_expect_info(c, b, 47, 47);
    int32_t ta[3], tb[3];
    tp_table(c, a, ta, 3);
    assert_int_equal(tp_table(c, b, tb, 3), 3);
    for (int i = 0; i < 3; i++) assert_int_equal(tb[i], ta[i]);
    pkv_seq_info info;
    assert_int_equal(pkv_seq_get_info(c, b, &info), 0);
    assert_int_equal(info.n_shared, 3);
    pkv_stats before = tp_stats(c);
    tp_compute(c, b, 0, p, 47, 1);
    pkv_stats after = tp_stats(c);
    assert_int_equal(after.cow_copies - before.cow_copies, 1);
    assert_int_equal(tp_table(c, b, tb, 3), 3);
    assert_int_not_equal(tb[2], ta[2]);
    tp_expect_kv(c, b, 0, p, 0, 48);
    tp_expect_kv(c, a, 0, p, 0, 48);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* B = 1: a full match of the whole prompt reuses n - 1 tokens in n - 1 blocks; the block of the
 * last prompt token holds no kept position and is not attached. */
static void test_prefix_b1_full_match(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(1, 32, 2, PKV_DTYPE_F16, 1);
    int32_t p[10];
    tp_tokens(p, 10, 17);
    pkv_seq a = tp_prompt(c, 0, p, 10);
    pkv_seq b = tp_match(c, 0, p, 10, 9);
    pkv_seq_info info;
    assert_int_equal(pkv_seq_get_info(c, b, &info), 0);
    assert_int_equal(info.n_tokens, 9);
    assert_int_equal(info.n_blocks, 9);
    tp_check(c);
    tp_expect_same(c, a, b, 0, 9);
    tp_compute(c, b, 0, p, 9, 1);
    tp_expect_kv(c, b, 0, p, 0, 10);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* Two sequences compute the same prompt without matching: the index keeps one copy of each
 * block (the later twin stays unindexed and goes FREE on release); a match finds the first. */
static void test_prefix_twin_indexed_once(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 32, 1, PKV_DTYPE_F16, 1);
    int32_t p[49];
    tp_tokens(p, 49, 19);
    pkv_seq a = tp_prompt(c, 0, p, 48), b = tp_prompt(c, 0, p, 48);
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.n_indexed, 3);
    int32_t ta[3], tb[3], tm[3];
    tp_table(c, a, ta, 3);
    tp_table(c, b, tb, 3);
    for (int i = 0; i < 3; i++) assert_int_not_equal(tb[i], ta[i]); /* b computed its own */
    assert_int_equal(pkv_seq_release(c, a), 0);
    assert_int_equal(pkv_seq_release(c, b), 0);
    st = tp_stats(c);
    assert_int_equal(st.n_cached, 3);
    assert_int_equal(st.n_free, 29);
    tp_check(c);
    pkv_seq d = tp_match(c, 0, p, 49, 48);
    assert_int_equal(tp_table(c, d, tm, 3), 3);
    assert_memory_equal(tm, ta, sizeof ta);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* ---- namespaces --------------------------------------------------------------------------- */

static void test_prefix_salt_isolation(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(8, 64, 1, PKV_DTYPE_F32, 1);
    int32_t p[41];
    tp_tokens(p, 41, 21);
    pkv_seq a = tp_prompt(c, 1, p, 40); /* "tenant-a" */
    (void)tp_match(c, 2, p, 41, 0);     /* "tenant-b": same tokens, other tenant */
    (void)tp_match(c, 0, p, 41, 0);     /* no salt */
    (void)tp_match(c, 3, p, 41, 0);     /* "tenant-a\0x": a salt is bytes, not a C string */
    pkv_seq a2 = tp_match(c, 1, p, 41, 40);
    tp_expect_same(c, a, a2, 0, 40);

    /* a salt of length 0 is the empty namespace, whatever the pointer */
    pkv_seq e1, e2;
    assert_int_equal(pkv_seq_create(c, NULL, 0, &e1), 0);
    tp_compute(c, e1, 0, p, 0, 16);
    tp_commit(c, e1, 16);
    assert_int_equal(pkv_seq_create(c, "ignored", 0, &e2), 0);
    uint32_t reused = 1;
    assert_int_equal(pkv_seq_match_prefix(c, e2, p, 17, &reused), 0);
    assert_int_equal(reused, 16);

    /* a fork inherits the salt: its newly committed blocks are tenant-a's */
    pkv_seq f;
    assert_int_equal(pkv_seq_fork(c, a2, &f), 0);
    int32_t longer[65];
    memcpy(longer, p, 40 * sizeof(int32_t));
    tp_tokens(longer + 40, 25, 22);
    tp_compute(c, f, 1, longer, 40, 24);
    tp_commit(c, f, 64);
    (void)tp_match(c, 1, longer, 65, 64);
    (void)tp_match(c, 2, longer, 65, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* Blocks exchanged by compaction (exchange_blocks) where every indexed block shares one hash
 * chain: a batch's indexed entries and the CACHED blocks of two released prompts interleaved,
 * laid out with PKV_BATCH_CACHED, then the same pool again through pkv_seq_compact with
 * PKV_COMPACT_CACHED. The chain's links, bucket head and tree stay sound (the checker), the
 * sequences keep their K/V, and the released prompts are still found whole, with theirs. */
static void test_prefix_exchange_one_chain(void **state) {
    (void)state;
    for (int batch = 1; batch >= 0; batch--) {
        pkv_cache *c = tp_cache(4, 12, 2, PKV_DTYPE_F32, 1);
        pkv__cache_test_const_hash(c, 1);
        int32_t ta[12], tb[12], t1[9], t2[9];
        tp_tokens(ta, 12, 41), tp_tokens(tb, 12, 42), tp_tokens(t1, 9, 43), tp_tokens(t2, 9, 44);
        pkv_seq a = tp_seq(c, 1), b = tp_seq(c, 1), r1 = tp_seq(c, 1), r2 = tp_seq(c, 1);
        /* ids in turn: a 0, r1 1, b 2, r1 3, a 4, r2 5, b 6, r2 7, a 8, b 9; 10, 11 FREE */
        tp_compute(c, a, 1, ta, 0, 4), tp_compute(c, r1, 1, t1, 0, 4), tp_compute(c, b, 1, tb, 0, 4);
        tp_compute(c, r1, 1, t1, 4, 4), tp_compute(c, a, 1, ta, 4, 4), tp_compute(c, r2, 1, t2, 0, 4);
        tp_compute(c, b, 1, tb, 4, 4), tp_compute(c, r2, 1, t2, 4, 4), tp_compute(c, a, 1, ta, 8, 4);
        tp_compute(c, b, 1, tb, 8, 4);
        tp_commit(c, a, 12), tp_commit(c, b, 12), tp_commit(c, r1, 8), tp_commit(c, r2, 8);
        assert_int_equal(pkv_seq_release(c, r1), 0);
        assert_int_equal(pkv_seq_release(c, r2), 0);
        pkv_stats st0, st1;
        assert_int_equal(pkv_cache_get_stats(c, &st0), 0);
        assert_int_equal(st0.n_cached, 4);
        assert_int_equal(st0.n_indexed, 10);
        uint32_t moved = 0;
        if (batch) {
            const pkv_seq ab[2] = {a, b};
            assert_int_equal(pkv_batch_compact(c, ab, 2, 0, PKV_BATCH_CACHED, &moved), 0);
        } else {
            uint32_t m = 0;
            assert_int_equal(pkv_seq_compact(c, a, PKV_COMPACT_CACHED, &m), 0);
            moved += m;
            assert_int_equal(pkv_seq_compact(c, b, PKV_COMPACT_CACHED, &m), 0);
            moved += m;
        }
        /* the batch lays a out as one run; pkv_seq_compact moves a's 4 to 1 (a's 8 cannot follow:
           2 is b's), then b's 6 to 3 and 9 to 4, all into CACHED ids */
        int32_t tab[3];
        assert_int_equal(tp_table(c, batch ? a : b, tab, 3), 3);
        assert_true(tab[1] == tab[0] + 1 && tab[2] == tab[1] + 1);
        assert_int_equal(moved, batch ? 10 : 6);
        assert_int_equal(pkv_cache_get_stats(c, &st1), 0);
        assert_int_equal(memcmp(&st0, &st1, sizeof st0), 0); /* nothing evicted, no count moved */
        tp_check(c);
        tp_expect_kv(c, a, 1, ta, 0, 12);
        tp_expect_kv(c, b, 1, tb, 0, 12);
        const int32_t *prompts[2] = {t1, t2};
        for (int i = 0; i < 2; i++) {
            (void)tp_match(c, 1, prompts[i], 9, 8);
            /* and their roots still on the root list (all on one under the test switch): a
               prompt that leaves each inside block 0 reuses its 2 leading tokens */
            int32_t q[9];
            memcpy(q, prompts[i], sizeof q);
            q[2] = -5;
            pkv_seq m2 = tp_match(c, 1, q, 9, 2);
            tp_check(c);
            assert_int_equal(pkv_seq_release(c, m2), 0);
        }
        tp_check(c);
        pkv_cache_destroy(c);
    }
}

/* Every identity hash made equal: lookups must still compare namespace, parent and tokens. */
static void test_prefix_forced_hash_collision(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 2, PKV_DTYPE_F32, 1);
    pkv__cache_test_const_hash(c, 1);
    int32_t p[49], q[49];
    tp_tokens(p, 49, 31);
    pkv_seq a = tp_prompt(c, 1, p, 48);
    /* a second chain in the same (single) hash bucket, sharing nothing */
    int32_t o[49];
    tp_tokens(o, 49, 32);
    (void)tp_prompt(c, 1, o, 48);
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.n_indexed, 6);
    tp_check(c);

    /* differs at position 20 (block 1): block 0 attached, 4 tokens of block 1 copied */
    memcpy(q, p, sizeof q);
    q[20] = 7777;
    pkv_seq b = tp_match(c, 1, q, 49, 20);
    tp_expect_same(c, a, b, 0, 20);
    int32_t ta[3], tb[3];
    tp_table(c, a, ta, 3);
    assert_int_equal(tp_table(c, b, tb, 3), 2);
    assert_int_equal(tb[0], ta[0]);
    assert_int_not_equal(tb[1], ta[1]);
    /* differs in the last token of block 0: its 15 leading tokens, from the one root of the two
       (on the one root list) that shares them */
    memcpy(q, p, sizeof q);
    q[15] = 7777;
    tp_expect_same(c, a, tp_match(c, 1, q, 49, 15), 0, 15);
    /* block 1 of the other chain under block 0 of this one: parent must match too */
    memcpy(q, p, sizeof q);
    memcpy(q + 16, o + 16, 16 * sizeof(int32_t));
    tp_expect_same(c, a, tp_match(c, 1, q, 49, 16), 0, 16);
    /* other namespace, identical tokens: nothing */
    (void)tp_match(c, 2, p, 49, 0);
    /* the real thing still hits */
    (void)tp_match(c, 1, p, 49, 48);
    (void)tp_match(c, 1, o, 49, 48);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* Token-granular matching inside block 0: a prompt sharing less than one block with the index
 * reuses the committed leading tokens of a root of its namespace, an indexed one or the partial
 * first block of a running sequence, and no more than is committed. */
static void test_prefix_root_partial(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 16, 2, PKV_DTYPE_F16, 1);
    int32_t p[16], q[16], r[16];
    tp_tokens(p, 16, 61);
    pkv_seq a = tp_seq(c, 1);
    tp_compute(c, a, 1, p, 0, 10);
    /* nothing committed yet: nothing to reuse */
    assert_int_equal(pkv_seq_release(c, tp_match(c, 1, p, 12, 0)), 0);
    /* 6 committed: a prompt sharing 8 tokens reuses those 6, in a block of its own */
    tp_commit(c, a, 6);
    memcpy(q, p, sizeof q);
    q[8] = -1;
    pkv_seq b = tp_match(c, 1, q, 12, 6);
    tp_expect_info(c, b, 6, 6);
    int32_t ta[1], tb[1];
    tp_table(c, a, ta, 1);
    assert_int_equal(tp_table(c, b, tb, 1), 1);
    assert_int_not_equal(ta[0], tb[0]);
    tp_check(c);
    /* all 10 committed: a 12-token prompt sharing them reuses 10; a 2-token one its first;
       another namespace sees none of it */
    tp_commit(c, a, 10);
    memcpy(q, p, sizeof q);
    q[10] = -2;
    pkv_seq d = tp_match(c, 1, q, 12, 10), e = tp_match(c, 1, p, 2, 1), f = tp_match(c, 2, q, 12, 0);
    tp_check(c);
    /* a truncated to nothing leaves the root list; d's copy (10 tokens) is found instead */
    assert_int_equal(pkv_seq_truncate(c, a, 0), 0);
    tp_check(c);
    pkv_seq g = tp_match(c, 1, p, 16, 10);
    /* d computes on to a full indexed root; a prompt leaving it at position 13 reuses 13 */
    tp_compute(c, d, 1, q, 10, 6);
    tp_commit(c, d, 16);
    assert_int_equal(pkv_seq_release(c, d), 0); /* d's root: CACHED, still on its list */
    assert_int_equal(tp_stats(c).n_cached, 1);
    memcpy(r, q, sizeof r);
    r[13] = -3;
    pkv_seq h = tp_match(c, 1, r, 16, 13);
    tp_check(c);
    /* every sequence gone: only the indexed root is left to match */
    const pkv_seq all[] = {a, b, e, f, g, h};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) assert_int_equal(pkv_seq_release(c, all[i]), 0);
    tp_check(c);
    (void)tp_match(c, 1, p, 16, 10);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* The best source of a token-granular copy is a CACHED root, the last block that can be had: a
 * copy cannot take it and copy it too, so the best source in use (a running sequence's partial
 * root) gives its shorter prefix instead; the copy's block is the evicted CACHED one. */
static void test_prefix_root_partial_pool_full(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 3, 1, PKV_DTYPE_F32, 1);
    const int32_t cached[4] = {2, 1, 1, 9}, running[3] = {2, 3, 3}, other[4] = {7, 7, 7, 7}, q[4] = {2, 1, 2, 1};
    assert_int_equal(pkv_seq_release(c, tp_prompt(c, 0, cached, 4)), 0);
    pkv_seq y = tp_prompt(c, 0, running, 3), z = tp_seq(c, 0);
    tp_compute(c, z, 0, other, 0, 4);
    pkv_stats st = tp_stats(c);
    assert_true(st.n_free == 0 && st.n_cached == 1);
    (void)tp_match(c, 0, q, 4, 1); /* [2] from y, not [2 1] from the CACHED root */
    st = tp_stats(c);
    assert_true(st.n_free == 0 && st.n_cached == 0 && st.evictions == 1);
    tp_expect_kv(c, y, 0, running, 0, 3);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* ---- what may not be matched or written ------------------------------------------------------- */

static void test_prefix_uncommitted_not_matched(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 2, PKV_DTYPE_F16, 1);
    int32_t p[33];
    tp_tokens(p, 33, 41);
    pkv_seq a = tp_seq(c, 0);
    tp_compute(c, a, 0, p, 0, 32); /* written but not committed */
    pkv_seq b = tp_match(c, 0, p, 33, 0);
    assert_int_equal(tp_stats(c).n_indexed, 0);
    assert_int_equal(pkv_seq_release(c, b), 0);

    tp_commit(c, a, 20); /* block 0 full and committed, block 1 committed up to 4 tokens */
    tp_expect_same(c, a, tp_match(c, 0, p, 33, 20), 0, 20);
    assert_int_equal(tp_stats(c).n_indexed, 1);

    tp_commit(c, a, 32);
    (void)tp_match(c, 0, p, 33, 32);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* Truncating the sequence that computed a prefix, or the one reusing it, and then appending new
 * tokens, never changes the blocks the other one reads. */
static void test_prefix_truncate_keeps_reused_blocks(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 2, PKV_DTYPE_F16, 1);
    int32_t p[64], q[64], r[64];
    tp_tokens(p, 64, 51);
    memcpy(q, p, 48 * sizeof(int32_t));
    tp_tokens(q + 48, 16, 52);
    pkv_seq a = tp_prompt(c, 0, p, 64);
    pkv_seq b = tp_match(c, 0, q, 64, 48);
    int32_t tb_before[4], tb_after[4];
    tp_table(c, b, tb_before, 4);

    /* a rolls back to 10 tokens and generates something else */
    assert_int_equal(pkv_seq_truncate(c, a, 10), 0);
    tp_expect_info(c, a, 10, 10);
    memcpy(r, p, 10 * sizeof(int32_t));
    tp_tokens(r + 10, 54, 53);
    tp_compute(c, a, 0, r, 10, 40);
    tp_commit(c, a, 50);
    tp_check(c);
    tp_expect_kv(c, a, 0, r, 0, 50);
    tp_expect_kv(c, b, 0, q, 0, 48);
    assert_int_equal(tp_table(c, b, tb_after, 4), 3);
    assert_int_equal(memcmp(tb_before, tb_after, 3 * sizeof(int32_t)), 0);

    /* b rolls back inside its reused block 2 and goes on: a copy, the index keeps the original */
    assert_int_equal(pkv_seq_truncate(c, b, 40), 0);
    tp_expect_info(c, b, 40, 40);
    tp_compute(c, b, 0, q, 40, 24);
    tp_commit(c, b, 64);
    assert_int_equal(tp_table(c, b, tb_after, 4), 4);
    assert_int_not_equal(tb_after[2], tb_before[2]);
    tp_expect_kv(c, b, 0, q, 0, 64);
    (void)tp_match(c, 0, p, 49, 48); /* the original chain of p is intact */
    tp_check(c);
    pkv_cache_destroy(c);
}

/* pkv_seq_get_info's n_reused counts the attached tokens the sequence still holds: a truncate
 * lowers it, and a later match that attaches nothing leaves 0 (it was left at 48). */
static void test_prefix_reused_count_follows_truncate(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 2, PKV_DTYPE_F16, 1);
    int32_t p[64];
    tp_tokens(p, 64, 61);
    (void)tp_prompt(c, 0, p, 64);
    pkv_seq b = tp_match(c, 0, p, 49, 48);
    pkv_seq_info in;
    assert_int_equal(pkv_seq_truncate(c, b, 20), 0);
    assert_int_equal(pkv_seq_get_info(c, b, &in), 0);
    assert_int_equal(in.n_reused, 20);
    assert_int_equal(pkv_seq_truncate(c, b, 0), 0);
    uint32_t reused = 1;
    assert_int_equal(pkv_seq_match_prefix(c, b, p, 1, &reused), 0); /* one token: nothing to attach */
    assert_int_equal(reused, 0);
    assert_int_equal(pkv_seq_get_info(c, b, &in), 0);
    assert_int_equal(in.n_tokens, 0);
    assert_int_equal(in.n_reused, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A prompt of nearly 2^32 tokens (zeros, mapped read-only and never touched past its first
 * blocks): the count of its reusable blocks was computed in 32 bits and wrapped to 0, so a match
 * attached nothing although the prefix was indexed. */
static void test_prefix_huge_prompt(void **state) {
    (void)state;
    const size_t n = UINT32_MAX;
    int32_t *tok = mmap(NULL, n * sizeof(int32_t), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (tok == MAP_FAILED) skip();
    pkv_cache *c = tp_cache(16, 64, 2, PKV_DTYPE_F16, 1);
    (void)tp_prompt(c, 0, tok, 32);
    (void)tp_match(c, 0, tok, (uint32_t)n, 32);
    tp_check(c);
    pkv_cache_destroy(c);
    munmap(tok, n * sizeof(int32_t));
}

/* Slots of indexed (committed) blocks, of cached blocks, of a block that stays indexed after a
 * truncate: PKV_EINVAL and nothing written, even for the good slots of the same call. */
static void test_prefix_write_into_indexed_rejected(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 64, 1, PKV_DTYPE_F32, 1);
    int32_t p[48];
    tp_tokens(p, 48, 61);
    pkv_seq a = tp_prompt(c, 0, p, 32);
    float kv[32 * TP_H * TP_D]; /* up to 32 tokens */
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) kv[i] = 42.0f;
    int32_t slots[32];
    assert_int_equal(pkv_seq_slots(c, a, 0, 32, slots), 0);
    for (int i = 0; i < 32; i++) assert_int_equal(pkv_write_kv(c, 0, &slots[i], 1, kv, kv, PKV_DTYPE_F32), PKV_EINVAL);
    /* through the reusing sequence's slots: the same blocks */
    pkv_seq b = tp_match(c, 0, p, 33, 32);
    assert_int_equal(pkv_seq_slots(c, b, 0, 32, slots), 0);
    assert_int_equal(pkv_write_kv(c, 0, slots, 32, kv, NULL, PKV_DTYPE_F32), PKV_EINVAL);
    assert_int_equal(pkv_write_kv(c, 0, slots + 31, 1, NULL, kv, PKV_DTYPE_F32), PKV_EINVAL);
    /* a good slot (a fresh uncommitted position of a) in the same call is not written either */
    tp_compute(c, a, 0, p, 32, 1);
    int32_t pair[2];
    assert_int_equal(pkv_seq_slots(c, a, 32, 1, &pair[0]), 0);
    pair[1] = slots[3];
    assert_int_equal(pkv_write_kv(c, 0, pair, 2, kv, kv, PKV_DTYPE_F32), PKV_EINVAL);
    tp_expect_kv(c, a, 0, p, 0, 33);
    tp_expect_kv(c, b, 0, p, 0, 32);
    /* after both are released the blocks are CACHED: still not writable */
    int32_t cached_slot = slots[5];
    assert_int_equal(pkv_seq_release(c, a), 0);
    assert_int_equal(pkv_seq_release(c, b), 0);
    assert_int_equal(pkv_write_kv(c, 0, &cached_slot, 1, kv, kv, PKV_DTYPE_F32), PKV_EINVAL);
    /* truncate keeps an indexed block indexed: its slots past the new length stay read-only,
       and appending copies it first */
    pkv_seq d = tp_match(c, 0, p, 33, 32);
    assert_int_equal(pkv_seq_truncate(c, d, 20), 0);
    int32_t tab[2];
    assert_int_equal(tp_table(c, d, tab, 2), 2);
    int32_t past = tab[1] * 16 + 9; /* position 25: no longer in d, but indexed */
    assert_int_equal(pkv_write_kv(c, 0, &past, 1, kv, kv, PKV_DTYPE_F32), PKV_EINVAL);
    pkv_stats s0 = tp_stats(c);
    int32_t alt[48];
    memcpy(alt, p, 20 * sizeof(int32_t));
    tp_tokens(alt + 20, 28, 62);
    tp_compute(c, d, 0, alt, 20, 6);
    pkv_stats s1 = tp_stats(c);
    assert_int_equal(s1.cow_copies - s0.cow_copies, 1);
    tp_expect_kv(c, d, 0, alt, 0, 26);
    (void)tp_match(c, 0, p, 33, 32);
    tp_check(c);
    pkv_cache_destroy(c);
}

static void test_prefix_match_nonempty_einval(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 32, 1, PKV_DTYPE_F16, 1);
    int32_t p[40];
    tp_tokens(p, 40, 71);
    pkv_seq a = tp_prompt(c, 0, p, 32);
    pkv_seq b = tp_seq(c, 0);
    tp_compute(c, b, 0, p, 0, 3);
    pkv_stats s0 = tp_stats(c);
    uint32_t reused = 1234;
    assert_int_equal(pkv_seq_match_prefix(c, b, p, 40, &reused), PKV_EINVAL);
    assert_int_equal(pkv_seq_match_prefix(c, a, p, 40, &reused), PKV_EINVAL);
    pkv_stats s1 = tp_stats(c);
    assert_int_equal(s1.prefix_lookups, s0.prefix_lookups);
    assert_int_equal(s1.n_active, s0.n_active);
    tp_expect_info(c, b, 3, 0);
    tp_expect_kv(c, b, 0, p, 0, 3);
    /* bad arguments */
    pkv_seq e = tp_seq(c, 0);
    assert_int_equal(pkv_seq_match_prefix(c, e, NULL, 5, &reused), PKV_EINVAL);
    assert_int_equal(pkv_seq_match_prefix(c, e, p, 5, NULL), PKV_EINVAL);
    assert_int_equal(pkv_seq_match_prefix(NULL, e, p, 5, &reused), PKV_EINVAL);
    /* stale and pin ids */
    pkv_seq pin;
    assert_int_equal(pkv_pin_create(c, a, 32, &pin), 0);
    assert_int_equal(pkv_seq_match_prefix(c, pin, p, 5, &reused), PKV_EINVAL);
    assert_int_equal(pkv_seq_release(c, e), 0);
    assert_int_equal(pkv_seq_match_prefix(c, e, p, 5, &reused), PKV_ENOENT);
    assert_int_equal(pkv_seq_match_prefix(c, (pkv_seq)0, p, 5, &reused), PKV_ENOENT);
    /* n = 0 and n = 1: nothing can be reused */
    pkv_seq z = tp_seq(c, 0);
    assert_int_equal(pkv_seq_match_prefix(c, z, p, 0, &reused), 0);
    assert_int_equal(reused, 0);
    assert_int_equal(pkv_seq_match_prefix(c, z, p, 1, &reused), 0);
    assert_int_equal(reused, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

static void test_prefix_disabled_no_reuse(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(16, 32, 1, PKV_DTYPE_F16, 0);
    int32_t p[49];
    tp_tokens(p, 49, 81);
    pkv_seq a = tp_prompt(c, 0, p, 48);
    tp_expect_info(c, tp_match(c, 0, p, 49, 0), 0, 0);
    assert_int_equal(pkv_seq_release(c, a), 0);
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.n_indexed, 0);
    assert_int_equal(st.n_cached, 0);
    assert_int_equal(st.n_free, 32);
    assert_int_equal(st.prefix_tokens_hit, 0);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* ---- stats: misses by reason ------------------------------------------------------------------ */

static void expect_misses(pkv_cache *c, uint64_t n_new, uint64_t n_evicted, uint64_t n_ns) {
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.prefix_miss_new, n_new);
    assert_int_equal(st.prefix_miss_evicted, n_evicted);
    assert_int_equal(st.prefix_miss_namespace, n_ns);
}

static void test_prefix_miss_reasons(void **state) {
    (void)state;
    pkv_cache *c = tp_cache(4, 16, 1, PKV_DTYPE_F16, 1);
    int32_t p[9], q[9], p2[9];
    tp_tokens(p, 9, 91);
    tp_tokens(q, 9, 92);
    /* 1. nothing indexed yet: never seen */
    pkv_seq s = tp_match(c, 1, p, 9, 0);
    expect_misses(c, 1, 0, 0);
    /* compute p under tenant-a (2 full blocks indexed) and release it */
    tp_compute(c, s, 1, p, 0, 9);
    tp_commit(c, s, 9);
    assert_int_equal(pkv_seq_release(c, s), 0);
    /* 2. a full hit (8 of 9) is no miss */
    s = tp_match(c, 1, p, 9, 8);
    expect_misses(c, 1, 0, 0);
    assert_int_equal(pkv_seq_release(c, s), 0);
    /* 3. same tokens, tenant-b: other namespace */
    s = tp_match(c, 2, p, 9, 0);
    expect_misses(c, 1, 0, 1);
    assert_int_equal(pkv_seq_release(c, s), 0);
    /* 4. other tokens, tenant-a: never seen */
    s = tp_match(c, 1, q, 9, 0);
    expect_misses(c, 2, 0, 1);
    assert_int_equal(pkv_seq_release(c, s), 0);
    /* 5. block 0 hits, block 1 never seen (diverges at its first token: no partial copy) */
    memcpy(p2, p, sizeof p2);
    p2[4] = 999;
    s = tp_match(c, 1, p2, 9, 4);
    expect_misses(c, 3, 0, 1);
    assert_int_equal(pkv_seq_release(c, s), 0);
    /* 6. fill the whole pool: both cached blocks are evicted; p is then an evicted miss */
    pkv_seq w = tp_seq(c, 0);
    int32_t fill[64];
    tp_tokens(fill, 64, 93);
    tp_compute(c, w, 0, fill, 0, 64);
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.evictions, 2);
    assert_int_equal(st.n_indexed, 0);
    assert_int_equal(pkv_seq_release(c, w), 0);
    (void)tp_match(c, 1, p, 9, 0);
    expect_misses(c, 3, 1, 1);
    st = tp_stats(c);
    assert_int_equal(st.prefix_lookups, 6);
    assert_int_equal(st.prefix_tokens_queried, 54);
    assert_int_equal(st.prefix_tokens_hit, 12);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* A full index: 1024 single-block prompts cached under tenant-a, then each looked up under
 * tenant-b. Every miss is a namespace miss; the reasons are best effort (fingerprint tables of
 * 2 x n_blocks slots): with one slot a fingerprint, 811 of these 1024 counted as such and the
 * rest as never seen; with two slots a fingerprint (stop 51), 986. */
static void test_prefix_miss_reasons_full_index(void **state) {
    (void)state;
    enum { N = 1024 };
    pkv_cache *c = tp_cache(4, N, 1, PKV_DTYPE_F16, 1);
    int32_t p[5];
    for (uint32_t i = 0; i < N; i++) {
        tp_tokens(p, 4, 1000 + i);
        assert_int_equal(pkv_seq_release(c, tp_prompt(c, 1, p, 4)), 0);
    }
    pkv_stats st = tp_stats(c);
    assert_int_equal(st.n_indexed, N);
    assert_int_equal(st.n_cached, N);
    for (uint32_t i = 0; i < N; i++) {
        tp_tokens(p, 4, 1000 + i);
        p[4] = 7;
        assert_int_equal(pkv_seq_release(c, tp_match(c, 2, p, 5, 0)), 0);
    }
    st = tp_stats(c);
    assert_int_equal(st.prefix_miss_new + st.prefix_miss_namespace, N);
    assert_int_equal(st.prefix_miss_evicted, 0);
    if (st.prefix_miss_namespace < N * 93 / 100)
        fail_msg("%llu of %d namespace misses counted as such", (unsigned long long)st.prefix_miss_namespace, N);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* ---- media positions keyed by their content (pkv_media_tokens) -------------------------------- */

/* The documented derivation, computed here from XXH3 itself. */
static int32_t media_id(const void *id, size_t len, uint64_t pos) {
    XXH128_canonical_t key;
    XXH128_canonicalFromHash(&key, XXH3_128bits_withSeed(id, len, 0x706b766d65646961ull));
    const int32_t v = (int32_t)(XXH3_64bits_withSeed(&key, sizeof key, pos) >> 34);
    return pos == 0 ? INT32_MIN + v : -1 - v;
}

/* The ids: as documented, negative, computed piece by piece the same, the same on every machine
 * and version (pinned: a router in another process must compute these), and another content's
 * differ at every position; the refusals write nothing. */
static void test_prefix_media_ids(void **state) {
    (void)state;
    enum { N = 4096 };
    static int32_t a[N], b[N], piece[N];
    const char *ida = "sha256:of-image-a", *idb = "sha256:of-image-b";
    assert_int_equal(pkv_media_tokens(ida, strlen(ida), 0, N, a), 0);
    assert_int_equal(pkv_media_tokens(idb, strlen(idb), 0, N, b), 0);
    uint32_t same = 0;
    for (uint32_t i = 0; i < N; i++) {
        assert_int_equal(a[i], media_id(ida, strlen(ida), i));
        /* the first in [-2^31, -2^30 - 1], the others in [-2^30, -1]: a media's start is seen */
        assert_true(i == 0 ? a[i] < -(1 << 30) && b[i] < -(1 << 30) : a[i] >= -(1 << 30) && a[i] < 0 && b[i] >= -(1 << 30) && b[i] < 0);
        same += a[i] == b[i];
    }
    assert_int_equal(same, 0);
    /* piece by piece: offsets 0, 1000, 1001 and 3000 */
    assert_int_equal(pkv_media_tokens(ida, strlen(ida), 0, 1000, piece), 0);
    assert_int_equal(pkv_media_tokens(ida, strlen(ida), 1000, 1, piece + 1000), 0);
    assert_int_equal(pkv_media_tokens(ida, strlen(ida), 1001, 1999, piece + 1001), 0);
    assert_int_equal(pkv_media_tokens(ida, strlen(ida), 3000, N - 3000, piece + 3000), 0);
    assert_memory_equal(piece, a, sizeof a);
    /* pinned: any change to the derivation breaks routers and stored tiers of older versions */
    const int32_t pinned[4] = {-1780325367, -650806929, -969049132, -49490191};
    int32_t got[4];
    assert_int_equal(pkv_media_tokens("pagedkv", 7, 0, 3, got), 0);
    assert_int_equal(pkv_media_tokens("pagedkv", 7, UINT32_MAX, 1, got + 3), 0);
    for (int i = 0; i < 4; i++) assert_int_equal(got[i], pinned[i]);
    /* a one-byte id and a large one (an image's bytes themselves) */
    static uint8_t pixels[1 << 16];
    for (size_t i = 0; i < sizeof pixels; i++) pixels[i] = (uint8_t)(i * 131 + 7);
    assert_int_equal(pkv_media_tokens(pixels, 1, 5, 1, got), 0);
    assert_int_equal(got[0], media_id(pixels, 1, 5));
    assert_int_equal(pkv_media_tokens(pixels, sizeof pixels, 0, 1, got), 0);
    assert_int_equal(got[0], media_id(pixels, sizeof pixels, 0));
    pixels[40000] ^= 1; /* one bit of the content: another id */
    assert_int_equal(pkv_media_tokens(pixels, sizeof pixels, 0, 1, got + 1), 0);
    assert_int_not_equal(got[1], got[0]);

    /* refusals: nothing written */
    int32_t out[2] = {7, 7};
    assert_int_equal(pkv_media_tokens(ida, 0, 0, 2, out), PKV_EINVAL); /* no identity */
    assert_int_equal(pkv_media_tokens(NULL, 4, 0, 2, out), PKV_EINVAL);
    assert_int_equal(pkv_media_tokens(ida, 4, 0, 2, NULL), PKV_EINVAL);
    assert_int_equal(pkv_media_tokens(ida, 4, UINT32_MAX, 2, out), PKV_EINVAL); /* past 2^32 */
    assert_int_equal(pkv_media_tokens(ida, 4, 2, UINT32_MAX, out), PKV_EINVAL);
    assert_int_equal(out[0], 7);
    assert_int_equal(out[1], 7);
    assert_int_equal(pkv_media_tokens(ida, 4, UINT32_MAX, 0, NULL), 0); /* none asked: valid */
    assert_int_equal(pkv_media_tokens(ida, 4, UINT32_MAX, 1, out), 0); /* the last position */
    assert_int_equal(out[0], media_id(ida, 4, UINT32_MAX));
}

/* Two prompts alike but for their image: 20 text tokens, 40 image positions, 12 text tokens,
 * B = 16. With the model's placeholder id at the image positions the second matches the first
 * whole, K/V of the wrong image included (the trap); with pkv_media_tokens ids it matches the
 * 20 text tokens before the image only (block 0, then 4 tokens of block 1, token-granular),
 * the same image again matches all 71 it may, and a router's pkv_prefix_hashes of the prompts
 * agree on block 0 alone. */
static void test_prefix_media_match(void **state) {
    (void)state;
    enum { T0 = 20, M = 40, T1 = 12, N = T0 + M + T1, B = 16 };
    pkv_cache *c = tp_cache(B, 64, 2, PKV_DTYPE_F16, 1);
    int32_t pa[N], pb[N], placeholder_a[N], placeholder_b[N];
    tp_tokens(pa, T0, 51);
    tp_tokens(pa + T0 + M, T1, 52);
    memcpy(pb, pa, sizeof pa);
    for (int i = 0; i < M; i++) pa[T0 + i] = pb[T0 + i] = 32000; /* the model's <image> */
    memcpy(placeholder_a, pa, sizeof pa);
    memcpy(placeholder_b, pb, sizeof pb);
    assert_int_equal(pkv_media_tokens("image-a", 7, 0, M, pa + T0), 0);
    assert_int_equal(pkv_media_tokens("image-b", 7, 0, M, pb + T0), 0);

    pkv_seq a = tp_prompt(c, 0, pa, N);
    pkv_seq b = tp_match(c, 0, pb, N, T0); /* the text before the image only */
    tp_compute(c, b, 0, pb, T0, N - T0);
    tp_commit(c, b, N);
    tp_expect_kv(c, b, 0, pb, 0, N);
    pkv_seq a2 = tp_match(c, 0, pa, N, N - 1); /* the same image: all of it */
    tp_expect_same(c, a, a2, 0, N - 1);
    pkv_seq b2 = tp_match(c, 0, pb, N, N - 1);
    tp_expect_same(c, b, b2, 0, N - 1);
    tp_check(c);

    uint64_t ha[N / B], hb[N / B];
    size_t na = 0, nb = 0;
    assert_int_equal(pkv_prefix_hashes(NULL, 0, B, pa, N, ha, N / B, &na), 0);
    assert_int_equal(pkv_prefix_hashes(NULL, 0, B, pb, N, hb, N / B, &nb), 0);
    assert_int_equal(na, N / B);
    assert_int_equal(nb, N / B);
    assert_true(ha[0] == hb[0]);
    for (size_t i = 1; i < na; i++) assert_true(ha[i] != hb[i]);

    /* the trap, shown: with the placeholders both prompts are the same tokens */
    pkv_seq pa_seq = tp_match(c, 0, placeholder_a, N, T0);
    tp_compute(c, pa_seq, 0, placeholder_a, T0, N - T0);
    tp_commit(c, pa_seq, N);
    pkv_seq pb_seq = tp_match(c, 0, placeholder_b, N, N - 1);
    tp_expect_same(c, pa_seq, pb_seq, 0, N - 1);
    tp_check(c);
    pkv_cache_destroy(c);
}

/* The guard against ids that agree by chance: a match does not end after fewer than 4 ids of a
 * media whose next position the prompt has (negative ids, as pkv_media_tokens makes). Prompts
 * of B = 16 whose media Y shares its first j ids with the cached prompt's media X (as a 2^-30
 * collision a position would), then differs:
 * - media at position 20 (slot 4 of block 1): j = 2 matches 20, not 22 (the copy trimmed);
 *   j = 4 matches 24 (four ids: trusted);
 * - media at position 30 (slot 14 of block 1, whose last two slots are X's): j = 2 matches 30,
 *   not 32 (block 1 matched whole, given back: it stays attached, read to 30); j = 3, the third
 *   in block 2's copy, matches 30 too;
 * - a 2-id media matched whole, the prompt going on with text, is not trimmed;
 * - two media side by side: the second's one agreeing id is given back;
 * and the pool stays sound, every block given back where it was (counts compared). */
static void test_prefix_media_guard(void **state) {
    (void)state;
    enum { N = 80, B = 16 };
    for (int at = 20; at <= 30; at += 10) {
        pkv_cache *c = tp_cache(B, 64, 2, PKV_DTYPE_F16, 1);
        int32_t x[N], y[N];
        tp_tokens(x, N, 91);
        assert_int_equal(pkv_media_tokens("image x", 7, 0, 40, x + at), 0);
        pkv_seq a = tp_prompt(c, 0, x, N);
        pkv_stats before = tp_stats(c);
        const uint32_t js[] = {1, 2, 3, 4, 5};
        for (size_t ji = 0; ji < sizeof js / sizeof *js; ji++) {
            const uint32_t j = js[ji];
            memcpy(y, x, sizeof x);
            assert_int_equal(pkv_media_tokens("image y", 7, j, 40 - j, y + at + j), 0);
            const uint32_t want = j < 4 ? (uint32_t)at : (uint32_t)at + j;
            pkv_seq b = tp_match(c, 0, y, N, want);
            tp_check(c);
            int32_t ta[8], tb[8];
            assert_int_equal(tp_table(c, a, ta, 8), 5);
            const uint32_t nb = tp_table(c, b, tb, 8);
            assert_int_equal(nb, (want + B - 1) / B);
            for (uint32_t i = 0; i < want / B; i++) assert_int_equal(tb[i], ta[i]); /* shared */
            /* copied, or (given back from a whole matched block) that block kept, read in part */
            if (want % B && at == 30 && (j == 2 || j == 3)) assert_int_equal(tb[nb - 1], ta[nb - 1]);
            else if (want % B) assert_int_not_equal(tb[nb - 1], ta[nb - 1]);
            assert_int_equal(pkv_seq_release(c, b), 0);
            pkv_stats now = tp_stats(c);
            assert_int_equal(now.n_active, before.n_active);
            assert_int_equal(now.n_cached, before.n_cached);
            assert_int_equal(now.n_indexed, before.n_indexed);
        }
        /* the same media matched: no trim (all 79 it may) */
        pkv_seq same = tp_match(c, 0, x, N, N - 1);
        tp_expect_same(c, a, same, 0, N - 1);
        tp_check(c);
        pkv_cache_destroy(c);
    }
    /* a short media matched whole, then text: kept; the same with the prompt's media going on */
    pkv_cache *c = tp_cache(B, 64, 1, PKV_DTYPE_F32, 1);
    int32_t p[40], q[40];
    tp_tokens(p, 40, 92);
    p[17] = -5, p[18] = -6; /* two media ids inside block 1 */
    (void)tp_prompt(c, 0, p, 40);
    memcpy(q, p, sizeof p);
    q[19] = 7777777; /* text right after the media: the media was matched whole */
    (void)tp_match(c, 0, q, 40, 19);
    q[19] = -7; /* the prompt's media goes on past the two that agreed: given back */
    (void)tp_match(c, 0, q, 40, 17);
    tp_check(c);
    pkv_cache_destroy(c);

    /* two media side by side: A (5 ids) matched whole, then B's first id agreeing by chance and
       its second not: B's one id given back, though 6 negative ids precede the end (a media's
       first id is marked, so the run is counted from it, not back into A) */
    c = tp_cache(B, 64, 1, PKV_DTYPE_F32, 1);
    int32_t u[40], v[40];
    tp_tokens(u, 40, 93);
    assert_int_equal(pkv_media_tokens("image a", 7, 0, 5, u + 10), 0);
    assert_int_equal(pkv_media_tokens("image b", 7, 0, 10, u + 15), 0);
    (void)tp_prompt(c, 0, u, 40);
    memcpy(v, u, sizeof u);
    assert_int_equal(pkv_media_tokens("image c", 7, 1, 9, v + 16), 0); /* C's own ids after B's first */
    (void)tp_match(c, 0, v, 40, 15);
    tp_check(c);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_same_prompt_full_blocks_only),
        cmocka_unit_test(test_prefix_same_prompt_token_granular),
        cmocka_unit_test(test_prefix_diverge_inside_block),
        cmocka_unit_test(test_prefix_full_match_then_cow),
        cmocka_unit_test(test_prefix_b1_full_match),
        cmocka_unit_test(test_prefix_twin_indexed_once),
        cmocka_unit_test(test_prefix_salt_isolation),
        cmocka_unit_test(test_prefix_forced_hash_collision),
        cmocka_unit_test(test_prefix_exchange_one_chain),
        cmocka_unit_test(test_prefix_root_partial),
        cmocka_unit_test(test_prefix_root_partial_pool_full),
        cmocka_unit_test(test_prefix_uncommitted_not_matched),
        cmocka_unit_test(test_prefix_truncate_keeps_reused_blocks),
        cmocka_unit_test(test_prefix_reused_count_follows_truncate),
        cmocka_unit_test(test_prefix_huge_prompt),
        cmocka_unit_test(test_prefix_write_into_indexed_rejected),
        cmocka_unit_test(test_prefix_match_nonempty_einval),
        cmocka_unit_test(test_prefix_disabled_no_reuse),
        cmocka_unit_test(test_prefix_miss_reasons),
        cmocka_unit_test(test_prefix_miss_reasons_full_index),
        cmocka_unit_test(test_prefix_media_ids),
        cmocka_unit_test(test_prefix_media_match),
        cmocka_unit_test(test_prefix_media_guard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
