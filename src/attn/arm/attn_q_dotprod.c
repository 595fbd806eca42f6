/* attn_q_dotprod.c: the q8_0 / q4_0 score kernel of attn_q_neon.c with the Armv8.2 dot-product
 * extension (SDOT: 4 int8 products summed into each int32 lane): the backend "neon-dotprod",
 * picked at run time where the CPU reports it (pkv__cpu_features, PKV_CPU_ASIMDDP). The same
 * exact integer block dot products as the reference, so the same results as "neon"; accum and
 * the float dtypes are NEON's. Compiled only on ARM, with +dotprod (CMake: *_dotprod.c). */
#include "../attn.h"
#include "../attn_q.h"
#include "../../quant/quant.h"

#include <arm_neon.h>
#include <string.h>

/* sum_j q[j] * (c0 | c1)[j] over 32 values, exact in int32 */
static inline __attribute__((always_inline)) int32_t dot32(const int8_t *q, int8x16_t c0, int8x16_t c1) {
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(q), c0), vld1q_s8(q + 16), c1));
}

#include "q_neon_score.h"

PKV__ATTN_DEF_I8_SCORES(score_i8)

void pkv__attn_fill_q_dotprod(pkv__attn_kernels *kt) {
    kt->name = "neon-dotprod";
    kt->score[PKV_DTYPE_Q8_0] = score_q8_0;
    kt->score[PKV_DTYPE_Q4_0] = score_q4_0;
}
