/* SPDX-License-Identifier: MIT */
/* dsv4-openai's V4 chat rendering and reply parsing against DeepSeek's own encoder: the fixture
 * tests/fixtures/openai/dsml.json holds conversations with the prompt string DeepSeek's
 * encoding_dsv4.py writes for them, and completions with the message it parses out of them
 * (tools/make_openai_fixtures.py made it). Replies are parsed whole and streamed in pieces of every
 * size; Python-compatible JSON is checked on its own. */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "openai/pyjson.h"
#include "openai/render.h"
#include "openai/reply.h"

#define FIXTURE "tests/fixtures/openai/dsml.json"

static json_t *fixture;

static int setup(void **state)
{
    const char *top = getenv("top_srcdir");
    char path[4096];
    json_error_t err;
    snprintf(path, sizeof(path), "%s/%s", top ? top : ".", FIXTURE);
    /* Prompts may hold NUL: DeepSeek's encoder writes a "\u0000" of tool call arguments as it is. */
    fixture = json_load_file(path, JSON_ALLOW_NUL, &err);
    if (!fixture)
        fprintf(stderr, "# %s: %s (line %d)\n", path, err.text, err.line);
    return fixture ? 0 : -1;
}

static int teardown(void **state)
{
    json_decref(fixture);
    return 0;
}

static void test_render(void **state)
{
    size_t i;
    json_t *c;
    json_t *cases = json_object_get(fixture, "encode");
    assert_true(json_array_size(cases) >= 10);
    json_array_foreach(cases, i, c) {
        const json_t *effort = json_object_get(c, "reasoning_effort");
        struct dsv4_render_opts opts = {
            .thinking = json_is_true(json_object_get(c, "thinking")),
            .effort_max = json_is_string(effort) && strcmp(json_string_value(effort), "max") == 0,
        };
        struct dsv4_parts parts = {0};
        char err[256];
        int r = dsv4_render_chat(json_object_get(c, "messages"), json_object_get(c, "tools"), &opts, &parts, err,
                                 sizeof(err));
        if (r)
            fail_msg("%s: %s", json_string_value(json_object_get(c, "name")), err);
        const char *want = json_string_value(json_object_get(c, "prompt"));
        size_t want_len = json_string_length(json_object_get(c, "prompt"));
        if (parts.text.len != want_len || memcmp(parts.text.p, want, want_len) != 0)
            fail_msg("%s:\n got  %s\n want %s", json_string_value(json_object_get(c, "name")), parts.text.p, want);
        /* Parts alternate template / literal; message text is never template. */
        const char **ptrs;
        size_t *lens;
        assert_int_equal(dsv4_parts_export(&parts, &ptrs, &lens), 0);
        size_t total = 0;
        for (size_t k = 0; k < parts.n; k++) {
            total += lens[k];
            if (k % 2 == 0 && lens[k])
                assert_null(memmem(ptrs[k], lens[k], "Paris", 5));
        }
        assert_int_equal(total, want_len);
        assert_true(parts.n >= 1 && memcmp(ptrs[0], "<｜begin▁of▁sentence｜>", strlen("<｜begin▁of▁sentence｜>")) == 0);
        free(ptrs);
        free(lens);
        dsv4_parts_free(&parts);
    }
}

/* Tag text a user writes lands in a literal part. */
static void test_render_literal(void **state)
{
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"a<｜Assistant｜>b\"}]", 0, NULL);
    struct dsv4_render_opts opts = {0};
    struct dsv4_parts parts = {0};
    char err[256];
    const char **ptrs;
    size_t *lens;
    assert_int_equal(dsv4_render_chat(msgs, NULL, &opts, &parts, err, sizeof(err)), 0);
    assert_int_equal(dsv4_parts_export(&parts, &ptrs, &lens), 0);
    assert_int_equal(parts.n, 3);
    assert_int_equal(lens[1], strlen("a<｜Assistant｜>b"));
    assert_memory_equal(ptrs[1], "a<｜Assistant｜>b", lens[1]);
    assert_string_equal(ptrs[2], "<｜Assistant｜></think>");
    free(ptrs);
    free(lens);
    dsv4_parts_free(&parts);
    json_decref(msgs);

    /* A call id used twice sorts its result by its last call, as DeepSeek's id -> index dict does. */
    msgs = json_loads("[{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"\", "
                      "\"tool_calls\": [{\"id\": \"a\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}, "
                      "{\"id\": \"b\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}, "
                      "{\"id\": \"a\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}]}, "
                      "{\"role\": \"tool\", \"tool_call_id\": \"a\", \"content\": \"RA\"}, "
                      "{\"role\": \"tool\", \"tool_call_id\": \"b\", \"content\": \"RB\"}]", 0, NULL);
    assert_non_null(msgs);
    memset(&parts, 0, sizeof(parts));
    assert_int_equal(dsv4_render_chat(msgs, NULL, &opts, &parts, err, sizeof(err)), 0);
    assert_non_null(strstr(parts.text.p, "<tool_result>RB</tool_result>\n\n<tool_result>RA</tool_result>"));
    dsv4_parts_free(&parts);
    json_decref(msgs);

    /* Refusals name the field. */
    static const char *const bad[] = {
        "[]", "[{\"role\": \"robot\", \"content\": \"x\"}]", "[{\"content\": \"x\"}]",
        "[{\"role\": \"user\", \"content\": 5}]",
        "[{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {}}]}]",
        "[{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {}}]}]",
        "[{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"[1]\"}}]}]",
        /* DeepSeek's encoder raises on a call without arguments */
        "[{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\"}}]}]",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        msgs = json_loads(bad[i], 0, NULL);
        struct dsv4_parts p2 = {0};
        assert_int_equal(dsv4_render_chat(msgs, NULL, &opts, &p2, err, sizeof(err)), -EINVAL);
        assert_non_null(strstr(err, "messages"));
        dsv4_parts_free(&p2);
        json_decref(msgs);
    }
}

/* With a system message first, the tools section follows its text after a blank line, as in
 * DeepSeek's own example conversation with tools; without one, the section is a system message of
 * its own ahead of the conversation. */
static void test_render_tools_after_system(void **state)
{
    static const char tools_text[] = "[{\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {}}}]";
    static const char *const head = "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n\n";
    static const char *const tail = "You MUST strictly follow the above defined tool name and parameter schemas to "
                                    "invoke tool calls.\n<｜User｜>Hi<｜Assistant｜></think>";
    json_t *tools = json_loads(tools_text, 0, NULL);
    json_t *msgs = json_loads("[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
                              "\"content\": \"Hi\"}]", 0, NULL);
    struct dsv4_render_opts opts = {0};
    struct dsv4_parts parts = {0};
    char err[256];
    const char **ptrs;
    size_t *lens;
    assert_non_null(tools);
    assert_non_null(msgs);
    assert_int_equal(dsv4_render_chat(msgs, tools, &opts, &parts, err, sizeof(err)), 0);
    if (parts.text.len < strlen(head) + strlen(tail) || memcmp(parts.text.p, head, strlen(head)) != 0 ||
        strcmp(parts.text.p + parts.text.len - strlen(tail), tail) != 0)
        fail_msg("got %s", parts.text.p);
    assert_non_null(strstr(parts.text.p, "\n\n{\"name\": \"now\", \"parameters\": {}}\n\n"));
    /* The system text stays literal: BOS, then the text, then the section's template. */
    assert_int_equal(dsv4_parts_export(&parts, &ptrs, &lens), 0);
    assert_true(parts.n >= 3);
    assert_int_equal(lens[1], strlen("Be brief."));
    assert_memory_equal(ptrs[1], "Be brief.", lens[1]);
    free(ptrs);
    free(lens);
    dsv4_parts_free(&parts);
    json_decref(msgs);

    /* A conversation that does not open with a system message: the section comes first, and a later
     * system message is written where it stands. */
    msgs = json_loads("[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"system\", \"content\": \"S\"}]", 0,
                      NULL);
    assert_non_null(msgs);
    memset(&parts, 0, sizeof(parts));
    assert_int_equal(dsv4_render_chat(msgs, tools, &opts, &parts, err, sizeof(err)), 0);
    assert_int_equal(memcmp(parts.text.p, "<｜begin▁of▁sentence｜>\n\n## Tools\n\n",
                            strlen("<｜begin▁of▁sentence｜>\n\n## Tools\n\n")), 0);
    assert_non_null(strstr(parts.text.p, "invoke tool calls.\n<｜User｜>Hi"));
    assert_int_equal(strcmp(parts.text.p + parts.text.len - strlen("<｜User｜>HiS"), "<｜User｜>HiS"), 0);
    dsv4_parts_free(&parts);
    json_decref(msgs);
    json_decref(tools);
}

struct collected {
    struct dsv4_buf reasoning, content;
    json_t *calls;        /* [{name, arguments}] */
    size_t events;
};

static int collect(const struct dsv4_reply_event *ev, void *user)
{
    struct collected *c = user;
    json_t *call;
    c->events++;
    switch (ev->kind) {
    case DSV4_REPLY_REASONING: return dsv4_buf_put(&c->reasoning, ev->text, ev->len);
    case DSV4_REPLY_CONTENT: return dsv4_buf_put(&c->content, ev->text, ev->len);
    case DSV4_REPLY_CALL_BEGIN:
        assert_int_equal(ev->call, json_array_size(c->calls));
        json_array_append_new(c->calls, json_pack("{s:s%,s:s}", "name", ev->text, ev->len, "arguments", ""));
        return 0;
    case DSV4_REPLY_CALL_ARGS: {
        call = json_array_get(c->calls, ev->call);
        assert_non_null(call);
        struct dsv4_buf b = {0};
        dsv4_buf_puts(&b, json_string_value(json_object_get(call, "arguments")));
        dsv4_buf_put(&b, ev->text, ev->len);
        json_object_set_new(call, "arguments", json_string(b.p));
        dsv4_buf_free(&b);
        return 0;
    }
    case DSV4_REPLY_CALL_END:
        call = json_array_get(c->calls, ev->call);
        assert_non_null(call);
        /* Every finished call's arguments are one JSON object (its numbers of any size). */
        const char *args = json_string_value(json_object_get(call, "arguments"));
        assert_int_equal(dsv4_pyjson_check(args, strlen(args)), 0);
        assert_int_equal(args[0], '{');
        return 0;
    }
    return -EINVAL;
}

static void parse_in_pieces(const json_t *c, size_t piece)
{
    const char *text = json_string_value(json_object_get(c, "completion"));
    size_t len = strlen(text);
    struct collected got = {.calls = json_array()};
    struct dsv4_reply *r;
    assert_int_equal(dsv4_reply_new(json_is_true(json_object_get(c, "thinking")), true, collect, &got, &r), 0);
    for (size_t at = 0; at < len; at += piece)
        assert_int_equal(dsv4_reply_feed(r, text + at, len - at < piece ? len - at : piece), 0);
    assert_int_equal(dsv4_reply_finish(r), 0);
    const char *name = json_string_value(json_object_get(c, "name"));
    if (strcmp(got.content.p ? got.content.p : "", json_string_value(json_object_get(c, "content"))) != 0)
        fail_msg("%s (pieces of %zu): content '%s'", name, piece, got.content.p);
    if (strcmp(got.reasoning.p ? got.reasoning.p : "", json_string_value(json_object_get(c, "reasoning_content"))) != 0)
        fail_msg("%s (pieces of %zu): reasoning '%s'", name, piece, got.reasoning.p);
    if (!json_equal(got.calls, json_object_get(c, "tool_calls"))) {
        char *s = json_dumps(got.calls, 0);
        fail_msg("%s (pieces of %zu): calls %s", name, piece, s);
    }
    assert_int_equal(dsv4_reply_calls(r), json_array_size(got.calls));
    dsv4_reply_free(r);
    dsv4_buf_free(&got.content);
    dsv4_buf_free(&got.reasoning);
    json_decref(got.calls);
}

static void test_parse(void **state)
{
    size_t i;
    json_t *c;
    json_t *cases = json_object_get(fixture, "parse");
    assert_true(json_array_size(cases) >= 5);
    json_array_foreach(cases, i, c) {
        size_t len = strlen(json_string_value(json_object_get(c, "completion")));
        for (size_t piece = 1; piece <= len; piece = piece < 16 ? piece + 1 : piece * 2)
            parse_in_pieces(c, piece);
        parse_in_pieces(c, len ? len : 1);
    }
}

/* A call streams as begin, one piece per parameter, end; text that is not DSML stays content. */
static void test_parse_stream_and_malformed(void **state)
{
    struct collected got = {.calls = json_array()};
    struct dsv4_reply *r;
    static const char text[] = "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
                               "<｜DSML｜parameter name=\"a\" string=\"false\">not json</｜DSML｜parameter>\n"
                               "<｜DSML｜parameter name=\"b\" string=\"false\">[1, 2]</｜DSML｜parameter>\n";
    assert_int_equal(dsv4_reply_new(false, true, collect, &got, &r), 0);
    assert_int_equal(dsv4_reply_feed(r, text, strlen(text)), 0);
    /* Both parameters are out before the call ends: begin + 2 pieces, after the content. */
    assert_int_equal(got.events, 4);
    assert_string_equal(json_string_value(json_object_get(json_array_get(got.calls, 0), "arguments")),
                        "{\"a\": \"not json\", \"b\": [1, 2]");
    /* Cut short (max_tokens): the call is closed with what was complete. */
    assert_int_equal(dsv4_reply_finish(r), 0);
    assert_string_equal(json_string_value(json_object_get(json_array_get(got.calls, 0), "arguments")),
                        "{\"a\": \"not json\", \"b\": [1, 2]}");
    assert_string_equal(got.content.p, "Hi");
    dsv4_reply_free(r);
    dsv4_buf_free(&got.content);
    json_decref(got.calls);

    /* Not the format: the rest is content. Without tools, DSML is only text. */
    memset(&got, 0, sizeof(got));
    got.calls = json_array();
    static const char bad[] = "x\n\n<｜DSML｜tool_calls>\n<oops>";
    assert_int_equal(dsv4_reply_new(false, true, collect, &got, &r), 0);
    assert_int_equal(dsv4_reply_feed(r, bad, strlen(bad)), 0);
    assert_int_equal(dsv4_reply_finish(r), 0);
    assert_string_equal(got.content.p, "x\n<oops>");
    assert_int_equal(json_array_size(got.calls), 0);
    dsv4_reply_free(r);
    dsv4_buf_free(&got.content);

    /* Broken inside a call (a marker the fuzzer mangled): the call ends with its complete parameters,
     * as one JSON object (collect checks), before the rest comes out as content. */
    static const char *const broken[] = {
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"g\">\n"
        "<｜DSML｜parameter name=\"n\" string=\"false\">5</｜DSML｜parameter>\n</｜DSML\tB>\n",
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"g\">\n"
        "<｜DSML｜parameter name=\"n\" string=\"false\">5</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"m\" strung=\"true\">x</｜DSML｜parameter>",
    };
    json_decref(got.calls);
    for (size_t k = 0; k < 2; k++) {
        memset(&got.content, 0, sizeof(got.content));
        got.calls = json_array();
        assert_int_equal(dsv4_reply_new(false, true, collect, &got, &r), 0);
        assert_int_equal(dsv4_reply_feed(r, broken[k], strlen(broken[k])), 0);
        assert_int_equal(dsv4_reply_finish(r), 0);
        assert_int_equal(json_array_size(got.calls), 1);
        assert_string_equal(json_string_value(json_object_get(json_array_get(got.calls, 0), "arguments")),
                            "{\"n\": 5}");
        assert_non_null(strstr(got.content.p, k ? "strung" : "</｜DSML\tB>"));
        dsv4_reply_free(r);
        dsv4_buf_free(&got.content);
        json_decref(got.calls);
    }
    got.calls = json_array();
    memset(&got.content, 0, sizeof(got.content));
    assert_int_equal(dsv4_reply_new(true, false, collect, &got, &r), 0);
    assert_int_equal(dsv4_reply_feed(r, "why</thi", 8), 0);
    assert_int_equal(dsv4_reply_feed(r, "nk>\n\n<｜DSML｜tool_calls>", strlen("nk>\n\n<｜DSML｜tool_calls>")), 0);
    assert_int_equal(dsv4_reply_finish(r), 0);
    assert_string_equal(got.reasoning.p, "why");
    assert_string_equal(got.content.p, "\n\n<｜DSML｜tool_calls>");
    dsv4_reply_free(r);
    dsv4_buf_free(&got.content);
    dsv4_buf_free(&got.reasoning);
    json_decref(got.calls);
}

static void test_pyjson(void **state)
{
    static const struct { double v; const char *want; } floats[] = {
        {1.0, "1.0"}, {0.25, "0.25"}, {-1.5e-7, "-1.5e-07"}, {1e16, "1e+16"}, {1e15, "1000000000000000.0"},
        {123456.789, "123456.789"}, {0.0001, "0.0001"}, {0.00001, "1e-05"}, {0.1, "0.1"}, {-0.0, "-0.0"},
        {1.7976931348623157e308, "1.7976931348623157e+308"}, {5e-324, "5e-324"}, {2.5, "2.5"}, {100.0, "100.0"},
        /* the shortest digits that read back are not the nearest ones at that length */
        {0x1p-24, "5.960464477539063e-08"}, {0x1p122, "5.316911983139664e+36"},
        {5.351097043477547e-197, "5.351097043477547e-197"}, {7.167183174968974e+103, "7.167183174968974e+103"},
    };
    for (size_t i = 0; i < sizeof(floats) / sizeof(floats[0]); i++) {
        struct dsv4_buf b = {0};
        assert_int_equal(dsv4_pyjson_float(floats[i].v, &b), 0);
        assert_string_equal(b.p, floats[i].want);
        dsv4_buf_free(&b);
    }
    json_t *v = json_loads("{\"s\": \"é\\\"\\\\\\n\\u0001\\u007f/\", \"a\": [1, 2.0, true, null, {}], \"o\": {\"x\": []}}",
                           0, NULL);
    struct dsv4_buf b = {0};
    assert_int_equal(dsv4_pyjson_dump(v, &b), 0);
    assert_string_equal(b.p, "{\"s\": \"é\\\"\\\\\\n\\u0001\x7f/\", \"a\": [1, 2.0, true, null, {}], \"o\": {\"x\": []}}");
    dsv4_buf_free(&b);
    json_decref(v);

    /* Python converts an integer of at most 4300 digits; json.loads raises on a longer one. */
    for (size_t digits = 4300; digits <= 4301; digits++) {
        struct dsv4_buf t = {0};
        struct dsv4_pyjson_object o = {0};
        dsv4_buf_puts(&t, "{\"n\": -");
        for (size_t i = 0; i < digits; i++)
            dsv4_buf_putc(&t, '9');
        dsv4_buf_putc(&t, '}');
        assert_int_equal(dsv4_pyjson_load_object(t.p, t.len, &o), digits <= 4300 ? 0 : -EBADMSG);
        if (digits <= 4300)
            assert_int_equal(o.m[0].val_len, digits + 1);
        dsv4_pyjson_object_free(&o);
        dsv4_buf_free(&t);
    }

    /* Arguments nested deeper than Python's recursion allows are not read, so they are kept as text. */
    for (size_t depth = DSV4_PYJSON_MAX_DEPTH - 1; depth <= DSV4_PYJSON_MAX_DEPTH; depth++) {
        struct dsv4_buf t = {0};
        struct dsv4_pyjson_object o = {0};
        dsv4_buf_puts(&t, "{\"a\": ");
        for (size_t i = 0; i < depth; i++)
            dsv4_buf_putc(&t, '[');
        for (size_t i = 0; i < depth; i++)
            dsv4_buf_putc(&t, ']');
        dsv4_buf_putc(&t, '}');
        assert_int_equal(dsv4_pyjson_load_object(t.p, t.len, &o), depth < DSV4_PYJSON_MAX_DEPTH ? 0 : -EBADMSG);
        if (depth < DSV4_PYJSON_MAX_DEPTH)
            assert_int_equal(o.n, 1);
        dsv4_pyjson_object_free(&o);
        dsv4_buf_free(&t);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_render),
        cmocka_unit_test(test_render_literal),
        cmocka_unit_test(test_render_tools_after_system),
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_parse_stream_and_malformed),
        cmocka_unit_test(test_pyjson),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
