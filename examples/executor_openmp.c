/* executor_openmp.c: attention run on an engine's own OpenMP threads (pkv_config.executor)
 * instead of threads the cache starts, checked against a cache with threads of its own: the
 * results are the same bit for bit. Built without OpenMP, the executor is a loop on the calling
 * thread (a valid executor too). */
#include <pkv.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The whole contract: fn(job, i, worker) for every i, concurrent calls on distinct workers. */
static void omp_parallel_for(void *ctx, pkv_task_fn fn, void *job, uint32_t n) {
    (void)ctx;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1)
    for (int i = 0; i < (int)n; i++) fn(job, (uint32_t)i, (uint32_t)omp_get_thread_num());
#else
    for (uint32_t i = 0; i < n; i++) fn(job, i, 0);
#endif
}

enum { SEQS = 4, LEN = 1024, KVH = 8, QH = 32, HD = 128 };

/* A cache of SEQS sequences of LEN tokens with the same K/V whatever its threads; decodes them. */
static int decode_on(const pkv_config *cfg, float *q, float *out) {
    pkv_cache *c = NULL;
    pkv_seq s[SEQS];
    static int32_t tok[LEN], slots[LEN];
    static float k[LEN][KVH][HD], v[LEN][KVH][HD];
    int rc = pkv_cache_create(cfg, &c);
    for (int i = 0; i < SEQS && !rc; i++) {
        for (int t = 0; t < LEN; t++) {
            tok[t] = 1000 * i + t;
            for (int h = 0; h < KVH; h++)
                for (int d = 0; d < HD; d++)
                    k[t][h][d] = (float)((t * 7 + h * 3 + d + i) % 17) / 17.0f - 0.5f,
                    v[t][h][d] = (float)((t * 5 + h + d * 3 + i) % 13) / 13.0f;
        }
        rc = pkv_seq_create(c, NULL, 0, &s[i]);
        if (!rc) rc = pkv_seq_append(c, s[i], tok, LEN, slots);
        if (!rc) rc = pkv_write_kv(c, 0, slots, LEN, k, v, PKV_DTYPE_F32);
    }
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = QH;
    if (!rc) rc = pkv_attn_decode(c, 0, s, SEQS, q, out, &p);
    pkv_cache_destroy(c);
    return rc;
}

int main(void) {
    uint32_t workers = 1;
#ifdef _OPENMP
    workers = (uint32_t)omp_get_max_threads();
    if (workers > 256) workers = 256;
#endif
    pkv_config cfg = pkv_config_default(); /* f16 pool, 16-token blocks */
    cfg.n_kv_heads = KVH, cfg.head_dim = HD, cfg.n_blocks = SEQS * LEN / 16, cfg.enable_prefix_cache = 0;
    static float q[SEQS][QH][HD], out_omp[SEQS][QH][HD], out_own[SEQS][QH][HD];
    for (size_t i = 0; i < sizeof q / sizeof(float); i++) (&q[0][0][0])[i] = (float)(i % 11) / 11.0f - 0.5f;

    cfg.executor = (pkv_executor){.parallel_for = omp_parallel_for, .n_workers = workers};
    int rc = decode_on(&cfg, &q[0][0][0], &out_omp[0][0][0]);
    cfg.executor = (pkv_executor){0}, cfg.n_threads = workers; /* the cache's own threads */
    if (!rc) rc = decode_on(&cfg, &q[0][0][0], &out_own[0][0][0]);
    if (rc) {
        fprintf(stderr, "pkv: %s\n", pkv_strerror(rc));
        return 1;
    }
    const int same = !memcmp(out_omp, out_own, sizeof out_omp);
    printf("decode of %d x %d tokens on %u executor workers: %s the cache's own threads\n", SEQS, LEN, workers,
           same ? "same bits as" : "DIFFERS from");
    return same ? 0 : 1;
}
