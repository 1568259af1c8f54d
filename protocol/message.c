/* SPDX-License-Identifier: MIT */
/* msgpack-rpc envelope, errors, and the small methods: hello, cancel, tokenize, detokenize, stats, health.
 * generate and its notifications live in protocol/generate.c. */
#include "build-config.h"

#include <errno.h>
#include <float.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "protocol/message_codec.h"

/* A decoded frame: msgpack-c's objects point into the copy of its payload. */
struct dsv4_proto_unpacked {
    uint8_t *copy;                 /* the payload; msgpack-c's str/bin objects point into it */
    msgpack_unpacked up;
    const msgpack_object *body;    /* params map (NULL when absent) or result */
};

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

static const char *const method_names[] = {
    [DSV4_PROTO_METHOD_HELLO] = "hello",
    [DSV4_PROTO_METHOD_GENERATE] = "generate",
    [DSV4_PROTO_METHOD_CANCEL] = "cancel",
    [DSV4_PROTO_METHOD_TOKENIZE] = "tokenize",
    [DSV4_PROTO_METHOD_DETOKENIZE] = "detokenize",
    [DSV4_PROTO_METHOD_STATS] = "stats",
    [DSV4_PROTO_METHOD_HEALTH] = "health",
    [DSV4_PROTO_NOTIFY_TOKEN] = "token",
    [DSV4_PROTO_NOTIFY_ERROR] = "error",
};

const char *dsv4_proto_method_name(enum dsv4_proto_method m)
{
    return (unsigned)m < ARRAY_SIZE(method_names) ? method_names[m] : NULL;
}

/* Requests match [HELLO, HEALTH], notifications [TOKEN, ERROR]. */
static enum dsv4_proto_method lookup_method(const msgpack_object *o, enum dsv4_proto_method first,
                                            enum dsv4_proto_method last)
{
    for (int m = first; m <= (int)last; m++) {
        const char *name = method_names[m];
        if (o->via.str.size == strlen(name) && memcmp(o->via.str.ptr, name, o->via.str.size) == 0)
            return (enum dsv4_proto_method)m;
    }
    return DSV4_PROTO_METHOD_UNKNOWN;
}

static int read_msgid(const msgpack_object *o, struct dsv4_proto_message *msg, struct dsv4_proto_error *err)
{
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER || o->via.u64 > UINT32_MAX)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_MSGID, "msgid must be an integer in [0, 2^32)");
    msg->msgid = (uint32_t)o->via.u64;
    msg->has_msgid = true;
    return 0;
}

/* params: [map] is the canonical form; map, [] and nil are accepted. Anything else stays as is for the
 * typed decoder to reject with WRONG_TYPE. */
static const msgpack_object *params_body(const msgpack_object *p)
{
    if (p->type == MSGPACK_OBJECT_NIL)
        return NULL;
    if (p->type == MSGPACK_OBJECT_ARRAY && p->via.array.size == 0)
        return NULL;
    if (p->type == MSGPACK_OBJECT_ARRAY && p->via.array.size == 1)
        return &p->via.array.ptr[0];
    return p;
}

static const char *const error_keys[] = { "code", "name", "message" };

static int read_error_map(const msgpack_object *o, struct dsv4_proto_error *out, struct dsv4_proto_error *err)
{
    char *m = NULL;
    int32_t code = 0;
    if (o->type != MSGPACK_OBJECT_MAP)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_NOT_RPC, "error must be nil or a map {code, name, message}");
    int rc = dsv4_wire_check_keys(o, error_keys, ARRAY_SIZE(error_keys), false, "error", err);
    if (rc)
        return rc;
    if (!dsv4_wire_get(o, "code"))
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "error: no code");
    rc = dsv4_wire_opt_i32(o, "code", "error", &code, err);
    if (rc == 0)
        rc = dsv4_wire_opt_str(o, "message", "error", 0, &m, NULL, err);
    if (rc)
        return rc;
    out->code = code;
    snprintf(out->message, sizeof(out->message), "%s", m ? m : dsv4_proto_code_describe(code));
    free(m);
    return 0;
}

int dsv4_proto_message_decode(const uint8_t *payload, size_t len, const struct dsv4_proto_limits *lim,
                              struct dsv4_proto_message *msg, struct dsv4_proto_error *err)
{
    memset(msg, 0, sizeof(*msg));
    int rc = dsv4_proto_validate(payload, len, lim, NULL, err);
    if (rc)
        return rc;
    struct dsv4_proto_unpacked *u = calloc(1, sizeof(*u));
    if (!u)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "no memory for a message");
    msgpack_unpacked_init(&u->up);
    msg->body = u;
    u->copy = malloc(len);
    if (!u->copy)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "no memory for a %zu-byte message", len);
    memcpy(u->copy, payload, len);
    size_t off = 0;
    if (msgpack_unpack_next(&u->up, (const char *)u->copy, len, &off) != MSGPACK_UNPACK_SUCCESS || off != len)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MALFORMED, "msgpack could not unpack the frame");

    const msgpack_object *root = &u->up.data;
    if (root->type != MSGPACK_OBJECT_ARRAY || root->via.array.size < 3 || root->via.array.size > 4)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_NOT_RPC, "a message is an array of 3 or 4 elements");
    const msgpack_object *a = root->via.array.ptr;
    if (a[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER || a[0].via.u64 > DSV4_PROTO_NOTIFICATION)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_NOT_RPC, "message type must be 0, 1 or 2");
    msg->kind = (enum dsv4_proto_kind)a[0].via.u64;
    uint32_t want = msg->kind == DSV4_PROTO_NOTIFICATION ? 3 : 4;
    if (root->via.array.size != want)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_NOT_RPC, "message of type %u must have %u elements",
                                    (unsigned)msg->kind, want);
    switch (msg->kind) {
    case DSV4_PROTO_REQUEST:
        rc = read_msgid(&a[1], msg, err);
        if (rc)
            return rc;
        if (a[2].type != MSGPACK_OBJECT_STR)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "method must be a string");
        msg->method = lookup_method(&a[2], DSV4_PROTO_METHOD_HELLO, DSV4_PROTO_METHOD_HEALTH);
        if (msg->method == DSV4_PROTO_METHOD_UNKNOWN) {
            if (!dsv4_utf8_valid(a[2].via.str.ptr, a[2].via.str.size))
                return dsv4_proto_error_set(err, DSV4_PROTO_E_UNKNOWN_METHOD, "unknown method (not valid UTF-8)");
            return dsv4_proto_error_set(err, DSV4_PROTO_E_UNKNOWN_METHOD, "unknown method \"%.*s\"",
                                        (int)(a[2].via.str.size > 64 ? 64 : a[2].via.str.size), a[2].via.str.ptr);
        }
        u->body = params_body(&a[3]);
        break;
    case DSV4_PROTO_RESPONSE:
        rc = read_msgid(&a[1], msg, err);
        if (rc)
            return rc;
        if (a[2].type != MSGPACK_OBJECT_NIL) {
            rc = read_error_map(&a[2], &msg->error, err);
            if (rc)
                return rc;
            msg->has_error = true;
        }
        u->body = a[3].type == MSGPACK_OBJECT_NIL ? NULL : &a[3];
        break;
    case DSV4_PROTO_NOTIFICATION:
        if (a[1].type != MSGPACK_OBJECT_STR)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_NOT_RPC, "notification method must be a string");
        msg->method = lookup_method(&a[1], DSV4_PROTO_NOTIFY_TOKEN, DSV4_PROTO_NOTIFY_ERROR);
        u->body = params_body(&a[2]);
        break;
    }
    return 0;
}

void dsv4_proto_message_clear(struct dsv4_proto_message *msg)
{
    if (!msg)
        return;
    if (msg->body) {
        msgpack_unpacked_destroy(&msg->body->up);
        free(msg->body->copy);
        free(msg->body);
    }
    memset(msg, 0, sizeof(*msg));
}

/* ---- errors ---- */

/* ---- roles and the chat-message list (message_codec.h) ---- */

static const char *const role_names[] = {
    [DSV4_PROTO_ROLE_SYSTEM] = "system",
    [DSV4_PROTO_ROLE_USER] = "user",
    [DSV4_PROTO_ROLE_ASSISTANT] = "assistant",
};

const char *dsv4_proto_role_name(enum dsv4_proto_role r)
{
    return (unsigned)r < ARRAY_SIZE(role_names) ? role_names[r] : "user";
}

static const char *const message_keys[] = { "role", "content" };

int dsv4_proto_read_chat_messages(const msgpack_object *o, const char *ctx, struct dsv4_proto_chat_message **ret,
                                  uint32_t *ret_n, struct dsv4_proto_error *err)
{
    *ret = NULL;
    *ret_n = 0;
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: messages must be an array of maps", ctx);
    uint32_t n = o->via.array.size;
    if (n == 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: messages is empty", ctx);
    if (n > DSV4_PROTO_MAX_MESSAGES)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_MESSAGES, "%s: %u messages, above the limit %u",
                                    ctx, n, DSV4_PROTO_MAX_MESSAGES);
    struct dsv4_proto_chat_message *m = calloc(n, sizeof(*m));
    if (!m)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "%s: no memory for %u messages", ctx, n);
    int rc = 0;
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        const msgpack_object *mo = &o->via.array.ptr[i];
        char field[48];
        snprintf(field, sizeof(field), "messages[%u]", i);
        if (mo->type != MSGPACK_OBJECT_MAP) {
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be a map {role, content}", ctx,
                                      field);
            break;
        }
        rc = dsv4_wire_check_keys(mo, message_keys, 2, true, ctx, err);
        if (rc)
            break;
        const msgpack_object *role = dsv4_wire_get(mo, "role"), *content = dsv4_wire_get(mo, "content");
        if (!role || !content) {
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: %s has no %s", ctx, field,
                                      role ? "content" : "role");
            break;
        }
        if (role->type != MSGPACK_OBJECT_STR) {
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s.role must be a string", ctx, field);
            break;
        }
        int r = -1;
        for (int k = DSV4_PROTO_ROLE_SYSTEM; k <= DSV4_PROTO_ROLE_ASSISTANT; k++) {
            const char *name = dsv4_proto_role_name((enum dsv4_proto_role)k);
            if (role->via.str.size == strlen(name) && memcmp(role->via.str.ptr, name, role->via.str.size) == 0)
                r = k;
        }
        /* Every string is UTF-8 first (PROTOCOL.md): a role that is not is invalid_utf8, not bad_role. */
        if (r < 0 && !dsv4_utf8_valid(role->via.str.ptr, role->via.str.size)) {
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_INVALID_UTF8, "%s: %s.role is not valid UTF-8", ctx, field);
            break;
        }
        if (r < 0) {
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_ROLE,
                                      "%s: %s.role must be system, user or assistant", ctx, field);
            break;
        }
        m[i].role = (enum dsv4_proto_role)r;
        rc = dsv4_wire_read_str(content, ctx, "content", 0, &m[i].content, &m[i].content_len, err);
    }
    if (rc) {
        dsv4_proto_free_chat_messages(m, n);
        return rc;
    }
    *ret = m;
    *ret_n = n;
    return 0;
}

void dsv4_proto_free_chat_messages(struct dsv4_proto_chat_message *m, uint32_t n)
{
    if (!m)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(m[i].content);
    free(m);
}

void dsv4_proto_pack_chat_messages(msgpack_packer *pk, const struct dsv4_proto_chat_message *m, uint32_t n)
{
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++) {
        msgpack_pack_map(pk, 2);
        dsv4_wire_key(pk, "role");
        dsv4_wire_cstr(pk, dsv4_proto_role_name(m[i].role));
        dsv4_wire_key(pk, "content");
        dsv4_wire_str(pk, m[i].content ? m[i].content : "", m[i].content ? m[i].content_len : 0);
    }
}

/* ---- the envelope (message_codec.h) ---- */

void dsv4_proto_begin_request(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out, uint32_t msgid,
                              enum dsv4_proto_method method)
{
    dsv4_wire_begin_frame(e, out);
    msgpack_pack_array(&e->pk, 4);
    msgpack_pack_uint32(&e->pk, DSV4_PROTO_REQUEST);
    msgpack_pack_uint32(&e->pk, msgid);
    dsv4_wire_cstr(&e->pk, dsv4_proto_method_name(method));
    msgpack_pack_array(&e->pk, 1);
}

void dsv4_proto_begin_response(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out, uint32_t msgid)
{
    dsv4_wire_begin_frame(e, out);
    msgpack_pack_array(&e->pk, 4);
    msgpack_pack_uint32(&e->pk, DSV4_PROTO_RESPONSE);
    msgpack_pack_uint32(&e->pk, msgid);
    msgpack_pack_nil(&e->pk);
}

void dsv4_proto_begin_notification(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out,
                                   enum dsv4_proto_method method)
{
    dsv4_wire_begin_frame(e, out);
    msgpack_pack_array(&e->pk, 3);
    msgpack_pack_uint32(&e->pk, DSV4_PROTO_NOTIFICATION);
    dsv4_wire_cstr(&e->pk, dsv4_proto_method_name(method));
    msgpack_pack_array(&e->pk, 1);
}

int dsv4_proto_body_map(const struct dsv4_proto_message *msg, const char *ctx, const msgpack_object **ret,
                        struct dsv4_proto_error *err)
{
    const msgpack_object *b = msg->body ? msg->body->body : NULL;
    *ret = NULL;
    if (!b)
        return 0;
    if (b->type != MSGPACK_OBJECT_MAP)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be a map", ctx,
                                    msg->kind == DSV4_PROTO_RESPONSE ? "result" : "params");
    *ret = b;
    return 0;
}

static void pack_error_map(msgpack_packer *pk, int code, const char *message)
{
    msgpack_pack_map(pk, 3);
    dsv4_wire_key(pk, "code");
    msgpack_pack_int32(pk, code);
    dsv4_wire_key(pk, "name");
    dsv4_wire_cstr(pk, dsv4_proto_code_name(code));
    dsv4_wire_key(pk, "message");
    const char *m = message ? message : dsv4_proto_code_describe(code);
    /* the message quotes client input: never echo invalid UTF-8 back */
    dsv4_wire_cstr(pk, dsv4_utf8_valid(m, strlen(m)) ? m : dsv4_proto_code_describe(code));
}

int dsv4_proto_encode_error(struct dsv4_proto_buf *out, uint32_t msgid, int code, const char *message)
{
    struct dsv4_wire_enc e;
    dsv4_wire_begin_frame(&e, out);
    msgpack_pack_array(&e.pk, 4);
    msgpack_pack_uint32(&e.pk, DSV4_PROTO_RESPONSE);
    msgpack_pack_uint32(&e.pk, msgid);
    pack_error_map(&e.pk, code, message);
    msgpack_pack_nil(&e.pk);
    return dsv4_wire_end(&e);
}

int dsv4_proto_encode_error_notification(struct dsv4_proto_buf *out, int code, const char *message)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_notification(&e, out, DSV4_PROTO_NOTIFY_ERROR);
    pack_error_map(&e.pk, code, message);
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_error_notification(const struct dsv4_proto_message *msg,
                                         struct dsv4_proto_error *out, struct dsv4_proto_error *err)
{
    const msgpack_object *map;
    int rc = dsv4_proto_body_map(msg, "error", &map, err);
    if (rc)
        return rc;
    if (!map)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "error: no params");
    return read_error_map(map, out, err);
}

/* ---- hello ---- */

static const char *const hello_keys[] = { "protocol", "client" };

int dsv4_proto_encode_hello(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_hello *req)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_request(&e, out, msgid, DSV4_PROTO_METHOD_HELLO);
    msgpack_pack_map(&e.pk, req->client ? 2 : 1);
    dsv4_wire_key(&e.pk, "protocol");
    msgpack_pack_uint32(&e.pk, req->protocol);
    if (req->client) {
        dsv4_wire_key(&e.pk, "client");
        dsv4_wire_cstr(&e.pk, req->client);
    }
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_hello(const struct dsv4_proto_message *msg, struct dsv4_proto_hello *req,
                            struct dsv4_proto_error *err)
{
    const msgpack_object *map;
    memset(req, 0, sizeof(*req));
    int rc = dsv4_proto_body_map(msg, "hello", &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, hello_keys, ARRAY_SIZE(hello_keys), true, "hello", err);
    if (rc)
        return rc;
    const msgpack_object *p = dsv4_wire_get(map, "protocol");
    if (!p)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "hello: no protocol (the client's version)");
    rc = dsv4_wire_read_u32(p, "hello", "protocol", &req->protocol, err);
    if (rc == 0)
        rc = dsv4_wire_opt_str(map, "client", "hello", DSV4_PROTO_MAX_NAME, &req->client, NULL, err);
    if (rc)
        dsv4_proto_hello_clear(req);
    return rc;
}

void dsv4_proto_hello_clear(struct dsv4_proto_hello *req)
{
    if (!req)
        return;
    free(req->client);
    memset(req, 0, sizeof(*req));
}

int dsv4_proto_hello_negotiate(const struct dsv4_proto_hello *req, uint32_t *ret_version,
                               struct dsv4_proto_error *err)
{
    if (req->protocol < DSV4_PROTO_VERSION_MIN)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_VERSION_UNSUPPORTED,
                                    "hello: protocol %u, this server speaks %u to %u", req->protocol,
                                    DSV4_PROTO_VERSION_MIN, DSV4_PROTO_VERSION);
    *ret_version = req->protocol < DSV4_PROTO_VERSION ? req->protocol : DSV4_PROTO_VERSION;
    return 0;
}

static void pack_kv_u32(msgpack_packer *pk, const char *key, uint32_t v)
{
    dsv4_wire_key(pk, key);
    msgpack_pack_uint32(pk, v);
}

static void pack_kv_u64(msgpack_packer *pk, const char *key, uint64_t v)
{
    dsv4_wire_key(pk, key);
    msgpack_pack_uint64(pk, v);
}

static void pack_kv_f64(msgpack_packer *pk, const char *key, double v)
{
    dsv4_wire_key(pk, key);
    msgpack_pack_double(pk, v);
}

static void pack_kv_str(msgpack_packer *pk, const char *key, const char *v)
{
    dsv4_wire_key(pk, key);
    dsv4_wire_cstr(pk, v ? v : "");
}

int dsv4_proto_encode_hello_result(struct dsv4_proto_buf *out, uint32_t msgid,
                                   const struct dsv4_proto_hello_result *res)
{
    struct dsv4_wire_enc e;
    msgpack_packer *pk = &e.pk;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(pk, 7);
    pack_kv_u32(pk, "protocol", res->protocol);
    pack_kv_str(pk, "server", res->server);
    dsv4_wire_key(pk, "model");
    msgpack_pack_map(pk, 10);
    pack_kv_str(pk, "name", res->model.name);
    pack_kv_u32(pk, "vocab_size", res->model.vocab_size);
    pack_kv_u32(pk, "hidden_size", res->model.hidden_size);
    pack_kv_u32(pk, "num_layers", res->model.num_layers);
    pack_kv_u32(pk, "num_heads", res->model.num_heads);
    pack_kv_u32(pk, "head_dim", res->model.head_dim);
    pack_kv_u32(pk, "n_routed_experts", res->model.n_routed_experts);
    pack_kv_u32(pk, "experts_per_token", res->model.experts_per_token);
    dsv4_wire_key(pk, "bos_id");
    msgpack_pack_int32(pk, res->model.bos_id);
    dsv4_wire_key(pk, "eos_id");
    msgpack_pack_int32(pk, res->model.eos_id);
    pack_kv_u32(pk, "max_context", res->max_context);
    pack_kv_u32(pk, "max_batch", res->max_batch);
    pack_kv_str(pk, "backend", res->backend);
    dsv4_wire_key(pk, "limits");
    msgpack_pack_map(pk, 6);
    pack_kv_u32(pk, "max_frame", res->limits.max_frame);
    pack_kv_u32(pk, "max_prompt_tokens", res->limits.max_prompt_tokens);
    pack_kv_u32(pk, "max_tokens", res->limits.max_tokens);
    pack_kv_u32(pk, "max_connections", res->limits.max_connections);
    pack_kv_u32(pk, "max_queue", res->limits.max_queue);
    pack_kv_u32(pk, "max_requests_per_connection", res->limits.max_requests_per_connection);
    return dsv4_wire_end(&e);
}

static const char *const hello_result_keys[] = {
    "protocol", "server", "model", "max_context", "max_batch", "backend", "limits",
};
static const char *const model_keys[] = {
    "name", "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "n_routed_experts",
    "experts_per_token", "bos_id", "eos_id",
};
static const char *const limits_keys[] = {
    "max_frame", "max_prompt_tokens", "max_tokens", "max_connections", "max_queue",
    "max_requests_per_connection",
};

static int read_model(const msgpack_object *o, struct dsv4_proto_model_info *m, struct dsv4_proto_error *err)
{
    const char *ctx = "hello.model";
    if (o->type != MSGPACK_OBJECT_MAP)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s must be a map", ctx);
    int rc = dsv4_wire_check_keys(o, model_keys, ARRAY_SIZE(model_keys), false, ctx, err);
    if (rc == 0) rc = dsv4_wire_opt_str(o, "name", ctx, DSV4_PROTO_MAX_NAME, &m->name, NULL, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "vocab_size", ctx, &m->vocab_size, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "hidden_size", ctx, &m->hidden_size, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "num_layers", ctx, &m->num_layers, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "num_heads", ctx, &m->num_heads, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "head_dim", ctx, &m->head_dim, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "n_routed_experts", ctx, &m->n_routed_experts, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "experts_per_token", ctx, &m->experts_per_token, err);
    if (rc == 0) rc = dsv4_wire_opt_i32(o, "bos_id", ctx, &m->bos_id, err);
    if (rc == 0) rc = dsv4_wire_opt_i32(o, "eos_id", ctx, &m->eos_id, err);
    return rc;
}

static int read_limits(const msgpack_object *o, struct dsv4_proto_server_limits *l, struct dsv4_proto_error *err)
{
    const char *ctx = "hello.limits";
    if (o->type != MSGPACK_OBJECT_MAP)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s must be a map", ctx);
    int rc = dsv4_wire_check_keys(o, limits_keys, ARRAY_SIZE(limits_keys), false, ctx, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "max_frame", ctx, &l->max_frame, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "max_prompt_tokens", ctx, &l->max_prompt_tokens, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "max_tokens", ctx, &l->max_tokens, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "max_connections", ctx, &l->max_connections, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "max_queue", ctx, &l->max_queue, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(o, "max_requests_per_connection", ctx, &l->max_requests_per_connection, err);
    return rc;
}

int dsv4_proto_decode_hello_result(const struct dsv4_proto_message *msg, struct dsv4_proto_hello_result *res,
                                   struct dsv4_proto_error *err)
{
    const char *ctx = "hello result";
    const msgpack_object *map, *o;
    memset(res, 0, sizeof(*res));
    res->model.bos_id = -1;
    res->model.eos_id = -1;
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, hello_result_keys, ARRAY_SIZE(hello_result_keys), false, ctx, err);
    if (rc == 0 && (!dsv4_wire_get(map, "protocol") || !dsv4_wire_get(map, "server")))
        rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: needs protocol and server", ctx);
    if (rc == 0) rc = dsv4_wire_opt_u32(map, "protocol", ctx, &res->protocol, err);
    if (rc == 0) rc = dsv4_wire_opt_str(map, "server", ctx, DSV4_PROTO_MAX_NAME, &res->server, NULL, err);
    if (rc == 0 && (o = dsv4_wire_get(map, "model")))
        rc = read_model(o, &res->model, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(map, "max_context", ctx, &res->max_context, err);
    if (rc == 0) rc = dsv4_wire_opt_u32(map, "max_batch", ctx, &res->max_batch, err);
    if (rc == 0) rc = dsv4_wire_opt_str(map, "backend", ctx, DSV4_PROTO_MAX_NAME, &res->backend, NULL, err);
    if (rc == 0 && (o = dsv4_wire_get(map, "limits")))
        rc = read_limits(o, &res->limits, err);
    if (rc)
        dsv4_proto_hello_result_clear(res);
    return rc;
}

void dsv4_proto_hello_result_clear(struct dsv4_proto_hello_result *res)
{
    if (!res)
        return;
    free(res->server);
    free(res->model.name);
    free(res->backend);
    memset(res, 0, sizeof(*res));
}

/* ---- cancel ---- */

static const char *const cancel_keys[] = { "msgid" };
static const char *const cancel_result_keys[] = { "cancelled" };

int dsv4_proto_encode_cancel(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_cancel *req)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_request(&e, out, msgid, DSV4_PROTO_METHOD_CANCEL);
    msgpack_pack_map(&e.pk, 1);
    pack_kv_u32(&e.pk, "msgid", req->msgid);
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_cancel(const struct dsv4_proto_message *msg, struct dsv4_proto_cancel *req,
                             struct dsv4_proto_error *err)
{
    const msgpack_object *map, *o;
    memset(req, 0, sizeof(*req));
    int rc = dsv4_proto_body_map(msg, "cancel", &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, cancel_keys, ARRAY_SIZE(cancel_keys), true, "cancel", err);
    if (rc)
        return rc;
    if (!(o = dsv4_wire_get(map, "msgid")))
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "cancel: no msgid");
    return dsv4_wire_read_u32(o, "cancel", "msgid", &req->msgid, err);
}

int dsv4_proto_encode_cancel_result(struct dsv4_proto_buf *out, uint32_t msgid, bool cancelled)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(&e.pk, 1);
    dsv4_wire_key(&e.pk, "cancelled");
    dsv4_wire_bool(&e.pk, cancelled);
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_cancel_result(const struct dsv4_proto_message *msg, bool *cancelled,
                                    struct dsv4_proto_error *err)
{
    const msgpack_object *map;
    *cancelled = false;
    int rc = dsv4_proto_body_map(msg, "cancel result", &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, cancel_result_keys, 1, false, "cancel result", err);
    if (rc == 0 && !dsv4_wire_get(map, "cancelled"))
        rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "cancel result: no cancelled");
    if (rc == 0)
        rc = dsv4_wire_opt_bool(map, "cancelled", "cancel result", cancelled, err);
    return rc;
}

/* ---- tokenize / detokenize ---- */

static const char *const tokenize_keys[] = { "text", "add_bos", "messages", "thinking" };
static const char *const tokens_keys[] = { "tokens" };
static const char *const text_keys[] = { "text" };

void dsv4_proto_tokenize_init(struct dsv4_proto_tokenize *req)
{
    memset(req, 0, sizeof(*req));
    req->add_bos = true;
}

int dsv4_proto_encode_tokenize(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_tokenize *req)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_request(&e, out, msgid, DSV4_PROTO_METHOD_TOKENIZE);
    msgpack_pack_map(&e.pk, 2);
    if (req->prompt_kind == DSV4_PROTO_PROMPT_MESSAGES) {
        dsv4_wire_key(&e.pk, "messages");
        dsv4_proto_pack_chat_messages(&e.pk, req->messages, req->n_messages);
        dsv4_wire_key(&e.pk, "thinking");
        dsv4_wire_bool(&e.pk, req->thinking);
    } else {
        dsv4_wire_key(&e.pk, "text");
        dsv4_wire_str(&e.pk, req->text ? req->text : "", req->text ? req->text_len : 0);
        dsv4_wire_key(&e.pk, "add_bos");
        dsv4_wire_bool(&e.pk, req->add_bos);
    }
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_tokenize(const struct dsv4_proto_message *msg, struct dsv4_proto_tokenize *req,
                               struct dsv4_proto_error *err)
{
    const char *ctx = "tokenize";
    const msgpack_object *map, *text, *messages;
    dsv4_proto_tokenize_init(req);
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, tokenize_keys, ARRAY_SIZE(tokenize_keys), true, ctx, err);
    if (rc)
        return rc;
    text = dsv4_wire_get(map, "text");
    messages = dsv4_wire_get(map, "messages");
    if (!text && !messages)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: needs text or messages", ctx);
    if (text && messages)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_PROMPT_CONFLICT, "%s: give text or messages, not both", ctx);
    if (text) {
        req->prompt_kind = DSV4_PROTO_PROMPT_TEXT;
        rc = dsv4_wire_read_str(text, ctx, "text", 0, &req->text, &req->text_len, err);
    } else {
        req->prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
        rc = dsv4_proto_read_chat_messages(messages, ctx, &req->messages, &req->n_messages, err);
    }
    if (rc == 0) rc = dsv4_wire_opt_bool(map, "add_bos", ctx, &req->add_bos, err);
    if (rc == 0) rc = dsv4_wire_opt_bool(map, "thinking", ctx, &req->thinking, err);
    if (rc)
        dsv4_proto_tokenize_clear(req);
    return rc;
}

void dsv4_proto_tokenize_clear(struct dsv4_proto_tokenize *req)
{
    if (!req)
        return;
    free(req->text);
    dsv4_proto_free_chat_messages(req->messages, req->n_messages);
    memset(req, 0, sizeof(*req));
}

static int encode_tokens_map(struct dsv4_wire_enc *e, const struct dsv4_proto_tokens *t)
{
    msgpack_pack_map(&e->pk, 1);
    dsv4_wire_key(&e->pk, "tokens");
    dsv4_wire_tokens(&e->pk, t->tokens, t->n_tokens);
    return dsv4_wire_end(e);
}

static int decode_tokens_map(const struct dsv4_proto_message *msg, const char *ctx, bool strict,
                             struct dsv4_proto_tokens *t, struct dsv4_proto_error *err)
{
    const msgpack_object *map, *o;
    memset(t, 0, sizeof(*t));
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, tokens_keys, 1, strict, ctx, err);
    if (rc)
        return rc;
    if (!(o = dsv4_wire_get(map, "tokens")))
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: no tokens", ctx);
    return dsv4_wire_read_tokens(o, ctx, "tokens", true, &t->tokens, &t->n_tokens, err);
}

int dsv4_proto_encode_tokenize_result(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_tokens *res)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_response(&e, out, msgid);
    return encode_tokens_map(&e, res);
}

int dsv4_proto_decode_tokenize_result(const struct dsv4_proto_message *msg, struct dsv4_proto_tokens *res,
                                      struct dsv4_proto_error *err)
{
    return decode_tokens_map(msg, "tokenize result", false, res, err);
}

int dsv4_proto_encode_detokenize(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_tokens *req)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_request(&e, out, msgid, DSV4_PROTO_METHOD_DETOKENIZE);
    return encode_tokens_map(&e, req);
}

int dsv4_proto_decode_detokenize(const struct dsv4_proto_message *msg, struct dsv4_proto_tokens *req,
                                 struct dsv4_proto_error *err)
{
    return decode_tokens_map(msg, "detokenize", true, req, err);
}

void dsv4_proto_tokens_clear(struct dsv4_proto_tokens *t)
{
    if (!t)
        return;
    free(t->tokens);
    memset(t, 0, sizeof(*t));
}

int dsv4_proto_encode_detokenize_result(struct dsv4_proto_buf *out, uint32_t msgid, const char *text, size_t len)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(&e.pk, 1);
    dsv4_wire_key(&e.pk, "text");
    dsv4_wire_str(&e.pk, text ? text : "", text ? len : 0);
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_detokenize_result(const struct dsv4_proto_message *msg, struct dsv4_proto_text *res,
                                        struct dsv4_proto_error *err)
{
    const char *ctx = "detokenize result";
    const msgpack_object *map, *o;
    memset(res, 0, sizeof(*res));
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, text_keys, 1, false, ctx, err);
    if (rc)
        return rc;
    if (!(o = dsv4_wire_get(map, "text")))
        return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: no text", ctx);
    return dsv4_wire_read_str(o, ctx, "text", 0, &res->text, &res->text_len, err);
}

void dsv4_proto_text_clear(struct dsv4_proto_text *t)
{
    if (!t)
        return;
    free(t->text);
    memset(t, 0, sizeof(*t));
}

/* ---- stats / health ---- */

static int encode_empty_request(struct dsv4_proto_buf *out, uint32_t msgid, enum dsv4_proto_method m)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_request(&e, out, msgid, m);
    msgpack_pack_map(&e.pk, 0);
    return dsv4_wire_end(&e);
}

int dsv4_proto_encode_stats(struct dsv4_proto_buf *out, uint32_t msgid)
{
    return encode_empty_request(out, msgid, DSV4_PROTO_METHOD_STATS);
}

int dsv4_proto_encode_health(struct dsv4_proto_buf *out, uint32_t msgid)
{
    return encode_empty_request(out, msgid, DSV4_PROTO_METHOD_HEALTH);
}

int dsv4_proto_decode_empty_params(const struct dsv4_proto_message *msg, struct dsv4_proto_error *err)
{
    const char *ctx = dsv4_proto_method_name(msg->method);
    const msgpack_object *map;
    int rc = dsv4_proto_body_map(msg, ctx ? ctx : "request", &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, NULL, 0, true, ctx ? ctx : "request", err);
    return rc;
}

/* One table drives the stats map both ways. */
enum stat_type { STAT_U32, STAT_U64, STAT_F64 };
struct stat_field {
    const char *name;
    enum stat_type type;
    size_t offset;
};
#define STAT(name, type) { #name, type, offsetof(struct dsv4_proto_stats, name) }
static const struct stat_field stat_fields[] = {
    STAT(uptime_s, STAT_F64),
    STAT(slots_total, STAT_U32),
    STAT(slots_busy, STAT_U32),
    STAT(queue_depth, STAT_U32),
    STAT(connections, STAT_U32),
    STAT(requests_total, STAT_U64),
    STAT(requests_failed, STAT_U64),
    STAT(requests_cancelled, STAT_U64),
    STAT(prompt_tokens_total, STAT_U64),
    STAT(generated_tokens_total, STAT_U64),
    STAT(prefill_tokens_per_s, STAT_F64),
    STAT(prefill_tokens_total, STAT_U64),
    STAT(prefill_chunks_total, STAT_U64),
    STAT(decode_tokens_per_s, STAT_F64),
    STAT(device_arena_bytes, STAT_U64),
    STAT(device_arena_used, STAT_U64),
    STAT(heap_allocated, STAT_U64),
    STAT(heap_active, STAT_U64),
    STAT(heap_resident, STAT_U64),
    STAT(heap_mapped, STAT_U64),
    STAT(device_allocs_after_boot, STAT_U64),
    STAT(graph_captures_after_boot, STAT_U64),
    STAT(eager_steps, STAT_U64),
    STAT(steps, STAT_U64),
    STAT(decode_steps, STAT_U64),
    STAT(sched_allocations, STAT_U64),
    STAT(sched_allocations_after_boot, STAT_U64),
    STAT(prefix_cache_bytes, STAT_U64),
    STAT(prefix_cache_used_bytes, STAT_U64),
    STAT(prefix_cache_tokens, STAT_U64),
    STAT(prefix_cache_snapshots, STAT_U64),
    STAT(prefix_cache_lookups, STAT_U64),
    STAT(prefix_cache_hits, STAT_U64),
    STAT(prefix_cache_hit_tokens, STAT_U64),
    STAT(prefix_cache_evictions, STAT_U64),
    STAT(spec_tokens, STAT_U32),
    STAT(spec_verifies, STAT_U64),
    STAT(spec_drafted, STAT_U64),
    STAT(spec_accepted, STAT_U64),
    STAT(engine_busy_s, STAT_F64),
    STAT(engine_backend_s, STAT_F64),
    STAT(engine_gap_s, STAT_F64),
    STAT(queue_count, STAT_U64),
    STAT(queue_sum_s, STAT_F64),
    STAT(ttft_count, STAT_U64),
    STAT(ttft_sum_s, STAT_F64),
    STAT(tpot_count, STAT_U64),
    STAT(tpot_sum_s, STAT_F64),
    STAT(e2e_count, STAT_U64),
    STAT(e2e_sum_s, STAT_F64),
};

/* The array keys dsv4_proto_stats_has answers for; their present bits follow stat_fields'. */
static const char *const stat_arrays[] = {
    "batch_size_hist", "spec_accept_hist", "latency_bounds_s", "queue_hist", "ttft_hist", "tpot_hist", "e2e_hist",
};

/* dsv4_proto_stats.present holds a bit per entry of both */
_Static_assert(ARRAY_SIZE(stat_fields) + ARRAY_SIZE(stat_arrays) <= 64, "stats keys outgrew dsv4_proto_stats.present");

/* The latency histograms: each one's buckets and the count they must add up to. */
struct latency_field {
    const char *name, *count_name;
    size_t hist, count;
};
#define LATENCY(h) { #h "_hist", #h "_count", offsetof(struct dsv4_proto_stats, h##_hist), \
                     offsetof(struct dsv4_proto_stats, h##_count) }
static const struct latency_field latency_fields[] = { LATENCY(queue), LATENCY(ttft), LATENCY(tpot), LATENCY(e2e) };
#undef LATENCY

/* An optional array of uint64 under key, at most max entries, into out[*n]. */
static int read_u64_array(const msgpack_object *map, const char *key, const char *ctx, uint32_t max, uint64_t *out,
                          uint32_t *n, struct dsv4_proto_error *err)
{
    const msgpack_object *k = dsv4_wire_get(map, key);
    if (!k)
        return 0;
    if (k->type != MSGPACK_OBJECT_ARRAY)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be an array", ctx, key);
    if (k->via.array.size > max)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %u %s entries, above the limit %u", ctx,
                                    k->via.array.size, key, max);
    for (uint32_t i = 0; i < k->via.array.size; i++) {
        int rc = dsv4_wire_read_u64(&k->via.array.ptr[i], ctx, key, DSV4_PROTO_E_BAD_VALUE, &out[i], err);
        if (rc)
            return rc;
    }
    *n = k->via.array.size;
    return 0;
}
#undef STAT

/* latency_bounds_s (at most DSV4_PROTO_MAX_LATENCY_BOUNDS increasing positive seconds), then each
 * histogram: present, it has one bucket more than the bounds (none without bounds), and its buckets
 * add up to its count when that was sent. A hostile server cannot make a reader index past the
 * bounds or print a histogram that contradicts its count. */
static int read_latency(const msgpack_object *map, const char *ctx, struct dsv4_proto_stats *st,
                        struct dsv4_proto_error *err)
{
    const msgpack_object *k = dsv4_wire_get(map, "latency_bounds_s");
    if (k) {
        if (k->type != MSGPACK_OBJECT_ARRAY)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: latency_bounds_s must be an array", ctx);
        if (k->via.array.size > DSV4_PROTO_MAX_LATENCY_BOUNDS)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %u latency_bounds_s entries, above the "
                                        "limit %u", ctx, k->via.array.size, DSV4_PROTO_MAX_LATENCY_BOUNDS);
        for (uint32_t i = 0; i < k->via.array.size; i++) {
            double v;
            int rc = dsv4_wire_read_num(&k->via.array.ptr[i], ctx, "latency_bounds_s", 0, DBL_MAX,
                                        DSV4_PROTO_E_BAD_VALUE, &v, err);
            if (rc)
                return rc;
            const double prev = i ? st->latency_bounds_s[i - 1] : 0;
            if (v <= prev)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: latency_bounds_s[%u] is %g, must be "
                                            "above %g (the bounds increase from 0)", ctx, i, v, prev);
            st->latency_bounds_s[i] = v;
        }
        st->n_latency_bounds = k->via.array.size;
    }
    const uint32_t want = st->n_latency_bounds ? st->n_latency_bounds + 1 : 0;
    for (size_t f = 0; f < ARRAY_SIZE(latency_fields); f++) {
        const struct latency_field *lf = &latency_fields[f];
        struct dsv4_proto_latency *h = (struct dsv4_proto_latency *)((char *)st + lf->hist);
        int rc = read_u64_array(map, lf->name, ctx, DSV4_PROTO_MAX_LATENCY_BOUNDS + 1, h->buckets, &h->n, err);
        if (rc)
            return rc;
        if (dsv4_wire_get(map, lf->name) && h->n != want)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %s has %u buckets, expected %u (one more "
                                        "than the %u latency_bounds_s)", ctx, lf->name, h->n, want,
                                        st->n_latency_bounds);
        if (!h->n || !dsv4_wire_get(map, lf->count_name))
            continue;
        uint64_t total = 0;
        bool over = false;
        for (uint32_t i = 0; i < h->n && !over; i++) {
            over = h->buckets[i] > UINT64_MAX - total;
            total += over ? 0 : h->buckets[i];
        }
        const uint64_t count = *(const uint64_t *)((const char *)st + lf->count);
        if (over || total != count)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %s buckets add up to %s%llu, %s is %llu",
                                        ctx, lf->name, over ? "more than " : "", (unsigned long long)total,
                                        lf->count_name, (unsigned long long)count);
    }
    return 0;
}

int dsv4_proto_encode_stats_result(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_stats *st)
{
    struct dsv4_wire_enc e;
    msgpack_packer *pk = &e.pk;
    uint32_t nk = st->n_kernels < DSV4_PROTO_MAX_KERNELS ? st->n_kernels : DSV4_PROTO_MAX_KERNELS;
    uint32_t nb = st->n_batch_hist < DSV4_PROTO_MAX_BATCH_BUCKETS ? st->n_batch_hist : DSV4_PROTO_MAX_BATCH_BUCKETS;
    uint32_t ns = st->n_spec_hist < DSV4_PROTO_MAX_SPEC_BUCKETS ? st->n_spec_hist : DSV4_PROTO_MAX_SPEC_BUCKETS;
    uint32_t nl = st->n_latency_bounds < DSV4_PROTO_MAX_LATENCY_BOUNDS ? st->n_latency_bounds
                                                                       : DSV4_PROTO_MAX_LATENCY_BOUNDS;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(pk, ARRAY_SIZE(stat_fields) + 5 + ARRAY_SIZE(latency_fields));
    for (size_t i = 0; i < ARRAY_SIZE(stat_fields); i++) {
        const void *p = (const char *)st + stat_fields[i].offset;
        switch (stat_fields[i].type) {
        case STAT_U32: pack_kv_u32(pk, stat_fields[i].name, *(const uint32_t *)p); break;
        case STAT_U64: pack_kv_u64(pk, stat_fields[i].name, *(const uint64_t *)p); break;
        case STAT_F64: pack_kv_f64(pk, stat_fields[i].name, *(const double *)p); break;
        }
    }
    pack_kv_str(pk, "backend", st->backend);
    dsv4_wire_key(pk, "kernels");
    msgpack_pack_array(pk, nk);
    for (uint32_t i = 0; i < nk; i++)
        dsv4_wire_cstr(pk, st->kernels[i] ? st->kernels[i] : "");
    dsv4_wire_key(pk, "batch_size_hist");
    msgpack_pack_array(pk, nb);
    for (uint32_t i = 0; i < nb; i++)
        msgpack_pack_uint64(pk, st->batch_hist[i]);
    dsv4_wire_key(pk, "spec_accept_hist");
    msgpack_pack_array(pk, ns);
    for (uint32_t i = 0; i < ns; i++)
        msgpack_pack_uint64(pk, st->spec_hist[i]);
    dsv4_wire_key(pk, "latency_bounds_s");
    msgpack_pack_array(pk, nl);
    for (uint32_t i = 0; i < nl; i++)
        msgpack_pack_double(pk, st->latency_bounds_s[i]);
    for (size_t f = 0; f < ARRAY_SIZE(latency_fields); f++) {
        const struct dsv4_proto_latency *h =
            (const struct dsv4_proto_latency *)((const char *)st + latency_fields[f].hist);
        const uint32_t n = h->n < DSV4_PROTO_MAX_LATENCY_BOUNDS + 1 ? h->n : DSV4_PROTO_MAX_LATENCY_BOUNDS + 1;
        dsv4_wire_key(pk, latency_fields[f].name);
        msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n; i++)
            msgpack_pack_uint64(pk, h->buckets[i]);
    }
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_stats_result(const struct dsv4_proto_message *msg, struct dsv4_proto_stats *st,
                                   struct dsv4_proto_error *err)
{
    const char *ctx = "stats result";
    const msgpack_object *map, *k;
    memset(st, 0, sizeof(*st));
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc)
        return rc;
    /* lenient: unknown keys are a newer server's additions */
    for (size_t i = 0; i < ARRAY_SIZE(stat_fields) && rc == 0; i++) {
        void *p = (char *)st + stat_fields[i].offset;
        switch (stat_fields[i].type) {
        case STAT_U32: rc = dsv4_wire_opt_u32(map, stat_fields[i].name, ctx, p, err); break;
        case STAT_U64: rc = dsv4_wire_opt_u64(map, stat_fields[i].name, ctx, p, err); break;
        case STAT_F64: rc = dsv4_wire_opt_f64(map, stat_fields[i].name, ctx, p, err); break;
        }
        if (dsv4_wire_get(map, stat_fields[i].name))
            st->present |= 1ull << i;
    }
    if (rc == 0)
        rc = dsv4_wire_opt_str(map, "backend", ctx, DSV4_PROTO_MAX_NAME, &st->backend, NULL, err);
    if (rc == 0 && (k = dsv4_wire_get(map, "kernels"))) {
        if (k->type != MSGPACK_OBJECT_ARRAY)
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: kernels must be an array", ctx);
        else if (k->via.array.size > DSV4_PROTO_MAX_KERNELS)
            rc = dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %u kernels, above the limit %u", ctx,
                                      k->via.array.size, DSV4_PROTO_MAX_KERNELS);
        for (uint32_t i = 0; rc == 0 && i < k->via.array.size; i++) {
            rc = dsv4_wire_read_str(&k->via.array.ptr[i], ctx, "kernels[]", DSV4_PROTO_MAX_NAME, &st->kernels[i],
                                    NULL, err);
            if (rc == 0)
                st->n_kernels = i + 1;
        }
    }
    if (rc == 0)
        rc = read_u64_array(map, "batch_size_hist", ctx, DSV4_PROTO_MAX_BATCH_BUCKETS, st->batch_hist,
                            &st->n_batch_hist, err);
    if (rc == 0)
        rc = read_u64_array(map, "spec_accept_hist", ctx, DSV4_PROTO_MAX_SPEC_BUCKETS, st->spec_hist,
                            &st->n_spec_hist, err);
    if (rc == 0)
        rc = read_latency(map, ctx, st, err);
    for (size_t i = 0; rc == 0 && i < ARRAY_SIZE(stat_arrays); i++)
        if (dsv4_wire_get(map, stat_arrays[i]))
            st->present |= 1ull << (ARRAY_SIZE(stat_fields) + i);
    if (rc)
        dsv4_proto_stats_clear(st);
    return rc;
}

void dsv4_proto_stats_clear(struct dsv4_proto_stats *st)
{
    if (!st)
        return;
    free(st->backend);
    for (uint32_t i = 0; i < st->n_kernels && i < DSV4_PROTO_MAX_KERNELS; i++)
        free(st->kernels[i]);
    memset(st, 0, sizeof(*st));
}

bool dsv4_proto_stats_has(const struct dsv4_proto_stats *st, const char *key)
{
    for (size_t i = 0; i < ARRAY_SIZE(stat_fields); i++)
        if (strcmp(stat_fields[i].name, key) == 0)
            return st->present >> i & 1;
    for (size_t i = 0; i < ARRAY_SIZE(stat_arrays); i++)
        if (strcmp(stat_arrays[i], key) == 0)
            return st->present >> (ARRAY_SIZE(stat_fields) + i) & 1;
    return false;
}

static const char *const health_names[] = {
    [DSV4_PROTO_HEALTH_READY] = "ready",
    [DSV4_PROTO_HEALTH_LOADING] = "loading",
    [DSV4_PROTO_HEALTH_DRAINING] = "draining",
    [DSV4_PROTO_HEALTH_FAILED] = "failed",
    [DSV4_PROTO_HEALTH_UNKNOWN] = "unknown",
};
static const char *const health_keys[] = { "status", "reason" };

const char *dsv4_proto_health_name(enum dsv4_proto_health_status s)
{
    return (unsigned)s < ARRAY_SIZE(health_names) ? health_names[s] : "unknown";
}

int dsv4_proto_health_from_name(const char *name)
{
    for (size_t i = 0; i < ARRAY_SIZE(health_names); i++)
        if (strcmp(name, health_names[i]) == 0)
            return (int)i;
    return -1;
}

int dsv4_proto_encode_health_result(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_health *h)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(&e.pk, 2);
    pack_kv_str(&e.pk, "status", dsv4_proto_health_name(h->status));
    pack_kv_str(&e.pk, "reason", h->reason);
    return dsv4_wire_end(&e);
}

int dsv4_proto_decode_health_result(const struct dsv4_proto_message *msg, struct dsv4_proto_health *h,
                                    struct dsv4_proto_error *err)
{
    const char *ctx = "health result";
    const msgpack_object *map;
    char *status = NULL;
    memset(h, 0, sizeof(*h));
    int rc = dsv4_proto_body_map(msg, ctx, &map, err);
    if (rc == 0)
        rc = dsv4_wire_check_keys(map, health_keys, ARRAY_SIZE(health_keys), false, ctx, err);
    if (rc == 0 && !dsv4_wire_get(map, "status"))
        rc = dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "%s: no status", ctx);
    if (rc == 0)
        rc = dsv4_wire_opt_str(map, "status", ctx, DSV4_PROTO_MAX_NAME, &status, NULL, err);
    if (rc == 0) {
        /* New statuses come without a version change (doc/PROTOCOL.md section 7): one this build does not
         * know is an answer meaning not ready, not a malformed reply. */
        int s = dsv4_proto_health_from_name(status);
        h->status = s < 0 ? DSV4_PROTO_HEALTH_UNKNOWN : (enum dsv4_proto_health_status)s;
    }
    free(status);
    if (rc == 0)
        rc = dsv4_wire_opt_str(map, "reason", ctx, DSV4_PROTO_ERROR_MESSAGE_MAX, &h->reason, NULL, err);
    if (rc)
        dsv4_proto_health_clear(h);
    return rc;
}

void dsv4_proto_health_clear(struct dsv4_proto_health *h)
{
    if (!h)
        return;
    free(h->reason);
    memset(h, 0, sizeof(*h));
}
