/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_twin_cuda: the CUDA kernels' CPU twins against the engine's own number formats and
 * GEMV (engine/model/quant.c, engine/model/linear.c), which were written independently: every e4m3,
 * e2m1 and bf16 code, the activation quantizer on fresh random data with small and outlier blocks,
 * and the dequantizing matvec in every format. Bit-exact where the arithmetic is the same; the
 * matvec sums in a different order (index order here, per scale block in linear.c): 1e-5 relative. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cmocka.h>

#include "engine/cpu/cpu_twin_cuda.h"
#include "engine/model/quant.h"
#include "engine/model/weights.h"
#include "tests/unit/seed_util.h"

static uint64_t rng;

static uint64_t next_u64(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
}

static float normal(void)
{
    float u = ((float)(next_u64() >> 40) + 1.0f) / 16777217.0f, v = (float)(next_u64() >> 40) / 16777216.0f;
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

static int same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof(a)) == 0 || (isnan(a) && isnan(b));
}

static void test_codes(void **state)
{
    for (int c = 0; c < 256; c++) {
        float a = dsv4_twin_e4m3_to_f32((uint8_t)c), b = dsv4_e4m3_to_f32((uint8_t)c);
        assert_true(same_bits(a, b));
        if (!isnan(a))      /* every finite code converts back to itself (-0 included) */
            assert_int_equal(dsv4_twin_f32_to_e4m3(a), c);
    }
    for (int c = 0; c < 16; c++) {
        assert_true(same_bits(dsv4_twin_e2m1_to_f32((uint8_t)c), dsv4_e2m1_to_f32((uint8_t)c)));
        assert_int_equal(dsv4_twin_f32_to_e2m1(dsv4_twin_e2m1_to_f32((uint8_t)c)), c);
    }
    for (int i = 0; i < 100000; i++) {
        float f = normal() * ldexpf(1.0f, (int)(next_u64() % 40) - 20);
        assert_int_equal(dsv4_twin_f32_to_e4m3(f), dsv4_f32_to_e4m3(f));
        assert_int_equal(dsv4_twin_f32_to_e2m1(f), dsv4_f32_to_e2m1(f));
        assert_int_equal(dsv4_twin_f32_to_bf16(f), dsv4_f32_to_bf16(f));
        assert_int_equal(dsv4_twin_ue8m0_for(fabsf(f), 448.0f), dsv4_ue8m0_scale_for(fabsf(f), 448.0f));
    }
}

static void test_fp8_roundtrip(void **state)
{
    const size_t n = 64 * 4096;
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    assert_non_null(a);
    assert_non_null(b);
    for (size_t i = 0; i < n; i++)
        a[i] = normal();
    for (size_t blk = 0; blk < n; blk += 128) {     /* some blocks under the 1e-4 floor, some with outliers */
        uint64_t r = next_u64() % 8;
        for (size_t i = 0; i < 128; i++)
            a[blk + i] *= r == 0 ? 1e-7f : r == 1 ? 300.0f : 1.0f;
    }
    memcpy(b, a, n * sizeof(float));
    dsv4_twin_fp8_roundtrip(a, n, 128);
    dsv4_fp8_roundtrip(b, n, 128);
    for (size_t i = 0; i < n; i++)
        assert_true(same_bits(a[i], b[i]));
    free(a);
    free(b);
}

static void check_matvec(enum dsv4_wfmt fmt, int64_t out, int64_t in)
{
    size_t wbytes = fmt == DSV4_W_F32 ? (size_t)(out * in) * 4 : fmt == DSV4_W_BF16 ? (size_t)(out * in) * 2 :
                    fmt == DSV4_W_FP8 ? (size_t)(out * in) : (size_t)(out * in) / 2;
    int64_t ss = fmt == DSV4_W_FP8 ? (in + 127) / 128 : in / 32;
    size_t sbytes = fmt == DSV4_W_FP8 ? (size_t)((out + 127) / 128 * ss) : (size_t)(out * ss);
    uint8_t *w = malloc(wbytes), *s = malloc(sbytes);
    float *x = malloc((size_t)in * sizeof(float)), *y1 = malloc((size_t)out * sizeof(float));
    float *y2 = malloc((size_t)out * sizeof(float));
    double num = 0.0, den = 0.0;

    for (size_t i = 0; i < wbytes; i++)
        w[i] = (uint8_t)next_u64();
    if (fmt == DSV4_W_FP8)
        for (size_t i = 0; i < wbytes; i++)
            w[i] = (w[i] & 0x7f) == 0x7f ? (uint8_t)(w[i] - 1) : w[i];     /* no NaN codes */
    if (fmt == DSV4_W_F32)
        for (size_t i = 0; i < wbytes / 4; i++) {
            float f = normal() * 0.02f;
            memcpy(w + 4 * i, &f, 4);
        }
    if (fmt == DSV4_W_BF16)
        for (size_t i = 0; i < wbytes / 2; i++) {
            uint16_t h = dsv4_f32_to_bf16(normal() * 0.02f);
            memcpy(w + 2 * i, &h, 2);
        }
    for (size_t i = 0; i < sbytes; i++)
        s[i] = (uint8_t)(120 + next_u64() % 4);
    for (int64_t i = 0; i < in; i++)
        x[i] = normal();
    struct dsv4_linear W = { .fmt = fmt, .out = out, .in = in, .row_stride = in, .w = w,
                             .scale = (fmt == DSV4_W_FP8 || fmt == DSV4_W_FP4) ? s : NULL, .scale_stride = ss,
                             .name = "test" };
    dsv4_twin_linear_matvec(&W, x, y1);
    dsv4_linear_matvec(&W, x, y2);
    for (int64_t r = 0; r < out; r++) {
        assert_true(isfinite(y1[r]));
        num += ((double)y1[r] - y2[r]) * ((double)y1[r] - y2[r]);
        den += (double)y2[r] * y2[r];
    }
    print_message("# twin matvec format %d [%lld,%lld]: rel err %.3g\n", (int)fmt, (long long)out, (long long)in,
                  sqrt(num / den));
    assert_true(sqrt(num / den) <= 1e-5);
    free(w);
    free(s);
    free(x);
    free(y1);
    free(y2);
}

static void test_matvec(void **state)
{
    check_matvec(DSV4_W_F32, 24, 512);
    check_matvec(DSV4_W_BF16, 130, 256);
    check_matvec(DSV4_W_FP8, 130, 384);
    check_matvec(DSV4_W_FP4, 64, 256);
}

int main(void)
{
    rng = dsv4_test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codes),
        cmocka_unit_test(test_fp8_roundtrip),
        cmocka_unit_test(test_matvec),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
