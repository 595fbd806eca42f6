/* cache.c: the cache object and sequences: create/destroy, append with copy-on-write, K/V
 * writes, commit, fork, truncate, release, gather, block-table exports, attention entry points. */
#include "cache_int.h"

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define LOCK(c) pthread_mutex_lock(&(c)->mu)
#define UNLOCK(c) pthread_mutex_unlock(&(c)->mu)

PKV_API pkv_config pkv_config_default(void) {
    pkv_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.n_layers = 1;
    cfg.n_kv_heads = 8;
    cfg.head_dim = 128;
    cfg.block_tokens = 16;
    cfg.n_blocks = 1024;
    cfg.k_dtype = PKV_DTYPE_F16;
    cfg.v_dtype = PKV_DTYPE_F16;
    cfg.max_seqs = 256;
    cfg.enable_prefix_cache = 1;
    cfg.huge_pages = 1;
    cfg.spin_us = PKV__SPIN_US_DEFAULT;
    return cfg;
}

/* ---- ids -------------------------------------------------------------------------------------- */
pkv_seq pkv__seq_id(const pkv_cache *c, const pkv__seq *s) {
    return ((uint64_t)s->gen << 32) | (uint64_t)(s - c->seqs);
}

pkv__seq *pkv__seq_get(pkv_cache *c, pkv_seq id) {
    uint64_t idx = id & 0xffffffffu;
    uint32_t gen = (uint32_t)(id >> 32);
    if (id == PKV_SEQ_NONE || idx >= c->max_seqs) return NULL;
    pkv__seq *s = &c->seqs[idx];
    if (!s->live || s->gen != gen) return NULL;
    return s;
}

int pkv__say(const pkv_cache *c, int rc, const char *api, const char *fmt, ...) {
    if (!c || !c->cfg.log) return rc;
    char why[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    pkv__log(c->cfg.log, c->cfg.log_ctx, PKV_LOG_ERROR, "%s: %s", api, why);
    return rc;
}

int pkv__get_seq(pkv_cache *c, pkv_seq id, pkv__seq **out, const char *api) {
    pkv__seq *s = pkv__seq_get(c, id);
    *out = s; /* (written whatever the answer: the callers' compilers then see it set) */
    if (!s)
        return pkv__say(c, PKV_ENOENT, api, "sequence %#llx is unknown: never made, released, or another cache's",
                        (unsigned long long)id);
    if (s->is_pin) return pkv__say(c, PKV_EINVAL, api, "%#llx is a pin, not a sequence", (unsigned long long)id);
    *out = s;
    return PKV_OK;
}
#define get_seq(c, id, out) pkv__get_seq((c), (id), (out), __func__)

/* Whether positions [start, start + n) of s are there to read or write: within its length and
 * past the blocks it dropped (pkv_seq_drop_front); said as api's refusal if not. */
static int check_span(const pkv_cache *c, const pkv__seq *s, uint32_t start, uint32_t n, const char *api) {
    if ((uint64_t)start + n > s->n_tokens)
        return pkv__say(c, PKV_EINVAL, api, "positions [%u, %llu) past the sequence's length %u", start,
                        (unsigned long long)start + n, s->n_tokens);
    if (n && start < pkv__seq_front(c, s))
        return pkv__say(c, PKV_EINVAL, api, "position %u was dropped (pkv_seq_drop_front: positions before %u)",
                        start, pkv__seq_front(c, s));
    return PKV_OK;
}

int pkv__seq_whole(const pkv_cache *c, const pkv__seq *s, const char *api) {
    return s->n_dropped ? pkv__say(c, PKV_EINVAL, api, "the sequence dropped positions [0, %u) (pkv_seq_drop_front)",
                                   pkv__seq_front(c, s))
                        : PKV_OK;
}

/* Whether the query (or tree node) at pos of s, whose first key is lo, sees only positions s still
 * holds; said as api's refusal ("request 3: the query at position ...") if not. */
static int check_front(const pkv_cache *c, const pkv__seq *s, const char *api, const char *what, uint32_t i,
                       const char *who, uint32_t pos, uint32_t lo) {
    if (lo >= pkv__seq_front(c, s)) return PKV_OK;
    return pkv__say(c, PKV_EINVAL, api, "%s %u: the %s at position %u sees position %u, dropped (pkv_seq_drop_front: "
                    "before %u)", what, i, who, pos, lo, pkv__seq_front(c, s));
}

/* Each cache starts its slots' generations at its own base: the n-th cache of the process at
 * n * 0x9E3779B1 mod 2^32 (0 skipped), so the bases of any two caches are far apart (the golden
 * ratio's multiples spread evenly) and a handle of one cache is refused by another (PKV_ENOENT)
 * unless a slot there went through about 2^32 / (the caches created) generations. A slot then
 * counts up from its base, skipping 0, and retires (generation 0) when the next one would be its
 * base again: 2^32 - 1 ids. */
static uint32_t new_gen_base(void) {
    static _Atomic uint32_t n_caches;
    uint32_t base = (atomic_fetch_add_explicit(&n_caches, 1, memory_order_relaxed) + 1u) * 0x9E3779B1u;
    return base ? base : 1u;
}

/* The generation after gen in cache c: 0 when the slot's ids are used up. */
static uint32_t next_gen(const pkv_cache *c, uint32_t gen) {
    uint32_t next = gen + 1u ? gen + 1u : 1u;
    return next == c->gen_base ? 0u : next;
}

pkv__seq *pkv__seq_new(pkv_cache *c) {
    if (c->seq_free == PKV_NONE) return NULL;
    pkv__seq *s = &c->seqs[c->seq_free];
    c->seq_free = s->next_free;
    s->live = 1;
    s->is_pin = 0;
    s->shifting = 0;
    s->n_tokens = s->n_committed = s->n_blocks = s->n_reused = s->idx_len = 0;
    s->exact = PKV_NONE;
    s->ns_lo = s->ns_hi = 0;
    s->next_free = PKV_NONE;
    c->n_live++;
    return s;
}

void pkv__seq_free(pkv_cache *c, pkv__seq *s) {
    if (!s->is_pin) c->n_tokens_total -= s->n_tokens;
    else c->n_pins--;
    s->live = 0;
    s->is_pin = 0;
    s->n_tokens = s->n_committed = s->n_blocks = s->n_reused = s->idx_len = s->n_dropped = 0;
    s->exact = PKV_NONE;
    c->n_live--;
    /* a released id is stale forever: a slot whose generations are used up (2^32 - 1 ids) is
       retired (generation 0, off the free list) rather than wrapped */
    s->gen = next_gen(c, s->gen);
    if (s->gen == 0) return;
    s->next_free = c->seq_free;
    c->seq_free = (uint32_t)(s - c->seqs);
}

/* ---- blocks ----------------------------------------------------------------------------------- */
/* Takes a CACHED block out of the index (with its subtree: pkv__index_evict) and out of its
 * queue, counted: FREE, in no queue. */
static void evict(pkv_cache *c, uint32_t b) {
    /* a block in the inner queue hands its place over to a full registered partial of the same
       content where there is one, else leaves a tombstone in its place where one is free; else
       its subtree goes too (an inner block goes to the LRU queue once its subtree is gone) */
    const bool inner = c->blk[b].inner;
    if (!inner || (!pkv__index_hand_over(c, b) && !pkv__tomb_make(c, b))) pkv__index_evict(c, b);
    pkv__pool_lru_remove(&c->pool, b);
    c->evictions++;
    c->blk[b].state = PKV_BLK_FREE;
}

/* Where the LRU queue is empty, the inner queue's block to evict: from its head (the least
 * recently released), down to a child that waits there too while there is one, so that what a
 * dropped front left goes from its deepest block up and the rest stays matchable. Its cost is
 * the child lists it passes (blocks in use among them): at most n_blocks, under the lock, and
 * only where nothing else is CACHED. */
static uint32_t inner_victim(const pkv_cache *c) {
    uint32_t b = c->pool.inner_head;
    for (uint32_t ch = b == PKV_NONE ? PKV_NONE : c->blk[b].child; ch != PKV_NONE;) {
        const pkv__blk *k = &c->blk[ch];
        /* down through a waiting block, or a tombstone with a block in use below it (one left
           by an earlier eviction: what waits below it is deeper) */
        if ((k->state == PKV_BLK_CACHED && k->inner) || (k->state == PKV_BLK_TOMB && k->n_hot)) {
            if (k->state == PKV_BLK_CACHED) b = ch;
            ch = k->child;
        } else {
            ch = k->sib_next;
        }
    }
    return b;
}

uint32_t pkv__take_block(pkv_cache *c) {
    uint32_t b = pkv__pool_free_pop(&c->pool);
    if (b == PKV_NONE) {
        /* the least recently released block no block in use hangs below (a leaf: its CACHED
           children went first) */
        b = c->pool.lru_head != PKV_NONE ? c->pool.lru_head : inner_victim(c);
        if (b == PKV_NONE) return PKV_NONE;
        evict(c, b);
    }
    pkv__pool_activate(&c->pool, b);
    return b;
}

void pkv__drop_block(pkv_cache *c, uint32_t b) {
    if (pkv__pool_unref(&c->pool, b) > 0) return;
    pkv__blk *k = &c->blk[b];
    if (k->flags & PKV_BLKF_INDEXED) {
        const bool inner = k->n_hot > 0; /* blocks in use below it: a dropped front's */
        pkv__pool_lru_push(&c->pool, b, inner);
        if (!inner) pkv__hot_down(c, k->parent);
    } else {
        if (k->flags & PKV_BLKF_PARTIAL) pkv__partial_unlink(c, b);
        pkv__pool_free_push(&c->pool, b);
    }
}

void pkv__copy_block(pkv_cache *c, uint32_t dst, uint32_t src, uint32_t n) {
    if (n == 0) return;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        uint8_t *k = c->kv + l * c->layer_stride, *v = k + c->v_off;
        if (n == c->B) {
            memcpy(k + dst * c->k_blk, k + src * c->k_blk, c->k_blk);
            memcpy(v + dst * c->v_blk, v + src * c->v_blk, c->v_blk);
            continue;
        }
        for (uint32_t h = 0; h < c->n_kv; h++) {
            memcpy(k + dst * c->k_blk + (size_t)h * c->B * c->k_row, k + src * c->k_blk + (size_t)h * c->B * c->k_row,
                   n * c->k_row);
            memcpy(v + dst * c->v_blk + (size_t)h * c->B * c->v_row, v + src * c->v_blk + (size_t)h * c->B * c->v_row,
                   n * c->v_row);
        }
    }
    memcpy(c->tokens + (size_t)dst * c->B, c->tokens + (size_t)src * c->B, n * sizeof(int32_t));
}

/* ---- create / destroy ---------------------------------------------------------------------- */
/* Counting shim between the attention context and the user's allocator. */
static void *attn_shim_alloc(void *ctx, size_t size, size_t align) {
    pkv_cache *c = ctx;
    void *p = pkv__alloc(&c->alloc, size, align);
    if (p) c->attn_bytes += size;
    return p;
}

static void attn_shim_free(void *ctx, void *p, size_t size) {
    pkv_cache *c = ctx;
    c->attn_bytes -= size;
    pkv__free(&c->alloc, p, size);
}

/* Refuses a configuration: says why through the log hook (PKV_LOG_ERROR), returns rc. */
#define REFUSE(cfg, rc, ...)                                                   \
    do {                                                                       \
        pkv__log((cfg)->log, (cfg)->log_ctx, PKV_LOG_ERROR, "pkv_cache_create: " __VA_ARGS__); \
        return (rc);                                                           \
    } while (0)

static int validate_config(const pkv_config *cfg) {
    if (cfg->n_layers < 1 || cfg->n_layers > 4096) REFUSE(cfg, PKV_EINVAL, "n_layers %u not in 1..4096", cfg->n_layers);
    if (cfg->n_kv_heads < 1 || cfg->n_kv_heads > 4096)
        REFUSE(cfg, PKV_EINVAL, "n_kv_heads %u not in 1..4096", cfg->n_kv_heads);
    if (cfg->head_dim < 1 || cfg->head_dim > 1024) REFUSE(cfg, PKV_EINVAL, "head_dim %u not in 1..1024", cfg->head_dim);
    if (cfg->block_tokens < 1 || cfg->block_tokens > 1024)
        REFUSE(cfg, PKV_EINVAL, "block_tokens %u not in 1..1024", cfg->block_tokens);
    const pkv_dtype dt[2] = {cfg->k_dtype, cfg->v_dtype};
    for (int i = 0; i < 2; i++) {
        const char *kv = i ? "v_dtype" : "k_dtype";
        if ((unsigned)dt[i] >= PKV_DTYPE_COUNT) REFUSE(cfg, PKV_EINVAL, "%s %d is not a pkv_dtype", kv, (int)dt[i]);
        if (!pkv__row_bytes(dt[i], cfg->head_dim))
            REFUSE(cfg, PKV_EINVAL, "%s %s needs head_dim a multiple of 32, not %u", kv, pkv_dtype_name(dt[i]),
                   cfg->head_dim);
        if (!pkv__dtype_pool_supported(dt[i]))
            REFUSE(cfg, PKV_ENOTSUP, "%s %s is not supported by this build", kv, pkv_dtype_name(dt[i]));
    }
    if (cfg->v_dim > cfg->head_dim) REFUSE(cfg, PKV_EINVAL, "v_dim %u is over head_dim %u", cfg->v_dim, cfg->head_dim);
    if (cfg->v_dim && cfg->v_dtype != cfg->k_dtype)
        REFUSE(cfg, PKV_EINVAL, "v_dim %u (V in K) needs v_dtype %s to be k_dtype %s", cfg->v_dim,
               pkv_dtype_name(cfg->v_dtype), pkv_dtype_name(cfg->k_dtype));
    if (cfg->v_dim && !pkv__row_bytes(cfg->k_dtype, cfg->v_dim))
        REFUSE(cfg, PKV_EINVAL, "v_dim %u: %s needs a multiple of 32", cfg->v_dim, pkv_dtype_name(cfg->k_dtype));
    if (cfg->max_seqs < 1 || cfg->max_seqs > (1u << 24))
        REFUSE(cfg, PKV_EINVAL, "max_seqs %u not in 1..2^24", cfg->max_seqs);
    if (cfg->n_threads > PKV_MAX_THREADS)
        REFUSE(cfg, PKV_EINVAL, "n_threads %u is over %u", cfg->n_threads, PKV_MAX_THREADS);
    if (cfg->enable_prefix_cache != 0 && cfg->enable_prefix_cache != 1)
        REFUSE(cfg, PKV_EINVAL, "enable_prefix_cache %d is not 0 or 1", cfg->enable_prefix_cache);
    if (cfg->huge_pages != 0 && cfg->huge_pages != 1)
        REFUSE(cfg, PKV_EINVAL, "huge_pages %d is not 0 or 1", cfg->huge_pages);
    if (cfg->allocator.alloc && !cfg->allocator.free) REFUSE(cfg, PKV_EINVAL, "allocator.alloc without allocator.free");
    const pkv_executor *x = &cfg->executor;
    if (x->parallel_for && (x->n_workers < 1 || x->n_workers > PKV_MAX_THREADS))
        REFUSE(cfg, PKV_EINVAL, "executor.n_workers %u not in 1..%u", x->n_workers, PKV_MAX_THREADS);
    if (x->parallel_for && cfg->n_threads && cfg->n_threads != x->n_workers)
        REFUSE(cfg, PKV_EINVAL, "n_threads %u with an executor of %u workers (0 or the same)", cfg->n_threads,
               x->n_workers);
    if (cfg->event_capacity > (1u << 24))
        REFUSE(cfg, PKV_EINVAL, "event_capacity %u is over 2^24", cfg->event_capacity);
    if (cfg->spin_us > PKV__SPIN_US_MAX)
        REFUSE(cfg, PKV_EINVAL, "spin_us %u is over %u", cfg->spin_us, PKV__SPIN_US_MAX);
    if (!x->parallel_for && x->n_workers != 0)
        REFUSE(cfg, PKV_EINVAL, "executor.n_workers %u without executor.parallel_for", x->n_workers);
    return PKV_OK;
}

static uint32_t pow2_at_least(uint64_t n) {
    uint32_t p = 16;
    while (p < n && p < (1u << 31)) p <<= 1;
    return p;
}

/* Every allocation create makes, in order, with its size in bytes as a uint64_t (every factor
 * is bounded by the config's checks, so no product overflows 64 bits; create refuses one past
 * size_t, which on a 32-bit machine several can be); destroy frees the same list. */
/* pkv_attn_tree's scratch (c->tree): first what a call shares, the prefix part's log-sum-exps of
 * a run (tree_lse_cap floats) and the request's node depths; then, for each of the cache's
 * attention threads (the path part runs a node a task on them), a node's path scores (double),
 * a head's p.V sum (head_dim floats), the K and V rows of a node's path for one kv head widened
 * to f32 (tree_path_floats each: the rows of paths up to that many values long; longer ones are
 * widened a query head at a time, the same arithmetic) and the node's path, each thread's part
 * whole 64-byte lines. The calling thread's rows hold 32,768 values (a path of 256 rows at
 * head_dim 128), the other threads' 8,192, so that a cache of many threads does not carry 256 KiB
 * of rows for each (76 KiB a thread at head_dim 128). tree_bytes sizes it, tree_carve cuts a
 * thread's view of it. */
#define TREE_PATH_FLOATS 32768u
#define TREE_PATH_FLOATS_WORKER 8192u
static uint32_t tree_lse_cap(const pkv_cache *c) {
    return PKV_MAX(4096u, 1024u * c->n_kv); /* a node's rows at the most query heads a call takes */
}
static size_t tree_path_floats(const pkv_cache *c, uint32_t tid) {
    return PKV_MAX(tid ? TREE_PATH_FLOATS_WORKER : TREE_PATH_FLOATS, c->head_dim);
}
static uint64_t tree_shared_bytes(const pkv_cache *c) {
    return ((sizeof(float) * (uint64_t)tree_lse_cap(c) + sizeof(uint32_t) * PKV_TREE_MAX_NODES) + 63u) & ~(uint64_t)63u;
}
static uint64_t tree_thread_bytes(const pkv_cache *c, uint32_t tid) {
    const uint64_t b = sizeof(double) * (uint64_t)PKV_TREE_MAX_NODES +
                       sizeof(float) * (c->head_dim + 2u * (uint64_t)tree_path_floats(c, tid)) +
                       sizeof(uint32_t) * (uint64_t)PKV_TREE_MAX_NODES;
    return (b + 63u) & ~(uint64_t)63u;
}
static uint64_t tree_bytes(const pkv_cache *c) {
    return tree_shared_bytes(c) + tree_thread_bytes(c, 0) + (uint64_t)(c->cfg.n_threads - 1u) * tree_thread_bytes(c, 1);
}
typedef struct tree_scratch {
    float *la;        /* shared */
    uint32_t *depth;  /* shared */
    double *sc;       /* the thread's own from here */
    float *acc, *kr, *vr;
    uint32_t *path;
    size_t path_floats; /* kr's and vr's floats */
} tree_scratch;
static tree_scratch tree_carve(const pkv_cache *c, uint32_t tid) {
    pkv_assert(tid < c->cfg.n_threads);
    tree_scratch t;
    t.la = (float *)(void *)c->tree;
    t.depth = (uint32_t *)(void *)(t.la + tree_lse_cap(c));
    const uint64_t at = tree_shared_bytes(c) + (tid ? tree_thread_bytes(c, 0) + (tid - 1u) * tree_thread_bytes(c, 1) : 0);
    t.sc = (double *)(void *)((uint8_t *)c->tree + at);
    t.path_floats = tree_path_floats(c, tid);
    t.acc = (float *)(void *)(t.sc + PKV_TREE_MAX_NODES);
    t.kr = t.acc + c->head_dim;
    t.vr = t.kr + t.path_floats;
    t.path = (uint32_t *)(void *)(t.vr + t.path_floats);
    return t;
}

/* Items an attention call holds: a batch of max_seqs decodes and their shared-prefix groups (share.c:
 * nested, as many as the lcp intervals of max_seqs tables, max_seqs - 1 at most). */
static uint32_t share_items(const pkv_cache *c) {
    return 2u * c->max_seqs;
}

#define CACHE_ALLOCS(X)                                                                               \
    X(blk, (uint64_t)sizeof(pkv__blk) * ((uint64_t)c->n_blocks + c->tomb_cap))                          \
    X(tokens, (uint64_t)sizeof(int32_t) * ((uint64_t)c->n_blocks + c->tomb_cap) * c->B)                 \
    X(seqs, (uint64_t)sizeof(pkv__seq) * c->max_seqs)                                                  \
    X(tables, (uint64_t)sizeof(int32_t) * c->max_seqs * c->max_bps)                                    \
    X(buckets, (uint64_t)sizeof(uint32_t) * ((uint64_t)c->bucket_mask + 1))                            \
    X(roots, (uint64_t)sizeof(uint32_t) * ((uint64_t)c->bucket_mask + 1))                              \
    X(fp_seen, (uint64_t)sizeof(uint64_t) * ((uint64_t)c->fp_mask + 1))                                \
    X(fp_content, (uint64_t)sizeof(uint64_t) * ((uint64_t)c->fp_mask + 1))                             \
    X(chk_ref, (uint64_t)sizeof(uint32_t) * c->n_blocks)                                               \
    X(chk_pos, (uint64_t)sizeof(uint32_t) * c->n_blocks)                                               \
    X(items, (uint64_t)sizeof(pkv__attn_item) * share_items(c))                                        \
    X(share_mem, pkv__share_bytes(c))                                                                  \
    X(tree, tree_bytes(c))                                                                             \
    X(ev, (uint64_t)sizeof(pkv_event) * c->ev_cap)                                                     \
    X(ev_tok, (uint64_t)sizeof(int32_t) * c->ev_cap * c->B)

static void cache_free_all(pkv_cache *c) {
    pkv_allocator a = c->alloc;
    if (c->attn) pkv__attn_destroy(c->attn);
#define FREE_ONE(field, size) pkv__free(&a, c->field, (size_t)(size));
    CACHE_ALLOCS(FREE_ONE)
#undef FREE_ONE
    if (c->kv) pkv__free(&a, c->kv, c->kv_bytes);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->attn_mu);
    pkv__free(&a, c, sizeof *c);
}

/* Every sequence slot free (live ones go stale: their generation moves on), every block FREE in
 * queue order 0..n-1, the index empty. Used by create and reset. */
static void reset_state(pkv_cache *c) {
    uint32_t *link = &c->seq_free;
    for (uint32_t i = 0; i < c->max_seqs; i++) {
        pkv__seq *s = &c->seqs[i];
        if (s->live) s->gen = next_gen(c, s->gen); /* 0 when used up: retired, as in pkv__seq_free */
        s->live = s->is_pin = 0;
        s->n_tokens = s->n_committed = s->n_blocks = s->n_reused = s->idx_len = s->n_dropped = 0;
        s->exact = PKV_NONE;
        s->next_free = PKV_NONE;
        if (s->gen == 0) continue;
        *link = i;
        link = &s->next_free;
    }
    *link = PKV_NONE;
    c->n_live = c->n_pins = 0;
    c->n_tokens_total = 0;
    pkv__pool_init(&c->pool, c->blk, c->n_blocks);
    pkv__index_reset(c);
}

/* Bytes between the end of a layer's K array and the start of its V array. K row b and V row b
 * are always read together, k_bytes + skew apart: where that distance was a multiple of 2 MiB
 * (n_blocks with a large power-of-two factor: a 512 MiB layer of 8192 x 16 f16 blocks), decode
 * from memory ran 25-45% slower on the development machine (Zen 4) than with the V array moved
 * 4 KiB, 64 KiB, 68 KiB or 3 MiB further (a move of 2 MiB did not help): the two streams
 * collide in the memory's banks. So a K array of at least 2 MiB is followed by a gap that puts
 * V at 68 KiB (17 pages) past a 2 MiB multiple from K: less than 2 MiB per layer. Smaller pools
 * keep V right after K. */
#define PKV_V_SKEW (17u * 4096u)
static size_t v_skew(size_t k_bytes) {
    if (k_bytes < PKV_HUGEPAGE) return 0;
    return (PKV_V_SKEW + PKV_HUGEPAGE - k_bytes % PKV_HUGEPAGE) % PKV_HUGEPAGE;
}

PKV_API int pkv_cache_create(const pkv_config *cfg_in, pkv_cache **out) {
    if (!cfg_in || !out) return PKV_EINVAL;
    int rc = validate_config(cfg_in);
    if (rc) return rc;
    pkv_config cfg = *cfg_in;
    size_t k_row = pkv__row_bytes(cfg.k_dtype, cfg.head_dim);
    size_t v_row = cfg.v_dim ? 0 : pkv__row_bytes(cfg.v_dtype, cfg.head_dim); /* V in K: no V array */
    size_t k_blk = k_row * cfg.block_tokens * cfg.n_kv_heads, v_blk = v_row * cfg.block_tokens * cfg.n_kv_heads;
    /* keep every block's K and V 64-byte aligned */
    if (k_blk % PKV_CACHELINE || v_blk % PKV_CACHELINE) {
        /* rows of quantized formats are not multiples of 64: blocks still tile exactly, only
           alignment of later blocks is relaxed; kernels use unaligned loads. */
    }
    size_t per_block = (k_blk + v_blk) * cfg.n_layers;
    if (cfg.n_blocks == 0) {
        if (cfg.mem_budget_bytes == 0) REFUSE(&cfg, PKV_EINVAL, "n_blocks 0 and mem_budget_bytes 0");
        uint64_t nb = cfg.mem_budget_bytes / per_block;
        if (nb == 0)
            REFUSE(&cfg, PKV_EINVAL, "mem_budget_bytes %llu is less than one block (%zu bytes)",
                   (unsigned long long)cfg.mem_budget_bytes, per_block);
        const uint64_t nb_max = ((1ull << 31) - 1) / cfg.block_tokens; /* the slots int32 can name */
        cfg.n_blocks = (uint32_t)PKV_MIN(nb, nb_max);
    }
    if ((uint64_t)cfg.n_blocks * cfg.block_tokens >= (1ull << 31)) /* int32 slots */
        REFUSE(&cfg, PKV_EINVAL, "n_blocks %u x block_tokens %u slots is not under 2^31", cfg.n_blocks,
               cfg.block_tokens);
    if (cfg.max_blocks_per_seq == 0) cfg.max_blocks_per_seq = PKV_MIN(cfg.n_blocks, 4096u);
    if ((uint64_t)cfg.max_blocks_per_seq * cfg.block_tokens >= (1ull << 31))
        REFUSE(&cfg, PKV_EINVAL, "max_blocks_per_seq %u x block_tokens %u is not under 2^31", cfg.max_blocks_per_seq,
               cfg.block_tokens);
    if ((uint64_t)cfg.max_seqs * cfg.max_blocks_per_seq > (1ull << 34))
        REFUSE(&cfg, PKV_EINVAL, "max_seqs %u x max_blocks_per_seq %u is over 2^34", cfg.max_seqs,
               cfg.max_blocks_per_seq);
    size_t k_bytes, v_bytes, layer_bytes, kv_bytes;
    if (!pkv__mul_ok(cfg.n_blocks, k_blk, &k_bytes) || !pkv__mul_ok(cfg.n_blocks, v_blk, &v_bytes))
        REFUSE(&cfg, PKV_EINVAL, "the pool's size overflows size_t");
    /* every layer's K and V arrays start on a cache line (ARCHITECTURE 3), whatever the row size */
    const size_t k_pad = pkv__align_up(k_bytes, PKV_CACHELINE), v_off = k_pad + (v_bytes ? v_skew(k_pad) : 0);
    size_t v_end;
    if (k_pad < k_bytes || v_off < k_pad || !pkv__add_ok(v_off, v_bytes, &v_end))
        REFUSE(&cfg, PKV_EINVAL, "the pool's size overflows size_t");
    layer_bytes = pkv__align_up(v_end, PKV_CACHELINE);
    if (layer_bytes < v_end || !pkv__mul_ok(layer_bytes, cfg.n_layers, &kv_bytes))
        REFUSE(&cfg, PKV_EINVAL, "the pool's size overflows size_t");
    if (cfg.executor.parallel_for) cfg.n_threads = cfg.executor.n_workers;
    if (cfg.n_threads == 0) cfg.n_threads = PKV_MIN(pkv__n_cpus(), PKV_MAX_THREADS);

    const int64_t share_min = pkv__share_env();
    if (share_min < 0)
        REFUSE(&cfg, PKV_EINVAL, "PKV_ATTN_SHARE is \"%s\": not auto, off or a number of positions 1-%u",
               getenv("PKV_ATTN_SHARE"), PKV__SHARE_MIN_KEYS_MAX);

    pkv_allocator a = cfg.allocator;
    pkv_cache *c = pkv__calloc(&a, sizeof *c, PKV_CACHELINE);
    if (!c) REFUSE(&cfg, PKV_ENOMEM, "the allocator gave no memory for the cache (%zu bytes)", sizeof *c);
    c->alloc = a;
    c->cfg = cfg;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->attn_mu, NULL);
    c->B = cfg.block_tokens;
    c->n_blocks = cfg.n_blocks;
    c->max_seqs = cfg.max_seqs;
    c->max_bps = cfg.max_blocks_per_seq;
    c->n_layers = cfg.n_layers;
    c->n_kv = cfg.n_kv_heads;
    c->head_dim = cfg.head_dim;
    c->v_dim = cfg.v_dim ? cfg.v_dim : cfg.head_dim;
    c->ev_cap = cfg.event_capacity;
    c->k_row = k_row;
    c->v_row = v_row;
    c->k_blk = k_blk;
    c->v_blk = v_blk;
    c->v_off = v_off;
    c->layer_stride = layer_bytes;
    /* tombstones (prefix.c): a windowed sequence leaves up to (length - window) / B of them where
       it holds about window / B blocks; 4 a block, ids below PKV_NONE */
    c->tomb_cap = c->tomb_lim =
        cfg.enable_prefix_cache ? (uint32_t)PKV_MIN(4ull * cfg.n_blocks, UINT32_MAX - 1ull - cfg.n_blocks) : 0;
    /* hash buckets (and root lists): one a block, two where tombstones may join the chains, so
       that with all 4 x n_blocks in use a chain holds 2.5 entries on average, not 5 */
    c->bucket_mask = pow2_at_least(c->tomb_cap ? 2ull * cfg.n_blocks : cfg.n_blocks) - 1;
    c->fp_mask = pow2_at_least(PKV_MIN((uint64_t)cfg.n_blocks * 2, 1u << 22)) - 1;

    uint64_t meta = sizeof *c;
#define FITS_ONE(field, size)                                                                           \
    if ((size) > SIZE_MAX) {                                                                            \
        cache_free_all(c);                                                                              \
        REFUSE(&cfg, PKV_EINVAL, "the cache's " #field " (%llu bytes) is past this machine's size_t",   \
               (unsigned long long)(size));                                                             \
    }
    CACHE_ALLOCS(FITS_ONE)
#undef FITS_ONE
#define ALLOC_ONE(field, size)                                   \
    c->field = pkv__calloc(&a, (size_t)(size), PKV_CACHELINE);  \
    if (!c->field) goto oom;                                     \
    meta += (size) + ((size) == 0); /* as pkv__alloc takes it */
    CACHE_ALLOCS(ALLOC_ONE)
#undef ALLOC_ONE
    c->kv_bytes = kv_bytes;
    c->kv = pkv__alloc(&a, kv_bytes, PKV_HUGEPAGE);
    if (!c->kv) goto oom;
    if (cfg.huge_pages && kv_bytes >= PKV_HUGEPAGE && ((uintptr_t)c->kv & (PKV_HUGEPAGE - 1)) == 0)
        (void)madvise(c->kv, kv_bytes & ~(size_t)(PKV_HUGEPAGE - 1), MADV_HUGEPAGE);
#ifdef MADV_NOHUGEPAGE
    /* the default allocator advises every mapping it makes for huge pages: take that back when
       the caller asked for none (a caller's own allocator's memory is left as it is) */
    if (!cfg.huge_pages && !cfg.allocator.alloc && kv_bytes >= PKV_HUGEPAGE)
        (void)madvise(c->kv, kv_bytes, MADV_NOHUGEPAGE);
#endif
    pkv__attn_limits lim = {.max_items = share_items(c), .max_blocks_per_seq = c->max_bps,
                            .n_kv_heads = c->n_kv, .head_dim = c->head_dim, .block_tokens = c->B,
                            .amx = cfg.k_dtype != PKV_DTYPE_F32 || cfg.v_dtype != PKV_DTYPE_F32,
                            .exec = cfg.executor, .spin_us = cfg.spin_us, .log = cfg.log, .log_ctx = cfg.log_ctx};
    c->attn_alloc = (pkv_allocator){.alloc = attn_shim_alloc, .free = attn_shim_free, .ctx = c};
    rc = pkv__attn_create(&c->attn_alloc, cfg.n_threads, &lim, &c->attn);
    if (rc) { /* what the environment got wrong it said itself */
        c->attn = NULL;
        cache_free_all(c);
        if (rc == PKV_ENOMEM)
            REFUSE(&cfg, rc, "no memory for the attention scratch, or no thread (n_threads %u)", cfg.n_threads);
        return rc;
    }
    c->meta_bytes = meta + c->attn_bytes;

    c->gen_base = new_gen_base();
    for (uint32_t i = 0; i < c->max_seqs; i++) {
        c->seqs[i].gen = c->gen_base;
        c->seqs[i].table = c->tables + (size_t)i * c->max_bps;
    }
    pkv__share_carve(c);
    atomic_init(&c->share.keys, 0);
    c->share.min_blocks = (uint32_t)((share_min + c->B - 1) / c->B); /* 0: off */
    reset_state(c);
    pkv__log(cfg.log, cfg.log_ctx, PKV_LOG_INFO,
             "pkv: cache of %u blocks x %u tokens, %u layers, %zu KV bytes, attention %s x%u", c->n_blocks, c->B,
             c->n_layers, kv_bytes, pkv__attn_backend_name(c->attn), pkv__attn_n_threads(c->attn));
    *out = c;
    return PKV_OK;
oom:
    cache_free_all(c);
    REFUSE(&cfg, PKV_ENOMEM, "the allocator gave no memory for the pool or its metadata (%zu K/V bytes)", kv_bytes);
}

PKV_API void pkv_cache_destroy(pkv_cache *c) {
    if (c) cache_free_all(c);
}

PKV_API int pkv_cache_reset(pkv_cache *c) {
    if (!c) return PKV_EINVAL;
    LOCK(c);
    uint32_t peak = c->pool.peak_active;
    reset_state(c);
    pkv__event_cleared(c);
    c->pool.peak_active = peak;
    UNLOCK(c);
    return PKV_OK;
}

PKV_API int pkv_cache_config(const pkv_cache *c, pkv_config *out) {
    if (!c) return PKV_EINVAL;
    if (!out) return PKV__SAY(c, PKV_EINVAL, "out is NULL");
    *out = c->cfg;
    return PKV_OK;
}

/* One layer of the pool as the kernels read it (attn.h), and as pkv_cache_layout reports layer 0:
 * where V lives in K, V's base, rows and blocks are K's. */
static pkv__kv_view layer_view(const pkv_cache *c, uint32_t layer) {
    const bool v_in_k = c->cfg.v_dim != 0; /* V's rows are K's first v_dim values */
    const uint8_t *k = c->kv + layer * c->layer_stride;
    pkv__kv_view v = {.k = k, .v = v_in_k ? k : k + c->v_off, .k_dtype = c->cfg.k_dtype, .v_dtype = c->cfg.v_dtype,
                      .k_row_bytes = c->k_row, .v_row_bytes = v_in_k ? c->k_row : c->v_row,
                      .k_block_bytes = c->k_blk, .v_block_bytes = v_in_k ? c->k_blk : c->v_blk,
                      .n_kv_heads = c->n_kv, .head_dim = c->head_dim, .block_tokens = c->B,
                      .n_blocks = c->n_blocks, .v_dim = c->v_dim};
    return v;
}

PKV_API int pkv_cache_layout(const pkv_cache *c, pkv_layout *out) {
    if (!c) return PKV_EINVAL;
    if (!out) return PKV__SAY(c, PKV_EINVAL, "out is NULL");
    const pkv__kv_view v = layer_view(c, 0);
    memset(out, 0, sizeof *out);
    out->k_base = c->kv;
    out->v_base = c->kv + (v.v - v.k);
    out->layer_stride_bytes = c->layer_stride;
    out->k_row_bytes = v.k_row_bytes;
    out->v_row_bytes = v.v_row_bytes;
    out->k_block_bytes = v.k_block_bytes;
    out->v_block_bytes = v.v_block_bytes;
    out->v_dim = v.v_dim;
    out->n_blocks = c->n_blocks;
    out->block_tokens = c->B;
    out->n_kv_heads = c->n_kv;
    out->head_dim = c->head_dim;
    out->n_layers = c->n_layers;
    out->k_dtype = c->cfg.k_dtype;
    out->v_dtype = c->cfg.v_dtype;
    return PKV_OK;
}

/* ---- sequences -------------------------------------------------------------------------------- */
PKV_API int pkv_seq_create(pkv_cache *c, const void *salt, size_t salt_len, pkv_seq *out) {
    if (!c) return PKV_EINVAL;
    if (!out) return PKV__SAY(c, PKV_EINVAL, "out is NULL");
    if (salt_len && !salt) return PKV__SAY(c, PKV_EINVAL, "salt is NULL, salt_len %zu", salt_len);
    if (salt_len > 256) return PKV__SAY(c, PKV_EINVAL, "salt_len %zu over 256", salt_len);
    uint64_t lo, hi;
    pkv__salt_digest(salt, salt_len, &lo, &hi);
    LOCK(c);
    pkv__seq *s = pkv__seq_new(c);
    if (!s) {
        const int rc = PKV__SAY(c, PKV_ELIMIT, "%u sequences and pins are live, max_seqs %u", c->n_live, c->max_seqs);
        UNLOCK(c);
        return rc;
    }
    s->ns_lo = lo;
    s->ns_hi = hi;
    *out = pkv__seq_id(c, s);
    UNLOCK(c);
    return PKV_OK;
}

static uint32_t committed_in_block(const pkv_cache *c, const pkv__seq *s, uint32_t i) {
    uint64_t start = (uint64_t)i * c->B;
    if (s->n_committed <= start) return 0;
    return (uint32_t)PKV_MIN((uint64_t)c->B, s->n_committed - start);
}

/* When s is the sole owner of an unindexed, partly used tail block, positions past its length
 * belong to nobody (a co-holder that appended them has left): trim the block's fill to s's
 * length. Likewise a commit count above s's own committed positions in that block was set by a
 * departed co-holder: trim it to s's, so s can write the positions it has not committed. */
static void claim_tail(pkv_cache *c, pkv__seq *s) {
    uint32_t off = s->n_tokens % c->B;
    if (off == 0) return;
    uint32_t b = (uint32_t)s->table[s->n_blocks - 1];
    pkv__blk *k = &c->blk[b];
    if (k->ref != 1 || (k->flags & PKV_BLKF_INDEXED)) return;
    uint32_t own = committed_in_block(c, s, s->n_blocks - 1);
    if (s->n_blocks - 1 < pkv__seq_index_cap(c, s)) k->moved = 0; /* s's rows alone, exact (a fork's moved past them) */
    if (k->n_fill > off) pkv__pool_set_fill(&c->pool, b, off);
    if (k->n_commit > own) k->n_commit = (uint16_t)own;
    if ((k->flags & PKV_BLKF_PARTIAL) && k->n_commit == 0) pkv__partial_unlink(c, b);
}

/* s's partly filled tail block, or PKV_NONE where its blocks are full (or it has none). */
static uint32_t open_tail(const pkv_cache *c, const pkv__seq *s) {
    return s->n_tokens % c->B ? (uint32_t)s->table[s->n_blocks - 1] : PKV_NONE;
}

/* Replaces the shared or indexed tail block by a private copy of its first len % B positions. */
static void cow_tail(pkv_cache *c, pkv__seq *s) {
    uint32_t i = s->n_blocks - 1, old = (uint32_t)s->table[i], off = s->n_tokens % c->B;
    uint32_t nb = pkv__take_block(c);
    pkv_assert(nb != PKV_NONE); /* availability was checked by the caller */
    pkv__copy_block(c, nb, old, off);
    pkv__pool_set_fill(&c->pool, nb, off);
    c->blk[nb].n_commit = (uint16_t)PKV_MIN(committed_in_block(c, s, i), off);
    c->blk[nb].moved = i >= pkv__seq_index_cap(c, s);
    s->table[i] = (int32_t)nb;
    if (s->idx_len > i) s->idx_len = i;
    pkv__drop_block(c, old);
    c->cow_copies++;
}

/* What appending n > 0 positions to s takes from the FREE and CACHED blocks: PKV_ELIMIT past
 * max_blocks_per_seq, else *need, so that the append succeeds iff need <= n_free + n_cached.
 * That is the new blocks plus a copy of a shared or indexed tail (*cow), less one where the
 * copied tail is then CACHED (s held it alone, so it is indexed) and the blocks after the copy
 * may evict it; the copy itself still needs one. *back (may be NULL): 1 where that copy is the
 * only block taken, so the append leaves n_free + n_cached as it found them (its old tail is
 * CACHED after it), else 0; the append lowers n_free + n_cached by need - back. gone: holders
 * of the tail that will have copied it away before this append (pkv_batch_append's earlier
 * requests), 0 for the state as it is. pkv_seq_append, pkv_seq_append_blocks and
 * pkv_batch_append all ask here, so they never disagree. */
static int append_need(const pkv_cache *c, const pkv__seq *s, uint32_t n, uint32_t gone, uint64_t *need, bool *cow,
                       uint32_t *back, const char *api) {
    const uint64_t nb_needed = ((uint64_t)s->n_tokens + n + c->B - 1) / c->B;
    if (nb_needed > c->max_bps)
        return pkv__say(c, PKV_ELIMIT, api, "%u + %u positions take %llu blocks, past max_blocks_per_seq %u",
                        s->n_tokens, n, (unsigned long long)nb_needed, c->max_bps);
    const uint32_t tail = open_tail(c, s);
    const uint32_t ref = tail == PKV_NONE ? 0 : c->blk[tail].ref - gone;
    *cow = tail != PKV_NONE && (ref > 1 || (c->blk[tail].flags & PKV_BLKF_INDEXED));
    uint64_t take = nb_needed - s->n_blocks + (*cow ? 1 : 0);
    const bool gives_back = *cow && ref == 1; /* the old tail turns CACHED */
    if (gives_back && take > 1) take--;
    if (back) *back = gives_back && take == 1 && nb_needed == s->n_blocks;
    *need = take;
    return PKV_OK;
}

PKV_API int pkv_seq_append_blocks(pkv_cache *c, pkv_seq id, uint32_t n, uint32_t *n_blocks) {
    if (!c) return PKV_EINVAL;
    if (!n_blocks) return PKV__SAY(c, PKV_EINVAL, "n_blocks is NULL");
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    uint64_t need = 0;
    bool cow;
    if (!rc && n) rc = append_need(c, s, n, 0, &need, &cow, NULL, __func__);
    if (!rc) *n_blocks = (uint32_t)need; /* at most max_blocks_per_seq + 1 */
    UNLOCK(c);
    return rc;
}

/* Appends n > 0 positions to s, append_need having said cow and that the blocks are there. */
static void append_locked(pkv_cache *c, pkv__seq *s, const int32_t *tokens, uint32_t n, int32_t *slots_out, bool cow) {
    if (cow) cow_tail(c, s);
    else claim_tail(c, s);
    const uint32_t B = c->B;
    uint32_t pos = s->n_tokens;
    for (uint32_t j = 0; j < n;) {
        uint32_t bi = pos / B, off = pos % B;
        if (bi == s->n_blocks) {
            uint32_t b = pkv__take_block(c);
            pkv_assert(b != PKV_NONE);
            c->blk[b].moved = bi >= pkv__seq_index_cap(c, s); /* computed after rows a shift moved */
            s->table[s->n_blocks++] = (int32_t)b;
        }
        uint32_t b = (uint32_t)s->table[bi];
        uint32_t run = PKV_MIN(B - off, n - j);
        memcpy(c->tokens + (size_t)b * B + off, tokens + j, run * sizeof(int32_t));
        if (slots_out)
            for (uint32_t t = 0; t < run; t++) slots_out[j + t] = (int32_t)(b * B + off + t);
        if (c->blk[b].n_fill < off + run) pkv__pool_set_fill(&c->pool, b, off + run);
        pos += run;
        j += run;
    }
    s->n_tokens = pos;
    c->n_tokens_total += n;
    if (cow) pkv__index_after_commit(c, s); /* the copied tail may be a registrable partial */
}

PKV_API int pkv_seq_append(pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n, int32_t *slots_out) {
    if (!c) return PKV_EINVAL;
    if (n && !tokens) return PKV__SAY(c, PKV_EINVAL, "tokens is NULL, n %u", n);
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (rc || n == 0) goto out;
    uint64_t need;
    bool cow;
    rc = append_need(c, s, n, 0, &need, &cow, NULL, __func__);
    if (rc) goto out;
    if (need > (uint64_t)c->pool.n_free + c->pool.n_cached) {
        /* how an engine learns to preempt, a routine refusal: said after the lock is let go */
        const uint32_t n_free = c->pool.n_free, n_cached = c->pool.n_cached;
        UNLOCK(c);
        return PKV__SAY(c, PKV_ENOSPC, "%u positions need %llu blocks, %u FREE and %u CACHED are left", n,
                        (unsigned long long)need, n_free, n_cached);
    }
    append_locked(c, s, tokens, n, slots_out, cow);
out:
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_batch_append(pkv_cache *c, const pkv_append_req *reqs, uint32_t n_reqs, uint32_t flags,
                             uint32_t *n_done) {
    if (!c) return PKV_EINVAL;
    if (n_reqs && !reqs) return PKV__SAY(c, PKV_EINVAL, "reqs is NULL, n_reqs %u", n_reqs);
    if (flags & ~PKV_APPEND_FIT) return PKV__SAY(c, PKV_EINVAL, "unknown flags %#x", flags);
    if ((flags & PKV_APPEND_FIT) && !n_done) return PKV__SAY(c, PKV_EINVAL, "n_done is NULL with PKV_APPEND_FIT");
    for (uint32_t i = 0; i < n_reqs; i++)
        if (reqs[i].n && !reqs[i].tokens)
            return PKV__SAY(c, PKV_EINVAL, "reqs[%u].tokens is NULL, n %u", i, reqs[i].n);
    LOCK(c);
    int rc = PKV_OK;
    /* every id live and named once (mark: how many requests name it) */
    for (uint32_t i = 0; i < n_reqs && !rc; i++) {
        pkv__seq *s;
        if (!(rc = get_seq(c, reqs[i].seq, &s))) s->mark = 0;
    }
    for (uint32_t i = 0; i < n_reqs && !rc; i++)
        if (pkv__seq_get(c, reqs[i].seq)->mark++)
            rc = PKV__SAY(c, PKV_EINVAL, "reqs[%u]: sequence %#llx named twice", i, (unsigned long long)reqs[i].seq);
    /* what each append will take once the ones before it are done: as append_need counts it
       then, a shared tail's earlier holders in the batch having copied it away (chk_ref,
       scratch under the lock: copies of each tail so far), against what the appends before it
       leave (each lowers n_free + n_cached by need - back); the longest leading run that fits,
       every request's own limit checked */
    for (uint32_t i = 0; i < n_reqs && !rc; i++) {
        const uint32_t t = reqs[i].n ? open_tail(c, pkv__seq_get(c, reqs[i].seq)) : PKV_NONE;
        if (t != PKV_NONE) c->chk_ref[t] = 0;
    }
    const uint64_t avail = (uint64_t)c->pool.n_free + c->pool.n_cached;
    uint64_t used = 0, miss_need = 0, miss_left = 0; /* used: by the requests before i */
    uint32_t k = 0;
    bool fits = true;
    for (uint32_t i = 0; i < n_reqs && !rc; i++) {
        uint64_t need = 0;
        bool cow = false;
        uint32_t back = 0;
        const pkv__seq *s = pkv__seq_get(c, reqs[i].seq);
        const uint32_t t = reqs[i].n ? open_tail(c, s) : PKV_NONE;
        if (reqs[i].n)
            rc = append_need(c, s, reqs[i].n, t == PKV_NONE ? 0 : c->chk_ref[t], &need, &cow, &back, __func__);
        if (cow) c->chk_ref[t]++;
        if (rc) break;
        if (fits && used + need <= avail) {
            k = i + 1;
        } else if (fits) {
            fits = false, miss_need = need, miss_left = avail - used;
        }
        used += need - back; /* never past avail + 1 - back: used <= avail before each fit */
    }
    if (!rc && k < n_reqs && !(flags & PKV_APPEND_FIT)) {
        const uint32_t n_free = c->pool.n_free, n_cached = c->pool.n_cached;
        UNLOCK(c);
        return PKV__SAY(c, PKV_ENOSPC,
                        "request %u of %u needs %llu blocks, %llu left after the ones before it (%u FREE and %u "
                        "CACHED now)",
                        k, n_reqs, (unsigned long long)miss_need, (unsigned long long)miss_left, n_free, n_cached);
    }
    for (uint32_t i = 0; i < k && !rc; i++) {
        if (!reqs[i].n) continue;
        pkv__seq *s = pkv__seq_get(c, reqs[i].seq);
        uint64_t need;
        bool cow; /* asked again, of the state the appends before it left: what was counted */
        const int ok = append_need(c, s, reqs[i].n, 0, &need, &cow, NULL, __func__);
        pkv_assert(ok == PKV_OK);
        append_locked(c, s, reqs[i].tokens, reqs[i].n, reqs[i].slots_out, cow);
    }
    if (!rc && n_done) *n_done = k;
    UNLOCK(c);
    return rc;
}

/* The slot of row i of a write: slots[i], or position start + i of a sequence's table. */
static inline int32_t write_slot(const pkv_cache *c, const int32_t *slots, const int32_t *table, uint32_t start,
                                 uint32_t i) {
    if (slots) return slots[i];
    const uint32_t p = start + i;
    return table[p / c->B] * (int32_t)c->B + (int32_t)(p % c->B);
}

/* Whether row i may be written at slot (under the lock): said as api's refusal if not. what
 * names the row in the message ("slot 17 (row 3)" or "position 40 (row 3)"). */
static int check_write_row(pkv_cache *c, int32_t slot, uint32_t i, const char *what, uint32_t what_v,
                           const char *api) {
    const uint32_t B = c->B;
    const int64_t n_slots = (int64_t)c->n_blocks * B;
    const pkv__blk *bk = slot < 0 || slot >= n_slots ? NULL : &c->blk[(uint32_t)slot / B];
    if (!bk)
        return pkv__say(c, PKV_EINVAL, api, "slot %d (row %u) is not in [0, %lld) nor -1", slot, i,
                        (long long)n_slots);
    if (bk->state != PKV_BLK_ACTIVE)
        return pkv__say(c, PKV_EINVAL, api, "%s %u (row %u) is in block %u, which no sequence holds", what, what_v, i,
                        (uint32_t)slot / B);
    if (bk->ref != 1)
        return pkv__say(c, PKV_EINVAL, api, "%s %u (row %u) is in block %u, shared (%u holders): read-only", what,
                        what_v, i, (uint32_t)slot / B, (unsigned)bk->ref);
    if (bk->flags & PKV_BLKF_INDEXED)
        return pkv__say(c, PKV_EINVAL, api, "%s %u (row %u) is in block %u, in the prefix index: read-only", what,
                        what_v, i, (uint32_t)slot / B);
    if ((uint32_t)slot % B < bk->n_commit)
        return pkv__say(c, PKV_EINVAL, api, "%s %u (row %u) is a committed position: read-only", what, what_v, i);
    return PKV_OK;
}

/* The argument checks every write shares: something to write, a layer of the cache. */
static int check_write_target(pkv_cache *c, uint32_t layer, const void *k, const void *v, const char *api) {
    if (!k && !v) return pkv__say(c, PKV_EINVAL, api, "neither k nor v given");
    if (v && c->cfg.v_dim)
        return pkv__say(c, PKV_EINVAL, api, "v given, but V lives in K here (v_dim %u): write k alone", c->v_dim);
    if (layer >= c->n_layers) return pkv__say(c, PKV_EINVAL, api, "layer %u of %u", layer, c->n_layers);
    return PKV_OK;
}

/* Those, and the element type of a write of values (pkv_write_kv, pkv_seq_write_kv). */
static int check_write_args(pkv_cache *c, uint32_t layer, const void *k, const void *v, pkv_dtype in_dtype,
                            const char *api) {
    const int rc = check_write_target(c, layer, k, v, api);
    if (!rc && in_dtype != PKV_DTYPE_F32 && in_dtype != PKV_DTYPE_F16 && in_dtype != PKV_DTYPE_BF16)
        return pkv__say(c, PKV_EINVAL, api, "input dtype %d is not f32, f16 or bf16", (int)in_dtype);
    return rc;
}

/* in_dtype of the rows pkv_seq_write_stored copies: each side in its pool dtype, as stored (only
 * that call passes it: check_write_args refuses it from the callers of the value writes) */
#define PKV__DTYPE_STORED ((pkv_dtype)PKV_DTYPE_COUNT)

/* Bytes of one (position, kv head) row of the input: in_dtype's elements, or the pool's rows. */
static size_t in_row_bytes(const pkv_cache *c, pkv_dtype in_dtype, bool v_side) {
    if (in_dtype == PKV__DTYPE_STORED) return v_side ? c->v_row : c->k_row;
    return (size_t)c->head_dim * (in_dtype == PKV_DTYPE_F32 ? 4 : 2);
}

/* Whether the nkv rows of one position of one side (k or v) may go into the pool. */
static bool input_row_fits(const pkv_cache *c, pkv_dtype in_dtype, const void *src, pkv_dtype pool) {
    if (in_dtype == PKV__DTYPE_STORED) return pkv__stored_fits(pool, src, c->n_kv, c->head_dim);
    return pkv__input_fits(in_dtype, src, (size_t)c->n_kv * c->head_dim, pool);
}

/* Checks every value (finite, and not past what the pool's dtypes hold), then copies the rows:
 * outside the lock, once the rows' places have been checked under it. Row i goes to
 * write_slot(c, slots, table, start, i); slots[i] < 0 skips it (padding rows are not read). */
static int write_rows(pkv_cache *c, uint32_t layer, const int32_t *slots, const int32_t *table, uint32_t start,
                      uint32_t n, const void *k, const void *v, pkv_dtype in_dtype, const char *api) {
    const uint32_t d = c->head_dim, nkv = c->n_kv, B = c->B;
    const size_t k_in = in_row_bytes(c, in_dtype, false), v_in = in_row_bytes(c, in_dtype, true);
    /* checked before a byte is written, so the pool only ever holds finite K/V through these
     * calls and attention over it is defined */
    for (uint32_t i = 0; i < n; i++) {
        if (slots && slots[i] < 0) continue;
        const bool k_bad = k && !input_row_fits(c, in_dtype, (const uint8_t *)k + (size_t)i * nkv * k_in, c->cfg.k_dtype);
        if (k_bad || (v && !input_row_fits(c, in_dtype, (const uint8_t *)v + (size_t)i * nkv * v_in, c->cfg.v_dtype)))
            return pkv__say(c, PKV_EINVAL, api,
                            in_dtype == PKV__DTYPE_STORED
                                ? "row %u of %s is not a %s row the pool can hold (a scale or value not finite, "
                                  "past PKV_VALUE_MAX, or a code the encoder never writes)"
                                : "row %u of %s has a value that is not finite, or past what %s holds",
                            i, k_bad ? "k" : "v", pkv_dtype_name(k_bad ? c->cfg.k_dtype : c->cfg.v_dtype));
    }
    uint8_t *kl = c->kv + layer * c->layer_stride, *vl = kl + c->v_off;
    float tmp[1024];
    for (int pass = 0; pass < 2; pass++) {
        const uint8_t *src = pass ? v : k;
        if (!src) continue;
        uint8_t *base = pass ? vl : kl;
        size_t row = pass ? c->v_row : c->k_row, blk = pass ? c->v_blk : c->k_blk, in_row = pass ? v_in : k_in;
        pkv_dtype dt = pass ? c->cfg.v_dtype : c->cfg.k_dtype;
        for (uint32_t i = 0; i < n; i++) {
            const int32_t slot = write_slot(c, slots, table, start, i);
            if (slot < 0) continue;
            uint32_t b = (uint32_t)slot / B, off = (uint32_t)slot % B;
            for (uint32_t h = 0; h < nkv; h++) {
                const uint8_t *s = src + ((size_t)i * nkv + h) * in_row;
                uint8_t *dst = base + b * blk + ((size_t)h * B + off) * row;
                if (dt == in_dtype || in_dtype == PKV__DTYPE_STORED) {
                    memcpy(dst, s, in_row);
                } else if (in_dtype == PKV_DTYPE_F32 && ((uintptr_t)s & 3) == 0) {
                    pkv__row_encode(dt, (const float *)s, d, dst); /* no copy of f32 rows first */
                } else {
                    pkv__to_f32(in_dtype, s, d, tmp);
                    pkv__row_encode(dt, tmp, d, dst);
                }
            }
        }
    }
    return PKV_OK;
}

PKV_API int pkv_write_kv(pkv_cache *c, uint32_t layer, const int32_t *slots, uint32_t n, const void *k,
                         const void *v, pkv_dtype in_dtype) {
    if (!c) return PKV_EINVAL;
    if (n && !slots) return PKV__SAY(c, PKV_EINVAL, "slots is NULL, n %u", n);
    int rc = check_write_args(c, layer, k, v, in_dtype, __func__);
    if (rc || n == 0) return rc;
    /* Validate every slot under the lock; copy the data outside it. */
    LOCK(c);
    for (uint32_t i = 0; i < n && !rc; i++)
        if (slots[i] != -1) rc = check_write_row(c, slots[i], i, "slot", (uint32_t)slots[i], __func__);
    UNLOCK(c);
    return rc ? rc : write_rows(c, layer, slots, NULL, 0, n, k, v, in_dtype, __func__);
}

/* pkv_seq_write_kv and pkv_seq_write_stored after their argument checks. */
static int seq_write(pkv_cache *c, pkv_seq id, uint32_t layer, uint32_t start, uint32_t n, const void *k,
                     const void *v, pkv_dtype in_dtype, const char *api) {
    LOCK(c);
    pkv__seq *s;
    int rc = pkv__get_seq(c, id, &s, api);
    if (!rc) rc = check_span(c, s, start, n, api);
    for (uint32_t i = 0; i < n && !rc; i++)
        rc = check_write_row(c, write_slot(c, NULL, s->table, start, i), i, "position", start + i, api);
    /* The table is the sequence's own row of c->tables: it stays put, and nothing may change it
     * while this call runs (pkv.h, "Threads"). */
    const int32_t *table = rc ? NULL : s->table;
    UNLOCK(c);
    return rc || n == 0 ? rc : write_rows(c, layer, NULL, table, start, n, k, v, in_dtype, api);
}

PKV_API int pkv_seq_write_kv(pkv_cache *c, pkv_seq id, uint32_t layer, uint32_t start, uint32_t n, const void *k,
                             const void *v, pkv_dtype in_dtype) {
    if (!c) return PKV_EINVAL;
    int rc = check_write_args(c, layer, k, v, in_dtype, __func__);
    return rc ? rc : seq_write(c, id, layer, start, n, k, v, in_dtype, __func__);
}

PKV_API int pkv_seq_write_stored(pkv_cache *c, pkv_seq id, uint32_t layer, uint32_t start, uint32_t n,
                                 const void *k, const void *v) {
    if (!c) return PKV_EINVAL;
    int rc = check_write_target(c, layer, k, v, __func__);
    return rc ? rc : seq_write(c, id, layer, start, n, k, v, PKV__DTYPE_STORED, __func__);
}

PKV_API int pkv_seq_commit(pkv_cache *c, pkv_seq id, uint32_t n_pos) {
    if (!c) return PKV_EINVAL;
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (rc) goto out;
    if (n_pos > s->n_tokens) {
        rc = PKV__SAY(c, PKV_EINVAL, "n_pos %u past the sequence's length %u", n_pos, s->n_tokens);
        goto out;
    }
    if (n_pos <= s->n_committed) goto out;
    for (uint32_t i = PKV_MAX(s->n_committed / c->B, s->n_dropped); i < s->n_blocks && (uint64_t)i * c->B < n_pos; i++) {
        pkv__blk *k = &c->blk[s->table[i]];
        uint32_t in_block = (uint32_t)PKV_MIN((uint64_t)c->B, n_pos - (uint64_t)i * c->B);
        if (k->n_commit < in_block) k->n_commit = (uint16_t)in_block;
    }
    s->n_committed = n_pos;
    pkv__index_after_commit(c, s);
out:
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_seq_fork(pkv_cache *c, pkv_seq parent, pkv_seq *child) {
    if (!c) return PKV_EINVAL;
    if (!child) return PKV__SAY(c, PKV_EINVAL, "child is NULL");
    LOCK(c);
    pkv__seq *p;
    int rc = get_seq(c, parent, &p);
    if (rc) goto out;
    pkv__seq *s = pkv__seq_new(c);
    if (!s) {
        rc = PKV__SAY(c, PKV_ELIMIT, "%u sequences and pins are live, max_seqs %u", c->n_live, c->max_seqs);
        goto out;
    }
    pkv__seq_share(c, s, p, p->n_blocks);
    s->n_tokens = p->n_tokens;
    s->n_committed = p->n_committed;
    c->n_tokens_total += s->n_tokens;
    *child = pkv__seq_id(c, s);
out:
    UNLOCK(c);
    return rc;
}

void pkv__seq_drop_blocks(pkv_cache *c, pkv__seq *s, uint32_t keep_blocks) {
    while (s->n_blocks > keep_blocks) {
        const int32_t b = s->table[--s->n_blocks];
        if (b >= 0) pkv__drop_block(c, (uint32_t)b);
    }
}

void pkv__seq_share(pkv_cache *c, pkv__seq *dst, const pkv__seq *src, uint32_t n_blocks) {
    for (uint32_t i = 0; i < n_blocks; i++) {
        dst->table[i] = src->table[i];
        if (src->table[i] >= 0) pkv__pool_ref(&c->pool, (uint32_t)src->table[i]);
    }
    dst->n_blocks = n_blocks;
    dst->n_dropped = PKV_MIN(src->n_dropped, n_blocks);
    dst->idx_len = PKV_MIN(src->idx_len, n_blocks);
    dst->exact = src->exact;
    dst->ns_lo = src->ns_lo;
    dst->ns_hi = src->ns_hi;
}

/* s keeps positions [0, n) (n < its length), under the lock. */
static void seq_cut(pkv_cache *c, pkv__seq *s, uint32_t n) {
    const uint32_t B = c->B;
    pkv__seq_drop_blocks(c, s, (n + B - 1) / B);
    c->n_tokens_total -= s->n_tokens - n;
    s->n_tokens = n;
    if (s->n_committed > n) s->n_committed = n;
    if (s->n_reused > n) s->n_reused = n; /* of the tokens it still holds */
    if (s->idx_len > n / B) s->idx_len = n / B;
    if (s->exact != PKV_NONE && n <= s->exact) s->exact = PKV_NONE; /* what is left is exact */
    claim_tail(c, s);
}

PKV_API int pkv_seq_truncate(pkv_cache *c, pkv_seq id, uint32_t n) {
    if (!c) return PKV_EINVAL;
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc && n < s->n_tokens && n < pkv__seq_front(c, s))
        rc = PKV__SAY(c, PKV_EINVAL, "n %u is below the positions dropped (pkv_seq_drop_front: before %u)", n,
                      pkv__seq_front(c, s));
    if (!rc && n < s->n_tokens) seq_cut(c, s, n);
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_seq_drop_front(pkv_cache *c, pkv_seq id, uint32_t pos) {
    if (!c) return PKV_EINVAL;
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc && pos > s->n_tokens)
        rc = PKV__SAY(c, PKV_EINVAL, "pos %u past the sequence's length %u", pos, s->n_tokens);
    if (!rc) {
        const uint32_t j = pos / c->B; /* the blocks wholly before pos */
        for (uint32_t i = j; i > s->n_dropped; i--) { /* deepest first, as a release drops */
            /* an indexed one stays in the index (CACHED where s held it alone: in the inner
               queue where s still holds the block below it) */
            pkv__drop_block(c, (uint32_t)s->table[i - 1]);
            s->table[i - 1] = -1;
        }
        s->n_dropped = PKV_MAX(s->n_dropped, j);
    }
    UNLOCK(c);
    return rc;
}

int pkv__seq_skip(pkv_cache *c, pkv_seq id, uint32_t pos, const char *api) {
    LOCK(c);
    pkv__seq *s;
    int rc = pkv__get_seq(c, id, &s, api);
    if (!rc && (s->n_blocks != s->n_dropped || s->n_tokens != pkv__seq_front(c, s)))
        rc = pkv__say(c, PKV_EINVAL, api, "the sequence changed during the call");
    if (!rc && (pos % c->B || pos / c->B > c->max_bps))
        rc = pkv__say(c, PKV_EINVAL, api, "position %u is no block boundary within the table", pos);
    if (!rc) {
        const uint32_t nb = pos / c->B;
        for (uint32_t i = 0; i < nb; i++) s->table[i] = -1;
        c->n_tokens_total = c->n_tokens_total - s->n_tokens + pos;
        s->n_blocks = s->n_dropped = s->idx_len = nb;
        s->n_tokens = s->n_committed = pos;
        s->exact = PKV_NONE;
        s->n_reused = 0;
    }
    UNLOCK(c);
    return rc;
}

/* ---- moving positions (pkv_seq_keep, pkv_seq_shift) ----------------------------------------- */
/* A turn back by d positions of rope: the pairs' value offsets and cos / sin of -d x freq. */
typedef struct rope_turn {
    uint32_t n, dim0; /* pairs; the first value turned */
    bool neox;        /* pair i: values dim0 + i and dim0 + n + i; else dim0 + 2i and dim0 + 2i + 1 */
    double cs[512], sn[512];
} rope_turn;

/* t := rope's turn back by d positions, or PKV_EINVAL said where rope breaks pkv_rope's rules. */
static int rope_plan(const pkv_cache *c, const pkv_rope *rope, uint32_t d, rope_turn *t) {
    const uint64_t end = (uint64_t)rope->dim0 + rope->n_rot;
    if (rope->n_rot < 2 || rope->n_rot % 2 || end > c->head_dim)
        return PKV__SAY(c, PKV_EINVAL, "rope: n_rot %u must be even, at least 2, and dim0 %u + n_rot within head_dim %u",
                        rope->n_rot, rope->dim0, c->head_dim);
    if (rope->style != PKV_ROPE_NEOX && rope->style != PKV_ROPE_GPTJ)
        return PKV__SAY(c, PKV_EINVAL, "rope: style %u is neither PKV_ROPE_NEOX nor PKV_ROPE_GPTJ", rope->style);
    if (!rope->inv_freq && !(isfinite(rope->theta) && rope->theta > 0.0f))
        return PKV__SAY(c, PKV_EINVAL, "rope: theta %g is not finite and positive (and no inv_freq)", (double)rope->theta);
    t->n = rope->n_rot / 2;
    t->neox = rope->style == PKV_ROPE_NEOX, t->dim0 = rope->dim0;
    for (uint32_t i = 0; i < t->n; i++) {
        double f;
        if (rope->inv_freq) {
            if (!isfinite(rope->inv_freq[i]))
                return PKV__SAY(c, PKV_EINVAL, "rope: inv_freq[%u] is not finite", i);
            f = rope->inv_freq[i];
        } else {
            f = pow((double)rope->theta, -2.0 * i / rope->n_rot);
        }
        const double a = -(double)d * f;
        t->cs[i] = cos(a), t->sn[i] = sin(a);
    }
    return PKV_OK;
}

/* x turned by t (each pair's rotation in double: one rounding to float a value) */
static void rope_apply(const rope_turn *t, float *x) {
    const uint32_t n = t->n;
    if (t->neox) { /* two runs of n values, so the loop vectorizes */
        float *restrict u = x + t->dim0, *restrict w = x + t->dim0 + n;
        for (uint32_t i = 0; i < n; i++) {
            const double a = u[i], b = w[i];
            u[i] = (float)(a * t->cs[i] - b * t->sn[i]);
            w[i] = (float)(a * t->sn[i] + b * t->cs[i]);
        }
        return;
    }
    float *v = x + t->dim0; /* GPT-J: pairs side by side */
    for (uint32_t i = 0; i < n; i++) {
        const double a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = (float)(a * t->cs[i] - b * t->sn[i]);
        v[2 * i + 1] = (float)(a * t->sn[i] + b * t->cs[i]);
    }
}

/* The K row, and the V row, of kv head h at position pos of table, in layer l. */
static uint8_t *k_row_at(const pkv_cache *c, const int32_t *table, uint32_t l, uint32_t h, uint32_t pos) {
    return c->kv + l * c->layer_stride + (size_t)table[pos / c->B] * c->k_blk + ((size_t)h * c->B + pos % c->B) * c->k_row;
}
static uint8_t *v_row_at(const pkv_cache *c, const int32_t *table, uint32_t l, uint32_t h, uint32_t pos) {
    return c->kv + l * c->layer_stride + c->v_off + (size_t)table[pos / c->B] * c->v_blk +
           ((size_t)h * c->B + pos % c->B) * c->v_row;
}

/* Moves the rows of kv head h in layer l at n positions from `from` of table to n positions from
 * `to` on, each run within one block (to < from: a run moved down in ascending order reads every
 * row before it is written over): K turned by turn where that is not NULL (pkv_seq_shift), a row
 * at a time, else as stored, and V, as stored, by one copy a run (its rows are consecutive in the
 * block). */
static void move_rows(pkv_cache *c, const int32_t *table, uint32_t l, uint32_t h, uint32_t from, uint32_t to,
                      uint32_t n, const rope_turn *turn) {
    if (turn) {
        float x[1024];
        for (uint32_t i = 0; i < n; i++) {
            pkv__row_decode(c->cfg.k_dtype, k_row_at(c, table, l, h, from + i), c->head_dim, x);
            rope_apply(turn, x);
            pkv__row_encode(c->cfg.k_dtype, x, c->head_dim, k_row_at(c, table, l, h, to + i));
        }
    } else {
        memmove(k_row_at(c, table, l, h, to), k_row_at(c, table, l, h, from), (size_t)n * c->k_row);
    }
    if (c->v_row) memmove(v_row_at(c, table, l, h, to), v_row_at(c, table, l, h, from), (size_t)n * c->v_row);
}

/* Moves position from of table to position to's token id. */
static void move_token(pkv_cache *c, const int32_t *table, uint32_t from, uint32_t to) {
    c->tokens[(size_t)table[to / c->B] * c->B + to % c->B] = c->tokens[(size_t)table[from / c->B] * c->B + from % c->B];
}

/* Moves position from of table to position to: its token id and every layer's K and V rows. */
static void move_position(pkv_cache *c, const int32_t *table, uint32_t from, uint32_t to) {
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint32_t h = 0; h < c->n_kv; h++) move_rows(c, table, l, h, from, to, 1, NULL);
    move_token(c, table, from, to);
}

/* s's positions from `from` on hold rows moved by a shift or computed after them: its exact part
 * ends there, and its blocks from that one's on are marked (none indexed: pkv_seq_keep and
 * pkv_seq_shift write only into blocks s holds alone outside the index; a partial s registered
 * there is unlinked). */
static void seq_mark_moved(pkv_cache *c, pkv__seq *s, uint32_t from) {
    s->exact = s->exact == PKV_NONE ? from : PKV_MIN(s->exact, from);
    if (s->idx_len > from / c->B) s->idx_len = from / c->B;
    for (uint32_t i = PKV_MAX(from / c->B, s->n_dropped); i < s->n_blocks; i++) {
        pkv__blk *k = &c->blk[s->table[i]];
        pkv_assert(!(k->flags & PKV_BLKF_INDEXED));
        if (k->flags & PKV_BLKF_PARTIAL) pkv__partial_unlink(c, (uint32_t)s->table[i]);
        k->moved = 1;
    }
}

PKV_API int pkv_seq_keep(pkv_cache *c, pkv_seq id, uint32_t start, const uint32_t *idx, uint32_t n) {
    if (!c) return PKV_EINVAL;
    if (n && !idx) return PKV__SAY(c, PKV_EINVAL, "idx is NULL, n %u", n);
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc && (start < s->n_committed || start < pkv__seq_front(c, s) || start > s->n_tokens))
        rc = PKV__SAY(c, PKV_EINVAL, "start %u is not in [max(committed %u, dropped %u), length %u]", start,
                      s->n_committed, pkv__seq_front(c, s), s->n_tokens);
    for (uint32_t k = 0; k < n && !rc; k++)
        if ((k && idx[k] <= idx[k - 1]) || (uint64_t)start + idx[k] >= s->n_tokens)
            rc = PKV__SAY(c, PKV_EINVAL, "idx[%u] = %u: not ascending, or past the length %u (start %u)", k, idx[k],
                          s->n_tokens, start);
    /* every position written to is one pkv_seq_write_kv could write (s's alone, not committed) */
    for (uint32_t k = 0; k < n && !rc; k++)
        if (idx[k] != k) rc = check_write_row(c, write_slot(c, NULL, s->table, start, k), k, "position", start + k, __func__);
    if (!rc) {
        /* ascending: position start + k is written after every position it held was read */
        for (uint32_t k = 0; k < n; k++)
            if (idx[k] != k) move_position(c, s->table, start + idx[k], start + k);
        /* after a shift, the first position kept from past s's exact part (pkv_seq_shift) is
           where its inexact rows now begin (a position written, so its block is s's alone) */
        if (s->exact != PKV_NONE) {
            uint32_t k = 0;
            while (k < n && start + idx[k] < s->exact) k++;
            if (k < n && start + k < s->exact) seq_mark_moved(c, s, start + k);
        }
        if (start + n < s->n_tokens) seq_cut(c, s, start + n);
    }
    UNLOCK(c);
    return rc;
}

/* Whether the K rows of kv head h in layer l at positions [p0, p1) of table, one block's, turned
 * by any rotation, certainly hold values the pool's dtype holds: a turn keeps each pair's norm,
 * at most sqrt(2) x the row's largest magnitude M, and its double result is rounded once to
 * float, so M x 1.5 under the first magnitude pkv__input_fits refuses (65520 for f16, else
 * PKV_VALUE_MAX) is enough. q8_0 and q4_0 rows hold at most 127 x 65504 in magnitude: always;
 * fp8 rows at most 448 x their scale. false: turn them to tell (rope_check). */
static bool turn_fits(const pkv_cache *c, const int32_t *table, uint32_t l, uint32_t h, uint32_t p0, uint32_t p1) {
    const pkv_dtype dt = c->cfg.k_dtype;
    const float lim = dt == PKV_DTYPE_F16 ? 65520.0f : pkv__bits_f32(PKV__VALUE_MAX_BITS);
    const uint8_t *r = k_row_at(c, table, l, h, p0);
    switch (dt) {
    case PKV_DTYPE_Q8_0:
    case PKV_DTYPE_Q4_0: return true;
    case PKV_DTYPE_FP8_E4M3:
        for (uint32_t p = p0; p < p1; p++, r += c->k_row) {
            float sc;
            memcpy(&sc, r, sizeof sc);
            if (!(sc * 448.0f * 1.5f < lim)) return false;
        }
        return true;
    default: {
        const uint32_t bits = pkv__max_abs_bits(dt, r, (size_t)(p1 - p0) * c->head_dim);
        const float m = dt == PKV_DTYPE_F32    ? pkv__bits_f32(bits)
                        : dt == PKV_DTYPE_F16 ? pkv__f16_to_f32((uint16_t)bits)
                                              : pkv__bf16_to_f32((uint16_t)bits);
        return m * 1.5f < lim; /* NaN: false */
    }
    }
}

/* Whether every K row of positions [from, to) of table, turned by t, is one the pool holds; else
 * PKV_EINVAL said, naming the first that is not. Rows turn_fits clears are not turned: a block's
 * rows a scan of their magnitudes, or (q8_0, q4_0) nothing. */
static int rope_check(pkv_cache *c, const int32_t *table, uint32_t from, uint32_t to, const rope_turn *t) {
    float x[1024];
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint32_t h = 0; h < c->n_kv; h++)
            for (uint32_t p0 = from; p0 < to;) {
                const uint32_t p1 = PKV_MIN(to, (p0 / c->B + 1) * c->B);
                if (!turn_fits(c, table, l, h, p0, p1))
                    for (uint32_t p = p0; p < p1; p++) {
                        pkv__row_decode(c->cfg.k_dtype, k_row_at(c, table, l, h, p), c->head_dim, x);
                        rope_apply(t, x);
                        if (!pkv__input_fits(PKV_DTYPE_F32, x, c->head_dim, c->cfg.k_dtype))
                            return PKV__SAY(c, PKV_EINVAL,
                                            "position %u, layer %u, kv head %u: K turned holds a value past what %s holds", p,
                                            l, h, pkv_dtype_name(c->cfg.k_dtype));
                    }
                p0 = p1;
            }
    return PKV_OK;
}

/* Whether block b must be copied before s writes into it: shared or in the prefix index. */
static bool shift_copies(const pkv_cache *c, uint32_t b) {
    return c->blk[b].ref > 1 || (c->blk[b].flags & PKV_BLKF_INDEXED);
}

/* The rows of a shift move, and its turn is checked, without the cache's lock: every other call
 * goes on meanwhile (a shift of 32768 positions over 8 layers of f16 took 0.3 s, stop 96). s is
 * the caller's alone for the call (pkv.h: a call that changes s overlaps none that names or reads
 * it), so its table stays as it is; the blocks the rows move into are s's alone and outside the
 * index (the copies below are made under the lock first), so no other call reads or moves them;
 * and the blocks the check reads are held by s, so none is freed or moved. The token ids, the
 * counts and the marks change under the lock after the rows, as one step. */
PKV_API int pkv_seq_shift(pkv_cache *c, pkv_seq id, uint32_t from, uint32_t to, const pkv_rope *rope) {
    if (!c) return PKV_EINVAL;
    if (from > to) return PKV__SAY(c, PKV_EINVAL, "from %u is past to %u", from, to);
    const uint32_t B = c->B, d = to - from;
    rope_turn turn;
    turn.n = 0;
    if (rope && rope_plan(c, rope, d, &turn)) return PKV_EINVAL;
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc && to > s->n_tokens) rc = PKV__SAY(c, PKV_EINVAL, "to %u is past the sequence's length %u", to, s->n_tokens);
    if (!rc && from < pkv__seq_front(c, s))
        rc = PKV__SAY(c, PKV_EINVAL, "from %u is inside the dropped front (pkv_seq_drop_front: before %u)", from,
                      pkv__seq_front(c, s));
    if (rc || !d) goto out;
    if (to == s->n_tokens) { /* nothing moves: a truncate */
        seq_cut(c, s, from);
        goto out;
    }
    const uint32_t n0 = s->n_tokens, front = s->n_dropped;
    if (rope) { /* before anything changes; s's rows as they are, without the lock (above) */
        UNLOCK(c);
        rc = rope_check(c, s->table, to, n0, &turn);
        LOCK(c);
        /* a call that changed s meanwhile broke pkv.h's rule: where it changed s's length or
           front (what this can see), refused rather than go on from stale counts */
        if (!rc && (rc = get_seq(c, id, &s)) == PKV_OK && (s->n_tokens != n0 || s->n_dropped != front))
            rc = PKV__SAY(c, PKV_EINVAL, "the sequence changed during the call");
        if (rc) goto out;
    }
    const uint32_t len = n0 - d, first = from / B, nb = (len + B - 1) / B; /* blocks [first, nb) written */
    /* the copies, one after another: each takes a block, and one s held alone (indexed) goes
       CACHED, to be had by the next */
    uint64_t avail = (uint64_t)c->pool.n_free + c->pool.n_cached;
    for (uint32_t i = first; i < nb; i++) {
        const uint32_t b = (uint32_t)s->table[i];
        if (!shift_copies(c, b)) continue;
        if (!avail) {
            rc = PKV__SAY(c, PKV_ENOSPC, "block %u of the sequence is shared or indexed, and no block is free for its copy",
                          i);
            goto out;
        }
        avail = avail - 1 + (c->blk[b].ref == 1);
    }
    /* the partials s holds alone there unlinked first: a take below may evict an indexed twin,
       which would hand its place to one (pkv__index_hand_over), a copy not counted */
    for (uint32_t i = first; i < nb; i++) {
        const uint32_t b = (uint32_t)s->table[i];
        if (!shift_copies(c, b) && (c->blk[b].flags & PKV_BLKF_PARTIAL)) pkv__partial_unlink(c, b);
    }
    for (uint32_t i = first; i < nb; i++) {
        const uint32_t b = (uint32_t)s->table[i], used = PKV_MIN(B, n0 - i * B);
        if (shift_copies(c, b)) {
            const uint32_t nb2 = pkv__take_block(c);
            pkv_assert(nb2 != PKV_NONE); /* counted above */
            pkv__copy_block(c, nb2, b, used);
            pkv__pool_set_fill(&c->pool, nb2, used);
            s->table[i] = (int32_t)nb2;
            pkv__drop_block(c, b);
            c->cow_copies++;
        }
    }
    /* ascending: each position is written after the one it takes was read (p + d > p); a run of
       rows within one source and one target block at a time, one copy a kv head (position by
       position across layers and heads had taken twice as long as a kv head's rows at a time;
       runs, stop 96: the same as the latter). Without the lock (above); meanwhile s's record is
       half changed (its copies replace shared and indexed blocks, its chain and counts are the
       old ones), so pkv_cache_check checks only its references to blocks (s->shifting). */
    s->shifting = 1;
    UNLOCK(c);
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint32_t p = from, n; p < len; p += n) { /* runs within one source and one target block */
            n = PKV_MIN(len - p, PKV_MIN(B - p % B, B - (p + d) % B));
            for (uint32_t h = 0; h < c->n_kv; h++) move_rows(c, s->table, l, h, p + d, p, n, rope ? &turn : NULL);
        }
    LOCK(c);
    s->shifting = 0;
    for (uint32_t p = from; p < len; p++) move_token(c, s->table, p + d, p);
    const uint32_t com = s->n_committed <= from ? s->n_committed : s->n_committed >= to ? s->n_committed - d : from;
    pkv__seq_drop_blocks(c, s, nb);
    c->n_tokens_total -= d;
    s->n_tokens = len;
    s->n_committed = com;
    if (s->n_reused > from) s->n_reused = from;
    for (uint32_t i = first; i < nb; i++) { /* s's own blocks now: its fill and commits */
        const uint32_t b = (uint32_t)s->table[i];
        pkv__pool_set_fill(&c->pool, b, PKV_MIN(B, len - i * B));
        c->blk[b].n_commit = (uint16_t)committed_in_block(c, s, i);
    }
    seq_mark_moved(c, s, from); /* whoever holds them later: never indexed */
out:
    UNLOCK(c);
    return rc;
}

/* Exchanges the contents of blocks x and y: K/V of every layer through a small buffer, and the
 * token ids. */
static void swap_content(pkv_cache *c, uint32_t x, uint32_t y) {
    uint8_t tmp[4096];
    for (uint32_t l = 0; l < c->n_layers; l++) {
        uint8_t *k = c->kv + l * c->layer_stride, *v = k + c->v_off;
        uint8_t *runs[2][2] = {{k + x * c->k_blk, k + y * c->k_blk}, {v + x * c->v_blk, v + y * c->v_blk}};
        const size_t bytes[2] = {c->k_blk, c->v_blk};
        for (int kv = 0; kv < 2; kv++)
            for (size_t o = 0; o < bytes[kv]; o += sizeof tmp) {
                const size_t n = PKV_MIN(sizeof tmp, bytes[kv] - o);
                memcpy(tmp, runs[kv][0] + o, n);
                memcpy(runs[kv][0] + o, runs[kv][1] + o, n);
                memcpy(runs[kv][1] + o, tmp, n);
            }
    }
    int32_t *tx = c->tokens + (size_t)x * c->B, *ty = c->tokens + (size_t)y * c->B;
    for (uint32_t j = 0; j < c->B; j++) {
        const int32_t t = tx[j];
        tx[j] = ty[j], ty[j] = t;
    }
}

/* x and y exchanged: the id rename of exchange_blocks. */
static uint32_t renamed(uint32_t v, uint32_t x, uint32_t y) { return v == x ? y : v == y ? x : v; }

/* Adds b to the list of blocks whose links exchange_blocks renames (once each: a rename twice
 * would undo itself). */
static void add_linked(uint32_t *list, uint32_t *n, uint32_t b) {
    if (b == PKV_NONE) return;
    for (uint32_t i = 0; i < *n; i++)
        if (list[i] == b) return;
    list[(*n)++] = b;
}

/* Exchanges blocks x and y whole (x != y, each CACHED or ACTIVE): contents, records (state,
 * refcount, counts, index fields, queue links) and every link that names either, so that each
 * one's content and identity live at the other's id afterwards: its place in the LRU queue, in
 * its hash chain and in the index tree (parent or root list, siblings, children) go with it.
 * The block tables that name an ACTIVE one are the caller's to rename. No count changes. */
static void exchange_blocks(pkv_cache *c, uint32_t x, uint32_t y) {
    /* the blocks whose links may name x or y, children aside: the two, their queue and tree
       neighbours and their hash chains' predecessors */
    uint32_t linked[16], n = 0, heads[2] = {PKV_NONE, PKV_NONE};
    uint32_t *root_heads[2] = {NULL, NULL}; /* the root list heads among them */
    const uint32_t xy[2] = {x, y};
    for (int i = 0; i < 2; i++) {
        const pkv__blk *k = &c->blk[xy[i]];
        pkv_assert(k->state != PKV_BLK_FREE); /* the free queue's ends are not renamed */
        add_linked(linked, &n, xy[i]);
        add_linked(linked, &n, k->qprev), add_linked(linked, &n, k->qnext);
        add_linked(linked, &n, k->parent), add_linked(linked, &n, k->sib_prev), add_linked(linked, &n, k->sib_next);
        if ((k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL)) && k->parent == PKV_NONE && k->sib_prev == PKV_NONE)
            root_heads[i] = pkv__tree_head(c, xy[i]);
        if (k->flags & PKV_BLKF_INDEXED) {
            heads[i] = (uint32_t)(k->hash & c->bucket_mask);
            for (uint32_t b = c->buckets[heads[i]]; b != xy[i]; b = c->blk[b].hnext) {
                pkv_assert(b != PKV_NONE);
                if (c->blk[b].hnext == xy[i]) add_linked(linked, &n, b);
            }
        }
    }
    const pkv__blk bx = c->blk[x];
    c->blk[x] = c->blk[y], c->blk[y] = bx;
    for (uint32_t i = 0; i < n; i++) {
        pkv__blk *k = &c->blk[renamed(linked[i], x, y)];
        k->qprev = renamed(k->qprev, x, y), k->qnext = renamed(k->qnext, x, y);
        k->parent = renamed(k->parent, x, y), k->hnext = renamed(k->hnext, x, y);
        k->child = renamed(k->child, x, y);
        k->sib_prev = renamed(k->sib_prev, x, y), k->sib_next = renamed(k->sib_next, x, y);
    }
    for (int i = 0; i < 2; i++) /* the children name their parent */
        for (uint32_t ch = c->blk[xy[i]].child; ch != PKV_NONE; ch = c->blk[ch].sib_next) c->blk[ch].parent = xy[i];
    pkv__pool *p = &c->pool;
    p->lru_head = renamed(p->lru_head, x, y), p->lru_tail = renamed(p->lru_tail, x, y);
    p->inner_head = renamed(p->inner_head, x, y), p->inner_tail = renamed(p->inner_tail, x, y);
    if (heads[0] != PKV_NONE) c->buckets[heads[0]] = renamed(c->buckets[heads[0]], x, y);
    if (heads[1] != PKV_NONE && heads[1] != heads[0]) c->buckets[heads[1]] = renamed(c->buckets[heads[1]], x, y);
    if (root_heads[0]) *root_heads[0] = renamed(*root_heads[0], x, y);
    if (root_heads[1] && root_heads[1] != root_heads[0]) *root_heads[1] = renamed(*root_heads[1], x, y);
    swap_content(c, x, y);
}

/* table[i] of s, which s alone holds, takes id t by exchange with what t holds (a CACHED block,
 * or another's entry, whose table is the caller's to mend). */
static void exchange_entry(pkv_cache *c, pkv__seq *s, uint32_t i, uint32_t t) {
    exchange_blocks(c, (uint32_t)s->table[i], t);
    s->table[i] = (int32_t)t;
}

/* Moves block table[i] of s, which s alone holds, into block dst, FREE or a CACHED leaf (which
 * is evicted first, as an append would): K/V of every layer and the token ids (dst is nobody's
 * then), its place in the prefix index, then the counts. The source is freed before dst is
 * made ACTIVE, so the counts (peak_active too) never see both in use. */
static void move_block(pkv_cache *c, pkv__seq *s, uint32_t i, uint32_t dst) {
    const uint32_t src = (uint32_t)s->table[i];
    if (c->blk[dst].state == PKV_BLK_CACHED) evict(c, dst); /* PKV_COMPACT_EVICT: a leaf */
    else pkv__pool_free_remove(&c->pool, dst);
    const pkv__blk was = c->blk[src]; /* its counts and index fields, for dst once it is ACTIVE */
    pkv__copy_block(c, dst, src, was.n_fill);
    if (was.flags) pkv__index_repoint(c, src, dst);
    pkv__drop_block(c, src);
    pkv__pool_activate(&c->pool, dst);
    pkv__pool_set_fill(&c->pool, dst, was.n_fill);
    pkv__blk *d = &c->blk[dst];
    d->n_commit = was.n_commit;
    d->moved = was.moved;
    if (was.flags) pkv__index_fields_copy(d, &was);
    s->table[i] = (int32_t)dst;
}

/* Whether block b may move: s alone holds it (no fork, no pin shares it). An indexed block
 * moves with its index entry. */
static bool movable(const pkv_cache *c, uint32_t b) { return c->blk[b].ref == 1; }

/* Length of the run of consecutive ids of s's table that starts at index i. */
static uint32_t run_at(const pkv__seq *s, uint32_t i) {
    uint32_t len = 1;
    while (i + len < s->n_blocks && s->table[i + len] == s->table[i + len - 1] + 1) len++;
    return len;
}

/* Whether the len blocks from id `from` may move to ids [to, to + len): each movable, each
 * target FREE, one of the run's own (a shift by less than the run's length), with
 * PKV_COMPACT_CACHED any CACHED block (exchanged), or with PKV_COMPACT_EVICT a CACHED leaf of the
 * index (what eviction may take). */
static bool run_fits(const pkv_cache *c, uint32_t flags, uint32_t from, uint32_t len, int64_t to) {
    if (to < 0 || to == from || to + len > c->n_blocks) return false;
    for (uint32_t j = 0; j < len; j++) {
        const uint64_t t = (uint64_t)to + j;
        const pkv__blk *k = &c->blk[t];
        const bool cached = k->state == PKV_BLK_CACHED;
        const bool leaf = cached && k->child == PKV_NONE && k->n_children == 0;
        const bool room = k->state == PKV_BLK_FREE || (cached && (flags & PKV_COMPACT_CACHED)) ||
                          (leaf && (flags & PKV_COMPACT_EVICT));
        if (!movable(c, from + j) || (!room && (t < from || t >= from + len))) return false;
    }
    return true;
}

/* Moves table[i .. i + len) to ids [to, to + len), from the end it moves towards, so that each
 * target is free (or, with PKV_COMPACT_CACHED, CACHED: exchanged) when its turn comes. Returns
 * the blocks copied. */
static uint32_t move_run(pkv_cache *c, pkv__seq *s, uint32_t flags, uint32_t i, uint32_t len, uint32_t to) {
    const bool down = to < (uint32_t)s->table[i];
    uint32_t copies = 0;
    for (uint32_t j = 0; j < len; j++) {
        const uint32_t k = down ? j : len - 1 - j;
        if ((flags & PKV_COMPACT_CACHED) && c->blk[to + k].state == PKV_BLK_CACHED) {
            exchange_entry(c, s, i + k, to + k);
            copies += 2;
        } else {
            move_block(c, s, i + k, to + k);
            copies++;
        }
    }
    return copies;
}

PKV_API int pkv_seq_compact(pkv_cache *c, pkv_seq id, uint32_t flags, uint32_t *n_moved) {
    if (!c) return PKV_EINVAL;
    if (flags & ~(uint32_t)(PKV_COMPACT_EVICT | PKV_COMPACT_CACHED))
        return PKV__SAY(c, PKV_EINVAL, "unknown flags %#x", flags);
    LOCK(c);
    pkv__seq *s;
    uint32_t moved = 0;
    int rc = get_seq(c, id, &s);
    /* table[p0 .. i) is a run; at each gap, the cheaper of the two runs beside it that fits
       moves to meet the other, and they go on as one */
    const uint32_t first = rc ? 0 : s->n_dropped; /* (a dropped front's entries are no blocks) */
    for (uint32_t p0 = first, i = rc || first == s->n_blocks ? UINT32_MAX : first + run_at(s, first);
         !rc && i < s->n_blocks;) {
        const uint32_t len = run_at(s, i), plen = i - p0;
        const uint32_t next = (uint32_t)s->table[i], prev = (uint32_t)s->table[p0];
        const uint32_t after = (uint32_t)s->table[i - 1] + 1; /* the id that would join the runs */
        if (next == after) { /* met by the move before */
            i += len;
            continue;
        }
        const bool a = run_fits(c, flags, next, len, after);
        const bool b = run_fits(c, flags, prev, plen, (int64_t)next - plen);
        if (a && (!b || len <= plen)) moved += move_run(c, s, flags, i, len, after);
        else if (b) moved += move_run(c, s, flags, p0, plen, next - plen);
        else p0 = i;
        i += len;
    }
    if (!rc && n_moved) *n_moved = moved;
    UNLOCK(c);
    return rc;
}

/* pkv_batch_compact. The owner map (the checker's scratch, under the lock) holds, for each id,
 * in own_seq: the slot of the sequence whose entry (block it alone holds) lies there, with the
 * entry's table index in own_at; or one of the marks below; or PKV_NONE. */
/* closed to the layout: a kept or placed sequence's entry, a FREE id inside a kept sequence's
   span, or a FREE id kept as slack */
#define OWN_CLOSED (PKV_NONE - 1)
/* In own_at beside a table index: the id is a placed sequence's slack, held by an entry not
 * placed yet (it moves out when its turn comes). */
#define OWN_SLACK 0x80000000u
/* pkv__seq.mark once a sequence is kept or laid out (before: its count of groups) */
#define MARK_DONE UINT32_MAX

typedef struct bc_map {
    uint32_t *seq, *at;
    bool cached; /* PKV_BATCH_CACHED: CACHED blocks are open too */
} bc_map;

static bool bc_entry(const bc_map *w, uint32_t t) { return w->seq[t] < OWN_CLOSED; }

/* Whether id t is closed to the layout: kept, placed, or a placed sequence's slack. */
static bool bc_closed(const bc_map *w, uint32_t t) {
    return w->seq[t] == OWN_CLOSED || (bc_entry(w, t) && (w->at[t] & OWN_SLACK));
}

/* Whether t is FREE, or CACHED where those are open. */
static bool bc_room(const pkv_cache *c, const bc_map *w, uint32_t t) {
    return c->blk[t].state == PKV_BLK_FREE || (w->cached && c->blk[t].state == PKV_BLK_CACHED);
}

/* Whether the layout may use id t: FREE (or CACHED, where open), or the entry of a sequence not
 * placed yet. */
static bool bc_open(const pkv_cache *c, const bc_map *w, uint32_t t) {
    return !bc_closed(w, t) && (bc_room(c, w, t) || bc_entry(w, t));
}

/* Whether x is entry p of the sequence in slot. */
static bool bc_is(const bc_map *w, uint32_t x, uint32_t slot, uint32_t p) {
    return w->seq[x] == slot && (w->at[x] & ~OWN_SLACK) == p;
}

/* The first of m ids from u on that the layout may use, with no closed id among them (others,
 * such as CACHED blocks, lie between), or PKV_NONE. `at_u`: only the stretch from u itself.
 * `only` (a slot, or PKV_NONE): ids that hold another sequence's entry count as closed (a clean
 * stretch: FREE ids and that sequence's own entries). */
static uint32_t bc_stretch(const pkv_cache *c, const bc_map *w, uint32_t u, uint32_t m, bool at_u, uint32_t only) {
    for (uint32_t start = PKV_NONE, room = 0; u < c->n_blocks; u++) {
        if (bc_closed(w, u) || (only != PKV_NONE && bc_entry(w, u) && w->seq[u] != only)) {
            if (at_u) return PKV_NONE;
            room = 0;
        } else if (bc_open(c, w, u)) {
            if (room++ == 0) start = u;
            if (room == m) return start;
        }
    }
    return PKV_NONE;
}

/* How many closed spans a layout of m entries from id t crosses. */
static uint32_t bc_crossed(const pkv_cache *c, const bc_map *w, uint32_t t, uint32_t m) {
    uint32_t crossed = 0;
    for (bool closed = false; m && t < c->n_blocks; t++) {
        if (bc_closed(w, t)) closed = true;
        else if (bc_open(c, w, t)) crossed += closed, closed = false, m--;
    }
    return crossed;
}

/* How many of s's entries already lie where a layout from id t puts them. */
static uint32_t bc_in_place(const pkv_cache *c, const bc_map *w, const pkv__seq *s, uint32_t slot, uint32_t t) {
    uint32_t hits = 0;
    for (uint32_t p = s->n_dropped; p < s->n_blocks && t < c->n_blocks; p++) {
        const uint32_t x = (uint32_t)s->table[p];
        if (!bc_is(w, x, slot, p)) continue;
        while (t < c->n_blocks && !bc_open(c, w, t)) t++;
        hits += x == t++;
    }
    return hits;
}

/* Places the entries of s in table order from id t on, over the ids the layout may use, then
 * closes `per` ids after them as slack. Returns the blocks copied. */
static uint32_t bc_place(pkv_cache *c, bc_map *w, pkv__seq *s, uint32_t slot, uint32_t t, uint32_t per) {
    uint32_t moved = 0;
    for (uint32_t p = s->n_dropped; p < s->n_blocks; p++) {
        const uint32_t x = (uint32_t)s->table[p];
        if (!bc_is(w, x, slot, p)) continue; /* shared: stays */
        while (t < c->n_blocks && !bc_open(c, w, t)) t++;
        if (t >= c->n_blocks) break;
        /* what x is once its entry has moved out (FREE or the CACHED block from t): closed if it
           is a placed one's slack */
        const uint32_t x_seq = w->at[x] & OWN_SLACK ? OWN_CLOSED : PKV_NONE;
        if (x != t && c->blk[t].state == PKV_BLK_FREE) {
            move_block(c, s, p, t);
            w->seq[x] = x_seq, w->at[x] = PKV_NONE;
            moved++;
        } else if (x != t) { /* exchanged with an entry not placed yet, or a CACHED block */
            const bool entry = bc_entry(w, t);
            exchange_entry(c, s, p, t);
            if (entry) {
                const uint32_t op = w->at[t] & ~OWN_SLACK; /* t held entry op of another */
                c->seqs[w->seq[t]].table[op] = (int32_t)x;
                w->seq[x] = w->seq[t], w->at[x] = op | (w->at[x] & OWN_SLACK);
            } else {
                w->seq[x] = x_seq, w->at[x] = PKV_NONE;
            }
            moved += 2;
        }
        w->seq[t] = OWN_CLOSED, w->at[t] = PKV_NONE; /* placed */
        t++;
    }
    for (uint32_t k = 0; k < per && t < c->n_blocks; t++) /* its slack */
        if (bc_open(c, w, t)) {
            if (bc_room(c, w, t)) w->seq[t] = OWN_CLOSED, w->at[t] = PKV_NONE;
            else w->at[t] |= OWN_SLACK;
            k++;
        }
    return moved;
}

/* Closes s's entries where they lie: it stays, and the others go round it. */
static void bc_stay(bc_map *w, pkv__seq *s, uint32_t slot) {
    for (uint32_t p = s->n_dropped; p < s->n_blocks; p++)
        if (bc_is(w, (uint32_t)s->table[p], slot, p)) w->seq[s->table[p]] = OWN_CLOSED, w->at[s->table[p]] = PKV_NONE;
}

/* The cursor of a pass over the batch: the lowest id that may be open, and the fewest open ids
 * a stretch was not found for. */
typedef struct bc_pass {
    uint32_t lo, none;
} bc_pass;

/* Of the stretch from s's first entry and the lowest one (both of want ids, clean where `only`
 * names s), the one that holds more of its entries in place, the lowest on a tie; or PKV_NONE. */
static uint32_t bc_pick(const pkv_cache *c, const bc_map *w, const pkv__seq *s, uint32_t slot, uint32_t home,
                        uint32_t want, bool from_home, bool lowest, uint32_t only, bc_pass *ps) {
    while (ps->lo < c->n_blocks && !bc_open(c, w, ps->lo)) ps->lo++;
    const uint32_t t = from_home ? bc_stretch(c, w, home, want, true, only) : PKV_NONE;
    /* over the open ids (only == PKV_NONE) they only close as the pass goes on: a length not
       found is not found later either; a clean stretch depends on whose entries it may hold */
    const uint32_t low = lowest && (only != PKV_NONE || want < ps->none) ? bc_stretch(c, w, ps->lo, want, false, only)
                                                                         : PKV_NONE;
    if (lowest && only == PKV_NONE && low == PKV_NONE) ps->none = PKV_MIN(ps->none, want);
    if (t == PKV_NONE || (low != PKV_NONE && low != t && bc_in_place(c, w, s, slot, low) >= bc_in_place(c, w, s, slot, t)))
        return low;
    return t;
}

/* Lays out one sequence that moves, in one of three passes (PKV_BATCH_REPACK: the last alone).
 * The first two take a clean stretch (FREE ids and its own entries, so nobody else is moved):
 * the one from its first entry, or for a scattered sequence (no run of consecutive ids holds
 * more than half its entries) the better of that and the lowest; each with its slack, else
 * without. A sequence that is not scattered and finds none in the second pass (after the first
 * has moved others away) stays. The last (the scattered ones left, or with PKV_BATCH_REPACK
 * every one) takes a stretch over the entries of those not laid out yet, which are exchanged
 * away: the better of the one from its first entry and the lowest (with PKV_BATCH_REPACK the
 * lowest), else across the closed spans from the lowest open id where that halves its groups
 * (always with PKV_BATCH_REPACK), else it stays. Returns the blocks copied. */
static uint32_t bc_seq(pkv_cache *c, bc_map *w, pkv__seq *s, uint32_t per, bool repack, int pass, bc_pass *ps) {
    const uint32_t slot = (uint32_t)(s - c->seqs), groups = s->mark;
    uint32_t m = 0, home = PKV_NONE, run = 0, longest = 0;
    for (uint32_t p = s->n_dropped, prev = PKV_NONE; p < s->n_blocks; p++) {
        const uint32_t x = (uint32_t)s->table[p];
        if (!bc_is(w, x, slot, p)) continue;
        if (!m++) home = x;
        run = prev != PKV_NONE && x == prev + 1 ? run + 1 : 1;
        longest = PKV_MAX(longest, run);
        prev = x;
    }
    const bool scattered = 2 * longest <= m;
    if (!m) {
        s->mark = MARK_DONE;
        return 0;
    }
    uint32_t t;
    if (pass < 2) {
        t = bc_pick(c, w, s, slot, home, m + per, true, scattered, slot, ps);
        if (t == PKV_NONE && per && pass == 1) { /* where it lies, without its slack */
            t = bc_pick(c, w, s, slot, home, m, true, false, slot, ps);
            per = 0;
        }
        if (t == PKV_NONE && (pass == 0 || scattered)) return 0; /* to a later pass */
    } else {
        t = bc_pick(c, w, s, slot, home, m + per, !repack, true, PKV_NONE, ps);
        if (t == PKV_NONE && (repack || 2 * (bc_crossed(c, w, ps->lo, m) + 1) <= groups)) t = ps->lo; /* across */
    }
    s->mark = MARK_DONE;
    if (t == PKV_NONE) {
        bc_stay(w, s, slot);
        return 0;
    }
    return bc_place(c, w, s, slot, t, per);
}

PKV_API int pkv_batch_compact(pkv_cache *c, const pkv_seq *seqs, uint32_t n, uint32_t slack, uint32_t flags,
                              uint32_t *n_moved) {
    if (!c) return PKV_EINVAL;
    if (n && !seqs) return PKV__SAY(c, PKV_EINVAL, "seqs is NULL, n %u", n);
    if (flags & ~(uint32_t)(PKV_BATCH_REPACK | PKV_BATCH_CACHED)) return PKV__SAY(c, PKV_EINVAL, "unknown flags %#x", flags);
    const bool repack = flags & PKV_BATCH_REPACK;
    LOCK(c);
    bc_map w = {c->chk_pos, c->chk_ref, (flags & PKV_BATCH_CACHED) != 0};
    uint32_t moved = 0;
    for (uint32_t b = 0; b < c->n_blocks; b++) w.at[b] = w.seq[b] = PKV_NONE;
    int rc = PKV_OK;
    for (uint32_t i = 0; i < n && !rc; i++) {
        pkv__seq *s;
        rc = get_seq(c, seqs[i], &s);
        for (uint32_t p = rc ? 0 : s->n_dropped; !rc && p < s->n_blocks; p++) {
            const uint32_t b = (uint32_t)s->table[p];
            if (!movable(c, b)) continue;
            if (w.at[b] != PKV_NONE) /* held once, so named twice: a repeated id */
                rc = PKV__SAY(c, PKV_EINVAL, "sequence %#llx named twice", (unsigned long long)seqs[i]);
            w.seq[b] = (uint32_t)(s - c->seqs), w.at[b] = p;
        }
    }
    /* mark: each sequence's groups of entries in id order (no other entry between) */
    for (uint32_t i = 0; i < n && !rc; i++) pkv__seq_get(c, seqs[i])->mark = 0;
    for (uint32_t b = 0, last = PKV_NONE; b < c->n_blocks && !rc; b++)
        if (w.seq[b] != PKV_NONE && w.seq[b] != last) c->seqs[last = w.seq[b]].mark++;
    /* a sequence laid out already (one group, ascending in table order) is kept: its entries,
       the FREE ids between them and its slack are closed to the others */
    const uint32_t per = n ? PKV_MIN(slack, c->pool.n_free / n) : 0;
    for (uint32_t i = 0; i < n && !rc; i++) {
        pkv__seq *s = pkv__seq_get(c, seqs[i]);
        const uint32_t slot = (uint32_t)(s - c->seqs);
        uint32_t first = PKV_NONE, prev = PKV_NONE;
        bool up = s->mark == 1 && !repack;
        for (uint32_t p = s->n_dropped; up && p < s->n_blocks; p++) {
            const uint32_t x = (uint32_t)s->table[p];
            if (!bc_is(&w, x, slot, p)) continue;
            up = prev == PKV_NONE || x > prev;
            if (first == PKV_NONE) first = x;
            prev = x;
        }
        if (!up || first == PKV_NONE) continue;
        for (uint32_t b = first; b <= prev; b++)
            if (w.seq[b] == slot || bc_room(c, &w, b)) w.seq[b] = OWN_CLOSED, w.at[b] = PKV_NONE;
        /* and its slack, as a placed one's (so a later call does not give it away): the room
           after its last entry, up to the next entry */
        for (uint32_t b = prev + 1, k = 0; k < per && b < c->n_blocks && !bc_entry(&w, b) && !bc_closed(&w, b); b++)
            if (bc_room(c, &w, b)) w.seq[b] = OWN_CLOSED, w.at[b] = PKV_NONE, k++;
        s->mark = MARK_DONE;
    }
    /* the others, in the order given: into clean stretches (twice), then over each other */
    for (int pass = repack ? 2 : 0; pass < 3 && !rc; pass++) {
        bc_pass ps = {0, UINT32_MAX};
        for (uint32_t i = 0; i < n; i++) {
            pkv__seq *s = pkv__seq_get(c, seqs[i]);
            if (s->mark != MARK_DONE) moved += bc_seq(c, &w, s, per, repack, pass, &ps);
        }
    }
    if (!rc && n_moved) *n_moved = moved;
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_seq_release(pkv_cache *c, pkv_seq id) {
    if (!c) return PKV_EINVAL;
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc) {
        pkv__seq_drop_blocks(c, s, 0);
        pkv__seq_free(c, s);
    }
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_seq_get_info(pkv_cache *c, pkv_seq id, pkv_seq_info *out) {
    if (!c) return PKV_EINVAL;
    if (!out) return PKV__SAY(c, PKV_EINVAL, "out is NULL");
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc) {
        out->n_tokens = s->n_tokens;
        out->n_committed = s->n_committed;
        out->n_blocks = s->n_blocks;
        out->n_reused = s->n_reused;
        out->n_shared = 0;
        for (uint32_t i = s->n_dropped; i < s->n_blocks; i++) out->n_shared += c->blk[s->table[i]].ref > 1;
        out->n_dropped = pkv__seq_front(c, s);
    }
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_seq_slots(pkv_cache *c, pkv_seq id, uint32_t start, uint32_t n, int32_t *slots) {
    if (!c) return PKV_EINVAL;
    if (n && !slots) return PKV__SAY(c, PKV_EINVAL, "slots is NULL, n %u", n);
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc) rc = check_span(c, s, start, n, __func__);
    if (!rc)
        for (uint32_t j = 0; j < n; j++) {
            uint32_t p = start + j;
            slots[j] = s->table[p / c->B] * (int32_t)c->B + (int32_t)(p % c->B);
        }
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_seq_block_table(pkv_cache *c, pkv_seq id, int32_t *out, uint32_t cap, uint32_t *n_out) {
    if (!c) return PKV_EINVAL;
    if (!n_out) return PKV__SAY(c, PKV_EINVAL, "n_out is NULL");
    if (cap && !out) return PKV__SAY(c, PKV_EINVAL, "out is NULL, cap %u", cap);
    LOCK(c);
    pkv__seq *s;
    int rc = get_seq(c, id, &s);
    if (!rc && cap < s->n_blocks) {
        rc = PKV_EINVAL; /* the sizing answer: not said (pkv.h) */
        *n_out = s->n_blocks; /* the capacity needed */
    }
    if (!rc) {
        if (s->n_blocks) memcpy(out, s->table, s->n_blocks * sizeof(int32_t)); /* out may be NULL when cap is 0 */
        *n_out = s->n_blocks;
    }
    UNLOCK(c);
    return rc;
}

/* pkv_seq_gather (f32) and pkv_seq_read_stored (the pool's rows): k_out, v_out are float * or
 * uint8_t * as stored says. */
static int seq_read(pkv_cache *c, pkv_seq id, uint32_t layer, uint32_t start, uint32_t n, void *k_out, void *v_out,
                    bool stored, const char *api) {
    if (layer >= c->n_layers) return pkv__say(c, PKV_EINVAL, api, "layer %u of %u", layer, c->n_layers);
    if (n && !k_out && !v_out) return pkv__say(c, PKV_EINVAL, api, "neither k_out nor v_out given");
    if (v_out && c->cfg.v_dim)
        return pkv__say(c, PKV_EINVAL, api, "v_out given, but V lives in K here (v_dim %u): read k alone", c->v_dim);
    LOCK(c);
    pkv__seq *s;
    int rc = pkv__get_seq(c, id, &s, api);
    if (!rc) rc = check_span(c, s, start, n, api);
    /* Copied outside the lock, as attention reads: the table is the sequence's own row of
     * c->tables, and no call that changes it or its blocks may overlap this one (pkv.h,
     * "Threads"), so a long read does not hold up other sequences' metadata calls. */
    const int32_t *table = rc ? NULL : s->table;
    UNLOCK(c);
    if (table) {
        const uint32_t B = c->B, d = c->head_dim;
        const uint8_t *kl = c->kv + layer * c->layer_stride, *vl = kl + c->v_off;
        for (uint32_t j = 0; j < n; j++) {
            uint32_t p = start + j, b = (uint32_t)table[p / B], off = p % B;
            for (uint32_t h = 0; h < c->n_kv; h++) {
                const size_t o = (size_t)j * c->n_kv + h;
                const uint8_t *kr = kl + b * c->k_blk + ((size_t)h * B + off) * c->k_row;
                const uint8_t *vr = vl + b * c->v_blk + ((size_t)h * B + off) * c->v_row;
                if (stored) {
                    if (k_out) memcpy((uint8_t *)k_out + o * c->k_row, kr, c->k_row);
                    if (v_out) memcpy((uint8_t *)v_out + o * c->v_row, vr, c->v_row);
                } else {
                    if (k_out) pkv__row_decode(c->cfg.k_dtype, kr, d, (float *)k_out + o * d);
                    if (v_out) pkv__row_decode(c->cfg.v_dtype, vr, d, (float *)v_out + o * d);
                }
            }
        }
    }
    return rc;
}

PKV_API int pkv_seq_gather(pkv_cache *c, pkv_seq id, uint32_t layer, uint32_t start, uint32_t n, float *k_out,
                           float *v_out) {
    return c ? seq_read(c, id, layer, start, n, k_out, v_out, false, __func__) : PKV_EINVAL;
}

PKV_API int pkv_seq_read_stored(pkv_cache *c, pkv_seq id, uint32_t layer, uint32_t start, uint32_t n, void *k_out,
                                void *v_out) {
    return c ? seq_read(c, id, layer, start, n, k_out, v_out, true, __func__) : PKV_EINVAL;
}

/* Validates every id of a list (live, not a pin). */
static int check_ids(pkv_cache *c, const pkv_seq *seqs, uint32_t n, const char *api) {
    for (uint32_t i = 0; i < n; i++) {
        pkv__seq *s;
        int rc = pkv__get_seq(c, seqs[i], &s, api);
        if (rc) return rc;
    }
    return PKV_OK;
}

PKV_API int pkv_export_dense(pkv_cache *c, const pkv_seq *seqs, uint32_t n_seqs, uint32_t max_blocks,
                             int32_t *block_tables, int32_t *seq_lens) {
    if (!c) return PKV_EINVAL;
    if (n_seqs && (!seqs || !block_tables || !seq_lens))
        return PKV__SAY(c, PKV_EINVAL, "%s is NULL, n_seqs %u", !seqs ? "seqs" : !block_tables ? "block_tables" : "seq_lens",
                        n_seqs);
    LOCK(c);
    int rc = check_ids(c, seqs, n_seqs, __func__);
    for (uint32_t i = 0; !rc && i < n_seqs; i++)
        if (pkv__seq_get(c, seqs[i])->n_blocks > max_blocks)
            rc = PKV__SAY(c, PKV_EINVAL, "sequence %#llx holds %u blocks, over max_blocks %u",
                          (unsigned long long)seqs[i], pkv__seq_get(c, seqs[i])->n_blocks, max_blocks);
    for (uint32_t i = 0; !rc && i < n_seqs; i++) {
        const pkv__seq *s = pkv__seq_get(c, seqs[i]);
        int32_t *row = block_tables + (size_t)i * max_blocks;
        memcpy(row, s->table, s->n_blocks * sizeof(int32_t));
        for (uint32_t j = s->n_blocks; j < max_blocks; j++) row[j] = -1;
        seq_lens[i] = (int32_t)s->n_tokens;
    }
    UNLOCK(c);
    return rc;
}

PKV_API int pkv_export_csr(pkv_cache *c, const pkv_seq *seqs, uint32_t n_seqs, int32_t *indptr, int32_t *indices,
                           uint32_t indices_cap, int32_t *last_page_len, uint32_t *n_needed) {
    if (!c) return PKV_EINVAL;
    if (!indptr || (n_seqs && (!seqs || !last_page_len)) || (indices_cap && !indices))
        return PKV__SAY(c, PKV_EINVAL, "%s is NULL (n_seqs %u, indices_cap %u)",
                        !indptr ? "indptr" : (n_seqs && !seqs) ? "seqs" : (n_seqs && !last_page_len) ? "last_page_len" : "indices",
                        n_seqs, indices_cap);
    LOCK(c);
    int rc = check_ids(c, seqs, n_seqs, __func__);
    uint64_t total = 0;
    for (uint32_t i = 0; !rc && i < n_seqs; i++) total += pkv__seq_get(c, seqs[i])->n_blocks;
    /* past int32 (one id named many times) there is no size to give: said, and *n_needed left
       alone, so that no caller allocates for a second call that would be refused too */
    if (!rc && total > INT32_MAX) rc = PKV__SAY(c, PKV_EINVAL, "%llu indices, past int32", (unsigned long long)total);
    if (!rc && n_needed) *n_needed = (uint32_t)total;
    if (!rc && total > indices_cap) rc = PKV_EINVAL; /* the sizing answer: not said (pkv.h) */
    if (!rc) {
        uint32_t at = 0;
        indptr[0] = 0;
        for (uint32_t i = 0; i < n_seqs; i++) {
            const pkv__seq *s = pkv__seq_get(c, seqs[i]);
            if (s->n_blocks) memcpy(indices + at, s->table, s->n_blocks * sizeof(int32_t)); /* indices: NULL if cap 0 */
            at += s->n_blocks;
            indptr[i + 1] = (int32_t)at;
            last_page_len[i] = s->n_tokens ? (int32_t)(s->n_tokens - (s->n_blocks - 1) * c->B) : 0;
        }
    }
    UNLOCK(c);
    return rc;
}

/* ---- attention -------------------------------------------------------------------------------- */
PKV_API pkv_attn_params pkv_attn_params_default(void) {
    pkv_attn_params p;
    memset(&p, 0, sizeof p);
    return p;
}

PKV_API const char *pkv_attn_backend(const pkv_cache *c) {
    return c ? pkv__attn_backend_name(c->attn) : "none";
}

PKV_API uint32_t pkv_attn_flags_used(const pkv_cache *c) {
    if (!c) return 0;
    const pkv_dtype kd = c->cfg.k_dtype, vd = c->cfg.v_dtype;
    uint32_t f = pkv__attn_lp(c->attn, kd) || pkv__attn_lp_v(c->attn, vd) ||
                         pkv__attn_lp_tiles(c->attn, kd, vd, c->head_dim, c->v_dim)
                     ? PKV_ATTN_BF16_DOT
                     : 0;
    if (pkv__attn_f16bf(c->attn, kd, vd, c->head_dim, c->v_dim)) f |= PKV_ATTN_F16_AS_BF16;
    return f;
}

static int resolve_call(const pkv_cache *c, uint32_t layer, const pkv_attn_params *p, pkv__attn_call *call,
                        const char *api) {
    if (layer >= c->n_layers) return pkv__say(c, PKV_EINVAL, api, "layer %u of %u", layer, c->n_layers);
    pkv_attn_params d = pkv_attn_params_default();
    if (!p) p = &d;
    uint32_t nq = p->n_q_heads ? p->n_q_heads : c->n_kv;
    if (nq % c->n_kv)
        return pkv__say(c, PKV_EINVAL, api, "n_q_heads %u is not a multiple of n_kv_heads %u", nq, c->n_kv);
    if (nq > c->n_kv * 1024u)
        return pkv__say(c, PKV_EINVAL, api, "n_q_heads %u over 1024 x n_kv_heads %u", nq, c->n_kv);
    if (!(p->scale >= 0.0f) || isinf(p->scale))
        return pkv__say(c, PKV_EINVAL, api, "scale %g is negative, NaN or infinite", (double)p->scale);
    if (!pkv__attn_softcap_ok(p->softcap))
        return pkv__say(c, PKV_EINVAL, api, "softcap %g is negative, NaN, infinite or too small", (double)p->softcap);
    if (p->flags & ~(uint32_t)(PKV_ATTN_BF16_DOT | PKV_ATTN_NONCAUSAL | PKV_ATTN_F16_AS_BF16))
        return pkv__say(c, PKV_EINVAL, api, "unknown flags %#x", p->flags);
    if ((p->flags & PKV_ATTN_NONCAUSAL) && (p->window || p->attn_chunk || p->alibi_slopes))
        return pkv__say(c, PKV_EINVAL, api, "PKV_ATTN_NONCAUSAL with %s: a non-causal query has no position",
                        p->window ? "a window" : p->attn_chunk ? "attn_chunk" : "alibi_slopes");
    call->n_q_heads = nq;
    call->scale = p->scale > 0.0f ? p->scale : 1.0f / sqrtf((float)c->head_dim);
    call->softcap = p->softcap;
    call->window = p->window;
    call->chunk = p->attn_chunk;
    call->flags = p->flags;
    call->sinks = p->sinks;
    for (uint32_t h = 0; p->sinks && h < nq; h++)
        if (!isfinite(p->sinks[h]))
            return pkv__say(c, PKV_EINVAL, api, "sinks[%u] is %g, not finite", h, (double)p->sinks[h]);
    call->alibi = p->alibi_slopes;
    for (uint32_t h = 0; p->alibi_slopes && h < nq; h++)
        if (!pkv__attn_slope_ok(p->alibi_slopes[h]))
            return pkv__say(c, PKV_EINVAL, api, "alibi_slopes[%u] is %g, not finite or past PKV_ALIBI_SLOPE_MAX", h,
                            (double)p->alibi_slopes[h]);
    return PKV_OK;
}

/* out may be q (in place: each query's rows are read before its output is written, and no other
 * query's are written over them) where its rows are as long (no = nq); any other overlap of q,
 * out and lse is PKV_EINVAL. nq, no: the bytes of q and of out, n_rows rows of n_q_heads x
 * head_dim (v_dim) floats. */
static int check_overlap(const float *q, const float *out, const float *lse, uint64_t n_rows, size_t nq, size_t no,
                         uint32_t n_q_heads) {
    const size_t nl = (size_t)n_rows * sizeof(float) * n_q_heads; /* <= no <= nq: n_q_heads <= orow */
    if (no == nq ? pkv__overlap_unequal(q, out, nq) : pkv__overlap(q, nq, out, no)) return PKV_EINVAL;
    if (lse && (pkv__overlap(lse, nl, q, nq) || pkv__overlap(lse, nl, out, no))) return PKV_EINVAL;
    return PKV_OK;
}

/* The checks of an attention call's buffers, n_rows queries of call->n_q_heads x head_dim (their
 * outputs of v_dim): their size within size_t, the overlaps of q, out, lse, sinks and ALiBi's slopes (out may be
 * q where in_place and v_dim is head_dim), and every query element finite with |q| x scale within
 * PKV_VALUE_MAX. */
static int check_buffers(pkv_cache *c, const char *api, const float *q, const float *out, const float *lse,
                         const pkv__attn_call *call, uint64_t n_rows, bool in_place) {
    const size_t qrow = (size_t)call->n_q_heads * c->head_dim, orow = (size_t)call->n_q_heads * c->v_dim;
    size_t q_bytes = 0, o_bytes = 0;
    if (!pkv__f32_rows_bytes(n_rows, qrow, &q_bytes))
        return pkv__say(c, PKV_EINVAL, api, "%llu queries x %zu floats are past size_t", (unsigned long long)n_rows,
                        qrow);
    (void)pkv__f32_rows_bytes(n_rows, orow, &o_bytes); /* orow <= qrow */
    in_place = in_place && orow == qrow;
    if (check_overlap(q, out, lse, n_rows, q_bytes, o_bytes, call->n_q_heads) || (!in_place && q == out))
        return pkv__say(c, PKV_EINVAL, api, "q, out and lse overlap (%s)",
                        in_place ? "out may be q itself, nothing else"
                        : orow != qrow ? "out may not be q where v_dim is not head_dim"
                                       : "out may not be q here");
    const float *const heads[2] = {call->sinks, call->alibi}; /* the per-head arrays, read during the call */
    static const char *const head_names[2] = {"sinks", "alibi_slopes"};
    const size_t ns = (size_t)call->n_q_heads * sizeof(float), nl = (size_t)n_rows * ns;
    for (int a = 0; a < 2; a++)
        if (heads[a] && (pkv__overlap(heads[a], ns, out, o_bytes) || (lse && pkv__overlap(heads[a], ns, lse, nl))))
            return pkv__say(c, PKV_EINVAL, api, "%s overlap out or lse", head_names[a]);
    /* a query that is not finite, or so large that q.k overflows (or q x scale, which the kernels
       form first), would give each backend and order its own garbage (a NaN or infinite logit is
       dropped by one max and kept by another): refused instead. With |K| <= PKV_VALUE_MAX too, a
       score is at most head_dim x 2^112 (pkv.h). */
    const uint32_t bits = pkv__max_abs_bits(PKV_DTYPE_F32, q, (size_t)n_rows * qrow);
    float qmax;
    memcpy(&qmax, &bits, sizeof qmax);
    if (!((double)qmax * call->scale <= PKV_VALUE_MAX)) /* NaN bits: not <= */
        return pkv__say(c, PKV_EINVAL, api, "a query element is not finite, or |q| x scale is past PKV_VALUE_MAX");
    return PKV_OK;
}

/* Why a job on the cache's threads failed where a caller's executor runs them (pkv__tpool_run). */
static const char k_exec_broke[] = "the executor broke its contract: a worker index out of range or in use, or tasks "
                                   "left";

int pkv__cache_attn_run(pkv_cache *c, const pkv__kv_view *view, uint32_t k, const pkv__attn_call *call,
                        const char *api) {
    const int rc = pkv__attn_run(c->attn, view, c->items, k, call);
    if (rc) pkv__say(c, rc, api, "%s", c->cfg.executor.parallel_for ? k_exec_broke : "the kernels refused the call");
    return rc;
}

/* Shared body of decode and prefill: reqs == NULL means decode (one query at length - 1). masks:
 * pkv_attn_prefill_masked's, or NULL. */
static int attn_common(pkv_cache *c, uint32_t layer, const pkv_seq *seqs, const pkv_attn_req *reqs,
                       const uint8_t *const *masks, uint32_t n, const float *q, float *out, const pkv_attn_params *p) {
    const char *api = masks ? "pkv_attn_prefill_masked" : reqs ? "pkv_attn_prefill" : "pkv_attn_decode";
    if (!c) return PKV_EINVAL;
    if (n && (!q || !out)) return pkv__say(c, PKV_EINVAL, api, "%s is NULL, %u %s", !q ? "q" : "out", n, reqs ? "requests" : "sequences");
    pkv__attn_call call;
    int rc = resolve_call(c, layer, p, &call, api);
    if (rc || n == 0) return rc;
    bool any_mask = false;
    for (uint32_t i = 0; masks && i < n; i++) any_mask |= masks[i] != NULL;
    if (any_mask && (call.window || call.chunk))
        return pkv__say(c, PKV_EINVAL, api, "a custom mask with %s: the mask says which keys a query sees (set "
                        "the window's or chunk's bits in it)", call.window ? "a window" : "attn_chunk");
    float *lse = p ? p->lse : NULL;
    const size_t qrow = (size_t)call.n_q_heads * c->head_dim, orow = (size_t)call.n_q_heads * c->v_dim;
    pkv__kv_view view = layer_view(c, layer);

    /* PKV_ATTN_NONCAUSAL: a request's queries see [0, length) (decode's do anyway) */
    const bool noncausal = reqs && (call.flags & PKV_ATTN_NONCAUSAL);
    pthread_mutex_lock(&c->attn_mu);
    /* validate everything first: no kernel runs on a bad request */
    uint64_t n_rows = 0; /* queries in all */
    LOCK(c);
    for (uint32_t i = 0; i < n && !rc; i++) {
        pkv__seq *s;
        rc = pkv__get_seq(c, reqs ? reqs[i].seq : seqs[i], &s, api);
        if (rc) break;
        if (noncausal && reqs[i].q_start)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: q_start %u with PKV_ATTN_NONCAUSAL (0 is taken)", i,
                          reqs[i].q_start);
        else if (noncausal && reqs[i].n_q && s->n_tokens == 0)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: %u non-causal queries over an empty sequence", i,
                          reqs[i].n_q);
        else if (noncausal && reqs[i].n_q > (uint64_t)c->max_bps * c->B) /* as many as a causal one may have */
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: %u non-causal queries, past the %llu positions a sequence may hold",
                          i, reqs[i].n_q, (unsigned long long)c->max_bps * c->B);
        else if (reqs && !noncausal && (uint64_t)reqs[i].q_start + reqs[i].n_q > s->n_tokens)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: positions [%u, %llu) past the sequence's length %u", i,
                          reqs[i].q_start, (unsigned long long)reqs[i].q_start + reqs[i].n_q, s->n_tokens);
        else if (!reqs && s->n_tokens == 0)
            rc = pkv__say(c, PKV_EINVAL, api, "sequence %u (%#llx) is empty: no position to query", i,
                          (unsigned long long)seqs[i]);
        if (!rc && masks && masks[i]) { /* its mask's own checks below, outside the lock */
            s->attn_len = s->n_tokens; /* a non-causal mask's rows: its length now (checked again below) */
        } else if (!rc && s->n_dropped && (!reqs || reqs[i].n_q)) { /* its first query's first key (the least) */
            const uint32_t q0 = reqs ? reqs[i].q_start : s->n_tokens - 1;
            rc = check_front(c, s, api, reqs ? "request" : "sequence", i, "query", q0,
                             noncausal ? 0 : pkv__attn_key_lo(&call, q0));
        }
        n_rows += reqs ? reqs[i].n_q : 1;
    }
    UNLOCK(c);
    if (!rc) rc = check_buffers(c, api, q, out, lse, &call, n_rows, true);
    /* the request array (and the masks' pointers) are read again as each group of max_seqs is
       built, after earlier groups wrote out and lse, and the masks during the call: none of them
       may overlap out or lse (check_buffers held their sizes within size_t) */
    const size_t o_bytes = (size_t)n_rows * orow * sizeof(float), l_bytes = (size_t)n_rows * call.n_q_heads * sizeof(float);
    if (!rc) {
        const void *arr[2] = {reqs ? (const void *)reqs : (const void *)seqs, masks};
        const size_t arr_bytes[2] = {(size_t)n * (reqs ? sizeof *reqs : sizeof *seqs), (size_t)n * sizeof *masks};
        for (int a = 0; a < 2 && !rc; a++)
            if (arr[a] && (pkv__overlap(arr[a], arr_bytes[a], out, o_bytes) ||
                           (lse && pkv__overlap(arr[a], arr_bytes[a], lse, l_bytes))))
                rc = pkv__say(c, PKV_EINVAL, api, "the %s array overlaps out or lse", a ? "masks" : reqs ? "reqs" : "seqs");
    }
    /* each mask: its bytes (its rows the length checked above where non-causal), and past a dropped
       front the least key a query of it sees (a mask of no bit sees none), read outside the
       metadata lock and then checked against the front under it */
    for (uint32_t i = 0; any_mask && i < n && !rc; i++) {
        if (!masks[i] || !reqs[i].n_q) continue;
        LOCK(c);
        pkv__seq *s;
        rc = pkv__get_seq(c, reqs[i].seq, &s, api);
        const uint32_t kv_len = rc ? 0 : noncausal ? s->attn_len : reqs[i].q_start + reqs[i].n_q;
        const bool dropped = !rc && s->n_dropped;
        UNLOCK(c);
        if (rc) break;
        const uint64_t bytes = ((uint64_t)reqs[i].n_q * kv_len + 7) / 8;
        if (bytes > SIZE_MAX)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: its mask's bytes are past size_t", i);
        else if (pkv__overlap(masks[i], (size_t)bytes, out, o_bytes) ||
                 (lse && pkv__overlap(masks[i], (size_t)bytes, lse, l_bytes)))
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: its mask overlaps out or lse", i);
        uint32_t lo = 0, hi = kv_len - 1;
        if (rc || !dropped || !pkv__bits_rows_span(masks[i], kv_len, 0, reqs[i].n_q, &lo, &hi)) continue;
        LOCK(c);
        rc = pkv__get_seq(c, reqs[i].seq, &s, api);
        if (!rc) rc = check_front(c, s, api, "request", i, "query", reqs[i].q_start, lo);
        UNLOCK(c);
    }
    size_t q_at = 0;
    pkv__attn_hold_counts(c->attn); /* the statistics count a call whose every group ran, or nothing */
    c->share.call_keys = 0;
    for (uint64_t i0 = 0; i0 < n && !rc; i0 += c->max_seqs) { /* 64-bit: no wrap near n = 2^32 */
        uint32_t m = (uint32_t)PKV_MIN(n - i0, c->max_seqs), k = 0;
        LOCK(c);
        for (uint32_t j = 0; j < m; j++) {
            uint32_t i = (uint32_t)i0 + j;
            pkv__seq *s = pkv__seq_get(c, reqs ? reqs[i].seq : seqs[i]);
            if (!s) { /* released by another thread since the check: a misuse (design.md), not a crash */
                rc = pkv__say(c, PKV_ENOENT, api, "a sequence was released during the call");
                k = 0;
                break;
            }
            uint32_t q0 = reqs ? reqs[i].q_start : s->n_tokens - 1, nq = reqs ? reqs[i].n_q : 1;
            if (nq == 0) continue;
            const uint32_t q_real = q0;
            /* non-causal: the queries at nominal positions from length on, every one seeing [0, k_end) */
            if (noncausal) q0 = s->n_tokens;
            pkv__attn_item *it = &c->items[k++];
            *it = (pkv__attn_item){.block_table = s->table, .q_pos0 = q0, .n_q = nq,
                                   .k_end = noncausal ? s->n_tokens : 0,
                                   .q = q + q_at * qrow, .out = out + q_at * orow,
                                   .lse = lse ? lse + q_at * call.n_q_heads : NULL};
            if (masks && masks[i]) { /* its keys [0, kv_len), at nominal positions past them (attn.h) */
                if (noncausal && s->n_tokens != s->attn_len) { /* grown or cut since the check: a misuse */
                    rc = pkv__say(c, PKV_EINVAL, api, "request %u: its sequence's length went from %u to %u during the "
                                  "call (its mask's rows)", i, s->attn_len, s->n_tokens);
                    k = 0;
                    break;
                }
                const uint32_t kv_len = noncausal ? s->n_tokens : q_real + nq;
                it->mask = masks[i], it->mask_row = kv_len, it->mask_pos0 = q_real;
                it->q_pos0 = it->k_end = kv_len;
            }
            q_at += nq;
        }
        UNLOCK(c);
        /* the masked items' blocks: from the one of the least key a mask sets to the greatest's,
           found outside the lock; a mask of no bit sees nothing (out 0, lse its sink's or -inf) */
        for (uint32_t j = 0; j < k; j++) {
            pkv__attn_item *it = &c->items[j];
            uint32_t lo = 0, hi = it->mask_row - 1;
            if (!it->mask) continue;
            if (pkv__bits_rows_span(it->mask, it->mask_row, 0, it->n_q, &lo, &hi)) {
                it->k_start = lo / c->B * c->B, it->k_end = hi + 1;
                continue;
            }
            for (uint32_t r = 0; r < it->n_q; r++)
                for (uint32_t h = 0; h < call.n_q_heads; h++) {
                    memset(it->out + ((size_t)r * call.n_q_heads + h) * c->v_dim, 0, c->v_dim * sizeof(float));
                    if (it->lse) it->lse[(size_t)r * call.n_q_heads + h] = call.sinks ? call.sinks[h] : -INFINITY;
                }
            it->n_q = 0; /* no kernel runs it */
        }
        if (k) rc = pkv__share_run(c, &view, k, &call, api);
    }
    pkv__attn_release_counts(c->attn, rc == 0);
    if (!rc) atomic_fetch_add_explicit(&c->share.keys, c->share.call_keys, memory_order_relaxed);
    pthread_mutex_unlock(&c->attn_mu);
    return rc;
}

PKV_API int pkv_attn_decode(pkv_cache *c, uint32_t layer, const pkv_seq *seqs, uint32_t n_seqs, const float *q,
                            float *out, const pkv_attn_params *p) {
    if (n_seqs && !seqs) return PKV__SAY(c, PKV_EINVAL, "seqs is NULL, n_seqs %u", n_seqs);
    return attn_common(c, layer, seqs, NULL, NULL, n_seqs, q, out, p);
}

PKV_API int pkv_attn_prefill(pkv_cache *c, uint32_t layer, const pkv_attn_req *reqs, uint32_t n_reqs, const float *q,
                             float *out, const pkv_attn_params *p) {
    if (n_reqs && !reqs) return PKV__SAY(c, PKV_EINVAL, "reqs is NULL, n_reqs %u", n_reqs);
    return attn_common(c, layer, NULL, reqs, NULL, n_reqs, q, out, p);
}

PKV_API int pkv_attn_prefill_masked(pkv_cache *c, uint32_t layer, const pkv_attn_req *reqs, uint32_t n_reqs,
                                    const uint8_t *const *masks, const float *q, float *out,
                                    const pkv_attn_params *p) {
    if (n_reqs && (!reqs || !masks))
        return PKV__SAY(c, PKV_EINVAL, "%s is NULL, n_reqs %u", !reqs ? "reqs" : "masks", n_reqs);
    return attn_common(c, layer, NULL, reqs, masks, n_reqs, q, out, p);
}

void pkv__cache_test_inline_work(pkv_cache *c, uint64_t elems) {
    pthread_mutex_lock(&c->attn_mu);
    pkv__attn_set_inline_work(c->attn, elems);
    pthread_mutex_unlock(&c->attn_mu);
}

/* ---- tree attention ---------------------------------------------------------------------------- */
/* Node i's path (itself, its parent, ... up to its root, or to where a window or chunk ends it)
 * into path; returns its length. depth: the request's node depths; q_start: the first node's
 * position (a node's own is q_start + depth). */
static uint32_t tree_path(const pkv__attn_call *call, const int32_t *parent, const uint32_t *depth, uint32_t q_start,
                          uint32_t i, uint32_t *path) {
    const uint32_t lo = pkv__attn_key_lo(call, q_start + depth[i]);
    uint32_t n = 0;
    for (int32_t j = (int32_t)i; j >= 0 && q_start + depth[j] >= lo; j = parent[j]) path[n++] = (uint32_t)j;
    return n;
}

/* Row `pos` of kv head h of one layer's K (or V) array base, widened to f32 into y. */
static inline void tree_row(const pkv_cache *c, const int32_t *table, const uint8_t *base, size_t blk_bytes,
                            size_t row_bytes, pkv_dtype dt, uint32_t h, uint32_t pos, float *y) {
    const size_t at = (size_t)table[pos / c->B] * blk_bytes + ((size_t)h * c->B + pos % c->B) * row_bytes;
    pkv__row_decode(dt, base + at, c->head_dim, y);
}

/* The rows of node i of request r, in the run of nodes from i0 (queries q, outputs out, lse or
 * NULL: the request's own rows): the prefix part already in out with its log-sum-exps in t->la
 * (-inf: none), the path part computed here, the two (and the sinks) merged by log-sum-exp into
 * out and lse. A path's K and V rows are widened once a kv head for all its query heads where
 * they fit the scratch. What it writes is node i's alone, and t's own part: nodes run side by
 * side, each on its thread's part of the scratch (tree_task). */
static void tree_node(const pkv_cache *c, const tree_scratch *t, const pkv__kv_view *kv, const int32_t *table,
                      const pkv_attn_tree_req *r, uint32_t i0, uint32_t i, const pkv__attn_call *call,
                      const float *sinks, const float *q, float *out, float *lse) {
    const uint32_t D = c->head_dim, Dv = c->v_dim, nqh = call->n_q_heads, G = nqh / c->n_kv;
    const size_t path_floats = t->path_floats;
    double *sc = t->sc;
    float *acc = t->acc, *kr = t->kr, *vr = t->vr;
    const float *la = t->la;
    const uint32_t *depth = t->depth;
    uint32_t *path = t->path;
    const bool v_in_k = kv->v == kv->k; /* V's rows are the K rows' first v_dim values */
    const uint32_t np = tree_path(call, r->parent, depth, r->q_start, i, path);
    const bool once = (size_t)np * D <= path_floats; /* the path's rows widened once a kv head */
    const float *vrows = once && v_in_k ? kr : vr; /* the widened V rows, where once */
    for (uint32_t h = 0; h < nqh; h++) {
        const uint32_t kh = h / G;
        if (once && h % G == 0)
            for (uint32_t k = 0; k < np; k++) {
                tree_row(c, table, kv->k, kv->k_block_bytes, kv->k_row_bytes, kv->k_dtype, kh, r->q_start + path[k],
                         kr + (size_t)k * D);
                if (!v_in_k)
                    tree_row(c, table, kv->v, kv->v_block_bytes, kv->v_row_bytes, kv->v_dtype, kh,
                             r->q_start + path[k], vr + (size_t)k * D);
            }
        const size_t row = (size_t)i * nqh + h;
        const float *qr = q + row * D;
        double mb = -INFINITY;
        for (uint32_t k = 0; k < np; k++) {
            const float *kk = kr + (once ? (size_t)k * D : 0);
            if (!once)
                tree_row(c, table, kv->k, kv->k_block_bytes, kv->k_row_bytes, kv->k_dtype, kh, r->q_start + path[k], kr);
            double x = (double)pkv__ref_dot(qr, kk, D) * call->scale;
            if (call->softcap > 0.0f) x = call->softcap * tanh(x / call->softcap);
            /* ALiBi: the ancestor's distance in the text, depth against depth */
            if (call->alibi) x += (double)call->alibi[h] * ((double)depth[path[k]] - (double)depth[i]);
            sc[k] = x;
            mb = x > mb ? x : mb;
        }
        double lb = 0.0;
        for (uint32_t d = 0; d < Dv; d++) acc[d] = 0.0f;
        for (uint32_t k = 0; k < np; k++) {
            const float *vv = vrows + (once ? (size_t)k * D : 0);
            if (!once)
                tree_row(c, table, kv->v, kv->v_block_bytes, kv->v_row_bytes, kv->v_dtype, kh, r->q_start + path[k], vr);
            const double w = exp(sc[k] - mb);
            const float wf = (float)w;
            lb += w;
            for (uint32_t d = 0; d < Dv; d++) acc[d] += wf * vv[d];
        }
        /* the parts' weights against the largest of their log-sum-exps (the path part has its
           node itself, so lb >= 1 and its log-sum-exp is finite) */
        const double a = la[(size_t)(i - i0) * nqh + h], b = mb + log(lb), s = sinks ? sinks[h] : -INFINITY;
        const double m = PKV_MAX(PKV_MAX(a, b), s);
        const double wa = a == -INFINITY ? 0.0 : exp(a - m), wb = exp(b - m), ws = sinks ? exp(s - m) : 0.0;
        const double tot = wa + wb + ws;
        const float fa = (float)(wa / tot), fb = (float)(wb / (lb * tot));
        float *o = out + row * Dv;
        if (wa > 0.0)
            for (uint32_t d = 0; d < Dv; d++) o[d] = fa * o[d] + fb * acc[d];
        else
            for (uint32_t d = 0; d < Dv; d++) o[d] = fb * acc[d];
        if (lse) lse[row] = (float)(m + log(tot));
    }
}

/* One run of nodes' path parts, a node a task (tree_node). */
typedef struct tree_job {
    const pkv_cache *c;
    const pkv__kv_view *kv;
    const int32_t *table;
    const pkv_attn_tree_req *r;
    uint32_t i0;
    const pkv__attn_call *call;
    const float *sinks, *q;
    float *out, *lse;
} tree_job;

static void tree_task(void *ctx, uint32_t task, uint32_t tid) {
    const tree_job *j = ctx;
    const tree_scratch t = tree_carve(j->c, tid);
    tree_node(j->c, &t, j->kv, j->table, j->r, j->i0, j->i0 + task, j->call, j->sinks, j->q, j->out, j->lse);
}

PKV_API int pkv_attn_tree(pkv_cache *c, uint32_t layer, const pkv_attn_tree_req *reqs, uint32_t n_reqs, const float *q,
                          float *out, const pkv_attn_params *p) {
    static const char api[] = "pkv_attn_tree";
    if (!c) return PKV_EINVAL;
    if (n_reqs && !reqs) return pkv__say(c, PKV_EINVAL, api, "reqs is NULL, n_reqs %u", n_reqs);
    if (n_reqs && (!q || !out)) return pkv__say(c, PKV_EINVAL, api, "%s is NULL, %u requests", !q ? "q" : "out", n_reqs);
    pkv__attn_call call;
    int rc = resolve_call(c, layer, p, &call, api);
    if (!rc && (call.flags & PKV_ATTN_NONCAUSAL))
        rc = pkv__say(c, PKV_EINVAL, api, "PKV_ATTN_NONCAUSAL: a tree's nodes are causal");
    if (rc || n_reqs == 0) return rc;
    float *lse = p ? p->lse : NULL;
    const uint32_t nqh = call.n_q_heads;
    const size_t qrow = (size_t)nqh * c->head_dim, orow = (size_t)nqh * c->v_dim;
    const pkv__kv_view view = layer_view(c, layer);

    pthread_mutex_lock(&c->attn_mu);
    uint64_t n_rows = 0;
    LOCK(c);
    for (uint32_t i = 0; i < n_reqs && !rc; i++) {
        const pkv_attn_tree_req *r = &reqs[i];
        pkv__seq *s;
        rc = pkv__get_seq(c, r->seq, &s, api);
        if (rc) break;
        if (r->n_nodes > PKV_TREE_MAX_NODES)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: %u nodes, past PKV_TREE_MAX_NODES", i, r->n_nodes);
        else if ((uint64_t)r->q_start + r->n_nodes > s->n_tokens)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: nodes at [%u, %llu), past the sequence's length %u", i,
                          r->q_start, (unsigned long long)r->q_start + r->n_nodes, s->n_tokens);
        else if (r->n_nodes && !r->parent)
            rc = pkv__say(c, PKV_EINVAL, api, "request %u: parent is NULL, %u nodes", i, r->n_nodes);
        else if (s->n_dropped && r->n_nodes) /* node 0, a root: the least first key */
            rc = check_front(c, s, api, "request", i, "node", r->q_start, pkv__attn_key_lo(&call, r->q_start));
        for (uint32_t j = 0; !rc && j < r->n_nodes; j++)
            if (r->parent[j] < -1 || r->parent[j] >= (int32_t)j)
                rc = pkv__say(c, PKV_EINVAL, api, "request %u: node %u's parent %d is not in [-1, %u)", i, j,
                              r->parent[j], j);
        n_rows += r->n_nodes;
    }
    UNLOCK(c);
    if (!rc) rc = check_buffers(c, api, q, out, lse, &call, n_rows, false);
    const float *sinks = call.sinks;
    call.sinks = NULL; /* counted once a row, in the merge of the two parts (tree_paths) */
    const tree_scratch ts = tree_carve(c, 0);
    float *la = ts.la;
    uint32_t *depth = ts.depth;
    const uint32_t run_nodes = tree_lse_cap(c) / nqh; /* >= 1: nqh <= 1024 x n_kv */
    pkv__attn_hold_counts(c->attn); /* not counted in attn_reqs_*: those are decode's and prefill's */
    size_t row0 = 0;
    for (uint32_t ri = 0; ri < n_reqs && !rc; row0 += reqs[ri].n_nodes, ri++) {
        const pkv_attn_tree_req *r = &reqs[ri];
        for (uint32_t j = 0; j < r->n_nodes; j++) depth[j] = r->parent[j] < 0 ? 0 : depth[r->parent[j]] + 1;
        for (uint32_t i0 = 0; i0 < r->n_nodes && !rc;) {
            /* the prefix part of nodes [i0, i1): one item for all of them where no window or chunk
               cuts the prefix short for any of them (its rows at nominal positions q_start + i, at
               or past their own, q_start + depth: a partial item, to which the kernels apply
               neither, as no node's own position hides a key of the prefix), else an item a node
               (its own window and chunk; none where they end before the prefix); their
               log-sum-exps in la (-inf: no prefix part) */
            uint32_t i1 = PKV_MIN(r->n_nodes, i0 + run_nodes), k = 0;
            LOCK(c);
            pkv__seq *s = pkv__seq_get(c, r->seq);
            const int32_t *table = s ? s->table : NULL;
            const bool gone = !s || (uint64_t)r->q_start + r->n_nodes > s->n_tokens;
            UNLOCK(c);
            if (gone) { /* released or cut by another thread since the check: a misuse (design.md), not a crash */
                rc = pkv__say(c, PKV_ENOENT, api, "a sequence was released or truncated during the call");
                break;
            }
            uint32_t dmax = 0; /* the deepest node of the run: the last position any of them is at */
            for (uint32_t i = i0; i < i1; i++) dmax = PKV_MAX(dmax, depth[i]);
            const bool nominal = r->q_start && pkv__attn_key_lo(&call, r->q_start + dmax) == 0;
            if (nominal)
                c->items[k++] = (pkv__attn_item){.block_table = table, .q_pos0 = r->q_start + i0, .n_q = i1 - i0,
                                                 .k_end = r->q_start, .partial = true, .q = q + (row0 + i0) * qrow,
                                                 .out = out + (row0 + i0) * orow, .lse = la};
            else if (r->q_start) {
                i1 = PKV_MIN(i1, i0 + c->max_seqs); /* an item a node */
                for (uint32_t i = i0; i < i1; i++)
                    if (pkv__attn_key_lo(&call, r->q_start + depth[i]) < r->q_start) /* it sees some prefix */
                        c->items[k++] = (pkv__attn_item){.block_table = table, .q_pos0 = r->q_start + depth[i], .n_q = 1,
                                                         .k_end = r->q_start, .q = q + (row0 + i) * qrow,
                                                         .out = out + (row0 + i) * orow,
                                                         .lse = la + (size_t)(i - i0) * nqh};
            }
            for (size_t x = 0; x < (size_t)(i1 - i0) * nqh; x++) la[x] = -INFINITY; /* the items write theirs */
            if (k && (rc = pkv__cache_attn_run(c, &view, k, &call, api)) != 0) break;
            /* ALiBi: one item for all the nodes read the prefix from nominal positions q_start + i;
               node i's own is q_start + depth[i], which moves its logits, so its log-sum-exps, by
               slope x (i - depth[i]) (its output, a softmax, is the same) */
            if (call.alibi && nominal)
                for (uint32_t i = i0; i < i1; i++)
                    for (uint32_t h = 0; h < nqh; h++) {
                        float *a = &la[(size_t)(i - i0) * nqh + h];
                        if (*a != -INFINITY) *a += call.alibi[h] * (float)(i - depth[i]);
                    }
            /* the path parts, a node a task on the cache's threads where they are worth it: a
               node's path is at most depth + 1 rows, each read by every query head */
            uint64_t work = 0;
            for (uint32_t i = i0; i < i1; i++) work += (uint64_t)(depth[i] + 1u) * nqh * c->head_dim;
            tree_job job = {.c = c, .kv = &view, .table = table, .r = r, .i0 = i0, .call = &call, .sinks = sinks,
                            .q = q + row0 * qrow, .out = out + row0 * orow, .lse = lse ? lse + row0 * nqh : NULL};
            if ((rc = pkv__attn_parallel(c->attn, tree_task, &job, i1 - i0, work)) != 0) {
                rc = pkv__say(c, rc, api, "%s", k_exec_broke);
                break;
            }
            i0 = i1;
        }
    }
    pkv__attn_release_counts(c->attn, false);
    pthread_mutex_unlock(&c->attn_mu);
    return rc;
}
