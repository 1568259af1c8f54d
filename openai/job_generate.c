/* SPDX-License-Identifier: MIT */
/* Chat and completions (openai/job_internal.h): the request rendered, generated through dsv4d, and
 * answered whole or streamed in OpenAI's chunks (content, reasoning, tool calls, logprobs, usage).
 * A request of n choices is n dsv4d requests on n connections, run at the same time. */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <syslog.h>
#include <time.h>

#include "openai/job_internal.h"
#include "openai/log.h"
#include "openai/reply.h"

/* What a log-probability of -inf is written as (JSON has no infinity; OpenAI's API uses this). */
#define LOGPROB_FLOOR -9999.0

struct choices;

/* One choice of a request: its dsv4d request and what it has produced. */
struct gen {
    struct dsv4_oai_job *j;
    struct oai_gen_request *g;
    struct choices *all;
    int index;                     /* the choice: its index in the response */
    struct dsv4_client_generate_params p;  /* g->p with the choice's seed */
    bool chat;
    bool thinking;
    char id[64];
    char model[256];
    json_int_t created;
    struct dsv4_client *c;         /* the choice's connection to dsv4d */
    struct dsv4_client *aux;       /* detokenizes logprob alternatives */
    int aux_rc;                    /* aux's first failure: the logprobs would be wrong, the choice fails */
    struct dsv4_reply *reply;      /* chat only */
    bool role_sent;
    /* the current stream chunk's delta (chat), or the whole reply (not streamed) */
    struct dsv4_buf content, reasoning;
    json_t *calls;                 /* tool_calls entries: chunk deltas when streaming, whole calls otherwise */
    json_t *logprobs;              /* chat: [entries]; completions: the legacy object */
    size_t text_offset;
    int err;
    /* the outcome */
    bool failed;                   /* rc (a libdsv4client error of errc doing what), err, or res says so */
    int rc;
    const char *what;
    struct dsv4_client *errc;
    struct dsv4_client_result res;
    const char *finish;            /* the finish_reason, once the choice ended well */
};

/* The choices of one request, run concurrently (choice 0 on the job's thread). */
struct choices {
    int n;
    bool failed;                   /* a choice failed: the others stop at their next token (j->lock) */
    struct gen G[DSV4_OAI_MAX_CHOICES];
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

/* The text of one id, for logprobs (U+FFFD where the id holds part of a character). A failure is
 * kept in G->aux_rc: dsv4d may close aux, which has no generate in flight, as one idle connection
 * too many (its max_idle_per_uid), and every text after that would be "". */
static json_t *token_text(struct gen *G, int32_t id)
{
    char *text = NULL;
    size_t len = 0;
    if (!G->aux)
        return json_string("");
    int rc = G->aux_rc ? G->aux_rc : dsv4_client_detokenize(G->aux, &id, 1, &text, &len);
    if (rc < 0) {
        G->aux_rc = rc;
        return json_string("");
    }
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

static json_t *chunk_base(const struct gen *G)
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
        choice = json_pack("{s:i,s:o,s:o,s:o}", "index", G->index, "delta", delta, "logprobs",
                           logprobs ? json_pack("{s:o}", "content", logprobs) : json_null(), "finish_reason",
                           finish ? json_string(finish) : json_null());
    } else {
        if (!G->content.len && !finish && !logprobs)
            return;
        choice = json_pack("{s:i,s:s%,s:o,s:o}", "index", G->index, "text", G->content.p ? G->content.p : "",
                           G->content.len,
                           "logprobs", logprobs ? logprobs : json_null(), "finish_reason",
                           finish ? json_string(finish) : json_null());
    }
    json_t *o = chunk_base(G);
    json_object_set_new(o, "choices", json_pack("[o]", choice));
    oai_stream_json(G->j, o);
    G->content.len = G->reasoning.len = 0;
    json_array_clear(G->calls);
}

static int on_token(const struct dsv4_client_token *tok, void *user)
{
    struct gen *G = user;
    struct dsv4_oai_job *j = G->j;
    pthread_mutex_lock(&j->lock);
    bool alive = oai_client_alive(j) && !j->stopping && !G->all->failed;
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
    if (G->aux_rc) {
        json_decref(G->g->stream ? lp : NULL);
        return 1;   /* run_choice() answers the failure */
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

/* usage: the prompt once (every choice reads the same one), the completion tokens of every choice. */
static json_t *usage(const struct choices *A)
{
    const struct dsv4_client_result *r0 = &A->G[0].res;
    int completion = 0;
    for (int i = 0; i < A->n; i++)
        completion += (int)A->G[i].res.completion_tokens;
    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", (int)r0->prompt_tokens, "completion_tokens",
                     completion, "total_tokens", (int)r0->prompt_tokens + completion, "prompt_tokens_details",
                     "cached_tokens", (int)r0->cached_tokens);
}

/* A choice that cannot go on: the others stop at their next token. */
static void choice_failed(struct gen *G, int rc, const char *what, struct dsv4_client *errc)
{
    G->failed = true;
    G->rc = rc;
    G->what = what;
    G->errc = errc;
    pthread_mutex_lock(&G->j->lock);
    G->all->failed = true;
    pthread_mutex_unlock(&G->j->lock);
}

/* A connection to dsv4d for choice G into *ret; false (the failure recorded) when there is none. */
static bool choice_connect(struct gen *G, struct dsv4_client **ret)
{
    const int rc = oai_dsv4d_open(G->j->srv->cfg, G->j->srv->cfg->dsv4d_timeout_ms, ret);
    if (rc < 0)
        choice_failed(G, rc, "connecting", *ret);
    return rc == 0;
}

/* Run one choice: connect (and a second time for the text of logprob alternatives), generate, and
 * when streamed send its last chunks. Failures are recorded in G, answered by respond(). */
static void run_choice(struct gen *G)
{
    struct dsv4_oai_job *j = G->j;

    if (!choice_connect(G, &G->c) || (G->p.logprobs >= 0 && !choice_connect(G, &G->aux)))
        return;
    oai_model_name(j, G->c, G->model, sizeof(G->model));
    pthread_mutex_lock(&j->lock);
    j->cli[G->index] = G->c;
    bool stop = j->client_left || j->stopping || G->all->failed;
    pthread_mutex_unlock(&j->lock);
    int rc = stop ? 0 : dsv4_client_generate_stream(G->c, &G->p, on_token, G, &G->res);
    pthread_mutex_lock(&j->lock);
    j->cli[G->index] = NULL;
    bool asked = j->client_left || G->all->failed;   /* a cancel this request wanted */
    pthread_mutex_unlock(&j->lock);
    if (stop)
        G->res.finish_reason = DSV4_CLIENT_FINISH_CANCELLED;
    if (rc < 0) {
        choice_failed(G, rc, "generating", G->c);
        return;
    }
    if (G->aux_rc) {
        choice_failed(G, G->aux_rc, "detokenizing logprobs on a second connection (dsv4d counts it against "
                      "max_idle_per_uid: it has no generate in flight)", G->aux);
        return;
    }
    if (G->res.finish_reason == DSV4_CLIENT_FINISH_CANCELLED && !asked) {
        /* dsv4d draining (or this server stopping) cut the reply short: an error, not a reply that
         * looks whole with finish_reason "stop". */
        pthread_mutex_lock(&j->srv->lock);
        bool stopping = j->srv->stopping;
        pthread_mutex_unlock(&j->srv->lock);
        choice_failed(G, -ECANCELED, stopping ? "this server is shutting down; the generation was cancelled"
                                              : "dsv4d cancelled the generation (it is shutting down); retry later",
                      NULL);
        return;
    }
    if (G->err || G->res.finish_reason == DSV4_CLIENT_FINISH_ERROR) {
        choice_failed(G, 0, NULL, NULL);
        return;
    }
    if (G->chat)
        dsv4_reply_finish(G->reply);
    G->finish = finish_reason(G, &G->res);
    if (G->g->stream && G->res.finish_reason != DSV4_CLIENT_FINISH_CANCELLED) {
        stream_chunk(G, NULL, NULL);   /* what the end released */
        stream_chunk(G, G->finish, NULL);
    }
}

static void *choice_main(void *arg)
{
    run_choice(arg);
    return NULL;
}

/* The whole response, the stream's end, or the first failed choice's error. */
static void respond(struct choices *A)
{
    struct dsv4_oai_job *j = A->G[0].j;
    const struct gen *F = NULL;
    for (int i = 0; i < A->n && !F; i++)
        if (A->G[i].failed)
            F = &A->G[i];

    pthread_mutex_lock(&j->lock);
    bool streaming = j->head_ready && j->stream;
    pthread_mutex_unlock(&j->lock);
    if (F) {
        char buf[256];
        const char *msg = "generation failed";
        const bool cut = F->rc == -ECANCELED;   /* what says why */
        if (cut)
            msg = F->what;
        else if (F->res.error_message)
            msg = F->res.error_message;
        else if (F->rc < 0 && F->errc)
            msg = dsv4_client_error_message(F->errc);
        else if (F->rc < 0 || F->err < 0) {
            snprintf(buf, sizeof(buf), "%s%s%s", F->what ? F->what : "", F->what ? ": " : "",
                     strerror(F->rc < 0 ? -F->rc : -F->err));
            msg = buf;
        }
        if (!streaming && F->rc < 0 && F->errc) {
            oai_respond_client_error(j, F->errc, F->rc, F->what);
        } else if (!streaming) {
            oai_respond_error(j, cut ? 503 : 500, "server_error", NULL, cut ? "cancelled" : NULL, msg);
        } else {
            char *e = dsv4_oai_error_json("server_error", NULL, cut ? "cancelled" : NULL, "%s", msg);
            if (e)
                oai_stream_event(j, e);
            free(e);
            oai_stream_event(j, "[DONE]");
        }
        return;
    }
    const struct gen *G0 = &A->G[0];
    if (G0->g->stream) {
        if (G0->g->include_usage) {
            json_t *o = chunk_base(G0);
            json_object_set_new(o, "choices", json_array());
            json_object_set_new(o, "usage", usage(A));
            oai_stream_json(j, o);
        }
        oai_stream_event(j, "[DONE]");
        return;
    }
    json_t *list = json_array();
    for (int i = 0; i < A->n && list; i++) {
        const struct gen *G = &A->G[i];
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
            choice = json_pack("{s:i,s:o,s:o,s:s}", "index", G->index, "message", msg, "logprobs",
                               G->logprobs ? json_pack("{s:O,s:n}", "content", G->logprobs, "refusal") : json_null(),
                               "finish_reason", G->finish);
        } else {
            choice = json_pack("{s:i,s:s%,s:O?,s:s}", "index", G->index, "text", G->content.p ? G->content.p : "",
                               G->content.len, "logprobs", G->logprobs, "finish_reason", G->finish);
        }
        json_array_append_new(list, choice);
    }
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", G0->id, "object",
                          G0->chat ? "chat.completion" : "text_completion", "created", G0->created, "model", G0->model,
                          "choices", list, "usage", usage(A));
    oai_respond_json(j, 200, o);
}

/* Run the request's choices (choice i sampling with seed + i when a seed is given), concurrently,
 * then answer. */
static void generate(struct choices *A)
{
    struct dsv4_oai_job *j = A->G[0].j;
    pthread_t t[DSV4_OAI_MAX_CHOICES];
    bool started[DSV4_OAI_MAX_CHOICES] = {false};
    pthread_attr_t attr;

    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, DSV4_OAI_WORKER_STACK);
    for (int i = 1; i < A->n; i++) {
        int rc = pthread_create(&t[i], &attr, choice_main, &A->G[i]);
        started[i] = rc == 0;
        if (rc)
            choice_failed(&A->G[i], -rc, "starting a thread for a choice", NULL);
    }
    pthread_attr_destroy(&attr);
    run_choice(&A->G[0]);
    for (int i = 1; i < A->n; i++)
        if (started[i])
            pthread_join(t[i], NULL);

    pthread_mutex_lock(&j->lock);
    bool left = j->client_left;
    pthread_mutex_unlock(&j->lock);
    if (left) {
        pthread_mutex_lock(&j->srv->lock);
        j->srv->disconnects++;
        pthread_mutex_unlock(&j->srv->lock);
        dsv4_oai_log(LOG_INFO, "%s: the client left; dsv4d's request%s cancelled", A->G[0].id,
                     A->n > 1 ? "s were" : " was");
    }
    respond(A);
}

static void choices_free(struct choices *A)
{
    for (int i = 0; A && i < A->n; i++) {
        struct gen *G = &A->G[i];
        dsv4_client_close(G->c);
        dsv4_client_close(G->aux);
        dsv4_reply_free(G->reply);
        dsv4_buf_free(&G->content);
        dsv4_buf_free(&G->reasoning);
        json_decref(G->calls);
        json_decref(G->logprobs);
        dsv4_client_result_clear(&G->res);
    }
    free(A);
}

/* The request's choices from G0 (its shared fields set): each with its own seed, reply parser and
 * buffers. NULL with the error answered. */
static struct choices *choices_new(const struct gen *G0, bool tools, bool logprobs)
{
    struct choices *A = calloc(1, sizeof(*A));
    if (!A) {
        oai_respond_error(G0->j, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    A->n = G0->g->n;
    for (int i = 0; i < A->n; i++) {
        struct gen *G = &A->G[i];
        *G = *G0;
        G->all = A;
        G->index = i;
        G->p = G0->g->p;
        if (G->p.has_seed)
            G->p.seed += (uint64_t)i;
        G->calls = json_array();
        G->logprobs = !logprobs ? NULL : G->chat ? json_array() : new_completion_logprobs();
        if (!G->calls || (logprobs && !G->logprobs) ||
            (G->chat && dsv4_reply_new(G->thinking, tools, on_reply, G, &G->reply) < 0)) {
            A->n = i + 1;
            choices_free(A);
            oai_respond_error(G0->j, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
    }
    return A;
}

void oai_run_chat(struct dsv4_oai_job *j)
{
    struct oai_gen_request g = {.logprobs = -1};
    struct gen G = {.j = j, .g = &g, .chat = true};
    struct dsv4_render_opts ro = {0};
    struct dsv4_parts parts = {0};
    struct oai_bad b = {0};
    json_t *tools = NULL;
    const char **ptrs = NULL;
    size_t *lens = NULL;
    struct choices *A = NULL;
    bool lp = false;
    json_int_t top = 0;
    char err[512];
    int rc;

    if (!(g.root = oai_parse_body(j)))
        return;
    dsv4_client_generate_params_init(&g.p);
    const json_t *msgs = json_object_get(g.root, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        oai_bad(&b, "messages", "messages must be a non-empty array of messages");
        goto bad_request;
    }
    if (json_array_size(msgs) > DSV4_OAI_MAX_MESSAGES) {
        oai_bad(&b, "messages", "%zu messages, at most %u", json_array_size(msgs), DSV4_OAI_MAX_MESSAGES);
        goto bad_request;
    }
    if (oai_parse_common(&g, 0, &b) || oai_parse_thinking(g.root, &ro, &b) || oai_parse_tools(g.root, &tools, &b) ||
        oai_opt_bool(g.root, "logprobs", &lp, &b) ||
        oai_opt_int(g.root, "top_logprobs", 0, DSV4_CLIENT_MAX_LOGPROBS, &top, NULL, &b))
        goto bad_request;
    const json_t *rf = json_object_get(g.root, "response_format");
    if (rf && !json_is_null(rf)) {
        const json_t *type = json_object_get(rf, "type");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0) {
            oai_bad(&b, "response_format", "response_format: only {\"type\": \"text\"} is supported");
            goto bad_request;
        }
    }
    if (json_object_get(g.root, "top_logprobs") && !json_is_null(json_object_get(g.root, "top_logprobs")) && !lp) {
        oai_bad(&b, "top_logprobs", "top_logprobs needs logprobs: true");
        goto bad_request;
    }
    g.p.logprobs = lp ? (int)top : -1;
    rc = dsv4_render_chat(msgs, tools, &ro, &parts, err, sizeof(err));
    if (rc == -EINVAL) {
        oai_bad(&b, "messages", "%s", err);
        goto bad_request;
    }
    if (rc < 0 || dsv4_parts_export(&parts, &ptrs, &lens) < 0) {
        oai_respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    g.p.prompt_parts = ptrs;
    g.p.prompt_part_lens = lens;
    g.p.n_prompt_parts = parts.n;
    g.p.add_bos = false;   /* the parts begin with it */

    G.thinking = ro.thinking;
    G.created = (json_int_t)time(NULL);
    random_id(G.id, sizeof(G.id), "chatcmpl-");
    if ((A = choices_new(&G, tools != NULL, lp)))
        generate(A);
    goto out;
bad_request:
    oai_respond_bad(j, &b);
out:
    choices_free(A);
    free(ptrs);
    free(lens);
    dsv4_parts_free(&parts);
    json_decref(tools);
    json_decref(g.root);
}

void oai_run_completions(struct dsv4_oai_job *j)
{
    struct oai_gen_request g = {.logprobs = -1};
    struct gen G = {.j = j, .g = &g};
    struct oai_bad b = {0};
    struct choices *A = NULL;
    int32_t *ids = NULL;
    json_int_t lp = -1;
    bool echo = false;

    if (!(g.root = oai_parse_body(j)))
        return;
    dsv4_client_generate_params_init(&g.p);
    /* OpenAI's default for this endpoint is 16 tokens. */
    if (oai_parse_common(&g, 16, &b) || oai_opt_int(g.root, "logprobs", 0, DSV4_CLIENT_MAX_LOGPROBS, &lp, NULL, &b) ||
        oai_opt_bool(g.root, "echo", &echo, &b))
        goto bad_request;
    if (echo) {
        oai_bad(&b, "echo", "echo is not supported");
        goto bad_request;
    }
    const json_t *suffix = json_object_get(g.root, "suffix");
    if (suffix && !json_is_null(suffix)) {
        oai_bad(&b, "suffix", "suffix is not supported");
        goto bad_request;
    }
    const json_t *prompt = json_object_get(g.root, "prompt");
    /* A batch of one is the same as its element. */
    if (json_is_array(prompt) && json_array_size(prompt) == 1 &&
        (json_is_string(json_array_get(prompt, 0)) || json_is_array(json_array_get(prompt, 0))))
        prompt = json_array_get(prompt, 0);
    if (json_is_string(prompt)) {
        if (!json_string_length(prompt)) {
            oai_bad(&b, "prompt", "prompt is empty");
            goto bad_request;
        }
        g.p.prompt = json_string_value(prompt);
        g.p.add_bos = true;
    } else if (json_is_array(prompt) && json_array_size(prompt) > 0) {
        size_t i, n = json_array_size(prompt);
        const json_t *v;
        ids = malloc(n * sizeof(*ids));
        if (!ids) {
            oai_respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
            goto out;
        }
        json_array_foreach(prompt, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
                oai_bad(&b, "prompt", "prompt must be a string or an array of token ids (a batch of several prompts is "
                    "not supported; n asks for several choices)");
                goto bad_request;
            }
            ids[i] = (int32_t)json_integer_value(v);
        }
        g.p.tokens = ids;
        g.p.n_tokens = n;
    } else {
        oai_bad(&b, "prompt", "prompt must be a non-empty string or array of token ids");
        goto bad_request;
    }
    g.p.logprobs = (int)lp;
    G.created = (json_int_t)time(NULL);
    random_id(G.id, sizeof(G.id), "cmpl-");
    if ((A = choices_new(&G, false, lp >= 0 && !g.stream)))
        generate(A);
    goto out;
bad_request:
    oai_respond_bad(j, &b);
out:
    choices_free(A);
    free(ids);
    json_decref(g.root);
}
