/* SPDX-License-Identifier: MIT */
/* engine/model/quant: hand-computed encodings (subnormals, negative zero, NaN codes, saturation,
 * rounding ties, extreme scales), exhaustive code round trips, and the converters against
 * brute-force nearest-value oracles on fresh random inputs. */
#include "build-config.h"

#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/model/quant.h"
#include "tests/unit/seed_util.h"
#include "tests/unit/st_writer.h"

static uint64_t seed;

static uint32_t bits(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;

    memcpy(&f, &u, 4);
    return f;
}

static void test_bf16(void **state)
{
    uint64_t s = seed;

    assert_int_equal(dsv4_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(dsv4_f32_to_bf16(-2.0f), 0xc000);
    assert_int_equal(dsv4_f32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(dsv4_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(dsv4_f32_to_bf16(from_bits(0x3f808000)), 0x3f80);   /* tie, even stays */
    assert_int_equal(dsv4_f32_to_bf16(from_bits(0x3f818000)), 0x3f82);   /* tie, odd rounds up */
    assert_int_equal(dsv4_f32_to_bf16(from_bits(0x3f808001)), 0x3f81);
    assert_int_equal(dsv4_f32_to_bf16(from_bits(0x7f7fffff)), 0x7f80);   /* FLT_MAX overflows */
    assert_int_equal(dsv4_f32_to_bf16(from_bits(0x00000001)), 0x0000);   /* smallest subnormal */
    assert_int_equal(dsv4_f32_to_bf16(from_bits(0x00018000)), 0x0002);   /* subnormal tie to even */
    assert_true(isnan(dsv4_bf16_to_f32(dsv4_f32_to_bf16(NAN))));
    assert_true(isnan(dsv4_bf16_to_f32(dsv4_f32_to_bf16(from_bits(0x7f800001)))));  /* payload in low bits */
    assert_true(dsv4_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(dsv4_bf16_to_f32(0x0001) == ldexpf(1.0f, -133));

    /* oracle: of the two bf16 neighbours (truncation and the next pattern), the nearer; ties to
     * the even pattern */
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)stw_rand(&s) & 0x7fffffff;
        float f = from_bits(u);
        uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1), want;
        double dlo, dhi;

        if (isnan(f) || isinf(f))
            continue;
        dlo = fabs((double)f - (double)from_bits((uint32_t)lo << 16));
        dhi = hi == 0x7f80 ? fabs((double)f - ldexp(1.0, 128)) : fabs((double)f - (double)from_bits((uint32_t)hi << 16));
        want = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1 ? hi : lo);
        if (dsv4_f32_to_bf16(f) != want || dsv4_f32_to_bf16(-f) != (uint16_t)(want | 0x8000))
            fail_msg("bf16(%a) = %#x, expected %#x", (double)f, dsv4_f32_to_bf16(f), want);
    }
}

static void test_f16(void **state)
{
    assert_true(dsv4_f16_to_f32(0x3c00) == 1.0f);
    assert_true(dsv4_f16_to_f32(0xc000) == -2.0f);
    assert_true(dsv4_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(dsv4_f16_to_f32(0x0400) == ldexpf(1.0f, -14));
    assert_true(dsv4_f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    assert_true(dsv4_f16_to_f32(0x03ff) == ldexpf(1023.0f, -24));
    assert_true(dsv4_f16_to_f32(0x7c00) == INFINITY);
    assert_true(dsv4_f16_to_f32(0xfc00) == -INFINITY);
    assert_true(isnan(dsv4_f16_to_f32(0x7e00)));
    assert_true(isnan(dsv4_f16_to_f32(0xfc01)));
    assert_true(dsv4_f16_to_f32(0x8000) == 0.0f && signbit(dsv4_f16_to_f32(0x8000)));
    assert_true(dsv4_f16_to_f32(0x3555) == 0x1.554p-2f);
}

/* e4m3fn by hand: S EEEE MMM, bias 7, subnormal step 2^-9, NaN = S.1111.111, max 448. */
static void test_e4m3_decode(void **state)
{
    assert_true(dsv4_e4m3_to_f32(0x00) == 0.0f && !signbit(dsv4_e4m3_to_f32(0x00)));
    assert_true(dsv4_e4m3_to_f32(0x80) == 0.0f && signbit(dsv4_e4m3_to_f32(0x80)));
    assert_true(dsv4_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(dsv4_e4m3_to_f32(0x07) == 0x7p-9f);
    assert_true(dsv4_e4m3_to_f32(0x87) == -0x7p-9f);
    assert_true(dsv4_e4m3_to_f32(0x08) == 0x1p-6f);
    assert_true(dsv4_e4m3_to_f32(0x0f) == 0x1.ep-6f);
    assert_true(dsv4_e4m3_to_f32(0x38) == 1.0f);
    assert_true(dsv4_e4m3_to_f32(0x40) == 2.0f);
    assert_true(dsv4_e4m3_to_f32(0x77) == 240.0f);
    assert_true(dsv4_e4m3_to_f32(0x78) == 256.0f);
    assert_true(dsv4_e4m3_to_f32(0x7e) == 448.0f);
    assert_true(dsv4_e4m3_to_f32(0xfe) == -448.0f);
    assert_true(isnan(dsv4_e4m3_to_f32(0x7f)));
    assert_true(isnan(dsv4_e4m3_to_f32(0xff)));
}

/* The nearest e4m3 code to a >= 0 by exhaustive search; ties to the even code. */
static uint8_t e4m3_oracle(float a)
{
    uint8_t best = 0;

    if (a >= 448.0f)
        return 0x7e;
    for (int c = 1; c <= 0x7e; c++) {
        double d = fabs((double)a - dsv4_e4m3_to_f32((uint8_t)c));
        double db = fabs((double)a - dsv4_e4m3_to_f32(best));

        if (d < db || (d == db && c % 2 == 0))
            best = (uint8_t)c;
    }
    return best;
}

static void test_e4m3_encode(void **state)
{
    uint64_t s = seed;

    for (int c = 0; c < 256; c++)
        if ((c & 0x7f) != 0x7f)
            assert_int_equal(dsv4_f32_to_e4m3(dsv4_e4m3_to_f32((uint8_t)c)), c);
    assert_int_equal(dsv4_f32_to_e4m3(-0.0f), 0x80);
    assert_int_equal(dsv4_f32_to_e4m3(NAN), 0x7f);
    assert_int_equal(dsv4_f32_to_e4m3(-NAN), 0xff);
    assert_int_equal(dsv4_f32_to_e4m3(464.0f), 0x7e);          /* would round to 480: saturates */
    assert_int_equal(dsv4_f32_to_e4m3(1e9f), 0x7e);
    assert_int_equal(dsv4_f32_to_e4m3(INFINITY), 0x7e);
    assert_int_equal(dsv4_f32_to_e4m3(-INFINITY), 0xfe);
    assert_int_equal(dsv4_f32_to_e4m3(0x1p-10f), 0x00);        /* half the smallest step: to even 0 */
    assert_int_equal(dsv4_f32_to_e4m3(0x1.000002p-10f), 0x01);
    assert_int_equal(dsv4_f32_to_e4m3(0x3p-10f), 0x02);        /* 1.5 steps: to even 2 */
    assert_int_equal(dsv4_f32_to_e4m3(0xfp-10f), 0x08);        /* between 7 steps and 2^-6: even */
    assert_int_equal(dsv4_f32_to_e4m3(1.0625f), 0x38);         /* tie 1.0 / 1.125 */
    assert_int_equal(dsv4_f32_to_e4m3(1.1875f), 0x3a);         /* tie 1.125 / 1.25 */
    assert_int_equal(dsv4_f32_to_e4m3(-3.3f), 0xc5);           /* 3.25 */
    for (int i = 0; i < 100000; i++) {
        /* magnitudes spread over the whole range, subnormals included */
        float a = ldexpf((float)(stw_rand(&s) >> 40) * 0x1p-24f, (int)(stw_rand(&s) % 22) - 12);
        uint8_t want = e4m3_oracle(a);

        if (dsv4_f32_to_e4m3(a) != want || dsv4_f32_to_e4m3(-a) != (want | 0x80))
            fail_msg("e4m3(%a) = %#x, expected %#x", (double)a, dsv4_f32_to_e4m3(a), want);
    }
}

static void test_e8m0(void **state)
{
    assert_true(dsv4_e8m0_to_f32(127) == 1.0f);
    assert_true(dsv4_e8m0_to_f32(120) == 0x1p-7f);
    assert_true(dsv4_e8m0_to_f32(254) == 0x1p127f);
    assert_true(dsv4_e8m0_to_f32(0) == ldexpf(1.0f, -127));    /* a subnormal float, not zero */
    assert_true(dsv4_e8m0_to_f32(0) > 0.0f);
    assert_true(isnan(dsv4_e8m0_to_f32(255)));
}

static void test_e2m1(void **state)
{
    static const float values[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };

    for (int c = 0; c < 8; c++) {
        assert_true(dsv4_e2m1_to_f32((uint8_t)c) == values[c]);
        assert_true(dsv4_e2m1_to_f32((uint8_t)(c | 8)) == -values[c]);
        assert_int_equal(dsv4_f32_to_e2m1(values[c]), c);
        if (c)
            assert_int_equal(dsv4_f32_to_e2m1(-values[c]), c | 8);
    }
    assert_true(signbit(dsv4_e2m1_to_f32(0x8)));
    assert_true(dsv4_e2m1_to_f32(0xf0 | 0x3) == 1.5f);        /* only the low nibble counts */
    assert_int_equal(dsv4_f32_to_e2m1(-0.0f), 0x8);
    assert_int_equal(dsv4_f32_to_e2m1(0.25f), 0x0);            /* ties to the even code */
    assert_int_equal(dsv4_f32_to_e2m1(0.75f), 0x2);
    assert_int_equal(dsv4_f32_to_e2m1(1.25f), 0x2);
    assert_int_equal(dsv4_f32_to_e2m1(1.75f), 0x4);
    assert_int_equal(dsv4_f32_to_e2m1(2.5f), 0x4);
    assert_int_equal(dsv4_f32_to_e2m1(3.5f), 0x6);
    assert_int_equal(dsv4_f32_to_e2m1(5.0f), 0x6);
    assert_int_equal(dsv4_f32_to_e2m1(-5.0f), 0xe);
    assert_int_equal(dsv4_f32_to_e2m1(5.01f), 0x7);
    assert_int_equal(dsv4_f32_to_e2m1(7.0f), 0x7);             /* saturates */
    assert_int_equal(dsv4_f32_to_e2m1(-INFINITY), 0xf);
    assert_int_equal(dsv4_f32_to_e2m1(NAN), 0x0);
}

static void test_ue8m0_scale(void **state)
{
    assert_int_equal(dsv4_ue8m0_scale_for(448.0f, 448.0f), 127);
    assert_int_equal(dsv4_ue8m0_scale_for(449.0f, 448.0f), 128);   /* rounded up, never down */
    assert_int_equal(dsv4_ue8m0_scale_for(224.0f, 448.0f), 126);
    assert_int_equal(dsv4_ue8m0_scale_for(6.0f, 6.0f), 127);
    assert_int_equal(dsv4_ue8m0_scale_for(6.0001f, 6.0f), 128);
    /* amax floored at 1e-4: 1e-4/448 = 2.23e-7 lies in (2^-23, 2^-22] */
    assert_int_equal(dsv4_ue8m0_scale_for(0.0f, 448.0f), 127 - 22);
    assert_int_equal(dsv4_ue8m0_scale_for(1e-30f, 448.0f), 127 - 22);
    assert_int_equal(dsv4_ue8m0_scale_for(NAN, 448.0f), 127 - 22);
    /* 1e-4/6 = 1.67e-5 lies in (2^-16, 2^-15] */
    assert_int_equal(dsv4_ue8m0_scale_for(0.0f, 6.0f), 127 - 15);
    assert_int_equal(dsv4_ue8m0_scale_for(3e38f, 448.0f), 127 + 120);  /* log2(6.7e35) = 119.01 */
    assert_int_equal(dsv4_ue8m0_scale_for(FLT_MAX, 1e-30f), 254);  /* clamped, never 0xff (NaN) */
}

/* Oracle for a block round trip: smallest 2^k >= max(amax, floor)/fmt_max by search (floor 1e-4
 * for FP8, 6 * 2^-126 for FP4, as the official quantizers), then the nearest code by exhaustive search. */
static void roundtrip_oracle(const float *x, float *out, size_t n, size_t block, bool fp8)
{
    float fmt_max = fp8 ? 448.0f : 6.0f;

    for (size_t b = 0; b < n; b += block) {
        size_t len = n - b < block ? n - b : block;
        float amax = fp8 ? 1e-4f : 6.0f * 0x1p-126f, sf;
        int k = -140;

        for (size_t i = 0; i < len; i++)
            amax = fmaxf(amax, fabsf(x[b + i]));
        sf = amax / fmt_max;
        while (ldexpf(1.0f, k) < sf)
            k++;
        for (size_t i = 0; i < len; i++) {
            float v = x[b + i] / ldexpf(1.0f, k), q;

            if (fp8) {
                q = dsv4_e4m3_to_f32(e4m3_oracle(fabsf(v)));
            } else {
                static const float grid[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
                int best = 0;

                for (int c = 1; c < 8; c++) {
                    float d = fabsf(fabsf(v) - grid[c]), db = fabsf(fabsf(v) - grid[best]);

                    if (d < db || (d == db && c % 2 == 0))
                        best = c;
                }
                q = grid[best];
            }
            out[b + i] = copysignf(q, v) * ldexpf(1.0f, k);
        }
    }
}

static void check_roundtrip(bool fp8, size_t n, size_t block, float magnitude, uint64_t *s)
{
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float)), *want = malloc(n * sizeof(float));

    for (size_t i = 0; i < n; i++)
        x[i] = stw_uniform(s) * magnitude * ldexpf(1.0f, -(int)(stw_rand(s) % 8));
    memcpy(y, x, n * sizeof(float));
    if (fp8)
        dsv4_fp8_roundtrip(y, n, block);
    else
        dsv4_fp4_roundtrip(y, n, block);
    roundtrip_oracle(x, want, n, block, fp8);
    for (size_t i = 0; i < n; i++) {
        if (isnan(y[i]) || bits(y[i]) != bits(want[i]))
            fail_msg("%s roundtrip [%zu] of %a: %a, expected %a", fp8 ? "fp8" : "fp4", i, (double)x[i],
                     (double)y[i], (double)want[i]);
    }
    free(x);
    free(y);
    free(want);
}

static void test_roundtrips(void **state)
{
    uint64_t s = seed ^ 0x1234;

    check_roundtrip(true, 300, 128, 3.0f, &s);         /* partial last block */
    check_roundtrip(true, 512, 64, 1e-3f, &s);         /* cache blocks of 64 */
    check_roundtrip(true, 128, 128, 1e-7f, &s);        /* below the amax floor */
    check_roundtrip(true, 256, 128, 1e36f, &s);        /* huge scales */
    check_roundtrip(false, 320, 32, 5.0f, &s);
    check_roundtrip(false, 100, 32, 1e-6f, &s);         /* below FP8's floor, above FP4's */
    check_roundtrip(false, 64, 32, 1e-39f, &s);         /* subnormal values: below FP4's floor */
    check_roundtrip(false, 96, 32, 1e30f, &s);
}

static void test_hadamard(void **state)
{
    uint64_t s = seed ^ 0x5678;
    size_t sizes[] = { 1, 2, 64, 128 };

    for (size_t t = 0; t < sizeof(sizes) / sizeof(sizes[0]); t++) {
        size_t n = sizes[t];
        float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
        double maxv = 0.0, maxerr = 0.0;

        for (size_t i = 0; i < n; i++)
            x[i] = y[i] = stw_uniform(&s);
        dsv4_hadamard(y, n);
        /* Sylvester's matrix: H[i][j] = (-1)^popcount(i & j), scaled by 1/sqrt(n) */
        for (size_t i = 0; i < n; i++) {
            double ref = 0.0;

            for (size_t j = 0; j < n; j++)
                ref += (__builtin_popcountll(i & j) % 2 ? -1.0 : 1.0) * x[j];
            ref /= sqrt((double)n);
            maxv = fmax(maxv, fabs(ref));
            maxerr = fmax(maxerr, fabs(ref - y[i]));
        }
        assert_true(maxv > 0.0);
        assert_true(maxerr <= 1e-6 * maxv);
        /* orthonormal and symmetric: applying it twice gives x back */
        dsv4_hadamard(y, n);
        for (size_t i = 0; i < n; i++)
            assert_true(fabs(y[i] - x[i]) <= 1e-6 * maxv);
        free(x);
        free(y);
    }
}

static int setup(void **state)
{
    seed = dsv4_test_seed();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_e4m3_decode),
        cmocka_unit_test(test_e4m3_encode),
        cmocka_unit_test(test_e8m0),
        cmocka_unit_test(test_e2m1),
        cmocka_unit_test(test_ue8m0_scale),
        cmocka_unit_test(test_roundtrips),
        cmocka_unit_test(test_hadamard),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
