/* test_core_check.c: the invariant checker finds what it says it checks. Every stress, fuzz and
 * model test takes pkv_cache_check's PKV_OK as proof that the state is sound, so each of its
 * checks is shown to fire here: a sound state with every kind of block (FREE, CACHED, ACTIVE
 * shared by a fork and a pin, indexed chains, a partial tail) is built through the API, one
 * field of the metadata is broken through the internal headers, and the checker must answer
 * PKV_ECORRUPT with a message that names the broken invariant (57 of its 75 checks; the rest
 * guard cycles, retired slots, the table capacity and states no field write reaches alone). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"
#include "cache/cache_int.h"

#include <stdio.h>
#include <string.h>

enum { B = 4 };

/* The state: a committed 10-token sequence a (blocks 0-1 indexed, its tail a partial), a fork f
 * of it, a pin of its first 8 tokens, a sequence b that reused a's prefix and went on (its tail
 * a second partial under a's block 1), a sequence whose committed blocks were released (CACHED,
 * in the LRU queue), and a sequence r of 2 committed tokens that begin like a's: its block, a
 * partial root, on the root list of a's root. */
typedef struct world {
    pkv_cache *c;
    pkv_seq a, f, pin, b, r;
    int32_t ta[4], tb[8], tr;
    uint32_t na, nb;
} world;

static void world_make(world *w) {
    memset(w, 0, sizeof *w);
    pkv_config cfg = tu_config(32, B, 1, 1, 4, PKV_DTYPE_F32);
    cfg.enable_prefix_cache = 1;
    cfg.max_seqs = 8;
    w->c = tu_create(&cfg);
    int32_t p[24];
    tu_tokens(p, 24, 100);
    w->a = tu_seq(w->c);
    TU_OK(pkv_seq_append(w->c, w->a, p, 10, NULL));
    TU_OK(pkv_seq_commit(w->c, w->a, 10));
    TU_OK(pkv_seq_fork(w->c, w->a, &w->f));
    TU_OK(pkv_pin_create(w->c, w->a, 8, &w->pin));
    w->b = tu_seq(w->c);
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(w->c, w->b, p, 11, &reused)); /* 8 in whole blocks, 2 from a's tail */
    assert_int_equal(reused, 10);
    TU_OK(pkv_seq_append(w->c, w->b, p + 10, 4, NULL));
    pkv_seq gone = tu_seq(w->c);
    int32_t g[8];
    tu_tokens(g, 8, 500);
    TU_OK(pkv_seq_append(w->c, gone, g, 8, NULL));
    TU_OK(pkv_seq_commit(w->c, gone, 8));
    TU_OK(pkv_seq_release(w->c, gone));
    w->r = tu_seq(w->c);
    const int32_t rp[2] = {p[0], -1};
    TU_OK(pkv_seq_append(w->c, w->r, rp, 2, NULL));
    TU_OK(pkv_seq_commit(w->c, w->r, 2));
    assert_int_equal(tu_table(w->c, w->r, &w->tr, 1), 1);
    w->na = tu_table(w->c, w->a, w->ta, 4);
    w->nb = tu_table(w->c, w->b, w->tb, 8);
    assert_int_equal(w->na, 3);
    TU_CHECK(w->c);
    /* the kinds of block the cases below break */
    const pkv_cache *c = w->c;
    assert_true(c->pool.n_free > 0 && c->pool.n_cached == 2);
    assert_true(c->blk[w->ta[0]].flags & PKV_BLKF_INDEXED);
    assert_int_equal(c->blk[w->ta[0]].ref, 4); /* a, f, the pin, b */
    assert_true(c->blk[w->ta[2]].flags & PKV_BLKF_PARTIAL);
    assert_true(c->blk[w->tb[2]].flags & PKV_BLKF_PARTIAL);
    assert_int_equal(c->blk[w->ta[1]].child, w->tb[2]); /* newest first: b's tail, then a's */
    assert_int_equal(c->blk[w->tb[2]].sib_next, w->ta[2]);
    assert_true(c->blk[w->tr].flags & PKV_BLKF_PARTIAL);
    assert_int_equal(c->blk[w->tr].parent, PKV_NONE);
    assert_int_equal(*pkv__tree_head(w->c, (uint32_t)w->tr), w->tr); /* r's root, then a's */
    assert_int_equal(c->blk[w->tr].sib_next, w->ta[0]);
}

typedef void (*breaker)(world *w);

/* Builds the world, breaks it, and expects PKV_ECORRUPT with `want` in the message; the cache
 * is then destroyed as it is (destroy walks no metadata). */
static void expect_corrupt(breaker brk, const char *want) {
    world w;
    world_make(&w);
    brk(&w);
    char msg[256];
    const int rc = pkv_cache_check(w.c, msg, sizeof msg);
    if (rc != PKV_ECORRUPT || !strstr(msg, want))
        fail_msg("checker: rc %d, message \"%s\"; want PKV_ECORRUPT and \"%s\"", rc, msg, want);
    /* no message buffer: the status alone; a short one: truncated, still terminated */
    assert_int_equal(pkv_cache_check(w.c, NULL, 0), PKV_ECORRUPT);
    char small[8];
    memset(small, 'x', sizeof small);
    assert_int_equal(pkv_cache_check(w.c, small, sizeof small), PKV_ECORRUPT);
    assert_int_equal(small[sizeof small - 1], '\0');
    assert_memory_equal(small, msg, sizeof small - 1);
    pkv_cache_destroy(w.c);
}

/* ---- the breakers: one invariant each ---- */
static void free_back_link(world *w) {
    pkv__blk *k = &w->c->blk[w->c->pool.free_head];
    assert_int_not_equal(k->qnext, PKV_NONE);
    w->c->blk[k->qnext].qprev = PKV_NONE;
}
static void free_count(world *w) { w->c->pool.n_free++; }
static void free_state(world *w) { w->c->blk[w->c->pool.free_tail].state = PKV_BLK_ACTIVE; }
static void lru_state(world *w) { w->c->blk[w->c->pool.lru_head].state = PKV_BLK_FREE; }
static void lru_count(world *w) { w->c->pool.n_cached--; }
static void lru_order(world *w) {
    /* the queue holds the released sequence's child before its parent: swap them */
    pkv__pool *p = &w->c->pool;
    const uint32_t x = p->lru_head, y = w->c->blk[x].qnext;
    assert_int_equal(w->c->blk[x].parent, y);
    w->c->blk[y].qprev = PKV_NONE, w->c->blk[y].qnext = x;
    w->c->blk[x].qprev = y, w->c->blk[x].qnext = PKV_NONE;
    p->lru_head = y, p->lru_tail = x;
}
static void refcount(world *w) { w->c->blk[w->ta[0]].ref++; }
static void seq_blocks(world *w) { pkv__seq_get(w->c, w->b)->n_tokens += B; }
static void seq_committed(world *w) { pkv__seq_get(w->c, w->b)->n_committed = 15; }
static void seq_table_free_block(world *w) { pkv__seq_get(w->c, w->b)->table[w->nb - 1] = (int32_t)w->c->pool.free_head; }
static void seq_table_range(world *w) { pkv__seq_get(w->c, w->b)->table[0] = (int32_t)w->c->n_blocks; }
static void seq_fill(world *w) { w->c->blk[w->tb[w->nb - 1]].n_fill = 1; }
static void seq_chain_parent(world *w) { w->c->blk[w->ta[1]].parent = PKV_NONE; }
static void seq_live_count(world *w) { w->c->n_live++; }
static void token_total(world *w) { w->c->n_tokens_total--; }
static void identity(world *w) { w->c->tokens[(size_t)w->ta[1] * B + 2]++; }
static void bucket(world *w) {
    pkv_cache *c = w->c;
    const uint32_t b = (uint32_t)w->ta[0];
    uint32_t *x = &c->buckets[c->blk[b].hash & c->bucket_mask];
    while (*x != b) x = &c->blk[*x].hnext;
    *x = c->blk[b].hnext; /* unlinked from its chain */
}
static void both_flags(world *w) { w->c->blk[w->ta[0]].flags |= PKV_BLKF_PARTIAL; }
static void commit_over_fill(world *w) { w->c->blk[w->ta[2]].n_commit = B; }
static void free_flags(world *w) { w->c->blk[w->c->pool.free_head].flags = PKV_BLKF_PARTIAL; }
static void indexed_not_full(world *w) { w->c->blk[w->c->pool.lru_head].n_commit = B - 1; }
static void slots_used(world *w) { w->c->pool.slots_used++; }
static void indexed_count(world *w) { w->c->n_indexed++; }
static void peak(world *w) { w->c->pool.peak_active = w->c->pool.n_active - 1; }
static void children_count(world *w) { w->c->blk[w->ta[0]].n_children++; }
static void child_of_unindexed(world *w) { w->c->blk[w->c->pool.free_head].child = (uint32_t)w->ta[1]; }
static void partial_parent(world *w) {
    /* out of its parent's child list (so that list stays sound), under a FREE block instead */
    pkv__tree_unlink(w->c, (uint32_t)w->ta[2]);
    w->c->blk[w->ta[2]].parent = w->c->pool.free_head;
}
static void partial_ns(world *w) { w->c->blk[w->ta[2]].ns_lo ^= 1; }
static void child_back_link(world *w) { w->c->blk[w->ta[2]].sib_prev = PKV_NONE; }
static void child_off_list(world *w) { /* off its parent's list (which stays sound), parent kept */
    pkv__tree_unlink(w->c, (uint32_t)w->ta[2]);
    w->c->blk[w->ta[2]].parent = (uint32_t)w->ta[1];
}
static void root_back_link(world *w) { w->c->blk[w->ta[0]].sib_prev = PKV_NONE; }
static void root_off_list(world *w) { pkv__tree_unlink(w->c, (uint32_t)w->tr); }
/* r's root moved, whole and consistent, into another namespace's list: its holder's namespace
   is then the only witness (a match from that namespace would reuse r's K/V) */
static void root_namespace(world *w) {
    pkv__tree_unlink(w->c, (uint32_t)w->tr);
    w->c->blk[w->tr].ns_lo ^= 1;
    pkv__tree_link(w->c, PKV_NONE, (uint32_t)w->tr);
}
/* r's root left on the list of the first token it had */
static void root_wrong_list(world *w) { w->c->tokens[(size_t)w->tr * B] ^= 1; }
/* b's partial tail made a root (off its parent's list, onto a root list, its parent forgotten) */
static void child_as_root(world *w) {
    pkv_cache *c = w->c;
    const pkv__seq *b = pkv__seq_get(c, w->b);
    pkv__tree_unlink(c, (uint32_t)w->tb[2]);
    c->blk[w->tb[2]].ns_lo = b->ns_lo, c->blk[w->tb[2]].ns_hi = b->ns_hi;
    pkv__tree_link(c, PKV_NONE, (uint32_t)w->tb[2]);
}

static void free_cycle(world *w) { w->c->blk[w->c->pool.free_tail].qnext = w->c->pool.free_head; }
static void lru_range(world *w) { w->c->blk[w->c->pool.lru_head].qnext = w->c->n_blocks + 5; }
/* a block that is not indexed left in a hash chain (as an eviction that skipped bucket_remove
   would leave it), and a chain link out of range: the walks of lookup and the checker follow them */
static void chain_stale_entry(world *w) {
    pkv_cache *c = w->c;
    const uint32_t f = c->pool.free_head, b = (uint32_t)w->ta[0];
    uint32_t *x = &c->buckets[c->blk[b].hash & c->bucket_mask];
    c->blk[f].hash = c->blk[b].hash;
    c->blk[f].hnext = *x;
    *x = f;
}
static void chain_link_range(world *w) {
    pkv_cache *c = w->c;
    const uint32_t b = (uint32_t)w->ta[0];
    c->blk[b].hnext = c->n_blocks + 1000000u;
}
static void seq_gen0(world *w) { pkv__seq_get(w->c, w->b)->gen = 0; }
static void seq_idx_len(world *w) { pkv__seq_get(w->c, w->a)->idx_len = 3; }
static void chain_not_indexed(world *w) { w->c->blk[w->ta[1]].flags &= (uint8_t)~PKV_BLKF_INDEXED; }
static void slot_list_live(world *w) {
    w->c->seqs[w->c->seq_free].live = 1; /* a live slot on the free list, counted as live */
    w->c->n_live++;
}
static void slot_list_short(world *w) { w->c->seq_free = PKV_NONE; }
static void state_counts(world *w) { w->c->pool.n_active++; }
/* a queue's tail pointer naming another block of the queue: every link and count is sound, but
   the next push would hang a block after the wrong one */
static void free_tail(world *w) {
    pkv__pool *p = &w->c->pool;
    assert_int_not_equal(p->free_head, p->free_tail);
    p->free_tail = p->free_head;
}
static void lru_tail(world *w) {
    pkv__pool *p = &w->c->pool;
    assert_int_not_equal(p->lru_head, p->lru_tail);
    p->lru_tail = p->lru_head;
}

/* dropped fronts (pkv_seq_drop_front): past the table, an entry in the front that is not -1,
   and a partial right past a front (b's tail, once a, its fork and the pin are gone and b dropped
   its first two blocks) under a block whose depth is not the one before it */
static pkv__seq *slot_of(world *w, pkv_seq id) { return &w->c->seqs[id & 0xffffffffu]; }
static void front_past_table(world *w) {
    pkv__seq *s = slot_of(w, w->r);
    s->n_dropped = s->n_blocks + 1;
}
static void front_entry(world *w) { slot_of(w, w->b)->n_dropped = 1; }
/* a, its fork and the pin gone, b drops its first two blocks: a's, CACHED above b's partial */
static void b_drops_front(world *w) {
    TU_OK(pkv_seq_release(w->c, w->a));
    TU_OK(pkv_seq_release(w->c, w->f));
    TU_OK(pkv_pin_release(w->c, w->pin));
    TU_OK(pkv_seq_drop_front(w->c, w->b, 2 * B));
    TU_CHECK(w->c);
}
static void front_partial(world *w) {
    b_drops_front(w);
    assert_int_equal(w->c->blk[w->ta[1]].state, PKV_BLK_CACHED); /* above b's partial, which b holds */
    assert_int_equal(w->c->blk[w->tb[2]].parent, w->ta[1]);
    w->c->blk[w->ta[1]].depth = 5;
}
/* the inner queue (CACHED blocks with a child in use, pool.h): a's first two blocks once a, its
   fork and the pin are gone and b dropped them, b's partial tail in use below them. Its count
   off, a block of it with none counted, one of the LRU queue with one, its tail, the flag on a
   FREE block, a count on a block outside the index */
static void inner_world(world *w) {
    b_drops_front(w);
    const pkv__pool *p = &w->c->pool;
    assert_int_equal(p->inner_head, w->ta[1]); /* dropped deepest first */
    assert_int_equal(p->inner_tail, w->ta[0]);
    assert_int_equal(w->c->blk[w->ta[1]].n_hot, 1); /* b's partial */
}
static void inner_count(world *w) {
    inner_world(w);
    w->c->blk[w->ta[1]].n_hot = 2;
}
static void inner_cold(world *w) {
    inner_world(w);
    w->c->blk[w->ta[0]].n_hot = 0;
}
static void lru_hot(world *w) {
    inner_world(w);
    pkv__pool_lru_demote(&w->c->pool, (uint32_t)w->ta[0]);
}
static void inner_tail(world *w) {
    inner_world(w);
    w->c->pool.inner_tail = (uint32_t)w->ta[1];
}
static void inner_mark(world *w) { w->c->blk[w->c->pool.free_head].inner = 1; }
static void unindexed_hot(world *w) { w->c->blk[w->c->pool.free_head].n_hot = 1; }
/* an index entry held at another depth than its own */
static void seq_depth(world *w) { w->c->blk[w->ta[1]].depth = 7; }

static void test_checker_fires(void **state) {
    (void)state;
    static const struct {
        breaker brk;
        const char *want;
    } cases[] = {
        {free_back_link, "free queue: block"},
        {free_count, "free queue:"},
        {free_state, "is not FREE"},
        {lru_state, "LRU queue: block"},
        {lru_count, "LRU queue:"},
        {lru_order, "leaves must go first"},
        {refcount, "refcount"},
        {seq_blocks, "blocks for"},
        {seq_committed, "committed 15 > length 14"},
        {seq_table_free_block, "is not ACTIVE"},
        {seq_table_range, "out of range"},
        {seq_fill, "holds 1 tokens"},
        {seq_chain_parent, "has parent"},
        {seq_live_count, "sequence count"},
        {token_total, "token count"},
        {identity, "identity changed"},
        {bucket, "not in its hash bucket"},
        {both_flags, "both indexed and partial"},
        {commit_over_fill, "inconsistent"},
        {free_flags, "FREE but"},
        {indexed_not_full, "not full and committed"},
        {slots_used, "slots used"},
        {indexed_count, "index:"},
        {peak, "peak_active"},
        {children_count, "indexed children"},
        {child_of_unindexed, "not indexed but has children"},
        {partial_parent, "table[2] (block"},
        {partial_ns, "partial under a parent but with a namespace"},
        {child_back_link, "child 2 links back"},
        {child_off_list, "child lists:"},
        {root_back_link, "block 0 links back to 4294967295, not 7"},
        {root_off_list, "root lists:"},
        {root_namespace, "in another namespace"},
        {root_wrong_list, "belongs on another list"},
        {child_as_root, "has parent 4294967295"},
        {free_cycle, "longer than n_free"},
        {lru_range, "LRU queue: block id"},
        {seq_gen0, "generation 0"},
        {chain_stale_entry, "is not indexed"},
        {chain_link_range, "out of range"},
        {seq_idx_len, "indexed chain of 3 blocks past committed 10"},
        {chain_not_indexed, "chain block 1 (block"},
        {slot_list_live, "is live or out of range"},
        {slot_list_short, "sequence free list: 0 slots"},
        {state_counts, "block states:"},
        {free_tail, "blocks linked, n_free="},
        {lru_tail, "LRU queue: 2 blocks linked ending at 5, its tail says 6"},
        {inner_count, "children in use, counter"},
        {inner_cold, "inner queue: block 0 is marked inner with 0 children in use"},
        {lru_hot, "LRU queue: block 0 is marked for the LRU with 1 children in use"},
        {inner_tail, "inner queue: 2 blocks linked ending at 0, its tail says 1"},
        {inner_mark, "marked for the inner queue but not CACHED"},
        {unindexed_hot, "not indexed but 1 children in use counted"},
        {front_past_table, "blocks dropped of"},
        {front_entry, "in its dropped front"},
        {front_partial, "table[2] (block 3), a partial past its dropped front, has parent 1"},
        {seq_depth, "is an index entry of depth 7"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) expect_corrupt(cases[i].brk, cases[i].want);
    /* and the world itself is sound, before and after a round of use */
    world w;
    world_make(&w);
    TU_OK(pkv_seq_release(w.c, w.f));
    TU_OK(pkv_pin_release(w.c, w.pin));
    TU_CHECK(w.c);
    /* fronts dropped under the index: a's block 0 goes CACHED only once b lets it go too, into
       the inner queue (blocks in use below it), a's block 1 too once a is gone (b's partial in
       use below it); once b is gone, both join the LRU queue, the child first */
    const pkv__blk *k0 = &w.c->blk[w.ta[0]], *k1 = &w.c->blk[w.ta[1]];
    TU_OK(pkv_seq_drop_front(w.c, w.a, B));
    TU_CHECK(w.c);
    assert_int_equal(k0->state, PKV_BLK_ACTIVE);
    TU_OK(pkv_seq_drop_front(w.c, w.b, 2 * B));
    TU_CHECK(w.c);
    assert_true(k0->state == PKV_BLK_CACHED && k0->inner);
    TU_OK(pkv_seq_release(w.c, w.a));
    TU_CHECK(w.c);
    assert_true(k1->state == PKV_BLK_CACHED && k1->inner);
    TU_OK(pkv_seq_release(w.c, w.b));
    TU_CHECK(w.c);
    assert_true(!k0->inner && !k1->inner && w.c->pool.inner_head == PKV_NONE);
    assert_true(w.c->pool.lru_tail == (uint32_t)w.ta[0] && k0->qprev == (uint32_t)w.ta[1]);
    pkv_cache_destroy(w.c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checker_fires),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
