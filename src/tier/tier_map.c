/* tier_map.c: the key map of the host and file stores, and the store base they share
 * (tier_int.h). */
#include "tier_int.h"

#include <stdint.h>
#include <string.h>

static size_t slot_of(const uint8_t *key, size_t mask) {
    uint64_t h;
    memcpy(&h, key, sizeof h);
    return (size_t)h & mask;
}

int pkv__tmap_init(pkv__tmap *m, const pkv_allocator *alloc) {
    memset(m, 0, sizeof *m);
    if (alloc) m->alloc = *alloc;
    const size_t n = 64;
    m->buckets = pkv__calloc(&m->alloc, n * sizeof *m->buckets, 64);
    if (!m->buckets) return PKV_ENOMEM;
    m->mask = n - 1;
    return PKV_OK;
}

void pkv__tmap_fini(pkv__tmap *m) {
    if (!m->buckets) return;
    for (pkv__tent *e = m->oldest, *next; e; e = next) {
        next = e->newer;
        pkv__tmap_free(m, e);
    }
    pkv__free(&m->alloc, m->buckets, (m->mask + 1) * sizeof *m->buckets);
    memset(m, 0, sizeof *m);
}

pkv__tent *pkv__tmap_find(const pkv__tmap *m, const uint8_t *key) {
    pkv__tent *e = m->buckets[slot_of(key, m->mask)];
    while (e && memcmp(e->key, key, PKV__TIER_KEY)) e = e->hnext;
    return e;
}

pkv__tent *pkv__tmap_new(pkv__tmap *m, const uint8_t *key, uint64_t len, size_t data_bytes) {
    size_t size;
    if (!pkv__add_ok(sizeof(pkv__tent), data_bytes, &size)) return NULL;
    pkv__tent *e = pkv__alloc(&m->alloc, size, 64);
    if (!e) return NULL;
    memset(e, 0, sizeof *e);
    memcpy(e->key, key, PKV__TIER_KEY);
    e->len = len;
    e->size = size;
    return e;
}

void pkv__tmap_free(pkv__tmap *m, pkv__tent *e) { pkv__free(&m->alloc, e, e->size); }

/* doubles the table where the entries outnumber its buckets (best effort: a failed allocation
   leaves longer chains, not an error) */
static void grow(pkv__tmap *m) {
    const size_t n = (m->mask + 1) * 2;
    pkv__tent **b = pkv__calloc(&m->alloc, n * sizeof *b, 64);
    if (!b) return;
    for (pkv__tent *e = m->oldest; e; e = e->newer) {
        size_t i = slot_of(e->key, n - 1);
        e->hnext = b[i];
        b[i] = e;
    }
    pkv__free(&m->alloc, m->buckets, (m->mask + 1) * sizeof *m->buckets);
    m->buckets = b;
    m->mask = n - 1;
}

static void link_newest(pkv__tmap *m, pkv__tent *e) {
    e->newer = NULL;
    e->older = m->newest;
    if (m->newest) m->newest->newer = e;
    else m->oldest = e;
    m->newest = e;
}

static void unlink_order(pkv__tmap *m, pkv__tent *e) {
    if (e->older) e->older->newer = e->newer;
    else m->oldest = e->newer;
    if (e->newer) e->newer->older = e->older;
    else m->newest = e->older;
    e->older = e->newer = NULL;
}

void pkv__tmap_insert(pkv__tmap *m, pkv__tent *e) {
    if (m->n + 1 > m->mask + 1 && m->mask < SIZE_MAX / (4 * sizeof(void *))) grow(m);
    size_t i = slot_of(e->key, m->mask);
    e->hnext = m->buckets[i];
    m->buckets[i] = e;
    link_newest(m, e);
    m->n++;
    m->bytes += e->len;
}

void pkv__tmap_remove(pkv__tmap *m, pkv__tent *e) {
    pkv__tent **at = &m->buckets[slot_of(e->key, m->mask)];
    while (*at != e) {
        pkv_assert(*at);
        at = &(*at)->hnext;
    }
    *at = e->hnext;
    e->hnext = NULL;
    unlink_order(m, e);
    m->n--;
    m->bytes -= e->len;
}

void pkv__tmap_touch(pkv__tmap *m, pkv__tent *e) {
    if (m->newest == e) return;
    unlink_order(m, e);
    link_newest(m, e);
}

/* ---- the store base ---- */
int pkv__tstore_init(pkv__tstore *s, uint64_t capacity, const pkv_allocator *alloc) {
    int rc = pkv__tmap_init(&s->map, alloc);
    if (rc) return rc;
    pthread_mutex_init(&s->mu, NULL);
    s->capacity = capacity;
    s->evictions = 0;
    s->evicted = NULL;
    return PKV_OK;
}

void pkv__tstore_fini(pkv__tstore *s) {
    pkv__tmap_fini(&s->map);
    pthread_mutex_destroy(&s->mu);
}

void pkv__tstore_forget(pkv__tstore *s, pkv__tent *e) {
    pkv__tmap_remove(&s->map, e);
    pkv__tmap_free(&s->map, e);
}

void pkv__tstore_evict_oldest(pkv__tstore *s) {
    pkv__tent *o = s->map.oldest;
    if (s->evicted) s->evicted(s, o);
    pkv__tstore_forget(s, o);
    s->evictions++;
}

void pkv__tstore_insert(pkv__tstore *s, pkv__tent *e) {
    pkv__tent *old = pkv__tmap_find(&s->map, e->key);
    if (old) pkv__tstore_forget(s, old); /* replaced (the file store: its file by the rename) */
    while (s->map.bytes + e->len > s->capacity) pkv__tstore_evict_oldest(s);
    pkv__tmap_insert(&s->map, e);
}

void pkv__tstore_usage(void *ctx, uint64_t *entries, uint64_t *bytes, uint64_t *capacity, uint64_t *evictions) {
    pkv__tstore *s = ctx;
    pthread_mutex_lock(&s->mu);
    *entries = s->map.n;
    *bytes = s->map.bytes;
    *capacity = s->capacity;
    *evictions = s->evictions;
    pthread_mutex_unlock(&s->mu);
}
