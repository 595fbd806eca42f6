/* quant.h: element formats of the pool: f32, f16, bf16, q8_0, q4_0, fp8 e4m3. Row encode /
 * decode (a row = head_dim elements of one token and kv head, scales inline) and the scalar
 * conversions every layer uses. Depends on core only. */
#ifndef PKV_QUANT_H
#define PKV_QUANT_H

#include "../core/core.h"

#include <string.h>

/* q8_0: per 32 consecutive values along head_dim, one f16 scale d = max|x| / 127 and
 * q = round(x / d) (saturating to [-127, 127]); x ~= d * q. ggml's block_q8_0. */
typedef struct {
    uint16_t d;
    int8_t qs[32];
} pkv_block_q8_0;
_Static_assert(sizeof(pkv_block_q8_0) == 34, "q8_0 block is 34 bytes");

/* q4_0: per 32 values, f16 scale d = max / -8 (max = the value of largest magnitude, sign
 * kept), q = clamp(round(x / d) + 8, 0, 15); value j in the low nibble of qs[j] (j < 16) and
 * value j + 16 in the high nibble of qs[j]; x ~= d * (q - 8). ggml's block_q4_0. */
typedef struct {
    uint16_t d;
    uint8_t qs[16];
} pkv_block_q4_0;
_Static_assert(sizeof(pkv_block_q4_0) == 18, "q4_0 block is 18 bytes");

/* fp8 e4m3 row: f32 scale s = max|x| / 448 (1 when the row is all zeros), then head_dim
 * e4m3fn bytes of x / s (round to nearest even, saturating to +-448). x ~= s * e4m3(b). */
#define PKV_FP8_ROW_HEADER 4

/* Bytes of one row (0 if the dtype cannot hold head_dim values). */
size_t pkv__row_bytes(pkv_dtype dt, uint32_t head_dim);

/* Encode d f32 values into one row of dt (d must suit dt: pkv__row_bytes(dt, d) != 0). */
void pkv__row_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst);
/* Decode one row of dt into d f32 values. */
void pkv__row_decode(pkv_dtype dt, const void *src, uint32_t d, float *y);
/* Quantized rows (q8_0, q4_0, fp8_e4m3), implemented in quant_q.c. */
void pkv__qrow_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst);
void pkv__qrow_decode(pkv_dtype dt, const void *src, uint32_t d, float *y);
/* True when the pool may hold this dtype in this build. */
bool pkv__dtype_pool_supported(pkv_dtype dt);

/* Convert n input elements (f32, f16 or bf16) to f32. */
void pkv__to_f32(pkv_dtype in, const void *src, size_t n, float *dst);

/* ---- scalar conversions (exact IEEE semantics, round to nearest even) ---- */
static inline uint32_t pkv__f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float pkv__bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float pkv__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return pkv__bits_f32(sign | 0x7f800000u | (man << 13)); /* inf / nan */
    if (exp == 0) {
        if (man == 0) return pkv__bits_f32(sign);
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    return pkv__bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t pkv__f32_to_f16(float f) {
    uint32_t x = pkv__f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) { /* below the smallest normal 2^-14: subnormal or zero */
        float a = pkv__bits_f32(ax) * 16777216.0f; /* in units of 2^-24, rounding by the FPU (RNE) */
        uint32_t m = (uint32_t)__builtin_nearbyintf(a);
        return (uint16_t)(sign | m);
    }
    uint32_t e = (ax >> 23) - 112, m = ax & 0x7fffff;
    uint32_t h = (e << 10) | (m >> 13);
    uint32_t rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static inline float pkv__bf16_to_f32(uint16_t b) { return pkv__bits_f32((uint32_t)b << 16); }
static inline uint16_t pkv__f32_to_bf16(float f) {
    uint32_t x = pkv__f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet nan */
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

#endif
