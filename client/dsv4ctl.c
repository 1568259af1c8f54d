/* SPDX-License-Identifier: MIT */
/* dsv4ctl: the dsv4d daemon from the shell (generate, info, stats, health, tokenize, detokenize,
 * bench).
 * Exit codes are documented in doc/dsv4ctl.1 and in usage(); scripts rely on them. */
#include "build-config.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "client/ctl_bench.h"
#include "client/dsv4client.h"

enum exit_code {
    EXIT_OK = 0,
    EXIT_REJECTED = 1,      /* the server answered the request with an error */
    EXIT_USAGE = 2,
    EXIT_CONNECT = 3,       /* no connection to the socket */
    EXIT_CONNECTION = 4,    /* connection lost, timeout, malformed answer */
    EXIT_NOT_READY = 5,     /* health: any status but ready */
    EXIT_INCOMPLETE = 6,    /* generate ended with finish_reason error, or cancelled by the server */
    EXIT_INTERRUPTED = 130, /* generate cancelled by SIGINT or SIGTERM */
};

#define STDIN_MAX (64u << 20)
#define CONNECT_TIMEOUT_MS 5000
#define MAX_TOKEN_LIST (1u << 20)

struct options {
    const char *socket;
    int timeout_ms;          /* -1: per command default */
    bool json;
    int stream;              /* -1: default (on when stdout is a TTY) */
    bool verbose;
    bool chat;
    const char *system;
    bool think;
    bool no_bos;
    const char *tokens;
    struct dsv4_client_generate_params gp;
    const char *stop[DSV4_CLIENT_MAX_STOP];
    int32_t stop_ids[DSV4_CLIENT_MAX_STOP_TOKEN_IDS];
    struct ctl_bench_opts bench;
};

static const char *prog = "dsv4ctl";

static void usage(FILE *f)
{
    fprintf(f,
        "Usage: %s [OPTIONS] COMMAND [ARGS]\n"
        "Talk to the dsv4d inference daemon.\n"
        "\n"
        "Commands:\n"
        "  generate [PROMPT]     generate a completion (PROMPT from stdin when absent)\n"
        "  info                  server, model and limits (hello)\n"
        "  stats                 server statistics (a table, or --json)\n"
        "  health                ready, loading or draining; exit 0 only when ready\n"
        "  tokenize [TEXT]       token ids of TEXT (stdin when absent), comma-separated\n"
        "  detokenize [IDS]      text of comma-separated token ids (stdin when absent)\n"
        "  bench                 load generator: streamed requests at each concurrency, then TTFT,\n"
        "                        time per output token (median, p99) and output tokens/s, and where\n"
        "                        the daemon's engine spent the level (backend, host work, gaps)\n"
        "\n"
        "Bench options (the sampling options below apply too):\n"
        "      --concurrency LIST  client connections of each level, e.g. 1,16,64 (default 1)\n"
        "      --prompt-tokens N   random token ids per prompt (default 128)\n"
        "      --requests N        requests per level (default 4 per connection, at least 8)\n"
        "      --admit-tokens N    once a level's streams decode, admit an N-token prompt beside them and\n"
        "                        report its TTFT and the streams' token gaps meanwhile\n"
        "      --shared-prefix N   the first N ids of every prompt are the same (a system prompt): the\n"
        "                        report adds the tokens the prefix cache restored (N < prompt tokens)\n"
        "\n"
        "Common options:\n"
        "  -s, --socket PATH     daemon socket (default $DSV4_SOCKET, then %s)\n"
        "  -t, --timeout SEC     give up waiting for an answer after SEC seconds (0: never;\n"
        "                        default 0 for generate and bench, 30 otherwise)\n"
        "  -j, --json            JSON output (generate: JSON lines, the last one the result)\n"
        "  -v, --verbose         generate: usage and timings on stderr\n"
        "  -h, --help            this text\n"
        "  -V, --version         version\n"
        "\n"
        "Prompt options (generate, tokenize):\n"
        "      --tokens IDS      prompt as token ids, e.g. 5,17,9 (generate)\n"
        "      --chat            wrap the prompt as a user message in the chat format\n"
        "      --system TEXT     system message (implies --chat)\n"
        "      --think           thinking mode (implies --chat)\n"
        "      --no-bos          do not prepend BOS to a raw prompt\n"
        "\n"
        "Sampling options (generate; names as in the OpenAI API):\n"
        "  -n, --max-tokens N            tokens to generate (default: the server's)\n"
        "      --temperature F           0 to 10, 0 greedy (default 1)\n"
        "      --top-p F                 0 to 1 (default 1)\n"
        "      --top-k N                 0 disables (default 0)\n"
        "      --min-p F                 0 to 1 (default 0)\n"
        "      --presence-penalty F      -2 to 2 (default 0)\n"
        "      --frequency-penalty F     -2 to 2 (default 0)\n"
        "      --repetition-penalty F    above 0, up to 10 (default 1)\n"
        "      --seed N                  sampling seed, decimal (default: the server picks one)\n"
        "      --stop TEXT               stop string, repeatable (up to %d)\n"
        "      --stop-token-ids IDS      comma-separated ids that stop generation\n"
        "      --logprobs N              log-probabilities with N top alternatives (0 to 20)\n"
        "      --stream, --no-stream     print tokens as they come (default on a terminal)\n"
        "\n"
        "Exit status:\n"
        "  0    success (health: ready)\n"
        "  1    the server rejected the request (its error code and message on stderr)\n"
        "  2    usage error\n"
        "  3    cannot connect to the socket\n"
        "  4    connection lost, timed out, or a malformed answer\n"
        "  5    health: the server is not ready (loading, draining, failed, or a status unknown to dsv4ctl)\n"
        "  6    generate: finished with finish_reason error, or cancelled by the server\n"
        "  130  generate: cancelled by SIGINT or SIGTERM (the partial result is printed)\n",
        prog, DSV4_CLIENT_DEFAULT_SOCKET, DSV4_CLIENT_MAX_STOP);
}

static void die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void die_usage(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry '%s --help'.\n", prog);
    exit(EXIT_USAGE);
}

static double parse_double(const char *opt, const char *s)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        die_usage("%s: '%s' is not a number", opt, s);
    return v;
}

static long long parse_int(const char *opt, const char *s, long long lo, long long hi)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        die_usage("%s: '%s' is not an integer in [%lld, %lld]", opt, s, lo, hi);
    return v;
}

static uint64_t parse_u64(const char *opt, const char *s)
{
    char *end;
    errno = 0;
    /* strtoull skips white space and negates after a '-': " -1" would come back as 2^64 - 1 */
    if (strchr(s, '-'))
        die_usage("%s: '%s' must not be negative", opt, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end)
        die_usage("%s: '%s' is not an unsigned integer", opt, s);
    return v;
}

/* "5,17,9" (ids separated by a comma and/or white space, as dsv4-run --encode prints them) into a
 * malloc'd array. An empty entry ("5,,9", a leading or trailing comma) is refused: a typo, not an id.
 * what names an entry in the messages ("token id"; --concurrency's are connection counts). */
static int32_t *parse_ids(const char *opt, const char *what, const char *s, size_t *ret_n)
{
    size_t n = 0, cap = 64;
    int32_t *ids = malloc(cap * sizeof(*ids));
    if (!ids)
        die_usage("out of memory");
    const char *p = s;
    bool after_comma = false;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
            p++;
        /* ids is freed before each refusal: exit() leaves it unreachable, a leak to LeakSanitizer */
        if (*p == ',' || (!*p && after_comma)) {
            free(ids);
            die_usage("%s: an empty entry at byte %zu of '%.40s' (%ss are separated by one comma)", opt,
                      (size_t)(p - s), s, what);
        }
        if (!*p)
            break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && !strchr(", \t\r\n", *end))) {
            free(ids);
            die_usage("%s: '%.20s' is not a %s", opt, p, what);
        }
        if (n == cap) {
            if (cap >= MAX_TOKEN_LIST) {
                free(ids);
                die_usage("%s: more than %u %ss", opt, MAX_TOKEN_LIST, what);
            }
            cap *= 2;
            int32_t *g = realloc(ids, cap * sizeof(*ids));
            if (!g) {
                free(ids);
                die_usage("out of memory");
            }
            ids = g;
        }
        ids[n++] = (int32_t)v;
        p = end;
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
            p++;
        after_comma = *p == ',';
        if (after_comma)
            p++;
    }
    if (n == 0)
        die_usage("%s: no %ss", opt, what);
    *ret_n = n;
    return ids;
}

static char *read_stdin(void)
{
    size_t n = 0, cap = 4096;
    char *buf = malloc(cap);
    if (!buf)
        die_usage("out of memory");
    for (;;) {
        if (cap - n < 2) {
            if (cap >= STDIN_MAX)
                die_usage("stdin holds more than %u bytes", STDIN_MAX);
            cap *= 2;
            char *g = realloc(buf, cap);
            if (!g)
                die_usage("out of memory");
            buf = g;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, stdin);
        n += got;
        if (got == 0) {
            if (ferror(stdin))
                die_usage("reading stdin: %s", strerror(errno));
            break;
        }
    }
    buf[n] = '\0';
    if (strlen(buf) != n)
        die_usage("stdin contains a NUL byte");
    /* The one newline `echo` ends its line with is not part of the prompt (as the shell's $(...) drops it). */
    if (n && buf[n - 1] == '\n')
        buf[--n] = '\0';
    return buf;
}

/* Exit status for a failed library call, with the message on stderr. */
static int report(struct dsv4_client *c, int rc)
{
    fprintf(stderr, "%s: %s\n", prog, dsv4_client_error_message(c));
    if (rc == -EREMOTEIO)
        return EXIT_REJECTED;
    if (rc == -EINVAL)
        return EXIT_USAGE;
    return EXIT_CONNECTION;
}

static void print_json(json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    if (s) {
        fputs(s, stdout);
        fputc('\n', stdout);
        free(s);
    }
    json_decref(j);
    fflush(stdout);
}

/* JSON has no infinities: a -inf log-probability, or any number a server sent as an infinity, prints
 * as null (jansson refuses to make a real of it, and one refused value loses the whole object). */
static json_t *json_number(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static json_t *json_top(const struct dsv4_client_logprob *lp)
{
    json_t *a = json_array();
    for (size_t i = 0; i < lp->n_top; i++)
        json_array_append_new(a, json_pack("[io]", (int)lp->top_ids[i], json_number(lp->top_logprobs[i])));
    return a;
}

/* ---- generate ---- */

/* The handle the signal thread may cancel; NULL once the generation returned (guarded by the lock,
 * so the handle is never used after dsv4_client_close). */
static pthread_mutex_t signal_lock = PTHREAD_MUTEX_INITIALIZER;
static struct dsv4_client *signal_client;
static atomic_bool interrupted;

/* Blocks on SIGINT/SIGTERM (blocked in every other thread): the first cancels the generation, which
 * then returns its partial result; the second gives up at once. */
static void *signal_thread(void *arg)
{
    sigset_t *set = arg;
    for (;;) {
        int sig;
        if (sigwait(set, &sig) != 0)
            continue;
        if (atomic_exchange(&interrupted, true))
            _exit(EXIT_INTERRUPTED);
        pthread_mutex_lock(&signal_lock);
        if (signal_client)
            dsv4_client_cancel(signal_client);
        pthread_mutex_unlock(&signal_lock);
    }
    return NULL;
}

struct stream_state {
    bool json;
};

static int on_token(const struct dsv4_client_token *t, void *user)
{
    struct stream_state *s = user;
    if (s->json) {
        json_t *j = json_pack("{s:i,s:s%}", "token", (int)t->id, "text", t->text, t->text_len);
        if (t->logprob) {
            json_object_set_new(j, "logprob", json_number(t->logprob->logprob));
            json_object_set_new(j, "top_logprobs", json_top(t->logprob));
        }
        print_json(j);
    } else {
        fwrite(t->text, 1, t->text_len, stdout);
        fflush(stdout);
    }
    return 0;
}

static json_t *json_result(const struct dsv4_client_result *r)
{
    json_t *tokens = json_array();
    for (size_t i = 0; i < r->n_tokens; i++)
        json_array_append_new(tokens, json_integer(r->tokens[i]));
    json_t *j = json_pack("{s:s%,s:o,s:s,s:{s:i,s:i,s:I,s:i},s:{s:o,s:o,s:o,s:o,s:o}}",
                          "text", r->text, r->text_len,
                          "tokens", tokens,
                          "finish_reason", dsv4_client_finish_name(r->finish_reason),
                          "usage", "prompt_tokens", (int)r->prompt_tokens, "completion_tokens",
                          (int)r->completion_tokens, "total_tokens",
                          (json_int_t)r->prompt_tokens + r->completion_tokens, "cached_tokens", (int)r->cached_tokens,
                          "timings", "queue_ms", json_number(r->queue_ms), "prefill_ms", json_number(r->prefill_ms),
                          "decode_ms", json_number(r->decode_ms), "total_ms", json_number(r->total_ms),
                          "decode_tokens_per_s", json_number(r->decode_tokens_per_s));
    if (r->error_message)
        json_object_set_new(j, "error", json_string(r->error_message));
    if (r->logprobs) {
        json_t *lp = json_array();
        for (size_t i = 0; i < r->n_tokens; i++)
            json_array_append_new(lp, json_pack("{s:o,s:o}", "logprob", json_number(r->logprobs[i].logprob),
                                                "top_logprobs", json_top(&r->logprobs[i])));
        json_object_set_new(j, "logprobs", lp);
    }
    return j;
}

/* messages for --chat / --system / --think */
static size_t chat_messages(const struct options *o, const char *prompt, struct dsv4_client_message m[2])
{
    size_t n = 0;
    if (o->system)
        m[n++] = (struct dsv4_client_message){ "system", o->system };
    m[n++] = (struct dsv4_client_message){ "user", prompt };
    return n;
}

static int cmd_generate(struct dsv4_client *c, struct options *o, int argc, char **argv)
{
    struct dsv4_client_generate_params *p = &o->gp;
    struct dsv4_client_message msgs[2];
    char *owned = NULL;
    int32_t *ids = NULL;
    if (argc > 1)
        die_usage("generate takes one PROMPT argument (quote it)");
    if (o->tokens) {
        if (argc == 1)
            die_usage("generate: give PROMPT or --tokens, not both");
        if (o->chat)
            die_usage("generate: --tokens cannot be combined with --chat, --system or --think");
        ids = parse_ids("--tokens", "token id", o->tokens, &p->n_tokens);
        p->tokens = ids;
    } else {
        const char *prompt = argc == 1 ? argv[0] : (owned = read_stdin());
        if (o->chat) {
            p->messages = msgs;
            p->n_messages = chat_messages(o, prompt, msgs);
            p->thinking = o->think;
        } else {
            p->prompt = prompt;
            p->add_bos = !o->no_bos;
        }
    }
    bool stream = o->stream < 0 ? isatty(STDOUT_FILENO) : o->stream;

    /* SIGINT/SIGTERM cancel the request from a thread of their own (the library allows it) */
    static sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    pthread_mutex_lock(&signal_lock);
    signal_client = c;
    pthread_mutex_unlock(&signal_lock);
    pthread_t th;
    bool have_thread = pthread_create(&th, NULL, signal_thread, &set) == 0;
    if (have_thread)
        pthread_detach(th);

    struct dsv4_client_result r;
    struct stream_state ss = { o->json };
    int rc = stream ? dsv4_client_generate_stream(c, p, on_token, &ss, &r) : dsv4_client_generate(c, p, &r);
    pthread_mutex_lock(&signal_lock);
    signal_client = NULL;
    pthread_mutex_unlock(&signal_lock);
    free(owned);
    free(ids);
    if (rc < 0)
        return report(c, rc);
    if (o->json) {
        print_json(json_result(&r));
    } else {
        if (!stream)
            fwrite(r.text, 1, r.text_len, stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    if (o->verbose) {
        fprintf(stderr, "finish: %s; prompt %u tokens (%u cached), generated %u; queue %.1f ms, prefill %.1f ms, "
                "decode %.1f ms (%.1f tokens/s), total %.1f ms\n", dsv4_client_finish_name(r.finish_reason),
                r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.queue_ms, r.prefill_ms, r.decode_ms,
                r.decode_tokens_per_s, r.total_ms);
    }
    int status = EXIT_OK;
    if (r.finish_reason == DSV4_CLIENT_FINISH_ERROR) {
        fprintf(stderr, "%s: generation failed: %s\n", prog, r.error_message ? r.error_message : "unknown error");
        status = EXIT_INCOMPLETE;
    } else if (r.finish_reason == DSV4_CLIENT_FINISH_CANCELLED) {
        status = atomic_load(&interrupted) ? EXIT_INTERRUPTED : EXIT_INCOMPLETE;
        if (status == EXIT_INCOMPLETE)
            fprintf(stderr, "%s: the server cancelled the generation\n", prog);
    }
    dsv4_client_result_clear(&r);
    return status;
}

/* ---- info, stats, health ---- */

static int cmd_info(struct dsv4_client *c, const struct options *o)
{
    const struct dsv4_client_info *i;
    int rc = dsv4_client_hello(c, &i);
    if (rc < 0)
        return report(c, rc);
    if (o->json) {
        print_json(json_pack("{s:i,s:s,s:s,s:{s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i},s:i,s:i,"
                             "s:{s:i,s:i,s:i,s:i,s:i,s:i}}",
                             "protocol", (int)i->protocol, "server", i->server, "backend", i->backend,
                             "model", "name", i->model_name, "vocab_size", (int)i->vocab_size, "hidden_size",
                             (int)i->hidden_size, "num_layers", (int)i->num_layers, "num_heads", (int)i->num_heads,
                             "head_dim", (int)i->head_dim, "n_routed_experts", (int)i->n_routed_experts,
                             "experts_per_token", (int)i->experts_per_token, "bos_id", (int)i->bos_id, "eos_id",
                             (int)i->eos_id, "max_context", (int)i->max_context, "max_batch", (int)i->max_batch,
                             "limits", "max_frame", (int)i->max_frame, "max_prompt_tokens", (int)i->max_prompt_tokens,
                             "max_tokens", (int)i->max_tokens, "max_connections", (int)i->max_connections,
                             "max_queue", (int)i->max_queue, "max_requests_per_connection",
                             (int)i->max_requests_per_connection));
        return EXIT_OK;
    }
    printf("%-28s %s\n", "server", i->server);
    printf("%-28s %u\n", "protocol", i->protocol);
    printf("%-28s %s\n", "backend", i->backend);
    printf("%-28s %s\n", "model", i->model_name);
    printf("%-28s %u\n", "vocab_size", i->vocab_size);
    printf("%-28s %u\n", "hidden_size", i->hidden_size);
    printf("%-28s %u\n", "num_layers", i->num_layers);
    printf("%-28s %u\n", "num_heads", i->num_heads);
    printf("%-28s %u\n", "head_dim", i->head_dim);
    printf("%-28s %u\n", "n_routed_experts", i->n_routed_experts);
    printf("%-28s %u\n", "experts_per_token", i->experts_per_token);
    printf("%-28s %d\n", "bos_id", i->bos_id);
    printf("%-28s %d\n", "eos_id", i->eos_id);
    printf("%-28s %u\n", "max_context", i->max_context);
    printf("%-28s %u\n", "max_batch", i->max_batch);
    printf("%-28s %u\n", "max_frame", i->max_frame);
    printf("%-28s %u\n", "max_prompt_tokens", i->max_prompt_tokens);
    printf("%-28s %u\n", "max_tokens", i->max_tokens);
    printf("%-28s %u\n", "max_connections", i->max_connections);
    printf("%-28s %u\n", "max_queue", i->max_queue);
    printf("%-28s %u\n", "max_requests_per_connection", i->max_requests_per_connection);
    return EXIT_OK;
}

/* "batch_size_hist 1", "batch_size_hist 3-4", "batch_size_hist 129+": bucket i holds batches of (2^(i-1), 2^i]. */
static void batch_bucket_label(size_t i, bool last, char *buf, size_t cap)
{
    unsigned long long lo = i == 0 ? 1 : (1ull << (i - 1)) + 1, hi = 1ull << i;
    if (last)
        snprintf(buf, cap, "batch_size_hist %llu+", lo);
    else if (lo == hi)
        snprintf(buf, cap, "batch_size_hist %llu", lo);
    else
        snprintf(buf, cap, "batch_size_hist %llu-%llu", lo, hi);
}

/* The latency histograms, in the order doc/PROTOCOL.md lists them. */
struct latency_row {
    const char *name;
    const struct dsv4_client_latency *h;
};

/* The q-th quantile (per mille) of h, estimated as the upper bound of the bucket holding that rank:
 * the smallest bound at or below which at least ceil(q * count) requests lie. Written to buf as a
 * number, or ">B" when the rank lies above the last bound B. h->count > 0. */
static void latency_quantile(const struct dsv4_client_stats *s, const struct dsv4_client_latency *h, unsigned q,
                             char *buf, size_t cap)
{
    /* ceil(count * q / 1000) without overflow */
    const uint64_t rank = h->count / 1000 * q + (h->count % 1000 * q + 999) / 1000;
    uint64_t below = 0;
    size_t i = 0;
    while (i + 1 < h->n_buckets && (below += h->buckets[i]) < rank)
        i++;
    if (i < s->n_latency_bounds)
        snprintf(buf, cap, "%g", s->latency_bounds_s[i]);
    else
        snprintf(buf, cap, ">%g", s->latency_bounds_s[s->n_latency_bounds - 1]);
}

static int cmd_stats(struct dsv4_client *c, const struct options *o)
{
    struct dsv4_client_stats s;
    int rc = dsv4_client_stats(c, &s);
    if (rc < 0)
        return report(c, rc);
    struct { const char *name; double f; uint64_t u; bool is_f; } rows[] = {
        { "uptime_s", s.uptime_s, 0, true },
        { "slots_total", 0, s.slots_total, false },
        { "slots_busy", 0, s.slots_busy, false },
        { "queue_depth", 0, s.queue_depth, false },
        { "connections", 0, s.connections, false },
        { "requests_total", 0, s.requests_total, false },
        { "requests_failed", 0, s.requests_failed, false },
        { "requests_cancelled", 0, s.requests_cancelled, false },
        { "prompt_tokens_total", 0, s.prompt_tokens_total, false },
        { "generated_tokens_total", 0, s.generated_tokens_total, false },
        { "prefill_tokens_per_s", s.prefill_tokens_per_s, 0, true },
        { "decode_tokens_per_s", s.decode_tokens_per_s, 0, true },
        { "prefill_tokens_total", 0, s.prefill_tokens_total, false },
        { "prefill_chunks_total", 0, s.prefill_chunks_total, false },
        { "device_arena_bytes", 0, s.device_arena_bytes, false },
        { "device_arena_used", 0, s.device_arena_used, false },
        { "heap_allocated", 0, s.heap_allocated, false },
        { "heap_active", 0, s.heap_active, false },
        { "heap_resident", 0, s.heap_resident, false },
        { "heap_mapped", 0, s.heap_mapped, false },
        { "device_allocs_after_boot", 0, s.device_allocs_after_boot, false },
        { "graph_captures_after_boot", 0, s.graph_captures_after_boot, false },
        { "eager_steps", 0, s.eager_steps, false },
        { "steps", 0, s.steps, false },
        { "decode_steps", 0, s.decode_steps, false },
        { "sched_allocations", 0, s.sched_allocations, false },
        { "sched_allocations_after_boot", 0, s.sched_allocations_after_boot, false },
        { "prefix_cache_bytes", 0, s.prefix_cache_bytes, false },
        { "prefix_cache_used_bytes", 0, s.prefix_cache_used_bytes, false },
        { "prefix_cache_tokens", 0, s.prefix_cache_tokens, false },
        { "prefix_cache_snapshots", 0, s.prefix_cache_snapshots, false },
        { "prefix_cache_lookups", 0, s.prefix_cache_lookups, false },
        { "prefix_cache_hits", 0, s.prefix_cache_hits, false },
        { "prefix_cache_hit_tokens", 0, s.prefix_cache_hit_tokens, false },
        { "prefix_cache_evictions", 0, s.prefix_cache_evictions, false },
        { "spec_tokens", 0, s.spec_tokens, false },
        { "spec_verifies", 0, s.spec_verifies, false },
        { "spec_drafted", 0, s.spec_drafted, false },
        { "spec_accepted", 0, s.spec_accepted, false },
        { "engine_busy_s", s.engine_busy_s, 0, true },
        { "engine_backend_s", s.engine_backend_s, 0, true },
        { "engine_gap_s", s.engine_gap_s, 0, true },
    };
    const struct latency_row lat[] = {
        { "queue", &s.queue }, { "ttft", &s.ttft }, { "tpot", &s.tpot }, { "e2e", &s.e2e },
    };
    if (o->json) {
        json_t *j = json_object();
        json_object_set_new(j, "backend", json_string(s.backend));
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
            if (dsv4_client_stats_has(&s, rows[i].name))
                json_object_set_new(j, rows[i].name,
                                    rows[i].is_f ? json_number(rows[i].f) : json_integer((json_int_t)rows[i].u));
        json_t *k = json_array();
        for (size_t i = 0; i < s.n_kernels; i++)
            json_array_append_new(k, json_string(s.kernels[i]));
        json_object_set_new(j, "kernels", k);
        json_t *h = json_array();
        for (size_t i = 0; i < s.n_batch_hist; i++)
            json_array_append_new(h, json_integer((json_int_t)s.batch_hist[i]));
        json_object_set_new(j, "batch_size_hist", h);
        json_t *sh = json_array();
        for (size_t i = 0; i < s.n_spec_hist; i++)
            json_array_append_new(sh, json_integer((json_int_t)s.spec_hist[i]));
        json_object_set_new(j, "spec_accept_hist", sh);
        if (dsv4_client_stats_has(&s, "latency_bounds_s")) {
            json_t *b = json_array();
            for (size_t i = 0; i < s.n_latency_bounds; i++)
                json_array_append_new(b, json_number(s.latency_bounds_s[i]));
            json_object_set_new(j, "latency_bounds_s", b);
        }
        for (size_t l = 0; l < sizeof(lat) / sizeof(lat[0]); l++) {
            char key[32];
            snprintf(key, sizeof(key), "%s_count", lat[l].name);
            if (dsv4_client_stats_has(&s, key))
                json_object_set_new(j, key, json_integer((json_int_t)lat[l].h->count));
            snprintf(key, sizeof(key), "%s_sum_s", lat[l].name);
            if (dsv4_client_stats_has(&s, key))
                json_object_set_new(j, key, json_number(lat[l].h->sum_s));
            snprintf(key, sizeof(key), "%s_hist", lat[l].name);
            if (!dsv4_client_stats_has(&s, key))
                continue;
            json_t *a = json_array();
            for (size_t i = 0; i < lat[l].h->n_buckets; i++)
                json_array_append_new(a, json_integer((json_int_t)lat[l].h->buckets[i]));
            json_object_set_new(j, key, a);
        }
        print_json(j);
        return EXIT_OK;
    }
    printf("%-28s %s\n", "backend", s.backend);
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        if (!dsv4_client_stats_has(&s, rows[i].name))
            continue;   /* a server older than the key: not a count of 0 */
        if (rows[i].is_f)
            printf("%-28s %.6g\n", rows[i].name, rows[i].f);
        else
            printf("%-28s %llu\n", rows[i].name, (unsigned long long)rows[i].u);
    }
    for (size_t i = 0; i < s.n_kernels; i++)
        printf("%-28s %s\n", i == 0 ? "kernels" : "", s.kernels[i]);
    for (size_t i = 0; i < s.n_batch_hist; i++) {
        char label[64];
        batch_bucket_label(i, i + 1 == s.n_batch_hist, label, sizeof(label));
        printf("%-28s %llu\n", label, (unsigned long long)s.batch_hist[i]);
    }
    for (size_t i = 0; i < s.n_spec_hist; i++) {
        char label[64];
        snprintf(label, sizeof(label), "verifies accepting %zu draft%s", i, i == 1 ? "" : "s");
        printf("%-28s %llu\n", label, (unsigned long long)s.spec_hist[i]);
    }
    for (size_t l = 0; l < sizeof(lat) / sizeof(lat[0]); l++) {
        const struct dsv4_client_latency *h = lat[l].h;
        char label[32], p50[32], p90[32], p99[32];
        if (!h->n_buckets)
            continue;
        snprintf(label, sizeof(label), "%s_s", lat[l].name);
        if (!h->count) {
            printf("%-28s count 0\n", label);
            continue;
        }
        latency_quantile(&s, h, 500, p50, sizeof(p50));
        latency_quantile(&s, h, 900, p90, sizeof(p90));
        latency_quantile(&s, h, 990, p99, sizeof(p99));
        printf("%-28s count %llu mean %.6g p50 %s p90 %s p99 %s\n", label, (unsigned long long)h->count,
               h->sum_s / (double)h->count, p50, p90, p99);
    }
    return EXIT_OK;
}

static int cmd_health(struct dsv4_client *c, const struct options *o)
{
    struct dsv4_client_health h;
    int rc = dsv4_client_health(c, &h);
    if (rc < 0)
        return report(c, rc);
    if (o->json)
        print_json(json_pack("{s:s,s:s}", "status", dsv4_client_health_name(h.status), "reason", h.reason));
    else if (h.reason[0])
        printf("%s: %s\n", dsv4_client_health_name(h.status), h.reason);
    else
        printf("%s\n", dsv4_client_health_name(h.status));
    return h.status == DSV4_CLIENT_HEALTH_READY ? EXIT_OK : EXIT_NOT_READY;
}

/* ---- tokenize, detokenize ---- */

static int cmd_tokenize(struct dsv4_client *c, const struct options *o, int argc, char **argv)
{
    struct dsv4_client_message msgs[2];
    char *owned = NULL;
    int32_t *ids;
    size_t n;
    int rc;
    if (argc > 1)
        die_usage("tokenize takes one TEXT argument (quote it)");
    const char *text = argc == 1 ? argv[0] : (owned = read_stdin());
    if (o->chat)
        rc = dsv4_client_tokenize_chat(c, msgs, chat_messages(o, text, msgs), o->think, &ids, &n);
    else
        rc = dsv4_client_tokenize(c, text, !o->no_bos, &ids, &n);
    free(owned);
    if (rc < 0)
        return report(c, rc);
    if (o->json) {
        json_t *a = json_array();
        for (size_t i = 0; i < n; i++)
            json_array_append_new(a, json_integer(ids[i]));
        print_json(json_pack("{s:o}", "tokens", a));
    } else {
        for (size_t i = 0; i < n; i++)
            printf(i ? ",%d" : "%d", ids[i]);
        printf("\n");
    }
    free(ids);
    return EXIT_OK;
}

static int cmd_detokenize(struct dsv4_client *c, const struct options *o, int argc, char **argv)
{
    char *owned = NULL, *text;
    size_t n, len;
    if (argc > 1)
        die_usage("detokenize takes one IDS argument (comma-separated)");
    const char *list = argc == 1 ? argv[0] : (owned = read_stdin());
    int32_t *ids = parse_ids("detokenize", "token id", list, &n);
    free(owned);
    int rc = dsv4_client_detokenize(c, ids, n, &text, &len);
    free(ids);
    if (rc < 0)
        return report(c, rc);
    if (o->json) {
        print_json(json_pack("{s:s%}", "text", text, len));
    } else {
        fwrite(text, 1, len, stdout);
        fputc('\n', stdout);
    }
    free(text);
    return EXIT_OK;
}

/* Connects on its own: one connection per client thread. */
static int cmd_bench(const struct options *o)
{
    struct ctl_bench_opts b = o->bench;
    char err[512];
    b.socket = o->socket;
    b.connect_timeout_ms = CONNECT_TIMEOUT_MS;
    b.timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 0;
    b.json = o->json;
    b.gp = o->gp;
    b.gp.stop = o->stop;
    b.gp.stop_token_ids = o->stop_ids;
    if (b.n_levels == 0)
        b.levels[b.n_levels++] = 1;
    if (b.prompt_tokens == 0)
        b.prompt_tokens = 128;
    if (b.gp.max_tokens == 0)
        b.gp.max_tokens = 128;
    /* fresh prompts for each run (ctl_bench.h); the clock when the kernel has no entropy to give */
    if (getrandom(&b.seed, sizeof(b.seed), GRND_NONBLOCK) != (ssize_t)sizeof(b.seed)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        b.seed = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ (uint64_t)getpid() << 32;
    }
    int rc = ctl_bench_run(&b, stdout, isatty(STDERR_FILENO) ? stderr : NULL, err, sizeof(err));
    if (rc < 0)
        fprintf(stderr, "%s: %s\n", prog, err);
    return rc == 0 ? EXIT_OK : rc == -EREMOTEIO ? EXIT_REJECTED : rc == -EINVAL ? EXIT_USAGE : EXIT_CONNECT;
}

/* ---- main ---- */

enum {
    OPT_TOKENS = 256, OPT_CHAT, OPT_SYSTEM, OPT_THINK, OPT_NO_BOS, OPT_TEMPERATURE, OPT_TOP_P, OPT_TOP_K, OPT_MIN_P,
    OPT_PRESENCE, OPT_FREQUENCY, OPT_REPETITION, OPT_SEED, OPT_STOP, OPT_STOP_IDS, OPT_LOGPROBS, OPT_STREAM,
    OPT_NO_STREAM, OPT_CONCURRENCY, OPT_PROMPT_TOKENS, OPT_REQUESTS, OPT_ADMIT_TOKENS, OPT_SHARED_PREFIX,
};

static const struct option long_options[] = {
    { "socket", required_argument, NULL, 's' },
    { "timeout", required_argument, NULL, 't' },
    { "json", no_argument, NULL, 'j' },
    { "verbose", no_argument, NULL, 'v' },
    { "help", no_argument, NULL, 'h' },
    { "version", no_argument, NULL, 'V' },
    { "tokens", required_argument, NULL, OPT_TOKENS },
    { "chat", no_argument, NULL, OPT_CHAT },
    { "system", required_argument, NULL, OPT_SYSTEM },
    { "think", no_argument, NULL, OPT_THINK },
    { "no-bos", no_argument, NULL, OPT_NO_BOS },
    { "max-tokens", required_argument, NULL, 'n' },
    { "temperature", required_argument, NULL, OPT_TEMPERATURE },
    { "top-p", required_argument, NULL, OPT_TOP_P },
    { "top-k", required_argument, NULL, OPT_TOP_K },
    { "min-p", required_argument, NULL, OPT_MIN_P },
    { "presence-penalty", required_argument, NULL, OPT_PRESENCE },
    { "frequency-penalty", required_argument, NULL, OPT_FREQUENCY },
    { "repetition-penalty", required_argument, NULL, OPT_REPETITION },
    { "seed", required_argument, NULL, OPT_SEED },
    { "stop", required_argument, NULL, OPT_STOP },
    { "stop-token-ids", required_argument, NULL, OPT_STOP_IDS },
    { "logprobs", required_argument, NULL, OPT_LOGPROBS },
    { "stream", no_argument, NULL, OPT_STREAM },
    { "no-stream", no_argument, NULL, OPT_NO_STREAM },
    { "concurrency", required_argument, NULL, OPT_CONCURRENCY },
    { "prompt-tokens", required_argument, NULL, OPT_PROMPT_TOKENS },
    { "admit-tokens", required_argument, NULL, OPT_ADMIT_TOKENS },
    { "shared-prefix", required_argument, NULL, OPT_SHARED_PREFIX },
    { "requests", required_argument, NULL, OPT_REQUESTS },
    { 0, 0, 0, 0 },
};

static void parse_options(struct options *o, int argc, char **argv)
{
    int32_t *ids;
    size_t n;
    int ch;
    while ((ch = getopt_long(argc, argv, "s:t:jvhVn:", long_options, NULL)) != -1) {
        switch (ch) {
        case 's': o->socket = optarg; break;
        case 't': o->timeout_ms = (int)parse_int("--timeout", optarg, 0, INT_MAX / 1000) * 1000; break;
        case 'j': o->json = true; break;
        case 'v': o->verbose = true; break;
        case 'h': usage(stdout); exit(EXIT_OK);
        case 'V': printf("dsv4ctl %s\n", PACKAGE_VERSION); exit(EXIT_OK);
        case OPT_TOKENS: o->tokens = optarg; break;
        case OPT_CHAT: o->chat = true; break;
        case OPT_SYSTEM: o->system = optarg; o->chat = true; break;
        case OPT_THINK: o->think = true; o->chat = true; break;
        case OPT_NO_BOS: o->no_bos = true; break;
        case 'n': o->gp.max_tokens = (uint32_t)parse_int("--max-tokens", optarg, 1, UINT32_MAX); break;
        case OPT_TEMPERATURE: o->gp.temperature = (float)parse_double("--temperature", optarg); break;
        case OPT_TOP_P: o->gp.top_p = (float)parse_double("--top-p", optarg); break;
        case OPT_TOP_K: o->gp.top_k = (int32_t)parse_int("--top-k", optarg, 0, INT32_MAX); break;
        case OPT_MIN_P: o->gp.min_p = (float)parse_double("--min-p", optarg); break;
        case OPT_PRESENCE: o->gp.presence_penalty = (float)parse_double("--presence-penalty", optarg); break;
        case OPT_FREQUENCY: o->gp.frequency_penalty = (float)parse_double("--frequency-penalty", optarg); break;
        case OPT_REPETITION: o->gp.repetition_penalty = (float)parse_double("--repetition-penalty", optarg); break;
        case OPT_SEED: o->gp.seed = parse_u64("--seed", optarg); o->gp.has_seed = true; break;
        case OPT_STOP:
            if (o->gp.n_stop == DSV4_CLIENT_MAX_STOP)
                die_usage("--stop: at most %d stop strings", DSV4_CLIENT_MAX_STOP);
            if (!*optarg)
                die_usage("--stop: empty stop string");
            o->stop[o->gp.n_stop++] = optarg;
            break;
        case OPT_STOP_IDS:
            ids = parse_ids("--stop-token-ids", "token id", optarg, &n);
            for (size_t i = 0; i < n; i++) {
                if (o->gp.n_stop_token_ids == DSV4_CLIENT_MAX_STOP_TOKEN_IDS)
                    die_usage("--stop-token-ids: at most %d ids", DSV4_CLIENT_MAX_STOP_TOKEN_IDS);
                o->stop_ids[o->gp.n_stop_token_ids++] = ids[i];
            }
            free(ids);
            break;
        case OPT_LOGPROBS: o->gp.logprobs = (int)parse_int("--logprobs", optarg, 0, DSV4_CLIENT_MAX_LOGPROBS); break;
        case OPT_STREAM: o->stream = 1; break;
        case OPT_NO_STREAM: o->stream = 0; break;
        case OPT_CONCURRENCY: {
            ids = parse_ids("--concurrency", "connection count", optarg, &n);
            bool bad = false;
            for (size_t i = 0; i < n && i < CTL_BENCH_MAX_LEVELS; i++) {
                o->bench.levels[i] = ids[i];
                bad = bad || ids[i] < 1 || ids[i] > CTL_BENCH_MAX_CONCURRENCY;
            }
            free(ids);      /* before any exit: a usage error leaks nothing */
            if (n > CTL_BENCH_MAX_LEVELS)
                die_usage("--concurrency: at most %d levels", CTL_BENCH_MAX_LEVELS);
            if (bad)
                die_usage("--concurrency: every level must be in [1, %d]", CTL_BENCH_MAX_CONCURRENCY);
            o->bench.n_levels = (int)n;
            break;
        }
        case OPT_PROMPT_TOKENS:
            o->bench.prompt_tokens = (uint32_t)parse_int("--prompt-tokens", optarg, 1, CTL_BENCH_MAX_PROMPT);
            break;
        case OPT_REQUESTS:
            o->bench.requests = (uint32_t)parse_int("--requests", optarg, 1, CTL_BENCH_MAX_REQUESTS);
            break;
        case OPT_ADMIT_TOKENS:
            o->bench.admit_tokens = (uint32_t)parse_int("--admit-tokens", optarg, 1, CTL_BENCH_MAX_PROMPT);
            break;
        case OPT_SHARED_PREFIX:
            o->bench.shared_prefix = (uint32_t)parse_int("--shared-prefix", optarg, 0, CTL_BENCH_MAX_PROMPT - 1);
            break;
        default: fprintf(stderr, "Try '%s --help'.\n", prog); exit(EXIT_USAGE);
        }
    }
    o->gp.stop = o->stop;
    o->gp.stop_token_ids = o->stop_ids;
}

int main(int argc, char **argv)
{
    struct options o = { .timeout_ms = -1, .stream = -1 };
    dsv4_client_generate_params_init(&o.gp);
    parse_options(&o, argc, argv);
    if (optind >= argc) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[optind];
    int nargs = argc - optind - 1;
    char **args = argv + optind + 1;
    enum { GENERATE, INFO, STATS, HEALTH, TOKENIZE, DETOKENIZE, BENCH } which;
    if (strcmp(cmd, "generate") == 0) which = GENERATE;
    else if (strcmp(cmd, "info") == 0) which = INFO;
    else if (strcmp(cmd, "stats") == 0) which = STATS;
    else if (strcmp(cmd, "health") == 0) which = HEALTH;
    else if (strcmp(cmd, "tokenize") == 0) which = TOKENIZE;
    else if (strcmp(cmd, "detokenize") == 0) which = DETOKENIZE;
    else if (strcmp(cmd, "bench") == 0) which = BENCH;
    else die_usage("unknown command '%s'", cmd);
    if ((which == INFO || which == STATS || which == HEALTH || which == BENCH) && nargs > 0)
        die_usage("%s takes no arguments", cmd);
    if (which == BENCH)
        return cmd_bench(&o);

    struct dsv4_client *c = dsv4_client_new();
    if (!c) {
        fprintf(stderr, "%s: out of memory\n", prog);
        return EXIT_CONNECTION;
    }
    int rc = dsv4_client_connect(c, o.socket, CONNECT_TIMEOUT_MS);
    if (rc < 0) {
        fprintf(stderr, "%s: %s\n", prog, dsv4_client_error_message(c));
        dsv4_client_close(c);
        return EXIT_CONNECT;
    }
    dsv4_client_set_timeout(c, o.timeout_ms >= 0 ? o.timeout_ms : which == GENERATE ? 0 : 30000);
    int status;
    switch (which) {
    case GENERATE: status = cmd_generate(c, &o, nargs, args); break;
    case INFO: status = cmd_info(c, &o); break;
    case STATS: status = cmd_stats(c, &o); break;
    case HEALTH: status = cmd_health(c, &o); break;
    case TOKENIZE: status = cmd_tokenize(c, &o, nargs, args); break;
    default: status = cmd_detokenize(c, &o, nargs, args); break;
    }
    dsv4_client_close(c);
    if (fflush(stdout) != 0 && status == EXIT_OK)
        status = EXIT_CONNECTION;
    return status;
}
