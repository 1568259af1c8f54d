/* SPDX-License-Identifier: MIT */
/* GPU: the official numerics' cache codecs against the CPU reference's quantizers (engine/model/quant.c),
 * bit for bit: the KV entry (nope values e4m3 in 1x64 UE8M0 blocks, RoPE values bf16) and the
 * indexer's Hadamard rotation + FP4 (1x32 UE8M0), at V4 shapes (512/64, 128) and the tiny fixtures'
 * (32/8, 16). */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "engine/model/quant.h"
#include "tests/gpu/gpu_test.h"

#define ROWS 257

/* Count differing values; print the first few (row, index, input, reference, gpu). */
static size_t compare(const float *x, const float *out, const float *ref, size_t n, int width)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&out[i], &ref[i], sizeof(float)) != 0 && bad++ < 4)
            printf("#   row %zu [%zu]: x %.9g cpu %.9g gpu %.9g\n", i / width, i % width, x[i], ref[i], out[i]);
    return bad;
}

static void check_kv(int hd, int rd, int fmt)
{
    const size_t n = (size_t)ROWS * hd;
    float *x = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float)), *out, *dx, *dy;
    gt_fill_normal(x, n, 1.0f);
    for (int r = 0; r < ROWS; r += 5)       /* some rows tiny (below the amax floor), some with outliers */
        for (int d = 0; d < hd; d++)
            x[(size_t)r * hd + d] *= r % 10 == 0 ? 1e-6f : 50.0f;
    memcpy(ref, x, n * sizeof(float));
    for (int r = 0; r < ROWS; r++) {
        float *row = ref + (size_t)r * hd;
        if (fmt == 0)
            continue;
        dsv4_fp8_roundtrip(row, (size_t)(hd - rd), 64);
        for (int d = hd - rd; d < hd; d++)
                row[d] = dsv4_bf16_to_f32(dsv4_f32_to_bf16(row[d]));
    }
    dx = gt_dev_copy(x, n * sizeof(float));
    dy = gt_dev_poisoned(n);
    DSV4_OK(dsv4_cuda_kv_entry_roundtrip(dx, ROWS, hd, rd, fmt, dy, NULL));
    out = gt_host_from(dy, n);
    size_t bad = compare(x, out, ref, n, hd);
    printf("# kv entry format %d, head %d rope %d: %zu of %zu values differ from the CPU quantizers\n", fmt, hd, rd,
           bad, n);
    assert_int_equal(bad, 0);
    cudaFree(dx);
    cudaFree(dy);
    free(x);
    free(ref);
    free(out);
}

static void test_kv_entry(void **state)
{
    for (int fmt = 0; fmt < 2; fmt++) {
        check_kv(512, 64, fmt);
        check_kv(32, 8, fmt);
    }
}

static void check_hadamard(int n)
{
    const size_t N = (size_t)ROWS * n;
    float *x = malloc(N * sizeof(float)), *ref = malloc(N * sizeof(float)), *out, *dx, *dy;
    gt_fill_normal(x, N, 2.0f);
    memcpy(ref, x, N * sizeof(float));
    for (int r = 0; r < ROWS; r++) {
        dsv4_hadamard(ref + (size_t)r * n, (size_t)n);
        dsv4_fp4_roundtrip(ref + (size_t)r * n, (size_t)n, 32);
    }
    dx = gt_dev_copy(x, N * sizeof(float));
    dy = gt_dev_poisoned(N);
    DSV4_OK(dsv4_cuda_hadamard_fp4(dx, ROWS, n, dy, NULL));
    out = gt_host_from(dy, N);
    size_t bad = compare(x, out, ref, N, n);
    printf("# hadamard + fp4, n %d: %zu of %zu values differ from the CPU\n", n, bad, N);
    assert_int_equal(bad, 0);
    cudaFree(dx);
    cudaFree(dy);
    free(x);
    free(ref);
    free(out);
}

static void test_hadamard_fp4(void **state)
{
    check_hadamard(128);
    check_hadamard(16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_entry),
        cmocka_unit_test(test_hadamard_fp4),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
