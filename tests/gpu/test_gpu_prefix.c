/* SPDX-License-Identifier: MIT */
/* GPU: the prefix cache on the CUDA backend (kernels/prefix.cu). A request restored from a
 * snapshot computes on the GPU exactly what the same request computes there cold:
 *  - backend: one sequence snapshotted at every block boundary (device copies into the pool), each
 *    snapshot restored into another slot and continued (prefill of the rest, then decode): every
 *    logit bit-identical to the cold sequence's, on the fixture models and the default model, exact
 *    and fp8 numerics; the source slot continues unchanged; refused misuse (a load into a busy
 *    slot, a save off a boundary);
 *  - scheduler with device sampling: prompts that share the first c tokens of a cached prompt, for c
 *    around every boundary, greedy and seeded with penalties (the restored tokens must be in the
 *    device penalty history, as prefill puts them), and a pool small enough to evict: tokens and
 *    log-probabilities bit-identical to a backend without a pool, cached_tokens as expected. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/model/config.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"
#include "tests/gpu/gpu_test.h"
#include "tests/unit/prefix_util.h"
#include "tests/unit/sched_harness.h"

#define POOL_BYTES (256 << 20)
#define MAX_BATCH 4             /* divides every block: prefill chunks line up cold and restored */
#define GEN 8
#define MAX_PROMPT 1024

static struct dsv4_weights *load(const char *name)
{
    char dir[1024];
    struct dsv4_weights *w;
    if (strcmp(name, "default") == 0)
        snprintf(dir, sizeof(dir), "%s/models/default", DSV4_SRCDIR);
    else
        snprintf(dir, sizeof(dir), "%s/tests/fixtures/%s", DSV4_SRCDIR, name);
    DSV4_OK(dsv4_weights_load(dir, &w));
    return w;
}

/* the pooled backend still holds its one device allocation */
static void one_allocation(struct dsv4_backend *b)
{
    struct dsv4_backend_stats st;
    b->ops->get_stats(b, &st);
    assert_int_equal(st.device_allocs, 1);
}

static void backend_case(const char *name, enum dsv4_numerics num)
{
    struct dsv4_weights *w = load(name);
    const int B = dsv4_config_prefix_block(&w->cfg);
    assert_true(B > 0 && B % MAX_BATCH == 0);
    const struct dsv4_backend_opts bo = { .max_batch = MAX_BATCH, .numerics = num };
    prefix_backend_case(w, name, bo, POOL_BYTES, dsv4_backend_cuda_create, one_allocation);
    dsv4_weights_free(w);
}

static void test_backend_bit_identical(void **state)
{
    (void)state;
    static const char *const models[] = { "tiny_a", "tiny_b", "tiny_c", "default" };
    for (int m = 0; m < 4; m++) {
        backend_case(models[m], DSV4_NUMERICS_EXACT);
        backend_case(models[m], DSV4_NUMERICS_FP8);
    }
}

/* ---- scheduler, device sampling ---- */

static void env_make(struct env *e, struct dsv4_weights *w, int ctx, int64_t pool)
{
    e->w = w;
    struct dsv4_backend_opts bo = { .max_batch = MAX_BATCH, .max_context = ctx, .numerics = DSV4_NUMERICS_FP8,
                                    .prefix_pool_bytes = pool };
    DSV4_OK(dsv4_backend_cuda_create(w, &bo, &e->b));
    assert_non_null(e->b->ops->sample);
    struct dsv4_sched_limits lim = { .prefill_budget = 512, .detok = { letter_bytes, NULL } };
    DSV4_OK(dsv4_sched_create(e->b, NULL, &lim, &e->s));
}

static void submit(struct env *e, const int32_t *prompt, int n, const struct dsv4_sampling *sp, struct answer *a)
{
    memset(a, 0, sizeof(*a));
    struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = n, .max_tokens = GEN, .sampling = *sp,
                                     .ignore_eos = true, .user = a };
    DSV4_OK(dsv4_sched_submit(e->s, &rq, &a->id));
}

/* The request on the backend without a pool, then on the one with: the same answer, bit for bit. */
static void both(struct env *cold_env, struct env *warm_env, const int32_t *prompt, int n,
                 const struct dsv4_sampling *sp, struct answer *warm, const char *what)
{
    struct answer cold;
    submit(cold_env, prompt, n, sp, &cold);
    run_until(cold_env, &cold, 1);
    submit(warm_env, prompt, n, sp, warm);
    run_until(warm_env, warm, 1);
    answer_expect_same(warm, &cold, what);
}

static void sched_case(const char *name, int64_t pool, bool evict)
{
    struct dsv4_weights *w = load(name);
    const int B = dsv4_config_prefix_block(&w->cfg), V = w->cfg.vocab_size, nt = 5 * B + 3, tail = 5;
    struct env cold_env, warm_env;
    env_make(&cold_env, w, 7 * B, 0);
    env_make(&warm_env, w, 7 * B, pool);
    struct dsv4_sampling sp[2];
    dsv4_sampling_defaults(&sp[0]);
    sp[0].temperature = 0.0f;
    sp[0].logprobs = 2;
    dsv4_sampling_defaults(&sp[1]);
    sp[1].temperature = 0.9f;
    sp[1].repetition_penalty = 1.3f;
    sp[1].presence_penalty = 0.4f;
    sp[1].has_seed = true;
    sp[1].seed = 99;
    sp[1].logprobs = 2;
    int32_t T[MAX_PROMPT], u[MAX_PROMPT];
    assert_true(nt + tail <= MAX_PROMPT);
    for (int i = 0; i < nt; i++)
        T[i] = (int32_t)((i * 74 + 10) % (V / 2) * 2);
    struct answer a;
    char what[128];
    both(&cold_env, &warm_env, T, nt, &sp[0], &a, "the first request");
    for (int k = 1; k <= 5; k++)
        for (int c = k * B - 1; c <= k * B + 1; c++) {
            memcpy(u, T, sizeof(int32_t) * (size_t)c);
            for (int i = 0; i < tail; i++)
                u[c + i] = (int32_t)((c * 31 + i * 7) % (V / 2) * 2 + 1);
            for (int s = 0; s < 2; s++) {
                snprintf(what, sizeof(what), "%s, %d tokens of a %d-token prompt, %s", name, c, nt,
                         s ? "seeded" : "greedy");
                both(&cold_env, &warm_env, u, c + tail, &sp[s], &a, what);
                /* as test_prefix_cpu's hits: T's first prefill kept the state at its last boundary
                 * only, so the state at c = k B is the first request's to leave there */
                int want = c / B < 5 ? c / B * B : 5 * B, own = (c + tail - 1) / B * B;
                if (c % B == 0 && c / B < 5)
                    want -= B;
                const int again = c % B == 0 && c / B < 5 ? c : want;
                if (!evict)
                    assert_int_equal(a.cached_tokens, s == 0 ? want : (own > again ? own : again));
            }
        }
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(warm_env.s, &st);
    assert_true(st.prefix_cache && st.prefix.hits > 0);
    assert_true(evict ? st.prefix.boundaries_evicted > 0 : st.prefix.boundaries_evicted == 0);
    assert_int_equal(st.backend.device_allocs, 1);
    printf("# %s: %llu lookups, %llu hits, %llu tokens restored, %llu snapshots evicted\n", name,
           (unsigned long long)st.prefix.lookups, (unsigned long long)st.prefix.hits,
           (unsigned long long)st.prefix.hit_tokens, (unsigned long long)st.prefix.boundaries_evicted);
    dsv4_sched_destroy(cold_env.s);
    dsv4_backend_destroy(cold_env.b);
    env_close(&warm_env);   /* and the weights both used */
}

static void test_sched_bit_identical(void **state)
{
    (void)state;
    sched_case("tiny_a", POOL_BYTES, false);
    sched_case("tiny_b", POOL_BYTES, false);
    sched_case("default", POOL_BYTES, false);
}

/* A pool of a few snapshots: evictions, and every answer still the cold one. */
static void test_sched_evictions(void **state)
{
    (void)state;
    struct dsv4_weights *w = load("tiny_c");
    struct dsv4_backend_opts bo = { .max_batch = MAX_BATCH, .max_context = 7 * 16, .numerics = DSV4_NUMERICS_FP8,
                                    .prefix_pool_bytes = POOL_BYTES };
    struct dsv4_backend *probe;
    DSV4_OK(dsv4_backend_cuda_create(w, &bo, &probe));
    const struct dsv4_prefix_geom g = probe->prefix;
    dsv4_backend_destroy(probe);
    dsv4_weights_free(w);
    sched_case("tiny_c", 4 * (g.block_pages + g.boundary_pages) * g.page_bytes, true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backend_bit_identical),
        cmocka_unit_test(test_sched_bit_identical),
        cmocka_unit_test(test_sched_evictions),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
