/* tier_redis.c: the Redis store (pkv_tier_redis_create), over hiredis where the build found it
 * (PKV_HAVE_HIREDIS), else a constructor that answers PKV_ENOTSUP. An entry is a string value
 * under the key prefix followed by the 16 key bytes (binary-safe). What stays is the server's
 * business: its maxmemory and maxmemory-policy (allkeys-lru: the least recently used go;
 * noeviction: a put is refused with an OOM error, PKV_ENOSPC here). A store (redis_store) is one
 * connection, its calls serialized by its lock (a hiredis context is not thread-safe); a
 * connection that broke is made again at the next call. The ops' context is a pool of stores
 * (redis_pool): the callers' threads each keep to one of up to 4, the tier's thread has a pool
 * of one of its own (redis_clone). hiredis allocates with malloc, not through the hook.
 *
 * Gets ahead (redis_want: a load's or a prefetch's next entries): their GETs are sent together and
 * their replies read as the gets come, so that the server answers the next while the caller
 * takes in this one, instead of waiting for each request in turn; a get past some of them drops
 * those before it, any other call first reads and drops every reply still to come.
 * probe_many: probes together (a save's, the write-back's, a windowed load's search, a load's
 * touches); put_stream: puts together (a save's, the write-back's). */
#include "tier_int.h"

#include <string.h>

#ifdef PKV_HAVE_HIREDIS
#include <errno.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/time.h>
#include <time.h>

typedef struct redis_store {
    pthread_mutex_t mu;
    redisContext *rc; /* NULL after a failure: made again at the next call */
    /* the keys of the GETs sent ahead whose replies are still to be read, oldest first */
    uint8_t ahead[PKV__TIER_AHEAD][PKV__TIER_KEY];
    uint32_t n_ahead;
    pkv_allocator alloc;
    struct timeval tv;
    int port;
    size_t prefix_len;
    char host[256];
    char key[256 + PKV__TIER_KEY]; /* the prefix, then room for the key's bytes (under the lock) */
} redis_store;

/* The callers' connections: a thread takes the one its id hashes to, always the same, so that
 * its gets ahead and the gets that take them meet on one connection, and threads that load at
 * once mostly do so on connections of their own (connected at their first call). The tier's
 * thread has a pool of one (redis_clone). */
enum { REDIS_CONNS = PKV__TIER_REDIS_CONNS };
typedef struct redis_pool {
    uint32_t n;
    pkv_allocator alloc;
    redis_store *s[REDIS_CONNS];
} redis_pool;

static redis_store *pick(void *ctx) {
    const redis_pool *p = ctx;
    if (p->n == 1) return p->s[0];
    const pthread_t self = pthread_self();
    uint64_t h = 0;
    memcpy(&h, &self, sizeof self < sizeof h ? sizeof self : sizeof h);
    h *= 0x9E3779B97F4A7C15ull; /* the id's bits spread (ids are often aligned addresses) */
    return p->s[(h >> 32) % p->n];
}

/* hiredis writes with write(2): where the server has gone, a write after the first raises
 * SIGPIPE, whose default action ends the process. A library cannot change that action for its
 * caller, so each store call holds SIGPIPE back in its own thread while it runs and takes one
 * raised meanwhile (unless one was pending already: that one is the caller's); the write then
 * fails with EPIPE and the call with PKV_EIO. */
typedef struct pipe_guard {
    sigset_t old;
    bool had; /* SIGPIPE pending before the call */
} pipe_guard;

static void enter(redis_store *r, pipe_guard *g) {
    sigset_t pipe, pend;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &g->old);
    g->had = !sigpending(&pend) && sigismember(&pend, SIGPIPE);
    pthread_mutex_lock(&r->mu);
}

static void leave(redis_store *r, pipe_guard *g) {
    pthread_mutex_unlock(&r->mu);
    sigset_t pipe, pend;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    if (!g->had && !sigpending(&pend) && sigismember(&pend, SIGPIPE)) {
        const struct timespec none = {0, 0};
        while (sigtimedwait(&pipe, NULL, &none) < 0 && errno == EINTR) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

static int connect_now(redis_store *r) {
    if (r->rc) return PKV_OK;
    redisContext *c = redisConnectWithTimeout(r->host, r->port, r->tv);
    if (!c || c->err || redisSetTimeout(c, r->tv) != REDIS_OK) {
        if (c) redisFree(c);
        return PKV_EIO;
    }
    r->rc = c;
    return PKV_OK;
}

static void drop_connection(redis_store *r) {
    redisFree(r->rc);
    r->rc = NULL;
    r->n_ahead = 0;
}

/* The next reply on the connection, or NULL (the connection dropped). */
static redisReply *next_reply(redis_store *r) {
    void *y = NULL;
    if (redisGetReply(r->rc, &y) != REDIS_OK || !y) {
        drop_connection(r);
        return NULL;
    }
    return y;
}

/* the first k keys of the GETs sent ahead forgotten (their replies read) */
static void forget_ahead(redis_store *r, uint32_t k) {
    r->n_ahead -= k;
    memmove(r->ahead[0], r->ahead[k], (size_t)r->n_ahead * PKV__TIER_KEY);
}

/* the first k replies of the GETs sent ahead (k <= n_ahead), read and dropped */
static void drop_ahead(redis_store *r, uint32_t k) {
    uint32_t i = 0;
    for (redisReply *y; i < k && (y = next_reply(r)); i++) freeReplyObject(y);
    if (r->rc) forget_ahead(r, k); /* (dropped: none left) */
}

/* where the GET of key was sent ahead, its place among them; else n_ahead */
static uint32_t ahead_of(const redis_store *r, const uint8_t *key) {
    uint32_t k = 0;
    while (k < r->n_ahead && memcmp(r->ahead[k], key, PKV__TIER_KEY)) k++;
    return k;
}

/* every reply of the GETs sent ahead, read and dropped */
static void drain(redis_store *r) { drop_ahead(r, r->n_ahead); }

/* Queues the command for key (fmt: the key's %b, then the value's where data is set) and writes
 * it out now (a put's value can be large: not kept queued beside the next); false where the
 * connection failed (then dropped). */
static bool send_now(redis_store *r, const char *fmt, const uint8_t *key, const void *data, size_t len) {
    memcpy(r->key + r->prefix_len, key, PKV__TIER_KEY);
    const int q = data ? redisAppendCommand(r->rc, fmt, r->key, r->prefix_len + PKV__TIER_KEY, data, len)
                       : redisAppendCommand(r->rc, fmt, r->key, r->prefix_len + PKV__TIER_KEY);
    int done = q != REDIS_OK;
    while (!done)
        if (redisBufferWrite(r->rc, &done) != REDIS_OK) break;
    if (q != REDIS_OK || !done) {
        drop_connection(r);
        return false;
    }
    return true;
}

/* a command's reply (send_now's arguments), or NULL (connection dropped: made again at the next
 * call) */
static redisReply *command(redis_store *r, const char *fmt, const uint8_t *key, const void *data, size_t len) {
    drain(r);
    return connect_now(r) || !send_now(r, fmt, key, data, len) ? NULL : next_reply(r);
}

static void redis_want(void *ctx, const uint8_t *keys, uint32_t n) {
    redis_store *r = pick(ctx);
    pipe_guard g;
    enter(r, &g);
    n = n < PKV__TIER_AHEAD ? n : PKV__TIER_AHEAD;
    /* those sent before keys[0] are not wanted now (a prefetch that skipped staged blocks); the
       rest must be the first of keys, in order */
    drop_ahead(r, ahead_of(r, keys));
    const uint32_t same = r->n_ahead < n ? r->n_ahead : n;
    if (memcmp(r->ahead, keys, (size_t)same * PKV__TIER_KEY)) drain(r);
    /* written at once: redisGetReply writes what is queued only while no reply is waiting. Not
       where the connection is gone: the get after this connects (one timeout, not two) */
    if (r->rc)
        for (uint32_t j = r->n_ahead; j < n; j++) {
            const uint8_t *key = keys + (size_t)j * PKV__TIER_KEY;
            if (!send_now(r, "GET %b", key, NULL, 0)) break;
            memcpy(r->ahead[r->n_ahead++], key, PKV__TIER_KEY);
        }
    leave(r, &g);
}

/* a SET's reply as a status: refused for want of room under noeviction (OOM) is PKV_ENOSPC */
static int set_status(const redisReply *y) {
    return !y                                                                      ? PKV_EIO
           : y->type == REDIS_REPLY_STATUS                                         ? PKV_OK
           : y->type == REDIS_REPLY_ERROR && y->str && !strncmp(y->str, "OOM", 3) ? PKV_ENOSPC
                                                                                   : PKV_EIO;
}

static int redis_put(void *ctx, const uint8_t key[16], const void *data, size_t len) {
    redis_store *r = pick(ctx);
    pipe_guard g;
    enter(r, &g);
    redisReply *y = command(r, "SET %b %b", key, data ? data : "", len);
    const int rc = set_status(y);
    if (y) freeReplyObject(y);
    leave(r, &g);
    return rc;
}

/* the probe's reply as a status: a length over 0 is there (an entry is never empty) */
static int probe_status(const redisReply *y) {
    return !y || y->type != REDIS_REPLY_INTEGER ? PKV_EIO : y->integer > 0 ? PKV_OK : PKV_ENOENT;
}

static void redis_probe_many(void *ctx, uint32_t n, const uint8_t *keys, int *got) {
    redis_store *r = pick(ctx);
    pipe_guard g;
    enter(r, &g);
    drain(r);
    n = n < PKV__TIER_PROBES ? n : PKV__TIER_PROBES;
    uint32_t sent = 0;
    if (!connect_now(r))
        while (sent < n && send_now(r, "STRLEN %b", keys + (size_t)sent * PKV__TIER_KEY, NULL, 0)) sent++;
    /* (a connection lost on the way fails the rest: the caller asks nothing more of the store) */
    for (uint32_t i = 0; i < n; i++) {
        redisReply *y = i < sent && r->rc ? next_reply(r) : NULL;
        got[i] = probe_status(y);
        if (y) freeReplyObject(y);
    }
    leave(r, &g);
}

static void redis_put_stream(void *ctx, uint32_t n, const uint8_t *keys, pkv__tier_make_fn make, void *arg, int *put) {
    redis_store *r = pick(ctx);
    pipe_guard g;
    enter(r, &g);
    drain(r);
    n = n < PKV__TIER_PROBES ? n : PKV__TIER_PROBES;
    for (uint32_t i = 0; i < n; i++) put[i] = PKV__TIER_UNTRIED;
    const bool up = !connect_now(r);
    uint32_t sent = 0;
    if (!up && n) put[0] = PKV_EIO; /* (nothing made for a store out of reach) */
    for (uint32_t i = 0; up && i < n; i++) {
        const void *data = NULL;
        size_t len = 0;
        const int m = make(arg, i, &data, &len);
        if (m) {
            put[i] = m;
            break;
        }
        if (!send_now(r, "SET %b %b", keys + (size_t)i * PKV__TIER_KEY, len ? data : "", len)) {
            put[i] = PKV_EIO;
            break;
        }
        sent++;
    }
    for (uint32_t i = 0; i < sent; i++) { /* (a reply lost with the connection: PKV_EIO) */
        redisReply *y = r->rc ? next_reply(r) : NULL;
        put[i] = set_status(y);
        if (y) freeReplyObject(y);
    }
    leave(r, &g);
}

static int redis_get(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len) {
    redis_store *r = pick(ctx);
    pipe_guard g;
    enter(r, &g);
    int rc = PKV_EIO;
    /* the probe asks for the length (0: no such key; an entry is never empty); a get sent ahead
       takes its reply */
    redisReply *y;
    const uint32_t k = data ? ahead_of(r, key) : r->n_ahead;
    if (k < r->n_ahead) { /* those before it dropped */
        drop_ahead(r, k);
        y = r->rc ? next_reply(r) : NULL;
        if (y) forget_ahead(r, 1);
    } else {
        y = command(r, data ? "GET %b" : "STRLEN %b", key, NULL, 0);
    }
    if (!data) {
        rc = probe_status(y);
        if (rc != PKV_EIO) *len = (size_t)y->integer;
    } else if (y && y->type == REDIS_REPLY_NIL) rc = PKV_ENOENT;
    else if (y && y->type == REDIS_REPLY_STRING) {
        *len = y->len;
        rc = y->len > cap ? PKV_ENOSPC : PKV_OK;
        if (!rc) memcpy(data, y->str, y->len);
    }
    if (y) freeReplyObject(y);
    leave(r, &g);
    return rc;
}

static int redis_del(void *ctx, const uint8_t key[16]) {
    redis_store *r = pick(ctx);
    pipe_guard g;
    enter(r, &g);
    redisReply *y = command(r, "DEL %b", key, NULL, 0);
    int rc = y && y->type == REDIS_REPLY_INTEGER ? PKV_OK : PKV_EIO;
    if (y) freeReplyObject(y);
    leave(r, &g);
    return rc;
}

static void store_free(redis_store *r) {
    if (r->rc) redisFree(r->rc);
    pthread_mutex_destroy(&r->mu);
    pkv_allocator a = r->alloc;
    pkv__free(&a, r, sizeof *r);
}

static void redis_destroy(void *ctx) {
    redis_pool *p = ctx;
    for (uint32_t i = 0; i < p->n; i++) store_free(p->s[i]);
    pkv_allocator a = p->alloc;
    pkv__free(&a, p, sizeof *p);
}

/* A store of those parameters, not connected yet (the first call connects). */
static redis_store *store_new(const char *host, int port, const char *prefix, size_t prefix_len, struct timeval tv,
                              const pkv_allocator *alloc) {
    redis_store *r = pkv__alloc(alloc, sizeof *r, 64);
    if (!r) return NULL;
    memset(r, 0, sizeof *r);
    if (alloc) r->alloc = *alloc;
    pthread_mutex_init(&r->mu, NULL);
    r->tv = tv;
    r->port = port;
    strcpy(r->host, host);
    r->prefix_len = prefix_len;
    memcpy(r->key, prefix, prefix_len);
    return r;
}

/* A pool of n stores like `like` (first, where given, as its first: the caller's again where this
 * fails), not connected yet; NULL where the allocator has no room. */
static redis_pool *pool_new(uint32_t n, redis_store *first, const redis_store *like) {
    const pkv_allocator *alloc = like->alloc.alloc ? &like->alloc : NULL;
    redis_pool *p = pkv__alloc(alloc, sizeof *p, 64);
    if (!p) return NULL;
    memset(p, 0, sizeof *p);
    if (alloc) p->alloc = *alloc;
    for (uint32_t i = 0; i < n; i++) {
        redis_store *r = i == 0 && first ? first
                                         : store_new(like->host, like->port, like->key, like->prefix_len, like->tv, alloc);
        if (!r) {
            for (uint32_t j = first ? 1 : 0; j < p->n; j++) store_free(p->s[j]);
            pkv__free(alloc, p, sizeof *p);
            return NULL;
        }
        p->s[p->n++] = r;
    }
    return p;
}

static int redis_clone(void *ctx, void **out) {
    redis_pool *c = pool_new(1, NULL, ((const redis_pool *)ctx)->s[0]);
    *out = c;
    return c ? PKV_OK : PKV_ENOMEM;
}

int pkv__tier_redis_open(const char *host, int port, const char *prefix, uint32_t timeout_ms, uint32_t conns,
                         const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx, pkv__tier_ext *ext) {
    conns = conns < 1 ? 1 : conns > REDIS_CONNS ? REDIS_CONNS : conns;
    const uint32_t ms = timeout_ms ? timeout_ms : 1000;
    const struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    redis_store *r = store_new(host, port, prefix, strlen(prefix), tv, alloc);
    if (!r) return PKV_ENOMEM;
    pipe_guard g;
    enter(r, &g);
    int rc = connect_now(r);
    if (!rc) { /* the server answers */
        redisReply *y = redisCommand(r->rc, "PING");
        rc = y && y->type != REDIS_REPLY_ERROR ? PKV_OK : PKV_EIO;
        if (y) freeReplyObject(y);
    }
    leave(r, &g);
    redis_pool *p = rc ? NULL : pool_new(conns, r, r);
    if (!p) {
        store_free(r);
        return rc ? rc : PKV_ENOMEM;
    }
    *ops = (pkv_tier_ops){redis_put, redis_get, redis_del, NULL, redis_destroy};
    *ctx = p;
    *ext = (pkv__tier_ext){redis_want, redis_clone, redis_probe_many, redis_put_stream};
    return PKV_OK;
}
#else
int pkv__tier_redis_open(const char *host, int port, const char *prefix, uint32_t timeout_ms, uint32_t conns,
                         const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx, pkv__tier_ext *ext) {
    (void)host, (void)port, (void)prefix, (void)timeout_ms, (void)conns, (void)alloc, (void)ops, (void)ctx, (void)ext;
    return PKV_ENOTSUP;
}
#endif
