/* tier_host.c: the host-memory store (pkv_tier_host_create): entries in the map, bytes inline,
 * at most `capacity` bytes of entries, the least recently used dropped first. */
#include "tier_int.h"

#include <string.h>

typedef struct host_store {
    pkv__tstore s; /* first: the ops' ctx is also the base */
} host_store;

static int host_put(void *ctx, const uint8_t key[16], const void *data, size_t len) {
    host_store *h = ctx;
    if (len > h->s.capacity) return PKV_ENOSPC;
    /* the copy is made before the lock: a put of megabytes holds up no other thread's get */
    pkv__tent *e = pkv__tmap_new(&h->s.map, key, len, len);
    if (!e) return PKV_ENOMEM;
    memcpy(e->data, data, len);
    pthread_mutex_lock(&h->s.mu);
    pkv__tstore_insert(&h->s, e);
    pthread_mutex_unlock(&h->s.mu);
    return PKV_OK;
}

static int host_get(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len) {
    host_store *h = ctx;
    pthread_mutex_lock(&h->s.mu);
    pkv__tent *e = pkv__tmap_find(&h->s.map, key);
    int rc = PKV_ENOENT;
    if (e) {
        *len = (size_t)e->len;
        rc = data && e->len > cap ? PKV_ENOSPC : PKV_OK;
        if (data && !rc) memcpy(data, e->data, (size_t)e->len); /* under the lock: no put frees it meanwhile */
        pkv__tmap_touch(&h->s.map, e);
    }
    pthread_mutex_unlock(&h->s.mu);
    return rc;
}

static int host_del(void *ctx, const uint8_t key[16]) {
    host_store *h = ctx;
    pthread_mutex_lock(&h->s.mu);
    pkv__tent *e = pkv__tmap_find(&h->s.map, key);
    if (e) pkv__tmap_remove(&h->s.map, e);
    pthread_mutex_unlock(&h->s.mu);
    if (e) pkv__tmap_free(&h->s.map, e);
    return PKV_OK;
}

static void host_destroy(void *ctx) {
    host_store *h = ctx;
    pkv_allocator a = h->s.map.alloc;
    pkv__tstore_fini(&h->s);
    pkv__free(&a, h, sizeof *h);
}

int pkv__tier_host_open(uint64_t capacity, const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx) {
    host_store *h = pkv__alloc(alloc, sizeof *h, 64);
    if (!h) return PKV_ENOMEM;
    memset(h, 0, sizeof *h);
    int rc = pkv__tstore_init(&h->s, capacity, alloc);
    if (rc) {
        pkv__free(alloc, h, sizeof *h);
        return rc;
    }
    *ops = (pkv_tier_ops){host_put, host_get, host_del, pkv__tstore_usage, host_destroy};
    *ctx = h;
    return PKV_OK;
}
