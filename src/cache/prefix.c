/* prefix.c: the prefix index: identity hashing (XXH3), exact lookup, indexing at commit,
 * token-granular matching, eviction bookkeeping and pins.
 *
 * A block's identity is (namespace, parent block, its B token ids). The hash chains the
 * parent's hash, so it is a digest of the namespace and the whole token prefix; a lookup
 * compares the parent id, the namespace (roots) and every token id exactly, so a hash
 * collision can only cost time, never hand out the wrong K/V.
 *
 * Chains: a sequence indexes its full committed blocks only while its own table is the indexed
 * chain (table[i]'s parent is table[i-1]). Hence whoever holds an indexed block holds its
 * ancestors, up to its dropped front (pkv_seq_drop_front), and releasing deepest-first keeps
 * every CACHED block behind its CACHED children in the LRU queue: evicting from the head takes a
 * leaf. A front's dropped block may go CACHED above blocks still in use: it waits in the inner
 * queue (pkv__blk.n_hot, below), taken only where the LRU queue is empty, and then its whole
 * subtree leaves the index (pkv__index_evict). */
#include "cache_int.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

/* XXH3's output was final from xxHash 0.8.0 on: identity hashes (events, pkv_prefix_hashes) and
 * media ids (pkv_media_tokens) must be the same in every build */
#if XXH_VERSION_NUMBER < 800
#error "xxHash 0.8.0 or later is needed (XXH3's output changed before it)"
#endif

void pkv__salt_digest(const void *salt, size_t len, uint64_t *lo, uint64_t *hi) {
    XXH128_hash_t h = XXH3_128bits_withSeed(len ? salt : "", len, 0x706b7673616c74ull /* "pkvsalt" */);
    *lo = h.low64;
    *hi = h.high64;
}

uint64_t pkv__hash_seeded(const pkv_cache *c, uint64_t seed, const int32_t *toks) {
    if (c->const_hash) return 0x5151515151515151ull;
    return XXH3_64bits_withSeed(toks, (size_t)c->B * sizeof(int32_t), seed);
}

/* A first block's seed: its namespace's digest folded to 64 bits. */
static uint64_t root_seed(uint64_t ns_lo, uint64_t ns_hi) { return ns_lo ^ (ns_hi * 0x9E3779B97F4A7C15ull); }

uint64_t pkv__identity_hash(const pkv_cache *c, uint32_t parent, uint64_t ns_lo, uint64_t ns_hi,
                            const int32_t *toks) {
    uint64_t seed = parent == PKV_NONE ? root_seed(ns_lo, ns_hi) : c->blk[parent].hash;
    return pkv__hash_seeded(c, seed, toks);
}

PKV_API int pkv_prefix_hashes(const void *salt, size_t salt_len, uint32_t block_tokens, const int32_t *tokens,
                              size_t n, uint64_t *hashes, size_t cap, size_t *n_out) {
    if (!n_out || block_tokens < 1 || block_tokens > 1024 || salt_len > 256 || (!salt && salt_len) ||
        (!tokens && n) || (!hashes && cap))
        return PKV_EINVAL;
    uint64_t lo, hi;
    pkv__salt_digest(salt, salt_len, &lo, &hi);
    const size_t m = PKV_MIN(n / block_tokens, cap);
    uint64_t seed = root_seed(lo, hi);
    for (size_t i = 0; i < m; i++)
        hashes[i] = seed = XXH3_64bits_withSeed(tokens + i * block_tokens, block_tokens * sizeof(int32_t), seed);
    *n_out = m;
    return PKV_OK;
}

PKV_API int pkv_media_tokens(const void *id, size_t id_len, uint32_t offset, uint32_t n, int32_t *out) {
    if (!id_len || !id || (!out && n) || (uint64_t)offset + n > (uint64_t)UINT32_MAX + 1) return PKV_EINVAL;
    /* the digest in XXH3's canonical (big-endian) form: the same 16 bytes on every machine */
    XXH128_canonical_t key;
    XXH128_canonicalFromHash(&key, XXH3_128bits_withSeed(id, id_len, 0x706b766d65646961ull /* "pkvmedia" */));
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t pos = (uint64_t)offset + i;
        const int32_t v = (int32_t)(XXH3_64bits_withSeed(&key, sizeof key, pos) >> 34); /* 30 bits */
        out[i] = pos == 0 ? INT32_MIN + v /* the first: [-2^31, -2^30 - 1] */ : -1 - v /* [-2^30, -1] */;
    }
    return PKV_OK;
}

uint64_t pkv__content_hash(const pkv_cache *c, uint32_t parent, const int32_t *toks) {
    uint64_t seed = parent == PKV_NONE ? 0x636f6e74656e74ull : c->blk[parent].chash;
    return XXH3_64bits_withSeed(toks, (size_t)c->B * sizeof(int32_t), seed);
}

void pkv__cache_test_const_hash(pkv_cache *c, int on) {
    pthread_mutex_lock(&c->mu);
    c->const_hash = on;
    pthread_mutex_unlock(&c->mu);
}

void pkv__index_reset(pkv_cache *c) {
    for (uint32_t i = 0; i <= c->bucket_mask; i++) c->buckets[i] = c->roots[i] = PKV_NONE;
    c->n_indexed = 0;
    c->tomb_free = PKV_NONE;
    for (uint32_t i = c->tomb_cap; i-- > 0;) { /* every tombstone free, the first on top */
        pkv__blk *k = &c->blk[c->n_blocks + i];
        *k = (pkv__blk){.state = PKV_BLK_FREE, .qprev = PKV_NONE, .qnext = c->tomb_free, .parent = PKV_NONE,
                        .hnext = PKV_NONE, .child = PKV_NONE, .sib_prev = PKV_NONE, .sib_next = PKV_NONE};
        c->tomb_free = c->n_blocks + i;
    }
    c->n_tombs = 0;
    /* the fingerprint tables keep their history across a reset: "evicted" stays meaningful */
}

/* ---- the index tree's lists ----
 * An INDEXED or PARTIAL block with a parent is on its parent's child list. One without (a root:
 * the first block of its chain) is on a root list instead, c->roots[pkv__root_slot], keyed by
 * its namespace and first token id: so a prompt that shares less than one block with the index
 * finds the roots it may share leading tokens with (token-granular matching of block 0). Both
 * kinds of list link through sib_prev / sib_next, newest first. */
uint32_t pkv__root_slot(const pkv_cache *c, uint64_t ns_lo, uint64_t ns_hi, int32_t tok0) {
    if (c->const_hash) return 0; /* the test switch puts every root on one list too */
    uint64_t x = ns_lo ^ (ns_hi * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)(uint32_t)tok0 * 0xC2B2AE3D27D4EB4Full);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (uint32_t)x & c->bucket_mask;
}

/* The slot that names b first when it heads its list: its parent's child field or its root
 * list's head. b must be on a list (INDEXED or PARTIAL). */
uint32_t *pkv__tree_head(pkv_cache *c, uint32_t b) {
    const pkv__blk *k = &c->blk[b];
    if (k->parent != PKV_NONE) return &c->blk[k->parent].child;
    return &c->roots[pkv__root_slot(c, k->ns_lo, k->ns_hi, c->tokens[(size_t)b * c->B])];
}

void pkv__tree_link(pkv_cache *c, uint32_t parent, uint32_t b) {
    pkv__blk *k = &c->blk[b];
    k->parent = parent;
    uint32_t *head = pkv__tree_head(c, b);
    k->sib_prev = PKV_NONE;
    k->sib_next = *head;
    if (*head != PKV_NONE) c->blk[*head].sib_prev = b;
    *head = b;
}

void pkv__tree_unlink(pkv_cache *c, uint32_t b) {
    pkv__blk *k = &c->blk[b];
    if (k->sib_prev != PKV_NONE) c->blk[k->sib_prev].sib_next = k->sib_next;
    else *pkv__tree_head(c, b) = k->sib_next;
    if (k->sib_next != PKV_NONE) c->blk[k->sib_next].sib_prev = k->sib_prev;
    k->sib_prev = k->sib_next = PKV_NONE;
    k->parent = PKV_NONE;
}

/* ---- children in use (pkv__blk.n_hot) ----
 * An index entry is hot where it is ACTIVE, or CACHED in the inner queue (a block below it is in
 * use: only a dropped front leaves one so). A CACHED block with a hot child waits in the inner
 * queue, one without in the LRU queue, behind the children that went CACHED before it. */
void pkv__hot_up(pkv_cache *c, uint32_t p) {
    /* a child comes into use below a block in use (a link below a held block; a match that takes
       a chain from its root), where p's own count in its parent stays as it is; or, from a
       windowed match (pkv_seq_match_prefix_window), right past a front it does not take: p,
       CACHED in the LRU queue or a tombstone with no child in use, becomes hot, and so on up */
    while (p != PKV_NONE) {
        pkv__blk *k = &c->blk[p];
        const bool hot = pkv__blk_hot(k);
        k->n_hot++;
        if (hot) return;
        if (k->state == PKV_BLK_CACHED) { /* to the inner queue's tail */
            pkv__pool_lru_remove(&c->pool, p);
            pkv__pool_lru_push(&c->pool, p, true);
        } else {
            pkv_assert(k->state == PKV_BLK_TOMB);
        }
        p = k->parent;
    }
}

void pkv__hot_down(pkv_cache *c, uint32_t p) {
    while (p != PKV_NONE) {
        pkv__blk *k = &c->blk[p];
        pkv_assert(k->n_hot > 0);
        if (--k->n_hot) return; /* still hot */
        if (k->state == PKV_BLK_CACHED) pkv__pool_lru_demote(&c->pool, p); /* behind its children that went CACHED */
        else if (k->state != PKV_BLK_TOMB) return;                        /* ACTIVE: hot all the same */
        p = k->parent;
    }
}

void pkv__ref_block(pkv_cache *c, uint32_t b) {
    const pkv__blk *k = &c->blk[b];
    const bool cold = k->state == PKV_BLK_CACHED && !k->inner; /* (CACHED: indexed) */
    pkv__pool_ref(&c->pool, b);
    if (cold) pkv__hot_up(c, k->parent);
}

/* pkv__partial_unlink less its prune (pkv__index_evict walks the parent next); the parent. */
static uint32_t partial_drop(pkv_cache *c, uint32_t b) {
    pkv_assert(c->blk[b].flags & PKV_BLKF_PARTIAL);
    const uint32_t parent = c->blk[b].parent;
    const bool hot = pkv__blk_hot(&c->blk[b]);
    pkv__tree_unlink(c, b);
    if (hot) pkv__hot_down(c, parent);
    c->blk[b].flags &= (uint8_t)~PKV_BLKF_PARTIAL;
    c->blk[b].ns_lo = c->blk[b].ns_hi = 0;
    return parent;
}

void pkv__partial_unlink(pkv_cache *c, uint32_t b) { pkv__tomb_prune(c, partial_drop(c, b)); }

/* ---- hash table ---- */
static uint32_t lookup(const pkv_cache *c, uint64_t h, uint32_t parent, uint64_t ns_lo, uint64_t ns_hi,
                       const int32_t *toks) {
    for (uint32_t b = c->buckets[h & c->bucket_mask]; b != PKV_NONE; b = c->blk[b].hnext) {
        const pkv__blk *k = &c->blk[b];
        if (k->hash != h || k->parent != parent) continue;
        if (parent == PKV_NONE && (k->ns_lo != ns_lo || k->ns_hi != ns_hi)) continue;
        if (memcmp(c->tokens + (size_t)b * c->B, toks, (size_t)c->B * sizeof(int32_t))) continue;
        return b;
    }
    return PKV_NONE;
}

static void bucket_remove(pkv_cache *c, uint32_t b) {
    uint32_t *at = &c->buckets[c->blk[b].hash & c->bucket_mask];
    while (*at != b) {
        pkv_assert(*at != PKV_NONE);
        at = &c->blk[*at].hnext;
    }
    *at = c->blk[b].hnext;
    c->blk[b].hnext = PKV_NONE;
}

/* A free tombstone slot, taken off the free list and counted in use; PKV_NONE where none may be. */
static uint32_t tomb_take(pkv_cache *c) {
    if (c->tomb_free == PKV_NONE || c->n_tombs >= c->tomb_lim) return PKV_NONE;
    const uint32_t t = c->tomb_free;
    c->tomb_free = c->blk[t].qnext;
    c->n_tombs++;
    return t;
}

/* Tombstone t (out of the index now) back on the free list. */
static void tomb_put(pkv_cache *c, uint32_t t) {
    pkv__blk *k = &c->blk[t];
    k->state = PKV_BLK_FREE;
    k->n_children = k->n_hot = 0;
    k->qnext = c->tomb_free;
    c->tomb_free = t;
    c->n_tombs--;
}

/* Takes index entry b out of the index: REMOVED said, its hash chain, its parent's count and
 * child list; a tombstone (which has no entry below it left) freed. */
static void unindex(pkv_cache *c, uint32_t b) {
    pkv__blk *k = &c->blk[b];
    const bool tomb = k->state == PKV_BLK_TOMB;
    pkv_assert(!tomb || k->child == PKV_NONE);
    pkv__event_block(c, PKV_EVENT_REMOVED, b);
    bucket_remove(c, b);
    const uint32_t parent = k->parent;
    const bool hot = pkv__blk_hot(k);
    if (parent != PKV_NONE) c->blk[parent].n_children--;
    pkv__tree_unlink(c, b);
    if (hot) pkv__hot_down(c, parent);
    k->flags = 0;
    k->ns_lo = k->ns_hi = 0;
    if (tomb) tomb_put(c, b);
    else c->n_indexed--;
}

/* the entries of one list a scan for a registered partial compares (newest first): a match's
   token-granular hit, a full partial that takes an entry's place */
#define PARTIAL_SCAN 64

/* ---- tombstones ----
 * A dropped front (pkv_seq_drop_front) leaves CACHED blocks above blocks in use. Evicting one
 * used to take its whole subtree out of the index, since identities chain from block 0 (below);
 * but a windowed or chunked layer's next query reads only the last window's blocks, so for
 * pkv_seq_match_prefix_window an evicted ancestor is needed only as an identity: its token ids,
 * to be compared, and its place in the tree. A tombstone keeps just that (SGLang's SWA radix
 * cache keeps such nodes): a slot of blk[] and tokens[] past the pool's (ids n_blocks ..), state
 * PKV_BLK_TOMB, flags INDEXED, in its hash chain and its parent's child list, its children's
 * parent, counted in its parent's n_hot while an entry below it is in use; in no queue, and
 * never in a table. Events describe the index's entries, so a block that leaves a tombstone
 * says nothing, and REMOVED comes when the tombstone goes (its children's first, as ever; its
 * block field then names the tombstone: n_blocks or more); n_indexed counts blocks only. It
 * lives while an entry is below it (pkv__tomb_prune frees it when its last child goes), until
 * pkv_cache_reset, or until a sequence indexes the same block again (take_place, at commit: the
 * block takes its place and its subtree). A windowed tier load that skipped a front makes
 * tombstones for the identities before it that the index lacks (tomb_new: STORED said), its
 * first block linked below them at once. A plain match (pkv_seq_match_prefix) stops at one, as
 * at an evicted block. With every tombstone in use (tomb_cap: 4 x n_blocks) eviction takes the
 * subtree out as before. */
void pkv__cache_test_tombs(pkv_cache *c, uint32_t n) {
    pthread_mutex_lock(&c->mu);
    c->tomb_lim = PKV_MIN(n, c->tomb_cap);
    pthread_mutex_unlock(&c->mu);
}

bool pkv__tomb_make(pkv_cache *c, uint32_t b) {
    const uint32_t t = tomb_take(c);
    if (t == PKV_NONE) return false;
    pkv__blk *k = &c->blk[t];
    *k = c->blk[b];
    k->state = PKV_BLK_TOMB;
    k->ref = 0;
    k->inner = 0;
    k->qprev = k->qnext = PKV_NONE;
    memcpy(c->tokens + (size_t)t * c->B, c->tokens + (size_t)b * c->B, (size_t)c->B * sizeof(int32_t));
    pkv__index_repoint(c, b, t); /* its links name t; b keeps no index fields */
    c->n_indexed--;
    return true;
}

void pkv__tomb_prune(pkv_cache *c, uint32_t p) {
    while (pkv__is_tomb(c, p) && c->blk[p].child == PKV_NONE) {
        const uint32_t up = c->blk[p].parent;
        unindex(c, p);
        p = up;
    }
}

/* Block b (ACTIVE, full and committed, table[i] of a sequence, maybe a registered partial on the
 * same list) takes the place of index entry t, its twin (the same parent and token ids): a
 * tombstone (freed) or a CACHED block being evicted (pkv__index_hand_over; the caller frees it).
 * t's children are b's. No event: the entry never left the index (its block changes, as when
 * compaction moves one). */
static void take_place(pkv_cache *c, uint32_t t, uint32_t b) {
    pkv__blk *x = &c->blk[t], *k = &c->blk[b];
    const bool tomb = x->state == PKV_BLK_TOMB;
    const uint32_t parent = x->parent;
    const bool was_hot = x->n_hot > 0;
    if (k->flags & PKV_BLKF_PARTIAL) {
        /* counted in use under the same parent already: of the two, one stays counted */
        pkv__tree_unlink(c, b);
        k->flags &= (uint8_t)~PKV_BLKF_PARTIAL;
        if (was_hot && parent != PKV_NONE) {
            pkv_assert(c->blk[parent].n_hot > 1);
            c->blk[parent].n_hot--;
        }
    } else if (!was_hot) {
        pkv__hot_up(c, parent);
    }
    pkv__index_fields_copy(k, x); /* (flags: INDEXED) */
    pkv__index_repoint(c, t, b);
    if (tomb) {
        tomb_put(c, t);
        c->n_indexed++;
    }
}

/* The newest full registered partial among the first PARTIAL_SCAN entries of the list from head
 * (a child list, or a root list: namespace ns there, 0 below a parent) whose token ids are
 * toks; PKV_NONE where there is none. */
static uint32_t full_partial(const pkv_cache *c, uint32_t head, uint64_t ns_lo, uint64_t ns_hi, const int32_t *toks) {
    const uint32_t B = c->B;
    uint32_t scanned = 0;
    for (uint32_t ch = head; ch != PKV_NONE && scanned++ < PARTIAL_SCAN; ch = c->blk[ch].sib_next) {
        const pkv__blk *x = &c->blk[ch];
        if ((x->flags & PKV_BLKF_PARTIAL) && x->n_commit == B && x->ns_lo == ns_lo && x->ns_hi == ns_hi &&
            !memcmp(c->tokens + (size_t)ch * B, toks, (size_t)B * sizeof(int32_t)))
            return ch;
    }
    return PKV_NONE;
}

/* A registered partial that filled up where its twin was indexed stays a partial (the commit
 * stops at the twin), found only by a match's token-granular scan. When that twin is evicted, such
 * a block takes its place, so that the identity stays indexed with K/V and its subtree with it:
 * else a tombstone (or nothing) would stand in the index beside a full copy, and a plain match
 * would stop at the tombstone where the scan then copies the block and its commit fills the
 * tombstone: the same match again would find more. Scans the most recent PARTIAL_SCAN entries of
 * b's list (as the match's scan does). */
bool pkv__index_hand_over(pkv_cache *c, uint32_t b) {
    const pkv__blk *k = &c->blk[b];
    if (!(k->flags & PKV_BLKF_INDEXED)) return false;
    const uint32_t p = full_partial(c, *pkv__tree_head(c, b), k->ns_lo, k->ns_hi, c->tokens + (size_t)b * c->B);
    if (p == PKV_NONE) return false;
    take_place(c, b, p);
    return true;
}

/* After an eviction un-indexed blocks that sequences hold (each such holder dropped its front
 * past the evicted block, pkv_seq_drop_front: a holder of the block before would hold the
 * evicted one): every chain ends at its first entry no longer indexed. The subtree went whole, so
 * a chain breaks at one place. */
static void chains_clamp(pkv_cache *c) {
    for (uint32_t i = 0; i < c->max_seqs; i++) {
        pkv__seq *s = &c->seqs[i];
        if (!s->live || !s->n_dropped) continue;
        uint32_t j = s->n_dropped;
        while (j < s->idx_len && (c->blk[s->table[j]].flags & PKV_BLKF_INDEXED)) j++;
        if (j < s->idx_len) s->idx_len = j;
    }
}

void pkv__index_evict(pkv_cache *c, uint32_t b) {
    pkv_assert(c->blk[b].flags & PKV_BLKF_INDEXED);
    const uint32_t top = c->blk[b].parent;
    /* the subtree below b, deepest first and without a stack: down to a first child while there
       is one, that leaf out, back up to its parent. A block whose holders dropped the blocks
       before it is found only here (whoever else holds an indexed block holds its ancestors) */
    bool held = false;
    for (uint32_t x = b;;) {
        while (c->blk[x].child != PKV_NONE) x = c->blk[x].child;
        const uint32_t up = c->blk[x].parent;
        const bool tomb = c->blk[x].state == PKV_BLK_TOMB; /* (unindex frees it) */
        if (c->blk[x].flags & PKV_BLKF_PARTIAL) partial_drop(c, x); /* (up is walked next) */
        else unindex(c, x);
        if (x == b) break;
        if (!tomb && c->blk[x].state == PKV_BLK_CACHED) { /* of no use without b: free */
            pkv__pool_lru_remove(&c->pool, x);
            pkv__pool_free_push(&c->pool, x);
            c->evictions++;
        } else if (!tomb) {
            held = true;
        }
        x = up;
    }
    if (held) chains_clamp(c);
    pkv__tomb_prune(c, top);
}

void pkv__index_repoint(pkv_cache *c, uint32_t src, uint32_t dst) {
    pkv__blk *k = &c->blk[src];
    if (k->flags & PKV_BLKF_INDEXED) { /* its place in the hash chain */
        uint32_t *at = &c->buckets[k->hash & c->bucket_mask];
        while (*at != src) {
            pkv_assert(*at != PKV_NONE);
            at = &c->blk[*at].hnext;
        }
        *at = dst;
    }
    if (k->sib_prev != PKV_NONE) c->blk[k->sib_prev].sib_next = dst;
    else *pkv__tree_head(c, src) = dst;
    if (k->sib_next != PKV_NONE) c->blk[k->sib_next].sib_prev = dst;
    for (uint32_t ch = k->child; ch != PKV_NONE; ch = c->blk[ch].sib_next) c->blk[ch].parent = dst;
    k->flags = 0;
    k->parent = k->hnext = k->child = k->sib_prev = k->sib_next = PKV_NONE;
    k->n_children = k->n_hot = 0;
    k->ns_lo = k->ns_hi = 0;
}

/* The fingerprint tables behind the miss reasons (best effort): a value x may sit in two slots,
 * x & mask and (x >> 32) & mask. A put takes the first that holds x or is empty, else the second,
 * whose old value moves to its own other slot if that is empty and is lost otherwise. With one
 * slot a value, a full index lost about a fifth of its fingerprints to collisions (stop 51: a
 * lookup under another namespace then counted as never seen). 0 marks an empty slot. */
static void fp_put(uint64_t *t, uint32_t mask, uint64_t x) {
    uint64_t *a = &t[x & mask], *b = &t[(x >> 32) & mask];
    if (*a == x || *b == x) return;
    if (!*a) {
        *a = x;
        return;
    }
    const uint64_t y = *b;
    *b = x;
    if (!y) return;
    uint64_t *ya = &t[y & mask], *alt = ya == b ? &t[(y >> 32) & mask] : ya;
    if (!*alt) *alt = y;
}

static bool fp_has(const uint64_t *t, uint32_t mask, uint64_t x) {
    return t[x & mask] == x || t[(x >> 32) & mask] == x;
}

/* A new index entry x (its hash and content hash set, linked below parent): counted among
 * parent's children, in its hash bucket, and in the fingerprints of the miss reasons. */
static void entry_put(pkv_cache *c, uint32_t x, uint32_t parent) {
    pkv__blk *k = &c->blk[x];
    if (parent != PKV_NONE) c->blk[parent].n_children++;
    uint32_t *bucket = &c->buckets[k->hash & c->bucket_mask];
    k->hnext = *bucket;
    *bucket = x;
    fp_put(c->fp_seen, c->fp_mask, k->hash);
    fp_put(c->fp_content, c->fp_mask, k->chash);
}

/* Makes block b (full, committed, table[i] of s) an index entry under parent. */
static void index_insert(pkv_cache *c, const pkv__seq *s, uint32_t b, uint32_t parent, uint64_t h, uint32_t depth) {
    pkv__blk *k = &c->blk[b];
    /* a registered partial that just filled up is on its parent's list (or its root list)
       already, counted there in use: it moves to the list's head, as a new entry goes */
    const bool linked = (k->flags & PKV_BLKF_PARTIAL) != 0;
    pkv_assert(!linked || k->parent == parent);
    if (linked) pkv__tree_unlink(c, b);
    k->flags = (uint8_t)((k->flags & ~PKV_BLKF_PARTIAL) | PKV_BLKF_INDEXED);
    k->hash = h;
    k->depth = depth;
    k->chash = pkv__content_hash(c, parent, c->tokens + (size_t)b * c->B);
    k->ns_lo = parent == PKV_NONE ? s->ns_lo : 0;
    k->ns_hi = parent == PKV_NONE ? s->ns_hi : 0;
    pkv__tree_link(c, parent, b);
    if (!linked) pkv__hot_up(c, parent);
    entry_put(c, b, parent);
    c->n_indexed++;
    pkv__event_block(c, PKV_EVENT_STORED, b);
}

void pkv__index_after_commit(pkv_cache *c, pkv__seq *s) {
    if (!c->cfg.enable_prefix_cache) return;
    /* past a dropped front the chain goes on from a block s still holds, or from the block right
       past the front where that is linked below the dropped one before it (a partial tail
       registered while s held that one, filled up since, or a block a fork indexed there):
       nothing else names that parent */
    if (s->n_dropped && s->idx_len <= s->n_dropped) {
        if (s->idx_len < s->n_dropped || s->idx_len >= s->n_blocks) return;
        const pkv__blk *k = &c->blk[s->table[s->idx_len]];
        if (!(k->flags & (PKV_BLKF_PARTIAL | PKV_BLKF_INDEXED)) || k->parent == PKV_NONE) return;
    }
    const uint32_t B = c->B, cap = pkv__seq_index_cap(c, s); /* (a shift's moved rows: none) */
    uint32_t full = PKV_MIN(s->n_committed / B, cap);
    /* extend this sequence's indexed chain over its full committed blocks */
    while (s->idx_len < full) {
        uint32_t i = s->idx_len, b = (uint32_t)s->table[i];
        pkv__blk *k = &c->blk[b];
        const uint32_t parent = !i ? PKV_NONE : i > s->n_dropped ? (uint32_t)s->table[i - 1] : k->parent;
        if (k->flags & PKV_BLKF_INDEXED) { /* attached by match or fork: already the chain */
            pkv_assert(k->parent == parent);
            s->idx_len++;
            continue;
        }
        if (k->moved) break; /* (a fork's shift moved rows into it: pkv_seq_shift) */
        const int32_t *toks = c->tokens + (size_t)b * B;
        uint64_t h = pkv__identity_hash(c, parent, s->ns_lo, s->ns_hi, toks);
        const uint32_t twin = lookup(c, h, parent, s->ns_lo, s->ns_hi, toks);
        if (pkv__is_tomb(c, twin)) { /* the block comes back, under its subtree */
            take_place(c, twin, b);
            s->idx_len++;
            continue;
        }
        if (twin != PKV_NONE) break; /* a twin is indexed */
        index_insert(c, s, b, parent, h, i);
        s->idx_len++;
    }
    /* register the committed part of the tail block for token-granular matching (block 0: on
       its root list, under s's namespace) */
    uint32_t rem = s->n_committed % B, i = full;
    if (rem && i == s->idx_len && i < s->n_blocks && i < cap && (!i || i > s->n_dropped)) {
        uint32_t b = (uint32_t)s->table[i];
        pkv__blk *k = &c->blk[b];
        if (!(k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL)) && k->n_commit > 0 && !k->moved) {
            k->ns_lo = i ? 0 : s->ns_lo;
            k->ns_hi = i ? 0 : s->ns_hi;
            pkv__tree_link(c, i ? (uint32_t)s->table[i - 1] : PKV_NONE, b);
            pkv__hot_up(c, k->parent);
            k->flags |= PKV_BLKF_PARTIAL;
        }
    }
}

static uint32_t common_prefix(const int32_t *a, const int32_t *b, uint32_t n) {
    uint32_t i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* The ids of a media open at r: where tokens[r - 1] is a media's (negative) and fewer than
 * PKV__MEDIA_MIN of that media's ids are before r (back to its first, which pkv_media_tokens
 * marks: two media side by side are told apart), their count; else 0. */
uint32_t pkv__media_open(const int32_t *tokens, uint32_t r) {
    uint32_t run = 0;
    while (run < r && tokens[r - 1 - run] < 0) {
        if (++run >= PKV__MEDIA_MIN) return 0;
        if (pkv__media_first(tokens[r - run])) break;
    }
    return run;
}

/* Positions a match ending before tokens[r] gives back: the media ids open there
 * (pkv__media_open) where the prompt's next id goes on with that media (fewer than
 * PKV__MEDIA_MIN of its ids may agree by chance, 2^-30 each; PKV__MEDIA_MIN or more hardly
 * ever). 0 where the match ends on a text id, where the prompt goes on with a text id or
 * another media's first (the media was matched whole), or where enough of its ids agreed. */
uint32_t pkv__media_trim(const int32_t *tokens, uint32_t n, uint32_t r) {
    return r < n && pkv__media_more(tokens[r]) ? pkv__media_open(tokens, r) : 0;
}

/* The front of a match of r positions under window: the blocks wholly before the first key a
 * query at r sees (r - window + 1), but never the last full block of the match, so that the
 * sequence's indexed chain goes on from one it holds. */
uint32_t pkv__window_front(uint32_t r, uint32_t window, uint32_t B) {
    const uint32_t last_full = r / B ? r / B - 1 : 0;
    return PKV_MIN((r - PKV_MIN(r, window - 1)) / B, last_full);
}

/* The longest match of at most r positions, over chain[0 .. k) (block ids and tombstones), whose
 * blocks from its front (window_front) on are blocks, not tombstones. */
static uint32_t window_fit(const pkv_cache *c, const uint32_t *chain, uint32_t k, uint32_t r, uint32_t window) {
    const uint32_t B = c->B;
    for (;;) {
        if (!r) return 0;
        const uint32_t lo = pkv__window_front(r, window, B);
        uint32_t j = PKV_MIN(k, (r + B - 1) / B);
        while (j > lo && !pkv__is_tomb(c, chain[j - 1])) j--;
        if (j == lo) return r;
        r = (j - 1) * B; /* ends before that tombstone */
    }
}

/* pkv_seq_match_prefix (window 0) and pkv_seq_match_prefix_window. */
static int match(pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n, uint32_t window, uint32_t *n_reused,
                 const char *api) {
    if (!c) return PKV_EINVAL;
    if (!n_reused) return pkv__say(c, PKV_EINVAL, api, "n_reused is NULL");
    if (n && !tokens) return pkv__say(c, PKV_EINVAL, api, "tokens is NULL, n %u", n);
    pthread_mutex_lock(&c->mu);
    pkv__seq *s;
    int rc = pkv__get_seq(c, id, &s, api);
    if (rc) goto out;
    if (s->n_tokens != 0) {
        rc = pkv__say(c, PKV_EINVAL, api, "the sequence holds %u positions: a match goes into an empty one",
                      s->n_tokens);
        goto out;
    }
    *n_reused = 0;
    s->n_reused = 0; /* an empty sequence: a match that attaches nothing leaves it at 0 */
    c->pfx_lookups++;
    c->pfx_queried += n;
    if (!c->cfg.enable_prefix_cache) goto out;
    if (n <= 1) goto out;
    const uint32_t B = c->B, cap = n - 1;
    /* blocks holding positions [0, cap): with B = 1 the block of the last prompt token holds no
       reusable position and must not be attached (it would lie past the length) */
    uint32_t prev = PKV_NONE, k = 0, full = (uint32_t)PKV_MIN(PKV_MIN(n / B, ((uint64_t)cap + B - 1) / B), c->max_bps);
    /* the chain's ids, in s's table until they are taken (tombstones among them only under a
       window) */
    uint32_t *chain = (uint32_t *)(void *)s->table;
    /* The identity hash of block i is seeded by block i-1's hash, which on a hit is the hash
       just computed: so a chunk of hashes is computed ahead, and the bucket heads, block records
       and token ids of the next lookups are prefetched while this one is compared. Without it
       a hit in a large index waits on three dependent cache misses per block. */
    enum { AHEAD = 64, DIST = 4 };
    /* a miss at block 0 goes on to the root list: its head is fetched while block 0 is hashed */
    const uint32_t root_slot = pkv__root_slot(c, s->ns_lo, s->ns_hi, tokens[0]);
    __builtin_prefetch(&c->roots[root_slot]);
    uint64_t hs[AHEAD];
    bool miss = false;
    while (k < full && !miss) {
        uint32_t m = PKV_MIN((uint32_t)AHEAD, full - k);
        for (uint32_t j = 0; j < m; j++) {
            hs[j] = j == 0 ? pkv__identity_hash(c, prev, s->ns_lo, s->ns_hi, tokens + (size_t)k * B)
                           : pkv__hash_seeded(c, hs[j - 1], tokens + (size_t)(k + j) * B);
            __builtin_prefetch(&c->buckets[hs[j] & c->bucket_mask]);
        }
        for (uint32_t j = 0; j < m; j++) {
            if (j + DIST < m) {
                uint32_t ahead = c->buckets[hs[j + DIST] & c->bucket_mask];
                if (ahead != PKV_NONE) {
                    __builtin_prefetch(&c->blk[ahead]);
                    __builtin_prefetch(c->tokens + (size_t)ahead * B);
                }
            }
            const int32_t *t = tokens + (size_t)k * B;
            uint64_t h = hs[j];
            uint32_t b = lookup(c, h, prev, s->ns_lo, s->ns_hi, t);
            if (b == PKV_NONE || (!window && pkv__is_tomb(c, b))) {
                /* why: the same namespace+prefix was indexed once (evicted: its tombstone is no
                   block), the same tokens exist under another namespace, or never seen. Best
                   effort: fingerprints. */
                uint64_t ch = pkv__content_hash(c, prev, t);
                if (b != PKV_NONE || (!c->const_hash && fp_has(c->fp_seen, c->fp_mask, h))) c->miss_evicted++;
                else if (fp_has(c->fp_content, c->fp_mask, ch)) c->miss_ns++;
                else c->miss_new++;
                miss = true;
                break;
            }
            chain[k++] = b;
            prev = b;
        }
    }
    uint32_t reused = PKV_MIN(k * B, cap), front = 0;
    if (window) {
        /* a match under a window: the media trim and the window's blocks, each of which can only
           shorten it, until both hold; then its blocks from the front on are taken */
        bool cut = false; /* by a tombstone the window sees: a miss at an evicted block */
        for (;;) {
            const uint32_t r = reused - pkv__media_trim(tokens, n, reused);
            reused = window_fit(c, chain, k, r, window);
            cut |= reused < r;
            if (reused == r && !pkv__media_trim(tokens, n, reused)) break;
        }
        if (cut && !miss) c->miss_evicted++;
        k = (reused + B - 1) / B;
        prev = k ? chain[k - 1] : PKV_NONE; /* (a block: the front never passes the last) */
        front = pkv__window_front(reused, window, B);
        for (uint32_t i = 0; i < front; i++)
            if (pkv__is_tomb(c, chain[i])) {
                c->pfx_tomb_hits++;
                break;
            }
        for (uint32_t i = front; i < k; i++) pkv__ref_block(c, chain[i]); /* parents first */
        for (uint32_t i = 0; i < front; i++) s->table[i] = -1;
        s->n_dropped = front;
    } else {
        for (uint32_t i = 0; i < k; i++) pkv__ref_block(c, chain[i]);
    }
    s->n_blocks = k;
    /* token-granular: the child of the last matched block (with none matched, the root of s's
       namespace) sharing the longest token prefix */
    const uint32_t can_take = c->pool.n_free + c->pool.n_cached; /* blocks a copy could take */
    uint32_t best = PKV_NONE, best_m = 0;
    if (reused == k * B && reused < cap && k < c->max_bps && can_take) {
        /* the copy needs a block besides its source: with one block to be had, a CACHED source
           (that block) is passed over for the best source in use (the copy then evicts it) */
        const bool cached_ok = can_take >= 2;
        uint32_t want = PKV_MIN(B, cap - reused);
        /* lists are linked newest first; a prefix shared by thousands of requests has thousands
           of children, so only the most recent PARTIAL_SCAN are compared: the token-granular
           extra is best effort, the full-block hits above are not. A root list may also hold
           the roots of other namespaces or first tokens that share its slot: skipped, counted.
           Tombstones hold no K/V to copy. */
        uint32_t scanned = 0;
        const uint32_t first = k ? c->blk[prev].child : c->roots[root_slot];
        for (uint32_t ch = first; ch != PKV_NONE && scanned++ < PARTIAL_SCAN; ch = c->blk[ch].sib_next) {
            if (!k && (c->blk[ch].ns_lo != s->ns_lo || c->blk[ch].ns_hi != s->ns_hi)) continue;
            if (c->blk[ch].state == PKV_BLK_TOMB || (!cached_ok && c->blk[ch].state == PKV_BLK_CACHED)) continue;
            uint32_t lim = PKV_MIN(want, (uint32_t)c->blk[ch].n_commit);
            uint32_t m = common_prefix(c->tokens + (size_t)ch * B, tokens + reused, lim);
            if (m > best_m) {
                best_m = m;
                best = ch;
            }
        }
    }
    /* a match does not end a few ids into a media whose next position it lacks (the ids agree
       by chance there): the trim takes them off the copy, or from the matched blocks, where the
       one the match now ends in stays attached, read to its new end (as a whole prompt's last
       block is: an append copies it first), and the refs of those past it go, deepest first, so
       that a CACHED one rejoins the LRU queue behind its children */
    const uint32_t trim = pkv__media_trim(tokens, n, reused + best_m);
    if (window && trim > best_m) { /* (cannot be: the window's match ends where no trim is due) */
        best_m = 0;
    } else if (trim > best_m) {
        reused = reused + best_m - trim;
        best_m = 0;
        const uint32_t keep = (reused + B - 1) / B;
        for (uint32_t i = k; i-- > keep;) pkv__drop_block(c, (uint32_t)s->table[i]);
        k = s->n_blocks = keep;
    } else {
        best_m -= trim;
    }
    s->idx_len = PKV_MIN(k, reused / B);
    if (best_m) {
        pkv__ref_block(c, best); /* protect the source from eviction */
        uint32_t nb = pkv__take_block(c);
        pkv_assert(nb != PKV_NONE);
        pkv__copy_block(c, nb, best, best_m);
        pkv__pool_set_fill(&c->pool, nb, best_m);
        c->blk[nb].n_commit = (uint16_t)best_m;
        pkv__drop_block(c, best);
        s->table[s->n_blocks++] = (int32_t)nb;
        reused += best_m;
    }
    s->n_tokens = s->n_committed = s->n_reused = reused;
    c->n_tokens_total += reused;
    c->pfx_hit += reused;
    *n_reused = reused;
    pkv__index_after_commit(c, s);
    if (window) { /* the copy's positions may move the front on: what the window passed goes,
                     deepest first (as pkv_seq_drop_front lets go), after the commit above (a
                     whole block copied may see the front pass every block found: it is indexed
                     under the last of them first, as past the front nothing names its parent) */
        const uint32_t to = pkv__window_front(reused, window, B);
        for (uint32_t i = to; i-- > front;) {
            pkv__drop_block(c, (uint32_t)s->table[i]);
            s->table[i] = -1;
        }
        if (to > front) s->n_dropped = to;
    }
out:
    pthread_mutex_unlock(&c->mu);
    return rc;
}

PKV_API int pkv_seq_match_prefix(pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n, uint32_t *n_reused) {
    return match(c, id, tokens, n, 0, n_reused, __func__);
}

PKV_API int pkv_seq_match_prefix_window(pkv_cache *c, pkv_seq id, const int32_t *tokens, uint32_t n, uint32_t window,
                                        uint32_t *n_reused) {
    if (c && !window) return PKV__SAY(c, PKV_EINVAL, "window is 0: pkv_seq_match_prefix needs none");
    return match(c, id, tokens, n, window, n_reused, __func__);
}

/* ---- a front the index is told of (tier.c's windowed load) ---- */
bool pkv__seq_front_ids(const pkv_cache *c, const pkv__seq *s, int32_t *toks) {
    const uint32_t nd = s->n_dropped, B = c->B;
    if (!nd) return true;
    if (nd >= s->n_blocks) return false;
    const pkv__blk *k = &c->blk[s->table[nd]];
    if (!(k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL))) return false;
    uint32_t p = k->parent;
    for (uint32_t i = nd; i-- > 0;) { /* (the checker's rules: depth i below the front) */
        if (p == PKV_NONE || !(c->blk[p].flags & PKV_BLKF_INDEXED) || c->blk[p].depth != i) return false;
        memcpy(toks + (size_t)i * B, c->tokens + (size_t)p * B, (size_t)B * sizeof(int32_t));
        p = c->blk[p].parent;
    }
    return p == PKV_NONE;
}

/* A new tombstone: the identity h of block depth of s's chain (token ids toks) under parent, no
 * block and, until the caller links one, no child; STORED said. PKV_NONE where none is free. */
static uint32_t tomb_new(pkv_cache *c, const pkv__seq *s, uint32_t parent, uint64_t h, uint32_t depth,
                         const int32_t *toks) {
    const uint32_t t = tomb_take(c);
    if (t == PKV_NONE) return PKV_NONE;
    pkv__blk *k = &c->blk[t];
    memset(k, 0, sizeof *k);
    k->state = PKV_BLK_TOMB;
    k->flags = PKV_BLKF_INDEXED;
    k->n_fill = k->n_commit = (uint16_t)c->B;
    k->qprev = k->qnext = k->hnext = k->child = PKV_NONE;
    k->hash = h;
    k->depth = depth;
    k->chash = pkv__content_hash(c, parent, toks);
    k->ns_lo = parent == PKV_NONE ? s->ns_lo : 0;
    k->ns_hi = parent == PKV_NONE ? s->ns_hi : 0;
    memcpy(c->tokens + (size_t)t * c->B, toks, (size_t)c->B * sizeof(int32_t));
    pkv__tree_link(c, parent, t);
    entry_put(c, t, parent);
    pkv__event_block(c, PKV_EVENT_STORED, t);
    return t;
}

void pkv__seq_link_front(pkv_cache *c, pkv_seq id, const int32_t *tokens) {
    pthread_mutex_lock(&c->mu);
    pkv__seq *s;
    if (pkv__get_seq(c, id, &s, __func__) || !c->cfg.enable_prefix_cache) goto out;
    const uint32_t nd = s->n_dropped, B = c->B;
    if (!nd || s->idx_len != nd || nd >= s->n_blocks || s->n_committed < (nd + 1) * B) goto out;
    const uint32_t b = (uint32_t)s->table[nd];
    if (c->blk[b].flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL)) goto out;
    /* the front's identities the index has: entries (blocks, tombstones), or a full registered
       partial, made the entry (a tombstone beside it would hide its K/V from a plain match),
       down to the first it lacks: every one below that is missing too (an entry's parent is one) */
    uint32_t parent = PKV_NONE, i = 0;
    for (; i < nd; i++) {
        const int32_t *t = tokens + (size_t)i * B;
        const uint64_t h = pkv__identity_hash(c, parent, s->ns_lo, s->ns_hi, t);
        uint32_t x = lookup(c, h, parent, s->ns_lo, s->ns_hi, t);
        if (x == PKV_NONE) {
            const bool root = parent == PKV_NONE;
            x = full_partial(c, root ? c->roots[pkv__root_slot(c, s->ns_lo, s->ns_hi, t[0])] : c->blk[parent].child,
                             root ? s->ns_lo : 0, root ? s->ns_hi : 0, t);
            if (x == PKV_NONE) break;
            index_insert(c, s, x, parent, h, i);
        }
        parent = x;
    }
    /* the rest become tombstones: all of them, or none where too few are free */
    if (c->n_tombs + (nd - i) > c->tomb_lim) goto out;
    for (; i < nd; i++) {
        const int32_t *t = tokens + (size_t)i * B;
        const uint64_t h = pkv__identity_hash(c, parent, s->ns_lo, s->ns_hi, t);
        parent = tomb_new(c, s, parent, h, i, t);
        pkv_assert(parent != PKV_NONE);
    }
    const int32_t *t = c->tokens + (size_t)b * B;
    const uint64_t h = pkv__identity_hash(c, parent, s->ns_lo, s->ns_hi, t);
    const uint32_t twin = lookup(c, h, parent, s->ns_lo, s->ns_hi, t);
    if (pkv__is_tomb(c, twin)) {
        take_place(c, twin, b);
    } else if (twin != PKV_NONE) {
        /* the same block is indexed already (a restore of what the pool still holds past the
           front): s takes it, as a match would, and lets go of its copy (freed: not indexed) */
        pkv__ref_block(c, twin);
        s->table[nd] = (int32_t)twin;
        pkv__drop_block(c, b);
    } else {
        index_insert(c, s, b, parent, h, nd);
    }
    s->idx_len = nd + 1;
    pkv__index_after_commit(c, s); /* the rest of its full committed blocks */
out:
    pthread_mutex_unlock(&c->mu);
}

/* ---- pins ----------------------------------------------------------------------------------- */
PKV_API int pkv_pin_create(pkv_cache *c, pkv_seq id, uint32_t n_pos, pkv_seq *pin) {
    if (!c) return PKV_EINVAL;
    if (!pin) return PKV__SAY(c, PKV_EINVAL, "pin is NULL");
    pthread_mutex_lock(&c->mu);
    pkv__seq *s;
    int rc = pkv__get_seq(c, id, &s, __func__);
    if (rc) goto out;
    rc = pkv__seq_whole(c, s, __func__); /* no prefix left to pin */
    if (rc) goto out;
    pkv__seq *p = pkv__seq_new(c);
    if (!p) {
        rc = PKV__SAY(c, PKV_ELIMIT, "%u sequences and pins are live, max_seqs %u", c->n_live, c->max_seqs);
        goto out;
    }
    uint32_t nb = PKV_MIN(n_pos, s->n_committed) / c->B;
    p->is_pin = 1;
    c->n_pins++;
    pkv__seq_share(c, p, s, nb);
    p->n_tokens = p->n_committed = nb * c->B;
    if (p->exact != PKV_NONE && p->exact >= p->n_tokens) p->exact = PKV_NONE; /* (its blocks before a shift's) */
    *pin = pkv__seq_id(c, p);
out:
    pthread_mutex_unlock(&c->mu);
    return rc;
}

PKV_API int pkv_pin_release(pkv_cache *c, pkv_seq pin) {
    if (!c) return PKV_EINVAL;
    pthread_mutex_lock(&c->mu);
    pkv__seq *p = pkv__seq_get(c, pin);
    int rc = !p   ? PKV__SAY(c, PKV_ENOENT, "pin %#llx is unknown: never made, released, or another cache's",
                             (unsigned long long)pin)
             : !p->is_pin ? PKV__SAY(c, PKV_EINVAL, "%#llx is a sequence, not a pin", (unsigned long long)pin)
                          : PKV_OK;
    if (!rc) {
        pkv__seq_drop_blocks(c, p, 0);
        pkv__seq_free(c, p);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}
