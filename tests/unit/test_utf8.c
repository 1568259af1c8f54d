/* SPDX-License-Identifier: MIT */
/* base/utf8: the scanner against a reference built here from the definition, not from the code: the
 * encodings of every Unicode scalar value (written by a generic shift loop) give the set of valid
 * characters and of their proper prefixes; a maximal invalid subpart is the longest run that is such a
 * prefix. Checked on every sequence of up to 3 bytes, on 4-byte sequences over boundary bytes, on
 * every scalar value's encoding, on Unicode's own example of U+FFFD substitution, and on random text. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "base/utf8.h"
#include "tests/unit/seed_util.h"

#define UNICODE_MAX 0x10FFFFu

/* Proper prefixes of valid encodings, by length: pre1[b], pre2[b0 b1], pre3[b0 b1 b2] (bitsets). */
static uint8_t pre1[256 / 8], pre2[65536 / 8], pre3[(1u << 24) / 8];

static void bit_set(uint8_t *set, uint32_t i) { set[i >> 3] |= (uint8_t)(1u << (i & 7)); }
static int bit_get(const uint8_t *set, uint32_t i) { return set[i >> 3] >> (i & 7) & 1; }

static int is_scalar(uint32_t cp)
{
    return cp <= UNICODE_MAX && !(cp >= 0xD800 && cp <= 0xDFFF);
}

/* The shortest encoding of cp, surrogates included (they are encodable, just not valid). */
static int ref_encode(uint32_t cp, unsigned char *out)
{
    int len = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;

    if (len == 1) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    for (int i = len - 1; i > 0; i--) {
        out[i] = (unsigned char)(0x80 | (cp & 0x3F));
        cp >>= 6;
    }
    out[0] = (unsigned char)(((0xF00u >> len) & 0xFF) | cp);
    return len;
}

static int setup_prefixes(void **state)
{
    for (uint32_t cp = 0; cp <= UNICODE_MAX; cp++) {
        unsigned char e[4];
        int len;

        if (!is_scalar(cp))
            continue;
        len = ref_encode(cp, e);
        if (len > 1)
            bit_set(pre1, e[0]);
        if (len > 2)
            bit_set(pre2, (uint32_t)e[0] << 8 | e[1]);
        if (len > 3)
            bit_set(pre3, (uint32_t)e[0] << 16 | (uint32_t)e[1] << 8 | e[2]);
    }
    return 0;
}

/* 1..4 when p[0..len) is exactly one valid character of that length, else 0. */
static int ref_char_len(const unsigned char *p, size_t n)
{
    int len = p[0] < 0x80 ? 1 : (p[0] & 0xE0) == 0xC0 ? 2 : (p[0] & 0xF0) == 0xE0 ? 3 : (p[0] & 0xF8) == 0xF0 ? 4 : 0;
    unsigned char e[4];
    uint32_t cp;

    if (!len || (size_t)len > n)
        return 0;
    cp = len == 1 ? p[0] : p[0] & (0x7Fu >> len);
    for (int i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (p[i] & 0x3F);
    }
    /* Valid when it is a scalar value written in its shortest form. */
    if (!is_scalar(cp) || ref_encode(cp, e) != len)
        return 0;
    return len;
}

static int ref_is_proper_prefix(const unsigned char *p, size_t k)
{
    switch (k) {
    case 1: return bit_get(pre1, p[0]);
    case 2: return bit_get(pre2, (uint32_t)p[0] << 8 | p[1]);
    case 3: return bit_get(pre3, (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2]);
    default: return 0;
    }
}

static enum dsv4_utf8_step ref_step(const unsigned char *p, size_t n, size_t *used)
{
    size_t m = 0;
    int len = ref_char_len(p, n);

    if (len) {
        *used = (size_t)len;
        return DSV4_UTF8_VALID;
    }
    for (size_t k = 1; k <= 3 && k <= n; k++)
        if (ref_is_proper_prefix(p, k))
            m = k;
    if (m == 0) {
        *used = 1;
        return DSV4_UTF8_INVALID;
    }
    *used = m;
    return m == n ? DSV4_UTF8_INCOMPLETE : DSV4_UTF8_INVALID;
}

/* Both scanners on p[0..n) and on each shorter cut of it. */
static void check_seq(const unsigned char *p, size_t n)
{
    for (size_t cut = 1; cut <= n; cut++) {
        size_t used = 0, ref_used = 0;
        enum dsv4_utf8_step st = dsv4_utf8_step(p, cut, &used), ref = ref_step(p, cut, &ref_used);

        if (st != ref || used != ref_used)
            fail_msg("%02x %02x %02x %02x (first %zu bytes): step %d used %zu, reference %d used %zu", p[0],
                     n > 1 ? p[1] : 0, n > 2 ? p[2] : 0, n > 3 ? p[3] : 0, cut, st, used, ref, ref_used);
    }
}

static void test_every_short_sequence(void **state)
{
    unsigned char p[3];

    for (uint32_t v = 0; v < 256; v++) {
        p[0] = (unsigned char)v;
        check_seq(p, 1);
    }
    for (uint32_t v = 0; v < 65536; v++) {
        p[0] = (unsigned char)(v >> 8);
        p[1] = (unsigned char)v;
        check_seq(p, 2);
    }
    /* Three bytes: only lead bytes that can start a multi-byte character lead anywhere new. */
    for (uint32_t v = 0xC0u << 16; v < 1u << 24; v++) {
        p[0] = (unsigned char)(v >> 16);
        p[1] = (unsigned char)(v >> 8);
        p[2] = (unsigned char)v;
        check_seq(p, 3);
    }
}

static void test_four_byte_boundaries(void **state)
{
    /* Each range edge of Unicode Table 3-7, and bytes just outside them. */
    static const unsigned char edge[] = { 0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xE0,
                                          0xF0, 0xF4, 0xF5, 0xFF };
    unsigned char p[4];

    for (uint32_t b0 = 0xC0; b0 < 256; b0++)
        for (uint32_t b1 = 0; b1 < 256; b1++)
            for (size_t i = 0; i < sizeof(edge); i++)
                for (size_t j = 0; j < sizeof(edge); j++) {
                    p[0] = (unsigned char)b0;
                    p[1] = (unsigned char)b1;
                    p[2] = edge[i];
                    p[3] = edge[j];
                    check_seq(p, 4);
                }
}

static void test_every_scalar_value(void **state)
{
    for (uint32_t cp = 0; cp <= UNICODE_MAX; cp++) {
        unsigned char ref[4];
        char out[4];
        int ref_len = ref_encode(cp, ref);
        size_t used = 0;

        if (!is_scalar(cp)) {
            /* A surrogate's encoding is invalid: ED then a byte above 9F. */
            assert_int_equal(dsv4_utf8_step(ref, (size_t)ref_len, &used), DSV4_UTF8_INVALID);
            assert_int_equal(used, 1);
            assert_false(dsv4_utf8_valid((const char *)ref, (size_t)ref_len));
            continue;
        }
        assert_int_equal(dsv4_utf8_put(out, cp), ref_len);
        assert_memory_equal(out, ref, (size_t)ref_len);
        assert_int_equal(dsv4_utf8_step((const unsigned char *)out, (size_t)ref_len, &used), DSV4_UTF8_VALID);
        assert_int_equal(used, ref_len);
        assert_true(dsv4_utf8_valid(out, (size_t)ref_len));
    }
}

/* Repair as a lossy decoder does: one U+FFFD per invalid or (at the end) incomplete step. */
static size_t repair(const char *in, size_t n, char *out)
{
    size_t i = 0, o = 0;

    while (i < n) {
        size_t used;

        if (dsv4_utf8_step((const unsigned char *)in + i, n - i, &used) == DSV4_UTF8_VALID) {
            memcpy(out + o, in + i, used);
            o += used;
        } else {
            memcpy(out + o, DSV4_UTF8_REPLACEMENT, DSV4_UTF8_REPLACEMENT_LEN);
            o += DSV4_UTF8_REPLACEMENT_LEN;
        }
        i += used;
    }
    return o;
}

static void test_maximal_subparts(void **state)
{
    /* The Unicode Standard's example of U+FFFD substitution of maximal subparts (chapter 3, Table 3-11):
     * 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 -> a FFFD FFFD FFFD b FFFD c FFFD FFFD d. */
    static const char in[] = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
    static const char want[] = "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c\xEF\xBF\xBD\xEF\xBF\xBD" "d";
    char out[3 * sizeof(in)];
    size_t n = repair(in, sizeof(in) - 1, out);

    assert_int_equal(n, sizeof(want) - 1);
    assert_memory_equal(out, want, n);
    /* A character cut at the end of the input is one U+FFFD, and the valid prefix stops before it. */
    assert_int_equal(repair("ab\xE2\x82", 4, out), 2 + DSV4_UTF8_REPLACEMENT_LEN);
    assert_int_equal(dsv4_utf8_valid_prefix("ab\xE2\x82", 4), 2);
    /* Overlong forms, a surrogate, above U+10FFFF: refused at their first byte. */
    assert_int_equal(dsv4_utf8_valid_prefix("x\xC0\xAF", 3), 1);
    assert_int_equal(dsv4_utf8_valid_prefix("xy\xE0\x80\xAF", 5), 2);
    assert_int_equal(dsv4_utf8_valid_prefix("\xED\xA0\x80", 3), 0);
    assert_int_equal(dsv4_utf8_valid_prefix("\xF4\x90\x80\x80", 4), 0);
    assert_int_equal(dsv4_utf8_valid_prefix("\xF4\x8F\xBF\xBF", 4), 4);
    assert_true(dsv4_utf8_valid("", 0));
}

static uint64_t xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void test_random_text(void **state)
{
    uint64_t seed = dsv4_test_seed();

    for (int round = 0; round < 20000; round++) {
        unsigned char buf[64];
        size_t n = xorshift(&seed) % sizeof(buf), i = 0, want;

        /* Mostly valid characters, now and then a random byte. */
        while (i < n) {
            uint64_t r = xorshift(&seed);
            if (r % 16 == 0) {
                buf[i++] = (unsigned char)(r >> 8);
                continue;
            }
            uint32_t cp = (uint32_t)(r >> 8) % (UNICODE_MAX + 1);
            unsigned char e[4];
            int len = ref_encode(is_scalar(cp) ? cp : 'x', e);
            if (i + (size_t)len > n)
                break;
            memcpy(buf + i, e, (size_t)len);
            i += (size_t)len;
        }
        n = i;
        for (want = 0; want < n;) {
            size_t used;
            if (ref_step(buf + want, n - want, &used) != DSV4_UTF8_VALID)
                break;
            want += used;
        }
        assert_int_equal(dsv4_utf8_valid_prefix((const char *)buf, n), want);
        assert_int_equal(dsv4_utf8_valid((const char *)buf, n), want == n);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_short_sequence),
        cmocka_unit_test(test_four_byte_boundaries),
        cmocka_unit_test(test_every_scalar_value),
        cmocka_unit_test(test_maximal_subparts),
        cmocka_unit_test(test_random_text),
    };
    return cmocka_run_group_tests(tests, setup_prefixes, NULL);
}
