/* SPDX-License-Identifier: MIT */
/* Chat and completions (openai/job_internal.h): the request rendered, generated through dsv4d, and
 * answered whole or streamed in OpenAI's chunks (content, reasoning, tool calls, logprobs, usage). */
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

struct gen {
    struct dsv4_oai_job *j;
    struct oai_gen_request *g;
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
    oai_stream_json(G->j, o);
    G->content.len = G->reasoning.len = 0;
    json_array_clear(G->calls);
}

static int on_token(const struct dsv4_client_token *tok, void *user)
{
    struct gen *G = user;
    struct dsv4_oai_job *j = G->j;
    pthread_mutex_lock(&j->lock);
    bool alive = oai_client_alive(j);
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
                oai_respond_client_error(j, c, rc, "generating");
            else
                oai_respond_error(j, 500, "server_error", NULL, NULL,
                              res.error_message ? res.error_message : "generation failed");
        } else {
            char *e = dsv4_oai_error_json("server_error", NULL, NULL, "%s",
                                          res.error_message ? res.error_message
                                          : rc < 0 ? dsv4_client_error_message(c) : "generation failed");
            if (e)
                oai_stream_event(j, e);
            free(e);
            oai_stream_event(j, "[DONE]");
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
            oai_stream_json(j, o);
        }
        oai_stream_event(j, "[DONE]");
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
        oai_respond_json(j, 200, o);
    }
    dsv4_client_result_clear(&res);
}

/* Connect to dsv4d (*c, closed by the caller), and a second time for the text of logprob
 * alternatives when aux, then generate; a failure is answered. */
static void connect_and_generate(struct gen *G, bool aux, struct dsv4_client **c)
{
    struct dsv4_oai_job *j = G->j;

    if (oai_connect_dsv4d(j, j->srv->cfg->dsv4d_timeout_ms, c) < 0)
        return;
    if (aux && oai_connect_dsv4d(j, j->srv->cfg->dsv4d_timeout_ms, &G->aux) < 0)
        return;
    oai_model_name(j, *c, G->model, sizeof(G->model));
    generate(G, *c);
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
    struct dsv4_client *c = NULL;
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
    G.calls = json_array();
    if (lp)
        G.logprobs = json_array();
    if (dsv4_reply_new(ro.thinking, tools != NULL, on_reply, &G, &G.reply) < 0 || !G.calls) {
        oai_respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    connect_and_generate(&G, lp, &c);
    goto out;
bad_request:
    oai_respond_bad(j, &b);
out:
    dsv4_client_close(c);
    gen_clear(&G);
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
    struct dsv4_client *c = NULL;
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
                    "not supported: n is 1)");
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
    if (lp >= 0 && !g.stream && !(G.logprobs = new_completion_logprobs())) {
        oai_respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        goto out;
    }
    connect_and_generate(&G, lp >= 0, &c);
    goto out;
bad_request:
    oai_respond_bad(j, &b);
out:
    dsv4_client_close(c);
    gen_clear(&G);
    free(ids);
    json_decref(g.root);
}
