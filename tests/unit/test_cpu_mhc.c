/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_mhc: hyper-connection pre/post/head against doc/MODEL.md §3.3's mHC formulas computed in double
 * (mixes scaled after the projection, Sinkhorn as written there), for hc_mult 4 and 3. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "cpu_test_util.h"

#define D 24

static double sigmoid(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

/* MODEL.md §3.3: m = (fn @ flatten(X)) * rsqrt(mean(X^2) + eps) */
static void mixes(const struct dsv4_linear *fn, const float *X, int hc, double eps, double *m)
{
    double ss = 0.0;
    for (int i = 0; i < hc * D; i++)
        ss += (double)X[i] * X[i];
    test_matvec(fn, X, m);
    for (int i = 0; i < fn->out; i++)
        m[i] /= sqrt(ss / (hc * D) + eps);
}

static void check_site(int hc, int iters)
{
    struct dsv4_config cfg = {.dim = D, .hc_mult = hc, .hc_sinkhorn_iters = iters, .hc_eps = 1e-6,
                              .rms_norm_eps = 1e-6};
    struct dsv4_cpu_ctx c = {.cfg = &cfg, .num = DSV4_NUMERICS_EXACT, .wk = test_work(64 * D)};
    struct dsv4_cpu_work *wk = c.wk;
    int nmix = (2 + hc) * hc;
    struct dsv4_hc site = {.fn = test_linear(nmix, hc * D, 0.3), .base = test_randv(nmix, 1.0, 0.0),
                           .scale = test_randv(3, 0.5, 1.0)};
    for (int i = 0; i < hc * D; i++)
        wk->X[i] = (float)(2.0 * test_frand());
    float X0[8 * D];
    memcpy(X0, wk->X, sizeof(float) * (size_t)(hc * D));

    dsv4_cpu_hc_pre(&c, &site);

    double m[80], pre[8], post[8], comb[64], y[D];
    mixes(&site.fn, X0, hc, cfg.rms_norm_eps, m);
    for (int j = 0; j < hc; j++) {
        pre[j] = sigmoid(m[j] * site.scale[0] + site.base[j]) + cfg.hc_eps;
        post[j] = 2.0 * sigmoid(m[hc + j] * site.scale[1] + site.base[hc + j]);
    }
    for (int j = 0; j < hc; j++) {
        double s = 0.0;
        for (int k = 0; k < hc; k++) {
            comb[j * hc + k] = exp(m[2 * hc + j * hc + k] * site.scale[2] + site.base[2 * hc + j * hc + k]);
            s += comb[j * hc + k];
        }
        for (int k = 0; k < hc; k++)
            comb[j * hc + k] = comb[j * hc + k] / s + cfg.hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        for (int pass = it == 0 ? 1 : 0; pass < 2; pass++) {
            for (int a = 0; a < hc; a++) {
                /* pass 0: row a; pass 1: column a */
                int step = pass ? hc : 1;
                double *line = pass ? &comb[a] : &comb[a * hc];
                double s = 0.0;
                for (int b = 0; b < hc; b++)
                    s += line[b * step];
                for (int b = 0; b < hc; b++)
                    line[b * step] /= s + cfg.hc_eps;
            }
        }
    }
    for (int d = 0; d < D; d++) {
        y[d] = 0.0;
        for (int j = 0; j < hc; j++)
            y[d] += pre[j] * X0[j * D + d];
    }
    assert_close(wk->pre, pre, hc, 1e-5);
    assert_close(wk->post, post, hc, 1e-5);
    assert_close(wk->comb, comb, hc * hc, 1e-5);
    assert_close(wk->y, y, D, 1e-5);
    /* Sinkhorn's last pass normalizes the columns: each sums to 1 (up to eps). */
    for (int k = 0; k < hc; k++) {
        double s = 0.0;
        for (int j = 0; j < hc; j++)
            s += wk->comb[j * hc + k];
        assert_true(fabs(s - 1.0) < 1e-4);
    }

    /* post: X'[k] = post_k out + sum_j comb[j,k] X[j] (the first index is summed) */
    float *out = test_randv(D, 1.0, 0.0);
    double want[8 * D];
    for (int k = 0; k < hc; k++)
        for (int d = 0; d < D; d++) {
            want[k * D + d] = post[k] * out[d];
            for (int j = 0; j < hc; j++)
                want[k * D + d] += comb[j * hc + k] * X0[j * D + d];
        }
    dsv4_cpu_hc_post(&c, out);
    assert_close(wk->X, want, hc * D, 1e-5);
}

static void test_site_hc4(void **state)
{
    srand(3);
    check_site(4, 20);
    test_free_all();
}

static void test_site_hc3(void **state)
{
    srand(4);
    check_site(3, 7);
    test_free_all();
}

/* hc_head: pre_j = sigmoid(m_j * scale + base_j) + eps; y = sum_j pre_j X[j] */
static void test_head(void **state)
{
    srand(5);
    int hc = 4;
    struct dsv4_config cfg = {.dim = D, .hc_mult = hc, .hc_eps = 1e-6, .rms_norm_eps = 1e-6};
    struct dsv4_cpu_ctx c = {.cfg = &cfg, .num = DSV4_NUMERICS_EXACT, .wk = test_work(64 * D)};
    struct dsv4_hc_head hh = {.fn = test_linear(hc, hc * D, 0.3), .base = test_randv(hc, 1.0, 0.0),
                              .scale = test_randv(1, 0.5, 1.0)};
    float *X = test_randv(hc * D, 2.0, 0.0);
    float y[D];
    double m[8], want[D];
    dsv4_cpu_hc_head(&c, &hh, X, y);
    mixes(&hh.fn, X, hc, cfg.rms_norm_eps, m);
    for (int d = 0; d < D; d++) {
        want[d] = 0.0;
        for (int j = 0; j < hc; j++)
            want[d] += (sigmoid(m[j] * hh.scale[0] + hh.base[j]) + cfg.hc_eps) * X[j * D + d];
    }
    assert_close(y, want, D, 1e-5);
    test_free_all();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_site_hc4),
        cmocka_unit_test(test_site_hc3),
        cmocka_unit_test(test_head),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
