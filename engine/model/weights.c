/* SPDX-License-Identifier: MIT */
/* Weights: find every tensor the config implies in either spelling, check dtype and shape, and
 * describe it in place. Small vectors become owned f32 copies; matrices stay in the mapping in
 * their checkpoint format. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"
#include "engine/model/quant.h"
#include "engine/model/synth.h"
#include "engine/model/weights.h"

#define NAME_MAX_LEN 256
#define FP8_BLOCK 128
#define FP4_BLOCK 32

/* Every allocation the weights own, freed together. */
struct owned {
    void **ptrs;
    size_t n, cap;
};

/* Three spellings exist in practice: DeepSeek's release (layers.i.attn.wq_a.weight, per-expert
 * ffn.experts.E.w1.weight), transformers' module names (model.layers.i.self_attn.q_a_proj.weight,
 * stacked mlp.experts.gate_up_proj), and what transformers' save_pretrained writes, which reverts
 * its renames on the way out except the anchored top-level ones: model.layers.i.attn.wq_a.weight
 * with per-expert tensors, model.embed_tokens.weight, model.norm.weight, model.hc_head.hc_fn and
 * head.weight. So the layer prefix, the layer sub-names and each top-level tensor are detected
 * separately. */
struct loader {
    struct dsv4_weights *w;
    const struct dsv4_st *st;
    struct owned *own;
    const char *prefix;         /* "model." or "" before layers.i. */
    bool hf;                    /* transformers sub-names inside a layer */
    uint8_t *used;              /* [dsv4_st_count] tensors some part of the model took */
};

static void mark_used(struct loader *L, const struct dsv4_st_tensor *t)
{
    L->used[t - dsv4_st_at(L->st, 0)] = 1;
}

static void *own_alloc(struct loader *L, size_t size)
{
    struct owned *o = L->own;
    void *p;

    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 256;
        void **np = realloc(o->ptrs, cap * sizeof(*np));

        if (!np)
            return NULL;
        o->ptrs = np;
        o->cap = cap;
    }
    /* 64-byte alignment for rows handed to vector code; never zero bytes (empty tensors) */
    p = aligned_alloc(64, size ? (size + 63) / 64 * 64 : 64);
    if (p)
        o->ptrs[o->n++] = p;
    return p;
}

static const char *fmt_name(char *buf, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static const char *fmt_name(char *buf, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, NAME_MAX_LEN, fmt, ap);
    va_end(ap);
    return buf;
}

static const struct dsv4_st_tensor *need(struct loader *L, const char *name, int *r)
{
    const struct dsv4_st_tensor *t = dsv4_st_find(L->st, name);

    if (!t) {
        *r = dsv4_error_set(-ENOENT, "tensor %s: missing from %s", name, dsv4_st_source(L->st));
        return NULL;
    }
    mark_used(L, t);
    *r = 0;
    return t;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t off = (size_t)snprintf(buf, n, "[");

    for (int i = 0; i < ndim && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (off < n)
        snprintf(buf + off, n - off, "]");
}

static int check_shape(const struct dsv4_st_tensor *t, int ndim, const int64_t *shape)
{
    char got[96], want[96];
    bool ok = t->ndim == ndim;

    for (int i = 0; ok && i < ndim; i++)
        ok = t->shape[i] == shape[i];
    if (ok)
        return 0;
    shape_str(got, sizeof(got), t->ndim, t->shape);
    shape_str(want, sizeof(want), ndim, shape);
    return dsv4_error_set(-EINVAL, "tensor %s in %s: shape %s, expected %s", t->name, t->file, got, want);
}

static bool is_float(enum dsv4_dtype dt)
{
    return dt == DSV4_DT_F32 || dt == DSV4_DT_BF16 || dt == DSV4_DT_F16;
}

static int want_float(const struct dsv4_st_tensor *t)
{
    if (is_float(t->dtype))
        return 0;
    return dsv4_error_set(-EINVAL, "tensor %s in %s: dtype %s, expected F32, BF16 or F16",
                          t->name, t->file, dsv4_dtype_name(t->dtype));
}

static float float_at(const struct dsv4_st_tensor *t, size_t i)
{
    const uint8_t *p = (const uint8_t *)t->data + i * dsv4_dtype_size(t->dtype);
    uint16_t h;
    float f;

    switch (t->dtype) {
    case DSV4_DT_F32:
        memcpy(&f, p, 4);
        return f;
    case DSV4_DT_BF16:
        memcpy(&h, p, 2);
        return dsv4_bf16_to_f32(h);
    default:
        memcpy(&h, p, 2);
        return dsv4_f16_to_f32(h);
    }
}

/* A float tensor of the given shape as an owned f32 copy. */
static int load_f32(struct loader *L, const char *name, int ndim, const int64_t *shape, const float **ret)
{
    const struct dsv4_st_tensor *t;
    size_t n = 1;
    float *out;
    int r;

    t = need(L, name, &r);
    if (!t)
        return r;
    if ((r = want_float(t)) < 0 || (r = check_shape(t, ndim, shape)) < 0)
        return r;
    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    out = own_alloc(L, n * sizeof(float));
    if (!out)
        return dsv4_error_set(-ENOMEM, "out of memory loading %s", name);
    for (size_t i = 0; i < n; i++)
        out[i] = float_at(t, i);
    L->w->bytes_total += t->nbytes;
    *ret = out;
    return 0;
}

static int load_vec(struct loader *L, const char *name, int64_t n, const float **ret)
{
    return load_f32(L, name, 1, &n, ret);
}

/* Float matrix data pointer, copied when the mapping's address is not aligned for the element
 * type (safetensors does not align tensors; the compute code reads them as typed arrays). */
static int float_data(struct loader *L, const struct dsv4_st_tensor *t, const void **ret)
{
    size_t es = dsv4_dtype_size(t->dtype);
    void *copy;

    if ((uintptr_t)t->data % es == 0) {
        *ret = t->data;
        return 0;
    }
    copy = own_alloc(L, t->nbytes);
    if (!copy)
        return dsv4_error_set(-ENOMEM, "out of memory copying %s", t->name);
    memcpy(copy, t->data, t->nbytes);
    *ret = copy;
    return 0;
}

static enum dsv4_wfmt float_fmt(enum dsv4_dtype dt)
{
    return dt == DSV4_DT_F32 ? DSV4_W_F32 : dt == DSV4_DT_BF16 ? DSV4_W_BF16 : DSV4_W_F16;
}

/* The UE8M0 scale sibling of a quantized weight: NAME minus ".weight" plus ".scale", or
 * NAME + "_scale_inv" (older files). F8_E8M0/U8 bytes are used in place; F32 scales (older
 * files) must be powers of two and become owned exponent bytes. */
static int load_scale(struct loader *L, const struct dsv4_st_tensor *wt, int64_t rows, int64_t cols,
                      const uint8_t **ret)
{
    char name[NAME_MAX_LEN];
    const struct dsv4_st_tensor *s = NULL;
    size_t len = strlen(wt->name);
    int64_t shape[2] = { rows, cols };
    uint8_t *copy;
    int r;

    if (len > 7 && strcmp(wt->name + len - 7, ".weight") == 0) {
        snprintf(name, sizeof(name), "%.*s.scale", (int)(len - 7), wt->name);
        s = dsv4_st_find(L->st, name);
    }
    if (!s) {
        snprintf(name, sizeof(name), "%s_scale_inv", wt->name);
        s = dsv4_st_find(L->st, name);
    }
    if (!s)
        return dsv4_error_set(-ENOENT, "tensor %s in %s: quantized (%s) but its scale (.scale or "
                              "_scale_inv) is missing from %s", wt->name, wt->file,
                              dsv4_dtype_name(wt->dtype), dsv4_st_source(L->st));
    mark_used(L, s);
    if ((r = check_shape(s, 2, shape)) < 0)
        return r;
    L->w->bytes_total += s->nbytes;
    L->w->bytes_quantized += s->nbytes;
    if (s->dtype == DSV4_DT_F8_E8M0 || s->dtype == DSV4_DT_U8) {
        *ret = s->data;
        return 0;
    }
    if (s->dtype != DSV4_DT_F32)
        return dsv4_error_set(-EINVAL, "tensor %s in %s: dtype %s, expected F8_E8M0 (or F32 powers of two)",
                              s->name, s->file, dsv4_dtype_name(s->dtype));
    copy = own_alloc(L, (size_t)(rows * cols));
    if (!copy)
        return dsv4_error_set(-ENOMEM, "out of memory loading %s", s->name);
    for (int64_t i = 0; i < rows * cols; i++) {
        float f = float_at(s, (size_t)i);
        int e = 0;

        if (!(f > 0.0f) || frexpf(f, &e) != 0.5f || e - 1 + 127 < 0 || e - 1 + 127 > 254)
            return dsv4_error_set(-EINVAL, "tensor %s in %s: element %lld = %g is not a power of two; "
                                  "only UE8M0 block scales are supported", s->name, s->file,
                                  (long long)i, (double)f);
        copy[i] = (uint8_t)(e - 1 + 127);
    }
    *ret = copy;
    return 0;
}

static int load_linear(struct loader *L, const char *name, int64_t out, int64_t in, struct dsv4_linear *ret)
{
    const struct dsv4_st_tensor *t;
    int64_t shape[2] = { out, in };
    int r;

    t = need(L, name, &r);
    if (!t)
        return r;
    memset(ret, 0, sizeof(*ret));
    ret->out = out;
    ret->in = in;
    ret->row_stride = in;
    ret->name = t->name;
    L->w->bytes_total += t->nbytes;
    if (is_float(t->dtype)) {
        if ((r = check_shape(t, 2, shape)) < 0)
            return r;
        ret->fmt = float_fmt(t->dtype);
        return float_data(L, t, &ret->w);
    }
    if (t->dtype == DSV4_DT_F8_E4M3) {
        if ((r = check_shape(t, 2, shape)) < 0)
            return r;
        ret->fmt = DSV4_W_FP8;
        ret->w = t->data;
        ret->scale_stride = (in + FP8_BLOCK - 1) / FP8_BLOCK;
        L->w->bytes_quantized += t->nbytes;
        return load_scale(L, t, (out + FP8_BLOCK - 1) / FP8_BLOCK, ret->scale_stride, &ret->scale);
    }
    if (t->dtype == DSV4_DT_I8 || t->dtype == DSV4_DT_U8) {
        shape[1] = in / 2;
        if (in % FP4_BLOCK)
            return dsv4_error_set(-EINVAL, "tensor %s in %s: packed FP4 needs an input width divisible by "
                                  "%d, the config implies %lld", t->name, t->file, FP4_BLOCK, (long long)in);
        if ((r = check_shape(t, 2, shape)) < 0)
            return r;
        ret->fmt = DSV4_W_FP4;
        ret->w = t->data;
        ret->scale_stride = in / FP4_BLOCK;
        L->w->bytes_quantized += t->nbytes;
        return load_scale(L, t, out, ret->scale_stride, &ret->scale);
    }
    return dsv4_error_set(-EINVAL, "tensor %s in %s: dtype %s, expected F32, BF16, F16, F8_E4M3 (with a "
                          "UE8M0 scale) or I8/U8 packed FP4", t->name, t->file, dsv4_dtype_name(t->dtype));
}

/* transformers' stacked experts: a float [E, rows, in] tensor; expert e's matrix starts at row
 * e*rows + row0 and has `out` rows. */
static void stacked_view(const struct dsv4_st_tensor *t, const void *data, int64_t e,
                        int64_t rows, int64_t row0, int64_t out, int64_t in, struct dsv4_linear *ret)
{
    size_t es = dsv4_dtype_size(t->dtype);

    memset(ret, 0, sizeof(*ret));
    ret->fmt = float_fmt(t->dtype);
    ret->out = out;
    ret->in = in;
    ret->row_stride = in;
    ret->w = (const uint8_t *)data + ((size_t)(e * rows + row0) * (size_t)in) * es;
    ret->name = t->name;
}

static int load_ids(struct loader *L, const char *name, int64_t rows, int64_t cols, int n_experts,
                    const int32_t **ret)
{
    const struct dsv4_st_tensor *t;
    int64_t shape[2] = { rows, cols };
    int32_t *out;
    int r;

    t = need(L, name, &r);
    if (!t)
        return r;
    if (t->dtype != DSV4_DT_I32 && t->dtype != DSV4_DT_I64)
        return dsv4_error_set(-EINVAL, "tensor %s in %s: dtype %s, expected I32 or I64", t->name, t->file,
                              dsv4_dtype_name(t->dtype));
    if ((r = check_shape(t, 2, shape)) < 0)
        return r;
    out = own_alloc(L, (size_t)(rows * cols) * sizeof(int32_t));
    if (!out)
        return dsv4_error_set(-ENOMEM, "out of memory loading %s", name);
    for (int64_t i = 0; i < rows * cols; i++) {
        int64_t v;

        if (t->dtype == DSV4_DT_I64) {
            memcpy(&v, (const uint8_t *)t->data + 8 * i, 8);
        } else {
            int32_t v32;

            memcpy(&v32, (const uint8_t *)t->data + 4 * i, 4);
            v = v32;
        }
        if (v < 0 || v >= n_experts)
            return dsv4_error_set(-EINVAL, "tensor %s in %s: token %lld maps to expert %lld, outside "
                                  "[0, %d)", t->name, t->file, (long long)(i / cols), (long long)v, n_experts);
        out[i] = (int32_t)v;
    }
    L->w->bytes_total += t->nbytes;
    *ret = out;
    return 0;
}

/* Spelling-dependent relative name. */
#define SP(L, hf_name, official_name) ((L)->hf ? (hf_name) : (official_name))

static int load_hc(struct loader *L, const char *prefix, const char *site, struct dsv4_hc *ret)
{
    const struct dsv4_config *c = &L->w->cfg;
    int64_t mix = (int64_t)(2 + c->hc_mult) * c->hc_mult;
    char n[NAME_MAX_LEN];
    int r;

    if ((r = load_linear(L, L->hf ? fmt_name(n, "%s%s_hc.fn", prefix, site) :
                         fmt_name(n, "%shc_%s_fn", prefix, site), mix, (int64_t)c->hc_mult * c->dim, &ret->fn)) < 0 ||
        (r = load_vec(L, L->hf ? fmt_name(n, "%s%s_hc.base", prefix, site) :
                      fmt_name(n, "%shc_%s_base", prefix, site), mix, &ret->base)) < 0 ||
        (r = load_vec(L, L->hf ? fmt_name(n, "%s%s_hc.scale", prefix, site) :
                      fmt_name(n, "%shc_%s_scale", prefix, site), 3, &ret->scale)) < 0)
        return r;
    return 0;
}

/* hc_head: official hc_head_{fn,base,scale}; transformers model.hc_head.hc_{fn,base,scale}. */
static int load_hc_head(struct loader *L, const char *prefix, bool hf, struct dsv4_hc_head *ret)
{
    const struct dsv4_config *c = &L->w->cfg;
    const char *sep = hf ? "hc_head.hc_" : "hc_head_";
    char n[NAME_MAX_LEN];
    int r;

    if ((r = load_linear(L, fmt_name(n, "%s%sfn", prefix, sep), c->hc_mult,
                         (int64_t)c->hc_mult * c->dim, &ret->fn)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%s%sbase", prefix, sep), c->hc_mult, &ret->base)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%s%sscale", prefix, sep), 1, &ret->scale)) < 0)
        return r;
    return 0;
}

/* One compressor at `base` ("...compressor." or "...indexer.compressor."/"...compressor.indexer."). */
static int load_compressor(struct loader *L, const char *base, int ratio, int dim, bool overlap,
                           struct dsv4_compressor *ret)
{
    const struct dsv4_config *c = &L->w->cfg;
    int64_t width = (overlap ? 2 : 1) * (int64_t)dim, ape_shape[2] = { ratio, width };
    char n[NAME_MAX_LEN];
    int r;

    ret->ratio = ratio;
    ret->dim = dim;
    ret->overlap = overlap;
    if ((r = load_linear(L, fmt_name(n, "%s%s", base, SP(L, "kv_proj.weight", "wkv.weight")), width,
                         c->dim, &ret->wkv)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", base, SP(L, "gate_proj.weight", "wgate.weight")), width,
                         c->dim, &ret->wgate)) < 0 ||
        (r = load_f32(L, fmt_name(n, "%s%s", base, SP(L, "position_bias", "ape")), 2, ape_shape, &ret->ape)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%s%s", base, SP(L, "kv_norm.weight", "norm.weight")), dim, &ret->norm)) < 0)
        return r;
    return 0;
}

/* The attention's kv_norm: save_pretrained's reverse renaming turns DeepSeek's attn.kv_norm
 * into attn.norm (its forward rule maps every ".norm." to ".kv_norm."), so both are accepted. */
static const char *kv_norm_name(const struct loader *L, const char *p, char *a, char *b)
{
    if (L->hf)
        return fmt_name(a, "%sself_attn.kv_norm.weight", p);
    fmt_name(a, "%sattn.kv_norm.weight", p);
    fmt_name(b, "%sattn.norm.weight", p);
    return dsv4_st_find(L->st, a) || !dsv4_st_find(L->st, b) ? a : b;
}

static int load_attn(struct loader *L, const char *p, int ratio, struct dsv4_attn *a)
{
    const struct dsv4_config *c = &L->w->cfg;
    int64_t hd = (int64_t)c->n_heads * c->head_dim;
    char n[NAME_MAX_LEN], base[NAME_MAX_LEN];
    int r;

    if ((r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.q_a_proj.weight", "attn.wq_a.weight")),
                         c->q_lora_rank, c->dim, &a->wq_a)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.q_a_norm.weight", "attn.q_norm.weight")),
                      c->q_lora_rank, &a->q_norm)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.q_b_proj.weight", "attn.wq_b.weight")),
                         hd, c->q_lora_rank, &a->wq_b)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.kv_proj.weight", "attn.wkv.weight")),
                         c->head_dim, c->dim, &a->wkv)) < 0 ||
        (r = load_vec(L, kv_norm_name(L, p, n, base), c->head_dim, &a->kv_norm)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.o_a_proj.weight", "attn.wo_a.weight")),
                         (int64_t)c->o_groups * c->o_lora_rank, hd / c->o_groups, &a->wo_a)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.o_b_proj.weight", "attn.wo_b.weight")),
                         c->dim, (int64_t)c->o_groups * c->o_lora_rank, &a->wo_b)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.sinks", "attn.attn_sink")),
                      c->n_heads, &a->sink)) < 0)
        return r;
    if (ratio == 0)
        return 0;
    fmt_name(base, "%s%s", p, SP(L, "self_attn.compressor.", "attn.compressor."));
    if ((r = load_compressor(L, base, ratio, c->head_dim, ratio == c->csa_ratio, &a->comp)) < 0)
        return r;
    if (ratio != c->csa_ratio)
        return 0;
    fmt_name(base, "%s%s", p, SP(L, "self_attn.compressor.indexer.", "attn.indexer.compressor."));
    if ((r = load_compressor(L, base, ratio, c->index_head_dim, true, &a->indexer.comp)) < 0)
        return r;
    if ((r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.compressor.indexer.q_b_proj.weight",
                                                      "attn.indexer.wq_b.weight")),
                         (int64_t)c->index_n_heads * c->index_head_dim, c->q_lora_rank, &a->indexer.wq_b)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "self_attn.compressor.indexer.scorer.weights_proj.weight",
                                                      "attn.indexer.weights_proj.weight")),
                         c->index_n_heads, c->dim, &a->indexer.weights_proj)) < 0)
        return r;
    return 0;
}

/* transformers' experts: gate_up_proj [E, 2I, D] (gate rows first, then up: the forward chunks
 * the 2I outputs in halves) and down_proj [E, D, I]. */
static int load_experts_hf(struct loader *L, const char *p, struct dsv4_ffn *f)
{
    const struct dsv4_config *c = &L->w->cfg;
    int64_t E = c->n_experts, I = c->moe_inter, D = c->dim;
    int64_t gu_shape[3] = { E, 2 * I, D }, dn_shape[3] = { E, D, I };
    const struct dsv4_st_tensor *gu, *dn;
    const void *gu_data, *dn_data;
    char n[NAME_MAX_LEN];
    int r;

    if (!(gu = need(L, fmt_name(n, "%smlp.experts.gate_up_proj", p), &r)))
        return r;
    if (!(dn = need(L, fmt_name(n, "%smlp.experts.down_proj", p), &r)))
        return r;
    if (!is_float(gu->dtype) || !is_float(dn->dtype))
        return dsv4_error_set(-ENOTSUP, "tensor %s in %s: dtype %s; stacked experts are supported in "
                              "F32, BF16 or F16 only", is_float(gu->dtype) ? dn->name : gu->name,
                              is_float(gu->dtype) ? dn->file : gu->file,
                              dsv4_dtype_name(is_float(gu->dtype) ? dn->dtype : gu->dtype));
    if ((r = check_shape(gu, 3, gu_shape)) < 0 || (r = check_shape(dn, 3, dn_shape)) < 0 ||
        (r = float_data(L, gu, &gu_data)) < 0 || (r = float_data(L, dn, &dn_data)) < 0)
        return r;
    L->w->bytes_total += gu->nbytes + dn->nbytes;
    for (int64_t e = 0; e < E; e++) {
        stacked_view(gu, gu_data, e, 2 * I, 0, I, D, &f->w1[e]);
        stacked_view(gu, gu_data, e, 2 * I, I, I, D, &f->w3[e]);
        stacked_view(dn, dn_data, e, D, 0, D, I, &f->w2[e]);
    }
    return 0;
}

static int load_ffn(struct loader *L, const char *p, enum dsv4_mlp_type type, struct dsv4_ffn *f)
{
    const struct dsv4_config *c = &L->w->cfg;
    int64_t E = c->n_experts, I = c->moe_inter, D = c->dim;
    char n[NAME_MAX_LEN];
    int r;

    f->type = type;
    f->w1 = own_alloc(L, (size_t)E * sizeof(*f->w1));
    f->w2 = own_alloc(L, (size_t)E * sizeof(*f->w2));
    f->w3 = own_alloc(L, (size_t)E * sizeof(*f->w3));
    if (!f->w1 || !f->w2 || !f->w3)
        return dsv4_error_set(-ENOMEM, "out of memory loading %sexperts", p);
    if ((r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "mlp.gate.weight", "ffn.gate.weight")), E, D,
                         &f->gate)) < 0)
        return r;
    if (type == DSV4_MLP_HASH)
        r = load_ids(L, fmt_name(n, "%s%s", p, SP(L, "mlp.gate.tid2eid", "ffn.gate.tid2eid")),
                     c->vocab_size, c->n_experts_per_tok, c->n_experts, &f->tid2eid);
    else
        r = load_vec(L, fmt_name(n, "%s%s", p, SP(L, "mlp.gate.e_score_correction_bias", "ffn.gate.bias")),
                     E, &f->gate_bias);
    if (r < 0)
        return r;
    if (L->hf) {
        if ((r = load_experts_hf(L, p, f)) < 0)
            return r;
    } else {
        for (int64_t e = 0; e < E; e++)
            if ((r = load_linear(L, fmt_name(n, "%sffn.experts.%lld.w1.weight", p, (long long)e), I, D,
                                 &f->w1[e])) < 0 ||
                (r = load_linear(L, fmt_name(n, "%sffn.experts.%lld.w3.weight", p, (long long)e), I, D,
                                 &f->w3[e])) < 0 ||
                (r = load_linear(L, fmt_name(n, "%sffn.experts.%lld.w2.weight", p, (long long)e), D, I,
                                 &f->w2[e])) < 0)
                return r;
    }
    /* one shared expert of width moe_intermediate_size (the config refuses other counts) */
    if ((r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "mlp.shared_experts.gate_proj.weight",
                                                      "ffn.shared_experts.w1.weight")), I, D, &f->sw1)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "mlp.shared_experts.up_proj.weight",
                                                      "ffn.shared_experts.w3.weight")), I, D, &f->sw3)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%s%s", p, SP(L, "mlp.shared_experts.down_proj.weight",
                                                      "ffn.shared_experts.w2.weight")), D, I, &f->sw2)) < 0)
        return r;
    return 0;
}

static int load_layer(struct loader *L, const char *p, int ratio, enum dsv4_mlp_type type,
                      struct dsv4_layer *ly)
{
    const struct dsv4_config *c = &L->w->cfg;
    char n[NAME_MAX_LEN];
    int r;

    ly->ratio = ratio;
    if ((r = load_vec(L, fmt_name(n, "%s%s", p, SP(L, "input_layernorm.weight", "attn_norm.weight")),
                      c->dim, &ly->attn_norm)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%s%s", p, SP(L, "post_attention_layernorm.weight", "ffn_norm.weight")),
                      c->dim, &ly->ffn_norm)) < 0 ||
        (r = load_hc(L, p, "attn", &ly->hc_attn)) < 0 ||
        (r = load_hc(L, p, "ffn", &ly->hc_ffn)) < 0 ||
        (r = load_attn(L, p, ratio, &ly->attn)) < 0 ||
        (r = load_ffn(L, p, type, &ly->ffn)) < 0)
        return r;
    return 0;
}

/* MTP block k: the layer in the checkpoint's spelling under "[model.]mtp.k.", its own
 * projections, norms and hc_head under DeepSeek's names (transformers drops MTP weights, so no
 * other spelling exists). Its layer is sliding-window with scored routing. */
static int load_mtp(struct loader *L, int k, struct dsv4_mtp *m)
{
    const struct dsv4_config *c = &L->w->cfg;
    char p[NAME_MAX_LEN], n[NAME_MAX_LEN];
    int r;

    fmt_name(p, "%smtp.%d.", L->prefix, k);
    if ((r = load_vec(L, fmt_name(n, "%senorm.weight", p), c->dim, &m->enorm)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%shnorm.weight", p), c->dim, &m->hnorm)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%se_proj.weight", p), c->dim, c->dim, &m->e_proj)) < 0 ||
        (r = load_linear(L, fmt_name(n, "%sh_proj.weight", p), c->dim, c->dim, &m->h_proj)) < 0 ||
        (r = load_vec(L, fmt_name(n, "%snorm.weight", p), c->dim, &m->norm)) < 0 ||
        (r = load_hc_head(L, p, false, &m->hc_head)) < 0 ||
        (r = load_layer(L, p, 0, DSV4_MLP_MOE, &m->layer)) < 0)
        return r;
    return 0;
}

/* The first of the spellings' names that the checkpoint has (the first when none). */
static const char *pick(const struct loader *L, const char *a, const char *b, const char *c)
{
    if (dsv4_st_find(L->st, a))
        return a;
    if (dsv4_st_find(L->st, b))
        return b;
    if (c && dsv4_st_find(L->st, c))
        return c;
    return a;
}

static int detect_spelling(struct loader *L)
{
    char n[NAME_MAX_LEN];

    if (dsv4_st_find(L->st, "model.layers.0.input_layernorm.weight") ||
        dsv4_st_find(L->st, "model.layers.0.attn_norm.weight"))
        L->prefix = "model.";
    else if (dsv4_st_find(L->st, "layers.0.attn_norm.weight") ||
             dsv4_st_find(L->st, "layers.0.input_layernorm.weight"))
        L->prefix = "";
    else
        return dsv4_error_set(-ENOENT, "tensor layers.0.attn_norm.weight (DeepSeek) or "
                              "model.layers.0.input_layernorm.weight (transformers): missing from %s",
                              dsv4_st_source(L->st));
    L->hf = dsv4_st_find(L->st, fmt_name(n, "%slayers.0.input_layernorm.weight", L->prefix)) != NULL;
    return 0;
}

static int load_all(struct loader *L)
{
    struct dsv4_weights *w = L->w;
    const struct dsv4_config *c = &w->cfg;
    const char *hc_name;
    char p[NAME_MAX_LEN], n[NAME_MAX_LEN];
    int r;

    if ((r = detect_spelling(L)) < 0)
        return r;
    if ((r = load_linear(L, pick(L, "model.embed_tokens.weight", "embed.weight", NULL), c->vocab_size,
                         c->dim, &w->embed)) < 0)
        return r;
    if (c->tie_embeddings)
        w->head = w->embed;
    else if ((r = load_linear(L, pick(L, "lm_head.weight", "head.weight", NULL), c->vocab_size, c->dim,
                              &w->head)) < 0)
        return r;
    if ((r = load_vec(L, pick(L, "model.norm.weight", "norm.weight", NULL), c->dim, &w->norm)) < 0)
        return r;
    hc_name = pick(L, "model.hc_head.hc_fn", "hc_head_fn", "model.hc_head_fn");
    if (strcmp(hc_name, "model.hc_head.hc_fn") == 0)
        r = load_hc_head(L, "model.", true, &w->hc_head);
    else
        r = load_hc_head(L, strcmp(hc_name, "hc_head_fn") == 0 ? "" : "model.", false, &w->hc_head);
    if (r < 0)
        return r;

    w->layers = own_alloc(L, (size_t)c->n_layers * sizeof(*w->layers));
    if (!w->layers)
        return dsv4_error_set(-ENOMEM, "out of memory loading layers");
    memset(w->layers, 0, (size_t)c->n_layers * sizeof(*w->layers));
    for (int i = 0; i < c->n_layers; i++) {
        fmt_name(p, "%slayers.%d.", L->prefix, i);
        if ((r = load_layer(L, p, c->compress_ratio[i], c->mlp_type[i], &w->layers[i])) < 0)
            return r;
    }

    /* MTP blocks are optional: load the ones present, in order */
    w->mtp = own_alloc(L, (size_t)(c->n_mtp_layers + 1) * sizeof(*w->mtp));
    if (!w->mtp)
        return dsv4_error_set(-ENOMEM, "out of memory loading MTP");
    memset(w->mtp, 0, (size_t)(c->n_mtp_layers + 1) * sizeof(*w->mtp));
    for (int k = 0; k < c->n_mtp_layers; k++) {
        if (!dsv4_st_find(L->st, fmt_name(n, "%smtp.%d.e_proj.weight", L->prefix, k)))
            break;
        if ((r = load_mtp(L, k, &w->mtp[k])) < 0)
            return r;
        w->n_mtp = k + 1;
    }

    for (size_t i = 0; i < dsv4_st_count(L->st); i++)
        if (!L->used[i]) {
            if (!w->n_unused)
                w->first_unused = dsv4_st_at(L->st, i)->name;
            w->n_unused++;
        }
    return 0;
}

int dsv4_weights_load(const char *dir, struct dsv4_weights **ret)
{
    struct dsv4_weights *w = calloc(1, sizeof(*w));
    struct owned *own = calloc(1, sizeof(*own));
    struct loader L = { .w = w, .own = own };
    struct dsv4_synth_recipe recipe;
    int r;

    if (!w || !own) {
        free(w);
        free(own);
        return dsv4_error_set(-ENOMEM, "out of memory loading %s", dir);
    }
    w->owned = own;
    r = dsv4_config_load(dir, &w->cfg);
    if (r == 0)
        r = dsv4_synth_recipe_read(dir, &w->cfg, &recipe);
    if (r == 1) {
        char source[4096];

        snprintf(source, sizeof(source), "%s/%s", dir, DSV4_SYNTH_RECIPE);
        r = dsv4_synth_tensors(&w->cfg, &recipe, source, &w->st);
        w->synthetic = true;
    } else if (r == 0) {
        r = dsv4_st_open(dir, &w->st);
    }
    if (r == 0) {
        L.st = w->st;
        L.used = calloc(dsv4_st_count(w->st) + 1, 1);
        r = L.used ? load_all(&L) : dsv4_error_set(-ENOMEM, "out of memory loading %s", dir);
        free(L.used);
    }
    if (r < 0) {
        dsv4_error_prefix(r, "loading %s: ", dir);
        dsv4_weights_free(w);
        return r;
    }
    *ret = w;
    return 0;
}

void dsv4_weights_free(struct dsv4_weights *w)
{
    struct owned *o;

    if (!w)
        return;
    o = w->owned;
    if (o) {
        for (size_t i = 0; i < o->n; i++)
            free(o->ptrs[i]);
        free(o->ptrs);
        free(o);
    }
    dsv4_st_close(w->st);
    free(w);
}
