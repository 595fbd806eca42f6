/* attn_q_vnni.c: the q8_0 and q4_0 score (q.K) with AVX-512 VNNI's vpdpbusd, the backend
 * "avx512-vnni" (the avx512 table with these entries over it). Same integers as attn_q_ref.c:
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
#define PKV__VNNI_NAME "avx512-vnni-emu"
#else
#include <immintrin.h>
#define PKV__VNNI_FILL pkv__attn_fill_q_vnni
#define PKV__VNNI_NAME "avx512-vnni"
#endif
#include "i8_x86.h"

#include <stdbool.h>

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
    return pkv__sum4x4_epi32(_mm256_dpbusd_epi32(c, kv[0], qv), _mm256_dpbusd_epi32(c, kv[1], qv),
                             _mm256_dpbusd_epi32(c, kv[2], qv), _mm256_dpbusd_epi32(c, kv[3], qv));
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
