/* dsv4-run --tokenizer FILE --encode|--decode: the tokenizer on stdin/stdout.
 *   --encode  stdin: UTF-8 text, encoded whole; stdout: ids separated by spaces, then a newline
 *   --decode  stdin: ids separated by spaces/commas/newlines; stdout: the text (invalid UTF-8 from
 *             ids that cut a character becomes U+FFFD, as `tokenizers` returns it)
 * Options: --special-as-text / --added-as-text (encode: don't recognise special / any added
 * tokens), --skip-special (decode: drop special tokens). */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"
#include "engine/tokenizer.h"
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

static int run_encode(const struct dsv4_tokenizer *tok, unsigned flags)
{
    char *text;
    size_t len;
    struct dsv4_tok_ids ids = {0};
    int r = read_all(stdin, &text, &len);
    if (r)
        return r;
    r = dsv4_tokenizer_encode(tok, text, len, flags, &ids);
    free(text);
    if (r)
        return r;
    for (size_t i = 0; i < ids.len; i++)
        printf(i ? " %d" : "%d", ids.ids[i]);
    putchar('\n');
    dsv4_tok_ids_free(&ids);
    return fflush(stdout) ? dsv4_error_set(-EIO, "writing stdout: %s", strerror(errno)) : 0;
}

static int run_decode(const struct dsv4_tokenizer *tok, unsigned flags)
{
    char *text, *bytes = NULL;
    size_t len, nbytes;
    struct dsv4_tok_ids ids = {0};
    int r = read_all(stdin, &text, &len);
    if (r)
        return r;
    for (char *p = text; !r;) {
        p += strspn(p, " \t\r\n,");
        if (!*p)
            break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < INT32_MIN || v > INT32_MAX)
            r = dsv4_error_set(-EINVAL, "stdin: \"%.20s\" is not a token id", p);
        else
            r = dsv4_tok_ids_push(&ids, (int32_t)v);
        p = end;
    }
    free(text);
    if (!r)
        r = dsv4_tokenizer_decode(tok, ids.ids, ids.len, flags, &bytes, &nbytes);
    dsv4_tok_ids_free(&ids);
    if (r)
        return r;
    size_t olen;
    char *out = dsv4_utf8_lossy(bytes, nbytes, &olen);
    free(bytes);
    if (!out)
        return dsv4_error_set(-ENOMEM, "out of memory");
    r = fwrite(out, 1, olen, stdout) != olen || fflush(stdout)
            ? dsv4_error_set(-EIO, "writing stdout: %s", strerror(errno)) : 0;
    free(out);
    return r;
}

int dsv4_run_tokenizer(int argc, char **argv)
{
    const char *path = NULL;
    int mode = 0;  /* 'e' encode, 'd' decode */
    unsigned enc_flags = 0, dec_flags = 0;
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
        else if (!strcmp(argv[i], "--skip-special"))
            dec_flags |= DSV4_TOK_DECODE_SKIP_SPECIAL;
        else {
            fprintf(stderr, "dsv4-run: unknown or incomplete option %s\n", argv[i]);
            return 2;
        }
    }
    if (!path || !mode) {
        fprintf(stderr, "usage: dsv4-run --tokenizer FILE --encode|--decode [--special-as-text] "
                        "[--added-as-text] [--skip-special]\n");
        return 2;
    }
    struct dsv4_tokenizer *tok;
    int r = dsv4_tokenizer_load(path, &tok);
    if (!r) {
        r = mode == 'e' ? run_encode(tok, enc_flags) : run_decode(tok, dec_flags);
        dsv4_tokenizer_free(tok);
    }
    if (r) {
        fprintf(stderr, "dsv4-run: %s\n", dsv4_error_message());
        return 1;
    }
    return 0;
}
