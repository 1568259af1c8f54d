/* SPDX-License-Identifier: MIT */
/* libdsv4client: one connection per handle, requests answered in order on the calling thread, which
 * alone reads and writes the socket. Only dsv4_client_cancel() crosses threads: it marks the cancel
 * under a lock never held across I/O and wakes that thread, which writes the cancel frame itself. */
#include "build-config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client/dsv4client.h"
#include "protocol/message.h"

#define CLIENT_NAME "libdsv4client " PACKAGE_VERSION
#define CLIENT_MESSAGE_MAX 512

struct dsv4_client {
    int fd;                          /* -1 when not connected */
    int timeout_ms;
    uint32_t next_msgid;
    /* The generate call in progress, as dsv4_client_cancel() sees it from any thread: cancel_lock
     * guards the two flags and is never held across I/O, so a cancel never waits for the socket. */
    pthread_mutex_t cancel_lock;
    bool in_generate;
    bool cancel_wanted;
    int wake_fd;                     /* eventfd: a cancel wakes the generating thread's polls */
    /* The generating thread's side of a cancel. One that comes before the request is on the wire is
     * written right after it; one that comes while the request waits for room ends the call. */
    bool request_written;
    bool cancel_sent;
    bool cancel_begun;               /* part of the cancel frame is on the stream */
    struct dsv4_proto_buf cancel_out;    /* what of the cancel frame is not written yet */
    int64_t cancel_deadline;         /* when writing it gives up (-1: never) */
    int cancel_error;                /* a cancel that could not be written: the socket is shut down */
    uint32_t generate_msgid;
    struct dsv4_proto_reader reader;
    struct dsv4_proto_limits limits;
    struct dsv4_proto_buf out;       /* frames of the using thread */
    int server_code;
    char message[CLIENT_MESSAGE_MAX];
    struct dsv4_proto_hello_result hello;
    struct dsv4_client_info info;
    bool have_info;
};

static int fail(struct dsv4_client *c, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int fail(struct dsv4_client *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->message, sizeof(c->message), fmt, ap);
    va_end(ap);
    return rc;
}

static void reset_error(struct dsv4_client *c)
{
    c->server_code = 0;
    c->message[0] = '\0';
}

static void disconnect(struct dsv4_client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->cancel_error = 0;
    dsv4_proto_buf_reset(&c->cancel_out);
    dsv4_proto_reader_clear(&c->reader);
    dsv4_proto_reader_init(&c->reader, c->limits.max_frame);
}

struct dsv4_client *dsv4_client_new(void)
{
    struct dsv4_client *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->fd = -1;
    c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->wake_fd < 0) {
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->cancel_lock, NULL);
    dsv4_proto_limits_client(&c->limits);
    dsv4_proto_reader_init(&c->reader, c->limits.max_frame);
    c->next_msgid = 1;
    return c;
}

void dsv4_client_close(struct dsv4_client *c)
{
    if (!c)
        return;
    disconnect(c);
    dsv4_proto_reader_clear(&c->reader);
    dsv4_proto_buf_clear(&c->out);
    dsv4_proto_buf_clear(&c->cancel_out);
    dsv4_proto_hello_result_clear(&c->hello);
    close(c->wake_fd);
    pthread_mutex_destroy(&c->cancel_lock);
    free(c);
}

void dsv4_client_set_timeout(struct dsv4_client *c, int timeout_ms)
{
    c->timeout_ms = timeout_ms;
}

const char *dsv4_client_error_message(const struct dsv4_client *c)
{
    return c->message;
}

int dsv4_client_server_code(const struct dsv4_client *c)
{
    return c->server_code;
}

const char *dsv4_client_code_name(int code)
{
    return dsv4_proto_code_name(code);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* poll the socket until events or the deadline (-1: none); 0, -ETIMEDOUT or -errno. A cancel's wake-up
 * ends the wait as well (0: the caller looks at what it has to do, and waits again). */
static int wait_fd(struct dsv4_client *c, short events, int64_t deadline)
{
    for (;;) {
        int t = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0)
                return -ETIMEDOUT;
            t = left > 1 << 30 ? 1 << 30 : (int)left;
        }
        struct pollfd p[2] = { { .fd = c->fd, .events = events }, { .fd = c->wake_fd, .events = POLLIN } };
        int n = poll(p, 2, t);
        if (n > 0) {
            uint64_t v;
            if (p[1].revents && read(c->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
                return -errno;
            return 0;
        }
        if (n == 0)
            return -ETIMEDOUT;
        if (errno != EINTR)
            return -errno;
    }
}

int dsv4_client_connect_fd(struct dsv4_client *c, int fd)
{
    reset_error(c);
    disconnect(c);
    c->have_info = false;   /* the description belongs to the previous connection */
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        int e = errno;
        close(fd);
        return fail(c, -e, "socket: %s", strerror(e));
    }
    c->fd = fd;
    return 0;
}

int dsv4_client_connect(struct dsv4_client *c, const char *path, int timeout_ms)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    reset_error(c);
    if (!path || !*path)
        path = getenv(DSV4_CLIENT_SOCKET_ENV);
    if (!path || !*path)
        path = DSV4_CLIENT_DEFAULT_SOCKET;
    if (strlen(path) >= sizeof(sa.sun_path))
        return fail(c, -EINVAL, "socket path %s is longer than %zu bytes", path, sizeof(sa.sun_path) - 1);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fail(c, -errno, "socket: %s", strerror(errno));
    /* AF_UNIX refuses a non-blocking connect with EAGAIN while the listen backlog is full and leaves
     * the socket unconnected, with nothing to poll for. A blocking connect waits for room, for at
     * most SO_SNDTIMEO (then EAGAIN); connect_fd makes the socket non-blocking afterwards. */
    int64_t deadline = timeout_ms > 0 ? now_ms() + timeout_ms : -1;
    for (;;) {
        int e = 0;
        if (deadline >= 0) {
            int64_t left = deadline - now_ms();
            struct timeval tv = { .tv_sec = left / 1000, .tv_usec = (left % 1000) * 1000 };
            if (left <= 0)
                e = ETIMEDOUT;
            else if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0)
                e = errno;
        }
        if (e == 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            break;
        if (e == 0)
            e = errno == EAGAIN ? ETIMEDOUT : errno;
        if (e == EINTR)
            continue;   /* interrupted while waiting for room: still unconnected, try again */
        close(fd);
        return fail(c, -e, "connecting to %s: %s%s", path, strerror(e),
                    e == ENOENT || e == ECONNREFUSED ? " (is dsv4d running? see systemctl status dsv4d.socket)" : "");
    }
    return dsv4_client_connect_fd(c, fd);
}

static bool cancel_wanted(struct dsv4_client *c)
{
    pthread_mutex_lock(&c->cancel_lock);
    bool wanted = c->cancel_wanted;
    pthread_mutex_unlock(&c->cancel_lock);
    return wanted;
}

/* Write a whole frame; the fd stays non-blocking, poll waits for room. A generate request that must
 * wait for room stops at a cancel: -ECANCELED, *sent telling how much of it is on the stream. */
static int write_all(struct dsv4_client *c, const uint8_t *data, size_t len, bool is_generate, size_t *sent)
{
    int64_t deadline = c->timeout_ms > 0 ? now_ms() + c->timeout_ms : -1;
    *sent = 0;
    if (c->fd < 0)
        return -ENOTCONN;
    while (*sent < len) {
        ssize_t n = send(c->fd, data + *sent, len - *sent, MSG_NOSIGNAL);
        if (n > 0) {
            *sent += (size_t)n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (is_generate && cancel_wanted(c))
                return -ECANCELED;
            int rc = wait_fd(c, POLLOUT, deadline);
            if (rc < 0)
                return rc;
        } else {
            return n < 0 ? -errno : -ECONNRESET;
        }
    }
    return 0;
}

/* A cancel that could not be written may have left part of its frame on the stream, and the generate
 * would go on as though it had been sent: the socket is shut down, so that the next read ends the call
 * with cancel_error (after whatever had arrived: a whole result still counts) and closes the connection. */
static void cancel_failed(struct dsv4_client *c, int rc)
{
    dsv4_proto_buf_reset(&c->cancel_out);
    c->cancel_error = rc;
    shutdown(c->fd, SHUT_RDWR);
}

/* On the generating thread, between its reads: once its request is on the wire, queue a cancel that
 * was asked for and write what the socket takes of it without waiting; the read loop waits for room
 * for the rest, until cancel_deadline. */
static void flush_cancel(struct dsv4_client *c)
{
    if (!c->request_written || c->cancel_error)
        return;
    if (!c->cancel_sent && cancel_wanted(c)) {
        struct dsv4_proto_cancel req = { .msgid = c->generate_msgid };
        int rc = dsv4_proto_encode_cancel(&c->cancel_out, c->next_msgid++, &req);
        c->cancel_sent = true;
        c->cancel_deadline = c->timeout_ms > 0 ? now_ms() + c->timeout_ms : -1;
        if (rc < 0) {
            cancel_failed(c, rc);
            return;
        }
    }
    while (c->cancel_out.len > 0) {
        ssize_t n = send(c->fd, c->cancel_out.data, c->cancel_out.len, MSG_NOSIGNAL);
        if (n > 0) {
            c->cancel_begun = true;
            dsv4_proto_buf_consume(&c->cancel_out, (size_t)n);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (c->cancel_deadline >= 0 && now_ms() >= c->cancel_deadline)
                cancel_failed(c, -ETIMEDOUT);
            return;
        } else {
            cancel_failed(c, n < 0 ? -errno : -ECONNRESET);
            return;
        }
    }
}

/* The generate call ends on an open connection: a cancel none of which is on the stream is dropped,
 * the rest of one that is goes out before the next request can. */
static void finish_cancel(struct dsv4_client *c)
{
    if (!c->cancel_begun)
        dsv4_proto_buf_reset(&c->cancel_out);
    while (c->cancel_out.len > 0 && !c->cancel_error) {
        int rc = wait_fd(c, POLLOUT, c->cancel_deadline);
        if (rc < 0 && rc != -ETIMEDOUT)
            cancel_failed(c, rc);
        else
            flush_cancel(c);   /* gives up once past cancel_deadline */
    }
}

static int recv_message(struct dsv4_client *c, struct dsv4_proto_message *msg);
static int closed_by_server(struct dsv4_client *c, struct dsv4_proto_message *msg);

/* Send c->out. is_generate marks the generate request: -ECANCELED when a cancel stopped it before it
 * was all written, and then the connection is closed if part of it was (the server would read on in
 * a cut frame). */
static int send_out(struct dsv4_client *c, bool is_generate)
{
    size_t sent;
    int rc = write_all(c, c->out.data, c->out.len, is_generate, &sent);
    dsv4_proto_buf_reset(&c->out);
    if (rc == 0 && is_generate)
        c->request_written = true;
    if (rc == -ECANCELED) {
        if (sent > 0)
            disconnect(c);
        return rc;
    }
    if (rc == -ENOTCONN)
        return fail(c, rc, "not connected");
    if (rc == -EPIPE || rc == -ECONNRESET) {
        /* dsv4d may have said why it closed the connection (draining, too many connections) before
         * this write found it closed: that reason is the error, not the broken pipe. The peer is
         * gone, so these reads end at what it sent and never wait. */
        struct dsv4_proto_message msg;
        while (recv_message(c, &msg) == 0) {
            if (msg.kind == DSV4_PROTO_NOTIFICATION && msg.method == DSV4_PROTO_NOTIFY_ERROR)
                return closed_by_server(c, &msg);
            dsv4_proto_message_clear(&msg);
        }
    }
    if (rc < 0) {
        fail(c, rc, "sending to dsv4d: %s", strerror(-rc));
        disconnect(c);
    }
    return rc;
}

/* Next message from the server into msg; on failure the connection is closed. The timeout bounds the
 * whole frame, not each read: a server dribbling bytes cannot hold the call past it. */
static int recv_message(struct dsv4_client *c, struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 };
    int64_t deadline = c->timeout_ms > 0 ? now_ms() + c->timeout_ms : -1;
    for (;;) {
        const uint8_t *payload;
        size_t len;
        int rc = dsv4_proto_reader_next(&c->reader, &payload, &len, &err);
        if (rc == 1) {
            rc = dsv4_proto_message_decode(payload, len, &c->limits, msg, &err);
            if (rc == 0)
                return 0;
            dsv4_proto_message_clear(msg);
            disconnect(c);
            return fail(c, -EPROTO, "malformed message from dsv4d: %s", err.message);
        }
        if (rc < 0) {
            disconnect(c);
            return fail(c, -EPROTO, "malformed frame from dsv4d: %s", err.message);
        }
        uint8_t *space;
        size_t avail;
        if (c->fd < 0)
            return fail(c, -ENOTCONN, "not connected");
        if ((rc = dsv4_proto_reader_space(&c->reader, &space, &avail, &err)) < 0) {
            disconnect(c);
            return fail(c, rc == -ENOMEM ? rc : -EPROTO, "reading from dsv4d: %s", err.message);
        }
        flush_cancel(c);
        ssize_t n = recv(c->fd, space, avail, 0);
        if (n > 0) {
            dsv4_proto_reader_commit(&c->reader, (size_t)n);
            continue;
        }
        if (n == 0) {
            bool cut = dsv4_proto_reader_pending(&c->reader) > 0;
            int cancel_error = c->cancel_error;
            disconnect(c);
            if (cancel_error)
                return fail(c, cancel_error, "sending a cancel to dsv4d: %s; the connection is closed",
                            strerror(-cancel_error));
            return fail(c, -ECONNRESET, "dsv4d closed the connection%s", cut ? " in the middle of a frame" : "");
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            /* a cancel still to be written waits for room beside the answer, until its own deadline */
            bool cancelling = c->cancel_out.len > 0;
            int64_t d = deadline;
            if (cancelling && c->cancel_deadline >= 0 && (d < 0 || c->cancel_deadline < d))
                d = c->cancel_deadline;
            rc = wait_fd(c, POLLIN | (cancelling ? POLLOUT : 0), d);
            if (rc == -ETIMEDOUT && d != deadline)
                continue;   /* the cancel's deadline: flush_cancel gives it up */
            if (rc == -ETIMEDOUT) {
                disconnect(c);
                return fail(c, rc, "no answer from dsv4d within %d ms", c->timeout_ms);
            }
            if (rc < 0) {
                disconnect(c);
                return fail(c, rc, "waiting for dsv4d: %s", strerror(-rc));
            }
            continue;
        }
        rc = -errno;
        disconnect(c);
        return fail(c, rc, "reading from dsv4d: %s", strerror(-rc));
    }
}

/* dsv4d's error notification (msg, cleared here): it says why, then closes the connection. */
static int closed_by_server(struct dsv4_client *c, struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error e = { 0 }, err;
    if (dsv4_proto_decode_error_notification(msg, &e, &err) < 0)
        e = err;
    c->server_code = e.code;
    dsv4_proto_message_clear(msg);
    disconnect(c);
    return fail(c, -ECONNRESET, "dsv4d closed the connection: %s (%s)", e.message, dsv4_proto_code_name(e.code));
}

typedef int (*notify_fn)(struct dsv4_client *c, const struct dsv4_proto_message *msg, void *user);

/* Wait for the response to msgid; notifications go to on_notify, answers to other msgids (cancels sent
 * from another thread) are dropped. On 0, *resp holds the successful response (clear it). */
static int await_response(struct dsv4_client *c, uint32_t msgid, notify_fn on_notify, void *user,
                          struct dsv4_proto_message *resp)
{
    for (;;) {
        struct dsv4_proto_message msg;
        int rc = recv_message(c, &msg);
        if (rc < 0)
            return rc;
        if (msg.kind == DSV4_PROTO_RESPONSE && msg.msgid == msgid) {
            if (msg.has_error) {
                c->server_code = msg.error.code;
                fail(c, -EREMOTEIO, "dsv4d: %s (%s)", msg.error.message, dsv4_proto_code_name(msg.error.code));
                dsv4_proto_message_clear(&msg);
                return -EREMOTEIO;
            }
            *resp = msg;
            return 0;
        }
        if (msg.kind == DSV4_PROTO_NOTIFICATION && msg.method == DSV4_PROTO_NOTIFY_ERROR)
            return closed_by_server(c, &msg);
        if (msg.kind == DSV4_PROTO_NOTIFICATION && on_notify) {
            rc = on_notify(c, &msg, user);
            if (rc < 0) {
                dsv4_proto_message_clear(&msg);
                return rc;
            }
        }
        dsv4_proto_message_clear(&msg);
    }
}

/* Encode with fn into c->out under a fresh msgid, send, await the answer. */
static uint32_t take_msgid(struct dsv4_client *c)
{
    return c->next_msgid++;
}

static int check_encoded(struct dsv4_client *c, int rc)
{
    if (rc == -ENOMEM)
        return fail(c, rc, "out of memory");
    if (rc < 0)
        return fail(c, -EINVAL, "request too large to encode");
    return 0;
}

static int decode_failed(struct dsv4_client *c, struct dsv4_proto_message *resp, const struct dsv4_proto_error *err)
{
    dsv4_proto_message_clear(resp);
    disconnect(c);
    return fail(c, -EPROTO, "malformed answer from dsv4d: %s", err->message);
}

/* ---- hello ---- */

int dsv4_client_hello(struct dsv4_client *c, const struct dsv4_client_info **ret)
{
    struct dsv4_proto_hello req = { .protocol = DSV4_PROTO_VERSION, .client = (char *)CLIENT_NAME };
    struct dsv4_proto_message resp;
    struct dsv4_proto_error err;
    struct dsv4_proto_hello_result h;
    reset_error(c);
    uint32_t id = take_msgid(c);
    int rc = check_encoded(c, dsv4_proto_encode_hello(&c->out, id, &req));
    if (rc == 0) rc = send_out(c, false);
    if (rc == 0) rc = await_response(c, id, NULL, NULL, &resp);
    if (rc < 0)
        return rc;
    if (dsv4_proto_decode_hello_result(&resp, &h, &err) < 0)
        return decode_failed(c, &resp, &err);
    dsv4_proto_message_clear(&resp);
    if (h.protocol < DSV4_PROTO_VERSION_MIN || h.protocol > DSV4_PROTO_VERSION) {
        uint32_t v = h.protocol;
        dsv4_proto_hello_result_clear(&h);
        disconnect(c);
        return fail(c, -EPROTO, "dsv4d chose protocol version %u, this library speaks %u to %u", v,
                    DSV4_PROTO_VERSION_MIN, DSV4_PROTO_VERSION);
    }
    dsv4_proto_hello_result_clear(&c->hello);
    c->hello = h;
    c->info = (struct dsv4_client_info){
        .protocol = h.protocol, .server = h.server ? h.server : "", .model_name = h.model.name ? h.model.name : "",
        .vocab_size = h.model.vocab_size, .hidden_size = h.model.hidden_size, .num_layers = h.model.num_layers,
        .num_heads = h.model.num_heads, .head_dim = h.model.head_dim, .n_routed_experts = h.model.n_routed_experts,
        .experts_per_token = h.model.experts_per_token, .bos_id = h.model.bos_id, .eos_id = h.model.eos_id,
        .max_context = h.max_context, .max_batch = h.max_batch, .backend = h.backend ? h.backend : "",
        .max_frame = h.limits.max_frame, .max_prompt_tokens = h.limits.max_prompt_tokens,
        .max_tokens = h.limits.max_tokens, .max_connections = h.limits.max_connections,
        .max_queue = h.limits.max_queue, .max_requests_per_connection = h.limits.max_requests_per_connection,
    };
    c->have_info = true;
    if (ret)
        *ret = &c->info;
    return 0;
}

const struct dsv4_client_info *dsv4_client_info(const struct dsv4_client *c)
{
    return c->have_info ? &c->info : NULL;
}

/* ---- generate ---- */

void dsv4_client_generate_params_init(struct dsv4_client_generate_params *p)
{
    struct dsv4_proto_sampling d;
    dsv4_proto_sampling_default(&d);
    memset(p, 0, sizeof(*p));
    p->add_bos = true;
    p->max_tokens = d.max_tokens;
    p->temperature = d.temperature;
    p->top_p = d.top_p;
    p->top_k = d.top_k;
    p->min_p = d.min_p;
    p->presence_penalty = d.presence_penalty;
    p->frequency_penalty = d.frequency_penalty;
    p->repetition_penalty = d.repetition_penalty;
    p->logprobs = d.logprobs;
}

const char *dsv4_client_finish_name(enum dsv4_client_finish f)
{
    return dsv4_proto_finish_name((enum dsv4_proto_finish)f);
}

static int parse_role(const char *role, enum dsv4_proto_role *ret)
{
    for (int r = DSV4_PROTO_ROLE_SYSTEM; r <= DSV4_PROTO_ROLE_ASSISTANT; r++)
        if (role && strcmp(role, dsv4_proto_role_name((enum dsv4_proto_role)r)) == 0) {
            *ret = (enum dsv4_proto_role)r;
            return 0;
        }
    return -EINVAL;
}

/* Chat messages into the protocol's form (content pointers borrowed, the array malloc'd). */
static int convert_messages(struct dsv4_client *c, const struct dsv4_client_message *m, size_t n,
                            struct dsv4_proto_chat_message **ret)
{
    if (n == 0 || n > DSV4_PROTO_MAX_MESSAGES)
        return fail(c, -EINVAL, "%zu chat messages: give 1 to %u", n, DSV4_PROTO_MAX_MESSAGES);
    struct dsv4_proto_chat_message *pm = calloc(n, sizeof(*pm));
    if (!pm)
        return fail(c, -ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (parse_role(m[i].role, &pm[i].role) < 0) {
            free(pm);
            return fail(c, -EINVAL, "message %zu: role must be system, user or assistant", i);
        }
        pm[i].content = (char *)(m[i].content ? m[i].content : "");
        pm[i].content_len = strlen(pm[i].content);
    }
    *ret = pm;
    return 0;
}

static int build_generate(struct dsv4_client *c, const struct dsv4_client_generate_params *p, bool stream,
                          struct dsv4_proto_generate *g)
{
    int sources = !!p->prompt + !!p->messages + !!p->tokens + !!p->prompt_parts;
    dsv4_proto_generate_init(g);
    if (sources != 1)
        return fail(c, -EINVAL, "give exactly one of prompt, messages, tokens, prompt_parts");
    if (p->prompt_parts && (!p->prompt_part_lens || p->n_prompt_parts == 0 ||
                            p->n_prompt_parts > DSV4_PROTO_MAX_PROMPT_PARTS))
        return fail(c, -EINVAL, "prompt_parts: %zu parts (1..%u, each with its length)", p->n_prompt_parts,
                    DSV4_PROTO_MAX_PROMPT_PARTS);
    if (p->n_stop > DSV4_PROTO_MAX_STOP || p->n_stop_token_ids > DSV4_PROTO_MAX_STOP_TOKEN_IDS)
        return fail(c, -EINVAL, "at most %u stop strings and %u stop token ids", DSV4_PROTO_MAX_STOP,
                    DSV4_PROTO_MAX_STOP_TOKEN_IDS);
    if (p->tokens && (p->n_tokens == 0 || p->n_tokens > UINT32_MAX / 4))
        return fail(c, -EINVAL, "token prompt of %zu tokens", p->n_tokens);
    if (p->prompt) {
        g->prompt_kind = DSV4_PROTO_PROMPT_TEXT;
        g->prompt = (char *)p->prompt;
        g->prompt_len = strlen(p->prompt);
        g->add_bos = p->add_bos;
    } else if (p->prompt_parts) {
        g->prompt_kind = DSV4_PROTO_PROMPT_PARTS;
        g->parts = (char **)p->prompt_parts;
        g->part_lens = (size_t *)p->prompt_part_lens;
        g->n_parts = (uint32_t)p->n_prompt_parts;
        g->add_bos = p->add_bos;
    } else if (p->messages) {
        g->prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
        int rc = convert_messages(c, p->messages, p->n_messages, &g->messages);
        if (rc < 0)
            return rc;
        g->n_messages = (uint32_t)p->n_messages;
    } else {
        g->prompt_kind = DSV4_PROTO_PROMPT_TOKENS;
        g->tokens = (int32_t *)p->tokens;
        g->n_tokens = (uint32_t)p->n_tokens;
    }
    g->thinking = p->thinking;
    g->stream = stream;
    struct dsv4_proto_sampling *s = &g->sampling;
    s->max_tokens = p->max_tokens;
    s->temperature = p->temperature;
    s->top_p = p->top_p;
    s->top_k = p->top_k;
    s->min_p = p->min_p;
    s->presence_penalty = p->presence_penalty;
    s->frequency_penalty = p->frequency_penalty;
    s->repetition_penalty = p->repetition_penalty;
    s->has_seed = p->has_seed;
    s->seed = p->seed;
    s->n_stop = (uint32_t)p->n_stop;
    for (size_t i = 0; i < p->n_stop; i++)
        s->stop[i] = (char *)p->stop[i];
    s->n_stop_token_ids = (uint32_t)p->n_stop_token_ids;
    for (size_t i = 0; i < p->n_stop_token_ids; i++)
        s->stop_token_ids[i] = p->stop_token_ids[i];
    s->logprobs = p->logprobs < 0 ? -1 : p->logprobs;
    return 0;
}

static void convert_logprob(const struct dsv4_proto_logprob *in, struct dsv4_client_logprob *out)
{
    out->logprob = in->logprob;
    out->n_top = in->n_top;
    for (uint32_t i = 0; i < in->n_top && i < DSV4_CLIENT_MAX_LOGPROBS; i++) {
        out->top_ids[i] = in->top_ids[i];
        out->top_logprobs[i] = in->top_logprobs[i];
    }
}

struct stream_ctx {
    uint32_t msgid;
    dsv4_client_token_fn fn;
    void *user;
};

static int on_token(struct dsv4_client *c, const struct dsv4_proto_message *msg, void *user)
{
    struct stream_ctx *s = user;
    struct dsv4_proto_token_event ev;
    struct dsv4_proto_error err;
    if (msg->method != DSV4_PROTO_NOTIFY_TOKEN)
        return 0;   /* a newer server's notification */
    if (dsv4_proto_decode_token(msg, &ev, &err) < 0) {
        disconnect(c);
        return fail(c, -EPROTO, "malformed token from dsv4d: %s", err.message);
    }
    if (ev.msgid == s->msgid && s->fn) {
        struct dsv4_client_logprob lp;
        struct dsv4_client_token t = { .id = ev.token, .text = ev.text, .text_len = ev.text_len };
        if (ev.has_logprob) {
            convert_logprob(&ev.logprob, &lp);
            t.logprob = &lp;
        }
        if (s->fn(&t, s->user) != 0)
            dsv4_client_cancel(c);
    }
    dsv4_proto_token_event_clear(&ev);
    return 0;
}

static int generate(struct dsv4_client *c, const struct dsv4_client_generate_params *p, bool stream,
                    dsv4_client_token_fn fn, void *user, struct dsv4_client_result *res)
{
    struct dsv4_proto_generate g;
    struct dsv4_proto_message resp;
    struct dsv4_proto_generate_result r;
    struct dsv4_proto_error err;
    memset(res, 0, sizeof(*res));
    reset_error(c);
    /* cancellable from here on: a cancel before the request is written is sent right after it */
    uint32_t id = take_msgid(c);
    c->request_written = c->cancel_sent = c->cancel_begun = false;
    c->generate_msgid = id;
    pthread_mutex_lock(&c->cancel_lock);
    c->in_generate = true;
    c->cancel_wanted = false;
    pthread_mutex_unlock(&c->cancel_lock);
    int rc = build_generate(c, p, stream, &g);
    if (rc == 0)
        rc = check_encoded(c, dsv4_proto_encode_generate(&c->out, id, &g));
    free(g.messages);   /* everything else in g is borrowed from p */
    struct stream_ctx sc = { id, fn, user };
    if (rc == 0)
        rc = send_out(c, true);
    if (rc == 0)
        rc = await_response(c, id, on_token, &sc, &resp);
    pthread_mutex_lock(&c->cancel_lock);
    c->in_generate = false;
    pthread_mutex_unlock(&c->cancel_lock);
    if (c->fd >= 0)
        finish_cancel(c);
    if (rc == -ECANCELED) {
        /* cancelled while its request waited for room: dsv4d has not seen the request whole */
        res->finish_reason = DSV4_CLIENT_FINISH_CANCELLED;
        res->text = calloc(1, 1);
        return res->text ? 0 : fail(c, -ENOMEM, "out of memory");
    }
    if (rc < 0)
        return rc;
    if (dsv4_proto_decode_generate_result(&resp, &r, &err) < 0)
        return decode_failed(c, &resp, &err);
    dsv4_proto_message_clear(&resp);
    if (r.logprobs) {
        res->logprobs = calloc(r.n_tokens ? r.n_tokens : 1, sizeof(*res->logprobs));
        if (!res->logprobs) {
            dsv4_proto_generate_result_clear(&r);
            return fail(c, -ENOMEM, "out of memory");
        }
        for (uint32_t i = 0; i < r.n_tokens; i++)
            convert_logprob(&r.logprobs[i], &res->logprobs[i]);
    }
    res->text = r.text;
    res->text_len = r.text_len;
    res->tokens = r.tokens;
    res->n_tokens = r.n_tokens;
    res->finish_reason = (enum dsv4_client_finish)r.finish_reason;
    res->error_message = r.error_message;
    res->prompt_tokens = r.usage.prompt_tokens;
    res->completion_tokens = r.usage.completion_tokens;
    res->queue_ms = r.timings.queue_ms;
    res->prefill_ms = r.timings.prefill_ms;
    res->decode_ms = r.timings.decode_ms;
    res->total_ms = r.timings.total_ms;
    res->decode_tokens_per_s = r.timings.decode_tokens_per_s;
    res->cached_tokens = r.usage.cached_tokens;
    free(r.logprobs);
    return 0;
}

int dsv4_client_generate(struct dsv4_client *c, const struct dsv4_client_generate_params *p,
                         struct dsv4_client_result *res)
{
    return generate(c, p, false, NULL, NULL, res);
}

int dsv4_client_generate_stream(struct dsv4_client *c, const struct dsv4_client_generate_params *p,
                                dsv4_client_token_fn on_token_fn, void *user, struct dsv4_client_result *res)
{
    return generate(c, p, true, on_token_fn, user, res);
}

void dsv4_client_result_clear(struct dsv4_client_result *r)
{
    if (!r)
        return;
    free(r->text);
    free(r->tokens);
    free(r->error_message);
    free(r->logprobs);
    memset(r, 0, sizeof(*r));
}

int dsv4_client_cancel(struct dsv4_client *c)
{
    /* Runs on any thread, and must not wait for the socket (a signal thread, an HTTP server's polling
     * thread call it): it only marks the cancel and wakes the generating thread, which owns the socket. */
    pthread_mutex_lock(&c->cancel_lock);
    bool wake = c->in_generate && !c->cancel_wanted;
    c->cancel_wanted |= c->in_generate;
    pthread_mutex_unlock(&c->cancel_lock);
    uint64_t one = 1;
    if (wake && write(c->wake_fd, &one, sizeof(one)) < 0)
        return -errno;
    return 0;
}

/* ---- tokens ---- */

static int tokens_call(struct dsv4_client *c, uint32_t id, int32_t **ret_tokens, size_t *ret_n)
{
    struct dsv4_proto_message resp;
    struct dsv4_proto_tokens t;
    struct dsv4_proto_error err;
    int rc = send_out(c, false);
    if (rc == 0)
        rc = await_response(c, id, NULL, NULL, &resp);
    if (rc < 0)
        return rc;
    if (dsv4_proto_decode_tokenize_result(&resp, &t, &err) < 0)
        return decode_failed(c, &resp, &err);
    dsv4_proto_message_clear(&resp);
    *ret_tokens = t.tokens;
    *ret_n = t.n_tokens;
    return 0;
}

int dsv4_client_tokenize(struct dsv4_client *c, const char *text, bool add_bos, int32_t **ret_tokens,
                         size_t *ret_n)
{
    struct dsv4_proto_tokenize req;
    reset_error(c);
    *ret_tokens = NULL;
    *ret_n = 0;
    if (!text)
        return fail(c, -EINVAL, "tokenize: no text");
    dsv4_proto_tokenize_init(&req);
    req.prompt_kind = DSV4_PROTO_PROMPT_TEXT;
    req.text = (char *)text;
    req.text_len = strlen(text);
    req.add_bos = add_bos;
    uint32_t id = take_msgid(c);
    int rc = check_encoded(c, dsv4_proto_encode_tokenize(&c->out, id, &req));
    return rc < 0 ? rc : tokens_call(c, id, ret_tokens, ret_n);
}

int dsv4_client_tokenize_chat(struct dsv4_client *c, const struct dsv4_client_message *messages, size_t n,
                              bool thinking, int32_t **ret_tokens, size_t *ret_n)
{
    struct dsv4_proto_tokenize req;
    reset_error(c);
    *ret_tokens = NULL;
    *ret_n = 0;
    dsv4_proto_tokenize_init(&req);
    req.prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
    int rc = convert_messages(c, messages, n, &req.messages);
    if (rc < 0)
        return rc;
    req.n_messages = (uint32_t)n;
    req.thinking = thinking;
    uint32_t id = take_msgid(c);
    rc = check_encoded(c, dsv4_proto_encode_tokenize(&c->out, id, &req));
    free(req.messages);
    return rc < 0 ? rc : tokens_call(c, id, ret_tokens, ret_n);
}

int dsv4_client_detokenize(struct dsv4_client *c, const int32_t *tokens, size_t n, char **ret_text,
                           size_t *ret_len)
{
    struct dsv4_proto_tokens req = { .tokens = (int32_t *)tokens, .n_tokens = (uint32_t)n };
    struct dsv4_proto_message resp;
    struct dsv4_proto_text t;
    struct dsv4_proto_error err;
    reset_error(c);
    *ret_text = NULL;
    if (ret_len)
        *ret_len = 0;
    if ((n && !tokens) || n > UINT32_MAX / 4)
        return fail(c, -EINVAL, "detokenize: %zu tokens", n);
    uint32_t id = take_msgid(c);
    int rc = check_encoded(c, dsv4_proto_encode_detokenize(&c->out, id, &req));
    if (rc == 0) rc = send_out(c, false);
    if (rc == 0) rc = await_response(c, id, NULL, NULL, &resp);
    if (rc < 0)
        return rc;
    if (dsv4_proto_decode_detokenize_result(&resp, &t, &err) < 0)
        return decode_failed(c, &resp, &err);
    dsv4_proto_message_clear(&resp);
    *ret_text = t.text;
    if (ret_len)
        *ret_len = t.text_len;
    return 0;
}

/* ---- stats, health ---- */

_Static_assert(DSV4_CLIENT_MAX_LATENCY_BUCKETS == DSV4_PROTO_MAX_LATENCY_BOUNDS + 1,
               "dsv4_client_latency holds the protocol's histograms whole");

static void copy_latency(const struct dsv4_proto_latency *h, uint64_t count, double sum_s,
                         struct dsv4_client_latency *ret)
{
    ret->n_buckets = h->n;
    for (size_t i = 0; i < h->n; i++)
        ret->buckets[i] = h->buckets[i];
    ret->count = count;
    ret->sum_s = sum_s;
}

int dsv4_client_stats(struct dsv4_client *c, struct dsv4_client_stats *ret)
{
    struct dsv4_proto_message resp;
    struct dsv4_proto_stats st;
    struct dsv4_proto_error err;
    reset_error(c);
    memset(ret, 0, sizeof(*ret));
    uint32_t id = take_msgid(c);
    int rc = check_encoded(c, dsv4_proto_encode_stats(&c->out, id));
    if (rc == 0) rc = send_out(c, false);
    if (rc == 0) rc = await_response(c, id, NULL, NULL, &resp);
    if (rc < 0)
        return rc;
    if (dsv4_proto_decode_stats_result(&resp, &st, &err) < 0)
        return decode_failed(c, &resp, &err);
    dsv4_proto_message_clear(&resp);
    ret->uptime_s = st.uptime_s;
    snprintf(ret->backend, sizeof(ret->backend), "%s", st.backend ? st.backend : "");
    ret->slots_total = st.slots_total;
    ret->slots_busy = st.slots_busy;
    ret->queue_depth = st.queue_depth;
    ret->connections = st.connections;
    ret->requests_total = st.requests_total;
    ret->requests_failed = st.requests_failed;
    ret->requests_cancelled = st.requests_cancelled;
    ret->prompt_tokens_total = st.prompt_tokens_total;
    ret->generated_tokens_total = st.generated_tokens_total;
    ret->prefill_tokens_per_s = st.prefill_tokens_per_s;
    ret->decode_tokens_per_s = st.decode_tokens_per_s;
    ret->prefill_tokens_total = st.prefill_tokens_total;
    ret->prefill_chunks_total = st.prefill_chunks_total;
    ret->device_arena_bytes = st.device_arena_bytes;
    ret->device_arena_used = st.device_arena_used;
    ret->heap_allocated = st.heap_allocated;
    ret->heap_active = st.heap_active;
    ret->heap_resident = st.heap_resident;
    ret->heap_mapped = st.heap_mapped;
    ret->device_allocs_after_boot = st.device_allocs_after_boot;
    ret->graph_captures_after_boot = st.graph_captures_after_boot;
    ret->eager_steps = st.eager_steps;
    ret->n_kernels = st.n_kernels < DSV4_CLIENT_MAX_KERNELS ? st.n_kernels : DSV4_CLIENT_MAX_KERNELS;
    for (size_t i = 0; i < ret->n_kernels; i++)
        snprintf(ret->kernels[i], sizeof(ret->kernels[i]), "%s", st.kernels[i]);
    ret->steps = st.steps;
    ret->decode_steps = st.decode_steps;
    ret->n_batch_hist = st.n_batch_hist < DSV4_CLIENT_MAX_BATCH_BUCKETS ? st.n_batch_hist : DSV4_CLIENT_MAX_BATCH_BUCKETS;
    for (size_t i = 0; i < ret->n_batch_hist; i++)
        ret->batch_hist[i] = st.batch_hist[i];
    ret->sched_allocations = st.sched_allocations;
    ret->sched_allocations_after_boot = st.sched_allocations_after_boot;
    ret->prefix_cache_bytes = st.prefix_cache_bytes;
    ret->prefix_cache_used_bytes = st.prefix_cache_used_bytes;
    ret->prefix_cache_tokens = st.prefix_cache_tokens;
    ret->prefix_cache_snapshots = st.prefix_cache_snapshots;
    ret->prefix_cache_lookups = st.prefix_cache_lookups;
    ret->prefix_cache_hits = st.prefix_cache_hits;
    ret->prefix_cache_hit_tokens = st.prefix_cache_hit_tokens;
    ret->prefix_cache_evictions = st.prefix_cache_evictions;
    ret->spec_tokens = st.spec_tokens;
    ret->spec_verifies = st.spec_verifies;
    ret->spec_drafted = st.spec_drafted;
    ret->spec_accepted = st.spec_accepted;
    ret->n_spec_hist = st.n_spec_hist < DSV4_CLIENT_MAX_SPEC_BUCKETS ? st.n_spec_hist : DSV4_CLIENT_MAX_SPEC_BUCKETS;
    for (size_t i = 0; i < ret->n_spec_hist; i++)
        ret->spec_hist[i] = st.spec_hist[i];
    ret->engine_busy_s = st.engine_busy_s;
    ret->engine_backend_s = st.engine_backend_s;
    ret->engine_gap_s = st.engine_gap_s;
    ret->present = st.present;
    ret->n_latency_bounds = st.n_latency_bounds;
    for (size_t i = 0; i < st.n_latency_bounds; i++)
        ret->latency_bounds_s[i] = st.latency_bounds_s[i];
    copy_latency(&st.queue_hist, st.queue_count, st.queue_sum_s, &ret->queue);
    copy_latency(&st.ttft_hist, st.ttft_count, st.ttft_sum_s, &ret->ttft);
    copy_latency(&st.tpot_hist, st.tpot_count, st.tpot_sum_s, &ret->tpot);
    copy_latency(&st.e2e_hist, st.e2e_count, st.e2e_sum_s, &ret->e2e);
    dsv4_proto_stats_clear(&st);
    return 0;
}

bool dsv4_client_stats_has(const struct dsv4_client_stats *st, const char *key)
{
    struct dsv4_proto_stats p = {.present = st->present};
    return dsv4_proto_stats_has(&p, key);
}

const char *dsv4_client_health_name(enum dsv4_client_health_status s)
{
    return dsv4_proto_health_name((enum dsv4_proto_health_status)s);
}

int dsv4_client_health(struct dsv4_client *c, struct dsv4_client_health *ret)
{
    struct dsv4_proto_message resp;
    struct dsv4_proto_health h;
    struct dsv4_proto_error err;
    reset_error(c);
    memset(ret, 0, sizeof(*ret));
    uint32_t id = take_msgid(c);
    int rc = check_encoded(c, dsv4_proto_encode_health(&c->out, id));
    if (rc == 0) rc = send_out(c, false);
    if (rc == 0) rc = await_response(c, id, NULL, NULL, &resp);
    if (rc < 0)
        return rc;
    if (dsv4_proto_decode_health_result(&resp, &h, &err) < 0)
        return decode_failed(c, &resp, &err);
    dsv4_proto_message_clear(&resp);
    ret->status = (enum dsv4_client_health_status)h.status;
    snprintf(ret->reason, sizeof(ret->reason), "%s", h.reason ? h.reason : "");
    dsv4_proto_health_clear(&h);
    return 0;
}
