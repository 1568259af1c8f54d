/* SPDX-License-Identifier: MIT */
/* libFuzzer target for the receiving side of the protocol: the frame reader, the pre-validator, the
 * message decoder and every typed decoder. The first input byte sets how many bytes each simulated
 * recv() delivers (1..256); the rest is the byte stream a peer sends. Checks:
 *   - the reader never offers space past max_frame + header, and refuses an oversized header;
 *   - a payload the pre-validator accepts is one msgpack-c unpacks (its promise to msgpack-c);
 *   - a request that decodes re-encodes, and the re-encoded frame decodes to the same fields.
 * The server's limits apply to requests, the client's to responses and notifications, as in use. */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "protocol/frame.h"
#include "protocol/message.h"
#include "protocol/validate.h"

#define FUZZ_MAX_FRAME (1u << 16)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const struct dsv4_proto_model_limits model = {
    .vocab_size = 1024, .max_context = 4096, .max_prompt_tokens = 4095, .max_tokens = 4096,
};

/* A rejection's message is what dsv4d answers, a msgpack str: UTF-8 however the names it quotes were cut. */
static void message_utf8(const struct dsv4_proto_error *err)
{
    if (!dsv4_utf8_valid(err->message, strlen(err->message)))
        abort();
}

static int decode_frame(const uint8_t *payload, size_t len, const struct dsv4_proto_limits *lim,
                        struct dsv4_proto_message *msg, struct dsv4_proto_error *err)
{
    int r = dsv4_proto_message_decode(payload, len, lim, msg, err);
    message_utf8(err);
    /* The validator accepted it: msgpack-c must have unpacked it. */
    if (r < 0 && dsv4_proto_validate(payload, len, lim, NULL, NULL) == 0 &&
        !strcmp(err->message, "msgpack could not unpack the frame"))
        abort();
    return r;
}

static void same_generate(const struct dsv4_proto_generate *a, const struct dsv4_proto_generate *b)
{
    /* add_bos means something for text prompts only and thinking for messages (doc/PROTOCOL.md): the
     * encoder sends each only with the prompts it goes with (thinking also with tokens), so elsewhere
     * it comes back as the default */
    const bool text = a->prompt_kind == DSV4_PROTO_PROMPT_TEXT || a->prompt_kind == DSV4_PROTO_PROMPT_PARTS;
    if (a->prompt_kind != b->prompt_kind || a->prompt_len != b->prompt_len || a->n_messages != b->n_messages ||
        a->n_tokens != b->n_tokens || (text && a->add_bos != b->add_bos) || (!text && a->thinking != b->thinking) ||
        a->stream != b->stream || a->sampling.n_stop != b->sampling.n_stop ||
        a->sampling.n_stop_token_ids != b->sampling.n_stop_token_ids ||
        a->sampling.max_tokens != b->sampling.max_tokens || a->sampling.has_seed != b->sampling.has_seed ||
        (a->sampling.has_seed && a->sampling.seed != b->sampling.seed) ||
        a->sampling.logprobs != b->sampling.logprobs || a->sampling.top_k != b->sampling.top_k)
        abort();
    if (a->prompt_len && memcmp(a->prompt, b->prompt, a->prompt_len))
        abort();
    if (a->n_tokens && memcmp(a->tokens, b->tokens, a->n_tokens * sizeof(*a->tokens)))
        abort();
    for (uint32_t i = 0; i < a->n_messages; i++)
        if (a->messages[i].role != b->messages[i].role || a->messages[i].content_len != b->messages[i].content_len ||
            memcmp(a->messages[i].content, b->messages[i].content, a->messages[i].content_len))
            abort();
    for (uint32_t i = 0; i < a->sampling.n_stop; i++)
        if (strcmp(a->sampling.stop[i], b->sampling.stop[i]))
            abort();
}

/* A decoded generate request is encoded again and must come back the same. */
static void roundtrip_generate(uint32_t msgid, const struct dsv4_proto_generate *gen,
                               const struct dsv4_proto_limits *lim)
{
    struct dsv4_proto_buf b = { 0 };
    struct dsv4_proto_message msg;
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_generate again;

    if (dsv4_proto_encode_generate(&b, msgid, gen) < 0)
        abort();
    /* Encoding may exceed the fuzz limits (a bin grows by its header); those frames are skipped. */
    if (b.len - DSV4_PROTO_FRAME_HEADER > lim->max_frame) {
        dsv4_proto_buf_clear(&b);
        return;
    }
    dsv4_proto_generate_init(&again);
    if (decode_frame(b.data + DSV4_PROTO_FRAME_HEADER, b.len - DSV4_PROTO_FRAME_HEADER, lim, &msg, &err) < 0 ||
        dsv4_proto_decode_generate(&msg, &again, &err) < 0)
        abort();
    same_generate(gen, &again);
    dsv4_proto_generate_clear(&again);
    dsv4_proto_message_clear(&msg);
    dsv4_proto_buf_clear(&b);
}

static void decode_request(const struct dsv4_proto_message *msg, const struct dsv4_proto_limits *lim)
{
    struct dsv4_proto_error err = { 0 };
    switch (msg->method) {
    case DSV4_PROTO_METHOD_HELLO: {
        struct dsv4_proto_hello h = { 0 };
        uint32_t version;
        if (dsv4_proto_decode_hello(msg, &h, &err) == 0)
            (void)dsv4_proto_hello_negotiate(&h, &version, &err);
        dsv4_proto_hello_clear(&h);
        break;
    }
    case DSV4_PROTO_METHOD_GENERATE: {
        struct dsv4_proto_generate g;
        dsv4_proto_generate_init(&g);
        if (dsv4_proto_decode_generate(msg, &g, &err) == 0) {
            (void)dsv4_proto_check_generate(&g, &model, &err);
            (void)dsv4_proto_effective_max_tokens(&g.sampling, &model);
            roundtrip_generate(msg->msgid, &g, lim);
        }
        dsv4_proto_generate_clear(&g);
        break;
    }
    case DSV4_PROTO_METHOD_CANCEL: {
        struct dsv4_proto_cancel c;
        (void)dsv4_proto_decode_cancel(msg, &c, &err);
        break;
    }
    case DSV4_PROTO_METHOD_TOKENIZE: {
        struct dsv4_proto_tokenize t;
        dsv4_proto_tokenize_init(&t);
        (void)dsv4_proto_decode_tokenize(msg, &t, &err);
        dsv4_proto_tokenize_clear(&t);
        break;
    }
    case DSV4_PROTO_METHOD_DETOKENIZE: {
        struct dsv4_proto_tokens t = { 0 };
        if (dsv4_proto_decode_detokenize(msg, &t, &err) == 0)
            (void)dsv4_proto_check_token_ids(t.tokens, t.n_tokens, model.vocab_size, "tokens", &err);
        dsv4_proto_tokens_clear(&t);
        break;
    }
    default:
        (void)dsv4_proto_decode_empty_params(msg, &err);
        break;
    }
    message_utf8(&err);
}

/* The client's side: a response is read by the decoder of the method the client asked for, so any
 * of them may meet any result. */
static void decode_response(const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 };
    struct dsv4_proto_hello_result hr = { 0 };
    struct dsv4_proto_generate_result gr = { 0 };
    struct dsv4_proto_tokens tr = { 0 };
    struct dsv4_proto_text xr = { 0 };
    struct dsv4_proto_stats sr = { 0 };
    struct dsv4_proto_health he = { 0 };
    bool cancelled;

    (void)dsv4_proto_decode_hello_result(msg, &hr, &err);
    dsv4_proto_hello_result_clear(&hr);
    (void)dsv4_proto_decode_generate_result(msg, &gr, &err);
    dsv4_proto_generate_result_clear(&gr);
    (void)dsv4_proto_decode_tokenize_result(msg, &tr, &err);
    dsv4_proto_tokens_clear(&tr);
    (void)dsv4_proto_decode_detokenize_result(msg, &xr, &err);
    dsv4_proto_text_clear(&xr);
    (void)dsv4_proto_decode_stats_result(msg, &sr, &err);
    dsv4_proto_stats_clear(&sr);
    (void)dsv4_proto_decode_health_result(msg, &he, &err);
    dsv4_proto_health_clear(&he);
    (void)dsv4_proto_decode_cancel_result(msg, &cancelled, &err);
}

static void decode_notification(const struct dsv4_proto_message *msg)
{
    struct dsv4_proto_error err = { 0 }, notified;
    struct dsv4_proto_token_event ev = { 0 };

    (void)dsv4_proto_decode_token(msg, &ev, &err);
    dsv4_proto_token_event_clear(&ev);
    (void)dsv4_proto_decode_error_notification(msg, &notified, &err);
}

static void one_frame(const uint8_t *payload, size_t len)
{
    struct dsv4_proto_limits server, client;
    struct dsv4_proto_message msg;
    struct dsv4_proto_error err = { 0 };

    dsv4_proto_limits_server(&server);
    server.max_frame = FUZZ_MAX_FRAME;
    if (decode_frame(payload, len, &server, &msg, &err) == 0 && msg.kind == DSV4_PROTO_REQUEST)
        decode_request(&msg, &server);
    dsv4_proto_message_clear(&msg);

    dsv4_proto_limits_client(&client);
    client.max_frame = FUZZ_MAX_FRAME;
    if (decode_frame(payload, len, &client, &msg, &err) == 0) {
        if (msg.kind == DSV4_PROTO_RESPONSE && !msg.has_error)
            decode_response(&msg);
        else if (msg.kind == DSV4_PROTO_NOTIFICATION)
            decode_notification(&msg);
    }
    dsv4_proto_message_clear(&msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_proto_reader reader;
    struct dsv4_proto_error err;

    if (!size)
        return 0;
    size_t chunk = (size_t)data[0] + 1, at = 1;
    dsv4_proto_reader_init(&reader, FUZZ_MAX_FRAME);
    for (;;) {
        const uint8_t *payload;
        uint8_t *space;
        size_t len, avail;
        int r = dsv4_proto_reader_next(&reader, &payload, &len, &err);
        if (r < 0)
            break;
        if (r == 1) {
            if (len == 0 || len > FUZZ_MAX_FRAME)
                abort();
            one_frame(payload, len);
            continue;
        }
        if (at == size)
            break;
        r = dsv4_proto_reader_space(&reader, &space, &avail, &err);
        if (r < 0) {
            if (r != -EBADMSG)
                abort();
            break;
        }
        /* The buffer holds one frame and its header at most (FUZZ_MAX_FRAME is above the first size). */
        if (avail == 0 || reader.cap > FUZZ_MAX_FRAME + DSV4_PROTO_FRAME_HEADER)
            abort();
        size_t n = size - at < chunk ? size - at : chunk;
        if (n > avail)
            n = avail;
        memcpy(space, data + at, n);
        dsv4_proto_reader_commit(&reader, n);
        at += n;
    }
    dsv4_proto_reader_clear(&reader);
    return 0;
}
