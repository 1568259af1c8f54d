/* SPDX-License-Identifier: MIT */
/* Shared pieces of the CPU backend's unit tests: random f32 matrices and a context whose scratch
 * the test allocates itself. Header-only; every test program includes it once. */
#ifndef DSV4_TESTS_CPU_TEST_UTIL_H
#define DSV4_TESTS_CPU_TEST_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"

#define TEST_MAX_ALLOCS 256

static void *test_allocs[TEST_MAX_ALLOCS];
static int test_n_allocs;

/* Zeroed memory released by test_free_all(). */
static inline void *test_alloc(size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    assert_non_null(p);
    assert_true(test_n_allocs < TEST_MAX_ALLOCS);
    test_allocs[test_n_allocs++] = p;
    return p;
}

static inline void test_free_all(void)
{
    while (test_n_allocs)
        free(test_allocs[--test_n_allocs]);
}

static inline double test_frand(void)
{
    return rand() / (double)RAND_MAX * 2.0 - 1.0;
}

static inline float *test_randv(int64_t n, double scale, double offset)
{
    float *v = test_alloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)(offset + scale * test_frand());
    return v;
}

/* A contiguous f32 [out, in] matrix with entries uniform in +-scale. */
static inline struct dsv4_linear test_linear(int64_t out, int64_t in, double scale)
{
    return (struct dsv4_linear){.fmt = DSV4_W_F32, .out = out, .in = in, .row_stride = in,
                                .w = test_randv(out * in, scale, 0.0), .name = "test"};
}

/* y = W x in double, the oracle's matrix product. */
static inline void test_matvec(const struct dsv4_linear *W, const float *x, double *y)
{
    const float *w = W->w;
    for (int64_t r = 0; r < W->out; r++) {
        double s = 0.0;
        for (int64_t i = 0; i < W->in; i++)
            s += (double)w[r * W->row_stride + i] * x[i];
        y[r] = s;
    }
}

/* Scratch big enough for the unit tests' shapes (every buffer `n` floats). */
static inline struct dsv4_cpu_work *test_work(int64_t n)
{
    struct dsv4_cpu_work *wk = test_alloc(sizeof(*wk));
    float **fields[] = {&wk->X, &wk->X2, &wk->flat, &wk->mix, &wk->pre, &wk->post, &wk->comb, &wk->y,
                        &wk->xn, &wk->sub, &wk->qr, &wk->q, &wk->kv, &wk->o, &wk->z, &wk->scores,
                        &wk->entry, &wk->iq, &wk->iw, &wk->iscore, &wk->router, &wk->rsel, &wk->h1,
                        &wk->h3, &wk->eout, &wk->act, &wk->row};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
        *fields[i] = test_alloc((size_t)n * sizeof(float));
    wk->isel = test_alloc((size_t)n * sizeof(int));
    wk->iheap = test_alloc((size_t)n * sizeof(int));
    wk->keys = test_alloc((size_t)n * sizeof(*wk->keys));
    wk->max_keys = (int)n;
    return wk;
}

/* Largest |got - want| relative to the largest |want|. */
static inline double test_rel_err(const float *got, const double *want, int64_t n)
{
    double diff = 0.0, mag = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(got[i] - want[i]);
        diff = d > diff || d != d ? d : diff;
        mag = fmax(mag, fabs(want[i]));
    }
    return mag > 0.0 ? diff / mag : INFINITY;
}

#define assert_close(got, want, n, tol)                                                              \
    do {                                                                                             \
        double e_ = test_rel_err((got), (want), (n));                                                \
        if (!(e_ <= (tol)))                                                                          \
            fail_msg("%s: relative error %.3g > %.3g", #got, e_, (double)(tol));                     \
    } while (0)

#endif
