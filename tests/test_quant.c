/* test_quant.c: the quantized row formats (q8_0, q4_0, fp8 e4m3): exact encodings of known
 * vectors (expected bytes computed independently, by hand / Python, and written out here),
 * the stated round-trip bounds, saturation, zero blocks, NaN, and every SIMD variant equal to
 * the scalar reference bit for bit. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <fenv.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "quant/quant.h"
#include "support_util.h"

/* ---- helpers --------------------------------------------------------------------------------- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
static float rng_unif(void) { return (float)(rng_u32() >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }
static float rng_normal(void) {
    float u = ((float)(rng_u32() >> 8) + 0.5f) / 16777216.0f, w = (float)(rng_u32() >> 8) / 16777216.0f;
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * w);
}

static uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* v[i] = (i - 16) * 0.1 in f32 (SEEDS.md test 35/36 input). */
static void seed_vector(float *v) {
    for (int i = 0; i < 32; i++) v[i] = (float)(i - 16) * 0.1f;
}

/* ---- sizes and support ----------------------------------------------------------------------- */
static void test_row_bytes_and_support(void **state) {
    (void)state;
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, 128), 4 * 34);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q4_0, 128), 4 * 18);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_FP8_E4M3, 128), 4 + 128);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_FP8_E4M3, 1), 5);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, 100), 0);
    assert_int_equal(pkv_dtype_row_bytes(PKV_DTYPE_Q4_0, 16), 0);
    for (int dt = 0; dt < PKV_DTYPE_COUNT; dt++) assert_true(pkv__dtype_pool_supported((pkv_dtype)dt));
    assert_false(pkv__dtype_pool_supported(PKV_DTYPE_COUNT));
}

/* ---- known vectors --------------------------------------------------------------------------- */
/* amax = 1.6f; d = f32(1.6f / 127) = 0.012598425..; f16(d) = 0x2273 = 0.01259613037109375;
 * q = rne(x * f32(1 / d16)): the same integers SEEDS.md test 36 lists for realizar. */
static void test_q8_0_known_vector(void **state) {
    (void)state;
    static const int8_t want[32] = {-127, -119, -111, -103, -95, -87, -79, -71, -64, -56, -48,
                                    -40,  -32,  -24,  -16,  -8,  0,   8,   16,  24,  32,  40,
                                    48,   56,   64,   71,   79,  87,  95,  103, 111, 119};
    float v[32], y[32];
    seed_vector(v);
    pkv_block_q8_0 b;
    pkv__q8_0_encode_ref(v, 32, &b);
    assert_int_equal(b.d, 0x2273);
    assert_memory_equal(b.qs, want, 32);
    pkv__q8_0_decode_ref(&b, 32, y);
    for (int i = 0; i < 32; i++) {
        assert_true(y[i] == 0.01259613037109375f * (float)want[i]);
        assert_true(fabsf(y[i] - v[i]) <= 0.01259613037109375f / 2);
    }
}

/* m = -1.6f (largest magnitude); d = m / -8 = 0.2f; f16 -> 0x3266 = 0.199951171875;
 * nibbles q = rne(x / d16) + 8 = 0 0 1 1 2 2 3 3 4 4 5 5 6 6 7 7 | 8 9 9 10 10 11 11 12 12 13 13
 * 14 14 15 15 15 (x = 1.5 gives 7.5019 -> 8 -> clamped to 7: the one element with err > d/2). */
static void test_q4_0_known_vector(void **state) {
    (void)state;
    static const uint8_t want[16] = {0x80, 0x90, 0x91, 0xa1, 0xa2, 0xb2, 0xb3, 0xc3,
                                     0xc4, 0xd4, 0xd5, 0xe5, 0xe6, 0xf6, 0xf7, 0xf7};
    float v[32], y[32];
    seed_vector(v);
    pkv_block_q4_0 b;
    pkv__q4_0_encode_ref(v, 32, &b);
    assert_int_equal(b.d, 0x3266);
    assert_memory_equal(b.qs, want, 16);
    pkv__q4_0_decode_ref(&b, 32, y);
    const float d = 0.199951171875f;
    for (int i = 0; i < 32; i++) {
        int q = i < 16 ? (want[i] & 15) : (want[i - 16] >> 4);
        assert_true(y[i] == d * (float)(q - 8));
        assert_true(fabsf(y[i] - v[i]) <= (i == 31 ? d : d / 2));
    }
}

/* s = f32(1.6f / 448) = 0x3b6a0ea1; b = e4m3(x * f32(1 / s)), codes found by nearest-value
 * search over all 126 finite positive e4m3 values (ties to the even code) in Python. */
static void test_fp8_known_vector(void **state) {
    (void)state;
    static const uint8_t want[32] = {0xfe, 0xfd, 0xfc, 0xfb, 0xfa, 0xfa, 0xf9, 0xf8, 0xf6, 0xf4, 0xf2,
                                     0xf1, 0xee, 0xea, 0xe6, 0xde, 0x00, 0x5e, 0x66, 0x6a, 0x6e, 0x71,
                                     0x72, 0x74, 0x76, 0x78, 0x79, 0x7a, 0x7a, 0x7b, 0x7c, 0x7d};
    float v[32], y[32];
    seed_vector(v);
    uint8_t row[4 + 32];
    pkv__fp8_encode_ref(v, 32, row);
    float s;
    memcpy(&s, row, 4);
    assert_int_equal(fbits(s), 0x3b6a0ea1u);
    assert_memory_equal(row + 4, want, 32);
    pkv__fp8_decode_ref(row, 32, y);
    for (int i = 0; i < 32; i++) assert_true(fabsf(y[i] - v[i]) <= fmaxf(fabsf(v[i]) / 16, s / 1024) * 1.0001f);
}

/* q8_0 ties: amax = 127/16 gives d = 1/16 exactly and 1/d = 16, so x = (k + 0.5) / 16 is an
 * exact tie: round half to even. */
static void test_q8_0_ties_to_even(void **state) {
    (void)state;
    float v[32] = {0};
    v[0] = 127.0f / 16;
    v[1] = 0.5f / 16, v[2] = 1.5f / 16, v[3] = 2.5f / 16, v[4] = -0.5f / 16, v[5] = -1.5f / 16, v[6] = -2.5f / 16;
    v[7] = 126.5f / 16;
    pkv_block_q8_0 b;
    pkv__q8_0_encode_ref(v, 32, &b);
    assert_int_equal(b.d, 0x2c00); /* 1/16 */
    static const int8_t want[8] = {127, 0, 2, 2, 0, -2, -2, 126};
    assert_memory_equal(b.qs, want, 8);
}

/* ---- e4m3 scalar conversions ---------------------------------------------------------------- */
typedef struct {
    float x;
    uint8_t code;
} e4m3_case;

static void test_e4m3_scalar_known(void **state) {
    (void)state;
    /* expected codes derived by hand (and checked by a Python nearest-value search) */
    const e4m3_case cases[] = {
        {0.0f, 0x00},        {-0.0f, 0x80},          {1.0f, 0x38},           {-1.0f, 0xb8},
        {448.0f, 0x7e},      {449.0f, 0x7e},         {463.9f, 0x7e},         {464.0f, 0x7e},
        {1000.0f, 0x7e},     {INFINITY, 0x7e},       {-INFINITY, 0xfe},      {1.0625f, 0x38}, /* tie -> even */
        {1.1875f, 0x3a},     {0x1p-9f, 0x01},        {0x1p-10f, 0x00},       {0x3p-10f, 0x02},
        {0x1p-6f, 0x08},     {0.0155f, 0x08},        {0x7p-9f, 0x07},        {0x1p-11f, 0x00},
        {0.3f, 0x2a},        {-0.3f, 0xaa},          {240.0f, 0x77},         {0.1f, 0x1d},
        {0x1p-30f, 0x00},    {1e-45f, 0x00},         {300.0f, 0x79},         {6e-05f, 0x00},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t c = pkv__f32_to_e4m3(cases[i].x);
        if (c != cases[i].code) fail_msg("e4m3(%a) = 0x%02x, want 0x%02x", (double)cases[i].x, c, cases[i].code);
    }
    assert_int_equal(pkv__f32_to_e4m3(NAN) & 0x7f, 0x7f);
    /* decode of known codes */
    assert_true(pkv__e4m3_to_f32(0x7e) == 448.0f);
    assert_true(pkv__e4m3_to_f32(0xfe) == -448.0f);
    assert_true(pkv__e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(pkv__e4m3_to_f32(0x07) == 0x7p-9f);
    assert_true(pkv__e4m3_to_f32(0x08) == 0x1p-6f);
    assert_true(pkv__e4m3_to_f32(0x38) == 1.0f);
    assert_true(pkv__e4m3_to_f32(0x3a) == 1.25f);
    assert_true(pkv__e4m3_to_f32(0x77) == 240.0f);
    assert_true(pkv__e4m3_to_f32(0x00) == 0.0f && !signbit(pkv__e4m3_to_f32(0x00)));
    assert_true(signbit(pkv__e4m3_to_f32(0x80)));
    assert_true(isnan(pkv__e4m3_to_f32(0x7f)) && isnan(pkv__e4m3_to_f32(0xff)));
}

/* Value of a code computed from the e4m3fn definition (independent of the library). */
static double e4m3_def(int code) {
    int e = (code >> 3) & 15, m = code & 7;
    double v = e == 0 ? m / 8.0 * ldexp(1, -6) : (1 + m / 8.0) * ldexp(1, e - 7);
    return code & 0x80 ? -v : v;
}

/* Round trip of every finite code, and f32 -> e4m3 against a brute-force nearest search
 * (ties to the even code, saturating) over many values including every midpoint. */
static void test_e4m3_exhaustive(void **state) {
    (void)state;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue;
        assert_true((double)pkv__e4m3_to_f32((uint8_t)c) == e4m3_def(c));
        assert_int_equal(pkv__f32_to_e4m3(pkv__e4m3_to_f32((uint8_t)c)), c);
    }
    float probes[4000];
    int n = 0;
    for (int c = 0; c < 0x7e; c++) { /* midpoints and their neighbours */
        float mid = (float)((e4m3_def(c) + e4m3_def(c + 1)) / 2);
        probes[n++] = mid, probes[n++] = nextafterf(mid, 0), probes[n++] = nextafterf(mid, 1000);
    }
    while (n < 4000) probes[n++] = ldexpf(fabsf(rng_unif()), (int)(rng_u32() % 24) - 14);
    for (int i = 0; i < n; i++) {
        for (int sgn = 0; sgn < 2; sgn++) {
            float x = sgn ? -probes[i] : probes[i];
            double ax = fabs((double)x);
            int best = 0;
            double bd = INFINITY;
            for (int c = 0; c <= 0x7e; c++) {
                double dist = fabs(e4m3_def(c) - ax);
                if (dist < bd || (dist == bd && !(c & 1))) bd = dist, best = c;
            }
            if (ax >= 448) best = 0x7e;
            int want = best | (signbit(x) ? 0x80 : 0);
            int got = pkv__f32_to_e4m3(x);
            if (got != want) fail_msg("e4m3(%a) = 0x%02x, want 0x%02x", (double)x, got, want);
        }
    }
}

/* ---- round-trip bounds ---------------------------------------------------------------------- */
static void fill_random(float *x, uint32_t n, float scale, int kind) {
    for (uint32_t i = 0; i < n; i++) {
        float v = kind == 0 ? rng_unif() : rng_normal();
        if (kind == 2 && rng_u32() % 17 == 0) v *= 40.0f; /* outliers */
        x[i] = v * scale;
    }
}

static void test_q8_0_roundtrip_bound(void **state) {
    (void)state;
    float x[256], y[256];
    uint8_t row[8 * 34];
    const float scales[] = {1e-4f, 0.05f, 1.0f, 30.0f, 2000.0f};
    for (int it = 0; it < 300; it++) {
        uint32_t d = 32 * (1 + rng_u32() % 8);
        fill_random(x, d, scales[it % 5], it % 3);
        pkv__q8_0_encode_ref(x, d, row);
        pkv__q8_0_decode_ref(row, d, y);
        for (uint32_t b = 0; b < d / 32; b++) {
            pkv_block_q8_0 blk;
            memcpy(&blk, row + 34 * b, 34);
            float dd = pkv__f16_to_f32(blk.d), amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
            /* the stored scale is amax / 127 to f16 precision (absolute 2^-25 when subnormal) */
            assert_true(fabsf(dd - amax / 127) <= fmaxf(amax / 127 * 0x1p-11f, 0x1p-25f) * 1.001f);
            /* stated bound: max(d/2, amax - 127 d); the second term exceeds d/2 only for f16
               subnormal scales (amax < 127 * 2^-14, the 1e-4 case here) */
            float bound = fmaxf(dd / 2, amax - 127 * dd) * (1 + 0x1p-20f);
            if (amax >= 127 * 0x1p-14f) assert_true(amax - 127 * dd <= dd / 2);
            for (int j = 0; j < 32; j++) {
                float err = fabsf(y[32 * b + j] - x[32 * b + j]);
                if (err > bound) fail_msg("q8_0 err %g > bound %g (d %g)", (double)err, (double)bound, (double)dd);
            }
        }
    }
}

static void test_q4_0_roundtrip_bound(void **state) {
    (void)state;
    float x[256], y[256];
    uint8_t row[8 * 18];
    const float scales[] = {0.01f, 0.05f, 1.0f, 30.0f, 2000.0f}; /* d normal: |m| / 8 >= 2^-14 */
    for (int it = 0; it < 300; it++) {
        uint32_t d = 32 * (1 + rng_u32() % 8);
        fill_random(x, d, scales[it % 5], it % 3);
        pkv__q4_0_encode_ref(x, d, row);
        pkv__q4_0_decode_ref(row, d, y);
        for (uint32_t b = 0; b < d / 32; b++) {
            pkv_block_q4_0 blk;
            memcpy(&blk, row + 18 * b, 18);
            float dd = pkv__f16_to_f32(blk.d), m = 0;
            for (int j = 0; j < 32; j++)
                if (fabsf(x[32 * b + j]) > fabsf(m)) m = x[32 * b + j];
            assert_true(fabsf(dd - m / -8) <= fabsf(m) / 8 * 0x1p-11f * 1.001f);
            for (int j = 0; j < 32; j++) {
                float xv = x[32 * b + j], err = fabsf(y[32 * b + j] - xv);
                /* values of the sign opposite to m beyond 15/16 |m| clamp: bound |d| */
                float bound = (xv / dd > 7.5f) ? fabsf(dd) : fabsf(dd) / 2;
                if (err > bound * (1 + 0x1p-20f)) fail_msg("q4_0 err %g > %g (x/d %g)", (double)err, (double)bound, (double)(xv / dd));
            }
        }
    }
}

static void test_fp8_roundtrip_bound(void **state) {
    (void)state;
    float x[300], y[300];
    uint8_t row[4 + 300];
    const float scales[] = {1e-30f, 1e-3f, 1.0f, 30.0f, 1e20f};
    for (int it = 0; it < 300; it++) {
        uint32_t d = 1 + rng_u32() % 300;
        fill_random(x, d, scales[it % 5], it % 3);
        pkv__fp8_encode_ref(x, d, row);
        pkv__fp8_decode_ref(row, d, y);
        float s, amax = 0;
        memcpy(&s, row, 4);
        for (uint32_t j = 0; j < d; j++) amax = fmaxf(amax, fabsf(x[j]));
        assert_true(s == fmaxf(amax / 448, FLT_MIN));
        for (uint32_t j = 0; j < d; j++) {
            float err = fabsf(y[j] - x[j]);
            float bound = fmaxf(fabsf(x[j]) / 16, s * 0x1p-10f) * (1 + 0x1p-18f);
            if (err > bound) fail_msg("fp8 err %g > %g (x %g, s %g)", (double)err, (double)bound, (double)x[j], (double)s);
        }
    }
}

/* ---- zero blocks, saturation, non-finite input ------------------------------------------------ */
static void test_zero_blocks(void **state) {
    (void)state;
    float z[64] = {0}, y[64];
    z[3] = -0.0f;
    pkv_block_q8_0 b8[2];
    pkv__q8_0_encode_ref(z, 64, b8);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(b8[i].d, 0);
        for (int j = 0; j < 32; j++) assert_int_equal(b8[i].qs[j], 0);
    }
    pkv_block_q4_0 b4[2];
    pkv__q4_0_encode_ref(z, 64, b4);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(b4[i].d, 0);
        for (int j = 0; j < 16; j++) assert_int_equal(b4[i].qs[j], 0x88);
    }
    uint8_t r[4 + 64];
    pkv__fp8_encode_ref(z, 64, r);
    float s;
    memcpy(&s, r, 4);
    assert_true(s == FLT_MIN);
    for (int j = 0; j < 64; j++) assert_int_equal(r[4 + j], j == 3 ? 0x80 : 0x00);
    pkv__q8_0_decode_ref(b8, 64, y);
    for (int j = 0; j < 64; j++) assert_true(y[j] == 0.0f);
    pkv__q4_0_decode_ref(b4, 64, y);
    for (int j = 0; j < 64; j++) assert_true(y[j] == 0.0f);
    pkv__fp8_decode_ref(r, 64, y);
    for (int j = 0; j < 64; j++) assert_true(y[j] == 0.0f);
}

static void test_saturation_and_nonfinite(void **state) {
    (void)state;
    float x[32];
    /* q8_0: amax 1e9 > 127 * 65504: the scale saturates to 65504 (0x7bff), codes to +-127 */
    for (int j = 0; j < 32; j++) x[j] = (j & 1 ? -1e9f : 1e9f) * (float)(j + 1) / 32;
    pkv_block_q8_0 b8;
    pkv__q8_0_encode_ref(x, 32, &b8);
    assert_int_equal(b8.d, 0x7bff);
    assert_int_equal(b8.qs[31], -127);
    assert_int_equal(b8.qs[30], 127);
    /* q8_0: inf and NaN: NaN encodes as 0, inf as the saturated code */
    for (int j = 0; j < 32; j++) x[j] = 1.0f;
    x[0] = NAN, x[1] = INFINITY, x[2] = -INFINITY;
    pkv__q8_0_encode_ref(x, 32, &b8);
    assert_int_equal(b8.d, 0x7bff);
    assert_int_equal(b8.qs[0], 0);
    assert_int_equal(b8.qs[1], 127);
    assert_int_equal(b8.qs[2], -127);
    assert_int_equal(b8.qs[3], 0); /* 1 / 65504 rounds to 0 */
    /* NaN alone: ignored by the scale */
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 16) * 0.1f;
    x[5] = NAN;
    pkv__q8_0_encode_ref(x, 32, &b8);
    assert_int_equal(b8.d, 0x2273);
    assert_int_equal(b8.qs[5], 0);
    /* q4_0: +-inf, m = +inf clamps to FLT_MAX, d saturates to -65504 (0xfbff) */
    for (int j = 0; j < 32; j++) x[j] = 1.0f;
    x[0] = INFINITY, x[1] = -INFINITY, x[2] = NAN;
    pkv_block_q4_0 b4;
    pkv__q4_0_encode_ref(x, 32, &b4);
    assert_int_equal(b4.d, 0xfbff);
    assert_int_equal(b4.qs[0] & 15, 0);  /* +inf / -65504 = -inf -> -8 */
    assert_int_equal(b4.qs[1] & 15, 15); /* -inf -> +inf -> clamp 7 */
    assert_int_equal(b4.qs[2] & 15, 8);  /* NaN -> 0 */
    /* fp8: inf -> +-448 code, others tiny; NaN -> 0 */
    uint8_t r[4 + 32];
    pkv__fp8_encode_ref(x, 32, r);
    float s;
    memcpy(&s, r, 4);
    assert_true(s == FLT_MAX / 448);
    assert_int_equal(r[4], 0x7e);
    assert_int_equal(r[5], 0xfe);
    assert_int_equal(r[6], 0x00);
    /* fp8: the largest magnitude always encodes as +-448 exactly (scale = amax / 448) */
    for (int j = 0; j < 32; j++) x[j] = rng_normal() * 3;
    x[17] = -50.0f;
    pkv__fp8_encode_ref(x, 32, r);
    assert_int_equal(r[4 + 17], 0xfe);
}

/* ---- SIMD variants == reference, bit for bit ------------------------------------------------ */
typedef void (*enc_fn)(const float *, uint32_t, void *);
typedef void (*dec_fn)(const void *, uint32_t, float *);

/* Inputs that stress every branch: ties, +-0, subnormals, huge values, inf, NaN. */
static void fill_nasty(float *x, uint32_t n, int mode) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t r = rng_u32();
        float v;
        switch (mode % 6) {
        case 0: v = rng_normal(); break;
        case 1: v = (float)((int)(r % 33) - 16) * 0.5f / 16; break;       /* many exact ties */
        case 2: v = ldexpf(rng_unif(), (int)(r % 60) - 40); break;         /* wide exponents */
        case 3: v = ldexpf(rng_unif(), -140 + (int)(r % 10)); break;       /* f32 subnormals */
        case 4: v = rng_normal() * 1e7f; break;                             /* q8 scale saturates */
        default: v = (r % 7 == 0) ? -0.0f : (r % 11 == 0 ? NAN : (r % 13 == 0 ? INFINITY : rng_unif())); break;
        }
        x[i] = v;
    }
    if (mode % 6 == 1) x[rng_u32() % n] = 127.0f / 16; /* d = 1/16 exactly */
}

static void check_variant(const char *name, pkv_dtype dt, enc_fn enc_ref, dec_fn dec_ref, enc_fn enc, dec_fn dec) {
    float x[1024], y0[1024], y1[1024];
    uint8_t r0[4 + 1024 * 2], r1[4 + 1024 * 2];
    for (int it = 0; it < 2000; it++) {
        uint32_t d = dt == PKV_DTYPE_FP8_E4M3 ? 1 + rng_u32() % 300 : 32 * (1 + rng_u32() % 8);
        if (it % 97 == 0) d = dt == PKV_DTYPE_FP8_E4M3 ? 1024 : 1024;
        fill_nasty(x, d, it);
        size_t rb = pkv__row_bytes(dt, d);
        memset(r0, 0xa5, sizeof r0), memset(r1, 0x5a, sizeof r1);
        enc_ref(x, d, r0);
        enc(x, d, r1);
        if (memcmp(r0, r1, rb) != 0) {
            size_t k = 0;
            while (r0[k] == r1[k]) k++;
            fail_msg("%s %s encode differs at byte %zu (d %u, mode %d): ref 0x%02x, simd 0x%02x", name,
                     pkv_dtype_name(dt), k, d, it % 6, r0[k], r1[k]);
        }
        assert_int_equal(r1[rb], 0x5a); /* nothing written past the row */
        dec_ref(r0, d, y0);
        dec(r0, d, y1);
        for (uint32_t j = 0; j < d; j++)
            if (fbits(y0[j]) != fbits(y1[j]) && !(isnan(y0[j]) && isnan(y1[j])))
                fail_msg("%s %s decode differs at %u: %a vs %a", name, pkv_dtype_name(dt), j, (double)y0[j], (double)y1[j]);
    }
}

#if defined(__x86_64__) || defined(__i386__)
/* The f16 / bf16 row encodes and decodes and the magnitude scans of the write path: AVX2
 * against the reference, bit for bit: encodes over f32 bit patterns 2^32 / 65521 apart (every
 * exponent, NaNs with their payloads and both signs among them), decodes over every code, in
 * rows of every length up to 40 (20) at many offsets (vector bodies and scalar tails), and
 * scans with the largest element at each place. */
static void check_16bit_avx2(void) {
    enum { N = 65536 };
    static float x[N];
    static uint16_t a[N], b[N];
    for (uint32_t i = 0; i < N; i++) {
        const uint32_t w = i * 65521u + (i >> 3);
        memcpy(&x[i], &w, 4);
    }
    for (int bf = 0; bf < 2; bf++) {
        void (*ref)(const float *, uint32_t, void *) = bf ? pkv__bf16_encode_ref : pkv__f16_encode_ref;
        void (*vec)(const float *, uint32_t, void *) = bf ? pkv__bf16_encode_avx2 : pkv__f16_encode_avx2;
        ref(x, N, a), vec(x, N, b);
        for (uint32_t i = 0; i < N; i++)
            if (a[i] != b[i]) fail_msg("%s: 0x%08x: avx2 0x%04x, ref 0x%04x", bf ? "bf16" : "f16", fbits(x[i]), b[i], a[i]);
        for (uint32_t d = 1; d <= 40; d++)
            for (uint32_t at = 0; at + d <= 200; at += 7) {
                memset(b, 0xa5, 2 * (size_t)(d + 1));
                vec(x + at, d, b);
                for (uint32_t j = 0; j < d; j++) assert_int_equal(b[j], a[at + j]);
                assert_int_equal(b[d], 0xa5a5); /* nothing past the row */
            }
    }
    /* decode: every code, bit for bit (signalling NaNs keep their payload), and short rows */
    static uint16_t codes[N];
    static float fa[N], fb[N];
    for (uint32_t i = 0; i < N; i++) codes[i] = (uint16_t)i;
    for (int bf = 0; bf < 2; bf++) {
        void (*ref)(const void *, uint32_t, float *) = bf ? pkv__bf16_decode_ref : pkv__f16_decode_ref;
        void (*vec)(const void *, uint32_t, float *) = bf ? pkv__bf16_decode_avx2 : pkv__f16_decode_avx2;
        ref(codes, N, fa), vec(codes, N, fb);
        for (uint32_t i = 0; i < N; i++)
            if (fbits(fa[i]) != fbits(fb[i]))
                fail_msg("%s 0x%04x: avx2 0x%08x, ref 0x%08x", bf ? "bf16" : "f16", i, fbits(fb[i]), fbits(fa[i]));
        for (uint32_t d = 1; d <= 20; d++)
            for (uint32_t at = 0x7bf0; at + d <= 0x7c20; at += 5) { /* the largest finite, inf, NaNs */
                fb[d] = 1.5f;
                vec(codes + at, d, fb);
                for (uint32_t j = 0; j < d; j++) assert_int_equal(fbits(fb[j]), fbits(fa[at + j]));
                assert_true(fb[d] == 1.5f);
            }
    }
    static uint32_t w32[300];
    static uint16_t w16[300];
    for (uint32_t n = 0; n <= 300; n += 1 + n / 16)
        for (uint32_t top = 0; top < (n ? n : 1); top += 1 + top / 8) {
            for (uint32_t i = 0; i < n; i++) {
                w32[i] = (i * 2654435761u) & 0x3fffffffu; /* below the planted maximum, either sign */
                w16[i] = (uint16_t)((i * 40503u) & 0x3fff);
            }
            if (n) w32[top] = 0xff800001u, w16[top] = 0xfc01; /* a negative NaN: magnitude beats all */
            assert_int_equal(pkv__max_abs32_avx2(w32, n), pkv__max_abs32_ref(w32, n));
            assert_int_equal(pkv__max_abs16_avx2(w16, n), pkv__max_abs16_ref(w16, n));
            if (n) assert_int_equal(pkv__max_abs32_ref(w32, n), 0x7f800001u);
        }
}
#endif

static void test_avx2_equals_ref(void **state) {
    (void)state;
#if defined(__x86_64__) || defined(__i386__)
    const uint32_t need = PKV_CPU_AVX2 | PKV_CPU_FMA | PKV_CPU_F16C;
    if ((pkv__cpu_features() & need) != need) {
        skip();
        return;
    }
    check_variant("avx2", PKV_DTYPE_Q8_0, pkv__q8_0_encode_ref, pkv__q8_0_decode_ref, pkv__q8_0_encode_avx2, pkv__q8_0_decode_avx2);
    check_variant("avx2", PKV_DTYPE_Q4_0, pkv__q4_0_encode_ref, pkv__q4_0_decode_ref, pkv__q4_0_encode_avx2, pkv__q4_0_decode_avx2);
    check_variant("avx2", PKV_DTYPE_FP8_E4M3, pkv__fp8_encode_ref, pkv__fp8_decode_ref, pkv__fp8_encode_avx2, pkv__fp8_decode_avx2);
    check_16bit_avx2();
#else
    skip();
#endif
}

/* ---- f16 and bf16, every bit pattern ---------------------------------------------------------
 * The pool's f16 / bf16 rows (pkv__row_encode / pkv__row_decode, what pkv_write_kv and
 * pkv_seq_gather use, and the reference kernels' scalar reads) against the test's own
 * conversions (support_util.c: ldexp and nearbyint, written apart from the library): every one
 * of the 65536 codes decodes to the same f32 bits (NaN to a NaN of the same sign) and encodes
 * back to itself; and f32 values at every code, at the midpoint to the next code (a tie: to
 * even), and one f32 step either side of it encode as round-to-nearest-even says. That covers
 * subnormals, the smallest normal, the largest finite (65504 / 3.39e38) and overflow to inf. */
static void check_16bit_format(pkv_dtype dt) {
    float (*dec)(uint16_t) = dt == PKV_DTYPE_F16 ? tu_f16_to_f32 : tu_bf16_to_f32;
    uint16_t (*enc)(float) = dt == PKV_DTYPE_F16 ? tu_f32_to_f16 : tu_f32_to_bf16;
    const uint16_t inf = dt == PKV_DTYPE_F16 ? 0x7c00 : 0x7f80;
    static uint16_t codes[65536], back[65536];
    static float vals[65536];
    for (uint32_t i = 0; i < 65536; i++) codes[i] = (uint16_t)i;
    pkv__row_decode(dt, codes, 65536, vals);
    for (uint32_t i = 0; i < 65536; i++) {
        const float want = dec((uint16_t)i);
        if (isnan(want)) {
            if (!isnan(vals[i]) || signbit(vals[i]) != signbit(want))
                fail_msg("%s 0x%04x: decodes to %g, want a NaN of its sign", pkv_dtype_name(dt), i, (double)vals[i]);
        } else if (fbits(vals[i]) != fbits(want)) {
            fail_msg("%s 0x%04x: decodes to %a, want %a", pkv_dtype_name(dt), i, (double)vals[i], (double)want);
        }
    }
    /* the scalar conversion alone (the reference kernels' reads, a row's tail), bit for bit;
       on x86-64 again with the FPU flushing subnormals (FTZ and DAZ in MXCSR, as an engine may
       set them): f16's subnormals are formed from normal numbers, so the mode cannot touch them;
       and rounding down (FE_DOWNWARD: a conversion that subtracted to make a subnormal gave -0
       for +0 there) */
    for (int flush = 0; flush < 3; flush++) {
        if (flush == 2) assert_int_equal(fesetround(FE_DOWNWARD), 0);
#if defined(__x86_64__)
        const unsigned csr = _mm_getcsr();
        if (flush == 1) _mm_setcsr(csr | 0x8040u);
#else
        if (flush == 1) continue;
#endif
        uint32_t bad = 65536;
        for (uint32_t i = 0; i < 65536 && bad == 65536; i++) {
            const float got = dt == PKV_DTYPE_F16 ? pkv__f16_to_f32((uint16_t)i) : pkv__bf16_to_f32((uint16_t)i);
            if (isnan(vals[i]) ? !isnan(got) || signbit(got) != signbit(vals[i]) : fbits(got) != fbits(vals[i])) bad = i;
        }
#if defined(__x86_64__)
        _mm_setcsr(csr);
#endif
        fesetround(FE_TONEAREST);
        if (bad < 65536)
            fail_msg("%s 0x%04x: the scalar conversion (flush %d) differs from the row's %a", pkv_dtype_name(dt), bad,
                     flush, (double)vals[bad]);
    }
    pkv__row_encode(dt, vals, 65536, back);
    for (uint32_t i = 0; i < 65536; i++) {
        const bool nan = (i & 0x7fff) > inf;
        if (nan ? (back[i] & 0x7fff) <= inf || (back[i] & 0x8000) != (i & 0x8000) : back[i] != i)
            fail_msg("%s 0x%04x: encodes back as 0x%04x", pkv_dtype_name(dt), i, back[i]);
    }
    /* f32 inputs: each finite code, the midpoint to the next one up in magnitude (or to where
       the next would be, past the largest finite), and one f32 step either side of that; in one
       row, so the vector path (not only its scalar tail) encodes them */
    const uint32_t n = 8u * inf;
    float *x = malloc(sizeof(float) * n);
    uint16_t *got = malloc(sizeof(uint16_t) * n);
    assert_non_null(x), assert_non_null(got);
    for (uint32_t i = 0; i < inf; i++)
        for (uint32_t sgn = 0; sgn < 2; sgn++) {
            const double lo = dec((uint16_t)i), hi = i + 1 < inf ? dec((uint16_t)(i + 1)) : 2.0 * lo - dec((uint16_t)(i - 1));
            const float mid = (float)((lo + hi) / 2); /* exact: the formats have fewer bits than f32 */
            const float v[4] = {(float)lo, mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
            for (uint32_t j = 0; j < 4; j++) x[8 * i + 4 * sgn + j] = sgn ? -v[j] : v[j];
        }
    pkv__row_encode(dt, x, n, got);
    for (uint32_t i = 0; i < n; i++)
        if (got[i] != enc(x[i]))
            fail_msg("%s: %a encodes as 0x%04x, want 0x%04x", pkv_dtype_name(dt), (double)x[i], got[i], enc(x[i]));
    free(x), free(got);
}

static void test_f16_bf16_every_code(void **state) {
    (void)state;
    check_16bit_format(PKV_DTYPE_F16);
    check_16bit_format(PKV_DTYPE_BF16);
}

/* The dispatched entry points (whatever backend was chosen) produce the reference bytes. */
static void enc_q8(const float *x, uint32_t d, void *o) { pkv__row_encode(PKV_DTYPE_Q8_0, x, d, o); }
static void dec_q8(const void *s, uint32_t d, float *y) { pkv__row_decode(PKV_DTYPE_Q8_0, s, d, y); }
static void enc_q4(const float *x, uint32_t d, void *o) { pkv__row_encode(PKV_DTYPE_Q4_0, x, d, o); }
static void dec_q4(const void *s, uint32_t d, float *y) { pkv__row_decode(PKV_DTYPE_Q4_0, s, d, y); }
static void enc_f8(const float *x, uint32_t d, void *o) { pkv__row_encode(PKV_DTYPE_FP8_E4M3, x, d, o); }
static void dec_f8(const void *s, uint32_t d, float *y) { pkv__row_decode(PKV_DTYPE_FP8_E4M3, s, d, y); }

static void test_dispatch_equals_ref(void **state) {
    (void)state;
    const char *be = pkv__qrow_backend();
    assert_true(!strcmp(be, "ref") || !strcmp(be, "avx2"));
    check_variant(be, PKV_DTYPE_Q8_0, pkv__q8_0_encode_ref, pkv__q8_0_decode_ref, enc_q8, dec_q8);
    check_variant(be, PKV_DTYPE_Q4_0, pkv__q4_0_encode_ref, pkv__q4_0_decode_ref, enc_q4, dec_q4);
    check_variant(be, PKV_DTYPE_FP8_E4M3, pkv__fp8_encode_ref, pkv__fp8_decode_ref, enc_f8, dec_f8);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_row_bytes_and_support),
        cmocka_unit_test(test_q8_0_known_vector),
        cmocka_unit_test(test_q4_0_known_vector),
        cmocka_unit_test(test_fp8_known_vector),
        cmocka_unit_test(test_q8_0_ties_to_even),
        cmocka_unit_test(test_e4m3_scalar_known),
        cmocka_unit_test(test_e4m3_exhaustive),
        cmocka_unit_test(test_q8_0_roundtrip_bound),
        cmocka_unit_test(test_q4_0_roundtrip_bound),
        cmocka_unit_test(test_fp8_roundtrip_bound),
        cmocka_unit_test(test_zero_blocks),
        cmocka_unit_test(test_saturation_and_nonfinite),
        cmocka_unit_test(test_avx2_equals_ref),
        cmocka_unit_test(test_dispatch_equals_ref),
        cmocka_unit_test(test_f16_bf16_every_code),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
