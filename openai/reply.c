/* SPDX-License-Identifier: MIT */
/* Streaming parse of a V4 reply into reasoning, content and DSML tool calls (see reply.h). */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "openai/buf.h"
#include "openai/pyjson.h"
#include "openai/reply.h"

#define DSML "｜DSML｜"

static const char think_end[] = "</think>";
static const char calls_start[] = "<" DSML "tool_calls>";
static const char calls_start_nl[] = "\n\n<" DSML "tool_calls>";
static const char calls_end[] = "</" DSML "tool_calls>";
static const char invoke_open[] = "<" DSML "invoke name=\"";
static const char invoke_close[] = "</" DSML "invoke>";
static const char param_open[] = "<" DSML "parameter name=\"";
static const char param_close[] = "</" DSML "parameter>";

enum state {
    ST_REASONING,
    ST_CONTENT,
    ST_CALLS,      /* between invokes */
    ST_INVOKE,     /* inside an invoke, between parameters */
    ST_AFTER,      /* after the tool-call block: nothing more is the reply */
    ST_PLAIN,      /* a malformed block: everything is content from here */
};

struct dsv4_reply {
    enum state st;
    bool tools;
    dsv4_reply_fn fn;
    void *user;
    struct dsv4_buf hold;      /* text not yet given out */
    size_t calls;              /* calls begun */
    size_t params;             /* parameters of the open call */
    struct dsv4_buf args;      /* scratch for one CALL_ARGS piece */
};

int dsv4_reply_new(bool thinking, bool tools, dsv4_reply_fn fn, void *user, struct dsv4_reply **ret)
{
    struct dsv4_reply *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->st = thinking ? ST_REASONING : ST_CONTENT;
    r->tools = tools;
    r->fn = fn;
    r->user = user;
    *ret = r;
    return 0;
}

void dsv4_reply_free(struct dsv4_reply *r)
{
    if (!r)
        return;
    dsv4_buf_free(&r->hold);
    dsv4_buf_free(&r->args);
    free(r);
}

size_t dsv4_reply_calls(const struct dsv4_reply *r)
{
    return r->calls;
}

static int emit(struct dsv4_reply *r, enum dsv4_reply_kind kind, const char *text, size_t len)
{
    if (len == 0 && (kind == DSV4_REPLY_REASONING || kind == DSV4_REPLY_CONTENT))
        return 0;
    struct dsv4_reply_event ev = {.kind = kind, .call = r->calls ? r->calls - 1 : 0, .text = text, .len = len};
    return r->fn(&ev, r->user);
}

static const char *find(const char *h, size_t hn, const char *needle)
{
    size_t nn = strlen(needle);
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == needle[0] && memcmp(h + i, needle, nn) == 0)
            return h + i;
    return NULL;
}

/* Length of the longest suffix of h that is a proper prefix of needle. */
static size_t partial_suffix(const char *h, size_t hn, const char *needle)
{
    size_t nn = strlen(needle);
    for (size_t k = nn - 1 < hn ? nn - 1 : hn; k > 0; k--)
        if (memcmp(h + hn - k, needle, k) == 0)
            return k;
    return 0;
}

/* h starts with needle (1), could still (0: wait for more), or cannot (-1). */
static int starts(const char *h, size_t hn, const char *needle)
{
    size_t nn = strlen(needle);
    size_t k = hn < nn ? hn : nn;
    if (memcmp(h, needle, k) != 0)
        return -1;
    return hn >= nn ? 1 : 0;
}

static size_t skip_space(const char *h, size_t hn)
{
    size_t i = 0;
    while (i < hn && (h[i] == '\n' || h[i] == ' ' || h[i] == '\t' || h[i] == '\r'))
        i++;
    return i;
}

static int call_args(struct dsv4_reply *r)
{
    int rc = emit(r, DSV4_REPLY_CALL_ARGS, r->args.p ? r->args.p : "", r->args.len);
    r->args.len = 0;
    return rc;
}

/* Close the open call with the parameters that were complete: its arguments end as one JSON object. */
static int close_call(struct dsv4_reply *r)
{
    int rc = dsv4_buf_puts(&r->args, r->params ? "}" : "{}");
    if (rc == 0)
        rc = call_args(r);
    if (rc == 0)
        rc = emit(r, DSV4_REPLY_CALL_END, "", 0);
    return rc;
}

/* One complete parameter element starting at h (after its opening "<｜DSML｜parameter name=\"").
 * The name runs to the first " string="true"> or " string="false">, so that it may hold quotes, as
 * DeepSeek's parser reads it; the value to </｜DSML｜parameter>. Returns the bytes consumed after the
 * opening, 0 to wait, -EBADMSG when malformed. */
static ssize_t parse_param(struct dsv4_reply *r, const char *h, size_t hn)
{
    static const char attr_true[] = "\" string=\"true\">", attr_false[] = "\" string=\"false\">";
    const char *end = find(h, hn, param_close);
    if (!end)
        return 0;
    const char *t = find(h, (size_t)(end - h), attr_true), *f = find(h, (size_t)(end - h), attr_false);
    if (!t && !f)
        return -EBADMSG;
    bool is_str = t && (!f || t < f);
    size_t name_len = (size_t)((is_str ? t : f) - h);
    const char *val = h + name_len + (is_str ? strlen(attr_true) : strlen(attr_false));
    size_t val_len = (size_t)(end - val);
    int rc = dsv4_buf_puts(&r->args, r->params ? ", " : "{");
    if (rc == 0) rc = dsv4_pyjson_string(h, name_len, &r->args);
    if (rc == 0) rc = dsv4_buf_puts(&r->args, ": ");
    if (rc == 0) {
        /* Kept as the model wrote it when it is JSON (numbers of any size and \u0000 included, which a
         * 64-bit JSON library refuses); as a string otherwise. */
        int valid = is_str ? -EBADMSG : dsv4_pyjson_check(val, val_len);
        if (valid == -ENOMEM)
            return -ENOMEM;
        rc = valid == 0 ? dsv4_buf_put(&r->args, val, val_len) : dsv4_pyjson_string(val, val_len, &r->args);
    }
    if (rc)
        return rc;
    r->params++;
    if ((rc = call_args(r)))
        return rc;
    return (ssize_t)(end + strlen(param_close) - h);
}

/* Parse what hold has, emitting events; leaves in hold what needs more text. */
static int run(struct dsv4_reply *r, bool final)
{
    for (;;) {
        const char *h = r->hold.p ? r->hold.p : "";
        size_t hn = r->hold.len, used = 0;
        int rc = 0;
        switch (r->st) {
        case ST_REASONING: {
            const char *at = find(h, hn, think_end);
            if (at) {
                if ((rc = emit(r, DSV4_REPLY_REASONING, h, (size_t)(at - h))))
                    return rc;
                used = (size_t)(at - h) + strlen(think_end);
                r->st = ST_CONTENT;
                break;
            }
            size_t keep = final ? 0 : partial_suffix(h, hn, think_end);
            rc = emit(r, DSV4_REPLY_REASONING, h, hn - keep);
            dsv4_buf_consume(&r->hold, hn - keep);
            return rc;
        }
        case ST_CONTENT:
        case ST_PLAIN: {
            const char *at = r->st == ST_CONTENT && r->tools ? find(h, hn, calls_start) : NULL;
            if (at) {
                size_t clen = (size_t)(at - h);
                /* The block is written after a blank line, which belongs to it. */
                if (clen >= 2 && h[clen - 1] == '\n' && h[clen - 2] == '\n')
                    clen -= 2;
                if ((rc = emit(r, DSV4_REPLY_CONTENT, h, clen)))
                    return rc;
                used = (size_t)(at - h) + strlen(calls_start);
                r->st = ST_CALLS;
                break;
            }
            size_t keep = 0;
            if (!final && r->st == ST_CONTENT && r->tools) {
                size_t k1 = partial_suffix(h, hn, calls_start_nl), k2 = partial_suffix(h, hn, calls_start);
                keep = k1 > k2 ? k1 : k2;
            }
            rc = emit(r, DSV4_REPLY_CONTENT, h, hn - keep);
            dsv4_buf_consume(&r->hold, hn - keep);
            return rc;
        }
        case ST_CALLS: {
            size_t sp = skip_space(h, hn);
            int a = starts(h + sp, hn - sp, calls_end), b = starts(h + sp, hn - sp, invoke_open);
            if (a == 1) {
                used = sp + strlen(calls_end);
                r->st = ST_AFTER;
                break;
            }
            if (b == 1) {
                const char *name = h + sp + strlen(invoke_open);
                const char *q = find(name, hn - (size_t)(name - h), "\">");
                if (!q) {
                    if (final)
                        dsv4_buf_consume(&r->hold, hn);
                    return 0;
                }
                r->calls++;
                r->params = 0;
                if ((rc = emit(r, DSV4_REPLY_CALL_BEGIN, name, (size_t)(q - name))))
                    return rc;
                used = (size_t)(q + 2 - h);
                r->st = ST_INVOKE;
                break;
            }
            if ((a == 0 || b == 0 || sp == hn) && !final)
                return 0;
            if (a == 0 || b == 0 || sp == hn) {
                dsv4_buf_consume(&r->hold, hn);
                return 0;
            }
            r->st = ST_PLAIN;
            break;
        }
        case ST_INVOKE: {
            size_t sp = skip_space(h, hn);
            int a = starts(h + sp, hn - sp, invoke_close), b = starts(h + sp, hn - sp, param_open);
            if (a == 1) {
                if ((rc = close_call(r)))
                    return rc;
                used = sp + strlen(invoke_close);
                r->st = ST_CALLS;
                break;
            }
            if (b == 1) {
                const char *p = h + sp + strlen(param_open);
                ssize_t n = parse_param(r, p, hn - (size_t)(p - h));
                if (n == -EBADMSG) {
                    /* not the format: the call begun is closed, the rest is content */
                    if ((rc = close_call(r)))
                        return rc;
                    r->st = ST_PLAIN;
                    break;
                }
                if (n < 0)
                    return (int)n;
                if (n == 0 && !final)
                    return 0;
                if (n == 0) {
                    dsv4_buf_consume(&r->hold, hn);
                    return 0;
                }
                used = (size_t)(p - h) + (size_t)n;
                break;
            }
            if ((a == 0 || b == 0 || sp == hn) && !final)
                return 0;
            if (a == 0 || b == 0 || sp == hn) {
                dsv4_buf_consume(&r->hold, hn);
                return 0;
            }
            if ((rc = close_call(r)))
                return rc;
            r->st = ST_PLAIN;
            break;
        }
        case ST_AFTER:
            dsv4_buf_consume(&r->hold, hn);
            return 0;
        }
        dsv4_buf_consume(&r->hold, used);
    }
}

int dsv4_reply_feed(struct dsv4_reply *r, const char *text, size_t len)
{
    if (r->st == ST_AFTER)
        return 0;
    int rc = dsv4_buf_put(&r->hold, text, len);
    return rc ? rc : run(r, false);
}

int dsv4_reply_finish(struct dsv4_reply *r)
{
    int rc = run(r, true);
    if (rc == 0 && r->st == ST_INVOKE) {
        rc = close_call(r);     /* cut short inside a call */
        r->st = ST_AFTER;
    }
    return rc;
}
