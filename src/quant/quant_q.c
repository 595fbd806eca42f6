/* quant_q.c: placeholder for the quantized formats (q8_0, q4_0, fp8 e4m3) until they land;
 * the cache refuses these dtypes (pkv__dtype_pool_supported) so these are never reached. */
#include "quant.h"

bool pkv__dtype_pool_supported(pkv_dtype dt) { return dt == PKV_DTYPE_F32 || dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16; }

void pkv__qrow_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst) {
    (void)dt, (void)x, (void)d, (void)dst;
    pkv_assert(!"quantized formats not built");
}

void pkv__qrow_decode(pkv_dtype dt, const void *src, uint32_t d, float *y) {
    (void)dt, (void)src, (void)d, (void)y;
    pkv_assert(!"quantized formats not built");
}
