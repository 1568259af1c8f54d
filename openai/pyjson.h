/* SPDX-License-Identifier: MIT */
/* JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it: ", " and ": "
 * separators, non-ASCII kept, lowercase \u00XX escapes for control characters, floats in Python's
 * shortest repr ("1.0", "1e-07", "1e+16"). DeepSeek's V4 chat format embeds tool schemas and tool
 * arguments in that form, so the model sees what it was trained on. Tool call arguments come as JSON
 * text, which DeepSeek's encoder reads with json.loads: dsv4_pyjson_load_object reads it the same way,
 * with what jansson cannot hold (integers beyond 64 bits, NaN, \u0000) kept. */
#ifndef DSV4_OPENAI_PYJSON_H
#define DSV4_OPENAI_PYJSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "openai/buf.h"

/* Append the JSON of v. Returns 0 or -ENOMEM. */
int dsv4_pyjson_dump(const json_t *v, struct dsv4_buf *out);
/* Append s (n bytes of UTF-8) as a JSON string literal. */
int dsv4_pyjson_string(const char *s, size_t n, struct dsv4_buf *out);
/* Append a double as Python's repr() writes it. */
int dsv4_pyjson_float(double v, struct dsv4_buf *out);

/* Containers nested deeper than this are not read: Python's json.loads raises RecursionError there
 * (its default recursion limit is 1000 frames, of which its caller holds some). */
#define DSV4_PYJSON_MAX_DEPTH 900

/* A JSON object as Python's json.loads reads it: a later duplicate key gives its value to the
 * first one's place, as a dict does. Keys and values are ranges of `text`. */
struct dsv4_pyjson_member {
    size_t key, key_len;      /* the key, decoded (it may hold NUL) */
    size_t val, val_len;      /* a string decoded, any other value as json.dumps writes it */
    bool is_str;
};

struct dsv4_pyjson_object {
    struct dsv4_buf text;
    struct dsv4_pyjson_member *m;
    size_t n, cap;
};

/* Read s (n bytes of UTF-8) as Python's json.loads(s) would: besides JSON it takes NaN, Infinity and
 * -Infinity, and numbers of any size (an integer of more than 4300 digits is refused, as Python
 * refuses to convert it). A \u escape of a lone surrogate is refused: Python takes it, but the text
 * it would make has no UTF-8 form. Returns 0 with *ret filled (zero-initialised by the caller),
 * -EBADMSG when Python would raise, -EINVAL when s is JSON but not an object, or -ENOMEM. */
int dsv4_pyjson_load_object(const char *s, size_t n, struct dsv4_pyjson_object *ret);
void dsv4_pyjson_object_free(struct dsv4_pyjson_object *o);

/* 0 when s is one JSON value (RFC 8259: numbers of any size, no NaN or Infinity), with white space
 * around it allowed; -EBADMSG when not; -ENOMEM. */
int dsv4_pyjson_check(const char *s, size_t n);

#endif
