/* test_shift.c: pkv_seq_shift, the context shift. Every row is written as RoPE(raw, its position)
 * from raw K/V the test draws (its own RoPE in double, both pair styles, a partial rotary part);
 * after shifts each position must hold RoPE(raw of the row it took, its new position) within a
 * tolerance per dtype, V and the unturned K values moved unchanged, the token ids moved, attention
 * over the shifted sequence equal to attention over one written at the new positions directly,
 * forks, matched prefixes and the prefix index untouched (copy on write), nothing indexed or
 * saved past the shift until a truncate, every refusal changing nothing, and the checker clean
 * after every step of a random run. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_assert.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pkv.h"
#include "support_util.h"
#include "cache/cache_int.h"

enum { L = 2, H = 2, D = 64, B = 4, NB = 96, MAXP = 200, TOK0 = 1000 };

/* raw K (v 0) or V (v 1) of original row o: uniform in [-1, 1), from a hash of its place */
static double raw(uint32_t tag, uint32_t l, uint32_t o, uint32_t h, uint32_t i, int v) {
    uint64_t x = ((((uint64_t)tag * 31 + l) * 1000003u + o) * 131 + h) * 1031 + i * 2 + (uint64_t)v + 0x9e3779b97f4a7c15ull;
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9ull, x ^= x >> 27, x *= 0x94d049bb133111ebull, x ^= x >> 31;
    return (double)(x >> 11) / 4503599627370496.0 - 1.0;
}

/* The test's own RoPE: x[D] turned to position pos. */
typedef struct trope {
    uint32_t dim0, n_rot, style;
    double theta;
} trope;

static void rope_at(const trope *r, double pos, double *x) {
    const uint32_t n = r->n_rot / 2;
    for (uint32_t i = 0; i < n; i++) {
        const double a = pos * pow(r->theta, -2.0 * i / r->n_rot);
        const uint32_t lo = r->dim0 + (r->style == PKV_ROPE_NEOX ? i : 2 * i);
        const uint32_t hi = r->dim0 + (r->style == PKV_ROPE_NEOX ? i + n : 2 * i + 1);
        const double u = x[lo], w = x[hi];
        x[lo] = u * cos(a) - w * sin(a);
        x[hi] = u * sin(a) + w * cos(a);
    }
}

static pkv_rope lib_rope(const trope *r) {
    pkv_rope p = {.dim0 = r->dim0, .n_rot = r->n_rot, .style = r->style, .theta = (float)r->theta, .inv_freq = NULL};
    return p;
}

/* Row o's K at position pos (r NULL: no RoPE), and V. */
static void row_k(uint32_t tag, const trope *r, uint32_t l, uint32_t o, uint32_t pos, uint32_t h, double *x) {
    for (uint32_t i = 0; i < D; i++) x[i] = raw(tag, l, o, h, i, 0);
    if (r) rope_at(r, pos, x);
}

/* The model of one sequence: the original row each position holds (its token id TOK0 + orig). */
typedef struct mseq {
    pkv_seq id;
    uint32_t len, orig[MAXP];
} mseq;

/* Writes positions [from, len) of m (appended already) as rows orig[p] at p, every layer. */
static void write_rows(pkv_cache *c, uint32_t tag, const trope *r, const mseq *m, uint32_t from) {
    float k[H * D], v[H * D];
    double x[D];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t p = from; p < m->len; p++) {
            for (uint32_t h = 0; h < H; h++) {
                row_k(tag, r, l, m->orig[p], p, h, x);
                for (uint32_t i = 0; i < D; i++)
                    k[h * D + i] = (float)x[i], v[h * D + i] = (float)raw(tag, l, m->orig[p], h, i, 1);
            }
            TU_OK(pkv_seq_write_kv(c, m->id, l, p, 1, k, v, PKV_DTYPE_F32));
        }
}

/* A new sequence of rows [o0, o0 + n) at positions [0, n), committed to `commit`. */
static mseq make_seq(pkv_cache *c, uint32_t tag, const trope *r, uint32_t o0, uint32_t n, uint32_t commit) {
    mseq m = {.id = tu_seq(c), .len = n};
    int32_t tok[MAXP];
    for (uint32_t p = 0; p < n; p++) m.orig[p] = o0 + p, tok[p] = (int32_t)(TOK0 + o0 + p);
    TU_OK(pkv_seq_append(c, m.id, tok, n, NULL));
    write_rows(c, tag, r, &m, 0);
    TU_OK(pkv_seq_commit(c, m.id, commit));
    return m;
}

/* The model's side of pkv_seq_shift. */
static void model_shift(mseq *m, uint32_t from, uint32_t to) {
    memmove(m->orig + from, m->orig + to, (m->len - to) * sizeof(uint32_t));
    m->len -= to - from;
}

/* What a row's K may differ by after `turns` shifts, in units of the row's largest raw value: a
 * rounding to the pool's dtype at the write and one at each turn (f16 2^-11, bf16 2^-8 of the
 * value; q8_0 half a step of max / 127, q4_0 of max / 7 over a 32-value group; fp8 e4m3 2^-4 of
 * the value), and float's cos and sin besides. */
static double k_tol(pkv_dtype dt, uint32_t turns) {
    const double one = dt == PKV_DTYPE_F32    ? 2e-6
                       : dt == PKV_DTYPE_F16  ? 1.1e-3
                       : dt == PKV_DTYPE_BF16 ? 8e-3
                       : dt == PKV_DTYPE_Q8_0 ? 1.2e-2
                       : dt == PKV_DTYPE_Q4_0 ? 0.15
                                              : 0.09;
    return one * (1 + turns) * 1.5; /* x 1.5: a pair's two values mix in a turn */
}

/* The larger of m and x, NaN where x is (so that a NaN fails the tolerance after). */
static double worse(double m, double x) { return isnan(m) || x <= m ? m : x; }

/* m in c against the model: length, token ids, V as written (bit for bit against before[] where
 * given: the gathered V of the row's original position), K within tol of RoPE(raw, position). */
static void check_seq(pkv_cache *c, uint32_t tag, const trope *r, const mseq *m, pkv_dtype dt, uint32_t turns) {
    assert_int_equal(tu_info(c, m->id).n_tokens, m->len);
    int32_t table[MAXP / B + 2];
    const uint32_t nb = tu_table(c, m->id, table, MAXP / B + 2);
    assert_int_equal(nb, (m->len + B - 1) / B);
    for (uint32_t p = 0; p < m->len; p++)
        assert_int_equal(c->tokens[(size_t)table[p / B] * B + p % B], (int32_t)(TOK0 + m->orig[p]));
    float *k = malloc(sizeof(float) * MAXP * H * D), *v = malloc(sizeof(float) * MAXP * H * D);
    assert_true(k && v);
    const double tol = k_tol(dt, turns);
    double x[D], vv[D];
    for (uint32_t l = 0; l < L; l++) {
        TU_OK(pkv_seq_gather(c, m->id, l, 0, m->len, k, v));
        for (uint32_t p = 0; p < m->len; p++)
            for (uint32_t h = 0; h < H; h++) {
                row_k(tag, r, l, m->orig[p], p, h, x);
                double mx = 0, e = 0; /* (not fmax: aarch64 GCC 12 at -O3 failed on those loops, an ICE) */
                for (uint32_t i = 0; i < D; i++) mx = worse(mx, fabs(raw(tag, l, m->orig[p], h, i, 0)));
                for (uint32_t i = 0; i < D; i++) e = worse(e, fabs(k[((size_t)p * H + h) * D + i] - x[i]));
                if (!(e <= tol * mx))
                    fail_msg("%s layer %u pos %u (row %u) head %u: K off by %g (tol %g)", pkv_dtype_name(dt), l, p,
                             m->orig[p], h, e, tol * mx);
                /* V: what the pool made of the raw value, the same wherever the row went */
                for (uint32_t i = 0; i < D; i++) vv[i] = raw(tag, l, m->orig[p], h, i, 1);
                double ev = 0, mv = 0;
                for (uint32_t i = 0; i < D; i++)
                    ev = worse(ev, fabs(v[((size_t)p * H + h) * D + i] - vv[i])), mv = worse(mv, fabs(vv[i]));
                assert_true(ev <= k_tol(dt, 0) * mv);
            }
    }
    free(k);
    free(v);
}

/* Every layer's rows of s gathered [len][H][D] K then V (f32), for exact comparisons. */
static float *snap(pkv_cache *c, pkv_seq s, uint32_t len) {
    float *o = malloc(sizeof(float) * 2 * L * (len + 1) * H * D);
    assert_non_null(o);
    for (uint32_t l = 0; l < L; l++) {
        float *k = o + (size_t)l * 2 * len * H * D;
        TU_OK(pkv_seq_gather(c, s, l, 0, len, k, k + (size_t)len * H * D));
    }
    return o;
}

static pkv_config cfg_of(pkv_dtype dt, uint32_t n_blocks, int prefix) {
    pkv_config cfg = tu_config(n_blocks, B, L, H, D, dt);
    cfg.enable_prefix_cache = prefix;
    cfg.max_seqs = 16;
    return cfg;
}

static const trope g_neox = {0, D, PKV_ROPE_NEOX, 10000.0};
static const trope g_gptj = {16, 32, PKV_ROPE_GPTJ, 500.0}; /* a partial rotary part past dim0 */

/* Shifts of one sequence, its fork and a matched prefix beside it, for every dtype and both
 * styles: the rows where the model says, the others' rows and the index untouched. */
static void test_shift_oracle(void **state) {
    (void)state;
    const pkv_dtype dts[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_Q8_0, PKV_DTYPE_Q4_0,
                             PKV_DTYPE_FP8_E4M3};
    const trope *ropes[] = {&g_neox, &g_gptj, NULL};
    for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
        for (int ri = 0; ri < 3; ri++) {
            const pkv_dtype dt = dts[di];
            const trope *r = ropes[ri];
            const pkv_config cfg = cfg_of(dt, NB, 1);
            pkv_cache *c = tu_create(&cfg);
            const uint32_t tag = (uint32_t)(di * 3 + ri);
            mseq a = make_seq(c, tag, r, 0, 50, 50);
            mseq f = a; /* a fork: every block shared */
            TU_OK(pkv_seq_fork(c, a.id, &f.id));
            int32_t tok[50];
            tu_tokens(tok, 50, TOK0);
            mseq m = {.id = tu_seq(c), .len = 0};
            uint32_t reused = 0;
            TU_OK(pkv_seq_match_prefix(c, m.id, tok, 50, &reused));
            assert_int_equal(reused, 49);
            m.len = 49;
            for (uint32_t p = 0; p < 49; p++) m.orig[p] = p;
            float *before = snap(c, a.id, 50);
            const pkv_stats st0 = tu_stats(c);
            TU_CHECK(c);
            /* unaligned (13, 22), then block-aligned (8, 16), then from 0, then the tail */
            const uint32_t cuts[][2] = {{13, 22}, {8, 16}, {0, 3}, {20, 0}}; /* the last to the end */
            uint32_t turns = 0;
            pkv_rope lr = r ? lib_rope(r) : (pkv_rope){0};
            for (size_t k = 0; k < 4; k++) {
                const uint32_t from = cuts[k][0], to = k == 3 ? a.len : cuts[k][1];
                const uint32_t com = tu_info(c, a.id).n_committed;
                TU_OK(pkv_seq_shift(c, a.id, from, to, r ? &lr : NULL));
                model_shift(&a, from, to);
                turns += to < a.len + (to - from); /* a truncate turns nothing */
                TU_CHECK(c);
                assert_int_equal(tu_info(c, a.id).n_committed, com >= to ? com - (to - from) : PKV_MIN(com, from));
                check_seq(c, tag, r, &a, dt, turns);
            }
            /* V and the unturned K values moved bit for bit (16-bit and f32 pools) */
            if (dt == PKV_DTYPE_F32 || dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16) {
                float *after = snap(c, a.id, a.len);
                for (uint32_t l = 0; l < L; l++)
                    for (uint32_t p = 0; p < a.len; p++)
                        for (uint32_t h = 0; h < H; h++)
                            for (uint32_t i = 0; i < D; i++) {
                                const size_t o = ((size_t)a.orig[p] * H + h) * D + i, n = ((size_t)p * H + h) * D + i;
                                const float *bk = before + (size_t)l * 2 * 50 * H * D, *ak = after + (size_t)l * 2 * a.len * H * D;
                                assert_true(memcmp(&bk[50 * H * D + o], &ak[a.len * H * D + n], sizeof(float)) == 0);
                                const bool turned = r && i >= r->dim0 && i < r->dim0 + r->n_rot;
                                if (!turned) assert_true(memcmp(&bk[o], &ak[n], sizeof(float)) == 0);
                            }
                free(after);
            }
            /* the fork and the matched sequence kept theirs; the index kept every block */
            float *fa = snap(c, f.id, 50);
            assert_memory_equal(fa, before, sizeof(float) * 2 * L * 50 * H * D);
            free(fa);
            check_seq(c, tag, r, &m, dt, 0);
            const pkv_stats st1 = tu_stats(c);
            assert_int_equal(st1.n_indexed, st0.n_indexed);
            assert_true(st1.cow_copies > st0.cow_copies);
            /* a's new positions index nothing; the same prompt again matches whole, as it was */
            int32_t more[8];
            for (uint32_t i = 0; i < 8; i++) more[i] = 7000 + (int32_t)i, a.orig[a.len + i] = 6000 + i;
            TU_OK(pkv_seq_append(c, a.id, more, 8, NULL));
            a.len += 8;
            TU_OK(pkv_seq_commit(c, a.id, a.len));
            assert_int_equal(tu_stats(c).n_indexed, st0.n_indexed);
            mseq m2 = {.id = tu_seq(c)};
            TU_OK(pkv_seq_match_prefix(c, m2.id, tok, 50, &reused));
            assert_int_equal(reused, 49);
            m2.len = 49;
            memcpy(m2.orig, m.orig, sizeof m.orig);
            check_seq(c, tag, r, &m2, dt, 0);
            /* truncated to the last shift's from (0) or below, a is exact again: new blocks index */
            TU_OK(pkv_seq_truncate(c, a.id, 1));
            assert_int_equal(tu_stats(c).n_indexed, st0.n_indexed); /* (exact from 0: not yet) */
            TU_OK(pkv_seq_truncate(c, a.id, 0));
            int32_t fresh[16];
            tu_tokens(fresh, 16, 8000);
            TU_OK(pkv_seq_append(c, a.id, fresh, 16, NULL));
            for (uint32_t p = 0; p < 16; p++) a.orig[p] = 7000 + p;
            a.len = 16;
            write_rows(c, tag, r, &a, 0);
            TU_OK(pkv_seq_commit(c, a.id, 16));
            assert_int_equal(tu_stats(c).n_indexed, st0.n_indexed + 4);
            TU_CHECK(c);
            free(before);
            pkv_cache_destroy(c);
        }
}

/* Attention after a shift equals attention over a sequence written at the new positions. */
static void test_shift_attention(void **state) {
    (void)state;
    const pkv_dtype dts[] = {PKV_DTYPE_F32, PKV_DTYPE_F16};
    for (size_t di = 0; di < 2; di++) {
        const pkv_dtype dt = dts[di];
        const pkv_config cfg = cfg_of(dt, NB, 0);
        pkv_cache *c = tu_create(&cfg);
        mseq a = make_seq(c, 40, &g_neox, 0, 120, 120);
        const pkv_rope lr = lib_rope(&g_neox);
        TU_OK(pkv_seq_shift(c, a.id, 4, 61, &lr)); /* StreamingLLM: 4 sinks kept, the oldest 57 after them gone */
        model_shift(&a, 4, 61);
        mseq b = {.id = tu_seq(c), .len = a.len};
        memcpy(b.orig, a.orig, sizeof a.orig);
        int32_t tok[MAXP];
        for (uint32_t p = 0; p < b.len; p++) tok[p] = (int32_t)(TOK0 + b.orig[p]);
        TU_OK(pkv_seq_append(c, b.id, tok, b.len, NULL));
        write_rows(c, 40, &g_neox, &b, 0);
        const uint32_t nq = 2 * H;
        float q[2 * 2 * H * D], out[2 * 2 * H * D], lse[2 * 2 * H]; /* [2 sequences][nq][D] */
        for (uint32_t i = 0; i < nq * D; i++) q[i] = q[nq * D + i] = (float)raw(41, 0, 0, 0, i, 0) * 2.0f;
        const pkv_seq ids[2] = {a.id, b.id};
        pkv_attn_params ap = pkv_attn_params_default();
        ap.n_q_heads = nq;
        for (uint32_t l = 0; l < L; l++) {
            ap.lse = lse;
            TU_OK(pkv_attn_decode(c, l, ids, 2, q, out, &ap));
            for (uint32_t i = 0; i < nq * D; i++)
                assert_true(fabs(out[i] - out[nq * D + i]) <= (dt == PKV_DTYPE_F32 ? 1e-5 : 4e-3));
            for (uint32_t h = 0; h < nq; h++)
                assert_true(fabs(lse[h] - lse[nq + h]) <= (dt == PKV_DTYPE_F32 ? 1e-5 : 4e-3));
        }
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

/* Every refusal says why and changes nothing. */
static void test_shift_refusals(void **state) {
    (void)state;
    pkv_config cfg = cfg_of(PKV_DTYPE_F16, NB, 1);
    pkv_cache *c = tu_create(&cfg);
    mseq a = make_seq(c, 50, &g_neox, 0, 40, 40);
    TU_OK(pkv_seq_drop_front(c, a.id, 9)); /* the front: 2 blocks, positions [0, 8) */
    float *before = NULL;
    const pkv_stats st0 = tu_stats(c);
    const pkv_seq_info in0 = tu_info(c, a.id);
    pkv_rope ok = lib_rope(&g_neox), bad;
    float nanf[D / 2];
    for (uint32_t i = 0; i < D / 2; i++) nanf[i] = i == 5 ? NAN : 0.1f;
    struct {
        uint32_t from, to;
        int which; /* 0 ok rope, 1.. bad ropes */
        int want;
    } cases[] = {
        {20, 10, 0, PKV_EINVAL}, {10, 41, 0, PKV_EINVAL}, {4, 12, 0, PKV_EINVAL}, /* from > to, past length, front */
        {10, 12, 1, PKV_EINVAL}, {10, 12, 2, PKV_EINVAL}, {10, 12, 3, PKV_EINVAL}, /* n_rot odd, 0, past head_dim */
        {10, 12, 4, PKV_EINVAL}, {10, 12, 5, PKV_EINVAL}, {10, 12, 6, PKV_EINVAL}, /* style, theta, inv_freq */
    };
    before = malloc(sizeof(float) * 2 * L * 40 * H * D);
    for (uint32_t l = 0; l < L; l++)
        TU_OK(pkv_seq_gather(c, a.id, l, 8, 32, before + (size_t)l * 2 * 32 * H * D,
                             before + (size_t)l * 2 * 32 * H * D + 32 * H * D));
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        bad = ok;
        if (cases[k].which == 1) bad.n_rot = 7;
        if (cases[k].which == 2) bad.n_rot = 0;
        if (cases[k].which == 3) bad.dim0 = 2; /* 2 + 64 > 64 */
        if (cases[k].which == 4) bad.style = 7;
        if (cases[k].which == 5) bad.theta = 0.0f;
        if (cases[k].which == 6) bad.inv_freq = nanf;
        TU_RC(pkv_seq_shift(c, a.id, cases[k].from, cases[k].to, &bad), cases[k].want);
        const pkv_stats st = tu_stats(c);
        TU_STATS_EQ(&st, &st0);
        const pkv_seq_info in = tu_info(c, a.id);
        assert_memory_equal(&in, &in0, sizeof in);
        float *now = malloc(sizeof(float) * 2 * L * 40 * H * D);
        for (uint32_t l = 0; l < L; l++)
            TU_OK(pkv_seq_gather(c, a.id, l, 8, 32, now + (size_t)l * 2 * 32 * H * D,
                                 now + (size_t)l * 2 * 32 * H * D + 32 * H * D));
        assert_memory_equal(now, before, sizeof(float) * 2 * L * 32 * H * D);
        free(now);
    }
    TU_RC(pkv_seq_shift(NULL, a.id, 10, 12, &ok), PKV_EINVAL);
    TU_RC(pkv_seq_shift(c, (pkv_seq)12345, 10, 12, &ok), PKV_ENOENT);
    pkv_seq pin;
    mseq p = make_seq(c, 51, &g_neox, 100, 16, 16);
    TU_OK(pkv_pin_create(c, p.id, 16, &pin));
    TU_RC(pkv_seq_shift(c, pin, 1, 2, &ok), PKV_EINVAL);
    TU_OK(pkv_seq_shift(c, a.id, 12, 12, &ok)); /* nothing to remove */
    assert_int_equal(tu_info(c, a.id).n_tokens, 40);
    TU_CHECK(c);
    free(before);
    pkv_cache_destroy(c);

    /* a turn that takes an f16 value past 65504: refused, nothing changed */
    cfg = cfg_of(PKV_DTYPE_F16, NB, 0);
    c = tu_create(&cfg);
    const pkv_seq s = tu_seq(c);
    tu_append(c, s, 8, 0, NULL);
    float k[H * D], v[H * D];
    for (uint32_t i = 0; i < H * D; i++) k[i] = 60000.0f, v[i] = 1.0f;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t pos = 0; pos < 8; pos++) TU_OK(pkv_seq_write_kv(c, s, l, pos, 1, k, v, PKV_DTYPE_F32));
    const pkv_stats s0 = tu_stats(c);
    pkv_rope big = {.dim0 = 0, .n_rot = D, .style = PKV_ROPE_NEOX, .theta = 10000.0f, .inv_freq = NULL};
    TU_RC(pkv_seq_shift(c, s, 2, 3, &big), PKV_EINVAL); /* pair 0 turns by -1 rad: 60000 (cos 1 + sin 1) */
    const pkv_stats s1 = tu_stats(c);
    TU_STATS_EQ(&s1, &s0);
    float g[8 * H * D];
    TU_OK(pkv_seq_gather(c, s, 0, 0, 8, g, NULL));
    for (uint32_t i = 0; i < 8 * H * D; i++) assert_true(g[i] == 60000.0f);
    TU_OK(pkv_seq_shift(c, s, 2, 3, NULL)); /* no turn: moved as stored */
    assert_int_equal(tu_info(c, s).n_tokens, 7);
    TU_CHECK(c);
    pkv_cache_destroy(c);

    /* Rows whose magnitudes alone do not clear them (the check's scan: 1.5 x the largest under
       the pool's limit) are turned to tell: pair 0 turns by -1 rad, (a, b) -> (a cos 1 + b sin 1,
       b cos 1 - a sin 1). f16: (50000, 0) stays within 65504 and is taken, whatever a scan says;
       f32: (a, a) with a = 0.7 x 2^56 turns to 0.967 x 2^56, taken, and a = 0.75 x 2^56 to 1.036
       x 2^56, refused with nothing changed. */
    const struct {
        pkv_dtype dt;
        float a, b;
        int want;
    } turned[] = {
        {PKV_DTYPE_F16, 50000.0f, 0.0f, PKV_OK},
        {PKV_DTYPE_F32, 0.7f * 0x1p56f, 0.7f * 0x1p56f, PKV_OK},
        {PKV_DTYPE_F32, 0.75f * 0x1p56f, 0.75f * 0x1p56f, PKV_EINVAL},
        {PKV_DTYPE_BF16, 0.75f * 0x1p56f, 0.75f * 0x1p56f, PKV_EINVAL},
    };
    for (size_t t = 0; t < sizeof turned / sizeof turned[0]; t++) {
        cfg = cfg_of(turned[t].dt, NB, 0);
        c = tu_create(&cfg);
        const pkv_seq u = tu_seq(c);
        tu_append(c, u, 8, 0, NULL);
        for (uint32_t i = 0; i < H * D; i++) k[i] = 1.0f, v[i] = 1.0f;
        for (uint32_t h = 0; h < H; h++) k[h * D] = turned[t].a, k[h * D + D / 2] = turned[t].b; /* pair 0 (NEOX) */
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t pos = 0; pos < 8; pos++) TU_OK(pkv_seq_write_kv(c, u, l, pos, 1, k, v, PKV_DTYPE_F32));
        const pkv_stats u0 = tu_stats(c);
        float g0[8 * H * D]; /* as stored (f16 rounds 50000 to 50016) */
        TU_OK(pkv_seq_gather(c, u, 0, 0, 8, g0, NULL));
        TU_RC(pkv_seq_shift(c, u, 2, 3, &big), turned[t].want);
        TU_OK(pkv_seq_gather(c, u, 0, 0, turned[t].want ? 8 : 7, g, NULL));
        if (turned[t].want) { /* nothing changed */
            const pkv_stats u1 = tu_stats(c);
            TU_STATS_EQ(&u1, &u0);
            assert_memory_equal(g, g0, sizeof g0);
        } else { /* before 2: as they were; 2 on: the rows of 3 on, pair 0 as a double turn gives */
            assert_memory_equal(g, g0, sizeof(float) * 2 * H * D);
            for (uint32_t h = 0; h < H; h++) {
                const double x0 = g0[3 * H * D + h * D], y0 = g0[3 * H * D + h * D + D / 2];
                const double x = x0 * cos(1.0) + y0 * sin(1.0), y = y0 * cos(1.0) - x0 * sin(1.0);
                TU_NEAR(g[2 * H * D + h * D], (float)x, fabsf((float)x) * 1e-3f);
                TU_NEAR(g[2 * H * D + h * D + D / 2], (float)y, fabsf((float)y) * 1e-3f);
            }
            assert_int_equal(tu_info(c, u).n_tokens, 7);
        }
        TU_CHECK(c);
        pkv_cache_destroy(c);
    }
}

/* Copies need blocks: none to be had is PKV_ENOSPC with nothing changed; a block s held alone
 * (indexed) goes CACHED as its copy is made, so one block to be had serves every copy. */
static void test_shift_nospace(void **state) {
    (void)state;
    const pkv_config cfg = cfg_of(PKV_DTYPE_F32, 12, 1);
    pkv_cache *c = tu_create(&cfg);
    mseq a = make_seq(c, 60, NULL, 0, 40, 40); /* 10 blocks, indexed */
    mseq f = a;
    TU_OK(pkv_seq_fork(c, a.id, &f.id));
    const pkv_seq filler = tu_seq(c);
    tu_append(c, filler, 8, 5000, NULL); /* the last 2 blocks */
    const pkv_stats st0 = tu_stats(c);
    assert_int_equal(st0.n_free + st0.n_cached, 0);
    TU_RC(pkv_seq_shift(c, a.id, 5, 9, NULL), PKV_ENOSPC);
    const pkv_stats st1 = tu_stats(c);
    TU_STATS_EQ(&st1, &st0);
    assert_int_equal(tu_info(c, a.id).n_tokens, 40);
    /* the fork gone, a holds its blocks alone: one free block serves all 9 copies */
    TU_OK(pkv_seq_release(c, f.id));
    TU_OK(pkv_seq_truncate(c, filler, 4));
    assert_int_equal(tu_stats(c).n_free, 1);
    TU_OK(pkv_seq_shift(c, a.id, 5, 9, NULL));
    model_shift(&a, 5, 9);
    check_seq(c, 60, NULL, &a, PKV_DTYPE_F32, 0);
    assert_int_equal(tu_stats(c).cow_copies - st0.cow_copies, 8); /* blocks 1-8 */
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* A fork of a shifted sequence truncated back into the exact part shares the block the shift
 * moved rows into: neither may hand that block's rows to a match, whoever commits it (fuzz_api
 * found the fork's commits exposed through the other's registered partial), until the exact one
 * holds it alone and writes its own rows there. */
static void test_shift_fork_truncate(void **state) {
    (void)state;
    const pkv_config cfg = cfg_of(PKV_DTYPE_F32, NB, 1);
    pkv_cache *c = tu_create(&cfg);
    mseq a = make_seq(c, 65, NULL, 0, 13, 4); /* block 0 committed and indexed */
    TU_OK(pkv_seq_shift(c, a.id, 6, 7, NULL)); /* block 1 (positions 4-7) takes moved rows */
    model_shift(&a, 6, 7);
    mseq f = a;
    TU_OK(pkv_seq_fork(c, a.id, &f.id));
    TU_OK(pkv_seq_truncate(c, a.id, 5)); /* a: exact again, block 1 shared with f */
    a.len = 5;
    TU_OK(pkv_seq_commit(c, a.id, 5));
    TU_OK(pkv_seq_commit(c, f.id, 10)); /* f commits its moved rows in block 1 */
    TU_CHECK(c);
    int32_t tok[12];
    for (uint32_t p = 0; p < f.len; p++) tok[p] = (int32_t)(TOK0 + f.orig[p]);
    const pkv_stats st0 = tu_stats(c);
    pkv_seq m = tu_seq(c);
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(c, m, tok, 12, &reused));
    assert_int_equal(reused, 4); /* block 0 alone: nothing of block 1 */
    TU_OK(pkv_seq_release(c, m));
    TU_OK(pkv_seq_release(c, f.id));
    /* a alone writes its own rows into block 1: then it indexes it */
    int32_t more[3] = {9001, 9002, 9003};
    TU_OK(pkv_seq_append(c, a.id, more, 3, NULL));
    for (uint32_t p = 5; p < 8; p++) a.orig[p] = 9001 + p;
    a.len = 8;
    write_rows(c, 65, NULL, &a, 5);
    TU_OK(pkv_seq_commit(c, a.id, 8));
    assert_int_equal(tu_stats(c).n_indexed, st0.n_indexed + 1);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* pkv_seq_keep after a shift, keeping rows from past the exact part at positions before it: the
 * exact part ends where they now begin, so the commit after indexes none of them (the review's
 * find: they had been indexed, and a match of those ids handed them out as a prefill). */
static void test_shift_then_keep(void **state) {
    (void)state;
    const pkv_config cfg = cfg_of(PKV_DTYPE_F32, NB, 1);
    pkv_cache *c = tu_create(&cfg);
    mseq a = make_seq(c, 66, NULL, 0, 20, 0); /* nothing committed */
    TU_OK(pkv_seq_shift(c, a.id, 8, 12, NULL)); /* exact 8, length 16 */
    model_shift(&a, 8, 12);
    const uint32_t idx[5] = {5, 6, 7, 8, 9}; /* positions 4..8 take the rows of 9..13 */
    TU_OK(pkv_seq_keep(c, a.id, 4, idx, 5));
    for (uint32_t k = 0; k < 5; k++) a.orig[4 + k] = a.orig[4 + idx[k]];
    a.len = 9;
    TU_OK(pkv_seq_commit(c, a.id, 9));
    TU_CHECK(c);
    check_seq(c, 66, NULL, &a, PKV_DTYPE_F32, 0);
    int32_t tok[9];
    for (uint32_t p = 0; p < 9; p++) tok[p] = (int32_t)(TOK0 + a.orig[p]);
    const pkv_seq m = tu_seq(c);
    uint32_t reused = 0;
    TU_OK(pkv_seq_match_prefix(c, m, tok, 9, &reused));
    assert_int_equal(reused, 4); /* block 0: positions 0..3, exact */
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* A shift whose copies evict a CACHED twin of a full partial s registered (an inner block of a
 * fork's dropped front): the eviction would hand the twin's index entry to the partial, which then
 * needs a copy the count before had not seen. The partials s holds alone are unlinked before any
 * copy, so the shift succeeds (it had aborted on pkv_assert: the review's find). */
static void test_shift_hand_over(void **state) {
    (void)state;
    pkv_config cfg = cfg_of(PKV_DTYPE_F32, 16, 1);
    pkv_cache *c = tu_create(&cfg);
    int32_t t[16];
    tu_tokens(t, 16, 100);
    pkv_seq s = tu_seq(c), q, r;
    TU_OK(pkv_seq_append(c, s, t, 8, NULL));
    TU_OK(pkv_seq_commit(c, s, 8)); /* a0 a1 indexed */
    TU_OK(pkv_seq_fork(c, s, &q));
    TU_OK(pkv_seq_append(c, q, t + 8, 8, NULL));
    TU_OK(pkv_seq_commit(c, q, 16));     /* X (under a1) and Y indexed */
    TU_OK(pkv_seq_drop_front(c, q, 12)); /* X CACHED in the inner queue (Y in use) */
    TU_OK(pkv_seq_fork(c, s, &r));
    TU_OK(pkv_seq_drop_front(c, r, 4)); /* a1 shared with r */
    TU_OK(pkv_seq_append(c, s, t + 8, 4, NULL));
    TU_OK(pkv_seq_commit(c, s, 10));
    TU_OK(pkv_seq_commit(c, s, 12)); /* s's third block: a full registered partial, X's twin */
    const pkv_seq f = tu_seq(c);
    const int32_t ft[4] = {7, 7, 7, 7};
    while (tu_stats(c).n_free) TU_OK(pkv_seq_append(c, f, ft, 4, NULL));
    assert_int_equal(tu_stats(c).n_cached, 1);
    TU_OK(pkv_seq_shift(c, s, 0, 1, NULL));
    assert_int_equal(tu_info(c, s).n_tokens, 11);
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* A storage tier saves a shifted sequence's blocks before the shift only. */
static void test_shift_tier(void **state) {
    (void)state;
    const pkv_config cfg = cfg_of(PKV_DTYPE_F16, NB, 1);
    pkv_cache *c = tu_create(&cfg);
    pkv_tier *t;
    TU_OK(pkv_tier_host_create(64u << 20, NULL, &t));
    mseq a = make_seq(c, 70, &g_gptj, 0, 60, 60);
    const pkv_rope lr = lib_rope(&g_gptj);
    TU_OK(pkv_seq_shift(c, a.id, 18, 30, &lr));
    uint32_t saved = 0;
    TU_OK(pkv_tier_save(t, c, a.id, &saved));
    assert_int_equal(saved, 18 / B); /* blocks 0-3: positions [0, 16) */
    TU_OK(pkv_seq_truncate(c, a.id, 17));
    int32_t tok[8];
    tu_tokens(tok, 8, 9000);
    TU_OK(pkv_seq_append(c, a.id, tok, 8, NULL));
    a.len = 25;
    for (uint32_t p = 17; p < 25; p++) a.orig[p] = 8000 + p; /* (rows of their own; ids TOK0 + orig unused) */
    write_rows(c, 70, &g_gptj, &a, 17);
    TU_OK(pkv_seq_commit(c, a.id, 25));
    TU_OK(pkv_tier_save(t, c, a.id, &saved));
    assert_int_equal(saved, 2); /* exact again: blocks 4 and 5 */
    TU_CHECK(c);
    pkv_tier_destroy(t);
    pkv_cache_destroy(c);
}

/* MLA: V lives in K's first v_dim values, the rotary part after them (DeepSeek's layout). */
static void test_shift_mla(void **state) {
    (void)state;
    pkv_config cfg = cfg_of(PKV_DTYPE_BF16, NB, 1);
    cfg.v_dim = 48;
    pkv_cache *c = tu_create(&cfg);
    const trope r = {48, 16, PKV_ROPE_GPTJ, 10000.0};
    const pkv_seq s = tu_seq(c);
    tu_append(c, s, 30, TOK0, NULL);
    double x[D];
    float k[H * D];
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t p = 0; p < 30; p++) {
            for (uint32_t h = 0; h < H; h++) {
                row_k(80, &r, l, p, p, h, x);
                for (uint32_t i = 0; i < D; i++) k[h * D + i] = (float)x[i];
            }
            TU_OK(pkv_seq_write_kv(c, s, l, p, 1, k, NULL, PKV_DTYPE_F32));
        }
    TU_OK(pkv_seq_commit(c, s, 30));
    float before[30 * H * D], after[30 * H * D];
    TU_OK(pkv_seq_gather(c, s, 1, 0, 30, before, NULL));
    const pkv_rope lr = lib_rope(&r);
    TU_OK(pkv_seq_shift(c, s, 3, 10, &lr));
    TU_OK(pkv_seq_gather(c, s, 1, 0, 23, after, NULL));
    for (uint32_t p = 0; p < 23; p++) {
        const uint32_t o = p < 3 ? p : p + 7;
        for (uint32_t h = 0; h < H; h++) {
            assert_memory_equal(&after[(p * H + h) * D], &before[(o * H + h) * D], 48 * sizeof(float)); /* V's part */
            row_k(80, &r, 1, o, p, h, x);
            for (uint32_t i = 48; i < D; i++) assert_true(fabs(after[(p * H + h) * D + i] - x[i]) <= k_tol(PKV_DTYPE_BF16, 1));
        }
    }
    TU_CHECK(c);
    pkv_cache_destroy(c);
}

/* Random shifts among appends, commits, forks, matches, truncates and releases over a small
 * prefix-caching pool: the checker after every step, every live sequence against its model. */
static void test_shift_random(void **state) {
    (void)state;
    const pkv_dtype dts[] = {PKV_DTYPE_F32, PKV_DTYPE_F16};
    for (size_t di = 0; di < 2; di++) {
        const pkv_dtype dt = dts[di];
        const pkv_config cfg = cfg_of(dt, 48, 1);
        pkv_cache *c = tu_create(&cfg);
        tu_rng rng;
        tu_rng_seed(&rng, tu_env_u64("PKV_TEST_SEED", 94) + di);
        enum { NS = 6 };
        mseq ms[NS];
        uint32_t turns[NS] = {0};
        bool live[NS] = {false};
        const uint32_t tag = 90;
        const pkv_rope lr = lib_rope(&g_neox);
        uint32_t n_shifts = 0, n_cow = 0;
        for (int step = 0; step < 600; step++) {
            const uint32_t i = tu_rng_below(&rng, NS), op = tu_rng_below(&rng, 6);
            mseq *m = &ms[i];
            if (!live[i]) { /* a new request: a prompt of rows 0.., matched first where it can be */
                m->id = tu_seq(c);
                m->len = 0;
                live[i] = true;
                turns[i] = 0;
                const uint32_t n = 4 + tu_rng_below(&rng, 40);
                int32_t tok[MAXP];
                for (uint32_t p = 0; p < n; p++) tok[p] = (int32_t)(TOK0 + p), m->orig[p] = p;
                uint32_t reused = 0;
                int rc = pkv_seq_match_prefix(c, m->id, tok, n, &reused);
                if (rc == PKV_OK) rc = pkv_seq_append(c, m->id, tok + reused, n - reused, NULL);
                if (rc != PKV_OK) {
                    TU_OK(pkv_seq_release(c, m->id));
                    live[i] = false;
                    continue;
                }
                m->len = n;
                write_rows(c, tag, &g_neox, m, reused);
                TU_OK(pkv_seq_commit(c, m->id, n));
            } else if (op == 0 && m->len > 1) { /* a shift */
                const uint32_t from = tu_rng_below(&rng, m->len), to = from + 1 + tu_rng_below(&rng, m->len - from);
                const pkv_stats st = tu_stats(c);
                const int rc = pkv_seq_shift(c, m->id, from, to, &lr);
                if (rc == PKV_ENOSPC) {
                    const pkv_stats st2 = tu_stats(c);
                    TU_STATS_EQ(&st2, &st);
                } else {
                    TU_OK(rc);
                    if (to < m->len) turns[i]++;
                    model_shift(m, from, to);
                    n_shifts++;
                    n_cow += (uint32_t)(tu_stats(c).cow_copies - st.cow_copies);
                }
            } else if (op == 1 && m->len + 8 < MAXP) { /* decode a few more */
                const uint32_t n = 1 + tu_rng_below(&rng, 8), at = m->len;
                int32_t tok[8];
                for (uint32_t k = 0; k < n; k++) tok[k] = (int32_t)(TOK0 + 500 + step * 8 + k), m->orig[at + k] = 500 + step * 8 + k;
                if (pkv_seq_append(c, m->id, tok, n, NULL) != PKV_OK) continue;
                m->len += n;
                write_rows(c, tag, &g_neox, m, at);
                TU_OK(pkv_seq_commit(c, m->id, m->len));
            } else if (op == 2) { /* a fork into a free place */
                for (uint32_t j = 0; j < NS; j++)
                    if (!live[j]) {
                        ms[j] = *m;
                        if (pkv_seq_fork(c, m->id, &ms[j].id) != PKV_OK) break;
                        live[j] = true;
                        turns[j] = turns[i];
                        break;
                    }
            } else if (op == 3) {
                const uint32_t n = tu_rng_below(&rng, m->len + 1);
                TU_OK(pkv_seq_truncate(c, m->id, n));
                m->len = n;
            } else if (op == 4) {
                TU_OK(pkv_seq_release(c, m->id));
                live[i] = false;
            }
            TU_CHECK(c);
            if (live[i]) check_seq(c, tag, &g_neox, m, dt, turns[i]);
        }
        print_message("%s: %u shifts, %u blocks copied\n", pkv_dtype_name(dt), n_shifts, n_cow);
        assert_true(n_shifts > 20 && n_cow > 0);
        pkv_cache_destroy(c);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shift_oracle),  cmocka_unit_test(test_shift_attention), cmocka_unit_test(test_shift_refusals),
        cmocka_unit_test(test_shift_nospace), cmocka_unit_test(test_shift_fork_truncate),
        cmocka_unit_test(test_shift_then_keep), cmocka_unit_test(test_shift_hand_over), cmocka_unit_test(test_shift_tier),      cmocka_unit_test(test_shift_mla),
        cmocka_unit_test(test_shift_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
