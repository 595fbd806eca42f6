/* quant.c: row encode/decode for every pool dtype (dispatching to quant_q.c's chosen set),
 * input conversion, and the check that input fits the pool (finite, not rounding to infinity). */
#include "quant.h"

#include <math.h>

size_t pkv__row_bytes(pkv_dtype dt, uint32_t d) {
    switch (dt) {
    case PKV_DTYPE_F32: return (size_t)d * 4;
    case PKV_DTYPE_F16:
    case PKV_DTYPE_BF16: return (size_t)d * 2;
    case PKV_DTYPE_Q8_0: return d % 32 ? 0 : (size_t)d / 32 * sizeof(pkv_block_q8_0);
    case PKV_DTYPE_Q4_0: return d % 32 ? 0 : (size_t)d / 32 * sizeof(pkv_block_q4_0);
    case PKV_DTYPE_FP8_E4M3: return PKV_FP8_ROW_HEADER + (size_t)d;
    default: return 0;
    }
}

PKV_API size_t pkv_dtype_row_bytes(pkv_dtype dtype, uint32_t head_dim) {
    if (head_dim == 0) return 0;
    return pkv__row_bytes(dtype, head_dim);
}

static const char *const k_names[PKV_DTYPE_COUNT] = {"f32", "f16", "bf16", "q8_0", "q4_0", "fp8_e4m3"};

PKV_API const char *pkv_dtype_name(pkv_dtype dtype) {
    return (unsigned)dtype < PKV_DTYPE_COUNT ? k_names[dtype] : NULL;
}

PKV_API int pkv_dtype_from_name(const char *name, pkv_dtype *out) {
    if (!name || !out) return PKV_EINVAL;
    for (int i = 0; i < PKV_DTYPE_COUNT; i++)
        if (!strcmp(name, k_names[i])) {
            *out = (pkv_dtype)i;
            return PKV_OK;
        }
    if (!strcmp(name, "fp8")) {
        *out = PKV_DTYPE_FP8_E4M3;
        return PKV_OK;
    }
    return PKV_EINVAL;
}

void pkv__to_f32(pkv_dtype in, const void *src, uint32_t n, float *dst) {
    switch (in) {
    case PKV_DTYPE_F32: memcpy(dst, src, (size_t)n * 4); break;
    case PKV_DTYPE_F16:
    case PKV_DTYPE_BF16: pkv__row16_decode(in, src, n, dst); break;
    default: pkv_assert(!"input dtype must be f32, f16 or bf16");
    }
}

bool pkv__input_fits(pkv_dtype in, const void *src, size_t n, pkv_dtype pool) {
    switch (in) {
    case PKV_DTYPE_F32: {
        /* the first magnitude refused: past PKV_VALUE_MAX (2^56), or (f16) one that rounds to
           nearest even to infinity; NaN and infinity are past both */
        const uint32_t lim = pool == PKV_DTYPE_F16 ? 0x477ff000u /* 65520 */ : PKV__VALUE_MAX_BITS + 1;
        return pkv__max_abs_bits(in, src, n) < lim;
    }
    case PKV_DTYPE_F16: return pkv__max_abs_bits(in, src, n) < 0x7c00u; /* every finite f16 fits every pool */
    case PKV_DTYPE_BF16:
        return pkv__max_abs_bits(in, src, n) < (pool == PKV_DTYPE_F16 ? 0x4780u /* 65536 */
                                                                     : (PKV__VALUE_MAX_BITS >> 16) + 1);
    default: pkv_assert(!"input dtype must be f32, f16 or bf16");
    }
    return false;
}

/* Whether one of the 8 bytes at p, each first and-ed with mask and then xor-ed with flip, is 0
 * (the zero-byte test, a word at a time). */
static inline bool any_byte_zero(const uint8_t *p, uint64_t mask, uint64_t flip) {
    uint64_t w;
    memcpy(&w, p, 8);
    w = (w & mask) ^ flip;
    return (w - 0x0101010101010101ull) & ~w & 0x8080808080808080ull;
}

bool pkv__stored_fits(pkv_dtype dt, const void *rows, size_t n_rows, uint32_t d) {
    if (dt == PKV_DTYPE_F32 || dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16)
        return pkv__input_fits(dt, rows, n_rows * d, dt);
    const size_t rb = pkv_dtype_row_bytes(dt, d);
    const uint8_t *p = rows;
    for (size_t r = 0; r < n_rows; r++, p += rb) {
        if (dt == PKV_DTYPE_FP8_E4M3) {
            float s;
            memcpy(&s, p, 4);
            /* the encoder writes a positive scale, at most (2^56) / 448 (amax / 448 for amax within
               PKV_VALUE_MAX); 0 is a row never written (the pool starts zeroed) */
            static const float s_max = 0x1p56f / 448.0f; /* a float: x87 would compare in long double */
            if (!(s >= 0.0f && s <= s_max)) return false;
            const uint8_t *e = p + PKV_FP8_ROW_HEADER; /* no NaN code, 0x7f or 0xff */
            uint32_t j = 0;
            for (; j + 8 <= d; j += 8) /* eight at a time: a byte of (code & 0x7f) ^ 0x7f is 0 */
                if (any_byte_zero(e + j, 0x7f7f7f7f7f7f7f7full, 0x7f7f7f7f7f7f7f7full)) return false;
            for (; j < d; j++)
                if ((e[j] & 0x7f) == 0x7f) return false;
            continue;
        }
        const size_t bb = dt == PKV_DTYPE_Q8_0 ? sizeof(pkv_block_q8_0) : sizeof(pkv_block_q4_0);
        for (uint32_t b = 0; b < d / 32; b++) {
            const uint8_t *blk = p + b * bb;
            uint16_t h;
            memcpy(&h, blk, 2); /* the f16 scale leads each block (quant.h) */
            if ((h & 0x7c00u) == 0x7c00u) return false; /* infinity or NaN */
            if (dt == PKV_DTYPE_Q8_0) /* a code -128 (0x80): the encoder writes -127 .. 127 */
                for (int j = 0; j < 32; j += 8)
                    if (any_byte_zero(blk + 2 + j, ~0ull, 0x8080808080808080ull)) return false;
        }
    }
    return true;
}

void pkv__row_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst) {
    switch (dt) {
    case PKV_DTYPE_F32: memcpy(dst, x, (size_t)d * 4); break;
    case PKV_DTYPE_F16:
    case PKV_DTYPE_BF16: pkv__row16_encode(dt, x, d, dst); break;
    default: pkv__qrow_encode(dt, x, d, dst); break;
    }
}

void pkv__row_decode(pkv_dtype dt, const void *src, uint32_t d, float *y) {
    switch (dt) {
    case PKV_DTYPE_F32: memcpy(y, src, (size_t)d * 4); break;
    case PKV_DTYPE_F16:
    case PKV_DTYPE_BF16: pkv__row16_decode(dt, src, d, y); break;
    default: pkv__qrow_decode(dt, src, d, y); break;
    }
}
