/* SPDX-License-Identifier: MIT */
/* A growable byte buffer: response bodies, SSE events, rendered prompts. Appends fail only with
 * -ENOMEM; the contents stay NUL-terminated so they can be used as strings. */
#ifndef DSV4_OPENAI_BUF_H
#define DSV4_OPENAI_BUF_H

#include <stdarg.h>
#include <stddef.h>

struct dsv4_buf {
    char *p;        /* NULL until the first append */
    size_t len;
    size_t cap;
};

int dsv4_buf_put(struct dsv4_buf *b, const void *data, size_t n);
int dsv4_buf_puts(struct dsv4_buf *b, const char *s);
int dsv4_buf_putc(struct dsv4_buf *b, char c);
int dsv4_buf_printf(struct dsv4_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Drop the first n bytes (what a reader has consumed). */
void dsv4_buf_consume(struct dsv4_buf *b, size_t n);
/* The contents as a malloc'd string the caller owns; the buffer is left empty. Never NULL unless
 * out of memory. */
char *dsv4_buf_steal(struct dsv4_buf *b);
void dsv4_buf_free(struct dsv4_buf *b);

#endif
