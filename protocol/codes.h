/* SPDX-License-Identifier: MIT */
/* Protocol error codes: one stable number and one stable name per failure a peer can cause.
 * The numbers travel on the wire ({code, name, message} maps) and are documented in doc/PROTOCOL.md;
 * never renumber one, only add. Groups:
 *   1xx  framing and envelope: the frame cannot be trusted, the server sends an `error` notification
 *        and closes the connection (dsv4_proto_code_is_fatal() says which);
 *   2xx  request shape: answered with an error response to that msgid, the connection stays;
 *   3xx  values that need the model (vocab, context) or fall outside sane ranges;
 *   4xx  configured limits;
 *   5xx  server state. */
#ifndef DSV4_PROTOCOL_CODES_H
#define DSV4_PROTOCOL_CODES_H

#include <stdbool.h>
#include <stddef.h>

enum dsv4_proto_code {
    DSV4_PROTO_OK = 0,

    /* 1xx: fatal for the connection */
    DSV4_PROTO_E_FRAME_TOO_LARGE = 100,    /* length prefix above the receiver's max frame size */
    DSV4_PROTO_E_FRAME_EMPTY = 101,        /* length prefix 0 */
    DSV4_PROTO_E_TRUNCATED = 102,          /* a length or count claims more bytes than the frame holds */
    DSV4_PROTO_E_MALFORMED = 103,          /* reserved byte 0xc1, ext types, or other non-msgpack bytes */
    DSV4_PROTO_E_TRAILING_BYTES = 104,     /* bytes after the one msgpack value of a frame */
    DSV4_PROTO_E_TOO_DEEP = 105,           /* containers nested deeper than the depth cap */
    DSV4_PROTO_E_TOO_MANY_ELEMENTS = 106,  /* more objects in one frame than the element cap */
    DSV4_PROTO_E_STRING_TOO_LONG = 107,    /* one str above the string cap */
    DSV4_PROTO_E_BIN_TOO_LONG = 108,       /* one bin above the bin cap */
    DSV4_PROTO_E_NOT_RPC = 109,            /* not [0,msgid,method,params] / [1,msgid,error,result] / [2,method,params] */
    DSV4_PROTO_E_BAD_MSGID = 110,          /* msgid not an integer in [0, 2^32) */
    DSV4_PROTO_E_UNEXPECTED_MESSAGE = 111, /* a message kind or notification the receiver never accepts */

    /* 2xx: request shape */
    DSV4_PROTO_E_UNKNOWN_METHOD = 200,
    DSV4_PROTO_E_WRONG_TYPE = 201,         /* params or a field has the wrong msgpack type */
    DSV4_PROTO_E_MISSING_FIELD = 202,
    DSV4_PROTO_E_UNKNOWN_FIELD = 203,      /* requests are strict: a misspelt option is an error */
    DSV4_PROTO_E_INVALID_UTF8 = 204,
    DSV4_PROTO_E_DUPLICATE_FIELD = 205,
    DSV4_PROTO_E_PROMPT_CONFLICT = 206,    /* not exactly one of prompt, messages, tokens */
    DSV4_PROTO_E_BAD_TOKENS = 207,         /* tokens bin empty or its length not a multiple of 4 */
    DSV4_PROTO_E_BAD_ROLE = 208,           /* chat message role not system, user or assistant */
    DSV4_PROTO_E_VERSION_UNSUPPORTED = 209,
    DSV4_PROTO_E_DUPLICATE_MSGID = 210,    /* msgid of a request still in flight on this connection */
    DSV4_PROTO_E_BAD_VALUE = 211,          /* a non-sampling value out of its documented range */

    /* 3xx: values */
    DSV4_PROTO_E_TOKEN_OUT_OF_VOCAB = 300,
    DSV4_PROTO_E_PROMPT_TOO_LONG = 301,    /* prompt tokens above max_prompt_tokens or not below the context */
    DSV4_PROTO_E_BAD_SAMPLING = 302,       /* a sampling parameter NaN, infinite or outside its range */

    /* 4xx: limits */
    DSV4_PROTO_E_TOO_MANY_CONNECTIONS = 400,
    DSV4_PROTO_E_QUEUE_FULL = 401,
    DSV4_PROTO_E_TOO_MANY_REQUESTS = 402,  /* requests in flight on this connection */
    DSV4_PROTO_E_TOO_MANY_STOP = 403,      /* too many / too long stop strings or stop_token_ids */
    DSV4_PROTO_E_TOO_MANY_MESSAGES = 404,  /* chat messages above DSV4_PROTO_MAX_MESSAGES */
    DSV4_PROTO_E_MAX_TOKENS_LIMIT = 405,   /* max_tokens above the server's configured limit */
    DSV4_PROTO_E_REPLY_TOO_LARGE = 406,    /* the result would exceed the largest frame the server sends */

    /* 5xx: server state */
    DSV4_PROTO_E_NOT_READY = 500,          /* still loading */
    DSV4_PROTO_E_DRAINING = 501,           /* shutting down, takes no new work */
    DSV4_PROTO_E_INTERNAL = 502,
    DSV4_PROTO_E_OUT_OF_MEMORY = 503,
};

/* Stable lower-case name ("invalid_utf8"), or "unknown" for a number this build does not know. */
const char *dsv4_proto_code_name(int code);

/* One-line description of the code, used when no specific message was set. */
const char *dsv4_proto_code_describe(int code);

/* True for 1xx: the stream can no longer be trusted; send an `error` notification and close. */
bool dsv4_proto_code_is_fatal(int code);

/* Longest message an error carries (bytes, NUL included); longer ones are truncated. */
#define DSV4_PROTO_ERROR_MESSAGE_MAX 256

/* An error as it travels: a code and a message naming the field, the value and the limit. */
struct dsv4_proto_error {
    int code;                                   /* enum dsv4_proto_code */
    char message[DSV4_PROTO_ERROR_MESSAGE_MAX];
};

/* Fill err (may be NULL) and return -EBADMSG (or -ENOMEM for DSV4_PROTO_E_OUT_OF_MEMORY), so call sites
 * can write `return dsv4_proto_error_set(err, DSV4_PROTO_E_MISSING_FIELD, "generate: no %s", "prompt");`. */
int dsv4_proto_error_set(struct dsv4_proto_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#ifdef __clang_analyzer__
/* As engine/error.h does for dsv4_error_set: scan-build cannot see that the result is negative. */
static inline int dsv4_proto_error_negative(int rc)
{
    __builtin_assume(rc < 0);
    return rc;
}
#define dsv4_proto_error_set(...) dsv4_proto_error_negative(dsv4_proto_error_set(__VA_ARGS__))
#endif

#endif
