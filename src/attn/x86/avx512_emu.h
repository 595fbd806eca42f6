/* avx512_emu.h: for tests only. Lets attn_avx512.c be compiled for a CPU without AVX-512, so
 * its kernels (tiles, tails, masks, the softmax) run against the reference on any x86 machine
 * with AVX2. SIMDe (Debian's libsimde-dev) gives the 512-bit types and most intrinsics, each as
 * a pair of 256-bit AVX2 operations; the eight the packaged SIMDe lacks are written below the
 * same way, and one it has without its native alias (shuffle_f32x4) is aliased by hand. CMake
 * compiles this variant (PKV_AVX512_EMU) into objects of test_attn and test_quant_attn only, as
 * the backends "avx512-emu" and "avx512-vnni-emu"; it never goes into libpkv. It checks the
 * kernels' logic, not what the compiler makes of the real 512-bit instructions. */
#ifndef PKV_AVX512_EMU_H
#define PKV_AVX512_EMU_H

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

static inline simde__m512 pkv_emu_from2(__m256 lo, __m256 hi) {
    simde__m512_private r;
    r.m256[0] = lo;
    r.m256[1] = hi;
    return simde__m512_from_private(r);
}
static inline __m256 pkv_emu_half(simde__m512 a, int i) { return simde__m512_to_private(a).m256[i]; }

static inline simde__m512 pkv_emu_mm512_cvtph_ps(__m256i h) {
    return pkv_emu_from2(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
static inline simde__m512i pkv_emu_mm512_cvtepu16_epi32(__m256i h) {
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
    r.m256i[1] = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
    return simde__m512i_from_private(r);
}
static inline simde__m512i pkv_emu_mm512_cvtps_epi32(simde__m512 a) {
    simde__m512i_private r;
    r.m256i[0] = _mm256_cvtps_epi32(pkv_emu_half(a, 0));
    r.m256i[1] = _mm256_cvtps_epi32(pkv_emu_half(a, 1));
    return simde__m512i_from_private(r);
}
static inline simde__m512 pkv_emu_mm512_cvtepi32_ps(simde__m512i a) {
    const simde__m512i_private p = simde__m512i_to_private(a);
    return pkv_emu_from2(_mm256_cvtepi32_ps(p.m256i[0]), _mm256_cvtepi32_ps(p.m256i[1]));
}
/* masked-off lanes are 0 and not read (maskload does not fault on them) */
static inline simde__m512 pkv_emu_mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i lo = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(k & 0xff), bits), bits);
    const __m256i hi = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(k >> 8), bits), bits);
    return pkv_emu_from2(_mm256_maskload_ps((const float *)p, lo), _mm256_maskload_ps((const float *)p + 8, hi));
}
/* the reductions fold halves, as the compilers' own versions do */
static inline float pkv_emu_mm512_reduce_add_ps(simde__m512 a) {
    const __m256 y = _mm256_add_ps(pkv_emu_half(a, 0), pkv_emu_half(a, 1));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
static inline float pkv_emu_mm512_reduce_max_ps(simde__m512 a) {
    const __m256 y = _mm256_max_ps(pkv_emu_half(a, 0), pkv_emu_half(a, 1));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* truncating 32 -> 16 bits (vpmovdw): the low halves, masked first so that packus is exact */
static inline __m256i pkv_emu_mm512_cvtepi32_epi16(simde__m512i a) {
    const simde__m512i_private p = simde__m512i_to_private(a);
    const __m256i m = _mm256_set1_epi32(0xffff);
    const __m256i x = _mm256_packus_epi32(_mm256_and_si256(p.m256i[0], m), _mm256_and_si256(p.m256i[1], m));
    return _mm256_permute4x64_epi64(x, 0xD8);
}
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 pkv_emu_mm512_cvtepi32_epi16
#undef _mm512_cvtph_ps
#undef _mm512_maskz_loadu_ps
#undef _mm512_cvtepu16_epi32
#undef _mm512_cvtps_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps pkv_emu_mm512_cvtepi32_ps
#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#undef _mm512_shuffle_f32x4
#define _mm512_cvtph_ps pkv_emu_mm512_cvtph_ps
#define _mm512_maskz_loadu_ps pkv_emu_mm512_maskz_loadu_ps
#define _mm512_cvtepu16_epi32 pkv_emu_mm512_cvtepu16_epi32
#define _mm512_cvtps_epi32 pkv_emu_mm512_cvtps_epi32
#define _mm512_reduce_add_ps pkv_emu_mm512_reduce_add_ps
#define _mm512_reduce_max_ps pkv_emu_mm512_reduce_max_ps
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4

#endif
