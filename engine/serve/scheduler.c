/* SPDX-License-Identifier: MIT */
/* Scheduler: request records, FIFO admission into the backend's slots, chunked prefill, one batched
 * decode per step, sampling, stop detection, streaming text and events. The contract is written in
 * scheduler.h; these files keep to it.
 *
 * Here: create, destroy and the io-thread side (submit, cancel, events, release, drain, stats); the
 * engine thread's step is sched_step.c and the pieces it uses are listed in sched_internal.h, with
 * the locking rules. */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include "base/utf8.h"
#include "engine/error.h"
#include "engine/serve/sched_internal.h"
#include "engine/text/tokenizer.h"
#include "engine/workpool.h"

#define SCHED_DEFAULT_PREFILL_BUDGET 512
#define SCHED_DEFAULT_OUTPUT_TOKENS_CAP 32768
#define SCHED_DEFAULT_BYTES_PER_TOKEN 8
#define SCHED_DEFAULT_REQUESTS_PER_SLOT 4
/* Event ring. A step needs at most three events per slot (a running request cancelled, then the
 * slot's new request's token and finish); a step starts only with that much room free. The ring holds
 * twice that, plus slack for queued requests that finish without a slot. */
#define SCHED_EVENTS_PER_SLOT_STEP 3
#define SCHED_EVENT_SLACK 64
/* Request ids carry the record index in their low bits and a serial above, so a stale id never
 * names a reused record. */
#define SCHED_ID_INDEX_BITS 16
#define SCHED_ID_INDEX_MASK ((1u << SCHED_ID_INDEX_BITS) - 1)
#define SCHED_PREFILL_BUDGET_MAX (1 << 20)

static void *sched_alloc(struct dsv4_sched *s, size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size);
    if (p)
        s->allocations++;
    return p;
}

const char *dsv4_finish_reason_name(enum dsv4_finish_reason r)
{
    switch (r) {
    case DSV4_FINISH_NONE: return "none";
    case DSV4_FINISH_STOP: return "stop";
    case DSV4_FINISH_LENGTH: return "length";
    case DSV4_FINISH_CONTEXT: return "context";
    case DSV4_FINISH_CANCELLED: return "cancelled";
    case DSV4_FINISH_ERROR: return "error";
    }
    return "unknown";
}

/* The tokenizer as detokenizer: special tokens contribute no text. */
static int tokenizer_token_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    const struct dsv4_tokenizer *tok = ctx;
    size_t len;
    if (dsv4_tokenizer_is_special(tok, id))
        return 0;
    const char *bytes = dsv4_tokenizer_token_bytes(tok, id, &len);
    if (!bytes)
        return dsv4_error_set(-ERANGE, "token id %d is not in the tokenizer's vocabulary", id);
    if (len > cap)
        return dsv4_error_set(-E2BIG, "token id %d has %zu bytes, more than %zu", id, len, cap);
    memcpy(buf, bytes, len);
    return (int)len;
}

/* ---- create / destroy ---- */

int dsv4_sched_create(struct dsv4_backend *b, const struct dsv4_tokenizer *tok,
                      const struct dsv4_sched_limits *limits, struct dsv4_sched **ret)
{
    *ret = NULL;
    if (!b || !b->weights)
        return dsv4_error_set(-EINVAL, "scheduler: a backend with its model weights is needed");
    if (!tok && !(limits && limits->detok.token_bytes))
        return dsv4_error_set(-EINVAL, "scheduler: a tokenizer (or limits.detok) is needed for text");
    struct dsv4_sched_limits lim = limits ? *limits : (struct dsv4_sched_limits){ 0 };
    int max_batch = b->opts.max_batch, max_context = b->opts.max_context;
    int vocab = b->weights->cfg.vocab_size;
    if (max_batch < 1 || max_context < 2)
        return dsv4_error_set(-EINVAL, "scheduler: backend max_batch %d / max_context %d: need >= 1 / >= 2",
                              max_batch, max_context);
    if (vocab < 2 || vocab > DSV4_SAMPLER_VOCAB_MAX)
        return dsv4_error_set(-EINVAL, "scheduler: vocab_size %d: must be in [2, %d]", vocab,
                              DSV4_SAMPLER_VOCAB_MAX);
    if (!lim.max_requests)
        lim.max_requests = SCHED_DEFAULT_REQUESTS_PER_SLOT * max_batch;
    if (!lim.prefill_budget)
        lim.prefill_budget = SCHED_DEFAULT_PREFILL_BUDGET;
    if (!lim.max_output_tokens)
        lim.max_output_tokens = max_context < SCHED_DEFAULT_OUTPUT_TOKENS_CAP ? max_context
                                                                             : SCHED_DEFAULT_OUTPUT_TOKENS_CAP;
    if (!lim.max_output_bytes && lim.max_output_tokens > 0)
        lim.max_output_bytes = (int)((int64_t)SCHED_DEFAULT_BYTES_PER_TOKEN * lim.max_output_tokens > INT32_MAX / 2
                                     ? INT32_MAX / 2 : SCHED_DEFAULT_BYTES_PER_TOKEN * lim.max_output_tokens);
    if (!lim.max_unreleased)
        lim.max_unreleased = max_batch;
    if (!lim.sampler_threads)
        lim.sampler_threads = 1;
    if (lim.max_requests < max_batch || lim.max_requests > DSV4_SCHED_REQUESTS_MAX)
        return dsv4_error_set(-EINVAL, "scheduler max_requests %d: must be in [max_batch %d, %d]",
                              lim.max_requests, max_batch, DSV4_SCHED_REQUESTS_MAX);
    if (lim.prefill_budget < 1 || lim.prefill_budget > SCHED_PREFILL_BUDGET_MAX)
        return dsv4_error_set(-EINVAL, "scheduler prefill_budget %d: must be in [1, %d]",
                              lim.prefill_budget, SCHED_PREFILL_BUDGET_MAX);
    if (lim.decode_stall_ms < 0 || lim.decode_stall_ms > DSV4_SCHED_DECODE_STALL_MS_MAX)
        return dsv4_error_set(-EINVAL, "scheduler decode_stall_ms %d: must be in [0, %d]", lim.decode_stall_ms,
                              DSV4_SCHED_DECODE_STALL_MS_MAX);
    if (lim.max_output_tokens < 1 || lim.max_output_tokens > max_context)
        return dsv4_error_set(-EINVAL, "scheduler max_output_tokens %d: must be in [1, max_context %d]",
                              lim.max_output_tokens, max_context);
    if (lim.max_output_bytes < 1 || lim.max_output_bytes > INT32_MAX / 2)
        return dsv4_error_set(-EINVAL, "scheduler max_output_bytes %d: must be in [1, %d]",
                              lim.max_output_bytes, INT32_MAX / 2);
    if (lim.sampler_threads < 1 || lim.sampler_threads > DSV4_SCHED_SAMPLER_THREADS_MAX)
        return dsv4_error_set(-EINVAL, "scheduler sampler_threads %d: must be in [1, %d]", lim.sampler_threads,
                              DSV4_SCHED_SAMPLER_THREADS_MAX);
    if (lim.max_unreleased < 0 || lim.max_unreleased > lim.max_requests)
        return dsv4_error_set(-EINVAL, "scheduler max_unreleased %d: must be in [0, max_requests %d]",
                              lim.max_unreleased, lim.max_requests);
    const int groups = b->slot_groups ? b->slot_groups : 1;
    if (groups < 1 || groups > DSV4_EP_MAX_GPUS || groups > max_batch)
        return dsv4_error_set(-EINVAL, "scheduler: the backend deals its %d slots over %d devices: need 1 to %d "
                              "devices and a slot each", max_batch, groups, DSV4_EP_MAX_GPUS);

    struct dsv4_sched *s = calloc(1, sizeof(*s));
    if (!s)
        return dsv4_error_set(-ENOMEM, "scheduler: out of memory");
    s->allocations = 1;
    s->backend = b;
    s->tok = tok;
    s->detok = lim.detok.token_bytes ? lim.detok
                                     : (struct dsv4_sched_detok){ tokenizer_token_bytes, (void *)tok };
    s->vocab = vocab;
    s->max_batch = max_batch;
    s->max_context = max_context;
    s->n_groups = groups;
    for (int g = 0, end = 0; g < groups; g++) {
        end += dsv4_ep_slots(max_batch, groups, g);
        s->group_end[g] = end;
    }
    s->eos = b->weights->cfg.eos_id;
    s->lim = lim;
    s->event_fd = -1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    s->n_threads = lim.sampler_threads < max_batch ? lim.sampler_threads : max_batch;

    int r = -ENOMEM;
    s->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->event_fd < 0) {
        r = dsv4_error_set(-errno, "scheduler: eventfd: %s", strerror(errno));
        goto fail;
    }
    s->n_outs = max_batch + lim.max_unreleased;
    s->spec = b->spec_tokens > 0 && b->ops->draft && b->ops->verify && b->ops->accept && !b->ops->sample
              ? b->spec_tokens : 0;
    s->st.spec_tokens = s->spec;
    s->events_per_slot = SCHED_EVENTS_PER_SLOT_STEP + s->spec;
    s->n_events = 2 * s->events_per_slot * max_batch + SCHED_EVENT_SLACK;
    s->seen_stride = ((size_t)vocab + 7) / 8;
    s->reqs = sched_alloc(s, (size_t)lim.max_requests, sizeof(*s->reqs));
    s->outs = sched_alloc(s, (size_t)s->n_outs, sizeof(*s->outs));
    s->slot_req = sched_alloc(s, (size_t)max_batch, sizeof(*s->slot_req));
    s->running = sched_alloc(s, (size_t)max_batch, sizeof(*s->running));
    s->counts = sched_alloc(s, (size_t)max_batch * (size_t)vocab, sizeof(*s->counts));
    s->seen = sched_alloc(s, (size_t)max_batch * s->seen_stride, 1);
    s->events = sched_alloc(s, (size_t)s->n_events, sizeof(*s->events));
    s->device_sampling = b->ops->sample != NULL;
    /* logits come back to the host only when the host samples */
    s->logits = sched_alloc(s, s->device_sampling ? 1 : (size_t)max_batch * (size_t)(s->spec + 1) * (size_t)vocab,
                            sizeof(*s->logits));
    if (s->spec) {
        s->spec_k = sched_alloc(s, (size_t)max_batch, sizeof(*s->spec_k));
        s->spec_made = sched_alloc(s, (size_t)max_batch, sizeof(*s->spec_made));
        s->spec_drafts = sched_alloc(s, (size_t)max_batch * (size_t)s->spec, sizeof(*s->spec_drafts));
        s->spec_rows = sched_alloc(s, (size_t)max_batch * (size_t)(s->spec + 1), sizeof(*s->spec_rows));
        if (!s->spec_k || !s->spec_made || !s->spec_drafts || !s->spec_rows) {
            r = dsv4_error_set(-ENOMEM, "scheduler: out of memory for speculative decoding");
            goto fail;
        }
    }
    s->dec_slots = sched_alloc(s, (size_t)max_batch, sizeof(*s->dec_slots));
    s->dec_tokens = sched_alloc(s, (size_t)max_batch, sizeof(*s->dec_tokens));
    s->dec_reqs = sched_alloc(s, (size_t)max_batch, sizeof(*s->dec_reqs));
    s->scratch = sched_alloc(s, 4 + DSV4_SCHED_TOKEN_BYTES_MAX, 1);
    s->samplers = sched_alloc(s, (size_t)s->n_threads, sizeof(*s->samplers));
    s->row_sample = sched_alloc(s, (size_t)max_batch, sizeof(*s->row_sample));
    s->row_rc = sched_alloc(s, (size_t)max_batch, sizeof(*s->row_rc));
    if (s->device_sampling) {
        s->sreq = sched_alloc(s, (size_t)max_batch, sizeof(*s->sreq));
        s->smsg = sched_alloc(s, (size_t)max_batch, DSV4_BACKEND_MSG_MAX);
    }
    s->row_err = sched_alloc(s, (size_t)max_batch, sizeof(*s->row_err));
    if (!s->reqs || !s->outs || !s->slot_req || !s->running || !s->counts || !s->seen || !s->events ||
        !s->logits || !s->dec_slots || !s->dec_tokens || !s->dec_reqs || !s->scratch || !s->samplers ||
        !s->row_sample || !s->row_rc || !s->row_err ||
        (s->device_sampling && (!s->sreq || !s->smsg))) {
        r = dsv4_error_set(-ENOMEM, "scheduler: out of memory for %d slots x vocab %d", max_batch, vocab);
        goto fail;
    }
    for (int i = 0; i < s->n_outs; i++) {
        s->outs[i].tokens = sched_alloc(s, (size_t)lim.max_output_tokens, sizeof(int32_t));
        s->outs[i].text = sched_alloc(s, (size_t)lim.max_output_bytes + 1, 1);
        s->outs[i].next_free = i + 1 < s->n_outs ? i + 1 : -1;
        if (!s->outs[i].tokens || !s->outs[i].text) {
            r = dsv4_error_set(-ENOMEM, "scheduler: out of memory for %d output buffers of %d tokens / %d bytes",
                               s->n_outs, lim.max_output_tokens, lim.max_output_bytes);
            goto fail;
        }
    }
    s->free_out = 0;
    for (int i = 0; i < lim.max_requests; i++) {
        s->reqs[i].next = i + 1 < lim.max_requests ? i + 1 : -1;
        s->reqs[i].slot = s->reqs[i].out = -1;
    }
    s->free_req = 0;
    s->queue_head = s->queue_tail = -1;
    for (int i = 0; i < max_batch; i++)
        s->slot_req[i] = -1;
    if (b->prefix.n_pages > 0) {
        if (!b->ops->prefix_save || !b->ops->prefix_load) {
            r = dsv4_error_set(-EINVAL, "scheduler: the %s backend has a prefix pool but no prefix operations",
                               b->ops->name);
            goto fail;
        }
        r = dsv4_prefix_cache_create(&b->prefix, max_context, &s->prefix);
        if (r < 0)
            goto fail;
        dsv4_prefix_cache_get_stats(s->prefix, &s->st.prefix);
        s->st.prefix_cache = true;
        s->allocations += s->st.prefix.allocations;
        s->block = b->prefix.block;
        s->chain_max = dsv4_prefix_cache_chain_max(s->prefix);
        s->block_tokens = sched_alloc(s, (size_t)s->block, sizeof(int32_t));
        if (!s->block_tokens) {
            r = dsv4_error_set(-ENOMEM, "scheduler: out of memory");
            goto fail;
        }
    }
    for (int i = 0; i < s->n_threads; i++) {
        r = dsv4_sampler_create(vocab, &s->samplers[i]);
        if (r < 0)
            goto fail;
        s->allocations++;
    }
    r = dsv4_workpool_create(s->n_threads, "sampler", &s->pool);
    if (r < 0) {
        r = dsv4_error_prefix(r, "scheduler: ");
        goto fail;
    }
    s->allocations += (uint64_t)dsv4_workpool_allocations(s->pool);
    /* Every token's text must fit the per-token bound the event deltas are sized for. */
    for (int32_t id = 0; id < vocab; id++) {
        int n = s->detok.token_bytes(s->detok.ctx, id, s->scratch, DSV4_SCHED_TOKEN_BYTES_MAX);
        if (n == -ERANGE)
            continue;   /* model ids past the tokenizer's vocabulary: an error only if generated */
        if (n < 0) {
            r = dsv4_error_prefix(n, "scheduler: token %d: ", id);
            goto fail;
        }
    }
    s->st.slots_total = max_batch;
    if (b->ops->get_stats)
        b->ops->get_stats(b, &s->st.backend);
    *ret = s;
    return 0;
fail:
    dsv4_sched_destroy(s);
    return r;
}

void dsv4_sched_destroy(struct dsv4_sched *s)
{
    if (!s)
        return;
    if (s->outs)
        for (int i = 0; i < s->n_outs; i++) {
            free(s->outs[i].tokens);
            free(s->outs[i].text);
        }
    free(s->reqs);
    free(s->outs);
    free(s->slot_req);
    free(s->running);
    free(s->counts);
    free(s->seen);
    free(s->events);
    free(s->logits);
    free(s->spec_k);
    free(s->spec_made);
    free(s->spec_drafts);
    free(s->spec_rows);
    free(s->dec_slots);
    free(s->dec_tokens);
    free(s->dec_reqs);
    free(s->scratch);
    dsv4_prefix_cache_destroy(s->prefix);
    free(s->block_tokens);
    dsv4_workpool_free(s->pool);
    if (s->samplers)
        for (int i = 0; i < s->n_threads; i++)
            dsv4_sampler_destroy(s->samplers[i]);
    free(s->samplers);
    free(s->row_sample);
    free(s->row_rc);
    free(s->row_err);
    free(s->sreq);
    free(s->smsg);
    if (s->event_fd >= 0)
        close(s->event_fd);
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

/* ---- io-thread side ---- */

static struct sched_req *lookup(struct dsv4_sched *s, uint64_t id)
{
    uint32_t i = (uint32_t)(id & SCHED_ID_INDEX_MASK);
    if (id == 0 || i >= (uint32_t)s->lim.max_requests || s->reqs[i].id != id)
        return NULL;
    return &s->reqs[i];
}

static int check_request(const struct dsv4_sched *s, const struct dsv4_sched_request *req)
{
    if (!req->prompt || req->n_prompt < 1)
        return dsv4_error_set(-EINVAL, "request: empty prompt");
    if (req->n_prompt >= s->max_context)
        return dsv4_error_set(-E2BIG, "request: prompt of %d tokens leaves no room for a generated token in "
                              "max_context %d", req->n_prompt, s->max_context);
    if (req->max_tokens < 0 || req->max_tokens > s->lim.max_output_tokens)
        return dsv4_error_set(-E2BIG, "request: max_tokens %d: must be in [0, max_output_tokens %d]",
                              req->max_tokens, s->lim.max_output_tokens);
    for (int i = 0; i < req->n_prompt; i++)
        if (req->prompt[i] < 0 || req->prompt[i] >= s->vocab)
            return dsv4_error_set(-EINVAL, "request: prompt token %d at %d is outside vocab_size %d",
                                  req->prompt[i], i, s->vocab);
    /* The one place sampling parameters are checked on the way in; -EDOM tells the caller which. */
    if (dsv4_sampling_validate(&req->sampling) < 0)
        return dsv4_error_prefix(-EDOM, "request: ");
    if (req->n_stop < 0 || req->n_stop > DSV4_SCHED_STOP_STRINGS_MAX || (req->n_stop && !req->stop))
        return dsv4_error_set(-E2BIG, "request: %d stop strings: at most %d", req->n_stop,
                              DSV4_SCHED_STOP_STRINGS_MAX);
    for (int i = 0; i < req->n_stop; i++) {
        size_t len = req->stop[i] ? strlen(req->stop[i]) : 0;
        if (len < 1 || len > DSV4_SCHED_STOP_LEN_MAX)
            return dsv4_error_set(-E2BIG, "request: stop string %d has %zu bytes: must be 1..%d", i, len,
                                  DSV4_SCHED_STOP_LEN_MAX);
        /* Stop strings must be valid UTF-8: the text they are matched against is. */
        if (!dsv4_utf8_valid(req->stop[i], len))
            return dsv4_error_set(-EINVAL, "request: stop string %d is not valid UTF-8", i);
    }
    if (req->n_stop_token_ids < 0 || req->n_stop_token_ids > DSV4_SCHED_STOP_TOKENS_MAX ||
        (req->n_stop_token_ids && !req->stop_token_ids))
        return dsv4_error_set(-E2BIG, "request: %d stop_token_ids: at most %d", req->n_stop_token_ids,
                              DSV4_SCHED_STOP_TOKENS_MAX);
    for (int i = 0; i < req->n_stop_token_ids; i++)
        if (req->stop_token_ids[i] < 0 || req->stop_token_ids[i] >= s->vocab)
            return dsv4_error_set(-EINVAL, "request: stop_token_ids[%d] = %d is outside vocab_size %d", i,
                                  req->stop_token_ids[i], s->vocab);
    return 0;
}

int dsv4_sched_submit(struct dsv4_sched *s, const struct dsv4_sched_request *req, uint64_t *ret_id)
{
    *ret_id = 0;
    int r = check_request(s, req);
    uint64_t seed = req->sampling.seed;
    if (r == 0 && !req->sampling.has_seed && getrandom(&seed, sizeof(seed), 0) != sizeof(seed))
        r = dsv4_error_set(-EIO, "request: drawing a seed: %s", strerror(errno));
    pthread_mutex_lock(&s->lock);
    if (r == 0 && s->fatal)
        r = dsv4_error_set(-ENOTRECOVERABLE, "request: the engine has failed: %s", s->fatal_msg);
    if (r == 0 && s->draining)
        r = dsv4_error_set(-ESHUTDOWN, "request: the engine is draining");
    if (r == 0 && s->free_req < 0)
        r = dsv4_error_set(-EAGAIN, "request: %d requests already in the engine (max_requests)",
                           s->lim.max_requests);
    if (r < 0) {
        s->st.rejected++;
        pthread_mutex_unlock(&s->lock);
        return r;
    }
    int i = s->free_req;
    struct sched_req *q = &s->reqs[i];
    s->free_req = q->next;
    s->serial++;
    uint64_t id = (s->serial << SCHED_ID_INDEX_BITS) | (uint64_t)i;

    memset(q, 0, sizeof(*q));
    q->id = id;
    q->state = REQ_QUEUED;
    q->next = -1;
    q->slot = q->out = -1;
    q->cache_node = DSV4_PREFIX_ROOT;
    q->prompt = req->prompt;
    q->n_prompt = req->n_prompt;
    q->max_tokens = req->max_tokens ? req->max_tokens : s->lim.max_output_tokens;
    q->sampling = req->sampling;
    q->user = req->user;
    q->seed = seed;
    q->n_stop = req->n_stop;
    for (int k = 0; k < req->n_stop; k++) {
        q->stop_len[k] = (int)strlen(req->stop[k]);
        memcpy(q->stop[k], req->stop[k], (size_t)q->stop_len[k] + 1);
    }
    q->ignore_eos = req->ignore_eos;
    q->n_stop_ids = req->n_stop_token_ids;
    if (req->n_stop_token_ids)
        memcpy(q->stop_ids, req->stop_token_ids, sizeof(int32_t) * (size_t)req->n_stop_token_ids);
    q->result.id = id;
    q->result.user = req->user;
    q->result.seed = seed;
    q->result.stop_token = -1;
    q->result.stop_string = -1;
    q->result.prompt_tokens = req->n_prompt;
    q->result.timings.submit_ns = sched_now_ns();

    if (s->queue_tail >= 0)
        s->reqs[s->queue_tail].next = i;
    else
        s->queue_head = i;
    s->queue_tail = i;
    s->n_queued++;
    s->st.submitted++;
    s->kick++;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
    *ret_id = id;
    return 0;
}

int dsv4_sched_cancel(struct dsv4_sched *s, uint64_t id)
{
    pthread_mutex_lock(&s->lock);
    struct sched_req *q = lookup(s, id);
    int r = 0;
    if (!q || (q->state != REQ_QUEUED && q->state != REQ_RUNNING))
        r = dsv4_error_set(-ENOENT, "cancel: request %llu is not queued or running", (unsigned long long)id);
    else {
        q->cancel = true;
        s->kick++;
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->lock);
    return r;
}

int dsv4_sched_next_event(struct dsv4_sched *s, struct dsv4_sched_event *ev)
{
    pthread_mutex_lock(&s->lock);
    int got = 0;
    if (s->ev_count > 0) {
        const struct dsv4_sched_event *e = &s->events[s->ev_head];
        /* copy only the used part of the delta */
        memcpy(ev, e, offsetof(struct dsv4_sched_event, delta));
        memcpy(ev->delta, e->delta, e->delta_len);
        ev->result = e->result;
        s->ev_head = (s->ev_head + 1) % s->n_events;
        s->ev_count--;
        got = 1;
        s->kick++;
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->lock);
    return got;
}

int dsv4_sched_release(struct dsv4_sched *s, uint64_t id)
{
    pthread_mutex_lock(&s->lock);
    struct sched_req *q = lookup(s, id);
    int r = 0;
    if (!q || q->state != REQ_FINISHED) {
        r = dsv4_error_set(-ENOENT, "release: request %llu has not finished", (unsigned long long)id);
    } else {
        if (q->out >= 0) {
            s->outs[q->out].next_free = s->free_out;
            s->free_out = q->out;
            q->out = -1;
        }
        int i = (int)(q - s->reqs);
        q->id = 0;
        q->state = REQ_FREE;
        q->next = s->free_req;
        s->free_req = i;
        s->st.unreleased--;
        s->kick++;
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->lock);
    return r;
}

int dsv4_sched_event_fd(const struct dsv4_sched *s)
{
    return s->event_fd;
}

void dsv4_sched_stop(struct dsv4_sched *s)
{
    pthread_mutex_lock(&s->lock);
    s->stop_asked = true;
    s->kick++;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
}

int dsv4_sched_run_between(struct dsv4_sched *s, void (*fn)(void *), void *arg)
{
    if (!fn)
        return dsv4_error_set(-EINVAL, "no function to run between steps");
    pthread_mutex_lock(&s->lock);
    const bool busy = s->between != NULL;
    if (!busy) {
        s->between = fn;
        s->between_arg = arg;
        s->kick++;
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->lock);
    return busy ? dsv4_error_set(-EBUSY, "an earlier call between steps has not run yet") : 0;
}

void dsv4_sched_drain(struct dsv4_sched *s, double grace_s)
{
    pthread_mutex_lock(&s->lock);
    if (!s->draining) {
        s->draining = true;
        s->drain_deadline_ns = sched_now_ns() + (uint64_t)(grace_s > 0 ? grace_s * 1e9 : 0);
    }
    s->kick++;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->lock);
}

bool dsv4_sched_drained(struct dsv4_sched *s)
{
    pthread_mutex_lock(&s->lock);
    bool d = s->draining && s->n_queued == 0 && s->n_running == 0;
    pthread_mutex_unlock(&s->lock);
    return d;
}

void dsv4_sched_get_stats(struct dsv4_sched *s, struct dsv4_sched_stats *ret)
{
    pthread_mutex_lock(&s->lock);
    *ret = s->st;
    ret->slots_in_use = s->n_slots_used;
    ret->queued = s->n_queued;
    ret->events_pending = s->ev_count;
    ret->allocations = s->allocations;
    ret->busy_s = (double)s->busy_ns * 1e-9;
    ret->backend_s = (double)s->backend_ns * 1e-9;
    ret->gap_s = (double)s->gap_ns * 1e-9;
    ret->tokens_per_s = s->busy_ns ? (double)s->st.generated_tokens / ret->busy_s : 0.0;
    pthread_mutex_unlock(&s->lock);
}
