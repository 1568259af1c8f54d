/* SPDX-License-Identifier: MIT */
/* libFuzzer target for the chat format (engine/text/chat.c). The first input byte picks the mode (bit 0:
 * thinking) and the form of the rest:
 *   bit 1 clear: ids, 3 bytes each modulo the vocab size: dsv4_chat_parse_ids() and the stream
 *                (dsv4_chat_stream_feed/flush) must give the same reasoning and content;
 *   bit 1 set:   messages separated by 0xff, each led by its role byte (modulo 3): the conversation
 *                is built as text and as ids; encoding the text (flags 0) must give the same ids as
 *                dsv4_chat_build_ids() with content_flags 0, and dsv4_chat_parse_text() must accept
 *                the built text.
 * The tokenizer file comes from $DSV4_TOKENIZER_JSON (tests/fuzz/run_fuzz.sh sets it). */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/chat.h"
#include "engine/error.h"
#include "engine/text/tokenizer.h"

#define FUZZ_CHAT_MAX_MESSAGES 64

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct dsv4_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char *path = getenv("DSV4_TOKENIZER_JSON");
    struct dsv4_chat_tags tags;
    if (!path || dsv4_tokenizer_load(path, &tok) || dsv4_chat_tags_lookup(tok, &tags)) {
        fprintf(stderr, "fuzz_chat: set DSV4_TOKENIZER_JSON to a tokenizer.json with the chat tags (%s)\n",
                path ? dsv4_error_message() : "unset");
        exit(1);
    }
    return 0;
}

static void fuzz_parse(enum dsv4_chat_mode mode, const uint8_t *data, size_t size)
{
    size_t n = size / 3, vocab = dsv4_tokenizer_vocab_size(tok);
    int32_t *ids = malloc((n ? n : 1) * sizeof(*ids));
    if (!ids)
        abort();
    for (size_t i = 0; i < n; i++)
        ids[i] = (int32_t)(((size_t)data[3 * i] << 16 | (size_t)data[3 * i + 1] << 8 | data[3 * i + 2]) % vocab);

    struct dsv4_chat_reply reply;
    if (dsv4_chat_parse_ids(tok, mode, ids, n, &reply))
        abort();
    struct dsv4_chat_stream *s;
    if (dsv4_chat_stream_new(tok, mode, &s))
        abort();
    size_t got[2] = {0, 0};
    for (size_t i = 0; i <= n; i++) {
        struct dsv4_chat_delta delta;
        if (i < n ? dsv4_chat_stream_feed(s, ids[i], &delta) : dsv4_chat_stream_flush(s, &delta))
            abort();
        const char *want = delta.part == DSV4_CHAT_PART_REASONING ? reply.reasoning : reply.content;
        size_t want_len = delta.part == DSV4_CHAT_PART_REASONING ? reply.reasoning_len : reply.content_len;
        if (got[delta.part] + delta.len > want_len || memcmp(want + got[delta.part], delta.text, delta.len))
            abort();
        got[delta.part] += delta.len;
    }
    if (got[0] != reply.reasoning_len || got[1] != reply.content_len)
        abort();
    if (mode == DSV4_CHAT_MODE_CHAT && reply.reasoning_len)
        abort();
    dsv4_chat_stream_free(s);
    dsv4_chat_reply_free(&reply);
    free(ids);
}

static void fuzz_build(enum dsv4_chat_mode mode, const uint8_t *data, size_t size)
{
    struct dsv4_chat_message msgs[FUZZ_CHAT_MAX_MESSAGES];
    size_t n = 0;
    bool valid = true;
    for (size_t at = 0; at < size && n < FUZZ_CHAT_MAX_MESSAGES;) {
        const uint8_t *end = memchr(data + at, 0xff, size - at);
        size_t stop = end ? (size_t)(end - data) : size;
        if (stop == at) {       /* no role byte: no message */
            at++;
            continue;
        }
        struct dsv4_chat_message *m = &msgs[n++];
        m->role = (enum dsv4_chat_role)(data[at] % 3);
        m->content = (const char *)data + at + 1;
        m->content_len = stop - at - 1;
        m->reasoning = NULL;
        m->reasoning_len = 0;
        size_t vlen;
        char *v = dsv4_utf8_lossy(m->content, m->content_len, &vlen);
        if (!v)
            abort();
        valid = valid && vlen == m->content_len && !memcmp(v, m->content, vlen);
        free(v);
        at = stop + 1;
    }
    struct dsv4_chat_options opts = {.mode = mode};
    struct dsv4_tok_ids built = {0}, encoded = {0};
    char *text;
    size_t len;
    int r = dsv4_chat_build_ids(tok, msgs, n, &opts, &built);
    if (!valid) {
        if (r != -EILSEQ)
            abort();
        dsv4_tok_ids_free(&built);
        return;
    }
    if (r || dsv4_chat_build_text(msgs, n, &opts, &text, &len))
        abort();
    if (dsv4_tokenizer_encode(tok, text, len, 0, &encoded) || encoded.len != built.len ||
        memcmp(encoded.ids, built.ids, built.len * sizeof(*built.ids)))
        abort();
    struct dsv4_chat_reply reply;
    if (dsv4_chat_parse_text(mode, text, len, &reply))
        abort();
    dsv4_chat_reply_free(&reply);
    free(text);
    dsv4_tok_ids_free(&built);
    dsv4_tok_ids_free(&encoded);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!size)
        return 0;
    enum dsv4_chat_mode mode = data[0] & 1 ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    if (data[0] & 2)
        fuzz_build(mode, data + 1, size - 1);
    else
        fuzz_parse(mode, data + 1, size - 1);
    return 0;
}
