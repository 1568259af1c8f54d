/* SPDX-License-Identifier: MIT */
/* The sampling pool (engine/serve/sched_internal.h): a decode step's rows sampled on the host by every
 * pool thread, then taken in order; or sampled on the device by the backend. */
#include "build-config.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/error.h"
#include "engine/serve/sched_internal.h"

/* Sample row k of the decode step (request dec_reqs[k], logits row k) with the given workspace. */
static void sample_decode_row(struct dsv4_sched *s, struct dsv4_sampler *sm, int k)
{
    const struct sched_req *q = &s->reqs[s->dec_reqs[k]];
    struct dsv4_sampler_history hist = {
        .counts = s->counts + (size_t)q->slot * (size_t)s->vocab,
        .seen = s->seen + (size_t)q->slot * s->seen_stride,
    };
    s->row_rc[k] = dsv4_sampler_sample(sm, &q->sampling, s->logits + (size_t)k * (size_t)s->vocab, &hist,
                                       q->seed, (uint64_t)q->result.n_tokens, &s->row_sample[k]);
    if (s->row_rc[k] < 0)
        snprintf(s->row_err[k], DSV4_SCHED_ERROR_MAX, "sampling: %s", dsv4_error_message());
}

static void pool_work(struct dsv4_sched *s, struct dsv4_sampler *sm)
{
    int k;
    while ((k = atomic_fetch_add(&s->pool_next, 1)) < s->pool_rows)
        sample_decode_row(s, sm, k);
}

void *sched_pool_worker(void *arg)
{
    struct dsv4_sched *s = ((struct pool_arg *)arg)->s;
    int index = ((struct pool_arg *)arg)->index;
    uint64_t seen = 0;
    free(arg);
    pthread_mutex_lock(&s->pool_lock);
    for (;;) {
        while (s->pool_gen == seen && !s->pool_quit)
            pthread_cond_wait(&s->pool_go, &s->pool_lock);
        if (s->pool_quit)
            break;
        seen = s->pool_gen;
        pthread_mutex_unlock(&s->pool_lock);
        pool_work(s, s->samplers[index]);
        pthread_mutex_lock(&s->pool_lock);
        if (++s->pool_finished == s->n_workers)
            pthread_cond_signal(&s->pool_done);
    }
    pthread_mutex_unlock(&s->pool_lock);
    return NULL;
}

/* Device sampling of rows [0, n): request reqs[k] (running-list indices) for row k of the call just
 * made, into row_sample/row_rc/row_err (a failure of the whole call fails every row). Returns true
 * when the backend failed for good (sched_backend_fatal: every running request has ended). */
bool sched_sample_on_device(struct dsv4_sched *s, int n, const int *reqs)
{
    for (int k = 0; k < n; k++) {
        const struct sched_req *q = &s->reqs[reqs[k]];
        s->sreq[k] = (struct dsv4_backend_sample_req){ .slot = q->slot, .params = &q->sampling, .seed = q->seed,
                                                       .index = (uint64_t)q->result.n_tokens };
    }
    int r = s->backend->ops->sample(s->backend, n, s->sreq, s->row_sample, s->row_rc, s->smsg);
    if (sched_backend_fatal(s, r, "sampling"))
        return true;
    for (int k = 0; k < n; k++) {
        if (r < 0)
            s->row_rc[k] = r;
        if (s->row_rc[k] < 0)
            snprintf(s->row_err[k], DSV4_SCHED_ERROR_MAX, "sampling: %s",
                     r < 0 ? dsv4_error_message() : s->smsg + (size_t)k * DSV4_BACKEND_MSG_MAX);
    }
    return false;
}

/* Sample the decode step's n rows into row_sample/row_rc, on every pool thread. */
void sched_sample_decode_rows(struct dsv4_sched *s, int n)
{
    if (s->n_workers == 0 || n < 2) {
        for (int k = 0; k < n; k++)
            sample_decode_row(s, s->samplers[0], k);
        return;
    }
    pthread_mutex_lock(&s->pool_lock);
    s->pool_rows = n;
    atomic_store(&s->pool_next, 0);
    s->pool_finished = 0;
    s->pool_gen++;
    pthread_cond_broadcast(&s->pool_go);
    pthread_mutex_unlock(&s->pool_lock);
    pool_work(s, s->samplers[0]);
    pthread_mutex_lock(&s->pool_lock);
    while (s->pool_finished < s->n_workers)
        pthread_cond_wait(&s->pool_done, &s->pool_lock);
    pthread_mutex_unlock(&s->pool_lock);
}
