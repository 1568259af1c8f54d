/* SPDX-License-Identifier: MIT */
/* The attention sublayer: shared-KV MQA over the sliding window (the token itself included) plus,
 * in compressed layers, the compressed entries (HCA: all complete ones; CSA: those the indexer
 * picks), with a per-head sink, inverse RoPE on the output and the grouped output projection.
 *
 *   qr = q_norm(wq_a x);  q = wq_b qr -> [H, hd], each head RMSNormed without weight, RoPE on [-rd:]
 *   kv = kv_norm(wkv x) -> [hd], RoPE on [-rd:]; keys and values are the same vectors
 *   o_h = sum_t p_t k_t,  p = softmax over {scale * q_h . k_t} and the sink logit (which takes
 *         probability but contributes no value);  scale = hd^-0.5
 *   o_h[-rd:] = RoPE^-1(pos);  z_g = wo_a[g] concat(o of group g's heads);  out = wo_b z
 *
 * Sliding layers use the "main" RoPE frequencies; CSA/HCA layers use the "compress" ones for
 * q, kv and the output as well as for their compressors. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/model/quant.h"

/* Official numerics store the window and compressed entries as the FP8 cache holds them (doc/MODEL.md §5.2):
 * the non-RoPE part in e4m3 with a UE8M0 scale per 64 values, the RoPE part in bf16. */
static void round_kv(const struct dsv4_cpu_ctx *c, float *kv)
{
    if (c->num != DSV4_NUMERICS_FP8)
        return;
    int nope = dsv4_config_nope_dim(c->cfg);
    dsv4_fp8_roundtrip(kv, (size_t)nope, DSV4_CPU_KV_BLOCK);
    for (int i = nope; i < c->cfg->head_dim; i++)
        kv[i] = dsv4_bf16_to_f32(dsv4_f32_to_bf16(kv[i]));
}

/* Feed the compressors of a compressed layer and collect the entries the query at pos attends to
 * into wk->keys[*nk ...]. Entry i is visible once its block is complete: i < (pos+1)/ratio. */
static void compressed_keys(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *layer,
                            struct dsv4_cpu_layer_state *ls, const float *xn, int64_t pos, int *nk)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    int hd = cfg->head_dim, r = layer->ratio;
    int64_t entry = pos / r;

    if (dsv4_cpu_compressor_push(c, &layer->attn.comp, &ls->comp, xn, pos, wk->entry)) {
        round_kv(c, wk->entry);
        dsv4_cpu_undo_save(c->undo, ls->entries + entry * hd, (size_t)hd * sizeof(float));
        memcpy(ls->entries + entry * hd, wk->entry, (size_t)hd * sizeof(float));
    }
    int n_entries = (int)((pos + 1) / r);
    if (r != cfg->csa_ratio) {
        for (int i = 0; i < n_entries; i++)
            wk->keys[(*nk)++] = ls->entries + (size_t)i * hd;
        return;
    }

    int dI = cfg->index_head_dim;
    if (dsv4_cpu_compressor_push(c, &layer->attn.indexer.comp, &ls->index_comp, xn, pos, wk->entry)) {
        if (c->num == DSV4_NUMERICS_FP8) {
            dsv4_hadamard(wk->entry, (size_t)dI);
            dsv4_fp4_roundtrip(wk->entry, (size_t)dI, DSV4_CPU_FP4_BLOCK);
        }
        dsv4_cpu_undo_save(c->undo, ls->index_keys + entry * dI, (size_t)dI * sizeof(float));
        memcpy(ls->index_keys + entry * dI, wk->entry, (size_t)dI * sizeof(float));
    }
    int n = dsv4_cpu_indexer_select(c, layer, ls, xn, wk->qr, pos, n_entries);
    for (int i = 0; i < n; i++)
        wk->keys[(*nk)++] = ls->entries + (size_t)wk->isel[i] * hd;
}

void dsv4_cpu_attention(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *layer,
                        struct dsv4_cpu_layer_state *ls, const float *xn, int64_t pos, float *out)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    const struct dsv4_attn *a = &layer->attn;
    int H = cfg->n_heads, hd = cfg->head_dim, rd = cfg->rope_dim, W = cfg->window;
    const struct dsv4_cpu_rope *rope = layer->ratio ? &wk->rope_compress : &wk->rope_main;

    dsv4_cpu_linear(c, &a->wq_a, xn, wk->qr);
    dsv4_cpu_rmsnorm(wk->qr, wk->qr, a->q_norm, cfg->q_lora_rank, cfg->rms_norm_eps);
    dsv4_cpu_linear(c, &a->wq_b, wk->qr, wk->q);
    for (int h = 0; h < H; h++) {
        float *qh = wk->q + (size_t)h * hd;
        dsv4_cpu_rmsnorm(qh, qh, NULL, hd, cfg->rms_norm_eps);
        dsv4_cpu_rope_apply(rope, qh + hd - rd, pos, false);
    }

    dsv4_cpu_linear(c, &a->wkv, xn, wk->kv);
    dsv4_cpu_rmsnorm(wk->kv, wk->kv, a->kv_norm, hd, cfg->rms_norm_eps);
    dsv4_cpu_rope_apply(rope, wk->kv + hd - rd, pos, false);
    round_kv(c, wk->kv);
    /* The window is written before attending: the token sees itself. */
    dsv4_cpu_undo_save(c->undo, ls->window + (size_t)(pos % W) * hd, (size_t)hd * sizeof(float));
    memcpy(ls->window + (size_t)(pos % W) * hd, wk->kv, (size_t)hd * sizeof(float));

    /* Keys in transformers' order: the window oldest first, then the compressed entries. */
    int nk = 0;
    int64_t first = pos - W + 1 > ls->start ? pos - W + 1 : ls->start;
    for (int64_t t = first; t <= pos; t++)
        wk->keys[nk++] = ls->window + (size_t)(t % W) * hd;
    if (layer->ratio)
        compressed_keys(c, layer, ls, xn, pos, &nk);

    float scale = 1.0f / sqrtf((float)hd);
    for (int h = 0; h < H; h++) {
        const float *qh = wk->q + (size_t)h * hd;
        float *oh = wk->o + (size_t)h * hd;
        float m = a->sink[h];
        for (int t = 0; t < nk; t++) {
            wk->scores[t] = dsv4_cpu_dot(qh, wk->keys[t], hd) * scale;
            m = fmaxf(m, wk->scores[t]);
        }
        float den = expf(a->sink[h] - m);
        for (int t = 0; t < nk; t++) {
            wk->scores[t] = expf(wk->scores[t] - m);
            den += wk->scores[t];
        }
        memset(oh, 0, (size_t)hd * sizeof(float));
        for (int t = 0; t < nk; t++) {
            float p = wk->scores[t] / den;
            const float *k = wk->keys[t];
            for (int i = 0; i < hd; i++)
                oh[i] += p * k[i];
        }
        dsv4_cpu_rope_apply(rope, oh + hd - rd, pos, true);
    }

    /* Grouped output projection: group g maps heads [g*H/G, (g+1)*H/G) through rows
     * [g*o_lora_rank, (g+1)*o_lora_rank) of wo_a. The official code runs wo_a in BF16, so its
     * input is not quantized in fp8 numerics. */
    int G = cfg->o_groups, R = cfg->o_lora_rank;
    int64_t gin = (int64_t)H * hd / G;
    for (int g = 0; g < G; g++)
        dsv4_cpu_linear_rows(c, &a->wo_a, (int64_t)g * R, R, wk->o + g * gin, wk->z + (size_t)g * R, true);
    dsv4_cpu_linear(c, &a->wo_b, wk->z, out);
}
