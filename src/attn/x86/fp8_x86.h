/* fp8_x86.h: the fp8 e4m3 pieces shared by the x86 attention files (attn_q_avx2.c,
 * attn_q_avx512.c, and attn_avx2.c / attn_avx512.c for the transposed primitives' widening;
 * include only from files compiled with -mavx2 -mf16c). */
#ifndef PKV_ATTN_FP8_X86_H
#define PKV_ATTN_FP8_X86_H

#include "../../quant/quant.h"

#include <immintrin.h>

/* Keys per V pass: the rows' weights of a pass, w[r * PKV__VKEYS + t], live on the stack. */
#define PKV__VKEYS 16u

/* 16 codes -> 16 f16 equal to e4m3(b) * 2^-8 exactly: the byte sign-extended to 16 bits and
 * shifted left by 7 has the sign at bits 15 and 14 (14 cleared by the mask) and the magnitude
 * at bits 13..7: an f16 with the e4m3 exponent rebiased by 8, subnormals included, which F16C
 * widens exactly. The encoder never writes the NaN codes. */
static inline __attribute__((always_inline)) __m256i pkv__e4m3_f16x16(const uint8_t *p) {
    const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm256_and_si256(w, _mm256_set1_epi16((short)0xbf80));
}

/* 8 codes -> 8 floats equal to e4m3(b) * 2^-8 (the same decode, 8 at a time) */
static inline __attribute__((always_inline)) __m256 pkv__e4m3_f32x8(const uint8_t *p) {
    const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xbf80)));
}

/* The V columns [d, D) the vector tiles left (head_dim not a multiple of their width), scalar:
 * acc[r][c] += w[r][t] * e4m3(code) for nk keys of codes at e + t * vrb; w carries the 2^8 the
 * vector decode takes off, so w / 256 is exactly p times the row scale. */
static inline void pkv__fp8_accum_tail(const float *w, uint32_t nk, const uint8_t *e, size_t vrb, uint32_t d,
                                       uint32_t D, uint32_t NR, float *acc) {
    for (; d < D; d++)
        for (uint32_t t = 0; t < nk; t++) {
            const float x = pkv__e4m3_to_f32(e[t * vrb + d]) * (1.0f / 256.0f);
            for (uint32_t r = 0; r < NR; r++) acc[r * (size_t)D + d] += w[r * PKV__VKEYS + t] * x;
        }
}

#endif
