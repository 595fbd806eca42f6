/* bf16_x86.h: the bf16 pieces shared by attn_avx512.c (vdpbf16ps) and attn_amx.c (AMX tiles):
 * f32 values rounded to bf16 as PKV_ATTN_BF16_DOT rounds queries and weights, and two V rows
 * interleaved into pairs of one column. Include after the AVX-512 intrinsics (immintrin.h, or
 * avx512_emu.h in the emulated build). */
#ifndef PKV_ATTN_BF16_X86_H
#define PKV_ATTN_BF16_X86_H

/* 16 floats rounded to bf16 (nearest, ties to even): the high halves of u + 0x7fff + (bit 16 of
 * u), each in the low half of its 32-bit lane (NaN does not occur: the queries are finite, the
 * weights in [0, e^8]). */
static inline __attribute__((always_inline)) __m512i bf16_round_lo(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

/* The same as 16 words. */
static inline __attribute__((always_inline)) __m256i bf16_round16(__m512 x) {
    return _mm512_cvtepi32_epi16(bf16_round_lo(x));
}

/* A 32-column group of two V rows (keys 2 j and 2 j + 1) as pairs of one column: the even columns
 * from the low halves of both rows' 32-bit lanes, the odd ones from the high halves. */
static inline __attribute__((always_inline)) void v_pairs(__m512i A, __m512i B, __m512i *even, __m512i *odd) {
    const __mmask32 hi = 0xAAAAAAAAu;
    *even = _mm512_mask_blend_epi16(hi, A, _mm512_slli_epi32(B, 16));
    *odd = _mm512_mask_blend_epi16(hi, _mm512_srli_epi32(A, 16), B);
}

#endif
