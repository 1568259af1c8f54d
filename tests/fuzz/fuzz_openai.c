/* SPDX-License-Identifier: MIT */
/* libFuzzer target for what the HTTP front (dsv4-openai) parses that it did not write: a request's
 * conversation rendered into prompt parts (openai/render.c), and the model's reply parsed into
 * reasoning, content and DSML tool calls (openai/reply.c). The first byte picks the side and its
 * options.
 *
 * Render (bit 0 clear): the rest is a JSON object {"messages": [...], "tools": [...]}, rendered in
 * chat or thinking mode (bit 1), with the max-effort prompt (bit 2). Accepted: the parts cover the
 * text exactly, in order, and export to the same bytes. Refused: -EINVAL with a message.
 *
 * Reply (bit 0 set): the rest is the model's text (valid UTF-8, as dsv4d's text always is; other
 * inputs are skipped), fed in pieces of 1..16 bytes (bits 4-7) in thinking mode (bit 1) and with
 * tools (bit 2). The events must be the same, piece by piece merged,
 * as for the text fed whole (the parser holds text back only while it could start a marker). Every
 * call begun ends, numbered from 0, and its arguments are one JSON object. */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "openai/pyjson.h"
#include "openai/reply.h"
#include "openai/render.h"

#define MAX_EVENTS 4096

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

struct event {
    enum dsv4_reply_kind kind;
    size_t call;
    size_t off, len;            /* into the log's text */
};

struct log {
    struct event ev[MAX_EVENTS];
    int n;
    char *text;
    size_t len, cap;
};

/* Adjacent text of one kind and call is one event, however the feeding split it. */
static int on_event(const struct dsv4_reply_event *e, void *user)
{
    struct log *l = user;
    const bool text = e->kind == DSV4_REPLY_REASONING || e->kind == DSV4_REPLY_CONTENT || e->kind == DSV4_REPLY_CALL_ARGS;

    if (l->len + e->len > l->cap) {
        size_t cap = 2 * (l->len + e->len) + 64;
        char *p = realloc(l->text, cap);

        if (!p)
            abort();
        l->text = p;
        l->cap = cap;
    }
    if (e->len == 0 && text)
        return 0;
    if (e->len)
        memcpy(l->text + l->len, e->text, e->len);
    if (text && l->n > 0 && l->ev[l->n - 1].kind == e->kind && l->ev[l->n - 1].call == e->call &&
        l->ev[l->n - 1].off + l->ev[l->n - 1].len == l->len) {
        l->ev[l->n - 1].len += e->len;
    } else {
        if (l->n == MAX_EVENTS)
            return -E2BIG;
        l->ev[l->n++] = (struct event){ e->kind, e->call, l->len, e->len };
    }
    l->len += e->len;
    return 0;
}

/* Feed text in pieces of `piece` bytes (0: whole). Returns the parser's result. */
static int parse(const char *text, size_t n, bool thinking, bool tools, size_t piece, struct log *l)
{
    struct dsv4_reply *r;
    int rc = dsv4_reply_new(thinking, tools, on_event, l, &r);

    if (rc < 0)
        return rc;
    for (size_t i = 0; rc == 0 && i < n; i += piece ? piece : n)
        rc = dsv4_reply_feed(r, text + i, piece && n - i > piece ? piece : n - i);
    if (rc == 0)
        rc = dsv4_reply_finish(r);
    dsv4_reply_free(r);
    return rc;
}

static void check_calls(const struct log *l)
{
    size_t next = 0;
    bool open = false;
    char *args = NULL;
    size_t alen = 0;

    for (int i = 0; i < l->n; i++) {
        const struct event *e = &l->ev[i];

        if (e->kind == DSV4_REPLY_CALL_BEGIN) {
            if (open || e->call != next)
                abort();        /* calls do not nest and are numbered in order */
            open = true;
            alen = 0;
        } else if (e->kind == DSV4_REPLY_CALL_ARGS) {
            if (!open || e->call != next)
                abort();
            args = realloc(args, alen + e->len + 1);
            if (!args)
                abort();
            memcpy(args + alen, l->text + e->off, e->len);
            alen += e->len;
        } else if (e->kind == DSV4_REPLY_CALL_END) {
            if (!open || e->call != next)
                abort();
            /* a call's arguments are always one JSON object (its numbers of any size) */
            if (!alen || args[0] != '{' || dsv4_pyjson_check(args, alen) != 0)
                abort();
            open = false;
            next++;
        } else if (open) {
            abort();            /* text inside a call */
        }
    }
    if (open)
        abort();                /* finish closes a call cut short */
    free(args);
}

static void fuzz_reply(uint8_t flags, const char *text, size_t n)
{
    const bool thinking = flags & 2, tools = flags & 4;
    struct log *whole = calloc(1, sizeof(*whole)), *split = calloc(1, sizeof(*split));

    if (!whole || !split)
        abort();
    const int a = parse(text, n, thinking, tools, 0, whole);
    const int b = parse(text, n, thinking, tools, 1 + (flags >> 4), split);
    if (a != b || (a == 0 && (whole->n != split->n || whole->len != split->len ||
                              (whole->len && memcmp(whole->text, split->text, whole->len)))))
        abort();
    for (int i = 0; a == 0 && i < whole->n; i++)
        if (whole->ev[i].kind != split->ev[i].kind || whole->ev[i].call != split->ev[i].call ||
            whole->ev[i].len != split->ev[i].len)
            abort();
    if (a == 0)
        check_calls(whole);
    free(whole->text);
    free(split->text);
    free(whole);
    free(split);
}

static void fuzz_render(uint8_t flags, const char *text, size_t n)
{
    json_error_t jerr;
    json_t *root = json_loadb(text, n, 0, &jerr);
    const json_t *messages = json_object_get(root, "messages"), *tools = json_object_get(root, "tools");
    const struct dsv4_render_opts opts = { .thinking = flags & 2, .effort_max = flags & 4 };
    struct dsv4_parts parts;
    char err[256] = "";

    if (!json_is_array(messages)) {
        json_decref(root);
        return;
    }
    memset(&parts, 0, sizeof(parts));
    int rc = dsv4_render_chat(messages, json_is_array(tools) ? tools : NULL, &opts, &parts, err, sizeof(err));
    if (rc == 0) {
        const char **ptrs;
        size_t *lens, at = 0;

        if (parts.n < 1 || parts.ends[parts.n - 1] != parts.text.len)
            abort();
        for (size_t i = 1; i < parts.n; i++)
            if (parts.ends[i] < parts.ends[i - 1])
                abort();
        if (dsv4_parts_export(&parts, &ptrs, &lens) < 0)
            abort();
        for (size_t i = 0; i < parts.n; i++) {
            if (memcmp(ptrs[i], parts.text.p + at, lens[i]))
                abort();
            at += lens[i];
        }
        if (at != parts.text.len)
            abort();
        free(ptrs);
        free(lens);
    } else if (rc != -ENOMEM && !(rc == -EINVAL && err[0])) {
        abort();
    }
    dsv4_parts_free(&parts);
    json_decref(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (!(data[0] & 1))
        fuzz_render(data[0], (const char *)data + 1, size - 1);
    else if (dsv4_utf8_valid((const char *)data + 1, size - 1))
        fuzz_reply(data[0], (const char *)data + 1, size - 1);
    return 0;
}
