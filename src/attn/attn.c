/* attn.c: the paged attention driver: validates a call, plans it into work units (items x
 * kv-head groups x query tiles x key splits), runs them on the context's thread pool with the
 * backend's primitives (online softmax over one block at a time) and merges key splits by
 * log-sum-exp. Dtype- and ISA-independent; see attn.h for the kernel table. */
#include "attn.h"
#include "attn_pool.h"
#include "../quant/quant.h"

#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <sched.h>
#include <unistd.h>

/* Rows (query position x query head pairs) one work unit holds; its scratch is
 * ROWS_MAX x (prepared q + acc) + a block of scores. 64 covers every kv head of a decode with
 * 32 query heads, and prefill tiles of 32 rows per kv head for two heads. */
#define ROWS_MAX 64u
/* Prefill tiles aim at this many rows per kv head: every K/V row loaded is used this many times. */
#define ROWS_PER_HEAD 32u
/* The same where the units run AMX tiles (runs_tiles), whose kernels convert K and V (V's pairs;
 * f16 to bf16) once a unit: a 2,048-token prefill on the Xeon of stop 87, standalone loop, 1
 * thread: f16 with PKV_ATTN_F16_AS_BF16 113-115 ms against 129-133 at 32 rows, bf16 with
 * PKV_ATTN_BF16_DOT 107-108 against 109-115. */
#define ROWS_PER_HEAD_TILES 64u
/* A key split covers at least this many blocks: below it, the merge costs more than it saves. */
#define MIN_SPLIT_BLOCKS 4u
/* The transposed path (attn.h: score_t) takes heads of at least PKV__ATTN_T_MIN_ROWS rows, so a
 * unit holds at most ROWS_MAX / 16 of them, each padded to a multiple of 16 rows: the columns of
 * qt a thread needs at most, and the lanes of one head's transposed scores. */
#define T_QT_ROWS (ROWS_MAX + 15u * (ROWS_MAX / PKV__ATTN_T_MIN_ROWS))
#define T_ROWS_PAD ((ROWS_MAX + 15u) & ~15u)
/* Keys the transposed scores hold: a block's, or a group's for accum_tn (attn.h) */
#define T_S_KEYS(s_stride) PKV_MAX((s_stride), PKV__ATTN_T_RUN_KEYS)
/* Rows of head_dim floats in vbuf: a block's widened V, or a group's interleaved pairs (accum_tn) */
#define T_V_ROWS PKV_MAX(PKV__ATTN_T_KEYS, PKV__ATTN_T_RUN_KEYS / 2)
/* Key-split partial slots per thread. */
#define SLOTS_PER_THREAD 16u
/* The row path's pieces where PKV_CPU_PIECES says (piece_call, block_pieces): a (block, head) run
 * of 16-bit K longer than this is taken this many bytes of K at a time. */
#define PKV_ATTN_PIECE_BYTES 4096u
/* Below about this many K/V elements (per plan) waking the workers costs more than they save:
 * 64 blocks of 16 tokens x head_dim 128, a few microseconds of work. */
#define INLINE_WORK_ELEMS (64u * 16u * 128u)
/* The two passes (pass_window): a window's scores take at most PASS_BYTES of a thread's scratch
 * (or one block's of ROWS_MAX rows where that is more), and a window holds at most
 * PASS_BLOCKS_MAX blocks. f16 4096 x 16 at 1 thread (ab-decode, stop 44): windows of 32 blocks
 * (64 KiB of scores at 32 rows) against 16: 1.036 paged, 1.009 contiguous; 64 against 32: 0.997
 * and 0.990. */
#define PASS_BYTES ((size_t)64 * 1024)
#define PASS_BLOCKS_MAX 64u

/* Key splits aim at this many units per thread: two, so a thread the OS preempts holds back at
 * most a quarter of a 2-thread call (the sweep takes one chunk a thread: below). Smaller splits
 * cost more than they balance: at 4 per thread, decode of one to four sequences from
 * contiguous tables at 2 threads took 1-15% longer (docs/design.md, stop 25). */
#ifndef UNITS_PER_THREAD
#define UNITS_PER_THREAD 2u
#endif
/* ... but key splits cut an item into more parts than threads only where each part still reads
 * this many blocks of it: every part starts a partial state and the merge reads them all. At 2
 * parts a thread the sweep cost 9% at 512 tokens x 1 and 1-3% at 512 x 16 (stop 25); key splits, f16
 * decode of one sequence from contiguous tables at 2 threads (ab-decode, stop 28): 512 tokens
 * (4 splits of 8 blocks before, 2 of 16 now) 0.859 and 1/1.249, 1024 tokens 0.937 and 1/1.127;
 * 2048 (4 splits of 32 blocks) unchanged. */
#define PART_ITEM_BLOCKS 32u

/* The most parts work of item_blocks blocks per item may be cut into: one a thread at least,
 * more only as PART_ITEM_BLOCKS allows. */
static uint64_t parts_cap(uint32_t n_threads, uint64_t item_blocks) {
    return PKV_MAX((uint64_t)n_threads, item_blocks / PART_ITEM_BLOCKS);
}

/* Pool-order decode (the "sweep", below): a call's one-query items are swept in groups of at
 * most SWEEP_ITEMS, one chunk a thread, for contexts of at most SWEEP_MAX_THREADS threads (its
 * state slots are items x chunks). A chunk keeps the running state of the items of its set (32
 * KiB of queries and acc a sequence at 32 query heads x head_dim 128), and between two visits to
 * one it reads an entry (K/V runs and state) of each other: a group holds as many items a
 * thread as make SWEEP_STATE_L2_EIGHTHS eighths of the core's L2 in such bytes, and at most
 * SWEEP_STATE_BYTES_MAX, at least SWEEP_CHUNK_ITEMS_MIN (SWEEP_CHUNK_ITEMS_MIN_VICTIM where a
 * victim L3 backs the L2, PKV_CPU_VICTIM_L3). With 16-token blocks that is 8 sequences for f16
 * and bf16 (96 KiB an entry), and 4 for f32 (160 KiB) or 8 with a victim L3, both on the 2 MiB
 * L2 of stop 32's Intel machine and on Zen 4's 1 MiB. Fewer make sparser reads of the pool,
 * more states that leave L2 between visits. On Intel more than 8 cost 2% to 7% of the call,
 * and at f32 or with 64-token blocks 4 beat 8 by 0.4-2.7%. On Zen 4 a state that leaves L2
 * is found in L3: at f16 the states cost 0.5% of the call at 4 and 4% at 8, and 8 beat 4 by
 * up to 2.4% at 1 thread and 2.4-6.1% at 2 (quiet memory); at f32 and with 32- and 64-token
 * blocks 8 beat 4 by 0.5-3.6% in 15 of 16 paired runs (docs/design.md, stops 32 and 34). An
 * entry key packs (block id << 32 | item << 27 | block index), so a sequence's blocks up to
 * 2^27.
 * Where PKV_CPU_WIDE_SWEEP says the gaps cost more than the states (Zen 5), a group holds as
 * many items as the sweep does (SWEEP_ITEMS, fewer where their entries would pass sweep_cap),
 * as one set cut into block ranges, a range a chunk: each thread reads a region of the pool with
 * no gaps and keeps every item's state, and no state is prefetched. There, against sets of 8 at
 * f16 4096 tokens (stop 38, ab-decode): 0.962 at batch 16 and 1 thread, 0.974 at 2 threads;
 * 0.910 and 0.915 at batch 32. The state prefetch alone, on a set of 16 at 1 thread, made the
 * call 1.10-1.18x as slow there. */
#define SWEEP_ITEMS 32u
#define SWEEP_STATE_L2_EIGHTHS 6u
#define SWEEP_STATE_BYTES_MAX ((size_t)768 * 1024) /* 3/8 of a 2 MiB L2 */
#define SWEEP_CHUNK_ITEMS_MIN 4u
#define SWEEP_CHUNK_ITEMS_MIN_VICTIM 8u
#define SWEEP_MAX_THREADS 16u
#define SWEEP_B_BITS 27u
#define SWEEP_ENTRIES_MAX (1u << 20)
#define SWEEP_ENTRIES_UNBOUNDED 65536u
/* AUTO reads in table order when the tables' runs of neighbouring blocks average this many:
 * there the sweep's state traffic and merges cost more (about 1% on contiguous tables) than the
 * few jumps it would save. */
#define SWEEP_TABLE_RUN 32u
enum { SWEEP_Q_NONE, SWEEP_Q_BUSY, SWEEP_Q_READY }; /* an item's queries in a sweep (run_chunk) */
_Static_assert(SWEEP_ITEMS <= 32 && ((uint64_t)SWEEP_ITEMS << SWEEP_B_BITS) <= (1ull << 32),
               "an entry's item fits the key's bits and a chunk's 32-bit mask of started items");

typedef struct plan_item {
    uint32_t unit0;      /* first unit of this item */
    uint32_t n_units;
    uint32_t n_hgs;      /* head groups: kv-head ranges, or query-head sub-groups of one kv head */
    uint32_t heads_per;  /* kv heads per group (1 when n_gsub > 1) */
    uint32_t n_gsub;     /* query-head sub-groups per kv head (> 1 only when G > ROWS_MAX) */
    uint32_t gsub;       /* query heads per sub-group */
    uint32_t qtile;      /* queries per tile */
    uint32_t n_qt;
    uint32_t n_ks;       /* key splits per (group, tile) */
    uint32_t slot0;      /* first partial slot (n_ks > 1) */
    uint32_t grp0;       /* first split counter (n_ks > 1) */
} plan_item;

struct pkv__attn {
    uint64_t head_blocks;  /* of the current plan: (kv head, block) pairs its units read */
    uint32_t last_threads; /* threads the last run used (1: the caller alone) */
    _Atomic uint64_t items_pool, items_table; /* pkv__attn_item_counts */
    bool hold;                                /* pkv__attn_hold_counts: runs add to held instead */
    uint64_t held[2];                         /* held items: pool, table */
    uint64_t inline_elems; /* plans under this many K/V elements run on the caller alone */
    pkv_allocator a;
    size_t alloc_bytes;
    /* the backend's table; copies of it with its lp_fill applied (PKV_ATTN_BF16_DOT: [1]), its
     * f16_fill ([2]) or both ([3]); kt, one of the four, is the current call's (flags_table) */
    pkv__attn_kernels kt_tab[4];
    const pkv__attn_kernels *kt;
    pkv__attn_limits lim;
    uint32_t n_threads;
    pkv__tpool pool;
    pkv__tpool_worker *workers;
    /* per-thread scratch, thread_bytes each: prepared q [ROWS_MAX][QROW], acc [ROWS_MAX][head_dim],
     * m, l [ROWS_MAX], scores [ROWS_MAX][s_stride], the two passes' score window (pass_bytes); where
     * the backend has the transposed
     * primitives (attn.h: score_t) also qt [T_QT_ROWS][head_dim], scores [T_S_KEYS][T_ROWS_PAD],
     * kbuf [PKV__ATTN_T_KEYS][head_dim] and vbuf [T_V_ROWS][head_dim] */
    uint8_t *scratch;
    size_t thread_bytes;
    uint32_t s_stride;
    /* key-split partials: n_slots x [ROWS_MAX] m, [ROWS_MAX] l, [ROWS_MAX][head_dim] acc */
    float *partials;
    size_t slot_floats;
    uint32_t n_slots;
    _Atomic uint32_t *split_done; /* [n_slots]: finished splits per (group, tile) */
    plan_item *plan;              /* [max_items] */
    /* pool-order decode: sweep_cap entries (0: never), their keys sorted through sweep_tmp,
     * prepared queries (room for sweep_items x ROWS_MAX rows of QROW bytes; a group packs them
     * [item][H x G]), state slots [sweep_items][chunks max] (slot_floats each), the call's
     * swept items (sweep_idx [max_items]: the items of one query, sweep_total of them, in batch
     * order) and, for the group being swept (sweep_idx[sweep_i0 .. sweep_i0 + sweep_ni)), its
     * entry count and chunks */
    int order;
    bool last_swept;
    uint32_t sweep_cap, sweep_chunks_max, sweep_items_cap, sweep_group_max;
    uint64_t *sweep_keys, *sweep_tmp;
    const uint64_t *sweep_sorted;
    uint8_t *sweep_q;
    float *sweep_slots;
    uint32_t *sweep_idx;
    uint32_t sweep_total, sweep_n, sweep_chunks, sweep_i0, sweep_ni;
    /* the group's sets (sweep_prepare): set k's entries are sweep_sorted[sweep_set[k] ..
     * sweep_set[k + 1]), its items [sweep_set_i0[k], sweep_set_i1[k]); chunk c sweeps range
     * c / sweep_n_sets of set c % sweep_n_sets */
    uint32_t sweep_n_sets, sweep_set[SWEEP_MAX_THREADS + 1], sweep_set_i0[SWEEP_MAX_THREADS],
        sweep_set_i1[SWEEP_MAX_THREADS];
    /* the group's items within its one job (run_chunk): queries not made, being made or ready
     * (SWEEP_Q_*), and chunks done with the item (part_done: the last one merges it) */
    _Atomic uint32_t sweep_qstate[SWEEP_ITEMS], sweep_done[SWEEP_ITEMS];
    size_t l2_bytes; /* a core's L2 cache (sysconf), or L2_GUESS_BYTES: see run_chunk's state prefetch */
    uint32_t sweep_items_min; /* sequences a thread a sweep group holds at least (SWEEP_CHUNK_ITEMS_MIN) */
    bool sweep_wide; /* groups as large as the sweep holds, one set cut into ranges (PKV_CPU_WIDE_SWEEP) */
    int pf_l1;   /* the next block's prefetch into L1 (PKV_CPU_PREFETCH_L1), else into L2: head_io_fill */
    int pf_fine; /* and a decode head's score in finer shares (the same flag; attn.h, PKV__ATTN_PF_SUB_FINE) */
    int pf_two;  /* and the row path's led by bytes, at two levels, where pf_l1 is set (the same flag; head_io_fill) */
    int pf_head; /* the row path's prefetch leads by one head (PKV_CPU_LEAD_HEAD), where pf_two is not set: into L2,
                  * or L1 where K and V are quantized (pf_l1_call) */
    uint32_t pf_lead; /* the call's lead in heads: pf_ahead where pf_two and pf_l1 are set, 1 where pf_head is, else 0 */
    int pf_l1_call;   /* the call's: pf_l1, or where the one-head lead (pf_head) reads quantized K and V, L1 too */
    uint32_t piece_bytes; /* the row path's pieces of a head's run, in bytes of K (PKV_CPU_PIECES); 0: whole runs */
    uint32_t piece_keys;  /* the call's: keys a piece (piece_call), 0 where runs are taken whole */
    bool tpath;  /* units of many rows take the transposed primitives where the backend has them */
    bool two_pass;        /* the row path in two passes, K then V (PKV_CPU_TWO_PASS; pass_window) */
    uint32_t pass_blocks; /* the most blocks a window of the two passes holds */
    uint32_t pass_ahead;  /* the call's lead in runs along the two passes' walk (pass_pf) */
    size_t pass_bytes;    /* a thread's score window (PASS_BYTES at least) */
    /* the call being run (read-only for the workers during a job) */
    const pkv__kv_view *kv; /* during a run: kv_own */
    pkv__kv_view kv_own;    /* the run's view, v_dim resolved */
    const pkv__attn_item *items;
    const pkv__attn_call *call;
    uint32_t n_items;
    uint32_t G; /* query heads per kv head */
};

/* ---- backend tables ------------------------------------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
static bool have_avx2(uint32_t f) {
    const uint32_t need = PKV_CPU_AVX2 | PKV_CPU_FMA | PKV_CPU_F16C;
    return (f & need) == need;
}
/* AVX-VNNI, where this build has its kernels (CMake: PKV_HAVE_AVXVNNI) */
static bool have_avxvnni(uint32_t f) {
#ifdef PKV_HAVE_AVXVNNI
    return have_avx2(f) && (f & PKV_CPU_AVXVNNI);
#else
    (void)f;
    return false;
#endif
}
static bool have_avx512(uint32_t f) {
    const uint32_t need = PKV_CPU_AVX512F | PKV_CPU_AVX512BW | PKV_CPU_AVX512VL | PKV_CPU_AVX512DQ;
    return (f & need) == need && have_avx2(f);
}
/* "avx512-amx": avx512-vnni with bf16 tiles, where this build has AMX kernels (CMake:
 * PKV_HAVE_AMX), the CPU has AMX-BF16 and AVX512_BF16 and Linux grants the tile state (asked
 * here, once a process: pkv__amx_enable) */
static bool have_amx(uint32_t f) {
#ifdef PKV_HAVE_AMX
    const uint32_t need = PKV_CPU_AVX512VNNI | PKV_CPU_AVX512BF16 | PKV_CPU_AMX_BF16;
    return have_avx512(f) && (f & need) == need && pkv__amx_enable();
#else
    (void)f;
    return false;
#endif
}
#endif

/* Every table starts as the reference, then the SIMD fillers override what they implement:
 * a dtype with only a reference kernel still runs (slowly) on a SIMD backend. */
static int build_kernels(const char *want, pkv__attn_kernels *kt) {
    memset(kt, 0, sizeof *kt);
    pkv__attn_fill_ref(kt);
    pkv__attn_fill_q_ref(kt);
    if (!strcmp(want, "ref")) return PKV_OK;
#if defined(__x86_64__) || defined(__i386__)
    const uint32_t f = pkv__cpu_features();
    const bool avxvnni = !strcmp(want, "avx2-vnni");
    if (avxvnni || !strcmp(want, "avx2")) {
        if (!have_avx2(f) || (avxvnni && !have_avxvnni(f))) return PKV_ENOTSUP;
        pkv__attn_fill_avx2(kt);
        /* quantized-dtype fillers for AVX2 go here */
        pkv__attn_fill_q_avx2(kt);
#ifdef PKV_HAVE_AVXVNNI
        if (avxvnni) pkv__attn_fill_q_avxvnni(kt);
#endif
        return PKV_OK;
    }
    const bool amx = !strcmp(want, "avx512-amx");
    if (amx && !have_amx(f)) return PKV_ENOTSUP;
    const bool vnni = amx || !strcmp(want, "avx512-vnni");
    if (vnni && !(f & PKV_CPU_AVX512VNNI)) return PKV_ENOTSUP;
    if (vnni || !strcmp(want, "avx512")) {
        if (!have_avx512(f)) return PKV_ENOTSUP;
        pkv__attn_fill_avx2(kt); /* anything the 512-bit file lacks runs at 256 bits */
        /* quantized-dtype fillers for AVX2 go here */
        pkv__attn_fill_q_avx2(kt);
        pkv__attn_fill_avx512(kt);
        /* quantized-dtype fillers for AVX-512 go here */
        pkv__attn_fill_q_avx512(kt);
        if (!(f & PKV_CPU_AVX512_HALVES)) pkv__attn_fill_q_avx512_wide(kt); /* not on Zen 4 */
        if (vnni) pkv__attn_fill_q_vnni(kt);
        if (vnni && !(f & PKV_CPU_AVX512_HALVES)) pkv__attn_fill_q_vnni_wide(kt); /* not on Zen 4 */
#ifdef PKV_HAVE_AMX
        if (amx) {
            kt->name = "avx512-amx";
            kt->lp_fill = pkv__attn_lp_fill_amx;
            kt->f16_fill = pkv__attn_f16_fill_amx;
        }
#endif
        return PKV_OK;
    }
#elif defined(__aarch64__)
    const bool dot = !strcmp(want, "neon-dotprod");
    if (dot && !(pkv__cpu_features() & PKV_CPU_ASIMDDP)) return PKV_ENOTSUP;
    if (dot || !strcmp(want, "neon")) {
        pkv__attn_fill_neon(kt);
        /* quantized-dtype fillers for NEON go here */
        pkv__attn_fill_q_neon(kt);
        if (dot) pkv__attn_fill_q_dotprod(kt);
        if (pkv__cpu_features() & PKV_CPU_ARM_BF16) kt->lp_fill = pkv__attn_lp_fill_neon_bf16;
        return PKV_OK;
    }
#endif
    return PKV_ENOTSUP;
}

/* PKV_FORCE_REF=1 first, then PKV_ATTN_BACKEND=name (an unknown name, or one this CPU or build
 * lacks, makes creation fail with PKV_ENOTSUP rather than run something else), then detection. */
static const char *auto_backend(const pkv__attn_limits *lim) {
    if (pkv__force_ref()) return "ref";
    const char *named = pkv__env_backend();
    if (named) return named;
#if defined(__x86_64__) || defined(__i386__)
    const uint32_t f = pkv__cpu_features();
    if (lim->amx && have_amx(f)) return "avx512-amx"; /* only then is the tile state asked for */
    if (have_avx512(f)) return f & PKV_CPU_AVX512VNNI ? "avx512-vnni" : "avx512";
    if (have_avxvnni(f)) return "avx2-vnni";
    if (have_avx2(f)) return "avx2";
#elif defined(__aarch64__)
    return pkv__cpu_features() & PKV_CPU_ASIMDDP ? "neon-dotprod" : "neon";
#endif
    return "ref";
}

/* PKV_ATTN_ORDER: unset or empty = auto, "auto", "table", "pool"; anything else is -1. */
static int env_order(void) {
    const char *e = getenv("PKV_ATTN_ORDER");
    if (!e || !*e || !strcmp(e, "auto")) return PKV__ATTN_ORDER_AUTO;
    if (!strcmp(e, "table")) return PKV__ATTN_ORDER_TABLE;
    if (!strcmp(e, "pool")) return PKV__ATTN_ORDER_POOL;
    return -1;
}

/* An override of a CPU rule from the environment: var unset, empty or "auto" = the rule
 * (pkv__cpu_features() has flag), on = 1, off = 0; anything else is -1. */
static int env_rule(const char *var, uint32_t flag, const char *on, const char *off) {
    const char *e = getenv(var);
    if (!e || !*e || !strcmp(e, "auto")) return (pkv__cpu_features() & flag) != 0;
    if (!strcmp(e, on)) return 1;
    if (!strcmp(e, off)) return 0;
    return -1;
}

/* ---- create / destroy ------------------------------------------------------------------------ */

static size_t align64(size_t x) { return pkv__align_up(x, 64); }

/* The transposed path's part of a thread's scratch (thread_scratch): qt, scores, kbuf, vbuf. */
static size_t t_scratch_bytes(uint32_t D, uint32_t s_stride) {
    return align64((size_t)T_QT_ROWS * D * sizeof(float)) +
           align64((size_t)T_S_KEYS(s_stride) * T_ROWS_PAD * sizeof(float)) +
           align64((size_t)PKV__ATTN_T_KEYS * D * sizeof(float)) + align64((size_t)T_V_ROWS * D * sizeof(float));
}

/* A core's L2 in bytes where the C library tells it (glibc: from CPUID on x86, 0 where it does
 * not know, as on many ARM systems), else L2_GUESS_BYTES. */
#define L2_GUESS_BYTES ((size_t)512 * 1024)
static size_t l2_size(void) {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (n > 0) return (size_t)n;
#endif
    return L2_GUESS_BYTES;
}

int pkv__attn_create_backend(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim,
                             const char *backend, pkv__attn **out) {
    return pkv__attn_create_extended(a, n_threads, lim, backend, NULL, out);
}

int pkv__attn_create_extended(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim,
                              const char *backend, void (*extra)(struct pkv__attn_kernels *kt), pkv__attn **out) {
    if (!lim || !out) return PKV_EINVAL;
    if (lim->head_dim == 0 || lim->head_dim > 4096 || lim->block_tokens == 0 || lim->block_tokens > 4096 ||
        lim->n_kv_heads == 0)
        return PKV_EINVAL;
    pkv__attn_kernels kt;
    const char *want = backend ? backend : auto_backend(lim);
    int rc = build_kernels(want, &kt);
    if (rc < 0) {
        pkv__log(lim->log, lim->log_ctx, PKV_LOG_ERROR,
                 "pkv_cache_create: attention backend \"%s\" (PKV_ATTN_BACKEND) is unknown or not supported by "
                 "this CPU or build",
                 want);
        return rc;
    }
    if (extra) extra(&kt);
    const int order = env_order(), wide = env_rule("PKV_ATTN_SWEEP", PKV_CPU_WIDE_SWEEP, "wide", "narrow");
    const int passes = env_rule("PKV_ATTN_PASSES", PKV_CPU_TWO_PASS, "two", "one");
    const int lead_head = env_rule("PKV_ATTN_LEAD", PKV_CPU_LEAD_HEAD, "head", "block");
    const int pieces = env_rule("PKV_ATTN_PIECES", PKV_CPU_PIECES, "on", "off");
    if (order < 0 || wide < 0 || passes < 0 || lead_head < 0 || pieces < 0) {
        const char *bad = order < 0  ? "PKV_ATTN_ORDER (auto, table or pool)"
                          : wide < 0 ? "PKV_ATTN_SWEEP (auto, wide or narrow)"
                          : passes < 0 ? "PKV_ATTN_PASSES (auto, two or one)"
                          : lead_head < 0 ? "PKV_ATTN_LEAD (auto, head or block)"
                                          : "PKV_ATTN_PIECES (auto, on or off)";
        pkv__log(lim->log, lim->log_ctx, PKV_LOG_ERROR, "pkv_cache_create: the environment's %s has another value",
                 bad);
        return PKV_EINVAL;
    }
    if (lim->exec.parallel_for) {
        if (lim->exec.n_workers == 0 || lim->exec.n_workers > PKV_MAX_THREADS) return PKV_EINVAL;
        n_threads = lim->exec.n_workers;
    }
    if (n_threads == 0) n_threads = pkv__n_cpus();
    if (n_threads > PKV_MAX_THREADS) n_threads = PKV_MAX_THREADS;

    const uint32_t D = lim->head_dim;
    const uint32_t s_stride = (lim->block_tokens + 15u) & ~15u;
    const size_t pass_bytes = PKV_MAX(PASS_BYTES, align64((size_t)ROWS_MAX * s_stride * sizeof(float)));
    const size_t thread_bytes = align64((size_t)ROWS_MAX * PKV__ATTN_QROW_BYTES(D)) +
                                align64((size_t)ROWS_MAX * D * sizeof(float)) +
                                2 * align64(ROWS_MAX * sizeof(float)) +
                                align64((size_t)ROWS_MAX * s_stride * sizeof(float)) + pass_bytes +
                                (kt.softmax_t ? t_scratch_bytes(D, s_stride) : 0);
    const uint32_t n_slots = n_threads > 1 ? SLOTS_PER_THREAD * n_threads : 0;
    const size_t slot_floats = (size_t)ROWS_MAX * (D + 2);
    const uint32_t max_items = lim->max_items ? lim->max_items : 1;
    /* the sweep's entries: every block of a group of sequences, within bounds */
    const uint32_t sweep_items = PKV_MIN(max_items, SWEEP_ITEMS);
    uint64_t sweep_cap = lim->max_blocks_per_seq ? (uint64_t)sweep_items * lim->max_blocks_per_seq
                                                 : SWEEP_ENTRIES_UNBOUNDED;
    sweep_cap = PKV_MIN(sweep_cap, SWEEP_ENTRIES_MAX);
    if (n_threads > SWEEP_MAX_THREADS) sweep_cap = 0;
    const uint32_t sweep_chunks_max = sweep_cap ? n_threads : 0; /* one a thread */
    const size_t sweep_slots = sweep_cap ? (size_t)sweep_items * sweep_chunks_max : 0;

    /* one allocation: context | workers | plan | sweep item list | split counters | partials |
     * scratch | sweep keys (two arrays) | sweep queries | sweep slots */
    size_t off_workers = align64(sizeof(pkv__attn));
    size_t off_plan = off_workers + align64(sizeof(pkv__tpool_worker) * n_threads);
    size_t off_idx = off_plan + align64(sizeof(plan_item) * (size_t)max_items);
    size_t off_done = off_idx + (sweep_cap ? align64(sizeof(uint32_t) * (size_t)max_items) : 0);
    size_t off_part = off_done + align64(sizeof(_Atomic uint32_t) * (n_slots + 1));
    size_t off_scr = off_part + align64(slot_floats * sizeof(float) * n_slots);
    size_t off_keys = off_scr + thread_bytes * n_threads;
    size_t off_sq = off_keys + 2 * align64(sizeof(uint64_t) * sweep_cap);
    size_t off_sslot = off_sq + (sweep_cap ? (size_t)sweep_items * ROWS_MAX * PKV__ATTN_QROW_BYTES(D) : 0);
    size_t total = off_sslot + slot_floats * sizeof(float) * sweep_slots;

    uint8_t *mem = pkv__alloc(a, total, 64);
    if (!mem) return PKV_ENOMEM;
    pkv__attn *at = (pkv__attn *)mem;
    memset(at, 0, sizeof *at);
    atomic_init(&at->items_pool, 0);
    atomic_init(&at->items_table, 0);
    for (uint32_t i = 0; i < SWEEP_ITEMS; i++) atomic_init(&at->sweep_qstate[i], 0), atomic_init(&at->sweep_done[i], 0);
    if (a) at->a = *a;
    at->alloc_bytes = total;
    at->kt_tab[0] = at->kt_tab[1] = kt;
    if (kt.lp_fill) kt.lp_fill(&at->kt_tab[1]);
    at->kt_tab[2] = at->kt_tab[0], at->kt_tab[3] = at->kt_tab[1];
    if (kt.f16_fill) kt.f16_fill(&at->kt_tab[2]), kt.f16_fill(&at->kt_tab[3]);
    at->kt = &at->kt_tab[0];
    at->lim = *lim;
    at->lim.max_items = max_items;
    at->n_threads = n_threads;
    at->inline_elems = INLINE_WORK_ELEMS;
    at->workers = (pkv__tpool_worker *)(mem + off_workers);
    at->plan = (plan_item *)(mem + off_plan);
    at->split_done = (_Atomic uint32_t *)(mem + off_done);
    for (uint32_t i = 0; i < n_slots + 1; i++) atomic_init(&at->split_done[i], 0);
    at->partials = (float *)(mem + off_part);
    at->slot_floats = slot_floats;
    at->n_slots = n_slots;
    at->scratch = mem + off_scr;
    at->thread_bytes = thread_bytes;
    at->s_stride = s_stride;
    at->order = order;
    at->sweep_cap = (uint32_t)sweep_cap;
    at->sweep_chunks_max = sweep_chunks_max;
    at->sweep_items_cap = sweep_items;
    at->sweep_keys = (uint64_t *)(mem + off_keys);
    at->sweep_tmp = at->sweep_keys + align64(sizeof(uint64_t) * sweep_cap) / sizeof(uint64_t);
    at->sweep_q = mem + off_sq;
    at->sweep_slots = (float *)(mem + off_sslot);
    at->sweep_idx = (uint32_t *)(mem + off_idx);
    at->l2_bytes = l2_size();
    at->sweep_items_min = pkv__cpu_features() & PKV_CPU_VICTIM_L3 ? SWEEP_CHUNK_ITEMS_MIN_VICTIM
                                                                  : SWEEP_CHUNK_ITEMS_MIN;
    at->pf_l1 = at->pf_fine = at->pf_two = (pkv__cpu_features() & PKV_CPU_PREFETCH_L1) != 0;
    at->pf_head = lead_head;
    at->piece_bytes = pieces ? PKV_ATTN_PIECE_BYTES : 0;
    at->sweep_wide = wide;
    at->tpath = true;
    at->two_pass = passes;
    at->pass_blocks = PASS_BLOCKS_MAX;
    at->pass_bytes = pass_bytes;
    rc = pkv__tpool_init(&at->pool, n_threads, at->workers, &lim->exec, lim->spin_us);
    if (rc < 0) {
        pkv__free(&at->a, mem, total);
        return rc;
    }
    *out = at;
    return PKV_OK;
}

int pkv__attn_create(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim, pkv__attn **out) {
    return pkv__attn_create_backend(a, n_threads, lim, NULL, out);
}

void pkv__attn_destroy(pkv__attn *at) {
    if (!at) return;
    pkv__tpool_fini(&at->pool);
    pkv_allocator a = at->a;
    pkv__free(&a, at, at->alloc_bytes);
}

bool pkv__attn_lp(const pkv__attn *at, pkv_dtype k_dtype) {
    return at && (unsigned)k_dtype < PKV_DTYPE_COUNT && at->kt_tab[1].score[k_dtype] != at->kt_tab[0].score[k_dtype];
}

bool pkv__attn_lp_v(const pkv__attn *at, pkv_dtype v_dtype) {
    return at && (unsigned)v_dtype < PKV_DTYPE_COUNT && at->kt_tab[1].accum[v_dtype] != at->kt_tab[0].accum[v_dtype];
}

bool pkv__attn_lp_t(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype) {
    return at && (unsigned)k_dtype < PKV_DTYPE_COUNT && (unsigned)v_dtype < PKV_DTYPE_COUNT &&
           (at->kt_tab[1].score_t[k_dtype] != at->kt_tab[0].score_t[k_dtype] ||
            at->kt_tab[1].accum_t[v_dtype] != at->kt_tab[0].accum_t[v_dtype]);
}

/* Whether table kt_tab[tab]'s transposed primitives differ from table kt_tab[base]'s for this K
 * and V at these dims */
static bool t_differs(const pkv__attn *at, unsigned tab, unsigned base, pkv_dtype k_dtype, pkv_dtype v_dtype,
                      uint32_t head_dim, uint32_t v_dim) {
    if (!at || (unsigned)k_dtype >= PKV_DTYPE_COUNT || (unsigned)v_dtype >= PKV_DTYPE_COUNT) return false;
    const pkv__attn_kernels *f = &at->kt_tab[tab], *o = &at->kt_tab[base];
    /* the transposed path runs a pair with both primitives (f16 K beside a q8_0 V only in tables
       with AMX's PKV_ATTN_BF16_DOT kernels); the tiles take head_dim (K) or v_dim (V) in groups
       of 32, the f32 kernels the rest; bf16's rest goes to the vdpbf16ps kernels, which round
       alike (attn_amx.c: score_t_amx, accum_fallback), so bf16 differs at every head_dim */
    return f->score_t[k_dtype] && f->accum_t[v_dtype] &&
           ((f->score_t[k_dtype] != o->score_t[k_dtype] && (head_dim % 32 == 0 || k_dtype == PKV_DTYPE_BF16)) ||
            (f->accum_t[v_dtype] != o->accum_t[v_dtype] && (v_dim % 32 == 0 || v_dtype == PKV_DTYPE_BF16)));
}

bool pkv__attn_f16bf(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype, uint32_t head_dim, uint32_t v_dim) {
    /* alone (table 2 against 0), or beside PKV_ATTN_BF16_DOT (3 against 1) */
    return t_differs(at, 2, 0, k_dtype, v_dtype, head_dim, v_dim) || t_differs(at, 3, 1, k_dtype, v_dtype, head_dim, v_dim);
}

bool pkv__attn_lp_tiles(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype, uint32_t head_dim, uint32_t v_dim) {
    return t_differs(at, 1, 0, k_dtype, v_dtype, head_dim, v_dim);
}

bool pkv__attn_has_t(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype) {
    return at && (unsigned)k_dtype < PKV_DTYPE_COUNT && (unsigned)v_dtype < PKV_DTYPE_COUNT &&
           at->kt_tab[0].score_t[k_dtype] && at->kt_tab[0].accum_t[v_dtype];
}

const char *pkv__attn_backend_name(const pkv__attn *at) { return at ? at->kt->name : "none"; }
uint32_t pkv__attn_n_threads(const pkv__attn *at) { return at ? at->n_threads : 0; }

/* Whether a job of work_elems K/V elements goes to the thread pool (else the caller runs it alone). */
static inline bool goes_parallel(const pkv__attn *at, uint64_t work_elems) { return work_elems >= at->inline_elems; }

int pkv__attn_parallel(pkv__attn *at, void (*fn)(void *ctx, uint32_t task, uint32_t tid), void *ctx, uint32_t n_tasks,
                       uint64_t work_elems) {
    if (goes_parallel(at, work_elems)) return pkv__tpool_run(&at->pool, fn, ctx, n_tasks); /* inline itself for 1 */
    for (uint32_t i = 0; i < n_tasks; i++) fn(ctx, i, 0);
    return PKV_OK;
}

/* ---- one work unit --------------------------------------------------------------------------- */

typedef struct unit {
    const pkv__attn_item *item;
    const plan_item *pi;
    uint32_t kvh0, n_kvh; /* kv heads [kvh0, kvh0 + n_kvh) */
    uint32_t g0, gs;      /* query heads g0 .. g0 + gs - 1 of each kv head's group */
    uint32_t qa, nq;      /* queries [qa, qa + nq) of the item */
    uint32_t ks;          /* key split index */
    uint32_t grp;         /* (group, tile) index within the item, for split slots */
} unit;

static void decode_unit(const pkv__attn *at, uint32_t u, unit *w) {
    /* binary search: last item with unit0 <= u */
    uint32_t lo = 0, hi = at->n_items;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (at->plan[mid].unit0 <= u) lo = mid;
        else hi = mid;
    }
    const plan_item *pi = &at->plan[lo];
    uint32_t r = u - pi->unit0;
    w->item = &at->items[lo];
    w->pi = pi;
    w->ks = r % pi->n_ks;
    r /= pi->n_ks;
    w->grp = r;
    /* later query tiles see more keys: hand them out first for balance */
    uint32_t qt = pi->n_qt - 1 - r % pi->n_qt;
    uint32_t hg = r / pi->n_qt;
    w->qa = qt * pi->qtile;
    w->nq = PKV_MIN(pi->qtile, w->item->n_q - w->qa);
    if (pi->n_gsub > 1) {
        w->kvh0 = hg / pi->n_gsub;
        w->n_kvh = 1;
        w->g0 = (hg % pi->n_gsub) * pi->gsub;
        w->gs = PKV_MIN(pi->gsub, at->G - w->g0);
    } else {
        w->kvh0 = hg * pi->heads_per;
        w->n_kvh = PKV_MIN(pi->heads_per, at->kv->n_kv_heads - w->kvh0);
        w->g0 = 0;
        w->gs = at->G;
    }
}

/* The last key a query at pos of item it sees (the item's k_end hides the keys from it on). */
static inline uint32_t item_key_hi(const pkv__attn_item *it, uint32_t pos) {
    return it->k_end && it->k_end - 1 < pos ? it->k_end - 1 : pos;
}

/* Items of one query the pool-order sweep may take (its decodes). */
static inline bool sweepable(const pkv__attn_item *it) {
    return it->n_q == 1 && !it->k_end;
}

/* The first key a query at pos of item it sees under the call's window and chunks: none hides a
 * key of a partial item (a shared-prefix part, whose nominal positions, P - 1 on, one a member,
 * are not its queries': neither hides any of [0, P) from a member, the cache groups no other; the
 * tree's prefix part, likewise for its nodes). */
static inline uint32_t key_lo(const pkv__attn_call *call, const pkv__attn_item *it, uint32_t pos) {
    return it->partial ? 0 : pkv__attn_key_lo(call, pos);
}

/* The first key a query at pos of item it sees: key_lo's, or the item's k_start (a block
 * boundary: the blocks before it are not read, so no mask needs it). */
static inline uint32_t item_key_lo(const pkv__attn_call *call, const pkv__attn_item *it, uint32_t pos) {
    return PKV_MAX(key_lo(call, it, pos), it->k_start);
}

/* Software prefetch of the next block's rows of one head while this block's head is computed
 * (pkv__attn_pf), PKV_ATTN_PF_DIST blocks ahead. Each (block, head) is one 4 KiB run for f16
 * at head_dim 128, B 16: the hardware prefetcher restarts at every such run, software does not.
 * Into L2 (T1), or into L1 (T0) where PKV_CPU_PREFETCH_L1 says (pf_l1). T0 made decode 1.43x as
 * slow on Zen 4 (f32) and 1.19x on Intel (stop 32). On Zen 5 it made it 8-12% faster at 1 thread
 * and 1% at 2, and q8_0 1.78x as fast at 1 thread; there, no software prefetch at all made decode
 * 2-2.7x as slow, and 2 blocks ahead instead of 1 gained nothing (stop 35). Zen 5 also takes
 * finer shares in a decode head's score (pf_fine: attn.h, PKV__ATTN_DEF_SCORE_ROWS4), and the row
 * path prefetches at two levels there (pf_two: attn.h, pkv__attn_pf.near): a block ahead is 64
 * KiB of K/V at f16 (8 heads), more than the L1, so a line the T0 prefetch brought in is gone
 * again when its head starts; with the next block into L2 and the next head (8 KiB on) into L1,
 * f16 4096 x 16 paged took 0.977 of the time at 2 threads and 0.960 at 1, f32 0.939 at 1
 * (scripts/ab-decode.sh both ways round), and 1.05 on K/V in cache (stop 39). Since stop 40 the
 * row path there leads by about 16 KiB of K/V (pf_ahead: 2 heads at f16 and bf16, 1 at f32, at
 * head_dim 128 and B 16) rather than a block (64-128 KiB): a block ahead kept more lines in
 * flight than the core serves, and a lead in bytes was the best at both widths (the leads
 * measured: pf_ahead). Against the block lead, both ways round: f16 paged 0.963 at 1 thread and
 * 0.990 at 2, f32 0.907 at 1 and 0.997 at 2, bf16 0.969 at 1 and 0.996 at 2, f16 in cache
 * 1.01. The transposed path (prefill, compute-bound, its K/V often just written) keeps one
 * level, a block ahead: 2% slower with two (stop 39). On Intel (PKV_CPU_LEAD_HEAD, stop 52) the
 * row path leads by one head into L2 (pf_head): f16 4096 x 16 contiguous 0.84 of the block
 * lead's time at 2 threads, 32768 x 1 0.85 (contiguous) and 0.83-0.85 (paged, 1 and 2 threads),
 * 4096 x 16 paged 0.93-0.94, bf16 0.87 and 0.95, f32 and the quantized types 0.99-1.00; two
 * and four heads ahead measured the same as the block lead (ab-decode). Where K and V are both
 * quantized (q8_0, q4_0, fp8: a head's block of rows 2-4 KiB), that one-head lead goes into L1
 * (pf_l1_call): once the VNNI score read 16 keys transposed (stop 75), a q8_0 head's block took
 * about 280 ns, and T0 took 0.964 of T1's time at q8_0 4096 x 16 paged (2 threads), 0.944 at 1,
 * 0.964 at 32768 x 1 contiguous, 0.964 in cache (256 x 2), q4_0 0.954 and 0.960 (32768 x 1),
 * fp8 0.980 (ab-decode, HEAD against the change); f16 with T0 measured 1.05-1.11 of T1's time
 * in the bench the same day (0.97-0.98 at 32768 x 16 only), so 16-bit and f32 K/V keep T1. */
#ifndef PKV_ATTN_PF_DIST
#define PKV_ATTN_PF_DIST 1
#endif

/* Merges n_ks partial softmax states of w's rows by log-sum-exp and writes w's outputs (and
 * log-sum-exps) in one pass. State k is m0 [ROWS_MAX], l0 [ROWS_MAX], acc0 [ROWS_MAX][head_dim]
 * (in w's row order) at k * stride floats further (slots of a key split or of a sweep's chunks;
 * n_ks 1 and stride 0 for a unit's own state; head_dim: v_dim). Each output row is the states' acc rows weighted
 * exp(m_k - m) / l, with m their max and l the weighted sum of their l_k. A state with l = 0
 * saw nothing (its acc may be stale): it weighs 0, and a row no state saw is written as zeros
 * (log-sum-exp -inf). Acc in even-odd order is combined in state 0's row and unshuffled from
 * there. The states' m become their weights. (As a merge into slot 0 followed by a separate
 * write of the output, with the swept items merged by the last chunk, the merges took 5% of
 * f16 decode of 512 x 2 at 2 threads, stop 31.) */
static void merge_write(const pkv__attn *at, const unit *w, float *m0, const float *l0, float *acc0, size_t stride,
                        uint32_t n_ks) {
    const uint32_t D = at->kv->v_dim, nqh = at->call->n_q_heads, G = at->G;
    const uint32_t rows_h = w->nq * w->gs;
    const bool eo = at->kt->acc_eo[at->kv->v_dtype]; /* acc in even-odd order (attn.h) */
    const float *sinks = w->item->partial ? NULL : at->call->sinks;
    for (uint32_t j = 0; j < w->n_kvh; j++)
        for (uint32_t qi = 0; qi < w->nq; qi++)
            for (uint32_t g = 0; g < w->gs; g++) {
                const uint32_t r = j * rows_h + qi * w->gs + g;
                const size_t o = (size_t)(w->qa + qi) * nqh + (size_t)(w->kvh0 + j) * G + w->g0 + g;
                float *dst = w->item->out + o * D;
                float mx = -INFINITY, lsum = 0.0f;
                for (uint32_t k = 0; k < n_ks; k++)
                    if (l0[k * stride + r] > 0.0f) mx = PKV_MAX(mx, m0[k * stride + r]);
                if (mx != -INFINITY)
                    for (uint32_t k = 0; k < n_ks; k++) {
                        const float lk = l0[k * stride + r];
                        if (!(lk > 0.0f)) continue;
                        const float mk = m0[k * stride + r];
                        m0[k * stride + r] = mk == mx ? 1.0f : expf(mk - mx); /* exp(0) exactly */
                        lsum += lk * m0[k * stride + r];
                    }
                const bool seen = lsum > 0.0f;
                if (sinks) { /* one more key, of logit sinks[h] and value 0: in the sum, not in acc */
                    const float sv = sinks[(w->kvh0 + j) * G + w->g0 + g];
                    if (sv > mx) { /* the sink leads: every state's weight shrinks by e^(mx - sv) */
                        const float f = seen ? expf(mx - sv) : 0.0f;
                        for (uint32_t k = 0; k < n_ks; k++)
                            if (l0[k * stride + r] > 0.0f) m0[k * stride + r] *= f;
                        lsum = lsum * f + 1.0f;
                        mx = sv;
                    } else
                        lsum += expf(sv - mx);
                }
                if (w->item->lse) w->item->lse[o] = lsum > 0.0f ? mx + logf(lsum) : -INFINITY;
                if (!seen) { /* no key visible: the sink alone (lse sinks[h]) or nothing */
                    for (uint32_t d = 0; d < D; d++) dst[d] = 0.0f;
                    continue;
                }
                const float inv = 1.0f / lsum;
                float *sum = eo ? acc0 + (size_t)r * D : dst;
                bool first = true;
                for (uint32_t k = 0; k < n_ks; k++) {
                    if (!(l0[k * stride + r] > 0.0f)) continue;
                    const float f = eo ? m0[k * stride + r] : m0[k * stride + r] * inv;
                    const float *ak = acc0 + k * stride + (size_t)r * D;
                    if (first)
                        for (uint32_t d = 0; d < D; d++) sum[d] = ak[d] * f;
                    else
                        for (uint32_t d = 0; d < D; d++) sum[d] += ak[d] * f;
                    first = false;
                }
                if (eo) pkv__attn_unshuffle_eo(dst, sum, D, inv);
            }
}

/* Thread tid's scratch (thread_bytes): prepared q [ROWS_MAX][QROW], acc [ROWS_MAX][head_dim],
 * m, l [ROWS_MAX], scores [ROWS_MAX][s_stride]. */
typedef struct scratch {
    uint8_t *qp;
    float *acc, *m, *l, *s;
    float *sw; /* the two passes' score window (pass_bytes) */
    float *qt, *st, *kbuf, *vbuf; /* the transposed path's (NULL where the backend has none) */
} scratch;

static scratch thread_scratch(const pkv__attn *at, uint32_t tid) {
    const uint32_t D = at->kv->head_dim;
    uint8_t *p = at->scratch + (size_t)tid * at->thread_bytes;
    scratch sc;
    sc.qp = p;
    p += align64((size_t)ROWS_MAX * PKV__ATTN_QROW_BYTES(D));
    sc.acc = (float *)p;
    p += align64((size_t)ROWS_MAX * D * sizeof(float));
    sc.m = (float *)p;
    p += align64(ROWS_MAX * sizeof(float));
    sc.l = (float *)p;
    p += align64(ROWS_MAX * sizeof(float));
    sc.s = (float *)p;
    p += align64((size_t)ROWS_MAX * at->s_stride * sizeof(float));
    sc.sw = (float *)p;
    p += at->pass_bytes;
    sc.qt = sc.st = sc.kbuf = sc.vbuf = NULL;
    if (at->kt->softmax_t) {
        sc.qt = (float *)p;
        p += align64((size_t)T_QT_ROWS * D * sizeof(float));
        sc.st = (float *)p;
        p += align64((size_t)T_S_KEYS(at->s_stride) * T_ROWS_PAD * sizeof(float));
        sc.kbuf = (float *)p;
        p += align64((size_t)PKV__ATTN_T_KEYS * D * sizeof(float));
        sc.vbuf = (float *)p;
    }
    return sc;
}

/* How many heads ahead the row path prefetches where it leads by bytes (head_io_fill caps it at
 * the walk's heads: the same head of the next block): about PKV_ATTN_PF_LEAD bytes of K and V
 * runs (run the bytes of one head's, a block's rows of K and V), at least one head, or two where
 * K is not f32 (wide: f32). f16 at 16-token blocks (8 KiB runs), time against the block lead: 2
 * heads 0.960, 3 0.983, 4 0.993, 1 1.067 (paged). One head ahead, the run goes into L1 alone:
 * best for f32 (16 KiB runs at 16-token blocks: 0.866 of the block lead's time, two heads 0.952;
 * 32 KiB runs at 32-token blocks: 0.920, two heads 0.964), not for f16 at 32-token blocks (16 KiB
 * runs: one head 1.046, 1.064 and 1.135 of the block lead's time, two heads 0.999, 1.001 and
 * 1.031; two against one directly 0.973 over three noisy runs; 1 thread, 4096 x 16, contiguous
 * but where paged is said, stop 40). */
#ifndef PKV_ATTN_PF_LEAD
#define PKV_ATTN_PF_LEAD ((size_t)16 * 1024)
#endif
/* q8_0, q4_0, fp8: a head's block of K and V rows is 2-4 KiB at head_dim 128 and 16-token blocks */
static bool dtype_quantized(pkv_dtype dt) {
    return dt == PKV_DTYPE_Q8_0 || dt == PKV_DTYPE_Q4_0 || dt == PKV_DTYPE_FP8_E4M3;
}

/* How many runs of run bytes make lead bytes, rounded up: at least least, at most most. */
static uint32_t lead_runs(size_t lead, size_t run, size_t least, size_t most) {
    return (uint32_t)PKV_MIN(PKV_MAX((lead + run - 1) / run, least), most);
}
static uint32_t pf_ahead(size_t run, bool wide) { return lead_runs(PKV_ATTN_PF_LEAD, run, wide ? 1 : 2, UINT32_MAX); }

/* What score and accum read for kv head h of block bid from key t0 (kr, vr), and what they
 * prefetch meanwhile: the K and V runs head_io_fill picks (by default the same head's of the
 * next block; pkp, pvp NULL: none). score takes the K run and accum the V run (run 1 empty), or
 * score both where the backend's accum does not prefetch. pkp and pvp point into the struct:
 * fill it in place. */
typedef struct head_io {
    const uint8_t *kr, *vr;
    pkv__attn_pf pk, pv, *pkp, *pvp;
} head_io;

/* Head h of block bid, with the next block's K and V at kn, vn (NULL: nothing to prefetch past
 * this block). The caller walks heads [h0, h1) of each block. By default the prefetch is the same
 * head of the next block. Where the call leads by bytes (pf_lead, set in pkv__attn_run where
 * pf_two and pf_l1 are; the row path only: two is false for the transposed one), it is the run
 * `ahead` heads on in that walk instead, with the NTA hint where that is more than one head on
 * (attn.h, pkv__attn_pf.near), with the next head's runs into L1 as well; one head on, it is that
 * head's runs into L1 alone.
 * xr, xn: NULL, or xn more bytes at xr for score to prefetch as well (run_chunk: the next
 * sequence's queries), spread over its steps as the second run of its pf where that run is
 * free; else the caller is told (false) and prefetches them itself. */
static inline bool head_io_fill(const pkv__attn *at, size_t bid, uint32_t h, uint32_t h0, uint32_t h1, bool two,
                                uint32_t t0, const uint8_t *kn, const uint8_t *vn, const uint8_t *xr, size_t xn,
                                head_io *io) {
    const pkv__kv_view *kv = at->kv;
    const uint32_t B = kv->block_tokens;
    const uint8_t *kb = kv->k + bid * kv->k_block_bytes, *vb = kv->v + bid * kv->v_block_bytes;
    io->kr = kb + ((size_t)h * B + t0) * kv->k_row_bytes;
    io->vr = vb + ((size_t)h * B + t0) * kv->v_row_bytes;
    io->pkp = io->pvp = NULL;
    const size_t kblk = (size_t)B * kv->k_row_bytes, vblk = (size_t)B * kv->v_row_bytes;
    const bool lead = two && at->pf_lead;
    const uint32_t n = h1 - h0, ahead = lead ? PKV_MIN(at->pf_lead, n) : n;
    /* the far run: head h + ahead of the walk, in this block or the next */
    const uint32_t hf = h - h0 + ahead;
    if (hf >= n && !kn) return !xr;
    const size_t hx = h0 + (hf < n ? hf : hf - n); /* hf < 2 n */
    const uint8_t *kx = (hf < n ? kb : kn) + hx * kblk, *vx = (hf < n ? vb : vn) + hx * vblk;
    const bool accum_pf = at->kt->accum_pf[kv->v_dtype];
    /* score's second run: the V run where accum does not prefetch it, else xr (or empty) */
    const uint8_t *r1 = accum_pf ? (xr ? xr : kx) : vx, *e1 = accum_pf ? (xr ? xr + xn : kx) : vx + vblk;
    io->pk = (pkv__attn_pf){.p = {kx, r1}, .end = {kx + kblk, e1}, .l1 = at->pf_l1_call, .fine = at->pf_fine};
    io->pv = (pkv__attn_pf){.p = {vx, vx}, .end = {vx + vblk, vx}, .l1 = at->pf_l1_call};
    if (lead && ahead > 1) { /* the far run (NTA), the next head's into L1: this block's h + 1, or the next's h0 */
        const bool here = h + 1 < h1;
        if (here || kn) {
            const uint8_t *kh = (here ? kb : kn) + (size_t)(here ? h + 1 : h0) * kblk;
            const uint8_t *vh = (here ? vb : vn) + (size_t)(here ? h + 1 : h0) * vblk;
            io->pk.near = kh - kx, io->pv.near = vh - vx;
        }
    }
    io->pkp = &io->pk, io->pvp = accum_pf ? &io->pv : NULL;
    return !xr || accum_pf;
}

/* Pipelined heads (run_unit, run_chunk): a block's kv heads run as score j, accum j - 1,
 * softmax j (the last head's accum after the loop), so that softmax's chain of dependent steps
 * (max, exp, sum) has the next head's score behind it rather than its own accum, and the
 * score's reduction tail the previous head's accum. With one head that is the plain order.
 * Head j's scores take half j % 2 of the scratch's rows (rows_h rows a head: two heads fit,
 * 2 * rows_h <= ROWS_MAX, wherever there are two) and its head_io is io[j % 2] (filled in
 * place: its prefetch pointers point into it). */
static inline float *score_half(const pkv__attn *at, float *s, uint32_t rows_h, uint32_t j) {
    return s + (size_t)(j & 1u) * rows_h * at->s_stride;
}

/* Head j's accum: its scores' half, its V run, its acc rows at acc + j * rows_h. */
static inline void accum_head(const pkv__attn *at, pkv__attn_accum_fn accum, float *s, uint32_t rows_h, uint32_t j,
                              uint32_t n_keys, const head_io *io, float *acc) {
    const pkv__kv_view *kv = at->kv;
    accum(score_half(at, s, rows_h, j), at->s_stride, rows_h, io[j & 1u].vr, kv->v_row_bytes, n_keys, kv->v_dim,
          acc + (size_t)j * rows_h * kv->v_dim, io[j & 1u].pvp);
}

/* ---- pieces: a head's run a piece at a time (PKV_CPU_PIECES) ----------------------------------
 * Where piece_keys is set, the one-pass row path takes heads [h0, h1) of a block in pieces of
 * piece_keys keys, the visible keys [t0, t0 + n_keys) of head h0 first, piece after piece, then
 * head h0 + 1's: score, softmax and accum a piece, pipelined as whole heads are (score j, accum
 * j - 1, softmax j), and each piece prefetches the next piece of the walk (the next of this run,
 * else the next head's first, else the next block's head h0 from key 0) into L2, or L1 where pf_l1
 * is set. Each piece is one more online-softmax step, so the results differ from whole runs by
 * float rounding only. On the Intel Xeon of stop 53 the K and V streams of a decode read fastest
 * with 4 KiB of each between switches and a lead of one such piece: 16-token f16 blocks have
 * exactly that (4 KiB runs at head_dim 128), and longer runs read 13-15% slower whole. */

/* The keys a piece holds for this call: piece_bytes of K, a multiple of 4 keys, at least 4; 0
 * (whole runs) where pieces are off, the K or V dtype is not 16-bit, the V accum does not
 * prefetch, or a run fits one piece. The prefetch flags (pf_l1 and the rest) do not change it, so
 * they do not change a result. */
static uint32_t piece_call(const pkv__attn *at, const pkv__kv_view *kv) {
    const bool k16 = kv->k_dtype == PKV_DTYPE_F16 || kv->k_dtype == PKV_DTYPE_BF16;
    const bool v16 = kv->v_dtype == PKV_DTYPE_F16 || kv->v_dtype == PKV_DTYPE_BF16;
    if (!at->piece_bytes || !k16 || !v16 || !at->kt->accum_pf[kv->v_dtype]) return 0;
    const uint32_t pk = PKV_MAX((uint32_t)(at->piece_bytes / kv->k_row_bytes) & ~3u, 4u);
    return pk < kv->block_tokens ? pk : 0;
}

/* Piece (h, o) of a block: keys [o, o + n) of head h's run from key t0 (o relative to t0); what
 * it prefetches: the next piece of the walk (pieces above), nothing past the unit's last block
 * (kn NULL). */
static inline void piece_io_fill(const pkv__attn *at, size_t bid, uint32_t h, uint32_t h1, uint32_t h0, uint32_t t0,
                                 uint32_t o, uint32_t n, uint32_t n_keys, const uint8_t *kn, const uint8_t *vn,
                                 head_io *io) {
    const pkv__kv_view *kv = at->kv;
    const uint32_t B = kv->block_tokens, pk = at->piece_keys;
    const size_t krb = kv->k_row_bytes, vrb = kv->v_row_bytes;
    const uint8_t *kb = kv->k + bid * kv->k_block_bytes, *vb = kv->v + bid * kv->v_block_bytes;
    io->kr = kb + ((size_t)h * B + t0 + o) * krb;
    io->vr = vb + ((size_t)h * B + t0 + o) * vrb;
    const uint8_t *kx, *vx;
    uint32_t nx;
    if (o + n < n_keys) /* the rest of this run */
        kx = io->kr + n * krb, vx = io->vr + n * vrb, nx = PKV_MIN(pk, n_keys - o - n);
    else if (h + 1 < h1) /* the next head's first piece */
        kx = kb + ((size_t)(h + 1) * B + t0) * krb, vx = vb + ((size_t)(h + 1) * B + t0) * vrb, nx = PKV_MIN(pk, n_keys);
    else if (kn) /* the next block's head h0 */
        kx = kn + (size_t)h0 * B * krb, vx = vn + (size_t)h0 * B * vrb, nx = pk;
    else {
        io->pkp = io->pvp = NULL;
        return;
    }
    io->pk = (pkv__attn_pf){.p = {kx, kx}, .end = {kx + nx * krb, kx}, .l1 = at->pf_l1_call, .fine = at->pf_fine};
    io->pv = (pkv__attn_pf){.p = {vx, vx}, .end = {vx + nx * vrb, vx}, .l1 = at->pf_l1_call};
    io->pkp = &io->pk, io->pvp = &io->pv;
}

/* Whether a block of n_keys visible keys goes in pieces: the call takes pieces, there is more than
 * one, and two pieces' scores of rows_h rows fit the scratch (score_half). */
static inline bool piece_take(const pkv__attn *at, uint32_t n_keys, uint32_t rows_h) {
    return at->piece_keys && n_keys > at->piece_keys && 2 * rows_h <= ROWS_MAX;
}

static void mask_block(const pkv__attn *at, const unit *w, uint32_t pos_first, uint32_t kp0, uint32_t n_keys,
                       float *s, size_t rs, size_t ts);
/* (apart: the hot loops that call it keep the shape they had without ALiBi) */
__attribute__((noinline)) static void bias_block(const pkv__attn *at, uint32_t hq0, uint32_t nq, uint32_t gs,
                                                 uint32_t pos_first, uint32_t kp0, uint32_t n_keys, float *s,
                                                 size_t rs, size_t ts);

/* The soft-cap the softmax steps take: the call's, or 0 where ALiBi's pass (bias_block) caps first. */
static inline float sm_cap(const pkv__attn *at) { return at->call->alibi ? 0.0f : at->call->softcap; }

/* The real position of a unit's first query, its first at pos_first (ALiBi's: an item of a custom
 * mask has its queries at nominal positions, and its real ones from mask_pos0). A sweep entry's
 * unit has no item (its query's position is real). */
static inline uint32_t bias_first(const unit *w, uint32_t pos_first) {
    return w->item && w->item->mask ? w->item->mask_pos0 + w->qa : pos_first;
}

/* A unit's rows of kv head kvh (of a block's keys from kp0): ALiBi's bias where the call has it. */
static inline void unit_bias(const pkv__attn *at, const unit *w, uint32_t kvh, uint32_t pos_first, uint32_t kp0,
                             uint32_t n_keys, float *s, size_t rs, size_t ts) {
    if (PKV_UNLIKELY(at->call->alibi != NULL))
        bias_block(at, kvh * at->G + w->g0, w->nq, w->gs, bias_first(w, pos_first), kp0, n_keys, s, rs, ts);
}

/* What block_pieces does to a piece's scores: the masks where mask is set (run_unit: causal or
 * window keys), ALiBi's bias where the call has it; NULL: neither. */
typedef struct piece_mask {
    const unit *w;
    uint32_t pos_first, kp0; /* the first query's position; the position of key t0 */
    bool mask;               /* whether the keys need masks (else ALiBi's bias alone) */
} piece_mask;

/* Piece i's accum (accum_head's for pieces): its scores' half, its V run, len[i % 2] keys, the acc
 * rows of its head (np pieces a head). */
static inline void accum_piece(const pkv__attn *at, pkv__attn_accum_fn accum, float *s, uint32_t rows_h, uint32_t i,
                               uint32_t np, const uint32_t *len, const head_io *io, float *acc) {
    const pkv__kv_view *kv = at->kv;
    accum(score_half(at, s, rows_h, i), at->s_stride, rows_h, io[i & 1u].vr, kv->v_row_bytes, len[i & 1u],
          kv->v_dim, acc + (size_t)(i / np) * rows_h * kv->v_dim, io[i & 1u].pvp);
}

/* Heads [h0, h1) of block bid, keys [t0, t0 + n_keys), in pieces (above); qp, m, l, acc: the rows
 * of head h0 first, rows_h a head (piece_take); s: the scratch of two pieces' scores. xq: where
 * set, the next sequence's queries of a head, xn bytes a head (run_chunk), prefetched into L2 at
 * each head's first piece. */
static void block_pieces(const pkv__attn *at, size_t bid, uint32_t h0, uint32_t h1, uint32_t t0, uint32_t n_keys,
                         const uint8_t *kn, const uint8_t *vn, const uint8_t *qp, uint32_t rows_h, float *s,
                         float *m, float *l, float *acc, const piece_mask *pm, const uint8_t *xq, size_t xn) {
    const pkv__kv_view *kv = at->kv;
    const pkv__attn_kernels *kt = at->kt;
    const pkv__attn_score_fn score = kt->score[kv->k_dtype];
    const pkv__attn_accum_fn accum = kt->accum[kv->v_dtype];
    const uint32_t D = kv->head_dim, Dv = kv->v_dim, pk = at->piece_keys, np = (n_keys + pk - 1) / pk;
    const uint32_t n = (h1 - h0) * np;
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    head_io io2[2];
    uint32_t len[2]; /* piece j's keys, by j % 2 */
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t hj = j / np, o = j % np * pk, nj = PKV_MIN(pk, n_keys - o), r0 = hj * rows_h;
        float *sj = score_half(at, s, rows_h, j);
        head_io *io = &io2[j & 1u];
        piece_io_fill(at, bid, h0 + hj, h1, h0, t0, o, nj, n_keys, kn, vn, io);
        if (xq && o == 0)
            for (size_t b = 0; b < xn; b += 64) __builtin_prefetch(xq + hj * xn + b, 0, 2);
        score(qp + (size_t)r0 * qrow, rows_h, io->kr, kv->k_row_bytes, nj, D, sj, at->s_stride, io->pkp);
        if (pm && pm->mask) mask_block(at, pm->w, pm->pos_first, pm->kp0 + o, nj, sj, at->s_stride, 1);
        if (pm) unit_bias(at, pm->w, h0 + hj, pm->pos_first, pm->kp0 + o, nj, sj, at->s_stride, 1);
        if (j > 0) accum_piece(at, accum, s, rows_h, j - 1, np, len, io2, acc);
        len[j & 1u] = nj;
        kt->softmax(sj, at->s_stride, rows_h, nj, sm_cap(at), m + r0, l + r0, acc + (size_t)r0 * Dv, Dv);
    }
    accum_piece(at, accum, s, rows_h, n - 1, np, len, io2, acc);
}

/* Counts one of n parts (key splits, a sweep's chunks) done, on a counter reset to 0 before the
 * job: true for the last, which then merges them (acq_rel: it sees every other part's slot). */
static bool part_done(_Atomic uint32_t *done, uint32_t n) {
    return atomic_fetch_add_explicit(done, 1, memory_order_acq_rel) + 1 == n;
}

/* Block b of a unit's walk over [.., b1) of its item: its id, the position of its first key, the
 * keys the unit sees in it [t0, t0 + n_keys) (of [k_lo, k_hi]), whether any of them needs a mask
 * (causal past the first query pos_first, or before the last query's first key lo_last: its
 * window's or chunk's),
 * and the next block's K and V to prefetch (NULL: none). */
typedef struct unit_block {
    size_t bid;
    uint32_t kb, t0, n_keys;
    bool mask;
    const uint8_t *kn, *vn;
} unit_block;

static inline unit_block unit_block_at(const pkv__attn *at, const pkv__attn_item *it, uint32_t b, uint32_t b1,
                                       uint32_t k_lo, uint32_t k_hi, uint32_t pos_first, uint32_t lo_last) {
    const pkv__kv_view *kv = at->kv;
    const uint32_t B = kv->block_tokens;
    unit_block ub = {.bid = (size_t)it->block_table[b], .kb = b * B};
    ub.t0 = k_lo > ub.kb ? k_lo - ub.kb : 0;
    const uint32_t t1 = PKV_MIN(B, k_hi - ub.kb + 1);
    ub.n_keys = t1 - ub.t0;
    ub.mask = it->mask || (ub.kb + t1 - 1 > pos_first) || (lo_last > ub.kb + ub.t0);
    ub.kn = ub.vn = NULL;
    if (PKV_ATTN_PF_DIST && b + PKV_ATTN_PF_DIST < b1) {
        ub.kn = kv->k + (size_t)it->block_table[b + PKV_ATTN_PF_DIST] * kv->k_block_bytes;
        ub.vn = kv->v + (size_t)it->block_table[b + PKV_ATTN_PF_DIST] * kv->v_block_bytes;
    }
    return ub;
}

/* Whether no query of a tile (qa .. qa + nq - 1) of an item's custom mask sees a key of
 * [kp0, kp0 + n): the block is not read (a document's tile skips the other documents' blocks). */
static bool mask_block_none(const pkv__attn_item *it, uint32_t qa, uint32_t nq, uint32_t kp0, uint32_t n) {
    for (uint32_t r = 0; r < nq; r++) {
        const uint64_t b = (uint64_t)(qa + r) * it->mask_row + kp0;
        if (pkv__bits_first(it->mask, b, b + n) < b + n) return false;
    }
    return true;
}

/* The masks of one block's scores for a unit's queries: -inf where key kp is past query p or
 * before its first (key_lo: its window's or chunk's), or, for an item of a custom mask, where its
 * bit is clear. s[qi * gs + g][t] lies at s + (qi * gs + g) * rs + t * ts (the row path's
 * layout: rs = s_stride, ts = 1; the transposed path's: rs = 1, ts = rp). */
static void mask_block(const pkv__attn *at, const unit *w, uint32_t pos_first, uint32_t kp0, uint32_t n_keys,
                       float *s, size_t rs, size_t ts) {
    const pkv__attn_item *it = w->item;
    if (it->mask) { /* its positions are nominal: the bits say it all */
        for (uint32_t qi = 0; qi < w->nq; qi++) {
            const uint64_t bit0 = (uint64_t)(w->qa + qi) * it->mask_row + kp0;
            float *sq = s + (size_t)qi * w->gs * rs;
            for (uint32_t t = 0; t < n_keys; t++) {
                const uint64_t b = bit0 + t;
                if (it->mask[b >> 3] >> (b & 7u) & 1u) continue;
                for (uint32_t g = 0; g < w->gs; g++) sq[g * rs + t * ts] = -INFINITY;
            }
        }
        return;
    }
    for (uint32_t qi = 0; qi < w->nq; qi++) {
        const uint32_t p = pos_first + qi, plo = key_lo(at->call, w->item, p);
        for (uint32_t g = 0; g < w->gs; g++) {
            float *sr = s + (size_t)(qi * w->gs + g) * rs;
            for (uint32_t t = 0; t < n_keys; t++)
                if (kp0 + t > p || kp0 + t < plo) sr[t * ts] = -INFINITY;
        }
    }
}

/* ALiBi (call->alibi): the scores of query heads hq0 .. hq0 + gs - 1 at positions pos_first + qi,
 * for the keys at kp0 + t, in mask_block's layout (rs = 1 or ts = 1): each raised by
 * alibi[h] x (kp0 + t - pos), masked ones (-inf) staying -inf; where the call caps, each visible
 * one is capped first (the softmax steps then take cap 0: sm_cap). Distances are formed in f32
 * (exact under 2^24 positions). Without a cap the loops run along the contiguous axis with no
 * branch (-inf plus a finite bias is -inf), so the compiler vectorizes them: a pass over rows x
 * keys floats beside a score of head_dim products each. */
__attribute__((noinline)) static void bias_block(const pkv__attn *at, uint32_t hq0, uint32_t nq, uint32_t gs,
                                                 uint32_t pos_first, uint32_t kp0, uint32_t n_keys, float *s,
                                                 size_t rs, size_t ts) {
    const uint32_t rows = nq * gs;
    pkv_assert(rows <= ROWS_MAX);
    float sl[ROWS_MAX], d0[ROWS_MAX]; /* a row's slope, and key t0's distance from its query */
    for (uint32_t qi = 0; qi < nq; qi++)
        for (uint32_t g = 0; g < gs; g++) {
            sl[qi * gs + g] = at->call->alibi[hq0 + g];
            d0[qi * gs + g] = (float)((int64_t)kp0 - (int64_t)pos_first - qi);
        }
    const float cap = at->call->softcap;
    if (cap > 0.0f) {
        const float inv = 1.0f / cap;
        for (uint32_t r = 0; r < rows; r++)
            for (uint32_t t = 0; t < n_keys; t++) {
                float *x = s + r * rs + t * ts;
                if (*x != -INFINITY) *x = cap * tanhf(*x * inv) + sl[r] * (d0[r] + (float)t);
            }
    } else if (ts == 1) { /* the row path's layout: a row's keys contiguous */
        for (uint32_t r = 0; r < rows; r++) {
            float *x = s + r * rs;
            const float a = sl[r], d = d0[r];
            for (uint32_t t = 0; t < n_keys; t++) x[t] += a * (d + (float)t);
        }
    } else { /* the transposed path's: a key's rows contiguous */
        for (uint32_t t = 0; t < n_keys; t++) {
            float *x = s + t * ts;
            const float ft = (float)t;
            for (uint32_t r = 0; r < rows; r++) x[r] += sl[r] * (d0[r] + ft);
        }
    }
}

/* An entry key's fields: block id, item (within its group), index in the item's table. */
static uint64_t sweep_key(int32_t bid, uint32_t i, uint32_t b) {
    return (uint64_t)(uint32_t)bid << 32 | (uint64_t)i << SWEEP_B_BITS | b;
}
static size_t key_bid(uint64_t e) { return (size_t)(e >> 32); }
static uint32_t key_item(uint64_t e) { return (uint32_t)(e >> SWEEP_B_BITS) & (SWEEP_ITEMS - 1u); }
static uint32_t key_b(uint64_t e) { return (uint32_t)e & ((1u << SWEEP_B_BITS) - 1u); }

/* ---- the two passes --------------------------------------------------------------------------
 * Where two_pass is set (PKV_CPU_TWO_PASS, PKV_ATTN_PASSES), the row path walks its blocks in
 * windows: first the window's K runs, every block's heads' scores into the thread's score window
 * (the K pass), then the same blocks' V runs, each head's softmax step and accum (the V pass),
 * rather than each block's K and V runs head by head. The memory serves one stream at a time, and
 * a pass touches half of the states: the queries in the K pass, acc, m and l in the V pass. Each
 * head's softmax and accum steps run in the same order as in one pass, on the same scores: the
 * results are the same bits. The prefetch leads by about PKV_ATTN_PF_LEAD bytes along the walk's
 * runs (a window's K runs, then its V runs, then the next window's K runs), at least two runs:
 * the run led to into L2, or where pf_l1 says with the NTA hint and the next run into L1 as well
 * (pkv__attn_pf.near).
 * Backends whose accum does not prefetch its V run (accum_pf: the quantized V kernels) keep one
 * pass. On Zen 5 (stop 44, ab-decode against one pass, 4096 x 16, 2 layers): f16 paged 0.914 at
 * 1 and 2 threads, contiguous 0.937 and 0.902; f32 and bf16 faster by 6-15% in the bench. */
typedef struct pass_walk {
    const uint64_t *e;    /* the sweep's sorted entries: block x of the walk is key_bid(e[x]); or NULL, */
    const int32_t *table; /* and block x is table[x] (a unit's walk) */
    uint32_t h0, nh;      /* kv heads [h0, h0 + nh) of each block */
    uint32_t x1, W;       /* the walk ends before block x1; windows of W blocks */
} pass_walk;

/* One block of a window: its keys [t0, t0 + n_keys), whether they need the unit's masks (kp0 the
 * position of key t0), the prepared queries of its first head's rows and the state its rows
 * update (rows_h rows a head, heads one after the other). */
typedef struct pass_blk {
    size_t bid;
    uint32_t t0, n_keys, kp0;
    uint32_t qpos; /* a sweep entry's query position (ALiBi's bias; a unit's come from the unit) */
    bool mask;
    const uint8_t *qp;
    float *m, *l, *acc;
} pass_blk;

static bool pass_on(const pkv__attn *at) { return at->two_pass && at->kt->accum_pf[at->kv->v_dtype]; }

/* The most blocks a window of units of rows rows holds: as many blocks' scores as pass_bytes takes. */
static uint32_t pass_window_blocks(const pkv__attn *at, uint32_t rows) {
    const size_t n = at->pass_bytes / ((size_t)rows * at->s_stride * sizeof(float));
    return (uint32_t)PKV_MAX(PKV_MIN(n, (size_t)at->pass_blocks), (size_t)1);
}

static inline size_t pass_bid(const pass_walk *pw, uint32_t x) {
    return pw->e ? key_bid(pw->e[x]) : (size_t)pw->table[x];
}

/* Run idx of the walk from the window that starts at block xw0, its bytes in *n; NULL past the walk. */
static const uint8_t *pass_run(const pkv__attn *at, const pass_walk *pw, uint32_t xw0, size_t idx, size_t *n) {
    const pkv__kv_view *kv = at->kv;
    const size_t krun = (size_t)kv->block_tokens * kv->k_row_bytes, vrun = (size_t)kv->block_tokens * kv->v_row_bytes;
    for (;;) {
        const uint32_t nw = PKV_MIN(pw->W, pw->x1 - xw0);
        const size_t runs = (size_t)nw * pw->nh;
        if (idx < 2 * runs) {
            const bool v = idx >= runs; /* the window's V runs follow its K runs */
            const size_t i = v ? idx - runs : idx, bid = pass_bid(pw, xw0 + (uint32_t)(i / pw->nh));
            *n = v ? vrun : krun;
            return (v ? kv->v + bid * kv->v_block_bytes : kv->k + bid * kv->k_block_bytes) + (pw->h0 + i % pw->nh) * *n;
        }
        idx -= 2 * runs;
        xw0 += nw;
        if (xw0 >= pw->x1) return NULL;
    }
}

/* The prefetch while run idx of the walk is read (pass_ahead runs on), in *pf; NULL: none left. */
static pkv__attn_pf *pass_pf(const pkv__attn *at, const pass_walk *pw, uint32_t xw0, size_t idx, pkv__attn_pf *pf) {
    size_t n, nn;
    const uint8_t *far = pass_run(at, pw, xw0, idx + at->pass_ahead, &n);
    if (!far) return NULL;
    *pf = (pkv__attn_pf){.p = {far, far}, .end = {far + n, far}, .fine = at->pf_fine};
    if (at->pf_l1) {
        const uint8_t *next = pass_run(at, pw, xw0, idx + 1, &nn);
        if (next && nn == n) pf->near = next - far;
    }
    return pf;
}

/* One window of the two passes: blocks bl[0 .. nw) of the walk from block xw0, rows_h rows a
 * head; the scores go to sw. w and pos_first: the unit whose masks a block may need (NULL in the
 * sweep, whose blocks need none). */
static void pass_window(const pkv__attn *at, const pass_walk *pw, uint32_t xw0, const pass_blk *bl, uint32_t nw,
                        uint32_t rows_h, float *sw, const unit *w, uint32_t pos_first) {
    const pkv__kv_view *kv = at->kv;
    const pkv__attn_kernels *kt = at->kt;
    const uint32_t D = kv->head_dim, Dv = kv->v_dim, B = kv->block_tokens, nh = pw->nh;
    const size_t qrow = PKV__ATTN_QROW_BYTES(D), ss = at->s_stride, rows = (size_t)nh * rows_h;
    const size_t krun = (size_t)B * kv->k_row_bytes, vrun = (size_t)B * kv->v_row_bytes;
    const pkv__attn_score_fn score = kt->score[kv->k_dtype];
    const pkv__attn_accum_fn accum = kt->accum[kv->v_dtype];
    pkv__attn_pf pf;
    for (uint32_t j = 0; j < nw; j++) { /* the K pass */
        const pass_blk *b = &bl[j];
        const uint8_t *k = kv->k + b->bid * kv->k_block_bytes + ((size_t)pw->h0 * B + b->t0) * kv->k_row_bytes;
        for (uint32_t h = 0; h < nh; h++) {
            float *s = sw + (j * rows + (size_t)h * rows_h) * ss;
            score(b->qp + (size_t)h * rows_h * qrow, rows_h, k + h * krun, kv->k_row_bytes, b->n_keys, D, s,
                  (uint32_t)ss, pass_pf(at, pw, xw0, (size_t)j * nh + h, &pf));
            if (b->mask) mask_block(at, w, pos_first, b->kp0, b->n_keys, s, ss, 1);
            if (PKV_UNLIKELY(at->call->alibi != NULL)) /* a unit's blocks, or a sweep's entries of one query each */
                bias_block(at, (pw->h0 + h) * at->G + (w ? w->g0 : 0), w ? w->nq : 1, w ? w->gs : rows_h,
                           w ? bias_first(w, pos_first) : b->qpos, b->kp0, b->n_keys, s, ss, 1);
        }
    }
    for (uint32_t j = 0; j < nw; j++) { /* the V pass */
        const pass_blk *b = &bl[j];
        const uint8_t *v = kv->v + b->bid * kv->v_block_bytes + ((size_t)pw->h0 * B + b->t0) * kv->v_row_bytes;
        for (uint32_t h = 0; h < nh; h++) {
            const size_t r0 = (size_t)h * rows_h;
            float *s = sw + (j * rows + r0) * ss;
            kt->softmax(s, (uint32_t)ss, rows_h, b->n_keys, sm_cap(at), b->m + r0, b->l + r0, b->acc + r0 * Dv, Dv);
            accum(s, (uint32_t)ss, rows_h, v + h * vrun, kv->v_row_bytes, b->n_keys, Dv, b->acc + r0 * Dv,
                  pass_pf(at, pw, xw0, (size_t)(nw + j) * nh + h, &pf));
        }
    }
}

/* Whether this call's units run tiles for its K or V (AMX: t_dtypes) where the transposed path
 * takes them: head_dim (K) or v_dim (V) a multiple of 32, else the kernels fall back and no
 * tile runs. The driver then loads the tile configuration for a unit (unit_blocks_t) and plans
 * prefill tiles of ROWS_PER_HEAD_TILES rows. */
static bool runs_tiles(const pkv__attn *at) {
    const pkv__attn_kernels *kt = at->kt;
    const pkv__kv_view *kv = at->kv;
    return kt->t_enter && (((kt->t_dtypes >> kv->k_dtype & 1u) && kv->head_dim % 32 == 0) ||
                           ((kt->t_dtypes >> kv->v_dtype & 1u) && kv->v_dim % 32 == 0));
}

/* run_unit's blocks [b0, b1) through the transposed primitives (attn.h: score_t): each head's
 * prepared rows transposed into qt once (pad rows 0), then for each block and head score_t, the
 * masks, softmax_t and accum_t. The row path's flow otherwise (run_unit below). */
static void unit_blocks_t(const pkv__attn *at, const unit *w, const scratch *sc, uint32_t b0, uint32_t b1,
                          uint32_t k_lo, uint32_t k_hi, uint32_t pos_first, uint32_t lo_last) {
    const pkv__kv_view *kv = at->kv;
    const pkv__attn_kernels *kt = at->kt;
    const pkv__attn_item *it = w->item;
    const uint32_t D = kv->head_dim, Dv = kv->v_dim;
    const uint32_t rows_h = w->nq * w->gs, rp = (rows_h + 15u) & ~15u;
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    pkv_assert(w->n_kvh * rp <= T_QT_ROWS && rp <= T_ROWS_PAD);
    const bool pairs = kt->qt_pairs[kv->k_dtype], round = pkv__attn_qt_round(kt, kv->k_dtype, D);
    for (uint32_t j = 0; j < w->n_kvh; j++) {
        float *qt = sc->qt + (size_t)j * rp * D;
        if (pairs || round) { /* (D + 1) / 2 pairs of 16-bit values, in the room of D floats: the
                                 prepared ones (pairs), or the f32 rows rounded to bf16 (round) */
            uint32_t *qp = (uint32_t *)(void *)qt;
            const uint32_t P = (D + 1) / 2;
            for (uint32_t r = 0; r < rows_h; r++) {
                const uint8_t *q = sc->qp + (size_t)(j * rows_h + r) * qrow;
                if (pairs) {
                    for (uint32_t i = 0; i < P; i++) memcpy(qp + (size_t)i * rp + r, q + 4 * (size_t)i, 4);
                } else { /* D even: a multiple of 32 */
                    const float *f = (const float *)(const void *)q;
                    for (uint32_t i = 0; i < P; i++)
                        qp[(size_t)i * rp + r] = pkv__f32_to_bf16(f[2 * i]) | (uint32_t)pkv__f32_to_bf16(f[2 * i + 1]) << 16;
                }
            }
            for (uint32_t i = 0; i < P; i++)
                for (uint32_t r = rows_h; r < rp; r++) qp[(size_t)i * rp + r] = 0;
            continue;
        }
        for (uint32_t r = 0; r < rows_h; r++) {
            const float *q = (const float *)(sc->qp + (size_t)(j * rows_h + r) * qrow);
            for (uint32_t d = 0; d < D; d++) qt[(size_t)d * rp + r] = q[d];
        }
        for (uint32_t d = 0; d < D; d++) /* the pad rows */
            for (uint32_t r = rows_h; r < rp; r++) qt[(size_t)d * rp + r] = 0.0f;
    }
    const pkv__attn_score_t_fn score = kt->score_t[kv->k_dtype];
    const pkv__attn_accum_t_fn accum = kt->accum_t[kv->v_dtype];
    /* blocks in groups where v_dim is a multiple of 32, the tiles' groups (elsewhere accum_tn's
       fallbacks take a block at a time anyway, and the groups would only change the softmax's
       steps: PKV_ATTN_F16_AS_BF16 changes no bit there) */
    const pkv__attn_accum_tn_fn accum_n = Dv % 32 ? NULL : kt->accum_tn[kv->v_dtype];
    /* the transposed path's set-up, where this call's primitives have one (AMX: bf16, f16, fp8, q8_0, q4_0) and
       some tile runs */
    const bool hooks = runs_tiles(at);
    if (hooks) kt->t_enter();
    for (uint32_t b = b0; b < b1; b++) {
        unit_block ub[PKV__ATTN_T_RUNS];
        ub[0] = unit_block_at(at, it, b, b1, k_lo, k_hi, pos_first, lo_last);
        if (it->mask && mask_block_none(it, w->qa, w->nq, ub[0].kb + ub[0].t0, ub[0].n_keys)) continue;
        /* with accum_tn, the next blocks too while each has at most 16 keys to see, up to
           PKV__ATTN_T_RUN_KEYS in all (a block no query sees ends the group) */
        uint32_t g = 1, n_keys = ub[0].n_keys;
        if (accum_n && n_keys <= 16)
            while (g < PKV__ATTN_T_RUNS && b + g < b1) {
                const unit_block u = unit_block_at(at, it, b + g, b1, k_lo, k_hi, pos_first, lo_last);
                if (u.n_keys > 16 || n_keys + u.n_keys > PKV__ATTN_T_RUN_KEYS ||
                    (it->mask && mask_block_none(it, w->qa, w->nq, u.kb + u.t0, u.n_keys)))
                    break;
                ub[g++] = u, n_keys += u.n_keys;
            }
        for (uint32_t j = 0; j < w->n_kvh; j++) {
            const uint32_t r0 = j * rows_h;
            const float *qt = sc->qt + (size_t)j * rp * D;
            const uint8_t *vr[PKV__ATTN_T_RUNS];
            uint32_t nv[PKV__ATTN_T_RUNS];
            float *st = sc->st;
            head_io io; /* the last block's, whose pvp (inside it) accum takes */
            for (uint32_t i = 0; i < g; i++) { /* each block's scores below the last's */
                const unit_block *u = &ub[i];
                (void)head_io_fill(at, u->bid, w->kvh0 + j, w->kvh0, w->kvh0 + w->n_kvh, false, u->t0, u->kn, u->vn,
                                   NULL, 0, &io);
                score(qt, rp, io.kr, kv->k_row_bytes, u->n_keys, D, st, sc->kbuf, io.pkp);
                if (u->mask) mask_block(at, w, pos_first, u->kb + u->t0, u->n_keys, st, 1, rp);
                unit_bias(at, w, w->kvh0 + j, pos_first, u->kb + u->t0, u->n_keys, st, 1, rp);
                vr[i] = io.vr, nv[i] = u->n_keys;
                st += (size_t)u->n_keys * rp;
            }
            kt->softmax_t(sc->st, rp, rows_h, n_keys, sm_cap(at), sc->m + r0, sc->l + r0, sc->acc + (size_t)r0 * Dv,
                          Dv);
            if (g > 1)
                accum_n(sc->st, rp, rows_h, vr, nv, g, kv->v_row_bytes, Dv, sc->acc + (size_t)r0 * Dv, sc->vbuf, io.pvp);
            else
                accum(sc->st, rp, rows_h, vr[0], kv->v_row_bytes, n_keys, Dv, sc->acc + (size_t)r0 * Dv, sc->vbuf,
                      io.pvp);
        }
        b += g - 1;
    }
    if (hooks) kt->t_leave();
}

static void run_unit(void *ctx, uint32_t u, uint32_t tid) {
    pkv__attn *at = ctx;
    const pkv__kv_view *kv = at->kv;
    const pkv__attn_call *call = at->call;
    const pkv__attn_kernels *kt = at->kt;
    const uint32_t D = kv->head_dim, Dv = kv->v_dim, B = kv->block_tokens, G = at->G, nqh = call->n_q_heads;
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    unit w;
    decode_unit(at, u, &w);
    const plan_item *pi = w.pi;
    const pkv__attn_item *it = w.item;

    const scratch sc = thread_scratch(at, tid);
    uint8_t *qp = sc.qp;
    float *acc = sc.acc, *m = sc.m, *l = sc.l, *s = sc.s;

    const uint32_t rows_h = w.nq * w.gs, rows = w.n_kvh * rows_h;
    pkv_assert(rows <= ROWS_MAX);
    const bool tpath =
        at->tpath && rows_h >= PKV__ATTN_T_MIN_ROWS && kt->score_t[kv->k_dtype] && kt->accum_t[kv->v_dtype];
    const pkv__attn_prep_fn prep =
        tpath && kt->prep_q_t[kv->k_dtype] ? kt->prep_q_t[kv->k_dtype] : kt->prep_q[kv->k_dtype];
    for (uint32_t j = 0; j < w.n_kvh; j++)
        for (uint32_t qi = 0; qi < w.nq; qi++) {
            const float *q = it->q + ((size_t)(w.qa + qi) * nqh + (size_t)(w.kvh0 + j) * G + w.g0) * D;
            prep(q, D, w.gs, D, call->scale, qp + (size_t)(j * rows_h + qi * w.gs) * qrow);
        }
    for (uint32_t r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(acc, 0, (size_t)rows * Dv * sizeof(float));

    /* keys this tile sees: [k_lo, k_hi]; split ks takes an even share of its blocks */
    const uint32_t pos_first = it->q_pos0 + w.qa, pos_last = pos_first + w.nq - 1;
    uint32_t k_lo = item_key_lo(call, it, pos_first), k_hi = item_key_hi(it, pos_last);
    /* a custom mask's tile: the keys its rows set (core.h; none: no block; every split of it
       agrees), so a causal mask's tile reads what a causal tile reads, not every key to k_end:
       nq x (k_hi - k_lo + 1) bits at most, beside as many scores of head_dim products each */
    const bool none = it->mask && !pkv__bits_rows_span(it->mask, it->mask_row, w.qa, w.nq, &k_lo, &k_hi);
    const uint32_t bl = k_lo / B, nb = none ? 0 : k_hi / B - bl + 1;
    const uint32_t b0 = bl + (uint32_t)((uint64_t)nb * w.ks / pi->n_ks);
    const uint32_t b1 = bl + (uint32_t)((uint64_t)nb * (w.ks + 1) / pi->n_ks);
    /* rows that may need masking inside a block: causal when a key is past the first query,
     * window or chunk when a key is before the last query's first (the largest: key_lo) */
    const uint32_t lo_last = key_lo(call, it, pos_last);

    const pkv__attn_score_fn score = kt->score[kv->k_dtype];
    const pkv__attn_accum_fn accum = kt->accum[kv->v_dtype];
    if (tpath) {
        unit_blocks_t(at, &w, &sc, b0, b1, k_lo, k_hi, pos_first, lo_last);
    } else if (pass_on(at)) {
        const pass_walk pw = {.table = it->block_table, .h0 = w.kvh0, .nh = w.n_kvh, .x1 = b1,
                              .W = pass_window_blocks(at, rows)};
        pass_blk pb[PASS_BLOCKS_MAX];
        for (uint32_t xw0 = b0; xw0 < b1; xw0 += pw.W) {
            const uint32_t nw = PKV_MIN(pw.W, b1 - xw0);
            for (uint32_t j = 0; j < nw; j++) {
                const unit_block ub = unit_block_at(at, it, xw0 + j, b1, k_lo, k_hi, pos_first, lo_last);
                pb[j] = (pass_blk){.bid = ub.bid, .t0 = ub.t0, .n_keys = ub.n_keys, .kp0 = ub.kb + ub.t0,
                                   .mask = ub.mask, .qp = qp, .m = m, .l = l, .acc = acc};
            }
            pass_window(at, &pw, xw0, pb, nw, rows_h, sc.sw, &w, pos_first);
        }
    } else {
        for (uint32_t b = b0; b < b1; b++) {
            const unit_block ub = unit_block_at(at, it, b, b1, k_lo, k_hi, pos_first, lo_last);
            const uint32_t n_keys = ub.n_keys;
            if (it->mask && mask_block_none(it, w.qa, w.nq, ub.kb + ub.t0, n_keys)) continue;
            if (piece_take(at, n_keys, rows_h)) {
                const piece_mask pm = {.w = &w, .pos_first = pos_first, .kp0 = ub.kb + ub.t0, .mask = ub.mask};
                block_pieces(at, ub.bid, w.kvh0, w.kvh0 + w.n_kvh, ub.t0, n_keys, ub.kn, ub.vn, qp, rows_h, s, m, l,
                             acc, ub.mask || call->alibi ? &pm : NULL, NULL, 0);
                continue;
            }
            head_io io2[2]; /* heads pipelined (score_half) */
            for (uint32_t j = 0; j < w.n_kvh; j++) {
                const uint32_t r0 = j * rows_h;
                float *sj = score_half(at, s, rows_h, j);
                head_io *io = &io2[j & 1u];
                (void)head_io_fill(at, ub.bid, w.kvh0 + j, w.kvh0, w.kvh0 + w.n_kvh, true, ub.t0, ub.kn, ub.vn,
                                   NULL, 0, io);
                score(qp + (size_t)r0 * qrow, rows_h, io->kr, kv->k_row_bytes, n_keys, D, sj, at->s_stride, io->pkp);
                if (ub.mask) mask_block(at, &w, pos_first, ub.kb + ub.t0, n_keys, sj, at->s_stride, 1);
                unit_bias(at, &w, w.kvh0 + j, pos_first, ub.kb + ub.t0, n_keys, sj, at->s_stride, 1);
                if (j > 0) accum_head(at, accum, s, rows_h, j - 1, n_keys, io2, acc);
                kt->softmax(sj, at->s_stride, rows_h, n_keys, sm_cap(at), m + r0, l + r0, acc + (size_t)r0 * Dv, Dv);
            }
            accum_head(at, accum, s, rows_h, w.n_kvh - 1, n_keys, io2, acc);
        }
    }

    if (pi->n_ks == 1) {
        merge_write(at, &w, m, l, acc, 0, 1);
        return;
    }
    /* key split: publish the partial; the last split of this (group, tile) merges and writes */
    float *slot0 = at->partials + (size_t)(pi->slot0 + w.grp * pi->n_ks) * at->slot_floats;
    float *slot = slot0 + (size_t)w.ks * at->slot_floats;
    memcpy(slot, m, rows * sizeof(float));
    memcpy(slot + ROWS_MAX, l, rows * sizeof(float));
    memcpy(slot + 2 * ROWS_MAX, acc, (size_t)rows * Dv * sizeof(float));
    if (!part_done(&at->split_done[pi->grp0 + w.grp], pi->n_ks)) return;
    merge_write(at, &w, slot0, slot0 + ROWS_MAX, slot0 + 2 * ROWS_MAX, at->slot_floats, pi->n_ks);
}

/* ---- planning -------------------------------------------------------------------------------- */

/* The unit shape of one item before any key split: head groups x query tiles. */
static void plan_shape(const pkv__attn *at, const pkv__attn_item *it, plan_item *pi) {
    const uint32_t G = at->G, H = at->kv->n_kv_heads;
    if (G > ROWS_MAX) {
        pi->n_gsub = (G + ROWS_MAX - 1) / ROWS_MAX;
        pi->gsub = (G + pi->n_gsub - 1) / pi->n_gsub;
        pi->heads_per = 1;
        pi->qtile = 1;
        pi->n_hgs = H * pi->n_gsub;
    } else {
        pi->n_gsub = 1;
        pi->gsub = G;
        /* a shared prefix's queries (and a tree's prefix part's, and non-causal ones: k_end at or
           before the first query) all see the same keys: as many in a tile as it holds, so its
           blocks are read once a tile */
        const bool same = it->partial || (it->k_end && it->k_end <= it->q_pos0);
        const uint32_t per_head = same ? ROWS_MAX : runs_tiles(at) ? ROWS_PER_HEAD_TILES : ROWS_PER_HEAD;
        pi->qtile = PKV_MAX(1u, PKV_MIN(it->n_q, per_head / G));
        const uint32_t rows_h = pi->qtile * G;
        /* as many kv heads per unit as fit: their blocks are adjacent in the pool */
        pi->heads_per = PKV_MAX(1u, PKV_MIN(H, ROWS_MAX / rows_h));
        pi->n_hgs = (H + pi->heads_per - 1) / pi->heads_per;
        if (same) { /* even groups: 4 + 4 heads, not 5 + 3 */
            pi->heads_per = (H + pi->n_hgs - 1) / pi->n_hgs;
            pi->n_hgs = (H + pi->heads_per - 1) / pi->heads_per;
        }
    }
    pi->n_qt = (it->n_q + pi->qtile - 1) / pi->qtile;
    pi->n_ks = 1;
}

/* Blocks the item's last query sees: its share of the work when choosing key splits. */
static uint32_t item_blocks(const pkv__attn *at, const pkv__attn_item *it) {
    const uint32_t B = at->kv->block_tokens, last = item_key_hi(it, it->q_pos0 + it->n_q - 1);
    const uint32_t lo = item_key_lo(at->call, it, it->q_pos0 + it->n_q - 1) / B;
    return last / B - PKV_MIN(lo, last / B) + 1;
}

/* Plans the call's units (without its items of one query when the sweep took them); returns
 * their count. */
static uint32_t make_plan(pkv__attn *at, bool skip_swept) {
    uint64_t base_total = 0, work_total = 0, head_blocks = 0;
    for (uint32_t i = 0; i < at->n_items; i++) {
        plan_item *pi = &at->plan[i];
        if (at->items[i].n_q == 0 || (skip_swept && sweepable(&at->items[i]))) { /* no units */
            memset(pi, 0, sizeof *pi);
            pi->n_ks = 1;
            continue;
        }
        plan_shape(at, &at->items[i], pi);
        const uint64_t base = (uint64_t)pi->n_hgs * pi->n_qt, nb = item_blocks(at, &at->items[i]);
        base_total += base;
        work_total += base * nb;
        /* a unit reads heads_per kv heads (fewer in the last group): H heads per query tile,
         * each once per query-head sub-group */
        head_blocks += (uint64_t)at->kv->n_kv_heads * pi->n_gsub * pi->n_qt * nb;
    }
    /* Split keys when there are too few units to keep every thread busy (few long
     * sequences): aim at UNITS_PER_THREAD units per thread, each split at least MIN_SPLIT_BLOCKS
     * long and within parts_cap. */
    const uint64_t target = (uint64_t)UNITS_PER_THREAD * at->n_threads;
    uint32_t slots_left = at->n_slots;
    const bool split = at->n_threads > 1 && base_total < target && work_total > 0;
    uint32_t unit0 = 0, grp0 = 0;
    for (uint32_t i = 0; i < at->n_items; i++) {
        plan_item *pi = &at->plan[i];
        const uint64_t base = (uint64_t)pi->n_hgs * pi->n_qt;
        /* a shared prefix's units are split whatever the rest: they are the call's largest */
        const bool partial = at->items[i].partial && at->n_threads > 1;
        if ((split || partial) && pi->n_qt == 1) {
            const uint32_t nb = item_blocks(at, &at->items[i]);
            uint64_t want = (target * base * nb + work_total - 1) / work_total; /* this item's share */
            want = (want + base - 1) / base;
            if (partial) want = PKV_MAX(want, (target + base - 1) / base);
            want = PKV_MIN(want, nb / MIN_SPLIT_BLOCKS);
            want = PKV_MIN(want, parts_cap(at->n_threads, nb));
            want = PKV_MIN(want, slots_left / base);
            if (want > 1) {
                pi->n_ks = (uint32_t)want;
                pi->slot0 = at->n_slots - slots_left;
                pi->grp0 = grp0;
                for (uint64_t g = 0; g < base; g++) atomic_store_explicit(&at->split_done[grp0 + g], 0, memory_order_relaxed);
                grp0 += (uint32_t)base;
                slots_left -= (uint32_t)(base * want);
            }
        }
        pi->unit0 = unit0;
        pi->n_units = (uint32_t)(base * pi->n_ks);
        unit0 += pi->n_units;
    }
    at->head_blocks = head_blocks;
    return unit0;
}


/* ---- pool-order decode (the sweep) ------------------------------------------------------------
 *
 * Every (sequence, block) pair of a decode call is an entry. A group's entries are cut into
 * sets, one a chunk: in (sequence, block index) order, into equal parts (a sequence may fall in
 * two). Each set is sorted by block id, and its chunk keeps one online-softmax state per
 * sequence (a slot: m, l, acc of its H x G rows); the last chunk done with a sequence merges
 * its slots by log-sum-exp and writes its output. Where the batch's blocks fill a region of the
 * pool the chunks read it front to back together, each its set's blocks, as a contiguous cache
 * would be read, while a chunk keeps at most about SWEEP_CHUNK_ITEMS states; a block held by
 * several sequences of a set comes in from memory once, for all of them in a row. A lone
 * sequence is one set, cut into chunks by block ranges, and so is every group where sweep_wide
 * is set (above). */

/* Sorts the keys by their block id (bits 32 and up, below n_blocks), keeping equal ids in the
 * order given: LSD radix, 11 bits a pass. Returns the sorted array, a or tmp. A short list (a
 * decode of a few hundred tokens) is sorted in place by insertion: a radix pass walks its 2048
 * counters whatever n is, some microseconds, a few per cent of such a call. The keys are built in
 * (item, table index) order, so sorting whole keys keeps equal ids in the order given. */
#define SORT_INSERTION_MAX 64u
static const uint64_t *sort_by_block(uint64_t *a, uint64_t *tmp, uint32_t n, uint32_t n_blocks) {
    if (n <= SORT_INSERTION_MAX) {
        for (uint32_t x = 1; x < n; x++) {
            const uint64_t k = a[x];
            uint32_t y = x;
            for (; y > 0 && a[y - 1] > k; y--) a[y] = a[y - 1];
            a[y] = k;
        }
        return a;
    }
    uint32_t bits = 0;
    while (bits < 32 && (uint64_t)(n_blocks - 1) >> bits) bits++;
    for (uint32_t sh = 32; sh < 32 + bits; sh += 11) {
        uint32_t at[2048] = {0};
        for (uint32_t x = 0; x < n; x++) at[(a[x] >> sh) & 2047u]++;
        for (uint32_t d = 0, sum = 0; d < 2048; d++) {
            const uint32_t c = at[d];
            at[d] = sum, sum += c;
        }
        for (uint32_t x = 0; x < n; x++) tmp[at[(a[x] >> sh) & 2047u]++] = a[x];
        uint64_t *t = a;
        a = tmp, tmp = t;
    }
    return a;
}


/* The bytes a chunk reads for one entry: its K/V runs and its item's state (queries and acc). */
static size_t sweep_entry_bytes(const pkv__attn *at) {
    const pkv__kv_view *kv = at->kv;
    const uint32_t D = kv->head_dim, rows = kv->n_kv_heads * at->G;
    return (size_t)kv->n_kv_heads * kv->block_tokens * (kv->k_row_bytes + kv->v_row_bytes) +
           (size_t)rows * (PKV__ATTN_QROW_BYTES(D) + kv->v_dim * sizeof(float));
}

/* Lists the call's items of one query (decode, or an extend of one token) in sweep_idx: the
 * items the sweep would take; sets the group size (SWEEP_STATE_L2_EIGHTHS and the rest, above).
 * most: the entries (visible blocks) of the longest of those items, which bound a wide group. */
static void sweep_collect(pkv__attn *at, uint32_t most) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < at->n_items; i++)
        if (sweepable(&at->items[i])) at->sweep_idx[n++] = i;
    at->sweep_total = n;
    const size_t budget = PKV_MIN(at->l2_bytes / 8 * SWEEP_STATE_L2_EIGHTHS, SWEEP_STATE_BYTES_MAX);
    const size_t per_chunk = budget / sweep_entry_bytes(at);
    uint64_t group = (uint64_t)PKV_MAX(per_chunk, at->sweep_items_min) * at->n_threads;
    if (at->sweep_wide && most) /* as many as the sweep holds, in groups within sweep_cap */
        group = PKV_MAX(group, at->sweep_cap / most);
    at->sweep_group_max = (uint32_t)PKV_MIN(group, (uint64_t)at->sweep_items_cap);
}

/* Item i (0-based) of the group being swept. */
static const pkv__attn_item *sweep_item(const pkv__attn *at, uint32_t i) {
    return &at->items[at->sweep_idx[at->sweep_i0 + i]];
}

/* The call's sweep groups: sweep_group_max of the listed items at most, sizes within one of
 * each other; group g is sweep_idx[*i0 .. *i1). */
static uint32_t sweep_groups(const pkv__attn *at) {
    return (at->sweep_total + at->sweep_group_max - 1) / at->sweep_group_max;
}

static void sweep_group(const pkv__attn *at, uint32_t g, uint32_t *i0, uint32_t *i1) {
    const uint32_t ng = sweep_groups(at);
    *i0 = (uint32_t)((uint64_t)at->sweep_total * g / ng);
    *i1 = (uint32_t)((uint64_t)at->sweep_total * (g + 1) / ng);
}

/* The blocks an item's one query sees: [*b0, *b1] of its table. */
static void sweep_blocks(const pkv__attn *at, const pkv__attn_item *it, uint32_t *b0, uint32_t *b1) {
    const uint32_t B = at->kv->block_tokens;
    *b0 = item_key_lo(at->call, it, it->q_pos0) / B, *b1 = it->q_pos0 / B;
}

/* Whether the sweep takes the call's items of one query (sweep_collect listed them; items of
 * more queries run in table order beside them): at most ROWS_MAX rows an item, each group's
 * entries within sweep_cap and, under AUTO, tables whose runs of neighbouring blocks (runs:
 * counted over those items by pkv__attn_run as it checks the tables) average under
 * SWEEP_TABLE_RUN. Sets *entries to their (item, block) pairs when it gets that far; changes
 * nothing else. */
static bool sweep_takes(const pkv__attn *at, uint64_t runs, uint64_t *entries) {
    const uint32_t H = at->kv->n_kv_heads, B = at->kv->block_tokens;
    if (!at->sweep_cap || (uint64_t)H * at->G > ROWS_MAX) return false;
    uint64_t x = 0;
    for (uint32_t g = 0, ng = sweep_groups(at); g < ng; g++) {
        uint32_t i0, i1;
        uint64_t xg = 0;
        sweep_group(at, g, &i0, &i1);
        for (uint32_t i = i0; i < i1; i++) {
            const pkv__attn_item *it = &at->items[at->sweep_idx[i]];
            if (it->q_pos0 / B >= (1u << SWEEP_B_BITS)) return false;
            uint32_t b0, b1;
            sweep_blocks(at, it, &b0, &b1);
            xg += b1 - b0 + 1;
        }
        if (xg > at->sweep_cap) return false;
        x += xg;
    }
    /* tables of long runs of neighbouring blocks already read as a contiguous cache does */
    *entries = x;
    return x && (at->order != PKV__ATTN_ORDER_AUTO || x < (uint64_t)SWEEP_TABLE_RUN * runs);
}

/* Makes the sorted entries and chunk count of the group sweep_idx[i0 .. i1) (sweep_takes said the
 * call fits; one chunk when the caller runs it alone) and resets its items' progress: the chunks
 * prepare the queries and merge the items (run_chunk). */
static void sweep_prepare(pkv__attn *at, uint32_t i0, uint32_t i1, bool alone) {
    const pkv__kv_view *kv = at->kv;
    uint64_t *keys = at->sweep_keys;
    uint32_t x = 0;
    for (uint32_t i = i0; i < i1; i++) {
        const pkv__attn_item *it = &at->items[at->sweep_idx[i]];
        uint32_t b0, b1;
        sweep_blocks(at, it, &b0, &b1);
        for (uint32_t b = b0; b <= b1; b++)
            keys[x++] = sweep_key(it->block_table[b], i - i0, b);
    }
    at->sweep_i0 = i0, at->sweep_ni = i1 - i0;
    at->sweep_n = x;
    /* a chunk a thread (a group is never empty); the items in as many sets as there are
     * chunks, or one set of a lone item cut into chunks by block ranges */
    const uint32_t chunks = alone ? 1u : PKV_MAX(1u, PKV_MIN(at->sweep_chunks_max, x / MIN_SPLIT_BLOCKS));
    const uint32_t ns = at->sweep_wide ? 1u : PKV_MIN(chunks, at->sweep_ni);
    at->sweep_chunks = chunks / ns * ns;
    at->sweep_n_sets = ns;
    /* the keys are in (item, block index) order: set k is the k-th of ns cuts of equal entries
     * (an item may straddle two), each sorted by block id, back into keys where the sort left
     * it in sweep_tmp */
    for (uint32_t k = 0; k <= ns; k++) at->sweep_set[k] = (uint32_t)((uint64_t)x * k / ns);
    for (uint32_t k = 0; k < ns; k++) {
        const uint32_t a = at->sweep_set[k], n = at->sweep_set[k + 1] - a;
        at->sweep_set_i0[k] = key_item(keys[a]), at->sweep_set_i1[k] = key_item(keys[a + n - 1]) + 1;
        const uint64_t *sorted = sort_by_block(keys + a, at->sweep_tmp, n, kv->n_blocks);
        if (sorted != keys + a) memcpy(keys + a, sorted, (size_t)n * sizeof(uint64_t));
    }
    at->sweep_sorted = keys;
    /* relaxed: the job's start publishes them (the pool's ticket, or the executor's call) */
    for (uint32_t i = 0; i < at->sweep_ni; i++) {
        atomic_store_explicit(&at->sweep_qstate[i], SWEEP_Q_NONE, memory_order_relaxed);
        atomic_store_explicit(&at->sweep_done[i], 0, memory_order_relaxed);
    }
}

/* Item i's prepared queries: its rows [H][G] are consecutive, one prep. */
static void prep_item(pkv__attn *at, uint32_t i) {
    const pkv__kv_view *kv = at->kv;
    const uint32_t rows = kv->n_kv_heads * at->G, D = kv->head_dim;
    at->kt->prep_q[kv->k_dtype](sweep_item(at, i)->q, D, rows, D, at->call->scale,
                               at->sweep_q + (size_t)i * rows * PKV__ATTN_QROW_BYTES(D));
}

/* The share of its set's queries of the chunk that sweeps range rg of the set's nr. The chunks
 * of a set (a lone item's, or the two that share a straddling item) read the same items'
 * queries, so the chunk that starts first cannot make them as it meets them: another chunk
 * would read rows still being written. Each chunk instead claims every item of its set not yet
 * claimed, from an offset of its own (chunks that start together make about a share each), and
 * makes them before it sweeps.
 * (Made by one thread before the chunks started, they held the others back: f16 512 x 16,
 * 2 threads, paged, 3% of the call, stop 29; then in a job of their own, one wake-up more.) */
static void sweep_claim_queries(pkv__attn *at, uint32_t set, uint32_t rg, uint32_t nr) {
    const uint32_t i0 = at->sweep_set_i0[set], ni = at->sweep_set_i1[set] - i0;
    const uint32_t first = (uint32_t)((uint64_t)ni * rg / nr);
    for (uint32_t k = 0; k < ni; k++) {
        const uint32_t i = i0 + (first + k < ni ? first + k : first + k - ni);
        uint32_t none = SWEEP_Q_NONE;
        if (atomic_load_explicit(&at->sweep_qstate[i], memory_order_relaxed) != SWEEP_Q_NONE ||
            !atomic_compare_exchange_strong_explicit(&at->sweep_qstate[i], &none, SWEEP_Q_BUSY,
                                                     memory_order_relaxed, memory_order_relaxed))
            continue;
        prep_item(at, i);
        atomic_store_explicit(&at->sweep_qstate[i], SWEEP_Q_READY, memory_order_release);
    }
}

/* Waits until item i's queries are ready. After sweep_claim_queries every item of the chunk's
 * set is claimed, and one not ready is being made by a task that is running and waits on
 * nothing: this ends under any executor (a serial one never gets here). The yield is for a
 * preempted maker. */
static void sweep_wait_queries(const pkv__attn *at, uint32_t i) {
    for (uint32_t n = 0; atomic_load_explicit(&at->sweep_qstate[i], memory_order_acquire) != SWEEP_Q_READY; n++) {
        pkv__cpu_relax();
        if ((n & 1023u) == 1023u) sched_yield();
    }
}

/* Chunk c's state slot for item i: an item's slots are consecutive, as merge_write reads them. */
static float *sweep_slot(const pkv__attn *at, uint32_t i, uint32_t c) {
    return at->sweep_slots + ((size_t)i * at->sweep_chunks_max + c) * at->slot_floats;
}

/* Item i of the group being swept: merges its chunks' slots and writes its output. */
static void merge_item(const pkv__attn *at, uint32_t i) {
    const pkv__attn_item *it = sweep_item(at, i);
    const uint32_t H = at->kv->n_kv_heads, G = at->G;
    float *slot0 = sweep_slot(at, i, 0);
    const unit w = {.item = it, .kvh0 = 0, .n_kvh = H, .g0 = 0, .gs = G, .qa = 0, .nq = 1};
    merge_write(at, &w, slot0, slot0 + ROWS_MAX, slot0 + 2 * ROWS_MAX, at->slot_floats, at->sweep_chunks);
}

/* A chunk is done with item i: the item's last chunk to be done merges it. */
static void finish_item(pkv__attn *at, uint32_t i) {
    if (part_done(&at->sweep_done[i], at->sweep_chunks)) merge_item(at, i);
}

/* Entry ek of chunk c's walk: its block, the keys its item sees there, the item's queries and the
 * chunk's state for it, started (after the item's queries are ready) at the chunk's first entry
 * of the item (*used: the items started). */
static pass_blk sweep_entry(const pkv__attn *at, uint32_t c, uint64_t ek, uint32_t *used) {
    const uint32_t i = key_item(ek), B = at->kv->block_tokens, D = at->kv->head_dim, rows = at->kv->n_kv_heads * at->G;
    float *m = sweep_slot(at, i, c);
    if (!(*used >> i & 1u)) {
        *used |= 1u << i;
        sweep_wait_queries(at, i);
        for (uint32_t r = 0; r < rows; r++) m[r] = -INFINITY, m[ROWS_MAX + r] = 0.0f;
        memset(m + 2 * ROWS_MAX, 0, (size_t)rows * at->kv->v_dim * sizeof(float));
    }
    const pkv__attn_item *it = sweep_item(at, i);
    const uint32_t pos = it->q_pos0, k_lo = item_key_lo(at->call, it, pos), kb = key_b(ek) * B;
    const uint32_t t0 = k_lo > kb ? k_lo - kb : 0;
    return (pass_blk){.bid = key_bid(ek), .t0 = t0, .n_keys = PKV_MIN(B, pos - kb + 1) - t0, .kp0 = kb + t0, .qpos = pos,
                      .qp = at->sweep_q + (size_t)i * rows * PKV__ATTN_QROW_BYTES(D), .m = m, .l = m + ROWS_MAX,
                      .acc = m + 2 * ROWS_MAX};
}

static void run_chunk(void *ctx, uint32_t c, uint32_t tid) {
    pkv__attn *at = ctx;
    const pkv__kv_view *kv = at->kv;
    const pkv__attn_call *call = at->call;
    const pkv__attn_kernels *kt = at->kt;
    const uint32_t D = kv->head_dim, Dv = kv->v_dim, G = at->G, H = kv->n_kv_heads, rows = H * G;
    const size_t qrow = PKV__ATTN_QROW_BYTES(D);
    const scratch sc = thread_scratch(at, tid);
    float *s = sc.s; /* the chunk's states live in its slots */
    const pkv__attn_score_fn score = kt->score[kv->k_dtype];
    const pkv__attn_accum_fn accum = kt->accum[kv->v_dtype];
    const uint64_t *e = at->sweep_sorted;
    const uint32_t ns = at->sweep_n_sets, set = c % ns, rg = c / ns, nr = at->sweep_chunks / ns;
    const uint32_t sa = at->sweep_set[set], sn = at->sweep_set[set + 1] - sa;
    const uint32_t x0 = sa + (uint32_t)((uint64_t)sn * rg / nr), x1 = sa + (uint32_t)((uint64_t)sn * (rg + 1) / nr);
    const uint32_t n_items = at->sweep_ni;
    uint32_t used = 0; /* items whose slot this chunk has started */
    sweep_claim_queries(at, set, rg, nr);
    /* Each item's last entry in the chunk: after it the chunk is done with the item (finish_item),
     * so the item's last chunk merges it there, between its own entries, rather than all of
     * them at its end. An item with no entry here is done at once: its slot weighs 0. */
    uint32_t last[SWEEP_ITEMS], seen = 0;
    const uint32_t all = n_items == 32 ? ~0u : (1u << n_items) - 1u;
    for (uint32_t x = x1; x-- > x0 && seen != all;) {
        const uint32_t i = key_item(e[x]);
        if (!(seen >> i & 1u)) seen |= 1u << i, last[i] = x;
    }
    for (uint32_t i = 0; i < n_items; i++)
        if (!(seen >> i & 1u)) {
            for (uint32_t r = 0; r < rows; r++) sweep_slot(at, i, c)[ROWS_MAX + r] = 0.0f;
            finish_item(at, i);
        }
    if (pass_on(at)) { /* in windows, each in two passes (pass_window); no state prefetch */
        const pass_walk pw = {.e = e, .h0 = 0, .nh = H, .x1 = x1, .W = pass_window_blocks(at, rows)};
        pass_blk bl[PASS_BLOCKS_MAX];
        for (uint32_t xw0 = x0; xw0 < x1; xw0 += pw.W) {
            const uint32_t nw = PKV_MIN(pw.W, x1 - xw0);
            for (uint32_t j = 0; j < nw; j++) bl[j] = sweep_entry(at, c, e[xw0 + j], &used);
            pass_window(at, &pw, xw0, bl, nw, G, sc.sw, NULL, 0);
            for (uint32_t j = 0; j < nw; j++)
                if (xw0 + j == last[key_item(e[xw0 + j])]) finish_item(at, key_item(e[xw0 + j]));
        }
        return;
    }
    /* The next sequence's state is prefetched into L2 where the states may have left it: where
     * the bytes a core reads between two uses of one state (an entry's K/V runs and state, one
     * entry of each other sequence) exceed its L2. Where they fit, the prefetches only cost
     * (in cache, f16 at batch 2, 4 and 8: 2.7-2.9% of the call). */
    const size_t entry_bytes = sweep_entry_bytes(at);
    const bool state_pf =
        !at->sweep_wide && (uint64_t)(at->sweep_set_i1[set] - at->sweep_set_i0[set]) * entry_bytes > at->l2_bytes;
    for (uint32_t x = x0; x < x1; x++) {
        const pass_blk eb = sweep_entry(at, c, e[x], &used);
        const size_t bid = eb.bid;
        const uint32_t i = key_item(e[x]), t0 = eb.t0, n_keys = eb.n_keys;
        float *m = eb.m, *l = eb.l, *acc = eb.acc;
        const uint8_t *qp = eb.qp, *kn = NULL, *vn = NULL;
        const uint8_t *qn = NULL, *an = NULL;
        if (PKV_ATTN_PF_DIST && x + PKV_ATTN_PF_DIST < x1) {
            kn = kv->k + key_bid(e[x + PKV_ATTN_PF_DIST]) * kv->k_block_bytes;
            vn = kv->v + key_bid(e[x + PKV_ATTN_PF_DIST]) * kv->v_block_bytes;
        }
        if (state_pf && x + 1 < x1) {
            const uint32_t in = key_item(e[x + 1]);
            if (in != i) {
                qn = at->sweep_q + (size_t)in * rows * qrow;
                an = (const uint8_t *)(sweep_slot(at, in, c) + 2 * ROWS_MAX);
            }
        }
        /* the entry's rows as a unit's for ALiBi's bias (every kv head's G query heads, one query;
           no item: a mask-free piece does not read it, the bias only to see it is NULL) */
        const unit wi = {.n_kvh = H, .gs = G, .nq = 1};
        if (piece_take(at, n_keys, G)) {
            /* no masks (an entry's keys are its query's); ALiBi's bias where the call has it */
            const piece_mask pm = {.w = &wi, .pos_first = eb.qpos, .kp0 = eb.kp0};
            block_pieces(at, bid, 0, H, t0, n_keys, kn, vn, qp, G, s, m, l, acc, call->alibi ? &pm : NULL, qn,
                         (size_t)G * qrow);
            if (qn) /* and its acc */
                for (size_t o = 0; o < (size_t)rows * Dv * sizeof(float); o += 64) __builtin_prefetch(an + o, 1, 2);
            if (x == last[i]) finish_item(at, i);
            continue;
        }
        head_io io2[2]; /* heads pipelined (score_half) */
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t r0 = h * G;
            float *sh = score_half(at, s, G, h);
            head_io *io = &io2[h & 1u];
            /* the next sequence's queries for this head, into L2: they left while other blocks
             * streamed by; with score's prefetch where it has room, else at once */
            const uint8_t *qx = qn ? qn + (size_t)h * G * qrow : NULL;
            if (!head_io_fill(at, bid, h, 0, H, true, t0, kn, vn, qx, (size_t)G * qrow, io))
                for (size_t o = 0; o < (size_t)G * qrow; o += 64) __builtin_prefetch(qx + o, 0, 2);
            score(qp + (size_t)r0 * qrow, G, io->kr, kv->k_row_bytes, n_keys, D, sh, at->s_stride, io->pkp);
            if (qn) { /* and its acc, between score and accum */
                const uint8_t *ax = an + (size_t)h * G * Dv * sizeof(float);
                for (size_t o = 0; o < (size_t)G * Dv * sizeof(float); o += 64) __builtin_prefetch(ax + o, 1, 2);
            }
            unit_bias(at, &wi, h, eb.qpos, eb.kp0, n_keys, sh, at->s_stride, 1);
            if (h > 0) accum_head(at, accum, s, G, h - 1, n_keys, io2, acc);
            kt->softmax(sh, at->s_stride, G, n_keys, sm_cap(at), m + r0, l + r0, acc + (size_t)r0 * Dv, Dv);
        }
        accum_head(at, accum, s, G, H - 1, n_keys, io2, acc);
        if (x == last[i]) finish_item(at, i);
    }
}

/* Sweeps the call (sweep_takes said yes), group by group; a small call on the caller alone.
 * Raises *threads to the context's where a group ran in several chunks. Returns 0, or
 * PKV_EINVAL where a caller's executor broke its contract. */
static int sweep_run(pkv__attn *at, bool small, uint32_t *threads) {
    for (uint32_t g = 0, ng = sweep_groups(at); g < ng; g++) {
        uint32_t i0, i1;
        sweep_group(at, g, &i0, &i1);
        sweep_prepare(at, i0, i1, small); /* small: one chunk, which the pool runs on the caller */
        /* one job a group: its chunks make the queries and merge the items themselves */
        const int rc = pkv__tpool_run(&at->pool, run_chunk, at, at->sweep_chunks);
        if (rc) return rc;
        if (at->sweep_chunks > 1) *threads = at->n_threads;
    }
    return PKV_OK;
}

void pkv__attn_set_inline_work(pkv__attn *at, uint64_t elems) { at->inline_elems = elems; }
void pkv__attn_set_order(pkv__attn *at, int order) { at->order = order; }
void pkv__attn_set_sweep_sizing(pkv__attn *at, size_t l2_bytes, uint32_t items_min) {
    at->l2_bytes = l2_bytes;
    at->sweep_items_min = PKV_MAX(items_min, 1u);
}
void pkv__attn_set_sweep_wide(pkv__attn *at, bool on) { at->sweep_wide = on; }
bool pkv__attn_sweep_wide(const pkv__attn *at) { return at->sweep_wide; }
void pkv__attn_set_tpath(pkv__attn *at, bool on) { at->tpath = on; }
void pkv__attn_set_passes(pkv__attn *at, bool two, uint32_t window_blocks) {
    at->two_pass = two;
    at->pass_blocks = window_blocks ? PKV_MIN(window_blocks, PASS_BLOCKS_MAX) : PASS_BLOCKS_MAX;
}
bool pkv__attn_two_pass(const pkv__attn *at) { return at->two_pass; }
void pkv__attn_set_prefetch(pkv__attn *at, bool l1, bool fine, bool two, bool head) {
    at->pf_l1 = l1;
    at->pf_fine = fine;
    at->pf_two = two;
    at->pf_head = head;
}
bool pkv__attn_lead_head(const pkv__attn *at) { return at->pf_head != 0; }
void pkv__attn_set_pieces(pkv__attn *at, uint32_t bytes) { at->piece_bytes = bytes; }
uint32_t pkv__attn_piece_bytes(const pkv__attn *at) { return at->piece_bytes; }
bool pkv__attn_last_swept(const pkv__attn *at) { return at->last_swept; }
uint32_t pkv__attn_last_threads(const pkv__attn *at) { return at->last_threads; }
void pkv__attn_item_counts(const pkv__attn *at, uint64_t *pool, uint64_t *table) {
    *pool = atomic_load_explicit(&at->items_pool, memory_order_relaxed);
    *table = atomic_load_explicit(&at->items_table, memory_order_relaxed);
}

/* ---- run ------------------------------------------------------------------------------------- */

int pkv__attn_run(pkv__attn *at, const pkv__kv_view *kv, const pkv__attn_item *items, uint32_t n_items,
                  const pkv__attn_call *call) {
    if (!at || !kv || !call || (n_items && !items)) return PKV_EINVAL;
    if (n_items > at->lim.max_items) return PKV_EINVAL;
    if (!kv->k || !kv->v || kv->n_kv_heads == 0 || kv->head_dim == 0 || kv->block_tokens == 0) return PKV_EINVAL;
    if (kv->head_dim > at->lim.head_dim || kv->block_tokens > at->lim.block_tokens) return PKV_EINVAL;
    if ((unsigned)kv->k_dtype >= PKV_DTYPE_COUNT || (unsigned)kv->v_dtype >= PKV_DTYPE_COUNT) return PKV_EINVAL;
    if (kv->v_dim > kv->head_dim) return PKV_EINVAL;
    const uint32_t v_dim = kv->v_dim ? kv->v_dim : kv->head_dim;
    const size_t krb = pkv__row_bytes(kv->k_dtype, kv->head_dim), vrb = pkv__row_bytes(kv->v_dtype, v_dim);
    if (!krb || !vrb || kv->k_row_bytes < krb || kv->v_row_bytes < vrb) return PKV_EINVAL;
    if (kv->k_block_bytes < (size_t)kv->n_kv_heads * kv->block_tokens * kv->k_row_bytes ||
        kv->v_block_bytes < (size_t)kv->n_kv_heads * kv->block_tokens * kv->v_row_bytes)
        return PKV_EINVAL;
    if (call->n_q_heads == 0 || call->n_q_heads % kv->n_kv_heads) return PKV_EINVAL;
    if (!isfinite(call->scale) || call->scale == 0.0f || !pkv__attn_softcap_ok(call->softcap))
        return PKV_EINVAL;
    for (uint32_t h = 0; call->alibi && h < call->n_q_heads; h++)
        if (!pkv__attn_slope_ok(call->alibi[h])) return PKV_EINVAL;
    if (!at->kt->prep_q[kv->k_dtype] || !at->kt->score[kv->k_dtype] || !at->kt->accum[kv->v_dtype]) return PKV_ENOTSUP;
    uint64_t runs = 0; /* runs of neighbouring blocks in one-query items' visible tables (AUTO's rule) */
    uint32_t most = 0; /* visible blocks of the longest one-query item (sweep_collect) */
    uint32_t n_live = 0; /* items of at least one query, partial ones aside (not requests) */
    for (uint32_t i = 0; i < n_items; i++) {
        const pkv__attn_item *it = &items[i];
        if (it->n_q == 0) continue;
        n_live += !it->partial;
        if (!it->q || !it->out || !it->block_table) return PKV_EINVAL;
        const uint64_t end = (uint64_t)it->q_pos0 + it->n_q;
        if (end > UINT32_MAX) return PKV_EINVAL;
        /* the blocks up to the last key a query sees */
        const uint64_t nbt = item_key_hi(it, (uint32_t)(end - 1)) / kv->block_tokens + 1;
        if (nbt > at->lim.max_blocks_per_seq && at->lim.max_blocks_per_seq) return PKV_EINVAL;
        /* every query sees a key (a tile of later queries would otherwise have none: k_lo > k_hi) */
        if (it->k_end && key_lo(call, it, it->q_pos0 + it->n_q - 1) >= it->k_end) return PKV_EINVAL;
        if (it->k_start % kv->block_tokens || it->k_start > it->q_pos0 || (it->k_end && it->k_start >= it->k_end))
            return PKV_EINVAL;
        /* a custom mask: nominal positions past k_end, rows of at least k_end bits, no window or chunks */
        if (it->mask && (!it->k_end || it->q_pos0 < it->k_end || it->mask_row < it->k_end || it->partial ||
                         call->window || call->chunk || (uint64_t)it->mask_pos0 + it->n_q > UINT32_MAX))
            return PKV_EINVAL;
        /* only the blocks a query can see are read; each must name a block of the pool */
        const uint32_t lo = item_key_lo(call, it, it->q_pos0) / kv->block_tokens;
        if (sweepable(it)) most = PKV_MAX(most, (uint32_t)(nbt - lo));
        for (uint64_t b = lo; b < nbt; b++) {
            if (it->block_table[b] < 0 || (uint32_t)it->block_table[b] >= kv->n_blocks) return PKV_EINVAL;
            runs += sweepable(it) && (b == lo || it->block_table[b] != it->block_table[b - 1] + 1);
        }
    }

    at->kv_own = *kv;
    at->kv_own.v_dim = v_dim;
    at->kv = kv = &at->kv_own;
    at->call = call;
    at->kt = &at->kt_tab[(call->flags & PKV_ATTN_BF16_DOT ? 1 : 0) | (call->flags & PKV_ATTN_F16_AS_BF16 ? 2 : 0)];
    at->G = call->n_q_heads / kv->n_kv_heads;
    /* the bytes of a head's K and V runs of a block: the one-pass lead counts heads of them; the
     * two passes' lead counts single runs, about PKV_ATTN_PF_LEAD bytes of them, 2 to 64 */
    const size_t run2 = (size_t)kv->block_tokens * (kv->k_row_bytes + kv->v_row_bytes);
    at->pf_lead = at->pf_two && at->pf_l1 ? pf_ahead(run2, kv->k_dtype == PKV_DTYPE_F32) : at->pf_head ? 1 : 0;
    at->pf_l1_call = at->pf_l1 || (at->pf_head && dtype_quantized(kv->k_dtype) && dtype_quantized(kv->v_dtype));
    at->piece_keys = piece_call(at, kv);
    at->pass_ahead = lead_runs(2 * PKV_ATTN_PF_LEAD, run2, 2, 64);
    at->items = items;
    at->n_items = n_items;
    const uint64_t elems_per_head_block = (uint64_t)kv->block_tokens * kv->head_dim;
    uint32_t threads = 1; /* last_threads and last_swept, set once the run has succeeded */
    bool swept = false;
    int rc = PKV_OK;
    if (at->sweep_cap && at->order != PKV__ATTN_ORDER_TABLE) {
        /* the one-query items' share of the work decides whether they go to the pool */
        uint64_t x = 0;
        sweep_collect(at, most);
        const bool takes = sweep_takes(at, runs, &x);
        const bool small_sweep = x * kv->n_kv_heads * elems_per_head_block < at->inline_elems;
        if (takes && (at->order == PKV__ATTN_ORDER_POOL || !small_sweep)) {
            swept = true;
            rc = sweep_run(at, small_sweep, &threads);
        }
    }
    /* the items the sweep did not take, as units */
    const uint32_t n_units = rc ? 0 : make_plan(at, swept);
    const uint64_t work = at->head_blocks * elems_per_head_block; /* a small call: the caller alone */
    if (n_units) rc = pkv__attn_parallel(at, run_unit, at, n_units, work);
    if (n_units > 1 && goes_parallel(at, work)) threads = at->n_threads;
    at->kv = NULL;
    at->items = NULL;
    at->call = NULL;
    at->kt = &at->kt_tab[0];
    if (rc) return rc; /* a caller's executor left tasks out: outputs unspecified, nothing counted */
    at->last_threads = threads;
    at->last_swept = swept;
    const uint32_t n_pool = swept ? at->sweep_total : 0;
    if (at->hold) {
        at->held[0] += n_pool, at->held[1] += n_live - n_pool;
        return PKV_OK;
    }
    atomic_fetch_add_explicit(&at->items_pool, n_pool, memory_order_relaxed);
    atomic_fetch_add_explicit(&at->items_table, n_live - n_pool, memory_order_relaxed);
    return PKV_OK;
}

void pkv__attn_hold_counts(pkv__attn *at) {
    at->hold = true;
    at->held[0] = at->held[1] = 0;
}

void pkv__attn_release_counts(pkv__attn *at, bool keep) {
    if (keep) {
        atomic_fetch_add_explicit(&at->items_pool, at->held[0], memory_order_relaxed);
        atomic_fetch_add_explicit(&at->items_table, at->held[1], memory_order_relaxed);
    }
    at->hold = false;
    at->held[0] = at->held[1] = 0;
}
