/* SPDX-License-Identifier: MIT */
/* Pre-validation of one msgpack payload before msgpack-c sees it.
 *
 * msgpack-c sizes its allocations from the counts a message claims: an array header 0xdd + 4 bytes
 * claims 2^32 elements and makes it reserve 2^32 * sizeof(msgpack_object) = 96 GiB from 5 bytes.
 * dsv4_proto_validate() walks the bytes without allocating anything and checks, in one pass:
 *   - every str/bin/ext length and every array/map count against the bytes actually left (each element
 *     needs at least one byte, each map entry two), so no claim can exceed the frame;
 *   - container depth <= max_depth, total objects <= max_elements, each str <= max_str, each bin <= max_bin;
 *   - no reserved byte 0xc1, no ext types (the protocol uses none);
 *   - exactly one value, no trailing bytes.
 * Only when it returns 0 may the payload be handed to msgpack-c, whose allocation is then bounded by
 * info.elements * sizeof(msgpack_object) plus one zone chunk. UTF-8 is not checked here: that is a
 * per-field error answered to the request's msgid (protocol/message.h). */
#ifndef DSV4_PROTOCOL_VALIDATE_H
#define DSV4_PROTOCOL_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

#include "protocol/codes.h"

/* Server defaults (dsv4_proto_limits_server). */
#define DSV4_PROTO_DEFAULT_MAX_DEPTH 16u
#define DSV4_PROTO_DEFAULT_MAX_ELEMENTS (1u << 16)
#define DSV4_PROTO_DEFAULT_MAX_STR (4u << 20)
#define DSV4_PROTO_DEFAULT_MAX_BIN (4u << 20)   /* 1 Mi tokens of int32 */
/* Client defaults (dsv4_proto_limits_client): results with logprobs hold many small objects. */
#define DSV4_PROTO_CLIENT_MAX_ELEMENTS (1u << 24)
#define DSV4_PROTO_CLIENT_MAX_STR (64u << 20)
#define DSV4_PROTO_CLIENT_MAX_BIN (64u << 20)
/* The walker keeps one counter per open container on the stack: this bounds any configured depth. */
#define DSV4_PROTO_MAX_DEPTH_LIMIT 64u

struct dsv4_proto_limits {
    size_t max_frame;       /* payload bytes (the reader enforces it; validate re-checks len) */
    uint32_t max_depth;     /* open containers at once; the top-level array is depth 1 */
    uint32_t max_elements;  /* objects of any type, containers and map keys included */
    uint32_t max_str;       /* bytes of one str */
    uint32_t max_bin;       /* bytes of one bin */
};

void dsv4_proto_limits_server(struct dsv4_proto_limits *lim);
void dsv4_proto_limits_client(struct dsv4_proto_limits *lim);

/* What the walk saw, for the allocation bound and for tests. */
struct dsv4_proto_validate_info {
    uint32_t elements;
    uint32_t depth;         /* deepest nesting seen */
};

/* Returns 0, or -EBADMSG with err->code one of DSV4_PROTO_E_{FRAME_TOO_LARGE, FRAME_EMPTY, TRUNCATED,
 * MALFORMED, TRAILING_BYTES, TOO_DEEP, TOO_MANY_ELEMENTS, STRING_TOO_LONG, BIN_TOO_LONG} and a message
 * giving the byte offset and the numbers. info and err may be NULL. Allocates nothing. */
int dsv4_proto_validate(const uint8_t *buf, size_t len, const struct dsv4_proto_limits *lim,
                        struct dsv4_proto_validate_info *info, struct dsv4_proto_error *err);

#endif
