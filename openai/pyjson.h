/* SPDX-License-Identifier: MIT */
/* JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it: ", " and ": "
 * separators, non-ASCII kept, lowercase \u00XX escapes for control characters, floats in Python's
 * shortest repr ("1.0", "1e-07", "1e+16"). DeepSeek's V4 chat format embeds tool schemas and tool
 * arguments in that form, so the model sees what it was trained on. */
#ifndef DSV4_OPENAI_PYJSON_H
#define DSV4_OPENAI_PYJSON_H

#include <jansson.h>
#include <stddef.h>

#include "openai/buf.h"

/* Append the JSON of v. Returns 0 or -ENOMEM. */
int dsv4_pyjson_dump(const json_t *v, struct dsv4_buf *out);
/* Append s (n bytes of UTF-8) as a JSON string literal. */
int dsv4_pyjson_string(const char *s, size_t n, struct dsv4_buf *out);
/* Append a double as Python's repr() writes it. */
int dsv4_pyjson_float(double v, struct dsv4_buf *out);

#endif
