/* tier_redis.c: the Redis store (pkv_tier_redis_create), over hiredis where the build found it
 * (PKV_HAVE_HIREDIS), else a constructor that answers PKV_ENOTSUP. An entry is a string value
 * under the key prefix followed by the 16 key bytes (binary-safe). What stays is the server's
 * business: its maxmemory and maxmemory-policy (allkeys-lru: the least recently used go;
 * noeviction: a put is refused with an OOM error, PKV_ENOSPC here). One connection, its calls
 * serialized by the store's lock (a hiredis context is not thread-safe); a connection that broke
 * is made again at the next call. hiredis allocates with malloc, not through the hook.
 *
 * Gets ahead (redis_want: a load's or a prefetch's next entries): their GETs are sent together and
 * their replies read as the gets come, so that the server answers the next while the caller
 * takes in this one, instead of waiting for each request in turn; any other call first reads
 * and drops the replies still to come. */
#include "tier_int.h"

#include <string.h>

#ifdef PKV_HAVE_HIREDIS
#include <hiredis/hiredis.h>
#include <sys/time.h>

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

/* the replies of the GETs sent ahead, read and dropped */
static void drain(redis_store *r) {
    for (redisReply *y; r->n_ahead && (y = next_reply(r)); r->n_ahead--) freeReplyObject(y);
}

/* a command's reply, or NULL (connection dropped: made again at the next call) */
static redisReply *command(redis_store *r, const char *fmt, const uint8_t *key, const void *data, size_t len) {
    drain(r);
    if (connect_now(r)) return NULL;
    memcpy(r->key + r->prefix_len, key, PKV__TIER_KEY);
    redisReply *y = data ? redisCommand(r->rc, fmt, r->key, r->prefix_len + PKV__TIER_KEY, data, len)
                         : redisCommand(r->rc, fmt, r->key, r->prefix_len + PKV__TIER_KEY);
    if (!y) drop_connection(r);
    return y;
}

static void redis_want(void *ctx, const uint8_t *keys, uint32_t n) {
    redis_store *r = ctx;
    pthread_mutex_lock(&r->mu);
    n = n < PKV__TIER_AHEAD ? n : PKV__TIER_AHEAD;
    /* those sent already must be the first of keys, in order */
    const uint32_t same = r->n_ahead < n ? r->n_ahead : n;
    if (memcmp(r->ahead, keys, (size_t)same * PKV__TIER_KEY)) drain(r);
    const uint32_t first = r->n_ahead;
    if (first < n && !connect_now(r)) {
        for (uint32_t j = first; j < n; j++) {
            const uint8_t *key = keys + (size_t)j * PKV__TIER_KEY;
            memcpy(r->key + r->prefix_len, key, PKV__TIER_KEY);
            if (redisAppendCommand(r->rc, "GET %b", r->key, r->prefix_len + PKV__TIER_KEY) != REDIS_OK) break;
            memcpy(r->ahead[r->n_ahead++], key, PKV__TIER_KEY);
        }
        /* written now: redisGetReply writes what is queued only once no reply is waiting */
        int done = 0;
        while (r->n_ahead > first && !done)
            if (redisBufferWrite(r->rc, &done) != REDIS_OK) drop_connection(r);
    }
    pthread_mutex_unlock(&r->mu);
}

static int redis_put(void *ctx, const uint8_t key[16], const void *data, size_t len) {
    redis_store *r = ctx;
    pthread_mutex_lock(&r->mu);
    redisReply *y = command(r, "SET %b %b", key, data ? data : "", len);
    int rc = !y                                  ? PKV_EIO
             : y->type == REDIS_REPLY_STATUS     ? PKV_OK
             : y->type == REDIS_REPLY_ERROR && y->str && !strncmp(y->str, "OOM", 3) ? PKV_ENOSPC
                                                 : PKV_EIO;
    if (y) freeReplyObject(y);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

static int redis_get(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len) {
    redis_store *r = ctx;
    pthread_mutex_lock(&r->mu);
    int rc = PKV_EIO;
    /* the probe asks for the length (0: no such key; an entry is never empty); a get sent ahead
       takes its reply */
    redisReply *y;
    if (data && r->n_ahead && !memcmp(r->ahead[0], key, PKV__TIER_KEY)) {
        if ((y = next_reply(r))) memmove(r->ahead[0], r->ahead[1], (size_t)--r->n_ahead * PKV__TIER_KEY);
    } else {
        y = command(r, data ? "GET %b" : "STRLEN %b", key, NULL, 0);
    }
    if (y && !data && y->type == REDIS_REPLY_INTEGER) {
        rc = y->integer > 0 ? PKV_OK : PKV_ENOENT;
        *len = (size_t)y->integer;
    } else if (y && data && y->type == REDIS_REPLY_NIL) rc = PKV_ENOENT;
    else if (y && data && y->type == REDIS_REPLY_STRING) {
        *len = y->len;
        rc = y->len > cap ? PKV_ENOSPC : PKV_OK;
        if (!rc) memcpy(data, y->str, y->len);
    }
    if (y) freeReplyObject(y);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

static int redis_del(void *ctx, const uint8_t key[16]) {
    redis_store *r = ctx;
    pthread_mutex_lock(&r->mu);
    redisReply *y = command(r, "DEL %b", key, NULL, 0);
    int rc = y && y->type == REDIS_REPLY_INTEGER ? PKV_OK : PKV_EIO;
    if (y) freeReplyObject(y);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

static void redis_destroy(void *ctx) {
    redis_store *r = ctx;
    if (r->rc) redisFree(r->rc);
    pthread_mutex_destroy(&r->mu);
    pkv_allocator a = r->alloc;
    pkv__free(&a, r, sizeof *r);
}

int pkv__tier_redis_open(const char *host, int port, const char *prefix, uint32_t timeout_ms,
                         const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx, pkv__tier_want_fn *want) {
    redis_store *r = pkv__alloc(alloc, sizeof *r, 64);
    if (!r) return PKV_ENOMEM;
    memset(r, 0, sizeof *r);
    if (alloc) r->alloc = *alloc;
    pthread_mutex_init(&r->mu, NULL);
    const uint32_t ms = timeout_ms ? timeout_ms : 1000;
    r->tv.tv_sec = ms / 1000;
    r->tv.tv_usec = (ms % 1000) * 1000;
    r->port = port;
    strcpy(r->host, host);
    r->prefix_len = strlen(prefix);
    memcpy(r->key, prefix, r->prefix_len);
    int rc = connect_now(r);
    if (!rc) { /* the server answers */
        redisReply *y = redisCommand(r->rc, "PING");
        rc = y && y->type != REDIS_REPLY_ERROR ? PKV_OK : PKV_EIO;
        if (y) freeReplyObject(y);
    }
    if (rc) {
        redis_destroy(r);
        return rc;
    }
    *ops = (pkv_tier_ops){redis_put, redis_get, redis_del, NULL, redis_destroy};
    *ctx = r;
    *want = redis_want;
    return PKV_OK;
}
#else
int pkv__tier_redis_open(const char *host, int port, const char *prefix, uint32_t timeout_ms,
                         const pkv_allocator *alloc, pkv_tier_ops *ops, void **ctx, pkv__tier_want_fn *want) {
    (void)host, (void)port, (void)prefix, (void)timeout_ms, (void)alloc, (void)ops, (void)ctx, (void)want;
    return PKV_ENOTSUP;
}
#endif
