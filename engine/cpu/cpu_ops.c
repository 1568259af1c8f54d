/* SPDX-License-Identifier: MIT */
/* Building blocks of the CPU reference forward pass: RMSNorm, linears over row ranges, activations. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/model/quant.h"

void dsv4_cpu_rmsnorm(float *y, const float *x, const float *w, int n, double eps)
{
    /* transformers: x * rsqrt(mean(x^2) + eps) in f32, then times the weight */
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / n) + (float)eps);
    for (int i = 0; i < n; i++) {
        float v = x[i] * r;
        y[i] = w ? w[i] * v : v;
    }
}

float dsv4_cpu_dot(const float *a, const float *b, int n)
{
    double s = 0.0;
    for (int i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return (float)s;
}

float dsv4_cpu_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

float dsv4_cpu_silu(float x)
{
    return x / (1.0f + expf(-x));
}

static size_t elem_bytes(enum dsv4_wfmt fmt)
{
    switch (fmt) {
    case DSV4_W_F32:
        return 4;
    case DSV4_W_BF16:
    case DSV4_W_F16:
        return 2;
    default:
        return 1;
    }
}

/* A view of rows [r0, r0+n) of W as a matrix of its own, when the storage allows one (FP8 block
 * scales cover 128 rows, so an FP8 view must start on a block boundary). */
static bool linear_view(const struct dsv4_linear *W, int64_t r0, int64_t n, struct dsv4_linear *v)
{
    *v = *W;
    v->out = n;
    switch (W->fmt) {
    case DSV4_W_F32:
    case DSV4_W_BF16:
    case DSV4_W_F16:
        v->w = (const uint8_t *)W->w + (size_t)(r0 * W->row_stride) * elem_bytes(W->fmt);
        return true;
    case DSV4_W_FP8:
        if (r0 % 128)
            return false;
        v->w = (const uint8_t *)W->w + (size_t)(r0 * W->row_stride);
        v->scale = W->scale + (size_t)(r0 / 128 * W->scale_stride);
        return true;
    case DSV4_W_FP4:
        v->w = (const uint8_t *)W->w + (size_t)(r0 * W->row_stride / 2);
        v->scale = W->scale + (size_t)(r0 * W->scale_stride);
        return true;
    }
    return false;
}

/* Rows [r0, r0+n) of W x into y, by a view when the storage allows one for the whole range (then
 * every sub-range of `align` rows allows one too), else row by row. Either way a row's arithmetic
 * does not depend on the range it is computed in. */
struct rows_job {
    const struct dsv4_linear *W;
    int64_t r0, nrows, align;
    bool view;
    const float *x;
    float *y;
    struct dsv4_cpu_pool *pool;
};

static void rows_range(const struct rows_job *j, int64_t a, int64_t b, float *row)
{
    struct dsv4_linear v;
    if (j->view) {
        linear_view(j->W, j->r0 + a, b - a, &v);
        dsv4_linear_matvec(&v, j->x, j->y + a);
        return;
    }
    for (int64_t r = a; r < b; r++) {
        dsv4_linear_row(j->W, j->r0 + r, row);
        j->y[r] = dsv4_cpu_dot(row, j->x, (int)j->W->in);
    }
}

static void rows_part(void *arg, int part, int nparts)
{
    const struct rows_job *j = arg;
    int64_t per = (j->nrows + nparts - 1) / nparts;
    per = (per + j->align - 1) / j->align * j->align;
    int64_t a = (int64_t)part * per, b = a + per < j->nrows ? a + per : j->nrows;
    if (a < b)
        rows_range(j, a, b, dsv4_cpu_pool_row(j->pool, part));
}

void dsv4_cpu_linear_rows(const struct dsv4_cpu_ctx *c, const struct dsv4_linear *W, int64_t r0,
                          int64_t nrows, const float *x, float *y, bool raw_act)
{
    struct dsv4_cpu_work *wk = c->wk;
    bool quantized = W->fmt == DSV4_W_FP8 || W->fmt == DSV4_W_FP4;
    if (c->num == DSV4_NUMERICS_FP8 && quantized && !raw_act) {
        memcpy(wk->act, x, (size_t)W->in * sizeof(float));
        dsv4_fp8_roundtrip(wk->act, (size_t)W->in, DSV4_CPU_ACT_BLOCK);
        x = wk->act;
    }
    struct dsv4_linear v;
    struct rows_job j = {.W = W, .r0 = r0, .nrows = nrows, .align = W->fmt == DSV4_W_FP8 ? 128 : 1,
                         .view = linear_view(W, r0, nrows, &v), .x = x, .y = y, .pool = c->pool};
    if (dsv4_cpu_pool_size(c->pool) > 1 && nrows * W->in >= DSV4_CPU_PAR_MIN && nrows > j.align)
        dsv4_cpu_pool_run(c->pool, rows_part, &j);
    else
        rows_range(&j, 0, nrows, wk->row);
}
