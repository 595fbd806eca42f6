/* attn_pool.c: fixed pthread pool of the attention context: workers spin while the job they
 * took part in is still running elsewhere and briefly after it for the next one (decode calls
 * come back-to-back), then sleep on a condition variable. Tasks are claimed
 * from one ticket (attn_pool.h); a job is over when its tasks are done. */
#include "attn_pool.h"

/* How many times this process is a fork child of the one before (a pthread_atfork handler in
 * the child counts them): a pool made at another count is another process's, its workers not
 * here. (A count, not getpid(): no system call a job, and a pid the kernel reuses for a later
 * descendant cannot pass for the creator's.) */
static _Atomic uint32_t g_forks;
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static void on_fork_child(void) { atomic_fetch_add_explicit(&g_forks, 1, memory_order_relaxed); }
static void atfork_init(void) { (void)pthread_atfork(NULL, NULL, on_fork_child); }

/* How long a thread spins at least while the job it worked on runs on elsewhere (below). Once
 * the job is over, a worker spins for the pool's spin_ns (pkv_config.spin_us: 50 us by
 * default, long enough to bridge consecutive calls of one decode step, short enough not to
 * steal a shared core for long) before it sleeps. */
#define SPIN_NS 50000u
/* While the job a thread took part in is still running on other threads (it ran out of tasks
 * first: the caller waiting for the job's end, a worker for the next job, which cannot come
 * before it), the thread spins for as long as it worked on the job itself, at least SPIN_NS
 * and at most SPIN_JOB_MAX_NS: the others' tasks began with its own and are about as long, so
 * the job is then likely to end soon, and a thread that slept instead would add a wake-up to
 * the call (the caller's) or to the next one (a worker's). On the Xeon VM of stop 96 such a
 * wake-up cost about a quarter of a 2-thread decode of one 4096-token sequence: f16, 16 MiB a
 * call, 14.1-14.5 GB/s with the 50 us spin alone, 17.8-18.5 with this (docs/design.md). A
 * thread whose partner was preempted still sleeps after the bound. */
#define SPIN_JOB_MAX_NS 2000000u

/* The spin bound of a thread that worked busy_ns on a job still in flight (above), or the pool's
 * poll after a job where that is longer, up to SPIN_JOB_MAX_NS: a caller that asked for a
 * longer poll between jobs wants no wake-up within one either, but a thread whose partner was
 * preempted still sleeps after 2 ms. */
static uint64_t job_spin_ns(const pkv__tpool *p, uint64_t busy_ns) {
    return PKV_MIN(PKV_MAX(PKV_MAX(busy_ns, (uint64_t)SPIN_NS), p->spin_ns), (uint64_t)SPIN_JOB_MAX_NS);
}

/* A thread's polling time: the clock's steps between two reads (64 polls apart, a few
 * microseconds), those over POLL_GAP_NS left out. Such a step is time the thread did not run
 * (preempted, or its vCPU descheduled), and the bounds on polling count polling: on a loaded
 * machine a bound on the wall clock ran out during a preemption, so a thread asked to poll for
 * 5 ms between jobs slept about as often as one polling 50 us (test_thr_pool_poll beside a
 * fuzzer and another test on 2 vCPUs: 260 sleeps against 262 in 100 pauses). */
#define POLL_GAP_NS 200000u
typedef struct poll_clock {
    uint64_t last, polled; /* the last read (0: none yet); the time counted */
} poll_clock;

static uint64_t poll_tick(poll_clock *c) {
    const uint64_t now = pkv__now_ns();
    if (c->last && now - c->last <= POLL_GAP_NS) c->polled += now - c->last;
    c->last = now;
    return c->polled;
}

/* Whether the current job has tasks not yet done (some claimed by other threads, or none
 * published: ticket and n_done both 0). */
static bool job_in_flight(pkv__tpool *p) {
    const uint32_t n = (uint32_t)(atomic_load_explicit(&p->ticket, memory_order_relaxed) >> 32);
    return atomic_load_explicit(&p->n_done, memory_order_relaxed) != n;
}

/* Claims the current job's next task: its index, or -1 when every task is taken; *n is the
 * claimed job's task count. */
static int64_t claim(pkv__tpool *p, uint32_t *n) {
    uint64_t v = atomic_load_explicit(&p->ticket, memory_order_acquire);
    for (;;) {
        const uint32_t i = (uint32_t)v;
        *n = (uint32_t)(v >> 32);
        if (i >= *n) return -1;
        if (atomic_compare_exchange_weak_explicit(&p->ticket, &v, v + 1, memory_order_acq_rel, memory_order_acquire))
            return i;
    }
}

/* Runs tasks until none is left to claim. fn and ctx are the claimed job's: read after the
 * claim, and that job cannot end (nor the next one be written) before this task is counted done. */
static void run_tasks(pkv__tpool *p, uint32_t tid) {
    uint32_t n;
    for (int64_t t; (t = claim(p, &n)) >= 0;) {
        p->fn(p->ctx, (uint32_t)t, tid);
        if (atomic_fetch_add_explicit(&p->n_done, 1, memory_order_acq_rel) + 1 == n && tid != 0) {
            pthread_mutex_lock(&p->mu); /* the job's last task: the caller may be asleep */
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

/* One call of a caller's executor: takes the job's tasks, as worker w, until none is left (the
 * executor's own index i is not used: the ticket hands the tasks out). */
static void exec_call(void *job, uint32_t i, uint32_t w) {
    (void)i;
    pkv__tpool *p = job;
    /* acquire: the scratch of w is ours after whichever call used it last */
    if (w >= p->n_threads || atomic_exchange_explicit(&p->workers[w].busy, 1, memory_order_acq_rel)) {
        atomic_store_explicit(&p->exec_bad, 1, memory_order_relaxed);
        return;
    }
    uint32_t n;
    for (int64_t t; (t = claim(p, &n)) >= 0;) {
        p->fn(p->ctx, (uint32_t)t, w);
        atomic_fetch_add_explicit(&p->n_done, 1, memory_order_release);
    }
    atomic_store_explicit(&p->workers[w].busy, 0, memory_order_release);
}

/* Waits until gen differs from seen; returns the new value (or seen when stopping). busy_ns:
 * how long this worker ran tasks of the job before (the spin bound while it is in flight). */
static uint64_t wait_gen(pkv__tpool *p, uint64_t seen, uint64_t busy_ns) {
    const uint64_t in_flight_ns = job_spin_ns(p, busy_ns);
    poll_clock pc = {0, 0};
    uint64_t t_over = UINT64_MAX; /* the polling time when the job was seen over */
    for (uint32_t i = 0;; i++) {
        uint64_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen || atomic_load_explicit(&p->stop, memory_order_acquire)) return g;
        pkv__cpu_relax();
        if ((i & 63) == 63) {
            const uint64_t t = poll_tick(&pc);
            if (t_over == UINT64_MAX && job_in_flight(p)) {
                if (t > in_flight_ns) break;
            } else if (t_over == UINT64_MAX) {
                t_over = t;
                if (!p->spin_ns) break; /* no poll between jobs */
            } else if (t - t_over >= p->spin_ns) {
                break;
            }
        }
    }
    uint64_t g;
    pthread_mutex_lock(&p->mu);
    for (bool first = true; (g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen &&
                            !atomic_load_explicit(&p->stop, memory_order_acquire);
         first = false) {
        if (first) atomic_fetch_add_explicit(&p->n_sleeps, 1, memory_order_relaxed);
        pthread_cond_wait(&p->cv_work, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *arg) {
    pkv__tpool_worker *w = arg;
    pkv__tpool *p = w->pool;
    uint64_t seen = 0, busy_ns = 0;
    for (;;) {
        seen = wait_gen(p, seen, busy_ns);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        const uint64_t t0 = pkv__now_ns();
        run_tasks(p, w->tid); /* may find the job (or several) already over: nothing to do */
        busy_ns = pkv__now_ns() - t0;
    }
    return NULL;
}

int pkv__tpool_init(pkv__tpool *p, uint32_t n_threads, pkv__tpool_worker *workers, const pkv_executor *exec,
                    uint32_t spin_us) {
    p->exec = exec && exec->parallel_for ? *exec : (pkv_executor){0};
    p->n_threads = n_threads;
    p->spin_ns = (uint64_t)spin_us * 1000u;
    pthread_once(&g_atfork_once, atfork_init);
    p->fork_gen = atomic_load_explicit(&g_forks, memory_order_relaxed);
    p->workers = workers;
    atomic_init(&p->gen, 0);
    atomic_init(&p->ticket, 0);
    atomic_init(&p->n_done, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->exec_bad, 0);
    atomic_init(&p->n_sleeps, 0);
    for (uint32_t i = 0; i < n_threads; i++) atomic_init(&workers[i].busy, 0);
    p->fn = NULL;
    p->ctx = NULL;
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
    for (uint32_t i = 0; !p->exec.parallel_for && i + 1 < n_threads; i++) {
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

/* Whether this is a child process of the one that made the pool (its workers are not here). */
static bool forked(const pkv__tpool *p) { return atomic_load_explicit(&g_forks, memory_order_relaxed) != p->fork_gen; }

void pkv__tpool_fini(pkv__tpool *p) {
    if (forked(p)) return; /* no workers to stop; mu and the cvs may hold the parent's waiters */
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 0; !p->exec.parallel_for && i + 1 < p->n_threads; i++) pthread_join(p->workers[i].thread, NULL);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_work);
    pthread_mutex_destroy(&p->mu);
}

/* A job on the caller's executor (pkv__tpool_run). */
static int run_exec(pkv__tpool *p, uint32_t n_tasks) {
    atomic_store_explicit(&p->exec_bad, 0, memory_order_relaxed);
    p->exec.parallel_for(p->exec.ctx, exec_call, p, PKV_MIN(n_tasks, p->n_threads));
    /* every call has returned (the contract): a task is done, or it was never claimed */
    if (atomic_load_explicit(&p->n_done, memory_order_acquire) == n_tasks &&
        !atomic_load_explicit(&p->exec_bad, memory_order_relaxed))
        return PKV_OK;
    atomic_store_explicit(&p->ticket, 0, memory_order_release); /* a late call finds nothing */
    return PKV_EINVAL;
}

int pkv__tpool_run(pkv__tpool *p, pkv__task_fn fn, void *ctx, uint32_t n_tasks) {
    if (p->n_threads <= 1 || n_tasks <= 1 || (!p->exec.parallel_for && forked(p))) {
        /* nothing to share (or, in a child process, no worker to share it with) */
        for (uint32_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return PKV_OK;
    }
    /* no task of the previous job is in flight: every one was counted done before it returned */
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->ticket, (uint64_t)n_tasks << 32, memory_order_release);
    if (p->exec.parallel_for) return run_exec(p, n_tasks);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    const uint64_t t_run = pkv__now_ns();
    run_tasks(p, 0);
    /* the tasks other threads still run: spin for up to job_spin_ns of this thread's share, then sleep */
    const uint64_t spin_ns = job_spin_ns(p, pkv__now_ns() - t_run);
    poll_clock pc = {0, 0};
    for (uint32_t i = 0; atomic_load_explicit(&p->n_done, memory_order_acquire) != n_tasks; i++) {
        pkv__cpu_relax();
        if ((i & 63) == 63 && poll_tick(&pc) > spin_ns) {
            pthread_mutex_lock(&p->mu);
            while (atomic_load_explicit(&p->n_done, memory_order_acquire) != n_tasks)
                pthread_cond_wait(&p->cv_done, &p->mu);
            pthread_mutex_unlock(&p->mu);
            break;
        }
    }
    return PKV_OK;
}
