/* SPDX-License-Identifier: MIT */
/* Test helper for the scheduler tests that run a real backend (tests/unit/test_sched_cpu.c on the
 * CPU backend, tests/gpu/test_gpu_serve.c on the CUDA one): a request's answer gathered from the
 * event stream, the letter detokenizer of the fixture vocabularies, and the run loop. Header-only:
 * each test program includes it once, after cmocka.h. */
#ifndef DSV4_TESTS_SCHED_HARNESS_H
#define DSV4_TESTS_SCHED_HARNESS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"

#define ANSWER_MAX_TOKENS 256

struct answer {
    int32_t tokens[ANSWER_MAX_TOKENS];
    float logprob[ANSWER_MAX_TOKENS];
    int32_t top0[ANSWER_MAX_TOKENS];    /* the first top-logprob alternative, -1 without */
    int32_t top1[ANSWER_MAX_TOKENS];    /* the second, -1 without */
    float top_lp[ANSWER_MAX_TOKENS][2]; /* their logprobs (NAN without) */
    int n;
    int cached_tokens;                  /* prompt tokens the prefix cache restored */
    bool finished;
    enum dsv4_finish_reason finish;
    uint64_t id;
};

struct env {
    struct dsv4_weights *w;
    struct dsv4_backend *b;
    struct dsv4_sched *s;
};

/* The fixture vocabularies have no tokenizer: each id reads as one letter. */
static int letter_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    (void)ctx;
    if (cap < 1)
        return -E2BIG;
    buf[0] = (char)('a' + id % 26);
    return 1;
}

static void env_close(struct env *e)
{
    dsv4_sched_destroy(e->s);
    dsv4_backend_destroy(e->b);
    dsv4_weights_free(e->w);
}

/* Every pending event into its request's answer (ev.user); a finished request is released. */
static void collect(struct dsv4_sched *s)
{
    struct dsv4_sched_event ev;
    while (dsv4_sched_next_event(s, &ev) == 1) {
        struct answer *a = ev.user;
        if (ev.type == DSV4_SCHED_EVENT_TOKEN) {
            assert_true(a->n < ANSWER_MAX_TOKENS);
            a->tokens[a->n] = ev.sample.token;
            a->logprob[a->n] = ev.sample.logprob;
            a->top0[a->n] = ev.sample.n_top > 0 ? ev.sample.top_ids[0] : -1;
            a->top1[a->n] = ev.sample.n_top > 1 ? ev.sample.top_ids[1] : -1;
            a->top_lp[a->n][0] = ev.sample.n_top > 0 ? ev.sample.top_logprobs[0] : NAN;
            a->top_lp[a->n][1] = ev.sample.n_top > 1 ? ev.sample.top_logprobs[1] : NAN;
            a->n++;
        } else {
            if (ev.result->finish == DSV4_FINISH_ERROR)
                fail_msg("request failed: %s", ev.result->error_message);
            a->finished = true;
            a->finish = ev.result->finish;
            a->cached_tokens = ev.result->cached_tokens;
            assert_int_equal(ev.result->n_tokens, a->n);
            assert_int_equal(dsv4_sched_release(s, ev.id), 0);
        }
    }
}

/* Step until the n answers are finished. */
static void run_until(struct env *e, struct answer *a, int n)
{
    for (int guard = 0; guard < 10000; guard++) {
        int done = 0;
        for (int i = 0; i < n; i++)
            done += a[i].finished;
        if (done == n)
            return;
        assert_true(dsv4_sched_step(e->s) >= 0);
        collect(e->s);
    }
    fail_msg("requests did not finish");
}

/* p[n]: BOS, then ids 2..255 drawn from the linear congruential stream *st (advanced once an id). */
static inline void harness_prompt(uint64_t *st, int32_t *p, int n)
{
    for (int k = 0; k < n; k++) {
        *st = *st * 6364136223846793005ull + 1442695040888963407ull;
        p[k] = k == 0 ? 0 : 2 + (int32_t)((*st >> 33) % 254);
    }
}

/* warm (a cached or otherwise different path) gave cold's answer bit for bit: tokens, log-probabilities
 * and both top alternatives with theirs. */
static inline void answer_expect_same(const struct answer *warm, const struct answer *cold, const char *what)
{
    if (warm->n != cold->n || memcmp(warm->tokens, cold->tokens, sizeof(int32_t) * (size_t)cold->n) ||
        memcmp(warm->logprob, cold->logprob, sizeof(float) * (size_t)cold->n) ||
        memcmp(warm->top0, cold->top0, sizeof(int32_t) * (size_t)cold->n) ||
        memcmp(warm->top1, cold->top1, sizeof(int32_t) * (size_t)cold->n) ||
        memcmp(warm->top_lp, cold->top_lp, sizeof(warm->top_lp[0]) * (size_t)cold->n))
        fail_msg("%s: the cached answer differs from the cold one", what);
}

#endif
