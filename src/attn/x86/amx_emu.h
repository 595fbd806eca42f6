/* amx_emu.h: the AMX tile instructions attn_amx.c uses, emulated in C for tests (PKV_AMX_EMU,
 * tests/amx_emu.c: test_attn's backend "avx512-amx-emu"), so that the AMX kernels' indexing and
 * the driver's use of the tiles are checked, under ASan too, on CPUs without AMX (the AVX-512
 * BF16 machines most of this project ran on). Each thread has its own 8 tiles and configuration,
 * as the hardware does. Beyond the arithmetic it checks what the hardware faults on or leaves
 * undefined, and aborts (test code): a tile used with no configuration loaded (the driver's
 * t_enter missing), a palette other than 1, shapes a product cannot take (A's columns against
 * B's rows, C's against B's), and tiles of more than 16 rows or 64 bytes a row. tdpbf16ps: each
 * pair of bf16 products added to the f32 sum in turn (the hardware's order and rounding of the
 * sum differ: within the tests' tolerance), bf16 inputs below the normal range taken as 0. */
#ifndef PKV_AMX_EMU_H
#define PKV_AMX_EMU_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct amx_emu_state {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16 * 64];
} amx_emu_state;
static _Thread_local amx_emu_state amx_emu;

static void amx_emu_fail(const char *what, int t) {
    fprintf(stderr, "amx_emu: %s (tile %d)\n", what, t);
    abort();
}

static void amx_emu_need(int t) {
    if (!amx_emu.configured) amx_emu_fail("tile used with no configuration loaded", t);
    if (t < 0 || t > 7 || amx_emu.rows[t] == 0 || amx_emu.rows[t] > 16 || amx_emu.colsb[t] == 0 ||
        amx_emu.colsb[t] > 64)
        amx_emu_fail("tile not configured for use", t);
}

static void amx_emu_loadconfig(const void *cfg) {
    const uint8_t *c = cfg;
    if (c[0] != 1) amx_emu_fail("palette other than 1", -1);
    for (int t = 0; t < 8; t++) {
        uint16_t cb;
        memcpy(&cb, c + 16 + 2 * t, sizeof cb);
        amx_emu.colsb[t] = cb;
        amx_emu.rows[t] = c[48 + t];
    }
    memset(amx_emu.data, 0, sizeof amx_emu.data);
    amx_emu.configured = 1;
}

static void amx_emu_release(void) {
    amx_emu.configured = 0;
}

static void amx_emu_loadd(int t, const void *base, size_t stride) {
    amx_emu_need(t);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy(amx_emu.data[t] + 64 * r, (const uint8_t *)base + (size_t)r * stride, amx_emu.colsb[t]);
}

static void amx_emu_stored(int t, void *base, size_t stride) {
    amx_emu_need(t);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy((uint8_t *)base + (size_t)r * stride, amx_emu.data[t] + 64 * r, amx_emu.colsb[t]);
}

static void amx_emu_zero(int t) {
    amx_emu_need(t);
    memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
}

static float amx_emu_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    if ((h & 0x7f80u) == 0) h &= 0x8000u; /* below the normal range: 0 */
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] */
static void amx_emu_dpbf16ps(int c, int a, int b) {
    amx_emu_need(c), amx_emu_need(a), amx_emu_need(b);
    const int M = amx_emu.rows[c], N = amx_emu.colsb[c] / 4, K = amx_emu.colsb[a] / 4;
    if (amx_emu.rows[a] != M || amx_emu.rows[b] != K || amx_emu.colsb[b] != amx_emu.colsb[c] ||
        amx_emu.colsb[a] % 4 || amx_emu.colsb[c] % 4)
        amx_emu_fail("shapes a product cannot take", c);
    /* B's values as f32, its pairs' first and second halves apart, then a row of C at a time: the
       same sums in the same order per element as a loop over k innermost (k ascending, a pair's
       first product before its second), without that loop's chain of dependent adds (the emulator
       had been a third of test_attn's time) */
    float b0[16][16], b1[16][16];
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++) {
            b0[k][n] = amx_emu_bf16(amx_emu.data[b] + 64 * k + 4 * n);
            b1[k][n] = amx_emu_bf16(amx_emu.data[b] + 64 * k + 4 * n + 2);
        }
    for (int m = 0; m < M; m++) {
        float acc[16];
        memcpy(acc, amx_emu.data[c] + 64 * m, sizeof(float) * (size_t)N);
        for (int k = 0; k < K; k++) {
            const float a0 = amx_emu_bf16(amx_emu.data[a] + 64 * m + 4 * k);
            const float a1 = amx_emu_bf16(amx_emu.data[a] + 64 * m + 4 * k + 2);
            for (int n = 0; n < N; n++) {
                acc[n] += a0 * b0[k][n];
                acc[n] += a1 * b1[k][n];
            }
        }
        memcpy(amx_emu.data[c] + 64 * m, acc, sizeof(float) * (size_t)N);
    }
}

#define TILE_CFG(c) amx_emu_loadconfig(c)
#define TILE_RELEASE() amx_emu_release()
#define TILE_LOAD(t, p, s) amx_emu_loadd(t, p, (size_t)(s))
#define TILE_STORE(t, p, s) amx_emu_stored(t, p, (size_t)(s))
#define TILE_ZERO(t) amx_emu_zero(t)
#define TILE_DP(c, a, b) amx_emu_dpbf16ps(c, a, b)

#endif
