/* SPDX-License-Identifier: MIT */
/* The DeepSeek-V4 chat format (doc/MODEL.md §6) and parsing of a completion.
 *
 *   <｜begin▁of▁sentence｜>{system}<｜User｜>{u1}<｜Assistant｜></think>{a1}<｜end▁of▁sentence｜>
 *   <｜User｜>{u2}<｜Assistant｜></think>                          (chat mode)
 *   <｜User｜>{u2}<｜Assistant｜><think>                           (thinking mode)
 *
 * (one line in reality; broken here for reading). Rules:
 *   - system text is written as is, with no tag: the options' system prompt right after BOS, and
 *     each system message where it stands;
 *   - a user message is <｜User｜>{content}; when an assistant message or the end of the conversation
 *     follows, <｜Assistant｜> and </think> come next, <think> after the LAST user message in thinking
 *     mode; a user message right after another joins its turn after a blank line ("\n\n"), as
 *     DeepSeek's encoder (encoding_dsv4.py) writes them;
 *   - an assistant message before the last user message is {content}<｜end▁of▁sentence｜>: its
 *     reasoning is dropped;
 *   - an assistant message after the last user message (a continued turn) is, in thinking mode,
 *     {reasoning}</think>{content}<｜end▁of▁sentence｜>, in chat mode {content}<｜end▁of▁sentence｜>.
 * Every tag id is looked up in the tokenizer's added tokens by its content, never a constant.
 *
 * Completion parsing: in thinking mode the model's reply is reasoning, </think>, content; in chat
 * mode it is content. <｜end▁of▁sentence｜> ends the reply. */
#ifndef DSV4_ENGINE_TEXT_CHAT_H
#define DSV4_ENGINE_TEXT_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/text/tokenizer.h"

/* Refuse a conversation with more messages than this. */
#define DSV4_CHAT_MAX_MESSAGES 65536

/* Tag contents as they appear in the V4 tokenizer's added tokens. */
#define DSV4_CHAT_BOS_TEXT "<｜begin▁of▁sentence｜>"
#define DSV4_CHAT_EOS_TEXT "<｜end▁of▁sentence｜>"
#define DSV4_CHAT_USER_TEXT "<｜User｜>"
#define DSV4_CHAT_ASSISTANT_TEXT "<｜Assistant｜>"
#define DSV4_CHAT_THINK_START_TEXT "<think>"
#define DSV4_CHAT_THINK_END_TEXT "</think>"

enum dsv4_chat_role {
    DSV4_CHAT_ROLE_SYSTEM,
    DSV4_CHAT_ROLE_USER,
    DSV4_CHAT_ROLE_ASSISTANT,
};

enum dsv4_chat_mode {
    DSV4_CHAT_MODE_CHAT,     /* the reply is the answer; prompt ends with </think> */
    DSV4_CHAT_MODE_THINKING, /* the reply starts with reasoning; prompt ends with <think> */
};

/* One message. Strings are UTF-8 of the given length (need not be NUL-terminated). `reasoning`
 * is only read for assistant messages after the last user message in thinking mode; NULL = none. */
struct dsv4_chat_message {
    enum dsv4_chat_role role;
    const char *content;
    size_t content_len;
    const char *reasoning;
    size_t reasoning_len;
};

struct dsv4_chat_options {
    enum dsv4_chat_mode mode;
    const char *system;  /* optional system prompt written right after BOS; NULL = none */
    size_t system_len;
    /* Encode flags (enum dsv4_tok_encode_flags) applied to message, system and reasoning text when
     * building ids. DSV4_TOK_ENCODE_ADDED_AS_TEXT keeps a user from injecting tags such as
     * <｜Assistant｜> or </think> (SPECIAL_AS_TEXT does not: V4 does not flag those "special");
     * 0 gives the ids `tokenizers` gives for the built text. */
    unsigned content_flags;
    bool no_bos;         /* leave out <｜begin▁of▁sentence｜> (continuing an existing context) */
};

/* The tag ids of a tokenizer, each looked up by content. */
struct dsv4_chat_tags {
    int32_t bos, eos, user, assistant, think_start, think_end;
};

/* Look up all six tags; -ENOENT naming the missing one if the tokenizer lacks any. */
int dsv4_chat_tags_lookup(const struct dsv4_tokenizer *tok, struct dsv4_chat_tags *ret_tags);

/* Build the prompt for `n` messages as ids, APPENDED to `out`: tags as their ids, text encoded
 * with opts->content_flags. Returns 0 or a negative errno with a message (bad role, too many
 * messages, invalid UTF-8 naming the message index). */
int dsv4_chat_build_ids(const struct dsv4_tokenizer *tok, const struct dsv4_chat_message *msgs,
                        size_t n, const struct dsv4_chat_options *opts, struct dsv4_tok_ids *out);

/* Build the same prompt as text (tags written as their contents); malloc'd, NUL-terminated.
 * Needs no tokenizer. Encoding this text with flags 0 gives the ids dsv4_chat_build_ids() gives
 * with content_flags 0. */
int dsv4_chat_build_text(const struct dsv4_chat_message *msgs, size_t n,
                         const struct dsv4_chat_options *opts, char **ret_text, size_t *ret_len);

/* A parsed completion. Strings are malloc'd, NUL-terminated, valid UTF-8 (dsv4_utf8_lossy). */
struct dsv4_chat_reply {
    char *reasoning;        /* thinking mode: text before </think> ("" in chat mode) */
    size_t reasoning_len;
    char *content;          /* text after </think> (thinking mode) or the whole reply (chat) */
    size_t content_len;
    bool reasoning_closed;  /* thinking mode: </think> was seen (false = cut short while thinking) */
    bool finished;          /* <｜end▁of▁sentence｜> was seen; ids/text after it are ignored */
};

void dsv4_chat_reply_free(struct dsv4_chat_reply *reply);

/* Parse the ids the model generated after a prompt built in `mode`. The first </think> id splits
 * reasoning from content; the first EOS id ends the reply. Other special ids are dropped. */
int dsv4_chat_parse_ids(const struct dsv4_tokenizer *tok, enum dsv4_chat_mode mode,
                        const int32_t *ids, size_t n, struct dsv4_chat_reply *ret_reply);

/* Parse a completion given as text: the first "</think>" splits, the first
 * "<｜end▁of▁sentence｜>" ends the reply. */
int dsv4_chat_parse_text(enum dsv4_chat_mode mode, const char *text, size_t len,
                         struct dsv4_chat_reply *ret_reply);

/* Streaming form of dsv4_chat_parse_ids() for the daemon: feed each generated id, get the newly
 * complete UTF-8 text and which part it belongs to. */
struct dsv4_chat_stream;

enum dsv4_chat_part {
    DSV4_CHAT_PART_REASONING,
    DSV4_CHAT_PART_CONTENT,
};

struct dsv4_chat_delta {
    enum dsv4_chat_part part;  /* which part `text` belongs to */
    const char *text;          /* newly complete UTF-8 (maybe empty); valid until the next call */
    size_t len;
    bool finished;             /* EOS seen: the reply is over, later ids are ignored */
};

int dsv4_chat_stream_new(const struct dsv4_tokenizer *tok, enum dsv4_chat_mode mode,
                         struct dsv4_chat_stream **ret);
void dsv4_chat_stream_free(struct dsv4_chat_stream *s);
/* Feed one generated id. At the </think> id (thinking mode) the held-back bytes of the reasoning
 * are flushed with part REASONING, and later text is CONTENT. Returns 0 or -ERANGE (unknown id). */
int dsv4_chat_stream_feed(struct dsv4_chat_stream *s, int32_t id, struct dsv4_chat_delta *ret_delta);
/* End of the reply (length limit or EOS): return any held-back bytes. */
int dsv4_chat_stream_flush(struct dsv4_chat_stream *s, struct dsv4_chat_delta *ret_delta);

#endif
