/* SPDX-License-Identifier: MIT */
/* A fixed fork-join pool of threads: a job is split into `parts`; the caller runs part 0 itself,
 * the threads started at create run parts 1 .. parts - 1, and dsv4_workpool_run returns once every
 * part is done. Nothing is allocated after create and the threads sleep between jobs. One caller
 * at a time: the CPU backend's matrix products (engine/cpu/cpu_pool.c) and the scheduler's host
 * sampling (engine/serve/sched_pool.c) each own one. */
#ifndef DSV4_ENGINE_WORKPOOL_H
#define DSV4_ENGINE_WORKPOOL_H

#define DSV4_WORKPOOL_MAX_PARTS 1024

struct dsv4_workpool;

/* fn(arg, part, parts) for part in [0, parts); the parts of one job run concurrently. */
typedef void (*dsv4_work_fn)(void *arg, int part, int parts);

/* parts in [1, DSV4_WORKPOOL_MAX_PARTS] (1: no thread, the caller runs the whole job). -EINVAL,
 * -ENOMEM or the error of pthread_create, with a message naming `what` (for example "sampler"). */
int dsv4_workpool_create(int parts, const char *what, struct dsv4_workpool **ret);
void dsv4_workpool_free(struct dsv4_workpool *pool);     /* joins the threads; accepts NULL */
int dsv4_workpool_parts(const struct dsv4_workpool *pool);
/* Host allocations create made (the callers count theirs; none are made afterwards). */
int dsv4_workpool_allocations(const struct dsv4_workpool *pool);
void dsv4_workpool_run(struct dsv4_workpool *pool, dsv4_work_fn fn, void *arg);

#endif
