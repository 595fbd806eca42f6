/* attn_avx512.c: AVX-512 (F, BW, VL, DQ) primitives of paged attention (f32, f16, bf16 K/V,
 * softmax): the AVX2 tiling at 16 lanes. The query preparation stays the AVX2 one (the table
 * is filled by pkv__attn_fill_avx2 first). test_attn compares it with the reference wherever
 * the CPU has it, and everywhere else as "avx512-emu": this file compiled with PKV_AVX512_EMU,
 * its 512-bit intrinsics emulated on AVX2 (avx512_emu.h). */
#include "../attn.h"

#include <math.h>
#ifdef PKV_AVX512_EMU /* tests only: the same kernels on AVX2, through avx512_emu.h */
#include "avx512_emu.h"
#define PKV__AVX512_FILL pkv__attn_fill_avx512_emu
#define PKV__AVX512_NAME "avx512-emu"
#else
#include <immintrin.h>
#define PKV__AVX512_FILL pkv__attn_fill_avx512
#define PKV__AVX512_NAME "avx512"
#endif

static inline __m512 ld_f32(const void *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 ld_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float sc_f32(const void *p, uint32_t i) { return ((const float *)p)[i]; }
static inline float sc_f16(const void *p, uint32_t i) { return _cvtsh_ss(((const uint16_t *)p)[i]); }
static inline float sc_bf16(const void *p, uint32_t i) {
    union { uint32_t u; float f; } x = {(uint32_t)((const uint16_t *)p)[i] << 16};
    return x.f;
}

typedef float elem_f32;
typedef uint16_t elem_f16;
typedef uint16_t elem_bf16;

/* ---- score: tiles of 4 rows x 4 keys (16 accumulators of 32), 16 elements per step ---------- */
#define DEF_SCORE(T)                                                                                            \
    static inline __attribute__((always_inline)) void score_tile_##T(const float *q, size_t qs, const uint8_t *k, \
                                                                     size_t krb, const uint32_t R, const uint32_t K, \
                                                                     uint32_t D, float *s, uint32_t ss) {       \
        __m512 acc[4][4];                                                                                       \
        const size_t esz = sizeof(elem_##T);                                                                    \
        const uint32_t D16 = D & ~15u;                                                                          \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm512_setzero_ps();                                   \
        for (uint32_t d = 0; d < D16; d += 16) {                                                                \
            __m512 kk[4];                                                                                       \
            for (uint32_t t = 0; t < K; t++) kk[t] = ld_##T(k + t * krb + d * esz);                             \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const __m512 x = _mm512_loadu_ps(q + r * qs + d);                                               \
                for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm512_fmadd_ps(x, kk[t], acc[r][t]);              \
            }                                                                                                   \
        }                                                                                                       \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t t = 0; t < K; t++) {                                                                  \
                float o = _mm512_reduce_add_ps(acc[r][t]);                                                      \
                for (uint32_t d = D16; d < D; d++) o += q[r * qs + d] * sc_##T(k + t * krb, d);                 \
                s[r * ss + t] = o;                                                                              \
            }                                                                                                   \
    }

/* ---- accum: tiles of 4 rows x 48 columns (12 accumulators) across the block's keys ----------- */
#define DEF_ACCUM(T)                                                                                            \
    static inline __attribute__((always_inline)) void accum_tile_##T(const float *p, uint32_t ps, const uint32_t R, \
                                                                     const uint8_t *v, size_t vrb, uint32_t n_keys, \
                                                                     const uint32_t C, float *acc, uint32_t D) { \
        __m512 a[4][3];                                                                                         \
        const size_t esz = sizeof(elem_##T);                                                                    \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);                   \
        for (uint32_t t = 0; t < n_keys; t++) {                                                                 \
            const uint8_t *vr = v + t * vrb;                                                                    \
            __m512 x[3];                                                                                        \
            for (uint32_t c = 0; c < C; c++) x[c] = ld_##T(vr + 16 * c * esz);                                  \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const __m512 w = _mm512_set1_ps(p[r * ps + t]);                                                 \
                for (uint32_t c = 0; c < C; c++) a[r][c] = _mm512_fmadd_ps(w, x[c], a[r][c]);                   \
            }                                                                                                   \
        }                                                                                                       \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);                   \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void accum_rows_##T(const float *p, uint32_t ps, const uint32_t R, \
                                                                     const uint8_t *v, size_t vrb, uint32_t n_keys, \
                                                                     uint32_t D, float *acc) {                  \
        const size_t esz = sizeof(elem_##T);                                                                    \
        uint32_t d = 0; /* 48-column tiles, ending on 32-column ones rather than a 16-column one */             \
        for (; D - d >= 48 && D - d != 64; d += 48) accum_tile_##T(p, ps, R, v + d * esz, vrb, n_keys, 3, acc + d, D); \
        for (; D - d >= 32; d += 32) accum_tile_##T(p, ps, R, v + d * esz, vrb, n_keys, 2, acc + d, D);         \
        if (D - d >= 16) accum_tile_##T(p, ps, R, v + d * esz, vrb, n_keys, 1, acc + d, D), d += 16;            \
        for (uint32_t i = 0; i < R; i++) /* head_dim not a multiple of 16 */                                    \
            for (uint32_t t = 0; t < n_keys; t++) {                                                             \
                const float w = p[i * ps + t];                                                                  \
                for (uint32_t e = d; e < D; e++) acc[(size_t)i * D + e] += w * sc_##T(v + t * vrb, e);          \
            }                                                                                                   \
    }

DEF_SCORE(f32)
DEF_SCORE(f16)
DEF_SCORE(bf16)
PKV__ATTN_DEF_SCORE_ROWS4(f32)
PKV__ATTN_DEF_SCORE_ROWS4(f16)
PKV__ATTN_DEF_SCORE_ROWS4(bf16)
DEF_ACCUM(f32)
DEF_ACCUM(f16)
DEF_ACCUM(bf16)
PKV__ATTN_DEF_ACCUM_ROWS(f32)
PKV__ATTN_DEF_ACCUM_ROWS(f16)
PKV__ATTN_DEF_ACCUM_ROWS(bf16)

/* ---- softmax (same polynomial as the AVX2 path) ------------------------------------------------ */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ); /* x < -87.3, -inf, nan -> 0 */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e));
}

static inline __m512 softcap16(__m512 x, __m512 c, __m512 m2_inv_c) {
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 e = exp16(_mm512_mul_ps(ax, m2_inv_c));
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    /* sign of x back on; masked keys (-inf) stay masked */
    t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                                            _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
    const __mmask16 masked = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(masked, _mm512_mul_ps(c, t), x);
}

/* One row after soft-capping: the online-softmax step of attn.h for a row on its own. */
static void softmax_row(float *sr, uint32_t n16, float *m, float *l, float *acc_row, uint32_t D) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (uint32_t t = 0; t < n16; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + t));
    float mnew = _mm512_reduce_max_ps(mx);
    if (mnew < *m) mnew = *m;
    if (mnew == -INFINITY) {
        for (uint32_t t = 0; t < n16; t++) sr[t] = 0.0f;
        return;
    }
    const __m512 vm = _mm512_set1_ps(mnew);
    __m512 sum = _mm512_setzero_ps();
    for (uint32_t t = 0; t < n16; t += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + t), vm));
        _mm512_storeu_ps(sr + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    pkv__attn_softmax_commit(m, l, acc_row, D, mnew, _mm512_reduce_add_ps(sum));
}

/* Four rows at once, as in the AVX2 file: their max, exp and sum chains interleave instead of
 * running one row after the other, and m, l are updated as one vector. */
static void softmax_rows4(float *s, uint32_t ss, uint32_t n16, float *m, float *l, float *acc, uint32_t D) {
    float *s0 = s, *s1 = s + ss, *s2 = s + 2 * (size_t)ss, *s3 = s + 3 * (size_t)ss;
    __m512 x0 = _mm512_set1_ps(-INFINITY), x1 = x0, x2 = x0, x3 = x0;
    for (uint32_t t = 0; t < n16; t += 16) {
        x0 = _mm512_max_ps(x0, _mm512_loadu_ps(s0 + t));
        x1 = _mm512_max_ps(x1, _mm512_loadu_ps(s1 + t));
        x2 = _mm512_max_ps(x2, _mm512_loadu_ps(s2 + t));
        x3 = _mm512_max_ps(x3, _mm512_loadu_ps(s3 + t));
    }
    const __m128 mold = _mm_loadu_ps(m);
    const __m128 mnew = _mm_max_ps(mold, _mm_setr_ps(_mm512_reduce_max_ps(x0), _mm512_reduce_max_ps(x1),
                                                     _mm512_reduce_max_ps(x2), _mm512_reduce_max_ps(x3)));
    if (_mm_movemask_ps(_mm_cmpeq_ps(mnew, _mm_set1_ps(-INFINITY)))) { /* a row sees nothing yet */
        for (uint32_t r = 0; r < 4; r++) softmax_row(s + (size_t)r * ss, n16, m + r, l + r, acc + (size_t)r * D, D);
        return;
    }
    float mv[4];
    _mm_storeu_ps(mv, mnew);
    const __m512 v0 = _mm512_set1_ps(mv[0]), v1 = _mm512_set1_ps(mv[1]), v2 = _mm512_set1_ps(mv[2]),
                 v3 = _mm512_set1_ps(mv[3]);
    __m512 u0 = _mm512_setzero_ps(), u1 = u0, u2 = u0, u3 = u0;
    for (uint32_t t = 0; t < n16; t += 16) {
        const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s0 + t), v0));
        const __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s1 + t), v1));
        const __m512 e2 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s2 + t), v2));
        const __m512 e3 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s3 + t), v3));
        _mm512_storeu_ps(s0 + t, e0), _mm512_storeu_ps(s1 + t, e1);
        _mm512_storeu_ps(s2 + t, e2), _mm512_storeu_ps(s3 + t, e3);
        u0 = _mm512_add_ps(u0, e0), u1 = _mm512_add_ps(u1, e1), u2 = _mm512_add_ps(u2, e2), u3 = _mm512_add_ps(u3, e3);
    }
    /* f = exp(m - m'): 1 where the max stayed, 0 where m was -inf (lanes 4-15 are zeros: e^0) */
    const __m128 f =
        _mm512_castps512_ps128(exp16(_mm512_insertf32x4(_mm512_setzero_ps(), _mm_sub_ps(mold, mnew), 0)));
    const __m128 sums = _mm_setr_ps(_mm512_reduce_add_ps(u0), _mm512_reduce_add_ps(u1), _mm512_reduce_add_ps(u2),
                                    _mm512_reduce_add_ps(u3));
    _mm_storeu_ps(l, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(l), f), sums));
    _mm_storeu_ps(m, mnew);
    int moved = _mm_movemask_ps(_mm_cmpneq_ps(mnew, mold));
    if (moved) {
        float fr[4];
        _mm_storeu_ps(fr, f);
        for (uint32_t r = 0; r < 4; r++)
            if (moved >> r & 1) {
                float *a = acc + (size_t)r * D;
                for (uint32_t d = 0; d < D; d++) a[d] *= fr[r];
            }
    }
}

static void softmax_avx512(float *s, uint32_t ss, uint32_t n_rows, uint32_t n_keys, float softcap, float *m, float *l,
                           float *acc, uint32_t D) {
    const uint32_t n16 = (n_keys + 15) & ~15u; /* rows of s are padded to a multiple of 16 */
    const __m512 c = _mm512_set1_ps(softcap), m2ic = _mm512_set1_ps(softcap > 0.0f ? -2.0f / softcap : 0.0f);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *sr = s + (size_t)r * ss;
        for (uint32_t t = n_keys; t < n16; t++) sr[t] = -INFINITY;
        if (softcap > 0.0f)
            for (uint32_t t = 0; t < n16; t += 16) _mm512_storeu_ps(sr + t, softcap16(_mm512_loadu_ps(sr + t), c, m2ic));
    }
    uint32_t r = 0;
    for (; r + 4 <= n_rows; r += 4)
        softmax_rows4(s + (size_t)r * ss, ss, n16, m + r, l + r, acc + (size_t)r * D, D);
    for (; r < n_rows; r++) softmax_row(s + (size_t)r * ss, n16, m + r, l + r, acc + (size_t)r * D, D);
}

void PKV__AVX512_FILL(pkv__attn_kernels *kt) {
    kt->name = PKV__AVX512_NAME;
    kt->score[PKV_DTYPE_F32] = score_f32;
    kt->score[PKV_DTYPE_F16] = score_f16;
    kt->score[PKV_DTYPE_BF16] = score_bf16;
    kt->accum[PKV_DTYPE_F32] = accum_f32;
    kt->accum[PKV_DTYPE_F16] = accum_f16;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16;
    kt->softmax = softmax_avx512;
}
