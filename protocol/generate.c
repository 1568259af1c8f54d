/* SPDX-License-Identifier: MIT */
/* generate: request, token notifications, result, and the checks that need the model's numbers. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "protocol/message_codec.h"

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

static const char *const finish_names[] = {
    [DSV4_PROTO_FINISH_STOP] = "stop",
    [DSV4_PROTO_FINISH_LENGTH] = "length",
    [DSV4_PROTO_FINISH_CANCELLED] = "cancelled",
    [DSV4_PROTO_FINISH_ERROR] = "error",
};

const char *dsv4_proto_finish_name(enum dsv4_proto_finish f)
{
    return (unsigned)f < ARRAY_SIZE(finish_names) ? finish_names[f] : "error";
}

int dsv4_proto_finish_from_name(const char *name)
{
    for (size_t i = 0; i < ARRAY_SIZE(finish_names); i++)
        if (strcmp(name, finish_names[i]) == 0)
            return (int)i;
    return -1;
}

void dsv4_proto_sampling_default(struct dsv4_proto_sampling *s)
{
    memset(s, 0, sizeof(*s));
    s->temperature = DSV4_PROTO_DEFAULT_TEMPERATURE;
    s->top_p = DSV4_PROTO_DEFAULT_TOP_P;
    s->top_k = DSV4_PROTO_DEFAULT_TOP_K;
    s->min_p = DSV4_PROTO_DEFAULT_MIN_P;
    s->repetition_penalty = DSV4_PROTO_DEFAULT_REPETITION_PENALTY;
    s->logprobs = -1;
}

void dsv4_proto_generate_init(struct dsv4_proto_generate *req)
{
    memset(req, 0, sizeof(*req));
    req->add_bos = true;
    dsv4_proto_sampling_default(&req->sampling);
}

static const char *const generate_keys[] = {
    "prompt", "messages", "tokens", "prompt_parts", "add_bos", "thinking", "stream",
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "logprobs",
};

static void pack_kv_num(msgpack_packer *pk, const char *key, double v)
{
    dsv4_wire_key(pk, key);
    msgpack_pack_double(pk, v);
}

int dsv4_proto_encode_generate(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_generate *req)
{
    struct dsv4_wire_enc e;
    msgpack_packer *pk = &e.pk;
    const struct dsv4_proto_sampling *s = &req->sampling;
    uint32_t n_stop = s->n_stop < DSV4_PROTO_MAX_STOP ? s->n_stop : DSV4_PROTO_MAX_STOP;
    uint32_t n_ids = s->n_stop_token_ids < DSV4_PROTO_MAX_STOP_TOKEN_IDS ? s->n_stop_token_ids
                                                                          : DSV4_PROTO_MAX_STOP_TOKEN_IDS;
    /* prompt source + add_bos/thinking + stream + 7 sampling numbers, then the optional ones */
    uint32_t n = 10 + (s->max_tokens ? 1 : 0) + (s->has_seed ? 1 : 0) + (n_stop ? 1 : 0) + (n_ids ? 1 : 0) +
                 (s->logprobs >= 0 ? 1 : 0);

    dsv4_proto_begin_request(&e, out, msgid, DSV4_PROTO_METHOD_GENERATE);
    msgpack_pack_map(pk, n);
    switch (req->prompt_kind) {
    case DSV4_PROTO_PROMPT_MESSAGES:
        dsv4_wire_key(pk, "messages");
        dsv4_proto_pack_chat_messages(pk, req->messages, req->n_messages);
        dsv4_wire_key(pk, "thinking");
        dsv4_wire_bool(pk, req->thinking);
        break;
    case DSV4_PROTO_PROMPT_TOKENS:
        dsv4_wire_key(pk, "tokens");
        dsv4_wire_tokens(pk, req->tokens, req->n_tokens);
        dsv4_wire_key(pk, "thinking");
        dsv4_wire_bool(pk, req->thinking);
        break;
    case DSV4_PROTO_PROMPT_PARTS:
        dsv4_wire_key(pk, "prompt_parts");
        msgpack_pack_array(pk, req->n_parts);
        for (uint32_t i = 0; i < req->n_parts; i++)
            dsv4_wire_str(pk, req->parts[i], req->part_lens[i]);
        dsv4_wire_key(pk, "add_bos");
        dsv4_wire_bool(pk, req->add_bos);
        break;
    default:
        dsv4_wire_key(pk, "prompt");
        dsv4_wire_str(pk, req->prompt ? req->prompt : "", req->prompt ? req->prompt_len : 0);
        dsv4_wire_key(pk, "add_bos");
        dsv4_wire_bool(pk, req->add_bos);
        break;
    }
    dsv4_wire_key(pk, "stream");
    dsv4_wire_bool(pk, req->stream);
    if (s->max_tokens) {
        dsv4_wire_key(pk, "max_tokens");
        msgpack_pack_uint32(pk, s->max_tokens);
    }
    pack_kv_num(pk, "temperature", s->temperature);
    pack_kv_num(pk, "top_p", s->top_p);
    dsv4_wire_key(pk, "top_k");
    msgpack_pack_int32(pk, s->top_k);
    pack_kv_num(pk, "min_p", s->min_p);
    pack_kv_num(pk, "presence_penalty", s->presence_penalty);
    pack_kv_num(pk, "frequency_penalty", s->frequency_penalty);
    pack_kv_num(pk, "repetition_penalty", s->repetition_penalty);
    if (s->has_seed) {
        dsv4_wire_key(pk, "seed");
        msgpack_pack_uint64(pk, s->seed);
    }
    if (n_stop) {
        dsv4_wire_key(pk, "stop");
        msgpack_pack_array(pk, n_stop);
        for (uint32_t i = 0; i < n_stop; i++)
            dsv4_wire_cstr(pk, s->stop[i] ? s->stop[i] : "");
    }
    if (n_ids) {
        dsv4_wire_key(pk, "stop_token_ids");
        msgpack_pack_array(pk, n_ids);
        for (uint32_t i = 0; i < n_ids; i++)
            msgpack_pack_int32(pk, s->stop_token_ids[i]);
    }
    if (s->logprobs >= 0) {
        dsv4_wire_key(pk, "logprobs");
        msgpack_pack_int32(pk, s->logprobs);
    }
    return dsv4_wire_end(&e);
}

/* Optional float sampling field in [lo, hi]. */
static int opt_sampling(const msgpack_object *map, const char *key, double lo, double hi, float *dst,
                        struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    double v;
    if (!o)
        return 0;
    int rc = dsv4_wire_read_num(o, "generate", key, lo, hi, DSV4_PROTO_E_BAD_SAMPLING, &v, err);
    if (rc == 0)
        *dst = (float)v;
    return rc;
}

static int read_stop(const msgpack_object *o, struct dsv4_proto_sampling *s, struct dsv4_proto_error *err)
{
    const msgpack_object *items = o;
    uint32_t n = 1;
    if (o->type == MSGPACK_OBJECT_ARRAY) {
        items = o->via.array.ptr;
        n = o->via.array.size;
    } else if (o->type != MSGPACK_OBJECT_STR) {
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "generate: stop must be a string or an array of strings");
    }
    if (n > DSV4_PROTO_MAX_STOP)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_STOP, "generate: %u stop strings, above the limit %u",
                                    n, DSV4_PROTO_MAX_STOP);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *it = &items[i];
        if (it->type != MSGPACK_OBJECT_STR)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "generate: stop[%u] must be a string", i);
        if (it->via.str.size > DSV4_PROTO_MAX_STOP_LEN)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_STOP,
                                        "generate: stop[%u] is %u bytes, above the limit %u", i, it->via.str.size,
                                        DSV4_PROTO_MAX_STOP_LEN);
        if (it->via.str.size == 0)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "generate: stop[%u] is empty", i);
        /* Stop strings are kept NUL-terminated: one holding a NUL would silently become its prefix. */
        if (memchr(it->via.str.ptr, '\0', it->via.str.size))
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "generate: stop[%u] holds a NUL byte", i);
        int rc = dsv4_wire_read_str(it, "generate", "stop", 0, &s->stop[i], NULL, err);
        if (rc)
            return rc;
        s->n_stop = i + 1;
    }
    return 0;
}

static int read_stop_token_ids(const msgpack_object *o, struct dsv4_proto_sampling *s, struct dsv4_proto_error *err)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "generate: stop_token_ids must be an array of integers");
    if (o->via.array.size > DSV4_PROTO_MAX_STOP_TOKEN_IDS)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_STOP, "generate: %u stop_token_ids, above the limit %u",
                                    o->via.array.size, DSV4_PROTO_MAX_STOP_TOKEN_IDS);
    for (uint32_t i = 0; i < o->via.array.size; i++) {
        int64_t v;
        int rc = dsv4_wire_read_int(&o->via.array.ptr[i], "generate", "stop_token_ids[]", 0, INT32_MAX,
                                    DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB, &v, err);
        if (rc)
            return rc;
        s->stop_token_ids[i] = (int32_t)v;
    }
    s->n_stop_token_ids = o->via.array.size;
    return 0;
}

static int read_parts(const msgpack_object *o, struct dsv4_proto_generate *req, struct dsv4_proto_error *err)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "generate: prompt_parts must be an array of strings");
    uint32_t n = o->via.array.size;
    if (n == 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "generate: prompt_parts is empty");
    if (n > DSV4_PROTO_MAX_PROMPT_PARTS)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "generate: %u prompt_parts, above the limit %u", n,
                                    DSV4_PROTO_MAX_PROMPT_PARTS);
    req->parts = calloc(n, sizeof(*req->parts));
    req->part_lens = calloc(n, sizeof(*req->part_lens));
    if (!req->parts || !req->part_lens)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "generate: no memory for prompt_parts");
    for (uint32_t i = 0; i < n; i++) {
        int rc = dsv4_wire_read_str(&o->via.array.ptr[i], "generate", "prompt_parts[]", 0, &req->parts[i],
                                    &req->part_lens[i], err);
        if (rc)
            return rc;
        req->n_parts = i + 1;
    }
    return 0;
}

static int read_sampling(const msgpack_object *map, struct dsv4_proto_sampling *s, struct dsv4_proto_error *err)
{
    const char *ctx = "generate";
    const msgpack_object *o;
    int64_t v;
    int rc = 0;
    if ((o = dsv4_wire_get(map, "max_tokens"))) {
        rc = dsv4_wire_read_int(o, ctx, "max_tokens", 1, DSV4_PROTO_MAX_MAX_TOKENS, DSV4_PROTO_E_BAD_SAMPLING, &v, err);
        if (rc)
            return rc;
        s->max_tokens = (uint32_t)v;
    }
    if (rc == 0) rc = opt_sampling(map, "temperature", 0, DSV4_PROTO_MAX_TEMPERATURE, &s->temperature, err);
    if (rc == 0) rc = opt_sampling(map, "top_p", 0, 1, &s->top_p, err);
    if (rc == 0) rc = opt_sampling(map, "min_p", 0, 1, &s->min_p, err);
    if (rc == 0) rc = opt_sampling(map, "presence_penalty", -DSV4_PROTO_MAX_PENALTY, DSV4_PROTO_MAX_PENALTY,
                                   &s->presence_penalty, err);
    if (rc == 0) rc = opt_sampling(map, "frequency_penalty", -DSV4_PROTO_MAX_PENALTY, DSV4_PROTO_MAX_PENALTY,
                                   &s->frequency_penalty, err);
    if (rc == 0) rc = opt_sampling(map, "repetition_penalty", 0, DSV4_PROTO_MAX_REPETITION_PENALTY,
                                   &s->repetition_penalty, err);
    if (rc)
        return rc;
    if (s->repetition_penalty <= 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_SAMPLING, "generate: repetition_penalty must be above 0");
    if ((o = dsv4_wire_get(map, "top_k"))) {
        rc = dsv4_wire_read_int(o, ctx, "top_k", -1, INT32_MAX, DSV4_PROTO_E_BAD_SAMPLING, &v, err);
        if (rc)
            return rc;
        s->top_k = v < 0 ? 0 : (int32_t)v;
    }
    if ((o = dsv4_wire_get(map, "seed"))) {
        rc = dsv4_wire_read_u64(o, ctx, "seed", DSV4_PROTO_E_BAD_SAMPLING, &s->seed, err);
        if (rc)
            return rc;
        s->has_seed = true;
    }
    if ((o = dsv4_wire_get(map, "logprobs"))) {
        if (o->type == MSGPACK_OBJECT_BOOLEAN) {
            s->logprobs = o->via.boolean ? 0 : -1;
        } else {
            rc = dsv4_wire_read_int(o, ctx, "logprobs", 0, DSV4_PROTO_MAX_LOGPROBS, DSV4_PROTO_E_BAD_SAMPLING, &v,
                                    err);
            if (rc)
                return rc;
            s->logprobs = (int32_t)v;
        }
    }
    if ((o = dsv4_wire_get(map, "stop")) && (rc = read_stop(o, s, err)))
        return rc;
    if ((o = dsv4_wire_get(map, "stop_token_ids")) && (rc = read_stop_token_ids(o, s, err)))
        return rc;
    return 0;
}

int dsv4_proto_decode_generate(const struct dsv4_proto_message *msg, struct dsv4_proto_generate *req,
                               struct dsv4_proto_error *err)
{
    const char *ctx = "generate";
    const msgpack_object *map, *prompt, *messages, *tokens, *parts;
    dsv4_proto_generate_init(req);
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, generate_keys, ARRAY_SIZE(generate_keys), true, ctx, err);
    if (rc)
        return rc;
    prompt = dsv4_wire_get(map, "prompt");
    messages = dsv4_wire_get(map, "messages");
    tokens = dsv4_wire_get(map, "tokens");
    parts = dsv4_wire_get(map, "prompt_parts");
    int sources = !!prompt + !!messages + !!tokens + !!parts;
    if (sources == 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD,
                                    "generate: needs prompt, messages, tokens or prompt_parts");
    if (sources > 1)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_PROMPT_CONFLICT,
                                    "generate: give exactly one of prompt, messages, tokens, prompt_parts");
    if (parts) {
        req->prompt_kind = DSV4_PROTO_PROMPT_PARTS;
        rc = read_parts(parts, req, err);
    } else if (prompt) {
        req->prompt_kind = DSV4_PROTO_PROMPT_TEXT;
        rc = dsv4_wire_read_str(prompt, ctx, "prompt", 0, &req->prompt, &req->prompt_len, err);
    } else if (messages) {
        req->prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
        rc = dsv4_proto_read_chat_messages(messages, ctx, &req->messages, &req->n_messages, err);
    } else {
        req->prompt_kind = DSV4_PROTO_PROMPT_TOKENS;
        rc = dsv4_wire_read_tokens(tokens, ctx, "tokens", false, &req->tokens, &req->n_tokens, err);
    }
    if (rc == 0) rc = dsv4_wire_opt_bool(map, "add_bos", ctx, &req->add_bos, err);
    if (rc == 0) rc = dsv4_wire_opt_bool(map, "thinking", ctx, &req->thinking, err);
    if (rc == 0) rc = dsv4_wire_opt_bool(map, "stream", ctx, &req->stream, err);
    if (rc == 0) rc = read_sampling(map, &req->sampling, err);
    if (rc)
        dsv4_proto_generate_clear(req);
    return rc;
}

void dsv4_proto_generate_clear(struct dsv4_proto_generate *req)
{
    if (!req)
        return;
    free(req->prompt);
    dsv4_proto_free_chat_messages(req->messages, req->n_messages);
    free(req->tokens);
    for (uint32_t i = 0; i < req->n_parts; i++)
        free(req->parts[i]);
    free(req->parts);
    free(req->part_lens);
    for (uint32_t i = 0; i < req->sampling.n_stop && i < DSV4_PROTO_MAX_STOP; i++)
        free(req->sampling.stop[i]);
    memset(req, 0, sizeof(*req));
}

int dsv4_proto_check_token_ids(const int32_t *ids, size_t n, uint32_t vocab_size, const char *field,
                               struct dsv4_proto_error *err)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (vocab_size && (uint32_t)ids[i] >= vocab_size))
            return dsv4_proto_error_set(err, DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB,
                                        "%s[%zu] = %d is outside the vocabulary [0, %u)", field, i, ids[i],
                                        vocab_size);
    return 0;
}

int dsv4_proto_check_prompt_length(uint32_t n_prompt_tokens, const struct dsv4_proto_model_limits *lim,
                                   struct dsv4_proto_error *err)
{
    if (lim->max_prompt_tokens && n_prompt_tokens > lim->max_prompt_tokens)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_PROMPT_TOO_LONG,
                                    "prompt of %u tokens, above the limit of %u prompt tokens", n_prompt_tokens,
                                    lim->max_prompt_tokens);
    if (lim->max_context && n_prompt_tokens >= lim->max_context)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_PROMPT_TOO_LONG,
                                    "prompt of %u tokens leaves no room in the context of %u tokens",
                                    n_prompt_tokens, lim->max_context);
    return 0;
}

uint32_t dsv4_proto_effective_max_tokens(const struct dsv4_proto_sampling *s, const struct dsv4_proto_model_limits *lim)
{
    uint32_t n = s->max_tokens ? s->max_tokens : DSV4_PROTO_DEFAULT_MAX_TOKENS;
    return lim->max_tokens && n > lim->max_tokens ? lim->max_tokens : n;
}

int dsv4_proto_check_generate(const struct dsv4_proto_generate *req, const struct dsv4_proto_model_limits *lim,
                              struct dsv4_proto_error *err)
{
    int rc = 0;
    if (req->prompt_kind == DSV4_PROTO_PROMPT_TOKENS) {
        rc = dsv4_proto_check_token_ids(req->tokens, req->n_tokens, lim->vocab_size, "generate: tokens", err);
        if (rc == 0)
            rc = dsv4_proto_check_prompt_length(req->n_tokens, lim, err);
    }
    if (rc == 0)
        rc = dsv4_proto_check_token_ids(req->sampling.stop_token_ids, req->sampling.n_stop_token_ids,
                                        lim->vocab_size, "generate: stop_token_ids", err);
    if (rc == 0 && lim->max_tokens && req->sampling.max_tokens > lim->max_tokens)
        rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MAX_TOKENS_LIMIT, "generate: max_tokens %u above the limit %u",
                                  req->sampling.max_tokens, lim->max_tokens);
    return rc;
}

/* ---- token notification ---- */

static void pack_top(msgpack_packer *pk, const struct dsv4_proto_logprob *lp)
{
    uint32_t n = lp->n_top < DSV4_PROTO_MAX_LOGPROBS ? lp->n_top : DSV4_PROTO_MAX_LOGPROBS;
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++) {
        msgpack_pack_array(pk, 2);
        msgpack_pack_int32(pk, lp->top_ids[i]);
        msgpack_pack_double(pk, lp->top_logprobs[i]);
    }
}

static const char *const logprob_keys[] = { "logprob", "top_logprobs" };

/* A number, not NaN; -inf is a valid log-probability (a token the sampler filtered out). */
static int read_logprob_value(const msgpack_object *o, const char *ctx, double *ret, struct dsv4_proto_error *err)
{
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64) {
        if (isnan(o->via.f64))
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: a logprob is NaN", ctx);
        *ret = o->via.f64;
        return 0;
    }
    return dsv4_wire_read_num(o, ctx, "logprob", -INFINITY, INFINITY, DSV4_PROTO_E_BAD_VALUE, ret, err);
}

/* logprob (number, required when the map is there) and top_logprobs ([[id, logprob], ...], optional). */
static int read_logprob(const msgpack_object *map, const char *ctx, struct dsv4_proto_logprob *lp,
                        struct dsv4_proto_error *err)
{
    const msgpack_object *top;
    double v = 0;
    memset(lp, 0, sizeof(*lp));
    int rc = dsv4_wire_opt_f64(map, "logprob", ctx, &v, err);
    if (rc)
        return rc;
    lp->logprob = (float)v;
    if (!(top = dsv4_wire_get(map, "top_logprobs")))
        return 0;
    if (top->type != MSGPACK_OBJECT_ARRAY)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: top_logprobs must be an array", ctx);
    if (top->via.array.size > DSV4_PROTO_MAX_LOGPROBS)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %u top_logprobs, above the limit %u", ctx,
                                    top->via.array.size, DSV4_PROTO_MAX_LOGPROBS);
    for (uint32_t i = 0; i < top->via.array.size; i++) {
        const msgpack_object *pair = &top->via.array.ptr[i];
        int64_t id;
        double l;
        if (pair->type != MSGPACK_OBJECT_ARRAY || pair->via.array.size != 2)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: top_logprobs[%u] must be [id, logprob]",
                                        ctx, i);
        rc = dsv4_wire_read_int(&pair->via.array.ptr[0], ctx, "top_logprobs id", INT32_MIN, INT32_MAX,
                                DSV4_PROTO_E_BAD_VALUE, &id, err);
        if (rc == 0)
            rc = read_logprob_value(&pair->via.array.ptr[1], ctx, &l, err);
        if (rc)
            return rc;
        lp->top_ids[i] = (int32_t)id;
        lp->top_logprobs[i] = (float)l;
    }
    lp->n_top = top->via.array.size;
    return 0;
}

static const char *const token_keys[] = { "msgid", "token", "text", "logprob", "top_logprobs" };

int dsv4_proto_encode_token(struct dsv4_proto_buf *out, const struct dsv4_proto_token_event *ev)
{
    struct dsv4_wire_enc e;
    msgpack_packer *pk = &e.pk;
    dsv4_proto_begin_notification(&e, out, DSV4_PROTO_NOTIFY_TOKEN);
    msgpack_pack_map(pk, ev->has_logprob ? 5 : 3);
    dsv4_wire_key(pk, "msgid");
    msgpack_pack_uint32(pk, ev->msgid);
    dsv4_wire_key(pk, "token");
    msgpack_pack_int32(pk, ev->token);
    dsv4_wire_key(pk, "text");
    dsv4_wire_str(pk, ev->text ? ev->text : "", ev->text ? ev->text_len : 0);
    if (ev->has_logprob) {
        pack_kv_num(pk, "logprob", ev->logprob.logprob);
        dsv4_wire_key(pk, "top_logprobs");
        pack_top(pk, &ev->logprob);
    }
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_token(const struct dsv4_proto_message *msg, struct dsv4_proto_token_event *ev,
                            struct dsv4_proto_error *err)
{
    const char *ctx = "token";
    const msgpack_object *map;
    memset(ev, 0, sizeof(*ev));
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, token_keys, ARRAY_SIZE(token_keys), false, ctx, err);
    if (rc == 0 && (!dsv4_wire_get(map, "msgid") || !dsv4_wire_get(map, "token") || !dsv4_wire_get(map, "text")))
        rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: needs msgid, token and text", ctx);
    if (rc == 0) rc = dsv4_wire_opt_u32(map, "msgid", ctx, &ev->msgid, err);
    if (rc == 0) rc = dsv4_wire_opt_i32(map, "token", ctx, &ev->token, err);
    if (rc == 0) rc = dsv4_wire_opt_str(map, "text", ctx, 0, &ev->text, &ev->text_len, err);
    if (rc == 0 && dsv4_wire_get(map, "logprob")) {
        ev->has_logprob = true;
        rc = read_logprob(map, ctx, &ev->logprob, err);
    }
    if (rc)
        dsv4_proto_token_event_clear(ev);
    return rc;
}

void dsv4_proto_token_event_clear(struct dsv4_proto_token_event *ev)
{
    if (!ev)
        return;
    free(ev->text);
    memset(ev, 0, sizeof(*ev));
}

/* ---- result ---- */

static const char *const result_keys[] = {
    "text", "tokens", "finish_reason", "error", "usage", "timings", "logprobs",
};
static const char *const usage_keys[] = { "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens" };
static const char *const timing_keys[] = { "queue_ms", "prefill_ms", "decode_ms", "total_ms", "decode_tokens_per_s" };

int dsv4_proto_encode_generate_result(struct dsv4_proto_buf *out, uint32_t msgid,
                                      const struct dsv4_proto_generate_result *res)
{
    struct dsv4_wire_enc e;
    msgpack_packer *pk = &e.pk;
    bool has_error = res->finish_reason == DSV4_PROTO_FINISH_ERROR && res->error_message;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(pk, 5 + (has_error ? 1 : 0) + (res->logprobs ? 1 : 0));
    dsv4_wire_key(pk, "text");
    dsv4_wire_str(pk, res->text ? res->text : "", res->text ? res->text_len : 0);
    dsv4_wire_key(pk, "tokens");
    dsv4_wire_tokens(pk, res->tokens, res->n_tokens);
    dsv4_wire_key(pk, "finish_reason");
    dsv4_wire_cstr(pk, dsv4_proto_finish_name(res->finish_reason));
    if (has_error) {
        dsv4_wire_key(pk, "error");
        dsv4_wire_cstr(pk, res->error_message);
    }
    dsv4_wire_key(pk, "usage");
    msgpack_pack_map(pk, 4);
    dsv4_wire_key(pk, "prompt_tokens");
    msgpack_pack_uint32(pk, res->usage.prompt_tokens);
    dsv4_wire_key(pk, "completion_tokens");
    msgpack_pack_uint32(pk, res->usage.completion_tokens);
    dsv4_wire_key(pk, "total_tokens");
    msgpack_pack_uint64(pk, (uint64_t)res->usage.prompt_tokens + res->usage.completion_tokens);
    dsv4_wire_key(pk, "cached_tokens");
    msgpack_pack_uint32(pk, res->usage.cached_tokens);
    dsv4_wire_key(pk, "timings");
    msgpack_pack_map(pk, 5);
    pack_kv_num(pk, "queue_ms", res->timings.queue_ms);
    pack_kv_num(pk, "prefill_ms", res->timings.prefill_ms);
    pack_kv_num(pk, "decode_ms", res->timings.decode_ms);
    pack_kv_num(pk, "total_ms", res->timings.total_ms);
    pack_kv_num(pk, "decode_tokens_per_s", res->timings.decode_tokens_per_s);
    if (res->logprobs) {
        dsv4_wire_key(pk, "logprobs");
        msgpack_pack_array(pk, res->n_tokens);
        for (uint32_t i = 0; i < res->n_tokens; i++) {
            msgpack_pack_map(pk, 2);
            pack_kv_num(pk, "logprob", res->logprobs[i].logprob);
            dsv4_wire_key(pk, "top_logprobs");
            pack_top(pk, &res->logprobs[i]);
        }
    }
    return dsv4_wire_end(&e);
}

static int read_result_logprobs(const msgpack_object *o, struct dsv4_proto_generate_result *res,
                                struct dsv4_proto_error *err)
{
    const char *ctx = "generate result";
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: logprobs must be an array", ctx);
    if (o->via.array.size != res->n_tokens)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %u logprobs for %u tokens", ctx,
                                    o->via.array.size, res->n_tokens);
    res->logprobs = calloc(res->n_tokens ? res->n_tokens : 1, sizeof(*res->logprobs));
    if (!res->logprobs)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "%s: no memory for logprobs", ctx);
    for (uint32_t i = 0; i < res->n_tokens; i++) {
        const msgpack_object *m = &o->via.array.ptr[i];
        if (m->type != MSGPACK_OBJECT_MAP)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: logprobs[%u] must be a map", ctx, i);
        int rc = dsv4_wire_check_keys(m, logprob_keys, ARRAY_SIZE(logprob_keys), false, ctx, err);
        if (rc == 0)
            rc = read_logprob(m, ctx, &res->logprobs[i], err);
        if (rc)
            return rc;
    }
    return 0;
}

int dsv4_proto_decode_generate_result(const struct dsv4_proto_message *msg,
                                      struct dsv4_proto_generate_result *res, struct dsv4_proto_error *err)
{
    const char *ctx = "generate result";
    const msgpack_object *map, *o;
    char *finish = NULL;
    memset(res, 0, sizeof(*res));
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, result_keys, ARRAY_SIZE(result_keys), false, ctx, err);
    if (rc == 0 && (!dsv4_wire_get(map, "text") || !dsv4_wire_get(map, "tokens") ||
                    !dsv4_wire_get(map, "finish_reason")))
        rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: needs text, tokens and finish_reason", ctx);
    if (rc == 0) rc = dsv4_wire_opt_str(map, "text", ctx, 0, &res->text, &res->text_len, err);
    if (rc == 0)
        rc = dsv4_wire_read_tokens(dsv4_wire_get(map, "tokens"), ctx, "tokens", true, &res->tokens, &res->n_tokens,
                                   err);
    if (rc == 0) rc = dsv4_wire_opt_str(map, "finish_reason", ctx, DSV4_PROTO_MAX_NAME, &finish, NULL, err);
    if (rc == 0) {
        int f = dsv4_proto_finish_from_name(finish);
        if (f < 0)
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: unknown finish_reason \"%s\"", ctx, finish);
        else
            res->finish_reason = (enum dsv4_proto_finish)f;
    }
    free(finish);
    if (rc == 0) rc = dsv4_wire_opt_str(map, "error", ctx, 0, &res->error_message, NULL, err);
    if (rc == 0 && (o = dsv4_wire_get(map, "usage"))) {
        if (o->type != MSGPACK_OBJECT_MAP)
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: usage must be a map", ctx);
        if (rc == 0) rc = dsv4_wire_check_keys(o, usage_keys, ARRAY_SIZE(usage_keys), false, ctx, err);
        if (rc == 0) rc = dsv4_wire_opt_u32(o, "prompt_tokens", ctx, &res->usage.prompt_tokens, err);
        if (rc == 0) rc = dsv4_wire_opt_u32(o, "completion_tokens", ctx, &res->usage.completion_tokens, err);
        if (rc == 0) rc = dsv4_wire_opt_u32(o, "cached_tokens", ctx, &res->usage.cached_tokens, err);
    }
    if (rc == 0 && (o = dsv4_wire_get(map, "timings"))) {
        if (o->type != MSGPACK_OBJECT_MAP)
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: timings must be a map", ctx);
        if (rc == 0) rc = dsv4_wire_check_keys(o, timing_keys, ARRAY_SIZE(timing_keys), false, ctx, err);
        if (rc == 0) rc = dsv4_wire_opt_f64(o, "queue_ms", ctx, &res->timings.queue_ms, err);
        if (rc == 0) rc = dsv4_wire_opt_f64(o, "prefill_ms", ctx, &res->timings.prefill_ms, err);
        if (rc == 0) rc = dsv4_wire_opt_f64(o, "decode_ms", ctx, &res->timings.decode_ms, err);
        if (rc == 0) rc = dsv4_wire_opt_f64(o, "total_ms", ctx, &res->timings.total_ms, err);
        if (rc == 0)
            rc = dsv4_wire_opt_f64(o, "decode_tokens_per_s", ctx, &res->timings.decode_tokens_per_s, err);
    }
    if (rc == 0 && (o = dsv4_wire_get(map, "logprobs")))
        rc = read_result_logprobs(o, res, err);
    if (rc)
        dsv4_proto_generate_result_clear(res);
    return rc;
}

void dsv4_proto_generate_result_clear(struct dsv4_proto_generate_result *res)
{
    if (!res)
        return;
    free(res->text);
    free(res->tokens);
    free(res->error_message);
    free(res->logprobs);
    memset(res, 0, sizeof(*res));
}
