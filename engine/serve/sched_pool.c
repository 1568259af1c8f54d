/* SPDX-License-Identifier: MIT */
/* The sampling pool (engine/serve/sched_internal.h): a decode step's rows sampled on the host by every
 * part of the scheduler's work pool, then taken in order; or sampled on the device by the backend. */
#include "build-config.h"

#include <stdatomic.h>
#include <stdio.h>

#include "engine/error.h"
#include "engine/serve/sched_internal.h"
#include "engine/workpool.h"

/* Sample row k of the decode step (request dec_reqs[k], logits row k) with the given workspace. */
static void sample_decode_row(struct dsv4_sched *s, struct dsv4_sampler *sm, int k)
{
    const struct sched_req *q = &s->reqs[s->dec_reqs[k]];
    s->row_rc[k] = sched_draw(s, sm, q, s->logits + (size_t)k * (size_t)s->vocab, &s->row_sample[k]);
    if (s->row_rc[k] < 0)
        snprintf(s->row_err[k], DSV4_SCHED_ERROR_MAX, "sampling: %s", dsv4_error_message());
}

/* One part of the pool: rows claimed one at a time (their costs differ with truncation and
 * penalties), each sampled with this part's own workspace. */
static void pool_part(void *arg, int part, int parts)
{
    struct dsv4_sched *s = arg;
    int k;
    (void)parts;
    while ((k = atomic_fetch_add(&s->pool_next, 1)) < s->pool_rows)
        sample_decode_row(s, s->samplers[part], k);
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
    const uint64_t t0 = sched_now_ns();
    int r = s->backend->ops->sample(s->backend, n, s->sreq, s->row_sample, s->row_rc, s->smsg);
    sched_backend_time(s, t0);
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

/* Sample the decode step's n rows into row_sample/row_rc, on every part of the pool. */
void sched_sample_decode_rows(struct dsv4_sched *s, int n)
{
    if (n < 2) {
        for (int k = 0; k < n; k++)
            sample_decode_row(s, s->samplers[0], k);
        return;
    }
    s->pool_rows = n;
    atomic_store(&s->pool_next, 0);
    dsv4_workpool_run(s->pool, pool_part, s);
}
