/* SPDX-License-Identifier: MIT */
/* protocol: every message round-trips (encode -> frames -> reader -> validate -> decode) on fresh random
 * contents, and the decoded struct equals the one encoded, field by field. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "protocol/message.h"
#include "protocol/message_codec.h"

#define ROUNDS 40

static uint64_t rng_state;

static uint64_t rnd(void)
{
    /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t rnd_below(uint32_t n)
{
    return (uint32_t)(rnd() % n);
}

static float rnd_float(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd() >> 40) / (float)(1u << 24);
}

/* Random valid UTF-8 of up to max_chars code points, every encoded length represented. */
static char *rnd_utf8(uint32_t max_chars, size_t *ret_len)
{
    uint32_t n = rnd_below(max_chars + 1);
    char *s = malloc((size_t)n * 4 + 1);
    size_t k = 0;
    assert_non_null(s);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t cp;
        switch (rnd_below(4)) {
        case 0: cp = 0x20 + rnd_below(0x5f); break;
        case 1: cp = 0x80 + rnd_below(0x780); break;
        case 2: cp = 0x800 + rnd_below(0xd800 - 0x800); break;
        default: cp = 0x10000 + rnd_below(0x100000); break;
        }
        if (cp < 0x80) {
            s[k++] = (char)cp;
        } else if (cp < 0x800) {
            s[k++] = (char)(0xc0 | cp >> 6);
            s[k++] = (char)(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
            s[k++] = (char)(0xe0 | cp >> 12);
            s[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
            s[k++] = (char)(0x80 | (cp & 0x3f));
        } else {
            s[k++] = (char)(0xf0 | cp >> 18);
            s[k++] = (char)(0x80 | ((cp >> 12) & 0x3f));
            s[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
            s[k++] = (char)(0x80 | (cp & 0x3f));
        }
    }
    s[k] = '\0';
    if (ret_len)
        *ret_len = k;
    return s;
}

static int32_t *rnd_tokens(uint32_t n)
{
    int32_t *t = malloc((size_t)n * sizeof(*t) + 1);
    assert_non_null(t);
    for (uint32_t i = 0; i < n; i++)
        t[i] = (int32_t)rnd_below(129280);
    return t;
}

/* Decode the single frame in buf: the header must announce exactly the payload. */
static void decode_frame(const struct dsv4_proto_buf *buf, const struct dsv4_proto_limits *lim,
                         struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_validate_info info;
    assert_true(buf->len > DSV4_PROTO_FRAME_HEADER);
    assert_int_equal(dsv4_proto_frame_get_header(buf->data), buf->len - DSV4_PROTO_FRAME_HEADER);
    assert_int_equal(dsv4_proto_validate(buf->data + 4, buf->len - 4, lim, &info, &err), 0);
    assert_true(info.elements >= 4);
    int rc = dsv4_proto_message_decode(buf->data + 4, buf->len - 4, lim, msg, &err);
    if (rc)
        fail_msg("decode: %s (%d)", err.message, err.code);
}

static void server_limits(struct dsv4_proto_limits *lim)
{
    dsv4_proto_limits_server(lim);
}

static void client_limits(struct dsv4_proto_limits *lim)
{
    dsv4_proto_limits_client(lim);
}

static void assert_request(const struct dsv4_proto_message *msg, uint32_t msgid, enum dsv4_proto_method m)
{
    assert_int_equal(msg->kind, DSV4_PROTO_REQUEST);
    assert_true(msg->has_msgid);
    assert_int_equal(msg->msgid, msgid);
    assert_int_equal(msg->method, m);
}

static void assert_response(const struct dsv4_proto_message *msg, uint32_t msgid)
{
    assert_int_equal(msg->kind, DSV4_PROTO_RESPONSE);
    assert_int_equal(msg->msgid, msgid);
    assert_false(msg->has_error);
}

static void assert_bytes(const char *a, size_t alen, const char *b, size_t blen)
{
    assert_int_equal(alen, blen);
    assert_memory_equal(a, b, alen);
    assert_int_equal(b[blen], '\0');
}

static void test_hello(void **state)
{
    struct dsv4_proto_limits sl, cl;
    server_limits(&sl);
    client_limits(&cl);
    for (int r = 0; r < ROUNDS; r++) {
        struct dsv4_proto_buf buf = { 0 };
        struct dsv4_proto_message msg;
        struct dsv4_proto_error err;
        uint32_t msgid = (uint32_t)rnd();
        struct dsv4_proto_hello req = { .protocol = 1 + rnd_below(5), .client = r % 2 ? rnd_utf8(20, NULL) : NULL };
        struct dsv4_proto_hello got;
        assert_int_equal(dsv4_proto_encode_hello(&buf, msgid, &req), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_HELLO);
        assert_int_equal(dsv4_proto_decode_hello(&msg, &got, &err), 0);
        assert_int_equal(got.protocol, req.protocol);
        if (req.client)
            assert_string_equal(got.client, req.client);
        else
            assert_null(got.client);
        uint32_t v;
        assert_int_equal(dsv4_proto_hello_negotiate(&got, &v, &err), 0);
        assert_int_equal(v, req.protocol < DSV4_PROTO_VERSION ? req.protocol : DSV4_PROTO_VERSION);
        dsv4_proto_hello_clear(&got);
        dsv4_proto_message_clear(&msg);

        struct dsv4_proto_hello_result res = {
            .protocol = DSV4_PROTO_VERSION,
            .server = rnd_utf8(30, NULL),
            .model = { .name = rnd_utf8(30, NULL), .vocab_size = (uint32_t)rnd(), .hidden_size = (uint32_t)rnd(),
                       .num_layers = rnd_below(100), .num_heads = rnd_below(256), .head_dim = rnd_below(1024),
                       .n_routed_experts = rnd_below(512), .experts_per_token = rnd_below(16),
                       .bos_id = (int32_t)rnd_below(1000), .eos_id = (int32_t)rnd_below(1000) - 1 },
            .max_context = (uint32_t)rnd(), .max_batch = rnd_below(256), .backend = rnd_utf8(8, NULL),
            .limits = { (uint32_t)rnd(), (uint32_t)rnd(), (uint32_t)rnd(), (uint32_t)rnd(), (uint32_t)rnd(),
                        (uint32_t)rnd() },
        };
        struct dsv4_proto_hello_result gr;
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_hello_result(&buf, msgid, &res), 0);
        decode_frame(&buf, &cl, &msg);
        assert_response(&msg, msgid);
        assert_int_equal(dsv4_proto_decode_hello_result(&msg, &gr, &err), 0);
        assert_int_equal(gr.protocol, res.protocol);
        assert_string_equal(gr.server, res.server);
        assert_string_equal(gr.model.name, res.model.name);
        assert_string_equal(gr.backend, res.backend);
        assert_int_equal(gr.model.vocab_size, res.model.vocab_size);
        assert_int_equal(gr.model.hidden_size, res.model.hidden_size);
        assert_int_equal(gr.model.num_layers, res.model.num_layers);
        assert_int_equal(gr.model.num_heads, res.model.num_heads);
        assert_int_equal(gr.model.head_dim, res.model.head_dim);
        assert_int_equal(gr.model.n_routed_experts, res.model.n_routed_experts);
        assert_int_equal(gr.model.experts_per_token, res.model.experts_per_token);
        assert_int_equal(gr.model.bos_id, res.model.bos_id);
        assert_int_equal(gr.model.eos_id, res.model.eos_id);
        assert_int_equal(gr.max_context, res.max_context);
        assert_int_equal(gr.max_batch, res.max_batch);
        assert_memory_equal(&gr.limits, &res.limits, sizeof(res.limits));
        dsv4_proto_hello_result_clear(&gr);
        dsv4_proto_message_clear(&msg);
        free(res.server);
        free(res.model.name);
        free(res.backend);
        free(req.client);
        dsv4_proto_buf_clear(&buf);
    }
}

static void rnd_messages(struct dsv4_proto_chat_message **ret, uint32_t *ret_n)
{
    uint32_t n = 1 + rnd_below(6);
    struct dsv4_proto_chat_message *m = calloc(n, sizeof(*m));
    assert_non_null(m);
    for (uint32_t i = 0; i < n; i++) {
        m[i].role = (enum dsv4_proto_role)rnd_below(3);
        m[i].content = rnd_utf8(100, &m[i].content_len);
    }
    *ret = m;
    *ret_n = n;
}

static void assert_messages(const struct dsv4_proto_chat_message *a, uint32_t na,
                            const struct dsv4_proto_chat_message *b, uint32_t nb)
{
    assert_int_equal(na, nb);
    for (uint32_t i = 0; i < na; i++) {
        assert_int_equal(a[i].role, b[i].role);
        assert_bytes(a[i].content, a[i].content_len, b[i].content, b[i].content_len);
    }
}

static void free_messages(struct dsv4_proto_chat_message *m, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        free(m[i].content);
    free(m);
}

static void test_generate(void **state)
{
    struct dsv4_proto_limits sl;
    server_limits(&sl);
    for (int r = 0; r < 4 * ROUNDS; r++) {
        struct dsv4_proto_buf buf = { 0 };
        struct dsv4_proto_message msg;
        struct dsv4_proto_error err;
        struct dsv4_proto_generate req, got;
        uint32_t msgid = (uint32_t)rnd();
        dsv4_proto_generate_init(&req);
        req.prompt_kind = (enum dsv4_proto_prompt_kind)(1 + r % 4);
        switch (req.prompt_kind) {
        case DSV4_PROTO_PROMPT_TEXT:
            req.prompt = rnd_utf8(300, &req.prompt_len);
            req.add_bos = rnd_below(2);
            break;
        case DSV4_PROTO_PROMPT_MESSAGES:
            rnd_messages(&req.messages, &req.n_messages);
            req.thinking = rnd_below(2);
            break;
        case DSV4_PROTO_PROMPT_PARTS:
            req.n_parts = 1 + rnd_below(9);
            req.parts = calloc(req.n_parts, sizeof(*req.parts));
            req.part_lens = calloc(req.n_parts, sizeof(*req.part_lens));
            assert_non_null(req.parts);
            assert_non_null(req.part_lens);
            for (uint32_t i = 0; i < req.n_parts; i++)
                req.parts[i] = rnd_utf8(60, &req.part_lens[i]);
            req.add_bos = rnd_below(2);
            break;
        default:
            req.n_tokens = 1 + rnd_below(500);
            req.tokens = rnd_tokens(req.n_tokens);
            break;
        }
        req.stream = rnd_below(2);
        struct dsv4_proto_sampling *s = &req.sampling;
        s->max_tokens = rnd_below(DSV4_PROTO_MAX_MAX_TOKENS + 1);
        s->temperature = rnd_float(0, DSV4_PROTO_MAX_TEMPERATURE);
        s->top_p = rnd_float(0, 1);
        s->top_k = (int32_t)rnd_below(1000);
        s->min_p = rnd_float(0, 1);
        s->presence_penalty = rnd_float(-2, 2);
        s->frequency_penalty = rnd_float(-2, 2);
        s->repetition_penalty = rnd_float(0.01f, 10);
        s->has_seed = rnd_below(2);
        s->seed = rnd();
        s->n_stop = rnd_below(DSV4_PROTO_MAX_STOP + 1);
        for (uint32_t i = 0; i < s->n_stop; i++) {
            size_t n;
            do {
                free(s->stop[i]);
                s->stop[i] = rnd_utf8(40, &n);
            } while (n == 0 || n > DSV4_PROTO_MAX_STOP_LEN);
        }
        s->n_stop_token_ids = rnd_below(DSV4_PROTO_MAX_STOP_TOKEN_IDS + 1);
        for (uint32_t i = 0; i < s->n_stop_token_ids; i++)
            s->stop_token_ids[i] = (int32_t)rnd_below(129280);
        s->logprobs = (int32_t)rnd_below(DSV4_PROTO_MAX_LOGPROBS + 2) - 1;

        assert_int_equal(dsv4_proto_encode_generate(&buf, msgid, &req), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_GENERATE);
        if (dsv4_proto_decode_generate(&msg, &got, &err))
            fail_msg("decode_generate: %s", err.message);
        assert_int_equal(got.prompt_kind, req.prompt_kind);
        switch (req.prompt_kind) {
        case DSV4_PROTO_PROMPT_TEXT:
            assert_bytes(req.prompt, req.prompt_len, got.prompt, got.prompt_len);
            assert_int_equal(got.add_bos, req.add_bos);
            break;
        case DSV4_PROTO_PROMPT_MESSAGES:
            assert_messages(req.messages, req.n_messages, got.messages, got.n_messages);
            assert_int_equal(got.thinking, req.thinking);
            break;
        case DSV4_PROTO_PROMPT_PARTS:
            assert_int_equal(got.n_parts, req.n_parts);
            for (uint32_t i = 0; i < req.n_parts; i++)
                assert_bytes(req.parts[i], req.part_lens[i], got.parts[i], got.part_lens[i]);
            assert_int_equal(got.add_bos, req.add_bos);
            break;
        default:
            assert_int_equal(got.n_tokens, req.n_tokens);
            assert_memory_equal(got.tokens, req.tokens, req.n_tokens * sizeof(int32_t));
            break;
        }
        assert_int_equal(got.stream, req.stream);
        const struct dsv4_proto_sampling *g = &got.sampling;
        assert_int_equal(g->max_tokens, s->max_tokens);
        assert_true(g->temperature == s->temperature);
        assert_true(g->top_p == s->top_p);
        assert_int_equal(g->top_k, s->top_k);
        assert_true(g->min_p == s->min_p);
        assert_true(g->presence_penalty == s->presence_penalty);
        assert_true(g->frequency_penalty == s->frequency_penalty);
        assert_true(g->repetition_penalty == s->repetition_penalty);
        assert_int_equal(g->has_seed, s->has_seed);
        if (s->has_seed)
            assert_true(g->seed == s->seed);
        assert_int_equal(g->n_stop, s->n_stop);
        for (uint32_t i = 0; i < s->n_stop; i++)
            assert_string_equal(g->stop[i], s->stop[i]);
        assert_int_equal(g->n_stop_token_ids, s->n_stop_token_ids);
        assert_memory_equal(g->stop_token_ids, s->stop_token_ids, s->n_stop_token_ids * sizeof(int32_t));
        assert_int_equal(g->logprobs, s->logprobs);

        struct dsv4_proto_model_limits ml = { .vocab_size = 129280, .max_context = 1u << 20 };
        assert_int_equal(dsv4_proto_check_generate(&got, &ml, &err), 0);

        dsv4_proto_generate_clear(&got);
        dsv4_proto_message_clear(&msg);
        free(req.prompt);
        free(req.tokens);
        for (uint32_t i = 0; i < req.n_parts; i++)
            free(req.parts[i]);
        free(req.parts);
        free(req.part_lens);
        free_messages(req.messages, req.n_messages);
        for (uint32_t i = 0; i < s->n_stop; i++)
            free(s->stop[i]);
        dsv4_proto_buf_clear(&buf);
    }
}

/* Absent fields decode to the documented defaults. */
static void test_generate_defaults(void **state)
{
    struct dsv4_proto_limits sl;
    struct dsv4_proto_buf buf = { 0 };
    struct dsv4_proto_message msg;
    struct dsv4_proto_error err;
    struct dsv4_proto_generate got;
    struct dsv4_proto_sampling def;
    /* [0, 7, "generate", [{"prompt": "hi"}]] packed by hand */
    static const uint8_t frame[] = { 0x94, 0x00, 0x07, 0xa8, 'g', 'e', 'n', 'e', 'r', 'a', 't', 'e',
                                     0x91, 0x81, 0xa6, 'p', 'r', 'o', 'm', 'p', 't', 0xa2, 'h', 'i' };
    server_limits(&sl);
    assert_int_equal(dsv4_proto_message_decode(frame, sizeof(frame), &sl, &msg, &err), 0);
    assert_int_equal(dsv4_proto_decode_generate(&msg, &got, &err), 0);
    dsv4_proto_sampling_default(&def);
    assert_string_equal(got.prompt, "hi");
    assert_true(got.add_bos);
    assert_false(got.stream);
    assert_false(got.thinking);
    assert_int_equal(got.sampling.max_tokens, 0);
    struct dsv4_proto_model_limits ml = { .max_tokens = 100 };
    assert_int_equal(dsv4_proto_effective_max_tokens(&got.sampling, &ml), 100);
    assert_int_equal(dsv4_proto_check_generate(&got, &ml, &err), 0);
    ml.max_tokens = 0;
    assert_int_equal(dsv4_proto_effective_max_tokens(&got.sampling, &ml), DSV4_PROTO_DEFAULT_MAX_TOKENS);
    assert_true(got.sampling.temperature == DSV4_PROTO_DEFAULT_TEMPERATURE);
    assert_true(got.sampling.top_p == DSV4_PROTO_DEFAULT_TOP_P);
    assert_int_equal(got.sampling.top_k, 0);
    assert_true(got.sampling.repetition_penalty == DSV4_PROTO_DEFAULT_REPETITION_PENALTY);
    assert_false(got.sampling.has_seed);
    assert_int_equal(got.sampling.logprobs, -1);
    assert_memory_equal(&got.sampling, &def, sizeof(def));
    dsv4_proto_generate_clear(&got);
    dsv4_proto_message_clear(&msg);
    dsv4_proto_buf_clear(&buf);
}

static void rnd_logprob(struct dsv4_proto_logprob *lp)
{
    lp->logprob = -rnd_float(0, 30);
    lp->n_top = rnd_below(DSV4_PROTO_MAX_LOGPROBS + 1);
    for (uint32_t i = 0; i < lp->n_top; i++) {
        lp->top_ids[i] = (int32_t)rnd_below(129280);
        lp->top_logprobs[i] = i == 3 ? -INFINITY : -rnd_float(0, 30);
    }
}

static void assert_logprob(const struct dsv4_proto_logprob *a, const struct dsv4_proto_logprob *b)
{
    assert_true(a->logprob == b->logprob);
    assert_int_equal(a->n_top, b->n_top);
    for (uint32_t i = 0; i < a->n_top; i++) {
        assert_int_equal(a->top_ids[i], b->top_ids[i]);
        assert_true(a->top_logprobs[i] == b->top_logprobs[i]);
    }
}

static void test_token_and_result(void **state)
{
    struct dsv4_proto_limits cl;
    client_limits(&cl);
    for (int r = 0; r < ROUNDS; r++) {
        struct dsv4_proto_buf buf = { 0 };
        struct dsv4_proto_message msg;
        struct dsv4_proto_error err;
        struct dsv4_proto_token_event ev = { .msgid = (uint32_t)rnd(), .token = (int32_t)rnd_below(129280) }, ge;
        ev.text = rnd_utf8(4, &ev.text_len);
        ev.has_logprob = r % 2;
        if (ev.has_logprob)
            rnd_logprob(&ev.logprob);
        assert_int_equal(dsv4_proto_encode_token(&buf, &ev), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(msg.kind, DSV4_PROTO_NOTIFICATION);
        assert_int_equal(msg.method, DSV4_PROTO_NOTIFY_TOKEN);
        assert_int_equal(dsv4_proto_decode_token(&msg, &ge, &err), 0);
        assert_int_equal(ge.msgid, ev.msgid);
        assert_int_equal(ge.token, ev.token);
        assert_bytes(ev.text, ev.text_len, ge.text, ge.text_len);
        assert_int_equal(ge.has_logprob, ev.has_logprob);
        if (ev.has_logprob)
            assert_logprob(&ev.logprob, &ge.logprob);
        dsv4_proto_token_event_clear(&ge);
        dsv4_proto_message_clear(&msg);
        free(ev.text);

        struct dsv4_proto_generate_result res = { 0 }, gr;
        uint32_t msgid = (uint32_t)rnd();
        res.text = rnd_utf8(400, &res.text_len);
        res.n_tokens = rnd_below(300);
        res.tokens = rnd_tokens(res.n_tokens);
        res.finish_reason = (enum dsv4_proto_finish)rnd_below(4);
        if (res.finish_reason == DSV4_PROTO_FINISH_ERROR)
            res.error_message = rnd_utf8(40, NULL);
        res.usage.prompt_tokens = (uint32_t)rnd();
        res.usage.completion_tokens = res.n_tokens;
        res.usage.cached_tokens = (uint32_t)rnd();
        res.timings = (struct dsv4_proto_timings){ rnd_float(0, 1e4f), rnd_float(0, 1e4f), rnd_float(0, 1e5f),
                                                   rnd_float(0, 1e6f), rnd_float(0, 1e4f) };
        if (r % 3 == 0) {
            res.logprobs = calloc(res.n_tokens + 1, sizeof(*res.logprobs));
            assert_non_null(res.logprobs);
            for (uint32_t i = 0; i < res.n_tokens; i++)
                rnd_logprob(&res.logprobs[i]);
        }
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_generate_result(&buf, msgid, &res), 0);
        decode_frame(&buf, &cl, &msg);
        assert_response(&msg, msgid);
        if (dsv4_proto_decode_generate_result(&msg, &gr, &err))
            fail_msg("decode_generate_result: %s", err.message);
        assert_bytes(res.text, res.text_len, gr.text, gr.text_len);
        assert_int_equal(gr.n_tokens, res.n_tokens);
        assert_memory_equal(gr.tokens, res.tokens, res.n_tokens * sizeof(int32_t));
        assert_int_equal(gr.finish_reason, res.finish_reason);
        if (res.error_message)
            assert_string_equal(gr.error_message, res.error_message);
        else
            assert_null(gr.error_message);
        assert_int_equal(gr.usage.prompt_tokens, res.usage.prompt_tokens);
        assert_int_equal(gr.usage.completion_tokens, res.usage.completion_tokens);
        assert_int_equal(gr.usage.cached_tokens, res.usage.cached_tokens);
        assert_true(gr.timings.queue_ms == res.timings.queue_ms);
        assert_true(gr.timings.prefill_ms == res.timings.prefill_ms);
        assert_true(gr.timings.decode_ms == res.timings.decode_ms);
        assert_true(gr.timings.total_ms == res.timings.total_ms);
        assert_true(gr.timings.decode_tokens_per_s == res.timings.decode_tokens_per_s);
        assert_int_equal(gr.logprobs != NULL, res.logprobs != NULL);
        for (uint32_t i = 0; res.logprobs && i < res.n_tokens; i++)
            assert_logprob(&res.logprobs[i], &gr.logprobs[i]);
        dsv4_proto_generate_result_clear(&gr);
        dsv4_proto_message_clear(&msg);
        free(res.text);
        free(res.tokens);
        free(res.error_message);
        free(res.logprobs);
        dsv4_proto_buf_clear(&buf);
    }
}

static void test_small_methods(void **state)
{
    struct dsv4_proto_limits sl, cl;
    server_limits(&sl);
    client_limits(&cl);
    for (int r = 0; r < ROUNDS; r++) {
        struct dsv4_proto_buf buf = { 0 };
        struct dsv4_proto_message msg;
        struct dsv4_proto_error err;
        uint32_t msgid = (uint32_t)rnd();

        /* cancel */
        struct dsv4_proto_cancel c = { (uint32_t)rnd() }, gc;
        bool cancelled = r % 2, gcan;
        assert_int_equal(dsv4_proto_encode_cancel(&buf, msgid, &c), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_CANCEL);
        assert_int_equal(dsv4_proto_decode_cancel(&msg, &gc, &err), 0);
        assert_int_equal(gc.msgid, c.msgid);
        dsv4_proto_message_clear(&msg);
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_cancel_result(&buf, msgid, cancelled), 0);
        decode_frame(&buf, &cl, &msg);
        assert_response(&msg, msgid);
        assert_int_equal(dsv4_proto_decode_cancel_result(&msg, &gcan, &err), 0);
        assert_int_equal(gcan, cancelled);
        dsv4_proto_message_clear(&msg);

        /* tokenize, both prompt kinds */
        struct dsv4_proto_tokenize tk, gt;
        dsv4_proto_tokenize_init(&tk);
        if (r % 2) {
            tk.prompt_kind = DSV4_PROTO_PROMPT_TEXT;
            tk.text = rnd_utf8(200, &tk.text_len);
            tk.add_bos = rnd_below(2);
        } else {
            tk.prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
            rnd_messages(&tk.messages, &tk.n_messages);
            tk.thinking = rnd_below(2);
        }
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_tokenize(&buf, msgid, &tk), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_TOKENIZE);
        assert_int_equal(dsv4_proto_decode_tokenize(&msg, &gt, &err), 0);
        assert_int_equal(gt.prompt_kind, tk.prompt_kind);
        if (r % 2) {
            assert_bytes(tk.text, tk.text_len, gt.text, gt.text_len);
            assert_int_equal(gt.add_bos, tk.add_bos);
        } else {
            assert_messages(tk.messages, tk.n_messages, gt.messages, gt.n_messages);
            assert_int_equal(gt.thinking, tk.thinking);
        }
        dsv4_proto_tokenize_clear(&gt);
        dsv4_proto_message_clear(&msg);
        free(tk.text);
        free_messages(tk.messages, tk.n_messages);

        /* tokens both ways: tokenize result and detokenize request, the empty array included */
        struct dsv4_proto_tokens t = { .n_tokens = r == 0 ? 0 : rnd_below(2000) }, gtk;
        t.tokens = rnd_tokens(t.n_tokens);
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_tokenize_result(&buf, msgid, &t), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_tokenize_result(&msg, &gtk, &err), 0);
        assert_int_equal(gtk.n_tokens, t.n_tokens);
        assert_memory_equal(gtk.tokens, t.tokens, t.n_tokens * sizeof(int32_t));
        dsv4_proto_tokens_clear(&gtk);
        dsv4_proto_message_clear(&msg);
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_detokenize(&buf, msgid, &t), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_DETOKENIZE);
        assert_int_equal(dsv4_proto_decode_detokenize(&msg, &gtk, &err), 0);
        assert_int_equal(gtk.n_tokens, t.n_tokens);
        assert_memory_equal(gtk.tokens, t.tokens, t.n_tokens * sizeof(int32_t));
        assert_int_equal(dsv4_proto_check_token_ids(gtk.tokens, gtk.n_tokens, 129280, "tokens", &err), 0);
        dsv4_proto_tokens_clear(&gtk);
        dsv4_proto_message_clear(&msg);
        free(t.tokens);

        struct dsv4_proto_text txt;
        size_t tl;
        char *text = rnd_utf8(300, &tl);
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_detokenize_result(&buf, msgid, text, tl), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_detokenize_result(&msg, &txt, &err), 0);
        assert_bytes(text, tl, txt.text, txt.text_len);
        dsv4_proto_text_clear(&txt);
        dsv4_proto_message_clear(&msg);
        free(text);

        /* stats and health: requests carry no params */
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_stats(&buf, msgid), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_STATS);
        assert_int_equal(dsv4_proto_decode_empty_params(&msg, &err), 0);
        dsv4_proto_message_clear(&msg);
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_health(&buf, msgid), 0);
        decode_frame(&buf, &sl, &msg);
        assert_request(&msg, msgid, DSV4_PROTO_METHOD_HEALTH);
        assert_int_equal(dsv4_proto_decode_empty_params(&msg, &err), 0);
        dsv4_proto_message_clear(&msg);

        struct dsv4_proto_stats st = { 0 }, gs;
        st.uptime_s = rnd_float(0, 1e6f);
        st.backend = rnd_utf8(6, NULL);
        st.slots_total = (uint32_t)rnd();
        st.slots_busy = (uint32_t)rnd();
        st.queue_depth = (uint32_t)rnd();
        st.connections = (uint32_t)rnd();
        st.requests_total = rnd();
        st.requests_failed = rnd();
        st.requests_cancelled = rnd();
        st.prompt_tokens_total = rnd();
        st.generated_tokens_total = rnd();
        st.prefill_tokens_per_s = rnd_float(0, 1e5f);
        st.decode_tokens_per_s = rnd_float(0, 1e4f);
        st.prefill_tokens_total = rnd();
        st.prefill_chunks_total = rnd();
        st.device_arena_bytes = rnd();
        st.device_arena_used = rnd();
        st.heap_allocated = rnd();
        st.heap_active = rnd();
        st.heap_resident = rnd();
        st.heap_mapped = rnd();
        st.device_allocs_after_boot = rnd();
        st.graph_captures_after_boot = rnd();
        st.eager_steps = rnd();
        st.steps = rnd();
        st.decode_steps = rnd();
        st.n_batch_hist = rnd_below(DSV4_PROTO_MAX_BATCH_BUCKETS + 1);
        for (uint32_t i = 0; i < st.n_batch_hist; i++)
            st.batch_hist[i] = rnd();
        st.sched_allocations = rnd();
        st.sched_allocations_after_boot = rnd();
        st.prefix_cache_bytes = rnd();
        st.prefix_cache_used_bytes = rnd();
        st.prefix_cache_tokens = rnd();
        st.prefix_cache_snapshots = rnd();
        st.prefix_cache_lookups = rnd();
        st.prefix_cache_hits = rnd();
        st.prefix_cache_hit_tokens = rnd();
        st.prefix_cache_evictions = rnd();
        st.spec_tokens = (uint32_t)rnd_below(4);
        st.spec_verifies = rnd();
        st.spec_drafted = rnd();
        st.spec_accepted = rnd();
        st.n_spec_hist = rnd_below(DSV4_PROTO_MAX_SPEC_BUCKETS + 1);
        for (uint32_t i = 0; i < st.n_spec_hist; i++)
            st.spec_hist[i] = rnd();
        st.engine_busy_s = rnd_float(0, 1e6f);
        st.engine_backend_s = rnd_float(0, 1e6f);
        st.engine_gap_s = rnd_float(0, 1e3f);
        st.n_latency_bounds = rnd_below(DSV4_PROTO_MAX_LATENCY_BOUNDS + 1);
        for (uint32_t i = 0; i < st.n_latency_bounds; i++)
            st.latency_bounds_s[i] = (i ? st.latency_bounds_s[i - 1] : 0) + rnd_float(1e-4f, 10.0f);
        struct dsv4_proto_latency *lat[] = { &st.queue_hist, &st.ttft_hist, &st.tpot_hist, &st.e2e_hist };
        uint64_t *lat_count[] = { &st.queue_count, &st.ttft_count, &st.tpot_count, &st.e2e_count };
        double *lat_sum[] = { &st.queue_sum_s, &st.ttft_sum_s, &st.tpot_sum_s, &st.e2e_sum_s };
        for (int h = 0; h < 4; h++) {
            lat[h]->n = st.n_latency_bounds ? st.n_latency_bounds + 1 : 0;
            for (uint32_t i = 0; i < lat[h]->n; i++) {
                lat[h]->buckets[i] = rnd_below(1u << 20);
                *lat_count[h] += lat[h]->buckets[i];
            }
            *lat_sum[h] = rnd_float(0, 1e6f);
        }
        st.n_kernels = rnd_below(DSV4_PROTO_MAX_KERNELS + 1);
        for (uint32_t i = 0; i < st.n_kernels; i++)
            st.kernels[i] = rnd_utf8(20, NULL);
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_stats_result(&buf, msgid, &st), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_stats_result(&msg, &gs, &err), 0);
        assert_true(dsv4_proto_stats_has(&gs, "uptime_s") && dsv4_proto_stats_has(&gs, "engine_gap_s")
                    && dsv4_proto_stats_has(&gs, "prefix_cache_hits"));
        assert_true(dsv4_proto_stats_has(&gs, "latency_bounds_s") && dsv4_proto_stats_has(&gs, "ttft_hist")
                    && dsv4_proto_stats_has(&gs, "e2e_count") && dsv4_proto_stats_has(&gs, "tpot_sum_s")
                    && dsv4_proto_stats_has(&gs, "batch_size_hist"));
        assert_true(gs.uptime_s == st.uptime_s);
        assert_string_equal(gs.backend, st.backend);
        assert_int_equal(gs.slots_total, st.slots_total);
        assert_int_equal(gs.slots_busy, st.slots_busy);
        assert_int_equal(gs.queue_depth, st.queue_depth);
        assert_int_equal(gs.connections, st.connections);
        assert_true(gs.requests_total == st.requests_total);
        assert_true(gs.requests_failed == st.requests_failed);
        assert_true(gs.requests_cancelled == st.requests_cancelled);
        assert_true(gs.prompt_tokens_total == st.prompt_tokens_total);
        assert_true(gs.generated_tokens_total == st.generated_tokens_total);
        assert_true(gs.prefill_tokens_per_s == st.prefill_tokens_per_s);
        assert_true(gs.decode_tokens_per_s == st.decode_tokens_per_s);
        assert_true(gs.prefill_tokens_total == st.prefill_tokens_total);
        assert_true(gs.prefill_chunks_total == st.prefill_chunks_total);
        assert_true(gs.device_arena_bytes == st.device_arena_bytes);
        assert_true(gs.device_arena_used == st.device_arena_used);
        assert_true(gs.heap_allocated == st.heap_allocated);
        assert_true(gs.heap_active == st.heap_active);
        assert_true(gs.heap_resident == st.heap_resident);
        assert_true(gs.heap_mapped == st.heap_mapped);
        assert_true(gs.device_allocs_after_boot == st.device_allocs_after_boot);
        assert_true(gs.graph_captures_after_boot == st.graph_captures_after_boot);
        assert_true(gs.eager_steps == st.eager_steps);
        assert_true(gs.steps == st.steps);
        assert_true(gs.decode_steps == st.decode_steps);
        assert_int_equal(gs.n_batch_hist, st.n_batch_hist);
        for (uint32_t i = 0; i < st.n_batch_hist; i++)
            assert_true(gs.batch_hist[i] == st.batch_hist[i]);
        assert_true(gs.sched_allocations == st.sched_allocations);
        assert_true(gs.sched_allocations_after_boot == st.sched_allocations_after_boot);
        assert_true(gs.prefix_cache_bytes == st.prefix_cache_bytes);
        assert_true(gs.prefix_cache_used_bytes == st.prefix_cache_used_bytes);
        assert_true(gs.prefix_cache_tokens == st.prefix_cache_tokens);
        assert_true(gs.prefix_cache_snapshots == st.prefix_cache_snapshots);
        assert_true(gs.prefix_cache_lookups == st.prefix_cache_lookups);
        assert_true(gs.prefix_cache_hits == st.prefix_cache_hits);
        assert_true(gs.prefix_cache_hit_tokens == st.prefix_cache_hit_tokens);
        assert_true(gs.prefix_cache_evictions == st.prefix_cache_evictions);
        assert_int_equal(gs.spec_tokens, st.spec_tokens);
        assert_true(gs.spec_verifies == st.spec_verifies);
        assert_true(gs.spec_drafted == st.spec_drafted);
        assert_true(gs.spec_accepted == st.spec_accepted);
        assert_int_equal(gs.n_spec_hist, st.n_spec_hist);
        for (uint32_t i = 0; i < st.n_spec_hist; i++)
            assert_true(gs.spec_hist[i] == st.spec_hist[i]);
        assert_true(gs.engine_busy_s == st.engine_busy_s);
        assert_true(gs.engine_backend_s == st.engine_backend_s);
        assert_true(gs.engine_gap_s == st.engine_gap_s);
        assert_int_equal(gs.n_latency_bounds, st.n_latency_bounds);
        for (uint32_t i = 0; i < st.n_latency_bounds; i++)
            assert_true(gs.latency_bounds_s[i] == st.latency_bounds_s[i]);
        const struct dsv4_proto_latency *glat[] = { &gs.queue_hist, &gs.ttft_hist, &gs.tpot_hist, &gs.e2e_hist };
        const uint64_t glat_count[] = { gs.queue_count, gs.ttft_count, gs.tpot_count, gs.e2e_count };
        const double glat_sum[] = { gs.queue_sum_s, gs.ttft_sum_s, gs.tpot_sum_s, gs.e2e_sum_s };
        for (int h = 0; h < 4; h++) {
            assert_int_equal(glat[h]->n, lat[h]->n);
            for (uint32_t i = 0; i < lat[h]->n; i++)
                assert_true(glat[h]->buckets[i] == lat[h]->buckets[i]);
            assert_true(glat_count[h] == *lat_count[h]);
            assert_true(glat_sum[h] == *lat_sum[h]);
        }
        assert_int_equal(gs.n_kernels, st.n_kernels);
        for (uint32_t i = 0; i < st.n_kernels; i++)
            assert_string_equal(gs.kernels[i], st.kernels[i]);
        dsv4_proto_stats_clear(&gs);
        dsv4_proto_stats_clear(&st);
        dsv4_proto_message_clear(&msg);

        struct dsv4_proto_health h = { (enum dsv4_proto_health_status)rnd_below(3), rnd_utf8(40, NULL) }, gh;
        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_health_result(&buf, msgid, &h), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_health_result(&msg, &gh, &err), 0);
        assert_int_equal(gh.status, h.status);
        assert_string_equal(gh.reason, h.reason);
        dsv4_proto_health_clear(&gh);
        dsv4_proto_health_clear(&h);
        dsv4_proto_message_clear(&msg);
        dsv4_proto_buf_clear(&buf);
    }
}

static void test_errors(void **state)
{
    struct dsv4_proto_limits cl;
    client_limits(&cl);
    static const int codes[] = { DSV4_PROTO_E_UNKNOWN_METHOD, DSV4_PROTO_E_PROMPT_TOO_LONG,
                                 DSV4_PROTO_E_QUEUE_FULL, DSV4_PROTO_E_NOT_READY, DSV4_PROTO_E_FRAME_TOO_LARGE };
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        struct dsv4_proto_buf buf = { 0 };
        struct dsv4_proto_message msg;
        struct dsv4_proto_error err, got;
        uint32_t msgid = (uint32_t)rnd();
        char *text = rnd_utf8(60, NULL);
        assert_int_equal(dsv4_proto_encode_error(&buf, msgid, codes[i], text), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(msg.kind, DSV4_PROTO_RESPONSE);
        assert_int_equal(msg.msgid, msgid);
        assert_true(msg.has_error);
        assert_int_equal(msg.error.code, codes[i]);
        assert_int_equal(strncmp(msg.error.message, text, sizeof(msg.error.message) - 1), 0);
        dsv4_proto_message_clear(&msg);

        dsv4_proto_buf_reset(&buf);
        assert_int_equal(dsv4_proto_encode_error_notification(&buf, codes[i], NULL), 0);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(msg.kind, DSV4_PROTO_NOTIFICATION);
        assert_int_equal(msg.method, DSV4_PROTO_NOTIFY_ERROR);
        assert_int_equal(dsv4_proto_decode_error_notification(&msg, &got, &err), 0);
        assert_int_equal(got.code, codes[i]);
        assert_string_equal(got.message, dsv4_proto_code_describe(codes[i]));
        dsv4_proto_message_clear(&msg);
        dsv4_proto_buf_clear(&buf);
        free(text);
    }
    /* every code has a distinct name */
    static const int all[] = { 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 200, 201, 202, 203, 204,
                               205, 206, 207, 208, 209, 210, 211, 300, 301, 302, 400, 401, 402, 403, 404, 405, 500,
                               501, 502, 503 };
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        assert_string_not_equal(dsv4_proto_code_name(all[i]), "unknown");
        assert_int_equal(dsv4_proto_code_is_fatal(all[i]), all[i] < 200);
        for (size_t j = 0; j < i; j++)
            assert_string_not_equal(dsv4_proto_code_name(all[i]), dsv4_proto_code_name(all[j]));
    }
}

/* Many frames through one reader, delivered in random chunk sizes, come out whole and in order. */
static void test_reader_chunks(void **state)
{
    struct dsv4_proto_buf stream = { 0 };
    struct dsv4_proto_limits sl;
    enum { N = 200 };
    uint32_t ids[N];
    size_t biggest = 0;
    server_limits(&sl);
    for (int i = 0; i < N; i++) {
        size_t before = stream.len;
        struct dsv4_proto_tokens t = { .n_tokens = 1 + rnd_below(i % 10 == 0 ? 20000 : 50) };
        t.tokens = rnd_tokens(t.n_tokens);
        ids[i] = (uint32_t)rnd();
        assert_int_equal(dsv4_proto_encode_detokenize(&stream, ids[i], &t), 0);
        if (stream.len - before > biggest)
            biggest = stream.len - before;
        free(t.tokens);
    }
    struct dsv4_proto_reader r;
    struct dsv4_proto_error err;
    dsv4_proto_reader_init(&r, 0);
    size_t pos = 0;
    int got = 0;
    while (got < N) {
        uint8_t *p;
        size_t avail;
        assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), 0);
        size_t n = 1 + rnd_below(3000);
        if (n > avail)
            n = avail;
        if (n > stream.len - pos)
            n = stream.len - pos;
        memcpy(p, stream.data + pos, n);
        pos += n;
        dsv4_proto_reader_commit(&r, n);
        /* the buffer holds at most the initial size or the biggest frame with its header */
        assert_true(r.cap <= DSV4_PROTO_READER_INITIAL || r.cap <= biggest);
        const uint8_t *payload;
        size_t len;
        int rc;
        while ((rc = dsv4_proto_reader_next(&r, &payload, &len, &err)) == 1) {
            struct dsv4_proto_message msg;
            assert_int_equal(dsv4_proto_message_decode(payload, len, &sl, &msg, &err), 0);
            assert_int_equal(msg.msgid, ids[got]);
            dsv4_proto_message_clear(&msg);
            got++;
        }
        assert_int_equal(rc, 0);
    }
    assert_int_equal(pos, stream.len);
    assert_int_equal(dsv4_proto_reader_pending(&r), 0);
    dsv4_proto_reader_clear(&r);
    dsv4_proto_buf_clear(&stream);
}

/* The output buffer of a connection whose reader is slow: frames keep being appended while the socket
 * takes a few KiB per write. Every byte comes out once and in order, and consuming the written part does
 * not shift the whole backlog each time (that made draining a large backlog quadratic): the bytes moved
 * by all the consumes together stay below the bytes consumed. */
static void test_buf_slow_reader(void **state)
{
    struct dsv4_proto_buf b = { 0 };
    enum { BACKLOG = 4 << 20, FRAME = 1000, TOKEN = 100 };
    uint8_t chunk[FRAME];
    uint64_t appended = 0, consumed = 0, moved = 0;
    size_t peak = 0;

    while (appended < BACKLOG) {
        for (size_t i = 0; i < FRAME; i++)
            chunk[i] = (uint8_t)((appended + i) % 251);
        assert_int_equal(dsv4_proto_buf_append(&b, chunk, FRAME), 0);
        appended += FRAME;
    }
    while (b.len) {
        size_t n = 1 + rnd_below(8192);
        if (n > b.len)
            n = b.len;
        for (size_t i = 0; i < n; i++)
            if (b.data[i] != (uint8_t)((consumed + i) % 251))
                fail_msg("byte %llu: %u, expected %u", (unsigned long long)(consumed + i), b.data[i],
                         (unsigned)((consumed + i) % 251));
        const uint8_t *next = b.data + n;
        dsv4_proto_buf_consume(&b, n);
        consumed += n;
        if (b.len && b.data != next)
            moved += b.len;
        if (consumed < BACKLOG / 2 && rnd_below(4) == 0) {
            /* a token notification arrives meanwhile */
            for (size_t i = 0; i < TOKEN; i++)
                chunk[i] = (uint8_t)((appended + i) % 251);
            assert_int_equal(dsv4_proto_buf_append(&b, chunk, TOKEN), 0);
            appended += TOKEN;
        }
        if (b.len > peak)
            peak = b.len;
    }
    assert_int_equal(consumed, appended);
    if (moved > consumed)
        fail_msg("consuming %llu bytes moved %llu bytes of backlog", (unsigned long long)consumed,
                 (unsigned long long)moved);
    /* emptied: appending starts at the front of the storage again */
    assert_int_equal(dsv4_proto_buf_append(&b, chunk, 1), 0);
    assert_int_equal(b.len, 1);
    dsv4_proto_buf_clear(&b);
    assert_null(b.data);
}

/* A stats result from a server that predates the engine counters decodes with them zero; a histogram
 * longer than DSV4_PROTO_MAX_BATCH_BUCKETS or with a negative count is refused, naming the field. */
static void pack_stats_with_hist(struct dsv4_proto_buf *buf, uint32_t msgid, uint64_t requests_total, uint32_t n_buckets,
                                 bool negative)
{
    struct dsv4_wire_enc e;
    dsv4_proto_buf_reset(buf);
    dsv4_proto_begin_response(&e, buf, msgid);
    msgpack_pack_map(&e.pk, n_buckets ? 2 : 1);
    dsv4_wire_key(&e.pk, "requests_total");
    msgpack_pack_uint64(&e.pk, requests_total);
    if (n_buckets) {
        dsv4_wire_key(&e.pk, "batch_size_hist");
        msgpack_pack_array(&e.pk, n_buckets);
        for (uint32_t i = 0; i < n_buckets; i++) {
            if (negative && i == n_buckets - 1)
                msgpack_pack_int64(&e.pk, -1 - (int64_t)rnd_below(1000));
            else
                msgpack_pack_uint64(&e.pk, rnd());
        }
    }
    assert_int_equal(dsv4_wire_end(&e), 0);
}

static void test_stats_compat(void **state)
{
    struct dsv4_proto_limits cl;
    struct dsv4_proto_buf buf = { 0 };
    struct dsv4_proto_message msg;
    struct dsv4_proto_stats gs;
    struct dsv4_proto_error err;
    (void)state;
    client_limits(&cl);
    for (int r = 0; r < ROUNDS; r++) {
        uint32_t msgid = (uint32_t)rnd();
        uint64_t total = rnd() | 1;
        pack_stats_with_hist(&buf, msgid, total, 0, false);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_stats_result(&msg, &gs, &err), 0);
        assert_true(gs.requests_total == total);
        assert_true(gs.steps == 0 && gs.decode_steps == 0 && gs.n_batch_hist == 0);
        assert_true(gs.sched_allocations == 0 && gs.sched_allocations_after_boot == 0);
        /* the keys it sent are there, the others absent (not counts of 0), unknown names too */
        assert_true(dsv4_proto_stats_has(&gs, "requests_total"));
        assert_false(dsv4_proto_stats_has(&gs, "sched_allocations_after_boot"));
        assert_false(dsv4_proto_stats_has(&gs, "prefix_cache_hits"));
        assert_false(dsv4_proto_stats_has(&gs, "no_such_key"));
        assert_false(dsv4_proto_stats_has(&gs, "latency_bounds_s") || dsv4_proto_stats_has(&gs, "ttft_hist")
                     || dsv4_proto_stats_has(&gs, "ttft_count") || dsv4_proto_stats_has(&gs, "batch_size_hist"));
        assert_true(gs.n_latency_bounds == 0 && gs.ttft_hist.n == 0 && gs.e2e_hist.n == 0);
        dsv4_proto_stats_clear(&gs);
        dsv4_proto_message_clear(&msg);

        pack_stats_with_hist(&buf, msgid, total, DSV4_PROTO_MAX_BATCH_BUCKETS + 1 + rnd_below(8), false);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_stats_result(&msg, &gs, &err), -EBADMSG);
        assert_int_equal(err.code, DSV4_PROTO_E_BAD_VALUE);
        assert_non_null(strstr(err.message, "batch_size_hist"));
        assert_int_equal(gs.n_batch_hist, 0);
        dsv4_proto_message_clear(&msg);

        pack_stats_with_hist(&buf, msgid, total, 1 + rnd_below(DSV4_PROTO_MAX_BATCH_BUCKETS), true);
        decode_frame(&buf, &cl, &msg);
        assert_int_equal(dsv4_proto_decode_stats_result(&msg, &gs, &err), -EBADMSG);
        assert_int_equal(err.code, DSV4_PROTO_E_BAD_VALUE);
        assert_non_null(strstr(err.message, "batch_size_hist"));
        dsv4_proto_message_clear(&msg);
    }
    dsv4_proto_buf_clear(&buf);
}

/* A stats map of requests_total, then latency_bounds_s of nb bounds (from 1 ms, each twice the last;
 * the one at `bad_bound`, when below nb, no larger than the one before it), then ttft_hist of nh
 * buckets and ttft_count: the buckets' sum plus count_off. nb or nh UINT32_MAX: the key left out. */
static void pack_stats_latency(struct dsv4_proto_buf *buf, uint32_t msgid, uint32_t nb, uint32_t bad_bound,
                               uint32_t nh, uint64_t count_off)
{
    struct dsv4_wire_enc e;
    uint64_t total = 0;
    dsv4_proto_buf_reset(buf);
    dsv4_proto_begin_response(&e, buf, msgid);
    msgpack_pack_map(&e.pk, 1 + (nb != UINT32_MAX) + 2 * (nh != UINT32_MAX));
    dsv4_wire_key(&e.pk, "requests_total");
    msgpack_pack_uint64(&e.pk, 1);
    if (nb != UINT32_MAX) {
        double v = 0.001;
        dsv4_wire_key(&e.pk, "latency_bounds_s");
        msgpack_pack_array(&e.pk, nb);
        for (uint32_t i = 0; i < nb; i++, v *= 2)
            msgpack_pack_double(&e.pk, i == bad_bound ? v / (2 + rnd_below(3)) : v);
    }
    if (nh != UINT32_MAX) {
        dsv4_wire_key(&e.pk, "ttft_hist");
        msgpack_pack_array(&e.pk, nh);
        for (uint32_t i = 0; i < nh; i++) {
            uint64_t c = rnd_below(1000);
            total += c;
            msgpack_pack_uint64(&e.pk, c);
        }
        dsv4_wire_key(&e.pk, "ttft_count");
        msgpack_pack_uint64(&e.pk, total + count_off);
    }
    assert_int_equal(dsv4_wire_end(&e), 0);
}

/* A hostile server's latency histograms are refused as malformed, naming the key: more bounds than
 * DSV4_PROTO_MAX_LATENCY_BOUNDS, bounds that do not increase, a histogram whose length is not the
 * bounds' plus one (or that comes without bounds), buckets that do not add up to the count; a
 * well-formed one decodes. */
static void test_stats_latency_hostile(void **state)
{
    struct dsv4_proto_limits cl;
    struct dsv4_proto_buf buf = { 0 };
    struct dsv4_proto_message msg;
    struct dsv4_proto_stats gs;
    struct dsv4_proto_error err;
    (void)state;
    client_limits(&cl);
    for (int r = 0; r < ROUNDS; r++) {
        const uint32_t msgid = (uint32_t)rnd();
        const uint32_t nb = 1 + rnd_below(DSV4_PROTO_MAX_LATENCY_BOUNDS);
        const uint32_t nb2 = 2 + rnd_below(DSV4_PROTO_MAX_LATENCY_BOUNDS - 1);    /* room for a bad one */
        const struct {
            uint32_t nb, bad_bound, nh;
            uint64_t count_off;
            const char *names;
        } cases[] = {
            { nb, UINT32_MAX, nb + 1, 0, NULL },
            { DSV4_PROTO_MAX_LATENCY_BOUNDS + 1 + rnd_below(8), UINT32_MAX, UINT32_MAX, 0, "latency_bounds_s" },
            { nb2, 1 + rnd_below(nb2 - 1), UINT32_MAX, 0, "latency_bounds_s" },
            { nb, UINT32_MAX, nb + 2 + rnd_below(8), 0, "ttft_hist" },
            { nb, UINT32_MAX, rnd_below(nb + 1), 0, "ttft_hist" },
            { UINT32_MAX, UINT32_MAX, 1 + rnd_below(DSV4_PROTO_MAX_LATENCY_BOUNDS + 1), 0, "ttft_hist" },
            { nb, UINT32_MAX, nb + 1, 1 + rnd_below(1000), "ttft_count" },
        };
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
            pack_stats_latency(&buf, msgid, cases[c].nb, cases[c].bad_bound, cases[c].nh, cases[c].count_off);
            decode_frame(&buf, &cl, &msg);
            int rc = dsv4_proto_decode_stats_result(&msg, &gs, &err);
            if (!cases[c].names) {
                assert_int_equal(rc, 0);
                assert_int_equal(gs.n_latency_bounds, nb);
                assert_int_equal(gs.ttft_hist.n, nb + 1);
                assert_int_equal(gs.e2e_hist.n, 0);
                assert_true(dsv4_proto_stats_has(&gs, "ttft_hist") && !dsv4_proto_stats_has(&gs, "e2e_hist"));
                dsv4_proto_stats_clear(&gs);
            } else {
                if (rc != -EBADMSG || err.code != DSV4_PROTO_E_BAD_VALUE || !strstr(err.message, cases[c].names))
                    fail_msg("case %zu: %d, code %d: %s", c, rc, err.code, err.message);
                assert_int_equal(gs.n_latency_bounds, 0);
                assert_int_equal(gs.ttft_hist.n, 0);
            }
            dsv4_proto_message_clear(&msg);
        }
    }
    dsv4_proto_buf_clear(&buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello),
        cmocka_unit_test(test_generate),
        cmocka_unit_test(test_generate_defaults),
        cmocka_unit_test(test_token_and_result),
        cmocka_unit_test(test_small_methods),
        cmocka_unit_test(test_stats_compat),
        cmocka_unit_test(test_stats_latency_hostile),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_reader_chunks),
        cmocka_unit_test(test_buf_slow_reader),
    };
    rng_state = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    printf("# random seed %llu\n", (unsigned long long)rng_state);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
