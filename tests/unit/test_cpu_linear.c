/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_ops: linears over row ranges (the grouped wo_a) in every stored format, and the fp8
 * numerics' activation quantization (1x128 e4m3 before FP8/FP4 matrices, none for f32/bf16 or when
 * the caller asks for the raw activation). The oracle dequantizes each row with dsv4_linear_row and
 * takes the dot product in double. With worker threads (engine/cpu/cpu_pool) the rows are bitwise the
 * same as with one. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine/model/quant.h"
#include "cpu_test_util.h"

#define OUT 384
#define IN 512

static struct dsv4_cpu_pool *pool;

static int setup(void **state)
{
    return dsv4_cpu_pool_create(3, IN, &pool);
}

static int teardown(void **state)
{
    dsv4_cpu_pool_free(pool);
    return 0;
}

static struct dsv4_linear fp8_matrix(void)
{
    int64_t sr = (OUT + 127) / 128, sc = (IN + 127) / 128;
    uint8_t *w = test_alloc(OUT * IN), *s = test_alloc((size_t)(sr * sc));
    for (int i = 0; i < OUT * IN; i++)
        w[i] = dsv4_f32_to_e4m3((float)(test_frand() * 300.0));
    for (int i = 0; i < sr * sc; i++)
        s[i] = (uint8_t)(127 - 9 + rand() % 4);
    return (struct dsv4_linear){.fmt = DSV4_W_FP8, .out = OUT, .in = IN, .row_stride = IN, .w = w,
                                .scale = s, .scale_stride = sc, .name = "fp8"};
}

static struct dsv4_linear fp4_matrix(void)
{
    uint8_t *w = test_alloc(OUT * IN / 2), *s = test_alloc(OUT * IN / 32);
    for (int i = 0; i < OUT * IN / 2; i++)
        w[i] = (uint8_t)(rand() & 0xff);
    for (int i = 0; i < OUT * IN / 32; i++)
        s[i] = (uint8_t)(127 - 4 + rand() % 4);
    return (struct dsv4_linear){.fmt = DSV4_W_FP4, .out = OUT, .in = IN, .row_stride = IN, .w = w,
                                .scale = s, .scale_stride = IN / 32, .name = "fp4"};
}

static struct dsv4_linear bf16_matrix(void)
{
    /* a view with row_stride > in, like a stacked expert tensor */
    uint16_t *w = test_alloc(sizeof(uint16_t) * OUT * (IN + 8));
    for (int i = 0; i < OUT * (IN + 8); i++)
        w[i] = dsv4_f32_to_bf16((float)test_frand());
    return (struct dsv4_linear){.fmt = DSV4_W_BF16, .out = OUT, .in = IN, .row_stride = IN + 8, .w = w,
                                .name = "bf16"};
}

static void check_rows(const struct dsv4_linear *W, enum dsv4_numerics num, bool raw_act)
{
    struct dsv4_cpu_ctx c = {.num = num, .wk = test_work(IN)};
    bool quantize = num == DSV4_NUMERICS_FP8 && !raw_act && (W->fmt == DSV4_W_FP8 || W->fmt == DSV4_W_FP4);
    float *x = test_randv(IN, 3.0, 0.0), *xq = test_alloc(sizeof(float) * IN), *row = test_alloc(sizeof(float) * IN);
    float *x0 = test_alloc(sizeof(float) * IN);
    memcpy(xq, x, sizeof(float) * IN);
    memcpy(x0, x, sizeof(float) * IN);
    if (quantize) {
        dsv4_fp8_roundtrip(xq, IN, 128);
        assert_memory_not_equal(xq, x, sizeof(float) * IN);
    }
    /* whole matrix, block-aligned groups, and unaligned ranges */
    const int64_t ranges[][2] = {{0, OUT}, {128, 128}, {256, 128}, {16, 40}, {200, 100}, {8, 300}};
    for (size_t t = 0; t < sizeof(ranges) / sizeof(ranges[0]); t++) {
        int64_t r0 = ranges[t][0], n = ranges[t][1];
        float y[OUT];
        double want[OUT];
        dsv4_cpu_linear_rows(&c, W, r0, n, x, y, raw_act);
        for (int64_t r = 0; r < n; r++) {
            dsv4_linear_row(W, r0 + r, row);
            want[r] = 0.0;
            for (int k = 0; k < IN; k++)
                want[r] += (double)row[k] * xq[k];
        }
        assert_close(y, want, n, 1e-5);
        /* Split among threads (big ranges only), every row bitwise the same. */
        float yt[OUT];
        struct dsv4_cpu_ctx ct = c;
        ct.pool = pool;
        dsv4_cpu_linear_rows(&ct, W, r0, n, x, yt, raw_act);
        assert_memory_equal(y, yt, sizeof(float) * (size_t)n);
    }
    /* The caller's activation is never modified. */
    assert_memory_equal(x, x0, sizeof(float) * IN);
    test_free_all();
}

static void test_fp8_exact(void **state)
{
    srand(51);
    struct dsv4_linear W = fp8_matrix();
    check_rows(&W, DSV4_NUMERICS_EXACT, false);
}

static void test_fp8_quantized_activation(void **state)
{
    srand(52);
    struct dsv4_linear W = fp8_matrix();
    check_rows(&W, DSV4_NUMERICS_FP8, false);
}

static void test_fp8_raw_activation(void **state)
{
    srand(53);
    struct dsv4_linear W = fp8_matrix();
    check_rows(&W, DSV4_NUMERICS_FP8, true);
}

static void test_fp4_quantized_activation(void **state)
{
    srand(54);
    struct dsv4_linear W = fp4_matrix();
    check_rows(&W, DSV4_NUMERICS_FP8, false);
}

static void test_bf16_strided(void **state)
{
    srand(55);
    struct dsv4_linear W = bf16_matrix();
    check_rows(&W, DSV4_NUMERICS_FP8, false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp8_exact),
        cmocka_unit_test(test_fp8_quantized_activation),
        cmocka_unit_test(test_fp8_raw_activation),
        cmocka_unit_test(test_fp4_quantized_activation),
        cmocka_unit_test(test_bf16_strided),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
