/* SPDX-License-Identifier: MIT */
/* The prefix cache on the CPU backend: a request restored from a snapshot computes exactly what the
 * same request computes cold.
 *  - backend: snapshots at every block boundary of one sequence, each restored into another slot and
 *    continued (prefill of the rest, then decode): every logit bit-identical to the cold sequence's,
 *    on the three fixture models and the default model, exact and fp8 numerics;
 *  - scheduler: prompts that leave a cached prompt before, at and after every block boundary
 *    (greedy, and seeded sampling with penalties), a hit on a request that is still running, a hit
 *    on a snapshot written while decoding, and a pool small enough to evict: tokens, log-probabilities
 *    and top alternatives bit-identical to a scheduler without a pool, cached_tokens as expected,
 *    and the stats counting what happened. */
#include "build-config.h"

#include <errno.h>
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
#include "engine/model/config.h"
#include "engine/error.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"
#include "tests/unit/prefix_util.h"
#include "tests/unit/sched_harness.h"

#define POOL_BYTES (64 << 20)   /* untouched pages cost nothing: calloc'd */
#define MAX_PROMPT 1024
#define GEN 6                   /* tokens generated per scheduler request */

static void model_dir(const char *name, char *out, size_t cap)
{
    const char *top = getenv("top_srcdir");
    if (strcmp(name, "default") == 0)
        snprintf(out, cap, "%s/models/default", top ? top : ".");
    else
        snprintf(out, cap, "%s/tests/fixtures/%s", top ? top : ".", name);
}

static struct dsv4_weights *load(const char *name)
{
    char dir[PATH_MAX];
    struct dsv4_weights *w;
    model_dir(name, dir, sizeof(dir));
    if (dsv4_weights_load(dir, &w) < 0)
        fail_msg("%s: %s", dir, dsv4_error_message());
    return w;
}

/* ---- backend ---- */

static void backend_case(const char *name, enum dsv4_numerics num)
{
    struct dsv4_weights *w = load(name);
    const struct dsv4_backend_opts bo = { .max_batch = 2, .numerics = num, .threads = 1 };
    prefix_backend_case(w, name, bo, POOL_BYTES, dsv4_backend_cpu_create, NULL);
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

/* A pool that cannot hold one snapshot is refused at create with the sizes. */
static void test_pool_too_small(void **state)
{
    (void)state;
    struct dsv4_weights *w = load("tiny_a");
    struct dsv4_backend_opts bo = { .max_batch = 1, .max_context = 64, .threads = 1, .prefix_pool_bytes = 1024 };
    struct dsv4_backend *b;
    assert_int_equal(dsv4_backend_cpu_create(w, &bo, &b), -ENOSPC);
    assert_non_null(strstr(dsv4_error_message(), "one snapshot takes"));
    bo.max_context = 8;     /* below one block of 16 */
    bo.prefix_pool_bytes = POOL_BYTES;
    assert_int_equal(dsv4_backend_cpu_create(w, &bo, &b), -EINVAL);
    dsv4_weights_free(w);
}

/* ---- scheduler ---- */

struct pair {
    struct env cold, warm;      /* no pool / a pool */
    int B, V;
};

static void env_make(struct env *e, struct dsv4_weights *w, int max_batch, int ctx, int64_t pool, int budget)
{
    e->w = w;
    struct dsv4_backend_opts bo = { .max_batch = max_batch, .max_context = ctx, .numerics = DSV4_NUMERICS_EXACT,
                                    .threads = 1, .prefix_pool_bytes = pool };
    if (dsv4_backend_cpu_create(w, &bo, &e->b) < 0)
        fail_msg("cpu backend: %s", dsv4_error_message());
    struct dsv4_sched_limits lim = { .prefill_budget = budget, .detok = { letter_bytes, NULL } };
    if (dsv4_sched_create(e->b, NULL, &lim, &e->s) < 0)
        fail_msg("scheduler: %s", dsv4_error_message());
}

/* ctx 0: 7 blocks */
static void pair_open(struct pair *p, const char *name, int max_batch, int ctx, int64_t pool, int budget)
{
    struct dsv4_weights *w = load(name);
    p->B = dsv4_config_prefix_block(&w->cfg);
    p->V = w->cfg.vocab_size;
    if (!ctx)
        ctx = 7 * p->B;
    env_make(&p->cold, w, 1, ctx, 0, budget);
    env_make(&p->warm, w, max_batch, ctx, pool, budget);
}

static void pair_close(struct pair *p)
{
    dsv4_sched_destroy(p->cold.s);
    dsv4_backend_destroy(p->cold.b);
    env_close(&p->warm);    /* and the weights both used */
}

static void submit(struct env *e, const int32_t *prompt, int n, const struct dsv4_sampling *sp, struct answer *a)
{
    memset(a, 0, sizeof(*a));
    struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = n, .max_tokens = GEN, .sampling = *sp,
                                     .ignore_eos = true, .user = a };
    if (dsv4_sched_submit(e->s, &rq, &a->id) < 0)
        fail_msg("submit: %s", dsv4_error_message());
}

/* The request cold (a scheduler without a pool), then on the pool's scheduler: the same answer. */
static void both(struct pair *p, const int32_t *prompt, int n, const struct dsv4_sampling *sp, struct answer *warm,
                 const char *what)
{
    struct answer cold;
    submit(&p->cold, prompt, n, sp, &cold);
    run_until(&p->cold, &cold, 1);
    assert_int_equal(cold.cached_tokens, 0);
    submit(&p->warm, prompt, n, sp, warm);
    run_until(&p->warm, warm, 1);
    answer_expect_same(warm, &cold, what);
}

static void samplings(struct dsv4_sampling sp[2])
{
    dsv4_sampling_defaults(&sp[0]);
    sp[0].temperature = 0.0f;
    sp[0].logprobs = 2;
    dsv4_sampling_defaults(&sp[1]);
    sp[1].temperature = 0.9f;
    sp[1].repetition_penalty = 1.3f;
    sp[1].presence_penalty = 0.4f;
    sp[1].frequency_penalty = 0.2f;
    sp[1].has_seed = true;
    sp[1].seed = 1234567;
    sp[1].logprobs = 2;
}

/* Prompts that share the first c tokens of a cached prompt T, for c around every block boundary:
 * the hit is the deepest boundary at most c (and short of the prompt's last token) where some
 * request's slot stood: T's prefill ran past its inner boundaries in one chunk, saving their blocks
 * but not the state there, so a boundary gets its state from the first request that leaves T's
 * chain at it (c = k B finds (k - 1) B, and its second run k B). The answer is the cold one. */
static void hits_case(const char *name)
{
    struct pair p;
    struct dsv4_sampling sp[2];
    struct answer a;
    char what[128];
    samplings(sp);
    pair_open(&p, name, 1, 0, POOL_BYTES, 512);
    const int B = p.B, nt = 5 * B + 3, tail = 5;
    int32_t T[MAX_PROMPT], u[MAX_PROMPT];
    assert_true(nt + tail <= MAX_PROMPT);
    /* T's ids are even, the divergent tails' odd: a tail never continues T */
    for (int i = 0; i < nt; i++)
        T[i] = (int32_t)((i * 74 + 10) % (p.V / 2) * 2);
    both(&p, T, nt, &sp[0], &a, "the first request");
    assert_int_equal(a.cached_tokens, 0);
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(p.warm.s, &st);
    /* one prefill chunk to T's last boundary: its 5 blocks, the state at the end only */
    assert_int_equal(st.prefix.blocks_saved, 5);
    assert_int_equal(st.prefix.boundaries_saved, 1);
    /* in two backend calls (a block a call before), where the scheduler without a pool takes one */
    assert_true(nt <= 512);
    assert_true(st.prefill_tokens == (uint64_t)nt && st.prefill_chunks == 2);
    dsv4_sched_get_stats(p.cold.s, &st);
    assert_true(st.prefill_tokens == (uint64_t)nt && st.prefill_chunks == 1);
    uint64_t hit_tokens = 0;
    int requests = 1;
    for (int k = 1; k <= 5; k++)
        for (int c = k * B - 1; c <= k * B + 1; c++) {
            memcpy(u, T, sizeof(int32_t) * (size_t)c);
            for (int i = 0; i < tail; i++)
                u[c + i] = (int32_t)((c * 31 + i * 7) % (p.V / 2) * 2 + 1);
            int n = c + tail, want = c / B < 5 ? c / B * B : 5 * B;
            if (c % B == 0 && c / B < 5)
                want -= B;      /* the state at c is this request's to leave */
            for (int s = 0; s < 2; s++) {
                snprintf(what, sizeof(what), "%s, %d tokens of a %d-token prompt, %s", name, c, nt,
                         s ? "seeded" : "greedy");
                both(&p, u, n, &sp[s], &a, what);
                /* the second run of the same prompt also finds its own tail's block when it has one */
                int own = (n - 1) / B * B;
                const int again = c % B == 0 && c / B < 5 ? c : want;
                assert_int_equal(a.cached_tokens, s == 0 ? want : (own > again ? own : again));
                hit_tokens += (uint64_t)a.cached_tokens;
                requests++;
            }
        }
    /* the whole prompt again: everything but the last block's tokens */
    both(&p, T, nt, &sp[1], &a, "the first prompt again");
    assert_int_equal(a.cached_tokens, 5 * B);
    hit_tokens += (uint64_t)a.cached_tokens;
    requests++;

    dsv4_sched_get_stats(p.warm.s, &st);
    assert_true(st.prefix_cache);
    assert_int_equal(st.prefix.lookups, requests);
    assert_int_equal(st.prefix.hit_tokens, hit_tokens);
    assert_int_equal(st.prefix.block, B);
    assert_true(st.prefix.pages_used > 0);
    assert_int_equal(st.prefix.boundaries_evicted, 0);
    pair_close(&p);
}

static void test_hits_at_every_boundary(void **state)
{
    (void)state;
    hits_case("tiny_a");
    hits_case("tiny_b");
    hits_case("default");
}

/* B arrives with A: A prefills first (oldest first), B's first prefill finds the blocks A
 * snapshotted in that same step, while A goes on decoding. Then C continues A's answer: its hit
 * reaches past A's prompt, into the blocks A snapshotted while decoding. */
static void test_hit_on_running_source(void **state)
{
    (void)state;
    struct pair p;
    struct dsv4_sampling sp[2];
    samplings(sp);
    pair_open(&p, "tiny_c", 2, 256, POOL_BYTES, 2 * 16);
    enum { B = 16 };            /* tiny_c's block */
    assert_int_equal(p.B, B);
    int32_t a_prompt[3 * B + 5], b_prompt[4 * B];
    const int na = 3 * B + 5, nb = 4 * B;
    prefix_tokens(a_prompt, na, p.V, 3);
    memcpy(b_prompt, a_prompt, sizeof(int32_t) * 3 * B);
    prefix_tokens(b_prompt + 3 * B, B, p.V, 4);

    struct answer cold[2], warm[2];
    submit(&p.cold, a_prompt, na, &sp[1], &cold[0]);
    run_until(&p.cold, &cold[0], 1);
    submit(&p.cold, b_prompt, nb, &sp[0], &cold[1]);
    run_until(&p.cold, &cold[1], 1);

    struct dsv4_sched_request ra = { .prompt = a_prompt, .n_prompt = na, .max_tokens = 2 * B, .sampling = sp[1],
                                     .ignore_eos = true, .user = &warm[0] };
    memset(warm, 0, sizeof(warm));
    assert_int_equal(dsv4_sched_submit(p.warm.s, &ra, &warm[0].id), 0);
    submit(&p.warm, b_prompt, nb, &sp[0], &warm[1]);
    /* step 1: A prefills 2 blocks; step 2: A ends its prompt and B starts from A's 3 blocks */
    assert_int_equal(dsv4_sched_step(p.warm.s), 1);
    collect(p.warm.s);
    assert_int_equal(warm[0].n, 0);
    assert_int_equal(dsv4_sched_step(p.warm.s), 1);
    collect(p.warm.s);
    assert_int_equal(warm[0].n, 1);
    run_until(&p.warm, warm, 2);
    assert_int_equal(warm[1].cached_tokens, 3 * B);
    assert_int_equal(warm[0].cached_tokens, 0);
    /* A's answer (2 B tokens) ran past two boundaries while B was running */
    struct answer cold_a;
    struct dsv4_sched_request rc = ra;
    rc.user = &cold_a;
    memset(&cold_a, 0, sizeof(cold_a));
    assert_int_equal(dsv4_sched_submit(p.cold.s, &rc, &cold_a.id), 0);
    run_until(&p.cold, &cold_a, 1);
    answer_expect_same(&warm[0], &cold_a, "the source request");
    answer_expect_same(&warm[1], &cold[1], "the request that hit the running source");

    /* C: A's prompt and answer, then a new turn */
    int32_t c_prompt[3 * B + 5 + 2 * B + 7];
    const int nc = na + 2 * B + 7;
    assert_int_equal(warm[0].n, 2 * B);
    memcpy(c_prompt, a_prompt, sizeof(int32_t) * (size_t)na);
    memcpy(c_prompt + na, warm[0].tokens, sizeof(int32_t) * 2 * B);
    prefix_tokens(c_prompt + na + 2 * B, 7, p.V, 5);
    struct answer c;
    both(&p, c_prompt, nc, &sp[1], &c, "the next turn of the source's conversation");
    /* fed to A's slot: prompt + all but its last token = na + 2B - 1 = 84: 5 blocks */
    assert_int_equal(c.cached_tokens, (na + warm[0].n - 1) / B * B);
    assert_true(c.cached_tokens > na);
    pair_close(&p);
}

/* The same prompt twice, one token under, exactly at and one token over 3 blocks: the second run
 * restores the prompt's last boundary short of its last token, as a lookup asks (2 B, 2 B, 3 B);
 * a prompt of whole blocks also keeps the state at its end, for a longer prompt that continues it. */
static void test_same_prompt_again(void **state)
{
    (void)state;
    struct pair p;
    struct dsv4_sampling sp[2];
    struct answer a;
    char what[96];
    samplings(sp);
    pair_open(&p, "tiny_a", 1, 0, POOL_BYTES, 512);
    const int B = p.B;
    int32_t t[4 * 16 + 1];
    assert_true(3 * B + 1 <= 4 * 16 + 1);
    for (int d = -1; d <= 1; d++) {
        const int n = 3 * B + d;
        prefix_tokens(t, n, p.V, 20 + d);
        for (int run = 0; run < 2; run++) {
            snprintf(what, sizeof(what), "a prompt of 3 blocks %+d tokens, run %d", d, run);
            both(&p, t, n, &sp[run], &a, what);
            if (a.cached_tokens != (run ? (n - 1) / B * B : 0))
                fail_msg("%s: %d tokens restored, not %d", what, a.cached_tokens, run ? (n - 1) / B * B : 0);
        }
    }
    /* the whole 3 blocks and a turn after them */
    prefix_tokens(t, 3 * B + 1, p.V, 20);
    both(&p, t, 3 * B + 1, &sp[0], &a, "a longer prompt through the whole blocks");
    assert_int_equal(a.cached_tokens, 3 * B);
    pair_close(&p);
}

/* Step budgets that are no multiple of the block (as decode_stall_ms makes), 2.5 blocks and 0.7 of
 * one: with the cache on a prompt of 10 blocks and 3 tokens prefills in the calls it takes without
 * a pool, and one more where a chunk ends at the prompt's last boundary; the blocks completed in
 * the middle of a chunk join the cache where the slot next stands on a boundary, so the same prompt
 * again restores all 10. The answers are the cold ones. */
static void test_budget_past_a_boundary(void **state)
{
    (void)state;
    struct dsv4_sampling sp[2];
    struct answer a;
    struct dsv4_sched_stats st;
    char what[96];
    samplings(sp);
    struct dsv4_weights *w = load("tiny_a");
    const int B = dsv4_config_prefix_block(&w->cfg), V = w->cfg.vocab_size;
    dsv4_weights_free(w);
    const int n = 10 * B + 3, budgets[2] = { 2 * B + B / 2, B * 7 / 10 };
    int32_t t[MAX_PROMPT];
    assert_true(n <= MAX_PROMPT && B >= 4);
    prefix_tokens(t, n, V, 7);
    for (int i = 0; i < 2; i++) {
        struct pair p;
        pair_open(&p, "tiny_a", 1, 12 * B, POOL_BYTES, budgets[i]);
        snprintf(what, sizeof(what), "a 10-block prompt under a budget of %d tokens (blocks of %d)", budgets[i], B);
        both(&p, t, n, &sp[0], &a, what);
        assert_int_equal(a.cached_tokens, 0);
        dsv4_sched_get_stats(p.cold.s, &st);
        const uint64_t cold = st.prefill_chunks;
        assert_true(cold == (uint64_t)((n + budgets[i] - 1) / budgets[i]));
        dsv4_sched_get_stats(p.warm.s, &st);
        assert_true(st.prefill_tokens == (uint64_t)n);
        if (st.prefill_chunks < cold || st.prefill_chunks > cold + 1)
            fail_msg("%s: %llu prefill calls, %llu without a pool", what, (unsigned long long)st.prefill_chunks,
                     (unsigned long long)cold);
        assert_int_equal(st.prefix.blocks_saved, 10);
        both(&p, t, n, &sp[1], &a, what);
        assert_int_equal(a.cached_tokens, 10 * B);
        pair_close(&p);
    }
}

/* A prompt that fits the step's budget gets its first token in that step with the cache on too: its
 * chunk ends at its last boundary short of its last token, and the few tokens after it are a call of
 * their own in this step or the next, so they run at once though less than a block of the budget is
 * left (3 blocks and 3 tokens under a budget of 3.5 blocks: 2 calls, one step). The same where the
 * chunk ends where the prompt leaves the cached chain, short of its last boundary. */
static void test_prompt_within_budget(void **state)
{
    (void)state;
    struct pair p;
    struct dsv4_sampling sp[2];
    struct answer a[2];
    struct dsv4_sched_stats st;
    samplings(sp);
    pair_open(&p, "tiny_a", 1, 0, POOL_BYTES, 3 * 16 + 8);
    const int B = p.B, n = 3 * B + 3;
    int32_t t[3 * 16 + 3], u[3 * 16 + 3];
    assert_int_equal(B, 16);
    prefix_tokens(t, n, p.V, 30);
    prefix_tokens(u, n, p.V, 31);
    memcpy(u, t, sizeof(int32_t) * (size_t)B);
    /* t once, then u, which leaves t's chain after its first block (restored: nothing, t's prefill
     * stood at none of t's inner boundaries), so its chunk ends there and again at its last boundary */
    const int32_t *prompts[2] = { t, u };
    for (int r = 0; r < 2; r++) {
        struct env *e[2] = { &p.cold, &p.warm };
        for (int w = 0; w < 2; w++) {
            dsv4_sched_get_stats(e[w]->s, &st);
            const uint64_t chunks = st.prefill_chunks;
            submit(e[w], prompts[r], n, &sp[0], &a[w]);
            assert_int_equal(dsv4_sched_step(e[w]->s), 1);
            collect(e[w]->s);
            dsv4_sched_get_stats(e[w]->s, &st);
            if (a[w].n != 1)
                fail_msg("prompt %d, %s: %d tokens after the first step (%llu prefill calls), not 1", r,
                         w ? "with the cache" : "without", a[w].n, (unsigned long long)(st.prefill_chunks - chunks));
            run_until(e[w], &a[w], 1);
        }
        answer_expect_same(&a[1], &a[0], r ? "a prompt leaving the cached chain" : "a prompt within the budget");
        assert_int_equal(a[1].cached_tokens, 0);
    }
    pair_close(&p);
}

/* tiny_a's prefix pool geometry (pages of a block record and of a boundary record), to size pools by
 * the snapshots they hold. */
static struct dsv4_prefix_geom tiny_a_geom(void)
{
    struct dsv4_weights *w = load("tiny_a");
    struct dsv4_backend_opts bo = { .max_batch = 1, .max_context = 128, .threads = 1,
                                    .prefix_pool_bytes = POOL_BYTES };
    struct dsv4_backend *probe;
    assert_int_equal(dsv4_backend_cpu_create(w, &bo, &probe), 0);
    const struct dsv4_prefix_geom g = probe->prefix;
    dsv4_backend_destroy(probe);
    dsv4_weights_free(w);
    return g;
}

/* A pool of a few snapshots under many prompts: evictions happen, hits continue on what is left,
 * every answer stays the cold one, and the counts add up. */
static void test_eviction(void **state)
{
    (void)state;
    const struct dsv4_prefix_geom g = tiny_a_geom();

    struct pair p;
    struct dsv4_sampling sp[2];
    samplings(sp);
    /* room for 5 snapshots: fewer than one round of the prompts below makes */
    pair_open(&p, "tiny_a", 1, 128, 5 * (g.block_pages + g.boundary_pages) * g.page_bytes, 512);
    const int B = p.B, n = 3 * B + 2;
    int32_t prompts[6][3 * 16 + 2];
    assert_int_equal(B, 16);
    assert_true(n <= 3 * 16 + 2);
    for (int i = 0; i < 6; i++)
        prefix_tokens(prompts[i], n, p.V, 10 + i);
    uint64_t hits = 0, hit_tokens = 0;
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < 6; i++) {
            struct answer a;
            char what[64];
            snprintf(what, sizeof(what), "round %d, prompt %d", round, i);
            /* the same prompt twice in a row: the second finds it whatever the first did */
            for (int twice = 0; twice < 2; twice++) {
                both(&p, prompts[i], n, &sp[round % 2], &a, what);
                hits += a.cached_tokens > 0;
                hit_tokens += (uint64_t)a.cached_tokens;
            }
            assert_int_equal(a.cached_tokens, 3 * B);
        }
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(p.warm.s, &st);
    assert_true(st.prefix.boundaries_evicted > 0);
    assert_true(st.prefix.nodes_evicted > 0);
    assert_true(st.prefix.pages_used <= st.prefix.pages_total);
    assert_int_equal(st.prefix.lookups, 36);
    assert_int_equal(st.prefix.hits, hits);
    assert_int_equal(st.prefix.hit_tokens, hit_tokens);
    pair_close(&p);
}

/* A prompt longer than the pool can hold: its chain stops at the deepest block the pool holds with
 * the state there (a chunk ends at that boundary to keep it), instead of evicting everything else for
 * blocks that nothing could restore. The same prompt again restores those blocks; the answers are the
 * cold ones. */
static void test_prompt_past_the_pool(void **state)
{
    (void)state;
    const struct dsv4_prefix_geom g = tiny_a_geom();
    assert_true(g.block_pages > 0);

    struct pair p;
    struct dsv4_sampling sp[2];
    struct answer a;
    samplings(sp);
    /* room for a chain of 4 blocks and the state at its end */
    pair_open(&p, "tiny_a", 1, 12 * 16, (4 * g.block_pages + g.boundary_pages) * g.page_bytes, 512);
    const int B = p.B, n = 10 * B + 3;
    int32_t t[10 * 16 + 3];
    assert_int_equal(B, 16);
    prefix_tokens(t, n, p.V, 40);
    both(&p, t, n, &sp[0], &a, "a prompt of 10 blocks in a pool of 4");
    assert_int_equal(a.cached_tokens, 0);
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(p.warm.s, &st);
    assert_int_equal(st.prefix.blocks_saved, 4);
    assert_int_equal(st.prefix.boundaries_saved, 1);
    both(&p, t, n, &sp[1], &a, "the same prompt again");
    assert_int_equal(a.cached_tokens, 4 * B);
    pair_close(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backend_bit_identical),
        cmocka_unit_test(test_pool_too_small),
        cmocka_unit_test(test_hits_at_every_boundary),
        cmocka_unit_test(test_hit_on_running_source),
        cmocka_unit_test(test_same_prompt_again),
        cmocka_unit_test(test_budget_past_a_boundary),
        cmocka_unit_test(test_prompt_within_budget),
        cmocka_unit_test(test_eviction),
        cmocka_unit_test(test_prompt_past_the_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
