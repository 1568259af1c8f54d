/* SPDX-License-Identifier: MIT */
/* Private to protocol/: what generate.c takes from message.c (the envelope, the chat-message list),
 * built on the low-level codec (wire.h), which knows nothing of methods, envelopes or chat messages. */
#ifndef DSV4_PROTOCOL_MESSAGE_CODEC_H
#define DSV4_PROTOCOL_MESSAGE_CODEC_H

#include <stdint.h>
#include <msgpack.h>

#include "protocol/message.h"
#include "protocol/wire.h"

/* message.c: the msgpack-rpc envelope. Each begin writes the frame header placeholder and the envelope
 * up to where the caller packs exactly one value: the params map (request, notification; wrapped in
 * a one-element array) or the result; dsv4_wire_end() closes the frame. */
void dsv4_proto_begin_request(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out, uint32_t msgid,
                              enum dsv4_proto_method method);
void dsv4_proto_begin_response(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out, uint32_t msgid);
void dsv4_proto_begin_notification(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out,
                                   enum dsv4_proto_method method);
/* The params map of a request or notification, or the result map of a response; *ret NULL when a request
 * carried no params (allowed: the caller then sees every field absent). Anything else: WRONG_TYPE. */
int dsv4_proto_body_map(const struct dsv4_proto_message *msg, const char *ctx, const msgpack_object **ret,
                        struct dsv4_proto_error *err);

/* message.c: the chat-message list [{role, content}, ...] of generate and tokenize. */
int dsv4_proto_read_chat_messages(const msgpack_object *o, const char *ctx, struct dsv4_proto_chat_message **ret,
                                  uint32_t *ret_n, struct dsv4_proto_error *err);
void dsv4_proto_free_chat_messages(struct dsv4_proto_chat_message *m, uint32_t n);
void dsv4_proto_pack_chat_messages(msgpack_packer *pk, const struct dsv4_proto_chat_message *m, uint32_t n);

#endif
