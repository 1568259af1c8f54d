/* SPDX-License-Identifier: MIT */
/* msgpack-rpc messages of the dsv4d protocol (doc/PROTOCOL.md is the normative description).
 *
 *   request       [0, msgid, method, params]
 *   response      [1, msgid, error, result]      error nil on success, else {code, name, message}
 *   notification  [2, method, params]
 * params is an array holding one map ([{...}]); a bare map, an empty array or nil are accepted too.
 *
 * Receiving: take a frame from the reader (protocol/frame.h), dsv4_proto_message_decode() it (that runs
 * the pre-validator, then msgpack-c, then reads the envelope), then the typed decoder for its method.
 * Sending: the dsv4_proto_encode_* functions append one complete frame to a struct dsv4_proto_buf.
 *
 * Ownership: decoded typed structs own their memory (heap copies), independent of the message they were
 * read from; free them with the matching *_clear(), which accepts NULL and leaves a zeroed struct.
 * Encoders only read the struct they are given. Strings are UTF-8, NUL-terminated, with their byte
 * length beside them.
 *
 * Strictness: request decoders reject unknown fields (DSV4_PROTO_E_UNKNOWN_FIELD); result decoders
 * ignore unknown fields so a newer server can add some. Every decoder returns 0 or a negative errno
 * (-EBADMSG, -ENOMEM) and fills err with the protocol code and a message naming the field. */
#ifndef DSV4_PROTOCOL_MESSAGE_H
#define DSV4_PROTOCOL_MESSAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "protocol/codes.h"
#include "protocol/frame.h"
#include "protocol/validate.h"

/* Version spoken by this build; hello negotiates min(client, server) when >= DSV4_PROTO_VERSION_MIN. */
#define DSV4_PROTO_VERSION 2u          /* 2: generate takes prompt_parts */
#define DSV4_PROTO_VERSION_MIN 1u

/* Request limits that need no model (the model-dependent ones are in struct dsv4_proto_model_limits). */
#define DSV4_PROTO_MAX_MESSAGES 4096u          /* chat messages in one generate/tokenize */
#define DSV4_PROTO_MAX_PROMPT_PARTS 65536u     /* strings in one prompt_parts */
#define DSV4_PROTO_MAX_STOP 16u                /* stop strings */
#define DSV4_PROTO_MAX_STOP_LEN 256u           /* bytes of one stop string */
#define DSV4_PROTO_MAX_STOP_TOKEN_IDS 64u
#define DSV4_PROTO_MAX_LOGPROBS 20u            /* top alternatives per token */
#define DSV4_PROTO_MAX_NAME 256u               /* bytes of names: client, model, backend, kernel names */

/* Sampling defaults (absent fields) and sane ranges (outside: DSV4_PROTO_E_BAD_SAMPLING). */
#define DSV4_PROTO_DEFAULT_MAX_TOKENS 1024u   /* when max_tokens is absent */
#define DSV4_PROTO_MAX_MAX_TOKENS (1u << 20)   /* [1, 2^20] */
#define DSV4_PROTO_DEFAULT_TEMPERATURE 1.0f    /* [0, 10]; 0 means greedy */
#define DSV4_PROTO_MAX_TEMPERATURE 10.0f
#define DSV4_PROTO_DEFAULT_TOP_P 1.0f          /* [0, 1] */
#define DSV4_PROTO_DEFAULT_TOP_K 0             /* >= 0, 0 (or -1 on the wire) disables */
#define DSV4_PROTO_DEFAULT_MIN_P 0.0f          /* [0, 1] */
#define DSV4_PROTO_MAX_PENALTY 2.0f            /* presence and frequency: [-2, 2], default 0 */
#define DSV4_PROTO_DEFAULT_REPETITION_PENALTY 1.0f /* (0, 10] */
#define DSV4_PROTO_MAX_REPETITION_PENALTY 10.0f

/* ---- envelope ---------------------------------------------------------------------------------- */

enum dsv4_proto_kind {
    DSV4_PROTO_REQUEST = 0,
    DSV4_PROTO_RESPONSE = 1,
    DSV4_PROTO_NOTIFICATION = 2,
};

enum dsv4_proto_method {
    DSV4_PROTO_METHOD_UNKNOWN = 0,
    /* requests */
    DSV4_PROTO_METHOD_HELLO,
    DSV4_PROTO_METHOD_GENERATE,
    DSV4_PROTO_METHOD_CANCEL,
    DSV4_PROTO_METHOD_TOKENIZE,
    DSV4_PROTO_METHOD_DETOKENIZE,
    DSV4_PROTO_METHOD_STATS,
    DSV4_PROTO_METHOD_HEALTH,
    /* notifications, server to client */
    DSV4_PROTO_NOTIFY_TOKEN,
    DSV4_PROTO_NOTIFY_ERROR,   /* fatal error before the server closes the connection */
};

/* Wire name of a method ("generate"), NULL for UNKNOWN. */
const char *dsv4_proto_method_name(enum dsv4_proto_method m);

struct dsv4_proto_unpacked;   /* private: msgpack-c zone and objects */

struct dsv4_proto_message {
    enum dsv4_proto_kind kind;
    bool has_msgid;                 /* requests and responses, once the msgid was read */
    uint32_t msgid;
    enum dsv4_proto_method method;  /* requests and notifications */
    /* responses: has_error with the server's error, else the result is read by a typed decoder */
    bool has_error;
    struct dsv4_proto_error error;
    struct dsv4_proto_unpacked *body;   /* params (request, notification) or result (response) */
};

/* Validate (protocol/validate.h), copy the payload, unpack it with msgpack-c, read the envelope. The
 * message does not reference payload afterwards. On failure err says why and msg keeps what was read:
 * when the code is not fatal (UNKNOWN_METHOD, WRONG_TYPE for a method that is not a str)
 * msg->has_msgid is true and the server answers that msgid with an error response; on a fatal code it
 * sends dsv4_proto_encode_error_notification() and closes. Call dsv4_proto_message_clear() in both
 * cases. A server must also treat msg->kind != DSV4_PROTO_REQUEST as fatal UNEXPECTED_MESSAGE; a
 * client ignores notifications whose method is DSV4_PROTO_METHOD_UNKNOWN (sent by a newer server). */
int dsv4_proto_message_decode(const uint8_t *payload, size_t len, const struct dsv4_proto_limits *lim,
                              struct dsv4_proto_message *msg, struct dsv4_proto_error *err);
void dsv4_proto_message_clear(struct dsv4_proto_message *msg);

/* Error response [1, msgid, {code, name, message}, nil]; message NULL uses dsv4_proto_code_describe(). */
int dsv4_proto_encode_error(struct dsv4_proto_buf *out, uint32_t msgid, int code, const char *message);
/* Error notification [2, "error", [{code, name, message}]]: the last frame before a fatal close. */
int dsv4_proto_encode_error_notification(struct dsv4_proto_buf *out, int code, const char *message);
/* Read the error notification's params. */
int dsv4_proto_decode_error_notification(const struct dsv4_proto_message *msg,
                                         struct dsv4_proto_error *out, struct dsv4_proto_error *err);

/* ---- hello ------------------------------------------------------------------------------------- */

struct dsv4_proto_hello {
    uint32_t protocol;   /* highest version the client speaks; required */
    char *client;        /* optional free-form client name ("dsv4ctl 0.1.0"), NULL when absent */
};

struct dsv4_proto_model_info {
    char *name;
    uint32_t vocab_size;
    uint32_t hidden_size;
    uint32_t num_layers;
    uint32_t num_heads;
    uint32_t head_dim;
    uint32_t n_routed_experts;
    uint32_t experts_per_token;
    int32_t bos_id;      /* -1 when the tokenizer has none */
    int32_t eos_id;
};

/* Server limits reported by hello (0 = no limit configured). */
struct dsv4_proto_server_limits {
    uint32_t max_frame;
    uint32_t max_prompt_tokens;
    uint32_t max_tokens;                  /* upper bound for a request's max_tokens */
    uint32_t max_connections;
    uint32_t max_queue;
    uint32_t max_requests_per_connection;
};

struct dsv4_proto_hello_result {
    uint32_t protocol;   /* negotiated version */
    char *server;        /* "dsv4d 0.1.0" */
    struct dsv4_proto_model_info model;
    uint32_t max_context;
    uint32_t max_batch;
    char *backend;       /* "cpu", "cuda" */
    struct dsv4_proto_server_limits limits;
};

int dsv4_proto_encode_hello(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_hello *req);
int dsv4_proto_decode_hello(const struct dsv4_proto_message *msg, struct dsv4_proto_hello *req,
                            struct dsv4_proto_error *err);
void dsv4_proto_hello_clear(struct dsv4_proto_hello *req);
/* The version the server answers with, or -EBADMSG (DSV4_PROTO_E_VERSION_UNSUPPORTED) when the client's
 * version is below DSV4_PROTO_VERSION_MIN. */
int dsv4_proto_hello_negotiate(const struct dsv4_proto_hello *req, uint32_t *ret_version,
                               struct dsv4_proto_error *err);

int dsv4_proto_encode_hello_result(struct dsv4_proto_buf *out, uint32_t msgid,
                                   const struct dsv4_proto_hello_result *res);
int dsv4_proto_decode_hello_result(const struct dsv4_proto_message *msg, struct dsv4_proto_hello_result *res,
                                   struct dsv4_proto_error *err);
void dsv4_proto_hello_result_clear(struct dsv4_proto_hello_result *res);

/* ---- generate ---------------------------------------------------------------------------------- */

enum dsv4_proto_prompt_kind {
    DSV4_PROTO_PROMPT_NONE = 0,
    DSV4_PROTO_PROMPT_TEXT,       /* "prompt": str, raw completion */
    DSV4_PROTO_PROMPT_MESSAGES,   /* "messages": [{role, content}], chat format */
    DSV4_PROTO_PROMPT_TOKENS,     /* "tokens": bin of little-endian int32 */
    DSV4_PROTO_PROMPT_PARTS,      /* "prompt_parts": [str], template and literal text alternating */
};

enum dsv4_proto_role {
    DSV4_PROTO_ROLE_SYSTEM = 0,
    DSV4_PROTO_ROLE_USER,
    DSV4_PROTO_ROLE_ASSISTANT,
};

/* "system", "user", "assistant". */
const char *dsv4_proto_role_name(enum dsv4_proto_role r);

struct dsv4_proto_chat_message {
    enum dsv4_proto_role role;
    char *content;
    size_t content_len;
};

struct dsv4_proto_sampling {
    uint32_t max_tokens;           /* 0: absent, see dsv4_proto_effective_max_tokens() */
    float temperature;
    float top_p;
    int32_t top_k;                 /* 0: disabled */
    float min_p;
    float presence_penalty;
    float frequency_penalty;
    float repetition_penalty;
    bool has_seed;                 /* absent: the server picks one */
    uint64_t seed;
    uint32_t n_stop;               /* wire: "stop" is a str or an array of str */
    char *stop[DSV4_PROTO_MAX_STOP];
    uint32_t n_stop_token_ids;
    int32_t stop_token_ids[DSV4_PROTO_MAX_STOP_TOKEN_IDS];
    int32_t logprobs;              /* -1 off; 0..MAX_LOGPROBS: chosen token's logprob + that many top */
};

/* Fill with the documented defaults (what an absent field means). */
void dsv4_proto_sampling_default(struct dsv4_proto_sampling *s);

struct dsv4_proto_generate {
    enum dsv4_proto_prompt_kind prompt_kind;
    char *prompt;                  /* PROMPT_TEXT */
    size_t prompt_len;
    bool add_bos;                  /* PROMPT_TEXT only: prepend BOS; default true */
    struct dsv4_proto_chat_message *messages;   /* PROMPT_MESSAGES */
    uint32_t n_messages;
    int32_t *tokens;               /* PROMPT_TOKENS, host order */
    uint32_t n_tokens;
    /* PROMPT_PARTS: tokenized as one text; even-indexed parts are the caller's template (tags are
     * recognised), odd-indexed parts literal text (never a tag). add_bos applies as to PROMPT_TEXT. */
    char **parts;
    size_t *part_lens;
    uint32_t n_parts;
    bool thinking;                 /* chat only: reply starts with reasoning; default false */
    bool stream;                   /* token notifications before the result; default false */
    struct dsv4_proto_sampling sampling;
};

/* Initialise to an empty request with default sampling (call before filling one to encode). */
void dsv4_proto_generate_init(struct dsv4_proto_generate *req);
int dsv4_proto_encode_generate(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_generate *req);
/* Checks shape, types, UTF-8, roles, and the model-independent ranges and limits above. */
int dsv4_proto_decode_generate(const struct dsv4_proto_message *msg, struct dsv4_proto_generate *req,
                               struct dsv4_proto_error *err);
void dsv4_proto_generate_clear(struct dsv4_proto_generate *req);

/* What the server knows once the model is loaded; 0 in a field means "no limit". */
struct dsv4_proto_model_limits {
    uint32_t vocab_size;
    uint32_t max_context;          /* prompt + generated tokens */
    uint32_t max_prompt_tokens;
    uint32_t max_tokens;           /* cap on a request's max_tokens */
};

/* Model-dependent checks of a decoded request: token prompt ids and stop_token_ids inside the vocab
 * (TOKEN_OUT_OF_VOCAB), a token prompt's length (PROMPT_TOO_LONG), max_tokens (MAX_TOKENS_LIMIT). */
int dsv4_proto_check_generate(const struct dsv4_proto_generate *req, const struct dsv4_proto_model_limits *lim,
                              struct dsv4_proto_error *err);
/* The number of tokens a request may generate: its max_tokens, or DSV4_PROTO_DEFAULT_MAX_TOKENS when
 * absent, capped by lim->max_tokens (an absent max_tokens never fails the limit check). The context
 * bound is separate: generation also stops, with finish_reason "length", when the context is full. */
uint32_t dsv4_proto_effective_max_tokens(const struct dsv4_proto_sampling *s, const struct dsv4_proto_model_limits *lim);
/* Length of a tokenized prompt: above max_prompt_tokens or >= max_context is PROMPT_TOO_LONG. */
int dsv4_proto_check_prompt_length(uint32_t n_prompt_tokens, const struct dsv4_proto_model_limits *lim,
                                   struct dsv4_proto_error *err);
/* Every id in [0, vocab_size); field names the request field in the message. */
int dsv4_proto_check_token_ids(const int32_t *ids, size_t n, uint32_t vocab_size, const char *field,
                               struct dsv4_proto_error *err);

/* Log-probabilities of one generated token. */
struct dsv4_proto_logprob {
    float logprob;                 /* of the chosen token */
    uint32_t n_top;
    int32_t top_ids[DSV4_PROTO_MAX_LOGPROBS];
    float top_logprobs[DSV4_PROTO_MAX_LOGPROBS];
};

/* Notification [2, "token", [{msgid, token, text, logprob?, top_logprobs?}]]: one generated token of a
 * streaming request. text is the UTF-8 delta this token completes (may be "" while a character's bytes
 * are still incomplete); the deltas of a request concatenate to the result's text. */
struct dsv4_proto_token_event {
    uint32_t msgid;
    int32_t token;
    char *text;
    size_t text_len;
    bool has_logprob;
    struct dsv4_proto_logprob logprob;
};

int dsv4_proto_encode_token(struct dsv4_proto_buf *out, const struct dsv4_proto_token_event *ev);
int dsv4_proto_decode_token(const struct dsv4_proto_message *msg, struct dsv4_proto_token_event *ev,
                            struct dsv4_proto_error *err);
void dsv4_proto_token_event_clear(struct dsv4_proto_token_event *ev);

enum dsv4_proto_finish {
    DSV4_PROTO_FINISH_STOP = 0,    /* EOS, a stop string or a stop token */
    DSV4_PROTO_FINISH_LENGTH,      /* max_tokens or the context filled */
    DSV4_PROTO_FINISH_CANCELLED,   /* cancel, or the server draining */
    DSV4_PROTO_FINISH_ERROR,       /* the engine failed mid-way; error_message says why */
};

/* "stop", "length", "cancelled", "error"; and back (-1 for an unknown name). */
const char *dsv4_proto_finish_name(enum dsv4_proto_finish f);
int dsv4_proto_finish_from_name(const char *name);

struct dsv4_proto_usage {
    uint32_t prompt_tokens;
    uint32_t completion_tokens;    /* total_tokens on the wire is their sum */
    uint32_t cached_tokens;        /* of prompt_tokens, those restored from the prefix cache */
};

struct dsv4_proto_timings {
    double queue_ms;               /* accepted -> admitted into a slot */
    double prefill_ms;             /* admitted -> first token */
    double decode_ms;              /* first token -> last token */
    double total_ms;               /* accepted -> result */
    double decode_tokens_per_s;    /* (completion_tokens - 1) / decode time; 0 when fewer than 2 tokens */
};

struct dsv4_proto_generate_result {
    char *text;                    /* everything generated, stop string excluded */
    size_t text_len;
    int32_t *tokens;               /* generated ids (wire: bin of LE int32) */
    uint32_t n_tokens;
    enum dsv4_proto_finish finish_reason;
    char *error_message;           /* FINISH_ERROR only, else NULL */
    struct dsv4_proto_usage usage;
    struct dsv4_proto_timings timings;
    struct dsv4_proto_logprob *logprobs;   /* n_tokens entries when logprobs was requested, else NULL */
};

int dsv4_proto_encode_generate_result(struct dsv4_proto_buf *out, uint32_t msgid,
                                      const struct dsv4_proto_generate_result *res);
int dsv4_proto_decode_generate_result(const struct dsv4_proto_message *msg,
                                      struct dsv4_proto_generate_result *res, struct dsv4_proto_error *err);
void dsv4_proto_generate_result_clear(struct dsv4_proto_generate_result *res);

/* ---- cancel ------------------------------------------------------------------------------------ */

/* {msgid}: cancel a generate request of the same connection. Its own response still comes, with
 * finish_reason "cancelled". The cancel response is {cancelled: bool}: false when that msgid was not in
 * flight any more (finished already, or never sent), which is not an error. */
struct dsv4_proto_cancel {
    uint32_t msgid;
};

int dsv4_proto_encode_cancel(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_cancel *req);
int dsv4_proto_decode_cancel(const struct dsv4_proto_message *msg, struct dsv4_proto_cancel *req,
                             struct dsv4_proto_error *err);
int dsv4_proto_encode_cancel_result(struct dsv4_proto_buf *out, uint32_t msgid, bool cancelled);
int dsv4_proto_decode_cancel_result(const struct dsv4_proto_message *msg, bool *cancelled,
                                    struct dsv4_proto_error *err);

/* ---- tokenize / detokenize --------------------------------------------------------------------- */

/* {text, add_bos?} or {messages, thinking?}: exactly the tokens generate would see for that prompt. */
struct dsv4_proto_tokenize {
    enum dsv4_proto_prompt_kind prompt_kind;   /* TEXT or MESSAGES */
    char *text;
    size_t text_len;
    bool add_bos;                  /* default true, as in generate */
    struct dsv4_proto_chat_message *messages;
    uint32_t n_messages;
    bool thinking;
};

void dsv4_proto_tokenize_init(struct dsv4_proto_tokenize *req);
int dsv4_proto_encode_tokenize(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_tokenize *req);
int dsv4_proto_decode_tokenize(const struct dsv4_proto_message *msg, struct dsv4_proto_tokenize *req,
                               struct dsv4_proto_error *err);
void dsv4_proto_tokenize_clear(struct dsv4_proto_tokenize *req);

/* A token array travels as {tokens: bin}: the tokenize result and the detokenize request. */
struct dsv4_proto_tokens {
    int32_t *tokens;
    uint32_t n_tokens;
};

int dsv4_proto_encode_tokenize_result(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_tokens *res);
int dsv4_proto_decode_tokenize_result(const struct dsv4_proto_message *msg, struct dsv4_proto_tokens *res,
                                      struct dsv4_proto_error *err);
/* detokenize request {tokens: bin}; an empty array is allowed and gives "". */
int dsv4_proto_encode_detokenize(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_tokens *req);
int dsv4_proto_decode_detokenize(const struct dsv4_proto_message *msg, struct dsv4_proto_tokens *req,
                                 struct dsv4_proto_error *err);
void dsv4_proto_tokens_clear(struct dsv4_proto_tokens *t);

/* detokenize result {text}: invalid byte sequences the tokens spell are sent as U+FFFD. */
struct dsv4_proto_text {
    char *text;
    size_t text_len;
};

int dsv4_proto_encode_detokenize_result(struct dsv4_proto_buf *out, uint32_t msgid, const char *text, size_t len);
int dsv4_proto_decode_detokenize_result(const struct dsv4_proto_message *msg, struct dsv4_proto_text *res,
                                        struct dsv4_proto_error *err);
void dsv4_proto_text_clear(struct dsv4_proto_text *t);

/* ---- stats / health ---------------------------------------------------------------------------- */

/* stats and health take no params ({} or nothing); these encode the requests and check the params. */
int dsv4_proto_encode_stats(struct dsv4_proto_buf *out, uint32_t msgid);
int dsv4_proto_encode_health(struct dsv4_proto_buf *out, uint32_t msgid);
int dsv4_proto_decode_empty_params(const struct dsv4_proto_message *msg, struct dsv4_proto_error *err);

#define DSV4_PROTO_MAX_KERNELS 64u
/* Decode batch-size histogram: bucket 0 counts batches of 1, bucket i > 0 batches of (2^(i-1), 2^i],
 * the last bucket also everything larger. 32 buckets reach far beyond any slot count. */
#define DSV4_PROTO_MAX_BATCH_BUCKETS 32u
#define DSV4_PROTO_MAX_SPEC_BUCKETS 16u     /* spec_accept_hist: accepted drafts 0..15 */
/* Latency histograms: latency_bounds_s holds at most this many finite bucket bounds; each histogram
 * has one bucket more, for what lies above the last. */
#define DSV4_PROTO_MAX_LATENCY_BOUNDS 63u

/* One latency histogram's buckets (wire: an array of uint): buckets[i] counts the requests whose
 * seconds v have latency_bounds_s[i - 1] < v <= latency_bounds_s[i], not cumulative; the last bucket,
 * v above every bound. n is n_latency_bounds + 1, or 0 (none sent). */
struct dsv4_proto_latency {
    uint32_t n;
    uint64_t buckets[DSV4_PROTO_MAX_LATENCY_BOUNDS + 1];
};

/* A flat map, one key per field (names as below). */
struct dsv4_proto_stats {
    double uptime_s;
    char *backend;
    uint32_t slots_total;
    uint32_t slots_busy;
    uint32_t queue_depth;
    uint32_t connections;
    uint64_t requests_total;
    uint64_t requests_failed;
    uint64_t requests_cancelled;
    uint64_t prompt_tokens_total;
    uint64_t generated_tokens_total;
    double prefill_tokens_per_s;   /* since start, over engine_busy_s (doc/PROTOCOL.md) */
    uint64_t prefill_tokens_total; /* prompt tokens run through the model (restored ones are not) */
    uint64_t prefill_chunks_total; /* the backend calls that ran them */
    double decode_tokens_per_s;
    uint64_t device_arena_bytes;
    uint64_t device_arena_used;
    uint64_t heap_allocated;       /* jemalloc stats.allocated, request arena included */
    uint64_t heap_active;
    uint64_t heap_resident;
    uint64_t heap_mapped;
    uint64_t device_allocs_after_boot;   /* must stay 0 */
    uint64_t graph_captures_after_boot;  /* must stay 0 */
    uint64_t eager_steps;                /* steps launched outside the boot's graphs (long prefill chunks) */
    uint64_t steps;                /* engine steps that did work (prefill or decode) */
    uint64_t decode_steps;         /* steps that decoded at least one sequence */
    uint32_t n_batch_hist;         /* wire: "batch_size_hist", an array of uint */
    uint64_t batch_hist[DSV4_PROTO_MAX_BATCH_BUCKETS];   /* decode steps per batch size, buckets above */
    uint64_t sched_allocations;    /* heap allocations the scheduler made since it was created */
    uint64_t sched_allocations_after_boot;   /* must stay 0 */
    uint64_t prefix_cache_bytes;   /* the prefix-cache pool; 0 = off */
    uint64_t prefix_cache_used_bytes;
    uint64_t prefix_cache_tokens;  /* tokens whose compressed entries the pool holds */
    uint64_t prefix_cache_snapshots;   /* block boundaries a request can continue from */
    uint64_t prefix_cache_lookups; /* requests that consulted it */
    uint64_t prefix_cache_hits;    /* of those, requests that restored a prefix */
    uint64_t prefix_cache_hit_tokens;  /* prompt tokens restored rather than prefilled */
    uint64_t prefix_cache_evictions;   /* snapshots evicted to make room */
    uint32_t spec_tokens;          /* speculative decoding: drafts per step, 0 = off */
    uint64_t spec_verifies;        /* verifies that had drafts */
    uint64_t spec_drafted;
    uint64_t spec_accepted;
    uint32_t n_spec_hist;          /* wire: "spec_accept_hist", an array of uint */
    uint64_t spec_hist[DSV4_PROTO_MAX_SPEC_BUCKETS];     /* verifies that accepted 0, 1, ... drafts */
    double engine_busy_s;          /* seconds inside engine steps that did work */
    double engine_backend_s;       /* of those, inside backend calls (the rest: the steps' host work) */
    double engine_gap_s;           /* between a step that left requests running and the next one */
    /* Latency histograms of the requests that got a slot (doc/PROTOCOL.md): wire "latency_bounds_s",
     * increasing positive seconds, and "queue_hist", "ttft_hist", "tpot_hist", "e2e_hist"; each with
     * its count (the sum of its buckets) and its seconds summed. */
    uint32_t n_latency_bounds;
    double latency_bounds_s[DSV4_PROTO_MAX_LATENCY_BOUNDS];
    struct dsv4_proto_latency queue_hist, ttft_hist, tpot_hist, e2e_hist;
    uint64_t queue_count, ttft_count, tpot_count, e2e_count;
    double queue_sum_s, ttft_sum_s, tpot_sum_s, e2e_sum_s;
    uint32_t n_kernels;
    char *kernels[DSV4_PROTO_MAX_KERNELS];   /* kernel variants in use */
    uint64_t present;              /* decoded: which numeric keys the map held (dsv4_proto_stats_has) */
};

int dsv4_proto_encode_stats_result(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_stats *st);
int dsv4_proto_decode_stats_result(const struct dsv4_proto_message *msg, struct dsv4_proto_stats *st,
                                   struct dsv4_proto_error *err);
void dsv4_proto_stats_clear(struct dsv4_proto_stats *st);
/* Whether a decoded stats result held the numeric key (one of the struct's numeric fields or
 * histograms, by its wire name): a server older than the key leaves it out, and it reads 0 then,
 * which is not the same. */
bool dsv4_proto_stats_has(const struct dsv4_proto_stats *st, const char *key);

enum dsv4_proto_health_status {
    DSV4_PROTO_HEALTH_READY = 0,
    DSV4_PROTO_HEALTH_LOADING,
    DSV4_PROTO_HEALTH_DRAINING,
    DSV4_PROTO_HEALTH_FAILED,      /* the engine failed for good; the server is exiting (to be restarted) */
    DSV4_PROTO_HEALTH_UNKNOWN,     /* decoded only: a status added after this build, which means not ready */
};

/* "ready", "loading", "draining"; and back (-1 for an unknown name). */
const char *dsv4_proto_health_name(enum dsv4_proto_health_status s);
int dsv4_proto_health_from_name(const char *name);

struct dsv4_proto_health {
    enum dsv4_proto_health_status status;
    char *reason;                  /* "uploading weights 41%", "SIGTERM, 2 requests left"; may be NULL */
};

int dsv4_proto_encode_health_result(struct dsv4_proto_buf *out, uint32_t msgid, const struct dsv4_proto_health *h);
int dsv4_proto_decode_health_result(const struct dsv4_proto_message *msg, struct dsv4_proto_health *h,
                                    struct dsv4_proto_error *err);
void dsv4_proto_health_clear(struct dsv4_proto_health *h);

#endif
