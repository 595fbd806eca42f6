/* test_attn.c: the paged attention kernels against a double-precision contiguous reference,
 * for every backend this CPU has, over pools built here (fragmented block tables), plus the
 * seed value, soft-cap, sliding window, chunked local attention, LSE merge and bad input. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_assert.h"
#include "tu_ref.h"
#include "tu_shard.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn.h"
#include "attn/attn_q.h"
#include "quant/quant.h"

/* ---- tolerances ------------------------------------------------------------------------------
 * Errors are measured as max |out - ref| / max |V| over the sequence: every output is a convex
 * combination of V rows, so max |V| is the output's natural scale (the output itself can be
 * near 0 when it averages thousands of random values, which would make a relative error
 * meaningless).
 * TOL_F32: the kernels accumulate q.k over head_dim <= 256 and p.v over <= 5000 keys in f32
 * (rounding ~6e-8 per operation, mostly cancelling); 1e-5 leaves a wide margin over the
 * ~1e-6 we observe, while a wrong mask, a dropped block or a bad merge gives errors >= 1e-3.
 * TOL_F16 / TOL_BF16: the reference is computed on the f16/bf16-rounded K and V the kernel
 * reads, so what remains is the same f32 accumulation: the same bound holds.
 * TOL_LSE: the log-sum-exp, absolute, relative to max(1, |lse|).
 * Past head_dim 256 (test_oracle_extreme_shapes: 1000 and 1024) each logit sums up to 4x the
 * terms, and the reference backend sums them one after the other: its error there measured 7e-6
 * (D 1000, f16 prefill), so the tolerance grows with D / 256 (dim_factor). */
#define TOL_F32 1e-5
#define TOL_F16 1e-5
#define TOL_BF16 1e-5
#define TOL_LSE 1e-5

static double dim_factor(uint32_t head_dim) { return head_dim > 256 ? head_dim / 256.0 : 1.0; }

static double tol_for(pkv_dtype k, pkv_dtype v) {
    double t = TOL_F32;
    if (k == PKV_DTYPE_F16 || v == PKV_DTYPE_F16) t = TOL_F16;
    if (k == PKV_DTYPE_BF16 || v == PKV_DTYPE_BF16) t = fmax(t, TOL_BF16);
    return t;
}

/* ---- deterministic rng ----------------------------------------------------------------------- */
static uint64_t g_rng = 1;
static uint64_t rng_u64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static uint32_t rng_below(uint32_t n) { return (uint32_t)(rng_u64() % n); }
static double rng_unit(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
/* About N(0, 1): the sum of four uniforms (16 bits each, from one draw), centred and scaled to
 * variance 1, within +-sqrt(12) = 3.46. Box-Muller's log and cos per value had been 60% of this
 * test's time, and more under qemu, where every floating-point operation is a call. */
static float rng_normal(void) {
    const uint64_t r = rng_u64();
    const uint32_t sum = (uint32_t)(r & 0xffff) + (uint32_t)(r >> 16 & 0xffff) + (uint32_t)(r >> 32 & 0xffff) +
                         (uint32_t)(r >> 48);
    return (float)(((double)sum + 2.0 - 131072.0) * (1.7320508075688772 / 65536.0));
}

/* ---- a pool built by hand -------------------------------------------------------------------- */
typedef struct tpool {
    uint32_t H, D, B, n_blocks, next_free;
    int32_t *free_ids; /* shuffled: sequences get fragmented block tables */
    uint8_t *k, *v;
    pkv__kv_view view;
} tpool;

typedef struct tseq {
    uint32_t len;
    int32_t *table;
    float *kf, *vf; /* the values the pool holds, decoded: [len][H][D] */
    float vmax;     /* max |V| */
} tseq;

static void pool_init(tpool *p, uint32_t H, uint32_t D, uint32_t B, uint32_t n_blocks, pkv_dtype kdt, pkv_dtype vdt) {
    memset(p, 0, sizeof *p);
    p->H = H, p->D = D, p->B = B, p->n_blocks = n_blocks;
    size_t krb = pkv__row_bytes(kdt, D), vrb = pkv__row_bytes(vdt, D);
    assert_true(krb && vrb);
    p->view.k_dtype = kdt, p->view.v_dtype = vdt;
    p->view.k_row_bytes = krb, p->view.v_row_bytes = vrb;
    p->view.k_block_bytes = (size_t)H * B * krb, p->view.v_block_bytes = (size_t)H * B * vrb;
    p->view.n_kv_heads = H, p->view.head_dim = D, p->view.block_tokens = B, p->view.n_blocks = n_blocks;
    size_t kb = (p->view.k_block_bytes * n_blocks + 63) & ~(size_t)63, vb = (p->view.v_block_bytes * n_blocks + 63) & ~(size_t)63;
    p->k = aligned_alloc(64, kb);
    p->v = aligned_alloc(64, vb);
    assert_non_null(p->k);
    assert_non_null(p->v);
    /* garbage everywhere: a kernel reading a slot it should not read shows up as NaN */
    memset(p->k, 0xff, kb);
    memset(p->v, 0xff, vb);
    p->view.k = p->k, p->view.v = p->v;
    p->free_ids = malloc(sizeof(int32_t) * n_blocks);
    for (uint32_t i = 0; i < n_blocks; i++) p->free_ids[i] = (int32_t)i;
    for (uint32_t i = n_blocks; i > 1; i--) {
        uint32_t j = rng_below(i);
        int32_t t = p->free_ids[i - 1];
        p->free_ids[i - 1] = p->free_ids[j];
        p->free_ids[j] = t;
    }
}

static void pool_free(tpool *p) {
    free(p->k);
    free(p->v);
    free(p->free_ids);
}

/* Writes one token's K and V (f32 [H][D] each) at position pos of s. */
static void seq_put(tpool *p, tseq *s, uint32_t pos, const float *k, const float *v) {
    const uint32_t D = p->D;
    int32_t b = s->table[pos / p->B];
    for (uint32_t h = 0; h < p->H; h++) {
        uint8_t *kr = p->k + (size_t)b * p->view.k_block_bytes + ((size_t)h * p->B + pos % p->B) * p->view.k_row_bytes;
        uint8_t *vr = p->v + (size_t)b * p->view.v_block_bytes + ((size_t)h * p->B + pos % p->B) * p->view.v_row_bytes;
        pkv__row_encode(p->view.k_dtype, k + (size_t)h * D, D, kr);
        pkv__row_encode(p->view.v_dtype, v + (size_t)h * D, D, vr);
        float *kf = s->kf + ((size_t)pos * p->H + h) * D, *vf = s->vf + ((size_t)pos * p->H + h) * D;
        pkv__row_decode(p->view.k_dtype, kr, D, kf);
        pkv__row_decode(p->view.v_dtype, vr, D, vf);
        for (uint32_t d = 0; d < D; d++) /* not fmaxf: a call per element where NaN need not be handled */
            if (fabsf(vf[d]) > s->vmax) s->vmax = fabsf(vf[d]);
    }
}

/* A sequence of len random tokens (K ~ rng_normal() * kmul, V ~ rng_normal()) on fresh shuffled blocks. */
static void seq_make(tpool *p, tseq *s, uint32_t len, float kmul) {
    memset(s, 0, sizeof *s);
    s->len = len;
    uint32_t nb = (len + p->B - 1) / p->B;
    s->table = malloc(sizeof(int32_t) * (nb + 1));
    assert_true(p->next_free + nb <= p->n_blocks);
    for (uint32_t i = 0; i < nb; i++) s->table[i] = p->free_ids[p->next_free++];
    size_t n = (size_t)len * p->H * p->D;
    s->kf = malloc(sizeof(float) * (n + 1));
    s->vf = malloc(sizeof(float) * (n + 1));
    float *k = malloc(sizeof(float) * p->H * p->D), *v = malloc(sizeof(float) * p->H * p->D);
    for (uint32_t pos = 0; pos < len; pos++) {
        for (uint32_t i = 0; i < p->H * p->D; i++) k[i] = rng_normal() * kmul, v[i] = rng_normal();
        seq_put(p, s, pos, k, v);
    }
    free(k);
    free(v);
}

static void seq_free(tseq *s) {
    free(s->table);
    free(s->kf);
    free(s->vf);
}

/* ---- the reference: plain contiguous attention in double -------------------------------------- */
/* A custom mask's row for the reference: key t (of [0, n)) is seen where bit bit0 + t of bits is
 * set (bit i: bit i % 8 of byte i / 8, numpy's packbits(bitorder="little")). */
typedef struct ref_mask {
    const uint8_t *bits;
    uint64_t bit0;
    uint32_t n;
} ref_mask;

static bool mask_bit(const uint8_t *bits, uint64_t i) { return bits[i >> 3] >> (i & 7u) & 1u; }

/* The query at position pos: causal under the window and chunks, or, where mk is set, the keys
 * its row sets (pos then only ALiBi's). A query that sees no key gets 0 (lse: the sink's, or -inf). */
TU_ORACLE static void ref_query(const tpool *p, const tseq *s, uint32_t n_q_heads, const float *q, uint32_t pos, double scale,
                      double softcap, uint32_t window, uint32_t chunk, const float *sinks, const float *alibi,
                      const ref_mask *mk, double *out, double *lse) {
    const uint32_t D = p->D, G = n_q_heads / p->H;
    uint32_t lo = (window && pos + 1 > window) ? pos + 1 - window : 0;
    if (chunk && pos / chunk * chunk > lo) lo = pos / chunk * chunk; /* the query's chunk's first key */
    const uint32_t n_all = mk ? mk->n : pos + 1;
    uint32_t *keys = malloc(sizeof(uint32_t) * n_all), nk = 0; /* the keys it sees */
    for (uint32_t t = mk ? 0 : lo; t < n_all; t++)
        if (!mk || mask_bit(mk->bits, mk->bit0 + t)) keys[nk++] = t;
    /* the G query heads of a kv head together, so each K and V row is read once for all of them
       (the reference had been a fifth of test_attn's time); each head's sums in the same order as
       one head at a time */
    double *w = malloc(sizeof(double) * ((size_t)nk * G + 1)), mx[256], sum[256];
    assert_true(G <= 256);
    for (uint32_t h = 0; h < p->H; h++) {
        for (uint32_t g = 0; g < G; g++) mx[g] = -INFINITY;
        for (uint32_t i = 0; i < nk; i++) {
            const uint32_t t = keys[i];
            const float *kr = s->kf + ((size_t)t * p->H + h) * D;
            for (uint32_t g = 0; g < G; g++) {
                const uint32_t hq = h * G + g;
                double x = tu_dot(q + (size_t)hq * D, kr, D) * scale;
                if (softcap > 0) x = softcap * tanh(x / softcap);
                if (alibi) x += (double)alibi[hq] * ((double)t - (double)pos); /* after the cap */
                w[(size_t)g * nk + i] = x;
                mx[g] = fmax(mx[g], x);
            }
        }
        for (uint32_t g = 0; g < G; g++) {
            const uint32_t hq = h * G + g;
            if (sinks) mx[g] = fmax(mx[g], sinks[hq]); /* a key of this logit and value 0 */
            sum[g] = sinks ? exp(sinks[hq] - mx[g]) : 0;
            double *wg = w + (size_t)g * nk;
            for (uint32_t i = 0; i < nk; i++) sum[g] += (wg[i] = exp(wg[i] - mx[g]));
        }
        for (uint32_t g = 0; g < G; g++) memset(out + (size_t)(h * G + g) * D, 0, sizeof(double) * D);
        for (uint32_t i = 0; i < nk; i++) {
            const float *vr = s->vf + ((size_t)keys[i] * p->H + h) * D;
            for (uint32_t g = 0; g < G; g++) {
                const double wi = w[(size_t)g * nk + i];
                double *o = out + (size_t)(h * G + g) * D;
                for (uint32_t d = 0; d < D; d++) o[d] += wi * vr[d];
            }
        }
        for (uint32_t g = 0; g < G; g++) {
            const uint32_t hq = h * G + g;
            double *o = out + (size_t)hq * D;
            if (nk)
                for (uint32_t d = 0; d < D; d++) o[d] /= sum[g];
            if (lse) lse[hq] = sum[g] > 0 ? mx[g] + log(sum[g]) : -INFINITY;
        }
    }
    free(w);
    free(keys);
}

/* Compares the n_q queries of one item with the reference; returns the worst scaled error. */
/* The error of n outputs against the reference's, in units of max |V| (NaN: infinite). */
static double rows_err(const float *out, const double *ref, size_t n, float vmax) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)out[i] - ref[i]) / fmax(vmax, 1e-30);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

/* A log-sum-exp's error: where the reference's is -inf (no key seen, no sink) it must be exactly
 * that; else relative to max(1, |reference|) (NaN: infinite). */
static double lse_err_of(float got, double ref) {
    if (isinf(ref)) return got == -INFINITY ? 0 : INFINITY;
    const double e = fabs((double)got - ref) / fmax(1.0, fabs(ref));
    return isnan(e) ? INFINITY : e;
}

static double check_item(const tpool *p, const tseq *s, uint32_t nqh, const pkv__attn_item *it, const pkv__attn_call *c,
                         double *lse_err) {
    const uint32_t D = p->D;
    double *ro = malloc(sizeof(double) * nqh * D), *rl = malloc(sizeof(double) * nqh);
    double worst = 0;
    for (uint32_t qi = 0; qi < it->n_q; qi++) {
        const ref_mask mk = {.bits = it->mask, .bit0 = (uint64_t)qi * it->mask_row, .n = it->mask_row};
        ref_query(p, s, nqh, it->q + (size_t)qi * nqh * D, (it->mask ? it->mask_pos0 : it->q_pos0) + qi, c->scale,
                  c->softcap, c->window, c->chunk, c->sinks, c->alibi, it->mask ? &mk : NULL, ro, rl);
        worst = fmax(worst, rows_err(it->out + (size_t)qi * nqh * D, ro, (size_t)nqh * D, s->vmax));
        for (uint32_t h = 0; it->lse && h < nqh; h++)
            *lse_err = fmax(*lse_err, lse_err_of(it->lse[(size_t)qi * nqh + h], rl[h]));
    }
    free(ro);
    free(rl);
    return worst;
}

/* ---- backend selection ----------------------------------------------------------------------- */
typedef struct backend_case {
    const char *name;
} backend_case;

/* A context with the named backend. "avx512-emu" is the AVX-512 kernels compiled for AVX2
 * (src/attn/x86/avx512_emu.h) over the avx2 table, when CMake linked them in (SIMDe found). */
#ifdef PKV_TEST_AMX_EMU
/* "avx512-amx-emu": avx512-vnni whose PKV_ATTN_BF16_DOT table is the AMX one, its tiles emulated */
static void fill_amx_emu(pkv__attn_kernels *kt) {
    kt->name = "avx512-amx-emu";
    kt->lp_fill = pkv__attn_lp_fill_amx_emu;
    kt->f16_fill = pkv__attn_f16_fill_amx_emu;
}
#endif

static int create_named(const char *backend, uint32_t n_threads, const pkv__attn_limits *lim, pkv__attn **out) {
#ifdef PKV_HAVE_AVX512_EMU
    if (!strcmp(backend, "avx512-emu"))
        return pkv__attn_create_extended(NULL, n_threads, lim, "avx2", pkv__attn_fill_avx512_emu, out);
#endif
    if (!strcmp(backend, "avx512-amx-emu")) { /* its fallbacks are the vdpbf16ps kernels */
#ifdef PKV_TEST_AMX_EMU
        if (!(pkv__cpu_features() & PKV_CPU_AVX512BF16)) return PKV_ENOTSUP;
        return pkv__attn_create_extended(NULL, n_threads, lim, "avx512-vnni", fill_amx_emu, out);
#else
        return PKV_ENOTSUP;
#endif
    }
    return pkv__attn_create_backend(NULL, n_threads, lim, backend, out);
}

/* Creates a context with the named backend, or skips the test when this CPU lacks it. */
static pkv__attn *make_attn(const char *backend, uint32_t n_threads, uint32_t max_items, uint32_t max_blocks,
                            uint32_t H, uint32_t D, uint32_t B) {
    pkv__attn_limits lim = {.max_items = max_items, .max_blocks_per_seq = max_blocks, .n_kv_heads = H, .head_dim = D,
                            .block_tokens = B, .spin_us = PKV__SPIN_US_DEFAULT};
    pkv__attn *at = NULL;
    int rc = create_named(backend, n_threads, &lim, &at);
    if (rc == PKV_ENOTSUP) return NULL;
    assert_int_equal(rc, PKV_OK);
    assert_string_equal(pkv__attn_backend_name(at), backend);
    assert_int_equal(pkv__attn_n_threads(at), n_threads);
    return at;
}

/* Skips the calling test before it allocates anything when this CPU or build lacks the backend,
 * when PKV_ATTN_TEST_BACKENDS (a comma-separated list of names) is set and does not name it, or
 * when PKV_ATTN_TEST_EXCLUDE names it; a backend PKV_ATTN_TEST_BACKENDS names must exist (the
 * test fails otherwise). The emulated arm64 stage of scripts/test.sh runs only "neon" this way
 * (the reference is tested natively); ctest runs "avx512-emu" as an entry of its own. */
static void need_backend(const char *backend) {
    const char *only = getenv("PKV_ATTN_TEST_BACKENDS"), *except = getenv("PKV_ATTN_TEST_EXCLUDE");
    if (only && *only && !tu_matches(only, backend)) skip(); /* tu_shard.h: comma-separated names */
    if (except && tu_matches(except, backend)) skip();
    pkv__attn_limits lim = {.max_items = 1, .max_blocks_per_seq = 1, .n_kv_heads = 1, .head_dim = 8, .block_tokens = 1};
    pkv__attn *at = NULL;
    int rc = create_named(backend, 1, &lim, &at);
    if (rc == PKV_ENOTSUP && only && *only) fail_msg("backend %s was asked for by name but is not available", backend);
    if (rc == PKV_ENOTSUP) skip();
    assert_int_equal(rc, PKV_OK);
    pkv__attn_destroy(at);
}

static float *rand_q(size_t n) {
    float *q = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) q[i] = rng_normal();
    return q;
}

/* ---- seed value (SEEDS.md test 40) ------------------------------------------------------------ */
/* One query, H = 1, D = 4, scale 1, B = 3. Block 0 holds 3 tokens with K = 0.1, V = 0.2 (every
 * element); block 1 holds 2 tokens with K = 0.5, V = 0.6; the query is all ones. Logits are
 * 0.4 (x3) and 2.0 (x2): out = (3e^0.4 * 0.2 + 2e^2 * 0.6) / (3e^0.4 + 2e^2) = 0.5070205 for
 * every element. The blocks are placed at ids 1 and 0 (reversed) to exercise the table. */
static void test_seed_value(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    for (uint32_t nt = 1; nt <= 2; nt++) {
        pkv__attn *at = make_attn(bc->name, nt, 1, 2, 1, 4, 3);
        if (!at) skip();
        float kbuf[2][3][4], vbuf[2][3][4];
        for (int b = 0; b < 2; b++)
            for (int t = 0; t < 3; t++)
                for (int d = 0; d < 4; d++) {
                    /* block id 1 = logical block 0, block id 0 = logical block 1; slot 2 of block
                     * id 0 is past the end: NaN there must not leak into the result */
                    kbuf[b][t][d] = b == 1 ? 0.1f : (t < 2 ? 0.5f : NAN);
                    vbuf[b][t][d] = b == 1 ? 0.2f : (t < 2 ? 0.6f : NAN);
                }
        pkv__kv_view kv = {.k = (const uint8_t *)kbuf, .v = (const uint8_t *)vbuf, .k_dtype = PKV_DTYPE_F32,
                           .v_dtype = PKV_DTYPE_F32, .k_row_bytes = 16, .v_row_bytes = 16, .k_block_bytes = 48,
                           .v_block_bytes = 48, .n_kv_heads = 1, .head_dim = 4, .block_tokens = 3, .n_blocks = 2};
        const int32_t table[2] = {1, 0};
        const float q[4] = {1, 1, 1, 1};
        float out[4] = {0}, lse = 0;
        pkv__attn_item it = {.block_table = table, .q_pos0 = 4, .n_q = 1, .q = q, .out = out, .lse = &lse};
        pkv__attn_call call = {.n_q_heads = 1, .scale = 1.0f};
        assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_OK);
        for (int d = 0; d < 4; d++) TU_NEAR(out[d], 0.5070205f, 1e-6f);
        TU_NEAR(lse, (float)log(3 * exp(0.4) + 2 * exp(2.0)), 1e-5f);
        pkv__attn_destroy(at);
    }
}

/* ---- the oracle ------------------------------------------------------------------------------- */
static const uint32_t k_dims[] = {64, 80, 128, 256};
static const uint32_t k_heads[][2] = {{1, 1}, {8, 8}, {32, 8}, {8, 1}}; /* n_q_heads, n_kv_heads */
static const pkv_dtype k_types[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};

/* A random context length: mostly short, sometimes long (up to 5000, or PKV_ATTN_TEST_MAX_LEN:
 * the sanitizer stage of scripts/test.sh lowers it, every shape and dtype still runs). */
static uint32_t max_len(void) {
    static uint32_t m;
    if (!m) {
        const char *e = getenv("PKV_ATTN_TEST_MAX_LEN");
        long v = e ? strtol(e, NULL, 10) : 0;
        m = v >= 20 && v <= 5000 ? (uint32_t)v : 5000;
    }
    return m;
}

static uint32_t rand_len(void) {
    uint32_t len;
    switch (rng_below(4)) {
    case 0: len = 1 + rng_below(20); break;
    case 1: len = 1 + rng_below(300); break;
    case 2: len = 1 + rng_below(1500); break;
    default: len = 1 + rng_below(5000); break;
    }
    return len <= max_len() ? len : 1 + len % max_len();
}

/* ---- PKV_ATTN_BF16_DOT ------------------------------------------------------------------------
 * Where the backend scores bf16 K by bf16 dot products (pkv__attn_lp), each query row times scale
 * is rounded to bf16, nearest even: the reference then takes those rounded queries (and scale 1),
 * so the score side is checked as tightly as ever. Where it takes p.V of bf16 V by dot products
 * (pkv__attn_lp_v), each weight p = exp(s - m) is rounded to bf16 too (8 significant bits: relative
 * error <= 2^-8) while the sum l is not: |out - ref| <= 2^-8 sum p |V| / sum p <= 2^-8 max |V|, so
 * TOL_BF16_DOT = 2^-7 of max |V| (twice the bound; measured: 0.28 of it). The lse is unchanged by that rounding:
 * TOL_LSE. Elsewhere the flag changes nothing: the same bits as without it. Decode (the sweep
 * too: several fragmented sequences) and extends of fewer than 16 rows a kv head (the row path)
 * or more (the transposed primitives, on units of 16 rows and up). */
#define TOL_BF16_DOT (1.0 / 128.0)
/* Whether a call with PKV_ATTN_BF16_DOT may round V's weights: where the row path's accum does
 * (pkv__attn_lp_v), or for a bf16 V whose transposed primitives differ from the base's
 * (avx512-amx: its tile units, and their vdpbf16ps fallbacks, round their weights; its row path
 * keeps f32 weights, pkv__attn_lp_rows_f32) */
static bool lp_v_any(const pkv__attn *at, pkv_dtype kdt, pkv_dtype vdt) {
    return pkv__attn_lp_v(at, vdt) || (vdt == PKV_DTYPE_BF16 && pkv__attn_lp_t(at, kdt, vdt));
}
/* check_item's error in units of the tolerance of (kdt, vdt), for a call whose kernels may have
 * rounded as PKV_ATTN_BF16_DOT lets them: where K was scored in bf16 (lp_k) the reference takes
 * the queries times scale rounded to bf16 (and scale 1); where p.V took bf16 weights (lp_v) the
 * tolerance is TOL_BF16_DOT more. */
static double check_item_lp(const tpool *p, const tseq *s, uint32_t nqh, const pkv__attn_item *it,
                            const pkv__attn_call *call, pkv_dtype kdt, pkv_dtype vdt, bool lp_k, bool lp_v,
                            double *lse_err) {
    const uint32_t D = p->D;
    pkv__attn_item ri = *it;
    pkv__attn_call rc = *call;
    float *qr = NULL;
    if (lp_k) {
        const size_t n = (size_t)it->n_q * nqh * D;
        qr = malloc(sizeof(float) * n);
        for (size_t x = 0; x < n; x++) qr[x] = tu_bf16(it->q[x] * call->scale);
        ri.q = qr, rc.scale = 1.0f;
    }
    const double tol = (lp_v ? TOL_BF16_DOT : 0) + tol_for(kdt, vdt) * dim_factor(D);
    const double e = check_item(p, s, nqh, &ri, &rc, lse_err) / tol;
    free(qr);
    return e;
}

/* ---- PKV_ATTN_F16_AS_BF16 ---------------------------------------------------------------------
 * Where it applies (pkv__attn_f16bf: avx512-amx), a unit of the transposed path (16 rows a kv
 * head and more) with head_dim a multiple of 32 scores f16 K as bf16 against its queries times
 * scale rounded to bf16; with v_dim a multiple of 32 its first rows in 16s take f16 V as bf16 and
 * their weights rounded to bf16. Other units, and a unit's rows past a multiple of 16 for V,
 * compute as without the flag. Which unit a row fell in is the planner's business, so each
 * output row is checked against the two references it may have taken, exact or with the queries
 * times scale and K rounded as the tiles round them, and counts the nearer; V's side is in the
 * tolerance: its values' rounding moves an output by up to 2^-8 of max |V|, the weights' by
 * 2^-8 more (TOL_BF16_DOT: 2^-7, once the bound; lp_v: a bf16 V's weights under PKV_ATTN_BF16_DOT,
 * the same). The lse likewise (the weights' rounding does not move it). */
/* The check of a call whose tile units may have rounded: rk, their queries times scale (and
 * where kround is set, K's values) to bf16, each output row checked against the exact reference
 * and the rounded one, the nearer counted; vtol: TOL_BF16_DOT more for V's side. The exact
 * reference is the row path's: for q8_0 and q4_0 K its queries times scale quantized to int8 per
 * 32 (pkv__attn_prep_q8, the row path's own, bit for bit) and taken back (times their dq). */
static double check_item_tiles(const tpool *p, const tseq *s, uint32_t nqh, const pkv__attn_item *it,
                               const pkv__attn_call *c, pkv_dtype kdt, pkv_dtype vdt, bool rk, bool kround, bool vtol,
                               double *lse_err) {
    const uint32_t D = p->D;
    const bool qi8 = kdt == PKV_DTYPE_Q8_0 || kdt == PKV_DTYPE_Q4_0;
    tseq sr = *s;
    float *kr = NULL, *qr = malloc(sizeof(float) * nqh * D), *q8 = malloc(sizeof(float) * nqh * D);
    uint8_t *qp = malloc(PKV__ATTN_QROW_BYTES(D));
    if (rk && kround) {
        const size_t n = (size_t)s->len * p->H * D;
        kr = malloc(sizeof(float) * (n + 1));
        for (size_t x = 0; x < n; x++) kr[x] = tu_bf16(s->kf[x]);
        sr.kf = kr;
    }
    double *ro[2], *rl[2], worst = 0;
    for (int r = 0; r < 2; r++) ro[r] = malloc(sizeof(double) * nqh * D), rl[r] = malloc(sizeof(double) * nqh);
    for (uint32_t qi = 0; qi < it->n_q; qi++) {
        const ref_mask mk = {.bits = it->mask, .bit0 = (uint64_t)qi * it->mask_row, .n = it->mask_row};
        const float *q = it->q + (size_t)qi * nqh * D;
        const uint32_t pos = (it->mask ? it->mask_pos0 : it->q_pos0) + qi;
        if (qi8) {
            for (uint32_t h = 0; h < nqh; h++) {
                pkv__attn_prep_q8(q + (size_t)h * D, D, 1, D, c->scale, qp);
                const int8_t *qs = (const int8_t *)qp;
                const float *dq = (const float *)(const void *)(qp + 2 * (size_t)D);
                for (uint32_t d = 0; d < D; d++) q8[(size_t)h * D + d] = (float)qs[d] * dq[d / 32];
            }
        }
        ref_query(p, s, nqh, qi8 ? q8 : q, pos, qi8 ? 1.0 : c->scale, c->softcap, c->window, c->chunk, c->sinks,
                  c->alibi, it->mask ? &mk : NULL, ro[0], rl[0]);
        if (rk) {
            for (uint32_t x = 0; x < nqh * D; x++) qr[x] = tu_bf16(q[x] * c->scale);
            ref_query(p, &sr, nqh, qr, pos, 1.0, c->softcap, c->window, c->chunk, c->sinks, c->alibi,
                      it->mask ? &mk : NULL, ro[1], rl[1]);
        }
        for (uint32_t h = 0; h < nqh; h++) {
            double e[2] = {0, 0}, le[2] = {0, 0};
            for (int r = 0; r < (rk ? 2 : 1); r++) {
                e[r] = rows_err(it->out + ((size_t)qi * nqh + h) * D, ro[r] + (size_t)h * D, D, s->vmax);
                if (it->lse) le[r] = lse_err_of(it->lse[(size_t)qi * nqh + h], rl[r][h]);
            }
            const double eh = rk ? fmin(e[0], e[1]) : e[0], lh = rk ? fmin(le[0], le[1]) : le[0];
            worst = fmax(worst, eh), *lse_err = fmax(*lse_err, lh);
        }
    }
    for (int r = 0; r < 2; r++) free(ro[r]), free(rl[r]);
    free(qr), free(kr), free(q8), free(qp);
    return worst / ((vtol ? TOL_BF16_DOT : 0) + tol_for(kdt, vdt) * dim_factor(D));
}

static double check_item_f16bf(const tpool *p, const tseq *s, uint32_t nqh, const pkv__attn_item *it,
                               const pkv__attn_call *c, pkv_dtype kdt, pkv_dtype vdt, bool lp_v, double *lse_err) {
    const bool rk = kdt == PKV_DTYPE_F16 && p->D % 32 == 0, rv = vdt == PKV_DTYPE_F16 && p->D % 32 == 0;
    return check_item_tiles(p, s, nqh, it, c, kdt, vdt, rk, true, rv || lp_v, lse_err);
}

/* The dtypes PKV_ATTN_BF16_DOT takes on avx512-amx's tiles alone: their values are bf16 exactly */
static bool tiles_exact(pkv_dtype dt) {
    return dt == PKV_DTYPE_FP8_E4M3 || dt == PKV_DTYPE_Q8_0 || dt == PKV_DTYPE_Q4_0;
}

/* PKV_ATTN_BF16_DOT over fp8 e4m3, q8_0 or q4_0 K or V where it applies (pkv__attn_lp_tiles:
 * avx512-amx's tiles, head_dim a multiple of 32): a tile unit's queries times scale are rounded
 * to bf16 (K's codes or integers are bf16 exactly, their scales applied to the sums in f32), its
 * first rows in 16s round their weights times V's scales (TOL_BF16_DOT, as for a bf16 V; lp_v: a
 * bf16 V beside such a K); other units compute as without the flag: check_item_tiles. used: the
 * flag applies (else every unit computes as without it, q8_0 and q4_0 K on int8 queries). */
static double check_item_qbf(const tpool *p, const tseq *s, uint32_t nqh, const pkv__attn_item *it,
                             const pkv__attn_call *c, pkv_dtype kdt, pkv_dtype vdt, bool used, bool lp_v,
                             double *lse_err) {
    const bool rk = used && tiles_exact(kdt) && p->D % 32 == 0, rv = used && tiles_exact(vdt) && p->D % 32 == 0;
    return check_item_tiles(p, s, nqh, it, c, kdt, vdt, rk, false, rv || lp_v, lse_err);
}

typedef struct oracle_opts {
    int prefill;     /* 0: decode items (one query at the end); 1: prefill / extend items */
    int softcap;     /* random soft-cap */
    int window;      /* random sliding window */
    int sinks;       /* random attention-sink logits */
    int alibi;       /* random ALiBi slopes (rand_alibi) */
    int chunk;       /* random chunks of local attention (rand_chunk) */
    int mask;        /* prefill items of random custom masks (rand_mask) */
    uint32_t block_tokens; /* 0: drawn from k_btok */
    uint32_t len_cap;      /* 0: rand_len() alone; else contexts of at most this many tokens */
    int bf16_dot;          /* calls with PKV_ATTN_BF16_DOT, bf16 K (V bf16 or drawn): the reference takes
                              the queries rounded as the kernel does, the tolerance TOL_BF16_DOT more */
    int f16bf;             /* calls with PKV_ATTN_F16_AS_BF16, f16 K (V f16 or drawn): check_item_f16bf */
    int qbf;               /* with bf16_dot: K of dtype qbf_k (fp8 e4m3, q8_0, q4_0; V the same or drawn),
                              check_item_qbf where the tiles apply */
    pkv_dtype qbf_k;
} oracle_opts;

/* ALiBi slopes for nqh heads into a: one case in two the models' own, 2^(-8 (h + 1) / nqh); else
 * each drawn from steep (up to 2: only the nearest keys count), shallow (2^-12 .. 2^-4: the
 * context's far end still weighs) and slightly negative (down to -2^-9: the far end leads, with
 * logits that stay within f32's rounding over 5,000 positions). */
static void rand_alibi(float *a, uint32_t nqh) {
    const bool model = rng_below(2);
    for (uint32_t h = 0; h < nqh; h++) {
        const uint32_t k = rng_below(4);
        a[h] = model ? (float)pow(2.0, -8.0 * (h + 1) / nqh)
               : k == 0 ? (float)(2.0 * rng_unit())
               : k == 3 ? (float)(-pow(2.0, -9.0) * rng_unit())
                        : (float)pow(2.0, -12.0 + 8.0 * rng_unit());
    }
}

/* Chunked local attention's chunk size for blocks of B tokens: one case in two a multiple of B
 * (as models' 8192 is of every block size), else any size from 1 (edges inside blocks); prefill
 * gets short ones, so that its runs of up to 20 queries cross chunk edges. */
static uint32_t rand_chunk(uint32_t B, bool prefill) {
    const uint32_t most = prefill ? 120 : 900;
    return rng_below(2) ? B * (1 + rng_below(most / B + 1)) : 1 + rng_below(most);
}

/* A custom mask for n_q queries at real positions pos0 on over keys [0, kv_len), rows of kv_len
 * bits, in one of the shapes masks take: random bits (sparse, even, dense); causal with
 * bidirectional spans (Gemma 3's image tokens, PaliGemma's prefix); causal within documents
 * (packed sequences); causal with whole runs of keys off (block-sparse); one key a query (one
 * case in two a block's first: a tile then reads blocks where each row sees one key, or none,
 * and must skip only the latter). One case in three then
 * clears a few queries' rows (they see nothing). The item's key range goes to *k_start and
 * *k_end: one case in two that of the bits set (the first one's block on), else all of [0, kv_len). */
static uint8_t *rand_mask(uint32_t n_q, uint32_t pos0, uint32_t kv_len, uint32_t B, uint32_t *k_start,
                          uint32_t *k_end) {
    const uint64_t n_bits = (uint64_t)n_q * kv_len;
    uint8_t *m = calloc((n_bits + 7) / 8, 1); /* exactly its bits: a read past them is ASan's */
    const uint32_t shape = rng_below(5), cut = 1 + rng_below(kv_len), cut2 = rng_below(kv_len + 1);
    const bool at_block = rng_below(2);
    const double density = (double[]){0.03, 0.5, 0.97}[rng_below(3)];
    const uint32_t span0 = PKV_MIN(cut, cut2), span1 = PKV_MAX(cut, cut2); /* a span, or two documents' edge */
    for (uint32_t qi = 0; qi < n_q; qi++) {
        const uint32_t p = pos0 + qi;
        const uint32_t one = at_block ? rng_below(kv_len) / B * B : rng_below(kv_len); /* shape 4's key */
        for (uint32_t t = 0; t < kv_len; t++) {
            bool on;
            switch (shape) {
            case 0: on = rng_unit() < density; break;
            case 1: on = t <= p || (p >= span0 && p < span1 && t >= span0 && t < span1); break;
            case 2: on = t <= p && (p < cut) == (t < cut); break;
            case 4: on = t == one; break;
            default: on = t <= p && !(t >= span0 && t < span1); break;
            }
            if (on) m[((uint64_t)qi * kv_len + t) >> 3] |= (uint8_t)(1u << (((uint64_t)qi * kv_len + t) & 7u));
        }
    }
    if (rng_below(3) == 0)
        for (uint32_t k = 0, n = 1 + rng_below(2); k < n; k++) {
            const uint32_t qi = rng_below(n_q);
            for (uint32_t t = 0; t < kv_len; t++) {
                const uint64_t b = (uint64_t)qi * kv_len + t;
                m[b >> 3] &= (uint8_t) ~(1u << (b & 7u));
            }
        }
    uint32_t lo = kv_len, hi = 0;
    for (uint64_t b = 0; b < n_bits; b++)
        if (mask_bit(m, b)) lo = PKV_MIN(lo, (uint32_t)(b % kv_len)), hi = PKV_MAX(hi, (uint32_t)(b % kv_len));
    if (lo == kv_len) lo = hi = kv_len - 1; /* no bit set: the last key's block, read and all masked */
    if (rng_below(2)) *k_start = lo / B * B, *k_end = hi + 1;
    else *k_start = 0, *k_end = kv_len;
    return m;
}

/* One random case: a batch of sequences in one pool, one run, every query checked. */
/* The oracle cases' turn through the prefetch paths, the transposed and row paths and the row
 * path's pieces (oracle_case). run_oracle_dims and the other callers start it from their seed, so
 * a test's cases are the same alone (PKV_TEST_FILTER) as after other tests. */
static unsigned g_case;

static void oracle_case(const char *backend, uint32_t n_threads, uint32_t D, uint32_t nqh, uint32_t H, pkv_dtype kdt,
                        pkv_dtype vdt, const oracle_opts *o, double *worst, double *worst_lse) {
    static const uint32_t k_btok[] = {1, 3, 16, 16, 16, 32};
    const uint32_t B_drawn = k_btok[rng_below(6)];
    const uint32_t B = o->block_tokens ? o->block_tokens : B_drawn;
    const uint32_t n_seqs = 1 + rng_below(4);
    tseq seqs[4];
    uint32_t lens[4], total_blocks = 0, max_blocks = 0;
    for (uint32_t i = 0; i < n_seqs; i++) {
        /* big shapes get shorter contexts to bound the run time of the double reference */
        lens[i] = rand_len();
        if (o->len_cap && lens[i] > o->len_cap) lens[i] = 1 + lens[i] % o->len_cap;
        if ((size_t)H * D > 1024 && lens[i] > 2500) lens[i] = 1 + lens[i] / 2;
        if (o->prefill && lens[i] > 2000) lens[i] = 1 + lens[i] / 3;
        uint32_t nb = (lens[i] + B - 1) / B;
        total_blocks += nb;
        max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    tpool p;
    pool_init(&p, H, D, B, total_blocks + 3, kdt, vdt);
    /* peaky and flat attention both: scale q.k by 1/sqrt(D) times 0.5 .. 4 */
    const float kmul = (float)(0.5 + 3.5 * rng_unit());
    for (uint32_t i = 0; i < n_seqs; i++) seq_make(&p, &seqs[i], lens[i], kmul);
    pkv__attn *at = make_attn(backend, n_threads, n_seqs, max_blocks, H, D, B);
    if (!at) {
        for (uint32_t i = 0; i < n_seqs; i++) seq_free(&seqs[i]);
        pool_free(&p);
        skip();
    }
    const unsigned n_case = g_case++; /* the prefetch paths in turn, whatever this CPU would pick, and the */
    pkv__attn_set_prefetch(at, n_case & 1u, n_case >> 1 & 1u, n_case >> 3 & 1u, n_case >> 4 & 1u);
    pkv__attn_set_tpath(at, !(n_case >> 2 & 1u)); /* transposed path and the row path (attn.h) */
    /* the row path's runs whole, or in pieces of 64 B to 4 KiB of K (4 keys at least: pieces that
     * do not divide the visible keys, start past key 0 and end in a mask) */
    pkv__attn_set_pieces(at, n_case >> 5 & 1u ? 0 : 64u << rng_below(7));
    pkv__attn_call call = {.n_q_heads = nqh, .scale = (float)(1.0 / sqrt((double)D))};
    /* caps near the logits, and (one case in four) far above them, where tanh(x / cap) is tiny */
    if (o->softcap) call.softcap = rng_below(4) ? (float)(1.0 + 30.0 * rng_unit()) : (float)pow(10.0, 2.0 + 28.0 * rng_unit());
    if (o->window) call.window = 1 + rng_below(600);
    if (o->chunk) call.chunk = rand_chunk(B, o->prefill);
    float *sinks = NULL;
    if (o->sinks) { /* near the logits, far above them (the sink leads: outputs shrink) and far below */
        sinks = malloc(sizeof(float) * nqh);
        for (uint32_t h = 0; h < nqh; h++) {
            const uint32_t k = rng_below(4);
            sinks[h] = (float)(k < 2 ? -4.0 + 12.0 * rng_unit()
                               : k == 2 ? 8.0 + 12.0 * rng_unit() : -30.0 + 26.0 * rng_unit());
        }
        call.sinks = sinks;
    }
    float *alibi = NULL;
    if (o->alibi) {
        alibi = malloc(sizeof(float) * nqh);
        rand_alibi(alibi, nqh);
        call.alibi = alibi;
    }
    pkv__attn_item items[4];
    for (uint32_t i = 0; i < n_seqs; i++) {
        uint32_t n_q = 1, pos0 = lens[i] - 1;
        if (o->prefill) {
            /* extend: up to 20 queries ending anywhere; or a whole short prompt */
            n_q = 1 + rng_below(lens[i] < 20 ? lens[i] : 20);
            if (lens[i] <= 160 && rng_below(2)) n_q = lens[i];
            pos0 = rng_below(lens[i] - n_q + 1);
        }
        items[i] = (pkv__attn_item){.block_table = seqs[i].table, .q_pos0 = pos0, .n_q = n_q,
                                    .q = rand_q((size_t)n_q * nqh * D),
                                    .out = malloc(sizeof(float) * n_q * nqh * D),
                                    .lse = rng_below(2) ? malloc(sizeof(float) * n_q * nqh) : NULL};
        if (o->mask) { /* over the request's keys [0, pos0 + n_q), or (non-causal) the whole sequence */
            pkv__attn_item *it = &items[i];
            const uint32_t kv_len = rng_below(2) ? pos0 + n_q : lens[i];
            it->mask = rand_mask(n_q, pos0, kv_len, B, &it->k_start, &it->k_end);
            it->mask_row = kv_len, it->mask_pos0 = pos0, it->q_pos0 = kv_len; /* nominal positions */
        }
    }
    /* A mask lets a query see keys ahead of it, which positive slopes raise: the leading logits
     * are then slope x distance, rounded to f32 (as negative slopes' far keys: pkv.h), so the
     * slopes are held to 8 over the farthest distance ahead, where that rounding stays under 1e-6. */
    for (uint32_t i = 0; alibi && o->mask && i < n_seqs; i++) {
        const float most = 8.0f / (float)PKV_MAX(1u, items[i].mask_row - items[i].mask_pos0);
        for (uint32_t h = 0; h < nqh; h++) alibi[h] = PKV_MAX(-most, PKV_MIN(alibi[h], most));
    }
    if (o->bf16_dot) call.flags = PKV_ATTN_BF16_DOT;
    if (o->f16bf) call.flags |= PKV_ATTN_F16_AS_BF16;
    assert_int_equal(pkv__attn_run(at, &p.view, items, n_seqs, &call), PKV_OK);
    /* The row path in two passes (a window's K, then its V: attn.c, pass_window) or in one gives
     * the same bits; windows of 1 to 3 blocks put their edges everywhere, 0 the default size. */
    {
        const bool two = pkv__attn_two_pass(at);
        const uint32_t pieces = pkv__attn_piece_bytes(at);
        /* two passes take runs whole: compare them with one pass that does too (pieces take more
         * online-softmax steps, so their bits differ) */
        pkv__attn_set_pieces(at, 0);
        if (pieces && !two) assert_int_equal(pkv__attn_run(at, &p.view, items, n_seqs, &call), PKV_OK);
        float *first[4], *first_lse[4];
        for (uint32_t i = 0; i < n_seqs; i++) {
            const size_t n = (size_t)items[i].n_q * nqh;
            first[i] = malloc(sizeof(float) * n * D), first_lse[i] = malloc(sizeof(float) * n);
            memcpy(first[i], items[i].out, sizeof(float) * n * D);
            if (items[i].lse) memcpy(first_lse[i], items[i].lse, sizeof(float) * n);
        }
        pkv__attn_set_passes(at, !two, rng_below(4));
        assert_int_equal(pkv__attn_run(at, &p.view, items, n_seqs, &call), PKV_OK);
        for (uint32_t i = 0; i < n_seqs; i++) {
            const size_t n = (size_t)items[i].n_q * nqh;
            assert_memory_equal(first[i], items[i].out, sizeof(float) * n * D);
            if (items[i].lse) assert_memory_equal(first_lse[i], items[i].lse, sizeof(float) * n);
            free(first[i]), free(first_lse[i]);
        }
        pkv__attn_set_passes(at, two, 0);
        /* and the oracle below checks the pieces' results where the call took them */
        pkv__attn_set_pieces(at, pieces);
        if (pieces && !two) assert_int_equal(pkv__attn_run(at, &p.view, items, n_seqs, &call), PKV_OK);
    }
    for (uint32_t i = 0; i < n_seqs; i++) {
        /* errors in units of the tolerance of this (K, V) pair; with PKV_ATTN_BF16_DOT, where the
           kernels round (test_bf16_dot), the reference's queries rounded alike and the weights'
           rounding on top */
        const bool lp_k = o->bf16_dot && pkv__attn_lp(at, kdt), lp_v = o->bf16_dot && lp_v_any(at, kdt, vdt);
        const double e = o->f16bf && pkv__attn_f16bf(at, kdt, vdt, D, D)
                             ? check_item_f16bf(&p, &seqs[i], nqh, &items[i], &call, kdt, vdt, lp_v, worst_lse)
                         : o->qbf && pkv__attn_lp_tiles(at, kdt, vdt, D, D)
                             ? check_item_qbf(&p, &seqs[i], nqh, &items[i], &call, kdt, vdt, true, lp_v, worst_lse)
                             : check_item_lp(&p, &seqs[i], nqh, &items[i], &call, kdt, vdt, lp_k, lp_v, worst_lse);
        if (!(e <= *worst)) {
            *worst = e;
            if (e > 1.0)
                print_message("  fail: %s D=%u q/kv=%u/%u B=%u len=%u q_pos0=%u n_q=%u softcap=%g window=%u chunk=%u "
                              "alibi=%d thr=%u: err %.3g\n",
                              backend, D, nqh, H, B, lens[i], items[i].q_pos0, items[i].n_q, call.softcap, call.window,
                              call.chunk, call.alibi != NULL, n_threads, e);
        }
        free((void *)items[i].q);
        free((void *)items[i].mask);
        free(items[i].out);
        free(items[i].lse);
        seq_free(&seqs[i]);
    }
    free(sinks);
    free(alibi);
    pkv__attn_destroy(at);
    pool_free(&p);
}

static void run_oracle_dims(const char *backend, const oracle_opts *o, uint64_t seed, const uint32_t *dims,
                            size_t n_dims) {
    g_rng = seed;
    g_case = (unsigned)(seed * 13u); /* a different start of the turn per seed */
    for (size_t ti = 0; ti < sizeof k_types / sizeof *k_types; ti++) {
        if (o->bf16_dot && k_types[ti] != PKV_DTYPE_BF16) continue;
        if (o->f16bf && k_types[ti] != PKV_DTYPE_F16) continue;
        const pkv_dtype ktype = o->qbf ? o->qbf_k : k_types[ti]; /* qbf: once, in bf16's turn */
        double worst = 0, worst_lse = 0;
        for (size_t di = 0; di < n_dims; di++)
            for (size_t hi = 0; hi < 4 && pkv__row_bytes(ktype, dims[di]); hi++) { /* q8_0, q4_0: D % 32 */
                const uint32_t nt = 1 + rng_below(3); /* 1..3 threads: 2 and 3 exercise key splits */
                /* K and V of different types sometimes: the dispatch is per tensor */
                pkv_dtype kdt = ktype, vdt = rng_below(4) ? kdt : k_types[rng_below(3)];
                oracle_case(backend, nt, dims[di], k_heads[hi][0], k_heads[hi][1], kdt, vdt, o, &worst, &worst_lse);
            }
        print_message("  %s K=%s%s%s%s%s%s%s%s%s: max err %.3g of the tolerance, lse err %.3g\n", backend,
                      pkv_dtype_name(ktype), o->bf16_dot ? " bf16-dot" : o->f16bf ? " f16-as-bf16" : "", o->prefill ? " prefill" : " decode",
                      o->softcap ? " softcap" : "",
                      o->window ? " window" : "", o->chunk ? " chunk" : "", o->mask ? " mask" : "", o->sinks ? " sinks" : "",
                      o->alibi ? " alibi" : "", worst, worst_lse);
        assert_true(worst <= 1.0);
        assert_true(worst_lse <= TOL_LSE);
    }
}

static void run_oracle(const char *backend, const oracle_opts *o, uint64_t seed) {
    run_oracle_dims(backend, o, seed, k_dims, sizeof k_dims / sizeof *k_dims);
}

/* Scores that climb by more than the softmax's lazy-rescale threshold (8) from one block to the
 * next, then fall, then spike once late: the running max keeps moving after the first block, so
 * the kernels leave their lazy path (exp against the old max) for the exact one (new max, acc
 * rescaled) at blocks other than the first. K = c(pos) * u + noise with every query head = u,
 * so the logit is about 8 c(pos). Decode (4-row groups) and a 40-query extend, f32 and f16. */
static void test_oracle_moving_max(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    const uint32_t H = 2, D = 64, B = 16, len = 400, nqh = 8;
    static const pkv_dtype dts[] = {PKV_DTYPE_F32, PKV_DTYPE_F16};
    for (size_t di = 0; di < 2; di++)
        for (int prefill = 0; prefill < 2; prefill++) {
            g_rng = 77 + di * 2 + (uint64_t)prefill;
            pkv__attn *at = make_attn(bc->name, 2, 1, (len + B - 1) / B, H, D, B);
            if (!at) skip();
            tpool p;
            pool_init(&p, H, D, B, (len + B - 1) / B + 2, dts[di], dts[di]);
            tseq s;
            seq_make(&p, &s, len, 1.0f);
            float *u = rand_q(D), *k = malloc(sizeof(float) * H * D), *v = malloc(sizeof(float) * H * D);
            for (uint32_t pos = 0; pos < len; pos++) {
                const double logit = pos < 160   ? 0.7 * pos                  /* +11.2 per block */
                                     : pos < 300 ? 112.0 - 0.5 * (pos - 160) /* falling */
                                     : pos == 350 ? 130.0                    /* a late spike */
                                                  : 2.0 * rng_normal();
                const float c = (float)(logit / 8.0); /* q.u * scale = 64 / 8 */
                for (uint32_t i = 0; i < H * D; i++) k[i] = c * u[i % D] + 0.1f * rng_normal(), v[i] = rng_normal();
                seq_put(&p, &s, pos, k, v);
            }
            const uint32_t n_q = prefill ? 40 : 1;
            float *q = malloc(sizeof(float) * n_q * nqh * D), lse[40 * 8];
            for (uint32_t i = 0; i < n_q * nqh; i++) memcpy(q + (size_t)i * D, u, sizeof(float) * D);
            pkv__attn_item it = {.block_table = s.table, .q_pos0 = len - n_q, .n_q = n_q, .q = q,
                                 .out = malloc(sizeof(float) * n_q * nqh * D), .lse = lse};
            pkv__attn_call call = {.n_q_heads = nqh, .scale = 0.125f};
            assert_int_equal(pkv__attn_run(at, &p.view, &it, 1, &call), PKV_OK);
            double lse_err = 0;
            const double e = check_item(&p, &s, nqh, &it, &call, &lse_err) / tol_for(dts[di], dts[di]);
            print_message("  %s %s %s: err %.3g of the tolerance, lse err %.3g\n", bc->name,
                          pkv_dtype_name(dts[di]), prefill ? "extend" : "decode", e, lse_err);
            assert_true(e <= 1.0);
            assert_true(lse_err <= TOL_LSE);
            pkv__attn_destroy(at);
            free(it.out);
            free(q);
            free(u);
            free(k);
            free(v);
            seq_free(&s);
            pool_free(&p);
        }
}

/* Head dims off the kernels' main tiles: 40 (not a multiple of 16: the AVX-512 and NEON score
 * and accum tails), 96 and 112 (AVX-512 accum ends on a 32- or 48-column tile after a 64-column
 * one; AVX2 on its own tails), 32 and 48 (fewer 16-element steps than the AVX-512 score's
 * prefetch spans per tile), decode and prefill. */
static void test_oracle_odd_dims(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    static const uint32_t dims[] = {32, 40, 48, 96, 112};
    const size_t n = sizeof dims / sizeof *dims;
    oracle_opts o = {0};
    run_oracle_dims(bc->name, &o, 404, dims, n);
    o.prefill = 1;
    run_oracle_dims(bc->name, &o, 405, dims, n);
}

/* Shapes at and past the edges of the kernels' tiles and of the driver's row budget, each in
 * decode and prefill, f32 / f16 / bf16 K (V sometimes another type): head_dim 1, 3, 5, 7 and 17
 * (no whole vector: every column in the tails), 1000 and 1024 (the largest accepted); GQA groups
 * of 3, 33 and 64 query heads a kv head (64 rows: a whole unit, ROWS_MAX; 66 and 128 a sequence:
 * its kv heads in units of their own), and of 100 and 130 (past ROWS_MAX: one kv head's query
 * heads cut into sub-groups, n_gsub in attn.c); blocks of 1, 3, 5, 7 and 1024 tokens (a context
 * inside one block). */
static void test_oracle_extreme_shapes(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    static const struct { uint32_t D, nqh, H, B, cap; } shapes[] = {
        {1, 4, 2, 3, 700},   {3, 3, 1, 1, 700},     {7, 64, 1, 5, 700},  {17, 33, 1, 16, 700},
        {200, 66, 2, 7, 300}, {64, 128, 2, 16, 300}, {1000, 2, 2, 1024, 400}, {1024, 8, 4, 16, 300},
        {5, 100, 1, 16, 300}, {33, 260, 2, 3, 200}, {1500, 4, 2, 16, 120}, /* past the reference's
                                                                               1024-value chunks */
    };
    g_rng = 406, g_case = 406u * 13u;
    for (int prefill = 0; prefill < 2; prefill++)
        for (size_t ti = 0; ti < sizeof k_types / sizeof *k_types; ti++) {
            double worst = 0, worst_lse = 0;
            for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
                const oracle_opts o = {.prefill = prefill, .softcap = (int)rng_below(2), .window = (int)rng_below(2),
                                       .sinks = (int)rng_below(2), .alibi = (int)rng_below(2),
                                       .chunk = (int)rng_below(2), .block_tokens = shapes[i].B,
                                       .len_cap = shapes[i].cap};
                const pkv_dtype kdt = k_types[ti], vdt = rng_below(4) ? kdt : k_types[rng_below(3)];
                oracle_case(bc->name, 1 + rng_below(2), shapes[i].D, shapes[i].nqh, shapes[i].H, kdt, vdt, &o, &worst,
                            &worst_lse);
            }
            print_message("  %s K=%s%s extreme shapes: max err %.3g of the tolerance, lse err %.3g\n", bc->name,
                          pkv_dtype_name(k_types[ti]), prefill ? " prefill" : " decode", worst, worst_lse);
            assert_true(worst <= 1.0);
            assert_true(worst_lse <= TOL_LSE);
        }
}

static void test_oracle_decode(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {0};
    run_oracle(bc->name, &o, 101);
}
static void test_oracle_prefill(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.prefill = 1};
    run_oracle(bc->name, &o, 202);
}
static void test_oracle_softcap_window(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.softcap = 1, .window = 1};
    run_oracle(bc->name, &o, 303);
    o.prefill = 1;
    run_oracle(bc->name, &o, 304);
    o.softcap = 0;
    run_oracle(bc->name, &o, 305);
}
static void test_oracle_sinks(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.sinks = 1};
    run_oracle(bc->name, &o, 306);
    o.prefill = 1;
    run_oracle(bc->name, &o, 307);
    o.window = o.softcap = 1;
    run_oracle(bc->name, &o, 308);
}

/* ALiBi (pkv__attn_call.alibi): every path (row and transposed, pieces, two passes, key splits)
 * against the reference, alone and with the soft-cap (the bias after it), a window and sinks. */
static void test_oracle_alibi(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.alibi = 1};
    run_oracle(bc->name, &o, 309);
    o.prefill = 1;
    run_oracle(bc->name, &o, 310);
    o.softcap = o.window = o.sinks = 1;
    run_oracle(bc->name, &o, 311);
    o.prefill = 0;
    run_oracle(bc->name, &o, 312);
}

/* Chunked local attention (pkv__attn_call.chunk, Llama 4's): every path against the reference,
 * alone and with a window (a key passes both), the soft-cap, sinks and ALiBi. */
static void test_oracle_chunk(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.chunk = 1};
    run_oracle(bc->name, &o, 313);
    o.prefill = 1;
    run_oracle(bc->name, &o, 314);
    o.softcap = o.window = o.sinks = o.alibi = 1;
    run_oracle(bc->name, &o, 315);
    o.prefill = 0;
    run_oracle(bc->name, &o, 316);
}

/* Custom masks (pkv__attn_item.mask: pkv_attn_prefill_masked): every path against the reference,
 * alone and with the soft-cap, sinks and ALiBi (real positions, keys ahead of a query included). */
static void test_oracle_mask(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.prefill = 1, .mask = 1, .len_cap = 700}; /* (sequences of more blocks elsewhere) */
    run_oracle(bc->name, &o, 317);
    o.softcap = o.sinks = o.alibi = 1;
    run_oracle(bc->name, &o, 318);
}

/* One case of test_f16_as_bf16 and test_bf16_dot: a pool of n_kv_heads H, head_dim D and K / V
 * dtypes kdt / vdt, 16-token blocks mostly (else 1-33 or 64: AMX's accum takes those 32 keys at
 * a time), 1-4 sequences of 1-40 tokens or up to 600 (max_len's), a context of 1-2 threads on the
 * backend (the test skips where it is missing); items and plain: the test's, freed by
 * lp_world_free. */
typedef struct lp_world {
    tpool p;
    tseq seqs[4];
    uint32_t n_seqs, lens[4], B, nt;
    pkv__attn *at;
    pkv__attn_item items[4];
    float *plain[4];
} lp_world;

static void lp_world_make(lp_world *w, const char *backend, uint32_t H, uint32_t D, pkv_dtype kdt, pkv_dtype vdt) {
    w->B = rng_below(3) ? 16 : rng_below(4) ? 1 + rng_below(33) : 64, w->nt = 1 + rng_below(2);
    w->n_seqs = 1 + rng_below(4);
    uint32_t total = 0, most = 0;
    for (uint32_t i = 0; i < w->n_seqs; i++) {
        w->lens[i] = 1 + rng_below(rng_below(2) ? 40 : PKV_MIN(600u, max_len())); /* qemu's stage: 80 */
        const uint32_t nb = (w->lens[i] + w->B - 1) / w->B;
        total += nb, most = nb > most ? nb : most;
    }
    pool_init(&w->p, H, D, w->B, total + 3, kdt, vdt);
    const float kmul = (float)(0.5 + 3.5 * rng_unit());
    for (uint32_t i = 0; i < w->n_seqs; i++) seq_make(&w->p, &w->seqs[i], w->lens[i], kmul);
    w->at = make_attn(backend, w->nt, w->n_seqs, most, H, D, w->B);
    if (!w->at) {
        for (uint32_t i = 0; i < w->n_seqs; i++) seq_free(&w->seqs[i]);
        pool_free(&w->p);
        skip();
    }
}

/* Item i of w: n_q queries from pos0 (nqh heads of D), out, lse and plain (a copy of out) of them */
static void lp_item(lp_world *w, uint32_t i, uint32_t pos0, uint32_t n_q, uint32_t nqh, uint32_t D) {
    const size_t n = (size_t)n_q * nqh;
    w->items[i] = (pkv__attn_item){.block_table = w->seqs[i].table, .q_pos0 = pos0, .n_q = n_q, .q = rand_q(n * D),
                                   .out = malloc(sizeof(float) * n * D), .lse = malloc(sizeof(float) * n)};
    w->plain[i] = malloc(sizeof(float) * n * D);
}

/* Items for every sequence of w: a decode, or (two in three) an extend of up to 64 queries or of
 * under 16 rows a kv head (the row path) */
static void lp_items_extend(lp_world *w, uint32_t nqh, uint32_t D, uint32_t G) {
    for (uint32_t i = 0; i < w->n_seqs; i++) {
        uint32_t n_q = 1, pos0 = w->lens[i] - 1;
        if (rng_below(3)) {
            const uint32_t cap = rng_below(4) ? 64 : 15 / G;
            const uint32_t most_q = cap < w->lens[i] ? cap : w->lens[i];
            n_q = most_q ? 1 + rng_below(most_q) : 1;
            pos0 = rng_below(w->lens[i] - n_q + 1);
        }
        lp_item(w, i, pos0, n_q, nqh, D);
    }
}

/* Runs w's items with call and keeps their outputs in plain (the call before a flag's, to compare bits) */
static void lp_run_plain(lp_world *w, const pkv__attn_call *call, uint32_t nqh, uint32_t D) {
    assert_int_equal(pkv__attn_run(w->at, &w->p.view, w->items, w->n_seqs, call), PKV_OK);
    for (uint32_t i = 0; i < w->n_seqs; i++)
        memcpy(w->plain[i], w->items[i].out, sizeof(float) * w->items[i].n_q * nqh * D);
}

static void lp_world_free(lp_world *w) {
    for (uint32_t i = 0; i < w->n_seqs; i++) {
        free((void *)w->items[i].q), free(w->items[i].out), free(w->items[i].lse), free(w->plain[i]);
        seq_free(&w->seqs[i]);
    }
    pkv__attn_destroy(w->at);
    pool_free(&w->p);
}

/* PKV_ATTN_F16_AS_BF16 (check_item_f16bf): decode and extends of under and over 16 rows a kv
 * head, head_dims that are and are not a multiple of 32, f16 K or V beside the other dtypes,
 * with PKV_ATTN_BF16_DOT or without. Where pkv__attn_f16bf says the flag changes nothing
 * (every backend but avx512-amx), for a head_dim not a multiple of 32, and where every item has
 * fewer than 16 rows a kv head, the bits are those of the call without it; on avx512-amx some
 * cases must differ (the tiles ran). */
static void test_f16_as_bf16(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    g_rng = 0xf16bf;
    static const uint32_t dims[] = {64, 128, 32, 96, 80, 40};
    /* f16 beside q8_0 or q4_0: the transposed path takes such a pair only with PKV_ATTN_BF16_DOT
       on avx512-amx (whose tiles then take the q8_0 / q4_0 side) */
    static const pkv_dtype kv[][2] = {{PKV_DTYPE_F16, PKV_DTYPE_F16},  {PKV_DTYPE_F16, PKV_DTYPE_F32},
                                      {PKV_DTYPE_F32, PKV_DTYPE_F16},  {PKV_DTYPE_F16, PKV_DTYPE_BF16},
                                      {PKV_DTYPE_BF16, PKV_DTYPE_F16}, {PKV_DTYPE_F16, PKV_DTYPE_Q8_0},
                                      {PKV_DTYPE_Q4_0, PKV_DTYPE_F16}};
    static const uint32_t heads[][2] = {{1, 1}, {8, 8}, {32, 8}, {8, 1}, {32, 2}};
    double worst = 0, worst_lse = 0;
    uint32_t n_used = 0, n_differ = 0, n_cases = 0;
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
        for (size_t hi = 0; hi < sizeof heads / sizeof *heads; hi++)
            for (size_t ti = 0; ti < sizeof kv / sizeof *kv; ti++) {
                const uint32_t D = dims[di], nqh = heads[hi][0], H = heads[hi][1], G = nqh / H;
                if (!pkv__row_bytes(kv[ti][0], D) || !pkv__row_bytes(kv[ti][1], D)) continue; /* q8_0 / q4_0: D % 32 */
                lp_world w;
                lp_world_make(&w, bc->name, H, D, kv[ti][0], kv[ti][1]);
                pkv__attn *at = w.at;
                const bool used = pkv__attn_f16bf(at, kv[ti][0], kv[ti][1], D, D);
                const bool dot = rng_below(2); /* PKV_ATTN_BF16_DOT beside it: the tables of both */
                const bool lp_k = dot && pkv__attn_lp(at, kv[ti][0]), lp_v = dot && lp_v_any(at, kv[ti][0], kv[ti][1]);
                n_used += used, n_cases++;
                pkv__attn_call call = {.n_q_heads = nqh, .scale = (float)(1.0 / sqrt((double)D))};
                lp_items_extend(&w, nqh, D, G);
                call.flags = dot ? PKV_ATTN_BF16_DOT : 0;
                lp_run_plain(&w, &call, nqh, D);
                call.flags |= PKV_ATTN_F16_AS_BF16;
                assert_int_equal(pkv__attn_run(at, &w.p.view, w.items, w.n_seqs, &call), PKV_OK);
                bool differs = false;
                for (uint32_t i = 0; i < w.n_seqs; i++) {
                    const pkv__attn_item *it = &w.items[i];
                    differs |= memcmp(w.plain[i], it->out, sizeof(float) * it->n_q * nqh * D) != 0;
                    /* with BF16_DOT too, a bf16 K rounds its queries in every unit (check_item_lp), an
                       f16 V beside it in the tiles' (in the tolerance, as a bf16 V's weights); a q8_0
                       or q4_0 K the tiles' queries, a q8_0 V their weights (check_item_tiles: the
                       row path's int8 queries are its exact reference) */
                    const pkv_dtype kd = kv[ti][0], vd = kv[ti][1];
                    const bool rv = used && vd == PKV_DTYPE_F16 && D % 32 == 0;
                    const bool qk = used && dot && tiles_exact(kd), qv = used && dot && tiles_exact(vd);
                    const double e =
                        used && !lp_k && !qk && !qv
                            ? check_item_f16bf(&w.p, &w.seqs[i], nqh, it, &call, kd, vd, lp_v, &worst_lse)
                        : tiles_exact(kd) || qv
                            ? check_item_tiles(&w.p, &w.seqs[i], nqh, it, &call, kd, vd,
                                               (qk || (used && kd == PKV_DTYPE_F16)) && D % 32 == 0,
                                               kd == PKV_DTYPE_F16, rv || lp_v || qv, &worst_lse)
                            : check_item_lp(&w.p, &w.seqs[i], nqh, it, &call, kd, vd, lp_k, lp_v || rv, &worst_lse);
                    if (e > 1.0)
                        print_message("  fail: %s D=%u q/kv=%u/%u B=%u K=%s V=%s len=%u q_pos0=%u n_q=%u thr=%u dot=%d: err %.3g\n",
                                      bc->name, D, nqh, H, w.B, pkv_dtype_name(kv[ti][0]), pkv_dtype_name(kv[ti][1]),
                                      w.lens[i], it->q_pos0, it->n_q, w.nt, dot, e);
                    worst = fmax(worst, e);
                }
                /* nor where every item has fewer than 16 rows a kv head (the row path's units) */
                bool rows16 = false;
                for (uint32_t i = 0; i < w.n_seqs; i++) rows16 |= w.items[i].n_q * G >= 16;
                if (!used || D % 32 || !rows16) assert_false(differs);
                n_differ += differs;
                lp_world_free(&w);
            }
    print_message("  %s: the flag applied in %u of %u cases and changed the results of %u; max err %.3g of the "
                  "tolerance, lse err %.3g\n", bc->name, n_used, n_cases, n_differ, worst, worst_lse);
    if (n_used) assert_true(n_differ > 0);
    assert_true(worst <= 1.0);
    assert_true(worst_lse <= TOL_LSE);
}

/* PKV_ATTN_BF16_DOT over fp8 e4m3, q8_0 or q4_0 K or V (check_item_qbf): decode and extends of
 * under and over 16 rows a kv head, head_dims that are and (fp8) are not a multiple of 32, each
 * beside the other dtypes. Where neither K nor V is bf16 (whose row path the flag changes too)
 * the bits are those of the call without it wherever pkv__attn_lp_tiles says it does not apply
 * (every backend but avx512-amx), for a head_dim not a multiple of 32, and where every item has
 * fewer than 16 rows a kv head; on avx512-amx some cases must differ (the tiles ran). */
static void run_q_bf16_dot(const backend_case *bc, uint64_t seed, const uint32_t *dims, size_t n_dims,
                           const pkv_dtype (*kv)[2], size_t n_kv) {
    g_rng = seed;
    static const uint32_t heads[][2] = {{1, 1}, {8, 8}, {32, 8}, {8, 1}, {32, 2}};
    double worst = 0, worst_lse = 0;
    uint32_t n_used = 0, n_differ = 0, n_cases = 0;
    for (size_t di = 0; di < n_dims; di++)
        for (size_t hi = 0; hi < sizeof heads / sizeof *heads; hi++)
            for (size_t ti = 0; ti < n_kv; ti++) {
                const uint32_t D = dims[di], nqh = heads[hi][0], H = heads[hi][1], G = nqh / H;
                const pkv_dtype kdt = kv[ti][0], vdt = kv[ti][1];
                lp_world w;
                lp_world_make(&w, bc->name, H, D, kdt, vdt);
                pkv__attn *at = w.at;
                const bool used = pkv__attn_lp_tiles(at, kdt, vdt, D, D);
                const bool lp_k = pkv__attn_lp(at, kdt), lp_v = lp_v_any(at, kdt, vdt);
                /* the flag's kernels of these dtypes are the tiles' alone: no row path changes */
                assert_false(tiles_exact(kdt) && lp_k);
                assert_false(tiles_exact(vdt) && lp_v);
                n_used += used && !lp_k && !lp_v, n_cases++;
                pkv__attn_call call = {.n_q_heads = nqh, .scale = (float)(1.0 / sqrt((double)D))};
                lp_items_extend(&w, nqh, D, G);
                lp_run_plain(&w, &call, nqh, D);
                call.flags = PKV_ATTN_BF16_DOT;
                assert_int_equal(pkv__attn_run(at, &w.p.view, w.items, w.n_seqs, &call), PKV_OK);
                bool differs = false;
                for (uint32_t i = 0; i < w.n_seqs; i++) {
                    const pkv__attn_item *it = &w.items[i];
                    differs |= memcmp(w.plain[i], it->out, sizeof(float) * it->n_q * nqh * D) != 0;
                    /* a bf16 K rounds its queries in every unit (check_item_lp), a V of these dtypes
                       beside it its weights in the tiles' (in the tolerance, as a bf16 V's) */
                    const bool rv = used && tiles_exact(vdt) && D % 32 == 0;
                    const double e =
                        !lp_k ? check_item_qbf(&w.p, &w.seqs[i], nqh, it, &call, kdt, vdt, used, lp_v, &worst_lse)
                            : check_item_lp(&w.p, &w.seqs[i], nqh, it, &call, kdt, vdt, lp_k, lp_v || rv, &worst_lse);
                    if (e > 1.0)
                        print_message("  fail: %s D=%u q/kv=%u/%u B=%u K=%s V=%s len=%u q_pos0=%u n_q=%u thr=%u: err %.3g\n",
                                      bc->name, D, nqh, H, w.B, pkv_dtype_name(kdt), pkv_dtype_name(vdt), w.lens[i],
                                      it->q_pos0, it->n_q, w.nt, e);
                    worst = fmax(worst, e);
                }
                bool rows16 = false;
                for (uint32_t i = 0; i < w.n_seqs; i++) rows16 |= w.items[i].n_q * G >= 16;
                if (!lp_k && !lp_v) {
                    if (!used || D % 32 || !rows16) assert_false(differs);
                    n_differ += differs;
                }
                lp_world_free(&w);
            }
    print_message("  %s: the flag applied to these dtypes alone in %u of %u cases and changed the results of %u; max err %.3g "
                  "of the tolerance, lse err %.3g\n", bc->name, n_used, n_cases, n_differ, worst, worst_lse);
    if (n_used) assert_true(n_differ > 0);
    assert_true(worst <= 1.0);
    assert_true(worst_lse <= TOL_LSE);
}

static void test_fp8_bf16_dot(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    static const uint32_t dims[] = {64, 128, 32, 96, 80, 40};
    static const pkv_dtype kv[][2] = {{PKV_DTYPE_FP8_E4M3, PKV_DTYPE_FP8_E4M3}, {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_F32},
                                      {PKV_DTYPE_F32, PKV_DTYPE_FP8_E4M3},      {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_F16},
                                      {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_BF16},     {PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3}};
    run_q_bf16_dot(bc, 0xf8bf, dims, sizeof dims / sizeof *dims, kv, sizeof kv / sizeof *kv);
}

/* q8_0 and q4_0 (head_dim a multiple of 32 always), beside each other and the other dtypes; the
 * row path's units score int8 queries (check_item_tiles' exact reference) */
static void test_q_bf16_dot(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    static const uint32_t dims[] = {64, 128, 32, 96};
    static const pkv_dtype kv[][2] = {{PKV_DTYPE_Q8_0, PKV_DTYPE_Q8_0}, {PKV_DTYPE_Q4_0, PKV_DTYPE_Q4_0},
                                      {PKV_DTYPE_Q8_0, PKV_DTYPE_F16},  {PKV_DTYPE_F32, PKV_DTYPE_Q4_0},
                                      {PKV_DTYPE_Q4_0, PKV_DTYPE_Q8_0}, {PKV_DTYPE_Q8_0, PKV_DTYPE_BF16},
                                      {PKV_DTYPE_BF16, PKV_DTYPE_Q8_0}, {PKV_DTYPE_FP8_E4M3, PKV_DTYPE_Q4_0}};
    run_q_bf16_dot(bc, 0x98bf, dims, sizeof dims / sizeof *dims, kv, sizeof kv / sizeof *kv);
}

/* The oracles of a rounding flag (base: bf16_dot or f16bf set), prefill: plain, soft-cap with a
 * window and sinks, chunks with ALiBi, custom masks with soft-cap; seeds seed .. seed + 3 */
static void run_oracle_lp(const char *backend, const oracle_opts *base, uint64_t seed) {
    oracle_opts o = *base;
    o.prefill = 1;
    run_oracle(backend, &o, seed);
    o.softcap = o.window = o.sinks = 1;
    run_oracle(backend, &o, seed + 1);
    o = *base;
    o.prefill = o.chunk = o.alibi = 1;
    run_oracle(backend, &o, seed + 2);
    o = *base;
    o.prefill = o.mask = o.softcap = 1, o.len_cap = 700;
    run_oracle(backend, &o, seed + 3);
}

/* PKV_ATTN_F16_AS_BF16 with the driver's parameters, as test_oracle_bf16_dot for bf16 */
static void test_oracle_f16_as_bf16(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    const oracle_opts o = {.f16bf = 1};
    run_oracle_lp(bc->name, &o, 341);
}

/* PKV_ATTN_BF16_DOT over fp8 e4m3, q8_0 and q4_0 K (V the same or drawn) with the driver's
 * parameters, as test_oracle_f16_as_bf16 for its flag */
static void test_oracle_quant_bf16_dot(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.bf16_dot = 1, .qbf = 1, .qbf_k = PKV_DTYPE_FP8_E4M3};
    run_oracle_lp(bc->name, &o, 351);
    o.qbf_k = PKV_DTYPE_Q8_0; /* and the integer dtypes (the row path's units: int8 queries) */
    run_oracle_lp(bc->name, &o, 361);
    o.qbf_k = PKV_DTYPE_Q4_0;
    run_oracle_lp(bc->name, &o, 371);
}

/* PKV_ATTN_BF16_DOT with every parameter the driver applies between score and accum (soft-cap,
 * window, chunks, sinks, ALiBi, custom masks), prefill and decode, bf16 K (V bf16 or drawn):
 * where the kernels of the flag take blocks in groups (accum_tn: AMX), each block's masks and
 * biases land on its own rows of the scores. */
static void test_oracle_bf16_dot(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    oracle_opts o = {.bf16_dot = 1};
    run_oracle_lp(bc->name, &o, 331);
    o = (oracle_opts){.bf16_dot = 1, .window = 1, .alibi = 1};
    run_oracle(bc->name, &o, 335);
    o.prefill = 1; /* a window's first block seen from inside: its biases from key t0 on */
    run_oracle(bc->name, &o, 336);
}

/* ---- soft-cap and window: exact effects on a hand-made case ------------------------------------ */
/* Window 1 (or chunks of 1): a query sees only its own position, so out == V[p] exactly and lse ==
 * its logit. */
static void test_window_one_sees_itself(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    g_rng = 7;
    tpool p;
    pool_init(&p, 2, 64, 16, 8, PKV_DTYPE_F32, PKV_DTYPE_F32);
    tseq s;
    seq_make(&p, &s, 100, 1.0f);
    pkv__attn *at = make_attn(bc->name, 2, 1, 8, 2, 64, 16);
    if (!at) skip();
    const uint32_t nqh = 4, n_q = 40;
    float *q = rand_q((size_t)n_q * nqh * 64), *out = malloc(sizeof(float) * n_q * nqh * 64);
    float lse[40 * 4];
    pkv__attn_item it = {.block_table = s.table, .q_pos0 = 60, .n_q = n_q, .q = q, .out = out, .lse = lse};
    /* a window of 1, and chunks of 1 (Llama 4's local attention at its smallest) */
    for (int chunked = 0; chunked < 2; chunked++) {
        pkv__attn_call call = {.n_q_heads = nqh, .scale = 0.125f, .softcap = 5.0f};
        call.window = !chunked, call.chunk = (uint32_t)chunked;
        assert_int_equal(pkv__attn_run(at, &p.view, &it, 1, &call), PKV_OK);
        for (uint32_t qi = 0; qi < n_q; qi++)
            for (uint32_t hq = 0; hq < nqh; hq++) {
                const uint32_t h = hq / 2, pos = 60 + qi;
                const float *v = s.vf + ((size_t)pos * 2 + h) * 64;
                for (uint32_t d = 0; d < 64; d++) TU_NEAR(out[((size_t)qi * nqh + hq) * 64 + d], v[d], 1e-6f);
                double dot = 0;
                for (uint32_t d = 0; d < 64; d++)
                    dot += (double)q[((size_t)qi * nqh + hq) * 64 + d] * s.kf[((size_t)pos * 2 + h) * 64 + d];
                double logit = 5.0 * tanh(dot * 0.125 / 5.0);
                TU_NEAR(lse[qi * nqh + hq], (float)logit, 1e-5f);
                assert_true(fabs(logit) <= 5.0);
            }
    }
    free(q);
    free(out);
    seq_free(&s);
    pool_free(&p);
    pkv__attn_destroy(at);
}

/* Two keys with logits +1 and -1 and values +1 and -1: out = tanh(s), lse = log(e^s + e^-s) for
 * the capped logit s = cap * tanh(1 / cap), for caps whose 1 / cap lies on both sides of the
 * SIMD soft-cap's switch to a series at 1/4 and far above the logits (at 1e8 the form
 * (1 - e) / (1 + e) rounded every logit to 0). */
static void test_softcap_wide(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    const uint32_t D = 16;
    tpool p;
    pool_init(&p, 1, D, 16, 1, PKV_DTYPE_F32, PKV_DTYPE_F32);
    float *k = (float *)p.view.k, *v = (float *)p.view.v;
    memset(k, 0, 2 * D * sizeof(float));
    memset(v, 0, 2 * D * sizeof(float));
    k[0] = 4.0f, k[D] = -4.0f, v[0] = 1.0f, v[D] = -1.0f;
    pkv__attn *at = make_attn(bc->name, 1, 1, 1, 1, D, 16);
    if (!at) skip();
    const int32_t table[1] = {0};
    float q[16] = {0.25f}, out[16], lse;
    static const double caps[] = {0.0, 0.5, 2.0, 4.0, 5.0, 40.0, 1e3, 1e6, 1e8, 1e30};
    for (size_t ci = 0; ci < sizeof caps / sizeof *caps; ci++) {
        pkv__attn_item it = {.block_table = table, .q_pos0 = 1, .n_q = 1, .q = q, .out = out, .lse = &lse};
        pkv__attn_call call = {.n_q_heads = 1, .scale = 1.0f, .softcap = (float)caps[ci]};
        assert_int_equal(pkv__attn_run(at, &p.view, &it, 1, &call), PKV_OK);
        const double c = caps[ci], sl = c > 0 ? c * tanh(1.0 / c) : 1.0;
        if (fabs(out[0] - tanh(sl)) > 1e-6 || fabs(lse - log(exp(sl) + exp(-sl))) > 1e-6)
            print_message("  %s cap %g: out %.9g (want %.9g), lse %.9g (want %.9g)\n", bc->name, c, out[0],
                          tanh(sl), lse, log(exp(sl) + exp(-sl)));
        TU_NEAR(out[0], tanh(sl), 1e-6);
        TU_NEAR(lse, log(exp(sl) + exp(-sl)), 1e-6);
        for (uint32_t d = 1; d < D; d++) TU_NEAR(out[d], 0.0f, 0.0f);
    }
    pkv__attn_destroy(at);
    pool_free(&p);
}

/* ---- LSE merge: attention over two halves, merged by their LSEs, equals the whole ------------ */
static void test_lse_merge_halves(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    g_rng = 11;
    const uint32_t H = 8, D = 128, B = 16, nqh = 32, n1 = 64 * B, n2 = 37 * B + 5;
    tpool p;
    pool_init(&p, H, D, B, 300, PKV_DTYPE_F16, PKV_DTYPE_F16);
    tseq whole;
    seq_make(&p, &whole, n1 + n2, 1.0f);
    pkv__attn *at = make_attn(bc->name, 2, 3, 200, H, D, B);
    if (!at) skip();
    float *q = rand_q((size_t)nqh * D);
    float *o[3], l[3][32];
    for (int i = 0; i < 3; i++) o[i] = malloc(sizeof(float) * nqh * D);
    /* the halves as sequences of their own: the first n1 positions, and the rest re-based at 0
     * (their block table is the tail of the whole one, since n1 is a multiple of B) */
    pkv__attn_item items[3] = {
        {.block_table = whole.table, .q_pos0 = n1 + n2 - 1, .n_q = 1, .q = q, .out = o[0], .lse = l[0]},
        {.block_table = whole.table, .q_pos0 = n1 - 1, .n_q = 1, .q = q, .out = o[1], .lse = l[1]},
        {.block_table = whole.table + n1 / B, .q_pos0 = n2 - 1, .n_q = 1, .q = q, .out = o[2], .lse = l[2]},
    };
    pkv__attn_call call = {.n_q_heads = nqh, .scale = 0.088f, .softcap = 0};
    assert_int_equal(pkv__attn_run(at, &p.view, items, 3, &call), PKV_OK);
    for (uint32_t h = 0; h < nqh; h++) {
        double m = fmax(l[1][h], l[2][h]);
        double w1 = exp(l[1][h] - m), w2 = exp(l[2][h] - m);
        TU_NEAR(l[0][h], (float)(m + log(w1 + w2)), 1e-5f);
        for (uint32_t d = 0; d < D; d++) {
            double merged = (w1 * o[1][h * D + d] + w2 * o[2][h * D + d]) / (w1 + w2);
            assert_true(fabs(merged - o[0][h * D + d]) <= 1e-5 * whole.vmax);
        }
    }
    for (int i = 0; i < 3; i++) free(o[i]);
    free(q);
    seq_free(&whole);
    pool_free(&p);
    pkv__attn_destroy(at);
}

/* ---- threads and splits give the same answer as one thread ----------------------------------- */
static void test_threads_agree(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    g_rng = 13;
    const uint32_t H = 1, D = 128, B = 16, nqh = 8;
    tpool p;
    pool_init(&p, H, D, B, 400, PKV_DTYPE_BF16, PKV_DTYPE_BF16);
    tseq s;
    seq_make(&p, &s, 6000, 1.0f);
    float *q = rand_q((size_t)nqh * D), out[3][8 * 128];
    for (uint32_t nt = 1; nt <= 3; nt++) {
        pkv__attn *at = make_attn(bc->name, nt, 1, 400, H, D, B);
        if (!at) skip();
        pkv__attn_item it = {.block_table = s.table, .q_pos0 = 5999, .n_q = 1, .q = q, .out = out[nt - 1]};
        pkv__attn_call call = {.n_q_heads = nqh, .scale = 0.1f};
        assert_int_equal(pkv__attn_run(at, &p.view, &it, 1, &call), PKV_OK);
        pkv__attn_destroy(at);
    }
    for (uint32_t i = 0; i < nqh * D; i++) {
        assert_true(fabsf(out[1][i] - out[0][i]) <= 1e-5f * s.vmax);
        assert_true(fabsf(out[2][i] - out[0][i]) <= 1e-5f * s.vmax);
    }
    free(q);
    seq_free(&s);
    pool_free(&p);
}

/* ---- pool order (the sweep) ------------------------------------------------------------------- */

/* A sequence of len tokens whose first share blocks are parent's (table entries and K/V: a fork
 * or a reused prefix), the rest fresh blocks of random tokens. share * B <= len, parent->len. */
static void seq_fork(tpool *p, const tseq *parent, tseq *s, uint32_t share, uint32_t len, float kmul) {
    const uint32_t B = p->B, nb = (len + B - 1) / B, n_shared = share * B;
    assert_true(n_shared <= len && n_shared <= parent->len);
    memset(s, 0, sizeof *s);
    s->len = len;
    s->table = malloc(sizeof(int32_t) * (nb + 1));
    for (uint32_t i = 0; i < nb; i++) s->table[i] = i < share ? parent->table[i] : p->free_ids[p->next_free++];
    assert_true(p->next_free <= p->n_blocks);
    const size_t per_tok = (size_t)p->H * p->D;
    s->kf = malloc(sizeof(float) * (len * per_tok + 1));
    s->vf = malloc(sizeof(float) * (len * per_tok + 1));
    memcpy(s->kf, parent->kf, sizeof(float) * n_shared * per_tok);
    memcpy(s->vf, parent->vf, sizeof(float) * n_shared * per_tok);
    for (size_t i = 0; i < n_shared * per_tok; i++) s->vmax = fmaxf(s->vmax, fabsf(s->vf[i]));
    float *k = malloc(sizeof(float) * per_tok), *v = malloc(sizeof(float) * per_tok);
    for (uint32_t pos = n_shared; pos < len; pos++) {
        for (size_t i = 0; i < per_tok; i++) k[i] = rng_normal() * kmul, v[i] = rng_normal();
        seq_put(p, s, pos, k, v);
    }
    free(k);
    free(v);
}

/* Decode in pool order (forced) against the reference and against table order: batches of 1
 * to 16 sequences, and of 33 to 40 (swept in two groups or more; in every other call the groups
 * are made the smallest, 4 sequences a thread, so that several groups, each cut into a set a
 * thread with sequences across two sets, are swept), a third of them forked from an earlier
 * one (shared prefix blocks, which the sweep reads once for all their holders), in pools up to
 * 3x larger than the batch (free blocks between the batch's), with soft-cap, window and
 * log-sum-exp sometimes, on 1 to 3 threads; in some calls every fourth item has no query (its
 * output untouched), and in others every third is an extend of 2 to 40 queries (a chunked prefill
 * beside the decodes: it runs in table order in the same call). */
static void test_oracle_pool_order(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    g_rng = 606;
    static const uint32_t shapes[][3] = {{128, 32, 8}, {64, 8, 1}, {80, 8, 8}, {256, 8, 2}}; /* D, q heads, kv heads */
    static const uint32_t btoks[] = {1, 3, 16, 16, 32};
    double worst = 0, worst_lse = 0, worst_table = 0;
    for (uint32_t c = 0; c < 24; c++) {
        const uint32_t D = shapes[c % 4][0], nqh = shapes[c % 4][1], H = shapes[c % 4][2];
        const uint32_t B = btoks[rng_below(5)], nt = 1 + rng_below(3);
        const uint32_t n = c % 6 == 5 ? 33 + rng_below(8) : 1 + rng_below(16), idle = c % 4 == 2 ? 4 : 0;
        const uint32_t ext = c % 3 == 1 ? 3 : 0; /* every ext-th item from the third an extend */
        const pkv_dtype dt = k_types[c % 3];
        uint32_t lens[40], share[40], parent[40], total = 0, max_blocks = 0;
        for (uint32_t i = 0; i < n; i++) {
            lens[i] = 1 + rng_below(PKV_MIN(c < 12 || n > 16 ? 600u : 2500u, max_len()));
            share[i] = 0, parent[i] = i;
            if (i && rng_below(3) == 0) { /* fork an earlier sequence that is not a fork itself */
                const uint32_t j = rng_below(i);
                if (parent[j] == j) parent[i] = j, share[i] = rng_below(PKV_MIN(lens[i], lens[j]) / B + 1);
            }
            const uint32_t nb = (lens[i] + B - 1) / B;
            total += nb - share[i], max_blocks = PKV_MAX(max_blocks, nb);
        }
        tpool p;
        pool_init(&p, H, D, B, total * (1 + rng_below(3)) + 3, dt, dt);
        tseq seqs[40];
        for (uint32_t i = 0; i < n; i++)
            if (parent[i] == i) seq_make(&p, &seqs[i], lens[i], 1.5f);
            else seq_fork(&p, &seqs[parent[i]], &seqs[i], share[i], lens[i], 1.5f);
        pkv__attn *at = make_attn(bc->name, nt, n, max_blocks, H, D, B);
        if (!at) skip();
        pkv__attn_call call = {.n_q_heads = nqh, .scale = (float)(1.0 / sqrt((double)D))};
        if (rng_below(3) == 0) call.softcap = (float)(1.0 + 30.0 * rng_unit());
        if (rng_below(3) == 0) call.window = 1 + rng_below(600);
        if (c % 5 == 4) call.chunk = rand_chunk(B, false); /* decodes whose chunk starts past block 0: every shape */
        float alibi[32];
        /* the sweep's bias: narrow and wide, both sizings, in pieces (where one pass is the
           default) and in the other pass mode below */
        if (c % 3 == 2) rand_alibi(alibi, nqh), call.alibi = alibi;
        pkv__attn_item items[40];
        float *table_out[40];
        for (uint32_t i = 0; i < n; i++) {
            uint32_t n_q = idle && i % idle == 1 ? 0 : 1;
            if (ext && i % ext == 2) {
                const uint32_t want = 2 + rng_below(39); /* PKV_MIN evaluates its arguments twice */
                n_q = PKV_MIN(lens[i], want);
            }
            const size_t nout = (size_t)PKV_MAX(n_q, 1u) * nqh * D;
            items[i] = (pkv__attn_item){.block_table = seqs[i].table, .q_pos0 = lens[i] - PKV_MAX(n_q, 1u),
                                        .n_q = n_q, .q = rand_q(nout), .out = malloc(sizeof(float) * nout),
                                        .lse = rng_below(2) ? malloc(sizeof(float) * nout / D) : NULL};
            table_out[i] = malloc(sizeof(float) * nout);
            for (size_t x = 0; x < nout; x++) items[i].out[x] = NAN;
        }
        pkv__attn_set_order(at, PKV__ATTN_ORDER_TABLE);
        assert_int_equal(pkv__attn_run(at, &p.view, items, n, &call), PKV_OK);
        assert_false(pkv__attn_last_swept(at));
        for (uint32_t i = 0; i < n; i++) { /* keep table order's answers; the pool run writes anew */
            const size_t nout = (size_t)PKV_MAX(items[i].n_q, 1u) * nqh * D;
            memcpy(table_out[i], items[i].out, sizeof(float) * nout);
            for (size_t x = 0; x < nout; x++) items[i].out[x] = NAN;
            for (size_t x = 0; items[i].lse && x < nout / D; x++) items[i].lse[x] = NAN;
        }
        pkv__attn_set_order(at, PKV__ATTN_ORDER_POOL);
        if (c % 2) pkv__attn_set_sweep_sizing(at, 0, 4); /* groups of 4 sequences a thread */
        pkv__attn_set_sweep_wide(at, c / 2 % 2); /* or groups of 32, one set cut into ranges */
        pkv__attn_set_pieces(at, c % 3 ? 64u << c % 7 : 0); /* runs whole or in pieces of 64 B to 4 KiB */
        assert_int_equal(pkv__attn_run(at, &p.view, items, n, &call), PKV_OK);
        assert_true(pkv__attn_last_swept(at));
        for (uint32_t i = 0; i < n; i++) {
            if (items[i].n_q == 0) { /* no query: nothing written */
                for (uint32_t x = 0; x < nqh * D; x++) assert_true(isnan(items[i].out[x]));
                continue;
            }
            const double e = check_item(&p, &seqs[i], nqh, &items[i], &call, &worst_lse) / tol_for(dt, dt);
            if (!(e <= worst)) worst = e;
            if (e > 1.0)
                print_message("  fail: %s D=%u q/kv=%u/%u B=%u n=%u len=%u share=%u thr=%u: err %.3g\n", bc->name, D,
                              nqh, H, B, n, lens[i], share[i], nt, e);
            for (size_t x = 0; x < (size_t)items[i].n_q * nqh * D; x++) {
                const double d = fabs((double)items[i].out[x] - table_out[i][x]) / fmax(seqs[i].vmax, 1e-30);
                if (!(d <= worst_table)) worst_table = isnan(d) ? INFINITY : d;
            }
        }
        /* The other prefetch paths (into L1 or L2, the row path's at one level or two, a block
         * or a head ahead; a decode head's score in finer shares or not) give the same bits: the
         * shares split score's head_dim loop, not its order. */
        for (uint32_t i = 0; i < n; i++)
            memcpy(table_out[i], items[i].out, sizeof(float) * items[i].n_q * nqh * D);
        pkv__attn_set_prefetch(at, c % 2 == 0, c % 4 < 2, c % 8 < 4, c % 16 < 8);
        assert_int_equal(pkv__attn_run(at, &p.view, items, n, &call), PKV_OK);
        for (uint32_t i = 0; i < n; i++)
            assert_memory_equal(table_out[i], items[i].out, sizeof(float) * items[i].n_q * nqh * D);
        /* and so does the other pass mode (windows of 1 to 3 blocks, or the default), against one
         * pass with runs whole (pieces round otherwise) */
        const bool pieced = pkv__attn_piece_bytes(at) && !pkv__attn_two_pass(at);
        pkv__attn_set_pieces(at, 0);
        if (pieced) {
            assert_int_equal(pkv__attn_run(at, &p.view, items, n, &call), PKV_OK);
            for (uint32_t i = 0; i < n; i++)
                memcpy(table_out[i], items[i].out, sizeof(float) * items[i].n_q * nqh * D);
        }
        pkv__attn_set_passes(at, !pkv__attn_two_pass(at), c % 4);
        assert_int_equal(pkv__attn_run(at, &p.view, items, n, &call), PKV_OK);
        assert_true(pkv__attn_last_swept(at));
        for (uint32_t i = 0; i < n; i++)
            assert_memory_equal(table_out[i], items[i].out, sizeof(float) * items[i].n_q * nqh * D);
        for (uint32_t i = 0; i < n; i++) {
            free((void *)items[i].q), free(items[i].out), free(items[i].lse), free(table_out[i]);
            seq_free(&seqs[i]);
        }
        pkv__attn_destroy(at);
        pool_free(&p);
    }
    print_message("  %s pool order: max err %.3g of the tolerance, lse err %.3g, against table order %.3g\n", bc->name,
                  worst, worst_lse, worst_table);
    assert_true(worst <= 1.0);
    assert_true(worst_lse <= TOL_LSE);
    assert_true(worst_table <= 2 * TOL_F32); /* two results, each within the tolerance of the reference */
}

/* Runs one call of n sequences of len tokens (shuffled blocks unless in_order), each with n_q
 * queries at its end (odd items ext_q instead, where ext_q is not 0), and returns whether it was
 * swept; the outputs are checked against the reference either way. */
static bool swept_case_bt(pkv__attn *at, uint32_t B, uint32_t n, uint32_t len, uint32_t nqh, uint32_t H, uint32_t n_q,
                          uint32_t ext_q, int in_order, int window) {
    const uint32_t D = 64, nb = (len + B - 1) / B;
    tpool p;
    pool_init(&p, H, D, B, n * nb, PKV_DTYPE_F32, PKV_DTYPE_F32);
    if (in_order)
        for (uint32_t i = 0; i < n * nb; i++) p.free_ids[i] = (int32_t)i;
    tseq seqs[66];
    pkv__attn_item items[66];
    pkv__attn_call call = {.n_q_heads = nqh, .scale = 0.125f, .window = window ? 40u : 0u};
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t nq = ext_q && i % 2 ? ext_q : n_q;
        seq_make(&p, &seqs[i], len, 1.0f);
        items[i] = (pkv__attn_item){.block_table = seqs[i].table, .q_pos0 = len - nq, .n_q = nq,
                                    .q = rand_q((size_t)nq * nqh * D), .out = malloc(sizeof(float) * nq * nqh * D)};
        for (size_t x = 0; x < (size_t)nq * nqh * D; x++) items[i].out[x] = NAN; /* every output written */
    }
    assert_int_equal(pkv__attn_run(at, &p.view, items, n, &call), PKV_OK);
    const bool swept = pkv__attn_last_swept(at);
    for (uint32_t i = 0; i < n; i++) {
        double lse_err = 0;
        assert_true(check_item(&p, &seqs[i], nqh, &items[i], &call, &lse_err) <= TOL_F32);
        free((void *)items[i].q), free(items[i].out);
        seq_free(&seqs[i]);
    }
    pool_free(&p);
    return swept;
}

/* The same with 16-token blocks. */
static bool swept_case_ext(pkv__attn *at, uint32_t n, uint32_t len, uint32_t nqh, uint32_t H, uint32_t n_q,
                           uint32_t ext_q, int in_order, int window) {
    return swept_case_bt(at, 16, n, len, nqh, H, n_q, ext_q, in_order, window);
}

/* The same, every item with n_q queries. */
static bool swept_case(pkv__attn *at, uint32_t n, uint32_t len, uint32_t nqh, uint32_t H, uint32_t n_q, int in_order,
                       int window) {
    return swept_case_ext(at, n, len, nqh, H, n_q, 0, in_order, window);
}

/* Creation with var=value in the environment fails with PKV_EINVAL and leaves *out NULL. */
static void assert_env_refused(const pkv__attn_limits *lim, const char *var, const char *value) {
    setenv(var, value, 1);
    pkv__attn *at = NULL;
    assert_int_equal(pkv__attn_create_backend(NULL, 2, lim, "ref", &at), PKV_EINVAL);
    assert_null(at);
    unsetenv(var);
}

/* Whether the row path takes runs in pieces (PKV_ATTN_PIECES), for assert_env_rule. */
static bool pieces_on(const pkv__attn *at) { return pkv__attn_piece_bytes(at) != 0; }

/* var = on, then off, at creation: get reads it back as true, then false; another value fails. */
static void assert_env_rule(const pkv__attn_limits *lim, const char *var, const char *on, const char *off,
                            bool (*get)(const pkv__attn *)) {
    for (int v = 1; v >= 0; v--) {
        setenv(var, v ? on : off, 1);
        pkv__attn *at = NULL;
        assert_int_equal(pkv__attn_create_backend(NULL, 2, lim, "ref", &at), PKV_OK);
        assert_int_equal(get(at), v);
        pkv__attn_destroy(at);
    }
    unsetenv(var);
    assert_env_refused(lim, var, "sideways");
}

/* When the sweep takes a call: forced pool order takes every decode call it can hold (more than
 * 32 sequences in groups) and the items of one query of a call that also has extends (those run
 * in table order), and falls back to table order (with the same answers) for calls of extends
 * only, more than 64 query rows per sequence and contexts of more than 16 threads; AUTO sweeps
 * calls above the inline threshold whose one-query items' tables jump, not contiguous tables or
 * small calls; PKV_ATTN_ORDER sets the order at creation and an unknown value fails it, and so
 * do PKV_ATTN_SWEEP the sweep's rule, PKV_ATTN_PASSES the row path's passes, PKV_ATTN_LEAD its
 * prefetch lead and PKV_ATTN_PIECES its pieces. */
static void test_pool_order_choice(void **state) {
    (void)state;
    need_backend("ref"); /* the driver's choices, on the reference's kernels */
    g_rng = 607;
    pkv__attn *at = make_attn("ref", 2, 66, 64, 4, 64, 16);
    pkv__attn_set_order(at, PKV__ATTN_ORDER_POOL);
    for (int wide = 0; wide < 2; wide++) { /* sets of sequences, one a thread, or one set in ranges */
        pkv__attn_set_sweep_wide(at, wide);
        assert_true(swept_case(at, 3, 100, 16, 4, 1, 0, 0));
        assert_true(swept_case(at, 16, 40, 16, 4, 1, 1, 1)); /* in order, windowed: forced all the same */
        assert_true(swept_case(at, 32, 40, 16, 4, 1, 0, 0));
        assert_true(swept_case(at, 66, 40, 16, 4, 1, 0, 0)); /* three groups of 22 */
        assert_false(swept_case(at, 2, 100, 16, 4, 2, 0, 0)); /* two queries: an extend */
        assert_true(swept_case_ext(at, 5, 100, 16, 4, 1, 7, 0, 0)); /* decodes beside extends of 7 */
        assert_true(swept_case_ext(at, 40, 40, 16, 4, 1, 3, 0, 1)); /* 20 decodes, one group */
        assert_true(swept_case_ext(at, 66, 40, 16, 4, 1, 3, 0, 0)); /* 33 decodes, two groups */
        assert_false(swept_case(at, 2, 100, 68, 4, 1, 0, 0)); /* 68 rows */
    }
    pkv__attn_set_sweep_wide(at, false);
    pkv__attn_set_order(at, PKV__ATTN_ORDER_AUTO);
    pkv__attn_set_inline_work(at, 0);
    assert_true(swept_case(at, 4, 1000, 16, 4, 1, 0, 0));
    assert_false(swept_case(at, 4, 1000, 16, 4, 1, 1, 0)); /* runs of 63 blocks */
    assert_true(swept_case_ext(at, 4, 1000, 16, 4, 1, 100, 0, 0));
    assert_false(swept_case_ext(at, 4, 1000, 16, 4, 1, 100, 1, 0)); /* the decodes' runs count */
    pkv__attn_set_inline_work(at, 64u * 16u * 128u); /* the default */
    /* one decode of 7 blocks (28 Ki elements, under the threshold) beside an extend of 100
     * queries: the call goes to the pool, but the decode is too small to sweep there */
    assert_false(swept_case_ext(at, 2, 100, 16, 4, 1, 100, 0, 0));
    pkv__attn_set_inline_work(at, 1u << 30);
    assert_false(swept_case(at, 4, 1000, 16, 4, 1, 0, 0)); /* a small call, on the caller */
    pkv__attn_destroy(at);

    at = make_attn("ref", 17, 2, 64, 4, 64, 16);
    pkv__attn_set_order(at, PKV__ATTN_ORDER_POOL);
    assert_false(swept_case(at, 2, 100, 16, 4, 1, 0, 0));
    pkv__attn_destroy(at);

    /* Wide groups stay within the sweep's entries: with no bound on a table (room for 65536
     * entries), 32 decodes of 2500 one-token blocks are 80000 entries, more than one group holds;
     * the wide rule makes two groups of 16 (26 would fit) instead of one the sweep cannot take. */
    at = make_attn("ref", 2, 32, 0, 1, 64, 1);
    pkv__attn_set_order(at, PKV__ATTN_ORDER_POOL);
    pkv__attn_set_sweep_sizing(at, 0, 4); /* the narrow rule alone: groups of 8 */
    pkv__attn_set_sweep_wide(at, true);
    assert_true(swept_case_bt(at, 1, 32, 2500, 1, 1, 1, 0, 0, 0));
    pkv__attn_destroy(at);

    pkv__attn_limits lim = {.max_items = 4, .max_blocks_per_seq = 64, .n_kv_heads = 4, .head_dim = 64,
                            .block_tokens = 16, .spin_us = PKV__SPIN_US_DEFAULT};
    setenv("PKV_ATTN_ORDER", "pool", 1);
    assert_int_equal(pkv__attn_create_backend(NULL, 2, &lim, "ref", &at), PKV_OK);
    assert_true(swept_case(at, 2, 40, 16, 4, 1, 1, 0)); /* forced: small and in order */
    pkv__attn_destroy(at);
    setenv("PKV_ATTN_ORDER", "table", 1);
    assert_int_equal(pkv__attn_create_backend(NULL, 2, &lim, "ref", &at), PKV_OK);
    pkv__attn_set_inline_work(at, 0);
    assert_false(swept_case(at, 2, 1000, 16, 4, 1, 0, 0));
    pkv__attn_destroy(at);
    assert_env_refused(&lim, "PKV_ATTN_ORDER", "sideways");
    /* PKV_ATTN_SWEEP overrides the CPU's sweep rule at creation; an unknown value fails it */
    static const struct { const char *value; int wide; } sweeps[] = {{"wide", 1}, {"narrow", 0}};
    for (int i = 0; i < 2; i++) {
        setenv("PKV_ATTN_SWEEP", sweeps[i].value, 1);
        assert_int_equal(pkv__attn_create_backend(NULL, 2, &lim, "ref", &at), PKV_OK);
        assert_int_equal(pkv__attn_sweep_wide(at), sweeps[i].wide);
        pkv__attn_set_order(at, PKV__ATTN_ORDER_POOL);
        assert_true(swept_case(at, 3, 100, 16, 4, 1, 0, 0));
        pkv__attn_destroy(at);
    }
    unsetenv("PKV_ATTN_SWEEP");
    assert_env_refused(&lim, "PKV_ATTN_SWEEP", "diagonal");
    /* PKV_ATTN_PASSES overrides the CPU's rule for the row path's passes, PKV_ATTN_LEAD its
     * prefetch lead, PKV_ATTN_PIECES its pieces; an unknown value fails */
    assert_env_rule(&lim, "PKV_ATTN_PASSES", "two", "one", pkv__attn_two_pass);
    assert_env_rule(&lim, "PKV_ATTN_LEAD", "head", "block", pkv__attn_lead_head);
    assert_env_rule(&lim, "PKV_ATTN_PIECES", "on", "off", pieces_on);
}

/* The plan's size for the run-inline decision counts every kv head a unit reads: a decode unit
 * covers all 8 kv heads of a sequence, so one sequence of 512 tokens is 8 x 32 (head, block)
 * pairs, 4x the default threshold of 64, and goes to the pool; it counted 32 once (run alone). */
static void test_inline_threshold_counts_heads(void **state) {
    (void)state;
    need_backend("ref");
    const uint32_t D = 128, B = 16;
    const struct { uint32_t H, len, threads; } cases[] = {
        {8, 512, 2},  /* 256 head-blocks */
        {8, 128, 2},  /* 64: at the threshold, not under it */
        {8, 112, 1},  /* 56 */
        {1, 512, 1},  /* 32 */
        {1, 1024, 2}, /* 64 */
    };
    g_rng = 29;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint32_t H = cases[c].H, len = cases[c].len, nqh = 4 * H;
        tpool p;
        pool_init(&p, H, D, B, 64, PKV_DTYPE_F16, PKV_DTYPE_F16);
        tseq s;
        seq_make(&p, &s, len, 1.0f);
        float *q = rand_q((size_t)nqh * D), *out = malloc(sizeof(float) * nqh * D);
        pkv__attn *at = make_attn("ref", 2, 1, 64, H, D, B); /* the decision is the driver's, not the backend's */
        assert_int_equal(pkv__attn_last_threads(at), 0);
        pkv__attn_item it = {.block_table = s.table, .q_pos0 = len - 1, .n_q = 1, .q = q, .out = out};
        pkv__attn_call call = {.n_q_heads = nqh, .scale = 0.1f};
        assert_int_equal(pkv__attn_run(at, &p.view, &it, 1, &call), PKV_OK);
        assert_int_equal(pkv__attn_last_threads(at), cases[c].threads);
        pkv__attn_destroy(at);
        free(q), free(out);
        seq_free(&s);
        pool_free(&p);
    }
}

/* ---- bad input --------------------------------------------------------------------------------- */
static void test_bad_input(void **state) {
    (void)state;
    g_rng = 17;
    tpool p;
    pool_init(&p, 2, 64, 16, 8, PKV_DTYPE_F16, PKV_DTYPE_F16);
    tseq s;
    seq_make(&p, &s, 40, 1.0f);
    pkv__attn *at = make_attn("ref", 2, 2, 8, 2, 64, 16);
    float q[4 * 64], out[4 * 64];
    for (int i = 0; i < 4 * 64; i++) q[i] = 1.0f, out[i] = 42.0f;
    pkv__attn_item it = {.block_table = s.table, .q_pos0 = 39, .n_q = 1, .q = q, .out = out};
    pkv__attn_call call = {.n_q_heads = 4, .scale = 0.125f};
    pkv__kv_view kv = p.view;

    assert_int_equal(pkv__attn_run(NULL, &kv, &it, 1, &call), PKV_EINVAL);
    assert_int_equal(pkv__attn_run(at, NULL, &it, 1, &call), PKV_EINVAL);
    assert_int_equal(pkv__attn_run(at, &kv, NULL, 1, &call), PKV_EINVAL);
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, NULL), PKV_EINVAL);
    assert_int_equal(pkv__attn_run(at, &kv, &it, 3, &call), PKV_EINVAL); /* > max_items */
    call.n_q_heads = 3; /* not a multiple of 2 kv heads */
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    call.n_q_heads = 0;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    call.n_q_heads = 4;
    call.scale = NAN;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    call.scale = 0.125f;
    call.softcap = -1.0f;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    call.softcap = 1e-39f; /* subnormal: 1 / cap is not finite */
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    call.softcap = 0.0f;
    float slopes[4] = {0.5f, 0.25f, NAN, 0.0625f}; /* a slope NaN, infinite, or past the bound */
    call.alibi = slopes;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    slopes[2] = -INFINITY;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    slopes[2] = 2.0f * PKV_ALIBI_SLOPE_MAX;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    call.alibi = NULL;
    kv.k_dtype = (pkv_dtype)99;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    kv = p.view;
    kv.head_dim = 128; /* beyond the limits the context was sized for */
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    kv = p.view;
    kv.k = NULL;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    kv = p.view;
    it.q = NULL;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    it.q = q;
    it.out = NULL;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    it.out = out;
    it.block_table = NULL;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    int32_t bad_table[3] = {s.table[0], 99, s.table[2]}; /* 99 is not a block of the pool */
    it.block_table = bad_table;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    bad_table[1] = -1;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    it.block_table = s.table;
    it.q_pos0 = 8 * 16; /* past the block-table capacity */
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_EINVAL);
    it.q_pos0 = 39;
    /* a failing call wrote nothing */
    for (int i = 0; i < 4 * 64; i++) assert_true(out[i] == 42.0f);
    /* zero items and empty items are fine and write nothing */
    assert_int_equal(pkv__attn_run(at, &kv, NULL, 0, &call), PKV_OK);
    it.n_q = 0;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_OK);
    for (int i = 0; i < 4 * 64; i++) assert_true(out[i] == 42.0f);
    it.n_q = 1;
    assert_int_equal(pkv__attn_run(at, &kv, &it, 1, &call), PKV_OK);
    assert_true(out[0] != 42.0f);
    pkv__attn_destroy(at);
    pkv__attn_destroy(NULL);

    pkv__attn_limits lim = {.max_items = 1, .max_blocks_per_seq = 1, .n_kv_heads = 1, .head_dim = 64, .block_tokens = 16};
    pkv__attn *x = NULL;
    assert_int_equal(pkv__attn_create_backend(NULL, 1, &lim, "no-such-isa", &x), PKV_ENOTSUP);
    assert_null(x);
    assert_int_equal(pkv__attn_create(NULL, 1, NULL, &x), PKV_EINVAL);
    lim.head_dim = 0;
    assert_int_equal(pkv__attn_create(NULL, 1, &lim, &x), PKV_EINVAL);
    seq_free(&s);
    pool_free(&p);
}

/* Quantized K/V: either a kernel exists (then it runs) or the call says PKV_ENOTSUP and writes
 * nothing. The kernels and their error bounds are tested by the quant tests. */
static void test_quant_dtypes_supported_or_enotsup(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    const pkv_dtype qt[] = {PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0, PKV_DTYPE_FP8_E4M3};
    for (int i = 0; i < 3; i++) {
        g_rng = 19;
        tpool p;
        pool_init(&p, 1, 64, 16, 4, qt[i], qt[i]);
        tseq s;
        seq_make(&p, &s, 50, 1.0f);
        pkv__attn *at = make_attn(bc->name, 1, 1, 4, 1, 64, 16);
        if (!at) skip();
        float q[64], out[64];
        for (int d = 0; d < 64; d++) q[d] = 0.1f, out[d] = 42.0f;
        pkv__attn_item it = {.block_table = s.table, .q_pos0 = 49, .n_q = 1, .q = q, .out = out};
        pkv__attn_call call = {.n_q_heads = 1, .scale = 0.125f};
        int rc = pkv__attn_run(at, &p.view, &it, 1, &call);
        assert_true(rc == PKV_OK || rc == PKV_ENOTSUP);
        if (rc == PKV_ENOTSUP)
            for (int d = 0; d < 64; d++) assert_true(out[d] == 42.0f);
        else
            for (int d = 0; d < 64; d++) assert_true(isfinite(out[d]) && fabsf(out[d]) <= s.vmax * 1.01f);
        pkv__attn_destroy(at);
        seq_free(&s);
        pool_free(&p);
    }
}

/* PKV_FORCE_REF=1 makes the automatic choice the reference. */
static void test_force_ref(void **state) {
    (void)state;
    pkv__attn_limits lim = {.max_items = 1, .max_blocks_per_seq = 1, .n_kv_heads = 1, .head_dim = 64, .block_tokens = 16};
    pkv__attn *at = NULL;
    setenv("PKV_FORCE_REF", "1", 1);
    assert_int_equal(pkv__attn_create(NULL, 1, &lim, &at), PKV_OK);
    assert_string_equal(pkv__attn_backend_name(at), "ref");
    pkv__attn_destroy(at);
    unsetenv("PKV_FORCE_REF");
    assert_int_equal(pkv__attn_create(NULL, 1, &lim, &at), PKV_OK);
    const uint32_t f = pkv__cpu_features();
    if ((f & (PKV_CPU_AVX2 | PKV_CPU_FMA | PKV_CPU_F16C)) == (PKV_CPU_AVX2 | PKV_CPU_FMA | PKV_CPU_F16C))
        assert_string_not_equal(pkv__attn_backend_name(at), "ref");
    pkv__attn_destroy(at);
}

static void test_bf16_dot(void **state) {
    const backend_case *bc = *state;
    need_backend(bc->name);
    g_rng = 0xbf16;
    /* 36: past NEON's groups of 8 too; 32 and 96: AMX's smallest head_dim and its split of C tiles */
    static const uint32_t dims[] = {64, 80, 128, 256, 40, 36, 32, 96};
    /* K and V: bf16 both, bf16 K with f16 or f32 V, bf16 V with f16 or f32 K */
    static const pkv_dtype kv[][2] = {{PKV_DTYPE_BF16, PKV_DTYPE_BF16}, {PKV_DTYPE_BF16, PKV_DTYPE_F16},
                                      {PKV_DTYPE_BF16, PKV_DTYPE_F32},  {PKV_DTYPE_F16, PKV_DTYPE_BF16},
                                      {PKV_DTYPE_F32, PKV_DTYPE_BF16}};
    /* the oracles' head shapes, and 16 query heads a kv head: decode through the transposed
       primitives (on avx512-amx, tiles) */
    static const uint32_t heads[][2] = {{1, 1}, {8, 8}, {32, 8}, {8, 1}, {32, 2}};
    double worst = 0, worst_lse = 0;
    uint32_t n_lp = 0, n_cases = 0;
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++)
        for (size_t hi = 0; hi < sizeof heads / sizeof *heads; hi++)
            for (size_t ti = 0; ti < sizeof kv / sizeof *kv; ti++) {
                const uint32_t D = dims[di], nqh = heads[hi][0], H = heads[hi][1], G = nqh / H;
                lp_world w;
                lp_world_make(&w, bc->name, H, D, kv[ti][0], kv[ti][1]);
                pkv__attn *at = w.at;
                const bool lp_k = pkv__attn_lp(at, kv[ti][0]), lp_v = lp_v_any(at, kv[ti][0], kv[ti][1]);
                /* rows: the row path's accum rounds weights too (on avx512-amx only the tile units
                   round a bf16 V's) */
                const bool rows_v = pkv__attn_lp_v(at, kv[ti][1]);
                /* the transposed primitives follow the row path's: the same rounding in every unit
                   (a backend without them, NEON, runs such units on the row path) */
                assert_true(pkv__attn_lp_t(at, kv[ti][0], kv[ti][1]) ==
                            ((lp_k || lp_v) && pkv__attn_has_t(at, kv[ti][0], kv[ti][1])));
                n_lp += lp_k || lp_v, n_cases++;
                pkv__attn_call call = {.n_q_heads = nqh, .scale = (float)(1.0 / sqrt((double)D))};
                for (uint32_t i = 0; i < w.n_seqs; i++) {
                    uint32_t n_q = 1, pos0 = w.lens[i] - 1;
                    if (rng_below(3) == 0) { /* an extend: under 16 rows a kv head (the row path) or more */
                        const uint32_t cap = rng_below(2) ? 15 / G : 48;
                        const uint32_t most_q = cap < w.lens[i] ? cap : w.lens[i];
                        n_q = most_q ? 1 + rng_below(most_q) : 1;
                        pos0 = rng_below(w.lens[i] - n_q + 1);
                    }
                    lp_item(&w, i, pos0, n_q, nqh, D);
                }
                /* without the flag first, to compare bits */
                lp_run_plain(&w, &call, nqh, D);
                call.flags = PKV_ATTN_BF16_DOT;
                assert_int_equal(pkv__attn_run(at, &w.p.view, w.items, w.n_seqs, &call), PKV_OK);
                bool differs = false;
                for (uint32_t i = 0; i < w.n_seqs; i++) {
                    const pkv__attn_item *it = &w.items[i];
                    differs |= memcmp(w.plain[i], it->out, sizeof(float) * it->n_q * nqh * D) != 0;
                    const double e =
                        check_item_lp(&w.p, &w.seqs[i], nqh, it, &call, kv[ti][0], kv[ti][1], lp_k, lp_v, &worst_lse);
                    if (e > 1.0)
                        print_message("  fail: %s D=%u q/kv=%u/%u B=%u K=%s V=%s len=%u q_pos0=%u n_q=%u thr=%u: err %.3g\n",
                                      bc->name, D, nqh, H, w.B, pkv_dtype_name(kv[ti][0]), pkv_dtype_name(kv[ti][1]),
                                      w.lens[i], it->q_pos0, it->n_q, w.nt, e);
                    worst = fmax(worst, e);
                }
                /* the flag changes the results exactly where a kernel of its own ran (and some query sees
                   two keys: over one key the output is its V whatever the score) */
                /* t_rows: a unit of 16 rows a kv head may run; t_unit: one does (an extend, not the
                   sweep's, of 16 rows a kv head and more), whose second query sees two keys */
                bool two_keys = false, t_rows = false, t_unit = false;
                for (uint32_t i = 0; i < w.n_seqs; i++) {
                    two_keys |= w.items[i].q_pos0 + w.items[i].n_q >= 2;
                    t_rows |= w.items[i].n_q * G >= 16;
                    t_unit |= w.items[i].n_q >= 2 && w.items[i].n_q * G >= 16;
                }
                if (!(lp_k || rows_v || (lp_v && t_rows))) assert_false(differs);
                else if (two_keys && (lp_k || rows_v)) assert_true(differs);
                else if (t_unit && lp_v && pkv__attn_has_t(at, kv[ti][0], kv[ti][1])) assert_true(differs);
                lp_world_free(&w);
            }
    print_message("  %s: %u of %u cases took bf16 dot products; max err %.3g of the tolerance, lse err %.3g\n",
                  bc->name, n_lp, n_cases, worst, worst_lse);
    assert_true(worst <= 1.0);
    assert_true(worst_lse <= TOL_LSE);
}

static backend_case g_ref = {"ref"}, g_avx2 = {"avx2"}, g_avx512 = {"avx512"}, g_avx512_emu = {"avx512-emu"},
                    g_neon = {"neon"}, g_amx = {"avx512-amx"}, g_amx_emu = {"avx512-amx-emu"};

#define PER_BACKEND(fn)                                                                                            \
    cmocka_unit_test_prestate(fn, &g_ref), cmocka_unit_test_prestate(fn, &g_avx2),                                 \
        cmocka_unit_test_prestate(fn, &g_avx512), cmocka_unit_test_prestate(fn, &g_avx512_emu),                    \
        cmocka_unit_test_prestate(fn, &g_neon)

int main(void) {
    const struct CMUnitTest tests[] = {
        PER_BACKEND(test_seed_value),
        PER_BACKEND(test_oracle_decode),
        PER_BACKEND(test_oracle_prefill),
        PER_BACKEND(test_oracle_softcap_window),
        PER_BACKEND(test_oracle_sinks),
        PER_BACKEND(test_oracle_alibi),
        PER_BACKEND(test_softcap_wide),
        PER_BACKEND(test_oracle_odd_dims),
        PER_BACKEND(test_oracle_extreme_shapes),
        PER_BACKEND(test_oracle_moving_max),
        PER_BACKEND(test_oracle_chunk),
        PER_BACKEND(test_oracle_mask),
        PER_BACKEND(test_window_one_sees_itself),
        PER_BACKEND(test_lse_merge_halves),
        PER_BACKEND(test_threads_agree),
        PER_BACKEND(test_oracle_pool_order),
        PER_BACKEND(test_quant_dtypes_supported_or_enotsup),
        PER_BACKEND(test_bf16_dot),
        PER_BACKEND(test_oracle_bf16_dot),
        /* avx512-amx differs from avx512-vnni only in calls with PKV_ATTN_BF16_DOT or
           PKV_ATTN_F16_AS_BF16 */
        cmocka_unit_test_prestate(test_bf16_dot, &g_amx),
        cmocka_unit_test_prestate(test_oracle_bf16_dot, &g_amx),
        cmocka_unit_test_prestate(test_bf16_dot, &g_amx_emu),
        cmocka_unit_test_prestate(test_oracle_bf16_dot, &g_amx_emu),
        PER_BACKEND(test_f16_as_bf16),
        /* the flag's fp8, q8_0 and q4_0 kernels are avx512-amx's alone: elsewhere the reference
           and NEON show it changes nothing (avx512-amx's base, avx512-vnni, is its flagless table) */
        cmocka_unit_test_prestate(test_fp8_bf16_dot, &g_ref),
        cmocka_unit_test_prestate(test_fp8_bf16_dot, &g_neon),
        cmocka_unit_test_prestate(test_fp8_bf16_dot, &g_amx),
        cmocka_unit_test_prestate(test_fp8_bf16_dot, &g_amx_emu),
        cmocka_unit_test_prestate(test_q_bf16_dot, &g_ref),
        cmocka_unit_test_prestate(test_q_bf16_dot, &g_neon),
        cmocka_unit_test_prestate(test_q_bf16_dot, &g_amx),
        cmocka_unit_test_prestate(test_q_bf16_dot, &g_amx_emu),
        cmocka_unit_test_prestate(test_oracle_quant_bf16_dot, &g_amx),
        cmocka_unit_test_prestate(test_oracle_quant_bf16_dot, &g_amx_emu),
        cmocka_unit_test_prestate(test_f16_as_bf16, &g_amx),
        cmocka_unit_test_prestate(test_f16_as_bf16, &g_amx_emu),
        cmocka_unit_test_prestate(test_oracle_f16_as_bf16, &g_amx),
        cmocka_unit_test_prestate(test_oracle_f16_as_bf16, &g_amx_emu),
        cmocka_unit_test(test_inline_threshold_counts_heads),
        cmocka_unit_test(test_pool_order_choice),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_force_ref),
    };
    return TU_RUN_TESTS(tests); /* PKV_TEST_FILTER, PKV_TEST_SHARD: tu_shard.h */
}
