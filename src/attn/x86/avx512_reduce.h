/* avx512_reduce.h: horizontal sums and maxima of 512-bit vectors as transpose-add trees, shared by
 * the AVX-512 attention files (attn_avx512.c, attn_q_avx512.c). Include after <immintrin.h>, or,
 * in the emulated test builds, after avx512_emu.h; only from files compiled for AVX-512 (or
 * emulating it). */
#ifndef PKV_ATTN_AVX512_REDUCE_H
#define PKV_ATTN_AVX512_REDUCE_H

/* ---- horizontal sums as transpose-add trees ---------------------------------------------------
 * HSUM4X4(a): lane 4 i + j = the sum of a[i][j]'s 16 lanes (45 shuffles and adds for 16
 * sums, against about 8 each for one _mm512_reduce_add_ps). Level 1 pairs vectors with
 * unpacklo/hi (each 128-bit lane then holds partials of two vectors), level 2 pairs those with
 * 64-bit unpacks (partials of four vectors per 128-bit lane, in order), levels 3 and 4 add the
 * four 128-bit lanes across vectors with shuffle_f32x4. hsum4 / hmax4: levels 1 and 2
 * (HTREE4) for 4 vectors, then the 128-bit lanes folded: the 4 sums / maxima as an __m128. */
#define HPAIR(op, x, y) op(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)) /* lane: x0.x2 y0.y2 x1.x3 y1.y3 */
#define HQUAD(op, x, y) /* lane: four vectors' partials, in order */                                         \
    op(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),                          \
       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))))
static inline __attribute__((always_inline)) __m512 hlanes(__m512 x, __m512 y) { /* x01 x23 y01 y23 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
#define HTREE4(op, a0, a1, a2, a3) HQUAD(op, HPAIR(op, a0, a1), HPAIR(op, a2, a3)) /* levels 1 and 2 */
/* a macro, not a function taking the array: given the array's address, GCC 12 stores all 16
 * accumulators to the stack and loads them back (32 memory operations per tile) */
#define HROW4(a, i) HTREE4(_mm512_add_ps, a[i][0], a[i][1], a[i][2], a[i][3])
#define HSUM4X4(a) hlanes(hlanes(HROW4(a, 0), HROW4(a, 1)), hlanes(HROW4(a, 2), HROW4(a, 3)))
#define DEF_HTREE4(name, op512, op256, op128)                                                                   \
    static inline __attribute__((always_inline)) __m128 name(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {       \
        const __m512 c = HTREE4(op512, a0, a1, a2, a3);                                                         \
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1));                     \
        const __m256 h = op256(_mm512_castps512_ps256(c), hi);                                                  \
        return op128(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));                                   \
    }
/* h's 128-bit lane r (4 sums, as HSUM4X4 leaves row r's) stored at s + r * ss */
static inline __attribute__((always_inline)) void hstore4x4(__m512 h, float *s, uint32_t ss) {
    _mm_storeu_ps(s, _mm512_castps512_ps128(h));
    _mm_storeu_ps(s + ss, _mm512_extractf32x4_ps(h, 1));
    _mm_storeu_ps(s + 2 * (size_t)ss, _mm512_extractf32x4_ps(h, 2));
    _mm_storeu_ps(s + 3 * (size_t)ss, _mm512_extractf32x4_ps(h, 3));
}
DEF_HTREE4(hsum4, _mm512_add_ps, _mm256_add_ps, _mm_add_ps)
DEF_HTREE4(hmax4, _mm512_max_ps, _mm256_max_ps, _mm_max_ps)

#endif
