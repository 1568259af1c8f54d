/* SPDX-License-Identifier: MIT */
/* Python-compatible JSON writer (see pyjson.h). */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai/pyjson.h"

int dsv4_pyjson_string(const char *s, size_t n, struct dsv4_buf *out)
{
    int r = dsv4_buf_putc(out, '"');
    size_t run = 0;   /* bytes copied as they are, written in one go */
    for (size_t i = 0; i < n && r == 0; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof(u), "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc) {
            run++;
            continue;
        }
        r = dsv4_buf_put(out, s + i - run, run);
        run = 0;
        if (r == 0)
            r = dsv4_buf_puts(out, esc);
    }
    if (r == 0)
        r = dsv4_buf_put(out, s + n - run, run);
    return r ? r : dsv4_buf_putc(out, '"');
}

int dsv4_pyjson_float(double v, struct dsv4_buf *out)
{
    char e[40], digits[24];
    int exp10, nd = 0;
    if (isnan(v))
        return dsv4_buf_puts(out, "NaN");
    if (isinf(v))
        return dsv4_buf_puts(out, v < 0 ? "-Infinity" : "Infinity");
    /* The fewest significant digits that read back as v: what repr() chooses. */
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof(e), "%.*e", p - 1, v);
        if (strtod(e, NULL) == v)
            break;
    }
    /* e is "[-]d[.ddd]e[+-]XX" */
    const char *q = e;
    bool neg = *q == '-';
    if (neg)
        q++;
    for (; *q && *q != 'e'; q++)
        if (*q != '.')
            digits[nd++] = *q;
    digits[nd] = '\0';
    exp10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        digits[--nd] = '\0';
    int r = neg ? dsv4_buf_putc(out, '-') : 0;
    if (r)
        return r;
    if (exp10 < -4 || exp10 >= 16) {
        r = dsv4_buf_putc(out, digits[0]);
        if (r == 0 && nd > 1)
            r = dsv4_buf_printf(out, ".%s", digits + 1);
        return r ? r : dsv4_buf_printf(out, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    if (exp10 < 0) {
        r = dsv4_buf_puts(out, "0.");
        for (int i = 0; i < -exp10 - 1 && r == 0; i++)
            r = dsv4_buf_putc(out, '0');
        return r ? r : dsv4_buf_puts(out, digits);
    }
    /* exp10 + 1 digits before the point, padded with zeros; at least one after it. */
    for (int i = 0; i <= exp10 && r == 0; i++)
        r = dsv4_buf_putc(out, i < nd ? digits[i] : '0');
    if (r == 0)
        r = dsv4_buf_putc(out, '.');
    if (r == 0)
        r = nd > exp10 + 1 ? dsv4_buf_puts(out, digits + exp10 + 1) : dsv4_buf_putc(out, '0');
    return r;
}

int dsv4_pyjson_dump(const json_t *v, struct dsv4_buf *out)
{
    int r = 0;
    switch (json_typeof(v)) {
    case JSON_NULL: return dsv4_buf_puts(out, "null");
    case JSON_TRUE: return dsv4_buf_puts(out, "true");
    case JSON_FALSE: return dsv4_buf_puts(out, "false");
    case JSON_INTEGER: return dsv4_buf_printf(out, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    case JSON_REAL: return dsv4_pyjson_float(json_real_value(v), out);
    case JSON_STRING: return dsv4_pyjson_string(json_string_value(v), json_string_length(v), out);
    case JSON_ARRAY: {
        size_t i;
        const json_t *item;
        r = dsv4_buf_putc(out, '[');
        json_array_foreach(v, i, item) {
            if (r == 0 && i)
                r = dsv4_buf_puts(out, ", ");
            if (r == 0)
                r = dsv4_pyjson_dump(item, out);
        }
        return r ? r : dsv4_buf_putc(out, ']');
    }
    case JSON_OBJECT: {
        const char *key;
        const json_t *item;
        bool first = true;
        r = dsv4_buf_putc(out, '{');
        /* jansson keeps insertion order, as Python's dict does. */
        json_object_foreach((json_t *)v, key, item) {
            if (r == 0 && !first)
                r = dsv4_buf_puts(out, ", ");
            first = false;
            if (r == 0)
                r = dsv4_pyjson_string(key, strlen(key), out);
            if (r == 0)
                r = dsv4_buf_puts(out, ": ");
            if (r == 0)
                r = dsv4_pyjson_dump(item, out);
        }
        return r ? r : dsv4_buf_putc(out, '}');
    }
    }
    return -EINVAL;
}
