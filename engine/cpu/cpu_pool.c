/* SPDX-License-Identifier: MIT */
/* The CPU backend's worker threads for its big matrix-vector products: a fork-join pool
 * (engine/workpool.h) and per-part row scratch, all made at create. Splitting rows among threads
 * never changes a row's arithmetic, so results are bitwise those of one thread. */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/error.h"
#include "engine/workpool.h"

struct dsv4_cpu_pool {
    struct dsv4_workpool *threads;
    float *rows;                    /* [parts, max_in] per-part row scratch */
    int64_t max_in;
};

void dsv4_cpu_pool_free(struct dsv4_cpu_pool *pool)
{
    if (!pool)
        return;
    dsv4_workpool_free(pool->threads);
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
    pool->max_in = max_in;
    pool->rows = calloc((size_t)threads * (size_t)max_in, sizeof(float));
    if (!pool->rows) {
        dsv4_cpu_pool_free(pool);
        return dsv4_error_set(-ENOMEM, "out of memory for the row scratch of %d CPU threads", threads);
    }
    int rc = dsv4_workpool_create(threads, "CPU worker", &pool->threads);
    if (rc < 0) {
        dsv4_cpu_pool_free(pool);
        return rc;
    }
    *ret = pool;
    return 0;
}

int dsv4_cpu_pool_size(const struct dsv4_cpu_pool *pool)
{
    return pool ? dsv4_workpool_parts(pool->threads) : 1;
}

float *dsv4_cpu_pool_row(const struct dsv4_cpu_pool *pool, int part)
{
    return pool->rows + (size_t)part * (size_t)pool->max_in;
}

void dsv4_cpu_pool_run(struct dsv4_cpu_pool *pool, void (*fn)(void *arg, int part, int nparts), void *arg)
{
    dsv4_workpool_run(pool->threads, fn, arg);
}
