/* test_thr_tier.c: threads with a cache each share one host tier and one file tier: each request
 * matches its prompt in its own pool, loads what the tier has, computes (writes) the rest,
 * checks every row, and saves. The pools are small, so their prefix blocks are evicted and come
 * back from the tiers; the tiers are small too, so they evict while other threads read. Runs
 * under ThreadSanitizer in CI (label "thread"). The file tier prefetches (its own thread stages a
 * prompt's entries while the requesting thread matches), so loads take staged entries too, and
 * two saves in three to it are written back by that thread (pkv_tier_save_async). A request in
 * three is windowed: matched and loaded under a window of 12 (pkv_seq_match_prefix_window,
 * pkv_tier_load_window), its front dropped before its save, its rows checked from the front. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NTHR = 3, ITERS = 60, B = 4, LAYERS = 2, KVH = 2, HD = 32, VARIANTS = 4, MAXN = 40, W = 12 };

typedef struct {
    pkv_cache *c;
    pkv_tier *tiers[2];
    uint64_t seed;
    long errors, loaded;
    char first_error[200];
} targ;

#define TCHECK(a, cond, ...)                                                                                         \
    do {                                                                                                             \
        if (!(cond)) {                                                                                               \
            if (!(a)->errors++) snprintf((a)->first_error, sizeof(a)->first_error, __VA_ARGS__);                   \
            goto done;                                                                                               \
        }                                                                                                            \
    } while (0)

/* Variant v's prompt: its tokens depend on v and the position only, so requests of one variant
 * share their prefixes; its K/V is pattern tag v (a function of the position: the same prefix,
 * the same rows), which the checks compare against. */
static void *worker(void *p) {
    targ *a = p;
    tu_rng r;
    tu_rng_seed(&r, a->seed);
    int32_t toks[MAXN];
    for (int it = 0; it < ITERS; it++) {
        const uint32_t v = tu_rng_below(&r, VARIANTS), n = 2 + tu_rng_below(&r, MAXN - 1);
        for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)(1000 * v + i);
        pkv_tier *t = a->tiers[it % 2];
        const bool win = it % 3 == 2; /* a windowed request: matched and loaded under W, its front dropped */
        pkv_seq s;
        uint32_t reused = 0, got = 0, saved = 0;
        int rc;
        if (it % 2) { /* the file tier's thread stages the prompt while this one matches */
            rc = pkv_tier_prefetch(t, a->c, "t", 1, toks, n);
            TCHECK(a, rc == PKV_OK || rc == PKV_EBUSY, "prefetch: %d", rc);
        }
        rc = pkv_seq_create(a->c, "t", 1, &s);
        TCHECK(a, rc == PKV_OK, "create: %d", rc);
        rc = win ? pkv_seq_match_prefix_window(a->c, s, toks, n, W, &reused)
                 : pkv_seq_match_prefix(a->c, s, toks, n, &reused);
        TCHECK(a, rc == PKV_OK, "match: %d", rc);
        rc = win ? pkv_tier_load_window(t, a->c, s, toks, n, W, &got) : pkv_tier_load(t, a->c, s, toks, n, &got);
        TCHECK(a, rc == PKV_OK, "load: %d", rc);
        a->loaded += got;
        const uint32_t m = reused + got;
        rc = pkv_seq_append(a->c, s, toks + m, n - m, NULL);
        if (rc == PKV_OK) {
            rc = tu_write_pattern(a->c, s, m, n - m, v);
            TCHECK(a, rc == PKV_OK, "write: %d", rc);
            rc = pkv_seq_commit(a->c, s, n);
            TCHECK(a, rc == PKV_OK, "commit: %d", rc);
            if (win && n >= W) { /* the next query, at n, sees from n - W + 1 on */
                rc = pkv_seq_drop_front(a->c, s, n - W + 1);
                TCHECK(a, rc == PKV_OK, "drop_front: %d", rc);
            }
        } else
            TCHECK(a, rc == PKV_ENOSPC, "append: %d", rc);
        pkv_seq_info info;
        rc = pkv_seq_get_info(a->c, s, &info);
        TCHECK(a, rc == PKV_OK, "info: %d", rc);
        long bad = tu_cmp_pattern(a->c, s, info.n_dropped, info.n_committed - info.n_dropped, v);
        TCHECK(a, bad == 0, "variant %u, n %u (reused %u, loaded %u): %ld elements differ", v, n, reused, got, bad);
        rc = pkv_tier_save(a->tiers[0], a->c, s, &saved);
        TCHECK(a, rc == PKV_OK, "save: %d", rc);
        rc = it % 3 ? pkv_tier_save_async(a->tiers[1], a->c, s, &saved) : pkv_tier_save(a->tiers[1], a->c, s, &saved);
        TCHECK(a, rc == PKV_OK, "save (file): %d", rc);
        /* now and then the writes so far in the store: where the tier's thread got no core
           before the workers ended (ctest beside a test of 2 threads), no file load found an
           entry (fs.loaded_blocks 0, seen once); a flush beside other threads' too */
        if (it % 8 == 7) {
            rc = pkv_tier_flush(a->tiers[1]);
            TCHECK(a, rc == PKV_OK, "flush: %d", rc);
        }
        rc = pkv_seq_release(a->c, s);
        TCHECK(a, rc == PKV_OK, "release: %d", rc);
    }
done:
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    char dir[] = "/tmp/pkv-thr-tier-XXXXXX";
    assert_non_null(mkdtemp(dir));
    /* an entry: 88 + B * 4 + LAYERS * B * KVH * (HD * 2) * 2 bytes; room for about 12 */
    const uint64_t entry = 88 + B * 4 + (uint64_t)LAYERS * B * KVH * HD * 2 * 2;
    pkv_tier *tiers[2];
    TU_OK(pkv_tier_host_create(12 * entry, NULL, &tiers[0]));
    TU_OK(pkv_tier_file_create(dir, 12 * entry, NULL, &tiers[1]));
    const uint64_t staging = 12 * entry; /* the writes waiting share it with the staged entries */
    TU_OK(pkv_tier_prefetch_start(tiers[1], staging));
    pthread_t th[NTHR];
    targ args[NTHR];
    pkv_cache *caches[NTHR];
    for (int i = 0; i < NTHR; i++) {
        pkv_config cfg = tu_config(14, B, LAYERS, KVH, HD, PKV_DTYPE_F16);
        cfg.enable_prefix_cache = 1;
        caches[i] = tu_create(&cfg);
        args[i] = (targ){.c = caches[i], .tiers = {tiers[0], tiers[1]}, .seed = tu_env_u64("PKV_SEED", 11) + (uint64_t)i};
        assert_int_equal(pthread_create(&th[i], NULL, worker, &args[i]), 0);
    }
    long loaded = 0;
    for (int i = 0; i < NTHR; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        if (args[i].errors) fail_msg("thread %d: %s", i, args[i].first_error);
        loaded += args[i].loaded;
        TU_CHECK(caches[i]);
        pkv_cache_destroy(caches[i]);
    }
    TU_OK(pkv_tier_prefetch_wait(tiers[1]));
    TU_OK(pkv_tier_flush(tiers[1]));
    pkv_tier_stats hs, fs;
    TU_OK(pkv_tier_get_stats(tiers[0], &hs));
    TU_OK(pkv_tier_get_stats(tiers[1], &fs));
    if (!(loaded > 0 && hs.loaded_blocks > 0 && fs.loaded_blocks > 0))
        fail_msg("loads: %ld positions, host tier %llu blocks, file tier %llu blocks", loaded,
                 (unsigned long long)hs.loaded_blocks, (unsigned long long)fs.loaded_blocks);
    assert_true(hs.evictions > 0 && fs.evictions > 0);
    assert_int_equal(hs.rejected + fs.rejected + hs.errors + fs.errors, 0);
    assert_true(hs.bytes <= 12 * entry && fs.bytes <= 12 * entry);
    print_message("prefetch: %llu staged, %llu loads from staging, %llu dropped; file tier: %llu saved, %llu present\n",
                  (unsigned long long)fs.prefetched, (unsigned long long)fs.prefetch_hits,
                  (unsigned long long)fs.prefetch_dropped, (unsigned long long)fs.saved,
                  (unsigned long long)fs.save_present);
    assert_true(fs.prefetched > 0 && fs.prefetch_hits <= fs.prefetched && fs.staged_bytes <= staging);
    pkv_tier_destroy(tiers[0]);
    pkv_tier_destroy(tiers[1]);
    /* the file tier's files: removed */
    pkv_tier *t;
    TU_OK(pkv_tier_file_create(dir, 1, NULL, &t)); /* capacity 1 byte: every entry goes */
    pkv_tier_stats st;
    TU_OK(pkv_tier_get_stats(t, &st));
    assert_int_equal(st.entries, 0);
    pkv_tier_destroy(t);
    assert_int_equal(rmdir(dir), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_threads)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
