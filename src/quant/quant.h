/* quant.h: element formats of the pool: f32, f16, bf16, q8_0, q4_0, fp8 e4m3. Row encode /
 * decode (a row = head_dim elements of one token and kv head, scales inline) and the scalar
 * conversions every layer uses. Depends on core only. */
#ifndef PKV_QUANT_H
#define PKV_QUANT_H

#include "../core/core.h"

#include <string.h>

/* q8_0: per 32 consecutive values along head_dim, one f16 scale and 32 int8 (ggml's
 * block_q8_0 layout). Encoding (every path, scalar and SIMD, bit for bit):
 *   NaN inputs count as 0; amax = min(max|x|, FLT_MAX);
 *   d = f16(amax / 127) rounded to nearest even, saturated to the largest finite f16;
 *   q = clamp(rne(x * (1 / d)), -127, 127), q = 0 when d == 0.
 * The quantization uses the stored (f16) d, not the f32 one, so the bound is in terms of what
 * is stored: |x - d * q| <= max(d / 2, amax - 127 d) (+ f32 rounding) for finite x with
 * amax <= 127 * 65504; the second term exceeds d / 2 only when d is an f16 subnormal
 * (amax < 127 * 2^-14). ggml rounds half away from zero and quantizes with the f32 d; we use
 * round-half-even (what the SIMD round instruction does) and the stored d. Decode: d * q. */
typedef struct {
    uint16_t d;
    int8_t qs[32];
} pkv_block_q8_0;
_Static_assert(sizeof(pkv_block_q8_0) == 34, "q8_0 block is 34 bytes");

/* q4_0: per 32 values, one f16 scale and 16 bytes of nibbles (ggml's block_q4_0 layout: value
 * j in the low nibble of qs[j] (j < 16), value j + 16 in the high nibble of qs[j]).
 * Encoding (every path, bit for bit): NaN inputs count as 0; m = the value of largest
 * magnitude, sign kept (between +a and -a the positive one: order independent, unlike
 * ggml's first occurrence), clamped to +-FLT_MAX; d = f16(m / -8) (round to nearest even,
 * saturated to +-65504); q = clamp(rne(x * (1 / d)), -8, 7) + 8 (q = 8 when d == 0).
 * An all-zero block stores d = +0 (ggml: -0). Decode: x ~= d * (q - 8). Bound (d normal):
 * |x - d (q - 8)| <= |d| / 2 for x / d in [-8.5, 7.5], which is every value except those of
 * opposite sign to m with |x| > 15/16 |m|: they clamp to 7 and err by at most |d|
 * (+ f32 rounding). */
typedef struct {
    uint16_t d;
    uint8_t qs[16];
} pkv_block_q4_0;
_Static_assert(sizeof(pkv_block_q4_0) == 18, "q4_0 block is 18 bytes");

/* fp8 e4m3 row: f32 scale s, then head_dim e4m3fn bytes (bias 7, 3 mantissa bits, no
 * infinity, 0x7f / 0xff are NaN, largest finite 448). Encoding (every path, bit for bit):
 * NaN inputs count as 0; amax = min(max|x|, FLT_MAX); s = max(amax / 448, 2^-126) (so 1 / s
 * is finite; an all-zero row stores 2^-126); b = e4m3(x * (1 / s)) rounded to nearest even,
 * saturating to +-448, -0 kept. Decode: x ~= s * e4m3(b). Bound: |x - s e4m3(b)| <=
 * max(|x| / 16, s * 2^-10) (+ f32 rounding): half an ulp of 3 mantissa bits for normals
 * (|x / s| >= 2^-6), half the subnormal step 2^-9 below. */
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

/* ---- quantized rows: per-format kernels (quant_q.c: _ref, x86/quant_avx2.c: _avx2) ----
 * Every variant produces the same bytes / floats as _ref bit for bit (tests check it).
 * d: values in the row (multiple of 32 for q8_0 / q4_0, any for fp8). */
void pkv__q8_0_encode_ref(const float *x, uint32_t d, void *dst);
void pkv__q8_0_decode_ref(const void *src, uint32_t d, float *y);
void pkv__q4_0_encode_ref(const float *x, uint32_t d, void *dst);
void pkv__q4_0_decode_ref(const void *src, uint32_t d, float *y);
void pkv__fp8_encode_ref(const float *x, uint32_t d, void *dst);
void pkv__fp8_decode_ref(const void *src, uint32_t d, float *y);
#if defined(__x86_64__) || defined(__i386__)
void pkv__q8_0_encode_avx2(const float *x, uint32_t d, void *dst);
void pkv__q8_0_decode_avx2(const void *src, uint32_t d, float *y);
void pkv__q4_0_encode_avx2(const float *x, uint32_t d, void *dst);
void pkv__q4_0_decode_avx2(const void *src, uint32_t d, float *y);
void pkv__fp8_encode_avx2(const float *x, uint32_t d, void *dst);
void pkv__fp8_decode_avx2(const void *src, uint32_t d, float *y);
#endif
/* f32 <-> f16 / bf16 rows (encode: round to nearest even, as pkv__f32_to_f16 /
 * pkv__f32_to_bf16; decode: exact, as pkv__f16_to_f32 / pkv__bf16_to_f32; the AVX2 variants
 * give the same bits for every input, NaN payloads included), and the largest magnitude among
 * n f32 (as bits & 0x7fffffff) or 16-bit (bits & 0x7fff) elements, for the write path. */
void pkv__f16_encode_ref(const float *x, uint32_t d, void *dst);
void pkv__bf16_encode_ref(const float *x, uint32_t d, void *dst);
void pkv__f16_decode_ref(const void *src, uint32_t d, float *y);
void pkv__bf16_decode_ref(const void *src, uint32_t d, float *y);
uint32_t pkv__max_abs32_ref(const void *x, size_t n);
uint32_t pkv__max_abs16_ref(const void *x, size_t n);
#if defined(__x86_64__) || defined(__i386__)
void pkv__f16_encode_avx2(const float *x, uint32_t d, void *dst);
void pkv__bf16_encode_avx2(const float *x, uint32_t d, void *dst);
void pkv__f16_decode_avx2(const void *src, uint32_t d, float *y);
void pkv__bf16_decode_avx2(const void *src, uint32_t d, float *y);
uint32_t pkv__max_abs32_avx2(const void *x, size_t n);
uint32_t pkv__max_abs16_avx2(const void *x, size_t n);
#endif
/* The chosen set's: f16 or bf16 row encode, and the largest magnitude bits of n elements of in
 * (f32: 32-bit, f16 / bf16: 16-bit). */
void pkv__row16_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst);
void pkv__row16_decode(pkv_dtype dt, const void *src, uint32_t d, float *y);
uint32_t pkv__max_abs_bits(pkv_dtype in, const void *src, size_t n);
/* Name of the row-kernel set chosen at first use ("ref" or "avx2"). */
const char *pkv__qrow_backend(void);

/* Shared scale rules (the SIMD variants compute scales with these, so they cannot drift). */
/* f16 bits of v rounded to nearest even, saturated to +-65504 (never inf; NaN not expected). */
static inline uint16_t pkv__f16_sat(float v);
/* e4m3fn <-> f32. Encode: round to nearest even, |v| >= 448 (and inf) saturate to +-448,
 * NaN -> 0x7f with the sign, -0 -> 0x80. Decode: exact; 0x7f / 0xff -> NaN. */
static inline uint8_t pkv__f32_to_e4m3(float v);
static inline float pkv__e4m3_to_f32(uint8_t b);

/* Convert n input elements (f32, f16 or bf16: a row or a few) to f32. */
void pkv__to_f32(pkv_dtype in, const void *src, uint32_t n, float *dst);
/* Whether n input elements of in (f32, f16 or bf16) are all within PKV_VALUE_MAX (2^56: finite,
 * and small enough that attention's sums cannot overflow, pkv.h) and none of them would round to
 * infinity when stored as pool (f16: |x| >= 65520). One pass of integer max over the elements'
 * magnitude bits (pkv__max_abs_bits: AVX2 where the CPU has it). */
bool pkv__input_fits(pkv_dtype in, const void *src, size_t n, pkv_dtype pool);
/* Whether n_rows stored rows of dt (pkv_dtype_row_bytes(dt, d) bytes each, the pool's own
 * format) are rows the encoder could have written, as far as attention relies on it: float
 * elements as pkv__input_fits asks of a write into dt; q8_0 / q4_0 scales finite, q8_0 codes in
 * -127 .. 127; fp8 scales in [0, 2^56 / 448] and no NaN code (0x7f / 0xff). */
bool pkv__stored_fits(pkv_dtype dt, const void *rows, size_t n_rows, uint32_t d);
/* PKV_VALUE_MAX (2^56) as f32 bits; its bf16 code is the top half (test_write_range checks
 * both against the header's value). */
#define PKV__VALUE_MAX_BITS 0x5b800000u

/* ---- scalar conversions (exact IEEE semantics, round to nearest even) ---- */
static inline uint32_t pkv__f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float pkv__bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Without branches, so that a loop over a row vectorizes (the reference backend's and the
 * portable row decoder's): exponent and mantissa move to f32's places and the exponent gains
 * 127 - 15; inf / nan gain as much again (to 255, the payload kept where the value is returned
 * in a vector or integer register: i386's x87 returns quiet a signalling NaN); a subnormal
 * man * 2^-24 is that product, exact and a normal f32 (so a caller's flush-to-zero /
 * denormals-are-zero mode cannot change it, and zero is +0 in any rounding mode) */
static inline float pkv__f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = (uint32_t)(h & 0x7fff) << 13;
    const uint32_t e = em & 0x0f800000u;
    const uint32_t normal = em + (e == 0x0f800000u ? 0x70000000u : 0x38000000u);
    const float sub = (float)(h & 0x3ffu) * 0x1p-24f;
    return pkv__bits_f32(sign | (e ? normal : pkv__f32_bits(sub)));
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

static inline uint16_t pkv__f16_sat(float v) {
    uint16_t h = pkv__f32_to_f16(v);
    if ((h & 0x7fffu) > 0x7bffu) h = (uint16_t)((h & 0x8000u) | 0x7bffu);
    return h;
}

static inline uint8_t pkv__f32_to_e4m3(float v) {
    uint32_t x = pkv__f32_bits(v);
    uint8_t sign = (uint8_t)((x >> 24) & 0x80);
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7f);
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e); /* >= 448, inf: saturate */
    if (a < 0x3c800000u) {                                /* < 2^-6: subnormal, units of 2^-9 */
        float t = pkv__bits_f32(a) * 512.0f;              /* exact: a power-of-two scaling */
        return (uint8_t)(sign | (uint8_t)__builtin_nearbyintf(t)); /* 8 -> 0x08 = 2^-6: right */
    }
    /* normal: round the 23-bit mantissa to 3 bits (ties to even); a carry bumps the exponent */
    uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
    uint32_t e = r - (120u << 3); /* rebias 127 -> 7 */
    if (e > 0x7eu) e = 0x7eu;
    return (uint8_t)(sign | e);
}

/* Without branches (a row's loop vectorizes): exponent and mantissa moved to f32's places and
 * rebiased (7 -> 127); a subnormal m * 2^-9 exactly; the NaN codes 0x7f / 0xff a quiet NaN. */
static inline float pkv__e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, em = (uint32_t)(b & 0x7f) << 20;
    const float sub = (float)(b & 7u) * 0x1p-9f;
    const uint32_t mag = (b & 0x7f) == 0x7f ? 0x7fc00000u : (b & 0x78) ? em + (120u << 23) : pkv__f32_bits(sub);
    return pkv__bits_f32(sign | mag);
}

#endif
