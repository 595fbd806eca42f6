/* attn_q.h: shared pieces of the quantized-KV attention primitives (attn_q_ref.c and the SIMD
 * files): the query preparations, whose output format the score kernels of every backend
 * read. Internal to src/attn. */
#ifndef PKV_ATTN_Q_H
#define PKV_ATTN_Q_H

#include "attn.h"

/* For q8_0 / q4_0 K. Prepared row: int8 q[D] | uint8 |q|[D] | f32 dq[D / 32], where per 32
 * values dq = amax / 127 and q = rne(scale * query / dq) (D is a multiple of 32). The AVX2
 * backend pairs its score kernels with its own prep (same q and dq bit for bit, plus
 * vector-ready scales and q4_0's offset sums: x86/attn_q_avx2.c, prep_i8). */
void pkv__attn_prep_q8(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp);
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

#endif
