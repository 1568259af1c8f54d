/* SPDX-License-Identifier: MIT */
/* The io thread: one sd-event loop owning the listening sockets, the connections, the protocol and
 * the tokenizer; it hands generate requests to the scheduler and turns the scheduler's events into
 * token notifications and results. Split into server.c (loop, lifecycle, systemd), conn.c (sockets,
 * frames, bounded buffers) and dispatch.c (methods, engine events). */
#ifndef DSV4_DAEMON_SERVER_H
#define DSV4_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <systemd/sd-event.h>

#include "daemon/host.h"
#include "daemon/listen.h"
#include "daemon/prompts.h"
#include "daemon/settings.h"
#include "engine/text/chat.h"
#include "engine/model/config.h"
#include "engine/text/tokenizer.h"
#include "protocol/message.h"

/* Frames handled per readable event on one connection before the loop serves the others. */
#define DSV4_CONN_FRAMES_PER_WAKEUP 64
/* Stop reading a connection's requests while this much output waits for it (it resumes below). */
#define DSV4_CONN_OUTPUT_HIGH_WATER (1u << 20)
/* Prompts of more text than this are tokenized on the prompt worker (a few ms of encoding inline). */
#define DSV4_PROMPT_INLINE_BYTES (16u << 10)
/* After the engine failed, how long health and hello still answer "failed" before the connections
 * close and the process exits (systemd restarts it): clients polling health learn why. */
#define DSV4_SERVER_FAILED_LINGER_USEC (1 * 1000000ull)
/* After the drain, how long the last responses may take to reach slow clients. */
#define DSV4_SERVER_FLUSH_USEC (2 * 1000000ull)
/* Boot steps extend systemd's start timeout by this much, each time the boot timer fires. */
#define DSV4_SERVER_EXTEND_USEC (60 * 1000000ull)
#define DSV4_SERVER_EXTEND_PERIOD_USEC (20 * 1000000ull)
#define DSV4_SERVER_REASON_MAX 512

enum dsv4_server_state {
    DSV4_SERVER_LOADING,        /* engine thread booting */
    DSV4_SERVER_WARMUP,         /* warm-up generation in flight */
    DSV4_SERVER_READY,
    DSV4_SERVER_DRAINING,       /* SIGTERM: finishing in-flight work, no new work */
    DSV4_SERVER_FAILED,         /* the engine failed: answering what is left, then exit 1 */
    DSV4_SERVER_EXITING,
};

struct dsv4_server;
struct dsv4_conn;

/* A generate request from its decode to its result (or a tokenize request while the prompt worker
 * encodes its text). Owned by the server; linked into its connection's list while the client is
 * there (conn NULL after the client left). */
struct dsv4_request {
    struct dsv4_request *all_prev, *all_next;   /* server->requests */
    struct dsv4_request *conn_prev, *conn_next; /* conn->requests */
    struct dsv4_request *pending_next;          /* server->pending_head: held until READY */
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
    struct dsv4_server *server;
    bool tokenizing, cancel_asked;
    bool tokenize_only;                 /* a tokenize request (gen holds its text), not a generate */
    int job_rc;
    struct dsv4_proto_error job_err;
};

struct dsv4_conn {
    struct dsv4_conn *prev, *next;
    struct dsv4_server *server;
    uint64_t id;
    int fd;
    sd_event_source *src;
    sd_event_source *resume_src;        /* reads on after a pause or the per-wakeup frame cap */
    bool paused;                        /* output above high water: requests wait in the socket */
    uint64_t partial_since_ns;          /* when the frame the reader holds part of began; 0: none */
    uint64_t idle_since_ns;             /* when n_requests last became 0 (or the accept) */
    pid_t pid;
    uid_t uid;
    gid_t gid;
    bool closing;                       /* flush what is queued, then close */
    const char *close_reason;           /* why it is closing, for the log (static string) */
    bool closed;                        /* fd closed; freed by the server's reaper */
    struct dsv4_proto_reader reader;
    struct dsv4_proto_buf out;          /* encoded frames not yet written */
    struct dsv4_request *requests;      /* generate requests in flight */
    int n_requests;
};

struct dsv4_server_counters {
    uint64_t connections_total, connections_refused;
    uint64_t requests_total, requests_failed, requests_cancelled, requests_rejected;
    uint64_t prompt_tokens_total, generated_tokens_total;
};

struct dsv4_server {
    const struct dsv4_settings *cfg;
    sd_event *event;
    enum dsv4_server_state state;
    char reason[DSV4_SERVER_REASON_MAX];    /* health's reason */
    int exit_code;

    struct dsv4_listeners listeners;
    sd_event_source *listen_src[DSV4_LISTEN_MAX];

    struct dsv4_config model;               /* config.json, read before boot */
    struct dsv4_tokenizer *tok;
    bool has_chat;                          /* the tokenizer has the chat tags */
    struct dsv4_chat_tags tags;
    int32_t bos_id;                         /* -1 when the tokenizer has no BOS tag */
    struct dsv4_proto_limits proto_limits;
    uint32_t vocab_size;                    /* ids a client may send: min(model, tokenizer) */
    size_t max_token_bytes;                 /* the most text one token stands for (no normalizer) */
    struct dsv4_prompt_worker *prompts;
    sd_event_source *prompts_src;

    struct dsv4_host *host;
    struct dsv4_sched *sched;               /* once booted */
    sd_event_source *boot_src, *sched_src;
    sd_event_source *watchdog_src, *extend_src, *drain_src;
    sd_event_source *linger_src;            /* engine failed: DSV4_SERVER_FAILED_LINGER_USEC */
    sd_event_source *sweep_src;             /* frame_timeout and max_idle_per_uid (conn.c) */
    uint64_t watchdog_usec, watchdog_last_steps;
    uint64_t boot_device_allocs, boot_graph_captures;  /* backend counters when boot ended */
    uint64_t boot_sched_allocations;        /* the scheduler's allocation counter when boot ended */

    struct dsv4_conn *conns;
    int n_conns;
    bool accept_paused;                     /* out of file descriptors: resumes when one closes */
    struct dsv4_conn *zombies;              /* closed, freed from reap_src once the stack unwinds */
    sd_event_source *reap_src;
    uint64_t next_conn_id;
    struct dsv4_request *requests;          /* every live request */
    int n_requests;
    struct dsv4_request *pending_head, *pending_tail;
    int n_pending;

    uint64_t start_ns, ready_ns;
    struct dsv4_server_counters counters;
};

uint64_t dsv4_now_ns(void);

/* server.c */
int dsv4_server_init(struct dsv4_server *s, const struct dsv4_settings *cfg);
int dsv4_server_run(struct dsv4_server *s);
void dsv4_server_done(struct dsv4_server *s);
/* The warm-up finished (ok or not): become READY or exit. */
void dsv4_server_warmup_done(struct dsv4_server *s, bool ok, const char *what);
/* The engine failed for good (a fatal backend error, a sticky GPU fault): refuse new work, let health
 * say why for DSV4_SERVER_FAILED_LINGER_USEC, then close the connections and exit 1. Once. */
void dsv4_server_engine_failed(struct dsv4_server *s, const char *why);
/* Called after events were handled: ends the drain when nothing is left. */
void dsv4_server_check_drained(struct dsv4_server *s);

/* conn.c */
int dsv4_conn_accept(struct dsv4_server *s, int listen_fd);
/* Write what the encoders appended to c->out; drops a client whose backlog passes max_output_buffer.
 * c may be closed afterwards (c->closed): callers check before touching it again. */
void dsv4_conn_flush(struct dsv4_conn *c);
/* Answer msgid with an error (protocol code, message NULL for the code's description). */
void dsv4_conn_send_error(struct dsv4_conn *c, uint32_t msgid, int code, const char *message);
/* Send an error notification and close once it is written. */
void dsv4_conn_fail(struct dsv4_conn *c, int code, const char *message);
/* Close now: its requests are cancelled, the struct is freed later by the reaper. */
void dsv4_conn_close(struct dsv4_conn *c, const char *why);
/* Free closed connections (from the reaper, and at shutdown). */
void dsv4_conn_reap(struct dsv4_server *s);
/* Recompute which events the connection waits for (reading pauses while its output backs up). */
void dsv4_conn_update_events(struct dsv4_conn *c);
/* Close the connections that have held a partial frame for longer than frame_timeout, and each
 * uid's idle connections beyond max_idle_per_uid (those idle longest first). */
void dsv4_conn_sweep(struct dsv4_server *s);

/* dispatch.c */
/* One decoded frame from c. */
void dsv4_dispatch_frame(struct dsv4_conn *c, const uint8_t *payload, size_t len);
/* The scheduler's eventfd is readable. */
int dsv4_dispatch_engine_events(sd_event_source *src, int fd, uint32_t revents, void *userdata);
/* Submit the boot warm-up through the same path as a client's request. */
int dsv4_dispatch_start_warmup(struct dsv4_server *s);
/* READY: submit the requests held during boot. */
void dsv4_dispatch_submit_pending(struct dsv4_server *s);
/* The client is gone: cancel or drop its requests. */
void dsv4_dispatch_conn_gone(struct dsv4_conn *c);
/* Answer every request held for boot with an error and drop it. */
void dsv4_dispatch_refuse_pending(struct dsv4_server *s, int code, const char *message);
/* Free every request (shutdown). */
void dsv4_dispatch_free_all(struct dsv4_server *s);
/* The prompt worker's eventfd is readable: prompts it tokenized go on to the engine. */
int dsv4_dispatch_prompts_done(sd_event_source *src, int fd, uint32_t revents, void *userdata);

#endif
