/* spin.c: decode attention when the engine's own work comes between the calls, and what
 * pkv_config.spin_us (how long the cache's threads poll for the next call) does to it.
 *
 *   ./build/spin_bench [ROUNDS [SPIN_US]]   (defaults 9 and 2000)
 *
 * Three caches with the same K/V (f16, 8 kv heads, head_dim 128, 32 query heads, 16-token
 * blocks, one sequence's table interleaved with another's, enough layers that the calls read
 * 512 MiB from memory): "poll50" has 2 threads polling 50 us after a call (the default),
 * "pollS" 2 threads polling SPIN_US, "one" the calling thread alone. Before each call the
 * calling thread works alone for GAP us (a busy loop: the engine's single-threaded work between
 * two layers' attention, while the other core idles). Each round times a block of calls on
 * each cache in turn (the order rotates; after each block the program sleeps until that
 * cache's threads have stopped polling) and keeps the median of each block past its first 2
 * calls; the report is the median over rounds of each, and of the ratios pollS / poll50 and
 * one / poll50 with their quartiles. Only the calls are timed: what polling costs an engine
 * whose own threads want the cores between the calls is not measured here (bench/executor.c's
 * "step" workload is that case). The three pools hold about 3 GiB at once. */
#include "tool.h" /* tools/tool_util.c: clock, median */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { KVH = 8, QH = 32, HD = 128, BLOCK = 24, MAX_ROUNDS = 99, N_CACHES = 3 };

/* a cache of nl layers holding one sequence of len tokens, its blocks interleaved with a
 * second sequence's (released after), the same random K/V in every cache */
static pkv_cache *make(uint32_t n_threads, uint32_t spin_us, uint32_t len, uint32_t nl, pkv_seq *s) {
    pkv_config cfg = pkv_config_default();
    cfg.n_kv_heads = KVH, cfg.head_dim = HD, cfg.n_layers = nl, cfg.n_blocks = 2 * len / 16 + 2;
    cfg.max_blocks_per_seq = len / 16 + 1, cfg.enable_prefix_cache = 0;
    cfg.n_threads = n_threads, cfg.spin_us = spin_us;
    pkv_cache *c = NULL;
    if (tool_check(pkv_cache_create(&cfg, &c), "pkv_cache_create")) exit(1);
    static float kv[16 * KVH * HD];
    static const int32_t other[16]; /* the second sequence's token ids: never read */
    uint64_t rng = 1;
    pkv_seq s2;
    if (tool_check(pkv_seq_create(c, NULL, 0, s), "pkv_seq_create") ||
        tool_check(pkv_seq_create(c, NULL, 0, &s2), "pkv_seq_create"))
        exit(1);
    for (uint32_t t = 0; t < len; t += 16) {
        if (tool_fill_seq(c, *s, 16, (int32_t)t, kv, &rng)) exit(1);
        if ((t / 16) % 2 && tool_check(pkv_seq_append(c, s2, other, 16, NULL), "pkv_seq_append")) exit(1);
    }
    if (tool_check(pkv_seq_release(c, s2), "pkv_seq_release")) exit(1);
    return c;
}

/* The engine's work between calls: the calling thread busy for gap_ns. */
static void engine_work(uint64_t gap_ns) {
    const uint64_t t0 = tool_now_ns();
    while (tool_now_ns() - t0 < gap_ns) {
    }
}

/* Median microseconds of a block of decode calls (past the first 2), each after the gap. */
static double block_us(pkv_cache *c, pkv_seq s, uint32_t nl, uint32_t *layer, const float *q, float *o,
                       uint64_t gap_ns) {
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = QH;
    double t[BLOCK];
    for (uint32_t i = 0; i < BLOCK + 2; i++) {
        engine_work(gap_ns);
        const uint64_t t0 = tool_now_ns();
        if (tool_check(pkv_attn_decode(c, *layer, &s, 1, q, o, &p), "pkv_attn_decode")) exit(1);
        if (i >= 2) t[i - 2] = (double)(tool_now_ns() - t0) / 1e3;
        *layer = (*layer + 1) % nl;
    }
    return tool_median(t, BLOCK);
}

int main(int argc, char **argv) {
    uint32_t rounds = 9, spin = 2000;
    if ((argc > 1 && tool_parse_u32(argv[1], &rounds)) || rounds < 3 || rounds > MAX_ROUNDS ||
        (argc > 2 && (tool_parse_u32(argv[2], &spin) || spin > 1000000))) {
        fprintf(stderr, "usage: spin_bench [ROUNDS 3..%d [SPIN_US 0..1000000]]\n", MAX_ROUNDS);
        return 2;
    }
    printf("spin_bench: 2 threads polling 50 us (poll50) and %u us (pollS), 1 thread (one); %u rounds of %d calls "
           "a cache; %s\n",
           spin, rounds, BLOCK, tool_build_info());
    printf("%5s %6s %6s %10s %10s %10s %12s %12s %12s %12s\n", "ctx", "layers", "gap_us", "poll50_us", "pollS_us",
           "one_us", "pollS/poll50", "q1-q3", "one/poll50", "q1-q3");
    static const uint32_t ctxs[] = {512, 4096};
    static const uint32_t gaps_us[] = {0, 100, 300, 1000};
    for (size_t ci = 0; ci < sizeof ctxs / sizeof ctxs[0]; ci++) {
        const uint32_t len = ctxs[ci], nl = (uint32_t)((512ull << 20) / ((uint64_t)len * KVH * HD * 2 * 2));
        pkv_seq s[N_CACHES];
        pkv_cache *c[N_CACHES] = {make(2, 50, len, nl, &s[0]), make(2, spin, len, nl, &s[1]),
                                  make(1, 50, len, nl, &s[2])};
        float *q = calloc((size_t)QH * HD, sizeof(float)), *o = calloc((size_t)QH * HD, sizeof(float));
        if (!q || !o) {
            fprintf(stderr, "spin_bench: out of memory\n");
            return 1; /* the process ends: the caches go with it */
        }
        for (size_t i = 0; i < (size_t)QH * HD; i++) q[i] = (float)(i % 3) / 3;
        for (int w = 0; w < N_CACHES; w++) { /* a warm-up round, not timed (the first after the
                                                caches were made ran up to 2x slower) */
            uint32_t l = 0;
            for (uint32_t b = 0; b < (nl + BLOCK - 1) / BLOCK; b++) (void)block_us(c[w], s[w], nl, &l, q, o, 0);
        }
        for (size_t gi = 0; gi < sizeof gaps_us / sizeof gaps_us[0]; gi++) {
            double u[N_CACHES][MAX_ROUNDS], rs[MAX_ROUNDS], r1[MAX_ROUNDS];
            uint32_t layer[N_CACHES] = {0, 0, 0};
            for (uint32_t k = 0; k < rounds; k++) {
                for (int j = 0; j < N_CACHES; j++) {
                    const int w = (j + k) % N_CACHES;
                    u[w][k] = block_us(c[w], s[w], nl, &layer[w], q, o, (uint64_t)gaps_us[gi] * 1000u);
                    /* until the block's threads have stopped polling: none holds a core the next
                       block's need */
                    const uint64_t rest_ns = (uint64_t)spin * 1000u + 2000000u;
                    const struct timespec ts = {(time_t)(rest_ns / 1000000000u), (long)(rest_ns % 1000000000u)};
                    nanosleep(&ts, NULL);
                }
                rs[k] = u[1][k] / u[0][k], r1[k] = u[2][k] / u[0][k];
            }
            const double sq1 = tool_percentile(rs, (size_t)rounds, 25), sq3 = tool_percentile(rs, (size_t)rounds, 75);
            const double oq1 = tool_percentile(r1, (size_t)rounds, 25), oq3 = tool_percentile(r1, (size_t)rounds, 75);
            printf("%5u %6u %6u %10.1f %10.1f %10.1f %12.3f %5.3f-%.3f %12.3f %5.3f-%.3f\n", len, nl, gaps_us[gi],
                   tool_median(u[0], (size_t)rounds), tool_median(u[1], (size_t)rounds),
                   tool_median(u[2], (size_t)rounds), tool_median(rs, (size_t)rounds), sq1, sq3,
                   tool_median(r1, (size_t)rounds), oq1, oq3);
            fflush(stdout);
        }
        for (int j = 0; j < N_CACHES; j++) pkv_cache_destroy(c[j]);
        free(q), free(o);
    }
    return 0;
}
