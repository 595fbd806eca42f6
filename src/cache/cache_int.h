/* cache_int.h: the cache object: pool memory, sequences and block tables, the prefix index,
 * counters. Private to src/cache/. */
#ifndef PKV_CACHE_INT_H
#define PKV_CACHE_INT_H

#include "../attn/attn.h"
#include "../pool/pool.h"
#include "../quant/quant.h"

#include <pthread.h>

typedef struct pkv__seq {
    uint32_t gen;  /* generation: the id is (gen << 32) | index; moves on at release */
    uint8_t live;  /* slot holds a live sequence or pin */
    uint8_t is_pin;
    uint32_t n_tokens, n_committed, n_blocks, n_reused;
    uint32_t idx_len; /* table[0 .. idx_len) is this sequence's indexed chain */
    uint64_t ns_lo, ns_hi; /* namespace: XXH3-128 of the salt */
    uint32_t next_free;    /* free-slot list */
    uint32_t mark;         /* pkv_batch_compact's and pkv_batch_append's scratch, under the lock */
    int32_t *table;        /* [max_blocks_per_seq] block ids; [0, n_blocks) valid */
} pkv__seq;

struct pkv_cache {
    pkv_config cfg; /* resolved */
    pkv_allocator alloc;
    pthread_mutex_t mu;      /* metadata: pool, sequences, index, counters */
    pthread_mutex_t attn_mu; /* serializes attention calls (scratch + thread pool) */
    uint32_t B, n_blocks, max_seqs, max_bps, n_layers, n_kv, head_dim;

    /* pool memory: layer l: K at kv + l * layer_stride, V at kv + l * layer_stride + v_off (the K
     * array, then a gap of v_skew bytes: cache.c) */
    uint8_t *kv;
    size_t kv_bytes, layer_stride, v_off, k_row, v_row, k_blk, v_blk;

    pkv__pool pool;
    pkv__blk *blk;  /* [n_blocks] */
    int32_t *tokens; /* [n_blocks][B] token ids of each block */

    pkv__seq *seqs;  /* [max_seqs] */
    int32_t *tables; /* [max_seqs][max_bps] */
    uint32_t seq_free, n_live, n_pins;
    uint32_t gen_base; /* every slot's first generation, nonzero, far from other caches' (cache.c) */
    uint64_t n_tokens_total; /* sum of n_tokens over live sequences (pins excluded) */

    /* prefix index */
    uint32_t *buckets; /* [bucket_mask + 1] first block of each hash chain */
    uint32_t *roots;   /* [bucket_mask + 1] first block of each root list (prefix.c) */
    uint32_t bucket_mask;
    uint64_t n_indexed;
    uint64_t *fp_seen, *fp_content; /* [fp_mask + 1] fingerprints for miss reasons */
    uint32_t fp_mask;
    int const_hash; /* test switch: every identity hash is the same value */

    /* prefix-index events (events.c): a ring of ev_cap, the oldest at ev_head, ev_n held */
    pkv_event *ev;   /* [ev_cap] */
    int32_t *ev_tok; /* [ev_cap][B] token ids of STORED / REMOVED events */
    uint32_t ev_cap, ev_head, ev_n;
    uint64_t ev_seqno; /* the last event's */

    /* counters */
    uint64_t cow_copies, evictions;
    uint64_t pfx_lookups, pfx_queried, pfx_hit, miss_new, miss_evicted, miss_ns;
    uint64_t meta_bytes;

    /* checker scratch */
    uint32_t *chk_ref; /* [n_blocks] */
    uint32_t *chk_pos; /* [n_blocks] */

    pkv__attn *attn;
    pkv__attn_item *items; /* [max_seqs] */
    uint8_t *tree;         /* pkv_attn_tree's scratch (cache.c: tree_bytes), under attn_mu */
    /* the attention context allocates through this counting shim, so meta_bytes includes it */
    pkv_allocator attn_alloc;
    uint64_t attn_bytes;
};

/* ---- cache.c ---- */
pkv__seq *pkv__seq_get(pkv_cache *c, pkv_seq id); /* NULL if unknown or stale */
/* A refusal said through the cache's log hook: one PKV_LOG_ERROR message "api: why" on the
 * calling thread before the call returns (pkv.h); returns rc. Called with or without c->mu held
 * (the hook must not call libpkv on the cache). */
int pkv__say(const pkv_cache *c, int rc, const char *api, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* The same from a public function, named after it. */
#define PKV__SAY(c, rc, ...) pkv__say((c), (rc), __func__, __VA_ARGS__)
/* A live, non-pin sequence (*out) or the status saying why not, said as api's refusal. */
int pkv__get_seq(pkv_cache *c, pkv_seq id, pkv__seq **out, const char *api);

/* A fresh live slot (NULL when max_seqs are live) / back to the free list (id goes stale). */
pkv__seq *pkv__seq_new(pkv_cache *c);
void pkv__seq_free(pkv_cache *c, pkv__seq *s);
pkv_seq pkv__seq_id(const pkv_cache *c, const pkv__seq *s);
/* Drops table[keep_blocks ..) deepest first (so the LRU queue holds leaves before parents). */
void pkv__seq_drop_blocks(pkv_cache *c, pkv__seq *s, uint32_t keep_blocks);
/* dst (empty) takes references to src's first n_blocks blocks, its indexed chain up to there
 * and its namespace (fork and pins). Lengths are the caller's to set. */
void pkv__seq_share(pkv_cache *c, pkv__seq *dst, const pkv__seq *src, uint32_t n_blocks);
/* Takes one block: FREE first, then evicts the LRU head. PKV_NONE if none. */
uint32_t pkv__take_block(pkv_cache *c);
/* Drops one reference; a block reaching 0 becomes CACHED (indexed) or FREE. */
void pkv__drop_block(pkv_cache *c, uint32_t b);
/* Copies positions [0, n) of block src into dst (all layers, K and V, token ids). */
void pkv__copy_block(pkv_cache *c, uint32_t dst, uint32_t src, uint32_t n);

/* ---- prefix.c ---- */
void pkv__index_reset(pkv_cache *c);
/* Un-indexes a CACHED block about to be reused (eviction). */
void pkv__index_evict(pkv_cache *c, uint32_t b);
/* The root list of a namespace and first token id: c->roots[pkv__root_slot(...)]. */
uint32_t pkv__root_slot(const pkv_cache *c, uint64_t ns_lo, uint64_t ns_hi, int32_t tok0);
/* The slot naming b when it heads its list (its parent's child field, or its root list's head);
 * b INDEXED or PARTIAL. */
uint32_t *pkv__tree_head(pkv_cache *c, uint32_t b);
/* Puts b at the head of parent's child list (PKV_NONE: of its root list, so b's namespace and
 * first token must be set) / takes b off its list (its parent then PKV_NONE). Links only: flags
 * and counts are the caller's. */
void pkv__tree_link(pkv_cache *c, uint32_t parent, uint32_t b);
void pkv__tree_unlink(pkv_cache *c, uint32_t b);
/* Unlinks a PARTIAL block from its parent's child list (or its root list). */
void pkv__partial_unlink(pkv_cache *c, uint32_t b);
/* Compaction's move of an indexed or partial block: every index link to src (its place in the
 * hash chain and on its parent's child list or its root list, its children's parent) now names
 * dst, and src keeps no index fields; the caller gives dst src's. No hash depends on a block
 * id. */
void pkv__index_repoint(pkv_cache *c, uint32_t src, uint32_t dst);
/* After a commit (or match / append) of s: index its full committed blocks, register its
 * committed partial tail. */
void pkv__index_after_commit(pkv_cache *c, pkv__seq *s);
/* XXH3 of a block's B token ids with seed (the parent's hash, or the namespace for roots). */
uint64_t pkv__hash_seeded(const pkv_cache *c, uint64_t seed, const int32_t *toks);
uint64_t pkv__identity_hash(const pkv_cache *c, uint32_t parent, uint64_t ns_lo, uint64_t ns_hi, const int32_t *toks);
uint64_t pkv__content_hash(const pkv_cache *c, uint32_t parent, const int32_t *toks);
void pkv__salt_digest(const void *salt, size_t len, uint64_t *lo, uint64_t *hi);
/* Test-only: make every identity hash collide (forces exact comparison). */
void pkv__cache_test_const_hash(pkv_cache *c, int on);

/* ---- events.c ---- (under c->mu; no-ops with event_capacity 0) */
/* Records STORED / REMOVED of indexed block b (its fields set: hash, parent, depth). */
void pkv__event_block(pkv_cache *c, pkv_event_kind kind, uint32_t b);
/* Records CLEARED (pkv_cache_reset). */
void pkv__event_cleared(pkv_cache *c);

#endif
