/* Helpers shared by the tokenizer and chat modules; not part of the public API. */
#ifndef DSV4_ENGINE_TOK_INTERNAL_H
#define DSV4_ENGINE_TOK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

enum dsv4_tok_utf8_step {
    DSV4_TOK_UTF8_VALID,      /* a whole character of *ret_used bytes */
    DSV4_TOK_UTF8_INVALID,    /* a maximal invalid subpart of *ret_used bytes (one U+FFFD) */
    DSV4_TOK_UTF8_INCOMPLETE, /* all n bytes start a character that needs more */
};

/* Classify the UTF-8 sequence starting at p[0] (n >= 1 bytes available) by Rust's rules. */
enum dsv4_tok_utf8_step dsv4_tok_utf8_step(const unsigned char *p, size_t n, size_t *ret_used);

uint64_t dsv4_tok_hash_bytes(const void *data, size_t n);

/* The code point each byte maps to in the byte-level alphabet. */
void dsv4_tok_byte_to_codepoints(uint32_t cp[256]);

#endif
