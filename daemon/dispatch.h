/* SPDX-License-Identifier: MIT */
/* Methods and engine events: each frame a connection reads becomes a reply or a request handed to the
 * scheduler, and the scheduler's events become token notifications and results. Uses conn.c to
 * answer; what it needs of the server it is given (the fields below), what it must tell the server
 * goes through the hooks server.c registers. */
#ifndef DSV4_DAEMON_DISPATCH_H
#define DSV4_DAEMON_DISPATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "daemon/conn.h"
#include "daemon/host.h"
#include "daemon/lifecycle.h"
#include "daemon/prompts.h"
#include "daemon/settings.h"
#include "engine/model/config.h"
#include "engine/text/chat.h"
#include "engine/text/tokenizer.h"
#include "protocol/message.h"

/* Prompts of more text than this are tokenized on the prompt worker (a few ms of encoding inline). */
#define DSV4_PROMPT_INLINE_BYTES (16u << 10)

struct dsv4_dispatch;

/* A generate request from its decode to its result (or a tokenize request while the prompt worker
 * encodes its text). Owned by the dispatcher; linked into its connection's list while the client is
 * there (conn NULL after the client left). */
struct dsv4_request {
    struct dsv4_request *all_prev, *all_next;   /* dispatch->requests */
    struct dsv4_request *conn_prev, *conn_next; /* conn->requests */
    struct dsv4_request *pending_next;          /* dispatch->pending_head: held until READY */
    struct dsv4_conn *conn;
    uint32_t msgid;
    bool submitted, pending, warmup;
    uint64_t sched_id;
    uint64_t accepted_ns;
    struct dsv4_proto_generate gen;     /* the decoded request (stop strings, sampling) */
    struct dsv4_tok_ids prompt;         /* kept valid until the scheduler releases the request */
    struct dsv4_proto_logprob *logprobs;/* [completion tokens] when logprobs were asked for */
    uint32_t n_logprobs, cap_logprobs;
    /* A large prompt is tokenized on the prompt worker (prompts.h): the request waits, tokenizing,
     * until its job comes back; a cancel or the client leaving meanwhile is acted on then. */
    struct dsv4_prompt_job job;
    struct dsv4_dispatch *dispatch;
    bool tokenizing, cancel_asked;
    bool tokenize_only;                 /* a tokenize request (gen holds its text), not a generate */
    int job_rc;
    struct dsv4_proto_error job_err;
};

struct dsv4_dispatch_hooks {
    /* The warm-up finished (ok or not). */
    void (*warmup_done)(void *userdata, bool ok, const char *what);
    /* A request ended with a fatal engine error (a sticky GPU fault): the engine is gone for good. */
    void (*engine_failed)(void *userdata, const char *why);
    /* Requests ended: a drain may be over. */
    void (*requests_ended)(void *userdata);
    void *userdata;
};

struct dsv4_dispatch_counters {
    uint64_t requests_total, requests_failed, requests_cancelled, requests_rejected;
    uint64_t prompt_tokens_total, generated_tokens_total;
};

struct dsv4_dispatch {
    /* Given by the server before the first frame; the server keeps *state and reason current. */
    const struct dsv4_settings *cfg;
    const struct dsv4_config *model;        /* config.json */
    const enum dsv4_server_state *state;
    const char *reason;                     /* health's reason */
    uint64_t start_ns;
    const struct dsv4_conns *conns;         /* for stats */
    struct dsv4_dispatch_hooks hooks;
    struct dsv4_prompt_worker *prompts;
    struct dsv4_host *host;

    /* The tokenizer and what the server derived from it before boot. */
    struct dsv4_tokenizer *tok;
    bool has_chat;                          /* the tokenizer has the chat tags */
    struct dsv4_chat_tags tags;
    int32_t bos_id;                         /* -1 when the tokenizer has no BOS tag */
    struct dsv4_proto_limits proto_limits;
    uint32_t vocab_size;                    /* ids a client may send: min(model, tokenizer) */
    size_t max_token_bytes;                 /* the most text one token stands for (no normalizer) */

    /* Once booted (dsv4_dispatch_engine_ready). */
    struct dsv4_sched *sched;
    uint64_t boot_device_allocs, boot_graph_captures;  /* backend counters when boot ended */
    uint64_t boot_sched_allocations;        /* the scheduler's allocation counter when boot ended */
    /* The scheduler's latency histograms once the warm-up had finished: the warm-up is no client's
     * request, so stats report what came after (queue, ttft, tpot, e2e). */
    struct {
        struct dsv4_sched_latency queue, ttft, tpot, e2e;
    } warmup_latency;

    struct dsv4_request *requests;          /* every live request */
    int n_requests;
    struct dsv4_request *pending_head, *pending_tail;
    int n_pending;
    struct dsv4_dispatch_counters counters;
};

/* The engine booted: requests go to sched from now on; its counters now are the boot's. */
void dsv4_dispatch_engine_ready(struct dsv4_dispatch *d, struct dsv4_sched *sched);
/* One decoded frame from c (the conn hook). */
void dsv4_dispatch_frame(struct dsv4_dispatch *d, struct dsv4_conn *c, const uint8_t *payload, size_t len);
/* The client is gone: cancel or drop its requests (the conn hook). */
void dsv4_dispatch_conn_gone(struct dsv4_dispatch *d, struct dsv4_conn *c);
/* The scheduler's eventfd is readable (userdata: the dispatcher). */
int dsv4_dispatch_engine_events(sd_event_source *src, int fd, uint32_t revents, void *userdata);
/* The prompt worker's eventfd is readable: prompts it tokenized go on to the engine (userdata: the
 * dispatcher). */
int dsv4_dispatch_prompts_done(sd_event_source *src, int fd, uint32_t revents, void *userdata);
/* Submit the boot warm-up through the same path as a client's request. */
int dsv4_dispatch_start_warmup(struct dsv4_dispatch *d);
/* READY: submit the requests held during boot. */
void dsv4_dispatch_submit_pending(struct dsv4_dispatch *d);
/* Answer every request held for boot with an error and drop it. */
void dsv4_dispatch_refuse_pending(struct dsv4_dispatch *d, int code, const char *message);
/* Free every request (shutdown). */
void dsv4_dispatch_free_all(struct dsv4_dispatch *d);

#endif
