/* SPDX-License-Identifier: MIT */
/* Growable byte buffer. */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai/buf.h"

static int reserve(struct dsv4_buf *b, size_t extra)
{
    if (extra >= ((size_t)-1) / 2 - b->len)
        return -ENOMEM;
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return -ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

int dsv4_buf_put(struct dsv4_buf *b, const void *data, size_t n)
{
    if (reserve(b, n) < 0)
        return -ENOMEM;
    if (n)
        memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

int dsv4_buf_puts(struct dsv4_buf *b, const char *s)
{
    return dsv4_buf_put(b, s, strlen(s));
}

int dsv4_buf_putc(struct dsv4_buf *b, char c)
{
    return dsv4_buf_put(b, &c, 1);
}

int dsv4_buf_printf(struct dsv4_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || reserve(b, (size_t)n) < 0)
        return -ENOMEM;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

void dsv4_buf_consume(struct dsv4_buf *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
    } else {
        memmove(b->p, b->p + n, b->len - n);
        b->len -= n;
    }
    if (b->p)
        b->p[b->len] = '\0';
}

char *dsv4_buf_steal(struct dsv4_buf *b)
{
    char *s = b->p ? b->p : strdup("");
    b->p = NULL;
    b->len = b->cap = 0;
    return s;
}

void dsv4_buf_free(struct dsv4_buf *b)
{
    if (!b)
        return;
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}
