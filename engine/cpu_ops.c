/* Building blocks of the CPU reference forward pass: RMSNorm, linears over row ranges, activations. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu_ops.h"
#include "engine/quant.h"

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
    if (r0 == 0 && nrows == W->out) {
        dsv4_linear_matvec(W, x, y);
    } else if (linear_view(W, r0, nrows, &v)) {
        dsv4_linear_matvec(&v, x, y);
    } else {
        for (int64_t r = 0; r < nrows; r++) {
            dsv4_linear_row(W, r0 + r, wk->row);
            y[r] = dsv4_cpu_dot(wk->row, x, (int)W->in);
        }
    }
}
