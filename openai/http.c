/* SPDX-License-Identifier: MIT */
/* libmicrohttpd glue: routes, limits, deadlines, bearer auth, and responses that wait suspended for
 * their job (see server.h). */
#include "build-config.h"

#include <errno.h>
#include <microhttpd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include "openai/http.h"
#include "openai/job.h"
#include "openai/log.h"
#include "openai/server.h"

/* libmicrohttpd renamed 413 over the years; the number is what goes on the wire. */
#define HTTP_CONTENT_TOO_LARGE 413

/* A connection, for the request deadline: from its start (or the end of its previous response)
 * until its request is wholly received it must not take longer than request_timeout; a client that
 * drips a header byte by byte is cut off by a reaper thread. */
struct conn_state {
    int fd;
    bool receiving;
    bool cut;
    struct timespec since;
    struct conn_state *prev, *next;
};

/* One HTTP request. */
struct request {
    enum dsv4_oai_route route;
    struct conn_state *cs;
    struct dsv4_buf body;
    bool too_big;
    struct dsv4_oai_job *job;
};

static pthread_mutex_t conns_lock = PTHREAD_MUTEX_INITIALIZER;
static struct conn_state *conns;
static pthread_t reaper;
static bool reaper_started, reaper_stop;
static pthread_cond_t reaper_wake = PTHREAD_COND_INITIALIZER;

static double since_s(const struct timespec *t)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t->tv_sec) + (double)(now.tv_nsec - t->tv_nsec) / 1e9;
}

static void *reaper_main(void *arg)
{
    struct dsv4_oai_server *s = arg;
    pthread_mutex_lock(&conns_lock);
    while (!reaper_stop) {
        for (struct conn_state *c = conns; c; c = c->next)
            if (c->receiving && !c->cut && since_s(&c->since) > s->cfg->request_timeout) {
                /* The fd is still the connection's: it leaves the list before libmicrohttpd closes it. */
                shutdown(c->fd, SHUT_RDWR);
                c->cut = true;
                dsv4_oai_log(LOG_INFO, "connection fd %d: no whole request within %u s, closing it", c->fd,
                             s->cfg->request_timeout);
            }
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_sec += 1;
        pthread_cond_timedwait(&reaper_wake, &conns_lock, &t);
    }
    pthread_mutex_unlock(&conns_lock);
    return NULL;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    struct conn_state *c = *socket_context;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        c = calloc(1, sizeof(*c));
        if (!c)
            return;   /* no deadline for this one; the idle timeout still applies */
        c->fd = ci ? ci->connect_fd : -1;
        c->receiving = c->fd >= 0;
        clock_gettime(CLOCK_MONOTONIC, &c->since);
        pthread_mutex_lock(&conns_lock);
        c->next = conns;
        if (conns)
            conns->prev = c;
        conns = c;
        pthread_mutex_unlock(&conns_lock);
        *socket_context = c;
    } else if (c) {
        pthread_mutex_lock(&conns_lock);
        if (c->prev)
            c->prev->next = c->next;
        else
            conns = c->next;
        if (c->next)
            c->next->prev = c->prev;
        pthread_mutex_unlock(&conns_lock);
        free(c);
        *socket_context = NULL;
    }
}

static void set_receiving(struct conn_state *c, bool receiving)
{
    if (!c)
        return;
    pthread_mutex_lock(&conns_lock);
    c->receiving = receiving;
    clock_gettime(CLOCK_MONOTONIC, &c->since);
    pthread_mutex_unlock(&conns_lock);
}

/* ---- responses ---------------------------------------------------------------------------------- */

/* allow: the methods the path takes, for the Allow header a 405 must carry (RFC 9110 15.5.6); NULL otherwise. */
static enum MHD_Result queue(struct dsv4_oai_server *s, struct MHD_Connection *conn, unsigned status,
                             const char *type, char *body, size_t len, const char *allow)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == MHD_HTTP_UNAUTHORIZED)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (allow)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    pthread_mutex_lock(&s->lock);
    if (status >= 500)
        s->responses_5xx++;
    else if (status >= 400)
        s->responses_4xx++;
    pthread_mutex_unlock(&s->lock);
    enum MHD_Result r = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return r;
}

static enum MHD_Result queue_error(struct dsv4_oai_server *s, struct MHD_Connection *conn, unsigned status,
                                   const char *type, const char *code, const char *message)
{
    char *body = dsv4_oai_error_json(type, NULL, code, "%s", message);
    if (!body)
        return MHD_NO;
    return queue(s, conn, status, "application/json", body, strlen(body), NULL);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    long n = dsv4_oai_job_read(cls, buf, max);
    return n < 0 ? MHD_CONTENT_READER_END_OF_STREAM : (ssize_t)n;
}

static void stream_free(void *cls)
{
    dsv4_oai_job_unref(cls);
}

/* The job's response, or a suspended wait for it. */
static enum MHD_Result answer_job(struct dsv4_oai_server *s, struct MHD_Connection *conn, struct request *rq)
{
    unsigned status;
    bool stream;
    char *body;
    size_t len;
    if (dsv4_oai_job_head(rq->job, conn, &status, &stream, &body, &len) == -EAGAIN)
        return MHD_YES;
    if (!stream) {
        const char *type = rq->route == DSV4_OAI_ROUTE_METRICS && status == 200
                               ? "text/plain; version=0.0.4; charset=utf-8" : "application/json";
        return queue(s, conn, status, type, body, len, NULL);
    }
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 << 10, stream_read, rq->job,
                                                                  stream_free);
    if (!resp)
        return MHD_NO;
    /* The response holds its own reference: it may outlive the request context. */
    dsv4_oai_job_ref(rq->job);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result r = MHD_queue_response(conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return r;
}

/* ---- requests ----------------------------------------------------------------------------------- */

#define MODEL_PREFIX "/v1/models/"

static bool route_of(const char *method, const char *url, enum dsv4_oai_route *ret, bool *ret_post)
{
    static const struct { const char *path; bool post; enum dsv4_oai_route route; } routes[] = {
        {"/v1/chat/completions", true, DSV4_OAI_ROUTE_CHAT},
        {"/v1/completions", true, DSV4_OAI_ROUTE_COMPLETIONS},
        {"/v1/models", false, DSV4_OAI_ROUTE_MODELS},
        {"/health", false, DSV4_OAI_ROUTE_HEALTH},
        {"/metrics", false, DSV4_OAI_ROUTE_METRICS},
    };
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
        if (strcmp(url, routes[i].path) == 0) {
            *ret = routes[i].route;
            *ret_post = routes[i].post;
            return true;
        }
    if (strncmp(url, MODEL_PREFIX, strlen(MODEL_PREFIX)) == 0 && url[strlen(MODEL_PREFIX)]) {
        *ret = DSV4_OAI_ROUTE_MODEL;     /* the rest of the path is the model's id, which may hold '/' */
        *ret_post = false;
        return true;
    }
    (void)method;
    return false;
}

/* "Bearer KEY" against the configured key, in time independent of where they differ. */
static bool authorized(const struct dsv4_oai_config *cfg, struct MHD_Connection *conn)
{
    if (!cfg->api_key)
        return true;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    const char *key = h + 7;
    size_t n = strlen(key);
    unsigned char diff = n != cfg->api_key_len;
    for (size_t i = 0; i < cfg->api_key_len; i++)
        diff |= (unsigned char)(cfg->api_key[i] ^ (i < n ? key[i] : 0));
    return diff == 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    struct dsv4_oai_server *s = cls;
    struct request *rq = *con_cls;

    if (!rq) {
        /* Headers are in: route, method, auth and the announced size, before any body is read. */
        enum dsv4_oai_route route;
        bool post;
        if (!route_of(method, url, &route, &post))
            return queue_error(s, conn, MHD_HTTP_NOT_FOUND, "invalid_request_error", "not_found",
                               "no such endpoint; this server has POST /v1/chat/completions, POST /v1/completions, "
                               "GET /v1/models, GET /v1/models/{model}, GET /health and GET /metrics");
        /* HEAD goes wherever GET does (RFC 9110 9.3.2): the same answer, whose body libmicrohttpd leaves out. */
        const char *allow = post ? "POST" : "GET, HEAD";
        if (post ? strcmp(method, "POST") != 0 : strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
            char *body = dsv4_oai_error_json("invalid_request_error", NULL, "method_not_allowed",
                                             "this endpoint takes %s", allow);
            if (!body)
                return MHD_NO;
            return queue(s, conn, MHD_HTTP_METHOD_NOT_ALLOWED, "application/json", body, strlen(body), allow);
        }
        if (route != DSV4_OAI_ROUTE_HEALTH && !authorized(s->cfg, conn))
            return queue_error(s, conn, MHD_HTTP_UNAUTHORIZED, "invalid_request_error", "invalid_api_key",
                               "missing or wrong API key (Authorization: Bearer ...)");
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno || *end || n > s->cfg->max_body) {
                char msg[160];
                snprintf(msg, sizeof(msg), "request body of %s bytes is above the limit of %zu bytes", cl,
                         s->cfg->max_body);
                return queue_error(s, conn, HTTP_CONTENT_TOO_LARGE, "invalid_request_error", "body_too_large",
                                   msg);
            }
        }
        rq = calloc(1, sizeof(*rq));
        if (!rq)
            return MHD_NO;
        rq->route = route;
        if (route == DSV4_OAI_ROUTE_MODEL && dsv4_buf_puts(&rq->body, url + strlen(MODEL_PREFIX)) < 0) {
            free(rq);
            return MHD_NO;
        }
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        rq->cs = ci ? ci->socket_context : NULL;
        pthread_mutex_lock(&s->lock);
        s->requests[route]++;
        pthread_mutex_unlock(&s->lock);
        *con_cls = rq;
        return MHD_YES;
    }
    if (*upload_data_size) {
        /* A body without Content-Length (chunked) may still run over: keep reading, refuse at the end. */
        if (!rq->too_big && rq->body.len + *upload_data_size > s->cfg->max_body) {
            rq->too_big = true;
            dsv4_buf_free(&rq->body);
        }
        if (!rq->too_big && dsv4_buf_put(&rq->body, upload_data, *upload_data_size) < 0)
            return MHD_NO;
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (rq->job)
        return answer_job(s, conn, rq);

    /* The whole request is in. */
    set_receiving(rq->cs, false);
    if (rq->too_big) {
        char msg[128];
        snprintf(msg, sizeof(msg), "request body above the limit of %zu bytes", s->cfg->max_body);
        return queue_error(s, conn, HTTP_CONTENT_TOO_LARGE, "invalid_request_error", "body_too_large", msg);
    }
    bool quick = rq->route != DSV4_OAI_ROUTE_CHAT && rq->route != DSV4_OAI_ROUTE_COMPLETIONS;
    pthread_mutex_lock(&s->lock);
    bool full = s->stopping || (quick ? s->quick_jobs >= DSV4_OAI_MAX_QUICK_JOBS
                                      : s->generations >= s->cfg->max_generations);
    bool stopping = s->stopping;
    if (!full) {
        if (quick)
            s->quick_jobs++;
        else
            s->generations++;
    }
    pthread_mutex_unlock(&s->lock);
    if (stopping)
        return queue_error(s, conn, MHD_HTTP_SERVICE_UNAVAILABLE, "server_error", "shutting_down",
                           "the server is shutting down");
    if (full) {
        char msg[160];
        snprintf(msg, sizeof(msg), "%u requests are already being served (the limit); retry later",
                 quick ? DSV4_OAI_MAX_QUICK_JOBS : s->cfg->max_generations);
        return queue_error(s, conn, MHD_HTTP_TOO_MANY_REQUESTS, "rate_limit_exceeded", "too_many_requests", msg);
    }
    size_t len = rq->body.len;
    rq->job = dsv4_oai_job_new(s, rq->route, dsv4_buf_steal(&rq->body), len);
    if (rq->job) {
        pthread_mutex_lock(&s->lock);
        s->responding++;   /* until on_completed() */
        pthread_mutex_unlock(&s->lock);
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!rq->job || dsv4_oai_job_start(rq->job, conn, ci ? ci->connect_fd : -1) < 0)
        return queue_error(s, conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "server_error", NULL,
                           "could not start a worker for this request (out of memory or threads)");
    return answer_job(s, conn, rq);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    struct dsv4_oai_server *s = cls;
    struct request *rq = *con_cls;
    if (!rq) {
        /* Answered from its headers alone: the next request's deadline starts now. */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        set_receiving(ci ? ci->socket_context : NULL, true);
        return;
    }
    if (rq->job) {
        dsv4_oai_job_detach(rq->job, toe != MHD_REQUEST_TERMINATED_COMPLETED_OK);
        dsv4_oai_job_unref(rq->job);
        pthread_mutex_lock(&s->lock);
        s->responding--;
        pthread_cond_broadcast(&s->idle);
        pthread_mutex_unlock(&s->lock);
    }
    set_receiving(rq->cs, true);   /* the next request on this connection has its own deadline */
    dsv4_buf_free(&rq->body);
    free(rq);
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    char line[512];
    vsnprintf(line, sizeof(line), fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n')
        line[--n] = '\0';
    dsv4_oai_log(LOG_DEBUG, "libmicrohttpd: %s", line);
}

int dsv4_oai_http_start(struct dsv4_oai_server *s, int listen_fd)
{
    const struct dsv4_oai_config *cfg = s->cfg;
    s->mhd = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG, 0, NULL,
        NULL, on_request, s,
        MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s,   /* first, so that no message goes to stderr raw */
        MHD_OPTION_LISTEN_SOCKET, listen_fd,
        MHD_OPTION_CONNECTION_LIMIT, cfg->max_connections,
        MHD_OPTION_CONNECTION_TIMEOUT, cfg->idle_timeout,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, cfg->max_header,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
        MHD_OPTION_END);
    if (!s->mhd) {
        dsv4_oai_log(LOG_ERR, "libmicrohttpd would not start on fd %d", listen_fd);
        return -EIO;
    }
    reaper_stop = false;
    if (pthread_create(&reaper, NULL, reaper_main, s) != 0) {
        MHD_stop_daemon(s->mhd);
        s->mhd = NULL;
        return -EAGAIN;
    }
    reaper_started = true;
    return 0;
}

void dsv4_oai_http_stop(struct dsv4_oai_server *s, unsigned grace_s)
{
    if (!s->mhd)
        return;
    MHD_quiesce_daemon(s->mhd);
    pthread_mutex_lock(&s->lock);
    s->stopping = true;
    pthread_mutex_unlock(&s->lock);
    dsv4_oai_jobs_cancel_all(s);
    /* Jobs end by themselves once cancelled; each resumes its connection when it does. */
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += grace_s;
    pthread_mutex_lock(&s->lock);
    while (s->jobs && pthread_cond_timedwait(&s->idle, &s->lock, &t) == 0)
        ;
    bool left = s->jobs != NULL;
    /* A job that ended has resumed its connection with the last of its response (a stream's error
     * event and end): let libmicrohttpd send it, which stopping now would cut. No job touches a
     * connection any more, so stopping after the grace is safe whatever is still unsent. */
    while (!left && s->responding && pthread_cond_timedwait(&s->idle, &s->lock, &t) == 0)
        ;
    pthread_mutex_unlock(&s->lock);
    if (left)
        dsv4_oai_log(LOG_WARNING, "jobs still running after %u s; stopping anyway", grace_s);
    else
        MHD_stop_daemon(s->mhd);
    s->mhd = NULL;
    if (reaper_started) {
        pthread_mutex_lock(&conns_lock);
        reaper_stop = true;
        pthread_cond_signal(&reaper_wake);
        pthread_mutex_unlock(&conns_lock);
        pthread_join(reaper, NULL);
        reaper_started = false;
    }
}
