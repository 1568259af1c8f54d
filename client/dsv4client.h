/* SPDX-License-Identifier: MIT */
/* libdsv4client: talk to the dsv4d inference daemon over its Unix socket.
 *
 *   struct dsv4_client *c = dsv4_client_new();
 *   if (dsv4_client_connect(c, NULL, 5000) < 0) { fprintf(stderr, "%s\n", dsv4_client_error_message(c)); ... }
 *   struct dsv4_client_generate_params p;
 *   dsv4_client_generate_params_init(&p);
 *   p.prompt = "The capital of France is";
 *   p.max_tokens = 16;
 *   struct dsv4_client_result r;
 *   if (dsv4_client_generate(c, &p, &r) == 0) { fwrite(r.text, 1, r.text_len, stdout); dsv4_client_result_clear(&r); }
 *   dsv4_client_close(c);
 *
 * Errors: every function returns 0 or a negative errno value:
 *   -EREMOTEIO  the server answered with an error: dsv4_client_server_code() gives its protocol code
 *               (doc/PROTOCOL.md, e.g. 301 prompt_too_long) and dsv4_client_error_message() its message;
 *   -ETIMEDOUT  no answer within the timeout; -ECONNREFUSED, -ENOENT, -EACCES: connect failed;
 *   -ECONNRESET the server closed the connection; -EPROTO the server sent something malformed;
 *   -EINVAL     bad arguments (message says which); -ENOMEM; -ENOTCONN not connected.
 * After any failure but -EREMOTEIO and -EINVAL the connection is closed; connect again to continue.
 *
 * Thread safety: a handle is used by one thread at a time, with one exception: dsv4_client_cancel() may
 * be called from any thread (or from a signal-handling thread, or from inside the token callback) while
 * another thread is inside dsv4_client_generate*() on the same handle (it must not race with
 * dsv4_client_close(): stop calling it before closing). Different handles are
 * independent. The library keeps no global state and installs no signal handlers; it writes with
 * MSG_NOSIGNAL, so a closed server never raises SIGPIPE. Strings in and out are UTF-8.
 *
 * Compatibility: the caller allocates every struct this header defines, so a field added to one (always
 * at its end) changes the ABI as a changed signature does. Each such change raises DSV4_CLIENT_ABI, the
 * N of the library's soname libdsv4client.so.N, so a program built against an older header keeps
 * loading the library it was built for. Stats keys a server leaves out read as 0 and are told apart
 * with dsv4_client_stats_has; the protocol version is negotiated by dsv4_client_hello. */
#ifndef DSV4CLIENT_H
#define DSV4CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI this header describes (above): libdsv4client.so.2. */
#define DSV4_CLIENT_ABI 2

/* Where dsv4_client_connect(c, NULL, ...) looks when $DSV4_SOCKET is unset or empty. */
#define DSV4_CLIENT_DEFAULT_SOCKET "/run/dsv4d/dsv4d.sock"
#define DSV4_CLIENT_SOCKET_ENV "DSV4_SOCKET"
/* Top alternatives a token may carry (the protocol's limit). */
#define DSV4_CLIENT_MAX_LOGPROBS 20
#define DSV4_CLIENT_MAX_STOP 16
#define DSV4_CLIENT_MAX_STOP_TOKEN_IDS 64

struct dsv4_client;

/* NULL when out of memory or file descriptors (a handle holds one besides its connection's). */
struct dsv4_client *dsv4_client_new(void);
/* Closes the connection and frees everything; accepts NULL. */
void dsv4_client_close(struct dsv4_client *c);

/* Connect to path (NULL: $DSV4_SOCKET, then DSV4_CLIENT_DEFAULT_SOCKET), waiting at most timeout_ms
 * (<= 0: no limit). A handle holds one connection: connecting again closes the previous one. */
int dsv4_client_connect(struct dsv4_client *c, const char *path, int timeout_ms);
/* Use an already connected stream socket (a socketpair in tests, an inherited fd); takes ownership of
 * fd, even on failure. */
int dsv4_client_connect_fd(struct dsv4_client *c, int fd);

/* How long to wait for each frame of an answer, from when the wait for it starts until its last byte
 * (a streaming request waits this long per token, so a long generation never times out while tokens
 * flow); <= 0, the default, waits forever. */
void dsv4_client_set_timeout(struct dsv4_client *c, int timeout_ms);

/* The last error's message ("" when none) and, after -EREMOTEIO, the server's protocol code (else 0).
 * Valid until the next call on the handle from the thread that uses it. */
const char *dsv4_client_error_message(const struct dsv4_client *c);
int dsv4_client_server_code(const struct dsv4_client *c);
/* Stable name of a server protocol code ("prompt_too_long"), "unknown" for others. */
const char *dsv4_client_code_name(int code);

/* ---- hello ---- */

struct dsv4_client_info {
    uint32_t protocol;          /* negotiated version */
    const char *server;         /* "dsv4d 0.1.0" */
    const char *model_name;
    uint32_t vocab_size;
    uint32_t hidden_size;
    uint32_t num_layers;
    uint32_t num_heads;
    uint32_t head_dim;
    uint32_t n_routed_experts;
    uint32_t experts_per_token;
    int32_t bos_id;             /* -1 when none */
    int32_t eos_id;
    uint32_t max_context;
    uint32_t max_batch;
    const char *backend;        /* "cpu", "cuda" */
    /* server limits, 0 = none */
    uint32_t max_frame;
    uint32_t max_prompt_tokens;
    uint32_t max_tokens;
    uint32_t max_connections;
    uint32_t max_queue;
    uint32_t max_requests_per_connection;
};

/* Negotiate the protocol version and fetch the server's description. *ret (may be NULL) is owned by the
 * handle and valid until the next hello or close. Optional: the other calls work without it. The
 * server answers hello in every state (loading and draining too); model numbers may be 0 while it
 * loads. */
int dsv4_client_hello(struct dsv4_client *c, const struct dsv4_client_info **ret);
/* The description of the last successful hello, or NULL. */
const struct dsv4_client_info *dsv4_client_info(const struct dsv4_client *c);

/* ---- generate ---- */

struct dsv4_client_message {
    const char *role;           /* "system", "user", "assistant" */
    const char *content;
};

/* Exactly one prompt source: prompt, messages (chat format), tokens or prompt_parts. Numbers left at the values
 * dsv4_client_generate_params_init() sets are the protocol's defaults (doc/PROTOCOL.md). */
struct dsv4_client_generate_params {
    const char *prompt;         /* raw completion */
    bool add_bos;               /* prompt only: prepend BOS (default true) */
    const struct dsv4_client_message *messages;
    size_t n_messages;
    bool thinking;              /* messages only: reasoning mode */
    const int32_t *tokens;      /* token-id prompt */
    size_t n_tokens;
    /* A prompt the caller renders itself (protocol 2): the parts are tokenized as one text; tags such
     * as <｜User｜> are recognised only in even-indexed parts (the caller's template), never in
     * odd-indexed ones (message text). Lengths in bytes, both arrays n_prompt_parts long. add_bos
     * applies as to prompt. */
    const char *const *prompt_parts;
    const size_t *prompt_part_lens;
    size_t n_prompt_parts;

    uint32_t max_tokens;        /* 0: the server's default */
    float temperature;          /* [0, 10], 0 greedy; default 1 */
    float top_p;                /* [0, 1]; default 1 */
    int32_t top_k;              /* 0 disables; default 0 */
    float min_p;                /* [0, 1]; default 0 */
    float presence_penalty;     /* [-2, 2]; default 0 */
    float frequency_penalty;    /* [-2, 2]; default 0 */
    float repetition_penalty;   /* (0, 10]; default 1 */
    bool has_seed;
    uint64_t seed;
    const char *const *stop;    /* up to DSV4_CLIENT_MAX_STOP strings */
    size_t n_stop;
    const int32_t *stop_token_ids;
    size_t n_stop_token_ids;
    int logprobs;               /* -1 off (default); 0..20: chosen token's logprob + that many top */
};

void dsv4_client_generate_params_init(struct dsv4_client_generate_params *p);

enum dsv4_client_finish {
    DSV4_CLIENT_FINISH_STOP = 0,
    DSV4_CLIENT_FINISH_LENGTH,
    DSV4_CLIENT_FINISH_CANCELLED,
    DSV4_CLIENT_FINISH_ERROR,
};

/* "stop", "length", "cancelled", "error". */
const char *dsv4_client_finish_name(enum dsv4_client_finish f);

struct dsv4_client_logprob {
    float logprob;
    size_t n_top;
    int32_t top_ids[DSV4_CLIENT_MAX_LOGPROBS];
    float top_logprobs[DSV4_CLIENT_MAX_LOGPROBS];
};

struct dsv4_client_result {
    char *text;                 /* NUL-terminated, text_len bytes */
    size_t text_len;
    int32_t *tokens;            /* generated ids */
    size_t n_tokens;
    enum dsv4_client_finish finish_reason;
    char *error_message;        /* FINISH_ERROR: why; else NULL */
    uint32_t prompt_tokens;
    uint32_t completion_tokens;
    double queue_ms, prefill_ms, decode_ms, total_ms;
    struct dsv4_client_logprob *logprobs;   /* n_tokens entries when requested, else NULL */
    double decode_tokens_per_s;  /* (completion_tokens - 1) / decode time; 0 when fewer than 2 tokens */
    uint32_t cached_tokens;     /* of prompt_tokens, those restored from the prefix cache (not prefilled) */
};

/* Frees the result's memory; accepts NULL. */
void dsv4_client_result_clear(struct dsv4_client_result *r);

/* One streamed token; valid only during the callback. */
struct dsv4_client_token {
    int32_t id;
    const char *text;           /* UTF-8 delta, possibly "" */
    size_t text_len;
    const struct dsv4_client_logprob *logprob;   /* NULL unless requested */
};

/* Return 0 to continue, non-zero to cancel the request (its result then ends "cancelled"). */
typedef int (*dsv4_client_token_fn)(const struct dsv4_client_token *tok, void *user);

/* Blocking: returns when the whole result is there. A cancelled or failed generation is still a
 * success of the call (0): look at res->finish_reason. */
int dsv4_client_generate(struct dsv4_client *c, const struct dsv4_client_generate_params *p,
                         struct dsv4_client_result *res);
/* Streaming: on_token runs on the calling thread for each token as it arrives, then res holds the
 * whole result (the deltas concatenate to res->text). */
int dsv4_client_generate_stream(struct dsv4_client *c, const struct dsv4_client_generate_params *p,
                                dsv4_client_token_fn on_token, void *user, struct dsv4_client_result *res);

/* Ask the server to stop the generation in progress on this handle. Any thread; returns without
 * waiting, even for a server that reads nothing: the generate call's thread writes the cancel (the
 * call returns with finish_reason "cancelled", or with what had finished). Any time during a generate
 * call counts: a cancel that comes before the request is on the wire is sent right after it; one that
 * comes while the request waits for room to be written ends the call at once with finish_reason
 * "cancelled" and no tokens, and closes the connection if part of the request was written. Outside a
 * generate call it does nothing. 0, or a negative errno when the generate call could not be woken. A
 * cancel that cannot be written (within the timeout) closes the connection like any failure: the
 * generate call then returns that error, with a message saying so, unless its whole result had
 * already arrived. */
int dsv4_client_cancel(struct dsv4_client *c);

/* ---- tokens ---- */

/* Token ids generate would see for text (add_bos as in generate). *ret_tokens is malloc'd: free(). */
int dsv4_client_tokenize(struct dsv4_client *c, const char *text, bool add_bos, int32_t **ret_tokens,
                         size_t *ret_n);
/* The same for a chat. */
int dsv4_client_tokenize_chat(struct dsv4_client *c, const struct dsv4_client_message *messages, size_t n,
                              bool thinking, int32_t **ret_tokens, size_t *ret_n);
/* Text of token ids (invalid byte sequences become U+FFFD). *ret_text is malloc'd, NUL-terminated: free(). */
int dsv4_client_detokenize(struct dsv4_client *c, const int32_t *tokens, size_t n, char **ret_text,
                           size_t *ret_len);

/* ---- stats, health ---- */

#define DSV4_CLIENT_MAX_KERNELS 64
/* Bytes of one kernel line, the protocol's limit on names: a CUDA server's lines run past 100. */
#define DSV4_CLIENT_MAX_KERNEL_NAME 256
/* Decode batch-size histogram buckets: batches of 1, 2, 3-4, 5-8, ..., (2^(i-1), 2^i]; the last one
 * the server sends also counts everything larger. */
#define DSV4_CLIENT_MAX_BATCH_BUCKETS 32
#define DSV4_CLIENT_MAX_SPEC_BUCKETS 16
/* Latency histogram buckets: the server's bucket bounds (at most 63) and one more above them. */
#define DSV4_CLIENT_MAX_LATENCY_BUCKETS 64

/* One latency histogram (doc/PROTOCOL.md, stats): buckets[i] counts the requests whose seconds v have
 * latency_bounds_s[i - 1] < v <= latency_bounds_s[i], per bucket (not cumulative); the last bucket,
 * those above every bound. */
struct dsv4_client_latency {
    size_t n_buckets;               /* n_latency_bounds + 1; 0 from a server older than the histograms */
    uint64_t buckets[DSV4_CLIENT_MAX_LATENCY_BUCKETS];
    uint64_t count;                 /* requests observed: the buckets' sum */
    double sum_s;                   /* their seconds; sum_s / count is the mean */
};

struct dsv4_client_stats {
    double uptime_s;
    char backend[64];
    uint32_t slots_total, slots_busy, queue_depth, connections;
    uint64_t requests_total, requests_failed, requests_cancelled;
    uint64_t prompt_tokens_total, generated_tokens_total;
    double prefill_tokens_per_s, decode_tokens_per_s;
    /* prompt tokens run through the model (restored from the prefix cache: not), and the backend
     * calls that ran them: their ratio is the mean prefill chunk */
    uint64_t prefill_tokens_total, prefill_chunks_total;
    uint64_t device_arena_bytes, device_arena_used;
    uint64_t heap_allocated, heap_active, heap_resident, heap_mapped;
    uint64_t device_allocs_after_boot, graph_captures_after_boot;
    uint64_t eager_steps;                    /* steps launched outside the boot's graphs (long prefill chunks) */
    size_t n_kernels;
    char kernels[DSV4_CLIENT_MAX_KERNELS][DSV4_CLIENT_MAX_KERNEL_NAME + 1];
    uint64_t steps, decode_steps;            /* engine steps that did work; those that decoded */
    size_t n_batch_hist;                     /* 0 until the engine runs */
    uint64_t batch_hist[DSV4_CLIENT_MAX_BATCH_BUCKETS];   /* decode steps per bucket; they sum to decode_steps */
    uint64_t sched_allocations;              /* the scheduler's heap allocations since it was created */
    uint64_t sched_allocations_after_boot;   /* stays 0 once ready */
    /* The prefix cache (0 when off): its pool, what it holds, how it served. */
    uint64_t prefix_cache_bytes, prefix_cache_used_bytes;
    uint64_t prefix_cache_tokens;            /* tokens whose compressed entries are held */
    uint64_t prefix_cache_snapshots;         /* block boundaries a request can continue from */
    uint64_t prefix_cache_lookups, prefix_cache_hits, prefix_cache_hit_tokens;
    uint64_t prefix_cache_evictions;         /* snapshots evicted */
    /* Speculative decoding (spec_tokens 0: off): verifies that had drafts, drafts made and accepted,
     * and spec_hist[a]: verifies that accepted a drafts (a = 0 .. spec_tokens). */
    uint32_t spec_tokens;
    uint64_t spec_verifies, spec_drafted, spec_accepted;
    size_t n_spec_hist;
    uint64_t spec_hist[DSV4_CLIENT_MAX_SPEC_BUCKETS];
    /* Where the engine's time goes: seconds inside steps that did work; of those, inside the backend
     * (the rest is the steps' host work: scheduling, host sampling, text); and between a step that
     * left requests running and the next (the loop's own time). 0 from a server that predates them. */
    double engine_busy_s, engine_backend_s, engine_gap_s;
    uint64_t present;                        /* which keys the server sent: read it through dsv4_client_stats_has */
    /* Latency of each generate request that got a slot, observed as it finishes (doc/PROTOCOL.md says
     * which): queue, submitted -> admitted into a slot; ttft, submitted -> first token; tpot, its mean
     * time per token after the first; e2e, submitted -> finished. Bucket bounds in seconds, shared by
     * the four; none (n_latency_bounds 0) from a server older than them. */
    size_t n_latency_bounds;
    double latency_bounds_s[DSV4_CLIENT_MAX_LATENCY_BUCKETS - 1];
    struct dsv4_client_latency queue, ttft, tpot, e2e;
};

int dsv4_client_stats(struct dsv4_client *c, struct dsv4_client_stats *ret);
/* Whether the server sent the numeric stats key or histogram (its name in doc/PROTOCOL.md, e.g.
 * "prefix_cache_hits", "ttft_hist"): a server older than the key leaves it out and the field reads 0,
 * which is not a count of 0. */
bool dsv4_client_stats_has(const struct dsv4_client_stats *st, const char *key);

enum dsv4_client_health_status {
    DSV4_CLIENT_HEALTH_READY = 0,
    DSV4_CLIENT_HEALTH_LOADING,
    DSV4_CLIENT_HEALTH_DRAINING,
    DSV4_CLIENT_HEALTH_FAILED,      /* the engine failed; the daemon exits and systemd restarts it */
    DSV4_CLIENT_HEALTH_UNKNOWN,     /* a status newer than this library (the reason says more): not ready */
};

struct dsv4_client_health {
    enum dsv4_client_health_status status;
    char reason[256];
};

/* "ready", "loading", "draining", "failed", "unknown". */
const char *dsv4_client_health_name(enum dsv4_client_health_status s);
int dsv4_client_health(struct dsv4_client *c, struct dsv4_client_health *ret);

#ifdef __cplusplus
}
#endif

#endif
