/* access_pattern.c: how fast one core reads a decode's K/V stream from memory, by the order of
 * its loads and by software prefetch, with the kernels' arithmetic left out (a fixed 8 FMAs of
 * 256 bits per 64-byte line, about what f32 decode does with 4 query heads per kv head).
 *
 *   ./build/access_pattern [ROUNDS]   (x86-64: CMake builds it with the tools, -mavx2 -mfma)
 *
 * The stream is one layer of the pool's layout (ARCHITECTURE section 3) with f32 rows at head_dim
 * 128: 8 kv heads, 16-token blocks, so each (block, head) is an 8 KiB run of K and one of V, read
 * K run then V run, head by head, block by block; V starts 68 KiB past a 2 MiB multiple from K, as
 * in the pool (cache.c, v_skew). 256 MiB of K and 256 MiB of V, on transparent huge pages.
 * Variants, each timed once per round with the rounds interleaved (the machines are shared):
 *   layout  contig (blocks in pool order) or paged (the block table shuffled);
 *   order   seq (each run front to back, line after line) or tile (the order the AVX-512 kernels
 *           load: K in tiles of 4 rows, one 64-byte column of the 4 rows after the other; V in
 *           two passes of half a row each over the 16 rows);
 *   pf      none, or the next block's runs of the same head prefetched (T1) one line every
 *           second line of this run, as pkv__attn_pf spreads them.
 * Prints the median GB/s per variant and its ratio to contig/seq/none measured in the same run. */
#include "tool.h" /* tools/tool_util.c: clock, median, RNG */

#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HEADS 8u
#define ROWS 16u
#define LPR 8u /* 64-byte lines per row: 128 f32 */
#define LINES (ROWS * LPR)
#define RUN (LINES * 64u)
#define N_BLOCKS 4096u
#define V_SKEW (17u * 4096u)
#define MAX_ROUNDS 64

typedef struct variant {
    int paged, tile, pf;
    double gbps[MAX_ROUNDS];
} variant;

static uint8_t *g_k, *g_v;
static uint32_t g_seq_tab[N_BLOCKS], g_rand_tab[N_BLOCKS];
static uint16_t g_order[2][2][LINES]; /* [tile][k or v][i]: line of the run loaded i-th */
static volatile float g_sink;

static double run_variant(const variant *w) {
    const uint32_t *tab = w->paged ? g_rand_tab : g_seq_tab;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m256 x = _mm256_set1_ps(0.999f);
    const uint64_t t0 = tool_now_ns();
    for (uint32_t b = 0; b < N_BLOCKS; b++)
        for (uint32_t h = 0; h < HEADS; h++)
            for (int kv = 0; kv < 2; kv++) {
                const uint8_t *base = kv ? g_v : g_k;
                const uint8_t *run = base + ((size_t)tab[b] * HEADS + h) * RUN;
                const uint8_t *next = w->pf && b + 1 < N_BLOCKS ? base + ((size_t)tab[b + 1] * HEADS + h) * RUN : NULL;
                const uint16_t *ord = g_order[w->tile][kv];
                for (uint32_t i = 0; i < LINES; i++) {
                    if (next && !(i & 1)) __builtin_prefetch(next + (i / 2) * 64u, 0, 2);
                    const uint8_t *p = run + (size_t)ord[i] * 64u;
                    const __m256 lo = _mm256_load_ps((const float *)p), hi = _mm256_load_ps((const float *)(p + 32));
                    a0 = _mm256_fmadd_ps(a0, x, lo), a1 = _mm256_fmadd_ps(a1, x, hi);
                    a2 = _mm256_fmadd_ps(a2, x, lo), a3 = _mm256_fmadd_ps(a3, x, hi);
                    a0 = _mm256_fmadd_ps(a0, x, hi), a1 = _mm256_fmadd_ps(a1, x, lo);
                    a2 = _mm256_fmadd_ps(a2, x, hi), a3 = _mm256_fmadd_ps(a3, x, lo);
                }
            }
    const double sec = (double)(tool_now_ns() - t0) * 1e-9;
    float o[8];
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    g_sink += o[0];
    return 2.0 * (double)N_BLOCKS * HEADS * RUN * 1e-9 / sec;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    if (rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: %s [ROUNDS (1..%d)]\n", argv[0], MAX_ROUNDS);
        return 2;
    }
    const size_t k_bytes = (size_t)N_BLOCKS * HEADS * RUN;
    g_k = tool_map_huge(2 * k_bytes + V_SKEW);
    if (!g_k) {
        perror("mmap");
        return 1;
    }
    g_v = g_k + k_bytes + V_SKEW;
    memset(g_k, 0x3c, 2 * k_bytes + V_SKEW); /* floats near 0.01: no denormals, no overflow */

    tool_rng rng;
    tool_rng_seed(&rng, 1);
    for (uint32_t i = 0; i < N_BLOCKS; i++) g_seq_tab[i] = g_rand_tab[i] = i;
    for (uint32_t i = N_BLOCKS - 1; i > 0; i--) {
        const uint32_t j = (uint32_t)(tool_rng_u64(&rng) % (i + 1)), t = g_rand_tab[i];
        g_rand_tab[i] = g_rand_tab[j], g_rand_tab[j] = t;
    }
    for (uint32_t i = 0; i < LINES; i++) {
        g_order[0][0][i] = g_order[0][1][i] = (uint16_t)i;
        const uint32_t tile = i / (4 * LPR), col = i / 4 % LPR, row = i % 4; /* K: 4-row tiles, column by column */
        g_order[1][0][i] = (uint16_t)((tile * 4 + row) * LPR + col);
        const uint32_t half = i / (LINES / 2), r = i / (LPR / 2) % ROWS, c = i % (LPR / 2); /* V: two half-row passes */
        g_order[1][1][i] = (uint16_t)(r * LPR + half * (LPR / 2) + c);
    }

    variant vs[] = {{0, 0, 0, {0}}, {0, 0, 1, {0}}, {0, 1, 0, {0}}, {0, 1, 1, {0}},
                    {1, 0, 0, {0}}, {1, 0, 1, {0}}, {1, 1, 0, {0}}, {1, 1, 1, {0}}};
    const int n = (int)(sizeof vs / sizeof vs[0]);
    for (int i = 0; i < n; i++) (void)run_variant(&vs[i]); /* warm-up: pages, TLB */
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < n; i++) vs[i].gbps[r] = run_variant(&vs[i]);
    const double *base = vs[0].gbps; /* read before the medians below sort copies */
    printf("# one thread, %d rounds; K and V 256 MiB each, 8 KiB runs (f32, head_dim 128, 16-token blocks)\n", rounds);
    printf("layout  order  pf     GB/s(median)  ratio to contig/seq/none (median of per-round ratios)\n");
    for (int i = 0; i < n; i++) {
        double g[MAX_ROUNDS], q[MAX_ROUNDS];
        for (int r = 0; r < rounds; r++) g[r] = vs[i].gbps[r], q[r] = vs[i].gbps[r] / base[r];
        printf("%-7s %-6s %-6s %12.2f  %6.3f\n", vs[i].paged ? "paged" : "contig", vs[i].tile ? "tile" : "seq",
               vs[i].pf ? "next" : "none", tool_median(g, (size_t)rounds), tool_median(q, (size_t)rounds));
    }
    return 0;
}
