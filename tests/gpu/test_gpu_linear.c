/* SPDX-License-Identifier: MIT */
/* GPU: the activation quantizer, the skinny-batch linears (F32, BF16, FP8 128x128, FP4 1x32) and
 * the tensor-core linears (FP8 with in-kernel activation quantization, FP8 with raw activations as
 * f16 hi/lo, alone and as wo_a's 8 groups in one launch, BF16 with hi/lo activations) against their
 * CPU twins, at real V4-Flash shapes and tiny ones, batch 1, 3, 17 and 64.
 * Bounds: the quantizer must match bit for bit (same rounding rules); a linear sees the same FP8-
 * rounded x on both sides, so only f32 summation order differs: 1e-5 relative, every format (the
 * BF16 tensor-core path also carries the hi/lo split's 2^-17 relative error per activation). The
 * tensor-core path must also give row 0 of a batch bit for bit what it gives row 0 alone. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"

#define LINEAR_BOUND 1e-5

struct shape {
    const char *what;
    enum dsv4_wfmt fmt;
    int64_t out, in;
    int max_batch;              /* largest batch checked (the CPU oracle's cost) */
};

static const struct shape shapes[] = {
    { "fp8 wq_a [1024,4096]", DSV4_W_FP8, 1024, 4096, 64 },
    { "fp8 wq_b [32768,1024]", DSV4_W_FP8, 32768, 1024, 64 },
    { "fp8 wo_b [4096,8192]", DSV4_W_FP8, 4096, 8192, 64 },
    { "fp8 tiny [130,256]", DSV4_W_FP8, 130, 256, 64 },
    { "fp8 tiny [8,128]", DSV4_W_FP8, 8, 128, 64 },
    { "bf16 wo_a [8192,4096]", DSV4_W_BF16, 8192, 4096, 64 },
    { "bf16 gate [256,4096]", DSV4_W_BF16, 256, 4096, 64 },
    { "bf16 head [129280,4096]", DSV4_W_BF16, 129280, 4096, 1 },
    { "bf16 tiny [5,72]", DSV4_W_BF16, 5, 72, 64 },
    { "f32 hc fn [24,16384]", DSV4_W_F32, 24, 16384, 64 },
    { "f32 tiny [3,12]", DSV4_W_F32, 3, 12, 64 },
    { "fp4 w1 [2048,4096]", DSV4_W_FP4, 2048, 4096, 64 },
    { "fp4 w2 [4096,2048]", DSV4_W_FP4, 4096, 2048, 64 },
    { "fp4 tiny [3,128]", DSV4_W_FP4, 3, 128, 64 },
};

static const int batches[] = { 1, 3, 17, 64 };

static struct dsv4_cuda_gemm_ws gemm_ws;
static void *gemm_ws_mem;
#define GEMM_WS_MAX_K 32768        /* wo_a's grouped input: 64 heads x 512 */

/* gemm_ws for DSV4_CUDA_MAX_BATCH rows of width GEMM_WS_MAX_K, after dsv4_cuda_gemm_prepare. */
static void ws_open(void)
{
    DSV4_OK(dsv4_cuda_gemm_prepare());
    assert_int_equal(cudaMalloc(&gemm_ws_mem, dsv4_cuda_gemm_ws_bytes(DSV4_CUDA_MAX_BATCH, GEMM_WS_MAX_K)),
                     cudaSuccess);
    dsv4_cuda_gemm_ws_init(&gemm_ws, gemm_ws_mem, DSV4_CUDA_MAX_BATCH, GEMM_WS_MAX_K);
}

static void ws_close(void)
{
    cudaFree(gemm_ws_mem);
}

/* A host linear with random weights in `fmt` and its device copy. */
struct pair {
    struct dsv4_linear h;
    struct dsv4_cuda_linear d;
    void *hw, *hs;
};

static void make_linear(struct pair *p, enum dsv4_wfmt fmt, int64_t out, int64_t in)
{
    size_t wbytes, sbytes = 0;
    int64_t sstride = 0;

    memset(p, 0, sizeof(*p));
    switch (fmt) {
    case DSV4_W_F32: wbytes = (size_t)(out * in) * 4; break;
    case DSV4_W_BF16: wbytes = (size_t)(out * in) * 2; break;
    case DSV4_W_FP8:
        wbytes = (size_t)(out * in);
        sstride = (in + 127) / 128;
        sbytes = (size_t)((out + 127) / 128 * sstride);
        break;
    default:
        wbytes = (size_t)(out * in) / 2;
        sstride = in / 32;
        sbytes = (size_t)(out * sstride);
        break;
    }
    p->hw = malloc(wbytes);
    p->hs = sbytes ? malloc(sbytes) : NULL;
    assert_non_null(p->hw);
    switch (fmt) {
    case DSV4_W_F32: gt_fill_normal(p->hw, (size_t)(out * in), 0.02f); break;
    case DSV4_W_BF16: gt_fill_bf16(p->hw, (size_t)(out * in)); break;
    case DSV4_W_FP8: gt_fill_fp8(p->hw, wbytes); gt_fill_scales(p->hs, sbytes, -9); break;
    default: gt_fill_fp4(p->hw, wbytes); gt_fill_scales(p->hs, sbytes, -5); break;
    }
    p->h = (struct dsv4_linear){ .fmt = fmt, .out = out, .in = in, .row_stride = in, .w = p->hw,
                                 .scale = p->hs, .scale_stride = sstride, .name = "test" };
    p->d = (struct dsv4_cuda_linear){ .fmt = fmt, .out = out, .in = in, .row_stride = in,
                                      .w = gt_dev_copy(p->hw, wbytes),
                                      .scale = sbytes ? gt_dev_copy(p->hs, sbytes) : NULL,
                                      .scale_stride = sstride };
}

static void free_linear(struct pair *p)
{
    cudaFree((void *)p->d.w);
    cudaFree((void *)p->d.scale);
    free(p->hw);
    free(p->hs);
}

/* Activations like a real residual stream: N(0,1) with a few blocks far smaller (below the 1e-4
 * amax floor) and a few with outliers, so every branch of the quantizer runs. */
static void fill_activations(float *x, size_t n)
{
    gt_fill_normal(x, n, 1.0f);
    for (size_t b = 0; b + 128 <= n; b += 128) {
        uint64_t r = gt_u64() % 16;
        if (r == 0)
            for (size_t i = 0; i < 128; i++)
                x[b + i] *= 1e-6f;
        else if (r == 1)
            x[b + gt_u64() % 128] = 300.0f * gt_normal();
    }
}

static void test_fp8_roundtrip(void **state)
{
    const int64_t ks[] = { 128, 4096, 7168, 96, 200 };   /* the last two end rows in a short block */
    for (size_t t = 0; t < sizeof(ks) / sizeof(ks[0]); t++) {
        const int rows = 64;
        const size_t n = (size_t)rows * ks[t];
        float *x = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float)), *out;
        float *dx, *dy;
        size_t mism = 0;

        fill_activations(x, n);
        memcpy(ref, x, n * sizeof(float));
        for (int r = 0; r < rows; r++)
            dsv4_twin_fp8_roundtrip(ref + (size_t)r * ks[t], (size_t)ks[t], 128);
        dx = gt_dev_copy(x, n * sizeof(float));
        dy = gt_dev_poisoned(n);
        DSV4_OK(dsv4_cuda_fp8_roundtrip(dx, rows, ks[t], 128, dy, NULL));
        out = gt_host_from(dy, n);
        for (size_t i = 0; i < n; i++)
            mism += memcmp(&out[i], &ref[i], sizeof(float)) != 0;
        printf("# fp8 roundtrip [%d,%lld]: %zu of %zu values differ from the twin\n", rows,
               (long long)ks[t], mism, n);
        assert_int_equal(mism, 0);
        cudaFree(dx);
        cudaFree(dy);
        free(x);
        free(ref);
        free(out);
    }
}

/* The tensor-core linear W (groups > 0: dsv4_cuda_gemm_grouped, raw x) on B rows of d_x [B, ldx]
 * against ref [B, W.out] (bound LINEAR_BOUND), then row 0 alone: bit-identical to row 0 of the batch. */
static void check_gemm(const struct dsv4_cuda_linear *W, int groups, bool quant, const float *d_x, int64_t ldx, int B,
                       const float *ref, const char *what)
{
    const size_t out_n = (size_t)W->out;
    float *dy = gt_dev_poisoned((size_t)B * out_n), *out, *row0;
    if (groups)
        DSV4_OK(dsv4_cuda_gemm_grouped(W, groups, d_x, ldx, B, &gemm_ws, dy, W->out, NULL));
    else
        DSV4_OK(dsv4_cuda_gemm(W, d_x, ldx, B, quant, &gemm_ws, dy, W->out, NULL));
    out = gt_host_from(dy, (size_t)B * out_n);
    ASSERT_REL(what, out, ref, (size_t)B * out_n, LINEAR_BOUND);
    cudaFree(dy);
    dy = gt_dev_poisoned(out_n);
    if (groups)
        DSV4_OK(dsv4_cuda_gemm_grouped(W, groups, d_x, ldx, 1, &gemm_ws, dy, W->out, NULL));
    else
        DSV4_OK(dsv4_cuda_gemm(W, d_x, ldx, 1, quant, &gemm_ws, dy, W->out, NULL));
    row0 = gt_host_from(dy, out_n);
    assert_memory_equal(row0, out, out_n * sizeof(float));
    free(row0);
    free(out);
    cudaFree(dy);
}

static void check_shape(const struct shape *s)
{
    struct pair p;
    const size_t in = (size_t)s->in, out_n = (size_t)s->out;
    const int bmax = s->max_batch;
    const bool quant = s->fmt == DSV4_W_FP8 || s->fmt == DSV4_W_FP4;
    float *x = malloc((size_t)bmax * in * sizeof(float)), *xq = malloc((size_t)bmax * in * sizeof(float));
    float *row = malloc(in * sizeof(float)), *ref = malloc((size_t)bmax * out_n * sizeof(float));
    float *ref_raw = s->fmt == DSV4_W_FP8 ? malloc((size_t)bmax * out_n * sizeof(float)) : NULL;
    float *dx, *dxq, *dy;

    make_linear(&p, s->fmt, s->out, s->in);
    fill_activations(x, (size_t)bmax * in);
    memcpy(xq, x, (size_t)bmax * in * sizeof(float));
    if (quant)
        for (int b = 0; b < bmax; b++)
            dsv4_twin_fp8_roundtrip(xq + (size_t)b * in, in, 128);
    for (size_t r = 0; r < out_n; r++) {
        dsv4_twin_linear_row(&p.h, (int64_t)r, row);
        for (int b = 0; b < bmax; b++) {
            double acc = 0.0;
            for (size_t k = 0; k < in; k++)
                acc += (double)row[k] * xq[(size_t)b * in + k];
            ref[(size_t)b * out_n + r] = (float)acc;
            if (ref_raw) {      /* FP8 weights with raw activations (wo_a; exact numerics) */
                acc = 0.0;
                for (size_t k = 0; k < in; k++)
                    acc += (double)row[k] * x[(size_t)b * in + k];
                ref_raw[(size_t)b * out_n + r] = (float)acc;
            }
        }
    }
    dx = gt_dev_copy(x, (size_t)bmax * in * sizeof(float));
    dxq = gt_dev_poisoned((size_t)bmax * in);
    if (quant)
        DSV4_OK(dsv4_cuda_fp8_roundtrip(dx, bmax, s->in, 128, dxq, NULL));
    for (size_t i = 0; i < sizeof(batches) / sizeof(batches[0]) && batches[i] <= bmax; i++) {
        const int B = batches[i];
        char what[96];
        float *out;
        dy = gt_dev_poisoned((size_t)B * out_n);
        DSV4_OK(dsv4_cuda_gemv(&p.d, quant ? dxq : dx, s->in, B, dy, s->out, NULL));
        out = gt_host_from(dy, (size_t)B * out_n);
        snprintf(what, sizeof(what), "%s batch %d", s->what, B);
        ASSERT_REL(what, out, ref, (size_t)B * out_n, LINEAR_BOUND);
        free(out);
        cudaFree(dy);
        if (!dsv4_cuda_gemm_supports(&p.d, quant))
            continue;
        /* tensor cores: quantization happens inside, from the raw x */
        snprintf(what, sizeof(what), "%s batch %d (tensor cores, %d stages)", s->what, B, dsv4_cuda_gemm_stages());
        check_gemm(&p.d, 0, quant, dx, s->in, B, ref, what);
        if (!ref_raw || !dsv4_cuda_gemm_supports(&p.d, false))
            continue;
        snprintf(what, sizeof(what), "%s batch %d (raw x, tensor cores, %d stages)", s->what, B,
                 dsv4_cuda_gemm_stages());
        check_gemm(&p.d, 0, false, dx, s->in, B, ref_raw, what);
    }
    cudaFree(dx);
    cudaFree(dxq);
    free_linear(&p);
    free(x);
    free(xq);
    free(row);
    free(ref);
    free(ref_raw);
}

static void test_linears(void **state)
{
    ws_open();
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        check_shape(&shapes[i]);
    /* refusals: FP4 weights, BF16 with quantized activations, more rows than the workspace, groups
     * that split a scale block */
    struct pair p, q;
    float *dx = gt_dev_poisoned(2 * 256), *dy = gt_dev_poisoned(256);
    make_linear(&p, DSV4_W_FP8, 256, 256);
    make_linear(&q, DSV4_W_FP4, 256, 256);
    assert_false(dsv4_cuda_gemm_supports(&q.d, true));
    assert_int_equal(dsv4_cuda_gemm(&q.d, dx, 256, 1, true, &gemm_ws, dy, 256, NULL), -EINVAL);
    free_linear(&q);
    make_linear(&q, DSV4_W_BF16, 256, 256);
    assert_false(dsv4_cuda_gemm_supports(&q.d, true));
    free_linear(&q);
    assert_int_equal(dsv4_cuda_gemm(&p.d, dx, 256, DSV4_CUDA_MAX_BATCH + 1, true, &gemm_ws, dy, 256, NULL), -EINVAL);
    assert_false(dsv4_cuda_gemm_grouped_supports(&p.d, 4));
    assert_int_equal(dsv4_cuda_gemm_grouped(&p.d, 4, dx, 256, 1, &gemm_ws, dy, 256, NULL), -EINVAL);
    free_linear(&p);
    cudaFree(dx);
    cudaFree(dy);
    ws_close();
}

/* wo_a at V4-Flash's shape in one grouped launch: W [8 x 1024, 4096] FP8, x [B, 8 x 4096] raw;
 * output row o reads x's group o / 1024. Against a double reference; a row alone bit-identical.
 * Needs gemm_ws. */
static void check_wo_a_grouped(void)
{
    const int G = 8, R = 1024, K = 4096, B = DSV4_CUDA_MAX_BATCH, ob = G * R, xw = G * K;
    const int bs[3] = { 1, 17, 64 };
    struct pair p;
    float *x = malloc((size_t)B * xw * sizeof(float)), *row = malloc((size_t)K * sizeof(float));
    float *ref = malloc((size_t)B * ob * sizeof(float)), *dx;
    char what[96];

    make_linear(&p, DSV4_W_FP8, ob, K);
    assert_true(dsv4_cuda_gemm_grouped_supports(&p.d, G));
    fill_activations(x, (size_t)B * xw);
    for (int o = 0; o < ob; o++) {
        dsv4_twin_linear_row(&p.h, o, row);
        for (int b = 0; b < B; b++) {
            const float *xg = x + (size_t)b * xw + (size_t)(o / R) * K;
            double acc = 0.0;
            for (int k = 0; k < K; k++)
                acc += (double)row[k] * xg[k];
            ref[(size_t)b * ob + o] = (float)acc;
        }
    }
    dx = gt_dev_copy(x, (size_t)B * xw * sizeof(float));
    for (int i = 0; i < 3; i++) {
        snprintf(what, sizeof(what), "fp8 wo_a [8192,4096] in 8 groups, raw x, batch %d, %d-stage ring", bs[i],
                 dsv4_cuda_gemm_stages());
        check_gemm(&p.d, G, false, dx, xw, bs[i], ref, what);
    }
    cudaFree(dx);
    free_linear(&p);
    free(x);
    free(row);
    free(ref);
}

static void test_wo_a_grouped(void **state)
{
    ws_open();
    check_wo_a_grouped();
    ws_close();
}

/* The 2-stage ring that devices with 99 KB of shared memory a block (sm_86/89/120) get, forced here
 * (DSV4_CUDA_GEMM_STAGES=2, and DSV4_CUDA_GEMM_WGMMA=0: those devices have no wgmma, so batches of
 * 9-64 rows take the ring too): every mode at a Flash shape and a tiny one, and the grouped wo_a. */
static void test_short_ring(void **state)
{
    static const struct shape few[] = {
        { "fp8 wo_b [4096,8192]", DSV4_W_FP8, 4096, 8192, 64 },
        { "fp8 tiny [130,256]", DSV4_W_FP8, 130, 256, 64 },
        { "bf16 gate [256,4096]", DSV4_W_BF16, 256, 4096, 64 },
        { "bf16 tiny [5,72]", DSV4_W_BF16, 5, 72, 64 },
    };
    setenv("DSV4_CUDA_GEMM_STAGES", "2", 1);
    setenv("DSV4_CUDA_GEMM_WGMMA", "0", 1);
    ws_open();
    unsetenv("DSV4_CUDA_GEMM_STAGES");
    unsetenv("DSV4_CUDA_GEMM_WGMMA");
    assert_int_equal(dsv4_cuda_gemm_stages(), 2);
    assert_false(dsv4_cuda_gemm_wgmma_decode());
    for (size_t i = 0; i < sizeof(few) / sizeof(few[0]); i++)
        check_shape(&few[i]);
    check_wo_a_grouped();
    ws_close();
    DSV4_OK(dsv4_cuda_gemm_prepare());      /* back to the device's own choice */
    printf("# the device's own ring: %d stages\n", dsv4_cuda_gemm_stages());
}

/* Linears of 1 to 8 rows whose K is split run gemm_direct.cu's kernel (weights streamed into
 * registers): every row of it bit-identical to the same rows through the shared-memory ring kernel
 * (DSV4_CUDA_GEMM_DIRECT=0), in every mode, at Flash's shapes, one with rows past the last full tile
 * and the grouped wo_a, and the direct kernel counted as the variant that ran; unsplit shapes (wq_b)
 * keep the ring either way. */
static void direct_against_ring(const struct dsv4_cuda_linear *W, int groups, bool quant, const float *d_x, int64_t ldx,
                                bool direct, const char *what, int *differ)
{
    static const int rows[] = { 1, 2, 5, 8 };
    const size_t out_n = (size_t)W->out;
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        const int B = rows[i];
        float *got[2];
        for (int ring = 0; ring < 2; ring++) {
            if (ring)
                setenv("DSV4_CUDA_GEMM_DIRECT", "0", 1);
            DSV4_OK(dsv4_cuda_gemm_prepare());
            unsetenv("DSV4_CUDA_GEMM_DIRECT");
            const uint64_t n_direct = dsv4_cuda_variant_launches(DSV4_CUDA_V_GEMM_DIRECT);
            float *dy = gt_dev_poisoned((size_t)B * out_n);
            if (groups)
                DSV4_OK(dsv4_cuda_gemm_grouped(W, groups, d_x, ldx, B, &gemm_ws, dy, W->out, NULL));
            else
                DSV4_OK(dsv4_cuda_gemm(W, d_x, ldx, B, quant, &gemm_ws, dy, W->out, NULL));
            assert_int_equal(dsv4_cuda_variant_launches(DSV4_CUDA_V_GEMM_DIRECT), n_direct + (!ring && direct ? 1 : 0));
            got[ring] = gt_host_from(dy, (size_t)B * out_n);
            cudaFree(dy);
        }
        for (int b = 0; b < B; b++)
            if (memcmp(got[0] + (size_t)b * out_n, got[1] + (size_t)b * out_n, out_n * sizeof(float)) != 0) {
                printf("#   %s, %d rows: row %d differs from the ring kernel's\n", what, B, b);
                (*differ)++;
            }
        free(got[0]);
        free(got[1]);
    }
    printf("# %s: rows 1-8 %s, bit-identical to the ring kernel\n", what, direct ? "direct" : "on the ring (one split)");
}

static void test_direct_rows(void **state)
{
    static const struct {
        struct shape s;
        bool direct;            /* K split: the direct kernel runs */
    } few[] = {
        { { "fp8 wq_a [1024,4096]", DSV4_W_FP8, 1024, 4096, 8 }, true },
        { { "fp8 wq_b [32768,1024]", DSV4_W_FP8, 32768, 1024, 8 }, false },
        { { "fp8 wo_b [4096,8192]", DSV4_W_FP8, 4096, 8192, 8 }, true },
        { { "fp8 shared w2 [4096,2048]", DSV4_W_FP8, 4096, 2048, 8 }, true },
        { { "fp8 [130,4096]", DSV4_W_FP8, 130, 4096, 8 }, true },
        { { "bf16 gate [256,4096]", DSV4_W_BF16, 256, 4096, 8 }, true },
        { { "bf16 comp wkv [1024,4096]", DSV4_W_BF16, 1024, 4096, 8 }, true },
    };
    const int G = 8, K = 4096, B = 8;
    int differ = 0;
    float *dx;
    ws_open();
    for (size_t i = 0; i < sizeof(few) / sizeof(few[0]); i++) {
        struct pair p;
        float *x = malloc((size_t)B * few[i].s.in * sizeof(float));
        make_linear(&p, few[i].s.fmt, few[i].s.out, few[i].s.in);
        fill_activations(x, (size_t)B * few[i].s.in);
        dx = gt_dev_copy(x, (size_t)B * few[i].s.in * sizeof(float));
        if (few[i].s.fmt == DSV4_W_FP8) {
            char what[96];
            snprintf(what, sizeof(what), "%s quantized x", few[i].s.what);
            direct_against_ring(&p.d, 0, true, dx, few[i].s.in, few[i].direct, what, &differ);
            snprintf(what, sizeof(what), "%s raw x", few[i].s.what);
            direct_against_ring(&p.d, 0, false, dx, few[i].s.in, few[i].direct, what, &differ);
        } else {
            direct_against_ring(&p.d, 0, false, dx, few[i].s.in, few[i].direct, few[i].s.what, &differ);
        }
        cudaFree(dx);
        free_linear(&p);
        free(x);
    }
    struct pair p;
    float *x = malloc((size_t)B * G * K * sizeof(float));
    make_linear(&p, DSV4_W_FP8, G * 1024, K);
    fill_activations(x, (size_t)B * G * K);
    dx = gt_dev_copy(x, (size_t)B * G * K * sizeof(float));
    direct_against_ring(&p.d, G, false, dx, (int64_t)G * K, true, "fp8 wo_a [8192,4096] in 8 groups", &differ);
    cudaFree(dx);
    free_linear(&p);
    free(x);
    ws_close();
    DSV4_OK(dsv4_cuda_gemm_prepare());
    assert_int_equal(differ, 0);
}

/* A view of rows [64, 128) of an FP8 linear (one wo_a group of 64 rows: it starts mid scale block)
 * gives bit for bit those rows of the whole linear's result. */
static void test_fp8_view_mid_block(void **state)
{
    struct pair p;
    const int64_t out = 256, in = 512, r0 = 64, n = 64;
    const int B = 3;
    float *x = malloc(sizeof(float) * B * in), *full, *part;
    float *dx, *dxq, *dy, *dv;

    make_linear(&p, DSV4_W_FP8, out, in);
    fill_activations(x, (size_t)B * in);
    dx = gt_dev_copy(x, sizeof(float) * B * in);
    dxq = gt_dev_poisoned((size_t)B * in);
    dy = gt_dev_poisoned((size_t)B * out);
    dv = gt_dev_poisoned((size_t)B * n);
    DSV4_OK(dsv4_cuda_fp8_roundtrip(dx, B, in, 128, dxq, NULL));
    DSV4_OK(dsv4_cuda_gemv(&p.d, dxq, in, B, dy, out, NULL));
    const struct dsv4_cuda_linear v = dsv4_cuda_linear_rows(&p.d, r0, n);
    DSV4_OK(dsv4_cuda_gemv(&v, dxq, in, B, dv, n, NULL));
    full = gt_host_from(dy, (size_t)B * out);
    part = gt_host_from(dv, (size_t)B * n);
    for (int b = 0; b < B; b++)
        assert_memory_equal(part + b * n, full + b * out + r0, sizeof(float) * n);
    assert_false(dsv4_cuda_gemm_supports(&v, true));   /* the tensor-core path takes whole blocks only */
    free_linear(&p);
    cudaFree(dx);
    cudaFree(dxq);
    cudaFree(dy);
    cudaFree(dv);
    free(x);
    free(full);
    free(part);
}

/* dsv4_cuda_gemm_same_x, in each activation form: after W1 on x, W2 on the same x skips preparing x
 * and gives bit for bit what W2 alone gives; x is overwritten on the device in between, so a result
 * that still matches shows the preparation was reused. A previous call on different rows, or one
 * that failed, makes it prepare x again. */
static void test_same_x(void **state)
{
    static const struct { enum dsv4_wfmt fmt; bool quant; const char *what; } forms[] = {
        { DSV4_W_FP8, true, "fp8, quantized x" }, { DSV4_W_FP8, false, "fp8, raw x" },
        { DSV4_W_BF16, false, "bf16" },
    };
    const int64_t out = 256, in = 512;
    const int B = 5;

    (void)state;
    ws_open();
    for (size_t f = 0; f < sizeof(forms) / sizeof(forms[0]); f++) {
        struct pair w1, w2;
        float *x = malloc(sizeof(float) * B * in), *ref, *got;
        float *dx, *dy1 = gt_dev_poisoned((size_t)B * out), *dy = gt_dev_poisoned((size_t)B * out);
        const bool q = forms[f].quant;

        make_linear(&w1, forms[f].fmt, out, in);
        make_linear(&w2, forms[f].fmt, out, in);
        fill_activations(x, (size_t)B * in);
        dx = gt_dev_copy(x, sizeof(float) * B * in);
        DSV4_OK(dsv4_cuda_gemm(&w2.d, dx, in, B, q, &gemm_ws, dy, out, NULL));
        ref = gt_host_from(dy, (size_t)B * out);

        DSV4_OK(dsv4_cuda_gemm(&w1.d, dx, in, B, q, &gemm_ws, dy1, out, NULL));
        assert_int_equal(cudaMemset(dx, 0xff, sizeof(float) * B * in), cudaSuccess);   /* NaN: must not be read */
        DSV4_OK(dsv4_cuda_gemm_same_x(&w2.d, dx, in, B, q, &gemm_ws, dy, out, NULL));
        got = gt_host_from(dy, (size_t)B * out);
        assert_memory_equal(got, ref, sizeof(float) * B * out);
        free(got);

        assert_int_equal(cudaMemcpy(dx, x, sizeof(float) * B * in, cudaMemcpyHostToDevice), cudaSuccess);
        DSV4_OK(dsv4_cuda_gemm(&w1.d, dx, in, B - 2, q, &gemm_ws, dy1, out, NULL));     /* other rows */
        DSV4_OK(dsv4_cuda_gemm_same_x(&w2.d, dx, in, B, q, &gemm_ws, dy, out, NULL));
        got = gt_host_from(dy, (size_t)B * out);
        assert_memory_equal(got, ref, sizeof(float) * B * out);
        free(got);

        DSV4_OK(dsv4_cuda_gemm(&w1.d, dx, in, B, q, &gemm_ws, dy1, out, NULL));
        assert_int_equal(dsv4_cuda_gemm(&w1.d, dx, in, DSV4_CUDA_MAX_BATCH + 1, q, &gemm_ws, dy1, out, NULL),
                         -EINVAL);                                                  /* a failed call */
        DSV4_OK(dsv4_cuda_gemm_same_x(&w2.d, dx, in, B, q, &gemm_ws, dy, out, NULL));
        got = gt_host_from(dy, (size_t)B * out);
        assert_memory_equal(got, ref, sizeof(float) * B * out);
        printf("# same x, %s: reused preparation, other rows and a failed call all give W2's own result\n",
               forms[f].what);
        free(got);
        free(ref);
        free(x);
        free_linear(&w1);
        free_linear(&w2);
        cudaFree(dx);
        cudaFree(dy1);
        cudaFree(dy);
    }
    ws_close();
}

/* Every row of a launch of B rows bit-identical to that row computed alone (the decode path of one
 * row, whose split-K reduction every other path reproduces), in each activation form, on shapes whose
 * K is split (wq_a's [1024, 4096] in 16 splits, a BF16 [256, 4096] in 32), a grouped wo_a, and K of 5
 * and 1 k-tiles, at row counts that leave a partial last block; and within LINEAR_BOUND of the CPU
 * twin on sampled rows. `env` = `on` selects the kernel under test; `v` counts its launches, which
 * must be > 0 on an sm_90 device when on (the sm_90a image runs there) and 0 when off. */
static void check_rows(const char *env, bool on, enum dsv4_cuda_variant v, const int *rows, size_t nrows,
                       const char *label)
{
    static const struct { enum dsv4_wfmt fmt; bool quant; int64_t out, in; int groups; const char *what; } forms[] = {
        { DSV4_W_FP8, true, 1024, 4096, 0, "fp8 [1024,4096], quantized x" },
        { DSV4_W_FP8, false, 1024, 4096, 0, "fp8 [1024,4096], raw x" },
        { DSV4_W_BF16, false, 256, 4096, 0, "bf16 [256,4096]" },
        { DSV4_W_FP8, false, 2048, 1024, 4, "fp8 grouped [2048,1024] x 4 groups" },
        { DSV4_W_FP8, true, 384, 640, 0, "fp8 [384,640], quantized x (an odd count of k-tiles)" },
        { DSV4_W_FP8, false, 256, 128, 0, "fp8 [256,128], raw x (one k-tile)" },
        { DSV4_W_FP8, true, 32768, 256, 0, "fp8 [32768,256], quantized x (one split)" },
    };
    int RMAX = 1;
    const int64_t KMAX = 4096;
    struct dsv4_cuda_gemm_ws ws;
    void *mem;

    for (size_t r = 0; r < nrows; r++)
        RMAX = rows[r] > RMAX ? rows[r] : RMAX;
    struct cudaDeviceProp prop;
    assert_int_equal(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    setenv(env, on ? "1" : "0", 1);
    DSV4_OK(dsv4_cuda_gemm_prepare());
    const uint64_t n0 = dsv4_cuda_variant_launches(v);
    assert_int_equal(cudaMalloc(&mem, dsv4_cuda_gemm_ws_bytes(RMAX, KMAX)), cudaSuccess);
    dsv4_cuda_gemm_ws_init(&ws, mem, RMAX, KMAX);
    for (size_t f = 0; f < sizeof(forms) / sizeof(forms[0]); f++) {
        const int64_t out = forms[f].out, G = forms[f].groups, xw = forms[f].in * (G ? G : 1);
        const bool q = forms[f].quant;
        struct pair W;
        make_linear(&W, forms[f].fmt, out, forms[f].in);
        float *x = malloc(sizeof(float) * (size_t)RMAX * xw);
        fill_activations(x, (size_t)RMAX * xw);
        float *dx = gt_dev_copy(x, sizeof(float) * (size_t)RMAX * xw);
        for (size_t r = 0; r < nrows; r++) {
            const int B = rows[r];
            float *dy = gt_dev_poisoned((size_t)B * out), *d1 = gt_dev_poisoned((size_t)out);
            if (G)
                DSV4_OK(dsv4_cuda_gemm_grouped(&W.d, (int)G, dx, xw, B, &ws, dy, out, NULL));
            else
                DSV4_OK(dsv4_cuda_gemm(&W.d, dx, xw, B, q, &ws, dy, out, NULL));
            float *got = gt_host_from(dy, (size_t)B * out);
            size_t differ = 0;
            for (int i = 0; i < B; i++) {
                if (G)
                    DSV4_OK(dsv4_cuda_gemm_grouped(&W.d, (int)G, dx + (size_t)i * xw, xw, 1, &ws, d1, out, NULL));
                else
                    DSV4_OK(dsv4_cuda_gemm(&W.d, dx + (size_t)i * xw, xw, 1, q, &ws, d1, out, NULL));
                float *one = gt_host_from(d1, (size_t)out);
                differ += memcmp(one, got + (size_t)i * out, sizeof(float) * out) != 0;
                free(one);
            }
            /* the twin on the first, a middle and the last row (f64 dot products of the
             * dequantized weight rows with x, FP8-rounded in 1x128 blocks when quantized) */
            const int probe[3] = { 0, B / 2, B - 1 };
            const int64_t K = forms[f].in, R = G ? out / G : out;
            float *wrow = malloc(sizeof(float) * K), *xr = malloc(sizeof(float) * xw);
            float *gsel = malloc(sizeof(float) * 3 * out), *rsel = malloc(sizeof(float) * 3 * out);
            for (int k = 0; k < 3; k++) {
                memcpy(xr, x + (size_t)probe[k] * xw, sizeof(float) * xw);
                if (q)
                    dsv4_twin_fp8_roundtrip(xr, (size_t)xw, 128);
                for (int64_t o = 0; o < out; o++) {
                    const float *xg = xr + (o / R) * K;
                    double acc = 0.0;
                    dsv4_twin_linear_row(&W.h, o, wrow);
                    for (int64_t i = 0; i < K; i++)
                        acc += (double)wrow[i] * xg[i];
                    rsel[(size_t)k * out + o] = (float)acc;
                }
                memcpy(gsel + (size_t)k * out, got + (size_t)probe[k] * out, sizeof(float) * out);
            }
            char what[160];
            snprintf(what, sizeof(what), "%s, %d rows, %s=%d", forms[f].what, B, env, on);
            ASSERT_REL(what, gsel, rsel, (size_t)3 * out, LINEAR_BOUND);
            printf("# %s rows, %s: %zu of %d rows differ from the row computed alone\n", label, what, differ, B);
            assert_int_equal(differ, 0);
            free(wrow);
            free(xr);
            free(gsel);
            free(rsel);
            free(got);
            cudaFree(dy);
            cudaFree(d1);
        }
        free(x);
        cudaFree(dx);
        free_linear(&W);
    }
    cudaFree(mem);
    const uint64_t n = dsv4_cuda_variant_launches(v) - n0;
    printf("# %s rows, %s=%d: %llu launches of %s\n", label, env, on, (unsigned long long)n,
           dsv4_cuda_variant_name(v));
    if (!on)
        assert_int_equal(n, 0);
    else if (prop.major == 9 && prop.minor == 0)
        assert_true(n > 0);
    unsetenv(env);
    DSV4_OK(dsv4_cuda_gemm_prepare());
}

/* Prefill chunks (more than DSV4_CUDA_MAX_BATCH rows: a CTA per block of 64 rows, or of 32, 16 or 8
 * where a small weight would leave SMs idle (on the H200's mma.sync path these shapes and row counts
 * reach all four widths), each walking all of K and folding the shape's splits in order), on both
 * prefill kernels: the FP8 forms on wgmma (the default where the sm_90a image runs) and everything on
 * mma.sync (DSV4_CUDA_GEMM_WGMMA=0, which the boot log then names as the reason). */
static void test_prefill_rows(void **state)
{
    static const int rows[] = { 65, 200, 1000 };
    (void)state;
    check_rows("DSV4_CUDA_GEMM_WGMMA", true, DSV4_CUDA_V_GEMM_FP8_WGMMA, rows, 3, "prefill");
    assert_int_equal(dsv4_cuda_gemm_wgmma(), dsv4_cuda_gemm_wgmma_why_not() == NULL);
    setenv("DSV4_CUDA_GEMM_WGMMA", "0", 1);
    DSV4_OK(dsv4_cuda_gemm_prepare());
    assert_false(dsv4_cuda_gemm_wgmma());
    assert_string_equal(dsv4_cuda_gemm_wgmma_why_not(), "DSV4_CUDA_GEMM_WGMMA=0");
    check_rows("DSV4_CUDA_GEMM_WGMMA", false, DSV4_CUDA_V_GEMM_FP8_WGMMA, rows, 3, "prefill");
}

/* Decode batches of 9-64 rows: the FP8 and BF16 forms on wgmma (N 16, 32 or 64; a CTA per weight tile
 * and K split, the partials reduced as the mma.sync path's) and on the mma.sync ring
 * (DSV4_CUDA_GEMM_WGMMA_DECODE=0); each row == the row alone (the one-tile register kernel). */
static void test_decode_rows(void **state)
{
    static const int rows[] = { 9, 16, 17, 32, 33, 64 };
    (void)state;
    check_rows("DSV4_CUDA_GEMM_WGMMA_DECODE", true, DSV4_CUDA_V_GEMM_WGMMA_DECODE, rows, 6, "decode");
    check_rows("DSV4_CUDA_GEMM_WGMMA_DECODE", false, DSV4_CUDA_V_GEMM_WGMMA_DECODE, rows, 6, "decode");
}

/* dsv4_cuda_gemm_norm: the normalized rows are dsv4_cuda_rmsnorm's bit for bit, and a linear that
 * then reads them through dsv4_cuda_gemm_same_x gives what RMSNorm followed by the plain linear
 * gives, bit for bit, with the normalized rows overwritten in between (so the fused preparation is
 * what it used). Forms without a fused preparation (FP8 with raw x) are refused. */
static void test_norm_prep(void **state)
{
    static const struct { enum dsv4_wfmt fmt; bool quant; int64_t out; const char *what; } forms[] = {
        { DSV4_W_FP8, true, 1024, "fp8 wq_a [1024,4096], quantized x" },
        { DSV4_W_BF16, false, 256, "bf16 gate [256,4096]" },
    };
    static const int rows[] = { 1, 17, 64, 200 };
    const int64_t in = 4096;
    const float eps = 1e-6f;
    struct dsv4_cuda_gemm_ws nws;       /* room for the 200-row prefill chunk */
    void *nmem;

    (void)state;
    DSV4_OK(dsv4_cuda_gemm_prepare());
    assert_int_equal(cudaMalloc(&nmem, dsv4_cuda_gemm_ws_bytes(200, in)), cudaSuccess);
    dsv4_cuda_gemm_ws_init(&nws, nmem, 200, in);
    for (size_t f = 0; f < sizeof(forms) / sizeof(forms[0]); f++) {
        const int64_t out = forms[f].out;
        const bool q = forms[f].quant;
        struct pair W;
        make_linear(&W, forms[f].fmt, out, in);
        assert_true(dsv4_cuda_gemm_norm_supports(&W.d, q));
        for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
            const int B = rows[r];
            float *x = malloc(sizeof(float) * B * in), *nw = malloc(sizeof(float) * in);
            fill_activations(x, (size_t)B * in);
            gt_fill_normal(nw, (size_t)in, 0.1f);
            for (int64_t i = 0; i < in; i++)
                nw[i] += 1.0f;
            float *dx = gt_dev_copy(x, sizeof(float) * B * in), *dw = gt_dev_copy(nw, sizeof(float) * in);
            float *dn_ref = gt_dev_poisoned((size_t)B * in), *dn = gt_dev_poisoned((size_t)B * in);
            float *dy_ref = gt_dev_poisoned((size_t)B * out), *dy = gt_dev_poisoned((size_t)B * out);

            DSV4_OK(dsv4_cuda_rmsnorm(dx, dw, B, (int)in, eps, dn_ref, NULL));
            DSV4_OK(dsv4_cuda_gemm(&W.d, dn_ref, in, B, q, &nws, dy_ref, out, NULL));
            DSV4_OK(dsv4_cuda_gemm_norm(&W.d, q, dx, NULL, dw, B, eps, &nws, dn, NULL));
            assert_ptr_equal(nws.prepared.x, dn);
            float *n_ref = gt_host_from(dn_ref, (size_t)B * in), *n_got = gt_host_from(dn, (size_t)B * in);
            assert_memory_equal(n_got, n_ref, sizeof(float) * B * in);
            assert_int_equal(cudaMemset(dn, 0xff, sizeof(float) * B * in), cudaSuccess);  /* NaN: must not be read */
            DSV4_OK(dsv4_cuda_gemm_same_x(&W.d, dn, in, B, q, &nws, dy, out, NULL));
            float *y_ref = gt_host_from(dy_ref, (size_t)B * out), *y_got = gt_host_from(dy, (size_t)B * out);
            assert_memory_equal(y_got, y_ref, sizeof(float) * B * out);
            printf("# norm + prepare, %s, %d rows: norm and linear bit-identical to the two-step path\n",
                   forms[f].what, B);
            free(x); free(nw); free(n_ref); free(n_got); free(y_ref); free(y_got);
            cudaFree(dx); cudaFree(dw); cudaFree(dn_ref); cudaFree(dn); cudaFree(dy_ref); cudaFree(dy);
        }
        free_linear(&W);
    }
    {   /* FP8 with raw activations has no fused preparation */
        struct pair W;
        float *dx = gt_dev_poisoned((size_t)in), *dn = gt_dev_poisoned((size_t)in);
        make_linear(&W, DSV4_W_FP8, 256, in);
        assert_false(dsv4_cuda_gemm_norm_supports(&W.d, false));
        assert_int_equal(dsv4_cuda_gemm_norm(&W.d, false, dx, NULL, NULL, 1, eps, &nws, dn, NULL), -EINVAL);
        assert_null(nws.prepared.x);
        free_linear(&W);
        cudaFree(dx);
        cudaFree(dn);
    }
    cudaFree(nmem);
}

/* The head's shape [129280, 4096] BF16, one split of 64 k-tiles a CTA: at 9, 17 and 64 rows (the
 * 2-, 4- and 8-tile walks, walk_stages deep in gemm.cu) every row is bit for bit the row computed alone
 * (the one-tile walk, which test_linears checks against the twin), and rows 0 and 63 are within
 * LINEAR_BOUND of the twin. */
static void test_head_rows(void **state)
{
    static const int batches_wide[] = { 9, 17, 64 };
    const int64_t out = 129280, in = 4096;
    const int bmax = 64;
    struct pair W;
    float *x = malloc(sizeof(float) * bmax * in), *row = malloc(sizeof(float) * in);
    float *ref = malloc(sizeof(float) * 2 * out);

    (void)state;
    ws_open();
    make_linear(&W, DSV4_W_BF16, out, in);
    fill_activations(x, (size_t)bmax * in);
    for (int64_t r = 0; r < out; r++) {
        dsv4_twin_linear_row(&W.h, r, row);
        for (int j = 0; j < 2; j++) {
            const float *xb = x + (size_t)(j ? bmax - 1 : 0) * in;
            double acc = 0.0;
            for (int64_t k = 0; k < in; k++)
                acc += (double)row[k] * xb[k];
            ref[(size_t)j * out + r] = (float)acc;
        }
    }
    float *dx = gt_dev_copy(x, sizeof(float) * bmax * in), *dalone = gt_dev_poisoned((size_t)bmax * out);
    for (int b = 0; b < bmax; b++)
        DSV4_OK(dsv4_cuda_gemm(&W.d, dx + (size_t)b * in, in, 1, false, &gemm_ws, dalone + (size_t)b * out, out, NULL));
    for (size_t i = 0; i < sizeof(batches_wide) / sizeof(batches_wide[0]); i++) {
        const int B = batches_wide[i];
        char what[96];
        float *dy = gt_dev_poisoned((size_t)B * out);
        DSV4_OK(dsv4_cuda_gemm(&W.d, dx, in, B, false, &gemm_ws, dy, out, NULL));
        snprintf(what, sizeof(what), "bf16 head [129280,4096], %d rows against each alone", B);
        gt_assert_same(what, dy, dalone, (size_t)B * out);
        if (B == bmax) {
            float *y = gt_host_from(dy, (size_t)B * out);
            ASSERT_REL("bf16 head, 64 rows: row 0 against the twin", y, ref, (size_t)out, LINEAR_BOUND);
            ASSERT_REL("bf16 head, 64 rows: row 63 against the twin", y + (size_t)63 * out, ref + out, (size_t)out,
                       LINEAR_BOUND);
            free(y);
        }
        cudaFree(dy);
    }
    cudaFree(dx); cudaFree(dalone);
    free(x); free(row); free(ref);
    free_linear(&W);
    ws_close();
}

/* Results left pending (dsv4_cuda_gemm_deferred, as decode steps chain their linears): at 1, 5 and 64
 * rows the partials reduced by dsv4_cuda_pending_flush are the plain call's y bit for bit, for FP8
 * with quantized x (wq_a [1024, 4096], 16 splits), BF16 (the gate [256, 4096]) and the grouped FP8
 * raw-x form; the deferred call writes nothing to y. A linear whose x is pending and the fused norm +
 * preparation reading a pending x give what they give on the reduced x, bit for bit. A pending result
 * read at another shape is refused (-EINVAL), and once the second split linear after it has reused
 * its buffer every reader refuses it (-EFAULT). */
static void check_deferred(const char *what, const struct dsv4_cuda_linear *W, int groups, bool q, int B)
{
    const int64_t k = W->in * groups;
    float *x = malloc(sizeof(float) * B * k);
    fill_activations(x, (size_t)B * k);
    float *dx = gt_dev_copy(x, sizeof(float) * B * k), *dy_ref = gt_dev_poisoned((size_t)B * W->out);
    float *dy = gt_dev_poisoned((size_t)B * W->out), *dsum = gt_dev_poisoned((size_t)B * W->out);
    struct dsv4_cuda_pending p;
    char line[128];

    if (groups > 1) {
        DSV4_OK(dsv4_cuda_gemm_grouped(W, groups, dx, k, B, &gemm_ws, dy_ref, W->out, NULL));
        DSV4_OK(dsv4_cuda_gemm_grouped_deferred(W, groups, dx, k, B, &gemm_ws, dy, W->out, &p, NULL));
    } else {
        DSV4_OK(dsv4_cuda_gemm(W, dx, k, B, q, &gemm_ws, dy_ref, W->out, NULL));
        DSV4_OK(dsv4_cuda_gemm_deferred(W, dx, NULL, k, B, q, false, &gemm_ws, dy, W->out, &p, NULL));
    }
    assert_true(p.splits > 1);
    float *untouched = gt_host_from(dy, (size_t)B * W->out);
    for (int64_t i = 0; i < B * W->out; i++)
        if (!isnan(untouched[i]))
            fail_msg("%s, %d rows: the deferred call wrote y[%lld]", what, B, (long long)i);
    DSV4_OK(dsv4_cuda_pending_flush(&p, dsum, W->out, NULL));
    snprintf(line, sizeof(line), "pending %s, %d rows (%d splits)", what, B, p.splits);
    gt_assert_same(line, dsum, dy_ref, (size_t)B * W->out);
    free(x); free(untouched);
    cudaFree(dx); cudaFree(dy_ref); cudaFree(dy); cudaFree(dsum);
}

static void test_pending(void **state)
{
    static const int rows[] = { 1, 5, 64 };
    const int64_t in = 4096, mid = 1024, out = 4096;
    const float eps = 1e-6f;
    struct pair A, Bw, G, O;

    (void)state;
    ws_open();
    make_linear(&A, DSV4_W_FP8, mid, in);       /* wq_a: 16 splits */
    make_linear(&Bw, DSV4_W_FP8, out, mid);     /* reads A's result: 4 splits */
    make_linear(&G, DSV4_W_BF16, 256, in);      /* the gate */
    make_linear(&O, DSV4_W_FP8, 256, 512);      /* wo_a's form: 2 groups of 128 rows */
    for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
        const int B = rows[r];
        check_deferred("fp8 [1024,4096] quantized x", &A.d, 1, true, B);
        check_deferred("bf16 [256,4096]", &G.d, 1, false, B);
        check_deferred("fp8 raw x, 2 groups [256,2x512]", &O.d, 2, false, B);

        /* the chain: A's result pending, read by B's preparation and by the fused norm */
        float *x = malloc(sizeof(float) * B * in), *nw = malloc(sizeof(float) * mid);
        fill_activations(x, (size_t)B * in);
        gt_fill_normal(nw, (size_t)mid, 0.1f);
        for (int64_t i = 0; i < mid; i++)
            nw[i] += 1.0f;
        float *dx = gt_dev_copy(x, sizeof(float) * B * in), *dw = gt_dev_copy(nw, sizeof(float) * mid);
        float *da_ref = gt_dev_poisoned((size_t)B * mid), *da = gt_dev_poisoned((size_t)B * mid);
        float *db_ref = gt_dev_poisoned((size_t)B * out), *db = gt_dev_poisoned((size_t)B * out);
        float *dn_ref = gt_dev_poisoned((size_t)B * mid), *dn = gt_dev_poisoned((size_t)B * mid);
        float *dc_ref = gt_dev_poisoned((size_t)B * out), *dc = gt_dev_poisoned((size_t)B * out);
        struct dsv4_cuda_pending p, pb;

        DSV4_OK(dsv4_cuda_gemm(&A.d, dx, in, B, true, &gemm_ws, da_ref, mid, NULL));
        DSV4_OK(dsv4_cuda_gemm(&Bw.d, da_ref, mid, B, true, &gemm_ws, db_ref, out, NULL));
        DSV4_OK(dsv4_cuda_gemm_norm(&Bw.d, true, da_ref, NULL, dw, B, eps, &gemm_ws, dn_ref, NULL));
        DSV4_OK(dsv4_cuda_gemm_same_x(&Bw.d, dn_ref, mid, B, true, &gemm_ws, dc_ref, out, NULL));

        DSV4_OK(dsv4_cuda_gemm_deferred(&A.d, dx, NULL, in, B, true, false, &gemm_ws, da, mid, &p, NULL));
        assert_int_equal(dsv4_cuda_pending_live(&p, B + 1, mid, "test"), -EINVAL);
        DSV4_OK(dsv4_cuda_gemm_deferred(&Bw.d, da, &p, mid, B, true, false, &gemm_ws, db, out, &pb, NULL));
        assert_true(pb.splits > 1);
        DSV4_OK(dsv4_cuda_pending_live(&p, B, mid, "test"));        /* one linear since: still there */
        DSV4_OK(dsv4_cuda_gemm_norm(&Bw.d, true, da, &p, dw, B, eps, &gemm_ws, dn, NULL));
        DSV4_OK(dsv4_cuda_pending_flush(&pb, db, out, NULL));
        DSV4_OK(dsv4_cuda_gemm_same_x(&Bw.d, dn, mid, B, true, &gemm_ws, dc, out, NULL));
        gt_assert_same("pending x: the linear reading it", db, db_ref, (size_t)B * out);
        gt_assert_same("pending x: fused norm's rows", dn, dn_ref, (size_t)B * mid);
        gt_assert_same("pending x: fused norm's linear", dc, dc_ref, (size_t)B * out);

        /* B's deferred call and the same_x call have reused both buffers since A wrote its partials */
        assert_int_equal(dsv4_cuda_pending_live(&p, B, mid, "test"), -EFAULT);
        assert_int_equal(dsv4_cuda_pending_flush(&p, da, mid, NULL), -EFAULT);
        assert_int_equal(dsv4_cuda_gemm_deferred(&Bw.d, da, &p, mid, B, true, false, &gemm_ws, db, out, NULL, NULL),
                         -EFAULT);
        assert_int_equal(dsv4_cuda_gemm_norm(&Bw.d, true, da, &p, dw, B, eps, &gemm_ws, dn, NULL), -EFAULT);
        free(x); free(nw);
        cudaFree(dx); cudaFree(dw); cudaFree(da_ref); cudaFree(da); cudaFree(db_ref); cudaFree(db);
        cudaFree(dn_ref); cudaFree(dn); cudaFree(dc_ref); cudaFree(dc);
    }
    free_linear(&A); free_linear(&Bw); free_linear(&G); free_linear(&O);
    ws_close();
}

/* A strided view (a stacked transformers expert) is refused when misaligned, never misread. */
static void test_refuses_misaligned(void **state)
{
    struct dsv4_cuda_linear W = { .fmt = DSV4_W_BF16, .out = 4, .in = 12, .row_stride = 12 };
    float *dx = gt_dev_poisoned(16), *dy = gt_dev_poisoned(4);
    W.w = dx;
    assert_int_equal(dsv4_cuda_gemv(&W, dx, 12, 1, dy, 4, NULL), -EINVAL);
    W.fmt = DSV4_W_F16;
    W.in = W.row_stride = 16;
    assert_int_equal(dsv4_cuda_gemv(&W, dx, 16, 1, dy, 4, NULL), -ENOTSUP);
    cudaFree(dx);
    cudaFree(dy);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp8_roundtrip),
        cmocka_unit_test(test_linears),
        cmocka_unit_test(test_wo_a_grouped),
        cmocka_unit_test(test_short_ring),
        cmocka_unit_test(test_direct_rows),
        cmocka_unit_test(test_fp8_view_mid_block),
        cmocka_unit_test(test_same_x),
        cmocka_unit_test(test_prefill_rows),
        cmocka_unit_test(test_decode_rows),
        cmocka_unit_test(test_norm_prep),
        cmocka_unit_test(test_pending),
        cmocka_unit_test(test_head_rows),
        cmocka_unit_test(test_refuses_misaligned),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
