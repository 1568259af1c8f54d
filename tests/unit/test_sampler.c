/* SPDX-License-Identifier: MIT */
/* engine/serve/sampler and engine/serve/philox: Philox known answers; each sampling step against a
 * straightforward reference (full sort, dense arrays) on fresh random logits; the draw checked
 * exactly (the reference CDF interval of the chosen token holds the Philox uniform) and
 * statistically (frequencies within 5 standard errors of the reference probabilities). */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/serve/philox.h"
#include "engine/serve/sampler.h"

/* Test-side random numbers (a different generator from the one under test). */
static uint64_t rng_state = 0x1234567887654321ull;
static uint64_t rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double rng_uniform(void)
{
    return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0);
}

static void random_logits(float *l, int V, double scale)
{
    for (int v = 0; v < V; v++)
        l[v] = (float)(scale * (rng_uniform() * 2.0 - 1.0));
}

/* ---- reference ---- */

static const float *ref_sort_keys;
static int ref_cmp(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    float fx = ref_sort_keys[x], fy = ref_sort_keys[y];
    if (fx != fy)
        return fx > fy ? -1 : 1;
    return (x > y) - (x < y);
}

/* Probabilities the sampler must draw from: prob[V], 0 for dropped tokens, summing to 1. */
static void ref_probs(const struct dsv4_sampling *p, const float *logits, int V, const uint32_t *counts,
                      const uint8_t *seen, double *prob)
{
    float *l = malloc(sizeof(float) * (size_t)V);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)V);
    for (int v = 0; v < V; v++) {
        float x = logits[v];
        if (seen && (seen[v / 8] >> (v % 8)) & 1)
            x = x > 0 ? x / p->repetition_penalty : x * p->repetition_penalty;
        if (counts && counts[v])
            x -= (float)counts[v] * p->frequency_penalty + p->presence_penalty;
        l[v] = x;
    }
    for (int v = 0; v < V; v++)
        prob[v] = 0.0;
    if (p->temperature == 0.0f) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (l[v] > l[best])
                best = v;
        prob[best] = 1.0;
        free(l);
        free(order);
        return;
    }
    for (int v = 0; v < V; v++) {
        l[v] *= 1.0f / p->temperature;
        order[v] = v;
    }
    ref_sort_keys = l;
    qsort(order, (size_t)V, sizeof(int32_t), ref_cmp);
    int n = (p->top_k > 0 && p->top_k < V) ? p->top_k : V;
    double m = l[order[0]], z = 0.0;
    for (int i = 0; i < n; i++)
        z += exp((double)l[order[i]] - m);
    if (p->top_p < 1.0f) {
        double acc = 0.0;
        int i;
        for (i = 0; i < n; i++) {
            acc += exp((double)l[order[i]] - m) / z;
            if (acc >= p->top_p)
                break;
        }
        n = i < n ? i + 1 : n;
    }
    double zk = 0.0;
    for (int i = 0; i < n; i++) {
        double e = exp((double)l[order[i]] - m);
        if (e / z < p->min_p * (1.0 / z))       /* the best has e = 1 */
            continue;
        prob[order[i]] = e;
        zk += e;
    }
    for (int v = 0; v < V; v++)
        prob[v] /= zk;
    free(l);
    free(order);
}

/* ---- tests ---- */

static void test_philox_known_answers(void **state)
{
    /* Random123's published known-answer vectors for philox4x32-10. */
    static const uint32_t ctr[3][4] = {
        { 0, 0, 0, 0 },
        { 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff },
        { 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344 },
    };
    static const uint32_t key[3][2] = { { 0, 0 }, { 0xffffffff, 0xffffffff }, { 0xa4093822, 0x299f31d0 } };
    static const uint32_t want[3][4] = {
        { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 },
        { 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd },
        { 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1 },
    };
    for (int t = 0; t < 3; t++) {
        uint32_t out[4];
        dsv4_philox4x32_10(ctr[t], key[t], out);
        for (int i = 0; i < 4; i++)
            assert_int_equal(out[i], want[t][i]);
    }
    /* uniform: in [0, 1), mean 1/2 and variance 1/12 within 5 standard errors */
    const int N = 100000;
    double sum = 0, sum2 = 0;
    for (int i = 0; i < N; i++) {
        double u = dsv4_philox_uniform(42, (uint64_t)i, 0);
        assert_true(u >= 0.0 && u < 1.0);
        sum += u;
        sum2 += u * u;
    }
    double mean = sum / N, var = sum2 / N - mean * mean;
    assert_true(fabs(mean - 0.5) < 5.0 * sqrt(1.0 / 12.0 / N));
    assert_true(fabs(var - 1.0 / 12.0) < 5.0 * sqrt(1.0 / 180.0 / N));
    assert_true(dsv4_philox_uniform(1, 5, 0) != dsv4_philox_uniform(2, 5, 0));
    assert_true(dsv4_philox_uniform(1, 5, 0) != dsv4_philox_uniform(1, 6, 0));
}

static void test_validate(void **state)
{
    struct dsv4_sampling p;
    dsv4_sampling_defaults(&p);
    assert_int_equal(dsv4_sampling_validate(&p), 0);
    struct dsv4_sampling bad[7];
    for (int i = 0; i < 7; i++)
        bad[i] = p;
    bad[0].temperature = -1.0f;
    bad[1].top_p = 0.0f;
    bad[2].min_p = 1.5f;
    bad[3].repetition_penalty = 0.0f;
    bad[4].top_k = -3;
    bad[5].logprobs = DSV4_SAMPLER_LOGPROBS_MAX + 1;
    bad[6].frequency_penalty = NAN;
    for (int i = 0; i < 7; i++)
        assert_int_equal(dsv4_sampling_validate(&bad[i]), -EINVAL);
}

/* Random history for the penalties: counts over the output, seen over prompt + output. */
static void random_history(int V, uint32_t *counts, uint8_t *seen)
{
    memset(counts, 0, sizeof(uint32_t) * (size_t)V);
    memset(seen, 0, (size_t)(V + 7) / 8);
    for (int i = 0; i < V / 3; i++) {
        int v = (int)(rng_next() % (uint64_t)V);
        seen[v / 8] |= (uint8_t)(1u << (v % 8));
    }
    for (int i = 0; i < V / 4; i++) {
        int v = (int)(rng_next() % (uint64_t)V);
        counts[v] += 1 + (uint32_t)(rng_next() % 3);
        seen[v / 8] |= (uint8_t)(1u << (v % 8));
    }
}

/* Draw N tokens with indices 0..N-1 and check each against the reference CDF and the totals
 * against the reference probabilities. */
static void check_draws(const struct dsv4_sampling *p, const float *logits, int V, const uint32_t *counts,
                        const uint8_t *seen, int N)
{
    struct dsv4_sampler *s;
    assert_int_equal(dsv4_sampler_create(V, &s), 0);
    double *prob = malloc(sizeof(double) * (size_t)V);
    double *cdf = malloc(sizeof(double) * ((size_t)V + 1));
    long *hits = calloc((size_t)V, sizeof(long));
    ref_probs(p, logits, V, counts, seen, prob);
    cdf[0] = 0.0;
    for (int v = 0; v < V; v++)
        cdf[v + 1] = cdf[v] + prob[v];
    struct dsv4_sampler_history hist = { counts, seen };
    for (int i = 0; i < N; i++) {
        struct dsv4_sample smp;
        assert_int_equal(dsv4_sampler_sample(s, p, logits, &hist, p->seed, (uint64_t)i, &smp), 0);
        assert_true(smp.token >= 0 && smp.token < V);
        assert_true(prob[smp.token] > 0.0);
        if (p->temperature > 0.0f) {
            double u = dsv4_philox_uniform(p->seed, (uint64_t)i, 0);
            /* 1e-6: the sampler takes exponentials in float, the reference in double */
            assert_true(u >= cdf[smp.token] - 1e-6 && u < cdf[smp.token + 1] + 1e-6);
        }
        hits[smp.token]++;
    }
    for (int v = 0; v < V; v++) {
        double f = (double)hits[v] / N;
        double tol = 5.0 * sqrt(prob[v] * (1.0 - prob[v]) / N) + 1.0 / N;
        if (fabs(f - prob[v]) > tol)
            fail_msg("token %d: frequency %g, reference %g, tolerance %g", v, f, prob[v], tol);
    }
    free(prob);
    free(cdf);
    free(hits);
    dsv4_sampler_destroy(s);
}

static void test_plain_temperature(void **state)
{
    const int V = 40;
    float logits[40];
    random_logits(logits, V, 3.0);
    struct dsv4_sampling p;
    dsv4_sampling_defaults(&p);
    p.temperature = 0.8f;
    p.seed = 11;
    check_draws(&p, logits, V, NULL, NULL, 20000);
    /* the defaults: temperature 1 reuses step 1's exponentials */
    dsv4_sampling_defaults(&p);
    p.seed = 12;
    check_draws(&p, logits, V, NULL, NULL, 20000);
}

static void test_all_steps(void **state)
{
    const int V = 64;
    float logits[64];
    uint32_t counts[64];
    uint8_t seen[8];
    for (int round = 0; round < 4; round++) {
        random_logits(logits, V, 4.0);
        random_history(V, counts, seen);
        struct dsv4_sampling p;
        dsv4_sampling_defaults(&p);
        p.temperature = 0.5f + 0.3f * (float)round;
        p.top_k = round == 3 ? 0 : 20 + 5 * round;
        p.top_p = round == 2 ? 1.0f : 0.85f;
        p.min_p = round == 1 ? 0.0f : 0.02f;
        p.repetition_penalty = 1.3f;
        p.presence_penalty = 0.4f;
        p.frequency_penalty = 0.25f;
        p.seed = 1000 + (uint64_t)round;
        check_draws(&p, logits, V, counts, seen, 20000);
    }
}

/* A large row exercises the growing nucleus head (more than 256 tokens needed to reach top_p). */
static void test_large_nucleus(void **state)
{
    const int V = 3000;
    float *logits = malloc(sizeof(float) * (size_t)V);
    random_logits(logits, V, 0.5);
    struct dsv4_sampling p;
    dsv4_sampling_defaults(&p);
    p.top_p = 0.9f;
    p.seed = 77;
    check_draws(&p, logits, V, NULL, NULL, 20000);
    p.top_k = 1000;
    p.min_p = 0.7f;
    check_draws(&p, logits, V, NULL, NULL, 20000);
    free(logits);
}

static void test_greedy_and_logprobs(void **state)
{
    const int V = 500;
    float *logits = malloc(sizeof(float) * (size_t)V);
    uint32_t *counts = malloc(sizeof(uint32_t) * (size_t)V);
    uint8_t *seen = malloc((size_t)(V + 7) / 8);
    double *prob = malloc(sizeof(double) * (size_t)V);
    struct dsv4_sampler *s;
    assert_int_equal(dsv4_sampler_create(V, &s), 0);
    for (int round = 0; round < 20; round++) {
        random_logits(logits, V, 5.0);
        if (round % 2)
            logits[V / 2] = logits[V / 3] = 9.0f;   /* a tie: the lower id wins */
        random_history(V, counts, seen);
        struct dsv4_sampling p;
        dsv4_sampling_defaults(&p);
        p.temperature = 0.0f;
        p.repetition_penalty = round % 3 ? 1.2f : 1.0f;
        p.frequency_penalty = 0.3f;
        p.logprobs = round % (DSV4_SAMPLER_LOGPROBS_MAX + 1);
        ref_probs(&p, logits, V, counts, seen, prob);
        struct dsv4_sampler_history hist = { counts, seen };
        struct dsv4_sample smp;
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, &hist, 5, (uint64_t)round, &smp), 0);
        assert_true(prob[smp.token] == 1.0);
        /* logprobs: log_softmax of the raw row, sorted best first */
        double m = logits[0], z = 0;
        for (int v = 1; v < V; v++)
            m = logits[v] > m ? logits[v] : m;
        for (int v = 0; v < V; v++)
            z += exp((double)logits[v] - m);
        double lse = m + log(z);
        assert_true(fabs(smp.logprob - ((double)logits[smp.token] - lse)) <= 1e-5 * (1.0 + fabs(smp.logprob)));
        assert_int_equal(smp.n_top, p.logprobs);
        int32_t *order = malloc(sizeof(int32_t) * (size_t)V);
        for (int v = 0; v < V; v++)
            order[v] = v;
        ref_sort_keys = logits;
        qsort(order, (size_t)V, sizeof(int32_t), ref_cmp);
        for (int i = 0; i < smp.n_top; i++) {
            assert_int_equal(smp.top_ids[i], order[i]);
            double want = (double)logits[order[i]] - lse;
            assert_true(fabs(smp.top_logprobs[i] - want) <= 1e-5 * (1.0 + fabs(want)));
        }
        free(order);
    }
    dsv4_sampler_destroy(s);
    free(logits);
    free(counts);
    free(seen);
    free(prob);
}

static void test_bad_rows(void **state)
{
    const int V = 16;
    float logits[16];
    random_logits(logits, V, 1.0);
    struct dsv4_sampler *s;
    assert_int_equal(dsv4_sampler_create(V, &s), 0);
    struct dsv4_sampling p;
    dsv4_sampling_defaults(&p);
    struct dsv4_sample smp;
    logits[3] = NAN;
    assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 1, 0, &smp), -EDOM);
    for (int v = 0; v < V; v++)
        logits[v] = -INFINITY;
    assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 1, 0, &smp), -EDOM);
    /* masked tokens are never drawn */
    random_logits(logits, V, 1.0);
    for (int v = 0; v < V; v += 2)
        logits[v] = -INFINITY;
    for (int i = 0; i < 2000; i++) {
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 9, (uint64_t)i, &smp), 0);
        assert_true(smp.token % 2 == 1);
    }
    dsv4_sampler_destroy(s);
    assert_int_equal(dsv4_sampler_create(0, &s), -EINVAL);
}

/* A temperature or repetition penalty small enough to carry the working logits past the float range
 * (both pass validation: finite and > 0) leaves no token with a positive probability: the row fails
 * with -EDOM, as the device sampler's does, rather than drawing no token (-1) or a NaN one. */
static void test_overflowing_rows(void **state)
{
    const int V = 4;
    const float logits[4] = { 5.0f, 3.0f, 0.0f, -1.0f };
    struct dsv4_sampler *s;
    assert_int_equal(dsv4_sampler_create(V, &s), 0);
    struct dsv4_sampling p;
    struct dsv4_sample smp;
    const float min_ps[2] = { 0.0f, 0.1f };
    for (int i = 0; i < 2; i++) {
        dsv4_sampling_defaults(&p);
        p.temperature = 1e-40f;     /* 1 / T is +inf in float */
        p.min_p = min_ps[i];
        assert_int_equal(dsv4_sampling_validate(&p), 0);
        smp.token = 77;
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 1, 0, &smp), -EDOM);
        dsv4_sampling_defaults(&p);
        p.temperature = 1e-38f;     /* 1 / T is finite, 5 / T is not */
        p.min_p = min_ps[i];
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 1, 0, &smp), -EDOM);
        /* l / r overflows for the seen positive logits */
        const uint32_t counts[4] = { 0 };
        const uint8_t seen[1] = { 0x3 };
        const struct dsv4_sampler_history hist = { counts, seen };
        dsv4_sampling_defaults(&p);
        p.repetition_penalty = 1e-40f;
        p.min_p = min_ps[i];
        assert_int_equal(dsv4_sampling_validate(&p), 0);
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, &hist, 1, 0, &smp), -EDOM);
    }
    /* a tiny temperature that stays in range is still sampled (the largest logit, with certainty) */
    dsv4_sampling_defaults(&p);
    p.temperature = 1e-3f;
    p.min_p = 0.1f;
    assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 1, 0, &smp), 0);
    assert_int_equal(smp.token, 0);
    dsv4_sampler_destroy(s);
}

/* -0.0 and +0.0 are the same logit: a tie, which every step breaks towards the lower id (top_p's
 * ranking included, so that it keeps what top_k keeps). */
static void test_signed_zero_ties(void **state)
{
    const int V = 4;
    const float logits[4] = { -0.0f, 0.0f, -30.0f, -30.0f };
    struct dsv4_sampler *s;
    assert_int_equal(dsv4_sampler_create(V, &s), 0);
    struct dsv4_sampling p;
    struct dsv4_sample smp;
    for (uint64_t i = 0; i < 64; i++) {
        dsv4_sampling_defaults(&p);
        p.top_k = 1;
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 5, i, &smp), 0);
        assert_int_equal(smp.token, 0);
        dsv4_sampling_defaults(&p);
        p.top_p = 0.4f;     /* one of the two tied tokens reaches it */
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 5, i, &smp), 0);
        assert_int_equal(smp.token, 0);
        p.temperature = 0.5f;
        assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 5, i, &smp), 0);
        assert_int_equal(smp.token, 0);
    }
    dsv4_sampling_defaults(&p);
    p.temperature = 0.0f;
    assert_int_equal(dsv4_sampler_sample(s, &p, logits, NULL, 5, 0, &smp), 0);
    assert_int_equal(smp.token, 0);
    dsv4_sampler_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_known_answers),
        cmocka_unit_test(test_validate),
        cmocka_unit_test(test_plain_temperature),
        cmocka_unit_test(test_all_steps),
        cmocka_unit_test(test_large_nucleus),
        cmocka_unit_test(test_greedy_and_logprobs),
        cmocka_unit_test(test_bad_rows),
        cmocka_unit_test(test_overflowing_rows),
        cmocka_unit_test(test_signed_zero_ties),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
