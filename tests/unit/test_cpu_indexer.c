/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_indexer: the lightning indexer's choice against doc/MODEL.md §3.6 in double:
 *   qI = wq_b qr, RoPE on each head's last rope_dim values; w = weights_proj xn * nI^-0.5;
 *   score_s = sum_h w_h ReLU(qI_h . k_s) dI^-0.5; the top index_topk entries, ascending. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "cpu_test_util.h"

#define D 16
#define QL 12
#define NH 4
#define DI 16
#define RD 4
#define TOPK 5
#define ENTRIES 23

struct rig {
    struct dsv4_config cfg;
    struct dsv4_cpu_ctx c;
    struct dsv4_layer layer;
    struct dsv4_cpu_layer_state ls;
    float *xn, *qr;
};

static void rig_init(struct rig *g)
{
    memset(g, 0, sizeof(*g));
    g->cfg = (struct dsv4_config){.dim = D, .q_lora_rank = QL, .index_n_heads = NH, .index_head_dim = DI,
                                  .index_topk = TOPK, .rope_dim = RD, .rope_compress = {.theta = 5000.0}};
    g->c = (struct dsv4_cpu_ctx){.cfg = &g->cfg, .num = DSV4_NUMERICS_EXACT, .wk = test_work(256)};
    dsv4_cpu_rope_init(&g->c.wk->rope_compress, &g->cfg.rope_compress, RD);
    g->layer.attn.indexer.wq_b = test_linear(NH * DI, QL, 0.5);
    g->layer.attn.indexer.weights_proj = test_linear(NH, D, 0.5);
    g->ls.index_keys = test_randv(ENTRIES * DI, 1.0, 0.0);
    g->xn = test_randv(D, 1.0, 0.0);
    g->qr = test_randv(QL, 1.0, 0.0);
}

static void oracle_scores(const struct rig *g, int64_t pos, int n, double *score)
{
    double q[NH * DI], w[NH];
    test_matvec(&g->layer.attn.indexer.wq_b, g->qr, q);
    test_matvec(&g->layer.attn.indexer.weights_proj, g->xn, w);
    for (int h = 0; h < NH; h++) {
        double *x = q + h * DI + DI - RD;
        for (int p = 0; p < RD / 2; p++) {
            double a = pos * pow(5000.0, -2.0 * p / RD), x0 = x[2 * p], x1 = x[2 * p + 1];
            x[2 * p] = x0 * cos(a) - x1 * sin(a);
            x[2 * p + 1] = x1 * cos(a) + x0 * sin(a);
        }
    }
    for (int s = 0; s < n; s++) {
        score[s] = 0.0;
        for (int h = 0; h < NH; h++) {
            double dot = 0.0;
            for (int i = 0; i < DI; i++)
                dot += q[h * DI + i] * g->ls.index_keys[s * DI + i];
            score[s] += w[h] / sqrt(NH) * fmax(dot, 0.0) / sqrt(DI);
        }
    }
}

static void test_topk_matches_scores(void **state)
{
    srand(61);
    struct rig g;
    for (int trial = 0; trial < 10; trial++) {
        rig_init(&g);
        int64_t pos = 4 * ENTRIES + trial % 4 - 1;
        int n = dsv4_cpu_indexer_select(&g.c, &g.layer, &g.ls, g.xn, g.qr, pos, ENTRIES);
        assert_int_equal(n, TOPK);
        double score[ENTRIES];
        oracle_scores(&g, pos, ENTRIES, score);
        /* ascending, distinct, and no unchosen entry scores above a chosen one */
        for (int i = 1; i < n; i++)
            assert_true(g.c.wk->isel[i] > g.c.wk->isel[i - 1]);
        double lowest = INFINITY;
        bool chosen[ENTRIES] = {false};
        for (int i = 0; i < n; i++) {
            chosen[g.c.wk->isel[i]] = true;
            lowest = fmin(lowest, score[g.c.wk->isel[i]]);
        }
        /* exact ties only happen at 0 (every head's ReLU closed); they keep the lower entries */
        int last = -1;
        for (int i = 0; i < n; i++)
            if (score[g.c.wk->isel[i]] == 0.0)
                last = g.c.wk->isel[i];
        for (int s = 0; s < ENTRIES; s++)
            if (!chosen[s])
                assert_true(score[s] < lowest || (score[s] == 0.0 && lowest == 0.0 && s > last));
        test_free_all();
    }
}

/* Equal scores keep the lower entries; fewer complete entries than top-k keeps them all. */
static void test_ties_and_short(void **state)
{
    srand(62);
    struct rig g;
    rig_init(&g);
    for (int s = 1; s < ENTRIES; s++)
        memcpy(g.ls.index_keys + s * DI, g.ls.index_keys, sizeof(float) * DI);
    int n = dsv4_cpu_indexer_select(&g.c, &g.layer, &g.ls, g.xn, g.qr, 4 * ENTRIES - 1, ENTRIES);
    assert_int_equal(n, TOPK);
    for (int i = 0; i < TOPK; i++)
        assert_int_equal(g.c.wk->isel[i], i);
    n = dsv4_cpu_indexer_select(&g.c, &g.layer, &g.ls, g.xn, g.qr, 13, 3);
    assert_int_equal(n, 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(g.c.wk->isel[i], i);
    assert_int_equal(dsv4_cpu_indexer_select(&g.c, &g.layer, &g.ls, g.xn, g.qr, 2, 0), 0);
    test_free_all();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topk_matches_scores),
        cmocka_unit_test(test_ties_and_short),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
