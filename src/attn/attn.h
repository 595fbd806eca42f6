/* attn.h: the interface between the cache and the paged attention kernels. The kernels see a
 * read-only view of one layer of the pool plus, per work item, a block table; they never see
 * cache internals. Depends on core and quant only. */
#ifndef PKV_ATTN_H
#define PKV_ATTN_H

#include "../core/core.h"

#include <float.h>
#include <math.h>
#include <stddef.h>

/* One layer of the pool (ARCHITECTURE section 3). Row of (block b, kv head h, offset t):
 * k + b * k_block_bytes + (h * block_tokens + t) * k_row_bytes. K rows hold head_dim values, V
 * rows v_dim (0: head_dim), at most head_dim: queries are [head_dim], outputs and acc [v_dim]. A
 * cache whose V is the first v_dim values of each K row (MLA: pkv_config.v_dim) passes v = k,
 * v_dtype = k_dtype and K's row and block bytes for V's. */
typedef struct pkv__kv_view {
    const uint8_t *k, *v;
    pkv_dtype k_dtype, v_dtype;
    size_t k_row_bytes, v_row_bytes;
    size_t k_block_bytes, v_block_bytes;
    uint32_t n_kv_heads, head_dim, block_tokens, n_blocks;
    uint32_t v_dim;
} pkv__kv_view;

/* One sequence's share of an attention call: n_q consecutive queries at positions
 * q_pos0 .. q_pos0 + n_q - 1; the query at position p attends to positions
 * [pkv__attn_key_lo(call, p), p]: [max(0, p - window + 1), p] (window 0 = [0, p]), and with
 * chunks not before p's chunk, p - p % chunk. block_table covers at least
 * ceil((q_pos0 + n_q) / block_tokens) entries, all valid block ids. Decode is the item
 * {q_pos0 = length - 1, n_q = 1}. k_end, where not 0, also hides every key at or past it; the
 * last query's first key (pkv__attn_key_lo) must still be below it (else PKV_EINVAL). With k_end <=
 * q_pos0 and neither window nor chunks (or partial) all n_q queries see the same keys [0, k_end):
 * pkv_attn_tree's prefix part, a shared-prefix group's (cache.c, share_*) and a non-causal
 * request (PKV_ATTN_NONCAUSAL: q_pos0 = k_end = length); the pool-order sweep does not take such
 * items, and the planner gives them the larger tiles. Only the blocks its queries see must be
 * valid in block_table. k_start, a multiple of block_tokens, hides every key before it (a
 * shared-prefix group's members read their own blocks from there); the first query must be at or
 * past it. partial: the item's queries are at nominal positions, all seeing [0, k_end) (the
 * shared-prefix part of a group of decodes, or the tree's prefix part for a run of nodes): the
 * call's window, chunks and sinks are not applied to it (neither hides a key of it for any of its
 * real queries; the merge with the members' own parts, or the tree's paths, adds the sinks there)
 * and pkv__attn_item_counts does not count it. mask: a custom mask (pkv_attn_prefill_masked):
 * query qi of the item (0 .. n_q - 1) sees key kp only where bit qi x mask_row + kp of mask is
 * set (bit i is bit i % 8 of byte i / 8), within [k_start, k_end) as any item's; such an item's
 * queries are at nominal positions (q_pos0 >= k_end, as non-causal ones: every key below k_end
 * is behind them) and the call has neither window nor chunks; ALiBi takes their real positions,
 * mask_pos0 on. */
typedef struct pkv__attn_item {
    const int32_t *block_table;
    uint32_t q_pos0;
    uint32_t n_q;
    uint32_t k_end;
    uint32_t k_start;
    bool partial;
    const uint8_t *mask; /* NULL: none */
    uint32_t mask_row;   /* bits a query's row of mask: at least k_end */
    uint32_t mask_pos0;  /* the first query's real position (ALiBi) */
    const float *q; /* [n_q][n_q_heads][head_dim] */
    float *out;     /* [n_q][n_q_heads][v_dim] */
    float *lse;     /* [n_q][n_q_heads] or NULL */
} pkv__attn_item;

typedef struct pkv__attn_call {
    uint32_t n_q_heads; /* multiple of n_kv_heads (pkv__attn_run checks it) */
    float scale;        /* resolved (never 0) */
    float softcap;      /* 0 = off */
    uint32_t window;    /* 0 = off */
    uint32_t chunk;     /* chunked local attention (pkv_attn_params.attn_chunk): 0 = off */
    uint32_t flags;     /* pkv_attn_params.flags (PKV_ATTN_BF16_DOT), checked by the caller */
    const float *sinks; /* [n_q_heads] finite sink logits (pkv_attn_params.sinks), or NULL */
    const float *alibi; /* [n_q_heads] ALiBi slopes (pkv_attn_params.alibi_slopes: finite, at most
                           PKV_ALIBI_SLOPE_MAX), or NULL: each visible logit, after the soft-cap,
                           gains alibi[h] x (key position - query position), the query's position
                           being the item's (nominal where a partial item's are: its callers
                           correct the log-sum-exps, which shift by alibi[h] x (nominal - real)
                           per row; an item of a custom mask gives its real ones, mask_pos0 on) */
} pkv__attn_call;

/* The first key a query at position pos sees under the call's window and chunks (0 where
 * neither hides one). Never past pos, and never less for a later pos: a tile's last query has the
 * largest, its first the smallest. */
static inline uint32_t pkv__attn_key_lo(const pkv__attn_call *call, uint32_t pos) {
    uint32_t lo = call->window && pos + 1 > call->window ? pos + 1 - call->window : 0;
    if (call->chunk && pos - pos % call->chunk > lo) lo = pos - pos % call->chunk;
    return lo;
}

/* A soft-cap the kernels take: 0 (off), or finite and normal (a subnormal cap's 1 / cap is not
 * finite). pkv.h's attention parameters and pkv__attn_run both check it. */
static inline bool pkv__attn_softcap_ok(float softcap) {
    return softcap == 0.0f || (softcap >= FLT_MIN && !isinf(softcap));
}

/* An ALiBi slope the kernels take: finite, |slope| <= PKV_ALIBI_SLOPE_MAX (NaN is not). pkv.h's
 * attention parameters and pkv__attn_run both check it. */
static inline bool pkv__attn_slope_ok(float slope) { return fabsf(slope) <= PKV_ALIBI_SLOPE_MAX; }

/* Sizes the attention context may rely on (scratch is allocated once, at create), and where
 * its jobs run. */
typedef struct pkv__attn_limits {
    uint32_t max_items;          /* items per pkv__attn_run call */
    uint32_t max_blocks_per_seq;
    uint32_t n_kv_heads, head_dim, block_tokens;
    /* K or V is not f32 (the dtypes the AMX tables serve: PKV_ATTN_BF16_DOT,
       PKV_ATTN_F16_AS_BF16): automatic selection takes "avx512-amx" where the CPU has AMX, asking
       Linux for the tile state then and only then */
    bool amx;
    pkv_executor exec; /* parallel_for set: the caller's executor (n_threads = its n_workers) */
    uint32_t spin_us;  /* the own threads' poll for the next job (pkv_config.spin_us) */
    pkv_log_fn log;    /* where create says why it refuses (NULL: silent) */
    void *log_ctx;
} pkv__attn_limits;

typedef struct pkv__attn pkv__attn; /* thread pool, scratch, chosen backend */

/* n_threads: workers including the caller (0 = all cpus). Allocates through a. Picks the
 * backend once from pkv__cpu_features() (PKV_FORCE_REF=1 forces "ref"). */
int pkv__attn_create(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim, pkv__attn **out);
/* Same with a named backend ("ref", "avx2", "avx2-vnni", "avx512", "avx512-vnni", "avx512-amx", "neon",
 * "neon-dotprod"; NULL = automatic): tests use it to compare every SIMD path with the reference. PKV_ENOTSUP if this
 * CPU or build lacks it. */
int pkv__attn_create_backend(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim,
                             const char *backend, pkv__attn **out);
/* Tests only: the named backend's table, then extra(kt) over it (extra names the result in
 * kt->name). test_attn runs the AVX-512 kernels on CPUs without AVX-512 this way: base "avx2",
 * extra pkv__attn_fill_avx512_emu (x86/avx512_emu.h). */
struct pkv__attn_kernels;
int pkv__attn_create_extended(const pkv_allocator *a, uint32_t n_threads, const pkv__attn_limits *lim,
                              const char *backend, void (*extra)(struct pkv__attn_kernels *kt), pkv__attn **out);
void pkv__attn_destroy(pkv__attn *at);
/* Calls whose plan covers fewer K/V elements than this run on the calling thread alone (waking
 * workers costs more). Default 64 * 16 * 128; tests set 0 to drive the pool on every call. */
void pkv__attn_set_inline_work(pkv__attn *at, uint64_t elems);
/* The order in which the one-query items of a call (decodes) read their blocks. TABLE: each
 * sequence's blocks in table order (split into key ranges when there are few sequences). POOL:
 * every block of those items in ascending block id, whichever sequence holds it, with a running
 * softmax state per sequence and chunk, merged by log-sum-exp at the end (the "sweep" in
 * attn.c): where the batch's blocks fill a region of the pool the reads are sequential however
 * the tables are shuffled, and a block that several sequences share is read from memory once.
 * Items of more queries (extends) always run in table order, after the sweep in the same call.
 * A call the sweep does not take (no one-query item, more query rows per sequence than a unit
 * holds, a context of more than 16 threads) runs in table order; more than 32 sequences are
 * swept in groups. AUTO (the default): POOL where the one-query items' part of the call goes to
 * the thread pool (above the inline threshold) and their tables jump (runs of neighbouring
 * blocks under 32 on average), TABLE for the rest. A sweep's groups are smaller where the
 * sequences' states would not stay in a core's L2 (pkv__attn_set_sweep_sizing). The results
 * differ from TABLE's by rounding only (the softmax is summed in another order). The context starts with
 * the order PKV_ATTN_ORDER names in the environment ("auto", "table", "pool"; unset or empty:
 * auto); creation fails with PKV_EINVAL on any other value. */
enum { PKV__ATTN_ORDER_AUTO = 0, PKV__ATTN_ORDER_TABLE = 1, PKV__ATTN_ORDER_POOL = 2 };
void pkv__attn_set_order(pkv__attn *at, int order);
/* What the sweep sizes its groups by (attn.c: SWEEP_STATE_L2_EIGHTHS and the rest): the core's L2
 * size (sysconf at creation) and the fewest sequences a thread (4, or 8 on a CPU with a victim
 * L3). Tests set 0 and 4 to make groups of 4 sequences a thread on any machine. */
void pkv__attn_set_sweep_sizing(pkv__attn *at, size_t l2_bytes, uint32_t items_min);
/* Whether the sweep's groups are as large as it holds (32 sequences, fewer where their entries
 * would not fit), each swept as one set cut into ranges of the pool, a range a thread, with no
 * state prefetch (attn.c: sweep_wide; set at creation from PKV_CPU_WIDE_SWEEP). Results differ by
 * rounding only (other merges by log-sum-exp); tests run both ways. */
void pkv__attn_set_sweep_wide(pkv__attn *at, bool on);
/* Whether the sweep is wide: the CPU's rule, or PKV_ATTN_SWEEP in the environment at creation
 * ("wide", "narrow", "auto"; unset or empty: auto; another value fails creation, PKV_EINVAL). */
bool pkv__attn_sweep_wide(const pkv__attn *at);
/* How the kernels prefetch the next block (attn.c: pf_l1, pf_fine, pf_two; set at creation from
 * PKV_CPU_PREFETCH_L1): into L1 rather than L2 (l1), in a decode head's score in finer shares
 * (fine), and, where l1 is set, the row path's about 16 KiB of K/V ahead rather than a block,
 * at two levels where that is more than one head (two: attn.c, head_io_fill; pkv__attn_pf.near),
 * and, where two is not set, the row path's one head ahead into L2 rather than a block (head;
 * from PKV_CPU_LEAD_HEAD or PKV_ATTN_LEAD; into L1 where K and V are both quantized: attn.c,
 * pf_l1_call). None changes a result; tests set them every way so every machine runs every
 * path. */
void pkv__attn_set_prefetch(pkv__attn *at, bool l1, bool fine, bool two, bool head);
/* Whether the row path's prefetch leads by one head where two is not set (head above). */
bool pkv__attn_lead_head(const pkv__attn *at);
/* The one-pass row path's pieces (attn.c, piece_call and block_pieces): with 16-bit K and V, a
 * (block, head) run of more than bytes of K is taken bytes of K at a time, each piece prefetching
 * the next; 0 takes runs whole. Set at creation from PKV_CPU_PIECES (PKV_ATTN_PIECE_BYTES, 4 KiB)
 * or PKV_ATTN_PIECES in the environment ("on", "off", "auto"; unset or empty: auto; another value
 * fails creation, PKV_EINVAL). Results differ by float rounding only; tests run both ways. */
void pkv__attn_set_pieces(pkv__attn *at, uint32_t bytes);
uint32_t pkv__attn_piece_bytes(const pkv__attn *at);
/* Whether units of many query rows take the backend's transposed primitives where it has them
 * (attn.h: score_t; on by default). Results differ by rounding only; tests run both ways. */
void pkv__attn_set_tpath(pkv__attn *at, bool on);
/* Whether the row path reads its blocks in windows of two passes, the window's K and then its V
 * (attn.c: pass_window), rather than each block's K and V together; window_blocks caps a window
 * (0: PASS_BLOCKS_MAX, 64). Set at creation from PKV_CPU_TWO_PASS (Zen 5) or PKV_ATTN_PASSES in
 * the environment ("two", "one", "auto"; unset or empty: auto; another value fails creation,
 * PKV_EINVAL). Backends whose accum does not prefetch (the quantized V kernels) keep one pass.
 * The results are the same bits either way; tests run both, with windows of 1 to 3 blocks. */
void pkv__attn_set_passes(pkv__attn *at, bool two, uint32_t window_blocks);
bool pkv__attn_two_pass(const pkv__attn *at);
/* Whether the last successful pkv__attn_run read its one-query items' blocks in pool order. */
bool pkv__attn_last_swept(const pkv__attn *at);
/* Threads the last successful pkv__attn_run used: 1 when it ran on the caller alone (small
 * plan, one unit or one thread), else the context's thread count; 0 before any run. */
uint32_t pkv__attn_last_threads(const pkv__attn *at);
/* Items (of at least one query) that successful runs have read, by order, since creation:
 * *pool in pool order (swept), *table in table order. Safe to call while a run is in flight
 * (relaxed atomics: a run's items show once it has returned). */
void pkv__attn_item_counts(const pkv__attn *at, uint64_t *pool, uint64_t *table);
/* A call of several runs (a batch past max_seqs, in groups) counts all of them or none: between
 * hold and release the runs' items are held back, then added where keep (every run succeeded)
 * or dropped. Serialized with the runs. */
void pkv__attn_hold_counts(pkv__attn *at);
void pkv__attn_release_counts(pkv__attn *at, bool keep);
const char *pkv__attn_backend_name(const pkv__attn *at);
/* Whether calls with PKV_ATTN_BF16_DOT take other kernels than those without for this K dtype. */
bool pkv__attn_lp(const pkv__attn *at, pkv_dtype k_dtype);
/* The same for accum and this V dtype. */
bool pkv__attn_lp_v(const pkv__attn *at, pkv_dtype v_dtype);
/* The same for the transposed primitives (prefill tiles of 16 rows a kv head or more). */
bool pkv__attn_lp_t(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype);
/* Whether calls with PKV_ATTN_F16_AS_BF16 compute otherwise than those without for this K and V
 * dtype at these dims (the transposed primitives: f16 as bf16 on AMX tiles), alone or beside
 * PKV_ATTN_BF16_DOT (which alone takes f16 beside q8_0 or q4_0 to the transposed path). */
bool pkv__attn_f16bf(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype, uint32_t head_dim, uint32_t v_dim);
/* Whether calls with PKV_ATTN_BF16_DOT compute otherwise than those without in the transposed
 * primitives for this K and V dtype at these dims (bf16 where pkv__attn_lp_t; fp8 e4m3, q8_0 and
 * q4_0 on AMX tiles, whose row path the flag leaves alone). */
bool pkv__attn_lp_tiles(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype, uint32_t head_dim, uint32_t v_dim);
/* Whether the backend has transposed primitives for this pair (without them, such tiles take
 * the row path: NEON). */
bool pkv__attn_has_t(const pkv__attn *at, pkv_dtype k_dtype, pkv_dtype v_dtype);
uint32_t pkv__attn_n_threads(const pkv__attn *at);
/* Runs fn(ctx, task, tid) for task in [0, n_tasks) on the context's threads (tid < its
 * n_threads; each tid is one thread at a time), or on the calling thread alone (tid 0) where
 * n_tasks is 1 or the job's work, work_elems, is under what the attention calls run inline. Not
 * while an attention call runs on the same context (the cache serializes them). Returns 0, or
 * PKV_EINVAL where a caller's executor broke its contract (some tasks then did not run). */
int pkv__attn_parallel(pkv__attn *at, void (*fn)(void *ctx, uint32_t task, uint32_t tid), void *ctx, uint32_t n_tasks,
                       uint64_t work_elems);

/* Runs attention for n_items items (n_items <= max_items). Not reentrant on one context: the
 * cache serializes calls. Allocates nothing. Returns 0, PKV_EINVAL (NULL pointers, n_q_heads
 * not a positive multiple of n_kv_heads, view shape beyond the limits), or PKV_ENOTSUP when
 * the backend has no kernel for (k_dtype, v_dtype). On error nothing is written. */
int pkv__attn_run(pkv__attn *at, const pkv__kv_view *kv, const pkv__attn_item *items, uint32_t n_items,
                  const pkv__attn_call *call);

/* ---- kernel dispatch ---------------------------------------------------------------------
 *
 * The driver (attn.c) owns everything dtype-independent: the work plan (items x kv-head
 * groups x query tiles x key splits), the thread pool, the causal / window masks, the
 * split-K log-sum-exp merge and the final normalisation. For each (block, kv head) it calls
 * three primitives from the backend's pkv__attn_kernels table:
 *
 *   prep_q[k_dtype]   once per work unit: query rows (f32, times scale) -> the layout the
 *                     score kernel wants (a plain f32 copy, or e.g. int8 + per-32 scales).
 *   score[k_dtype]    s[r][t] = <prepared q row r, K row t> for up to one block of K rows.
 *   softmax           (dtype-free, per backend) soft-cap, online-softmax update of m, l, the
 *                     rescale of acc, and s -> p = exp(s - m).
 *   accum[v_dtype]    acc[r][:] += sum_t p[r][t] * V row t.
 *
 * A pair (k_dtype, v_dtype) is supported by a backend when prep_q[k], score[k] and accum[v]
 * are all non-NULL; otherwise pkv__attn_run returns PKV_ENOTSUP. Dtypes mix freely (e.g.
 * q8_0 K with f16 V).
 *
 * How to add a dtype's kernels (e.g. q8_0 on AVX2):
 *   1. Write src/attn/x86/attn_q8_avx2.c (the _avx2 suffix gives it -mavx2 -mfma -mf16c)
 *      with static prep / score / accum functions following the contracts below, and one
 *      exported filler:  void pkv__attn_fill_q8_avx2(pkv__attn_kernels *kt)  that sets
 *      kt->prep_q[PKV_DTYPE_Q8_0], kt->score[...], kt->accum[...] and kt->accum_pf[...]
 *      (true if its accum prefetches the V run it is given, else false).
 *   2. Declare the filler in the "fillers" list below and call it from the backend's
 *      table builder in attn.c (function build_kernels: one line per filler, under the
 *      same #if as the backend). The scalar reference fills live in attn_ref.c (fill the
 *      ref table too, so PKV_FORCE_REF=1 and the oracle tests cover the dtype).
 *   3. Nothing else changes: the tests in tests/test_attn.c loop over every dtype the
 *      pool accepts and compare each backend with the reference, and `pkv bench attn`
 *      lists every dtype pkv_cache_create accepts.
 * Rows of a quantized dtype are pkv__row_bytes(dt, head_dim) bytes with inline scales
 * (quant.h); kernels receive the row pointer and row stride and decode in registers (no
 * dequantized copy of the cache). Kernels run on worker threads: no static mutable state.
 */

/* Bytes of prepared-query space per row, 64-aligned: room for head_dim f32 (prep_q of the
 * float dtypes) and for any quantized form that is not larger than f32. */
#define PKV__ATTN_QROW_BYTES(head_dim) ((((size_t)(head_dim) * 4u) + 63u) & ~(size_t)63u)

/* prep_q: n_rows query rows, row r at q + r * q_stride (floats), head_dim f32 values each;
 * writes row r of (scale * q) in the kernel's own format at qp + r * PKV__ATTN_QROW_BYTES. */
typedef void (*pkv__attn_prep_fn)(const float *q, size_t q_stride, uint32_t n_rows, uint32_t head_dim,
                                  float scale, void *qp);
/* Lines a kernel prefetches while it computes: the same kv head of the block that comes next
 * (its K and V rows: one or two runs of bytes, p[j] up to end[j]; run 1 may be empty). A
 * kernel calls pkv__attn_pf_start(pf, n) once, then pkv__attn_pf_step(pf) up to n times spread
 * evenly over its work (n its own count of steps), then pkv__attn_pf_finish(pf), so the next
 * block's lines arrive in small shares between loads of this one: a burst of all of them at
 * once fills the core's miss buffers and stalls it. The driver gives score the K run and accum
 * the V run where the backend's accum takes it (accum_pf in the table), else score both runs.
 * pf may be NULL (nothing to prefetch); the kernel owns it for the call. */
typedef struct pkv__attn_pf {
    const uint8_t *p[2], *end[2];
    size_t step;   /* bytes per step, a multiple of 64 */
    uint32_t left; /* steps left when the runs split evenly (even), else unused */
    int even;      /* run 0 (and run 1 unless empty) is left * step bytes: a step is a fixed, unbounded burst */
    int two;       /* run 1 is not empty */
    int l1;        /* set by the driver: prefetch into L1 (T0) rather than L2 (T1): the call's pf_l1_call (attn.c) */
    int fine;      /* set by the driver: a decode-sized score takes finer shares (PKV__ATTN_DEF_SCORE_ROWS4) */
    /* set by the driver, 0 or not: the prefetch at two levels (pkv__attn's pf_two). Each line of run
     * 0 (the run the driver leads to, some heads on: attn.c, head_io_fill) is fetched with the
     * non-temporal hint (NTA), and the line near bytes on, of the run of the next head the unit
     * computes (this block's, or the next block's first), into L1 (T0): the memory's latency is
     * hidden by the lead, and the lines are in L1 when their head starts, not evicted again by
     * other heads in between. Run 1 goes by l1. NTA rather than T1 for the lead (Zen 5, the one
     * machine that sets pf_two; ab-decode, time NTA / T1): f16 4096 x 16 paged 0.974 at 1 thread
     * and 0.979 at 2, contiguous 0.972 and 0.969, f32 paged 0.873 at 1 thread, contiguous 0.952
     * at 2, bf16 paged 0.968 at 2, f16 32768 x 1 at 2 threads 0.947, q8_0 1.000, and with the
     * K/V in the L3 (256 x 16) 0.996. A decode reads each K/V line once (a block shared by
     * several sequences once a sequence where it is not swept: shared prefixes 0.993 at 1 thread
     * and 1.004 at 2), so a hint that it need not be kept costs nothing measurable; the near
     * line's T0 as NTA measured 0.999 and 0.981 (f16 paged and contiguous at 1 thread): no
     * better. */
    ptrdiff_t near;
} pkv__attn_pf;

/* n bytes of lines from x (n a multiple of 64; a constant where the caller's is): where near is
 * not 0 each with the NTA hint and the line near bytes on into L1 (pkv__attn_pf.near), else into
 * L1 where l1 is set, else into L2. */
static inline __attribute__((always_inline)) void pkv__attn_pf_lines(const uint8_t *x, size_t n, int l1,
                                                                      ptrdiff_t near) {
    if (near)
        for (size_t o = 0; o < n; o += 64) __builtin_prefetch(x + o, 0, 0), __builtin_prefetch(x + o + near, 0, 3);
    else if (l1)
        for (size_t o = 0; o < n; o += 64) __builtin_prefetch(x + o, 0, 3);
    else
        for (size_t o = 0; o < n; o += 64) __builtin_prefetch(x + o, 0, 2);
}

/* always_inline: as plain static inline functions, GCC 12 finds them free of side effects
 * (prefetches do not count), deems the calls dead and drops every prefetch. */
static inline __attribute__((always_inline)) void pkv__attn_pf_start(pkv__attn_pf *pf, uint32_t n) {
    if (!pf) return;
    const size_t a = (size_t)(pf->end[0] - pf->p[0]), b = (size_t)(pf->end[1] - pf->p[1]);
    const size_t lines = ((a > b ? a : b) + 63u) / 64u;
    n = n ? n : 1;
    pf->step = (lines + n - 1) / n * 64u;
    pf->left = n;
    pf->two = b != 0;
    pf->even = (a == b || b == 0) && a == pf->step * n;
}

static inline __attribute__((always_inline)) void pkv__attn_pf_step(pkv__attn_pf *pf) {
    if (!pf) return;
    if (pf->even) { /* the common case (f16 or f32 rows, 16-key blocks): no bounds, 4 lines unrolled */
        if (!pf->left) return;
        pf->left--;
        const uint8_t *x = pf->p[0], *y = pf->p[1];
        if (pf->step == 256) {
            pkv__attn_pf_lines(x, 256, pf->l1, pf->near);
            if (pf->two) pkv__attn_pf_lines(y, 256, pf->l1, 0);
        } else {
            pkv__attn_pf_lines(x, pf->step, pf->l1, pf->near);
            if (pf->two) pkv__attn_pf_lines(y, pf->step, pf->l1, 0);
        }
        pf->p[0] = x + pf->step, pf->p[1] = y + (pf->two ? pf->step : 0);
        return;
    }
    for (int j = 0; j < 2; j++) {
        const uint8_t *e = pf->p[j] + pf->step < pf->end[j] ? pf->p[j] + pf->step : pf->end[j], *x = pf->p[j];
        const ptrdiff_t near = j ? 0 : pf->near;
        for (; x + 3 * 64 < e; x += 4 * 64) /* 4 lines per turn: a third of the loop's instructions */
            pkv__attn_pf_lines(x, 256, pf->l1, near);
        for (; x < e; x += 64) pkv__attn_pf_lines(x, 64, pf->l1, near);
        pf->p[j] = e;
    }
}

/* For a kernel's inner loop of n steps over a one-run pf (run 1 empty): takes the loop's steps out
 * of pf at once, so that the loop keeps no state: returns the first line, sets *step (bytes per
 * step), *n_ok (how many of the n steps are left in the run), *l1 and *near (pf's), and the
 * loop's turn i < *n_ok calls pkv__attn_pf_burst(x + i * *step, *step, *l1, *near). A two-run pf
 * gives *n_ok = 0 and is left to pkv__attn_pf_finish. */
static inline __attribute__((always_inline)) const uint8_t *pkv__attn_pf_take(pkv__attn_pf *pf, uint32_t n,
                                                                               size_t *step, uint32_t *n_ok,
                                                                               int *l1, ptrdiff_t *near) {
    *step = 0, *n_ok = 0, *l1 = 0, *near = 0;
    if (!pf || pf->two || pf->p[0] >= pf->end[0]) return NULL;
    *l1 = pf->l1, *near = pf->near;
    const uint8_t *x = pf->p[0];
    const size_t left = (size_t)(pf->end[0] - x), k = (left + pf->step - 1) / pf->step;
    *step = pf->step;
    *n_ok = k < n ? (uint32_t)k : n;
    pf->p[0] = *n_ok == n ? x + (size_t)n * pf->step : pf->end[0], pf->p[1] = pf->p[0];
    pf->left = pf->left > n ? pf->left - n : 0;
    return x;
}

static inline __attribute__((always_inline)) void pkv__attn_pf_burst(const uint8_t *x, size_t step, int l1,
                                                                      ptrdiff_t near) {
    pkv__attn_pf_lines(x, 64, l1, near);
    if (step > 64) pkv__attn_pf_lines(x + 64, 64, l1, near);
    if (step > 128) pkv__attn_pf_lines(x + 128, step - 128, l1, near);
}

/* Whatever steps were not taken (a kernel whose work had fewer steps than it counted) at once. */
static inline __attribute__((always_inline)) void pkv__attn_pf_finish(pkv__attn_pf *pf) {
    if (!pf) return;
    for (int j = 0; j < 2; j++) {
        for (const uint8_t *x = pf->p[j]; x < pf->end[j]; x += 64) pkv__attn_pf_lines(x, 64, pf->l1, j ? 0 : pf->near);
        pf->p[j] = pf->end[j];
    }
    pf->left = 0;
}

/* score: for r < n_rows, t < n_keys: s[r * s_stride + t] = <prepared row r, K row t>, K row t
 * at k + t * k_row_bytes (k_dtype elements, head_dim of them, scales inline); 1 <= n_keys <=
 * block_tokens (one block's visible keys). Prefetches pf (above) along the way. */
typedef void (*pkv__attn_score_fn)(const void *qp, uint32_t n_rows, const uint8_t *k, size_t k_row_bytes,
                                   uint32_t n_keys, uint32_t head_dim, float *s, uint32_t s_stride,
                                   pkv__attn_pf *pf);
/* accum: for r < n_rows: acc[r * head_dim + d] += sum_{t < n_keys} p[r * p_stride + t] * V[t][d],
 * V row t at v + t * v_row_bytes (d in even-odd order where the table's acc_eo[v_dtype] says
 * so). acc is 64-byte aligned, head_dim floats per row. Prefetches pf (above) along the way
 * where the table's accum_pf[v_dtype] says so; else it is given NULL. */
typedef void (*pkv__attn_accum_fn)(const float *p, uint32_t p_stride, uint32_t n_rows, const uint8_t *v,
                                   size_t v_row_bytes, uint32_t n_keys, uint32_t head_dim, float *acc,
                                   pkv__attn_pf *pf);
/* softmax: one online-softmax step over a block of scores s[r * s_stride + t] (t < n_keys;
 * masked entries are -inf). If softcap > 0 first s = softcap * tanh(s / softcap) for every s that is
 * not -inf (masked keys stay -inf). Then per row:
 * m' = max(m[r], max_t s), or m[r] itself where it is finite and max_t s <= m[r] + 8 (a lazy
 * rescale: p <= e^8; x86); acc row *= exp(m[r] - m') (skipped when m' == m[r]);
 * s[t] = exp(s[t] - m') (0 for -inf); l[r] = l[r] * exp(m[r] - m') + sum_t s[t]; m[r] = m'.
 * A row whose m' is still -inf is left with p = 0 and m, l, acc unchanged. */
typedef void (*pkv__attn_softmax_fn)(float *s, uint32_t s_stride, uint32_t n_rows, uint32_t n_keys, float softcap,
                                     float *m, float *l, float *acc, uint32_t head_dim);

/* The portable primitives' (attn_ref.c, attn_q_ref.c, the tree's paths in cache.c) dot product
 * of f32 rows, in four running sums, so that it does not wait out the add's latency at every
 * element (the compiler may vectorize it; eight sums made the reference 8% slower in decode and
 * 17% in prefill here; the tree's times were the same either way). */
static inline float pkv__ref_dot(const float *a, const float *b, uint32_t n) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    uint32_t d = 0;
    for (; d + 4 <= n; d += 4) {
        s0 += a[d] * b[d];
        s1 += a[d + 1] * b[d + 1];
        s2 += a[d + 2] * b[d + 2];
        s3 += a[d + 3] * b[d + 3];
    }
    for (; d < n; d++) s0 += a[d] * b[d];
    return (s0 + s1) + (s2 + s3);
}

/* The reference primitives decode a K or V row once, PKV__REF_CHUNK values at a time, into a row
 * on the stack, and use it for every query row (one chunk up to head_dim 1024, the cache's limit;
 * the kernels' own limit is 4096). pkv__ref_score_chunk: values [d0, d0 + n) of key t's row, kf,
 * into the n_rows scores of key t (the first chunk sets them, later ones add). */
#define PKV__REF_CHUNK 1024u
static inline void pkv__ref_score_chunk(const void *qp, uint32_t n_rows, uint32_t head_dim, const float *kf,
                                        uint32_t d0, uint32_t n, float *s, uint32_t s_stride, uint32_t t) {
    const size_t qrow = PKV__ATTN_QROW_BYTES(head_dim);
    for (uint32_t r = 0; r < n_rows; r++) {
        const float x = pkv__ref_dot((const float *)((const uint8_t *)qp + r * qrow) + d0, kf, n);
        s[r * s_stride + t] = d0 ? s[r * s_stride + t] + x : x;
    }
}
/* Values [d0, d0 + n) of key t's V row, vf, into the n_rows accumulators with weight p[r][t] x
 * scale; a row of weight 0 is left alone. */
static inline void pkv__ref_accum_chunk(const float *p, uint32_t p_stride, uint32_t n_rows, float scale,
                                        const float *vf, uint32_t d0, uint32_t n, float *acc, uint32_t head_dim,
                                        uint32_t t) {
    for (uint32_t r = 0; r < n_rows; r++) {
        const float w = p[r * p_stride + t] * scale;
        if (w == 0.0f) continue;
        float *a = acc + (size_t)r * head_dim + d0;
        for (uint32_t d = 0; d < n; d++) a[d] += w * vf[d];
    }
}

/* The end of one row's softmax step, common to every backend: with the block's max folded in
 * (mnew >= *m) and sum = the row's new exp(s - mnew) total, rescale the row's acc, l and m
 * when the max moved, then add sum. The multiply loop is left to the compiler's vectorizer
 * (each backend file is compiled for its own ISA). */
static inline void pkv__attn_softmax_commit(float *m, float *l, float *acc_row, uint32_t head_dim, float mnew,
                                            float sum) {
    if (mnew != *m) {
        const float f = *m == -INFINITY ? 0.0f : expf(*m - mnew);
        for (uint32_t d = 0; d < head_dim; d++) acc_row[d] *= f;
        *l *= f;
        *m = mnew;
    }
    *l += sum;
}

/* ---- drivers shared by the SIMD backends (ISA-free; each file instantiates them per dtype T) ----
 * PKV__ATTN_DEF_SCORE_ROWS4(T) needs score_tile_##T(q, qs, k, krb, R, K, D, s, ss, pf, sub): R <= 4
 * rows x K <= 4 keys, and PKV__ATTN_PF_SUB_##T and PKV__ATTN_PF_SUB_FINE_##T, the prefetch
 * shares per tile (constants). It defines score_rows_##T (a row group over the block's keys, 4
 * at a time) and the table entry score_##T (row groups of 4, then single rows). The prefetch goes
 * in sub shares per tile of the row groups, the first single row standing for the group of
 * leftover rows: the tile issues sub - 1 of them spread over its head_dim steps (a tile may
 * ignore pf when sub is 1), the driver the last one after it. A decode block of 16 keys for 4
 * rows gets 4 x sub shares, not one burst (at head_dim 128 and sub 1, 16 lines of each of the K
 * and V runs per share for f16, 32 for f32). sub is PKV__ATTN_PF_SUB_##T, or the FINE one where
 * pf->fine is set, the score has at most 4 rows (a decode head's, at up to 4 query heads a kv
 * head) and head_dim is 128: on Zen 5 finer shares paid from memory at 2 threads, and cost in
 * cache and in prefill's many rows (src/attn/attn.c, pf_fine). It also needs
 * PKV__ATTN_SCORE_RUN(T, q, qs, k, krb, R, n_keys, D, s, ss, pf, sub): a backend's own walk over
 * the row group's first keys, giving how many it scored (0: none; the tiles do the rest),
 * taking the prefetch steps the tiles would have taken for them.
 * PKV__ATTN_DEF_ACCUM_ROWS(T) needs accum_rows_##T(p, ps, R, v, vrb, n_keys, D, acc, pf), which
 * takes one step of pf per key in each of its PKV__ATTN_ACCUM_TILES(D) column tiles (a backend
 * whose accum does not prefetch defines that as 0 and ignores pf), and defines the table entry
 * accum_##T: row groups of 4, then single rows, with an instance for head_dim 128 (constant
 * offsets). */
#define PKV__ATTN_DEF_SCORE_ROWS4(T)                                                                           \
    static inline __attribute__((always_inline)) void score_rows_##T(const float *q, size_t qs, const uint8_t *k, \
                                                                     size_t krb, const uint32_t R, uint32_t n_keys, \
                                                                     uint32_t D, float *s, uint32_t ss,         \
                                                                     pkv__attn_pf *pf, const uint32_t sub) {    \
        uint32_t t = PKV__ATTN_SCORE_RUN(T, q, qs, k, krb, R, n_keys, D, s, ss, pf, sub);                       \
        for (; t + 4 <= n_keys; t += 4) {                                                                       \
            score_tile_##T(q, qs, k + t * krb, krb, R, 4, D, s + t, ss, pf, sub);                               \
            pkv__attn_pf_step(pf);                                                                              \
        }                                                                                                       \
        switch (n_keys - t) {                                                                                   \
        case 3: score_tile_##T(q, qs, k + t * krb, krb, R, 3, D, s + t, ss, pf, sub); break;                    \
        case 2: score_tile_##T(q, qs, k + t * krb, krb, R, 2, D, s + t, ss, pf, sub); break;                    \
        case 1: score_tile_##T(q, qs, k + t * krb, krb, R, 1, D, s + t, ss, pf, sub); break;                    \
        default: return;                                                                                        \
        }                                                                                                       \
        pkv__attn_pf_step(pf);                                                                                  \
    }                                                                                                           \
    static inline __attribute__((always_inline)) void score_all_##T(const void *qp, uint32_t n_rows,            \
                                                                    const uint8_t *k, size_t krb, uint32_t n_keys, \
                                                                    uint32_t D, float *s, uint32_t ss,          \
                                                                    pkv__attn_pf *pf, const uint32_t sub) {     \
        const size_t qs = PKV__ATTN_QROW_BYTES(D) / sizeof(float);                                              \
        const float *q = qp;                                                                                    \
        uint32_t r = 0;                                                                                         \
        pkv__attn_pf_start(pf, (n_keys + 3) / 4 * ((n_rows + 3) / 4) * sub); /* sub per tile */                 \
        for (; r + 4 <= n_rows; r += 4)                                                                         \
            score_rows_##T(q + r * qs, qs, k, krb, 4, n_keys, D, s + r * ss, ss, pf, sub);                      \
        for (uint32_t r0 = r; r < n_rows; r++)                                                                  \
            score_rows_##T(q + r * qs, qs, k, krb, 1, n_keys, D, s + r * ss, ss, r == r0 ? pf : NULL, sub);     \
    }                                                                                                           \
    static void score_##T(const void *qp, uint32_t n_rows, const uint8_t *k, size_t krb, uint32_t n_keys,       \
                          uint32_t D, float *s, uint32_t ss, pkv__attn_pf *pf) {                                \
        const int fine = PKV__ATTN_PF_SUB_FINE_##T != PKV__ATTN_PF_SUB_##T && pf && pf->fine && n_rows <= 4;  \
        if (D == 128 && fine) /* a decode head's rows: finer shares where pf asks for them */                 \
            score_all_##T(qp, n_rows, k, krb, n_keys, 128, s, ss, pf, PKV__ATTN_PF_SUB_FINE_##T);               \
        else if (D == 128) /* the common head_dim, with constant trip counts */                                 \
            score_all_##T(qp, n_rows, k, krb, n_keys, 128, s, ss, pf, PKV__ATTN_PF_SUB_##T);                    \
        else                                                                                                    \
            score_all_##T(qp, n_rows, k, krb, n_keys, D, s, ss, pf, PKV__ATTN_PF_SUB_##T);                      \
    }

#define PKV__ATTN_DEF_ACCUM_ROWS(T)                                                                            \
    static void accum_##T(const float *p, uint32_t ps, uint32_t n_rows, const uint8_t *v, size_t vrb,           \
                          uint32_t n_keys, uint32_t D, float *acc, pkv__attn_pf *pf) {                          \
        uint32_t r = 0;                                                                                         \
        pkv__attn_pf_start(pf, (n_rows / 4 + n_rows % 4) * n_keys * PKV__ATTN_ACCUM_TILES(D));                \
        if (D == 128)                                                                                           \
            for (; r + 4 <= n_rows; r += 4)                                                                     \
                accum_rows_##T(p + r * ps, ps, 4, v, vrb, n_keys, 128, acc + (size_t)r * 128, pf);              \
        for (; r + 4 <= n_rows; r += 4) accum_rows_##T(p + r * ps, ps, 4, v, vrb, n_keys, D, acc + (size_t)r * D, pf); \
        for (; r < n_rows; r++) accum_rows_##T(p + r * ps, ps, 1, v, vrb, n_keys, D, acc + (size_t)r * D, pf);  \
        pkv__attn_pf_finish(pf);                                                                                \
    }

/* ---- the transposed ("prefill") primitives: optional, for units of many query rows ----------
 * A work unit of at least PKV__ATTN_T_MIN_ROWS rows a kv head (prefill tiles; decode where a kv
 * head has that many query heads) may run its blocks through these instead of score, softmax and
 * accum: the scores of a block are kept as s[t * rp + r] (a key's row of rp lanes, rp = the rows
 * rounded up to 16), so that score is a plain outer product of a K row by the queries, transposed
 * once a unit (qt[d * rp + r], pad rows 0), with no horizontal sums, and softmax works on 16 rows
 * at a time down the keys. K and V of a 16-bit or fp8 dtype are widened to f32 once a block
 * (kbuf, vbuf: each room for PKV__ATTN_T_KEYS rows of head_dim floats, which a backend fills with
 * whole rows or with parts of rows (x86: tpath_x86.h's TP_DC columns), in the order its prep_q
 * and acc use; fp8 V with each row's scale, fp8 K without, its scores scaled after the sums), not
 * once per row group. A backend fills all three (and the float prep_q) or none; for a
 * K dtype with score_t and not qt_pairs, prep_q (prep_q_t where set) must give plain f32 rows (q
 * times scale, in the order the widened K uses), since the driver transposes them as floats.
 * score_t: for t < n_keys, r < rp: s[t * rp + r] = <qt column r, K row t>, K row t at
 * k + t * k_row_bytes; prefetches pf (the next block's K run) along the way. */
#define PKV__ATTN_T_MIN_ROWS 16u
/* kbuf and vbuf hold this many rows: a block of more keys is widened and used this many keys at a time. */
#define PKV__ATTN_T_KEYS 16u
typedef void (*pkv__attn_score_t_fn)(const float *qt, uint32_t rp, const uint8_t *k, size_t k_row_bytes,
                                     uint32_t n_keys, uint32_t head_dim, float *s, float *kbuf, pkv__attn_pf *pf);
/* softmax_t: softmax's step (above) for rows r < n_rows of s[t * rp + r]; m, l, acc by row as there. */
typedef void (*pkv__attn_softmax_t_fn)(float *s, uint32_t rp, uint32_t n_rows, uint32_t n_keys, float softcap,
                                       float *m, float *l, float *acc, uint32_t head_dim);
/* accum_t: for r < n_rows: acc[r * head_dim + d] += sum_{t < n_keys} p[t * rp + r] * V[t][d] (acc's
 * order as accum's); prefetches pf (the next block's V run). */
typedef void (*pkv__attn_accum_t_fn)(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v,
                                     size_t v_row_bytes, uint32_t n_keys, uint32_t head_dim, float *acc, float *vbuf,
                                     pkv__attn_pf *pf);

/* accum_tn: accum_t over the keys of several blocks at once: run i is n[i] V rows at v[i] (1 <=
 * n[i] <= 16, i < n_runs <= PKV__ATTN_T_RUNS, at most PKV__ATTN_T_RUN_KEYS keys in all), their
 * weights p[t * rp + r] in the runs' order; vbuf has room for PKV__ATTN_T_RUN_KEYS / 2 rows of
 * head_dim floats; prefetches pf (the run after the last). Where the table has it, the driver
 * takes a unit's blocks of at most 16 visible keys that many at a time (score_t a block at a
 * time into s's rows, softmax_t over them all): AMX, whose tiles of acc are then loaded and
 * stored once for up to 32 keys, not once a block (64 measured slower: docs/design.md, stop 86). */
#define PKV__ATTN_T_RUNS 8u
#define PKV__ATTN_T_RUN_KEYS 32u
typedef void (*pkv__attn_accum_tn_fn)(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *const *v,
                                      const uint32_t *n, uint32_t n_runs, size_t v_row_bytes, uint32_t head_dim,
                                      float *acc, float *vbuf, pkv__attn_pf *pf);

typedef struct pkv__attn_kernels {
    const char *name;
    pkv__attn_prep_fn prep_q[PKV_DTYPE_COUNT];  /* by k_dtype */
    pkv__attn_score_fn score[PKV_DTYPE_COUNT];  /* by k_dtype */
    pkv__attn_accum_fn accum[PKV_DTYPE_COUNT];  /* by v_dtype */
    pkv__attn_softmax_fn softmax;
    bool accum_pf[PKV_DTYPE_COUNT]; /* by v_dtype: accum prefetches the next V run (pf), not score */
    bool acc_eo[PKV_DTYPE_COUNT];   /* by v_dtype: accum keeps acc in even-odd order (below) */
    pkv__attn_score_t_fn score_t[PKV_DTYPE_COUNT]; /* by k_dtype; NULL: the row path (above) */
    pkv__attn_accum_t_fn accum_t[PKV_DTYPE_COUNT]; /* by v_dtype */
    pkv__attn_softmax_t_fn softmax_t;
    pkv__attn_accum_tn_fn accum_tn[PKV_DTYPE_COUNT]; /* by v_dtype; NULL: a block at a time */
    /* the table of calls with PKV_ATTN_BF16_DOT (pkv.h): applied to a copy of this one, it puts
     * in place the kernels that compute at the K and V dtypes' own precision, faster (acc in
     * accum's order as ever; for a K dtype whose prep_q it replaces, score and score_t to match,
     * with qt_pairs as the new score_t reads); NULL: such calls take this table */
    void (*lp_fill)(struct pkv__attn_kernels *kt);
    /* the table of calls with PKV_ATTN_F16_AS_BF16 (pkv.h), applied to a copy of this one and of
     * lp_fill's: transposed primitives that take f16 K and V as bf16 (qt_round); NULL: such
     * calls take the table they would without the flag */
    void (*f16_fill)(struct pkv__attn_kernels *kt);
    /* by k_dtype: score_t takes qt as 32-bit pairs of the prepared rows (prep_q's own 16-bit
     * values, or prep_q_t's where set): lane r of pair i at qt + i * rp holds row r's values 2 i and 2 i + 1, pairs
     * i < (head_dim + 1) / 2; else qt is f32 [head_dim][rp] */
    bool qt_pairs[PKV_DTYPE_COUNT];
    /* by k_dtype: the prep_q of units that run the transposed path, where it differs from the
     * row path's (AMX's q8_0 and q4_0 K: plain f32 rows for qt_round, not int8); NULL: prep_q */
    pkv__attn_prep_fn prep_q_t[PKV_DTYPE_COUNT];
    /* by k_dtype, where head_dim is a multiple of 32 and qt_pairs is not set: score_t takes qt as
     * qt_pairs' layout of the prepared f32 rows rounded to bf16 (nearest even), which the driver
     * writes; elsewhere qt is f32 as above (pkv__attn_qt_round) */
    bool qt_round[PKV_DTYPE_COUNT];
    /* NULL, or called by the driver on the thread that runs a unit's blocks through score_t and
     * accum_t where K or V is of a dtype of t_dtypes: t_enter before the first, t_leave after the last (AMX: the tile configuration,
     * loaded once a unit, and released, so that no tile state outlives the unit) */
    void (*t_enter)(void);
    void (*t_leave)(void);
    uint32_t t_dtypes; /* bit d set: the K or V dtype d's transposed primitives need t_enter
                          where they run tiles (head_dim, v_dim a multiple of 32: else the
                          driver calls no hook) */
} pkv__attn_kernels;

/* Whether score_t of table kt takes qt rounded to bf16 pairs (qt_round) for K dtype k at head_dim D. */
static inline bool pkv__attn_qt_round(const pkv__attn_kernels *kt, pkv_dtype k, uint32_t D) {
    return kt->qt_round[k] && !kt->qt_pairs[k] && D % 32 == 0;
}

/* Even-odd order (the AVX-512 bf16 kernels): each full group of 32 of a row's head_dim values,
 * [32 g, 32 g + 32) with 32 g + 32 <= head_dim, holds the group's 16 even-indexed values, then its
 * 16 odd ones; the values past the last full group stay in place. One 64-byte load of 32 bf16
 * then widens to two f32 vectors by a shift and a mask, with no shuffle. Where the backend keeps
 * acc in that order (acc_eo), its prep_q writes the bf16 queries in it too, softmax and the
 * merges work on acc lane by lane as ever, and the driver restores the order as it writes the
 * output (pkv__attn_unshuffle_eo). */

/* dst[d] = scale * (the value of column d) for a row src in even-odd order, a group at a time:
 * with an index computed per value (and its branch) here and in the queries' copy, a bf16
 * decode of 512-1024 tokens in cache took 5% longer (scripts/ab-decode.sh, stop 29). */
static inline void pkv__attn_unshuffle_eo(float *dst, const float *src, uint32_t head_dim, float scale) {
    const uint32_t D32 = head_dim & ~31u;
    uint32_t d = 0;
    for (; d < D32; d += 32)
        for (uint32_t i = 0; i < 16; i++) {
            dst[d + 2 * i] = src[d + i] * scale;
            dst[d + 2 * i + 1] = src[d + 16 + i] * scale;
        }
    for (; d < head_dim; d++) dst[d] = src[d] * scale;
}

/* ---- fillers: each sets the entries its file implements (one per backend x dtype family) -- */
void pkv__attn_fill_ref(pkv__attn_kernels *kt);     /* attn_ref.c: f32, f16, bf16 + softmax */
void pkv__attn_fill_avx2(pkv__attn_kernels *kt);    /* x86/attn_avx2.c */
void pkv__attn_fill_avx512(pkv__attn_kernels *kt);  /* x86/attn_avx512.c */
void pkv__attn_fill_avx512_emu(pkv__attn_kernels *kt); /* the same, built for tests on AVX2 */
void pkv__attn_fill_neon(pkv__attn_kernels *kt);    /* arm/attn_neon.c */
void pkv__attn_fill_q_ref(pkv__attn_kernels *kt);   /* attn_q_ref.c: q8_0, q4_0, fp8_e4m3 */
void pkv__attn_fill_q_avx2(pkv__attn_kernels *kt);  /* x86/attn_q_avx2.c: q8_0, q4_0, fp8_e4m3 */
void pkv__attn_fill_q_avx512(pkv__attn_kernels *kt); /* x86/attn_q_avx512.c: fp8_e4m3 (over the AVX2 fill) */
/* x86/attn_q_avx512.c: q8_0, q4_0 accum at 512 bits, for cores with full-width 512-bit units */
void pkv__attn_fill_q_avx512_wide(pkv__attn_kernels *kt);
void pkv__attn_fill_q_vnni(pkv__attn_kernels *kt);   /* x86/attn_q_vnni.c: q8_0, q4_0 prep and score (VNNI) */
/* x86/attn_q_vnni.c: the same over 16 keys transposed, for full-width 512-bit units (not Zen 4) */
void pkv__attn_fill_q_vnni_wide(pkv__attn_kernels *kt);
/* x86/attn_q_avxvnni.c: the 4-key VNNI score with AVX-VNNI (VEX), over the avx2 table */
void pkv__attn_fill_q_avxvnni(pkv__attn_kernels *kt);
void pkv__attn_fill_q_neon(pkv__attn_kernels *kt);  /* arm/attn_q_neon.c: q8_0, q4_0, fp8_e4m3 */
void pkv__attn_fill_q_dotprod(pkv__attn_kernels *kt); /* arm/attn_q_dotprod.c: q8_0, q4_0 score (SDOT) */
/* x86/attn_avx512.c: its lp_fill (bf16 K and V by vdpbf16ps) and the transposed primitives of
 * that table, for attn_amx.c to fill over and to hand the shapes its tiles do not cover */
void pkv__attn_lp_fill_bf16dp(pkv__attn_kernels *kt);
/* the same file: pkv__attn_lp_fill_bf16dp's table with its bf16 row path (prep_q, score, accum) on
 * f32 FMAs over the rounded queries, the transposed path's queries prepared as before (prep_q_t) */
void pkv__attn_lp_rows_f32(pkv__attn_kernels *kt);
void pkv__attn_score_t_bf16dp(const float *qt, uint32_t rp, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                              uint32_t head_dim, float *s, float *kbuf, pkv__attn_pf *pf);
void pkv__attn_accum_t_bf16dp(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                              uint32_t n_keys, uint32_t head_dim, float *acc, float *vbuf, pkv__attn_pf *pf);
/* x86/attn_amx.c (where the build has AMX: PKV_HAVE_AMX): the lp_fill of backend "avx512-amx",
 * pkv__attn_lp_fill_bf16dp's table with its bf16 row path on f32 FMAs (pkv__attn_lp_rows_f32) and
 * the transposed primitives on AMX tiles */
void pkv__attn_lp_fill_amx(pkv__attn_kernels *kt);
/* x86/attn_amx.c: the f16_fill of backend "avx512-amx" (PKV_ATTN_F16_AS_BF16): f16 K and V
 * taken as bf16 by the transposed primitives on AMX tiles */
void pkv__attn_f16_fill_amx(pkv__attn_kernels *kt);
/* tests/amx_emu.c: the two with the tile instructions emulated in C (x86/amx_emu.h), for
 * test_attn's "avx512-amx-emu" on CPUs with AVX-512 BF16 and no AMX */
void pkv__attn_lp_fill_amx_emu(pkv__attn_kernels *kt);
void pkv__attn_f16_fill_amx_emu(pkv__attn_kernels *kt);
/* x86/attn_avx512.c: its transposed f16 primitives (f32 arithmetic), for attn_amx.c's f16
 * kernels to hand the shapes its tiles do not cover */
void pkv__attn_score_t_f16_x512(const float *qt, uint32_t rp, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                                uint32_t head_dim, float *s, float *kbuf, pkv__attn_pf *pf);
void pkv__attn_accum_t_f16_x512(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                                uint32_t n_keys, uint32_t head_dim, float *acc, float *vbuf, pkv__attn_pf *pf);
/* x86/attn_avx512.c: its transposed fp8 e4m3 primitives (f32 arithmetic, tpath_x86.h), for
 * attn_amx.c's fp8 kernels to hand the shapes its tiles do not cover */
void pkv__attn_score_t_fp8_x512(const float *qt, uint32_t rp, const uint8_t *k, size_t k_row_bytes, uint32_t n_keys,
                                uint32_t head_dim, float *s, float *kbuf, pkv__attn_pf *pf);
void pkv__attn_accum_t_fp8_x512(const float *p, uint32_t rp, uint32_t n_rows, const uint8_t *v, size_t v_row_bytes,
                                uint32_t n_keys, uint32_t head_dim, float *acc, float *vbuf, pkv__attn_pf *pf);
/* arm/attn_bf16dot.c: the lp_fill of NEON where the CPU has bf16 (BFDOT): bf16 prep_q, score, accum */
void pkv__attn_lp_fill_neon_bf16(pkv__attn_kernels *kt);

#endif
