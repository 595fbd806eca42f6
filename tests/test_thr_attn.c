/* test_thr_attn.c: the attention thread pool under ThreadSanitizer: many back-to-back calls on
 * a multi-threaded context (key splits merged by the last finisher, decode batches read in pool
 * order and merged in a second job, prefill tiles handed out by work stealing), contexts created
 * and destroyed repeatedly, and two contexts driven from two application threads at once; the
 * pool itself: every task of every job runs exactly once, and none after its job has returned,
 * with workers that doze off between jobs and wake late; the same on a caller's executor (an
 * engine's own pthreads). Each result must equal the
 * single-threaded one bit for bit where the partition is the same, and within float rounding
 * where key splits change it. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn.h"
#include "attn/attn_pool.h"
#include "quant/quant.h"

#include <stdatomic.h>
#include <time.h>

enum { H = 2, D = 64, B = 16, NQH = 8, NB = 96, LEN = 1200 };

static uint16_t g_k[NB][H][B][D], g_v[NB][H][B][D]; /* f16 pool */
static int32_t g_table[NB];
static float g_q[LEN][NQH][D];

static void fill(void) {
    uint64_t s = 5;
    for (size_t i = 0; i < sizeof g_k / 2; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ((uint16_t *)g_k)[i] = pkv__f32_to_f16((float)((s >> 40) & 0xffff) / 32768.0f - 1.0f);
        ((uint16_t *)g_v)[i] = pkv__f32_to_f16((float)((s >> 20) & 0xffff) / 32768.0f - 1.0f);
    }
    for (int i = 0; i < NB; i++) g_table[i] = (i * 37) % NB; /* 37 is prime to 96: a permutation */
    for (size_t i = 0; i < sizeof g_q / 4; i++) ((float *)g_q)[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
}

static pkv__kv_view view(void) {
    pkv__kv_view kv = {.k = (const uint8_t *)g_k, .v = (const uint8_t *)g_v, .k_dtype = PKV_DTYPE_F16,
                       .v_dtype = PKV_DTYPE_F16, .k_row_bytes = D * 2, .v_row_bytes = D * 2,
                       .k_block_bytes = (size_t)H * B * D * 2, .v_block_bytes = (size_t)H * B * D * 2,
                       .n_kv_heads = H, .head_dim = D, .block_tokens = B, .n_blocks = NB};
    return kv;
}

static pkv__attn *make(uint32_t nt) {
    pkv__attn_limits lim = {.max_items = 4, .max_blocks_per_seq = NB, .n_kv_heads = H, .head_dim = D, .block_tokens = B,
                            .spin_us = PKV__SPIN_US_DEFAULT};
    pkv__attn *at = NULL;
    assert_int_equal(pkv__attn_create(NULL, nt, &lim, &at), PKV_OK);
    pkv__attn_set_inline_work(at, 0); /* every call through the pool, however small */
    return at;
}

static void near(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) assert_true(fabsf(a[i] - b[i]) <= 1e-5f);
}

/* decode of 1 long item (key splits with > 1 thread), then of it and another (pool order), + a
 * prefill of 40 queries, + the first decode and the 40 queries in one call; out_dec holds 3
 * outputs */
static void run_once(pkv__attn *at, float *out_dec, float *out_pre, uint32_t len) {
    pkv__kv_view kv = view();
    pkv__attn_call call = {.n_q_heads = NQH, .scale = 0.125f};
    pkv__attn_item dec[3] = {
        {.block_table = g_table, .q_pos0 = len - 1, .n_q = 1, .q = &g_q[0][0][0], .out = out_dec},
        {.block_table = g_table, .q_pos0 = len - 1, .n_q = 1, .q = &g_q[0][0][0], .out = out_dec + NQH * D},
        {.block_table = g_table, .q_pos0 = len / 2, .n_q = 1, .q = &g_q[1][0][0], .out = out_dec + 2 * NQH * D},
    };
    assert_int_equal(pkv__attn_run(at, &kv, dec, 1, &call), PKV_OK);
    /* two sequences: read in pool order (the table jumps), their blocks shared, one merge each */
    assert_int_equal(pkv__attn_run(at, &kv, dec + 1, 2, &call), PKV_OK);
    assert_true(pkv__attn_last_swept(at));
    near(out_dec, out_dec + NQH * D, NQH * D);
    pkv__attn_item pre[2] = {
        {.block_table = g_table, .q_pos0 = len - 40, .n_q = 40, .q = &g_q[0][0][0], .out = out_pre},
        {.block_table = g_table, .q_pos0 = 0, .n_q = 7, .q = &g_q[40][0][0], .out = out_pre + 40 * NQH * D},
    };
    assert_int_equal(pkv__attn_run(at, &kv, pre, 2, &call), PKV_OK);
    /* a decode beside an extend in one call: the decode swept, then the extend's units */
    float *mix = malloc(sizeof(float) * 41 * NQH * D);
    assert_non_null(mix);
    pkv__attn_item mixed[2] = {
        {.block_table = g_table, .q_pos0 = len - 1, .n_q = 1, .q = &g_q[0][0][0], .out = mix},
        {.block_table = g_table, .q_pos0 = len - 40, .n_q = 40, .q = &g_q[0][0][0], .out = mix + NQH * D},
    };
    assert_int_equal(pkv__attn_run(at, &kv, mixed, 2, &call), PKV_OK);
    assert_true(pkv__attn_last_swept(at));
    near(mix, out_dec, NQH * D);
    near(mix + NQH * D, out_pre, 40 * NQH * D);
    free(mix);
}


static void test_thr_back_to_back(void **state) {
    (void)state;
    fill();
    static float d1[3 * NQH * D], p1[47 * NQH * D], dn[3 * NQH * D], pn[47 * NQH * D];
    pkv__attn *one = make(1), *many = make(3);
    for (int it = 0; it < 60; it++) {
        const uint32_t len = 41 + (uint32_t)(it * 97) % (LEN - 41);
        pkv__attn_set_sweep_wide(many, it & 1); /* a set a thread, or one set in ranges of the pool */
        pkv__attn_set_passes(many, it & 2, (uint32_t)it % 3); /* in one pass or two (attn.c: pass_window) */
        run_once(one, d1, p1, len);
        run_once(many, dn, pn, len);
        near(d1, dn, 3 * NQH * D);
        assert_memory_equal(p1, pn, sizeof p1); /* prefill units are not split: identical */
    }
    pkv__attn_destroy(one);
    pkv__attn_destroy(many);
}

static void test_thr_create_destroy(void **state) {
    (void)state;
    static float d[3 * NQH * D], p[47 * NQH * D];
    for (uint32_t nt = 1; nt <= 4; nt++)
        for (int rep = 0; rep < 5; rep++) {
            pkv__attn *at = make(nt);
            if (rep & 1) run_once(at, d, p, 300);
            pkv__attn_destroy(at); /* also right after creation: workers may still be starting */
        }
}

typedef struct app_thread {
    pkv__attn *at;
    float dec[3 * NQH * D], pre[47 * NQH * D];
    int ok;
} app_thread;

static void *app_main(void *arg) {
    app_thread *t = arg;
    for (int i = 0; i < 20; i++) run_once(t->at, t->dec, t->pre, 800);
    t->ok = 1;
    return NULL;
}

/* Two contexts (as two caches would have), each used by its own application thread. */
static void test_thr_two_contexts(void **state) {
    (void)state;
    static app_thread t[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        t[i].at = make(2);
        t[i].ok = 0;
        assert_int_equal(pthread_create(&th[i], NULL, app_main, &t[i]), 0);
    }
    /* the item counts may be read while runs are in flight (as pkv_cache_get_stats does): they
     * only grow */
    uint64_t last[2][2] = {{0}};
    for (int rep = 0; rep < 2000; rep++) {
        const int i = rep & 1;
        uint64_t pool, table;
        pkv__attn_item_counts(t[i].at, &pool, &table);
        assert_true(pool >= last[i][0] && table >= last[i][1]);
        last[i][0] = pool, last[i][1] = table;
        sched_yield();
    }
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
    assert_true(t[0].ok && t[1].ok);
    for (int i = 0; i < 2; i++) { /* run_once reads 7 items, at least 3 of them in pool order */
        uint64_t pool, table;
        pkv__attn_item_counts(t[i].at, &pool, &table);
        assert_int_equal(pool + table, 20 * 7);
        assert_true(pool >= 20 * 3);
    }
    assert_memory_equal(t[0].dec, t[1].dec, sizeof t[0].dec);
    assert_memory_equal(t[0].pre, t[1].pre, sizeof t[0].pre);
    for (int i = 0; i < 2; i++) pkv__attn_destroy(t[i].at);
}

/* ---- the pool on its own ---- */
enum { POOL_JOBS = 3000, POOL_MAX_TASKS = 8 };
typedef struct pool_job {
    _Atomic int runs[POOL_MAX_TASKS];
    _Atomic int closed;     /* set when pkv__tpool_run returned */
    _Atomic int late;       /* a task ran after that */
    _Atomic int bad_tid;
    uint32_t n_threads;
} pool_job;
static pool_job g_jobs[POOL_JOBS];

static void pool_task(void *ctx, uint32_t task, uint32_t tid) {
    pool_job *j = ctx;
    if (tid >= j->n_threads) atomic_store(&j->bad_tid, 1);
    if (task % 3 == 1) { /* some tasks take a while: the others are shared out meanwhile */
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&j->runs[task], 1);
    if (atomic_load(&j->closed)) atomic_store(&j->late, 1);
}

static void test_thr_pool_tasks_once(void **state) {
    (void)state;
    static pkv__tpool_worker workers[3];
    /* the workers' poll after a job (pkv_config.spin_us): none (they sleep after every job), the
       default, and longer than the pauses below (they never sleep) */
    static const uint32_t spins[] = {0, PKV__SPIN_US_DEFAULT, 5000};
    for (size_t k = 0; k < sizeof spins / sizeof spins[0]; k++) {
        memset(g_jobs, 0, sizeof g_jobs);
        pkv__tpool p;
        assert_int_equal(pkv__tpool_init(&p, 3, workers, NULL, spins[k]), PKV_OK);
        for (uint32_t i = 0; i < POOL_JOBS; i++) {
            pool_job *j = &g_jobs[i];
            const uint32_t n = 1 + (i * 7 + i / 5) % POOL_MAX_TASKS;
            j->n_threads = 3;
            if (i % 50 == 49) { /* past the default spin: they sleep, and the next job must wake them */
                struct timespec ts = {0, 200000};
                nanosleep(&ts, NULL);
            }
            pkv__tpool_run(&p, pool_task, j, n);
            atomic_store(&j->closed, 1);
            for (uint32_t t = 0; t < POOL_MAX_TASKS; t++) assert_int_equal(atomic_load(&j->runs[t]), t < n ? 1 : 0);
        }
        pkv__tpool_fini(&p);
        for (uint32_t i = 0; i < POOL_JOBS; i++) { /* after fini no worker is left to run anything */
            assert_int_equal(atomic_load(&g_jobs[i].late), 0);
            assert_int_equal(atomic_load(&g_jobs[i].bad_tid), 0);
        }
    }
}

static void count_task(void *ctx, uint32_t task, uint32_t tid) {
    (void)task, (void)tid;
    atomic_fetch_add((_Atomic uint32_t *)ctx, 1);
}

/* The poll between jobs is the one asked for (pkv_config.spin_us): jobs of two quick tasks on a
 * pool of two threads, a 2 ms pause before every 4th. Polling 50 us, the worker sleeps in
 * about every pause; polling 5 ms, in none (its time preempted does not count: attn_pool.c). */
static void test_thr_pool_poll(void **state) {
    (void)state;
    enum { JOBS = 400, EVERY = 4 };
    static pkv__tpool_worker workers[2];
    static const uint32_t spins[] = {PKV__SPIN_US_DEFAULT, 5000};
    uint64_t sleeps[2];
    for (size_t k = 0; k < 2; k++) {
        pkv__tpool p;
        assert_int_equal(pkv__tpool_init(&p, 2, workers, NULL, spins[k]), PKV_OK);
        _Atomic uint32_t runs = 0;
        for (uint32_t i = 0; i < JOBS; i++) {
            if (i % EVERY == 0) {
                const struct timespec ts = {0, 2000000};
                nanosleep(&ts, NULL);
            }
            assert_int_equal(pkv__tpool_run(&p, count_task, (void *)&runs, 2), PKV_OK);
        }
        pkv__tpool_fini(&p);
        assert_int_equal(atomic_load(&runs), 2 * JOBS);
        sleeps[k] = atomic_load(&p.n_sleeps);
    }
    if (sleeps[0] < JOBS / EVERY / 4 || sleeps[1] * 4 >= sleeps[0])
        fail_msg("worker sleeps in %d pauses: %lu polling 50 us, %lu polling 5 ms", JOBS / EVERY,
                 (unsigned long)sleeps[0], (unsigned long)sleeps[1]);
}

/* ---- a caller's executor (pkv_executor): an engine's own pool of pthreads ----
 * Its threads are the worker indexes; the calling thread hands the calls out and waits. */
enum { EXEC_MAX = 4 };
typedef struct test_exec {
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_t th[EXEC_MAX];
    uint32_t n, started;
    uint64_t gen;
    int stop;
    pkv_task_fn fn; /* the current parallel_for: calls [next, n_calls) not yet handed out */
    void *job;
    uint32_t n_calls, next, done;
    uint64_t n_jobs; /* parallel_for calls so far */
} test_exec;

typedef struct exec_arg {
    test_exec *x;
    uint32_t w;
} exec_arg;
static exec_arg g_exec_args[EXEC_MAX];

static void *exec_thread(void *arg) {
    const exec_arg *a = arg;
    test_exec *x = a->x;
    uint64_t seen = 0;
    pthread_mutex_lock(&x->mu);
    for (;;) {
        while (x->gen == seen && !x->stop) pthread_cond_wait(&x->cv_work, &x->mu);
        if (x->stop) break;
        seen = x->gen;
        while (x->next < x->n_calls) {
            const uint32_t i = x->next++;
            pkv_task_fn fn = x->fn;
            void *job = x->job;
            pthread_mutex_unlock(&x->mu);
            fn(job, i, a->w);
            pthread_mutex_lock(&x->mu);
            if (++x->done == x->n_calls) pthread_cond_signal(&x->cv_done);
        }
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

static void exec_parallel_for(void *ctx, pkv_task_fn fn, void *job, uint32_t n) {
    test_exec *x = ctx;
    pthread_mutex_lock(&x->mu);
    x->fn = fn, x->job = job, x->n_calls = n, x->next = 0, x->done = 0;
    x->gen++;
    x->n_jobs++;
    pthread_cond_broadcast(&x->cv_work);
    while (x->done < n) pthread_cond_wait(&x->cv_done, &x->mu);
    pthread_mutex_unlock(&x->mu);
}

static void exec_start(test_exec *x, uint32_t n) {
    memset(x, 0, sizeof *x);
    x->n = n;
    assert_int_equal(pthread_mutex_init(&x->mu, NULL), 0);
    assert_int_equal(pthread_cond_init(&x->cv_work, NULL), 0);
    assert_int_equal(pthread_cond_init(&x->cv_done, NULL), 0);
    for (uint32_t i = 0; i < n; i++) {
        g_exec_args[i] = (exec_arg){.x = x, .w = i};
        assert_int_equal(pthread_create(&x->th[i], NULL, exec_thread, &g_exec_args[i]), 0);
    }
}

static void exec_stop(test_exec *x) {
    pthread_mutex_lock(&x->mu);
    x->stop = 1;
    pthread_cond_broadcast(&x->cv_work);
    pthread_mutex_unlock(&x->mu);
    for (uint32_t i = 0; i < x->n; i++) assert_int_equal(pthread_join(x->th[i], NULL), 0);
    pthread_cond_destroy(&x->cv_done);
    pthread_cond_destroy(&x->cv_work);
    pthread_mutex_destroy(&x->mu);
}

static pkv_executor executor_of(test_exec *x) {
    return (pkv_executor){.parallel_for = exec_parallel_for, .ctx = x, .n_workers = x->n};
}

/* The pool on an executor: every task of every job once, with a worker index in range, none
 * after its job returned; no threads of the pool's own. */
static void test_thr_pool_executor(void **state) {
    (void)state;
    static test_exec x;
    static pkv__tpool_worker workers[3];
    exec_start(&x, 3);
    const pkv_executor e = executor_of(&x);
    pkv__tpool p;
    assert_int_equal(pkv__tpool_init(&p, e.n_workers, workers, &e, PKV__SPIN_US_DEFAULT), PKV_OK);
    assert_int_equal(p.n_threads, 3);
    memset(g_jobs, 0, sizeof g_jobs);
    uint64_t multi = 0;
    for (uint32_t i = 0; i < POOL_JOBS / 3; i++) {
        pool_job *j = &g_jobs[i];
        const uint32_t n = 1 + (i * 7 + i / 5) % POOL_MAX_TASKS;
        j->n_threads = 3;
        assert_int_equal(pkv__tpool_run(&p, pool_task, j, n), PKV_OK);
        atomic_store(&j->closed, 1);
        multi += n > 1;
        for (uint32_t t = 0; t < POOL_MAX_TASKS; t++) assert_int_equal(atomic_load(&j->runs[t]), t < n ? 1 : 0);
    }
    pkv__tpool_fini(&p);
    assert_int_equal(x.n_jobs, multi); /* a job of one task runs on the caller */
    exec_stop(&x);
    for (uint32_t i = 0; i < POOL_JOBS / 3; i++) {
        assert_int_equal(atomic_load(&g_jobs[i].late), 0);
        assert_int_equal(atomic_load(&g_jobs[i].bad_tid), 0);
    }
}

/* Attention on an executor of 3 threads: the same results, bit for bit, as on a context with
 * 3 threads of its own (the plan depends on the thread count only), call after call. */
static void test_thr_attn_executor(void **state) {
    (void)state;
    fill();
    static test_exec x;
    static float d3[3 * NQH * D], p3[47 * NQH * D], dx[3 * NQH * D], px[47 * NQH * D];
    exec_start(&x, 3);
    pkv__attn_limits lim = {.max_items = 4, .max_blocks_per_seq = NB, .n_kv_heads = H, .head_dim = D,
                            .block_tokens = B, .exec = executor_of(&x)};
    pkv__attn *ex = NULL, *own = make(3);
    assert_int_equal(pkv__attn_create(NULL, 0, &lim, &ex), PKV_OK);
    assert_int_equal(pkv__attn_n_threads(ex), 3);
    pkv__attn_set_inline_work(ex, 0);
    for (int it = 0; it < 40; it++) {
        const uint32_t len = 41 + (uint32_t)(it * 131) % (LEN - 41);
        run_once(own, d3, p3, len);
        const uint64_t jobs0 = x.n_jobs;
        run_once(ex, dx, px, len);
        assert_true(x.n_jobs > jobs0);
        assert_memory_equal(d3, dx, sizeof d3);
        assert_memory_equal(p3, px, sizeof p3);
    }
    pkv__attn_destroy(ex);
    pkv__attn_destroy(own);
    exec_stop(&x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_thr_back_to_back),
        cmocka_unit_test(test_thr_create_destroy),
        cmocka_unit_test(test_thr_two_contexts),
        cmocka_unit_test(test_thr_pool_tasks_once),
        cmocka_unit_test(test_thr_pool_poll),
        cmocka_unit_test(test_thr_pool_executor),
        cmocka_unit_test(test_thr_attn_executor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
