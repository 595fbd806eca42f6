/* attn_q_avx2.c: AVX2 attention primitives for quantized K/V (q8_0, q4_0, fp8 e4m3), read
 * from the pool rows and dequantized in registers (no copy of the cache, no decoded tile).
 * Same arithmetic as attn_q_ref.c up to float summation order: q8_0 / q4_0 q.K are exact
 * integer dot products per 32 values, scaled by dq * dk per block.
 *
 * Decode at 4 query rows per kv head is compute-bound for these formats (they read 2x-3.5x
 * fewer bytes than f16), so every kernel is shaped by instructions per (key, kv head):
 *   score (int8): tiles of 4 keys x the rows; per block each K vector is decoded once and
 *     used by every row; the 4 keys' sums are reduced together (3 hadds) and kept as 8 float
 *     lanes (4 keys x 2 half-blocks) per row, so the block scale costs one mul + one fma per
 *     row and 4 keys. q4_0 skips the sign trick: its unsigned nibbles go straight into
 *     maddubs and the -8 offset is one subtraction of 8 * sum(q) per block (from the prep).
 *   score (fp8): one key at a time, decoded in registers (4 ops per 16 values) and fed to
 *     the rows' FMAs with the query as the memory operand; the row scale after the sum.
 *   accum: tiles of 4 rows x 16 values held in registers across the block's keys; per key
 *     2 decoded vectors, 4 broadcast weights, 8 FMAs. The V scale is folded into the
 *     weights once per (row, key, block); q4_0's -8 is one correction per tile. */
#include "../attn.h"
#include "avx2_reduce.h"
#include "../attn_q.h"
#include "../../quant/quant.h"
#include "fp8_x86.h"
#include "i8_x86.h"

#include <immintrin.h>
#include <stdbool.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))


/* ---- prepared query for integer K (q8_0, q4_0) -----------------------------------------------
 * Row layout (4 D bytes, within PKV__ATTN_QROW_BYTES(D)), per block b of 32 values:
 *   int8 q[D] | uint8 |q|[D] | f32 dq8[b][8] | int32 qs8[b][8]
 * q and dq as attn_q_ref.c's pkv__attn_prep_q8 (dq = amax / 127, q = rne(x / dq), bit for
 * bit); dq8 repeats dq 8 times (a plain memory operand of the scale multiply); qs8 holds
 * 8 * (sum of q over values 0..15) in lanes 0..3 and 8 * (sum over 16..31) in lanes 4..7:
 * the q4_0 score's -8 offset for each half-block lane of its sums. */
void pkv__attn_prep_i8_avx2(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const uint32_t nb = D / 32;
    const __m256 vs = _mm256_set1_ps(scale), sgn = _mm256_set1_ps(-0.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (uint32_t r = 0; r < n_rows; r++) {
        uint8_t *dst = (uint8_t *)qp + r * qrow;
        const float *src = q + r * q_stride;
        for (uint32_t b = 0; b < nb; b++) {
            __m256 x[4], am = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                x[i] = _mm256_mul_ps(_mm256_loadu_ps(src + 32 * b + 8 * i), vs);
                am = _mm256_max_ps(_mm256_andnot_ps(sgn, x[i]), am); /* NaN lanes keep am (the reference's compare) */
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i iv[4];
            __m256 half[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int i = 0; i < 4; i++) {
                __m256 v = _mm256_round_ps(_mm256_mul_ps(x[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)); /* NaN -> 0 */
                v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
                half[i / 2] = _mm256_add_ps(half[i / 2], v); /* exact: integers below 2^12 */
                iv[i] = _mm256_cvtps_epi32(v);
            }
            const __m256i w16 = _mm256_packs_epi32(iv[0], iv[1]), w16b = _mm256_packs_epi32(iv[2], iv[3]);
            const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), order);
            _mm256_storeu_si256((__m256i *)(dst + 32 * b), q8);
            _mm256_storeu_si256((__m256i *)(dst + D + 32 * b), _mm256_abs_epi8(q8));
            _mm256_storeu_ps((float *)(dst + 2 * (size_t)D + 32 * b), _mm256_set1_ps(d));
            const int32_t s0 = (int32_t)pkv__hsum8(half[0]), s1 = (int32_t)pkv__hsum8(half[1]);
            _mm256_storeu_si256((__m256i *)(dst + 3 * (size_t)D + 32 * b),
                                _mm256_setr_epi32(8 * s0, 8 * s0, 8 * s0, 8 * s0, 8 * s1, 8 * s1, 8 * s1, 8 * s1));
        }
    }
}

/* For fp8 K: scale * query as f32, zero-padded to a multiple of 8 values. */
static void prep_f32(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const __m256 vs = _mm256_set1_ps(scale);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = (float *)((uint8_t *)qp + r * qrow);
        const float *src = q + r * q_stride;
        uint32_t d = 0;
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vs));
        for (; d < D; d++) dst[d] = src[d] * scale;
        for (; d % 8; d++) dst[d] = 0.0f;
    }
}

/* ---- integer q.K (q8_0, q4_0) -------------------------------------------------------------------
 * Tiles of 4 keys (i8_x86.h); the int8 products by maddubs / madd, q8_0 with the sign trick. */
static ALWAYS_INLINE __m256i i8_codes(const uint8_t *p, const bool q4) {
    return q4 ? pkv__q4_codes(p) : _mm256_loadu_si256((const __m256i *)p);
}

static ALWAYS_INLINE __m256i i8_sums(const __m256i kv[4], const uint8_t *row, uint32_t b, uint32_t D, const bool q4) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i qv = _mm256_loadu_si256((const __m256i *)(row + 32 * b));
    if (q4) {
        /* nibble n in 0..15 times q: pairs <= 3810, 8 products <= 15240 fit int16 */
        const __m256i p0 = _mm256_maddubs_epi16(kv[0], qv), p1 = _mm256_maddubs_epi16(kv[1], qv);
        const __m256i p2 = _mm256_maddubs_epi16(kv[2], qv), p3 = _mm256_maddubs_epi16(kv[3], qv);
        const __m256i t = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p0, p1), _mm256_hadd_epi16(p2, p3)), ones);
        /* sum (n - 8) q = sum n q - 8 sum q, per half-block lane */
        return _mm256_sub_epi32(t, _mm256_loadu_si256((const __m256i *)(row + 3 * (size_t)D + 32 * b)));
    }
    /* |q| * (k * sign q) in pairs: |q|, |k| <= 127, no int16 saturation */
    const __m256i av = _mm256_loadu_si256((const __m256i *)(row + D + 32 * b));
    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(kv[0], qv)), ones);
    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(kv[1], qv)), ones);
    const __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(kv[2], qv)), ones);
    const __m256i p3 = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(kv[3], qv)), ones);
    return pkv__sum4x4_epi32(p0, p1, p2, p3);
}

static ALWAYS_INLINE void score_i8_tile(const uint8_t *qp, size_t qrow, uint32_t D, const uint32_t NR,
                                        const uint8_t *const kr[4], const bool q4, float *s, uint32_t ss, uint32_t nk) {
#define CODES(p) i8_codes(p, q4)
#define SUMS(kv, row, b) i8_sums(kv, row, b, D, q4)
    PKV__I8_TILE_BODY(CODES, SUMS);
#undef CODES
#undef SUMS
}

#define CALL_I8(N) score_i8_tile(q, qrow, D, N, kr, q4, sr, ss, nk)
PKV__ATTN_DEF_I8_SCORE_WALK(CALL_I8)
#undef CALL_I8

/* ---- fp8 e4m3 ---------------------------------------------------------------------------------
 * Codes decode to f16 (fp8_x86.h, pkv__e4m3_f16x16 and pkv__e4m3_f32x8), widened by F16C. */
/* 16 dims of one key for NR rows: a[r][0] += q_r[d..d+8) * k[d..d+8), a[r][1] the next 8 */
static ALWAYS_INLINE void fp8_dot16(const float *const q[4], const uint32_t NR, const uint8_t *e, uint32_t d,
                                    __m256 a[4][2]) {
    const __m256i w = pkv__e4m3_f16x16(e + d);
    const __m256 k0 = _mm256_cvtph_ps(_mm256_castsi256_si128(w)), k1 = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
    for (uint32_t r = 0; r < NR; r++) {
        a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d + 8), k1, a[r][1]);
    }
}

/* s[r * ss] = sk * <q_r, key>, NR rows, one key: 2 accumulators per row (8 chains), the
 * query as the fma's memory operand (each query vector is used once per key). */
static ALWAYS_INLINE void score_fp8_key(const float *const q[4], const uint32_t NR, const uint8_t *kr, uint32_t D,
                                        float *s, uint32_t ss) {
    const uint8_t *e = kr + PKV_FP8_ROW_HEADER;
    __m256 a[4][2];
    for (uint32_t r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    uint32_t d = 0;
    for (; d + 32 <= D; d += 32) {
        fp8_dot16(q, NR, e, d, a);
        fp8_dot16(q, NR, e, d + 16, a);
    }
    if (d + 16 <= D) fp8_dot16(q, NR, e, d, a), d += 16;
    if (d + 8 <= D) {
        const __m256 k0 = pkv__e4m3_f32x8(e + d);
        for (uint32_t r = 0; r < NR; r++) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), k0, a[r][0]);
        d += 8;
    }
    float sk;
    memcpy(&sk, kr, 4);
    sk *= 256.0f; /* exact: undoes the decode's 2^-8 */
    if (NR == 4 && d == D) {
        const __m128 o = _mm_mul_ps(pkv__hsum4x8(_mm256_add_ps(a[0][0], a[0][1]), _mm256_add_ps(a[1][0], a[1][1]),
                                            _mm256_add_ps(a[2][0], a[2][1]), _mm256_add_ps(a[3][0], a[3][1])),
                                    _mm_set1_ps(sk));
        _mm_store_ss(s, o);
        s[ss] = _mm_cvtss_f32(_mm_shuffle_ps(o, o, 1));
        s[2 * ss] = _mm_cvtss_f32(_mm_movehl_ps(o, o));
        s[3 * ss] = _mm_cvtss_f32(_mm_shuffle_ps(o, o, 3));
        return;
    }
    float o[4];
    for (uint32_t r = 0; r < NR; r++) o[r] = pkv__hsum8(_mm256_add_ps(a[r][0], a[r][1]));
    for (; d < D; d++) { /* head_dim % 8 */
        const float x = pkv__e4m3_to_f32(e[d]) * (1.0f / 256.0f);
        for (uint32_t r = 0; r < NR; r++) o[r] += q[r][d] * x;
    }
    for (uint32_t r = 0; r < NR; r++) s[r * ss] = o[r] * sk;
}

/* Keys in groups of 4 between prefetch shares. */
static ALWAYS_INLINE void score_fp8_rows(const float *const q[4], const uint32_t NR, const uint8_t *k, size_t krb,
                                         uint32_t n_keys, uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {
    for (uint32_t t = 0; t < n_keys; t++) {
        score_fp8_key(q, NR, k + t * krb, D, s + t, ss);
        if (t % 4 == 3 || t + 1 == n_keys) pkv__attn_pf_step(pf);
    }
}

static void score_fp8(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                      float *s, uint32_t ss, pkv__attn_pf *pf) {
    pkv__attn_pf_start(pf, ((n_keys + 3) / 4) * ((n_rows + 3) / 4));
#define CALL_F8S(N) score_fp8_rows(q, N, k, krb, n_keys, D, sr, ss, pf)
    PKV__ATTN_SCORE_ROW_GROUPS(qp, n_rows, D, s, ss, CALL_F8S)
#undef CALL_F8S
}

/* ---- V accumulation ----------------------------------------------------------------------------
 * NR <= 4 rows x 16 values in 8 registers across the keys: per key 2 decoded vectors, NR
 * broadcast weights, 2 NR fmas. w[rr * PKV__VKEYS + t] is row rr's weight for key t with the key's
 * (block) scale folded in. */

/* f16 scales at p + j * stride (j < nk; 0 beyond) -> 8 floats */
static ALWAYS_INLINE __m256 scales8_f16(const uint8_t *p, size_t stride, uint32_t nk) {
    __m128i h = _mm_setzero_si128();
    if (nk >= 8) {
        h = _mm_cvtsi32_si128(pkv__ld16(p));
        h = _mm_insert_epi16(h, pkv__ld16(p + stride), 1);
        h = _mm_insert_epi16(h, pkv__ld16(p + 2 * stride), 2);
        h = _mm_insert_epi16(h, pkv__ld16(p + 3 * stride), 3);
        h = _mm_insert_epi16(h, pkv__ld16(p + 4 * stride), 4);
        h = _mm_insert_epi16(h, pkv__ld16(p + 5 * stride), 5);
        h = _mm_insert_epi16(h, pkv__ld16(p + 6 * stride), 6);
        h = _mm_insert_epi16(h, pkv__ld16(p + 7 * stride), 7);
    } else {
        uint16_t t[8] = {0};
        for (uint32_t j = 0; j < nk; j++) t[j] = (uint16_t)pkv__ld16(p + j * stride);
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return _mm256_cvtph_ps(h);
}

/* One 16-value tile of a q8_0 / q4_0 block for NR rows. q8_0: values c0 .. c0 + 15 (codes at
 * src + c0); q4_0: values c0 .. c0 + 7 (low nibbles of bytes c0 ..) and c0 + 16 .. c0 + 23
 * (their high nibbles), c0 in {0, 8}; the nibbles' -8 is corr[rr] = 8 * sum_t w, subtracted
 * once at the end. a0 / a1: the two 8-value column groups' accumulators in row 0. */
static ALWAYS_INLINE void accum_i8_tile(const float *w, const float *corr, uint32_t nk, const uint8_t *src,
                                        size_t vrb, float *a0, float *a1, uint32_t D, const uint32_t NR,
                                        const bool q4) {
    __m256 a[4][2];
    for (uint32_t rr = 0; rr < NR; rr++) {
        a[rr][0] = _mm256_loadu_ps(a0 + rr * (size_t)D);
        a[rr][1] = _mm256_loadu_ps(a1 + rr * (size_t)D);
    }
#pragma GCC unroll 4
    for (uint32_t t = 0; t < nk; t++) {
        const uint8_t *c = src + t * vrb;
        __m256 x0, x1;
        if (q4) {
            const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
            x0 = _mm256_cvtepi32_ps(_mm256_and_si256(z, _mm256_set1_epi32(15)));
            x1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(z, 4));
        } else {
            x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
            x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))));
        }
        for (uint32_t rr = 0; rr < NR; rr++) {
            const __m256 wv = _mm256_broadcast_ss(w + rr * PKV__VKEYS + t);
            a[rr][0] = _mm256_fmadd_ps(wv, x0, a[rr][0]);
            a[rr][1] = _mm256_fmadd_ps(wv, x1, a[rr][1]);
        }
    }
    for (uint32_t rr = 0; rr < NR; rr++) {
        if (q4) {
            const __m256 cv = _mm256_broadcast_ss(corr + rr);
            a[rr][0] = _mm256_sub_ps(a[rr][0], cv);
            a[rr][1] = _mm256_sub_ps(a[rr][1], cv);
        }
        _mm256_storeu_ps(a0 + rr * (size_t)D, a[rr][0]);
        _mm256_storeu_ps(a1 + rr * (size_t)D, a[rr][1]);
    }
}

/* NR rows, nk <= PKV__VKEYS keys of q8_0 / q4_0 V (D % 32 == 0). */
static ALWAYS_INLINE void accum_i8_rows(const float *p, uint32_t ps, const uint32_t NR, const uint8_t *v, size_t vrb,
                                        uint32_t nk, uint32_t D, float *acc, const bool q4) {
    const uint32_t nb = D / 32;
    const size_t bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);
    /* the rows' weights, zero past nk (on the stack: registers are short in the block loop) */
    float pr[4 * PKV__VKEYS] __attribute__((aligned(32)));
    for (uint32_t rr = 0; rr < NR; rr++) {
        const float *pp = p + (size_t)rr * ps;
        if (nk == PKV__VKEYS) {
            _mm256_store_ps(pr + rr * PKV__VKEYS, _mm256_loadu_ps(pp));
            _mm256_store_ps(pr + rr * PKV__VKEYS + 8, _mm256_loadu_ps(pp + 8));
        } else {
            for (uint32_t j = 0; j < PKV__VKEYS; j++) pr[rr * PKV__VKEYS + j] = j < nk ? pp[j] : 0.0f;
        }
    }
    float w[4 * PKV__VKEYS] __attribute__((aligned(32)));
    float corr[4];
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *vb = v + b * bsz;
        const __m256 d0 = scales8_f16(vb, vrb, PKV_MIN(nk, 8u));
        const __m256 d1 = nk > 8 ? scales8_f16(vb + 8 * vrb, vrb, nk - 8) : _mm256_setzero_ps();
        for (uint32_t rr = 0; rr < NR; rr++) {
            const __m256 w0 = _mm256_mul_ps(_mm256_load_ps(pr + rr * PKV__VKEYS), d0);
            const __m256 w1 = _mm256_mul_ps(_mm256_load_ps(pr + rr * PKV__VKEYS + 8), d1);
            _mm256_store_ps(w + rr * PKV__VKEYS, w0);
            _mm256_store_ps(w + rr * PKV__VKEYS + 8, w1);
            if (q4) corr[rr] = 8.0f * pkv__hsum8(_mm256_add_ps(w0, w1));
        }
        float *ab = acc + 32 * b;
if (q4) {
            accum_i8_tile(w, corr, nk, vb + 2, vrb, ab, ab + 16, D, NR, true);
            accum_i8_tile(w, corr, nk, vb + 2 + 8, vrb, ab + 8, ab + 24, D, NR, true);
        } else {
            accum_i8_tile(w, corr, nk, vb + 2, vrb, ab, ab + 8, D, NR, false);
            accum_i8_tile(w, corr, nk, vb + 2 + 16, vrb, ab + 16, ab + 24, D, NR, false);
        }
    }
}

/* fp8: NR rows x 16 values (codes at src), weights carry the row scale and the 2^8. */
static ALWAYS_INLINE void accum_fp8_tile(const float *w, uint32_t nk, const uint8_t *src, size_t vrb, float *a0,
                                         uint32_t D, const uint32_t NR, const bool half) {
    __m256 a[4][2];
    for (uint32_t rr = 0; rr < NR; rr++) {
        a[rr][0] = _mm256_loadu_ps(a0 + rr * (size_t)D);
        if (!half) a[rr][1] = _mm256_loadu_ps(a0 + rr * (size_t)D + 8);
    }
#pragma GCC unroll 4
    for (uint32_t t = 0; t < nk; t++) {
        __m256 x0, x1 = _mm256_setzero_ps();
        if (half) {
            x0 = pkv__e4m3_f32x8(src + t * vrb);
        } else {
            const __m256i h = pkv__e4m3_f16x16(src + t * vrb);
            x0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), x1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        }
        for (uint32_t rr = 0; rr < NR; rr++) {
            const __m256 wv = _mm256_broadcast_ss(w + rr * PKV__VKEYS + t);
            a[rr][0] = _mm256_fmadd_ps(wv, x0, a[rr][0]);
            if (!half) a[rr][1] = _mm256_fmadd_ps(wv, x1, a[rr][1]);
        }
    }
    for (uint32_t rr = 0; rr < NR; rr++) {
        _mm256_storeu_ps(a0 + rr * (size_t)D, a[rr][0]);
        if (!half) _mm256_storeu_ps(a0 + rr * (size_t)D + 8, a[rr][1]);
    }
}

static ALWAYS_INLINE void accum_fp8_rows(const float *p, uint32_t ps, const uint32_t NR, const uint8_t *v, size_t vrb,
                                         uint32_t nk, uint32_t D, float *acc) {
    float w[4 * PKV__VKEYS] __attribute__((aligned(32)));
    for (uint32_t t = 0; t < nk; t++) {
        float sv;
        memcpy(&sv, v + t * vrb, 4);
        sv *= 256.0f; /* exact: undoes the decode's 2^-8 */
        for (uint32_t rr = 0; rr < NR; rr++) w[rr * PKV__VKEYS + t] = p[(size_t)rr * ps + t] * sv;
    }
    const uint8_t *e = v + PKV_FP8_ROW_HEADER;
    uint32_t d = 0;
    for (; d + 16 <= D; d += 16) accum_fp8_tile(w, nk, e + d, vrb, acc + d, D, NR, false);
    if (d + 8 <= D) accum_fp8_tile(w, nk, e + d, vrb, acc + d, D, NR, true), d += 8;
    pkv__fp8_accum_tail(w, nk, e, vrb, d, D, NR, acc); /* head_dim % 8 */
}

/* The V side of every quantized dtype: keys in chunks of PKV__VKEYS, rows in groups of up to 4, each
 * (chunk, group) done by the dtype's row-tile function with the group size as a constant. */
enum v_kind { V_Q8_0, V_Q4_0, V_FP8 };

static ALWAYS_INLINE void accum_tiles_d(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                        uint32_t n_keys, uint32_t D, float *acc, const enum v_kind kind) {
#define CALL_V(N)                                                                                             \
    (kind == V_FP8 ? accum_fp8_rows(pp, ps, N, vv, vrb, nk, D, ar)                                            \
                   : accum_i8_rows(pp, ps, N, vv, vrb, nk, D, ar, kind == V_Q4_0))
    PKV__ATTN_ACCUM_CHUNKS(PKV__VKEYS, p, ps, n_rows, v, vrb, n_keys, D, acc, CALL_V)
#undef CALL_V
}

/* head_dim 128, the common case, gets its own instance with constant trip counts */
static ALWAYS_INLINE void accum_tiles(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                      uint32_t n_keys, uint32_t D, float *acc, const enum v_kind kind) {
    if (D == 128)
        accum_tiles_d(p, ps, n_rows, v, vrb, n_keys, 128, acc, kind);
    else
        accum_tiles_d(p, ps, n_rows, v, vrb, n_keys, D, acc, kind);
}

PKV__ATTN_DEF_I8_ENTRIES(score_i8, accum_tiles, V_Q8_0, V_Q4_0)

static void accum_fp8(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                      uint32_t D, float *acc, pkv__attn_pf *pf) {
    (void)pf; /* accum_pf off: the driver gives score both runs */
    accum_tiles(p, ps, n_rows, v, vrb, n_keys, D, acc, V_FP8);
}

void pkv__attn_fill_q_avx2(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_Q8_0] = pkv__attn_prep_i8_avx2;
    kt->prep_q[PKV_DTYPE_Q4_0] = pkv__attn_prep_i8_avx2;
    kt->prep_q[PKV_DTYPE_FP8_E4M3] = prep_f32;
    kt->score[PKV_DTYPE_Q8_0] = score_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_q4_0;
    kt->score[PKV_DTYPE_FP8_E4M3] = score_fp8;
    kt->accum[PKV_DTYPE_Q8_0] = accum_q8_0;
    kt->accum[PKV_DTYPE_Q4_0] = accum_q4_0;
    kt->accum[PKV_DTYPE_FP8_E4M3] = accum_fp8;
    kt->accum_pf[PKV_DTYPE_Q8_0] = kt->accum_pf[PKV_DTYPE_Q4_0] = kt->accum_pf[PKV_DTYPE_FP8_E4M3] = false;
}
