/* SPDX-License-Identifier: MIT */
/* Model weights: every tensor the config implies, located in the mapped checkpoint, checked for
 * dtype and shape, and kept in its checkpoint format (FP8/FP4 stay quantized; dequantized on use).
 * Both spellings load into the same structs: DeepSeek's release names and transformers' names
 * (its state_dict names, and the mix its save_pretrained writes: model.layers.i.attn.wq_a...). */
#ifndef DSV4_ENGINE_MODEL_WEIGHTS_H
#define DSV4_ENGINE_MODEL_WEIGHTS_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model/config.h"
#include "engine/model/safetensors.h"

enum dsv4_wfmt {
    DSV4_W_F32,
    DSV4_W_BF16,
    DSV4_W_F16,
    DSV4_W_FP8,     /* e4m3fn, UE8M0 scale per 128x128 block: scale [ceil(out/128), ceil(in/128)] */
    DSV4_W_FP4,     /* e2m1 two a byte (low nibble = even k), UE8M0 scale per 1x32: scale [out, in/32] */
};

/* A matrix [out, in] (y = W x). Row r of the matrix starts at element r * row_stride of `w`
 * (row_stride == in for contiguous tensors; stacked transformers experts use a view into one
 * 3-D tensor). FP8/FP4 are always contiguous. */
struct dsv4_linear {
    enum dsv4_wfmt fmt;
    int64_t out, in;
    int64_t row_stride;         /* in elements (FP4: in values, i.e. 2 per byte) */
    const void *w;
    const uint8_t *scale;       /* FP8/FP4 only, else NULL */
    int64_t scale_stride;       /* bytes between scale rows (FP8: ceil(in/128); FP4: in/32) */
    const char *name;           /* checkpoint name, for messages and stats */
};

/* Manifold-constrained hyper-connection site: fn [(2+hc)*hc, hc*D] f32, base [(2+hc)*hc], scale [3]. */
struct dsv4_hc {
    struct dsv4_linear fn;
    const float *base;
    const float *scale;
};

/* hc_head: fn [hc, hc*D], base [hc], scale [1]. */
struct dsv4_hc_head {
    struct dsv4_linear fn;
    const float *base;
    const float *scale;
};

struct dsv4_compressor {
    int ratio;                  /* 4 or 128 */
    int dim;                    /* entry width d: head_dim (main) or index_head_dim (indexer) */
    bool overlap;               /* ratio 4: wkv/wgate are 2d wide (Ca for the next block, Cb own) */
    struct dsv4_linear wkv;     /* [coff*d, D], coff = overlap ? 2 : 1 */
    struct dsv4_linear wgate;   /* [coff*d, D] */
    const float *ape;           /* [ratio, coff*d] position bias added to the gate */
    const float *norm;          /* [d] RMSNorm weight */
};

struct dsv4_indexer {
    struct dsv4_linear wq_b;         /* [index_n_heads*index_head_dim, q_lora_rank] */
    struct dsv4_linear weights_proj; /* [index_n_heads, D] */
    struct dsv4_compressor comp;     /* dim index_head_dim, overlapping (ratio 4) */
};

struct dsv4_attn {
    struct dsv4_linear wq_a;    /* [q_lora_rank, D] */
    const float *q_norm;        /* [q_lora_rank] */
    struct dsv4_linear wq_b;    /* [H*head_dim, q_lora_rank] */
    struct dsv4_linear wkv;     /* [head_dim, D] */
    const float *kv_norm;       /* [head_dim] */
    struct dsv4_linear wo_a;    /* [o_groups*o_lora_rank, H*head_dim/o_groups]: group g uses rows g*o_lora_rank.. */
    struct dsv4_linear wo_b;    /* [D, o_groups*o_lora_rank] */
    const float *sink;          /* [H] */
    struct dsv4_compressor comp;    /* valid when the layer's ratio > 0 */
    struct dsv4_indexer indexer;    /* valid when the layer's ratio == csa ratio */
};

struct dsv4_ffn {
    enum dsv4_mlp_type type;
    struct dsv4_linear gate;    /* [E, D] router */
    const float *gate_bias;     /* [E] selection bias (scored layers only; NULL for hash) */
    const int32_t *tid2eid;     /* [vocab, topk] (hash layers only) */
    struct dsv4_linear *w1;     /* [E] each [I, D]  gate */
    struct dsv4_linear *w3;     /* [E] each [I, D]  up */
    struct dsv4_linear *w2;     /* [E] each [D, I]  down */
    struct dsv4_linear sw1, sw3, sw2;   /* shared expert (n_shared_experts * I wide) */
};

struct dsv4_layer {
    int ratio;                  /* 0, csa ratio, hca ratio */
    const float *attn_norm;     /* [D] */
    const float *ffn_norm;      /* [D] */
    struct dsv4_hc hc_attn, hc_ffn;
    struct dsv4_attn attn;
    struct dsv4_ffn ffn;
};

/* The MTP block: one sliding-window layer plus its own projections, hc_head and norm. */
struct dsv4_mtp {
    const float *enorm, *hnorm; /* [D] */
    struct dsv4_linear e_proj, h_proj;  /* [D, D] */
    struct dsv4_layer layer;
    struct dsv4_hc_head hc_head;
    const float *norm;          /* [D] */
};

struct dsv4_weights {
    struct dsv4_config cfg;
    struct dsv4_st *st;                 /* owns the mappings */
    struct dsv4_linear embed;           /* [V, D] */
    struct dsv4_linear head;            /* [V, D] */
    const float *norm;                  /* [D] */
    struct dsv4_hc_head hc_head;
    struct dsv4_layer *layers;          /* [n_layers] */
    int n_mtp;                          /* 0 when the checkpoint carries no MTP weights */
    struct dsv4_mtp *mtp;               /* [n_mtp] */
    bool synthetic;                     /* generated from DIR/synthetic.json: random values (synth.h) */
    uint64_t bytes_quantized;           /* FP8+FP4 payload and scales, for stats */
    uint64_t bytes_total;
    /* Checkpoint tensors no part of the config uses (transformers ignores them too): non-zero
     * usually means config.json and the weights disagree, worth a warning. */
    uint64_t n_unused;
    const char *first_unused;           /* its name (owned by st), NULL when n_unused is 0 */
    void *owned;                        /* f32 copies of small vectors, freed with the weights */
};

/* Load DIR (config.json + safetensors): parse the config, map the shards, find and validate every
 * tensor the config implies (presence, dtype, shape; a message names the tensor and file). A DIR with
 * synthetic.json in place of shards gets random weights generated in memory instead (synth.h),
 * validated the same way. */
int dsv4_weights_load(const char *dir, struct dsv4_weights **ret);
void dsv4_weights_free(struct dsv4_weights *w);   /* accepts NULL */

/* Dequantize row r of W into out[W->in] (f32). */
void dsv4_linear_row(const struct dsv4_linear *W, int64_t r, float *out);
/* y[out] = W x[in], f32 accumulation (per scale block, then across), dequantizing on the fly. */
void dsv4_linear_matvec(const struct dsv4_linear *W, const float *x, float *y);

#endif
