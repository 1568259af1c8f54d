/* SPDX-License-Identifier: MIT */
/* Helpers shared by the tokenizer and chat modules; not part of the public API. */
#ifndef DSV4_ENGINE_TEXT_TOK_INTERNAL_H
#define DSV4_ENGINE_TEXT_TOK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/* The code point each byte maps to in the byte-level alphabet. */
void dsv4_tok_byte_to_codepoints(uint32_t cp[256]);

/* Explicit members of a Unicode general category (\p{L} ...) as `tokenizers`' own Oniguruma has
 * them (Unicode 16.0); the system libonig may be older. Generated into tok_unicode.c by
 * tests/tokenizer/gen_unicode_classes.py. The array ends with a NULL name. */
struct dsv4_tok_unicode_class {
    const char *name;
    const uint32_t (*ranges)[2];  /* [n][first, last] code points, ascending */
    size_t n;
};

extern const struct dsv4_tok_unicode_class dsv4_tok_unicode_classes[];

#endif
