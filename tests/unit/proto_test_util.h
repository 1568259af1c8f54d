/* SPDX-License-Identifier: MIT */
/* Test helper for the fake servers that speak the dsv4d protocol to the client under test. Header-only
 * so each test program includes what it needs. */
#ifndef DSV4_TESTS_PROTO_TEST_UTIL_H
#define DSV4_TESTS_PROTO_TEST_UTIL_H

#include <stddef.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "protocol/message.h"

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

#endif
