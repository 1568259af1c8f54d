/* SPDX-License-Identifier: MIT */
/* Scheduler: request records, FIFO admission into the backend's slots, chunked prefill, one batched
 * decode per step, sampling, stop detection, streaming text and events. The contract is written in
 * scheduler.h; this file keeps to it.
 *
 * Locking. s->lock guards the queue, the free lists, every record's state/cancel fields, the event
 * ring's indices and the stats. The engine thread alone writes a running record's output (tokens,
 * text, result) and the ring entries past the published tail; publishing the tail under the lock
 * hands them to the reader. A record's request fields are written once by submit before it is
 * queued and only read afterwards. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "base/utf8.h"
#include "engine/error.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"

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
#define SCHED_RATE_WEIGHT 0.5       /* a new prefill chunk's share of the moving average of its rate */

enum req_state { REQ_FREE, REQ_QUEUED, REQ_RUNNING, REQ_FINISHED };

struct sched_out {                  /* one output buffer */
    int32_t *tokens;                /* [max_output_tokens] */
    char *text;                     /* [max_output_bytes + 1] */
    int next_free;
};

struct sched_req {
    uint64_t id;
    enum req_state state;
    bool cancel;                    /* asked by cancel() or a drain */
    int next;                       /* queue or free-list link, -1 ends */

    /* the request, fixed at submit */
    const int32_t *prompt;
    int n_prompt;
    int max_tokens;                 /* effective: never 0 */
    struct dsv4_sampling sampling;
    void *user;
    uint64_t seed;
    int n_stop;
    int stop_len[DSV4_SCHED_STOP_STRINGS_MAX];
    char stop[DSV4_SCHED_STOP_STRINGS_MAX][DSV4_SCHED_STOP_LEN_MAX + 1];
    int n_stop_ids;
    int32_t stop_ids[DSV4_SCHED_STOP_TOKENS_MAX];
    bool ignore_eos;

    /* engine-thread state while running */
    int slot, out;
    int n_prefilled;                /* prompt tokens fed */
    int64_t position;               /* tokens in the slot */
    bool generating;                /* prompt done, pending holds the next token to feed */
    bool fresh;                     /* got its first token this step: no decode this step */
    bool done;                      /* finished this step, published at the step's end */
    bool cache_looked;              /* the prefix cache was consulted (at the first prefill) */
    bool caching;                   /* the slot's state is snapshotted at its next block boundary */
    int32_t cache_node;             /* the prefix-cache node the slot continues (held), or ROOT */
    int cache_match;                /* prompt blocks found in the cache: where the request leaves it */
    int32_t pending;
    size_t emitted;                 /* text bytes already streamed */
    int n_raw;                      /* incomplete UTF-8 sequence awaiting more bytes */
    unsigned char raw[4];
    struct dsv4_sched_result result;
};

struct dsv4_sched {
    struct dsv4_backend *backend;
    struct dsv4_prefix_cache *prefix;   /* NULL when the backend has no prefix pool */
    int block;                      /* its tokens per block */
    int32_t *block_tokens;          /* [block] a decode snapshot's tokens */
    const struct dsv4_tokenizer *tok;
    struct dsv4_sched_detok detok;
    int vocab, max_batch, max_context;
    int32_t eos;
    struct dsv4_sched_limits lim;   /* defaults resolved */
    double prefill_ns_per_token;    /* moving average over chunks of >= DSV4_SCHED_STALL_MIN_TOKENS; 0: none yet */
    uint64_t allocations;

    pthread_mutex_t lock;
    pthread_cond_t wake;            /* engine thread: work arrived, events drained, stop */
    int event_fd;

    struct sched_req *reqs;         /* [max_requests] */
    int free_req;                   /* free list head */
    int queue_head, queue_tail, n_queued;
    uint64_t serial;

    struct sched_out *outs;         /* [n_outs] */
    int n_outs, free_out;

    int *slot_req;                  /* [max_batch] record index or -1 */
    int n_slots_used;
    int *running;                   /* [max_batch] record indices, admission order */
    int n_running;
    uint32_t *counts;               /* [max_batch, V] output counts per slot */
    uint8_t *seen;                  /* [max_batch, ceil(V/8)] prompt-or-output bits per slot */
    size_t seen_stride;

    struct dsv4_sched_event *events;    /* ring [n_events] */
    int n_events, ev_head, ev_count;    /* published entries */
    int ev_tail;                    /* (ev_head + ev_count) % n_events; moved by the engine thread only */
    int ev_staged;                  /* entries written past the tail this step, not yet published */
    uint64_t kick;                  /* bumped by every call that may give the engine thread work */
    void (*between)(void *);        /* dsv4_sched_run_between's pending call, or NULL */
    void *between_arg;
    uint64_t step_generated;        /* tokens sampled this step (engine thread), added at publish */

    float *logits;                  /* [max_batch, V] */
    int *dec_slots;                 /* [max_batch] */
    int32_t *dec_tokens;            /* [max_batch] */
    int *dec_reqs;                  /* [max_batch] */
    struct dsv4_sampler **samplers; /* [n_threads]: [0] the engine thread's, [i] worker i's */
    int n_threads;
    pthread_t *workers;             /* [n_threads - 1] */
    int n_workers;                  /* started */
    /* The sampling pool: a decode step's rows are sampled in parallel, then taken in order. */
    pthread_mutex_t pool_lock;
    pthread_cond_t pool_go, pool_done;
    uint64_t pool_gen;              /* bumped per job */
    int pool_rows, pool_finished;
    atomic_int pool_next;
    bool pool_quit;
    struct dsv4_sample *row_sample; /* [max_batch] */
    int *row_rc;                    /* [max_batch] */
    char (*row_err)[DSV4_SCHED_ERROR_MAX];  /* [max_batch] messages of failed rows */
    bool device_sampling;           /* the backend samples where its logits are (ops->sample) */
    /* Speculative decoding: drafts per step (0: off; the backend's spec_tokens when it has the ops and
     * the host samples). A step's decode becomes draft, verify, accept: see spec_decode(). */
    int spec;
    int events_per_slot;            /* event room one step may need per slot: 3 + spec */
    int *spec_k;                    /* [max_batch] drafts asked of each decode row */
    int *spec_made;                 /* [max_batch] drafts made */
    int32_t *spec_drafts;           /* [max_batch, spec] */
    int32_t *spec_rows;             /* [max_batch, spec + 1] the verify's tokens: pending, then drafts */
    struct {
        uint64_t steps, drafted, accepted, hist[DSV4_SPEC_TOKENS_MAX + 1];
    } step_spec;                    /* this step's, added to st at its end */
    struct dsv4_backend_sample_req *sreq;   /* [max_batch] its rows */
    char *smsg;                     /* [max_batch, DSV4_BACKEND_MSG_MAX] its row messages */
    char *scratch;                  /* [4 + TOKEN_BYTES_MAX] raw bytes awaiting UTF-8 repair */

    bool stop_asked, draining;
    /* The backend returned -ENOTRECOVERABLE: every request ends with an error, no new one is taken.
     * Written by the engine thread under the lock. */
    int fatal;
    char fatal_msg[DSV4_SCHED_ERROR_MAX];
    uint64_t drain_deadline_ns;
    struct dsv4_sched_stats st;     /* st.backend: copied on the engine thread after each step */
    uint64_t busy_ns;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

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

/* ---- UTF-8 repair (as Rust's from_utf8_lossy; base/utf8.h scans) ---- */

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

/* ---- the sampling pool ---- */

struct pool_arg {
    struct dsv4_sched *s;
    int index;
};

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

static void *pool_worker(void *arg)
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

static bool backend_fatal(struct dsv4_sched *s, int r, const char *what);

/* Device sampling of rows [0, n): request reqs[k] (running-list indices) for row k of the call just
 * made, into row_sample/row_rc/row_err (a failure of the whole call fails every row). Returns true
 * when the backend failed for good (backend_fatal: every running request has ended). */
static bool sample_on_device(struct dsv4_sched *s, int n, const int *reqs)
{
    for (int k = 0; k < n; k++) {
        const struct sched_req *q = &s->reqs[reqs[k]];
        s->sreq[k] = (struct dsv4_backend_sample_req){ .slot = q->slot, .params = &q->sampling, .seed = q->seed,
                                                       .index = (uint64_t)q->result.n_tokens };
    }
    int r = s->backend->ops->sample(s->backend, n, s->sreq, s->row_sample, s->row_rc, s->smsg);
    if (backend_fatal(s, r, "sampling"))
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
static void sample_decode_rows(struct dsv4_sched *s, int n)
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
    s->eos = b->weights->cfg.eos_id;
    s->lim = lim;
    s->event_fd = -1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    pthread_mutex_init(&s->pool_lock, NULL);
    pthread_cond_init(&s->pool_go, NULL);
    pthread_cond_init(&s->pool_done, NULL);
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
    s->workers = sched_alloc(s, (size_t)s->n_threads, sizeof(*s->workers));
    s->row_sample = sched_alloc(s, (size_t)max_batch, sizeof(*s->row_sample));
    s->row_rc = sched_alloc(s, (size_t)max_batch, sizeof(*s->row_rc));
    if (s->device_sampling) {
        s->sreq = sched_alloc(s, (size_t)max_batch, sizeof(*s->sreq));
        s->smsg = sched_alloc(s, (size_t)max_batch, DSV4_BACKEND_MSG_MAX);
    }
    s->row_err = sched_alloc(s, (size_t)max_batch, sizeof(*s->row_err));
    if (!s->reqs || !s->outs || !s->slot_req || !s->running || !s->counts || !s->seen || !s->events ||
        !s->logits || !s->dec_slots || !s->dec_tokens || !s->dec_reqs || !s->scratch || !s->samplers ||
        !s->workers || !s->row_sample || !s->row_rc || !s->row_err ||
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
    for (int i = 1; i < s->n_threads; i++) {
        struct pool_arg *a = sched_alloc(s, 1, sizeof(*a));    /* the worker frees it */
        if (!a) {
            r = dsv4_error_set(-ENOMEM, "scheduler: out of memory for sampler threads");
            goto fail;
        }
        a->s = s;
        a->index = i;
        int e = pthread_create(&s->workers[i - 1], NULL, pool_worker, a);
        if (e) {
            free(a);
            r = dsv4_error_set(-e, "scheduler: starting sampler thread %d: %s", i, strerror(e));
            goto fail;
        }
        s->n_workers++;
    }
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
    if (s->n_workers) {
        pthread_mutex_lock(&s->pool_lock);
        s->pool_quit = true;
        pthread_cond_broadcast(&s->pool_go);
        pthread_mutex_unlock(&s->pool_lock);
        for (int i = 0; i < s->n_workers; i++)
            pthread_join(s->workers[i], NULL);
    }
    if (s->samplers)
        for (int i = 0; i < s->n_threads; i++)
            dsv4_sampler_destroy(s->samplers[i]);
    free(s->samplers);
    free(s->workers);
    free(s->row_sample);
    free(s->row_rc);
    free(s->row_err);
    free(s->sreq);
    free(s->smsg);
    pthread_cond_destroy(&s->pool_go);
    pthread_cond_destroy(&s->pool_done);
    pthread_mutex_destroy(&s->pool_lock);
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
    q->result.timings.submit_ns = now_ns();

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
        s->drain_deadline_ns = now_ns() + (uint64_t)(grace_s > 0 ? grace_s * 1e9 : 0);
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
    ret->tokens_per_s = s->busy_ns ? (double)s->st.generated_tokens / ret->busy_s : 0.0;
    pthread_mutex_unlock(&s->lock);
}

/* ---- engine-thread side ---- */

static struct dsv4_sched_event *stage_event(struct dsv4_sched *s, enum dsv4_sched_event_type type,
                                            const struct sched_req *q)
{
    /* The caller reserved room: step() refuses to start without 2 events per slot free. */
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
 * the slot returns to the free set under the lock, in unlink_finished()). */
static void clear_slot(struct dsv4_sched *s, struct sched_req *q)
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
    s->backend->ops->slot_reset(s->backend, q->slot);
}

/* Under the lock: requests finished since the last call become FINISHED, free their slots and leave
 * the running list. */
static void unlink_finished(struct dsv4_sched *s)
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
    }
    s->n_running = w;
}

/* End a request: flush its text, fill the result, reset its slot, stage its FINISH event. It becomes
 * FINISHED (slot free) under the lock: at once for a queued one, in unlink_finished() for a running
 * one. Its record and output buffer wait for release(). */
static void finish(struct dsv4_sched *s, struct sched_req *q, enum dsv4_finish_reason why, int error,
                   const char *message)
{
    struct dsv4_sched_result *res = &q->result;
    uint64_t t = now_ns();
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
    clear_slot(s, q);
    struct dsv4_sched_event *e = stage_event(s, DSV4_SCHED_EVENT_FINISH, q);
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
static void take_token(struct dsv4_sched *s, struct sched_req *q, const struct dsv4_sample *smp)
{
    struct dsv4_sched_result *res = &q->result;
    struct sched_out *o = &s->outs[q->out];
    int32_t tok = smp->token;
    uint64_t t = now_ns();
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
        if (utf8_append(o->text, (size_t)s->lim.max_output_bytes, &res->text_len, q->raw, q->n_raw, true,
                        raw, &n_raw) < 0 && why != DSV4_FINISH_STOP)
            why = DSV4_FINISH_LENGTH;
        q->n_raw = 0;
    }
    size_t safe = res->text_len;
    if (why == DSV4_FINISH_NONE) {
        size_t hold = stop_holdback(q, o->text, res->text_len);
        safe = res->text_len - hold;
        if (safe < q->emitted)
            safe = q->emitted;
    }
    struct dsv4_sched_event *e = stage_event(s, DSV4_SCHED_EVENT_TOKEN, q);
    e->index = index;
    e->sample = *smp;
    if (safe > q->emitted) {
        e->delta_len = safe - q->emitted;
        memcpy(e->delta, o->text + q->emitted, e->delta_len);
        q->emitted = safe;
    }
    if (why != DSV4_FINISH_NONE)
        finish(s, q, why, err, err ? msg : NULL);
}

static void sample_row(struct dsv4_sched *s, struct sched_req *q, const float *row)
{
    struct dsv4_sampler_history hist = {
        .counts = s->counts + (size_t)q->slot * (size_t)s->vocab,
        .seen = s->seen + (size_t)q->slot * s->seen_stride,
    };
    struct dsv4_sample smp;
    int r = dsv4_sampler_sample(s->samplers[0], &q->sampling, row, &hist, q->seed,
                                (uint64_t)q->result.n_tokens, &smp);
    if (r < 0) {
        char msg[DSV4_SCHED_ERROR_MAX];
        snprintf(msg, sizeof(msg), "sampling: %s", dsv4_error_message());
        finish(s, q, DSV4_FINISH_ERROR, r, msg);
        return;
    }
    take_token(s, q, &smp);
}

static void fail_request(struct dsv4_sched *s, struct sched_req *q, int r, const char *what)
{
    char msg[DSV4_SCHED_ERROR_MAX];
    snprintf(msg, sizeof(msg), "%s: %s", what, dsv4_error_message());
    finish(s, q, DSV4_FINISH_ERROR, r, msg);
}

static int batch_bucket(int n)
{
    int b = 0;
    while (b < DSV4_SCHED_BATCH_BUCKETS - 1 && n > (1 << b))
        b++;
    return b;
}

/* ---- prefix cache (engine thread) ---- */

struct save_ctx {
    struct dsv4_backend *b;
    int slot;
};

static int save_slot(void *ctx, const int32_t *block_pages, const int32_t *boundary_pages)
{
    const struct save_ctx *x = ctx;
    return x->b->ops->prefix_save(x->b, x->slot, block_pages, boundary_pages);
}

/* Before q's first prefill: restore the longest cached prefix of its prompt, all but the last token
 * (prefill makes that one's logits). Returns 0, or the backend's error (q is then finished). */
static int prefix_restore(struct dsv4_sched *s, struct sched_req *q)
{
    struct dsv4_backend *b = s->backend;
    struct dsv4_prefix_hit hit;
    q->cache_looked = true;
    if (!s->prefix)
        return 0;
    q->caching = true;
    dsv4_prefix_cache_lookup(s->prefix, q->prompt, q->n_prompt - 1, &hit);
    q->cache_match = hit.matched_blocks;
    if (hit.node == DSV4_PREFIX_ROOT)
        return 0;
    q->cache_node = hit.node;       /* released with the slot, also when the load fails */
    int r = b->ops->prefix_load(b, q->slot, hit.n_blocks, hit.block_pages, hit.boundary_pages, q->prompt);
    if (r < 0) {
        fail_request(s, q, r, "restoring the cached prefix");
        return r;
    }
    const int n = hit.n_blocks * s->block;
    uint8_t *seen = s->seen + (size_t)q->slot * s->seen_stride;
    for (int i = 0; i < n; i++)
        seen[q->prompt[i] / 8] |= (uint8_t)(1u << (q->prompt[i] % 8));
    q->n_prefilled = n;
    q->position = n;
    q->result.cached_tokens = n;
    return 0;
}

/* The tokens of the block that ends at q's position: prompt, then the generated tokens fed since. */
static const int32_t *fed_block(struct dsv4_sched *s, const struct sched_req *q)
{
    const int64_t start = q->position - s->block;
    if (q->position <= q->n_prompt)
        return q->prompt + start;
    const int32_t *gen = s->outs[q->out].tokens;
    for (int i = 0; i < s->block; i++)
        s->block_tokens[i] = start + i < q->n_prompt ? q->prompt[start + i] : gen[start + i - q->n_prompt];
    return s->block_tokens;
}

/* q's slot has reached a block boundary: its state becomes (or meets) the next node of its chain.
 * When the cache has no room, or the copy fails (the slot itself is unchanged), q stops snapshotting
 * and runs on. */
static void prefix_snapshot(struct dsv4_sched *s, struct sched_req *q, bool hot)
{
    struct save_ctx ctx = { s->backend, q->slot };
    int32_t node;
    int r = dsv4_prefix_cache_extend(s->prefix, q->cache_node, fed_block(s, q), hot, save_slot, &ctx, &node);
    if (backend_fatal(s, r, "saving a prefix"))
        return;
    dsv4_prefix_cache_release(s->prefix, q->cache_node);
    q->cache_node = r == 0 ? node : DSV4_PREFIX_ROOT;
    q->caching = r == 0;
}

/* A backend call returned r: when that is -ENOTRECOVERABLE (the device is gone, a sticky CUDA error)
 * nothing can run any more. Every running request ends now with the error; queued ones end at the
 * next admit(), new ones are refused, and dsv4_sched_run() returns r once all have ended. Returns
 * true when it was fatal. */
static bool backend_fatal(struct dsv4_sched *s, int r, const char *what)
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
            finish(s, q, DSV4_FINISH_ERROR, r, s->fatal_msg);
    }
    return true;
}

/* ---- speculative decoding (engine thread) ---- */

/* Drafts worth asking for q at this step: what its output, its context and (while its state is being
 * snapshotted) its next block boundary leave room for. A verify of k drafts feeds k + 1 rows at
 * positions P..P+k and can give k + 1 tokens. */
static int spec_room(const struct dsv4_sched *s, const struct sched_req *q)
{
    int k = s->spec;
    int out_left = q->max_tokens - q->result.n_tokens - 1;
    int64_t ctx_left = (int64_t)s->max_context - q->position - 1;
    if (k > out_left)
        k = out_left;
    if (k > ctx_left)
        k = (int)ctx_left;
    if (q->caching) {
        int to_boundary = s->block - (int)(q->position % s->block) - 1;
        if (k > to_boundary)
            k = to_boundary;
    }
    return k > 0 ? k : 0;
}

/* The decode of n rows (dec_reqs, dec_slots, dec_tokens) with drafts. Each row's slot gets drafts from
 * the backend's MTP block, then one verify feeds the pending token and the drafts; the rows' logits
 * are sampled in order, exactly as plain decode would sample them (same history, same seed and
 * output index), and a draft is accepted when the token sampled before it equals it. That is the
 * rejection rule for a draft that is certain (the MTP block's greedy pick): accepted with probability
 * p(draft), and on rejection the token comes from p without the draft, renormalized. Sampling with
 * the same Philox draw as plain decode makes the tokens identical to decoding without drafts, so the
 * output never depends on the drafts, the batch or the prefix cache: only the speed does. The first
 * rejected (or finishing) row ends the slot's step; accept() takes back the rows after it. */
static void spec_decode(struct dsv4_sched *s, int n)
{
    struct dsv4_backend *b = s->backend;
    int S = s->spec, V = s->vocab;
    for (int k = 0; k < n; k++)
        s->spec_k[k] = spec_room(s, &s->reqs[s->dec_reqs[k]]);
    int r = b->ops->draft(b, n, s->dec_slots, s->dec_tokens, s->spec_k, s->spec_drafts, s->spec_made);
    if (backend_fatal(s, r, "draft"))
        return;
    for (int k = 0; k < n; k++) {
        if (r < 0)
            s->spec_made[k] = 0;    /* a failed draft costs speed only */
        int32_t *row = s->spec_rows + (size_t)k * (size_t)(S + 1);
        row[0] = s->dec_tokens[k];
        memcpy(row + 1, s->spec_drafts + (size_t)k * (size_t)S, (size_t)s->spec_made[k] * sizeof(int32_t));
        s->spec_k[k] = s->spec_made[k] + 1;     /* from here on: the rows of each verify */
    }
    r = b->ops->verify(b, n, s->dec_slots, s->spec_k, s->spec_rows, s->logits);
    if (backend_fatal(s, r, "verify"))
        return;
    for (int k = 0; k < n; k++) {
        struct sched_req *q = &s->reqs[s->dec_reqs[k]];
        if (r < 0) {
            fail_request(s, q, r, "verify");
            continue;
        }
        if (q->done)
            continue;
        const int32_t *draft = s->spec_rows + (size_t)k * (size_t)(S + 1) + 1;
        int rows = s->spec_k[k], made = rows - 1, keep = rows, accepted = 0;
        struct dsv4_sampler_history hist = {
            .counts = s->counts + (size_t)q->slot * (size_t)V,
            .seen = s->seen + (size_t)q->slot * s->seen_stride,
        };
        for (int j = 0; j < rows; j++) {
            const float *lg = s->logits + ((size_t)k * (size_t)(S + 1) + (size_t)j) * (size_t)V;
            struct dsv4_sample smp;
            int rc = dsv4_sampler_sample(s->samplers[0], &q->sampling, lg, &hist, q->seed,
                                         (uint64_t)q->result.n_tokens, &smp);
            if (rc < 0) {
                char msg[DSV4_SCHED_ERROR_MAX];
                snprintf(msg, sizeof(msg), "sampling: %s", dsv4_error_message());
                finish(s, q, DSV4_FINISH_ERROR, rc, msg);
                break;
            }
            /* Row j's input is kept: its position is fed, as plain decode would have fed it. */
            if (j == rows - 1 || smp.token != draft[j]) {
                keep = j + 1;
                r = b->ops->accept(b, q->slot, keep);
                if (backend_fatal(s, r, "accept"))
                    return;
                if (r < 0) {
                    fail_request(s, q, r, "accept");
                    break;
                }
                q->position += keep;
                if (q->caching && q->position % s->block == 0)
                    prefix_snapshot(s, q, true);
                if (!q->done)
                    take_token(s, q, &smp);
                break;
            }
            accepted++;
            take_token(s, q, &smp);
            if (q->done)
                break;      /* finished on an accepted draft: the slot is reset, nothing to accept */
        }
        if (made > 0) {
            s->step_spec.steps++;
            s->step_spec.drafted += (uint64_t)made;
            s->step_spec.accepted += (uint64_t)accepted;
            s->step_spec.hist[accepted]++;
        }
    }
}

/* Under the lock: end cancelled (and, past a drain's grace, all) requests, then admit FIFO. */
static void admit(struct dsv4_sched *s, uint64_t t)
{
    bool past_grace = s->draining && t >= s->drain_deadline_ns;
    for (int k = 0; k < s->n_running; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (q->cancel || past_grace)
            finish(s, q, DSV4_FINISH_CANCELLED, 0, NULL);
    }
    unlink_finished(s);
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
            finish(s, q, why, why == DSV4_FINISH_ERROR ? s->fatal : 0,
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
        int slot = 0;
        while (s->slot_req[slot] >= 0)
            slot++;
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

    if (!s->lim.decode_stall_ms || s->prefill_ns_per_token <= 0.0)
        return budget;
    for (int k = 0; k < n_running && !decoding; k++)
        decoding = s->reqs[s->running[k]].generating;
    if (!decoding)
        return budget;
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

int dsv4_sched_step(struct dsv4_sched *s)
{
    uint64_t t0 = now_ns();
    pthread_mutex_lock(&s->lock);
    if (s->n_events - s->ev_count < s->events_per_slot * s->max_batch) {
        pthread_mutex_unlock(&s->lock);
        return -EAGAIN;
    }
    s->ev_staged = 0;
    s->step_generated = 0;
    memset(&s->step_spec, 0, sizeof(s->step_spec));
    admit(s, t0);
    int n_running = s->n_running;
    pthread_mutex_unlock(&s->lock);

    /* Prefill: oldest first, within the budget. Only the running list's first n_running entries
     * are ours to read: submit never touches it. */
    struct dsv4_backend *b = s->backend;
    int budget = step_prefill_budget(s, n_running);
    int prefill_tokens = 0;
    int r_restore;
    for (int k = 0; k < n_running; k++)
        s->reqs[s->running[k]].fresh = false;
    for (int k = 0; k < n_running && budget > 0 && !s->fatal; k++) {
        struct sched_req *q = &s->reqs[s->running[k]];
        if (q->generating)
            continue;
        if (!q->cache_looked && (r_restore = prefix_restore(s, q)) < 0) {
            if (backend_fatal(s, r_restore, "restoring a cached prefix"))
                break;
            continue;
        }
        /* chunks end on block boundaries while the slot's state is being snapshotted */
        for (;;) {
            int left = q->n_prompt - q->n_prefilled;
            int chunk = left < budget ? left : budget;
            if (q->caching && chunk > s->block - (int)(q->position % s->block))
                chunk = s->block - (int)(q->position % s->block);
            bool last = chunk == left;
            float *lg = last && !s->device_sampling ? s->logits : NULL;
            const uint64_t tp = now_ns();
            int r = b->ops->prefill(b, q->slot, q->prompt + q->n_prefilled, chunk, lg, false);
            if (r == 0)
                note_prefill_rate(s, chunk, now_ns() - tp);
            if (r < 0) {
                if (!backend_fatal(s, r, "prefill"))
                    fail_request(s, q, r, "prefill");
                break;
            }
            uint8_t *seen = s->seen + (size_t)q->slot * s->seen_stride;
            for (int i = q->n_prefilled; i < q->n_prefilled + chunk; i++)
                seen[q->prompt[i] / 8] |= (uint8_t)(1u << (q->prompt[i] % 8));
            q->n_prefilled += chunk;
            q->position += chunk;
            budget -= chunk;
            prefill_tokens += chunk;
            /* hot: the prompt's last boundary, or where the prompt leaves the cached chain */
            if (q->caching && q->position % s->block == 0)
                prefix_snapshot(s, q, q->position + s->block > q->n_prompt ||
                                          q->position / s->block == q->cache_match);
            if (s->fatal)
                break;
            if (last) {
                q->generating = true;
                q->fresh = true;
                if (s->device_sampling) {
                    int ri = s->running[k];
                    if (sample_on_device(s, 1, &ri))
                        break;
                    if (s->row_rc[0] < 0)
                        finish(s, q, DSV4_FINISH_ERROR, s->row_rc[0], s->row_err[0]);
                    else
                        take_token(s, q, &s->row_sample[0]);
                } else {
                    sample_row(s, q, s->logits);
                }
                break;
            }
            if (budget == 0)
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
        spec_decode(s, n);
    } else if (n > 0 && !s->fatal) {
        int r = b->ops->decode(b, n, s->dec_slots, s->dec_tokens, s->device_sampling ? NULL : s->logits);
        if (backend_fatal(s, r, "decode"))
            n = 0;
        else if (r >= 0 && s->device_sampling && sample_on_device(s, n, s->dec_reqs))
            n = 0;
        else if (r >= 0 && !s->device_sampling)
            sample_decode_rows(s, n);
        for (int k = 0; k < n; k++) {
            struct sched_req *q = &s->reqs[s->dec_reqs[k]];
            if (r < 0) {
                fail_request(s, q, r, "decode");
                continue;
            }
            if (q->done)
                continue;   /* ended by a fatal backend error earlier in this loop */
            q->position++;
            if (q->caching && q->position % s->block == 0)
                prefix_snapshot(s, q, true);
            if (q->done)
                continue;
            if (s->row_rc[k] < 0)
                finish(s, q, DSV4_FINISH_ERROR, s->row_rc[k], s->row_err[k]);
            else
                take_token(s, q, &s->row_sample[k]);
        }
    }

    uint64_t t1 = now_ns();
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
    unlink_finished(s);
    s->st.generated_tokens += s->step_generated;
    if (worked) {
        s->st.steps++;
        s->st.prefill_tokens += (uint64_t)prefill_tokens;
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
        s->st.last_step_s = (double)(t1 - t0) * 1e-9;
        if (s->st.last_step_s > s->st.max_step_s)
            s->st.max_step_s = s->st.last_step_s;
    }
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
