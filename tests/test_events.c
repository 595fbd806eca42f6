/* test_events.c: the prefix index's events (pkv_cache_take_events, pkv_prefix_snapshot) and
 * pkv_prefix_hashes. A consumer's mirror of the index, built from events alone, is compared
 * with a snapshot after every step of random workloads; every event's hash is recomputed from
 * its tokens; and a router's prediction from the mirror and a prompt's hashes is compared with
 * the reuse the cache itself then gives that prompt. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "../fuzz/prefix_model.h"
#include "support_util.h"
#include "test_prefix_util.h"


static pkv_cache *ev_cache(uint32_t B, uint32_t n_blocks, uint32_t ev_cap) {
    pkv_config cfg = tu_config(n_blocks, B, 1, TP_H, TP_D, PKV_DTYPE_F16);
    cfg.enable_prefix_cache = 1;
    cfg.event_capacity = ev_cap;
    return tu_create(&cfg);
}

static size_t take(pkv_cache *c, pkv_event *ev, size_t cap, int32_t *toks) {
    size_t n = 12345;
    assert_int_equal(pkv_cache_take_events(c, ev, cap, toks, &n), 0);
    assert_true(n <= cap);
    return n;
}

static void hashes(int salt, uint32_t B, const int32_t *toks, size_t n, uint64_t *out, size_t want) {
    size_t got = 0;
    assert_int_equal(pkv_prefix_hashes(pm_salts[salt], pm_salt_lens[salt], B, toks, n, out, want, &got), 0);
    assert_int_equal(got, want);
}

/* ---- the deterministic cases ---------------------------------------------------------------- */

static void test_events_stored_removed_cleared(void **state) {
    (void)state;
    const uint32_t B = 4;
    pkv_cache *c = ev_cache(B, 6, 64);
    pkv_event ev[16];
    int32_t et[16 * 4], p[10], q[10];
    tp_tokens(p, 10, 1);
    tp_tokens(q, 10, 2);
    uint64_t hp[2];
    hashes(1, B, p, 10, hp, 2);

    /* two full committed blocks of p: STORED root first, then its child */
    pkv_seq a = tp_prompt(c, 1, p, 10);
    assert_int_equal(take(c, ev, 16, et), 2);
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(ev[i].kind, PKV_EVENT_STORED);
        assert_int_equal(ev[i].seqno, i + 1);
        assert_int_equal(ev[i].depth, i);
        assert_int_equal(ev[i].hash, hp[i]);
        assert_int_equal(ev[i].parent_hash, i ? hp[0] : 0);
        assert_int_equal(ev[i].lost, 0);
        assert_int_equal(ev[i].reserved, 0);
        assert_memory_equal(et + i * B, p + i * B, B * sizeof(int32_t));
    }
    int32_t tab[8];
    assert_int_equal(tp_table(c, a, tab, 8), 3);
    assert_int_equal(ev[0].block, tab[0]);
    assert_int_equal(ev[1].block, tab[1]);
    assert_int_equal(take(c, ev, 16, et), 0);

    /* the same prompt computed again is a private twin: no event; nor is a release (the blocks
       stay indexed, CACHED) or a match (the blocks are indexed already) */
    pkv_seq a2 = tp_prompt(c, 1, p, 8);
    assert_int_equal(pkv_seq_release(c, a2), 0);
    assert_int_equal(pkv_seq_release(c, a), 0);
    pkv_seq m = tp_seq(c, 1);
    uint32_t reused = 0;
    assert_int_equal(pkv_seq_match_prefix(c, m, p, 10, &reused), 0);
    assert_int_equal(reused, 8);
    assert_int_equal(pkv_seq_release(c, m), 0);
    assert_int_equal(take(c, ev, 16, et), 0);
    /* the same tokens under another namespace: other hashes */
    uint64_t h0[2];
    hashes(2, B, p, 10, h0, 2);
    assert_true(h0[0] != hp[0] && h0[1] != hp[1]);

    /* q needs 3 blocks of the 6: with p's 2 cached and one free... q's 12 tokens take every
       block, so p's leaf goes first, then its root (children before parents) */
    pkv_seq b = tp_prompt(c, 0, q, 10);
    pkv_seq b2 = tp_seq(c, 3);
    tp_compute(c, b2, 3, q, 0, 9);
    size_t n = take(c, ev, 16, et);
    uint64_t hq[2];
    hashes(0, B, q, 10, hq, 2);
    assert_int_equal(n, 4);
    assert_int_equal(ev[0].kind, PKV_EVENT_STORED);
    assert_int_equal(ev[0].hash, hq[0]);
    assert_int_equal(ev[1].kind, PKV_EVENT_STORED);
    assert_int_equal(ev[1].hash, hq[1]);
    assert_int_equal(ev[1].parent_hash, hq[0]);
    assert_int_equal(ev[2].kind, PKV_EVENT_REMOVED);
    assert_int_equal(ev[2].hash, hp[1]);
    assert_int_equal(ev[2].parent_hash, hp[0]);
    assert_int_equal(ev[2].depth, 1);
    assert_memory_equal(et + 2 * B, p + B, B * sizeof(int32_t));
    assert_int_equal(ev[3].kind, PKV_EVENT_REMOVED);
    assert_int_equal(ev[3].hash, hp[0]);
    assert_int_equal(ev[3].depth, 0);
    for (uint32_t i = 0; i < 4; i++) assert_int_equal(ev[i].seqno, 3 + i);
    tp_check(c);

    /* reset: one CLEARED, token ids zeroed */
    assert_int_equal(pkv_cache_reset(c), 0);
    memset(et, 0x55, sizeof et);
    assert_int_equal(take(c, ev, 16, et), 1);
    assert_int_equal(ev[0].kind, PKV_EVENT_CLEARED);
    assert_int_equal(ev[0].seqno, 7);
    assert_int_equal(ev[0].hash, 0);
    for (uint32_t i = 0; i < B; i++) assert_int_equal(et[i], 0);
    (void)b;
    (void)b2;
    pkv_cache_destroy(c);
}

/* A take of fewer than are held leaves the rest in order; tokens NULL is allowed. */
static void test_events_partial_take(void **state) {
    (void)state;
    const uint32_t B = 2;
    pkv_cache *c = ev_cache(B, 16, 8);
    int32_t p[13];
    tp_tokens(p, 13, 3);
    pkv_seq a = tp_prompt(c, 0, p, 13); /* 6 STORED */
    pkv_event ev[8];
    assert_int_equal(take(c, ev, 0, NULL), 0);
    assert_int_equal(take(c, ev, 4, NULL), 4);
    for (uint32_t i = 0; i < 4; i++) assert_int_equal(ev[i].seqno, i + 1);
    assert_int_equal(take(c, ev, 8, NULL), 2);
    assert_int_equal(ev[0].seqno, 5);
    assert_int_equal(ev[1].seqno, 6);
    assert_int_equal(ev[1].depth, 5);
    assert_int_equal(pkv_seq_release(c, a), 0);
    pkv_cache_destroy(c);
}

/* A full ring collapses into one OVERFLOW counting what was dropped; the seqnos say the same;
 * a snapshot then gives the whole index and forgets what the ring held. */
static void test_events_overflow(void **state) {
    (void)state;
    const uint32_t B = 2;
    for (uint32_t cap = 1; cap <= 4; cap++) {
        pkv_cache *c = ev_cache(B, 32, cap);
        int32_t p[21];
        tp_tokens(p, 21, 4 + cap);
        pkv_seq a = tp_prompt(c, 1, p, 21); /* 10 STORED */
        pkv_event ev[40];
        int32_t et[40 * 2];
        size_t n = take(c, ev, 40, et);
        /* the ring collapses at each event that finds it full: held + 1 lost, then those after */
        uint64_t lost = 0;
        for (uint32_t e = 1, held = 0; e <= 10; e++) {
            if (held == cap) {
                lost = lost ? lost + held : held + 1;
                held = 1;
                continue;
            }
            held++;
        }
        assert_int_equal(ev[0].kind, PKV_EVENT_OVERFLOW);
        assert_int_equal(ev[0].lost, lost);
        assert_int_equal(ev[0].seqno, lost);
        assert_int_equal(n, 1 + (10 - lost));
        for (size_t i = 1; i < n; i++) {
            assert_int_equal(ev[i].kind, PKV_EVENT_STORED);
            assert_int_equal(ev[i].seqno, lost + i);
            assert_int_equal(ev[i].depth, lost + i - 1);
        }
        for (uint32_t i = 0; i < B; i++) assert_int_equal(et[i], 0);

        /* refill, then resync: the snapshot has the 10 blocks, root first, and the ring is empty */
        pkv_seq b = tp_prompt(c, 2, p, 7); /* 3 more */
        size_t got = 0;
        assert_int_equal(pkv_prefix_snapshot(c, ev, 12, et, &got), PKV_ELIMIT);
        assert_int_equal(got, 13);
        assert_int_not_equal(take(c, ev, 1, NULL), 0); /* the failed snapshot forgot nothing */
        tp_prompt(c, 3, p, 3);                         /* 1 more */
        assert_int_equal(pkv_prefix_snapshot(c, ev, 40, et, &got), 0);
        assert_int_equal(got, 14);
        assert_int_equal(take(c, ev + 20, 20, NULL), 0);
        uint64_t h[10];
        for (int salt = 1; salt <= 3; salt++) {
            const uint32_t nb = salt == 1 ? 10 : salt == 2 ? 3 : 1;
            hashes(salt, B, p, 21, h, nb);
            for (uint32_t d = 0; d < nb; d++) {
                size_t at = 14;
                for (size_t i = 0; i < got; i++)
                    if (ev[i].hash == h[d]) at = i;
                assert_true(at < got);
                assert_int_equal(ev[at].kind, PKV_EVENT_STORED);
                assert_int_equal(ev[at].seqno, 0);
                assert_int_equal(ev[at].depth, d);
                assert_int_equal(ev[at].parent_hash, d ? h[d - 1] : 0);
                assert_memory_equal(et + at * B, p + d * B, B * sizeof(int32_t));
                if (d) { /* its parent came before it */
                    size_t pa = 14;
                    for (size_t i = 0; i < got; i++)
                        if (ev[i].hash == h[d - 1]) pa = i;
                    assert_true(pa < at);
                }
            }
        }
        (void)a;
        (void)b;
        pkv_cache_destroy(c);
    }
}

static void test_events_bad_input(void **state) {
    (void)state;
    pkv_config cfg = pkv_config_default();
    cfg.n_blocks = 8;
    cfg.event_capacity = (1u << 24) + 1;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    assert_null(c);
    /* the largest ring: 2^24 events of 1024 tokens, 64 GiB of token ids: past a 32-bit size_t
       (refused as such, where it wrapped to nothing before), refused by the allocator on 64 */
    tu_alloc_state as;
    tu_alloc_reset(&as, -1);
    as.refuse_over = (size_t)1 << 30;
    pkv_config big = cfg;
    big.allocator = tu_allocator(&as);
    big.event_capacity = 1u << 24;
    big.block_tokens = 1024;
    assert_int_equal(pkv_cache_create(&big, &c), sizeof(size_t) < 8 ? PKV_EINVAL : PKV_ENOMEM);
    assert_null(c);
    assert_int_equal(as.n_live, 0);
    cfg.event_capacity = 0;
    assert_int_equal(pkv_cache_create(&cfg, &c), 0);
    pkv_event ev[4];
    size_t n = 99;
    /* no events recorded: take refuses, a snapshot works */
    assert_int_equal(pkv_cache_take_events(c, ev, 4, NULL, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_snapshot(c, ev, 4, NULL, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(pkv_prefix_snapshot(c, NULL, 0, NULL, &n), 0);
    assert_int_equal(pkv_prefix_snapshot(c, NULL, 1, NULL, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_snapshot(c, ev, 4, NULL, NULL), PKV_EINVAL);
    assert_int_equal(pkv_prefix_snapshot(NULL, ev, 4, NULL, &n), PKV_EINVAL);
    pkv_cache_destroy(c);
    c = ev_cache(4, 8, 4);
    assert_int_equal(pkv_cache_take_events(NULL, ev, 4, NULL, &n), PKV_EINVAL);
    assert_int_equal(pkv_cache_take_events(c, NULL, 4, NULL, &n), PKV_EINVAL);
    assert_int_equal(pkv_cache_take_events(c, ev, 4, NULL, NULL), PKV_EINVAL);
    assert_int_equal(pkv_cache_take_events(c, NULL, 0, NULL, &n), 0);
    assert_int_equal(n, 0);
    pkv_cache_destroy(c);

    int32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint64_t h[4];
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 4, t, 8, h, 4, NULL), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 0, t, 8, h, 4, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 1025, t, 8, h, 4, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes(NULL, 1, 4, t, 8, h, 4, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes("x", 257, 4, t, 8, h, 4, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 4, NULL, 8, h, 4, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 4, t, 8, NULL, 4, &n), PKV_EINVAL);
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 4, NULL, 0, NULL, 0, &n), 0);
    assert_int_equal(n, 0);
    /* the cap and the partial tail bound the count; the chain is XXH3-64 seeded by the parent */
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 3, t, 8, h, 4, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(h[1], XXH3_64bits_withSeed(t + 3, 3 * sizeof(int32_t), h[0]));
    uint64_t h1;
    assert_int_equal(pkv_prefix_hashes(NULL, 0, 3, t, 8, &h1, 1, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(h1, h[0]);
    /* "" and no salt are one namespace (as in pkv_seq_create) */
    assert_int_equal(pkv_prefix_hashes("", 0, 3, t, 8, &h1, 1, &n), 0);
    assert_int_equal(h1, h[0]);
}

/* ---- the consumer's mirror (fuzz/prefix_model.h's pm_ev) ---------------------------------------- */

/* The pm world's random workload (forks, truncates, pins, matches, compaction, attention) with
 * events on: its pm_verify drains them into its mirror and compares that with a snapshot after
 * every step. */
static void test_events_random_world(void **state) {
    (void)state;
    uint64_t stored = 0, removed = 0, overflow = 0, tomb_matches = 0;
    for (uint64_t seed = 1; seed <= 8; seed++) {
        pm_world *w = malloc(sizeof *w);
        assert_non_null(w);
        const uint32_t b0 = (uint32_t)(seed * 5) & 0x7f, b1 = (uint32_t)(seed * 11);
        pkv_config cfg = pm_config(b0, b1, 0);
        cfg.event_capacity = seed % 2 ? 4096 : 3; /* odd seeds never overflow, even ones often */
        if (pm_init(w, &cfg, seed) < 0) fail_msg("%s", w->err);
        assert_non_null(w->ev);
        pm_src src = {.use_rng = 1, .rng = seed * 0x9E3779B97F4A7C15ull};
        for (int i = 0; i < 800; i++)
            if (pm_step(w, &src) < 0) fail_msg("seed %llu: %s", (unsigned long long)seed, w->err);
        stored += w->ev->n_stored, removed += w->ev->n_removed, overflow += w->ev->n_overflow;
        tomb_matches += w->n_tomb_matches;
        pm_fini(w);
        free(w);
    }
    print_message("events: %llu stored, %llu removed, %llu overflows; %llu windowed matches while tombstones were "
                  "indexed\n",
                  (unsigned long long)stored, (unsigned long long)removed, (unsigned long long)overflow,
                  (unsigned long long)tomb_matches);
    assert_true(stored > 500 && removed > 100 && overflow > 10);
    assert_true(tomb_matches > 0); /* tombstones in the index the mirror follows */
}

/* A router's view: from the drained mirror and pkv_prefix_hashes alone it predicts how many full
 * blocks of a prompt the cache holds; the cache's own match then reuses exactly that (capped at
 * n - 1 tokens). Workload: prompts of two families sharing prefixes, two namespaces, sequences
 * kept or released, partial commits, resets, in a pool too small to keep everything. */
static void test_events_router_prediction(void **state) {
    (void)state;
    static const uint32_t Bs[3] = {1, 4, 16};
    uint64_t predicted_blocks = 0, checks = 0, n_extra = 0;
    pkv_event ev1[8];
    for (uint32_t bi = 0; bi < 3; bi++) {
        const uint32_t B = Bs[bi], n_blocks = B == 1 ? 160 : B == 4 ? 48 : 14;
        pkv_cache *c = ev_cache(B, n_blocks, 256);
        static pm_ev m;
        static pm_world rw; /* its cache and error message only */
        memset(&m, 0, sizeof m);
        m.B = B;
        rw.c = c;
        int32_t fam[2][96];
        tp_tokens(fam[0], 96, 10 + bi);
        tp_tokens(fam[1], 96, 20 + bi);
        pkv_seq live[6] = {0};
        uint64_t r = 0x1234 + bi;
        for (int step = 0; step < 300; step++) {
            r = pm_mix(r);
            const int f = (int)(r & 1), salt = (int)((r >> 1) & 1);
            uint32_t n = 1 + (uint32_t)((r >> 8) % 96);
            int32_t prompt[96];
            memcpy(prompt, fam[f], sizeof prompt);
            if ((r >> 20) % 3 == 0) prompt[(r >> 24) % n] ^= 0x4000; /* a fork in the family tree */
            /* the router's prediction */
            uint64_t h[96];
            size_t nh = 0;
            assert_int_equal(pkv_prefix_hashes(pm_salts[salt], pm_salt_lens[salt], B, prompt, n, h, 96, &nh), 0);
            assert_int_equal(nh, n / B);
            uint32_t held = 0;
            while (held < nh && pm_ev_find(&m, h[held]) >= 0) held++;
            const uint32_t want = held < (n - 1) / B ? held : (n - 1) / B;
            /* the engine's reuse */
            pkv_seq s = tp_seq(c, salt);
            uint32_t reused = 0;
            assert_int_equal(pkv_seq_match_prefix(c, s, prompt, n, &reused), 0);
            /* one block more than the index held: a live sequence's committed tail block, full
               but not indexed (an identical twin was indexed first, since evicted), copied by
               token-granular matching; the copy is indexed then, and says so */
            const int extra = reused / B == want + 1;
            if (!extra) assert_int_equal(reused / B, want);
            if (extra) {
                size_t ne = take(c, ev1, 8, NULL);
                assert_true(ne >= 1);
                assert_int_equal(ev1[ne - 1].kind, PKV_EVENT_STORED);
                assert_int_equal(ev1[ne - 1].hash, h[want]);
                assert_int_equal(ev1[ne - 1].depth, want);
                n_extra++;
                if (pm_ev_snapshot(&rw, &m) < 0) fail_msg("%s", rw.err);
                m.last_seqno = 0;
            }
            predicted_blocks += want, checks++;
            /* compute the rest (when it fits), commit all or part, keep or release */
            int rc = 0;
            if (n > reused) {
                int32_t slots[96];
                rc = pkv_seq_append(c, s, prompt + reused, n - reused, slots);
            }
            if (rc == 0) {
                tp_commit(c, s, (r >> 40) % 4 ? n : reused + (n - reused) / 2);
            } else {
                assert_int_equal(rc, PKV_ENOSPC);
            }
            const int slot = (int)((r >> 44) % 6);
            if (live[slot]) assert_int_equal(pkv_seq_release(c, live[slot]), 0);
            live[slot] = 0;
            if ((r >> 48) % 2 && rc == 0) live[slot] = s;
            else assert_int_equal(pkv_seq_release(c, s), 0);
            if ((r >> 52) % 97 == 0) {
                assert_int_equal(pkv_cache_reset(c), 0);
                memset(live, 0, sizeof live);
            }
            tp_check(c);
            if (pm_ev_drain(&rw, &m) < 0 || pm_ev_compare(&rw, &m) < 0) fail_msg("B %u step %d: %s", B, step, rw.err);
        }
        assert_true(m.n_cleared >= 1 && m.n_removed > 20);
        pkv_cache_destroy(c);
    }
    print_message("router: %llu predictions, %llu blocks predicted held, %llu copied tail blocks\n",
                  (unsigned long long)checks, (unsigned long long)predicted_blocks, (unsigned long long)n_extra);
    assert_true(predicted_blocks > 200);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_events_stored_removed_cleared),
        cmocka_unit_test(test_events_partial_take),
        cmocka_unit_test(test_events_overflow),
        cmocka_unit_test(test_events_bad_input),
        cmocka_unit_test(test_events_random_world),
        cmocka_unit_test(test_events_router_prediction),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
