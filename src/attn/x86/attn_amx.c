/* attn_amx.c: the transposed primitives (attn.h: score_t, accum_t) for bf16 K and V (and the
 * dtypes below) by Intel AMX tiles (AMX-BF16: Sapphire Rapids and later Xeons), in calls with PKV_ATTN_BF16_DOT: the
 * inputs rounded as by the vdpbf16ps kernels of attn_avx512.c (queries times scale and softmax
 * weights to bf16, nearest even; products exact, sums in f32, in another order: not the same
 * bits), at the tiles' rate: one
 * tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 f32 sums, 16 times the
 * products of a 512-bit FMA (stop 86: 3.9 TFLOP/s a core against 0.25 for f32 FMAs). The same
 * tiles take f16 K and V rounded to bf16 (PKV_ATTN_F16_AS_BF16), and with PKV_ATTN_BF16_DOT fp8
 * e4m3, q8_0 and q4_0 K and V, whose codes and integers are bf16 exactly: their scales go on in
 * f32 (fp8's per row on a key's scores or V row's weights; q8_0's and q4_0's per 32 values on
 * each group's scores, score_q_chunk, or on each group's own weights in accum_runs).
 *
 * score_t: s[t * rp + r] = <K row t, query row r> is C[key][row] = A[key][d] . B[d][row]: A is
 * 16 K rows straight from the pool (a tile load with the row stride), B the queries as bf16
 * pairs, which is the driver's qt_pairs layout as it stands (lane r of pair i: row r's values
 * 2 i, 2 i + 1 = a tile row of 16 pairs). C goes to s with rp lanes a row, no transposition.
 * accum_t, accum_tn: acc[r][d] += sum_t p[t][r] V[t][d] is C[row][col] = A[row][t] . B[t][col]:
 * A the weights rounded to bf16 in pairs of keys and transposed to rows (32 shuffles for 16
 * rows x 8 pairs), B two keys' V rows interleaved into pairs of one column (v_pairs, as the
 * vdpbf16ps path), whose even and odd halves land in acc's even-odd order (attn.h) as that path
 * keeps it; C tiles are loaded from acc once for up to 32 keys (accum_tn: the keys of several
 * 16-token blocks) and stored back.
 *
 * One tile configuration for both (amx_enter, called by the driver before a unit's
 * first block; _leave releases the tiles after its last, so a thread holds no tile state
 * between calls). Shapes the tiles do not cover go to the vdpbf16ps kernels: head_dim or v_dim
 * not a multiple of 32, and a unit's last rows past a multiple of 16 (accum). Built where the
 * compiler has AMX (CMake: PKV_HAVE_AMX), run where the CPU has it and Linux grants its state
 * (core.c: pkv__amx_enable). */
#include "../attn.h"

#include <immintrin.h>
#include <string.h>

#include "bf16_x86.h" /* bf16_round_lo, v_pairs: the vdpbf16ps kernels' own */
#include "fp8_x86.h"  /* pkv__e4m3_f16x16: e4m3 codes to f16, exactly */
#ifdef PKV_AMX_EMU /* tests only: the tile instructions emulated in C */
#include "amx_emu.h"
#define PKV__AMX_LP_FILL pkv__attn_lp_fill_amx_emu
#define PKV__AMX_F16_FILL pkv__attn_f16_fill_amx_emu
#else
#define PKV__AMX_LP_FILL pkv__attn_lp_fill_amx
#define PKV__AMX_F16_FILL pkv__attn_f16_fill_amx
#define TILE_CFG(c) _tile_loadconfig(c)
#define TILE_RELEASE() _tile_release()
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* GCC's tile intrinsics are asm statements with no memory operand: this fence tells the compiler
 * that the C stores before it (pa, vx, kbuf) are read by the tile loads after it, and that the
 * tile stores before it (s, sb, acc) are read by whatever C reads those after it. */
#define TILE_FENCE() __asm__ volatile("" ::: "memory")


/* The configuration: tiles 0-3 C (16 x 16 f32), 4 score's A (16 K rows x 32 bf16), 5 score's B
 * (16 pairs x 16 rows), 6 accum's A (16 rows x 16 pairs: 32 keys), 7 accum's B (16 pairs x 16
 * columns). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_cfg;

static void amx_enter(void) {
    static const tile_cfg cfg __attribute__((aligned(64))) = {
        .palette = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    TILE_CFG(&cfg);
}

static void amx_leave(void) { TILE_RELEASE(); }

/* C tiles 0..n-1 (n <= 4, a constant where inlined) += A (tile 4) . B_j, B_j at b + 64 j bytes */
#define SCORE_DP(j)                                                                                             \
    do {                                                                                                        \
        TILE_LOAD(5, bq + 64 * (j), bqs);                                                                       \
        TILE_DP(j, 4, 5);                                                                                       \
    } while (0)
#define C_ZERO(j) TILE_ZERO(j)
#define C_STORE(j, dst, stride) TILE_STORE(j, (dst) + 16 * (j), stride)

/* The K and V dtypes of the tiles: bf16 from the pool, f16 taken as bf16
 * (PKV_ATTN_F16_AS_BF16), and in calls with PKV_ATTN_BF16_DOT fp8 e4m3 codes and q8_0 / q4_0
 * integers, whose values are bf16 exactly (their scales applied in f32). */
enum kv_kind { KV_BF16, KV_F16, KV_FP8, KV_Q8, KV_Q4 };
#define KV_GROUPED(kind) ((kind) == KV_Q8 || (kind) == KV_Q4) /* a scale per 32 values */

/* One key chunk of 16 rows (ka, stride kas) against rows [n0, n0 + 16 n) of the queries, over
 * the groups [g0, g1) of 32 columns: C[key][row] into s (stride ss bytes). */
static inline __attribute__((always_inline)) void score_chunk_g(const uint32_t *qp, uint32_t rp, const uint8_t *ka,
                                                                    size_t kas, uint32_t g0, uint32_t g1, float *s,
                                                                    size_t ss, const uint32_t n) {
    const size_t bqs = (size_t)rp * 4;
    if (n > 0) C_ZERO(0);
    if (n > 1) C_ZERO(1);
    if (n > 2) C_ZERO(2);
    if (n > 3) C_ZERO(3);
    for (uint32_t g = g0; g < g1; g++) { /* 32 values of head_dim: 16 pairs */
        TILE_LOAD(4, ka + 64 * (size_t)g, kas);
        const uint8_t *bq = (const uint8_t *)(qp + (size_t)16 * g * rp);
        if (n > 0) SCORE_DP(0);
        if (n > 1) SCORE_DP(1);
        if (n > 2) SCORE_DP(2);
        if (n > 3) SCORE_DP(3);
    }
    if (n > 0) C_STORE(0, s, ss);
    if (n > 1) C_STORE(1, s, ss);
    if (n > 2) C_STORE(2, s, ss);
    if (n > 3) C_STORE(3, s, ss);
}
static inline __attribute__((always_inline)) void score_chunk(const uint32_t *qp, uint32_t rp, const uint8_t *ka,
                                                                  size_t kas, uint32_t D, float *s, size_t ss,
                                                                  const uint32_t n) {
    score_chunk_g(qp, rp, ka, kas, 0, D / 32, s, ss, n);
}

/* q8_0 / q4_0 K: 16 keys' integers as bf16 rows (kb, stride kbs) against query rows [0, 16 n)
 * of qp, a group of 32 columns at a time: C = A_g . B_g into cb (C tile j at cb + 16 j: rows of
 * 64 floats), then s[key][row] = (g 0) or += (later groups) the key's scale of group g times C,
 * for the nk keys of the chunk (key t's row at s + t ss bytes) */
static inline __attribute__((always_inline)) void score_q_chunk(const uint32_t *qp, uint32_t rp, const uint8_t *kb,
                                                                    size_t kbs, uint32_t NG, const float *dk,
                                                                    float *s, size_t ss, uint32_t nk, const uint32_t n,
                                                                    float *cb) {
    for (uint32_t g = 0; g < NG; g++) {
        score_chunk_g(qp, rp, kb, kbs, g, g + 1, cb, 256, n);
        TILE_FENCE(); /* cb written by the tiles */
        for (uint32_t j = 0; j < n; j++)
            for (uint32_t t = 0; t < nk; t++) {
                float *st = (float *)(void *)((uint8_t *)s + t * ss) + 16 * j;
                const __m512 x = _mm512_mul_ps(_mm512_load_ps(cb + 64 * t + 16 * j), _mm512_set1_ps(dk[16 * g + t]));
                _mm512_storeu_ps(st, g ? _mm512_add_ps(_mm512_loadu_ps(st), x) : x);
            }
        TILE_FENCE(); /* cb read before the next group's tile stores */
    }
}

/* One key chunk against query rows [n0, n0 + 16 n): score_chunk, or score_q_chunk for q8_0 /
 * q4_0 (dk: the keys' group scales, nk keys, cb: its buffer) */
static inline __attribute__((always_inline)) void score_rows(const uint32_t *qp, uint32_t rp, const uint8_t *ka,
                                                                 size_t kas, uint32_t D, float *s, size_t ss,
                                                                 const int kind, const float *dk, uint32_t nk,
                                                                 float *cb, const uint32_t n) {
    if (KV_GROUPED(kind)) score_q_chunk(qp, rp, ka, kas, D / 32, dk, s, ss, nk, n, cb);
    else score_chunk(qp, rp, ka, kas, D, s, ss, n);
}

/* A key chunk against every query row [0, rp): 64 rows at a time, then the rest */
static inline __attribute__((always_inline)) void score_keys(const uint32_t *qp, uint32_t rp, const uint8_t *ka,
                                                                 size_t kas, uint32_t D, float *s, size_t ss,
                                                                 const int kind, const float *dk, uint32_t nk,
                                                                 float *cb) {
    uint32_t n0 = 0;
    for (; n0 + 64 <= rp; n0 += 64) score_rows(qp + n0, rp, ka, kas, D, s + n0, ss, kind, dk, nk, cb, 4);
    switch ((rp - n0) / 16) {
    case 3: score_rows(qp + n0, rp, ka, kas, D, s + n0, ss, kind, dk, nk, cb, 3); break;
    case 2: score_rows(qp + n0, rp, ka, kas, D, s + n0, ss, kind, dk, nk, cb, 2); break;
    case 1: score_rows(qp + n0, rp, ka, kas, D, s + n0, ss, kind, dk, nk, cb, 1); break;
    default: break;
    }
}

/* f16 K and V taken as bf16: 16 f16 values at p widened, and two such
 * vectors rounded to bf16, nearest even, by vcvtne2ps2bf16 (AVX512_BF16, which every AMX CPU
 * has): x's in the low 16 words, y's in the high ones. Its treatment of f32 denormals never
 * applies: f16 values widen to normal floats. */
static inline __attribute__((always_inline)) __m512 f16_widen(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}
/* 16 fp8 e4m3 codes at p as floats, each the code's value times 2^-8 (fp8_x86.h): 4 significant
 * bits and exponents within bf16's, so bf16_pack keeps them exactly (the row's scale, times 2^8,
 * is applied to the scores (K) or the weights (V), in f32) */
static inline __attribute__((always_inline)) __m512 fp8_widen(const uint8_t *p) {
    return _mm512_cvtph_ps(pkv__e4m3_f16x16(p));
}
/* q8_0 and q4_0 rows: groups of 32 values, each an f16 scale and 32 int8 (34 bytes) or 16 bytes
 * of nibbles (18 bytes; value j in qs[j]'s low nibble, j + 16 in its high one: quant.h). The
 * integers of group g, its values 16 h .. 16 h + 15 (h 0 or 1), as floats (int8, or the nibble
 * minus 8: exact), and the group's scale. */
static inline __attribute__((always_inline)) __m512 q_widen(const uint8_t *row, uint32_t g, uint32_t h,
                                                              const int kind) {
    if (kind == KV_Q8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(row + 34 * (size_t)g + 2 + 16 * h))));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(row + 18 * (size_t)g + 2)));
    const __m512i nib = h ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(nib, _mm512_set1_epi32(8)));
}
static inline float q_scale(const uint8_t *row, uint32_t g, const int kind) {
    uint16_t h;
    memcpy(&h, row + (kind == KV_Q8 ? 34 : 18) * (size_t)g, sizeof h);
    return _cvtsh_ss(h);
}
/* a K or V row's 16 values from column d on (a multiple of 16), widened: f16, fp8 (past its
 * scale), q8_0 / q4_0 (their integers) */
static inline __attribute__((always_inline)) __m512 kv_widen(const uint8_t *row, uint32_t d, const int kind) {
    if (KV_GROUPED(kind)) return q_widen(row, d / 32, d / 16 % 2, kind);
    return kind == KV_FP8 ? fp8_widen(row + PKV_FP8_ROW_HEADER + d) : f16_widen(row + 2 * (size_t)d);
}
/* an fp8 row's scale times 2^8: what its codes' values above leave out */
static inline float fp8_scale256(const uint8_t *row) {
    float sc;
    memcpy(&sc, row, sizeof sc);
    return sc * 256.0f;
}
static inline __attribute__((always_inline)) __m512i bf16_pack(__m512 x, __m512 y) {
    return (__m512i)_mm512_cvtne2ps_pbh(y, x);
}

/* score_t over bf16 rows: each 16 keys' rows as A tiles, bf16 K's straight from the pool, f16
 * K's rounded to bf16 and fp8 K's codes and q8_0 / q4_0 K's integers (exact) into kbuf (2 D
 * bytes a row), a last chunk of fewer keys' there too, padded with zero rows; its scores 16
 * query rows at a time through sb (1 KiB past the rows); fp8: each key's scores then times its
 * scale times 2^8, after the sums, as the f32 kernel (tpath_x86.h: score_t_fp8); q8_0 / q4_0:
 * the keys' group scales past the rows (dk, where sb would be), each group's sums times its
 * scale (score_q_chunk), so the sums of a group are exact products added in f32 and K is not
 * rounded. qt as bf16 pairs (qt_pairs, or the driver's qt_round of f32 rows for the others:
 * prep_q_t for q8_0 / q4_0); head_dim a multiple of 32, rp of 16. */
static inline __attribute__((always_inline)) void score_t_tiles(const float *qt, uint32_t rp, const uint8_t *k,
                                                                  size_t krb, uint32_t n_keys, uint32_t D, float *s,
                                                                  float *kbuf, pkv__attn_pf *pf, const int kind) {
    const uint32_t *qp = (const uint32_t *)(const void *)qt;
    uint8_t *kb = (uint8_t *)kbuf; /* room for 16 rows of D floats: 16 rows of D bf16 and the scores */
    float *sb = (float *)(void *)(kb + (size_t)32 * D);
    float *dk = sb;                                 /* q8_0 / q4_0: [group][key], 16 D / 32 floats */
    float cb[KV_GROUPED(kind) ? 4 * 256 : 1] __attribute__((aligned(64))); /* score_q_chunk's */
    pkv__attn_pf_start(pf, (n_keys + 15) / 16);
    for (uint32_t t0 = 0; t0 < n_keys; t0 += 16) {
        const uint32_t nk = PKV_MIN(16u, n_keys - t0);
        const uint8_t *ka = k + t0 * krb;
        size_t kas = krb;
        if (kind != KV_BF16 || nk < 16) {
            for (uint32_t t = 0; t < 16; t++) {
                uint8_t *dst = kb + (size_t)t * 2 * D;
                if (t >= nk) {
                    memset(dst, 0, (size_t)2 * D);
                    continue;
                }
                const uint8_t *src = ka + t * krb;
                if (kind == KV_BF16) memcpy(dst, src, (size_t)2 * D);
                else
                    for (uint32_t d = 0; d < D; d += 32)
                        _mm512_storeu_si512((void *)(dst + 2 * d),
                                            bf16_pack(kv_widen(src, d, kind), kv_widen(src, d + 16, kind)));
                if (KV_GROUPED(kind))
                    for (uint32_t g = 0; g < D / 32; g++) dk[16 * g + t] = q_scale(src, g, kind);
            }
            ka = kb, kas = (size_t)2 * D;
            TILE_FENCE(); /* kb's rows written */
        }
        if (nk == 16 || KV_GROUPED(kind)) { /* score_q_chunk writes the nk keys' rows alone */
            score_keys(qp, rp, ka, kas, D, s + (size_t)t0 * rp, (size_t)rp * 4, kind, dk, nk, cb);
        } else {
            for (uint32_t n0 = 0; n0 < rp; n0 += 16) {
                TILE_FENCE(); /* sb's last scores read */
                score_chunk(qp + n0, rp, ka, kas, D, sb, 64, 1);
                TILE_FENCE();
                for (uint32_t t = 0; t < nk; t++) memcpy(s + (size_t)(t0 + t) * rp + n0, sb + 16 * t, 64);
            }
        }
        TILE_FENCE(); /* kb and s's scores read and written by the tiles before C goes on */
        if (kind == KV_FP8)
            for (uint32_t t = 0; t < nk; t++) {
                const __m512 sk = _mm512_set1_ps(fp8_scale256(k + (t0 + t) * krb));
                float *st = s + (size_t)(t0 + t) * rp;
                for (uint32_t r = 0; r < rp; r += 16) _mm512_storeu_ps(st + r, _mm512_mul_ps(_mm512_loadu_ps(st + r), sk));
            }
        pkv__attn_pf_step(pf);
    }
    pkv__attn_pf_finish(pf);
}

static void score_t_amx(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                        float *s, float *kbuf, pkv__attn_pf *pf) {
    if (D % 32 || rp % 16) {
        pkv__attn_score_t_bf16dp(qt, rp, k, krb, n_keys, D, s, kbuf, pf);
        return;
    }
    score_t_tiles(qt, rp, k, krb, n_keys, D, s, kbuf, pf, KV_BF16);
}

/* f16 K (PKV_ATTN_F16_AS_BF16); head_dim not a multiple of 32: qt is f32 (pkv__attn_qt_round),
 * the f32 kernel's. rp is a multiple of 16, as the driver pads it. */
static void score_t_amx_f16(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                            float *s, float *kbuf, pkv__attn_pf *pf) {
    if (D % 32) {
        pkv__attn_score_t_f16_x512(qt, rp, k, krb, n_keys, D, s, kbuf, pf);
        return;
    }
    score_t_tiles(qt, rp, k, krb, n_keys, D, s, kbuf, pf, KV_F16);
}

static void score_t_amx_q8(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                           float *s, float *kbuf, pkv__attn_pf *pf) {
    score_t_tiles(qt, rp, k, krb, n_keys, D, s, kbuf, pf, KV_Q8);
}
static void score_t_amx_q4(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                           float *s, float *kbuf, pkv__attn_pf *pf) {
    score_t_tiles(qt, rp, k, krb, n_keys, D, s, kbuf, pf, KV_Q4);
}

/* fp8 K (PKV_ATTN_BF16_DOT); head_dim not a multiple of 32: the f32 kernel's, as score_t_amx_f16 */
static void score_t_amx_fp8(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                            float *s, float *kbuf, pkv__attn_pf *pf) {
    if (D % 32) {
        pkv__attn_score_t_fp8_x512(qt, rp, k, krb, n_keys, D, s, kbuf, pf);
        return;
    }
    score_t_tiles(qt, rp, k, krb, n_keys, D, s, kbuf, pf, KV_FP8);
}

/* Pairs of keys' weights of 16 rows as 8 vectors: x[j] lane r = row r's bf16 weights of keys
 * 2 j, 2 j + 1 (p + t * rp, lanes r0 .. r0 + 15 already applied; keys past nk: 0; where ws is
 * set, key t's times ws[t] first, in f32), turned into
 * rows by an 8 x 16 transpose of 32-bit lanes (unpack by 32 and 64 bits, then the 128-bit
 * lanes): y[v] = row 2 v's 8 pairs, then row 2 v + 1's. */
static inline __attribute__((always_inline)) __m512 weight_row(const float *p, uint32_t rp, uint32_t t,
                                                                 const float *ws) {
    const __m512 w = _mm512_loadu_ps(p + (size_t)t * rp);
    return ws ? _mm512_mul_ps(w, _mm512_set1_ps(ws[t])) : w;
}
static inline __attribute__((always_inline)) void weights_rows8(const float *p, uint32_t rp, uint32_t nk,
                                                                    const float *ws, __m512i y[8]) {
    __m512i x[8];
    for (uint32_t j = 0; j < 8; j++) {
        const __m512i lo = 2 * j < nk ? bf16_round_lo(weight_row(p, rp, 2 * j, ws)) : _mm512_setzero_si512();
        const __m512i hi = 2 * j + 1 < nk ? bf16_round_lo(weight_row(p, rp, 2 * j + 1, ws)) : _mm512_setzero_si512();
        x[j] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    }
    /* aJl, aJh: rows 4k, 4k + 1 (l) or 4k + 2, 4k + 3 (h) of pairs J, J + 1, 128-bit lane k */
    const __m512i a01l = _mm512_unpacklo_epi32(x[0], x[1]), a01h = _mm512_unpackhi_epi32(x[0], x[1]);
    const __m512i a23l = _mm512_unpacklo_epi32(x[2], x[3]), a23h = _mm512_unpackhi_epi32(x[2], x[3]);
    const __m512i a45l = _mm512_unpacklo_epi32(x[4], x[5]), a45h = _mm512_unpackhi_epi32(x[4], x[5]);
    const __m512i a67l = _mm512_unpacklo_epi32(x[6], x[7]), a67h = _mm512_unpackhi_epi32(x[6], x[7]);
    /* b[m] (pairs 0-3) and c[m] (pairs 4-7): 128-bit lane k holds row 4k + m */
    const __m512i b[4] = {_mm512_unpacklo_epi64(a01l, a23l), _mm512_unpackhi_epi64(a01l, a23l),
                          _mm512_unpacklo_epi64(a01h, a23h), _mm512_unpackhi_epi64(a01h, a23h)};
    const __m512i c[4] = {_mm512_unpacklo_epi64(a45l, a67l), _mm512_unpackhi_epi64(a45l, a67l),
                          _mm512_unpacklo_epi64(a45h, a67h), _mm512_unpackhi_epi64(a45h, a67h)};
    for (uint32_t m = 0; m < 4; m += 2) { /* rows 4k + m, 4k + m + 1: y[2k + m / 2] */
        const __m512i pq01 = _mm512_shuffle_i32x4(b[m], c[m], 0x44), pq23 = _mm512_shuffle_i32x4(b[m], c[m], 0xEE);
        const __m512i rs01 = _mm512_shuffle_i32x4(b[m + 1], c[m + 1], 0x44);
        const __m512i rs23 = _mm512_shuffle_i32x4(b[m + 1], c[m + 1], 0xEE);
        y[0 + m / 2] = _mm512_shuffle_i32x4(pq01, rs01, 0x88);
        y[2 + m / 2] = _mm512_shuffle_i32x4(pq01, rs01, 0xDD);
        y[4 + m / 2] = _mm512_shuffle_i32x4(pq23, rs23, 0x88);
        y[6 + m / 2] = _mm512_shuffle_i32x4(pq23, rs23, 0xDD);
    }
}

/* The weights of 32 keys (p + t * rp, lanes = 16 rows; keys past nk: 0; times ws[t] where set)
 * as accum's A tile: pa[r * 16 + j] = the bf16 pair of keys 2 j, 2 j + 1 of row r. */
static inline __attribute__((always_inline)) void weights_a(const float *p, uint32_t rp, uint32_t nk,
                                                                const float *ws, uint32_t *pa) {
    __m512i ya[8], yb[8];
    weights_rows8(p, rp, nk, ws, ya);
    if (nk > 16) weights_rows8(p + (size_t)16 * rp, rp, nk - 16, ws ? ws + 16 : NULL, yb);
    else
        for (uint32_t v = 0; v < 8; v++) yb[v] = _mm512_setzero_si512();
    for (uint32_t v = 0; v < 8; v++) { /* row 2 v: pairs 0-7 of ya, 8-15 of yb; row 2 v + 1 likewise */
        _mm512_storeu_si512((void *)(pa + 32 * v), _mm512_shuffle_i32x4(ya[v], yb[v], 0x44));
        _mm512_storeu_si512((void *)(pa + 32 * v + 16), _mm512_shuffle_i32x4(ya[v], yb[v], 0xEE));
    }
}

/* q8_0 / q4_0 V in f32 (accum_t's contract; the rows a tile unit leaves past a multiple of 16):
 * each key's group of 32 values decoded (integer times scale: exact in f32) and added in with
 * each row's weight */
static inline __attribute__((always_inline)) void accum_q_f32(const float *p, uint32_t rp, uint32_t n_rows,
                                                                const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                                uint32_t D, float *acc, pkv__attn_pf *pf,
                                                                const int kind) {
    pkv__attn_pf_start(pf, n_keys);
    for (uint32_t t = 0; t < n_keys; t++) {
        const uint8_t *row = v + t * vrb;
        for (uint32_t g = 0; g < D / 32; g++) {
            const __m512 sc = _mm512_set1_ps(q_scale(row, g, kind));
            const __m512 lo = _mm512_mul_ps(q_widen(row, g, 0, kind), sc), hi = _mm512_mul_ps(q_widen(row, g, 1, kind), sc);
            for (uint32_t r = 0; r < n_rows; r++) {
                const __m512 w = _mm512_set1_ps(p[(size_t)t * rp + r]);
                float *a = acc + (size_t)r * D + 32 * g;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(w, lo, _mm512_loadu_ps(a)));
                _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(w, hi, _mm512_loadu_ps(a + 16)));
            }
        }
        pkv__attn_pf_step(pf);
    }
    pkv__attn_pf_finish(pf);
}
static void accum_t_q8_f32(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                           uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    (void)vbuf;
    accum_q_f32(p, rp, n_rows, v, vrb, n_keys, D, acc, pf, KV_Q8);
}
static void accum_t_q4_f32(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb, uint32_t n_keys,
                           uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    (void)vbuf;
    accum_q_f32(p, rp, n_rows, v, vrb, n_keys, D, acc, pf, KV_Q4);
}

/* The kernel of the shapes the tiles do not cover: vdpbf16ps for bf16 V (the same rounding of
 * its inputs), the f32 ones for the others (none), acc in each one's order */
static inline pkv__attn_accum_t_fn accum_fallback(const int kind) {
    switch (kind) {
    case KV_F16: return pkv__attn_accum_t_f16_x512;
    case KV_FP8: return pkv__attn_accum_t_fp8_x512;
    case KV_Q8: return accum_t_q8_f32;
    case KV_Q4: return accum_t_q4_f32;
    default: return pkv__attn_accum_t_bf16dp;
    }
}

#define ACC_B(j, vxk, c)                                                                                        \
    do {                                                                                                        \
        TILE_LOAD(7, (vxk) + 64 * (c), vxs);                                                                    \
        TILE_DP(j, 6, 7);                                                                                       \
    } while (0)

/* accum over the keys of runs (n[i] V rows at v[i]), their weights p[t * rp + r] in the runs'
 * order, up to PKV__ATTN_T_RUN_KEYS keys: every pair of keys interleaved into vx once (vbuf:
 * PKV__ATTN_T_RUN_KEYS / 2 pairs), the weights of each 16 rows and 32 keys as an A tile (pa),
 * then for each 16 rows and 4 tiles of 16 columns, acc's C tiles loaded once, every 32 keys'
 * A . B added, and stored once. */
static inline __attribute__((always_inline)) void accum_runs(const float *p, uint32_t rp, uint32_t n_rows,
                                                               const uint8_t *const *v, const uint32_t *n,
                                                               uint32_t n_runs, size_t vrb, uint32_t D, float *acc,
                                                               float *vbuf, pkv__attn_pf *pf, const int kind) {
    const uint32_t rows16 = n_rows & ~15u, NG = D / 32;
    const size_t vxs = (size_t)NG * 128, as = (size_t)D * 4; /* bytes of a pair's columns; of an acc row */
    uint8_t *vx = (uint8_t *)vbuf;
    const uint8_t *row[PKV__ATTN_T_RUN_KEYS]; /* each key's V row */
    uint32_t n_keys = 0;
    for (uint32_t i = 0; i < n_runs; i++)
        for (uint32_t t = 0; t < n[i]; t++) row[n_keys++] = v[i] + t * vrb;
    const uint32_t n_kc = (n_keys + 31) / 32;
    float ws[PKV__ATTN_T_RUN_KEYS]; /* fp8: each key's weights times its row's scale times 2^8 */
    if (kind == KV_FP8)
        for (uint32_t t = 0; t < n_keys; t++) ws[t] = fp8_scale256(row[t]);
    /* f16, fp8: words c and 16 + c (the two rows' column c) to 32-bit lane c */
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    /* [key chunk][16 rows]: A tiles (rows <= T_ROWS_PAD, 64) */
    uint32_t pa[(PKV__ATTN_T_RUN_KEYS + 31) / 32][4][16 * 16] __attribute__((aligned(64)));
    pkv__attn_pf_start(pf, n_keys);
    /* the weights first: their stores reach L1 while V is interleaved, before the tile loads
       (q8_0, q4_0: a group's own, below) */
    for (uint32_t kc = 0; kc < n_kc && !KV_GROUPED(kind); kc++)
        for (uint32_t r0 = 0; r0 < rows16; r0 += 16)
            weights_a(p + (size_t)32 * kc * rp + r0, rp, PKV_MIN(32u, n_keys - 32 * kc),
                      kind == KV_FP8 ? ws + 32 * kc : NULL, pa[kc][r0 / 16]);
    for (uint32_t j = 0; j < 16 * n_kc; j++) { /* pairs past n_keys: zeros (their weights are 0 too) */
        const bool one = 2 * j < n_keys, two = 2 * j + 1 < n_keys;
        for (uint32_t g = 0; g < NG; g++) {
            __m512i e, o;
            if (kind != KV_BF16) { /* as bf16 (f16 rounded, fp8 exact), paired by column in their own
                                      order: acc's natural order */
                const __m512 z = _mm512_setzero_ps();
                const uint8_t *ra = one ? row[2 * j] : NULL, *rb = two ? row[2 * j + 1] : NULL;
                const uint32_t d = 32 * g;
                const __m512i lo = bf16_pack(one ? kv_widen(ra, d, kind) : z, two ? kv_widen(rb, d, kind) : z); /* columns 0-15 */
                const __m512i hi = bf16_pack(one ? kv_widen(ra, d + 16, kind) : z, two ? kv_widen(rb, d + 16, kind) : z);
                e = _mm512_permutexvar_epi16(pair_idx, lo), o = _mm512_permutexvar_epi16(pair_idx, hi);
            } else {
                const __m512i A = one ? _mm512_loadu_si512((const void *)(row[2 * j] + 64 * g)) : _mm512_setzero_si512();
                const __m512i B = two ? _mm512_loadu_si512((const void *)(row[2 * j + 1] + 64 * g)) : _mm512_setzero_si512();
                v_pairs(A, B, &e, &o);
            }
            _mm512_storeu_si512((void *)(vx + j * vxs + 128 * g), e);
            _mm512_storeu_si512((void *)(vx + j * vxs + 128 * g + 64), o);
        }
        if (one) pkv__attn_pf_step(pf);
        if (two) pkv__attn_pf_step(pf);
    }
    TILE_FENCE();
    /* q8_0 / q4_0: a group's 32 columns take the weights times each key's scale of that group,
       so each group has A tiles of its own (pq: made for the two groups of 4 C tiles at a time,
       16 rows at a time); the others take pa's for every column */
    float wq[2][PKV__ATTN_T_RUN_KEYS]; /* [group of the quad][key]: the keys' scales */
    uint32_t pq[2][(PKV__ATTN_T_RUN_KEYS + 31) / 32][16 * 16] __attribute__((aligned(64)));
    for (uint32_t r0 = 0; r0 < rows16; r0 += 16) {
        float *ar = acc + (size_t)r0 * D;
        for (uint32_t c = 0; c < 2 * NG; c += 4) { /* 4 C tiles of acc held over the keys (2 where
                                                      NG is odd, at the end), B (tile 7) by turns */
            const bool four = c + 4 <= 2 * NG;
            if (KV_GROUPED(kind)) {
                TILE_FENCE(); /* pq's last A tiles loaded before it is written again */
                for (uint32_t gi = 0; gi < (four ? 2u : 1u); gi++) {
                    for (uint32_t t = 0; t < n_keys; t++) wq[gi][t] = q_scale(row[t], c / 2 + gi, kind);
                    for (uint32_t kc = 0; kc < n_kc; kc++)
                        weights_a(p + (size_t)32 * kc * rp + r0, rp, PKV_MIN(32u, n_keys - 32 * kc),
                                  wq[gi] + 32 * kc, pq[gi][kc]);
                }
                TILE_FENCE(); /* pq written */
            }
            TILE_LOAD(0, ar + 16 * c, as);
            TILE_LOAD(1, ar + 16 * (c + 1), as);
            if (four) {
                TILE_LOAD(2, ar + 16 * (c + 2), as);
                TILE_LOAD(3, ar + 16 * (c + 3), as);
            }
            for (uint32_t kc = 0; kc < n_kc; kc++) {
                const uint8_t *vxk = vx + (size_t)16 * kc * vxs;
                TILE_LOAD(6, KV_GROUPED(kind) ? pq[0][kc] : pa[kc][r0 / 16], 64);
                ACC_B(0, vxk, c);
                ACC_B(1, vxk, c + 1);
                if (four) {
                    if (KV_GROUPED(kind)) TILE_LOAD(6, pq[1][kc], 64);
                    ACC_B(2, vxk, c + 2);
                    ACC_B(3, vxk, c + 3);
                }
            }
            TILE_STORE(0, ar + 16 * c, as);
            TILE_STORE(1, ar + 16 * (c + 1), as);
            if (four) {
                TILE_STORE(2, ar + 16 * (c + 2), as);
                TILE_STORE(3, ar + 16 * (c + 3), as);
            }
        }
    }
    pkv__attn_pf_finish(pf);
    TILE_FENCE();
    const float *pt = p + rows16; /* the last rows, a run at a time */
    for (uint32_t i = 0; rows16 < n_rows && i < n_runs; pt += (size_t)n[i] * rp, i++)
        accum_fallback(kind)(pt, rp, n_rows - rows16, v[i], vrb, n[i], D, acc + (size_t)rows16 * D, vbuf, NULL);
}

/* accum_t: bf16 V, f16 V taken as bf16 (PKV_ATTN_F16_AS_BF16) or fp8, q8_0 and q4_0 V
 * (PKV_ATTN_BF16_DOT); shapes the tiles do not cover by accum_fallback */
static inline __attribute__((always_inline)) void accum_t_tiles(const float *p, uint32_t rp, uint32_t n_rows,
                                                                  const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                                  uint32_t D, float *acc, float *vbuf,
                                                                  pkv__attn_pf *pf, const int kind) {
    if (D % 32 || n_rows < 16) {
        accum_fallback(kind)(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf);
        return;
    }
    /* a block of more keys than a call of accum_runs takes: in parts of PKV__ATTN_T_RUN_KEYS */
    for (uint32_t k0 = 0; k0 < n_keys; k0 += PKV__ATTN_T_RUN_KEYS) {
        const uint8_t *const vk = v + k0 * vrb;
        const uint32_t nk = PKV_MIN(PKV__ATTN_T_RUN_KEYS, n_keys - k0);
        accum_runs(p + (size_t)k0 * rp, rp, n_rows, &vk, &nk, 1, vrb, D, acc, vbuf, k0 + nk < n_keys ? NULL : pf, kind);
    }
}

/* accum_tn: the same over runs */
static inline __attribute__((always_inline)) void accum_tn_tiles(const float *p, uint32_t rp, uint32_t n_rows,
                                                                   const uint8_t *const *v, const uint32_t *n,
                                                                   uint32_t n_runs, size_t vrb, uint32_t D, float *acc,
                                                                   float *vbuf, pkv__attn_pf *pf, const int kind) {
    if (D % 32 || n_rows < 16) {
        const float *pt = p;
        for (uint32_t i = 0; i < n_runs; pt += (size_t)n[i] * rp, i++)
            accum_fallback(kind)(pt, rp, n_rows, v[i], vrb, n[i], D, acc, vbuf, i + 1 == n_runs ? pf : NULL);
        return;
    }
    accum_runs(p, rp, n_rows, v, n, n_runs, vrb, D, acc, vbuf, pf, kind);
}

static void accum_t_amx(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                            uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_tiles(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf, KV_BF16);
}
static void accum_t_amx_f16(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                            uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_tiles(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf, KV_F16);
}
static void accum_t_amx_fp8(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                            uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_tiles(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf, KV_FP8);
}
static void accum_tn_amx(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *const *v, const uint32_t *n,
                             uint32_t n_runs, size_t vrb, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_tn_tiles(p, rp, n_rows, v, n, n_runs, vrb, D, acc, vbuf, pf, KV_BF16);
}
static void accum_tn_amx_f16(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *const *v, const uint32_t *n,
                             uint32_t n_runs, size_t vrb, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_tn_tiles(p, rp, n_rows, v, n, n_runs, vrb, D, acc, vbuf, pf, KV_F16);
}
static void accum_tn_amx_fp8(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *const *v, const uint32_t *n,
                             uint32_t n_runs, size_t vrb, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_tn_tiles(p, rp, n_rows, v, n, n_runs, vrb, D, acc, vbuf, pf, KV_FP8);
}
static void accum_t_amx_q8(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                           uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_tiles(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf, KV_Q8);
}
static void accum_tn_amx_q8(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *const *v, const uint32_t *n,
                            uint32_t n_runs, size_t vrb, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_tn_tiles(p, rp, n_rows, v, n, n_runs, vrb, D, acc, vbuf, pf, KV_Q8);
}
static void accum_t_amx_q4(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                           uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_tiles(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf, KV_Q4);
}
static void accum_tn_amx_q4(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *const *v, const uint32_t *n,
                            uint32_t n_runs, size_t vrb, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_tn_tiles(p, rp, n_rows, v, n, n_runs, vrb, D, acc, vbuf, pf, KV_Q4);
}

/* PKV_ATTN_BF16_DOT's table (attn.h: lp_fill): bf16 K and V by vdpbf16ps (pkv__attn_lp_fill_bf16dp)
 * and on tiles, and fp8 e4m3, q8_0 and q4_0 K and V on tiles (their codes and integers exact as
 * bf16, the queries rounded by the driver, qt_round, and the weights by accum_runs, as for bf16).
 * bf16's row path (decode of fewer than 16 query heads a kv head, decode read in pool order,
 * short extends) takes the rounded queries on f32 FMAs instead (pkv__attn_lp_rows_f32): here vdpbf16ps makes no more
 * products a cycle than a 512-bit FMA, and its row kernels made bf16 decode 1.14-1.19x the time
 * of the f32 ones (stop 89; on Zen 4, where it does, 0.80-0.82x: stop 59). */
void PKV__AMX_LP_FILL(pkv__attn_kernels *kt) {
    pkv__attn_lp_fill_bf16dp(kt);
    pkv__attn_lp_rows_f32(kt);
    kt->score_t[PKV_DTYPE_BF16] = score_t_amx;
    kt->accum_t[PKV_DTYPE_BF16] = accum_t_amx;
    kt->accum_tn[PKV_DTYPE_BF16] = accum_tn_amx;
    kt->score_t[PKV_DTYPE_FP8_E4M3] = score_t_amx_fp8;
    kt->accum_t[PKV_DTYPE_FP8_E4M3] = accum_t_amx_fp8;
    kt->accum_tn[PKV_DTYPE_FP8_E4M3] = accum_tn_amx_fp8;
    kt->qt_round[PKV_DTYPE_FP8_E4M3] = true;
    /* q8_0 and q4_0, whose row path takes int8 queries: the tile units' prepared rows are f32
       (the f32 K's prep), rounded to bf16 by the driver */
    kt->score_t[PKV_DTYPE_Q8_0] = score_t_amx_q8;
    kt->accum_t[PKV_DTYPE_Q8_0] = accum_t_amx_q8;
    kt->accum_tn[PKV_DTYPE_Q8_0] = accum_tn_amx_q8;
    kt->score_t[PKV_DTYPE_Q4_0] = score_t_amx_q4;
    kt->accum_t[PKV_DTYPE_Q4_0] = accum_t_amx_q4;
    kt->accum_tn[PKV_DTYPE_Q4_0] = accum_tn_amx_q4;
    kt->prep_q_t[PKV_DTYPE_Q8_0] = kt->prep_q_t[PKV_DTYPE_Q4_0] = kt->prep_q[PKV_DTYPE_F32];
    kt->qt_round[PKV_DTYPE_Q8_0] = kt->qt_round[PKV_DTYPE_Q4_0] = true;
    kt->t_enter = amx_enter;
    kt->t_leave = amx_leave;
    kt->t_dtypes |= 1u << PKV_DTYPE_BF16 | 1u << PKV_DTYPE_FP8_E4M3 | 1u << PKV_DTYPE_Q8_0 | 1u << PKV_DTYPE_Q4_0;
}

/* PKV_ATTN_F16_AS_BF16's table (attn.h: f16_fill), over the backend's or lp_fill's: f16 K and V
 * in the transposed primitives as bf16, the queries rounded by the driver (qt_round) */
void PKV__AMX_F16_FILL(pkv__attn_kernels *kt) {
    kt->score_t[PKV_DTYPE_F16] = score_t_amx_f16;
    kt->accum_t[PKV_DTYPE_F16] = accum_t_amx_f16;
    kt->accum_tn[PKV_DTYPE_F16] = accum_tn_amx_f16;
    kt->qt_round[PKV_DTYPE_F16] = true;
    kt->t_enter = amx_enter;
    kt->t_leave = amx_leave;
    kt->t_dtypes |= 1u << PKV_DTYPE_F16;
}
