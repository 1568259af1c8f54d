/* SPDX-License-Identifier: MIT */
/* The fork-join pool of engine/workpool.h: a generation counter under one mutex tells the threads a
 * job is there (a thread that wakes late still sees the bump), a count of parts outstanding tells
 * the caller it is done. */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"
#include "engine/workpool.h"

struct worker {
    struct dsv4_workpool *pool;
    int part;
};

struct dsv4_workpool {
    int parts;                      /* the caller plus parts - 1 threads */
    pthread_t *threads;             /* [parts - 1] */
    struct worker *workers;         /* [parts - 1] */
    int started;                    /* threads running, for teardown after a failed create */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    uint64_t generation;            /* bumped for each job */
    int remaining;                  /* threads yet to finish the current job */
    bool stop;
    dsv4_work_fn fn;
    void *arg;
};

static void *work_loop(void *p)
{
    const struct worker *w = p;
    struct dsv4_workpool *pool = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->generation == seen && !pool->stop)
            pthread_cond_wait(&pool->start, &pool->mu);
        if (pool->stop)
            break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->mu);
        pool->fn(pool->arg, w->part, pool->parts);
        pthread_mutex_lock(&pool->mu);
        if (--pool->remaining == 0)
            pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

void dsv4_workpool_free(struct dsv4_workpool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = true;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->started; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->start);
    pthread_cond_destroy(&pool->done);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

int dsv4_workpool_create(int parts, const char *what, struct dsv4_workpool **ret)
{
    if (parts < 1 || parts > DSV4_WORKPOOL_MAX_PARTS)
        return dsv4_error_set(-EINVAL, "%s threads: %d is outside [1, %d]", what, parts, DSV4_WORKPOOL_MAX_PARTS);
    struct dsv4_workpool *pool = calloc(1, sizeof(*pool));
    if (!pool)
        return dsv4_error_set(-ENOMEM, "out of memory for a pool of %d %s threads", parts, what);
    pool->parts = parts;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->start, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->threads = calloc((size_t)parts, sizeof(*pool->threads));
    pool->workers = calloc((size_t)parts, sizeof(*pool->workers));
    if (!pool->threads || !pool->workers) {
        dsv4_workpool_free(pool);
        return dsv4_error_set(-ENOMEM, "out of memory for a pool of %d %s threads", parts, what);
    }
    for (int i = 0; i < parts - 1; i++) {
        pool->workers[i] = (struct worker){ .pool = pool, .part = i + 1 };
        int rc = pthread_create(&pool->threads[i], NULL, work_loop, &pool->workers[i]);
        if (rc) {
            dsv4_workpool_free(pool);
            return dsv4_error_set(-rc, "starting %s thread %d of %d: %s", what, i + 1, parts - 1, strerror(rc));
        }
        pool->started = i + 1;
    }
    *ret = pool;
    return 0;
}

int dsv4_workpool_parts(const struct dsv4_workpool *pool)
{
    return pool->parts;
}

int dsv4_workpool_allocations(const struct dsv4_workpool *pool)
{
    (void)pool;
    return 3;       /* the pool, its thread handles and their arguments */
}

void dsv4_workpool_run(struct dsv4_workpool *pool, dsv4_work_fn fn, void *arg)
{
    if (pool->parts == 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->arg = arg;
    pool->remaining = pool->parts - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mu);
    fn(arg, 0, pool->parts);
    pthread_mutex_lock(&pool->mu);
    while (pool->remaining > 0)
        pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
}
