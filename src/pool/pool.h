/* pool.h: the block allocator: per-block metadata, the FIFO free queue and the LRU queue of
 * cached blocks. Knows nothing of sequences or the prefix index (the cache layer does). */
#ifndef PKV_POOL_H
#define PKV_POOL_H

#include "../core/core.h"

#define PKV_NONE UINT32_MAX

/* Block states (ARCHITECTURE section 4). */
enum { PKV_BLK_FREE = 0, PKV_BLK_CACHED = 1, PKV_BLK_ACTIVE = 2 };
/* A tombstone (the cache layer's, never in the pool: ids n_blocks and up): an index entry that
 * keeps an evicted block's identity and token ids, no K/V, while entries below it are indexed
 * (src/cache/prefix.c, "Tombstones"). */
enum { PKV_BLK_TOMB = 3 };
/* Flags: INDEXED = full, committed, findable by hash; PARTIAL = committed prefix of a block
 * registered under its indexed parent for token-granular matching (never both). */
enum { PKV_BLKF_INDEXED = 1, PKV_BLKF_PARTIAL = 2 };

/* Metadata of one block. Refcount and CoW rules: ref counts block-table entries plus pins; a
 * block with ref > 1 or INDEXED is never written in place; positions [0, n_commit) are never
 * rewritten (committed K/V is immutable). */
typedef struct pkv__blk {
    uint32_t ref;
    uint8_t state, flags;
    uint16_t n_fill;   /* positions [0, n_fill) hold tokens (max over holders) */
    uint16_t n_commit; /* positions [0, n_commit) hold committed K/V */
    uint8_t inner;     /* CACHED in the inner queue (n_hot > 0), not the LRU queue */
    uint8_t moved;     /* holds rows a context shift moved, or rows computed after them (the cache
                          layer's pkv_seq_shift): never INDEXED nor PARTIAL, whoever commits it */
    uint32_t qprev, qnext; /* free queue (FIFO), LRU queue or inner queue links */
    uint32_t parent;       /* index parent (INDEXED or PARTIAL), PKV_NONE for a root */
    uint32_t hnext;        /* hash-bucket chain (INDEXED) */
    uint32_t child;        /* first INDEXED or PARTIAL child */
    uint32_t sib_prev, sib_next;
    uint32_t n_children; /* INDEXED children */
    uint32_t n_hot;      /* children (INDEXED or PARTIAL) in use: ACTIVE, CACHED in the inner queue, or
                            tombstones with such a child (pkv__blk_hot) */
    uint32_t depth;      /* index in its chain (INDEXED): parent's + 1, a root's 0 */
    uint64_t hash;       /* identity hash: namespace + whole token prefix (INDEXED) */
    uint64_t chash;      /* namespace-free content hash of the prefix (INDEXED) */
    uint64_t ns_lo, ns_hi; /* namespace digest (INDEXED roots) */
} pkv__blk;

typedef struct pkv__pool {
    pkv__blk *blk;
    uint32_t n_blocks;
    uint32_t free_head, free_tail, n_free;
    /* CACHED blocks: those without a child in use (n_hot 0) in the LRU queue (head = least
       recently released: eviction's first choice; a block follows its CACHED children there),
       those with one in the inner queue (only a dropped front leaves such: evicted only where
       the LRU queue is empty); n_cached counts both */
    uint32_t lru_head, lru_tail, n_cached;
    uint32_t inner_head, inner_tail;
    uint32_t n_active, peak_active;
    uint64_t slots_used; /* sum of n_fill over ACTIVE blocks */
} pkv__pool;

/* All blocks FREE, free queue 0, 1, ..., n_blocks - 1. */
void pkv__pool_init(pkv__pool *p, pkv__blk *blk, uint32_t n_blocks);

/* Queue primitives. */
void pkv__pool_free_push(pkv__pool *p, uint32_t b);  /* b becomes FREE at the back */
uint32_t pkv__pool_free_pop(pkv__pool *p);           /* front of the free queue or PKV_NONE */
void pkv__pool_free_remove(pkv__pool *p, uint32_t b); /* unlinks a FREE block from anywhere in the queue */
/* b becomes CACHED at the tail of the inner queue (inner: it has children) or the LRU queue. */
void pkv__pool_lru_push(pkv__pool *p, uint32_t b, bool inner);
void pkv__pool_lru_remove(pkv__pool *p, uint32_t b); /* unlinks a CACHED block from its queue */
/* A CACHED block moves from the inner queue to the LRU queue's tail (no child in use left). */
void pkv__pool_lru_demote(pkv__pool *p, uint32_t b);

/* Whether index entry k counts in its parent's n_hot: in use, or CACHED or a tombstone above a
 * block in use. */
static inline bool pkv__blk_hot(const pkv__blk *k) {
    return k->state == PKV_BLK_ACTIVE || (k->state == PKV_BLK_CACHED && k->inner) ||
           (k->state == PKV_BLK_TOMB && k->n_hot > 0);
}

/* A FREE block (popped) becomes ACTIVE with ref 1 and clean metadata. */
void pkv__pool_activate(pkv__pool *p, uint32_t b);
/* ref += 1; a CACHED block leaves the LRU and becomes ACTIVE. */
void pkv__pool_ref(pkv__pool *p, uint32_t b);
/* ref -= 1; returns the new refcount. At 0 the caller decides CACHED or FREE via
 * pkv__pool_lru_push / pkv__pool_free_push (the block is in no queue until then). */
uint32_t pkv__pool_unref(pkv__pool *p, uint32_t b);
/* Adjusts n_fill of an ACTIVE block, keeping slots_used exact. */
void pkv__pool_set_fill(pkv__pool *p, uint32_t b, uint32_t n_fill);

#endif
