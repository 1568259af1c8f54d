/* SPDX-License-Identifier: MIT */
/* UTF-8 as RFC 3629 defines it (shortest form only, no surrogates, nothing above U+10FFFF), scanned
 * one character at a time the way Rust's String::from_utf8_lossy scans it: a bad sequence ends at its
 * maximal invalid subpart (Unicode §3.9, "U+FFFD substitution of maximal subparts"), so a repair that
 * writes one U+FFFD per invalid step produces Hugging Face tokenizers' strings byte for byte.
 *
 * Header-only and below every component: the protocol (which checks every str it decodes) and the
 * engine (tokenizer, streamed output) must not depend on each other, and libdsv4client exports only
 * dsv4_client_*; static inline functions need no library of their own and export nothing. */
#ifndef DSV4_BASE_UTF8_H
#define DSV4_BASE_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DSV4_UTF8_CHAR_MAX 4                    /* bytes of the longest character */
#define DSV4_UTF8_REPLACEMENT "\xEF\xBF\xBD"    /* U+FFFD: what an invalid subpart becomes */
#define DSV4_UTF8_REPLACEMENT_LEN 3

enum dsv4_utf8_step {
    DSV4_UTF8_VALID,        /* a whole character of *ret_used bytes */
    DSV4_UTF8_INVALID,      /* a maximal invalid subpart of *ret_used bytes (one U+FFFD) */
    DSV4_UTF8_INCOMPLETE,   /* all n bytes start a character that needs more (*ret_used = n) */
};

/* Classify the sequence that starts at p[0] (n >= 1 bytes available). The lead byte fixes the length
 * and the range of the second byte (Unicode Table 3-7): E0 and F0 exclude overlong forms, ED the
 * surrogates, F4 what lies above U+10FFFF; C0, C1 and F5..FF never start a character. */
static inline enum dsv4_utf8_step dsv4_utf8_step(const unsigned char *p, size_t n, size_t *ret_used)
{
    unsigned char b = p[0], lo = 0x80, hi = 0xBF;
    size_t need;

    if (b < 0x80) {
        *ret_used = 1;
        return DSV4_UTF8_VALID;
    } else if (b >= 0xC2 && b <= 0xDF) {
        need = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 3;
        if (b == 0xE0)
            lo = 0xA0;
        else if (b == 0xED)
            hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 4;
        if (b == 0xF0)
            lo = 0x90;
        else if (b == 0xF4)
            hi = 0x8F;
    } else {
        *ret_used = 1;
        return DSV4_UTF8_INVALID;
    }
    for (size_t i = 1; i < need; i++) {
        unsigned char c;

        if (i >= n) {
            *ret_used = n;
            return DSV4_UTF8_INCOMPLETE;
        }
        c = p[i];
        if (i == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) {
            *ret_used = i;
            return DSV4_UTF8_INVALID;
        }
    }
    *ret_used = need;
    return DSV4_UTF8_VALID;
}

/* Offset of the first byte of s[0..n) that does not begin a whole valid character, or n. */
static inline size_t dsv4_utf8_valid_prefix(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;

    while (i < n) {
        size_t used;

        if (p[i] < 0x80) {
            i++;
            continue;
        }
        if (dsv4_utf8_step(p + i, n - i, &used) != DSV4_UTF8_VALID)
            return i;
        i += used;
    }
    return n;
}

static inline bool dsv4_utf8_valid(const char *s, size_t n)
{
    return dsv4_utf8_valid_prefix(s, n) == n;
}

/* Write the code point cp (a Unicode scalar value: at most U+10FFFF, not a surrogate) to out; returns
 * the bytes written, 1 to 4. */
static inline size_t dsv4_utf8_put(char *out, uint32_t cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

#endif
