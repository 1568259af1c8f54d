/* SPDX-License-Identifier: MIT */
/* dsv4-bench's floor (tools/dsv4-bench.c): the bytes a step of the CUDA backend must read at the
 * least, from the loaded weights' formats and the config. Header-only, so that the arithmetic is
 * tested without a GPU (tests/unit/test_bench_floor.c) while dsv4-bench is built with CUDA only. */
#ifndef DSV4_TOOLS_BENCH_FLOOR_H
#define DSV4_TOOLS_BENCH_FLOOR_H

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/weights.h"

/* A linear's weight and scale bytes in its stored format (UE8M0 scales: one byte each). */
static inline double dsv4_bench_linear_bytes(const struct dsv4_linear *l)
{
    switch (l->fmt) {
    case DSV4_W_F32: return (double)l->out * l->in * 4;
    case DSV4_W_BF16:
    case DSV4_W_F16: return (double)l->out * l->in * 2;
    case DSV4_W_FP8: return (double)l->out * l->in + (double)((l->out + 127) / 128) * l->scale_stride;
    case DSV4_W_FP4: return (double)l->out * l->in / 2 + (double)l->out * l->scale_stride;
    }
    return 0.0;
}

/* Weight bytes of one layer's linears (its small vectors, under 1 MB a layer, are left out). */
static inline double dsv4_bench_layer_bytes(const struct dsv4_config *c, const struct dsv4_layer *L)
{
    const struct dsv4_attn *a = &L->attn;
    const struct dsv4_ffn *f = &L->ffn;
    const bool comp = L->ratio > 0, index = comp && L->ratio == c->csa_ratio;
    const struct dsv4_linear *lin[] = {
        &L->hc_attn.fn, &L->hc_ffn.fn, &a->wq_a, &a->wq_b, &a->wkv, &a->wo_a, &a->wo_b, &f->gate, &f->sw1, &f->sw3,
        &f->sw2, comp ? &a->comp.wkv : NULL, comp ? &a->comp.wgate : NULL, index ? &a->indexer.wq_b : NULL,
        index ? &a->indexer.weights_proj : NULL, index ? &a->indexer.comp.wkv : NULL,
        index ? &a->indexer.comp.wgate : NULL,
    };
    double b = 0.0;
    for (size_t i = 0; i < sizeof(lin) / sizeof(lin[0]); i++)
        if (lin[i] && lin[i]->w)
            b += dsv4_bench_linear_bytes(lin[i]);
    for (int e = 0; f->w1 && e < c->n_experts; e++)
        b += dsv4_bench_linear_bytes(&f->w1[e]) + dsv4_bench_linear_bytes(&f->w3[e]) +
             dsv4_bench_linear_bytes(&f->w2[e]);
    return b;
}

/* The routed experts a step of `rows` rows reads in one layer under uniform routing: each row picks
 * k distinct of E, so an expert is missed by a row with probability 1 - k/E. */
static inline double dsv4_bench_distinct_experts(const struct dsv4_config *c, int rows)
{
    const double K = c->n_experts_per_tok, E = c->n_experts;
    return E * (1.0 - pow(1.0 - K / E, rows));
}

/* What every step reads apart from the routed experts (dense: everything but the routed experts, the
 * MTP block, which no decode step reads, the embedding and the hash layers' tid2eid tables, of which a
 * step reads a row per token), and one routed expert's bytes. */
struct dsv4_bench_floor {
    double dense;
    double expert;
    int hash_layers;            /* layers routed by tid2eid: an int32 row of k experts per token each */
};

static inline void dsv4_bench_floor_init(const struct dsv4_weights *w, struct dsv4_bench_floor *f)
{
    const struct dsv4_config *c = &w->cfg;
    double routed_all = 0.0, mtp = 0.0;
    f->expert = 0.0;
    f->hash_layers = 0;
    for (int l = 0; l < c->n_layers; l++)
        f->hash_layers += w->layers[l].ffn.tid2eid != NULL;
    for (int l = 0; l < c->n_layers; l++)
        for (int e = 0; e < c->n_experts; e++) {
            const double eb = dsv4_bench_linear_bytes(&w->layers[l].ffn.w1[e]) +
                              dsv4_bench_linear_bytes(&w->layers[l].ffn.w3[e]) +
                              dsv4_bench_linear_bytes(&w->layers[l].ffn.w2[e]);
            routed_all += eb;
            f->expert = eb;
        }
    for (int i = 0; i < w->n_mtp; i++)
        mtp += dsv4_bench_layer_bytes(c, &w->mtp[i].layer) + dsv4_bench_linear_bytes(&w->mtp[i].e_proj) +
               dsv4_bench_linear_bytes(&w->mtp[i].h_proj) + dsv4_bench_linear_bytes(&w->mtp[i].hc_head.fn);
    /* bytes_total has every tid2eid table (the MTP block's too, if it routes by hash) as the file
     * stores it, I32 or I64 */
    double tables = 0.0;
    for (size_t k = 0; k < dsv4_st_count(w->st); k++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(w->st, k);
        const size_t n = strlen(t->name);
        if (n >= 7 && strcmp(t->name + n - 7, "tid2eid") == 0)
            tables += (double)t->nbytes;
    }
    f->dense = (double)w->bytes_total - routed_all - dsv4_bench_linear_bytes(&w->embed) - mtp - tables;
}

/* A decode step of `rows` rows: the dense bytes, the experts they route to in every layer, and per
 * row its embedding row (bf16), its tid2eid rows and its f32 logits. */
static inline double dsv4_bench_step_bytes(const struct dsv4_config *c, const struct dsv4_bench_floor *f, int rows)
{
    return f->dense + c->n_layers * dsv4_bench_distinct_experts(c, rows) * f->expert +
           (double)rows * (c->dim * 2 + 4.0 * f->hash_layers * c->n_experts_per_tok + 4.0 * c->vocab_size);
}

/* The cache a row at position `context` reads in fp8 numerics (doc/MODEL.md 5.1, 5.2; the numerics
 * dsv4-bench runs): in every layer its window, and the complete compressed entries before it, all of
 * them in an HCA layer, in a CSA layer every indexer key and the index_topk entries they pick. */
static inline double dsv4_bench_cache_bytes(const struct dsv4_config *c, int context)
{
    const int nope = c->head_dim - c->rope_dim;
    /* e4m3 values, bf16 RoPE values, a UE8M0 byte per 64 e4m3 values, padded to 8 bytes */
    const double kv = (double)((nope + 2 * c->rope_dim + (nope + 63) / 64 + 7) / 8 * 8);
    /* e2m1 values two a byte, a UE8M0 byte per 32 */
    const double key = c->index_head_dim / 2 + (c->index_head_dim + 31) / 32;
    const int64_t pos = context;
    double b = 0.0;
    for (int l = 0; l < c->n_layers; l++) {
        const int r = c->compress_ratio[l];
        const int64_t n = r > 0 ? (pos + 1) / r : 0;
        b += (double)(pos + 1 < c->window ? pos + 1 : c->window) * kv;
        if (r == c->csa_ratio && r > 0)
            b += (double)(n < c->index_topk ? n : c->index_topk) * kv + (double)n * key;
        else if (r > 0)
            b += (double)n * kv;
    }
    return b;
}

/* A decode step of one row at a context of `context` tokens: the weights' bytes and the cache's. */
static inline double dsv4_bench_context_step_bytes(const struct dsv4_config *c, const struct dsv4_bench_floor *f,
                                                   int context)
{
    return dsv4_bench_step_bytes(c, f, 1) + dsv4_bench_cache_bytes(c, context);
}

#endif
