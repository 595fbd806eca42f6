/* attn_pool.c: fixed pthread pool of the attention context: workers spin briefly for the next
 * job (decode calls come back-to-back), then sleep on a condition variable. */
#include "attn_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

/* How long an idle thread spins before sleeping: long enough to bridge consecutive calls of
 * one decode step (layers), short enough not to steal a shared core for long. */
#define SPIN_NS 50000u

static void run_tasks(pkv__tpool *p, uint32_t tid) {
    const uint32_t n = p->n_tasks;
    for (;;) {
        uint32_t t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= n) break;
        p->fn(p->ctx, t, tid);
    }
}

/* Waits until gen differs from seen; returns the new value (or seen when stopping). */
static uint64_t wait_gen(pkv__tpool *p, uint64_t seen) {
    uint64_t t0 = 0;
    for (uint32_t i = 0;; i++) {
        uint64_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_acquire)) return g;
        cpu_relax();
        if ((i & 63) == 63) {
            uint64_t now = pkv__now_ns();
            if (!t0) t0 = now;
            else if (now - t0 > SPIN_NS) break;
        }
    }
    uint64_t g;
    pthread_mutex_lock(&p->mu);
    while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&p->stop, memory_order_acquire))
        pthread_cond_wait(&p->cv_work, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *arg) {
    pkv__tpool_worker *w = arg;
    pkv__tpool *p = w->pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = wait_gen(p, seen);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        seen = g;
        run_tasks(p, w->tid);
        /* The last worker to finish wakes the caller; the caller re-checks n_done under mu. */
        if (atomic_fetch_add_explicit(&p->n_done, 1, memory_order_acq_rel) + 1 == p->n_threads - 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

int pkv__tpool_init(pkv__tpool *p, uint32_t n_threads, pkv__tpool_worker *workers) {
    p->n_threads = n_threads;
    p->workers = workers;
    atomic_init(&p->gen, 0);
    atomic_init(&p->next, 0);
    atomic_init(&p->n_done, 0);
    atomic_init(&p->stop, 0);
    p->fn = NULL;
    p->ctx = NULL;
    p->n_tasks = 0;
    if (pthread_mutex_init(&p->mu, NULL)) return PKV_ENOMEM;
    if (pthread_cond_init(&p->cv_work, NULL)) {
        pthread_mutex_destroy(&p->mu);
        return PKV_ENOMEM;
    }
    if (pthread_cond_init(&p->cv_done, NULL)) {
        pthread_cond_destroy(&p->cv_work);
        pthread_mutex_destroy(&p->mu);
        return PKV_ENOMEM;
    }
    for (uint32_t i = 0; i + 1 < n_threads; i++) {
        workers[i].pool = p;
        workers[i].tid = i + 1;
        if (pthread_create(&workers[i].thread, NULL, worker_main, &workers[i])) {
            p->n_threads = i + 1; /* stop the ones already running */
            pkv__tpool_fini(p);
            return PKV_ENOMEM;
        }
    }
    return PKV_OK;
}

void pkv__tpool_fini(pkv__tpool *p) {
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i + 1 < p->n_threads; i++) pthread_join(p->workers[i].thread, NULL);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_work);
    pthread_mutex_destroy(&p->mu);
}

void pkv__tpool_run(pkv__tpool *p, pkv__task_fn fn, void *ctx, uint32_t n_tasks) {
    const uint32_t n_workers = p->n_threads - 1;
    if (n_workers == 0 || n_tasks <= 1) { /* nothing to share: skip the wake-up */
        for (uint32_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p, 0);
    uint64_t t0 = 0;
    for (uint32_t i = 0; atomic_load_explicit(&p->n_done, memory_order_acquire) != n_workers; i++) {
        cpu_relax();
        if ((i & 63) == 63) {
            uint64_t now = pkv__now_ns();
            if (!t0) t0 = now;
            else if (now - t0 > SPIN_NS) {
                pthread_mutex_lock(&p->mu);
                while (atomic_load_explicit(&p->n_done, memory_order_acquire) != n_workers)
                    pthread_cond_wait(&p->cv_done, &p->mu);
                pthread_mutex_unlock(&p->mu);
                break;
            }
        }
    }
}
