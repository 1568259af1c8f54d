/* SPDX-License-Identifier: MIT */
/* What a step hands back (engine/serve/sched_internal.h): tokens taken, stops detected, text repaired
 * and streamed, results and events staged, slots cleared. */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "base/utf8.h"
#include "engine/error.h"
#include "engine/serve/sched_internal.h"

/* UTF-8 repair as Rust's from_utf8_lossy (base/utf8.h scans). */
/* Append bytes in[0..n) to text (capacity cap) repaired; an incomplete sequence at the end is kept
 * in raw[] unless `final`, where it becomes one U+FFFD. Returns 0, or -1 when it would not fit
 * (*len is then unchanged: the caller treats it as the byte limit). */
static int utf8_append(char *text, size_t cap, size_t *len, const unsigned char *in, int n, bool final,
                       unsigned char *raw, int *n_raw)
{
    size_t w = *len, i = 0;

    *n_raw = 0;
    while (i < (size_t)n) {
        size_t used;
        enum dsv4_utf8_step st = dsv4_utf8_step(in + i, (size_t)n - i, &used);

        if (st == DSV4_UTF8_INCOMPLETE && !final) {
            memcpy(raw, in + i, used);      /* may still complete */
            *n_raw = (int)used;
        } else if (st == DSV4_UTF8_VALID) {
            if (w + used > cap)
                return -1;
            memcpy(text + w, in + i, used);
            w += used;
        } else {
            if (w + DSV4_UTF8_REPLACEMENT_LEN > cap)
                return -1;
            memcpy(text + w, DSV4_UTF8_REPLACEMENT, DSV4_UTF8_REPLACEMENT_LEN);
            w += DSV4_UTF8_REPLACEMENT_LEN;
        }
        i += used;
    }
    *len = w;
    return 0;
}

const double dsv4_sched_latency_bounds_s[DSV4_SCHED_LATENCY_BOUNDS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80,
};

static void latency_observe(struct dsv4_sched_latency *h, double v)
{
    int i = 0;
    while (i < DSV4_SCHED_LATENCY_BOUNDS && v > dsv4_sched_latency_bounds_s[i])
        i++;
    h->buckets[i]++;
    h->count++;
    h->sum_s += v;
}

/* Under the lock, once for each request that got a slot, as it leaves it (scheduler.h, stats). */
static void latency_observe_request(struct dsv4_sched *s, const struct dsv4_sched_result *res)
{
    const struct dsv4_sched_timings *tm = &res->timings;
    latency_observe(&s->st.queue, tm->queue_s);
    if (tm->first_token_ns)
        latency_observe(&s->st.ttft, (double)(tm->first_token_ns - tm->submit_ns) * 1e-9);
    if (res->completion_tokens >= 2)
        latency_observe(&s->st.tpot, tm->decode_s / (res->completion_tokens - 1));
    latency_observe(&s->st.e2e, (double)(tm->finish_ns - tm->submit_ns) * 1e-9);
}

/* ---- engine-thread side ---- */

struct dsv4_sched_event *sched_stage_event(struct dsv4_sched *s, enum dsv4_sched_event_type type,
                                            const struct sched_req *q)
{
    /* The caller reserved room: dsv4_sched_step() starts only with events_per_slot events a slot free. */
    int at = (s->ev_tail + s->ev_staged) % s->n_events;
    s->ev_staged++;
    struct dsv4_sched_event *e = &s->events[at];
    e->type = type;
    e->id = q->id;
    e->user = q->user;
    e->index = 0;
    e->delta_len = 0;
    e->result = NULL;
    return e;
}

/* Reset the slot in the backend and clear the penalty history the request wrote (engine thread;
 * the slot returns to the free set under the lock, in sched_unlink_finished()). */
void sched_clear_slot(struct dsv4_sched *s, struct sched_req *q)
{
    if (q->slot < 0)
        return;
    uint32_t *counts = s->counts + (size_t)q->slot * (size_t)s->vocab;
    uint8_t *seen = s->seen + (size_t)q->slot * s->seen_stride;
    for (int i = 0; i < q->n_prefilled; i++)
        seen[q->prompt[i] / 8] = 0;
    if (q->out >= 0)
        for (int i = 0; i < q->result.n_tokens; i++) {
            int32_t t = s->outs[q->out].tokens[i];
            counts[t] = 0;
            seen[t / 8] = 0;
        }
    if (s->prefix)
        dsv4_prefix_cache_release(s->prefix, q->cache_node);
    q->cache_node = DSV4_PREFIX_ROOT;
    q->caching = false;
    const uint64_t t0 = sched_now_ns();
    s->backend->ops->slot_reset(s->backend, q->slot);
    sched_backend_time(s, t0);
}

/* Under the lock: requests finished since the last call become FINISHED, free their slots and leave
 * the running list. */
void sched_unlink_finished(struct dsv4_sched *s)
{
    int w = 0;
    for (int k = 0; k < s->n_running; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (!q->done) {
            s->running[w++] = s->running[k];
            continue;
        }
        q->done = false;
        q->state = REQ_FINISHED;
        s->slot_req[q->slot] = -1;
        s->n_slots_used--;
        q->slot = -1;
        s->st.finished[q->result.finish]++;
        s->st.unreleased++;
        latency_observe_request(s, &q->result);
    }
    s->n_running = w;
}

/* End a request: flush its text, fill the result, reset its slot, stage its FINISH event. It becomes
 * FINISHED (slot free) under the lock: at once for a queued one, in sched_unlink_finished() for a running
 * one. Its record and output buffer wait for release(). */
void sched_finish(struct dsv4_sched *s, struct sched_req *q, enum dsv4_finish_reason why, int error,
                   const char *message)
{
    struct dsv4_sched_result *res = &q->result;
    uint64_t t = sched_now_ns();
    if (q->out >= 0 && q->n_raw) {
        /* an incomplete sequence left by a cancel or error: U+FFFD if it fits, else dropped */
        unsigned char raw[4];
        int n_raw;
        utf8_append(s->outs[q->out].text, (size_t)s->lim.max_output_bytes, &res->text_len, q->raw,
                    q->n_raw, true, raw, &n_raw);
        q->n_raw = 0;
    }
    if (q->out >= 0) {
        s->outs[q->out].text[res->text_len] = '\0';
        res->text = s->outs[q->out].text;
        res->tokens = s->outs[q->out].tokens;
    } else {
        res->text = "";
        res->tokens = NULL;
    }
    res->finish = why;
    res->error = error;
    if (message)
        snprintf(res->error_message, sizeof(res->error_message), "%s", message);
    res->completion_tokens = res->n_tokens;
    struct dsv4_sched_timings *tm = &res->timings;
    tm->finish_ns = t;
    if (tm->admit_ns)
        tm->queue_s = (double)(tm->admit_ns - tm->submit_ns) * 1e-9;
    else
        tm->queue_s = (double)(t - tm->submit_ns) * 1e-9;
    if (tm->first_token_ns) {
        tm->prefill_s = (double)(tm->first_token_ns - tm->admit_ns) * 1e-9;
        tm->decode_s = (double)(t - tm->first_token_ns) * 1e-9;
        if (tm->decode_s > 0 && res->n_tokens > 1)
            tm->decode_tokens_per_s = (double)(res->n_tokens - 1) / tm->decode_s;
    } else if (tm->admit_ns) {
        tm->prefill_s = (double)(t - tm->admit_ns) * 1e-9;
    }
    sched_clear_slot(s, q);
    struct dsv4_sched_event *e = sched_stage_event(s, DSV4_SCHED_EVENT_FINISH, q);
    e->result = res;
    q->done = true;
}

/* Earliest stop-string match that ends after `from` (bytes before it were checked already):
 * returns its start and sets *which, or -1. */
static int64_t find_stop(const struct sched_req *q, const char *text, size_t len, size_t from, int *which)
{
    int64_t best = -1;
    for (int k = 0; k < q->n_stop; k++) {
        size_t sl = (size_t)q->stop_len[k];
        if (sl > len)
            continue;
        size_t start = from + 1 > sl ? from + 1 - sl : 0;
        for (size_t p = start; p + sl <= len; p++) {
            if (best >= 0 && (int64_t)p >= best)
                break;
            if (memcmp(text + p, q->stop[k], sl) == 0) {
                best = (int64_t)p;
                *which = k;
                break;
            }
        }
    }
    return best;
}

/* Bytes at the end of text that could still grow into a stop string. */
static size_t stop_holdback(const struct sched_req *q, const char *text, size_t len)
{
    size_t hold = 0;
    for (int k = 0; k < q->n_stop; k++) {
        size_t sl = (size_t)q->stop_len[k];
        for (size_t h = sl - 1 < len ? sl - 1 : len; h > hold; h--) {
            if (memcmp(text + len - h, q->stop[k], h) == 0) {
                hold = h;
                break;
            }
        }
    }
    return hold;
}

/* A token was sampled for q: record it, decide whether q stops, stream its delta. */
void sched_take_token(struct dsv4_sched *s, struct sched_req *q, const struct dsv4_sample *smp)
{
    struct dsv4_sched_result *res = &q->result;
    struct sched_out *o = &s->outs[q->out];
    int32_t tok = smp->token;
    uint64_t t = sched_now_ns();
    if (!res->timings.first_token_ns)
        res->timings.first_token_ns = t;
    int index = res->n_tokens;
    o->tokens[res->n_tokens++] = tok;
    s->counts[(size_t)q->slot * (size_t)s->vocab + (size_t)tok]++;
    s->seen[(size_t)q->slot * s->seen_stride + (size_t)tok / 8] |= (uint8_t)(1u << (tok % 8));
    q->pending = tok;
    s->step_generated++;

    enum dsv4_finish_reason why = DSV4_FINISH_NONE;
    int err = 0;
    char msg[DSV4_SCHED_ERROR_MAX] = "";
    size_t old_len = res->text_len;
    bool stop_tok = tok == s->eos && !q->ignore_eos;
    for (int k = 0; k < q->n_stop_ids && !stop_tok; k++)
        stop_tok = tok == q->stop_ids[k];
    if (stop_tok) {
        why = DSV4_FINISH_STOP;
        res->stop_token = tok;
    } else {
        int n = s->detok.token_bytes(s->detok.ctx, tok, s->scratch + q->n_raw, DSV4_SCHED_TOKEN_BYTES_MAX);
        /* An id of the model's vocabulary past the tokenizer's (a padded embedding) has no text: it is
         * streamed with an empty delta and generation goes on. */
        if (n == -ERANGE)
            n = 0;
        if (n < 0) {
            why = DSV4_FINISH_ERROR;
            err = n;
            snprintf(msg, sizeof(msg), "detokenizing token %d: %s", tok, dsv4_error_message());
        } else {
            memcpy(s->scratch, q->raw, (size_t)q->n_raw);
            if (utf8_append(o->text, (size_t)s->lim.max_output_bytes, &res->text_len,
                            (const unsigned char *)s->scratch, q->n_raw + n, false, q->raw, &q->n_raw) < 0)
                why = DSV4_FINISH_LENGTH;   /* the output byte limit; this token's text is not added */
        }
    }
    if (why == DSV4_FINISH_NONE && q->n_stop) {
        int which = -1;
        int64_t at = find_stop(q, o->text, res->text_len, old_len, &which);
        if (at >= 0) {
            why = DSV4_FINISH_STOP;
            res->stop_string = which;
            res->text_len = (size_t)at;
            q->n_raw = 0;
        }
    }
    if (why == DSV4_FINISH_NONE && res->n_tokens >= q->max_tokens)
        why = DSV4_FINISH_LENGTH;
    /* prompt + generated == max_context: the token just sampled is the last one the context holds
     * (it is never fed, so it needs no position of its own). */
    if (why == DSV4_FINISH_NONE && q->n_prompt + res->n_tokens >= s->max_context)
        why = DSV4_FINISH_CONTEXT;

    if (why != DSV4_FINISH_NONE && why != DSV4_FINISH_ERROR && q->n_raw) {
        unsigned char raw[4];
        int n_raw;
        const size_t flushed_from = res->text_len;
        if (utf8_append(o->text, (size_t)s->lim.max_output_bytes, &res->text_len, q->raw, q->n_raw, true,
                        raw, &n_raw) < 0 && why != DSV4_FINISH_STOP)
            why = DSV4_FINISH_LENGTH;
        q->n_raw = 0;
        /* The U+FFFD that ends the text may complete a stop string: cut before it as anywhere else
         * (a stop token, matched first, stays the reason). */
        int which = -1;
        int64_t at = find_stop(q, o->text, res->text_len, flushed_from, &which);
        if (at >= 0) {
            res->text_len = (size_t)at;
            if (why != DSV4_FINISH_STOP) {
                why = DSV4_FINISH_STOP;
                res->stop_string = which;
            }
        }
    }
    size_t safe = res->text_len;
    if (why == DSV4_FINISH_NONE) {
        size_t hold = stop_holdback(q, o->text, res->text_len);
        safe = res->text_len - hold;
        if (safe < q->emitted)
            safe = q->emitted;
    }
    struct dsv4_sched_event *e = sched_stage_event(s, DSV4_SCHED_EVENT_TOKEN, q);
    e->index = index;
    e->sample = *smp;
    if (safe > q->emitted) {
        e->delta_len = safe - q->emitted;
        memcpy(e->delta, o->text + q->emitted, e->delta_len);
        q->emitted = safe;
    }
    if (why != DSV4_FINISH_NONE)
        sched_finish(s, q, why, err, err ? msg : NULL);
}

int sched_draw(const struct dsv4_sched *s, struct dsv4_sampler *sm, const struct sched_req *q, const float *row,
               struct dsv4_sample *smp)
{
    struct dsv4_sampler_history hist = {
        .counts = s->counts + (size_t)q->slot * (size_t)s->vocab,
        .seen = s->seen + (size_t)q->slot * s->seen_stride,
    };
    return dsv4_sampler_sample(sm, &q->sampling, row, &hist, q->seed, (uint64_t)q->result.n_tokens, smp);
}

int sched_sample(struct dsv4_sched *s, struct sched_req *q, const float *row, struct dsv4_sample *smp)
{
    int r = sched_draw(s, s->samplers[0], q, row, smp);
    if (r < 0) {
        char msg[DSV4_SCHED_ERROR_MAX];
        snprintf(msg, sizeof(msg), "sampling: %s", dsv4_error_message());
        sched_finish(s, q, DSV4_FINISH_ERROR, r, msg);
    }
    return r;
}

void sched_sample_row(struct dsv4_sched *s, struct sched_req *q, const float *row)
{
    struct dsv4_sample smp;
    if (sched_sample(s, q, row, &smp) == 0)
        sched_take_token(s, q, &smp);
}

void sched_fail_request(struct dsv4_sched *s, struct sched_req *q, int r, const char *what)
{
    char msg[DSV4_SCHED_ERROR_MAX];
    snprintf(msg, sizeof(msg), "%s: %s", what, dsv4_error_message());
    sched_finish(s, q, DSV4_FINISH_ERROR, r, msg);
}

/* A backend call returned r: when that is -ENOTRECOVERABLE (the device is gone, a sticky CUDA error)
 * nothing can run any more. Every running request ends now with the error; queued ones end at the
 * next admission (sched_step.c), new ones are refused, and dsv4_sched_run() returns r once all have ended. Returns
 * true when it was fatal. */
bool sched_backend_fatal(struct dsv4_sched *s, int r, const char *what)
{
    if (r != -ENOTRECOVERABLE)
        return false;
    if (!s->fatal) {
        pthread_mutex_lock(&s->lock);
        s->fatal = r;
        snprintf(s->fatal_msg, sizeof(s->fatal_msg), "the engine failed (%s: %s)", what, dsv4_error_message());
        pthread_mutex_unlock(&s->lock);
    }
    for (int k = 0; k < s->n_running; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (q->state == REQ_RUNNING && !q->done)
            sched_finish(s, q, DSV4_FINISH_ERROR, r, s->fatal_msg);
    }
    return true;
}
