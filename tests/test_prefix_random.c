/* test_prefix_random.c: seeded randomized prefix-caching workload (many sequences sharing a few
 * prompts, salts, forks, truncates, releases, matches, pins) run against the shadow model of
 * fuzz/prefix_model.h, with pkv_cache_check and a K/V gather of every sequence after each step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "../fuzz/prefix_model.h"

#include <stdlib.h>

typedef struct totals {
    uint64_t matches, full_hits, partial_hits, root_hits, evictions, cow, enospc, forks, pins, truncs, tokens_hit, compact_moved;
    uint64_t attn, attn_queries, attn_bad, attn_pool, attn_in_place, attn_shared;
    uint64_t drops, attn_front, attn_masked;
    uint64_t window_matches, window_fronts, tomb_matches, tombs_end, tomb_hits;
    uint64_t tier_saves, tier_saved, tier_loads, tier_loaded, tier_window_loads, tier_window_fronts, tier_reloads;
    uint64_t tier_async, tier_prefetches, tier_prefetch_hits, tier_bounded, tier_window_bounded;
    uint64_t shifts, shift_moves, shift_copies;
} totals;

static void run_world_tier(uint32_t b0, uint32_t b1, int prefix_off, uint64_t seed, int steps, int tier, totals *t) {
    pm_world *w = malloc(sizeof *w);
    assert_non_null(w);
    pkv_config cfg = pm_config(b0, b1, prefix_off);
    if (pm_init(w, &cfg, seed) < 0) fail_msg("%s", w->err);
    char dir[] = "/tmp/pkv-prefix-random-XXXXXX";
    if (tier & 4) assert_non_null(mkdtemp(dir));
    if ((tier & 1) && pm_tier_on(w, tier & 2, tier & 4 ? dir : NULL) < 0) fail_msg("%s", w->err);
    w->shift_on = (tier & 8) != 0;
    w->trace = getenv("PM_TRACE") && atoi(getenv("PM_TRACE"));
    pm_src src = {.use_rng = 1, .rng = seed * 0x9E3779B97F4A7C15ull + b0 * 131 + b1};
    for (int i = 0; i < steps; i++)
        if (pm_step(w, &src) < 0)
            fail_msg("seed %llu B=%u k=%s v=%s layers=%u n_blocks=%u prefix=%d: %s", (unsigned long long)seed,
                     cfg.block_tokens, pkv_dtype_name(cfg.k_dtype), pkv_dtype_name(cfg.v_dtype), cfg.n_layers,
                     cfg.n_blocks, cfg.enable_prefix_cache, w->err);
    pkv_stats st;
    assert_int_equal(pkv_cache_get_stats(w->c, &st), 0);
    t->matches += w->n_matches;
    t->full_hits += w->n_full_block_hits;
    t->partial_hits += w->n_partial_hits;
    t->root_hits += w->n_root_hits;
    t->evictions += st.evictions;
    t->cow += st.cow_copies;
    t->enospc += w->n_enospc;
    t->forks += w->n_forks;
    t->pins += w->n_pins;
    t->truncs += w->n_truncs;
    t->compact_moved += w->n_compact_moved;
    t->tokens_hit += st.prefix_tokens_hit;
    t->attn += w->n_attn;
    t->attn_queries += w->n_attn_queries;
    t->attn_bad += w->n_attn_bad;
    t->attn_in_place += w->n_attn_in_place;
    t->attn_shared += w->n_attn_shared;
    t->attn_pool += st.attn_reqs_pool;
    t->drops += w->n_drops;
    t->attn_front += w->n_attn_front;
    t->attn_masked += w->n_attn_masked;
    t->window_matches += w->n_window_matches;
    t->window_fronts += w->n_window_fronts;
    t->tomb_matches += w->n_tomb_matches;
    t->tombs_end += st.n_tombstones;
    t->tomb_hits += st.prefix_tomb_hits;
    t->tier_saves += w->n_tier_saves;
    t->tier_saved += w->n_tier_saved_blocks;
    t->tier_loads += w->n_tier_loads;
    t->tier_loaded += w->n_tier_loaded_blocks;
    t->tier_window_loads += w->n_tier_window_loads;
    t->tier_window_fronts += w->n_tier_window_fronts;
    t->tier_reloads += w->n_tier_reloads;
    t->tier_async += w->n_tier_async;
    t->tier_prefetches += w->n_tier_prefetches;
    t->tier_bounded += w->n_tier_bounded;
    t->tier_window_bounded += w->n_tier_window_bounded;
    t->shifts += w->n_shifts, t->shift_moves += w->n_shift_moves, t->shift_copies += w->n_shift_copies;
    pkv_tier_stats ts;
    if (w->tier) {
        assert_int_equal(pkv_tier_get_stats(w->tier, &ts), 0);
        t->tier_prefetch_hits += ts.prefetch_hits;
    }
    pm_fini(w);
    free(w);
}

static void run_world(uint32_t b0, uint32_t b1, int prefix_off, uint64_t seed, int steps, totals *t) {
    run_world_tier(b0, b1, prefix_off, seed, steps, 0, t);
}

/* B = 4, f16 pool, pools from tight to roomy: reuse, eviction and CoW must all happen. */
static void test_prefix_random_b4(void **state) {
    (void)state;
    totals t = {0};
    for (uint64_t seed = 1; seed <= 6; seed++) run_world(0x00, (uint32_t)(seed * 7), 0, seed, 1500, &t);
    print_message("B=4: matches %llu full-block hits %llu partial hits %llu (in block 0 %llu) evictions %llu cow %llu "
                  "enospc %llu attention calls %llu (%llu queries, %llu masked) bad %llu\n",
                  (unsigned long long)t.matches, (unsigned long long)t.full_hits, (unsigned long long)t.partial_hits,
                  (unsigned long long)t.root_hits,
                  (unsigned long long)t.evictions, (unsigned long long)t.cow, (unsigned long long)t.enospc,
                  (unsigned long long)t.attn, (unsigned long long)t.attn_queries, (unsigned long long)t.attn_masked,
                  (unsigned long long)t.attn_bad);
    /* the workload must really exercise what it checks, or it proves nothing */
    assert_true(t.full_hits > 0);
    assert_true(t.partial_hits > 0);
    assert_true(t.root_hits > 0);
    assert_true(t.evictions > 0);
    assert_true(t.cow > 0);
    assert_true(t.forks > 0 && t.pins > 0 && t.truncs > 0 && t.compact_moved > 0);
    /* attention over those sequences, against the model's K/V, and its bad calls */
    assert_true(t.attn > 0 && t.attn_queries > t.attn && t.attn_bad > 0 && t.attn_in_place > 0);
    assert_true(t.attn_shared > 0); /* decodes of forks and matched prompts in shared-prefix groups */
    assert_true(t.attn_masked > 0);  /* prefills through custom masks */
    assert_true(t.drops > 0);        /* fronts dropped under the index (pkv_seq_drop_front calls taken) */
    print_message("B=4: windowed matches %llu (%llu with a front, %llu while tombstones were indexed, %llu through "
                  "one), tombstones at the end %llu\n",
                  (unsigned long long)t.window_matches, (unsigned long long)t.window_fronts,
                  (unsigned long long)t.tomb_matches, (unsigned long long)t.tomb_hits, (unsigned long long)t.tombs_end);
    assert_true(t.window_matches > 0 && t.window_fronts > 0 && t.tomb_matches > 0 && t.tomb_hits > 0);
}

/* Other block sizes (1, 3, 16), dtypes (f32, bf16, mixed K/V) and two layers. */
static void test_prefix_random_shapes(void **state) {
    (void)state;
    totals t = {0};
    static const uint32_t b0s[] = {0x01, 0x02, 0x03, 0x84, 0x88, 0x16, 0x1b, 0x8f};
    for (size_t i = 0; i < sizeof b0s / sizeof b0s[0]; i++)
        for (uint64_t seed = 1; seed <= 2; seed++)
            run_world(b0s[i], (uint32_t)(11 * seed + i), 0, 100 + seed, 1000, &t);
    print_message("shapes: matches %llu full-block hits %llu partial hits %llu evictions %llu cow %llu\n",
                  (unsigned long long)t.matches, (unsigned long long)t.full_hits, (unsigned long long)t.partial_hits,
                  (unsigned long long)t.evictions, (unsigned long long)t.cow);
    assert_true(t.full_hits > 0 && t.partial_hits > 0 && t.evictions > 0);
}

/* Prefix cache disabled: the same workload must never reuse or index anything. */
static void test_prefix_random_disabled(void **state) {
    (void)state;
    totals t = {0};
    for (uint64_t seed = 1; seed <= 4; seed++) run_world(0x00, 20, 1, seed, 800, &t);
    print_message("prefix off: %llu drop_front calls taken, %llu attention calls checked over dropped fronts\n",
                  (unsigned long long)t.drops, (unsigned long long)t.attn_front);
    assert_true(t.matches > 0);
    assert_int_equal(t.tokens_hit, 0);
    assert_true(t.drops > 0 && t.attn_front > 0); /* pkv_seq_drop_front, and attention past the fronts */
}

/* The same workloads with attention read in pool order (the sweep), whatever the call's size:
 * after forks, CoW, truncates and prefix reuse, the blocks of a batch are shared and scattered. */
static void test_prefix_random_attn_pool(void **state) {
    (void)state;
    totals t = {0};
    assert_int_equal(setenv("PKV_ATTN_ORDER", "pool", 1), 0);
    for (uint64_t seed = 1; seed <= 3; seed++) run_world(0x00, (uint32_t)(seed * 7), 0, 200 + seed, 1500, &t);
    static const uint32_t b0s[] = {0x01, 0x03, 0x88, 0x16};
    for (size_t i = 0; i < sizeof b0s / sizeof b0s[0]; i++) run_world(b0s[i], (uint32_t)(13 + i), 0, 300 + i, 1000, &t);
    assert_int_equal(unsetenv("PKV_ATTN_ORDER"), 0);
    print_message("pool order: %llu attention calls checked (%llu queries, %llu read in pool order), %llu bad calls\n",
                  (unsigned long long)t.attn, (unsigned long long)t.attn_queries, (unsigned long long)t.attn_pool,
                  (unsigned long long)t.attn_bad);
    assert_true(t.attn > 0 && t.attn_pool > 0 && t.attn_bad > 0);
}

/* The same workloads with a host tier behind the cache: saves of every kind of sequence (fronts
 * dropped, media, forks), loads plain, windowed and after matches, each block checked against the
 * model's K/V and the saves made; a save of a whole prompt loaded again right away gives it all.
 * Half the worlds run the tier's thread (loads after prefetches, saves written back), half keep
 * the entries in files (pkv_tier_file_create). */
static void test_prefix_random_tier(void **state) {
    (void)state;
    totals t = {0};
    /* (tier: 1, on; 2, with its thread: prefetches before loads, saves written back; 4, files) */
    for (uint64_t seed = 1; seed <= 8; seed++)
        run_world_tier(0x00, (uint32_t)(seed * 7), 0, 400 + seed, 1500, 1 | (int)(seed & 3) << 1, &t);
    static const uint32_t b0s[] = {0x01, 0x03, 0x88, 0x16};
    for (size_t i = 0; i < sizeof b0s / sizeof b0s[0]; i++)
        run_world_tier(b0s[i], (uint32_t)(17 + 5 * i), 0, 500 + i, 1000, 1 | (int)(i & 3) << 1, &t);
    print_message("tier: %llu saves (%llu blocks stored), %llu loads (%llu blocks), %llu windowed into an empty "
                  "sequence (%llu with a front), %llu reloads right after a save\n",
                  (unsigned long long)t.tier_saves, (unsigned long long)t.tier_saved, (unsigned long long)t.tier_loads,
                  (unsigned long long)t.tier_loaded, (unsigned long long)t.tier_window_loads,
                  (unsigned long long)t.tier_window_fronts, (unsigned long long)t.tier_reloads);
    print_message("tier's thread: %llu saves written back, %llu prefetches, %llu blocks loaded from staging\n",
                  (unsigned long long)t.tier_async, (unsigned long long)t.tier_prefetches,
                  (unsigned long long)t.tier_prefetch_hits);
    assert_true(t.tier_async > 0 && t.tier_prefetches > 0 && t.tier_prefetch_hits > 0);
    print_message("tier: %llu plain loads and %llu windowed ones held to the blocks a save surely stored\n",
                  (unsigned long long)t.tier_bounded, (unsigned long long)t.tier_window_bounded);
    assert_true(t.tier_saved > 0 && t.tier_loaded > 0 && t.tier_window_fronts > 0 && t.tier_reloads > 0);
    assert_true(t.tier_bounded > 0 && t.tier_window_bounded > 0);
    assert_true(t.full_hits > 0 && t.window_fronts > 0 && t.evictions > 0);
}

/* The same workloads with context shifts among the calls (pkv_seq_shift, no rope): rows moved
 * as stored and checked after every step, identities of the ids after the shift, nothing indexed
 * past it (the checker) and, with a tier, nothing saved past it. */
static void test_prefix_random_shift(void **state) {
    (void)state;
    totals t = {0};
    for (uint64_t seed = 1; seed <= 6; seed++)
        run_world_tier(0x00, (uint32_t)(seed * 11), seed == 6, 700 + seed, 1500, 8 | (seed & 1 ? 1 | (int)(seed & 2) : 0), &t);
    static const uint32_t b0s[] = {0x01, 0x03, 0x88, 0x16};
    for (size_t i = 0; i < sizeof b0s / sizeof b0s[0]; i++)
        run_world_tier(b0s[i], (uint32_t)(19 + 5 * i), 0, 800 + i, 1000, 8 | (i & 1), &t);
    print_message("shift: %llu shifts (%llu moved rows, %llu blocks copied first), %llu matches, %llu tier saves\n",
                  (unsigned long long)t.shifts, (unsigned long long)t.shift_moves, (unsigned long long)t.shift_copies,
                  (unsigned long long)t.matches, (unsigned long long)t.tier_saves);
    assert_true(t.shift_moves > 0 && t.shift_copies > 0 && t.tier_saves > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_random_b4),
        cmocka_unit_test(test_prefix_random_shapes),
        cmocka_unit_test(test_prefix_random_disabled),
        cmocka_unit_test(test_prefix_random_attn_pool),
        cmocka_unit_test(test_prefix_random_tier),
        cmocka_unit_test(test_prefix_random_shift),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
