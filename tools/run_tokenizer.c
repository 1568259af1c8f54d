/* SPDX-License-Identifier: MIT */
/* dsv4-run --tokenizer FILE --encode|--decode: the tokenizer on stdin/stdout.
 *   --encode  stdin: UTF-8 text, encoded whole; stdout: ids separated by spaces, then a newline
 *   --decode  stdin: ids separated by spaces/commas/newlines; stdout: the text (invalid UTF-8 from
 *             ids that cut a character becomes U+FFFD, as `tokenizers` returns it)
 * Options: --special-as-text / --added-as-text (encode: don't recognise special / any added
 * tokens), --skip-special (decode: drop special tokens), --records (encode: stdin holds records
 * separated by NUL bytes, each encoded on its own and written as one line of ids; decode: each line
 * of stdin is one sequence, the texts are written separated by NUL bytes). */
#include "build-config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"
#include "engine/text/tokenizer.h"
#include "tools/run.h"

/* Refuse more input than this on stdin. */
#define RUN_TOK_MAX_INPUT ((size_t)1 << 30)

static int read_all(FILE *f, char **ret, size_t *ret_len)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (len < cap) {
            if (ferror(f)) {
                free(buf);
                return dsv4_error_set(-EIO, "reading stdin: %s", strerror(errno));
            }
            buf[len] = '\0';
            *ret = buf;
            *ret_len = len;
            return 0;
        }
        if (cap >= RUN_TOK_MAX_INPUT) {
            free(buf);
            return dsv4_error_set(-E2BIG, "stdin is larger than %zu bytes", RUN_TOK_MAX_INPUT);
        }
        cap *= 2;
        char *n = realloc(buf, cap + 1);
        if (!n)
            free(buf);
        buf = n;
    }
    return dsv4_error_set(-ENOMEM, "out of memory reading stdin");
}

static int encode_print(const struct dsv4_tokenizer *tok, const char *text, size_t len, unsigned flags,
                        struct dsv4_tok_ids *ids)
{
    ids->len = 0;
    int r = dsv4_tokenizer_encode(tok, text, len, flags, ids);
    if (r)
        return r;
    for (size_t i = 0; i < ids->len; i++)
        printf(i ? " %d" : "%d", ids->ids[i]);
    putchar('\n');
    return 0;
}

static int run_encode(const struct dsv4_tokenizer *tok, unsigned flags, bool records)
{
    char *text;
    size_t len;
    struct dsv4_tok_ids ids = {0};
    int r = read_all(stdin, &text, &len);
    if (r)
        return r;
    if (!records) {
        r = encode_print(tok, text, len, flags, &ids);
    } else {
        for (size_t at = 0, n = 0; !r && at <= len; at += n + 1, n = 0) {
            const char *nul = memchr(text + at, '\0', len - at);
            n = nul ? (size_t)(nul - (text + at)) : len - at;
            if ((r = encode_print(tok, text + at, n, flags, &ids)))
                dsv4_error_prefix(r, "record at byte %zu: ", at);
        }
    }
    free(text);
    dsv4_tok_ids_free(&ids);
    if (r)
        return r;
    return fflush(stdout) ? dsv4_error_set(-EIO, "writing stdout: %s", strerror(errno)) : 0;
}

static int decode_write(const struct dsv4_tokenizer *tok, const struct dsv4_tok_ids *ids, unsigned flags)
{
    char *bytes;
    size_t nbytes, olen;
    int r = dsv4_tokenizer_decode(tok, ids->ids, ids->len, flags, &bytes, &nbytes);
    if (r)
        return r;
    char *out = dsv4_utf8_lossy(bytes, nbytes, &olen);
    free(bytes);
    if (!out)
        return dsv4_error_set(-ENOMEM, "out of memory");
    r = fwrite(out, 1, olen, stdout) != olen ? dsv4_error_set(-EIO, "writing stdout: %s", strerror(errno)) : 0;
    free(out);
    return r;
}

/* Parse the ids in text[0..len) (separated by spaces, tabs, commas, newlines) into ids. */
static int parse_ids(const char *text, size_t len, struct dsv4_tok_ids *ids)
{
    ids->len = 0;
    for (size_t i = 0; i < len;) {
        if (strchr(" \t\r\n,", text[i])) {
            i++;
            continue;
        }
        long v = 0;
        size_t start = i;
        while (i < len && text[i] >= '0' && text[i] <= '9' && v <= INT32_MAX)
            v = v * 10 + (text[i++] - '0');
        if (i == start || v > INT32_MAX || (i < len && !strchr(" \t\r\n,", text[i])))
            return dsv4_error_set(-EINVAL, "stdin: \"%.20s\" is not a token id", text + start);
        int r = dsv4_tok_ids_push(ids, (int32_t)v);
        if (r)
            return r;
    }
    return 0;
}

/* With `records`, each input line is one sequence and the texts are written separated by NULs. */
static int run_decode(const struct dsv4_tokenizer *tok, unsigned flags, bool records)
{
    char *text;
    size_t len;
    struct dsv4_tok_ids ids = {0};
    int r = read_all(stdin, &text, &len);
    if (r)
        return r;
    if (!records) {
        if (!(r = parse_ids(text, len, &ids)))
            r = decode_write(tok, &ids, flags);
    } else {
        /* A final newline ends the last line rather than starting an empty one. */
        size_t end = len && text[len - 1] == '\n' ? len - 1 : len;
        for (size_t at = 0, line = 0; !r && at <= end; line++) {
            const char *nl = memchr(text + at, '\n', end - at);
            size_t n = nl ? (size_t)(nl - (text + at)) : end - at;
            if (line)
                putchar('\0');
            if ((r = parse_ids(text + at, n, &ids)) || (r = decode_write(tok, &ids, flags)))
                dsv4_error_prefix(r, "line %zu: ", line + 1);
            at += n + 1;
        }
    }
    free(text);
    dsv4_tok_ids_free(&ids);
    if (!r && fflush(stdout))
        r = dsv4_error_set(-EIO, "writing stdout: %s", strerror(errno));
    return r;
}

int dsv4_run_tokenizer(int argc, char **argv)
{
    const char *path = NULL;
    int mode = 0;  /* 'e' encode, 'd' decode */
    unsigned enc_flags = 0, dec_flags = 0;
    bool records = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc)
            path = argv[++i];
        else if (!strcmp(argv[i], "--encode"))
            mode = 'e';
        else if (!strcmp(argv[i], "--decode"))
            mode = 'd';
        else if (!strcmp(argv[i], "--special-as-text"))
            enc_flags |= DSV4_TOK_ENCODE_SPECIAL_AS_TEXT;
        else if (!strcmp(argv[i], "--added-as-text"))
            enc_flags |= DSV4_TOK_ENCODE_ADDED_AS_TEXT;
        else if (!strcmp(argv[i], "--records"))
            records = true;
        else if (!strcmp(argv[i], "--skip-special"))
            dec_flags |= DSV4_TOK_DECODE_SKIP_SPECIAL;
        else {
            fprintf(stderr, "dsv4-run: unknown or incomplete option %s\n", argv[i]);
            return 2;
        }
    }
    if (!path || !mode) {
        fprintf(stderr, "usage: dsv4-run --tokenizer FILE --encode|--decode [--special-as-text] "
                        "[--added-as-text] [--records] [--skip-special]\n");
        return 2;
    }
    struct dsv4_tokenizer *tok;
    int r = dsv4_tokenizer_load(path, &tok);
    if (!r) {
        r = mode == 'e' ? run_encode(tok, enc_flags, records) : run_decode(tok, dec_flags, records);
        dsv4_tokenizer_free(tok);
    }
    if (r) {
        fprintf(stderr, "dsv4-run: %s\n", dsv4_error_message());
        return 1;
    }
    return 0;
}
