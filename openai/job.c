/* SPDX-License-Identifier: MIT */
/* A request's work against dsv4d, on its own thread: OpenAI's JSON in, dsv4d through libdsv4client,
 * OpenAI's JSON (or server-sent events) out, handed to the HTTP thread through the job (server.h). */
#include "build-config.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <syslog.h>
#include <time.h>

#include "client/dsv4client.h"
#include "openai/job.h"
#include "openai/log.h"
#include "openai/render.h"
#include "openai/reply.h"
#include "openai/server.h"

/* What a log-probability of -inf is written as (JSON has no infinity; OpenAI's API uses this). */
#define LOGPROB_FLOOR -9999.0
/* How long a health, metrics or models request waits for dsv4d. */
#define QUICK_TIMEOUT_MS 5000
/* Worker thread stack: JSON parsing recurses at most jansson's depth limit. */
#define WORKER_STACK (2u << 20)

struct dsv4_oai_job {
    struct dsv4_oai_server *srv;
    enum dsv4_oai_route route;
    char *body;
    size_t body_len;

    pthread_mutex_t lock;        /* everything below */
    int refs;
    struct MHD_Connection *conn; /* NULL once the HTTP side is done with the job */
    int client_fd;
    bool suspended;              /* the connection waits for news from this job */
    bool head_ready;             /* status and kind of response are known */
    bool stream;                 /* the response is server-sent events from out */
    bool done;                   /* nothing more will be added to out */
    bool gone;                   /* the HTTP side is finished */
    bool client_left;
    unsigned status;
    struct dsv4_buf out;
    struct dsv4_client *cli;     /* while dsv4d works for this job: what cancel needs */
    struct dsv4_oai_job *prev, *next;
};

/* ---- errors ------------------------------------------------------------------------------------- */

char *dsv4_oai_error_json(const char *type, const char *param, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    json_t *o = json_pack("{s:{s:s,s:s,s:s?,s:s?}}", "error", "message", msg, "type", type, "param", param, "code",
                          code);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* ---- the job's side of the hand-over ------------------------------------------------------------ */

/* Lock held. */
static void wake(struct dsv4_oai_job *j)
{
    if (j->suspended && j->conn) {
        j->suspended = false;
        MHD_resume_connection(j->conn);
    }
}

void dsv4_oai_job_ref(struct dsv4_oai_job *j)
{
    pthread_mutex_lock(&j->lock);
    j->refs++;
    pthread_mutex_unlock(&j->lock);
}

void dsv4_oai_job_unref(struct dsv4_oai_job *j)
{
    if (!j)
        return;
    pthread_mutex_lock(&j->lock);
    int left = --j->refs;
    pthread_mutex_unlock(&j->lock);
    if (left)
        return;
    pthread_mutex_destroy(&j->lock);
    dsv4_buf_free(&j->out);
    free(j->body);
    free(j);
}

int dsv4_oai_job_head(struct dsv4_oai_job *j, void *conn, unsigned *ret_status, bool *ret_stream, char **ret_body,
                      size_t *ret_len)
{
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->suspended = true;
        MHD_suspend_connection(conn);
        pthread_mutex_unlock(&j->lock);
        return -EAGAIN;
    }
    *ret_status = j->status;
    *ret_stream = j->stream;
    *ret_body = NULL;
    *ret_len = 0;
    if (!j->stream) {
        *ret_len = j->out.len;
        *ret_body = dsv4_buf_steal(&j->out);
    }
    pthread_mutex_unlock(&j->lock);
    return 0;
}

long dsv4_oai_job_read(struct dsv4_oai_job *j, char *buf, size_t max)
{
    long n;
    pthread_mutex_lock(&j->lock);
    if (j->out.len) {
        size_t k = j->out.len < max ? j->out.len : max;
        memcpy(buf, j->out.p, k);
        dsv4_buf_consume(&j->out, k);
        n = (long)k;
    } else if (j->done || !j->conn) {
        n = -1;
    } else {
        j->suspended = true;
        MHD_suspend_connection(j->conn);
        n = 0;
    }
    pthread_mutex_unlock(&j->lock);
    return n;
}

void dsv4_oai_job_detach(struct dsv4_oai_job *j, bool client_left)
{
    pthread_mutex_lock(&j->lock);
    j->gone = true;
    j->conn = NULL;
    j->suspended = false;
    if (client_left && !j->done) {
        j->client_left = true;
        if (j->cli)
            dsv4_client_cancel(j->cli);
    }
    pthread_mutex_unlock(&j->lock);
}

void dsv4_oai_jobs_cancel_all(struct dsv4_oai_server *s)
{
    pthread_mutex_lock(&s->lock);
    for (struct dsv4_oai_job *j = s->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->lock);
        if (j->cli)
            dsv4_client_cancel(j->cli);
        pthread_mutex_unlock(&j->lock);
    }
    pthread_mutex_unlock(&s->lock);
}

/* Whether the client is still there. While its connection is suspended the HTTP thread does not look
 * at it, so a client that closed is seen here, at the next token. Lock held. */
static bool client_alive(struct dsv4_oai_job *j)
{
    if (j->gone)
        return !j->client_left;
    if (j->suspended && j->client_fd >= 0) {
        struct pollfd p = {.fd = j->client_fd, .events = POLLRDHUP};
        if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            j->client_left = true;
            return false;
        }
    }
    return true;
}

/* The whole response at once. Takes body. */
static void respond(struct dsv4_oai_job *j, unsigned status, char *body)
{
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->head_ready = true;
        j->stream = false;
        j->status = body ? status : 500;
        dsv4_buf_free(&j->out);
        if (body)
            dsv4_buf_puts(&j->out, body);
    }
    j->done = true;
    wake(j);
    pthread_mutex_unlock(&j->lock);
    free(body);
}

static void respond_json(struct dsv4_oai_job *j, unsigned status, json_t *o)
{
    respond(j, status, o ? json_dumps(o, JSON_COMPACT) : NULL);
    json_decref(o);
}

static void respond_error(struct dsv4_oai_job *j, unsigned status, const char *type, const char *param,
                          const char *code, const char *msg)
{
    respond(j, status, dsv4_oai_error_json(type, param, code, "%s", msg));
}

/* One server-sent event (data: JSON) on the stream; the first one sends the response head. */
static void stream_event(struct dsv4_oai_job *j, const char *data)
{
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->head_ready = true;
        j->stream = true;
        j->status = 200;
    }
    if (j->stream && !j->gone) {
        dsv4_buf_puts(&j->out, "data: ");
        dsv4_buf_puts(&j->out, data);
        dsv4_buf_puts(&j->out, "\n\n");
    }
    wake(j);
    pthread_mutex_unlock(&j->lock);
}

static void stream_json(struct dsv4_oai_job *j, json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    if (s)
        stream_event(j, s);
    free(s);
    json_decref(o);
}

/* ---- dsv4d -------------------------------------------------------------------------------------- */

/* HTTP status, OpenAI error type and code for a dsv4d protocol error (doc/PROTOCOL.md). */
static void map_server_code(int code, unsigned *status, const char **type, const char **ocode)
{
    *ocode = dsv4_client_code_name(code);
    if (code == 301) {
        *status = 400;
        *type = "invalid_request_error";
        *ocode = "context_length_exceeded";
    } else if (code == 401 || code == 402) {
        *status = 429;
        *type = "rate_limit_exceeded";
    } else if (code >= 200 && code < 500) {
        *status = 400;
        *type = "invalid_request_error";
    } else if (code == 500 || code == 501 || code == 503) {
        *status = 503;
        *type = "server_error";
    } else {
        *status = 500;
        *type = "server_error";
    }
}

static void respond_client_error(struct dsv4_oai_job *j, struct dsv4_client *c, int rc, const char *what)
{
    char msg[768];
    if (rc == -EREMOTEIO) {
        unsigned status;
        const char *type, *code;
        map_server_code(dsv4_client_server_code(c), &status, &type, &code);
        respond_error(j, status, type, NULL, code, dsv4_client_error_message(c));
        return;
    }
    snprintf(msg, sizeof(msg), "%s: dsv4d: %s", what, dsv4_client_error_message(c));
    respond_error(j, 503, "server_error", NULL, "dsv4d_unavailable", msg);
}

static int connect_dsv4d(struct dsv4_oai_job *j, int timeout_ms, struct dsv4_client **ret)
{
    struct dsv4_client *c = dsv4_client_new();
    if (!c) {
        respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        return -ENOMEM;
    }
    int rc = dsv4_client_connect(c, j->srv->cfg->socket, timeout_ms);
    if (rc < 0) {
        respond_client_error(j, c, rc, "connecting");
        dsv4_client_close(c);
        return rc;
    }
    dsv4_client_set_timeout(c, timeout_ms);
    *ret = c;
    return 0;
}

/* The name requests and responses carry: configured, or dsv4d's (asked once). */
static void model_name(struct dsv4_oai_job *j, struct dsv4_client *c, char *out, size_t n)
{
    struct dsv4_oai_server *s = j->srv;
    if (s->cfg->model_name) {
        snprintf(out, n, "%s", s->cfg->model_name);
        return;
    }
    pthread_mutex_lock(&s->lock);
    snprintf(out, n, "%s", s->model_name);
    pthread_mutex_unlock(&s->lock);
    if (out[0])
        return;
    const struct dsv4_client_info *info;
    if (dsv4_client_hello(c, &info) == 0 && info->model_name && info->model_name[0]) {
        pthread_mutex_lock(&s->lock);
        snprintf(s->model_name, sizeof(s->model_name), "%s", info->model_name);
        pthread_mutex_unlock(&s->lock);
        snprintf(out, n, "%s", info->model_name);
    } else {
        snprintf(out, n, "dsv4");
    }
}

/* ---- request fields ----------------------------------------------------------------------------- */

struct bad {
    const char *param;
    char msg[512];
};

static int bad(struct bad *b, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(struct bad *b, const char *param, const char *fmt, ...)
{
    va_list ap;
    b->param = param;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof(b->msg), fmt, ap);
    va_end(ap);
    return -EINVAL;
}

/* An optional field: absent or null leaves *v. */
static int opt_number(const json_t *root, const char *key, double lo, double hi, double *v, bool *given,
                      struct bad *b)
{
    const json_t *o = json_object_get(root, key);
    if (!o || json_is_null(o))
        return 0;
    if (!json_is_number(o))
        return bad(b, key, "%s must be a number", key);
    double x = json_number_value(o);
    if (!(x >= lo && x <= hi))
        return bad(b, key, "%s is %g, must be in [%g, %g]", key, x, lo, hi);
    *v = x;
    if (given)
        *given = true;
    return 0;
}

static int opt_int(const json_t *root, const char *key, json_int_t lo, json_int_t hi, json_int_t *v, bool *given,
                   struct bad *b)
{
    const json_t *o = json_object_get(root, key);
    if (!o || json_is_null(o))
        return 0;
    if (!json_is_integer(o))
        return bad(b, key, "%s must be an integer", key);
    json_int_t x = json_integer_value(o);
    if (x < lo || x > hi)
        return bad(b, key, "%s is %" JSON_INTEGER_FORMAT ", must be in [%" JSON_INTEGER_FORMAT ", %" JSON_INTEGER_FORMAT
                   "]", key, x, lo, hi);
    *v = x;
    if (given)
        *given = true;
    return 0;
}

static int opt_bool(const json_t *root, const char *key, bool *v, struct bad *b)
{
    const json_t *o = json_object_get(root, key);
    if (!o || json_is_null(o))
        return 0;
    if (!json_is_boolean(o))
        return bad(b, key, "%s must be true or false", key);
    *v = json_is_true(o);
    return 0;
}

/* What both completion endpoints take. */
struct gen_request {
    json_t *root;
    bool stream, include_usage;
    int logprobs;                  /* -1 off; else top alternatives per token */
    struct dsv4_client_generate_params p;
    const char *stop[DSV4_CLIENT_MAX_STOP];
    int32_t stop_ids[DSV4_CLIENT_MAX_STOP_TOKEN_IDS];
};

static int parse_common(struct gen_request *g, uint32_t default_max_tokens, struct bad *b)
{
    json_t *root = g->root;
    struct dsv4_client_generate_params *p = &g->p;
    double x;
    json_int_t n;
    bool given = false;
    int rc = 0;
    const json_t *o;

    if ((o = json_object_get(root, "model")) && !json_is_string(o) && !json_is_null(o))
        return bad(b, "model", "model must be a string");
    if ((rc = opt_bool(root, "stream", &g->stream, b)))
        return rc;
    if ((o = json_object_get(root, "stream_options")) && !json_is_null(o)) {
        if (!json_is_object(o))
            return bad(b, "stream_options", "stream_options must be an object");
        if ((rc = opt_bool(o, "include_usage", &g->include_usage, b))) {
            b->param = "stream_options.include_usage";
            return rc;
        }
    }
    n = 1;
    if ((rc = opt_int(root, "n", 1, 1, &n, NULL, b))) {
        snprintf(b->msg, sizeof(b->msg), "n: only one choice per request is supported (n must be 1)");
        return rc;
    }
    n = 1;
    if ((rc = opt_int(root, "best_of", 1, 1, &n, NULL, b)))
        return rc;
    /* max_completion_tokens is the newer name; it wins when both are given. */
    n = default_max_tokens;
    if ((rc = opt_int(root, "max_tokens", 1, 1 << 20, &n, NULL, b)) ||
        (rc = opt_int(root, "max_completion_tokens", 1, 1 << 20, &n, NULL, b)))
        return rc;
    p->max_tokens = (uint32_t)n;
    x = 1;
    if ((rc = opt_number(root, "temperature", 0, 2, &x, NULL, b)))
        return rc;
    p->temperature = (float)x;
    x = 1;
    if ((rc = opt_number(root, "top_p", 0, 1, &x, NULL, b)))
        return rc;
    p->top_p = (float)x;
    n = 0;
    if ((rc = opt_int(root, "top_k", -1, INT32_MAX, &n, NULL, b)))
        return rc;
    p->top_k = n < 0 ? 0 : (int32_t)n;
    x = 0;
    if ((rc = opt_number(root, "min_p", 0, 1, &x, NULL, b)))
        return rc;
    p->min_p = (float)x;
    x = 0;
    if ((rc = opt_number(root, "presence_penalty", -2, 2, &x, NULL, b)))
        return rc;
    p->presence_penalty = (float)x;
    x = 0;
    if ((rc = opt_number(root, "frequency_penalty", -2, 2, &x, NULL, b)))
        return rc;
    p->frequency_penalty = (float)x;
    x = 1;
    if ((rc = opt_number(root, "repetition_penalty", 1e-6, 10, &x, NULL, b)))
        return rc;
    p->repetition_penalty = (float)x;
    n = 0;
    if ((rc = opt_int(root, "seed", INT64_MIN, INT64_MAX, &n, &given, b)))
        return rc;
    p->has_seed = given;
    p->seed = (uint64_t)n;   /* negative seeds are as good as any: two's complement */

    if ((o = json_object_get(root, "stop")) && !json_is_null(o)) {
        if (json_is_string(o)) {
            g->stop[p->n_stop++] = json_string_value(o);
        } else if (json_is_array(o)) {
            size_t i;
            const json_t *s;
            if (json_array_size(o) > DSV4_CLIENT_MAX_STOP)
                return bad(b, "stop", "stop has %zu strings, at most %d", json_array_size(o), DSV4_CLIENT_MAX_STOP);
            json_array_foreach(o, i, s) {
                if (!json_is_string(s))
                    return bad(b, "stop", "stop[%zu] must be a string", i);
                g->stop[p->n_stop++] = json_string_value(s);
            }
        } else {
            return bad(b, "stop", "stop must be a string or an array of strings");
        }
        for (size_t i = 0; i < p->n_stop; i++)
            if (!g->stop[i][0] || strlen(g->stop[i]) > 256)
                return bad(b, "stop", "stop strings must be 1 to 256 bytes");
        p->stop = g->stop;
    }
    if ((o = json_object_get(root, "stop_token_ids")) && !json_is_null(o)) {
        size_t i;
        const json_t *v;
        if (!json_is_array(o) || json_array_size(o) > DSV4_CLIENT_MAX_STOP_TOKEN_IDS)
            return bad(b, "stop_token_ids", "stop_token_ids must be an array of at most %d token ids",
                       DSV4_CLIENT_MAX_STOP_TOKEN_IDS);
        json_array_foreach(o, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
                return bad(b, "stop_token_ids", "stop_token_ids[%zu] must be a token id", i);
            g->stop_ids[i] = (int32_t)json_integer_value(v);
        }
        p->stop_token_ids = g->stop_ids;
        p->n_stop_token_ids = json_array_size(o);
    }
    if ((o = json_object_get(root, "logit_bias")) && !json_is_null(o) &&
        !(json_is_object(o) && json_object_size(o) == 0))
        return bad(b, "logit_bias", "logit_bias is not supported");
    if ((o = json_object_get(root, "user")) && !json_is_string(o) && !json_is_null(o))
        return bad(b, "user", "user must be a string");
    return 0;
}

/* ---- generation --------------------------------------------------------------------------------- */

struct gen {
    struct dsv4_oai_job *j;
    struct gen_request *g;
    bool chat;
    bool thinking;
    char id[64];
    char model[256];
    json_int_t created;
    struct dsv4_client *aux;       /* detokenizes logprob alternatives */
    struct dsv4_reply *reply;      /* chat only */
    bool role_sent;
    /* the current stream chunk's delta (chat), or the whole reply (not streamed) */
    struct dsv4_buf content, reasoning;
    json_t *calls;                 /* tool_calls entries: chunk deltas when streaming, whole calls otherwise */
    json_t *logprobs;              /* chat: [entries]; completions: the legacy object */
    size_t text_offset;
    int err;
};

static void random_id(char *out, size_t n, const char *prefix)
{
    unsigned char r[12];
    if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r))
        for (size_t i = 0; i < sizeof(r); i++)
            r[i] = (unsigned char)rand();
    int k = snprintf(out, n, "%s", prefix);
    for (size_t i = 0; i < sizeof(r) && (size_t)k + 2 < n; i++)
        k += snprintf(out + k, n - (size_t)k, "%02x", r[i]);
}

static json_t *logprob_value(float lp)
{
    return json_real(isfinite(lp) ? (double)lp : LOGPROB_FLOOR);
}

/* The text of one id, for logprobs (U+FFFD where the id holds part of a character). */
static json_t *token_text(struct gen *G, int32_t id)
{
    char *text = NULL;
    size_t len = 0;
    if (!G->aux || dsv4_client_detokenize(G->aux, &id, 1, &text, &len) < 0)
        return json_string("");
    json_t *s = json_stringn(text, len);
    free(text);
    return s ? s : json_string("");
}

static json_t *text_bytes(const json_t *s)
{
    json_t *a = json_array();
    const unsigned char *p = (const unsigned char *)json_string_value(s);
    for (size_t i = 0; a && i < json_string_length(s); i++)
        json_array_append_new(a, json_integer(p[i]));
    return a;
}

static json_t *chat_logprob_entry(struct gen *G, const struct dsv4_client_token *tok)
{
    json_t *text = token_text(G, tok->id), *top = json_array();
    for (size_t i = 0; i < tok->logprob->n_top && top; i++) {
        json_t *t = token_text(G, tok->logprob->top_ids[i]);
        json_array_append_new(top, json_pack("{s:o,s:o,s:o}", "token", t, "logprob",
                                             logprob_value(tok->logprob->top_logprobs[i]), "bytes", text_bytes(t)));
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "token", text, "logprob", logprob_value(tok->logprob->logprob), "bytes",
                     text_bytes(text), "top_logprobs", top);
}

/* Completions' logprobs: one object of parallel arrays. */
static void completion_logprob_add(struct gen *G, json_t *lp, const struct dsv4_client_token *tok)
{
    json_t *top = json_object();
    for (size_t i = 0; i < tok->logprob->n_top && top; i++) {
        json_t *t = token_text(G, tok->logprob->top_ids[i]);
        json_object_set_new(top, json_string_value(t), logprob_value(tok->logprob->top_logprobs[i]));
        json_decref(t);
    }
    json_array_append_new(json_object_get(lp, "tokens"), token_text(G, tok->id));
    json_array_append_new(json_object_get(lp, "token_logprobs"), logprob_value(tok->logprob->logprob));
    json_array_append_new(json_object_get(lp, "top_logprobs"), top);
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)G->text_offset));
}

static json_t *new_completion_logprobs(void)
{
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

static int on_reply(const struct dsv4_reply_event *ev, void *user)
{
    struct gen *G = user;
    json_t *call;
    switch (ev->kind) {
    case DSV4_REPLY_REASONING: return dsv4_buf_put(&G->reasoning, ev->text, ev->len);
    case DSV4_REPLY_CONTENT: return dsv4_buf_put(&G->content, ev->text, ev->len);
    case DSV4_REPLY_CALL_BEGIN: {
        char id[48];
        random_id(id, sizeof(id), "call_");
        call = json_pack("{s:I,s:s,s:s,s:{s:s%,s:s}}", "index", (json_int_t)ev->call, "id", id, "type", "function",
                         "function", "name", ev->text, ev->len, "arguments", "");
        return call && json_array_append_new(G->calls, call) == 0 ? 0 : -ENOMEM;
    }
    case DSV4_REPLY_CALL_ARGS:
        if (G->g->stream) {
            call = json_pack("{s:I,s:{s:s%}}", "index", (json_int_t)ev->call, "function", "arguments", ev->text, ev->len);
            return call && json_array_append_new(G->calls, call) == 0 ? 0 : -ENOMEM;
        } else {
            json_t *fn = json_object_get(json_array_get(G->calls, ev->call), "function");
            const json_t *args = json_object_get(fn, "arguments");
            struct dsv4_buf b = {0};
            int rc = dsv4_buf_put(&b, json_string_value(args), json_string_length(args));
            if (rc == 0) rc = dsv4_buf_put(&b, ev->text, ev->len);
            if (rc == 0) rc = json_object_set_new(fn, "arguments", json_stringn(b.p, b.len)) ? -ENOMEM : 0;
            dsv4_buf_free(&b);
            return rc;
        }
    case DSV4_REPLY_CALL_END: return 0;
    }
    return 0;
}

static json_t *chunk_base(struct gen *G)
{
    json_t *o = json_pack("{s:s,s:s,s:I,s:s}", "id", G->id, "object", G->chat ? "chat.completion.chunk" : "text_completion",
                          "created", G->created, "model", G->model);
    if (o && G->g->include_usage)
        json_object_set_new(o, "usage", json_null());
    return o;
}

/* One chunk of the stream from what the last token produced; nothing when it produced nothing. */
static void stream_chunk(struct gen *G, const char *finish, json_t *logprobs)
{
    json_t *choice;
    if (G->chat) {
        json_t *delta = json_object();
        if (!G->role_sent) {
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", json_string(""));
            G->role_sent = true;
        }
        if (G->reasoning.len)
            json_object_set_new(delta, "reasoning_content", json_stringn(G->reasoning.p, G->reasoning.len));
        if (G->content.len)
            json_object_set_new(delta, "content", json_stringn(G->content.p, G->content.len));
        if (json_array_size(G->calls))
            json_object_set(delta, "tool_calls", G->calls);
        if (!json_object_size(delta) && !finish && !logprobs) {
            json_decref(delta);
            return;
        }
        choice = json_pack("{s:i,s:o,s:o,s:o}", "index", 0, "delta", delta, "logprobs",
                           logprobs ? json_pack("{s:o}", "content", logprobs) : json_null(), "finish_reason",
                           finish ? json_string(finish) : json_null());
    } else {
        if (!G->content.len && !finish && !logprobs)
            return;
        choice = json_pack("{s:i,s:s%,s:o,s:o}", "index", 0, "text", G->content.p ? G->content.p : "", G->content.len,
                           "logprobs", logprobs ? logprobs : json_null(), "finish_reason",
                           finish ? json_string(finish) : json_null());
    }
    json_t *o = chunk_base(G);
    json_object_set_new(o, "choices", json_pack("[o]", choice));
    stream_json(G->j, o);
    G->content.len = G->reasoning.len = 0;
    json_array_clear(G->calls);
}

static int on_token(const struct dsv4_client_token *tok, void *user)
{
    struct gen *G = user;
    struct dsv4_oai_job *j = G->j;
    pthread_mutex_lock(&j->lock);
    bool alive = client_alive(j);
    pthread_mutex_unlock(&j->lock);
    if (!alive)
        return 1;   /* cancels the request in dsv4d */

    json_t *lp = NULL;
    if (tok->logprob && G->chat) {
        lp = chat_logprob_entry(G, tok);
        if (!G->g->stream)
            json_array_append_new(G->logprobs, lp);
    } else if (tok->logprob) {
        lp = G->g->stream ? new_completion_logprobs() : G->logprobs;
        completion_logprob_add(G, lp, tok);
        if (!G->g->stream)
            lp = NULL;
    }
    G->text_offset += tok->text_len;
    int rc = G->chat ? dsv4_reply_feed(G->reply, tok->text, tok->text_len)
                     : dsv4_buf_put(&G->content, tok->text, tok->text_len);
    if (rc < 0) {
        G->err = rc;
        json_decref(G->g->stream ? lp : NULL);
        return 1;
    }
    if (G->g->stream)
        stream_chunk(G, NULL, G->chat && lp ? json_pack("[o]", lp) : lp);
    return 0;
}

static const char *finish_reason(const struct gen *G, const struct dsv4_client_result *res)
{
    if (res->finish_reason == DSV4_CLIENT_FINISH_LENGTH)
        return "length";
    if (G->chat && dsv4_reply_calls(G->reply))
        return "tool_calls";
    return "stop";
}

static json_t *usage(const struct dsv4_client_result *res)
{
    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", (int)res->prompt_tokens, "completion_tokens",
                     (int)res->completion_tokens, "total_tokens", (int)(res->prompt_tokens + res->completion_tokens),
                     "prompt_tokens_details", "cached_tokens", (int)res->cached_tokens);
}

/* Run the generation and respond (streamed or whole). */
static void generate(struct gen *G, struct dsv4_client *c)
{
    struct dsv4_oai_job *j = G->j;
    struct dsv4_client_result res = {0};

    pthread_mutex_lock(&j->lock);
    j->cli = c;
    bool left = j->client_left;
    pthread_mutex_unlock(&j->lock);
    int rc = left ? -ECANCELED : dsv4_client_generate_stream(c, &G->g->p, on_token, G, &res);
    pthread_mutex_lock(&j->lock);
    j->cli = NULL;
    left = j->client_left;
    pthread_mutex_unlock(&j->lock);
    if (left) {
        pthread_mutex_lock(&j->srv->lock);
        j->srv->disconnects++;
        pthread_mutex_unlock(&j->srv->lock);
        dsv4_oai_log(LOG_INFO, "%s: the client left; dsv4d's request was cancelled", G->id);
    }

    bool streaming;
    pthread_mutex_lock(&j->lock);
    streaming = j->head_ready && j->stream;
    pthread_mutex_unlock(&j->lock);
    if (rc < 0 || G->err || res.finish_reason == DSV4_CLIENT_FINISH_ERROR) {
        if (!streaming) {
            if (rc < 0 && rc != -ECANCELED)
                respond_client_error(j, c, rc, "generating");
            else
                respond_error(j, 500, "server_error", NULL, NULL,
                              res.error_message ? res.error_message : "generation failed");
        } else {
            char *e = dsv4_oai_error_json("server_error", NULL, NULL, "%s",
                                          res.error_message ? res.error_message
                                          : rc < 0 ? dsv4_client_error_message(c) : "generation failed");
            if (e)
                stream_event(j, e);
            free(e);
            stream_event(j, "[DONE]");
        }
        dsv4_client_result_clear(&res);
        return;
    }
    if (G->chat)
        dsv4_reply_finish(G->reply);
    const char *finish = finish_reason(G, &res);

    if (G->g->stream) {
        stream_chunk(G, NULL, NULL);   /* what the end released */
        stream_chunk(G, finish, NULL);
        if (G->g->include_usage) {
            json_t *o = chunk_base(G);
            json_object_set_new(o, "choices", json_array());
            json_object_set_new(o, "usage", usage(&res));
            stream_json(j, o);
        }
        stream_event(j, "[DONE]");
    } else {
        json_t *choice;
        if (G->chat) {
            bool calls = json_array_size(G->calls) > 0;
            json_t *msg = json_pack("{s:s,s:o}", "role", "assistant", "content",
                                    G->content.len || !calls ? json_stringn(G->content.p ? G->content.p : "", G->content.len)
                                                             : json_null());
            if (G->thinking)
                json_object_set_new(msg, "reasoning_content",
                                    json_stringn(G->reasoning.p ? G->reasoning.p : "", G->reasoning.len));
            if (calls)
                json_object_set(msg, "tool_calls", G->calls);
            choice = json_pack("{s:i,s:o,s:o,s:s}", "index", 0, "message", msg, "logprobs",
                               G->logprobs ? json_pack("{s:O,s:n}", "content", G->logprobs, "refusal") : json_null(),
                               "finish_reason", finish);
        } else {
            choice = json_pack("{s:i,s:s%,s:O?,s:s}", "index", 0, "text", G->content.p ? G->content.p : "",
                               G->content.len, "logprobs", G->logprobs, "finish_reason", finish);
        }
        json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:[o],s:o}", "id", G->id, "object",
                              G->chat ? "chat.completion" : "text_completion", "created", G->created, "model", G->model,
                              "choices", choice, "usage", usage(&res));
        respond_json(j, 200, o);
    }
    dsv4_client_result_clear(&res);
}

static void gen_clear(struct gen *G)
{
    dsv4_client_close(G->aux);
    dsv4_reply_free(G->reply);
    dsv4_buf_free(&G->content);
    dsv4_buf_free(&G->reasoning);
    json_decref(G->calls);
    json_decref(G->logprobs);
}

/* Parse the body; on failure the job has its 400 and NULL comes back. */
static json_t *parse_body(struct dsv4_oai_job *j)
{
    json_error_t jerr;
    json_t *root = json_loadb(j->body ? j->body : "", j->body_len, 0, &jerr);
    if (!root) {
        char msg[300];
        snprintf(msg, sizeof(msg), "the body is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                 jerr.column);
        respond_error(j, 400, "invalid_request_error", NULL, "invalid_json", msg);
        return NULL;
    }
    if (!json_is_object(root)) {
        respond_error(j, 400, "invalid_request_error", NULL, "invalid_json", "the body must be a JSON object");
        json_decref(root);
        return NULL;
    }
    return root;
}

static void respond_bad(struct dsv4_oai_job *j, const struct bad *b)
{
    respond_error(j, 400, "invalid_request_error", b->param, "invalid_value", b->msg);
}

/* Thinking mode: chat_template_kwargs {"thinking": true} (or "enable_thinking"), or a reasoning
 * effort other than "none". DeepSeek's "max" effort (and OpenAI's "xhigh") adds its effort prompt. */
static int parse_thinking(const json_t *root, struct dsv4_render_opts *o, struct bad *b)
{
    const json_t *kw = json_object_get(root, "chat_template_kwargs"), *eff = json_object_get(root, "reasoning_effort");
    int rc;
    if (kw && !json_is_null(kw)) {
        if (!json_is_object(kw))
            return bad(b, "chat_template_kwargs", "chat_template_kwargs must be an object");
        if ((rc = opt_bool(kw, "thinking", &o->thinking, b)) || (rc = opt_bool(kw, "enable_thinking", &o->thinking, b))) {
            b->param = "chat_template_kwargs";
            return rc;
        }
    }
    if (eff && !json_is_null(eff)) {
        static const char *const efforts[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
        size_t k, n = sizeof(efforts) / sizeof(efforts[0]);
        if (!json_is_string(eff))
            return bad(b, "reasoning_effort", "reasoning_effort must be a string");
        for (k = 0; k < n; k++)
            if (strcmp(json_string_value(eff), efforts[k]) == 0)
                break;
        if (k == n)
            return bad(b, "reasoning_effort", "reasoning_effort '%s' is not one of none, minimal, low, medium, high, "
                       "xhigh, max", json_string_value(eff));
        if (k > 0)
            o->thinking = true;
        o->effort_max = k >= 5;
    }
    return 0;
}

/* tools and tool_choice: "none" hides the tools; a named function offers only that one (the choice is
 * not enforced by constrained decoding; "required" is as "auto"). Returns the tools to render. */
static int parse_tools(const json_t *root, json_t **ret_tools, struct bad *b)
{
    const json_t *tools = json_object_get(root, "tools"), *choice = json_object_get(root, "tool_choice");
    /* Checked even without tools: a wrong type is an error wherever it is. */
    *ret_tools = NULL;
    if (tools && !json_is_null(tools) && !json_is_array(tools))
        return bad(b, "tools", "tools must be an array");
    if (json_array_size(tools) > 128)
        return bad(b, "tools", "%zu tools, at most 128", json_array_size(tools));
    if (choice && !json_is_null(choice) && !json_is_string(choice) && !json_is_object(choice))
        return bad(b, "tool_choice", "tool_choice must be a string or an object");
    if (!json_array_size(tools))
        return 0;
    if (choice && !json_is_null(choice)) {
        if (json_is_string(choice)) {
            const char *c = json_string_value(choice);
            if (strcmp(c, "none") == 0)
                return 0;
            if (strcmp(c, "auto") != 0 && strcmp(c, "required") != 0)
                return bad(b, "tool_choice", "tool_choice '%s' is not none, auto, required or a function", c);
        } else if (json_is_object(choice)) {
            const json_t *name = json_object_get(json_object_get(choice, "function"), "name");
            if (!json_is_string(name))
                return bad(b, "tool_choice", "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
            size_t i;
            const json_t *t;
            json_array_foreach(tools, i, t) {
                const json_t *tn = json_object_get(json_object_get(t, "function"), "name");
                if (json_is_string(tn) && strcmp(json_string_value(tn), json_string_value(name)) == 0) {
                    *ret_tools = json_pack("[O]", t);
                    return *ret_tools ? 0 : -ENOMEM;
                }
            }
            return bad(b, "tool_choice", "tool_choice names '%s', which is not in tools", json_string_value(name));
        }
    }
    *ret_tools = json_incref((json_t *)tools);
    return 0;
}

static void run_chat(struct dsv4_oai_job *j)
{
    struct gen_request g = {.logprobs = -1};
    struct gen G = {.j = j, .g = &g, .chat = true};
    struct dsv4_render_opts ro = {0};
    struct dsv4_parts parts = {0};
    struct bad b = {0};
    json_t *tools = NULL;
    const char **ptrs = NULL;
    size_t *lens = NULL;
    struct dsv4_client *c = NULL;
    bool lp = false;
    json_int_t top = 0;
    char err[512];
    int rc;

    if (!(g.root = parse_body(j)))
        return;
    dsv4_client_generate_params_init(&g.p);
    const json_t *msgs = json_object_get(g.root, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        bad(&b, "messages", "messages must be a non-empty array of messages");
        goto bad_request;
    }
    if (json_array_size(msgs) > DSV4_OAI_MAX_MESSAGES) {
        bad(&b, "messages", "%zu messages, at most %u", json_array_size(msgs), DSV4_OAI_MAX_MESSAGES);
        goto bad_request;
    }
    if (parse_common(&g, 0, &b) || parse_thinking(g.root, &ro, &b) || parse_tools(g.root, &tools, &b) ||
        opt_bool(g.root, "logprobs", &lp, &b) || opt_int(g.root, "top_logprobs", 0, DSV4_CLIENT_MAX_LOGPROBS, &top, NULL, &b))
        goto bad_request;
    const json_t *rf = json_object_get(g.root, "response_format");
    if (rf && !json_is_null(rf)) {
        const json_t *type = json_object_get(rf, "type");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0) {
            bad(&b, "response_format", "response_format: only {\"type\": \"text\"} is supported");
            goto bad_request;
        }
    }
    if (json_object_get(g.root, "top_logprobs") && !json_is_null(json_object_get(g.root, "top_logprobs")) && !lp) {
        bad(&b, "top_logprobs", "top_logprobs needs logprobs: true");
        goto bad_request;
    }
    g.p.logprobs = lp ? (int)top : -1;
    rc = dsv4_render_chat(msgs, tools, &ro, &parts, err, sizeof(err));
    if (rc == -EINVAL) {
        bad(&b, "messages", "%s", err);
        goto bad_request;
    }
    if (rc < 0 || dsv4_parts_export(&parts, &ptrs, &lens) < 0) {
        respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    g.p.prompt_parts = ptrs;
    g.p.prompt_part_lens = lens;
    g.p.n_prompt_parts = parts.n;
    g.p.add_bos = false;   /* the parts begin with it */

    G.thinking = ro.thinking;
    G.created = (json_int_t)time(NULL);
    random_id(G.id, sizeof(G.id), "chatcmpl-");
    G.calls = json_array();
    if (lp)
        G.logprobs = json_array();
    if (dsv4_reply_new(ro.thinking, tools != NULL, on_reply, &G, &G.reply) < 0 || !G.calls) {
        respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    if (connect_dsv4d(j, j->srv->cfg->dsv4d_timeout_ms, &c) < 0)
        goto out;
    if (lp && connect_dsv4d(j, j->srv->cfg->dsv4d_timeout_ms, &G.aux) < 0)
        goto out;
    model_name(j, c, G.model, sizeof(G.model));
    generate(&G, c);
    goto out;
bad_request:
    respond_bad(j, &b);
out:
    dsv4_client_close(c);
    gen_clear(&G);
    free(ptrs);
    free(lens);
    dsv4_parts_free(&parts);
    json_decref(tools);
    json_decref(g.root);
}

static void run_completions(struct dsv4_oai_job *j)
{
    struct gen_request g = {.logprobs = -1};
    struct gen G = {.j = j, .g = &g};
    struct bad b = {0};
    struct dsv4_client *c = NULL;
    int32_t *ids = NULL;
    json_int_t lp = -1;
    bool echo = false;

    if (!(g.root = parse_body(j)))
        return;
    dsv4_client_generate_params_init(&g.p);
    /* OpenAI's default for this endpoint is 16 tokens. */
    if (parse_common(&g, 16, &b) || opt_int(g.root, "logprobs", 0, DSV4_CLIENT_MAX_LOGPROBS, &lp, NULL, &b) ||
        opt_bool(g.root, "echo", &echo, &b))
        goto bad_request;
    if (echo) {
        bad(&b, "echo", "echo is not supported");
        goto bad_request;
    }
    const json_t *suffix = json_object_get(g.root, "suffix");
    if (suffix && !json_is_null(suffix)) {
        bad(&b, "suffix", "suffix is not supported");
        goto bad_request;
    }
    const json_t *prompt = json_object_get(g.root, "prompt");
    /* A batch of one is the same as its element. */
    if (json_is_array(prompt) && json_array_size(prompt) == 1 &&
        (json_is_string(json_array_get(prompt, 0)) || json_is_array(json_array_get(prompt, 0))))
        prompt = json_array_get(prompt, 0);
    if (json_is_string(prompt)) {
        if (!json_string_length(prompt)) {
            bad(&b, "prompt", "prompt is empty");
            goto bad_request;
        }
        g.p.prompt = json_string_value(prompt);
        g.p.add_bos = true;
    } else if (json_is_array(prompt) && json_array_size(prompt) > 0) {
        size_t i, n = json_array_size(prompt);
        const json_t *v;
        ids = malloc(n * sizeof(*ids));
        if (!ids) {
            respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
            goto out;
        }
        json_array_foreach(prompt, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
                bad(&b, "prompt", "prompt must be a string or an array of token ids (a batch of several prompts is "
                    "not supported: n is 1)");
                goto bad_request;
            }
            ids[i] = (int32_t)json_integer_value(v);
        }
        g.p.tokens = ids;
        g.p.n_tokens = n;
    } else {
        bad(&b, "prompt", "prompt must be a non-empty string or array of token ids");
        goto bad_request;
    }
    g.p.logprobs = (int)lp;
    G.created = (json_int_t)time(NULL);
    random_id(G.id, sizeof(G.id), "cmpl-");
    if (lp >= 0 && !g.stream && !(G.logprobs = new_completion_logprobs())) {
        respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    if (connect_dsv4d(j, j->srv->cfg->dsv4d_timeout_ms, &c) < 0)
        goto out;
    if (lp >= 0 && connect_dsv4d(j, j->srv->cfg->dsv4d_timeout_ms, &G.aux) < 0)
        goto out;
    model_name(j, c, G.model, sizeof(G.model));
    generate(&G, c);
    goto out;
bad_request:
    respond_bad(j, &b);
out:
    dsv4_client_close(c);
    gen_clear(&G);
    free(ids);
    json_decref(g.root);
}

/* ---- models, health, metrics -------------------------------------------------------------------- */

static void run_models(struct dsv4_oai_job *j)
{
    struct dsv4_client *c;
    const struct dsv4_client_info *info;
    char name[256];
    if (connect_dsv4d(j, QUICK_TIMEOUT_MS, &c) < 0)
        return;
    int rc = dsv4_client_hello(c, &info);
    if (rc < 0) {
        respond_client_error(j, c, rc, "hello");
    } else {
        model_name(j, c, name, sizeof(name));
        respond_json(j, 200, json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:I}]}", "object", "list", "data", "id", name, "object",
                                       "model", "created", (json_int_t)time(NULL), "owned_by", "dsv4d", "max_model_len",
                                       (json_int_t)info->max_context));
    }
    dsv4_client_close(c);
}

static void run_health(struct dsv4_oai_job *j)
{
    struct dsv4_client *c = dsv4_client_new();
    struct dsv4_client_health h;
    int rc = c ? dsv4_client_connect(c, j->srv->cfg->socket, QUICK_TIMEOUT_MS) : -ENOMEM;
    if (rc == 0) {
        dsv4_client_set_timeout(c, QUICK_TIMEOUT_MS);
        rc = dsv4_client_health(c, &h);
    }
    if (rc < 0)
        respond_json(j, 503, json_pack("{s:s,s:s}", "status", "unavailable", "reason",
                                       c ? dsv4_client_error_message(c) : "out of memory"));
    else
        respond_json(j, h.status == DSV4_CLIENT_HEALTH_READY ? 200 : 503,
                     json_pack("{s:s,s:s}", "status", dsv4_client_health_name(h.status), "reason", h.reason));
    dsv4_client_close(c);
}

static void metric(struct dsv4_buf *b, const char *name, const char *type, const char *help, double v)
{
    dsv4_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

/* Prometheus text exposition of dsv4d's stats and this front's own counters. */
static void run_metrics(struct dsv4_oai_job *j)
{
    struct dsv4_oai_server *s = j->srv;
    struct dsv4_client *c = dsv4_client_new();
    struct dsv4_client_stats st;
    struct dsv4_client_health h;
    struct dsv4_buf b = {0};
    int rc = c ? dsv4_client_connect(c, s->cfg->socket, QUICK_TIMEOUT_MS) : -ENOMEM;
    if (rc == 0) {
        dsv4_client_set_timeout(c, QUICK_TIMEOUT_MS);
        rc = dsv4_client_stats(c, &st);
    }
    if (rc == 0)
        rc = dsv4_client_health(c, &h);
    metric(&b, "dsv4d_up", "gauge", "1 when dsv4d answered this scrape", rc == 0);
    if (rc == 0) {
        dsv4_buf_printf(&b, "# HELP dsv4d_health dsv4d's state (1 for the current one)\n# TYPE dsv4d_health gauge\n");
        for (int k = DSV4_CLIENT_HEALTH_READY; k <= DSV4_CLIENT_HEALTH_DRAINING; k++)
            dsv4_buf_printf(&b, "dsv4d_health{status=\"%s\"} %d\n", dsv4_client_health_name(k), (int)h.status == k);
        dsv4_buf_printf(&b, "# HELP dsv4d_info the backend and kernel variants in use\n# TYPE dsv4d_info gauge\n"
                        "dsv4d_info{backend=\"%s\"} 1\n", st.backend);
        for (size_t k = 0; k < st.n_kernels; k++) {
            char esc[160];
            size_t w = 0;
            for (const char *p = st.kernels[k]; *p && w + 2 < sizeof(esc); p++) {
                if (*p == '"' || *p == '\\')
                    esc[w++] = '\\';
                esc[w++] = *p == '\n' ? ' ' : *p;
            }
            esc[w] = '\0';
            dsv4_buf_printf(&b, "dsv4d_info{kernel=\"%s\"} 1\n", esc);
        }
        metric(&b, "dsv4d_uptime_seconds", "gauge", "time since dsv4d started", st.uptime_s);
        metric(&b, "dsv4d_slots", "gauge", "sequence slots", st.slots_total);
        metric(&b, "dsv4d_slots_busy", "gauge", "slots holding a sequence", st.slots_busy);
        metric(&b, "dsv4d_queue_depth", "gauge", "requests waiting for a slot", st.queue_depth);
        metric(&b, "dsv4d_connections", "gauge", "open connections to dsv4d", st.connections);
        metric(&b, "dsv4d_requests_total", "counter", "generate requests accepted", (double)st.requests_total);
        metric(&b, "dsv4d_requests_failed_total", "counter", "generate requests that failed", (double)st.requests_failed);
        metric(&b, "dsv4d_requests_cancelled_total", "counter", "generate requests cancelled",
               (double)st.requests_cancelled);
        metric(&b, "dsv4d_prompt_tokens_total", "counter", "prompt tokens accepted", (double)st.prompt_tokens_total);
        metric(&b, "dsv4d_generated_tokens_total", "counter", "tokens generated", (double)st.generated_tokens_total);
        metric(&b, "dsv4d_prefill_tokens_per_second", "gauge", "recent prefill rate", st.prefill_tokens_per_s);
        metric(&b, "dsv4d_decode_tokens_per_second", "gauge", "recent decode rate", st.decode_tokens_per_s);
        metric(&b, "dsv4d_device_arena_bytes", "gauge", "the boot-time device allocation", (double)st.device_arena_bytes);
        metric(&b, "dsv4d_heap_allocated_bytes", "gauge", "heap bytes allocated", (double)st.heap_allocated);
        metric(&b, "dsv4d_heap_resident_bytes", "gauge", "heap bytes resident", (double)st.heap_resident);
        metric(&b, "dsv4d_device_allocs_after_boot", "gauge", "device allocations after boot (stays 0)",
               (double)st.device_allocs_after_boot);
        metric(&b, "dsv4d_graph_captures_after_boot", "gauge", "graph captures after boot (stays 0)",
               (double)st.graph_captures_after_boot);
        metric(&b, "dsv4d_steps_total", "counter", "engine steps that did work", (double)st.steps);
        metric(&b, "dsv4d_decode_steps_total", "counter", "steps that decoded", (double)st.decode_steps);
        dsv4_buf_printf(&b, "# HELP dsv4d_decode_batch_size decode steps by batch size\n"
                        "# TYPE dsv4d_decode_batch_size histogram\n");
        uint64_t cum = 0;
        for (size_t k = 0; k < st.n_batch_hist; k++) {
            cum += st.batch_hist[k];
            if (k + 1 < st.n_batch_hist)
                dsv4_buf_printf(&b, "dsv4d_decode_batch_size_bucket{le=\"%llu\"} %" PRIu64 "\n", 1ull << k, cum);
        }
        dsv4_buf_printf(&b, "dsv4d_decode_batch_size_bucket{le=\"+Inf\"} %" PRIu64 "\n"
                        "dsv4d_decode_batch_size_count %" PRIu64 "\n", st.decode_steps, st.decode_steps);
    }
    static const char *const route_names[] = {"chat_completions", "completions", "models", "health", "metrics"};
    pthread_mutex_lock(&s->lock);
    dsv4_buf_printf(&b, "# HELP dsv4_openai_requests_total HTTP requests by endpoint\n"
                    "# TYPE dsv4_openai_requests_total counter\n");
    for (int r = 0; r < DSV4_OAI_N_ROUTES; r++)
        dsv4_buf_printf(&b, "dsv4_openai_requests_total{endpoint=\"%s\"} %" PRIu64 "\n", route_names[r], s->requests[r]);
    dsv4_buf_printf(&b, "# HELP dsv4_openai_errors_total error responses by class\n"
                    "# TYPE dsv4_openai_errors_total counter\n"
                    "dsv4_openai_errors_total{class=\"4xx\"} %" PRIu64 "\n"
                    "dsv4_openai_errors_total{class=\"5xx\"} %" PRIu64 "\n", s->responses_4xx, s->responses_5xx);
    metric(&b, "dsv4_openai_generations", "gauge", "completions in flight", s->generations);
    metric(&b, "dsv4_openai_disconnects_total", "counter", "generations cancelled because the client left",
           (double)s->disconnects);
    pthread_mutex_unlock(&s->lock);
    dsv4_client_close(c);
    respond(j, 200, dsv4_buf_steal(&b));
}

/* ---- the thread --------------------------------------------------------------------------------- */

static void *job_main(void *arg)
{
    struct dsv4_oai_job *j = arg;
    struct dsv4_oai_server *s = j->srv;
    switch (j->route) {
    case DSV4_OAI_ROUTE_CHAT: run_chat(j); break;
    case DSV4_OAI_ROUTE_COMPLETIONS: run_completions(j); break;
    case DSV4_OAI_ROUTE_MODELS: run_models(j); break;
    case DSV4_OAI_ROUTE_HEALTH: run_health(j); break;
    case DSV4_OAI_ROUTE_METRICS: run_metrics(j); break;
    case DSV4_OAI_N_ROUTES: break;
    }
    /* Whatever path was taken, the response is complete now. */
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->head_ready = true;
        j->status = 500;
        dsv4_buf_puts(&j->out, "{\"error\":{\"message\":\"no response\",\"type\":\"server_error\"}}");
    }
    j->done = true;
    wake(j);
    pthread_mutex_unlock(&j->lock);

    pthread_mutex_lock(&s->lock);
    if (j->prev)
        j->prev->next = j->next;
    else
        s->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    if (j->route == DSV4_OAI_ROUTE_CHAT || j->route == DSV4_OAI_ROUTE_COMPLETIONS)
        s->generations--;
    else
        s->quick_jobs--;
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->lock);
    dsv4_oai_job_unref(j);
    return NULL;
}

struct dsv4_oai_job *dsv4_oai_job_new(struct dsv4_oai_server *s, enum dsv4_oai_route route, char *body,
                                      size_t body_len)
{
    struct dsv4_oai_job *j = calloc(1, sizeof(*j));
    if (!j) {
        free(body);
        return NULL;
    }
    j->srv = s;
    j->route = route;
    j->body = body;
    j->body_len = body_len;
    j->refs = 1;
    j->client_fd = -1;
    pthread_mutex_init(&j->lock, NULL);
    return j;
}

int dsv4_oai_job_start(struct dsv4_oai_job *j, void *conn, int client_fd)
{
    struct dsv4_oai_server *s = j->srv;
    pthread_attr_t attr;
    pthread_t t;
    j->conn = conn;
    j->client_fd = client_fd;
    j->refs++;   /* the thread's */
    pthread_mutex_lock(&s->lock);
    j->next = s->jobs;
    if (s->jobs)
        s->jobs->prev = j;
    s->jobs = j;
    pthread_mutex_unlock(&s->lock);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, WORKER_STACK);
    int rc = pthread_create(&t, &attr, job_main, j);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return 0;
    pthread_mutex_lock(&s->lock);
    if (j->prev)
        j->prev->next = j->next;
    else
        s->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    if (j->route == DSV4_OAI_ROUTE_CHAT || j->route == DSV4_OAI_ROUTE_COMPLETIONS)
        s->generations--;
    else
        s->quick_jobs--;
    pthread_mutex_unlock(&s->lock);
    j->refs--;
    j->conn = NULL;
    return -rc;
}
