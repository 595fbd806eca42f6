/* bench_attn.c: `pkv bench attn`: paged attention decode (bytes/s against the machine's read
 * bandwidth, measured in the same run, and paged against contiguous block tables) and prefill
 * (GFLOP/s against the machine's f32 FMA peak, measured in the same run). Public API only. */
#include "tool.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif

enum { H_KV = 8, H_Q = 32, HEAD_DIM = 128, BT_DEFAULT = 16, BT_MAX = 1024, BATCH_MAX = 256, SETS_MAX = 2 };
static uint32_t g_bt = BT_DEFAULT; /* block_tokens: opts.block_tokens, set by tool_bench_attn */
static uint32_t g_hq = H_Q;        /* n_q_heads: opts.q_heads (--q-heads), set by tool_bench_attn */
static int g_compact;              /* --compact (1) / --batch-compact (2): the paged batch is
                                      compacted before it is timed */
static uint32_t g_attn_flags;      /* --bf16-dot, --f16-as-bf16: pkv_attn_params.flags of every call */
#define GIB (1024.0 * 1024.0 * 1024.0)
#define ROUNDS_MAX 99 /* --rounds */

static void usage(FILE *f) {
    fprintf(f,
            "usage: pkv bench attn [--json] [--quick] [--dtype LIST] [--ctx LIST] [--batch LIST]\n"
            "                      [--threads LIST] [--prompt N] [--block-tokens N] [--q-heads N] [--occupancy PCT]\n"
            "                      [--compact | --batch-compact] [--rounds N] [--bf16-dot] [--f16-as-bf16]\n"
            "                      [--mask]\n"
            "\n"
            "Paged attention, n_q_heads %d, n_kv_heads %d, head_dim %d, block_tokens %u.\n"
            "Decode: contexts 512, 4096, 32768; batch 1 and 16; 1 and 2 threads; every KV dtype the\n"
            "cache accepts; each on a fragmented (paged: shuffled blocks) and a contiguous block table\n"
            "(identity: a sequence's blocks consecutive in the pool), the two over the same memory (one\n"
            "pool mapping shared by both caches: the ratio compares block orders, not where two\n"
            "buffers were placed). Each call uses another layer so\n"
            "the K/V working set (>= 1 GiB, at most 2 GiB of pool) exceeds the caches. A configuration\n"
            "is measured in 7 rounds (--rounds); each round samples the streaming read bandwidth (1 GiB buffer,\n"
            "same thread count; the fastest of a pass with the hardware's prefetch alone, one that also\n"
            "prefetches 4 KiB ahead, as the kernels do, and where the library prefetches at two levels\n"
            "(Zen 5) one that does so too) and then times contiguous and paged with their calls\n"
            "interleaved "
            "(contig, paged, paged, contig, ...), so the other tenants of a shared machine weigh on\n"
            "both sides of each ratio alike. Reports the median time per\n"
            "call, K/V bytes read per second, the median over rounds of (bytes/s / read bandwidth),\n"
            "K+V bytes per token per layer (B/tok) and the median of per-round paged / contiguous,\n"
            "with the quartiles of those per-round ratios (p/c q1-q3: how far the median can be trusted).\n"
            "Each round also times the kernel on K/V already in the caches (one layer of at most\n"
            "8 MiB, up to 2 of the sequences, called repeatedly): hotGB/s, and hot_bw, its median\n"
            "fraction of the read bandwidth, are the rate the kernel's arithmetic allows here. Decode\n"
            "from memory cannot be much faster: where hot_bw is near or under 100%%, decode is bound\n"
            "by compute on this machine, not by memory. read_p/c: a plain read of the same K/V runs in\n"
            "the kernel's order (where decode sweeps the batch, pool order: group after group of\n"
            "sequences, each thread its own sequences' blocks in ascending id; else table order; where\n"
            "decode reads in two passes, a window's K runs and then its V runs) and\n"
            "with its software prefetch, no arithmetic, paged over contiguous (median of per-round\n"
            "ratios): what the memory system itself charges for the paged order (whole runs: where\n"
            "the kernels take longer runs in pieces, PKV_ATTN_PIECES, the plain read does not).\n"
"Prefill: one 2048-token prompt, causal, GFLOP/s (4 * n_q_heads * head_dim per\n"
            "query-key pair) and the fraction of the f32 FMA peak: 7 rounds of (a short FMA peak\n"
            "sample, one prefill call, another sample), the fraction against the mean of the two\n"
            "samples; median of the per-round fractions.\n"
            "\n"
            "  --json      one JSON object per line\n"
            "  --quick     a short subset (contexts 512 and 4096, batch 1, f16, 256 MiB working set,\n"
            "              512-token prefill): a smoke run for CI\n"
            "  --dtype LIST    only these KV dtypes (comma-separated names, e.g. f16,q8_0)\n"
            "  --ctx LIST      only these decode contexts (e.g. 4096,32768)\n"
            "  --batch LIST    only these decode batch sizes\n"
            "  --threads LIST  only these thread counts (1, 2)\n"
            "  --prompt N      prefill prompt tokens (0: no prefill)\n"
            "  --block-tokens N  token slots per block, 1..1024, at most the smallest context and the\n"
            "              prompt [16]; larger blocks make longer runs, so fewer jumps in a paged table\n"
            "  --q-heads N  query heads, a multiple of the 8 kv heads up to 128 [32]: 64 is Llama 3\n"
            "              70B's 8 a kv head, where the arithmetic grows with the rows and hot_bw\n"
            "              shows whether it, not memory, bounds decode here\n"
            "  --rounds N  rounds per configuration, 3..%d [7; 3 with --quick]: more rounds pin the\n"
            "              medians and the paged / contiguous ratio closer\n"
            "  --occupancy PCT  the decode batch holds PCT%% of its pool's blocks, 10..100 [100]: the\n"
            "              rest were freed by other sequences; the paged batch holds a random subset of\n"
            "              the pool (so free blocks lie between its blocks), the contiguous one the first\n"
            "              blocks. The layers shrink to keep the pool within the budget\n"
            "  --compact   compact the paged batch (pkv_seq_compact on each sequence, in passes until\n"
            "              none moves) before timing it; reports the blocks moved and the time taken.\n"
            "              Only FREE blocks are targets, so at 100%% occupancy nothing moves\n"
            "  --batch-compact  the same with one pkv_batch_compact over the batch, which exchanges\n"
            "              blocks where no room is free (reports block copies)\n"
            "  --bf16-dot  every call with PKV_ATTN_BF16_DOT: bf16 K scored by bf16 dot products where\n"
            "              the CPU has them (queries rounded to bf16; pkv.h); the header says whether it\n"
            "              took effect, the JSON lines carry attn_flags; each round also times the\n"
            "              contiguous layout with the flag and without, calls interleaved (their ratio),\n"
            "              and the prefill without it after the flag's call (a line of its own, with\n"
            "              flag / without: on backend avx512-amx the flag's prefill runs on AMX tiles,\n"
            "              with bf16, fp8_e4m3, q8_0 and q4_0 K and V)\n"
            "  --f16-as-bf16  every call with PKV_ATTN_F16_AS_BF16: f16 K and V taken as bf16 where the\n"
            "              backend has bf16 tiles (avx512-amx: prefill; pkv.h), reported as --bf16-dot's\n"
            "              flag is (both options: both flags)\n"
            "  --mask      each prefill round also times the prompt through pkv_attn_prefill_masked with\n"
            "              the causal mask (the same keys: what a custom mask costs), its call after the\n"
            "              causal one's; a \"prefill\" line of layout \"masked\" gives its median and the\n"
            "              median of per-round masked / causal\n"
            "  -h, --help  this text\n"
            "Goals: decode f16 at contexts >= 4096 reaches >= 85%% of the read bandwidth at 2 threads;\n"
            "paged within 3%% of contiguous; prefill >= 40%% of the FMA peak.\n",
            H_Q, H_KV, HEAD_DIM, g_bt, ROUNDS_MAX);
}

/* ---- machine: streaming read bandwidth ---------------------------------------------------------- */
typedef struct bw_job {
    const uint64_t *p;
    size_t n;
    size_t pf_ahead; /* 0: no software prefetch; else each line prefetches the one this many bytes on */
    size_t near;     /* 0, or (with pf_ahead) the library's two levels: pf_ahead with the NTA hint and
                      * the line near bytes on into L1 (tool_sum_run) */
    int l1;          /* into L1, not L2 (as the library on this CPU: g_pf_l1) */
    uint64_t sum;
} bw_job;

/* The same loop as the plain read of read_p/c (tool_sum_run), over the job's whole lines. */
static void *bw_read(void *arg) {
    bw_job *j = arg;
    const uint8_t *p = (const uint8_t *)j->p;
    j->sum = tool_sum_run(p, j->pf_ahead ? p + j->pf_ahead : NULL, j->pf_ahead && j->near ? p + j->near : NULL,
                          j->n / 8 * 64, j->l1);
    return NULL;
}

static uint64_t *g_bw_buf;
static size_t g_bw_words;
static volatile uint64_t g_sink;

/* ---- machine samples run on n threads, thread i pinned to the i-th CPU the process may use ------
 * Unpinned, a thread the sample creates can land on its creator's CPU and share it for the whole
 * sample: seen here as a 2-thread FMA peak equal to the 1-thread one (117 against 230 GFLOP/s) in
 * some runs, which halved the 2-thread peak that prefill is compared with. The library's own
 * threads stay unpinned: the decode and prefill figures are what a caller gets. */
typedef struct pinned_thread {
    void *(*fn)(void *);
    void *arg;
    int cpu;                 /* -1: leave unpinned */
    int n;                   /* threads in the sample */
    atomic_int *arrived;     /* start line: each thread counts in, then waits for all */
    _Atomic uint64_t *start; /* set by the last thread in: the sample's start */
    uint64_t end;            /* when this thread's share was done */
} pinned_thread;

#ifdef __linux__
/* The CPU of rank i in the process's mask at start-up, or -1 when there are fewer than n. */
static int nth_cpu(int i, int n) {
    static cpu_set_t mask;
    static int have = -1;
    if (have < 0) have = sched_getaffinity(0, sizeof mask, &mask) == 0;
    if (!have || CPU_COUNT(&mask) < n) return -1;
    for (int c = 0, k = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &mask) && k++ == i) return c;
    return -1;
}
static void pin_self(int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    (void)pthread_setaffinity_np(pthread_self(), sizeof one, &one); /* best effort */
}
#else
static int nth_cpu(int i, int n) { (void)i, (void)n; return -1; }
static void pin_self(int cpu) { (void)cpu; }
#endif

static void *pinned_main(void *arg) {
    pinned_thread *t = arg;
    if (t->cpu >= 0) pin_self(t->cpu);
    if (atomic_fetch_add(t->arrived, 1) + 1 == t->n) atomic_store(t->start, tool_now_ns());
    while (atomic_load(t->arrived) < t->n) { /* spin: every thread is on its CPU when the clock starts */
    }
    t->fn(t->arg);
    t->end = tool_now_ns();
    return NULL;
}

/* Runs fn(args + i * arg_size) on n threads (the caller is thread 0), each pinned to its own CPU;
 * returns the seconds from the moment all of them were running to the last one's end. The start
 * line keeps out the time a VM takes to wake an idle CPU (milliseconds here: a 17 ms 2-thread
 * sample unpinned and without it measured the 1-thread FMA rate). The caller's mask is put back. */
static double run_pinned(int n, void *(*fn)(void *), void *args, size_t arg_size) {
    pinned_thread t[2];
    pthread_t th[2];
    atomic_int arrived = 0;
    _Atomic uint64_t start = 0;
#ifdef __linux__
    cpu_set_t saved;
    const int restore = pthread_getaffinity_np(pthread_self(), sizeof saved, &saved) == 0;
#endif
    for (int i = 0; i < n; i++)
        t[i] = (pinned_thread){fn, (char *)args + (size_t)i * arg_size, nth_cpu(i, n), n, &arrived, &start, 0};
    for (int i = 1; i < n; i++) pthread_create(&th[i], NULL, pinned_main, &t[i]);
    pinned_main(&t[0]);
    uint64_t end = t[0].end;
    for (int i = 1; i < n; i++) {
        pthread_join(th[i], NULL);
        if (t[i].end > end) end = t[i].end;
    }
#ifdef __linux__
    if (restore) (void)pthread_setaffinity_np(pthread_self(), sizeof saved, &saved);
#endif
    return (double)(end - atomic_load(&start)) * 1e-9;
}

/* the library's CPU choices this bench follows (main); g_pf_l1 also means the decode kernels'
 * prefetch led by bytes, at two levels (src/attn/attn.c, head_io_fill), which the plain read of
 * read_p/c copies (tool_sum_block); g_head their lead of one head into L2 (PKV_CPU_LEAD_HEAD:
 * Intel), copied likewise; g_two the row path in two passes (attn.c, pass_window), which it
 * copies too (read_two) */
static int g_victim_l3, g_pf_l1, g_head, g_wide, g_two;

/* The value of var in the environment (NULL: unset), which sets *flag where it is on (1) or off
 * (0), as the library reads its overrides; other values leave *flag alone (the library refuses
 * them, and the bench ends before measuring: main). */
static const char *env_override(const char *var, const char *on, const char *off, int *flag) {
    const char *e = getenv(var);
    if (e && !strcmp(e, on)) *flag = 1;
    if (e && !strcmp(e, off)) *flag = 0;
    return e;
}

/* One streaming pass over the buffer split between n_threads threads, each line's software
 * prefetch pf_ahead bytes on (0: none), at two levels where near is not 0 (bw_job); GB/s. */
static double bw_pass(int n_threads, size_t pf_ahead, size_t near) {
    bw_job jobs[2];
    size_t per = g_bw_words / (size_t)n_threads;
    for (int i = 0; i < n_threads; i++)
        jobs[i] = (bw_job){g_bw_buf + per * (size_t)i, per, pf_ahead, near, g_pf_l1, 0};
    const double sec = run_pinned(n_threads, bw_read, jobs, sizeof jobs[0]);
    for (int i = 0; i < n_threads; i++) g_sink += jobs[i].sum;
    return (double)(per * (size_t)n_threads * 8) * 1e-9 / sec;
}

/* How far ahead the prefetching pass prefetches: 4 KiB, about what decode keeps in flight (the
 * next block's run of a kv head while it reads this one's). */
#define BW_PF_AHEAD 4096u

/* The read bandwidth: the fastest of a pass that leaves the prefetching to the hardware, one
 * that also prefetches BW_PF_AHEAD bytes ahead, as the kernels do, and where the library
 * prefetches at two levels (g_pf_l1: Zen 5) one that does so too, PKV_ATTN_PF_LEAD bytes ahead
 * with the NTA hint and BW_PF_AHEAD into L1. On some machines the second is much the faster
 * (Intel, stop 36: 1.3-1.5x at 1 thread), and decode, which prefetches, read up to 133% of a
 * plain pass's rate: a ceiling the kernel beats is no ceiling. On Zen 5 the NTA lead made decode
 * read up to 114% of the other two (stop 45). */
static double bw_sample(int n_threads) {
    const double plain = bw_pass(n_threads, 0, 0), ahead = bw_pass(n_threads, BW_PF_AHEAD, 0);
    const double two = g_pf_l1 ? bw_pass(n_threads, PKV_ATTN_PF_LEAD, BW_PF_AHEAD) : 0.0;
    const double best = plain > ahead ? plain : ahead;
    return best > two ? best : two;
}

/* The machine line's figure: the median of 3 samples. */
static double bw_median3(int n_threads) {
    double v[3];
    for (int i = 0; i < 3; i++) v[i] = bw_sample(n_threads);
    return tool_median(v, 3);
}

/* ---- machine: f32 FMA peak (FMAs on independent accumulators, at each vector width) -----------
 * The peak is the faster of 256- and 512-bit FMAs, the widest the attention backends use. They
 * differ by CPU: Zen 5 runs 512-bit FMAs at full width, twice the 256-bit rate (prefill measured
 * 104-128% of a 256-bit-only peak there, stop 35); Zen 4 runs them as two halves (the same rate);
 * an Intel core with one 512-bit FMA unit gives both the same or 512-bit slower. 12 chains cover
 * 2 pipes of 4-cycle (or 5-cycle) FMAs. */
typedef struct fma_job {
    uint64_t iters;
    float out;
} fma_job;

#define FMA_CHAINS 12
/* The loops' accumulators must stay in registers, unrolled, in every build: a sanitizer build
 * (scripts/test.sh's ASan stage runs the bench's tests at -O1) otherwise kept them on the stack
 * and spent 3/4 of a --quick run there */
#if defined(__clang__) || defined(__GNUC__)
#define FMA_NO_SANITIZE __attribute__((no_sanitize_address, no_sanitize("undefined")))
#else
#define FMA_NO_SANITIZE
#endif
#if defined(__x86_64__) || defined(__i386__)
/* The loop at one vector width: FMA_CHAINS accumulators of type V, each a chain of FMAs */
#define DEF_FMA_LOOP(NAME, ISA, V, SET1, FMADD, ADD, LANE0)                                                    \
    __attribute__((target(ISA))) FMA_NO_SANITIZE static void *NAME(void *arg) {                                 \
        fma_job *j = arg;                                                                                       \
        V a[FMA_CHAINS], x = SET1(0.999999f), y = SET1(1e-7f);                                                  \
        for (int i = 0; i < FMA_CHAINS; i++) a[i] = SET1((float)i);                                             \
        for (uint64_t it = 0; it < j->iters; it++) {                                                            \
            _Pragma("GCC unroll 12") for (int i = 0; i < FMA_CHAINS; i++) a[i] = FMADD(a[i], x, y);             \
        }                                                                                                       \
        V s = a[0];                                                                                             \
        for (int i = 1; i < FMA_CHAINS; i++) s = ADD(s, a[i]);                                                  \
        j->out = LANE0(s);                                                                                      \
        return NULL;                                                                                            \
    }
DEF_FMA_LOOP(fma_loop, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_cvtss_f32)
DEF_FMA_LOOP(fma_loop512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_cvtss_f32)
static int fma_available(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
/* The loops to time and their f32 lanes: 256-bit, and 512-bit where the CPU has AVX-512F. */
static int fma_loops(void *(**fn)(void *), int *lanes) {
    fn[0] = fma_loop, lanes[0] = 8;
    if (!__builtin_cpu_supports("avx512f")) return 1;
    fn[1] = fma_loop512, lanes[1] = 16;
    return 2;
}
#else
FMA_NO_SANITIZE static void *fma_loop(void *arg) { /* portable: independent scalar chains (the compiler may vectorize) */
    fma_job *j = arg;
    float a[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) a[i] = (float)i;
    for (uint64_t it = 0; it < j->iters; it++) {
        _Pragma("GCC unroll 12") for (int i = 0; i < FMA_CHAINS; i++) a[i] = fmaf(a[i], 0.999999f, 1e-7f);
    }
    j->out = a[0] + a[FMA_CHAINS - 1];
    return NULL;
}
static int fma_available(void) { return 1; }
static int fma_loops(void *(**fn)(void *), int *lanes) {
    fn[0] = fma_loop, lanes[0] = 1;
    return 1;
}
#endif

/* Best of reps runs of iters iterations per thread of each loop, GFLOP/s (100M / 4: about 0.1 s
 * a run at 256 bits). */
static double fma_peak_n(int n_threads, int reps, uint64_t iters) {
    fma_job jobs[2];
    void *(*fn[2])(void *);
    int lanes[2];
    const int n_loops = fma_loops(fn, lanes);
    double best = 0;
    for (int rep = 0; rep < reps; rep++)
        for (int k = 0; k < n_loops; k++) {
            for (int i = 0; i < n_threads; i++) jobs[i].iters = iters;
            const double sec = run_pinned(n_threads, fn[k], jobs, sizeof jobs[0]);
            g_sink += (uint64_t)jobs[0].out;
            const double g = (double)FMA_CHAINS * lanes[k] * 2 * (double)iters * n_threads * 1e-9 / sec;
            if (g > best) best = g;
        }
    return best;
}
static double fma_peak(int n_threads) { return fma_peak_n(n_threads, 3, 100000000ull / 4); }

/* ---- cache set-up ------------------------------------------------------------------------------- */
/* One group of the sweep's order (sweep_order): its set k is swept[cut[k] .. cut[k + 1]), its
 * ns sets read by chunks threads (a range of a set each). */
typedef struct sweep_group {
    uint32_t ns, chunks, cut[SETS_MAX + 1];
} sweep_group;

typedef struct setup {
    pkv_cache *c;
    pkv_seq seqs[BATCH_MAX];
    uint32_t batch, ctx, n_layers;
    double adjacent; /* fraction of logical neighbours that are physical neighbours */
    uint64_t moved;  /* --compact: blocks pkv_seq_compact moved, in passes until none moved */
    uint32_t passes;
    double compact_s;
    uint32_t next_layer; /* decode calls cycle over the layers */
    int32_t *tables;     /* [batch][per_seq]: the block tables, for the plain read (gather_read) */
    /* where decode reads in pool order (else NULL): the batch's block ids as the sweep reads
     * them (sweep_order), group after group, and in each group set after set */
    int32_t *swept;
    sweep_group *sw;
    uint32_t sw_groups;
    uint32_t per_seq, next_read_layer;
    pkv_layout L;
} setup;

static void setup_free(setup *s) {
    pkv_cache_destroy(s->c);
    free(s->tables);
    free(s->swept);
    free(s->sw);
    memset(s, 0, sizeof *s);
}

/* Fills every block of every layer with valid K/V of the dtype: the first (up to) 64 blocks of
 * sequence 0 are written through pkv_write_kv (random input, converted by the library), then
 * copied over the whole pool through pkv_cache_layout. The values are irrelevant to the
 * timing as long as they are finite and not all alike (the softmax max changes now and then). */
static int fill_pool(setup *s, tool_rng *rng) {
    const pkv_layout L = s->L;
    const uint32_t per_seq = s->ctx / g_bt;
    const uint32_t n_pat = 64 < per_seq ? 64 : per_seq, n_tok = n_pat * g_bt;
    int32_t *slots = malloc(sizeof(int32_t) * n_tok);
    float *k = malloc(sizeof(float) * n_tok * H_KV * HEAD_DIM), *v = malloc(sizeof(float) * n_tok * H_KV * HEAD_DIM);
    uint8_t *pat_k = malloc(L.k_block_bytes * n_pat), *pat_v = malloc(L.v_block_bytes * n_pat);
    int rc = -1;
    if (!slots || !k || !v || !pat_k || !pat_v) goto out;
    for (size_t i = 0; i < (size_t)n_tok * H_KV * HEAD_DIM; i++)
        k[i] = (float)tool_rng_normal(rng), v[i] = (float)tool_rng_normal(rng);
    if (tool_check(pkv_seq_slots(s->c, s->seqs[0], 0, n_tok, slots), "pkv_seq_slots") < 0) goto out;
    if (tool_check(pkv_write_kv(s->c, 0, slots, n_tok, k, v, PKV_DTYPE_F32), "pkv_write_kv") < 0) goto out;
    for (uint32_t b = 0; b < n_pat; b++) {
        uint32_t id = (uint32_t)slots[b * g_bt] / g_bt;
        memcpy(pat_k + b * L.k_block_bytes, L.k_base + (size_t)id * L.k_block_bytes, L.k_block_bytes);
        memcpy(pat_v + b * L.v_block_bytes, L.v_base + (size_t)id * L.v_block_bytes, L.v_block_bytes);
    }
    for (uint32_t l = 0; l < L.n_layers; l++)
        for (uint32_t b = 0; b < L.n_blocks; b++) {
            memcpy(L.k_base + l * L.layer_stride_bytes + (size_t)b * L.k_block_bytes, pat_k + (b % n_pat) * L.k_block_bytes,
                   L.k_block_bytes);
            memcpy(L.v_base + l * L.layer_stride_bytes + (size_t)b * L.v_block_bytes, pat_v + (b % n_pat) * L.v_block_bytes,
                   L.v_block_bytes);
        }
    rc = 0;
out:
    free(slots), free(k), free(v), free(pat_k), free(pat_v);
    return rc;
}

/* Scatters the free queue: many small sequences take blocks in random interleaving and are
 * released in random order, so later sequences get fragmented block tables. */
static int scatter_free_queue(setup *s, tool_rng *rng, uint32_t n_blocks) {
    enum { M = 1024 };
    pkv_seq sc[M];
    static const int32_t tok[BT_MAX] = {0};
    const uint32_t m = n_blocks < M ? n_blocks : M;
    for (uint32_t i = 0; i < m; i++)
        if (tool_check(pkv_seq_create(s->c, NULL, 0, &sc[i]), "pkv_seq_create") < 0) return -1;
    for (uint32_t b = 0; b < n_blocks; b++)
        for (;;) {
            int rc = pkv_seq_append(s->c, sc[tool_rng_u64(rng) % m], tok, g_bt, NULL);
            if (rc == PKV_ELIMIT) continue; /* that one is full: pick another */
            if (tool_check(rc, "pkv_seq_append") < 0) return -1;
            break;
        }
    for (uint32_t i = m; i > 1; i--) {
        uint32_t j = (uint32_t)(tool_rng_u64(rng) % i);
        pkv_seq t = sc[i - 1];
        sc[i - 1] = sc[j];
        sc[j] = t;
    }
    for (uint32_t i = 0; i < m; i++)
        if (tool_check(pkv_seq_release(s->c, sc[i]), "pkv_seq_release") < 0) return -1;
    return 0;
}

/* The parameters of every attention call: g_hq query heads (--q-heads), --bf16-dot's and
 * --f16-as-bf16's flags. */
static pkv_attn_params bench_params(void) {
    pkv_attn_params p = pkv_attn_params_default();
    p.n_q_heads = g_hq;
    p.flags = g_attn_flags;
    return p;
}

/* Whether pkv_attn_decode reads the setup's batch in pool order (pkv.h: PKV_ATTN_ORDER, and by
 * default where the tables jump): one decode of layer 0, and the library's own count of the
 * requests it read in pool order (pkv_stats.attn_reqs_pool). 1 yes, 0 no, -1 failed. */
static int decode_sweeps(const setup *s) {
    const size_t n = (size_t)s->batch * g_hq * HEAD_DIM;
    float *q = calloc(n, sizeof *q), *out = malloc(n * sizeof *out);
    pkv_attn_params p = bench_params();
    pkv_stats a, b;
    int rc = q && out ? 0 : -1;
    if (!rc) rc = tool_check(pkv_cache_get_stats(s->c, &a), "pkv_cache_get_stats");
    if (!rc) rc = tool_check(pkv_attn_decode(s->c, 0, s->seqs, s->batch, q, out, &p), "pkv_attn_decode");
    if (!rc) rc = tool_check(pkv_cache_get_stats(s->c, &b), "pkv_cache_get_stats");
    free(q);
    free(out);
    return rc < 0 ? -1 : b.attn_reqs_pool - a.attn_reqs_pool == s->batch;
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The sweep's shape, as src/attn/attn.c makes it (sweep_collect, sweep_prepare), for the plain
 * read to follow; a model of the library's rule, kept beside it by hand. A thread keeps the
 * states of as many sequences as make 3/4 of its core's L2, at most 768 KiB, in the bytes it
 * reads per entry (a block's K and V, and a sequence's queries and acc), at least 4 (8 on AMD
 * family 19h, whose L3 catches what L2 evicts); a group has that many a thread, at most 32, and
 * groups are swept one after the other, of sizes within one of each other. A group's entries,
 * in (sequence, block index) order, are cut into one set a thread (one set where the group is
 * one sequence, its blocks then cut into ranges, a range a thread), and each set is read in
 * ascending block id. On AMD family 1Ah (PKV_CPU_WIDE_SWEEP) a group has 32 sequences, as one
 * set cut into ranges. */
enum { SW_ITEMS_MAX = 32, SW_ITEMS_MIN = 4, SW_ITEMS_MIN_VICTIM = 8, SW_L2_EIGHTHS = 6, SW_MIN_SPLIT = 4 };
#define SW_BYTES_MAX ((size_t)768 * 1024)

static size_t l2_bytes(void) {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (n > 0) return (size_t)n;
#endif
    return (size_t)512 * 1024; /* the library's guess where the C library does not know */
}

/* The CPU's family where it is an AMD one, else 0: read from CPUID leaf 1 as src/core/core.c
 * reads it for the library's AMD flags (GCC 12 has no "amdfam1ah"). */
static unsigned amd_family(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned family = (a >> 8) & 0xFu;
    return family == 0xFu ? family + ((a >> 20) & 0xFFu) : family;
#else
    return 0;
#endif
}
/* Whether the CPU is an Intel one: the library's PKV_CPU_LEAD_HEAD (src/core/core.c). */
static int intel_cpu(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
#else
    return 0;
#endif
}
/* The library's PKV_CPU_VICTIM_L3 (AMD family 19h), PKV_CPU_PREFETCH_L1 and PKV_CPU_WIDE_SWEEP
 * (family 1Ah), read once in main before any sweep model or plain read. */

static int sweep_order(setup *s, uint32_t nt) {
    const size_t n = (size_t)s->per_seq * s->batch;
    const size_t qrow = ((size_t)HEAD_DIM * 4 + 63) / 64 * 64;
    const size_t entry = s->L.k_block_bytes + s->L.v_block_bytes + (size_t)g_hq * (qrow + HEAD_DIM * sizeof(float));
    const size_t budget = l2_bytes() / 8 * SW_L2_EIGHTHS;
    size_t per = (budget < SW_BYTES_MAX ? budget : SW_BYTES_MAX) / entry;
    const size_t per_min = g_victim_l3 ? SW_ITEMS_MIN_VICTIM : SW_ITEMS_MIN;
    per = per < per_min ? per_min : per;
    /* wide (PKV_CPU_WIDE_SWEEP): groups as large as the sweep holds, one set cut into ranges (the
     * entries' bound never binds here: a table has room for 64 blocks or more, 32 tables' worth) */
    const uint32_t group_max = g_wide ? SW_ITEMS_MAX : (uint32_t)(per * nt < SW_ITEMS_MAX ? per * nt : SW_ITEMS_MAX);
    const uint32_t ng = (s->batch + group_max - 1) / group_max;
    s->sw_groups = ng;
    s->swept = malloc(sizeof(int32_t) * n);
    s->sw = malloc(sizeof *s->sw * ng);
    if (!s->swept || !s->sw) return -1;
    memcpy(s->swept, s->tables, sizeof(int32_t) * n); /* (sequence, block index) order */
    for (uint32_t g = 0; g < ng; g++) {
        const uint32_t i0 = (uint32_t)((uint64_t)s->batch * g / ng), i1 = (uint32_t)((uint64_t)s->batch * (g + 1) / ng);
        const uint32_t x = (i1 - i0) * s->per_seq, base = i0 * s->per_seq;
        uint32_t chunks = x / SW_MIN_SPLIT < nt ? x / SW_MIN_SPLIT : nt;
        chunks = chunks ? chunks : 1;
        sweep_group *gr = &s->sw[g];
        gr->ns = g_wide ? 1 : chunks < i1 - i0 ? chunks : i1 - i0;
        gr->chunks = chunks / gr->ns * gr->ns;
        for (uint32_t k = 0; k <= gr->ns; k++) gr->cut[k] = base + (uint32_t)((uint64_t)x * k / gr->ns);
        for (uint32_t k = 0; k < gr->ns; k++)
            qsort(s->swept + gr->cut[k], gr->cut[k + 1] - gr->cut[k], sizeof(int32_t), cmp_i32);
    }
    return 0;
}

/* loan: NULL, or another cache's pool for this one to read (tool_loan_allocator); occ: the
 * percent of the pool's blocks the batch holds */
static int setup_make(setup *s, pkv_dtype dt, uint32_t ctx, uint32_t batch, uint32_t n_layers, uint32_t n_threads,
                      int paged, tool_pool_loan *loan, tool_rng *rng, uint32_t occ) {
    memset(s, 0, sizeof *s);
    s->batch = batch, s->ctx = ctx, s->n_layers = n_layers;
    /* A set-up on a loan reads the lender's pool (paged on contiguous), and their calls
     * alternate: starting both at layer 0 would give each call the layer the other had just
     * read, in L3 where a layer fits there (2 MiB at f16 512 x 1: read_p/c measured 1.9). Half
     * the layers apart, every call reads a layer neither has read for n_layers / 2 calls. */
    if (loan) s->next_layer = s->next_read_layer = n_layers / 2;
    const uint32_t per_seq = (ctx + g_bt - 1) / g_bt;
    const uint32_t n_blocks = (uint32_t)(((uint64_t)per_seq * batch * 100 + occ - 1) / occ);
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = n_layers;
    cfg.n_kv_heads = H_KV;
    cfg.head_dim = HEAD_DIM;
    cfg.block_tokens = g_bt;
    cfg.n_blocks = n_blocks;
    cfg.k_dtype = cfg.v_dtype = dt;
    cfg.max_seqs = 1024 + 32;
    cfg.max_blocks_per_seq = per_seq > 64 ? per_seq : 64;
    if (cfg.max_blocks_per_seq < n_blocks / 512 + 1) /* room for scatter_free_queue's sequences */
        cfg.max_blocks_per_seq = n_blocks / 512 + 1;
    cfg.n_threads = n_threads;
    cfg.enable_prefix_cache = 0;
    if (loan) cfg.allocator = tool_loan_allocator(loan);
    tool_log_errors(&cfg, "pkv bench attn");
    int rc = pkv_cache_create(&cfg, &s->c);
    if (rc < 0) return rc;
    if (paged && scatter_free_queue(s, rng, n_blocks) < 0) goto fail;
    int32_t *tok = calloc(ctx, sizeof *tok);
    s->per_seq = per_seq;
    s->tables = malloc(sizeof(int32_t) * per_seq * batch);
    if (!tok || !s->tables) {
        free(tok);
        goto fail;
    }
    for (uint32_t i = 0; i < batch; i++)
        if (tool_check(pkv_seq_create(s->c, NULL, 0, &s->seqs[i]), "pkv_seq_create") < 0 ||
            tool_check(pkv_seq_append(s->c, s->seqs[i], tok, ctx, NULL), "pkv_seq_append") < 0) {
            free(tok);
            goto fail;
        }
    free(tok);
    if (paged && g_compact) {
        const uint64_t t0 = tool_now_ns();
        if (g_compact == 2) { /* one pkv_batch_compact over the batch */
            uint32_t m = 0;
            if (tool_check(pkv_batch_compact(s->c, s->seqs, batch, 0, 0, &m), "pkv_batch_compact") < 0) goto fail;
            s->moved = m, s->passes = 1;
        }
        for (uint32_t moved = g_compact == 1; moved && s->passes < 16; s->passes++) { /* passes until none moves */
            moved = 0;
            for (uint32_t i = 0; i < batch; i++) {
                uint32_t m = 0;
                if (tool_check(pkv_seq_compact(s->c, s->seqs[i], 0, &m), "pkv_seq_compact") < 0) goto fail;
                moved += m;
            }
            s->moved += moved;
        }
        s->compact_s = (double)(tool_now_ns() - t0) * 1e-9;
    }
    uint64_t adj = 0, pairs = 0;
    for (uint32_t i = 0; i < batch; i++) {
        int32_t *table = s->tables + (size_t)i * per_seq;
        uint32_t n_tab = 0;
        if (tool_check(pkv_seq_block_table(s->c, s->seqs[i], table, per_seq, &n_tab), "pkv_seq_block_table") < 0)
            goto fail;
        for (uint32_t b = 1; b < n_tab; b++) adj += table[b] == table[b - 1] + 1, pairs++;
    }
    s->adjacent = pairs ? (double)adj / (double)pairs : 1.0;
    if (tool_check(pkv_cache_layout(s->c, &s->L), "pkv_cache_layout") < 0 || fill_pool(s, rng) < 0) goto fail;
    const int sweeps = decode_sweeps(s);
    if (sweeps < 0 || (sweeps && sweep_order(s, n_threads) < 0)) goto fail;
    return 0;
fail:
    setup_free(s);
    return PKV_EINVAL;
}

/* ---- measurements --------------------------------------------------------------------------------- */
typedef struct opts {
    int json, quick;
    uint32_t ctx[8], batch[8], threads[3];
    int n_ctx, n_batch, n_threads;
    int dtype_on[PKV_DTYPE_COUNT], dtype_set;
    long prompt; /* -1: the default */
    uint32_t block_tokens;
    uint32_t q_heads;
    uint32_t occupancy;
    uint32_t rounds; /* 0: the default (7; 3 with --quick) */
    int mask;        /* --mask */
} opts;

static int opts_rounds(const opts *o) { return o->rounds ? (int)o->rounds : o->quick ? 3 : 7; }

static int parse_dtypes(const char *s, opts *o) {
    pkv_dtype d[64];
    int n = 0;
    if (tool_parse_dtype_list(s, d, 64, &n)) return -1; /* "" or "," names none */
    o->dtype_set = 1;
    for (int i = 0; i < n; i++) o->dtype_on[d[i]] = 1;
    return 0;
}

static double g_bw[3];   /* initial read bandwidth, GB/s, by thread count */
static double g_peak[3]; /* f32 FMA peak, GFLOP/s, by thread count */

/* One decode call of the setup's batch on its next layer; 0 or -1 (reported). */
static int decode_next(setup *s, const float *q, float *out, const pkv_attn_params *p) {
    return tool_check(pkv_attn_decode(s->c, s->next_layer++ % s->n_layers, s->seqs, s->batch, q, out, p),
                      "pkv_attn_decode");
}

/* ---- the memory's own paged / contiguous: a plain read of the same runs in the same order --------
 * Reads one layer's K and V of the setup's sequences the way the decode kernel walks them (for
 * each block of a table, or of the sorted entries where decode sweeps the batch (setup.swept),
 * for each kv head: its K run, then its V run), summing 64-bit words as
 * the bandwidth sample does, with the kernel's software prefetch: the same head of the next
 * block, one line per line read. Timed on the contiguous and the paged tables over the same
 * pages, its ratio is what the memory system itself charges for the paged order when nothing
 * else is done: the kernel's own paged / contiguous can be set against it. */
typedef struct gather_job {
    const setup *s;
    uint32_t layer, seq0, seq_step; /* this thread's sequences: seq0, seq0 + seq_step, ... */
    uint32_t part, n_parts;         /* and of each, this part of its blocks */
    _Atomic uint32_t *groups_done;  /* swept: the threads' count of groups read (the library's
                                     * threads end a group's job together) */
    uint64_t sum;
} gather_job;

/* The two passes' walk over blocks ids[0 .. n) (src/attn/attn.c, pass_run, copied by hand): in
 * windows of w blocks, each window's K runs head by head, then its V runs; run r from the window
 * at x0, NULL past the end. */
static const uint8_t *two_run(const pkv_layout *L, const uint8_t *K, const uint8_t *V, const int32_t *ids, size_t n,
                              size_t w, size_t x0, size_t r) {
    const size_t H = L->n_kv_heads, kh = L->k_block_bytes / H, vh = L->v_block_bytes / H;
    for (;;) {
        const size_t nw = n - x0 < w ? n - x0 : w, runs = nw * H;
        if (r < runs) return K + (size_t)ids[x0 + r / H] * L->k_block_bytes + r % H * kh;
        if (r < 2 * runs) return V + (size_t)ids[x0 + (r - runs) / H] * L->v_block_bytes + (r - runs) % H * vh;
        r -= 2 * runs, x0 += nw;
        if (x0 >= n) return NULL;
    }
}

/* Blocks ids[0 .. n) read as the library's two passes read them (g_two; attn.c, pass_window and
 * pass_pf): windows of as many blocks as 64 KiB of one decode's scores (g_hq rows a block) take,
 * at most 64; the prefetch leads by about PKV_ATTN_PF_LEAD bytes of the walk (2 x that over a K
 * and a V run's bytes, at least 2 runs) into L2, or where g_pf_l1 says with the NTA hint and the
 * next run into L1 (tool_sum_run). */
static uint64_t read_two(const pkv_layout *L, const uint8_t *K, const uint8_t *V, const int32_t *ids, size_t n) {
    const size_t H = L->n_kv_heads, kh = L->k_block_bytes / H, vh = L->v_block_bytes / H;
    const size_t per = (size_t)g_hq * ((g_bt + 15u) & ~15u) * sizeof(float), w0 = (size_t)64 * 1024 / per;
    const size_t w = w0 < 1 ? 1 : w0 > 64 ? 64 : w0, ahead0 = (2 * PKV_ATTN_PF_LEAD + kh + vh - 1) / (kh + vh);
    const size_t ahead = ahead0 < 2 ? 2 : ahead0;
    uint64_t sum = 0;
    for (size_t x0 = 0; x0 < n; x0 += w) {
        const size_t nw = n - x0 < w ? n - x0 : w;
        for (size_t r = 0; r < 2 * nw * H; r++) {
            const uint8_t *far = two_run(L, K, V, ids, n, w, x0, r + ahead);
            const uint8_t *next = g_pf_l1 && far ? two_run(L, K, V, ids, n, w, x0, r + 1) : NULL;
            sum += tool_sum_run(two_run(L, K, V, ids, n, w, x0, r), far, next, r < nw * H ? kh : vh, 0);
        }
    }
    return sum;
}

/* Reads the blocks ids[0 .. n) of one layer in that order, prefetching as the decode kernels do
 * (tool_sum_block): the next block into L2, or where g_pf_l1 says the library's lead in bytes,
 * or where g_head says the next head into L2; in two passes where g_two says (read_two). */
static uint64_t read_blocks(const pkv_layout *L, const uint8_t *K, const uint8_t *V, const int32_t *ids, size_t n) {
    if (g_two) return read_two(L, K, V, ids, n);
    const size_t kh = L->k_block_bytes / L->n_kv_heads, vh = L->v_block_bytes / L->n_kv_heads;
    uint64_t sum = 0;
    for (size_t x = 0; x < n; x++) {
        const uint8_t *kn = NULL, *vn = NULL;
        if (x + 1 < n) kn = K + (size_t)ids[x + 1] * L->k_block_bytes, vn = V + (size_t)ids[x + 1] * L->v_block_bytes;
        sum += tool_sum_block(K + (size_t)ids[x] * L->k_block_bytes, V + (size_t)ids[x] * L->v_block_bytes, kn, vn,
                              L->n_kv_heads, kh, vh, g_pf_l1 ? 2 : g_head ? 3 : 0, L->k_dtype == PKV_DTYPE_F32 ? 1 : 2);
    }
    return sum;
}

static void *gather_read(void *arg) {
    gather_job *j = arg;
    const setup *s = j->s;
    const pkv_layout *L = &s->L;
    const uint8_t *K = L->k_base + (size_t)j->layer * L->layer_stride_bytes;
    const uint8_t *V = L->v_base + (size_t)j->layer * L->layer_stride_bytes;
    if (s->swept) { /* pool order: group after group, thread (chunk) c reads range c / ns of set c % ns */
        uint64_t sum = 0;
        const uint32_t c = j->part, nt = j->n_parts;
        for (uint32_t g = 0; g < s->sw_groups; g++) {
            const sweep_group *gr = &s->sw[g];
            const uint32_t ns = gr->ns, nr = gr->chunks / ns;
            if (c < gr->chunks) {
                const uint32_t set = c % ns, rg = c / ns;
                const uint32_t a = gr->cut[set], sn = gr->cut[set + 1] - a;
                const uint32_t x0 = a + (uint32_t)((uint64_t)sn * rg / nr), x1 = a + (uint32_t)((uint64_t)sn * (rg + 1) / nr);
                sum += read_blocks(L, K, V, s->swept + x0, x1 - x0);
            }
            atomic_fetch_add(j->groups_done, 1);
            while (atomic_load(j->groups_done) < (g + 1) * nt) sched_yield();
        }
        j->sum = sum;
        return NULL;
    }
    const uint32_t b0 = s->per_seq * j->part / j->n_parts, b1 = s->per_seq * (j->part + 1) / j->n_parts;
    uint64_t sum = 0;
    for (uint32_t i = j->seq0; i < s->batch; i += j->seq_step)
        sum += read_blocks(L, K, V, s->tables + (size_t)i * s->per_seq + b0, b1 - b0);
    j->sum = sum;
    return NULL;
}

/* One plain read of the setup's next layer on nt pinned threads, seconds. The sequences are dealt
 * round-robin; with fewer sequences than threads, each thread reads a part of every sequence's
 * blocks (the kernel's key split). */
static double gather_sample(setup *s, uint32_t nt) {
    gather_job jobs[2];
    const uint32_t layer = s->next_read_layer++ % s->n_layers;
    const int split = s->batch < nt || s->swept; /* swept: thread i is the sweep's chunk i */
    _Atomic uint32_t groups_done = 0;
    for (uint32_t i = 0; i < nt; i++)
        jobs[i] = split ? (gather_job){s, layer, 0, 1, i, nt, &groups_done, 0}
                        : (gather_job){s, layer, i, nt, 0, 1, &groups_done, 0};
    const double sec = run_pinned((int)nt, gather_read, jobs, sizeof jobs[0]);
    for (uint32_t i = 0; i < nt; i++) g_sink += jobs[i].sum;
    return sec;
}

/* One timed call on a setup: seconds, or < 0 when it failed (reported). */
typedef double (*timed_call)(setup *s, void *ctx);

/* Two sides timed against each other, side l a call on s[l] with ctx[l]: calls alternate in
 * ABBA order (0, 1, 1, 0, ...), for about max_s seconds and at least min_calls calls a side.
 * med[l]: the median seconds per call of side l; 0, or -1 when a call failed. Interleaving call
 * by call puts both sides under the same conditions of a shared machine (its bandwidth and clock
 * change within a second). */
static int time_sides(setup *const s[2], timed_call call, void *const ctx[2], double max_s, uint32_t min_calls,
                      double med[2]) {
    enum { MAX_CALLS = 200 };
    double t[2][MAX_CALLS];
    int n[2] = {0, 0};
    const uint64_t start = tool_now_ns();
    for (uint32_t i = 0; n[0] < MAX_CALLS && n[1] < MAX_CALLS; i++) {
        const int l = (i ^ (i >> 1)) & 1;
        const double sec = call(s[l], ctx[l]);
        if (sec < 0) return -1;
        t[l][n[l]++] = sec;
        if ((uint32_t)n[0] >= min_calls && n[0] == n[1] && (double)(tool_now_ns() - start) * 1e-9 > max_s) break;
    }
    for (int l = 0; l < 2; l++) med[l] = tool_median(t[l], (size_t)n[l]);
    return 0;
}

/* One round of timing for the two layouts (su[0] contiguous, su[1] paged), the same ctx. */
static int time_abba(setup su[2], timed_call call, void *ctx, double max_s, uint32_t min_calls, double med[2]) {
    setup *const s[2] = {&su[0], &su[1]};
    void *const c[2] = {ctx, ctx};
    return time_sides(s, call, c, max_s, min_calls, med);
}

typedef struct decode_args {
    const float *q;
    float *out;
    pkv_attn_params p;
} decode_args;

/* timed_call: one decode call on the setup's next layer */
static double timed_decode(setup *s, void *ctx) {
    decode_args *a = ctx;
    const uint64_t t0 = tool_now_ns();
    const int rc = decode_next(s, a->q, a->out, &a->p);
    const uint64_t t1 = tool_now_ns();
    return rc < 0 ? -1.0 : (double)(t1 - t0) * 1e-9;
}

/* timed_call: one plain read of the setup's next layer; ctx: the thread count (uint32_t) */
static double timed_gather(setup *s, void *ctx) { return gather_sample(s, *(const uint32_t *)ctx); }

/* One round of decode timing for the two layouts (time_abba), each call on the layout's next
 * layer, after one warm-up call each. */
static int time_decode_pair(setup su[2], const float *q, float *out, double max_s, uint32_t min_calls, double med[2]) {
    decode_args a = {q, out, bench_params()};
    if (decode_next(&su[0], q, out, &a.p) < 0 || decode_next(&su[1], q, out, &a.p) < 0) return -1; /* warm-up */
    return time_abba(su, timed_decode, &a, max_s, min_calls, med);
}

/* --bf16-dot's baseline: the contiguous layout's calls with the flag and without (time_sides, one
 * setup: each call its next layer); med[0] with the flag, med[1] without. */
static int time_flag_pair(setup *s, const float *q, float *out, double max_s, uint32_t min_calls, double med[2]) {
    decode_args a[2] = {{q, out, bench_params()}, {q, out, bench_params()}};
    a[1].p.flags = 0;
    if (timed_decode(s, &a[0]) < 0 || timed_decode(s, &a[1]) < 0) return -1; /* warm-up */
    setup *const ss[2] = {s, s};
    void *const c[2] = {&a[0], &a[1]};
    return time_sides(ss, timed_decode, c, max_s, min_calls, med);
}

/* A round of plain reads (time_abba): the ratio of the medians, paged / contiguous. */
static double gather_ratio(setup su[2], uint32_t nt, double max_s, uint32_t min_calls) {
    double med[2] = {1.0, 1.0};
    (void)time_abba(su, timed_gather, &nt, max_s, min_calls, med); /* a plain read cannot fail */
    return med[1] / med[0];
}

/* The same kernel with K/V already in the caches: one layer of HOT_BYTES, called over and over
 * for about max_s seconds (after two warm-up calls) on the setup's first layer; the median
 * seconds per call. Its bytes per second are what the kernel's arithmetic allows when memory is
 * not in the way, so decode from memory can reach at most min(read bandwidth, this). */
#define HOT_BYTES (8.0 * 1024 * 1024)
static int time_decode_hot(setup *s, const float *q, float *out, double max_s, double *med) {
    enum { MAX_CALLS = 400, MIN_CALLS = 10 };
    double t[MAX_CALLS];
    int n = 0;
    pkv_attn_params p = bench_params();
    for (int i = 0; i < 2; i++)
        if (decode_next(s, q, out, &p) < 0) return -1;
    const uint64_t start = tool_now_ns();
    while (n < MAX_CALLS) {
        const uint64_t t0 = tool_now_ns();
        const int rc = decode_next(s, q, out, &p);
        const uint64_t t1 = tool_now_ns();
        if (rc < 0) return -1;
        t[n++] = (double)(t1 - t0) * 1e-9;
        if (n >= MIN_CALLS && (double)(t1 - start) * 1e-9 > max_s) break;
    }
    *med = tool_median(t, (size_t)n);
    return 0;
}

/* Other tenants of a shared machine change the available bandwidth from one second to the next,
 * so a configuration is measured in rounds: each round samples the read bandwidth, then times
 * the contiguous and the paged layout with their calls interleaved (time_decode_pair). Fractions
 * and the paged / contiguous ratio are per round; the report gives their medians over the rounds. */
static int bench_decode(const opts *o, pkv_dtype dt, uint32_t ctx, uint32_t batch, uint32_t nt, tool_rng *rng) {
    const size_t row = pkv_dtype_row_bytes(dt, HEAD_DIM) * 2; /* K + V */
    const double per_layer = (double)batch * ctx * H_KV * row;
    const double budget = o->quick ? 256.0 * 1024 * 1024 : 2.0 * GIB;
    if (per_layer > budget) {
        if (!o->json)
            printf("%-7s %-8s %6u %5u %3u  skipped: one layer is %.1f GiB, over the %.1f GiB budget\n", "decode",
                   pkv_dtype_name(dt), ctx, batch, nt, per_layer / GIB, budget / GIB);
        return 0;
    }
    uint32_t n_layers = (uint32_t)(budget / (per_layer * 100.0 / o->occupancy)); /* the pool, free blocks included */
    if (n_layers < 1) n_layers = 1;
    if (n_layers > 4096) n_layers = 4096;
    const int rounds = opts_rounds(o);
    const double round_s = o->quick ? 0.1 : 0.15;
    const uint32_t min_calls = per_layer >= 64.0 * 1024 * 1024 ? 3 : 15;
    float *q = malloc(sizeof(float) * batch * g_hq * HEAD_DIM), *out = malloc(sizeof(float) * batch * g_hq * HEAD_DIM);
    if (!q || !out) {
        fprintf(stderr, "pkv bench attn: out of memory for the queries\n");
        free(q), free(out);
        return -1;
    }
    for (size_t i = 0; i < (size_t)batch * g_hq * HEAD_DIM; i++) q[i] = (float)tool_rng_normal(rng);
    /* su[2]: the in-cache run, paged, one layer of about HOT_BYTES: up to 2 of the batch's
     * sequences, as many tokens as fit (at most ctx) */
    const uint32_t hot_batch = batch < 2 ? batch : 2;
    uint32_t hot_ctx = (uint32_t)(HOT_BYTES / ((double)hot_batch * H_KV * row)) / g_bt * g_bt;
    if (hot_ctx > ctx) hot_ctx = ctx;
    if (hot_ctx < g_bt) hot_ctx = g_bt;
    const double hot_layer = (double)hot_batch * hot_ctx * H_KV * row;
    /* su[1] reads su[0]'s pool: the same pages, in two block orders */
    setup su[3];
    tool_pool_loan loan = {0};
    int rc = 0, made = 0;
    for (; made < 3; made++) {
        if (made == 1) rc = tool_check(tool_pool_loan_from(su[0].c, &loan), "pool loan");
        if (rc == 0)
            rc = made < 2 ? setup_make(&su[made], dt, ctx, batch, n_layers, nt, made, made ? &loan : NULL, rng,
                                          o->occupancy)
                          : setup_make(&su[made], dt, hot_ctx, hot_batch, 1, nt, 1, NULL, rng, 100);
        if (rc < 0) {
            fprintf(stderr, "pkv bench attn: set-up failed for %s ctx %u batch %u: %s\n", pkv_dtype_name(dt), ctx, batch,
                    pkv_strerror(rc));
            break;
        }
    }
    double t[2][ROUNDS_MAX], frac[2][ROUNDS_MAX], bw[ROUNDS_MAX], ratio[ROUNDS_MAX], hot[ROUNDS_MAX],
        hot_frac[ROUNDS_MAX], mem_ratio[ROUNDS_MAX], flag_ratio[ROUNDS_MAX];
    for (int r = 0; r < rounds && rc == 0; r++) {
        bw[r] = bw_sample((int)nt);
        double med[2] = {0, 0}, hot_med = 0;
        rc = time_decode_pair(su, q, out, 2 * round_s, min_calls, med);
        if (rc == 0) rc = time_decode_hot(&su[2], q, out, round_s / 2, &hot_med);
        if (rc < 0) break;
        mem_ratio[r] = gather_ratio(su, nt, round_s, min_calls);
        flag_ratio[r] = 1.0;
        if (g_attn_flags) {
            double fm[2] = {1.0, 1.0};
            rc = time_flag_pair(&su[0], q, out, round_s, min_calls, fm);
            if (rc < 0) break;
            flag_ratio[r] = fm[0] / fm[1];
        }
        for (int l = 0; l < 2; l++) t[l][r] = med[l], frac[l][r] = per_layer / med[l] * 1e-9 / bw[r];
        ratio[r] = t[1][r] / t[0][r];
        hot[r] = hot_layer / hot_med * 1e-9, hot_frac[r] = hot[r] / bw[r];
    }
    const double adjacent[2] = {su[0].adjacent, su[1].adjacent};
    const uint64_t moved = su[1].moved;
    const uint32_t passes = su[1].passes;
    const double compact_ms = su[1].compact_s * 1e3;
    for (int l = made - 1; l >= 0; l--) setup_free(&su[l]); /* the borrower first; a failed setup_make freed its own */
    free(q), free(out);
    if (rc < 0) return -1;
    const double bw_med = tool_median(bw, (size_t)rounds), ratio_med = tool_median(ratio, (size_t)rounds);
    /* the spread of the per-round ratios: their quartiles */
    const double ratio_q1 = tool_percentile(ratio, (size_t)rounds, 25.0);
    const double ratio_q3 = tool_percentile(ratio, (size_t)rounds, 75.0);
    const double hot_med = tool_median(hot, (size_t)rounds), hot_frac_med = tool_median(hot_frac, (size_t)rounds);
    const double mem_ratio_med = tool_median(mem_ratio, (size_t)rounds);
    const double flag_med = tool_median(flag_ratio, (size_t)rounds);
    const double flag_q1 = tool_percentile(flag_ratio, (size_t)rounds, 25.0);
    const double flag_q3 = tool_percentile(flag_ratio, (size_t)rounds, 75.0);
    for (int paged = 0; paged <= 1; paged++) {
        const double med = tool_median(t[paged], (size_t)rounds), fr = tool_median(frac[paged], (size_t)rounds);
        const double gbps = per_layer / med * 1e-9;
        const char *layout = paged ? "paged" : "contig";
        if (o->json)
            printf("{\"bench\":\"attn\",\"kernel\":\"decode\",\"kv_dtype\":\"%s\",\"ctx\":%u,\"batch\":%u,\"threads\":%u,"
                   "\"layout\":\"%s\",\"median_us\":%.2f,\"gbps\":%.3f,\"read_bw_gbps\":%.3f,\"frac_of_bw\":%.4f,"
                   "\"ws_mib\":%.0f,\"bytes_per_token_layer\":%zu,\"rounds\":%d,\"adjacent_blocks\":%.3f,"
                   "\"occupancy\":%.2f,\"attn_flags\":%u,\"n_q_heads\":%u",
                   pkv_dtype_name(dt), ctx, batch, nt, layout, med * 1e6, gbps, bw_med, fr,
                   per_layer * n_layers / (1024.0 * 1024.0), (size_t)H_KV * row, rounds, adjacent[paged],
                   o->occupancy / 100.0, g_attn_flags, g_hq);
        else
            printf("%-7s %-8s %6u %5u %3u  %-6s %10.1f %8.2f %8.2f %6.1f%% %7.0f %6zu", "decode", pkv_dtype_name(dt), ctx,
                   batch, nt, layout, med * 1e6, gbps, bw_med, 100.0 * fr, per_layer * n_layers / (1024.0 * 1024.0),
                   (size_t)H_KV * row);
        if (o->json) printf(",\"hot_gbps\":%.3f,\"hot_frac_of_bw\":%.4f", hot_med, hot_frac_med);
        else printf(" %8.2f %6.1f%%", hot_med, 100.0 * hot_frac_med);
        if (paged) {
            if (o->json) {
                printf(",\"paged_over_contig\":%.4f,\"paged_over_contig_q1\":%.4f,\"paged_over_contig_q3\":%.4f,"
                       "\"read_paged_over_contig\":%.4f",
                       ratio_med, ratio_q1, ratio_q3, mem_ratio_med);
                if (g_compact) printf(",\"compacted_blocks\":%llu,\"compact_passes\":%u,\"compact_ms\":%.3f",
                                      (unsigned long long)moved, passes, compact_ms);
                if (g_attn_flags)
                    printf(",\"contig_flags_over_plain\":%.4f,\"contig_flags_over_plain_q1\":%.4f,"
                           "\"contig_flags_over_plain_q3\":%.4f",
                           flag_med, flag_q1, flag_q3);
                printf("}\n");
            } else {
                printf("   %11.3f  %5.3f-%5.3f %8.3f\n", ratio_med, ratio_q1, ratio_q3, mem_ratio_med);
                if (g_attn_flags)
                    printf("#   contiguous, the flag / without it (calls interleaved): %.3f (q1-q3 %.3f-%.3f)\n",
                           flag_med, flag_q1, flag_q3);
                if (g_compact)
                {
                    if (g_compact == 2) printf("#   paged after --batch-compact: %llu block copies", (unsigned long long)moved);
                    else printf("#   paged after --compact: %llu blocks moved in %u passes", (unsigned long long)moved, passes);
                    printf(", %.1f ms; adjacent blocks %.3f\n", compact_ms, adjacent[1]);
                }
            }
        } else {
            printf(o->json ? "}\n" : "\n");
        }
    }
    fflush(stdout);
    return 0;
}

/* A short sample of the f32 FMA peak at nt threads, GFLOP/s (0 where there is no FMA loop). */
static double peak_sample(uint32_t nt) { return fma_available() ? fma_peak_n((int)nt, 1, 100000000ull / 16) : 0; }

/* A prefill JSON line beside the main one: layout (and what follows it: a JSON fragment), the
 * median time, GFLOP/s, and a ratio against the main call under its name. */
static void prefill_json_extra(pkv_dtype dt, uint32_t n_tok, uint32_t nt, const char *layout, double med, double flop,
                               const char *ratio_name, double ratio) {
    printf("{\"bench\":\"attn\",\"kernel\":\"prefill\",\"kv_dtype\":\"%s\",\"ctx\":%u,\"batch\":1,\"threads\":%u,"
           "\"layout\":%s,\"n_q_heads\":%u,\"median_us\":%.1f,\"gflops\":%.2f,\"%s\":%.4f}\n",
           pkv_dtype_name(dt), n_tok, nt, layout, g_hq, med * 1e6, flop / med * 1e-9, ratio_name, ratio);
}

static int bench_prefill(const opts *o, pkv_dtype dt, uint32_t n_tok, uint32_t nt, tool_rng *rng) {
    setup s;
    int rc = setup_make(&s, dt, n_tok, 1, 1, nt, 1, NULL, rng, 100);
    if (rc < 0) {
        fprintf(stderr, "pkv bench attn: prefill set-up failed for %s: %s\n", pkv_dtype_name(dt), pkv_strerror(rc));
        return -1;
    }
    const size_t n = (size_t)n_tok * g_hq * HEAD_DIM;
    float *q = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
    /* --mask: the causal mask, n_tok rows of n_tok bits (64-bit: 65536^2 / 8 passes a 32-bit size_t) */
    const uint64_t mask_bytes = ((uint64_t)n_tok * n_tok + 7) / 8;
    uint8_t *mask = o->mask && mask_bytes <= SIZE_MAX ? calloc((size_t)mask_bytes, 1) : NULL;
    if (!q || !out || (o->mask && !mask)) {
        fprintf(stderr, "pkv bench attn: out of memory for the queries\n");
        free(q), free(out), free(mask);
        setup_free(&s);
        return -1;
    }
    for (size_t i = 0; i < n; i++) q[i] = (float)tool_rng_normal(rng);
    for (uint64_t i = 0; mask && i < n_tok; i++)
        for (uint64_t t = 0; t <= i; t++) mask[(i * n_tok + t) >> 3] |= (uint8_t)(1u << ((i * n_tok + t) & 7u));
    const uint8_t *const masks[1] = {mask};
    pkv_attn_req req = {.seq = s.seqs[0], .q_start = 0, .n_q = n_tok};
    pkv_attn_params p = bench_params();
    /* rounds of (FMA peak sample, one prefill, FMA peak sample): the peak the machine gives
     * around the call, as the mean of the samples on either side of it */
    double t[ROUNDS_MAX], frac[ROUNDS_MAX], peak[ROUNDS_MAX], tm[ROUNDS_MAX], ratio[ROUNDS_MAX];
    double tp[ROUNDS_MAX], fratio[ROUNDS_MAX]; /* --bf16-dot: the call without the flag, flag / without */
    pkv_attn_params plain = p;
    plain.flags = 0;
    const int reps = opts_rounds(o);
    /* causal: query i sees i + 1 keys; q.k and p.v are one multiply-add each per element */
    const double flop = 4.0 * g_hq * HEAD_DIM * ((double)n_tok * (n_tok + 1) / 2.0);
    rc = tool_check(pkv_attn_prefill(s.c, 0, &req, 1, q, out, &p), "pkv_attn_prefill"); /* warm-up */
    if (mask && rc == 0)
        rc = tool_check(pkv_attn_prefill_masked(s.c, 0, &req, 1, masks, q, out, &p), "pkv_attn_prefill_masked");
    for (int i = 0; i < reps && rc == 0; i++) {
        const double before = peak_sample(nt);
        uint64_t t0 = tool_now_ns();
        rc = tool_check(pkv_attn_prefill(s.c, 0, &req, 1, q, out, &p), "pkv_attn_prefill");
        t[i] = (double)(tool_now_ns() - t0) * 1e-9;
        peak[i] = 0.5 * (before + peak_sample(nt));
        frac[i] = peak[i] > 0 ? flop / t[i] * 1e-9 / peak[i] : 0;
        if (mask && rc == 0) {
            t0 = tool_now_ns();
            rc = tool_check(pkv_attn_prefill_masked(s.c, 0, &req, 1, masks, q, out, &p), "pkv_attn_prefill_masked");
            tm[i] = (double)(tool_now_ns() - t0) * 1e-9;
            ratio[i] = tm[i] / t[i];
        }
        if (g_attn_flags && rc == 0) { /* the same prompt without the flag, after the flag's call */
            t0 = tool_now_ns();
            rc = tool_check(pkv_attn_prefill(s.c, 0, &req, 1, q, out, &plain), "pkv_attn_prefill");
            tp[i] = (double)(tool_now_ns() - t0) * 1e-9;
            fratio[i] = t[i] / tp[i];
        }
    }
    setup_free(&s);
    free(q), free(out), free(mask);
    if (rc < 0) return -1;
    const double med = tool_median(t, (size_t)reps), gflops = flop / med * 1e-9;
    const double peak_med = tool_median(peak, (size_t)reps), frac_med = tool_median(frac, (size_t)reps);
    if (o->json)
        printf("{\"bench\":\"attn\",\"kernel\":\"prefill\",\"kv_dtype\":\"%s\",\"ctx\":%u,\"batch\":1,\"threads\":%u,"
               "\"layout\":\"paged\",\"attn_flags\":%u,\"n_q_heads\":%u,\"median_us\":%.1f,\"gflops\":%.2f,"
               "\"peak_gflops\":%.2f,\"frac_of_peak\":%.4f}\n",
               pkv_dtype_name(dt), n_tok, nt, g_attn_flags, g_hq, med * 1e6, gflops, peak_med, frac_med);
    else
        printf("%-7s %-8s %6u %5u %3u  %-6s %10.1f %8.2f %8.2f %6.1f%%\n", "prefill", pkv_dtype_name(dt), n_tok, 1, nt,
               "paged", med * 1e6, gflops, peak_med, 100.0 * frac_med);
    if (g_attn_flags) { /* --bf16-dot: the flag's call / the plain one's, per round */
        const double pmed = tool_median(tp, (size_t)reps), fmed = tool_median(fratio, (size_t)reps);
        if (o->json)
            prefill_json_extra(dt, n_tok, nt, "\"paged\",\"attn_flags\":0", pmed, flop, "flags_over_plain", fmed);
        else
            printf("#   prefill without the flag: %.1f us, %.2f GFLOP/s; flag / without (calls interleaved): %.3f\n",
                   pmed * 1e6, flop / pmed * 1e-9, fmed);
    }
    if (mask) { /* the same keys through the causal mask: masked / causal */
        const double mmed = tool_median(tm, (size_t)reps), rmed = tool_median(ratio, (size_t)reps);
        if (o->json)
            prefill_json_extra(dt, n_tok, nt, "\"masked\"", mmed, flop, "masked_over_causal", rmed);
        else
            printf("%-7s %-8s %6u %5u %3u  %-6s %10.1f %8.2f  masked/causal %.3f\n", "prefill", pkv_dtype_name(dt), n_tok,
                   1, nt, "masked", mmed * 1e6, flop / mmed * 1e-9, rmed);
    }
    fflush(stdout);
    return 0;
}

/* Every dtype the cache accepts for this shape, in enum order. */
static int dtype_ok(pkv_dtype dt) {
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1, cfg.n_kv_heads = H_KV, cfg.head_dim = HEAD_DIM, cfg.block_tokens = g_bt, cfg.n_blocks = 4;
    cfg.k_dtype = cfg.v_dtype = dt;
    cfg.n_threads = 1;
    pkv_cache *c = NULL;
    if (pkv_cache_create(&cfg, &c) < 0) return 0;
    pkv_cache_destroy(c);
    return 1;
}

int tool_bench_attn(int argc, char **argv) {
    opts o;
    memset(&o, 0, sizeof o);
    o.prompt = -1;
    o.block_tokens = BT_DEFAULT;
    o.q_heads = H_Q;
    o.occupancy = 100;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(arg, "--json")) o.json = 1;
        else if (!strcmp(arg, "--quick")) o.quick = 1;
        else if (!strcmp(arg, "--compact")) g_compact = 1;
        else if (!strcmp(arg, "--batch-compact")) g_compact = 2;
        else if (!strcmp(arg, "--bf16-dot")) g_attn_flags |= PKV_ATTN_BF16_DOT;
        else if (!strcmp(arg, "--f16-as-bf16")) g_attn_flags |= PKV_ATTN_F16_AS_BF16;
        else if (!strcmp(arg, "--mask")) o.mask = 1;
        else if (!strcmp(arg, "--dtype") && val) bad = parse_dtypes(val, &o), i++;
        else if (!strcmp(arg, "--ctx") && val) bad = tool_parse_u32_list(val, o.ctx, 8, 1u << 20, &o.n_ctx), i++;
        else if (!strcmp(arg, "--batch") && val) bad = tool_parse_u32_list(val, o.batch, 8, BATCH_MAX, &o.n_batch), i++;
        else if (!strcmp(arg, "--threads") && val) bad = tool_parse_u32_list(val, o.threads, 2, 2, &o.n_threads), i++;
        else if (!strcmp(arg, "--prompt") && val) {
            char *end;
            o.prompt = strtol(val, &end, 10);
            bad = *end || end == val || o.prompt < 0 || o.prompt > 65536;
            i++;
        }
        else if (!strcmp(arg, "--block-tokens") && val) {
            int n = 0;
            bad = tool_parse_u32_list(val, &o.block_tokens, 1, BT_MAX, &n);
            i++;
        }
        else if (!strcmp(arg, "--q-heads") && val) {
            int n = 0;
            bad = tool_parse_u32_list(val, &o.q_heads, 1, 16 * H_KV, &n) || o.q_heads % H_KV;
            i++;
        }
        else if (!strcmp(arg, "--rounds") && val) {
            int n = 0;
            bad = tool_parse_u32_list(val, &o.rounds, 1, ROUNDS_MAX, &n) || o.rounds < 3;
            i++;
        }
        else if (!strcmp(arg, "--occupancy") && val) {
            int n = 0;
            bad = tool_parse_u32_list(val, &o.occupancy, 1, 100, &n) || o.occupancy < 10;
            i++;
        }
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return TOOL_OK;
        } else {
            fprintf(stderr, "pkv bench attn: unknown option or missing value '%s'\n", arg);
            usage(stderr);
            return TOOL_USAGE;
        }
        if (bad) {
            fprintf(stderr, "pkv bench attn: bad value for %s: '%s'\n", arg, val);
            return TOOL_USAGE;
        }
    }
    g_bt = o.block_tokens;
    g_hq = o.q_heads;
    static const uint32_t ctxs_full[] = {512, 4096, 32768}, ctxs_quick[] = {512, 4096};
    static const uint32_t batches_full[] = {1, 16}, batches_quick[] = {1}, threads_all[] = {1, 2};
    const uint32_t *ctxs = o.n_ctx ? o.ctx : o.quick ? ctxs_quick : ctxs_full;
    const uint32_t *batches = o.n_batch ? o.batch : o.quick ? batches_quick : batches_full;
    const uint32_t *threads = o.n_threads ? o.threads : threads_all;
    const int n_ctx = o.n_ctx ? o.n_ctx : o.quick ? 2 : 3, n_batch = o.n_batch ? o.n_batch : o.quick ? 1 : 2;
    const int n_thr = o.n_threads ? o.n_threads : 2;
    const uint32_t prompt = o.prompt >= 0 ? (uint32_t)o.prompt : o.quick ? 512 : 2048;
    int short_ctx = prompt && prompt < g_bt;
    for (int ci = 0; ci < n_ctx; ci++) short_ctx |= ctxs[ci] < g_bt;
    if (short_ctx) {
        fprintf(stderr, "pkv bench attn: --block-tokens %u is longer than a context or the prompt\n", g_bt);
        return TOOL_USAGE;
    }
    tool_rng rng;
    tool_rng_seed(&rng, 42);
    g_bw_words = (o.quick ? (256u << 20) : (1u << 30)) / 8;
    g_bw_buf = aligned_alloc(64, g_bw_words * 8); /* whole lines, as tool_sum_run reads them */
    if (!g_bw_buf) {
        fprintf(stderr, "pkv bench attn: cannot allocate the bandwidth buffer\n");
        return TOOL_FAIL;
    }
    for (size_t i = 0; i < g_bw_words; i++) g_bw_buf[i] = i;
    const unsigned family = amd_family();
    g_victim_l3 = family == 0x19u, g_pf_l1 = g_wide = g_two = family == 0x1Au;
    const int intel = intel_cpu();
    g_head = intel;
    /* the library's overrides (pkv.h) */
    const char *sweep_env = env_override("PKV_ATTN_SWEEP", "wide", "narrow", &g_wide);
    const char *passes_env = env_override("PKV_ATTN_PASSES", "two", "one", &g_two);
    const char *lead_env = env_override("PKV_ATTN_LEAD", "head", "block", &g_head);
    int pieces = intel; /* the library's PKV_CPU_PIECES (src/core/core.c) */
    const char *pieces_env = env_override("PKV_ATTN_PIECES", "on", "off", &pieces);
    const char *lead = g_pf_l1 ? "bytes" : g_head ? "head" : "block"; /* Zen 5's lead in bytes wins */
    /* the backend a cache picks; a cache the library refuses here (the environment's
     * PKV_ATTN_BACKEND, PKV_ATTN_ORDER, PKV_ATTN_SWEEP, PKV_ATTN_PASSES, PKV_ATTN_LEAD or PKV_ATTN_PIECES) ends the
     * run before any measurement */
    static char backend[32], backend_bf16[32]; /* an f16 cache's; a bf16 one's */
    bool bf16_dot = false, f16bf = false;
    {
        pkv_config cfg = pkv_config_default();
        cfg.n_blocks = 4;
        cfg.n_threads = 1;
        pkv_cache *c = NULL;
        const int crc = pkv_cache_create(&cfg, &c);
        if (crc < 0) {
            fprintf(stderr, "pkv bench attn: the library refuses a cache here: %s (see PKV_ATTN_BACKEND, "
                    "PKV_ATTN_ORDER, PKV_ATTN_SWEEP, PKV_ATTN_PASSES, PKV_ATTN_LEAD and PKV_ATTN_PIECES in pkv.h)\n",
                    pkv_strerror(crc));
            free(g_bw_buf);
            return TOOL_FAIL;
        }
        snprintf(backend, sizeof backend, "%s", pkv_attn_backend(c));
        f16bf = (pkv_attn_flags_used(c) & PKV_ATTN_F16_AS_BF16) != 0; /* the default: f16 K/V */
        pkv_cache_destroy(c);
        cfg.k_dtype = cfg.v_dtype = PKV_DTYPE_BF16; /* whether --bf16-dot changes anything here */
        if (pkv_cache_create(&cfg, &c) == PKV_OK) {
            bf16_dot = (pkv_attn_flags_used(c) & PKV_ATTN_BF16_DOT) != 0;
            snprintf(backend_bf16, sizeof backend_bf16, "%s", pkv_attn_backend(c));
            pkv_cache_destroy(c);
        }
    }
    for (int nt = 1; nt <= 2; nt++) {
        g_bw[nt] = bw_median3(nt);
        g_peak[nt] = fma_available() ? fma_peak(nt) : 0;
    }
    if (o.json)
        printf("{\"bench\":\"attn\",\"kind\":\"machine\",\"cpu\":\"%s\",\"build\":\"%s\",\"backend\":\"%s\","
               "\"backend_bf16\":\"%s\",\"read_gbps_1t\":%.3f,\"read_gbps_2t\":%.3f,\"fma_gflops_1t\":%.2f,\"fma_gflops_2t\":%.2f,"
               "\"sweep\":\"%s\",\"passes\":\"%s\",\"lead\":\"%s\",\"pieces\":\"%s\",\"bf16_dot\":%s,"
               "\"f16_as_bf16\":%s}\n",
               tool_cpu_name(), tool_build_info(), backend, backend_bf16, g_bw[1], g_bw[2], g_peak[1], g_peak[2],
               g_wide ? "wide" : "narrow", g_two ? "two" : "one", lead, pieces ? "on" : "off",
               bf16_dot ? "true" : "false", f16bf ? "true" : "false");
    else {
        printf("# %s, %s, attention backend %s", tool_cpu_name(), tool_build_info(), backend);
        if (backend_bf16[0] && strcmp(backend, backend_bf16)) printf(" (%s with bf16 K/V)", backend_bf16);
        printf("\n");
        if (g_attn_flags & PKV_ATTN_BF16_DOT)
            printf("# --bf16-dot: %s\n", bf16_dot ? "bf16 K scored by bf16 dot products (queries rounded to bf16)"
                                                  : "no bf16 dot products here: the calls compute as without it");
        if (g_attn_flags & PKV_ATTN_F16_AS_BF16)
            printf("# --f16-as-bf16: %s\n", f16bf ? "f16 K and V taken as bf16 by the prefill's tiles (inputs rounded to bf16)"
                                                   : "no bf16 tiles here: the calls compute as without it");
        printf("# streaming read: %.2f GB/s (1 thread), %.2f GB/s (2 threads); f32 FMA peak: %.1f / %.1f GFLOP/s\n",
               g_bw[1], g_bw[2], g_peak[1], g_peak[2]);
        const char *order = getenv("PKV_ATTN_ORDER");
        printf("# n_q_heads %u, n_kv_heads %d, head_dim %d, block_tokens %u, decode pools %u%% held by the batch, "
               "PKV_ATTN_ORDER=%s, PKV_ATTN_SWEEP=%s (%s here), PKV_ATTN_PASSES=%s (%s here), PKV_ATTN_LEAD=%s (%s "
               "here), PKV_ATTN_PIECES=%s (%s here)\n",
               g_hq, H_KV, HEAD_DIM, g_bt, o.occupancy, order && *order ? order : "(auto)",
               sweep_env && *sweep_env ? sweep_env : "(auto)", g_wide ? "wide" : "narrow",
               passes_env && *passes_env ? passes_env : "(auto)", g_two ? "two" : "one",
               lead_env && *lead_env ? lead_env : "(auto)", lead, pieces_env && *pieces_env ? pieces_env : "(auto)",
               pieces ? "on" : "off");
        printf("%-7s %-8s %6s %5s %3s  %-6s %10s %8s %8s %7s %7s %6s %8s %7s  %s  %-11s %8s\n", "kernel", "kv", "ctx",
               "batch", "thr", "layout", "median_us", "GB/s", "readBW", "of_bw", "ws_MiB", "B/tok", "hotGB/s", "hot_bw",
               "paged/contig", "p/c q1-q3", "read_p/c");
    }
    fflush(stdout);

    int rc = 0;
    for (int d = 0; d < PKV_DTYPE_COUNT && rc == 0; d++) {
        pkv_dtype dt = (pkv_dtype)d;
        if (o.dtype_set ? !o.dtype_on[d] : (o.quick && dt != PKV_DTYPE_F16)) continue;
        if (!dtype_ok(dt)) continue;
        for (int ci = 0; ci < n_ctx && rc == 0; ci++)
            for (int bi = 0; bi < n_batch && rc == 0; bi++)
                for (int ti = 0; ti < n_thr && rc == 0; ti++) rc = bench_decode(&o, dt, ctxs[ci], batches[bi], threads[ti], &rng);
    }
    if (!o.json && prompt)
        printf("%-7s %-8s %6s %5s %3s  %-6s %10s %8s %8s %7s\n", "kernel", "kv", "prompt", "batch", "thr", "layout",
               "median_us", "GFLOP/s", "peak", "of_peak");
    for (int d = 0; d < PKV_DTYPE_COUNT && rc == 0 && prompt; d++) {
        pkv_dtype dt = (pkv_dtype)d;
        if (o.dtype_set ? !o.dtype_on[d] : (o.quick && dt != PKV_DTYPE_F16)) continue;
        if (!dtype_ok(dt)) continue;
        for (int ti = 0; ti < n_thr && rc == 0; ti++) rc = bench_prefill(&o, dt, prompt, threads[ti], &rng);
    }
    free(g_bw_buf);
    return rc == 0 ? TOOL_OK : TOOL_FAIL;
}
