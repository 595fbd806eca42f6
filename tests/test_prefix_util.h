/* test_prefix_util.h: helpers of the prefix-caching tests: caches of a given shape, sequences
 * that "compute" their tokens (append + write K/V that is a pure function of salt and prefix,
 * see fuzz/prefix_model.h), and K/V checks against that oracle or another sequence. Include
 * after cmocka.h and prefix_model.h. */
#ifndef PKV_TEST_PREFIX_UTIL_H
#define PKV_TEST_PREFIX_UTIL_H

#include <stdlib.h>
#include <string.h>

#define TP_H 2 /* kv heads */
#define TP_D 8 /* head_dim */

static inline pkv_cache *tp_cache(uint32_t B, uint32_t n_blocks, uint32_t layers, pkv_dtype dt, int prefix) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = layers;
    cfg.n_kv_heads = TP_H;
    cfg.head_dim = TP_D;
    cfg.block_tokens = B;
    cfg.n_blocks = n_blocks;
    cfg.k_dtype = cfg.v_dtype = dt;
    cfg.n_threads = 1;
    cfg.huge_pages = 0;
    cfg.enable_prefix_cache = prefix;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), 0);
    return c;
}

static inline void tp_check(pkv_cache *c) {
    char msg[256] = "";
    int rc = pkv_cache_check(c, msg, sizeof msg);
    if (rc != 0) fail_msg("pkv_cache_check: %s: %s", pkv_strerror(rc), msg);
}

/* A sequence in namespace pm_salts[salt]. */
static inline pkv_seq tp_seq(pkv_cache *c, int salt) {
    pkv_seq s = 0;
    assert_int_equal(pkv_seq_create(c, pm_salts[salt], pm_salt_lens[salt], &s), 0);
    return s;
}

/* n distinct-looking token ids from a seed. */
static inline void tp_tokens(int32_t *out, uint32_t n, uint64_t seed) {
    uint64_t r = seed * 0x2545F4914F6CDD1Dull;
    for (uint32_t i = 0; i < n; i++) out[i] = (int32_t)((r = pm_mix(r)) % 1000003u);
}

/* Chain hash of position p of a sequence in namespace `salt` holding toks[0 .. p]. */
static inline uint64_t tp_hash(int salt, const int32_t *toks, uint32_t p) {
    uint64_t h = pm_root(salt);
    for (uint32_t i = 0; i <= p; i++) h = pm_next(h, toks[i], i);
    return h;
}

/* Appends toks[start .. start + n) to s (whose first `start` tokens are toks[0 .. start)) and
 * writes their K/V, every layer, as the oracle says. */
static inline void tp_compute(pkv_cache *c, pkv_seq s, int salt, const int32_t *toks, uint32_t start, uint32_t n) {
    pkv_config cfg;
    assert_int_equal(pkv_cache_config(c, &cfg), 0);
    int32_t *slots = malloc(n * sizeof *slots);
    float *k = malloc((size_t)n * TP_H * TP_D * sizeof(float)), *v = malloc((size_t)n * TP_H * TP_D * sizeof(float));
    assert_true(slots && k && v);
    assert_int_equal(pkv_seq_append(c, s, toks + start, n, slots), 0);
    for (uint32_t l = 0; l < cfg.n_layers; l++) {
        uint64_t h = start ? tp_hash(salt, toks, start - 1) : pm_root(salt);
        for (uint32_t i = 0; i < n; i++) {
            h = pm_next(h, toks[start + i], start + i);
            for (uint32_t hd = 0; hd < TP_H; hd++)
                for (uint32_t d = 0; d < TP_D; d++) {
                    k[(i * TP_H + hd) * TP_D + d] = pm_val(h, l, 0, hd, d);
                    v[(i * TP_H + hd) * TP_D + d] = pm_val(h, l, 1, hd, d);
                }
        }
        assert_int_equal(pkv_write_kv(c, l, slots, n, k, v, PKV_DTYPE_F32), 0);
    }
    free(slots);
    free(k);
    free(v);
}

static inline void tp_commit(pkv_cache *c, pkv_seq s, uint32_t n) { assert_int_equal(pkv_seq_commit(c, s, n), 0); }

/* A new sequence in namespace salt that has computed and committed toks[0 .. n). */
static inline pkv_seq tp_prompt(pkv_cache *c, int salt, const int32_t *toks, uint32_t n) {
    pkv_seq s = tp_seq(c, salt);
    tp_compute(c, s, salt, toks, 0, n);
    tp_commit(c, s, n);
    return s;
}

static inline pkv_stats tp_stats(pkv_cache *c) {
    pkv_stats st;
    assert_int_equal(pkv_cache_get_stats(c, &st), 0);
    return st;
}

/* Positions [start, start + n) of s hold the oracle's K/V for toks in namespace salt. */
static inline void tp_expect_kv(pkv_cache *c, pkv_seq s, int salt, const int32_t *toks, uint32_t start, uint32_t n) {
    pkv_config cfg;
    assert_int_equal(pkv_cache_config(c, &cfg), 0);
    float *k = malloc((size_t)n * TP_H * TP_D * sizeof(float)), *v = malloc((size_t)n * TP_H * TP_D * sizeof(float));
    assert_true(k && v);
    for (uint32_t l = 0; l < cfg.n_layers; l++) {
        assert_int_equal(pkv_seq_gather(c, s, l, start, n, k, v), 0);
        uint64_t h = start ? tp_hash(salt, toks, start - 1) : pm_root(salt);
        for (uint32_t i = 0; i < n; i++) {
            h = pm_next(h, toks[start + i], start + i);
            for (uint32_t hd = 0; hd < TP_H; hd++)
                for (uint32_t d = 0; d < TP_D; d++) {
                    size_t o = ((size_t)i * TP_H + hd) * TP_D + d;
                    if (k[o] != pm_val(h, l, 0, hd, d) || v[o] != pm_val(h, l, 1, hd, d))
                        fail_msg("layer %u pos %u head %u dim %u: K %g V %g, expected %g %g", l, start + i, hd, d,
                                 k[o], v[o], pm_val(h, l, 0, hd, d), pm_val(h, l, 1, hd, d));
                }
        }
    }
    free(k);
    free(v);
}

/* Sequences a and b gather identical K/V over [start, start + n), every layer. */
static inline void tp_expect_same(pkv_cache *c, pkv_seq a, pkv_seq b, uint32_t start, uint32_t n) {
    pkv_config cfg;
    assert_int_equal(pkv_cache_config(c, &cfg), 0);
    size_t m = (size_t)n * TP_H * TP_D;
    float *ka = malloc(m * sizeof(float)), *va = malloc(m * sizeof(float));
    float *kb = malloc(m * sizeof(float)), *vb = malloc(m * sizeof(float));
    assert_true(ka && va && kb && vb);
    for (uint32_t l = 0; l < cfg.n_layers; l++) {
        assert_int_equal(pkv_seq_gather(c, a, l, start, n, ka, va), 0);
        assert_int_equal(pkv_seq_gather(c, b, l, start, n, kb, vb), 0);
        assert_memory_equal(ka, kb, m * sizeof(float));
        assert_memory_equal(va, vb, m * sizeof(float));
    }
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

/* A new sequence in namespace salt that matches toks[0 .. n): it must reuse exactly `want`
 * tokens, holding the oracle's K/V for them. */
static inline pkv_seq tp_match(pkv_cache *c, int salt, const int32_t *toks, uint32_t n, uint32_t want) {
    pkv_seq s = tp_seq(c, salt);
    uint32_t reused = 0xdeadbeef;
    assert_int_equal(pkv_seq_match_prefix(c, s, toks, n, &reused), 0);
    assert_int_equal(reused, want);
    if (want) tp_expect_kv(c, s, salt, toks, 0, want);
    return s;
}

static inline void tp_expect_info(pkv_cache *c, pkv_seq s, uint32_t len, uint32_t committed) {
    pkv_seq_info info;
    assert_int_equal(pkv_seq_get_info(c, s, &info), 0);
    assert_int_equal(info.n_tokens, len);
    assert_int_equal(info.n_committed, committed);
}

static inline uint32_t tp_table(pkv_cache *c, pkv_seq s, int32_t *out, uint32_t cap) {
    uint32_t n = 0;
    assert_int_equal(pkv_seq_block_table(c, s, out, cap, &n), 0);
    return n;
}

#endif
