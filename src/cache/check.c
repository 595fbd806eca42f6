/* check.c: statistics and the invariant checker (mimalloc-style validator): every rule of
 * ARCHITECTURE section 4 verified in O(n_blocks + table entries), naming the first one broken. */
#include "cache_int.h"

#include <stdarg.h>
#include <stdio.h>

PKV_API int pkv_cache_get_stats(pkv_cache *c, pkv_stats *out) {
    if (!c) return PKV_EINVAL;
    if (!out) return PKV__SAY(c, PKV_EINVAL, "out is NULL");
    pthread_mutex_lock(&c->mu);
    memset(out, 0, sizeof *out);
    out->n_blocks = c->n_blocks;
    out->n_free = c->pool.n_free;
    out->n_cached = c->pool.n_cached;
    out->n_active = c->pool.n_active;
    out->n_seqs = c->n_live - c->n_pins;
    out->n_pins = c->n_pins;
    out->n_tokens = c->n_tokens_total;
    out->n_slots_used = c->pool.slots_used;
    out->kv_bytes = c->kv_bytes;
    out->kv_bytes_per_block = (uint64_t)(c->k_blk + c->v_blk) * c->n_layers;
    out->meta_bytes = c->meta_bytes;
    out->frag_slots = (uint64_t)c->pool.n_active * c->B - c->pool.slots_used;
    out->cow_copies = c->cow_copies;
    out->peak_active = c->pool.peak_active;
    out->n_tombstones = c->n_tombs;
    out->prefix_tomb_hits = c->pfx_tomb_hits;
    out->prefix_lookups = c->pfx_lookups;
    out->prefix_tokens_queried = c->pfx_queried;
    out->prefix_tokens_hit = c->pfx_hit;
    out->prefix_miss_new = c->miss_new;
    out->prefix_miss_evicted = c->miss_evicted;
    out->prefix_miss_namespace = c->miss_ns;
    out->n_indexed = c->n_indexed;
    out->evictions = c->evictions;
    if (c->attn) pkv__attn_item_counts(c->attn, &out->attn_reqs_pool, &out->attn_reqs_table);
    out->attn_shared_keys = atomic_load_explicit(&c->share.keys, memory_order_relaxed);
    pthread_mutex_unlock(&c->mu);
    return PKV_OK;
}

typedef struct {
    char *msg;
    size_t cap;
} report;

static int fail(report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(report *r, const char *fmt, ...) {
    if (r->msg && r->cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->msg, r->cap, fmt, ap);
        va_end(ap);
    }
    return PKV_ECORRUPT;
}

#define REQUIRE(cond, ...)                    \
    do {                                      \
        if (!(cond)) return fail(r, __VA_ARGS__); \
    } while (0)

static int check_queues(pkv_cache *c, report *r) {
    const pkv__pool *p = &c->pool;
    uint32_t *pos = c->chk_pos;
    uint32_t n = 0, prev = PKV_NONE;
    for (uint32_t b = p->free_head; b != PKV_NONE; prev = b, b = c->blk[b].qnext) {
        REQUIRE(b < c->n_blocks, "free queue: block id %u out of range", b);
        REQUIRE(++n <= p->n_free, "free queue: longer than n_free=%u (cycle?)", p->n_free);
        REQUIRE(c->blk[b].state == PKV_BLK_FREE, "free queue: block %u is not FREE", b);
        REQUIRE(c->blk[b].qprev == prev, "free queue: block %u has a wrong back link", b);
    }
    REQUIRE(n == p->n_free && prev == p->free_tail, "free queue: %u blocks linked, n_free=%u", n, p->n_free);
    /* the cached blocks: those without a child in use in the LRU queue (positions kept for the
       order check), the others in the inner queue (pool.h); both counted in n_cached */
    uint32_t n_cached = 0;
    for (int q = 0; q < 2; q++) {
        const uint32_t head = q ? p->inner_head : p->lru_head, tail = q ? p->inner_tail : p->lru_tail;
        const char *name = q ? "inner queue" : "LRU queue";
        n = 0;
        prev = PKV_NONE;
        for (uint32_t b = head; b != PKV_NONE; prev = b, b = c->blk[b].qnext) {
            REQUIRE(b < c->n_blocks, "%s: block id %u out of range", name, b);
            REQUIRE(++n_cached <= p->n_cached, "%s: longer than n_cached=%u (cycle?)", name, p->n_cached);
            const pkv__blk *k = &c->blk[b];
            REQUIRE(k->state == PKV_BLK_CACHED, "%s: block %u is not CACHED", name, b);
            REQUIRE(k->qprev == prev, "%s: block %u has a wrong back link", name, b);
            REQUIRE(k->inner == q && (k->n_hot > 0) == q, "%s: block %u is marked %s with %u children in use", name,
                    b, k->inner ? "inner" : "for the LRU", k->n_hot);
            pos[b] = ++n;
        }
        REQUIRE(prev == tail, "%s: %u blocks linked ending at %u, its tail says %u", name, n, prev, tail);
    }
    REQUIRE(n_cached == p->n_cached, "cached queues: %u blocks linked, n_cached=%u", n_cached, p->n_cached);
    return PKV_OK;
}

static int check_sequences(pkv_cache *c, report *r, uint64_t *n_tokens) {
    uint32_t *ref = c->chk_ref;
    memset(ref, 0, sizeof(uint32_t) * c->n_blocks);
    uint32_t live = 0, pins = 0;
    *n_tokens = 0;
    for (uint32_t i = 0; i < c->max_seqs; i++) {
        const pkv__seq *s = &c->seqs[i];
        if (!s->live) continue;
        live++;
        pins += s->is_pin;
        if (!s->is_pin) *n_tokens += s->n_tokens;
        if (s->shifting) { /* midway through pkv_seq_shift (cache.c): only its blocks' references */
            for (uint32_t j = s->n_dropped; j < s->n_blocks; j++) {
                const int32_t b = s->table[j];
                REQUIRE(b >= 0 && (uint32_t)b < c->n_blocks, "sequence %u: table[%u]=%d out of range", i, j, b);
                REQUIRE(c->blk[b].state == PKV_BLK_ACTIVE, "sequence %u: table[%u]=block %d is not ACTIVE", i, j, b);
                ref[b]++;
            }
            continue;
        }
        REQUIRE(s->gen != 0, "sequence %u: generation 0", i);
        REQUIRE(s->n_blocks == (s->n_tokens + c->B - 1) / c->B,
                "sequence %u: %u blocks for %u tokens (B=%u)", i, s->n_blocks, s->n_tokens, c->B);
        REQUIRE(s->n_blocks <= c->max_bps, "sequence %u: %u blocks > max_blocks_per_seq", i, s->n_blocks);
        REQUIRE(s->n_committed <= s->n_tokens, "sequence %u: committed %u > length %u", i, s->n_committed, s->n_tokens);
        REQUIRE((uint64_t)s->idx_len * c->B <= s->n_committed, "sequence %u: indexed chain of %u blocks past committed %u",
                i, s->idx_len, s->n_committed);
        /* after a shift (pkv_seq_shift), positions past exact are moved ones: none of them indexed */
        REQUIRE(s->exact == PKV_NONE || s->exact < s->n_tokens, "sequence %u: exact to %u of %u positions", i, s->exact,
                s->n_tokens);
        REQUIRE(s->exact == PKV_NONE || s->idx_len <= s->exact / c->B,
                "sequence %u: indexed chain of %u blocks past its exact positions (%u)", i, s->idx_len, s->exact);
        for (uint32_t j = PKV_MAX(s->n_dropped, s->exact == PKV_NONE ? s->n_blocks : s->exact / c->B); j < s->n_blocks; j++)
            REQUIRE(c->blk[s->table[j]].moved, "sequence %u: table[%u] (block %d), past its exact positions (%u), not marked moved",
                    i, j, s->table[j], s->exact);
        /* a dropped front (pkv_seq_drop_front): -1 entries, whole blocks within the length */
        REQUIRE(s->n_dropped <= s->n_blocks && (uint64_t)s->n_dropped * c->B <= s->n_tokens,
                "sequence %u: %u blocks dropped of %u (%u tokens)", i, s->n_dropped, s->n_blocks, s->n_tokens);
        for (uint32_t j = 0; j < s->n_dropped; j++)
            REQUIRE(s->table[j] == -1, "sequence %u: table[%u]=%d in its dropped front", i, j, s->table[j]);
        for (uint32_t j = s->n_dropped; j < s->n_blocks; j++) {
            int32_t b = s->table[j];
            REQUIRE(b >= 0 && (uint32_t)b < c->n_blocks, "sequence %u: table[%u]=%d out of range", i, j, b);
            ref[b]++;
            const pkv__blk *k = &c->blk[b];
            REQUIRE(k->state == PKV_BLK_ACTIVE, "sequence %u: table[%u]=block %d is not ACTIVE", i, j, b);
            uint32_t need = (uint32_t)PKV_MIN((uint64_t)c->B, s->n_tokens - (uint64_t)j * c->B);
            REQUIRE(k->n_fill >= need, "sequence %u: block %d holds %u tokens, sequence uses %u", i, b, k->n_fill, need);
            if (j < s->idx_len)
                REQUIRE(k->flags & PKV_BLKF_INDEXED, "sequence %u: chain block %u (block %d) not indexed", i, j, b);
            if (k->flags & PKV_BLKF_INDEXED)
                REQUIRE(k->depth == j, "sequence %u: table[%u] (block %d) is an index entry of depth %u", i, j, b,
                        k->depth);
            if ((k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL)) && (!j || j > s->n_dropped)) {
                /* an index entry (on the chain or a registered partial) sits where its holders'
                   tables say: a root at table[0] under the holder's namespace, any other below
                   table[j - 1] */
                REQUIRE(k->parent == (j ? (uint32_t)s->table[j - 1] : PKV_NONE),
                        "sequence %u: table[%u] (block %d) has parent %u, table says %d", i, j, b, k->parent,
                        j ? s->table[j - 1] : -1);
                if (!j)
                    REQUIRE(k->ns_lo == s->ns_lo && k->ns_hi == s->ns_hi,
                            "sequence %u: its root (block %d) is in another namespace", i, b);
            } else if (k->flags & PKV_BLKF_PARTIAL) {
                /* a partial right past the front: below an index entry of the depth before it */
                REQUIRE(k->parent < c->n_blocks + c->tomb_cap && (c->blk[k->parent].flags & PKV_BLKF_INDEXED) &&
                            c->blk[k->parent].depth + 1 == j,
                        "sequence %u: table[%u] (block %d), a partial past its dropped front, has parent %u", i, j,
                        b, k->parent);
            }
            uint64_t committed = s->n_committed > (uint64_t)j * c->B ? s->n_committed - (uint64_t)j * c->B : 0;
            REQUIRE(k->n_commit >= PKV_MIN(committed, (uint64_t)c->B),
                    "sequence %u: block %d commit count %u below the sequence's %llu", i, b, k->n_commit,
                    (unsigned long long)PKV_MIN(committed, (uint64_t)c->B));
        }
    }
    REQUIRE(live == c->n_live && pins == c->n_pins, "sequence count: %u live (%u pins) vs counters %u (%u)", live,
            pins, c->n_live, c->n_pins);
    uint32_t n_free_slots = 0;
    for (uint32_t i = c->seq_free; i != PKV_NONE; i = c->seqs[i].next_free) {
        REQUIRE(i < c->max_seqs && !c->seqs[i].live, "sequence free list: slot %u is live or out of range", i);
        REQUIRE(c->seqs[i].gen != 0, "sequence free list: slot %u is retired", i);
        REQUIRE(++n_free_slots <= c->max_seqs - live, "sequence free list: too long (cycle?)");
    }
    uint32_t retired = 0; /* slots whose generations are used up (pkv__seq_free) */
    for (uint32_t i = 0; i < c->max_seqs; i++) retired += !c->seqs[i].live && c->seqs[i].gen == 0;
    REQUIRE(n_free_slots == c->max_seqs - live - retired, "sequence free list: %u slots, expected %u", n_free_slots,
            c->max_seqs - live - retired);
    return PKV_OK;
}

/* The prefix index's hash chains: every entry a block or tombstone in range, INDEXED, in the
 * bucket its hash names, and no chain cycling (so the walks of check_blocks and of lookup stay in
 * bounds and only ever meet index entries). O(buckets + n_blocks + tomb_cap): buckets <= 4
 * n_blocks, or 16. */
static int check_index_chains(pkv_cache *c, report *r, uint64_t *n_root_entries) {
    uint64_t n = 0;
    const uint64_t n_ids = (uint64_t)c->n_blocks + c->tomb_cap;
    for (uint32_t i = 0; i <= c->bucket_mask; i++)
        for (uint32_t b = c->buckets[i]; b != PKV_NONE; b = c->blk[b].hnext) {
            REQUIRE(b < n_ids, "index bucket %u: block id %u out of range", i, b);
            REQUIRE(c->blk[b].flags & PKV_BLKF_INDEXED, "index bucket %u: block %u is not indexed", i, b);
            REQUIRE(b < c->n_blocks || c->blk[b].state == PKV_BLK_TOMB, "index bucket %u: tombstone slot %u is free",
                    i, b);
            REQUIRE((c->blk[b].hash & c->bucket_mask) == i, "index bucket %u: block %u belongs in bucket %llu", i, b,
                    (unsigned long long)(c->blk[b].hash & c->bucket_mask));
            REQUIRE(++n <= n_ids, "index buckets: more entries than blocks and tombstones (cycle?)");
        }
    /* the root lists: every entry an INDEXED or PARTIAL block without a parent, on the list its
       namespace and first token name, its back link the entry before it; and as many entries as
       such blocks (check_blocks counts them), so each is on its list exactly once */
    n = 0;
    for (uint32_t i = 0; i <= c->bucket_mask; i++)
        for (uint32_t b = c->roots[i], before = PKV_NONE; b != PKV_NONE; before = b, b = c->blk[b].sib_next) {
            REQUIRE(b < n_ids, "root list %u: block id %u out of range", i, b);
            const pkv__blk *k = &c->blk[b];
            REQUIRE((k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL)) && k->parent == PKV_NONE,
                    "root list %u: block %u is not a root of the index", i, b);
            REQUIRE(pkv__root_slot(c, k->ns_lo, k->ns_hi, c->tokens[(size_t)b * c->B]) == i,
                    "root list %u: block %u belongs on another list", i, b);
            REQUIRE(k->sib_prev == before, "root list %u: block %u links back to %u, not %u", i, b, k->sib_prev, before);
            REQUIRE(++n <= n_ids, "root lists: more entries than blocks and tombstones (cycle?)");
        }
    *n_root_entries = n;
    return PKV_OK;
}

static int check_blocks(pkv_cache *c, report *r, uint64_t n_root_entries) {
    uint32_t n_free = 0, n_cached = 0, n_active = 0, n_tombs = 0, n_tomb_free = 0;
    uint64_t slots = 0, n_indexed = 0, n_roots = 0, n_children = 0, n_listed = 0;
    const uint32_t n_ids = c->n_blocks + c->tomb_cap;
    for (uint32_t b = 0; b < n_ids; b++) {
        const pkv__blk *k = &c->blk[b];
        if (b >= c->n_blocks) { /* a tombstone slot: free, or an index entry with one below it at least */
            if (k->state == PKV_BLK_FREE) {
                n_tomb_free++;
                REQUIRE(k->flags == 0 && k->child == PKV_NONE && k->n_hot == 0,
                        "tombstone slot %u: free but flags %u / a child / %u in use counted", b, k->flags, k->n_hot);
                continue;
            }
            REQUIRE(k->state == PKV_BLK_TOMB, "tombstone slot %u: state %u", b, k->state);
            REQUIRE(k->ref == 0 && !k->inner && k->flags == PKV_BLKF_INDEXED && k->child != PKV_NONE,
                    "tombstone %u: ref %u, inner %u, flags %u, %s", b, k->ref, k->inner, k->flags,
                    k->child == PKV_NONE ? "nothing below it" : "a child");
            n_tombs++;
        } else {
            REQUIRE(k->ref == c->chk_ref[b], "block %u: refcount %u but %u table entries and pins name it", b, k->ref,
                    c->chk_ref[b]);
        }
        REQUIRE(!((k->flags & PKV_BLKF_INDEXED) && (k->flags & PKV_BLKF_PARTIAL)), "block %u: both indexed and partial", b);
        REQUIRE(k->n_commit <= k->n_fill && k->n_fill <= c->B, "block %u: commit %u / fill %u / B %u inconsistent", b,
                k->n_commit, k->n_fill, c->B);
        REQUIRE(!k->inner || k->state == PKV_BLK_CACHED, "block %u: marked for the inner queue but not CACHED", b);
        switch (b >= c->n_blocks ? PKV_BLK_TOMB : k->state) {
        case PKV_BLK_TOMB: break; /* (a block's state is never TOMB: the default below) */
        case PKV_BLK_FREE:
            n_free++;
            REQUIRE(k->ref == 0 && k->flags == 0, "block %u: FREE but ref %u flags %u", b, k->ref, k->flags);
            break;
        case PKV_BLK_CACHED:
            n_cached++;
            REQUIRE(k->ref == 0 && (k->flags & PKV_BLKF_INDEXED), "block %u: CACHED but ref %u / not indexed", b, k->ref);
            break;
        case PKV_BLK_ACTIVE:
            n_active++;
            slots += k->n_fill;
            REQUIRE(k->ref > 0, "block %u: ACTIVE with refcount 0", b);
            break;
        default: return fail(r, "block %u: unknown state %u", b, k->state);
        }
        REQUIRE(!k->moved || (k->state == PKV_BLK_ACTIVE && !(k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL))),
                "block %u: holds rows a shift moved, yet is %s", b, k->state != PKV_BLK_ACTIVE ? "not in use" : "in the index");
        if (k->flags & (PKV_BLKF_INDEXED | PKV_BLKF_PARTIAL)) {
            n_roots += k->parent == PKV_NONE;
            n_children += k->parent != PKV_NONE;
        }
        if (k->flags & PKV_BLKF_INDEXED) {
            n_indexed += b < c->n_blocks;
            REQUIRE(k->n_commit == c->B && k->n_fill == c->B, "block %u: indexed but not full and committed", b);
            const int32_t *toks = c->tokens + (size_t)b * c->B;
            uint64_t h = pkv__identity_hash(c, k->parent, k->ns_lo, k->ns_hi, toks);
            REQUIRE(h == k->hash, "block %u: indexed identity changed (hash %016llx, recomputed %016llx)", b,
                    (unsigned long long)k->hash, (unsigned long long)h);
            uint32_t x = c->buckets[h & c->bucket_mask], steps = 0;
            while (x != PKV_NONE && x != b && steps++ <= n_ids) x = c->blk[x].hnext;
            REQUIRE(x == b, "block %u: indexed but not in its hash bucket", b);
            REQUIRE(k->depth == (k->parent == PKV_NONE ? 0 : c->blk[k->parent].depth + 1),
                    "block %u: depth %u under a parent of depth %u", b, k->depth,
                    k->parent == PKV_NONE ? 0 : c->blk[k->parent].depth);
            if (k->parent != PKV_NONE) {
                const pkv__blk *p = &c->blk[k->parent];
                REQUIRE(p->flags & PKV_BLKF_INDEXED, "block %u: indexed under parent %u which is not indexed", b, k->parent);
                /* (a block in use below a CACHED one: a dropped front's; the parent counts it in
                   n_hot and waits in the inner queue, checked below and in check_queues) */
                if (k->state == PKV_BLK_CACHED && !k->inner && p->state == PKV_BLK_CACHED && !p->inner &&
                    k->parent < c->n_blocks)
                    REQUIRE(c->chk_pos[b] < c->chk_pos[k->parent],
                            "LRU: cached block %u is behind its cached parent %u (leaves must go first)", b, k->parent);
            }
            uint32_t n_ch = 0;
            for (uint32_t ch = k->child, before = PKV_NONE; ch != PKV_NONE; before = ch, ch = c->blk[ch].sib_next) {
                REQUIRE(ch < n_ids && c->blk[ch].parent == b, "block %u: child %u does not name it as parent", b, ch);
                REQUIRE(c->blk[ch].sib_prev == before, "block %u: child %u links back to %u, not %u", b, ch,
                        c->blk[ch].sib_prev, before);
                REQUIRE(++n_ch <= n_ids, "block %u: child list cycles", b);
            }
            n_listed += n_ch;
        } else if (k->flags & PKV_BLKF_PARTIAL) {
            REQUIRE(k->state == PKV_BLK_ACTIVE && k->n_commit > 0, "block %u: partial but not ACTIVE with commits", b);
            REQUIRE(k->parent == PKV_NONE || (c->blk[k->parent].flags & PKV_BLKF_INDEXED),
                    "block %u: partial under a parent that is not indexed", b);
            if (k->parent != PKV_NONE)
                REQUIRE(k->ns_lo == 0 && k->ns_hi == 0, "block %u: partial under a parent but with a namespace", b);
        } else {
            REQUIRE(k->child == PKV_NONE, "block %u: not indexed but has children", b);
        }
    }
    REQUIRE(n_free == c->pool.n_free && n_cached == c->pool.n_cached && n_active == c->pool.n_active,
            "block states: %u free / %u cached / %u active, counters %u / %u / %u", n_free, n_cached, n_active,
            c->pool.n_free, c->pool.n_cached, c->pool.n_active);
    REQUIRE(n_free + n_cached + n_active == c->n_blocks, "block states do not add up to n_blocks");
    REQUIRE(slots == c->pool.slots_used, "slots used: %llu counted, counter %llu", (unsigned long long)slots,
            (unsigned long long)c->pool.slots_used);
    REQUIRE(n_indexed == c->n_indexed, "index: %llu indexed blocks, counter %llu", (unsigned long long)n_indexed,
            (unsigned long long)c->n_indexed);
    REQUIRE(n_tombs == c->n_tombs && n_tombs + n_tomb_free == c->tomb_cap,
            "tombstones: %u in use, %u free, counters %u of %u", n_tombs, n_tomb_free, c->n_tombs, c->tomb_cap);
    uint32_t n_listed_free = 0;
    for (uint32_t t = c->tomb_free; t != PKV_NONE; t = c->blk[t].qnext) {
        REQUIRE(t >= c->n_blocks && t < n_ids && c->blk[t].state == PKV_BLK_FREE,
                "tombstones' free list: %u is not a free tombstone slot", t);
        REQUIRE(++n_listed_free <= n_tomb_free, "tombstones' free list: longer than the free slots (cycle?)");
    }
    REQUIRE(n_listed_free == n_tomb_free, "tombstones' free list: %u of %u free slots", n_listed_free, n_tomb_free);
    REQUIRE(n_listed == n_children, "child lists: %llu entries, %llu index entries with a parent",
            (unsigned long long)n_listed, (unsigned long long)n_children);
    REQUIRE(n_roots == n_root_entries, "root lists: %llu entries, %llu roots of the index", (unsigned long long)n_root_entries,
            (unsigned long long)n_roots);
    REQUIRE(c->pool.peak_active >= n_active, "peak_active %u below n_active %u", c->pool.peak_active, n_active);
    REQUIRE(c->ev_n <= c->ev_cap && (c->ev_cap ? c->ev_head < c->ev_cap : c->ev_head == 0),
            "event ring: %u held from %u, capacity %u", c->ev_n, c->ev_head, c->ev_cap);
    /* children counts: every INDEXED block's n_children equals its indexed children, its n_hot
       its children in use (ACTIVE, or CACHED in the inner queue); other blocks have none */
    for (uint32_t b = 0; b < n_ids; b++) {
        const pkv__blk *k = &c->blk[b];
        if (!(k->flags & PKV_BLKF_INDEXED)) {
            REQUIRE(k->n_hot == 0, "block %u: not indexed but %u children in use counted", b, k->n_hot);
            continue;
        }
        uint32_t n_idx = 0, n_hot = 0;
        for (uint32_t ch = k->child; ch != PKV_NONE; ch = c->blk[ch].sib_next) {
            const pkv__blk *x = &c->blk[ch];
            n_idx += (x->flags & PKV_BLKF_INDEXED) != 0;
            n_hot += pkv__blk_hot(x);
        }
        REQUIRE(n_idx == k->n_children, "block %u: %u indexed children, counter %u", b, n_idx, k->n_children);
        REQUIRE(n_hot == k->n_hot, "block %u: %u children in use, counter %u", b, n_hot, k->n_hot);
    }
    return PKV_OK;
}

PKV_API int pkv_cache_check(pkv_cache *c, char *msg, size_t msg_cap) {
    if (!c) return PKV_EINVAL;
    if (msg_cap && !msg) return PKV__SAY(c, PKV_EINVAL, "msg is NULL, msg_cap %zu", msg_cap);
    char why[400] = "";
    report rep = {why, sizeof why}, *r = &rep;
    pthread_mutex_lock(&c->mu);
    uint64_t n_tokens = 0, n_root_entries = 0;
    int rc = check_queues(c, r);
    if (!rc) rc = check_sequences(c, r, &n_tokens);
    if (!rc) rc = check_index_chains(c, r, &n_root_entries);
    if (!rc) rc = check_blocks(c, r, n_root_entries);
    if (!rc && n_tokens != c->n_tokens_total)
        rc = fail(r, "token count: %llu over sequences, counter %llu", (unsigned long long)n_tokens,
                  (unsigned long long)c->n_tokens_total);
    if (rc) PKV__SAY(c, rc, "%s", why);
    pthread_mutex_unlock(&c->mu);
    if (msg_cap) snprintf(msg, msg_cap, "%s", why);
    return rc;
}
