/* cache_int.h: the cache object: pool memory, sequences and block tables, the prefix index,
 * counters. Private to src/cache/. */
#ifndef PKV_CACHE_INT_H
#define PKV_CACHE_INT_H

#include "../attn/attn.h"
#include "../pool/pool.h"
#include "../quant/quant.h"

#include <pthread.h>
#include <stdatomic.h>

typedef struct pkv__seq {
    uint32_t gen;  /* generation: the id is (gen << 32) | index; moves on at release */
    uint8_t live;  /* slot holds a live sequence or pin */
    uint8_t is_pin;
    uint8_t shifting; /* pkv_seq_shift is moving its rows without the lock: its table holds the
                         blocks it refers to, the rest of its record is as the shift left it
                         midway (check.c checks only the former) */
    uint32_t n_tokens, n_committed, n_blocks, n_reused;
    uint32_t idx_len; /* table[0 .. idx_len) is this sequence's indexed chain */
    uint32_t n_dropped; /* table[0 .. n_dropped) are -1: blocks let go (pkv_seq_drop_front); it
                           indexes nothing more, and every position it is asked for is past them */
    uint32_t exact;     /* positions [0, exact) hold what a prefill of their token ids computes
                           (PKV_NONE: all): pkv_seq_shift lowers it, a truncate to it or below
                           sets PKV_NONE again; s indexes no block at or past exact / B */
    uint64_t ns_lo, ns_hi; /* namespace: XXH3-128 of the salt */
    uint32_t next_free;    /* free-slot list */
    uint32_t mark;         /* pkv_batch_compact's and pkv_batch_append's scratch, under the lock */
    uint32_t attn_len;     /* the length a masked non-causal request over it was checked at (its
                              mask's rows; attn_common, under attn_mu) */
    int32_t *table;        /* [max_blocks_per_seq] block ids; [0, n_blocks) valid */
} pkv__seq;

/* A group of a decode batch's sequences whose tables share their first `blocks` blocks (share.c),
 * counted from each member's base (pkv__share.base: the first block its queries see, past 0 where
 * chunks of local attention or a window that starts on a block boundary hide the earlier ones;
 * the same for every member): its members are pkv__share.order[first .. first + n); it reads
 * blocks [from, blocks) for them, a group of a superset of them (from its blocks on) or none (from
 * 0) the blocks before. */
typedef struct pkv__share_group {
    uint32_t first, n, from, blocks;
} pkv__share_group;

/* Shared-prefix decode's settings and scratch (share.c), under attn_mu. */
typedef struct pkv__share {
    uint32_t min_blocks; /* the fewest blocks a group shares (0: no groups; PKV_ATTN_SHARE) */
    uint32_t rows;       /* query rows (a member's query heads each) the scratch holds */
    uint32_t *full, *idx, *tmp, *order, *lcp; /* [max_seqs + 1] each */
    uint32_t *base;                           /* [max_seqs + 1]: an item's first visible block (full counts from it) */
    uint32_t *st_lcp, *st_lb, *st_id;         /* [max_seqs + 1] each: the lcp intervals' stack */
    uint32_t *nd_a, *nd_b, *nd_depth, *nd_up; /* [max_seqs + 1] each: the intervals, by id */
    uint32_t *nd_eff, *slot;                  /* [max_seqs + 1] each */
    uint64_t *qsum;                           /* [max_seqs + 1]: the queries of the first x members in order */
    uint32_t n_sorted;                        /* the members in order (the last plan's) */
    pkv__share_group *groups;                 /* [max_seqs] */
    float **lse_to;                           /* [max_seqs] each member's own lse (NULL: none) */
    float *q;                                 /* [rows][head_dim]: the groups' queries, then their outputs */
    float *o;                                 /* [rows][v_dim]: the outputs: q, or its own where v_dim < head_dim */
    float *lse_a, *lse_b;                     /* [rows]: the groups' parts' and the members' own parts' */
    uint64_t call_keys;                       /* this call's saved positions so far (pkv_stats) */
    _Atomic uint64_t keys;                    /* pkv_stats.attn_shared_keys */
} pkv__share;

struct pkv_cache {
    pkv_config cfg; /* resolved */
    pkv_allocator alloc;
    pthread_mutex_t mu;      /* metadata: pool, sequences, index, counters */
    pthread_mutex_t attn_mu; /* serializes attention calls (scratch + thread pool) */
    uint32_t B, n_blocks, max_seqs, max_bps, n_layers, n_kv, head_dim;
    uint32_t v_dim; /* values of a V row: head_dim, or cfg.v_dim where V lives in K (then v_row
                       and v_blk are 0: no V array; layer_view points V at K) */

    /* pool memory: layer l: K at kv + l * layer_stride, V at kv + l * layer_stride + v_off (the K
     * array, then a gap of v_skew bytes: cache.c) */
    uint8_t *kv;
    size_t kv_bytes, layer_stride, v_off, k_row, v_row, k_blk, v_blk;

    pkv__pool pool;
    pkv__blk *blk;  /* [n_blocks + tomb_cap]: the pool's blocks, then the tombstones (prefix.c) */
    int32_t *tokens; /* [n_blocks + tomb_cap][B] token ids of each block and tombstone */

    pkv__seq *seqs;  /* [max_seqs] */
    int32_t *tables; /* [max_seqs][max_bps] */
    uint32_t seq_free, n_live, n_pins;
    uint32_t gen_base; /* every slot's first generation, nonzero, far from other caches' (cache.c) */
    uint64_t n_tokens_total; /* sum of n_tokens over live sequences (pins excluded) */

    /* prefix index */
    uint32_t *buckets; /* [bucket_mask + 1] first block of each hash chain */
    uint32_t *roots;   /* [bucket_mask + 1] first block of each root list (prefix.c) */
    uint32_t bucket_mask;
    uint64_t n_indexed; /* index entries that hold K/V (blocks), tombstones not counted */
    /* tombstones: ids n_blocks .. n_blocks + tomb_cap - 1 (prefix.c, "Tombstones"); tomb_cap is
       4 x n_blocks where the cache indexes prefixes, else 0 */
    uint32_t tomb_cap, tomb_lim; /* tomb_lim: those that may be in use (a test hook lowers it) */
    uint32_t tomb_free, n_tombs; /* free ones linked through qnext; in use */
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
    uint64_t pfx_lookups, pfx_queried, pfx_hit, miss_new, miss_evicted, miss_ns, pfx_tomb_hits;
    uint64_t meta_bytes;

    /* checker scratch */
    uint32_t *chk_ref; /* [n_blocks] */
    uint32_t *chk_pos; /* [n_blocks] */

    pkv__attn *attn;
    pkv__attn_item *items; /* [2 x max_seqs]: a batch's, then its shared-prefix groups' (fewer) */
    uint8_t *share_mem;    /* share's scratch (cache.c: share_bytes) */
    pkv__share share;
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
/* The first position s still holds: the end of its dropped front (pkv_seq_drop_front; 0: none). */
static inline uint32_t pkv__seq_front(const pkv_cache *c, const pkv__seq *s) { return s->n_dropped * c->B; }
/* The blocks s may index: none at or past its first inexact position's (pkv_seq_shift). */
static inline uint32_t pkv__seq_index_cap(const pkv_cache *c, const pkv__seq *s) {
    return s->exact == PKV_NONE ? PKV_NONE : s->exact / c->B;
}
/* PKV_OK where s dropped nothing, else PKV_EINVAL said as api's refusal: for the calls that key
 * or hold a sequence by every position from 0 (pins, the storage tiers). */
int pkv__seq_whole(const pkv_cache *c, const pkv__seq *s, const char *api);

/* A fresh live slot (NULL when max_seqs are live) / back to the free list (id goes stale). */
pkv__seq *pkv__seq_new(pkv_cache *c);
void pkv__seq_free(pkv_cache *c, pkv__seq *s);
pkv_seq pkv__seq_id(const pkv_cache *c, const pkv__seq *s);
/* Drops table[keep_blocks ..) deepest first (so the LRU queue holds leaves before parents);
 * the dropped front's -1 entries (n_dropped) are passed over. */
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

/* Runs the kernels over c->items[0, k), saying why where they fail (attention calls, under
 * attn_mu). */
int pkv__cache_attn_run(pkv_cache *c, const pkv__kv_view *view, uint32_t k, const pkv__attn_call *call,
                        const char *api);

/* ---- share.c ---- (under attn_mu) */
/* Groups the decodes c->items[0, k) that share at least share.min_blocks whole blocks before their
 * queries, from the first block they see (every query of a member seeing from the same block
 * boundary on: none where a window or a chunk starts inside a block or moves between its queries;
 * members whose chunks start at different blocks in no group together): share.order and
 * share.groups, nested (the trie of their tables: a group of forks inside a group of requests that
 * share a system prompt); returns the number of groups (0: none, or share off). Every set of
 * members that share a prefix is a group, from its enclosing group's blocks to its own, where that
 * is min_blocks or more and the scratch still has rows for its members at call's n_q_heads query
 * heads (taken shallowest first, over the whole batch). */
uint32_t pkv__share_plan(pkv_cache *c, uint32_t k, const pkv__attn_call *call);
/* pkv__cache_attn_run for the requests c->items[0, k) (decodes, or extends of their queries; lse
 * pointing at the caller's or NULL), their shared prefixes read once a group: each group's part is
 * one more item of all its members' queries, before the k, and merges with its members' own parts
 * into their outputs. The members' items are changed (k_start, lse). */
int pkv__share_run(pkv_cache *c, const pkv__kv_view *view, uint32_t k, const pkv__attn_call *call,
                   const char *api);
/* The fewest shared positions that make a group (rounded up to whole blocks) unless
 * PKV_ATTN_SHARE says otherwise: "auto" (or unset, or empty) is this, "off" none, a number 1 to
 * PKV__SHARE_MIN_KEYS_MAX that number; pkv__share_env gives -1 for anything else (create refuses
 * it). Where the K/V is in cache, a group of fewer shared positions cost more than it saved on the
 * development machine (Intel Xeon, 2 threads, f16: 2-16 forks of 128-256 positions 0.79-1.17 of
 * the time without, 512 and more 0.82-0.99; from memory 0.59-0.90: docs/design.md, "Stop 74"). */
#define PKV__SHARE_MIN_KEYS 512u
#define PKV__SHARE_MIN_KEYS_MAX 1000000000u
int64_t pkv__share_env(void); /* the positions, 0 for off */
/* Test hook: the fewest blocks a group shares (0: no groups; pkv_cache_create sets the positions
 * of pkv__share_env in whole blocks), and the query rows the scratch takes (0: all it holds; at
 * most that). */
void pkv__cache_test_share(pkv_cache *c, uint32_t min_blocks, uint32_t rows);
/* The share scratch's bytes, and its arrays cut from share_mem. */
uint64_t pkv__share_bytes(const pkv_cache *c);
void pkv__share_carve(pkv_cache *c);

/* ---- prefix.c ---- */
void pkv__index_reset(pkv_cache *c);
/* d takes s's place in the index as s's fields say it (flags, identity, links, counts): the
 * half of a move that pkv__index_repoint leaves to the caller (compaction, a tombstone filled). */
static inline void pkv__index_fields_copy(pkv__blk *d, const pkv__blk *s) {
    d->flags = s->flags;
    d->hash = s->hash, d->chash = s->chash, d->ns_lo = s->ns_lo, d->ns_hi = s->ns_hi;
    d->parent = s->parent, d->hnext = s->hnext, d->child = s->child;
    d->sib_prev = s->sib_prev, d->sib_next = s->sib_next;
    d->n_children = s->n_children, d->n_hot = s->n_hot, d->depth = s->depth;
}
/* Whether id names a tombstone slot (pkv__blk.state PKV_BLK_TOMB while in use). */
static inline bool pkv__is_tomb(const pkv_cache *c, uint32_t id) { return id != PKV_NONE && id >= c->n_blocks; }
/* Evicts CACHED block b that waits in the inner queue (entries below it in use) by leaving a
 * tombstone in its place in the index (no event: the entry stays): true; false, and nothing changed,
 * where no tombstone is free (the caller evicts its subtree then, pkv__index_evict). b keeps no
 * index fields; its queue and state are the caller's. */
bool pkv__tomb_make(pkv_cache *c, uint32_t b);
/* The front of a match of r positions under window (prefix.c): the blocks wholly before the
 * first key a query at r sees (r - window + 1), never the last full block of the match. */
uint32_t pkv__window_front(uint32_t r, uint32_t window, uint32_t B);
/* The token ids of s's dropped blocks [0, n_dropped) into toks (B a block), from the index: the
 * chain above the first block s holds (blocks and tombstones). False where the index no longer
 * names them (prefix caching off, a chain cut by an eviction that took a subtree, or a front a
 * tier load skipped that pkv__seq_link_front did not link). Under the lock. */
bool pkv__seq_front_ids(const pkv_cache *c, const pkv__seq *s, int32_t *toks);
/* For a windowed tier load that started an empty sequence past its front (pkv__seq_skip): links
 * its chain into the index, as a windowed match would have found it. The dropped blocks'
 * identities, from tokens[0, n_dropped x B), are found in the index (a full registered partial
 * is made the entry) or made tombstones (STORED said for each: a new entry, with no K/V), and
 * s's full committed blocks from the front on are indexed below them as a commit indexes them;
 * where the first of them is indexed already (another block), s takes that block instead of its
 * copy. Nothing where prefix caching is off, where s's block at the front is not full and
 * committed or is indexed already, or where too few tombstones are free for those missing (none
 * made then). Takes the lock. */
void pkv__seq_link_front(pkv_cache *c, pkv_seq id, const int32_t *tokens);
/* Sequence id, holding no block (empty, or every block dropped, as only this leaves it), gets
 * length pos (a multiple of B; 0: empty again) with every block dropped, committed. PKV_EINVAL
 * (said as api's) where it holds a block, or for pos. Takes the lock. */
int pkv__seq_skip(pkv_cache *c, pkv_seq id, uint32_t pos, const char *api);
/* Where a full registered partial with the same parent and token ids as index entry b (CACHED,
 * being evicted) is on b's list, it takes b's place in the index, subtree and all (no event):
 * true, and b keeps no index fields (its queue and state are the caller's). Else false, nothing
 * changed. */
bool pkv__index_hand_over(pkv_cache *c, uint32_t b);
/* Frees the tombstones from p up that have no entry below them left (no indexed or partial
 * child; p: any id or PKV_NONE). */
void pkv__tomb_prune(pkv_cache *c, uint32_t p);
/* Test hook: at most n tombstones in use (at most tomb_cap; those in use stay). */
void pkv__cache_test_tombs(pkv_cache *c, uint32_t n);
/* Un-indexes a CACHED block about to be reused (eviction) with everything below it in the index:
 * a CACHED descendant goes FREE (counted as evicted), an ACTIVE one stays with its holders, a
 * partial one is unlinked, a tombstone freed; then the tombstones above it left with nothing
 * below. Only blocks above a dropped front's blocks have descendants (in the inner queue, or in
 * the LRU queue above a tombstone whose blocks below went CACHED); the chains of their holders
 * then end where the index does. */
void pkv__index_evict(pkv_cache *c, uint32_t b);
/* Index entry p (PKV_NONE: none) gained / lost a child in use (pkv__blk.n_hot). A CACHED p that
 * gains its first moves to the inner queue's tail, and a tombstone gains its first too, and so
 * on up (a windowed match's first block below a front it does not take); a CACHED p left with
 * none moves from the inner queue to the LRU queue's tail, and so on up. */
void pkv__hot_up(pkv_cache *c, uint32_t p);
void pkv__hot_down(pkv_cache *c, uint32_t p);
/* pkv__pool_ref, counting a CACHED index entry taken back among its parent's children in use. */
void pkv__ref_block(pkv_cache *c, uint32_t b);
/* The root list of a namespace and first token id: c->roots[pkv__root_slot(...)]. */
uint32_t pkv__root_slot(const pkv_cache *c, uint64_t ns_lo, uint64_t ns_hi, int32_t tok0);
/* The fewest ids of a media (pkv_media_tokens: negative ids) a match or a tier load may end
 * after, where the prompt's media goes on: fewer are given back (pkv__media_trim). */
#define PKV__MEDIA_MIN 4
/* A media's first id (pkv_media_tokens: [-2^31, -2^30 - 1]; its others [-2^30, -1]). */
static inline bool pkv__media_first(int32_t id) { return id < -(INT32_C(1) << 30); }
/* Whether id goes on with the media before it: a media's id other than a first. */
static inline bool pkv__media_more(int32_t id) { return id < 0 && !pkv__media_first(id); }
uint32_t pkv__media_open(const int32_t *tokens, uint32_t r);
uint32_t pkv__media_trim(const int32_t *tokens, uint32_t n, uint32_t r);
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
/* Tests: attention and the tree's path part go to the cache's threads from elems K/V elements on
 * (pkv__attn_set_inline_work; 0: every call with more than one task), so that a small test
 * call runs on them as a large one would. */
void pkv__cache_test_inline_work(pkv_cache *c, uint64_t elems);

/* ---- events.c ---- (under c->mu; no-ops with event_capacity 0) */
/* Records STORED / REMOVED of indexed block b (its fields set: hash, parent, depth). */
void pkv__event_block(pkv_cache *c, pkv_event_kind kind, uint32_t b);
/* Records CLEARED (pkv_cache_reset). */
void pkv__event_cleared(pkv_cache *c);

#endif
