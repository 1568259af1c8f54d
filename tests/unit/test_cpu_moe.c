/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_moe: routing and experts against doc/MODEL.md §3.7 in double: sqrt(softplus) scores, the
 * bias only for selection, normalized top-k weights times routed_scaling_factor, the SwiGLU clamp in
 * routed and shared experts; hash layers take tid2eid[token]. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "cpu_test_util.h"

#define D 16
#define E 8
#define K 3
#define I 12
#define LIMIT 0.6
#define VOCAB 5

static int clamp_hits;
static int bias_changed;    /* trials where the bias changed the chosen set */

static void oracle_expert(const struct dsv4_linear *w1, const struct dsv4_linear *w3, const struct dsv4_linear *w2,
                          const float *x, double *y)
{
    double g[I], u[I];
    float h[I];
    test_matvec(w1, x, g);
    test_matvec(w3, x, u);
    for (int i = 0; i < I; i++) {
        clamp_hits += g[i] > LIMIT || fabs(u[i]) > LIMIT;
        double gc = fmin(g[i], LIMIT), uc = fmin(fmax(u[i], -LIMIT), LIMIT);
        h[i] = (float)(gc / (1.0 + exp(-gc)) * uc);
    }
    test_matvec(w2, h, y);
}

static void check_moe(enum dsv4_mlp_type type)
{
    struct dsv4_config cfg = {.dim = D, .n_experts = E, .n_experts_per_tok = K, .moe_inter = I,
                              .routed_scaling_factor = 2.5, .swiglu_limit = LIMIT};
    struct dsv4_cpu_ctx c = {.cfg = &cfg, .num = DSV4_NUMERICS_EXACT, .wk = test_work(64)};
    struct dsv4_ffn ffn = {.type = type, .gate = test_linear(E, D, 0.6)};
    ffn.w1 = test_alloc(sizeof(*ffn.w1) * E);
    ffn.w3 = test_alloc(sizeof(*ffn.w3) * E);
    ffn.w2 = test_alloc(sizeof(*ffn.w2) * E);
    for (int e = 0; e < E; e++) {
        ffn.w1[e] = test_linear(I, D, 0.5);
        ffn.w3[e] = test_linear(I, D, 0.5);
        ffn.w2[e] = test_linear(D, I, 0.5);
    }
    ffn.sw1 = test_linear(I, D, 0.5);
    ffn.sw3 = test_linear(I, D, 0.5);
    ffn.sw2 = test_linear(D, I, 0.5);
    int32_t *table = test_alloc(sizeof(int32_t) * VOCAB * K);
    if (type == DSV4_MLP_HASH) {
        for (int t = 0; t < VOCAB * K; t++)
            table[t] = (t * 5 + t / K) % E;
        ffn.tid2eid = table;
    } else {
        ffn.gate_bias = test_randv(E, 0.4, 0.0);
    }

    clamp_hits = 0;
    bias_changed = 0;
    for (int trial = 0; trial < 20; trial++) {
        int32_t token = trial % VOCAB;
        float *x = test_randv(D, 1.5, 0.0);
        float out[D];
        dsv4_cpu_moe(&c, &ffn, x, token, out);

        double logit[E], s[E], want[D], y[D];
        test_matvec(&ffn.gate, x, logit);
        for (int e = 0; e < E; e++)
            s[e] = sqrt(log1p(exp(logit[e])));
        int idx[K];
        bool used[E] = {false};
        for (int k = 0; k < K; k++) {
            if (type == DSV4_MLP_HASH) {
                idx[k] = table[token * K + k];
                continue;
            }
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!used[e] && (best < 0 || s[e] + ffn.gate_bias[e] > s[best] + ffn.gate_bias[best]))
                    best = e;
            used[best] = true;
            idx[k] = best;
        }
        if (type != DSV4_MLP_HASH) {
            int unbiased = 0;
            for (int k = 0; k < K; k++) {
                int rank = 0;
                for (int e = 0; e < E; e++)
                    rank += s[e] > s[idx[k]];
                unbiased += rank < K;
            }
            bias_changed += unbiased < K;
        }
        double sum = 0.0;
        for (int k = 0; k < K; k++)
            sum += s[idx[k]];
        oracle_expert(&ffn.sw1, &ffn.sw3, &ffn.sw2, x, want);
        for (int k = 0; k < K; k++) {
            oracle_expert(&ffn.w1[idx[k]], &ffn.w3[idx[k]], &ffn.w2[idx[k]], x, y);
            for (int d = 0; d < D; d++)
                want[d] += s[idx[k]] / sum * 2.5 * y[d];
        }
        assert_close(out, want, D, 1e-5);
    }
    /* The data must drive pre-activations past the limit, or the clamp goes untested. */
    assert_true(clamp_hits > 20);
    if (type != DSV4_MLP_HASH)
        assert_true(bias_changed > 0);
    test_free_all();
}

static void test_scored(void **state)
{
    srand(31);
    check_moe(DSV4_MLP_MOE);
}

static void test_hash(void **state)
{
    srand(32);
    check_moe(DSV4_MLP_HASH);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scored),
        cmocka_unit_test(test_hash),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
