/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_rope: interleaved-pair RoPE and YaRN frequencies against doc/MODEL.md §3.1's formulas in double. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine/cpu/cpu_ops.h"

static double frand(void)
{
    return rand() / (double)RAND_MAX * 2.0 - 1.0;
}

static void assert_rel(double got, double want, double tol)
{
    double err = fabs(got - want) / fabs(want);
    if (!(err <= tol))
        fail_msg("got %.9g, want %.9g (relative error %.3g > %.3g)", got, want, err, tol);
}

/* V4-Flash's compress RoPE: theta 160000, rope_dim 64, YaRN factor 16 over 65536 positions, betas 32/1.
 * MODEL.md §3.1: low 15, high 25; pairs up to low keep f_i, pairs from high on use f_i / 16, linear in between. */
static void test_yarn_flash(void **state)
{
    struct dsv4_rope p = {.theta = 160000.0, .yarn = true, .yarn_factor = 16.0, .yarn_original_max = 65536,
                          .beta_fast = 32.0, .beta_slow = 1.0};
    struct dsv4_cpu_rope r;
    dsv4_cpu_rope_init(&r, &p, 64);
    assert_int_equal(r.dim, 64);
    for (int i = 0; i < 32; i++) {
        double f = pow(160000.0, -2.0 * i / 64.0);
        double ramp = fmin(fmax((i - 15.0) / (25.0 - 15.0), 0.0), 1.0);
        double want = f / 16.0 * ramp + f * (1.0 - ramp);
        assert_rel(r.inv_freq[i], want, 1e-6);
    }
    assert_rel(r.inv_freq[10], pow(160000.0, -20.0 / 64.0), 1e-6);
    assert_rel(r.inv_freq[30], pow(160000.0, -60.0 / 64.0) / 16.0, 1e-6);
}

static void test_plain_frequencies(void **state)
{
    struct dsv4_rope p = {.theta = 10000.0};
    struct dsv4_cpu_rope r;
    dsv4_cpu_rope_init(&r, &p, 8);
    for (int i = 0; i < 4; i++)
        assert_rel(r.inv_freq[i], pow(10000.0, -2.0 * i / 8.0), 1e-6);
}

/* x'[2i] = x[2i] cos(pos f_i) - x[2i+1] sin(pos f_i); x'[2i+1] = x[2i+1] cos + x[2i] sin. */
static void test_rotation_and_inverse(void **state)
{
    struct dsv4_rope p = {.theta = 40000.0};
    struct dsv4_cpu_rope r;
    dsv4_cpu_rope_init(&r, &p, 16);
    srand(7);
    for (int trial = 0; trial < 20; trial++) {
        float x[16], y[16];
        int64_t pos = rand() % 5000;
        for (int i = 0; i < 16; i++)
            x[i] = y[i] = (float)frand();
        dsv4_cpu_rope_apply(&r, y, pos, false);
        for (int i = 0; i < 8; i++) {
            double a = pos * (double)r.inv_freq[i];
            double w0 = x[2 * i] * cos(a) - x[2 * i + 1] * sin(a);
            double w1 = x[2 * i + 1] * cos(a) + x[2 * i] * sin(a);
            /* f32 angles of up to ~5000 rad carry ~3e-4 absolute error */
            assert_true(fabs(y[2 * i] - w0) < 1e-3 && fabs(y[2 * i + 1] - w1) < 1e-3);
        }
        dsv4_cpu_rope_apply(&r, y, pos, true);
        for (int i = 0; i < 16; i++)
            assert_true(fabs(y[i] - x[i]) < 1e-5);
    }
}

/* q.k after RoPE depends only on the distance between the positions. */
static void test_relative_position(void **state)
{
    struct dsv4_rope p = {.theta = 10000.0};
    struct dsv4_cpu_rope r;
    dsv4_cpu_rope_init(&r, &p, 8);
    srand(11);
    float q[8], k[8];
    for (int i = 0; i < 8; i++) {
        q[i] = (float)frand();
        k[i] = (float)frand();
    }
    double first = 0.0;
    for (int shift = 0; shift < 200; shift += 37) {
        float a[8], b[8];
        for (int i = 0; i < 8; i++) {
            a[i] = q[i];
            b[i] = k[i];
        }
        dsv4_cpu_rope_apply(&r, a, 50 + shift, false);
        dsv4_cpu_rope_apply(&r, b, 20 + shift, false);
        double dot = 0.0;
        for (int i = 0; i < 8; i++)
            dot += (double)a[i] * b[i];
        if (shift == 0)
            first = dot;
        else
            assert_true(fabs(dot - first) < 1e-4);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_yarn_flash),
        cmocka_unit_test(test_plain_frequencies),
        cmocka_unit_test(test_rotation_and_inverse),
        cmocka_unit_test(test_relative_position),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
