/* attn_q.h: shared pieces of the quantized-KV attention primitives (attn_q_ref.c and the SIMD
 * files): the query preparations, whose output format the score kernels of every backend
 * read. Internal to src/attn. */
#ifndef PKV_ATTN_Q_H
#define PKV_ATTN_Q_H

#include "attn.h"

/* For q8_0 / q4_0 K. Prepared row: int8 q[D] | uint8 |q|[D] | f32 dq[D / 32], where per 32
 * values dq = amax / 127 and q = rne(scale * query / dq) (D is a multiple of 32). The AVX2
 * backends pair their score kernels with their own prep (same q and dq bit for bit, plus
 * vector-ready scales and q4_0's offset sums: x86/attn_q_avx2.c, pkv__attn_prep_i8_avx2 below,
 * which x86/attn_q_vnni.c extends). */
void pkv__attn_prep_q8(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp);
#if defined(__x86_64__) || defined(__i386__)
void pkv__attn_prep_i8_avx2(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale,
                            void *qp);
#endif
/* For fp8 K: scale * query as f32, zero-padded to a multiple of 8 values (SIMD tiles). */
void pkv__attn_prep_f32(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp);

/* Calls CALL(N) with the group's row count nr (1..4) as a constant N, so a SIMD tile of N rows
 * keeps its accumulators in registers. */
#define PKV__ATTN_NR_SWITCH(nr, CALL)                                                                        \
    switch (nr) {                                                                                            \
    case 4: CALL(4); break;                                                                                  \
    case 3: CALL(3); break;                                                                                  \
    case 2: CALL(2); break;                                                                                  \
    default: CALL(1); break;                                                                                 \
    }

/* The V side's walk of the x86 quantized files: keys in chunks of VK, rows in groups of up to 4;
 * for each (chunk, group) runs ROWS(N) with the group's row count as a constant N, where nk,
 * pp, vv and ar name the chunk's key count, the group's p, the chunk's first V row and the
 * group's acc rows. */
#define PKV__ATTN_ACCUM_CHUNKS(VK, p, ps, n_rows, v, vrb, n_keys, D, acc, ROWS)                           \
    for (uint32_t t0_ = 0; t0_ < (n_keys); t0_ += (VK)) {                                                    \
        const uint32_t nk = PKV_MIN((VK), (n_keys)-t0_);                                                     \
        for (uint32_t r0_ = 0; r0_ < (n_rows); r0_ += 4) {                                                   \
            const uint32_t nr_ = PKV_MIN(4u, (n_rows)-r0_);                                                  \
            const float *pp = (p) + (size_t)r0_ * (ps) + t0_;                                                \
            const uint8_t *vv = (v) + (size_t)t0_ * (vrb);                                                   \
            float *ar = (acc) + (size_t)r0_ * (D);                                                           \
            PKV__ATTN_NR_SWITCH(nr_, ROWS)                                                                   \
        }                                                                                                    \
    }

/* The fp8 score's walk of the x86 files: rows in groups of up to 4; for each group runs ROWS(N)
 * with the group's row count as a constant N, q[4] its prepared f32 rows (past the group's end,
 * its first row again) and sr its first row of scores. */
#define PKV__ATTN_SCORE_ROW_GROUPS(qp, n_rows, D, s, ss, ROWS)                                               \
    for (uint32_t r0_ = 0; r0_ < (n_rows); r0_ += 4) {                                                       \
        const uint32_t nr_ = PKV_MIN(4u, (n_rows)-r0_);                                                      \
        const size_t qs_ = PKV__ATTN_QROW_BYTES(D) / sizeof(float);                                          \
        const float *q[4];                                                                                   \
        for (uint32_t r_ = 0; r_ < 4; r_++) q[r_] = (const float *)(qp) + (r0_ + (r_ < nr_ ? r_ : 0)) * qs_; \
        float *sr = (s) + (size_t)r0_ * (ss);                                                                \
        PKV__ATTN_NR_SWITCH(nr_, ROWS)                                                                       \
    }

/* The q8_0 / q4_0 score table entries of a SIMD file whose score kernel takes the format as a
 * last, constant argument: SCORE(qp, n_rows, k, krb, n_keys, D, s, ss, pf, q4), q4 false / true. */
#define PKV__ATTN_DEF_I8_SCORES(SCORE)                                                                       \
    static void score_q8_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,    \
                           uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {                             \
        SCORE(qp, n_rows, k, krb, n_keys, D, s, ss, pf, false);                                              \
    }                                                                                                        \
    static void score_q4_0(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,    \
                           uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {                             \
        SCORE(qp, n_rows, k, krb, n_keys, D, s, ss, pf, true);                                               \
    }

/* Those and the accum entries, ACCUM(p, ps, n_rows, v, vrb, n_keys, D, acc, A8 or A4). */
#define PKV__ATTN_DEF_I8_ENTRIES(SCORE, ACCUM, A8, A4)                                                       \
    PKV__ATTN_DEF_I8_SCORES(SCORE)                                                                           \
    static void accum_q8_0(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,        \
                           uint32_t n_keys, uint32_t D, float *acc, pkv__attn_pf *pf) {                     \
        (void)pf; /* accum_pf off: the driver gives score both runs */                                       \
        ACCUM(p, ps, n_rows, v, vrb, n_keys, D, acc, A8);                                                    \
    }                                                                                                        \
    static void accum_q4_0(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,        \
                           uint32_t n_keys, uint32_t D, float *acc, pkv__attn_pf *pf) {                     \
        (void)pf; /* accum_pf off: the driver gives score both runs */                                       \
        ACCUM(p, ps, n_rows, v, vrb, n_keys, D, acc, A4);                                                    \
    }

#endif
