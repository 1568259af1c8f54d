/* SPDX-License-Identifier: MIT */
/* libFuzzer target for the tokenizer (the chat format has tests/fuzz/fuzz_chat.c). The first input
 * byte picks the mode:
 *   bit 7 clear: the rest is text, encoded with flags (byte & 3); valid UTF-8 must encode and
 *                decode back to itself, invalid UTF-8 must be refused with -EILSEQ; then the text
 *                goes through the chat builder as user content (added tokens as text) and the ids
 *                of the content must decode back to it;
 *   bit 7 set:   the rest is ids (3 bytes each, modulo the vocab size); whole decoding and
 *                streaming detokenization must agree.
 * The tokenizer file comes from $DSV4_TOKENIZER_JSON (tests/fuzz/run_fuzz.sh sets it). */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/chat.h"
#include "engine/error.h"
#include "engine/text/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct dsv4_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char *path = getenv("DSV4_TOKENIZER_JSON");
    if (!path || dsv4_tokenizer_load(path, &tok)) {
        fprintf(stderr, "fuzz_tokenizer: set DSV4_TOKENIZER_JSON to a loadable tokenizer.json (%s)\n",
                path ? dsv4_error_message() : "unset");
        exit(1);
    }
    return 0;
}

static void fuzz_text(unsigned flags, const char *text, size_t len)
{
    struct dsv4_tok_ids ids = {0};
    size_t vlen;
    char *valid = dsv4_utf8_lossy(text, len, &vlen);
    bool is_valid = vlen == len && !memcmp(valid, text, len);
    free(valid);
    int r = dsv4_tokenizer_encode(tok, text, len, flags, &ids);
    if (!is_valid) {
        if (r != -EILSEQ)
            abort();
        dsv4_tok_ids_free(&ids);
        return;
    }
    char *back;
    size_t blen;
    if (r || dsv4_tokenizer_decode(tok, ids.ids, ids.len, 0, &back, &blen))
        abort();
    if (blen != len || memcmp(back, text, len))
        abort();
    free(back);

    struct dsv4_chat_message msg = {DSV4_CHAT_ROLE_USER, text, len, NULL, 0};
    struct dsv4_chat_options opts = {.mode = DSV4_CHAT_MODE_THINKING, .content_flags = DSV4_TOK_ENCODE_ADDED_AS_TEXT};
    ids.len = 0;
    if (dsv4_chat_build_ids(tok, &msg, 1, &opts, &ids) || ids.len < 4)
        abort();
    /* BOS USER content... ASSISTANT <think> */
    if (dsv4_tokenizer_decode(tok, ids.ids + 2, ids.len - 4, 0, &back, &blen) || blen != len ||
        memcmp(back, text, len))
        abort();
    free(back);
    dsv4_tok_ids_free(&ids);
}

static void fuzz_ids(const uint8_t *data, size_t size)
{
    size_t n = size / 3, vocab = dsv4_tokenizer_vocab_size(tok);
    int32_t *ids = malloc((n ? n : 1) * sizeof(*ids));
    for (size_t i = 0; i < n; i++)
        ids[i] = (int32_t)(((size_t)data[3 * i] << 16 | (size_t)data[3 * i + 1] << 8 | data[3 * i + 2]) % vocab);
    char *raw, *whole;
    size_t rlen, wlen;
    if (dsv4_tokenizer_decode(tok, ids, n, 0, &raw, &rlen) || !(whole = dsv4_utf8_lossy(raw, rlen, &wlen)))
        abort();
    struct dsv4_detok *d;
    if (dsv4_detok_new(tok, 0, &d))
        abort();
    size_t at = 0;
    for (size_t i = 0; i <= n; i++) {
        const char *piece;
        size_t plen;
        if ((i < n ? dsv4_detok_feed(d, ids[i], &piece, &plen) : dsv4_detok_flush(d, &piece, &plen)) ||
            at + plen > wlen || memcmp(whole + at, piece, plen))
            abort();
        at += plen;
    }
    if (at != wlen)
        abort();
    dsv4_detok_free(d);

    free(raw);
    free(whole);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!size)
        return 0;
    if (data[0] & 0x80)
        fuzz_ids(data + 1, size - 1);
    else
        fuzz_text(data[0] & 3, (const char *)data + 1, size - 1);
    return 0;
}
