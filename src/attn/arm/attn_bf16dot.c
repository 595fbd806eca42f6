/* attn_bf16dot.c: the NEON table of calls with PKV_ATTN_BF16_DOT (attn.h: lp_fill) on CPUs with
 * the Armv8.6 bf16 extension (FEAT_BF16: Neoverse V1 / V2 / N2, Graviton 3 and 4, Apple M2 and
 * later; Linux AT_HWCAP2 bit BF16, pkv__cpu_features' PKV_CPU_ARM_BF16). BFDOT (vbfdotq_f32)
 * adds two bf16 products into each of 4 f32 lanes: 8 products an instruction, twice an f32 FMA's.
 * The same contract as the x86 kernels of that table (pkv.h): for bf16 K the queries times scale
 * are rounded to bf16 (nearest, ties to even: BFCVT under the default FPCR), zeros up to a
 * multiple of 8, and a score is a sum of BFDOTs; for bf16 V each row's weights are rounded to
 * bf16 in pairs of keys, each pair of V rows zipped into pairs of one column (ZIP1 / ZIP2: the
 * columns stay in their natural order, as NEON's acc is), and the columns past the last group of
 * 8 take the f32 weights. BFDOT counts subnormal bf16 values as 0 (without FEAT_EBF16), as
 * vdpbf16ps does. NEON's accum does not prefetch (accum_pf off): score issues both runs, one
 * share a tile. Compiled only on ARM, with +bf16 (CMake: *_bf16dot.c); run under qemu-user by
 * scripts/test-arm64.sh (its CPU has the extension), where test_attn's test_bf16_dot compares it
 * with the reference. Its speed is unmeasured (no ARM machine here). */
#include "../attn.h"
#include "../../quant/quant.h"

#include <arm_neon.h>
#include <string.h>

static inline bfloat16x8_t as_bf(uint16x8_t x) { return vreinterpretq_bf16_u16(x); }

/* 8 f32 rounded to bf16 (BFCVTN, BFCVTN2) as 8 16-bit values */
static inline uint16x8_t round8(float32x4_t lo, float32x4_t hi) {
    return vreinterpretq_u16_bf16(vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(lo), hi));
}

/* q times scale rounded to bf16, head_dim values a row, zeros up to a multiple of 8 */
static void prep_bf16dot(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    for (uint32_t r = 0; r < n_rows; r++) {
        uint16_t *dst = (uint16_t *)((uint8_t *)qp + r * qrow);
        const float *src = q + r * q_stride;
        uint32_t d = 0;
        for (; d + 8 <= head_dim; d += 8)
            vst1q_u16(dst + d, round8(vmulq_n_f32(vld1q_f32(src + d), scale), vmulq_n_f32(vld1q_f32(src + d + 4), scale)));
        if (d < head_dim) {
            float t[8] = {0};
            for (uint32_t i = 0; d + i < head_dim; i++) t[i] = src[d + i];
            vst1q_u16(dst + d, round8(vmulq_n_f32(vld1q_f32(t), scale), vmulq_n_f32(vld1q_f32(t + 4), scale)));
        }
    }
}

/* values [d, d + 8) of a bf16 row: whole where they lie within head_dim, else those that do and zeros */
static inline uint16x8_t ld8(const uint8_t *row, uint32_t d, uint32_t D) {
    if (d + 8 <= D) return vld1q_u16((const uint16_t *)row + d);
    uint16_t t[8] = {0};
    memcpy(t, (const uint16_t *)row + d, 2 * (size_t)(D - d));
    return vld1q_u16(t);
}

/* A tile of R rows x K keys (up to 4 x 4: 16 accumulators), 8 values a step; the queries' zeros
 * past head_dim meet the K row's zeros in the last step. */
static inline __attribute__((always_inline)) void score_tile_bd(const uint8_t *q, size_t qrow, const uint8_t *k,
                                                                size_t krb, const uint32_t R, const uint32_t K,
                                                                uint32_t D, float *s, uint32_t ss) {
    float32x4_t acc[4][4];
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t t = 0; t < K; t++) acc[r][t] = vdupq_n_f32(0.0f);
    for (uint32_t d = 0; d < D; d += 8) {
        bfloat16x8_t kk[4];
        for (uint32_t t = 0; t < K; t++) kk[t] = as_bf(ld8(k + t * krb, d, D));
        for (uint32_t r = 0; r < R; r++) {
            const bfloat16x8_t x = as_bf(vld1q_u16((const uint16_t *)(q + r * qrow) + d));
            for (uint32_t t = 0; t < K; t++) acc[r][t] = vbfdotq_f32(acc[r][t], x, kk[t]);
        }
    }
    if (K == 4) { /* pairwise adds: lane t of row r's vector is key t's sum */
        for (uint32_t r = 0; r < R; r++)
            vst1q_f32(s + r * ss, vpaddq_f32(vpaddq_f32(acc[r][0], acc[r][1]), vpaddq_f32(acc[r][2], acc[r][3])));
        return;
    }
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t t = 0; t < K; t++) s[r * ss + t] = vaddvq_f32(acc[r][t]);
}

static inline __attribute__((always_inline)) void score_bd_all(const void *qp, uint32_t n_rows, const uint8_t *k,
                                                               size_t krb, uint32_t n_keys, uint32_t D, float *s,
                                                               uint32_t ss, pkv__attn_pf *pf) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const uint8_t *q = qp;
    pkv__attn_pf_start(pf, (n_keys + 3) / 4 * ((n_rows + 3) / 4)); /* a share a tile */
    for (uint32_t r = 0; r < n_rows; r += 4) {
        const uint32_t R = n_rows - r < 4 ? n_rows - r : 4;
        const uint8_t *qr = q + r * qrow;
        float *sr = s + (size_t)r * ss;
        uint32_t t = 0;
        if (R == 4) /* constant row and key counts, so that the tile's loops unroll */
            for (; t + 4 <= n_keys; t += 4) {
                score_tile_bd(qr, qrow, k + t * krb, krb, 4, 4, D, sr + t, ss);
                pkv__attn_pf_step(pf);
            }
        for (; t < n_keys; t += 4) {
            score_tile_bd(qr, qrow, k + t * krb, krb, R, n_keys - t < 4 ? n_keys - t : 4, D, sr + t, ss);
            pkv__attn_pf_step(pf);
        }
    }
    pkv__attn_pf_finish(pf);
}

static void score_bf16dot(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                          float *s, uint32_t ss, pkv__attn_pf *pf) {
    if (D == 128) /* the common head_dim, with constant trip counts */
        score_bd_all(qp, n_rows, k, krb, n_keys, 128, s, ss, pf);
    else
        score_bd_all(qp, n_rows, k, krb, n_keys, D, s, ss, pf);
}

/* p.V for R rows (up to 4) and C groups of 8 columns (up to 2: 4 rows x 4 vectors of 4 columns,
 * 16 accumulators) at acc, over nk keys of V at v: pb[r * 8 + j] is row r's weights of keys 2 j
 * and 2 j + 1 as a bf16 pair (the low half key 2 j's, as ZIP1 puts row 2 j's value below row
 * 2 j + 1's in each 32-bit lane). An odd last key pairs with a row of zeros. */
static inline __attribute__((always_inline)) void accum_tile_bd(const uint32_t *pb, const uint32_t R,
                                                                const uint8_t *v, size_t vrb, uint32_t nk,
                                                                const uint32_t C, float *acc, uint32_t D) {
    float32x4_t a[4][4];
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t c = 0; c < 2 * C; c++) a[r][c] = vld1q_f32(acc + r * D + 4 * c);
    for (uint32_t j = 0; 2 * j < nk; j++) {
        const uint16_t *va = (const uint16_t *)(v + 2 * j * vrb), *vb = (const uint16_t *)(v + (2 * j + 1) * vrb);
        const bool two = 2 * j + 1 < nk;
        bfloat16x8_t x[4];
        for (uint32_t g = 0; g < C; g++) {
            const uint16x8_t A = vld1q_u16(va + 8 * g), B = two ? vld1q_u16(vb + 8 * g) : vdupq_n_u16(0);
            x[2 * g] = as_bf(vzip1q_u16(A, B)), x[2 * g + 1] = as_bf(vzip2q_u16(A, B));
        }
        for (uint32_t r = 0; r < R; r++) {
            const bfloat16x8_t w = vreinterpretq_bf16_u32(vdupq_n_u32(pb[r * 8 + j]));
            for (uint32_t c = 0; c < 2 * C; c++) a[r][c] = vbfdotq_f32(a[r][c], w, x[c]);
        }
    }
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t c = 0; c < 2 * C; c++) vst1q_f32(acc + r * D + 4 * c, a[r][c]);
}

/* The columns [0, D8) in tiles of 16, then one of 8 */
static inline __attribute__((always_inline)) void accum_groups_bd(const uint32_t *pb, const uint32_t R,
                                                                  const uint8_t *vk, size_t vrb, uint32_t nk,
                                                                  uint32_t D8, float *ar, uint32_t D) {
    uint32_t d = 0;
    for (; d + 16 <= D8; d += 16) accum_tile_bd(pb, R, vk + 2 * d, vrb, nk, 2, ar + d, D);
    if (d < D8) accum_tile_bd(pb, R, vk + 2 * d, vrb, nk, 1, ar + d, D);
}

static inline __attribute__((always_inline)) void accum_bd_all(const float *p, uint32_t ps, uint32_t n_rows,
                                                               const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                               uint32_t D, float *acc) {
    const uint32_t D8 = D & ~7u;
    for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
        const uint32_t R = n_rows - r0 < 4 ? n_rows - r0 : 4;
        float *ar = acc + (size_t)r0 * D;
        for (uint32_t k0 = 0; k0 < n_keys; k0 += 16) { /* keys 16 at a time: 8 pairs of weights a row */
            const uint32_t nk = n_keys - k0 < 16 ? n_keys - k0 : 16;
            uint32_t pb[4 * 8];
            for (uint32_t r = 0; r < R; r++) {
                float w[16] = {0};
                memcpy(w, p + (size_t)(r0 + r) * ps + k0, sizeof(float) * nk);
                vst1q_u32(pb + r * 8, vreinterpretq_u32_u16(round8(vld1q_f32(w), vld1q_f32(w + 4))));
                vst1q_u32(pb + r * 8 + 4, vreinterpretq_u32_u16(round8(vld1q_f32(w + 8), vld1q_f32(w + 12))));
            }
            const uint8_t *vk = v + k0 * vrb;
            if (R == 4) /* a constant row count, so that the tile's loops unroll */
                accum_groups_bd(pb, 4, vk, vrb, nk, D8, ar, D);
            else
                accum_groups_bd(pb, R, vk, vrb, nk, D8, ar, D);
            for (uint32_t r = 0; r < R && D8 < D; r++) /* the columns past the last group of 8: f32 weights */
                for (uint32_t t = 0; t < nk; t++) {
                    const float wt = p[(size_t)(r0 + r) * ps + k0 + t];
                    const uint16_t *vr = (const uint16_t *)(vk + t * vrb);
                    for (uint32_t e = D8; e < D; e++) ar[(size_t)r * D + e] += wt * pkv__bf16_to_f32(vr[e]);
                }
        }
    }
}

static void accum_bf16dot(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,
                          uint32_t n_keys, uint32_t D, float *acc, pkv__attn_pf *pf) {
    (void)pf; /* accum_pf is off on NEON: the driver gives score both runs */
    if (D == 128) /* the common head_dim, with constant trip counts */
        accum_bd_all(p, ps, n_rows, v, vrb, n_keys, 128, acc);
    else
        accum_bd_all(p, ps, n_rows, v, vrb, n_keys, D, acc);
}

void pkv__attn_lp_fill_neon_bf16(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_BF16] = prep_bf16dot;
    kt->score[PKV_DTYPE_BF16] = score_bf16dot;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16dot;
}
