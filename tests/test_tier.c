/* test_tier.c: storage tiers (pkv.h, "storage tiers"): blocks saved from one cache and loaded
 * into another, byte for byte; partial matches finished from the tier; what must not match
 * (another namespace, another shape, other tokens); the store's least-recently-used order; the
 * file store across "processes" (destroy and reopen) and with corrupt files; a store of the
 * test's own that fails, loses and garbles on request; allocation failures. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"
#include "tier/tier_int.h" /* pkv__tier_test_ext */

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

enum { B = 8, LAYERS = 2, KV = 2, HD = 32, N = 45, TAG = 7 };

static pkv_cache *mk(pkv_dtype k, pkv_dtype v, uint32_t n_blocks, uint32_t layers) {
    pkv_config cfg = tu_config(n_blocks, B, layers, KV, HD, k);
    cfg.v_dtype = v;
    cfg.enable_prefix_cache = 1;
    return tu_create(&cfg);
}

static void prompt(int32_t *t, uint32_t n, int32_t base) {
    for (uint32_t i = 0; i < n; i++) t[i] = base + (int32_t)(i * 7 % 13) + (int32_t)i;
}

/* a sequence of salt holding tokens[0, n), the pattern TAG written, committed */
static pkv_seq filled(pkv_cache *c, const char *salt, const int32_t *toks, uint32_t n) {
    pkv_seq s;
    TU_OK(pkv_seq_create(c, salt, salt ? strlen(salt) : 0, &s));
    TU_OK(pkv_seq_append(c, s, toks, n, NULL));
    TU_WRITE_PAT(c, s, 0, n, TAG);
    TU_OK(pkv_seq_commit(c, s, n));
    return s;
}

/* s (committed to from) goes on with toks[from, from + n): appended, the pattern TAG written,
 * committed */
static void goes_on(pkv_cache *c, pkv_seq s, const int32_t *toks, uint32_t from, uint32_t n) {
    TU_OK(pkv_seq_append(c, s, toks + from, n, NULL));
    TU_WRITE_PAT(c, s, from, n, TAG);
    TU_OK(pkv_seq_commit(c, s, from + n));
}

/* positions [start, start + n) of a in ca and b in cb: the same stored bytes, every layer */
static void same_rows_at(pkv_cache *ca, pkv_seq a, pkv_cache *cb, pkv_seq b, uint32_t start, uint32_t n) {
    pkv_config cfg;
    TU_OK(pkv_cache_config(ca, &cfg));
    const size_t kb = pkv_dtype_row_bytes(cfg.k_dtype, HD) * KV * n, vb = pkv_dtype_row_bytes(cfg.v_dtype, HD) * KV * n;
    uint8_t *x = malloc(kb + vb + 1), *y = malloc(kb + vb + 1);
    for (uint32_t l = 0; l < cfg.n_layers; l++) {
        TU_OK(pkv_seq_read_stored(ca, a, l, start, n, x, x + kb));
        TU_OK(pkv_seq_read_stored(cb, b, l, start, n, y, y + kb));
        assert_memory_equal(x, y, kb + vb);
    }
    free(x);
    free(y);
}

static void same_rows(pkv_cache *ca, pkv_seq a, pkv_cache *cb, pkv_seq b, uint32_t n) {
    same_rows_at(ca, a, cb, b, 0, n);
}

static pkv_tier *host(uint64_t cap) {
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_host_create(cap, NULL, &t));
    return t;
}

static pkv_tier_stats tstats(pkv_tier *t) {
    pkv_tier_stats st;
    TU_OK(pkv_tier_get_stats(t, &st));
    return st;
}

/* load into a fresh sequence of c (a match first), giving the positions loaded */
static uint32_t load_fresh(pkv_tier *t, pkv_cache *c, const char *salt, const int32_t *toks, uint32_t n,
                           uint32_t *reused, pkv_seq *out) {
    pkv_seq s;
    uint32_t r = 0, got = 99999;
    TU_OK(pkv_seq_create(c, salt, salt ? strlen(salt) : 0, &s));
    TU_OK(pkv_seq_match_prefix(c, s, toks, n, &r));
    TU_OK(pkv_tier_load(t, c, s, toks, n, &got));
    pkv_seq_info info = tu_info(c, s);
    assert_int_equal(info.n_tokens, r + got);
    assert_int_equal(info.n_committed, r + got);
    TU_CHECK(c);
    if (reused) *reused = r;
    *out = s;
    return got;
}

/* ---- one cache to another, every dtype pair of four, then decode over the loaded blocks ---- */
static void roundtrip(pkv_dtype k, pkv_dtype v) {
    int32_t toks[N];
    prompt(toks, N, 100);
    pkv_cache *a = mk(k, v, 16, LAYERS), *b = mk(k, v, 40, LAYERS);
    pkv_tier *t = host(1u << 24);
    pkv_seq sa = filled(a, "ten", toks, N);
    uint32_t saved = 99;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, N / B); /* the full committed blocks */
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 0);
    pkv_tier_stats st = tstats(t);
    assert_int_equal(st.saved, 5);
    assert_int_equal(st.save_present, 5);
    assert_int_equal(st.entries, 5);
    /* b is empty: the whole of the 5 blocks comes from the tier (the prompt's last token never) */
    pkv_seq sb;
    uint32_t reused;
    assert_int_equal(load_fresh(t, b, "ten", toks, N, &reused, &sb), 40);
    assert_int_equal(reused, 0);
    same_rows(a, sa, b, sb, 40);
    st = tstats(t);
    assert_int_equal(st.loaded_blocks, 5);
    assert_int_equal(st.loaded_tokens, 40);
    assert_int_equal(st.load_misses, 0); /* the prompt has no sixth full block to look for */
    /* the loaded blocks are in b's index: another request matches them in the pool */
    pkv_seq s2;
    uint32_t r2 = 0;
    TU_OK(pkv_seq_create(b, "ten", 3, &s2));
    TU_OK(pkv_seq_match_prefix(b, s2, toks, N, &r2));
    assert_int_equal(r2, 40);
    /* decode over the loaded blocks equals decode over the saved ones */
    TU_OK(pkv_seq_append(b, sb, toks + 40, 5, NULL));
    TU_WRITE_PAT(b, sb, 40, 5, TAG);
    TU_OK(pkv_seq_commit(b, sb, N));
    float q[KV * HD], oa[KV * HD], ob[KV * HD];
    for (int i = 0; i < KV * HD; i++) q[i] = sinf((float)i);
    float scale = 0;
    for (uint32_t l = 0; l < LAYERS; l++) {
        TU_OK(pkv_attn_decode(a, l, &sa, 1, q, oa, NULL));
        TU_OK(pkv_attn_decode(b, l, &sb, 1, q, ob, NULL));
        for (int i = 0; i < KV * HD; i++) scale = fmaxf(scale, fabsf(oa[i]));
        for (int i = 0; i < KV * HD; i++) assert_true(fabsf(oa[i] - ob[i]) <= 1e-5f * (scale + 1e-30f));
    }
    assert_true(scale > 0);
    TU_CHECK(a);
    TU_CHECK(b);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
}

static void test_roundtrip(void **state) {
    (void)state;
    roundtrip(PKV_DTYPE_F16, PKV_DTYPE_F16);
    roundtrip(PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0);
    roundtrip(PKV_DTYPE_FP8_E4M3, PKV_DTYPE_BF16);
    roundtrip(PKV_DTYPE_F32, PKV_DTYPE_Q8_0);
}

/* ---- a pool match that stops inside a block, finished from the tier ---- */
static void test_partial(void **state) {
    (void)state;
    int32_t toks[N];
    prompt(toks, N, 300);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 16, LAYERS), *b = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 40, LAYERS);
    pkv_tier *t = host(1u << 24);
    pkv_seq sa = filled(a, NULL, toks, N);
    TU_OK(pkv_tier_save(t, a, sa, NULL));
    /* b has computed the first 20 tokens once: 2 indexed blocks and a committed part of a third */
    pkv_seq old = filled(b, NULL, toks, 20); /* kept: its tail block is the token-granular source */
    pkv_seq sb;
    uint32_t reused;
    assert_int_equal(load_fresh(t, b, NULL, toks, N, &reused, &sb), 20);
    assert_int_equal(reused, 20); /* 16 in whole blocks, 4 token-granular */
    same_rows(a, sa, b, sb, 40);
    TU_OK(pkv_seq_release(b, old));
    /* a prompt that ends on a block's last token: that token is not loaded */
    pkv_seq s3;
    assert_int_equal(load_fresh(t, b, NULL, toks, 40, &reused, &s3), 0);
    assert_int_equal(reused, 39);
    pkv_cache *c = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 40, LAYERS);
    assert_int_equal(load_fresh(t, c, NULL, toks, 40, &reused, &s3), 39);
    same_rows(a, sa, c, s3, 39);
    assert_int_equal(load_fresh(t, c, NULL, toks, 41, &reused, &s3), 1); /* 39 in the pool, then 1 */
    /* a pool of 3 blocks: the load ends when it is full, successfully, with what fitted */
    pkv_cache *small = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 3, LAYERS);
    assert_int_equal(load_fresh(t, small, NULL, toks, N, &reused, &s3), 24);
    same_rows(a, sa, small, s3, 24);
    pkv_cache_destroy(small);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
}

/* ---- media ids agreeing by chance: a block ending 1-3 ids into a media is keyed with the
 * ids after it, and a load ending a few ids into a media gives them back ---- */
/* The saved prompt x holds a media's ids at [22, 45): block 2 ([16, 24)) ends 2 ids into it, so
 * its key takes ids 24 and 25 as well. A prompt y whose media agrees on its first j ids only (as
 * ids agreeing by chance would): j = 0 and j = 2 load blocks 0-1 (16: block 2's key differs);
 * j = 4 loads block 2 too, then misses block 3 and gives back the 2 media ids (22); j = 10 loads
 * block 3 (32). Then y (j = 2) computed with other K/V and saved: its block 2 is an entry of
 * its own, so a load of y reads y's K/V there and on, not x's. */
static void test_media_guard(void **state) {
    (void)state;
    int32_t x[N], y[N];
    prompt(x, N, 700);
    TU_OK(pkv_media_tokens("image x", 7, 0, N - 22, x + 22));
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_tier *t = host(1u << 24);
    pkv_seq sa = filled(a, NULL, x, N);
    TU_OK(pkv_tier_save(t, a, sa, NULL));
    const uint32_t js[] = {0, 2, 4, 10}, want[] = {16, 16, 22, 32};
    for (int i = 0; i < 4; i++) {
        memcpy(y, x, sizeof x);
        TU_OK(pkv_media_tokens("image y", 7, js[i], N - 22 - js[i], y + 22 + js[i]));
        pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
        pkv_seq sb;
        uint32_t reused;
        assert_int_equal(load_fresh(t, b, NULL, y, N, &reused, &sb), want[i]);
        assert_int_equal(reused, 0);
        same_rows(a, sa, b, sb, want[i]);
        pkv_cache_destroy(b);
    }
    /* the same media: the 5 saved blocks, ending 18 ids into it */
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sb;
    assert_int_equal(load_fresh(t, b, NULL, x, N, NULL, &sb), N / B * B);
    pkv_cache_destroy(b);
    /* y of j = 2 with K/V of its own (another pattern), saved: all 5 of its blocks are entries
       of their own past block 1, and a load of y reads them back */
    memcpy(y, x, sizeof x);
    TU_OK(pkv_media_tokens("image y", 7, 2, N - 24, y + 24));
    pkv_cache *ya = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sy;
    TU_OK(pkv_seq_create(ya, NULL, 0, &sy));
    TU_OK(pkv_seq_append(ya, sy, y, N, NULL));
    TU_WRITE_PAT(ya, sy, 0, 16, TAG); /* blocks 0-1: x's ids, x's K/V */
    TU_WRITE_PAT(ya, sy, 16, N - 16, TAG + 2);
    TU_OK(pkv_seq_commit(ya, sy, N));
    uint32_t saved = 0;
    TU_OK(pkv_tier_save(t, ya, sy, &saved));
    assert_int_equal(saved, 3); /* blocks 2, 3 and 4: 0 and 1 are x's, the same ids */
    b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    assert_int_equal(load_fresh(t, b, NULL, y, N, NULL, &sb), N / B * B);
    same_rows(ya, sy, b, sb, N / B * B); /* positions 16-23 included: y's, not x's */
    pkv_cache_destroy(b);
    pkv_cache_destroy(ya);

    /* a key takes only ids that go on with the media: a 2-id media complete at block 2's end,
       then text, keeps block 2's plain key, so a prompt with other text after it loads block 2
       (24); and a save reads the committed partial tail for those ids: 28 committed positions
       whose block 2 ends 2 ids into a media going on at 24 and 25 save 3 blocks */
    pkv_tier *t2 = host(1u << 24);
    int32_t s2[N], o2[N];
    prompt(s2, N, 900);
    TU_OK(pkv_media_tokens("short", 5, 0, 2, s2 + 22));
    memcpy(o2, s2, sizeof s2);
    prompt(o2 + 24, N - 24, 950);
    pkv_cache *sc = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq ss = filled(sc, NULL, s2, N);
    TU_OK(pkv_tier_save(t2, sc, ss, NULL));
    b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    assert_int_equal(load_fresh(t2, b, NULL, o2, N, NULL, &sb), 24);
    same_rows(sc, ss, b, sb, 24);
    pkv_cache_destroy(b);
    pkv_cache_destroy(sc);
    pkv_tier_destroy(t2);
    t2 = host(1u << 24);
    sc = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    ss = filled(sc, NULL, x, 28);
    TU_OK(pkv_tier_save(t2, sc, ss, &saved));
    assert_int_equal(saved, 3);
    ss = filled(sc, NULL, x, 24); /* the ids after block 2 unknown: blocks 0-1 only */
    pkv_tier *t3 = host(1u << 24);
    TU_OK(pkv_tier_save(t3, sc, ss, &saved));
    assert_int_equal(saved, 2);
    pkv_tier_destroy(t3);
    pkv_cache_destroy(sc);
    pkv_tier_destroy(t2);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
}

/* ---- what must not match, and refusals ---- */
static void test_mismatch(void **state) {
    (void)state;
    int32_t toks[N], other[N];
    prompt(toks, N, 500);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_tier *t = host(1u << 24);
    pkv_seq sa = filled(a, "alice", toks, N), s;
    TU_OK(pkv_tier_save(t, a, sa, NULL));
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 60, LAYERS);
    assert_int_equal(load_fresh(t, b, "bob", toks, N, NULL, &s), 0); /* another namespace */
    assert_int_equal(load_fresh(t, b, NULL, toks, N, NULL, &s), 0);  /* none */
    assert_int_equal(tstats(t).load_misses, 2);
    pkv_cache *c3 = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, 3); /* another shape */
    assert_int_equal(load_fresh(t, c3, "alice", toks, N, NULL, &s), 0);
    pkv_cache *cb = mk(PKV_DTYPE_F16, PKV_DTYPE_BF16, 40, LAYERS);
    assert_int_equal(load_fresh(t, cb, "alice", toks, N, NULL, &s), 0);
    /* tokens that differ in block 3: blocks 0-2 */
    memcpy(other, toks, sizeof other);
    other[27]++;
    assert_int_equal(load_fresh(t, b, "alice", other, N, NULL, &s), 24);
    same_rows(a, sa, b, s, 24);
    /* refusals, nothing changed */
    uint32_t got = 5;
    pkv_seq e;
    TU_OK(pkv_seq_create(b, "alice", 5, &e));
    TU_OK(pkv_seq_append(b, e, toks, 3, NULL));
    TU_WRITE_PAT(b, e, 0, 3, TAG);
    TU_RC(pkv_tier_load(t, b, e, toks, N, &got), PKV_EINVAL); /* uncommitted positions */
    TU_OK(pkv_seq_commit(b, e, 3));
    TU_RC(pkv_tier_load(t, b, e, other + 1, N - 1, &got), PKV_EINVAL); /* not the prompt's tokens */
    TU_RC(pkv_tier_load(t, b, e, toks, 2, &got), PKV_EINVAL);          /* longer than the prompt */
    TU_RC(pkv_tier_load(t, b, e, NULL, N, &got), PKV_EINVAL);
    TU_RC(pkv_tier_load(t, b, e, toks, N, NULL), PKV_EINVAL);
    TU_RC(pkv_tier_load(NULL, b, e, toks, N, &got), PKV_EINVAL);
    TU_RC(pkv_tier_load(t, NULL, e, toks, N, &got), PKV_EINVAL);
    TU_RC(pkv_tier_load(t, b, e + 1, toks, N, &got), PKV_ENOENT);
    TU_RC(pkv_tier_save(NULL, b, e, &got), PKV_EINVAL);
    TU_RC(pkv_tier_save(t, NULL, e, &got), PKV_EINVAL);
    TU_RC(pkv_tier_save(t, b, e + 1, &got), PKV_ENOENT);
    assert_int_equal(tu_info(b, e).n_tokens, 3);
    TU_OK(pkv_tier_load(t, b, e, toks, N, &got)); /* from position 3: the rest of blocks 0-4 */
    assert_int_equal(got, 37);
    same_rows(a, sa, b, e, 40);
    /* a pin is not a sequence */
    pkv_seq pin;
    TU_OK(pkv_pin_create(b, e, 16, &pin));
    TU_RC(pkv_tier_save(t, b, pin, &got), PKV_EINVAL);
    TU_OK(pkv_pin_release(b, pin));
    /* creation */
    pkv_tier *x = (pkv_tier *)&got;
    TU_RC(pkv_tier_host_create(0, NULL, &x), PKV_EINVAL);
    assert_null(x);
    TU_RC(pkv_tier_host_create(1, NULL, NULL), PKV_EINVAL);
    TU_RC(pkv_tier_file_create(NULL, 1, NULL, &x), PKV_EINVAL);
    TU_RC(pkv_tier_file_create("", 1, NULL, &x), PKV_EINVAL);
    TU_RC(pkv_tier_file_create("/nonexistent-dir-pkv/a/b", 1 << 20, NULL, &x), PKV_EIO);
    TU_RC(pkv_tier_file_create("/dev/null", 1 << 20, NULL, &x), PKV_EIO);
    pkv_tier_ops none = {0};
    TU_RC(pkv_tier_create(&none, NULL, NULL, &x), PKV_EINVAL);
    TU_RC(pkv_tier_create(NULL, NULL, NULL, &x), PKV_EINVAL);
    TU_RC(pkv_tier_get_stats(t, NULL), PKV_EINVAL);
    TU_RC(pkv_tier_get_stats(NULL, &(pkv_tier_stats){0}), PKV_EINVAL);
    pkv_tier_destroy(NULL);
    TU_CHECK(b);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c3);
    pkv_cache_destroy(cb);
}

/* ---- a store with room for 3 entries keeps the beginnings of the prefix ---- */
static void test_lru(void **state) {
    (void)state;
    int32_t toks[N];
    prompt(toks, N, 700);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sa = filled(a, NULL, toks, N), s;
    pkv_tier *probe = host(1u << 24);
    TU_OK(pkv_tier_save(probe, a, sa, NULL));
    const uint64_t entry = tstats(probe).bytes / 5;
    assert_int_equal(tstats(probe).bytes % 5, 0);
    pkv_tier_destroy(probe);
    pkv_tier *t = host(3 * entry + entry / 2);
    uint32_t saved;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    pkv_tier_stats st = tstats(t);
    assert_int_equal(st.entries, 3);
    assert_int_equal(st.evictions, 2);
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    assert_int_equal(load_fresh(t, b, NULL, toks, N, NULL, &s), 24); /* blocks 0-2 stayed */
    assert_int_equal(tstats(t).load_misses, 1);
    /* a store too small for one entry: nothing stored, not an error */
    pkv_tier *tiny = host(entry - 1);
    TU_OK(pkv_tier_save(tiny, a, sa, &saved));
    assert_int_equal(saved, 0);
    assert_int_equal(tstats(tiny).save_no_room, 5);
    pkv_tier_destroy(tiny);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
}

/* ---- what a load uses is kept over what was saved before it (host and file stores) ----
 * Room for 6 entries: P's 5 blocks, then R's 2 (P's deepest goes), then P is loaded (4 blocks,
 * touched), then S's 2 come in: R's go, not P's. In a store that ignored use (first in, first
 * out), P's blocks 3 and 2 would go instead. */
static void lru_scenario(pkv_tier *t, uint64_t entry) {
    (void)entry;
    int32_t p[N], r[2 * B + 1], q[2 * B + 1];
    prompt(p, N, 5000);
    prompt(r, 2 * B + 1, 6000);
    prompt(q, 2 * B + 1, 7000);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sp = filled(a, NULL, p, N), sr = filled(a, NULL, r, 2 * B + 1), sq = filled(a, NULL, q, 2 * B + 1), s;
    uint32_t saved;
    TU_OK(pkv_tier_save(t, a, sp, &saved));
    TU_OK(pkv_tier_save(t, a, sr, &saved));
    assert_int_equal(tstats(t).entries, 6);
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    assert_int_equal(load_fresh(t, b, NULL, p, N, NULL, &s), 32); /* P's block 4 went for R */
    TU_OK(pkv_tier_save(t, a, sq, &saved));
    assert_int_equal(saved, 2);
    pkv_cache *c = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    assert_int_equal(load_fresh(t, c, NULL, r, 2 * B + 1, NULL, &s), 0); /* R's went */
    assert_int_equal(load_fresh(t, c, NULL, p, N, NULL, &s), 32);        /* P's stayed */
    assert_int_equal(load_fresh(t, c, NULL, q, 2 * B + 1, NULL, &s), 16); /* S came in */
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
}

static void test_use_order(void **state) {
    (void)state;
    const uint64_t entry = 88 + B * 4 + (uint64_t)LAYERS * B * KV * 2 * pkv_dtype_row_bytes(PKV_DTYPE_F16, HD);
    pkv_tier *t = host(6 * entry + entry / 2);
    lru_scenario(t, entry);
    pkv_tier_destroy(t);
    char dir[] = "/tmp/pkv-tier-lru-XXXXXX";
    assert_non_null(mkdtemp(dir));
    TU_OK(pkv_tier_file_create(dir, 6 * entry + entry / 2, NULL, &t));
    lru_scenario(t, entry);
    pkv_tier_destroy(t);
    TU_OK(pkv_tier_file_create(dir, 1, NULL, &t)); /* drops every file */
    pkv_tier_destroy(t);
    assert_int_equal(rmdir(dir), 0);
}

/* ---- files: taken over by a new tier, corrupt ones refused ---- */
static int count_files(const char *dir, const char *suffix, char *first) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *de; (de = readdir(d));) {
        size_t l = strlen(de->d_name), ls = strlen(suffix);
        if (l >= ls && !strcmp(de->d_name + l - ls, suffix)) {
            if (first && !n) snprintf(first, 256, "%s/%s", dir, de->d_name);
            n++;
        }
    }
    closedir(d);
    return n;
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_file(void **state) {
    (void)state;
    char dir[] = "/tmp/pkv-tier-XXXXXX", path[512], victim[256];
    assert_non_null(mkdtemp(dir));
    int32_t toks[N];
    prompt(toks, N, 900);
    pkv_cache *a = mk(PKV_DTYPE_Q4_0, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sa = filled(a, NULL, toks, N), s;
    pkv_tier *t = NULL;
    snprintf(path, sizeof path, "%s/sub", dir);
    TU_OK(pkv_tier_file_create(path, 1u << 24, NULL, &t)); /* made */
    TU_OK(pkv_tier_save(t, a, sa, NULL));
    const uint64_t bytes = tstats(t).bytes;
    pkv_tier_destroy(t);
    assert_int_equal(count_files(path, ".pkvb", NULL), 5);
    /* another "process": a temporary file two hours old (a writer that died) goes; a fresh one
       (another process's write in flight) and a foreign file stay */
    char tmp[600], live[600], foreign[600];
    snprintf(tmp, sizeof tmp, "%s/.pkvt-1-1-1", path);
    snprintf(live, sizeof live, "%s/.pkvt-2-1-1", path);
    snprintf(foreign, sizeof foreign, "%s/notes.txt", path);
    write_file(tmp, "half an entry");
    write_file(live, "half an entry");
    write_file(foreign, "mine");
    const struct timeval old[2] = {{time(NULL) - 7200, 0}, {time(NULL) - 7200, 0}};
    assert_int_equal(utimes(tmp, old), 0);
    TU_OK(pkv_tier_file_create(path, 1u << 24, NULL, &t));
    pkv_tier_stats st = tstats(t);
    assert_int_equal(st.entries, 5);
    assert_int_equal(st.bytes, bytes);
    assert_int_equal(access(tmp, F_OK), -1);
    assert_int_equal(access(live, F_OK), 0);
    assert_int_equal(access(foreign, F_OK), 0);
    unlink(live);
    pkv_cache *b = mk(PKV_DTYPE_Q4_0, PKV_DTYPE_F16, 40, LAYERS);
    assert_int_equal(load_fresh(t, b, NULL, toks, N, NULL, &s), 40);
    same_rows(a, sa, b, s, 40);
    /* one file spoiled (a byte in its rows): the load stops there, the file is deleted */
    count_files(path, ".pkvb", victim);
    FILE *f = fopen(victim, "r+b");
    assert_non_null(f);
    fseek(f, -3, SEEK_END);
    int ch = fgetc(f);
    fseek(f, -3, SEEK_END);
    fputc(ch ^ 0x10, f);
    fclose(f);
    pkv_cache *c = mk(PKV_DTYPE_Q4_0, PKV_DTYPE_F16, 40, LAYERS);
    uint32_t got = load_fresh(t, c, NULL, toks, N, NULL, &s);
    assert_true(got < 40 && got % B == 0);
    same_rows(a, sa, c, s, got);
    st = tstats(t);
    assert_int_equal(st.rejected, 1);
    assert_int_equal(st.entries, 4);
    assert_int_equal(access(victim, F_OK), -1);
    /* a file removed by hand: a miss, forgotten */
    TU_OK(pkv_tier_save(t, a, sa, NULL)); /* back to 5 */
    assert_int_equal(tstats(t).entries, 5);
    count_files(path, ".pkvb", victim);
    assert_int_equal(unlink(victim), 0);
    pkv_cache *d = mk(PKV_DTYPE_Q4_0, PKV_DTYPE_F16, 40, LAYERS);
    got = load_fresh(t, d, NULL, toks, N, NULL, &s);
    assert_true(got < 40 && got % B == 0);
    assert_int_equal(tstats(t).entries, 4);
    TU_OK(pkv_tier_save(t, a, sa, NULL)); /* back to 5 */
    pkv_tier_destroy(t);
    /* reopened smaller: the oldest written go. The files' write times are set by the block
       each holds (its first token id, after the 88-byte header): block 0 newest, as a save
       leaves them (deepest first), so blocks 0 and 1 stay and a load gets 16 positions */
    DIR *dd = opendir(path);
    assert_non_null(dd);
    for (struct dirent *de; (de = readdir(dd));) {
        if (!strstr(de->d_name, ".pkvb")) continue;
        char fp[1024];
        snprintf(fp, sizeof fp, "%s/%s", path, de->d_name);
        FILE *ff = fopen(fp, "rb");
        int32_t first = 0;
        assert_non_null(ff);
        assert_int_equal(fseek(ff, 88, SEEK_SET), 0);
        assert_int_equal(fread(&first, 4, 1, ff), 1);
        fclose(ff);
        int blk = -1;
        for (int k = 0; k < N; k += B)
            if (toks[k] == first) blk = k / B;
        assert_true(blk >= 0);
        const struct timeval when[2] = {{time(NULL) - 100 * blk, 0}, {time(NULL) - 100 * blk, 0}};
        assert_int_equal(utimes(fp, when), 0);
    }
    closedir(dd);
    TU_OK(pkv_tier_file_create(path, 2 * (bytes / 5), NULL, &t));
    assert_int_equal(tstats(t).entries, 2);
    assert_int_equal(count_files(path, ".pkvb", NULL), 2);
    pkv_cache *e = mk(PKV_DTYPE_Q4_0, PKV_DTYPE_F16, 40, LAYERS);
    assert_int_equal(load_fresh(t, e, NULL, toks, N, NULL, &s), 16);
    pkv_cache_destroy(e);
    pkv_tier_destroy(t);
    unlink(foreign);
    while (count_files(path, ".pkvb", victim)) unlink(victim);
    rmdir(path);
    rmdir(dir);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
    pkv_cache_destroy(d);
}

/* ---- a store of the test's own, failing on request ---- */
typedef struct fake {
    uint8_t key[32][16];
    uint8_t *data[32];
    size_t len[32];
    int n_put, n_get, n_del, n_calls; /* n_calls: gets, probes included */
    int fail_put_at, fail_get_at; /* call index answered PKV_EIO (-1 never) */
    int garble, shorten;          /* gets: flip a byte of the rows / give one byte less */
    int craft;                    /* gets: a q8_0 code of -128 in the V rows, checksum fixed */
    int retoken;                  /* gets: a token id changed, checksum fixed */
    int other;                    /* gets: another key's entry (the first stored of another key) */
    int reparent;                 /* gets: the parent key changed, checksum fixed (it is not covered) */
    atomic_int gate;              /* gets with data, and puts, wait while it is set (prefetch tests) */
    atomic_int hold_tok;          /* nonzero: only puts of the block beginning with it wait */
    int32_t log[128];             /* puts (+first token) and gets with data (-first token), in order */
    atomic_int n_log;
} fake;

/* the first token id of an entry's block (after the 88-byte header) */
static int32_t first_tok(const void *entry) {
    int32_t t;
    memcpy(&t, (const uint8_t *)entry + 88, sizeof t);
    return t;
}

static int find(fake *f, const uint8_t *key) {
    for (int i = 0; i < 32; i++)
        if (f->data[i] && !memcmp(f->key[i], key, 16)) return i;
    return -1;
}

static int fake_put(void *ctx, const uint8_t key[16], const void *data, size_t len) {
    fake *f = ctx;
    while (atomic_load(&f->gate) && (!atomic_load(&f->hold_tok) || atomic_load(&f->hold_tok) == first_tok(data)))
        usleep(100);
    const int at = atomic_fetch_add(&f->n_log, 1);
    if (at < 128) f->log[at] = first_tok(data);
    if (f->n_put++ == f->fail_put_at) return PKV_EIO;
    int i = find(f, key);
    for (int j = 0; i < 0 && j < 32; j++)
        if (!f->data[j]) i = j;
    if (i < 0) return PKV_ENOSPC;
    free(f->data[i]);
    f->data[i] = malloc(len);
    memcpy(f->data[i], data, len);
    memcpy(f->key[i], key, 16);
    f->len[i] = len;
    return PKV_OK;
}

static int fake_get(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len) {
    fake *f = ctx;
    while (data && atomic_load(&f->gate) && !atomic_load(&f->hold_tok)) usleep(100);
    f->n_calls++;
    if (data && f->n_get++ == f->fail_get_at) return PKV_EIO;
    int i = find(f, key);
    if (i < 0) return PKV_ENOENT;
    for (int j = 0; data && f->other && j < 32; j++)
        if (f->data[j] && j != i) {
            i = j;
            break;
        }
    *len = f->len[i] - (data && f->shorten ? 1 : 0);
    if (!data) return PKV_OK;
    const int at = atomic_fetch_add(&f->n_log, 1);
    if (at < 128) f->log[at] = -first_tok(f->data[i]);
    if (*len > cap) return PKV_ENOSPC;
    memcpy(data, f->data[i], *len);
    uint8_t *p = data;
    if (f->garble) p[*len - 1] ^= 1;
    if (f->craft) { /* layer 0's first V row: header 88, tokens, K rows (f16) */
        p[88 + B * 4 + B * KV * HD * 2 + 2] = 0x80; /* its first code (after the f16 scale) */
        uint64_t sum = XXH3_64bits(p + 88, *len - 88);
        memcpy(p + 80, &sum, 8);
    }
    if (f->reparent) p[40] ^= 1; /* the header's parent key: bytes 32-47 */
    if (f->retoken) {
        p[88 + 4 * (B - 1)] ^= 1; /* the block's last token id */
        uint64_t sum = XXH3_64bits(p + 88, *len - 88);
        memcpy(p + 80, &sum, 8);
    }
    return PKV_OK;
}

static int fake_del(void *ctx, const uint8_t key[16]) {
    fake *f = ctx;
    f->n_del++;
    int i = find(f, key);
    if (i >= 0) free(f->data[i]), f->data[i] = NULL;
    return PKV_OK;
}

static const pkv_tier_ops fake_ops = {fake_put, fake_get, fake_del, NULL, NULL};

/* an empty store that fails nothing */
static void fake_init(fake *f) {
    memset(f, 0, sizeof *f);
    f->fail_put_at = f->fail_get_at = -1;
}

/* every entry dropped, the log emptied */
static void clear_fake(fake *f) {
    for (int i = 0; i < 32; i++) free(f->data[i]), f->data[i] = NULL;
    atomic_store(&f->n_log, 0);
}

static int fake_count(const fake *f) {
    int n = 0;
    for (int i = 0; i < 32; i++) n += f->data[i] != NULL;
    return n;
}

/* ---- a store taking probes and puts together (ext.probe_many, ext.put_stream: Redis's way),
 * each entry's last use timed ---- */
typedef struct bstore {
    uint8_t key[64][16];
    int32_t tok[64];   /* the first token id of the entry's block */
    uint64_t used[64]; /* the clock at its last use: a probe that found it, a put */
    int n;
    uint64_t clock;
    int probe_calls, stream_calls;
    int drop_at; /* the next probe_many answers PKV_EIO from this key on (a lost connection); -1 */
    /* the next put_stream: its put fail_put_at fails (PKV_EIO, the others put), its puts from
       lose_from on are taken but answered PKV_EIO (replies lost), and after its make number
       trunc_after the sequence s of c is cut to 8 blocks (the next make fails); -1: none */
    int fail_put_at, lose_from, trunc_after;
    pkv_cache *c;
    pkv_seq s;
    atomic_int gate, waiting; /* a probe waits while gate is set (waiting: probes that came) */
} bstore;

static int bfind(const bstore *s, const uint8_t *key) {
    for (int i = 0; i < s->n; i++)
        if (!memcmp(s->key[i], key, 16)) return i;
    return -1;
}

static int b_put(void *ctx, const uint8_t key[16], const void *data, size_t len) {
    bstore *s = ctx;
    (void)len;
    int i = bfind(s, key);
    if (i < 0) {
        assert_true(s->n < 64);
        i = s->n++;
        memcpy(s->key[i], key, 16);
    }
    s->tok[i] = first_tok(data);
    s->used[i] = ++s->clock;
    return PKV_OK;
}

static int b_get(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len) {
    bstore *s = ctx;
    atomic_fetch_add(&s->waiting, 1);
    while (atomic_load(&s->gate)) usleep(100);
    assert_null(data); /* (probes only, here) */
    (void)cap;
    const int i = bfind(s, key);
    if (i < 0) return PKV_ENOENT;
    s->used[i] = ++s->clock;
    *len = 1;
    return PKV_OK;
}

static int b_del(void *ctx, const uint8_t key[16]) {
    bstore *s = ctx;
    const int i = bfind(s, key);
    if (i >= 0) { /* the last entry takes its place */
        s->n--;
        memcpy(s->key[i], s->key[s->n], 16);
        s->tok[i] = s->tok[s->n], s->used[i] = s->used[s->n];
    }
    return PKV_OK;
}

static void b_probe_many(void *ctx, uint32_t n, const uint8_t *keys, int *got) {
    bstore *s = ctx;
    s->probe_calls++;
    for (uint32_t i = 0; i < n; i++) {
        size_t len;
        got[i] = s->drop_at >= 0 && (int)i >= s->drop_at ? PKV_EIO : b_get(ctx, keys + 16 * i, NULL, 0, &len);
    }
    s->drop_at = -1;
}

static void b_put_stream(void *ctx, uint32_t n, const uint8_t *keys, pkv__tier_make_fn make, void *arg, int *put) {
    bstore *s = ctx;
    s->stream_calls++;
    for (uint32_t i = 0; i < n; i++) put[i] = PKV__TIER_UNTRIED;
    for (uint32_t i = 0; i < n; i++) {
        const void *data;
        size_t len;
        if ((put[i] = make(arg, i, &data, &len))) break;
        if ((int)i == s->trunc_after) TU_OK(pkv_seq_truncate(s->c, s->s, 8 * B));
        put[i] = (int)i == s->fail_put_at ? PKV_EIO : b_put(ctx, keys + 16 * i, data, len);
        if (s->lose_from >= 0 && (int)i >= s->lose_from) put[i] = PKV_EIO;
    }
    s->fail_put_at = s->lose_from = s->trunc_after = -1;
}

/* The last use of block j's entry, toks's blocks looked up by their first token id. */
static uint64_t b_used(const bstore *s, const int32_t *toks, uint32_t j) {
    for (int i = 0; i < s->n; i++)
        if (s->tok[i] == toks[j * B]) return s->used[i];
    fail_msg("block %u is not stored", j);
    return 0;
}

/* A save's probes and puts, taken together, leave the store as one at a time did: a
 * conversation saved at 10 blocks, then at 20, has its blocks last used beginnings last (the
 * probes of the 10 found come after the puts of the 10 new: the first batch ends before them);
 * a probe lost with the connection is counted once and its block put again, the blocks after it
 * asked anew. With and without the batched calls. And a batched save that fails deletes what
 * it put, even where the store's answer was lost. */
static void test_save_batched(void **state) {
    (void)state;
    enum { NB = 20 };
    int32_t toks[NB * B];
    prompt(toks, NB * B, 1300);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 2 * NB + 4, 1);
    pkv_seq half = filled(a, NULL, toks, NB * B / 2), whole = filled(a, NULL, toks, NB * B);
    for (int batched = 0; batched < 2; batched++) {
        bstore s = {.drop_at = -1, .fail_put_at = -1, .lose_from = -1, .trunc_after = -1};
        const pkv_tier_ops ops = {b_put, b_get, b_del, NULL, NULL};
        pkv_tier *t = NULL;
        TU_OK(pkv_tier_create(&ops, &s, NULL, &t));
        if (batched) pkv__tier_test_ext(t, &(pkv__tier_ext){.probe_many = b_probe_many, .put_stream = b_put_stream});
        uint32_t saved = 0;
        TU_OK(pkv_tier_save(t, a, half, &saved));
        assert_int_equal(saved, NB / 2);
        TU_OK(pkv_tier_save(t, a, whole, &saved));
        assert_int_equal(saved, NB / 2);
        pkv_tier_stats st = tstats(t);
        assert_int_equal(st.save_present, NB / 2);
        for (uint32_t j = 0; j + 1 < NB; j++) assert_true(b_used(&s, toks, j) > b_used(&s, toks, j + 1));
        if (batched) { /* two saves: the first probes 10 and puts 10; the second probes 16, puts
                          10, then probes 10 */
            assert_int_equal(s.probe_calls, 3);
            assert_int_equal(s.stream_calls, 2);
        }
        /* every block stored: the third probe of the next save is lost with the connection */
        s.drop_at = 2;
        TU_OK(pkv_tier_save(t, a, whole, &saved));
        st = tstats(t);
        assert_int_equal(st.errors, batched ? 1 : 0);
        assert_int_equal(saved, batched ? 1 : 0);
        assert_int_equal(st.save_present, NB / 2 + NB - (batched ? 1 : 0));
        for (uint32_t j = 0; j + 1 < NB; j++) assert_true(b_used(&s, toks, j) > b_used(&s, toks, j + 1));
        pkv_tier_destroy(t);
    }
    /* a batched save that fails leaves none of its entries: the store fails the third put of 16
       (the others taken), or loses the replies of the puts from the sixth on (all taken), or the
       sequence is cut after the third entry is made (the fourth cannot be); the counts as
       before the call, one error where the store failed */
    for (int how = 0; how < 3; how++) {
        pkv_cache *c = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, NB + 4, 1);
        pkv_seq sc = filled(c, NULL, toks, NB * B);
        bstore s = {.drop_at = -1, .fail_put_at = how == 0 ? 2 : -1, .lose_from = how == 1 ? 5 : -1,
                    .trunc_after = how == 2 ? 2 : -1, .c = c, .s = sc};
        const pkv_tier_ops ops = {b_put, b_get, b_del, NULL, NULL};
        pkv_tier *t = NULL;
        TU_OK(pkv_tier_create(&ops, &s, NULL, &t));
        pkv__tier_test_ext(t, &(pkv__tier_ext){.probe_many = b_probe_many, .put_stream = b_put_stream});
        uint32_t saved = 99;
        TU_RC(pkv_tier_save(t, c, sc, &saved), how == 2 ? PKV_EINVAL : PKV_EIO);
        assert_int_equal(saved, 0);
        assert_int_equal(s.n, 0);
        const pkv_tier_stats st = tstats(t);
        assert_int_equal(st.errors, how == 2 ? 0 : 1);
        assert_int_equal(st.saved + st.save_present + st.save_no_room, 0);
        pkv_tier_destroy(t);
        pkv_cache_destroy(c);
    }
    pkv_cache_destroy(a);
}

/* The write-back takes up to 16 queued writes at once where the store takes probes and puts
 * together (Redis's way): their probes in one round trip, the puts of those not found in
 * another. While the thread waits on its first write's probe, a prompt of 6 blocks is queued
 * twice and its continuation to 12 blocks once: the next 16 writes go together (the second 6 are
 * the first's twins: counted found, not put again), then the last 8 in two rounds (blocks 7 and
 * 6 put, then 5 to 0 found: the round ends before them, so that they are used after the puts),
 * the conversation's blocks last used beginnings last, as one at a time. Then a probe lost with
 * the connection (one error, the round ends after it) and a put together that fails (put again
 * alone). */
static void test_write_back_batched(void **state) {
    (void)state;
    enum { NB = 12 };
    int32_t toks[NB * B], other[B];
    prompt(toks, NB * B, 1500);
    prompt(other, B, 1700);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 2 * NB + 8, 1);
    pkv_seq half = filled(a, NULL, toks, NB * B / 2), whole = filled(a, NULL, toks, NB * B);
    pkv_seq one = filled(a, NULL, other, B);
    bstore s = {.drop_at = -1, .fail_put_at = -1, .lose_from = -1, .trunc_after = -1};
    const pkv_tier_ops ops = {b_put, b_get, b_del, NULL, NULL};
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_create(&ops, &s, NULL, &t));
    pkv__tier_test_ext(t, &(pkv__tier_ext){.probe_many = b_probe_many, .put_stream = b_put_stream});
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    atomic_store(&s.gate, 1);
    uint32_t queued = 0;
    TU_OK(pkv_tier_save_async(t, a, one, &queued));
    assert_int_equal(queued, 1);
    while (atomic_load(&s.waiting) < 1) usleep(100);
    TU_OK(pkv_tier_save_async(t, a, half, &queued));
    TU_OK(pkv_tier_save_async(t, a, half, &queued));
    TU_OK(pkv_tier_save_async(t, a, whole, &queued));
    assert_int_equal(queued, NB);
    atomic_store(&s.gate, 0);
    TU_OK(pkv_tier_flush(t));
    const pkv_tier_stats st = tstats(t);
    assert_int_equal(st.saved, 1 + NB);
    assert_int_equal(st.save_present, NB);
    assert_int_equal(st.errors + st.save_no_room, 0);
    assert_int_equal(s.n, 1 + NB);
    assert_int_equal(s.probe_calls, 1 + 2); /* 16 writes; 8 in two rounds (the first write alone) */
    assert_int_equal(s.stream_calls, 1 + 1);
    for (uint32_t j = 0; j + 1 < NB; j++) assert_true(b_used(&s, toks, j) > b_used(&s, toks, j + 1));
    /* the conversation written back again, all of it stored: the third probe is lost with the
       connection; one error, its block put again, the round ends there and the rest are found */
    s.drop_at = 2;
    TU_OK(pkv_tier_save_async(t, a, whole, &queued));
    TU_OK(pkv_tier_flush(t));
    pkv_tier_stats st2 = tstats(t);
    assert_int_equal(st2.errors, 1);
    assert_int_equal(st2.saved, st.saved + 1);
    assert_int_equal(st2.save_present, st.save_present + NB - 1);
    /* a new prompt of 3 blocks whose second put fails together: put again alone, no error */
    int32_t more[3 * B];
    prompt(more, 3 * B, 1900);
    pkv_seq three = filled(a, NULL, more, 3 * B);
    s.fail_put_at = 1;
    TU_OK(pkv_tier_save_async(t, a, three, &queued));
    TU_OK(pkv_tier_flush(t));
    const pkv_tier_stats st3 = tstats(t);
    assert_int_equal(st3.errors, 1);
    assert_int_equal(st3.saved, st2.saved + 3);
    assert_int_equal(s.n, 1 + NB + 3);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
}

static void test_faults(void **state) {
    (void)state;
    int32_t toks[N];
    prompt(toks, N, 1100);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 16, LAYERS);
    pkv_seq sa = filled(a, NULL, toks, N), s;
    fake f = {.fail_put_at = 2, .fail_get_at = -1};
    const pkv_tier_ops ops = fake_ops;
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    uint32_t saved = 7;
    TU_RC(pkv_tier_save(t, a, sa, &saved), PKV_EIO); /* the third put: the two before are deleted */
    assert_int_equal(fake_count(&f), 0);
    assert_int_equal(saved, 0);
    assert_int_equal(tstats(t).errors, 1);
    assert_int_equal(tstats(t).saved, 0);
    f.fail_put_at = -1;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    assert_int_equal(tstats(t).entries, 0); /* no usage op */
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    /* the store fails the third get: two blocks, then the load ends, successfully */
    f.n_get = 0, f.fail_get_at = 2, f.n_calls = 0;
    assert_int_equal(load_fresh(t, b, NULL, toks, N, NULL, &s), 16);
    assert_int_equal(f.n_calls, 3); /* nothing asked of a failing store after its failure */
    assert_int_equal(tstats(t).errors, 2);
    same_rows(a, sa, b, s, 16);
    f.fail_get_at = -1;
    /* garbled, shortened, crafted rows, another token, another entry, another parent: each refused at block 0
       and deleted */
    pkv_cache *c = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    int *knob[6] = {&f.garble, &f.shorten, &f.craft, &f.retoken, &f.other, &f.reparent};
    for (int k = 0; k < 6; k++) {
        *knob[k] = 1;
        assert_int_equal(load_fresh(t, c, NULL, toks, N, NULL, &s), 0);
        assert_int_equal(tstats(t).rejected, (uint64_t)k + 1);
        assert_int_equal(fake_count(&f), 4); /* block 0 deleted */
        assert_int_equal(tu_info(c, s).n_tokens, 0);
        *knob[k] = 0;
        TU_OK(pkv_tier_save(t, a, sa, &saved)); /* put back */
        assert_int_equal(saved, 1);
    }
    /* the crafted entry without the -128 passes: the check above was the cache's */
    assert_int_equal(load_fresh(t, c, NULL, toks, N, NULL, &s), 40);
    same_rows(a, sa, c, s, 40);
    TU_CHECK(c);
    pkv_tier_destroy(t);
    clear_fake(&f);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
}

/* ---- sliding windows: a dropped front saved, and a windowed load of what the window reads ---- */
enum { WN = 217, WIN = 40 };

/* A conversation of 200 positions of toks in a (pattern TAG), its front dropped as a window of
 * WIN leaves it for the next query (at 200: blocks 0-19 go). */
static pkv_seq window_conversation(pkv_cache *a, const int32_t *toks) {
    pkv_seq sa;
    TU_OK(pkv_seq_create(a, "win", 3, &sa));
    TU_OK(pkv_seq_append(a, sa, toks, 200, NULL));
    TU_WRITE_PAT(a, sa, 0, 200, TAG);
    TU_OK(pkv_seq_commit(a, sa, 200));
    TU_OK(pkv_seq_drop_front(a, sa, 200 - WIN + 1)); /* the next query (200) sees 161 .. 200 */
    assert_int_equal(tu_info(a, sa).n_dropped, 160);
    return sa;
}

/* A fresh sequence of c loaded under the window from t with toks[0, n): the positions it gives
 * (asserted to be the sequence's length, all committed) and the front (positions). */
static uint32_t load_window_fresh(pkv_tier *t, pkv_cache *c, const int32_t *toks, uint32_t n, pkv_seq *out,
                                  uint32_t *front) {
    pkv_seq s;
    uint32_t got = 99999;
    TU_OK(pkv_seq_create(c, "win", 3, &s));
    TU_OK(pkv_tier_load_window(t, c, s, toks, n, WIN, &got));
    const pkv_seq_info info = tu_info(c, s);
    assert_int_equal(info.n_tokens, got);
    assert_int_equal(info.n_committed, got);
    *front = info.n_dropped;
    TU_CHECK(c);
    *out = s;
    return got;
}

/* A conversation of 200 positions in cache a drops what a window of 40 no longer reads (blocks
 * 0-19): its save stores blocks 20-24 only, keyed through the ids the index keeps of the front.
 * An empty cache b restores it with pkv_tier_load_window: the front skipped (200 positions, 5
 * blocks loaded, K/V byte for byte a's), the front's identities tombstones in b's index (20,
 * STORED said parents first), so a windowed match in b takes the loaded blocks and a plain one
 * stops at once. The conversation goes on in b (2 blocks more) and is saved from b: only the new
 * blocks are stored, under the keys a would have made, as a third cache's windowed load of the
 * longer prompt shows (front 176), and a plain pkv_tier_load continues a windowed sequence. */
static void test_window(void **state) {
    (void)state;
    int32_t toks[WN];
    prompt(toks, WN, 3000);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    pkv_tier *t = host(1u << 24);
    const pkv_seq sa = window_conversation(a, toks);
    uint32_t saved = 99;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    assert_int_equal(tstats(t).entries, 5);
    TU_CHECK(a);
    /* b restores the window: blocks 20-24 */
    pkv_config cfg = tu_config(40, B, LAYERS, KV, HD, PKV_DTYPE_F16);
    cfg.enable_prefix_cache = 1;
    cfg.event_capacity = 256;
    pkv_cache *b = tu_create(&cfg);
    pkv_seq sb;
    uint32_t front = 0;
    assert_int_equal(load_window_fresh(t, b, toks, 201, &sb, &front), 200);
    assert_int_equal(front, 160);
    same_rows_at(a, sa, b, sb, 160, 40);
    pkv_tier_stats ts = tstats(t);
    assert_int_equal(ts.loaded_blocks, 5);
    assert_int_equal(ts.loaded_tokens, 40);
    assert_int_equal(ts.load_misses, 0);
    pkv_stats st;
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_tombstones, 20);
    assert_int_equal(st.n_indexed, 5);
    assert_int_equal(st.n_active, 5);
    pkv_event ev[64];
    size_t n_ev = 0;
    TU_OK(pkv_cache_take_events(b, ev, 64, NULL, &n_ev));
    assert_int_equal(n_ev, 25);
    for (uint32_t i = 0; i < 25; i++) {
        assert_int_equal(ev[i].kind, PKV_EVENT_STORED);
        assert_int_equal(ev[i].depth, i);
        assert_true((ev[i].block >= 40) == (i < 20)); /* a tombstone's block: n_blocks or more */
        if (i) assert_true(ev[i].parent_hash == ev[i - 1].hash);
    }
    /* b's pool now answers a windowed match; a plain one stops at the first tombstone */
    pkv_seq m;
    uint32_t r = 99;
    TU_OK(pkv_seq_create(b, "win", 3, &m));
    TU_OK(pkv_seq_match_prefix_window(b, m, toks, 201, WIN, &r));
    assert_int_equal(r, 200);
    assert_int_equal(tu_info(b, m).n_dropped, 160);
    TU_OK(pkv_seq_release(b, m));
    TU_OK(pkv_seq_create(b, "win", 3, &m));
    TU_OK(pkv_seq_match_prefix(b, m, toks, 201, &r));
    assert_int_equal(r, 0);
    TU_OK(pkv_seq_release(b, m));
    TU_CHECK(b);
    /* the conversation goes on in b: 16 positions, 2 full blocks more; b's save stores those */
    goes_on(b, sb, toks, 200, 16);
    TU_OK(pkv_tier_save(t, b, sb, &saved));
    assert_int_equal(saved, 2);
    assert_int_equal(tstats(t).save_present, 5);
    /* a third cache: the longer prompt's window (from 177 on: blocks 22-26), and a plain load
       that goes on past a windowed one */
    pkv_cache *c = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    pkv_seq sc;
    assert_int_equal(load_window_fresh(t, c, toks, WN, &sc, &front), 216);
    assert_int_equal(front, 176);
    same_rows_at(b, sb, c, sc, 176, 40);
    TU_OK(pkv_seq_release(c, sc));
    assert_int_equal(load_window_fresh(t, c, toks, 201, &sc, &front), 200); /* (from c's pool: none yet) */
    uint32_t got = 0;
    TU_OK(pkv_tier_load(t, c, sc, toks, WN, &got));
    assert_int_equal(got, 16);
    assert_int_equal(tu_info(c, sc).n_dropped, 160);
    same_rows_at(b, sb, c, sc, 160, 56);
    TU_CHECK(c);
    /* window 0 is pkv_tier_load's: refused, nothing changed */
    pkv_seq z;
    TU_OK(pkv_seq_create(c, "win", 3, &z));
    got = 7;
    TU_RC(pkv_tier_load_window(t, c, z, toks, WN, 0, &got), PKV_EINVAL);
    assert_int_equal(tu_info(c, z).n_tokens, 0);
    pkv_tier_destroy(t);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
}

/* The windowed load against a store of the test's: where the store holds the latest window
 * whole, it only gets those blocks (no probe first); prefetched under the window
 * (pkv_tier_prefetch_window), it takes every block from staging; a block missing inside the
 * window rules out every end past it, each block asked about once after that (3 gets, then 22
 * probes for a prompt of 25 blocks, none loadable: blocks 0-19 were never saved); a store that
 * fails the third get of a load that skipped its front leaves the sequence empty (a window that
 * would reach past the front). */
static void test_window_faults(void **state) {
    (void)state;
    int32_t toks[WN];
    prompt(toks, WN, 3000);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    const pkv_seq sa = window_conversation(a, toks);
    fake f;
    fake_init(&f);
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_create(&fake_ops, &f, NULL, &t));
    uint32_t saved = 0, front = 9;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    /* the store holds the latest window whole (the usual case): the load asks nothing first,
       5 gets and the 4 touches after (deepest first, for a least-recently-used store); the
       probes of the first form (stop 92's) came on top: 14 calls */
    pkv_cache *p = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    pkv_seq s;
    f.n_calls = 0, f.n_get = 0;
    assert_int_equal(load_window_fresh(t, p, toks, 201, &s, &front), 200);
    assert_int_equal(f.n_get, 5);
    assert_int_equal(f.n_calls, 9);
    pkv_cache_destroy(p);
    /* prefetched under the window: the thread stages blocks 20-24 (those the whole prompt's
       window reads), and the load takes them from staging: no get of its own goes to the store */
    TU_OK(pkv_tier_prefetch_start(t, 1u << 22));
    p = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    TU_RC(pkv_tier_prefetch_window(t, p, "win", 3, toks, 201, 0), PKV_EINVAL);
    TU_OK(pkv_tier_prefetch_window(t, p, "win", 3, toks, 201, WIN));
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(tstats(t).prefetched, 5);
    const int gets = f.n_get;
    assert_int_equal(load_window_fresh(t, p, toks, 201, &s, &front), 200);
    assert_int_equal(front, 160);
    same_rows_at(a, sa, p, s, 160, 40);
    assert_int_equal(tstats(t).prefetch_hits, 5);
    assert_int_equal(f.n_get, gets);
    pkv_cache_destroy(p);
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    /* the third get fails: 2 blocks loaded, then the window (from 137) would need block 17 */
    f.fail_get_at = 2, f.n_get = 0;
    const uint64_t loaded_before = tstats(t).loaded_blocks;
    assert_int_equal(load_window_fresh(t, b, toks, 201, &s, &front), 0);
    assert_int_equal(front, 0);
    pkv_tier_stats ts = tstats(t);
    assert_int_equal(ts.errors, 1);
    assert_int_equal(ts.loaded_blocks, loaded_before);
    pkv_stats st;
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_active, 0);
    assert_int_equal(st.n_tombstones, 0);
    TU_OK(pkv_seq_release(b, s));
    f.fail_get_at = -1;
    /* block 22 gone from the store: no end has its window's blocks all there */
    for (int i = 0; i < 32; i++)
        if (f.data[i] && first_tok(f.data[i]) == toks[22 * B]) free(f.data[i]), f.data[i] = NULL;
    assert_int_equal(fake_count(&f), 4);
    f.n_calls = 0;
    assert_int_equal(load_window_fresh(t, b, toks, 201, &s, &front), 0);
    assert_int_equal(f.n_calls, 25);
    assert_int_equal(tstats(t).load_misses, 1);
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_active, 0);
    TU_CHECK(b);
    pkv_tier_destroy(t);
    clear_fake(&f);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
}

void pkv__cache_test_tombs(pkv_cache *c, uint32_t n); /* cache_int.h */

/* How the front of a windowed load is linked into the index (the review's cases of stop 92):
 * - two windowed loads of one prompt (two requests matched before either loaded): the second's
 *   first block has an indexed twin, the first's: it takes that block, so its chain is the
 *   index's and its continuation's save stores the 2 new blocks;
 * - too few tombstones for the front: none made, no event, nothing indexed (the load itself
 *   succeeds);
 * - a front block the index has only as a full registered partial (its indexed twin evicted):
 *   the partial is made the entry, no tombstone beside it, so the same plain match twice finds
 *   the same 16 positions (a tombstone there gave 8, then 16);
 * - B = 1: the block of the prompt's last token (which no load gives) is not probed: no miss. */
static void test_window_link(void **state) {
    (void)state;
    int32_t toks[WN];
    prompt(toks, WN, 3000);
    pkv_tier *t = host(1u << 24);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 40, LAYERS);
    uint32_t saved = 0, got = 0, r = 9;
    TU_OK(pkv_tier_save(t, a, window_conversation(a, toks), &saved));
    assert_int_equal(saved, 5);
    pkv_cache_destroy(a);
    pkv_config cfg = tu_config(40, B, LAYERS, KV, HD, PKV_DTYPE_F16);
    cfg.enable_prefix_cache = 1;
    cfg.event_capacity = 256;
    pkv_cache *b = tu_create(&cfg);
    pkv_seq x, y;
    TU_OK(pkv_seq_create(b, "win", 3, &x));
    TU_OK(pkv_seq_create(b, "win", 3, &y));
    TU_OK(pkv_seq_match_prefix_window(b, y, toks, 201, WIN, &r));
    assert_int_equal(r, 0);
    TU_OK(pkv_tier_load_window(t, b, x, toks, 201, WIN, &got));
    assert_int_equal(got, 200);
    TU_OK(pkv_tier_load_window(t, b, y, toks, 201, WIN, &got));
    assert_int_equal(got, 200);
    pkv_stats st;
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_active, 9); /* x's 5, y's own 4 (its first is x's) */
    TU_CHECK(b);
    goes_on(b, y, toks, 200, 16);
    TU_OK(pkv_tier_save(t, b, y, &saved));
    assert_int_equal(saved, 2);
    same_rows_at(b, x, b, y, 160, 40);
    pkv_cache_destroy(b);
    /* too few tombstones: 20 wanted, 5 allowed */
    b = tu_create(&cfg);
    pkv__cache_test_tombs(b, 5);
    TU_OK(pkv_seq_create(b, "win", 3, &x));
    TU_OK(pkv_tier_load_window(t, b, x, toks, 201, WIN, &got));
    assert_int_equal(got, 200);
    pkv_event ev[8];
    size_t n_ev = 9;
    TU_OK(pkv_cache_take_events(b, ev, 8, NULL, &n_ev));
    assert_int_equal(n_ev, 0);
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_tombstones, 0);
    assert_int_equal(st.n_indexed, 0);
    TU_CHECK(b);
    pkv_cache_destroy(b);
    pkv_tier_destroy(t);
    /* the front as a full registered partial: B = 8, a window of 8, 17 tokens */
    int32_t p[17], other[56];
    for (int i = 0; i < 17; i++) p[i] = 100 + i;
    for (int i = 0; i < 56; i++) other[i] = 9000 + i;
    t = host(1u << 24);
    a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sa = filled(a, NULL, p, 16);
    TU_OK(pkv_seq_drop_front(a, sa, 9));
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 1);
    b = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 8, LAYERS);
    pkv_seq q = filled(b, NULL, p, 1); /* a registered partial of block 0 */
    pkv_seq s2 = filled(b, NULL, p, 8);  /* block 0 indexed */
    TU_OK(pkv_seq_append(b, q, p + 1, 7, NULL));
    TU_WRITE_PAT(b, q, 1, 7, TAG);
    TU_OK(pkv_seq_commit(b, q, 8)); /* full, its twin indexed: it stays a partial */
    TU_OK(pkv_seq_release(b, s2));
    TU_OK(pkv_seq_release(b, filled(b, NULL, other, 56))); /* s2's block evicted */
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_indexed, 7);
    TU_OK(pkv_seq_create(b, NULL, 0, &y));
    TU_OK(pkv_tier_load_window(t, b, y, p, 17, 8, &got));
    assert_int_equal(got, 16);
    assert_int_equal(tu_info(b, y).n_dropped, 8);
    TU_OK(pkv_cache_get_stats(b, &st));
    assert_int_equal(st.n_tombstones, 0);
    TU_CHECK(b);
    for (int i = 0; i < 2; i++) {
        pkv_seq m;
        TU_OK(pkv_seq_create(b, NULL, 0, &m));
        TU_OK(pkv_seq_match_prefix(b, m, p, 17, &r));
        assert_int_equal(r, 16);
        TU_CHECK(b);
        TU_OK(pkv_seq_release(b, m));
    }
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_tier_destroy(t);
    /* B = 1 */
    pkv_config c1 = tu_config(64, 1, LAYERS, KV, HD, PKV_DTYPE_F16);
    c1.enable_prefix_cache = 1;
    a = tu_create(&c1);
    b = tu_create(&c1);
    t = host(1u << 24);
    TU_OK(pkv_tier_save(t, a, filled(a, NULL, toks, 29), &saved));
    assert_int_equal(saved, 29);
    TU_OK(pkv_seq_create(b, NULL, 0, &y));
    TU_OK(pkv_tier_load_window(t, b, y, toks, 30, 5, &got));
    assert_int_equal(got, 29);
    assert_int_equal(tu_info(b, y).n_dropped, 25);
    assert_int_equal(tstats(t).load_misses, 0);
    TU_CHECK(b);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_tier_destroy(t);
}

/* Random requests under a window of 20 over two small caches and a host tier of 12 entries:
 * each is matched under the window (pkv_seq_match_prefix_window), loaded under it
 * (pkv_tier_load_window), computed, committed, drops what the window passed and is saved; at
 * times the pool forgets (pkv_cache_reset). After each step: the sequence's front is one the
 * window allows at its length, what it holds from there is its own variant's, the checker
 * passes; at the end the tier's counts are the steps' sums. */
static void test_window_random(void **state) {
    (void)state;
    enum { STEPS = 400, VAR = 4, MAXLEN = 120, LIVE = 3, W = 20 };
    tu_rng r;
    tu_rng_seed(&r, tu_env_u64("PKV_SEED", 72));
    pkv_cache *cs[2] = {mk(PKV_DTYPE_F16, PKV_DTYPE_F32, 20, LAYERS), mk(PKV_DTYPE_F16, PKV_DTYPE_F32, 28, LAYERS)};
    const uint64_t entry = 88 + B * 4 + (uint64_t)LAYERS * B * KV * (pkv_dtype_row_bytes(PKV_DTYPE_F16, HD) +
                                                                       pkv_dtype_row_bytes(PKV_DTYPE_F32, HD));
    pkv_tier *t = host(12 * entry);
    pkv_seq live[2][LIVE];
    int n_live[2] = {0, 0};
    uint64_t loaded_total = 0, saved_total = 0, skips = 0, windowed_hits = 0;
    int32_t toks[MAXLEN];
    for (int step = 0; step < STEPS; step++) {
        const int ci = (int)tu_rng_below(&r, 2);
        pkv_cache *c = cs[ci];
        const uint32_t v = tu_rng_below(&r, VAR), n = 2 + tu_rng_below(&r, MAXLEN - 1);
        for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)(100 * v + 3 * i);
        const char salt[2] = {(char)('a' + v % 2), 0};
        pkv_seq s;
        uint32_t reused = 0, got = 0, saved = 0;
        TU_OK(pkv_seq_create(c, salt, 1, &s));
        TU_OK(pkv_seq_match_prefix_window(c, s, toks, n, W, &reused));
        TU_OK(pkv_tier_load_window(t, c, s, toks, n, W, &got));
        const uint32_t len = reused + got;
        const pkv_seq_info in = tu_info(c, s);
        assert_true(len <= n - 1);
        assert_int_equal(in.n_tokens, len);
        assert_int_equal(in.n_committed, len);
        /* the front: a block boundary no query at len or past it reads before */
        assert_int_equal(in.n_dropped % B, 0);
        assert_true(!in.n_dropped || in.n_dropped + W - 1 <= len);
        if (len > in.n_dropped) assert_int_equal(tu_cmp_pattern(c, s, in.n_dropped, len - in.n_dropped, v), 0);
        loaded_total += reused ? got : got - in.n_dropped;
        skips += !reused && got && in.n_dropped;
        windowed_hits += reused && in.n_dropped;
        int rc = pkv_seq_append(c, s, toks + len, n - len, NULL);
        if (rc == PKV_OK) {
            TU_WRITE_PAT(c, s, len, n - len, v);
            TU_OK(pkv_seq_commit(c, s, n));
            if (n >= W) TU_OK(pkv_seq_drop_front(c, s, n - W + 1)); /* the next query, at n, sees n - W + 1 on */
            TU_OK(pkv_tier_save(t, c, s, &saved));
            saved_total += saved;
        } else {
            assert_int_equal(rc, PKV_ENOSPC);
        }
        TU_CHECK(c);
        if (rc == PKV_OK && n_live[ci] < LIVE && tu_rng_chance(&r, 0.5)) live[ci][n_live[ci]++] = s;
        else TU_OK(pkv_seq_release(c, s));
        if (n_live[ci] && tu_rng_chance(&r, 0.3)) TU_OK(pkv_seq_release(c, live[ci][--n_live[ci]]));
        if (tu_rng_chance(&r, 0.03)) { /* an engine restart: the pool forgets, the tier does not */
            for (int j = 0; j < n_live[ci]; j++) TU_OK(pkv_seq_release(c, live[ci][j]));
            n_live[ci] = 0;
            TU_OK(pkv_cache_reset(c));
        }
        TU_CHECK(c);
    }
    pkv_tier_stats st = tstats(t);
    if (getenv("PKV_TEST_VERBOSE"))
        printf("test_window_random: %llu saved, %llu loaded blocks (%llu positions), %llu misses, %llu evictions; "
               "%llu loads skipped a front, %llu windowed pool hits\n",
               (unsigned long long)st.saved, (unsigned long long)st.loaded_blocks, (unsigned long long)st.loaded_tokens,
               (unsigned long long)st.load_misses, (unsigned long long)st.evictions, (unsigned long long)skips,
               (unsigned long long)windowed_hits);
    assert_int_equal(st.saved, saved_total);
    assert_int_equal(st.loaded_tokens, loaded_total);
    assert_true(skips > 0 && windowed_hits > 0 && st.evictions > 0);
    assert_int_equal(st.rejected + st.errors, 0);
    for (int ci = 0; ci < 2; ci++) {
        for (int j = 0; j < n_live[ci]; j++) TU_OK(pkv_seq_release(cs[ci], live[ci][j]));
        TU_CHECK(cs[ci]);
        pkv_cache_destroy(cs[ci]);
    }
    pkv_tier_destroy(t);
}

/* ---- prefetch: a prompt's entries staged by the tier's thread, then loaded from memory ---- */
static void test_prefetch(void **state) {
    (void)state;
    int32_t toks[N], toks2[N];
    prompt(toks, N, 1700);
    prompt(toks2, N, 2900);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 16, LAYERS);
    pkv_seq sa = filled(a, "ns", toks, N), s;
    static fake f;
    fake_init(&f);
    const pkv_tier_ops ops = fake_ops;
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    uint32_t saved = 0;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    /* not started: refused */
    TU_RC(pkv_tier_prefetch(t, b, "ns", 2, toks, N), PKV_EINVAL);
    TU_RC(pkv_tier_prefetch_wait(t), PKV_EINVAL);
    TU_RC(pkv_tier_prefetch_start(t, 0), PKV_EINVAL);
    TU_RC(pkv_tier_prefetch_start(NULL, 1), PKV_EINVAL);
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    TU_RC(pkv_tier_prefetch_start(t, 1u << 24), PKV_EINVAL); /* once */
    TU_RC(pkv_tier_prefetch(t, NULL, "ns", 2, toks, N), PKV_EINVAL);
    TU_RC(pkv_tier_prefetch(t, b, NULL, 2, toks, N), PKV_EINVAL);
    TU_RC(pkv_tier_prefetch(t, b, "ns", 2, NULL, N), PKV_EINVAL);
    TU_OK(pkv_tier_prefetch(t, b, "ns", 2, toks, B - 1)); /* no full block: nothing to do */
    /* staged: every block, one get each; the load then asks the store for no entry */
    f.n_get = 0;
    TU_OK(pkv_tier_prefetch(t, b, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    pkv_tier_stats st = tstats(t);
    assert_int_equal(st.prefetched, 5);
    assert_int_equal(st.staged_entries, 5);
    const uint64_t held = st.staged_bytes / 5; /* an entry's buffer in staging */
    assert_int_equal(st.staged_bytes, 5 * held);
    assert_true(held > 88 + B * 4);
    assert_int_equal(f.n_get, 5);
    TU_OK(pkv_tier_prefetch(t, b, "ns", 2, toks, N)); /* staged already: no get */
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(f.n_get, 5);
    assert_int_equal(load_fresh(t, b, "ns", toks, N, NULL, &s), 40);
    assert_int_equal(f.n_get, 5);
    same_rows(a, sa, b, s, 40);
    st = tstats(t);
    assert_int_equal(st.prefetch_hits, 5);
    assert_int_equal(st.staged_entries, 0);
    assert_int_equal(st.staged_bytes, 5 * held); /* the buffers, kept for the next fetches */
    /* another namespace: the first block is missing, nothing staged */
    TU_OK(pkv_tier_prefetch(t, b, "other", 5, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(tstats(t).prefetched, 5);
    assert_int_equal(f.n_get, 6);
    /* a store that gives a garbled entry: the thread stages none of it (it checks as the load
       does), and the load then finds it in the store, refuses it and deletes it there */
    f.garble = 1;
    TU_OK(pkv_tier_prefetch(t, b, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    f.garble = 0;
    assert_int_equal(tstats(t).staged_entries, 0);
    assert_int_equal(tstats(t).prefetched, 5);
    f.garble = 1;
    pkv_cache *c = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    assert_int_equal(load_fresh(t, c, "ns", toks, N, NULL, &s), 0);
    f.garble = 0;
    assert_int_equal(tstats(t).rejected, 1);
    assert_int_equal(fake_count(&f), 4);
    TU_OK(pkv_tier_save(t, a, sa, &saved)); /* put back */
    /* a store that hangs: 64 prefetches queue, the 65th is refused; released, all finish */
    atomic_store(&f.gate, 1);
    for (int i = 0; i < 64; i++) TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    TU_RC(pkv_tier_prefetch(t, c, "ns", 2, toks, N), PKV_EBUSY);
    atomic_store(&f.gate, 0);
    TU_OK(pkv_tier_prefetch_wait(t));
    st = tstats(t);
    assert_int_equal(st.staged_entries, 5);
    assert_int_equal(st.prefetched, 10);
    assert_int_equal(st.staged_bytes, 5 * held);
    pkv_tier_destroy(t);
    /* staging of 2.5 entries: the oldest staged entries are dropped; the load takes the rest from
       staging and the dropped ones from the store; then another prompt's prefetch drops the
       kept buffers and what is staged to stay within it */
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    const uint64_t small = 2 * held + held / 2;
    TU_OK(pkv_tier_prefetch_start(t, small));
    f.n_get = 0;
    TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    st = tstats(t);
    assert_int_equal(st.prefetched, 5);
    assert_int_equal(st.prefetch_dropped, 3);
    assert_int_equal(st.staged_entries, 2);
    assert_int_equal(st.staged_bytes, 2 * held);
    pkv_cache_destroy(c);
    c = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    assert_int_equal(load_fresh(t, c, "ns", toks, N, NULL, &s), 40);
    same_rows(a, sa, c, s, 40);
    assert_int_equal(tstats(t).prefetch_hits, 2);
    assert_int_equal(f.n_get, 5 + 3);
    assert_int_equal(tstats(t).staged_bytes, 2 * held); /* two spares */
    pkv_seq sa2 = filled(a, "ns", toks2, N);
    TU_OK(pkv_tier_save(t, a, sa2, &saved));
    assert_int_equal(saved, 5);
    TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks2, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    st = tstats(t);
    assert_int_equal(st.prefetched, 10);
    assert_int_equal(st.staged_entries, 2);
    assert_true(st.staged_bytes <= small);
    assert_int_equal(st.prefetch_dropped, 3 + 3);
    /* staging too small for one entry: nothing is fetched */
    pkv_tier_destroy(t);
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    TU_OK(pkv_tier_prefetch_start(t, held - 1));
    TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(tstats(t).prefetched, 0);
    assert_int_equal(tstats(t).staged_bytes, 0);
    /* destroyed with prefetches queued: they are dropped, nothing leaks */
    pkv_tier_destroy(t);
    tu_alloc_state as;
    pkv_allocator al = tu_allocator(&as);
    tu_alloc_reset(&as, -1);
    TU_OK(pkv_tier_create(&ops, &f, &al, &t));
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    for (int i = 0; i < 20; i++) TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    pkv_tier_destroy(t);
    assert_int_equal(as.n_live, 0);
    /* the buffers a load took serve the next prefetch: it allocates its jobs only */
    tu_alloc_reset(&as, -1);
    TU_OK(pkv_tier_create(&ops, &f, &al, &t));
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    pkv_cache_destroy(c);
    c = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    assert_int_equal(load_fresh(t, c, "ns", toks, N, NULL, &s), 40);
    const long calls = as.n_calls;
    const size_t live = as.live_bytes;
    TU_OK(pkv_tier_prefetch(t, c, "other", 5, toks, N)); /* a miss: nothing staged */
    TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(as.n_calls - calls, 2);
    assert_int_equal(as.live_bytes, live); /* the jobs freed, the buffers the same */
    st = tstats(t);
    assert_int_equal(st.prefetched, 10);
    assert_int_equal(st.staged_entries, 5);
    pkv_tier_destroy(t);
    assert_int_equal(as.n_live, 0);
    /* allocation failures: the job's (PKV_ENOMEM, nothing queued) and staging's (nothing staged) */
    tu_alloc_reset(&as, -1);
    TU_OK(pkv_tier_create(&ops, &f, &al, &t));
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    as.fail_at = as.n_calls;
    TU_RC(pkv_tier_prefetch(t, c, "ns", 2, toks, N), PKV_ENOMEM);
    as.fail_at = as.n_calls + 1; /* the job is allocated; its first staged entry is not */
    TU_OK(pkv_tier_prefetch(t, c, "ns", 2, toks, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(tstats(t).prefetched, 0);
    assert_int_equal(tstats(t).staged_bytes, 0);
    assert_int_equal(as.n_failed, 2);
    pkv_tier_destroy(t);
    assert_int_equal(as.n_live, 0);
    assert_int_equal(as.n_bad_free, 0);
    clear_fake(&f);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
}

/* ---- write-back: a save's entries made at once, put by the tier's thread ---- */
static void *flush_main(void *t) { return (void *)(intptr_t)pkv_tier_flush(t); }

static void test_write_back(void **state) {
    (void)state;
    int32_t toks[N], toks2[N];
    prompt(toks, N, 3300);
    prompt(toks2, N, 5300);
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 16, LAYERS);
    pkv_seq sa = filled(a, "wb", toks, N), sb2 = filled(a, "wb", toks2, N), s;
    static fake f;
    fake_init(&f);
    const pkv_tier_ops ops = fake_ops;
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    uint32_t q = 99;
    TU_RC(pkv_tier_save_async(t, a, sa, &q), PKV_EINVAL); /* no thread */
    assert_int_equal(q, 0);
    TU_RC(pkv_tier_flush(t), PKV_EINVAL);
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    TU_RC(pkv_tier_save_async(NULL, a, sa, &q), PKV_EINVAL);
    TU_RC(pkv_tier_save_async(t, a, 12345, &q), PKV_ENOENT);
    /* a store that hangs: the save returns with its entries made, and the sequence can go */
    atomic_store(&f.gate, 1);
    pkv_seq sa2;
    TU_OK(pkv_seq_fork(a, sa, &sa2));
    TU_OK(pkv_tier_save_async(t, a, sa2, &q));
    assert_int_equal(q, 5);
    TU_OK(pkv_seq_release(a, sa2));
    usleep(20000);
    assert_int_equal(fake_count(&f), 0); /* the thread waits at the first put */
    const uint64_t held = tstats(t).staged_bytes / 5; /* an entry's buffer */
    assert_true(held > 88 + B * 4);
    assert_int_equal(tstats(t).staged_bytes, 5 * held);
    atomic_store(&f.gate, 0);
    TU_OK(pkv_tier_flush(t));
    assert_int_equal(fake_count(&f), 5);
    pkv_tier_stats st = tstats(t);
    assert_int_equal(st.saved, 5);
    assert_int_equal(st.staged_bytes, 5 * held); /* the buffers, kept for the next writes */
    /* put deepest first, as a synchronous save */
    assert_int_equal(atomic_load(&f.n_log), 5);
    for (int i = 0; i < 5; i++) assert_int_equal(f.log[i], toks[(4 - i) * B]);
    /* the stored entries load as a synchronous save's do */
    pkv_cache *b = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    assert_int_equal(load_fresh(t, b, "wb", toks, N, NULL, &s), 40);
    same_rows(a, sa, b, s, 40);
    /* again: the thread finds them there */
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    TU_OK(pkv_tier_flush(t));
    assert_int_equal(tstats(t).save_present, 5);
    assert_int_equal(tstats(t).saved, 5);
    /* writes go before prefetches: the first prompt's first put held, a prefetch queued behind
       it; released, the store sees the five puts, then the prefetch's five gets */
    clear_fake(&f);
    TU_OK(pkv_tier_save(t, a, sb2, &q)); /* the second prompt stored, for the prefetch to fetch */
    assert_int_equal(q, 5);
    atomic_store(&f.n_log, 0);
    pkv_cache_destroy(b);
    b = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    atomic_store(&f.hold_tok, toks[4 * B]); /* the first prompt's first put waits */
    atomic_store(&f.gate, 1);
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    usleep(20000);                                   /* the thread at that put */
    TU_OK(pkv_tier_prefetch(t, b, "wb", 2, toks2, N)); /* queued behind the writes */
    atomic_store(&f.gate, 0);
    TU_OK(pkv_tier_flush(t));
    TU_OK(pkv_tier_prefetch_wait(t));
    atomic_store(&f.hold_tok, 0);
    assert_int_equal(atomic_load(&f.n_log), 5 + 5);
    for (int i = 0; i < 5; i++) assert_int_equal(f.log[i], toks[(4 - i) * B]);   /* the writes */
    for (int i = 0; i < 5; i++) assert_int_equal(f.log[5 + i], -toks2[i * B]);    /* then the fetches */
    assert_int_equal(tstats(t).prefetched, 5);
    /* a flush waits for the writes queued before it, not for those queued after: the first
       prompt's first put held, a flush on another thread, the second prompt queued, then the
       hold moved to the second's first put: the flush returns with the second's held */
    clear_fake(&f);
    atomic_store(&f.hold_tok, toks[4 * B]);
    atomic_store(&f.gate, 1);
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    pthread_t fl;
    assert_int_equal(pthread_create(&fl, NULL, flush_main, t), 0);
    usleep(20000);
    TU_OK(pkv_tier_save_async(t, a, sb2, &q));
    atomic_store(&f.hold_tok, toks2[4 * B]);
    void *frc;
    assert_int_equal(pthread_join(fl, &frc), 0);
    assert_int_equal((intptr_t)frc, PKV_OK);
    assert_int_equal(fake_count(&f), 5); /* the second's first put still held */
    atomic_store(&f.gate, 0);
    atomic_store(&f.hold_tok, 0);
    TU_OK(pkv_tier_flush(t));
    assert_int_equal(fake_count(&f), 10);
    /* a put that fails: the flush says so, once */
    clear_fake(&f);
    f.n_put = 0, f.fail_put_at = 1;
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    TU_RC(pkv_tier_flush(t), PKV_EIO);
    TU_OK(pkv_tier_flush(t));
    assert_int_equal(fake_count(&f), 4);
    f.fail_put_at = -1;
    /* entries queued at destroy are put first */
    clear_fake(&f);
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    pkv_tier_destroy(t);
    assert_int_equal(fake_count(&f), 5);
    /* staging for three entries: no room for the save's five, so it saves now, synchronously
       (stored on return, no flush), and staging holds nothing of it */
    clear_fake(&f);
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    TU_OK(pkv_tier_prefetch_start(t, 3 * held));
    TU_OK(pkv_tier_prefetch(t, b, "wb", 2, toks2, N)); /* a miss: the store is empty */
    TU_OK(pkv_tier_prefetch_wait(t));
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    assert_int_equal(q, 0);
    assert_int_equal(fake_count(&f), 5);
    assert_int_equal(tstats(t).saved, 5);
    assert_int_equal(tstats(t).staged_bytes, held); /* the miss's buffer, kept */
    /* three staged entries, then a save that cannot fit: nothing staged is dropped for it */
    TU_OK(pkv_tier_save(t, a, sb2, &q));
    TU_OK(pkv_tier_prefetch(t, b, "wb", 2, toks2, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    assert_int_equal(tstats(t).staged_entries, 3);
    const uint64_t dropped = tstats(t).prefetch_dropped;
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    assert_int_equal(q, 0);
    assert_int_equal(tstats(t).staged_entries, 3);
    assert_int_equal(tstats(t).prefetch_dropped, dropped);
    /* staging for six entries: three staged and two kept buffers (a load took two), then a
       save of five: it takes the two buffers and drops two staged entries for the other three,
       and staging stays within its six */
    pkv_tier_destroy(t);
    TU_OK(pkv_tier_create(&ops, &f, NULL, &t));
    TU_OK(pkv_tier_prefetch_start(t, 6 * held));
    TU_OK(pkv_tier_prefetch(t, b, "wb", 2, toks2, N));
    TU_OK(pkv_tier_prefetch_wait(t));
    pkv_cache_destroy(b);
    b = mk(PKV_DTYPE_F16, PKV_DTYPE_Q8_0, 60, LAYERS);
    assert_int_equal(load_fresh(t, b, "wb", toks2, 2 * B + 1, NULL, &s), 2 * B);
    st = tstats(t);
    assert_true(st.staged_entries == 3 && st.staged_bytes == 5 * held && st.prefetch_dropped == 0);
    for (int i = 0; i < 32; i++) /* the first prompt's entries out of the store: all five put */
        if (f.data[i] && first_tok(f.data[i]) >= toks[0] && first_tok(f.data[i]) < toks2[0]) free(f.data[i]), f.data[i] = NULL;
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    assert_int_equal(q, 5);
    st = tstats(t);
    assert_true(st.staged_entries == 1 && st.prefetch_dropped == 2 && st.staged_bytes == 6 * held);
    TU_OK(pkv_tier_flush(t));
    assert_int_equal(tstats(t).staged_bytes, 6 * held);
    /* allocation failures of the entries' buffers: the save is made now; the two it had stay
       as spares, within the staging */
    pkv_tier_destroy(t);
    clear_fake(&f);
    tu_alloc_state as;
    pkv_allocator al = tu_allocator(&as);
    tu_alloc_reset(&as, -1);
    TU_OK(pkv_tier_create(&ops, &f, &al, &t));
    TU_OK(pkv_tier_prefetch_start(t, 1u << 24));
    as.fail_at = as.n_calls + 2; /* the third buffer */
    TU_OK(pkv_tier_save_async(t, a, sa, &q));
    assert_int_equal(q, 0);
    assert_int_equal(fake_count(&f), 5);
    TU_OK(pkv_tier_flush(t));
    assert_int_equal(tstats(t).staged_bytes, 2 * held);
    pkv_tier_destroy(t);
    assert_int_equal(as.n_live, 0);
    assert_int_equal(as.n_bad_free, 0);
    clear_fake(&f);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
}

/* ---- allocation failures: tier creation, the store's put, the cache's entry buffer ---- */
static void test_alloc_faults(void **state) {
    (void)state;
    int32_t toks[N];
    prompt(toks, N, 1300);
    tu_alloc_state as;
    pkv_allocator al = tu_allocator(&as);
    for (long k = 0;; k++) { /* every allocation of pkv_tier_host_create */
        tu_alloc_reset(&as, k);
        pkv_tier *t = NULL;
        int rc = pkv_tier_host_create(1u << 24, &al, &t);
        if (rc == PKV_OK) {
            pkv_tier_destroy(t);
            assert_int_equal(as.n_live, 0);
            assert_true(k > 0);
            break;
        }
        assert_int_equal(rc, PKV_ENOMEM);
        assert_null(t);
        assert_int_equal(as.n_live, 0);
    }
    char dir[] = "/tmp/pkv-tierf-XXXXXX";
    assert_non_null(mkdtemp(dir));
    for (long k = 0;; k++) { /* every allocation of pkv_tier_file_create */
        tu_alloc_reset(&as, k);
        pkv_tier *t = NULL;
        int rc = pkv_tier_file_create(dir, 1u << 24, &al, &t);
        if (rc == PKV_OK) {
            pkv_tier_destroy(t);
            assert_int_equal(as.n_live, 0);
            break;
        }
        assert_int_equal(rc, PKV_ENOMEM);
        assert_int_equal(as.n_live, 0);
    }
    rmdir(dir);
    assert_int_equal(as.n_bad_free, 0);
    /* the store's allocations fail during a save: PKV_ENOMEM, no entry stays */
    pkv_cache *a = mk(PKV_DTYPE_F16, PKV_DTYPE_F16, 16, LAYERS);
    pkv_seq sa = filled(a, NULL, toks, N);
    tu_alloc_reset(&as, -1);
    pkv_tier *t = NULL;
    TU_OK(pkv_tier_host_create(1u << 24, &al, &t));
    as.fail_at = as.n_calls + 2;
    uint32_t saved;
    TU_RC(pkv_tier_save(t, a, sa, &saved), PKV_ENOMEM);
    assert_int_equal(tstats(t).entries, 0);
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    /* the cache's allocator fails the token and key buffers, the tier's the entry buffer: the
       save and the load refuse, nothing changed */
    pkv_config cfg = tu_config(40, B, LAYERS, KV, HD, PKV_DTYPE_F16);
    cfg.enable_prefix_cache = 1;
    tu_alloc_state cs;
    tu_alloc_reset(&cs, -1);
    cfg.allocator = tu_allocator(&cs);
    pkv_cache *b = tu_create(&cfg);
    pkv_seq sb;
    TU_OK(pkv_seq_create(b, NULL, 0, &sb));
    for (long k = 0; k < 2; k++) {
        cs.fail_at = cs.n_calls + k;
        uint32_t got = 9;
        TU_RC(pkv_tier_load(t, b, sb, toks, N, &got), PKV_ENOMEM);
        assert_int_equal(tu_info(b, sb).n_tokens, 0);
    }
    cs.fail_at = -1;
    pkv_tier *fresh = NULL; /* no entry buffer kept yet */
    TU_OK(pkv_tier_host_create(1u << 24, &al, &fresh));
    as.fail_at = as.n_calls;
    uint32_t got = 9;
    TU_RC(pkv_tier_load(fresh, b, sb, toks, N, &got), PKV_ENOMEM);
    as.fail_at = as.n_calls;
    TU_RC(pkv_tier_save(fresh, a, sa, &saved), PKV_ENOMEM);
    assert_int_equal(tstats(fresh).entries, 0);
    as.fail_at = -1;
    assert_int_equal(tu_info(b, sb).n_tokens, 0);
    pkv_tier_destroy(fresh);
    got = 0;
    TU_OK(pkv_tier_load(t, b, sb, toks, N, &got));
    assert_int_equal(got, 40);
    same_rows(a, sa, b, sb, 40);
    for (long k = 0; k < 3; k++) {
        cs.fail_at = cs.n_calls + k;
        TU_RC(pkv_tier_save(t, b, sb, &saved), PKV_ENOMEM);
    }
    cs.fail_at = -1;
    TU_CHECK(b);
    pkv_cache_destroy(b);
    assert_int_equal(cs.n_live, 0);
    pkv_tier_destroy(t);
    assert_int_equal(as.n_live, 0);
    assert_int_equal(as.n_bad_free, 0);
    pkv_cache_destroy(a);
}

/* ---- a random workload over two caches and one small tier, checked after every step ----
 * Prompts of four variants (a variant's tokens depend on the position only, and so do its rows:
 * pattern tag = variant), random lengths; each request matches, loads, computes the rest, checks
 * every committed row against its variant's pattern, saves, and is released or kept for a while.
 * The pools and the tier are small, so blocks are evicted from both. The checker runs after every
 * step, and the tier's counters must add up. */
static void test_random(void **state) {
    (void)state;
    enum { STEPS = 400, VAR = 4, MAXLEN = 60, LIVE = 3 };
    tu_rng r;
    tu_rng_seed(&r, tu_env_u64("PKV_SEED", 71));
    /* (dtypes the pattern's values are exact in: the checks compare values) */
    pkv_cache *cs[2] = {mk(PKV_DTYPE_F16, PKV_DTYPE_F32, 20, LAYERS), mk(PKV_DTYPE_F16, PKV_DTYPE_F32, 28, LAYERS)};
    const uint64_t entry = 88 + B * 4 + (uint64_t)LAYERS * B * KV * (pkv_dtype_row_bytes(PKV_DTYPE_F16, HD) +
                                                                       pkv_dtype_row_bytes(PKV_DTYPE_F32, HD));
    pkv_tier *t = host(10 * entry);
    pkv_seq live[2][LIVE];
    int n_live[2] = {0, 0};
    uint64_t loaded_total = 0, saved_total = 0;
    int32_t toks[MAXLEN];
    for (int step = 0; step < STEPS; step++) {
        const int ci = (int)tu_rng_below(&r, 2);
        pkv_cache *c = cs[ci];
        const uint32_t v = tu_rng_below(&r, VAR), n = 2 + tu_rng_below(&r, MAXLEN - 1);
        for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)(100 * v + 3 * i);
        const char salt[2] = {(char)('a' + v % 2), 0}; /* two namespaces: variants 0, 2 and 1, 3 */
        pkv_seq s;
        uint32_t reused = 0, got = 0, saved = 0;
        TU_OK(pkv_seq_create(c, salt, 1, &s));
        TU_OK(pkv_seq_match_prefix(c, s, toks, n, &reused));
        TU_OK(pkv_tier_load(t, c, s, toks, n, &got));
        assert_true(reused + got <= n - 1);
        assert_int_equal(tu_info(c, s).n_committed, reused + got);
        assert_int_equal(tu_cmp_pattern(c, s, 0, reused + got, v), 0); /* what came back is this variant's */
        loaded_total += got;
        int rc = pkv_seq_append(c, s, toks + reused + got, n - reused - got, NULL);
        if (rc == PKV_OK) {
            TU_WRITE_PAT(c, s, reused + got, n - reused - got, v);
            TU_OK(pkv_seq_commit(c, s, n));
            TU_OK(pkv_tier_save(t, c, s, &saved));
            saved_total += saved;
        } else
            assert_int_equal(rc, PKV_ENOSPC);
        TU_CHECK(c);
        if (rc == PKV_OK && n_live[ci] < LIVE && tu_rng_chance(&r, 0.5)) live[ci][n_live[ci]++] = s;
        else TU_OK(pkv_seq_release(c, s));
        if (n_live[ci] && tu_rng_chance(&r, 0.3)) TU_OK(pkv_seq_release(c, live[ci][--n_live[ci]]));
        if (tu_rng_chance(&r, 0.02)) { /* an engine restart: the pool forgets, the tier does not */
            for (int j = 0; j < n_live[ci]; j++) TU_OK(pkv_seq_release(c, live[ci][j]));
            n_live[ci] = 0;
            TU_OK(pkv_cache_reset(c));
        }
        TU_CHECK(c);
    }
    pkv_tier_stats st = tstats(t);
    if (getenv("PKV_TEST_VERBOSE"))
        printf("test_random: %llu saved, %llu loaded blocks (%llu positions), %llu misses, %llu evictions\n",
               (unsigned long long)st.saved, (unsigned long long)st.loaded_blocks, (unsigned long long)st.loaded_tokens,
               (unsigned long long)st.load_misses, (unsigned long long)st.evictions);
    assert_int_equal(st.saved, saved_total);
    assert_int_equal(st.loaded_tokens, loaded_total);
    assert_true(st.loaded_blocks > 0 && st.evictions > 0 && st.entries <= 10);
    assert_int_equal(st.rejected + st.errors, 0);
    assert_true(st.bytes <= 10 * entry);
    for (int ci = 0; ci < 2; ci++) {
        for (int j = 0; j < n_live[ci]; j++) TU_OK(pkv_seq_release(cs[ci], live[ci][j]));
        TU_CHECK(cs[ci]);
        pkv_cache_destroy(cs[ci]);
    }
    pkv_tier_destroy(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip), cmocka_unit_test(test_partial),     cmocka_unit_test(test_media_guard),
        cmocka_unit_test(test_mismatch),
        cmocka_unit_test(test_lru),       cmocka_unit_test(test_file),        cmocka_unit_test(test_faults),
        cmocka_unit_test(test_save_batched), cmocka_unit_test(test_write_back_batched),
        cmocka_unit_test(test_alloc_faults), cmocka_unit_test(test_random), cmocka_unit_test(test_use_order),
        cmocka_unit_test(test_prefetch),  cmocka_unit_test(test_write_back),  cmocka_unit_test(test_window),
        cmocka_unit_test(test_window_faults), cmocka_unit_test(test_window_link), cmocka_unit_test(test_window_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
