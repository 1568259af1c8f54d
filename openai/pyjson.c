/* SPDX-License-Identifier: MIT */
/* Python-compatible JSON writer and reader (see pyjson.h). */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
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

/* ---- reading ---------------------------------------------------------------------------------------- */

/* Python converts at most this many decimal digits into an int (sys.get_int_max_str_digits(), the
 * default since 3.11 and 3.10.7): json.loads raises on a longer integer. */
#define PY_INT_MAX_STR_DIGITS 4300

struct reader {
    const char *s;
    size_t n, at;
    bool strict;              /* RFC 8259 only: no NaN, Infinity, -Infinity */
    struct dsv4_buf scratch;  /* a string decoded, a number's text */
};

static void skip_ws(struct reader *rd)
{
    while (rd->at < rd->n && (rd->s[rd->at] == ' ' || rd->s[rd->at] == '\t' || rd->s[rd->at] == '\n' ||
                              rd->s[rd->at] == '\r'))
        rd->at++;
}

static bool eat(struct reader *rd, const char *lit)
{
    size_t k = strlen(lit);
    if (rd->n - rd->at < k || memcmp(rd->s + rd->at, lit, k) != 0)
        return false;
    rd->at += k;
    return true;
}

static bool digit_at(const struct reader *rd)
{
    return rd->at < rd->n && rd->s[rd->at] >= '0' && rd->s[rd->at] <= '9';
}

static int hex4(struct reader *rd, unsigned *ret)
{
    unsigned v = 0;
    if (rd->n - rd->at < 4)
        return -EBADMSG;
    for (int i = 0; i < 4; i++) {
        char c = rd->s[rd->at++];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            return -EBADMSG;
    }
    *ret = v;
    return 0;
}

static int put_utf8(struct dsv4_buf *out, unsigned cp)
{
    char u[4];
    size_t k;
    if (cp < 0x80) {
        u[0] = (char)cp;
        k = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xc0 | cp >> 6);
        u[1] = (char)(0x80 | (cp & 0x3f));
        k = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xe0 | cp >> 12);
        u[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        u[2] = (char)(0x80 | (cp & 0x3f));
        k = 3;
    } else {
        u[0] = (char)(0xf0 | cp >> 18);
        u[1] = (char)(0x80 | (cp >> 12 & 0x3f));
        u[2] = (char)(0x80 | (cp >> 6 & 0x3f));
        u[3] = (char)(0x80 | (cp & 0x3f));
        k = 4;
    }
    return dsv4_buf_put(out, u, k);
}

/* The string at rd->at (its opening quote), decoded into out. */
static int read_string(struct reader *rd, struct dsv4_buf *out)
{
    int r = 0;
    rd->at++;
    for (;;) {
        size_t run = rd->at;
        while (rd->at < rd->n && rd->s[rd->at] != '"' && rd->s[rd->at] != '\\' &&
               (unsigned char)rd->s[rd->at] >= 0x20)
            rd->at++;
        if ((r = dsv4_buf_put(out, rd->s + run, rd->at - run)) < 0)
            return r;
        if (rd->at == rd->n || (unsigned char)rd->s[rd->at] < 0x20)
            return -EBADMSG;   /* unterminated, or a control character Python's strict mode refuses */
        if (rd->s[rd->at++] == '"')
            return 0;
        if (rd->at == rd->n)
            return -EBADMSG;
        static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
        char e = rd->s[rd->at++];
        const char *k = e ? strchr(from, e) : NULL;
        if (k) {
            r = dsv4_buf_putc(out, to[k - from]);
        } else if (e == 'u') {
            unsigned cp, lo;
            if ((r = hex4(rd, &cp)) < 0)
                return r;
            if (cp >= 0xdc00 && cp <= 0xdfff)
                return -EBADMSG;
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (!eat(rd, "\\u") || hex4(rd, &lo) < 0 || lo < 0xdc00 || lo > 0xdfff)
                    return -EBADMSG;
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            r = put_utf8(out, cp);
        } else {
            return -EBADMSG;
        }
        if (r < 0)
            return r;
    }
}

/* The number at rd->at, written as Python writes what it reads: an integer digit for digit ("-0" is
 * 0), anything with a fraction or exponent as the double it rounds to. */
static int read_number(struct reader *rd, struct dsv4_buf *out)
{
    size_t start = rd->at;
    bool neg = eat(rd, "-"), real = false;
    if (neg && !rd->strict && eat(rd, "Infinity"))
        return dsv4_buf_puts(out, "-Infinity");
    if (eat(rd, "0")) {
        /* no leading zeros */
    } else if (digit_at(rd)) {
        while (digit_at(rd))
            rd->at++;
    } else {
        return -EBADMSG;
    }
    size_t int_digits = rd->at - start - neg;
    if (eat(rd, ".")) {
        if (!digit_at(rd))
            return -EBADMSG;
        while (digit_at(rd))
            rd->at++;
        real = true;
    }
    if (eat(rd, "e") || eat(rd, "E")) {
        if (!eat(rd, "+"))
            eat(rd, "-");
        if (!digit_at(rd))
            return -EBADMSG;
        while (digit_at(rd))
            rd->at++;
        real = true;
    }
    if (!real && int_digits > PY_INT_MAX_STR_DIGITS)
        return -EBADMSG;
    if (!real)
        return neg && int_digits == 1 && rd->s[start + 1] == '0' ? dsv4_buf_putc(out, '0')
                                                                  : dsv4_buf_put(out, rd->s + start, rd->at - start);
    rd->scratch.len = 0;
    int r = dsv4_buf_put(&rd->scratch, rd->s + start, rd->at - start);
    return r ? r : dsv4_pyjson_float(strtod(rd->scratch.p, NULL), out);
}

static int read_members(struct reader *rd, unsigned depth, struct dsv4_pyjson_object *o);

/* One value at rd->at into out, as json.dumps writes it. */
static int read_value(struct reader *rd, unsigned depth, struct dsv4_buf *out)
{
    int r;
    if (rd->at == rd->n)
        return -EBADMSG;
    switch (rd->s[rd->at]) {
    case '"':
        rd->scratch.len = 0;
        r = read_string(rd, &rd->scratch);
        return r ? r : dsv4_pyjson_string(rd->scratch.p, rd->scratch.len, out);
    case '{': {
        struct dsv4_pyjson_object o = {0};
        r = read_members(rd, depth, &o);
        r = r ? r : dsv4_buf_putc(out, '{');
        for (size_t i = 0; i < o.n && r == 0; i++) {
            const struct dsv4_pyjson_member *m = &o.m[i];
            if (i)
                r = dsv4_buf_puts(out, ", ");
            if (r == 0)
                r = dsv4_pyjson_string(o.text.p + m->key, m->key_len, out);
            if (r == 0)
                r = dsv4_buf_puts(out, ": ");
            if (r == 0)
                r = m->is_str ? dsv4_pyjson_string(o.text.p + m->val, m->val_len, out)
                              : dsv4_buf_put(out, o.text.p + m->val, m->val_len);
        }
        dsv4_pyjson_object_free(&o);
        return r ? r : dsv4_buf_putc(out, '}');
    }
    case '[':
        if (depth >= DSV4_PYJSON_MAX_DEPTH)
            return -EBADMSG;
        rd->at++;
        r = dsv4_buf_putc(out, '[');
        skip_ws(rd);
        if (r == 0 && eat(rd, "]"))
            return dsv4_buf_putc(out, ']');
        for (bool first = true; r == 0; first = false) {
            if (!first)
                r = dsv4_buf_puts(out, ", ");
            skip_ws(rd);
            if (r == 0)
                r = read_value(rd, depth + 1, out);
            skip_ws(rd);
            if (r == 0 && eat(rd, "]"))
                return dsv4_buf_putc(out, ']');
            if (r == 0 && !eat(rd, ","))
                r = -EBADMSG;
        }
        return r;
    case 't': return eat(rd, "true") ? dsv4_buf_puts(out, "true") : -EBADMSG;
    case 'f': return eat(rd, "false") ? dsv4_buf_puts(out, "false") : -EBADMSG;
    case 'n': return eat(rd, "null") ? dsv4_buf_puts(out, "null") : -EBADMSG;
    case 'N': return !rd->strict && eat(rd, "NaN") ? dsv4_buf_puts(out, "NaN") : -EBADMSG;
    case 'I': return !rd->strict && eat(rd, "Infinity") ? dsv4_buf_puts(out, "Infinity") : -EBADMSG;
    default: return read_number(rd, out);
    }
}

struct key_at {
    const char *key;
    size_t len, index;
};

static int key_cmp(const void *a, const void *b)
{
    const struct key_at *x = a, *y = b;
    int c = memcmp(x->key, y->key, x->len < y->len ? x->len : y->len);
    if (c)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

/* Duplicate keys as a dict takes them: the first place, the last value. Sorted, so that a hostile
 * object of many keys costs n log n, not n^2. */
static int merge_duplicates(struct dsv4_pyjson_object *o)
{
    if (o->n < 2)
        return 0;
    struct key_at *k = malloc(o->n * sizeof(*k));
    if (!k)
        return -ENOMEM;
    for (size_t i = 0; i < o->n; i++)
        k[i] = (struct key_at){o->text.p + o->m[i].key, o->m[i].key_len, i};
    qsort(k, o->n, sizeof(*k), key_cmp);
    bool any = false;
    for (size_t i = 0, j; i < o->n; i = j) {
        for (j = i + 1; j < o->n && k[j].len == k[i].len && memcmp(k[j].key, k[i].key, k[i].len) == 0; j++)
            o->m[k[j].index].key_len = SIZE_MAX;   /* dropped */
        if (j - i > 1) {
            struct dsv4_pyjson_member *first = &o->m[k[i].index];
            const struct dsv4_pyjson_member *last = &o->m[k[j - 1].index];
            first->val = last->val;
            first->val_len = last->val_len;
            first->is_str = last->is_str;
            any = true;
        }
    }
    free(k);
    size_t w = 0;
    for (size_t i = 0; any && i < o->n; i++)
        if (o->m[i].key_len != SIZE_MAX)
            o->m[w++] = o->m[i];
    if (any)
        o->n = w;
    return 0;
}

/* The object at rd->at (its opening brace) into o: keys and string values decoded, other values as
 * json.dumps writes them. */
static int read_members(struct reader *rd, unsigned depth, struct dsv4_pyjson_object *o)
{
    int r = 0;
    if (depth >= DSV4_PYJSON_MAX_DEPTH)
        return -EBADMSG;
    rd->at++;
    skip_ws(rd);
    if (eat(rd, "}"))
        return 0;
    for (;;) {
        struct dsv4_pyjson_member m = {.key = o->text.len};
        if (rd->at == rd->n || rd->s[rd->at] != '"')
            return -EBADMSG;
        if ((r = read_string(rd, &o->text)) < 0)
            return r;
        m.key_len = o->text.len - m.key;
        skip_ws(rd);
        if (!eat(rd, ":"))
            return -EBADMSG;
        skip_ws(rd);
        m.val = o->text.len;
        m.is_str = rd->at < rd->n && rd->s[rd->at] == '"';
        if ((r = m.is_str ? read_string(rd, &o->text) : read_value(rd, depth + 1, &o->text)) < 0)
            return r;
        m.val_len = o->text.len - m.val;
        if (o->n == o->cap) {
            size_t cap = o->cap ? 2 * o->cap : 8;
            struct dsv4_pyjson_member *p = realloc(o->m, cap * sizeof(*p));
            if (!p)
                return -ENOMEM;
            o->m = p;
            o->cap = cap;
        }
        o->m[o->n++] = m;
        skip_ws(rd);
        if (eat(rd, "}"))
            return merge_duplicates(o);
        if (!eat(rd, ","))
            return -EBADMSG;
        skip_ws(rd);
    }
}

void dsv4_pyjson_object_free(struct dsv4_pyjson_object *o)
{
    if (!o)
        return;
    dsv4_buf_free(&o->text);
    free(o->m);
    memset(o, 0, sizeof(*o));
}

int dsv4_pyjson_load_object(const char *s, size_t n, struct dsv4_pyjson_object *ret)
{
    struct reader rd = {.s = s, .n = n};
    struct dsv4_buf other = {0};
    int r;
    skip_ws(&rd);
    bool is_object = rd.at < n && s[rd.at] == '{';
    r = is_object ? read_members(&rd, 0, ret) : read_value(&rd, 0, &other);
    skip_ws(&rd);
    if (r == 0 && rd.at != n)
        r = -EBADMSG;   /* "Extra data" */
    if (r == 0 && !is_object)
        r = -EINVAL;
    dsv4_buf_free(&other);
    dsv4_buf_free(&rd.scratch);
    if (r)
        dsv4_pyjson_object_free(ret);
    return r;
}

int dsv4_pyjson_check(const char *s, size_t n)
{
    struct reader rd = {.s = s, .n = n, .strict = true};
    struct dsv4_buf out = {0};
    skip_ws(&rd);
    int r = read_value(&rd, 0, &out);
    skip_ws(&rd);
    if (r == 0 && rd.at != n)
        r = -EBADMSG;
    dsv4_buf_free(&out);
    dsv4_buf_free(&rd.scratch);
    return r;
}
