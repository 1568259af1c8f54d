/* SPDX-License-Identifier: MIT */
/* msgpack-c packing into frames, and typed, bounded reads of unpacked fields. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "protocol/wire.h"

static int write_cb(void *data, const char *buf, size_t len)
{
    struct dsv4_wire_enc *e = data;
    if (e->failed)
        return -1;
    if (dsv4_proto_buf_append(e->out, buf, len) < 0) {
        e->failed = true;
        return -1;
    }
    return 0;
}

void dsv4_wire_begin_frame(struct dsv4_wire_enc *e, struct dsv4_proto_buf *out)
{
    static const uint8_t zero[DSV4_PROTO_FRAME_HEADER];
    e->out = out;
    e->start = out->len;
    e->failed = dsv4_proto_buf_append(out, zero, sizeof(zero)) < 0;
    msgpack_packer_init(&e->pk, e, write_cb);
}

int dsv4_wire_end(struct dsv4_wire_enc *e)
{
    size_t payload = e->out->len - e->start - DSV4_PROTO_FRAME_HEADER;
    int rc = e->failed ? -ENOMEM : payload > UINT32_MAX ? -EMSGSIZE : 0;
    if (rc < 0) {
        e->out->len = e->start;
        return rc;
    }
    dsv4_proto_frame_put_header(e->out->data + e->start, (uint32_t)payload);
    return 0;
}

void dsv4_wire_str(msgpack_packer *pk, const char *s, size_t len)
{
    msgpack_pack_str(pk, len);
    msgpack_pack_str_body(pk, s, len);
}

void dsv4_wire_cstr(msgpack_packer *pk, const char *s)
{
    if (s)
        dsv4_wire_str(pk, s, strlen(s));
    else
        msgpack_pack_nil(pk);
}

void dsv4_wire_bool(msgpack_packer *pk, bool v)
{
    if (v)
        msgpack_pack_true(pk);
    else
        msgpack_pack_false(pk);
}

void dsv4_wire_key(msgpack_packer *pk, const char *key)
{
    dsv4_wire_str(pk, key, strlen(key));
}

void dsv4_wire_tokens(msgpack_packer *pk, const int32_t *ids, uint32_t n)
{
    uint8_t chunk[1024];
    msgpack_pack_bin(pk, (size_t)n * 4);
    for (uint32_t i = 0; i < n;) {
        size_t k = 0;
        for (; i < n && k + 4 <= sizeof(chunk); i++, k += 4) {
            uint32_t v = (uint32_t)ids[i];
            chunk[k] = (uint8_t)v;
            chunk[k + 1] = (uint8_t)(v >> 8);
            chunk[k + 2] = (uint8_t)(v >> 16);
            chunk[k + 3] = (uint8_t)(v >> 24);
        }
        msgpack_pack_bin_body(pk, chunk, k);
    }
}

static bool key_is(const msgpack_object *k, const char *name)
{
    size_t n = strlen(name);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n && memcmp(k->via.str.ptr, name, n) == 0;
}

int dsv4_wire_check_keys(const msgpack_object *map, const char *const *names, size_t n_names, bool strict,
                         const char *ctx, struct dsv4_proto_error *err)
{
    /* one bit per known name; the tables stay below 64 names */
    uint64_t seen = 0;
    if (!map)
        return 0;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: map keys must be strings", ctx);
        if (!dsv4_utf8_valid(k->via.str.ptr, k->via.str.size))
            return dsv4_proto_error_set(err, DSV4_PROTO_E_INVALID_UTF8, "%s: a key is not valid UTF-8", ctx);
        size_t j = 0;
        while (j < n_names && !key_is(k, names[j]))
            j++;
        if (j == n_names) {
            if (strict)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_UNKNOWN_FIELD, "%s: unknown field \"%.*s\"", ctx,
                                            (int)(k->via.str.size > 64 ? 64 : k->via.str.size), k->via.str.ptr);
            continue;
        }
        if (seen & (1ull << j))
            return dsv4_proto_error_set(err, DSV4_PROTO_E_DUPLICATE_FIELD, "%s: field %s appears twice", ctx,
                                        names[j]);
        seen |= 1ull << j;
    }
    return 0;
}

const msgpack_object *dsv4_wire_get(const msgpack_object *map, const char *key)
{
    if (!map)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (key_is(&map->via.map.ptr[i].key, key))
            return &map->via.map.ptr[i].val;
    return NULL;
}

int dsv4_wire_read_str(const msgpack_object *o, const char *ctx, const char *field, size_t max, char **ret,
                       size_t *ret_len, struct dsv4_proto_error *err)
{
    *ret = NULL;
    if (ret_len)
        *ret_len = 0;
    if (o->type != MSGPACK_OBJECT_STR)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be a string", ctx, field);
    size_t n = o->via.str.size;
    if (max && n > max)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %s is %zu bytes, above the limit %zu", ctx,
                                    field, n, max);
    if (!dsv4_utf8_valid(o->via.str.ptr, n))
        return dsv4_proto_error_set(err, DSV4_PROTO_E_INVALID_UTF8, "%s: %s is not valid UTF-8", ctx, field);
    char *s = malloc(n + 1);
    if (!s)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "%s: no memory for %s", ctx, field);
    if (n)
        memcpy(s, o->via.str.ptr, n);
    s[n] = '\0';
    *ret = s;
    if (ret_len)
        *ret_len = n;
    return 0;
}

int dsv4_wire_read_bool(const msgpack_object *o, const char *ctx, const char *field, bool *ret,
                        struct dsv4_proto_error *err)
{
    if (o->type != MSGPACK_OBJECT_BOOLEAN)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be a boolean", ctx, field);
    *ret = o->via.boolean;
    return 0;
}

int dsv4_wire_read_int(const msgpack_object *o, const char *ctx, const char *field, int64_t lo, int64_t hi,
                       int bad_code, int64_t *ret, struct dsv4_proto_error *err)
{
    int64_t v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        v = o->via.u64 > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)o->via.u64;
    else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        v = o->via.i64;
    else
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be an integer", ctx, field);
    if (v < lo || v > hi)
        return dsv4_proto_error_set(err, bad_code, "%s: %s must be in [%lld, %lld]", ctx, field, (long long)lo,
                                    (long long)hi);
    *ret = v;
    return 0;
}

int dsv4_wire_read_u64(const msgpack_object *o, const char *ctx, const char *field, int bad_code, uint64_t *ret,
                       struct dsv4_proto_error *err)
{
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return dsv4_proto_error_set(err, bad_code, "%s: %s must not be negative", ctx, field);
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be an integer", ctx, field);
    *ret = o->via.u64;
    return 0;
}

int dsv4_wire_read_u32(const msgpack_object *o, const char *ctx, const char *field, uint32_t *ret,
                       struct dsv4_proto_error *err)
{
    int64_t v;
    int rc = dsv4_wire_read_int(o, ctx, field, 0, UINT32_MAX, DSV4_PROTO_E_BAD_VALUE, &v, err);
    if (rc == 0)
        *ret = (uint32_t)v;
    return rc;
}

int dsv4_wire_read_num(const msgpack_object *o, const char *ctx, const char *field, double lo, double hi,
                       int bad_code, double *ret, struct dsv4_proto_error *err)
{
    double v;
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: v = (double)o->via.u64; break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: v = (double)o->via.i64; break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: v = o->via.f64; break;
    default:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be a number", ctx, field);
    }
    if (!isfinite(v) || v < lo || v > hi)
        return dsv4_proto_error_set(err, bad_code, "%s: %s is %g, must be in [%g, %g]", ctx, field, v, lo, hi);
    *ret = v;
    return 0;
}

int dsv4_wire_read_tokens(const msgpack_object *o, const char *ctx, const char *field, bool allow_empty,
                          int32_t **ret, uint32_t *ret_n, struct dsv4_proto_error *err)
{
    *ret = NULL;
    *ret_n = 0;
    if (o->type != MSGPACK_OBJECT_BIN)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE,
                                    "%s: %s must be a bin of little-endian int32", ctx, field);
    size_t bytes = o->via.bin.size;
    if (bytes % 4)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_TOKENS,
                                    "%s: %s is %zu bytes, not a multiple of 4 (little-endian int32)", ctx, field,
                                    bytes);
    if (bytes == 0 && !allow_empty)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_TOKENS, "%s: %s is empty", ctx, field);
    size_t n = bytes / 4;
    int32_t *t = malloc(n ? n * sizeof(*t) : 1);
    if (!t)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_OUT_OF_MEMORY, "%s: no memory for %zu tokens", ctx, n);
    const uint8_t *p = (const uint8_t *)o->via.bin.ptr;
    for (size_t i = 0; i < n; i++, p += 4)
        t[i] = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
    *ret = t;
    *ret_n = (uint32_t)n;
    return 0;
}

int dsv4_wire_opt_u32(const msgpack_object *map, const char *key, const char *ctx, uint32_t *dst,
                      struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    return o ? dsv4_wire_read_u32(o, ctx, key, dst, err) : 0;
}

int dsv4_wire_opt_u64(const msgpack_object *map, const char *key, const char *ctx, uint64_t *dst,
                      struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    return o ? dsv4_wire_read_u64(o, ctx, key, DSV4_PROTO_E_BAD_VALUE, dst, err) : 0;
}

int dsv4_wire_opt_i32(const msgpack_object *map, const char *key, const char *ctx, int32_t *dst,
                      struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    int64_t v;
    if (!o)
        return 0;
    int rc = dsv4_wire_read_int(o, ctx, key, INT32_MIN, INT32_MAX, DSV4_PROTO_E_BAD_VALUE, &v, err);
    if (rc == 0)
        *dst = (int32_t)v;
    return rc;
}

int dsv4_wire_opt_f64(const msgpack_object *map, const char *key, const char *ctx, double *dst,
                      struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    if (!o)
        return 0;
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *dst = (double)o->via.u64; return 0;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *dst = (double)o->via.i64; return 0;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (isnan(o->via.f64))
            return dsv4_proto_error_set(err, DSV4_PROTO_E_BAD_VALUE, "%s: %s is NaN", ctx, key);
        *dst = o->via.f64;
        return 0;
    default:
        return dsv4_proto_error_set(err, DSV4_PROTO_E_WRONG_TYPE, "%s: %s must be a number", ctx, key);
    }
}

int dsv4_wire_opt_bool(const msgpack_object *map, const char *key, const char *ctx, bool *dst,
                       struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    return o ? dsv4_wire_read_bool(o, ctx, key, dst, err) : 0;
}

int dsv4_wire_opt_str(const msgpack_object *map, const char *key, const char *ctx, size_t max, char **dst,
                      size_t *dst_len, struct dsv4_proto_error *err)
{
    const msgpack_object *o = dsv4_wire_get(map, key);
    char *s;
    size_t n;
    if (!o)
        return 0;
    int rc = dsv4_wire_read_str(o, ctx, key, max, &s, &n, err);
    if (rc)
        return rc;
    free(*dst);
    *dst = s;
    if (dst_len)
        *dst_len = n;
    return 0;
}
