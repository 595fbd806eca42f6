/* avx2_reduce.h: horizontal sums shared by the x86 attention files (include only from files
 * compiled with -mavx2, i.e. named *_avx2.c or *_avx512.c). */
#ifndef PKV_ATTN_AVX2_REDUCE_H
#define PKV_ATTN_AVX2_REDUCE_H

#include <immintrin.h>

/* the sum of the 8 lanes of v */
static inline __attribute__((always_inline)) float pkv__hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lane i = the sum of the 8 lanes of a_i */
static inline __attribute__((always_inline)) __m128 pkv__hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

#endif
