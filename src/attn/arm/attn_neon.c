/* attn_neon.c: AArch64 NEON primitives of paged attention (f32, f16, bf16 K/V, softmax): the
 * AVX2 tiling at 4 lanes with 32 registers (tiles of 4 rows x 4 keys and 4 rows x 16 columns:
 * 16 independent FMA chains). Compiled only on ARM; not run on the x86 development machine:
 * test_attn compares it with the reference on ARM hosts. */
#include "../attn.h"

#include <arm_neon.h>
#include <math.h>

static inline float32x4_t ld_f32(const void *p) { return vld1q_f32((const float *)p); }
static inline float32x4_t ld_f16(const void *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }
static inline float32x4_t ld_bf16(const void *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
}
static inline float sc_f32(const void *p, uint32_t i) { return ((const float *)p)[i]; }
static inline float sc_f16(const void *p, uint32_t i) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(((const uint16_t *)p)[i]))), 0);
}
static inline float sc_bf16(const void *p, uint32_t i) {
    union { uint32_t u; float f; } x = {(uint32_t)((const uint16_t *)p)[i] << 16};
    return x.f;
}

typedef float elem_f32;
typedef uint16_t elem_f16;
typedef uint16_t elem_bf16;

static void prep_f32(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = (float *)((uint8_t *)qp + r * qrow);
        const float *src = q + r * q_stride;
        uint32_t d = 0;
        for (; d + 4 <= head_dim; d += 4) vst1q_f32(dst + d, vmulq_n_f32(vld1q_f32(src + d), scale));
        for (; d < head_dim; d++) dst[d] = src[d] * scale;
    }
}

#define DEF_SCORE(T)                                                                                            \
    static inline __attribute__((always_inline)) void score_tile_##T(const float *q, size_t qs, const uint8_t *k, \
                                                                     size_t krb, const uint32_t R, const uint32_t K, \
                                                                     uint32_t D, float *s, uint32_t ss,         \
                                                                     pkv__attn_pf *pf, const uint32_t sub) {    \
        (void)pf, (void)sub; /* sub is 1: the driver issues the tile's one share */                            \
        float32x4_t acc[4][4];                                                                                  \
        const size_t esz = sizeof(elem_##T);                                                                    \
        const uint32_t D4 = D & ~3u;                                                                            \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t t = 0; t < K; t++) acc[r][t] = vdupq_n_f32(0.0f);                                     \
        for (uint32_t d = 0; d < D4; d += 4) {                                                                  \
            float32x4_t kk[4];                                                                                  \
            for (uint32_t t = 0; t < K; t++) kk[t] = ld_##T(k + t * krb + d * esz);                             \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const float32x4_t x = vld1q_f32(q + r * qs + d);                                                \
                for (uint32_t t = 0; t < K; t++) acc[r][t] = vfmaq_f32(acc[r][t], x, kk[t]);                    \
            }                                                                                                   \
        }                                                                                                       \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t t = 0; t < K; t++) {                                                                  \
                float o = vaddvq_f32(acc[r][t]);                                                                \
                for (uint32_t d = D4; d < D; d++) o += q[r * qs + d] * sc_##T(k + t * krb, d);                  \
                s[r * ss + t] = o;                                                                              \
            }                                                                                                   \
    }

#define DEF_ACCUM(T)                                                                                            \
    static inline __attribute__((always_inline)) void accum_tile_##T(const float *p, uint32_t ps, const uint32_t R, \
                                                                     const uint8_t *v, size_t vrb, uint32_t n_keys, \
                                                                     const uint32_t C, float *acc, uint32_t D,  \
                                                                     pkv__attn_pf *pf) {                        \
        float32x4_t a[4][4];                                                                                    \
        const size_t esz = sizeof(elem_##T);                                                                    \
        (void)pf; /* accum_pf is off on NEON: the driver gives score both runs */                              \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) a[r][c] = vld1q_f32(acc + r * D + 4 * c);                          \
        for (uint32_t t = 0; t < n_keys; t++) {                                                                 \
            const uint8_t *vr = v + t * vrb;                                                                    \
            float32x4_t x[4];                                                                                   \
            for (uint32_t c = 0; c < C; c++) x[c] = ld_##T(vr + 4 * c * esz);                                   \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const float w = p[r * ps + t];                                                                  \
                for (uint32_t c = 0; c < C; c++) a[r][c] = vfmaq_n_f32(a[r][c], x[c], w);                       \
            }                                                                                                   \
        }                                                                                                       \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) vst1q_f32(acc + r * D + 4 * c, a[r][c]);                           \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void accum_rows_##T(const float *p, uint32_t ps, const uint32_t R, \
                                                                     const uint8_t *v, size_t vrb, uint32_t n_keys, \
                                                                     uint32_t D, float *acc, pkv__attn_pf *pf) { \
        const size_t esz = sizeof(elem_##T);                                                                    \
        uint32_t d = 0;                                                                                         \
        for (; d + 16 <= D; d += 16) accum_tile_##T(p, ps, R, v + d * esz, vrb, n_keys, 4, acc + d, D, pf);         \
        if (D - d >= 8) accum_tile_##T(p, ps, R, v + d * esz, vrb, n_keys, 2, acc + d, D, pf), d += 8;              \
        if (D - d >= 4) accum_tile_##T(p, ps, R, v + d * esz, vrb, n_keys, 1, acc + d, D, pf), d += 4;              \
        for (uint32_t i = 0; i < R; i++) /* head_dim not a multiple of 4 */                                     \
            for (uint32_t t = 0; t < n_keys; t++) {                                                             \
                const float w = p[i * ps + t];                                                                  \
                for (uint32_t e = d; e < D; e++) acc[(size_t)i * D + e] += w * sc_##T(v + t * vrb, e);          \
            }                                                                                                   \
    }

DEF_SCORE(f32)
DEF_SCORE(f16)
DEF_SCORE(bf16)
/* one prefetch share per score tile (attn.h) */
#define PKV__ATTN_PF_SUB_f32 1
#define PKV__ATTN_PF_SUB_f16 1
#define PKV__ATTN_PF_SUB_bf16 1
#define PKV__ATTN_PF_SUB_FINE_f32 1 /* the same: no finer shares on NEON */
#define PKV__ATTN_PF_SUB_FINE_f16 1
#define PKV__ATTN_PF_SUB_FINE_bf16 1
#define PKV__ATTN_SCORE_RUN(T, ...) 0u /* no walk of its own: the tiles score every key */
PKV__ATTN_DEF_SCORE_ROWS4(f32)
PKV__ATTN_DEF_SCORE_ROWS4(f16)
PKV__ATTN_DEF_SCORE_ROWS4(bf16)
DEF_ACCUM(f32)
DEF_ACCUM(f16)
DEF_ACCUM(bf16)
#define PKV__ATTN_ACCUM_TILES(D) 0 /* accum does not prefetch (accum_pf off) */
PKV__ATTN_DEF_ACCUM_ROWS(f32)
PKV__ATTN_DEF_ACCUM_ROWS(f16)
PKV__ATTN_DEF_ACCUM_ROWS(bf16)

/* e^x, same reduction and polynomial as the x86 paths; x < -87.3 (and -inf) gives 0. */
static inline float32x4_t exp4(float32x4_t x) {
    const float32x4_t lo = vdupq_n_f32(-87.3f);
    const uint32x4_t keep = vcgeq_f32(x, lo);
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(88.3f)), lo);
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, r);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, r);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, r);
    y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), y, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    y = vmulq_f32(y, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), keep));
}

/* c * tanh(x / c): as vf_softcap in x86/softmax_x86.h (the odd series below y = |x| / c = 1/4) */
static inline float32x4_t softcap4(float32x4_t x, float c, float m2_inv_c) {
    const float32x4_t u = vmulq_n_f32(vabsq_f32(x), m2_inv_c); /* -2y */
    const float32x4_t e = exp4(u);
    const float32x4_t one = vdupq_n_f32(1.0f);
    const float32x4_t y = vmulq_n_f32(u, -0.5f), y2 = vmulq_f32(y, y);
    float32x4_t p = vfmaq_f32(vdupq_n_f32(-17.0f / 315.0f), y2, vdupq_n_f32(62.0f / 2835.0f));
    p = vfmaq_f32(vdupq_n_f32(2.0f / 15.0f), p, y2);
    p = vfmaq_f32(vdupq_n_f32(-1.0f / 3.0f), p, y2);
    p = vfmaq_f32(y, vmulq_f32(p, y2), y);
    float32x4_t t = vdivq_f32(vsubq_f32(one, e), vaddq_f32(one, e));
    t = vbslq_f32(vcltq_f32(y, vdupq_n_f32(0.25f)), p, t);
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    t = vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(t), vandq_u32(vreinterpretq_u32_f32(x), sign)));
    const uint32x4_t masked = vceqq_f32(x, vdupq_n_f32(-INFINITY)); /* masked keys stay masked */
    return vbslq_f32(masked, x, vmulq_n_f32(t, c));
}

static void softmax_neon(float *s, uint32_t ss, uint32_t n_rows, uint32_t n_keys, float softcap, float *m, float *l,
                         float *acc, uint32_t D) {
    const uint32_t n4 = (n_keys + 3) & ~3u; /* rows of s are padded to a multiple of 16 */
    const float m2ic = softcap > 0.0f ? -2.0f / softcap : 0.0f;
    for (uint32_t r = 0; r < n_rows; r++) {
        float *sr = s + (size_t)r * ss;
        for (uint32_t t = n_keys; t < n4; t++) sr[t] = -INFINITY;
        float32x4_t mx = vdupq_n_f32(-INFINITY);
        for (uint32_t t = 0; t < n4; t += 4) {
            float32x4_t x = vld1q_f32(sr + t);
            if (softcap > 0.0f) {
                x = softcap4(x, softcap, m2ic);
                vst1q_f32(sr + t, x);
            }
            mx = vmaxq_f32(mx, x);
        }
        float mnew = vmaxvq_f32(mx);
        if (mnew < m[r]) mnew = m[r];
        if (mnew == -INFINITY) {
            for (uint32_t t = 0; t < n4; t++) sr[t] = 0.0f;
            continue;
        }
        const float32x4_t vm = vdupq_n_f32(mnew);
        float32x4_t sum = vdupq_n_f32(0.0f);
        for (uint32_t t = 0; t < n4; t += 4) {
            float32x4_t e = exp4(vsubq_f32(vld1q_f32(sr + t), vm));
            vst1q_f32(sr + t, e);
            sum = vaddq_f32(sum, e);
        }
        pkv__attn_softmax_commit(&m[r], &l[r], acc + (size_t)r * D, D, mnew, vaddvq_f32(sum));
    }
}

void pkv__attn_fill_neon(pkv__attn_kernels *kt) {
    kt->name = "neon";
    kt->prep_q[PKV_DTYPE_F32] = prep_f32;
    kt->prep_q[PKV_DTYPE_F16] = prep_f32;
    kt->prep_q[PKV_DTYPE_BF16] = prep_f32;
    kt->score[PKV_DTYPE_F32] = score_f32;
    kt->score[PKV_DTYPE_F16] = score_f16;
    kt->score[PKV_DTYPE_BF16] = score_bf16;
    kt->accum[PKV_DTYPE_F32] = accum_f32;
    kt->accum[PKV_DTYPE_F16] = accum_f16;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16;
    kt->accum_pf[PKV_DTYPE_F32] = kt->accum_pf[PKV_DTYPE_F16] = kt->accum_pf[PKV_DTYPE_BF16] = false;
    kt->softmax = softmax_neon;
}
