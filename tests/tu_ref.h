/* tu_ref.h: the arithmetic the double-precision oracles share. */
#ifndef PKV_TU_REF_H
#define PKV_TU_REF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* On the oracles' inner loops (tu_dot, each test's reference attention): no AddressSanitizer
 * checks there. They read buffers the test sized itself and never touch the library's; under ASan
 * at -O1 their checked loads had been 37% of test_attn's time in CI's ASan stage, which is there
 * to check the library's code. UBSan still covers them, and every other test line keeps ASan. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define TU_ORACLE __attribute__((no_sanitize("address")))
#else
#define TU_ORACLE
#endif

/* sum a[i] * b[i] in double, over four running sums: one chain of dependent adds waits out the
 * add's latency at every element, which made the reference the slowest part of test_attn (a
 * quarter of its time, more under qemu); the sums' order differs from one chain's by rounding
 * far below any tolerance the tests hold the kernels to */
TU_ORACLE static inline double tu_dot(const float *a, const float *b, size_t n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i < n % 4; i++) s0 += (double)a[i] * b[i]; /* the odd ones first, then fours */
    for (; i < n; i += 4) {
        s0 += (double)a[i] * b[i];
        s1 += (double)a[i + 1] * b[i + 1];
        s2 += (double)a[i + 2] * b[i + 2];
        s3 += (double)a[i + 3] * b[i + 3];
    }
    return (s0 + s1) + (s2 + s3);
}

/* x rounded to bf16, nearest even: what the kernels do to their inputs under PKV_ATTN_BF16_DOT
 * and PKV_ATTN_F16_AS_BF16 (finite values) */
static inline float tu_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

#endif
