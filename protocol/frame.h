/* SPDX-License-Identifier: MIT */
/* Frames: a 4-byte big-endian payload length, then exactly one msgpack value of that length.
 *
 * struct dsv4_proto_buf is the output side: every encoder in protocol/message.h appends one whole frame
 * (header + payload), so a caller writes buf.data[0..len) to the socket as is.
 * struct dsv4_proto_reader is the input side for non-blocking sockets: read into the space it offers,
 * commit, then take complete frames out. It never allocates more than header + the announced length,
 * and refuses an announced length above max_frame before allocating anything. */
#ifndef DSV4_PROTOCOL_FRAME_H
#define DSV4_PROTOCOL_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "protocol/codes.h"

#define DSV4_PROTO_FRAME_HEADER 4u
/* Server default for the largest payload it accepts (configurable). */
#define DSV4_PROTO_DEFAULT_MAX_FRAME (8u << 20)
/* Client default for the largest payload it accepts: results carry whole texts and token arrays. */
#define DSV4_PROTO_CLIENT_MAX_FRAME (64u << 20)
/* Hard ceiling for any configured max frame (the length prefix is 32 bits). */
#define DSV4_PROTO_MAX_FRAME_LIMIT (1u << 30)
/* First allocation of a reader's buffer; it grows to fit the current frame only. */
#define DSV4_PROTO_READER_INITIAL (16u << 10)

/* Growable byte buffer. Zero-initialised is a valid empty buffer. */
struct dsv4_proto_buf {
    uint8_t *data;      /* the bytes held: data[0..len) */
    size_t len;
    size_t cap;         /* storage from data on */
    size_t head;        /* consumed bytes still in front of data: the storage starts at data - head */
};

void dsv4_proto_buf_init(struct dsv4_proto_buf *b);
/* Frees the storage; accepts NULL. */
void dsv4_proto_buf_clear(struct dsv4_proto_buf *b);
/* Forget the contents, keep the storage. */
void dsv4_proto_buf_reset(struct dsv4_proto_buf *b);
/* Append n bytes; 0 or -ENOMEM. */
int dsv4_proto_buf_append(struct dsv4_proto_buf *b, const void *data, size_t n);
/* Drop the first n bytes (after a partial write(2)). The bytes left move only once no more of them are
 * left than were dropped since they last moved, so draining a backlog costs about its size. */
void dsv4_proto_buf_consume(struct dsv4_proto_buf *b, size_t n);

/* Write / read the 4-byte big-endian length prefix. */
void dsv4_proto_frame_put_header(uint8_t hdr[DSV4_PROTO_FRAME_HEADER], uint32_t payload_len);
uint32_t dsv4_proto_frame_get_header(const uint8_t hdr[DSV4_PROTO_FRAME_HEADER]);

/* Incremental frame reader. */
struct dsv4_proto_reader {
    uint8_t *buf;
    size_t start;      /* first unconsumed byte */
    size_t len;        /* bytes held, from 0 */
    size_t cap;
    size_t max_frame;  /* payload bytes */
};

/* max_frame 0 means DSV4_PROTO_DEFAULT_MAX_FRAME; values above DSV4_PROTO_MAX_FRAME_LIMIT are clamped. */
void dsv4_proto_reader_init(struct dsv4_proto_reader *r, size_t max_frame);
/* Frees the buffer; accepts NULL. */
void dsv4_proto_reader_clear(struct dsv4_proto_reader *r);

/* Space to read(2) into: *ptr and *avail (0 only while a complete frame is waiting: take it with
 * dsv4_proto_reader_next() first). The buffer never exceeds max(DSV4_PROTO_READER_INITIAL, 4 + the
 * length of the frame being assembled), nor twice the bytes received: it grows only after that length
 * was checked, and by doubling when full. Returns 0, -ENOMEM, or -EBADMSG with err = DSV4_PROTO_E_FRAME_TOO_LARGE / FRAME_EMPTY when the
 * pending header is already unacceptable (the connection must then be closed). */
int dsv4_proto_reader_space(struct dsv4_proto_reader *r, uint8_t **ptr, size_t *avail,
                            struct dsv4_proto_error *err);
/* Record that n bytes were written into the space just offered. */
void dsv4_proto_reader_commit(struct dsv4_proto_reader *r, size_t n);

/* Take the next complete frame: returns 1 with *payload and *len pointing into the reader (valid until the
 * next reader call), 0 when more bytes are needed, -EBADMSG (err filled: FRAME_TOO_LARGE, FRAME_EMPTY)
 * when the announced length is unacceptable. */
int dsv4_proto_reader_next(struct dsv4_proto_reader *r, const uint8_t **payload, size_t *len,
                           struct dsv4_proto_error *err);

/* Bytes held that do not form a complete frame yet (non-zero at EOF means the peer sent a truncated
 * frame). */
size_t dsv4_proto_reader_pending(const struct dsv4_proto_reader *r);

#endif
