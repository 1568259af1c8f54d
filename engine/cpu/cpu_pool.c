/* SPDX-License-Identifier: MIT */
/* A fixed pool of worker threads for the CPU backend's big matrix-vector products. The caller runs
 * part 0 itself and waits for the others; nothing is allocated after create. Splitting rows among
 * threads never changes a row's arithmetic, so results are bitwise those of one thread. */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/error.h"

struct worker {
    struct dsv4_cpu_pool *pool;
    int part;
};

struct dsv4_cpu_pool {
    int n;                          /* parts: the caller plus n-1 workers */
    pthread_t *threads;             /* [n-1] */
    struct worker *workers;         /* [n-1] */
    int started;                    /* workers running, for teardown after a failed create */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    uint64_t generation;            /* bumped for each job */
    int remaining;                  /* workers yet to finish the current job */
    bool stop;
    void (*fn)(void *arg, int part, int nparts);
    void *arg;
    float *rows;                    /* [n, max_in] per-part row scratch */
    int64_t max_in;
};

static void *work_loop(void *p)
{
    struct worker *w = p;
    struct dsv4_cpu_pool *pool = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->generation == seen && !pool->stop)
            pthread_cond_wait(&pool->start, &pool->mu);
        if (pool->stop)
            break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->mu);
        pool->fn(pool->arg, w->part, pool->n);
        pthread_mutex_lock(&pool->mu);
        if (--pool->remaining == 0)
            pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

void dsv4_cpu_pool_free(struct dsv4_cpu_pool *pool)
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
    free(pool->rows);
    free(pool);
}

int dsv4_cpu_pool_create(int threads, int64_t max_in, struct dsv4_cpu_pool **ret)
{
    if (threads < 1 || threads > DSV4_CPU_MAX_THREADS)
        return dsv4_error_set(-EINVAL, "threads %d is outside [1, %d]", threads, DSV4_CPU_MAX_THREADS);
    struct dsv4_cpu_pool *pool = calloc(1, sizeof(*pool));
    if (!pool)
        return dsv4_error_set(-ENOMEM, "out of memory for a thread pool");
    pool->n = threads;
    pool->max_in = max_in;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->start, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->threads = calloc((size_t)threads, sizeof(*pool->threads));
    pool->workers = calloc((size_t)threads, sizeof(*pool->workers));
    pool->rows = calloc((size_t)threads * (size_t)max_in, sizeof(float));
    if (!pool->threads || !pool->workers || !pool->rows) {
        dsv4_cpu_pool_free(pool);
        return dsv4_error_set(-ENOMEM, "out of memory for a thread pool of %d", threads);
    }
    for (int i = 0; i < threads - 1; i++) {
        pool->workers[i] = (struct worker){.pool = pool, .part = i + 1};
        int rc = pthread_create(&pool->threads[i], NULL, work_loop, &pool->workers[i]);
        if (rc) {
            dsv4_cpu_pool_free(pool);
            return dsv4_error_set(-rc, "starting CPU worker thread %d of %d: %s", i + 1, threads, strerror(rc));
        }
        pool->started = i + 1;
    }
    *ret = pool;
    return 0;
}

int dsv4_cpu_pool_size(const struct dsv4_cpu_pool *pool)
{
    return pool ? pool->n : 1;
}

float *dsv4_cpu_pool_row(const struct dsv4_cpu_pool *pool, int part)
{
    return pool->rows + (size_t)part * (size_t)pool->max_in;
}

void dsv4_cpu_pool_run(struct dsv4_cpu_pool *pool, void (*fn)(void *arg, int part, int nparts), void *arg)
{
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->arg = arg;
    pool->remaining = pool->n - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mu);
    fn(arg, 0, pool->n);
    pthread_mutex_lock(&pool->mu);
    while (pool->remaining > 0)
        pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
}
