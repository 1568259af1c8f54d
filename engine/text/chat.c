/* SPDX-License-Identifier: MIT */
/* engine/text/chat: the DeepSeek-V4 prompt format and completion parsing (rules in chat.h). */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "engine/text/chat.h"
#include "engine/error.h"

int dsv4_chat_tags_lookup(const struct dsv4_tokenizer *tok, struct dsv4_chat_tags *ret_tags)
{
    const char *names[6] = {DSV4_CHAT_BOS_TEXT, DSV4_CHAT_EOS_TEXT, DSV4_CHAT_USER_TEXT,
                            DSV4_CHAT_ASSISTANT_TEXT, DSV4_CHAT_THINK_START_TEXT, DSV4_CHAT_THINK_END_TEXT};
    int32_t *slots[6] = {&ret_tags->bos, &ret_tags->eos, &ret_tags->user, &ret_tags->assistant,
                         &ret_tags->think_start, &ret_tags->think_end};
    for (size_t i = 0; i < 6; i++) {
        int32_t id = dsv4_tokenizer_added_id(tok, names[i]);
        if (id < 0)
            return dsv4_error_prefix(id, "chat format: ");
        *slots[i] = id;
    }
    return 0;
}

/* The ids and text builders share one walk over the messages; a sink receives tags and text. */
struct chat_sink {
    int (*tag)(struct chat_sink *s, size_t which);  /* which: index into the tag tables below */
    int (*text)(struct chat_sink *s, const char *text, size_t len, size_t msg);
};

enum { TAG_BOS, TAG_EOS, TAG_USER, TAG_ASSISTANT, TAG_THINK_START, TAG_THINK_END };

static const char *const tag_text[] = {DSV4_CHAT_BOS_TEXT, DSV4_CHAT_EOS_TEXT, DSV4_CHAT_USER_TEXT,
                                       DSV4_CHAT_ASSISTANT_TEXT, DSV4_CHAT_THINK_START_TEXT,
                                       DSV4_CHAT_THINK_END_TEXT};

static int chat_walk(const struct dsv4_chat_message *msgs, size_t n, const struct dsv4_chat_options *opts,
                     struct chat_sink *sink)
{
    if (n > DSV4_CHAT_MAX_MESSAGES)
        return dsv4_error_set(-E2BIG, "chat: %zu messages, more than the limit of %d", n,
                              DSV4_CHAT_MAX_MESSAGES);
    if (opts->mode != DSV4_CHAT_MODE_CHAT && opts->mode != DSV4_CHAT_MODE_THINKING)
        return dsv4_error_set(-EINVAL, "chat: unknown mode %d", (int)opts->mode);
    bool thinking = opts->mode == DSV4_CHAT_MODE_THINKING;
    size_t last_user = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        if (msgs[i].role == DSV4_CHAT_ROLE_USER)
            last_user = i;
        else if (msgs[i].role != DSV4_CHAT_ROLE_SYSTEM && msgs[i].role != DSV4_CHAT_ROLE_ASSISTANT)
            return dsv4_error_set(-EINVAL, "chat: message %zu has unknown role %d", i, (int)msgs[i].role);
        if (!msgs[i].content && msgs[i].content_len)
            return dsv4_error_set(-EINVAL, "chat: message %zu has no content pointer", i);
    }
    int r = 0;
    if (!opts->no_bos)
        r = sink->tag(sink, TAG_BOS);
    if (!r && opts->system)
        r = sink->text(sink, opts->system, opts->system_len, SIZE_MAX);
    for (size_t i = 0; i < n && !r; i++) {
        const struct dsv4_chat_message *m = &msgs[i];
        switch (m->role) {
        case DSV4_CHAT_ROLE_SYSTEM:
            r = sink->text(sink, m->content, m->content_len, i);
            break;
        case DSV4_CHAT_ROLE_USER:
            /* A user message right after another joins its turn, after a blank line. */
            if (i > 0 && msgs[i - 1].role == DSV4_CHAT_ROLE_USER)
                r = sink->text(sink, "\n\n", 2, i);
            else
                r = sink->tag(sink, TAG_USER);
            if (!r)
                r = sink->text(sink, m->content, m->content_len, i);
            /* The assistant is handed the turn only when it answers next (or the conversation ends). */
            if (!r && (i + 1 == n || msgs[i + 1].role == DSV4_CHAT_ROLE_ASSISTANT) &&
                !(r = sink->tag(sink, TAG_ASSISTANT)))
                r = sink->tag(sink, thinking && i == last_user ? TAG_THINK_START : TAG_THINK_END);
            break;
        case DSV4_CHAT_ROLE_ASSISTANT:
            /* Reasoning survives only in the turn being continued (after the last user message). */
            if (thinking && (last_user == SIZE_MAX || i > last_user)) {
                if (m->reasoning)
                    r = sink->text(sink, m->reasoning, m->reasoning_len, i);
                if (!r)
                    r = sink->tag(sink, TAG_THINK_END);
            }
            if (!r && !(r = sink->text(sink, m->content, m->content_len, i)))
                r = sink->tag(sink, TAG_EOS);
            break;
        }
    }
    return r;
}

/* Text that meets text with no tag between (a system message before another system or an assistant
 * message, a user message before a system message or another user message) is encoded as one piece,
 * as encoding the built text does: BPE does not split where the messages met. Each piece is checked
 * for UTF-8 on its own, so the error names its message. */
struct ids_sink {
    struct chat_sink base;
    const struct dsv4_tokenizer *tok;
    struct dsv4_chat_tags tags;
    unsigned flags;
    struct dsv4_tok_ids *out;
    char *text;             /* [text_len] pending text of messages text_first..text_last */
    size_t text_len, text_cap, text_first, text_last;
};

static int ids_flush(struct ids_sink *k)
{
    if (!k->text_len)
        return 0;
    int r = dsv4_tokenizer_encode(k->tok, k->text, k->text_len, k->flags, k->out);
    k->text_len = 0;
    if (r && k->text_first == SIZE_MAX && k->text_last == SIZE_MAX)
        return dsv4_error_prefix(r, "chat: system prompt: ");
    if (r && k->text_first != k->text_last)
        return dsv4_error_prefix(r, "chat: messages %zu to %zu: ", k->text_first == SIZE_MAX ? 0 : k->text_first,
                                 k->text_last);
    return r ? dsv4_error_prefix(r, "chat: message %zu: ", k->text_last) : 0;
}

static int ids_tag(struct chat_sink *s, size_t which)
{
    struct ids_sink *k = (struct ids_sink *)s;
    const int32_t ids[] = {k->tags.bos, k->tags.eos, k->tags.user, k->tags.assistant, k->tags.think_start,
                           k->tags.think_end};
    int r = ids_flush(k);
    return r ? r : dsv4_tok_ids_push(k->out, ids[which]);
}

static int ids_text(struct chat_sink *s, const char *text, size_t len, size_t msg)
{
    struct ids_sink *k = (struct ids_sink *)s;
    size_t bad = dsv4_utf8_valid_prefix(text, len);
    if (bad != len && msg == SIZE_MAX)
        return dsv4_error_set(-EILSEQ, "chat: system prompt: not valid UTF-8 at byte %zu", bad);
    if (bad != len)
        return dsv4_error_set(-EILSEQ, "chat: message %zu: not valid UTF-8 at byte %zu", msg, bad);
    if (!len)
        return 0;
    if (k->text_len + len > k->text_cap) {
        size_t cap = k->text_cap ? k->text_cap : 256;
        while (cap < k->text_len + len)
            cap *= 2;
        char *d = realloc(k->text, cap);
        if (!d)
            return dsv4_error_set(-ENOMEM, "chat: out of memory building a prompt of %zu bytes", cap);
        k->text = d;
        k->text_cap = cap;
    }
    if (!k->text_len)
        k->text_first = msg;
    k->text_last = msg;
    memcpy(k->text + k->text_len, text, len);
    k->text_len += len;
    return 0;
}

int dsv4_chat_build_ids(const struct dsv4_tokenizer *tok, const struct dsv4_chat_message *msgs, size_t n,
                        const struct dsv4_chat_options *opts, struct dsv4_tok_ids *out)
{
    struct ids_sink k = {.base = {ids_tag, ids_text}, .tok = tok, .flags = opts->content_flags, .out = out};
    int r = dsv4_chat_tags_lookup(tok, &k.tags);
    if (!r)
        r = chat_walk(msgs, n, opts, &k.base);
    if (!r)
        r = ids_flush(&k);
    free(k.text);
    return r;
}

struct text_sink {
    struct chat_sink base;
    char *data;
    size_t len, cap;
};

static int text_put(struct chat_sink *s, const char *text, size_t len, size_t msg)
{
    struct text_sink *k = (struct text_sink *)s;
    if (k->len + len + 1 > k->cap) {
        size_t cap = k->cap ? k->cap : 256;
        while (cap < k->len + len + 1)
            cap *= 2;
        char *d = realloc(k->data, cap);
        if (!d)
            return dsv4_error_set(-ENOMEM, "chat: out of memory building a prompt of %zu bytes", cap);
        k->data = d;
        k->cap = cap;
    }
    if (len)    /* a message may have no content pointer when it has no content */
        memcpy(k->data + k->len, text, len);
    k->len += len;
    k->data[k->len] = '\0';
    return 0;
}

static int text_tag(struct chat_sink *s, size_t which)
{
    return text_put(s, tag_text[which], strlen(tag_text[which]), 0);
}

int dsv4_chat_build_text(const struct dsv4_chat_message *msgs, size_t n, const struct dsv4_chat_options *opts,
                         char **ret_text, size_t *ret_len)
{
    struct text_sink k = {.base = {text_tag, text_put}};
    *ret_text = NULL;
    int r = text_put(&k.base, "", 0, 0);
    if (!r)
        r = chat_walk(msgs, n, opts, &k.base);
    if (r) {
        free(k.data);
        return r;
    }
    *ret_text = k.data;
    *ret_len = k.len;
    return 0;
}

/* ---- parsing ---- */

void dsv4_chat_reply_free(struct dsv4_chat_reply *reply)
{
    if (!reply)
        return;
    free(reply->reasoning);
    free(reply->content);
    reply->reasoning = reply->content = NULL;
    reply->reasoning_len = reply->content_len = 0;
}

static int reply_set(struct dsv4_chat_reply *reply, const char *reasoning, size_t rlen, const char *content,
                     size_t clen)
{
    reply->reasoning = dsv4_utf8_lossy(reasoning, rlen, &reply->reasoning_len);
    reply->content = dsv4_utf8_lossy(content, clen, &reply->content_len);
    if (!reply->reasoning || !reply->content) {
        dsv4_chat_reply_free(reply);
        return dsv4_error_set(-ENOMEM, "chat: out of memory parsing a reply");
    }
    return 0;
}

int dsv4_chat_parse_ids(const struct dsv4_tokenizer *tok, enum dsv4_chat_mode mode, const int32_t *ids,
                        size_t n, struct dsv4_chat_reply *ret_reply)
{
    memset(ret_reply, 0, sizeof(*ret_reply));
    struct dsv4_chat_tags tags;
    int r = dsv4_chat_tags_lookup(tok, &tags);
    if (r)
        return r;
    /* ids [0, split) are reasoning, [split + 1, end) content (split = end in chat mode: no reasoning). */
    size_t end = n, split = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] == tags.eos) {
            end = i;
            ret_reply->finished = true;
            break;
        }
        if (mode == DSV4_CHAT_MODE_THINKING && split == SIZE_MAX && ids[i] == tags.think_end)
            split = i;
    }
    size_t rend = 0, cstart = 0;
    if (mode == DSV4_CHAT_MODE_THINKING) {
        ret_reply->reasoning_closed = split != SIZE_MAX;
        rend = split != SIZE_MAX ? split : end;
        cstart = split != SIZE_MAX ? split + 1 : end;
    }
    char *reasoning = NULL, *content = NULL;
    size_t rlen = 0, clen = 0;
    r = dsv4_tokenizer_decode(tok, ids, rend, DSV4_TOK_DECODE_SKIP_SPECIAL, &reasoning, &rlen);
    if (!r)
        r = dsv4_tokenizer_decode(tok, ids + cstart, end - cstart, DSV4_TOK_DECODE_SKIP_SPECIAL, &content, &clen);
    if (!r)
        r = reply_set(ret_reply, reasoning, rlen, content, clen);
    free(reasoning);
    free(content);
    return r ? dsv4_error_prefix(r, "chat: parsing a reply: ") : 0;
}

int dsv4_chat_parse_text(enum dsv4_chat_mode mode, const char *text, size_t len, struct dsv4_chat_reply *ret_reply)
{
    memset(ret_reply, 0, sizeof(*ret_reply));
    const char *eos = memmem(text, len, DSV4_CHAT_EOS_TEXT, strlen(DSV4_CHAT_EOS_TEXT));
    if (eos) {
        len = (size_t)(eos - text);
        ret_reply->finished = true;
    }
    const char *content = text;
    size_t rlen = 0;
    if (mode == DSV4_CHAT_MODE_THINKING) {
        const char *close = memmem(text, len, DSV4_CHAT_THINK_END_TEXT, strlen(DSV4_CHAT_THINK_END_TEXT));
        ret_reply->reasoning_closed = close != NULL;
        rlen = close ? (size_t)(close - text) : len;
        content = close ? close + strlen(DSV4_CHAT_THINK_END_TEXT) : text + len;
    }
    return reply_set(ret_reply, text, rlen, content, len - (size_t)(content - text));
}

/* ---- streaming ---- */

struct dsv4_chat_stream {
    const struct dsv4_tokenizer *tok;
    struct dsv4_chat_tags tags;
    struct dsv4_detok *detok;
    enum dsv4_chat_part part;
    bool finished;
};

int dsv4_chat_stream_new(const struct dsv4_tokenizer *tok, enum dsv4_chat_mode mode, struct dsv4_chat_stream **ret)
{
    *ret = NULL;
    struct dsv4_chat_stream *s = calloc(1, sizeof(*s));
    if (!s)
        return dsv4_error_set(-ENOMEM, "chat: out of memory");
    int r = dsv4_chat_tags_lookup(tok, &s->tags);
    if (!r)
        r = dsv4_detok_new(tok, DSV4_TOK_DECODE_SKIP_SPECIAL, &s->detok);
    if (r) {
        free(s);
        return r;
    }
    s->tok = tok;
    s->part = mode == DSV4_CHAT_MODE_THINKING ? DSV4_CHAT_PART_REASONING : DSV4_CHAT_PART_CONTENT;
    *ret = s;
    return 0;
}

void dsv4_chat_stream_free(struct dsv4_chat_stream *s)
{
    if (!s)
        return;
    dsv4_detok_free(s->detok);
    free(s);
}

int dsv4_chat_stream_feed(struct dsv4_chat_stream *s, int32_t id, struct dsv4_chat_delta *ret_delta)
{
    *ret_delta = (struct dsv4_chat_delta){.part = s->part, .text = "", .finished = s->finished};
    if (s->finished)
        return 0;
    size_t len;
    if (!dsv4_tokenizer_token_bytes(s->tok, id, &len))
        return dsv4_error_set(-ERANGE, "chat: id %d is not in the vocabulary", id);
    int r;
    if (id == s->tags.eos) {
        s->finished = ret_delta->finished = true;
        r = dsv4_detok_flush(s->detok, &ret_delta->text, &ret_delta->len);
    } else if (s->part == DSV4_CHAT_PART_REASONING && id == s->tags.think_end) {
        r = dsv4_detok_flush(s->detok, &ret_delta->text, &ret_delta->len);
        s->part = DSV4_CHAT_PART_CONTENT;
    } else {
        r = dsv4_detok_feed(s->detok, id, &ret_delta->text, &ret_delta->len);
    }
    return r;
}

int dsv4_chat_stream_flush(struct dsv4_chat_stream *s, struct dsv4_chat_delta *ret_delta)
{
    *ret_delta = (struct dsv4_chat_delta){.part = s->part, .finished = s->finished};
    return dsv4_detok_flush(s->detok, &ret_delta->text, &ret_delta->len);
}
