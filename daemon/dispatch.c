/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/clock.h"
#include "daemon/dispatch.h"
#include "daemon/log.h"
#include "daemon/reqmem.h"
#include "engine/error.h"
#include "engine/serve/sampler.h"
#include "engine/serve/scheduler.h"

/* The stats reply copies the scheduler's histogram: same bucket layout (1, 2, 3-4, ..., open last). */
_Static_assert(DSV4_SCHED_BATCH_BUCKETS <= DSV4_PROTO_MAX_BATCH_BUCKETS, "batch_size_hist has too few buckets");
_Static_assert(DSV4_SPEC_TOKENS_MAX + 1 <= DSV4_PROTO_MAX_SPEC_BUCKETS, "spec_accept_hist has too few buckets");
_Static_assert(DSV4_SCHED_LATENCY_BOUNDS <= DSV4_PROTO_MAX_LATENCY_BOUNDS, "latency_bounds_s has too few entries");
/* A token event's alternatives are copied into the protocol's fixed arrays. */
_Static_assert(DSV4_SAMPLER_LOGPROBS_MAX <= DSV4_PROTO_MAX_LOGPROBS, "top_logprobs has too few entries");

#define DSV4_WARMUP_PROMPT "Hello"

/* ---- request bookkeeping ------------------------------------------------------------------------ */

static struct dsv4_request *request_new(struct dsv4_dispatch *d, struct dsv4_conn *c, uint32_t msgid)
{
    struct dsv4_request *req = dsv4_reqmem_calloc(1, sizeof(*req));
    if (!req)
        return NULL;
    req->msgid = msgid;
    req->accepted_ns = dsv4_now_ns();
    req->all_next = d->requests;
    if (d->requests)
        d->requests->all_prev = req;
    d->requests = req;
    d->n_requests++;
    if (c) {
        req->conn = c;
        req->conn_next = c->requests;
        if (c->requests)
            c->requests->conn_prev = req;
        c->requests = req;
        c->n_requests++;
    }
    return req;
}

static void request_detach_conn(struct dsv4_request *req)
{
    struct dsv4_conn *c = req->conn;
    if (!c)
        return;
    if (req->conn_prev)
        req->conn_prev->conn_next = req->conn_next;
    else
        c->requests = req->conn_next;
    if (req->conn_next)
        req->conn_next->conn_prev = req->conn_prev;
    req->conn_prev = req->conn_next = NULL;
    req->conn = NULL;
    if (--c->n_requests == 0) {
        c->idle_since_ns = dsv4_now_ns();   /* max_idle_per_uid counts from here */
        dsv4_conn_requests_ended(c);
    }
}

static void pending_remove(struct dsv4_dispatch *d, struct dsv4_request *req)
{
    struct dsv4_request **pp = &d->pending_head, *prev = NULL;
    while (*pp && *pp != req) {
        prev = *pp;
        pp = &(*pp)->pending_next;
    }
    if (!*pp)
        return;
    *pp = req->pending_next;
    if (d->pending_tail == req)
        d->pending_tail = prev;
    req->pending_next = NULL;
    req->pending = false;
    d->n_pending--;
}

static void request_free(struct dsv4_dispatch *d, struct dsv4_request *req)
{
    request_detach_conn(req);
    if (req->pending)
        pending_remove(d, req);
    if (req->all_prev)
        req->all_prev->all_next = req->all_next;
    else
        d->requests = req->all_next;
    if (req->all_next)
        req->all_next->all_prev = req->all_prev;
    d->n_requests--;
    dsv4_proto_generate_clear(&req->gen);
    dsv4_tok_ids_free(&req->prompt);
    dsv4_reqmem_free(req->logprobs);
    dsv4_reqmem_free(req);
}

void dsv4_dispatch_conn_gone(struct dsv4_dispatch *d, struct dsv4_conn *c)
{
    while (c->requests) {
        struct dsv4_request *req = c->requests;
        request_detach_conn(req);
        if (req->tokenizing)
            continue;   /* the worker has it: freed when its job comes back */
        if (req->submitted) {
            /* The slot is freed at the next step; the FINISH event frees the request. */
            dsv4_sched_cancel(d->sched, req->sched_id);
        } else {
            d->counters.requests_cancelled++;
            request_free(d, req);
        }
    }
}

void dsv4_dispatch_free_all(struct dsv4_dispatch *d)
{
    while (d->requests)
        request_free(d, d->requests);
}

/* ---- building prompts --------------------------------------------------------------------------- */

static struct dsv4_proto_model_limits model_limits(const struct dsv4_dispatch *d)
{
    struct dsv4_proto_model_limits lim = {
        .vocab_size = d->vocab_size,
        .max_context = (uint32_t)d->cfg->max_context,
        .max_prompt_tokens = (uint32_t)dsv4_settings_prompt_limit(d->cfg),
        /* A slot never holds more: an explicit max_tokens above it is max_tokens_limit (405), an absent
         * one means the protocol's default capped by it. */
        .max_tokens = (uint32_t)d->cfg->max_context,
    };
    return lim;
}

static int encode_error(int r, struct dsv4_proto_error *err)
{
    if (r == -EILSEQ)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_INVALID_UTF8, "%s", dsv4_error_message());
    if (r == -ENOMEM)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "prompt: out of memory");
    if (r < 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s", dsv4_error_message());
    return 0;
}

/* The ids generate and tokenize see: raw text (BOS unless add_bos is false; tags in the text are
 * recognised, the caller owns the whole prompt) or chat messages (their text can never become a
 * tag: a user cannot forge <｜Assistant｜>). */
static int build_prompt(struct dsv4_dispatch *d, enum dsv4_proto_prompt_kind kind, const char *text, size_t text_len,
                        bool add_bos, const struct dsv4_proto_chat_message *messages, uint32_t n_messages,
                        bool thinking, struct dsv4_tok_ids *ids, struct dsv4_proto_error *err)
{
    int r;

    if (kind == DSV4_PROTO_PROMPT_TEXT) {
        if (add_bos && d->bos_id >= 0 && dsv4_tok_ids_push(ids, d->bos_id) < 0)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "prompt: out of memory");
        r = dsv4_tokenizer_encode(d->tok, text, text_len, 0, ids);
    } else if (kind == DSV4_PROTO_PROMPT_MESSAGES) {
        struct dsv4_chat_message *msgs;
        struct dsv4_chat_options opts = {
            .mode = thinking ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT,
            .content_flags = DSV4_TOK_ENCODE_ADDED_AS_TEXT,
        };
        if (!d->has_chat)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE,
                                        "messages: this model's tokenizer has no chat tags; send prompt or tokens");
        msgs = dsv4_reqmem_calloc(n_messages ? n_messages : 1, sizeof(*msgs));
        if (!msgs)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "messages: out of memory");
        for (uint32_t i = 0; i < n_messages; i++) {
            msgs[i].role = messages[i].role == DSV4_PROTO_ROLE_SYSTEM ? DSV4_CHAT_ROLE_SYSTEM
                         : messages[i].role == DSV4_PROTO_ROLE_USER ? DSV4_CHAT_ROLE_USER : DSV4_CHAT_ROLE_ASSISTANT;
            msgs[i].content = messages[i].content;
            msgs[i].content_len = messages[i].content_len;
        }
        r = dsv4_chat_build_ids(d->tok, msgs, n_messages, &opts, ids);
        dsv4_reqmem_free(msgs);
    } else {
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "no prompt, messages or tokens");
    }
    return encode_error(r, err);
}

/* prompt_parts: the caller's own template with literal text between (a front rendering a chat format
 * the daemon does not know); tags are recognised only in the template parts. */
static int build_parts(struct dsv4_dispatch *d, const struct dsv4_proto_generate *gen, struct dsv4_tok_ids *ids,
                       struct dsv4_proto_error *err)
{
    if (gen->add_bos && d->bos_id >= 0 && dsv4_tok_ids_push(ids, d->bos_id) < 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "prompt: out of memory");
    return encode_error(dsv4_tokenizer_encode_parts(d->tok, (const char *const *)gen->parts, gen->part_lens,
                                                    gen->n_parts, 0, ids), err);
}

/* A generate request's text prompt, whichever of the three forms it takes, as ids. */
static int build_generate_prompt(struct dsv4_dispatch *d, const struct dsv4_proto_generate *g, struct dsv4_tok_ids *ids,
                                 struct dsv4_proto_error *err)
{
    if (g->prompt_kind == DSV4_PROTO_PROMPT_PARTS)
        return build_parts(d, g, ids, err);
    return build_prompt(d, g->prompt_kind, g->prompt, g->prompt_len, g->add_bos, g->messages, g->n_messages,
                        g->thinking, ids, err);
}

/* ---- responses ---------------------------------------------------------------------------------- */

static void reply_error(struct dsv4_conn *c, uint32_t msgid, const struct dsv4_proto_error *err)
{
    dsv4_log_debug("connection %llu: msgid %u: error %d (%s): %s", (unsigned long long)c->id, msgid, err->code,
                   dsv4_proto_code_name(err->code), err->message);
    dsv4_conn_send_error(c, msgid, err->code, err->message[0] ? err->message : NULL);
}

static void reply_encoded(struct dsv4_conn *c, int r)
{
    if (r < 0) {
        dsv4_conn_close(c, "out of memory encoding a response");
        return;
    }
    dsv4_conn_flush(c);
}

/* A result whose size the request decides (a text, token ids, logprobs), encoded into c->out from
 * start on. One the client could not take is taken back and the request answered reply_too_large
 * (doc/PROTOCOL.md section 1): a payload above what libdsv4client accepts, or a frame above
 * max_output_buffer, past which the connection would be dropped as one whose client does not read
 * although it does. -EMSGSIZE is the encoder's own refusal (above the 4 GiB a length prefix holds). */
static void reply_result(struct dsv4_dispatch *d, struct dsv4_conn *c, uint32_t msgid, const char *method,
                         size_t start, int r)
{
    struct dsv4_proto_error err = { 0 };
    size_t frame = r == 0 ? c->out.len - start : 0;

    if (r == -EMSGSIZE)
        dsv4_proto_error_set(&err, DSV4_PROTO_E_REPLY_TOO_LARGE, "%s: the reply is above the 4 GiB a frame "
                             "can hold", method);
    else if (frame > DSV4_PROTO_FRAME_HEADER + DSV4_PROTO_CLIENT_MAX_FRAME)
        dsv4_proto_error_set(&err, DSV4_PROTO_E_REPLY_TOO_LARGE, "%s: the reply of %zu bytes is above the "
                             "largest frame a client accepts (%u bytes)", method, frame - DSV4_PROTO_FRAME_HEADER,
                             DSV4_PROTO_CLIENT_MAX_FRAME);
    else if (frame > d->cfg->max_output_buffer)
        dsv4_proto_error_set(&err, DSV4_PROTO_E_REPLY_TOO_LARGE, "%s: the reply of %zu bytes is above "
                             "max_output_buffer (%llu bytes)", method, frame,
                             (unsigned long long)d->cfg->max_output_buffer);
    if (!err.code) {
        reply_encoded(c, r);
        return;
    }
    /* Its storage goes too when nothing else is queued: a refused reply does not hold memory. */
    if (start == 0)
        dsv4_proto_buf_clear(&c->out);
    else
        c->out.len = start;
    reply_error(c, msgid, &err);
}

static enum dsv4_proto_finish proto_finish(enum dsv4_finish_reason f)
{
    switch (f) {
    case DSV4_FINISH_STOP: return DSV4_PROTO_FINISH_STOP;
    case DSV4_FINISH_LENGTH:
    case DSV4_FINISH_CONTEXT: return DSV4_PROTO_FINISH_LENGTH;
    case DSV4_FINISH_CANCELLED: return DSV4_PROTO_FINISH_CANCELLED;
    default: return DSV4_PROTO_FINISH_ERROR;
    }
}

/* End a request that never reached the engine (cancelled while held during boot) with an empty
 * result. The request is freed before the answer is written: a failed write closes the connection,
 * and closing frees whatever requests are still linked to it. */
static void finish_unsubmitted(struct dsv4_dispatch *d, struct dsv4_request *req, enum dsv4_proto_finish finish)
{
    struct dsv4_proto_generate_result res = { .text = (char *)"", .finish_reason = finish };
    struct dsv4_conn *c = req->conn;
    uint32_t msgid = req->msgid;

    res.timings.total_ms = (double)(dsv4_now_ns() - req->accepted_ns) / 1e6;
    res.timings.queue_ms = res.timings.total_ms;
    request_free(d, req);
    if (c)
        reply_encoded(c, dsv4_proto_encode_generate_result(&c->out, msgid, &res));
}

/* Refuse a request that is not submitted: freed first, for the same reason. */
static void refuse_request(struct dsv4_dispatch *d, struct dsv4_request *req, const struct dsv4_proto_error *err)
{
    struct dsv4_conn *c = req->conn;
    uint32_t msgid = req->msgid;

    request_free(d, req);
    if (c)
        reply_error(c, msgid, err);
}

void dsv4_dispatch_refuse_pending(struct dsv4_dispatch *d, int code, const char *message)
{
    while (d->pending_head) {
        struct dsv4_request *req = d->pending_head;
        struct dsv4_proto_error err = { .code = code };
        snprintf(err.message, sizeof(err.message), "%s", message);
        refuse_request(d, req, &err);
    }
}

/* ---- methods ------------------------------------------------------------------------------------ */

static void do_hello(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_hello req = { 0 };
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_hello_result res = { 0 };
    char server[64];
    uint32_t version;

    if (dsv4_proto_decode_hello(msg, &req, &err) < 0 || dsv4_proto_hello_negotiate(&req, &version, &err) < 0) {
        reply_error(c, msg->msgid, &err);
        dsv4_proto_hello_clear(&req);
        return;
    }
    if (req.client)
        dsv4_log_info("connection %llu: client '%s', protocol %u", (unsigned long long)c->id, req.client, version);
    snprintf(server, sizeof(server), "dsv4d %s", PACKAGE_VERSION);
    res.protocol = version;
    res.server = server;
    res.model.name = (char *)d->model->model_name;
    res.model.vocab_size = (uint32_t)d->model->vocab_size;
    res.model.hidden_size = (uint32_t)d->model->dim;
    res.model.num_layers = (uint32_t)d->model->n_layers;
    res.model.num_heads = (uint32_t)d->model->n_heads;
    res.model.head_dim = (uint32_t)d->model->head_dim;
    res.model.n_routed_experts = (uint32_t)d->model->n_experts;
    res.model.experts_per_token = (uint32_t)d->model->n_experts_per_tok;
    res.model.bos_id = d->bos_id;
    res.model.eos_id = d->model->eos_id;     /* the id the engine stops on */
    res.max_context = (uint32_t)d->cfg->max_context;
    res.max_batch = (uint32_t)d->cfg->max_batch;
    /* Before boot has picked one, the configured choice ("auto"). */
    res.backend = (char *)(d->sched ? dsv4_host_backend_name(d->host) : dsv4_settings_backend_name(d->cfg->backend));
    res.limits.max_frame = (uint32_t)d->cfg->max_frame;
    res.limits.max_prompt_tokens = (uint32_t)dsv4_settings_prompt_limit(d->cfg);
    res.limits.max_tokens = (uint32_t)d->cfg->max_context;
    res.limits.max_connections = (uint32_t)d->cfg->max_connections;
    res.limits.max_queue = (uint32_t)d->cfg->max_queued;
    res.limits.max_requests_per_connection = (uint32_t)d->cfg->max_requests_per_conn;
    reply_encoded(c, dsv4_proto_encode_hello_result(&c->out, msg->msgid, &res));
    dsv4_proto_hello_clear(&req);
}

static int submit(struct dsv4_dispatch *d, struct dsv4_request *req, struct dsv4_proto_error *err)
{
    const struct dsv4_proto_sampling *ps = &req->gen.sampling;
    struct dsv4_proto_model_limits lim = model_limits(d);
    uint32_t max_tokens = dsv4_proto_effective_max_tokens(ps, &lim);
    int max_out = dsv4_host_max_output_tokens(d->host);
    struct dsv4_sched_request sr = {
        .prompt = req->prompt.ids,
        .n_prompt = (int)req->prompt.len,
        .max_tokens = max_tokens < (uint32_t)max_out ? (int)max_tokens : max_out,
        .stop = (const char *const *)ps->stop,
        .n_stop = (int)ps->n_stop,
        .stop_token_ids = ps->stop_token_ids,
        .n_stop_token_ids = (int)ps->n_stop_token_ids,
        .user = req,
    };
    int r;

    dsv4_sampling_defaults(&sr.sampling);
    sr.sampling.temperature = ps->temperature;
    sr.sampling.top_k = ps->top_k;
    sr.sampling.top_p = ps->top_p;
    sr.sampling.min_p = ps->min_p;
    sr.sampling.repetition_penalty = ps->repetition_penalty;
    sr.sampling.presence_penalty = ps->presence_penalty;
    sr.sampling.frequency_penalty = ps->frequency_penalty;
    sr.sampling.has_seed = ps->has_seed;
    sr.sampling.seed = ps->seed;
    sr.sampling.logprobs = ps->logprobs > 0 ? ps->logprobs : 0;

    /* The scheduler checks the request, sampling parameters included; its errors become codes here. */
    r = dsv4_sched_submit(d->sched, &sr, &req->sched_id);
    switch (r) {
    case 0:
        req->submitted = true;
        return 0;
    case -ESHUTDOWN:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_DRAINING, "the server is shutting down");
    case -ENOTRECOVERABLE:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_INTERNAL, "%s; dsv4d is exiting to be restarted",
                                    dsv4_error_message());
    case -EAGAIN:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_QUEUE_FULL, "%s", dsv4_error_message());
    case -E2BIG:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_PROMPT_TOO_LONG, "%s", dsv4_error_message());
    case -EDOM:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_SAMPLING, "%s", dsv4_error_message());
    case -EINVAL:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s", dsv4_error_message());
    default:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_INTERNAL, "%s", dsv4_error_message());
    }
}

static bool duplicate_msgid(const struct dsv4_conn *c, uint32_t msgid)
{
    for (const struct dsv4_request *r = c->requests; r; r = r->conn_next)
        if (r->msgid == msgid)
            return true;
    return false;
}

static int queued_now(struct dsv4_dispatch *d)
{
    struct dsv4_sched_stats st;
    if (!d->sched)
        return d->n_pending;
    dsv4_sched_get_stats(d->sched, &st);
    return d->n_pending + st.queued;
}

/* max_queued, checked when a request arrives and again when its prompt, tokenized on the worker
 * meanwhile, is ready to queue: others may have filled the queue in between. */
static int check_queue(struct dsv4_dispatch *d, struct dsv4_proto_error *err)
{
    const int queued = queued_now(d);
    if (queued >= d->cfg->max_queued)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_QUEUE_FULL, "%d requests are waiting for a slot "
                                    "(max_queued = %d)", queued, d->cfg->max_queued);
    return 0;
}

/* A request that stays in flight (a generate, a tokenize on the prompt worker) holds its msgid and
 * one of the connection's max_requests_per_conn places until it is answered. */
static int admit_in_flight(struct dsv4_dispatch *d, const struct dsv4_conn *c, uint32_t msgid,
                           struct dsv4_proto_error *err)
{
    if (duplicate_msgid(c, msgid))
        return dsv4_proto_error_set(err, DSV4_PROTO_E_DUPLICATE_MSGID, "msgid %u is already in flight on this "
                                    "connection", msgid);
    if (c->n_requests >= d->cfg->max_requests_per_conn)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_REQUESTS, "%d requests in flight on this connection "
                                    "(max_requests_per_conn = %d)", c->n_requests, d->cfg->max_requests_per_conn);
    return 0;
}

/* The checks that need no tokenizing, in the order a client can act on them. */
static int admit_generate(struct dsv4_dispatch *d, struct dsv4_conn *c, uint32_t msgid,
                          const struct dsv4_proto_generate *gen, struct dsv4_proto_error *err)
{
    struct dsv4_proto_model_limits lim = model_limits(d);
    const struct dsv4_proto_sampling *ps = &gen->sampling;

    if (*d->state == DSV4_SERVER_FAILED)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_INTERNAL, "%s; dsv4d is exiting to be restarted", d->reason);
    if (*d->state == DSV4_SERVER_DRAINING || *d->state == DSV4_SERVER_EXITING)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_DRAINING, "the server is shutting down; retry later");
    int r = admit_in_flight(d, c, msgid, err);
    if (r < 0)
        return r;
    r = check_queue(d, err);
    if (r < 0)
        return r;
    if (ps->n_stop > DSV4_SCHED_STOP_STRINGS_MAX)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_STOP, "stop: %u strings, at most %d",
                                    ps->n_stop, DSV4_SCHED_STOP_STRINGS_MAX);
    for (uint32_t i = 0; i < ps->n_stop; i++) {
        size_t len = strlen(ps->stop[i]);
        if (len == 0 || len > DSV4_SCHED_STOP_LEN_MAX)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_STOP, "stop[%u]: %zu bytes, must be 1..%d",
                                        i, len, DSV4_SCHED_STOP_LEN_MAX);
    }
    if (ps->n_stop_token_ids > DSV4_SCHED_STOP_TOKENS_MAX)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_STOP, "stop_token_ids: %u ids, at most %d",
                                    ps->n_stop_token_ids, DSV4_SCHED_STOP_TOKENS_MAX);
    return dsv4_proto_check_generate(gen, &lim, err);
}

/* Bytes of text a prompt holds: what the tokenizer would have to read. */
static size_t prompt_text_bytes(const struct dsv4_proto_generate *gen)
{
    size_t n = gen->prompt_kind == DSV4_PROTO_PROMPT_TEXT ? gen->prompt_len : 0;
    if (gen->prompt_kind == DSV4_PROTO_PROMPT_MESSAGES)
        for (uint32_t i = 0; i < gen->n_messages; i++)
            n += gen->messages[i].content_len;
    if (gen->prompt_kind == DSV4_PROTO_PROMPT_PARTS)
        for (uint32_t i = 0; i < gen->n_parts; i++)
            n += gen->part_lens[i];
    return n;
}

static size_t tokenize_text_bytes(const struct dsv4_proto_tokenize *t)
{
    size_t n = t->prompt_kind == DSV4_PROTO_PROMPT_TEXT ? t->text_len : 0;
    if (t->prompt_kind == DSV4_PROTO_PROMPT_MESSAGES)
        for (uint32_t i = 0; i < t->n_messages; i++)
            n += t->messages[i].content_len;
    return n;
}

/* A token covers at most max_token_bytes of text (the tokenizer has no normalizer), so text longer
 * than max_prompt_tokens of them cannot fit, whatever it says: refused before it is read. */
static int check_prompt_bytes(struct dsv4_dispatch *d, const struct dsv4_proto_generate *gen,
                              struct dsv4_proto_error *err)
{
    struct dsv4_proto_model_limits lim = model_limits(d);
    size_t bytes = prompt_text_bytes(gen), per = d->max_token_bytes;
    if (per == 0 || bytes / per < lim.max_prompt_tokens)
        return 0;
    size_t at_least = (bytes + per - 1) / per;
    if (at_least <= lim.max_prompt_tokens)
        return 0;
    return dsv4_proto_error_set(err, DSV4_PROTO_E_PROMPT_TOO_LONG, "prompt: %zu bytes of text are at least %zu "
                                "tokens (no token spans more than %zu bytes), above max_prompt_tokens %u", bytes,
                                at_least, per, lim.max_prompt_tokens);
}

/* The prompt's ids are built: check them and hand the request to the engine (or hold it for READY). */
static void generate_prompt_ready(struct dsv4_dispatch *d, struct dsv4_request *req)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_model_limits lim = model_limits(d);

    if (req->prompt.len == 0) {
        dsv4_proto_error_set(&err, DSV4_PROTO_E_BAD_VALUE, "the prompt is empty (no tokens)");
        goto fail;
    }
    if (dsv4_proto_check_prompt_length((uint32_t)req->prompt.len, &lim, &err) < 0 || check_queue(d, &err) < 0)
        goto fail;

    d->counters.requests_total++;
    d->counters.prompt_tokens_total += req->prompt.len;
    if (*d->state == DSV4_SERVER_LOADING || *d->state == DSV4_SERVER_WARMUP) {
        /* Held until READY: a client that connected through socket activation just waits. */
        req->pending = true;
        if (d->pending_tail)
            d->pending_tail->pending_next = req;
        else
            d->pending_head = req;
        d->pending_tail = req;
        d->n_pending++;
        return;
    }
    if (submit(d, req, &err) < 0)
        goto fail;
    return;

fail:
    d->counters.requests_rejected++;
    refuse_request(d, req, &err);
}

/* On the prompt worker: only the request's own fields and the server's immutable tokenizer state. */
static void build_prompt_job(struct dsv4_prompt_job *job)
{
    struct dsv4_request *req = (struct dsv4_request *)((char *)job - offsetof(struct dsv4_request, job));
    req->job_rc = build_generate_prompt(req->dispatch, &req->gen, &req->prompt, &req->job_err);
}

int dsv4_dispatch_prompts_done(sd_event_source *src, int fd, uint32_t revents, void *userdata)
{
    struct dsv4_dispatch *d = userdata;
    struct dsv4_prompt_job *job;

    while ((job = dsv4_prompt_worker_take_done(d->prompts))) {
        struct dsv4_request *req = (struct dsv4_request *)((char *)job - offsetof(struct dsv4_request, job));
        req->tokenizing = false;
        if (!job->ran)
            continue;   /* the worker stopped first (shutdown): freed with the others */
        if (req->tokenize_only) {
            /* A tokenize request: freed first (a failed write closes the connection, which frees what
             * is linked to it), then answered if its client is still there. */
            struct dsv4_conn *c = req->conn;
            uint32_t msgid = req->msgid;
            int rc = req->job_rc;
            struct dsv4_proto_error job_err = req->job_err;
            struct dsv4_tok_ids ids = req->prompt;
            req->prompt = (struct dsv4_tok_ids){ 0 };
            request_free(d, req);
            struct dsv4_proto_tokens res = { .tokens = ids.ids, .n_tokens = (uint32_t)ids.len };
            if (c && rc < 0) {
                reply_error(c, msgid, &job_err);
            } else if (c) {
                size_t start = c->out.len;
                reply_result(d, c, msgid, "tokenize", start, dsv4_proto_encode_tokenize_result(&c->out, msgid, &res));
            }
            dsv4_tok_ids_free(&ids);
        } else if (!req->conn) {
            /* Cancelled before its prompt was ready: a request, as one cancelled while held for boot
             * is, so that requests_cancelled stays a part of requests_total. */
            d->counters.requests_total++;
            d->counters.requests_cancelled++;
            request_free(d, req);
        } else if (req->cancel_asked) {
            d->counters.requests_total++;
            d->counters.requests_cancelled++;
            finish_unsubmitted(d, req, DSV4_PROTO_FINISH_CANCELLED);
        } else if (req->job_rc < 0) {
            d->counters.requests_rejected++;
            refuse_request(d, req, &req->job_err);
        } else {
            generate_prompt_ready(d, req);
        }
    }
    d->hooks.requests_ended(d->hooks.userdata);
    return 0;
}

static void do_generate(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_request *req;
    struct dsv4_proto_generate gen;

    dsv4_proto_generate_init(&gen);
    if (dsv4_proto_decode_generate(msg, &gen, &err) < 0 || admit_generate(d, c, msg->msgid, &gen, &err) < 0 ||
        check_prompt_bytes(d, &gen, &err) < 0) {
        d->counters.requests_rejected++;
        reply_error(c, msg->msgid, &err);
        dsv4_proto_generate_clear(&gen);
        return;
    }
    req = request_new(d, c, msg->msgid);
    if (!req) {
        dsv4_proto_generate_clear(&gen);
        dsv4_conn_send_error(c, msg->msgid, DSV4_PROTO_E_OUT_OF_MEMORY, NULL);
        return;
    }
    req->gen = gen;
    if (gen.prompt_kind == DSV4_PROTO_PROMPT_TOKENS) {
        for (uint32_t i = 0; i < gen.n_tokens; i++)
            if (dsv4_tok_ids_push(&req->prompt, gen.tokens[i]) < 0) {
                dsv4_proto_error_set(&err, DSV4_PROTO_E_OUT_OF_MEMORY, "tokens: out of memory");
                d->counters.requests_rejected++;
                refuse_request(d, req, &err);
                return;
            }
    } else if (prompt_text_bytes(&gen) > DSV4_PROMPT_INLINE_BYTES) {
        /* Encoding this much would hold every other client up: the worker does it. */
        req->dispatch = d;
        req->tokenizing = true;
        req->job.run = build_prompt_job;
        dsv4_prompt_worker_submit(d->prompts, &req->job);
        return;
    } else if (build_generate_prompt(d, &gen, &req->prompt, &err) < 0) {
        d->counters.requests_rejected++;
        refuse_request(d, req, &err);
        return;
    }
    generate_prompt_ready(d, req);
}

void dsv4_dispatch_submit_pending(struct dsv4_dispatch *d)
{
    while (d->pending_head) {
        struct dsv4_request *req = d->pending_head;
        struct dsv4_proto_error err = { 0 };
        pending_remove(d, req);
        if (submit(d, req, &err) < 0)
            refuse_request(d, req, &err);
    }
}

static void do_cancel(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_cancel req = { 0 };
    struct dsv4_proto_error err = { 0 };
    bool cancelled = false;

    if (dsv4_proto_decode_cancel(msg, &req, &err) < 0) {
        reply_error(c, msg->msgid, &err);
        return;
    }
    for (struct dsv4_request *r = c->requests; r; r = r->conn_next) {
        if (r->msgid != req.msgid || r->tokenize_only)
            continue;
        if (r->submitted) {
            cancelled = dsv4_sched_cancel(d->sched, r->sched_id) == 0;
        } else if (r->tokenizing) {
            /* Answered cancelled when the worker hands it back. */
            r->cancel_asked = true;
            cancelled = true;
        } else {
            /* Still held for boot: it ends here. */
            d->counters.requests_cancelled++;
            finish_unsubmitted(d, r, DSV4_PROTO_FINISH_CANCELLED);
            cancelled = true;
        }
        break;
    }
    if (!c->closed)
        reply_encoded(c, dsv4_proto_encode_cancel_result(&c->out, msg->msgid, cancelled));
}

static void do_tokenize(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_tokenize req;
    struct dsv4_proto_error err = { 0 };
    struct dsv4_tok_ids ids = { 0 };

    dsv4_proto_tokenize_init(&req);
    if (dsv4_proto_decode_tokenize(msg, &req, &err) < 0) {
        reply_error(c, msg->msgid, &err);
    } else if (tokenize_text_bytes(&req) > DSV4_PROMPT_INLINE_BYTES) {
        /* As for generate: a large text is encoded on the prompt worker, answered when it is done. It
         * holds its text meanwhile, so it counts against the connection's requests in flight: a client
         * pipelining large texts faster than the worker encodes them is refused, not buffered. */
        struct dsv4_request *r;
        if (admit_in_flight(d, c, msg->msgid, &err) < 0) {
            reply_error(c, msg->msgid, &err);
        } else if (!(r = request_new(d, c, msg->msgid))) {
            dsv4_conn_send_error(c, msg->msgid, DSV4_PROTO_E_OUT_OF_MEMORY, NULL);
        } else {
            r->tokenize_only = true;
            r->gen.prompt_kind = req.prompt_kind;
            r->gen.prompt = req.text;
            r->gen.prompt_len = req.text_len;
            r->gen.add_bos = req.add_bos;
            r->gen.messages = req.messages;
            r->gen.n_messages = req.n_messages;
            r->gen.thinking = req.thinking;
            req.text = NULL;
            req.messages = NULL;
            req.n_messages = 0;
            r->dispatch = d;
            r->tokenizing = true;
            r->job.run = build_prompt_job;
            dsv4_prompt_worker_submit(d->prompts, &r->job);
        }
    } else if (build_prompt(d, req.prompt_kind, req.text, req.text_len, req.add_bos, req.messages, req.n_messages,
                            req.thinking, &ids, &err) < 0) {
        reply_error(c, msg->msgid, &err);
    } else {
        struct dsv4_proto_tokens res = { .tokens = ids.ids, .n_tokens = (uint32_t)ids.len };
        size_t start = c->out.len;
        reply_result(d, c, msg->msgid, "tokenize", start, dsv4_proto_encode_tokenize_result(&c->out, msg->msgid, &res));
    }
    dsv4_tok_ids_free(&ids);
    dsv4_proto_tokenize_clear(&req);
}

static void do_detokenize(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_tokens req = { 0 };
    struct dsv4_proto_error err = { 0 };
    char *bytes = NULL, *text = NULL;
    size_t len = 0, text_len = 0;

    if (dsv4_proto_decode_detokenize(msg, &req, &err) < 0 ||
        dsv4_proto_check_token_ids(req.tokens, req.n_tokens, d->vocab_size, "tokens", &err) < 0) {
        reply_error(c, msg->msgid, &err);
        goto out;
    }
    /* Ids of the model's vocabulary past the tokenizer's have no text, as when they are generated. */
    uint32_t n = 0;
    for (uint32_t i = 0; i < req.n_tokens; i++)
        if ((size_t)req.tokens[i] < dsv4_tokenizer_vocab_size(d->tok))
            req.tokens[n++] = req.tokens[i];
    if (dsv4_tokenizer_decode(d->tok, req.tokens, n, 0, &bytes, &len) < 0) {
        dsv4_proto_error_set(&err, DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB, "%s", dsv4_error_message());
        reply_error(c, msg->msgid, &err);
        goto out;
    }
    text = dsv4_utf8_lossy(bytes, len, &text_len);
    if (!text) {
        dsv4_conn_send_error(c, msg->msgid, DSV4_PROTO_E_OUT_OF_MEMORY, NULL);
        goto out;
    }
    size_t start = c->out.len;
    reply_result(d, c, msg->msgid, "detokenize", start,
                 dsv4_proto_encode_detokenize_result(&c->out, msg->msgid, text, text_len));
out:
    free(bytes);
    free(text);
    dsv4_proto_tokens_clear(&req);
}

/* One of the scheduler's latency histograms into the stats reply (same buckets), less the warm-up's
 * observations (base). */
static void stats_latency(const struct dsv4_sched_latency *h, const struct dsv4_sched_latency *base,
                          struct dsv4_proto_latency *ret, uint64_t *ret_count, double *ret_sum_s)
{
    ret->n = DSV4_SCHED_LATENCY_BOUNDS + 1;
    for (uint32_t i = 0; i < ret->n; i++)
        ret->buckets[i] = h->buckets[i] - base->buckets[i];
    *ret_count = h->count - base->count;
    *ret_sum_s = h->sum_s - base->sum_s;
}

static void do_stats(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_stats st = { 0 };
    struct dsv4_reqmem_stats mem;

    if (dsv4_proto_decode_empty_params(msg, &err) < 0) {
        reply_error(c, msg->msgid, &err);
        return;
    }
    dsv4_reqmem_get_stats(&mem);
    st.uptime_s = (double)(dsv4_now_ns() - d->start_ns) / 1e9;
    st.backend = (char *)(d->sched ? dsv4_host_backend_name(d->host) : dsv4_settings_backend_name(d->cfg->backend));
    st.slots_total = (uint32_t)d->cfg->max_batch;
    st.queue_depth = (uint32_t)d->n_pending;
    st.connections = (uint32_t)d->conns->n;
    st.requests_total = d->counters.requests_total;
    st.requests_failed = d->counters.requests_failed;
    st.requests_cancelled = d->counters.requests_cancelled;
    st.prompt_tokens_total = d->counters.prompt_tokens_total;
    st.generated_tokens_total = d->counters.generated_tokens_total;
    st.heap_allocated = mem.allocated;
    st.heap_active = mem.active;
    st.heap_resident = mem.resident;
    st.heap_mapped = mem.mapped;
    if (d->sched) {
        struct dsv4_sched_stats ss;
        dsv4_sched_get_stats(d->sched, &ss);
        st.slots_busy = (uint32_t)ss.slots_in_use;
        st.queue_depth += (uint32_t)ss.queued;
        st.prefill_tokens_per_s = ss.busy_s > 0 ? (double)ss.prefill_tokens / ss.busy_s : 0;
        st.prefill_tokens_total = ss.prefill_tokens;
        st.prefill_chunks_total = ss.prefill_chunks;
        st.decode_tokens_per_s = ss.tokens_per_s;
        st.device_arena_bytes = ss.backend.bytes_reserved;
        st.device_arena_used = ss.backend.bytes_reserved;
        st.device_allocs_after_boot = ss.backend.device_allocs - d->boot_device_allocs;
        st.graph_captures_after_boot = ss.backend.graph_captures - d->boot_graph_captures;
        st.eager_steps = ss.backend.eager_steps;
        st.steps = ss.steps;
        st.decode_steps = ss.decode_steps;
        st.n_batch_hist = DSV4_SCHED_BATCH_BUCKETS;
        for (uint32_t i = 0; i < DSV4_SCHED_BATCH_BUCKETS; i++)
            st.batch_hist[i] = ss.batch_hist[i];
        st.spec_tokens = (uint32_t)ss.spec_tokens;
        st.spec_verifies = ss.spec_steps;
        st.spec_drafted = ss.spec_drafted;
        st.spec_accepted = ss.spec_accepted;
        st.n_spec_hist = ss.spec_tokens > 0 ? (uint32_t)ss.spec_tokens + 1 : 0;
        for (uint32_t i = 0; i < st.n_spec_hist; i++)
            st.spec_hist[i] = ss.spec_accept_hist[i];
        st.engine_busy_s = ss.busy_s;
        st.engine_backend_s = ss.backend_s;
        st.engine_gap_s = ss.gap_s;
        st.n_latency_bounds = DSV4_SCHED_LATENCY_BOUNDS;
        for (uint32_t i = 0; i < DSV4_SCHED_LATENCY_BOUNDS; i++)
            st.latency_bounds_s[i] = dsv4_sched_latency_bounds_s[i];
        stats_latency(&ss.queue, &d->warmup_latency.queue, &st.queue_hist, &st.queue_count, &st.queue_sum_s);
        stats_latency(&ss.ttft, &d->warmup_latency.ttft, &st.ttft_hist, &st.ttft_count, &st.ttft_sum_s);
        stats_latency(&ss.tpot, &d->warmup_latency.tpot, &st.tpot_hist, &st.tpot_count, &st.tpot_sum_s);
        stats_latency(&ss.e2e, &d->warmup_latency.e2e, &st.e2e_hist, &st.e2e_count, &st.e2e_sum_s);
        st.sched_allocations = ss.allocations;
        st.sched_allocations_after_boot = ss.allocations - d->boot_sched_allocations;
        if (ss.prefix_cache) {
            const struct dsv4_prefix_stats *ps = &ss.prefix;
            st.prefix_cache_bytes = (uint64_t)(ps->pages_total * ps->page_bytes);
            st.prefix_cache_used_bytes = (uint64_t)(ps->pages_used * ps->page_bytes);
            st.prefix_cache_tokens = (uint64_t)ps->nodes * (uint64_t)ps->block;
            st.prefix_cache_snapshots = (uint64_t)ps->boundaries;
            st.prefix_cache_lookups = ps->lookups;
            st.prefix_cache_hits = ps->hits;
            st.prefix_cache_hit_tokens = ps->hit_tokens;
            st.prefix_cache_evictions = ps->boundaries_evicted;
        }
        if (ss.backend.variant[0])
            st.kernels[st.n_kernels++] = ss.backend.variant;
        /* where the routed experts live: a total line, then DSV4_PLACEMENT_LINE_LAYERS layers a line */
        char experts[1 + DSV4_MAX_LAYERS / DSV4_PLACEMENT_LINE_LAYERS][160];
        if (ss.backend.experts_host > 0 || ss.backend.embed_bytes_host > 0) {
            snprintf(experts[0], sizeof(experts[0]), "routed experts: %u on the GPU (%.2f GiB), %u in pinned host "
                     "memory (%.2f GiB, and the embedding's %.2f GiB), read in place over PCIe", ss.backend.experts_gpu,
                     ss.backend.expert_bytes_gpu / 1073741824.0, ss.backend.experts_host,
                     ss.backend.expert_bytes_host / 1073741824.0, ss.backend.embed_bytes_host / 1073741824.0);
            st.kernels[st.n_kernels++] = experts[0];
            for (int l0 = 0, i = 1; ss.backend.experts_host > 0 && l0 < ss.backend.expert_layers;
                 l0 += DSV4_PLACEMENT_LINE_LAYERS, i++) {
                const int n = ss.backend.expert_layers - l0 < DSV4_PLACEMENT_LINE_LAYERS
                                  ? ss.backend.expert_layers - l0 : DSV4_PLACEMENT_LINE_LAYERS;
                int w = snprintf(experts[i], sizeof(experts[i]), "routed experts gpu/host by layer:");
                dsv4_placement_layers_text(ss.backend.experts_gpu_by_layer, ss.backend.experts_host_by_layer, l0, n,
                                           experts[i] + w, sizeof(experts[i]) - (size_t)w);
                st.kernels[st.n_kernels++] = experts[i];
            }
        }
        char fetch[160];
        if (ss.backend.expert_fetch) {
            snprintf(fetch, sizeof(fetch), "host experts fetched ahead: %.3f GiB copied into device slots, %.3f GiB "
                     "of them read there", ss.backend.expert_fetch_copied / 1073741824.0,
                     ss.backend.expert_fetch_used / 1073741824.0);
            st.kernels[st.n_kernels++] = fetch;
        }
        /* ss lives until the reply is encoded: kernels[0] points into it. */
        reply_encoded(c, dsv4_proto_encode_stats_result(&c->out, msg->msgid, &st));
        return;
    }
    reply_encoded(c, dsv4_proto_encode_stats_result(&c->out, msg->msgid, &st));
}

static void do_health(struct dsv4_dispatch *d, struct dsv4_conn *c, const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_health h = { .reason = (char *)d->reason };
    char reason[DSV4_SERVER_REASON_MAX + 64];

    if (dsv4_proto_decode_empty_params(msg, &err) < 0) {
        reply_error(c, msg->msgid, &err);
        return;
    }
    switch (*d->state) {
    case DSV4_SERVER_READY: h.status = DSV4_PROTO_HEALTH_READY; break;
    case DSV4_SERVER_LOADING:
        /* The engine thread's current boot step. */
        snprintf(reason, sizeof(reason), "%s: %s", d->reason, dsv4_host_phase_text(dsv4_host_phase(d->host)));
        h.reason = reason;
        h.status = DSV4_PROTO_HEALTH_LOADING;
        break;
    case DSV4_SERVER_WARMUP: h.status = DSV4_PROTO_HEALTH_LOADING; break;
    case DSV4_SERVER_FAILED: h.status = DSV4_PROTO_HEALTH_FAILED; break;
    default: h.status = DSV4_PROTO_HEALTH_DRAINING; break;
    }
    reply_encoded(c, dsv4_proto_encode_health_result(&c->out, msg->msgid, &h));
}

void dsv4_dispatch_frame(struct dsv4_dispatch *d, struct dsv4_conn *c, const uint8_t *payload, size_t len)
{
    struct dsv4_proto_message msg = { 0 };
    struct dsv4_proto_error err = { 0 };

    if (dsv4_proto_message_decode(payload, len, &d->proto_limits, &msg, &err) < 0) {
        if (dsv4_proto_code_is_fatal(err.code) || !msg.has_msgid)
            dsv4_conn_fail(c, err.code, err.message);
        else
            reply_error(c, msg.msgid, &err);
        dsv4_proto_message_clear(&msg);
        return;
    }
    if (msg.kind != DSV4_PROTO_REQUEST) {
        dsv4_conn_fail(c, DSV4_PROTO_E_UNEXPECTED_MESSAGE, "the server accepts only requests [0, msgid, method, params]");
        dsv4_proto_message_clear(&msg);
        return;
    }
    switch (msg.method) {
    case DSV4_PROTO_METHOD_HELLO: do_hello(d, c, &msg); break;
    case DSV4_PROTO_METHOD_GENERATE: do_generate(d, c, &msg); break;
    case DSV4_PROTO_METHOD_CANCEL: do_cancel(d, c, &msg); break;
    case DSV4_PROTO_METHOD_TOKENIZE: do_tokenize(d, c, &msg); break;
    case DSV4_PROTO_METHOD_DETOKENIZE: do_detokenize(d, c, &msg); break;
    case DSV4_PROTO_METHOD_STATS: do_stats(d, c, &msg); break;
    case DSV4_PROTO_METHOD_HEALTH: do_health(d, c, &msg); break;
    default:
        dsv4_proto_error_set(&err, DSV4_PROTO_E_UNKNOWN_METHOD, "'%s' is not a request method",
                             dsv4_proto_method_name(msg.method));
        reply_error(c, msg.msgid, &err);
        break;
    }
    dsv4_proto_message_clear(&msg);
}

/* ---- engine events ------------------------------------------------------------------------------ */

static void on_token(struct dsv4_dispatch *d, struct dsv4_request *req, const struct dsv4_sched_event *ev)
{
    struct dsv4_conn *c = req->conn;
    const struct dsv4_sample *smp = &ev->sample;

    if (req->gen.sampling.logprobs >= 0 && !req->warmup) {
        if (req->n_logprobs == req->cap_logprobs) {
            uint32_t cap = req->cap_logprobs ? 2 * req->cap_logprobs : 64;
            void *p = dsv4_reqmem_realloc(req->logprobs, cap * sizeof(*req->logprobs));
            if (!p) {
                dsv4_log_err("request %u: out of memory for logprobs; cancelling it", req->msgid);
                dsv4_sched_cancel(d->sched, req->sched_id);
                return;
            }
            req->logprobs = p;
            req->cap_logprobs = cap;
        }
        struct dsv4_proto_logprob *lp = &req->logprobs[req->n_logprobs++];
        lp->logprob = smp->logprob;
        lp->n_top = (uint32_t)smp->n_top;
        memcpy(lp->top_ids, smp->top_ids, sizeof(int32_t) * (size_t)smp->n_top);
        memcpy(lp->top_logprobs, smp->top_logprobs, sizeof(float) * (size_t)smp->n_top);
    }
    if (c && req->gen.stream) {
        struct dsv4_proto_token_event te = {
            .msgid = req->msgid,
            .token = smp->token,
            .text = (char *)ev->delta,
            .text_len = ev->delta_len,
            .has_logprob = req->gen.sampling.logprobs >= 0,
        };
        char delta[DSV4_SCHED_DELTA_MAX + 1];
        /* The encoder takes a NUL-terminated string. */
        memcpy(delta, ev->delta, ev->delta_len);
        delta[ev->delta_len] = '\0';
        te.text = delta;
        if (te.has_logprob)
            te.logprob = req->logprobs[req->n_logprobs - 1];
        reply_encoded(c, dsv4_proto_encode_token(&c->out, &te));
    }
}

static void on_finish(struct dsv4_dispatch *d, struct dsv4_request *req, const struct dsv4_sched_result *res)
{
    struct dsv4_conn *c = req->conn;
    struct dsv4_proto_generate_result out = { 0 };

    if (!req->warmup)
        d->counters.generated_tokens_total += (uint64_t)res->completion_tokens;
    if (res->finish == DSV4_FINISH_CANCELLED)
        d->counters.requests_cancelled++;
    else if (res->finish == DSV4_FINISH_ERROR)
        d->counters.requests_failed++;
    if (res->finish == DSV4_FINISH_ERROR)
        dsv4_log_err("request %u: engine error: %s", req->msgid, res->error_message);
    /* The first request ended by a fatal backend error tells the server (the engine thread's own
     * report follows once every request has ended). */
    if (res->finish == DSV4_FINISH_ERROR && res->error == -ENOTRECOVERABLE)
        d->hooks.engine_failed(d->hooks.userdata, res->error_message);

    if (req->warmup) {
        char what[DSV4_SCHED_ERROR_MAX + 128];
        struct dsv4_sched_stats ss;
        /* the scheduler observed the warm-up before its result came out (both under its lock) */
        dsv4_sched_get_stats(d->sched, &ss);
        d->warmup_latency.queue = ss.queue;
        d->warmup_latency.ttft = ss.ttft;
        d->warmup_latency.tpot = ss.tpot;
        d->warmup_latency.e2e = ss.e2e;
        bool ok = res->finish != DSV4_FINISH_ERROR && res->finish != DSV4_FINISH_CANCELLED && res->n_tokens > 0;
        if (ok)
            snprintf(what, sizeof(what), "warm-up generated %d tokens in %.3f s", res->n_tokens,
                     (double)(res->timings.finish_ns - res->timings.submit_ns) / 1e9);
        else
            snprintf(what, sizeof(what), "warm-up generation failed: %s (%s)", dsv4_finish_reason_name(res->finish),
                     res->error_message[0] ? res->error_message : "no tokens");
        d->hooks.warmup_done(d->hooks.userdata, ok, what);
        return;
    }
    if (!c)
        return;
    out.text = (char *)res->text;
    out.text_len = res->text_len;
    out.tokens = (int32_t *)res->tokens;
    out.n_tokens = (uint32_t)res->n_tokens;
    out.finish_reason = proto_finish(res->finish);
    out.error_message = res->finish == DSV4_FINISH_ERROR ? (char *)res->error_message : NULL;
    out.usage.prompt_tokens = (uint32_t)res->prompt_tokens;
    out.usage.completion_tokens = (uint32_t)res->completion_tokens;
    out.usage.cached_tokens = (uint32_t)res->cached_tokens;
    /* From acceptance, as total_ms: the engine's queue_s starts at its submit, after the prompt was
     * tokenized and, for a request held while dsv4d booted, after READY. Both clocks are monotonic. */
    const uint64_t admitted_ns = res->timings.admit_ns ? res->timings.admit_ns : res->timings.finish_ns;
    out.timings.queue_ms = (double)(admitted_ns - req->accepted_ns) / 1e6;
    out.timings.prefill_ms = res->timings.prefill_s * 1e3;
    out.timings.decode_ms = res->timings.decode_s * 1e3;
    out.timings.total_ms = (double)(dsv4_now_ns() - req->accepted_ns) / 1e6;
    out.timings.decode_tokens_per_s = res->timings.decode_tokens_per_s;
    /* logprobs only when every token has its entry (a cancelled request may have lost none, but be exact). */
    if (req->gen.sampling.logprobs >= 0 && req->n_logprobs == (uint32_t)res->n_tokens)
        out.logprobs = req->logprobs;
    size_t start = c->out.len;
    reply_result(d, c, req->msgid, "generate", start, dsv4_proto_encode_generate_result(&c->out, req->msgid, &out));
}

int dsv4_dispatch_engine_events(sd_event_source *src, int fd, uint32_t revents, void *userdata)
{
    struct dsv4_dispatch *d = userdata;
    struct dsv4_sched_event event, *ev = &event;
    uint64_t n;

    if (read(fd, &n, sizeof(n)) < 0 && errno != EAGAIN)
        dsv4_log_warning("engine eventfd: %m");
    while (dsv4_sched_next_event(d->sched, ev) == 1) {
        struct dsv4_request *req = ev->user;
        if (ev->type == DSV4_SCHED_EVENT_TOKEN) {
            on_token(d, req, ev);
            continue;
        }
        on_finish(d, req, ev->result);
        dsv4_sched_release(d->sched, ev->id);
        request_free(d, req);
        if (*d->state == DSV4_SERVER_EXITING)
            break;
    }
    d->hooks.requests_ended(d->hooks.userdata);
    return 0;
}

void dsv4_dispatch_engine_ready(struct dsv4_dispatch *d, struct dsv4_sched *sched)
{
    struct dsv4_sched_stats st;

    d->sched = sched;
    dsv4_sched_get_stats(sched, &st);
    d->boot_device_allocs = st.backend.device_allocs;
    d->boot_graph_captures = st.backend.graph_captures;
    d->boot_sched_allocations = st.allocations;
}

int dsv4_dispatch_start_warmup(struct dsv4_dispatch *d)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_request *req = request_new(d, NULL, 0);
    int r;

    if (!req)
        return -ENOMEM;
    req->warmup = true;
    dsv4_proto_generate_init(&req->gen);
    req->gen.sampling.temperature = 0;
    req->gen.sampling.max_tokens = (uint32_t)d->cfg->warmup_tokens;
    if (d->has_chat) {
        struct dsv4_proto_chat_message m = { .role = DSV4_PROTO_ROLE_USER, .content = (char *)DSV4_WARMUP_PROMPT,
                                             .content_len = strlen(DSV4_WARMUP_PROMPT) };
        r = build_prompt(d, DSV4_PROTO_PROMPT_MESSAGES, NULL, 0, false, &m, 1, false, &req->prompt, &err);
    } else {
        r = build_prompt(d, DSV4_PROTO_PROMPT_TEXT, DSV4_WARMUP_PROMPT, strlen(DSV4_WARMUP_PROMPT), true, NULL, 0,
                         false, &req->prompt, &err);
    }
    if (r == 0 && (req->prompt.len == 0 || req->prompt.len >= (size_t)d->cfg->max_context))
        r = dsv4_proto_error_set(&err, DSV4_PROTO_E_PROMPT_TOO_LONG, "%zu prompt tokens for max_context %d",
                                 req->prompt.len, d->cfg->max_context);
    if (r == 0)
        r = submit(d, req, &err);
    if (r < 0) {
        dsv4_error_set(-EINVAL, "warm-up request: %s", err.message);
        request_free(d, req);
        return -EINVAL;
    }
    return 0;
}
