/* SPDX-License-Identifier: MIT */
/* CPU twins of the CUDA kernels: scalar, exact number formats, fp32 math. cpu_twin_cuda.h says which
 * kernel each one checks. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_twin_cuda.h"

#define TWIN_FP8_BLOCK 128      /* FP8 weight scale block, both axes */
#define TWIN_FP4_BLOCK 32       /* FP4 weight scale block along K */
#define TWIN_AMAX_FLOOR 1e-4f   /* official activation quantizer */

static float bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint32_t f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

float dsv4_twin_e4m3_to_f32(uint8_t v)
{
    int sign = v >> 7, exp = (v >> 3) & 15, man = v & 7;
    float mag;
    if (exp == 15 && man == 7)
        return NAN;
    if (exp == 0)
        mag = ldexpf((float)man, -9);               /* subnormal: man/8 * 2^-6 */
    else
        mag = ldexpf(1.0f + man / 8.0f, exp - 7);
    return sign ? -mag : mag;
}

/* Round |f| to the grid of a minifloat with `man_bits` mantissa bits, minimum normal exponent
 * emin, saturating at fmax; nearest even through rintf in the default rounding mode. */
static float round_minifloat(float a, int man_bits, int emin, float fmax)
{
    int e;
    float q;
    if (!(a < fmax))
        return fmax;
    frexpf(a, &e);                  /* a = m * 2^e, m in [0.5, 1) */
    e -= 1;                         /* a = 1.x * 2^e */
    if (e < emin)
        e = emin;
    q = ldexpf(1.0f, e - man_bits);
    a = rintf(a / q) * q;
    return a > fmax ? fmax : a;
}

uint8_t dsv4_twin_f32_to_e4m3(float f)
{
    uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = round_minifloat(fabsf(f), 3, -6, DSV4_TWIN_E4M3_MAX);
    int e;
    if (isnan(f))
        return 0x7f;
    if (a == 0.0f)
        return sign;
    frexpf(a, &e);
    e -= 1;
    if (e < -6)
        return sign | (uint8_t)lrintf(ldexpf(a, 9));            /* subnormal */
    return sign | (uint8_t)((e + 7) << 3) | (uint8_t)lrintf((ldexpf(a, -e) - 1.0f) * 8.0f);
}

float dsv4_twin_e2m1_to_f32(uint8_t nibble)
{
    static const float mag[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
    float v = mag[nibble & 7];
    return (nibble & 8) ? -v : v;
}

uint8_t dsv4_twin_f32_to_e2m1(float f)
{
    float a = round_minifloat(fabsf(f), 1, 0, DSV4_TWIN_E2M1_MAX);
    uint8_t code = 0;
    for (uint8_t c = 0; c < 8; c++)
        if (dsv4_twin_e2m1_to_f32(c) == a)
            code = c;
    return (uint8_t)((signbit(f) ? 8 : 0) | code);
}

float dsv4_twin_bf16_to_f32(uint16_t v)
{
    return bits_to_f32((uint32_t)v << 16);
}

uint16_t dsv4_twin_f32_to_bf16(float f)
{
    uint32_t u = f32_to_bits(f);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

uint8_t dsv4_twin_ue8m0_for(float amax, float fmt_max)
{
    float s = fmaxf(amax, TWIN_AMAX_FLOOR) / fmt_max;
    uint32_t u = f32_to_bits(s);
    int exp = (int)((u >> 23) & 0xff);
    if (u & 0x7fffff)
        exp++;                      /* not a power of two: round up */
    return (uint8_t)exp;
}

void dsv4_twin_fp8_roundtrip(float *x, size_t n, size_t block)
{
    for (size_t b = 0; b < n; b += block) {
        const size_t len = n - b < block ? n - b : block;   /* a short last group stands alone */
        float amax = 0.0f, s;
        for (size_t i = 0; i < len; i++)
            amax = fmaxf(amax, fabsf(x[b + i]));
        s = ldexpf(1.0f, (int)dsv4_twin_ue8m0_for(amax, DSV4_TWIN_E4M3_MAX) - 127);
        for (size_t i = 0; i < len; i++)
            x[b + i] = dsv4_twin_e4m3_to_f32(dsv4_twin_f32_to_e4m3(x[b + i] / s)) * s;
    }
}

static float weight_at(const struct dsv4_linear *W, int64_t r, int64_t k)
{
    switch (W->fmt) {
    case DSV4_W_F32:
        return ((const float *)W->w)[r * W->row_stride + k];
    case DSV4_W_BF16:
        return dsv4_twin_bf16_to_f32(((const uint16_t *)W->w)[r * W->row_stride + k]);
    case DSV4_W_F16:
        return NAN;                 /* no F16 linears in either release; the kernels refuse them too */
    case DSV4_W_FP8: {
        uint8_t q = ((const uint8_t *)W->w)[r * W->row_stride + k];
        uint8_t s = W->scale[(r / TWIN_FP8_BLOCK) * W->scale_stride + k / TWIN_FP8_BLOCK];
        return ldexpf(dsv4_twin_e4m3_to_f32(q), (int)s - 127);
    }
    case DSV4_W_FP4: {
        uint8_t byte = ((const uint8_t *)W->w)[(r * W->row_stride + k) / 2];
        uint8_t s = W->scale[r * W->scale_stride + k / TWIN_FP4_BLOCK];
        return ldexpf(dsv4_twin_e2m1_to_f32((k & 1) ? byte >> 4 : byte & 15), (int)s - 127);
    }
    }
    return NAN;
}

void dsv4_twin_linear_row(const struct dsv4_linear *W, int64_t r, float *out)
{
    for (int64_t k = 0; k < W->in; k++)
        out[k] = weight_at(W, r, k);
}

void dsv4_twin_linear_matvec(const struct dsv4_linear *W, const float *x, float *y)
{
    for (int64_t r = 0; r < W->out; r++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < W->in; k++)
            acc += weight_at(W, r, k) * x[k];
        y[r] = acc;
    }
}

void dsv4_twin_rmsnorm(const float *x, const float *w, int n, float eps, float *y)
{
    double ss = 0.0;
    float r;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        y[i] = (w ? w[i] : 1.0f) * (x[i] * r);
}

static float sqrt_softplus(float l)
{
    /* softplus(l) = log(1 + e^l), computed without overflow for large l */
    float sp = l > 20.0f ? l : log1pf(expf(l));
    return sqrtf(sp);
}

void dsv4_twin_router(const float *logits, int n_experts, int topk, const float *bias,
                      const int32_t *tid2eid_row, float route_scale, int32_t *idx, float *w)
{
    float sum = 0.0f;
    for (int j = 0; j < topk; j++) {
        if (tid2eid_row) {
            idx[j] = tid2eid_row[j];
            continue;
        }
        int best = -1;
        float best_v = -INFINITY;
        for (int e = 0; e < n_experts; e++) {
            float v = sqrt_softplus(logits[e]) + (bias ? bias[e] : 0.0f);
            int taken = 0;
            for (int i = 0; i < j; i++)
                taken |= idx[i] == e;
            if (!taken && (best < 0 || v > best_v)) {
                best = e;
                best_v = v;
            }
        }
        idx[j] = best;
    }
    for (int j = 0; j < topk; j++) {
        w[j] = sqrt_softplus(logits[idx[j]]);
        sum += w[j];
    }
    for (int j = 0; j < topk; j++)
        w[j] = w[j] / (sum + 1e-20f) * route_scale;
}

static float silu(float v)
{
    return v / (1.0f + expf(-v));
}

void dsv4_twin_expert(const struct dsv4_linear *w1, const struct dsv4_linear *w3,
                      const struct dsv4_linear *w2, const float *x, float limit, float *y)
{
    int64_t n = w1->out;
    float g[n], u[n];               /* moe_inter values: 2048 (Flash), 3072 (Pro) */
    dsv4_twin_linear_matvec(w1, x, g);
    dsv4_twin_linear_matvec(w3, x, u);
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], ui = u[i];
        if (limit > 0.0f) {
            gi = fminf(gi, limit);
            ui = fminf(fmaxf(ui, -limit), limit);
        }
        g[i] = silu(gi) * ui;
    }
    dsv4_twin_fp8_roundtrip(g, (size_t)n, TWIN_FP8_BLOCK);
    dsv4_twin_linear_matvec(w2, g, y);
}

void dsv4_twin_ep_mask(int32_t *idx, int n, int e0, int e1)
{
    for (int i = 0; i < n; i++)
        if (idx[i] < e0 || idx[i] >= e1)
            idx[i] = -1;
}

void dsv4_twin_ep_select(float *g, const int32_t *idx, int ranks, const int *e1, int pairs, int64_t dim)
{
    for (int p = 0; p < pairs; p++) {
        int r = 0;
        while (r + 1 < ranks && idx[p] >= e1[r])
            r++;
        if (r)
            memcpy(g + (int64_t)p * dim, g + ((int64_t)r * pairs + p) * dim, sizeof(float) * (size_t)dim);
    }
}

static float sigmoid(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

void dsv4_twin_mhc_pre(const float *X, const float *m, const float *base, const float *scale,
                       int hc, int dim, int iters, float hc_eps, float norm_eps,
                       float *y, float *post, float *comb)
{
    double ss = 0.0;
    float r, pre[hc];               /* hc <= DSV4_MAX_HC */
    for (int i = 0; i < hc * dim; i++)
        ss += (double)X[i] * X[i];
    r = 1.0f / sqrtf((float)(ss / (hc * dim)) + norm_eps);
    for (int j = 0; j < hc; j++) {
        pre[j] = sigmoid(m[j] * r * scale[0] + base[j]) + hc_eps;
        post[j] = 2.0f * sigmoid(m[hc + j] * r * scale[1] + base[hc + j]);
    }
    for (int j = 0; j < hc; j++) {              /* softmax along each row */
        float *row = comb + j * hc, mx = -INFINITY, sum = 0.0f;
        for (int k = 0; k < hc; k++) {
            row[k] = m[2 * hc + j * hc + k] * r * scale[2] + base[2 * hc + j * hc + k];
            mx = fmaxf(mx, row[k]);
        }
        for (int k = 0; k < hc; k++) {
            row[k] = expf(row[k] - mx);
            sum += row[k];
        }
        for (int k = 0; k < hc; k++)
            row[k] = row[k] / sum + hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int j = 0; j < hc; j++) {      /* rows */
                float s = 0.0f;
                for (int k = 0; k < hc; k++)
                    s += comb[j * hc + k];
                for (int k = 0; k < hc; k++)
                    comb[j * hc + k] /= s + hc_eps;
            }
        }
        for (int k = 0; k < hc; k++) {          /* columns */
            float s = 0.0f;
            for (int j = 0; j < hc; j++)
                s += comb[j * hc + k];
            for (int j = 0; j < hc; j++)
                comb[j * hc + k] /= s + hc_eps;
        }
    }
    for (int d = 0; d < dim; d++) {
        float acc = 0.0f;
        for (int j = 0; j < hc; j++)
            acc += pre[j] * X[j * dim + d];
        y[d] = acc;
    }
}

void dsv4_twin_mhc_post(const float *X, const float *f, const float *post, const float *comb,
                        int hc, int dim, float *Xo)
{
    for (int k = 0; k < hc; k++)
        for (int d = 0; d < dim; d++) {
            float acc = post[k] * f[d];
            for (int j = 0; j < hc; j++)
                acc += comb[j * hc + k] * X[j * dim + d];
            Xo[k * dim + d] = acc;
        }
}
