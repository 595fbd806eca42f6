/* test_mla.c: caches whose V lives in K (pkv_config.v_dim: multi-head latent attention, MLA).
 * Decode, prefill and tree attention on every backend this CPU has and every dtype, against a
 * double reference over the pool's own rows (pkv_seq_gather of K; V = K's first v_dim values) and
 * against a twin cache of the classic layout whose V rows are copies of the K rows (its outputs'
 * first v_dim columns); forks after copy-on-write, shared prefixes read once (share.c), the
 * refusals of V writes and reads, the layout, stored rows, and a tier round trip that a cache of
 * the classic layout never sees. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_shard.h"
#include "tu_assert.h"
#include "tu_ref.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pkv.h"
#include "support_util.h"

enum { B = 16, MAXTOK = 300, NSEQ = 3 };
#define TOL 1e-5

static tu_rng g_rng = {7};
static float rnd(void) { return tu_rng_float(&g_rng); } /* uniform in [-1, 1) */

static const char *const g_backends[] = {"ref", "avx2", "avx2-vnni", "avx512", "avx512-vnni", "avx512-amx",
                                         "neon", "neon-dotprod"};
static const pkv_dtype g_types[] = {PKV_DTYPE_F32,  PKV_DTYPE_F16,  PKV_DTYPE_BF16,
                                    PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0, PKV_DTYPE_FP8_E4M3};
/* q8_0 and q4_0 K score int8 queries (test_attn_api.c: tol_of); the rest keep f32 queries */
static double tol_of(pkv_dtype dt) { return dt == PKV_DTYPE_Q8_0 || dt == PKV_DTYPE_Q4_0 ? 2e-2 : TOL; }

typedef struct shape {
    uint32_t D, Dv, nqh, nkv, threads;
} shape;

static pkv_config mla_config(pkv_dtype dt, shape sh, uint32_t v_dim) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 2, cfg.n_kv_heads = sh.nkv, cfg.head_dim = sh.D, cfg.block_tokens = B, cfg.n_blocks = 160;
    cfg.k_dtype = cfg.v_dtype = dt;
    cfg.n_threads = sh.threads;
    cfg.max_seqs = 16;
    cfg.v_dim = v_dim;
    return cfg;
}

/* The attention parameters a world runs with besides scale and n_q_heads. */
typedef struct extra {
    float softcap;
    uint32_t window;
    uint32_t chunk; /* chunked local attention (pkv_attn_params.attn_chunk) */
    bool sinks;    /* sinks[h] = 0.5 - h / nqh */
    uint32_t flags; /* PKV_ATTN_BF16_DOT, PKV_ATTN_F16_AS_BF16 */
} extra;

/* The MLA cache and its twin of the classic layout (V rows: copies of the K rows), the same
 * sequences in both (same handles' roles, same token ids). */
typedef struct world {
    shape sh;
    pkv_dtype dt;
    extra ex;
    pkv_cache *c[2]; /* [0] MLA, [1] classic */
    pkv_seq s[2][NSEQ];
    uint32_t len[NSEQ];
} world;

/* Appends n positions to sequence i of both caches and writes random K in every layer (V too, the
 * same rows, in the classic one). */
static void grow(world *w, uint32_t i, uint32_t n, int32_t tok0) {
    const size_t row = (size_t)w->sh.nkv * w->sh.D;
    int32_t tok[MAXTOK];
    float *k = malloc((size_t)n * row * sizeof(float));
    assert_non_null(k);
    for (uint32_t t = 0; t < n; t++) tok[t] = tok0 + (int32_t)(w->len[i] + t);
    for (int x = 0; x < 2; x++) assert_int_equal(pkv_seq_append(w->c[x], w->s[x][i], tok, n, NULL), PKV_OK);
    for (uint32_t l = 0; l < 2; l++) {
        for (size_t j = 0; j < (size_t)n * row; j++) k[j] = rnd() * 1.5f;
        assert_int_equal(pkv_seq_write_kv(w->c[0], w->s[0][i], l, w->len[i], n, k, NULL, PKV_DTYPE_F32), PKV_OK);
        assert_int_equal(pkv_seq_write_kv(w->c[1], w->s[1][i], l, w->len[i], n, k, k, PKV_DTYPE_F32), PKV_OK);
    }
    w->len[i] += n;
    free(k);
}

static void world_check(const world *w) {
    for (int x = 0; x < 2; x++) {
        char msg[256];
        assert_int_equal(pkv_cache_check(w->c[x], msg, sizeof msg), PKV_OK);
    }
}

/* Three sequences grown in turns, so that their tables interleave in the pool: 0 of 150
 * positions, 1 a fork of 0 after 70 that grows its own 60 (copy-on-write of the shared partial
 * block), 2 of 37 on its own. */
static void world_make(world *w, pkv_dtype dt, shape sh, extra ex) {
    memset(w, 0, sizeof *w);
    w->sh = sh, w->dt = dt, w->ex = ex;
    for (int x = 0; x < 2; x++) {
        const pkv_config cfg = mla_config(dt, sh, x ? 0 : sh.Dv);
        assert_int_equal(pkv_cache_create(&cfg, &w->c[x]), PKV_OK);
        assert_int_equal(pkv_seq_create(w->c[x], NULL, 0, &w->s[x][0]), PKV_OK);
        assert_int_equal(pkv_seq_create(w->c[x], NULL, 0, &w->s[x][2]), PKV_OK);
    }
    grow(w, 0, 40, 1);
    grow(w, 2, 20, 5000);
    grow(w, 0, 30, 1);
    for (int x = 0; x < 2; x++) assert_int_equal(pkv_seq_fork(w->c[x], w->s[x][0], &w->s[x][1]), PKV_OK);
    w->len[1] = 70;
    for (int r = 0; r < 4; r++) grow(w, 0, 20, 1), grow(w, 1, 15, 1000);
    grow(w, 2, 17, 5000);
    world_check(w);
}

static void world_free(world *w) {
    for (int x = 0; x < 2; x++) pkv_cache_destroy(w->c[x]);
}

static float sink_of(const world *w, uint32_t h) { return 0.5f - (float)h / (float)w->sh.nqh; }

/* The double reference of query rows q ([nqh][D]) at position pos of sequence i in layer l, over
 * the keys the pool holds (gathered from the MLA cache) that the window and chunk leave: out [nqh][Dv],
 * lse [nqh]. */
static void ref_rows(const world *w, uint32_t i, uint32_t l, const float *q, uint32_t pos, float scale, double *out,
                     double *lse) {
    const uint32_t D = w->sh.D, Dv = w->sh.Dv, nkv = w->sh.nkv, G = w->sh.nqh / nkv, n = pos + 1;
    uint32_t lo = w->ex.window && n > w->ex.window ? n - w->ex.window : 0;
    if (w->ex.chunk && pos / w->ex.chunk * w->ex.chunk > lo) lo = pos / w->ex.chunk * w->ex.chunk;
    float *k = malloc((size_t)n * nkv * D * sizeof(float));
    double *p = malloc((size_t)n * sizeof(double));
    assert_true(k && p);
    assert_int_equal(pkv_seq_gather(w->c[0], w->s[0][i], l, 0, n, k, NULL), PKV_OK);
    for (uint32_t h = 0; h < w->sh.nqh; h++) {
        const float *kh = k + (size_t)(h / G) * D; /* row t of kv head h / G at kh + t * nkv * D */
        double mx = -INFINITY, sum = 0;
        for (uint32_t t = lo; t < n; t++) {
            double x = tu_dot(q + (size_t)h * D, kh + (size_t)t * nkv * D, D) * scale;
            if (w->ex.softcap > 0) x = w->ex.softcap * tanh(x / w->ex.softcap);
            p[t] = x;
            mx = fmax(mx, x);
        }
        if (w->ex.sinks) mx = fmax(mx, sink_of(w, h)), sum = exp(sink_of(w, h) - mx); /* a key of value 0 */
        for (uint32_t t = lo; t < n; t++) sum += (p[t] = exp(p[t] - mx));
        for (uint32_t d = 0; d < Dv; d++) {
            double o = 0;
            for (uint32_t t = lo; t < n; t++) o += p[t] * kh[(size_t)t * nkv * D + d];
            out[(size_t)h * Dv + d] = o / sum;
        }
        lse[h] = mx + log(sum);
    }
    free(k);
    free(p);
}

/* Whether the call's flag rounds this world's inputs to bf16: the bf16 flag with bf16 K/V, or
 * with fp8, q8_0 or q4_0 K/V and the f16 one where the cache's backend takes them
 * (pkv_attn_flags_used: avx512-amx) */
static bool lp_world(const world *w) {
    return ((w->ex.flags & PKV_ATTN_BF16_DOT) && w->dt == PKV_DTYPE_BF16) ||
           ((w->ex.flags & PKV_ATTN_BF16_DOT) && w->dt != PKV_DTYPE_F32 && w->dt != PKV_DTYPE_F16 &&
            (pkv_attn_flags_used(w->c[0]) & PKV_ATTN_BF16_DOT)) ||
           ((w->ex.flags & PKV_ATTN_F16_AS_BF16) && (pkv_attn_flags_used(w->c[0]) & PKV_ATTN_F16_AS_BF16));
}

/* The tolerance against the reference: q8_0 and q4_0 score int8 queries (so do their units of
 * the row path under the bf16 flag); the flags round queries and weights to bf16, the f16 one K
 * and V too (pkv.h) */
static double ref_tol(const world *w) {
    return lp_world(w) ? fmax(1.0 / 64.0, tol_of(w->dt)) : tol_of(w->dt);
}

/* Under emulation (scripts/test-arm64.sh sets PKV_ATTN_TEST_MAX_LEN, as for test_attn) the
 * double reference checks the decode rows and each request's first and last query, the twin every
 * row, the oracle reads the CPU's own way alone, 128 heads run with f16 alone, and the shared
 * prefixes of f16 and q8_0 once each: qemu made the whole test take 270 s. */
static bool quick(void) { return getenv("PKV_ATTN_TEST_MAX_LEN") != NULL; }

/* Row r of out ([nqh][Dv], lse [nqh]) against the reference at position pos of sequence i (where
 * with_ref), and against the classic twin's row (co: [nqh][D], its first Dv columns). */
static void check_row_as(const world *w, uint32_t i, uint32_t l, const float *q, uint32_t pos, float scale,
                         const float *out, const float *lse, const float *co, const float *clse, bool with_ref) {
    const uint32_t Dv = w->sh.Dv, D = w->sh.D, nqh = w->sh.nqh;
    double *ro = malloc((size_t)nqh * Dv * sizeof(double)), rl[128];
    assert_true(ro && nqh <= 128);
    if (!with_ref) { /* the twin alone */
        for (size_t j = 0; j < (size_t)nqh * Dv; j++) ro[j] = co[j / Dv * D + j % Dv];
        for (uint32_t h = 0; h < nqh; h++) rl[h] = clse[h];
    } else
        ref_rows(w, i, l, q, pos, scale, ro, rl);
    double vm = 0; /* the outputs' scale: the largest |V| is at most 1.5 rounded up */
    for (size_t j = 0; j < (size_t)nqh * Dv; j++) vm = fmax(vm, fabs(ro[j]));
    vm = fmax(vm, 1.0);
    const double tol = ref_tol(w);
    for (uint32_t h = 0; h < nqh; h++) {
        for (uint32_t d = 0; d < Dv; d++) {
            const float o = out[(size_t)h * Dv + d];
            if (!(fabs(o - ro[(size_t)h * Dv + d]) <= tol * vm))
                fail_msg("%s seq %u pos %u head %u d %u: %g, reference %g", pkv_dtype_name(w->dt), i, pos, h, d, o,
                         ro[(size_t)h * Dv + d]);
            /* the same kernels over the same values: equal up to the order of float sums (the
               MLA cache's shared-prefix groups hold 128-head members, the classic one's do not:
               with the bf16 flag each part's weights are rounded to bf16 apart) */
            if (!(fabs(o - co[(size_t)h * D + d]) <= (lp_world(w) ? 1.0 / 128.0 : 1e-6) * vm))
                fail_msg("%s %s D %u Dv %u nqh %u nkv %u flags %u cap %g: seq %u pos %u head %u d %u: %g, classic %g",
                         pkv_dtype_name(w->dt), pkv_attn_backend(w->c[0]), D, Dv, nqh, w->sh.nkv, w->ex.flags,
                         w->ex.softcap, i, pos, h, d, o, co[(size_t)h * D + d]);
        }
        assert_true(fabs(lse[h] - rl[h]) <= tol * fmax(1.0, fabs(rl[h])));
        assert_true(fabs(lse[h] - clse[h]) <= 1e-5 * fmax(1.0, fabs(rl[h])));
    }
    free(ro);
}

static void check_row(const world *w, uint32_t i, uint32_t l, const float *q, uint32_t pos, float scale,
                      const float *out, const float *lse, const float *co, const float *clse) {
    check_row_as(w, i, l, q, pos, scale, out, lse, co, clse, true);
}

static float *rand_q(size_t n) {
    float *q = malloc(n * sizeof(float));
    assert_non_null(q);
    for (size_t j = 0; j < n; j++) q[j] = rnd();
    return q;
}

/* Decode of the three sequences, a ragged prefill and a tree, in both caches, checked row by
 * row; scale 0: the default. */
static void run_world(world *w, float scale) {
    const uint32_t D = w->sh.D, Dv = w->sh.Dv, nqh = w->sh.nqh;
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = nqh, p.scale = scale, p.softcap = w->ex.softcap, p.window = w->ex.window, p.flags = w->ex.flags;
    p.attn_chunk = w->ex.chunk;
    float sinks[128];
    for (uint32_t h = 0; h < nqh; h++) sinks[h] = sink_of(w, h);
    if (w->ex.sinks) p.sinks = sinks;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)D); /* the default, as the library takes it */
    enum { NQ = 24 };
    float *q = rand_q((size_t)NQ * nqh * D), *out = malloc((size_t)NQ * nqh * Dv * sizeof(float));
    float *co = malloc((size_t)NQ * nqh * D * sizeof(float)), *lse = malloc(NQ * 128 * sizeof(float));
    float *clse = malloc(NQ * 128 * sizeof(float));
    assert_true(out && co && lse && clse && nqh <= 128);
    for (uint32_t l = 0; l < 2; l++) {
        /* decode */
        p.lse = lse;
        assert_int_equal(pkv_attn_decode(w->c[0], l, w->s[0], NSEQ, q, out, &p), PKV_OK);
        p.lse = clse;
        assert_int_equal(pkv_attn_decode(w->c[1], l, w->s[1], NSEQ, q, co, &p), PKV_OK);
        for (uint32_t i = 0; i < NSEQ; i++)
            check_row(w, i, l, q + (size_t)i * nqh * D, w->len[i] - 1, scale, out + (size_t)i * nqh * Dv,
                      lse + i * nqh, co + (size_t)i * nqh * D, clse + i * nqh);
        /* prefill: positions [100, 112) of 0, [0, 9) of 2, the last of 1 */
        const uint32_t who[3] = {0, 2, 1}, q0[3] = {100, 0, w->len[1] - 1}, nq[3] = {12, 9, 1};
        pkv_attn_req r[2][3];
        for (int x = 0; x < 2; x++)
            for (int j = 0; j < 3; j++) r[x][j] = (pkv_attn_req){.seq = w->s[x][who[j]], .q_start = q0[j], .n_q = nq[j]};
        p.lse = lse;
        assert_int_equal(pkv_attn_prefill(w->c[0], l, r[0], 3, q, out, &p), PKV_OK);
        p.lse = clse;
        assert_int_equal(pkv_attn_prefill(w->c[1], l, r[1], 3, q, co, &p), PKV_OK);
        for (uint32_t j = 0, at = 0; j < 3; j++)
            for (uint32_t t = 0; t < nq[j]; t++, at++)
                check_row_as(w, who[j], l, q + (size_t)at * nqh * D, q0[j] + t, scale, out + (size_t)at * nqh * Dv,
                             lse + at * nqh, co + (size_t)at * nqh * D, clse + at * nqh,
                             !quick() || t == 0 || t + 1 == nq[j]);
        /* non-causal (PKV_ATTN_NONCAUSAL, where the world has no window or chunks): 5 queries over
           all of sequence 2, each as its last position's */
        if (!w->ex.window && !w->ex.chunk) {
            const pkv_attn_req nr[2] = {{.seq = w->s[0][2], .n_q = 5}, {.seq = w->s[1][2], .n_q = 5}};
            pkv_attn_params pn = p;
            pn.flags |= PKV_ATTN_NONCAUSAL;
            pn.lse = lse;
            assert_int_equal(pkv_attn_prefill(w->c[0], l, &nr[0], 1, q, out, &pn), PKV_OK);
            pn.lse = clse;
            assert_int_equal(pkv_attn_prefill(w->c[1], l, &nr[1], 1, q, co, &pn), PKV_OK);
            for (uint32_t t = 0; t < 5; t++)
                check_row_as(w, 2, l, q + (size_t)t * nqh * D, w->len[2] - 1, scale, out + (size_t)t * nqh * Dv,
                             lse + t * nqh, co + (size_t)t * nqh * D, clse + t * nqh, !quick() || t == 0);
        }
        /* a custom mask (pkv_attn_prefill_masked, where the world has no window or chunks): the
           causal one over [100, 112) of sequence 0, against the causal rows' reference */
        if (!w->ex.window && !w->ex.chunk) {
            enum { KV = 112 };
            uint8_t cm[(12 * KV + 7) / 8] = {0};
            for (uint32_t i = 0; i < 12; i++)
                for (uint32_t t = 0; t <= 100 + i; t++) cm[(i * KV + t) / 8] |= (uint8_t)(1u << ((i * KV + t) % 8));
            const uint8_t *const ms[1] = {cm};
            pkv_attn_params pm = p;
            pm.lse = lse;
            assert_int_equal(pkv_attn_prefill_masked(w->c[0], l, &r[0][0], 1, ms, q, out, &pm), PKV_OK);
            pm.lse = clse;
            assert_int_equal(pkv_attn_prefill_masked(w->c[1], l, &r[1][0], 1, ms, q, co, &pm), PKV_OK);
            for (uint32_t t = 0; t < 12; t++)
                check_row_as(w, 0, l, q + (size_t)t * nqh * D, 100 + t, scale, out + (size_t)t * nqh * Dv,
                             lse + t * nqh, co + (size_t)t * nqh * D, clse + t * nqh, !quick() || t == 0 || t == 11);
        }
        /* a tree of 4 nodes at the end of sequence 0: a chain 0-1-2 and a node 3 under 0; against
           the twin (the paths' reference is test_attn_api.c's) */
        const int32_t parent[4] = {-1, 0, 1, 0};
        const uint32_t t0 = w->len[0] - 4;
        pkv_attn_tree_req tr[2];
        for (int x = 0; x < 2; x++) tr[x] = (pkv_attn_tree_req){.seq = w->s[x][0], .q_start = t0, .n_nodes = 4, .parent = parent};
        p.lse = lse;
        assert_int_equal(pkv_attn_tree(w->c[0], l, &tr[0], 1, q, out, &p), PKV_OK);
        p.lse = clse;
        assert_int_equal(pkv_attn_tree(w->c[1], l, &tr[1], 1, q, co, &p), PKV_OK);
        /* with the bf16 flag, bf16 V's columns past the last full group of 32 of v_dim (but not of
           head_dim: 128-135 at 200 / 136) take the f32 accum in the MLA cache, the bf16 one in the twin */
        const bool lp = lp_world(w);
        for (uint32_t j = 0; j < 4 * nqh; j++) {
            for (uint32_t d = 0; d < Dv; d++)
                assert_true(fabs(out[(size_t)j * Dv + d] - co[(size_t)j * D + d]) <=
                            (lp && d >= (Dv & ~31u) ? 1.0 / 128.0 : 1e-5));
            assert_true(fabs(lse[j] - clse[j]) <= 1e-5 * fmax(1.0, fabs(clse[j])));
        }
        /* the chain's nodes 0-2 are prefill rows t0 .. t0 + 2 of sequence 0 */
        for (uint32_t j = 0; j < 3; j++)
            check_row_as(w, 0, l, q + (size_t)j * nqh * D, t0 + j, scale, out + (size_t)j * nqh * Dv, lse + j * nqh,
                         co + (size_t)j * nqh * D, clse + j * nqh, !quick() || j == 2);
    }
    free(q), free(out), free(co), free(lse), free(clse);
}

/* The kernels' ways of reading (pkv.h: PKV_ATTN_*), set at creation: the CPU's own, then pool
 * order with two passes (a window's K, then its V), then table order with 16-bit runs in 4 KiB
 * pieces (the row path's, where a kv head has fewer than 16 query heads). */
static const char *const g_ways[3][5] = {
    {NULL},
    {"PKV_ATTN_ORDER", "pool", "PKV_ATTN_PASSES", "two", NULL},
    {"PKV_ATTN_ORDER", "table", "PKV_ATTN_PIECES", "on", NULL},
};
static void set_way(int way) {
    const char *const names[] = {"PKV_ATTN_ORDER", "PKV_ATTN_PASSES", "PKV_ATTN_PIECES"};
    for (int i = 0; i < 3; i++) unsetenv(names[i]);
    for (int i = 0; g_ways[way][i]; i += 2) setenv(g_ways[way][i], g_ways[way][i + 1], 1);
}

/* Whether the backend is to be tested: PKV_ATTN_TEST_BACKENDS, where set and not empty, names the
 * ones (comma-separated: scripts/test-arm64.sh runs "neon" alone under emulation), and it exists
 * here (pkv_cache_create refuses it otherwise). */
static bool backend_here(const char *name) {
    const char *want = getenv("PKV_ATTN_TEST_BACKENDS");
    if (want && *want) {
        bool listed = false;
        for (const char *p = want; *p;) {
            const size_t len = strcspn(p, ",");
            listed |= len == strlen(name) && strncmp(p, name, len) == 0;
            p += len + (p[len] == ',');
        }
        if (!listed) return false;
    }
    setenv("PKV_ATTN_BACKEND", name, 1);
    const shape sh = {96, 64, 1, 1, 1};
    pkv_config probe = mla_config(PKV_DTYPE_F16, sh, 64);
    pkv_cache *c = NULL;
    if (pkv_cache_create(&probe, &c) == PKV_ENOTSUP) return false;
    pkv_cache_destroy(c);
    return true;
}

/* Every backend this CPU has, every dtype, each way of reading (g_ways), three shapes: a small
 * one at 1 and 16 query heads (16: the transposed primitives on x86), and DeepSeek's (576 = 512 +
 * 64) at 16 heads and 2 threads (f16, q8_0: above the size a call runs on the caller alone, so
 * the pool-order read runs in two chunks). */
static void test_mla_oracle(void **state) {
    (void)state;
    const shape shapes[3] = {{96, 64, 1, 1, 1}, {96, 64, 16, 1, 2}, {576, 512, 16, 1, 2}};
    int n_backends = 0;
    for (size_t b = 0; b < sizeof g_backends / sizeof *g_backends; b++) {
        if (!backend_here(g_backends[b])) continue;
        n_backends++;
        for (int way = 0; way < (quick() ? 1 : 3); way++) {
            set_way(way);
            for (size_t t = 0; t < sizeof g_types / sizeof *g_types; t++)
                for (int s = 0; s < 3; s++) {
                    if (s == 2 && g_types[t] != PKV_DTYPE_F16 && g_types[t] != PKV_DTYPE_Q8_0) continue;
                    world w;
                    world_make(&w, g_types[t], shapes[s], (extra){0});
                    run_world(&w, s == 2 ? 1.0f / sqrtf(192.0f) : 0.0f /* default: 1/sqrt(head_dim) */);
                    world_free(&w);
                }
        }
    }
    set_way(0);
    unsetenv("PKV_ATTN_BACKEND");
    const char *want = getenv("PKV_ATTN_TEST_BACKENDS");
    assert_true(n_backends >= (want && *want ? 1 : 2)); /* ref and the detected one at least */
}

/* Other shapes and parameters, on the reference and the CPU's own backend, 2 threads: 128 query
 * heads on one kv head (split into sub-groups of 64 rows), 2 kv heads, 4 query heads at head_dim
 * 576 (the row path: its 16-bit runs in pieces where the way says so), head_dim 200 and v_dim 136
 * at 16 heads (the transposed path's parts of 64 columns end on parts of 8), soft-cap with a
 * window, chunks of 40 and sinks, the bf16 flag over bf16, fp8, q8_0 and q4_0 caches (non-causal prefill where there is no window); then after pkv_seq_compact (1) and pkv_seq_keep (2) on both
 * caches. */
static void test_mla_shapes(void **state) {
    (void)state;
    const shape shapes[5] = {{96, 64, 128, 1, 2}, {128, 96, 16, 2, 2}, {576, 512, 4, 1, 2}, {64, 32, 8, 2, 2},
                             {200, 136, 16, 1, 2}};
    const extra exs[4] = {{0}, {.softcap = 3.0f, .window = 50, .chunk = 40, .sinks = true}, {.flags = PKV_ATTN_BF16_DOT},
                          {.flags = PKV_ATTN_F16_AS_BF16}};
    const char *const backends[2] = {"ref", NULL};
    for (int b = 0; b < 2; b++) {
        const char *want = getenv("PKV_ATTN_TEST_BACKENDS");
        if (backends[b] && want && *want) continue; /* the listed backends' own, the CPU's */
        if (backends[b]) setenv("PKV_ATTN_BACKEND", backends[b], 1);
        else unsetenv("PKV_ATTN_BACKEND");
        for (int way = 0; way < (quick() ? 1 : 3); way += 2) {
            set_way(way);
            for (int s = 0; s < 5; s++)
                for (int e = 0; e < 4; e++)
                    for (size_t t = 0; t < sizeof g_types / sizeof *g_types; t++) {
                        const pkv_dtype dt = g_types[t];
                        if (e == 2 && (dt == PKV_DTYPE_F32 || dt == PKV_DTYPE_F16)) continue;
                        if (e == 3 && dt != PKV_DTYPE_F16) continue;
                        if (s == 2 && dt != PKV_DTYPE_F16 && dt != PKV_DTYPE_BF16) continue;
                        if (!pkv_dtype_row_bytes(dt, shapes[s].Dv)) continue; /* q8_0 / q4_0 at v_dim 96 */
                        /* 128 heads, and x86's transposed parts (200 / 136): f16 alone */
                        if (quick() && (s == 0 || s == 4) && dt != PKV_DTYPE_F16) continue;
                        world w;
                        world_make(&w, dt, shapes[s], exs[e]);
                        run_world(&w, 0.0f);
                        uint32_t moved[2];
                        for (int x = 0; x < 2; x++)
                            assert_int_equal(pkv_seq_compact(w.c[x], w.s[x][1], 0, &moved[x]), PKV_OK);
                        assert_int_equal(moved[0], moved[1]);
                        const uint32_t idx[3] = {0, 2, 5};
                        for (int x = 0; x < 2; x++) assert_int_equal(pkv_seq_keep(w.c[x], w.s[x][2], 30, idx, 3), PKV_OK);
                        w.len[2] = 33;
                        world_check(&w);
                        run_world(&w, 0.25f);
                        world_free(&w);
                    }
        }
    }
    set_way(0);
    unsetenv("PKV_ATTN_BACKEND");
}

/* Forks of one long prompt decoded together: the shared prefix is read once for all (share.c,
 * attn_shared_keys counts it). With 64 query heads a group's queries are tiles of one query, each
 * a unit of its own on 2 threads: their outputs must land apart from the queries (v_dim <
 * head_dim). With 128 the scratch holds groups of 128-head members (SHARE_MLA_HEADS). */
static void test_mla_shared_prefix(void **state) {
    (void)state;
    const shape shapes[3] = {{96, 64, 16, 1, 2}, {96, 64, 64, 1, 2}, {96, 64, 128, 1, 2}};
    for (int s = 0; s < 3; s++)
        for (size_t t = 0; t < sizeof g_types / sizeof *g_types; t++) {
            if (quick() && g_types[t] != PKV_DTYPE_F16 && g_types[t] != PKV_DTYPE_Q8_0) continue;
            const shape sh = shapes[s];
            world w;
            world_make(&w, g_types[t], sh, (extra){0});
            /* 0 grows to 290; 1 and 2 become forks of it with 5 positions each of their own */
            grow(&w, 0, 140, 1);
            for (int x = 0; x < 2; x++) {
                assert_int_equal(pkv_seq_release(w.c[x], w.s[x][1]), PKV_OK);
                assert_int_equal(pkv_seq_release(w.c[x], w.s[x][2]), PKV_OK);
                assert_int_equal(pkv_seq_commit(w.c[x], w.s[x][0], 290), PKV_OK);
                assert_int_equal(pkv_seq_fork(w.c[x], w.s[x][0], &w.s[x][1]), PKV_OK);
                assert_int_equal(pkv_seq_fork(w.c[x], w.s[x][0], &w.s[x][2]), PKV_OK);
            }
            w.len[1] = w.len[2] = 290;
            grow(&w, 1, 5, 7000);
            grow(&w, 2, 5, 8000);
            pkv_stats st0;
            assert_int_equal(pkv_cache_get_stats(w.c[0], &st0), PKV_OK);
            pkv_attn_params p = pkv_attn_params_default();
            p.n_q_heads = sh.nqh;
            float *q = rand_q((size_t)NSEQ * sh.nqh * sh.D);
            float *out = malloc((size_t)NSEQ * sh.nqh * sh.Dv * sizeof(float));
            float *co = malloc((size_t)NSEQ * sh.nqh * sh.D * sizeof(float)), lse[NSEQ * 128], clse[NSEQ * 128];
            assert_true(out && co);
            for (int rep = 0; rep < (quick() ? 1 : 4); rep++) { /* units on 2 threads: the order varies */
                p.lse = lse;
                assert_int_equal(pkv_attn_decode(w.c[0], 0, w.s[0], NSEQ, q, out, &p), PKV_OK);
                p.lse = clse;
                assert_int_equal(pkv_attn_decode(w.c[1], 0, w.s[1], NSEQ, q, co, &p), PKV_OK);
                for (uint32_t i = 0; i < NSEQ; i++)
                    check_row(&w, i, 0, q + (size_t)i * sh.nqh * sh.D, w.len[i] - 1, 1.0f / sqrtf(96.0f),
                              out + (size_t)i * sh.nqh * sh.Dv, lse + i * sh.nqh, co + (size_t)i * sh.nqh * sh.D,
                              clse + i * sh.nqh);
            }
            pkv_stats st1;
            assert_int_equal(pkv_cache_get_stats(w.c[0], &st1), PKV_OK);
            assert_true(st1.attn_shared_keys > st0.attn_shared_keys); /* the groups ran */
            free(q);
            free(out);
            free(co);
            world_free(&w);
        }
}

/* What a cache whose V lives in K refuses, and what it reports. */
static void test_mla_refusals(void **state) {
    (void)state;
    const shape sh = {96, 64, 4, 1, 1};
    pkv_config cfg = mla_config(PKV_DTYPE_F16, sh, 97);
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL); /* v_dim over head_dim */
    cfg = mla_config(PKV_DTYPE_F16, sh, 64);
    cfg.v_dtype = PKV_DTYPE_BF16;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL); /* v_dtype not k_dtype */
    cfg = mla_config(PKV_DTYPE_Q8_0, sh, 48);
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL); /* q8_0 blocks of 32 */
    assert_null(c);
    cfg = mla_config(PKV_DTYPE_Q4_0, sh, 64);
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    pkv_config got;
    assert_int_equal(pkv_cache_config(c, &got), PKV_OK);
    assert_int_equal(got.v_dim, 64);
    pkv_layout lo;
    assert_int_equal(pkv_cache_layout(c, &lo), PKV_OK);
    assert_int_equal(lo.v_dim, 64);
    assert_ptr_equal(lo.v_base, lo.k_base);
    assert_int_equal(lo.v_row_bytes, lo.k_row_bytes);
    assert_int_equal(lo.v_block_bytes, lo.k_block_bytes);
    assert_int_equal(lo.v_dtype, PKV_DTYPE_Q4_0);
    pkv_stats st;
    assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
    assert_int_equal(st.kv_bytes_per_block, 2 * B * pkv_dtype_row_bytes(PKV_DTYPE_Q4_0, 96)); /* K alone, 2 layers */

    pkv_seq s;
    int32_t tok[20], slots[20];
    for (int i = 0; i < 20; i++) tok[i] = i;
    assert_int_equal(pkv_seq_create(c, NULL, 0, &s), PKV_OK);
    assert_int_equal(pkv_seq_append(c, s, tok, 20, slots), PKV_OK);
    float k[20 * 96], q[4 * 96], out[4 * 96], lse[4];
    for (int i = 0; i < 20 * 96; i++) k[i] = rnd();
    for (int i = 0; i < 4 * 96; i++) q[i] = rnd();
    assert_int_equal(pkv_write_kv(c, 0, slots, 20, k, k, PKV_DTYPE_F32), PKV_EINVAL);
    assert_int_equal(pkv_seq_write_kv(c, s, 0, 0, 20, k, k, PKV_DTYPE_F32), PKV_EINVAL);
    assert_int_equal(pkv_seq_write_kv(c, s, 0, 0, 20, NULL, k, PKV_DTYPE_F32), PKV_EINVAL);
    for (uint32_t l = 0; l < 2; l++) assert_int_equal(pkv_write_kv(c, l, slots, 20, k, NULL, PKV_DTYPE_F32), PKV_OK);
    float g[20 * 96];
    uint8_t raw[20 * 64];
    assert_int_equal(pkv_seq_gather(c, s, 0, 0, 20, g, g), PKV_EINVAL);
    assert_int_equal(pkv_seq_gather(c, s, 0, 0, 20, NULL, g), PKV_EINVAL);
    assert_int_equal(pkv_seq_read_stored(c, s, 0, 0, 1, raw, raw + 64), PKV_EINVAL);
    assert_int_equal(pkv_seq_read_stored(c, s, 0, 0, 20, raw, NULL), PKV_OK);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = 4;
    memcpy(out, q, sizeof q);
    assert_int_equal(pkv_attn_decode(c, 0, &s, 1, out, out, &p), PKV_EINVAL); /* in place: rows differ */
    assert_int_equal(pkv_attn_decode(c, 0, &s, 1, q, q + 96, &p), PKV_EINVAL);
    p.lse = out + 4 * 64 - 2; /* over out's last row */
    assert_int_equal(pkv_attn_decode(c, 0, &s, 1, q, out, &p), PKV_EINVAL);
    p.lse = lse;
    out[4 * 64] = 12345.0f; /* past out's [4][64]: untouched */
    assert_int_equal(pkv_attn_decode(c, 0, &s, 1, q, out, &p), PKV_OK);
    assert_true(out[4 * 64] == 12345.0f);
    char msg[256];
    assert_int_equal(pkv_cache_check(c, msg, sizeof msg), PKV_OK);
    pkv_cache_destroy(c);
}

/* Stored rows move between MLA caches of another block size bit for bit, and a tier's entries
 * from one MLA cache load into another (the same attention after), never into a cache of the
 * classic layout with the same dtypes and head_dim. */
static void test_mla_stored_tier(void **state) {
    (void)state;
    const shape sh = {96, 64, 8, 1, 1};
    world w;
    world_make(&w, PKV_DTYPE_FP8_E4M3, sh, (extra){0});
    pkv_config cfg = mla_config(PKV_DTYPE_FP8_E4M3, sh, 64);
    cfg.block_tokens = 32;
    pkv_cache *c2 = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c2), PKV_OK);
    const size_t rb = pkv_dtype_row_bytes(PKV_DTYPE_FP8_E4M3, 96);
    uint8_t *rows = malloc(150 * rb), *back = malloc(150 * rb);
    assert_true(rows && back);
    pkv_seq s2;
    int32_t tok[150];
    for (int i = 0; i < 150; i++) tok[i] = 1 + i;
    assert_int_equal(pkv_seq_create(c2, NULL, 0, &s2), PKV_OK);
    assert_int_equal(pkv_seq_append(c2, s2, tok, 150, NULL), PKV_OK);
    for (uint32_t l = 0; l < 2; l++) {
        assert_int_equal(pkv_seq_read_stored(w.c[0], w.s[0][0], l, 0, 150, rows, NULL), PKV_OK);
        assert_int_equal(pkv_seq_write_stored(c2, s2, l, 0, 150, rows, rows), PKV_EINVAL);
        assert_int_equal(pkv_seq_write_stored(c2, s2, l, 0, 150, rows, NULL), PKV_OK);
        assert_int_equal(pkv_seq_read_stored(c2, s2, l, 0, 150, back, NULL), PKV_OK);
        assert_memory_equal(rows, back, 150 * rb);
    }
    pkv_cache_destroy(c2);

    /* a tier: sequence 0's 9 full blocks (its first 144 positions) saved, then loaded elsewhere */
    pkv_tier *t = NULL;
    assert_int_equal(pkv_tier_host_create(64u << 20, NULL, &t), PKV_OK);
    assert_int_equal(pkv_seq_commit(w.c[0], w.s[0][0], 150), PKV_OK);
    uint32_t saved = 0, loaded = 0;
    assert_int_equal(pkv_tier_save(t, w.c[0], w.s[0][0], &saved), PKV_OK);
    assert_int_equal(saved, 9);
    for (int x = 1; x >= 0; x--) { /* the classic layout first: its miss must not cost the MLA entries */
        cfg = mla_config(PKV_DTYPE_FP8_E4M3, sh, x ? 0 : 64);
        assert_int_equal(pkv_cache_create(&cfg, &c2), PKV_OK);
        assert_int_equal(pkv_seq_create(c2, NULL, 0, &s2), PKV_OK);
        assert_int_equal(pkv_tier_load(t, c2, s2, tok, 150, &loaded), PKV_OK);
        if (x) { /* the classic layout: another key chain, nothing found */
            assert_int_equal(loaded, 0);
            pkv_cache_destroy(c2);
            continue;
        }
        assert_int_equal(loaded, 144);
        for (uint32_t l = 0; l < 2; l++) {
            assert_int_equal(pkv_seq_read_stored(w.c[0], w.s[0][0], l, 0, 144, rows, NULL), PKV_OK);
            assert_int_equal(pkv_seq_read_stored(c2, s2, l, 0, 144, back, NULL), PKV_OK);
            assert_memory_equal(rows, back, 144 * rb);
        }
        pkv_cache_destroy(c2);
    }
    pkv_tier_destroy(t);
    free(rows);
    free(back);
    world_free(&w);
}

int main(void) {
    setenv("PKV_ATTN_SHARE", "64", 1); /* shared prefixes of 64 positions and more read once */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mla_oracle),        cmocka_unit_test(test_mla_shapes),
        cmocka_unit_test(test_mla_shared_prefix), cmocka_unit_test(test_mla_refusals),
        cmocka_unit_test(test_mla_stored_tier),
    };
    return TU_RUN_TESTS(tests);
}
