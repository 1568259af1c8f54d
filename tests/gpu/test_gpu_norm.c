/* SPDX-License-Identifier: MIT */
/* GPU: RMSNorm, the split-K mHC fn GEMV, mHC pre (norm, gates, Sinkhorn, collapse) and post against
 * their CPU twins at V4-Flash shapes (D 4096, hc 4, 20 Sinkhorn iterations) and tiny ones. All fp32:
 * bound 1e-5. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "engine/cpu/cpu_ops.h"
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

/* RMSNorm + RoPE in one launch against the twin RMSNorm followed by the CPU backend's RoPE: rows
 * are `heads` heads of each token, positions random up to 2^17, frequencies like YaRN's spread. */
static void check_rmsnorm_rope(int tokens, int heads, int n, int rd, bool weighted)
{
    const int rows = tokens * heads;
    const size_t N = (size_t)rows * n;
    float *x = malloc(N * sizeof(float)), *w = malloc((size_t)n * sizeof(float)), *ref = malloc(N * sizeof(float));
    int32_t *pos = malloc((size_t)tokens * sizeof(int32_t));
    struct dsv4_cpu_rope rope = { .dim = rd };
    float *dx, *dw, *dinv, *out;
    int32_t *dpos;
    char what[96];

    gt_fill_normal(x, N, 3.0f);
    gt_fill_normal(w, (size_t)n, 1.0f);
    for (int i = 0; i < rd / 2; i++)
        rope.inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)rd) * (i % 3 ? 1.0f : 1.0f / 16.0f);
    for (int t = 0; t < tokens; t++)
        pos[t] = (int32_t)(gt_u64() % (1u << 17));
    for (int r = 0; r < rows; r++) {
        dsv4_twin_rmsnorm(x + (size_t)r * n, weighted ? w : NULL, n, 1e-6f, ref + (size_t)r * n);
        dsv4_cpu_rope_apply(&rope, ref + (size_t)r * n + n - rd, pos[r / heads], false);
    }
    dx = gt_dev_copy(x, N * sizeof(float));
    dw = gt_dev_copy(w, (size_t)n * sizeof(float));
    dinv = gt_dev_copy(rope.inv_freq, (size_t)(rd / 2) * sizeof(float));
    dpos = gt_dev_copy(pos, (size_t)tokens * sizeof(int32_t));
    DSV4_OK(dsv4_cuda_rmsnorm_rope(dx, NULL, weighted ? dw : NULL, rows, n, 1e-6f, heads, rd, dpos, dinv, dx, NULL));
    out = gt_host_from(dx, N);
    snprintf(what, sizeof(what), "rmsnorm+rope%s [%d tokens x %d, %d], rope %d", weighted ? "" : " unweighted",
             tokens, heads, n, rd);
    ASSERT_REL(what, out, ref, N, FP32_BOUND);
    assert_int_equal(dsv4_cuda_rmsnorm_rope(dx, NULL, NULL, rows, n, 1e-6f, heads, n + 2, dpos, dinv, dx, NULL), -EINVAL);
    cudaFree(dx); cudaFree(dw); cudaFree(dinv); cudaFree(dpos);
    free(x); free(w); free(ref); free(out); free(pos);
}

/* Readers of a pending linear result (struct dsv4_cuda_pending: 13 splits, so both the grouped and
 * the trailing loads of the sum run): RMSNorm + RoPE of wkv's result, mHC post of a sublayer's output,
 * each bit for bit what it makes of the reduced values, and refusing a pending result of another shape. */
static void test_pending_readers(void **state)
{
    static const int rows[] = { 1, 5, 64 };
    const int n = 512, rd = 64, hc = 4, dim = 4096;
    struct dsv4_cuda_gemm_ws ws;

    (void)state;
    for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
        const int B = rows[r];
        float *dsum, *w = malloc(sizeof(float) * n), *inv = malloc(sizeof(float) * rd / 2);
        int32_t *pos = malloc(sizeof(int32_t) * B);
        gt_fill_normal(w, (size_t)n, 1.0f);
        for (int i = 0; i < rd / 2; i++)
            inv[i] = powf(10000.0f, -2.0f * (float)i / (float)rd);
        for (int b = 0; b < B; b++)
            pos[b] = (int32_t)(gt_u64() % 65536);
        float *dw = gt_dev_copy(w, sizeof(float) * n), *dinv = gt_dev_copy(inv, sizeof(float) * rd / 2);
        int32_t *dpos = gt_dev_copy(pos, sizeof(int32_t) * B);
        struct dsv4_cuda_pending p = gt_pending(&ws, 13, B, n, 1.0f, &dsum);
        float *dy = gt_dev_poisoned((size_t)B * n);
        DSV4_OK(dsv4_cuda_rmsnorm_rope(dsum, NULL, dw, B, n, 1e-6f, 1, rd, dpos, dinv, dsum, NULL));
        DSV4_OK(dsv4_cuda_rmsnorm_rope(dy, &p, dw, B, n, 1e-6f, 1, rd, dpos, dinv, dy, NULL));
        gt_assert_same("rmsnorm+rope of a pending kv", dy, dsum, (size_t)B * n);
        assert_int_equal(dsv4_cuda_rmsnorm_rope(dy, &p, dw, B * 2, n / 2, 1e-6f, 1, rd, dpos, dinv, dy, NULL), -EINVAL);
        cudaFree((void *)p.part); cudaFree(dsum); cudaFree(dy); cudaFree(dw); cudaFree(dinv); cudaFree(dpos);
        free(w); free(inv); free(pos);

        const size_t NX = (size_t)B * hc * dim;
        float *X = malloc(NX * sizeof(float)), *post = malloc(sizeof(float) * B * hc);
        float *comb = malloc(sizeof(float) * B * hc * hc);
        gt_fill_normal(X, NX, 1.0f);
        gt_fill_normal(post, (size_t)B * hc, 1.0f);
        gt_fill_normal(comb, (size_t)B * hc * hc, 0.5f);
        float *dX = gt_dev_copy(X, NX * sizeof(float)), *dpost = gt_dev_copy(post, sizeof(float) * B * hc);
        float *dcomb = gt_dev_copy(comb, sizeof(float) * B * hc * hc);
        float *dXo_ref = gt_dev_poisoned(NX), *dXo = gt_dev_poisoned(NX), *df = gt_dev_poisoned((size_t)B * dim);
        p = gt_pending(&ws, 13, B, dim, 1.0f, &dsum);
        DSV4_OK(dsv4_cuda_mhc_post(dX, dsum, NULL, dpost, dcomb, B, hc, dim, dXo_ref, NULL));
        DSV4_OK(dsv4_cuda_mhc_post(dX, df, &p, dpost, dcomb, B, hc, dim, dXo, NULL));
        gt_assert_same("mhc_post of a pending sublayer output", dXo, dXo_ref, NX);
        assert_int_equal(dsv4_cuda_mhc_post(dX, df, &p, dpost, dcomb, B, hc, dim / 2, dXo, NULL), -EINVAL);
        cudaFree((void *)p.part); cudaFree(dsum); cudaFree(dX); cudaFree(dpost); cudaFree(dcomb);
        cudaFree(dXo_ref); cudaFree(dXo); cudaFree(df);
        free(X); free(post); free(comb);
    }
}

static void test_rmsnorm_rope(void **state)
{
    check_rmsnorm_rope(1, 64, 512, 64, false);      /* a token's query heads, in place */
    check_rmsnorm_rope(64, 64, 512, 64, false);
    check_rmsnorm_rope(64, 1, 512, 64, true);       /* kv with kv_norm */
    check_rmsnorm_rope(5, 4, 32, 8, true);          /* tiny fixture shape */
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
    DSV4_OK(dsv4_cuda_mhc_post(dX, df, NULL, dpost, dcomb, batch, hc, dim, dXo, NULL));
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

/* The split-K mHC fn GEMV against the twin's matvec, and batch invariance: a row computed in a batch
 * of `batch` is bit-identical to the same row computed alone. */
static void check_mhc_fn(int batch, int64_t out, int64_t in)
{
    const size_t NW = (size_t)(out * in), NX = (size_t)batch * in, NY = (size_t)batch * out;
    float *w = malloc(NW * sizeof(float)), *x = malloc(NX * sizeof(float)), *ref = malloc(NY * sizeof(float));
    float *dw, *dx, *dy, *dy1, *dws, *o, *o1;
    const int64_t wsf = dsv4_cuda_mhc_fn_ws_floats(batch, out, in);
    const int probe = batch / 2;
    char what[96];

    gt_fill_normal(w, NW, 0.02f);
    gt_fill_normal(x, NX, 1.0f);
    const struct dsv4_linear h = { .fmt = DSV4_W_F32, .out = out, .in = in, .row_stride = in, .w = w, .name = "fn" };
    for (int b = 0; b < batch; b++)
        dsv4_twin_linear_matvec(&h, x + (size_t)b * in, ref + (size_t)b * out);
    dw = gt_dev_copy(w, NW * sizeof(float));
    dx = gt_dev_copy(x, NX * sizeof(float));
    dy = gt_dev_poisoned(NY);
    dy1 = gt_dev_poisoned((size_t)out);
    dws = gt_dev_poisoned((size_t)wsf);
    const struct dsv4_cuda_linear d = { .fmt = DSV4_W_F32, .out = out, .in = in, .row_stride = in, .w = dw };
    DSV4_OK(dsv4_cuda_mhc_fn(&d, dx, in, batch, dws, wsf, dy, out, NULL));
    o = gt_host_from(dy, NY);
    snprintf(what, sizeof(what), "mhc_fn split-K [%lld,%lld] batch %d", (long long)out, (long long)in, batch);
    ASSERT_REL(what, o, ref, NY, FP32_BOUND);
    DSV4_OK(dsv4_cuda_mhc_fn(&d, dx + (size_t)probe * in, in, 1, dws, wsf, dy1, out, NULL));
    o1 = gt_host_from(dy1, (size_t)out);
    assert_memory_equal(o1, o + (size_t)probe * out, (size_t)out * sizeof(float));
    assert_int_equal(dsv4_cuda_mhc_fn(&d, dx, in, batch, dws, wsf - 1, dy, out, NULL), -EINVAL);
    cudaFree(dw); cudaFree(dx); cudaFree(dy); cudaFree(dy1); cudaFree(dws);
    free(w); free(x); free(ref); free(o); free(o1);
}

static void test_mhc_fn(void **state)
{
    check_mhc_fn(1, 24, 16384);     /* hc_attn / hc_ffn fn, hc 4, D 4096 */
    check_mhc_fn(64, 24, 16384);
    check_mhc_fn(3, 4, 16384);      /* hc_head fn */
    check_mhc_fn(5, 12, 136);       /* hc 2, D 68: one partial chunk */
}

/* dsv4_cuda_mhc_fn_pre (the fn's sums inside mHC pre) against dsv4_cuda_mhc_fn then dsv4_cuda_mhc_pre:
 * y, post and comb bit for bit. */
static void check_mhc_fn_pre(int batch, int hc, int dim, int iters)
{
    const int64_t out = (int64_t)(2 + hc) * hc, in = (int64_t)hc * dim;
    const size_t NW = (size_t)(out * in), NX = (size_t)batch * in, NY = (size_t)batch * dim;
    float *w = malloc(NW * sizeof(float)), *X = malloc(NX * sizeof(float)), *base = malloc((size_t)out * sizeof(float));
    float scale[3], *dw, *dX, *dbase, *dscale, *dws, *dm, *y[3], *post[3], *comb[3], *hy[3], *hp[3], *hc_[3];
    const int64_t wsf = dsv4_cuda_mhc_fn_ws_floats(batch, out, in);

    gt_fill_normal(w, NW, 4.0f / sqrtf((float)in));
    gt_fill_normal(X, NX, 1.0f);
    gt_fill_normal(base, (size_t)out, 1.0f);
    gt_fill_normal(scale, 3, 1.0f);
    dw = gt_dev_copy(w, NW * sizeof(float));
    dX = gt_dev_copy(X, NX * sizeof(float));
    dbase = gt_dev_copy(base, (size_t)out * sizeof(float));
    dscale = gt_dev_copy(scale, sizeof(scale));
    dws = gt_dev_poisoned((size_t)wsf);
    dm = gt_dev_poisoned((size_t)batch * out);
    for (int i = 0; i < 3; i++) {
        y[i] = gt_dev_poisoned(NY);
        post[i] = gt_dev_poisoned((size_t)batch * hc);
        comb[i] = gt_dev_poisoned((size_t)batch * hc * hc);
    }
    const struct dsv4_cuda_linear d = { .fmt = DSV4_W_F32, .out = out, .in = in, .row_stride = in, .w = dw };
    DSV4_OK(dsv4_cuda_mhc_fn(&d, dX, in, batch, dws, wsf, dm, out, NULL));
    DSV4_OK(dsv4_cuda_mhc_pre(dX, dm, dbase, dscale, batch, hc, dim, iters, 1e-6f, 1e-6f, y[0], post[0], comb[0], NULL));
    DSV4_OK(dsv4_cuda_mhc_fn_pre(&d, dX, batch, dws, wsf, dbase, dscale, hc, dim, iters, 1e-6f, 1e-6f, y[1], post[1],
                                 comb[1], NULL));
    /* the step's form: y alone, then post and comb from the partials on a second stream */
    cudaStream_t side;
    CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    DSV4_OK(dsv4_cuda_mhc_fn_pre(&d, dX, batch, dws, wsf, dbase, dscale, hc, dim, iters, 1e-6f, 1e-6f, y[2], NULL,
                                 NULL, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    DSV4_OK(dsv4_cuda_mhc_comb(dws, batch, dbase, dscale, hc, dim, iters, 1e-6f, 1e-6f, post[2], comb[2], side));
    CUDA_OK(cudaStreamSynchronize(side));
    CUDA_OK(cudaStreamDestroy(side));
    for (int i = 0; i < 3; i++) {
        hy[i] = gt_host_from(y[i], NY);
        hp[i] = gt_host_from(post[i], (size_t)batch * hc);
        hc_[i] = gt_host_from(comb[i], (size_t)batch * hc * hc);
    }
    for (int i = 1; i < 3; i++) {
        assert_memory_equal(hy[0], hy[i], NY * sizeof(float));
        assert_memory_equal(hp[0], hp[i], (size_t)batch * hc * sizeof(float));
        assert_memory_equal(hc_[0], hc_[i], (size_t)batch * hc * hc * sizeof(float));
    }
    printf("# mhc fn + pre fused, hc %d [%d,%d] iters %d: y, post, comb bit-identical to fn then pre, in one launch "
           "and with post and comb apart\n", hc, batch, dim, iters);
    assert_int_equal(dsv4_cuda_mhc_fn_pre(&d, dX, batch, dws, wsf, dbase, dscale, hc + 1, dim, iters, 1e-6f, 1e-6f,
                                          y[1], post[1], comb[1], NULL), -EINVAL);
    for (int i = 0; i < 3; i++) {
        cudaFree(y[i]); cudaFree(post[i]); cudaFree(comb[i]);
        free(hy[i]); free(hp[i]); free(hc_[i]);
    }
    cudaFree(dw); cudaFree(dX); cudaFree(dbase); cudaFree(dscale); cudaFree(dws); cudaFree(dm);
    free(w); free(X); free(base);
}

static void test_mhc_fn_pre(void **state)
{
    check_mhc_fn_pre(1, 4, 4096, 20);       /* V4-Flash */
    check_mhc_fn_pre(64, 4, 4096, 20);
    check_mhc_fn_pre(3, 2, 68, 3);          /* one partial chunk */
}

/* hc_head (the streams collapsed by sigmoid gates, no Sinkhorn) against a double-precision
 * reference, and dsv4_cuda_mhc_fn_head (fn partials and hc_head in two launches) bit for bit
 * against dsv4_cuda_mhc_fn then dsv4_cuda_hc_head. */
static void check_hc_head(int batch, int hc, int dim)
{
    const int64_t in = (int64_t)hc * dim;
    const size_t NW = (size_t)(hc * in), NX = (size_t)batch * in, NY = (size_t)batch * dim;
    float *w = malloc(NW * sizeof(float)), *X = malloc(NX * sizeof(float)), *base = malloc((size_t)hc * sizeof(float));
    float *ref = malloc(NY * sizeof(float)), *m = malloc((size_t)batch * hc * sizeof(float)), scale[1];
    float *dw, *dX, *dbase, *dscale, *dws, *dm, *y[2], *hy[2];
    const int64_t wsf = dsv4_cuda_mhc_fn_ws_floats(batch, hc, in);
    char what[96];

    gt_fill_normal(w, NW, 4.0f / sqrtf((float)in));
    gt_fill_normal(X, NX, 1.0f);
    gt_fill_normal(base, (size_t)hc, 1.0f);
    gt_fill_normal(scale, 1, 1.0f);
    dw = gt_dev_copy(w, NW * sizeof(float));
    dX = gt_dev_copy(X, NX * sizeof(float));
    dbase = gt_dev_copy(base, (size_t)hc * sizeof(float));
    dscale = gt_dev_copy(scale, sizeof(scale));
    dws = gt_dev_poisoned((size_t)wsf);
    dm = gt_dev_poisoned((size_t)batch * hc);
    for (int i = 0; i < 2; i++)
        y[i] = gt_dev_poisoned(NY);
    const struct dsv4_cuda_linear d = { .fmt = DSV4_W_F32, .out = hc, .in = in, .row_stride = in, .w = dw };
    DSV4_OK(dsv4_cuda_mhc_fn(&d, dX, in, batch, dws, wsf, dm, hc, NULL));
    DSV4_OK(dsv4_cuda_hc_head(dX, dm, dbase, dscale, batch, hc, dim, 1e-6f, 1e-6f, y[0], NULL));
    DSV4_OK(dsv4_cuda_mhc_fn_head(&d, dX, batch, dws, wsf, dbase, dscale, hc, dim, 1e-6f, 1e-6f, y[1], NULL));
    for (int i = 0; i < 2; i++)
        hy[i] = gt_host_from(y[i], NY);
    CUDA_OK(cudaMemcpy(m, dm, (size_t)batch * hc * sizeof(float), cudaMemcpyDeviceToHost));
    for (int b = 0; b < batch; b++) {
        const float *Xb = X + (size_t)b * in;
        double ss = 0.0, pre[DSV4_MAX_HC];
        for (int64_t i = 0; i < in; i++)
            ss += (double)Xb[i] * Xb[i];
        const double r = 1.0 / sqrt(ss / (double)in + 1e-6);
        for (int j = 0; j < hc; j++)    /* the device's fn sums (checked in test_mhc_fn), exact gates */
            pre[j] = 1.0 / (1.0 + exp(-((double)m[b * hc + j] * r * scale[0] + base[j]))) + 1e-6;
        for (int k = 0; k < dim; k++) {
            double acc = 0.0;
            for (int j = 0; j < hc; j++)
                acc += pre[j] * Xb[(size_t)j * dim + k];
            ref[(size_t)b * dim + k] = (float)acc;
        }
    }
    snprintf(what, sizeof(what), "hc_head hc=%d [%d,%d]", hc, batch, dim);
    ASSERT_REL(what, hy[0], ref, NY, FP32_BOUND);
    assert_memory_equal(hy[0], hy[1], NY * sizeof(float));
    printf("# hc_head fused with the fn, hc %d [%d,%d]: y bit-identical to fn then hc_head\n", hc, batch, dim);
    assert_int_equal(dsv4_cuda_mhc_fn_head(&d, dX, batch, dws, wsf, dbase, dscale, hc + 1, dim, 1e-6f, 1e-6f, y[1],
                                           NULL), -EINVAL);
    for (int i = 0; i < 2; i++) {
        cudaFree(y[i]);
        free(hy[i]);
    }
    cudaFree(dw); cudaFree(dX); cudaFree(dbase); cudaFree(dscale); cudaFree(dws); cudaFree(dm);
    free(w); free(X); free(base); free(ref); free(m);
}

static void test_hc_head(void **state)
{
    check_hc_head(1, 4, 4096);      /* V4-Flash */
    check_hc_head(64, 4, 4096);
    check_hc_head(3, 2, 68);        /* one partial chunk */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rmsnorm_rope),
        cmocka_unit_test(test_pending_readers),
        cmocka_unit_test(test_mhc),
        cmocka_unit_test(test_mhc_fn_pre),
        cmocka_unit_test(test_hc_head),
        cmocka_unit_test(test_mhc_fn),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
