/* attn_pool.h: the attention context's fixed thread pool: n - 1 workers created once, woken
 * per job, plus the calling thread. Jobs are "run task(ctx, i, tid) for i in [0, n_tasks)"
 * with tasks handed out in index order from one atomic ticket. A job ends when its tasks are
 * done, not when every worker has reported in: a worker that wakes late (a VM can take
 * milliseconds to run an idle vCPU again) finds nothing left and goes back to sleep, and the
 * caller, which takes tasks too, never waits for it.
 * With a caller's executor (pkv_executor) the pool starts no threads: a job is one
 * parallel_for of min(n_tasks, n_threads) calls, each taking tasks from the same ticket until
 * none is left, as the worker of the index the executor gave it (tid).
 * In a child process (fork) the workers do not exist: there, jobs run on the calling thread
 * alone (the same results: the executor contract's serial loop), and fini only marks the pool
 * done (the parent's threads may have left its mutex and condition variables in use). */
#ifndef PKV_ATTN_POOL_H
#define PKV_ATTN_POOL_H

#include "../core/core.h"

#include <pthread.h>
#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define pkv__cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define pkv__cpu_relax() __asm__ volatile("yield" ::: "memory")
#else
#define pkv__cpu_relax() ((void)0)
#endif

typedef void (*pkv__task_fn)(void *ctx, uint32_t task, uint32_t tid);

typedef struct pkv__tpool_worker {
    struct pkv__tpool *pool;
    pthread_t thread;
    uint32_t tid;
    _Atomic uint32_t busy; /* executor: 1 while a call runs as this worker index */
} pkv__tpool_worker;

typedef struct pkv__tpool {
    uint32_t n_threads;           /* including the caller (tid 0) */
    uint32_t fork_gen;            /* the process's fork count when the workers started (attn_pool.c) */
    uint64_t spin_ns;             /* a worker's poll for the next job once one is over */
    pkv__tpool_worker *workers;   /* [n_threads - 1], tids 1.. */
    pthread_mutex_t mu;
    pthread_cond_t cv_work;       /* workers sleep here for a new generation */
    pthread_cond_t cv_done;       /* the caller sleeps here for the last task */
    _Atomic uint64_t gen;         /* wake-ups: bumped (release) after a job is published */
    /* The current job's (n_tasks << 32 | next task): a thread claims task i by moving it from
     * (n, i) to (n, i + 1) with a compare-and-swap, so it can only take an unclaimed task of the
     * job that is current (a stale value fails the swap). */
    _Atomic uint64_t ticket;
    _Atomic uint32_t n_done;      /* tasks of the current job finished */
    _Atomic int stop;
    /* The current job: written by the caller before its release store of ticket, read by a
     * thread after a successful claim; not touched again until every task is done. */
    pkv__task_fn fn;
    void *ctx;
    pkv_executor exec;          /* exec.parallel_for: the caller's executor; no workers then */
    _Atomic uint32_t exec_bad;  /* the executor broke its contract in the current job */
    _Atomic uint64_t n_sleeps;  /* times a worker went to sleep between jobs (tests) */
} pkv__tpool;

/* Starts n_threads - 1 workers, or none when exec (may be NULL) has a parallel_for: its jobs
 * then run on it, and n_threads must be its n_workers. workers[] storage is given by the
 * caller, n_threads entries. spin_us: how long a worker polls for the next job once one is over
 * (pkv_config.spin_us). Returns 0 or PKV_ENOMEM (threads could not be created; none left
 * running). */
int pkv__tpool_init(pkv__tpool *p, uint32_t n_threads, pkv__tpool_worker *workers, const pkv_executor *exec,
                    uint32_t spin_us);
void pkv__tpool_fini(pkv__tpool *p);
/* Runs the job to completion; the caller takes part as tid 0, the workers that are awake
 * share the tasks with it. Returns 0 when every task is done, or PKV_EINVAL when a caller's
 * executor broke its contract (a worker index out of range or in use by a running call, or
 * returning with tasks left): some tasks have then not run. */
int pkv__tpool_run(pkv__tpool *p, pkv__task_fn fn, void *ctx, uint32_t n_tasks);

#endif
