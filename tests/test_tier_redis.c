/* test_tier_redis.c: the Redis tier against a redis-server this test starts on a port of its
 * own: blocks saved through one tier object and loaded through another (another process's view)
 * byte for byte, key prefixes apart, a server that goes away (a save fails with PKV_EIO, a load
 * ends with what it has) and comes back (the tier connects again), and a full server under
 * noeviction (puts refused for want of room: not an error). Where the library was built without
 * hiredis, pkv_tier_redis_create must answer PKV_ENOTSUP, and the rest is skipped; where it was
 * built with it, a missing redis-server fails the test (scripts/deps.sh installs it). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "support_util.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test_teardown(test_redis, teardown)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
