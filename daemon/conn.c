/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/clock.h"
#include "daemon/conn.h"
#include "daemon/log.h"
#include "daemon/reqmem.h"
#include "engine/error.h"

#define DSV4_CONN_ACCEPTS_PER_WAKEUP 64
/* Out of descriptors (or kernel memory) with nothing of ours to close, as when other processes fill
 * the system's file table: accepting is tried again this often. */
#define DSV4_CONN_ACCEPT_RETRY_USEC 1000000ull
/* A peer's supplementary groups are read into this many on the stack first; a peer in more of them
 * (the kernel allows NGROUPS_MAX, 65536) is read again into a buffer of the size the kernel names. */
#define DSV4_CONN_PEER_GROUPS_STACK 256

static int conn_io(sd_event_source *src, int fd, uint32_t revents, void *userdata);
static int conn_resume(sd_event_source *src, void *userdata);

static bool id_listed(const uint32_t *ids, int n, uint32_t id)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == id)
            return true;
    return false;
}

/* allow_users / allow_groups: the peer's uid, its primary gid or one of its supplementary groups. */
static bool peer_allowed(const struct dsv4_settings *cfg, int fd, uid_t uid, gid_t gid)
{
    gid_t stack[DSV4_CONN_PEER_GROUPS_STACK], *groups = stack;
    socklen_t len = sizeof(stack);
    bool allowed = false;
    int r;

    if (cfg->n_allow_users == 0 && cfg->n_allow_groups == 0)
        return true;
    if (id_listed((const uint32_t *)cfg->allow_users, cfg->n_allow_users, uid))
        return true;
    if (id_listed((const uint32_t *)cfg->allow_groups, cfg->n_allow_groups, gid))
        return true;
    if (cfg->n_allow_groups == 0)
        return false;
    r = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
    /* ERANGE: more groups than fit; len is now the size they take. */
    if (r < 0 && errno == ERANGE && len <= NGROUPS_MAX * sizeof(gid_t) && (groups = malloc(len)))
        r = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
    if (r < 0)
        dsv4_log_warning("SO_PEERGROUPS: %s", groups ? strerror(errno) : "out of memory");
    for (size_t i = 0; r == 0 && !allowed && i < len / sizeof(gid_t); i++)
        allowed = id_listed((const uint32_t *)cfg->allow_groups, cfg->n_allow_groups, groups[i]);
    if (groups != stack)
        free(groups);
    return allowed;
}

/* Refuse a connection with one error notification, best effort (the socket is fresh: it fits). */
static void refuse(int fd, int code, const char *message)
{
    struct dsv4_proto_buf b;
    dsv4_proto_buf_init(&b);
    if (dsv4_proto_encode_error_notification(&b, code, message) == 0)
        (void)!send(fd, b.data, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
    dsv4_proto_buf_clear(&b);
    close(fd);
}

static void set_accepting(struct dsv4_conns *cs, bool on)
{
    for (int i = 0; i < cs->n_listen; i++)
        if (cs->listen_src[i])
            sd_event_source_set_enabled(cs->listen_src[i], on ? SD_EVENT_ON : SD_EVENT_OFF);
    cs->accept_paused = !on;
}

/* Stop accepting while descriptors are short: a closing connection resumes it, and so does the retry
 * timer, since the shortage may not be ours (with no connection open, none would ever close). */
static void pause_accepting(struct dsv4_conns *cs)
{
    set_accepting(cs, false);
    sd_event_source_set_time(cs->accept_retry_src, dsv4_now_ns() / 1000 + DSV4_CONN_ACCEPT_RETRY_USEC);
    sd_event_source_set_enabled(cs->accept_retry_src, SD_EVENT_ONESHOT);
}

/* While refusing (a drain), too: new clients are to be told so, not left in the backlog. */
static void resume_accepting(struct dsv4_conns *cs)
{
    if (cs->accept_paused && !cs->accept_stopped)
        set_accepting(cs, true);
}

/* max_idle_per_uid: a connection is idle once it has had no generate request in flight for this
 * long, so a client's fresh connection (its first request on the way) and a busy pool are not. */
#define DSV4_CONN_IDLE_AFTER_NS 1000000000ull

static bool conn_idle(const struct dsv4_conn *c, uint64_t now)
{
    return c->n_requests == 0 && !c->closing && !c->closed && now - c->idle_since_ns >= DSV4_CONN_IDLE_AFTER_NS;
}

/* Idle connections of uid: what one local user holds while doing nothing. */
static int idle_connections(const struct dsv4_conns *cs, uid_t uid)
{
    uint64_t now = dsv4_now_ns();
    int n = 0;
    for (const struct dsv4_conn *c = cs->head; c; c = c->next)
        n += c->uid == uid && conn_idle(c, now);
    return n;
}

static int conn_accept(struct dsv4_conns *cs, int listen_fd)
{
    for (int k = 0; k < DSV4_CONN_ACCEPTS_PER_WAKEUP; k++) {
        struct ucred cred = { .pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1 };
        socklen_t len = sizeof(cred);
        struct dsv4_conn *c;
        int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC), r;

        if (fd < 0) {
            if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)
                return 0;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                dsv4_log_warning("accept: %m; not accepting for %llu s or until a connection closes",
                                 DSV4_CONN_ACCEPT_RETRY_USEC / 1000000);
                pause_accepting(cs);
                return 0;
            }
            dsv4_log_err("accept: %m");
            return 0;
        }
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
            dsv4_log_warning("SO_PEERCRED: %m");
        cs->accepted_total++;
        if (cs->refuse_code) {
            /* Told, not left waiting in the backlog until the socket is closed. */
            cs->refused_total++;
            refuse(fd, cs->refuse_code, cs->refuse_message);
            continue;
        }
        if (!peer_allowed(cs->cfg, fd, cred.uid, cred.gid)) {
            dsv4_log_warning("refused connection from pid %d uid %u gid %u: not in allow_users/allow_groups",
                             (int)cred.pid, (unsigned)cred.uid, (unsigned)cred.gid);
            cs->refused_total++;
            close(fd);
            continue;
        }
        int idle = idle_connections(cs, cred.uid);
        if (cs->cfg->max_idle_per_uid && idle >= cs->cfg->max_idle_per_uid) {
            char msg[160];
            snprintf(msg, sizeof(msg), "uid %u already holds %d connections with no generate in flight "
                     "(max_idle_per_uid = %d)", (unsigned)cred.uid, idle, cs->cfg->max_idle_per_uid);
            dsv4_log_warning("refused connection from pid %d: %s", (int)cred.pid, msg);
            cs->refused_total++;
            refuse(fd, DSV4_PROTO_E_TOO_MANY_CONNECTIONS, msg);
            continue;
        }
        if (cs->n >= cs->cfg->max_connections) {
            char msg[128];
            snprintf(msg, sizeof(msg), "max_connections = %d reached", cs->cfg->max_connections);
            dsv4_log_warning("refused connection from pid %d uid %u: %s", (int)cred.pid, (unsigned)cred.uid, msg);
            cs->refused_total++;
            refuse(fd, DSV4_PROTO_E_TOO_MANY_CONNECTIONS, msg);
            continue;
        }
        c = dsv4_reqmem_calloc(1, sizeof(*c));
        if (!c) {
            refuse(fd, DSV4_PROTO_E_OUT_OF_MEMORY, NULL);
            continue;
        }
        c->set = cs;
        c->fd = fd;
        c->id = ++cs->next_id;
        c->pid = cred.pid;
        c->uid = cred.uid;
        c->gid = cred.gid;
        c->idle_since_ns = dsv4_now_ns();
        c->sent_ns = c->idle_since_ns;
        dsv4_proto_reader_init(&c->reader, cs->cfg->max_frame);
        dsv4_proto_buf_init(&c->out);
        r = sd_event_add_io(cs->event, &c->src, fd, EPOLLIN, conn_io, c);
        if (r >= 0) {
            r = sd_event_add_defer(cs->event, &c->resume_src, conn_resume, c);
            if (r >= 0)
                sd_event_source_set_enabled(c->resume_src, SD_EVENT_OFF);
            else
                c->src = sd_event_source_disable_unref(c->src);
        }
        if (r < 0) {
            dsv4_log_err("connection %llu: sd_event_add_io: %s", (unsigned long long)c->id, strerror(-r));
            dsv4_proto_reader_clear(&c->reader);
            dsv4_reqmem_free(c);
            close(fd);
            continue;
        }
        c->next = cs->head;
        if (cs->head)
            cs->head->prev = c;
        cs->head = c;
        cs->n++;
        dsv4_log_info("connection %llu: pid %d uid %u gid %u", (unsigned long long)c->id, (int)c->pid,
                      (unsigned)c->uid, (unsigned)c->gid);
    }
    return 0;
}

static void schedule_resume(struct dsv4_conn *c)
{
    sd_event_source_set_enabled(c->resume_src, SD_EVENT_ONESHOT);
}

/* Recompute which events the connection waits for (reading pauses while its output backs up). */
static void update_events(struct dsv4_conn *c)
{
    uint32_t ev = 0;
    if (c->closed)
        return;
    /* frame_timeout counts while part of a frame is held and reading is on: time paused for the
     * client's own unread output is not its stall. */
    if (dsv4_proto_reader_pending(&c->reader) == 0 || c->paused || c->closing)
        c->partial_since_ns = 0;
    else if (!c->partial_since_ns)
        c->partial_since_ns = dsv4_now_ns();
    if (c->closing || c->read_eof) {
        /* nothing more to read */
    } else if (c->out.len < DSV4_CONN_OUTPUT_HIGH_WATER) {
        ev |= EPOLLIN;
        /* A complete frame may already sit in the reader: the socket will not say so again. */
        if (c->paused)
            schedule_resume(c);
        c->paused = false;
    } else {
        c->paused = true;
    }
    if (c->out.len)
        ev |= EPOLLOUT;
    sd_event_source_set_io_events(c->src, ev);
}

void dsv4_conn_close(struct dsv4_conn *c, const char *why)
{
    struct dsv4_conns *cs = c->set;

    if (c->closed)
        return;
    c->closed = true;
    dsv4_log_info("connection %llu (pid %d): closed: %s", (unsigned long long)c->id, (int)c->pid, why);
    c->src = sd_event_source_disable_unref(c->src);
    c->resume_src = sd_event_source_disable_unref(c->resume_src);
    close(c->fd);
    c->fd = -1;
    if (c->prev)
        c->prev->next = c->next;
    else
        cs->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    cs->n--;
    c->prev = NULL;
    c->next = cs->zombies;
    cs->zombies = c;
    if (cs->reap_src)
        sd_event_source_set_enabled(cs->reap_src, SD_EVENT_ONESHOT);
    resume_accepting(cs);
    cs->hooks.closed(cs->hooks.userdata, c);
}

/* Free closed connections (from the reaper, and at shutdown). */
static void conn_reap(struct dsv4_conns *cs)
{
    while (cs->zombies) {
        struct dsv4_conn *c = cs->zombies;
        cs->zombies = c->next;
        dsv4_proto_reader_clear(&c->reader);
        dsv4_proto_buf_clear(&c->out);
        dsv4_reqmem_free(c);
    }
}

void dsv4_conn_flush(struct dsv4_conn *c)
{
    size_t queued = c->out.len;

    if (c->closed)
        return;
    while (c->out.len) {
        ssize_t n = send(c->fd, c->out.data, c->out.len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                break;
            dsv4_conn_close(c, errno == EPIPE || errno == ECONNRESET ? "client went away" : strerror(errno));
            return;
        }
        dsv4_proto_buf_consume(&c->out, (size_t)n);
    }
    if (c->out.len < queued)
        c->sent_ns = dsv4_now_ns();
    if (c->out.len > c->set->cfg->max_output_buffer) {
        char why[128];
        snprintf(why, sizeof(why), "client does not read: %zu bytes queued, max_output_buffer = %llu",
                 c->out.len, (unsigned long long)c->set->cfg->max_output_buffer);
        dsv4_conn_close(c, why);
        return;
    }
    if (c->closing && c->out.len == 0) {
        dsv4_conn_close(c, c->close_reason);
        return;
    }
    update_events(c);
}

void dsv4_conn_send_error(struct dsv4_conn *c, uint32_t msgid, int code, const char *message)
{
    if (c->closed)
        return;
    if (dsv4_proto_encode_error(&c->out, msgid, code, message) < 0) {
        dsv4_conn_close(c, "out of memory encoding an error");
        return;
    }
    dsv4_conn_flush(c);
}

/* Send an error notification, then close once it is written; reason is what the close logs. */
static void conn_fail_with(struct dsv4_conn *c, int code, const char *message, const char *reason)
{
    if (c->closed || c->closing)
        return;
    c->closing = true;
    c->close_reason = reason;
    if (dsv4_proto_encode_error_notification(&c->out, code, message) < 0) {
        dsv4_conn_close(c, "out of memory encoding an error");
        return;
    }
    dsv4_conn_flush(c);
}

void dsv4_conn_close_after_flush(struct dsv4_conn *c, const char *reason)
{
    if (c->closed)
        return;
    if (!c->closing) {
        c->closing = true;
        c->close_reason = reason;
    }
    dsv4_conn_flush(c);
}

void dsv4_conn_fail(struct dsv4_conn *c, int code, const char *message)
{
    if (c->closed || c->closing)
        return;
    dsv4_log_info("connection %llu (pid %d): protocol error %d (%s): %s", (unsigned long long)c->id, (int)c->pid,
                  code, dsv4_proto_code_name(code), message ? message : dsv4_proto_code_describe(code));
    conn_fail_with(c, code, message, "after a protocol error");
}

static void conn_read(struct dsv4_conn *c)
{
    struct dsv4_proto_error err = { 0 };
    int frames = 0;

    while (!c->closed && !c->closing && !c->read_eof) {
        const uint8_t *payload;
        uint8_t *space;
        size_t avail, len;
        ssize_t n;
        int r;

        if (c->out.len >= DSV4_CONN_OUTPUT_HIGH_WATER)
            return;     /* paused; update_events() resumes it */
        if (frames == DSV4_CONN_FRAMES_PER_WAKEUP) {
            schedule_resume(c);     /* let the other clients in first */
            return;
        }

        /* Frames already buffered first: the reader holds at most one frame and the next header. */
        r = dsv4_proto_reader_next(&c->reader, &payload, &len, &err);
        if (r < 0) {
            dsv4_conn_fail(c, err.code, err.message);
            return;
        }
        if (r == 1) {
            frames++;
            c->set->hooks.frame(c->set->hooks.userdata, c, payload, len);
            continue;
        }
        r = dsv4_proto_reader_space(&c->reader, &space, &avail, &err);
        if (r < 0) {
            if (r == -EBADMSG)
                dsv4_conn_fail(c, err.code, err.message);
            else
                dsv4_conn_close(c, "out of memory for its frame");
            return;
        }
        n = recv(c->fd, space, avail, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ECONNRESET)
                dsv4_conn_close(c, "client went away (connection reset)");
            else if (errno != EAGAIN)
                dsv4_conn_close(c, strerror(errno));
            return;
        }
        if (n == 0) {
            size_t pending = dsv4_proto_reader_pending(&c->reader);
            if (pending) {
                char why[96];
                snprintf(why, sizeof(why), "end of stream inside a frame (%zu bytes pending)", pending);
                dsv4_conn_close(c, why);
                return;
            }
            /* Every frame before the end is handled. The client may only have shut its writing side
             * (shutdown(SHUT_WR), as `nc -N` does): its requests are answered, then it is closed. A
             * client that closed the socket shows as a hang-up (conn_io) and is closed there. */
            c->read_eof = true;
            if (c->n_requests)
                dsv4_log_debug("connection %llu: end of stream; answering its %d requests in flight, then closing",
                               (unsigned long long)c->id, c->n_requests);
            else
                dsv4_conn_close_after_flush(c, "end of stream");
            return;
        }
        dsv4_proto_reader_commit(&c->reader, (size_t)n);
    }
}

static int conn_resume(sd_event_source *src, void *userdata)
{
    struct dsv4_conn *c = userdata;
    if (c->read_eof && c->n_requests == 0)
        dsv4_conn_close_after_flush(c, "end of stream; every request answered");
    else
        conn_read(c);
    if (!c->closed)
        update_events(c);
    return 0;
}

void dsv4_conn_requests_ended(struct dsv4_conn *c)
{
    if (c->read_eof && !c->closed)
        schedule_resume(c);
}

static int conn_io(sd_event_source *src, int fd, uint32_t revents, void *userdata)
{
    struct dsv4_conn *c = userdata;

    if (revents & EPOLLIN)
        conn_read(c);
    if (!c->closed && (revents & EPOLLOUT))
        dsv4_conn_flush(c);
    /* A hang-up with data to read is acted on once the data is read, when reading met the end. */
    if (!c->closed && (revents & (EPOLLHUP | EPOLLERR)) && (!(revents & EPOLLIN) || c->read_eof))
        dsv4_conn_close(c, c->n_requests ? "client went away with requests in flight" : "hang-up");
    if (!c->closed)
        update_events(c);
    return 0;
}

static void close_stalled(struct dsv4_conns *cs, uint64_t now)
{
    uint64_t limit = (uint64_t)(cs->cfg->frame_timeout * 1e9);
    for (struct dsv4_conn *c = cs->head, *next; c; c = next) {
        next = c->next;
        char why[160];
        if (c->partial_since_ns && now - c->partial_since_ns > limit) {
            snprintf(why, sizeof(why), "held a partial frame (%zu bytes) for more than %g s (frame_timeout)",
                     dsv4_proto_reader_pending(&c->reader), cs->cfg->frame_timeout);
            dsv4_conn_close(c, why);
        } else if (c->closing && c->out.len && now - c->sent_ns > limit) {
            /* Neither idle nor reading: without this a client that never reads would keep it forever. */
            snprintf(why, sizeof(why), "took none of its last %zu bytes for more than %g s (frame_timeout)",
                     c->out.len, cs->cfg->frame_timeout);
            dsv4_conn_close(c, why);
        }
    }
}

/* By uid, then idle longest first. */
static int cmp_idle(const void *a, const void *b)
{
    const struct dsv4_conn *x = *(struct dsv4_conn *const *)a, *y = *(struct dsv4_conn *const *)b;
    if (x->uid != y->uid)
        return x->uid < y->uid ? -1 : 1;
    return (x->idle_since_ns > y->idle_since_ns) - (x->idle_since_ns < y->idle_since_ns);
}

/* Connections that became idle after the accept check (their requests ended) can still pile up:
 * each uid keeps its max_idle_per_uid most recently active idle ones; the others are told and closed. */
static void close_excess_idle(struct dsv4_conns *cs, uint64_t now)
{
    int limit = cs->cfg->max_idle_per_uid, n = 0;
    for (struct dsv4_conn *c = cs->head; c; c = c->next)
        n += conn_idle(c, now);
    if (n <= limit)
        return;     /* no uid can be over */
    struct dsv4_conn **idle = dsv4_reqmem_calloc((size_t)n, sizeof(*idle));
    if (!idle)
        return;     /* next sweep */
    n = 0;
    for (struct dsv4_conn *c = cs->head; c; c = c->next)
        if (conn_idle(c, now))
            idle[n++] = c;
    qsort(idle, (size_t)n, sizeof(*idle), cmp_idle);
    for (int g = 0, end; g < n; g = end) {
        for (end = g + 1; end < n && idle[end]->uid == idle[g]->uid; end++)
            ;
        for (int i = g; i < end - limit; i++) {
            char msg[160];
            snprintf(msg, sizeof(msg), "uid %u holds %d connections with no generate in flight "
                     "(max_idle_per_uid = %d); closing this one, idle longest", (unsigned)idle[i]->uid, end - g, limit);
            dsv4_log_info("connection %llu (pid %d): %s", (unsigned long long)idle[i]->id, (int)idle[i]->pid, msg);
            conn_fail_with(idle[i], DSV4_PROTO_E_TOO_MANY_CONNECTIONS, msg, "one idle connection too many for its uid");
        }
    }
    dsv4_reqmem_free(idle);
}

void dsv4_conns_sweep(struct dsv4_conns *cs)
{
    uint64_t now = dsv4_now_ns();
    if (cs->cfg->frame_timeout > 0)
        close_stalled(cs, now);
    if (cs->cfg->max_idle_per_uid > 0)
        close_excess_idle(cs, now);
}

/* ---- the set ------------------------------------------------------------------------------------- */

static int on_accept(sd_event_source *src, int fd, uint32_t revents, void *userdata)
{
    return conn_accept(userdata, fd);
}

static int on_reap(sd_event_source *src, void *userdata)
{
    conn_reap(userdata);
    return 0;
}

static int on_accept_retry(sd_event_source *src, uint64_t usec, void *userdata)
{
    resume_accepting(userdata);
    return 0;
}

int dsv4_conns_init(struct dsv4_conns *cs, sd_event *event, const struct dsv4_settings *cfg,
                    const struct dsv4_conn_hooks *hooks)
{
    int r;

    memset(cs, 0, sizeof(*cs));
    cs->event = event;
    cs->cfg = cfg;
    cs->hooks = *hooks;
    r = sd_event_add_defer(event, &cs->reap_src, on_reap, cs);
    if (r < 0)
        return dsv4_error_set(r, "sd_event_add_defer: %s", strerror(-r));
    sd_event_source_set_enabled(cs->reap_src, SD_EVENT_OFF);
    r = sd_event_add_time(event, &cs->accept_retry_src, CLOCK_MONOTONIC, 0, 0, on_accept_retry, cs);
    if (r < 0)
        return dsv4_error_set(r, "sd_event_add_time: %s", strerror(-r));
    sd_event_source_set_enabled(cs->accept_retry_src, SD_EVENT_OFF);
    return 0;
}

int dsv4_conns_listen(struct dsv4_conns *cs, int fd, const char *name)
{
    int r;

    if (cs->n_listen == DSV4_LISTEN_MAX)
        return dsv4_error_set(-EMFILE, "socket %s: more than %d listening sockets", name, DSV4_LISTEN_MAX);
    r = sd_event_add_io(cs->event, &cs->listen_src[cs->n_listen], fd, EPOLLIN, on_accept, cs);
    if (r < 0)
        return dsv4_error_set(r, "watching socket %s: %s", name, strerror(-r));
    cs->n_listen++;
    return 0;
}

void dsv4_conns_refuse_new(struct dsv4_conns *cs, int code, const char *message)
{
    cs->refuse_code = code;
    cs->refuse_message = message;
}

void dsv4_conns_stop_accepting(struct dsv4_conns *cs)
{
    for (int i = 0; i < cs->n_listen; i++)
        if (cs->listen_src[i])
            sd_event_source_set_enabled(cs->listen_src[i], SD_EVENT_OFF);
    cs->accept_stopped = true;
}

void dsv4_conns_done(struct dsv4_conns *cs)
{
    while (cs->head)
        dsv4_conn_close(cs->head, "server exiting");
    conn_reap(cs);
    for (int i = 0; i < cs->n_listen; i++)
        cs->listen_src[i] = sd_event_source_disable_unref(cs->listen_src[i]);
    cs->reap_src = sd_event_source_disable_unref(cs->reap_src);
    cs->accept_retry_src = sd_event_source_disable_unref(cs->accept_retry_src);
}
