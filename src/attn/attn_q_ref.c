/* attn_q_ref.c: scalar reference attention primitives for quantized K/V (q8_0, q4_0, fp8
 * e4m3), read straight from the pool rows (quant.h layouts, dequantized in registers). They
 * define the arithmetic the SIMD variants (x86/attn_q_avx2.c) reproduce up to float
 * summation order: for q8_0 / q4_0 K the query is quantized per 32 values to int8 (as ggml
 * does for q8_0 / q4_0 dot products) and each block's dot product is an exact integer. */
#include "attn.h"
#include "attn_q.h"
#include "../quant/quant.h"

#include <math.h>

/* ---- prepared query for integer K (q8_0, q4_0) ----------------------------------------------
 * Row layout (within PKV__ATTN_QROW_BYTES(D) = 4 D rounded to 64, so it always fits):
 *   int8 q[D] | uint8 |q|[D] | f32 dq[D / 32]
 * Per 32 values: dq = amax / 127 (f32, never stored in the pool, so no f16 rounding),
 * q = rne(x / dq) in [-127, 127], x = scale * query. |q| serves the AVX2 sign trick. */
void pkv__attn_prep_q8(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    const uint32_t nb = head_dim / 32;
    for (uint32_t r = 0; r < n_rows; r++) {
        uint8_t *dst = (uint8_t *)qp + r * qrow;
        int8_t *qs = (int8_t *)dst;
        uint8_t *qa = dst + head_dim;
        float *dq = (float *)(dst + 2 * (size_t)head_dim);
        const float *src = q + r * q_stride;
        for (uint32_t b = 0; b < nb; b++) {
            float x[32], amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                x[j] = src[32 * b + j] * scale;
                const float a = fabsf(x[j]);
                amax = a > amax ? a : amax; /* plain compares: fmaxf is a libm call here */
            }
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            dq[b] = d;
            for (int j = 0; j < 32; j++) {
                /* |x * id| <= 127 (+ rounding): round half to even by the 1.5 * 2^23 trick,
                   exact for |v| < 2^22, then clamp the rounding overshoot. The product and
                   the sum are each stored in a float: where float math carries excess
                   precision (x87, FLT_EVAL_METHOD 2) the sum would otherwise keep the
                   product's fraction and the (int8_t) below would truncate instead of round,
                   and an unrounded product could round to another integer than the SIMD
                   kernels' float product (stop 67) */
                const float xq = x[j] * id, big = xq + 12582912.0f;
                float v = big - 12582912.0f;
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : (v == v ? v : 0.0f)); /* NaN query -> 0 */
                qs[32 * b + j] = (int8_t)v;
                qa[32 * b + j] = (uint8_t)(v < 0 ? -v : v);
            }
        }
    }
}

/* A q8_0 / q4_0 K row's values [d0, d0 + n) (n a multiple of 32) as int8 into kq, and its
 * blocks' scales into dk: decoded once a key for every query row of the group. */
static void unpack_q8_0(const uint8_t *kr, uint32_t d0, uint32_t n, int8_t *kq, float *dk) {
    for (uint32_t b = 0; b < n / 32; b++) {
        pkv_block_q8_0 blk;
        memcpy(&blk, kr + (d0 / 32 + b) * sizeof blk, sizeof blk);
        memcpy(kq + 32 * b, blk.qs, 32);
        dk[b] = pkv__f16_to_f32(blk.d);
    }
}

static void unpack_q4_0(const uint8_t *kr, uint32_t d0, uint32_t n, int8_t *kq, float *dk) {
    for (uint32_t b = 0; b < n / 32; b++) {
        pkv_block_q4_0 blk;
        memcpy(&blk, kr + (d0 / 32 + b) * sizeof blk, sizeof blk);
        for (int j = 0; j < 16; j++) {
            kq[32 * b + j] = (int8_t)((blk.qs[j] & 15) - 8);
            kq[32 * b + j + 16] = (int8_t)((blk.qs[j] >> 4) - 8);
        }
        dk[b] = pkv__f16_to_f32(blk.d);
    }
}

/* q8_0 / q4_0 K: per 32-value block an exact integer dot, scaled by dq * dk, the blocks summed in
 * order. Each key's row is unpacked once (PKV__REF_CHUNK values at a time) for all the rows, and
 * the blocks' integer dots run over plain int8 arrays, which the compiler vectorizes. */
static void score_int8(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                       uint32_t head_dim, float *s, uint32_t s_stride, pkv__attn_pf *pf,
                       void (*unpack)(const uint8_t *, uint32_t, uint32_t, int8_t *, float *)) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    int8_t kq[PKV__REF_CHUNK];
    float dk[PKV__REF_CHUNK / 32];
    pkv__attn_pf_start(pf, n_keys);
    for (uint32_t t = 0; t < n_keys; t++) {
        pkv__attn_pf_step(pf);
        const uint8_t *kr = k + t * k_row_bytes;
        for (uint32_t r = 0; r < n_rows; r++) s[r * s_stride + t] = 0.0f;
        for (uint32_t d0 = 0; d0 < head_dim; d0 += PKV__REF_CHUNK) {
            const uint32_t n = PKV_MIN(PKV__REF_CHUNK, head_dim - d0);
            unpack(kr, d0, n, kq, dk);
            for (uint32_t r = 0; r < n_rows; r++) {
                const uint8_t *row = (const uint8_t *)qp + r * qrow;
                const int8_t *qs = (const int8_t *)row + d0;
                const float *dq = (const float *)(row + 2 * (size_t)head_dim) + d0 / 32;
                float acc = s[r * s_stride + t];
                for (uint32_t b = 0; b < n / 32; b++) {
                    int32_t isum = 0;
                    for (int j = 0; j < 32; j++) isum += (int32_t)qs[32 * b + j] * kq[32 * b + j];
                    acc += dq[b] * dk[b] * (float)isum;
                }
                s[r * s_stride + t] = acc;
            }
        }
    }
}

static void score_q8_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                       uint32_t head_dim, float *s, uint32_t s_stride, pkv__attn_pf *pf) {
    score_int8(qp, n_rows, k, k_row_bytes, n_keys, head_dim, s, s_stride, pf, unpack_q8_0);
}

static void score_q4_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                       uint32_t head_dim, float *s, uint32_t s_stride, pkv__attn_pf *pf) {
    score_int8(qp, n_rows, k, k_row_bytes, n_keys, head_dim, s, s_stride, pf, unpack_q4_0);
}

/* ---- fp8 K: f32 query (the prep of the float dtypes), row scale applied after the sum ---- */
void pkv__attn_prep_f32(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = (float *)((uint8_t *)qp + r * qrow);
        for (uint32_t d = 0; d < head_dim; d++) dst[d] = q[r * q_stride + d] * scale;
        for (uint32_t d = head_dim; d % 8; d++) dst[d] = 0.0f; /* fits: qrow >= 4 * roundup(D, 16) */
    }
}

static void score_fp8(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                      uint32_t head_dim, float *s, uint32_t s_stride, pkv__attn_pf *pf) {
    float kf[PKV__REF_CHUNK];
    pkv__attn_pf_start(pf, n_keys);
    for (uint32_t t = 0; t < n_keys; t++) {
        pkv__attn_pf_step(pf);
        const uint8_t *kr = k + t * k_row_bytes;
        float sk;
        memcpy(&sk, kr, 4);
        const uint8_t *e = kr + PKV_FP8_ROW_HEADER;
        for (uint32_t d0 = 0; d0 < head_dim; d0 += PKV__REF_CHUNK) { /* decoded once, for every row */
            const uint32_t n = PKV_MIN(PKV__REF_CHUNK, head_dim - d0);
            for (uint32_t d = 0; d < n; d++) kf[d] = pkv__e4m3_to_f32(e[d0 + d]);
            pkv__ref_score_chunk(qp, n_rows, head_dim, kf, d0, n, s, s_stride, t);
        }
        for (uint32_t r = 0; r < n_rows; r++) s[r * s_stride + t] *= sk;
    }
}

/* ---- V accumulation: acc[r] += p[r][t] * scale(t, block) * code ----
 * Each key's row is unpacked once (PKV__REF_CHUNK values at a time: its codes as floats, exact,
 * and its blocks' scales) for all the rows, then each block of 32 goes through the float
 * reference's accumulation with the block's scale (attn.h): (p x scale) x code, one add a key. */
static void accum_int8(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                       uint32_t n_keys, uint32_t head_dim, float *acc,
                       void (*unpack)(const uint8_t *, uint32_t, uint32_t, int8_t *, float *)) {
    int8_t vq[PKV__REF_CHUNK];
    float vf[PKV__REF_CHUNK], dv[PKV__REF_CHUNK / 32];
    for (uint32_t t = 0; t < n_keys; t++) {
        const uint8_t *vr = v + t * v_row_bytes;
        for (uint32_t d0 = 0; d0 < head_dim; d0 += PKV__REF_CHUNK) {
            const uint32_t n = PKV_MIN(PKV__REF_CHUNK, head_dim - d0);
            unpack(vr, d0, n, vq, dv);
            for (uint32_t j = 0; j < n; j++) vf[j] = (float)vq[j];
            for (uint32_t b = 0; b < n / 32; b++)
                pkv__ref_accum_chunk(p, p_stride, n_rows, dv[b], vf + 32 * b, d0 + 32 * b, 32, acc, head_dim, t);
        }
    }
}

static void accum_q8_0(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                       uint32_t n_keys, uint32_t head_dim, float *acc, pkv__attn_pf *pf) {
    (void)pf; /* accum_pf off: the driver gives score both runs */
    accum_int8(p, p_stride, n_rows, v, v_row_bytes, n_keys, head_dim, acc, unpack_q8_0);
}

static void accum_q4_0(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                       uint32_t n_keys, uint32_t head_dim, float *acc, pkv__attn_pf *pf) {
    (void)pf;
    accum_int8(p, p_stride, n_rows, v, v_row_bytes, n_keys, head_dim, acc, unpack_q4_0);
}

static void accum_fp8(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                      uint32_t n_keys, uint32_t head_dim, float *acc, pkv__attn_pf *pf) {
    (void)pf; /* accum_pf off: the driver gives score both runs */
    float vf[PKV__REF_CHUNK];
    for (uint32_t t = 0; t < n_keys; t++) {
        const uint8_t *vr = v + t * v_row_bytes;
        float sv;
        memcpy(&sv, vr, 4);
        const uint8_t *e = vr + PKV_FP8_ROW_HEADER;
        for (uint32_t d0 = 0; d0 < head_dim; d0 += PKV__REF_CHUNK) { /* decoded once, for every row */
            const uint32_t n = PKV_MIN(PKV__REF_CHUNK, head_dim - d0);
            for (uint32_t d = 0; d < n; d++) vf[d] = pkv__e4m3_to_f32(e[d0 + d]);
            pkv__ref_accum_chunk(p, p_stride, n_rows, sv, vf, d0, n, acc, head_dim, t);
        }
    }
}

void pkv__attn_fill_q_ref(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_Q8_0] = pkv__attn_prep_q8;
    kt->prep_q[PKV_DTYPE_Q4_0] = pkv__attn_prep_q8;
    kt->prep_q[PKV_DTYPE_FP8_E4M3] = pkv__attn_prep_f32;
    kt->score[PKV_DTYPE_Q8_0] = score_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_q4_0;
    kt->score[PKV_DTYPE_FP8_E4M3] = score_fp8;
    kt->accum[PKV_DTYPE_Q8_0] = accum_q8_0;
    kt->accum[PKV_DTYPE_Q4_0] = accum_q4_0;
    kt->accum[PKV_DTYPE_FP8_E4M3] = accum_fp8;
    kt->accum_pf[PKV_DTYPE_Q8_0] = kt->accum_pf[PKV_DTYPE_Q4_0] = kt->accum_pf[PKV_DTYPE_FP8_E4M3] = false;
}
