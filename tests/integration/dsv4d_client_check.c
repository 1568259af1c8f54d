/* SPDX-License-Identifier: MIT */
/* libdsv4client against a running dsv4d ($DSV4_SOCKET), serving an endless fixture model (its greedy
 * answers run to max_tokens). Run by test_dsv4d_client.py, which starts the daemon; TAP through cmocka. */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "client/dsv4client.h"

#define CHECK_CLIENTS 16
#define CHECK_TOKENS 24
#define CHECK_LONG 3000     /* a request that is certainly still running when the test acts on it */
#define CHECK_TIMEOUT_MS 180000

static struct dsv4_client *connect_or_fail(void)
{
    struct dsv4_client *c = dsv4_client_new();
    assert_non_null(c);
    if (dsv4_client_connect(c, NULL, CHECK_TIMEOUT_MS) < 0)
        fail_msg("connect: %s", dsv4_client_error_message(c));
    dsv4_client_set_timeout(c, CHECK_TIMEOUT_MS);
    return c;
}

static void greedy_params(struct dsv4_client_generate_params *p, const int32_t *prompt, size_t n, uint32_t max)
{
    dsv4_client_generate_params_init(p);
    p->tokens = prompt;
    p->n_tokens = n;
    p->max_tokens = max;
    p->temperature = 0;
}

static void test_hello(void **state)
{
    struct dsv4_client *c = connect_or_fail();
    const struct dsv4_client_info *info = NULL;

    assert_int_equal(dsv4_client_hello(c, &info), 0);
    assert_non_null(info);
    assert_int_equal(info->protocol, 2);   /* both sides speak version 2 */
    assert_string_equal(info->backend, "cpu");
    assert_int_equal(info->vocab_size, (uint32_t)atoi(getenv("DSV4_TEST_VOCAB")));
    assert_true(info->max_batch >= 1);
    assert_true(info->max_context > CHECK_LONG);
    assert_int_equal(strncmp(info->server, "dsv4d ", 6), 0);
    dsv4_client_close(c);
}

struct stream_acc {
    char text[1 << 16];
    size_t len;
    int32_t ids[CHECK_LONG];
    size_t n;
    size_t cancel_after;    /* return non-zero after this many tokens (0: never) */
    struct dsv4_client *cancel_handle;  /* cancel through dsv4_client_cancel() from another thread */
    pthread_mutex_t lock;
    pthread_cond_t cond;
};

static int on_token(const struct dsv4_client_token *tok, void *user)
{
    struct stream_acc *a = user;
    if (a->len + tok->text_len < sizeof(a->text)) {
        memcpy(a->text + a->len, tok->text, tok->text_len);
        a->len += tok->text_len;
    }
    pthread_mutex_lock(&a->lock);
    if (a->n < CHECK_LONG)
        a->ids[a->n++] = tok->id;
    pthread_cond_broadcast(&a->cond);
    pthread_mutex_unlock(&a->lock);
    return a->cancel_after && a->n >= a->cancel_after;
}

static struct stream_acc *acc_new(void)
{
    struct stream_acc *a = calloc(1, sizeof(*a));
    assert_non_null(a);
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->cond, NULL);
    return a;
}

static void acc_free(struct stream_acc *a)
{
    pthread_mutex_destroy(&a->lock);
    pthread_cond_destroy(&a->cond);
    free(a);
}

static void test_stream_matches_blocking(void **state)
{
    static const int32_t prompt[] = { 0, 40, 41, 42 };
    struct dsv4_client *c = connect_or_fail();
    struct dsv4_client_generate_params p;
    struct dsv4_client_result blocking = { 0 }, streamed = { 0 };
    struct stream_acc *a = acc_new();

    greedy_params(&p, prompt, 4, CHECK_TOKENS);
    assert_int_equal(dsv4_client_generate(c, &p, &blocking), 0);
    assert_int_equal(dsv4_client_generate_stream(c, &p, on_token, a, &streamed), 0);
    assert_int_equal(blocking.n_tokens, CHECK_TOKENS);
    assert_int_equal(blocking.finish_reason, DSV4_CLIENT_FINISH_LENGTH);
    assert_int_equal(blocking.prompt_tokens, 4);
    assert_int_equal(blocking.completion_tokens, CHECK_TOKENS);
    assert_int_equal(streamed.n_tokens, blocking.n_tokens);
    assert_memory_equal(streamed.tokens, blocking.tokens, blocking.n_tokens * sizeof(int32_t));
    /* The streamed deltas concatenate to the text, and the streamed ids are the result's. */
    assert_int_equal(a->n, streamed.n_tokens);
    assert_memory_equal(a->ids, streamed.tokens, a->n * sizeof(int32_t));
    assert_int_equal(a->len, streamed.text_len);
    assert_memory_equal(a->text, streamed.text, a->len);
    assert_int_equal(blocking.text_len, streamed.text_len);
    assert_memory_equal(blocking.text, streamed.text, blocking.text_len);
    dsv4_client_result_clear(&blocking);
    dsv4_client_result_clear(&streamed);
    acc_free(a);
    dsv4_client_close(c);
}

static void test_text_and_chat(void **state)
{
    static const struct dsv4_client_message chat[] = { { "system", "Be brief." }, { "user", "What is 17*23?" } };
    struct dsv4_client *c = connect_or_fail();
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r = { 0 };
    int32_t *ids = NULL;
    size_t n = 0, len = 0;
    char *text = NULL;

    assert_int_equal(dsv4_client_tokenize(c, "hello world", false, &ids, &n), 0);
    assert_int_equal(n, strlen("hello world"));     /* the test tokenizer: one id per byte */
    assert_int_equal(dsv4_client_detokenize(c, ids, n, &text, &len), 0);
    assert_string_equal(text, "hello world");
    free(ids);
    free(text);
    assert_int_equal(dsv4_client_tokenize_chat(c, chat, 2, false, &ids, &n), 0);
    assert_true(n > strlen("Be brief.What is 17*23?"));
    free(ids);

    dsv4_client_generate_params_init(&p);
    p.prompt = "The capital of France is";
    p.max_tokens = 8;
    p.has_seed = true;
    p.seed = 42;
    assert_int_equal(dsv4_client_generate(c, &p, &r), 0);
    assert_int_equal(r.n_tokens, 8);
    assert_int_equal(r.prompt_tokens, 1 + strlen("The capital of France is"));
    dsv4_client_result_clear(&r);

    dsv4_client_generate_params_init(&p);
    p.messages = chat;
    p.n_messages = 2;
    p.max_tokens = 8;
    p.temperature = 0;
    assert_int_equal(dsv4_client_generate(c, &p, &r), 0);
    assert_int_equal(r.n_tokens, 8);
    dsv4_client_result_clear(&r);
    dsv4_client_close(c);
}

static void test_cancel_from_callback(void **state)
{
    static const int32_t prompt[] = { 0, 9, 9 };
    struct dsv4_client *c = connect_or_fail();
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r = { 0 };
    struct stream_acc *a = acc_new();

    a->cancel_after = 3;
    greedy_params(&p, prompt, 3, CHECK_LONG);
    assert_int_equal(dsv4_client_generate_stream(c, &p, on_token, a, &r), 0);
    assert_int_equal(r.finish_reason, DSV4_CLIENT_FINISH_CANCELLED);
    assert_true(r.n_tokens >= 3 && r.n_tokens < CHECK_LONG);
    dsv4_client_result_clear(&r);
    acc_free(a);
    /* The handle goes on. */
    struct dsv4_client_health h;
    assert_int_equal(dsv4_client_health(c, &h), 0);
    assert_int_equal(h.status, DSV4_CLIENT_HEALTH_READY);
    dsv4_client_close(c);
}

static void *canceller(void *arg)
{
    struct stream_acc *a = arg;
    pthread_mutex_lock(&a->lock);
    while (a->n < 2)
        pthread_cond_wait(&a->cond, &a->lock);
    pthread_mutex_unlock(&a->lock);
    dsv4_client_cancel(a->cancel_handle);
    return NULL;
}

static void test_cancel_from_thread(void **state)
{
    static const int32_t prompt[] = { 0, 10, 11 };
    struct dsv4_client *c = connect_or_fail();
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r = { 0 };
    struct stream_acc *a = acc_new();
    pthread_t th;

    a->cancel_handle = c;
    greedy_params(&p, prompt, 3, CHECK_LONG);
    assert_int_equal(pthread_create(&th, NULL, canceller, a), 0);
    assert_int_equal(dsv4_client_generate_stream(c, &p, on_token, a, &r), 0);
    pthread_join(th, NULL);
    assert_int_equal(r.finish_reason, DSV4_CLIENT_FINISH_CANCELLED);
    assert_true(r.n_tokens >= 2 && r.n_tokens < CHECK_LONG);
    dsv4_client_result_clear(&r);
    acc_free(a);
    dsv4_client_close(c);
}

struct worker {
    pthread_t th;
    int32_t prompt[4];
    struct dsv4_client_result r;
    int rc;
    char error[256];
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct dsv4_client *c = dsv4_client_new();
    struct dsv4_client_generate_params p;

    w->rc = c ? dsv4_client_connect(c, NULL, CHECK_TIMEOUT_MS) : -ENOMEM;
    if (w->rc == 0) {
        dsv4_client_set_timeout(c, CHECK_TIMEOUT_MS);
        greedy_params(&p, w->prompt, 4, CHECK_TOKENS);
        w->rc = dsv4_client_generate(c, &p, &w->r);
    }
    if (w->rc < 0)
        snprintf(w->error, sizeof(w->error), "%s", c ? dsv4_client_error_message(c) : "no memory");
    dsv4_client_close(c);
    return NULL;
}

static void test_sixteen_clients(void **state)
{
    struct worker *w = calloc(CHECK_CLIENTS, sizeof(*w));
    struct dsv4_client *c = connect_or_fail();
    assert_non_null(w);

    for (int k = 0; k < CHECK_CLIENTS; k++) {
        w[k].prompt[0] = 0;
        w[k].prompt[1] = 6 + (int32_t)(17 * k % 250);
        w[k].prompt[2] = 6 + (int32_t)(5 * k % 250);
        w[k].prompt[3] = 6 + (int32_t)(k % 250);
        assert_int_equal(pthread_create(&w[k].th, NULL, worker_main, &w[k]), 0);
    }
    for (int k = 0; k < CHECK_CLIENTS; k++)
        pthread_join(w[k].th, NULL);
    /* Each answer equals the same request alone. */
    for (int k = 0; k < CHECK_CLIENTS; k++) {
        struct dsv4_client_generate_params p;
        struct dsv4_client_result alone = { 0 };
        if (w[k].rc != 0)
            fail_msg("client %d: %d %s", k, w[k].rc, w[k].error);
        greedy_params(&p, w[k].prompt, 4, CHECK_TOKENS);
        assert_int_equal(dsv4_client_generate(c, &p, &alone), 0);
        assert_int_equal(w[k].r.n_tokens, CHECK_TOKENS);
        assert_int_equal(alone.n_tokens, w[k].r.n_tokens);
        assert_memory_equal(alone.tokens, w[k].r.tokens, alone.n_tokens * sizeof(int32_t));
        dsv4_client_result_clear(&alone);
        dsv4_client_result_clear(&w[k].r);
    }
    free(w);
    dsv4_client_close(c);
}

static int die_on_token(const struct dsv4_client_token *tok, void *user)
{
    kill(getpid(), SIGKILL);
    return 0;
}

static void test_killed_client(void **state)
{
    static const int32_t prompt[] = { 0, 12, 13 };
    struct dsv4_client *c = connect_or_fail();
    struct dsv4_client_stats st;
    struct dsv4_client_health h;
    int status = 0;
    pid_t pid = fork();

    assert_true(pid >= 0);
    if (pid == 0) {
        struct dsv4_client *k = dsv4_client_new();
        struct dsv4_client_generate_params p;
        struct dsv4_client_result r;
        if (!k || dsv4_client_connect(k, NULL, CHECK_TIMEOUT_MS) < 0)
            _exit(3);
        greedy_params(&p, prompt, 3, CHECK_LONG);
        dsv4_client_generate_stream(k, &p, die_on_token, NULL, &r);
        _exit(4);   /* not reached: the first token kills it */
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    /* Its slot comes free: the daemon notices the dead peer and cancels its request. */
    for (int i = 0;; i++) {
        assert_int_equal(dsv4_client_stats(c, &st), 0);
        if (st.slots_busy == 0)
            break;
        if (i * 10 > CHECK_TIMEOUT_MS)
            fail_msg("%u slots still busy after %d ms", st.slots_busy, CHECK_TIMEOUT_MS);
        nanosleep(&(struct timespec){ .tv_nsec = 10 * 1000 * 1000 }, NULL);
    }
    assert_int_equal(dsv4_client_health(c, &h), 0);
    assert_int_equal(h.status, DSV4_CLIENT_HEALTH_READY);
    assert_true(st.requests_cancelled >= 1);
    /* The engine counters come through the library (one snapshot): the histogram sums to the decode
     * steps, and the scheduler allocated nothing after boot. */
    uint64_t hist_sum = 0;
    for (size_t i = 0; i < st.n_batch_hist; i++)
        hist_sum += st.batch_hist[i];
    assert_true(st.n_batch_hist > 0 && st.decode_steps > 0 && hist_sum == st.decode_steps);
    assert_true(st.steps >= st.decode_steps);
    assert_true(st.sched_allocations > 0 && st.sched_allocations_after_boot == 0);
    /* So do the latency histograms: the shared bounds, each histogram one bucket longer, summing to its
     * count; every request that got a slot (the killed one's, cancelled after a token, too) is in queue
     * and e2e, those with a token in ttft, those with two in tpot. */
    assert_true(dsv4_client_stats_has(&st, "ttft_hist") && dsv4_client_stats_has(&st, "e2e_sum_s"));
    assert_int_equal(st.n_latency_bounds, 19);
    const struct dsv4_client_latency *lat[] = { &st.queue, &st.ttft, &st.tpot, &st.e2e };
    for (size_t k = 0; k < 4; k++) {
        uint64_t sum = 0;
        assert_int_equal(lat[k]->n_buckets, st.n_latency_bounds + 1);
        for (size_t i = 0; i < lat[k]->n_buckets; i++)
            sum += lat[k]->buckets[i];
        assert_true(sum == lat[k]->count && lat[k]->count > 0 && lat[k]->sum_s > 0);
    }
    assert_true(st.queue.count == st.e2e.count && st.e2e.count >= st.ttft.count && st.ttft.count >= st.tpot.count);
    dsv4_client_close(c);
}

static void test_server_error(void **state)
{
    struct dsv4_client *c = connect_or_fail();
    const struct dsv4_client_info *info = NULL;
    struct dsv4_client_generate_params p;
    struct dsv4_client_result r = { 0 };
    struct dsv4_client_stats st;
    int32_t *prompt;

    assert_int_equal(dsv4_client_hello(c, &info), 0);
    prompt = calloc(info->max_context, sizeof(*prompt));
    assert_non_null(prompt);
    greedy_params(&p, prompt, info->max_context, 4);
    assert_int_equal(dsv4_client_generate(c, &p, &r), -EREMOTEIO);
    assert_int_equal(dsv4_client_server_code(c), 301);
    assert_string_equal(dsv4_client_code_name(301), "prompt_too_long");
    free(prompt);
    /* An error answer leaves the connection usable. */
    assert_int_equal(dsv4_client_stats(c, &st), 0);
    assert_string_equal(st.backend, "cpu");
    assert_true(st.requests_total > 0 && st.generated_tokens_total > 0);
    assert_int_equal(st.device_allocs_after_boot, 0);
    dsv4_client_close(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello),
        cmocka_unit_test(test_stream_matches_blocking),
        cmocka_unit_test(test_text_and_chat),
        cmocka_unit_test(test_cancel_from_callback),
        cmocka_unit_test(test_cancel_from_thread),
        cmocka_unit_test(test_sixteen_clients),
        cmocka_unit_test(test_killed_client),
        cmocka_unit_test(test_server_error),
    };
    if (!getenv("DSV4_SOCKET") || !getenv("DSV4_TEST_VOCAB")) {
        fprintf(stderr, "dsv4d_client_check: run by test_dsv4d_client.py (needs $DSV4_SOCKET, $DSV4_TEST_VOCAB)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
