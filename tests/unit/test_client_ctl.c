/* SPDX-License-Identifier: MIT */
/* dsv4ctl against a scripted fake server on a Unix socket: every flag reaches the wire with its value,
 * output formats (text, JSON lines), and each documented exit status, SIGINT's cancel included. */
#include "build-config.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "protocol/message.h"
#include "protocol/wire.h"
#include "tests/unit/proto_test_util.h"

extern char **environ;

enum scenario {
    SC_ECHO,          /* generate: n tokens spelling "t0 t1 ...", with the request checked by the test */
    SC_REJECT,        /* generate: error response prompt_too_long */
    SC_FAIL,          /* generate: result with finish_reason error */
    SC_FAIL_ODD,      /* generate: the server's 2nd, 4th, ... generate as SC_FAIL, the others as SC_ECHO */
    SC_SLOW,          /* generate: SIGINT to the peer after the first token, then tokens every 5 ms until a
                         cancel arrives */
    SC_LOADING,       /* health: loading */
    SC_NEWER_HEALTH,  /* health: a status added after this client (doc/PROTOCOL.md section 7) */
    SC_INFINITE,      /* generate and stats: numbers that are infinite (msgpack has them, JSON does not) */
    SC_OLDER_STATS,   /* stats: a server older than the prefix-cache and speculation keys */
};

static struct {
    int listen_fd;
    char path[108];
    pthread_t thread;
    enum scenario sc;
    struct dsv4_proto_generate last;   /* the last generate request, for the test to inspect */
    bool have_last;
    unsigned n_generate;               /* generate requests answered, for SC_FAIL_ODD */
    pthread_mutex_t lock;
} srv;

/* 1 with a request, 0 at EOF, -ETIMEDOUT when nothing came within timeout_ms. */
static int next_request(int fd, struct dsv4_proto_reader *r, struct dsv4_proto_message *msg, int timeout_ms)
{
    struct dsv4_proto_limits lim;
    struct dsv4_proto_error err;
    dsv4_proto_limits_server(&lim);
    for (;;) {
        const uint8_t *p;
        size_t len;
        if (dsv4_proto_reader_next(r, &p, &len, &err) == 1)
            return dsv4_proto_message_decode(p, len, &lim, msg, &err) == 0 ? 1 : 0;
        struct pollfd pf = { .fd = fd, .events = POLLIN };
        if (poll(&pf, 1, timeout_ms) == 0)
            return -ETIMEDOUT;
        uint8_t *space;
        size_t avail;
        if (dsv4_proto_reader_space(r, &space, &avail, &err) < 0)
            return 0;
        ssize_t n = recv(fd, space, avail, 0);
        if (n <= 0)
            return 0;
        dsv4_proto_reader_commit(r, (size_t)n);
    }
}

static void answer_generate(int fd, struct dsv4_proto_reader *r, const struct dsv4_proto_message *msg,
                            struct dsv4_proto_buf *out)
{
    struct dsv4_proto_generate g;
    struct dsv4_proto_error err;
    if (dsv4_proto_decode_generate(msg, &g, &err) < 0) {
        dsv4_proto_encode_error(out, msg->msgid, err.code, err.message);
        return;
    }
    enum scenario sc = srv.sc;
    if (sc == SC_REJECT) {
        dsv4_proto_encode_error(out, msg->msgid, DSV4_PROTO_E_PROMPT_TOO_LONG, "prompt of 70000 tokens");
        dsv4_proto_generate_clear(&g);
        return;
    }
    uint32_t n = sc == SC_SLOW ? 100000 : g.sampling.max_tokens ? g.sampling.max_tokens : 4;
    struct dsv4_proto_generate_result res = { .finish_reason = DSV4_PROTO_FINISH_LENGTH };
    res.tokens = calloc(n, sizeof(int32_t));
    res.text = calloc((size_t)n * 8 + 1, 1);
    if (g.sampling.logprobs >= 0)
        res.logprobs = calloc(n, sizeof(*res.logprobs));
    for (uint32_t i = 0; i < n; i++) {
        char piece[16];
        int len = snprintf(piece, sizeof(piece), "t%u ", i);
        struct dsv4_proto_logprob lp = { .logprob = -0.25f * (float)(i + 1) };
        for (int32_t k = 0; k < g.sampling.logprobs; k++) {
            lp.top_ids[lp.n_top] = 100 + k;
            lp.top_logprobs[lp.n_top++] = k == 1 ? -INFINITY : -(float)k;
        }
        res.tokens[res.n_tokens++] = 1000 + (int32_t)i;
        memcpy(res.text + res.text_len, piece, (size_t)len);
        res.text_len += (size_t)len;
        if (res.logprobs)
            res.logprobs[i] = lp;
        if (g.stream) {
            struct dsv4_proto_token_event ev = { msg->msgid, 1000 + (int32_t)i, piece, (size_t)len,
                                                 g.sampling.logprobs >= 0, lp };
            dsv4_proto_encode_token(out, &ev);
            proto_test_send_all(fd, out);
        }
        if (sc == SC_SLOW) {
            struct dsv4_proto_message cm;
            if (i == 0) {
                /* the peer's pid from the kernel, so the signal can only reach dsv4ctl */
                struct ucred cred;
                socklen_t cred_len = sizeof(cred);
                assert_int_equal(getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len), 0);
                assert_true(cred.pid > 1);
                assert_int_equal(kill(cred.pid, SIGINT), 0);
            }
            if (next_request(fd, r, &cm, 5) == 1) {
                struct dsv4_proto_cancel c;
                bool ours = cm.method == DSV4_PROTO_METHOD_CANCEL && dsv4_proto_decode_cancel(&cm, &c, &err) == 0 &&
                            c.msgid == msg->msgid;
                dsv4_proto_encode_cancel_result(out, cm.msgid, ours);
                proto_test_send_all(fd, out);
                dsv4_proto_message_clear(&cm);
                if (ours) {
                    res.finish_reason = DSV4_PROTO_FINISH_CANCELLED;
                    break;
                }
            }
        }
    }
    if (sc == SC_FAIL || (sc == SC_FAIL_ODD && srv.n_generate++ % 2 == 1)) {
        res.finish_reason = DSV4_PROTO_FINISH_ERROR;
        res.error_message = "engine step failed";
    }
    res.usage.prompt_tokens = 3;
    res.usage.completion_tokens = res.n_tokens;
    if (sc == SC_INFINITE)
        res.timings = (struct dsv4_proto_timings){ .decode_ms = INFINITY, .decode_tokens_per_s = -INFINITY };
    dsv4_proto_encode_generate_result(out, msg->msgid, &res);
    free(res.tokens);
    free(res.text);
    free(res.logprobs);
    pthread_mutex_lock(&srv.lock);
    if (srv.have_last)
        dsv4_proto_generate_clear(&srv.last);
    srv.last = g;
    srv.have_last = true;
    pthread_mutex_unlock(&srv.lock);
}

/* The stats of a server that predates most keys: a few counters, its backend and kernels only. */
static void older_stats(struct dsv4_proto_buf *out, uint32_t msgid)
{
    struct dsv4_wire_enc e;
    dsv4_proto_begin_response(&e, out, msgid);
    msgpack_pack_map(&e.pk, 4);
    dsv4_wire_key(&e.pk, "slots_total");
    msgpack_pack_uint32(&e.pk, 4);
    dsv4_wire_key(&e.pk, "requests_total");
    msgpack_pack_uint64(&e.pk, 9);
    dsv4_wire_key(&e.pk, "backend");
    dsv4_wire_cstr(&e.pk, "cpu");
    dsv4_wire_key(&e.pk, "kernels");
    msgpack_pack_array(&e.pk, 0);
    dsv4_wire_end(&e);
}

static void serve_connection(int fd)
{
    struct dsv4_proto_reader r;
    struct dsv4_proto_buf out = { 0 };
    struct dsv4_proto_message msg;
    struct dsv4_proto_error err;
    dsv4_proto_reader_init(&r, 0);
    while (next_request(fd, &r, &msg, -1) == 1) {
        switch (msg.method) {
        case DSV4_PROTO_METHOD_GENERATE:
            answer_generate(fd, &r, &msg, &out);
            break;
        case DSV4_PROTO_METHOD_HEALTH: {
            if (srv.sc == SC_NEWER_HEALTH) {
                proto_test_newer_health(&out, msg.msgid);
                break;
            }
            struct dsv4_proto_health h = { srv.sc == SC_LOADING ? DSV4_PROTO_HEALTH_LOADING : DSV4_PROTO_HEALTH_READY,
                                           srv.sc == SC_LOADING ? "uploading weights 41%" : "" };
            dsv4_proto_encode_health_result(&out, msg.msgid, &h);
            break;
        }
        case DSV4_PROTO_METHOD_STATS: {
            if (srv.sc == SC_OLDER_STATS) {
                older_stats(&out, msg.msgid);
                break;
            }
            /* latency: ttft's ranks 5, 9 and 10 of 10 lie in buckets 1, 2 and above the bounds; no tpot yet */
            struct dsv4_proto_stats st = { .backend = "cpu", .slots_total = 4, .slots_busy = 1,
                                           .decode_tokens_per_s = srv.sc == SC_INFINITE ? INFINITY : 12.5,
                                           .n_kernels = 1, .kernels = { "gemv" },
                                           .n_latency_bounds = 3, .latency_bounds_s = { 0.01, 0.1, 1 },
                                           .queue_hist = { 4, { 4, 0, 0, 0 } }, .queue_count = 4,
                                           .queue_sum_s = 0.02,
                                           .ttft_hist = { 4, { 2, 5, 2, 1 } }, .ttft_count = 10, .ttft_sum_s = 3,
                                           .tpot_hist = { 4, { 0 } },
                                           .e2e_hist = { 4, { 0, 0, 3, 1 } }, .e2e_count = 4, .e2e_sum_s = 5.5 };
            dsv4_proto_encode_stats_result(&out, msg.msgid, &st);
            break;
        }
        case DSV4_PROTO_METHOD_HELLO: {
            struct dsv4_proto_hello_result h = { .protocol = 1, .server = "fake", .backend = "cpu",
                                                 .max_context = 4096, .model = { .name = "tiny", .vocab_size = 1000 } };
            dsv4_proto_encode_hello_result(&out, msg.msgid, &h);
            break;
        }
        case DSV4_PROTO_METHOD_TOKENIZE: {
            struct dsv4_proto_tokenize t;
            int32_t ids[64];
            struct dsv4_proto_tokens res = { ids, 0 };
            if (dsv4_proto_decode_tokenize(&msg, &t, &err) == 0) {
                if (t.add_bos)
                    ids[res.n_tokens++] = 0;
                for (size_t i = 0; t.text && i < t.text_len && i < 60; i++)
                    ids[res.n_tokens++] = (uint8_t)t.text[i];
                dsv4_proto_tokenize_clear(&t);
            }
            dsv4_proto_encode_tokenize_result(&out, msg.msgid, &res);
            break;
        }
        case DSV4_PROTO_METHOD_DETOKENIZE: {
            struct dsv4_proto_tokens t;
            char text[64] = "";
            size_t n = 0;
            if (dsv4_proto_decode_detokenize(&msg, &t, &err) == 0) {
                for (uint32_t i = 0; i < t.n_tokens && n < 60; i++)
                    if (t.tokens[i] > 0)
                        text[n++] = (char)t.tokens[i];
                dsv4_proto_tokens_clear(&t);
            }
            dsv4_proto_encode_detokenize_result(&out, msg.msgid, text, n);
            break;
        }
        default:
            dsv4_proto_encode_error(&out, msg.msgid, DSV4_PROTO_E_UNKNOWN_METHOD, NULL);
            break;
        }
        proto_test_send_all(fd, &out);
        dsv4_proto_message_clear(&msg);
    }
    dsv4_proto_reader_clear(&r);
    dsv4_proto_buf_clear(&out);
    close(fd);
}


static void *server_main(void *arg)
{
    for (;;) {
        int fd = accept4(srv.listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            return NULL;   /* the listening socket was shut down */
        serve_connection(fd);
    }
}

static int setup(void **state)
{
    snprintf(srv.path, sizeof(srv.path), "/tmp/dsv4ctl-test-%d.sock", (int)getpid());
    unlink(srv.path);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    memcpy(sa.sun_path, srv.path, strlen(srv.path) + 1);
    srv.listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(srv.listen_fd >= 0);
    assert_int_equal(bind(srv.listen_fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(srv.listen_fd, 8), 0);
    pthread_mutex_init(&srv.lock, NULL);
    assert_int_equal(pthread_create(&srv.thread, NULL, server_main, NULL), 0);
    return 0;
}

static int teardown(void **state)
{
    shutdown(srv.listen_fd, SHUT_RDWR);
    pthread_join(srv.thread, NULL);
    close(srv.listen_fd);
    unlink(srv.path);
    if (srv.have_last)
        dsv4_proto_generate_clear(&srv.last);
    return 0;
}

struct run {
    int status;      /* exit status, or 128 + signal */
    char out[65536];
    char err[4096];
};

static void drain(int fd, char *buf, size_t cap)
{
    size_t n = 0;
    ssize_t k;
    while (n + 1 < cap && (k = read(fd, buf + n, cap - 1 - n)) > 0)
        n += (size_t)k;
    buf[n] = '\0';
}

/* Run the built dsv4ctl with args, stdin_text on its stdin. */
static void run_ctl(struct run *r, const char *stdin_text, const char *const *args)
{
    const char *top = getenv("top_builddir");
    char prog[4096];
    const char *argv[64];
    int n = 0;
    snprintf(prog, sizeof(prog), "%s/dsv4ctl", top ? top : ".");
    argv[n++] = prog;
    argv[n++] = "--socket";
    argv[n++] = srv.path;
    for (int i = 0; args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;

    int in[2], out[2], err[2];
    assert_int_equal(pipe(in), 0);
    assert_int_equal(pipe(out), 0);
    assert_int_equal(pipe(err), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err[1], 2);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    posix_spawn_file_actions_addclose(&fa, err[0]);
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, prog, &fa, NULL, (char *const *)argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    close(err[1]);
    if (stdin_text)
        assert_int_equal(write(in[1], stdin_text, strlen(stdin_text)), (ssize_t)strlen(stdin_text));
    close(in[1]);
    drain(out[0], r->out, sizeof(r->out));
    drain(err[0], r->err, sizeof(r->err));
    close(out[0]);
    close(err[0]);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

#define RUN(r, stdin_text, ...) run_ctl(r, stdin_text, (const char *const[]){ __VA_ARGS__, NULL })

static void expect(const struct run *r, int status)
{
    if (r->status != status)
        fail_msg("exit %d, expected %d; stdout: %.400s; stderr: %.400s", r->status, status, r->out, r->err);
}

static void test_flags_reach_the_wire(void **state)
{
    static struct run r;
    srv.sc = SC_ECHO;
    RUN(&r, NULL, "generate", "hello there", "--max-tokens", "3", "--temperature", "0.5", "--top-p", "0.9",
        "--top-k", "40", "--min-p", "0.05", "--presence-penalty", "0.25", "--frequency-penalty", "-0.5",
        "--repetition-penalty", "1.125", "--seed", "18446744073709551615", "--stop", "END", "--stop", "\n\n",
        "--stop-token-ids", "1,2, 7", "--no-bos", "--no-stream");
    expect(&r, 0);
    assert_string_equal(r.out, "t0 t1 t2 \n");
    pthread_mutex_lock(&srv.lock);
    const struct dsv4_proto_generate *g = &srv.last;
    assert_int_equal(g->prompt_kind, DSV4_PROTO_PROMPT_TEXT);
    assert_string_equal(g->prompt, "hello there");
    assert_false(g->add_bos);
    assert_false(g->stream);
    assert_int_equal(g->sampling.max_tokens, 3);
    assert_true(g->sampling.temperature == 0.5f);
    assert_true(g->sampling.top_p == 0.9f);
    assert_int_equal(g->sampling.top_k, 40);
    assert_true(g->sampling.min_p == 0.05f);
    assert_true(g->sampling.presence_penalty == 0.25f);
    assert_true(g->sampling.frequency_penalty == -0.5f);
    assert_true(g->sampling.repetition_penalty == 1.125f);
    assert_true(g->sampling.has_seed);
    assert_true(g->sampling.seed == UINT64_MAX);
    assert_int_equal(g->sampling.n_stop, 2);
    assert_string_equal(g->sampling.stop[0], "END");
    assert_string_equal(g->sampling.stop[1], "\n\n");
    assert_int_equal(g->sampling.n_stop_token_ids, 3);
    assert_int_equal(g->sampling.stop_token_ids[2], 7);
    assert_int_equal(g->sampling.logprobs, -1);
    pthread_mutex_unlock(&srv.lock);

    /* chat: --system and --think make a two-message chat in thinking mode; the prompt comes from stdin */
    RUN(&r, "what is 2+2?", "generate", "--system", "be brief", "--think", "-n", "2");
    expect(&r, 0);
    pthread_mutex_lock(&srv.lock);
    assert_int_equal(g->prompt_kind, DSV4_PROTO_PROMPT_MESSAGES);
    assert_int_equal(g->n_messages, 2);
    assert_int_equal(g->messages[0].role, DSV4_PROTO_ROLE_SYSTEM);
    assert_string_equal(g->messages[0].content, "be brief");
    assert_int_equal(g->messages[1].role, DSV4_PROTO_ROLE_USER);
    assert_string_equal(g->messages[1].content, "what is 2+2?");
    assert_true(g->thinking);
    pthread_mutex_unlock(&srv.lock);

    /* stdin loses the one newline echo adds, and only that one */
    RUN(&r, "What is 17*23?\n", "generate", "--chat", "-n", "1");
    expect(&r, 0);
    pthread_mutex_lock(&srv.lock);
    assert_int_equal(g->n_messages, 1);
    assert_string_equal(g->messages[0].content, "What is 17*23?");
    pthread_mutex_unlock(&srv.lock);
    RUN(&r, "two lines\n\n", "generate", "-n", "1");
    expect(&r, 0);
    pthread_mutex_lock(&srv.lock);
    assert_string_equal(g->prompt, "two lines\n");
    pthread_mutex_unlock(&srv.lock);

    /* --seed N is decimal, leading zeros included (not octal) */
    static const char *const seeds[] = { "010", "08" };
    for (size_t i = 0; i < 2; i++) {
        RUN(&r, NULL, "generate", "x", "-n", "1", "--seed", seeds[i]);
        expect(&r, 0);
        pthread_mutex_lock(&srv.lock);
        uint64_t seed = g->sampling.has_seed ? g->sampling.seed : UINT64_MAX;
        pthread_mutex_unlock(&srv.lock);
        assert_true(seed == strtoull(seeds[i], NULL, 10));
    }

    RUN(&r, NULL, "generate", "--tokens", "5,17 9", "-n", "1");
    expect(&r, 0);
    pthread_mutex_lock(&srv.lock);
    assert_int_equal(g->n_tokens, 3);
    pthread_mutex_unlock(&srv.lock);
    RUN(&r, NULL, "generate", "--tokens", "5,17,9", "-n", "1");
    expect(&r, 0);
    pthread_mutex_lock(&srv.lock);
    assert_int_equal(g->prompt_kind, DSV4_PROTO_PROMPT_TOKENS);
    assert_int_equal(g->n_tokens, 3);
    assert_int_equal(g->tokens[0], 5);
    assert_int_equal(g->tokens[1], 17);
    assert_int_equal(g->tokens[2], 9);
    pthread_mutex_unlock(&srv.lock);
}

static void test_json_lines(void **state)
{
    static struct run r;
    srv.sc = SC_ECHO;
    RUN(&r, NULL, "generate", "x", "--json", "--stream", "--logprobs", "2", "-n", "3");
    expect(&r, 0);
    /* three token lines, then the result */
    json_t *lines[8];
    int n = 0;
    char *save, *line = strtok_r(r.out, "\n", &save);
    while (line && n < 8) {
        json_error_t je;
        lines[n] = json_loads(line, 0, &je);
        if (!lines[n])
            fail_msg("line %d is not JSON: %s (%s)", n, line, je.text);
        n++;
        line = strtok_r(NULL, "\n", &save);
    }
    assert_int_equal(n, 4);
    for (int i = 0; i < 3; i++) {
        char want[16];
        snprintf(want, sizeof(want), "t%d ", i);
        assert_int_equal(json_integer_value(json_object_get(lines[i], "token")), 1000 + i);
        assert_string_equal(json_string_value(json_object_get(lines[i], "text")), want);
        assert_true(json_real_value(json_object_get(lines[i], "logprob")) == -0.25 * (i + 1));
        json_t *top = json_object_get(lines[i], "top_logprobs");
        assert_int_equal(json_array_size(top), 2);
        assert_int_equal(json_integer_value(json_array_get(json_array_get(top, 0), 0)), 100);
        assert_true(json_is_null(json_array_get(json_array_get(top, 1), 1)));   /* -inf */
    }
    json_t *res = lines[3];
    assert_string_equal(json_string_value(json_object_get(res, "text")), "t0 t1 t2 ");
    assert_string_equal(json_string_value(json_object_get(res, "finish_reason")), "length");
    json_t *tokens = json_object_get(res, "tokens");
    assert_int_equal(json_array_size(tokens), 3);
    assert_int_equal(json_integer_value(json_array_get(tokens, 2)), 1002);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(res, "usage"), "total_tokens")), 6);
    assert_int_equal(json_array_size(json_object_get(res, "logprobs")), 3);
    for (int i = 0; i < n; i++)
        json_decref(lines[i]);

    /* without --stream, --json prints the result line only */
    RUN(&r, NULL, "generate", "x", "--json", "--no-stream", "-n", "2");
    expect(&r, 0);
    json_error_t je;
    json_t *only = json_loads(r.out, 0, &je);
    assert_non_null(only);
    assert_string_equal(json_string_value(json_object_get(only, "text")), "t0 t1 ");
    json_decref(only);
}

static void test_exit_codes(void **state)
{
    static struct run r;
    srv.sc = SC_REJECT;
    RUN(&r, NULL, "generate", "x");
    expect(&r, 1);
    assert_non_null(strstr(r.err, "prompt_too_long"));
    assert_non_null(strstr(r.err, "70000 tokens"));

    RUN(&r, NULL, "generate", "--tokens", "5,x");
    expect(&r, 2);
    /* an empty entry is a typo, not an id */
    RUN(&r, NULL, "generate", "--tokens", "0,,2");
    expect(&r, 2);
    assert_non_null(strstr(r.err, "empty entry"));
    RUN(&r, NULL, "generate", "--tokens", ",5");
    expect(&r, 2);
    RUN(&r, NULL, "generate", "--tokens", "5,");
    expect(&r, 2);
    RUN(&r, "5,,6\n", "detokenize");
    expect(&r, 2);
    RUN(&r, NULL, "generate", "x", "--temperature", "warm");
    expect(&r, 2);
    /* a negative seed is refused however it is spelled, not wrapped to 2^64 - 1 */
    RUN(&r, NULL, "generate", "x", "--seed", "-1");
    expect(&r, 2);
    RUN(&r, NULL, "generate", "x", "--seed", " -1");
    expect(&r, 2);
    RUN(&r, NULL, "generate", "x", "--tokens", "5");
    expect(&r, 2);
    RUN(&r, NULL, "frobnicate");
    expect(&r, 2);

    srv.sc = SC_FAIL;
    RUN(&r, NULL, "generate", "x", "-n", "2");
    expect(&r, 6);
    assert_non_null(strstr(r.err, "engine step failed"));

    srv.sc = SC_LOADING;
    RUN(&r, NULL, "health");
    expect(&r, 5);
    assert_string_equal(r.out, "loading: uploading weights 41%\n");
    /* a status newer than dsv4ctl: not ready (5), not a malformed answer (4) */
    srv.sc = SC_NEWER_HEALTH;
    RUN(&r, NULL, "health");
    expect(&r, 5);
    assert_string_equal(r.out, "unknown: swapping the model\n");
    srv.sc = SC_ECHO;
    RUN(&r, NULL, "health", "--json");
    expect(&r, 0);
    assert_non_null(strstr(r.out, "\"status\":\"ready\""));

    static const char *const argv_none[] = { "--socket", "/nonexistent/x.sock", "health", NULL };
    const char *top = getenv("top_builddir");
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s/dsv4ctl", top ? top : ".");
    const char *argv[8] = { prog };
    for (int i = 0; argv_none[i]; i++)
        argv[i + 1] = argv_none[i];
    pid_t pid;
    int st;
    assert_int_equal(posix_spawn(&pid, prog, NULL, NULL, (char *const *)argv, environ), 0);
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_int_equal(WEXITSTATUS(st), 3);
}

static void test_sigint_cancels(void **state)
{
    static struct run r;
    srv.sc = SC_SLOW;
    RUN(&r, NULL, "generate", "x", "--stream");
    expect(&r, 130);
    /* the partial text was printed: at least the token before the signal */
    assert_int_equal(strncmp(r.out, "t0 ", 3), 0);
    pthread_mutex_lock(&srv.lock);
    assert_true(srv.have_last);
    pthread_mutex_unlock(&srv.lock);
}

static void test_other_commands(void **state)
{
    static struct run r;
    srv.sc = SC_ECHO;
    RUN(&r, NULL, "tokenize", "hi");
    expect(&r, 0);
    assert_string_equal(r.out, "0,104,105\n");
    RUN(&r, "hi", "tokenize", "--no-bos", "--json");
    expect(&r, 0);
    assert_string_equal(r.out, "{\"tokens\":[104,105]}\n");
    RUN(&r, NULL, "detokenize", "0,104,105");
    expect(&r, 0);
    assert_string_equal(r.out, "hi\n");
    RUN(&r, NULL, "stats");
    expect(&r, 0);
    assert_non_null(strstr(r.out, "slots_total                  4\n"));
    assert_non_null(strstr(r.out, "decode_tokens_per_s          12.5\n"));
    RUN(&r, NULL, "stats", "--json");
    expect(&r, 0);
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "slots_busy")), 1);
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "kernels"), 0)), "gemv");
    json_decref(j);
    RUN(&r, NULL, "info");
    expect(&r, 0);
    assert_non_null(strstr(r.out, "max_context                  4096\n"));
    RUN(&r, NULL, "--help");
    expect(&r, 0);
    assert_non_null(strstr(r.out, "Exit status"));
}

/* A key an older server does not send is left out of the table and of --json, not printed as 0. */
static void test_stats_older_server(void **state)
{
    static struct run r;
    json_error_t je;
    (void)state;
    srv.sc = SC_OLDER_STATS;
    RUN(&r, NULL, "stats");
    expect(&r, 0);
    assert_non_null(strstr(r.out, "requests_total               9\n"));
    assert_null(strstr(r.out, "prefix_cache_hits"));
    assert_null(strstr(r.out, "uptime_s"));
    RUN(&r, NULL, "stats", "--json");
    expect(&r, 0);
    json_t *j = json_loads(r.out, 0, &je);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(j, "slots_total")), 4);
    assert_null(json_object_get(j, "prefix_cache_hits"));
    assert_null(json_object_get(j, "spec_accepted"));
    assert_null(json_object_get(j, "latency_bounds_s"));
    assert_null(json_object_get(j, "ttft_hist"));
    assert_null(json_object_get(j, "ttft_count"));
    json_decref(j);
    RUN(&r, NULL, "stats");
    assert_null(strstr(r.out, "ttft_s"));
}

/* The latency histograms: the table gives each one's count, mean and the p50/p90/p99 estimated as the
 * upper bound of the bucket holding that rank (">B" above the last bound B), only the count of an
 * empty one; --json carries the raw per-bucket arrays, the bounds, counts and sums. */
static void test_stats_latency(void **state)
{
    static struct run r;
    json_error_t je;
    (void)state;
    srv.sc = SC_ECHO;
    RUN(&r, NULL, "stats");
    expect(&r, 0);
    if (!strstr(r.out, "queue_s                      count 4 mean 0.005 p50 0.01 p90 0.01 p99 0.01\n")
        || !strstr(r.out, "ttft_s                       count 10 mean 0.3 p50 0.1 p90 1 p99 >1\n")
        || !strstr(r.out, "tpot_s                       count 0\n")
        || !strstr(r.out, "e2e_s                        count 4 mean 1.375 p50 1 p90 >1 p99 >1\n"))
        fail_msg("latency lines: '%s'", r.out);
    RUN(&r, NULL, "stats", "--json");
    expect(&r, 0);
    json_t *j = json_loads(r.out, 0, &je);
    assert_non_null(j);
    json_t *b = json_object_get(j, "latency_bounds_s"), *t = json_object_get(j, "ttft_hist");
    assert_int_equal(json_array_size(b), 3);
    assert_true(json_real_value(json_array_get(b, 1)) == 0.1);
    assert_int_equal(json_array_size(t), 4);
    const json_int_t want[] = { 2, 5, 2, 1 };
    for (size_t i = 0; i < 4; i++)
        assert_int_equal(json_integer_value(json_array_get(t, i)), want[i]);
    assert_int_equal(json_array_size(json_object_get(j, "tpot_hist")), 4);
    assert_int_equal(json_integer_value(json_object_get(j, "ttft_count")), 10);
    assert_true(json_real_value(json_object_get(j, "e2e_sum_s")) == 5.5);
    assert_int_equal(json_integer_value(json_object_get(j, "tpot_count")), 0);
    json_decref(j);
}

/* JSON has no infinities: a number the server sent as one prints as null, and the rest of the
 * object still prints. */
static void test_json_infinite_numbers(void **state)
{
    static struct run r;
    json_error_t je;
    srv.sc = SC_INFINITE;
    RUN(&r, NULL, "generate", "x", "--json", "--no-stream", "-n", "2");
    expect(&r, 0);
    json_t *j = json_loads(r.out, 0, &je);
    if (!j)
        fail_msg("not JSON: '%s' (%s)", r.out, je.text);
    assert_string_equal(json_string_value(json_object_get(j, "text")), "t0 t1 ");
    json_t *tm = json_object_get(j, "timings");
    assert_true(json_is_null(json_object_get(tm, "decode_ms")));
    assert_true(json_is_null(json_object_get(tm, "decode_tokens_per_s")));
    assert_true(json_real_value(json_object_get(tm, "total_ms")) == 0);
    json_decref(j);

    RUN(&r, NULL, "stats", "--json");
    expect(&r, 0);
    j = json_loads(r.out, 0, &je);
    assert_non_null(j);
    json_t *v = json_object_get(j, "decode_tokens_per_s");
    assert_non_null(v);
    assert_true(json_is_null(v));
    assert_int_equal(json_integer_value(json_object_get(j, "slots_total")), 4);
    json_decref(j);
    srv.sc = SC_ECHO;
}

/* bench checks the prompt and max_tokens against the server's context (4096 here) before sending
 * anything, whatever their sum: near 2^32 it must not wrap round to something that fits. */
static void test_bench_limits(void **state)
{
    static struct run r;
    srv.sc = SC_REJECT;     /* a request that reached the server would fail with exit 1 */
    RUN(&r, NULL, "bench", "--requests", "1", "--prompt-tokens", "8", "--max-tokens", "5000");
    expect(&r, 2);
    assert_non_null(strstr(r.err, "context of 4096 tokens"));
    RUN(&r, NULL, "bench", "--requests", "1", "--prompt-tokens", "8", "--max-tokens", "4294967295");
    expect(&r, 2);
    assert_non_null(strstr(r.err, "context of 4096 tokens"));
    /* a level that is not a number is named as one, not as a token id */
    static const char *const bad_levels[] = { "-1", "4,x", "", "1,,2", "99999999999" };
    for (size_t i = 0; i < sizeof(bad_levels) / sizeof(bad_levels[0]); i++) {
        RUN(&r, NULL, "bench", "--concurrency", bad_levels[i]);
        expect(&r, 2);
        assert_non_null(strstr(r.err, "--concurrency: "));
        assert_non_null(strstr(r.err, "connection count"));
        assert_null(strstr(r.err, "id"));
    }
}

/* A request that fails after streaming tokens is counted as failed, and so are its tokens: output
 * tokens and tokens/s are those of the requests that finished, like requests/s, TTFT and TPOT. */
static void test_bench_failed_requests(void **state)
{
    static struct run r;
    json_error_t je;
    srv.sc = SC_FAIL_ODD;
    srv.n_generate = 0;
    RUN(&r, NULL, "bench", "--requests", "4", "--prompt-tokens", "4", "--max-tokens", "3", "--json");
    expect(&r, 1);
    assert_non_null(strstr(r.err, "2 of 4 requests failed"));
    json_t *j = json_loads(r.out, 0, &je);
    if (!j)
        fail_msg("not JSON: '%s' (%s)", r.out, je.text);
    assert_int_equal(json_integer_value(json_object_get(j, "failed")), 2);
    assert_int_equal(json_integer_value(json_object_get(j, "output_tokens")), 6);
    const double wall = json_real_value(json_object_get(j, "wall_s"));
    assert_true(wall > 0);
    assert_true(fabs(json_real_value(json_object_get(j, "output_tokens_per_s")) * wall - 6) < 1e-6);
    assert_true(fabs(json_real_value(json_object_get(j, "requests_per_s")) * wall - 2) < 1e-6);
    json_decref(j);
    srv.sc = SC_ECHO;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flags_reach_the_wire),
        cmocka_unit_test(test_json_lines),
        cmocka_unit_test(test_exit_codes),
        cmocka_unit_test(test_sigint_cancels),
        cmocka_unit_test(test_other_commands),
        cmocka_unit_test(test_bench_limits),
        cmocka_unit_test(test_bench_failed_requests),
        cmocka_unit_test(test_json_infinite_numbers),
        cmocka_unit_test(test_stats_older_server),
        cmocka_unit_test(test_stats_latency),
    };
    signal(SIGPIPE, SIG_IGN);
    return cmocka_run_group_tests(tests, setup, teardown);
}
