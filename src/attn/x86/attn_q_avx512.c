/* attn_q_avx512.c: AVX-512 (F, BW, VL, DQ) primitives for fp8 e4m3 K/V: the score and the V
 * accumulation. Everything else of the quantized dtypes (the query preparations, q8_0 and q4_0;
 * their score has a VNNI version in attn_q_vnni.c)
 * stays the AVX2 code (attn_q_avx2.c fills the table first; this file overwrites the fp8
 * score and accum entries). Same arithmetic as attn_q_ref.c up to float summation order.
 *
 * Quantized decode is compute-bound (the formats read 2x-3.5x fewer bytes than f16). Measured
 * on Zen 4 in L1, cycles per (key, kv head) at 4 query rows and head_dim 128, AVX2 -> this file:
 * fp8 score 62 -> 58, accum 53 -> 49. The fp8 decode is 4 ops per 16 values here against 4 per 8
 * at 256 bits (vcvtph2ps widens 16 at once). q8_0 and q4_0 V at 512 bits measured slower on
 * Zen 4 (tiles of 4 rows x 2 blocks: q8_0 49 -> 55, q4_0 56 -> 63): it runs a 512-bit fma as two
 * 256-bit ones, so the wider vectors save only instructions, and the 512-bit sign / zero
 * extensions cost more than they save. On cores with full-width 512-bit units (the Intel
 * machine of stop 32) the 512-bit q8_0 / q4_0 accum below (pkv__attn_fill_q_avx512_wide, then
 * one block per tile) raised the in-cache decode rate 8-10%; build_kernels takes it on every
 * AVX-512 CPU but AMD family 19h (PKV_CPU_AVX512_HALVES). On Zen 5 (stop 42) two blocks a tile
 * and the block scales by a gather made decode in cache another 8-10% faster (accum_i8_tile).
 *   accum: tiles of 4 rows x 64 values (16 accumulators) across up to 16 keys; per key 4
 *     decoded vectors and 16 fmas whose weight (p * row scale * 2^8, made per 16 keys as one
 *     multiply per row) is a broadcast memory operand.
 *   score: one key at a time, the query as the fma's memory operand, 4 chains; the row scale
 *     after the sum.
 * Rows per group and head_dim 128 are constants where it counts (PKV__ATTN_NR_SWITCH). */
#include "../attn.h"
#include "../attn_q.h"
#include "../../quant/quant.h"
#ifdef PKV_AVX512_EMU /* tests only: the same kernels on AVX2, 512-bit intrinsics emulated */
#include "avx512_emu.h"
#define PKV__Q512_FILL pkv__attn_fill_q_avx512_emu
#else
#include <immintrin.h>
#define PKV__Q512_FILL pkv__attn_fill_q_avx512
#endif
#include "avx2_reduce.h"
#include "avx512_reduce.h"
#include "fp8_x86.h"

#include <stdbool.h>
#include <string.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* 16 e4m3 codes -> 16 floats equal to e4m3(b) * 2^-8 */
static ALWAYS_INLINE __m512 e4m3x16(const uint8_t *p) { return _mm512_cvtph_ps(pkv__e4m3_f16x16(p)); }

/* the rows' p for nk keys, 0 past nk, 16 per row */
static ALWAYS_INLINE void load_p(const float *p, uint32_t ps, const uint32_t NR, uint32_t nk, __m512 pr[4]) {
    const __mmask16 m = (__mmask16)((1u << nk) - 1u);
    for (uint32_t r = 0; r < NR; r++) pr[r] = _mm512_maskz_loadu_ps(m, p + (size_t)r * ps);
}

/* ---- fp8 V ----------------------------------------------------------------------------------------
 * NR rows x C * 16 values (codes at e) across nk keys; w[r * PKV__VKEYS + t] carries p, the row
 * scale and the 2^8 the decode takes off. */
static ALWAYS_INLINE void accum_fp8_tile(const float *w, uint32_t nk, const uint8_t *e, size_t vrb, float *acc,
                                         uint32_t D, const uint32_t NR, const uint32_t C) {
    __m512 a[4][4];
    for (uint32_t r = 0; r < NR; r++)
        for (uint32_t c = 0; c < C; c++) a[r][c] = _mm512_loadu_ps(acc + r * (size_t)D + 16 * c);
    for (uint32_t t = 0; t < nk; t++) {
        __m512 x[4];
        for (uint32_t c = 0; c < C; c++) x[c] = e4m3x16(e + t * vrb + 16 * c);
        for (uint32_t r = 0; r < NR; r++)
            for (uint32_t c = 0; c < C; c++)
                a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * PKV__VKEYS + t]), x[c], a[r][c]);
    }
    for (uint32_t r = 0; r < NR; r++)
        for (uint32_t c = 0; c < C; c++) _mm512_storeu_ps(acc + r * (size_t)D + 16 * c, a[r][c]);
}

static ALWAYS_INLINE void accum_fp8_rows(const float *p, uint32_t ps, const uint32_t NR, const uint8_t *v, size_t vrb,
                                         uint32_t nk, uint32_t D, float *acc) {
    float sv[PKV__VKEYS] = {0};
    for (uint32_t t = 0; t < nk; t++) memcpy(&sv[t], v + t * vrb, 4);
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sv), _mm512_set1_ps(256.0f)); /* exact: undoes the 2^-8 */
    __m512 pr[4];
    load_p(p, ps, NR, nk, pr);
    float w[4 * PKV__VKEYS] __attribute__((aligned(64)));
    for (uint32_t r = 0; r < NR; r++) _mm512_store_ps(w + r * PKV__VKEYS, _mm512_mul_ps(pr[r], s));
    const uint8_t *e = v + PKV_FP8_ROW_HEADER;
    uint32_t d = 0;
    for (; D - d >= 64; d += 64) accum_fp8_tile(w, nk, e + d, vrb, acc + d, D, NR, 4);
    if (D - d >= 48) accum_fp8_tile(w, nk, e + d, vrb, acc + d, D, NR, 3), d += 48;
    else if (D - d >= 32) accum_fp8_tile(w, nk, e + d, vrb, acc + d, D, NR, 2), d += 32;
    else if (D - d >= 16) accum_fp8_tile(w, nk, e + d, vrb, acc + d, D, NR, 1), d += 16;
    pkv__fp8_accum_tail(w, nk, e, vrb, d, D, NR, acc); /* head_dim % 16 */
}

#ifndef PKV_AVX512_EMU
/* ---- q8_0 / q4_0 V at 512 bits (pkv__attn_fill_q_avx512_wide) ------------------------------------
 * NR rows x NB (1 or 2) 32-value blocks across nk keys (block j's codes at c + j * bsz, key t at
 * + t * vrb), 8 NB accumulators; w[(j * 4 + r) * PKV__VKEYS + t] is p times key t's scale of
 * block j. q4_0: values 0..15 are the low nibbles, 16..31 the high ones, each widened to its
 * value n - 8 by one vpermps from a table of the 16 (the index is a lane's low 4 bits: the low
 * nibble as the byte is, the high one after a shift), a convert and the -8 in one op; before
 * (stop 75), a mask or shift and a convert a 16, and the -8 taken off at the end as 8 times the
 * sum of each weight row. Two blocks a tile give each accumulator's chain of fmas (4 cycles a
 * step) twice the independent work beside it: one block a tile, 8 chains of one fma a key, kept
 * the fma pipes waiting on latency. */
static ALWAYS_INLINE void accum_i8_tile(const float *w, uint32_t nk, const uint8_t *c, size_t bsz, size_t vrb,
                                        float *acc, uint32_t D, const uint32_t NR, const uint32_t NB, const bool q4) {
    const __m512 q4v = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 a[4][4];
    for (uint32_t r = 0; r < NR; r++)
        for (uint32_t h = 0; h < 2 * NB; h++) a[r][h] = _mm512_loadu_ps(acc + r * (size_t)D + 16 * h);
    for (uint32_t t = 0; t < nk; t++) {
        __m512 x[4];
        for (uint32_t j = 0; j < NB; j++) {
            const uint8_t *ct = c + j * bsz + t * vrb;
            if (q4) {
                const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ct));
                x[2 * j] = _mm512_permutexvar_ps(z, q4v);
                x[2 * j + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), q4v);
            } else {
                x[2 * j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)ct)));
                x[2 * j + 1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ct + 16))));
            }
        }
        for (uint32_t j = 0; j < NB; j++)
            for (uint32_t r = 0; r < NR; r++) {
                const __m512 wv = _mm512_set1_ps(w[(j * 4 + r) * PKV__VKEYS + t]);
                a[r][2 * j] = _mm512_fmadd_ps(wv, x[2 * j], a[r][2 * j]);
                a[r][2 * j + 1] = _mm512_fmadd_ps(wv, x[2 * j + 1], a[r][2 * j + 1]);
            }
    }
    for (uint32_t r = 0; r < NR; r++)
        for (uint32_t h = 0; h < 2 * NB; h++) _mm512_storeu_ps(acc + r * (size_t)D + 16 * h, a[r][h]);
}

/* NR rows, nk <= PKV__VKEYS keys of q8_0 / q4_0 V (D % 32 == 0): per pair of blocks, the keys'
 * scales folded into the rows' weights, then the pair's tile (one block where D / 32 is odd). */
static ALWAYS_INLINE void accum_i8_rows(const float *p, uint32_t ps, const uint32_t NR, const uint8_t *v, size_t vrb,
                                        uint32_t nk, uint32_t D, float *acc, const bool q4) {
    const size_t bsz = q4 ? sizeof(pkv_block_q4_0) : sizeof(pkv_block_q8_0);
    __m512 pr[4];
    load_p(p, ps, NR, nk, pr);
    float w[4 * 4 * PKV__VKEYS] __attribute__((aligned(64)));
    /* the keys' block scales by one gather a block: 16-bit stores read back as one vector wait
     * for the stores to retire (a store-forwarding stall, 13% of the q8_0 accum's samples). The
     * weights of 4 blocks (2 tiles) are made before their tiles: with a pair's gathers right
     * before its tile, the tile's start waited on them (stop 75: the accum alone in L2 0.94 of
     * the time, decode in cache 0.976 at q8_0 and 0.988 at q4_0, ab-decode 256 x 2) */
    const __mmask16 km = (__mmask16)((1u << nk) - 1u);
    const __m512i ix = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)vrb));
    const uint32_t nb = D / 32;
    for (uint32_t b0 = 0; b0 < nb; b0 += 4) {
        const uint32_t n4 = PKV_MIN(4u, nb - b0);
        for (uint32_t j = 0; j < n4; j++) {
            const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), km, ix, v + (b0 + j) * bsz, 1);
            const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
            for (uint32_t r = 0; r < NR; r++) _mm512_store_ps(w + (j * 4 + r) * PKV__VKEYS, _mm512_mul_ps(pr[r], d));
        }
        for (uint32_t j = 0; j < n4; j += 2) {
            const uint32_t b = b0 + j;
            const uint8_t *c = v + b * bsz + 2;
            const float *wj = w + j * 4 * PKV__VKEYS;
            if (n4 - j >= 2)
                accum_i8_tile(wj, nk, c, bsz, vrb, acc + 32 * b, D, NR, 2, q4);
            else
                accum_i8_tile(wj, nk, c, bsz, vrb, acc + 32 * b, D, NR, 1, q4);
        }
    }
}

#define ACCUM_I8_ROWS(...) accum_i8_rows(__VA_ARGS__)
#else
#define ACCUM_I8_ROWS(...) ((void)0) /* the emulated build registers no q8_0 / q4_0 accum */
#endif

/* The V side of each dtype here: keys in chunks of PKV__VKEYS, rows in groups of up to 4, each
 * (chunk, group) done by the dtype's row-tile function with the group size a constant; head_dim
 * 128, the common case, an instance of its own with constant trip counts. accum_pf is off for
 * all of them: the driver gives score both runs. */
enum v_kind { V_FP8, V_Q8_0, V_Q4_0 };

static ALWAYS_INLINE void accum_tiles_d(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                        uint32_t n_keys, uint32_t D, float *acc, const enum v_kind kind) {
#define CALL_V(N)                                                                                             \
    (kind == V_FP8 ? accum_fp8_rows(pp, ps, N, vv, vrb, nk, D, ar)                                            \
                   : ACCUM_I8_ROWS(pp, ps, N, vv, vrb, nk, D, ar, kind == V_Q4_0))
    PKV__ATTN_ACCUM_CHUNKS(PKV__VKEYS, p, ps, n_rows, v, vrb, n_keys, D, acc, CALL_V)
#undef CALL_V
}

static ALWAYS_INLINE void accum_tiles(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                      uint32_t n_keys, uint32_t D, float *acc, const enum v_kind kind) {
    if (D == 128)
        accum_tiles_d(p, ps, n_rows, v, vrb, n_keys, 128, acc, kind);
    else
        accum_tiles_d(p, ps, n_rows, v, vrb, n_keys, D, acc, kind);
}

static void accum_fp8(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                      uint32_t D, float *acc, pkv__attn_pf *pf) {
    (void)pf;
    accum_tiles(p, ps, n_rows, v, vrb, n_keys, D, acc, V_FP8);
}

#ifndef PKV_AVX512_EMU
static void accum_q8_0(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                       uint32_t D, float *acc, pkv__attn_pf *pf) {
    (void)pf;
    accum_tiles(p, ps, n_rows, v, vrb, n_keys, D, acc, V_Q8_0);
}

static void accum_q4_0(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                       uint32_t D, float *acc, pkv__attn_pf *pf) {
    (void)pf;
    accum_tiles(p, ps, n_rows, v, vrb, n_keys, D, acc, V_Q4_0);
}

void pkv__attn_fill_q_avx512_wide(pkv__attn_kernels *kt) {
    kt->accum[PKV_DTYPE_Q8_0] = accum_q8_0;
    kt->accum[PKV_DTYPE_Q4_0] = accum_q4_0;
    kt->accum_pf[PKV_DTYPE_Q8_0] = kt->accum_pf[PKV_DTYPE_Q4_0] = false;
}
#endif

/* ---- fp8 K -----------------------------------------------------------------------------------------
 * s[r * ss] = sk * <q_r, key> for NR rows and one key; the prepared query is f32 (prep_f32 of
 * attn_q_avx2.c), 4 chains of fmas with the query as the memory operand. */
static ALWAYS_INLINE void score_fp8_key(const float *const q[4], const uint32_t NR, const uint8_t *kr, uint32_t D,
                                        float *s, uint32_t ss) {
    const uint8_t *e = kr + PKV_FP8_ROW_HEADER;
    const uint32_t D16 = D & ~15u;
    __m512 a[4];
    for (uint32_t r = 0; r < NR; r++) a[r] = _mm512_setzero_ps();
    for (uint32_t d = 0; d < D16; d += 16) {
        const __m512 x = e4m3x16(e + d);
        for (uint32_t r = 0; r < NR; r++) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q[r] + d), x, a[r]);
    }
    float sk;
    memcpy(&sk, kr, 4);
    sk *= 256.0f; /* exact: undoes the decode's 2^-8 */
    __m256 h[4];
    for (uint32_t r = 0; r < NR; r++)
        h[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r]), 1)));
    if (NR == 4 && D16 == D) {
        const __m128 o = _mm_mul_ps(pkv__hsum4x8(h[0], h[1], h[2], h[3]), _mm_set1_ps(sk));
        _mm_store_ss(s, o);
        s[ss] = _mm_cvtss_f32(_mm_shuffle_ps(o, o, 1));
        s[2 * ss] = _mm_cvtss_f32(_mm_movehl_ps(o, o));
        s[3 * ss] = _mm_cvtss_f32(_mm_shuffle_ps(o, o, 3));
        return;
    }
    for (uint32_t r = 0; r < NR; r++) {
        float o = pkv__hsum8(h[r]);
        for (uint32_t d = D16; d < D; d++) o += q[r][d] * (pkv__e4m3_to_f32(e[d]) * (1.0f / 256.0f));
        s[r * ss] = o * sk;
    }
}

/* 4 rows x 4 keys (D a multiple of 16): each K vector decoded once for the 4 rows, and the 16
 * dot products reduced together by one transpose-add tree (HSUM4X4: 45 ops for the 16, where the
 * one-key path above takes about 18 a key), then the 4 keys' scales by one multiply. Measured
 * alone in L2 (4 rows, head_dim 128): 0.82-0.93 of the one-key path's time. */
static ALWAYS_INLINE void score_fp8_tile4(const float *const q[4], const uint8_t *k, size_t krb, uint32_t D, float *s,
                                          uint32_t ss) {
    __m512 acc[4][4];
    for (uint32_t r = 0; r < 4; r++)
        for (uint32_t j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (uint32_t d = 0; d < D; d += 16) {
        __m512 kk[4];
        for (uint32_t j = 0; j < 4; j++) kk[j] = e4m3x16(k + j * krb + PKV_FP8_ROW_HEADER + d);
        for (uint32_t r = 0; r < 4; r++) {
            const __m512 x = _mm512_loadu_ps(q[r] + d);
            for (uint32_t j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(x, kk[j], acc[r][j]);
        }
    }
    float sk[4];
    for (uint32_t j = 0; j < 4; j++) memcpy(&sk[j], k + j * krb, 4);
    /* times 256, exact: undoes the decode's 2^-8 */
    hstore4x4(_mm512_mul_ps(HSUM4X4(acc), _mm512_broadcast_f32x4(_mm_mul_ps(_mm_loadu_ps(sk), _mm_set1_ps(256.0f)))),
              s, ss);
}

/* Keys in groups of 4 between prefetch shares: 4 rows and D a multiple of 16 by the tile above,
 * the rest (and other shapes) a key at a time. */
static ALWAYS_INLINE void score_fp8_rows(const float *const q[4], const uint32_t NR, const uint8_t *k, size_t krb,
                                         uint32_t n_keys, uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {
    uint32_t t0 = 0;
    if (NR == 4 && D % 16 == 0)
        for (; t0 + 4 <= n_keys; t0 += 4) {
            score_fp8_tile4(q, k + t0 * krb, krb, D, s + t0, ss);
            pkv__attn_pf_step(pf);
        }
    for (uint32_t t = t0; t < n_keys; t++) {
        score_fp8_key(q, NR, k + t * krb, D, s + t, ss);
        if (t % 4 == 3 || t + 1 == n_keys) pkv__attn_pf_step(pf);
    }
}

static ALWAYS_INLINE void score_fp8_d(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,
                                      uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {
    pkv__attn_pf_start(pf, ((n_keys + 3) / 4) * ((n_rows + 3) / 4));
#define CALL_F8S(N) score_fp8_rows(q, N, k, krb, n_keys, D, sr, ss, pf)
    PKV__ATTN_SCORE_ROW_GROUPS(qp, n_rows, D, s, ss, CALL_F8S)
#undef CALL_F8S
}

static void score_fp8(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                      float *s, uint32_t ss, pkv__attn_pf *pf) {
    if (D == 128)
        score_fp8_d(qp, n_rows, k, krb, n_keys, 128, s, ss, pf);
    else
        score_fp8_d(qp, n_rows, k, krb, n_keys, D, s, ss, pf);
}

void PKV__Q512_FILL(pkv__attn_kernels *kt) {
    kt->score[PKV_DTYPE_FP8_E4M3] = score_fp8;
    kt->accum[PKV_DTYPE_FP8_E4M3] = accum_fp8;
    kt->accum_pf[PKV_DTYPE_FP8_E4M3] = false;
}
