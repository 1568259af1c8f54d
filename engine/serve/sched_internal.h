/* SPDX-License-Identifier: MIT */
/* The scheduler's own pieces (engine/serve/scheduler.h is the contract): the request records, the
 * scheduler state every piece reads, and what the pieces call of each other. The calls point one
 * way: scheduler.c (create, destroy, the io-thread side) and sched_step.c (the engine thread's step)
 * use sched_spec.c (speculative decoding), sched_prefix.c (the prefix cache), sched_pool.c (sampling a
 * decode step's rows) and sched_emit.c (tokens, stops, text and events: what a step hands back);
 * sched_emit.c calls none of them.
 *
 * Locking. s->lock guards the queue, the free lists, every record's state/cancel fields, the event
 * ring's indices and the stats. The engine thread alone writes a running record's output (tokens,
 * text, result) and the ring entries past the published tail; publishing the tail under the lock
 * hands them to the reader. A record's request fields are written once by submit before it is
 * queued and only read afterwards. */
#ifndef DSV4_ENGINE_SERVE_SCHED_INTERNAL_H
#define DSV4_ENGINE_SERVE_SCHED_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "engine/model/ep_plan.h"
#include "engine/serve/scheduler.h"

struct dsv4_workpool;

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
    bool caching;                   /* the blocks the slot completes join its chain in the prefix cache */
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
    int chain_max;                  /* the most blocks a chain holds (dsv4_prefix_cache_chain_max) */
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
    int n_groups;                   /* the backend's slot groups (devices), 1..DSV4_EP_MAX_GPUS */
    int group_end[DSV4_EP_MAX_GPUS];    /* group g: slots [g ? group_end[g - 1] : 0, group_end[g]) */
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
    struct dsv4_sampler **samplers; /* [n_threads]: [0] the engine thread's, [i] pool part i's */
    int n_threads;
    /* The sampling pool: a decode step's rows are claimed one at a time by every part (the engine
     * thread is part 0), sampled, then taken in order. */
    struct dsv4_workpool *pool;
    int pool_rows;
    atomic_int pool_next;
    struct dsv4_sample *row_sample; /* [max_batch] */
    int *row_rc;                    /* [max_batch] */
    char (*row_err)[DSV4_SCHED_ERROR_MAX];  /* [max_batch] messages of failed rows */
    bool device_sampling;           /* the backend samples where its logits are (ops->sample) */
    /* Speculative decoding: drafts per step (0: off; the backend's spec_tokens when it has the ops and
     * the host samples). A step's decode becomes draft, verify, accept: see sched_spec_decode(). */
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
    uint64_t backend_ns, gap_ns;    /* stats.backend_s, stats.gap_s (under the lock) */
    uint64_t step_backend_ns;       /* this step's backend time so far (engine thread) */
    uint64_t last_end_ns;           /* when the last working step ended */
    bool running_at_end;            /* requests were running when it ended */
};

static inline uint64_t sched_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Every backend call is timed (stats.backend_s): t0 = sched_now_ns() before it, then this, which
 * returns the call's nanoseconds. */
static inline uint64_t sched_backend_time(struct dsv4_sched *s, uint64_t t0)
{
    const uint64_t ns = sched_now_ns() - t0;
    s->step_backend_ns += ns;
    return ns;
}

/* sched_emit.c (engine thread) */
/* A new event past the ring's tail, not yet published (the step reserved room for it). */
struct dsv4_sched_event *sched_stage_event(struct dsv4_sched *s, enum dsv4_sched_event_type type,
                                           const struct sched_req *q);
/* Reset q's slot in the backend and clear the penalty history q wrote. */
void sched_clear_slot(struct dsv4_sched *s, struct sched_req *q);
/* Under the lock: requests finished since the last call become FINISHED and free their slots. */
void sched_unlink_finished(struct dsv4_sched *s);
/* End q: flush its text, fill its result, reset its slot, stage its FINISH event. */
void sched_finish(struct dsv4_sched *s, struct sched_req *q, enum dsv4_finish_reason why, int error,
                  const char *message);
/* A token was sampled for q: record it, decide whether q stops, stream its delta. */
void sched_take_token(struct dsv4_sched *s, struct sched_req *q, const struct dsv4_sample *smp);
/* Draw q's next token from row with workspace sm, q's history, seed and output index into *smp (0 or
 * the sampler's error; any thread: it reads q and its slot's history, writes only sm and *smp). */
int sched_draw(const struct dsv4_sched *s, struct dsv4_sampler *sm, const struct sched_req *q, const float *row,
               struct dsv4_sample *smp);
/* sched_draw with the engine thread's workspace; on failure q is finished with the error and the
 * negative errno returned. */
int sched_sample(struct dsv4_sched *s, struct sched_req *q, const float *row, struct dsv4_sample *smp);
/* sched_sample, then take the token. */
void sched_sample_row(struct dsv4_sched *s, struct sched_req *q, const float *row);
/* End q with the error r of `what` (the message is dsv4_error_message()'s). */
void sched_fail_request(struct dsv4_sched *s, struct sched_req *q, int r, const char *what);
/* r from a backend call: true (every running request ended) when it is -ENOTRECOVERABLE. */
bool sched_backend_fatal(struct dsv4_sched *s, int r, const char *what);

/* sched_pool.c */
/* Device sampling of rows [0, n) of the call just made; true when the backend failed for good. */
bool sched_sample_on_device(struct dsv4_sched *s, int n, const int *reqs);
/* Host sampling of the decode step's n rows, on every pool thread. */
void sched_sample_decode_rows(struct dsv4_sched *s, int n);

/* sched_prefix.c (engine thread) */
/* Before q's first prefill: restore the longest cached prefix of its prompt (0, or the backend's error
 * with q finished). */
int sched_prefix_restore(struct dsv4_sched *s, struct sched_req *q);
/* Whether the slot's state at block boundary `boundary` is worth keeping longer: the prompt's last
 * boundary short of its last token (where the same prompt again resumes) and any after it, where
 * the prompt leaves the cached chain, the deepest boundary a chain can reach in the pool, or any
 * point while generating. */
bool sched_prefix_hot(const struct dsv4_sched *s, const struct sched_req *q, int64_t boundary);
/* q's slot moved on. When it stands on a block boundary, every block completed since the last that
 * joined q's chain joins it now (the backend saves their entries: they stay in the slot), the last
 * one with the slot's state there; mid-block the backends save nothing, so those blocks wait for the
 * next boundary the slot stands on (at the latest the prompt's last, where a chunk ends). At the
 * pool's chain_max blocks, when the cache has no room, or when a copy fails (the slot itself is
 * unchanged), q stops caching and runs on. */
void sched_prefix_advance(struct dsv4_sched *s, struct sched_req *q);

/* sched_spec.c (engine thread) */
/* The decode of the step's n rows with drafts, verify and accept. */
void sched_spec_decode(struct dsv4_sched *s, int n);

#endif
