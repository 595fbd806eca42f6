/* attn_ref.c: the scalar reference primitives of paged attention (f32, f16, bf16 K/V and the
 * online-softmax step). Portable C, used by PKV_FORCE_REF=1, by CPUs without SIMD paths and
 * as the oracle the SIMD paths are tested against. */
#include "attn.h"
#include "../quant/quant.h"

#include <math.h>

static void prep_f32(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = (float *)((uint8_t *)qp + r * qrow);
        const float *src = q + r * q_stride;
        for (uint32_t d = 0; d < head_dim; d++) dst[d] = src[d] * scale;
    }
}

/* Each K or V row is decoded to f32 once, a chunk at a time (attn.h, pkv__ref_score_chunk), and
 * then used by every query row of the group. The reference favours clarity, but it is also the
 * path of a CPU without SIMD paths. */
#define REF_SCORE(NAME, T, CVT)                                                                          \
    static void NAME(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys, \
                     uint32_t head_dim, float *s, uint32_t s_stride, pkv__attn_pf *pf) {                 \
        float kf[PKV__REF_CHUNK];                                                                        \
        pkv__attn_pf_start(pf, n_keys);                                                                  \
        for (uint32_t t = 0; t < n_keys; t++) {                                                          \
            pkv__attn_pf_step(pf);                                                                       \
            const T *kr = (const T *)(k + t * k_row_bytes);                                              \
            for (uint32_t d0 = 0; d0 < head_dim; d0 += PKV__REF_CHUNK) {                                 \
                const uint32_t n = PKV_MIN(PKV__REF_CHUNK, head_dim - d0);                               \
                for (uint32_t d = 0; d < n; d++) kf[d] = CVT(kr[d0 + d]);                                \
                pkv__ref_score_chunk(qp, n_rows, head_dim, kf, d0, n, s, s_stride, t);                   \
            }                                                                                            \
        }                                                                                                \
    }

#define REF_ACCUM(NAME, T, CVT)                                                                          \
    static void NAME(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes, \
                     uint32_t n_keys, uint32_t head_dim, float *acc, pkv__attn_pf *pf) {                 \
        float vf[PKV__REF_CHUNK];                                                                        \
        pkv__attn_pf_start(pf, n_keys);                                                                  \
        for (uint32_t t = 0; t < n_keys; t++) {                                                          \
            pkv__attn_pf_step(pf);                                                                       \
            const T *vr = (const T *)(v + t * v_row_bytes);                                              \
            for (uint32_t d0 = 0; d0 < head_dim; d0 += PKV__REF_CHUNK) {                                 \
                const uint32_t n = PKV_MIN(PKV__REF_CHUNK, head_dim - d0);                               \
                for (uint32_t d = 0; d < n; d++) vf[d] = CVT(vr[d0 + d]);                                \
                pkv__ref_accum_chunk(p, p_stride, n_rows, 1.0f, vf, d0, n, acc, head_dim, t);            \
            }                                                                                            \
        }                                                                                                \
    }

static inline float id_f32(float x) { return x; }

REF_SCORE(score_f32, float, id_f32)
REF_SCORE(score_f16, uint16_t, pkv__f16_to_f32)
REF_SCORE(score_bf16, uint16_t, pkv__bf16_to_f32)
REF_ACCUM(accum_f32, float, id_f32)
REF_ACCUM(accum_f16, uint16_t, pkv__f16_to_f32)
REF_ACCUM(accum_bf16, uint16_t, pkv__bf16_to_f32)

static void softmax_ref(float *s, uint32_t s_stride, uint32_t n_rows, uint32_t n_keys, float softcap, float *m,
                        float *l, float *acc, uint32_t head_dim) {
    for (uint32_t r = 0; r < n_rows; r++) {
        float *sr = s + (size_t)r * s_stride;
        if (softcap > 0.0f) {
            const float inv = 1.0f / softcap;
            for (uint32_t t = 0; t < n_keys; t++) /* masked keys (-inf) stay masked */
                if (sr[t] != -INFINITY) sr[t] = softcap * tanhf(sr[t] * inv);
        }
        float mx = m[r];
        for (uint32_t t = 0; t < n_keys; t++) mx = sr[t] > mx ? sr[t] : mx;
        if (mx == -INFINITY) { /* nothing visible yet in this row */
            for (uint32_t t = 0; t < n_keys; t++) sr[t] = 0.0f;
            continue;
        }
        float sum = 0.0f;
        for (uint32_t t = 0; t < n_keys; t++) {
            sr[t] = expf(sr[t] - mx); /* expf(-inf) == 0 */
            sum += sr[t];
        }
        pkv__attn_softmax_commit(&m[r], &l[r], acc + (size_t)r * head_dim, head_dim, mx, sum);
    }
}

void pkv__attn_fill_ref(pkv__attn_kernels *kt) {
    kt->name = "ref";
    kt->prep_q[PKV_DTYPE_F32] = prep_f32;
    kt->prep_q[PKV_DTYPE_F16] = prep_f32;
    kt->prep_q[PKV_DTYPE_BF16] = prep_f32;
    kt->score[PKV_DTYPE_F32] = score_f32;
    kt->score[PKV_DTYPE_F16] = score_f16;
    kt->score[PKV_DTYPE_BF16] = score_bf16;
    kt->accum[PKV_DTYPE_F32] = accum_f32;
    kt->accum[PKV_DTYPE_F16] = accum_f16;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16;
    kt->accum_pf[PKV_DTYPE_F32] = kt->accum_pf[PKV_DTYPE_F16] = kt->accum_pf[PKV_DTYPE_BF16] = true;
    kt->softmax = softmax_ref;
}
