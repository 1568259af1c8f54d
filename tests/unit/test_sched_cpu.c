/* SPDX-License-Identifier: MIT */
/* engine/serve/scheduler over the real CPU backend on the tiny fixture models (tests/fixtures/): greedy
 * answers equal transformers' greedy tokens, alone and batched with chunked prefill; seeded
 * answers are the same alone and in a batch with arrivals mid-way. */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"
#include "tests/unit/fixture_cases.h"
#include "tests/unit/sched_harness.h"

#define MAX_CONTEXT 160

static void env_open(struct env *e, const char *model, int max_batch, int prefill_budget)
{
    char dir[PATH_MAX];
    fixture_dir(model, dir, sizeof(dir));
    if (dsv4_weights_load(dir, &e->w) < 0)
        fail_msg("%s: %s", dir, dsv4_error_message());
    struct dsv4_backend_opts bo = { .max_batch = max_batch, .max_context = MAX_CONTEXT,
                                    .numerics = DSV4_NUMERICS_EXACT, .threads = 1 };
    if (dsv4_backend_cpu_create(e->w, &bo, &e->b) < 0)
        fail_msg("cpu backend: %s", dsv4_error_message());
    struct dsv4_sched_limits lim = { .prefill_budget = prefill_budget, .detok = { letter_bytes, NULL } };
    if (dsv4_sched_create(e->b, NULL, &lim, &e->s) < 0)
        fail_msg("scheduler: %s", dsv4_error_message());
}

static void submit(struct env *e, const int32_t *prompt, int n, int max_tokens, const struct dsv4_sampling *sp,
                   struct answer *a)
{
    memset(a, 0, sizeof(*a));
    struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = n, .max_tokens = max_tokens,
                                     .sampling = *sp, .user = a };
    if (dsv4_sched_submit(e->s, &rq, &a->id) < 0)
        fail_msg("submit: %s", dsv4_error_message());
}

/* Every fixture case through the scheduler, alone (prefill in the case's chunk size) and all of a
 * model's cases together (arriving one step apart, 7-token prefill budget): transformers' greedy
 * tokens each time. */
static void test_fixture_greedy(void **state)
{
    static const char *const models[] = { "tiny_a", "tiny_b", "tiny_c" };
    struct dsv4_sampling greedy;
    dsv4_sampling_defaults(&greedy);
    greedy.temperature = 0.0f;
    for (int m = 0; m < 3; m++) {
        static struct fixture_case cases[FIXTURE_CASES_MAX];
        int nc = fixture_cases_load(models[m], cases);
        assert_true(nc >= 2);
        static struct answer a[FIXTURE_CASES_MAX];
        for (int c = 0; c < nc; c++) {
            struct env e;
            env_open(&e, models[m], 1, cases[c].chunk ? cases[c].chunk : 512);
            submit(&e, cases[c].seq, cases[c].n_prompt, cases[c].n_greedy, &greedy, &a[c]);
            run_until(&e, &a[c], 1);
            assert_int_equal(a[c].finish, DSV4_FINISH_LENGTH);
            assert_int_equal(a[c].n, cases[c].n_greedy);
            assert_memory_equal(a[c].tokens, cases[c].seq + cases[c].n_prompt, sizeof(int32_t) * (size_t)cases[c].n_greedy);
            env_close(&e);
        }
        struct env e;
        env_open(&e, models[m], 4, 7);
        for (int c = 0; c < nc; c++) {
            submit(&e, cases[c].seq, cases[c].n_prompt, cases[c].n_greedy, &greedy, &a[c]);
            assert_true(dsv4_sched_step(e.s) >= 0);
            collect(e.s);
        }
        run_until(&e, a, nc);
        for (int c = 0; c < nc; c++) {
            assert_int_equal(a[c].n, cases[c].n_greedy);
            assert_memory_equal(a[c].tokens, cases[c].seq + cases[c].n_prompt, sizeof(int32_t) * (size_t)cases[c].n_greedy);
        }
        env_close(&e);
    }
}

/* Seeded sampling with truncation and penalties: the same tokens alone and among others. */
static void test_seeded_batch_invariance(void **state)
{
    enum { N = 6 };
    static int32_t prompts[N][64];
    struct dsv4_sampling sp[N];
    uint64_t st = 31;
    for (int i = 0; i < N; i++) {
        harness_prompt(&st, prompts[i], 64);
        dsv4_sampling_defaults(&sp[i]);
        sp[i].has_seed = true;
        sp[i].seed = 500 + (uint64_t)i;
        sp[i].temperature = 0.7f + 0.1f * (float)i;
        sp[i].top_p = 0.9f;
        sp[i].top_k = i % 2 ? 40 : 0;
        sp[i].repetition_penalty = 1.1f;
        sp[i].presence_penalty = 0.3f;
    }
    static struct answer alone[N], batch[N];
    for (int i = 0; i < N; i++) {
        struct env e;
        env_open(&e, "tiny_a", 1, 512);
        submit(&e, prompts[i], 10 + 9 * i, 20, &sp[i], &alone[i]);
        run_until(&e, &alone[i], 1);
        assert_int_equal(alone[i].n, 20);
        env_close(&e);
    }
    struct env e;
    env_open(&e, "tiny_a", 4, 9);
    int next = 0;
    for (int t = 0; next < N; t++) {
        if (t % 2 == 0) {
            submit(&e, prompts[next], 10 + 9 * next, 20, &sp[next], &batch[next]);
            next++;
        }
        assert_true(dsv4_sched_step(e.s) >= 0);
        collect(e.s);
    }
    run_until(&e, batch, N);
    for (int i = 0; i < N; i++) {
        assert_int_equal(batch[i].n, alone[i].n);
        assert_memory_equal(batch[i].tokens, alone[i].tokens, sizeof(int32_t) * (size_t)alone[i].n);
    }
    struct dsv4_sched_stats stats;
    dsv4_sched_get_stats(e.s, &stats);
    assert_int_equal(stats.slots_in_use, 0);
    assert_true(stats.batch_hist[2] > 0);   /* decode batches of 3-4 happened */
    env_close(&e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_greedy),
        cmocka_unit_test(test_seeded_batch_invariance),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
