/* i8_x86.h: the q8_0 / q4_0 score pieces shared by the x86 quantized attention files
 * (attn_q_avx2.c, attn_q_vnni.c; include only from files compiled with -mavx2 -mf16c): the
 * 4-key tile's loads and stores and the walk over a block's keys and rows.
 *
 * A score tile is NR rows x 4 keys (kr[j]: key j's row; padding keys repeat a real one and their
 * lanes are not stored). Per 32-value block it holds the 4 keys' codes in registers and their
 * scales as [dk0..dk3 | dk0..dk3]; per row it reduces 4 integer dot products to
 * [k0..k3 | k0..k3] (sums over the two half-blocks) and adds float(sums) * dk * dq. */
#ifndef PKV_ATTN_I8_X86_H
#define PKV_ATTN_I8_X86_H

#include "../attn.h"
#include "../attn_q.h"
#include "../../quant/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

static inline __attribute__((always_inline)) int pkv__ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Writes the first n (<= 4) lanes of v to dst. */
static inline __attribute__((always_inline)) void pkv__store4(float *dst, __m128 v, uint32_t n) {
    if (n == 4) {
        _mm_storeu_ps(dst, v);
        return;
    }
    float t[4];
    _mm_storeu_ps(t, v);
    for (uint32_t j = 0; j < n; j++) dst[j] = t[j];
}

/* 16 bytes of q4_0 nibbles -> 32 bytes 0..15 in value order (low nibbles, then high) */
static inline __attribute__((always_inline)) __m256i pkv__q4_codes(const uint8_t *p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

/* The f16 block scales at offset o of the 4 keys' rows as [dk0..dk3 | dk0..dk3]. */
static inline __attribute__((always_inline)) __m256 pkv__dk4(const uint8_t *const kr[4], size_t o) {
    __m128i h = _mm_cvtsi32_si128(pkv__ld16(kr[0] + o));
    h = _mm_insert_epi16(h, pkv__ld16(kr[1] + o), 1);
    h = _mm_insert_epi16(h, pkv__ld16(kr[2] + o), 2);
    h = _mm_insert_epi16(h, pkv__ld16(kr[3] + o), 3);
    const __m128 d4 = _mm_cvtph_ps(h);
    return _mm256_set_m128(d4, d4);
}

/* [sum t0 | sum t1 | sum t2 | sum t3] within each 128-bit half: lane j of each half is the sum of
 * tj's 4 lanes there. Unpacks and adds (9 ops); 3% faster than 3 hadds on Zen 4. */
static inline __attribute__((always_inline)) __m256i pkv__sum4x4_epi32(__m256i t0, __m256i t1, __m256i t2, __m256i t3) {
    const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(t0, t1), _mm256_unpackhi_epi32(t0, t1));
    const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(t2, t3), _mm256_unpackhi_epi32(t2, t3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

/* Sums the two half-block lanes of each row's tile accumulator and stores the nk (<= 4) keys. */
static inline __attribute__((always_inline)) void pkv__i8_store_tile(const __m256 acc[4], const uint32_t NR, float *s,
                                                                     uint32_t ss, uint32_t nk) {
    __m128 o[4];
    for (uint32_t r = 0; r < NR; r++) o[r] = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    if (nk == 4) {
        for (uint32_t r = 0; r < NR; r++) _mm_storeu_ps(s + (size_t)r * ss, o[r]);
    } else {
        for (uint32_t r = 0; r < NR; r++) pkv__store4(s + (size_t)r * ss, o[r], nk);
    }
}

/* The body of a tile function of NR rows x 4 keys (its parameters: qp, qrow, D, NR, kr, q4, s, ss,
 * nk). Per block: the 4 keys' codes kv[j] = CODES(p) (p: key j's codes after the block scale) and
 * their scales; per row: t = SUMS(kv, row, b), the 4 keys' int32 sums [k0..k3 | k0..k3] over the
 * block's half-blocks, added as float(t) * dk * dq. */
#define PKV__I8_TILE_BODY(CODES, SUMS)                                                                       \
    const uint32_t nb = D / 32;                                                                              \
    const size_t bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);                                \
    __m256 acc[4];                                                                                           \
    for (uint32_t r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();                                          \
    for (uint32_t b = 0; b < nb; b++) {                                                                      \
        const size_t o = b * bsz;                                                                            \
        __m256i kv[4];                                                                                       \
        for (int j = 0; j < 4; j++) kv[j] = CODES(kr[j] + o + 2);                                            \
        const __m256 dk = pkv__dk4(kr, o);                                                                   \
        for (uint32_t r = 0; r < NR; r++) {                                                                  \
            const uint8_t *row = qp + r * qrow;                                                              \
            const __m256i t = SUMS(kv, row, b);                                                              \
            const __m256 sc = _mm256_mul_ps(dk, _mm256_loadu_ps((const float *)(row + 2 * (size_t)D + 32 * b))); \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, acc[r]);                                     \
        }                                                                                                    \
    }                                                                                                        \
    pkv__i8_store_tile(acc, NR, s, ss, nk)

/* Defines score_i8(qp, n_rows, k, krb, n_keys, D, s, ss, pf, q4), the score walk of a q8_0 /
 * q4_0 (q4 true) block over a tile: 4-key tiles, rows in groups of up to 4, one prefetch share
 * per tile, head_dim 128 an instance of its own (constant trip counts). CALL(N) runs the tile of
 * N rows (a constant) with q, qrow, D, kr, q4, sr, ss and nk in scope. */
#define PKV__ATTN_DEF_I8_SCORE_WALK(CALL)                                                                         \
    static inline __attribute__((always_inline)) void score_i8_d(const void *qp, uint32_t n_rows,            \
                                                                 const uint8_t *k, size_t krb,               \
                                                                 uint32_t n_keys, uint32_t D, float *s,      \
                                                                 uint32_t ss, pkv__attn_pf *pf,              \
                                                                 const bool q4) {                            \
        const size_t qrow = PKV__ATTN_QROW_BYTES(D);                                                         \
        pkv__attn_pf_start(pf, ((n_keys + 3) / 4) * ((n_rows + 3) / 4));                                     \
        for (uint32_t t0 = 0; t0 < n_keys; t0 += 4) {                                                        \
            const uint32_t nk = PKV_MIN(4u, n_keys - t0);                                                    \
            const uint8_t *kr[4];                                                                            \
            for (uint32_t j = 0; j < 4; j++) kr[j] = k + (size_t)(t0 + (j < nk ? j : nk - 1)) * krb;         \
            for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {                                                    \
                const uint32_t nr = PKV_MIN(4u, n_rows - r0);                                                \
                const uint8_t *q = (const uint8_t *)qp + r0 * qrow;                                          \
                float *sr = s + (size_t)r0 * ss + t0;                                                        \
                PKV__ATTN_NR_SWITCH(nr, CALL)                                                                \
                pkv__attn_pf_step(pf);                                                                       \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    static inline __attribute__((always_inline)) void score_i8(const void *qp, uint32_t n_rows,              \
                                                               const uint8_t *k, size_t krb, uint32_t n_keys, \
                                                               uint32_t D, float *s, uint32_t ss,            \
                                                               pkv__attn_pf *pf, const bool q4) {            \
        if (D == 128)                                                                                        \
            score_i8_d(qp, n_rows, k, krb, n_keys, 128, s, ss, pf, q4);                                      \
        else                                                                                                 \
            score_i8_d(qp, n_rows, k, krb, n_keys, D, s, ss, pf, q4);                                        \
    }

#endif
