/* attn_q_vnni.c: the q8_0 and q4_0 score (q.K) with VNNI's vpdpbusd, the backend "avx512-vnni"
 * (the avx512 table with these entries over it) and, compiled again by attn_q_avxvnni.c with the
 * VEX encoding of AVX-VNNI (PKV_AVXVNNI: its 256-bit 4-key tiles only), the backend "avx2-vnni"
 * (the avx2 table with them over it). Same integers as attn_q_ref.c:
 * each 32-value block's dot product of the int8 query and the K codes is exact, then scaled by
 * dq * dk in f32, as in the AVX2 file.
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes and adds each 4 products into an int32
 * lane, so one instruction does what AVX2 does with sign, maddubs and madd. The K codes are the
 * unsigned side: q4_0's nibbles n as they are (n - 8 is the value), q8_0's codes k as k + 128
 * (one xor per K vector, shared by the rows). The offsets come back as one constant per row and
 * half-block, -8 * sum(q) or -128 * sum(q), which the prep stores as the start value of the
 * dot products (lanes 0 and 4 of a vector; the reduction adds them into the half-block sums).
 * The tiles, the reduction and the walk are the AVX2 file's (i8_x86.h); 256-bit vectors, since
 * one 32-value block is 32 bytes and Zen 4 runs 512-bit integer ops as two 256-bit halves. */
#include "../attn.h"
#include "../attn_q.h"
#include "../../quant/quant.h"
#ifdef PKV_AVX512_EMU /* tests only: the same kernels on AVX2, vpdpbusd emulated (avx512_emu.h) */
#include "avx512_emu.h"
#define PKV__VNNI_FILL pkv__attn_fill_q_vnni_emu
#define PKV__VNNI_FILL_WIDE pkv__attn_fill_q_vnni_wide_emu
#define PKV__VNNI_NAME "avx512-vnni-emu"
#define DPBUSD256 _mm256_dpbusd_epi32
#elif defined(PKV_AVXVNNI) /* attn_q_avxvnni.c: AVX2 + AVX-VNNI (VEX), no AVX-512 */
#include <immintrin.h>
#define PKV__VNNI_FILL pkv__attn_fill_q_avxvnni
#define PKV__VNNI_NAME "avx2-vnni"
#define DPBUSD256 _mm256_dpbusd_avx_epi32
#else
#include <immintrin.h>
#define PKV__VNNI_FILL pkv__attn_fill_q_vnni
#define PKV__VNNI_FILL_WIDE pkv__attn_fill_q_vnni_wide
#define PKV__VNNI_NAME "avx512-vnni"
#define DPBUSD256 _mm256_dpbusd_epi32
#endif
#include "i8_x86.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* ---- prepared query ---------------------------------------------------------------------------
 * The AVX2 row (attn_q_avx2.c: int8 q | |q| | f32 dq8 | int32 qs8, per 32-value block), with the
 * |q| slot, which these kernels do not read, replaced by the dot products' start value per block:
 * int32 [-off * S0, 0, 0, 0, -off * S1, 0, 0, 0], S0 and S1 the sums of q over values 0..15 and
 * 16..31, off 8 (q4_0) or 128 (q8_0). qs8 holds 8 * S0 in lane 0 and 8 * S1 in lane 4. */
static ALWAYS_INLINE void prep_vnni(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp,
                                    const int shift) {
    pkv__attn_prep_i8_avx2(q, q_stride, n_rows, D, scale, qp);
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const __m256i keep = _mm256_setr_epi32(-1, 0, 0, 0, -1, 0, 0, 0);
    for (uint32_t r = 0; r < n_rows; r++) {
        uint8_t *row = (uint8_t *)qp + r * qrow;
        for (uint32_t b = 0; b < D / 32; b++) {
            const __m256i qs8 = _mm256_loadu_si256((const __m256i *)(row + 3 * (size_t)D + 32 * b));
            const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(qs8, shift));
            _mm256_storeu_si256((__m256i *)(row + D + 32 * b), _mm256_and_si256(c, keep));
        }
    }
}

static void prep_q8_0(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp) {
    prep_vnni(q, q_stride, n_rows, D, scale, qp, 4); /* 16 * 8 * S = 128 * S */
}

static void prep_q4_0(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp) {
    prep_vnni(q, q_stride, n_rows, D, scale, qp, 0);
}

/* ---- score: NR rows x 4 keys ------------------------------------------------------------------
 * Per block and row: 4 vpdpbusd from the start value, a reduction to [k0..k3 | k0..k3], one convert,
 * one scale multiply, one fma. Bounds: 4 products of at most 255 * 127 per lane, 129540, plus a
 * start value of at most 128 * 16 * 127 in magnitude. */
static ALWAYS_INLINE __m256i vnni_codes(const uint8_t *p, const bool q4) {
    return q4 ? pkv__q4_codes(p) : _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
}

static ALWAYS_INLINE __m256i vnni_sums(const __m256i kv[4], const uint8_t *row, uint32_t b, uint32_t D) {
    const __m256i qv = _mm256_loadu_si256((const __m256i *)(row + 32 * b));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(row + D + 32 * b));
    return pkv__sum4x4_epi32(DPBUSD256(c, kv[0], qv), DPBUSD256(c, kv[1], qv), DPBUSD256(c, kv[2], qv),
                             DPBUSD256(c, kv[3], qv));
}

static ALWAYS_INLINE void score_vnni_tile(const uint8_t *qp, size_t qrow, uint32_t D, const uint32_t NR,
                                          const uint8_t *const kr[4], const bool q4, float *s, uint32_t ss,
                                          uint32_t nk) {
#define CODES(p) vnni_codes(p, q4)
#define SUMS(kv, row, b) vnni_sums(kv, row, b, D)
    PKV__I8_TILE_BODY(CODES, SUMS);
#undef CODES
#undef SUMS
}

#define CALL_VNNI(N) score_vnni_tile(q, qrow, D, N, kr, q4, sr, ss, nk)
PKV__ATTN_DEF_I8_SCORE_WALK(CALL_VNNI)
#undef CALL_VNNI

PKV__ATTN_DEF_I8_SCORES(score_i8)

void PKV__VNNI_FILL(pkv__attn_kernels *kt) {
    kt->name = PKV__VNNI_NAME;
    kt->prep_q[PKV_DTYPE_Q8_0] = prep_q8_0;
    kt->prep_q[PKV_DTYPE_Q4_0] = prep_q4_0;
    kt->score[PKV_DTYPE_Q8_0] = score_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_q4_0;
}

#ifndef PKV_AVXVNNI /* the rest is AVX-512 */
/* ---- score over 16 keys transposed (pkv__attn_fill_q_vnni_wide) ---------------------------------
 * For cores with full-width 512-bit units (Intel, AMD Zen 5; build_kernels takes it where
 * PKV_CPU_AVX512_HALVES is not set; measured on Intel only). The tiles above reduce each row's
 * four 8-lane dot products to the 4 keys' sums, 9 shuffles and adds per row and block: with 4
 * query rows a kv head that reduction, done again for every row, is most of the score's work.
 * Here 16 keys' codes of a block are transposed once, shared by the rows: register g holds the
 * 4-byte group g of every key (lane j: key j), so one vpdpbusd with the query's group g
 * broadcast adds 4 products to each key's lane, and 8 of them leave each key's block sum in its
 * own lane with nothing to reduce. A row then costs 8 vpdpbusd, an add, a convert, a multiply
 * (the scales) and an fma per block for 16 keys.
 * The transpose (q8_0: 8 x 32 bytes per key pair and block, 3 shuffle stages; q4_0: 16 bytes
 * a key, 2 stages, the nibbles split after) is paid once per block and 16 keys.
 *
 * Prepared row: the AVX2 row (int8 q | - | f32 dq8 | int32 qs8) with each block's start value,
 * -off * (sum of q over the block), off 128 (q8_0) or 8 (q4_0), as one int32 at D + 4 b. Same
 * integers as attn_q_ref.c, the block scales dk * dq applied in f32 as in the tiles above. */
typedef struct t16_rows {
    const uint8_t *kr[16]; /* key j's row (past nk: the last real key's again) */
    __mmask16 km;          /* the nk real keys */
    bool gather;           /* the scales by one gather (offsets j * k_row_bytes fit 32 bits) */
#ifndef PKV_AVX512_EMU
    __m512i ix; /* j * k_row_bytes */
#endif
} t16_rows;

static ALWAYS_INLINE void prep_t16(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp,
                                   const int32_t mul) {
    pkv__attn_prep_i8_avx2(q, q_stride, n_rows, D, scale, qp);
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    for (uint32_t r = 0; r < n_rows; r++) {
        uint8_t *row = (uint8_t *)qp + r * qrow;
        for (uint32_t b = 0; b < D / 32; b++) {
            int32_t s0, s1;
            memcpy(&s0, row + 3 * (size_t)D + 32 * b, 4);
            memcpy(&s1, row + 3 * (size_t)D + 32 * b + 16, 4);
            const int32_t start = -mul * (s0 + s1); /* qs8 holds 8 * the half sums */
            memcpy(row + D + 4 * (size_t)b, &start, 4);
        }
    }
}

static void prep_t16_q8_0(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp) {
    prep_t16(q, q_stride, n_rows, D, scale, qp, 16); /* 16 * 8 * S = 128 * S */
}

static void prep_t16_q4_0(const float *q, size_t q_stride, uint32_t n_rows, uint32_t D, float scale, void *qp) {
    prep_t16(q, q_stride, n_rows, D, scale, qp, 1);
}

/* q8_0, block at offset o of each row: Kt[g], lane j = bytes 4 g .. 4 g + 3 of key j's codes + 128.
 * Registers of key pairs (i, i + 8), then 8 x 8 transposes within their 256-bit halves (epi32 and
 * epi64 unpacks), then the halves' 128-bit lanes interleaved (lanes 0-3: keys 0-3, 4-7: 4-7, ...). */
static ALWAYS_INLINE void t16_codes_q8(const t16_rows *kr, size_t o, __m512i Kt[8]) {
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(kr->kr[i] + o))),
                                  _mm256_loadu_si256((const __m256i *)(kr->kr[i + 8] + o)), 1);
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    for (int h = 0; h < 8; h += 4) {
        u[h] = _mm512_unpacklo_epi64(t[h], t[h + 2]), u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]), u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    /* u[m], m < 4: lanes 0-3 group m of keys 0-3, 4-7 group m + 4 of keys 0-3, 8-15 the same of keys
     * 8-11; u[4 + m] the same of keys 4-7 and 12-15 */
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    for (int m = 0; m < 4; m++) {
        Kt[m] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[m], lo, u[4 + m]), x80);
        Kt[m + 4] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[m], hi, u[4 + m]), x80);
    }
}

/* q4_0: registers of keys (i, i + 4, i + 8, i + 12), a 4 x 4 transpose within 128-bit lanes (which
 * leaves lane j = key j), then group g < 4 is the low nibbles (values 4 g .. 4 g + 3) and group
 * g + 4 the high ones (values 16 + 4 g ..). */
static ALWAYS_INLINE void t16_codes_q4(const t16_rows *kr, size_t o, __m512i Kt[8]) {
    __m512i z[4], t[4];
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(kr->kr[i] + o)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kr->kr[i + 4] + o)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kr->kr[i + 8] + o)), 2);
        z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kr->kr[i + 12] + o)), 3);
    }
    t[0] = _mm512_unpacklo_epi32(z[0], z[1]), t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm512_unpacklo_epi32(z[2], z[3]), t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i w[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                          _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int g = 0; g < 4; g++) {
        Kt[g] = _mm512_and_si512(w[g], m4);
        Kt[g + 4] = _mm512_and_si512(_mm512_srli_epi16(w[g], 4), m4);
    }
}

/* The 16 keys' f16 block scales at offset o of their rows, as f32 (lanes past nk: 0). */
static ALWAYS_INLINE __m512 t16_scales(const t16_rows *kr, size_t o) {
#ifndef PKV_AVX512_EMU /* SIMDe has no 512-bit gather */
    if (kr->gather)
        return _mm512_cvtph_ps(
            _mm512_cvtepi32_epi16(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), kr->km, kr->ix, kr->kr[0] + o, 1)));
#endif
    uint16_t h[16] = {0};
    for (int j = 0; j < 16; j++)
        if (kr->km >> j & 1) memcpy(&h[j], kr->kr[j] + o, 2);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

/* The 32 bits at p in every lane, by a broadcast load (with a plain set1 of a scalar, GCC loaded
 * the query's groups into general registers in pairs and broadcast each from there: a shuffle
 * port uop apiece, where the load ports broadcast for free). _mm_loadu_si32: no float read of the
 * int8 / int32 bytes (GCC 12 still makes one vpbroadcastd from memory of it). */
static ALWAYS_INLINE __m512i t16_bcast(const uint8_t *p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

/* Row r's dot products with Kt for block b, plus its start value: two chains of 4 vpdpbusd. */
static ALWAYS_INLINE __m512 t16_row_block(const __m512i Kt[8], const uint8_t *row, uint32_t b, uint32_t D) {
    const uint8_t *qg = row + 32 * (size_t)b;
    __m512i a0 = t16_bcast(row + D + 4 * (size_t)b), a1 = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2) {
        a0 = _mm512_dpbusd_epi32(a0, Kt[g], t16_bcast(qg + 4 * g));
        a1 = _mm512_dpbusd_epi32(a1, Kt[g + 1], t16_bcast(qg + 4 * g + 4));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
}

static ALWAYS_INLINE float t16_dq(const uint8_t *row, uint32_t b, uint32_t D) {
    float dq;
    memcpy(&dq, row + 2 * (size_t)D + 32 * (size_t)b, 4);
    return dq;
}

static ALWAYS_INLINE void t16_store(float *s, __m512 v, uint32_t nk) {
    if (nk == 16) {
        _mm512_storeu_ps(s, v);
        return;
    }
    float t[16];
    _mm512_storeu_ps(t, v);
    memcpy(s, t, nk * sizeof(float));
}

static ALWAYS_INLINE void t16_codes(const t16_rows *kr, uint32_t b, __m512i Kt[8], const bool q4) {
    if (q4)
        t16_codes_q4(kr, b * sizeof(pkv_block_q4_0) + 2, Kt);
    else
        t16_codes_q8(kr, b * sizeof(pkv_block_q8_0) + 2, Kt);
}

/* n_rows (<= T16_ROWS) rows x 16 keys, each block transposed once for all of them; the rows' sums
 * kept across the blocks (in registers where n_rows is a constant of at most 4: t16_tile). */
#define T16_ROWS 16u
static ALWAYS_INLINE void t16_rows_tile(const uint8_t *qp, size_t qrow, uint32_t D, uint32_t n_rows,
                                        const t16_rows *kr, float *s, uint32_t ss, uint32_t nk, pkv__attn_pf *pf,
                                        const bool q4) {
    const size_t bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);
    __m512 acc[T16_ROWS];
    for (uint32_t r = 0; r < n_rows; r++) acc[r] = _mm512_setzero_ps();
    for (uint32_t b = 0; b < D / 32; b++) {
        __m512i Kt[8];
        t16_codes(kr, b, Kt, q4);
        const __m512 dk = t16_scales(kr, b * bsz);
        for (uint32_t r = 0; r < n_rows; r++) {
            const uint8_t *row = qp + r * qrow;
            acc[r] = _mm512_fmadd_ps(t16_row_block(Kt, row, b, D), _mm512_mul_ps(dk, _mm512_set1_ps(t16_dq(row, b, D))),
                                     acc[r]);
        }
        pkv__attn_pf_step(pf);
    }
    for (uint32_t r = 0; r < n_rows; r++) t16_store(s + (size_t)r * ss, acc[r], nk);
}

static ALWAYS_INLINE void score_t16_d(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,
                                      uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf, const bool q4) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const uint32_t groups = n_rows <= 4 ? 1 : (n_rows + T16_ROWS - 1) / T16_ROWS;
    pkv__attn_pf_start(pf, (n_keys + 15) / 16 * (D / 32) * groups);
    if (!n_rows) n_keys = 0; /* nothing to write (PKV__ATTN_NR_SWITCH would take 0 rows as 1) */
    t16_rows kr;
    kr.gather = krb <= (size_t)INT32_MAX / 16;
#ifndef PKV_AVX512_EMU
    kr.ix = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                               _mm512_set1_epi32(kr.gather ? (int32_t)krb : 0));
#endif
    for (uint32_t t0 = 0; t0 < n_keys; t0 += 16) {
        const uint32_t nk = PKV_MIN(16u, n_keys - t0);
        for (uint32_t j = 0; j < 16; j++) kr.kr[j] = k + (size_t)(t0 + (j < nk ? j : nk - 1)) * krb;
        kr.km = (__mmask16)((1u << nk) - 1u);
        float *st = s + t0;
#define CALL_T16(N) t16_rows_tile((const uint8_t *)qp, qrow, D, N, &kr, st, ss, nk, pf, q4)
        if (n_rows <= 4) {
            PKV__ATTN_NR_SWITCH(n_rows, CALL_T16)
        } else {
            for (uint32_t r0 = 0; r0 < n_rows; r0 += T16_ROWS)
                t16_rows_tile((const uint8_t *)qp + r0 * qrow, qrow, D, PKV_MIN(T16_ROWS, n_rows - r0), &kr,
                              st + (size_t)r0 * ss, ss, nk, pf, q4);
        }
#undef CALL_T16
    }
    pkv__attn_pf_finish(pf);
}

static void score_t16_q8_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                           float *s, uint32_t ss, pkv__attn_pf *pf) {
    if (D == 128)
        score_t16_d(qp, n_rows, k, krb, n_keys, 128, s, ss, pf, false);
    else
        score_t16_d(qp, n_rows, k, krb, n_keys, D, s, ss, pf, false);
}

static void score_t16_q4_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                           float *s, uint32_t ss, pkv__attn_pf *pf) {
    if (D == 128)
        score_t16_d(qp, n_rows, k, krb, n_keys, 128, s, ss, pf, true);
    else
        score_t16_d(qp, n_rows, k, krb, n_keys, D, s, ss, pf, true);
}

void PKV__VNNI_FILL_WIDE(pkv__attn_kernels *kt) {
    kt->name = PKV__VNNI_NAME;
    kt->prep_q[PKV_DTYPE_Q8_0] = prep_t16_q8_0;
    kt->prep_q[PKV_DTYPE_Q4_0] = prep_t16_q4_0;
    kt->score[PKV_DTYPE_Q8_0] = score_t16_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_t16_q4_0;
}
#endif
