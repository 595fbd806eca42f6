/* quant_q.c: the quantized row formats (q8_0, q4_0, fp8 e4m3) and the 16-bit ones (f16, bf16):
 * scalar reference encode / decode, which defines the bytes every SIMD variant must reproduce,
 * the magnitude scans of the write path, and the once-only dispatch behind pkv__qrow_encode /
 * pkv__qrow_decode, pkv__row16_encode / pkv__row16_decode and pkv__max_abs_bits. Layouts and
 * rules: quant.h. */
#include "quant.h"

#include <float.h>
#include <math.h>
#include <pthread.h>

bool pkv__dtype_pool_supported(pkv_dtype dt) { return (unsigned)dt < PKV_DTYPE_COUNT; }

/* NaN counts as 0 in every encoder (q8_0 / q4_0 cannot hold it; fp8 follows for one rule). */
static inline float nan_to_zero(float v) { return v == v ? v : 0.0f; }

/* ---- q8_0 ------------------------------------------------------------------------------------ */
void pkv__q8_0_encode_ref(const float *x, uint32_t d, void *dst) {
    pkv_assert(d % 32 == 0);
    pkv_block_q8_0 *b = dst;
    for (uint32_t i = 0; i < d / 32; i++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(nan_to_zero(x[j])));
        amax = fminf(amax, FLT_MAX);
        uint16_t h = pkv__f16_sat(amax / 127.0f);
        float dd = pkv__f16_to_f32(h);
        float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        pkv_block_q8_0 blk;
        blk.d = h;
        for (int j = 0; j < 32; j++) {
            float r = nearbyintf(nan_to_zero(x[j]) * id);
            r = fminf(fmaxf(r, -127.0f), 127.0f);
            blk.qs[j] = (int8_t)r;
        }
        memcpy(&b[i], &blk, sizeof blk); /* rows are packed: blocks may be unaligned */
    }
}

void pkv__q8_0_decode_ref(const void *src, uint32_t d, float *y) {
    pkv_assert(d % 32 == 0);
    const uint8_t *p = src;
    for (uint32_t i = 0; i < d / 32; i++, p += sizeof(pkv_block_q8_0), y += 32) {
        pkv_block_q8_0 blk;
        memcpy(&blk, p, sizeof blk);
        float dd = pkv__f16_to_f32(blk.d);
        for (int j = 0; j < 32; j++) y[j] = dd * (float)blk.qs[j];
    }
}

/* ---- q4_0 ------------------------------------------------------------------------------------ */
void pkv__q4_0_encode_ref(const float *x, uint32_t d, void *dst) {
    pkv_assert(d % 32 == 0);
    pkv_block_q4_0 *b = dst;
    for (uint32_t i = 0; i < d / 32; i++, x += 32) {
        float mx = 0.0f, mn = 0.0f;
        for (int j = 0; j < 32; j++) {
            float v = nan_to_zero(x[j]);
            mx = fmaxf(mx, v);
            mn = fminf(mn, v);
        }
        float m = -mn > mx ? mn : mx; /* ties: the positive one */
        m = fmaxf(fminf(m, FLT_MAX), -FLT_MAX);
        /* m == 0 (either sign of zero): store +0, so the bytes never depend on max(+0, -0) */
        uint16_t h = m != 0.0f ? pkv__f16_sat(m / -8.0f) : 0;
        float dd = pkv__f16_to_f32(h);
        float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        pkv_block_q4_0 blk;
        blk.d = h;
        uint8_t q[32];
        for (int j = 0; j < 32; j++) {
            float r = nearbyintf(nan_to_zero(x[j]) * id);
            r = fminf(fmaxf(r, -8.0f), 7.0f);
            q[j] = (uint8_t)(int)(r + 8.0f);
        }
        for (int j = 0; j < 16; j++) blk.qs[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
        memcpy(&b[i], &blk, sizeof blk);
    }
}

void pkv__q4_0_decode_ref(const void *src, uint32_t d, float *y) {
    pkv_assert(d % 32 == 0);
    const uint8_t *p = src;
    for (uint32_t i = 0; i < d / 32; i++, p += sizeof(pkv_block_q4_0), y += 32) {
        pkv_block_q4_0 blk;
        memcpy(&blk, p, sizeof blk);
        float dd = pkv__f16_to_f32(blk.d);
        for (int j = 0; j < 16; j++) {
            y[j] = dd * (float)((int)(blk.qs[j] & 15) - 8);
            y[j + 16] = dd * (float)((int)(blk.qs[j] >> 4) - 8);
        }
    }
}

/* ---- fp8 e4m3 -------------------------------------------------------------------------------- */
void pkv__fp8_encode_ref(const float *x, uint32_t d, void *dst) {
    uint8_t *o = dst;
    float amax = 0.0f;
    for (uint32_t j = 0; j < d; j++) amax = fmaxf(amax, fabsf(nan_to_zero(x[j])));
    amax = fminf(amax, FLT_MAX);
    float s = fmaxf(amax / 448.0f, FLT_MIN);
    float is = 1.0f / s;
    memcpy(o, &s, 4);
    o += PKV_FP8_ROW_HEADER;
    for (uint32_t j = 0; j < d; j++) o[j] = pkv__f32_to_e4m3(nan_to_zero(x[j]) * is);
}

void pkv__fp8_decode_ref(const void *src, uint32_t d, float *y) {
    const uint8_t *p = src;
    float s;
    memcpy(&s, p, 4);
    p += PKV_FP8_ROW_HEADER;
    for (uint32_t j = 0; j < d; j++) y[j] = s * pkv__e4m3_to_f32(p[j]);
}

/* ---- 16-bit rows and magnitude scans ------------------------------------------------------------ */
void pkv__f16_encode_ref(const float *x, uint32_t d, void *dst) {
    uint16_t *o = dst;
    for (uint32_t i = 0; i < d; i++) o[i] = pkv__f32_to_f16(x[i]);
}

void pkv__bf16_encode_ref(const float *x, uint32_t d, void *dst) {
    uint16_t *o = dst;
    for (uint32_t i = 0; i < d; i++) o[i] = pkv__f32_to_bf16(x[i]);
}

/* Element i of 16- or 32-bit input at any alignment: pkv_write_kv takes the caller's k and v as
 * bytes (const void *), so they may sit at any address. */
static inline uint16_t ld16(const void *p, size_t i) {
    uint16_t v;
    memcpy(&v, (const uint8_t *)p + 2 * i, 2);
    return v;
}

static inline uint32_t ld32(const void *p, size_t i) {
    uint32_t v;
    memcpy(&v, (const uint8_t *)p + 4 * i, 4);
    return v;
}

void pkv__f16_decode_ref(const void *src, uint32_t d, float *y) {
    for (uint32_t i = 0; i < d; i++) y[i] = pkv__f16_to_f32(ld16(src, i));
}

void pkv__bf16_decode_ref(const void *src, uint32_t d, float *y) {
    for (uint32_t i = 0; i < d; i++) y[i] = pkv__bf16_to_f32(ld16(src, i));
}

uint32_t pkv__max_abs32_ref(const void *x, size_t n) {
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) m = PKV_MAX(m, ld32(x, i) & 0x7fffffffu);
    return m;
}

uint32_t pkv__max_abs16_ref(const void *x, size_t n) {
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) m = PKV_MAX(m, ld16(x, i) & 0x7fffu);
    return m;
}

/* ---- dispatch (chosen once; PKV_FORCE_REF=1 keeps the reference) ----------------------------- */
typedef void (*enc_fn)(const float *, uint32_t, void *);
typedef void (*dec_fn)(const void *, uint32_t, float *);
typedef uint32_t (*scan_fn)(const void *, size_t);
typedef struct {
    enc_fn enc[3];
    dec_fn dec[3];
    enc_fn enc16[2]; /* f16, bf16 */
    dec_fn dec16[2];
    scan_fn max_abs32, max_abs16;
    const char *name;
} qrow_impl;

static const qrow_impl k_ref = {{pkv__q8_0_encode_ref, pkv__q4_0_encode_ref, pkv__fp8_encode_ref},
                                {pkv__q8_0_decode_ref, pkv__q4_0_decode_ref, pkv__fp8_decode_ref},
                                {pkv__f16_encode_ref, pkv__bf16_encode_ref},
                                {pkv__f16_decode_ref, pkv__bf16_decode_ref},
                                pkv__max_abs32_ref,
                                pkv__max_abs16_ref,
                                "ref"};
#if defined(__x86_64__) || defined(__i386__)
static const qrow_impl k_avx2 = {{pkv__q8_0_encode_avx2, pkv__q4_0_encode_avx2, pkv__fp8_encode_avx2},
                                 {pkv__q8_0_decode_avx2, pkv__q4_0_decode_avx2, pkv__fp8_decode_avx2},
                                 {pkv__f16_encode_avx2, pkv__bf16_encode_avx2},
                                 {pkv__f16_decode_avx2, pkv__bf16_decode_avx2},
                                 pkv__max_abs32_avx2,
                                 pkv__max_abs16_avx2,
                                 "avx2"};
#endif

static const qrow_impl *g_impl = &k_ref;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void choose_impl(void) {
    if (pkv__force_ref()) return;
#if defined(__x86_64__) || defined(__i386__)
    uint32_t f = pkv__cpu_features();
    const uint32_t need2 = PKV_CPU_AVX2 | PKV_CPU_FMA | PKV_CPU_F16C;
    if ((f & need2) == need2) g_impl = &k_avx2;
#endif
}

static inline const qrow_impl *impl(void) {
    pthread_once(&g_once, choose_impl);
    return g_impl;
}

const char *pkv__qrow_backend(void) { return impl()->name; }

void pkv__qrow_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst) {
    unsigned k = (unsigned)dt - PKV_DTYPE_Q8_0;
    pkv_assert(k < 3);
    impl()->enc[k](x, d, dst);
}

void pkv__qrow_decode(pkv_dtype dt, const void *src, uint32_t d, float *y) {
    unsigned k = (unsigned)dt - PKV_DTYPE_Q8_0;
    pkv_assert(k < 3);
    impl()->dec[k](src, d, y);
}

void pkv__row16_encode(pkv_dtype dt, const float *x, uint32_t d, void *dst) {
    pkv_assert(dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16);
    impl()->enc16[dt == PKV_DTYPE_BF16](x, d, dst);
}

void pkv__row16_decode(pkv_dtype dt, const void *src, uint32_t d, float *y) {
    pkv_assert(dt == PKV_DTYPE_F16 || dt == PKV_DTYPE_BF16);
    impl()->dec16[dt == PKV_DTYPE_BF16](src, d, y);
}

uint32_t pkv__max_abs_bits(pkv_dtype in, const void *src, size_t n) {
    return in == PKV_DTYPE_F32 ? impl()->max_abs32(src, n) : impl()->max_abs16(src, n);
}
