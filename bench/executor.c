/* executor.c: decode attention on an engine's OpenMP threads (pkv_config.executor) against the
 * same decode on the cache's own threads, alone and between the engine's own parallel work.
 *
 *   OMP_NUM_THREADS=2 ./build/executor_bench [ROUNDS]   (CMake builds it where OpenMP is found)
 *
 * Two caches with the same K/V (f16, 8 kv heads, head_dim 128, 32 query heads, 16-token blocks,
 * tables shuffled by appending 16 tokens to each sequence in turn): "own" has n_threads =
 * omp_get_max_threads() threads of its own, "exec" none and an executor over the OpenMP team
 * (one parallel for per job). Each round times a block of calls on one, then a block on the
 * other (the order alternates), and keeps the median of each block past its first 2 calls;
 * the report is the median and quartiles over rounds of exec / own. Two workloads:
 *   attn   decode calls back to back;
 *   step   each decode call follows an OpenMP parallel region of the engine's own (about 0.2 ms
 *          of FMAs a thread), as attention follows the projections in a model step.
 * How OpenMP's threads wait after a region (OMP_WAIT_POLICY, GOMP_SPINCOUNT) decides what the
 * cache's own threads meet: with libgomp's default, OpenMP threads spin for a while after each
 * region, on the cores the cache's threads need. */
#include "tool.h" /* tools/tool_util.c: clock, median */

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { KVH = 8, QH = 32, HD = 128, BLOCK = 20, MAX_ROUNDS = 99 };

static void omp_parallel_for(void *ctx, pkv_task_fn fn, void *job, uint32_t n) {
    (void)ctx;
#pragma omp parallel for schedule(static, 1)
    for (int i = 0; i < (int)n; i++) fn(job, (uint32_t)i, (uint32_t)omp_get_thread_num());
}

/* The engine's own work between attention calls: a parallel region of dependent FMAs. */
static volatile float g_sink;
static void engine_work(void) {
#pragma omp parallel
    {
        float a = 1.0f + (float)omp_get_thread_num(), b = 0.999f;
        for (int i = 0; i < 200000; i++) a = a * b + 0.001f;
        if (a == 42.0f) g_sink = a;
    }
}

static pkv_cache *make(int exec, uint32_t n_threads, uint32_t nseq, uint32_t len, uint32_t nl, pkv_seq *s) {
    pkv_config cfg = pkv_config_default();
    cfg.n_kv_heads = KVH, cfg.head_dim = HD, cfg.n_layers = nl, cfg.n_blocks = nseq * len / 16;
    cfg.enable_prefix_cache = 0, cfg.n_threads = n_threads;
    if (exec) cfg.executor = (pkv_executor){.parallel_for = omp_parallel_for, .n_workers = n_threads};
    pkv_cache *c = NULL;
    if (tool_check(pkv_cache_create(&cfg, &c), "pkv_cache_create")) exit(1);
    static int32_t tok[16], slots[16];
    static float k[16][KVH][HD], v[16][KVH][HD];
    for (int i = 0; i < 16 * KVH * HD; i++)
        (&k[0][0][0])[i] = (float)(i % 7) / 7, (&v[0][0][0])[i] = (float)(i % 5) / 5;
    for (uint32_t i = 0; i < nseq; i++)
        if (tool_check(pkv_seq_create(c, NULL, 0, &s[i]), "pkv_seq_create")) exit(1);
    for (uint32_t t = 0; t < len; t += 16)
        for (uint32_t i = 0; i < nseq; i++) {
            for (int j = 0; j < 16; j++) tok[j] = (int32_t)(i * 100000 + t + (uint32_t)j);
            if (tool_check(pkv_seq_append(c, s[i], tok, 16, slots), "pkv_seq_append")) exit(1);
            for (uint32_t l = 0; l < nl; l++)
                if (tool_check(pkv_write_kv(c, l, slots, 16, k, v, PKV_DTYPE_F32), "pkv_write_kv")) exit(1);
        }
    return c;
}

/* Median microseconds of a block of decode calls (past the first 2), with the engine's work
 * before each call when step is set. */
static double block_us(pkv_cache *c, const pkv_seq *s, uint32_t nseq, uint32_t nl, const float *q, float *o,
                       int step) {
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = QH;
    double t[BLOCK];
    for (uint32_t i = 0; i < BLOCK + 2; i++) {
        if (step) engine_work();
        const uint64_t t0 = tool_now_ns();
        if (tool_check(pkv_attn_decode(c, i % nl, s, nseq, q, o, &p), "pkv_attn_decode")) exit(1);
        if (i >= 2) t[i - 2] = (double)(tool_now_ns() - t0) / 1e3;
    }
    return tool_median(t, BLOCK);
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 15;
    if (rounds < 3 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: executor_bench [ROUNDS 3..%d]\n", MAX_ROUNDS);
        return 2;
    }
    const uint32_t nt = (uint32_t)omp_get_max_threads() > 256 ? 256 : (uint32_t)omp_get_max_threads();
    const char *wp = getenv("OMP_WAIT_POLICY");
    printf("executor_bench: %u threads, OMP_WAIT_POLICY=%s, %d rounds of %d calls a side; %s\n", nt,
           wp ? wp : "(unset)", rounds, BLOCK, tool_build_info());
    printf("%-6s %5s %5s %6s %10s %10s %9s %12s\n", "work", "batch", "ctx", "layers", "own_us", "exec_us",
           "exec/own", "q1-q3");
    static const uint32_t cfgs[][3] = {{16, 512, 4}, {1, 4096, 8}, {16, 4096, 2}}; /* batch, ctx, layers */
    for (int step = 0; step < 2; step++)
        for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
            const uint32_t nseq = cfgs[ci][0], len = cfgs[ci][1], nl = cfgs[ci][2];
            pkv_seq s0[16], s1[16];
            pkv_cache *own = make(0, nt, nseq, len, nl, s0), *ex = make(1, nt, nseq, len, nl, s1);
            const size_t n_q = (size_t)nseq * QH * HD;
            float *q = calloc(n_q, sizeof(float)), *o = calloc(n_q, sizeof(float));
            if (!q || !o) return 1;
            for (size_t i = 0; i < n_q; i++) q[i] = (float)(i % 3) / 3;
            double ua[MAX_ROUNDS], ub[MAX_ROUNDS], r[MAX_ROUNDS];
            for (int k = 0; k < rounds; k++) {
                if (k & 1) {
                    ub[k] = block_us(ex, s1, nseq, nl, q, o, step);
                    ua[k] = block_us(own, s0, nseq, nl, q, o, step);
                } else {
                    ua[k] = block_us(own, s0, nseq, nl, q, o, step);
                    ub[k] = block_us(ex, s1, nseq, nl, q, o, step);
                }
                r[k] = ub[k] / ua[k];
            }
            const double q1 = tool_percentile(r, (size_t)rounds, 25), q3 = tool_percentile(r, (size_t)rounds, 75);
            printf("%-6s %5u %5u %6u %10.1f %10.1f %9.3f %6.3f-%.3f\n", step ? "step" : "attn", nseq, len, nl,
                   tool_median(ua, (size_t)rounds), tool_median(ub, (size_t)rounds), tool_median(r, (size_t)rounds), q1,
                   q3);
            free(q), free(o);
            pkv_cache_destroy(own);
            pkv_cache_destroy(ex);
        }
    return 0;
}
