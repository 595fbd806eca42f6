/* attn_avx2.c: AVX2 + FMA + F16C primitives of paged attention (f32, f16, bf16 K/V, softmax).
 * Decode is memory-bound at ~2 multiply-adds per byte, so the inner loops use every loaded
 * K/V vector for 4 query rows (a GQA group) and keep converts at one per 4 FMAs: f16 through
 * vcvtph2ps, bf16 through a zero-extend and a 16-bit shift. */
#include "../attn.h"
#include "avx2_reduce.h"
#include "fp8_x86.h"

#include <immintrin.h>
#include <math.h>

/* ---- loads: 8 elements of a K/V row as f32 ----------------------------------------------------- */
static inline __m256 ld_f32(const void *p) { return _mm256_loadu_ps((const float *)p); }
static inline __m256 ld_f16(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 ld_bf16(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float sc_f32(const void *p, uint32_t i) { return ((const float *)p)[i]; }
static inline float sc_f16(const void *p, uint32_t i) { return _cvtsh_ss(((const uint16_t *)p)[i]); }
static inline float sc_bf16(const void *p, uint32_t i) {
    union { uint32_t u; float f; } x = {(uint32_t)((const uint16_t *)p)[i] << 16};
    return x.f;
}

static void prep_f32(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    const __m256 vs = _mm256_set1_ps(scale);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = (float *)((uint8_t *)qp + r * qrow);
        const float *src = q + r * q_stride;
        uint32_t d = 0;
        for (; d + 8 <= head_dim; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vs));
        for (; d < head_dim; d++) dst[d] = src[d] * scale;
    }
}

/* Prefetch shares in the middle of each score tile as well as after it: for f32 rows only. At
 * head_dim 128 and 16-token blocks a share per tile is about 11 lines of each run for f16 and
 * bf16 but 22 for f32, and a burst that size (4 lines per turn of pkv__attn_pf_step) stalls
 * the core on its miss buffers: halving it made f32 decode from memory 10-18% faster
 * (scripts/ab-decode.sh), while the split tile costs the 2-byte types a few percent in cache
 * and gains them little from memory (docs/design.md). */
#define SPLIT_PF_f32 1
#define SPLIT_PF_f16 0
#define SPLIT_PF_bf16 0

/* Tiles of a block's keys: 3 at a time, ending on 2-key tiles rather than a 1-key one (4 chains
 * would be latency-bound), e.g. 16 = 3 + 3 + 3 + 3 + 2 + 2. */
static inline uint32_t key_tiles(uint32_t n) {
    uint32_t k = 0;
    while (n) n -= (n >= 3 && n != 4) ? 3 : n >= 2 ? 2 : 1, k++;
    return k;
}

/* ---- score: s[r][t] = <q_r, k_t> ---------------------------------------------------------------
 * Tiles of 4 query rows x 3 keys: 12 independent accumulators (an FMA has 4 cycles of latency
 * and 2 issue per cycle, so 8 chains would leave no slack), per 8 elements 3 K loads (+ converts)
 * and 4 q loads for 12 FMAs. Row and key tails use narrower tiles of the same code. */
#define DEF_SCORE(T)                                                                                            \
    static inline __attribute__((always_inline)) void score_span_##T(__m256 acc[4][3], const float *q, size_t qs, \
                                                                     const uint8_t *k, size_t krb, const uint32_t R, \
                                                                     const uint32_t K, uint32_t d0, uint32_t d1) { \
        for (uint32_t d = d0; d < d1; d += 8) {                                                                 \
            __m256 kk[3];                                                                                       \
            for (uint32_t t = 0; t < K; t++) kk[t] = ld_##T(k + t * krb + d * sizeof(elem_##T));                \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const __m256 x = _mm256_loadu_ps(q + r * qs + d);                                               \
                for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm256_fmadd_ps(x, kk[t], acc[r][t]);              \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void score_tile_##T(const float *q, size_t qs, const uint8_t *k, \
                                                                     size_t krb, const uint32_t R, const uint32_t K, \
                                                                     uint32_t D, float *s, uint32_t ss,         \
                                                                     const int split, pkv__attn_pf *pf) {       \
        __m256 acc[4][3];                                                                                       \
        const uint32_t D8 = D & ~7u;                                                                            \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm256_setzero_ps();                                   \
        if (split) { /* the row in two halves, one prefetch share between them */                              \
            score_span_##T(acc, q, qs, k, krb, R, K, 0, D8 / 16 * 8);                                           \
            pkv__attn_pf_step(pf);                                                                              \
            score_span_##T(acc, q, qs, k, krb, R, K, D8 / 16 * 8, D8);                                          \
        } else {                                                                                                \
            score_span_##T(acc, q, qs, k, krb, R, K, 0, D8);                                                    \
        }                                                                                                       \
        if (R == 4) {                                                                                           \
            for (uint32_t t = 0; t < K; t++) {                                                                  \
                float o[4];                                                                                     \
                _mm_storeu_ps(o, pkv__hsum4x8(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));                     \
                for (uint32_t r = 0; r < 4; r++) s[r * ss + t] = o[r];                                          \
            }                                                                                                   \
        } else {                                                                                                \
            for (uint32_t r = 0; r < R; r++)                                                                    \
                for (uint32_t t = 0; t < K; t++) s[r * ss + t] = pkv__hsum8(acc[r][t]);                         \
        }                                                                                                       \
        for (uint32_t d = D8; d < D; d++) /* head_dim not a multiple of 8 */                                    \
            for (uint32_t r = 0; r < R; r++)                                                                    \
                for (uint32_t t = 0; t < K; t++) s[r * ss + t] += q[r * qs + d] * sc_##T(k + t * krb, d);       \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void score_body_##T(const void *qp, uint32_t n_rows,           \
                                                                     const uint8_t *k, size_t krb, uint32_t n_keys, \
                                                                     uint32_t D, float *s, uint32_t ss,         \
                                                                     const int split, pkv__attn_pf *pf) {       \
        const size_t qs = PKV__ATTN_QROW_BYTES(D) / sizeof(float);                                              \
        const float *q = qp;                                                                                    \
        /* one share of the prefetch after each tile of 4 rows (split: and one in its middle) */               \
        const uint32_t n_pf = PKV_MAX(1u, (split ? 2 : 1) * key_tiles(n_keys) * (n_rows / 4));                  \
        uint32_t i = 0, r = 0;                                                                                  \
        pkv__attn_pf_start(pf, n_pf);                                                                           \
        for (; r + 4 <= n_rows; r += 4) {                                                                       \
            const float *qr = q + r * qs;                                                                       \
            float *sr = s + r * ss;                                                                             \
            uint32_t t = 0;                                                                                     \
            for (; n_keys - t >= 3 && n_keys - t != 4; t += 3) {                                                \
                score_tile_##T(qr, qs, k + t * krb, krb, 4, 3, D, sr + t, ss, split, pf);                       \
                pkv__attn_pf_step(pf), i += split ? 2 : 1;                                                      \
            }                                                                                                   \
            for (; n_keys - t >= 2; t += 2) {                                                                   \
                score_tile_##T(qr, qs, k + t * krb, krb, 4, 2, D, sr + t, ss, split, pf);                       \
                pkv__attn_pf_step(pf), i += split ? 2 : 1;                                                      \
            }                                                                                                   \
            if (n_keys - t == 1) {                                                                              \
                score_tile_##T(qr, qs, k + t * krb, krb, 4, 1, D, sr + t, ss, split, pf);                       \
                pkv__attn_pf_step(pf), i += split ? 2 : 1;                                                      \
            }                                                                                                   \
        }                                                                                                       \
        for (; r < n_rows; r++) {                                                                               \
            const float *qr = q + r * qs;                                                                       \
            float *sr = s + r * ss;                                                                             \
            uint32_t t = 0;                                                                                     \
            for (; n_keys - t >= 3 && n_keys - t != 4; t += 3) score_tile_##T(qr, qs, k + t * krb, krb, 1, 3, D, sr + t, ss, 0, NULL); \
            for (; n_keys - t >= 2; t += 2) score_tile_##T(qr, qs, k + t * krb, krb, 1, 2, D, sr + t, ss, 0, NULL);      \
            if (n_keys - t == 1) score_tile_##T(qr, qs, k + t * krb, krb, 1, 1, D, sr + t, ss, 0, NULL);                 \
        }                                                                                                       \
        for (; i < n_pf; i++) pkv__attn_pf_step(pf);        /* fewer than 4 rows: all at the end */             \
    }                                                                                                           \
    static void score_##T(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,       \
                          uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {                                \
        if (D == 128) /* the common head_dim, with constant trip counts */                                      \
            score_body_##T(qp, n_rows, k, krb, n_keys, 128, s, ss, SPLIT_PF_##T, pf);                           \
        else                                                                                                    \
            score_body_##T(qp, n_rows, k, krb, n_keys, D, s, ss, SPLIT_PF_##T, pf);                             \
    }

/* ---- accum: acc[r][:] += sum_t p[r][t] * v_t ----------------------------------------------------
 * Tiles of 4 rows x 24 columns held in 12 registers across all keys of the block: per key 3 V
 * loads (+ converts), 4 broadcasts, 12 FMAs. Column tails use 16- and 8-wide tiles. */
#define DEF_ACCUM(T)                                                                                            \
    static inline __attribute__((always_inline)) void accum_tile_##T(const float *p, uint32_t ps, const size_t pts, \
                                                                     const uint32_t R, const uint8_t *v, size_t vrb, \
                                                                     uint32_t n_keys, const uint32_t C, float *acc, \
                                                                     uint32_t D, pkv__attn_pf *pf) {            \
        __m256 a[4][3];                                                                                         \
        const size_t esz = sizeof(elem_##T);                                                                    \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) a[r][c] = _mm256_loadu_ps(acc + r * D + 8 * c);                    \
        size_t pfs;                                                                                             \
        uint32_t pfn;                                                                                           \
        int pfl;                                                                                                \
        ptrdiff_t pfd;                                                                                          \
        const uint8_t *pfx = pkv__attn_pf_take(pf, n_keys, &pfs, &pfn, &pfl, &pfd); /* a share per key */       \
        for (uint32_t t = 0; t < n_keys; t++) {                                                                 \
            const uint8_t *vr = v + t * vrb;                                                                    \
            __m256 x[3];                                                                                        \
            if (t < pfn) pkv__attn_pf_burst(pfx + t * pfs, pfs, pfl, pfd);                                      \
            for (uint32_t c = 0; c < C; c++) x[c] = ld_##T(vr + 8 * c * esz);                                   \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const __m256 w = _mm256_broadcast_ss(p + r * ps + t * pts);                                     \
                for (uint32_t c = 0; c < C; c++) a[r][c] = _mm256_fmadd_ps(w, x[c], a[r][c]);                   \
            }                                                                                                   \
        }                                                                                                       \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) _mm256_storeu_ps(acc + r * D + 8 * c, a[r][c]);                    \
    }                                                                                                           \
    /* weights p[r * ps + t * pts]: pts 1 (accum), or the transposed path's rp (accum_t) */                  \
    static inline __attribute__((always_inline)) void accum_rows_pts_##T(const float *p, uint32_t ps,          \
                                                                         const size_t pts,                      \
                                                                         const uint32_t R, const uint8_t *v,    \
                                                                         size_t vrb, uint32_t n_keys, uint32_t D, \
                                                                         float *acc, size_t as, pkv__attn_pf *pf) { \
        const size_t esz = sizeof(elem_##T);                                                                    \
        /* 24-column tiles, ending on 16-column ones rather than an 8-column one (e.g. 128 = 4 x 24 + 2 x 16) */ \
        uint32_t d = 0;                                                                                         \
        for (; D - d >= 24 && D - d != 32; d += 24)                                                             \
            accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 3, acc + d, as, pf);                        \
        for (; D - d >= 16; d += 16) accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 2, acc + d, as, pf); \
        if (D - d >= 8) accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 1, acc + d, as, pf), d += 8;    \
        for (uint32_t i = 0; i < R; i++) /* head_dim not a multiple of 8 */                                     \
            for (uint32_t t = 0; t < n_keys; t++) {                                                             \
                const float w = p[i * ps + t * pts];                                                            \
                for (uint32_t e = d; e < D; e++) acc[(size_t)i * as + e] += w * sc_##T(v + t * vrb, e);         \
            }                                                                                                   \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void accum_rows_##T(const float *p, uint32_t ps, const uint32_t R, \
                                                                     const uint8_t *v, size_t vrb, uint32_t n_keys, \
                                                                     uint32_t D, float *acc, pkv__attn_pf *pf) { \
        accum_rows_pts_##T(p, ps, 1, R, v, vrb, n_keys, D, acc, D, pf);                                         \
    }

typedef float elem_f32;
typedef uint16_t elem_f16;
typedef uint16_t elem_bf16;
DEF_SCORE(f32)
DEF_SCORE(f16)
DEF_SCORE(bf16)
DEF_ACCUM(f32)
DEF_ACCUM(f16)
DEF_ACCUM(bf16)
/* accum_rows' column tiles (one pf step per key in each) */
static inline uint32_t accum_tiles(uint32_t D) {
    uint32_t n = 0, d = 0;
    for (; D - d >= 24 && D - d != 32; d += 24) n++;
    for (; D - d >= 16; d += 16) n++;
    return n + (D - d >= 8);
}
#define PKV__ATTN_ACCUM_TILES(D) accum_tiles(D)
PKV__ATTN_DEF_ACCUM_ROWS(f32)
PKV__ATTN_DEF_ACCUM_ROWS(f16)
PKV__ATTN_DEF_ACCUM_ROWS(bf16)

/* ---- softmax ------------------------------------------------------------------------------------ */
/* e^x for x <= 88.7: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 minimax polynomial (about
 * 2 ulp), times 2^n built in the exponent field. x < -87.3 (and -inf) gives 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero_mask, y);
}

/* lane i = the max of the 8 lanes of a_i */
static inline __m128 hmax4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    /* lanes 0-3 of each 128-bit half: a0 a1 interleaved, then a2 a3 */
    const __m256 x01 = _mm256_max_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1)); /* a0 a0 a1 a1 per half */
    const __m256 x23 = _mm256_max_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    const __m256 y = _mm256_max_ps(_mm256_shuffle_ps(x01, x23, 0x44), _mm256_shuffle_ps(x01, x23, 0xee)); /* a0 a1 a2 a3 */
    return _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* the vector of softmax_x86.h: 8 lanes */
typedef __m256 vf;
#define VF_N 8
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_zero _mm256_setzero_ps
#define vf_max _mm256_max_ps
#define vf_sub _mm256_sub_ps
#define vf_add _mm256_add_ps
#define vf_exp exp8
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define vf_copysign(t, x) _mm256_or_ps(t, _mm256_and_ps(_mm256_set1_ps(-0.0f), x)) /* t >= 0 */
#define vf_if_lt(a, b, x, y) _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ))
#define vf_if_eq(a, b, x, y) _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_EQ_OQ))
#define vf_hmax4 hmax4x8
#define vf_hsum4 pkv__hsum4x8
#define vf_hsum pkv__hsum8
static inline float vf_hmax(__m256 x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
static inline __m128 exp4(__m128 x) { return _mm256_castps256_ps128(exp8(_mm256_castps128_ps256(x))); }
#define LAZY_T 8.0f
static inline int vf_all_le(__m256 x, __m256 t) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x, t, _CMP_GT_OQ)) == 0;
}
#include "softmax_x86.h"

/* ---- the transposed primitives (tpath_x86.h) ------------------------------------------------- */
#define vf_exp_t exp8
#define vf_ne_bits(a, b) ((uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_UQ)))
#define TP_NK 6 /* 12 accumulators, 2 qt vectors, a broadcast: 15 of 16 registers */
#define TP_NK1 6 /* (rp, a multiple of 16, is 2 vectors or more: never taken) */
#define TP_WHOLE_MAX 1024u
#define TP_WIDEN_LD(T, row, d, D) ld_##T((row) + (size_t)(d) * sizeof(elem_##T))
#define TP_E4M3_LD(p) pkv__e4m3_f32x8(p)
#include "tpath_x86.h"

void pkv__attn_fill_avx2(pkv__attn_kernels *kt) {
    kt->name = "avx2";
    kt->prep_q[PKV_DTYPE_F32] = prep_f32;
    kt->prep_q[PKV_DTYPE_F16] = prep_f32;
    kt->prep_q[PKV_DTYPE_BF16] = prep_f32;
    kt->score[PKV_DTYPE_F32] = score_f32;
    kt->score[PKV_DTYPE_F16] = score_f16;
    kt->score[PKV_DTYPE_BF16] = score_bf16;
    kt->accum[PKV_DTYPE_F32] = accum_f32;
    kt->accum[PKV_DTYPE_F16] = accum_f16;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16;
    kt->accum_pf[PKV_DTYPE_F32] = kt->accum_pf[PKV_DTYPE_F16] = kt->accum_pf[PKV_DTYPE_BF16] = true;
    kt->softmax = softmax_vec;
    tpath_fill(kt);
}
