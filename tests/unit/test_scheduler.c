/* SPDX-License-Identifier: MIT */
/* engine/serve/scheduler over the fake backend (tests/unit/fake_backend.c): outputs checked against a
 * direct oracle (fake logits + sampler over the request's own history), batch invariance, stops,
 * limits, cancellation, drain, a random workload, and the engine thread driven from another thread.
 * Allocations inside scheduler calls are counted by wrapping malloc/calloc/realloc at link time. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include <jansson.h>

#include "engine/error.h"
#include "engine/serve/sampler.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"
#include "tests/unit/fake_backend.h"

/* ---- allocation counting (linked with --wrap=malloc,--wrap=calloc,--wrap=realloc) ---- */

static __thread int counting;
static long wrapped_allocs;
void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n)
{
    if (counting)
        __atomic_fetch_add(&wrapped_allocs, 1, __ATOMIC_RELAXED);
    return __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t size)
{
    if (counting)
        __atomic_fetch_add(&wrapped_allocs, 1, __ATOMIC_RELAXED);
    return __real_calloc(n, size);
}
void *__wrap_realloc(void *p, size_t n)
{
    if (counting)
        __atomic_fetch_add(&wrapped_allocs, 1, __ATOMIC_RELAXED);
    return __real_realloc(p, n);
}

/* ---- fixtures ---- */

#define VOCAB 96
#define EOS 1
#define OUT_MAX 512
#define TEXT_MAX 4096

static const struct fake_backend_opts FAKE_LONG = { VOCAB, EOS, -100.0f, 6.0f, 0, false, false, 0, 0 };  /* EOS never wins */
static const struct fake_backend_opts FAKE_EOS = { VOCAB, EOS, 0.0f, 6.0f, 0, false, false, 0, 0 };      /* EOS like any */
/* The same, sampling inside the backend (ops->sample), as the CUDA backend does. */
static const struct fake_backend_opts FAKE_EOS_DEVICE = { VOCAB, EOS, 0.0f, 6.0f, 0, true, false, 0, 0 };

struct outcome {
    bool finished;
    int n_events;
    int n_tokens;
    int32_t tokens[OUT_MAX];
    size_t stream_len;
    char stream[TEXT_MAX];          /* concatenated deltas */
    bool delta_in_stop;             /* a delta was not a prefix-consistent extension */
    struct dsv4_sched_result res;   /* copied, tokens/text below */
    int32_t res_tokens[OUT_MAX];
    char res_text[TEXT_MAX];
    uint64_t id;
};

/* Sampler threads for the scheduler env_open() makes (tests that exercise the pool set it). */
static int env_sampler_threads;
static int env_decode_stall_ms;

struct env {
    struct dsv4_backend *b;
    struct dsv4_sched *s;
    struct fake_backend_opts fo;
};

static void env_open(struct env *e, const struct fake_backend_opts *fo, int max_batch, int max_context,
                     int prefill_budget, int max_requests)
{
    struct dsv4_backend_opts bo = { .max_batch = max_batch, .max_context = max_context };
    e->fo = *fo;
    assert_int_equal(fake_backend_create(fo, &bo, &e->b), 0);
    struct dsv4_sched_limits lim = {
        .prefill_budget = prefill_budget,
        .max_requests = max_requests,
        .max_output_tokens = max_context < OUT_MAX ? max_context : OUT_MAX,
        .sampler_threads = env_sampler_threads,
        .decode_stall_ms = env_decode_stall_ms,
        .detok = { fake_token_bytes, NULL },
    };
    int r = dsv4_sched_create(e->b, NULL, &lim, &e->s);
    if (r < 0)
        fail_msg("create: %s", dsv4_error_message());
}

static void env_close(struct env *e)
{
    dsv4_sched_destroy(e->s);
    dsv4_backend_destroy(e->b);
}

/* Take every queued event; FINISH copies the result and releases the request. */
static int drain_events(struct dsv4_sched *s)
{
    struct dsv4_sched_event ev;
    int n = 0;
    counting = 1;
    while (dsv4_sched_next_event(s, &ev) == 1) {
        counting = 0;
        struct outcome *o = ev.user;
        assert_non_null(o);
        assert_false(o->finished);
        assert_int_equal(ev.id, o->id);
        o->n_events++;
        if (ev.type == DSV4_SCHED_EVENT_TOKEN) {
            assert_int_equal(ev.index, o->n_tokens);
            assert_true(o->n_tokens < OUT_MAX);
            o->tokens[o->n_tokens++] = ev.sample.token;
            assert_true(o->stream_len + ev.delta_len < TEXT_MAX);
            memcpy(o->stream + o->stream_len, ev.delta, ev.delta_len);
            o->stream_len += ev.delta_len;
        } else {
            const struct dsv4_sched_result *r = ev.result;
            o->finished = true;
            o->res = *r;
            assert_true(r->n_tokens <= OUT_MAX && r->text_len < TEXT_MAX);
            if (r->n_tokens)
                memcpy(o->res_tokens, r->tokens, sizeof(int32_t) * (size_t)r->n_tokens);
            memcpy(o->res_text, r->text, r->text_len + 1);
            counting = 1;
            assert_int_equal(dsv4_sched_release(s, ev.id), 0);
        }
        counting = 1;
        n++;
    }
    counting = 0;
    return n;
}

static int step(struct dsv4_sched *s)
{
    counting = 1;
    int r = dsv4_sched_step(s);
    counting = 0;
    assert_true(r >= 0);
    drain_events(s);
    return r;
}

static uint64_t submit(struct env *e, const struct dsv4_sched_request *rq, struct outcome *o)
{
    memset(o, 0, sizeof(*o));
    struct dsv4_sched_request r = *rq;
    r.user = o;
    counting = 1;
    int rc = dsv4_sched_submit(e->s, &r, &o->id);
    counting = 0;
    if (rc < 0)
        fail_msg("submit: %s", dsv4_error_message());
    return o->id;
}

static void run_all(struct env *e, struct outcome *o, int n)
{
    for (int guard = 0; guard < 100000; guard++) {
        int done = 0;
        for (int i = 0; i < n; i++)
            done += o[i].finished;
        if (done == n)
            return;
        step(e->s);
    }
    fail_msg("requests did not finish");
}

static void random_prompt(uint64_t *st, int32_t *p, int n)
{
    for (int i = 0; i < n; i++) {
        *st = *st * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = 2 + (int32_t)((*st >> 33) % (VOCAB - 2));
    }
}

static struct dsv4_sched_request make_request(const int32_t *prompt, int n, int max_tokens, int kind)
{
    struct dsv4_sched_request r = { .prompt = prompt, .n_prompt = n, .max_tokens = max_tokens };
    dsv4_sampling_defaults(&r.sampling);
    switch (kind % 4) {
    case 0:
        r.sampling.temperature = 0.0f;
        break;
    case 1:
        r.sampling.has_seed = true;
        r.sampling.seed = 1000 + (uint64_t)kind;
        r.sampling.temperature = 0.9f;
        r.sampling.top_p = 0.9f;
        break;
    case 2:
        r.sampling.has_seed = true;
        r.sampling.seed = 77 * (uint64_t)kind;
        r.sampling.top_k = 12;
        r.sampling.repetition_penalty = 1.3f;
        r.sampling.frequency_penalty = 0.5f;
        r.sampling.presence_penalty = 0.2f;
        r.sampling.logprobs = 3;
        break;
    default:
        r.sampling.has_seed = true;
        r.sampling.seed = (uint64_t)kind << 40;
        r.sampling.min_p = 0.1f;
        r.sampling.temperature = 1.4f;
        break;
    }
    return r;
}

/* The oracle: the fake's logits for prompt + output so far, sampled with the request's params and
 * the penalty history built here from scratch. */
static int oracle(const struct fake_backend_opts *fo, const struct dsv4_sched_request *rq, int max_context,
                  int32_t *out, int cap, uint64_t seed)
{
    int32_t hist[1024];
    float row[VOCAB];
    uint32_t counts[VOCAB] = { 0 };
    uint8_t seen[(VOCAB + 7) / 8] = { 0 };
    struct dsv4_sampler *sm;
    assert_int_equal(dsv4_sampler_create(VOCAB, &sm), 0);
    int n = rq->n_prompt;
    memcpy(hist, rq->prompt, sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        seen[hist[i] / 8] |= (uint8_t)(1u << (hist[i] % 8));
    int k = 0;
    for (;;) {
        fake_backend_row(fo, hist, n, row);
        struct dsv4_sampler_history h = { counts, seen };
        struct dsv4_sample smp;
        assert_int_equal(dsv4_sampler_sample(sm, &rq->sampling, row, &h, seed, (uint64_t)k, &smp), 0);
        out[k++] = smp.token;
        counts[smp.token]++;
        seen[smp.token / 8] |= (uint8_t)(1u << (smp.token % 8));
        if (smp.token == fo->eos_id || k == cap || (rq->max_tokens && k == rq->max_tokens) ||
            rq->n_prompt + k == max_context)
            break;
        hist[n++] = smp.token;
    }
    dsv4_sampler_destroy(sm);
    return k;
}

static void assert_same_tokens(const struct outcome *a, const int32_t *want, int n)
{
    assert_int_equal(a->res.n_tokens, n);
    assert_int_equal(a->n_tokens, n);
    for (int i = 0; i < n; i++) {
        assert_int_equal(a->res_tokens[i], want[i]);
        assert_int_equal(a->tokens[i], want[i]);
    }
}

/* ---- tests ---- */

/* Alone, each kind of request gives exactly the oracle's tokens; the stream equals the text. */
static void test_alone_matches_oracle(void **state)
{
    uint64_t st = 1;
    for (int kind = 0; kind < 8; kind++) {
        struct env e;
        env_open(&e, &FAKE_EOS, 1, 128, 7, 4);
        int32_t prompt[40];
        random_prompt(&st, prompt, 5 + 4 * kind);
        struct dsv4_sched_request rq = make_request(prompt, 5 + 4 * kind, 30, kind);
        struct outcome o;
        submit(&e, &rq, &o);
        run_all(&e, &o, 1);
        int32_t want[OUT_MAX];
        int n = oracle(&e.fo, &rq, 128, want, OUT_MAX, o.res.seed);
        assert_same_tokens(&o, want, n);
        assert_true(o.res.finish == (want[n - 1] == EOS ? DSV4_FINISH_STOP : DSV4_FINISH_LENGTH));
        assert_int_equal(o.stream_len, o.res.text_len);
        assert_memory_equal(o.stream, o.res_text, o.stream_len);
        /* the text is the lossy UTF-8 of the tokens' bytes (EOS adds none) */
        char raw[TEXT_MAX];
        size_t rl = 0;
        for (int i = 0; i < n; i++)
            rl += (size_t)fake_token_bytes(NULL, want[i], raw + rl, sizeof(raw) - rl);
        size_t ll;
        char *lossy = dsv4_utf8_lossy(raw, rl, &ll);
        assert_int_equal(ll, o.res.text_len);
        assert_memory_equal(lossy, o.res_text, ll);
        free(lossy);
        assert_int_equal(o.res.prompt_tokens, rq.n_prompt);
        assert_int_equal(o.res.completion_tokens, n);
        assert_int_equal(o.n_events, n + 1);
        env_close(&e);
    }
}

/* The same requests alone, three at once, and sixteen with arrivals and departures mid-way
 * (8 slots, so slots are reused and requests wait in the queue). */
static void test_batch_invariance(void **state)
{
    enum { N = 16 };
    static int32_t prompts[N][64];
    struct dsv4_sched_request rq[N];
    static struct outcome alone[N], batch[N];
    uint64_t st = 99;
    for (int i = 0; i < N; i++) {
        int len = 3 + (i * 7) % 50;
        random_prompt(&st, prompts[i], len);
        rq[i] = make_request(prompts[i], len, 10 + (i * 5) % 25, i);
    }
    for (int i = 0; i < N; i++) {
        struct env e;
        env_open(&e, &FAKE_EOS, 1, 256, 512, 4);
        submit(&e, &rq[i], &alone[i]);
        run_all(&e, &alone[i], 1);
        env_close(&e);
    }
    /* three at once */
    {
        struct env e;
        env_open(&e, &FAKE_EOS, 3, 256, 16, 8);
        for (int i = 0; i < 3; i++)
            submit(&e, &rq[i], &batch[i]);
        run_all(&e, batch, 3);
        for (int i = 0; i < 3; i++)
            assert_same_tokens(&batch[i], alone[i].res_tokens, alone[i].res.n_tokens);
        env_close(&e);
    }
    /* sixteen, arriving over time, with a cancelled bystander */
    {
        struct env e;
        env_open(&e, &FAKE_EOS, 8, 256, 24, 32);
        static struct outcome by;
        int32_t byp[20];
        random_prompt(&st, byp, 20);
        struct dsv4_sched_request brq = make_request(byp, 20, 200, 1);
        submit(&e, &brq, &by);
        int next = 0;
        for (int t = 0; next < N || !by.finished; t++) {
            if (next < N && t % 3 == 0) {
                submit(&e, &rq[next], &batch[next]);
                next++;
            }
            if (t == 20)
                assert_int_equal(dsv4_sched_cancel(e.s, by.id), 0);
            step(e.s);
            assert_true(t < 10000);
        }
        run_all(&e, batch, N);
        for (int i = 0; i < N; i++) {
            assert_same_tokens(&batch[i], alone[i].res_tokens, alone[i].res.n_tokens);
            assert_int_equal(batch[i].res.finish, alone[i].res.finish);
            assert_int_equal(batch[i].res.text_len, alone[i].res.text_len);
            assert_memory_equal(batch[i].res_text, alone[i].res_text, alone[i].res.text_len);
        }
        assert_int_equal(by.res.finish, DSV4_FINISH_CANCELLED);
        struct fake_backend_counters c;
        fake_backend_counters(e.b, &c);
        assert_true(c.max_prefill_chunk <= 24);
        assert_true(c.max_decode_batch > 3);
        env_close(&e);
    }
}

/* The first character boundary at or after byte i of UTF-8 text. */
static size_t char_start(const char *t, size_t i)
{
    while ((t[i] & 0xC0) == 0x80)
        i++;
    return i;
}

/* Stop strings cut from a real output so they span token boundaries. */
static void test_stop_strings(void **state)
{
    uint64_t st = 5;
    int tried = 0;
    for (int kind = 0; kind < 12; kind++) {
        int32_t prompt[12];
        random_prompt(&st, prompt, 12);
        struct dsv4_sched_request rq = make_request(prompt, 12, 60, kind);
        struct env e;
        env_open(&e, &FAKE_LONG, 2, 256, 64, 8);
        static struct outcome base;
        submit(&e, &rq, &base);
        run_all(&e, &base, 1);
        assert_int_equal(base.res.finish, DSV4_FINISH_LENGTH);
        const char *T = base.res_text;
        size_t tl = base.res.text_len;
        if (tl < 30) {
            env_close(&e);
            continue;
        }
        /* about bytes [10, 16) of T, on character boundaries: its first occurrence decides where
         * the text is cut */
        char stop[32];
        size_t a = char_start(T, 10), b = char_start(T, a + 6);
        memcpy(stop, T + a, b - a);
        stop[b - a] = '\0';
        size_t first = (size_t)(strstr(T, stop) - T);
        tried++;
        /* a second stop string that never completes ('#' is not in the vocabulary): its prefix is
         * held back, then released */
        char never[32];
        a = char_start(T, 20);
        b = char_start(T, a + 4);
        memcpy(never, T + a, b - a);
        memcpy(never + (b - a), "#", 2);
        const char *stops[2] = { never, stop };
        struct dsv4_sched_request r2 = rq;
        r2.stop = stops;
        r2.n_stop = 2;
        static struct outcome o;
        submit(&e, &r2, &o);
        run_all(&e, &o, 1);
        assert_int_equal(o.res.finish, DSV4_FINISH_STOP);
        assert_int_equal(o.res.stop_string, 1);
        assert_int_equal(o.res.stop_token, -1);
        assert_int_equal(o.res.text_len, first);
        assert_memory_equal(o.res_text, T, first);
        assert_int_equal(o.stream_len, first);
        assert_memory_equal(o.stream, T, first);
        /* the tokens stop with the one that completed the stop string */
        assert_true(o.res.n_tokens <= base.res.n_tokens);
        assert_memory_equal(o.res_tokens, base.res_tokens, sizeof(int32_t) * (size_t)o.res.n_tokens);

        /* only the never-completing one: the full text streams, with the prefix held back a while */
        r2.stop = stops;
        r2.n_stop = 1;
        static struct outcome o2;
        submit(&e, &r2, &o2);
        run_all(&e, &o2, 1);
        assert_int_equal(o2.res.finish, DSV4_FINISH_LENGTH);
        assert_int_equal(o2.stream_len, tl);
        assert_memory_equal(o2.stream, T, tl);
        env_close(&e);
    }
    assert_true(tried >= 6);
}

/* Streaming never shows a partial stop string: replay the deltas one event at a time. */
static void test_stop_holdback_per_event(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 1, 256, 64, 4);
    int32_t prompt[8];
    uint64_t st = 17;
    random_prompt(&st, prompt, 8);
    struct dsv4_sched_request rq = make_request(prompt, 8, 80, 0);
    static struct outcome base;
    submit(&e, &rq, &base);
    run_all(&e, &base, 1);
    const char *T = base.res_text;
    assert_true(base.res.text_len > 40);
    char stop[5];
    memcpy(stop, T + 30, 4);
    stop[4] = '\0';
    const char *stops[1] = { stop };
    rq.stop = stops;
    rq.n_stop = 1;
    uint64_t id;
    struct outcome o;
    memset(&o, 0, sizeof(o));
    rq.user = &o;
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), 0);
    o.id = id;
    size_t shown = 0;
    char text_so_far[TEXT_MAX];
    size_t raw_len = 0;
    for (int guard = 0; guard < 1000; guard++) {
        assert_true(dsv4_sched_step(e.s) >= 0);
        struct dsv4_sched_event ev;
        bool fin = false;
        while (dsv4_sched_next_event(e.s, &ev) == 1) {
            if (ev.type == DSV4_SCHED_EVENT_FINISH) {
                fin = true;
                assert_int_equal(ev.result->finish, DSV4_FINISH_STOP);
                assert_int_equal(shown, ev.result->text_len);
                assert_int_equal(dsv4_sched_release(e.s, id), 0);
                continue;
            }
            raw_len += (size_t)fake_token_bytes(NULL, ev.sample.token, text_so_far + raw_len,
                                                sizeof(text_so_far) - raw_len);
            shown += ev.delta_len;
            /* what is shown is always a prefix of the final text, i.e. before the stop string */
            assert_true(shown <= (size_t)(strstr(T, stop) - T));
            /* and holds back no more than the stop string's length - 1 (3) plus an incomplete
             * character (which the lossy reference shows as one U+FFFD, 3 bytes) */
            size_t ll;
            char *lossy = dsv4_utf8_lossy(text_so_far, raw_len, &ll);
            if (ll + 4 <= (size_t)(strstr(T, stop) - T))
                assert_true(ll - shown <= 3 + 3);
            free(lossy);
        }
        if (fin)
            break;
    }
    env_close(&e);
}

/* The last token of a request may leave an incomplete UTF-8 sequence, which the end of the text
 * shows as U+FFFD: that character is text like any other, so a stop string it completes stops the
 * request there (text cut before it), as when a token's own bytes complete one. */
static void test_stop_string_in_final_flush(void **state)
{
    static const char *const stops[1] = { "\xEF\xBF\xBD" };     /* U+FFFD */
    uint64_t st = 41;
    int found = 0;
    for (int attempt = 0; attempt < 60 && found < 3; attempt++) {
        int32_t prompt[10];
        random_prompt(&st, prompt, 10);
        struct dsv4_sched_request rq = make_request(prompt, 10, 120, 0);
        struct env e;
        env_open(&e, &FAKE_LONG, 1, 256, 64, 4);
        static struct outcome base;
        submit(&e, &rq, &base);
        run_all(&e, &base, 1);
        /* the first token that starts a sequence only a later token completes (0xC3, or E2 82),
         * with nothing shown as U+FFFD before it */
        char bytes[TEXT_MAX];
        size_t len = 0;
        int k = -1;
        for (int i = 0; i < base.res.n_tokens && k < 0; i++) {
            const int32_t t = base.res_tokens[i];
            if (t == 29 || t == 31) {
                k = i;
                break;
            }
            len += (size_t)fake_token_bytes(NULL, t, bytes + len, sizeof(bytes) - len);
            size_t ll;
            char *lossy = dsv4_utf8_lossy(bytes, len, &ll);
            const bool bad = memmem(lossy, ll, stops[0], 3) != NULL;
            free(lossy);
            if (bad)
                break;
        }
        if (k < 0) {
            env_close(&e);
            continue;
        }
        found++;
        /* ending right after that token: its bytes become the U+FFFD that completes the stop string */
        rq.max_tokens = k + 1;
        rq.stop = stops;
        rq.n_stop = 1;
        static struct outcome o;
        submit(&e, &rq, &o);
        run_all(&e, &o, 1);
        assert_int_equal(o.res.n_tokens, k + 1);
        assert_int_equal(o.res.finish, DSV4_FINISH_STOP);
        assert_int_equal(o.res.stop_string, 0);
        assert_int_equal(o.res.text_len, len);
        assert_memory_equal(o.res_text, bytes, len);
        assert_int_equal(o.stream_len, len);
        assert_memory_equal(o.stream, bytes, len);
        env_close(&e);
    }
    assert_true(found >= 3);
}

static void test_limits(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 2, 32, 8, 8);
    int32_t prompt[40];
    uint64_t st = 3;
    random_prompt(&st, prompt, 40);
    struct outcome o[4];
    /* max_tokens */
    struct dsv4_sched_request rq = make_request(prompt, 5, 7, 1);
    submit(&e, &rq, &o[0]);
    /* context: 20 prompt tokens in a 32-token context leave room for 12 generated ones */
    rq = make_request(prompt, 20, 0, 2);
    submit(&e, &rq, &o[1]);
    run_all(&e, o, 2);
    assert_int_equal(o[0].res.finish, DSV4_FINISH_LENGTH);
    assert_int_equal(o[0].res.n_tokens, 7);
    assert_int_equal(o[1].res.finish, DSV4_FINISH_CONTEXT);
    assert_int_equal(o[1].res.n_tokens, 32 - 20);
    assert_int_equal(o[1].res.prompt_tokens + o[1].res.completion_tokens, 32);
    /* a prompt one short of the context gets one token */
    rq = make_request(prompt, 31, 0, 0);
    submit(&e, &rq, &o[2]);
    run_all(&e, &o[2], 1);
    assert_int_equal(o[2].res.finish, DSV4_FINISH_CONTEXT);
    assert_int_equal(o[2].res.n_tokens, 1);
    /* refused at submit, with a message */
    uint64_t id;
    rq = make_request(prompt, 32, 0, 0);
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -E2BIG);
    assert_non_null(strstr(dsv4_error_message(), "max_context"));
    rq = make_request(prompt, 4, 33, 0);
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -E2BIG);
    int32_t badp[2] = { 5, VOCAB };
    rq = make_request(badp, 2, 4, 0);
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -EINVAL);
    rq = make_request(prompt, 4, 4, 0);
    const char *stops[1] = { "\xC3" };
    rq.stop = stops;
    rq.n_stop = 1;
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -EINVAL);
    rq.n_stop = DSV4_SCHED_STOP_STRINGS_MAX + 1;
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -E2BIG);
    rq = make_request(prompt, 4, 4, 0);
    rq.sampling.top_p = 2.0f;
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -EDOM);
    assert_non_null(strstr(dsv4_error_message(), "top_p"));
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.rejected, 6);
    assert_int_equal(stt.finished[DSV4_FINISH_LENGTH], 1);
    assert_int_equal(stt.finished[DSV4_FINISH_CONTEXT], 2);
    env_close(&e);
}

/* EOS and stop_token_ids end a request with STOP; the token counts, its text does not. */
static void test_stop_tokens(void **state)
{
    const struct fake_backend_opts eos_first = { VOCAB, EOS, 100.0f, 6.0f, 0, false, false, 0, 0 };
    struct env e;
    env_open(&e, &eos_first, 1, 64, 64, 4);
    int32_t prompt[6] = { 5, 6, 7, 8, 9, 10 };
    struct dsv4_sched_request rq = make_request(prompt, 6, 10, 1);
    struct outcome o;
    submit(&e, &rq, &o);
    run_all(&e, &o, 1);
    assert_int_equal(o.res.finish, DSV4_FINISH_STOP);
    assert_int_equal(o.res.stop_token, EOS);
    assert_int_equal(o.res.n_tokens, 1);
    assert_int_equal(o.res.text_len, 0);
    env_close(&e);

    env_open(&e, &FAKE_LONG, 1, 64, 64, 4);
    rq = make_request(prompt, 6, 20, 2);
    static struct outcome base, o2;
    submit(&e, &rq, &base);
    run_all(&e, &base, 1);
    int32_t stop_id = base.res_tokens[5];
    int first = 0;
    while (base.res_tokens[first] != stop_id)
        first++;
    rq.stop_token_ids = &stop_id;
    rq.n_stop_token_ids = 1;
    submit(&e, &rq, &o2);
    run_all(&e, &o2, 1);
    assert_int_equal(o2.res.finish, DSV4_FINISH_STOP);
    assert_int_equal(o2.res.stop_token, stop_id);
    assert_int_equal(o2.res.n_tokens, first + 1);
    assert_memory_equal(o2.res_tokens, base.res_tokens, sizeof(int32_t) * (size_t)(first + 1));
    env_close(&e);
}

static void test_cancel(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 2, 512, 16, 8);
    static int32_t prompt[300];
    uint64_t st = 8;
    random_prompt(&st, prompt, 300);
    static struct outcome o[3];
    /* in decode (admitted first: prefill goes oldest first) */
    struct dsv4_sched_request rq = make_request(prompt, 10, 400, 1);
    submit(&e, &rq, &o[1]);
    /* in prefill: 300 tokens at 16 a step */
    rq = make_request(prompt, 300, 50, 0);
    submit(&e, &rq, &o[0]);
    /* queued (both slots taken) */
    rq = make_request(prompt, 10, 400, 2);
    submit(&e, &rq, &o[2]);
    for (int i = 0; i < 5; i++)
        step(e.s);
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.slots_in_use, 2);
    assert_int_equal(stt.queued, 1);
    assert_true(o[1].n_tokens >= 3);
    assert_int_equal(o[0].n_tokens, 0);
    assert_int_equal(dsv4_sched_cancel(e.s, o[0].id), 0);
    assert_int_equal(dsv4_sched_cancel(e.s, o[1].id), 0);
    assert_int_equal(dsv4_sched_cancel(e.s, o[2].id), 0);
    step(e.s);
    for (int i = 0; i < 3; i++) {
        assert_true(o[i].finished);
        assert_int_equal(o[i].res.finish, DSV4_FINISH_CANCELLED);
    }
    assert_int_equal(o[0].res.n_tokens, 0);
    assert_true(o[1].res.n_tokens >= 3 && o[1].res.n_tokens == o[1].n_tokens);
    assert_int_equal(o[2].res.n_tokens, 0);
    assert_int_equal(dsv4_sched_cancel(e.s, o[1].id), -ENOENT);
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.slots_in_use, 0);
    assert_int_equal(stt.queued, 0);
    assert_int_equal(stt.unreleased, 0);
    assert_int_equal(stt.finished[DSV4_FINISH_CANCELLED], 3);
    assert_int_equal(fake_backend_position(e.b, 0), 0);
    assert_int_equal(fake_backend_position(e.b, 1), 0);
    env_close(&e);
}

/* A backend whose slots are dealt out over devices (slot groups): each admitted request goes to the
 * group with the fewest occupied slots (ties: the lower one), to that group's first free slot, and
 * stays there; a group count the slots cannot hold is refused at create. */
static void test_slot_groups(void **state)
{
    (void)state;
    struct fake_backend_opts fo = FAKE_LONG;
    fo.slot_groups = 2;
    struct env e;
    env_open(&e, &fo, 5, 512, 64, 16);      /* slots 0-2 the first group, 3-4 the second */
    static int32_t prompt[10];
    uint64_t st = 11;
    random_prompt(&st, prompt, 10);
    static struct outcome o[6];
    for (int i = 0; i < 3; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 10, 400, i);
        submit(&e, &rq, &o[i]);
    }
    for (int i = 0; i < 3; i++)
        step(e.s);
    /* admitted in order: group 0 (empty, lower), group 1 (0 against 1), group 0 (1 against 1) */
    const int64_t first[5] = { 1, 1, 0, 1, 0 };
    for (int slot = 0; slot < 5; slot++)
        assert_int_equal(fake_backend_position(e.b, slot) > 0, first[slot]);
    const int64_t pos3 = fake_backend_position(e.b, 3);
    step(e.s);
    assert_true(fake_backend_position(e.b, 3) > pos3);     /* request 1 decodes where it was placed */

    /* request 1 (slot 3) ends: group 1 is empty, so the next goes there, then again to group 1
     * (1 against 2), then to group 0's last slot (2 against 2) */
    assert_int_equal(dsv4_sched_cancel(e.s, o[1].id), 0);
    step(e.s);
    assert_true(o[1].finished);
    assert_int_equal(fake_backend_position(e.b, 3), 0);
    struct dsv4_sched_request rq = make_request(prompt, 10, 400, 3);
    submit(&e, &rq, &o[3]);
    step(e.s);
    assert_true(fake_backend_position(e.b, 3) > 0);
    assert_int_equal(fake_backend_position(e.b, 2), 0);
    assert_int_equal(fake_backend_position(e.b, 4), 0);
    rq = make_request(prompt, 10, 400, 4);
    submit(&e, &rq, &o[4]);
    step(e.s);
    assert_true(fake_backend_position(e.b, 4) > 0);
    assert_int_equal(fake_backend_position(e.b, 2), 0);
    rq = make_request(prompt, 10, 400, 5);
    submit(&e, &rq, &o[5]);
    step(e.s);
    assert_true(fake_backend_position(e.b, 2) > 0);
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.slots_in_use, 5);
    for (int i = 0; i < 6; i++)
        if (!o[i].finished)
            assert_int_equal(dsv4_sched_cancel(e.s, o[i].id), 0);
    step(e.s);
    env_close(&e);

    /* more groups than slots */
    struct dsv4_backend_opts bo = { .max_batch = 2, .max_context = 64 };
    struct dsv4_backend *b;
    struct dsv4_sched *s;
    fo.slot_groups = 3;
    assert_int_equal(fake_backend_create(&fo, &bo, &b), 0);
    struct dsv4_sched_limits lim = { .prefill_budget = 16, .max_requests = 4, .max_output_tokens = 32,
                                     .detok = { fake_token_bytes, NULL } };
    assert_int_equal(dsv4_sched_create(b, NULL, &lim, &s), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "3 devices"));
    dsv4_backend_destroy(b);
}

/* A long prompt arriving while others decode: every step still decodes every running sequence,
 * and no prefill call exceeds the budget. */
static void test_prefill_interleave(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 5, 1024, 32, 8);
    static int32_t prompt[600];
    uint64_t st = 11;
    random_prompt(&st, prompt, 600);
    static struct outcome o[5];
    for (int i = 0; i < 4; i++) {
        struct dsv4_sched_request rq = make_request(prompt + i, 8, 100, i);
        submit(&e, &rq, &o[i]);
    }
    for (int i = 0; i < 3; i++)
        step(e.s);
    struct dsv4_sched_request rq = make_request(prompt, 600, 10, 0);
    submit(&e, &rq, &o[4]);
    int before[4];
    for (int k = 0; k < 600 / 32 + 2; k++) {
        for (int i = 0; i < 4; i++)
            before[i] = o[i].n_tokens;
        step(e.s);
        for (int i = 0; i < 4; i++)
            assert_int_equal(o[i].n_tokens, before[i] + 1);
    }
    assert_true(o[4].n_tokens >= 1);
    struct fake_backend_counters c;
    fake_backend_counters(e.b, &c);
    assert_int_equal(c.max_prefill_chunk, 32);
    run_all(&e, o, 5);
    env_close(&e);
}

static void pause_ms(int ms)
{
    struct timespec ts = { 0, ms * 1000000L };
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

/* Where the engine's time goes (stats backend_s, gap_s): the fake sleeps 100 us a prefilled token,
 * so a 60-token prompt is at least 6 ms inside the backend; a pause between two steps while the
 * request runs is the loop's gap, and a pause once nothing runs is nobody's. */
static void test_engine_time(void **state)
{
    const struct fake_backend_opts fo = { VOCAB, EOS, -100.0f, 6.0f, 0, false, false, 100, 0 };
    static int32_t prompt[60];
    static struct outcome o[1];
    struct dsv4_sched_stats st;
    struct env e;
    uint64_t seed = 5;
    (void)state;
    env_open(&e, &fo, 1, 256, 64, 2);
    random_prompt(&seed, prompt, 60);
    struct dsv4_sched_request rq = make_request(prompt, 60, 4, 0);
    submit(&e, &rq, &o[0]);
    step(e.s);                          /* the prompt */
    pause_ms(20);                       /* the request is running: a gap */
    step(e.s);
    dsv4_sched_get_stats(e.s, &st);
    assert_true(st.backend_s >= 0.006);
    assert_true(st.backend_s <= st.busy_s);
    assert_true(st.gap_s >= 0.020);
    assert_true(st.gap_s < 1.0);
    run_all(&e, o, 1);
    dsv4_sched_get_stats(e.s, &st);
    const double gap = st.gap_s, busy = st.busy_s;
    pause_ms(20);                       /* nothing runs: not a gap */
    submit(&e, &rq, &o[0]);
    step(e.s);
    dsv4_sched_get_stats(e.s, &st);
    assert_true(st.gap_s == gap);
    assert_true(st.busy_s > busy);
    run_all(&e, o, 1);
    env_close(&e);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* h holds exactly the observations v[0..n): each in the bucket its bounds say, their seconds summed. */
static void expect_latency(const struct dsv4_sched_latency *h, const double *v, int n, const char *what)
{
    uint64_t want[DSV4_SCHED_LATENCY_BOUNDS + 1] = { 0 }, total = 0;
    double sum = 0;
    for (int k = 0; k < n; k++) {
        int i = 0;
        while (i < DSV4_SCHED_LATENCY_BOUNDS && v[k] > dsv4_sched_latency_bounds_s[i])
            i++;
        want[i]++;
        sum += v[k];
    }
    if (h->count != (uint64_t)n)
        fail_msg("%s: count %llu, expected %d", what, (unsigned long long)h->count, n);
    for (int i = 0; i <= DSV4_SCHED_LATENCY_BOUNDS; i++) {
        if (h->buckets[i] != want[i])
            fail_msg("%s: bucket %d holds %llu, expected %llu", what, i, (unsigned long long)h->buckets[i],
                     (unsigned long long)want[i]);
        total += h->buckets[i];
    }
    assert_int_equal(total, h->count);
    assert_true(fabs(h->sum_s - sum) <= 1e-9 * (1 + sum));
}

/* The latency histograms (stats queue, ttft, tpot, e2e) observe each request that got a slot once, as
 * it leaves it: a 1-token request is in ttft but not tpot, one cancelled in prefill in queue and e2e
 * only, one cancelled after tokens in all four, one cancelled while queued in none; each observation
 * is its result's timings, in the bucket the shared bounds say, and no sum exceeds count times the
 * wall time around the run. */
static void test_latency_hist(void **state)
{
    const struct fake_backend_opts fo = { VOCAB, EOS, -100.0f, 6.0f, 0, false, false, 20, 0 };
    static int32_t prompt[300];
    static struct outcome o[5];
    struct dsv4_sched_stats st;
    struct env e;
    uint64_t seed = 12;
    (void)state;
    for (int i = 1; i < DSV4_SCHED_LATENCY_BOUNDS; i++)
        assert_true(dsv4_sched_latency_bounds_s[i] > dsv4_sched_latency_bounds_s[i - 1]);
    env_open(&e, &fo, 2, 512, 16, 8);
    random_prompt(&seed, prompt, 300);
    const double t0 = now_s();
    struct dsv4_sched_request rq = make_request(prompt, 10, 1, 0);     /* one token */
    submit(&e, &rq, &o[0]);
    rq = make_request(prompt, 12, 5, 1);                                /* five */
    submit(&e, &rq, &o[1]);
    run_all(&e, o, 2);
    assert_int_equal(o[0].res.completion_tokens, 1);
    assert_int_equal(o[1].res.completion_tokens, 5);
    rq = make_request(prompt, 10, 400, 2);                              /* cancelled after tokens */
    submit(&e, &rq, &o[2]);
    rq = make_request(prompt, 300, 50, 0);                              /* cancelled in prefill */
    submit(&e, &rq, &o[3]);
    rq = make_request(prompt, 10, 400, 3);                              /* cancelled while queued */
    submit(&e, &rq, &o[4]);
    for (int i = 0; i < 5; i++)
        step(e.s);
    assert_true(o[2].n_tokens >= 3);
    assert_int_equal(o[3].n_tokens, 0);
    for (int i = 2; i < 5; i++)
        assert_int_equal(dsv4_sched_cancel(e.s, o[i].id), 0);
    run_all(&e, o, 5);
    const double wall = now_s() - t0;
    dsv4_sched_get_stats(e.s, &st);
    assert_int_equal(st.finished[DSV4_FINISH_CANCELLED], 3);
    assert_int_equal(o[4].res.timings.admit_ns, 0);

    double queue[5], ttft[5], tpot[5], e2e[5];
    int nq = 0, nt = 0, np = 0, ne = 0;
    for (int i = 0; i < 4; i++) {
        const struct dsv4_sched_timings *tm = &o[i].res.timings;
        queue[nq++] = tm->queue_s;
        if (tm->first_token_ns)
            ttft[nt++] = (double)(tm->first_token_ns - tm->submit_ns) * 1e-9;
        if (o[i].res.completion_tokens >= 2)
            tpot[np++] = tm->decode_s / (o[i].res.completion_tokens - 1);
        e2e[ne++] = (double)(tm->finish_ns - tm->submit_ns) * 1e-9;
    }
    assert_int_equal(nt, 3);
    assert_int_equal(np, 2);
    expect_latency(&st.queue, queue, nq, "queue");
    expect_latency(&st.ttft, ttft, nt, "ttft");
    expect_latency(&st.tpot, tpot, np, "tpot");
    expect_latency(&st.e2e, e2e, ne, "e2e");
    const struct dsv4_sched_latency *h[] = { &st.queue, &st.ttft, &st.tpot, &st.e2e };
    for (int k = 0; k < 4; k++) {
        assert_true(h[k]->sum_s > 0);
        assert_true(h[k]->sum_s <= (double)h[k]->count * wall);
    }
    /* every e2e is at least its queue and ttft */
    assert_true(st.e2e.sum_s >= st.queue.sum_s && st.e2e.sum_s >= st.ttft.sum_s);
    env_close(&e);
}

/* decode_stall_ms: while streams decode, a step prefills what the measured rate fits in the bound
 * (the fake sleeps 100 us a prefilled token, so 20 ms fit at most 200 tokens, fewer when the step's
 * own overhead shows in the rate); with nothing decoding, the whole budget. */
static void test_decode_stall(void **state)
{
    const struct fake_backend_opts fo = { VOCAB, EOS, -100.0f, 6.0f, 0, false, false, 100, 0 };
    const int budget = 1024, fit = 20 * 1000 / 100;
    static int32_t prompt[1500];
    static struct outcome o[6];
    struct fake_backend_counters c;
    struct env e;
    uint64_t st = 17;

    env_decode_stall_ms = 20;
    env_open(&e, &fo, 5, 4096, budget, 12);
    env_decode_stall_ms = 0;
    random_prompt(&st, prompt, 1500);
    /* no rate measured yet, nothing decoding: a 300-token prompt in one chunk */
    struct dsv4_sched_request rq = make_request(prompt, 300, 1, 0);
    submit(&e, &rq, &o[5]);
    run_all(&e, &o[5], 1);
    fake_backend_counters(e.b, &c);
    assert_int_equal(c.max_prefill_chunk, 300);
    /* four streams decoding, then a 1500-token prompt: its chunks fit the bound, every stream moves
     * each step */
    for (int i = 0; i < 4; i++) {
        rq = make_request(prompt + 100 + i, 8, 400, i);
        submit(&e, &rq, &o[i]);
    }
    for (int i = 0; i < 2; i++)
        step(e.s);
    rq = make_request(prompt, 1500, 4, 0);
    submit(&e, &rq, &o[4]);
    int steps = 0, before[4];
    while (o[4].n_tokens == 0) {
        for (int i = 0; i < 4; i++)
            before[i] = o[i].n_tokens;
        step(e.s);
        steps++;
        fake_backend_counters(e.b, &c);
        /* fewer than the smallest chunk only for what was left of the prompt (its first token came) */
        if (c.last_prefill_chunk > fit || (c.last_prefill_chunk < DSV4_SCHED_STALL_MIN_TOKENS && o[4].n_tokens == 0))
            fail_msg("step %d prefilled %d tokens while 4 streams decode (bound %d)", steps, c.last_prefill_chunk, fit);
        for (int i = 0; i < 4; i++)
            assert_int_equal(o[i].n_tokens, before[i] + 1);
        assert_true(steps < 1500 / DSV4_SCHED_STALL_MIN_TOKENS + 2);
    }
    print_message("a 1500-token prompt beside 4 decoding streams: %d steps of at most %d tokens\n", steps, fit);
    assert_true(steps >= 1500 / fit);
    for (int i = 0; i < 4; i++)
        assert_int_equal(dsv4_sched_cancel(e.s, o[i].id), 0);
    run_all(&e, o, 5);
    /* nothing decoding again: the whole budget */
    rq = make_request(prompt, 1400, 1, 0);
    submit(&e, &rq, &o[5]);
    step(e.s);
    fake_backend_counters(e.b, &c);
    assert_int_equal(c.last_prefill_chunk, budget);
    run_all(&e, &o[5], 1);
    env_close(&e);
}

/* decode_stall_ms before any rate is measured (the streams' own prompts were too short to measure
 * one, as after a warm-up on a few tokens): a long prompt arriving beside decoding streams takes the
 * smallest chunk, which measures the rate, not a whole prefill_budget. */
static void test_decode_stall_unmeasured(void **state)
{
    const struct fake_backend_opts fo = { VOCAB, EOS, -100.0f, 6.0f, 0, false, false, 100, 0 };
    const int budget = 1024, fit = 20 * 1000 / 100;
    static int32_t prompt[1500];
    static struct outcome o[5];
    struct fake_backend_counters c;
    struct env e;
    uint64_t st = 23;

    (void)state;
    env_decode_stall_ms = 20;
    env_open(&e, &fo, 5, 4096, budget, 12);
    env_decode_stall_ms = 0;
    random_prompt(&st, prompt, 1500);
    for (int i = 0; i < 4; i++) {
        struct dsv4_sched_request rq = make_request(prompt + 100 + i, DSV4_SCHED_STALL_MIN_TOKENS - 1, 400, i);
        submit(&e, &rq, &o[i]);
    }
    for (int i = 0; i < 2; i++)
        step(e.s);
    struct dsv4_sched_request rq = make_request(prompt, 1500, 4, 0);
    submit(&e, &rq, &o[4]);
    for (int steps = 1; o[4].n_tokens == 0; steps++) {
        step(e.s);
        fake_backend_counters(e.b, &c);
        if (c.last_prefill_chunk > fit)
            fail_msg("step %d prefilled %d tokens while 4 streams decode (bound %d)", steps, c.last_prefill_chunk,
                     fit);
        assert_true(steps < 1500 / DSV4_SCHED_STALL_MIN_TOKENS + 2);
    }
    for (int i = 0; i < 4; i++)
        assert_int_equal(dsv4_sched_cancel(e.s, o[i].id), 0);
    run_all(&e, o, 5);
    env_close(&e);
}

static void test_drain(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 2, 256, 64, 8);
    int32_t prompt[10] = { 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 };
    static struct outcome o[4];
    for (int i = 0; i < 4; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 10, 20, i);
        submit(&e, &rq, &o[i]);
    }
    step(e.s);
    /* a generous grace: running ones finish, queued ones are cancelled */
    dsv4_sched_drain(e.s, 3600.0);
    uint64_t id;
    struct dsv4_sched_request rq = make_request(prompt, 10, 20, 0);
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -ESHUTDOWN);
    run_all(&e, o, 4);
    assert_int_equal(o[0].res.finish, DSV4_FINISH_LENGTH);
    assert_int_equal(o[1].res.finish, DSV4_FINISH_LENGTH);
    assert_int_equal(o[2].res.finish, DSV4_FINISH_CANCELLED);
    assert_int_equal(o[3].res.finish, DSV4_FINISH_CANCELLED);
    assert_true(dsv4_sched_drained(e.s));
    env_close(&e);

    /* no grace: running ones are cancelled at the next step */
    env_open(&e, &FAKE_LONG, 2, 256, 64, 8);
    for (int i = 0; i < 2; i++) {
        rq = make_request(prompt, 10, 200, i);
        submit(&e, &rq, &o[i]);
    }
    step(e.s);
    step(e.s);
    assert_false(dsv4_sched_drained(e.s));
    dsv4_sched_drain(e.s, 0.0);
    step(e.s);
    assert_true(o[0].finished && o[1].finished);
    assert_int_equal(o[0].res.finish, DSV4_FINISH_CANCELLED);
    assert_int_equal(o[0].res.n_tokens, 2);
    assert_true(dsv4_sched_drained(e.s));
    env_close(&e);
}

/* 200 requests of every kind arriving at random, some cancelled at random moments, a few submits
 * refused while the engine is full: at the end every slot is free, nothing is queued or held, and
 * no scheduler call allocated. Finished answers are checked against the oracle (the request alone).
 * Run with the host sampler pool and with the backend sampling its own rows (the CUDA backend's
 * path: no logits copied to the scheduler). */
static void random_workload(const struct fake_backend_opts *fo)
{
    enum { N = 200 };
    struct env e;
    env_sampler_threads = 3;    /* decode rows sampled on three threads (host sampling) */
    env_open(&e, fo, 8, 192, 40, 24);
    env_sampler_threads = 0;
    struct dsv4_sched_stats st0;
    dsv4_sched_get_stats(e.s, &st0);
    static int32_t prompts[N][100];
    static struct outcome o[N];
    static struct dsv4_sched_request rq[N];
    uint64_t rs = 2024;
    int submitted = 0, refused = 0;
    long allocs0 = wrapped_allocs;
    bool cancel_at[N];
    for (int t = 0;; t++) {
        rs = rs * 6364136223846793005ull + 1442695040888963407ull;
        int arrivals = (int)((rs >> 40) % 4);
        for (int a = 0; a < arrivals && submitted < N; a++) {
            int i = submitted;
            int len = 1 + (int)((rs >> (8 + a)) % 99);
            random_prompt(&rs, prompts[i], len);
            rq[i] = make_request(prompts[i], len, (int)((rs >> 20) % 60), i);
            cancel_at[i] = (rs >> 50) % 5 == 0;
            struct dsv4_sched_request r = rq[i];
            memset(&o[i], 0, sizeof(o[i]));
            r.user = &o[i];
            counting = 1;
            int rc = dsv4_sched_submit(e.s, &r, &o[i].id);
            counting = 0;
            if (rc == -EAGAIN) {
                refused++;
                break;
            }
            assert_int_equal(rc, 0);
            submitted++;
        }
        for (int i = 0; i < submitted; i++) {
            rs = rs * 6364136223846793005ull + 1442695040888963407ull;
            if (cancel_at[i] && !o[i].finished && (rs >> 60) == 0) {
                counting = 1;
                int rc = dsv4_sched_cancel(e.s, o[i].id);
                counting = 0;
                assert_true(rc == 0 || rc == -ENOENT);
                cancel_at[i] = false;
            }
        }
        step(e.s);
        int done = 0;
        for (int i = 0; i < submitted; i++)
            done += o[i].finished;
        if (submitted == N && done == N)
            break;
        assert_true(t < 200000);
    }
    assert_int_equal(wrapped_allocs, allocs0);
    struct dsv4_sched_stats st1;
    dsv4_sched_get_stats(e.s, &st1);
    assert_int_equal(st1.allocations, st0.allocations);
    assert_int_equal(st1.slots_in_use, 0);
    assert_int_equal(st1.queued, 0);
    assert_int_equal(st1.unreleased, 0);
    assert_int_equal(st1.events_pending, 0);
    assert_int_equal(st1.submitted, N);
    uint64_t fin = 0;
    for (int r = 0; r <= DSV4_FINISH_ERROR; r++)
        fin += st1.finished[r];
    assert_int_equal(fin, N);
    assert_int_equal(st1.finished[DSV4_FINISH_ERROR], 0);
    assert_true(st1.finished[DSV4_FINISH_CANCELLED] > 0);
    uint64_t hist = 0;
    for (int k = 0; k < DSV4_SCHED_BATCH_BUCKETS; k++)
        hist += st1.batch_hist[k];
    assert_int_equal(hist, st1.decode_steps);
    assert_true(st1.batch_hist[3] > 0);     /* batches of 5-8 happened */
    for (int k = 0; k < 8; k++)
        assert_int_equal(fake_backend_position(e.b, k), 0);
    int checked = 0;
    for (int i = 0; i < N; i++) {
        if (o[i].res.finish == DSV4_FINISH_CANCELLED)
            continue;
        int32_t want[OUT_MAX];
        int n = oracle(&e.fo, &rq[i], 192, want, OUT_MAX, o[i].res.seed);
        assert_same_tokens(&o[i], want, n);
        assert_int_equal(o[i].stream_len, o[i].res.text_len);
        checked++;
    }
    assert_true(checked > N / 2);
    (void)refused;
    env_close(&e);
}

static void test_random_workload(void **state)
{
    random_workload(&FAKE_EOS);
}

static void test_random_workload_device_sampling(void **state)
{
    random_workload(&FAKE_EOS_DEVICE);
}

/* Unseeded requests report the seed they used; resubmitting with it repeats the tokens. */
static void test_reported_seed(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 2, 128, 64, 4);
    int32_t prompt[5] = { 9, 8, 7, 6, 5 };
    struct dsv4_sched_request rq = make_request(prompt, 5, 25, 3);
    rq.sampling.has_seed = false;
    static struct outcome a, b, c;
    submit(&e, &rq, &a);
    submit(&e, &rq, &b);
    run_all(&e, &a, 1);
    run_all(&e, &b, 1);
    assert_true(a.res.seed != b.res.seed);
    rq.sampling.has_seed = true;
    rq.sampling.seed = a.res.seed;
    submit(&e, &rq, &c);
    run_all(&e, &c, 1);
    assert_same_tokens(&c, a.res_tokens, a.res.n_tokens);
    env_close(&e);
}

/* The fake vocabulary with every odd id past 40 unknown to the detokenizer, as a model vocabulary
 * padded past its tokenizer's. */
static int padded_token_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    if (id > 40 && id % 2)
        return dsv4_error_set(-ERANGE, "id %d is past the tokenizer", id);
    return fake_token_bytes(ctx, id, buf, cap);
}

/* Such an id is a token with no text: streamed with an empty delta, and generation goes on. */
static void test_unknown_id_text(void **state)
{
    struct dsv4_backend_opts bo = { .max_batch = 2, .max_context = 128 };
    struct env e = { .fo = FAKE_LONG };
    assert_int_equal(fake_backend_create(&FAKE_LONG, &bo, &e.b), 0);
    struct dsv4_sched_limits lim = { .max_output_tokens = 128, .detok = { padded_token_bytes, NULL } };
    assert_int_equal(dsv4_sched_create(e.b, NULL, &lim, &e.s), 0);
    int32_t prompt[4] = { 2, 3, 4, 5 };
    static struct outcome o[2];
    for (int i = 0; i < 2; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 4, 60, 1 + 4 * i);
        rq.sampling.temperature = 2.0f;     /* flat rows: unknown ids get drawn */
        submit(&e, &rq, &o[i]);
    }
    run_all(&e, o, 2);
    int unknown = 0;
    for (int i = 0; i < 2; i++) {
        assert_int_equal(o[i].res.finish, DSV4_FINISH_LENGTH);
        assert_int_equal(o[i].n_tokens, 60);
        char raw[TEXT_MAX];
        size_t rl = 0, wl;
        for (int k = 0; k < o[i].n_tokens; k++) {
            int32_t id = o[i].tokens[k];
            if (id > 40 && id % 2)
                unknown++;
            else
                rl += (size_t)fake_token_bytes(NULL, id, raw + rl, sizeof(raw) - rl);
        }
        /* The text is the known ids' bytes made valid UTF-8, streamed and in the result alike. */
        char *want = dsv4_utf8_lossy(raw, rl, &wl);
        assert_int_equal(o[i].stream_len, wl);
        assert_memory_equal(o[i].stream, want, wl);
        assert_int_equal(o[i].res.text_len, wl);
        assert_memory_equal(o[i].res_text, want, wl);
        free(want);
    }
    assert_true(unknown > 0);
    env_close(&e);
}

/* With a real tokenizer (a hand-made byte-level file: ids 0-255 are bytes, 256 "<s>" special and
 * the model's EOS, 257 "<x>" not special): the text is what the tokenizer decodes, specials
 * skipped, made valid UTF-8 as from_utf8_lossy. */
static void test_tokenizer_text(void **state)
{
    /* GPT-2 byte-level symbols: printable Latin-1 bytes stand for themselves, the rest for 256+k */
    json_t *vocab = json_object();
    int shifted = 0;
    for (int b = 0; b < 256; b++) {
        bool plain = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        uint32_t cp = plain ? (uint32_t)b : 256u + (uint32_t)shifted++;
        char sym[4] = { 0 };
        if (cp < 0x80)
            sym[0] = (char)cp;
        else {
            sym[0] = (char)(0xC0 | (cp >> 6));
            sym[1] = (char)(0x80 | (cp & 0x3F));
        }
        json_object_set_new(vocab, sym, json_integer(b));
    }
    json_t *spec = json_pack(
        "{s:s, s:[{s:i, s:s, s:b, s:b, s:b, s:b, s:b}, {s:i, s:s, s:b, s:b, s:b, s:b, s:b}],"
        " s:n, s:{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]},"
        " s:{s:s}, s:{s:s, s:o, s:[]}}",
        "version", "1.0",
        "added_tokens", "id", 256, "content", "<s>", "single_word", 0, "lstrip", 0, "rstrip", 0,
        "normalized", 0, "special", 1, "id", 257, "content", "<x>", "single_word", 0, "lstrip", 0,
        "rstrip", 0, "normalized", 0, "special", 0,
        "normalizer",
        "pre_tokenizer", "type", "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex", "\\s+",
        "behavior", "Isolated", "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
        "use_regex", 0,
        "decoder", "type", "ByteLevel",
        "model", "type", "BPE", "vocab", vocab, "merges");
    assert_non_null(spec);
    char path[] = "/tmp/dsv4-test-sched-tokenizer-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(json_dump_file(spec, path, 0), 0);
    json_decref(spec);
    struct dsv4_tokenizer *tok;
    int r = dsv4_tokenizer_load(path, &tok);
    unlink(path);
    if (r < 0)
        fail_msg("tokenizer: %s", dsv4_error_message());

    const struct fake_backend_opts fo = { 258, 256, -2.0f, 3.0f, 0, false, false, 0, 0 };
    struct dsv4_backend_opts bo = { .max_batch = 2, .max_context = 256 };
    struct dsv4_backend *b;
    assert_int_equal(fake_backend_create(&fo, &bo, &b), 0);
    struct dsv4_sched *s;
    if (dsv4_sched_create(b, tok, NULL, &s) < 0)
        fail_msg("create: %s", dsv4_error_message());
    int32_t prompt[4] = { 'a', 'b', 257, 'c' };
    static struct outcome o[6];
    for (int i = 0; i < 6; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 4, 60, i);
        memset(&o[i], 0, sizeof(o[i]));
        rq.user = &o[i];
        assert_int_equal(dsv4_sched_submit(s, &rq, &o[i].id), 0);
    }
    for (int guard = 0; guard < 1000; guard++) {
        int done = 0;
        for (int i = 0; i < 6; i++)
            done += o[i].finished;
        if (done == 6)
            break;
        assert_true(dsv4_sched_step(s) >= 0);
        drain_events(s);
    }
    for (int i = 0; i < 6; i++) {
        assert_true(o[i].finished);
        char *bytes;
        size_t len, ll;
        assert_int_equal(dsv4_tokenizer_decode(tok, o[i].res_tokens, (size_t)o[i].res.n_tokens,
                                               DSV4_TOK_DECODE_SKIP_SPECIAL, &bytes, &len), 0);
        char *lossy = dsv4_utf8_lossy(bytes, len, &ll);
        assert_int_equal(o[i].res.text_len, ll);
        assert_memory_equal(o[i].res_text, lossy, ll);
        assert_int_equal(o[i].stream_len, ll);
        assert_memory_equal(o[i].stream, lossy, ll);
        free(lossy);
        free(bytes);
    }
    dsv4_sched_destroy(s);
    dsv4_backend_destroy(b);
    dsv4_tokenizer_free(tok);
}

/* A backend failure ends the requests it hit with ERROR and a message; their slots come back and
 * the next requests run (here the failure is injected once 30 tokens went in). */
static void test_backend_error(void **state)
{
    const struct fake_backend_opts failing = { VOCAB, EOS, -100.0f, 6.0f, 30, false, false, 0, 0 };
    struct env e;
    env_open(&e, &failing, 2, 128, 64, 8);
    int32_t prompt[10] = { 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 };
    static struct outcome o[3];
    for (int i = 0; i < 2; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 10, 40, i);
        submit(&e, &rq, &o[i]);
    }
    run_all(&e, o, 2);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(o[i].res.finish, DSV4_FINISH_ERROR);
        assert_int_equal(o[i].res.error, -EIO);
        assert_non_null(strstr(o[i].res.error_message, "decode"));
        assert_true(o[i].res.n_tokens >= 1);
    }
    /* a prompt that cannot even be prefilled */
    struct dsv4_sched_request rq = make_request(prompt, 10, 40, 0);
    submit(&e, &rq, &o[2]);
    run_all(&e, &o[2], 1);
    assert_int_equal(o[2].res.finish, DSV4_FINISH_ERROR);
    assert_non_null(strstr(o[2].res.error_message, "prefill"));
    assert_int_equal(o[2].res.n_tokens, 0);
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.slots_in_use, 0);
    assert_int_equal(stt.finished[DSV4_FINISH_ERROR], 3);
    env_close(&e);
}

/* The engine thread runs dsv4_sched_run(); this thread submits, waits on the eventfd, cancels. */
struct runner {
    struct dsv4_sched *s;
    int rc;
};

static void *run_thread(void *arg)
{
    struct runner *r = arg;
    r->rc = dsv4_sched_run(r->s);
    return NULL;
}

/* A fatal backend error (-ENOTRECOVERABLE, a sticky device fault) ends every request, running and
 * queued, with that error; new ones are refused; the engine thread's loop returns the error. */
static void test_backend_fatal(void **state)
{
    const struct fake_backend_opts faulty = { VOCAB, EOS, -100.0f, 6.0f, 40, false, true, 0, 0 };
    struct env e;
    env_open(&e, &faulty, 2, 128, 64, 8);
    int32_t prompt[10] = { 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 };
    static struct outcome o[5];
    for (int i = 0; i < 5; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 10, 60, i);
        submit(&e, &rq, &o[i]);
    }
    struct runner run = { e.s, 0 };
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, run_thread, &run), 0);
    int done = 0;
    for (int guard = 0; done < 5 && guard < 10000; guard++) {
        struct pollfd p = { dsv4_sched_event_fd(e.s), POLLIN, 0 };
        poll(&p, 1, 100);
        uint64_t n;
        (void)!read(dsv4_sched_event_fd(e.s), &n, sizeof(n));
        drain_events(e.s);
        done = 0;
        for (int i = 0; i < 5; i++)
            done += o[i].finished;
    }
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(run.rc, -ENOTRECOVERABLE);
    for (int i = 0; i < 5; i++) {
        assert_true(o[i].finished);
        assert_int_equal(o[i].res.finish, DSV4_FINISH_ERROR);
        assert_int_equal(o[i].res.error, -ENOTRECOVERABLE);
        assert_non_null(strstr(o[i].res.error_message, "the engine failed"));
        assert_non_null(strstr(o[i].res.error_message, "injected device fault"));
    }
    /* two ran (and generated before the fault), three never got a slot */
    assert_true(o[0].res.n_tokens >= 1 && o[1].res.n_tokens >= 1);
    assert_int_equal(o[2].res.n_tokens + o[3].res.n_tokens + o[4].res.n_tokens, 0);
    uint64_t id;
    struct dsv4_sched_request rq = make_request(prompt, 10, 4, 0);
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -ENOTRECOVERABLE);
    assert_non_null(strstr(dsv4_error_message(), "the engine has failed"));
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.slots_in_use, 0);
    assert_int_equal(stt.queued, 0);
    assert_int_equal(stt.finished[DSV4_FINISH_ERROR], 5);
    env_close(&e);
}

static void test_engine_thread(void **state)
{
    struct env e;
    env_sampler_threads = 2;
    env_open(&e, &FAKE_LONG, 4, 256, 32, 16);
    env_sampler_threads = 0;
    struct runner rn = { e.s, -1 };
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, run_thread, &rn), 0);
    static int32_t prompt[50];
    uint64_t st = 4;
    random_prompt(&st, prompt, 50);
    static struct outcome o[10];
    struct dsv4_sched_request rq[10];
    for (int i = 0; i < 10; i++) {
        rq[i] = make_request(prompt, 10 + 4 * i, i == 9 ? 0 : 30, i);
        struct dsv4_sched_request r = rq[i];
        memset(&o[i], 0, sizeof(o[i]));
        r.user = &o[i];
        assert_int_equal(dsv4_sched_submit(e.s, &r, &o[i].id), 0);
    }
    int fd = dsv4_sched_event_fd(e.s);
    bool cancelled = false;
    for (int guard = 0; guard < 100000; guard++) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        assert_true(poll(&p, 1, 10000) == 1);
        uint64_t v;
        assert_int_equal(read(fd, &v, sizeof(v)), sizeof(v));
        drain_events(e.s);
        if (!cancelled && o[9].n_tokens >= 2) {
            assert_int_equal(dsv4_sched_cancel(e.s, o[9].id), 0);
            cancelled = true;
        }
        int done = 0;
        for (int i = 0; i < 10; i++)
            done += o[i].finished;
        if (done == 10)
            break;
    }
    dsv4_sched_stop(e.s);
    pthread_join(th, NULL);
    assert_int_equal(rn.rc, 0);
    for (int i = 0; i < 9; i++) {
        assert_int_equal(o[i].res.finish, DSV4_FINISH_LENGTH);
        int32_t want[OUT_MAX];
        int n = oracle(&e.fo, &rq[i], 256, want, OUT_MAX, o[i].res.seed);
        assert_same_tokens(&o[i], want, n);
        assert_true(o[i].res.timings.queue_s >= 0 && o[i].res.timings.decode_s > 0);
        assert_true(o[i].res.timings.first_token_ns >= o[i].res.timings.admit_ns);
    }
    assert_int_equal(o[9].res.finish, DSV4_FINISH_CANCELLED);
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_int_equal(stt.slots_in_use, 0);
    assert_true(stt.tokens_per_s > 0);
    env_close(&e);
}

/* A reader that falls behind: steps refuse with -EAGAIN once the event ring cannot hold a step's
 * events, nothing is lost, and the answers are the oracle's. */
static void test_event_backpressure(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 4, 256, 64, 8);
    int32_t prompt[12];
    uint64_t st = 21;
    random_prompt(&st, prompt, 12);
    static struct outcome o[4];
    struct dsv4_sched_request rq[4];
    for (int i = 0; i < 4; i++) {
        rq[i] = make_request(prompt, 6 + i, 60, i);
        submit(&e, &rq[i], &o[i]);
    }
    int steps = 0, r;
    while ((r = dsv4_sched_step(e.s)) == 1)
        steps++;
    assert_int_equal(r, -EAGAIN);
    assert_true(steps >= 5);
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    assert_true(stt.events_pending >= 4 * steps);
    drain_events(e.s);
    run_all(&e, o, 4);
    for (int i = 0; i < 4; i++) {
        int32_t want[OUT_MAX];
        int n = oracle(&e.fo, &rq[i], 256, want, OUT_MAX, o[i].res.seed);
        assert_same_tokens(&o[i], want, n);
        assert_int_equal(o[i].stream_len, o[i].res.text_len);
    }
    env_close(&e);
}

/* dsv4_sched_run() returns once a drain has ended everything. */
static void test_run_drain(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 2, 256, 32, 8);
    int32_t prompt[8] = { 2, 4, 6, 8, 10, 12, 14, 16 };
    static struct outcome o[4];
    for (int i = 0; i < 4; i++) {
        struct dsv4_sched_request rq = make_request(prompt, 8, 0, i);
        submit(&e, &rq, &o[i]);
    }
    struct runner rn = { e.s, -1 };
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, run_thread, &rn), 0);
    dsv4_sched_drain(e.s, 0.0);
    /* The engine may have filled the event ring before the drain reached it; it can only end the
     * requests once events are taken, so take them (as the daemon's io thread does) until it returns. */
    while (pthread_tryjoin_np(th, NULL) == EBUSY) {
        drain_events(e.s);
        nanosleep(&(struct timespec){ 0, 1000000 }, NULL);
    }
    assert_int_equal(rn.rc, 0);
    assert_true(dsv4_sched_drained(e.s));
    drain_events(e.s);
    for (int i = 0; i < 4; i++) {
        assert_true(o[i].finished);
        assert_int_equal(o[i].res.finish, DSV4_FINISH_CANCELLED);
    }
    env_close(&e);
}

/* dsv4_sched_run_between: the call runs once, on the engine thread, even with nothing to decode (the
 * idle loop wakes for it); a second call while the first is pending is refused with -EBUSY, and no
 * function is -EINVAL. */
struct between {
    pthread_t engine;
    pthread_t ran_on;
    int runs;
};

static void between_fn(void *arg)
{
    struct between *b = arg;
    b->ran_on = pthread_self();
    __atomic_add_fetch(&b->runs, 1, __ATOMIC_SEQ_CST);
}

static void test_run_between(void **state)
{
    struct env e;
    env_open(&e, &FAKE_LONG, 2, 256, 32, 8);
    struct between b = { 0 };
    assert_int_equal(dsv4_sched_run_between(e.s, NULL, &b), -EINVAL);
    assert_int_equal(dsv4_sched_run_between(e.s, between_fn, &b), 0);
    assert_int_equal(dsv4_sched_run_between(e.s, between_fn, &b), -EBUSY);     /* the loop has not run yet */
    struct runner rn = { e.s, -1 };
    assert_int_equal(pthread_create(&b.engine, NULL, run_thread, &rn), 0);
    for (int guard = 0; __atomic_load_n(&b.runs, __ATOMIC_SEQ_CST) == 0 && guard < 5000; guard++)
        nanosleep(&(struct timespec){ 0, 1000000 }, NULL);
    assert_int_equal(__atomic_load_n(&b.runs, __ATOMIC_SEQ_CST), 1);
    assert_true(pthread_equal(b.ran_on, b.engine));
    assert_int_equal(dsv4_sched_run_between(e.s, between_fn, &b), 0);          /* free again: a second one */
    for (int guard = 0; __atomic_load_n(&b.runs, __ATOMIC_SEQ_CST) == 1 && guard < 5000; guard++)
        nanosleep(&(struct timespec){ 0, 1000000 }, NULL);
    assert_int_equal(__atomic_load_n(&b.runs, __ATOMIC_SEQ_CST), 2);
    dsv4_sched_drain(e.s, 0.0);
    assert_int_equal(pthread_join(b.engine, NULL), 0);
    assert_int_equal(rn.rc, 0);
    env_close(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alone_matches_oracle),
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_stop_holdback_per_event),
        cmocka_unit_test(test_stop_string_in_final_flush),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_stop_tokens),
        cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_slot_groups),
        cmocka_unit_test(test_prefill_interleave),
        cmocka_unit_test(test_decode_stall),
        cmocka_unit_test(test_decode_stall_unmeasured),
        cmocka_unit_test(test_drain),
        cmocka_unit_test(test_run_between),
        cmocka_unit_test(test_engine_time),
        cmocka_unit_test(test_latency_hist),
        cmocka_unit_test(test_random_workload),
        cmocka_unit_test(test_random_workload_device_sampling),
        cmocka_unit_test(test_reported_seed),
        cmocka_unit_test(test_backend_error),
        cmocka_unit_test(test_tokenizer_text),
        cmocka_unit_test(test_unknown_id_text),
        cmocka_unit_test(test_engine_thread),
        cmocka_unit_test(test_backend_fatal),
        cmocka_unit_test(test_event_backpressure),
        cmocka_unit_test(test_run_drain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
