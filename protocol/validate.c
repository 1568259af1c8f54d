/* SPDX-License-Identifier: MIT */
/* Allocation-free walk over one msgpack value: bounds every claim before msgpack-c sees the bytes. */
#include "build-config.h"

#include <errno.h>

#include "protocol/frame.h"
#include "protocol/validate.h"

void dsv4_proto_limits_server(struct dsv4_proto_limits *lim)
{
    lim->max_frame = DSV4_PROTO_DEFAULT_MAX_FRAME;
    lim->max_depth = DSV4_PROTO_DEFAULT_MAX_DEPTH;
    lim->max_elements = DSV4_PROTO_DEFAULT_MAX_ELEMENTS;
    lim->max_str = DSV4_PROTO_DEFAULT_MAX_STR;
    lim->max_bin = DSV4_PROTO_DEFAULT_MAX_BIN;
}

void dsv4_proto_limits_client(struct dsv4_proto_limits *lim)
{
    lim->max_frame = DSV4_PROTO_CLIENT_MAX_FRAME;
    lim->max_depth = DSV4_PROTO_DEFAULT_MAX_DEPTH;
    lim->max_elements = DSV4_PROTO_CLIENT_MAX_ELEMENTS;
    lim->max_str = DSV4_PROTO_CLIENT_MAX_STR;
    lim->max_bin = DSV4_PROTO_CLIENT_MAX_BIN;
}

static uint64_t be(const uint8_t *p, unsigned n)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* What one header byte announces. */
enum shape { SCALAR, STR, BIN, ARRAY, MAP, BAD };

struct head {
    enum shape shape;
    unsigned extra;      /* header bytes after the first (length field or fixed scalar payload) */
    unsigned len_bytes;  /* bytes of the length/count field within extra (0: immediate) */
    uint64_t immediate;  /* fix* length or count */
};

static struct head classify(uint8_t b)
{
    struct head h = { SCALAR, 0, 0, 0 };
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return h;
    if (b >= 0x80 && b <= 0x8f)
        return (struct head){ MAP, 0, 0, b & 0x0f };
    if (b >= 0x90 && b <= 0x9f)
        return (struct head){ ARRAY, 0, 0, b & 0x0f };
    if (b >= 0xa0 && b <= 0xbf)
        return (struct head){ STR, 0, 0, b & 0x1f };
    switch (b) {
    case 0xc4: return (struct head){ BIN, 1, 1, 0 };
    case 0xc5: return (struct head){ BIN, 2, 2, 0 };
    case 0xc6: return (struct head){ BIN, 4, 4, 0 };
    case 0xca: return (struct head){ SCALAR, 4, 0, 0 };
    case 0xcb: return (struct head){ SCALAR, 8, 0, 0 };
    case 0xcc: case 0xd0: return (struct head){ SCALAR, 1, 0, 0 };
    case 0xcd: case 0xd1: return (struct head){ SCALAR, 2, 0, 0 };
    case 0xce: case 0xd2: return (struct head){ SCALAR, 4, 0, 0 };
    case 0xcf: case 0xd3: return (struct head){ SCALAR, 8, 0, 0 };
    case 0xd9: return (struct head){ STR, 1, 1, 0 };
    case 0xda: return (struct head){ STR, 2, 2, 0 };
    case 0xdb: return (struct head){ STR, 4, 4, 0 };
    case 0xdc: return (struct head){ ARRAY, 2, 2, 0 };
    case 0xdd: return (struct head){ ARRAY, 4, 4, 0 };
    case 0xde: return (struct head){ MAP, 2, 2, 0 };
    case 0xdf: return (struct head){ MAP, 4, 4, 0 };
    default:   /* 0xc1 (never used), 0xc7-0xc9 and 0xd4-0xd8 (ext) */
        h.shape = BAD;
        return h;
    }
}

int dsv4_proto_validate(const uint8_t *buf, size_t len, const struct dsv4_proto_limits *lim,
                        struct dsv4_proto_validate_info *info, struct dsv4_proto_error *err)
{
    /* pending[d]: objects still to read in the container open at depth d; pending[0] is the one
     * top-level value. Counts fit: each is checked against the bytes left, and len <= max_frame. */
    size_t pending[DSV4_PROTO_MAX_DEPTH_LIMIT + 1];
    uint32_t max_depth = lim->max_depth < DSV4_PROTO_MAX_DEPTH_LIMIT ? lim->max_depth : DSV4_PROTO_MAX_DEPTH_LIMIT;
    uint32_t sp = 1, deepest = 0, elements = 0;
    size_t pos = 0;

    if (info) {
        info->elements = 0;
        info->depth = 0;
    }
    if (len == 0)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_FRAME_EMPTY, "empty frame");
    if (len > lim->max_frame)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_FRAME_TOO_LARGE,
                                    "frame of %zu bytes, above the maximum frame size %zu", len, lim->max_frame);
    pending[0] = 1;
    while (sp > 0) {
        if (pending[sp - 1] == 0) {
            sp--;
            continue;
        }
        pending[sp - 1]--;
        if (pos >= len)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_TRUNCATED,
                                        "frame ends at byte %zu inside a container that claims more objects", pos);
        if (elements >= lim->max_elements)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_MANY_ELEMENTS,
                                        "more than %u objects in one frame (byte %zu)", lim->max_elements, pos);
        elements++;
        size_t at = pos;
        uint8_t b = buf[pos++];
        struct head h = classify(b);
        if (h.shape == BAD)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_MALFORMED,
                                        "byte 0x%02x at offset %zu is reserved or an ext type", b, at);
        size_t left = len - pos;
        if (h.extra > left)
            return dsv4_proto_error_set(err, DSV4_PROTO_E_TRUNCATED,
                                        "header at byte %zu needs %u more bytes, %zu left", at, h.extra, left);
        uint64_t n = h.len_bytes ? be(buf + pos, h.len_bytes) : h.immediate;
        pos += h.extra;
        left = len - pos;
        switch (h.shape) {
        case STR:
        case BIN:
            if (n > left)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_TRUNCATED,
                                            "%s at byte %zu claims %llu bytes, %zu left in the frame",
                                            h.shape == STR ? "str" : "bin", at, (unsigned long long)n, left);
            if (h.shape == STR && n > lim->max_str)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_STRING_TOO_LONG,
                                            "str at byte %zu of %llu bytes, above the limit %u", at,
                                            (unsigned long long)n, lim->max_str);
            if (h.shape == BIN && n > lim->max_bin)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_BIN_TOO_LONG,
                                            "bin at byte %zu of %llu bytes, above the limit %u", at,
                                            (unsigned long long)n, lim->max_bin);
            pos += (size_t)n;
            break;
        case ARRAY:
        case MAP: {
            /* every object takes at least one byte: a count above the bytes left is a lie */
            uint64_t objects = h.shape == MAP ? 2 * n : n;
            if (objects > left)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_TRUNCATED,
                                            "%s at byte %zu claims %llu %s, only %zu bytes left in the frame",
                                            h.shape == MAP ? "map" : "array", at, (unsigned long long)n,
                                            h.shape == MAP ? "entries" : "elements", left);
            if (sp > max_depth)
                return dsv4_proto_error_set(err, DSV4_PROTO_E_TOO_DEEP,
                                            "container at byte %zu nested deeper than %u levels", at, max_depth);
            if (sp > deepest)
                deepest = sp;
            pending[sp++] = (size_t)objects;
            break;
        }
        default:   /* SCALAR: its payload was the header's extra bytes */
            break;
        }
    }
    if (pos != len)
        return dsv4_proto_error_set(err, DSV4_PROTO_E_TRAILING_BYTES,
                                    "%zu bytes after the msgpack value that ends at byte %zu", len - pos, pos);
    if (info) {
        info->elements = elements;
        info->depth = deepest;
    }
    return 0;
}
