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
    int exp10 = 0;
    int nd = 0;
    bool neg = signbit(v);
    if (isnan(v))
        return dsv4_buf_puts(out, "NaN");
    if (isinf(v))
        return dsv4_buf_puts(out, v < 0 ? "-Infinity" : "Infinity");
    if (v == 0) {
        digits[nd++] = '0';
    } else {
        /* The fewest significant digits that read back as v, as repr() chooses. At p digits the
         * correctly rounded mantissa M is tried first, then its neighbours M-1 and M+1: next to a
         * power of two the interval that reads back as v is lopsided, so the nearest p-digit
         * decimal can miss it while a neighbour lands inside (2**-24 is 5.960464477539063e-08). */
        double a = fabs(v);
        for (int p = 1; p <= 17 && !nd; p++) {
            snprintf(e, sizeof(e), "%.*e", p - 1, a);
            unsigned long long m = 0;
            for (const char *q = e; *q && *q != 'e'; q++)
                if (*q != '.')
                    m = m * 10 + (unsigned long long)(*q - '0');
            int scale = atoi(strchr(e, 'e') + 1) - (p - 1);
            const unsigned long long cand[3] = {m, m - 1, m + 1};
            for (int c = 0; c < 3; c++) {
                if (cand[c] == 0)
                    continue;
                snprintf(e, sizeof(e), "%llue%d", cand[c], scale);
                if (strtod(e, NULL) != a)
                    continue;
                nd = snprintf(digits, sizeof(digits), "%llu", cand[c]);
                exp10 = scale + nd - 1;
                break;
            }
        }
    }
    digits[nd] = '\0';
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
