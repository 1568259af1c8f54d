/* SPDX-License-Identifier: MIT */
/* DeepSeek-V4 chat encoding of an OpenAI conversation (see render.h for the rules). */
#include "build-config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai/pyjson.h"
#include "openai/render.h"

#define BOS "<｜begin▁of▁sentence｜>"
#define EOS "<｜end▁of▁sentence｜>"
#define USER_TAG "<｜User｜>"
#define ASSISTANT_TAG "<｜Assistant｜>"
#define THINK_START "<think>"
#define THINK_END "</think>"
#define DSML "｜DSML｜"

/* DeepSeek's text, word for word: the model was trained on it. */
static const char effort_max_prompt[] =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

static const char tools_head[] =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<" DSML "tool_calls>\" block like the following:\n\n"
    "<" DSML "tool_calls>\n"
    "<" DSML "invoke name=\"$TOOL_NAME\">\n"
    "<" DSML "parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" DSML "parameter>\n"
    "...\n"
    "</" DSML "invoke>\n"
    "<" DSML "invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</" DSML "invoke>\n"
    "</" DSML "tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by " THINK_START "), you MUST output your complete reasoning inside "
    THINK_START "..." THINK_END " BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after " THINK_END " with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
static const char tools_tail[] =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

/* ---- parts ---------------------------------------------------------------------------------------- */

void dsv4_parts_free(struct dsv4_parts *p)
{
    if (!p)
        return;
    dsv4_buf_free(&p->text);
    free(p->ends);
    memset(p, 0, sizeof(*p));
}

static int parts_push(struct dsv4_parts *p)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 16;
        size_t *e = realloc(p->ends, cap * sizeof(*e));
        if (!e)
            return -ENOMEM;
        p->ends = e;
        p->cap = cap;
    }
    p->ends[p->n++] = p->text.len;
    return 0;
}

/* Append to the template (literal false) or literal (true) text, starting a new part on a change. */
static int parts_add(struct dsv4_parts *p, bool literal, const char *s, size_t n)
{
    int r;
    if (!n)
        return 0;
    if (p->n == 0 && literal && (r = parts_push(p)) < 0)   /* an empty template part first */
        return r;
    if ((p->n == 0 || ((p->n - 1) % 2 == 1) != literal) && (r = parts_push(p)) < 0)
        return r;
    if ((r = dsv4_buf_put(&p->text, s, n)) < 0)
        return r;
    p->ends[p->n - 1] = p->text.len;
    return 0;
}

int dsv4_parts_export(const struct dsv4_parts *p, const char ***ret_ptrs, size_t **ret_lens)
{
    const char **ptrs = malloc((p->n ? p->n : 1) * sizeof(*ptrs));
    size_t *lens = malloc((p->n ? p->n : 1) * sizeof(*lens));
    if (!ptrs || !lens) {
        free(ptrs);
        free(lens);
        return -ENOMEM;
    }
    for (size_t i = 0; i < p->n; i++) {
        size_t start = i ? p->ends[i - 1] : 0;
        ptrs[i] = p->text.p + start;
        lens[i] = p->ends[i] - start;
    }
    *ret_ptrs = ptrs;
    *ret_lens = lens;
    return 0;
}

/* ---- messages ------------------------------------------------------------------------------------- */

enum role { ROLE_SYSTEM, ROLE_DEVELOPER, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL };

static const char *const role_names[] = {"system", "developer", "user", "assistant", "tool"};

struct block {
    bool tool_result;
    const char *text;
    size_t len;
    const char *call_id;      /* tool_result: the tool_call_id ("" when none) */
};

struct msg {
    enum role role;
    const char *content;      /* NULL for null or absent content */
    size_t content_len;
    const char *reasoning;    /* assistant: reasoning_content; NULL when none */
    size_t reasoning_len;
    const json_t *tool_calls; /* assistant: the calls (validated), NULL when none */
    const json_t *tools;      /* the system message made of the request's tools */
    struct block *blocks;     /* user turns (after merging tool results): what they are made of */
    size_t n_blocks;
};

struct render {
    const struct dsv4_render_opts *opts;
    struct dsv4_parts *out;
    char *err;
    size_t err_len;
    struct msg *msgs;
    size_t n;
    struct dsv4_buf *owned;   /* flattened contents */
    size_t n_owned;
};

static int fail(struct render *R, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(struct render *R, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(R->err, R->err_len, fmt, ap);
    va_end(ap);
    return -EINVAL;
}

/* Content as text: a string as it is, an array of text parts joined by `sep`, null as NULL. */
static int flatten(struct render *R, size_t index, const json_t *content, const char *sep, const char **ret,
                   size_t *ret_len)
{
    *ret = NULL;
    *ret_len = 0;
    if (!content || json_is_null(content))
        return 0;
    if (json_is_string(content)) {
        *ret = json_string_value(content);
        *ret_len = json_string_length(content);
        return 0;
    }
    if (!json_is_array(content))
        return fail(R, "messages[%zu].content must be a string, null or an array of text parts", index);
    struct dsv4_buf *b = &R->owned[R->n_owned++];
    size_t i;
    const json_t *part;
    json_array_foreach(content, i, part) {
        const json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0 || !json_is_string(text))
            return fail(R, "messages[%zu].content[%zu]: only {\"type\": \"text\", \"text\": \"...\"} parts are "
                        "supported", index, i);
        if ((i && dsv4_buf_puts(b, sep) < 0) || dsv4_buf_put(b, json_string_value(text), json_string_length(text)) < 0)
            return -ENOMEM;
    }
    *ret = b->p ? b->p : "";
    *ret_len = b->len;
    return 0;
}

static int check_tool_calls(struct render *R, size_t index, const json_t *calls)
{
    size_t i;
    const json_t *tc;
    if (!json_is_array(calls))
        return fail(R, "messages[%zu].tool_calls must be an array", index);
    json_array_foreach(calls, i, tc) {
        const json_t *fn = json_object_get(tc, "function");
        const json_t *id = json_object_get(tc, "id");
        if (!json_is_object(tc) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return fail(R, "messages[%zu].tool_calls[%zu] must be {\"type\": \"function\", \"function\": "
                        "{\"name\": ..., \"arguments\": ...}}", index, i);
        if (id && !json_is_string(id) && !json_is_null(id))
            return fail(R, "messages[%zu].tool_calls[%zu].id must be a string", index, i);
        /* DeepSeek's encoder raises on a call without arguments (a KeyError). */
        if (!json_object_get(fn, "arguments"))
            return fail(R, "messages[%zu].tool_calls[%zu].function.arguments is missing", index, i);
    }
    return 0;
}

/* One request message into R->msgs, merging tool results and user text into user turns as DeepSeek's
 * merge_tool_messages does. */
static int add_message(struct render *R, size_t index, const json_t *m)
{
    const json_t *role = json_object_get(m, "role");
    int rc;
    if (!json_is_object(m))
        return fail(R, "messages[%zu] must be an object", index);
    if (!json_is_string(role))
        return fail(R, "messages[%zu].role must be a string", index);
    size_t k;
    for (k = 0; k < sizeof(role_names) / sizeof(role_names[0]); k++)
        if (strcmp(json_string_value(role), role_names[k]) == 0)
            break;
    if (k == sizeof(role_names) / sizeof(role_names[0]))
        return fail(R, "messages[%zu].role: '%s' is not system, developer, user, assistant or tool", index,
                    json_string_value(role));
    struct msg cur = {.role = (enum role)k};
    rc = flatten(R, index, json_object_get(m, "content"), cur.role == ROLE_TOOL ? "\n\n" : "\n", &cur.content,
                 &cur.content_len);
    if (rc)
        return rc;

    if (cur.role == ROLE_TOOL || cur.role == ROLE_USER) {
        struct block blk = {.tool_result = cur.role == ROLE_TOOL, .text = cur.content ? cur.content : "",
                            .len = cur.content_len, .call_id = ""};
        if (cur.role == ROLE_TOOL) {
            const json_t *id = json_object_get(m, "tool_call_id");
            if (id && !json_is_string(id))
                return fail(R, "messages[%zu].tool_call_id must be a string", index);
            if (id)
                blk.call_id = json_string_value(id);
            /* DeepSeek's encoder puts a result in its block with str.format, which writes null (None)
             * as "None"; an absent content is "". */
            if (json_is_null(json_object_get(m, "content"))) {
                blk.text = "None";
                blk.len = strlen("None");
            }
        }
        struct msg *last = R->n ? &R->msgs[R->n - 1] : NULL;
        if (!last || last->role != ROLE_USER) {
            last = &R->msgs[R->n++];
            *last = (struct msg){.role = ROLE_USER};
        }
        struct block *b = realloc(last->blocks, (last->n_blocks + 1) * sizeof(*b));
        if (!b)
            return -ENOMEM;
        last->blocks = b;
        b[last->n_blocks++] = blk;
        return 0;
    }
    if (cur.role == ROLE_DEVELOPER && !cur.content_len)
        return fail(R, "messages[%zu]: a developer message needs content", index);
    if (cur.role == ROLE_ASSISTANT) {
        const json_t *rc_json = json_object_get(m, "reasoning_content");
        const json_t *calls = json_object_get(m, "tool_calls");
        if (rc_json && !json_is_string(rc_json) && !json_is_null(rc_json))
            return fail(R, "messages[%zu].reasoning_content must be a string", index);
        if (json_is_string(rc_json)) {
            cur.reasoning = json_string_value(rc_json);
            cur.reasoning_len = json_string_length(rc_json);
        }
        if (calls && !json_is_null(calls)) {
            if ((rc = check_tool_calls(R, index, calls)))
                return rc;
            if (json_array_size(calls))
                cur.tool_calls = calls;
        }
    }
    R->msgs[R->n++] = cur;
    return 0;
}

/* Tool results of a user turn in the order of the calls of the last assistant turn that made calls
 * (stable; an unknown id counts as the first call, a repeated one as its last), as DeepSeek's
 * sort_tool_results_by_call_order. */
static int sort_tool_results(struct render *R)
{
    const json_t *order = NULL;
    for (size_t i = 0; i < R->n; i++) {
        struct msg *m = &R->msgs[i];
        if (m->role == ROLE_ASSISTANT && m->tool_calls) {
            order = m->tool_calls;
            continue;
        }
        if (m->role != ROLE_USER || !order)
            continue;
        /* The tool blocks with the position of their call, insertion-sorted (stable) and put back
         * into the positions tool blocks held. */
        size_t n_tool = 0;
        for (size_t b = 0; b < m->n_blocks; b++)
            n_tool += m->blocks[b].tool_result;
        if (n_tool < 2)
            continue;
        struct keyed { size_t key; struct block blk; } *t = malloc(n_tool * sizeof(*t));
        if (!t)
            return -ENOMEM;
        size_t k = 0;
        for (size_t b = 0; b < m->n_blocks; b++) {
            if (!m->blocks[b].tool_result)
                continue;
            t[k] = (struct keyed){.key = 0, .blk = m->blocks[b]};
            size_t c;
            const json_t *tc;
            json_array_foreach(order, c, tc) {
                const json_t *id = json_object_get(tc, "id");
                /* no break: an id given to several calls counts as its last, as in DeepSeek's dict */
                if (json_is_string(id) && json_string_length(id) && strcmp(json_string_value(id), t[k].blk.call_id) == 0)
                    t[k].key = c;
            }
            for (size_t u = k; u > 0 && t[u - 1].key > t[u].key; u--) {
                struct keyed tmp = t[u];
                t[u] = t[u - 1];
                t[u - 1] = tmp;
            }
            k++;
        }
        k = 0;
        for (size_t b = 0; b < m->n_blocks; b++)
            if (m->blocks[b].tool_result)
                m->blocks[b] = t[k++].blk;
        free(t);
    }
    return 0;
}

static size_t last_user_index(const struct render *R)
{
    for (size_t i = R->n; i > 0; i--)
        if (R->msgs[i - 1].role == ROLE_USER || R->msgs[i - 1].role == ROLE_DEVELOPER)
            return i - 1;
    return (size_t)-1;
}

/* Thinking mode without tools: turns before the last user message lose their reasoning, developer
 * messages before it go (DeepSeek's _drop_thinking_messages). */
static void drop_thinking(struct render *R)
{
    size_t last = last_user_index(R), w = 0;
    for (size_t i = 0; i < R->n; i++) {
        struct msg m = R->msgs[i];
        if (last != (size_t)-1 && i < last && m.role == ROLE_DEVELOPER) {
            free(m.blocks);
            continue;
        }
        if (last != (size_t)-1 && i < last && m.role == ROLE_ASSISTANT)
            m.reasoning = NULL;
        R->msgs[w++] = m;
    }
    R->n = w;
}

/* ---- rendering ------------------------------------------------------------------------------------ */

#define T(s) parts_add(R->out, false, (s), strlen(s))
#define L(s, n) parts_add(R->out, true, (s), (n))

static int literal_json(struct render *R, const json_t *v)
{
    struct dsv4_buf b = {0};
    int r = dsv4_pyjson_dump(v, &b);
    if (r == 0)
        r = L(b.p, b.len);
    dsv4_buf_free(&b);
    return r;
}

static int render_tools(struct render *R, const json_t *tools)
{
    size_t i;
    const json_t *tool;
    int r = T(tools_head);
    json_array_foreach(tools, i, tool) {
        if (r == 0 && i)
            r = T("\n");
        if (r == 0)
            r = literal_json(R, json_object_get(tool, "function"));
    }
    return r ? r : T(tools_tail);
}

static int render_param(struct render *R, const char *key, size_t key_len, bool is_str, const char *val,
                        size_t val_len)
{
    int r = T("<" DSML "parameter name=\"");
    if (r == 0) r = L(key, key_len);
    if (r == 0) r = T(is_str ? "\" string=\"true\">" : "\" string=\"false\">");
    if (r == 0) r = L(val, val_len);
    return r ? r : T("</" DSML "parameter>");
}

/* One call: its arguments (a JSON object, given as a string or an object) as DSML parameters. A string
 * is read as DeepSeek's encoder reads it, with Python's json.loads (numbers of any size, NaN, NUL, the
 * last of duplicate keys); one it cannot read becomes one parameter named "arguments", and so does any
 * other value (null, a number, an array), written as JSON, as the encoder's json.loads refuses it. */
static int render_call(struct render *R, size_t index, const json_t *tc)
{
    const json_t *fn = json_object_get(tc, "function");
    const json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
    struct dsv4_pyjson_object a = {0};
    struct dsv4_buf dumped = {0};
    const char *text = NULL;
    size_t text_len = 0;
    int r = 0;
    if (json_is_string(args)) {
        text = json_string_value(args);
        text_len = json_string_length(args);
    } else if (json_is_object(args)) {
        r = dsv4_pyjson_dump(args, &dumped);
        text = dumped.p;
        text_len = dumped.len;
    }
    if (r == 0 && text)
        r = dsv4_pyjson_load_object(text, text_len, &a);
    else if (r == 0)
        r = dsv4_pyjson_dump(args, &dumped);
    bool raw = r == -EBADMSG, other = !text;
    if (r == -EINVAL)
        r = fail(R, "messages[%zu].tool_calls: function.arguments must be a JSON object", index);
    if (r < 0 && !raw)
        goto out;
    r = T("<" DSML "invoke name=\"");
    if (r == 0) r = L(json_string_value(name), json_string_length(name));
    if (r == 0) r = T("\">\n");
    if (r == 0 && raw)
        r = render_param(R, "arguments", strlen("arguments"), true, text, text_len);
    if (r == 0 && other)
        r = render_param(R, "arguments", strlen("arguments"), false, dumped.p, dumped.len);
    for (size_t i = 0; i < a.n && r == 0; i++) {
        const struct dsv4_pyjson_member *m = &a.m[i];
        if (i)
            r = T("\n");
        if (r == 0)
            r = render_param(R, a.text.p + m->key, m->key_len, m->is_str, a.text.p + m->val, m->val_len);
    }
    if (r == 0)
        r = T("\n</" DSML "invoke>");
out:
    dsv4_pyjson_object_free(&a);
    dsv4_buf_free(&dumped);
    return r;
}

static int render_message(struct render *R, size_t i, bool drop, size_t last_user)
{
    const struct msg *m = &R->msgs[i];
    bool thinking = R->opts->thinking;
    int r = 0;

    if (i == 0 && thinking && R->opts->effort_max)
        r = T(effort_max_prompt);
    switch (m->role) {
    case ROLE_SYSTEM:
        if (r == 0 && m->content) r = L(m->content, m->content_len);
        if (r == 0 && m->tools) {
            r = T("\n\n");
            if (r == 0) r = render_tools(R, m->tools);
        }
        break;
    case ROLE_DEVELOPER:
        if (r == 0) r = T(USER_TAG);
        if (r == 0) r = L(m->content, m->content_len);
        break;
    case ROLE_USER:
        if (r == 0) r = T(USER_TAG);
        for (size_t b = 0; b < m->n_blocks && r == 0; b++) {
            const struct block *blk = &m->blocks[b];
            if (b) r = T("\n\n");
            if (r == 0 && blk->tool_result) r = T("<tool_result>");
            if (r == 0) r = L(blk->text, blk->len);
            if (r == 0 && blk->tool_result) r = T("</tool_result>");
        }
        break;
    case ROLE_ASSISTANT:
        if (r == 0 && thinking && (!drop || last_user == (size_t)-1 || i > last_user)) {
            if (m->reasoning) r = L(m->reasoning, m->reasoning_len);
            if (r == 0) r = T(THINK_END);
        }
        if (r == 0 && m->content) r = L(m->content, m->content_len);
        if (r == 0 && m->tool_calls) {
            size_t c;
            const json_t *tc;
            r = T("\n\n<" DSML "tool_calls>\n");
            json_array_foreach(m->tool_calls, c, tc) {
                if (r == 0 && c) r = T("\n");
                if (r == 0) r = render_call(R, i, tc);
            }
            if (r == 0) r = T("\n</" DSML "tool_calls>");
        }
        if (r == 0) r = T(EOS);
        break;
    case ROLE_TOOL:
        break;   /* merged into user turns before rendering */
    }
    if (r)
        return r;
    /* What the next turn needs: after a user turn that the model answers, the assistant tag and the
     * thinking switch. */
    if (i + 1 < R->n && R->msgs[i + 1].role != ROLE_ASSISTANT)
        return 0;
    if (m->role == ROLE_USER || m->role == ROLE_DEVELOPER) {
        r = T(ASSISTANT_TAG);
        if (r == 0)
            r = T(thinking && (!drop || i >= last_user) ? THINK_START : THINK_END);
    }
    return r;
}

int dsv4_render_chat(const json_t *messages, const json_t *tools, const struct dsv4_render_opts *opts,
                     struct dsv4_parts *out, char *err, size_t err_len)
{
    struct render R = {.opts = opts, .out = out, .err = err, .err_len = err_len};
    size_t n_in = json_array_size(messages);
    bool has_tools = tools && json_array_size(tools) > 0;
    int r = 0;

    if (err_len)
        err[0] = '\0';
    if (!json_is_array(messages) || n_in == 0)
        return fail(&R, "messages must be a non-empty array");
    R.msgs = calloc(n_in + 1, sizeof(*R.msgs));
    R.owned = calloc(n_in, sizeof(*R.owned));
    if (!R.msgs || !R.owned) {
        r = -ENOMEM;
        goto out;
    }
    if (has_tools) {
        size_t i;
        const json_t *tool;
        json_array_foreach(tools, i, tool) {
            const json_t *fn = json_object_get(tool, "function"), *type = json_object_get(tool, "type");
            if (!json_is_object(tool) || !json_is_object(fn) || !json_is_string(json_object_get(fn, "name")) ||
                (type && (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0))) {
                r = fail(&R, "tools[%zu] must be {\"type\": \"function\", \"function\": {\"name\": ...}}", i);
                goto out;
            }
        }
    }
    /* The tools section follows the text of a first system message (DeepSeek's example conversation
     * with tools); without one it is a system message of its own ahead of the conversation. */
    const json_t *role0 = json_object_get(json_array_get(messages, 0), "role");
    bool lead_system = json_is_string(role0) && strcmp(json_string_value(role0), "system") == 0;
    if (has_tools && !lead_system)
        R.msgs[R.n++] = (struct msg){.role = ROLE_SYSTEM, .tools = tools};
    for (size_t i = 0; i < n_in && r == 0; i++)
        r = add_message(&R, i, json_array_get(messages, i));
    if (r)
        goto out;
    if (has_tools && lead_system)
        R.msgs[0].tools = tools;
    if ((r = sort_tool_results(&R)))
        goto out;
    bool drop = !has_tools;
    if (opts->thinking && drop)
        drop_thinking(&R);
    size_t last_user = last_user_index(&R);
    r = parts_add(out, false, BOS, strlen(BOS));
    for (size_t i = 0; i < R.n && r == 0; i++)
        r = render_message(&R, i, drop, last_user);
out:
    for (size_t i = 0; R.msgs && i < R.n; i++)
        free(R.msgs[i].blocks);
    for (size_t i = 0; R.owned && i < R.n_owned; i++)
        dsv4_buf_free(&R.owned[i]);
    free(R.msgs);
    free(R.owned);
    if (r == -ENOMEM && err_len)
        snprintf(err, err_len, "out of memory rendering the conversation");
    return r;
}
