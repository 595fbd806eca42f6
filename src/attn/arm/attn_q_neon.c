/* attn_q_neon.c: AArch64 NEON primitives of paged attention for q8_0 and q4_0 K/V, read
 * straight from the pool rows (quant.h layouts, decoded in registers). Same arithmetic as the
 * scalar reference (attn_q_ref.c): per 32-value block an exact integer dot product of the
 * int8 query (pkv__attn_prep_q8) with the codes, then acc += dq * dk * isum. Baseline NEON
 * (the score driver is q_neon_score.h; attn_q_dotprod.c runs it on SDOT where the CPU has the
 * dot-product extension): 8x8-bit products widened to 16 bits and pairwise-added to 32. fp8 e4m3 K/V: codes widened to f16 bit patterns and converted (exact), f32 FMAs with the
 * row scale applied once. Compiled only on ARM; test_quant_attn compares it with the reference
 * there (under qemu-user in CI). */
#include "../attn.h"
#include "../attn_q.h"
#include "../../quant/quant.h"

#include <arm_neon.h>
#include <string.h>

/* sum_j q[j] * (c0 | c1)[j] over 32 values, exact: |q| <= 127 and |code| <= 128, so two
 * products fit int16 (32512 at most) before the pairwise widening add. */
static inline __attribute__((always_inline)) int32_t dot32(const int8_t *q, int8x16_t c0, int8x16_t c1) {
    const int8x16_t q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
    int16x8_t p0 = vmull_s8(vget_low_s8(q0), vget_low_s8(c0));
    p0 = vmlal_s8(p0, vget_high_s8(q0), vget_high_s8(c0));
    int16x8_t p1 = vmull_s8(vget_low_s8(q1), vget_low_s8(c1));
    p1 = vmlal_s8(p1, vget_high_s8(q1), vget_high_s8(c1));
    return vaddvq_s32(vpadalq_s16(vpaddlq_s16(p0), p1));
}

#include "q_neon_score.h"

/* ---- accum: tiles of up to 4 rows x 16 values (16 accumulators) across the block's keys ----- */

/* 16 int8 codes -> 4 x float32x4 */
static inline __attribute__((always_inline)) void widen16(int8x16_t c, float32x4_t x[4]) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(c)), hi = vmovl_s8(vget_high_s8(c));
    x[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    x[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    x[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    x[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
}

/* acc[i][16 h .. 16 h + 15 of block b] += p[i][t] * dv(t, b) * code, h = half of the block */
static inline __attribute__((always_inline)) void accum_tile(const float *p, uint32_t ps, const uint32_t NR,
                                                             const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                             uint32_t D, uint32_t b, const uint32_t h, float *acc,
                                                             const bool q4) {
    const size_t bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);
    float *a0 = acc + 32 * b + 16 * h;
    float32x4_t a[4][4];
    for (uint32_t i = 0; i < NR; i++)
        for (uint32_t c = 0; c < 4; c++) a[i][c] = vld1q_f32(a0 + i * (size_t)D + 4 * c);
    for (uint32_t t = 0; t < n_keys; t++) {
        const uint8_t *blk = v + t * vrb + b * bsz;
        float32x4_t x[4];
        widen16(codes16(blk, q4, h), x); /* only the half this tile needs */
        const float dv = blk_scale(blk);
        for (uint32_t i = 0; i < NR; i++) {
            const float w = p[i * ps + t] * dv;
            for (uint32_t c = 0; c < 4; c++) a[i][c] = vfmaq_n_f32(a[i][c], x[c], w);
        }
    }
    for (uint32_t i = 0; i < NR; i++)
        for (uint32_t c = 0; c < 4; c++) vst1q_f32(a0 + i * (size_t)D + 4 * c, a[i][c]);
}

static inline __attribute__((always_inline)) void accum_i8(const float *p, uint32_t ps, uint32_t n_rows,
                                                           const uint8_t *v, size_t vrb, uint32_t n_keys, uint32_t D,
                                                           float *acc, const bool q4) {
    const uint32_t nb = D / 32;
    for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
        const uint32_t nr = PKV_MIN(4u, n_rows - r0);
        const float *pr = p + (size_t)r0 * ps;
        float *ar = acc + (size_t)r0 * D;
        for (uint32_t b = 0; b < nb; b++) {
#define CALL_V(N) (accum_tile(pr, ps, N, v, vrb, n_keys, D, b, 0, ar, q4), accum_tile(pr, ps, N, v, vrb, n_keys, D, b, 1, ar, q4))
            PKV__ATTN_NR_SWITCH(nr, CALL_V)
#undef CALL_V
        }
    }
}

PKV__ATTN_DEF_I8_ENTRIES(score_i8, accum_i8, false, true)

/* ---- fp8 e4m3 ------------------------------------------------------------------------------ */

/* 8 e4m3 codes -> f32 times 2^-8, exactly: each code's bits placed in an f16 (sign at bit 15,
 * the 4 exponent bits at 10-13, the 3 mantissa bits at 7-9); the f16's exponent bias (15
 * against e4m3's 7) scales every value, subnormals included, by 2^-8. The encoder never
 * writes the NaN codes. */
static inline __attribute__((always_inline)) void e4m3x8(const uint8_t *p, float32x4_t x[2]) {
    const int16x8_t w = vandq_s16(vshlq_n_s16(vmovl_s8(vld1_s8((const int8_t *)p)), 7), vdupq_n_s16((int16_t)0xbf80));
    const float16x8_t h = vreinterpretq_f16_s16(w);
    x[0] = vcvt_f32_f16(vget_low_f16(h));
    x[1] = vcvt_high_f32_f16(h);
}

/* s[i * ss] = sk * <q_i, key> for NR <= 4 rows (q: the prepared f32 rows), one key */
static inline __attribute__((always_inline)) void score_fp8_key(const float *const q[4], const uint32_t NR,
                                                                const uint8_t *kr, uint32_t D, float *s,
                                                                uint32_t ss) {
    const uint8_t *e = kr + PKV_FP8_ROW_HEADER;
    float32x4_t a[4][2];
    for (uint32_t i = 0; i < NR; i++) a[i][0] = a[i][1] = vdupq_n_f32(0.0f);
    uint32_t d = 0;
    for (; d + 8 <= D; d += 8) {
        float32x4_t x[2];
        e4m3x8(e + d, x);
        for (uint32_t i = 0; i < NR; i++) {
            a[i][0] = vfmaq_f32(a[i][0], vld1q_f32(q[i] + d), x[0]);
            a[i][1] = vfmaq_f32(a[i][1], vld1q_f32(q[i] + d + 4), x[1]);
        }
    }
    float sk;
    memcpy(&sk, kr, 4);
    sk *= 256.0f; /* exact: undoes the decode's 2^-8 */
    for (uint32_t i = 0; i < NR; i++) {
        float o = vaddvq_f32(vaddq_f32(a[i][0], a[i][1]));
        for (uint32_t j = d; j < D; j++) o += q[i][j] * (pkv__e4m3_to_f32(e[j]) * (1.0f / 256.0f)); /* D % 8 */
        s[i * ss] = o * sk;
    }
}

static void score_fp8(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                      float *s, uint32_t ss, pkv__attn_pf *pf) {
    const size_t qs = PKV__ATTN_QROW_BYTES(D) / sizeof(float);
    pkv__attn_pf_start(pf, n_keys);
    for (uint32_t t = 0; t < n_keys; t++) {
        pkv__attn_pf_step(pf);
        for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
            const uint32_t nr = PKV_MIN(4u, n_rows - r0);
            const float *q[4];
            for (uint32_t i = 0; i < 4; i++) q[i] = (const float *)qp + (r0 + (i < nr ? i : 0)) * qs;
            float *sr = s + (size_t)r0 * ss + t;
#define CALL_F8S(N) score_fp8_key(q, N, k + t * krb, D, sr, ss)
            PKV__ATTN_NR_SWITCH(nr, CALL_F8S)
#undef CALL_F8S
        }
    }
}

/* acc[i][d0 .. d0 + 8 C) += p[i][t] * sv(t) * e4m3 over the keys, NR <= 4 rows, C <= 2 groups of 8 */
static inline __attribute__((always_inline)) void accum_fp8_tile(const float *p, uint32_t ps, const uint32_t NR,
                                                                 const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                                 uint32_t D, uint32_t d0, const uint32_t C,
                                                                 float *acc) {
    float32x4_t a[4][4];
    for (uint32_t i = 0; i < NR; i++)
        for (uint32_t c = 0; c < 2 * C; c++) a[i][c] = vld1q_f32(acc + i * (size_t)D + d0 + 4 * c);
    for (uint32_t t = 0; t < n_keys; t++) {
        const uint8_t *vr = v + t * vrb;
        float sv;
        memcpy(&sv, vr, 4);
        sv *= 256.0f; /* exact: undoes the decode's 2^-8 */
        float32x4_t x[4];
        for (uint32_t c = 0; c < C; c++) e4m3x8(vr + PKV_FP8_ROW_HEADER + d0 + 8 * c, x + 2 * c);
        for (uint32_t i = 0; i < NR; i++) {
            const float w = p[i * ps + t] * sv;
            for (uint32_t c = 0; c < 2 * C; c++) a[i][c] = vfmaq_n_f32(a[i][c], x[c], w);
        }
    }
    for (uint32_t i = 0; i < NR; i++)
        for (uint32_t c = 0; c < 2 * C; c++) vst1q_f32(acc + i * (size_t)D + d0 + 4 * c, a[i][c]);
}

static inline __attribute__((always_inline)) void accum_fp8_rows(const float *p, uint32_t ps, const uint32_t NR,
                                                                 const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                                 uint32_t D, float *acc) {
    uint32_t d = 0;
    for (; d + 16 <= D; d += 16) accum_fp8_tile(p, ps, NR, v, vrb, n_keys, D, d, 2, acc);
    if (d + 8 <= D) accum_fp8_tile(p, ps, NR, v, vrb, n_keys, D, d, 1, acc), d += 8;
    for (; d < D; d++) /* head_dim % 8 */
        for (uint32_t t = 0; t < n_keys; t++) {
            float sv;
            memcpy(&sv, v + t * vrb, 4);
            const float x = pkv__e4m3_to_f32(v[t * vrb + PKV_FP8_ROW_HEADER + d]);
            for (uint32_t i = 0; i < NR; i++) acc[i * (size_t)D + d] += p[i * ps + t] * sv * x;
        }
}

static void accum_fp8(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                      uint32_t D, float *acc, pkv__attn_pf *pf) {
    (void)pf; /* accum_pf off: the driver gives score both runs */
    for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
        const uint32_t nr = PKV_MIN(4u, n_rows - r0);
        const float *pr = p + (size_t)r0 * ps;
        float *ar = acc + (size_t)r0 * D;
#define CALL_F8V(N) accum_fp8_rows(pr, ps, N, v, vrb, n_keys, D, ar)
        PKV__ATTN_NR_SWITCH(nr, CALL_F8V)
#undef CALL_F8V
    }
}

void pkv__attn_fill_q_neon(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_Q8_0] = pkv__attn_prep_q8;
    kt->prep_q[PKV_DTYPE_Q4_0] = pkv__attn_prep_q8;
    kt->score[PKV_DTYPE_Q8_0] = score_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_q4_0;
    kt->accum[PKV_DTYPE_Q8_0] = accum_q8_0;
    kt->accum[PKV_DTYPE_Q4_0] = accum_q4_0;
    kt->prep_q[PKV_DTYPE_FP8_E4M3] = pkv__attn_prep_f32;
    kt->score[PKV_DTYPE_FP8_E4M3] = score_fp8;
    kt->accum[PKV_DTYPE_FP8_E4M3] = accum_fp8;
    kt->accum_pf[PKV_DTYPE_Q8_0] = kt->accum_pf[PKV_DTYPE_Q4_0] = kt->accum_pf[PKV_DTYPE_FP8_E4M3] = false;
}
