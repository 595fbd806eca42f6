/* test_tier_redis.c: the Redis tier against a redis-server this test starts on a port of its
 * own: blocks saved through one tier object and loaded through another (another process's view)
 * byte for byte, key prefixes apart, a server that goes away (a save fails with PKV_EIO, a load
 * ends with what it has) and comes back (the tier connects again), and a full server under
 * noeviction (puts refused for want of room: not an error), and a windowed restore (loaded and
 * prefetched under a window). Where the library was built without
 * hiredis, pkv_tier_redis_create must answer PKV_ENOTSUP, and the rest is skipped; where it was
 * built with it, a missing redis-server fails the test (scripts/deps.sh installs it). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"
#include "tier/tier_int.h" /* PKV__TIER_AHEAD */

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { B = 8, LAYERS = 2, KV = 2, HD = 32, N = 45, TAG = 5 };

static pid_t g_srv = -1; /* the server running, stopped by the teardown where a check failed */

static pid_t start_server(int port, const char *maxmemory, const char *policy) {
    char p[16];
    snprintf(p, sizeof p, "%d", port);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        freopen("/dev/null", "w", stdout);
        execlp("redis-server", "redis-server", "--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory", maxmemory, "--maxmemory-policy", policy, (char *)NULL);
        _exit(127);
    }
    g_srv = pid;
    return pid;
}

static void stop_server(pid_t pid) {
    kill(pid, SIGCONT); /* (a check may have failed while it was stopped) */
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
    g_srv = -1;
}

static int teardown(void **state) {
    (void)state;
    if (g_srv > 0) stop_server(g_srv);
    return 0;
}

/* a tier on the server at port, waiting for it to come up (at most 10 s) */
static pkv_tier *connect_tier(int port, const char *prefix) {
    pkv_tier *t = NULL;
    for (int i = 0; i < 200; i++) {
        if (pkv_tier_redis_create("127.0.0.1", port, prefix, 500, NULL, &t) == PKV_OK) return t;
        usleep(50000);
    }
    fail_msg("no redis-server answered on port %d", port);
    return NULL;
}

static pkv_cache *mk(uint32_t n_blocks) {
    pkv_config cfg = tu_config(n_blocks, B, LAYERS, KV, HD, PKV_DTYPE_F16);
    cfg.v_dtype = PKV_DTYPE_Q8_0;
    cfg.enable_prefix_cache = 1;
    return tu_create(&cfg);
}

static pkv_seq filled(pkv_cache *c, const int32_t *toks, uint32_t n) {
    pkv_seq s;
    TU_OK(pkv_seq_create(c, NULL, 0, &s));
    TU_OK(pkv_seq_append(c, s, toks, n, NULL));
    TU_WRITE_PAT(c, s, 0, n, TAG);
    TU_OK(pkv_seq_commit(c, s, n));
    return s;
}

static uint32_t load_fresh(pkv_tier *t, pkv_cache *c, const int32_t *toks, uint32_t n, pkv_seq *out) {
    uint32_t r = 0, got = 999;
    TU_OK(pkv_seq_create(c, NULL, 0, out));
    TU_OK(pkv_seq_match_prefix(c, *out, toks, n, &r));
    assert_int_equal(r, 0);
    TU_OK(pkv_tier_load(t, c, *out, toks, n, &got));
    TU_CHECK(c);
    return got;
}

static pkv_tier_stats tstats(pkv_tier *t) {
    pkv_tier_stats st;
    TU_OK(pkv_tier_get_stats(t, &st));
    return st;
}

static void test_redis(void **state) {
    (void)state;
    pkv_tier *t = NULL;
    int rc = pkv_tier_redis_create("127.0.0.1", 1, NULL, 100, NULL, &t);
    if (rc == PKV_ENOTSUP) {
        printf("test_tier_redis: the library was built without hiredis: skipped\n");
        skip();
    }
    assert_int_equal(rc, PKV_EIO); /* nothing listens on port 1 */
    assert_null(t);
    TU_RC(pkv_tier_redis_create(NULL, 6379, NULL, 0, NULL, &t), PKV_EINVAL);
    TU_RC(pkv_tier_redis_create("127.0.0.1", 0, NULL, 0, NULL, &t), PKV_EINVAL);
    TU_RC(pkv_tier_redis_create("127.0.0.1", 70000, NULL, 0, NULL, &t), PKV_EINVAL);
    TU_RC(pkv_tier_redis_create("127.0.0.1", 6379, NULL, 0, NULL, NULL), PKV_EINVAL);
    if (system("command -v redis-server >/dev/null 2>&1") != 0) fail_msg("redis-server is not installed");
    const int port = 20000 + (int)(getpid() % 20000);
    pid_t srv = start_server(port, "64mb", "allkeys-lru");
    char prefix[64], other[64];
    snprintf(prefix, sizeof prefix, "pkvtest:%d:", (int)getpid());
    snprintf(other, sizeof other, "pkvother:%d:", (int)getpid());
    t = connect_tier(port, prefix);
    int32_t toks[N];
    for (int i = 0; i < N; i++) toks[i] = 40 + 3 * i;
    pkv_cache *a = mk(16), *b = mk(40);
    pkv_seq sa = filled(a, toks, N), s;
    uint32_t saved = 0;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 0);
    assert_int_equal(tstats(t).save_present, 5);
    /* another tier object on the same server and prefix: another process's view */
    pkv_tier *t2 = connect_tier(port, prefix), *t3 = connect_tier(port, other);
    assert_int_equal(load_fresh(t2, b, toks, N, &s), 40);
    const size_t kb = pkv_dtype_row_bytes(PKV_DTYPE_F16, HD) * KV * 40, vb = pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, HD) * KV * 40;
    uint8_t *x = malloc(kb + vb), *y = malloc(kb + vb);
    for (uint32_t l = 0; l < LAYERS; l++) {
        TU_OK(pkv_seq_read_stored(a, sa, l, 0, 40, x, x + kb));
        TU_OK(pkv_seq_read_stored(b, s, l, 0, 40, y, y + kb));
        assert_memory_equal(x, y, kb + vb);
    }
    free(x);
    free(y);
    pkv_cache *c = mk(40);
    assert_int_equal(load_fresh(t3, c, toks, N, &s), 0); /* another prefix */
    /* the server goes away: a save fails (PKV_EIO), a load ends with nothing, both say so */
    stop_server(srv);
    pkv_cache *d = mk(40);
    TU_RC(pkv_tier_save(t3, a, sa, &saved), PKV_EIO);
    assert_int_equal(load_fresh(t, d, toks, N, &s), 0);
    assert_true(tstats(t).errors >= 1 && tstats(t3).errors >= 1);
    /* it comes back (empty): the tier connects again */
    srv = start_server(port, "64mb", "allkeys-lru");
    pkv_tier *probe = connect_tier(port, prefix); /* waits for it */
    pkv_tier_destroy(probe);
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    TU_OK(pkv_seq_release(d, s));
    assert_int_equal(load_fresh(t, d, toks, N, &s), 40);
    /* the server hangs (stopped, not gone): the load waits for one command's timeout (500 ms),
       not for one a block, ends with nothing, and the tier connects again once it answers */
    TU_OK(pkv_seq_release(d, s));
    const uint64_t errors = tstats(t).errors;
    kill(srv, SIGSTOP);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pkv_cache *e = mk(40);
    assert_int_equal(load_fresh(t, e, toks, N, &s), 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double waited = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    kill(srv, SIGCONT);
    assert_true(waited < 1.5);
    assert_int_equal(tstats(t).errors, errors + 1);
    TU_OK(pkv_seq_release(e, s));
    assert_int_equal(load_fresh(t, e, toks, N, &s), 40);
    pkv_cache_destroy(e);
    stop_server(srv);
    /* a full server under noeviction refuses puts: not an error (maxmemory 1 byte: always full) */
    srv = start_server(port, "1", "noeviction");
    pkv_tier *full = connect_tier(port, prefix);
    TU_OK(pkv_tier_save(full, a, sa, &saved));
    assert_int_equal(saved, 0);
    assert_int_equal(tstats(full).save_no_room, 5);
    pkv_tier_destroy(full);
    stop_server(srv);
    pkv_tier_destroy(t);
    pkv_tier_destroy(t2);
    pkv_tier_destroy(t3);
    pkv_cache_destroy(a);
    pkv_cache_destroy(b);
    pkv_cache_destroy(c);
    pkv_cache_destroy(d);
}

/* A number from the server's INFO section: the line that starts with field (0 where none). */
static long info_number(int port, const char *section, const char *field) {
    char cmd[96], line[256];
    snprintf(cmd, sizeof cmd, "redis-cli -p %d INFO %s", port, section);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    long n = 0;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, strlen(field))) n = strtol(line + strlen(field), NULL, 10);
    assert_int_equal(pclose(f), 0);
    return n;
}

/* the GETs the server answered; the clients connected (redis-cli's own among them) */
static long gets_answered(int port) { return info_number(port, "commandstats", "cmdstat_get:calls="); }
static long clients(int port) { return info_number(port, "clients", "connected_clients:"); }

/* a and b hold the same rows at [start, start + n) of sa and sb, every layer */
static void same_rows_at(pkv_cache *a, pkv_seq sa, pkv_cache *b, pkv_seq sb, uint32_t start, uint32_t n) {
    const size_t kb = pkv_dtype_row_bytes(PKV_DTYPE_F16, HD) * KV * n, vb = pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, HD) * KV * n;
    uint8_t *x = malloc(kb + vb), *y = malloc(kb + vb);
    for (uint32_t l = 0; l < LAYERS; l++) {
        TU_OK(pkv_seq_read_stored(a, sa, l, start, n, x, x + kb));
        TU_OK(pkv_seq_read_stored(b, sb, l, start, n, y, y + kb));
        assert_memory_equal(x, y, kb + vb);
    }
    free(x);
    free(y);
}

static void same_rows(pkv_cache *a, pkv_seq sa, pkv_cache *b, pkv_seq sb, uint32_t n) {
    same_rows_at(a, sa, b, sb, 0, n);
}

/* put_stream's entries: entry i is 8 bytes of 0x40 + i, made into one buffer; the make of entry
 * fail_at fails (PKV_EINVAL). */
typedef struct stream_src {
    uint32_t fail_at, calls;
    uint8_t buf[8];
} stream_src;

static int stream_make(void *arg, uint32_t i, const void **data, size_t *len) {
    stream_src *s = arg;
    s->calls++;
    if (i == s->fail_at) return PKV_EINVAL;
    memset(s->buf, 0x40 + (int)i, sizeof s->buf);
    *data = s->buf, *len = sizeof s->buf;
    return PKV_OK;
}

/* The store's gets ahead call by call (pkv__tier_redis_open: its ops and want): whatever comes
 * after a want, each call answers for its own key, never with a reply sent ahead for another:
 * a get of another key, a probe, a put and a del between, a want that skips one, a key the
 * server lacks, a buffer too small. Values: key j's is j + 1 bytes of j (k[5] is stored later).
 * Then the calls beside: probe_many, put_stream, against a full server and a gone one. */
static void test_redis_store_ahead(void **state) {
    (void)state;
    pkv_tier_ops ops;
    void *ctx = NULL;
    pkv__tier_ext ext = {0};
    if (pkv__tier_redis_open("127.0.0.1", 1, "x:", 100, 1, NULL, &ops, &ctx, &ext) == PKV_ENOTSUP) skip();
    if (system("command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1") != 0)
        fail_msg("redis-server or redis-cli is not installed");
    const int port = 20000 + (int)((getpid() + 13) % 20000);
    start_server(port, "64mb", "allkeys-lru");
    int rc = PKV_EIO;
    for (int i = 0; i < 200 && rc; i++)
        if ((rc = pkv__tier_redis_open("127.0.0.1", port, "ahead:", 500, 1, NULL, &ops, &ctx, &ext))) usleep(50000);
    TU_OK(rc);
    const pkv__tier_want_fn want = ext.want;
    assert_non_null(want);
    assert_non_null(ext.probe_many);
    assert_non_null(ext.put_stream);
    assert_non_null(ext.clone);
    uint8_t k[6][PKV__TIER_KEY], v[64], got[64];
    memset(k, 0, sizeof k);
    for (int j = 0; j < 6; j++) k[j][0] = (uint8_t)(j + 1), k[j][15] = 0xA5;
    for (int j = 0; j < 5; j++) {
        memset(v, j, (size_t)j + 1);
        TU_OK(ops.put(ctx, k[j], v, (size_t)j + 1));
    }
    size_t len = 0;
#define GET_IS(j)                                                                      \
    do {                                                                               \
        memset(got, 0xEE, sizeof got);                                                 \
        TU_OK(ops.get(ctx, k[j], got, sizeof got, &len));                              \
        assert_int_equal(len, (size_t)(j) + 1);                                        \
        for (size_t b_ = 0; b_ < len; b_++) assert_int_equal(got[b_], (uint8_t)(j));   \
    } while (0)
    const long g0 = gets_answered(port);
    want(ctx, &k[0][0], 4); /* 0-3 sent; 2 asked for first: 0 and 1 dropped */
    GET_IS(2);
    GET_IS(3); /* sent ahead: not asked for again */
    assert_int_equal(gets_answered(port) - g0, 4);
    GET_IS(0);
    want(ctx, &k[0][0], 4);
    GET_IS(0);
    GET_IS(1);
    TU_OK(ops.get(ctx, k[4], NULL, 0, &len)); /* a probe while 2 and 3 are unread */
    assert_int_equal(len, 5);
    GET_IS(3);
    want(ctx, &k[0][0], 3);
    memset(v, 9, 10);
    TU_OK(ops.put(ctx, k[5], v, 10)); /* a put between */
    GET_IS(0);
    TU_OK(ops.get(ctx, k[5], got, sizeof got, &len));
    assert_int_equal(len, 10);
    want(ctx, &k[0][0], 4);
    TU_OK(ops.del(ctx, k[1])); /* 1's reply was sent before the del: not the answer after it */
    GET_IS(0);
    TU_RC(ops.get(ctx, k[1], got, sizeof got, &len), PKV_ENOENT);
    GET_IS(2);
    memset(v, 1, 2);
    TU_OK(ops.put(ctx, k[1], v, 2));
    want(ctx, &k[0][0], 3);
    want(ctx, &k[1][0], 3); /* 0 skipped */
    GET_IS(1);
    GET_IS(2);
    want(ctx, &k[2][0], 2);
    TU_RC(ops.get(ctx, k[2], got, 2, &len), PKV_ENOSPC); /* too small: the length said */
    assert_int_equal(len, 3);
    GET_IS(3);
    uint8_t none[2][PKV__TIER_KEY] = {{0xFF}, {0}}; /* a key the server lacks, then k[0] */
    memcpy(none[1], k[0], PKV__TIER_KEY);
    want(ctx, &none[0][0], 2);
    TU_RC(ops.get(ctx, none[0], got, sizeof got, &len), PKV_ENOENT);
    GET_IS(0);
    uint8_t dk[PKV__TIER_KEY] = {0x65, 5}; /* a key the server lacks */
    /* probe_many (a save's, a windowed load's search, a load's touches): after a want, whose
       replies it reads past; each key's status in its place */
    want(ctx, &k[0][0], 4);
    uint8_t pk6[4][PKV__TIER_KEY];
    memcpy(pk6[0], k[3], PKV__TIER_KEY), memcpy(pk6[1], none[0], PKV__TIER_KEY);
    memcpy(pk6[2], k[0], PKV__TIER_KEY), memcpy(pk6[3], dk, PKV__TIER_KEY);
    int pr[4];
    ext.probe_many(ctx, 4, pk6[0], pr);
    TU_OK(pr[0]), assert_int_equal(pr[1], PKV_ENOENT), TU_OK(pr[2]), assert_int_equal(pr[3], PKV_ENOENT);
    GET_IS(0);
    /* put_stream (a save's, the write-back's): after a want, whose replies it reads past; each
       entry made by the callback as its turn comes; a make that fails ends the call there, what
       was put before it stays put, the rest untried */
    want(ctx, &k[0][0], 4);
    stream_src src = {.fail_at = 2};
    uint8_t sk[4][PKV__TIER_KEY] = {{0x70, 1}, {0x71, 1}, {0x72, 1}, {0x73, 1}};
    int ps[4];
    ext.put_stream(ctx, 4, sk[0], stream_make, &src, ps);
    TU_OK(ps[0]), TU_OK(ps[1]), assert_int_equal(ps[2], PKV_EINVAL), assert_int_equal(ps[3], PKV__TIER_UNTRIED);
    assert_int_equal(src.calls, 3);
    for (int i = 0; i < 4; i++) {
        const int r = ops.get(ctx, sk[i], got, sizeof got, &len);
        if (i < 2) {
            TU_OK(r);
            assert_int_equal(len, 8);
            for (size_t b_ = 0; b_ < len; b_++) assert_int_equal(got[b_], 0x40 + i);
        } else {
            assert_int_equal(r, PKV_ENOENT);
        }
    }
    src = (stream_src){.fail_at = 9};
    ext.put_stream(ctx, 2, sk[2], stream_make, &src, ps);
    TU_OK(ps[0]), TU_OK(ps[1]);
    assert_int_equal(src.calls, 2);
    GET_IS(0);
    /* a full server (maxmemory 1 byte under noeviction) refuses the puts: PKV_ENOSPC */
    char cmd[128];
    snprintf(cmd, sizeof cmd, "redis-cli -p %d CONFIG SET maxmemory-policy noeviction >/dev/null", port);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "redis-cli -p %d CONFIG SET maxmemory 1 >/dev/null", port);
    assert_int_equal(system(cmd), 0);
    uint8_t nk[2][PKV__TIER_KEY] = {{0x63, 1}, {0x64, 2}};
    src = (stream_src){.fail_at = 9};
    ext.put_stream(ctx, 2, nk[0], stream_make, &src, ps);
    assert_int_equal(ps[0], PKV_ENOSPC), assert_int_equal(ps[1], PKV_ENOSPC);
    GET_IS(3);
    /* the server gone: every status a failure, no crash, and nothing left to read after */
    stop_server(g_srv);
    ext.probe_many(ctx, 2, sk[0], pr);
    assert_true(pr[0] == PKV_EIO && pr[1] == PKV_EIO);
    src = (stream_src){.fail_at = 9};
    ext.put_stream(ctx, 2, sk[0], stream_make, &src, ps);
    assert_true(ps[0] == PKV_EIO && ps[1] == PKV__TIER_UNTRIED && src.calls == 0);
#undef GET_IS
    ops.destroy(ctx);
}

/* A stand-in server on the listening socket *arg (closed once it has its one connection):
 * answers the store's PING at its creation and hangs up (as a server restarted, or one that
 * closes idle connections: Redis's timeout setting). */
static void *hang_up(void *arg) {
    const int lfd = *(int *)arg;
    const int fd = accept(lfd, NULL, NULL);
    close(lfd); /* later connections refused */
    char buf[4096];
    size_t have = 0;
    while (fd >= 0 && !memmem(buf, have, "PING\r\n", 6)) {
        const ssize_t n = read(fd, buf + have, sizeof buf - have);
        if (n <= 0) break;
        have += (size_t)n;
    }
    if (fd >= 0) {
        (void)!write(fd, "+PONG\r\n", 7);
        close(fd); /* nothing unread: a clean close (FIN), not a reset */
    }
    return NULL;
}

/* A server that has hung up: a call's first write goes out (the peer answers it with a reset),
 * its second raises SIGPIPE, whose default action (left as it is here) would end the process:
 * the GETs a load sends ahead, each written on its own. The get fails with PKV_EIO, so do the
 * put, the probes and the puts together after it (no one listens now), and the thread's signal
 * mask and pending signals are as they were. */
typedef struct big_src {
    const uint8_t *v;
    size_t len;
    int calls;
} big_src;

static int big_make(void *arg, uint32_t i, const void **data, size_t *len) {
    big_src *s = arg;
    (void)i;
    s->calls++;
    *data = s->v, *len = s->len;
    return PKV_OK;
}

static void test_redis_hang_up_mid_put(void **state) {
    (void)state;
    pkv_tier_ops ops;
    void *ctx = NULL;
    pkv__tier_ext ext;
    if (pkv__tier_redis_open("127.0.0.1", 1, "x:", 100, 1, NULL, &ops, &ctx, &ext) == PKV_ENOTSUP) skip();
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(lfd, 1), 0);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&a, &al), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, hang_up, &lfd), 0);
    TU_OK(pkv__tier_redis_open("127.0.0.1", ntohs(a.sin_port), "x:", 2000, 1, NULL, &ops, &ctx, &ext));
    pthread_join(th, NULL);
    usleep(20000); /* the close has arrived */
    uint8_t keys[4][PKV__TIER_KEY] = {{1}, {2}, {3}, {4}}, got[8];
    size_t len = 0;
    ext.want(ctx, &keys[0][0], 4);
    TU_RC(ops.get(ctx, keys[0], got, sizeof got, &len), PKV_EIO);
    const size_t big = 1u << 20;
    uint8_t *v = calloc(1, big), *key = keys[0];
    assert_non_null(v);
    TU_RC(ops.put(ctx, key, v, big), PKV_EIO);
    int pg[2], pp[2];
    ext.probe_many(ctx, 2, keys[0], pg); /* (no one listens now: it cannot connect) */
    assert_true(pg[0] == PKV_EIO && pg[1] == PKV_EIO);
    big_src src = {v, big, 0};
    ext.put_stream(ctx, 2, keys[0], big_make, &src, pp);
    assert_true(pp[0] == PKV_EIO && pp[1] == PKV__TIER_UNTRIED);
    sigset_t mask, pend;
    assert_int_equal(pthread_sigmask(SIG_BLOCK, NULL, &mask), 0);
    assert_false(sigismember(&mask, SIGPIPE));
    assert_int_equal(sigpending(&pend), 0);
    assert_false(sigismember(&pend, SIGPIPE));
    ops.destroy(ctx);
    free(v);
}

/* A load of tokens[0, n) through t into a new cache: want positions, each the same as src's sa. */
static void load_new(pkv_tier *t, const int32_t *toks, uint32_t n, uint32_t want, pkv_cache *src, pkv_seq sa) {
    pkv_cache *b = mk(n / B + 1);
    pkv_seq s;
    assert_int_equal(load_fresh(t, b, toks, n, &s), want);
    same_rows(src, sa, b, s, want);
    pkv_cache_destroy(b);
}

/* A thread's loads of one prompt through a shared tier, each into a cache of its own, compared
 * with the rows expected (no cmocka checks off the main thread: bad counts the loads that
 * differ). */
typedef struct loader {
    pkv_tier *t;
    const int32_t *toks;
    uint32_t n, want, rounds;
    const uint8_t *expect; /* every layer's K rows then V rows of [0, want), as same_rows reads */
    size_t kb, vb;
    int bad;
} loader;

static void *load_loop(void *arg) {
    loader *w = arg;
    uint8_t *y = malloc(w->kb + w->vb);
    for (uint32_t r = 0; r < w->rounds && y; r++) {
        pkv_config cfg = tu_config(w->n / B + 1, B, LAYERS, KV, HD, PKV_DTYPE_F16);
        cfg.v_dtype = PKV_DTYPE_Q8_0;
        pkv_cache *c = NULL;
        pkv_seq s;
        uint32_t got = 0;
        if (pkv_cache_create(&cfg, &c) || pkv_seq_create(c, NULL, 0, &s) ||
            pkv_tier_load(w->t, c, s, w->toks, w->n, &got) || got != w->want)
            w->bad++;
        for (uint32_t l = 0; l < LAYERS && got == w->want; l++)
            if (pkv_seq_read_stored(c, s, l, 0, w->want, y, y + w->kb) ||
                memcmp(y, w->expect + l * (w->kb + w->vb), w->kb + w->vb)) {
                w->bad++;
                break;
            }
        pkv_cache_destroy(c);
    }
    free(y);
    return NULL;
}

/* Gets ahead (tier_redis.c): a load sends the GETs of the next PKV__TIER_AHEAD blocks together
 * and reads their replies as it goes. Whatever ends a load early leaves replies unread, which
 * the next call on the connection must read past, never take as its own: a load that runs out
 * of room, one that stops at a block the server lacks (the GETs after it answered nil), and the
 * tier's prefetch thread fetching one prompt while loads of another run on the same connection,
 * with the staging so small that each prefetch fetches again. Each load is compared byte for
 * byte; a reply taken for another key would be refused (rejected) and the load cut short. */
static void test_redis_ahead(void **state) {
    (void)state;
    pkv_tier *t = NULL;
    if (pkv_tier_redis_create("127.0.0.1", 1, NULL, 100, NULL, &t) == PKV_ENOTSUP) skip();
    if (system("command -v redis-cli >/dev/null 2>&1") != 0) fail_msg("redis-cli is not installed");
    const int port = 20000 + (int)((getpid() + 7) % 20000);
    start_server(port, "64mb", "allkeys-lru");
    char prefix[64];
    snprintf(prefix, sizeof prefix, "pkvahead:%d:", (int)getpid());
    t = connect_tier(port, prefix);
    enum { NB = 9, M = NB * B + 1 }; /* 9 full blocks and a last token */
    int32_t toks[M], alt[M];
    for (int i = 0; i < M; i++) toks[i] = 7 + 5 * i, alt[i] = i < 5 * B ? toks[i] : 1000 + i;
    pkv_cache *a = mk(NB + 1), *a2 = mk(NB + 1);
    pkv_seq sa = filled(a, toks, M), sa2, s;
    uint32_t saved = 0;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, NB);

    /* room for 4 blocks (6 of 10 held by another sequence): the 5th append ends the load, with
       GETs sent past it */
    pkv_cache *small = mk(NB + 1);
    int32_t other[6 * B];
    for (int i = 0; i < 6 * B; i++) other[i] = 3000 + i;
    (void)filled(small, other, 6 * B);
    const long g0 = gets_answered(port);
    assert_int_equal(load_fresh(t, small, toks, M, &s), 4 * B);
    /* blocks 0-4 asked for, and PKV__TIER_AHEAD - 1 past the 5th */
    assert_int_equal(gets_answered(port) - g0, PKV_MIN(NB, 5 + PKV__TIER_AHEAD - 1));
    same_rows(a, sa, small, s, 4 * B);
    load_new(t, toks, M, NB * B, a, sa);

    /* alt shares toks' first 5 blocks; its own last 4 are stored, toks' are not (another prefix) */
    char prefix2[64];
    snprintf(prefix2, sizeof prefix2, "pkvahead2:%d:", (int)getpid());
    pkv_tier *u = connect_tier(port, prefix2);
    sa2 = filled(a2, alt, M);
    TU_OK(pkv_tier_save(u, a2, sa2, &saved));
    assert_int_equal(saved, NB);
    load_new(u, toks, M, 5 * B, a, sa); /* ends at block 5: nil, nil, nil after it */
    load_new(u, alt, M, NB * B, a2, sa2);
    assert_int_equal(tstats(u).rejected, 0);
    assert_int_equal(tstats(u).errors, 0);

    /* write-back (the thread's puts, PKV__TIER_AHEAD at a time): toks' last 4 blocks stored, its
       first 5 found; then the prefetch thread on alt (staging: 2 entries, so each prefetch
       fetches again), loads of toks beside it */
    TU_OK(pkv_tier_prefetch_start(u, 64 * 4096));
    TU_OK(pkv_tier_save_async(u, a, sa, &saved));
    TU_OK(pkv_tier_flush(u));
    assert_int_equal(tstats(u).saved, NB + NB - 5); /* alt's, then toks' own */
    assert_int_equal(tstats(u).save_present, 5);
    load_new(u, toks, M, NB * B, a, sa);
    pkv_tier_destroy(u);
    u = connect_tier(port, prefix2);
    const long c0 = clients(port);
    TU_OK(pkv_tier_prefetch_start(u, 3 * 4096));
    TU_OK(pkv_tier_prefetch(u, a, NULL, 0, alt, M));
    TU_OK(pkv_tier_prefetch_wait(u));
    assert_int_equal(clients(port), c0 + 1); /* the thread's own connection */
    for (int round = 0; round < 20; round++) {
        TU_OK(pkv_tier_prefetch(u, a, NULL, 0, alt, M));
        load_new(u, toks, M, NB * B, a, sa);
    }
    TU_OK(pkv_tier_prefetch_wait(u));
    const pkv_tier_stats st = tstats(u);
    assert_int_equal(st.rejected, 0);
    assert_int_equal(st.errors, 0);
    assert_true(st.prefetched > 0);
    /* loads from 4 threads at once through t: the callers' connections (a thread keeps to one,
       its gets ahead and its gets on it) */
    {
        enum { NT = 4 };
        const size_t kb = pkv_dtype_row_bytes(PKV_DTYPE_F16, HD) * KV * NB * B,
                     vb = pkv_dtype_row_bytes(PKV_DTYPE_Q8_0, HD) * KV * NB * B;
        uint8_t *x = malloc(LAYERS * (kb + vb));
        for (uint32_t l = 0; l < LAYERS; l++)
            TU_OK(pkv_seq_read_stored(a, sa, l, 0, NB * B, x + l * (kb + vb), x + l * (kb + vb) + kb));
        const long cl = clients(port);
        pthread_t th[NT];
        loader w[NT];
        for (int i = 0; i < NT; i++) {
            w[i] = (loader){.t = t, .toks = toks, .n = M, .want = NB * B, .rounds = 6, .expect = x, .kb = kb, .vb = vb};
            assert_int_equal(pthread_create(&th[i], NULL, load_loop, &w[i]), 0);
        }
        for (int i = 0; i < NT; i++) {
            assert_int_equal(pthread_join(th[i], NULL), 0);
            assert_int_equal(w[i].bad, 0);
        }
        assert_true(clients(port) <= cl + PKV__TIER_REDIS_CONNS - 1); /* one was connected already */
        assert_int_equal(tstats(t).rejected, 0);
        assert_int_equal(tstats(t).errors, 0);
        free(x);
    }
    /* every allocation of a Redis tier's making failing in turn (its connections', its
       thread's): PKV_ENOMEM and nothing left, or, past the last, a tier that works; where the
       thread's own connection cannot be made, it runs on the callers' */
    tu_alloc_state as;
    const pkv_allocator al = tu_allocator(&as);
    for (long k = 0;; k++) {
        tu_alloc_reset(&as, k);
        pkv_tier *ft = NULL;
        const int frc = pkv_tier_redis_create("127.0.0.1", port, prefix, 500, &al, &ft);
        if (frc == PKV_OK) {
            assert_int_equal(as.n_failed, 0);
            break;
        }
        assert_int_equal(frc, PKV_ENOMEM);
        assert_null(ft);
        assert_int_equal(as.n_live, 0);
    }
    for (long k = 0;; k++) { /* the allocations of prefetch_start and the first prefetch */
        tu_alloc_reset(&as, -1);
        pkv_tier *ft = NULL;
        TU_OK(pkv_tier_redis_create("127.0.0.1", port, prefix, 500, &al, &ft));
        const long made = as.n_calls;
        as.fail_at = made + k;
        const int frc = pkv_tier_prefetch_start(ft, 1u << 22);
        if (frc == PKV_OK) {
            const int prc = pkv_tier_prefetch(ft, a, NULL, 0, toks, M);
            assert_true(prc == PKV_OK || prc == PKV_ENOMEM);
            TU_OK(pkv_tier_prefetch_wait(ft));
            as.fail_at = -1; /* (the load's own allocations are test_tier's business) */
            load_new(ft, toks, M, NB * B, a, sa); /* from staging or the store: the same rows */
        } else {
            assert_int_equal(frc, PKV_ENOMEM);
        }
        pkv_tier_destroy(ft);
        assert_int_equal(as.n_live, 0);
        if (as.n_failed == 0) break;
    }
    pkv_tier_destroy(u);
    pkv_tier_destroy(t);
    stop_server(g_srv);
    pkv_cache_destroy(a);
    pkv_cache_destroy(a2);
    pkv_cache_destroy(small);
}

/* A windowed load of toks[0, n) into a new cache's empty sequence restores a's 200 positions,
 * front 160, their rows a's (sa's) byte for byte. */
static void restore_window(pkv_tier *t, pkv_cache *a, pkv_seq sa, const int32_t *toks, uint32_t n, uint32_t window) {
    pkv_cache *b = mk(40);
    pkv_seq s;
    uint32_t got = 0;
    TU_OK(pkv_seq_create(b, NULL, 0, &s));
    TU_OK(pkv_tier_load_window(t, b, s, toks, n, window, &got));
    assert_int_equal(got, 200);
    assert_int_equal(tu_info(b, s).n_dropped, 160);
    same_rows_at(a, sa, b, s, 160, 40);
    TU_CHECK(b);
    pkv_cache_destroy(b);
}

/* Under a sliding window (pkv_tier_load_window) against the server: a 200-position conversation
 * dropped to a window of 40 saves its last 5 blocks; another tier object restores them into an
 * empty cache (the probes, the gets ahead and the loads on one connection): 200 positions, front
 * 160, the rows byte for byte; then, prefetched under the window by the tier's thread on its own
 * connection, the same from staging (5 staged, 5 taken). */
static void test_redis_window(void **state) {
    (void)state;
    pkv_tier *t = NULL;
    if (pkv_tier_redis_create("127.0.0.1", 1, NULL, 100, NULL, &t) == PKV_ENOTSUP) skip();
    if (system("command -v redis-server >/dev/null 2>&1") != 0) fail_msg("redis-server is not installed");
    const int port = 20000 + (int)((getpid() + 3) % 20000);
    pid_t srv = start_server(port, "64mb", "allkeys-lru");
    char prefix[64];
    snprintf(prefix, sizeof prefix, "pkvwin:%d:", (int)getpid());
    t = connect_tier(port, prefix);
    enum { WN = 201, WIN = 40 };
    int32_t toks[WN];
    for (int i = 0; i < WN; i++) toks[i] = 7 + 5 * i;
    pkv_cache *a = mk(40);
    pkv_seq sa = filled(a, toks, 200);
    TU_OK(pkv_seq_drop_front(a, sa, 200 - WIN + 1)); /* the next query (200) sees 161 .. 200 */
    uint32_t saved = 0;
    TU_OK(pkv_tier_save(t, a, sa, &saved));
    assert_int_equal(saved, 5);
    pkv_tier *t2 = connect_tier(port, prefix);
    for (int staged = 0; staged < 2; staged++) {
        if (staged) {
            TU_OK(pkv_tier_prefetch_start(t2, 1u << 24));
            TU_OK(pkv_tier_prefetch_window(t2, a, NULL, 0, toks, WN, WIN));
            TU_OK(pkv_tier_prefetch_wait(t2));
            assert_int_equal(tstats(t2).prefetched, 5);
        }
        restore_window(t2, a, sa, toks, WN, WIN);
    }
    const pkv_tier_stats st = tstats(t2);
    assert_int_equal(st.loaded_blocks, 10);
    assert_int_equal(st.prefetch_hits, 5);
    assert_int_equal(st.errors + st.rejected + st.load_misses, 0);
    /* the conversation went on past its save (the window of 296 was never stored): the load
       misses block 32, the first of that window, then probes from block 31 down, 16 blocks in
       one round trip, and restores the window of 200 */
    enum { WN2 = 297 };
    int32_t toks2[WN2];
    for (int i = 0; i < WN2; i++) toks2[i] = 7 + 5 * i;
    restore_window(t2, a, sa, toks2, WN2, WIN);
    const pkv_tier_stats st2 = tstats(t2);
    assert_int_equal(st2.loaded_blocks, 15);
    assert_int_equal(st2.load_misses, 1);
    assert_int_equal(st2.errors + st2.rejected, 0);
    pkv_tier_destroy(t2);
    pkv_tier_destroy(t);
    stop_server(srv);
    pkv_cache_destroy(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test_teardown(test_redis, teardown),
                                       cmocka_unit_test_teardown(test_redis_store_ahead, teardown),
                                       cmocka_unit_test(test_redis_hang_up_mid_put),
                                       cmocka_unit_test_teardown(test_redis_ahead, teardown),
                                       cmocka_unit_test_teardown(test_redis_window, teardown)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
