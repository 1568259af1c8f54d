/* SPDX-License-Identifier: MIT */
/* Private to protocol/: msgpack-c packing into frames and typed reads of unpacked fields, the layer
 * below the messages: it knows no method, envelope or chat message (message_codec.h builds those on
 * it). Not installed and not for the daemon or the client: they use protocol/message.h. */
#ifndef DSV4_PROTOCOL_WIRE_H
#define DSV4_PROTOCOL_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <msgpack.h>

#include "protocol/codes.h"
#include "protocol/frame.h"

/* One frame being packed into out; a failed append rolls the buffer back in dsv4_wire_end(). */
struct dsv4_wire_enc {
    msgpack_packer pk;
    struct dsv4_proto_buf *out;
    size_t start;
    bool failed;
};

/* The frame header placeholder only; the caller packs the whole message. */
void dsv4_wire_begin_frame(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out);
/* Patch the length; 0, or -ENOMEM / -EMSGSIZE (payload above 2^32-1) with out restored. */
int dsv4_wire_end(struct dsv4_wire_enc *e);

void dsv4_wire_str(msgpack_packer *pk, const char *s, size_t len);
/* NULL packs nil. */
void dsv4_wire_cstr(msgpack_packer *pk, const char *s);
void dsv4_wire_key(msgpack_packer *pk, const char *key);
void dsv4_wire_bool(msgpack_packer *pk, bool v);
/* bin of little-endian int32 */
void dsv4_wire_tokens(msgpack_packer *pk, const int32_t *ids, uint32_t n);

/* Field access. ctx names the message ("generate"), field the key, for messages such as
 * "generate: temperature must be a number". Every reader returns 0 or -EBADMSG / -ENOMEM with err set. */

/* Keys are str, valid UTF-8, unique among names; strict rejects keys outside names (UNKNOWN_FIELD). */
int dsv4_wire_check_keys(const msgpack_object *map, const char *const *names, size_t n_names, bool strict,
                         const char *ctx, struct dsv4_proto_error *err);
/* Value of key in map (map may be NULL), NULL when absent. */
const msgpack_object *dsv4_wire_get(const msgpack_object *map, const char *key);

/* str of at most max bytes (0: no cap besides the validator's), valid UTF-8, copied NUL-terminated. */
int dsv4_wire_read_str(const msgpack_object *o, const char *ctx, const char *field, size_t max, char **ret,
                       size_t *ret_len, struct dsv4_proto_error *err);
int dsv4_wire_read_bool(const msgpack_object *o, const char *ctx, const char *field, bool *ret,
                        struct dsv4_proto_error *err);
/* Integers: WRONG_TYPE unless an integer; outside [lo, hi]: bad_code. */
int dsv4_wire_read_int(const msgpack_object *o, const char *ctx, const char *field, int64_t lo, int64_t hi,
                       int bad_code, int64_t *ret, struct dsv4_proto_error *err);
int dsv4_wire_read_u64(const msgpack_object *o, const char *ctx, const char *field, int bad_code, uint64_t *ret,
                       struct dsv4_proto_error *err);
int dsv4_wire_read_u32(const msgpack_object *o, const char *ctx, const char *field, uint32_t *ret,
                       struct dsv4_proto_error *err);
/* Numbers (int or float): WRONG_TYPE otherwise; NaN, infinities and values outside [lo, hi]: bad_code. */
int dsv4_wire_read_num(const msgpack_object *o, const char *ctx, const char *field, double lo, double hi,
                       int bad_code, double *ret, struct dsv4_proto_error *err);
/* bin of little-endian int32: BAD_TOKENS when its length is not a multiple of 4 (or 0 and !allow_empty). */
int dsv4_wire_read_tokens(const msgpack_object *o, const char *ctx, const char *field, bool allow_empty,
                          int32_t **ret, uint32_t *ret_n, struct dsv4_proto_error *err);
/* Optional fields of a map (map may be NULL): absent leaves *dst unchanged and returns 0. */
int dsv4_wire_opt_u32(const msgpack_object *map, const char *key, const char *ctx, uint32_t *dst,
                      struct dsv4_proto_error *err);
int dsv4_wire_opt_u64(const msgpack_object *map, const char *key, const char *ctx, uint64_t *dst,
                      struct dsv4_proto_error *err);
int dsv4_wire_opt_i32(const msgpack_object *map, const char *key, const char *ctx, int32_t *dst,
                      struct dsv4_proto_error *err);
/* Any number but NaN (a log-probability may be -inf). */
int dsv4_wire_opt_f64(const msgpack_object *map, const char *key, const char *ctx, double *dst,
                      struct dsv4_proto_error *err);
int dsv4_wire_opt_bool(const msgpack_object *map, const char *key, const char *ctx, bool *dst,
                       struct dsv4_proto_error *err);
/* Frees a previous *dst only on success. */
int dsv4_wire_opt_str(const msgpack_object *map, const char *key, const char *ctx, size_t max, char **dst,
                      size_t *dst_len, struct dsv4_proto_error *err);

#endif
