/* SPDX-License-Identifier: MIT */
/* protocol: hostile and malformed input. Every case must be rejected with its documented code; the
 * ones the pre-validator rejects must be rejected before anything is allocated (counted by interposing
 * malloc when the build has no sanitizer that owns malloc itself). */
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
#include <msgpack.h>

#include "base/utf8.h"
#include "protocol/message.h"

/* ---- allocation counter ---- */

#if defined(__SANITIZE_ADDRESS__)
#define COUNT_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer)
#define COUNT_ALLOCATIONS 0
#endif
#endif
#ifndef COUNT_ALLOCATIONS
#define COUNT_ALLOCATIONS 1
#endif

static int counting;
static size_t allocated;   /* bytes requested while counting */

#if COUNT_ALLOCATIONS
void *__libc_malloc(size_t n);
void *__libc_calloc(size_t n, size_t m);
void *__libc_realloc(void *p, size_t n);
void __libc_free(void *p);
void *malloc(size_t n);
void *calloc(size_t n, size_t m);
void *realloc(void *p, size_t n);
void free(void *p);

void *malloc(size_t n)
{
    if (counting)
        allocated += n;
    return __libc_malloc(n);
}

void *calloc(size_t n, size_t m)
{
    if (counting)
        allocated += n * m;
    return __libc_calloc(n, m);
}

void *realloc(void *p, size_t n)
{
    if (counting)
        allocated += n;
    return __libc_realloc(p, n);
}

void free(void *p)
{
    __libc_free(p);
}
#endif

/* ---- the server's front half, as dsv4d runs it ---- */

static const struct dsv4_proto_model_limits model = {
    .vocab_size = 1000, .max_context = 64, .max_prompt_tokens = 48, .max_tokens = 512,
};

/* Decode one payload and the typed request; returns the protocol code (0 when accepted). */
/* An error's message goes back to the client as a msgpack str, which the protocol says is UTF-8. */
static void assert_message_utf8(const struct dsv4_proto_error *err)
{
    if (!dsv4_utf8_valid(err->message, strlen(err->message)))
        fail_msg("error %d: the message is not valid UTF-8: %s", err->code, err->message);
}

static int serve(const uint8_t *p, size_t len, const struct dsv4_proto_limits *lim, bool *fatal_before_alloc)
{
    struct dsv4_proto_message msg;
    struct dsv4_proto_error err = { 0 };
    allocated = 0;
    counting = 1;
    int rc = dsv4_proto_message_decode(p, len, lim, &msg, &err);
    counting = 0;
    *fatal_before_alloc = rc && allocated == 0;
    if (rc) {
        assert_int_equal(rc, -EBADMSG);
        assert_true(err.code != 0);
        assert_true(err.message[0] != '\0');
        assert_message_utf8(&err);
        /* only fatal codes may lack a msgid to answer */
        if (!dsv4_proto_code_is_fatal(err.code))
            assert_true(msg.has_msgid);
        dsv4_proto_message_clear(&msg);
        return err.code;
    }
    if (msg.kind != DSV4_PROTO_REQUEST) {
        dsv4_proto_message_clear(&msg);
        return DSV4_PROTO_E_UNEXPECTED_MESSAGE;
    }
    switch (msg.method) {
    case DSV4_PROTO_METHOD_GENERATE: {
        struct dsv4_proto_generate g;
        rc = dsv4_proto_decode_generate(&msg, &g, &err);
        if (rc == 0)
            rc = dsv4_proto_check_generate(&g, &model, &err);
        dsv4_proto_generate_clear(&g);
        break;
    }
    case DSV4_PROTO_METHOD_HELLO: {
        struct dsv4_proto_hello h;
        uint32_t v;
        rc = dsv4_proto_decode_hello(&msg, &h, &err);
        if (rc == 0)
            rc = dsv4_proto_hello_negotiate(&h, &v, &err);
        dsv4_proto_hello_clear(&h);
        break;
    }
    case DSV4_PROTO_METHOD_CANCEL: {
        struct dsv4_proto_cancel c;
        rc = dsv4_proto_decode_cancel(&msg, &c, &err);
        break;
    }
    case DSV4_PROTO_METHOD_TOKENIZE: {
        struct dsv4_proto_tokenize t;
        rc = dsv4_proto_decode_tokenize(&msg, &t, &err);
        dsv4_proto_tokenize_clear(&t);
        break;
    }
    case DSV4_PROTO_METHOD_DETOKENIZE: {
        struct dsv4_proto_tokens t;
        rc = dsv4_proto_decode_detokenize(&msg, &t, &err);
        if (rc == 0)
            rc = dsv4_proto_check_token_ids(t.tokens, t.n_tokens, model.vocab_size, "detokenize: tokens", &err);
        dsv4_proto_tokens_clear(&t);
        break;
    }
    default:
        rc = dsv4_proto_decode_empty_params(&msg, &err);
        break;
    }
    dsv4_proto_message_clear(&msg);
    if (rc) {
        assert_true(err.message[0] != '\0');
        assert_message_utf8(&err);
        assert_false(dsv4_proto_code_is_fatal(err.code));
        return err.code;
    }
    return 0;
}

/* ---- building inputs ---- */

static uint8_t *from_hex(const char *hex, size_t *ret_len)
{
    size_t n = 0;
    uint8_t *b = malloc(strlen(hex) / 2 + 1);
    assert_non_null(b);
    for (const char *p = hex; *p;) {
        unsigned v;
        if (*p == ' ') {
            p++;
            continue;
        }
        assert_int_equal(sscanf(p, "%2x", &v), 1);
        b[n++] = (uint8_t)v;
        p += 2;
    }
    *ret_len = n;
    return b;
}

static int pk_write(void *data, const char *buf, size_t len)
{
    return dsv4_proto_buf_append(data, buf, len);
}

static void key(msgpack_packer *pk, const char *k)
{
    msgpack_pack_str(pk, strlen(k));
    msgpack_pack_str_body(pk, k, strlen(k));
}

static void str(msgpack_packer *pk, const char *s, size_t n)
{
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* [0, 1, method, [params]], the params map with n entries then packed by the case. */
static void request(msgpack_packer *pk, const char *method, uint32_t n)
{
    msgpack_pack_array(pk, 4);
    msgpack_pack_uint8(pk, 0);
    msgpack_pack_uint8(pk, 1);
    key(pk, method);
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, n);
}

static void generate_prompt(msgpack_packer *pk, uint32_t extra)
{
    request(pk, "generate", 1 + extra);
    key(pk, "prompt");
    str(pk, "hello", 5);
}

static void b_params_string(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 4);
    msgpack_pack_uint8(pk, 0);
    msgpack_pack_uint8(pk, 1);
    key(pk, "generate");
    str(pk, "prompt", 6);
}
static void b_no_prompt(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "max_tokens"); msgpack_pack_uint8(pk, 4); }
static void b_two_prompts(msgpack_packer *pk)
{
    generate_prompt(pk, 1);
    key(pk, "tokens");
    msgpack_pack_bin(pk, 4);
    msgpack_pack_bin_body(pk, "\1\0\0\0", 4);
}
static void b_bad_utf8(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "prompt"); str(pk, "a\xc3\x28z", 4); }
static void b_overlong(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "prompt"); str(pk, "\xc0\xaf", 2); }
static void b_surrogate(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "prompt"); str(pk, "\xed\xa0\x80", 3); }
static void b_above_unicode(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "prompt"); str(pk, "\xf4\x90\x80\x80", 4); }
static void b_cut_utf8(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "prompt"); str(pk, "ab\xe2\x82", 4); }
static void b_tokens_5(msgpack_packer *pk)
{
    request(pk, "generate", 1);
    key(pk, "tokens");
    msgpack_pack_bin(pk, 5);
    msgpack_pack_bin_body(pk, "\1\0\0\0\2", 5);
}
static void b_tokens_empty(msgpack_packer *pk) { request(pk, "generate", 1); key(pk, "tokens"); msgpack_pack_bin(pk, 0); }
static void b_tokens_array(msgpack_packer *pk)
{
    request(pk, "generate", 1);
    key(pk, "tokens");
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint8(pk, 5);
    msgpack_pack_uint8(pk, 17);
}
static void tokens_bin(msgpack_packer *pk, const int32_t *t, uint32_t n)
{
    msgpack_pack_bin(pk, n * 4);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t le[4] = { (uint8_t)t[i], (uint8_t)(t[i] >> 8), (uint8_t)(t[i] >> 16), (uint8_t)((uint32_t)t[i] >> 24) };
        msgpack_pack_bin_body(pk, le, 4);
    }
}
static void b_token_vocab(msgpack_packer *pk)
{
    static const int32_t t[] = { 5, 17, 1000 };
    request(pk, "generate", 1);
    key(pk, "tokens");
    tokens_bin(pk, t, 3);
}
static void b_token_negative(msgpack_packer *pk)
{
    static const int32_t t[] = { 5, -3 };
    request(pk, "generate", 1);
    key(pk, "tokens");
    tokens_bin(pk, t, 2);
}
static void b_prompt_context(msgpack_packer *pk)
{
    int32_t t[60];
    for (int i = 0; i < 60; i++)
        t[i] = i;
    request(pk, "generate", 1);
    key(pk, "tokens");
    tokens_bin(pk, t, 60);
}
static void b_temp_nan(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "temperature"); msgpack_pack_double(pk, NAN); }
static void b_temp_inf(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "temperature"); msgpack_pack_double(pk, INFINITY); }
static void b_temp_huge(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "temperature"); msgpack_pack_double(pk, 1e9); }
static void b_top_p_neg(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "top_p"); msgpack_pack_double(pk, -0.5); }
static void b_top_k_neg(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "top_k"); msgpack_pack_int32(pk, -7); }
static void b_max_tokens_0(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "max_tokens"); msgpack_pack_uint8(pk, 0); }
static void b_max_tokens_big(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "max_tokens"); msgpack_pack_uint64(pk, 1ull << 40); }
static void b_max_tokens_limit(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "max_tokens"); msgpack_pack_uint32(pk, 513); }
static void b_rep_zero(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "repetition_penalty"); msgpack_pack_double(pk, 0); }
static void b_seed_neg(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "seed"); msgpack_pack_int8(pk, -1); }
static void b_logprobs_99(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "logprobs"); msgpack_pack_uint8(pk, 99); }
static void b_temp_string(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "temperature"); str(pk, "hot", 3); }
static void b_stream_int(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "stream"); msgpack_pack_uint8(pk, 1); }
static void b_unknown_field(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "temprature"); msgpack_pack_double(pk, 0.5); }
/* Names the error quotes, cut to their first 64 bytes: here inside the 32nd of its two-byte characters. */
#define NAME_CUT_MIDCHAR "x\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9" \
    "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9" \
    "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"
static void b_unknown_field_utf8(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, NAME_CUT_MIDCHAR); msgpack_pack_double(pk, 0.5); }
static void b_unknown_method_utf8(msgpack_packer *pk) { request(pk, NAME_CUT_MIDCHAR, 0); }
static void b_dup_field(msgpack_packer *pk) { generate_prompt(pk, 1); key(pk, "prompt"); str(pk, "again", 5); }
static void b_int_key(msgpack_packer *pk) { generate_prompt(pk, 1); msgpack_pack_uint8(pk, 7); msgpack_pack_uint8(pk, 7); }
static void b_many_stop(msgpack_packer *pk)
{
    generate_prompt(pk, 1);
    key(pk, "stop");
    msgpack_pack_array(pk, DSV4_PROTO_MAX_STOP + 1);
    for (unsigned i = 0; i <= DSV4_PROTO_MAX_STOP; i++)
        str(pk, "x", 1);
}
static void b_long_stop(msgpack_packer *pk)
{
    char s[DSV4_PROTO_MAX_STOP_LEN + 1];
    memset(s, 'x', sizeof(s));
    generate_prompt(pk, 1);
    key(pk, "stop");
    str(pk, s, sizeof(s));
}
static void b_stop_ids_vocab(msgpack_packer *pk)
{
    generate_prompt(pk, 1);
    key(pk, "stop_token_ids");
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint32(pk, 1);
    msgpack_pack_uint32(pk, 5000);
}
static void b_bad_role(msgpack_packer *pk)
{
    request(pk, "generate", 1);
    key(pk, "messages");
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 2);
    key(pk, "role");
    str(pk, "god", 3);
    key(pk, "content");
    str(pk, "hi", 2);
}
static void b_role_not_utf8(msgpack_packer *pk)
{
    request(pk, "generate", 1);
    key(pk, "messages");
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 2);
    key(pk, "role");
    str(pk, "us\xff", 3);
    key(pk, "content");
    str(pk, "hi", 2);
}
static void b_stop_nul(msgpack_packer *pk)
{
    generate_prompt(pk, 1);
    key(pk, "stop");
    str(pk, "a\0b", 3);
}
static void b_message_no_content(msgpack_packer *pk)
{
    request(pk, "generate", 1);
    key(pk, "messages");
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 1);
    key(pk, "role");
    str(pk, "user", 4);
}
static void b_many_messages(msgpack_packer *pk)
{
    request(pk, "generate", 1);
    key(pk, "messages");
    msgpack_pack_array(pk, DSV4_PROTO_MAX_MESSAGES + 1);
    for (unsigned i = 0; i <= DSV4_PROTO_MAX_MESSAGES; i++) {
        msgpack_pack_map(pk, 2);
        key(pk, "role");
        str(pk, "user", 4);
        key(pk, "content");
        str(pk, "hi", 2);
    }
}
static void b_hello_v0(msgpack_packer *pk) { request(pk, "hello", 1); key(pk, "protocol"); msgpack_pack_uint8(pk, 0); }
static void b_hello_missing(msgpack_packer *pk) { request(pk, "hello", 0); }
static void b_cancel_missing(msgpack_packer *pk) { request(pk, "cancel", 0); }
static void b_cancel_string(msgpack_packer *pk) { request(pk, "cancel", 1); key(pk, "msgid"); str(pk, "1", 1); }
static void b_detok_vocab(msgpack_packer *pk)
{
    static const int32_t t[] = { 1, 2, 1 << 30 };
    request(pk, "detokenize", 1);
    key(pk, "tokens");
    tokens_bin(pk, t, 3);
}
static void b_tokenize_both(msgpack_packer *pk)
{
    request(pk, "tokenize", 2);
    key(pk, "text");
    str(pk, "a", 1);
    key(pk, "messages");
    msgpack_pack_array(pk, 0);
}
static void b_stats_params(msgpack_packer *pk) { request(pk, "stats", 1); key(pk, "verbose"); msgpack_pack_true(pk); }
static void b_method_int(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 4);
    msgpack_pack_uint8(pk, 0);
    msgpack_pack_uint8(pk, 9);
    msgpack_pack_uint8(pk, 3);
    msgpack_pack_array(pk, 0);
}
static void b_response_to_server(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 4);
    msgpack_pack_uint8(pk, 1);
    msgpack_pack_uint8(pk, 9);
    msgpack_pack_nil(pk);
    msgpack_pack_nil(pk);
}
static void b_too_many_elements(msgpack_packer *pk)
{
    msgpack_pack_array(pk, DSV4_PROTO_DEFAULT_MAX_ELEMENTS + 10);
    for (unsigned i = 0; i < DSV4_PROTO_DEFAULT_MAX_ELEMENTS + 10; i++)
        msgpack_pack_nil(pk);
}
static void b_long_string(msgpack_packer *pk)
{
    size_t n = DSV4_PROTO_DEFAULT_MAX_STR + 1;
    char *s = calloc(1, n);
    assert_non_null(s);
    memset(s, 'a', n);
    request(pk, "generate", 1);
    key(pk, "prompt");
    str(pk, s, n);
    free(s);
}
static void b_long_bin(msgpack_packer *pk)
{
    size_t n = DSV4_PROTO_DEFAULT_MAX_BIN + 4;
    char *s = calloc(1, n);
    assert_non_null(s);
    request(pk, "generate", 1);
    key(pk, "tokens");
    msgpack_pack_bin(pk, n);
    msgpack_pack_bin_body(pk, s, n);
    free(s);
}

struct hostile {
    const char *name;
    const char *hex;                     /* raw payload, or NULL */
    void (*build)(msgpack_packer *pk);   /* packed payload, or NULL */
    int code;
};

static const struct hostile cases[] = {
    /* framing and structure: fatal, rejected before any allocation */
    { "array32 claims 2^32-1 elements in 5 bytes", "dd ffffffff", NULL, DSV4_PROTO_E_TRUNCATED },
    { "map32 claims 2^32-1 entries in 5 bytes", "df ffffffff", NULL, DSV4_PROTO_E_TRUNCATED },
    { "str32 claims 4 GiB", "db ffffffff 41", NULL, DSV4_PROTO_E_TRUNCATED },
    { "bin32 claims 4 GiB", "c6 ffffffff 00", NULL, DSV4_PROTO_E_TRUNCATED },
    { "array16 claims 65535 in 3 bytes", "dc ffff", NULL, DSV4_PROTO_E_TRUNCATED },
    { "nested array32 claims inside a request", "94 00 01 a5 68656c6c6f dd 7fffffff", NULL, DSV4_PROTO_E_TRUNCATED },
    { "map with a key and no value", "81 a1 61", NULL, DSV4_PROTO_E_TRUNCATED },
    { "array of 3 holding 2", "93 01 02", NULL, DSV4_PROTO_E_TRUNCATED },
    { "array32 header cut short", "dd 00", NULL, DSV4_PROTO_E_TRUNCATED },
    { "uint64 cut short", "cf 0000", NULL, DSV4_PROTO_E_TRUNCATED },
    { "float64 cut short", "cb 00", NULL, DSV4_PROTO_E_TRUNCATED },
    { "str8 longer than the frame", "94 00 01 d9 ff 61", NULL, DSV4_PROTO_E_TRUNCATED },
    { "reserved byte 0xc1", "c1", NULL, DSV4_PROTO_E_MALFORMED },
    { "ext8 inside a request", "94 00 01 a5 68656c6c6f 91 c7 01 05 00", NULL, DSV4_PROTO_E_MALFORMED },
    { "fixext1", "d4 01 00", NULL, DSV4_PROTO_E_MALFORMED },
    { "two values in one frame", "01 02", NULL, DSV4_PROTO_E_TRAILING_BYTES },
    { "request then a trailing byte", "94 00 01 a5 7374617473 90 00", NULL, DSV4_PROTO_E_TRAILING_BYTES },
    { "17 nested arrays", "9191919191919191919191919191919190", NULL, DSV4_PROTO_E_TOO_DEEP },
    { "17 nested maps", "81a16b 81a16b 81a16b 81a16b 81a16b 81a16b 81a16b 81a16b 81a16b 81a16b 81a16b 81a16b "
                        "81a16b 81a16b 81a16b 81a16b 81a16b c0", NULL, DSV4_PROTO_E_TOO_DEEP },
    { "more objects than the element cap", NULL, b_too_many_elements, DSV4_PROTO_E_TOO_MANY_ELEMENTS },
    { "prompt above the string cap", NULL, b_long_string, DSV4_PROTO_E_STRING_TOO_LONG },
    { "tokens above the bin cap", NULL, b_long_bin, DSV4_PROTO_E_BIN_TOO_LONG },
    /* envelope: fatal */
    { "bare string", "a5 68656c6c6f", NULL, DSV4_PROTO_E_NOT_RPC },
    { "array of 2", "92 00 01", NULL, DSV4_PROTO_E_NOT_RPC },
    { "message type 3", "94 03 01 a5 68656c6c6f 90", NULL, DSV4_PROTO_E_NOT_RPC },
    { "message type as string", "94 a1 30 01 a5 68656c6c6f 90", NULL, DSV4_PROTO_E_NOT_RPC },
    { "request of 3 elements", "93 00 01 a5 68656c6c6f", NULL, DSV4_PROTO_E_NOT_RPC },
    { "msgid as string", "94 00 a1 31 a5 68656c6c6f 90", NULL, DSV4_PROTO_E_BAD_MSGID },
    { "msgid negative", "94 00 ff a5 68656c6c6f 90", NULL, DSV4_PROTO_E_BAD_MSGID },
    { "msgid float", "94 00 cb 3ff8000000000000 a5 68656c6c6f 90", NULL, DSV4_PROTO_E_BAD_MSGID },
    { "msgid 2^33", "94 00 cf 0000000200000000 a5 68656c6c6f 90", NULL, DSV4_PROTO_E_BAD_MSGID },
    { "msgid nil", "94 00 c0 a5 68656c6c6f 90", NULL, DSV4_PROTO_E_BAD_MSGID },
    { "a response sent to the server", NULL, b_response_to_server, DSV4_PROTO_E_UNEXPECTED_MESSAGE },
    /* request shape: answered to the msgid */
    { "unknown method", "94 00 01 a7 6578706c6f6465 90", NULL, DSV4_PROTO_E_UNKNOWN_METHOD },
    { "method with invalid UTF-8", "94 00 01 a2 c328 90", NULL, DSV4_PROTO_E_UNKNOWN_METHOD },
    { "method as integer", NULL, b_method_int, DSV4_PROTO_E_WRONG_TYPE },
    { "params as string", NULL, b_params_string, DSV4_PROTO_E_WRONG_TYPE },
    { "params as two maps", "94 00 01 a5 7374617473 92 80 80", NULL, DSV4_PROTO_E_WRONG_TYPE },
    { "generate without a prompt", NULL, b_no_prompt, DSV4_PROTO_E_MISSING_FIELD },
    { "prompt and tokens", NULL, b_two_prompts, DSV4_PROTO_E_PROMPT_CONFLICT },
    { "prompt with invalid UTF-8", NULL, b_bad_utf8, DSV4_PROTO_E_INVALID_UTF8 },
    { "prompt with an overlong encoding", NULL, b_overlong, DSV4_PROTO_E_INVALID_UTF8 },
    { "prompt with a surrogate", NULL, b_surrogate, DSV4_PROTO_E_INVALID_UTF8 },
    { "prompt above U+10FFFF", NULL, b_above_unicode, DSV4_PROTO_E_INVALID_UTF8 },
    { "prompt ending inside a character", NULL, b_cut_utf8, DSV4_PROTO_E_INVALID_UTF8 },
    { "tokens bin of 5 bytes", NULL, b_tokens_5, DSV4_PROTO_E_BAD_TOKENS },
    { "tokens bin empty", NULL, b_tokens_empty, DSV4_PROTO_E_BAD_TOKENS },
    { "tokens as an array", NULL, b_tokens_array, DSV4_PROTO_E_WRONG_TYPE },
    { "temperature as string", NULL, b_temp_string, DSV4_PROTO_E_WRONG_TYPE },
    { "stream as integer", NULL, b_stream_int, DSV4_PROTO_E_WRONG_TYPE },
    { "misspelt field", NULL, b_unknown_field, DSV4_PROTO_E_UNKNOWN_FIELD },
    { "unknown field of 73 bytes, cut inside a character", NULL, b_unknown_field_utf8, DSV4_PROTO_E_UNKNOWN_FIELD },
    { "unknown method of 73 bytes, cut inside a character", NULL, b_unknown_method_utf8, DSV4_PROTO_E_UNKNOWN_METHOD },
    { "prompt twice", NULL, b_dup_field, DSV4_PROTO_E_DUPLICATE_FIELD },
    { "integer map key", NULL, b_int_key, DSV4_PROTO_E_WRONG_TYPE },
    { "role god", NULL, b_bad_role, DSV4_PROTO_E_BAD_ROLE },
    { "role not UTF-8", NULL, b_role_not_utf8, DSV4_PROTO_E_INVALID_UTF8 },
    { "stop string holding a NUL", NULL, b_stop_nul, DSV4_PROTO_E_BAD_VALUE },
    { "message without content", NULL, b_message_no_content, DSV4_PROTO_E_MISSING_FIELD },
    { "hello protocol 0", NULL, b_hello_v0, DSV4_PROTO_E_VERSION_UNSUPPORTED },
    { "hello without protocol", NULL, b_hello_missing, DSV4_PROTO_E_MISSING_FIELD },
    { "cancel without msgid", NULL, b_cancel_missing, DSV4_PROTO_E_MISSING_FIELD },
    { "cancel msgid as string", NULL, b_cancel_string, DSV4_PROTO_E_WRONG_TYPE },
    { "tokenize text and messages", NULL, b_tokenize_both, DSV4_PROTO_E_PROMPT_CONFLICT },
    { "stats with a param", NULL, b_stats_params, DSV4_PROTO_E_UNKNOWN_FIELD },
    /* values */
    { "token id = vocab size", NULL, b_token_vocab, DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB },
    { "negative token id", NULL, b_token_negative, DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB },
    { "stop_token_ids outside the vocab", NULL, b_stop_ids_vocab, DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB },
    { "detokenize id 2^30", NULL, b_detok_vocab, DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB },
    { "token prompt longer than the prompt limit", NULL, b_prompt_context, DSV4_PROTO_E_PROMPT_TOO_LONG },
    { "temperature NaN", NULL, b_temp_nan, DSV4_PROTO_E_BAD_SAMPLING },
    { "temperature inf", NULL, b_temp_inf, DSV4_PROTO_E_BAD_SAMPLING },
    { "temperature 1e9", NULL, b_temp_huge, DSV4_PROTO_E_BAD_SAMPLING },
    { "top_p -0.5", NULL, b_top_p_neg, DSV4_PROTO_E_BAD_SAMPLING },
    { "top_k -7", NULL, b_top_k_neg, DSV4_PROTO_E_BAD_SAMPLING },
    { "max_tokens 0", NULL, b_max_tokens_0, DSV4_PROTO_E_BAD_SAMPLING },
    { "max_tokens 2^40", NULL, b_max_tokens_big, DSV4_PROTO_E_BAD_SAMPLING },
    { "repetition_penalty 0", NULL, b_rep_zero, DSV4_PROTO_E_BAD_SAMPLING },
    { "seed -1", NULL, b_seed_neg, DSV4_PROTO_E_BAD_SAMPLING },
    { "logprobs 99", NULL, b_logprobs_99, DSV4_PROTO_E_BAD_SAMPLING },
    /* limits */
    { "17 stop strings", NULL, b_many_stop, DSV4_PROTO_E_TOO_MANY_STOP },
    { "stop string of 257 bytes", NULL, b_long_stop, DSV4_PROTO_E_TOO_MANY_STOP },
    { "4097 chat messages", NULL, b_many_messages, DSV4_PROTO_E_TOO_MANY_MESSAGES },
    { "max_tokens above the server limit", NULL, b_max_tokens_limit, DSV4_PROTO_E_MAX_TOKENS_LIMIT },
};

static void test_hostile(void **state)
{
    struct dsv4_proto_limits lim;
    dsv4_proto_limits_server(&lim);
    size_t n_fatal = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct hostile *c = &cases[i];
        struct dsv4_proto_buf buf = { 0 };
        if (c->hex) {
            buf.data = from_hex(c->hex, &buf.len);
        } else {
            msgpack_packer pk;
            msgpack_packer_init(&pk, &buf, pk_write);
            c->build(&pk);
        }
        bool before_alloc;
        int code = serve(buf.data, buf.len, &lim, &before_alloc);
        if (code != c->code)
            fail_msg("%s: got %d (%s), documented %d (%s)", c->name, code, dsv4_proto_code_name(code), c->code,
                     dsv4_proto_code_name(c->code));
        /* the pre-validator's verdicts come before any allocation */
        bool validator_code = c->code >= DSV4_PROTO_E_FRAME_TOO_LARGE && c->code <= DSV4_PROTO_E_BIN_TOO_LONG;
        if (validator_code) {
            struct dsv4_proto_error err;
            assert_int_equal(dsv4_proto_validate(buf.data, buf.len, &lim, NULL, &err), -EBADMSG);
            assert_int_equal(err.code, c->code);
            if (COUNT_ALLOCATIONS && !before_alloc)
                fail_msg("%s: %zu bytes allocated before rejection", c->name, allocated);
            n_fatal++;
        }
        free(buf.data);
    }
    assert_true(n_fatal >= 20);
    assert_true(sizeof(cases) / sizeof(cases[0]) >= 30);
    if (!COUNT_ALLOCATIONS)
        printf("# allocation counting off (sanitizer build)\n");
}

/* A valid request still passes through the same path (the cases above fail for their own reason). */
static void test_valid_request_passes(void **state)
{
    struct dsv4_proto_limits lim;
    struct dsv4_proto_buf buf = { 0 };
    msgpack_packer pk;
    bool before;
    dsv4_proto_limits_server(&lim);
    msgpack_packer_init(&pk, &buf, pk_write);
    generate_prompt(&pk, 2);
    key(&pk, "temperature");
    msgpack_pack_double(&pk, 0.7);
    key(&pk, "stop");
    str(&pk, "\n\n", 2);
    assert_int_equal(serve(buf.data, buf.len, &lim, &before), 0);
    /* the counter sees msgpack-c's and the decoder's allocations, so a zero above means something */
    if (COUNT_ALLOCATIONS)
        assert_true(allocated >= buf.len);
    dsv4_proto_buf_clear(&buf);
}

/* The frame reader refuses an oversized or empty length before growing its buffer. */
static void test_reader_limits(void **state)
{
    struct dsv4_proto_reader r;
    struct dsv4_proto_error err;
    uint8_t *p;
    size_t avail;
    const uint8_t *payload;
    size_t len;
    static const uint8_t huge[] = { 0xff, 0xff, 0xff, 0xff, 0x90 };
    static const uint8_t just_over[] = { 0x00, 0x80, 0x00, 0x01 };   /* 8 MiB + 1 */
    static const uint8_t empty[] = { 0, 0, 0, 0 };

    const uint8_t *inputs[] = { huge, just_over, empty };
    const size_t sizes[] = { sizeof(huge), sizeof(just_over), sizeof(empty) };
    const int codes[] = { DSV4_PROTO_E_FRAME_TOO_LARGE, DSV4_PROTO_E_FRAME_TOO_LARGE, DSV4_PROTO_E_FRAME_EMPTY };
    for (int i = 0; i < 3; i++) {
        dsv4_proto_reader_init(&r, 0);
        assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), 0);
        assert_true(avail >= sizes[i]);
        memcpy(p, inputs[i], sizes[i]);
        dsv4_proto_reader_commit(&r, sizes[i]);
        assert_int_equal(dsv4_proto_reader_next(&r, &payload, &len, &err), -EBADMSG);
        assert_int_equal(err.code, codes[i]);
        assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), -EBADMSG);
        assert_int_equal(err.code, codes[i]);
        assert_true(r.cap <= DSV4_PROTO_READER_INITIAL);
        dsv4_proto_reader_clear(&r);
    }

    /* a frame of exactly the maximum, announced and then sent slowly: the buffer follows the bytes
     * received (at most twice them), not the announced length */
    dsv4_proto_reader_init(&r, 0);
    static const uint8_t max_frame[] = { 0x00, 0x80, 0x00, 0x00 };   /* 8 MiB */
    size_t sent = 0;
    assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), 0);
    memcpy(p, max_frame, 4);
    dsv4_proto_reader_commit(&r, 4);
    for (int k = 0; k < 200; k++) {
        assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), 0);
        size_t chunk = avail < 1000 ? avail : 1000;
        memset(p, 0xc0, chunk);
        dsv4_proto_reader_commit(&r, chunk);
        sent += chunk;
        assert_true(r.cap <= DSV4_PROTO_READER_INITIAL || r.cap <= 2 * (sent + 4));
        assert_int_equal(dsv4_proto_reader_next(&r, &payload, &len, &err), 0);
    }
    dsv4_proto_reader_clear(&r);

    /* a configured smaller maximum; exactly the maximum passes */
    dsv4_proto_reader_init(&r, 16);
    static const uint8_t ok16[] = { 0, 0, 0, 16 };
    static const uint8_t bad17[] = { 0, 0, 0, 17 };
    assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), 0);
    memcpy(p, ok16, 4);
    memset(p + 4, 0xc0, 16);
    memcpy(p + 20, bad17, 4);
    dsv4_proto_reader_commit(&r, 24);
    assert_int_equal(dsv4_proto_reader_next(&r, &payload, &len, &err), 1);
    assert_int_equal(len, 16);
    assert_int_equal(dsv4_proto_reader_next(&r, &payload, &len, &err), -EBADMSG);
    assert_int_equal(err.code, DSV4_PROTO_E_FRAME_TOO_LARGE);
    dsv4_proto_reader_clear(&r);

    /* a truncated frame stays pending: the caller sees it at EOF */
    dsv4_proto_reader_init(&r, 0);
    static const uint8_t cut[] = { 0, 0, 0, 9, 0x94, 0x00 };
    assert_int_equal(dsv4_proto_reader_space(&r, &p, &avail, &err), 0);
    memcpy(p, cut, sizeof(cut));
    dsv4_proto_reader_commit(&r, sizeof(cut));
    assert_int_equal(dsv4_proto_reader_next(&r, &payload, &len, &err), 0);
    assert_int_equal(dsv4_proto_reader_pending(&r), sizeof(cut));
    dsv4_proto_reader_clear(&r);
}

/* The validator's own limits and counts. */
static void test_validate_counts(void **state)
{
    struct dsv4_proto_limits lim;
    struct dsv4_proto_validate_info info;
    struct dsv4_proto_error err;
    size_t n;
    dsv4_proto_limits_server(&lim);
    /* [1, {"a": [nil, true]}, "xy"]: 1 + 1 + 1 + 1 + 1 + 2 + 1 = 8 objects, depth 3 */
    uint8_t *b = from_hex("93 01 81 a1 61 92 c0 c3 a2 7879", &n);
    assert_int_equal(dsv4_proto_validate(b, n, &lim, &info, &err), 0);
    assert_int_equal(info.elements, 8);
    assert_int_equal(info.depth, 3);
    lim.max_elements = 7;
    assert_int_equal(dsv4_proto_validate(b, n, &lim, &info, &err), -EBADMSG);
    assert_int_equal(err.code, DSV4_PROTO_E_TOO_MANY_ELEMENTS);
    dsv4_proto_limits_server(&lim);
    lim.max_depth = 2;
    assert_int_equal(dsv4_proto_validate(b, n, &lim, &info, &err), -EBADMSG);
    assert_int_equal(err.code, DSV4_PROTO_E_TOO_DEEP);
    dsv4_proto_limits_server(&lim);
    lim.max_str = 1;
    assert_int_equal(dsv4_proto_validate(b, n, &lim, &info, &err), -EBADMSG);
    assert_int_equal(err.code, DSV4_PROTO_E_STRING_TOO_LONG);
    dsv4_proto_limits_server(&lim);
    lim.max_frame = n - 1;
    assert_int_equal(dsv4_proto_validate(b, n, &lim, &info, &err), -EBADMSG);
    assert_int_equal(err.code, DSV4_PROTO_E_FRAME_TOO_LARGE);
    assert_int_equal(dsv4_proto_validate(b, 0, &lim, &info, &err), -EBADMSG);
    assert_int_equal(err.code, DSV4_PROTO_E_FRAME_EMPTY);
    /* every proper prefix is truncated */
    dsv4_proto_limits_server(&lim);
    for (size_t k = 1; k < n; k++) {
        assert_int_equal(dsv4_proto_validate(b, k, &lim, NULL, &err), -EBADMSG);
        assert_int_equal(err.code, DSV4_PROTO_E_TRUNCATED);
    }
    free(b);
}

/* ---- mutations of valid frames ---- */

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define CORPUS_MAX 16

struct corpus {
    struct dsv4_proto_buf frames[CORPUS_MAX];   /* one frame each, header included */
    size_t n;
};

static struct dsv4_proto_buf *corpus_next(struct corpus *c)
{
    assert_true(c->n < CORPUS_MAX);
    return &c->frames[c->n++];
}

static void build_requests(struct corpus *c)
{
    static const char *const stop[] = { "\n\n", "User:" };
    static const int32_t toks[] = { 0, 5, 17, 999 };
    struct dsv4_proto_chat_message msgs[] = { { DSV4_PROTO_ROLE_SYSTEM, "be brief", 8 },
                                             { DSV4_PROTO_ROLE_USER, "h\xc3\xa9llo", 6 } };
    struct dsv4_proto_generate g;
    dsv4_proto_generate_init(&g);
    g.prompt_kind = DSV4_PROTO_PROMPT_TEXT;
    g.prompt = "The capital of France is";
    g.prompt_len = strlen(g.prompt);
    g.stream = true;
    g.sampling.max_tokens = 16;
    g.sampling.has_seed = true;
    g.sampling.seed = 42;
    g.sampling.n_stop = 2;
    g.sampling.stop[0] = (char *)stop[0];
    g.sampling.stop[1] = (char *)stop[1];
    g.sampling.n_stop_token_ids = 2;
    g.sampling.stop_token_ids[0] = 1;
    g.sampling.stop_token_ids[1] = 2;
    g.sampling.logprobs = 5;
    assert_int_equal(dsv4_proto_encode_generate(corpus_next(c), 7, &g), 0);
    dsv4_proto_generate_init(&g);
    g.prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
    g.messages = msgs;
    g.n_messages = 2;
    g.thinking = true;
    assert_int_equal(dsv4_proto_encode_generate(corpus_next(c), 8, &g), 0);
    dsv4_proto_generate_init(&g);
    g.prompt_kind = DSV4_PROTO_PROMPT_TOKENS;
    g.tokens = (int32_t *)toks;
    g.n_tokens = 4;
    assert_int_equal(dsv4_proto_encode_generate(corpus_next(c), 9, &g), 0);
    struct dsv4_proto_hello h = { 1, "fuzz" };
    assert_int_equal(dsv4_proto_encode_hello(corpus_next(c), 1, &h), 0);
    struct dsv4_proto_cancel k = { 7 };
    assert_int_equal(dsv4_proto_encode_cancel(corpus_next(c), 2, &k), 0);
    struct dsv4_proto_tokenize t;
    dsv4_proto_tokenize_init(&t);
    t.prompt_kind = DSV4_PROTO_PROMPT_MESSAGES;
    t.messages = msgs;
    t.n_messages = 2;
    assert_int_equal(dsv4_proto_encode_tokenize(corpus_next(c), 3, &t), 0);
    struct dsv4_proto_tokens d = { (int32_t *)toks, 4 };
    assert_int_equal(dsv4_proto_encode_detokenize(corpus_next(c), 4, &d), 0);
    assert_int_equal(dsv4_proto_encode_stats(corpus_next(c), 5), 0);
}

static void build_answers(struct corpus *c)
{
    static int32_t toks[] = { 5, 17, 9 };
    struct dsv4_proto_logprob lp[3] = { { -0.5f, 2, { 5, 6 }, { -0.5f, -INFINITY } } };
    struct dsv4_proto_generate_result r = { .text = "abc", .text_len = 3, .tokens = toks, .n_tokens = 3,
                                            .finish_reason = DSV4_PROTO_FINISH_ERROR, .error_message = "engine",
                                            .usage = { 4, 3 }, .timings = { 1, 2, 3, 6 }, .logprobs = lp };
    assert_int_equal(dsv4_proto_encode_generate_result(corpus_next(c), 7, &r), 0);
    struct dsv4_proto_token_event ev = { 7, 17, "b", 1, true, lp[0] };
    assert_int_equal(dsv4_proto_encode_token(corpus_next(c), &ev), 0);
    struct dsv4_proto_hello_result hr = { .protocol = 1, .server = "dsv4d", .backend = "cpu",
                                          .model = { .name = "tiny", .vocab_size = 1000 } };
    assert_int_equal(dsv4_proto_encode_hello_result(corpus_next(c), 1, &hr), 0);
    struct dsv4_proto_stats st = { .backend = "cpu", .n_kernels = 1, .kernels = { "gemv" } };
    assert_int_equal(dsv4_proto_encode_stats_result(corpus_next(c), 5, &st), 0);
    struct dsv4_proto_health he = { DSV4_PROTO_HEALTH_LOADING, "weights" };
    assert_int_equal(dsv4_proto_encode_health_result(corpus_next(c), 6, &he), 0);
    assert_int_equal(dsv4_proto_encode_error(corpus_next(c), 8, DSV4_PROTO_E_QUEUE_FULL, NULL), 0);
    assert_int_equal(dsv4_proto_encode_error_notification(corpus_next(c), DSV4_PROTO_E_TRUNCATED, "cut"), 0);
}

/* The client's side: every result decoder on whatever arrives; none may fail other than cleanly. */
static void client_side(const uint8_t *p, size_t len)
{
    struct dsv4_proto_limits lim;
    struct dsv4_proto_message msg;
    struct dsv4_proto_error err;
    dsv4_proto_limits_client(&lim);
    if (dsv4_proto_message_decode(p, len, &lim, &msg, &err) == 0) {
        struct dsv4_proto_generate_result gr;
        struct dsv4_proto_hello_result hr;
        struct dsv4_proto_stats st;
        struct dsv4_proto_health he;
        struct dsv4_proto_tokens tk;
        struct dsv4_proto_text tx;
        struct dsv4_proto_token_event ev;
        struct dsv4_proto_error ne;
        bool b;
        if (dsv4_proto_decode_generate_result(&msg, &gr, &err) == 0)
            dsv4_proto_generate_result_clear(&gr);
        if (dsv4_proto_decode_hello_result(&msg, &hr, &err) == 0)
            dsv4_proto_hello_result_clear(&hr);
        if (dsv4_proto_decode_stats_result(&msg, &st, &err) == 0)
            dsv4_proto_stats_clear(&st);
        if (dsv4_proto_decode_health_result(&msg, &he, &err) == 0)
            dsv4_proto_health_clear(&he);
        if (dsv4_proto_decode_tokenize_result(&msg, &tk, &err) == 0)
            dsv4_proto_tokens_clear(&tk);
        if (dsv4_proto_decode_detokenize_result(&msg, &tx, &err) == 0)
            dsv4_proto_text_clear(&tx);
        if (dsv4_proto_decode_token(&msg, &ev, &err) == 0)
            dsv4_proto_token_event_clear(&ev);
        dsv4_proto_decode_error_notification(&msg, &ne, &err);
        dsv4_proto_decode_cancel_result(&msg, &b, &err);
    }
    dsv4_proto_message_clear(&msg);
}

static void mutate(struct dsv4_proto_buf *b)
{
    static const uint8_t interesting[] = { 0x00, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2,
                                           0xc4, 0xc6, 0xc7, 0xca, 0xcb, 0xcf, 0xd3, 0xd4, 0xd9, 0xdb, 0xdc,
                                           0xdd, 0xde, 0xdf, 0xe0, 0xff };
    unsigned n = 1 + (unsigned)(rnd() % 4);
    for (unsigned k = 0; k < n && b->len > 0; k++) {
        size_t at = rnd() % b->len;
        switch (rnd() % 5) {
        case 0: b->data[at] = (uint8_t)rnd(); break;
        case 1: b->data[at] = interesting[rnd() % sizeof(interesting)]; break;
        case 2: b->len = at; break;
        case 3: b->data[at] ^= (uint8_t)(1u << (rnd() % 8)); break;
        default: {
            /* repeat a slice at the end */
            size_t n2 = rnd() % (b->len - at) + 1;
            uint8_t *tmp = malloc(n2);
            assert_non_null(tmp);
            memcpy(tmp, b->data + at, n2);
            dsv4_proto_buf_append(b, tmp, n2);
            free(tmp);
            break;
        }
        }
    }
}

/* Random mutations of valid requests and answers: every outcome is a documented code, never a crash
 * (the sanitizer build checks the memory side), and whatever the pre-validator accepts msgpack-c
 * unpacks completely. */
static void test_mutations(void **state)
{
    struct corpus req = { 0 }, ans = { 0 };
    struct dsv4_proto_limits lim;
    size_t accepted = 0, rejected = 0;
    dsv4_proto_limits_server(&lim);
    build_requests(&req);
    build_answers(&ans);
    for (int i = 0; i < 50000; i++) {
        bool answers = i % 3 == 2;
        const struct corpus *c = answers ? &ans : &req;
        const struct dsv4_proto_buf *src = &c->frames[rnd() % c->n];
        struct dsv4_proto_buf b = { 0 };
        bool before;
        /* the payload only: a frame's length prefix is the reader's business, tested above */
        assert_int_equal(dsv4_proto_buf_append(&b, src->data + 4, src->len - 4), 0);
        mutate(&b);
        if (answers) {
            client_side(b.data, b.len);
        } else {
            int code = serve(b.data, b.len, &lim, &before);
            if (strcmp(dsv4_proto_code_name(code), "unknown") == 0)
                fail_msg("mutation %d: undocumented code %d", i, code);
            if (code == DSV4_PROTO_E_MALFORMED)
                assert_int_equal(dsv4_proto_validate(b.data, b.len, &lim, NULL, NULL), -EBADMSG);
            if (code)
                rejected++;
            else
                accepted++;
        }
        free(b.data);
    }
    /* the mutations exercise both outcomes */
    assert_true(accepted > 100);
    assert_true(rejected > 1000);
    for (size_t i = 0; i < req.n; i++)
        dsv4_proto_buf_clear(&req.frames[i]);
    for (size_t i = 0; i < ans.n; i++)
        dsv4_proto_buf_clear(&ans.frames[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_valid_request_passes),
        cmocka_unit_test(test_reader_limits),
        cmocka_unit_test(test_validate_counts),
        cmocka_unit_test(test_mutations),
    };
    rng_state = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    printf("# random seed %llu\n", (unsigned long long)rng_state);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
