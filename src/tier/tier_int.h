/* tier_int.h: storage tiers (pkv.h, "storage tiers"): the key map with its least-recently-used
 * list and the store base that the host and file stores share, and the built-in stores'
 * constructors. Depends on
 * core only; tier.c also reads the cache (save and load). */
#ifndef PKV_TIER_INT_H
#define PKV_TIER_INT_H

#include "../core/core.h"

#include <pthread.h>

#define PKV__TIER_KEY 16
#define PKV__TIER_DIR_MAX 4000 /* bytes of a file tier's directory name (pkv_tier_file_create) */

/* One entry of a store: its key, its size, its bytes (host: inline after the struct; file:
 * none, they are in the file), its hash chain and its place in the use order. */
typedef struct pkv__tent {
    struct pkv__tent *hnext, *older, *newer;
    uint64_t len;
    size_t size; /* bytes allocated for the entry, itself included */
    uint8_t key[PKV__TIER_KEY];
    _Alignas(16) unsigned char data[];
} pkv__tent;

/* Entries by key (a chained hash table on the key's first 8 bytes, already uniform: a key is a
 * hash) and in use order (oldest first). Not locked: the store's lock guards it. */
typedef struct pkv__tmap {
    pkv_allocator alloc;
    pkv__tent **buckets;
    size_t mask; /* buckets - 1 (a power of two) */
    pkv__tent *oldest, *newest;
    uint64_t n, bytes;
} pkv__tmap;

int pkv__tmap_init(pkv__tmap *m, const pkv_allocator *alloc); /* PKV_ENOMEM */
void pkv__tmap_fini(pkv__tmap *m);                            /* frees every entry */
pkv__tent *pkv__tmap_find(const pkv__tmap *m, const uint8_t *key);
/* An entry of data_bytes inline bytes (0 for the file store), key and len set, not in the map. */
pkv__tent *pkv__tmap_new(pkv__tmap *m, const uint8_t *key, uint64_t len, size_t data_bytes);
void pkv__tmap_free(pkv__tmap *m, pkv__tent *e); /* an entry not in the map */
void pkv__tmap_insert(pkv__tmap *m, pkv__tent *e); /* as the newest; grows the table if it can */
void pkv__tmap_remove(pkv__tmap *m, pkv__tent *e);
void pkv__tmap_touch(pkv__tmap *m, pkv__tent *e); /* now the newest */

/* What the host and file stores share: their lock, their map, their capacity and the count of
 * entries dropped for room. Each store's struct begins with one, so the ops' ctx is also a
 * pkv__tstore (pkv__tstore_usage is both stores' usage op). */
typedef struct pkv__tstore {
    pthread_mutex_t mu;
    pkv__tmap map;
    uint64_t capacity, evictions;
    /* NULL, or called under the lock on an entry dropped for room, before it is freed (the file
       store unlinks its file) */
    void (*evicted)(struct pkv__tstore *s, const pkv__tent *e);
} pkv__tstore;

int pkv__tstore_init(pkv__tstore *s, uint64_t capacity, const pkv_allocator *alloc); /* PKV_ENOMEM */
void pkv__tstore_fini(pkv__tstore *s);
/* Under the lock: e (len <= capacity) in place of the entry of its key, the oldest entries
 * dropped until it fits / the oldest dropped / an entry out of the map and freed. */
void pkv__tstore_insert(pkv__tstore *s, pkv__tent *e);
void pkv__tstore_evict_oldest(pkv__tstore *s);
void pkv__tstore_forget(pkv__tstore *s, pkv__tent *e);
void pkv__tstore_usage(void *ctx, uint64_t *entries, uint64_t *bytes, uint64_t *capacity, uint64_t *evictions);

/* The built-in stores: their ops and context (pkv_tier_host_create, pkv_tier_file_create). */
int pkv__tier_host_open(uint64_t capacity, const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx);
int pkv__tier_file_open(const char *dir, uint64_t capacity, const pkv_allocator *alloc, pkv_tier_ops *ops,
                        void **ctx);
/* A built-in store's own call beside its ops (pkv_tier_ops is the public contract): want says
 * that gets of keys[0], keys[1], ... keys[n - 1] (PKV__TIER_KEY bytes each, n <= PKV__TIER_AHEAD)
 * are coming, in that order, the first of them next, so that the store may ask for them ahead
 * (Redis: their GETs sent at once, the server answering the next while the caller takes in this
 * one). Only a hint: any call may follow. */
#define PKV__TIER_AHEAD 4u
typedef void (*pkv__tier_want_fn)(void *ctx, const uint8_t *keys, uint32_t n);
/* A second: another context on the same store (*out; PKV_OK, or PKV_ENOMEM), destroyed by
 * the ops' destroy. The tier's thread (prefetch, write-back) takes one of its own, so that its
 * calls and the callers' do not wait on one connection, nor drop each other's gets ahead. */
typedef int (*pkv__tier_clone_fn)(void *ctx, void **out);
/* And a third: the probes (get without data) of keys[0], keys[1], ... keys[n - 1]
 * (PKV__TIER_KEY bytes each, n <= PKV__TIER_PROBES) at once, got[i] each one's status (PKV_OK,
 * PKV_ENOENT, or a failure). Redis sends them together and reads the replies after: one round
 * trip for all. */
#define PKV__TIER_PROBES 16u
typedef void (*pkv__tier_probe_many_fn)(void *ctx, uint32_t n, const uint8_t *keys, int *got);
/* And a fourth: the puts of n <= PKV__TIER_PROBES entries, each made when its turn comes (into
 * the caller's one buffer, a save's; or made already, the write-back's): make(arg, i, &data,
 * &len) gives entry i (PKV_OK; else that status ends the call), which is put under keys[i]
 * (PKV__TIER_KEY bytes each) and written out before the next is made. put[i]: the put's status
 * (a failure may be a reply lost after the store took the entry); the make's where it failed;
 * PKV__TIER_UNTRIED for those after a make or a write that failed (the first, unmade, where the
 * store cannot be reached). Redis writes the SETs one after another and reads their replies
 * after: one round trip for all, where the ops take one a put. */
#define PKV__TIER_UNTRIED 1
typedef int (*pkv__tier_make_fn)(void *arg, uint32_t i, const void **data, size_t *len);
typedef void (*pkv__tier_put_stream_fn)(void *ctx, uint32_t n, const uint8_t *keys, pkv__tier_make_fn make, void *arg,
                                        int *put);
typedef struct pkv__tier_ext {
    pkv__tier_want_fn want;
    pkv__tier_clone_fn clone;
    pkv__tier_probe_many_fn probe_many;
    pkv__tier_put_stream_fn put_stream;
} pkv__tier_ext;
/* Tests: t's store calls beside its ops made ext's (a store of the test's own, taking probes and
 * puts together as Redis does). */
void pkv__tier_test_ext(pkv_tier *t, const pkv__tier_ext *ext);
/* host under 256 bytes, prefix under 256 (checked by the caller); conns: the callers'
 * connections, 1 to PKV__TIER_REDIS_CONNS (a thread keeps to one: tier_redis.c); PKV_ENOTSUP
 * without hiredis */
#ifndef PKV__TIER_REDIS_CONNS
#define PKV__TIER_REDIS_CONNS 4
#endif
int pkv__tier_redis_open(const char *host, int port, const char *prefix, uint32_t timeout_ms, uint32_t conns,
                         const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx, pkv__tier_ext *ext);

#endif
