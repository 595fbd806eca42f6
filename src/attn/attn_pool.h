/* attn_pool.h: the attention context's fixed thread pool: n - 1 workers created once, woken
 * per job, plus the calling thread. Jobs are "run task(ctx, i, tid) for i in [0, n_tasks)"
 * with tasks handed out by an atomic counter (work stealing in index order). */
#ifndef PKV_ATTN_POOL_H
#define PKV_ATTN_POOL_H

#include "../core/core.h"

#include <pthread.h>
#include <stdatomic.h>

typedef void (*pkv__task_fn)(void *ctx, uint32_t task, uint32_t tid);

typedef struct pkv__tpool_worker {
    struct pkv__tpool *pool;
    pthread_t thread;
    uint32_t tid;
} pkv__tpool_worker;

typedef struct pkv__tpool {
    uint32_t n_threads;           /* including the caller (tid 0) */
    pkv__tpool_worker *workers;   /* [n_threads - 1], tids 1.. */
    pthread_mutex_t mu;
    pthread_cond_t cv_work;       /* workers sleep here for a new generation */
    pthread_cond_t cv_done;       /* the caller sleeps here for the last worker */
    _Atomic uint64_t gen;         /* job generation: bumped (release) after the job is published */
    _Atomic uint32_t next;        /* next task index of the current job */
    _Atomic uint32_t n_done;      /* workers finished with the current generation */
    _Atomic int stop;
    /* The current job: written by the caller before the release bump of gen, read by
     * workers after they acquire gen; not touched again until every worker reported done. */
    pkv__task_fn fn;
    void *ctx;
    uint32_t n_tasks;
} pkv__tpool;

/* Starts n_threads - 1 workers (workers[] storage is given by the caller: n_threads - 1
 * entries). Returns 0 or PKV_ENOMEM (threads could not be created; none left running). */
int pkv__tpool_init(pkv__tpool *p, uint32_t n_threads, pkv__tpool_worker *workers);
void pkv__tpool_fini(pkv__tpool *p);
/* Runs the job to completion on all threads; the caller takes part as tid 0. */
void pkv__tpool_run(pkv__tpool *p, pkv__task_fn fn, void *ctx, uint32_t n_tasks);

#endif
