/* q_neon_score.h: the q8_0 / q4_0 score kernel of the NEON backends, written once over the
 * int8 dot product of 32 values. A template by #include: the including file defines
 *   dot32(q, c0, c1)   sum_j q[j] * (c0 | c1)[j] over 32 int8 values, exact, as int32_t
 * (attn_q_neon.c: baseline NEON, widening multiplies; attn_q_dotprod.c: SDOT), then includes
 * this file, which defines codes16, blk_scale and score_i8. */

/* Codes h * 16 .. h * 16 + 15 of a q8_0 / q4_0 block as int8 in value order: q8_0 as stored;
 * q4_0 nibble n - 8, value j in the low nibble of byte j (j < 16), value j + 16 in its high
 * nibble. */
static inline __attribute__((always_inline)) int8x16_t codes16(const uint8_t *blk, const bool q4, const uint32_t h) {
    if (!q4) return vld1q_s8((const int8_t *)(blk + 2 + 16 * h));
    const uint8x16_t x = vld1q_u8(blk + 2);
    const uint8x16_t n = h ? vshrq_n_u8(x, 4) : vandq_u8(x, vdupq_n_u8(15));
    return vsubq_s8(vreinterpretq_s8_u8(n), vdupq_n_s8(8));
}

static inline float blk_scale(const uint8_t *blk) {
    uint16_t d;
    memcpy(&d, blk, 2);
    return pkv__f16_to_f32(d);
}

/* ---- score: per key, each K block decoded once for a group of up to 4 query rows ---------- */
static inline __attribute__((always_inline)) void score_i8(const void *qp, uint32_t n_rows, const uint8_t *k,
                                                           size_t krb, uint32_t n_keys, uint32_t D, float *s,
                                                           uint32_t ss, pkv__attn_pf *pf, const bool q4) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D), bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);
    const uint32_t nb = D / 32;
    pkv__attn_pf_start(pf, n_keys);
    for (uint32_t t = 0; t < n_keys; t++) {
        pkv__attn_pf_step(pf);
        const uint8_t *kr = k + t * krb;
        for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
            const uint32_t nr = PKV_MIN(4u, n_rows - r0);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (uint32_t b = 0; b < nb; b++) {
                const int8x16_t c0 = codes16(kr + b * bsz, q4, 0), c1 = codes16(kr + b * bsz, q4, 1);
                const float dk = blk_scale(kr + b * bsz);
                for (uint32_t i = 0; i < nr; i++) {
                    const uint8_t *row = (const uint8_t *)qp + (r0 + i) * qrow;
                    const float *dq = (const float *)(row + 2 * (size_t)D);
                    acc[i] += dq[b] * dk * (float)dot32((const int8_t *)row + 32 * b, c0, c1);
                }
            }
            for (uint32_t i = 0; i < nr; i++) s[(r0 + i) * ss + t] = acc[i];
        }
    }
}

