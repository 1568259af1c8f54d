/* SPDX-License-Identifier: MIT */
/* Connections: the listening sockets' accepts, one client's socket, its frames and its bounded
 * buffers. Knows nothing of methods, requests or the server's lifecycle: each complete frame and each
 * close goes to the hooks its owner registered (server.c hands them to dispatch.c), and the owner
 * says when new connections are refused or no longer accepted. */
#ifndef DSV4_DAEMON_CONN_H
#define DSV4_DAEMON_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <systemd/sd-event.h>

#include "daemon/listen.h"
#include "daemon/settings.h"
#include "protocol/message.h"

/* Frames handled per readable event on one connection before the loop serves the others. */
#define DSV4_CONN_FRAMES_PER_WAKEUP 64
/* Stop reading a connection's requests while this much output waits for it (it resumes below). */
#define DSV4_CONN_OUTPUT_HIGH_WATER (1u << 20)

struct dsv4_conn;
struct dsv4_request;

struct dsv4_conn_hooks {
    /* One complete frame from c; its payload is valid until the next read of c. */
    void (*frame)(void *userdata, struct dsv4_conn *c, const uint8_t *payload, size_t len);
    /* c is closed and out of the set (its struct is freed by the reaper, later): let go of it. */
    void (*closed)(void *userdata, struct dsv4_conn *c);
    void *userdata;
};

struct dsv4_conn {
    struct dsv4_conn *prev, *next;
    struct dsv4_conns *set;
    uint64_t id;
    int fd;
    sd_event_source *src;
    sd_event_source *resume_src;        /* reads on after a pause or the per-wakeup frame cap */
    bool paused;                        /* output above high water: requests wait in the socket */
    uint64_t partial_since_ns;          /* when the frame the reader holds part of began; 0: none */
    uint64_t idle_since_ns;             /* when n_requests last became 0 (or the accept) */
    uint64_t sent_ns;                   /* when a write last took bytes (or the accept) */
    pid_t pid;
    uid_t uid;
    gid_t gid;
    bool read_eof;                      /* the client shut its side (half-close): answer, then close */
    bool closing;                       /* flush what is queued, then close */
    const char *close_reason;           /* why it is closing, for the log (static string) */
    bool closed;                        /* fd closed; freed by the reaper */
    struct dsv4_proto_reader reader;
    struct dsv4_proto_buf out;          /* encoded frames not yet written */
    /* Requests in flight, kept by dispatch.c; conn.c reads n_requests only (max_idle_per_uid, and the
     * close that follows a half-close). */
    struct dsv4_request *requests;
    int n_requests;
};

/* Every connection of the server, and the listening sockets they come from. */
struct dsv4_conns {
    const struct dsv4_settings *cfg;
    sd_event *event;
    struct dsv4_conn_hooks hooks;
    sd_event_source *listen_src[DSV4_LISTEN_MAX];
    int n_listen;
    struct dsv4_conn *head;
    int n;
    uint64_t next_id;
    uint64_t accepted_total, refused_total;
    bool accept_paused;                 /* out of file descriptors: resumes when one closes, or on retry */
    sd_event_source *accept_retry_src;  /* resumes a paused accept with no connection left to close */
    bool accept_stopped;                /* dsv4_conns_stop_accepting(): never resumes */
    int refuse_code;                    /* nonzero: every new connection is told this and closed */
    const char *refuse_message;
    struct dsv4_conn *zombies;          /* closed, freed from reap_src once the stack unwinds */
    sd_event_source *reap_src;
};

/* Set up the (empty) set; hooks are copied. Returns 0 or -errno with a message. */
int dsv4_conns_init(struct dsv4_conns *cs, sd_event *event, const struct dsv4_settings *cfg,
                    const struct dsv4_conn_hooks *hooks);
/* Accept connections from listening socket fd (named for the messages). */
int dsv4_conns_listen(struct dsv4_conns *cs, int fd, const char *name);
/* Tell every new connection code/message (static string) and close it, from now on. */
void dsv4_conns_refuse_new(struct dsv4_conns *cs, int code, const char *message);
/* Leave new clients in the listening sockets' backlog (systemd keeps its copy of the sockets). */
void dsv4_conns_stop_accepting(struct dsv4_conns *cs);
/* Close every connection now, free them, and drop the event sources (shutdown). */
void dsv4_conns_done(struct dsv4_conns *cs);
/* Close the connections that have held a partial frame for longer than frame_timeout, those being
 * closed whose client has taken none of their last messages for that long, and each uid's idle
 * connections beyond max_idle_per_uid (those idle longest first). */
void dsv4_conns_sweep(struct dsv4_conns *cs);

/* Write what the encoders appended to c->out; drops a client whose backlog passes max_output_buffer.
 * c may be closed afterwards (c->closed): callers check before touching it again. */
void dsv4_conn_flush(struct dsv4_conn *c);
/* Answer msgid with an error (protocol code, message NULL for the code's description). */
void dsv4_conn_send_error(struct dsv4_conn *c, uint32_t msgid, int code, const char *message);
/* Send an error notification and close once it is written. */
void dsv4_conn_fail(struct dsv4_conn *c, int code, const char *message);
/* Flush what is queued, then close (reason: a static string for the log). */
void dsv4_conn_close_after_flush(struct dsv4_conn *c, const char *reason);
/* Close now: the closed hook runs, the struct is freed later by the reaper. */
void dsv4_conn_close(struct dsv4_conn *c, const char *why);
/* c has no request in flight any more (dispatch.c): a client that half-closed its socket is closed
 * once the answers are written (from the loop, after what its caller still queues). */
void dsv4_conn_requests_ended(struct dsv4_conn *c);

#endif
