/* Scheduler: continuous batching over a backend's fixed slots, the engine's serving core.
 *
 * Threads. One engine thread calls dsv4_sched_step() (or dsv4_sched_run(), which loops on it); it
 * alone touches the backend. Any other thread (the daemon's io thread) may call submit, cancel,
 * drain, next_event, release and stats: they take the scheduler's lock for a few microseconds and
 * never wait for a step. When the engine thread queues events it writes the eventfd returned by
 * dsv4_sched_event_fd(), so an sd-event loop can watch it (EPOLLIN) and then drain events with
 * dsv4_sched_next_event() until it returns 0.
 *
 * Memory. Everything is allocated in dsv4_sched_create(): request records (max_requests), output
 * buffers (max_batch + max_unreleased, each max_output_tokens ids and max_output_bytes of text),
 * per-slot penalty counts [max_batch, V], the event ring, the sampler workspace, the logits buffer
 * [max_batch, V]. No allocation per request or per step afterwards; stats.allocations counts every
 * allocation the scheduler made and stays flat after create. A request's prompt is NOT copied: the
 * submitter keeps it valid and unchanged until it releases the request. Stop strings and stop token
 * ids are copied into the request record (bounded below).
 *
 * A step. (1) Under the lock: finish cancelled requests (queued or running; a running one's slot is
 * reset and free for this very step), then admit queued requests FIFO into free slots: a request is
 * admitted whenever a slot and an output buffer are free, so nothing waits behind a request that
 * cannot be placed. (2) Prefill: sequences still in their prompt, oldest first, get chunks until the
 * step's prefill_budget tokens are spent; a sequence whose prompt completes samples its first token
 * from the chunk's last row. (3) One batched decode for every sequence that was already generating at
 * the start of the step. (4) Sample, check stops, queue events. A long prompt therefore delays the
 * others' next token by at most one prefill_budget-sized chunk per step.
 *
 * Stops (first match wins, in this order, after each sampled token):
 *   EOS (the model's eos id) or one of stop_token_ids -> DSV4_FINISH_STOP (the token is kept in
 *   tokens and counted in usage, its text is not added);
 *   a stop string appears in the text -> DSV4_FINISH_STOP (text is cut before the earliest match;
 *   matches may span tokens);
 *   max_tokens reached -> DSV4_FINISH_LENGTH;
 *   output byte limit reached (max_output_bytes) -> DSV4_FINISH_LENGTH;
 *   the slot is full (prompt + fed tokens == max_context) -> DSV4_FINISH_CONTEXT.
 *
 * Streaming text. Each token event carries the text delta made safe to show: it never ends inside a
 * UTF-8 sequence and never shows a suffix that could still grow into a stop string; what is held
 * back is released by a later token's delta (or dropped if it became a stop string). The last token
 * event of a request flushes everything (a trailing incomplete UTF-8 sequence included), so the
 * concatenated deltas equal result.text for every finish except CANCELLED and ERROR. */
#ifndef DSV4_ENGINE_SCHEDULER_H
#define DSV4_ENGINE_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/sampler.h"

#define DSV4_SCHED_STOP_STRINGS_MAX 16      /* stop strings per request */
#define DSV4_SCHED_STOP_LEN_MAX 128         /* bytes per stop string */
#define DSV4_SCHED_STOP_TOKENS_MAX 64       /* stop_token_ids per request */
#define DSV4_SCHED_TOKEN_BYTES_MAX 256      /* bytes one token's text may take */
/* A delta holds back at most STOP_LEN_MAX - 1 bytes plus an incomplete UTF-8 sequence (3), then adds
 * one token's bytes. */
#define DSV4_SCHED_DELTA_MAX (DSV4_SCHED_TOKEN_BYTES_MAX + DSV4_SCHED_STOP_LEN_MAX + 4)
#define DSV4_SCHED_ERROR_MAX 256
#define DSV4_SCHED_BATCH_BUCKETS 9          /* decode batch sizes 1, 2, 3-4, 5-8, ..., 129+ */
#define DSV4_SCHED_REQUESTS_MAX 65536       /* max_requests ceiling */

struct dsv4_tokenizer;
struct dsv4_sched;

/* How generated ids become text: the bytes token `id` contributes (byte-level BPE decoded); returns
 * the length (0..cap) or -errno. Used only on the engine thread. */
struct dsv4_sched_detok {
    int (*token_bytes)(void *ctx, int32_t id, char *buf, size_t cap);
    void *ctx;
};

struct dsv4_sched_limits {
    int max_requests;       /* queued + running + finished-but-not-released; 0 = 4 * max_batch */
    int prefill_budget;     /* prompt tokens prefilled per step, all sequences together; 0 = 512 */
    int max_output_tokens;  /* per request; 0 = min(max_context, 32768) */
    int max_output_bytes;   /* text per request; 0 = 8 * max_output_tokens */
    int max_unreleased;     /* finished requests holding output buffers until released; 0 = max_batch */
    /* Text from ids: when token_bytes is set it is used and the tokenizer may be NULL (tests, tools). */
    struct dsv4_sched_detok detok;
};

enum dsv4_finish_reason {
    DSV4_FINISH_NONE = 0,       /* still running */
    DSV4_FINISH_STOP,           /* EOS, a stop token id or a stop string */
    DSV4_FINISH_LENGTH,         /* max_tokens or the output byte limit */
    DSV4_FINISH_CONTEXT,        /* the slot's max_context tokens are used */
    DSV4_FINISH_CANCELLED,      /* dsv4_sched_cancel() or a drain past its grace */
    DSV4_FINISH_ERROR,          /* backend or detokenizer failure: result.error, result.error_message */
};

const char *dsv4_finish_reason_name(enum dsv4_finish_reason r);    /* "stop", "length", ... */

struct dsv4_sched_request {
    const int32_t *prompt;          /* [n_prompt] ids; kept valid by the caller until release */
    int n_prompt;                   /* 1..max_context */
    int max_tokens;                 /* 0 = as many as fit (max_output_tokens, then context) */
    struct dsv4_sampling sampling;
    const char *const *stop;        /* n_stop NUL-terminated strings (copied), each 1..STOP_LEN_MAX bytes */
    int n_stop;
    const int32_t *stop_token_ids;  /* n_stop_token_ids ids (copied) */
    int n_stop_token_ids;
    void *user;                     /* opaque, handed back in every event */
};

/* Per-request timings, nanoseconds of CLOCK_MONOTONIC; 0 where the phase was never reached. */
struct dsv4_sched_timings {
    uint64_t submit_ns, admit_ns, first_token_ns, finish_ns;
    double queue_s;                 /* submit -> admitted into a slot */
    double prefill_s;               /* admitted -> first token sampled */
    double decode_s;                /* first token -> finish */
    double decode_tokens_per_s;     /* (completion_tokens - 1) / decode_s; 0 if undefined */
};

struct dsv4_sched_result {
    uint64_t id;
    void *user;
    enum dsv4_finish_reason finish;
    int32_t stop_token;             /* the id that stopped it (EOS or a stop id), else -1 */
    int stop_string;                /* index into the request's stop strings, else -1 */
    int error;                      /* negative errno when finish == ERROR */
    char error_message[DSV4_SCHED_ERROR_MAX];
    const int32_t *tokens;          /* [n_tokens] every generated id; valid until release */
    int n_tokens;
    const char *text;               /* [text_len] generated text, NUL-terminated; valid until release */
    size_t text_len;
    uint64_t seed;                  /* the seed actually used (drawn when the request had none) */
    int prompt_tokens, completion_tokens;   /* usage */
    struct dsv4_sched_timings timings;
};

enum dsv4_sched_event_type {
    DSV4_SCHED_EVENT_TOKEN,
    DSV4_SCHED_EVENT_FINISH,
};

struct dsv4_sched_event {
    enum dsv4_sched_event_type type;
    uint64_t id;
    void *user;
    /* TOKEN: */
    int index;                      /* output index of this token, from 0 */
    struct dsv4_sample sample;      /* token, logprob, top-n */
    size_t delta_len;
    char delta[DSV4_SCHED_DELTA_MAX];   /* not NUL-terminated */
    /* FINISH: valid until dsv4_sched_release(id); no event for this id follows it. */
    const struct dsv4_sched_result *result;
};

struct dsv4_sched_stats {
    uint64_t steps;                 /* steps that did work */
    uint64_t decode_steps;
    uint64_t prefill_tokens, generated_tokens;
    uint64_t submitted, rejected, finished[DSV4_FINISH_ERROR + 1];
    uint64_t batch_hist[DSV4_SCHED_BATCH_BUCKETS];  /* decode batch sizes, see BATCH_BUCKETS */
    double busy_s;                  /* time spent inside steps that did work */
    double tokens_per_s;            /* generated_tokens / busy_s */
    double last_step_s, max_step_s;
    int slots_total, slots_in_use;
    int queued;                     /* submitted, not yet admitted */
    int unreleased;                 /* finished, waiting for dsv4_sched_release() */
    int events_pending;
    uint64_t allocations;           /* allocations the scheduler made; flat after create */
    struct dsv4_backend_stats backend;
};

/* Create over a backend (borrowed, must outlive the scheduler) and a tokenizer (borrowed; may be
 * NULL when limits->detok is set). Sizes come from the backend's opts (max_batch, max_context) and
 * the model's vocab_size; EOS is the model config's eos_id. */
int dsv4_sched_create(struct dsv4_backend *b, const struct dsv4_tokenizer *tok,
                      const struct dsv4_sched_limits *limits, struct dsv4_sched **ret);
void dsv4_sched_destroy(struct dsv4_sched *s);

/* Queue a request; *ret_id identifies it in events, cancel and release. Copies stop strings and ids.
 * Fails with a message naming the field and limit: -EINVAL (bad params or ids), -E2BIG (prompt or
 * max_tokens over the limits), -EAGAIN (max_requests in the engine), -ESHUTDOWN (draining). */
int dsv4_sched_submit(struct dsv4_sched *s, const struct dsv4_sched_request *req, uint64_t *ret_id);

/* Ask for a request to end (client gone, or told so). Any thread. The slot is freed at the next
 * step and a FINISH event with DSV4_FINISH_CANCELLED follows (unless it finished first). Returns 0,
 * or -ENOENT when the id is unknown or already finished. */
int dsv4_sched_cancel(struct dsv4_sched *s, uint64_t id);

/* Take the oldest queued event (copied into *ev). Returns 1, or 0 when none. Any thread. */
int dsv4_sched_next_event(struct dsv4_sched *s, struct dsv4_sched_event *ev);

/* Give back a finished request's record and output buffer (after its FINISH event was handled;
 * its prompt is no longer read). Returns 0 or -ENOENT. Any thread. */
int dsv4_sched_release(struct dsv4_sched *s, uint64_t id);

/* An eventfd (EFD_NONBLOCK) that becomes readable when events are queued; reading it resets it.
 * Owned by the scheduler. */
int dsv4_sched_event_fd(const struct dsv4_sched *s);

/* One step on the engine thread. Returns 1 when it did work, 0 when there was nothing to do, -EAGAIN
 * when the event ring has no room for a step's events (drain events, then step again), or a negative
 * errno for a failure of the scheduler itself (failed requests end with FINISH_ERROR instead). */
int dsv4_sched_step(struct dsv4_sched *s);

/* The engine thread's loop: step while there is work, sleep while idle or while the event ring is
 * full, return 0 after dsv4_sched_stop(), or once a drain has completed. */
int dsv4_sched_run(struct dsv4_sched *s);

/* Make dsv4_sched_run() return after its current step. Any thread. */
void dsv4_sched_stop(struct dsv4_sched *s);

/* Stop admitting: new submits fail with -ESHUTDOWN, queued requests finish CANCELLED at the next
 * step, running ones continue until grace_s from now has passed and are then cancelled. Any thread. */
void dsv4_sched_drain(struct dsv4_sched *s, double grace_s);

/* True when draining and no request is queued or running (finished ones may await release). */
bool dsv4_sched_drained(struct dsv4_sched *s);

/* A consistent snapshot. Any thread. */
void dsv4_sched_get_stats(struct dsv4_sched *s, struct dsv4_sched_stats *ret);

#endif
