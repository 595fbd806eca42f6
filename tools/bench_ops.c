/* bench_ops.c: `pkv bench ops`: median ns of the cache's metadata operations (append 1 and 16
 * tokens, fork of a 1,000-block sequence, truncate, release, write K/V of one token) on a
 * 1,000-block and a 1,000,000-block pool, the ratio between them, and the metadata overhead
 * (meta_bytes / kv_bytes) of realistic shapes. Public API only. */
#include "tool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { OP_APPEND_1, OP_APPEND_16, OP_FORK_1000, OP_TRUNCATE, OP_RELEASE, OP_WRITE_KV_1, N_OPS };
static const char *op_name[N_OPS] = {"append_1", "append_16", "fork_1000_blocks", "truncate", "release", "write_kv_1"};
static const char *op_desc[N_OPS] = {
    "append 1 token",       "append 16 tokens",       "fork a 1,000-block sequence",
    "truncate by 16 tokens (frees 1 block)", "release a 1-block sequence", "write K/V of 1 token, 1 layer"};

enum { BATCH = 64, B = 16 };

typedef struct {
    double median, p10, p90;
    int n;
} result;

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench ops [--json] [--quick] [--samples N]\n"
            "\n"
            "Median ns per cache operation on pools of 1,000 and 1,000,000 blocks (B = 16,\n"
            "1 layer, 1 kv head, head_dim 8, f16: the pool memory is mapped lazily), with p10/p90\n"
            "and the ratio of the 1M pool to the 1K pool; then meta_bytes / kv_bytes for\n"
            "n_kv_heads 8, head_dim 128, f16, B 16 at 1 and 32 layers.\n"
            "Operations: append_1, append_16 (batches of %d), fork_1000_blocks (one per sample),\n"
            "truncate (by 16 tokens), release (1-block sequences), write_kv_1.\n"
            "\n"
            "  --json        one JSON object per line (op, pool_blocks, median_ns, p10_ns, p90_ns, ...)\n"
            "  --quick       fewer samples (a smoke run, for CI)\n"
            "  --samples N   samples per operation and pool (default 301, quick 31)\n"
            "  -h, --help    this text\n"
            "Goals: append_1 <= 50 ns; 1M pool within 1.5x of the 1K pool; metadata <= 1%% of KV.\n",
            BATCH);
}

static int make_cache(uint32_t n_blocks, pkv_cache **c) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1;
    cfg.n_kv_heads = 1;
    cfg.head_dim = 8;
    cfg.block_tokens = B;
    cfg.n_blocks = n_blocks;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F16;
    cfg.enable_prefix_cache = 0; /* pure block-table cost; bench prefix measures the index */
    cfg.n_threads = 1;
    cfg.max_seqs = 1024;
    cfg.max_blocks_per_seq = 1024;
    tool_log_errors(&cfg, "pkv bench ops");
    return tool_check(pkv_cache_create(&cfg, c), "pkv_cache_create");
}

/* Allocates every block once (sequences of up to 1,000 blocks) and releases them: a serving
 * cache is warm, and without this the 1M pool's first touches (page faults on the lazily mapped
 * metadata) would be timed instead of the operations. */
static int32_t g_toks[1000 * B];

static int warm_pool(pkv_cache *c, uint32_t n_blocks) {
    const int32_t *toks = g_toks;
    pkv_seq s[1024];
    uint32_t n = 0, left = n_blocks;
    while (left && n < 1024) {
        uint32_t nb = left < 1000 ? left : 1000;
        if (tool_check(pkv_seq_create(c, NULL, 0, &s[n]), "warm-up create") < 0) return -1;
        if (tool_check(pkv_seq_append(c, s[n], toks, nb * B, NULL), "warm-up append") < 0) return -1;
        n++;
        left -= nb;
    }
    for (uint32_t i = 0; i < n; i++)
        if (tool_check(pkv_seq_release(c, s[i]), "warm-up release") < 0) return -1;
    return 0;
}

static result summarize(double *v, int n) {
    result r;
    r.n = n;
    r.p10 = tool_percentile(v, (size_t)n, 10);
    r.p90 = tool_percentile(v, (size_t)n, 90);
    r.median = tool_median(v, (size_t)n);
    return r;
}

#define CHECK(expr)                                                                                                  \
    do {                                                                                                             \
        if (tool_check((expr), #expr) < 0) goto fail;                                                                \
    } while (0)

/* One pool's state for one operation; samples are taken alternately from both pools so drift
 * of the shared host hits them alike. */
typedef struct {
    pkv_cache *c;
    int op;
    pkv_seq s, big, seqs[BATCH];
    int32_t slot;
} bench_state;

static int state_init(bench_state *st, pkv_cache *c, int op) {
    memset(st, 0, sizeof *st);
    st->c = c;
    st->op = op;
    if (op == OP_FORK_1000) {
        CHECK(pkv_seq_create(c, NULL, 0, &st->big));
        CHECK(pkv_seq_append(c, st->big, g_toks, 1000 * B, NULL));
    }
    if (op == OP_WRITE_KV_1) {
        CHECK(pkv_seq_create(c, NULL, 0, &st->s));
        CHECK(pkv_seq_append(c, st->s, g_toks, 1, &st->slot));
    }
    return 0;
fail:
    return -1;
}

static void state_fini(bench_state *st) {
    if (st->s) tool_check(pkv_seq_release(st->c, st->s), "pkv_seq_release");
    if (st->big) tool_check(pkv_seq_release(st->c, st->big), "pkv_seq_release");
}

/* One sample: ns per operation (a batch of BATCH, or one fork), -1 on an error. */
static double sample(bench_state *st) {
    static const uint16_t kv[8] = {0x3c00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600, 0x4700, 0x4800};
    const uint32_t cap_tokens = 512 * B; /* a sequence restarts before it holds half the 1K pool */
    pkv_cache *c = st->c;
    uint64_t t0 = 0, t1 = 0;
    int per = BATCH;
    switch (st->op) {
    case OP_APPEND_1:
    case OP_APPEND_16: {
        uint32_t step = st->op == OP_APPEND_1 ? 1 : B;
        pkv_seq_info in = {0};
        if (st->s) CHECK(pkv_seq_get_info(c, st->s, &in));
        if (!st->s || in.n_tokens + BATCH * step > cap_tokens) {
            if (st->s) CHECK(pkv_seq_release(c, st->s));
            CHECK(pkv_seq_create(c, NULL, 0, &st->s));
        }
        t0 = tool_now_ns();
        for (int i = 0; i < BATCH; i++) CHECK(pkv_seq_append(c, st->s, g_toks + i, step, NULL));
        t1 = tool_now_ns();
        break;
    }
    case OP_FORK_1000: {
        pkv_seq child;
        per = 1;
        t0 = tool_now_ns();
        CHECK(pkv_seq_fork(c, st->big, &child));
        t1 = tool_now_ns();
        CHECK(pkv_seq_release(c, child));
        break;
    }
    case OP_TRUNCATE: {
        pkv_seq s;
        CHECK(pkv_seq_create(c, NULL, 0, &s));
        CHECK(pkv_seq_append(c, s, g_toks, BATCH * B, NULL));
        t0 = tool_now_ns();
        for (int i = BATCH - 1; i >= 0; i--) CHECK(pkv_seq_truncate(c, s, (uint32_t)i * B));
        t1 = tool_now_ns();
        CHECK(pkv_seq_release(c, s));
        break;
    }
    case OP_RELEASE: {
        for (int i = 0; i < BATCH; i++) {
            CHECK(pkv_seq_create(c, NULL, 0, &st->seqs[i]));
            CHECK(pkv_seq_append(c, st->seqs[i], g_toks, B, NULL));
        }
        t0 = tool_now_ns();
        for (int i = 0; i < BATCH; i++) CHECK(pkv_seq_release(c, st->seqs[i]));
        t1 = tool_now_ns();
        break;
    }
    case OP_WRITE_KV_1: {
        t0 = tool_now_ns();
        for (int i = 0; i < BATCH; i++) CHECK(pkv_write_kv(c, 0, &st->slot, 1, kv, kv, PKV_DTYPE_F16));
        t1 = tool_now_ns();
        break;
    }
    }
    return (double)(t1 - t0) / per;
fail:
    return -1;
}

static int meta_fraction(uint32_t n_layers, uint32_t n_blocks, int json) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = n_layers;
    cfg.n_kv_heads = 8;
    cfg.head_dim = 128;
    cfg.block_tokens = 16;
    cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_F16;
    cfg.n_blocks = n_blocks;
    cfg.n_threads = 1;
    /* K and V of 16 tokens x 8 kv heads x 128 f16, a block and layer */
    const uint64_t kv_bytes = (uint64_t)n_layers * n_blocks * 2 * 16 * 8 * 128 * 2;
    if (kv_bytes > SIZE_MAX / 2) { /* a 32-bit platform: no pool that size (create would refuse) */
        if (json)
            printf("{\"bench\":\"ops\",\"metric\":\"meta_fraction\",\"n_layers\":%u,\"n_blocks\":%u,"
                   "\"skipped\":\"a pool of %llu bytes is past this platform's size_t\"}\n",
                   n_layers, n_blocks, (unsigned long long)kv_bytes);
        else
            printf("  %2u layer(s), %6u blocks: skipped, a pool of %llu bytes is past this platform's size_t\n",
                   n_layers, n_blocks, (unsigned long long)kv_bytes);
        return 0;
    }
    pkv_cache *c = NULL;
    if (tool_check(pkv_cache_create(&cfg, &c), "pkv_cache_create (metadata shape)") < 0) return -1;
    pkv_stats st;
    if (tool_check(pkv_cache_get_stats(c, &st), "pkv_cache_get_stats") < 0) {
        pkv_cache_destroy(c);
        return -1;
    }
    pkv_config eff;
    if (tool_check(pkv_cache_config(c, &eff), "pkv_cache_config") < 0) {
        pkv_cache_destroy(c);
        return -1;
    }
    double frac = (double)st.meta_bytes / (double)st.kv_bytes;
    if (json)
        printf("{\"bench\":\"ops\",\"metric\":\"meta_fraction\",\"n_layers\":%u,\"n_blocks\":%u,\"n_kv_heads\":8,"
               "\"head_dim\":128,\"dtype\":\"f16\",\"block_tokens\":16,\"max_seqs\":%u,\"max_blocks_per_seq\":%u,"
               "\"meta_bytes\":%llu,\"kv_bytes\":%llu,\"fraction\":%.6f,\"goal_met\":%s}\n",
               n_layers, n_blocks, eff.max_seqs, eff.max_blocks_per_seq, (unsigned long long)st.meta_bytes,
               (unsigned long long)st.kv_bytes, frac, frac <= 0.01 ? "true" : "false");
    else
        printf("  %2u layer(s), %6u blocks (max_seqs %u x max_blocks_per_seq %u): meta %10llu B, KV %13llu B: "
               "%.4f%%  %s\n",
               n_layers, n_blocks, eff.max_seqs, eff.max_blocks_per_seq, (unsigned long long)st.meta_bytes,
               (unsigned long long)st.kv_bytes, 100.0 * frac, frac <= 0.01 ? "(goal <= 1% met)" : "(goal 1% MISSED)");
    pkv_cache_destroy(c);
    return 0;
}

int tool_bench_ops(int argc, char **argv) {
    int json = 0, quick = 0, n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--samples")) {
            const char *val = i + 1 < argc ? argv[++i] : "";
            uint32_t v;
            if (tool_parse_u32(val, &v) || v < 3 || v > 100000) {
                fprintf(stderr, "pkv bench ops: --samples wants 3..100000, got '%s'\n", val);
                return TOOL_USAGE;
            }
            n = (int)v;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return TOOL_OK;
        } else {
            fprintf(stderr, "pkv bench ops: unknown option '%s'\n\n", argv[i]);
            usage(stderr);
            return TOOL_USAGE;
        }
    }
    if (!n) n = quick ? 31 : 301;
    const uint32_t pools[2] = {1000, 1000000};
    result res[2][N_OPS];
    double *samples[2] = {malloc(sizeof(double) * (size_t)n), malloc(sizeof(double) * (size_t)n)};
    if (!samples[0] || !samples[1]) {
        free(samples[0]);
        free(samples[1]);
        return TOOL_FAIL;
    }
    if (json)
        printf("{\"bench\":\"ops\",\"build\":\"%s\",\"cpu\":\"%s\",\"samples\":%d,\"batch\":%d,\"block_tokens\":%d,\"warm\":true}\n",
               tool_build_info(), tool_cpu_name(), n, BATCH, B);
    else
        printf("pkv bench ops: %s on %s\n%d samples per op and pool (batches of %d, fork 1 per sample); B = %d, "
               "1 layer, 1 kv head, head_dim 8, f16, prefix cache off;\nevery block of a pool is allocated and released once before timing (a warm cache)\n\n",
               tool_build_info(), tool_cpu_name(), n, BATCH, B);
    /* both pools live at once; per operation the samples alternate between them */
    pkv_cache *caches[2] = {NULL, NULL};
    for (int p = 0; p < 2; p++)
        if (make_cache(pools[p], &caches[p]) < 0 || warm_pool(caches[p], pools[p]) < 0) goto fail;
    for (int op = 0; op < N_OPS; op++) {
        bench_state st[2];
        for (int p = 0; p < 2; p++)
            if (state_init(&st[p], caches[p], op) < 0) goto fail;
        for (int k = -3; k < n; k++) /* three warm-up samples each */
            for (int p = 0; p < 2; p++) {
                double v = sample(&st[p]);
                if (v < 0) goto fail;
                if (k >= 0) samples[p][k] = v;
            }
        for (int p = 0; p < 2; p++) {
            state_fini(&st[p]);
            res[p][op] = summarize(samples[p], n);
        }
    }
    for (int p = 0; p < 2; p++) pkv_cache_destroy(caches[p]);
    free(samples[0]);
    free(samples[1]);
    if (!json) printf("%-18s %-12s %10s %10s %10s %9s\n", "op", "pool_blocks", "median_ns", "p10_ns", "p90_ns", "1M/1K");
    for (int op = 0; op < N_OPS; op++)
        for (int p = 0; p < 2; p++) {
            const result *r = &res[p][op];
            double ratio = r->median / res[0][op].median;
            if (json)
                printf("{\"bench\":\"ops\",\"op\":\"%s\",\"pool_blocks\":%u,\"median_ns\":%.2f,\"p10_ns\":%.2f,"
                       "\"p90_ns\":%.2f,\"samples\":%d,\"ratio_vs_1k\":%.3f}\n",
                       op_name[op], pools[p], r->median, r->p10, r->p90, r->n, ratio);
            else if (p == 0)
                printf("%-18s %-12u %10.1f %10.1f %10.1f %9s\n", op_name[op], pools[p], r->median, r->p10, r->p90, "");
            else
                printf("%-18s %-12u %10.1f %10.1f %10.1f %8.2fx\n", op_name[op], pools[p], r->median, r->p10, r->p90,
                       ratio);
        }
    if (!json) {
        printf("\n");
        for (int op = 0; op < N_OPS; op++) printf("  %-18s %s\n", op_name[op], op_desc[op]);
        double worst = 0;
        int worst_op = 0;
        for (int op = 0; op < N_OPS; op++)
            if (res[1][op].median / res[0][op].median > worst) {
                worst = res[1][op].median / res[0][op].median;
                worst_op = op;
            }
        printf("\ngoals: append_1 median %.1f ns (goal <= 50: %s); largest 1M/1K ratio %.2fx (%s; goal <= 1.5x: %s)\n",
               res[0][OP_APPEND_1].median, res[0][OP_APPEND_1].median <= 50 ? "met" : "MISSED", worst,
               op_name[worst_op], worst <= 1.5 ? "met" : "MISSED");
        printf("metadata / KV bytes (n_kv_heads 8, head_dim 128, f16, B 16, default max_seqs):\n");
    }
    const uint32_t layers[2] = {1, 32}, blocks[2] = {1000, 4096};
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < 2; b++)
            if (meta_fraction(layers[l], blocks[b], json) < 0) return TOOL_FAIL;
    return TOOL_OK;
fail:
    for (int p = 0; p < 2; p++) pkv_cache_destroy(caches[p]);
    free(samples[0]);
    free(samples[1]);
    return TOOL_FAIL;
}
