/* SPDX-License-Identifier: MIT */
/* Test helper for the fake servers that speak the dsv4d protocol to the client under test. Header-only
 * so each test program includes what it needs. */
#ifndef DSV4_TESTS_PROTO_TEST_UTIL_H
#define DSV4_TESTS_PROTO_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "protocol/message.h"
#include "protocol/message_codec.h"
#include "protocol/wire.h"

/* Send all of b's bytes on fd, then empty b. Stops early when the peer has gone (the client under test
 * may close first; MSG_NOSIGNAL keeps that from raising SIGPIPE): the test then sees it on its side. */
static inline void proto_test_send_all(int fd, struct dsv4_proto_buf *b)
{
    size_t off = 0;
    while (off < b->len) {
        ssize_t n = send(fd, b->data + off, b->len - off, MSG_NOSIGNAL);
        if (n <= 0)
            break;
        off += (size_t)n;
    }
    dsv4_proto_buf_reset(b);
}

/* A health reply with a status this build does not know ("rebooting", a newer server's), packed by
 * hand into out: the encoder only knows this build's statuses. dsv4_wire_end's result. */
static inline int proto_test_newer_health(struct dsv4_proto_buf *out, uint32_t msgid)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(&e.pk, 2);
    dsv4_wire_key(&e.pk, "status");
    dsv4_wire_cstr(&e.pk, "rebooting");
    dsv4_wire_key(&e.pk, "reason");
    dsv4_wire_cstr(&e.pk, "swapping the model");
    return dsv4_wire_end(&e);
}

#endif
