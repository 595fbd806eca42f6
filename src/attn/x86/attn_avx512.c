/* attn_avx512.c: AVX-512 (F, BW, VL, DQ) primitives of paged attention (f32, f16, bf16 K/V,
 * softmax): score tiles of 4 rows x 4 keys reduced by transpose-add trees (for f16 and bf16
 * row groups software-pipelined), the next block's K run prefetched in 4 shares per score tile
 * and its V run in one share per key of each accum tile, accum tiles of 4 rows x 64 columns
 * (docs/design.md has the measurements on Zen 4). bf16 K and V are read in even-odd order
 * (attn.h: a 64-byte load widened by a shift and a mask), so bf16 queries are prepared in it
 * here and acc kept in it; the other query preparations stay the AVX2 ones (the table is
 * filled by pkv__attn_fill_avx2 first). test_attn compares it with the reference wherever
 * the CPU has it, and everywhere else as "avx512-emu": this file compiled with PKV_AVX512_EMU,
 * its 512-bit intrinsics emulated on AVX2 (avx512_emu.h). Calls with PKV_ATTN_BF16_DOT take
 * the bf16 dot-product kernels at the end of the file where the CPU has AVX512_BF16. */
#include "../attn.h"

#include <math.h>
#include <string.h>
#ifdef PKV_AVX512_EMU /* tests only: the same kernels on AVX2, through avx512_emu.h */
#include "avx512_emu.h"
#define PKV__AVX512_FILL pkv__attn_fill_avx512_emu
#define PKV__AVX512_NAME "avx512-emu"
#else
#include <immintrin.h>
#define PKV__AVX512_FILL pkv__attn_fill_avx512
#define PKV__AVX512_NAME "avx512"
#endif
#include "bf16_x86.h" /* bf16 rounding and V pairs, shared with attn_amx.c */
#include "fp8_x86.h"  /* fp8 e4m3 rows widened for the transposed primitives */

static inline __m512 ld_f32(const void *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld_f16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 ld_bf16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float sc_f32(const void *p, uint32_t i) { return ((const float *)p)[i]; }
static inline float sc_f16(const void *p, uint32_t i) { return _cvtsh_ss(((const uint16_t *)p)[i]); }
static inline float sc_bf16(const void *p, uint32_t i) {
    union { uint32_t u; float f; } x = {(uint32_t)((const uint16_t *)p)[i] << 16};
    return x.f;
}

/* K for score step d (16 values from d) of a row: LDK_T(row, d, D32), D32 = head_dim & ~31. bf16
 * rows are read in even-odd order (attn.h): a step in a full group of 32 loads the group's 64
 * bytes and takes its even values (the low halves of the 32-bit lanes, shifted up) or its odd
 * ones (the high halves, the low ones masked off). The second step loads the same line again
 * from L1. */
static inline __m512 bf16_even(__m512i z) { return _mm512_castsi512_ps(_mm512_slli_epi32(z, 16)); }
static inline __m512 bf16_odd(__m512i z) {
    return _mm512_castsi512_ps(_mm512_and_si512(z, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline __m512 ldk_bf16(const uint8_t *row, uint32_t d, uint32_t D32) {
    if (d >= D32) return ld_bf16(row + 2 * (size_t)d);
    const __m512i z = _mm512_loadu_si512((const void *)(row + 2 * (size_t)(d & ~31u)));
    return (d & 16) ? bf16_odd(z) : bf16_even(z);
}
#define LDK_f32(row, d, D32) ld_f32((row) + 4 * (size_t)(d))
#define LDK_f16(row, d, D32) ld_f16((row) + 2 * (size_t)(d))
#define LDK_bf16(row, d, D32) ldk_bf16(row, d, D32)
/* V for an accum tile of C 16-column vectors x[0 .. C) from row vr: LDV_T(x, vr, C). A tile
 * starts at a multiple of 64 columns (accum_rows), so for bf16 its pairs of vectors (0, 1) and
 * (2, 3) are full groups of 32 in even-odd order and a last odd vector is past the last group. */
#define LDV_PLAIN(T, x, vr, C)                                                                                  \
    for (uint32_t c_ = 0; c_ < (C); c_++) x[c_] = ld_##T((vr) + 16 * sizeof(elem_##T) * c_)
#define LDV_f32(x, vr, C) LDV_PLAIN(f32, x, vr, C)
#define LDV_f16(x, vr, C) LDV_PLAIN(f16, x, vr, C)
#define LDV_bf16(x, vr, C)                                                                                      \
    do {                                                                                                        \
        uint32_t c_ = 0;                                                                                        \
        for (; c_ + 2 <= (C); c_ += 2) {                                                                        \
            const __m512i z_ = _mm512_loadu_si512((const void *)((vr) + 32 * c_));                              \
            x[c_] = bf16_even(z_), x[c_ + 1] = bf16_odd(z_);                                                    \
        }                                                                                                       \
        if (c_ < (C)) x[c_] = ld_bf16((vr) + 32 * c_);                                                          \
    } while (0)

typedef float elem_f32;
typedef uint16_t elem_f16;
typedef uint16_t elem_bf16;

#include "avx512_reduce.h" /* the transpose-add trees: HSUM4X4, hsum4, hmax4 */

/* ---- score: tiles of 4 rows x 4 keys (16 accumulators of 32), 16 elements per step ----------
 * A tile of 4 keys whose head_dim is a multiple of 16 (every head_dim the bench and the tests'
 * shapes use but the odd ones) reduces its accumulators by the trees above and stores each row's
 * 4 scores at once; other tiles reduce one accumulator at a time. */
#define DEF_SCORE(T)                                                                                            \
    static inline __attribute__((always_inline)) void score_tile_##T(const float *q, size_t qs, const uint8_t *k, \
                                                                     size_t krb, const uint32_t R, const uint32_t K, \
                                                                     uint32_t D, float *s, uint32_t ss,         \
                                                                     pkv__attn_pf *pf, const uint32_t sub) {    \
        __m512 acc[4][4];                                                                                       \
        const uint32_t D16 = D & ~15u, D32 = D & ~31u;                                                          \
        (void)D32;                                                                                              \
        if (R == 4 && K == 4 && D % 8 == 0 && SCORE_TILE4Y_##T(q, qs, k, krb, D, s, ss, pf, sub)) return;      \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm512_setzero_ps();                                   \
        for (uint32_t part = 0; part < sub; part++) { /* sub spans, a prefetch share between them */           \
            const uint32_t d1 = D16 / 16 * (part + 1) / sub * 16;                                               \
            for (uint32_t d = D16 / 16 * part / sub * 16; d < d1; d += 16) {                                    \
                __m512 kk[4];                                                                                   \
                for (uint32_t t = 0; t < K; t++) kk[t] = LDK_##T(k + t * krb, d, D32);                          \
                for (uint32_t r = 0; r < R; r++) {                                                              \
                    const __m512 x = _mm512_loadu_ps(q + r * qs + d);                                           \
                    for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm512_fmadd_ps(x, kk[t], acc[r][t]);          \
                }                                                                                               \
            }                                                                                                   \
            if (part + 1 < sub) pkv__attn_pf_step(pf);                                                          \
        }                                                                                                       \
        if (K == 4 && D16 == D) {                                                                               \
            if (R == 4) {                                                                                       \
                if (YFOLD_##T) { /* halves added, then the 256-bit tree: on Zen 4 cheaper than 512-bit levels */ \
                    __m256 y[4][4];                                                                             \
                    _Pragma("GCC unroll 4") for (uint32_t r = 0; r < 4; r++)                                    \
                        _Pragma("GCC unroll 4") for (uint32_t t = 0; t < 4; t++)                                \
                            y[r][t] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),                          \
                                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1))); \
                    YSUM4X4_STORE(y, s, ss);                                                                    \
                    return;                                                                                     \
                }                                                                                               \
                hstore4x4(HSUM4X4(acc), s, ss);                                                                 \
            } else                                                                                              \
                for (uint32_t r = 0; r < R; r++)                                                                \
                    _mm_storeu_ps(s + r * ss, hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));               \
            return;                                                                                             \
        }                                                                                                       \
        /* fully unrolled, so acc is only indexed by constants and stays in registers */                      \
        _Pragma("GCC unroll 4") for (uint32_t r = 0; r < R; r++)                                                \
            _Pragma("GCC unroll 4") for (uint32_t t = 0; t < K; t++) {                                          \
                float o = _mm512_reduce_add_ps(acc[r][t]);                                                      \
                for (uint32_t d = D16; d < D; d++) o += q[r * qs + d] * sc_##T(k + t * krb, d);                 \
                s[r * ss + t] = o;                                                                              \
            }                                                                                                   \
    }

/* ---- accum: tiles of 4 rows x 64 columns (16 of the 32 registers accumulate) across the block's keys */
#define DEF_ACCUM(T)                                                                                            \
    static inline __attribute__((always_inline)) void accum_tile_##T(const float *p, uint32_t ps, const size_t pts, \
                                                                     const uint32_t R, const uint8_t *v, size_t vrb, \
                                                                     uint32_t n_keys,                           \
                                                                     const uint32_t C, float *acc, uint32_t D,  \
                                                                     pkv__attn_pf *pf) {                        \
        __m512 a[4][4];                                                                                         \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);                   \
        size_t pfs;                                                                                             \
        uint32_t pfn;                                                                                           \
        int pfl;                                                                                                \
        ptrdiff_t pfd;                                                                                          \
        const uint8_t *pfx = pkv__attn_pf_take(pf, n_keys, &pfs, &pfn, &pfl, &pfd); /* a share per key */       \
        for (uint32_t t = 0; t < n_keys; t++) {                                                                 \
            const uint8_t *vr = v + t * vrb;                                                                    \
            __m512 x[4];                                                                                        \
            if (t < pfn) pkv__attn_pf_burst(pfx + t * pfs, pfs, pfl, pfd);                                      \
            LDV_##T(x, vr, C);                                                                                  \
            for (uint32_t r = 0; r < R; r++) {                                                                  \
                const __m512 w = _mm512_set1_ps(p[r * ps + t * pts]);                                           \
                for (uint32_t c = 0; c < C; c++) a[r][c] = _mm512_fmadd_ps(w, x[c], a[r][c]);                   \
            }                                                                                                   \
        }                                                                                                       \
        for (uint32_t r = 0; r < R; r++)                                                                        \
            for (uint32_t c = 0; c < C; c++) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);                   \
    }                                                                                                           \
    /* weights p[r * ps + t * pts]: pts 1 (accum), or the transposed path's rp (accum_t) */                  \
    static inline __attribute__((always_inline)) void accum_rows_pts_##T(const float *p, uint32_t ps,          \
                                                                         const size_t pts,                      \
                                                                         const uint32_t R, const uint8_t *v,    \
                                                                         size_t vrb, uint32_t n_keys, uint32_t D, \
                                                                         float *acc, size_t as, pkv__attn_pf *pf) { \
        const size_t esz = sizeof(elem_##T);                                                                    \
        uint32_t d = 0; /* 64-column tiles, then one of 48, 32 or 16 (PKV__ATTN_ACCUM_TILES) */                 \
        for (; D - d >= 64; d += 64) accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 4, acc + d, as, pf); \
        if (D - d >= 48) accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 3, acc + d, as, pf), d += 48;  \
        else if (D - d >= 32) accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 2, acc + d, as, pf), d += 32; \
        else if (D - d >= 16) accum_tile_##T(p, ps, pts, R, v + d * esz, vrb, n_keys, 1, acc + d, as, pf), d += 16; \
        for (uint32_t i = 0; i < R; i++) /* head_dim not a multiple of 16 */                                    \
            for (uint32_t t = 0; t < n_keys; t++) {                                                             \
                const float w = p[i * ps + t * pts];                                                            \
                for (uint32_t e = d; e < D; e++) acc[(size_t)i * as + e] += w * sc_##T(v + t * vrb, e);         \
            }                                                                                                   \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void accum_rows_##T(const float *p, uint32_t ps, const uint32_t R, \
                                                                     const uint8_t *v, size_t vrb, uint32_t n_keys, \
                                                                     uint32_t D, float *acc, pkv__attn_pf *pf) { \
        accum_rows_pts_##T(p, ps, 1, R, v, vrb, n_keys, D, acc, D, pf);                                         \
    }

/* The 4 rows' 4 sums of 16 ymm accumulators a[r][t] (a macro over the array, as HSUM4X4) stored
 * to s[r * ss + t]: pairs, then quads by 64-bit unpacks, then the two 128-bit lanes of two rows. */
#define YPAIR(x, y) _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
#define YQUAD(x, y)                                                                                             \
    _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))),              \
                  _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))))
#define YROW(a, r) YQUAD(YPAIR(a[r][0], a[r][1]), YPAIR(a[r][2], a[r][3]))
#define YLANES(x, y) _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31))
#define YSUM4X4_STORE(a, s, ss)                                                                                 \
    do {                                                                                                        \
        const __m256 x01_ = YLANES(YROW(a, 0), YROW(a, 1)), x23_ = YLANES(YROW(a, 2), YROW(a, 3));              \
        _mm_storeu_ps(s, _mm256_castps256_ps128(x01_));                                                         \
        _mm_storeu_ps(s + ss, _mm256_extractf128_ps(x01_, 1));                                                  \
        _mm_storeu_ps(s + 2 * ss, _mm256_castps256_ps128(x23_));                                                \
        _mm_storeu_ps(s + 3 * ss, _mm256_extractf128_ps(x23_, 1));                                              \
    } while (0)

/* ---- f32 score, 256-bit: a tile of 4 rows x 4 keys in 16 ymm accumulators, 8 elements per step ----
 * Zen 4 runs a 512-bit op as two 256-bit halves, so the same FMAs at 256 bits cost the same, while
 * the reduction tree (42 ymm ops against 45 zmm ones) costs half. With the 32 registers of
 * AVX-512 the 16 accumulators fit. Measured (ab-decode): f32 in cache 0.964 and 1/1.014, from
 * memory (4096 x 16, 2 threads, paged) 0.987 and 1/1.012, 32768 x 1 on one thread 0.943. The same
 * tile for f16 was 4% faster in cache but 4.5-6.5% slower from memory (its 16-byte K loads; a
 * 32-byte load split in two was slower in cache), for bf16 1.4% slower in cache (8-lane
 * widenings): DEF_SCORE takes it through SCORE_TILE4Y_T, which is 0 (not taken) for those two. */
static inline __attribute__((always_inline)) void score_tile4y_f32(const float *q, size_t qs, const uint8_t *k,
                                                                  size_t krb, uint32_t D, float *s, uint32_t ss,
                                                                  pkv__attn_pf *pf, const uint32_t sub) {
    __m256 a[4][4];
    for (uint32_t r = 0; r < 4; r++)
        for (uint32_t t = 0; t < 4; t++) a[r][t] = _mm256_setzero_ps();
    for (uint32_t part = 0; part < sub; part++) { /* sub spans, a prefetch share between them */
        const uint32_t d1 = D / 8 * (part + 1) / sub * 8;
        for (uint32_t d = D / 8 * part / sub * 8; d < d1; d += 8) {
            __m256 kk[4];
            for (uint32_t t = 0; t < 4; t++) kk[t] = _mm256_loadu_ps((const float *)(k + t * krb) + d);
            for (uint32_t r = 0; r < 4; r++) {
                const __m256 x = _mm256_loadu_ps(q + r * qs + d);
                for (uint32_t t = 0; t < 4; t++) a[r][t] = _mm256_fmadd_ps(x, kk[t], a[r][t]);
            }
        }
        if (part + 1 < sub) pkv__attn_pf_step(pf);
    }
    YSUM4X4_STORE(a, s, ss);
}
/* runs the 4 x 4 tile at 256 bits and gives 1, or gives 0 (the 512-bit tile runs) */
#define SCORE_TILE4Y_f32(...) (score_tile4y_f32(__VA_ARGS__), 1)
#define SCORE_TILE4Y_f16(...) 0
#define SCORE_TILE4Y_bf16(...) 0
/* The 512-bit 4 x 4 tiles' reduction: their 16 accumulators folded to 256 bits, then
 * YSUM4X4_STORE, for f16: ab-decode in cache 0.983 and 1/1.011, from memory (4096 x 16, 2
 * threads, paged) 0.982 and 1/1.015. bf16 measured 1% slower in cache both ways (1.010, 1/0.990)
 * and keeps HSUM4X4. (f32's 4 x 4 tiles are the 256-bit ones above.) */
#define YFOLD_f32 1
#define YFOLD_f16 1
#define YFOLD_bf16 0

DEF_SCORE(f32)
DEF_SCORE(f16)
DEF_SCORE(bf16)
/* Prefetch shares per score tile (attn.h): 4, one after each quarter of head_dim, so the next
 * block's lines go out 4 to 8 at a time rather than 16 to 32 after the tile (measured when score
 * prefetched both runs; since the V run went to accum, 2 shares measured the same). On Zen 4 from memory
 * (ab-decode, 2 threads, 4096 x 16): f32 0.914, f16 0.918 (contig), f16 paged 1/1.060 (the
 * other order), bf16 0.953; 2 shares: f32 0.917, f16 0.993; 8 shares: f32 0.911, f16 0.955 but
 * 19% slower in cache (4: 1.005). */
#define PKV__ATTN_PF_SUB_f32 4
#define PKV__ATTN_PF_SUB_f16 4
#define PKV__ATTN_PF_SUB_bf16 4
/* Where pf->fine asks (Zen 5, attn.c's pf_fine), a decode head's score takes 8: ab-decode from
 * memory at 2 threads 0.945-0.975 (f16, bf16), f32 0.959; at 1 thread 0.986 and 1.017; but in
 * cache (f16 512 x 1) 1.08-1.11, and prefill's many rows 18-20% slower, so not there. Since the
 * two-level prefetch (attn.h, pkv__attn_pf.near; stop 39) f16 and bf16 take 4 there as well
 * (8 against 4 then: in cache 1/0.928 and 1/0.910, from memory at 1 thread 1/0.973, at 2
 * threads 0.98-1.03 either way), and f32 keeps 8 (4 measured 1.089 at 1 thread, 1.024 at 2). */
#define PKV__ATTN_PF_SUB_FINE_f32 8
#define PKV__ATTN_PF_SUB_FINE_f16 4
#define PKV__ATTN_PF_SUB_FINE_bf16 4
/* ---- score of a 4-row group, software-pipelined: tile i's reduction after tile i + 1's first step
 * The plain tile ends on its reduction tree, which waits for the tile's last FMAs and holds up
 * the next tile's behind it. Here a tile's 16 accumulators are folded to 8 by the tree's first
 * level (pairs) right after its last step, and the rest of the tree runs after the next tile's
 * first step (a multiply, which starts its 16 accumulators), when those 8 are ready. The
 * driver's prefetch steps are taken as in score_tile (sub per tile, the last after the tile).
 * f16 (ab-decode, stop 19, with the V prefetch in accum): in cache 0.981 and 1/1.037, from
 * memory (4096 x 16, 2 threads) paged 0.974 and 1/1.015, contig 0.981 and 1/0.994, 32768 x 1
 * 0.971 and 1/1.018. Before the V prefetch moved to accum the same tile was 12-18% slower
 * from memory (docs/design.md). */
#define RUN4_STEP(T, d, FIRST)                                                                                  \
    do {                                                                                                        \
        __m512 kk_[4];                                                                                          \
        for (uint32_t j_ = 0; j_ < 4; j_++) kk_[j_] = LDK_##T(kt + j_ * krb, d, D32);                          \
        for (uint32_t r_ = 0; r_ < 4; r_++) {                                                                   \
            const __m512 x_ = _mm512_loadu_ps(q + r_ * qs + (d));                                               \
            for (uint32_t j_ = 0; j_ < 4; j_++)                                                                 \
                acc[r_][j_] = (FIRST) ? _mm512_mul_ps(x_, kk_[j_]) : _mm512_fmadd_ps(x_, kk_[j_], acc[r_][j_]); \
        }                                                                                                       \
    } while (0)
/* the tree's levels 2 to 4 over the 8 pair sums h[2 r], h[2 r + 1] of rows r, each row's 4 scores stored */
#define RUN4_FINISH(h, st)                                                                                      \
    do {                                                                                                        \
        hstore4x4(hlanes(hlanes(HQUAD(_mm512_add_ps, h[0], h[1]), HQUAD(_mm512_add_ps, h[2], h[3])),            \
                         hlanes(HQUAD(_mm512_add_ps, h[4], h[5]), HQUAD(_mm512_add_ps, h[6], h[7]))),           \
                  st, ss);                                                                                      \
    } while (0)
/* Scores keys [0, t) of a 4-row group, t the largest multiple of 4 <= n_keys, and gives t (0, and
 * nothing done, where the shape is not one it takes: the driver's tiles do it). */
#define DEF_SCORE_RUN4(T)                                                                                       \
    static inline __attribute__((always_inline)) uint32_t score_run4_##T(const float *q, size_t qs,             \
                                                                         const uint8_t *k, size_t krb,          \
                                                                         const uint32_t R, uint32_t n_keys,     \
                                                                         uint32_t D, float *s, uint32_t ss,     \
                                                                         pkv__attn_pf *pf, const uint32_t sub) { \
        if (R != 4 || D % 16 != 0 || n_keys < 8) return 0;                                                      \
        const uint32_t D16 = D / 16, D32 = D & ~31u;                                                            \
        (void)D32;                                                                                              \
        __m512 h[8] = {_mm512_setzero_ps()}; /* the previous tile's pair sums (zeroed for the compiler's sake) */ \
        uint32_t t = 0;                                                                                         \
        for (; t + 4 <= n_keys; t += 4) {                                                                       \
            const uint8_t *kt = k + (size_t)t * krb;                                                            \
            __m512 acc[4][4];                                                                                   \
            RUN4_STEP(T, 0, 1);                                                                                 \
            if (t) RUN4_FINISH(h, s + t - 4);                                                                   \
            for (uint32_t part = 0; part < sub; part++) { /* sub spans (step 0 done), a prefetch step after each */ \
                const uint32_t d1 = D16 * (part + 1) / sub * 16;                                                \
                for (uint32_t d = PKV_MAX(16u, D16 * part / sub * 16); d < d1; d += 16) RUN4_STEP(T, d, 0);    \
                pkv__attn_pf_step(pf);                                                                          \
            }                                                                                                   \
            for (uint32_t r = 0; r < 4; r++) {                                                                  \
                h[2 * r] = HPAIR(_mm512_add_ps, acc[r][0], acc[r][1]);                                          \
                h[2 * r + 1] = HPAIR(_mm512_add_ps, acc[r][2], acc[r][3]);                                      \
            }                                                                                                   \
        }                                                                                                       \
        RUN4_FINISH(h, s + t - 4);                                                                              \
        return t;                                                                                               \
    }
DEF_SCORE_RUN4(f16)
DEF_SCORE_RUN4(bf16)
/* the driver's hook (attn.h): f16 and bf16 take the pipelined run (bf16: in cache 0.987 and
 * 1/1.012, from memory 1.005 and 1/0.992); f32 keeps its 256-bit tiles */
#define PKV__ATTN_SCORE_RUN(T, ...) score_run4_##T(__VA_ARGS__)
#define score_run4_f32(...) 0u

PKV__ATTN_DEF_SCORE_ROWS4(f32)
PKV__ATTN_DEF_SCORE_ROWS4(f16)
PKV__ATTN_DEF_SCORE_ROWS4(bf16)
DEF_ACCUM(f32)
DEF_ACCUM(f16)
DEF_ACCUM(bf16)
#define PKV__ATTN_ACCUM_TILES(D) ((D) / 64 + ((D) % 64 >= 16)) /* accum_rows' column tiles */
PKV__ATTN_DEF_ACCUM_ROWS(f32)
PKV__ATTN_DEF_ACCUM_ROWS(f16)
PKV__ATTN_DEF_ACCUM_ROWS(bf16)

/* ---- softmax (same polynomial as the AVX2 path) ------------------------------------------------ */
/* e^x = 2^n * y: returns y (a polynomial in x - n ln 2) and sets n and keep (the lanes not below
 * -87.3, not -inf, not nan: the others give 0) */
static inline __attribute__((always_inline)) __m512 exp16_poly(__m512 x, __m512 *n_out, __mmask16 *keep) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    *keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    *n_out = n;
    return _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}
static inline __m512 exp16(__m512 x) {
    __m512 n;
    __mmask16 keep;
    const __m512 y = exp16_poly(x, &n, &keep);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e));
}

/* the vector of softmax_x86.h: 16 lanes */
typedef __m512 vf;
#define VF_N 16
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_zero _mm512_setzero_ps
#define vf_max _mm512_max_ps
#define vf_sub _mm512_sub_ps
#define vf_add _mm512_add_ps
#define vf_exp exp16
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_abs _mm512_abs_ps
#define vf_copysign(t, x) /* t >= 0 */                                                                           \
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),                                                  \
                                        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))))
#define vf_if_lt(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x)
#define vf_if_eq(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), y, x)
#define vf_hmax _mm512_reduce_max_ps
#define vf_hsum _mm512_reduce_add_ps
#define vf_hmax4 hmax4
#define vf_hsum4 hsum4
#define LAZY_T 8.0f
static inline int vf_all_le(__m512 x, __m512 t) { return _mm512_cmp_ps_mask(x, t, _CMP_GT_OQ) == 0; }
/* lanes 4-15 are zeros (e^0, unused) */
static inline __m128 exp4(__m128 x) {
    return _mm512_castps512_ps128(exp16(_mm512_insertf32x4(_mm512_setzero_ps(), x, 0)));
}
#include "softmax_x86.h"

/* ---- the transposed primitives (tpath_x86.h) ------------------------------------------------- */
/* e^x as exp16 (the same polynomial), with 2^n applied by one scalef, which also gives the zero
 * for x < -87.3, -inf and nan through the mask: 14 operations against exp16's 19 (its results
 * may differ from exp16's in the last bit). */
static inline __m512 exp16_scalef(__m512 x) {
    __m512 n;
    __mmask16 keep;
    const __m512 y = exp16_poly(x, &n, &keep);
    return _mm512_maskz_scalef_ps(keep, y, n);
}
#define vf_exp_t exp16_scalef
#define vf_ne_bits(a, b) ((uint32_t)_mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ))
#define TP_NK 8 /* 16 accumulators, 2 qt vectors, a broadcast: of 32 registers */
#define TP_NK1 16 /* against one vector of rows: 16 accumulators */
#define TP_WHOLE_MAX 128u
#define TP_WIDEN_LD(T, row, d, D) LDK_##T(row, d, (D) & ~31u) /* bf16: even-odd groups, as prep_q and acc */
#define TP_E4M3_LD(p) _mm512_cvtph_ps(pkv__e4m3_f16x16(p))
#include "tpath_x86.h"

/* x, or (round) x rounded to bf16 as PKV_ATTN_BF16_DOT rounds queries (bf16_round_lo), as f32 */
static inline __attribute__((always_inline)) __m512 eo_value(__m512 x, const bool round) {
    return round ? _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round_lo(x), 16)) : x;
}

/* bf16 queries, scaled, in even-odd order (attn.h): each full group of 32 by two two-source
 * permutes. A sweep's chunks prepare every sequence's queries before they start reading
 * (sweep_claim_queries in attn.c), so this copy is on the call's critical path. */
static inline __attribute__((always_inline)) void prep_eo(const float *q, size_t q_stride, uint32_t n_rows,
                                                           uint32_t head_dim, float scale, void *qp,
                                                           const bool round) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    const uint32_t D32 = head_dim & ~31u;
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 vs = _mm512_set1_ps(scale);
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = (float *)((uint8_t *)qp + r * qrow);
        const float *src = q + r * q_stride;
        uint32_t d = 0;
        for (; d < D32; d += 32) {
            const __m512 a = _mm512_loadu_ps(src + d), b = _mm512_loadu_ps(src + d + 16);
            _mm512_storeu_ps(dst + d, eo_value(_mm512_mul_ps(_mm512_permutex2var_ps(a, ie, b), vs), round));
            _mm512_storeu_ps(dst + d + 16, eo_value(_mm512_mul_ps(_mm512_permutex2var_ps(a, io, b), vs), round));
        }
        for (; d < head_dim; d++)
            dst[d] = round ? pkv__bf16_to_f32(pkv__f32_to_bf16(src[d] * scale)) : src[d] * scale;
    }
}

static void prep_bf16_eo(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    prep_eo(q, q_stride, n_rows, head_dim, scale, qp, false);
}

/* ---- bf16 K by bf16 dot products (PKV_ATTN_BF16_DOT; AVX512_BF16) ------------------------------
 * Where a call allows it, bf16 K is scored by vdpbf16ps: each prepared query row holds its values
 * (times scale) rounded to bf16, in K's own order, so one instruction multiplies 32 pairs of a
 * query row and a K row exactly and adds them into 16 f32 lanes (two products a lane), against 16
 * products for an f32 fma after the K row's widening. The 4 x 4 tiles and the prefetch shares
 * are those of the f32-query kernels above, a step covering 32 values of head_dim instead of 16;
 * the tile's sums are folded to 256 bits and reduced by the 256-bit tree (YSUM4X4_STORE: in the
 * L3, dot / f32 time 0.884 against 0.915 with the 512-bit tree, stop 59). The real instruction treats subnormal bf16 inputs as 0 and rounds
 * each lane's sum to nearest even (the emulated build, "avx512-emu", sums the same products in
 * another order). */
#ifdef PKV_AVX512_EMU
#define BF16DP
#else
#define BF16DP __attribute__((target("avx512bf16")))
#endif
static inline __m512bh as_bh(__m512i x) {
    __m512bh r;
    memcpy(&r, &x, sizeof r);
    return r;
}
/* Query rows times scale rounded to bf16, in K's own order, zeros past head_dim up to a multiple
 * of 32 values (a row's room is QROW bytes, head_dim floats: enough). The product is taken in
 * f32 and then rounded; q and scale are finite, so a product that overflows rounds to infinity. */
static void prep_bf16dp(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale, void *qp) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    const uint32_t D32 = (head_dim + 31) & ~31u;
    const __m512 vs = _mm512_set1_ps(scale);
    for (uint32_t r = 0; r < n_rows; r++) {
        uint8_t *dst = (uint8_t *)qp + r * qrow;
        const float *src = q + r * q_stride;
        uint32_t d = 0;
        for (; d < head_dim; d += 16) {
            const uint32_t n = head_dim - d < 16 ? head_dim - d : 16;
            const __m512 x = _mm512_maskz_loadu_ps((__mmask16)(n == 16 ? 0xffffu : (1u << n) - 1u), src + d);
            _mm256_storeu_si256((__m256i *)(dst + 2 * (size_t)d), bf16_round16(_mm512_mul_ps(x, vs)));
        }
        for (; d < D32; d += 16) _mm256_storeu_si256((__m256i *)(dst + 2 * (size_t)d), _mm256_setzero_si256());
    }
}
/* The 32 bf16 values of group g of a K row: full groups loaded whole; the last one's values
 * past head_dim are 0 and not read. */
static inline __attribute__((always_inline)) __m512i ldk_dp(const uint8_t *row, uint32_t g, uint32_t D) {
    if (32 * g + 32 <= D) return _mm512_loadu_si512((const void *)(row + 64 * (size_t)g));
    uint16_t t[32] = {0};
    memcpy(t, row + 64 * (size_t)g, 2 * (size_t)(D - 32 * g));
    return _mm512_loadu_si512((const void *)t);
}
static inline __attribute__((always_inline)) BF16DP void score_tile_dp(const uint8_t *q, size_t qrow,
                                                                       const uint8_t *k, size_t krb, const uint32_t R,
                                                                       const uint32_t K, uint32_t D, float *s,
                                                                       uint32_t ss, pkv__attn_pf *pf,
                                                                       const uint32_t sub) {
    __m512 acc[4][4];
    const uint32_t G = (D + 31) / 32;
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm512_setzero_ps();
    for (uint32_t part = 0; part < sub; part++) { /* sub spans, a prefetch share between them */
        const uint32_t g1 = G * (part + 1) / sub;
        for (uint32_t g = G * part / sub; g < g1; g++) {
            __m512i kk[4];
            for (uint32_t t = 0; t < K; t++) kk[t] = ldk_dp(k + t * krb, g, D);
            for (uint32_t r = 0; r < R; r++) {
                const __m512bh x = as_bh(_mm512_loadu_si512((const void *)(q + r * qrow + 64 * (size_t)g)));
                for (uint32_t t = 0; t < K; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], x, as_bh(kk[t]));
            }
        }
        if (part + 1 < sub) pkv__attn_pf_step(pf);
    }
    if (R == 4 && K == 4) {
        __m256 y[4][4];
        _Pragma("GCC unroll 4") for (uint32_t r = 0; r < 4; r++)
            _Pragma("GCC unroll 4") for (uint32_t t = 0; t < 4; t++)
                y[r][t] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1)));
        YSUM4X4_STORE(y, s, ss);
        return;
    }
    _Pragma("GCC unroll 4") for (uint32_t r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (uint32_t t = 0; t < K; t++) s[r * ss + t] = _mm512_reduce_add_ps(acc[r][t]);
}
static inline __attribute__((always_inline)) BF16DP void score_dp_all(const void *qp, uint32_t n_rows,
                                                                      const uint8_t *k, size_t krb, uint32_t n_keys,
                                                                      uint32_t D, float *s, uint32_t ss,
                                                                      pkv__attn_pf *pf) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const uint32_t sub = PKV__ATTN_PF_SUB_bf16;
    const uint8_t *q = qp;
    pkv__attn_pf_start(pf, (n_keys + 3) / 4 * ((n_rows + 3) / 4) * sub); /* sub per tile */
    for (uint32_t r = 0; r < n_rows; r += 4) {
        const uint32_t R = PKV_MIN(4u, n_rows - r);
        const uint8_t *qr = q + r * qrow;
        float *sr = s + (size_t)r * ss;
        uint32_t t = 0;
        if (R == 4)
            for (; t + 4 <= n_keys; t += 4) {
                score_tile_dp(qr, qrow, k + t * krb, krb, 4, 4, D, sr + t, ss, pf, sub);
                pkv__attn_pf_step(pf);
            }
        for (; t < n_keys; t += 4) {
            score_tile_dp(qr, qrow, k + t * krb, krb, R, PKV_MIN(4u, n_keys - t), D, sr + t, ss, pf, sub);
            pkv__attn_pf_step(pf);
        }
    }
}
static BF16DP void score_bf16dp(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,
                                uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {
    if (D == 128) /* the common head_dim, with constant trip counts */
        score_dp_all(qp, n_rows, k, krb, n_keys, 128, s, ss, pf);
    else
        score_dp_all(qp, n_rows, k, krb, n_keys, D, s, ss, pf);
}

/* p.V by bf16 dot products (PKV_ATTN_BF16_DOT, bf16 V): each row's weights rounded to bf16 in
 * pairs of keys, and each pair of V rows interleaved into pairs of the same column, so that one
 * vdpbf16ps adds two keys' products into 16 columns of acc. The columns of a full group of 32
 * come out in even-odd order, as the f32-weight kernel keeps acc (attn.h): the even columns from
 * the low halves of both rows' 32-bit lanes, the odd ones from the high halves (a shift and a
 * blend each). Tiles of 4 rows x 64 columns (16 accumulators) as there; a key's prefetch share
 * per column tile as there; the columns past the last full group (head_dim not a multiple of 32)
 * with the f32 weights. */
/* v_pairs (bf16_x86.h): a 32-column group of two V rows as pairs of one column. */
/* The columns [d0, D) past the last full group, in natural order, with the f32 weights
 * p[r * rs + t * ts] of rows r < R and keys t < nk. */
static inline void accum_tail_cols(const float *p, size_t rs, size_t ts, uint32_t R, const uint8_t *vk, size_t vrb,
                                   uint32_t nk, uint32_t d0, uint32_t D, float *ar) {
    for (uint32_t r = 0; r < R && d0 < D; r++)
        for (uint32_t t = 0; t < nk; t++) {
            const float w = p[r * rs + t * ts];
            for (uint32_t d = d0; d < D; d++) ar[(size_t)r * D + d] += w * sc_bf16(vk + t * vrb, d);
        }
}
/* pb[r * rs + j * js]: row r's weights of keys 2 j and 2 j + 1 as a bf16 pair */
static inline __attribute__((always_inline)) BF16DP void accum_tile_dp(const uint32_t *pb, size_t rs, size_t js,
                                                                       const uint32_t R,
                                                                       const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                                       const uint32_t NG, float *acc, uint32_t D,
                                                                       pkv__attn_pf *pf) {
    __m512 a[4][4];
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t c = 0; c < 2 * NG; c++) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
    size_t pfs;
    uint32_t pfn;
    int pfl;
    ptrdiff_t pfd;
    const uint8_t *pfx = pkv__attn_pf_take(pf, n_keys, &pfs, &pfn, &pfl, &pfd); /* a share per key */
    for (uint32_t j = 0; 2 * j < n_keys; j++) {
        const uint8_t *va = v + 2 * j * vrb;
        const bool two = 2 * j + 1 < n_keys;
        if (2 * j < pfn) pkv__attn_pf_burst(pfx + 2 * j * pfs, pfs, pfl, pfd);
        if (two && 2 * j + 1 < pfn) pkv__attn_pf_burst(pfx + (2 * j + 1) * pfs, pfs, pfl, pfd);
        __m512i x[4];
        _Pragma("GCC unroll 2") for (uint32_t g = 0; g < NG; g++) {
            const __m512i B = two ? _mm512_loadu_si512((const void *)(va + vrb + 64 * g)) : _mm512_setzero_si512();
            v_pairs(_mm512_loadu_si512((const void *)(va + 64 * g)), B, &x[2 * g], &x[2 * g + 1]);
        }
        _Pragma("GCC unroll 4") for (uint32_t r = 0; r < R; r++) {
            const __m512bh w = as_bh(_mm512_set1_epi32((int)pb[r * rs + j * js]));
            _Pragma("GCC unroll 4") for (uint32_t c = 0; c < 2 * NG; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], w, as_bh(x[c]));
        }
    }
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t c = 0; c < 2 * NG; c++) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}
static inline __attribute__((always_inline)) BF16DP void accum_dp_all(const float *p, uint32_t ps, uint32_t n_rows,
                                                                      const uint8_t *v, size_t vrb, uint32_t n_keys,
                                                                      uint32_t D, float *acc, pkv__attn_pf *pf) {
    const uint32_t NG = D / 32, tiles = NG / 2 + NG % 2;
    pkv__attn_pf_start(pf, (n_rows + 3) / 4 * n_keys * (tiles ? tiles : 1));
    for (uint32_t r0 = 0; r0 < n_rows; r0 += 4) {
        const uint32_t R = PKV_MIN(4u, n_rows - r0);
        float *ar = acc + (size_t)r0 * D;
        for (uint32_t k0 = 0; k0 < n_keys; k0 += 32) { /* keys 32 at a time: 16 pairs of weights a row */
            const uint32_t nk = PKV_MIN(32u, n_keys - k0);
            const __mmask16 m0 = nk >= 16 ? 0xffffu : (__mmask16)((1u << nk) - 1u);
            const __mmask16 m1 = nk >= 32 ? 0xffffu : nk > 16 ? (__mmask16)((1u << (nk - 16)) - 1u) : 0;
            uint32_t pb[4][16];
            for (uint32_t r = 0; r < R; r++) {
                const float *pr = p + (size_t)(r0 + r) * ps + k0;
                _mm256_storeu_si256((__m256i *)pb[r], bf16_round16(_mm512_maskz_loadu_ps(m0, pr)));
                _mm256_storeu_si256((__m256i *)(pb[r] + 8),
                                    m1 ? bf16_round16(_mm512_maskz_loadu_ps(m1, pr + 16)) : _mm256_setzero_si256());
            }
            const uint8_t *vk = v + k0 * vrb;
            uint32_t g = 0;
            if (R == 4) { /* constant row counts, so that the tile's loops unroll */
                for (; g + 2 <= NG; g += 2) accum_tile_dp(pb[0], 16, 1, 4, vk + 64 * g, vrb, nk, 2, ar + 32 * g, D, pf);
                if (g < NG) accum_tile_dp(pb[0], 16, 1, 4, vk + 64 * g, vrb, nk, 1, ar + 32 * g, D, pf);
            } else {
                for (; g + 2 <= NG; g += 2) accum_tile_dp(pb[0], 16, 1, R, vk + 64 * g, vrb, nk, 2, ar + 32 * g, D, pf);
                if (g < NG) accum_tile_dp(pb[0], 16, 1, R, vk + 64 * g, vrb, nk, 1, ar + 32 * g, D, pf);
            }
            accum_tail_cols(p + (size_t)r0 * ps + k0, ps, 1, R, vk, vrb, nk, 32 * NG, D, ar);
        }
    }
    pkv__attn_pf_finish(pf);
}
static BF16DP void accum_bf16dp(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                uint32_t n_keys, uint32_t D, float *acc, pkv__attn_pf *pf) {
    if (D == 128) /* the common head_dim, with constant trip counts */
        accum_dp_all(p, ps, n_rows, v, vrb, n_keys, 128, acc, pf);
    else
        accum_dp_all(p, ps, n_rows, v, vrb, n_keys, D, acc, pf);
}

/* The transposed path (attn.h: score_t, accum_t) by bf16 dot products, for units of 16 query
 * rows a kv head or more (prefill) in calls with PKV_ATTN_BF16_DOT. score_t takes its queries
 * as bf16 pairs (the table's qt_pairs: lane r of pair i holds row r's values 2 i and 2 i + 1,
 * rounded to bf16 by prep_bf16dp), so that a K pair broadcast against 16 rows is one vdpbf16ps:
 * half the instructions of the f32 outer product, and no widening of K. accum_t rounds a pair of
 * keys' weights for 16 rows at a time (the scores lie a key's row of rp lanes) and runs the row
 * path's tiles above. */
static inline __attribute__((always_inline)) BF16DP void score_t_tile_dp(const uint32_t *qp, uint32_t rp,
                                                                         const uint8_t *k, size_t krb,
                                                                         const uint32_t NK, const uint32_t NV,
                                                                         uint32_t D, float *s) {
    __m512 a[8][2];
    _Pragma("GCC unroll 8") for (uint32_t t = 0; t < NK; t++)
        _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) a[t][v] = _mm512_setzero_ps();
    const uint32_t P = (D + 1) / 2; /* pairs; an odd head_dim's last K value is read alone */
    for (uint32_t i = 0; i < P; i++) {
        const uint32_t *qi = qp + (size_t)i * rp;
        const bool half = 2 * i + 1 == D;
        __m512bh x[2];
        _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) x[v] = as_bh(_mm512_loadu_si512((const void *)(qi + 16 * v)));
        _Pragma("GCC unroll 8") for (uint32_t t = 0; t < NK; t++) {
            const uint8_t *kp = k + t * krb + 4 * (size_t)i;
            uint32_t kw;
            if (half) {
                uint16_t h;
                memcpy(&h, kp, sizeof h);
                kw = h;
            } else {
                memcpy(&kw, kp, sizeof kw);
            }
            const __m512bh kb = as_bh(_mm512_set1_epi32((int)kw));
            _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) a[t][v] = _mm512_dpbf16_ps(a[t][v], kb, x[v]);
        }
    }
    _Pragma("GCC unroll 8") for (uint32_t t = 0; t < NK; t++)
        _Pragma("GCC unroll 2") for (uint32_t v = 0; v < NV; v++) _mm512_storeu_ps(s + t * rp + 16 * v, a[t][v]);
}
static inline __attribute__((always_inline)) BF16DP void score_t_keys_dp(const uint32_t *qp, uint32_t rp,
                                                                         const uint8_t *k, size_t krb,
                                                                         uint32_t n_keys, uint32_t D, float *s,
                                                                         const uint32_t NV, pkv__attn_pf *pf) {
    uint32_t t = 0;
    for (; t + 8 <= n_keys; t += 8) {
        score_t_tile_dp(qp, rp, k + t * krb, krb, 8, NV, D, s + t * rp);
        pkv__attn_pf_step(pf);
    }
    if (t < n_keys) {
        for (; t < n_keys; t++) score_t_tile_dp(qp, rp, k + t * krb, krb, 1, NV, D, s + t * rp);
        pkv__attn_pf_step(pf);
    }
}
static BF16DP void score_t_bf16dp(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys,
                                  uint32_t D, float *s, float *kbuf, pkv__attn_pf *pf) {
    (void)kbuf;
    const uint32_t *qp = (const uint32_t *)(const void *)qt;
    pkv__attn_pf_start(pf, (n_keys + 7) / 8 * ((rp + 31) / 32));
    uint32_t v = 0;
    for (; v + 32 <= rp; v += 32) score_t_keys_dp(qp + v, rp, k, krb, n_keys, D, s + v, 2, pf);
    if (v < rp) score_t_keys_dp(qp + v, rp, k, krb, n_keys, D, s + v, 1, pf);
    pkv__attn_pf_finish(pf);
}

/* accum_t's tile: the row path's (accum_tile_dp) over V pairs already interleaved, x[c] of pair j
 * at vx + j * vxs (bytes) + 64 c. */
static inline __attribute__((always_inline)) BF16DP void accum_t_tile_dp(const uint32_t *pb, const uint32_t R,
                                                                         const uint8_t *vx, size_t vxs,
                                                                         uint32_t n_pairs, const uint32_t NG,
                                                                         float *acc, uint32_t D) {
    __m512 a[4][4];
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t c = 0; c < 2 * NG; c++) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
    for (uint32_t j = 0; j < n_pairs; j++) {
        __m512bh x[4];
        _Pragma("GCC unroll 4") for (uint32_t c = 0; c < 2 * NG; c++)
            x[c] = as_bh(_mm512_loadu_si512((const void *)(vx + j * vxs + 64 * c)));
        _Pragma("GCC unroll 4") for (uint32_t r = 0; r < R; r++) {
            const __m512bh w = as_bh(_mm512_set1_epi32((int)pb[r + 16 * j]));
            _Pragma("GCC unroll 4") for (uint32_t c = 0; c < 2 * NG; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], w, x[c]);
        }
    }
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t c = 0; c < 2 * NG; c++) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}
/* 32 keys at a time: their V rows interleaved into pairs once (vbuf: 16 pairs of head_dim 32-bit
 * lanes, the room of PKV__ATTN_T_KEYS f32 rows), a prefetch step a key; then for each 16 rows
 * their weights rounded in pairs, and tiles of 4 rows x 64 columns over the pairs. */
static BF16DP void accum_t_bf16dp(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                  uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    const uint32_t NG = D / 32;
    const size_t vxs = (size_t)NG * 128; /* bytes of one pair's interleaved groups */
    uint8_t *vx = (uint8_t *)vbuf;
    pkv__attn_pf_start(pf, n_keys);
    uint32_t pb[16 * 16]; /* [pair j][row]: 32 keys of 16 rows */
    for (uint32_t k0 = 0; k0 < n_keys; k0 += 32) {
        const uint32_t nk = PKV_MIN(32u, n_keys - k0), np = (nk + 1) / 2;
        const uint8_t *vk = v + k0 * vrb;
        for (uint32_t j = 0; j < np; j++) {
            const uint8_t *va = vk + 2 * j * vrb;
            const bool two = 2 * j + 1 < nk;
            for (uint32_t g = 0; g < NG; g++) {
                const __m512i B = two ? _mm512_loadu_si512((const void *)(va + vrb + 64 * g)) : _mm512_setzero_si512();
                __m512i e, o;
                v_pairs(_mm512_loadu_si512((const void *)(va + 64 * g)), B, &e, &o);
                _mm512_storeu_si512((void *)(vx + j * vxs + 128 * g), e);
                _mm512_storeu_si512((void *)(vx + j * vxs + 128 * g + 64), o);
            }
            pkv__attn_pf_step(pf);
            if (two) pkv__attn_pf_step(pf);
        }
        for (uint32_t r16 = 0; r16 < n_rows; r16 += 16) {
            for (uint32_t j = 0; j < np; j++) { /* keys k0 + 2 j and + 1 of rows r16 .. r16 + 15 */
                const float *p0 = p + (size_t)(k0 + 2 * j) * rp + r16;
                const __m512i lo = bf16_round_lo(_mm512_loadu_ps(p0));
                const __m512i h = 2 * j + 1 < nk ? bf16_round_lo(_mm512_loadu_ps(p0 + rp))
                                                 : _mm512_setzero_si512();
                _mm512_storeu_si512((void *)(pb + 16 * j), _mm512_or_si512(lo, _mm512_slli_epi32(h, 16)));
            }
            for (uint32_t r0 = r16; r0 < n_rows && r0 < r16 + 16; r0 += 4) {
                const uint32_t R = PKV_MIN(4u, n_rows - r0);
                const uint32_t *pr = pb + (r0 - r16);
                float *ar = acc + (size_t)r0 * D;
                uint32_t g = 0;
                if (R == 4) {
                    for (; g + 2 <= NG; g += 2) accum_t_tile_dp(pr, 4, vx + 128 * g, vxs, np, 2, ar + 32 * g, D);
                    if (g < NG) accum_t_tile_dp(pr, 4, vx + 128 * g, vxs, np, 1, ar + 32 * g, D);
                } else {
                    for (; g + 2 <= NG; g += 2) accum_t_tile_dp(pr, R, vx + 128 * g, vxs, np, 2, ar + 32 * g, D);
                    if (g < NG) accum_t_tile_dp(pr, R, vx + 128 * g, vxs, np, 1, ar + 32 * g, D);
                }
                accum_tail_cols(p + (size_t)k0 * rp + r0, 1, rp, R, vk, vrb, nk, 32 * NG, D, ar);
            }
        }
    }
    pkv__attn_pf_finish(pf);
}

/* The table of calls with PKV_ATTN_BF16_DOT (attn.h: lp_fill): bf16 K and V by dot products,
 * the row path and the transposed one, queries prepared as bf16 pairs for both. */
static void lp_fill_bf16dp(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_BF16] = prep_bf16dp;
    kt->score[PKV_DTYPE_BF16] = score_bf16dp;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16dp;
    kt->score_t[PKV_DTYPE_BF16] = score_t_bf16dp;
    kt->accum_t[PKV_DTYPE_BF16] = accum_t_bf16dp;
    kt->qt_pairs[PKV_DTYPE_BF16] = true;
}

#ifndef PKV_AVX512_EMU
void pkv__attn_lp_fill_bf16dp(pkv__attn_kernels *kt) { lp_fill_bf16dp(kt); }

/* ---- PKV_ATTN_BF16_DOT's bf16 row path on f32 FMAs (avx512-amx) ------------------------------
 * The base table's bf16 score and accum over queries rounded as prep_bf16dp rounds them (q times
 * scale in f32, then to bf16, nearest even), kept as f32 in even-odd order: the same products
 * (a bf16 times a bf16 is exact in f32), added by f32 FMAs. On the Xeon of stops 86-89 vdpbf16ps
 * issues at half the rate of a 512-bit FMA, so it makes no more products a cycle, and its row
 * kernels (the rounding of the weights, V's pairs) made bf16 decode 1.14-1.19x the time of the
 * f32 ones; these cost what the f32 ones cost. The weights are not rounded here (the tiles round
 * theirs): the accum is the base's. score is a function of its own, so that the table differs
 * from the base where it rounds (pkv__attn_lp). */
static void prep_bf16_eo_lp(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim, float scale,
                            void *qp) {
    prep_eo(q, q_stride, n_rows, head_dim, scale, qp, true);
}

static void score_bf16_lp(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,
                          uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {
    score_bf16(qp, n_rows, k, krb, n_keys, D, s, ss, pf);
}

void pkv__attn_lp_rows_f32(pkv__attn_kernels *kt) {
    kt->prep_q[PKV_DTYPE_BF16] = prep_bf16_eo_lp;
    kt->score[PKV_DTYPE_BF16] = score_bf16_lp;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16;
    kt->prep_q_t[PKV_DTYPE_BF16] = prep_bf16dp; /* the transposed path's queries stay pairs (qt_pairs) */
}
BF16DP void pkv__attn_score_t_bf16dp(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys,
                                     uint32_t D, float *s, float *kbuf, pkv__attn_pf *pf) {
    score_t_bf16dp(qt, rp, k, krb, n_keys, D, s, kbuf, pf);
}
void pkv__attn_score_t_f16_x512(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                                float *s, float *kbuf, pkv__attn_pf *pf) {
    score_t_f16(qt, rp, k, krb, n_keys, D, s, kbuf, pf);
}
void pkv__attn_accum_t_f16_x512(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_f16(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf);
}
void pkv__attn_score_t_fp8_x512(const float *qt, uint32_t rp, const uint8_t *k, size_t krb, uint32_t n_keys, uint32_t D,
                                float *s, float *kbuf, pkv__attn_pf *pf) {
    score_t_fp8(qt, rp, k, krb, n_keys, D, s, kbuf, pf);
}
void pkv__attn_accum_t_fp8_x512(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_fp8(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf);
}
BF16DP void pkv__attn_accum_t_bf16dp(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t vrb,
                                     uint32_t n_keys, uint32_t D, float *acc, float *vbuf, pkv__attn_pf *pf) {
    accum_t_bf16dp(p, rp, n_rows, v, vrb, n_keys, D, acc, vbuf, pf);
}
#endif

void PKV__AVX512_FILL(pkv__attn_kernels *kt) {
    kt->name = PKV__AVX512_NAME;
    kt->score[PKV_DTYPE_F32] = score_f32;
    kt->score[PKV_DTYPE_F16] = score_f16;
    kt->score[PKV_DTYPE_BF16] = score_bf16;
    kt->accum[PKV_DTYPE_F32] = accum_f32;
    kt->accum[PKV_DTYPE_F16] = accum_f16;
    kt->accum[PKV_DTYPE_BF16] = accum_bf16;
    kt->softmax = softmax_vec;
    kt->accum_pf[PKV_DTYPE_F32] = kt->accum_pf[PKV_DTYPE_F16] = kt->accum_pf[PKV_DTYPE_BF16] = true;
    kt->prep_q[PKV_DTYPE_BF16] = prep_bf16_eo; /* bf16 K and V in even-odd order */
    kt->acc_eo[PKV_DTYPE_BF16] = true;
#ifndef PKV_AVX512_EMU
    if (pkv__cpu_features() & PKV_CPU_AVX512BF16)
#endif
        kt->lp_fill = lp_fill_bf16dp;
    tpath_fill(kt);
}
