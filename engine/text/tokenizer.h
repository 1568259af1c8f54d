/* SPDX-License-Identifier: MIT */
/* Byte-level BPE tokenizer, identical to Hugging Face `tokenizers` on a `tokenizer.json` of the
 * DeepSeek-V3/V4 family.
 *
 * What a file must contain (anything else is refused with a message naming the part):
 *   model          BPE, byte_fallback and ignore_merges false, no dropout, continuing-subword prefix
 *                  or end-of-word suffix; a symbol for each of the 256 bytes (so unk_token, if any,
 *                  is never needed); merges as "a b" strings or ["a", "b"] pairs
 *   added_tokens   id, content, special, normalized; lstrip/rstrip/single_word must be false
 *   normalizer     null or an empty Sequence (identity)
 *   pre_tokenizer  a Sequence of Split{Regex, Isolated, invert false} followed by
 *                  ByteLevel{add_prefix_space false, use_regex false}
 *   decoder        ByteLevel
 *
 * Encoding follows `Tokenizer.encode(text)` with its defaults: added tokens that are not
 * "normalized" are found first (leftmost-longest), then the "normalized" ones inside the remaining
 * pieces; every remaining piece is split by the file's regexes in order (Oniguruma, Ruby syntax,
 * as the Rust crate compiles them), each split piece is mapped to byte-level symbols and merged by
 * merge rank. No BOS/EOS is added (the file's ByteLevel post-processor adds none).
 *
 * Thread safety: after dsv4_tokenizer_load() returns, every function taking a
 * `const struct dsv4_tokenizer *` may be called from any number of threads at once (the word cache
 * is internally locked). A struct dsv4_detok belongs to one thread at a time. */
#ifndef DSV4_ENGINE_TEXT_TOKENIZER_H
#define DSV4_ENGINE_TEXT_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Refuse tokenizer files larger than this (the V4 file is 6.4 MB). */
#define DSV4_TOK_MAX_FILE_BYTES ((size_t)256 << 20)
/* Refuse vocabularies (model vocab + added tokens) with more ids than this. */
#define DSV4_TOK_MAX_VOCAB 1000000
/* Refuse a vocab entry or added token whose content is longer than this many bytes. */
#define DSV4_TOK_MAX_TOKEN_BYTES 1024
/* Refuse a single encode call on more text than this (bytes); callers chunk longer input. */
#define DSV4_TOK_MAX_TEXT_BYTES ((size_t)1 << 30)

struct dsv4_tokenizer;

/* Flags for dsv4_tokenizer_encode(). 0 is the library default: every added token is recognised. */
enum dsv4_tok_encode_flags {
    /* Added tokens flagged "special" (<｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, the place
     * holders, ...) are plain text and go through BPE like any other text. Same as
     * `tokenizer.encode_special_tokens = True` in `tokenizers`. Added tokens not flagged special are
     * still recognised; in the V4 file that includes <｜User｜>, <｜Assistant｜>, <think> and
     * </think>, so this flag alone does not stop a user from writing chat tags. */
    DSV4_TOK_ENCODE_SPECIAL_AS_TEXT = 1u << 0,
    /* No added token at all is recognised: the text is pure BPE. The right choice for message
     * content from untrusted users (no tag can be injected). */
    DSV4_TOK_ENCODE_ADDED_AS_TEXT = 1u << 1,
};

/* Flags for dsv4_tokenizer_decode() and dsv4_detok_new(). */
enum dsv4_tok_decode_flags {
    /* Drop ids of added tokens flagged "special" (as `decode(ids, skip_special_tokens=True)`). */
    DSV4_TOK_DECODE_SKIP_SPECIAL = 1u << 0,
};

/* A growable id array. Zero-initialise it; dsv4_tok_ids_free() releases it. Encoding appends. */
struct dsv4_tok_ids {
    int32_t *ids;
    size_t len;
    size_t cap;
};

void dsv4_tok_ids_free(struct dsv4_tok_ids *ids);
/* Append one id (grows the array). Returns 0 or -ENOMEM. */
int dsv4_tok_ids_push(struct dsv4_tok_ids *ids, int32_t id);

/* Load a Hugging Face tokenizer.json. On error returns a negative errno, sets a message naming the
 * file and the offending part, and leaves *ret_tok NULL. */
int dsv4_tokenizer_load(const char *path, struct dsv4_tokenizer **ret_tok);
void dsv4_tokenizer_free(struct dsv4_tokenizer *tok);

/* Number of ids: 1 + the largest id of the model vocab and the added tokens (129280 for V4). */
size_t dsv4_tokenizer_vocab_size(const struct dsv4_tokenizer *tok);

/* Encode `len` bytes of UTF-8 `text` (need not be NUL-terminated) and APPEND the ids to `out`.
 * Invalid UTF-8 is refused with -EILSEQ and the byte offset in the message (a Python str cannot hold
 * it either). `flags` is a mask of enum dsv4_tok_encode_flags. On error `out` keeps its earlier ids
 * plus possibly some of this call's. */
int dsv4_tokenizer_encode(const struct dsv4_tokenizer *tok, const char *text, size_t len,
                          unsigned flags, struct dsv4_tok_ids *out);

/* Encode the concatenation of `n` parts as one text (so ids are exactly those of the whole string
 * wherever no tag is involved), APPENDING to `out`: even-indexed parts are the caller's own template,
 * where added tokens are recognised as `flags` say; odd-indexed parts are literal text (message
 * content from untrusted users), and an added token is recognised only when it lies wholly inside
 * one template part. Errors as dsv4_tokenizer_encode(). */
int dsv4_tokenizer_encode_parts(const struct dsv4_tokenizer *tok, const char *const *parts, const size_t *lens,
                                size_t n, unsigned flags, struct dsv4_tok_ids *out);

/* Decode ids to bytes: the concatenation of dsv4_tokenizer_token_bytes() of each id (special ids
 * dropped with DSV4_TOK_DECODE_SKIP_SPECIAL). The result is NUL-terminated, malloc'd, owned by the
 * caller, and may end in (or contain) incomplete UTF-8 if the ids cut a character: apply
 * dsv4_utf8_lossy() to get the exact string `tokenizers` returns. An id outside the vocabulary is
 * refused with -ERANGE naming it. */
int dsv4_tokenizer_decode(const struct dsv4_tokenizer *tok, const int32_t *ids, size_t n,
                          unsigned flags, char **ret_bytes, size_t *ret_len);

/* The bytes one id stands for, as the ByteLevel decoder produces them (for an added token whose
 * content is not made of byte-level symbols, its UTF-8 content). Returns NULL for an unknown id.
 * The pointer lives as long as the tokenizer. Not NUL-terminated. */
const char *dsv4_tokenizer_token_bytes(const struct dsv4_tokenizer *tok, int32_t id, size_t *ret_len);

/* The token string as stored in the file (byte-level symbols for vocab entries, e.g. "Ġthe"),
 * NUL-terminated, or NULL for an unknown id. */
const char *dsv4_tokenizer_token_string(const struct dsv4_tokenizer *tok, int32_t id);

/* The id of the added token whose content is exactly `content` (NUL-terminated), e.g.
 * "<｜User｜>" or "</think>". Returns the id (>= 0) or -ENOENT (with a message naming it). */
int32_t dsv4_tokenizer_added_id(const struct dsv4_tokenizer *tok, const char *content);

/* The id of a token string of the model vocab or the added tokens (as `token_to_id`), or -ENOENT. */
int32_t dsv4_tokenizer_token_id(const struct dsv4_tokenizer *tok, const char *token_string);

/* True when `id` is an added token flagged "special". */
bool dsv4_tokenizer_is_special(const struct dsv4_tokenizer *tok, int32_t id);
/* True when `id` is any added token. */
bool dsv4_tokenizer_is_added(const struct dsv4_tokenizer *tok, int32_t id);

/* Rewrite `len` bytes into valid UTF-8 exactly as Rust's String::from_utf8_lossy does (each maximal
 * invalid subpart becomes U+FFFD). Returns a malloc'd NUL-terminated string or NULL on ENOMEM. */
char *dsv4_utf8_lossy(const char *bytes, size_t len, size_t *ret_len);

/* Streaming detokenizer: feed ids one at a time, get back only bytes that form complete UTF-8
 * characters. Whatever the token boundaries, the concatenation of every feed's output and the
 * final flush equals dsv4_utf8_lossy(dsv4_tokenizer_decode(all ids)). */
struct dsv4_detok;

int dsv4_detok_new(const struct dsv4_tokenizer *tok, unsigned decode_flags, struct dsv4_detok **ret);
void dsv4_detok_free(struct dsv4_detok *d);
/* Feed one id. *ret_bytes and *ret_len receive the newly complete text (possibly empty, valid UTF-8,
 * invalid sequences already replaced by U+FFFD); the pointer is valid until the next call on `d`.
 * Returns 0, or -ERANGE for an unknown id (the state is unchanged). */
int dsv4_detok_feed(struct dsv4_detok *d, int32_t id, const char **ret_bytes, size_t *ret_len);
/* End of stream: return the held-back tail of an incomplete character as U+FFFD (or nothing), and
 * reset `d` for a new stream. */
int dsv4_detok_flush(struct dsv4_detok *d, const char **ret_bytes, size_t *ret_len);

#endif
