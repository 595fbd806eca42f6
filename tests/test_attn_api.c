/* test_attn_api.c: attention through the public API (pkv_attn_decode / pkv_attn_prefill) over
 * sequences built with pkv_seq_append + pkv_write_kv: oracle against a contiguous double
 * reference kept by the test, forks after copy-on-write, shared prefix blocks, bad input. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_shard.h"
#include "tu_assert.h"
#include "tu_ref.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>

#include "pkv.h"
#include "quant/quant.h"

void pkv__cache_test_share(pkv_cache *c, uint32_t min_blocks, uint32_t rows); /* cache_int.h */
void pkv__cache_test_inline_work(pkv_cache *c, uint64_t elems);                /* cache_int.h */

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

/* Same tolerance as test_attn.c: max |out - ref| / max |V|, reference on the pool-rounded K/V. */
#define TOL 1e-5

enum { L = 2, H = 2, D = 64, B = 16, NQH = 8, MAXTOK = 400 };

/* The first thread count of the tests that run at 1 and 2 threads: 2 alone under emulation
 * (scripts/test-arm64.sh sets PKV_TEST_EMULATED=1), where qemu made test_api_mask,
 * test_api_noncausal and test_api_tree 41 s of this test's 56; the kernels at 1 thread are those
 * at 2, and the driver's 1-thread path is tested natively. Each (dtype, threads) case of those
 * seeds its own draws, so the 2-thread cases see the same data either way, and so do the tests
 * after them (q8_0's margin in test_api_tree does not move with the tests before it). */
static uint32_t nt_first(void) {
    const char *e = getenv("PKV_TEST_EMULATED");
    return e && !strcmp(e, "1") ? 2u : 1u;
}

static uint64_t g_rng = 99;
static float rnd(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* The test's own copy of a sequence: per layer, [pos][H][D] K and V as the pool holds them. */
typedef struct host_seq {
    pkv_seq id;
    uint32_t len;
    float k[L][MAXTOK][H][D], v[L][MAXTOK][H][D];
} host_seq;

static pkv_config api_config(pkv_dtype dt, uint32_t n_threads, int prefix) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = L, cfg.n_kv_heads = H, cfg.head_dim = D, cfg.block_tokens = B, cfg.n_blocks = 128;
    cfg.k_dtype = cfg.v_dtype = dt;
    cfg.n_threads = n_threads;
    cfg.enable_prefix_cache = prefix;
    cfg.max_seqs = 16;
    return cfg;
}

static pkv_cache *make_cache(pkv_dtype dt, uint32_t n_threads, int prefix) {
    const pkv_config cfg = api_config(dt, n_threads, prefix);
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    return c;
}

/* Appends n tokens to s (ids tok0 + position) and writes k[l], v[l] ([n][H][D] f32) at them in
 * each layer l, keeping in s what the pool holds: the values rounded to the pool dtype dt. */
static void append_kv(pkv_cache *c, pkv_dtype dt, host_seq *s, uint32_t n, int32_t tok0, const float *const k[L],
                      const float *const v[L]) {
    int32_t tok[MAXTOK], slots[MAXTOK];
    assert_true(s->len + n <= MAXTOK);
    for (uint32_t i = 0; i < n; i++) tok[i] = tok0 + (int32_t)(s->len + i);
    assert_int_equal(pkv_seq_append(c, s->id, tok, n, slots), PKV_OK);
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t r = 0; r < n * H; r++) {
            uint8_t row[D * 4];
            pkv__row_encode(dt, k[l] + (size_t)r * D, D, row);
            pkv__row_decode(dt, row, D, &s->k[l][s->len][0][0] + (size_t)r * D);
            pkv__row_encode(dt, v[l] + (size_t)r * D, D, row);
            pkv__row_decode(dt, row, D, &s->v[l][s->len][0][0] + (size_t)r * D);
        }
        assert_int_equal(pkv_write_kv(c, l, slots, n, k[l], v[l], PKV_DTYPE_F32), PKV_OK);
    }
    s->len += n;
}

/* Appends n tokens to s and writes random K/V for them in every layer (the tokens' ids are
 * tok0 + i, so two sequences built from the same tok0 share a prefix). */
static void append_write(pkv_cache *c, pkv_dtype dt, host_seq *s, uint32_t n, int32_t tok0) {
    static float kin[L][MAXTOK][H][D], vin[L][MAXTOK][H][D];
    const float *k[L], *v[L];
    assert_true(n <= MAXTOK);
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) kin[l][i][h][d] = rnd() * 2.0f, vin[l][i][h][d] = rnd();
        k[l] = &kin[l][0][0][0], v[l] = &vin[l][0][0][0];
    }
    append_kv(c, dt, s, n, tok0, k, v);
}

/* A new sequence in s (its copy reset) with n tokens of random K/V written (ids tok0 + position). */
static void seq_new(pkv_cache *c, pkv_dtype dt, host_seq *s, uint32_t n, int32_t tok0) {
    memset(s, 0, sizeof *s);
    assert_int_equal(pkv_seq_create(c, NULL, 0, &s->id), PKV_OK);
    if (n) append_write(c, dt, s, n, tok0);
}

/* The first key a query at pos sees under p's window and chunks (the references' own rule). */
static uint32_t ref_key_lo(const pkv_attn_params *p, uint32_t pos) {
    uint32_t lo = (p->window && pos + 1 > p->window) ? pos + 1 - p->window : 0;
    if (p->attn_chunk && pos / p->attn_chunk * p->attn_chunk > lo) lo = pos / p->attn_chunk * p->attn_chunk;
    return lo;
}

static bool bit_at(const uint8_t *m, uint64_t i) { return m[i >> 3] >> (i & 7u) & 1u; }

/* Reference for one query row set (NQH heads) at position pos of s: the keys p's window and chunks
 * leave it, or, where m is set (a custom mask, pkv_attn_prefill_masked), those of [0, kv_len)
 * whose bit bit0 + t of m is set (pos then only ALiBi's). No key seen: 0, lse -inf (or the
 * sink's). */
static void ref_one(const host_seq *s, uint32_t l, const float *q, uint32_t pos, const pkv_attn_params *p,
                    const uint8_t *m, uint64_t bit0, uint32_t kv_len, double *out, double *lse) {
    const double scale = p->scale > 0 ? p->scale : 1.0 / sqrt((double)D);
    const uint32_t t0 = m ? 0 : ref_key_lo(p, pos), t1 = m ? kv_len : pos + 1; /* keys [t0, t1) */
    for (uint32_t hq = 0; hq < NQH; hq++) {
        const uint32_t h = hq / (NQH / H);
        double w[MAXTOK], mx = -INFINITY, sum = 0;
        for (uint32_t t = t0; t < t1; t++) {
            if (m && !bit_at(m, bit0 + t)) continue;
            double x = tu_dot(q + hq * D, s->k[l][t][h], D) * scale;
            if (p->softcap > 0) x = p->softcap * tanh(x / p->softcap);
            if (p->alibi_slopes) x += (double)p->alibi_slopes[hq] * ((double)t - (double)pos); /* after the cap */
            w[t] = x;
            mx = fmax(mx, x);
        }
        if (p->sinks) mx = fmax(mx, p->sinks[hq]), sum = exp(p->sinks[hq] - mx); /* a key of value 0 */
        double *o = out + hq * D; /* key after key, each row's elements side by side */
        for (uint32_t d = 0; d < D; d++) o[d] = 0;
        for (uint32_t t = t0; t < t1; t++) {
            if (m && !bit_at(m, bit0 + t)) continue;
            sum += (w[t] = exp(w[t] - mx));
            for (uint32_t d = 0; d < D; d++) o[d] += w[t] * s->v[l][t][h][d];
        }
        if (sum > 0)
            for (uint32_t d = 0; d < D; d++) o[d] /= sum;
        if (lse) lse[hq] = sum > 0 ? mx + log(sum) : -INFINITY;
    }
}

static double vmax_of(const host_seq *s, uint32_t l) {
    double m = 1e-30;
    for (uint32_t t = 0; t < s->len; t++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t d = 0; d < D; d++) {
                const double a = fabs(s->v[l][t][h][d]);
                if (a > m) m = a; /* not fmax: GCC 12 for aarch64 dies vectorizing that reduction */
            }
    return m;
}

/* Checks n queries (positions pos0..) of s in out/lse against the reference; m: their custom
 * mask (rows of kv_len bits) or NULL. */
static void check_rows(const host_seq *s, uint32_t l, const float *q, const float *out, const float *lse,
                       uint32_t pos0, uint32_t n, const pkv_attn_params *p, double tol, const uint8_t *m,
                       uint32_t kv_len) {
    double ro[NQH * D], rl[NQH];
    const double vm = vmax_of(s, l);
    for (uint32_t i = 0; i < n; i++) {
        ref_one(s, l, q + (size_t)i * NQH * D, pos0 + i, p, m, (uint64_t)i * kv_len, kv_len, ro, rl);
        for (uint32_t j = 0; j < NQH * D; j++) assert_true(fabs(out[(size_t)i * NQH * D + j] - ro[j]) <= tol * vm);
        if (lse)
            for (uint32_t h = 0; h < NQH; h++) {
                if (isinf(rl[h])) assert_true(lse[i * NQH + h] == -INFINITY); /* a masked row that saw nothing */
                else assert_true(fabs(lse[i * NQH + h] - rl[h]) <= tol * fmax(1.0, fabs(rl[h])));
            }
    }
}

static void check_tol(const host_seq *s, uint32_t l, const float *q, const float *out, const float *lse,
                      uint32_t pos0, uint32_t n, const pkv_attn_params *p, double tol) {
    check_rows(s, l, q, out, lse, pos0, n, p, tol, NULL, 0);
}

static void check(const host_seq *s, uint32_t l, const float *q, const float *out, const float *lse, uint32_t pos0,
                  uint32_t n, const pkv_attn_params *p) {
    check_tol(s, l, q, out, lse, pos0, n, p, TOL);
}

static float *rand_q(uint32_t n) {
    float *q = malloc(sizeof(float) * n * NQH * D);
    for (uint32_t i = 0; i < n * NQH * D; i++) q[i] = rnd();
    return q;
}

static const pkv_dtype k_types[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
/* The float types and the 8-bit ones, and the tolerance each is checked to: q8_0 quantizes the
 * queries too (its score kernels take them as int8), fp8 only rounds the pool's values, which the
 * reference reads as the pool holds them. */
static const pkv_dtype q_types[5] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, PKV_DTYPE_Q8_0};
static double tol_of(pkv_dtype dt) { return dt == PKV_DTYPE_Q8_0 ? 2e-2 : TOL; }

/* Decode and ragged prefill over three sequences, every float dtype, 1 and 2 threads, with and
 * without soft-cap / window / LSE / sinks / ALiBi / chunks of local attention. */
static void test_api_oracle(void **state) {
    (void)state;
    static host_seq s[3];
    for (size_t ti = 0; ti < 3; ti++)
        for (uint32_t nt = 1; nt <= 2; nt++) {
            pkv_cache *c = make_cache(k_types[ti], nt, 1);
            const uint32_t lens[3] = {1 + (uint32_t)(rnd() * 0.5 + 0.5) * 10, 37, 250 + ti * 40};
            for (int i = 0; i < 3; i++) {
                memset(&s[i], 0, sizeof s[i]);
                assert_int_equal(pkv_seq_create(c, NULL, 0, &s[i].id), PKV_OK);
                /* appended in two steps: a block boundary crossed mid-way */
                append_write(c, k_types[ti], &s[i], lens[i] / 2 + 1, 1000 * i);
                if (lens[i] / 2 + 1 < lens[i]) append_write(c, k_types[ti], &s[i], lens[i] - lens[i] / 2 - 1, 1000 * i);
            }
            for (int variant = 0; variant < 8; variant++) {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                float lse[64 * NQH], sinks[NQH], slopes[NQH];
                if (variant >= 1) p.lse = lse;
                if (variant >= 2 && variant < 5) p.softcap = 7.5f, p.window = 20, p.scale = 0.2f;
                /* ALiBi: the models' slopes (4: with soft-cap and window; 7: below), then steeper (5) */
                for (uint32_t h = 0; h < NQH; h++)
                    slopes[h] = powf(2.0f, -8.0f * (float)(h + 1) / NQH) * (variant == 5 ? 2.0f : 1.0f);
                if (variant == 4 || variant == 5) p.alibi_slopes = slopes;
                /* chunks: of whole blocks (the sequences' ends and the extends cross their edges),
                   then of 13 with a window of 9, soft-cap and ALiBi */
                if (variant == 6) p.attn_chunk = 48;
                if (variant == 7) p.attn_chunk = 13, p.window = 9, p.softcap = 7.5f, p.alibi_slopes = slopes;
                if (variant == 3) { /* sinks below, near and above the logits (|logit| <= 7.5) */
                    for (uint32_t h = 0; h < NQH; h++) sinks[h] = 6.0f * rnd() + (h % 3 ? 0.0f : 8.0f);
                    p.sinks = sinks;
                }
                /* decode: one query per sequence at its last position */
                const pkv_seq ids[3] = {s[0].id, s[1].id, s[2].id};
                float *q = rand_q(3), *out = malloc(sizeof(float) * 3 * NQH * D);
                assert_int_equal(pkv_attn_decode(c, 1, ids, 3, q, out, &p), PKV_OK);
                for (int i = 0; i < 3; i++)
                    check(&s[i], 1, q + i * NQH * D, out + i * NQH * D, p.lse ? lse + i * NQH : NULL, s[i].len - 1, 1, &p);
                free(q), free(out);
                /* prefill: a ragged batch; the last request extends from the middle */
                pkv_attn_req reqs[3] = {{s[0].id, 0, s[0].len}, {s[1].id, 5, 20}, {s[2].id, s[2].len - 24, 24}};
                const uint32_t nq = reqs[0].n_q + reqs[1].n_q + reqs[2].n_q;
                q = rand_q(nq), out = malloc(sizeof(float) * nq * NQH * D);
                assert_int_equal(pkv_attn_prefill(c, 0, reqs, 3, q, out, &p), PKV_OK);
                size_t at = 0;
                for (int i = 0; i < 3; i++) {
                    check(&s[i], 0, q + at * NQH * D, out + at * NQH * D, p.lse ? lse + at * NQH : NULL, reqs[i].q_start,
                          reqs[i].n_q, &p);
                    at += reqs[i].n_q;
                }
                free(q), free(out);
            }
            pkv_cache_destroy(c);
        }
}

/* A fork shares the parent's blocks; appending to either copies the shared tail block
 * (copy-on-write), after which each reads its own K/V there and the shared prefix. */
static void test_api_fork_cow(void **state) {
    (void)state;
    static host_seq par, child;
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    seq_new(c, PKV_DTYPE_F16, &par, 40, 0); /* blocks 0, 1 full; block 2 holds 8 */
    child = par;
    assert_int_equal(pkv_seq_fork(c, par.id, &child.id), PKV_OK);
    append_write(c, PKV_DTYPE_F16, &child, 5, 500); /* CoW of block 2 for the child */
    append_write(c, PKV_DTYPE_F16, &par, 3, 900);   /* the parent's block 2 is its own again */
    int32_t tp[8], tc[8];
    uint32_t np = 0, nc = 0;
    assert_int_equal(pkv_seq_block_table(c, par.id, tp, 8, &np), PKV_OK);
    assert_int_equal(pkv_seq_block_table(c, child.id, tc, 8, &nc), PKV_OK);
    assert_int_equal(np, 3);
    assert_int_equal(nc, 3);
    assert_int_equal(tp[0], tc[0]); /* the full blocks are still shared */
    assert_int_equal(tp[1], tc[1]);
    assert_int_not_equal(tp[2], tc[2]); /* the tail was copied */
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    float lse[2 * NQH];
    p.lse = lse;
    const pkv_seq ids[2] = {par.id, child.id};
    float *q = rand_q(2), out[2 * NQH * D];
    for (uint32_t l = 0; l < L; l++) {
        assert_int_equal(pkv_attn_decode(c, l, ids, 2, q, out, &p), PKV_OK);
        check(&par, l, q, out, lse, par.len - 1, 1, &p);
        check(&child, l, q + NQH * D, out + NQH * D, lse + NQH, child.len - 1, 1, &p);
    }
    /* the child's prefill over its own tail: positions 38..44 */
    pkv_attn_req r = {child.id, 38, 7};
    float *q7 = rand_q(7), *o7 = malloc(sizeof(float) * 7 * NQH * D);
    p.lse = NULL;
    assert_int_equal(pkv_attn_prefill(c, 1, &r, 1, q7, o7, &p), PKV_OK);
    check(&child, 1, q7, o7, NULL, 38, 7, &p);
    free(q), free(q7), free(o7);
    char msg[256];
    assert_int_equal(pkv_cache_check(c, msg, sizeof msg), PKV_OK);
    pkv_cache_destroy(c);
}

/* A new sequence attached to an indexed prefix (pkv_seq_match_prefix) reads the shared blocks
 * written by the first one, plus its own positions. */
static void test_api_shared_prefix(void **state) {
    (void)state;
    static host_seq a, b;
    pkv_cache *c = make_cache(PKV_DTYPE_BF16, 2, 1);
    seq_new(c, PKV_DTYPE_BF16, &a, 64, 7);
    assert_int_equal(pkv_seq_commit(c, a.id, 64), PKV_OK);
    /* b's prompt: the same 64 tokens, then 20 of its own */
    int32_t prompt[84];
    for (int i = 0; i < 84; i++) prompt[i] = 7 + i + (i >= 64 ? 5000 : 0);
    b = a;
    b.len = 0;
    assert_int_equal(pkv_seq_create(c, NULL, 0, &b.id), PKV_OK);
    uint32_t reused = 0;
    assert_int_equal(pkv_seq_match_prefix(c, b.id, prompt, 84, &reused), PKV_OK);
    assert_true(reused >= 48 && reused <= 64); /* at least the three full blocks before the last one */
    b.len = reused;
    /* b's own K/V from `reused` on (token ids continue the prompt) */
    append_write(c, PKV_DTYPE_BF16, &b, 84 - reused, 0);
    pkv_seq_info info;
    assert_int_equal(pkv_seq_get_info(c, b.id, &info), PKV_OK);
    assert_true(info.n_shared >= 3);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    pkv_attn_req r = {b.id, reused, 84 - reused};
    float *q = rand_q(84 - reused), *out = malloc(sizeof(float) * (84 - reused) * NQH * D);
    for (uint32_t l = 0; l < L; l++) {
        assert_int_equal(pkv_attn_prefill(c, l, &r, 1, q, out, &p), PKV_OK);
        check(&b, l, q, out, NULL, reused, 84 - reused, &p);
    }
    free(q), free(out);
    pkv_cache_destroy(c);
}

static void test_api_bad_input(void **state) {
    (void)state;
    static host_seq s;
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    seq_new(c, PKV_DTYPE_F16, &s, 30, 0);
    pkv_seq empty, gone;
    assert_int_equal(pkv_seq_create(c, NULL, 0, &empty), PKV_OK);
    assert_int_equal(pkv_seq_create(c, NULL, 0, &gone), PKV_OK);
    assert_int_equal(pkv_seq_release(c, gone), PKV_OK);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    float q[4 * NQH * D], out[4 * NQH * D];
    for (size_t i = 0; i < sizeof q / sizeof *q; i++) q[i] = 0.5f, out[i] = 42.0f;
    pkv_seq two[2] = {s.id, gone};
    assert_int_equal(pkv_attn_decode(c, 0, &gone, 1, q, out, &p), PKV_ENOENT);
    assert_int_equal(pkv_attn_decode(c, 0, two, 2, q, out, &p), PKV_ENOENT); /* nothing computed for s */
    pkv_seq forged = s.id + (1ull << 32);
    assert_int_equal(pkv_attn_decode(c, 0, &forged, 1, q, out, &p), PKV_ENOENT);
    assert_int_equal(pkv_attn_decode(c, L, &s.id, 1, q, out, &p), PKV_EINVAL); /* layer out of range */
    assert_int_equal(pkv_attn_decode(c, 0, &empty, 1, q, out, &p), PKV_EINVAL); /* no position to decode */
    p.n_q_heads = 3; /* not a multiple of 2 kv heads */
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    p.n_q_heads = NQH;
    p.softcap = -1;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    p.softcap = 1e-39f; /* subnormal (pkv.h) */
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    p.softcap = 0;
    p.scale = -0.5f;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    p.scale = 0;
    p.flags = 8u; /* a flag pkv.h does not define */
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    p.flags = 0;
    assert_int_equal(pkv_attn_decode(NULL, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    assert_int_equal(pkv_attn_decode(c, 0, NULL, 1, q, out, &p), PKV_EINVAL);
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, NULL, out, &p), PKV_EINVAL);
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, NULL, &p), PKV_EINVAL);
    pkv_attn_req r = {s.id, 27, 4}; /* past the length (30) */
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    r = (pkv_attn_req){gone, 0, 1};
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, out, &p), PKV_ENOENT);
    assert_int_equal(pkv_attn_prefill(c, 0, NULL, 1, q, out, &p), PKV_EINVAL);
    for (size_t i = 0; i < sizeof out / sizeof *out; i++) assert_true(out[i] == 42.0f); /* nothing written */
    /* overlaps other than out == q: out a float past q, lse inside q or out (nothing written) */
    static float qo[3 * NQH * D], lse[NQH];
    for (size_t i = 0; i < sizeof qo / sizeof *qo; i++) qo[i] = 0.5f;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, qo, qo + 1, &p), PKV_EINVAL);
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, qo + 1, qo, &p), PKV_EINVAL);
    r = (pkv_attn_req){s.id, 26, 2}; /* two queries: out the second one's rows */
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, qo, qo + NQH * D, &p), PKV_EINVAL);
    p.lse = qo + NQH * D - 1;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, qo, out, &p), PKV_EINVAL);
    p.lse = out + 3;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_EINVAL);
    for (size_t i = 0; i < sizeof qo / sizeof *qo; i++) assert_true(qo[i] == 0.5f);
    for (size_t i = 0; i < sizeof out / sizeof *out; i++) assert_true(out[i] == 42.0f);
    /* next to each other is no overlap: q, then out, then lse */
    p.lse = lse;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, qo, qo + NQH * D, &p), PKV_OK);
    p.lse = qo + 2 * NQH * D;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, qo, qo + NQH * D, &p), PKV_OK);
    for (uint32_t h = 0; h < NQH; h++) assert_true(qo[2 * NQH * D + h] == lse[h]);
    p.lse = NULL;
    /* the same calls done right work; the smallest cap taken (FLT_MIN) too */
    p.softcap = FLT_MIN;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_OK);
    p.softcap = 0;
    r = (pkv_attn_req){s.id, 26, 4};
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, out, &p), PKV_OK);
    check(&s, 0, q, out, NULL, 26, 4, &p);
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, NULL), PKV_OK); /* NULL params: n_q_heads = n_kv_heads */
    const char *be = pkv_attn_backend(c);
    assert_true(!strcmp(be, "ref") || !strcmp(be, "avx2") || !strcmp(be, "avx2-vnni") || !strcmp(be, "avx512") ||
                !strcmp(be, "avx512-vnni") || !strcmp(be, "avx512-amx") || !strcmp(be, "neon") ||
                !strcmp(be, "neon-dotprod"));
    /* PKV_ATTN_BF16_DOT: accepted on any cache; with f16 K/V it changes nothing (the same bits) */
    assert_int_equal(pkv_attn_flags_used(c) & PKV_ATTN_BF16_DOT, 0u);
    assert_int_equal(pkv_attn_flags_used(NULL), 0u);
    float plain[NQH * D];
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, plain, &p), PKV_OK);
    p.flags = PKV_ATTN_BF16_DOT;
    assert_int_equal(pkv_attn_decode(c, 0, &s.id, 1, q, out, &p), PKV_OK);
    assert_memory_equal(plain, out, sizeof plain);
    pkv_cache_destroy(c);
}

/* PKV_ATTN_BF16_DOT through the API: a bf16 cache says whether its backend takes the flag
 * (pkv_attn_flags_used: AVX-512 with AVX512_BF16, NEON with FEAT_BF16, not the reference), and the results with it
 * stay within the bound pkv.h states: scores from queries rounded to bf16, outputs within 2^-8
 * of max |V| of those (test_attn.c checks the kernels on every shape; here the cache's own
 * dispatch, decode and prefill, and the backend the environment picks). */
static void test_api_bf16_dot(void **state) {
    (void)state;
    static host_seq s;
    pkv_cache *c = make_cache(PKV_DTYPE_BF16, 2, 0);
    seq_new(c, PKV_DTYPE_BF16, &s, 200, 0);
    const char *be = pkv_attn_backend(c);
    const bool avx512 = !strncmp(be, "avx512", 6), neon = !strncmp(be, "neon", 4);
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && (defined(__x86_64__) || defined(__i386__))
    if (avx512) assert_int_equal(pkv_attn_flags_used(c), __builtin_cpu_supports("avx512bf16") ? PKV_ATTN_BF16_DOT : 0u);
#endif
#if defined(__aarch64__) && defined(__linux__)
    if (neon) /* HWCAP2_BF16 */
        assert_int_equal(pkv_attn_flags_used(c), getauxval(AT_HWCAP2) & (1ul << 14) ? PKV_ATTN_BF16_DOT : 0u);
#endif
    if (!avx512 && !neon) assert_int_equal(pkv_attn_flags_used(c), 0u);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    static float q[4 * NQH * D], plain[4 * NQH * D], out[4 * NQH * D], qr[4 * NQH * D];
    for (size_t i = 0; i < sizeof q / sizeof *q; i++) q[i] = 2.0f * rnd();
    pkv_attn_req r = {s.id, 197, 3}; /* 3 queries x 4 query heads a kv head: the row path (under 16 rows) */
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, plain, &p), PKV_OK);
    p.flags = PKV_ATTN_BF16_DOT;
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, out, &p), PKV_OK);
    const bool used = pkv_attn_flags_used(c) != 0;
    assert_true((memcmp(plain, out, sizeof out) != 0) == used);
    /* the reference over the rounded queries (scale 1 / sqrt(D) first), within 2^-7 of max |V| */
    pkv_attn_params pr = p;
    pr.scale = 1.0f;
    const float scale = 1.0f / sqrtf((float)D);
    for (size_t i = 0; i < sizeof q / sizeof *q; i++) {
        qr[i] = used ? tu_bf16(q[i] * scale) : q[i];
    }
    if (!used) pr.scale = 0;
    check_tol(&s, 0, qr, out, NULL, 197, 3, &pr, used ? 1.0 / 128.0 : TOL);
    /* a decode too, and a prefill tile of 16 rows a kv head (the transposed kernels) */
    assert_int_equal(pkv_attn_decode(c, 1, &s.id, 1, q, out, &p), PKV_OK);
    check_tol(&s, 1, qr, out, NULL, 199, 1, &pr, used ? 1.0 / 128.0 : TOL);
    r = (pkv_attn_req){s.id, 196, 4};
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, out, &p), PKV_OK);
    check_tol(&s, 0, qr, out, NULL, 196, 4, &pr, used ? 1.0 / 128.0 : TOL);
    p.flags = 0;
    assert_int_equal(pkv_attn_prefill(c, 0, &r, 1, q, plain, &p), PKV_OK);
    assert_true((memcmp(plain, out, sizeof out) != 0) == used);
    pkv_cache_destroy(c);
}

/* A prefill of r under p with flags base, into plain, and with base | flag, into out (n floats
 * each); p's flags are base | flag after. Whether the two differ. */
static bool prefill_differs(pkv_cache *c, const pkv_attn_req *r, const float *q, float *plain, float *out, size_t n,
                            pkv_attn_params *p, uint32_t base, uint32_t flag) {
    p->flags = base;
    assert_int_equal(pkv_attn_prefill(c, 0, r, 1, q, plain, p), PKV_OK);
    p->flags = base | flag;
    assert_int_equal(pkv_attn_prefill(c, 0, r, 1, q, out, p), PKV_OK);
    return memcmp(plain, out, sizeof(float) * n) != 0;
}

/* pkv_attn_flags_used against what the flag does, for a bf16 V beside an f32 K at head_dim 80 (not
 * a multiple of 32): a prefill of 16 query rows a kv head (the transposed path where the backend
 * has it) differs with PKV_ATTN_BF16_DOT exactly where the cache says the flag applies. On
 * avx512-amx only those units round there (their weights: the tiles' vdpbf16ps fallback), so the
 * cache must say so (stop 89's review: it had said 0). */
static void test_api_bf16_v_flags_used(void **state) {
    (void)state;
    enum { HD = 80, KVH = 2, QH = 8, N = 40, NQ = 8 };
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = KVH, cfg.head_dim = HD, cfg.block_tokens = 16, cfg.n_blocks = 8;
    cfg.k_dtype = PKV_DTYPE_F32, cfg.v_dtype = PKV_DTYPE_BF16;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    const bool used = (pkv_attn_flags_used(c) & PKV_ATTN_BF16_DOT) != 0;
    if (!strcmp(pkv_attn_backend(c), "avx512-amx")) assert_true(used);
    if (!strcmp(pkv_attn_backend(c), "ref")) assert_false(used);
    pkv_seq s;
    int32_t tok[N];
    static float k[N * KVH * HD], v[N * KVH * HD], q[NQ * QH * HD], plain[NQ * QH * HD], out[NQ * QH * HD];
    for (int i = 0; i < N; i++) tok[i] = 7 + i;
    for (size_t i = 0; i < sizeof k / sizeof *k; i++) k[i] = rnd(), v[i] = rnd();
    for (size_t i = 0; i < sizeof q / sizeof *q; i++) q[i] = 2.0f * rnd();
    assert_int_equal(pkv_seq_create(c, NULL, 0, &s), PKV_OK);
    assert_int_equal(pkv_seq_append(c, s, tok, N, NULL), PKV_OK);
    assert_int_equal(pkv_seq_write_kv(c, s, 0, 0, N, k, v, PKV_DTYPE_F32), PKV_OK);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = QH;
    const pkv_attn_req r = {s, N - NQ, NQ}; /* 8 queries x 4 query heads a kv head: 32 rows */
    assert_true(prefill_differs(c, &r, q, plain, out, NQ * QH * HD, &p, 0, PKV_ATTN_BF16_DOT) == used);
    pkv_cache_destroy(c);
}

/* A rounding flag's calls on sequence id at the positions of the tests below: a decode (4 rows a kv
 * head: the row path) gives the same bits with flag as without, and a prefill of 16 queries from
 * 180 (64 rows a kv head: the tiles) differs exactly where used; out holds the prefill with the
 * flag, plain without, and p its flags 0 after. */
static void flag_calls(pkv_cache *c, pkv_seq id, pkv_attn_params *p, uint32_t flag, const float *q, float *plain,
                       float *out, bool used) {
    p->flags = 0;
    assert_int_equal(pkv_attn_decode(c, 0, &id, 1, q, plain, p), PKV_OK);
    p->flags = flag;
    assert_int_equal(pkv_attn_decode(c, 0, &id, 1, q, out, p), PKV_OK);
    assert_memory_equal(plain, out, sizeof(float) * NQH * D);
    const pkv_attn_req r = {id, 180, 16};
    assert_true(prefill_differs(c, &r, q, plain, out, 16 * NQH * D, p, 0, flag) == used);
    p->flags = 0;
}

/* PKV_ATTN_F16_AS_BF16 through the API: an f16 cache says whether its backend takes the flag
 * (pkv_attn_flags_used: avx512-amx; head_dim 64 here), a decode (4 rows a kv head: the row path)
 * gives the same bits with it, and a prefill of 16 queries (64 rows a kv head: AMX's tiles)
 * differs exactly where it is used, within 2^-7 of max |V| of the reference over K and the
 * queries times scale rounded to bf16 (test_attn.c checks the kernels on every shape). */
static void test_api_f16_as_bf16(void **state) {
    (void)state;
    static host_seq s, sr;
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    seq_new(c, PKV_DTYPE_F16, &s, 200, 0);
    const uint32_t used = pkv_attn_flags_used(c);
    const bool amx = !strcmp(pkv_attn_backend(c), "avx512-amx");
    assert_int_equal(used & PKV_ATTN_F16_AS_BF16, amx ? PKV_ATTN_F16_AS_BF16 : 0u);
    assert_int_equal(used & PKV_ATTN_BF16_DOT, 0u);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    static float q[16 * NQH * D], plain[16 * NQH * D], out[16 * NQH * D], qr[16 * NQH * D];
    for (size_t i = 0; i < sizeof q / sizeof *q; i++) q[i] = 2.0f * rnd();
    flag_calls(c, s.id, &p, PKV_ATTN_F16_AS_BF16, q, plain, out, amx);
    if (!amx) {
        check_tol(&s, 0, q, out, NULL, 180, 16, &p, TOL);
    } else {
        sr = s;
        for (uint32_t t = 0; t < s.len; t++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) sr.k[0][t][h][d] = tu_bf16(s.k[0][t][h][d]);
        const float scale = 1.0f / sqrtf((float)D);
        for (size_t i = 0; i < sizeof q / sizeof *q; i++) qr[i] = tu_bf16(q[i] * scale);
        pkv_attn_params pr = p;
        pr.scale = 1.0f;
        check_tol(&sr, 0, qr, out, NULL, 180, 16, &pr, 1.0 / 128.0);
    }
    pkv_cache_destroy(c);
    /* f16 K beside a q8_0 V: the transposed path takes such a pair only with PKV_ATTN_BF16_DOT on
       avx512-amx, so there the flag changes the results of calls that pass both, and alone none */
    pkv_config cfg = api_config(PKV_DTYPE_F16, 1, 0);
    cfg.v_dtype = PKV_DTYPE_Q8_0;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    assert_int_equal(pkv_attn_flags_used(c), amx ? PKV_ATTN_BF16_DOT | PKV_ATTN_F16_AS_BF16 : 0u);
    pkv_seq id;
    assert_int_equal(pkv_seq_create(c, NULL, 0, &id), PKV_OK);
    static int32_t tok[200], slots[200];
    static float kin[200 * H * D], vin[200 * H * D];
    for (uint32_t i = 0; i < 200; i++) tok[i] = (int32_t)i;
    for (size_t i = 0; i < sizeof kin / sizeof *kin; i++) kin[i] = 2.0f * rnd(), vin[i] = rnd();
    assert_int_equal(pkv_seq_append(c, id, tok, 200, slots), PKV_OK);
    assert_int_equal(pkv_write_kv(c, 0, slots, 200, kin, vin, PKV_DTYPE_F32), PKV_OK);
    const pkv_attn_req rq = {id, 180, 16};
    static float o2[16 * NQH * D];
    for (int dot = 0; dot < 2; dot++)
        assert_true(prefill_differs(c, &rq, q, plain, o2, 16 * NQH * D, &p, dot ? PKV_ATTN_BF16_DOT : 0,
                                    PKV_ATTN_F16_AS_BF16) == (amx && dot));
    pkv_cache_destroy(c);
}

/* PKV_ATTN_BF16_DOT over fp8 e4m3, q8_0 and q4_0 caches through the API: the automatic backend
 * is the one an f16 cache gets (avx512-amx where the CPU has AMX), which says it takes the flag
 * (pkv_attn_flags_used) exactly there; a decode (4 rows a kv head: the row path) gives the same
 * bits with it, and a prefill of 16 queries (64 rows a kv head: the tiles) differs exactly where
 * it is used, within 2^-7 of max |V| of the reference over the pool's values and the queries
 * times scale rounded to bf16 (fp8 codes and q8_0 / q4_0 integers are bf16 exactly). */
static void test_api_fp8_bf16_dot(void **state) {
    (void)state;
    static host_seq s;
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 1, 0);
    const bool amx = !strcmp(pkv_attn_backend(c), "avx512-amx");
    pkv_cache_destroy(c);
    static const pkv_dtype dts[] = {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0};
    for (size_t di = 0; di < sizeof dts / sizeof *dts; di++) {
        const pkv_dtype dt = dts[di];
        c = make_cache(dt, 2, 0);
        assert_true(!strcmp(pkv_attn_backend(c), "avx512-amx") == amx);
        seq_new(c, dt, &s, 200, 0);
        assert_int_equal(pkv_attn_flags_used(c), amx ? PKV_ATTN_BF16_DOT : 0u);
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH;
        static float q[16 * NQH * D], plain[16 * NQH * D], out[16 * NQH * D], qr[16 * NQH * D];
        for (size_t i = 0; i < sizeof q / sizeof *q; i++) q[i] = 2.0f * rnd();
        flag_calls(c, s.id, &p, PKV_ATTN_BF16_DOT, q, plain, out, amx);
        const double tol_plain = dt == PKV_DTYPE_FP8_E4M3 ? TOL : 2e-2; /* q8_0, q4_0: int8 queries */
        check_tol(&s, 0, q, plain, NULL, 180, 16, &p, tol_plain);
        if (amx) {
            const float scale = 1.0f / sqrtf((float)D);
            for (size_t i = 0; i < sizeof q / sizeof *q; i++) qr[i] = tu_bf16(q[i] * scale);
            pkv_attn_params pr = p;
            pr.scale = 1.0f;
            check_tol(&s, 0, qr, out, NULL, 180, 16, &pr, 1.0 / 128.0);
        }
        pkv_cache_destroy(c);
    }
}

/* Appends n tokens to dst holding src's K/V of positions [from, from + n) in every layer (the
 * values are already rounded to dt, so the pool holds them unchanged). */
static void append_copy(pkv_cache *c, pkv_dtype dt, host_seq *dst, const host_seq *src, uint32_t from, uint32_t n) {
    assert_true(from + n <= src->len);
    const float *k[L], *v[L];
    for (uint32_t l = 0; l < L; l++) k[l] = &src->k[l][from][0][0], v[l] = &src->v[l][from][0][0];
    append_kv(c, dt, dst, n, 70000, k, v);
}

/* Cascade attention through the public API: two forks of a shared prefix, each query attended
 * over the prefix (one sequence, named twice in the batch) and over its own suffix (a sequence
 * holding only the suffix's K/V), the parts merged by pkv_attn_merge, equal the decode over the
 * whole sequences and the double reference; in place gives the same bits. */
static void test_api_merge_cascade(void **state) {
    (void)state;
    static host_seq pre, a, b, sa, sb;
    for (size_t ti = 0; ti < 2; ti++) {
        const pkv_dtype dt = k_types[ti];
        pkv_cache *c = make_cache(dt, 2, 0);
        seq_new(c, dt, &pre, 40, 0); /* the prefix ends inside block 2: the forks copy it */
        a = pre, b = pre;
        assert_int_equal(pkv_seq_fork(c, pre.id, &a.id), PKV_OK);
        assert_int_equal(pkv_seq_fork(c, pre.id, &b.id), PKV_OK);
        append_write(c, dt, &a, 29, 100);
        append_write(c, dt, &b, 17, 200);
        memset(&sa, 0, sizeof sa), memset(&sb, 0, sizeof sb);
        assert_int_equal(pkv_seq_create(c, NULL, 0, &sa.id), PKV_OK);
        assert_int_equal(pkv_seq_create(c, NULL, 0, &sb.id), PKV_OK);
        append_copy(c, dt, &sa, &a, 40, 29);
        append_copy(c, dt, &sb, &b, 40, 17);
        for (int variant = 0; variant < 2; variant++) {
            pkv_attn_params p = pkv_attn_params_default();
            p.n_q_heads = NQH;
            if (variant) p.softcap = 5.0f, p.scale = 0.3f; /* both act per logit: the parts still merge */
            enum { N = 2 * NQH * D };
            float *q = rand_q(2), o[4][N], l[4][2 * NQH], om[N], lm[2 * NQH];
            const pkv_seq parts[3][2] = {{pre.id, pre.id}, {sa.id, sb.id}, {a.id, b.id}};
            for (int i = 0; i < 3; i++) {
                p.lse = l[i];
                assert_int_equal(pkv_attn_decode(c, 1, parts[i], 2, q, o[i], &p), PKV_OK);
            }
            assert_int_equal(pkv_attn_merge(2 * NQH, D, o[0], l[0], o[1], l[1], om, lm), PKV_OK);
            p.lse = NULL;
            check(&a, 1, q, om, NULL, a.len - 1, 1, &p);
            check(&b, 1, q + NQH * D, om + NQH * D, NULL, b.len - 1, 1, &p);
            for (uint32_t j = 0; j < 2 * NQH; j++)
                assert_true(fabsf(lm[j] - l[2][j]) <= 1e-5f * fmaxf(1.0f, fabsf(l[2][j])));
            const double vm = fmax(vmax_of(&a, 1), vmax_of(&b, 1));
            for (uint32_t j = 0; j < N; j++) assert_true(fabs(om[j] - o[2][j]) <= TOL * vm);
            /* in place, into either part, and with no lse wanted: the same bits */
            memcpy(o[3], o[0], sizeof o[3]), memcpy(l[3], l[0], sizeof l[3]);
            assert_int_equal(pkv_attn_merge(2 * NQH, D, o[3], l[3], o[1], l[1], o[3], l[3]), PKV_OK);
            assert_memory_equal(o[3], om, sizeof om);
            assert_memory_equal(l[3], lm, sizeof lm);
            memcpy(o[3], o[1], sizeof o[3]);
            assert_int_equal(pkv_attn_merge(2 * NQH, D, o[0], l[0], o[3], l[1], o[3], NULL), PKV_OK);
            assert_memory_equal(o[3], om, sizeof om);
            free(q);
        }
        pkv_cache_destroy(c);
    }
}

/* The cache of test_api_sinks and test_api_alibi: f16, 2 threads, three sequences of 70, 33 and
 * 140 positions appended in turns (tables that jump: decode reads them in pool order). */
static pkv_cache *jumping_seqs(host_seq s[3]) {
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    const uint32_t lens[3] = {70, 33, 140};
    for (int i = 0; i < 3; i++) {
        memset(&s[i], 0, sizeof s[i]);
        assert_int_equal(pkv_seq_create(c, NULL, 0, &s[i].id), PKV_OK);
    }
    for (uint32_t step = 0; step < 10; step++)
        for (int i = 0; i < 3; i++)
            append_write(c, PKV_DTYPE_F16, &s[i], lens[i] / 10 + (step == 9 ? lens[i] % 10 : 0), 100 * i);
    return c;
}

/* One call of test_api_sinks / test_api_alibi: 3 decodes or a ragged prefill of two requests. */
typedef struct run_ctx {
    pkv_cache *c;
    int prefill;
    const pkv_seq *ids;
    const pkv_attn_req *reqs;
} run_ctx;
static int run_call(const run_ctx *x, const float *q, float *out, const pkv_attn_params *p) {
    return x->prefill ? pkv_attn_prefill(x->c, 1, x->reqs, 2, q, out, p) : pkv_attn_decode(x->c, 1, x->ids, 3, q, out, p);
}

/* The refusals of a per-head array of the params (*field: &p->sinks or &p->alibi_slopes, whose
 * values vals[NQH] are good): each of bad[nb] in one head is PKV_EINVAL with out (o1, n_out
 * floats) untouched, and so is the array inside out or inside lse (l1); inside q (nq floats) it is
 * read only and allowed, the same bits as apart, except where out is q. */
static void array_refusals(const run_ctx *x, const float *q, size_t nq, size_t n_out, pkv_attn_params *p,
                           const float **field, float *vals, const float *bad, int nb, float *o0, float *o1, float *l1) {
    float *om = malloc(sizeof(float) * n_out);
    memcpy(om, o1, sizeof(float) * n_out);
    *field = vals;
    for (int b = 0; b < nb; b++) {
        const float keep = vals[NQH - 1 - b];
        vals[NQH - 1 - b] = bad[b];
        assert_int_equal(run_call(x, q, o1, p), PKV_EINVAL);
        vals[NQH - 1 - b] = keep;
    }
    assert_memory_equal(om, o1, sizeof(float) * n_out);
    free(om);
    memcpy(o1 + NQH * D, vals, sizeof(float) * NQH);
    *field = o1 + NQH * D; /* inside out */
    assert_int_equal(run_call(x, q, o1, p), PKV_EINVAL);
    memcpy(l1 + 3, vals, sizeof(float) * NQH);
    *field = l1 + 3; /* inside lse */
    assert_int_equal(run_call(x, q, o1, p), PKV_EINVAL);
    float *qs = malloc(sizeof(float) * nq); /* inside q: read only, allowed */
    memcpy(qs, q, sizeof(float) * nq);
    memcpy(qs + 5, vals, sizeof(float) * NQH);
    float *lse = p->lse;
    *field = qs + 5, p->lse = NULL;
    assert_int_equal(run_call(x, qs, o1, p), PKV_OK);
    *field = vals;
    assert_int_equal(run_call(x, qs, o0, p), PKV_OK);
    assert_memory_equal(o0, o1, sizeof(float) * n_out);
    *field = qs + 5; /* ... but not where out is q */
    assert_int_equal(run_call(x, qs, qs, p), PKV_EINVAL);
    *field = vals, p->lse = lse;
    free(qs);
}

/* Attention sinks (pkv_attn_params.sinks). Through the public calls, decode (a batch whose tables
 * jump, read in pool order) and prefill, 2 threads:
 * - sinks far below every logit give the same bits as none;
 * - a sink is one more key of value 0: the result equals the one without sinks merged
 *   (pkv_attn_merge) with a part of out 0 and lse sinks[h];
 * - a sink that is not finite, or sinks overlapping out or lse, is PKV_EINVAL with out untouched;
 *   overlapping q is allowed where out is not q. */
static void test_api_sinks(void **state) {
    (void)state;
    static host_seq s[3];
    pkv_cache *c = jumping_seqs(s);
    const pkv_seq ids[3] = {s[0].id, s[1].id, s[2].id};
    const pkv_attn_req reqs[2] = {{s[2].id, 100, 40}, {s[0].id, 0, 30}};
    enum { NR = 70 }; /* queries: 3 decodes, or 70 prefill rows */
    float *q = rand_q(NR), *o0 = malloc(sizeof(float) * NR * NQH * D), *o1 = malloc(sizeof(float) * NR * NQH * D);
    float *om = malloc(sizeof(float) * NR * NQH * D), *zero = calloc((size_t)NR * NQH * D, sizeof(float));
    float l0[NR * NQH], l1[NR * NQH], lz[NR * NQH], lm[NR * NQH], sinks[NQH];
    double vm = 0;
    for (int i = 0; i < 3; i++) vm = fmax(vm, vmax_of(&s[i], 1));
    for (int prefill = 0; prefill < 2; prefill++) {
        const uint32_t n = prefill ? NR : 3;
#define RUN(out, pp) (prefill ? pkv_attn_prefill(c, 1, reqs, 2, q, out, pp) : pkv_attn_decode(c, 1, ids, 3, q, out, pp))
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH, p.lse = l0;
        assert_int_equal(RUN(o0, &p), PKV_OK);
        for (uint32_t h = 0; h < NQH; h++) sinks[h] = -1e30f;
        p.sinks = sinks, p.lse = l1;
        assert_int_equal(RUN(o1, &p), PKV_OK);
        assert_memory_equal(o0, o1, sizeof(float) * n * NQH * D);
        assert_memory_equal(l0, l1, sizeof(float) * n * NQH);
        for (uint32_t h = 0; h < NQH; h++) sinks[h] = 4.0f * rnd() + (float)(h % 4) - 1.0f;
        assert_int_equal(RUN(o1, &p), PKV_OK);
        for (uint32_t r = 0; r < n * NQH; r++) lz[r] = sinks[r % NQH];
        assert_int_equal(pkv_attn_merge(n * NQH, D, o0, l0, zero, lz, om, lm), PKV_OK);
        for (size_t j = 0; j < (size_t)n * NQH * D; j++) assert_true(fabs(o1[j] - om[j]) <= TOL * vm);
        for (uint32_t r = 0; r < n * NQH; r++) assert_true(fabsf(l1[r] - lm[r]) <= 1e-5f * fmaxf(1.0f, fabsf(lm[r])));
        if (!prefill) /* and against the reference, which counts the sink itself */
            for (int i = 0; i < 3; i++)
                check(&s[i], 1, q + i * NQH * D, o1 + i * NQH * D, l1 + i * NQH, s[i].len - 1, 1, &p);
        /* refusals: out keeps what it held */
        const float bad[3] = {NAN, INFINITY, -INFINITY};
        const run_ctx x = {c, prefill, ids, reqs};
        array_refusals(&x, q, (size_t)NR * NQH * D, (size_t)n * NQH * D, &p, &p.sinks, sinks, bad, 3, o0, o1, l1);
#undef RUN
    }
    free(q), free(o0), free(o1), free(om), free(zero);
    pkv_cache_destroy(c);
}

/* ALiBi (pkv_attn_params.alibi_slopes) through the public calls, decode (tables that jump: the
 * pool-order sweep) and prefill, f16:
 * - slopes of 0 give the same bits as none;
 * - slopes of PKV_ALIBI_SLOPE_MAX leave each query its own key alone (every other is at least
 *   65,536 below): out = V[p] exactly, as with a window of 1, and lse its own logit;
 * - a slope that is NaN, infinite or past PKV_ALIBI_SLOPE_MAX, or slopes overlapping out or lse,
 *   is PKV_EINVAL with out untouched; overlapping q is allowed where out is not q. */
static void test_api_alibi(void **state) {
    (void)state;
    static host_seq s[3];
    pkv_cache *c = jumping_seqs(s);
    const pkv_seq ids[3] = {s[0].id, s[1].id, s[2].id};
    const pkv_attn_req reqs[2] = {{s[2].id, 100, 40}, {s[0].id, 0, 30}};
    enum { NR = 70 }; /* queries: 3 decodes, or 70 prefill rows */
    float *q = rand_q(NR), *o0 = malloc(sizeof(float) * NR * NQH * D), *o1 = malloc(sizeof(float) * NR * NQH * D);
    float l0[NR * NQH], l1[NR * NQH], slopes[NQH];
    for (int prefill = 0; prefill < 2; prefill++) {
        const uint32_t n = prefill ? NR : 3;
#define RUN(out, pp) (prefill ? pkv_attn_prefill(c, 1, reqs, 2, q, out, pp) : pkv_attn_decode(c, 1, ids, 3, q, out, pp))
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH, p.lse = l0;
        assert_int_equal(RUN(o0, &p), PKV_OK);
        for (uint32_t h = 0; h < NQH; h++) slopes[h] = 0.0f;
        p.alibi_slopes = slopes, p.lse = l1;
        assert_int_equal(RUN(o1, &p), PKV_OK);
        assert_memory_equal(o0, o1, sizeof(float) * n * NQH * D);
        assert_memory_equal(l0, l1, sizeof(float) * n * NQH);
        p.alibi_slopes = NULL, p.window = 1, p.lse = l0;
        assert_int_equal(RUN(o0, &p), PKV_OK);
        for (uint32_t h = 0; h < NQH; h++) slopes[h] = PKV_ALIBI_SLOPE_MAX;
        p.alibi_slopes = slopes, p.window = 0, p.lse = l1;
        assert_int_equal(RUN(o1, &p), PKV_OK);
        /* out: V[p] exactly (weights 1 and 0), as window 1 gives; lse: the own logit, which a
           window's one-key score tile sums in another order than the whole block's */
        for (uint32_t r = 0; r < n; r++) {
            const host_seq *sr = prefill ? &s[r < 40 ? 2 : 0] : &s[r];
            const uint32_t pos = prefill ? (r < 40 ? 100 + r : r - 40) : sr->len - 1;
            for (uint32_t hq = 0; hq < NQH; hq++) {
                for (uint32_t d = 0; d < D; d++) {
                    const float v = sr->v[1][pos][hq / (NQH / H)][d];
                    assert_true(o1[((size_t)r * NQH + hq) * D + d] == v);
                    assert_true(o0[((size_t)r * NQH + hq) * D + d] == v);
                }
                const float a = l0[r * NQH + hq], b = l1[r * NQH + hq];
                assert_true(fabsf(a - b) <= 1e-6f * fmaxf(1.0f, fabsf(a)));
            }
        }
        /* refusals: out keeps what it held; then these slopes against the reference */
        for (uint32_t h = 0; h < NQH; h++) slopes[h] = powf(2.0f, -(float)(h + 1));
        const float bad[4] = {NAN, INFINITY, -INFINITY, -1.5f * PKV_ALIBI_SLOPE_MAX};
        const run_ctx x = {c, prefill, ids, reqs};
        array_refusals(&x, q, (size_t)NR * NQH * D, (size_t)n * NQH * D, &p, &p.alibi_slopes, slopes, bad, 4, o0, o1,
                       l1);
        p.lse = NULL;
        assert_int_equal(RUN(o0, &p), PKV_OK);
        if (!prefill)
            for (int i = 0; i < 3; i++) check(&s[i], 1, q + i * NQH * D, o0 + i * NQH * D, NULL, s[i].len - 1, 1, &p);
#undef RUN
    }
    free(q), free(o0), free(o1);
    pkv_cache_destroy(c);
}

/* Set while the tree's K is q8_0: the prefix part's kernels score int8 queries (attn_q_ref.c,
 * pkv__attn_prep_q8), which ref_tree then takes too, so the reference is theirs up to float
 * rounding (the paths score the f32 queries). */
static bool g_tree_q8;

/* Query row x (D values, the scale applied) as the q8_0 score takes it: per 32 values amax / 127
 * times the nearest integer (ties to even) of x x 127 / amax, in float as prep_q8 computes it. */
static void q8_query(const float *x, float *y) {
    for (uint32_t b = 0; b < D / 32; b++) {
        float amax = 0.0f;
        for (uint32_t j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        /* each step stored as a float (volatile), as the kernels store it, where float math keeps
           excess precision (x87: the 32-bit stage) */
        const volatile float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (uint32_t j = 0; j < 32; j++) {
            const volatile float xq = x[32 * b + j] * id;
            y[32 * b + j] = nearbyintf(xq) * d;
        }
    }
}

/* PKV_ATTN_NONCAUSAL: 48 queries over 250 positions, cross-attention (40 queries over a 5-token
 * sequence, more queries than positions) and two requests of 3 and 4 queries over one sequence of
 * 48 positions, with an empty request, in one call, each query against the reference of
 * one at the sequence's last position; plain, with soft-cap and lse, with sinks; every float
 * dtype and the 8-bit ones, 1 and 2 threads (nt_first); in place the same bits as apart. Decode takes the
 * flag and gives the same bits. Refusals (a window, chunks or ALiBi with it, q_start past 0, queries
 * over an empty sequence, a tree, an unknown flag, more queries than a sequence may hold) leave
 * out untouched. */
static void test_api_noncausal(void **state) {
    (void)state;
    static host_seq s[4];
    for (size_t ti = 0; ti < 5; ti++)
        for (uint32_t nt = nt_first(); nt <= 2; nt++) {
            g_rng = 900u + 2u * ti + nt; /* each case its own draws: nt_first() */
            const pkv_dtype dt = q_types[ti];
            pkv_cache *c = make_cache(dt, nt, 0);
            pkv__cache_test_share(c, 1, 0); /* groups of any whole block, where they were allowed */
            static const uint32_t lens[4] = {48, 5, 250, 0};
            for (int i = 0; i < 4; i++) seq_new(c, dt, &s[i], lens[i], 100 * i);
            /* (two requests over sequence 0, within the scratch's rows: not grouped as a shared
               prefix, whose members' own parts would hold no key) */
            const pkv_attn_req reqs[5] = {{s[2].id, 0, 48}, {s[1].id, 0, 40}, {s[0].id, 0, 0}, {s[0].id, 0, 3},
                                          {s[0].id, 0, 4}};
            const host_seq *who[5] = {&s[2], &s[1], &s[0], &s[0], &s[0]};
            const uint32_t nq = 48 + 40 + 3 + 4;
            float *q = rand_q(nq), *out = malloc(sizeof(float) * nq * NQH * D), lse[95 * NQH], sinks[NQH];
            float *o2 = malloc(sizeof(float) * nq * NQH * D);
            for (uint32_t h = 0; h < NQH; h++) sinks[h] = 4.0f * rnd() + 1.0f;
            for (int variant = 0; variant < 3; variant++) {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH, p.flags = PKV_ATTN_NONCAUSAL;
                if (variant == 1) p.softcap = 6.0f, p.scale = 0.3f, p.lse = lse;
                if (variant == 2) p.sinks = sinks, p.lse = lse;
                assert_int_equal(pkv_attn_prefill(c, variant % L, reqs, 5, q, out, &p), PKV_OK);
                for (uint32_t j = 0, at = 0; j < 5; at += reqs[j].n_q, j++)
                    for (uint32_t i = 0; i < reqs[j].n_q; i++) /* every query as the last position's */
                        check_tol(who[j], variant % L, q + (size_t)(at + i) * NQH * D, out + (size_t)(at + i) * NQH * D,
                                  p.lse ? lse + (at + i) * NQH : NULL, who[j]->len - 1, 1, &p, tol_of(dt));
                /* in place: the same bits */
                memcpy(o2, q, sizeof(float) * nq * NQH * D);
                assert_int_equal(pkv_attn_prefill(c, variant % L, reqs, 5, o2, o2, &p), PKV_OK);
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
            }
            /* decode: the flag changes nothing */
            const pkv_seq ids[3] = {s[0].id, s[1].id, s[2].id};
            pkv_attn_params p = pkv_attn_params_default();
            p.n_q_heads = NQH;
            assert_int_equal(pkv_attn_decode(c, 0, ids, 3, q, out, &p), PKV_OK);
            p.flags = PKV_ATTN_NONCAUSAL;
            assert_int_equal(pkv_attn_decode(c, 0, ids, 3, q, o2, &p), PKV_OK);
            assert_memory_equal(o2, out, sizeof(float) * 3 * NQH * D);
            /* refusals, out untouched */
            float slopes[NQH];
            for (uint32_t h = 0; h < NQH; h++) slopes[h] = 0.1f;
            memset(out, 0x5a, sizeof(float) * nq * NQH * D);
            memcpy(o2, out, sizeof(float) * nq * NQH * D);
            for (int bad = 0; bad < 8; bad++) {
                pkv_attn_params pb = pkv_attn_params_default();
                pb.n_q_heads = NQH, pb.flags = PKV_ATTN_NONCAUSAL;
                pkv_attn_req rb[5];
                memcpy(rb, reqs, sizeof rb);
                if (bad == 0) pb.window = 8;
                if (bad == 1) pb.attn_chunk = 16;
                if (bad == 2) pb.alibi_slopes = slopes;
                if (bad == 3) rb[3].q_start = 1;
                if (bad == 4) rb[1].seq = s[3].id; /* empty */
                if (bad == 5) pb.flags |= 8u;
                if (bad == 7) rb[1].n_q = 0x7fffffffu; /* past what a sequence may hold (checked first) */
                if (bad == 6) {
                    const int32_t par[2] = {-1, 0};
                    const pkv_attn_tree_req tr = {s[0].id, 30, 2, par};
                    assert_int_equal(pkv_attn_tree(c, 0, &tr, 1, q, out, &pb), PKV_EINVAL);
                } else
                    assert_int_equal(pkv_attn_prefill(c, 0, rb, 5, q, out, &pb), PKV_EINVAL);
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
            }
            free(q), free(out), free(o2);
            pkv_cache_destroy(c);
        }
}

/* The reference of pkv_attn_tree for node i of a tree at [q_start, ..) of s: nqh query heads (GQA
 * over H), keys the prefix positions and the node's path, window and chunk counted from q_start +
 * depth. */
static void ref_tree(const host_seq *s, uint32_t l, const float *q, uint32_t nqh, uint32_t q_start,
                     const int32_t *parent, uint32_t i, const pkv_attn_params *p, double *out, double *lse) {
    const double scale = p->scale > 0 ? p->scale : 1.0 / sqrt((double)D);
    const float fscale = p->scale > 0 ? p->scale : 1.0f / sqrtf((float)D); /* as the library resolves it */
    uint32_t depth[MAXTOK], keys[MAXTOK], kpos[MAXTOK], n = 0; /* a key's row, its position in the text */
    for (uint32_t j = 0; j <= i; j++) depth[j] = parent[j] < 0 ? 0 : depth[parent[j]] + 1;
    const uint32_t pos = q_start + depth[i], lo = ref_key_lo(p, pos); /* a node's, from its position */
    for (uint32_t t = lo; t < q_start; t++) kpos[n] = t, keys[n++] = t;
    for (int32_t j = (int32_t)i; j >= 0; j = parent[j])
        if (q_start + depth[j] >= lo) kpos[n] = q_start + depth[j], keys[n++] = q_start + (uint32_t)j;
    for (uint32_t hq = 0; hq < nqh; hq++) {
        const uint32_t h = hq / (nqh / H);
        double w[MAXTOK], mx = p->sinks ? p->sinks[hq] : -INFINITY, sum = 0;
        float xs[D], xq[D]; /* the row times the scale, and that quantized (g_tree_q8) */
        for (uint32_t d = 0; d < D; d++) xs[d] = q[(size_t)hq * D + d] * fscale;
        q8_query(xs, xq);
        for (uint32_t k = 0; k < n; k++) {
            double x;
            if (g_tree_q8 && keys[k] < q_start) /* the prefix part: int8 queries, the scale in them */
                x = tu_dot(xq, s->k[l][keys[k]][h], D);
            else
                x = tu_dot(q + (size_t)hq * D, s->k[l][keys[k]][h], D) * scale;
            if (p->softcap > 0) x = p->softcap * tanh(x / p->softcap);
            if (p->alibi_slopes) x += (double)p->alibi_slopes[hq] * ((double)kpos[k] - (double)pos);
            w[k] = x;
            mx = fmax(mx, x);
        }
        if (p->sinks) sum = exp(p->sinks[hq] - mx);
        for (uint32_t k = 0; k < n; k++) sum += (w[k] = exp(w[k] - mx));
        double *o = out + (size_t)hq * D;
        for (uint32_t d = 0; d < D; d++) o[d] = 0;
        for (uint32_t k = 0; k < n; k++)
            for (uint32_t d = 0; d < D; d++) o[d] += w[k] * s->v[l][keys[k]][h][d];
        for (uint32_t d = 0; d < D; d++) o[d] /= sum;
        if (lse) lse[hq] = mx + log(sum);
    }
}

/* The largest error check_tree has seen since it was last reset, in units of its tolerance. */
static double g_tree_worst;

/* Checks a tree call's n nodes (queries q, out, lse at the request's rows) against ref_tree. */
static void check_tree(const host_seq *s, uint32_t l, const float *q, const float *out, const float *lse,
                       uint32_t nqh, uint32_t q_start, const int32_t *parent, uint32_t n, const pkv_attn_params *p,
                       double tol) {
    double *ro = malloc(sizeof(double) * nqh * D), *rl = malloc(sizeof(double) * nqh);
    const double vm = vmax_of(s, l);
    for (uint32_t i = 0; i < n; i++) {
        ref_tree(s, l, q + (size_t)i * nqh * D, nqh, q_start, parent, i, p, ro, rl);
        for (uint32_t j = 0; j < nqh * D; j++) {
            const double e = fabs(out[(size_t)i * nqh * D + j] - ro[j]);
            g_tree_worst = fmax(g_tree_worst, e / (tol * vm));
            if (!(e <= tol * vm))
                fail_msg("node %u of %u (q_start %u) row %u: %.9g, reference %.9g", i, n, q_start, j,
                         (double)out[(size_t)i * nqh * D + j], ro[j]);
        }
        if (lse)
            for (uint32_t h = 0; h < nqh; h++) {
                g_tree_worst = fmax(g_tree_worst, fabs(lse[(size_t)i * nqh + h] - rl[h]) / (tol * fmax(1.0, fabs(rl[h]))));
                if (!(fabs(lse[(size_t)i * nqh + h] - rl[h]) <= tol * fmax(1.0, fabs(rl[h]))))
                    fail_msg("node %u head %u lse %.9g, reference %.9g", i, h, (double)lse[(size_t)i * nqh + h], rl[h]);
            }
    }
    free(ro), free(rl);
}

/* A random tree of n nodes: mostly chains with branches, a root now and then. */
static void rand_tree(int32_t *parent, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        const float u = 0.5f * (rnd() + 1.0f); /* [0, 1) */
        parent[i] = i == 0 || u < 0.1f ? -1 : u < 0.6f ? (int32_t)i - 1 : (int32_t)((uint32_t)(u * 977.0f) % i);
    }
}

/* pkv_attn_tree against the reference: every float dtype, fp8 and q8_0 (K/V dequantized in the
 * reference; fp8 K keeps f32 queries, so the float tolerance holds; q8_0 K scores int8 queries
 * in the prefix part, which the reference quantizes as the kernels do (q8_query), so 1e-4 holds
 * there too: errors of about 1e-6 seen, where an unquantized reference needed 2e-2 and once saw
 * 0.0216), 1 and 2 threads (nt_first), prefixes of 0 to 150
 * tokens (a block boundary inside the tree), trees of 1 to 60 nodes, two requests and an empty
 * one in a call, with window (shorter and longer than the paths), soft-cap, sinks, ALiBi (its
 * distances by depth), chunks of local attention (edges in the prefix and among the nodes) and
 * lse; a chain gives what prefill gives. */
static void test_api_tree(void **state) {
    (void)state;
    static host_seq s[2];
    static const uint32_t prefixes[] = {0, 1, 37, 150}, sizes[] = {1, 7, 60};
    for (size_t ti = 0; ti < 5; ti++) {
        g_tree_worst = 0;
        for (uint32_t nt = nt_first(); nt <= 2; nt++) {
            g_rng = 770u + 2u * ti + nt; /* each case its own draws: nt_first() */
            const pkv_dtype dt = q_types[ti];
            const double tol = dt == PKV_DTYPE_Q8_0 ? 1e-4 : TOL;
            g_tree_q8 = dt == PKV_DTYPE_Q8_0;
            for (size_t pi = 0; pi < 4; pi++) {
                pkv_cache *c = make_cache(dt, nt, 0);
                int32_t par[2][64];
                uint32_t n[2], q0[2];
                for (int i = 0; i < 2; i++) {
                    memset(&s[i], 0, sizeof s[i]);
                    assert_int_equal(pkv_seq_create(c, NULL, 0, &s[i].id), PKV_OK);
                    q0[i] = prefixes[(pi + (uint32_t)i) % 4];
                    n[i] = sizes[(pi + ti + (uint32_t)i) % 3];
                    if (q0[i]) append_write(c, dt, &s[i], q0[i], 100 * i);
                    append_write(c, dt, &s[i], n[i] + 3, 7000 + 100 * i); /* the nodes, then 3 more */
                    rand_tree(par[i], n[i]);
                }
                const pkv_attn_tree_req reqs[3] = {{s[0].id, q0[0], n[0], par[0]}, {s[1].id, 0, 0, NULL},
                                                   {s[1].id, q0[1], n[1], par[1]}};
                const uint32_t rows = n[0] + n[1];
                float *q = rand_q(rows), *out = malloc(sizeof(float) * rows * NQH * D), lse[128 * NQH], sinks[NQH];
                for (uint32_t h = 0; h < NQH; h++) sinks[h] = 2.0f * rnd() + 1.0f;
                float slopes[NQH]; /* steep and shallow: the path's depths and the prefix both weigh */
                for (uint32_t h = 0; h < NQH; h++) slopes[h] = h % 2 ? 0.4f + 0.1f * (float)h : 0.005f * (float)(h + 1);
                for (int variant = 0; variant < 9; variant++) {
                    pkv_attn_params p = pkv_attn_params_default();
                    p.n_q_heads = NQH;
                    if (variant != 1) p.lse = lse;
                    if (variant == 2) p.window = 5;
                    if (variant == 3) p.window = 60, p.softcap = 6.0f, p.scale = 0.3f;
                    if (variant == 4) p.sinks = sinks, p.window = 40;
                    if (variant == 5) p.alibi_slopes = slopes, p.sinks = sinks;
                    if (variant == 6) p.alibi_slopes = slopes, p.window = 9, p.softcap = 6.0f;
                    if (variant == 7) p.attn_chunk = 32;
                    if (variant == 8) p.attn_chunk = 7, p.window = 5, p.alibi_slopes = slopes, p.sinks = sinks;
                    assert_int_equal(pkv_attn_tree(c, 1, reqs, 3, q, out, &p), PKV_OK);
                    check_tree(&s[0], 1, q, out, p.lse, NQH, q0[0], par[0], n[0], &p, tol);
                    check_tree(&s[1], 1, q + (size_t)n[0] * NQH * D, out + (size_t)n[0] * NQH * D,
                               p.lse ? lse + n[0] * NQH : NULL, NQH, q0[1], par[1], n[1], &p, tol);
                }
                /* a chain is what prefill computes over the same positions */
                int32_t chain[64];
                for (uint32_t i = 0; i < n[0]; i++) chain[i] = (int32_t)i - 1;
                const pkv_attn_tree_req cr = {s[0].id, q0[0], n[0], chain};
                const pkv_attn_req pr = {s[0].id, q0[0], n[0]};
                pkv_attn_params pc = pkv_attn_params_default();
                pc.n_q_heads = NQH;
                float *o2 = malloc(sizeof(float) * rows * NQH * D);
                assert_int_equal(pkv_attn_tree(c, 0, &cr, 1, q, out, &pc), PKV_OK);
                assert_int_equal(pkv_attn_prefill(c, 0, &pr, 1, q, o2, &pc), PKV_OK);
                const double vm = vmax_of(&s[0], 0);
                /* (q8_0: prefill scores every key with int8 queries, the tree its paths with f32 ones) */
                for (size_t j = 0; j < (size_t)n[0] * NQH * D; j++)
                    assert_true(fabs(out[j] - o2[j]) <= tol_of(dt) * vm);
                free(o2);
                pkv_cache_destroy(c);
                free(q), free(out);
            }
        }
        print_message("  tree %s: max err %.3g of the tolerance\n", pkv_dtype_name(q_types[ti]), g_tree_worst);
    }
    g_tree_q8 = false;
}

/* pkv_attn_tree's runs and refusals: with 1024 query heads a kv head a run holds 2 nodes (4096
 * log-sum-exps), so a tree of 7 takes 4 runs, which give the reference; every refusal writes
 * nothing. */
static void test_api_tree_refusals_runs(void **state) {
    (void)state;
    static host_seq s;
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    seq_new(c, PKV_DTYPE_F16, &s, 40, 0);
    const int32_t par[7] = {-1, 0, 0, 1, -1, 4, 2};
    enum { BIG = 2048 }; /* 1024 x H query heads */
    float *q = malloc(sizeof(float) * 7 * BIG * D), *out = malloc(sizeof(float) * 7 * BIG * D);
    float *lse = malloc(sizeof(float) * 7 * BIG);
    for (size_t i = 0; i < (size_t)7 * BIG * D; i++) q[i] = rnd();
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = BIG, p.lse = lse;
    pkv_attn_tree_req r = {s.id, 33, 7, par};
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_OK);
    check_tree(&s, 0, q, out, lse, BIG, 33, par, 7, &p, TOL);
    p.window = 3;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_OK);
    check_tree(&s, 0, q, out, lse, BIG, 33, par, 7, &p, TOL);
    /* chunks of 35: nodes at 33 and 34 see the whole prefix, those at 35 and 36 none of it */
    p.window = 0, p.attn_chunk = 35;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_OK);
    check_tree(&s, 0, q, out, lse, BIG, 33, par, 7, &p, TOL);
    /* refusals */
    p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    memset(out, 0x5a, sizeof(float) * 7 * NQH * D);
    float *before = malloc(sizeof(float) * 7 * NQH * D);
    memcpy(before, out, sizeof(float) * 7 * NQH * D);
    int32_t bad[7];
    memcpy(bad, par, sizeof bad);
    bad[3] = 3; /* itself */
    r.parent = bad;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    bad[3] = 5; /* a later node */
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    bad[3] = -2;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    r.parent = NULL;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    r.parent = par, r.q_start = 34; /* past the length */
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    r.q_start = 33, r.n_nodes = PKV_TREE_MAX_NODES + 1;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    r.n_nodes = 7;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, q, &p), PKV_EINVAL);   /* out may not be q */
    assert_int_equal(pkv_attn_tree(c, 2, &r, 1, q, out, &p), PKV_EINVAL); /* layer */
    assert_int_equal(pkv_attn_tree(c, 0, NULL, 1, q, out, &p), PKV_EINVAL);
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, NULL, out, &p), PKV_EINVAL);
    const float nan_sinks[NQH] = {0, 0, 0, NAN, 0, 0, 0, 0};
    p.sinks = nan_sinks;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    p.sinks = NULL;
    const float keep = q[5];
    q[5] = INFINITY;
    assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_EINVAL);
    q[5] = keep;
    pkv_attn_tree_req two[2] = {r, r};
    assert_int_equal(pkv_seq_release(c, s.id), PKV_OK); /* stale */
    assert_int_equal(pkv_attn_tree(c, 0, two, 2, q, out, &p), PKV_ENOENT);
    assert_memory_equal(before, out, sizeof(float) * 7 * NQH * D);
    assert_int_equal(pkv_attn_tree(c, 0, two, 0, q, out, &p), PKV_OK); /* nothing to do */
    assert_int_equal(pkv_attn_tree(NULL, 0, two, 0, q, out, &p), PKV_EINVAL);
    free(before), free(q), free(out), free(lse);
    pkv_cache_destroy(c);
}

/* The check of every invariant, as a test assertion. */
static void cache_ok(pkv_cache *c) {
    char msg[256];
    if (pkv_cache_check(c, msg, sizeof msg) != PKV_OK) fail_msg("pkv_cache_check: %s", msg);
}

/* Speculative decoding end to end: a prefix, a tree of drafts verified by pkv_attn_tree, the
 * accepted path kept by pkv_seq_keep (K/V and token ids moved down, the rest dropped), then
 * committed. After it the sequence reads as one written with the path directly: gather, decode
 * against the reference, and the prefix index matching the path's tokens. Refusals first, each
 * changing nothing. */
static void test_api_tree_keep(void **state) {
    (void)state;
    static host_seq s, h2;
    for (size_t ti = 0; ti < 2; ti++) {
        const pkv_dtype dt = k_types[ti + 1];
        pkv_cache *c = make_cache(dt, 2, 1);
        seq_new(c, dt, &s, 30, 0);
        assert_int_equal(pkv_seq_commit(c, s.id, 30), PKV_OK);
        append_write(c, dt, &s, 12, 5000); /* the tree: positions 30 .. 41, tokens 5030 .. 5041 */
        static const int32_t par[12] = {-1, 0, 0, 1, 2, 3, 3, 5, 4, -1, 7, 9};
        const pkv_attn_tree_req r = {s.id, 30, 12, par};
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH;
        float *q = rand_q(12), *out = malloc(sizeof(float) * 12 * NQH * D);
        assert_int_equal(pkv_attn_tree(c, 0, &r, 1, q, out, &p), PKV_OK);
        check_tree(&s, 0, q, out, NULL, NQH, 30, par, 12, &p, TOL);
        /* node 10's path: 10 <- 7 <- 5 <- 3 <- 1 <- 0, ascending */
        const uint32_t path[6] = {0, 1, 3, 5, 7, 10};
        float *k0 = malloc(sizeof(float) * 42 * H * D), *v0 = malloc(sizeof(float) * 42 * H * D);
        float *k1 = malloc(sizeof(float) * 42 * H * D), *v1 = malloc(sizeof(float) * 42 * H * D);
        assert_int_equal(pkv_seq_gather(c, s.id, 1, 0, 42, k0, v0), PKV_OK);
        const uint32_t bad_up[3] = {0, 3, 3}, bad_past[2] = {1, 12};
        assert_int_equal(pkv_seq_keep(c, s.id, 30, bad_up, 3), PKV_EINVAL);  /* not ascending */
        assert_int_equal(pkv_seq_keep(c, s.id, 30, bad_past, 2), PKV_EINVAL); /* past the length */
        assert_int_equal(pkv_seq_keep(c, s.id, 29, path, 6), PKV_EINVAL);     /* a committed position */
        assert_int_equal(pkv_seq_keep(c, s.id, 30, NULL, 6), PKV_EINVAL);
        pkv_seq f;
        assert_int_equal(pkv_seq_fork(c, s.id, &f), PKV_OK); /* the tree's blocks shared: read-only */
        assert_int_equal(pkv_seq_keep(c, s.id, 30, path, 6), PKV_EINVAL);
        assert_int_equal(pkv_seq_release(c, f), PKV_OK);
        assert_int_equal(pkv_seq_keep(c, f, 30, path, 6), PKV_ENOENT);
        pkv_seq_info info;
        assert_int_equal(pkv_seq_get_info(c, s.id, &info), PKV_OK);
        assert_int_equal(info.n_tokens, 42);
        assert_int_equal(pkv_seq_gather(c, s.id, 1, 0, 42, k1, v1), PKV_OK);
        assert_memory_equal(k0, k1, sizeof(float) * 42 * H * D);
        assert_memory_equal(v0, v1, sizeof(float) * 42 * H * D);
        cache_ok(c);
        /* keep the path */
        assert_int_equal(pkv_seq_keep(c, s.id, 30, path, 6), PKV_OK);
        cache_ok(c);
        assert_int_equal(pkv_seq_get_info(c, s.id, &info), PKV_OK);
        assert_int_equal(info.n_tokens, 36);
        assert_int_equal(info.n_committed, 30);
        for (uint32_t l = 0; l < L; l++) {
            assert_int_equal(pkv_seq_gather(c, s.id, l, 0, 36, k1, v1), PKV_OK);
            for (uint32_t i = 0; i < 6; i++) { /* the host copy follows */
                memcpy(s.k[l][30 + i], s.k[l][30 + path[i]], sizeof s.k[l][0]);
                memcpy(s.v[l][30 + i], s.v[l][30 + path[i]], sizeof s.v[l][0]);
            }
            assert_memory_equal(k1, s.k[l], sizeof(float) * 36 * H * D);
            assert_memory_equal(v1, s.v[l], sizeof(float) * 36 * H * D);
        }
        s.len = 36;
        float *qd = rand_q(1), *od = malloc(sizeof(float) * NQH * D);
        assert_int_equal(pkv_attn_decode(c, 1, &s.id, 1, qd, od, &p), PKV_OK);
        check(&s, 1, qd, od, NULL, 35, 1, &p);
        /* the kept token ids: committed, a new sequence of the same tokens reuses every full block */
        append_write(c, dt, &s, 12, 6000); /* on to 48: three full blocks */
        assert_int_equal(pkv_seq_commit(c, s.id, 48), PKV_OK);
        int32_t toks[48];
        for (uint32_t i = 0; i < 48; i++)
            toks[i] = i < 30 ? (int32_t)i : i < 36 ? 5000 + 30 + (int32_t)path[i - 30] : 6000 + (int32_t)i;
        memset(&h2, 0, sizeof h2);
        assert_int_equal(pkv_seq_create(c, NULL, 0, &h2.id), PKV_OK);
        uint32_t reused = 0;
        assert_int_equal(pkv_seq_match_prefix(c, h2.id, toks, 48, &reused), PKV_OK);
        assert_int_equal(reused, 47); /* all but the last token, which the engine computes */
        toks[33] ^= 1;                 /* one kept token different: the reuse stops there */
        pkv_seq h3;
        assert_int_equal(pkv_seq_create(c, NULL, 0, &h3), PKV_OK);
        assert_int_equal(pkv_seq_match_prefix(c, h3, toks, 48, &reused), PKV_OK);
        assert_int_equal(reused, 33);
        /* n 0 truncates to start; a start past the length is refused */
        int32_t slots[2];
        assert_int_equal(pkv_seq_append(c, h3, toks + 33, 2, slots), PKV_OK);
        assert_int_equal(pkv_seq_keep(c, h3, 36, NULL, 0), PKV_EINVAL);
        assert_int_equal(pkv_seq_keep(c, h3, 33, NULL, 0), PKV_OK);
        assert_int_equal(pkv_seq_get_info(c, h3, &info), PKV_OK);
        assert_int_equal(info.n_tokens, 33);
        cache_ok(c);
        free(q), free(out), free(qd), free(od), free(k0), free(v0), free(k1), free(v1);
        pkv_cache_destroy(c);
    }
}

/* out may be q (in place): every query's output overwrites only its own query, read before.
 * Decode (a repeated sequence, a batch past max_seqs run in groups) and ragged prefill, table and
 * pool order, 1 and 2 threads, with LSE: the same bits as into a buffer of their own. */
static void test_api_in_place(void **state) {
    (void)state;
    static host_seq s[4];
    static const char *orders[] = {"table", "pool"};
    for (int oi = 0; oi < 2; oi++)
        for (uint32_t nt = 1; nt <= 2; nt++) {
            setenv("PKV_ATTN_ORDER", orders[oi], 1);
            pkv_cache *c = make_cache(PKV_DTYPE_F16, nt, 0);
            unsetenv("PKV_ATTN_ORDER");
            const uint32_t lens[4] = {1, 70, 333, 150};
            for (int i = 0; i < 4; i++) {
                seq_new(c, PKV_DTYPE_F16, &s[i], lens[i], 1000 * i);
            }
            enum { NB = 20 }; /* > max_seqs (16): two groups */
            pkv_seq ids[NB];
            for (int i = 0; i < NB; i++) ids[i] = s[(i * 3) % 4].id;
            pkv_attn_req reqs[4] = {{s[0].id, 0, 1}, {s[1].id, 20, 50}, {s[2].id, 332, 1}, {s[3].id, 100, 37}};
            enum { NQ_PF = 1 + 50 + 1 + 37 }; /* the prefill's queries, more than NB */
            const uint32_t nq[2] = {NB, NQ_PF};
            for (int pf = 0; pf < 2; pf++) {
                const size_t n = (size_t)nq[pf] * NQH * D;
                float *q = rand_q(nq[pf]), *out = malloc(sizeof(float) * n), *buf = malloc(sizeof(float) * n);
                float lse[NQ_PF * NQH], lse2[NQ_PF * NQH];
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                p.lse = lse;
                memcpy(buf, q, sizeof(float) * n);
                if (pf) {
                    assert_int_equal(pkv_attn_prefill(c, 1, reqs, 4, q, out, &p), PKV_OK);
                    p.lse = lse2;
                    assert_int_equal(pkv_attn_prefill(c, 1, reqs, 4, buf, buf, &p), PKV_OK);
                } else {
                    assert_int_equal(pkv_attn_decode(c, 1, ids, NB, q, out, &p), PKV_OK);
                    p.lse = lse2;
                    assert_int_equal(pkv_attn_decode(c, 1, ids, NB, buf, buf, &p), PKV_OK);
                }
                assert_memory_equal(buf, out, sizeof(float) * n);
                assert_memory_equal(lse2, lse, sizeof(float) * nq[pf] * NQH);
                free(q), free(out), free(buf);
            }
            pkv_cache_destroy(c);
        }
}

/* pkv_attn_merge on values worked out by hand, parts over no keys, and bad input (nothing
 * written on any error). */
static void test_api_merge_values(void **state) {
    (void)state;
    enum { R = 6, DM = 3 };
    const float nan = NAN;
    /* row 0: weights 1 and 3 (lse 0 and log 3); row 1: equal weights; row 2: b over no keys, its
     * values NaN and not read; row 3: a over no keys; row 4: both; row 5: b 300 e-folds below a,
     * so its weight rounds to 0 in float */
    const float oa[R][DM] = {{1, 2, -4}, {1, 2, 3}, {5, 6, 7}, {nan, nan, nan}, {nan, 1, 2}, {-1, 0.5f, 8}};
    const float ob[R][DM] = {{3, 4, 8}, {3, -2, 5}, {nan, nan, nan}, {9, 8, 7}, {3, nan, 4}, {100, 100, 100}};
    const float la[R] = {0, 1.5f, 2, -INFINITY, -INFINITY, 10}, lb[R] = {logf(3), 1.5f, -INFINITY, -7, -INFINITY, -290};
    float out[R][DM], lse[R];
    assert_int_equal(pkv_attn_merge(R, DM, &oa[0][0], la, &ob[0][0], lb, &out[0][0], lse), PKV_OK);
    const float want0[DM] = {2.5f, 3.5f, 5.0f}, want1[DM] = {2, 0, 4};
    for (int d = 0; d < DM; d++) {
        TU_NEAR(out[0][d], want0[d], 1e-6);
        TU_NEAR(out[1][d], want1[d], 1e-6);
        assert_true(out[2][d] == oa[2][d] && out[3][d] == ob[3][d] && out[4][d] == 0.0f && out[5][d] == oa[5][d]);
    }
    TU_NEAR(lse[0], logf(4), 1e-6);
    TU_NEAR(lse[1], 1.5f + logf(2), 1e-6);
    assert_true(lse[2] == 2.0f && lse[3] == -7.0f && lse[4] == -INFINITY && lse[5] == 10.0f);

    /* bad input: a status, and out / lse untouched */
    float o2[R][DM], l2[R];
    for (int r = 0; r < R; r++) {
        l2[r] = 42.0f;
        for (int d = 0; d < DM; d++) o2[r][d] = 42.0f;
    }
    const float *a0 = &oa[0][0], *b0 = &ob[0][0];
    float *w = &o2[0][0];
    float la_bad[R], lb_bad[R];
    memcpy(la_bad, la, sizeof la), memcpy(lb_bad, lb, sizeof lb);
    la_bad[R - 1] = nan; /* the last row: found before the first is written */
    assert_int_equal(pkv_attn_merge(R, DM, a0, la_bad, b0, lb, w, l2), PKV_EINVAL);
    lb_bad[R - 1] = INFINITY;
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, b0, lb_bad, w, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, 0, a0, la, b0, lb, w, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, NULL, la, b0, lb, w, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, NULL, b0, lb, w, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, NULL, lb, w, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, b0, NULL, w, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, b0, lb, NULL, l2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(UINT32_MAX, UINT32_MAX, a0, la, b0, lb, w, l2), PKV_EINVAL); /* bytes overflow */
    /* overlaps other than exact aliasing, each alone: out one float into a part, out on a part's
     * lse, lse inside out, a part's out or off by one from a part's lse */
    static float big[2 * R * DM], lbig[R * DM + 2 * R];
    for (int i = 0; i < 2 * R * DM; i++) big[i] = 1.0f;
    for (int i = 0; i < R * DM + 2 * R; i++) lbig[i] = 0.0f;
    assert_int_equal(pkv_attn_merge(R, DM, big, la, b0, lb, big + 1, NULL), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, big, lb, big + 1, NULL), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, lbig, b0, lb, lbig, NULL), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, b0, lbig, lbig, NULL), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, b0, lb, w, w + 2), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, big, la, b0, lb, w, big + 5), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, big, lb, w, big + 5), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, lbig, b0, lb, w, lbig + 1), PKV_EINVAL);
    assert_int_equal(pkv_attn_merge(R, DM, a0, la, b0, lbig, w, lbig + 1), PKV_EINVAL);
    for (int r = 0; r < R; r++) {
        assert_true(l2[r] == 42.0f);
        for (int d = 0; d < DM; d++) assert_true(o2[r][d] == 42.0f);
    }
    for (int i = 0; i < 2 * R * DM; i++) assert_true(big[i] == 1.0f);
    for (int i = 0; i < R * DM + 2 * R; i++) assert_true(lbig[i] == 0.0f);
    /* nothing to merge: no rows, any pointers */
    assert_int_equal(pkv_attn_merge(0, DM, NULL, NULL, NULL, NULL, NULL, NULL), PKV_OK);
    /* a part merged with itself: its own values, lse + log 2 */
    assert_int_equal(pkv_attn_merge(1, DM, a0, la, a0, la, w, l2), PKV_OK);
    for (int d = 0; d < DM; d++) assert_true(o2[0][d] == oa[0][d]);
    TU_NEAR(l2[0], logf(2), 1e-7);
}

/* Every backend name PKV_ATTN_BACKEND takes (those this machine lacks give PKV_ENOTSUP). */
static const char *const g_backends[] = {"ref", "avx2", "avx2-vnni", "avx512", "avx512-vnni", "avx512-amx",
                                         "neon", "neon-dotprod"};

/* PKV_ATTN_BACKEND=name picks the backend by name (each one this CPU has decodes as the oracle
 * says), a name this CPU or build lacks makes pkv_cache_create fail with PKV_ENOTSUP and change
 * nothing (ASan checks that it leaks nothing), and PKV_FORCE_REF=1 wins over it. */
static void test_api_backend_env(void **state) {
    (void)state;
    unsetenv("PKV_ATTN_BACKEND");
    unsetenv("PKV_FORCE_REF");
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    char detected[32];
    strncpy(detected, pkv_attn_backend(c), sizeof detected - 1);
    detected[sizeof detected - 1] = 0;
    pkv_cache_destroy(c);
    pkv_config cfg = api_config(PKV_DTYPE_F16, 2, 0);
    int n_ok = 0, saw_detected = 0;
    for (size_t i = 0; i < sizeof g_backends / sizeof *g_backends; i++) {
        setenv("PKV_ATTN_BACKEND", g_backends[i], 1);
        c = NULL;
        const int rc = pkv_cache_create(&cfg, &c);
        if (rc == PKV_ENOTSUP) {
            assert_null(c);
            continue;
        }
        assert_int_equal(rc, PKV_OK);
        assert_string_equal(pkv_attn_backend(c), g_backends[i]);
        n_ok++, saw_detected |= !strcmp(g_backends[i], detected);
        static host_seq s;
        s.len = 0;
        assert_int_equal(pkv_seq_create(c, NULL, 0, &s.id), PKV_OK);
        append_write(c, cfg.k_dtype, &s, 100, 1);
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH;
        float *q = rand_q(1), out[NQH * D];
        assert_int_equal(pkv_attn_decode(c, 1, &s.id, 1, q, out, &p), PKV_OK);
        check(&s, 1, q, out, NULL, 99, 1, &p);
        free(q);
        pkv_cache_destroy(c);
    }
    assert_true(n_ok >= 1 && saw_detected); /* "ref" and the detected backend at least */
    setenv("PKV_ATTN_BACKEND", "no-such-backend", 1);
    pkv_cache *const untouched = (pkv_cache *)&cfg;
    c = untouched; /* a failed call changes nothing, *out included */
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_ENOTSUP);
    assert_ptr_equal(c, untouched);
    setenv("PKV_FORCE_REF", "1", 1); /* wins over the bad name */
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    assert_string_equal(pkv_attn_backend(c), "ref");
    pkv_cache_destroy(c);
    unsetenv("PKV_FORCE_REF");
    unsetenv("PKV_ATTN_BACKEND");
}

/* Values at PKV_VALUE_MAX, the most pkv_write_kv takes (and |q| x scale the calls take): on
 * every backend, f32 and bf16 pools, with and without the bf16 flag, a call over them returns
 * the exact finite answer. Scores: q x scale = +-2^56 against K = +-2^56 gives +-2^118 (one key
 * at +2^118 takes all the weight: out is its V, 2^56, and lse 2^118). Sums: K = 0 (every
 * weight 1) and V = 2^56 at every one of 40 keys: out 2^56 and lse ln 40, the acc at 40 x 2^56. */
static void test_api_value_max(void **state) {
    (void)state;
    enum { N = 40, HOT = 7 };
    static const pkv_dtype dts[] = {PKV_DTYPE_F32, PKV_DTYPE_BF16};
    const float big = 0x1p56f;
    assert_true((double)big == PKV_VALUE_MAX);
    int ran = 0;
    for (size_t bi = 0; bi < sizeof g_backends / sizeof *g_backends; bi++)
        for (size_t di = 0; di < 2; di++) {
            setenv("PKV_ATTN_BACKEND", g_backends[bi], 1);
            pkv_config cfg = api_config(dts[di], 2, 0);
            pkv_cache *c = NULL;
            const int rc = pkv_cache_create(&cfg, &c);
            if (rc == PKV_ENOTSUP) continue;
            assert_int_equal(rc, PKV_OK);
            for (int sums = 0; sums < 2; sums++) {
                pkv_seq sq;
                int32_t slots[N];
                int32_t tok[N] = {0};
                assert_int_equal(pkv_seq_create(c, NULL, 0, &sq), PKV_OK);
                assert_int_equal(pkv_seq_append(c, sq, tok, N, slots), PKV_OK);
                static float k[N][H][D], v[N][H][D];
                for (int t = 0; t < N; t++)
                    for (int h = 0; h < H; h++)
                        for (int d = 0; d < D; d++) {
                            const float sgn = d % 2 ? -1.0f : 1.0f;
                            k[t][h][d] = sums ? 0.0f : t == HOT ? sgn * big : -sgn * big;
                            v[t][h][d] = sums || t == HOT ? big : 1.0f;
                        }
                for (uint32_t l = 0; l < L; l++)
                    assert_int_equal(pkv_write_kv(c, l, slots, N, k, v, PKV_DTYPE_F32), PKV_OK);
                float q[NQH * D], out[NQH * D], lse[NQH];
                for (int i = 0; i < NQH * D; i++) q[i] = (i % D) % 2 ? -0x1p59f : 0x1p59f; /* x scale 2^-3: 2^56 */
                for (uint32_t flags = 0; flags < 2; flags++) {
                    pkv_attn_params p = pkv_attn_params_default();
                    p.n_q_heads = NQH, p.scale = 0.125f, p.lse = lse, p.flags = flags;
                    assert_int_equal(pkv_attn_decode(c, 1, &sq, 1, q, out, &p), PKV_OK);
                    for (int i = 0; i < NQH * D; i++)
                        if (!(fabs((double)out[i] - big) <= 1e-6 * big))
                            fail_msg("%s, %s pool, %s, flags %u: out[%d] = %g, want 2^56", g_backends[bi],
                                     pkv_dtype_name(dts[di]), sums ? "sums" : "scores", flags, i, (double)out[i]);
                    const double want_lse = sums ? log((double)N) : 0x1p118;
                    for (int i = 0; i < NQH; i++)
                        if (!(fabs((double)lse[i] - want_lse) <= 1e-6 * want_lse))
                            fail_msg("%s, %s pool, %s, flags %u: lse[%d] = %g, want %g", g_backends[bi],
                                     pkv_dtype_name(dts[di]), sums ? "sums" : "scores", flags, i, (double)lse[i],
                                     want_lse);
                    ran++;
                }
                assert_int_equal(pkv_seq_release(c, sq), PKV_OK);
            }
            pkv_cache_destroy(c);
        }
    unsetenv("PKV_ATTN_BACKEND");
    assert_true(ran >= 8); /* ref and the detected backend at least */
}

/* The stats' attention counters: requests read in pool order and in table order. */
/* Shared-prefix decode (pkv_attn_decode; src/cache/share.c). A batch in shuffled order: parent A
 * (100 positions) and its forks A1-A3, each with positions of its own after them (the 6 full
 * blocks shared, the partial 7th copied on write); parent P (50) and its fork P1 (3 blocks
 * shared); S, attached by the prefix cache to A's first s blocks (3 or 4: what the match reused).
 * With groups of any whole shared block, nested: {S, A, A1, A2, A3} over blocks [0, s), {A, A1,
 * A2, A3} over [s, 6) inside it, and {P, P1} over [0, 3), so attn_shared_keys grows by (4 s + 3
 * (6 - s)) x 16 + 48 = (s + 18) x 16 + 48 a call; with a window of 130, A3 (140 positions) decodes
 * alone: (3 s + 2 (6 - s)) x 16 + 48; with a scratch of two members' rows, only
 * {P, P1} fits: 48; with groups off and by the default rule (512 positions at least) 0; chunks of
 * 128 leave A3 alone as the window does; of 64, one group from block 4 on ({A, A1, A2} over
 * blocks 4 and 5: 2 x 2 x 16). Every output and lse
 * against the reference, each float and 8-bit dtype, 1 and 2 threads, with soft-cap, window, sinks
 * and ALiBi; the requests count 7 a call; in
 * place (out = q) the same bits as apart. PKV_ATTN_SHARE: 16 positions (one block) groups as any
 * block does, off groups nothing, 0 and other words make pkv_cache_create refuse. */
static void test_api_share(void **state) {
    (void)state;
    enum { NS = 7 };
    static host_seq s[NS];
    for (size_t ti = 0; ti < 5; ti++)
        for (uint32_t nt = 1; nt <= 2; nt++) {
            const pkv_dtype dt = q_types[ti];
            const double tol = tol_of(dt);
            pkv_cache *c = make_cache(dt, nt, 1);
            for (int i = 0; i < NS; i++) memset(&s[i], 0, sizeof s[i]);
            /* 0 A, 1-3 A1-A3, 4 P, 5 P1, 6 S */
            assert_int_equal(pkv_seq_create(c, NULL, 0, &s[0].id), PKV_OK);
            append_write(c, dt, &s[0], 100, 10);
            assert_int_equal(pkv_seq_commit(c, s[0].id, 100), PKV_OK);
            for (int i = 1; i <= 3; i++) {
                memcpy(&s[i], &s[0], sizeof s[0]);
                assert_int_equal(pkv_seq_fork(c, s[0].id, &s[i].id), PKV_OK);
            }
            static const uint32_t own[4] = {3, 5, 20, 40};
            for (int i = 0; i <= 3; i++) append_write(c, dt, &s[i], own[i], 1000 * (i + 1));
            assert_int_equal(pkv_seq_create(c, NULL, 0, &s[4].id), PKV_OK);
            append_write(c, dt, &s[4], 50, 20000);
            memcpy(&s[5], &s[4], sizeof s[4]);
            assert_int_equal(pkv_seq_fork(c, s[4].id, &s[5].id), PKV_OK);
            append_write(c, dt, &s[4], 10, 30000);
            append_write(c, dt, &s[5], 30, 40000);
            int32_t prompt[64 + 30];
            for (int i = 0; i < 94; i++) prompt[i] = 10 + i + (i >= 64 ? 50000 : 0);
            memcpy(&s[6], &s[0], sizeof s[0]);
            assert_int_equal(pkv_seq_create(c, NULL, 0, &s[6].id), PKV_OK);
            uint32_t reused = 0;
            assert_int_equal(pkv_seq_match_prefix(c, s[6].id, prompt, 94, &reused), PKV_OK);
            assert_true(reused >= 48 && reused <= 64);
            s[6].len = reused;
            append_write(c, dt, &s[6], 94 - reused, 0);

            static const int perm[NS] = {5, 2, 6, 0, 4, 3, 1}; /* the batch's order */
            pkv_seq ids[NS];
            for (int j = 0; j < NS; j++) ids[j] = s[perm[j]].id;
            float *q = rand_q(NS), *out = malloc(sizeof(float) * NS * NQH * D), lse[NS * NQH], sinks[NQH];
            float *out0 = malloc(sizeof(float) * NS * NQH * D), lse0[NS * NQH];
            for (uint32_t h = 0; h < NQH; h++) sinks[h] = 2.0f * rnd() + 1.0f;
            float slopes[NQH];
            for (uint32_t h = 0; h < NQH; h++) slopes[h] = powf(2.0f, -8.0f * (float)(h + 1) / NQH);
            for (int variant = 0; variant < 12; variant++) {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                p.lse = variant == 1 ? NULL : lse;
                const uint64_t sb = reused / B; /* S's shared blocks */
                uint64_t want = (sb + 18) * B + 48;
                pkv__cache_test_share(c, 1, 0);
                if (variant == 2) p.softcap = 5.0f, p.scale = 0.2f;
                if (variant == 3) p.window = 130, p.sinks = sinks, want = (sb + 12) * B + 48;
                if (variant == 4) pkv__cache_test_share(c, 1, 2 * NQH), want = 48;
                if (variant == 5) pkv__cache_test_share(c, 0, 0), want = 0;
                if (variant == 6) pkv__cache_test_share(c, 512 / B, 0), want = 0, p.sinks = sinks;
                /* ALiBi: the groups' parts at nominal positions, their log-sum-exps corrected */
                if (variant == 8) p.alibi_slopes = slopes;
                if (variant == 9) p.alibi_slopes = slopes, p.window = 130, p.sinks = sinks, want = (sb + 12) * B + 48;
                /* chunks of local attention: of 128, A3's query (139) sees from block 8 on, where
                   no other member's does, so it decodes alone (as the window of 130 left it); of
                   64, A, A1, A2 (102, 104, 119), P1 (79) and S (93) see from block 4 on, where A,
                   A1 and A2 share blocks 4 and 5 (S's block 4 and P1's are their own) */
                if (variant == 10) p.attn_chunk = 128, want = (sb + 12) * B + 48;
                if (variant == 11) p.attn_chunk = 64, p.alibi_slopes = slopes, p.sinks = sinks, want = 2 * 2 * B;
                pkv_stats st0, st1;
                assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
                const uint32_t l = variant == 7 ? 0 : (uint32_t)variant % L;
                if (variant == 7) memcpy(out, q, sizeof(float) * NS * NQH * D); /* in place: as variant 0 */
                assert_int_equal(pkv_attn_decode(c, l, ids, NS, variant == 7 ? out : q, out, &p), PKV_OK);
                if (variant == 0) memcpy(out0, out, sizeof(float) * NS * NQH * D), memcpy(lse0, lse, sizeof lse);
                if (variant == 7) {
                    assert_memory_equal(out, out0, sizeof(float) * NS * NQH * D);
                    assert_memory_equal(lse, lse0, sizeof lse);
                }
                assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
                const uint64_t got = st1.attn_shared_keys - st0.attn_shared_keys;
                assert_int_equal(got, want);
                assert_int_equal(st1.attn_reqs_pool + st1.attn_reqs_table - st0.attn_reqs_pool - st0.attn_reqs_table, NS);
                for (int j = 0; j < NS; j++)
                    check_tol(&s[perm[j]], l, q + (size_t)j * NQH * D, out + (size_t)j * NQH * D,
                              p.lse ? lse + j * NQH : NULL, s[perm[j]].len - 1, 1, &p, tol);
            }
            /* extends (pkv_attn_prefill) of each sequence's last 1-3 positions group as the decodes
               did: every query starts past the same shared blocks; without ALiBi, with it, and with
               it in chunks of 64 (one group, as the decodes' variant 11) */
            for (int al = 0; al < 3; al++) {
                pkv_attn_req reqs[NS];
                uint32_t nq = 0;
                for (int j = 0; j < NS; j++) {
                    const uint32_t m = 1 + (uint32_t)j % 3;
                    reqs[j] = (pkv_attn_req){s[perm[j]].id, s[perm[j]].len - m, m};
                    nq += m;
                }
                float *q3 = rand_q(nq), *o3 = malloc(sizeof(float) * nq * NQH * D), l3[3 * NS * NQH];
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH, p.lse = l3, p.sinks = sinks, p.alibi_slopes = al ? slopes : NULL;
                p.attn_chunk = al == 2 ? 64 : 0;
                pkv__cache_test_share(c, 1, 0);
                pkv_stats st0, st1;
                assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
                assert_int_equal(pkv_attn_prefill(c, 1, reqs, NS, q3, o3, &p), PKV_OK);
                assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
                assert_int_equal(st1.attn_shared_keys - st0.attn_shared_keys, al == 2 ? 2 * 2 * B : (reused / B + 18) * B + 48);
                for (int j = 0, at = 0; j < NS; at += (int)reqs[j].n_q, j++)
                    check_tol(&s[perm[j]], 1, q3 + (size_t)at * NQH * D, o3 + (size_t)at * NQH * D, l3 + at * NQH,
                              reqs[j].q_start, reqs[j].n_q, &p, tol);
                free(q3), free(o3);
            }
            free(q), free(out), free(out0);
            cache_ok(c);
            /* the environment's rule, read at creation */
            static const char *const envs[] = {"16", "off", "0", "12x", "auto"};
            for (int e = 0; e < 5; e++) {
                assert_int_equal(setenv("PKV_ATTN_SHARE", envs[e], 1), 0);
                pkv_cache *c2 = NULL;
                const pkv_config cfg = api_config(dt, nt, 1);
                if (e == 2 || e == 3) {
                    assert_int_equal(pkv_cache_create(&cfg, &c2), PKV_EINVAL);
                    assert_null(c2);
                    continue;
                }
                assert_int_equal(pkv_cache_create(&cfg, &c2), PKV_OK);
                pkv_seq f[2];
                host_seq *h = &s[0];
                memset(h, 0, sizeof *h);
                assert_int_equal(pkv_seq_create(c2, NULL, 0, &f[0]), PKV_OK);
                h->id = f[0];
                append_write(c2, dt, h, 40, 5);
                assert_int_equal(pkv_seq_fork(c2, f[0], &f[1]), PKV_OK);
                float *q2 = rand_q(2), out2[2 * NQH * D];
                pkv_stats st;
                assert_int_equal(pkv_attn_decode(c2, 0, f, 2, q2, out2, NULL), PKV_OK);
                assert_int_equal(pkv_cache_get_stats(c2, &st), PKV_OK);
                assert_int_equal(st.attn_shared_keys, e == 0 ? 32 : 0); /* 2 whole blocks before position 39 */
                free(q2);
                pkv_cache_destroy(c2);
            }
            assert_int_equal(unsetenv("PKV_ATTN_SHARE"), 0);
            pkv_cache_destroy(c);
        }
}

/* Shared-prefix groups under a window that hides none of the shared keys from any member, but
 * with more members than the window is wide past them: a group's part takes its queries at
 * nominal positions one a member, which the window must not cut. Forks of 97 positions (6 blocks
 * shared), window 99: 6 members; forks of 17 (one block), window 17: 20 members, whose nominal
 * positions run past the window's reach (a refusal when the window applied). Every output and
 * lse against the reference, the saved positions exact. */
static void test_api_share_window(void **state) {
    (void)state;
    static host_seq s[20];
    static const uint32_t lens[2] = {97, 17}, members[2] = {6, 20}, windows[2] = {99, 17};
    for (int k = 0; k < 2; k++)
        for (uint32_t nt = 1; nt <= 2; nt++) {
            pkv_config cfg = api_config(PKV_DTYPE_F32, nt, 0);
            cfg.max_seqs = 24;
            pkv_cache *c = NULL;
            assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
            pkv__cache_test_share(c, 1, 0);
            const uint32_t n = members[k];
            seq_new(c, PKV_DTYPE_F32, &s[0], lens[k], 3);
            pkv_seq ids[20];
            ids[0] = s[0].id;
            for (uint32_t i = 1; i < n; i++) {
                memcpy(&s[i], &s[0], sizeof s[0]);
                assert_int_equal(pkv_seq_fork(c, s[0].id, &s[i].id), PKV_OK);
                ids[i] = s[i].id;
            }
            for (uint32_t i = 1; k == 0 && i < n; i++) append_write(c, PKV_DTYPE_F32, &s[i], i % 3, 500 * i);
            pkv_attn_params p = pkv_attn_params_default();
            p.n_q_heads = NQH;
            p.window = windows[k];
            float *q = rand_q(n), *out = malloc(sizeof(float) * n * NQH * D), lse[20 * NQH];
            p.lse = lse;
            pkv_stats st0, st1;
            assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
            assert_int_equal(pkv_attn_decode(c, 1, ids, n, q, out, &p), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
            assert_int_equal(st1.attn_shared_keys - st0.attn_shared_keys, (uint64_t)(n - 1) * ((lens[k] - 1) / B * B));
            for (uint32_t i = 0; i < n; i++)
                check(&s[i], 1, q + (size_t)i * NQH * D, out + (size_t)i * NQH * D, lse + i * NQH, s[i].len - 1, 1, &p);
            free(q), free(out);
            cache_ok(c);
            pkv_cache_destroy(c);
        }
}

/* Shared-prefix groups from a base past block 0: forks F1, F2, F3 of a 150-token parent, 6
 * positions of their own each. Under chunks of local attention of 64, extends of F1 and F2 over
 * [150, 156) see from 128 (block 8) on and share block 8, the parent's: one group of 16 positions.
 * F3's extend over [120, 156) crosses the chunk edge at 128, its first queries seeing from 64: it
 * is in no group (a group from block 8 would hide [64, 128) from them). Then decodes under a
 * window that starts on a block boundary, and one that does not. With ALiBi and lse, against the
 * reference. */
static void test_api_share_chunk_cross(void **state) {
    (void)state;
    static host_seq s[4];
    for (uint32_t nt = 1; nt <= 2; nt++) {
        pkv_cache *c = make_cache(PKV_DTYPE_F32, nt, 0);
        pkv__cache_test_share(c, 1, 0);
        seq_new(c, PKV_DTYPE_F32, &s[0], 150, 7);
        for (int i = 1; i <= 3; i++) {
            memcpy(&s[i], &s[0], sizeof s[0]);
            assert_int_equal(pkv_seq_fork(c, s[0].id, &s[i].id), PKV_OK);
            append_write(c, PKV_DTYPE_F32, &s[i], 6, 900 * i);
        }
        const pkv_attn_req reqs[3] = {{s[1].id, 150, 6}, {s[3].id, 120, 36}, {s[2].id, 150, 6}};
        const uint32_t nq = 6 + 36 + 6;
        float slopes[NQH], *q = rand_q(nq), *out = malloc(sizeof(float) * nq * NQH * D), lse[48 * NQH];
        for (uint32_t h = 0; h < NQH; h++) slopes[h] = powf(2.0f, -(float)(h + 1));
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH, p.attn_chunk = 64, p.alibi_slopes = slopes, p.lse = lse;
        pkv_stats st0, st1;
        assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
        assert_int_equal(pkv_attn_prefill(c, 0, reqs, 3, q, out, &p), PKV_OK);
        assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
        assert_int_equal(st1.attn_shared_keys - st0.attn_shared_keys, B);
        const host_seq *who[3] = {&s[1], &s[3], &s[2]};
        for (uint32_t j = 0, at = 0; j < 3; at += reqs[j].n_q, j++)
            check(who[j], 0, q + (size_t)at * NQH * D, out + (size_t)at * NQH * D, lse + at * NQH, reqs[j].q_start,
                  reqs[j].n_q, &p);
        /* decodes of F1-F3 (at 155) under a window of 60, which starts on block 6 (96): one group
           over blocks 6-8, the parent's (2 x 3 x 16 positions); a window of 61 starts inside block
           5: none */
        for (uint32_t w = 60; w <= 61; w++) {
            const pkv_seq ids[3] = {s[1].id, s[2].id, s[3].id};
            p = pkv_attn_params_default();
            p.n_q_heads = NQH, p.window = w, p.alibi_slopes = slopes, p.lse = lse;
            assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
            assert_int_equal(pkv_attn_decode(c, 1, ids, 3, q, out, &p), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
            assert_int_equal(st1.attn_shared_keys - st0.attn_shared_keys, w == 60 ? 2 * 3 * B : 0);
            for (uint32_t j = 0; j < 3; j++)
                check(&s[1 + j], 1, q + (size_t)j * NQH * D, out + (size_t)j * NQH * D, lse + j * NQH, 155, 1, &p);
        }
        free(q), free(out);
        cache_ok(c);
        pkv_cache_destroy(c);
    }
}

/* Nested groups as deep as a batch makes them: 16 sequences in a chain, each a fork of the one
 * before after its block (sequence i shares its i + 1 blocks with every later one), each with a
 * position of its own; n_q_heads 2, so the scratch holds 128 members' rows. The groups: sequences
 * [i, 16) share i + 1 blocks. Outermost first those of 16 down to 5 members fit (block i each, to
 * i + 1 = 12), then the pair of the two deepest (blocks 12 to 15): 13 groups beside 16 decodes
 * (more than max_seqs / 2: the items hold 2 x max_seqs), 4 + ... + 15 + 3 = 117 blocks read once.
 * The outputs and lse as with groups off, to float rounding. */
static void test_api_share_chain(void **state) {
    (void)state;
    static host_seq hs;
    enum { N = 16 };
    for (uint32_t nt = 1; nt <= 2; nt++) {
        pkv_cache *c = make_cache(PKV_DTYPE_F32, nt, 0);
        pkv_seq ids[N];
        memset(&hs, 0, sizeof hs);
        assert_int_equal(pkv_seq_create(c, NULL, 0, &ids[0]), PKV_OK);
        hs.id = ids[0];
        append_write(c, PKV_DTYPE_F32, &hs, B, 1);
        for (uint32_t i = 1; i < N; i++) {
            assert_int_equal(pkv_seq_fork(c, ids[i - 1], &ids[i]), PKV_OK);
            hs.id = ids[i];
            append_write(c, PKV_DTYPE_F32, &hs, B, 100 * (int32_t)i);
        }
        for (uint32_t i = 0; i < N; i++) { /* a position of its own each */
            hs.id = ids[i];
            hs.len = (i + 1) * B;
            append_write(c, PKV_DTYPE_F32, &hs, 1, 9000 + (int32_t)i);
        }
        float *q = rand_q(N), out[2][N * NQH * D], lse[2][N * NQH];
        for (int k = 0; k < 2; k++) {
            pkv__cache_test_share(c, k == 0 ? 1 : 0, 0);
            pkv_attn_params p = pkv_attn_params_default(); /* n_q_heads = n_kv_heads (2) */
            p.lse = lse[k];
            pkv_stats st0, st1;
            assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
            assert_int_equal(pkv_attn_decode(c, 0, ids, N, q, out[k], &p), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
            assert_int_equal(st1.attn_shared_keys - st0.attn_shared_keys, k == 0 ? 117 * B : 0);
        }
        for (size_t j = 0; j < (size_t)N * H * D; j++) assert_true(fabs(out[0][j] - out[1][j]) <= 1e-5);
        for (size_t j = 0; j < (size_t)N * H; j++) assert_true(fabs(lse[0][j] - lse[1][j]) <= 1e-5 * fmax(1.0, fabs(lse[1][j])));
        free(q);
        cache_ok(c);
        pkv_cache_destroy(c);
    }
}

static void expect_attn_reqs(pkv_cache *c, uint64_t pool, uint64_t table) {
    pkv_stats st;
    assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
    assert_int_equal(st.attn_reqs_pool, pool);
    assert_int_equal(st.attn_reqs_table, table);
}

/* PKV_ATTN_ORDER=table|pool|auto: a parent and its fork (two full blocks shared) decode as the
 * oracle says in each order (pool: the shared blocks read once for both), and the stats count
 * the requests each order read (failed calls none); an unknown order makes
 * pkv_cache_create fail with PKV_EINVAL and change nothing. */
static void test_api_order_env(void **state) {
    (void)state;
    static const char *const orders[] = {"table", "pool", "auto"};
    pkv_config cfg = api_config(PKV_DTYPE_F16, 2, 0);
    for (size_t i = 0; i < 3; i++) {
        setenv("PKV_ATTN_ORDER", orders[i], 1);
        pkv_cache *c = NULL;
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
        static host_seq par, child;
        seq_new(c, PKV_DTYPE_F16, &par, 40, 0);
        child = par;
        assert_int_equal(pkv_seq_fork(c, par.id, &child.id), PKV_OK);
        append_write(c, PKV_DTYPE_F16, &child, 30, 500);
        const pkv_seq ids[2] = {par.id, child.id};
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH;
        float *q = rand_q(2), out[2 * NQH * D], lse[2 * NQH];
        p.lse = lse;
        for (uint32_t l = 0; l < L; l++) {
            assert_int_equal(pkv_attn_decode(c, l, ids, 2, q, out, &p), PKV_OK);
            check(&par, l, q, out, lse, par.len - 1, 1, &p);
            check(&child, l, q + NQH * D, out + NQH * D, lse + NQH, child.len - 1, 1, &p);
        }
        /* the stats count the requests by order: pool order only where forced (auto leaves a
         * call this small in table order, on the caller) */
        const uint64_t pooled = !strcmp(orders[i], "pool");
        expect_attn_reqs(c, 2 * L * pooled, 2 * L * !pooled);
        /* a decode beside an extend: only the decode is read in pool order */
        const pkv_attn_req reqs[2] = {{par.id, par.len - 1, 1}, {child.id, child.len - 5, 5}};
        float *q6 = rand_q(6), out6[6 * NQH * D];
        p.lse = NULL;
        assert_int_equal(pkv_attn_prefill(c, 0, reqs, 2, q6, out6, &p), PKV_OK);
        check(&par, 0, q6, out6, NULL, par.len - 1, 1, &p);
        check(&child, 0, q6 + NQH * D, out6 + NQH * D, NULL, child.len - 5, 5, &p);
        expect_attn_reqs(c, (2 * L + 1) * pooled, 2 * L * !pooled + 1 + !pooled);
        /* a failed call counts nothing */
        assert_int_equal(pkv_attn_decode(c, L, ids, 2, q, out, &p), PKV_EINVAL);
        assert_int_equal(pkv_attn_prefill(c, 0, reqs, 2, NULL, out6, &p), PKV_EINVAL);
        expect_attn_reqs(c, (2 * L + 1) * pooled, 2 * L * !pooled + 1 + !pooled);
        free(q6);
        free(q);
        pkv_cache_destroy(c);
    }
    setenv("PKV_ATTN_ORDER", "backwards", 1);
    pkv_cache *const untouched = (pkv_cache *)&cfg;
    pkv_cache *c = untouched;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    assert_ptr_equal(c, untouched);
    /* empty means auto (pkv.h), for each of the five variables; a case or space typo does not */
    static const char *const vars[] = {"PKV_ATTN_ORDER", "PKV_ATTN_SWEEP", "PKV_ATTN_PASSES", "PKV_ATTN_LEAD",
                                       "PKV_ATTN_PIECES"};
    unsetenv("PKV_ATTN_ORDER");
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        setenv(vars[i], "", 1);
        c = NULL;
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
        pkv_cache_destroy(c);
        static const char *const typos[] = {"Auto", "auto ", "AUTO"};
        for (size_t t = 0; t < 3; t++) {
            setenv(vars[i], typos[t], 1);
            c = untouched;
            assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
            assert_ptr_equal(c, untouched);
        }
        unsetenv(vars[i]);
    }
}

/* ---- a caller's executor (pkv_config.executor) ----
 * A serial one: its calls run one after the other on the calling thread, in reverse order,
 * with worker indexes taken in turn; the modes break the contract in ways the library sees. */
enum { EXEC_GOOD, EXEC_NONE, EXEC_BAD_INDEX, EXEC_BUDGET };
typedef struct api_exec {
    int mode;
    uint32_t n_workers;
    uint64_t jobs, calls;
    uint64_t budget; /* EXEC_BUDGET: runs this many parallel_for calls, then nothing */
} api_exec;

static void api_parallel_for(void *ctx, pkv_task_fn fn, void *job, uint32_t n) {
    api_exec *x = ctx;
    x->jobs++;
    if (x->mode == EXEC_NONE || (x->mode == EXEC_BUDGET && x->budget == 0)) return;
    if (x->mode == EXEC_BUDGET) x->budget--;
    for (uint32_t k = 0; k < n; k++) {
        fn(job, n - 1 - k, x->mode == EXEC_BAD_INDEX ? x->n_workers : k % x->n_workers);
        x->calls++;
    }
}

/* Four sequences of 300 tokens appended 50 at a time in turn (tables that jump: decode sweeps
 * them), the same K/V in every cache built with the same seed. */
enum { EX_SEQS = 4, EX_LEN = 300, EX_Q = 40 };
static void build_exec_batch(pkv_cache *c, host_seq *hs, pkv_seq *ids) {
    g_rng = 4242;
    for (int i = 0; i < EX_SEQS; i++) {
        memset(&hs[i], 0, sizeof hs[i]);
        assert_int_equal(pkv_seq_create(c, NULL, 0, &hs[i].id), PKV_OK);
        ids[i] = hs[i].id;
    }
    for (int r = 0; r < EX_LEN / 50; r++)
        for (int i = 0; i < EX_SEQS; i++) append_write(c, PKV_DTYPE_F16, &hs[i], 50, 1000 * i);
}

/* decode of the batch and a prefill of EX_Q queries a sequence; returns the first status that
 * is not PKV_OK */
static int exec_calls(pkv_cache *c, const pkv_seq *ids, const float *q, float *dec, float *pre) {
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH;
    int rc = pkv_attn_decode(c, 1, ids, EX_SEQS, q, dec, &p);
    if (rc) return rc;
    pkv_attn_req reqs[EX_SEQS];
    for (int i = 0; i < EX_SEQS; i++) reqs[i] = (pkv_attn_req){ids[i], EX_LEN - EX_Q - (uint32_t)i, EX_Q};
    return pkv_attn_prefill(c, 0, reqs, EX_SEQS, q, pre, &p);
}

/* exec_calls into dec and pre (zeroed first) succeeds and gives dec0 and pre0 bit for bit. */
static void expect_exec_same(pkv_cache *c, const pkv_seq *ids, const float *q, float *dec, float *pre,
                             const float *dec0, const float *pre0) {
    const size_t n_dec = (size_t)EX_SEQS * NQH * D, n_pre = (size_t)EX_SEQS * EX_Q * NQH * D;
    memset(dec, 0, n_dec * sizeof *dec), memset(pre, 0, n_pre * sizeof *pre);
    assert_int_equal(exec_calls(c, ids, q, dec, pre), PKV_OK);
    assert_memory_equal(dec, dec0, n_dec * sizeof *dec);
    assert_memory_equal(pre, pre0, n_pre * sizeof *pre);
}

/* Attention on a caller's executor: the config rules, the same results bit for bit as on the
 * cache's own threads (2 and 1 workers), and a status, not a crash, from an executor that runs
 * nothing or gives a worker index out of range; the cache works again once it behaves. */
static void test_api_executor(void **state) {
    (void)state;
    static host_seq hs[EX_SEQS];
    static float dec0[EX_SEQS * NQH * D], pre0[EX_SEQS * EX_Q * NQH * D];
    static float dec[EX_SEQS * NQH * D], pre[EX_SEQS * EX_Q * NQH * D];
    api_exec x = {.mode = EXEC_GOOD, .n_workers = 2};
    const pkv_executor good = {.parallel_for = api_parallel_for, .ctx = &x, .n_workers = 2};
    pkv_cache *c = NULL;

    /* config: n_workers 1..256 with parallel_for, 0 without; n_threads 0 or n_workers */
    pkv_config cfg = api_config(PKV_DTYPE_F16, 0, 0);
    cfg.executor = good;
    cfg.executor.n_workers = 0;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    cfg.executor.n_workers = 257;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    cfg.executor = good, cfg.n_threads = 3;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    cfg.executor = (pkv_executor){.n_workers = 2}, cfg.n_threads = 0;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_EINVAL);
    assert_null(c);
    cfg.executor = good, cfg.n_threads = 2;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    pkv_config eff;
    assert_int_equal(pkv_cache_config(c, &eff), PKV_OK);
    assert_int_equal(eff.n_threads, 2);
    assert_ptr_equal(eff.executor.ctx, &x);

    pkv_cache *own = make_cache(PKV_DTYPE_F16, 2, 0);
    pkv_seq ids[EX_SEQS], own_ids[EX_SEQS];
    build_exec_batch(own, hs, own_ids);
    build_exec_batch(c, hs, ids);
    float *q = rand_q(EX_SEQS * EX_Q);
    assert_int_equal(exec_calls(own, own_ids, q, dec0, pre0), PKV_OK);
    pkv_attn_params p0 = pkv_attn_params_default();
    p0.n_q_heads = NQH;
    for (int i = 0; i < EX_SEQS; i++) /* the reference cache itself against the oracle */
        check(&hs[i], 1, q + (size_t)i * NQH * D, dec0 + (size_t)i * NQH * D, NULL, EX_LEN - 1, 1, &p0);
    assert_int_equal(exec_calls(c, ids, q, dec, pre), PKV_OK);
    assert_true(x.jobs >= 2 && x.calls >= x.jobs); /* the decode's and the prefill's work went to it */
    assert_memory_equal(dec, dec0, sizeof dec);
    assert_memory_equal(pre, pre0, sizeof pre);
    pkv_stats st0, st1;
    assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
    assert_int_equal(st0.attn_reqs_pool, EX_SEQS); /* the decode batch was swept */

    /* executors that break the contract: PKV_EINVAL, nothing counted */
    for (int mode = EXEC_NONE; mode <= EXEC_BAD_INDEX; mode++) {
        x.mode = mode;
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH;
        assert_int_equal(pkv_attn_decode(c, 1, ids, EX_SEQS, q, dec, &p), PKV_EINVAL);
        assert_int_equal(exec_calls(c, ids, q, dec, pre), PKV_EINVAL);
    }
    assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
    assert_int_equal(st1.attn_reqs_pool, st0.attn_reqs_pool);
    assert_int_equal(st1.attn_reqs_table, st0.attn_reqs_table);
    /* a batch past max_seqs (16) runs in groups: an executor that fails only the second group's
     * work still leaves the call counted as nothing (the first group's items were counted) */
    {
        enum { BIG = 20 };
        pkv_seq big[BIG];
        for (int i = 0; i < BIG; i++) big[i] = ids[i % EX_SEQS];
        static float bq[BIG * NQH * D], bout[BIG * NQH * D];
        for (size_t i = 0; i < sizeof bq / sizeof bq[0]; i++) bq[i] = q[i % (EX_SEQS * NQH * D)];
        pkv_attn_params p = pkv_attn_params_default();
        p.n_q_heads = NQH;
        x.mode = EXEC_GOOD;
        const uint64_t j0 = x.jobs;
        assert_int_equal(pkv_attn_decode(c, 1, big, 16, bq, bout, &p), PKV_OK); /* one group's calls */
        x.mode = EXEC_BUDGET, x.budget = x.jobs - j0;
        assert_true(x.budget > 0);
        assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
        assert_int_equal(pkv_attn_decode(c, 1, big, BIG, bq, bout, &p), PKV_EINVAL);
        assert_int_equal(x.budget, 0); /* the first group ran */
        assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
        assert_int_equal(st1.attn_reqs_pool, st0.attn_reqs_pool);
        assert_int_equal(st1.attn_reqs_table, st0.attn_reqs_table);
        x.mode = EXEC_GOOD;
        assert_int_equal(pkv_attn_decode(c, 1, big, BIG, bq, bout, &p), PKV_OK);
        assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
        assert_int_equal(st1.attn_reqs_pool + st1.attn_reqs_table, st0.attn_reqs_pool + st0.attn_reqs_table + BIG);
    }
    x.mode = EXEC_GOOD;
    expect_exec_same(c, ids, q, dec, pre, dec0, pre0);
    pkv_cache_destroy(c);
    pkv_cache_destroy(own);

    /* one worker: every call on the calling thread, the executor never called */
    api_exec x1 = {.mode = EXEC_GOOD, .n_workers = 1};
    cfg = api_config(PKV_DTYPE_F16, 0, 0);
    cfg.executor = (pkv_executor){.parallel_for = api_parallel_for, .ctx = &x1, .n_workers = 1};
    c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    own = make_cache(PKV_DTYPE_F16, 1, 0);
    build_exec_batch(own, hs, own_ids);
    build_exec_batch(c, hs, ids);
    assert_int_equal(exec_calls(own, own_ids, q, dec0, pre0), PKV_OK);
    assert_int_equal(exec_calls(c, ids, q, dec, pre), PKV_OK);
    assert_int_equal(x1.jobs, 0);
    assert_memory_equal(dec, dec0, sizeof dec);
    assert_memory_equal(pre, pre0, sizeof pre);
    pkv_cache_destroy(c);
    pkv_cache_destroy(own);
    free(q);
}

/* pkv_config.spin_us, how long the cache's threads poll for the next call: the default, what
 * pkv_cache_config reports, and the same results bit for bit whether the threads sleep after
 * every job (0), poll as by default, or never sleep between the calls here (1 s), with pauses
 * between calls past the default's poll. */
static void test_api_spin(void **state) {
    (void)state;
    static host_seq hs[EX_SEQS];
    static float dec0[EX_SEQS * NQH * D], pre0[EX_SEQS * EX_Q * NQH * D];
    static float dec[EX_SEQS * NQH * D], pre[EX_SEQS * EX_Q * NQH * D];
    assert_int_equal(pkv_config_default().spin_us, 50);
    pkv_cache *c0 = make_cache(PKV_DTYPE_F16, 2, 0);
    pkv_seq ids0[EX_SEQS], ids[EX_SEQS];
    build_exec_batch(c0, hs, ids0);
    float *q = rand_q(EX_SEQS * EX_Q);
    assert_int_equal(exec_calls(c0, ids0, q, dec0, pre0), PKV_OK);
    static const uint32_t spins[] = {0, 50, 1000000};
    for (size_t k = 0; k < sizeof spins / sizeof spins[0]; k++) {
        pkv_config cfg = api_config(PKV_DTYPE_F16, 2, 0);
        cfg.spin_us = spins[k];
        pkv_cache *c = NULL;
        assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
        pkv_config eff;
        assert_int_equal(pkv_cache_config(c, &eff), PKV_OK);
        assert_int_equal(eff.spin_us, spins[k]);
        build_exec_batch(c, hs, ids);
        for (int r = 0; r < 3; r++) {
            expect_exec_same(c, ids, q, dec, pre, dec0, pre0);
            const struct timespec pause = {0, 300000}; /* past the default poll: asleep there */
            nanosleep(&pause, NULL);
        }
        pkv_cache_destroy(c);
    }
    pkv_cache_destroy(c0);
    free(q);
}

/* A child process (fork) of a program whose cache has worker threads: they are not in the
 * child, so there attention runs on the calling thread alone, with the same results bit for
 * bit, and destroying the cache returns (it hung, joining threads that are not there). The
 * parent's cache goes on with its threads. */
static void test_api_fork_child(void **state) {
    (void)state;
    static host_seq hs[EX_SEQS];
    static float dec0[EX_SEQS * NQH * D], pre0[EX_SEQS * EX_Q * NQH * D];
    static float dec[EX_SEQS * NQH * D], pre[EX_SEQS * EX_Q * NQH * D];
    pkv_cache *c = make_cache(PKV_DTYPE_F16, 2, 0);
    pkv_seq ids[EX_SEQS];
    build_exec_batch(c, hs, ids);
    float *q = rand_q(EX_SEQS * EX_Q);
    assert_int_equal(exec_calls(c, ids, q, dec0, pre0), PKV_OK);
    usleep(100000); /* the worker asleep on its condition variable, as in an idle engine */
    fflush(NULL);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        alarm(20); /* a hang ends the child with SIGALRM */
        int bad = exec_calls(c, ids, q, dec, pre) != PKV_OK;
        bad |= memcmp(dec, dec0, sizeof dec) != 0;
        bad |= (memcmp(pre, pre0, sizeof pre) != 0) << 1;
        pkv_cache_destroy(c);
        _exit(bad);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("child: %s %d", WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    expect_exec_same(c, ids, q, dec, pre, dec0, pre0);
    pkv_cache_destroy(c);
    free(q);
}

/* The distinct blocks the tables of ids[0 .. n) hold; every entry before info.n_dropped / B is
 * -1 (a dropped front) and no other is. */
static uint32_t blocks_held(pkv_cache *c, const pkv_seq *ids, uint32_t n) {
    uint8_t seen[128] = {0};
    uint32_t held = 0;
    for (uint32_t i = 0; i < n; i++) {
        int32_t tab[MAXTOK / B + 1];
        uint32_t nb = 0;
        pkv_seq_info in;
        assert_int_equal(pkv_seq_block_table(c, ids[i], tab, MAXTOK / B + 1, &nb), PKV_OK);
        assert_int_equal(pkv_seq_get_info(c, ids[i], &in), PKV_OK);
        for (uint32_t j = 0; j < nb; j++) {
            assert_int_equal(tab[j] < 0, j < in.n_dropped / B);
            if (tab[j] >= 0 && !seen[tab[j]]++) held++;
        }
    }
    return held;
}

/* pkv_seq_drop_front under a sliding window and under chunks of local attention. A 300-token
 * parent and two forks of their own tails (6 and 11 positions) drop what a window of 70 no
 * longer reads: the shared blocks go once all three have let go of them (n_active is the blocks
 * the tables still hold), and decode (shared-prefix groups on), an extend and a tree over what is
 * left match the reference, for f32 and f16, 1 and 2 threads. Then every call that would read a dropped position is refused with
 * its output untouched and the counts unchanged: decode without the window or with a wider one,
 * chunks that start before the front, non-causal prefill, a tree whose root sees it, gather,
 * read_stored, write by position, slots, keep and truncate below it, a pin; and a drop past the
 * length. A tier's save stores nothing (the ids before the front, which key its entries, are not
 * indexed here). Chunks of 64: the front dropped to the current chunk, decode matches.
 * (With prefix caching on: test_api_drop_front_indexed.) */
static char g_said[400]; /* the last refusal's reason (the cache's log hook) */
static void said_fn(void *ctx, int level, const char *msg) {
    (void)ctx;
    if (level == PKV_LOG_ERROR) snprintf(g_said, sizeof g_said, "%s", msg);
}

/* make_cache's cache (prefix caching off), its refusals' reasons in g_said. */
static pkv_cache *said_cache(pkv_dtype dt, uint32_t n_threads) {
    pkv_config cfg = api_config(dt, n_threads, 0);
    cfg.log = said_fn;
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    return c;
}

static void test_api_drop_front(void **state) {
    (void)state;
    static host_seq s[4];
    enum { W = 70 };
    for (int ti = 0; ti < 2; ti++)
        for (uint32_t nt = 1; nt <= 2; nt++) {
            const pkv_dtype dt = k_types[ti];
            pkv_cache *c = said_cache(dt, nt);
            pkv__cache_test_share(c, 1, 0);
            seq_new(c, dt, &s[0], 300, 11);
            for (int i = 1; i <= 2; i++) {
                memcpy(&s[i], &s[0], sizeof s[0]);
                assert_int_equal(pkv_seq_fork(c, s[0].id, &s[i].id), PKV_OK);
                append_write(c, dt, &s[i], i == 1 ? 6 : 11, 700 * i);
            }
            const pkv_seq ids[3] = {s[0].id, s[1].id, s[2].id};
            pkv_stats st0, st1;
            assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
            assert_int_equal(st0.n_active, blocks_held(c, ids, 3));
            /* each drops the blocks before its next decode's first key, len - W: blocks 0-13 for the
               parent and F1 (still held by the others: nothing freed), 0-14 for F2 (blocks 0-13
               freed; 14 is the parent's and F1's still) */
            for (int i = 0; i < 3; i++) {
                pkv_stats sd;
                assert_int_equal(pkv_seq_drop_front(c, s[i].id, s[i].len - W), PKV_OK);
                assert_int_equal(pkv_cache_get_stats(c, &sd), PKV_OK);
                if (i < 2) assert_int_equal(sd.n_active, st0.n_active);
                pkv_seq_info in;
                assert_int_equal(pkv_seq_get_info(c, s[i].id, &in), PKV_OK);
                assert_int_equal(in.n_dropped, (s[i].len - W) / B * B);
                assert_int_equal(in.n_tokens, s[i].len);
                assert_int_equal(pkv_seq_drop_front(c, s[i].id, 3), PKV_OK); /* below it: a no-op */
                assert_int_equal(pkv_seq_get_info(c, s[i].id, &in), PKV_OK);
                assert_int_equal(in.n_dropped, (s[i].len - W) / B * B);
            }
            assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
            assert_int_equal(st1.n_active, blocks_held(c, ids, 3));
            /* 300 - 70 = 230: blocks 0-13 of the parent, shared by all three, are FREE now */
            assert_int_equal(st0.n_active - st1.n_active, 230 / B);
            cache_ok(c);
            pkv_attn_params p = pkv_attn_params_default();
            float lse[16 * NQH];
            p.n_q_heads = NQH, p.window = W, p.lse = lse;
            float *q = rand_q(16), *out = malloc(sizeof(float) * 16 * NQH * D);
            assert_int_equal(pkv_attn_decode(c, 1, ids, 3, q, out, &p), PKV_OK);
            for (int i = 0; i < 3; i++)
                check(&s[i], 1, q + (size_t)i * NQH * D, out + (size_t)i * NQH * D, lse + i * NQH, s[i].len - 1, 1, &p);
            /* an extend of F1 by 5 positions, its queries' first keys past the front */
            append_write(c, dt, &s[1], 5, 900);
            const pkv_attn_req rq = {s[1].id, s[1].len - 5, 5};
            assert_int_equal(pkv_attn_prefill(c, 0, &rq, 1, q, out, &p), PKV_OK);
            check(&s[1], 0, q, out, lse, s[1].len - 5, 5, &p);
            /* a tree of 4 nodes at F2's last 4 positions; a fork of F2 inherits its front */
            assert_int_equal(pkv_seq_fork(c, s[2].id, &s[3].id), PKV_OK);
            pkv_seq_info in3;
            assert_int_equal(pkv_seq_get_info(c, s[3].id, &in3), PKV_OK);
            assert_int_equal(in3.n_dropped, (s[2].len - W) / B * B);
            const int32_t parent[4] = {-1, 0, 0, 1};
            const pkv_attn_tree_req tr = {s[2].id, s[2].len - 4, 4, parent};
            float *out2 = malloc(sizeof(float) * 16 * NQH * D);
            pkv_attn_params tp = p; /* the root, at len - 4, sees from len - W as the last decode did */
            tp.window = W - 3;
            assert_int_equal(pkv_attn_tree(c, 1, &tr, 1, q, out, &tp), PKV_OK);
            check_tree(&s[2], 1, q, out, lse, NQH, s[2].len - 4, parent, 4, &tp, TOL);
            assert_int_equal(pkv_seq_release(c, s[3].id), PKV_OK);

            /* refusals: each leaves out and the counts as they were */
            for (uint32_t i = 0; i < 16 * NQH * D; i++) out[i] = 7.0f;
            memcpy(out2, out, sizeof(float) * 16 * NQH * D);
            float lse2[16 * NQH];
            for (uint32_t i = 0; i < 16 * NQH; i++) lse[i] = lse2[i] = 7.0f;
            assert_int_equal(pkv_cache_get_stats(c, &st0), PKV_OK);
            pkv_attn_params bad = p;
            bad.window = 0;
            g_said[0] = 0;
            assert_int_equal(pkv_attn_decode(c, 1, ids, 3, q, out, &bad), PKV_EINVAL);
            assert_non_null(strstr(g_said, "sees position 0, dropped (pkv_seq_drop_front: before 224)")); /* 300 - 70 */
            bad.window = W + B + 1; /* sees the last dropped block of each */
            assert_int_equal(pkv_attn_decode(c, 1, ids, 3, q, out, &bad), PKV_EINVAL);
            assert_non_null(strstr(g_said, "sequence 0: the query at position 299 sees position 213, dropped"));
            bad.window = 0, bad.attn_chunk = 200; /* F1's chunk starts at 200, before its front (224) */
            assert_int_equal(pkv_attn_decode(c, 1, &s[1].id, 1, q, out, &bad), PKV_EINVAL);
            assert_non_null(strstr(g_said, "the query at position 310 sees position 200, dropped"));
            bad = p, bad.window = 0, bad.flags = PKV_ATTN_NONCAUSAL;
            const pkv_attn_req all = {s[0].id, 0, 2};
            assert_int_equal(pkv_attn_prefill(c, 0, &all, 1, q, out, &bad), PKV_EINVAL);
            assert_non_null(strstr(g_said, "request 0: the query at position 0 sees position 0, dropped"));
            const pkv_attn_req early = {s[1].id, s[1].len - 5 - W, 5}; /* 236: its first query sees 167 */
            assert_int_equal(pkv_attn_prefill(c, 0, &early, 1, q, out, &p), PKV_EINVAL);
            assert_non_null(strstr(g_said, "the query at position 236 sees position 167, dropped"));
            const pkv_attn_tree_req tr_early = {s[2].id, s[2].len - W, 4, parent};
            assert_int_equal(pkv_attn_tree(c, 1, &tr_early, 1, q, out, &p), PKV_EINVAL);
            assert_non_null(strstr(g_said, "the node at position 241 sees position 172, dropped"));
            /* a window of 1 below F2's front (240): no node sees the prefix, so no item reaches the
               kernels' driver, and only the tree's own check keeps its paths off the -1 entries */
            const pkv_attn_tree_req tr_low = {s[2].id, 200, 4, parent};
            bad = p, bad.window = 1;
            g_said[0] = 0;
            assert_int_equal(pkv_attn_tree(c, 1, &tr_low, 1, q, out, &bad), PKV_EINVAL);
            assert_non_null(strstr(g_said, "the node at position 200 sees position 200, dropped"));
            assert_memory_equal(out, out2, sizeof(float) * 16 * NQH * D);
            assert_memory_equal(lse, lse2, sizeof lse2);
            const uint32_t front = (s[0].len - W) / B * B;
            float row[H * D];
            uint8_t raw[H * D * 4];
            int32_t slot;
            pkv_seq pin;
            const uint32_t idx[1] = {0};
            assert_int_equal(pkv_seq_gather(c, s[0].id, 0, front - 1, 1, row, NULL), PKV_EINVAL);
            assert_int_equal(pkv_seq_gather(c, s[0].id, 0, front - 1, 2, row, row), PKV_EINVAL);
            assert_int_equal(pkv_seq_read_stored(c, s[0].id, 0, 0, 1, raw, NULL), PKV_EINVAL);
            assert_int_equal(pkv_seq_write_kv(c, s[0].id, 0, front - 1, 1, row, NULL, PKV_DTYPE_F32), PKV_EINVAL);
            assert_int_equal(pkv_seq_slots(c, s[0].id, front - 1, 1, &slot), PKV_EINVAL);
            assert_int_equal(pkv_seq_keep(c, s[0].id, front - 1, idx, 1), PKV_EINVAL);
            assert_int_equal(pkv_seq_truncate(c, s[0].id, front - 1), PKV_EINVAL);
            assert_int_equal(pkv_pin_create(c, s[0].id, 16, &pin), PKV_EINVAL);
            assert_int_equal(pkv_seq_drop_front(c, s[0].id, s[0].len + 1), PKV_EINVAL);
            pkv_tier *t = NULL;
            uint32_t saved = 99;
            assert_int_equal(pkv_tier_host_create(1u << 20, NULL, &t), PKV_OK);
            /* a save keys each entry by every id before it: where the index does not name the
               ids before the front (prefix caching off), nothing is stored, successfully */
            assert_int_equal(pkv_tier_save(t, c, s[0].id, &saved), PKV_OK);
            assert_int_equal(saved, 0);
            pkv_tier_stats ts;
            assert_int_equal(pkv_tier_get_stats(t, &ts), PKV_OK);
            assert_true(ts.saved == 0 && ts.save_present == 0 && ts.errors == 0);
            pkv_tier_destroy(t);
            assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
            assert_int_equal(st1.n_active, st0.n_active);
            assert_int_equal(st1.n_free, st0.n_free);
            assert_int_equal(st1.n_tokens, st0.n_tokens);
            /* what is left reads back as written, and a truncate to the front itself is taken */
            assert_int_equal(pkv_seq_gather(c, s[0].id, 1, front, 1, row, NULL), PKV_OK);
            const float *want = &s[0].k[1][front][0][0];
            for (uint32_t j = 0; j < H * D; j++) assert_true(row[j] == want[j]);
            assert_int_equal(pkv_seq_truncate(c, s[0].id, front), PKV_OK);
            s[0].len = front;
            cache_ok(c);

            /* chunks of 64: the parent, grown back to 300, drops to its current chunk (256) */
            append_write(c, dt, &s[0], 300 - front, 11);
            assert_int_equal(pkv_seq_drop_front(c, s[0].id, 256), PKV_OK);
            p = pkv_attn_params_default();
            p.n_q_heads = NQH, p.attn_chunk = 64;
            assert_int_equal(pkv_attn_decode(c, 0, &s[0].id, 1, q, out, &p), PKV_OK);
            check(&s[0], 0, q, out, NULL, 299, 1, &p);
            free(q), free(out), free(out2);
            for (int i = 0; i < 3; i++) assert_int_equal(pkv_seq_release(c, s[i].id), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st1), PKV_OK);
            assert_int_equal(st1.n_active, 0);
            cache_ok(c);
            pkv_cache_destroy(c);
        }
}

/* pkv_seq_drop_front where the cache indexes prefixes (a hybrid model's windowed layers with
 * prefix caching): a dropped block held by nobody else stays indexed and goes CACHED above the
 * blocks still in use; the same prompt again is matched whole, the dropped blocks taken back,
 * and full attention over them matches the reference; an eviction of a dropped block leaves a
 * tombstone (the blocks below stay indexed, in use, their decodes unchanged); a plain match stops
 * at it, a windowed one (pkv_seq_match_prefix_window) goes past it and decodes under the window
 * as the reference does; the prompt computed again fills it. (test_prefix_evict: the same
 * eviction with no tombstone to leave, which takes the subtree out.) The counts are exact at each
 * step and the checker runs after each; f32 and f16, 1 and 2 threads. */
static void test_api_drop_front_indexed(void **state) {
    (void)state;
    static host_seq s[4];
    enum { W = 70 };
    for (int ti = 0; ti < 2; ti++)
        for (uint32_t nt = 1; nt <= 2; nt++) {
            const pkv_dtype dt = k_types[ti];
            pkv_cache *c = make_cache(dt, nt, 1);
            pkv_stats st;
            seq_new(c, dt, &s[0], 300, 11); /* ids 11 + position */
            assert_int_equal(pkv_seq_commit(c, s[0].id, 300), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_indexed, 300 / B);
            /* blocks 0-13 wholly before 230: s0 held them alone, so all 14 are CACHED, still indexed */
            assert_int_equal(pkv_seq_drop_front(c, s[0].id, 300 - W), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_cached, 14);
            assert_int_equal(st.n_active, 19 - 14);
            assert_int_equal(st.n_indexed, 300 / B);
            cache_ok(c);
            pkv_attn_params p = pkv_attn_params_default();
            p.n_q_heads = NQH, p.window = W;
            float *q = rand_q(2), *out = malloc(sizeof(float) * 2 * NQH * D);
            /* s0 goes on past its front: its chain (blocks 14-17 indexed, past the front) grows */
            append_write(c, dt, &s[0], 20, 11);
            assert_int_equal(pkv_seq_commit(c, s[0].id, 320), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_indexed, 320 / B);
            assert_int_equal(pkv_attn_decode(c, 1, &s[0].id, 1, q, out, &p), PKV_OK);
            check(&s[0], 1, q, out, NULL, 319, 1, &p);
            /* the same prompt again: all 20 blocks, the 14 dropped ones taken back from the LRU */
            int32_t prompt[321];
            for (int i = 0; i < 321; i++) prompt[i] = 11 + i;
            memcpy(&s[1], &s[0], sizeof s[0]);
            assert_int_equal(pkv_seq_create(c, NULL, 0, &s[1].id), PKV_OK);
            uint32_t reused = 0;
            assert_int_equal(pkv_seq_match_prefix(c, s[1].id, prompt, 321, &reused), PKV_OK);
            assert_int_equal(reused, 320);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_cached, 0);
            assert_int_equal(st.n_active, 20);
            cache_ok(c);
            pkv_attn_params full = pkv_attn_params_default();
            full.n_q_heads = NQH;
            for (uint32_t l = 0; l < L; l++) {
                assert_int_equal(pkv_attn_decode(c, l, &s[1].id, 1, q, out, &full), PKV_OK);
                check(&s[1], l, q, out, NULL, 319, 1, &full);
            }
            /* s1 drops its front too, to 240: blocks 0-13 are nobody's again (CACHED, deepest
               first), block 14 stays s0's */
            assert_int_equal(pkv_seq_drop_front(c, s[1].id, 320 - W), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_cached, 14);
            cache_ok(c);
            /* another prompt takes every FREE block and one more: with nothing in the LRU queue
               (blocks 0-13 wait in the inner queue above blocks in use), the deepest waiting
               one, block 13, is evicted and leaves a tombstone: blocks 14-19, which s0 and s1
               still hold, stay indexed below it; blocks 0-12 stay CACHED and indexed */
            const pkv_stats before = st;
            pkv_seq other;
            assert_int_equal(pkv_seq_create(c, NULL, 0, &other), PKV_OK);
            const uint32_t n_other = (before.n_free + 1) * B;
            int32_t *toks = malloc(sizeof(int32_t) * n_other);
            for (uint32_t i = 0; i < n_other; i++) toks[i] = 90000 + (int32_t)i;
            assert_int_equal(pkv_seq_append(c, other, toks, n_other, NULL), PKV_OK);
            free(toks);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.evictions, before.evictions + 1);
            assert_int_equal(st.n_cached, 13);
            assert_int_equal(st.n_free, 0);
            assert_int_equal(st.n_indexed, 19);
            assert_int_equal(st.n_tombstones, 1);
            cache_ok(c);
            for (int i = 0; i < 2; i++) { /* their K/V is where it was */
                assert_int_equal(pkv_attn_decode(c, 0, &s[i].id, 1, q, out, &p), PKV_OK);
                check(&s[i], 0, q, out, NULL, 319, 1, &p);
            }
            /* s0's chain goes on below the tombstone: a further full block is indexed */
            assert_int_equal(pkv_seq_release(c, other), PKV_OK);
            append_write(c, dt, &s[0], 16, 11);
            assert_int_equal(pkv_seq_commit(c, s[0].id, 336), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_indexed, 20);
            cache_ok(c);
            /* the prompt once more: blocks 0-12, then the tombstone is a miss (its K/V is gone) */
            memcpy(&s[2], &s[1], sizeof s[1]);
            assert_int_equal(pkv_seq_create(c, NULL, 0, &s[2].id), PKV_OK);
            const pkv_stats pre = st;
            assert_int_equal(pkv_seq_match_prefix(c, s[2].id, prompt, 321, &reused), PKV_OK);
            assert_int_equal(reused, 13 * B);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.prefix_miss_evicted, pre.prefix_miss_evicted + 1);
            assert_int_equal(st.n_cached, 0);
            cache_ok(c);
            /* under the window the match goes past it: a query at 320 sees from 251, so blocks
               15-19 are taken and the front ends at 240 */
            memcpy(&s[3], &s[1], sizeof s[1]);
            assert_int_equal(pkv_seq_create(c, NULL, 0, &s[3].id), PKV_OK);
            assert_int_equal(pkv_seq_match_prefix_window(c, s[3].id, prompt, 321, W, &reused), PKV_OK);
            assert_int_equal(reused, 320);
            pkv_seq_info in;
            assert_int_equal(pkv_seq_get_info(c, s[3].id, &in), PKV_OK);
            assert_int_equal(in.n_dropped, 15 * B);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.prefix_tomb_hits, pre.prefix_tomb_hits + 1);
            cache_ok(c);
            for (uint32_t l = 0; l < L; l++) {
                assert_int_equal(pkv_attn_decode(c, l, &s[3].id, 1, q, out, &p), PKV_OK);
                check(&s[3], l, q, out, NULL, 319, 1, &p);
            }
            /* the plain match's sequence computes the rest of the prompt: its block 13 fills the
               tombstone (its chain then meets block 14, indexed: a twin), and the whole prompt
               matches plainly again, through its block 13 */
            s[2].len = 13 * B;
            append_write(c, dt, &s[2], 320 - 13 * B, 11);
            assert_int_equal(pkv_seq_commit(c, s[2].id, 320), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_tombstones, 0);
            assert_int_equal(st.n_indexed, 21);
            cache_ok(c);
            pkv_seq again;
            assert_int_equal(pkv_seq_create(c, NULL, 0, &again), PKV_OK);
            assert_int_equal(pkv_seq_match_prefix(c, again, prompt, 321, &reused), PKV_OK);
            assert_int_equal(reused, 320);
            int32_t t2[20], ta[20];
            uint32_t n2 = 0, na = 0;
            assert_int_equal(pkv_seq_block_table(c, s[2].id, t2, 20, &n2), PKV_OK);
            assert_int_equal(pkv_seq_block_table(c, again, ta, 20, &na), PKV_OK);
            assert_int_equal(ta[13], t2[13]);
            cache_ok(c);
            assert_int_equal(pkv_seq_release(c, again), PKV_OK);
            for (int i = 0; i < 4; i++) assert_int_equal(pkv_seq_release(c, s[i].id), PKV_OK);
            assert_int_equal(pkv_cache_get_stats(c, &st), PKV_OK);
            assert_int_equal(st.n_active, 0);
            cache_ok(c);
            free(q), free(out);
            pkv_cache_destroy(c);
        }
}

/* pkv_attn_tree's path part runs a node a task on the cache's threads (tree_task) where the
 * work is worth it: 1 thread, 2 threads and a caller's executor of 2 workers give the same bits
 * (with and without a prefix part; a random tree, and a chain whose paths, up to 250 rows, pass
 * the 128 rows of 64 values a worker's scratch widens at once but not the calling thread's
 * 512), the executor is called for a tree with no prefix part (so by the path part alone), and
 * one that runs nothing fails the call with its reason and leaves the cache working. */
static void test_api_tree_threads(void **state) {
    (void)state;
    static host_seq hs;
    enum { N = 250 };
    static int32_t par[N];
    static float o[3][N * NQH * D], l[3][N * NQH];
    api_exec x = {.mode = EXEC_GOOD, .n_workers = 2};
    for (uint32_t v = 0; v < 4; v++) /* a random tree, then a chain; without a prefix, then after 100 */
        for (int k = 0; k < 3; k++) {
            const int shape = v >= 2;
            const uint32_t q0 = v % 2 ? 100 : 0;
            pkv_config cfg = api_config(PKV_DTYPE_F16, k ? 2 : 1, 0);
            if (k == 2) cfg.executor = (pkv_executor){.parallel_for = api_parallel_for, .ctx = &x, .n_workers = 2};
            cfg.log = said_fn;
            pkv_cache *c = NULL;
            assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
            g_rng = 990; /* the same K/V, tree and queries in each cache */
            memset(&hs, 0, sizeof hs);
            assert_int_equal(pkv_seq_create(c, NULL, 0, &hs.id), PKV_OK);
            append_write(c, PKV_DTYPE_F16, &hs, q0 + N, 500);
            rand_tree(par, N);
            if (shape)
                for (uint32_t i = 0; i < N; i++) par[i] = (int32_t)i - 1;
            float *q = rand_q(N);
            pkv_attn_params p = pkv_attn_params_default();
            p.n_q_heads = NQH, p.lse = l[k];
            const pkv_attn_tree_req r = {hs.id, q0, N, par};
            const uint64_t jobs = x.jobs;
            assert_int_equal(pkv_attn_tree(c, 1, &r, 1, q, o[k], &p), PKV_OK);
            if (k == 0) check_tree(&hs, 1, q, o[0], l[0], NQH, q0, par, N, &p, TOL);
            else {
                assert_memory_equal(o[k], o[0], sizeof o[0]);
                assert_memory_equal(l[k], l[0], sizeof l[0]);
            }
            if (k == 2 && q0 == 0) assert_true(x.jobs > jobs);
            if (k == 2) {
                x.mode = EXEC_NONE, g_said[0] = 0;
                assert_int_equal(pkv_attn_tree(c, 1, &r, 1, q, o[k], &p), PKV_EINVAL);
                assert_non_null(strstr(g_said, "the executor broke its contract"));
                x.mode = EXEC_GOOD;
                assert_int_equal(pkv_attn_tree(c, 1, &r, 1, q, o[k], &p), PKV_OK);
                assert_memory_equal(o[k], o[0], sizeof o[0]);
            }
            free(q);
            pkv_cache_destroy(c);
        }
}

/* ---- custom masks (pkv_attn_prefill_masked) ----------------------------------------------------- */
static void bit_set(uint8_t *m, uint64_t i, bool on) {
    if (on) m[i >> 3] |= (uint8_t)(1u << (i & 7u));
    else m[i >> 3] &= (uint8_t) ~(1u << (i & 7u));
}

enum { MASK_REQS = 5 };

/* pkv_attn_prefill_masked, one call of five requests: an extend of 80 queries over 120 positions,
 * causal with a bidirectional span [60, 100) (Gemma 3's image tokens); a prompt of 90 packed as
 * three documents (edges 30 and 65), causal within each; random bits over 50 positions from
 * query 20, two rows empty; a request left causal (mask NULL) beside them; a request of no
 * queries. Plain, with a soft-cap, scale and lse, with sinks, with ALiBi (keys ahead raised), each
 * against the reference, every float dtype and the 8-bit ones, 1 and 2 threads (nt_first); in place the same
 * bits; a mask that is the causal one gives pkv_attn_prefill's results, all masks NULL its bits;
 * with PKV_ATTN_NONCAUSAL rows of the sequence's length. Past a dropped front a mask that sees none
 * of it is taken and one that sees its last key refused; a window or chunks with a mask, masks
 * NULL, a mask overlapping out or lse: PKV_EINVAL, out untouched. */
static void test_api_mask(void **state) {
    (void)state;
    static host_seq s[4];
    for (size_t ti = 0; ti < 5; ti++)
        for (uint32_t nt = nt_first(); nt <= 2; nt++) {
            g_rng = 2540u + 2u * ti + nt; /* each case its own draws: nt_first() */
            const pkv_dtype dt = q_types[ti];
            pkv_cache *c = said_cache(dt, nt);
            static const uint32_t lens[4] = {120, 90, 70, 40};
            for (int i = 0; i < 4; i++) seq_new(c, dt, &s[i], lens[i], 100 * i);
            const pkv_attn_req reqs[MASK_REQS] = {
                {s[0].id, 40, 80}, {s[1].id, 0, 90}, {s[2].id, 20, 30}, {s[3].id, 25, 15}, {s[0].id, 10, 0}};
            const host_seq *who[MASK_REQS] = {&s[0], &s[1], &s[2], &s[3], &s[0]};
            uint8_t *m[MASK_REQS] = {NULL};
            for (uint32_t r = 0; r < 3; r++) {
                const uint32_t n_q = reqs[r].n_q, kv = reqs[r].q_start + n_q;
                m[r] = calloc(((size_t)n_q * kv + 7) / 8, 1); /* exactly its bits: no spare byte */
                for (uint32_t i = 0; i < n_q; i++)
                    for (uint32_t t = 0; t < kv; t++) {
                        const uint32_t pos = reqs[r].q_start + i;
                        const bool on = r == 0   ? t <= pos || (pos >= 60 && pos < 100 && t >= 60 && t < 100)
                                        : r == 1 ? t <= pos && (pos >= 30) == (t >= 30) && (pos >= 65) == (t >= 65)
                                                 : (i != 3 && i != 17 && rnd() > 0.2f);
                        bit_set(m[r], (uint64_t)i * kv + t, on);
                    }
            }
            const uint8_t *const masks[MASK_REQS] = {m[0], m[1], m[2], NULL, m[4]};
            const uint32_t nq = 80 + 90 + 30 + 15;
            float *q = rand_q(nq), *out = malloc(sizeof(float) * nq * NQH * D), *o2 = malloc(sizeof(float) * nq * NQH * D);
            float *lse = malloc(sizeof(float) * nq * NQH), sinks[NQH], slopes[NQH];
            for (uint32_t h = 0; h < NQH; h++) sinks[h] = 4.0f * rnd() + 1.0f, slopes[h] = 0.05f * (float)(h + 1) * rnd();
            for (int variant = 0; variant < 4; variant++) {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                if (variant == 1) p.softcap = 6.0f, p.scale = 0.3f, p.lse = lse;
                if (variant == 2) p.sinks = sinks, p.lse = lse;
                if (variant == 3) p.alibi_slopes = slopes, p.lse = lse;
                const uint32_t l = (uint32_t)variant % L;
                assert_int_equal(pkv_attn_prefill_masked(c, l, reqs, MASK_REQS, masks, q, out, &p), PKV_OK);
                for (uint32_t j = 0, at = 0; j < MASK_REQS; at += reqs[j].n_q, j++) {
                    const float *qj = q + (size_t)at * NQH * D, *oj = out + (size_t)at * NQH * D;
                    const float *lj = p.lse ? lse + at * NQH : NULL;
                    check_rows(who[j], l, qj, oj, lj, reqs[j].q_start, reqs[j].n_q, &p, tol_of(dt), masks[j],
                               reqs[j].q_start + reqs[j].n_q); /* (a NULL mask: causal) */
                }
                memcpy(o2, q, sizeof(float) * nq * NQH * D); /* in place: the same bits */
                assert_int_equal(pkv_attn_prefill_masked(c, l, reqs, MASK_REQS, masks, o2, o2, &p), PKV_OK);
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
            }
            /* a causal mask: pkv_attn_prefill's results; masks all NULL: its bits */
            {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                const uint32_t kv = 120;
                uint8_t *cm = calloc(((size_t)80 * kv + 7) / 8, 1);
                for (uint32_t i = 0; i < 80; i++)
                    for (uint32_t t = 0; t <= 40 + i; t++) bit_set(cm, (uint64_t)i * kv + t, true);
                const uint8_t *const one[1] = {cm}, *const none[MASK_REQS] = {NULL};
                assert_int_equal(pkv_attn_prefill_masked(c, 0, reqs, 1, one, q, out, &p), PKV_OK);
                check_tol(&s[0], 0, q, out, NULL, 40, 80, &p, tol_of(dt));
                assert_int_equal(pkv_attn_prefill(c, 0, reqs, MASK_REQS, q, o2, &p), PKV_OK);
                assert_int_equal(pkv_attn_prefill_masked(c, 0, reqs, MASK_REQS, none, q, out, &p), PKV_OK);
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
                free(cm);
            }
            /* non-causal: rows of the sequence's length (40 queries over s[2]'s 70 positions) */
            {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH, p.flags = PKV_ATTN_NONCAUSAL, p.lse = lse;
                const pkv_attn_req nr = {s[2].id, 0, 40};
                uint8_t *nm = calloc((40 * 70 + 7) / 8, 1);
                for (uint32_t b = 0; b < 40 * 70; b++) bit_set(nm, b, rnd() > 0.5f);
                const uint8_t *const one[1] = {nm};
                assert_int_equal(pkv_attn_prefill_masked(c, 1, &nr, 1, one, q, out, &p), PKV_OK);
                pkv_attn_params pr = p;
                pr.flags = 0; /* the reference's rule: the bits alone */
                check_rows(&s[2], 1, q, out, lse, 0, 40, &pr, tol_of(dt), nm, 70);
                free(nm);
            }
            /* refusals, out untouched */
            memset(out, 0x5a, sizeof(float) * nq * NQH * D);
            memcpy(o2, out, sizeof(float) * nq * NQH * D);
            for (int bad = 0; bad < 6; bad++) {
                pkv_attn_params pb = pkv_attn_params_default();
                pb.n_q_heads = NQH;
                if (bad == 0) pb.window = 8;
                if (bad == 1) pb.attn_chunk = 16;
                if (bad == 3) pb.flags = PKV_ATTN_NONCAUSAL; /* request 0's q_start 40 */
                /* a mask overlapping out (its last bytes) or lse, which the call writes */
                const uint8_t *over[MASK_REQS] = {masks[0], masks[1], masks[2], NULL, NULL};
                if (bad == 4) over[2] = (const uint8_t *)(out + (size_t)nq * NQH * D) - 8;
                if (bad == 5) pb.lse = lse, over[1] = (const uint8_t *)lse + 4;
                g_said[0] = 0;
                assert_int_equal(pkv_attn_prefill_masked(c, 0, reqs, MASK_REQS,
                                                         bad == 2 ? NULL : bad >= 4 ? over : masks, q, out, &pb),
                                 PKV_EINVAL);
                assert_true(g_said[0] != 0);
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
            }
            { /* the request array inside out (read again after a group of max_seqs wrote out) */
                pkv_attn_req *in_out = (pkv_attn_req *)(void *)(out + 64);
                memcpy(in_out, reqs, sizeof reqs);
                memcpy(o2, out, sizeof(float) * nq * NQH * D);
                assert_int_equal(pkv_attn_prefill_masked(c, 0, in_out, MASK_REQS, masks, q, out, NULL), PKV_EINVAL);
                assert_non_null(strstr(g_said, "reqs array overlaps"));
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
            }
            /* a window without any mask set is no refusal */
            {
                pkv_attn_params pw = pkv_attn_params_default();
                pw.n_q_heads = NQH, pw.window = 8;
                const uint8_t *const none[1] = {NULL};
                assert_int_equal(pkv_attn_prefill_masked(c, 0, &reqs[3], 1, none, q, out, &pw), PKV_OK);
                check_tol(&s[3], 0, q, out, NULL, 25, 15, &pw, tol_of(dt));
            }
            /* a dropped front (s[1]'s first two blocks, [0, 32)): the third document's queries
               ([65, 90), seeing [65, ..)) are taken; the second's ([30, 65), seeing [31, ..): the
               last key dropped) refused until no query sees key 31 */
            assert_int_equal(pkv_seq_drop_front(c, s[1].id, 40), PKV_OK);
            {
                pkv_attn_params p = pkv_attn_params_default();
                p.n_q_heads = NQH;
                const pkv_attn_req late = {s[1].id, 65, 25}, mid = {s[1].id, 30, 35};
                uint8_t *dm = calloc((25 * 90 + 7) / 8, 1);
                for (uint32_t i = 0; i < 25; i++)
                    for (uint32_t t = 65; t <= 65 + i; t++) bit_set(dm, (uint64_t)i * 90 + t, true);
                const uint8_t *const one[1] = {dm};
                assert_int_equal(pkv_attn_prefill_masked(c, 0, &late, 1, one, q, out, &p), PKV_OK);
                check_rows(&s[1], 0, q, out, NULL, 65, 25, &p, tol_of(dt), dm, 90);
                uint8_t *mm = calloc((35 * 65 + 7) / 8, 1);
                for (uint32_t i = 0; i < 35; i++)
                    for (uint32_t t = 31; t <= 30 + i; t++) bit_set(mm, (uint64_t)i * 65 + t, true);
                const uint8_t *const two[1] = {mm};
                memcpy(o2, out, sizeof(float) * nq * NQH * D);
                g_said[0] = 0;
                assert_int_equal(pkv_attn_prefill_masked(c, 0, &mid, 1, two, q, out, &p), PKV_EINVAL);
                assert_non_null(strstr(g_said, "dropped"));
                assert_memory_equal(o2, out, sizeof(float) * nq * NQH * D);
                for (uint32_t i = 0; i < 35; i++) /* now no query sees 31 (the first two see nothing) */
                    bit_set(mm, (uint64_t)i * 65 + 31, false);
                assert_int_equal(pkv_attn_prefill_masked(c, 0, &mid, 1, two, q, out, &p), PKV_OK);
                check_rows(&s[1], 0, q, out, NULL, 30, 35, &p, tol_of(dt), mm, 65);
                /* a mask of no bit sees nothing, dropped or not: queries [0, 10), whose keys are all
                   dropped, taken with out 0 and lse -inf */
                const pkv_attn_req early = {s[1].id, 0, 10};
                memset(mm, 0, (35 * 65 + 7) / 8);
                p.lse = lse;
                memset(out, 0x5a, sizeof(float) * 10 * NQH * D);
                assert_int_equal(pkv_attn_prefill_masked(c, 0, &early, 1, two, q, out, &p), PKV_OK);
                for (uint32_t x = 0; x < 10 * NQH; x++) {
                    assert_true(lse[x] == -INFINITY);
                    for (uint32_t d = 0; d < D; d++) assert_true(out[(size_t)x * D + d] == 0.0f);
                }
                free(dm), free(mm);
            }
            char msg[256];
            assert_int_equal(pkv_cache_check(c, msg, sizeof msg), PKV_OK);
            for (int r = 0; r < MASK_REQS; r++) free(m[r]);
            free(q), free(out), free(o2), free(lse);
            pkv_cache_destroy(c);
        }
}

/* A sequence that grows during a masked non-causal call (a misuse: the mask's rows were sized for
 * the length the call checked): the caller's executor appends to it while the first group of
 * max_seqs requests runs, and the second group, which holds the masked request, is refused with
 * the reason, its mask never read past its bits (ASan: the mask is exactly its size). */
typedef struct grow_exec {
    pkv_cache *c;
    pkv_seq s;
    int grown;
} grow_exec;

static void grow_parallel_for(void *ctx, pkv_task_fn fn, void *job, uint32_t n) {
    grow_exec *x = ctx;
    if (!x->grown) {
        int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8}, slots[8];
        assert_int_equal(pkv_seq_append(x->c, x->s, tok, 8, slots), PKV_OK);
        x->grown = 1;
    }
    for (uint32_t k = 0; k < n; k++) fn(job, k, k % 2);
}

static void test_api_mask_length_moves(void **state) {
    (void)state;
    static host_seq s[2];
    grow_exec x = {0};
    pkv_config cfg = api_config(PKV_DTYPE_F32, 2, 0);
    cfg.log = said_fn;
    cfg.executor = (pkv_executor){.parallel_for = grow_parallel_for, .ctx = &x, .n_workers = 2};
    pkv_cache *c = NULL;
    assert_int_equal(pkv_cache_create(&cfg, &c), PKV_OK);
    pkv__cache_test_inline_work(c, 0); /* every group through the executor */
    seq_new(c, PKV_DTYPE_F32, &s[0], 40, 0);
    seq_new(c, PKV_DTYPE_F32, &s[1], 30, 500);
    x.c = c, x.s = s[1].id;
    enum { NR = 17 }; /* max_seqs 16: the masked request is in the second group */
    pkv_attn_req reqs[NR];
    const uint8_t *masks[NR] = {NULL};
    for (int i = 0; i < NR - 1; i++) reqs[i] = (pkv_attn_req){s[0].id, 0, 2};
    reqs[NR - 1] = (pkv_attn_req){s[1].id, 0, 4};
    uint8_t *bits = malloc((4 * 30 + 7) / 8);
    memset(bits, 0xff, (4 * 30 + 7) / 8);
    masks[NR - 1] = bits;
    const uint32_t nq = 2 * (NR - 1) + 4;
    float *q = rand_q(nq), *out = malloc(sizeof(float) * nq * NQH * D);
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = NQH, p.flags = PKV_ATTN_NONCAUSAL;
    g_said[0] = 0;
    assert_int_equal(pkv_attn_prefill_masked(c, 0, reqs, NR, masks, q, out, &p), PKV_EINVAL);
    assert_true(x.grown);
    assert_non_null(strstr(g_said, "length went from 30 to 38"));
    /* at the length it has now, a mask of its rows is taken */
    free(bits);
    bits = malloc((4 * 38 + 7) / 8);
    memset(bits, 0xff, (4 * 38 + 7) / 8);
    masks[NR - 1] = bits;
    assert_int_equal(pkv_attn_prefill_masked(c, 0, reqs, NR, masks, q, out, &p), PKV_OK);
    free(bits), free(q), free(out);
    pkv_cache_destroy(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_api_oracle),
        cmocka_unit_test(test_api_fork_cow),
        cmocka_unit_test(test_api_shared_prefix),
        cmocka_unit_test(test_api_bad_input),
        cmocka_unit_test(test_api_bf16_dot),
        cmocka_unit_test(test_api_bf16_v_flags_used),
        cmocka_unit_test(test_api_f16_as_bf16),
        cmocka_unit_test(test_api_fp8_bf16_dot),
        cmocka_unit_test(test_api_merge_cascade),
        cmocka_unit_test(test_api_merge_values),
        cmocka_unit_test(test_api_sinks),
        cmocka_unit_test(test_api_alibi),
        cmocka_unit_test(test_api_tree),
        cmocka_unit_test(test_api_tree_refusals_runs),
        cmocka_unit_test(test_api_tree_keep),
        cmocka_unit_test(test_api_in_place),
        cmocka_unit_test(test_api_backend_env),
        cmocka_unit_test(test_api_value_max),
        cmocka_unit_test(test_api_order_env),
        cmocka_unit_test(test_api_executor),
        cmocka_unit_test(test_api_spin),
        cmocka_unit_test(test_api_tree_threads),
        cmocka_unit_test(test_api_fork_child),
        cmocka_unit_test(test_api_share),
        cmocka_unit_test(test_api_share_window),
        cmocka_unit_test(test_api_share_chunk_cross),
        cmocka_unit_test(test_api_noncausal),
        cmocka_unit_test(test_api_share_chain),
        cmocka_unit_test(test_api_drop_front),
        cmocka_unit_test(test_api_drop_front_indexed),
        cmocka_unit_test(test_api_mask),
        cmocka_unit_test(test_api_mask_length_moves),
    };
    return TU_RUN_TESTS(tests);
}
