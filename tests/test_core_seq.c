/* test_core_seq.c: sequence life cycle of the core: fork and copy-on-write isolation, pool
 * exhaustion (all-or-nothing, FIFO reuse), the max_seqs / max_blocks_per_seq limits and
 * truncation (own and shared blocks, rewrite after truncate). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"

#include <stdlib.h>
#include <string.h>

/* Snapshot of everything observable about a set of sequences, to prove "nothing changed". */
typedef struct {
    pkv_stats st;
    uint32_t n;
    pkv_seq_info info[8];
    int32_t tab[8][64];
    uint32_t ntab[8];
} snap;

static void take(pkv_cache *c, const pkv_seq *s, uint32_t n, snap *o) {
    memset(o, 0, sizeof *o);
    o->st = tu_stats(c);
    o->n = n;
    for (uint32_t i = 0; i < n; i++) {
        o->info[i] = tu_info(c, s[i]);
        o->ntab[i] = tu_table(c, s[i], o->tab[i], 64);
    }
}

static void assert_same(pkv_cache *c, const pkv_seq *s, const snap *before) {
    snap now;
    take(c, s, before->n, &now);
    TU_STATS_EQ(&before->st, &now.st);
    for (uint32_t i = 0; i < before->n; i++) {
        assert_memory_equal(&before->info[i], &now.info[i], sizeof now.info[i]);
        assert_int_equal(before->ntab[i], now.ntab[i]);
        assert_memory_equal(before->tab[i], now.tab[i], now.ntab[i] * sizeof(int32_t));
    }
    TU_CHECK(c);
}

static pkv_config cfg_small(uint32_t n_blocks) { return tu_config(n_blocks, 4, 2, 2, 8, PKV_DTYPE_F32); }

/* ---- fork shares; CoW on the shared partly filled tail isolates both sides ---- */
static void test_fork_cow_isolation(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq p = tu_seq(c);
    tu_append(c, p, 6, 0, NULL); /* [0,1], tail holds 2 of 4 */
    TU_WRITE_PAT(c, p, 0, 6, 1);
    TU_OK(pkv_seq_commit(c, p, 4)); /* block 0 committed, block 1 not */
    pkv_seq ch;
    TU_OK(pkv_seq_fork(c, p, &ch));
    TU_CHECK(c);
    int32_t tp[8], tc[8];
    assert_int_equal(tu_table(c, p, tp, 8), 2);
    assert_int_equal(tu_table(c, ch, tc, 8), 2);
    assert_memory_equal(tp, tc, 2 * sizeof(int32_t));
    pkv_seq_info ip = tu_info(c, p), ic = tu_info(c, ch);
    assert_int_equal(ic.n_tokens, 6);
    assert_int_equal(ic.n_committed, 4);
    assert_int_equal(ic.n_blocks, 2);
    assert_int_equal(ic.n_shared, 2);
    assert_int_equal(ip.n_shared, 2);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_active, 2);
    assert_int_equal(st.cow_copies, 0);
    TU_SAME_PAT(c, ch, 0, 6, 1);

    /* shared blocks are read-only for both: writes are refused, nothing written */
    int32_t slot5;
    TU_OK(pkv_seq_slots(c, p, 5, 1, &slot5));
    float junk[16] = {0};
    TU_RC(pkv_write_kv(c, 0, &slot5, 1, junk, junk, PKV_DTYPE_F32), PKV_EINVAL);
    TU_SAME_PAT(c, p, 0, 6, 1);

    /* raw bytes of the parent's tail block, all layers, before the child appends */
    pkv_layout L;
    TU_OK(pkv_cache_layout(c, &L));
    uint8_t before_k[2][4 * 2 * 8 * 4];
    for (uint32_t l = 0; l < 2; l++)
        memcpy(before_k[l], L.k_base + l * L.layer_stride_bytes + (size_t)tp[1] * L.k_block_bytes, L.k_block_bytes);

    int32_t slot6;
    int32_t tok = 6;
    TU_OK(pkv_seq_append(c, ch, &tok, 1, &slot6));
    st = tu_stats(c);
    assert_int_equal(st.cow_copies, 1);
    assert_int_equal(st.n_active, 3);
    assert_int_equal(tu_table(c, ch, tc, 8), 2);
    assert_int_equal(tc[0], tp[0]);
    assert_true(tc[1] != tp[1]);
    assert_int_equal(slot6, tc[1] * 4 + 2);
    ic = tu_info(c, ch);
    ip = tu_info(c, p);
    assert_int_equal(ic.n_shared, 1);
    assert_int_equal(ip.n_shared, 1);
    assert_int_equal(ic.n_tokens, 7);
    TU_CHECK(c);
    /* the copy carries every layer of the shared positions */
    TU_SAME_PAT(c, ch, 0, 6, 1);
    /* the child writes its new position, the parent (now sole owner of its tail) rewrites its
       uncommitted positions 4, 5: neither sees the other's writes */
    TU_WRITE_PAT(c, ch, 6, 1, 2);
    TU_WRITE_PAT(c, p, 4, 2, 3);
    TU_SAME_PAT(c, p, 0, 4, 1);
    TU_SAME_PAT(c, p, 4, 2, 3);
    TU_SAME_PAT(c, ch, 0, 6, 1);
    TU_SAME_PAT(c, ch, 6, 1, 2);
    /* the parent's block bytes at offsets 2, 3 (never written by the parent) did not move */
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t h = 0; h < 2; h++) {
            const uint8_t *blk = L.k_base + l * L.layer_stride_bytes + (size_t)tp[1] * L.k_block_bytes;
            size_t off = ((size_t)h * 4 + 2) * L.k_row_bytes;
            assert_memory_equal(blk + off, before_k[l] + off, 2 * L.k_row_bytes);
        }
    /* a second append to the child (tail now its own) copies nothing */
    tu_append(c, ch, 1, 7, NULL);
    assert_int_equal(tu_stats(c).cow_copies, 1);

    /* release the parent first: the child's data stays */
    TU_OK(pkv_seq_release(c, p));
    TU_CHECK(c);
    TU_SAME_PAT(c, ch, 0, 6, 1);
    TU_SAME_PAT(c, ch, 6, 1, 2);
    ic = tu_info(c, ch);
    assert_int_equal(ic.n_shared, 0);
    st = tu_stats(c);
    assert_int_equal(st.n_active, 2);
    TU_OK(pkv_seq_release(c, ch));
    st = tu_stats(c);
    assert_int_equal(st.n_active, 0);
    assert_int_equal(st.n_free, 16);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- fork of a block-aligned parent: appends need no copy; parent released first ---- */
static void test_fork_full_tail_no_cow(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq p = tu_seq(c), a, b;
    tu_append(c, p, 8, 0, NULL);
    TU_WRITE_PAT(c, p, 0, 8, 5);
    TU_OK(pkv_seq_commit(c, p, 8));
    TU_OK(pkv_seq_fork(c, p, &a));
    TU_OK(pkv_seq_fork(c, a, &b)); /* fork of a fork */
    assert_int_equal(tu_info(c, b).n_shared, 2);
    tu_append(c, a, 3, 100, NULL);
    tu_append(c, b, 5, 200, NULL);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.cow_copies, 0);
    assert_int_equal(st.n_active, 2 + 1 + 2);
    TU_WRITE_PAT(c, a, 8, 3, 6);
    TU_WRITE_PAT(c, b, 8, 5, 7);
    TU_OK(pkv_seq_release(c, p));
    TU_CHECK(c);
    TU_SAME_PAT(c, a, 0, 8, 5);
    TU_SAME_PAT(c, b, 0, 8, 5);
    TU_SAME_PAT(c, a, 8, 3, 6);
    TU_SAME_PAT(c, b, 8, 5, 7);
    assert_int_equal(tu_info(c, a).n_shared, 2);
    TU_OK(pkv_seq_release(c, a));
    assert_int_equal(tu_info(c, b).n_shared, 0);
    TU_SAME_PAT(c, b, 0, 8, 5);
    TU_SAME_PAT(c, b, 8, 5, 7);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- CoW with no free block: PKV_ENOSPC, nothing changes; succeeds once a block frees ---- */
static void test_cow_enospc(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(4);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[3];
    s[0] = tu_seq(c);
    tu_append(c, s[0], 6, 0, NULL); /* [0,1] */
    TU_WRITE_PAT(c, s[0], 0, 6, 9);
    s[2] = tu_seq(c);
    tu_append(c, s[2], 5, 50, NULL); /* [2,3]: pool full */
    TU_OK(pkv_seq_fork(c, s[0], &s[1]));
    snap before;
    take(c, s, 3, &before);
    assert_int_equal(before.st.n_free, 0);
    int32_t toks[3] = {6, 7, 8}, slots[3] = {-9, -9, -9};
    TU_RC(pkv_seq_append(c, s[1], toks, 1, slots), PKV_ENOSPC); /* needs the CoW block */
    assert_same(c, s, &before);
    TU_RC(pkv_seq_append(c, s[0], toks, 1, slots), PKV_ENOSPC); /* the parent too */
    assert_same(c, s, &before);
    TU_SAME_PAT(c, s[1], 0, 6, 9);
    /* free one block: CoW + nothing else fits; CoW + one more block does not */
    TU_OK(pkv_seq_truncate(c, s[2], 4));
    snap before2;
    take(c, s, 3, &before2);
    assert_int_equal(before2.st.n_free, 1);
    TU_RC(pkv_seq_append(c, s[1], toks, 3, slots), PKV_ENOSPC); /* 6..8: CoW + a new block */
    assert_same(c, s, &before2);
    TU_OK(pkv_seq_append(c, s[1], toks, 1, slots));
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.cow_copies, 1);
    assert_int_equal(st.n_free, 0);
    TU_SAME_PAT(c, s[1], 0, 6, 9);
    TU_SAME_PAT(c, s[0], 0, 6, 9);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- CoW of an indexed tail that only this sequence holds: the old tail turns CACHED once copied,
 * so it counts towards the blocks an append can have (pkv.h: PKV_ENOSPC only if the blocks
 * cannot be had; appending 2 then 1 tokens succeeded where appending 3 at once failed) ---- */
static void test_cow_sole_indexed_tail_counts(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(3);
    cfg.enable_prefix_cache = 1;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    int32_t slots[8];
    tu_append(c, s, 8, 0, slots); /* blocks [0,1] */
    TU_WRITE_PAT(c, s, 0, 8, 9);
    TU_OK(pkv_seq_commit(c, s, 8)); /* both indexed */
    TU_OK(pkv_seq_truncate(c, s, 6)); /* tail: block 1, indexed, ref 1 */
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_free, 1);
    int32_t toks[3] = {60, 61, 62};
    TU_OK(pkv_seq_append(c, s, toks, 3, slots)); /* copy into the free block, then evict the old tail */
    st = tu_stats(c);
    assert_int_equal(st.cow_copies, 1);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(tu_info(c, s).n_tokens, 9);
    TU_SAME_PAT(c, s, 0, 6, 9);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- compaction (pkv_seq_compact) ---- */
/* Appends to the sequences in the order of plan, "i:n" pairs (n tokens to s[i]), which is how
 * their block ids interleave. Sequence i's tokens are 100 i + position. */
static void lay_out(pkv_cache *c, const pkv_seq *s, const char *plan) {
    uint32_t len[8] = {0};
    for (const char *p = plan; *p;) {
        char *end;
        const unsigned long i = strtoul(p, &end, 10);
        assert_true(*end == ':' && i < 8);
        const unsigned long n = strtoul(end + 1, &end, 10);
        tu_append(c, s[i], (uint32_t)n, (int32_t)(100 * i + len[i]), NULL);
        len[i] += (uint32_t)n;
        for (p = end; *p == ' ';) p++;
    }
}

/* The layout of the realizar seed's defragment case (SEEDS.md 4.6, item 30): three sequences
 * on blocks 0, 1, 2, the middle one released, the first extended onto 3 and 4. The seed moved
 * 3 to 1 and left 4, which trades one neighbour for another at the price of a copy; here a run
 * moves whole or not at all, so nothing moves while 2 is held. Once 2 is free too, the cheaper
 * side of the gap moves: block 0 to 2 (one copy) rather than 3, 4 to 1, 2 (two). */
static void test_compact_seed_layout(void **state) {
    (void)state;
    pkv_config cfg = tu_config(10, 16, 2, 2, 8, PKV_DTYPE_F32);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[3] = {tu_seq(c), tu_seq(c), tu_seq(c)}, x[1];
    lay_out(c, s, "0:16 1:16 2:16"); /* blocks 0, 1, 2 */
    TU_WRITE_PAT(c, s[0], 0, 16, 1);
    TU_OK(pkv_seq_release(c, s[1])); /* free queue 3..9, 1 */
    lay_out(c, s, "0:32");
    TU_WRITE_PAT(c, s[0], 16, 32, 1);
    int32_t tab[10];
    assert_int_equal(tu_table(c, s[0], tab, 10), 3);
    const int32_t frag[3] = {0, 3, 4};
    assert_memory_equal(tab, frag, sizeof frag);
    snap before;
    take(c, s, 1, &before);
    uint32_t moved = 99;
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved)); /* 1 is FREE, 2 is not: neither side fits */
    assert_int_equal(moved, 0);
    assert_same(c, s, &before);
    TU_OK(pkv_seq_release(c, s[2])); /* free queue 5..9, 1, 2 */
    take(c, s, 1, &before);
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved));
    assert_int_equal(moved, 1);
    assert_int_equal(tu_table(c, s[0], tab, 10), 3);
    const int32_t dense[3] = {2, 3, 4};
    assert_memory_equal(tab, dense, sizeof dense);
    TU_SAME_PAT(c, s[0], 0, 48, 1);
    pkv_stats st = tu_stats(c);
    TU_STATS_EQ(&before.st, &st);
    TU_CHECK(c);
    /* the old block went to the back of the free queue, the target left it: 5..9, 1, 0 */
    x[0] = tu_seq(c);
    tu_append(c, x[0], 16 * 7, 7, NULL);
    assert_int_equal(tu_table(c, x[0], tab, 10), 7);
    const int32_t fifo[7] = {5, 6, 7, 8, 9, 1, 0};
    assert_memory_equal(tab, fifo, sizeof fifo);
    /* 1 cannot follow 9 (10 is past the pool) nor 5..9 precede 1; 0 cannot follow 1 (2 is held)
       nor 1 precede 0 */
    TU_OK(pkv_seq_compact(c, x[0], 0, &moved));
    assert_int_equal(moved, 0);
    assert_int_equal(tu_table(c, x[0], tab, 10), 7);
    assert_memory_equal(tab, fifo, sizeof fifo);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* A run moves into room freed by the move before it; a moved block keeps its fill and commit
 * counts (committed positions stay read-only, the rest writable) and appends continue in it. */
static void test_compact_chain_partial_tail(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(12);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), tu_seq(c)};
    lay_out(c, s, "0:4 1:4 0:4 1:4 0:2"); /* s0 0, 2, 4 (2 of its 4 slots), s1 1, 3 */
    TU_WRITE_PAT(c, s[0], 0, 8, 5);
    TU_OK(pkv_seq_commit(c, s[0], 6)); /* block 2 holds 2 committed positions */
    TU_OK(pkv_seq_release(c, s[1]));   /* free queue 5..11, 3, 1 */
    pkv_stats st0 = tu_stats(c);
    uint32_t moved = 0;
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved)); /* 2 -> 1, then 4 -> 2 (freed by the first move) */
    assert_int_equal(moved, 2);
    int32_t tab[12];
    assert_int_equal(tu_table(c, s[0], tab, 12), 3);
    const int32_t dense[3] = {0, 1, 2};
    assert_memory_equal(tab, dense, sizeof dense);
    pkv_stats st1 = tu_stats(c);
    TU_STATS_EQ(&st0, &st1); /* peak_active included: never two copies in use at once */
    pkv_seq_info in = tu_info(c, s[0]);
    assert_int_equal(in.n_tokens, 10);
    assert_int_equal(in.n_committed, 6);
    TU_SAME_PAT(c, s[0], 0, 8, 5);
    TU_CHECK(c);
    int32_t slot;
    float k[16] = {0}, v[16] = {0};
    TU_OK(pkv_seq_slots(c, s[0], 5, 1, &slot));
    assert_int_equal(slot, 1 * 4 + 1);
    TU_RC(pkv_write_kv(c, 0, &slot, 1, k, v, PKV_DTYPE_F32), PKV_EINVAL); /* committed */
    TU_WRITE_PAT(c, s[0], 8, 2, 5); /* the moved tail's own positions */
    TU_SAME_PAT(c, s[0], 0, 10, 5);
    int32_t slots[3];
    tu_append(c, s[0], 3, 10, slots); /* 10, 11 in the moved tail, 12 in the queue's head */
    assert_int_equal(slots[0], 2 * 4 + 2);
    assert_int_equal(slots[1], 2 * 4 + 3);
    assert_int_equal(slots[2], 5 * 4 + 0);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* Shifts by less than a run's length, whose targets include the run's own blocks: down (the
 * run after the gap, when the one before cannot move: pinned) and up (the run before the gap,
 * when it is the shorter one). */
static void test_compact_short_shift(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(6);
    cfg.enable_prefix_cache = 1;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), tu_seq(c)};
    lay_out(c, s, "0:4 1:4 0:7"); /* s0 0, 2, 3, s1 1 */
    TU_WRITE_PAT(c, s[0], 0, 11, 8);
    TU_OK(pkv_seq_commit(c, s[0], 4));
    pkv_seq pin;
    TU_OK(pkv_pin_create(c, s[0], 4, &pin)); /* block 0 is shared with the pin: it stays */
    TU_OK(pkv_seq_release(c, s[1]));         /* 1 never committed: FREE; the queue 4, 5, 1 */
    uint32_t moved = 0;
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved));
    assert_int_equal(moved, 2);
    int32_t tab[6];
    assert_int_equal(tu_table(c, s[0], tab, 6), 3);
    const int32_t down[3] = {0, 1, 2};
    assert_memory_equal(tab, down, sizeof down);
    TU_SAME_PAT(c, s[0], 0, 11, 8);
    TU_CHECK(c);
    s[1] = tu_seq(c);
    tu_append(c, s[1], 12, 90, NULL);
    assert_int_equal(tu_table(c, s[1], tab, 6), 3);
    const int32_t fifo[3] = {4, 5, 3}; /* 2 went first and was taken again by the second move */
    assert_memory_equal(tab, fifo, sizeof fifo);
    pkv_cache_destroy(c);

    cfg = cfg_small(8);
    c = tu_create(&cfg);
    pkv_seq t[3] = {tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, t, "1:8 0:8 2:4 0:10"); /* t0 2, 3, 5, 6, 7, t1 0, 1, t2 4 */
    TU_WRITE_PAT(c, t[0], 0, 18, 9);
    TU_OK(pkv_seq_release(c, t[2]));
    TU_OK(pkv_seq_compact(c, t[0], 0, &moved)); /* 2, 3 up to 3, 4 (two copies, not three) */
    assert_int_equal(moved, 2);
    assert_int_equal(tu_table(c, t[0], tab, 6), 5);
    const int32_t up[5] = {3, 4, 5, 6, 7};
    assert_memory_equal(tab, up, sizeof up);
    TU_SAME_PAT(c, t[0], 0, 18, 9);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* Shared blocks (a fork's, a pin's) never move (seed item 31: a fork then a compaction of the
 * parent moves nothing); indexed blocks move with their index entries; bad ids change nothing. */
static void test_compact_shared_indexed_bad(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(12);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), tu_seq(c)};
    lay_out(c, s, "0:4 1:4 0:4"); /* s0 0, 2, s1 1 */
    TU_WRITE_PAT(c, s[0], 0, 8, 6);
    TU_OK(pkv_seq_commit(c, s[0], 8));
    TU_OK(pkv_seq_release(c, s[1]));
    pkv_seq ch, pin;
    TU_OK(pkv_seq_fork(c, s[0], &ch));
    snap before;
    take(c, s, 1, &before);
    uint32_t moved = 7;
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved));
    assert_int_equal(moved, 0);
    TU_OK(pkv_seq_compact(c, ch, 0, &moved));
    assert_int_equal(moved, 0);
    assert_same(c, s, &before);
    TU_OK(pkv_seq_release(c, ch));
    TU_OK(pkv_pin_create(c, s[0], 8, &pin));
    take(c, s, 1, &before);
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved));
    assert_int_equal(moved, 0);
    TU_RC(pkv_seq_compact(c, pin, 0, &moved), PKV_EINVAL);
    TU_RC(pkv_seq_compact(NULL, s[0], 0, &moved), PKV_EINVAL);
    TU_RC(pkv_seq_compact(c, ch, 0, &moved), PKV_ENOENT);
    assert_int_equal(moved, 0);
    assert_same(c, s, &before);
    TU_OK(pkv_pin_release(c, pin));
    TU_OK(pkv_seq_compact(c, s[0], 0, &moved));
    assert_int_equal(moved, 1);
    TU_SAME_PAT(c, s[0], 0, 8, 6);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* prefix cache on: indexed blocks move with their index entries (the chain's links, the
       registered partial tail's parent), so a later match finds the new ids */
    cfg.enable_prefix_cache = 1;
    c = tu_create(&cfg);
    pkv_seq q[3] = {tu_seq(c), tu_seq(c), tu_seq(c)}, a = q[0], b = q[1], d = q[2];
    lay_out(c, q, "0:4 1:4 0:4 2:4 0:2"); /* a 0, 2, 4, b 1, d 3 */
    TU_WRITE_PAT(c, a, 0, 10, 7);
    TU_OK(pkv_seq_commit(c, a, 10)); /* 0 and 2 enter the index, 4 is registered as a partial */
    TU_OK(pkv_seq_release(c, b));    /* 1 FREE (never committed) */
    TU_OK(pkv_seq_release(c, d));    /* 3 FREE */
    pkv_stats st0 = tu_stats(c);
    TU_OK(pkv_seq_compact(c, a, 0, &moved)); /* 2 -> 1, then 4 -> 2 */
    assert_int_equal(moved, 2);
    int32_t tab[4];
    assert_int_equal(tu_table(c, a, tab, 4), 3);
    const int32_t want[3] = {0, 1, 2};
    assert_memory_equal(tab, want, sizeof want);
    pkv_stats st1 = tu_stats(c);
    TU_STATS_EQ(&st0, &st1);
    TU_SAME_PAT(c, a, 0, 10, 7);
    TU_CHECK(c);
    int32_t prompt[11];
    tu_tokens(prompt, 11, 0);
    pkv_seq m = tu_seq(c);
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(c, m, prompt, 11, &reused));
    assert_int_equal(reused, 10); /* two full blocks and the partial's two tokens */
    assert_int_equal(tu_table(c, m, tab, 4), 3);
    assert_int_equal(tab[0], 0);
    assert_int_equal(tab[1], 1);
    TU_SAME_PAT(c, m, 0, 10, 7);
    TU_OK(pkv_seq_release(c, a)); /* 0 and 1 stay held by m; a's partial tail 2 is freed */
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* Asserts s's table is exactly the n ids given. */
static void table_is(pkv_cache *c, pkv_seq s, const int32_t *want, uint32_t n) {
    int32_t tab[16];
    assert_int_equal(tu_table(c, s, tab, 16), n);
    assert_memory_equal(tab, want, n * sizeof *want);
}

/* PKV_COMPACT_EVICT: a CACHED leaf of the index may be a target (evicted, counted), a CACHED
 * block with children may not; without the flag CACHED blocks are never targets; unknown flags
 * are refused. */
static void test_compact_evict(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(8);
    cfg.enable_prefix_cache = 1;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq q[2] = {tu_seq(c), tu_seq(c)}, a = q[0], b = q[1];
    lay_out(c, q, "0:4 1:4 0:4 1:4"); /* a 0, 2, b 1, 3 */
    TU_WRITE_PAT(c, a, 0, 8, 3);
    TU_WRITE_PAT(c, b, 0, 8, 4);
    TU_OK(pkv_seq_commit(c, b, 8)); /* 1 and its child 3 enter the index */
    TU_OK(pkv_seq_release(c, b));   /* both CACHED, 3 first in LRU order */
    snap before;
    take(c, &a, 1, &before);
    uint32_t moved = 9;
    TU_OK(pkv_seq_compact(c, a, PKV_COMPACT_EVICT, &moved)); /* 1 has a child: not a target */
    assert_int_equal(moved, 0);
    TU_RC(pkv_seq_compact(c, a, 4, &moved), PKV_EINVAL);
    TU_RC(pkv_seq_compact(c, a, 0x80000000u, &moved), PKV_EINVAL);
    assert_same(c, &a, &before);
    pkv_seq x = tu_seq(c);
    tu_append(c, x, 20, 90, NULL); /* 4..7, then evicts the LRU head 3: 1 is now a leaf */
    pkv_stats st0 = tu_stats(c);
    assert_int_equal(st0.n_cached, 1);
    assert_int_equal(st0.n_free, 0);
    TU_OK(pkv_seq_compact(c, a, 0, &moved));
    assert_int_equal(moved, 0);
    TU_OK(pkv_seq_compact(c, a, PKV_COMPACT_EVICT, &moved)); /* 2 -> 1 */
    assert_int_equal(moved, 1);
    int32_t tab[4];
    assert_int_equal(tu_table(c, a, tab, 4), 2);
    assert_int_equal(tab[0], 0);
    assert_int_equal(tab[1], 1);
    pkv_stats st1 = tu_stats(c);
    assert_int_equal(st1.evictions, st0.evictions + 1);
    assert_int_equal(st1.n_cached, 0);
    assert_int_equal(st1.n_free, 1);
    assert_int_equal(st1.n_active, st0.n_active);
    assert_int_equal(st1.n_indexed, st0.n_indexed - 1);
    TU_SAME_PAT(c, a, 0, 8, 3);
    TU_CHECK(c);
    int32_t prompt[9];
    tu_tokens(prompt, 9, 100);
    pkv_seq m = tu_seq(c);
    uint32_t reused = 7;
    TU_OK(pkv_seq_match_prefix(c, m, prompt, 9, &reused));
    assert_int_equal(reused, 0); /* b's blocks are gone */
    pkv_cache_destroy(c);
}

/* In a pool with no FREE block, of a prefix of two blocks (tokens from `first`, K/V written with
 * `tag`) that was released: a new sequence's append evicts the LRU head, which must be the
 * prefix's second block, at id `evicted`; a match of the prompt then reuses the first block, at
 * id `found`, with its K/V. So the two kept their LRU order and index places wherever they
 * went. */
static void evict_then_match(pkv_cache *c, int32_t evicted, int32_t first, int32_t found, uint32_t tag) {
    pkv_seq x = tu_seq(c);
    tu_append(c, x, 4, 900, NULL);
    table_is(c, x, &evicted, 1);
    int32_t prompt[9];
    tu_tokens(prompt, 9, first);
    pkv_seq m = tu_seq(c);
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(c, m, prompt, 9, &reused));
    assert_int_equal(reused, 4);
    table_is(c, m, &found, 1);
    TU_SAME_PAT(c, m, 0, 4, tag);
    TU_CHECK(c);
}

/* PKV_COMPACT_CACHED: any CACHED block may be a target, a parent included, and is exchanged, not
 * evicted: it keeps its K/V, its place in the index and in the LRU order; with both flags the
 * exchange wins. */
static void test_compact_cached(void **state) {
    (void)state;
    for (uint32_t flags = PKV_COMPACT_CACHED; flags <= (PKV_COMPACT_CACHED | PKV_COMPACT_EVICT); flags++) {
        pkv_config cfg = cfg_small(5);
        cfg.enable_prefix_cache = 1;
        pkv_cache *c = tu_create(&cfg);
        pkv_seq q[2] = {tu_seq(c), tu_seq(c)}, a = q[0], b = q[1];
        lay_out(c, q, "0:4 1:4 0:4 1:4 0:4"); /* a 0, 2, 4, b 1, 3 */
        TU_WRITE_PAT(c, a, 0, 12, 3);
        TU_WRITE_PAT(c, b, 0, 8, 4);
        TU_OK(pkv_seq_commit(c, b, 8)); /* 1 and its child 3 enter the index */
        TU_OK(pkv_seq_release(c, b));   /* both CACHED, 3 first in LRU order */
        const pkv_stats st0 = tu_stats(c);
        uint32_t moved = 0;
        TU_OK(pkv_seq_compact(c, a, flags, &moved));
        /* 2 moves to 1 (b's first block to 2), then 4 to 2 (it goes on to 4): one run 0 1 2 */
        assert_int_equal(moved, 4);
        table_is(c, a, (const int32_t[]){0, 1, 2}, 3);
        const pkv_stats st1 = tu_stats(c);
        TU_STATS_EQ(&st0, &st1);
        TU_SAME_PAT(c, a, 0, 12, 3);
        TU_CHECK(c);
        TU_OK(pkv_seq_compact(c, a, flags, &moved));
        assert_int_equal(moved, 0);
        evict_then_match(c, 3, 100, 4, 4); /* b's second block evicted at 3, its first found at 4 */
        pkv_cache_destroy(c);
    }
}

/* pkv_batch_compact in a full pool: interleaved sequences are exchanged into one run each, in
 * the order given, with their K/V and counts; shared blocks stay; indexed blocks go round
 * through a FREE block where there is one and stay where there is none; bad calls change
 * nothing. */
static void test_batch_compact(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(8);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), tu_seq(c)};
    lay_out(c, s, "0:4 1:4 0:4 1:4 0:4 1:4 0:4 1:3"); /* s0 0 2 4 6, s1 1 3 5 7 (3 of 4 slots) */
    TU_WRITE_PAT(c, s[0], 0, 16, 1);
    TU_WRITE_PAT(c, s[1], 0, 15, 2);
    TU_OK(pkv_seq_commit(c, s[0], 10));
    snap before;
    take(c, s, 2, &before);
    const pkv_seq twice[3] = {s[0], s[1], s[0]}, stale = s[0] + ((uint64_t)7 << 32);
    uint32_t moved = 99;
    TU_RC(pkv_batch_compact(c, twice, 3, 0, 0, &moved), PKV_EINVAL);
    TU_RC(pkv_batch_compact(c, NULL, 1, 0, 0, &moved), PKV_EINVAL);
    TU_RC(pkv_batch_compact(NULL, s, 2, 0, 0, &moved), PKV_EINVAL);
    const pkv_seq bad[2] = {s[1], stale};
    TU_RC(pkv_batch_compact(c, bad, 2, 0, 0, &moved), PKV_ENOENT);
    assert_int_equal(moved, 99);
    assert_same(c, s, &before);
    TU_OK(pkv_batch_compact(c, s, 0, 0, 0, NULL));
    TU_OK(pkv_batch_compact(c, s, 2, 3, 0, &moved)); /* no FREE block: no slack */
    assert_int_equal(moved, 8); /* four exchanges */
    int32_t tab[8];
    assert_int_equal(tu_table(c, s[0], tab, 8), 4);
    const int32_t first[4] = {0, 1, 2, 3}, second[4] = {4, 5, 6, 7};
    assert_memory_equal(tab, first, sizeof first);
    assert_int_equal(tu_table(c, s[1], tab, 8), 4);
    assert_memory_equal(tab, second, sizeof second);
    pkv_stats st = tu_stats(c);
    TU_STATS_EQ(&before.st, &st);
    TU_SAME_PAT(c, s[0], 0, 16, 1);
    TU_SAME_PAT(c, s[1], 0, 15, 2);
    TU_CHECK(c);
    int32_t slot, slots[2];
    float k[16] = {0};
    TU_OK(pkv_seq_slots(c, s[0], 9, 1, &slot));
    TU_RC(pkv_write_kv(c, 0, &slot, 1, k, k, PKV_DTYPE_F32), PKV_EINVAL); /* its commit count came along */
    TU_RC(pkv_seq_append(c, s[1], (const int32_t[]){1, 2}, 2, slots), PKV_ENOSPC);
    int32_t one = 5;
    TU_OK(pkv_seq_append(c, s[1], &one, 1, &slot)); /* the fill count came along: slot 3 of block 7 */
    assert_int_equal(slot, 7 * 4 + 3);
    const pkv_seq rev[2] = {s[1], s[0]};
    TU_OK(pkv_batch_compact(c, rev, 2, 0, 0, &moved)); /* laid out already, in either order: kept */
    assert_int_equal(moved, 0);
    assert_int_equal(tu_table(c, s[1], tab, 8), 4);
    assert_memory_equal(tab, second, sizeof second);
    TU_SAME_PAT(c, s[0], 0, 16, 1);
    TU_SAME_PAT(c, s[1], 0, 15, 2);
    TU_CHECK(c);
    pkv_seq f;
    TU_OK(pkv_seq_fork(c, s[1], &f)); /* every block of s1 is shared now: none moves */
    TU_OK(pkv_batch_compact(c, s, 2, 0, 0, &moved));
    assert_int_equal(moved, 0);
    assert_int_equal(tu_table(c, s[1], tab, 8), 4);
    assert_memory_equal(tab, second, sizeof second);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* prefix cache on, committed blocks indexed: exchanged as the others are, with no FREE block
       at all, their places in the index going with them, so a match finds them at their new ids */
    cfg = cfg_small(9);
    cfg.enable_prefix_cache = 1;
    c = tu_create(&cfg);
    pkv_seq q[3] = {tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, q, "0:4 1:4 0:4 1:4 0:4 1:4 0:4 1:4 2:4"); /* q0 0 2 4 6, q1 1 3 5 7, q2 8 */
    TU_WRITE_PAT(c, q[0], 0, 16, 3);
    TU_WRITE_PAT(c, q[1], 0, 16, 4);
    TU_OK(pkv_seq_commit(c, q[0], 16));
    TU_OK(pkv_seq_commit(c, q[1], 16));
    take(c, q, 2, &before);
    TU_OK(pkv_batch_compact(c, q, 2, 0, 0, &moved)); /* block 8 is q2's: nothing FREE */
    assert_int_equal(moved, 8); /* q0 into 0-3 (three exchanges), then q1's 4 6 5 7 put in order */
    assert_int_equal(tu_table(c, q[0], tab, 8), 4);
    assert_memory_equal(tab, first, sizeof first);
    assert_int_equal(tu_table(c, q[1], tab, 8), 4);
    assert_memory_equal(tab, second, sizeof second);
    st = tu_stats(c);
    TU_STATS_EQ(&before.st, &st);
    TU_SAME_PAT(c, q[0], 0, 16, 3);
    TU_SAME_PAT(c, q[1], 0, 16, 4);
    TU_CHECK(c);
    int32_t prompt[13];
    tu_tokens(prompt, 13, 100);
    pkv_seq m = tu_seq(c);
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(c, m, prompt, 13, &reused));
    assert_int_equal(reused, 12);
    TU_SAME_PAT(c, m, 0, 12, 4);
    TU_CHECK(c);
    TU_OK(pkv_batch_compact(c, q, 2, 0, 0, &moved)); /* laid out: kept */
    assert_int_equal(moved, 0);
    pkv_cache_destroy(c);
}

/* pkv_batch_compact's slack: FREE ids left after each sequence's run (as many as the FREE
 * blocks allow for every sequence), which pkv_seq_compact then moves an appended block into. */
static void test_batch_compact_slack(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(10);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), tu_seq(c)};
    lay_out(c, s, "0:4 1:4 0:4 1:4 0:4 1:4 0:4 1:4"); /* s0 0 2 4 6, s1 1 3 5 7; 8, 9 FREE */
    TU_WRITE_PAT(c, s[0], 0, 16, 1);
    TU_WRITE_PAT(c, s[1], 0, 16, 2);
    pkv_stats st0 = tu_stats(c);
    uint32_t moved = 0;
    TU_OK(pkv_batch_compact(c, s, 2, 5, 0, &moved)); /* 5 asked, 2 FREE for 2 sequences: 1 each */
    assert_int_equal(moved, 11); /* five exchanges and one move into a FREE block */
    int32_t tab[8];
    assert_int_equal(tu_table(c, s[0], tab, 8), 4);
    const int32_t first[4] = {0, 1, 2, 3}, second[4] = {5, 6, 7, 8};
    assert_memory_equal(tab, first, sizeof first);
    assert_int_equal(tu_table(c, s[1], tab, 8), 4);
    assert_memory_equal(tab, second, sizeof second);
    pkv_stats st1 = tu_stats(c);
    TU_STATS_EQ(&st0, &st1);
    TU_SAME_PAT(c, s[0], 0, 16, 1);
    TU_SAME_PAT(c, s[1], 0, 16, 2);
    TU_CHECK(c);
    /* each sequence grows by a block: wherever the free queue puts it, compaction brings it next
       to its run */
    for (int i = 0; i < 2; i++) {
        tu_append(c, s[i], 4, 100 * i + 16, NULL);
        TU_WRITE_PAT(c, s[i], 16, 4, (uint32_t)i + 1);
        TU_OK(pkv_seq_compact(c, s[i], 0, &moved));
        assert_int_equal(tu_table(c, s[i], tab, 8), 5);
        for (int j = 1; j < 5; j++) assert_int_equal(tab[j], tab[j - 1] + 1);
        TU_SAME_PAT(c, s[i], 0, 20, (uint32_t)i + 1);
    }
    TU_CHECK(c);
    pkv_cache_destroy(c);
}


/* pkv_batch_compact leaves what is laid out where it is: a sequence whose blocks already form
 * one group in id order stays; one that grew a block away from its run takes the run's own
 * stretch (one copy), not the lowest ids; one that fits no stretch between the kept ones is laid
 * across them only where that at least halves its groups, so a second call moves nothing;
 * PKV_BATCH_REPACK lays everything out again. */
static void test_batch_compact_stable(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[4] = {tu_seq(c), tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, s, "1:20 0:12 2:4 3:16 0:4"); /* s1 0-4, s0 5-7 and 13, s2 8, s3 9-12 */
    TU_OK(pkv_seq_release(c, s[2]));         /* 8 FREE */
    TU_WRITE_PAT(c, s[0], 0, 16, 1);
    TU_WRITE_PAT(c, s[1], 0, 20, 2);
    TU_WRITE_PAT(c, s[3], 0, 16, 4);
    const pkv_stats st0 = tu_stats(c);
    uint32_t moved = 0;
    TU_OK(pkv_batch_compact(c, s, 2, 0, 0, &moved)); /* without s3, nothing lies between s0's blocks */
    assert_int_equal(moved, 0);
    const pkv_seq batch[3] = {s[0], s[1], s[3]};
    TU_OK(pkv_batch_compact(c, batch, 3, 0, 0, &moved));
    assert_int_equal(moved, 1); /* 13 to 8 */
    table_is(c, s[0], (const int32_t[]){5, 6, 7, 8}, 4);
    table_is(c, s[1], (const int32_t[]){0, 1, 2, 3, 4}, 5);
    table_is(c, s[3], (const int32_t[]){9, 10, 11, 12}, 4);
    const pkv_stats st1 = tu_stats(c);
    TU_STATS_EQ(&st0, &st1);
    TU_SAME_PAT(c, s[0], 0, 16, 1);
    TU_SAME_PAT(c, s[1], 0, 20, 2);
    TU_SAME_PAT(c, s[3], 0, 16, 4);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* full pool: s2 on 2 and s3 on 6 stay; s0 (0 3 5 8, four groups) fits no stretch of 4, and
       across s2 it makes two groups, so it goes to 0 1 3 4; s1 (three groups) would make two
       across s3, not half, so it stays where the exchanges left it; a second call moves nothing,
       and PKV_BATCH_REPACK lays every one out again, one run each */
    cfg = cfg_small(9);
    c = tu_create(&cfg);
    for (int i = 0; i < 4; i++) s[i] = tu_seq(c);
    lay_out(c, s, "0:4 1:4 2:4 0:4 1:4 0:4 3:4 1:4 0:4");
    for (uint32_t i = 0; i < 4; i++) TU_WRITE_PAT(c, s[i], 0, i < 2 ? 16 - 4 * i : 4, i + 1);
    TU_OK(pkv_batch_compact(c, s, 4, 2, 0, &moved)); /* no FREE block: no slack */
    assert_int_equal(moved, 6);                     /* three exchanges */
    table_is(c, s[0], (const int32_t[]){0, 1, 3, 4}, 4);
    table_is(c, s[1], (const int32_t[]){5, 8, 7}, 3);
    table_is(c, s[2], (const int32_t[]){2}, 1);
    table_is(c, s[3], (const int32_t[]){6}, 1);
    for (uint32_t i = 0; i < 4; i++) TU_SAME_PAT(c, s[i], 0, i < 2 ? 16 - 4 * i : 4, i + 1);
    TU_CHECK(c);
    TU_OK(pkv_batch_compact(c, s, 4, 0, 0, &moved));
    assert_int_equal(moved, 0);
    TU_RC(pkv_batch_compact(c, s, 4, 0, 4, &moved), PKV_EINVAL); /* an unknown flag */
    TU_RC(pkv_batch_compact(c, s, 4, 0, 0x80000000u | PKV_BATCH_REPACK, &moved), PKV_EINVAL);
    TU_OK(pkv_batch_compact(c, s, 4, 0, PKV_BATCH_REPACK, &moved));
    table_is(c, s[0], (const int32_t[]){0, 1, 2, 3}, 4);
    table_is(c, s[1], (const int32_t[]){4, 5, 6}, 3);
    table_is(c, s[2], (const int32_t[]){7}, 1);
    table_is(c, s[3], (const int32_t[]){8}, 1);
    for (uint32_t i = 0; i < 4; i++) TU_SAME_PAT(c, s[i], 0, i < 2 ? 16 - 4 * i : 4, i + 1);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* pkv_batch_compact's choices, one scenario each: the stretch from a sequence's first entry when
 * it holds more of it in place than the lowest one (and the lowest on a tie); a kept sequence's
 * FREE ids closed to the others; a placed sequence's slack closed to the ones after it, and
 * counted in the stretch it needs. */
static void test_batch_compact_choices(void **state) {
    (void)state;
    uint32_t moved = 0;
    pkv_seq s[8];
    /* home: s0 on 2 3 4 and 7, s1 on 6 (laid out), 0 1 5 FREE: the stretch 2-5 holds three of
       s0's four in place, the lowest (0-3) none: one copy, 7 to 5 */
    pkv_config cfg = cfg_small(12);
    pkv_cache *c = tu_create(&cfg);
    for (int i = 0; i < 6; i++) s[i] = tu_seq(c);
    lay_out(c, s, "4:8 0:12 5:4 1:4 0:4");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_OK(pkv_seq_release(c, s[5]));
    TU_WRITE_PAT(c, s[0], 0, 16, 1);
    TU_OK(pkv_batch_compact(c, s, 2, 0, 0, &moved));
    assert_int_equal(moved, 1);
    table_is(c, s[0], (const int32_t[]){2, 3, 4, 5}, 4);
    table_is(c, s[1], (const int32_t[]){6}, 1);
    TU_SAME_PAT(c, s[0], 0, 16, 1);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* a tie: s0 on 3 then 1 (one group, not ascending), 0 2 4 FREE: from 3 (3 4) and from the
       lowest (0 1) each hold one entry in place; the lowest wins: 3 to 0 */
    cfg = cfg_small(5);
    c = tu_create(&cfg);
    for (int i = 0; i < 8; i++) s[i] = tu_seq(c);
    lay_out(c, s, "4:4 5:4 6:4 7:4 1:4"); /* 0-4 */
    TU_OK(pkv_seq_release(c, s[7]));      /* 3, then 1, to the free queue */
    TU_OK(pkv_seq_release(c, s[5]));
    lay_out(c, s, "0:8");
    table_is(c, s[0], (const int32_t[]){3, 1}, 2);
    for (int i = 4; i < 7; i += 2) TU_OK(pkv_seq_release(c, s[i]));
    TU_OK(pkv_seq_release(c, s[1]));
    TU_WRITE_PAT(c, s[0], 0, 8, 2);
    TU_OK(pkv_batch_compact(c, s, 1, 0, 0, &moved));
    assert_int_equal(moved, 1);
    table_is(c, s[0], (const int32_t[]){0, 1}, 2);
    TU_SAME_PAT(c, s[0], 0, 8, 2);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* a kept sequence's FREE ids: s1 on 0 and 3 with 1 2 FREE between, s2 on 4 and 6 around s3
       on 5, the rest held outside the batch: s2 fits no stretch but 1 2, which are s1's, and
       across s3 it would stay two groups: nothing moves */
    cfg = cfg_small(12);
    c = tu_create(&cfg);
    for (int i = 0; i < 6; i++) s[i] = tu_seq(c);
    lay_out(c, s, "1:4 4:8 1:4 2:4 3:4 2:4 5:20");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_OK(pkv_batch_compact(c, s, 4, 0, 0, &moved));
    assert_int_equal(moved, 0);
    table_is(c, s[1], (const int32_t[]){0, 3}, 2);
    table_is(c, s[2], (const int32_t[]){4, 6}, 2);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* scattered (no run holds more than half): s0 on 4 5 and 9 10 around s1 on 8, 0-3 and 6 7
       FREE: the clean stretch from its first entry (4-7) holds two in place, the lowest (0-3)
       none: two copies */
    cfg = cfg_small(12);
    c = tu_create(&cfg);
    for (int i = 0; i < 7; i++) s[i] = tu_seq(c);
    lay_out(c, s, "4:16 0:8 5:8 1:4 0:8 6:4");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_OK(pkv_seq_release(c, s[5]));
    TU_WRITE_PAT(c, s[0], 0, 16, 5);
    TU_OK(pkv_batch_compact(c, s, 2, 0, 0, &moved));
    assert_int_equal(moved, 2);
    table_is(c, s[0], (const int32_t[]){4, 5, 6, 7}, 4);
    TU_SAME_PAT(c, s[0], 0, 16, 5);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* not scattered: s0 on 0 1 2 and 6, s1 on 4 (laid out), 3 5 7-9 FREE, slack 1: no clean
       stretch of 5 from 0; s0 does not move whole to the lowest one (5-9), it takes 0-3 without
       its slack: one copy */
    cfg = cfg_small(10);
    c = tu_create(&cfg);
    for (int i = 0; i < 6; i++) s[i] = tu_seq(c);
    lay_out(c, s, "0:12 4:4 1:4 5:4 0:4");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_OK(pkv_seq_release(c, s[5]));
    TU_WRITE_PAT(c, s[0], 0, 16, 6);
    TU_OK(pkv_batch_compact(c, s, 2, 1, 0, &moved));
    assert_int_equal(moved, 1);
    table_is(c, s[0], (const int32_t[]){0, 1, 2, 3}, 4);
    table_is(c, s[1], (const int32_t[]){4}, 1);
    TU_SAME_PAT(c, s[0], 0, 16, 6);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* a later sequence makes room: s0 on 0 1 2 and 7, s2 on 3 and 8 (scattered), s1 on 4, 5 6 9
       FREE: s0 first finds 3 taken; s2 moves to the clean stretch 5 6; then s0 takes 0-3 */
    c = tu_create(&cfg);
    for (int i = 0; i < 6; i++) s[i] = tu_seq(c);
    lay_out(c, s, "0:12 2:4 1:4 4:8 0:4 2:4 5:4");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_OK(pkv_seq_release(c, s[5]));
    TU_WRITE_PAT(c, s[0], 0, 16, 7);
    TU_WRITE_PAT(c, s[2], 0, 8, 8);
    TU_OK(pkv_batch_compact(c, s, 3, 0, 0, &moved));
    assert_int_equal(moved, 3);
    table_is(c, s[0], (const int32_t[]){0, 1, 2, 3}, 4);
    table_is(c, s[2], (const int32_t[]){5, 6}, 2);
    TU_SAME_PAT(c, s[0], 0, 16, 7);
    TU_SAME_PAT(c, s[2], 0, 8, 8);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* a stretch has room for the slack: s0 on 3 and 5, s1 on 2 and s3 on 4 (laid out), 0 1 and
       6-8 FREE, slack 1: not 0 1 (no room after them) but 5 6 7 (3 and 5 exchanged, then 3 to 6) */
    cfg = cfg_small(12);
    c = tu_create(&cfg);
    for (int i = 0; i < 7; i++) s[i] = tu_seq(c);
    lay_out(c, s, "4:8 1:4 0:4 3:4 0:4 5:12 6:12");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_OK(pkv_seq_release(c, s[5]));
    TU_WRITE_PAT(c, s[0], 0, 8, 9);
    const pkv_seq trio[3] = {s[0], s[1], s[3]};
    TU_OK(pkv_batch_compact(c, trio, 3, 1, 0, &moved));
    assert_int_equal(moved, 3);
    table_is(c, s[0], (const int32_t[]){5, 6}, 2);
    TU_SAME_PAT(c, s[0], 0, 8, 9);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* slack: s0 on 0 and 3, s1 on 1 and 4, s3 on 2 (laid out), 5-9 FREE, slack 1: s0 takes the
       clean stretch 5 6 7 (two and its slack); s1 finds no clean stretch of 3, as 7 is s0's
       slack, nor one over the others, so it is laid across s3 from 0 (its groups halve) */
    cfg = cfg_small(10);
    c = tu_create(&cfg);
    for (int i = 0; i < 6; i++) s[i] = tu_seq(c);
    lay_out(c, s, "0:4 1:4 3:4 0:4 1:4 4:20");
    TU_OK(pkv_seq_release(c, s[4]));
    TU_WRITE_PAT(c, s[0], 0, 8, 3);
    TU_WRITE_PAT(c, s[1], 0, 8, 4);
    const pkv_seq batch[3] = {s[0], s[1], s[3]};
    TU_OK(pkv_batch_compact(c, batch, 3, 1, 0, &moved));
    assert_int_equal(moved, 4);
    table_is(c, s[0], (const int32_t[]){5, 6}, 2);
    table_is(c, s[1], (const int32_t[]){0, 1}, 2);
    table_is(c, s[3], (const int32_t[]){2}, 1);
    TU_SAME_PAT(c, s[0], 0, 8, 3);
    TU_SAME_PAT(c, s[1], 0, 8, 4);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* A kept sequence keeps its slack: the FREE ids after its last entry (as many as a placed one
 * gets) are closed to the others, so that a later call does not give away what an earlier one
 * left for its appends. */
static void test_batch_compact_kept_slack(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(10);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[4] = {tu_seq(c), tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, s, "0:8 3:8 1:4 2:4 1:4 2:4 3:8"); /* s0 0 1, s3 2 3 8 9, s1 4 6, s2 5 7 */
    TU_OK(pkv_seq_release(c, s[3]));                  /* 2, 3, 8, 9 FREE */
    for (uint32_t i = 0; i < 3; i++) TU_WRITE_PAT(c, s[i], 0, 8, i + 1);
    uint32_t moved = 0;
    TU_OK(pkv_batch_compact(c, s, 3, 1, 0, &moved)); /* slack 1 each (4 FREE for 3) */
    /* s0 is kept and 2 is its slack; s1 finds no clean stretch at first, s2 takes 7 8 (9 its
       slack), then s1 takes 4 5 */
    assert_int_equal(moved, 4);
    table_is(c, s[0], (const int32_t[]){0, 1}, 2);
    table_is(c, s[1], (const int32_t[]){4, 5}, 2);
    table_is(c, s[2], (const int32_t[]){7, 8}, 2);
    for (uint32_t i = 0; i < 3; i++) TU_SAME_PAT(c, s[i], 0, 8, i + 1);
    TU_CHECK(c);
    TU_OK(pkv_batch_compact(c, s, 3, 1, 0, &moved)); /* all laid out, each with its slack */
    assert_int_equal(moved, 0);
    pkv_cache_destroy(c);
}

/* PKV_BATCH_CACHED: CACHED blocks of the prefix index are targets too, exchanged with the entry
 * that takes their id, so their K/V and their places in the index and in the LRU order go with
 * them; without the flag they are in the way. */
static void test_batch_compact_cached(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(8);
    cfg.enable_prefix_cache = 1;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq q[4] = {tu_seq(c), tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, q, "0:8 1:4 2:8 0:4 1:4 3:4"); /* q0 0 1 5, q1 2 6, q2 3 4, q3 7 */
    TU_WRITE_PAT(c, q[0], 0, 12, 1);
    TU_WRITE_PAT(c, q[1], 0, 8, 2);
    TU_WRITE_PAT(c, q[2], 0, 8, 3);
    TU_OK(pkv_seq_commit(c, q[0], 12)); /* q0's blocks indexed too */
    TU_OK(pkv_seq_commit(c, q[2], 8));
    TU_OK(pkv_seq_release(c, q[2])); /* 3 and its child 4 CACHED, 4 first in LRU order */
    snap before;
    take(c, q, 2, &before);
    uint32_t moved = 9;
    TU_OK(pkv_batch_compact(c, q, 2, 0, 0, &moved));
    assert_int_equal(moved, 0); /* q1 finds no stretch, and across q0 it would not gain */
    assert_same(c, q, &before);
    TU_OK(pkv_batch_compact(c, q, 2, 0, PKV_BATCH_CACHED, &moved));
    assert_int_equal(moved, 2); /* q1's 6 exchanged with the CACHED 3; q0 finds no room and stays */
    table_is(c, q[0], (const int32_t[]){0, 1, 5}, 3);
    table_is(c, q[1], (const int32_t[]){2, 3}, 2);
    pkv_stats st = tu_stats(c);
    TU_STATS_EQ(&before.st, &st);
    TU_SAME_PAT(c, q[0], 0, 12, 1);
    TU_SAME_PAT(c, q[1], 0, 8, 2);
    TU_CHECK(c);
    TU_OK(pkv_batch_compact(c, q, 2, 0, PKV_BATCH_CACHED, &moved));
    assert_int_equal(moved, 0);
    evict_then_match(c, 4, 200, 6, 3); /* q2's second block evicted at 4, its first found at 6 */
    pkv_cache_destroy(c);

    /* CACHED ids inside a kept sequence's span are closed to the others like FREE ones: q0 (0, 3)
       is kept with 1 and 2 between; scattered q1 (4, 6) and q2 (5, 7) exchange with each other */
    cfg = cfg_small(10);
    cfg.enable_prefix_cache = 1;
    c = tu_create(&cfg);
    pkv_seq p[5] = {tu_seq(c), tu_seq(c), tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, p, "0:4 3:8 0:4 1:4 2:4 1:4 2:4 4:8"); /* p0 0 3, p3 1 2, p1 4 6, p2 5 7, p4 8 9 */
    TU_WRITE_PAT(c, p[3], 0, 8, 6);
    TU_OK(pkv_seq_commit(c, p[3], 8));
    TU_OK(pkv_seq_release(c, p[3]));
    for (uint32_t i = 0; i < 3; i++) TU_WRITE_PAT(c, p[i], 0, 8, i + 1);
    TU_OK(pkv_batch_compact(c, p, 3, 0, PKV_BATCH_CACHED, &moved));
    assert_int_equal(moved, 2);
    table_is(c, p[0], (const int32_t[]){0, 3}, 2);
    table_is(c, p[1], (const int32_t[]){4, 5}, 2);
    table_is(c, p[2], (const int32_t[]){6, 7}, 2);
    for (uint32_t i = 0; i < 3; i++) TU_SAME_PAT(c, p[i], 0, 8, i + 1);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* a CACHED id after a placed run is its slack like a FREE one, closed to the others: q0
       takes 2 3 (the CACHED 3 exchanged to 0) with the CACHED 4 as its slack, so q1 takes 5 6,
       not 4 5 */
    cfg = cfg_small(8);
    cfg.enable_prefix_cache = 1;
    c = tu_create(&cfg);
    pkv_seq r[4] = {tu_seq(c), tu_seq(c), tu_seq(c), tu_seq(c)};
    lay_out(c, r, "0:4 1:4 0:4 2:8 3:4 1:4 3:4"); /* r0 0 2, r1 1 6, r2 3 4, r3 5 7 */
    TU_WRITE_PAT(c, r[2], 0, 8, 6);
    TU_OK(pkv_seq_commit(c, r[2], 8));
    TU_OK(pkv_seq_release(c, r[2])); /* 3, 4 CACHED */
    TU_OK(pkv_seq_release(c, r[3])); /* 5, 7 FREE: one id of slack each */
    for (uint32_t i = 0; i < 2; i++) TU_WRITE_PAT(c, r[i], 0, 8, i + 1);
    TU_OK(pkv_batch_compact(c, r, 2, 1, PKV_BATCH_CACHED, &moved));
    assert_int_equal(moved, 5); /* r0: two exchanges; r1: 1 to 5 */
    table_is(c, r[0], (const int32_t[]){2, 3}, 2);
    table_is(c, r[1], (const int32_t[]){5, 6}, 2);
    for (uint32_t i = 0; i < 2; i++) TU_SAME_PAT(c, r[i], 0, 8, i + 1);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- exhaustion: N blocks filled exactly, one more fails cleanly, all N reusable (FIFO) ---- */
static void test_exhaustion_and_reuse(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(8);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[3];
    s[0] = tu_seq(c);
    s[1] = tu_seq(c);
    s[2] = tu_seq(c);
    tu_append(c, s[0], 20, 0, NULL); /* [0..4] */
    tu_append(c, s[1], 12, 0, NULL); /* [5,6,7] */
    snap before;
    take(c, s, 3, &before);
    assert_int_equal(before.st.n_free, 0);
    assert_int_equal(before.st.n_active, 8);
    assert_int_equal(before.st.n_slots_used, 32);
    int32_t toks[40];
    tu_tokens(toks, 40, 0);
    TU_RC(pkv_seq_append(c, s[1], toks, 1, NULL), PKV_ENOSPC);
    assert_same(c, s, &before);
    TU_RC(pkv_seq_append(c, s[2], toks, 1, NULL), PKV_ENOSPC);
    assert_same(c, s, &before);
    TU_RC(pkv_seq_append(c, s[2], toks, 32, NULL), PKV_ENOSPC); /* 8 blocks: the cap, none free */
    assert_same(c, s, &before);
    TU_OK(pkv_seq_append(c, s[2], toks, 0, NULL)); /* zero positions: always fine */
    assert_same(c, s, &before);
    /* release s0 (deepest first): the queue is 4,3,2,1,0 */
    TU_OK(pkv_seq_release(c, s[0]));
    s[0] = tu_seq(c);
    int32_t tab[8];
    tu_append(c, s[0], 17, 0, NULL);
    assert_int_equal(tu_table(c, s[0], tab, 8), 5);
    const int32_t want0[5] = {4, 3, 2, 1, 0};
    assert_memory_equal(tab, want0, sizeof want0);
    TU_RC(pkv_seq_append(c, s[2], toks, 1, NULL), PKV_ENOSPC);
    /* everything released: all 8 reusable by one sequence */
    TU_OK(pkv_seq_release(c, s[1])); /* queue 7,6,5 */
    TU_OK(pkv_seq_release(c, s[0])); /* then 0,1,2,3,4 */
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_free, 8);
    assert_int_equal(st.n_active, 0);
    tu_append(c, s[2], 32, 0, NULL);
    assert_int_equal(tu_table(c, s[2], tab, 8), 8);
    const int32_t want2[8] = {7, 6, 5, 0, 1, 2, 3, 4};
    assert_memory_equal(tab, want2, sizeof want2);
    TU_WRITE_PAT(c, s[2], 0, 32, 4);
    TU_SAME_PAT(c, s[2], 0, 32, 4);
    st = tu_stats(c);
    assert_int_equal(st.n_free, 0);
    assert_int_equal(st.peak_active, 8);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- limits: max_blocks_per_seq and max_seqs (pins included) ---- */
static void test_limits(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    cfg.max_blocks_per_seq = 3;
    cfg.max_seqs = 3;
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[3];
    s[0] = tu_seq(c);
    tu_append(c, s[0], 12, 0, NULL); /* 3 blocks: the cap */
    int32_t toks[16];
    tu_tokens(toks, 16, 0);
    snap before;
    take(c, s, 1, &before);
    TU_RC(pkv_seq_append(c, s[0], toks, 1, NULL), PKV_ELIMIT);
    assert_same(c, s, &before);
    s[1] = tu_seq(c);
    take(c, s, 2, &before);
    TU_RC(pkv_seq_append(c, s[1], toks, 13, NULL), PKV_ELIMIT);
    assert_same(c, s, &before);
    TU_OK(pkv_seq_append(c, s[1], toks, 11, NULL));
    /* a fork of a full-cap sequence cannot grow either */
    TU_OK(pkv_seq_fork(c, s[0], &s[2]));
    take(c, s, 3, &before);
    TU_RC(pkv_seq_append(c, s[2], toks, 1, NULL), PKV_ELIMIT);
    assert_same(c, s, &before);
    /* max_seqs = 3: create, fork and pin refuse */
    pkv_seq x = 0;
    TU_RC(pkv_seq_create(c, NULL, 0, &x), PKV_ELIMIT);
    assert_same(c, s, &before);
    TU_RC(pkv_seq_fork(c, s[0], &x), PKV_ELIMIT);
    assert_same(c, s, &before);
    TU_RC(pkv_pin_create(c, s[0], 0, &x), PKV_ELIMIT);
    assert_same(c, s, &before);
    TU_OK(pkv_seq_release(c, s[2]));
    TU_OK(pkv_seq_create(c, NULL, 0, &s[2]));
    assert_int_equal(tu_stats(c).n_seqs, 3);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- truncate: frees blocks past n, no-op for n >= length ---- */
static void test_truncate_frees(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    tu_append(c, s, 10, 0, NULL); /* [0,1,2] */
    TU_WRITE_PAT(c, s, 0, 10, 11);
    TU_OK(pkv_seq_commit(c, s, 7));
    TU_OK(pkv_seq_truncate(c, s, 10)); /* no-op */
    TU_OK(pkv_seq_truncate(c, s, 1000));
    pkv_seq_info in = tu_info(c, s);
    assert_int_equal(in.n_tokens, 10);
    assert_int_equal(in.n_committed, 7);
    assert_int_equal(tu_stats(c).n_active, 3);
    TU_OK(pkv_seq_truncate(c, s, 5));
    in = tu_info(c, s);
    assert_int_equal(in.n_tokens, 5);
    assert_int_equal(in.n_blocks, 2);
    assert_int_equal(in.n_committed, 5);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_active, 2);
    assert_int_equal(st.n_free, 14);
    assert_int_equal(st.n_tokens, 5);
    assert_int_equal(st.n_slots_used, 5);
    TU_SAME_PAT(c, s, 0, 5, 11);
    TU_OK(pkv_seq_truncate(c, s, 4));
    assert_int_equal(tu_info(c, s).n_blocks, 1);
    TU_OK(pkv_seq_truncate(c, s, 0));
    in = tu_info(c, s);
    assert_int_equal(in.n_tokens, 0);
    assert_int_equal(in.n_blocks, 0);
    assert_int_equal(in.n_committed, 0);
    st = tu_stats(c);
    assert_int_equal(st.n_active, 0);
    assert_int_equal(st.n_free, 16);
    TU_CHECK(c);
    /* the emptied sequence is usable again */
    tu_append(c, s, 3, 0, NULL);
    TU_WRITE_PAT(c, s, 0, 3, 12);
    TU_SAME_PAT(c, s, 0, 3, 12);
    pkv_cache_destroy(c);
}

/* ---- truncate then append rewrites the freed positions (own, unshared tail) ---- */
static void test_truncate_then_append_rewrites(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s = tu_seq(c);
    int32_t sl[8];
    tu_append(c, s, 8, 0, sl); /* [0,1] */
    TU_WRITE_PAT(c, s, 0, 8, 21);
    TU_OK(pkv_seq_commit(c, s, 8));
    TU_OK(pkv_seq_truncate(c, s, 6)); /* committed 6; block 1 keeps 2 */
    assert_int_equal(tu_info(c, s).n_committed, 6);
    int32_t toks[2] = {500, 501}, sl2[2];
    TU_OK(pkv_seq_append(c, s, toks, 2, sl2));
    assert_int_equal(sl2[0], sl[6]); /* same block, same slots: no new block, no copy */
    assert_int_equal(sl2[1], sl[7]);
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_active, 2);
    assert_int_equal(st.cow_copies, 0);
    TU_WRITE_PAT(c, s, 6, 2, 22); /* positions past the committed count are writable again */
    TU_SAME_PAT(c, s, 0, 6, 21);
    TU_SAME_PAT(c, s, 6, 2, 22);
    /* a committed position stays immutable */
    float junk[16] = {0};
    TU_RC(pkv_write_kv(c, 0, &sl[5], 1, junk, junk, PKV_DTYPE_F32), PKV_EINVAL);
    TU_SAME_PAT(c, s, 0, 6, 21);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- truncating into a shared block leaves the other sequence's data alone ---- */
static void test_truncate_shared(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq p = tu_seq(c), ch;
    tu_append(c, p, 10, 0, NULL); /* [0,1,2] */
    TU_WRITE_PAT(c, p, 0, 10, 31);
    TU_OK(pkv_seq_fork(c, p, &ch));
    TU_OK(pkv_seq_truncate(c, ch, 5)); /* ch keeps [0,1]; 1 still shared, 2 only p's */
    pkv_seq_info ic = tu_info(c, ch), ip = tu_info(c, p);
    assert_int_equal(ic.n_tokens, 5);
    assert_int_equal(ic.n_blocks, 2);
    assert_int_equal(ic.n_shared, 2);
    assert_int_equal(ip.n_shared, 2);
    assert_int_equal(tu_stats(c).n_active, 3);
    TU_SAME_PAT(c, p, 0, 10, 31);
    TU_CHECK(c);
    int32_t tok = 77, slot;
    TU_OK(pkv_seq_append(c, ch, &tok, 1, &slot)); /* position 5 in shared block 1: CoW */
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.cow_copies, 1);
    int32_t tc[4], tp[4];
    tu_table(c, ch, tc, 4);
    tu_table(c, p, tp, 4);
    assert_int_equal(tc[0], tp[0]);
    assert_true(tc[1] != tp[1] && tc[1] != tp[2]);
    TU_WRITE_PAT(c, ch, 5, 1, 32);
    TU_SAME_PAT(c, p, 0, 10, 31);
    TU_SAME_PAT(c, ch, 0, 5, 31);
    TU_SAME_PAT(c, ch, 5, 1, 32);
    /* the parent truncates into its (no longer shared) block 1 and rewrites */
    TU_OK(pkv_seq_truncate(c, p, 6));
    TU_WRITE_PAT(c, p, 5, 1, 33);
    TU_SAME_PAT(c, ch, 5, 1, 32);
    TU_SAME_PAT(c, p, 0, 5, 31);
    TU_SAME_PAT(c, p, 5, 1, 33);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- a block that was shared when truncated, then became sole-owned: the positions past
 * the sequence's committed count must be writable after append (pkv.h: "at a position not
 * yet committed") ---- */
static void test_truncate_shared_then_sole_owner_writes(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq p = tu_seq(c), ch;
    tu_append(c, p, 8, 0, NULL); /* [0,1] full */
    TU_WRITE_PAT(c, p, 0, 8, 41);
    TU_OK(pkv_seq_commit(c, p, 8));
    TU_OK(pkv_seq_fork(c, p, &ch));
    TU_OK(pkv_seq_truncate(c, ch, 6)); /* block 1 shared: only dereferenced */
    assert_int_equal(tu_info(c, ch).n_committed, 6);
    TU_OK(pkv_seq_release(c, p)); /* block 1 now only ch's */
    assert_int_equal(tu_info(c, ch).n_shared, 0);
    int32_t toks[2] = {90, 91}, sl[2];
    TU_OK(pkv_seq_append(c, ch, toks, 2, sl));
    TU_WRITE_PAT(c, ch, 6, 2, 42);
    TU_SAME_PAT(c, ch, 0, 6, 41);
    TU_SAME_PAT(c, ch, 6, 2, 42);
    TU_OK(pkv_seq_commit(c, ch, 8));
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- release makes ids stale; pkv_cache_reset frees everything ---- */
static void test_release_and_reset(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq a = tu_seq(c), b = tu_seq(c);
    tu_append(c, a, 9, 0, NULL);
    TU_OK(pkv_seq_fork(c, a, &b));
    TU_OK(pkv_seq_release(c, a));
    pkv_seq_info in;
    TU_RC(pkv_seq_get_info(c, a, &in), PKV_ENOENT);
    TU_RC(pkv_seq_release(c, a), PKV_ENOENT);
    pkv_seq a2 = tu_seq(c); /* may reuse a's index, never its id */
    assert_true(a2 != a);
    TU_RC(pkv_seq_get_info(c, a, &in), PKV_ENOENT);
    assert_int_equal(tu_stats(c).n_active, 3);
    TU_OK(pkv_cache_reset(c));
    pkv_stats st = tu_stats(c);
    assert_int_equal(st.n_free, 16);
    assert_int_equal(st.n_active, 0);
    assert_int_equal(st.n_seqs, 0);
    assert_int_equal(st.n_tokens, 0);
    TU_RC(pkv_seq_get_info(c, b, &in), PKV_ENOENT);
    TU_RC(pkv_seq_get_info(c, a2, &in), PKV_ENOENT);
    TU_CHECK(c);
    pkv_seq s = tu_seq(c);
    tu_append(c, s, 64, 0, NULL);
    assert_int_equal(tu_stats(c).n_free, 0);
    pkv_cache_destroy(c);
}

/* ---- reset empties the cache but the statistics' counters and peak_active go on (pkv.h) ---- */
static void test_reset_keeps_counters(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(16);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq a = tu_seq(c), b;
    tu_append(c, a, 10, 0, NULL); /* 3 blocks */
    TU_OK(pkv_seq_fork(c, a, &b));
    tu_append(c, b, 1, 10, NULL); /* CoW of the shared tail: 4 ACTIVE */
    pkv_seq d = tu_seq(c);
    tu_append(c, d, 8, 50, NULL); /* 6 ACTIVE */
    TU_OK(pkv_seq_release(c, d));
    pkv_stats before = tu_stats(c);
    assert_int_equal(before.peak_active, 6);
    assert_int_equal(before.n_active, 4);
    assert_int_equal(before.cow_copies, 1);
    TU_OK(pkv_cache_reset(c));
    pkv_stats after = tu_stats(c);
    assert_int_equal(after.n_active, 0);
    assert_int_equal(after.n_free, 16);
    assert_int_equal(after.peak_active, 6); /* not 0: the high-water mark survives a reset */
    assert_int_equal(after.cow_copies, 1);
    TU_CHECK(c);
    /* and it keeps counting from there: below the old peak nothing moves, above it it rises */
    pkv_seq e = tu_seq(c);
    tu_append(c, e, 4 * 5, 0, NULL);
    assert_int_equal(tu_stats(c).peak_active, 6);
    tu_append(c, e, 4 * 2, 20, NULL);
    assert_int_equal(tu_stats(c).peak_active, 7);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* ---- pkv_batch_append: a step's appends in one call ---- */
/* By hand: 4 blocks of 4. s1 holds 3 positions (block 0), s2 4 (block 1): 2 FREE. */
static void test_batch_append_exact(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(4);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), tu_seq(c)};
    tu_append(c, s[0], 3, 0, NULL);
    tu_append(c, s[1], 4, 100, NULL);
    int32_t t0[2] = {3, 4}, t1[1] = {104}, sl0[2], sl1[1];
    /* s1 + 2 takes block 2 (its tail has one place left), s2 + 1 takes block 3: both fit */
    pkv_append_req r[2] = {{s[0], t0, 2, sl0}, {s[1], t1, 1, sl1}};
    uint32_t done = 99;
    TU_OK(pkv_batch_append(c, r, 2, 0, &done));
    assert_int_equal(done, 2);
    assert_int_equal(sl0[0], 3), assert_int_equal(sl0[1], 8), assert_int_equal(sl1[0], 12);
    assert_int_equal(tu_stats(c).n_free, 0);
    TU_CHECK(c);
    /* nothing left: s2 + 3 fits its tail (0 blocks), s1 + 4 needs one; all or none: none */
    snap before;
    take(c, s, 2, &before);
    int32_t t2[4] = {5, 6, 7, 8}, t3[3] = {105, 106, 107};
    pkv_append_req r2[2] = {{s[1], t3, 3, NULL}, {s[0], t2, 4, NULL}};
    done = 99;
    TU_RC(pkv_batch_append(c, r2, 2, 0, &done), PKV_ENOSPC);
    assert_int_equal(done, 99);
    assert_same(c, s, &before);
    /* first come, first served: the first fits, the second is left */
    TU_OK(pkv_batch_append(c, r2, 2, PKV_APPEND_FIT, &done));
    assert_int_equal(done, 1);
    assert_int_equal(tu_info(c, s[1]).n_tokens, 8);
    assert_int_equal(tu_info(c, s[0]).n_tokens, 5);
    /* none fits: k = 0 is a success; an empty batch too */
    TU_OK(pkv_batch_append(c, r2 + 1, 1, PKV_APPEND_FIT, &done));
    assert_int_equal(done, 0);
    TU_OK(pkv_batch_append(c, NULL, 0, 0, NULL));
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* Twin caches, each with two sequences of 6 tokens whose tails are indexed blocks each holds
 * alone (8 committed, truncated to 6), and one block FREE. */
static void assert_twins(pkv_cache *const cc[2], pkv_seq s[2][8], uint32_t n);
static void two_indexed_tails(pkv_cache *cc[2], pkv_seq s[2][8]) {
    pkv_config cfg = cfg_small(5);
    cfg.enable_prefix_cache = 1;
    for (int w = 0; w < 2; w++) {
        cc[w] = tu_create(&cfg);
        for (int i = 0; i < 2; i++) {
            s[w][i] = tu_seq(cc[w]);
            tu_append(cc[w], s[w][i], 8, 100 * i, NULL);
            TU_OK(pkv_seq_commit(cc[w], s[w][i], 8));   /* both blocks indexed */
            TU_OK(pkv_seq_truncate(cc[w], s[w][i], 6)); /* tail: an indexed block, refcount 1 */
        }
    }
    const pkv_stats st = tu_stats(cc[0]);
    assert_int_equal(st.n_free, 1);
    assert_int_equal(st.n_cached, 0);
}

/* Appending one token to each of two_indexed_tails' sequences copies its tail
 * (pkv_seq_append_blocks 1 each), and the old tail turns CACHED, so the first leaves n_free +
 * n_cached as it found them and the second fits too (it evicts the first's old tail), as one
 * append after the other does; counting 1 + 1 against the 1 there at the start would refuse
 * the second. A copy with a new block after it gives nothing back (the new block may take the
 * old tail): 3 tokens to the first (count 1) leave 0, and the second is refused. */
static void test_batch_append_tail_given_back(void **state) {
    (void)state;
    pkv_cache *cc[2];
    pkv_seq s[2][8];
    two_indexed_tails(cc, s);
    uint32_t need[2];
    for (int i = 0; i < 2; i++) TU_OK(pkv_seq_append_blocks(cc[0], s[0][i], 1, &need[i]));
    assert_int_equal(need[0], 1), assert_int_equal(need[1], 1);
    int32_t t[3] = {50, 150, 250}, sl[2][2];
    pkv_append_req r[2] = {{s[0][0], t, 1, sl[0]}, {s[0][1], t + 1, 1, sl[0] + 1}};
    uint32_t done = 99;
    TU_OK(pkv_batch_append(cc[0], r, 2, 0, &done));
    assert_int_equal(done, 2);
    for (int i = 0; i < 2; i++) TU_OK(pkv_seq_append(cc[1], s[1][i], t + i, 1, sl[1] + i));
    assert_memory_equal(sl[0], sl[1], sizeof sl[0]);
    assert_twins(cc, s, 2);
    pkv_stats st = tu_stats(cc[0]);
    assert_int_equal(st.cow_copies, 2);
    assert_int_equal(st.evictions, 1); /* the second copy took the first's old tail */
    assert_int_equal(st.n_free + st.n_cached, 1);
    for (int w = 0; w < 2; w++) {
        TU_CHECK(cc[w]);
        pkv_cache_destroy(cc[w]);
    }
    two_indexed_tails(cc, s);
    TU_OK(pkv_seq_append_blocks(cc[0], s[0][0], 3, &need[0]));
    assert_int_equal(need[0], 1); /* the copy and a new block, less the old tail evicted */
    r[0].seq = s[0][0], r[0].n = 3, r[1].seq = s[0][1];
    snap before;
    take(cc[0], s[0], 2, &before);
    TU_RC(pkv_batch_append(cc[0], r, 2, 0, &done), PKV_ENOSPC);
    assert_same(cc[0], s[0], &before);
    TU_OK(pkv_batch_append(cc[0], r, 2, PKV_APPEND_FIT, &done));
    assert_int_equal(done, 1);
    TU_OK(pkv_seq_append(cc[1], s[1][0], t, 3, NULL));
    TU_RC(pkv_seq_append(cc[1], s[1][1], t + 1, 1, NULL), PKV_ENOSPC);
    assert_twins(cc, s, 2);
    for (int w = 0; w < 2; w++) {
        TU_CHECK(cc[w]);
        pkv_cache_destroy(cc[w]);
    }
}

/* A beam step: a sequence and its fork share a partly filled tail, one block is FREE. Each
 * alone counts a copy (pkv_seq_append_blocks 1 each), but in one batch the first copies the
 * tail and the last then holds it alone and appends in place: 1 block in all, which fits. */
static void test_batch_append_forks_share_a_tail(void **state) {
    (void)state;
    pkv_config cfg = cfg_small(2);
    pkv_cache *c = tu_create(&cfg);
    pkv_seq s[2] = {tu_seq(c), 0};
    tu_append(c, s[0], 2, 0, NULL);
    TU_OK(pkv_seq_fork(c, s[0], &s[1]));
    uint32_t need[2];
    TU_OK(pkv_seq_append_blocks(c, s[0], 1, &need[0]));
    TU_OK(pkv_seq_append_blocks(c, s[1], 1, &need[1]));
    assert_int_equal(need[0] + need[1], 2);
    assert_int_equal(tu_stats(c).n_free, 1);
    int32_t t0 = 7, t1 = 8, sl0, sl1;
    const pkv_append_req r[2] = {{s[0], &t0, 1, &sl0}, {s[1], &t1, 1, &sl1}};
    uint32_t done;
    TU_OK(pkv_batch_append(c, r, 2, 0, &done));
    assert_int_equal(done, 2);
    assert_int_equal(sl0, 4 + 2); /* s[0] copied the tail into block 1 */
    assert_int_equal(sl1, 2);     /* s[1] appended in place in block 0 */
    assert_int_equal(tu_stats(c).n_free, 0);
    assert_int_equal(tu_stats(c).cow_copies, 1);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* The twin caches alike: stats, and each of the n sequences' table and length. */
static void assert_twins(pkv_cache *const cc[2], pkv_seq s[2][8], uint32_t n) {
    const pkv_stats a = tu_stats(cc[0]), b = tu_stats(cc[1]);
    TU_STATS_EQ(&a, &b);
    for (uint32_t i = 0; i < n; i++) {
        int32_t ta[64], tb[64];
        const uint32_t na = tu_table(cc[0], s[0][i], ta, 64), nb = tu_table(cc[1], s[1][i], tb, 64);
        assert_int_equal(na, nb);
        assert_memory_equal(ta, tb, na * sizeof(int32_t));
        assert_int_equal(tu_info(cc[0], s[0][i]).n_tokens, tu_info(cc[1], s[1][i]).n_tokens);
    }
}

/* Twin caches built by the same calls (prefix caching on, forks, commits, truncates and
 * releases, so tails are shared, indexed or held alone), then one random batch: cache A takes
 * it in one pkv_batch_append, cache B one pkv_seq_append per request in order, each counted by
 * pkv_seq_append_blocks just before it. A succeeds iff those counts fit (the leading run of
 * them with PKV_APPEND_FIT), ends where B ends (stats, tables, slots), and a refused A is
 * unchanged. */
static void test_batch_append_oracle(void **state) {
    (void)state;
    tu_rng rng;
    tu_rng_seed(&rng, tu_env_u64("PKV_TEST_SEED", 0xba7c4));
    const uint32_t rounds = (uint32_t)tu_env_u64("PKV_BATCH_APPEND_ROUNDS", 1000);
    uint32_t n_fit = 0, n_nospc = 0, n_part = 0, n_shared = 0, n_back = 0;
    for (uint32_t round = 0; round < rounds; round++) {
        pkv_config cfg = cfg_small(6 + tu_rng_below(&rng, 14));
        cfg.enable_prefix_cache = 1;
        pkv_cache *cc[2] = {tu_create(&cfg), tu_create(&cfg)};
        pkv_seq s[2][8];
        uint32_t n = 0;
        int32_t tok[16];
        for (uint32_t step = 0; step < 14; step++) {
            const uint32_t op = tu_rng_below(&rng, 8), i = n ? tu_rng_below(&rng, n) : 0;
            const uint32_t k = 1 + tu_rng_below(&rng, 7), at = tu_rng_below(&rng, 3) * 20;
            tu_tokens(tok, k, (int32_t)at); /* few distinct prompts: blocks are found again */
            /* what to do, chosen once for both twins (n changes on the first) */
            const int kind = op <= 1 && n < 8            ? 1
                             : op == 2 && n && n < 8       ? 2
                             : op == 3 && n                ? 3
                             : op == 4 && n > 1            ? 4
                             : op >= 6 && n                ? 6
                             : n                           ? 5
                                                           : 0;
            if (kind == 1 || kind == 2) n++;
            if (kind == 1) s[0][n - 1] = tu_seq(cc[0]), s[1][n - 1] = tu_seq(cc[1]);
            for (int w = 0; w < 2; w++) {
                pkv_cache *c = cc[w];
                if (kind == 1) {
                    uint32_t got;
                    TU_OK(pkv_seq_match_prefix(c, s[w][n - 1], tok, k, &got));
                    const int rc = pkv_seq_append(c, s[w][n - 1], tok + got, k - got, NULL);
                    assert_true(rc == PKV_OK || rc == PKV_ENOSPC);
                    if (!rc) TU_OK(pkv_seq_commit(c, s[w][n - 1], tu_info(c, s[w][n - 1]).n_tokens));
                } else if (kind == 2) {
                    TU_OK(pkv_seq_fork(c, s[w][i], &s[w][n - 1]));
                } else if (kind == 3) {
                    const uint32_t len = tu_info(c, s[w][i]).n_tokens;
                    TU_OK(pkv_seq_truncate(c, s[w][i], len - len / 3));
                } else if (kind == 4) {
                    TU_OK(pkv_seq_release(c, s[w][i]));
                    s[w][i] = s[w][n - 1];
                } else if (kind == 5) {
                    const int rc = pkv_seq_append(c, s[w][i], tok, k, NULL);
                    assert_true(rc == PKV_OK || rc == PKV_ENOSPC || rc == PKV_ELIMIT);
                } else if (kind == 6) { /* commit, then cut into the last full block: an indexed tail */
                    const uint32_t len = tu_info(c, s[w][i]).n_tokens, full = len / cfg.block_tokens * cfg.block_tokens;
                    TU_OK(pkv_seq_commit(c, s[w][i], len));
                    if (full) TU_OK(pkv_seq_truncate(c, s[w][i], full - 1));
                }
            }
            if (kind == 4) n--;
        }
        if (!n) {
            pkv_cache_destroy(cc[0]), pkv_cache_destroy(cc[1]);
            continue;
        }
        if (tu_rng_chance(&rng, 0.4)) { /* a filler sequence leaves 0-2 blocks: a tight batch */
            const uint32_t left = tu_rng_below(&rng, 3);
            for (int w = 0; w < 2; w++) {
                pkv_seq f = tu_seq(cc[w]);
                const int32_t one = 9999;
                for (pkv_stats st = tu_stats(cc[w]); st.n_free + st.n_cached > left; st = tu_stats(cc[w]))
                    if (pkv_seq_append(cc[w], f, &one, 1, NULL) != PKV_OK) break; /* past its limit */
            }
        }
        assert_twins(cc, s, n);
        /* the batch: distinct sequences in a random order */
        uint32_t order[8], m = 1 + tu_rng_below(&rng, n);
        for (uint32_t i = 0; i < n; i++) order[i] = i;
        for (uint32_t i = n; i > 1; i--) {
            const uint32_t j = tu_rng_below(&rng, i), t = order[i - 1];
            order[i - 1] = order[j], order[j] = t;
        }
        pkv_append_req req[8];
        int32_t slots[2][8][9], toks[8][9];
        const pkv_stats st = tu_stats(cc[0]);
        const uint64_t avail = (uint64_t)st.n_free + st.n_cached;
        uint64_t alone = 0; /* the counts taken alone, before any of the batch is appended */
        bool limit = false;
        for (uint32_t r = 0; r < m; r++) {
            const uint32_t k = tu_rng_below(&rng, tu_rng_chance(&rng, 0.5) ? 3 : 10); /* some within a tail */
            tu_tokens(toks[r], k, 7000 + (int32_t)r);
            req[r] = (pkv_append_req){s[0][order[r]], toks[r], k, slots[0][r]};
            uint32_t need;
            const int rc = pkv_seq_append_blocks(cc[0], req[r].seq, k, &need);
            assert_true(rc == PKV_OK || rc == PKV_ELIMIT);
            limit |= rc == PKV_ELIMIT;
            alone += rc ? 0 : need;
        }
        /* B: one append after another until one is refused, each counted just before it (and
           refused iff its count is past what is left then) */
        uint64_t sum = 0;
        uint32_t fit = 0;
        for (uint32_t r = 0; r < m && !limit; r++) {
            uint32_t need;
            TU_OK(pkv_seq_append_blocks(cc[1], s[1][order[r]], req[r].n, &need));
            const pkv_stats now = tu_stats(cc[1]);
            const int rc_b = pkv_seq_append(cc[1], s[1][order[r]], toks[r], req[r].n, slots[1][r]);
            TU_RC(rc_b, need <= (uint64_t)now.n_free + now.n_cached ? PKV_OK : PKV_ENOSPC);
            if (rc_b) break;
            sum += need;
            fit = r + 1;
        }
        n_shared += !limit && sum < alone; /* a tail shared in the batch: copied once less */
        n_back += !limit && sum > avail;   /* fits only as the appends go: a copied tail given back */
        const uint32_t flags = tu_rng_chance(&rng, 0.5) ? PKV_APPEND_FIT : 0;
        snap before;
        take(cc[0], s[0], n, &before);
        uint32_t done = 99;
        const int rc = pkv_batch_append(cc[0], req, m, flags, &done);
        if (limit) {
            TU_RC(rc, PKV_ELIMIT);
            assert_same(cc[0], s[0], &before);
        } else if (fit < m && !flags) {
            TU_RC(rc, PKV_ENOSPC);
            assert_same(cc[0], s[0], &before);
            n_nospc++;
        } else {
            TU_OK(rc);
            assert_int_equal(done, fit);
            n_fit += fit == m, n_part += fit < m;
            for (uint32_t r = 0; r < fit; r++)
                assert_memory_equal(slots[0][r], slots[1][r], req[r].n * sizeof(int32_t));
            assert_twins(cc, s, n);
            TU_CHECK(cc[0]);
        }
        pkv_cache_destroy(cc[0]), pkv_cache_destroy(cc[1]);
    }
    /* every outcome met: all appended, some (PKV_APPEND_FIT), none (ENOSPC), batches whose
       counts taken alone overstate (forks sharing a tail, which only the last does not copy),
       and batches that fit only because a copied tail is given back as the appends go */
    print_message("batch append: %u all, %u a leading run, %u ENOSPC, %u with a shared tail, %u past the counts "
                  "taken at the start, of %u rounds\n",
                  n_fit, n_part, n_nospc, n_shared, n_back, rounds);
    assert_true(n_fit > 0 && n_part > 0 && n_nospc > 0 && n_shared > 0 && n_back > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fork_cow_isolation),
        cmocka_unit_test(test_fork_full_tail_no_cow),
        cmocka_unit_test(test_cow_enospc),
        cmocka_unit_test(test_exhaustion_and_reuse),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_cow_sole_indexed_tail_counts),
        cmocka_unit_test(test_batch_append_exact),
        cmocka_unit_test(test_batch_append_forks_share_a_tail),
        cmocka_unit_test(test_batch_append_tail_given_back),
        cmocka_unit_test(test_batch_append_oracle),
        cmocka_unit_test(test_truncate_frees),
        cmocka_unit_test(test_truncate_then_append_rewrites),
        cmocka_unit_test(test_truncate_shared),
        cmocka_unit_test(test_truncate_shared_then_sole_owner_writes),
        cmocka_unit_test(test_release_and_reset),
        cmocka_unit_test(test_reset_keeps_counters),
        cmocka_unit_test(test_compact_seed_layout),
        cmocka_unit_test(test_compact_chain_partial_tail),
        cmocka_unit_test(test_compact_short_shift),
        cmocka_unit_test(test_compact_shared_indexed_bad),
        cmocka_unit_test(test_compact_evict),
        cmocka_unit_test(test_batch_compact),
        cmocka_unit_test(test_batch_compact_slack),
        cmocka_unit_test(test_batch_compact_stable),
        cmocka_unit_test(test_batch_compact_choices),
        cmocka_unit_test(test_compact_cached),
        cmocka_unit_test(test_batch_compact_kept_slack),
        cmocka_unit_test(test_batch_compact_cached),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
