/* block_order.c: what one core pays, reading from memory, for each jump of a block table, and
 * what its hardware prefetcher fetches past the end of a run it has read.
 *
 *   ./build/block_order [ROUNDS]   (x86-64: CMake builds it with the tools)
 *
 * Part 1. One layer of the pool's layout (ARCHITECTURE section 3) with f16 rows at head_dim 128:
 * 8 kv heads, 16-token blocks, so each (block, head) is a 4 KiB run of K and one of V and a
 * block's K is one 32 KiB run for all heads. Read as the decode kernels walk it (block by block,
 * head by head, K run then V run, 64-bit sums as `pkv bench attn` reads), with the kernels'
 * software prefetch (the same head of the next block, one line per line read, T1). The block
 * table is one of:
 *   contig   pool order;
 *   runs8    runs of 8 neighbouring blocks (256 KiB of K), the runs in random order;
 *   runs2    the same with runs of 2 blocks;
 *   win64    shuffled within windows of 64 blocks (2 MiB of K: one huge page);
 *   paged    shuffled.
 * Prints the median GB/s of each and its time over contig's, per-round ratios, rounds
 * interleaved (the machines are shared).
 *
 * Part 2. A probe: a random 32 KiB run is read front to back, then (after a pause for the
 * prefetches to land) one line at an offset from the run is loaded and timed in TSC ticks; the
 * median over many runs per offset. A line read from memory takes the time of "random"; one the
 * hardware fetched on its own takes less. Lines past the end of a run belong, in a paged table,
 * to a block some other sequence owns. */
#include "tool.h" /* tools/tool_util.c: clock, median, RNG */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

#define HEADS 8u
#define RUN 4096u /* one (block, head): 16 rows of 128 f16 */
#define BLOCK (HEADS * RUN)
#define N_BLOCKS 16384u /* 512 MiB of K, 512 MiB of V */
#define V_SKEW (17u * 4096u)
#define MAX_ROUNDS 64
#define N_ORDERS 5

static uint8_t *g_k, *g_v;
static uint32_t g_tab[N_ORDERS][N_BLOCKS];
static const char *const g_names[N_ORDERS] = {"contig", "runs8", "runs2", "win64", "paged"};
static volatile uint64_t g_sink;

static double read_table(const uint32_t *tab) {
    uint64_t sum = 0;
    const uint64_t t0 = tool_now_ns();
    for (uint32_t b = 0; b < N_BLOCKS; b++) {
        const uint8_t *k = g_k + (size_t)tab[b] * BLOCK, *v = g_v + (size_t)tab[b] * BLOCK;
        const int last = b + 1 == N_BLOCKS; /* nothing to prefetch */
        const uint8_t *kn = last ? NULL : g_k + (size_t)tab[b + 1] * BLOCK;
        const uint8_t *vn = last ? NULL : g_v + (size_t)tab[b + 1] * BLOCK;
        sum += tool_sum_block(k, v, kn, vn, HEADS, RUN, RUN, 0, 1);
    }
    const double sec = (double)(tool_now_ns() - t0) * 1e-9;
    g_sink += sum;
    return 2.0 * (double)N_BLOCKS * BLOCK * 1e-9 / sec;
}

static void shuffle(uint32_t *a, uint32_t n, tool_rng *rng) {
    for (uint32_t i = n; i > 1; i--) {
        const uint32_t j = (uint32_t)(tool_rng_u64(rng) % i), t = a[i - 1];
        a[i - 1] = a[j], a[j] = t;
    }
}

/* runs of `run` neighbouring blocks in random order */
static void make_runs(uint32_t *tab, uint32_t run, tool_rng *rng) {
    static uint32_t ord[N_BLOCKS];
    const uint32_t n = N_BLOCKS / run;
    for (uint32_t i = 0; i < n; i++) ord[i] = i;
    shuffle(ord, n, rng);
    for (uint32_t i = 0; i < N_BLOCKS; i++) tab[i] = ord[i / run] * run + i % run;
}

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void probe(tool_rng *rng) {
    enum { TRIALS = 801 };
    static const long offs[] = {0, 4096, 8192, 12288, 16384, 24576, 32768, 65536, -4096, -8192};
    enum { N_OFF = sizeof offs / sizeof offs[0] };
    static uint64_t lat[N_OFF + 1][TRIALS];
    for (int t = 0; t < TRIALS; t++)
        for (int k = 0; k <= N_OFF; k++) {
            const uint8_t *run = g_k + (1 + tool_rng_u64(rng) % (N_BLOCKS - 4)) * (size_t)BLOCK;
            g_sink += tool_sum_run(run, NULL, NULL, BLOCK, 0);
            for (uint32_t i = 0; i < 16; i++) g_sink += tool_sum_run(g_v + (size_t)i * RUN, NULL, NULL, RUN, 0); /* a pause, in L1/L2 */
            const uint8_t *x = k == N_OFF ? g_v + (16 + tool_rng_u64(rng) % (N_BLOCKS * HEADS - 32)) * (size_t)RUN + 2048
                               : offs[k] < 0 ? run + offs[k]
                                             : run + BLOCK + offs[k];
            unsigned aux;
            __atomic_thread_fence(__ATOMIC_SEQ_CST); /* mfence; a locked or on i686 without SSE2 */
            const uint64_t t0 = __rdtscp(&aux);
            g_sink += *(volatile const uint8_t *)x;
            lat[k][t] = __rdtscp(&aux) - t0;
        }
    printf("\n# a 32 KiB run read front to back, then one line loaded: median TSC ticks of that load\n");
    for (int k = 0; k <= N_OFF; k++) {
        qsort(lat[k], TRIALS, sizeof lat[k][0], cmp_u64);
        if (k == N_OFF)
            printf("%-26s %6llu\n", "random line", (unsigned long long)lat[k][TRIALS / 2]);
        else if (offs[k] < 0)
            printf("%6ld B before its start   %6llu\n", -offs[k], (unsigned long long)lat[k][TRIALS / 2]);
        else
            printf("%6ld B past its end       %6llu\n", offs[k], (unsigned long long)lat[k][TRIALS / 2]);
    }
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 7;
    if (rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: %s [ROUNDS (1..%d)]\n", argv[0], MAX_ROUNDS);
        return 2;
    }
    const size_t k_bytes = (size_t)N_BLOCKS * BLOCK;
    g_k = tool_map_huge(2 * k_bytes + V_SKEW);
    if (!g_k) {
        perror("mmap");
        return 1;
    }
    g_v = g_k + k_bytes + V_SKEW;
    memset(g_k, 1, 2 * k_bytes + V_SKEW);

    tool_rng rng;
    tool_rng_seed(&rng, 1);
    for (uint32_t i = 0; i < N_BLOCKS; i++) g_tab[0][i] = g_tab[3][i] = g_tab[4][i] = i;
    make_runs(g_tab[1], 8, &rng);
    make_runs(g_tab[2], 2, &rng);
    for (uint32_t w = 0; w < N_BLOCKS; w += 64) shuffle(g_tab[3] + w, 64, &rng);
    shuffle(g_tab[4], N_BLOCKS, &rng);

    static double gbps[N_ORDERS][MAX_ROUNDS];
    for (int i = 0; i < N_ORDERS; i++) (void)read_table(g_tab[i]); /* warm-up: pages, TLB */
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < N_ORDERS; i++) gbps[i][r] = read_table(g_tab[i]);
    printf("# one thread, %d rounds; K and V 512 MiB each, 4 KiB runs (f16, head_dim 128, 16-token blocks),\n"
           "# the next block's runs prefetched (T1) as the kernels do\n",
           rounds);
    printf("table   GB/s(median)  time / contig (median of per-round ratios)\n");
    for (int i = 0; i < N_ORDERS; i++) {
        double g[MAX_ROUNDS], q[MAX_ROUNDS];
        for (int r = 0; r < rounds; r++) g[r] = gbps[i][r], q[r] = gbps[0][r] / gbps[i][r];
        printf("%-7s %12.2f  %6.3f\n", g_names[i], tool_median(g, (size_t)rounds), tool_median(q, (size_t)rounds));
    }
    probe(&rng);
    return 0;
}
