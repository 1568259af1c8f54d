/* SPDX-License-Identifier: MIT */
/* DeepSeek-V4's chat encoding of an OpenAI conversation, written as prompt parts for dsv4d's
 * prompt_parts (doc/PROTOCOL.md): even parts are this renderer's template (tags such as <｜User｜>,
 * <｜Assistant｜>, </think>, <｜DSML｜...> are recognised there), odd parts are text that came from
 * the request (message content, reasoning, tool names, arguments and schemas), where no tag can be
 * forged. Concatenated, the parts are exactly the string DeepSeek's published encoder
 * (encoding_dsv4.py, encode_messages) produces, BOS included:
 *
 *   - `tools` are rendered as the "## Tools" section, each function schema as one line of JSON,
 *     after a blank line that follows the text of a first system message, or as a system message
 *     of their own ahead of a conversation that does not begin with one;
 *   - `tool` messages become <tool_result>...</tool_result> blocks of a user turn, in the order of the
 *     calls of the last assistant turn that made calls; a user message right after joins that turn;
 *     blocks are joined by a blank line;
 *   - an assistant turn is [reasoning</think>] content ["\n\n" DSML tool_calls block] <｜end▁of▁sentence｜>;
 *     its tool call arguments (a JSON object) become one DSML parameter per key, string="true" for
 *     strings (written as they are) and string="false" for anything else (written as JSON); they are
 *     read as Python's json.loads reads them (openai/pyjson.h), and text it cannot read is one
 *     parameter named "arguments";
 *   - in thinking mode without tools, reasoning of turns before the last user message is dropped and
 *     only the last user turn opens <think>; with tools every turn keeps it;
 *   - reasoning effort "max" in thinking mode puts DeepSeek's effort prompt before everything.
 *
 * Message content may be a string, null, or an array of {"type":"text","text":...} parts (joined
 * with "\n"; in a tool message with a blank line, as DeepSeek's tool results are). A tool message's
 * null content is the text "None", as the encoder writes it. */
#ifndef DSV4_OPENAI_RENDER_H
#define DSV4_OPENAI_RENDER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "openai/buf.h"

/* The whole prompt in `text`; part i is text[ends[i-1], ends[i]) (ends[-1] = 0). */
struct dsv4_parts {
    struct dsv4_buf text;
    size_t *ends;
    size_t n;
    size_t cap;
};

void dsv4_parts_free(struct dsv4_parts *p);
/* Pointer and length arrays for dsv4_client_generate_params.prompt_parts; malloc'd, free() both. */
int dsv4_parts_export(const struct dsv4_parts *p, const char ***ret_ptrs, size_t **ret_lens);

struct dsv4_render_opts {
    bool thinking;          /* the reply starts with reasoning (prompt ends with <think>) */
    bool effort_max;        /* DeepSeek's "max" reasoning effort prompt (thinking mode only) */
};

/* Render `messages` (a JSON array in OpenAI's chat form) and `tools` (NULL or an array of
 * {"type":"function","function":{...}}) into *out (zero-initialised by the caller). Returns 0,
 * -EINVAL with a message naming the offending field in err (e.g. "messages[2].role: 'robot' is not
 * system, developer, user, assistant or tool"), or -ENOMEM. */
int dsv4_render_chat(const json_t *messages, const json_t *tools, const struct dsv4_render_opts *opts,
                     struct dsv4_parts *out, char *err, size_t err_len);

#endif
