/* SPDX-License-Identifier: MIT */
/* Shared by the GPU tests: skip without a GPU, random inputs that look like real ones, checked CUDA
 * calls, device buffers poisoned with NaN, and the relative error ||out - ref|| / ||ref||. Each test
 * program includes this once. */
#ifndef DSV4_TESTS_GPU_TEST_H
#define DSV4_TESTS_GPU_TEST_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "engine/cpu/cpu_twin_cuda.h"
#include "engine/error.h"
#include "kernels/dsv4cuda.h"

#define GPU_SKIP 77

#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                                 \
    } while (0)

#define DSV4_OK(call)                                                                          \
    do {                                                                                       \
        int rc_ = (call);                                                                      \
        if (rc_ != 0)                                                                          \
            fail_msg("%s = %d: %s", #call, rc_, dsv4_error_message());                         \
    } while (0)

/* xorshift64*: fresh inputs per run (seeded from the clock, printed for reproduction). */
static uint64_t gt_state;

static inline void gt_seed(void)
{
    const char *s = getenv("DSV4_TEST_SEED");
    gt_state = s ? strtoull(s, NULL, 0) : (uint64_t)time(NULL) * 2654435761u + 1;
    printf("# seed %llu (DSV4_TEST_SEED to repeat)\n", (unsigned long long)gt_state);
}

static inline uint64_t gt_u64(void)
{
    gt_state ^= gt_state >> 12;
    gt_state ^= gt_state << 25;
    gt_state ^= gt_state >> 27;
    return gt_state * 2685821657736338717ull;
}

static inline float gt_uniform(void)       /* [0, 1) */
{
    return (float)(gt_u64() >> 40) / 16777216.0f;
}

static inline float gt_normal(void)
{
    float u = gt_uniform() + 1e-7f, v = gt_uniform();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

static inline void gt_fill_normal(float *x, size_t n, float sigma)
{
    for (size_t i = 0; i < n; i++)
        x[i] = sigma * gt_normal();
}

/* Weight bytes as a real checkpoint has them, cheap enough for 10^9 values: FP8 codes uniform over
 * every finite e4m3 value (NaN codes 0x7f/0xff moved to 0x7e/0xfe), FP4 bytes uniform, BF16 with
 * random sign and mantissa over eight octaves 2^-9..2^-2; UE8M0 scales near 2^center. */
static inline void gt_fill_fp8(uint8_t *w, size_t n)
{
    for (size_t i = 0; i < n; i += 8) {
        uint64_t r = gt_u64();
        for (size_t j = 0; j < 8 && i + j < n; j++) {
            uint8_t v = (uint8_t)(r >> (8 * j));
            w[i + j] = (v & 0x7f) == 0x7f ? (uint8_t)(v - 1) : v;
        }
    }
}

static inline void gt_fill_fp4(uint8_t *w, size_t nbytes)
{
    for (size_t i = 0; i < nbytes; i += 8) {
        uint64_t r = gt_u64();
        for (size_t j = 0; j < 8 && i + j < nbytes; j++)
            w[i + j] = (uint8_t)(r >> (8 * j));
    }
}

static inline void gt_fill_bf16(uint16_t *w, size_t n)
{
    for (size_t i = 0; i < n; i += 4) {
        uint64_t r = gt_u64();
        for (size_t j = 0; j < 4 && i + j < n; j++) {
            uint32_t v = (uint32_t)(r >> (16 * j)) & 0xffff;
            w[i + j] = (uint16_t)((v & 0x8000) | ((118 + (v & 7)) << 7) | ((v >> 3) & 0x7f));
        }
    }
}

static inline void gt_fill_scales(uint8_t *s, size_t n, int center)
{
    for (size_t i = 0; i < n; i++)
        s[i] = (uint8_t)(127 + center + (int)(gt_u64() % 3) - 1);
}

static inline void *gt_dev_copy(const void *host, size_t bytes)
{
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, bytes ? bytes : 1));
    if (bytes)
        CUDA_OK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
}

/* A device buffer filled with NaN (0xff bytes), so an element nobody wrote fails the comparison. */
static inline float *gt_dev_poisoned(size_t n)
{
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, n * sizeof(float) + 1));
    CUDA_OK(cudaMemset(d, 0xff, n * sizeof(float)));
    return d;
}

static inline float *gt_host_from(const float *d, size_t n)
{
    float *h = malloc(n * sizeof(float) + 1);
    assert_non_null(h);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

/* A linear's result left pending (struct dsv4_cuda_pending) as `splits` random partials [splits, rows,
 * out] on the device, counted by *ws (a workspace with no buffers: only its part_seq is read), and
 * *d_sum [rows, out] its sum as the reduction launch writes it: what a reader of the pending result
 * must see. Free p.part and *d_sum. */
static inline struct dsv4_cuda_pending gt_pending(struct dsv4_cuda_gemm_ws *ws, int splits, int rows, int64_t out,
                                                  float sigma, float **d_sum)
{
    const size_t n = (size_t)splits * (size_t)rows * (size_t)out;
    float *h = malloc(n * sizeof(float));
    struct dsv4_cuda_pending p;

    assert_non_null(h);
    gt_fill_normal(h, n, sigma);
    memset(ws, 0, sizeof(*ws));
    ws->part_seq = 1;
    p = (struct dsv4_cuda_pending){ .part = gt_dev_copy(h, n * sizeof(float)), .plane = (int64_t)rows * out,
                                    .out = out, .rows = rows, .splits = splits, .ws = ws, .seq = 1 };
    free(h);
    *d_sum = gt_dev_poisoned((size_t)rows * (size_t)out);
    DSV4_OK(dsv4_cuda_pending_flush(&p, *d_sum, out, NULL));
    return p;
}

/* Finite and bit-identical device buffers of n floats (a and b), else fail naming `what`. */
static inline void gt_assert_same(const char *what, const float *d_a, const float *d_b, size_t n)
{
    float *a = gt_host_from(d_a, n), *b = gt_host_from(d_b, n);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(b[i]))
            fail_msg("%s: element %zu of the reference is %g", what, i, (double)b[i]);
    if (memcmp(a, b, n * sizeof(float)) != 0) {
        size_t i = 0;
        while (i < n && !memcmp(a + i, b + i, sizeof(float)))
            i++;
        fail_msg("%s: element %zu of %zu differs (%.9g against %.9g)", what, i, n, (double)a[i], (double)b[i]);
    }
    printf("# %-48s bit-identical (%zu values)\n", what, n);
    free(a);
    free(b);
}

/* ||out - ref|| / ||ref||; NaN or Inf anywhere in out gives INFINITY. */
static inline double gt_rel_err(const float *out, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(out[i]))
            return INFINITY;
        num += ((double)out[i] - ref[i]) * ((double)out[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

#define ASSERT_REL(what, out, ref, n, bound)                                                   \
    do {                                                                                       \
        double e_ = gt_rel_err(out, ref, n);                                                   \
        printf("# %-48s rel err %.3g (bound %.0e)\n", what, e_, (double)(bound));              \
        if (!(e_ <= (bound)))                                                                  \
            fail_msg("%s: relative error %g over bound %g", what, e_, (double)(bound));        \
    } while (0)

/* main() of every GPU test: skip (77) without a usable GPU. */
static inline int gt_main(const struct CMUnitTest *tests, size_t n)
{
    if (dsv4_cuda_device_count() == 0) {
        printf("# SKIP: %s\n", dsv4_error_message());
        return GPU_SKIP;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);   /* a test killed by a timeout still leaves its lines */
    gt_seed();
    if (getenv("DSV4_TEST_FILTER"))     /* run one test, e.g. under compute-sanitizer */
        cmocka_set_test_filter(getenv("DSV4_TEST_FILTER"));
    return _cmocka_run_group_tests("gpu", tests, n, NULL, NULL);
}

#endif
