/* SPDX-License-Identifier: MIT */
/* libdsv4client against a small fake server thread over a socketpair: every call, streaming, cancel
 * from another thread and from the callback, server errors, and a server that misbehaves. */
#include "build-config.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "client/dsv4client.h"
#include "protocol/message.h"
#include "protocol/wire.h"
#include "tests/unit/proto_test_util.h"

/* ---- fake server ---- */

/* A kernel line as long as the CUDA backend's (its image, device, numerics, KV format, graphs, sampling). */
#define LONG_KERNEL_LINE "cuda sm_90a 2026-11-30 0123abc, NVIDIA H200, exact numerics, KV fp8 e4m3+bf16 (584 B at " \
                         "512/64), 27 graphs, 2 streams, sampling on device, prefill chunk 64, MTP drafts"

enum behaviour {
    SERVE,            /* answer everything */
    CLOSE_MID_STREAM, /* close the socket after 3 tokens */
    GARBAGE,          /* answer the first request with a frame claiming 4 GiB */
    SILENT,           /* never answer */
    FATAL,            /* answer with an error notification and close */
    NEWER_HEALTH,     /* answer health with a status added after this client (doc/PROTOCOL.md section 7) */
    TRICKLE,          /* answer one byte every TRICKLE_GAP_MS */
    DEAF,             /* stream a generate's tokens DEAF_GAP_MS apart without reading (no cancel arrives) */
    NEVER_READS,      /* read nothing at all, until the client closes */
};

#define TRICKLE_GAP_MS 40
#define DEAF_GAP_MS 5

struct server {
    int fd;
    int client_fd;      /* the client's end, for a test that fills its socket */
    enum behaviour how;
    uint64_t seed;
    pthread_t thread;
    uint32_t cancels_seen;
};

/* The fake model: the generated ids are a function of the prompt's bytes and a position, so the test
 * can compute them independently (expected_token). Each token's text is one printable character. */
static int32_t expected_token(uint64_t seed, size_t i)
{
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    return (int32_t)(z % 94);
}

static uint64_t prompt_seed(const struct dsv4_proto_generate *g)
{
    uint64_t h = 1469598103934665603ull;
    const uint8_t *p = (const uint8_t *)(g->prompt ? g->prompt : g->messages ? g->messages[0].content : "");
    size_t n = g->prompt ? g->prompt_len : g->messages ? g->messages[0].content_len : 0;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    for (uint32_t i = 0; i < g->n_tokens; i++)
        h = (h ^ (uint32_t)g->tokens[i]) * 1099511628211ull;
    return h;
}

/* Next request frame; 0 at EOF. */
static int read_request(struct server *s, struct dsv4_proto_reader *r, struct dsv4_proto_message *msg, int timeout_ms)
{
    struct dsv4_proto_limits lim;
    struct dsv4_proto_error err;
    dsv4_proto_limits_server(&lim);
    for (;;) {
        const uint8_t *payload;
        size_t len;
        int rc = dsv4_proto_reader_next(r, &payload, &len, &err);
        assert_true(rc >= 0);
        if (rc == 1) {
            assert_int_equal(dsv4_proto_message_decode(payload, len, &lim, msg, &err), 0);
            return 1;
        }
        struct pollfd p = { .fd = s->fd, .events = POLLIN };
        if (poll(&p, 1, timeout_ms) == 0)
            return -ETIMEDOUT;
        uint8_t *space;
        size_t avail;
        assert_int_equal(dsv4_proto_reader_space(r, &space, &avail, &err), 0);
        ssize_t n = recv(s->fd, space, avail, 0);
        if (n <= 0)
            return 0;
        dsv4_proto_reader_commit(r, (size_t)n);
    }
}

static void serve_generate(struct server *s, struct dsv4_proto_reader *r, const struct dsv4_proto_message *msg,
                           struct dsv4_proto_buf *out)
{
    struct dsv4_proto_generate g;
    struct dsv4_proto_error err;
    assert_int_equal(dsv4_proto_decode_generate(msg, &g, &err), 0);
    if (g.prompt && strcmp(g.prompt, "reject") == 0) {
        dsv4_proto_encode_error(out, msg->msgid, DSV4_PROTO_E_PROMPT_TOO_LONG, "prompt of 9999 tokens, above 48");
        proto_test_send_all(s->fd, out);
        dsv4_proto_generate_clear(&g);
        return;
    }
    uint64_t seed = prompt_seed(&g);
    uint32_t n = g.sampling.max_tokens ? g.sampling.max_tokens : 8;
    struct dsv4_proto_generate_result res = { .finish_reason = DSV4_PROTO_FINISH_LENGTH };
    res.tokens = calloc(n, sizeof(int32_t));
    res.text = calloc(n + 1, 1);
    assert_non_null(res.tokens);
    assert_non_null(res.text);
    if (g.sampling.logprobs >= 0)
        res.logprobs = calloc(n, sizeof(*res.logprobs));
    for (uint32_t i = 0; i < n; i++) {
        int32_t t = expected_token(seed, i);
        char ch = (char)(33 + t);
        res.tokens[res.n_tokens++] = t;
        res.text[res.text_len++] = ch;
        struct dsv4_proto_logprob lp = { .logprob = -(float)t / 10, .n_top = (uint32_t)g.sampling.logprobs };
        for (uint32_t k = 0; g.sampling.logprobs > 0 && k < lp.n_top; k++) {
            lp.top_ids[k] = t + (int32_t)k;
            lp.top_logprobs[k] = -(float)k;
        }
        if (res.logprobs)
            res.logprobs[i] = lp;
        if (g.stream) {
            struct dsv4_proto_token_event ev = { .msgid = msg->msgid, .token = t, .text = &ch, .text_len = 1,
                                                 .has_logprob = g.sampling.logprobs >= 0, .logprob = lp };
            assert_int_equal(dsv4_proto_encode_token(out, &ev), 0);
            proto_test_send_all(s->fd, out);
            if (s->how == CLOSE_MID_STREAM && i == 2)
                break;
            /* between tokens, look for a cancel without blocking */
            struct dsv4_proto_message cm;
            if (s->how == DEAF) {
                nanosleep(&(struct timespec){ 0, DEAF_GAP_MS * 1000000L }, NULL);
            } else if (n > 100 && read_request(s, r, &cm, 1) == 1) {
                struct dsv4_proto_cancel c;
                assert_int_equal(cm.method, DSV4_PROTO_METHOD_CANCEL);
                assert_int_equal(dsv4_proto_decode_cancel(&cm, &c, &err), 0);
                bool ours = c.msgid == msg->msgid;
                s->cancels_seen++;
                dsv4_proto_encode_cancel_result(out, cm.msgid, ours);
                proto_test_send_all(s->fd, out);
                dsv4_proto_message_clear(&cm);
                if (ours) {
                    res.finish_reason = DSV4_PROTO_FINISH_CANCELLED;
                    break;
                }
            }
        }
    }
    if (s->how != CLOSE_MID_STREAM) {
        res.usage.prompt_tokens = g.n_tokens ? g.n_tokens : (uint32_t)g.prompt_len;
        res.usage.completion_tokens = res.n_tokens;
        res.timings = (struct dsv4_proto_timings){ .queue_ms = 1, .prefill_ms = 2, .decode_ms = 3, .total_ms = 6 };
        assert_int_equal(dsv4_proto_encode_generate_result(out, msg->msgid, &res), 0);
        proto_test_send_all(s->fd, out);
    }
    free(res.tokens);
    free(res.text);
    free(res.logprobs);
    dsv4_proto_generate_clear(&g);
}

static void *server_main(void *arg)
{
    struct server *s = arg;
    struct dsv4_proto_reader r;
    struct dsv4_proto_buf out = { 0 };
    struct dsv4_proto_error err;
    dsv4_proto_reader_init(&r, 0);
    /* no events: poll reports only the hangup of the client's close */
    for (struct pollfd p = { .fd = s->fd }; s->how == NEVER_READS && !(p.revents & POLLHUP);)
        poll(&p, 1, -1);
    for (;;) {
        struct dsv4_proto_message msg;
        if (s->how == NEVER_READS || read_request(s, &r, &msg, -1) != 1)
            break;
        assert_int_equal(msg.kind, DSV4_PROTO_REQUEST);
        if (s->how == GARBAGE) {
            static const uint8_t bad[] = { 0xff, 0xff, 0xff, 0xff, 0x90 };
            dsv4_proto_buf_append(&out, bad, sizeof(bad));
            proto_test_send_all(s->fd, &out);
            dsv4_proto_message_clear(&msg);
            continue;
        }
        if (s->how == SILENT) {
            dsv4_proto_message_clear(&msg);
            continue;
        }
        if (s->how == FATAL) {
            dsv4_proto_encode_error_notification(&out, DSV4_PROTO_E_TOO_MANY_CONNECTIONS, "64 connections open");
            proto_test_send_all(s->fd, &out);
            dsv4_proto_message_clear(&msg);
            break;
        }
        switch (msg.method) {
        case DSV4_PROTO_METHOD_HELLO: {
            struct dsv4_proto_hello h;
            uint32_t v;
            assert_int_equal(dsv4_proto_decode_hello(&msg, &h, &err), 0);
            assert_int_equal(dsv4_proto_hello_negotiate(&h, &v, &err), 0);
            assert_non_null(h.client);
            struct dsv4_proto_hello_result res = {
                .protocol = v, .server = "fake 1", .backend = "cpu", .max_context = 4096, .max_batch = 8,
                .model = { .name = "tiny", .vocab_size = 129280, .num_layers = 2, .bos_id = 0, .eos_id = 1 },
                .limits = { .max_frame = 8 << 20, .max_prompt_tokens = 4000 },
            };
            dsv4_proto_encode_hello_result(&out, msg.msgid, &res);
            dsv4_proto_hello_clear(&h);
            break;
        }
        case DSV4_PROTO_METHOD_GENERATE:
            serve_generate(s, &r, &msg, &out);
            if (s->how == CLOSE_MID_STREAM) {
                dsv4_proto_message_clear(&msg);
                goto done;
            }
            break;
        case DSV4_PROTO_METHOD_CANCEL: {
            struct dsv4_proto_cancel c;
            assert_int_equal(dsv4_proto_decode_cancel(&msg, &c, &err), 0);
            s->cancels_seen++;
            dsv4_proto_encode_cancel_result(&out, msg.msgid, false);
            break;
        }
        case DSV4_PROTO_METHOD_TOKENIZE: {
            /* the fake tokenizer: BOS 0 when asked, then one id per byte */
            struct dsv4_proto_tokenize t;
            assert_int_equal(dsv4_proto_decode_tokenize(&msg, &t, &err), 0);
            const char *text = t.text ? t.text : t.messages[t.n_messages - 1].content;
            size_t len = strlen(text);
            struct dsv4_proto_tokens res = { .tokens = calloc(len + 1, sizeof(int32_t)) };
            if (t.add_bos || t.prompt_kind == DSV4_PROTO_PROMPT_MESSAGES)
                res.tokens[res.n_tokens++] = 0;
            for (size_t i = 0; i < len; i++)
                res.tokens[res.n_tokens++] = (uint8_t)text[i] + 100;
            dsv4_proto_encode_tokenize_result(&out, msg.msgid, &res);
            free(res.tokens);
            dsv4_proto_tokenize_clear(&t);
            break;
        }
        case DSV4_PROTO_METHOD_DETOKENIZE: {
            struct dsv4_proto_tokens t;
            assert_int_equal(dsv4_proto_decode_detokenize(&msg, &t, &err), 0);
            char *text = calloc(t.n_tokens + 1, 1);
            size_t len = 0;
            for (uint32_t i = 0; i < t.n_tokens; i++)
                if (t.tokens[i] >= 100)
                    text[len++] = (char)(t.tokens[i] - 100);
            dsv4_proto_encode_detokenize_result(&out, msg.msgid, text, len);
            free(text);
            dsv4_proto_tokens_clear(&t);
            break;
        }
        case DSV4_PROTO_METHOD_STATS: {
            assert_int_equal(dsv4_proto_decode_empty_params(&msg, &err), 0);
            struct dsv4_proto_stats st = { .uptime_s = (double)(s->seed % 1000), .backend = "cpu",
                                           .slots_total = 8, .slots_busy = (uint32_t)(s->seed % 8),
                                           .requests_total = s->seed, .heap_allocated = s->seed >> 3,
                                           .n_kernels = 2, .kernels = { "gemv_bf16", LONG_KERNEL_LINE } };
            dsv4_proto_encode_stats_result(&out, msg.msgid, &st);
            break;
        }
        case DSV4_PROTO_METHOD_HEALTH: {
            assert_int_equal(dsv4_proto_decode_empty_params(&msg, &err), 0);
            if (s->how == NEWER_HEALTH) {
                assert_int_equal(proto_test_newer_health(&out, msg.msgid), 0);
                break;
            }
            struct dsv4_proto_health h = { (enum dsv4_proto_health_status)(s->seed % 3), "uploading weights 41%" };
            dsv4_proto_encode_health_result(&out, msg.msgid, &h);
            break;
        }
        default:
            fail_msg("unexpected method %d", msg.method);
        }
        for (size_t i = 0; s->how == TRICKLE && i < out.len; i++) {
            nanosleep(&(struct timespec){ 0, TRICKLE_GAP_MS * 1000000L }, NULL);
            if (send(s->fd, out.data + i, 1, MSG_NOSIGNAL) != 1)
                break;
        }
        if (s->how == TRICKLE)
            dsv4_proto_buf_reset(&out);
        proto_test_send_all(s->fd, &out);
        dsv4_proto_message_clear(&msg);
    }
done:
    dsv4_proto_reader_clear(&r);
    dsv4_proto_buf_clear(&out);
    close(s->fd);
    return NULL;
}

static uint64_t fresh_seed(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_nsec * 6364136223846793005ull + (uint64_t)ts.tv_sec;
}

static struct dsv4_client *start(struct server *s, enum behaviour how)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    s->fd = sv[1];
    s->client_fd = sv[0];
    s->how = how;
    s->seed = fresh_seed();
    s->cancels_seen = 0;
    assert_int_equal(pthread_create(&s->thread, NULL, server_main, s), 0);
    struct dsv4_client *c = dsv4_client_new();
    assert_non_null(c);
    assert_int_equal(dsv4_client_connect_fd(c, sv[0]), 0);
    return c;
}

static void stop(struct server *s, struct dsv4_client *c)
{
    dsv4_client_close(c);
    pthread_join(s->thread, NULL);
}

/* ---- tests ---- */

static void test_hello_stats_health(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, SERVE);
    const struct dsv4_client_info *info;
    assert_null(dsv4_client_info(c));
    assert_int_equal(dsv4_client_hello(c, &info), 0);
    assert_ptr_equal(info, dsv4_client_info(c));
    assert_int_equal(info->protocol, DSV4_PROTO_VERSION);
    assert_string_equal(info->server, "fake 1");
    assert_string_equal(info->model_name, "tiny");
    assert_string_equal(info->backend, "cpu");
    assert_int_equal(info->vocab_size, 129280);
    assert_int_equal(info->max_context, 4096);
    assert_int_equal(info->max_prompt_tokens, 4000);
    assert_int_equal(info->eos_id, 1);

    struct dsv4_client_stats st;
    assert_int_equal(dsv4_client_stats(c, &st), 0);
    assert_true(st.uptime_s == (double)(s.seed % 1000));
    assert_int_equal(st.slots_busy, s.seed % 8);
    assert_true(st.requests_total == s.seed);
    assert_true(st.heap_allocated == s.seed >> 3);
    assert_string_equal(st.backend, "cpu");
    assert_int_equal(st.n_kernels, 2);
    assert_string_equal(st.kernels[1], LONG_KERNEL_LINE);

    struct dsv4_client_health h;
    assert_int_equal(dsv4_client_health(c, &h), 0);
    assert_int_equal(h.status, s.seed % 3);
    assert_string_equal(h.reason, "uploading weights 41%");
    static const char *const names[] = { "ready", "loading", "draining" };
    assert_string_equal(dsv4_client_health_name(h.status), names[s.seed % 3]);
    stop(&s, c);
}

static void check_result(const struct dsv4_client_result *r, uint64_t seed, size_t n)
{
    assert_int_equal(r->n_tokens, n);
    assert_int_equal(r->text_len, n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(r->tokens[i], expected_token(seed, i));
        assert_int_equal(r->text[i], 33 + expected_token(seed, i));
    }
    assert_int_equal(r->text[n], '\0');
    assert_int_equal(r->completion_tokens, n);
}

static uint64_t text_seed(const char *prompt)
{
    struct dsv4_proto_generate g = { .prompt = (char *)prompt, .prompt_len = strlen(prompt) };
    return prompt_seed(&g);
}

static void test_generate_blocking(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, SERVE);
    char prompt[32];
    snprintf(prompt, sizeof(prompt), "prompt %llu", (unsigned long long)s.seed);
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r;
    dsv4_client_generate_params_init(&p);
    p.prompt = prompt;
    p.max_tokens = 5 + (uint32_t)(s.seed % 40);
    p.temperature = 0.7f;
    p.logprobs = 3;
    assert_int_equal(dsv4_client_generate(c, &p, &r), 0);
    check_result(&r, text_seed(prompt), p.max_tokens);
    assert_int_equal(r.finish_reason, DSV4_CLIENT_FINISH_LENGTH);
    assert_string_equal(dsv4_client_finish_name(r.finish_reason), "length");
    assert_non_null(r.logprobs);
    for (size_t i = 0; i < r.n_tokens; i++) {
        assert_true(r.logprobs[i].logprob == -(float)r.tokens[i] / 10);
        assert_int_equal(r.logprobs[i].n_top, 3);
        assert_int_equal(r.logprobs[i].top_ids[2], r.tokens[i] + 2);
    }
    assert_true(r.total_ms == 6);
    dsv4_client_result_clear(&r);

    /* token prompt and chat prompt take their own paths */
    int32_t toks[3] = { 5, 17, (int32_t)(s.seed % 1000) };
    dsv4_client_generate_params_init(&p);
    p.tokens = toks;
    p.n_tokens = 3;
    p.max_tokens = 7;
    assert_int_equal(dsv4_client_generate(c, &p, &r), 0);
    struct dsv4_proto_generate g = { .tokens = toks, .n_tokens = 3 };
    check_result(&r, prompt_seed(&g), 7);
    dsv4_client_result_clear(&r);

    struct dsv4_client_message m[2] = { { "system", "be brief" }, { "user", prompt } };
    dsv4_client_generate_params_init(&p);
    p.messages = m;
    p.n_messages = 2;
    p.thinking = true;
    assert_int_equal(dsv4_client_generate(c, &p, &r), 0);
    struct dsv4_proto_chat_message pm = { .content = "be brief", .content_len = 8 };
    struct dsv4_proto_generate gm = { .messages = &pm, .n_messages = 1 };
    check_result(&r, prompt_seed(&gm), 8);
    dsv4_client_result_clear(&r);

    /* bad arguments never reach the server */
    dsv4_client_generate_params_init(&p);
    assert_int_equal(dsv4_client_generate(c, &p, &r), -EINVAL);
    m[0].role = "god";
    p.messages = m;
    p.n_messages = 2;
    assert_int_equal(dsv4_client_generate(c, &p, &r), -EINVAL);
    assert_non_null(strstr(dsv4_client_error_message(c), "role"));
    stop(&s, c);
}

struct collect {
    char text[4096];
    size_t len;
    int32_t ids[4096];
    size_t n;
    size_t cancel_after;       /* return non-zero after this many tokens (0: never) */
    pthread_mutex_t lock;
    pthread_cond_t cond;
};

static int collect_token(const struct dsv4_client_token *t, void *user)
{
    struct collect *col = user;
    pthread_mutex_lock(&col->lock);
    memcpy(col->text + col->len, t->text, t->text_len);
    col->len += t->text_len;
    col->ids[col->n++] = t->id;
    pthread_cond_broadcast(&col->cond);
    pthread_mutex_unlock(&col->lock);
    return col->cancel_after && col->n >= col->cancel_after;
}

static void collect_init(struct collect *col)
{
    memset(col, 0, sizeof(*col));
    pthread_mutex_init(&col->lock, NULL);
    pthread_cond_init(&col->cond, NULL);
}

static void test_generate_stream(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, SERVE);
    struct collect col;
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r;
    char prompt[32];
    collect_init(&col);
    snprintf(prompt, sizeof(prompt), "stream %llu", (unsigned long long)s.seed);
    dsv4_client_generate_params_init(&p);
    p.prompt = prompt;
    p.max_tokens = 10 + (uint32_t)(s.seed % 50);
    assert_int_equal(dsv4_client_generate_stream(c, &p, collect_token, &col, &r), 0);
    check_result(&r, text_seed(prompt), p.max_tokens);
    /* the streamed deltas concatenate to the final text, the ids to the final tokens */
    assert_int_equal(col.n, r.n_tokens);
    assert_int_equal(col.len, r.text_len);
    assert_memory_equal(col.text, r.text, r.text_len);
    assert_memory_equal(col.ids, r.tokens, r.n_tokens * sizeof(int32_t));
    dsv4_client_result_clear(&r);
    stop(&s, c);
}

struct canceller {
    struct dsv4_client *c;
    struct collect *col;
    size_t after;
};

static void *cancel_main(void *arg)
{
    struct canceller *k = arg;
    pthread_mutex_lock(&k->col->lock);
    while (k->col->n < k->after)
        pthread_cond_wait(&k->col->cond, &k->col->lock);
    pthread_mutex_unlock(&k->col->lock);
    assert_int_equal(dsv4_client_cancel(k->c), 0);
    return NULL;
}

static void test_cancel_from_thread(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, SERVE);
    struct collect col;
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r;
    collect_init(&col);
    dsv4_client_generate_params_init(&p);
    p.prompt = "endless";
    p.max_tokens = 4000;   /* the server would stream all of them, 1 ms apart, unless cancelled */
    struct canceller k = { c, &col, 5 + (size_t)(s.seed % 20) };
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, cancel_main, &k), 0);
    assert_int_equal(dsv4_client_generate_stream(c, &p, collect_token, &col, &r), 0);
    pthread_join(th, NULL);
    assert_int_equal(r.finish_reason, DSV4_CLIENT_FINISH_CANCELLED);
    assert_true(r.n_tokens >= k.after);
    assert_true(r.n_tokens < p.max_tokens);
    check_result(&r, text_seed("endless"), r.n_tokens);
    assert_int_equal(col.n, r.n_tokens);
    dsv4_client_result_clear(&r);

    /* the callback's non-zero return cancels too */
    collect_init(&col);
    col.cancel_after = 3;
    assert_int_equal(dsv4_client_generate_stream(c, &p, collect_token, &col, &r), 0);
    assert_int_equal(r.finish_reason, DSV4_CLIENT_FINISH_CANCELLED);
    assert_true(r.n_tokens >= 3 && r.n_tokens < p.max_tokens);
    dsv4_client_result_clear(&r);

    /* cancel with nothing in flight sends nothing; the connection still works */
    assert_int_equal(dsv4_client_cancel(c), 0);
    struct dsv4_client_health h;
    assert_int_equal(dsv4_client_health(c, &h), 0);
    stop(&s, c);
    assert_int_equal(s.cancels_seen, 2);
}

/* Fills the client's socket with whole requests the server reads only later, then cancels. */
struct jam {
    int fd;
    size_t tokens;
};

/* Fill the client's socket with whole frames until it has no room. */
static void jam_socket(int fd)
{
    struct dsv4_proto_buf b = { 0 };
    assert_int_equal(dsv4_proto_encode_health(&b, 999), 0);
    for (;;) {
        ssize_t n = send(fd, b.data, b.len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0 && errno == EAGAIN)
            break;
        assert_int_equal(n, (ssize_t)b.len);
    }
    dsv4_proto_buf_clear(&b);
}

static int jam_then_cancel(const struct dsv4_client_token *t, void *user)
{
    struct jam *j = user;
    if (++j->tokens == 2)
        jam_socket(j->fd);
    return j->tokens >= 2;
}

/* A cancel that cannot be written (the server reads nothing; the socket's buffer is full) ends the
 * generate call with its reason and closes the connection, as every failed call does (dsv4client.h),
 * instead of the call going on as though the cancel had been sent. */
static void test_cancel_unsent(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, DEAF);
    struct jam j = { .fd = s.client_fd };
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r;
    struct dsv4_client_health h;
    dsv4_client_set_timeout(c, 200);
    dsv4_client_generate_params_init(&p);
    p.prompt = "deaf";
    p.max_tokens = 200;   /* a second of tokens: the cancel's write times out well before the end */
    int rc = dsv4_client_generate_stream(c, &p, jam_then_cancel, &j, &r);
    if (rc == 0)
        dsv4_client_result_clear(&r);
    assert_int_equal(rc, -ETIMEDOUT);
    assert_non_null(strstr(dsv4_client_error_message(c), "cancel"));
    assert_true(j.tokens < p.max_tokens);
    assert_int_equal(dsv4_client_health(c, &h), -ENOTCONN);
    stop(&s, c);
}

static int64_t elapsed_ms(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)(t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

/* Cancels once the generate waits for room to write its request, and times the call. */
struct blocked_cancel {
    struct dsv4_client *c;
    int rc;
    int64_t ms;
};

static void *blocked_cancel_main(void *arg)
{
    struct blocked_cancel *k = arg;
    struct timespec t0;
    nanosleep(&(struct timespec){ 0, 200 * 1000000L }, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    k->rc = dsv4_client_cancel(k->c);
    k->ms = elapsed_ms(&t0);
    return NULL;
}

/* A cancel while the request waits for room in a socket the server does not read returns at once
 * (dsv4ctl's signal thread and dsv4-openai's HTTP thread call it), and the generate call ends
 * cancelled instead of waiting on: on the connection, intact, when none of the request was written;
 * with the connection closed when part of it was (the server would read a cut frame). The timeout
 * only keeps a cancel that blocks from hanging the test. */
static void test_cancel_while_writing(void **state)
{
    for (int jammed = 0; jammed < 2; jammed++) {
        struct server s;
        struct dsv4_client *c = start(&s, NEVER_READS);
        struct blocked_cancel k = { .c = c };
        struct dsv4_client_generate_params p;
        struct dsv4_client_result r;
        struct dsv4_client_health h;
        struct timespec t0;
        pthread_t th;
        size_t big = jammed ? 16 : 4u << 20;   /* 4 MiB: far more than the socket holds */
        char *prompt = malloc(big + 1);
        assert_non_null(prompt);
        memset(prompt, 'x', big);
        prompt[big] = '\0';
        if (jammed)
            jam_socket(s.client_fd);   /* none of the request fits */
        dsv4_client_set_timeout(c, 3000);
        dsv4_client_generate_params_init(&p);
        p.prompt = prompt;
        assert_int_equal(pthread_create(&th, NULL, blocked_cancel_main, &k), 0);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int rc = dsv4_client_generate(c, &p, &r);
        int64_t ms = elapsed_ms(&t0);
        pthread_join(th, NULL);
        assert_int_equal(k.rc, 0);
        assert_true(k.ms < 1000);
        assert_int_equal(rc, 0);
        assert_true(ms < 1000);
        assert_int_equal(r.finish_reason, DSV4_CLIENT_FINISH_CANCELLED);
        assert_int_equal(r.n_tokens, 0);
        assert_non_null(r.text);
        assert_int_equal(r.text_len, 0);
        dsv4_client_result_clear(&r);
        if (!jammed)
            assert_int_equal(dsv4_client_health(c, &h), -ENOTCONN);
        free(prompt);
        stop(&s, c);
    }
}

static void test_server_error(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, SERVE);
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r;
    dsv4_client_generate_params_init(&p);
    p.prompt = "reject";
    assert_int_equal(dsv4_client_generate(c, &p, &r), -EREMOTEIO);
    assert_int_equal(dsv4_client_server_code(c), DSV4_PROTO_E_PROMPT_TOO_LONG);
    assert_string_equal(dsv4_client_code_name(dsv4_client_server_code(c)), "prompt_too_long");
    assert_non_null(strstr(dsv4_client_error_message(c), "9999 tokens"));
    /* the connection stays usable after a rejected request */
    p.prompt = "fine";
    p.max_tokens = 4;
    assert_int_equal(dsv4_client_generate(c, &p, &r), 0);
    assert_int_equal(dsv4_client_server_code(c), 0);
    check_result(&r, text_seed("fine"), 4);
    dsv4_client_result_clear(&r);
    stop(&s, c);
}

static void test_tokens(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, SERVE);
    char text[64];
    int32_t *ids;
    size_t n, len;
    char *back;
    snprintf(text, sizeof(text), "héllo %llu", (unsigned long long)s.seed);
    assert_int_equal(dsv4_client_tokenize(c, text, true, &ids, &n), 0);
    assert_int_equal(n, strlen(text) + 1);
    assert_int_equal(ids[0], 0);
    for (size_t i = 0; i < strlen(text); i++)
        assert_int_equal(ids[i + 1], (uint8_t)text[i] + 100);
    assert_int_equal(dsv4_client_detokenize(c, ids, n, &back, &len), 0);
    assert_int_equal(len, strlen(text));
    assert_string_equal(back, text);
    free(back);
    free(ids);
    assert_int_equal(dsv4_client_tokenize(c, text, false, &ids, &n), 0);
    assert_int_equal(n, strlen(text));
    free(ids);
    struct dsv4_client_message m = { "user", text };
    assert_int_equal(dsv4_client_tokenize_chat(c, &m, 1, false, &ids, &n), 0);
    assert_int_equal(n, strlen(text) + 1);
    free(ids);
    assert_int_equal(dsv4_client_detokenize(c, NULL, 0, &back, &len), 0);
    assert_int_equal(len, 0);
    assert_string_equal(back, "");
    free(back);
    stop(&s, c);
}

/* A health status this client does not know is an answer meaning not ready (doc/PROTOCOL.md section 7),
 * not a malformed reply: a newer server may add statuses without a version change. */
static void test_newer_health_status(void **state)
{
    struct server s;
    struct dsv4_client *c = start(&s, NEWER_HEALTH);
    struct dsv4_client_health h;
    assert_int_equal(dsv4_client_health(c, &h), 0);
    assert_int_equal(h.status, DSV4_CLIENT_HEALTH_UNKNOWN);
    assert_string_equal(dsv4_client_health_name(h.status), "unknown");
    assert_string_equal(h.reason, "swapping the model");
    stop(&s, c);
}

static void test_misbehaving_servers(void **state)
{
    struct server s;
    struct dsv4_client *c;
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r;
    struct dsv4_client_health h;
    struct collect col;

    c = start(&s, CLOSE_MID_STREAM);
    collect_init(&col);
    dsv4_client_generate_params_init(&p);
    p.prompt = "x";
    assert_int_equal(dsv4_client_generate_stream(c, &p, collect_token, &col, &r), -ECONNRESET);
    assert_int_equal(col.n, 3);
    assert_int_equal(dsv4_client_health(c, &h), -ENOTCONN);
    stop(&s, c);

    c = start(&s, GARBAGE);
    assert_int_equal(dsv4_client_health(c, &h), -EPROTO);
    assert_non_null(strstr(dsv4_client_error_message(c), "maximum frame size"));
    stop(&s, c);

    c = start(&s, SILENT);
    dsv4_client_set_timeout(c, 50);
    assert_int_equal(dsv4_client_health(c, &h), -ETIMEDOUT);
    stop(&s, c);

    /* The timeout bounds each answer frame (dsv4client.h), not the gap between its bytes: a server
     * trickling a frame a byte at a time, each within the timeout, does not hold the call forever. */
    c = start(&s, TRICKLE);
    dsv4_client_set_timeout(c, 4 * TRICKLE_GAP_MS);
    assert_int_equal(dsv4_client_health(c, &h), -ETIMEDOUT);
    assert_non_null(strstr(dsv4_client_error_message(c), "within 160 ms"));
    stop(&s, c);

    c = start(&s, FATAL);
    assert_int_equal(dsv4_client_health(c, &h), -ECONNRESET);
    assert_int_equal(dsv4_client_server_code(c), DSV4_PROTO_E_TOO_MANY_CONNECTIONS);
    assert_non_null(strstr(dsv4_client_error_message(c), "64 connections open"));
    stop(&s, c);

    /* A draining dsv4d tells a new connection why and closes it, often before the first request is
     * written: the request's write fails (EPIPE), and the reason waiting to be read is what the caller
     * is told, not the broken pipe. */
    int sv[2];
    struct dsv4_proto_buf note;
    dsv4_proto_buf_init(&note);
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    assert_int_equal(dsv4_proto_encode_error_notification(&note, DSV4_PROTO_E_DRAINING, "dsv4d is shutting down"), 0);
    proto_test_send_all(sv[1], &note);
    close(sv[1]);
    dsv4_proto_buf_clear(&note);
    c = dsv4_client_new();
    assert_int_equal(dsv4_client_connect_fd(c, sv[0]), 0);
    assert_int_equal(dsv4_client_health(c, &h), -ECONNRESET);
    assert_int_equal(dsv4_client_server_code(c), DSV4_PROTO_E_DRAINING);
    assert_non_null(strstr(dsv4_client_error_message(c), "dsv4d is shutting down"));
    dsv4_client_close(c);

    /* connect to a path where nothing listens */
    c = dsv4_client_new();
    assert_int_equal(dsv4_client_connect(c, "/nonexistent/dsv4d.sock", 100), -ENOENT);
    assert_non_null(strstr(dsv4_client_error_message(c), "/nonexistent/dsv4d.sock"));
    dsv4_client_close(c);
    dsv4_client_close(NULL);
}

/* A listener whose backlog is full: dsv4_client_connect waits for room (or gives up at its timeout)
 * instead of returning a socket that is not connected. */
struct backlog {
    int listen_fd;
    int delay_ms;
    struct server s;
};

static void *backlog_main(void *arg)
{
    struct backlog *b = arg;
    nanosleep(&(struct timespec){ b->delay_ms / 1000, (long)(b->delay_ms % 1000) * 1000000L }, NULL);
    int filler = accept(b->listen_fd, NULL, NULL);   /* room for the client's connection */
    assert_true(filler >= 0);
    b->s.fd = accept(b->listen_fd, NULL, NULL);
    close(filler);
    if (b->s.fd >= 0)
        server_main(&b->s);
    return NULL;
}

static void test_connect_backlog_full(void **state)
{
    char dir[] = "/tmp/dsv4-client-test-XXXXXX";
    char path[108];
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/s", dir);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(l >= 0);
    assert_int_equal(bind(l, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(l, 0), 0);
    /* backlog 0 holds one connection nobody accepted: the next one finds it full */
    int filler = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_int_equal(connect(filler, (struct sockaddr *)&sa, sizeof(sa)), 0);

    struct dsv4_client *c = dsv4_client_new();
    struct dsv4_client_health h;
    assert_int_equal(dsv4_client_connect(c, path, 100), -ETIMEDOUT);
    assert_non_null(strstr(dsv4_client_error_message(c), path));
    assert_int_equal(dsv4_client_health(c, &h), -ENOTCONN);

    /* room comes within the timeout: connected, and the connection serves */
    struct backlog b = { .listen_fd = l, .delay_ms = 100, .s = { .how = SERVE, .seed = fresh_seed() } };
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, backlog_main, &b), 0);
    assert_int_equal(dsv4_client_connect(c, path, 10000), 0);
    dsv4_client_set_timeout(c, 10000);
    assert_int_equal(dsv4_client_health(c, &h), 0);
    assert_int_equal(h.status, b.s.seed % 3);
    dsv4_client_close(c);
    pthread_join(th, NULL);
    close(filler);
    close(l);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_stats_health),
        cmocka_unit_test(test_newer_health_status),
        cmocka_unit_test(test_generate_blocking),
        cmocka_unit_test(test_generate_stream),
        cmocka_unit_test(test_cancel_from_thread),
        cmocka_unit_test(test_cancel_unsent),
        cmocka_unit_test(test_cancel_while_writing),
        cmocka_unit_test(test_server_error),
        cmocka_unit_test(test_tokens),
        cmocka_unit_test(test_misbehaving_servers),
        cmocka_unit_test(test_connect_backlog_full),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
