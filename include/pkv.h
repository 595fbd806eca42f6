/* pkv.h: the one public header of pagedkv (libpkv): a paged KV cache and paged attention for
 * LLM inference engines. C99/C++ clean. Every fallible function returns int: 0 on success, a
 * negative PKV_E* code on error (pkv_strerror names it). A call that fails changes no state of
 * the cache (what it writes to its outputs then is said where it writes any).
 *
 * Words (docs/design.md has the full glossary):
 *   block        block_tokens consecutive token slots; the unit of allocation, sharing, hashing.
 *   slot         block_id * block_tokens + offset: where one token position lives in the pool.
 *   sequence     one stream of token positions with its block table (logical block -> block id).
 *   committed    positions whose K/V are written for every layer; only committed full blocks
 *                enter the prefix index.
 *   cached block refcount 0 but still in the prefix index; evictable (LRU, leaves first).
 *
 * Threads: one cache may be used from many threads at once. Calls on different sequences may
 * overlap freely. Calls that only read a sequence may overlap one another on the same sequence:
 * pkv_attn_* (they read every sequence of the batch), pkv_seq_gather, pkv_seq_read_stored,
 * pkv_seq_get_info, pkv_seq_slots, pkv_seq_block_table, pkv_export_*, and pkv_seq_fork and
 * pkv_pin_create, which read their source. A call that changes a sequence (append, commit,
 * truncate, drop_front, compact, release, a prefix match into it, a pkv_batch_compact or pkv_batch_append
 * that names it) must not overlap any other call that names or reads that sequence.
 * pkv_write_kv, pkv_seq_write_kv and pkv_seq_write_stored may overlap reads of other layers or
 * other positions (layer l + 1 of a new token while attention reads layer l), not a read of the
 * rows they write, nor a pkv_seq_fork or pkv_pin_create of a sequence holding those rows (the
 * fork would share rows being written); the two by position read their sequence's table, so
 * they must not overlap a call that changes that sequence. Metadata calls
 * take the cache's lock for a short critical section; the writes copy without it; attention
 * calls are serialized among themselves (they share the cache's threads and scratch), so
 * attention from several threads at once is no faster than one after the other.
 * pkv_cache_destroy comes after every other call has returned. The hooks (log, allocator,
 * executor) are called from C: they must not throw or longjmp out.
 * fork(): a child process may go on using a cache it inherited, and destroy it, provided no
 * call on that cache was running in the parent when it forked (a lock held then stays held in
 * the child). The cache's threads are not in the child: its attention runs on the calling
 * thread alone there, with the same results. (A caller's executor is the caller's to handle.)
 */
#ifndef PKV_H
#define PKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PKV_VERSION_MAJOR 0
#define PKV_VERSION_MINOR 1
#define PKV_VERSION_PATCH 0
#define PKV_VERSION_STRING "0.1.0"
#define PKV_VERSION_NUMBER (PKV_VERSION_MAJOR * 10000 + PKV_VERSION_MINOR * 100 + PKV_VERSION_PATCH)

#if defined(_WIN32) && defined(PKV_SHARED_BUILD)
#define PKV_API __declspec(dllexport)
#elif defined(__GNUC__)
#define PKV_API __attribute__((visibility("default")))
#else
#define PKV_API
#endif

/* Statuses are meant to be checked: compilers warn where one is dropped. In C++17 and later
 * PKV_NODISCARD is [[nodiscard]], which a (void) cast silences; elsewhere (C, older C++) with GCC
 * and Clang it is warn_unused_result, which GCC does not let a (void) cast silence: define it empty
 * before including pkv.h to turn it off (e.g. for cleanup paths under -Werror). It comes first
 * in each declaration, so a definition of your own may be a standard attribute. */
#ifndef PKV_NODISCARD
#if defined(__cplusplus) && (__cplusplus >= 201703L || (defined(_MSVC_LANG) && _MSVC_LANG >= 201703L))
#define PKV_NODISCARD [[nodiscard]]
#elif defined(__GNUC__)
#define PKV_NODISCARD __attribute__((warn_unused_result))
#else
#define PKV_NODISCARD
#endif
#endif

/* ---- status codes: values never change once released ------------------------------------ */
enum {
    PKV_OK = 0,
    PKV_EINVAL = -1,   /* bad argument: NULL, shape/dtype mismatch, slot/layer/position out of range */
    PKV_ENOMEM = -2,   /* host allocation failed (the allocator hook returned NULL) */
    PKV_ENOSPC = -3,   /* no block available, even after evicting every cached block */
    PKV_ENOENT = -4,   /* unknown or stale sequence id */
    PKV_ELIMIT = -5,   /* max_seqs or max_blocks_per_seq would be exceeded */
    PKV_ECORRUPT = -6, /* the checker found a broken invariant */
    PKV_EIO = -7,      /* I/O error: a storage tier's put failed (pkv_tier_save) */
    PKV_ENOTSUP = -8,  /* valid request this build or configuration does not support */
    PKV_EBUSY = -9     /* the object is in use (e.g. a block shared with another sequence) */
};

/* Static, thread-safe description of a status code; never NULL. */
PKV_API const char *pkv_strerror(int rc);
/* "MAJOR.MINOR.PATCH" of the library actually linked. */
PKV_API const char *pkv_version(void);

/* ---- element formats --------------------------------------------------------------------- */
typedef enum pkv_dtype {
    PKV_DTYPE_F32 = 0,
    PKV_DTYPE_F16 = 1,      /* IEEE binary16 */
    PKV_DTYPE_BF16 = 2,     /* bfloat16, round to nearest even */
    PKV_DTYPE_Q8_0 = 3,     /* per 32 values along head_dim: f16 scale + 32 x int8 (34 bytes) */
    PKV_DTYPE_Q4_0 = 4,     /* per 32 values along head_dim: f16 scale + 16 bytes of nibbles (18 bytes) */
    PKV_DTYPE_FP8_E4M3 = 5, /* per (token, kv head) row: f32 scale, then head_dim e4m3 bytes */
    PKV_DTYPE_COUNT
} pkv_dtype;

/* Bytes one token row of `head_dim` elements takes in the pool in this dtype (including its
 * scales), or 0 if the dtype cannot hold such a row (q8_0/q4_0 need head_dim % 32 == 0). */
PKV_API size_t pkv_dtype_row_bytes(pkv_dtype dtype, uint32_t head_dim);
/* "f32", "f16", "bf16", "q8_0", "q4_0", "fp8_e4m3"; NULL for an unknown value. */
PKV_API const char *pkv_dtype_name(pkv_dtype dtype);
/* Parses the names above, and "fp8" for fp8_e4m3; PKV_EINVAL if unknown. */
PKV_NODISCARD PKV_API int pkv_dtype_from_name(const char *name, pkv_dtype *out);

/* ---- hooks --------------------------------------------------------------------------------- */
/* Allocator hook (zstd customMem style). alloc returns memory aligned to `align` (a power of
 * two, >= sizeof(void*)) or NULL; free receives the pointer and the size it was asked for.
 * alloc == NULL selects the default (aligned_alloc/free). The library calls it only in
 * pkv_cache_create, never on the hot path. */
typedef struct pkv_allocator {
    void *(*alloc)(void *ctx, size_t size, size_t align);
    void (*free)(void *ctx, void *ptr, size_t size);
    void *ctx;
} pkv_allocator;

enum { PKV_LOG_ERROR = 0, PKV_LOG_WARN = 1, PKV_LOG_INFO = 2, PKV_LOG_DEBUG = 3 };
/* Log hook: the library never prints; it reports through this (NULL = silent). When a call on
 * a cache refuses (any status but PKV_OK), the hook gets one PKV_LOG_ERROR message saying why
 * first, on the calling thread, before the call returns: "pkv_write_kv: slot 17 (row 3) is a
 * committed position: read-only". Not said: the sizing answers of pkv_seq_block_table and
 * pkv_export_csr (a capacity too small, with the size needed), and calls without a cache (no
 * hook to say it to: a NULL cache, pkv_attn_merge, pkv_dtype_from_name). The hook may run with
 * the cache's lock held: it must not call libpkv on that cache. */
typedef void (*pkv_log_fn)(void *ctx, int level, const char *msg);

/* Executor hook: attention run on the caller's threads (an engine's own pool, an OpenMP team)
 * instead of threads the cache creates. An attention call splits its work into jobs; for each
 * job the library calls parallel_for(ctx, fn, job, n) once, from the thread that made the
 * attention call, and parallel_for must:
 * - call fn(job, i, worker) once for every i in [0, n), on any threads, the calling one
 *   included, in any order;
 * - give calls that run at the same time different worker indexes in [0, n_workers) (the index
 *   names the scratch memory the call uses; calls one after the other may share one);
 * - return only after every call it made has returned.
 * A serial loop on the calling thread (worker 0) meets this. fn never blocks on other calls
 * and never calls the executor again. Results do not depend on which thread or worker runs
 * which call: they are the same, bit for bit, as with n_workers threads of the cache's own.
 * An attention call whose executor breaks the contract in a way the library sees (a worker
 * index out of range or in use by a running call, or tasks still unrun when parallel_for
 * returns) returns PKV_EINVAL, its output unspecified. Each call runs tasks until none is
 * left, so an executor that makes fewer than n calls but at least one still completes the job
 * (with the same bits); only one that makes none is seen. Small calls run on the calling
 * thread without the executor. */
typedef void (*pkv_task_fn)(void *job, uint32_t i, uint32_t worker);
typedef struct pkv_executor {
    void (*parallel_for)(void *ctx, pkv_task_fn fn, void *job, uint32_t n); /* NULL: own threads */
    void *ctx;
    uint32_t n_workers; /* 1..256 with parallel_for; 0 without */
} pkv_executor;

/* ---- configuration --------------------------------------------------------------------------- */
typedef struct pkv_config {
    uint32_t n_layers;           /* 1..4096 */
    uint32_t n_kv_heads;         /* 1..4096 */
    uint32_t head_dim;           /* 1..1024 (multiple of 32 for q8_0 / q4_0) */
    uint32_t block_tokens;       /* B, token slots per block, 1..1024; default 16 */
    uint32_t n_blocks;           /* pool size in blocks, n_blocks x block_tokens under 2^31 (slots
                                    are int32); 0 = derive from mem_budget_bytes */
    uint64_t mem_budget_bytes;   /* K/V bytes for the pool when n_blocks == 0 (the K-V gap of
                                    pkv_layout comes on top: under 2 MiB per layer); a budget
                                    past 2^31 - 1 slots gives the pool of that many slots */
    pkv_dtype k_dtype;           /* pool element format of K (default f16) */
    pkv_dtype v_dtype;           /* pool element format of V (default f16) */
    uint32_t max_seqs;           /* live sequences (pins included) at once, 1..2^24; default 256 */
    uint32_t max_blocks_per_seq; /* block-table capacity; 0 = min(n_blocks, 4096); max_seqs x
                                    max_blocks_per_seq at most 2^34 */
    uint32_t n_threads;          /* attention worker threads incl. the caller, at most 256;
                                    0 = all online cpus (at most 256), or the executor's.
                                    Each thread past the first adds its scratch to meta_bytes
                                    (1.9 MiB at head_dim 128 with 8 kv heads: the kernels'
                                    buffers, 76 KiB of it pkv_attn_tree's) */
    int enable_prefix_cache;     /* 1 (default): full committed blocks are indexed and reused */
    int huge_pages;              /* 1 (default): madvise(MADV_HUGEPAGE) the pool where possible;
                                    0: a pool the default allocator made gets MADV_NOHUGEPAGE */
    pkv_allocator allocator;     /* alloc == NULL: default allocator */
    pkv_log_fn log;              /* NULL: silent */
    void *log_ctx;
    pkv_executor executor;       /* parallel_for NULL (default): the cache starts n_threads - 1
                                    threads of its own; else it starts none and runs attention
                                    on the executor's n_workers (n_threads 0 or n_workers) */
    uint32_t event_capacity;     /* prefix-index events kept for pkv_cache_take_events, at most
                                    2^24; 0 (default): none recorded */
    uint32_t v_dim;              /* 0 (default): V has rows of its own, head_dim values of v_dtype.
                                    1..head_dim: V lives in K (multi-head latent attention, MLA:
                                    DeepSeek-V2 / V3, Kimi K2): the pool holds K rows only, and a
                                    token's V is the first v_dim values of its K row. For MLA a
                                    K row is [c_kv | k_pe]: head_dim = kv_lora_rank +
                                    qk_rope_head_dim (512 + 64), v_dim = kv_lora_rank, one kv
                                    head, queries with W_UK absorbed, outputs before W_UV.
                                    v_dtype must then equal k_dtype (q8_0 / q4_0: v_dim a multiple
                                    of 32); writes and reads of V rows (a v or v_out that is not
                                    NULL) are PKV_EINVAL, and attention's outputs are
                                    [n][n_q_heads][v_dim] (pkv_attn_decode). See "MLA" below. */
    uint32_t spin_us;            /* how long the cache's own attention threads poll for the next
                                    call once one is over before they sleep, in microseconds,
                                    at most 1000000; default 50, 0 = sleep as soon as the call
                                    is over. A sleeping thread must be woken by the next call,
                                    and where its core sat idle meanwhile that wake-up took a
                                    few hundred microseconds on a VM (docs/design.md, stop 97).
                                    An engine whose attention calls come further apart than
                                    50 us with its other cores idle between them (single-
                                    threaded work between layers) gains by setting it past that
                                    gap; a polling thread holds its core, so one whose own
                                    threads are busy then loses. Within a call, a thread that
                                    ran out of work (the caller included) polls for the others
                                    for as long as it worked, at least 50 us and spin_us, at
                                    most 2 ms, then sleeps. Time a polling thread was not
                                    running (preempted) does not count. Unused with an
                                    executor. */
} pkv_config;

/* Defaults: 1 layer, 8 kv heads, head_dim 128, B = 16, 1024 blocks, f16/f16, 256 sequences,
 * prefix cache on, huge pages on, all cpus, threads polling 50 us after a call. Fields are only
 * ever appended. Start a config from this, not from zeros: a zeroed pkv_config is refused
 * (block_tokens and max_seqs 0). */
PKV_API pkv_config pkv_config_default(void);

typedef struct pkv_cache pkv_cache;

/* Sequence handle: (generation << 32) | index. 0 is never a valid id. A released id is
 * stale forever (its slot's generation moves on): using it returns PKV_ENOENT. A slot whose
 * 2^32 - 1 generations are used up is retired, not wrapped: it no longer counts in max_seqs
 * (billions of create / release cycles of one slot). Each cache of a process starts its
 * generations far from the others' (about 2^32 / 3n apart for n caches), so a handle passed to
 * the wrong cache returns PKV_ENOENT too, unless one of that cache's slots has gone through that
 * many create / release cycles: a check that catches the mistake, not a guarantee. */
typedef uint64_t pkv_seq;
#ifdef __cplusplus
#define PKV_SEQ_NONE (static_cast<pkv_seq>(0))
#else
#define PKV_SEQ_NONE ((pkv_seq)0)
#endif

/* Creates a cache: allocates the whole pool, the metadata and the attention thread pool now;
 * nothing is allocated later. PKV_EINVAL for a bad config, PKV_ENOMEM, PKV_ENOTSUP (e.g. a
 * PKV_ATTN_BACKEND this CPU or build lacks: see pkv_attn_backend). When it refuses, it says why
 * through cfg->log at PKV_LOG_ERROR first, one message naming the field or variable and its
 * value (e.g. "pkv_cache_create: k_dtype q8_0 needs head_dim a multiple of 32, not 48"). */
PKV_NODISCARD PKV_API int pkv_cache_create(const pkv_config *cfg, pkv_cache **out);
/* Frees everything; NULL is a no-op. Outstanding sequence ids become invalid. */
PKV_API void pkv_cache_destroy(pkv_cache *c);
/* Releases every sequence and pin and empties the prefix index: all blocks FREE. The statistics'
 * counters and peak_active go on (a later miss at a block indexed before is counted in
 * prefix_miss_evicted). */
PKV_NODISCARD PKV_API int pkv_cache_reset(pkv_cache *c);
/* The effective configuration (n_blocks, max_blocks_per_seq and n_threads resolved). */
PKV_NODISCARD PKV_API int pkv_cache_config(const pkv_cache *c, pkv_config *out);

/* Where the pool lives, for engines that run their own kernels over it (vLLM layout):
 * K of layer l = k_base + l * layer_stride_bytes; block b, kv head h, offset t of K starts at
 * K + b * k_block_bytes + (h * block_tokens + t) * k_row_bytes; V likewise with v_*.
 * v_base - k_base can exceed n_blocks * k_block_bytes: a pool whose K array is 2 MiB or more
 * leaves a gap of under 2 MiB before V (so a block's K and V rows do not share memory banks).
 * Every layer's K and V arrays start 64-byte aligned (the K array, and the layer, padded to 64
 * bytes where their rows do not fill whole cache lines).
 * The pointers stay valid until pkv_cache_destroy. */
typedef struct pkv_layout {
    uint8_t *k_base, *v_base;
    size_t layer_stride_bytes;     /* between layers of K (and of V) */
    size_t k_row_bytes, v_row_bytes;
    size_t k_block_bytes, v_block_bytes; /* n_kv_heads * block_tokens * row bytes */
    uint32_t n_blocks, block_tokens, n_kv_heads, head_dim, n_layers;
    pkv_dtype k_dtype, v_dtype;
    uint32_t v_dim; /* values a V row holds: head_dim, or pkv_config.v_dim where V lives in K (then
                       v_base, v_row_bytes and v_block_bytes are K's, v_dtype k_dtype) */
} pkv_layout;
PKV_NODISCARD PKV_API int pkv_cache_layout(const pkv_cache *c, pkv_layout *out);

/* ---- sequences --------------------------------------------------------------------------- */
/* New empty sequence. salt (may be NULL when salt_len == 0, at most 256 bytes) names its
 * prefix-index namespace: sequences with different salts never share indexed blocks. Whatever
 * makes the same tokens give other K/V belongs in it: the tenant (vLLM's cache_salt), the LoRA
 * adapter (the K/V it gives differ), the weights' version (after an RL step updates the
 * weights, a new salt leaves every older block unmatched, and those go as room is needed, with
 * no call to flush them, while sequences in flight go on).
 * PKV_ELIMIT when max_seqs are live. */
PKV_NODISCARD PKV_API int pkv_seq_create(pkv_cache *c, const void *salt, size_t salt_len, pkv_seq *out);

/* Appends n positions with their token ids (tokens must not be NULL when n > 0) and returns
 * their slots in slots_out (may be NULL). Allocates blocks as needed, FREE blocks first, then
 * evicting CACHED blocks (LRU, leaves first); if the current tail block is shared (refcount > 1)
 * or indexed, it is first copied (copy-on-write, all layers). All-or-nothing: PKV_ENOSPC if
 * the blocks cannot be had, PKV_ELIMIT past max_blocks_per_seq. */
PKV_NODISCARD PKV_API int pkv_seq_append(pkv_cache *c, pkv_seq s, const int32_t *tokens, uint32_t n,
                                         int32_t *slots_out);

/* How many blocks pkv_seq_append(c, s, ..., n) would take from the FREE and CACHED ones, so
 * that it succeeds iff *n_blocks <= n_free + n_cached (pkv_stats) at the time of the append:
 * the new blocks, plus a copy of a shared or indexed tail, less one where the copied tail is
 * then CACHED (s held it alone) and so can be evicted by the same append. PKV_ELIMIT where the
 * append would pass max_blocks_per_seq; n = 0 gives 0. Changes nothing. For a scheduler that
 * budgets a step before appending (vLLM's can_append_slots): appends to distinct sequences
 * whose counts sum to at most n_free + n_cached all succeed, in any order, with no other call
 * between (the sum can overstate by one for each copy that frees its tail); count a sequence's
 * appends of one step as one append of their total. */
PKV_NODISCARD PKV_API int pkv_seq_append_blocks(pkv_cache *c, pkv_seq s, uint32_t n, uint32_t *n_blocks);

/* One request of pkv_batch_append: n positions with their token ids appended to seq (tokens
 * not NULL when n > 0), their slots returned in slots_out (may be NULL). */
typedef struct pkv_append_req {
    pkv_seq seq;
    const int32_t *tokens;
    uint32_t n;
    int32_t *slots_out;
} pkv_append_req;

/* pkv_batch_append flag: append the longest leading run of the requests that fits, instead of
 * all or none (first come, first served; *n_done says how many). */
#define PKV_APPEND_FIT 1u

/* A scheduler step's appends in one call: the budget check and the appends under one hold of
 * the cache's lock, so no other thread's append can take the blocks between them (as it can
 * between pkv_seq_append_blocks and pkv_seq_append). The requests are checked first: each
 * names a distinct live sequence (not a pin), none passes max_blocks_per_seq (PKV_ELIMIT),
 * else the call fails and changes nothing. Request i fits where pkv_seq_append_blocks would
 * count it at most n_free + n_cached once the requests before it are appended: each counted
 * in the state they leave (a tail shared by forks in the batch is copied by all but the last of
 * them), against what they leave (a request whose only block is the copy of an indexed tail it
 * holds alone gives that tail back, CACHED). That is exactly where one pkv_seq_append after
 * another succeeds. Without flags: every request is appended, in order, or none
 * (PKV_ENOSPC). With PKV_APPEND_FIT: requests 0 .. k-1 are appended for the largest k that
 * fits, the others left as they were, and the call succeeds, k 0 included; n_done is then
 * required. Each appended request is what pkv_seq_append would do (same blocks, slots and
 * copy-on-write). *n_done (may be NULL without PKV_APPEND_FIT) is the number appended. */
PKV_NODISCARD PKV_API int pkv_batch_append(pkv_cache *c, const pkv_append_req *reqs, uint32_t n_reqs, uint32_t flags,
                                           uint32_t *n_done);

/* The largest magnitude pkv_write_kv takes into the pool, and the largest |q_d| x scale the
 * attention calls take: 2^56 (7.2e16), far past any model's activations. With it every sum the
 * kernels form stays inside f32 (a score is at most head_dim x 2^112 <= 2^124, an unnormalized
 * output at most 2^12 x 2^56 per visible key), so a call that is accepted returns finite
 * results: a product past f32's range would otherwise make each backend return its own
 * garbage (zeros and a log-sum-exp of -inf from one, NaN from another). */
#define PKV_VALUE_MAX 72057594037927936.0

/* Writes K and V of one layer for n tokens at the given slots (vLLM reshape_and_cache).
 * k, v: [n][n_kv_heads][head_dim] elements of in_dtype (f32, f16 or bf16), converted to the
 * pool dtype. slot -1 is skipped (padding). Every slot is checked first: it must lie in a
 * block that is ACTIVE with refcount 1 and not in the prefix index, at a position not yet
 * committed, else PKV_EINVAL and nothing is written. Committed K/V is immutable: a position
 * that any holder of its block has committed stays read-only until that block is freed (a
 * sequence that later owns the block alone may rewrite only past its own committed count
 * after a truncate or append, which trim the block's counts to it). Every value written must
 * be finite, at most PKV_VALUE_MAX in magnitude, and must not round to infinity in the pool's
 * dtype (f16: |x| >= 65520; the quantized dtypes saturate), else PKV_EINVAL and nothing is
 * written; rows at slot -1 are not read. k or v may
 * be NULL to write only the other. So write a sequence's K/V before forking it: a block shared
 * by a fork is read-only until copy-on-write gives the writer its own copy. Slots name places in
 * the pool, not a sequence: after a sequence's truncate, release or compaction its old slots
 * may lie in another sequence's blocks, where a write through them passes these checks and
 * changes that sequence. Take slots again after those calls (pkv_seq_slots). */
PKV_NODISCARD PKV_API int pkv_write_kv(pkv_cache *c, uint32_t layer, const int32_t *slots, uint32_t n,
                                       const void *k, const void *v, pkv_dtype in_dtype);

/* pkv_write_kv by position: writes K and V of one layer for positions [start, start + n) of s
 * (start + n <= its length), k and v as there: [n][n_kv_heads][head_dim] of in_dtype, either
 * NULL to write only the other. The same checks, all made before a byte is written (every
 * position's block held by s alone, not in the prefix index, the position not committed; every
 * value finite and within PKV_VALUE_MAX), else PKV_EINVAL and nothing is written (PKV_ENOENT
 * for an unknown or released handle, PKV_EINVAL for a pin). Where a slot is a place that a
 * truncate, release or compaction hands to another sequence, a position stays s's own: this
 * call cannot write into another sequence's rows through stale slots, and needs no
 * slot_mapping. Threads (above): it
 * may overlap calls on other sequences, attention over them included, and reads of s that do
 * not read the rows it writes (attention over layer l while it writes layer l + 1); not a call
 * that changes s, a fork or pin of s, nor another write of the same rows. */
PKV_NODISCARD PKV_API int pkv_seq_write_kv(pkv_cache *c, pkv_seq s, uint32_t layer, uint32_t start, uint32_t n,
                                           const void *k, const void *v, pkv_dtype in_dtype);

/* The caller's promise that positions [0, n_pos) of s now hold K/V for every layer: the library
 * cannot check it (K/V never written read as whatever the block held). Full blocks in that
 * range enter the prefix index (when enabled), and committed positions are what
 * pkv_seq_match_prefix hands to other sequences, so commit what the engine keeps (speculative
 * drafts once verified). n_pos may not exceed the length; committing less than is already
 * committed is a no-op. */
PKV_NODISCARD PKV_API int pkv_seq_commit(pkv_cache *c, pkv_seq s, uint32_t n_pos);

/* New sequence sharing every block of parent (refcounts + 1, no data copied), same length,
 * committed count and salt. PKV_ELIMIT when max_seqs are live. */
PKV_NODISCARD PKV_API int pkv_seq_fork(pkv_cache *c, pkv_seq parent, pkv_seq *child);

/* Keeps positions [0, n); releases the blocks past n. Never fails for n >= length (no-op).
 * The committed count becomes min(committed, n). Shared blocks are only dereferenced. n below
 * the positions pkv_seq_drop_front let go is PKV_EINVAL. */
PKV_NODISCARD PKV_API int pkv_seq_truncate(pkv_cache *c, pkv_seq s, uint32_t n);

/* Lets go of the blocks of s wholly before position pos (pos <= length), which no query of a
 * sliding window or of chunked local attention reads again: what llama.cpp's SWA cache and
 * vLLM's sliding-window manager do. Each such block loses s's reference (FREE where s held it
 * alone; shared with a fork, it stays the fork's) and its table entry reads -1
 * (pkv_seq_block_table and the exports give -1 there). The length, committed count and every
 * later position stay as they are; pkv_seq_info.n_dropped says where the dropped front ends (a
 * multiple of block_tokens). A pos that drops no further block is a no-op.
 * Afterwards any call that would read or write a dropped position is PKV_EINVAL: attention
 * whose query sees a key there (window or attn_chunk must hide them; PKV_ATTN_NONCAUSAL sees all
 * of them), pkv_seq_gather / read_stored / write_kv / write_stored / slots from there,
 * pkv_seq_truncate or pkv_seq_keep to below it, pkv_pin_create and the storage tiers' save and
 * load. A slot taken before the drop names a block s no longer holds, as one kept past a
 * truncate does. A fork inherits the dropped front. Compaction moves the blocks that are left.
 * A block here holds every layer's rows, so a model mixing windowed or chunked layers with
 * global ones (Gemma 2/3, gpt-oss, Llama 4) keeps its windowed layers in a cache of their own and
 * drops there (examples/hybrid_window.c).
 * Where the cache indexes prefixes (enable_prefix_cache), a dropped block that was indexed stays
 * in the index (one s held alone goes CACHED, pkv_stats.n_cached, at the LRU queue's tail; an
 * unindexed one goes FREE), so the same prompt again (pkv_seq_match_prefix) is matched whole, the
 * dropped blocks taken back, until eviction takes them. Such dropped blocks, with blocks in use
 * below them, are evicted only where no other CACHED block is left, the deepest first. Identities
 * chain from block 0, so an evicted one leaves a tombstone in the index (pkv_stats.n_tombstones):
 * its token ids and its place, no K/V, so that the blocks below it stay indexed. A plain match
 * stops at a tombstone; pkv_seq_match_prefix_window goes past it where the window no longer
 * reads that block (vLLM's sliding-window prefix caching); a sequence that computes the block
 * again fills it at commit. A tombstone goes once nothing is indexed below it (and no sequence's
 * committed partial tail block is registered below it). With every one of
 * the cache's 4 x n_blocks tombstones in use, eviction takes the block's subtree out of the index
 * instead: those CACHED go FREE (counted in pkv_stats.evictions), those in use stay with their
 * sequences, unindexed, and a sequence whose indexed chain broke so indexes none of its later
 * blocks.
 * PKV_ENOENT for an unknown sequence, PKV_EINVAL for a pin. */
PKV_NODISCARD PKV_API int pkv_seq_drop_front(pkv_cache *c, pkv_seq s, uint32_t pos);

/* Keeps the positions start + idx[0] < start + idx[1] < ... < start + idx[n - 1] of s's
 * uncommitted tail and drops the rest of the tail: position start + idx[k] moves to start + k
 * (its token id and every layer's K and V, as the pool holds them), and the length becomes
 * start + n. After a tree verification (pkv_attn_tree over nodes at [start, ...)) this keeps the
 * accepted path, whose node indices ascend from root to leaf; then commit what is kept. idx
 * strictly ascending, start + idx[n - 1] < length, start at or past the committed count, and each
 * position moved into one pkv_seq_write_kv could write (a block s holds alone, outside the prefix
 * index, not committed): else PKV_EINVAL (PKV_ENOENT: an unknown sequence) and nothing changes.
 * n 0 truncates to start. After a context shift (pkv_seq_shift), the first position kept from
 * past the sequence's exact part is where that part now ends (nothing from there on is indexed).
 * Threads: as pkv_seq_truncate (it changes s). */
PKV_NODISCARD PKV_API int pkv_seq_keep(pkv_cache *c, pkv_seq s, uint32_t start, const uint32_t *idx, uint32_t n);

/* RoPE as the engine applied it to the K rows it wrote (pkv_seq_shift): pair i of a K row is
 * turned by position x freq[i] radians, freq[i] = theta^(-2i / n_rot) or inv_freq[i] where given
 * (Llama 3's scaled frequencies, YaRN's, any others), i < n_rot / 2. PKV_ROPE_NEOX pairs values
 * dim0 + i and dim0 + i + n_rot / 2 (rotate_half: Llama and Qwen in Hugging Face's layout, GPT-NeoX,
 * llama.cpp's NEOX mode); PKV_ROPE_GPTJ pairs dim0 + 2i and dim0 + 2i + 1 (interleaved: GPT-J,
 * llama.cpp's default mode, llama2.c). */
typedef enum pkv_rope_style { PKV_ROPE_NEOX = 0, PKV_ROPE_GPTJ = 1 } pkv_rope_style;

typedef struct pkv_rope {
    uint32_t dim0;         /* the first value of a K row RoPE turns: 0, or where the rotary part
                              begins (DeepSeek's MLA: kv_lora_rank, 512) */
    uint32_t n_rot;        /* values turned from dim0 on: even, at least 2, dim0 + n_rot <= head_dim */
    uint32_t style;        /* pkv_rope_style */
    float theta;           /* the frequencies' base (10000, 500000, ...) where inv_freq is NULL */
    const float *inv_freq; /* NULL, or [n_rot / 2] radians per position of each pair (finite) */
} pkv_rope;

/* Context shift: removes positions [from, to) of s; positions [to, length) move down to [from,
 * length - (to - from)) with their token ids and every layer's K and V rows, each K row turned back
 * by to - from positions of rope (NULL: moved as stored, for models whose K carries no position:
 * ALiBi's, NoPE's), so that it reads as if computed at its new position. This is llama.cpp's
 * context shift (llama_memory_seq_rm, then llama_memory_seq_add of -(to - from)) and StreamingLLM's
 * cache (keep the first positions, the attention sinks, remove the oldest after them) when a
 * sequence reaches the context the model was trained for. to == length is pkv_seq_truncate to
 * from; from == to changes nothing.
 * - Values: V rows, and K values outside [dim0, dim0 + n_rot), move bit for bit where K is f32,
 *   f16 or bf16; a turned value is rounded to the pool's dtype once per shift. q8_0, q4_0 and fp8
 *   K rows are decoded, turned and encoded again (a write's error, once per shift).
 * - Exactness: the moved positions were computed with the removed ones in their context, so they
 *   hold what no prefill of the new token ids computes. From from on s indexes nothing in the
 *   prefix cache (later commits neither; its blocks before from stay indexed), a storage tier
 *   saves only its blocks before from, and a fork inherits that; pkv_seq_truncate to from or
 *   below makes s exact again.
 * - Sharing: a block that receives moved rows and is shared (a fork's, a matched prefix's) or in
 *   the prefix index is copied first (pkv_stats.cow_copies), so the other holders and the index
 *   keep theirs; PKV_ENOSPC, nothing changed, where no block can be had for a copy.
 * The committed count loses the committed positions removed; committed positions stay committed.
 * PKV_EINVAL, nothing changed: from > to, to past the length, from inside a dropped front
 * (pkv_seq_drop_front), a rope whose fields break the rules above, or a K value the turn takes
 * past what the pool's dtype holds (f16's 65504, PKV_VALUE_MAX); PKV_ENOENT for an unknown
 * sequence, PKV_EINVAL for a pin. Threads: as pkv_seq_truncate (it changes s). It checks the
 * turn and moves the rows (about 2 x (length - from) rows a layer and kv head) without holding the
 * cache's lock, so calls on other sequences go on meanwhile; it holds the lock for its copies of
 * shared blocks and for its changes to s's table and counts. */
PKV_NODISCARD PKV_API int pkv_seq_shift(pkv_cache *c, pkv_seq s, uint32_t from, uint32_t to, const pkv_rope *rope);

/* Compaction: moves blocks of s into free room (FREE blocks; with PKV_COMPACT_EVICT also CACHED
 * ones eviction could take) so that its block table holds longer runs of consecutive ids.
 * Decode reads a batch's blocks in ascending id (docs/design.md, "Attention"), and each block of
 * another sequence than the last brings that sequence's queries and accumulators back into the
 * core's L1: at batch 16 fragmented tables decoded 5-18% slower than contiguous ones (README,
 * "Status and limits"). A sequence that will be decoded for many steps can be compacted once,
 * at the price of a copy of the blocks moved (every layer's K and V).
 * The rule, one pass over the table: at each gap between two runs of consecutive ids, the run
 * after it moves to the ids just after the run before it, or the run before it to the ids just
 * before the run after it, whichever is shorter (the first on a tie) of those that fit; the two
 * then count as one run for the next gap. A run fits where s alone holds every block of it
 * (refcount 1: no fork or pin shares it) and every target id is FREE, one of the run's own (a
 * shift by less than its length), with PKV_COMPACT_CACHED in flags any CACHED block, or with
 * PKV_COMPACT_EVICT a CACHED block that eviction could take (a leaf of the prefix index). A move
 * copies K/V of every layer and the token ids, keeps the fill and committed counts and the
 * block's place in the prefix index (a later match finds the new id), and frees the old block
 * to the back of the free queue. With PKV_COMPACT_CACHED a CACHED target is exchanged instead:
 * it moves to the old id whole, keeping its K/V, its place in the index and in the LRU order,
 * so no prefix is lost (two copies; with both flags CACHED targets are exchanged, none
 * evicted). Without PKV_COMPACT_EVICT nothing is evicted (so in a pool full of CACHED blocks
 * nothing moves unless PKV_COMPACT_CACHED is given) and no count in pkv_stats changes; with it
 * alone, each CACHED target is evicted as an append would (pkv_stats.evictions counts it;
 * n_cached and n_indexed fall and n_free rises by one each). Shared blocks never move, and runs
 * move whole: the table's number of runs never grows. A later call, or one for another
 * sequence, may move more, into blocks this one freed. *n_moved (may be NULL) gets the blocks
 * copied: one a move, two an exchange; 0 is success too. The slots, block tables and
 * exports of s taken before are stale for the moved blocks: take them again. Not while an
 * attention call reads s (as for every call that changes a sequence). PKV_ENOENT for an unknown
 * id, PKV_EINVAL for a pin or an unknown flag; a failed call changes nothing. */
enum { PKV_COMPACT_EVICT = 1u, PKV_COMPACT_CACHED = 2u };
PKV_NODISCARD PKV_API int pkv_seq_compact(pkv_cache *c, pkv_seq s, uint32_t flags, uint32_t *n_moved);

/* Compaction of a batch (a decode batch, say) at once: lays the blocks of seqs[0 .. n) that each
 * holds alone (refcount 1, its "entries") out so that, in block id order, each sequence's
 * entries form one group, in table order, with no other entry of the batch between them (FREE
 * ids, shared blocks and blocks of sequences outside the batch may lie between): pool-order
 * decode then switches sequences once per group. It leaves what is laid out where it is and
 * copies as little as it can:
 * - A sequence whose entries form such a group already stays, and keeps its slack (below): the
 *   FREE ids after its last entry, up to the next entry of the batch, as many as a sequence
 *   that moves gets, are closed to the others.
 * - Each other one, in the order given, first looks for a clean stretch: consecutive ids (others
 *   such as CACHED blocks may lie between) that are FREE or its own entries, as many as its
 *   entries plus `slack`; the stretch that starts at its first entry, or, for a scattered
 *   sequence (no run of consecutive ids holds more than half its entries), also the lowest one,
 *   whichever holds more of its entries in place already (the lowest on a tie). Its entries go
 *   there in table order, and the `slack` ids after them are kept free for the blocks decode
 *   will add (where the pool's FREE blocks allow that many for every sequence, else n_free / n
 *   each; a pkv_seq_compact after an append moves the new block there). Nobody else moves.
 * - Those that found none look again once the others have moved; a sequence that is not
 *   scattered (a run that grew a block elsewhere, say) then takes the stretch from its first
 *   entry without the slack where that fits, and otherwise stays: it is not worth moving others.
 * - Scattered ones left take a stretch over the entries of sequences not yet laid out, which
 *   are exchanged away (the better of the one from their first entry and the lowest), else are
 *   laid across the groups in their way from the lowest usable id where that at least halves
 *   their number of groups, and otherwise stay.
 * So a later call leaves every sequence an earlier one laid out where it is until it changes,
 * and after decode has added a few blocks or the batch has changed it moves few. With
 * PKV_BATCH_REPACK in flags every sequence is laid out again, in the order given, each from the
 * lowest usable id: one run each wherever no shared block or block of another sequence lies
 * between, at the price of moving what was in place. It needs no free room: where a target
 * holds another entry of the batch, the two are exchanged whole (K/V, token ids, counts, and
 * each one's place in the prefix index, so a later match finds it at its new id). CACHED blocks
 * are in the way (they lie between, as above) unless PKV_BATCH_CACHED is in flags: then they
 * are room like FREE ids, and a CACHED block at a target is exchanged with the entry that
 * moves there, keeping its K/V, its place in the index and in the LRU order (in a pool full of
 * CACHED blocks, as a prefix-caching server's is, that is where the clean stretches are).
 * *n_moved (may be NULL) gets the blocks copied (2 for an exchange). Nothing is
 * evicted and no count in pkv_stats changes. Slots, tables and exports of the batch taken before
 * are stale. Not while an attention call reads any of them. PKV_ENOENT for an unknown id,
 * PKV_EINVAL for a pin, an unknown flag, NULL seqs with n > 0 or a sequence named twice (seen
 * where it holds a block alone; a repeat holding none is harmless); a failed call changes
 * nothing. Costs a pass over the pool's block states, a few searches for a stretch per sequence
 * that moves (each at most one more pass), and up to two copies of every block of the batch. */
enum { PKV_BATCH_REPACK = 1u, PKV_BATCH_CACHED = 2u };
PKV_NODISCARD PKV_API int pkv_batch_compact(pkv_cache *c, const pkv_seq *seqs, uint32_t n, uint32_t slack,
                                            uint32_t flags, uint32_t *n_moved);

/* Drops the sequence: each block's refcount falls by one; a block reaching 0 becomes CACHED
 * if indexed, else FREE. The id becomes stale. */
PKV_NODISCARD PKV_API int pkv_seq_release(pkv_cache *c, pkv_seq s);

typedef struct pkv_seq_info {
    uint32_t n_tokens;     /* length in positions */
    uint32_t n_committed;  /* positions [0, n_committed) committed */
    uint32_t n_blocks;     /* block-table length */
    uint32_t n_shared;     /* blocks of its table with refcount > 1 */
    uint32_t n_reused;     /* tokens attached by pkv_seq_match_prefix */
    uint32_t n_dropped;    /* positions [0, n_dropped) let go by pkv_seq_drop_front (0: none) */
} pkv_seq_info;
PKV_NODISCARD PKV_API int pkv_seq_get_info(pkv_cache *c, pkv_seq s, pkv_seq_info *out);

/* Slots of positions [start, start + n) (start + n <= length): the vLLM slot_mapping. */
PKV_NODISCARD PKV_API int pkv_seq_slots(pkv_cache *c, pkv_seq s, uint32_t start, uint32_t n, int32_t *slots);

/* Copies the block table (block ids, int32) into out[0 .. cap); *n_out = its length.
 * PKV_EINVAL if cap is smaller than the length: nothing copied, *n_out = the length needed. */
PKV_NODISCARD PKV_API int pkv_seq_block_table(pkv_cache *c, pkv_seq s, int32_t *out, uint32_t cap,
                                              uint32_t *n_out);

/* Gathers positions [start, start + n) of one layer into contiguous f32
 * k_out, v_out: [n][n_kv_heads][head_dim] (either may be NULL). Dequantizes. */
PKV_NODISCARD PKV_API int pkv_seq_gather(pkv_cache *c, pkv_seq s, uint32_t layer, uint32_t start, uint32_t n,
                                         float *k_out, float *v_out);

/* K/V exactly as the pool stores them, for moving a sequence's K/V without loss: swapping it
 * out of the pool and back (preemption without recompute), or into another cache of the same
 * dtypes, head_dim and n_kv_heads, whatever its block size (a prefill instance handing a
 * sequence to a decode instance). Rows are [n][n_kv_heads] of pkv_dtype_row_bytes(dtype,
 * head_dim) bytes each, k in the cache's k_dtype and v in its v_dtype, scales inline as in the
 * pool (q8_0 / q4_0: f16 scale and codes per 32 values; fp8: f32 scale and head_dim codes); for
 * f32, f16 and bf16 that is the element type. pkv_seq_read_stored copies positions [start,
 * start + n) of one layer out (either buffer may be NULL), as pkv_seq_gather does without
 * decoding; it reads like pkv_seq_gather (Threads, above). pkv_seq_write_stored writes such
 * rows back, as pkv_seq_write_kv writes values, with the same checks and threading rules: every
 * position's block held by s alone, not in the prefix index, the position not committed, all
 * before a byte is written. The rows are checked too, since attention trusts the pool: an f32,
 * f16 or bf16 element that is not finite or is past PKV_VALUE_MAX, a q8_0 or q4_0 scale that is
 * not finite, a q8_0 code of -128, an fp8 scale outside [0, PKV_VALUE_MAX / 448] or NaN, or an
 * fp8 NaN code (0x7f, 0xff) is PKV_EINVAL, nothing written. Rows read from any cache of the same
 * dtypes and head_dim pass, as long as that cache's rows went in through the API (not written
 * through pkv_cache_layout). Rows carry no tag of their format: matching dtypes are the
 * caller's to keep (f16 rows written into a bf16 pool pass, read as bf16). A read then a write
 * is bit-exact for every dtype (pkv_seq_gather then pkv_seq_write_kv is for f32, f16 and bf16,
 * not for the quantized dtypes). */
PKV_NODISCARD PKV_API int pkv_seq_read_stored(pkv_cache *c, pkv_seq s, uint32_t layer, uint32_t start, uint32_t n,
                                              void *k_out, void *v_out);
PKV_NODISCARD PKV_API int pkv_seq_write_stored(pkv_cache *c, pkv_seq s, uint32_t layer, uint32_t start, uint32_t n,
                                               const void *k, const void *v);

/* Block tables of n_seqs sequences, vLLM dense format: block_tables [n_seqs][max_blocks]
 * int32 (unused entries -1) and seq_lens [n_seqs] int32. PKV_EINVAL if a table is longer
 * than max_blocks. A front dropped by pkv_seq_drop_front reads -1 too, and seq_lens counts it:
 * a kernel that loads every block up to the length (not only those its window sees) must not
 * be given such a sequence (vLLM names a valid null block there instead). */
PKV_NODISCARD PKV_API int pkv_export_dense(pkv_cache *c, const pkv_seq *seqs, uint32_t n_seqs, uint32_t max_blocks,
                                           int32_t *block_tables, int32_t *seq_lens);

/* FlashInfer CSR format: indptr [n_seqs + 1], indices [indptr[n_seqs]] (capacity
 * indices_cap), last_page_len [n_seqs] (tokens in each last block, 0 for an empty sequence).
 * A front dropped by pkv_seq_drop_front is there as -1 indices (see pkv_export_dense).
 * PKV_EINVAL if indices_cap is too small (n_needed, if not NULL, says how many), or if the
 * tables hold more than INT32_MAX ids in all (a sequence named many times: n_needed untouched). */
PKV_NODISCARD PKV_API int pkv_export_csr(pkv_cache *c, const pkv_seq *seqs, uint32_t n_seqs, int32_t *indptr,
                                         int32_t *indices, uint32_t indices_cap, int32_t *last_page_len,
                                         uint32_t *n_needed);

/* ---- prefix cache ---------------------------------------------------------------------------- */
/* For an empty sequence s and its prompt tokens[0 .. n): attaches the longest run of indexed,
 * committed blocks of s's namespace whose token ids match exactly, plus (token-granular) the
 * matching leading tokens of the next block, copied into a fresh block: among the indexed
 * blocks and committed partial tail blocks that follow the last matched block (with none
 * matched, the first blocks of s's namespace that begin with tokens[0]), the one sharing the
 * most, of the 64 most recently indexed or registered (best effort; full blocks are always
 * found). A partial tail block is a candidate only while a sequence holds it: released, it
 * goes FREE (only full blocks stay CACHED), so once its holder is gone the same prompt reuses
 * the full blocks only. Reuses at most n - 1 tokens (the last prompt token must be computed).
 * A match that would end 1 to 3 ids into a media the prompt goes on with ends before them
 * (pkv_media_tokens); where that is inside a matched block, the block stays attached, read in
 * part, as where the whole prompt matched: the first append copies it (one block, which
 * pkv_seq_append_blocks counts). On return s has length *n_reused, all committed; append the
 * rest with pkv_seq_append. PKV_EINVAL if s is not empty. With the prefix cache disabled it attaches nothing
 * (*n_reused = 0). No block free or evictable for the copy: the copy is skipped, not an error. */
PKV_NODISCARD PKV_API int pkv_seq_match_prefix(pkv_cache *c, pkv_seq s, const int32_t *tokens, uint32_t n,
                                               uint32_t *n_reused);

/* pkv_seq_match_prefix for a cache whose layers attend through a sliding window of `window`
 * positions (a query at p sees keys p - window + 1 .. p; for chunked local attention pass
 * attn_chunk, which bounds it the same way): vLLM's sliding-window prefix caching. The match
 * needs K/V only for the blocks its first new query can see; blocks before them that were
 * evicted may be tombstones: their token ids still in the index, compared exactly, so a match
 * goes past them (pkv_seq_drop_front, "tombstones"). On return s has length *n_reused and a
 * dropped front (pkv_seq_info.n_dropped) at the last block boundary at or before
 * *n_reused - window + 1, but never past the last whole block matched; the blocks from the front
 * on are attached, all committed, as by pkv_seq_match_prefix. The match is shortened until
 * those blocks all hold K/V (and as pkv_seq_match_prefix shortens one that would end inside a
 * media), then takes the token-granular extra as pkv_seq_match_prefix does. Attention over
 * s must then see no key before the front (window or attn_chunk set: pkv_attn_params), as after
 * pkv_seq_drop_front. window 0 is PKV_EINVAL (pkv_seq_match_prefix is that case); otherwise as
 * pkv_seq_match_prefix. */
PKV_NODISCARD PKV_API int pkv_seq_match_prefix_window(pkv_cache *c, pkv_seq s, const int32_t *tokens, uint32_t n,
                                                      uint32_t window, uint32_t *n_reused);

/* Pins the committed full blocks of positions [0, n_pos) of s: they stay in use (never
 * evicted, counted ACTIVE) until pkv_pin_release, even after s is released. *pin is a handle
 * of its own (it counts against max_seqs, and pkv_seq_* calls on it return PKV_EINVAL).
 * Pinning 0 full blocks is valid (an empty pin). */
PKV_NODISCARD PKV_API int pkv_pin_create(pkv_cache *c, pkv_seq s, uint32_t n_pos, pkv_seq *pin);
PKV_NODISCARD PKV_API int pkv_pin_release(pkv_cache *c, pkv_seq pin);

/* ---- prefix-index events -----------------------------------------------------------------------
 * What a KV-aware router needs to know of each engine's cache (vLLM's KV events): which full
 * blocks a prompt could reuse. With config event_capacity > 0 the cache records, under its lock
 * and in order, every change of its prefix index:
 *   PKV_EVENT_STORED   a full committed block was indexed (pkv_seq_commit, pkv_tier_load, ...);
 *                      a parent's STORED always comes before its children's. A windowed tier
 *                      load (pkv_tier_load_window) that skipped a front indexes the identities
 *                      of the blocks before it as tombstones where the index lacks them: their
 *                      STORED name no block (block n_blocks or more)
 *   PKV_EVENT_REMOVED  an indexed block was evicted to make room; children go before parents.
 *                      A dropped front's evicted block may leave a tombstone (pkv_seq_drop_front):
 *                      its identity stays, so REMOVED comes when that goes, after its children's
 *                      (an eviction, a release or a truncate took the last entry below it)
 *   PKV_EVENT_CLEARED  pkv_cache_reset emptied the index (no REMOVED for its blocks)
 *   PKV_EVENT_OVERFLOW the ring was full: `lost` events were dropped (counted with the ones
 *                      dropped with them); what the consumer knows of the index is stale:
 *                      rebuild it from pkv_prefix_snapshot
 * A block is named by its identity hash: XXH3-64 of its token ids seeded by its parent's hash
 * (a first block: by its namespace), exactly what pkv_prefix_hashes computes from a prompt in
 * another process, with no cache. Compaction moves blocks without an event (the hash stays). */
typedef enum pkv_event_kind {
    PKV_EVENT_STORED = 1,
    PKV_EVENT_REMOVED = 2,
    PKV_EVENT_CLEARED = 3,
    PKV_EVENT_OVERFLOW = 4
} pkv_event_kind;

typedef struct pkv_event {
    uint64_t seqno;       /* 1, 2, 3, ... over the cache's life (lost ones included); 0 in a snapshot */
    uint64_t hash;        /* STORED / REMOVED: the block's identity hash; else 0 */
    uint64_t parent_hash; /* STORED / REMOVED: its parent's, 0 for a first block */
    uint64_t lost;        /* OVERFLOW: events dropped; else 0 */
    uint32_t kind;        /* pkv_event_kind */
    uint32_t depth;       /* STORED / REMOVED: the block's index in its chain (positions depth x B
                             .. depth x B + B - 1) */
    uint32_t block;       /* STORED / REMOVED: the pool block at the time (compaction may move it);
                             n_blocks or more: a tombstone (pkv_seq_drop_front,
                             pkv_tier_load_window), no block */
    uint32_t reserved;    /* 0 */
} pkv_event;

/* Moves the oldest recorded events, at most cap, into out[0 .. *n_out) and forgets them. tokens:
 * NULL, or room for cap x block_tokens ids: event i's block's token ids at tokens[i x B ..]
 * (STORED and REMOVED; zeros for the others). Returns at once: *n_out 0 when none are held.
 * PKV_EINVAL for a cache created with event_capacity 0 (said through the log hook). One
 * consumer: two threads taking at once each get a share. */
PKV_NODISCARD PKV_API int pkv_cache_take_events(pkv_cache *c, pkv_event *out, size_t cap, int32_t *tokens,
                                                size_t *n_out);

/* The whole prefix index now, as STORED events (seqno 0), every parent before its children,
 * and the recorded events forgotten in the same step: a consumer that applies the snapshot and
 * then every event it takes afterwards stays exact. *n_out is the number of index entries
 * (indexed blocks, and tombstones: pkv_stats.n_tombstones);
 * PKV_ELIMIT, with nothing written or forgotten, when that is over cap (call again with room for
 * *n_out). tokens: as in pkv_cache_take_events. Works with event_capacity 0 as well. */
PKV_NODISCARD PKV_API int pkv_prefix_snapshot(pkv_cache *c, pkv_event *out, size_t cap, int32_t *tokens,
                                              size_t *n_out);

/* The identity hashes a cache with this block_tokens gives the full blocks of tokens[0 .. n)
 * under the namespace salt (as pkv_seq_create's): hashes[i] for block i, at most cap of them;
 * *n_out = min(n / block_tokens, cap). Needs no cache: a router computes a prompt's hashes and
 * counts how many leading ones each engine's events say it holds: a pkv_seq_match_prefix of
 * that prompt attaches those blocks (at most n - 1 tokens, and 1 to 3 fewer where they end that
 * far into a media the prompt goes on with: pkv_media_tokens), and may copy more from live
 * sequences' committed tail blocks (token-granular matching), which no event names: at most one
 * block's worth, as full only where that tail block filled up after an identical twin was
 * indexed. Token ids are hashed as int32 in the machine's byte order: hashes agree across
 * machines of one byte order. PKV_EINVAL
 * for block_tokens outside 1..1024, salt_len over 256, or a NULL buffer with a nonzero size. */
PKV_NODISCARD PKV_API int pkv_prefix_hashes(const void *salt, size_t salt_len, uint32_t block_tokens,
                                            const int32_t *tokens, size_t n, uint64_t *hashes, size_t cap,
                                            size_t *n_out);

/* Token ids for the positions of an image, audio clip or other media in a prompt, from what
 * identifies its content. The prefix index compares token ids only, and a model's placeholder
 * ids (<image> repeated 576 times) are the same for every image: two prompts that differ only in
 * their image would match, and the second would get the first's K/V. Append these ids instead
 * of the placeholders (the model still embeds its own; the cache keeps these), pass them to
 * pkv_seq_match_prefix, pkv_tier_load and pkv_prefix_hashes the same way, and a prompt is
 * matched through its media only where the content is the same. vLLM keys such blocks by the
 * media's hash, SGLang swaps the placeholders for a value derived from it; this is the latter,
 * one id a position.
 *
 * id must identify everything that decides the media's embeddings: its bytes and how they were
 * preprocessed (resolution, crops or tiles, the processor's settings), e.g. a SHA-256 over both;
 * the encoder's weights belong in the namespace (pkv_seq_create's salt) with the model's.
 *
 * out[i] is the id of the media's position offset + i (so the ids of a media split across
 * prefill chunks can be computed piece by piece): with key the 16 bytes of
 * XXH128_canonicalFromHash(XXH3_128bits_withSeed(id, id_len, 0x706b766d65646961 ("pkvmedia")))
 * and v = (int32_t)(XXH3_64bits_withSeed(key, 16, p) >> 34) (30 bits) for p = offset + i,
 * out[i] = INT32_MIN + v where p = 0 (a media's first id, in [-2^31, -2^30 - 1], so that two
 * media side by side are told apart) and -1 - v otherwise (in [-2^30, -1]): never a
 * vocabulary's id, and the same on every machine and, from this version on, in every version
 * (a router in another process computes the same; tests/test_prefix.c pins values; the ids of
 * the unreleased first form, 31 bits and no first id, differ). Two contents' ids agree at a
 * position with probability 2^-30, as if independently from position to position. So that this
 * is never enough for a false match, a match or tier load that would end fewer than 4 ids into
 * a media whose next position the prompt has gives those positions back, and a tier keys a
 * block that ends that far into a media with the media's next ids too: a false match needs 4
 * ids agreeing by chance, 2^-120 a candidate block (a media of 1 to 3 positions, matched whole,
 * only its own: 2^-30 an id). Chance, not an attacker: the ids are 30 bits from a public,
 * non-cryptographic hash, so content can be crafted to agree with a known id at a few
 * positions; keep tenants apart by namespace. A router's pkv_prefix_hashes count may therefore
 * be more than a match reuses (by the 1 to 3 ids given back). The library takes every negative
 * id for a media's, and one under -2^30 for a media's first: a prompt with negative ids of
 * another meaning gets the same trims there, and tier keys that take the ids after a block.
 * PKV_EINVAL for id_len 0 (content with no identity), a NULL id, a NULL out with n > 0, or
 * offset + n over 2^32. */
PKV_NODISCARD PKV_API int pkv_media_tokens(const void *id, size_t id_len, uint32_t offset, uint32_t n,
                                           int32_t *out);

/* ---- statistics and checker ------------------------------------------------------------------ */
typedef struct pkv_stats {
    uint32_t n_blocks, n_free, n_cached, n_active;
    uint32_t n_seqs, n_pins;
    uint64_t n_tokens;            /* positions over all live sequences (shared ones counted per sequence) */
    uint64_t n_slots_used;        /* distinct slots holding a live token (shared blocks counted once;
                                     positions one holder truncated away in a block it shared stay
                                     counted after the others leave, until it appends or truncates) */
    uint64_t kv_bytes;            /* pool bytes, all layers, K and V */
    uint64_t kv_bytes_per_block;  /* all layers, K and V */
    uint64_t meta_bytes;          /* metadata the cache allocated besides the pool */
    uint64_t frag_slots;          /* unused slots in partly filled ACTIVE blocks */
    uint64_t cow_copies;          /* blocks copied by copy-on-write */
    uint32_t peak_active;         /* most ACTIVE blocks at once */
    uint64_t prefix_lookups;      /* pkv_seq_match_prefix calls */
    uint64_t prefix_tokens_queried;
    uint64_t prefix_tokens_hit;
    uint64_t prefix_miss_new;     /* lookups that stopped at a block never indexed */
    uint64_t prefix_miss_evicted; /* ... at a block that was indexed but has been evicted (or
                                     dropped by pkv_cache_reset, which evictions does not count;
                                     a windowed match that a tombstone in its window ended too) */
    uint64_t prefix_miss_namespace; /* ... at a block indexed only under another namespace */
    uint64_t n_indexed;           /* blocks in the prefix index (ACTIVE or CACHED) */
    uint64_t evictions;           /* CACHED blocks evicted to satisfy allocations (and
                                     those below them in the index: pkv_seq_drop_front) */
    /* attention requests (decode sequences, prefill requests of n_q > 0) that
     * pkv_attn_decode / pkv_attn_prefill read, by block order (see pkv_attn_decode): in pool
     * order (the batch's blocks once each, ascending) and in table order; a call its checks
     * reject counts nothing */
    uint64_t attn_reqs_pool;
    uint64_t attn_reqs_table;
    /* K/V positions pkv_attn_decode and pkv_attn_prefill read once for a group of requests that
     * share them rather than once a request (shared prefixes, see pkv_attn_decode): (members - 1)
     * x shared positions, summed over groups, calls and layers; a failed call counts nothing */
    uint64_t attn_shared_keys;
    /* tombstones in the prefix index: evicted blocks whose token ids are kept while entries
       below them are (pkv_seq_drop_front; pkv_seq_match_prefix_window matches through them); at
       most 4 x n_blocks, past which eviction takes a subtree out */
    uint64_t n_tombstones;
    uint64_t prefix_tomb_hits; /* pkv_seq_match_prefix_window calls whose match went past one */
} pkv_stats;
PKV_NODISCARD PKV_API int pkv_cache_get_stats(pkv_cache *c, pkv_stats *out);

/* Verifies every invariant (block-state counts, refcounts against block tables and pins,
 * free/LRU queues, index identities, sequence lengths) in O(n_blocks + table entries).
 * 0 if all hold, else PKV_ECORRUPT with a description of the first broken one in msg. It may
 * overlap any other call: of a sequence a pkv_seq_shift is moving rows of at that moment it
 * checks only the blocks its table holds (the rest of its record is midway). */
PKV_NODISCARD PKV_API int pkv_cache_check(pkv_cache *c, char *msg, size_t msg_cap);

/* ---- attention ------------------------------------------------------------------------------- */
typedef struct pkv_attn_params {
    uint32_t n_q_heads;  /* multiple of n_kv_heads (GQA/MQA), at most 1024 x n_kv_heads; 0 = n_kv_heads.
                            Query head h reads kv head h / (n_q_heads / n_kv_heads): consecutive
                            query heads share one (Llama's repeat_kv order) */
    float scale;         /* 0 = 1/sqrt(head_dim); else positive and finite */
    float softcap;       /* logit soft-cap: s = softcap * tanh(s / softcap); 0 = off; else finite
                            and at least FLT_MIN (a subnormal cap is PKV_EINVAL) */
    uint32_t window;     /* sliding window: query at p sees (p - window, p]; 0 = off */
    float *lse;          /* optional out: natural-log sum-exp of the scaled (capped, ALiBi-biased) logits,
                            [n_queries][n_q_heads]; NULL = not wanted */
    uint32_t flags;      /* PKV_ATTN_* below, or 0; another bit is PKV_EINVAL */
    const float *sinks;  /* optional: [n_q_heads] attention-sink logits (gpt-oss), NULL = none.
                            Head h's softmax also counts one virtual key of logit sinks[h] and
                            value 0: out = sum_t e^(s_t) v_t / (e^(sinks[h]) + sum_t e^(s_t)),
                            with s_t the scaled (capped, ALiBi-biased) logits; the sink is compared with them
                            as given (neither scaled nor capped). Every key outside the window or chunk
                            or past the query's position is still invisible; a row that sees no
                            key gets out 0 and lse sinks[h]. lse includes the sink's term, so
                            to merge partial results (pkv_attn_merge) pass sinks to exactly one
                            part. Each must be finite, and sinks must not overlap out or lse
                            (it may overlap q where out is not q): else PKV_EINVAL. */
    const float *alibi_slopes; /* optional: [n_q_heads] ALiBi slopes (BLOOM, MPT, Baichuan,
                            Falcon-RW), NULL = none. Head h's logit of the key at position k for
                            the query at position p gains alibi_slopes[h] x (k - p) after the
                            scale and the soft-cap: s = cap(scale q.k) + slope (k - p), so keys
                            behind the query are pushed down by their distance (the usual slopes
                            2^(-8 (h + 1) / n_q_heads) for a power of 2 heads are positive; any
                            sign is taken). Positions are the keys' and queries' own (in
                            pkv_attn_tree a node's depth: below). The sinks are not biased. Each
                            slope must be finite with magnitude at most PKV_ALIBI_SLOPE_MAX, and
                            the slopes must not overlap out or lse: else PKV_EINVAL. A pass
                            between score and softmax: decode took 1.04-1.07x the time of none
                            (docs/design.md). Slopes of 0 give the same bits as none where no
                            soft-cap is taken (with one, ALiBi's pass takes the cap in scalar
                            arithmetic: other rounding). Negative slopes make the far keys lead,
                            their logits rounded to f32 at slope x distance. */
    uint32_t attn_chunk; /* chunked local attention (Llama 4's attention_chunk_size): the query at
                            p sees only the keys of its own chunk, [p - p % attn_chunk, p]; 0 =
                            off. With a window too, a key must pass both. Any value is taken (1:
                            each query sees itself alone). In pkv_attn_tree a node's position is
                            q_start + depth, as for the window. Shared-prefix groups (below)
                            share from the chunk's first block where chunks are of whole blocks
                            (8192 is); a request whose queries' chunks start at different
                            positions, or inside a block, is in no group. */
} pkv_attn_params;
/* The largest ALiBi slope magnitude taken: bias x distance stays far from f32's range at any
 * position a cache holds (2^32 x 2^16 = 2^48). */
#define PKV_ALIBI_SLOPE_MAX 65536.0f
/* pkv_attn_params.flags. PKV_ATTN_BF16_DOT: allows bf16 arithmetic where the backend has bf16
 * dot products (pkv_attn_flags_used; x86 with AVX512_BF16: Intel Cooper Lake, Sapphire Rapids
 * and later, AMD Zen 4 and later; ARM with FEAT_BF16: Neoverse V1, V2 and N2, Graviton 3 and 4,
 * Apple M2 and later, on Linux). vdpbf16ps multiplies 32 pairs of bf16 values exactly and adds
 * them into 16 f32 lanes (BFDOT: 8 pairs into 4): twice the products an instruction of the f32
 * path (subnormal bf16 values count as 0). Whether that is faster depends on the CPU: bf16
 * decode took 0.80-0.82x the time on an AMD Zen 4 but 1.13-1.16x from memory and 1.43x in cache
 * on an Intel Xeon (family 6 model 207), so measure it (pkv bench attn --bf16-dot) before
 * turning it on; pkv_attn_flags_used says whether it applies, not whether it pays.
 * - bf16 K: each query row times scale is rounded to bf16 (nearest, ties to even), so a score
 *   moves by up to 2^-8 of sum |q_d k_d| x scale: what a model computing its queries in bf16
 *   gets anyway.
 * - bf16 V: each softmax weight is rounded to bf16 for p.V (their sum, and so the log-sum-exp,
 *   is not), so an output moves by up to 2^-8 of the largest |V| it averages.
 * Decode and prefill alike. Elsewhere (other dtypes but fp8 e4m3, q8_0 and q4_0 on "avx512-amx",
 * below; other backends, PKV_FORCE_REF) the flag changes nothing. On backend "avx512-amx" (pkv_attn_backend) prefill's units of 16 query rows a
 * kv head and more take bf16 K and V through AMX tiles, their inputs rounded as above (sums in
 * another order: not the same bits as avx512-vnni's): a 2,048-token
 * bf16 prompt (32 query heads, 8 kv heads, head_dim 128) took 0.42-0.46x the time of the
 * flag's absence and 0.31-0.33x that of vdpbf16ps (avx512-vnni's, which there took 1.35-1.39x
 * the time of no flag) on an Intel Xeon with AMX (family 6 model 167 as reported, stop 86);
 * 0.36-0.37x with tiles of 64 query rows a kv head (stop 87).
 * There, units of fewer than 16 query rows a kv head (decode of fewer than 16 query heads a kv
 * head, decode read in pool order, short extends) take the rounded queries on f32 FMAs and keep
 * f32 weights, since vdpbf16ps made that decode 1.14-1.19x the time of no flag on that Xeon;
 * so decode with the flag costs what it costs without (1.00-1.02x, stop 89). Head dims and V
 * dims that are not a multiple of 32 in the tile units keep vdpbf16ps.
 * - fp8 e4m3, q8_0 and q4_0 K and V, on "avx512-amx" alone and in those units alone (head_dim a
 *   multiple of 32 for K, v_dim for V; the row path and other backends compute as without the
 *   flag): an e4m3 code's value, a q8_0 int8 and a q4_0 nibble minus 8 are bf16 values exactly,
 *   so the tiles take them as they are and apply the scales in f32: fp8's row scale, q8_0's and
 *   q4_0's scale of each 32 values, to a key's sums of those values (K) or to the weights of a V
 *   row (of its 32 values) before they are rounded. Such K then scores as bf16 K does (the
 *   queries times scale rounded to bf16; where the row path gives q8_0 and q4_0 K queries
 *   quantized to int8 per 32, as ggml does, the tiles give them these), and such V's weights
 *   times the scales are rounded as bf16 V's weights are, for the unit's rows in 16s (the last
 *   rows past a multiple of 16 keep f32). A 2,048-token prompt (32 query heads, 8 kv heads,
 *   head_dim 128) took 0.41x (fp8), 0.57x (q8_0) and 0.59x (q4_0) the time of the flag's
 *   absence at 1 thread on an Intel Xeon with AMX (family 6 model 167 as reported, pkv bench attn
 *   --dtype fp8_e4m3,q8_0,q4_0 --bf16-dot). */
enum { PKV_ATTN_BF16_DOT = 1u };
/* pkv_attn_params.flags. PKV_ATTN_F16_AS_BF16: allows f16 K and V to be computed as bf16 where
 * the backend multiplies bf16 much faster than f32: backend "avx512-amx" (pkv_attn_backend, AMX
 * tiles), in units of 16 query rows a kv head and more (prefill and extends; decode where a kv
 * head has 16 query heads or more, unless read in pool order) with head_dim a multiple of 32 for
 * K, v_dim for V; pkv_attn_flags_used says whether it applies to a cache. There each query row
 * times scale and each K value, and for the unit's rows in 16s each V value and softmax weight,
 * are rounded to bf16 (8 significant bits against f16's 11, nearest even), the products exact
 * and the sums in f32: a score moves by up to about 2^-7 of sum |q_d k_d| x scale, an output by
 * up to about 2^-7 of the largest |V| it averages, what a model run in bf16 gets anyway. On an
 * Intel Xeon with AMX (family 6 model 167 as reported) a 2,048-token f16 prompt (32 query heads,
 * 8 kv heads, head_dim 128) took 0.37-0.40x the time without the flag (pkv bench attn
 * --f16-as-bf16, stop 87). Elsewhere (other dtypes, other backends, units of fewer rows,
 * PKV_FORCE_REF) the flag changes nothing: the same bits as without it. Independent of
 * PKV_ATTN_BF16_DOT (bf16 K and V); a call may pass both. f16 beside q8_0 or q4_0 goes through
 * the tiles only in calls that pass both (PKV_ATTN_BF16_DOT takes such a pair there). */
enum { PKV_ATTN_F16_AS_BF16 = 4u };
/* pkv_attn_params.flags. PKV_ATTN_NONCAUSAL: each query of a pkv_attn_prefill request sees every
 * position its sequence holds, [0, length), whatever its own: an encoder's bidirectional
 * self-attention (BERT, Whisper's and T5's encoders), and cross-attention, where a decoder's
 * queries attend to a sequence that holds an encoder's K/V (Whisper, T5, Llama 3.2 Vision's image
 * layers: FlashInfer's and vLLM's causal=False). A request's queries are then not at positions of
 * the sequence: q_start must be 0 and n_q may be any count up to max_blocks_per_seq x
 * block_tokens, what a causal request may have (the sequence must hold a position where n_q is
 * not 0). Positions having no meaning, a window, attn_chunk or alibi_slopes with it is
 * PKV_EINVAL in every call, and so is pkv_attn_tree with it; pkv_attn_decode otherwise takes it
 * and computes what it computes without (its query sees [0, length) anyway). Soft-cap, sinks, lse, GQA and MLA as
 * causal requests. Queries over one sequence are best one request: its blocks are then read once a
 * tile of up to 64 query rows (a tile's query heads x queries), not once a request (such
 * requests are not grouped with others as shared prefixes). */
enum { PKV_ATTN_NONCAUSAL = 2u };
PKV_API pkv_attn_params pkv_attn_params_default(void);

/* Decode: one query per sequence, at its last position (length - 1), seeing [0, length).
 * p NULL means pkv_attn_params_default() (n_q_heads = n_kv_heads).
 * q, out: [n_seqs][n_q_heads][head_dim] f32 (out [n_seqs][n_q_heads][v_dim] where V lives in K:
 * MLA below). out may be q (in place; not where v_dim differs from head_dim); any other overlap of q,
 * out and p->lse is PKV_EINVAL, and so is seqs (pkv_attn_prefill's reqs) overlapping out or
 * lse (a batch past max_seqs reads them again after writing outputs), or a q element that is
 * not finite or whose magnitude times the scale is over PKV_VALUE_MAX. K/V of every visible position must have been written
 * for this layer (pkv_write_kv keeps them within PKV_VALUE_MAX; values put in the pool around
 * it past that make the rows that see them unspecified, and different between backends). A
 * sequence may appear more than once (each entry its own query and output), and n_seqs may
 * pass max_seqs (the batch then runs in groups of max_seqs). A batch whose block
 * tables jump is read in pool order: every block of the batch once, in ascending block id,
 * whichever sequences hold it, with one running softmax per sequence merged at the end (in
 * groups of at most 32 sequences). The result then differs from a
 * read in table order by float rounding only. PKV_ATTN_ORDER=table (or pool, or auto, the
 * default) in the environment at pkv_cache_create fixes the order; another value makes
 * pkv_cache_create fail with PKV_EINVAL (unset or empty means auto, for this variable and the
 * four PKV_ATTN_* below). pool reads in pool order wherever the pool-order read
 * can take the batch, and in table order where it cannot: more than 16 threads, n_q_heads over
 * 64, or a run of max_seqs in which one group of 32 sequences holds more (sequence, block) pairs
 * than the attention context does (32 x max_blocks_per_seq, at most 2^20): that whole run of
 * max_seqs is then read in table order, its other groups of 32 too. How the pool-order read
 * shares a batch among threads is chosen per CPU: each thread a set of the sequences, or (AMD
 * Zen 5) each thread a range of the pool for all of them. PKV_ATTN_SWEEP=narrow or wide (or
 * auto, the default) at pkv_cache_create fixes that, to compare the two on a machine; another
 * value makes pkv_cache_create fail with PKV_EINVAL. The results differ by float rounding only. On AMD Zen
 * 5 a sequence's (or a sweep's) blocks are read in windows of two passes, the window's K and then
 * its V, rather than each block's K and V together (f16, f32 and bf16 V); PKV_ATTN_PASSES=two or
 * one (or auto, the default) at pkv_cache_create fixes that, with the same rule for other
 * values. The results are the same bits either way. Elsewhere the kernels prefetch the next
 * block's K/V while they compute a block, or, on Intel, the next kv head's (a shorter lead:
 * measured faster there); PKV_ATTN_LEAD=head or block (or auto, the default) at
 * pkv_cache_create fixes that, with the same rule for other values, and the same bits. On Intel,
 * with f16 or bf16 K and V, a (block, kv head) run of more than 4 KiB of K (blocks of more than
 * 16 tokens at head_dim 128) is taken 4 KiB at a time, each piece one more online-softmax step:
 * measured 8-18% faster there; PKV_ATTN_PIECES=on or off (or auto, the default) at
 * pkv_cache_create fixes that, with the same rule for other values; the results differ by float
 * rounding only.
 * Shared prefixes: sequences of the batch whose block tables begin with the same blocks (forks
 * for parallel sampling or beam search, prompts the prefix cache matched) are grouped, and each
 * group's shared blocks are read once for all its members' queries (as a prefill of their
 * queries reads a block once for all of them), then each member's own blocks on its own, the two
 * parts merged by log-sum-exp (FlashInfer's and vLLM's cascade attention). A group shares at
 * least 512 positions of whole blocks (shorter ones cost more than they saved, measured), only
 * blocks before every member's query position, and only those every query of each member sees:
 * with chunks of local attention (attn_chunk) of whole blocks, from the block its chunk starts at
 * (members whose chunks start at different blocks are not grouped together); none of a member
 * whose window starts inside a block, or whose queries' first keys differ.
 * Groups nest: forks of several requests that share a system prompt make one group reading the
 * system prompt, and inside it one group a request reading that request's blocks after it (each
 * level where it reads 512 positions or more past the level around it). Groups hold up to
 * min(max_seqs, 32) x 8 x n_kv_heads query heads of members in all (x 128 where V lives in K:
 * MLA's one kv head is read by 16-128 query heads), within 16 MiB of scratch (head_dim + 2
 * floats a head, and v_dim more where V lives in K with v_dim < head_dim; the rest decode alone; where two members' query heads do not fit,
 * none is grouped). pkv_stats counts
 * the positions so read once (attn_shared_keys). From memory this took 0.55-0.72 of the time
 * without at 2-16 forks of 4096-32768 positions on the development machine (f16, 1 and 2
 * threads; pkv bench share), 0.42-0.58 with f32 K/V. PKV_ATTN_SHARE=off (or auto, the default, or a number: the fewest positions)
 * at pkv_cache_create fixes that; another value makes pkv_cache_create fail with PKV_EINVAL. The
 * results differ by float rounding only. */
PKV_NODISCARD PKV_API int pkv_attn_decode(pkv_cache *c, uint32_t layer, const pkv_seq *seqs, uint32_t n_seqs,
                                          const float *q, float *out, const pkv_attn_params *p);

/* MLA (pkv_config.v_dim): multi-head latent attention in its absorbed form (DeepSeek-V2 / V3,
 * FlashMLA's decode): one kv head whose row is the latent c_kv and the rotary key k_pe,
 * [c_kv | k_pe], read as K by every query head and its first v_dim values (c_kv) read as V. A
 * query row is [q_nope W_UK | q_pe] (head_dim values), an output row sum_t p_t c_kv_t (v_dim
 * values: the caller applies W_UV), and the scale is the model's (DeepSeek: 1 / sqrt(192), its
 * qk_nope + qk_rope dims, not head_dim's 576; the default 1/sqrt(head_dim) is rarely right
 * here). Each call (decode, prefill, tree) takes q [n][n_q_heads][head_dim] and out
 * [n][n_q_heads][v_dim], out never overlapping q (where v_dim < head_dim); pkv_attn_merge merges
 * such outputs with head_dim = v_dim. Every other rule is the same: sharing, copy-on-write,
 * prefix reuse, tiers (an MLA cache's entries are its own: a cache without v_dim never loads
 * them, nor they its), pkv_seq_read_stored / write_stored and pkv_seq_gather with k only. The
 * pool holds one row a token a layer (head_dim values of k_dtype), no V array. */

/* One prefill/extend request: queries for positions [q_start, q_start + n_q) of seq, causal
 * (a query at position p sees positions <= p, reused prefix blocks included);
 * q_start + n_q <= length. With PKV_ATTN_NONCAUSAL (above) every query sees [0, length) instead:
 * q_start 0, n_q any count. */
typedef struct pkv_attn_req {
    pkv_seq seq;
    uint32_t q_start;
    uint32_t n_q;
} pkv_attn_req;

/* Ragged batch of prefill requests in one call (p NULL: pkv_attn_params_default()); a sequence
 * may appear in more than one request. q, out: the requests' queries concatenated,
 * [sum n_q][n_q_heads][head_dim] f32, out [sum n_q][n_q_heads][v_dim] (out may be q, as in
 * pkv_attn_decode). Requests of one
 * query (decodes batched beside chunked prefills) are read as pkv_attn_decode reads its batch
 * (in pool order when their tables jump), the others in table order, in the same call. Requests
 * whose tables begin with the same blocks before their first query (forks verifying draft tokens,
 * beam search extending several tokens) are grouped as pkv_attn_decode groups shared prefixes,
 * all of a group's queries read together (a request's queries count against the scratch's heads
 * one by one: long prompts do not fit, and are read on their own). */
PKV_NODISCARD PKV_API int pkv_attn_prefill(pkv_cache *c, uint32_t layer, const pkv_attn_req *reqs, uint32_t n_reqs,
                                           const float *q, float *out, const pkv_attn_params *p);

/* pkv_attn_prefill with a custom mask per request (FlashInfer's custom_mask): masks[i] NULL leaves
 * request i to pkv_attn_prefill's rule; otherwise its query j sees key t exactly where bit
 * j x kv_len + t of masks[i] is set, for keys t of [0, kv_len), kv_len = q_start + n_q (with
 * PKV_ATTN_NONCAUSAL: the sequence's length). Bit i is bit i % 8 of byte i / 8: a bool array
 * [n_q][kv_len] through numpy.packbits(m, axis=None, bitorder="little"); n_q x kv_len bits, read
 * during the call, not overlapping out or lse (else PKV_EINVAL). Causality is the mask's to say:
 * a query may see keys ahead of it (Gemma 3's and PaliGemma's bidirectional image and prefix
 * tokens), or only its own document's (packed sequences), or any pattern. A query that sees no key gets out 0 and lse -inf (with sinks: lse
 * sinks[h]). Soft-cap, sinks, lse, GQA, MLA and ALiBi apply as in pkv_attn_prefill (ALiBi's
 * distance t - p at the query's real position p, positive for a key ahead of it); a window or
 * attn_chunk with any mask is PKV_EINVAL (set their bits in the mask instead). A masked request
 * reads the blocks from the one holding the least key any of its queries sees to the one holding
 * the greatest (each tile of its queries only those its rows see), and is not grouped with others
 * as a shared prefix; past a dropped front (pkv_seq_drop_front) that least key must be kept, as
 * for any query (a mask that sets no bit sees nothing and reads nothing, dropped or not). masks
 * NULL with n_reqs > 0, or the reqs or masks array overlapping out or lse, is PKV_EINVAL. With
 * PKV_ATTN_NONCAUSAL a mask's rows are the length the call checked: a sequence that another
 * thread grows or cuts during the call (a misuse) makes it fail with PKV_EINVAL before its mask
 * is read past its bits. Scores are masked after they are computed: a mask saves no arithmetic
 * inside the blocks it reads. The masks are scanned outside the cache's metadata lock. */
PKV_NODISCARD PKV_API int pkv_attn_prefill_masked(pkv_cache *c, uint32_t layer, const pkv_attn_req *reqs,
                                                  uint32_t n_reqs, const uint8_t *const *masks, const float *q,
                                                  float *out, const pkv_attn_params *p);

/* One request of pkv_attn_tree: a tree of draft tokens (speculative decoding) whose K/V a
 * sequence holds at positions [q_start, q_start + n_nodes), node i at q_start + i, in any order
 * where each node comes after its parent (parent[i] < i). Node i's position in the text is
 * q_start + depth(i) (a root, parent -1, follows position q_start - 1 and has depth 0): the
 * position its K was rotated for, and the one a window counts from. */
typedef struct pkv_attn_tree_req {
    pkv_seq seq;
    uint32_t q_start;      /* the first node's position; q_start + n_nodes <= length */
    uint32_t n_nodes;      /* at most PKV_TREE_MAX_NODES; 0: an empty request */
    const int32_t *parent; /* [n_nodes]: parent[i] in [-1, i), -1 for a root (several allowed) */
} pkv_attn_tree_req;
enum { PKV_TREE_MAX_NODES = 1024 };

/* Tree attention (SpecInfer / Medusa / EAGLE verification): node i's query sees the positions
 * before q_start (the prefix, reused blocks included) and the nodes on its path to its root,
 * itself included: not its siblings, cousins or other branches. With a window, a key is seen
 * where the node's position (q_start + depth) minus the key's (its position in the prefix, or
 * q_start + depth for a node) is under window; with chunks, where the key is in the node's
 * position's chunk. q, out: the requests' nodes' queries
 * concatenated, [sum n_nodes][n_q_heads][head_dim] (out [..][v_dim]; out may not be q: the paths read the queries
 * after the prefix part wrote out); p as for pkv_attn_prefill:
 * scale, softcap, window, lse, sinks, alibi_slopes and attn_chunk mean the same, per node (a key's distance
 * for ALiBi is the node's position, q_start + depth, minus the key's, as for the window). The prefix is read by the
 * prefill kernels, all of a request's nodes at once (in runs of max(4096, 1024 x n_kv_heads) /
 * n_q_heads nodes: a request of more reads its prefix once a run; where a window or chunk ends inside
 * the prefix for some node, a read a node), the paths a node a task on the cache's attention
 * threads (or its executor; on the calling thread alone where they are little work, as small
 * decodes are: the same bits either way); the two parts are merged by log-sum-exp. A chain (parent[i] = i - 1) gives what
 * pkv_attn_prefill gives over the same positions, up to float rounding. Bad input (a parent
 * outside [-1, i), n_nodes past PKV_TREE_MAX_NODES or the sequence, a NULL parent with nodes, and
 * every refusal of pkv_attn_prefill) is PKV_EINVAL (PKV_ENOENT: an unknown sequence) with nothing
 * written. Accepting a path afterwards: pkv_seq_truncate to drop the tree, or pkv_seq_keep. */
PKV_NODISCARD PKV_API int pkv_attn_tree(pkv_cache *c, uint32_t layer, const pkv_attn_tree_req *reqs, uint32_t n_reqs,
                                        const float *q, float *out, const pkv_attn_params *p);

/* Merges two partial attention results of the same queries over disjoint key sets into the
 * result over their union (cascade attention: a shared prefix attended once, each sequence's
 * suffix apart; split attention across devices or caches). out_a, out_b, out:
 * [n_rows][head_dim] f32; lse_a, lse_b, lse: [n_rows], natural-log sum-exp of each part's
 * scaled (capped) logits, as pkv_attn_params.lse returns them (n_rows = queries x q heads).
 * Per row, with m = max(lse_a, lse_b): out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) /
 * (e^(lse_a - m) + e^(lse_b - m)), lse = m + log of that sum (lse NULL: not wanted). A part over
 * no keys has lse -inf and weighs nothing (its out values are not read); both -inf give out 0
 * and lse -inf. out may be out_a or out_b and lse may be lse_a or lse_b (in place); any other
 * overlap, a NULL array (lse aside), head_dim 0 or an lse that is NaN or +inf is PKV_EINVAL,
 * and nothing is written. n_rows 0 does nothing. Needs no cache: the parts may come from
 * anywhere (another engine's kernel included), as long as both used the same scale. */
PKV_NODISCARD PKV_API int pkv_attn_merge(uint32_t n_rows, uint32_t head_dim, const float *out_a, const float *lse_a,
                                         const float *out_b, const float *lse_b, float *out, float *lse);

/* Which kernel family attention uses: "ref", "avx2", "avx2-vnni" (avx2 with the q8_0 / q4_0
 * score on AVX-VNNI: Intel cores without AVX-512 from Alder Lake and Sierra Forest on),
 * "avx512", "avx512-vnni" (avx512 with the q8_0 / q4_0 score on VNNI), "avx512-amx" (avx512-vnni
 * whose calls with PKV_ATTN_BF16_DOT run bf16, fp8 e4m3, q8_0 and q4_0 K and V, and with
 * PKV_ATTN_F16_AS_BF16 f16 K and V, on AMX tiles where a kv head has 16 query rows or more, as
 * prefill does: Intel Xeons from Sapphire Rapids on, 64-bit Linux; detection takes it for a
 * cache whose K or V is of any dtype but f32 (an f32 cache it serves as avx512-vnni), and creating such a cache asks the kernel
 * once a process for its AMX state, arch_prctl ARCH_REQ_XCOMP_PERM, which makes signal frames
 * 8 KiB larger; where the kernel refuses, detection picks avx512-vnni), "neon", "neon-dotprod" (chosen
 * once at creation from CPU detection; PKV_FORCE_REF=1 in the environment forces "ref" (so does
 * any value but an empty one or "0", "false" and "off" included), and
 * PKV_ATTN_BACKEND=name picks one by name: pkv_cache_create fails with PKV_ENOTSUP when this
 * CPU or build lacks it). */
PKV_API const char *pkv_attn_backend(const pkv_cache *c);

/* Of the PKV_ATTN_* flags, those that change how this cache's attention computes (a call may
 * pass any of them; the others change nothing here): PKV_ATTN_BF16_DOT where K or V is bf16 and
 * the backend has bf16 dot products, or where K (V) is fp8 e4m3, q8_0 or q4_0 with head_dim
 * (v_dim) a multiple of 32, the other of a dtype the transposed path takes, and the backend has
 * bf16 tiles ("avx512-amx"); PKV_ATTN_F16_AS_BF16 where K (V) is f16 with head_dim (v_dim)
 * a multiple of 32, the other of a dtype the transposed path takes (f32, f16, bf16, fp8_e4m3, and
 * q8_0 or q4_0 in calls that pass PKV_ATTN_BF16_DOT too), and the backend has bf16 tiles
 * ("avx512-amx"). 0 for NULL. */
PKV_API uint32_t pkv_attn_flags_used(const pkv_cache *c);

/* ---- storage tiers ----------------------------------------------------------------------------
 * A tier keeps whole blocks of prompt prefixes out of the pool: in host memory, in files, or in
 * a store of the caller's (the ops below), so that a prefix the pool has evicted, or one another
 * cache computed, is copied back instead of recomputed (what LMCache and SGLang's HiCache do).
 * An entry is one full, committed block: its token ids and every layer's K and V rows as the
 * pool stores them (pkv_seq_read_stored; K rows alone where V lives in K), under a 128-bit key
 * that chains the block's token ids onto its parent's key, seeded by the sequence's namespace
 * (its salt's digest) and the cache's shape (k_dtype, v_dtype, head_dim, n_kv_heads, n_layers,
 * block_tokens, v_dim). So only a cache of
 * that shape, a sequence of that namespace and that exact token prefix find an entry. A load
 * compares the entry's token ids, its parent's key, the shape and a checksum of its bytes: a
 * wrong prefix gets a block only through a collision of two prefixes' 128-bit keys (XXH3; not a
 * cryptographic hash: tenants who must not share blocks must use different salts, as in the
 * pool's index, and caches of different models with one shape must not share a tier unless
 * their salts differ). Entries are in the machine's byte order.
 *
 * The engine moves blocks explicitly, outside the cache's lock:
 *   pkv_seq_match_prefix(c, s, prompt, n, &reused);     the pool's blocks first
 *   pkv_tier_load(t, c, s, prompt, n, &loaded);           then the tier's, appended and committed
 *   ... compute positions [reused + loaded, n), commit ...
 *   pkv_tier_save(t, c, s, &saved);                       the full committed blocks, for later
 * A tier is thread-safe: several threads and several caches may share one. pkv_tier_save reads
 * its sequence like pkv_seq_gather; pkv_tier_load changes its sequence like pkv_seq_match_prefix
 * (pkv.h, Threads). */
typedef struct pkv_tier pkv_tier;

/* A store of the caller's: bytes under 16-byte keys. Each op returns a status; the library
 * calls them from the thread that called pkv_tier_save or pkv_tier_load, and get from the
 * tier's prefetch thread (pkv_tier_prefetch_start), possibly from several threads at once. The library checks what comes back (checksum, key, tokens, shape, size), so
 * a store may lose, truncate or garble entries: that is a miss, never wrong K/V.
 * - put: store len bytes under key, replacing an entry of that key. PKV_OK; PKV_ENOSPC: not
 *   stored, for want of room (not an error: the save goes on); anything else fails the save.
 * - get: data NULL (cap 0): is the entry there? PKV_OK with *len its size, or PKV_ENOENT. Else
 *   copy it into data (cap bytes): PKV_OK with *len; PKV_ENOENT; PKV_ENOSPC with *len where it
 *   is larger than cap. Either form may count as a use (for a least-recently-used policy).
 * - del: drop the entry (PKV_OK whether or not it was there).
 * - usage: may be NULL; what pkv_tier_get_stats reports of the store itself.
 * - destroy: may be NULL; called once, by pkv_tier_destroy. */
typedef struct pkv_tier_ops {
    int (*put)(void *ctx, const uint8_t key[16], const void *data, size_t len);
    int (*get)(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len);
    int (*del)(void *ctx, const uint8_t key[16]);
    void (*usage)(void *ctx, uint64_t *entries, uint64_t *bytes, uint64_t *capacity, uint64_t *evictions);
    void (*destroy)(void *ctx);
} pkv_tier_ops;

/* A tier over the caller's store (ops copied; put, get and del required). alloc: NULL or
 * alloc.alloc NULL for the default allocator. */
PKV_NODISCARD PKV_API int pkv_tier_create(const pkv_tier_ops *ops, void *ctx, const pkv_allocator *alloc,
                                          pkv_tier **out);
/* Host memory: at most capacity_bytes of entries (> 0), the least recently used dropped first. */
PKV_NODISCARD PKV_API int pkv_tier_host_create(uint64_t capacity_bytes, const pkv_allocator *alloc, pkv_tier **out);
/* Files in the directory dir (made if missing; its parent must exist), one file an entry
 * (32 hex digits of the key, ".pkvb"), at most capacity_bytes of them (> 0), the least recently
 * used dropped first. Entries already in dir (a tier of an earlier process) are taken over,
 * oldest written first in line to be dropped (the order of use is not kept in the files);
 * files of other names are left alone. A file is written beside its final name (".pkvt-<pid>-
 * <tier>-<count>") and renamed into place, so a reader never sees half an entry (not synced: a
 * crash of the machine may lose entries, and the checksum catches torn ones); temporary files
 * an hour old, left by a process that died writing them, are removed at creation. Two tier
 * objects on one directory (two processes) work, but keep separate accounts of it: each counts
 * only the files it wrote or found, and drops only those. PKV_EIO where dir cannot be made or
 * read. */
PKV_NODISCARD PKV_API int pkv_tier_file_create(const char *dir, uint64_t capacity_bytes, const pkv_allocator *alloc,
                                               pkv_tier **out);
/* Redis, where the library was built with hiredis (else PKV_ENOTSUP): entries as string values
 * under key_prefix (NULL: "pkv:") followed by the key's 16 bytes, on the server at host:port.
 * What stays is the server's to decide, by its maxmemory and maxmemory-policy: allkeys-lru
 * drops the least recently used; under noeviction a full server refuses puts (PKV_ENOSPC, not an
 * error for a save). Up to 4 connections for the callers, a thread keeping to one of them (its
 * calls on it one at a time; threads whose ids hash alike share one), each connected at its
 * first use, and one of its own for the tier's thread (pkv_tier_prefetch_start: its
 * prefetches and write-backs). A load (and
 * a prefetch) sends the GETs of its next 4 blocks together and reads each reply as it comes to
 * that block, so that the server answers the next while this one is checked and written (a load
 * that ends earlier leaves replies that the next call reads past); the probes and the puts of
 * a save and of the write-back, the probes of a windowed load's search (pkv_tier_load_window)
 * and a load's touches after it (a get with no buffer each) go up to 16 to a round trip, in
 * the order one at a time would take them. A
 * connection that broke is made again at the next call, and a call that cannot reach the
 * server is PKV_EIO (a save fails; a load ends there). SIGPIPE (hiredis writes with write(2):
 * a write to a connection the server has closed raises it) is held back in the calling thread
 * during each call and taken if raised: the process's handling of it is not touched. timeout_ms: for connecting and for each command (0: 1000). PKV_EIO
 * where the server does not answer at creation. hiredis allocates with malloc, not alloc.
 * pkv_tier_get_stats' entries, bytes, capacity and evictions are 0 (the server's INFO has
 * them). */
PKV_NODISCARD PKV_API int pkv_tier_redis_create(const char *host, int port, const char *key_prefix,
                                                uint32_t timeout_ms, const pkv_allocator *alloc, pkv_tier **out);
/* Destroys t (NULL: nothing); no call on t may be running. Entries of a file tier stay. */
PKV_API void pkv_tier_destroy(pkv_tier *t);

typedef struct pkv_tier_stats {
    uint64_t entries, bytes, capacity, evictions; /* the store's own (ops.usage; 0 without it) */
    uint64_t saved;          /* blocks pkv_tier_save stored */
    uint64_t save_present;   /* blocks it found stored already */
    uint64_t save_no_room;   /* blocks the store refused for want of room (PKV_ENOSPC) */
    uint64_t loaded_blocks;  /* blocks pkv_tier_load copied into a cache */
    uint64_t loaded_tokens;  /* positions they gave */
    uint64_t load_misses;    /* loads that ended on a block the store did not have */
    uint64_t rejected;       /* entries refused (size, checksum, key, tokens, shape, rows) and deleted */
    uint64_t errors;         /* store calls that failed otherwise (PKV_EIO, ...) */
    /* prefetch (pkv_tier_prefetch_start) */
    uint64_t prefetched;     /* entries the prefetch thread fetched from the store into staging */
    uint64_t prefetch_hits;  /* blocks pkv_tier_load took from staging instead of the store */
    uint64_t prefetch_dropped; /* staged entries dropped unused, for room */
    uint64_t staged_entries; /* entries staged now */
    uint64_t staged_bytes;   /* memory staging holds now: staged entries, kept buffers, writes
                                waiting (pkv_tier_save_async) */
} pkv_tier_stats;
PKV_NODISCARD PKV_API int pkv_tier_get_stats(pkv_tier *t, pkv_tier_stats *out);

/* Stores the full committed blocks of s that t lacks (deepest first, so that a least-recently-
 * used store drops the ends of prefixes before their beginnings); *n_saved (may be NULL): how
 * many it stored. Where s dropped its front (pkv_seq_drop_front, a windowed match or load), the
 * blocks from the front on: an entry's key takes every id before it, and the ids of the dropped
 * blocks come from the prefix index (their blocks or tombstones); where it no longer names them
 * (prefix caching off, or an eviction took the chain's subtree) nothing is stored, and the call
 * succeeds. Blocks t has are only touched; blocks the store refuses for want of room are
 * counted, not an error. A put that fails otherwise fails the call, and the entries it stored
 * are deleted again (up to the first del the store fails). PKV_ENOMEM: the token, key and flag
 * buffers could not be allocated (through the cache's allocator) or the entry buffer (through
 * the tier's; the tier keeps one between calls). A block that ends 1 to 3 ids into a media
 * (pkv_media_tokens) is keyed with the media's next ids too, so it and the blocks after it are
 * stored only where s's full committed blocks hold those ids. */
PKV_NODISCARD PKV_API int pkv_tier_save(pkv_tier *t, pkv_cache *c, pkv_seq s, uint32_t *n_saved);
/* For a sequence whose positions [0, m) are all committed and are tokens[0, m) (m <= n; what
 * pkv_seq_match_prefix leaves, or an empty sequence; one with a dropped front too, whose ids
 * before the front are compared as the prefix index has them: where it no longer names them
 * nothing is loaded, as pkv_tier_save stores nothing): appends, writes and commits the positions
 * of the prompt tokens[0, n) that the tier holds, block after block from the one holding
 * position m, up to the first block it lacks, and never the last token (as a prefix match).
 * *n_loaded: positions added. A block whose entry is missing, refused (then deleted), that the
 * store fails to give (counted in errors; nothing more is asked of the store in that call) or
 * that finds no room in the pool (PKV_ENOSPC, PKV_ELIMIT) ends the load: what was loaded before
 * it stays, and the call succeeds; where that end is 1 to 3 ids into a media the prompt goes on
 * with (pkv_media_tokens), those positions are given back, as a prefix match does. The loaded
 * full blocks enter the prefix index as committed blocks do, when the load ends. PKV_EINVAL where s has uncommitted positions or its tokens differ from tokens[0,
 * m). */
PKV_NODISCARD PKV_API int pkv_tier_load(pkv_tier *t, pkv_cache *c, pkv_seq s, const int32_t *tokens, uint32_t n,
                                        uint32_t *n_loaded);
/* pkv_tier_load for a cache whose layers attend through a sliding window of `window` positions
 * (chunked local attention: attn_chunk), the tier's side of pkv_seq_match_prefix_window. Into an
 * empty sequence it loads only the blocks the window of the longest prefix it can restore reads:
 * the latest end (as pkv_tier_load's: never the last token, a media's last few ids given back)
 * for which the store has every block from that match's front on (the front as
 * pkv_seq_match_prefix_window sets it: the block boundary at or before end - window + 1, never
 * past the last whole block). It first loads the latest window (that of the prompt's last full
 * block) with no question asked; where the store lacks one of its blocks, the ends past it are
 * ruled out, and unless what was loaded is the window of the end at it, it asks the store
 * whether it has each block from there down (a get with no buffer, or staging:
 * pkv_tier_prefetch), each at most once (a Redis tier asks for up to 16 blocks below it in one
 * round trip: some may lie past the window it finds), then loads. The sequence comes back with its front
 * dropped there, as after
 * pkv_seq_drop_front, the positions before it counted in its length and in *n_loaded though no
 * K/V of theirs was loaded (pkv_seq_get_info's n_dropped: the front; pkv_tier_stats counts the
 * positions loaded). Its blocks enter the prefix index below the identities of the blocks before
 * the front, from tokens: the index's own entries where it has them, else tombstones made for
 * them (PKV_EVENT_STORED said for each, its block n_blocks or more; all or none: nothing is
 * indexed where too few tombstones are free), so pkv_seq_match_prefix_window and pkv_tier_save
 * go on from it; where its first block is indexed already (another request's), the sequence
 * takes that block instead of the copy it loaded. Where the load
 * ends early (an entry gone since, refused, no room), so that the window would reach back past
 * the front, the sequence goes back to empty and *n_loaded is 0. Into a sequence that holds
 * positions (a windowed match's, pkv_tier_load's) it is pkv_tier_load: the blocks from the one
 * holding its length on, up to the first the store lacks. window 0 is PKV_EINVAL; otherwise as
 * pkv_tier_load. */
PKV_NODISCARD PKV_API int pkv_tier_load_window(pkv_tier *t, pkv_cache *c, pkv_seq s, const int32_t *tokens,
                                               uint32_t n, uint32_t window, uint32_t *n_loaded);

/* Prefetch (SGLang HiCache's prefetch from storage while a request waits): a thread of the
 * tier's own fetches a prompt's entries from the store into host memory (staging), so that the
 * pkv_tier_load that follows copies them from memory instead of waiting on files or Redis.
 * pkv_tier_prefetch_start starts the thread with staging_bytes of staging: entries allocated
 * through the tier's allocator as they arrive, the buffers of those loads took kept for the next
 * ones, the writes of pkv_tier_save_async waiting, and all of it, headers included, within
 * staging_bytes (kept buffers dropped first, then the oldest staged entries; writes waiting
 * are never dropped: where they hold the room, nothing is fetched). Once only: PKV_EINVAL after that; PKV_ENOMEM where no thread can be
 * started. pkv_tier_destroy stops it. */
PKV_NODISCARD PKV_API int pkv_tier_prefetch_start(pkv_tier *t, uint64_t staging_bytes);

/* Queues the entries of tokens[0 .. n)'s full blocks (those a later pkv_tier_load of this prompt
 * would ask for) under the namespace salt (as pkv_seq_create's) for caches of c's shape, and
 * returns. The thread fetches them in order and stops at the first the store lacks, or gives
 * wrong (it checks an entry's header, token ids and checksum as a load does, and stages only
 * what passes; entries already staged are kept). A load takes a staged entry (out of staging)
 * after the same checks as one from the store; a load that comes before its entries are staged
 * asks the store itself. PKV_EINVAL before pkv_tier_prefetch_start or for bad arguments; PKV_EBUSY when 64
 * prefetches are queued; PKV_ENOMEM. */
PKV_NODISCARD PKV_API int pkv_tier_prefetch(pkv_tier *t, const pkv_cache *c, const void *salt, size_t salt_len,
                                            const int32_t *tokens, uint32_t n);

/* pkv_tier_prefetch for a pkv_tier_load_window of the prompt into an empty sequence: the thread
 * fetches the blocks the window of the whole prompt reads (from the front that load would set
 * for the prompt's last full block on), in order, and stops at the first the store lacks (a
 * window the store does not hold whole: the load then asks the store itself). window 0 is
 * PKV_EINVAL; otherwise as pkv_tier_prefetch. */
PKV_NODISCARD PKV_API int pkv_tier_prefetch_window(pkv_tier *t, const pkv_cache *c, const void *salt, size_t salt_len,
                                                   const int32_t *tokens, uint32_t n, uint32_t window);

/* Waits until every queued prefetch is done (staged, or stopped at a miss). PKV_EINVAL before
 * pkv_tier_prefetch_start. */
PKV_NODISCARD PKV_API int pkv_tier_prefetch_wait(pkv_tier *t);

/* Write-back: as pkv_tier_save, but the store's puts are left to the tier's thread
 * (pkv_tier_prefetch_start first, else PKV_EINVAL), so a file or Redis tier's save costs the
 * caller a copy of the rows into host memory. The full committed blocks' entries (those
 * pkv_tier_save would store, its media rule included) are made now
 * (s may be released as soon as it returns) into buffers within staging_bytes and queued, all of
 * them or, on a failure, none; *n_queued (may be NULL) is their count. Where staging has no
 * room for them (the writes queued before hold it: then nothing staged is dropped for them) or
 * the allocator no memory, it saves now, as pkv_tier_save (*n_queued 0). The thread puts them in order before any queued prefetch, skipping those the store has,
 * and counts them in pkv_tier_get_stats (saved, save_present, save_no_room, errors); a load
 * that comes before a block's put misses it. pkv_tier_destroy puts every queued entry first. */
PKV_NODISCARD PKV_API int pkv_tier_save_async(pkv_tier *t, pkv_cache *c, pkv_seq s, uint32_t *n_queued);

/* Waits until the writes queued before the call are in the store (not those queued after it,
 * by other threads). PKV_EIO when a put failed since the last flush returned (counted in errors;
 * that block is not stored; one flush reports it), PKV_EINVAL before pkv_tier_prefetch_start. */
PKV_NODISCARD PKV_API int pkv_tier_flush(pkv_tier *t);

#ifdef __cplusplus
}
#endif
#endif /* PKV_H */
