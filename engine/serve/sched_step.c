/* SPDX-License-Identifier: MIT */
/* The engine thread's step and loop (engine/serve/scheduler.h, sched_internal.h): admission, chunked
 * prefill within the step's budget, one batched decode (or a speculative one), sampling. */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "engine/error.h"
#include "engine/serve/sched_internal.h"

#define SCHED_RATE_WEIGHT 0.5       /* a new prefill chunk's share of the moving average of its rate */

/* The batch-size histogram's entry for n rows: 1, 2, 3-4, 5-8, ... (scheduler.h). */
static int batch_bucket(int n)
{
    int b = 0;
    while (b < DSV4_SCHED_BATCH_BUCKETS - 1 && n > (1 << b))
        b++;
    return b;
}

/* A free slot for an admitted request (one exists): the first free slot of the group with the fewest
 * occupied slots among those with room, ties to the lower group (doc/MULTIGPU.md, "Request
 * placement"); with one group, the first free slot. */
static int place(const struct dsv4_sched *s)
{
    int slot = -1, best_used = 0;
    for (int g = 0, begin = 0; g < s->n_groups; begin = s->group_end[g++]) {
        int used = 0, free_slot = -1;
        for (int i = begin; i < s->group_end[g]; i++) {
            if (s->slot_req[i] >= 0)
                used++;
            else if (free_slot < 0)
                free_slot = i;
        }
        if (free_slot >= 0 && (slot < 0 || used < best_used)) {
            slot = free_slot;
            best_used = used;
        }
    }
    return slot;
}

/* Under the lock: end cancelled (and, past a drain's grace, all) requests, then admit FIFO. */
static void admit(struct dsv4_sched *s, uint64_t t)
{
    bool past_grace = s->draining && t >= s->drain_deadline_ns;
    for (int k = 0; k < s->n_running; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (q->cancel || past_grace)
            sched_finish(s, q, DSV4_FINISH_CANCELLED, 0, NULL);
    }
    sched_unlink_finished(s);
    /* Queued requests that end without a slot use the room left after this step's reserve. */
    int room = s->n_events - s->ev_count - s->events_per_slot * s->max_batch;
    int prev = -1;
    for (int i = s->queue_head; i >= 0 && room > s->ev_staged;) {
        struct sched_req *q = &s->reqs[i];
        int next = q->next;
        if (q->cancel || s->draining || s->fatal) {
            enum dsv4_finish_reason why = s->fatal && !q->cancel ? DSV4_FINISH_ERROR : DSV4_FINISH_CANCELLED;
            if (prev >= 0)
                s->reqs[prev].next = next;
            else
                s->queue_head = next;
            if (s->queue_tail == i)
                s->queue_tail = prev;
            s->n_queued--;
            sched_finish(s, q, why, why == DSV4_FINISH_ERROR ? s->fatal : 0,
                   why == DSV4_FINISH_ERROR ? s->fatal_msg : NULL);
            q->done = false;
            q->state = REQ_FINISHED;
            s->st.finished[why]++;
            s->st.unreleased++;
        } else {
            prev = i;
        }
        i = next;
    }
    /* A cancelled request left at the head (no event room this step) ends next step; nothing else
     * can keep the head from a slot, since every slot and output buffer fits every request. */
    while (!s->draining && !s->fatal && s->queue_head >= 0 && !s->reqs[s->queue_head].cancel &&
           s->n_slots_used < s->max_batch && s->free_out >= 0) {
        int i = s->queue_head;
        struct sched_req *q = &s->reqs[i];
        s->queue_head = q->next;
        if (s->queue_head < 0)
            s->queue_tail = -1;
        s->n_queued--;
        const int slot = place(s);
        s->slot_req[slot] = i;
        s->n_slots_used++;
        q->slot = slot;
        q->out = s->free_out;
        s->free_out = s->outs[q->out].next_free;
        q->state = REQ_RUNNING;
        q->next = -1;
        q->result.timings.admit_ns = t;
        s->running[s->n_running++] = i;
    }
}

/* The step's prefill tokens (scheduler.h): the budget, or while streams decode and decode_stall_ms is
 * set, what the measured prefill rate fits in that time. */
static int step_prefill_budget(const struct dsv4_sched *s, int n_running)
{
    const int budget = s->lim.prefill_budget;
    bool decoding = false;

    if (!s->lim.decode_stall_ms)
        return budget;
    for (int k = 0; k < n_running && !decoding; k++)
        decoding = s->reqs[s->running[k]].generating;
    if (!decoding)
        return budget;
    /* No rate yet (every prompt so far was too short to measure one): the smallest chunk, which
     * measures it, rather than a whole budget the streams would wait for. */
    if (s->prefill_ns_per_token <= 0.0)
        return budget < DSV4_SCHED_STALL_MIN_TOKENS ? budget : DSV4_SCHED_STALL_MIN_TOKENS;
    const double fit = s->lim.decode_stall_ms * 1e6 / s->prefill_ns_per_token;
    return fit < DSV4_SCHED_STALL_MIN_TOKENS ? DSV4_SCHED_STALL_MIN_TOKENS : fit > budget ? budget : (int)fit;
}

/* Fold one prefill chunk's time into the rate; short chunks (a prompt's tail) are mostly fixed cost
 * and would overstate it. */
static void note_prefill_rate(struct dsv4_sched *s, int tokens, uint64_t ns)
{
    if (tokens < DSV4_SCHED_STALL_MIN_TOKENS)
        return;
    const double per = (double)ns / tokens;
    s->prefill_ns_per_token = s->prefill_ns_per_token > 0.0
                              ? s->prefill_ns_per_token + SCHED_RATE_WEIGHT * (per - s->prefill_ns_per_token) : per;
}

/* A prefill chunk of q while its blocks join the prefix cache: the slot's state can be kept only where
 * a chunk ends, so the chunk ends at the first boundary worth keeping that it would pass
 * (sched_prefix_hot: the prompt's last short of its last token, where the same prompt again resumes,
 * where the prompt leaves the cached chain, or the deepest the pool can hold); else it runs whole, and the blocks it completes join the cache where the slot next
 * stands on a boundary (sched_prefix_advance). */
static int cached_chunk(const struct dsv4_sched *s, const struct sched_req *q, int chunk)
{
    const int64_t p = q->position;
    for (int64_t b = (p / s->block + 1) * s->block; b < p + chunk; b += s->block)
        if (sched_prefix_hot(s, q, b))
            return (int)(b - p);
    return chunk;
}

int dsv4_sched_step(struct dsv4_sched *s)
{
    uint64_t t0 = sched_now_ns();
    pthread_mutex_lock(&s->lock);
    if (s->n_events - s->ev_count < s->events_per_slot * s->max_batch) {
        pthread_mutex_unlock(&s->lock);
        return -EAGAIN;
    }
    s->ev_staged = 0;
    s->step_generated = 0;
    s->step_backend_ns = 0;
    memset(&s->step_spec, 0, sizeof(s->step_spec));
    admit(s, t0);
    int n_running = s->n_running;
    pthread_mutex_unlock(&s->lock);

    /* Prefill: oldest first, within the budget. Only the running list's first n_running entries
     * are ours to read: submit never touches it. */
    struct dsv4_backend *b = s->backend;
    int budget = step_prefill_budget(s, n_running);
    int prefill_tokens = 0, prefill_chunks = 0;
    int r_restore;
    for (int k = 0; k < n_running; k++)
        s->reqs[s->running[k]].fresh = false;
    for (int k = 0; k < n_running && budget > 0 && !s->fatal; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (q->generating)
            continue;
        if (!q->cache_looked && (r_restore = sched_prefix_restore(s, q)) < 0) {
            if (sched_backend_fatal(s, r_restore, "restoring a cached prefix"))
                break;
            continue;
        }
        for (;;) {
            int left = q->n_prompt - q->n_prefilled;
            int chunk = left < budget ? left : budget;
            const int asked = chunk;
            if (q->caching)
                chunk = cached_chunk(s, q, chunk);
            bool last = chunk == left;
            float *lg = last && !s->device_sampling ? s->logits : NULL;
            const uint64_t tp = sched_now_ns();
            int r = b->ops->prefill(b, q->slot, q->prompt + q->n_prefilled, chunk, lg, false);
            const uint64_t ns = sched_backend_time(s, tp);
            if (r == 0)
                note_prefill_rate(s, chunk, ns);
            if (r < 0) {
                if (!sched_backend_fatal(s, r, "prefill"))
                    sched_fail_request(s, q, r, "prefill");
                break;
            }
            uint8_t *seen = s->seen + (size_t)q->slot * s->seen_stride;
            for (int i = q->n_prefilled; i < q->n_prefilled + chunk; i++)
                seen[q->prompt[i] / 8] |= (uint8_t)(1u << (q->prompt[i] % 8));
            q->n_prefilled += chunk;
            q->position += chunk;
            budget -= chunk;
            prefill_tokens += chunk;
            prefill_chunks++;
            if (q->caching)
                sched_prefix_advance(s, q);
            if (s->fatal)
                break;
            if (last) {
                q->generating = true;
                q->fresh = true;
                if (s->device_sampling) {
                    int ri = s->running[k];
                    if (sched_sample_on_device(s, 1, &ri))
                        break;
                    if (s->row_rc[0] < 0)
                        sched_finish(s, q, DSV4_FINISH_ERROR, s->row_rc[0], s->row_err[0]);
                    else
                        sched_take_token(s, q, &s->row_sample[0]);
                } else {
                    sched_sample_row(s, q, s->logits);
                }
                break;
            }
            if (budget == 0)
                break;
            /* The cache ended the chunk at a boundary worth keeping and less than a block of budget is
             * left: a call of those few rows would cost nearly a whole chunk's weight reads, so q goes
             * on from the boundary next step. Not when the rest of the prompt fits what is left: its
             * calls are the same now or next step, and waiting would only hold its first token back. */
            if (chunk < asked && budget < s->block && left - chunk > budget)
                break;
        }
    }

    /* One batched decode for the sequences that were generating when the step began. */
    int n = 0;
    for (int k = 0; k < n_running; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (q->state != REQ_RUNNING || !q->generating || q->fresh)
            continue;
        s->dec_reqs[n] = s->running[k];
        s->dec_slots[n] = q->slot;
        s->dec_tokens[n] = q->pending;
        n++;
    }
    if (n > 0 && !s->fatal && s->spec) {
        sched_spec_decode(s, n);
    } else if (n > 0 && !s->fatal) {
        const uint64_t tb = sched_now_ns();
        int r = b->ops->decode(b, n, s->dec_slots, s->dec_tokens, s->device_sampling ? NULL : s->logits);
        sched_backend_time(s, tb);
        if (sched_backend_fatal(s, r, "decode"))
            n = 0;
        else if (r >= 0 && s->device_sampling && sched_sample_on_device(s, n, s->dec_reqs))
            n = 0;
        else if (r >= 0 && !s->device_sampling)
            sched_sample_decode_rows(s, n);
        for (int k = 0; k < n; k++) {
            struct sched_req *q = &s->reqs[s->dec_reqs[k]];
            if (r < 0) {
                sched_fail_request(s, q, r, "decode");
                continue;
            }
            if (q->done)
                continue;   /* ended by a fatal backend error earlier in this loop */
            q->position++;
            if (q->caching)
                sched_prefix_advance(s, q);
            if (q->done)
                continue;
            if (s->row_rc[k] < 0)
                sched_finish(s, q, DSV4_FINISH_ERROR, s->row_rc[k], s->row_err[k]);
            else
                sched_take_token(s, q, &s->row_sample[k]);
        }
    }

    uint64_t t1 = sched_now_ns();
    bool worked = n_running > 0 || s->ev_staged > 0;
    /* The backend is the engine thread's: its counters are read here, handed out by get_stats. */
    struct dsv4_backend_stats bst;
    if (worked && b->ops->get_stats)
        b->ops->get_stats(b, &bst);
    pthread_mutex_lock(&s->lock);
    if (worked && b->ops->get_stats)
        s->st.backend = bst;
    if (worked && s->prefix)
        dsv4_prefix_cache_get_stats(s->prefix, &s->st.prefix);
    s->ev_count += s->ev_staged;
    s->ev_tail = (s->ev_tail + s->ev_staged) % s->n_events;
    bool any_events = s->ev_staged > 0;
    s->ev_staged = 0;
    sched_unlink_finished(s);
    s->st.generated_tokens += s->step_generated;
    if (worked) {
        s->st.steps++;
        s->st.prefill_tokens += (uint64_t)prefill_tokens;
        s->st.prefill_chunks += (uint64_t)prefill_chunks;
        if (n > 0) {
            s->st.decode_steps++;
            s->st.batch_hist[batch_bucket(n)]++;
            s->st.spec_steps += s->step_spec.steps;
            s->st.spec_drafted += s->step_spec.drafted;
            s->st.spec_accepted += s->step_spec.accepted;
            for (int a = 0; a <= DSV4_SPEC_TOKENS_MAX; a++)
                s->st.spec_accept_hist[a] += s->step_spec.hist[a];
        }
        s->busy_ns += t1 - t0;
        s->backend_ns += s->step_backend_ns;
        if (s->running_at_end)
            s->gap_ns += t0 - s->last_end_ns;
        s->st.last_step_s = (double)(t1 - t0) * 1e-9;
        if (s->st.last_step_s > s->st.max_step_s)
            s->st.max_step_s = s->st.last_step_s;
    }
    /* a step that leaves requests running is followed by another at once: the time until it starts
     * is the loop's (counted when it starts, so a wait for the event reader counts too) */
    s->running_at_end = worked && s->n_running > 0;
    s->last_end_ns = t1;
    pthread_mutex_unlock(&s->lock);
    if (any_events) {
        uint64_t one = 1;
        ssize_t wr = write(s->event_fd, &one, sizeof(one));
        (void)wr;   /* EAGAIN only when the counter is saturated: the reader is already woken */
    }
    if (s->fatal)
        return s->fatal;
    return worked ? 1 : 0;
}

int dsv4_sched_run(struct dsv4_sched *s)
{
    for (;;) {
        pthread_mutex_lock(&s->lock);
        uint64_t kick = s->kick;
        pthread_mutex_unlock(&s->lock);
        int r = dsv4_sched_step(s);
        if (r < 0 && r != -EAGAIN) {
            if (!s->fatal)
                return r;
            /* After a fatal backend error, step again until every queued request has ended too (as
             * the event ring makes room: wait as for a full ring). */
            pthread_mutex_lock(&s->lock);
            bool left = s->n_queued > 0 || s->n_running > 0;
            pthread_mutex_unlock(&s->lock);
            if (!left)
                return dsv4_error_set(r, "%s", s->fatal_msg);
            r = -EAGAIN;
        }
        pthread_mutex_lock(&s->lock);
        void (*between)(void *) = s->between;
        void *between_arg = s->between_arg;
        s->between = NULL;
        pthread_mutex_unlock(&s->lock);
        if (between)
            between(between_arg);
        pthread_mutex_lock(&s->lock);
        if (s->stop_asked || (s->draining && s->n_queued == 0 && s->n_running == 0)) {
            pthread_mutex_unlock(&s->lock);
            return 0;
        }
        /* Nothing could run (idle, every slot or output buffer taken, or the event ring full):
         * sleep until a call that may change that. A running request always makes progress. */
        if (r == -EAGAIN || (r == 0 && s->n_running == 0))
            while (s->kick == kick)
                pthread_cond_wait(&s->wake, &s->lock);
        pthread_mutex_unlock(&s->lock);
    }
}
