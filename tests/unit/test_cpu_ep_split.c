/* SPDX-License-Identifier: MIT */
/* The routed experts split across ranks by contiguous expert ranges (engine/model/ep_plan.h), computed
 * with the CPU reference's own pieces (engine/cpu/cpu_moe.c), against the unsplit MoE sublayer, on the
 * committed models, every layer (and the MTP block's), exact and fp8 numerics, 1, 2, 4 and 8 ranks
 * where the model has that many experts.
 *
 * Two ways back to the token's rank, as doc/MULTIGPU.md describes:
 *   by slot: each rank returns the unweighted output of every (token, slot) whose expert it holds and
 *     the token's rank combines them in the reference's order: bitwise the unsplit output;
 *   by partial sum: each rank returns the weighted sum over its own experts and the token's rank adds
 *     those in rank order (what a reduce-scatter does). That is another association of the same K
 *     products t_k = wt_k * row_k, so it is not bitwise: any order of summing K floats is within
 *     gamma(K-1) * sum |t_k| of the exact sum (gamma(n) = n u / (1 - n u), u = 2^-24), so two orders
 *     differ by at most 2 gamma(K-1) sum |t_k|. Adding the shared expert rounds once more on each
 *     side: at most u / (1 - u) (|a| + |b|) beyond that. The test holds every element to that bound,
 *     and with one rank to bitwise equality. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "cpu_test_util.h"
#include "engine/model/ep_plan.h"

#define TRIALS 12               /* random inputs per layer */
#define U (1.0 / 16777216.0)    /* f32 unit roundoff, 2^-24 */

static const int RANKS[] = {1, 2, 4, 8};

struct tally {
    long compared;              /* (model, layer, numerics, ranks, trial) cases */
    long spanning;              /* of those with ranks > 1, where the token's experts lay on two ranks or more */
    long partial_differs;       /* elements where the partial-sum path is not bitwise the unsplit one */
    double worst;               /* largest |difference| / bound seen */
};

static double gamma_n(int n)
{
    return n * U / (1.0 - n * U);
}

static int rank_of(int n_experts, int n_ranks, int expert)
{
    for (int r = 0; r < n_ranks; r++) {
        int e0, e1;
        assert_int_equal(dsv4_ep_shard(n_experts, n_ranks, r, &e0, &e1), 0);
        if (expert >= e0 && expert < e1)
            return r;
    }
    fail_msg("expert %d is on no rank of %d", expert, n_ranks);
    return -1;
}

static void check_layer(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *l, struct tally *t)
{
    const struct dsv4_config *cfg = c->cfg;
    const int D = cfg->dim, E = cfg->n_experts, K = cfg->n_experts_per_tok;
    float *x = test_alloc((size_t)D * sizeof(float)), *xn = test_alloc((size_t)D * sizeof(float));
    float *ref = test_alloc((size_t)D * sizeof(float)), *out = test_alloc((size_t)D * sizeof(float));
    float *routed = test_alloc((size_t)D * sizeof(float)), *part = test_alloc((size_t)D * sizeof(float));
    float *full = test_alloc((size_t)D * sizeof(float));
    float *rows = test_alloc((size_t)K * D * sizeof(float));
    float *mine = test_alloc((size_t)8 * K * D * sizeof(float));    /* [rank][K, D] what each rank computed */

    for (int trial = 0; trial < TRIALS; trial++) {
        /* The sublayer's real input: an RMS-normed row times the layer's ffn_norm. */
        for (int d = 0; d < D; d++)
            x[d] = (float)(2.0 * test_frand());
        dsv4_cpu_rmsnorm(xn, x, l->ffn_norm, D, cfg->rms_norm_eps);
        const int32_t token = rand() % cfg->vocab_size;
        int idx[DSV4_MAX_TOPK];
        float wt[DSV4_MAX_TOPK];

        dsv4_cpu_moe(c, &l->ffn, xn, token, ref);
        dsv4_cpu_moe_route(c, &l->ffn, xn, token, idx, wt);
        /* the unsplit routed sum, for the bound's sum |t_k| */
        dsv4_cpu_moe_experts(c, &l->ffn, xn, idx, 0, E, rows);
        dsv4_cpu_moe_combine(cfg, idx, wt, rows, 0, E, full);

        for (size_t ri = 0; ri < sizeof(RANKS) / sizeof(RANKS[0]); ri++) {
            const int n = RANKS[ri];
            if (n > E)
                continue;
            t->compared++;
            /* Every rank computes the slots of the experts it holds; the rest of its rows stay NaN,
             * so a slot no rank computed, or one taken from the wrong rank, poisons the result. */
            for (size_t i = 0; i < (size_t)n * K * D; i++)
                mine[i] = NAN;
            for (int r = 0; r < n; r++) {
                int e0, e1;
                assert_int_equal(dsv4_ep_shard(E, n, r, &e0, &e1), 0);
                dsv4_cpu_moe_experts(c, &l->ffn, xn, idx, e0, e1, mine + (size_t)r * K * D);
            }
            int first = rank_of(E, n, idx[0]), span = 0;
            for (int k = 0; k < K; k++)
                span |= rank_of(E, n, idx[k]) != first;
            t->spanning += span;

            /* by slot: the token's rank takes slot k's row from the rank holding idx[k] */
            for (int k = 0; k < K; k++)
                memcpy(rows + (size_t)k * D, mine + ((size_t)rank_of(E, n, idx[k]) * K + k) * D,
                       (size_t)D * sizeof(float));
            dsv4_cpu_moe_combine(cfg, idx, wt, rows, 0, E, out);
            dsv4_cpu_moe_shared(c, &l->ffn, xn, out);
            assert_memory_equal(out, ref, (size_t)D * sizeof(float));

            /* by partial sum: rank r's weighted sum over its experts, added in rank order */
            for (int r = 0; r < n; r++) {
                int e0, e1;
                assert_int_equal(dsv4_ep_shard(E, n, r, &e0, &e1), 0);
                dsv4_cpu_moe_combine(cfg, idx, wt, mine + (size_t)r * K * D, e0, e1, r ? part : routed);
                for (int d = 0; r && d < D; d++)
                    routed[d] += part[d];
            }
            memcpy(out, routed, (size_t)D * sizeof(float));
            dsv4_cpu_moe_shared(c, &l->ffn, xn, out);
            if (n == 1) {
                assert_memory_equal(out, ref, (size_t)D * sizeof(float));
                continue;
            }
            for (int d = 0; d < D; d++) {
                double abs_terms = 0.0;
                for (int k = 0; k < K; k++)
                    abs_terms += fabs((double)(rows[(size_t)k * D + d] * wt[k]));
                const double sum_bound = 2.0 * gamma_n(K - 1) * abs_terms;
                const double out_bound = sum_bound + U / (1.0 - U) * (fabs(out[d]) + fabs(ref[d]));
                const double dsum = fabs((double)routed[d] - full[d]), dout = fabs((double)out[d] - ref[d]);
                assert_true(isfinite(out[d]));
                if (dsum > sum_bound || dout > out_bound)
                    fail_msg("element %d, %d ranks: routed %.9g vs %.9g (bound %.3g), out %.9g vs %.9g (bound %.3g)",
                             d, n, routed[d], full[d], sum_bound, out[d], ref[d], out_bound);
                t->partial_differs += out[d] != ref[d];
                if (out_bound > 0 && dout / out_bound > t->worst)
                    t->worst = dout / out_bound;
            }
        }
    }
}

static void check_model(const char *rel, enum dsv4_numerics num)
{
    const char *top = getenv("top_srcdir");
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/%s", top ? top : ".", rel);
    struct dsv4_weights *w = NULL;
    assert_int_equal(dsv4_weights_load(dir, &w), 0);
    const struct dsv4_config *cfg = &w->cfg;
    int64_t n = dsv4_cpu_max_linear_in(w);
    const int64_t cand[] = {(int64_t)cfg->n_experts_per_tok * cfg->dim, cfg->n_experts, cfg->moe_inter,
                            w->layers[0].ffn.sw1.out};
    for (size_t i = 0; i < sizeof(cand) / sizeof(cand[0]); i++)
        n = cand[i] > n ? cand[i] : n;
    struct dsv4_cpu_ctx c = {.w = w, .cfg = cfg, .num = num, .wk = test_work(n)};
    struct tally t = {0};

    for (int i = 0; i < cfg->n_layers; i++)
        check_layer(&c, &w->layers[i], &t);
    for (int i = 0; i < w->n_mtp; i++)
        check_layer(&c, &w->mtp[i].layer, &t);
    printf("# %s %s: %d experts, top-%d, %d layers + %d MTP: %ld cases, %ld with experts on two ranks or more; "
           "partial sums not bitwise in %ld elements, at most %.3f of the bound\n",
           rel, num == DSV4_NUMERICS_FP8 ? "fp8" : "exact", cfg->n_experts, cfg->n_experts_per_tok, cfg->n_layers,
           w->n_mtp, t.compared, t.spanning, t.partial_differs, t.worst);
    /* the split must have been exercised: tokens whose experts are spread over ranks */
    assert_true(t.spanning > 0);
    test_free_all();
    dsv4_weights_free(w);
}

static void test_shard(void **state)
{
    /* contiguous, disjoint, covering, sizes within one of each other, larger ones first */
    for (int E = 1; E <= 40; E++) {
        for (int n = 1; n <= E && n <= DSV4_EP_MAX_GPUS; n++) {
            int next = 0;
            for (int r = 0; r < n; r++) {
                int e0, e1;
                assert_int_equal(dsv4_ep_shard(E, n, r, &e0, &e1), 0);
                assert_int_equal(e0, next);
                assert_int_equal(e1 - e0, E / n + (r < E % n));
                next = e1;
            }
            assert_int_equal(next, E);
        }
    }
    int e0, e1;
    assert_int_equal(dsv4_ep_shard(256, 8, 3, &e0, &e1), 0);
    assert_int_equal(e0, 96);
    assert_int_equal(e1, 128);
    assert_int_equal(dsv4_ep_shard(6, 4, 3, &e0, &e1), 0);     /* 2, 2, 1, 1 */
    assert_int_equal(e0, 5);
    assert_int_equal(e1, 6);
    assert_int_equal(dsv4_ep_shard(8, 9, 0, &e0, &e1), -EINVAL);
    assert_int_equal(dsv4_ep_shard(8, 0, 0, &e0, &e1), -EINVAL);
    assert_int_equal(dsv4_ep_shard(8, 2, 2, &e0, &e1), -EINVAL);
    assert_int_equal(dsv4_ep_shard(8, 2, -1, &e0, &e1), -EINVAL);
}

static void test_fixtures(void **state)
{
    static const char *models[] = {"tests/fixtures/tiny_a", "tests/fixtures/tiny_b", "tests/fixtures/tiny_c",
                                   "tests/fixtures/tiny_a_mtp", "tests/fixtures/tiny_b_mtp"};
    srand(41);
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
        check_model(models[i], DSV4_NUMERICS_EXACT);
        check_model(models[i], DSV4_NUMERICS_FP8);
    }
}

static void test_default_models(void **state)
{
    srand(42);
    check_model("models/default", DSV4_NUMERICS_EXACT);
    check_model("models/default-fp8", DSV4_NUMERICS_FP8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard),
        cmocka_unit_test(test_fixtures),
        cmocka_unit_test(test_default_models),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
