/* attn_q_avx2.c: AVX2 attention primitives for quantized K/V (q8_0, q4_0, fp8 e4m3), read
 * from the pool rows and dequantized in registers (at most an L1 tile of 8 keys for q4_0 /
 * fp8 K; no copy of the cache). Same arithmetic as attn_q_ref.c up to float summation order:
 * q8_0 / q4_0 q.K are exact int8 dot products per 32 values (maddubs + madd with the sign
 * trick), scaled by dq * dk per block. */
#include "../attn.h"
#include "../attn_q.h"
#include "../../quant/quant.h"

#include <immintrin.h>
#include <stdbool.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Dims per K tile pass: bounds the stack tiles to 8 keys x PIECE values. */
#define PIECE 1024u
/* Keys per V pass (the per-key weights live on the stack). */
#define VKEYS 16u

/* lane j of the result = sum of the 8 lanes of a[j] */
static ALWAYS_INLINE __m256i reduce8_epi32(const __m256i a[8]) {
    __m256i h01 = _mm256_hadd_epi32(a[0], a[1]), h23 = _mm256_hadd_epi32(a[2], a[3]);
    __m256i h45 = _mm256_hadd_epi32(a[4], a[5]), h67 = _mm256_hadd_epi32(a[6], a[7]);
    __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                            _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

static ALWAYS_INLINE __m256 reduce8_ps(const __m256 a[8]) {
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* Writes (or adds) the first nk lanes of v to dst. */
static ALWAYS_INLINE void store_lanes(float *dst, __m256 v, uint32_t nk, bool add) {
    if (nk == 8) {
        _mm256_storeu_ps(dst, add ? _mm256_add_ps(_mm256_loadu_ps(dst), v) : v);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (uint32_t j = 0; j < nk; j++) dst[j] = add ? dst[j] + tmp[j] : tmp[j];
}

/* ---- integer q.K (q8_0, q4_0) ----------------------------------------------------------------
 * 8 keys at once: kq[j] points at key j's first block of 32 int8 codes, blocks kstride bytes
 * apart; dk[b * 8 + j] is its block-b scale (0 for padding keys). Query blocks b0 .. b0+nb-1.
 * Per row and block: 8 x (sign, maddubs, madd), one transposing reduction to a vector whose
 * lane j is key j's integer block dot, then one fma with dq[b] * dk[b][0..7]. */
static void score_i8x8(const uint8_t *qp, size_t qrow, uint32_t D, uint32_t n_rows, uint32_t b0, uint32_t nb,
                       const int8_t *const kq[8], size_t kstride, const float *dk, float *s, uint32_t s_stride,
                       uint32_t nk, bool add) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (uint32_t r = 0; r < n_rows; r++) {
        const uint8_t *row = qp + r * qrow;
        const int8_t *qs = (const int8_t *)row + 32 * (size_t)b0;
        const uint8_t *qa = row + D + 32 * (size_t)b0;
        const float *dq = (const float *)(row + 2 * (size_t)D) + b0;
        __m256 acc = _mm256_setzero_ps();
        for (uint32_t b = 0; b < nb; b++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * b));
            const __m256i av = _mm256_loadu_si256((const __m256i *)(qa + 32 * b));
            __m256i p[8];
            for (int j = 0; j < 8; j++) {
                const __m256i kv = _mm256_loadu_si256((const __m256i *)(kq[j] + b * kstride));
                /* |q| * (k * sign q) summed in pairs: |q|, |k| <= 127 so no int16 saturation */
                p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(kv, qv)), ones);
            }
            const __m256 f = _mm256_cvtepi32_ps(reduce8_epi32(p));
            const __m256 sc = _mm256_mul_ps(_mm256_broadcast_ss(dq + b), _mm256_loadu_ps(dk + 8 * b));
            acc = _mm256_fmadd_ps(f, sc, acc);
        }
        store_lanes(s + (size_t)r * s_stride, acc, nk, add);
    }
}

static ALWAYS_INLINE int ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* f16 scales at p + j * stride (j < nk; 0 beyond) -> 8 floats. Built in a register: 16-bit
 * stores read back as one 128-bit load would stall on store forwarding. */
static ALWAYS_INLINE __m256 scales8_f16(const uint8_t *p, size_t stride, uint32_t nk) {
    __m128i h = _mm_setzero_si128();
    if (nk == 8) {
        h = _mm_insert_epi16(h, ld16(p), 0);
        h = _mm_insert_epi16(h, ld16(p + stride), 1);
        h = _mm_insert_epi16(h, ld16(p + 2 * stride), 2);
        h = _mm_insert_epi16(h, ld16(p + 3 * stride), 3);
        h = _mm_insert_epi16(h, ld16(p + 4 * stride), 4);
        h = _mm_insert_epi16(h, ld16(p + 5 * stride), 5);
        h = _mm_insert_epi16(h, ld16(p + 6 * stride), 6);
        h = _mm_insert_epi16(h, ld16(p + 7 * stride), 7);
    } else {
        uint16_t t[8] = {0};
        for (uint32_t j = 0; j < nk; j++) t[j] = (uint16_t)ld16(p + j * stride);
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return _mm256_cvtph_ps(h);
}

static void score_q8_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                       uint32_t D, float *s, uint32_t s_stride, pkv__attn_pf *pf) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const uint32_t nb = D / 32, pb = PIECE / 32;
    float dk[PIECE / 32 * 8];
    pkv__attn_pf_start(pf, (n_keys + 7) / 8);
    for (uint32_t t0 = 0; t0 < n_keys; t0 += 8) {
        pkv__attn_pf_step(pf);
        const uint32_t nk = PKV_MIN(8u, n_keys - t0);
        const uint8_t *k0 = k + (size_t)t0 * k_row_bytes;
        for (uint32_t b0 = 0; b0 < nb; b0 += pb) {
            const uint32_t n = PKV_MIN(pb, nb - b0);
            const int8_t *kq[8];
            for (uint32_t j = 0; j < 8; j++) /* padding keys reread key 0 with scale 0 */
                kq[j] = (const int8_t *)(k0 + (j < nk ? j : 0) * k_row_bytes + b0 * sizeof(pkv_block_q8_0) + 2);
            for (uint32_t b = 0; b < n; b++)
                _mm256_storeu_ps(dk + 8 * b, scales8_f16(k0 + (b0 + b) * sizeof(pkv_block_q8_0), k_row_bytes, nk));
            score_i8x8(qp, qrow, D, n_rows, b0, n, kq, sizeof(pkv_block_q8_0), dk, s + t0, s_stride, nk, b0 > 0);
        }
    }
}

/* 16 bytes of q4_0 nibbles -> 32 int8 in [-8, 7], in value order */
static ALWAYS_INLINE __m256i q4_unpack(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(15);
    const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}

static void score_q4_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                       uint32_t D, float *s, uint32_t s_stride, pkv__attn_pf *pf) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const uint32_t nb = D / 32, pb = PIECE / 32;
    float dk[PIECE / 32 * 8];
    int8_t tile[8][PIECE] __attribute__((aligned(32))); /* 8 keys' codes, unpacked once for all rows */
    pkv__attn_pf_start(pf, (n_keys + 7) / 8);
    for (uint32_t t0 = 0; t0 < n_keys; t0 += 8) {
        pkv__attn_pf_step(pf);
        const uint32_t nk = PKV_MIN(8u, n_keys - t0);
        const uint8_t *k0 = k + (size_t)t0 * k_row_bytes;
        for (uint32_t b0 = 0; b0 < nb; b0 += pb) {
            const uint32_t n = PKV_MIN(pb, nb - b0);
            const int8_t *kq[8];
            for (uint32_t j = 0; j < 8; j++) {
                kq[j] = tile[j < nk ? j : 0];
                if (j >= nk) continue;
                const uint8_t *kr = k0 + j * k_row_bytes + b0 * sizeof(pkv_block_q4_0);
                for (uint32_t b = 0; b < n; b++)
                    _mm256_store_si256((__m256i *)(tile[j] + 32 * b), q4_unpack(kr + b * sizeof(pkv_block_q4_0) + 2));
            }
            for (uint32_t b = 0; b < n; b++)
                _mm256_storeu_ps(dk + 8 * b, scales8_f16(k0 + (b0 + b) * sizeof(pkv_block_q4_0), k_row_bytes, nk));
            score_i8x8(qp, qrow, D, n_rows, b0, n, kq, 32, dk, s + t0, s_stride, nk, b0 > 0);
        }
    }
}

/* ---- fp8 e4m3 ---------------------------------------------------------------------------------
 * 16 codes -> 16 floats equal to e4m3(b) * 2^-8 exactly: with the byte in the high half of a
 * 16-bit lane, an arithmetic shift right by one puts the sign at bit 15 (and 14, cleared) and
 * the magnitude at bits 13..7: an f16 with the e4m3 exponent rebiased by 8, subnormals
 * included, which F16C widens exactly. The encoder never writes the NaN codes. */
static ALWAYS_INLINE void e4m3x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
    w = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xbf80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
}

static void score_fp8(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                      uint32_t D, float *s, uint32_t s_stride, pkv__attn_pf *pf) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    float tile[8][PIECE] __attribute__((aligned(32))); /* 8 keys x PIECE values, times 2^-8 */
    pkv__attn_pf_start(pf, (n_keys + 7) / 8);
    for (uint32_t t0 = 0; t0 < n_keys; t0 += 8) {
        pkv__attn_pf_step(pf);
        const uint32_t nk = PKV_MIN(8u, n_keys - t0);
        float sk[8] = {0};
        for (uint32_t j = 0; j < nk; j++) memcpy(&sk[j], k + (size_t)(t0 + j) * k_row_bytes, 4);
        /* built from scalars (not reloaded from the stores); x 256 is exact: undoes the decode's 2^-8 */
        const __m256 skv = _mm256_mul_ps(_mm256_setr_ps(sk[0], sk[1], sk[2], sk[3], sk[4], sk[5], sk[6], sk[7]),
                                         _mm256_set1_ps(256.0f));
        for (uint32_t d0 = 0; d0 < D; d0 += PIECE) {
            const uint32_t dn = PKV_MIN(PIECE, D - d0), dn8 = (dn + 7) & ~7u;
            for (uint32_t j = 0; j < 8; j++) {
                if (j >= nk) { /* padding keys: zeros (fixed tile offsets keep the fma loop lean) */
                    memset(tile[j], 0, dn8 * sizeof(float));
                    continue;
                }
                const uint8_t *e = k + (size_t)(t0 + j) * k_row_bytes + PKV_FP8_ROW_HEADER + d0;
                uint32_t d = 0;
                for (; d + 16 <= dn; d += 16) {
                    __m256 a, b;
                    e4m3x16(e + d, &a, &b);
                    _mm256_store_ps(tile[j] + d, a);
                    _mm256_store_ps(tile[j] + d + 8, b);
                }
                for (; d < dn; d++) tile[j][d] = pkv__e4m3_to_f32(e[d]) * (1.0f / 256.0f);
                for (; d < dn8; d++) tile[j][d] = 0.0f;
            }
            for (uint32_t r = 0; r < n_rows; r++) {
                const float *qr = (const float *)((const uint8_t *)qp + r * qrow) + d0; /* zero-padded to 8 */
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (uint32_t d = 0; d < dn8; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qr + d);
                    for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(&tile[j][d]), acc[j]);
                }
                store_lanes(s + (size_t)r * s_stride + t0, _mm256_mul_ps(reduce8_ps(acc), skv), nk, d0 > 0);
            }
        }
    }
}

/* ---- V accumulation ----------------------------------------------------------------------------
 * Rows in groups of NR <= 4 with their accumulators in registers (2 x 8 values per row), keys
 * inner: each decoded V vector feeds NR fmas. w[rr * VKEYS + t] is row rr's weight for key t
 * with the key's (block) scale folded in. */
#define DEF_VLOOP(NAME, DECODE)                                                                       \
    static ALWAYS_INLINE void NAME(const float *w, uint32_t nk, const uint8_t *v, size_t v_row_bytes,     \
                                   size_t off, float *acc, uint32_t D, uint32_t NR) {                   \
        __m256 a[4][2];                                                                                  \
        for (uint32_t rr = 0; rr < NR; rr++) {                                                           \
            a[rr][0] = _mm256_load_ps(acc + rr * (size_t)D);                                             \
            a[rr][1] = _mm256_load_ps(acc + rr * (size_t)D + 8);                                         \
        }                                                                                                \
        for (uint32_t t = 0; t < nk; t++) {                                                              \
            const uint8_t *src = v + t * v_row_bytes + off;                                              \
            __m256 x0, x1;                                                                               \
            DECODE;                                                                                      \
            for (uint32_t rr = 0; rr < NR; rr++) {                                                       \
                const __m256 wv = _mm256_broadcast_ss(w + rr * VKEYS + t);                               \
                a[rr][0] = _mm256_fmadd_ps(wv, x0, a[rr][0]);                                            \
                a[rr][1] = _mm256_fmadd_ps(wv, x1, a[rr][1]);                                            \
            }                                                                                            \
        }                                                                                                \
        for (uint32_t rr = 0; rr < NR; rr++) {                                                           \
            _mm256_store_ps(acc + rr * (size_t)D, a[rr][0]);                                             \
            _mm256_store_ps(acc + rr * (size_t)D + 8, a[rr][1]);                                         \
        }                                                                                                \
    }

/* q8_0: 16 codes at src */
DEF_VLOOP(vloop_q8, {
    x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
    x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8))));
})
/* q4_0, low nibbles (values 0..15 of a block): src = the block's 16 code bytes */
DEF_VLOOP(vloop_q4_lo, {
    const __m128i c = _mm_sub_epi8(_mm_and_si128(_mm_loadu_si128((const __m128i *)src), _mm_set1_epi8(15)),
                                   _mm_set1_epi8(8));
    x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
})
/* q4_0, high nibbles (values 16..31) */
DEF_VLOOP(vloop_q4_hi, {
    const __m128i c = _mm_sub_epi8(
        _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)src), 4), _mm_set1_epi8(15)), _mm_set1_epi8(8));
    x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
})
/* fp8: 16 codes at src (values times 2^-8; the weights carry the 2^8) */
DEF_VLOOP(vloop_fp8, { e4m3x16(src, &x0, &x1); })

#define NR_SWITCH(CALL)                                                                                  \
    switch (nr) {                                                                                        \
    case 4: CALL(4); break;                                                                              \
    case 3: CALL(3); break;                                                                              \
    case 2: CALL(2); break;                                                                              \
    default: CALL(1); break;                                                                             \
    }

/* acc is 64-byte aligned with D floats per row; D % 32 == 0 here, so every 16-value group is
 * 32-byte aligned. */
static void accum_blocks(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                         uint32_t n_keys, uint32_t D, float *acc, bool q4) {
    const uint32_t nb = D / 32;
    const size_t bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);
    float w[4 * VKEYS] __attribute__((aligned(32)));
    float pr[4 * VKEYS] __attribute__((aligned(32))); /* this row group's p, zero past nk */
    float dv[(PIECE / 32) * 4 * VKEYS] __attribute__((aligned(32))); /* [block][key] scales */
    for (uint32_t t0 = 0; t0 < n_keys; t0 += VKEYS) {
        const uint32_t nk = PKV_MIN(VKEYS, n_keys - t0);
        const uint8_t *v0 = v + (size_t)t0 * v_row_bytes;
        for (uint32_t b0 = 0; b0 < nb; b0 += PIECE / 32 * 4) { /* dv holds 128 blocks: D <= 4096 */
            const uint32_t nbp = PKV_MIN(PIECE / 32 * 4, nb - b0);
            for (uint32_t b = 0; b < nbp; b++) {
                const uint8_t *sp = v0 + (b0 + b) * bsz;
                _mm256_store_ps(dv + b * VKEYS, scales8_f16(sp, v_row_bytes, PKV_MIN(nk, 8u)));
                _mm256_store_ps(dv + b * VKEYS + 8,
                                nk > 8 ? scales8_f16(sp + 8 * v_row_bytes, v_row_bytes, nk - 8) : _mm256_setzero_ps());
            }
            for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
                const uint32_t nr = PKV_MIN(4u, n_rows - r0);
                float *ar = acc + (size_t)r0 * D;
                for (uint32_t rr = 0; rr < nr; rr++) {
                    const float *pp = p + (size_t)(r0 + rr) * p_stride + t0;
                    if (nk == VKEYS) {
                        _mm256_store_ps(pr + rr * VKEYS, _mm256_loadu_ps(pp));
                        _mm256_store_ps(pr + rr * VKEYS + 8, _mm256_loadu_ps(pp + 8));
                    } else {
                        for (uint32_t t = 0; t < VKEYS; t++) pr[rr * VKEYS + t] = t < nk ? pp[t] : 0.0f;
                    }
                }
                for (uint32_t bb = 0; bb < nbp; bb++) {
                    const uint32_t b = b0 + bb;
                    for (uint32_t rr = 0; rr < nr; rr++)
                        for (uint32_t t = 0; t < VKEYS; t += 8)
                            _mm256_store_ps(w + rr * VKEYS + t, _mm256_mul_ps(_mm256_load_ps(pr + rr * VKEYS + t),
                                                                              _mm256_load_ps(dv + bb * VKEYS + t)));
                    const size_t off = b * bsz + 2;
                    float *ab = ar + 32 * b;
                    if (q4) {
#define CALL_LO(N) vloop_q4_lo(w, nk, v0, v_row_bytes, off, ab, D, N)
#define CALL_HI(N) vloop_q4_hi(w, nk, v0, v_row_bytes, off, ab + 16, D, N)
                        NR_SWITCH(CALL_LO)
                        NR_SWITCH(CALL_HI)
                    } else {
#define CALL_Q8A(N) vloop_q8(w, nk, v0, v_row_bytes, off, ab, D, N)
#define CALL_Q8B(N) vloop_q8(w, nk, v0, v_row_bytes, off + 16, ab + 16, D, N)
                        NR_SWITCH(CALL_Q8A)
                        NR_SWITCH(CALL_Q8B)
                    }
                }
            }
        }
    }
}

static void accum_q8_0(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                       uint32_t n_keys, uint32_t D, float *acc) {
    accum_blocks(p, p_stride, n_rows, v, v_row_bytes, n_keys, D, acc, false);
}

static void accum_q4_0(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                       uint32_t n_keys, uint32_t D, float *acc) {
    accum_blocks(p, p_stride, n_rows, v, v_row_bytes, n_keys, D, acc, true);
}

static void accum_fp8(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                      uint32_t n_keys, uint32_t D, float *acc) {
    float w[VKEYS * 4] __attribute__((aligned(32)));
    const uint32_t d16 = D & ~15u;
    for (uint32_t t0 = 0; t0 < n_keys; t0 += VKEYS) {
        const uint32_t nk = PKV_MIN(VKEYS, n_keys - t0);
        const uint8_t *v0 = v + (size_t)t0 * v_row_bytes;
        for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
            const uint32_t nr = PKV_MIN(4u, n_rows - r0);
            float *ar = acc + (size_t)r0 * D;
            for (uint32_t t = 0; t < nk; t++) {
                float sv;
                memcpy(&sv, v0 + t * v_row_bytes, 4);
                for (uint32_t rr = 0; rr < nr; rr++)
                    w[rr * VKEYS + t] = p[(size_t)(r0 + rr) * p_stride + t0 + t] * sv * 256.0f;
            }
            if (D % 8 == 0) { /* rows stay 32-byte aligned: the register loop */
                for (uint32_t d = 0; d < d16; d += 16) {
#define CALL_F8(N) vloop_fp8(w, nk, v0, v_row_bytes, PKV_FP8_ROW_HEADER + d, ar + d, D, N)
                    NR_SWITCH(CALL_F8)
                }
            } else {
                for (uint32_t d = 0; d < d16; d += 16)
                    for (uint32_t t = 0; t < nk; t++) {
                        __m256 x0, x1;
                        e4m3x16(v0 + t * v_row_bytes + PKV_FP8_ROW_HEADER + d, &x0, &x1);
                        for (uint32_t rr = 0; rr < nr; rr++) {
                            float *a = ar + rr * (size_t)D + d;
                            const __m256 wv = _mm256_broadcast_ss(w + rr * VKEYS + t);
                            _mm256_storeu_ps(a, _mm256_fmadd_ps(wv, x0, _mm256_loadu_ps(a)));
                            _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(wv, x1, _mm256_loadu_ps(a + 8)));
                        }
                    }
            }
            for (uint32_t d = d16; d < D; d++) /* tail: w / 256 is exactly p * sv */
                for (uint32_t t = 0; t < nk; t++) {
                    const float e = pkv__e4m3_to_f32(v0[t * v_row_bytes + PKV_FP8_ROW_HEADER + d]);
                    for (uint32_t rr = 0; rr < nr; rr++) ar[rr * (size_t)D + d] += w[rr * VKEYS + t] * (1.0f / 256.0f) * e;
                }
        }
    }
}

void pkv__attn_fill_q_avx2(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_Q8_0] = pkv__attn_prep_q8;
    kt->prep_q[PKV_DTYPE_Q4_0] = pkv__attn_prep_q8;
    kt->prep_q[PKV_DTYPE_FP8_E4M3] = pkv__attn_prep_f32;
    kt->score[PKV_DTYPE_Q8_0] = score_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_q4_0;
    kt->score[PKV_DTYPE_FP8_E4M3] = score_fp8;
    kt->accum[PKV_DTYPE_Q8_0] = accum_q8_0;
    kt->accum[PKV_DTYPE_Q4_0] = accum_q4_0;
    kt->accum[PKV_DTYPE_FP8_E4M3] = accum_fp8;
}
