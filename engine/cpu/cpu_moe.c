/* SPDX-License-Identifier: MIT */
/* The MoE sublayer: router (hash table or scored top-k), routed experts and the shared expert.
 *
 *   s = sqrt(softplus(gate x))                      [E]
 *   hash layers: idx = tid2eid[token]; scored: idx = top-k of (s + bias)  (the bias only selects)
 *   w = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
 *   expert(x) = w2( silu(min(w1 x, L)) * clamp(w3 x, -L, L) ),  L = swiglu_limit
 *   out = sum_e w_e expert_e(x) + shared(x)          (the shared expert clamps the same way)
 *
 * transformers normalizes the selected weights whatever norm_topk_prob says (both releases set
 * it true); this follows transformers. swiglu_limit 0 means no clamp here, where transformers
 * would clamp at 0; no config uses 0.
 *
 * The pieces are separate so that the routed experts can be split across GPUs by expert range
 * (doc/MULTIGPU.md): routing on the token's own GPU, each expert on the GPU that holds it, and the
 * combine back on the token's GPU, in the same order as here. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"

static float softplus(float x)
{
    /* torch's softplus returns x itself above its threshold of 20 */
    return x > 20.0f ? x : log1pf(expf(x));
}

/* y[D] = w2( silu(min(w1 x, L)) * clamp(w3 x, -L, L) ) */
static void swiglu(const struct dsv4_cpu_ctx *c, const struct dsv4_linear *w1,
                   const struct dsv4_linear *w3, const struct dsv4_linear *w2, const float *x, float *y)
{
    struct dsv4_cpu_work *wk = c->wk;
    float L = (float)c->cfg->swiglu_limit;
    int n = (int)w1->out;
    dsv4_cpu_linear(c, w1, x, wk->h1);
    dsv4_cpu_linear(c, w3, x, wk->h3);
    for (int i = 0; i < n; i++) {
        float g = wk->h1[i], u = wk->h3[i];
        if (L > 0.0f) {
            g = fminf(g, L);
            u = fminf(fmaxf(u, -L), L);
        }
        wk->h1[i] = dsv4_cpu_silu(g) * u;
    }
    dsv4_cpu_linear(c, w2, wk->h1, y);
}

void dsv4_cpu_moe_route(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn, int32_t token,
                        int *idx, float *wt)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    int E = cfg->n_experts, K = cfg->n_experts_per_tok;

    dsv4_cpu_linear(c, &ffn->gate, xn, wk->router);
    for (int e = 0; e < E; e++)
        wk->router[e] = sqrtf(softplus(wk->router[e]));

    if (ffn->type == DSV4_MLP_HASH) {
        for (int k = 0; k < K; k++)
            idx[k] = ffn->tid2eid[(size_t)token * K + k];
    } else {
        /* Top-k by score + bias; ties keep the lower expert. */
        for (int e = 0; e < E; e++)
            wk->rsel[e] = wk->router[e] + (ffn->gate_bias ? ffn->gate_bias[e] : 0.0f);
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (wk->rsel[e] != -INFINITY && (best < 0 || wk->rsel[e] > wk->rsel[best]))
                    best = e;
            idx[k] = best;
            wk->rsel[best] = -INFINITY;
        }
    }
    float sum = 0.0f;
    for (int k = 0; k < K; k++) {
        wt[k] = wk->router[idx[k]];
        sum += wt[k];
    }
    for (int k = 0; k < K; k++)
        wt[k] = wt[k] / (sum + 1e-20f) * (float)cfg->routed_scaling_factor;
    for (int k = 0; c->route_counts && k < K; k++)
        c->route_counts[idx[k]]++;
}

void dsv4_cpu_moe_experts(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn,
                          const int *idx, int e0, int e1, float *rows)
{
    const int K = c->cfg->n_experts_per_tok, D = c->cfg->dim;
    for (int k = 0; k < K; k++)
        if (idx[k] >= e0 && idx[k] < e1)
            swiglu(c, &ffn->w1[idx[k]], &ffn->w3[idx[k]], &ffn->w2[idx[k]], xn, rows + (size_t)k * D);
}

void dsv4_cpu_moe_combine(const struct dsv4_config *cfg, const int *idx, const float *wt, const float *rows,
                          int e0, int e1, float *out)
{
    const int K = cfg->n_experts_per_tok, D = cfg->dim;
    /* transformers adds the experts' outputs in ascending expert order (a slot repeated in a hash
     * table counts twice), then the shared expert. */
    memset(out, 0, (size_t)D * sizeof(float));
    for (int e = e0; e < e1; e++) {
        for (int k = 0; k < K; k++) {
            if (idx[k] != e)
                continue;
            const float *row = rows + (size_t)k * D;
            for (int d = 0; d < D; d++)
                out[d] += row[d] * wt[k];
        }
    }
}

void dsv4_cpu_moe_shared(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn, float *out)
{
    struct dsv4_cpu_work *wk = c->wk;
    swiglu(c, &ffn->sw1, &ffn->sw3, &ffn->sw2, xn, wk->eout);
    for (int d = 0; d < c->cfg->dim; d++)
        out[d] += wk->eout[d];
}

void dsv4_cpu_moe(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn,
                  int32_t token, float *out)
{
    const int E = c->cfg->n_experts;
    int idx[DSV4_MAX_TOPK];
    float wt[DSV4_MAX_TOPK];

    dsv4_cpu_moe_route(c, ffn, xn, token, idx, wt);
    dsv4_cpu_moe_experts(c, ffn, xn, idx, 0, E, c->wk->eout);
    dsv4_cpu_moe_combine(c->cfg, idx, wt, c->wk->eout, 0, E, out);
    dsv4_cpu_moe_shared(c, ffn, xn, out);
}
