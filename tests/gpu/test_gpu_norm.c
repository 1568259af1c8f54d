/* GPU: RMSNorm and mHC pre (norm, gates, Sinkhorn, collapse) and post against their CPU twins at
 * V4-Flash shapes (D 4096, hc 4, 20 Sinkhorn iterations) and tiny ones. All fp32: bound 1e-5. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"

#define FP32_BOUND 1e-5

static void check_rmsnorm(int rows, int n, bool weighted)
{
    const size_t N = (size_t)rows * n;
    float *x = malloc(N * sizeof(float)), *w = malloc((size_t)n * sizeof(float)), *ref = malloc(N * sizeof(float));
    float *dx, *dw, *dy, *out;
    char what[80];

    gt_fill_normal(x, N, 3.0f);
    gt_fill_normal(w, (size_t)n, 1.0f);
    for (int r = 0; r < rows; r++)
        dsv4_twin_rmsnorm(x + (size_t)r * n, weighted ? w : NULL, n, 1e-6f, ref + (size_t)r * n);
    dx = gt_dev_copy(x, N * sizeof(float));
    dw = gt_dev_copy(w, (size_t)n * sizeof(float));
    dy = gt_dev_poisoned(N);
    DSV4_OK(dsv4_cuda_rmsnorm(dx, weighted ? dw : NULL, rows, n, 1e-6f, dy, NULL));
    out = gt_host_from(dy, N);
    snprintf(what, sizeof(what), "rmsnorm%s [%d,%d]", weighted ? "" : " unweighted", rows, n);
    ASSERT_REL(what, out, ref, N, FP32_BOUND);
    cudaFree(dx); cudaFree(dw); cudaFree(dy);
    free(x); free(w); free(ref); free(out);
}

static void test_rmsnorm(void **state)
{
    check_rmsnorm(1, 4096, true);
    check_rmsnorm(64, 4096, true);
    check_rmsnorm(64, 1024, true);      /* q_norm */
    check_rmsnorm(64 * 64, 512, false); /* per-head q norm */
    check_rmsnorm(7, 100, true);
}

static void check_mhc(int batch, int hc, int dim, int iters)
{
    const int mix = (2 + hc) * hc;
    const size_t NX = (size_t)batch * hc * dim;
    float *X = malloc(NX * sizeof(float)), *m = malloc((size_t)batch * mix * sizeof(float));
    float *base = malloc((size_t)mix * sizeof(float)), scale[3];
    float *f = malloc((size_t)batch * dim * sizeof(float));
    float *ry = malloc((size_t)batch * dim * sizeof(float)), *rpost = malloc((size_t)batch * hc * sizeof(float));
    float *rcomb = malloc((size_t)batch * hc * hc * sizeof(float)), *rXo = malloc(NX * sizeof(float));
    float *dX, *dm, *dbase, *dscale, *dy, *dpost, *dcomb, *df, *dXo, *out;
    char what[96];

    gt_fill_normal(X, NX, 1.0f);
    gt_fill_normal(m, (size_t)batch * mix, 4.0f);
    gt_fill_normal(base, (size_t)mix, 1.0f);
    gt_fill_normal(scale, 3, 0.5f);
    gt_fill_normal(f, (size_t)batch * dim, 1.0f);
    for (int b = 0; b < batch; b++) {
        dsv4_twin_mhc_pre(X + (size_t)b * hc * dim, m + (size_t)b * mix, base, scale, hc, dim, iters, 1e-6f, 1e-6f,
                          ry + (size_t)b * dim, rpost + b * hc, rcomb + (size_t)b * hc * hc);
        dsv4_twin_mhc_post(X + (size_t)b * hc * dim, f + (size_t)b * dim, rpost + b * hc, rcomb + (size_t)b * hc * hc,
                           hc, dim, rXo + (size_t)b * hc * dim);
    }
    dX = gt_dev_copy(X, NX * sizeof(float));
    dm = gt_dev_copy(m, (size_t)batch * mix * sizeof(float));
    dbase = gt_dev_copy(base, (size_t)mix * sizeof(float));
    dscale = gt_dev_copy(scale, sizeof(scale));
    df = gt_dev_copy(f, (size_t)batch * dim * sizeof(float));
    dy = gt_dev_poisoned((size_t)batch * dim);
    dpost = gt_dev_poisoned((size_t)batch * hc);
    dcomb = gt_dev_poisoned((size_t)batch * hc * hc);
    dXo = gt_dev_poisoned(NX);
    DSV4_OK(dsv4_cuda_mhc_pre(dX, dm, dbase, dscale, batch, hc, dim, iters, 1e-6f, 1e-6f, dy, dpost, dcomb, NULL));
    /* post runs on the twin's post/comb so that its check is independent of pre's */
    CUDA_OK(cudaDeviceSynchronize());
    out = gt_host_from(dy, (size_t)batch * dim);
    snprintf(what, sizeof(what), "mhc_pre y hc=%d [%d,%d] iters %d", hc, batch, dim, iters);
    ASSERT_REL(what, out, ry, (size_t)batch * dim, FP32_BOUND);
    free(out);
    out = gt_host_from(dpost, (size_t)batch * hc);
    ASSERT_REL("mhc_pre post", out, rpost, (size_t)batch * hc, FP32_BOUND);
    free(out);
    out = gt_host_from(dcomb, (size_t)batch * hc * hc);
    ASSERT_REL("mhc_pre comb (Sinkhorn)", out, rcomb, (size_t)batch * hc * hc, FP32_BOUND);
    free(out);
    CUDA_OK(cudaMemcpy(dpost, rpost, (size_t)batch * hc * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dcomb, rcomb, (size_t)batch * hc * hc * sizeof(float), cudaMemcpyHostToDevice));
    DSV4_OK(dsv4_cuda_mhc_post(dX, df, dpost, dcomb, batch, hc, dim, dXo, NULL));
    out = gt_host_from(dXo, NX);
    snprintf(what, sizeof(what), "mhc_post hc=%d [%d,%d]", hc, batch, dim);
    ASSERT_REL(what, out, rXo, NX, FP32_BOUND);
    free(out);
    cudaFree(dX); cudaFree(dm); cudaFree(dbase); cudaFree(dscale); cudaFree(df); cudaFree(dy);
    cudaFree(dpost); cudaFree(dcomb); cudaFree(dXo);
    free(X); free(m); free(base); free(f); free(ry); free(rpost); free(rcomb); free(rXo);
}

static void test_mhc(void **state)
{
    check_mhc(1, 4, 4096, 20);
    check_mhc(64, 4, 4096, 20);
    check_mhc(3, 2, 64, 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_mhc),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
