/* SPDX-License-Identifier: MIT */
/* Manifold-constrained hyper-connections (mHC): hc residual streams collapsed into one sublayer
 * input by `pre`, and rebuilt from the sublayer output by `post` and the doubly-stochastic `comb`. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"

/* flat = X / rms(X) over all hc*D values (transformers normalizes before the fn projection;
 * the official code applies the same scaling after it: doc/MODEL.md §4.3). */
static void hc_mixes(const struct dsv4_cpu_ctx *c, const struct dsv4_linear *fn, const float *X,
                     float *mix)
{
    struct dsv4_cpu_work *wk = c->wk;
    int n = c->cfg->hc_mult * c->cfg->dim;
    dsv4_cpu_rmsnorm(wk->flat, X, NULL, n, c->cfg->rms_norm_eps);
    dsv4_cpu_linear_rows(c, fn, 0, fn->out, wk->flat, mix, true);
}

void dsv4_cpu_hc_pre(const struct dsv4_cpu_ctx *c, const struct dsv4_hc *hc)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    int n = cfg->hc_mult, D = cfg->dim;
    float eps = (float)cfg->hc_eps;
    float *mix = wk->mix, *comb = wk->comb;

    hc_mixes(c, &hc->fn, wk->X, mix);
    for (int j = 0; j < n; j++) {
        wk->pre[j] = dsv4_cpu_sigmoid(mix[j] * hc->scale[0] + hc->base[j]) + eps;
        wk->post[j] = 2.0f * dsv4_cpu_sigmoid(mix[n + j] * hc->scale[1] + hc->base[n + j]);
    }
    /* comb [j, k]: softmax over k, + eps, then Sinkhorn: columns first, then (iters-1) times rows
     * and columns, each divided by (sum + eps); the first column pass happens even with 0 iters. */
    for (int j = 0; j < n; j++) {
        float *row = comb + j * n;
        float m = -INFINITY;
        for (int k = 0; k < n; k++) {
            row[k] = mix[2 * n + j * n + k] * hc->scale[2] + hc->base[2 * n + j * n + k];
            m = fmaxf(m, row[k]);
        }
        float s = 0.0f;
        for (int k = 0; k < n; k++) {
            row[k] = expf(row[k] - m);
            s += row[k];
        }
        for (int k = 0; k < n; k++)
            row[k] = row[k] / s + eps;
    }
    int iters = cfg->hc_sinkhorn_iters > 0 ? cfg->hc_sinkhorn_iters : 1;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int j = 0; j < n; j++) {
                float s = 0.0f;
                for (int k = 0; k < n; k++)
                    s += comb[j * n + k];
                for (int k = 0; k < n; k++)
                    comb[j * n + k] /= s + eps;
            }
        }
        for (int k = 0; k < n; k++) {
            float s = 0.0f;
            for (int j = 0; j < n; j++)
                s += comb[j * n + k];
            for (int j = 0; j < n; j++)
                comb[j * n + k] /= s + eps;
        }
    }
    for (int d = 0; d < D; d++) {
        float s = 0.0f;
        for (int j = 0; j < n; j++)
            s += wk->pre[j] * wk->X[j * D + d];
        wk->y[d] = s;
    }
}

void dsv4_cpu_hc_post(const struct dsv4_cpu_ctx *c, const float *out)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    int n = cfg->hc_mult, D = cfg->dim;
    for (int k = 0; k < n; k++) {
        for (int d = 0; d < D; d++) {
            float s = 0.0f;
            for (int j = 0; j < n; j++)
                s += wk->comb[j * n + k] * wk->X[j * D + d];
            wk->X2[k * D + d] = wk->post[k] * out[d] + s;
        }
    }
    memcpy(wk->X, wk->X2, (size_t)n * D * sizeof(float));
}

void dsv4_cpu_hc_head(const struct dsv4_cpu_ctx *c, const struct dsv4_hc_head *hh, const float *X,
                      float *y)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    int n = cfg->hc_mult, D = cfg->dim;
    hc_mixes(c, &hh->fn, X, wk->mix);
    for (int j = 0; j < n; j++)
        wk->pre[j] = dsv4_cpu_sigmoid(wk->mix[j] * hh->scale[0] + hh->base[j]) + (float)cfg->hc_eps;
    for (int d = 0; d < D; d++) {
        float s = 0.0f;
        for (int j = 0; j < n; j++)
            s += wk->pre[j] * X[j * D + d];
        y[d] = s;
    }
}
