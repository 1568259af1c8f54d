/* SPDX-License-Identifier: MIT */
/* Frames: byte buffer for output, incremental reader for input. */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "protocol/frame.h"

void dsv4_proto_buf_init(struct dsv4_proto_buf *b)
{
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    b->head = 0;
}

/* Give the consumed bytes in front of data back to the storage (data then starts it). */
static void buf_rewind(struct dsv4_proto_buf *b)
{
    if (!b->head)
        return;
    b->data -= b->head;
    b->cap += b->head;
    b->head = 0;
}

void dsv4_proto_buf_clear(struct dsv4_proto_buf *b)
{
    if (!b)
        return;
    buf_rewind(b);
    free(b->data);
    dsv4_proto_buf_init(b);
}

void dsv4_proto_buf_reset(struct dsv4_proto_buf *b)
{
    buf_rewind(b);
    b->len = 0;
}

int dsv4_proto_buf_append(struct dsv4_proto_buf *b, const void *data, size_t n)
{
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->len < n) {
            if (cap > SIZE_MAX / 2)
                return -ENOMEM;
            cap *= 2;
        }
        if (cap > SIZE_MAX - b->head)
            return -ENOMEM;
        uint8_t *p = realloc(b->data ? b->data - b->head : NULL, b->head + cap);
        if (!p)
            return -ENOMEM;
        b->data = p + b->head;
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, data, n);
    b->len += n;
    return 0;
}

void dsv4_proto_buf_consume(struct dsv4_proto_buf *b, size_t n)
{
    if (n >= b->len) {
        dsv4_proto_buf_reset(b);
        return;
    }
    b->data += n;
    b->len -= n;
    b->cap -= n;
    b->head += n;
    /* Moving the rest down now costs no more than what was dropped since it last moved: linear in
     * all, and the dead space in front never exceeds what is held. */
    if (b->head >= b->len) {
        memmove(b->data - b->head, b->data, b->len);
        buf_rewind(b);
    }
}

void dsv4_proto_frame_put_header(uint8_t hdr[DSV4_PROTO_FRAME_HEADER], uint32_t payload_len)
{
    hdr[0] = (uint8_t)(payload_len >> 24);
    hdr[1] = (uint8_t)(payload_len >> 16);
    hdr[2] = (uint8_t)(payload_len >> 8);
    hdr[3] = (uint8_t)payload_len;
}

uint32_t dsv4_proto_frame_get_header(const uint8_t hdr[DSV4_PROTO_FRAME_HEADER])
{
    return (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
}

void dsv4_proto_reader_init(struct dsv4_proto_reader *r, size_t max_frame)
{
    r->buf = NULL;
    r->start = 0;
    r->len = 0;
    r->cap = 0;
    if (max_frame == 0)
        max_frame = DSV4_PROTO_DEFAULT_MAX_FRAME;
    if (max_frame > DSV4_PROTO_MAX_FRAME_LIMIT)
        max_frame = DSV4_PROTO_MAX_FRAME_LIMIT;
    r->max_frame = max_frame;
}

void dsv4_proto_reader_clear(struct dsv4_proto_reader *r)
{
    if (!r)
        return;
    free(r->buf);
    dsv4_proto_reader_init(r, r->max_frame);
}

size_t dsv4_proto_reader_pending(const struct dsv4_proto_reader *r)
{
    return r->len - r->start;
}

/* 1 with the length the pending header announces, 0 while fewer than 4 bytes are held, <0 when that
 * length is unacceptable. */
static int pending_frame(const struct dsv4_proto_reader *r, uint32_t *ret_len, struct dsv4_proto_error *err)
{
    *ret_len = 0;
    if (r->len - r->start < DSV4_PROTO_FRAME_HEADER)
        return 0;
    uint32_t n = dsv4_proto_frame_get_header(r->buf + r->start);
    if (n == 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_FRAME_EMPTY, "frame with length 0");
    if (n > r->max_frame)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_FRAME_TOO_LARGE,
                                    "frame of %u bytes, above the maximum frame size %zu", n, r->max_frame);
    *ret_len = n;
    return 1;
}

int dsv4_proto_reader_space(struct dsv4_proto_reader *r, uint8_t **ptr, size_t *avail,
                            struct dsv4_proto_error *err)
{
    if (r->start > 0) {
        size_t held = r->len - r->start;
        if (held == 0 && r->cap > DSV4_PROTO_READER_INITIAL) {
            /* give back the storage of a large frame once it is consumed */
            free(r->buf);
            r->buf = NULL;
            r->cap = 0;
        } else if (held) {
            memmove(r->buf, r->buf + r->start, held);
        }
        r->start = 0;
        r->len = held;
    }
    size_t need = DSV4_PROTO_READER_INITIAL;
    uint32_t n;
    int rc = pending_frame(r, &n, err);
    if (rc < 0)
        return rc;
    if (rc > 0 && (size_t)n + DSV4_PROTO_FRAME_HEADER > need && r->len == r->cap) {
        /* Grow only when full, by doubling up to the frame: a peer that announces a large frame and
         * then sends slowly holds at most twice what it actually sent. */
        need = r->cap * 2;
        if (need > (size_t)n + DSV4_PROTO_FRAME_HEADER)
            need = (size_t)n + DSV4_PROTO_FRAME_HEADER;
    }
    if (r->cap < need) {
        uint8_t *p = realloc(r->buf, need);
        if (!p)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "no memory for a %zu-byte frame", need);
        r->buf = p;
        r->cap = need;
    }
    *ptr = r->buf + r->len;
    *avail = r->cap - r->len;
    return 0;
}

void dsv4_proto_reader_commit(struct dsv4_proto_reader *r, size_t n)
{
    r->len += n;
}

int dsv4_proto_reader_next(struct dsv4_proto_reader *r, const uint8_t **payload, size_t *len,
                           struct dsv4_proto_error *err)
{
    uint32_t n;
    int rc = pending_frame(r, &n, err);
    if (rc <= 0)
        return rc;
    if (r->len - r->start - DSV4_PROTO_FRAME_HEADER < n)
        return 0;
    *payload = r->buf + r->start + DSV4_PROTO_FRAME_HEADER;
    *len = n;
    r->start += DSV4_PROTO_FRAME_HEADER + (size_t)n;
    return 1;
}
