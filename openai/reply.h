/* SPDX-License-Identifier: MIT */
/* The model's reply, parsed as it streams: reasoning (thinking mode: everything before </think>),
 * content, and DSML tool calls (after "\n\n<｜DSML｜tool_calls>", when the request offered tools),
 * turned into OpenAI's pieces:
 *
 *   <｜DSML｜invoke name="get_weather">                    -> CALL_BEGIN "get_weather"
 *   <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
 *                                                         -> CALL_ARGS "{\"city\": \"Paris\""
 *   <｜DSML｜parameter name="n" string="false">5</｜DSML｜parameter>
 *                                                         -> CALL_ARGS ", \"n\": 5"
 *   </｜DSML｜invoke>                                      -> CALL_ARGS "}", CALL_END
 *
 * The arguments are DeepSeek's decoding: string="true" values become JSON strings, string="false"
 * values are JSON already and are kept as written (a value that is not valid JSON becomes a string,
 * so arguments are always one JSON object). Text is held back only while it could still be the start
 * of a marker. A tool-call block that does not follow the format ends parsing: a call it had begun is
 * closed with the parameters that were complete, and the rest comes out as content. Feed any split of the text (it need not fall on UTF-8 boundaries: markers are ASCII and
 * the held-back text is only ever split at a marker). */
#ifndef DSV4_OPENAI_REPLY_H
#define DSV4_OPENAI_REPLY_H

#include <stdbool.h>
#include <stddef.h>

enum dsv4_reply_kind {
    DSV4_REPLY_REASONING,
    DSV4_REPLY_CONTENT,
    DSV4_REPLY_CALL_BEGIN,   /* text: the function name */
    DSV4_REPLY_CALL_ARGS,    /* text: the next piece of the arguments' JSON */
    DSV4_REPLY_CALL_END,
};

struct dsv4_reply_event {
    enum dsv4_reply_kind kind;
    size_t call;             /* CALL_*: the call's index, from 0 */
    const char *text;        /* valid during the callback; may be empty */
    size_t len;
};

/* Return 0 to go on, a negative errno to stop (dsv4_reply_feed returns it). */
typedef int (*dsv4_reply_fn)(const struct dsv4_reply_event *ev, void *user);

struct dsv4_reply;

/* thinking: the reply starts with reasoning; tools: parse DSML tool calls. */
int dsv4_reply_new(bool thinking, bool tools, dsv4_reply_fn fn, void *user, struct dsv4_reply **ret);
void dsv4_reply_free(struct dsv4_reply *r);
int dsv4_reply_feed(struct dsv4_reply *r, const char *text, size_t len);
/* The reply is over: what was held back is emitted; a call cut short is closed with what was complete. */
int dsv4_reply_finish(struct dsv4_reply *r);
/* Calls begun so far. */
size_t dsv4_reply_calls(const struct dsv4_reply *r);

#endif
