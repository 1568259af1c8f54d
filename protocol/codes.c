/* SPDX-License-Identifier: MIT */
/* Protocol error codes: names, descriptions, and the error struct. */
#include "build-config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/utf8.h"
#include "protocol/codes.h"

struct code_entry {
    int code;
    const char *name;
    const char *describe;
};

static const struct code_entry codes[] = {
    { DSV4_PROTO_OK, "ok", "success" },
    { DSV4_PROTO_E_FRAME_TOO_LARGE, "frame_too_large", "frame length above the maximum frame size" },
    { DSV4_PROTO_E_FRAME_EMPTY, "frame_empty", "frame of length 0" },
    { DSV4_PROTO_E_TRUNCATED, "truncated", "a length or count claims more bytes than the frame holds" },
    { DSV4_PROTO_E_MALFORMED, "malformed", "bytes that are not a msgpack value the protocol accepts" },
    { DSV4_PROTO_E_TRAILING_BYTES, "trailing_bytes", "bytes after the msgpack value of the frame" },
    { DSV4_PROTO_E_TOO_DEEP, "too_deep", "containers nested deeper than the depth limit" },
    { DSV4_PROTO_E_TOO_MANY_ELEMENTS, "too_many_elements", "more msgpack objects than the element limit" },
    { DSV4_PROTO_E_STRING_TOO_LONG, "string_too_long", "a string longer than the string limit" },
    { DSV4_PROTO_E_BIN_TOO_LONG, "bin_too_long", "a bin longer than the bin limit" },
    { DSV4_PROTO_E_NOT_RPC, "not_rpc", "not a msgpack-rpc request, response or notification" },
    { DSV4_PROTO_E_BAD_MSGID, "bad_msgid", "msgid is not an integer in [0, 2^32)" },
    { DSV4_PROTO_E_UNEXPECTED_MESSAGE, "unexpected_message", "a message the receiver does not accept" },
    { DSV4_PROTO_E_UNKNOWN_METHOD, "unknown_method", "unknown method" },
    { DSV4_PROTO_E_WRONG_TYPE, "wrong_type", "a field has the wrong type" },
    { DSV4_PROTO_E_MISSING_FIELD, "missing_field", "a required field is missing" },
    { DSV4_PROTO_E_UNKNOWN_FIELD, "unknown_field", "unknown field" },
    { DSV4_PROTO_E_INVALID_UTF8, "invalid_utf8", "a string is not valid UTF-8" },
    { DSV4_PROTO_E_DUPLICATE_FIELD, "duplicate_field", "a field appears twice" },
    { DSV4_PROTO_E_PROMPT_CONFLICT, "prompt_conflict", "give exactly one of prompt, messages, tokens" },
    { DSV4_PROTO_E_BAD_TOKENS, "bad_tokens", "tokens must be a non-empty bin of little-endian int32" },
    { DSV4_PROTO_E_BAD_ROLE, "bad_role", "role must be system, user or assistant" },
    { DSV4_PROTO_E_VERSION_UNSUPPORTED, "version_unsupported", "protocol version not supported" },
    { DSV4_PROTO_E_DUPLICATE_MSGID, "duplicate_msgid", "msgid already in flight on this connection" },
    { DSV4_PROTO_E_BAD_VALUE, "bad_value", "a value is outside its documented range" },
    { DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB, "token_out_of_vocab", "a token id is outside the vocabulary" },
    { DSV4_PROTO_E_PROMPT_TOO_LONG, "prompt_too_long", "the prompt does not fit the context" },
    { DSV4_PROTO_E_BAD_SAMPLING, "bad_sampling", "a sampling parameter is outside its range" },
    { DSV4_PROTO_E_TOO_MANY_CONNECTIONS, "too_many_connections", "connection limit reached" },
    { DSV4_PROTO_E_QUEUE_FULL, "queue_full", "request queue is full" },
    { DSV4_PROTO_E_TOO_MANY_REQUESTS, "too_many_requests", "too many requests in flight on this connection" },
    { DSV4_PROTO_E_TOO_MANY_STOP, "too_many_stop", "too many or too long stop strings or stop token ids" },
    { DSV4_PROTO_E_TOO_MANY_MESSAGES, "too_many_messages", "too many chat messages" },
    { DSV4_PROTO_E_MAX_TOKENS_LIMIT, "max_tokens_limit", "max_tokens above the server limit" },
    { DSV4_PROTO_E_REPLY_TOO_LARGE, "reply_too_large", "the result is larger than the server sends in one frame" },
    { DSV4_PROTO_E_NOT_READY, "not_ready", "the server is still loading" },
    { DSV4_PROTO_E_DRAINING, "draining", "the server is shutting down" },
    { DSV4_PROTO_E_INTERNAL, "internal", "internal server error" },
    { DSV4_PROTO_E_OUT_OF_MEMORY, "out_of_memory", "out of memory" },
};

static const struct code_entry *find(int code)
{
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++)
        if (codes[i].code == code)
            return &codes[i];
    return NULL;
}

const char *dsv4_proto_code_name(int code)
{
    const struct code_entry *e = find(code);
    return e ? e->name : "unknown";
}

const char *dsv4_proto_code_describe(int code)
{
    const struct code_entry *e = find(code);
    return e ? e->describe : "unknown error code";
}

bool dsv4_proto_code_is_fatal(int code)
{
    return code >= 100 && code < 200;
}

int (dsv4_proto_error_set)(struct dsv4_proto_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        err->code = code;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
        /* The message goes out as a msgpack str (UTF-8). A name it quotes (cut to a few bytes) or a
         * message it holds may have been cut inside a character: it ends before that character. */
        err->message[dsv4_utf8_valid_prefix(err->message, strlen(err->message))] = 0;
    }
    return code == DSV4_PROTO_E_OUT_OF_MEMORY ? -ENOMEM : -EBADMSG;
}
