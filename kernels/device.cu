/* SPDX-License-Identifier: MIT */
/* Per-device state: one cudaMalloc carved into weights (checkpoint formats), per-slot caches and
 * workspaces; the compute stream, the cuBLASLt handle and its workspace; counters that prove no
 * allocation or capture happens after the device is sealed. Everything one GPU owns lives in
 * struct dsv4_cuda_dev so that several devices (expert parallelism) can follow.
 *
 * Routed experts that do not fit (engine/model/placement.h decides which) live in one pinned, mapped
 * host allocation made at boot. Their entries in the layer's expert table hold the device address of
 * those host bytes, so the same expert kernels read them in place over PCIe: the arithmetic is the
 * same wherever an expert lives, only the time to reach its bytes differs. */
#include <atomic>
#include <memory>
#include <new>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>

#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/prefix.h"
#include "kernels/switches.h"

#define DEV_VARIANTS_MAX 4096           /* bytes of the variant report */
#define DEV_LOG_LINE 512                /* bytes of one boot-log line (the longest names three kernels) */
#define DEV_GIB 1073741824.0

static std::atomic<uint64_t> launch_counts[DSV4_CUDA_V_COUNT];

void dsv4_cuda_count_launch(enum dsv4_cuda_variant v)
{
    launch_counts[v].fetch_add(1, std::memory_order_relaxed);
}

extern "C" uint64_t dsv4_cuda_variant_launches(enum dsv4_cuda_variant v)
{
    return (unsigned)v < DSV4_CUDA_V_COUNT ? launch_counts[v].load(std::memory_order_relaxed) : 0;
}

extern "C" const char *dsv4_cuda_variant_name(enum dsv4_cuda_variant v)
{
    switch (v) {
    case DSV4_CUDA_V_GEMV_F32: return "gemv_f32_warprow";
    case DSV4_CUDA_V_GEMV_BF16: return "gemv_bf16_warprow";
    case DSV4_CUDA_V_GEMV_FP8: return "gemv_fp8_b128_warprow";
    case DSV4_CUDA_V_GEMV_FP4: return "gemv_fp4_b32_warprow";
    case DSV4_CUDA_V_EXPERTS_FP4: return "experts_fp4_grouped_swiglu_bf16mma_rows64";
    case DSV4_CUDA_V_EXPERTS_OTHER: return "experts_grouped_swiglu_f32_bf16_fp8";
    case DSV4_CUDA_V_MHC_FN_SPLITK: return "mhc_fn_f32_splitk256_fixed_order";
    case DSV4_CUDA_V_MHC_PRE: return "mhc_pre_cols1024_per_token_sinkhorn_regs";
    case DSV4_CUDA_V_GEMM_FP8_MMA: return "gemm_fp8_f16mma_rows128_splitk_fixed_order";
    case DSV4_CUDA_V_GEMM_BF16_MMA: return "gemm_bf16_hilo_mma_rows128_splitk_fixed_order";
    case DSV4_CUDA_V_GEMM_FP8RAW_MMA: return "gemm_fp8_f16hilo_mma_rows128_splitk_fixed_order";
    case DSV4_CUDA_V_ATTENTION_MMA: return "attention_mma_bf16_hilo_heads64_keys64_split16";
    case DSV4_CUDA_V_ATTENTION_F32: return "attention_f32_fma_heads32_keys12_split16";
    case DSV4_CUDA_V_INDEXER_MMA: return "indexer_scores_fp4keys_bf16mma_entries1024";
    case DSV4_CUDA_V_INDEXER_FMA: return "indexer_scores_fma_thread_per_entry";
    case DSV4_CUDA_V_EXPERTS_FP4_FMA: return "experts_fp4_grouped_swiglu_fma_warprow";
    case DSV4_CUDA_V_GEMM_FP8_WGMMA: return "gemm_fp8_f16wgmma_tma_rows128x64_prefill";
    case DSV4_CUDA_V_ATTENTION_WHOLE: return "attention_mma_bf16_hilo_keys64_whole_row";
    case DSV4_CUDA_V_GEMM_DIRECT: return "gemm_mma_rows128_batch8_weights_in_registers";
    case DSV4_CUDA_V_GEMM_WGMMA_DECODE: return "gemm_fp8_bf16hilo_wgmma_tma_rows128_batch9to64_splitk";
    case DSV4_CUDA_V_EXPERTS_FP4_WGMMA: return "experts_fp4_grouped_swiglu_bf16wgmma_rows128_prefill_n8to64";
    case DSV4_CUDA_V_COUNT: break;
    }
    return "?";
}

struct dev_linear {
    const char *name;
    const void *host;           /* the checkpoint bytes it was uploaded from */
    struct dsv4_cuda_linear lin;
};

struct dev_vector {
    const void *host;
    void *dev;
};

struct dsv4_cuda_dev {
    int ordinal;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_workspace;
    uint8_t *arena;             /* the one allocation */
    size_t arena_size, arena_used;
    bool sealed;
    struct dsv4_cuda_dev_stats stats;
    struct dev_linear *linears;
    size_t n_linears, cap_linears;
    struct dev_vector *vectors;
    size_t n_vectors, cap_vectors;
    struct dsv4_cuda_experts *experts;  /* [n_layers]; d_table NULL when not FP4 */
    int n_layers, experts_per_layer;
    struct dsv4_placement *place;       /* where each routed expert lives */
    bool *layer_movable;        /* [n_layers] the layer's experts are in a table, so they may live on the host */
    bool embed_on_host;         /* the embedding lives in the host allocation too (read a row per token) */
    uint8_t *host;              /* the pinned, mapped allocation of the experts placed in host memory, or NULL */
    uint8_t *host_dev;          /* the same bytes as kernels address them */
    size_t host_size, host_used;
    uint64_t *route_counts;     /* [n_layers * n_experts] tokens routed to each expert (route_stats.cu) */
    struct dsv4_cuda_fetch fetch;       /* host experts fetched ahead (expert_fetch.cu); slots NULL: off */
    size_t fetch_bytes;                 /* the arena's share for it (0: off) */
    const char *fetch_off;              /* why it is off while experts live on the host */
    struct dsv4_cuda_expert fetch_proto;        /* a host expert's table entry: the slots' shapes */
    int fetch_proto_layer;              /* its layer, -1 none yet */
    void *caches;               /* per-slot caches, official layout (used by the decode step) */
    char variants[DEV_VARIANTS_MAX];
};

/* ---- walking the weights: every linear and every small vector the config implies ---- */

struct walker {
    int (*linear)(struct walker *wk, const struct dsv4_linear *l);
    int (*vector)(struct walker *wk, const void *host, size_t bytes);
    int (*experts)(struct walker *wk, int layer, const struct dsv4_ffn *f);
    struct dsv4_cuda_dev *dev;
    const struct dsv4_config *cfg;
    size_t bytes;               /* pass 1: sum of aligned sizes, routed experts that may move excepted */
    const struct dsv4_linear *embed;    /* the token embedding, which may move to host memory too */
    size_t embed_bytes;         /* pass 1: its aligned size (not in bytes) */
    uint64_t *expert_bytes;     /* pass 1: [n_layers] aligned bytes of each layer's movable experts */
    int ex_layer, ex_expert;    /* the movable expert being walked (ex_layer -1: none), ex_expert counted from e0 */
    int e0, e1;                 /* the routed experts [e0, e1) of each layer this device holds (all, or its
                                 * rank's share under expert parallelism: opts->ep_ranks) */
    bool with_mtp;              /* the MTP block too (the backend speculates with it) */
    bool quant_act;             /* fp8 numerics: routed experts take quantized activations */
    bool ex_tiles;              /* the walked layer's experts are stored in k-tile blocks, wherever they live */
    bool all_tiled;             /* pass 1: every movable layer's are, FP4 [moe_inter, dim] (fetching ahead needs it) */
};

static size_t align_up(size_t n)
{
    return (n + DSV4_CUDA_ARENA_ALIGN - 1) / DSV4_CUDA_ARENA_ALIGN * DSV4_CUDA_ARENA_ALIGN;
}

#define WALK(call)                      \
    do {                                \
        int rc_ = (call);               \
        if (rc_ < 0)                    \
            return rc_;                 \
    } while (0)

static bool linear_present(const struct dsv4_linear *l)
{
    return l->w && l->out > 0 && l->in > 0;
}

/* The routed experts go into one table when all 3E linears share a format the kernel has. */
static bool experts_uniform(const struct dsv4_config *c, const struct dsv4_ffn *f)
{
    if (!f->w1 || !f->w2 || !f->w3 || c->n_experts < 1)
        return false;
    const enum dsv4_wfmt fmt = f->w1[0].fmt;
    if (fmt == DSV4_W_F16)
        return false;
    for (int e = 0; e < c->n_experts; e++)
        if (f->w1[e].fmt != fmt || f->w3[e].fmt != fmt || f->w2[e].fmt != fmt || !linear_present(&f->w1[e]))
            return false;
    return true;
}

static int walk_vec(struct walker *wk, const void *host, size_t n, size_t elem)
{
    return host ? wk->vector(wk, host, n * elem) : 0;
}

static int walk_hc(struct walker *wk, const struct dsv4_hc *h)
{
    const int hc = wk->cfg->hc_mult;
    WALK(wk->linear(wk, &h->fn));
    WALK(walk_vec(wk, h->base, (size_t)(2 + hc) * hc, sizeof(float)));
    return walk_vec(wk, h->scale, 3, sizeof(float));
}

static int walk_comp(struct walker *wk, const struct dsv4_compressor *c)
{
    const int coff = c->overlap ? 2 : 1;
    WALK(wk->linear(wk, &c->wkv));
    WALK(wk->linear(wk, &c->wgate));
    WALK(walk_vec(wk, c->ape, (size_t)c->ratio * coff * c->dim, sizeof(float)));
    return walk_vec(wk, c->norm, (size_t)c->dim, sizeof(float));
}

static int walk_layer(struct walker *wk, int li, const struct dsv4_layer *L)
{
    const struct dsv4_config *c = wk->cfg;
    const struct dsv4_attn *a = &L->attn;
    const struct dsv4_ffn *f = &L->ffn;

    WALK(walk_vec(wk, L->attn_norm, c->dim, sizeof(float)));
    WALK(walk_vec(wk, L->ffn_norm, c->dim, sizeof(float)));
    WALK(walk_hc(wk, &L->hc_attn));
    WALK(walk_hc(wk, &L->hc_ffn));
    WALK(wk->linear(wk, &a->wq_a));
    WALK(walk_vec(wk, a->q_norm, c->q_lora_rank, sizeof(float)));
    WALK(wk->linear(wk, &a->wq_b));
    WALK(wk->linear(wk, &a->wkv));
    WALK(walk_vec(wk, a->kv_norm, c->head_dim, sizeof(float)));
    WALK(wk->linear(wk, &a->wo_a));
    WALK(wk->linear(wk, &a->wo_b));
    WALK(walk_vec(wk, a->sink, c->n_heads, sizeof(float)));
    if (L->ratio > 0)
        WALK(walk_comp(wk, &a->comp));
    if (L->ratio > 0 && L->ratio == c->csa_ratio) {
        WALK(wk->linear(wk, &a->indexer.wq_b));
        WALK(wk->linear(wk, &a->indexer.weights_proj));
        WALK(walk_comp(wk, &a->indexer.comp));
    }
    WALK(wk->linear(wk, &f->gate));
    WALK(walk_vec(wk, f->gate_bias, c->n_experts, sizeof(float)));
    WALK(walk_vec(wk, f->tid2eid, (size_t)c->vocab_size * c->n_experts_per_tok, sizeof(int32_t)));
    /* only a layer's table of experts (upload_experts) can point into host memory; the MTP block's
     * layer (li n_layers) has a table too, always on the GPU */
    const bool movable = li >= 0 && li < c->n_layers && experts_uniform(c, f);
    wk->ex_tiles = movable && dsv4_cuda_moe_tiles(f->w1[0].fmt, c->dim, (int)f->w1[0].out, wk->quant_act);
    if (movable)
        wk->all_tiled &= wk->ex_tiles && f->w1[0].fmt == DSV4_W_FP4 && f->w1[0].out == c->moe_inter;
    for (int e = wk->e0; f->w1 && f->w2 && f->w3 && e < wk->e1; e++) {
        wk->ex_layer = movable ? li : -1;
        wk->ex_expert = e - wk->e0;
        WALK(wk->linear(wk, &f->w1[e]));
        WALK(wk->linear(wk, &f->w3[e]));
        WALK(wk->linear(wk, &f->w2[e]));
    }
    wk->ex_layer = -1;
    if (li >= 0)
        WALK(wk->experts(wk, li, f));
    WALK(wk->linear(wk, &f->sw1));
    WALK(wk->linear(wk, &f->sw3));
    return wk->linear(wk, &f->sw2);
}

static int walk_weights(struct walker *wk, const struct dsv4_weights *w)
{
    const struct dsv4_config *c = &w->cfg;
    WALK(wk->linear(wk, &w->embed));
    WALK(wk->linear(wk, &w->head));
    WALK(walk_vec(wk, w->norm, c->dim, sizeof(float)));
    WALK(wk->linear(wk, &w->hc_head.fn));
    WALK(walk_vec(wk, w->hc_head.base, c->hc_mult, sizeof(float)));
    WALK(walk_vec(wk, w->hc_head.scale, 1, sizeof(float)));
    for (int i = 0; i < c->n_layers; i++)
        WALK(walk_layer(wk, i, &w->layers[i]));
    /* The MTP block only when the backend speculates with it: at Flash's shapes it is 3.4 GB, about
     * 270 routed experts' worth of GPU memory. Its layer's expert table goes at index n_layers. */
    if (wk->with_mtp) {
        const struct dsv4_mtp *m = &w->mtp[0];
        WALK(walk_vec(wk, m->enorm, c->dim, sizeof(float)));
        WALK(walk_vec(wk, m->hnorm, c->dim, sizeof(float)));
        WALK(wk->linear(wk, &m->e_proj));
        WALK(wk->linear(wk, &m->h_proj));
        WALK(walk_layer(wk, c->n_layers, &m->layer));
        WALK(wk->linear(wk, &m->hc_head.fn));
        WALK(walk_vec(wk, m->hc_head.base, c->hc_mult, sizeof(float)));
        WALK(walk_vec(wk, m->hc_head.scale, 1, sizeof(float)));
        WALK(walk_vec(wk, m->norm, c->dim, sizeof(float)));
    }
    return 0;
}

/* Device bytes of a linear, stored contiguous (row_stride == in), and of its scales. */
static size_t linear_elem_bytes(const struct dsv4_linear *l, int64_t vals)
{
    switch (l->fmt) {
    case DSV4_W_F32: return (size_t)vals * 4;
    case DSV4_W_BF16:
    case DSV4_W_F16: return (size_t)vals * 2;
    case DSV4_W_FP8: return (size_t)vals;
    case DSV4_W_FP4: return (size_t)vals / 2;
    }
    return 0;
}

static size_t linear_scale_bytes(const struct dsv4_linear *l)
{
    if (l->fmt == DSV4_W_FP8)
        return (size_t)((l->out + DSV4_CUDA_FP8_BLOCK - 1) / DSV4_CUDA_FP8_BLOCK) * l->scale_stride;
    if (l->fmt == DSV4_W_FP4)
        return (size_t)l->out * l->scale_stride;
    return 0;
}

static int size_linear(struct walker *wk, const struct dsv4_linear *l)
{
    if (!linear_present(l))
        return 0;
    const size_t b = align_up(linear_elem_bytes(l, l->out * l->in)) + align_up(linear_scale_bytes(l));
    if (l == wk->embed)
        wk->embed_bytes += b;
    else if (wk->ex_layer >= 0)
        wk->expert_bytes[wk->ex_layer] += b;
    else
        wk->bytes += b;
    wk->dev->cap_linears++;
    return 0;
}

static int size_vector(struct walker *wk, const void *host, size_t bytes)
{
    wk->bytes += align_up(bytes);
    wk->dev->cap_vectors++;
    return 0;
}

static int size_experts(struct walker *wk, int layer, const struct dsv4_ffn *f)
{
    if (experts_uniform(wk->cfg, f))
        wk->bytes += align_up(sizeof(struct dsv4_cuda_expert) * wk->cfg->n_experts);
    return 0;
}

static int carve(struct dsv4_cuda_dev *dev, size_t bytes, void **ret)
{
    bytes = align_up(bytes);
    if (dev->sealed)
        return dsv4_error_set(-EPERM, "cuda: workspace of %zu bytes asked for after boot", bytes);
    if (bytes > dev->arena_size - dev->arena_used)
        return dsv4_error_set(-ENOMEM, "cuda: arena of %zu bytes exhausted (%zu used, %zu more asked)",
                              dev->arena_size, dev->arena_used, bytes);
    *ret = dev->arena + dev->arena_used;
    dev->arena_used += bytes;
    return 0;
}

/* The pinned host allocation's share of an expert placed there: its bytes written now, its device
 * address (what the expert table holds) returned. */
static int carve_host(struct dsv4_cuda_dev *dev, size_t bytes, uint8_t **ret_host, void **ret_dev)
{
    bytes = align_up(bytes);
    if (bytes > dev->host_size - dev->host_used)
        return dsv4_error_set(-ENOMEM, "cuda: host expert memory of %zu bytes exhausted (%zu used, %zu more asked)",
                              dev->host_size, dev->host_used, bytes);
    *ret_host = dev->host + dev->host_used;
    *ret_dev = dev->host_dev + dev->host_used;
    dev->host_used += bytes;
    return 0;
}

/* An FP4 expert linear into host memory in k-tile blocks (dsv4_cuda_tile_fp4): the bytes and their
 * places in the host allocation are those of the row-major copy; only the order differs. */
static int put_tiled_host(struct dsv4_cuda_dev *dev, const struct dsv4_linear *l, size_t scale_bytes, void **ret_w,
                          void **ret_s)
{
    uint8_t *hw = NULL, *hs = NULL;
    WALK(carve_host(dev, (size_t)l->out * (size_t)(l->in / 2), &hw, ret_w));
    WALK(carve_host(dev, scale_bytes, &hs, ret_s));
    dsv4_cuda_tile_fp4(static_cast<const uint8_t *>(l->w), l->row_stride / 2, l->scale, l->scale_stride, l->out, l->in,
                       hw, hs);
    return 0;
}

/* An FP4 expert linear into the arena in k-tile blocks: the row-major bytes go first to the arena's
 * tail, which the caches and workspaces take only after every weight is placed (at least the 32 MB
 * of cuBLASLt's workspace, against 4 MB for a V4-Flash expert matrix), and a kernel writes the blocks
 * (dsv4_cuda_tile_fp4_dev). Copies and kernel go through the legacy stream, in order; dev_boot
 * synchronizes before any other stream reads the weights. */
static int put_tiled_dev(struct dsv4_cuda_dev *dev, const struct dsv4_linear *l, size_t scale_bytes, void **ret_w,
                         void **ret_s)
{
    const size_t row = (size_t)(l->in / 2), wb = row * (size_t)l->out, stage = align_up(wb) + align_up(scale_bytes);
    WALK(carve(dev, wb, ret_w));
    WALK(carve(dev, scale_bytes, ret_s));
    if (stage > dev->arena_size - dev->arena_used)
        return dsv4_error_set(-ENOMEM, "cuda: expert linear %s needs %zu bytes of staging to be stored in k-tile "
                              "blocks, %zu are left past the weights (DSV4_CUDA_MOE_TILES=0 stores it row by row)",
                              l->name, stage, dev->arena_size - dev->arena_used);
    uint8_t *st = dev->arena + dev->arena_size - stage, *st_scale = st + align_up(wb);
    DSV4_CUDA_TRY(cudaMemcpy2D(st, row, l->w, l->row_stride / 2, row, l->out, cudaMemcpyHostToDevice));
    DSV4_CUDA_TRY(cudaMemcpy(st_scale, l->scale, scale_bytes, cudaMemcpyHostToDevice));
    return dsv4_cuda_tile_fp4_dev(st, (int64_t)row, st_scale, l->scale_stride, l->out, l->in,
                                  static_cast<uint8_t *>(*ret_w), static_cast<uint8_t *>(*ret_s), NULL);
}

/* rows x row bytes from src (rows pitch bytes apart) to the device arena, or into host memory. */
static int put_rows(struct dsv4_cuda_dev *dev, bool host, const void *src, size_t pitch, size_t row, size_t rows,
                    void **ret_dev)
{
    uint8_t *h = NULL;
    if (!host) {
        WALK(carve(dev, row * rows, ret_dev));
        DSV4_CUDA_TRY(cudaMemcpy2D(*ret_dev, row, src, pitch, row, rows, cudaMemcpyHostToDevice));
        return 0;
    }
    WALK(carve_host(dev, row * rows, &h, ret_dev));
    for (size_t r = 0; r < rows; r++)
        memcpy(h + r * row, static_cast<const uint8_t *>(src) + r * pitch, row);
    return 0;
}

static int upload_linear(struct walker *wk, const struct dsv4_linear *l)
{
    struct dsv4_cuda_dev *dev = wk->dev;
    struct dev_linear *dl;
    void *w = NULL, *s = NULL;
    size_t row = linear_elem_bytes(l, l->in), sb = linear_scale_bytes(l);
    const bool host = wk->ex_layer >= 0 ? dsv4_placement_on_host(dev->place, wk->ex_layer, wk->ex_expert)
                                        : l == wk->embed && dev->embed_on_host;

    if (!linear_present(l))
        return 0;
    if (wk->ex_layer >= 0 && wk->ex_tiles) {
        WALK(host ? put_tiled_host(dev, l, sb, &w, &s) : put_tiled_dev(dev, l, sb, &w, &s));
    } else {
        /* stacked expert views (row_stride > in) become contiguous rows */
        WALK(put_rows(dev, host, l->w, linear_elem_bytes(l, l->row_stride), row, l->out, &w));
        if (sb)
            WALK(put_rows(dev, host, l->scale, sb, sb, 1, &s));
    }
    dl = &dev->linears[dev->n_linears++];
    dl->name = l->name;
    dl->host = l->w;
    dl->lin.fmt = l->fmt;
    dl->lin.out = l->out;
    dl->lin.in = l->in;
    dl->lin.row_stride = l->in;
    dl->lin.w = w;
    dl->lin.scale = static_cast<const uint8_t *>(s);
    dl->lin.scale_stride = l->scale_stride;
    if (!host)
        dev->stats.weight_bytes += row * l->out + sb;
    else if (l == wk->embed)
        dev->stats.host_embed_bytes = row * l->out + sb;
    return 0;
}

static int upload_vector(struct walker *wk, const void *host, size_t bytes)
{
    struct dsv4_cuda_dev *dev = wk->dev;
    struct dev_vector *v = &dev->vectors[dev->n_vectors++];
    WALK(carve(dev, bytes, &v->dev));
    DSV4_CUDA_TRY(cudaMemcpy(v->dev, host, bytes, cudaMemcpyHostToDevice));
    v->host = host;
    dev->stats.weight_bytes += bytes;
    return 0;
}

static int upload_experts(struct walker *wk, int layer, const struct dsv4_ffn *f)
{
    struct dsv4_cuda_dev *dev = wk->dev;
    const struct dsv4_config *c = wk->cfg;
    struct dsv4_cuda_expert *tab;
    struct dsv4_cuda_experts *ex = &dev->experts[layer];
    void *d_tab = NULL;

    if (!experts_uniform(c, f))
        return 0;
    tab = static_cast<struct dsv4_cuda_expert *>(calloc(c->n_experts, sizeof(*tab)));
    if (!tab)
        return dsv4_error_set(-ENOMEM, "cuda: expert table of layer %d", layer);
    /* walk_layer uploads w1, w3, w2 of each expert it holds in order just before calling here; the
     * entries of the experts other devices hold stay empty (expert parallelism: a rank's steps never
     * route a pair to them) */
    const size_t base = dev->n_linears - 3 * (size_t)(wk->e1 - wk->e0);
    for (int e = wk->e0; e < wk->e1; e++) {
        const struct dev_linear *d1 = &dev->linears[base + 3 * (e - wk->e0)], *d3 = d1 + 1, *d2 = d1 + 2;
        if (d1->host != f->w1[e].w || d3->host != f->w3[e].w || d2->host != f->w2[e].w) {
            free(tab);
            return dsv4_error_set(-ENOENT, "cuda: layer %d expert %d was not uploaded", layer, e);
        }
        tab[e] = { d1->lin, d3->lin, d2->lin };
        if (dev->fetch_proto_layer < 0 && dsv4_placement_on_host(dev->place, layer, e - wk->e0)) {
            dev->fetch_proto = tab[e];
            dev->fetch_proto_layer = layer;
        }
    }
    ex->tiled = wk->ex_tiles;
    int rc = carve(dev, sizeof(*tab) * c->n_experts, &d_tab);
    if (rc == 0 && cudaMemcpy(d_tab, tab, sizeof(*tab) * c->n_experts, cudaMemcpyHostToDevice) != cudaSuccess)
        rc = dsv4_error_set(-EIO, "cuda: uploading the expert table of layer %d", layer);
    free(tab);
    if (rc < 0)
        return rc;
    ex->n_experts = c->n_experts;
    ex->dim = c->dim;
    ex->inter = (int)f->w1[0].out;
    ex->swiglu_limit = (float)c->swiglu_limit;
    ex->fmt = f->w1[0].fmt;
    ex->quant_act = false;
    ex->d_table = static_cast<const struct dsv4_cuda_expert *>(d_tab);
    return 0;
}

/* ---- caches and workspaces ---- */

static void vlog(struct dsv4_cuda_dev *dev, void (*log)(void *, const char *), void *ctx, bool variant,
                 const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void vlog(struct dsv4_cuda_dev *dev, void (*log)(void *, const char *), void *ctx, bool variant,
                 const char *fmt, ...)
{
    char line[DEV_LOG_LINE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (variant) {
        size_t n = strlen(dev->variants);
        snprintf(dev->variants + n, sizeof(dev->variants) - n, "%s\n", line);
    }
    if (log)
        log(ctx, line);
}

/* ---- host experts fetched ahead (expert_fetch.cu) ---- */

static_assert(DSV4_CUDA_FETCH_AHEAD_SWITCH_MAX == DSV4_CUDA_FETCH_AHEAD_MAX,
              "DSV4_CUDA_EXPERT_FETCH's range is the layers a prediction may cover");

/* The decode expert kernels' tiles in chunks into f's tile fields; false when the masks cannot hold them. */
static bool fetch_tiles(const struct dsv4_config *c, struct dsv4_cuda_fetch *f)
{
    int up_rows, down_rows;
    dsv4_cuda_moe_decode_tiles(&up_rows, &down_rows);
    if (up_rows % DSV4_CUDA_TILE_ROWS || down_rows % DSV4_CUDA_TILE_ROWS || c->moe_inter % up_rows ||
        c->dim % down_rows || c->moe_inter / up_rows > DSV4_CUDA_FETCH_TILES_MAX ||
        c->dim / down_rows > DSV4_CUDA_FETCH_TILES_MAX)
        return false;
    f->up_tile_blocks = up_rows / DSV4_CUDA_TILE_ROWS;
    f->down_tile_blocks = down_rows / DSV4_CUDA_TILE_ROWS;
    f->up_tiles = c->moe_inter / up_rows;
    f->down_tiles = c->dim / down_rows;
    return true;
}

/* The arena's share for fetching host experts ahead: DSV4_CUDA_FETCH_SETS sets of slots of an
 * expert's bytes (the movable experts are alike: all_tiled), their chunk flags, the slot table and the
 * jobs, which experts live on the host, the counters and stop words, the predictions' logits, the
 * redirect entries of every layer's experts and which of them are set. 0 and *why when decode steps
 * cannot fetch; else the layers a prediction covers (DSV4_CUDA_EXPERT_FETCH) go to the device's fetch. */
static size_t fetch_plan_bytes(const struct walker *wk, const struct dsv4_backend_opts *o, uint64_t expert,
                               const char **why)
{
    const struct dsv4_config *c = wk->cfg;
    struct dsv4_cuda_switches sw;
    const size_t slots = DSV4_CUDA_FETCH_SETS * DSV4_CUDA_FETCH_SLOTS;
    struct dsv4_cuda_fetch tiles = {};     /* the tile fields only: an expert's chunk count */
    *why = NULL;
    if (dsv4_cuda_switches_read(&sw) < 0 || !sw.expert_fetch)
        *why = "DSV4_CUDA_EXPERT_FETCH=0";
    else if (!sw.branches)
        *why = "DSV4_CUDA_BRANCHES=0: one stream, so a copy could not overlap the attention";
    else if (!wk->all_tiled)
        *why = "the routed experts are not FP4 in k-tile blocks on the tensor-core kernels (fp8 numerics)";
    else if (c->n_layers > DSV4_CUDA_FETCH_LAYERS_MAX)
        *why = "more layers than the fetch tags hold";
    else if (c->n_experts > 0xffff)
        *why = "more experts a layer than the slot keys hold";
    else if (!fetch_tiles(c, &tiles))
        *why = "more expert tiles than the fetch masks hold";
    else if (wk->e1 - wk->e0 != c->n_experts)
        *why = "the routed experts are split across devices (a step runs every rank's rows on them)";
    if (*why)
        return 0;
    wk->dev->fetch.ahead = sw.expert_fetch;
    return slots * (expert + align_up(sizeof(uint32_t) * (size_t)dsv4_cuda_fetch_chunks(&tiles))) +
           align_up(slots * sizeof(struct dsv4_cuda_fetch_slot)) + align_up(slots * sizeof(struct dsv4_cuda_fetch_job)) +
           align_up((size_t)c->n_layers * c->n_experts) + align_up(DSV4_CUDA_FETCH_WORDS * sizeof(unsigned long long)) +
           align_up(sizeof(float) * DSV4_CUDA_FETCH_AHEAD_MAX * DSV4_CUDA_FETCH_ROWS_MAX * (size_t)c->n_experts) +
           align_up(sizeof(struct dsv4_cuda_fetch_redirect) * (size_t)c->n_layers * c->n_experts) +
           align_up(sizeof(int32_t) * (size_t)c->n_layers * DSV4_CUDA_FETCH_SLOTS);
}

/* Carve and fill what fetch_plan_bytes counted, from a host expert's table entry (its shapes). */
static int fetch_build(struct dsv4_cuda_dev *dev, const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    struct dsv4_cuda_fetch *f = &dev->fetch;
    const int n_slots = DSV4_CUDA_FETCH_SETS * DSV4_CUDA_FETCH_SLOTS, E = c->n_experts;
    struct dsv4_cuda_fetch_slot slot[DSV4_CUDA_FETCH_SETS * DSV4_CUDA_FETCH_SLOTS];
    void *p = NULL;

    if (!dev->fetch_bytes)
        return 0;
    if (dev->fetch_proto_layer < 0) {
        dev->fetch_off = "no routed expert was placed in host memory";
        return 0;
    }
    f->n_layers = c->n_layers;
    f->n_experts = E;
    f->rows = o->max_batch < DSV4_CUDA_FETCH_ROWS_MAX ? o->max_batch : DSV4_CUDA_FETCH_ROWS_MAX;
    fetch_tiles(c, f);
    for (int s = 0; s < n_slots; s++) {
        struct dsv4_cuda_linear *lin[3] = { &slot[s].ex.w1, &slot[s].ex.w3, &slot[s].ex.w2 };
        slot[s].ex = dev->fetch_proto;
        for (int m = 0; m < 3; m++) {
            WALK(carve(dev, (size_t)lin[m]->out * (size_t)lin[m]->in / 2, &p));
            lin[m]->w = p;
            WALK(carve(dev, (size_t)lin[m]->out * (size_t)lin[m]->in / 32, &p));
            lin[m]->scale = static_cast<const uint8_t *>(p);
        }
        WALK(carve(dev, sizeof(uint32_t) * (size_t)dsv4_cuda_fetch_chunks(f), &p));
        DSV4_CUDA_TRY(cudaMemset(p, 0, sizeof(uint32_t) * (size_t)dsv4_cuda_fetch_chunks(f)));
        slot[s].done = static_cast<uint32_t *>(p);
        slot[s].key = 0;
    }
    WALK(carve(dev, sizeof(slot), &p));
    DSV4_CUDA_TRY(cudaMemcpy(p, slot, sizeof(slot), cudaMemcpyHostToDevice));
    f->slots = static_cast<struct dsv4_cuda_fetch_slot *>(p);
    WALK(carve(dev, n_slots * sizeof(struct dsv4_cuda_fetch_job), &p));
    DSV4_CUDA_TRY(cudaMemset(p, 0xff, n_slots * sizeof(struct dsv4_cuda_fetch_job)));
    f->jobs = static_cast<struct dsv4_cuda_fetch_job *>(p);
    std::unique_ptr<uint8_t[]> on_host(new (std::nothrow) uint8_t[(size_t)c->n_layers * E]());
    if (!on_host)
        return dsv4_error_set(-ENOMEM, "cuda: host expert table of %d layers", c->n_layers);
    for (int l = 0; l < c->n_layers; l++)
        for (int e = 0; dev->layer_movable[l] && e < E; e++)
            on_host[(size_t)l * E + e] = dsv4_placement_on_host(dev->place, l, e);
    WALK(carve(dev, (size_t)c->n_layers * E, &p));
    DSV4_CUDA_TRY(cudaMemcpy(p, on_host.get(), (size_t)c->n_layers * E, cudaMemcpyHostToDevice));
    f->on_host = static_cast<const uint8_t *>(p);
    WALK(carve(dev, DSV4_CUDA_FETCH_WORDS * sizeof(unsigned long long), &p));
    DSV4_CUDA_TRY(cudaMemset(p, 0, DSV4_CUDA_FETCH_WORDS * sizeof(unsigned long long)));
    f->words = static_cast<unsigned long long *>(p);
    WALK(carve(dev, sizeof(float) * DSV4_CUDA_FETCH_AHEAD_MAX * DSV4_CUDA_FETCH_ROWS_MAX * (size_t)E, &p));
    f->logits = static_cast<float *>(p);
    const size_t rb = sizeof(struct dsv4_cuda_fetch_redirect) * (size_t)c->n_layers * E;
    WALK(carve(dev, rb, &p));
    DSV4_CUDA_TRY(cudaMemset(p, 0, rb));
    f->redirect = static_cast<struct dsv4_cuda_fetch_redirect *>(p);
    WALK(carve(dev, sizeof(int32_t) * (size_t)c->n_layers * DSV4_CUDA_FETCH_SLOTS, &p));
    DSV4_CUDA_TRY(cudaMemset(p, 0xff, sizeof(int32_t) * (size_t)c->n_layers * DSV4_CUDA_FETCH_SLOTS));
    f->redirected = static_cast<int32_t *>(p);
    return 0;
}

/* Pass 1 gave the dense bytes (wk->bytes), the embedding's and each layer's movable expert bytes;
 * `rest` is what the caches, workspaces and prefix pool take. Decide where each expert lives and
 * make the host allocation for those that go there (the only one: nothing is allocated after boot).
 * When some expert must live on the host the embedding goes there first: a token reads one 8 KB
 * row of it, against 12.6 MB for each host expert it routes to (Flash), so its 1.06 GB on the GPU
 * are worth ~84 experts more. */
static int plan_experts(struct dsv4_cuda_dev *dev, struct walker *wk, const struct dsv4_backend_opts *o,
                        size_t rest, size_t free_b)
{
    const struct dsv4_config *c = wk->cfg;
    const size_t need = wk->bytes + wk->embed_bytes + rest + DSV4_CUDA_GPU_MARGIN;
    const int held = wk->e1 - wk->e0;      /* experts of a layer this device holds; the placement counts from e0 */
    uint64_t expert = 0;
    for (int l = 0; l < c->n_layers; l++) {
        wk->expert_bytes[l] /= (uint64_t)held;      /* the experts of a movable layer are alike */
        expert = wk->expert_bytes[l] > expert ? wk->expert_bytes[l] : expert;
    }
    /* routing statistics of the held experts only, layer by layer */
    std::unique_ptr<uint64_t[]> held_counts;
    if (o->expert_counts && held != c->n_experts) {
        held_counts.reset(new (std::nothrow) uint64_t[(size_t)c->n_layers * held]);
        if (!held_counts)
            return dsv4_error_set(-ENOMEM, "cuda: routing statistics of %d layers", c->n_layers);
        for (int l = 0; l < c->n_layers; l++)
            memcpy(&held_counts[(size_t)l * held], o->expert_counts + (size_t)l * c->n_experts + wk->e0,
                   sizeof(uint64_t) * held);
    }
    struct dsv4_placement_req req = {};
    req.n_layers = c->n_layers;
    req.n_experts = held;
    req.expert_bytes = wk->expert_bytes;
    req.gpu_budget = free_b > need ? free_b - need : 0;
    req.mode = o->expert_offload;
    req.host_percent = o->expert_host_share;
    req.counts = held_counts ? held_counts.get() : o->expert_counts;
    WALK(dsv4_placement_plan(&req, &dev->place));
    if (dev->place->offload && wk->embed_bytes > 0) {
        dsv4_placement_free(dev->place);
        dev->place = NULL;
        dev->embed_on_host = true;
        req.gpu_budget += wk->embed_bytes;
        WALK(dsv4_placement_plan(&req, &dev->place));
    }
    /* with experts on the host, decode steps fetch some ahead into slots: their bytes come first */
    if (dev->place->offload && (dev->fetch_bytes = fetch_plan_bytes(wk, o, expert, &dev->fetch_off)) > 0) {
        dsv4_placement_free(dev->place);
        dev->place = NULL;
        req.gpu_budget = req.gpu_budget > dev->fetch_bytes ? req.gpu_budget - dev->fetch_bytes : 0;
        WALK(dsv4_placement_plan(&req, &dev->place));
    }
    dev->layer_movable = static_cast<bool *>(calloc((size_t)c->n_layers + 1, sizeof(bool)));
    if (!dev->layer_movable)
        return dsv4_error_set(-ENOMEM, "cuda: placement of %d layers", c->n_layers);
    for (int l = 0; l < c->n_layers; l++) {
        dev->layer_movable[l] = wk->expert_bytes[l] > 0;
        dev->stats.experts_host += (uint32_t)dev->place->host_experts[l];
        dev->stats.experts_gpu += wk->expert_bytes[l] ? (uint32_t)(held - dev->place->host_experts[l]) : 0;
    }
    dev->stats.gpu_expert_bytes = dev->place->gpu_bytes;
    dev->stats.host_expert_bytes = dev->place->host_bytes;
    const size_t host_b = dev->place->host_bytes + (dev->embed_on_host ? wk->embed_bytes : 0);
    if (!host_b)
        return 0;
    void *h = NULL, *d = NULL;
    cudaError_t e = cudaHostAlloc(&h, host_b, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess)
        return dsv4_error_set(-ENOMEM, "cuda: pinning %.2f GiB of host memory for %u routed experts that do not fit "
                              "the GPU and the embedding: %s (free host memory, or expert_host_share lower)",
                              host_b / DEV_GIB, dev->stats.experts_host, cudaGetErrorString(e));
    dev->host = static_cast<uint8_t *>(h);
    dev->host_size = host_b;
    dev->stats.host_allocs++;
    DSV4_CUDA_TRY(cudaHostGetDevicePointer(&d, h, 0));
    dev->host_dev = static_cast<uint8_t *>(d);
    return 0;
}

extern "C" void dsv4_cuda_dev_expert_stats(const struct dsv4_cuda_dev *dev, struct dsv4_backend_stats *ret)
{
    const struct dsv4_placement *p = dev->place;
    ret->experts_gpu = dev->stats.experts_gpu;
    ret->experts_host = dev->stats.experts_host;
    ret->expert_bytes_gpu = dev->stats.gpu_expert_bytes;
    ret->expert_bytes_host = dev->stats.host_expert_bytes;
    ret->embed_bytes_host = dev->stats.host_embed_bytes;
    ret->expert_layers = p && p->n_layers <= DSV4_MAX_LAYERS ? p->n_layers : 0;
    for (int l = 0; l < ret->expert_layers; l++) {
        ret->experts_host_by_layer[l] = (uint16_t)p->host_experts[l];
        ret->experts_gpu_by_layer[l] = (uint16_t)(dev->layer_movable[l] ? p->n_experts - p->host_experts[l] : 0);
    }
}

/* Boot log: the placement, DSV4_PLACEMENT_LINE_LAYERS layers a line as layer:gpu/host. */
static void log_placement(struct dsv4_cuda_dev *dev, void (*log)(void *, const char *), void *ctx)
{
    const struct dsv4_placement *p = dev->place;
    struct dsv4_backend_stats st;
    bool tiled = false;
    for (int l = 0; l < dev->n_layers; l++)
        tiled = tiled || dev->experts[l].tiled;
    vlog(dev, log, ctx, false, "cuda: routed experts%s: %u on the GPU (%.2f GiB), %u in pinned host memory "
         "(%.2f GiB, read in place over PCIe): %s", tiled ? " in k-tile blocks" : "", dev->stats.experts_gpu,
         p->gpu_bytes / DEV_GIB, dev->stats.experts_host, p->host_bytes / DEV_GIB, dsv4_placement_rule(p));
    if (dev->embed_on_host)
        vlog(dev, log, ctx, false, "cuda: the embedding (%.2f GiB) in pinned host memory too: a row read per token",
             dev->stats.host_embed_bytes / DEV_GIB);
    if (!p->offload)
        return;
    dsv4_cuda_dev_expert_stats(dev, &st);
    for (int l0 = 0; l0 < st.expert_layers; l0 += DSV4_PLACEMENT_LINE_LAYERS) {
        char line[160];
        const int n = st.expert_layers - l0 < DSV4_PLACEMENT_LINE_LAYERS ? st.expert_layers - l0
                                                                         : DSV4_PLACEMENT_LINE_LAYERS;
        dsv4_placement_layers_text(st.experts_gpu_by_layer, st.experts_host_by_layer, l0, n, line, sizeof(line));
        vlog(dev, log, ctx, false, "cuda: experts gpu/host by layer:%s", line);
    }
    if (dev->fetch.slots)
        vlog(dev, log, ctx, true, "cuda: decode steps fetch host experts ahead: %d sets of %d slots (%.1f MiB), "
             "each layer's attention input predicting the routing of %d layer%s from it, copied while the link "
             "is idle (DSV4_CUDA_EXPERT_FETCH: the layers a prediction covers, 0: in place only)", DSV4_CUDA_FETCH_SETS,
             DSV4_CUDA_FETCH_SLOTS, dev->fetch_bytes / 1048576.0, dev->fetch.ahead, dev->fetch.ahead > 1 ? "s" : "");
    else
        vlog(dev, log, ctx, true, "cuda: host experts are read in place only, not fetched ahead: %s",
             dev->fetch_off ? dev->fetch_off : "nothing to fetch");
}

/* Which compiled image of the kernels the device runs: written by the device itself. */
__global__ void arch_probe_kernel(int *out)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM120_ALL)
    *out = __CUDA_ARCH__ * 10 + 1;      /* arch-specific ("a") cubin */
#elif defined(__CUDA_ARCH__)
    *out = __CUDA_ARCH__ * 10;          /* portable image: the PTX fallback, JIT-compiled */
#endif
}

/* Programmatic dependent launch needs griddepcontrol in every kernel, which only images built for sm_90
 * or later have (the compute_80 PTX fallback has none, even when JIT-compiled for a newer GPU).
 * Decided once per process: all GPUs of a host run the same image. DSV4_CUDA_PDL=0 turns it off (the
 * backend refuses a bad value before any launch). */
bool dsv4_cuda_pdl(void)
{
    static std::atomic<int> on{ -1 };
    int v = on.load(std::memory_order_relaxed);
    if (v < 0) {
        cudaFuncAttributes fa;
        struct dsv4_cuda_switches sw;
        v = cudaFuncGetAttributes(&fa, arch_probe_kernel) == cudaSuccess && fa.ptxVersion >= 90 &&
            fa.binaryVersion >= 90 && (dsv4_cuda_switches_read(&sw) < 0 || sw.pdl);
        on.store(v, std::memory_order_relaxed);
    }
    return v;
}

static int probe_build(struct dsv4_cuda_dev *dev, int *scratch)
{
    int code = 0;
    arch_probe_kernel<<<1, 1, 0, dev->stream>>>(scratch);
    DSV4_CUDA_LAUNCHED("arch_probe");
    DSV4_CUDA_TRY(cudaMemcpyAsync(&code, scratch, sizeof(code), cudaMemcpyDeviceToHost, dev->stream));
    DSV4_CUDA_TRY(cudaStreamSynchronize(dev->stream));
    if (code % 10)
        snprintf(dev->stats.kernel_build, sizeof(dev->stats.kernel_build), "sm_%da cubin", code / 100);
    else
        snprintf(dev->stats.kernel_build, sizeof(dev->stats.kernel_build), "compute_%d PTX (JIT)", code / 100);
    return 0;
}

extern "C" int dsv4_cuda_device_count(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        dsv4_error_set(-ENODEV, "no usable GPU: %s", cudaGetErrorString(e));
        return 0;
    }
    if (n == 0)
        dsv4_error_set(-ENODEV, "no usable GPU: the CUDA runtime sees no device");
    return n;
}

static int dev_boot(struct dsv4_cuda_dev *dev, const struct dsv4_weights *w, const struct dsv4_backend_opts *o,
                    void (*log)(void *, const char *), void *log_ctx)
{
    const struct dsv4_config *c = &w->cfg;
    struct walker wk = {};
    cudaDeviceProp prop;
    size_t free_b = 0, total_b = 0, cache, ws, prefix, lt_ws = DSV4_CUDA_LT_WORKSPACE;
    void *p;

    if (o->max_batch < 1 || o->max_batch > DSV4_CUDA_MAX_BATCH || o->max_context < 1)
        return dsv4_error_set(-EINVAL, "cuda: max_batch %d outside 1..%d or max_context %d < 1", o->max_batch,
                              DSV4_CUDA_MAX_BATCH, o->max_context);
    if (o->prefill_chunk < 0 || o->prefill_chunk > DSV4_PREFILL_CHUNK_MAX)
        return dsv4_error_set(-EINVAL, "cuda: prefill_chunk %d outside 0..%d (0 = the default, %d)", o->prefill_chunk,
                              DSV4_PREFILL_CHUNK_MAX, DSV4_PREFILL_CHUNK_DEFAULT);
    DSV4_CUDA_TRY(cudaSetDevice(dev->ordinal));
    DSV4_CUDA_TRY(cudaGetDeviceProperties(&prop, dev->ordinal));
    snprintf(dev->stats.device_name, sizeof(dev->stats.device_name), "%.95s", prop.name);
    dev->stats.cc_major = prop.major;
    dev->stats.cc_minor = prop.minor;
    dev->stats.sm_count = prop.multiProcessorCount;
    DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&dev->stream, cudaStreamNonBlocking));
    if (cublasLtCreate(&dev->lt) != CUBLAS_STATUS_SUCCESS)
        return dsv4_error_set(-EIO, "cuda: cublasLtCreate failed on device %d", dev->ordinal);

    /* pass 1: sizes */
    wk.dev = dev;
    wk.cfg = c;
    wk.linear = size_linear;
    wk.vector = size_vector;
    wk.experts = size_experts;
    wk.ex_layer = -1;
    wk.embed = &w->embed;
    wk.with_mtp = w->n_mtp > 0 && w->mtp[0].layer.ratio == 0 && dsv4_cuda_step_spec_tokens(c, o) > 0;
    wk.quant_act = o->numerics == DSV4_NUMERICS_FP8;
    wk.all_tiled = true;
    wk.e0 = 0;
    wk.e1 = c->n_experts;
    if (o->ep_ranks > 0)
        WALK(dsv4_ep_shard(c->n_experts, o->ep_ranks, o->ep_rank, &wk.e0, &wk.e1));
    dev->fetch_proto_layer = -1;
    std::unique_ptr<uint64_t[]> expert_bytes(new (std::nothrow) uint64_t[c->n_layers + 1]());
    if (!expert_bytes)
        return dsv4_error_set(-ENOMEM, "cuda: expert sizes of %d layers", c->n_layers);
    wk.expert_bytes = expert_bytes.get();
    WALK(walk_weights(&wk, w));
    cache = align_up(dsv4_cuda_step_cache_bytes(c, o));
    ws = align_up(dsv4_cuda_step_workspace_bytes(c, o)) + align_up(lt_ws) + 2 * DSV4_CUDA_ARENA_ALIGN;
    const int64_t pb = dsv4_cuda_prefix_bytes(c, o);
    if (pb < 0)
        return (int)pb;
    prefix = align_up((size_t)pb);
    const size_t counts = align_up(sizeof(uint64_t) * (size_t)c->n_layers * (size_t)c->n_experts);
    DSV4_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    const size_t fixed = wk.bytes + cache + ws + prefix + counts;
    if (fixed + DSV4_CUDA_GPU_MARGIN > free_b)
        return dsv4_error_set(-ENOMEM, "cuda: device %d (%s) has %.2f GiB free; the plan needs %.2f GiB before any "
                              "routed expert (dense weights %.2f, the embedding apart, + caches %.2f for %d slots x %d tokens + workspace "
                              "%.2f + prefix cache %.2f + margin %.2f): lower max_batch, max_context or prefix_cache",
                              dev->ordinal, prop.name, free_b / DEV_GIB, (fixed + DSV4_CUDA_GPU_MARGIN) / DEV_GIB,
                              wk.bytes / DEV_GIB, cache / DEV_GIB, o->max_batch, o->max_context, ws / DEV_GIB,
                              prefix / DEV_GIB, DSV4_CUDA_GPU_MARGIN / DEV_GIB);
    WALK(plan_experts(dev, &wk, o, cache + ws + prefix + counts, free_b));
    dev->arena_size = fixed + (dev->embed_on_host ? 0 : wk.embed_bytes) + dev->place->gpu_bytes + dev->fetch_bytes;
    DSV4_CUDA_TRY(cudaMalloc(&p, dev->arena_size));
    dev->stats.device_allocs++;
    dev->arena = static_cast<uint8_t *>(p);
    dev->stats.arena_bytes = dev->arena_size;
    dev->stats.cache_bytes = cache;
    dev->stats.workspace_bytes = ws;
    dev->stats.prefix_bytes = prefix;

    /* pass 2: upload, in checkpoint formats */
    dev->linears = static_cast<struct dev_linear *>(calloc(dev->cap_linears + 1, sizeof(*dev->linears)));
    dev->vectors = static_cast<struct dev_vector *>(calloc(dev->cap_vectors + 1, sizeof(*dev->vectors)));
    dev->n_layers = c->n_layers;
    dev->experts_per_layer = c->n_experts;
    dev->experts = static_cast<struct dsv4_cuda_experts *>(calloc(c->n_layers + 1, sizeof(*dev->experts)));
    if (!dev->linears || !dev->vectors || !dev->experts)
        return dsv4_error_set(-ENOMEM, "cuda: weight tables for %zu linears", dev->cap_linears);
    wk.linear = upload_linear;
    wk.vector = upload_vector;
    wk.experts = upload_experts;
    WALK(walk_weights(&wk, w));
    DSV4_CUDA_TRY(cudaDeviceSynchronize());     /* the legacy stream's copies and tiling kernels */
    if (dev->host_used != dev->host_size)
        return dsv4_error_set(-EIO, "cuda: %zu of %zu bytes of host expert memory written", dev->host_used,
                              dev->host_size);
    WALK(carve(dev, counts, &p));
    dev->route_counts = static_cast<uint64_t *>(p);
    DSV4_CUDA_TRY(cudaMemsetAsync(p, 0, counts, dev->stream));
    WALK(fetch_build(dev, c, o));
    WALK(carve(dev, cache, &dev->caches));
    DSV4_CUDA_TRY(cudaMemsetAsync(dev->caches, 0, cache, dev->stream));
    WALK(carve(dev, lt_ws, &dev->lt_workspace));
    WALK(carve(dev, sizeof(int), &p));
    WALK(probe_build(dev, static_cast<int *>(p)));

    vlog(dev, log, log_ctx, false, "cuda: device %d %s, cc %d.%d, %d SMs, kernels from %s", dev->ordinal,
         prop.name, prop.major, prop.minor, prop.multiProcessorCount, dev->stats.kernel_build);
    vlog(dev, log, log_ctx, false, "cuda: arena %.2f GiB in 1 allocation: weights %.2f GiB (%zu linears, %zu "
         "vectors, checkpoint formats), caches %.2f GiB (%d+1 slots x %d tokens, %s), workspace %.2f GiB",
         dev->arena_size / 1073741824.0, dev->stats.weight_bytes / 1073741824.0, dev->n_linears, dev->n_vectors,
         cache / 1073741824.0, o->max_batch, o->max_context,
         o->numerics == DSV4_NUMERICS_FP8 ? "FP8 KV entries, FP4 indexer keys" : "f32 entries",
         ws / 1073741824.0);
    if (o->ep_ranks > 0)
        vlog(dev, log, log_ctx, false, "cuda: expert parallelism: rank %d of %d, routed experts %d..%d of each layer",
             o->ep_rank, o->ep_ranks, wk.e0, wk.e1 - 1);
    log_placement(dev, log, log_ctx);
    vlog(dev, log, log_ctx, true, "op linear.fp8: %s (e4m3 128x128 UE8M0 weights, activations 1x128 e4m3); "
         "raw activations (wo_a, grouped in one launch; exact numerics): %s; K not a multiple of 128: %s",
         dsv4_cuda_variant_name(DSV4_CUDA_V_GEMM_FP8_MMA), dsv4_cuda_variant_name(DSV4_CUDA_V_GEMM_FP8RAW_MMA),
         dsv4_cuda_variant_name(DSV4_CUDA_V_GEMV_FP8));
    vlog(dev, log, log_ctx, true, "op linear.fp8 prefill chunks (more than %d rows, either activation form): %s%s%s",
         DSV4_CUDA_MAX_BATCH, dsv4_cuda_gemm_wgmma() ? dsv4_cuda_variant_name(DSV4_CUDA_V_GEMM_FP8_WGMMA)
                                                     : "mma.sync, the kernels above (no wgmma: ",
         dsv4_cuda_gemm_wgmma() ? "" : dsv4_cuda_gemm_wgmma_why_not(), dsv4_cuda_gemm_wgmma() ? "" : ")");
    vlog(dev, log, log_ctx, true, "op linear.fp8, linear.bf16 decode batches of 9-%d rows: %s", DSV4_CUDA_MAX_BATCH,
         dsv4_cuda_gemm_wgmma_decode() ? dsv4_cuda_variant_name(DSV4_CUDA_V_GEMM_WGMMA_DECODE)
         : dsv4_cuda_gemm_wgmma() ? "the mma.sync kernels above (DSV4_CUDA_GEMM_WGMMA_DECODE=0)"
                                  : "the mma.sync kernels above (no wgmma)");
    vlog(dev, log, log_ctx, true, "op linear rings: tensor-core linears with a %d-stage ring, the first wave "
         "prefetching up to %lld KB of weights; steps of up to 8 rows whose K is split (FP8 and BF16): %s",
         dsv4_cuda_gemm_stages(), (long long)(dsv4_cuda_gemm_prefetch_bytes() >> 10),
         dsv4_cuda_gemm_direct() ? dsv4_cuda_variant_name(DSV4_CUDA_V_GEMM_DIRECT) : "the ring (DSV4_CUDA_GEMM_DIRECT=0)");
    vlog(dev, log, log_ctx, true, "op linear.bf16: %s (K a multiple of 64; else %s)",
         dsv4_cuda_variant_name(DSV4_CUDA_V_GEMM_BF16_MMA), dsv4_cuda_variant_name(DSV4_CUDA_V_GEMV_BF16));
    vlog(dev, log, log_ctx, true, "op linear.f32: %s", dsv4_cuda_variant_name(DSV4_CUDA_V_GEMV_F32));
    vlog(dev, log, log_ctx, true, "op mhc fn: %s (K chunks of %d, fixed-order sum)",
         dsv4_cuda_variant_name(DSV4_CUDA_V_MHC_FN_SPLITK), DSV4_CUDA_MHC_FN_CHUNK);
    vlog(dev, log, log_ctx, true, "op linear.fp4: %s", dsv4_cuda_variant_name(DSV4_CUDA_V_GEMV_FP4));
    vlog(dev, log, log_ctx, true, "op experts: %s (FP4, fp8 numerics, dim and inter multiples of 128; "
         "DSV4_CUDA_MOE_MMA=0 turns it off); else %s / %s",
         dsv4_cuda_variant_name(DSV4_CUDA_V_EXPERTS_FP4), dsv4_cuda_variant_name(DSV4_CUDA_V_EXPERTS_FP4_FMA),
         dsv4_cuda_variant_name(DSV4_CUDA_V_EXPERTS_OTHER));
    vlog(dev, log, log_ctx, true, "op experts prefill chunks (more than %d rows): %s%s%s", DSV4_CUDA_MAX_BATCH,
         dsv4_cuda_moe_wgmma() ? dsv4_cuda_variant_name(DSV4_CUDA_V_EXPERTS_FP4_WGMMA)
                               : "mma.sync, the kernel above in CTAs of 8 warps (no wgmma: ",
         dsv4_cuda_moe_wgmma() ? "" : dsv4_cuda_moe_wgmma_why_not(), dsv4_cuda_moe_wgmma() ? "" : ")");
    vlog(dev, log, log_ctx, true, "op router: warp-per-token sqrtsoftplus top-k / hash table");
    vlog(dev, log, log_ctx, true, "op rmsnorm: block-per-row");
    vlog(dev, log, log_ctx, true, "op mhc pre: %s (blocks of 1024 columns per token, Sinkhorn in registers), "
         "post: thread-per-value", dsv4_cuda_variant_name(DSV4_CUDA_V_MHC_PRE));
    vlog(dev, log, log_ctx, true, "op attention: %s (FP8 entries) / %s (f32 entries), %d key splits, sinks, "
         "online combine + inverse RoPE; prefill chunks %s (%d heads a block; 0: the splits)",
         dsv4_cuda_variant_name(DSV4_CUDA_V_ATTENTION_MMA), dsv4_cuda_variant_name(DSV4_CUDA_V_ATTENTION_F32),
         DSV4_CUDA_ATT_SPLITS, dsv4_cuda_variant_name(DSV4_CUDA_V_ATTENTION_WHOLE),
         dsv4_cuda_attention_whole_heads());
    vlog(dev, log, log_ctx, true, "op sampling: on the device, one block per row (DSV4_CUDA_SAMPLE=0: on the host)");
    vlog(dev, log, log_ctx, true, "op compressor: block-per-row emission (pool from the step's rows + the slot's "
         "ring, norm, RoPE, FP8/FP4), then ring refresh");
    vlog(dev, log, log_ctx, true, "op indexer: keys %s; scores %s (FP4 keys of width 32/64/128, else %s), "
         "bitwise radix top-k per row", o->numerics == DSV4_NUMERICS_FP8 ? "FP4 68 B at 128 (official)" : "f32",
         dsv4_cuda_variant_name(DSV4_CUDA_V_INDEXER_MMA), dsv4_cuda_variant_name(DSV4_CUDA_V_INDEXER_FMA));
    vlog(dev, log, log_ctx, true, "op prefill: chunks of up to %d positions of one slot; up to %d replay the "
         "bucket graphs, longer ones launch the same kernels eagerly", dsv4_cuda_step_rows(o), o->max_batch);
    vlog(dev, log, log_ctx, true, "launch: %s", dsv4_cuda_pdl() ? "programmatic dependent launch (each kernel "
         "scheduled while the previous one drains; DSV4_CUDA_PDL=0 turns it off)" : "stream order (no programmatic "
         "dependent launch: image before sm_90, or DSV4_CUDA_PDL=0)");
    {
        struct dsv4_cuda_switches sw;
        char line[DSV4_CUDA_SWITCH_LINE];
        WALK(dsv4_cuda_switches_read(&sw));
        dsv4_cuda_switches_describe(&sw, line, sizeof(line));
        vlog(dev, log, log_ctx, false, "switches: %s", line);
    }
    DSV4_CUDA_TRY(cudaStreamSynchronize(dev->stream));
    return 0;
}

extern "C" int dsv4_cuda_dev_create(int ordinal, const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                                    void (*log)(void *ctx, const char *line), void *log_ctx,
                                    struct dsv4_cuda_dev **ret)
{
    struct dsv4_cuda_dev *dev;
    int n = dsv4_cuda_device_count(), rc;

    if (n == 0)
        return -ENODEV;
    if (ordinal < 0 || ordinal >= n)
        return dsv4_error_set(-ENODEV, "cuda: device %d asked for, %d present", ordinal, n);
    dev = static_cast<struct dsv4_cuda_dev *>(calloc(1, sizeof(*dev)));
    if (!dev)
        return dsv4_error_set(-ENOMEM, "cuda: device state");
    dev->ordinal = ordinal;
    rc = dev_boot(dev, w, opts, log, log_ctx);
    if (rc < 0) {
        dsv4_cuda_dev_destroy(dev);
        return rc;
    }
    *ret = dev;
    return 0;
}

extern "C" void dsv4_cuda_dev_destroy(struct dsv4_cuda_dev *dev)
{
    if (!dev)
        return;
    if (dev->stream)
        cudaStreamSynchronize(dev->stream);
    if (dev->lt)
        cublasLtDestroy(dev->lt);
    if (dev->stream)
        cudaStreamDestroy(dev->stream);
    cudaFree(dev->arena);
    cudaFreeHost(dev->host);
    dsv4_placement_free(dev->place);
    free(dev->layer_movable);
    free(dev->linears);
    free(dev->vectors);
    free(dev->experts);
    free(dev);
}

extern "C" void dsv4_cuda_dev_get_stats(const struct dsv4_cuda_dev *dev, struct dsv4_cuda_dev_stats *ret)
{
    *ret = dev->stats;
    for (int v = 0; v < DSV4_CUDA_V_COUNT; v++)
        ret->launches[v] = dsv4_cuda_variant_launches(static_cast<enum dsv4_cuda_variant>(v));
}

extern "C" const struct dsv4_cuda_linear *dsv4_cuda_dev_linear(const struct dsv4_cuda_dev *dev, const char *name)
{
    for (size_t i = 0; i < dev->n_linears; i++)
        if (dev->linears[i].name && strcmp(dev->linears[i].name, name) == 0)
            return &dev->linears[i].lin;
    return NULL;
}

extern "C" const void *dsv4_cuda_dev_vector(const struct dsv4_cuda_dev *dev, const void *host)
{
    for (size_t i = 0; i < dev->n_vectors; i++)
        if (dev->vectors[i].host == host)
            return dev->vectors[i].dev;
    return NULL;
}

extern "C" int dsv4_cuda_dev_experts(const struct dsv4_cuda_dev *dev, int layer, struct dsv4_cuda_experts *ret)
{
    if (layer < 0 || layer > dev->n_layers || !dev->experts[layer].d_table)    /* n_layers: the MTP block's */
        return dsv4_error_set(-ENOENT, "cuda: layer %d has no routed expert table on the device", layer);
    *ret = dev->experts[layer];
    return 0;
}

extern "C" const struct dsv4_cuda_linear *dsv4_cuda_dev_linear_for(const struct dsv4_cuda_dev *dev,
                                                                  const struct dsv4_linear *host)
{
    for (size_t i = 0; i < dev->n_linears; i++)
        if (dev->linears[i].host == host->w && dev->linears[i].lin.out == host->out &&
            dev->linears[i].lin.in == host->in)
            return &dev->linears[i].lin;
    return NULL;
}

extern "C" uint64_t *dsv4_cuda_dev_route_counts(const struct dsv4_cuda_dev *dev, int layer)
{
    return layer >= 0 && layer < dev->n_layers ? dev->route_counts + (int64_t)layer * dev->experts_per_layer : NULL;
}

extern "C" int dsv4_cuda_dev_read_route_counts(const struct dsv4_cuda_dev *dev, uint64_t *counts)
{
    /* the step's streams are non-blocking: the counts are those of the steps finished so far */
    DSV4_CUDA_TRY(cudaMemcpy(counts, dev->route_counts, sizeof(uint64_t) * (size_t)dev->n_layers *
                             (size_t)dev->experts_per_layer, cudaMemcpyDeviceToHost));
    return 0;
}

extern "C" const struct dsv4_cuda_fetch *dsv4_cuda_dev_fetch(const struct dsv4_cuda_dev *dev)
{
    return dev->fetch.slots ? &dev->fetch : NULL;
}

extern "C" int dsv4_cuda_dev_fetch_counts(const struct dsv4_cuda_dev *dev, uint64_t *copied, uint64_t *used)
{
    uint64_t v[2] = { 0, 0 };
    if (dev->fetch.slots)
        DSV4_CUDA_TRY(cudaMemcpy(v, dev->fetch.words + DSV4_CUDA_FETCH_COPIED, sizeof(v), cudaMemcpyDeviceToHost));
    *copied = v[0];
    *used = v[1];
    return 0;
}

extern "C" const struct dsv4_placement *dsv4_cuda_dev_placement(const struct dsv4_cuda_dev *dev)
{
    return dev->place;
}

extern "C" void *dsv4_cuda_dev_caches(const struct dsv4_cuda_dev *dev)
{
    return dev->caches;
}

extern "C" int dsv4_cuda_dev_carve(struct dsv4_cuda_dev *dev, size_t bytes, void **ret)
{
    return carve(dev, bytes, ret);
}

extern "C" void dsv4_cuda_dev_seal(struct dsv4_cuda_dev *dev)
{
    dev->sealed = true;
}

extern "C" void *dsv4_cuda_dev_stream(const struct dsv4_cuda_dev *dev)
{
    return dev->stream;
}

extern "C" const char *dsv4_cuda_dev_variants(const struct dsv4_cuda_dev *dev)
{
    return dev->variants;
}
