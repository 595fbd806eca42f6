/* events.c: the prefix index's event ring (vLLM's KV events): STORED and REMOVED blocks, the
 * index CLEARED, OVERFLOW; pkv_cache_take_events and pkv_prefix_snapshot.
 *
 * The ring is allocated at create (event_capacity events and their blocks' token ids) and
 * written under c->mu by the index's own changes, so the events are in the order the index
 * changed. A full ring is not grown and does not drop its oldest (a consumer that misses one
 * event in the middle is as stale as one that misses many): it collapses into one OVERFLOW
 * event, and the consumer rebuilds from a snapshot. */
#include "cache_int.h"

#include <string.h>

#define LOCK(c) pthread_mutex_lock(&(c)->mu)
#define UNLOCK(c) pthread_mutex_unlock(&(c)->mu)

/* The slot for a new event, its seqno set; NULL when the event is lost to a full ring (then the
 * ring holds one OVERFLOW event counting it). */
static pkv_event *ev_push(pkv_cache *c) {
    c->ev_seqno++;
    if (c->ev_n == c->ev_cap) {
        pkv_event *first = &c->ev[c->ev_head];
        uint64_t lost = c->ev_n + 1; /* the held events and this one */
        if (first->kind == PKV_EVENT_OVERFLOW) lost += first->lost - 1;
        c->ev_head = 0;
        c->ev_n = 1;
        c->ev[0] = (pkv_event){.seqno = c->ev_seqno, .lost = lost, .kind = PKV_EVENT_OVERFLOW};
        return NULL;
    }
    uint32_t at = c->ev_head + c->ev_n; /* both under ev_cap <= 2^24: no overflow, no division */
    if (at >= c->ev_cap) at -= c->ev_cap;
    c->ev_n++;
    pkv_event *e = &c->ev[at];
    *e = (pkv_event){.seqno = c->ev_seqno};
    return e;
}

static int32_t *ev_tokens(const pkv_cache *c, const pkv_event *e) {
    return c->ev_tok + (size_t)(e - c->ev) * c->B;
}

/* e describes indexed block b: kind, hash, parent's hash, depth, block. */
static void describe(const pkv_cache *c, pkv_event *e, pkv_event_kind kind, uint32_t b) {
    const pkv__blk *k = &c->blk[b];
    e->kind = kind;
    e->hash = k->hash;
    e->parent_hash = k->parent == PKV_NONE ? 0 : c->blk[k->parent].hash;
    e->depth = k->depth;
    e->block = b;
}

void pkv__event_block(pkv_cache *c, pkv_event_kind kind, uint32_t b) {
    if (!c->ev_cap) return;
    pkv_event *e = ev_push(c);
    if (!e) return;
    describe(c, e, kind, b);
    memcpy(ev_tokens(c, e), c->tokens + (size_t)b * c->B, (size_t)c->B * sizeof(int32_t));
}

void pkv__event_cleared(pkv_cache *c) {
    if (!c->ev_cap) return;
    pkv_event *e = ev_push(c);
    if (e) e->kind = PKV_EVENT_CLEARED;
}

PKV_API int pkv_cache_take_events(pkv_cache *c, pkv_event *out, size_t cap, int32_t *tokens, size_t *n_out) {
    if (!c) return PKV_EINVAL;
    if (!n_out) return PKV__SAY(c, PKV_EINVAL, "n_out is NULL");
    if (!out && cap) return PKV__SAY(c, PKV_EINVAL, "out is NULL with cap %zu", cap);
    if (!c->ev_cap) return PKV__SAY(c, PKV_EINVAL, "the cache records no events (config event_capacity 0)");
    LOCK(c);
    const size_t n = PKV_MIN(cap, (size_t)c->ev_n);
    for (size_t i = 0; i < n; i++) {
        const pkv_event *e = &c->ev[(c->ev_head + i) % c->ev_cap];
        out[i] = *e;
        if (!tokens) continue;
        int32_t *t = tokens + i * c->B;
        if (e->kind == PKV_EVENT_STORED || e->kind == PKV_EVENT_REMOVED)
            memcpy(t, ev_tokens(c, e), (size_t)c->B * sizeof(int32_t));
        else
            memset(t, 0, (size_t)c->B * sizeof(int32_t));
    }
    c->ev_head = (uint32_t)((c->ev_head + n) % c->ev_cap);
    c->ev_n -= (uint32_t)n;
    if (c->ev_n == 0) c->ev_head = 0;
    UNLOCK(c);
    *n_out = n;
    return PKV_OK;
}

/* Appends the indexed blocks of the list from b to out[n ..), never past need; the new n. */
static size_t snap_list(const pkv_cache *c, uint32_t b, pkv_event *out, size_t n, size_t need) {
    for (; b != PKV_NONE && n < need; b = c->blk[b].sib_next) {
        if (!(c->blk[b].flags & PKV_BLKF_INDEXED)) continue;
        out[n] = (pkv_event){0};
        describe(c, &out[n++], PKV_EVENT_STORED, b);
    }
    return n;
}

PKV_API int pkv_prefix_snapshot(pkv_cache *c, pkv_event *out, size_t cap, int32_t *tokens, size_t *n_out) {
    if (!c) return PKV_EINVAL;
    if (!n_out) return PKV__SAY(c, PKV_EINVAL, "n_out is NULL");
    if (!out && cap) return PKV__SAY(c, PKV_EINVAL, "out is NULL with cap %zu", cap);
    LOCK(c);
    const uint64_t need = c->n_indexed + c->n_tombs; /* the index's entries */
    if (need > cap) {
        UNLOCK(c);
        *n_out = (size_t)need;
        return PKV__SAY(c, PKV_ELIMIT, "%llu index entries, room for %zu", (unsigned long long)need, cap);
    }
    /* breadth first, out[] its own queue: the roots (every root list), then each entry's
       children; partial blocks are not index entries */
    size_t n = 0;
    for (uint32_t slot = 0; slot <= c->bucket_mask; slot++) n = snap_list(c, c->roots[slot], out, n, need);
    for (size_t i = 0; i < n; i++) n = snap_list(c, c->blk[out[i].block].child, out, n, need);
    pkv_assert(n == need);
    if (tokens)
        for (size_t i = 0; i < n; i++)
            memcpy(tokens + i * c->B, c->tokens + (size_t)out[i].block * c->B, (size_t)c->B * sizeof(int32_t));
    c->ev_head = c->ev_n = 0; /* what they said is in the snapshot */
    UNLOCK(c);
    *n_out = n;
    return PKV_OK;
}
