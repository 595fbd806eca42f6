/* quant_avx2.c: AVX2 + F16C row encode / decode for q8_0, q4_0 and fp8 e4m3, bit for bit
 * the scalar reference of quant_q.c (same scale rules from quant.h, same round-half-even,
 * same NaN-as-zero and saturation), f16 and bf16 row encode, and the magnitude scans that
 * K/V writes check their input with. Used by K/V writes (encode) and gather (decode). */
#include "../quant.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>

/* NaN lanes -> 0 (ordered compare against itself is false only for NaN). */
static inline __m256 nan0(__m256 v) { return _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)); }

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hmin8(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* rne(v * id) clamped to [lo, hi], as int32 lanes. Clamping in float first keeps the
 * conversion in range; the values are integral so the conversion is exact. */
static inline __m256i q_lanes(__m256 v, __m256 id, __m256 lo, __m256 hi) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
    return _mm256_cvttps_epi32(r);
}

/* 4 x 8 int32 lanes (values 0..31 in order) -> 32 bytes in order (signed saturation). */
static inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    __m256i x = _mm256_packs_epi16(ab, cd);
    return _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* ---- q8_0 ------------------------------------------------------------------------------------ */
void pkv__q8_0_encode_avx2(const float *x, uint32_t d, void *dst) {
    pkv_assert(d % 32 == 0);
    uint8_t *o = dst;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (uint32_t i = 0; i < d / 32; i++, x += 32, o += sizeof(pkv_block_q8_0)) {
        __m256 v0 = nan0(_mm256_loadu_ps(x)), v1 = nan0(_mm256_loadu_ps(x + 8));
        __m256 v2 = nan0(_mm256_loadu_ps(x + 16)), v3 = nan0(_mm256_loadu_ps(x + 24));
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absm), _mm256_and_ps(v1, absm)),
                                 _mm256_max_ps(_mm256_and_ps(v2, absm), _mm256_and_ps(v3, absm)));
        float amax = fminf(hmax8(m), FLT_MAX);
        uint16_t h = pkv__f16_sat(amax / 127.0f);
        float dd = pkv__f16_to_f32(h);
        __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        __m256i q = pack32(q_lanes(v0, id, lo, hi), q_lanes(v1, id, lo, hi), q_lanes(v2, id, lo, hi),
                           q_lanes(v3, id, lo, hi));
        memcpy(o, &h, 2);
        _mm256_storeu_si256((__m256i *)(o + 2), q);
    }
}

void pkv__q8_0_decode_avx2(const void *src, uint32_t d, float *y) {
    pkv_assert(d % 32 == 0);
    const uint8_t *p = src;
    for (uint32_t i = 0; i < d / 32; i++, p += sizeof(pkv_block_q8_0), y += 32) {
        uint16_t h;
        memcpy(&h, p, 2);
        __m256 dd = _mm256_set1_ps(pkv__f16_to_f32(h));
        for (int j = 0; j < 32; j += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(p + 2 + j));
            __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            _mm256_storeu_ps(y + j, _mm256_mul_ps(dd, f));
        }
    }
}

/* ---- q4_0 ------------------------------------------------------------------------------------ */
void pkv__q4_0_encode_avx2(const float *x, uint32_t d, void *dst) {
    pkv_assert(d % 32 == 0);
    uint8_t *o = dst;
    const __m256 lo = _mm256_set1_ps(-8.0f), hi = _mm256_set1_ps(7.0f);
    const __m256i eight = _mm256_set1_epi32(8);
    for (uint32_t i = 0; i < d / 32; i++, x += 32, o += sizeof(pkv_block_q4_0)) {
        __m256 v0 = nan0(_mm256_loadu_ps(x)), v1 = nan0(_mm256_loadu_ps(x + 8));
        __m256 v2 = nan0(_mm256_loadu_ps(x + 16)), v3 = nan0(_mm256_loadu_ps(x + 24));
        /* the reference starts its max / min at 0: same here, so all-negative rows agree */
        __m256 zero = _mm256_setzero_ps();
        float mx = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_max_ps(v0, v1), _mm256_max_ps(v2, v3)), zero));
        float mn = hmin8(_mm256_min_ps(_mm256_min_ps(_mm256_min_ps(v0, v1), _mm256_min_ps(v2, v3)), zero));
        float m = -mn > mx ? mn : mx;
        m = fmaxf(fminf(m, FLT_MAX), -FLT_MAX);
        /* m == 0 (either sign of zero): store +0, so the bytes never depend on max(+0, -0) */
        uint16_t h = m != 0.0f ? pkv__f16_sat(m / -8.0f) : 0;
        float dd = pkv__f16_to_f32(h);
        __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        __m256i q = pack32(_mm256_add_epi32(q_lanes(v0, id, lo, hi), eight),
                           _mm256_add_epi32(q_lanes(v1, id, lo, hi), eight),
                           _mm256_add_epi32(q_lanes(v2, id, lo, hi), eight),
                           _mm256_add_epi32(q_lanes(v3, id, lo, hi), eight));
        /* bytes 0..15 = values 0..15 (low nibbles), bytes 16..31 = values 16..31 (high) */
        __m128i ql = _mm256_castsi256_si128(q), qh = _mm256_extracti128_si256(q, 1);
        __m128i packed = _mm_or_si128(ql, _mm_slli_epi16(qh, 4)); /* nibbles <= 15: no spill */
        memcpy(o, &h, 2);
        _mm_storeu_si128((__m128i *)(o + 2), packed);
    }
}

void pkv__q4_0_decode_avx2(const void *src, uint32_t d, float *y) {
    pkv_assert(d % 32 == 0);
    const uint8_t *p = src;
    const __m128i m4 = _mm_set1_epi8(15), e8 = _mm_set1_epi8(8);
    for (uint32_t i = 0; i < d / 32; i++, p += sizeof(pkv_block_q4_0), y += 32) {
        uint16_t h;
        memcpy(&h, p, 2);
        __m256 dd = _mm256_set1_ps(pkv__f16_to_f32(h));
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 2));
        __m128i l = _mm_sub_epi8(_mm_and_si128(b, m4), e8);
        __m128i u = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m4), e8);
        _mm256_storeu_ps(y + 0, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l))));
        _mm256_storeu_ps(y + 8, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8)))));
        _mm256_storeu_ps(y + 16, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(u))));
        _mm256_storeu_ps(y + 24, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(u, 8)))));
    }
}

/* ---- fp8 e4m3 -------------------------------------------------------------------------------- */
/* 8 floats (no NaN) -> 8 e4m3 codes in int32 lanes; the lane-parallel form of
 * pkv__f32_to_e4m3 (normal and subnormal results both computed, then selected). */
static inline __m256i e4m3_lanes(__m256 y) {
    __m256i xi = _mm256_castps_si256(y);
    __m256i sign = _mm256_srli_epi32(_mm256_and_si256(xi, _mm256_set1_epi32((int)0x80000000u)), 24);
    __m256i a = _mm256_and_si256(xi, _mm256_set1_epi32(0x7fffffff));
    __m256i r = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff),
                                                     _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1))));
    __m256i en = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
    en = _mm256_min_epi32(en, _mm256_set1_epi32(0x7e)); /* >= 448 and inf saturate */
    __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f));
    __m256i es = _mm256_cvttps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a);
    return _mm256_or_si256(_mm256_blendv_epi8(en, es, sub), sign);
}

void pkv__fp8_encode_avx2(const float *x, uint32_t d, void *dst) {
    uint8_t *o = dst;
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    uint32_t j = 0;
    for (; j + 8 <= d; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(nan0(_mm256_loadu_ps(x + j)), absm));
    float amax = hmax8(m);
    for (; j < d; j++) {
        float v = x[j] == x[j] ? x[j] : 0.0f;
        amax = fmaxf(amax, fabsf(v));
    }
    amax = fminf(amax, FLT_MAX);
    float s = fmaxf(amax / 448.0f, FLT_MIN);
    float is = 1.0f / s;
    memcpy(o, &s, 4);
    o += PKV_FP8_ROW_HEADER;
    const __m256 vis = _mm256_set1_ps(is);
    for (j = 0; j + 16 <= d; j += 16) {
        __m256i a = e4m3_lanes(_mm256_mul_ps(nan0(_mm256_loadu_ps(x + j)), vis));
        __m256i b = e4m3_lanes(_mm256_mul_ps(nan0(_mm256_loadu_ps(x + j + 8)), vis));
        __m256i w = _mm256_packus_epi32(a, b); /* [a0-3 b0-3 | a4-7 b4-7] as u16 */
        __m128i w8 = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        /* bytes: a0-3 b0-3 a4-7 b4-7 -> a0-7 b0-7 */
        w8 = _mm_shuffle_epi32(w8, _MM_SHUFFLE(3, 1, 2, 0));
        _mm_storeu_si128((__m128i *)(o + j), w8);
    }
    for (; j < d; j++) {
        float v = x[j] == x[j] ? x[j] : 0.0f;
        o[j] = pkv__f32_to_e4m3(v * is);
    }
}

/* 8 e4m3 bytes -> 8 floats equal to e4m3(b) * 2^-8, exactly: the magnitude bits placed in an
 * f16 (exponent bias 15 instead of 7) make F16C do subnormals right. The NaN codes (never
 * written by the encoder) become an f16 NaN, as in the scalar decode. */
static inline __m256 e4m3x8_to_f32_2m8(__m128i b8) {
    __m128i w = _mm_cvtepu8_epi16(b8);
    __m128i mag = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
    __m128i sgn = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f << 7));
    mag = _mm_or_si128(mag, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
    return _mm256_cvtph_ps(_mm_or_si128(mag, sgn));
}

void pkv__fp8_decode_avx2(const void *src, uint32_t d, float *y) {
    const uint8_t *p = src;
    float s;
    memcpy(&s, p, 4);
    p += PKV_FP8_ROW_HEADER;
    /* (e * 2^-8) * (s * 2^8) == e * s exactly: one rounding either way */
    const __m256 vs = _mm256_set1_ps(s * 256.0f);
    uint32_t j = 0;
    for (; j + 8 <= d; j += 8) {
        __m256 f = e4m3x8_to_f32_2m8(_mm_loadl_epi64((const __m128i *)(p + j)));
        _mm256_storeu_ps(y + j, _mm256_mul_ps(f, vs));
    }
    for (; j < d; j++) y[j] = s * pkv__e4m3_to_f32(p[j]);
}

/* ---- 16-bit rows and magnitude scans ------------------------------------------------------------ */
/* F16C's conversion with round-to-nearest-even is IEEE's: subnormals, overflow to inf, NaN kept
 * quiet with the payload's top bits, as pkv__f32_to_f16. */
void pkv__f16_encode_avx2(const float *x, uint32_t d, void *dst) {
    uint16_t *o = dst;
    uint32_t j = 0;
    for (; j + 8 <= d; j += 8)
        _mm_storeu_si128((__m128i *)(o + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    pkv__f16_encode_ref(x + j, d - j, o + j);
}

/* pkv__f32_to_bf16 on 8 lanes, as 32-bit lanes holding the 16-bit results. */
static inline __m256i bf16_lanes(__m256i w) {
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(w, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000)); /* magnitudes < 2^31: signed compare */
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, nan);
}

void pkv__bf16_encode_avx2(const float *x, uint32_t d, void *dst) {
    uint16_t *o = dst;
    uint32_t j = 0;
    for (; j + 16 <= d; j += 16) {
        const __m256i a = bf16_lanes(_mm256_loadu_si256((const __m256i *)(x + j)));
        const __m256i b = bf16_lanes(_mm256_loadu_si256((const __m256i *)(x + j + 8)));
        /* packus works within 128-bit halves: a0-3 b0-3 a4-7 b4-7, put back in order */
        _mm256_storeu_si256((__m256i *)(o + j), _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
    }
    pkv__bf16_encode_ref(x + j, d - j, o + j);
}

/* F16C's widening is exact, but it quiets a signalling NaN (sets the mantissa's top bit), where
 * pkv__f16_to_f32 keeps the payload as it is: NaN lanes are rebuilt from their bits. */
void pkv__f16_decode_avx2(const void *src, uint32_t d, float *y) {
    const uint8_t *s = src; /* any alignment (pkv__f16_decode_ref) */
    uint32_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(s + 2 * j));
        const __m256i w = _mm256_cvtepu16_epi32(h);
        const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi32(0x7fff));
        const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7c00));
        const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
                                             _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                                                             _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x3ff)), 13)));
        const __m256 f = _mm256_cvtph_ps(h);
        _mm256_storeu_ps(y + j, _mm256_blendv_ps(f, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(nan)));
    }
    pkv__f16_decode_ref(s + 2 * j, d - j, y + j);
}

void pkv__bf16_decode_avx2(const void *src, uint32_t d, float *y) {
    const uint8_t *s = src;
    uint32_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 2 * j)));
        _mm256_storeu_si256((__m256i *)(y + j), _mm256_slli_epi32(w, 16));
    }
    pkv__bf16_decode_ref(s + 2 * j, d - j, y + j);
}

uint32_t pkv__max_abs32_avx2(const void *x, size_t n) {
    const uint8_t *w = x; /* any alignment (pkv__max_abs32_ref) */
    const __m256i mask = _mm256_set1_epi32(0x7fffffff);
    __m256i m0 = _mm256_setzero_si256(), m1 = m0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + 4 * i)), mask));
        m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + 4 * i + 32)), mask));
    }
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
    h = _mm_max_epu32(h, _mm_max_epu32(_mm256_castsi256_si128(m1), _mm256_extracti128_si256(m1, 1)));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
    const uint32_t m = (uint32_t)_mm_cvtsi128_si32(h), tail = pkv__max_abs32_ref(w + 4 * i, n - i);
    return PKV_MAX(m, tail);
}

uint32_t pkv__max_abs16_avx2(const void *x, size_t n) {
    const uint8_t *w = x;
    const __m256i mask = _mm256_set1_epi16(0x7fff);
    __m256i m0 = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + 2 * i)), mask));
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m0), _mm256_extracti128_si256(m0, 1));
    /* the largest of 8 unsigned 16-bit lanes: minpos of their complements */
    h = _mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1)));
    const uint32_t m = 0xffffu & ~(uint32_t)_mm_extract_epi16(h, 0), tail = pkv__max_abs16_ref(w + 2 * i, n - i);
    return PKV_MAX(m, tail);
}
