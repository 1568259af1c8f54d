/* SPDX-License-Identifier: MIT */
/* engine/model/weights + engine/model/linear: tiny checkpoints written here in each spelling (DeepSeek's,
 * transformers' state_dict, transformers' save_pretrained), single file or sharded, float or
 * quantized; every spelling must load into identical structs, and every broken checkpoint must
 * fail with a message naming the tensor and the file. The GEMV is checked against an explicit
 * dequantize-then-multiply in double precision. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/model/quant.h"
#include "engine/model/weights.h"
#include "tests/unit/seed_util.h"
#include "tests/unit/st_writer.h"

/* The test model: hc_mult 2 (not 4), one sliding, one CSA (ratio 4), one HCA (ratio 8) layer
 * after a sliding one; the first two layers hash-routed. */
#define V 50
#define D 64
#define NL 4
#define H 4
#define HD 32
#define QL 32
#define OG 2
#define OLR 16
#define E 4
#define TOPK 2
#define I_ 32
#define IH 2
#define IDIM 16
#define HC 2
#define CSA 4
#define HCA 8

static const int layer_ratio[NL] = { 0, 0, CSA, HCA };
static const bool layer_hash[NL] = { true, true, false, false };

static const char config_json[] =
    "{\"model_type\": \"deepseek_v4\", \"vocab_size\": 50, \"hidden_size\": 64, \"num_hidden_layers\": 4,"
    " \"num_attention_heads\": 4, \"head_dim\": 32, \"qk_rope_head_dim\": 8, \"q_lora_rank\": 32,"
    " \"o_groups\": 2, \"o_lora_rank\": 16, \"n_routed_experts\": 4, \"num_experts_per_tok\": 2,"
    " \"moe_intermediate_size\": 32, \"index_n_heads\": 2, \"index_head_dim\": 16, \"index_topk\": 2,"
    " \"hc_mult\": 2, \"sliding_window\": 8, \"num_nextn_predict_layers\": 1,"
    " \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 8},"
    " \"layer_types\": [\"sliding_attention\", \"sliding_attention\", \"compressed_sparse_attention\","
    "                  \"heavily_compressed_attention\"],"
    " \"mlp_layer_types\": [\"hash_moe\", \"hash_moe\", \"moe\", \"moe\"]}";

enum spelling { SP_OFFICIAL, SP_HF, SP_SAVED };

/* One generated checkpoint. Values derive from the DeepSeek name of each tensor and the run's
 * seed, so every spelling carries the same numbers. */
struct gen {
    enum spelling sp;
    bool quant;                 /* DeepSeek spelling only: FP8 wq_b/wkv, FP4 routed experts */
    bool mtp;
    uint64_t seed;
    struct stw_tensor t[1024];
    char *names[1024];
    void *bufs[1024];
    size_t n;
    /* breakage for the failure tests, by the name as written */
    const char *skip;
    const char *bad_dtype;      /* written as I32 of the same element count */
    const char *bad_shape;      /* first dimension one larger */
};

static uint64_t test_seed;

static uint64_t name_seed(const struct gen *g, const char *canon)
{
    uint64_t h = 1469598103934665603ull ^ g->seed;

    for (const char *p = canon; *p; p++)
        h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return h | 1;
}

static void emit(struct gen *g, const char *name, const char *dtype, int ndim, const int64_t *shape,
                 void *data, size_t nbytes)
{
    struct stw_tensor *t;

    if (g->skip && strcmp(name, g->skip) == 0) {
        free(data);
        return;
    }
    assert_true(g->n < sizeof(g->t) / sizeof(g->t[0]));
    t = &g->t[g->n];
    g->names[g->n] = strdup(name);
    g->bufs[g->n] = data;
    t->name = g->names[g->n];
    t->dtype = dtype;
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof(int64_t));
    t->data = data;
    t->nbytes = nbytes;
    if (g->bad_dtype && strcmp(name, g->bad_dtype) == 0)
        t->dtype = "I32";
    if (g->bad_shape && strcmp(name, g->bad_shape) == 0) {
        /* one more leading row, zero-filled so the header stays self-consistent */
        size_t bytes = nbytes / (size_t)shape[0] * (size_t)(shape[0] + 1);

        t->shape[0] += 1;
        free(data);
        g->bufs[g->n] = calloc(1, bytes);
        t->data = g->bufs[g->n];
        t->nbytes = bytes;
    }
    g->n++;
}

static float *fill(const struct gen *g, const char *canon, size_t n)
{
    uint64_t s = name_seed(g, canon);
    float *p = malloc(n * sizeof(float));

    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = stw_uniform(&s);
    return p;
}

static void gen_free(struct gen *g)
{
    for (size_t i = 0; i < g->n; i++) {
        free(g->names[i]);
        free(g->bufs[i]);
    }
    g->n = 0;
}

/* name in g's spelling: prefix is "layers.i." or "mtp.k." (DeepSeek form) */
static void spell(const struct gen *g, char *out, const char *prefix, const char *off, const char *hf)
{
    bool model = g->sp != SP_OFFICIAL;

    if (g->sp == SP_SAVED && strcmp(off, "attn.kv_norm.weight") == 0)
        off = "attn.norm.weight";
    snprintf(out, 256, "%s%s%s", model ? "model." : "", prefix, g->sp == SP_HF ? hf : off);
}

static void f32_tensor(struct gen *g, const char *prefix, const char *off, const char *hf, int ndim,
                       const int64_t *shape)
{
    char canon[256], name[256];
    size_t n = 1;

    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    snprintf(canon, sizeof(canon), "%s%s", prefix, off);
    spell(g, name, prefix, off, hf);
    emit(g, name, "F32", ndim, shape, fill(g, canon, n), n * sizeof(float));
}

static void vec(struct gen *g, const char *prefix, const char *off, const char *hf, int64_t n)
{
    f32_tensor(g, prefix, off, hf, 1, &n);
}

static void mat(struct gen *g, const char *prefix, const char *off, const char *hf, int64_t out, int64_t in)
{
    int64_t shape[2] = { out, in };

    f32_tensor(g, prefix, off, hf, 2, shape);
}

static uint8_t random_e4m3(uint64_t *s)
{
    uint8_t b = (uint8_t)stw_rand(s);

    return (b & 0x7f) == 0x7f ? b ^ 1 : b;     /* no NaN codes in weights */
}

/* FP8 [out, in] with a UE8M0 scale [ceil(out/128), ceil(in/128)]: as ".scale" F8_E8M0, or (older
 * files) "weight_scale_inv" F32 powers of two. */
static void fp8_mat(struct gen *g, const char *prefix, const char *off, int64_t out, int64_t in, bool f32_scale)
{
    char canon[256], name[280];
    int64_t shape[2] = { out, in }, sshape[2] = { (out + 127) / 128, (in + 127) / 128 };
    size_t ns = (size_t)(sshape[0] * sshape[1]);
    uint8_t *w = malloc((size_t)(out * in));
    uint64_t s;

    snprintf(canon, sizeof(canon), "%s%s", prefix, off);
    s = name_seed(g, canon);
    for (int64_t i = 0; i < out * in; i++)
        w[i] = random_e4m3(&s);
    emit(g, canon, "F8_E4M3", 2, shape, w, (size_t)(out * in));
    if (f32_scale) {
        float *sc = malloc(ns * sizeof(float));

        for (size_t i = 0; i < ns; i++)
            sc[i] = ldexpf(1.0f, (int)(stw_rand(&s) % 15) - 7);
        snprintf(name, sizeof(name), "%s_scale_inv", canon);
        emit(g, name, "F32", 2, sshape, sc, ns * sizeof(float));
    } else {
        uint8_t *sc = malloc(ns);

        for (size_t i = 0; i < ns; i++)
            sc[i] = (uint8_t)(120 + stw_rand(&s) % 15);
        snprintf(name, sizeof(name), "%.*s.scale", (int)(strlen(canon) - 7), canon);
        emit(g, name, "F8_E8M0", 2, sshape, sc, ns);
    }
}

/* FP4 [out, in] packed as I8 [out, in/2], scale [out, in/32] F8_E8M0. */
static void fp4_mat(struct gen *g, const char *prefix, const char *off, int64_t out, int64_t in)
{
    char canon[256], name[280];
    int64_t shape[2] = { out, in / 2 }, sshape[2] = { out, in / 32 };
    uint8_t *w = malloc((size_t)(out * in / 2)), *sc = malloc((size_t)(out * in / 32));
    uint64_t s;

    snprintf(canon, sizeof(canon), "%s%s", prefix, off);
    s = name_seed(g, canon);
    for (int64_t i = 0; i < out * in / 2; i++)
        w[i] = (uint8_t)stw_rand(&s);
    for (int64_t i = 0; i < out * in / 32; i++)
        sc[i] = (uint8_t)(118 + stw_rand(&s) % 20);
    emit(g, canon, "I8", 2, shape, w, (size_t)(out * in / 2));
    snprintf(name, sizeof(name), "%.*s.scale", (int)(strlen(canon) - 7), canon);
    emit(g, name, "F8_E8M0", 2, sshape, sc, (size_t)(out * in / 32));
}

static void gen_compressor(struct gen *g, const char *p, const char *off_base, const char *hf_base,
                           int ratio, int dim, int coff)
{
    char o[256], h[256];
    int64_t ape[2] = { ratio, coff * dim };

    snprintf(o, sizeof(o), "%swkv.weight", off_base);
    snprintf(h, sizeof(h), "%skv_proj.weight", hf_base);
    mat(g, p, o, h, coff * dim, D);
    snprintf(o, sizeof(o), "%swgate.weight", off_base);
    snprintf(h, sizeof(h), "%sgate_proj.weight", hf_base);
    mat(g, p, o, h, coff * dim, D);
    snprintf(o, sizeof(o), "%sape", off_base);
    snprintf(h, sizeof(h), "%sposition_bias", hf_base);
    f32_tensor(g, p, o, h, 2, ape);
    snprintf(o, sizeof(o), "%snorm.weight", off_base);
    snprintf(h, sizeof(h), "%skv_norm.weight", hf_base);
    vec(g, p, o, h, dim);
}

static void gen_layer(struct gen *g, const char *p, int ratio, bool hash)
{
    int64_t mix = (2 + HC) * HC;
    char name[256], canon[256];

    vec(g, p, "attn_norm.weight", "input_layernorm.weight", D);
    vec(g, p, "ffn_norm.weight", "post_attention_layernorm.weight", D);
    mat(g, p, "hc_attn_fn", "attn_hc.fn", mix, HC * D);
    vec(g, p, "hc_attn_base", "attn_hc.base", mix);
    vec(g, p, "hc_attn_scale", "attn_hc.scale", 3);
    mat(g, p, "hc_ffn_fn", "ffn_hc.fn", mix, HC * D);
    vec(g, p, "hc_ffn_base", "ffn_hc.base", mix);
    vec(g, p, "hc_ffn_scale", "ffn_hc.scale", 3);
    mat(g, p, "attn.wq_a.weight", "self_attn.q_a_proj.weight", QL, D);
    vec(g, p, "attn.q_norm.weight", "self_attn.q_a_norm.weight", QL);
    if (g->quant) {
        fp8_mat(g, p, "attn.wq_b.weight", H * HD, QL, false);
        fp8_mat(g, p, "attn.wkv.weight", HD, D, true);
    } else {
        mat(g, p, "attn.wq_b.weight", "self_attn.q_b_proj.weight", H * HD, QL);
        mat(g, p, "attn.wkv.weight", "self_attn.kv_proj.weight", HD, D);
    }
    vec(g, p, "attn.kv_norm.weight", "self_attn.kv_norm.weight", HD);
    mat(g, p, "attn.wo_a.weight", "self_attn.o_a_proj.weight", OG * OLR, H * HD / OG);
    mat(g, p, "attn.wo_b.weight", "self_attn.o_b_proj.weight", D, OG * OLR);
    vec(g, p, "attn.attn_sink", "self_attn.sinks", H);
    if (ratio) {
        gen_compressor(g, p, "attn.compressor.", "self_attn.compressor.", ratio, HD, ratio == CSA ? 2 : 1);
        if (ratio == CSA) {
            gen_compressor(g, p, "attn.indexer.compressor.", "self_attn.compressor.indexer.", ratio, IDIM, 2);
            mat(g, p, "attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight", IH * IDIM, QL);
            mat(g, p, "attn.indexer.weights_proj.weight",
                "self_attn.compressor.indexer.scorer.weights_proj.weight", IH, D);
        }
    }
    mat(g, p, "ffn.gate.weight", "mlp.gate.weight", E, D);
    if (hash) {
        int64_t shape[2] = { V, TOPK };
        bool i64 = g->sp != SP_OFFICIAL;
        void *ids = malloc((size_t)(V * TOPK) * 8);
        uint64_t s;

        snprintf(canon, sizeof(canon), "%sffn.gate.tid2eid", p);
        s = name_seed(g, canon);
        for (int i = 0; i < V * TOPK; i++) {
            int64_t e = (int64_t)(stw_rand(&s) % E);
            int32_t e32 = (int32_t)e;

            if (i64)
                memcpy((int64_t *)ids + i, &e, 8);
            else
                memcpy((int32_t *)ids + i, &e32, 4);
        }
        spell(g, name, p, "ffn.gate.tid2eid", "mlp.gate.tid2eid");
        emit(g, name, i64 ? "I64" : "I32", 2, shape, ids, (size_t)(V * TOPK) * (i64 ? 8 : 4));
    } else {
        vec(g, p, "ffn.gate.bias", "mlp.gate.e_score_correction_bias", E);
    }
    if (g->sp == SP_HF) {
        /* stacked: gate_up [E, 2I, D] = [w1; w3] per expert, down [E, D, I] */
        int64_t gu_shape[3] = { E, 2 * I_, D }, dn_shape[3] = { E, D, I_ };
        float *gu = malloc(sizeof(float) * E * 2 * I_ * D), *dn = malloc(sizeof(float) * E * D * I_);

        for (int e = 0; e < E; e++) {
            float *w1, *w3, *w2;

            snprintf(canon, sizeof(canon), "%sffn.experts.%d.w1.weight", p, e);
            w1 = fill(g, canon, I_ * D);
            snprintf(canon, sizeof(canon), "%sffn.experts.%d.w3.weight", p, e);
            w3 = fill(g, canon, I_ * D);
            snprintf(canon, sizeof(canon), "%sffn.experts.%d.w2.weight", p, e);
            w2 = fill(g, canon, D * I_);
            memcpy(gu + (size_t)e * 2 * I_ * D, w1, sizeof(float) * I_ * D);
            memcpy(gu + (size_t)e * 2 * I_ * D + I_ * D, w3, sizeof(float) * I_ * D);
            memcpy(dn + (size_t)e * D * I_, w2, sizeof(float) * D * I_);
            free(w1);
            free(w3);
            free(w2);
        }
        snprintf(name, sizeof(name), "model.%smlp.experts.gate_up_proj", p);
        emit(g, name, "F32", 3, gu_shape, gu, sizeof(float) * E * 2 * I_ * D);
        snprintf(name, sizeof(name), "model.%smlp.experts.down_proj", p);
        emit(g, name, "F32", 3, dn_shape, dn, sizeof(float) * E * D * I_);
    } else {
        for (int e = 0; e < E; e++) {
            char o1[64], o2[64], o3[64];

            snprintf(o1, sizeof(o1), "ffn.experts.%d.w1.weight", e);
            snprintf(o2, sizeof(o2), "ffn.experts.%d.w2.weight", e);
            snprintf(o3, sizeof(o3), "ffn.experts.%d.w3.weight", e);
            if (g->quant) {
                fp4_mat(g, p, o1, I_, D);
                fp4_mat(g, p, o2, D, I_);
                fp4_mat(g, p, o3, I_, D);
            } else {
                mat(g, p, o1, "", I_, D);
                mat(g, p, o2, "", D, I_);
                mat(g, p, o3, "", I_, D);
            }
        }
    }
    mat(g, p, "ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", I_, D);
    mat(g, p, "ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", I_, D);
    mat(g, p, "ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", D, I_);
}

static void top_tensor(struct gen *g, const char *canon, const char *hf, const char *saved, int ndim,
                       const int64_t *shape)
{
    const char *name = g->sp == SP_OFFICIAL ? canon : g->sp == SP_HF ? hf : saved;
    size_t n = 1;

    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    emit(g, name, "F32", ndim, shape, fill(g, canon, n), n * sizeof(float));
}

static void gen_model(struct gen *g)
{
    int64_t vd[2] = { V, D }, d1 = D, hcfn[2] = { HC, HC * D }, hc1 = HC, one = 1;
    char p[64];

    top_tensor(g, "embed.weight", "model.embed_tokens.weight", "model.embed_tokens.weight", 2, vd);
    top_tensor(g, "head.weight", "lm_head.weight", "head.weight", 2, vd);
    top_tensor(g, "norm.weight", "model.norm.weight", "model.norm.weight", 1, &d1);
    top_tensor(g, "hc_head_fn", "model.hc_head.hc_fn", "model.hc_head.hc_fn", 2, hcfn);
    top_tensor(g, "hc_head_base", "model.hc_head.hc_base", "model.hc_head.hc_base", 1, &hc1);
    top_tensor(g, "hc_head_scale", "model.hc_head.hc_scale", "model.hc_head.hc_scale", 1, &one);
    for (int i = 0; i < NL; i++) {
        snprintf(p, sizeof(p), "layers.%d.", i);
        gen_layer(g, p, layer_ratio[i], layer_hash[i]);
    }
    if (g->mtp && g->sp == SP_OFFICIAL) {
        const char *m = "mtp.0.";

        vec(g, m, "enorm.weight", "", D);
        vec(g, m, "hnorm.weight", "", D);
        mat(g, m, "e_proj.weight", "", D, D);
        mat(g, m, "h_proj.weight", "", D, D);
        vec(g, m, "norm.weight", "", D);
        mat(g, m, "hc_head_fn", "", HC, HC * D);
        vec(g, m, "hc_head_base", "", HC);
        vec(g, m, "hc_head_scale", "", 1);
        gen_layer(g, m, 0, false);
    }
}

/* Write g into dir: one model.safetensors, or `shards` files with an index. */
static void gen_write_config(const struct gen *g, const char *dir, int shards, const char *config)
{
    if (shards <= 1) {
        assert_int_equal(stw_write(dir, "model.safetensors", g->t, g->n), 0);
    } else {
        size_t per = (g->n + (size_t)shards - 1) / (size_t)shards, len = 0, cap = 64 + g->n * 160;
        char *idx = malloc(cap);

        len += (size_t)snprintf(idx + len, cap - len, "{\"metadata\": {}, \"weight_map\": {");
        for (int s = 0; s < shards; s++) {
            char fname[64];
            size_t a = (size_t)s * per, b = a + per < g->n ? a + per : g->n;

            snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, shards);
            assert_int_equal(stw_write(dir, fname, g->t + a, b - a), 0);
            for (size_t i = a; i < b; i++)
                len += (size_t)snprintf(idx + len, cap - len, "%s\"%s\": \"%s\"", i ? ", " : "", g->t[i].name, fname);
        }
        snprintf(idx + len, cap - len, "}}");
        assert_int_equal(stw_write_text(dir, "model.safetensors.index.json", idx), 0);
        free(idx);
    }
    assert_int_equal(stw_write_text(dir, "config.json", config), 0);
}

static void gen_write(const struct gen *g, const char *dir, int shards)
{
    gen_write_config(g, dir, shards, config_json);
}

static struct dsv4_weights *load_ok(const char *dir)
{
    struct dsv4_weights *w = NULL;
    int r = dsv4_weights_load(dir, &w);

    if (r < 0)
        fail_msg("load failed: %s", dsv4_error_message());
    return w;
}

/* Build, write and load one model. */
static struct dsv4_weights *make(enum spelling sp, bool quant, bool mtp, int shards, char **ret_dir)
{
    struct gen *g = calloc(1, sizeof(*g));
    struct dsv4_weights *w;
    char *dir = stw_tempdir();

    assert_non_null(dir);
    g->sp = sp;
    g->quant = quant;
    g->mtp = mtp;
    g->seed = test_seed;
    gen_model(g);
    gen_write(g, dir, shards);
    gen_free(g);
    free(g);
    w = load_ok(dir);
    if (ret_dir)
        *ret_dir = dir;
    else {
        stw_rmdir(dir);
        free(dir);
    }
    return w;
}

static void assert_linear_equal(const struct dsv4_linear *a, const struct dsv4_linear *b)
{
    float *ra, *rb;

    assert_int_equal(a->out, b->out);
    assert_int_equal(a->in, b->in);
    ra = malloc(sizeof(float) * (size_t)a->in);
    rb = malloc(sizeof(float) * (size_t)b->in);
    for (int64_t r = 0; r < a->out; r++) {
        dsv4_linear_row(a, r, ra);
        dsv4_linear_row(b, r, rb);
        for (int64_t k = 0; k < a->in; k++)
            if (!(ra[k] == rb[k]))
                fail_msg("%s / %s differ at [%lld, %lld]: %g vs %g", a->name, b->name, (long long)r,
                         (long long)k, (double)ra[k], (double)rb[k]);
    }
    free(ra);
    free(rb);
}

static void assert_vec_equal(const float *a, const float *b, size_t n)
{
    assert_non_null(a);
    assert_non_null(b);
    for (size_t i = 0; i < n; i++)
        if (!(a[i] == b[i]))
            fail_msg("vectors differ at %zu: %g vs %g", i, (double)a[i], (double)b[i]);
}

static void assert_compressor_equal(const struct dsv4_compressor *a, const struct dsv4_compressor *b)
{
    assert_int_equal(a->ratio, b->ratio);
    assert_int_equal(a->dim, b->dim);
    assert_int_equal(a->overlap, b->overlap);
    assert_linear_equal(&a->wkv, &b->wkv);
    assert_linear_equal(&a->wgate, &b->wgate);
    assert_vec_equal(a->ape, b->ape, (size_t)a->ratio * (a->overlap ? 2 : 1) * (size_t)a->dim);
    assert_vec_equal(a->norm, b->norm, (size_t)a->dim);
}

static void assert_layer_equal(const struct dsv4_layer *a, const struct dsv4_layer *b)
{
    size_t mix = (2 + HC) * HC;

    assert_int_equal(a->ratio, b->ratio);
    assert_vec_equal(a->attn_norm, b->attn_norm, D);
    assert_vec_equal(a->ffn_norm, b->ffn_norm, D);
    assert_linear_equal(&a->hc_attn.fn, &b->hc_attn.fn);
    assert_vec_equal(a->hc_attn.base, b->hc_attn.base, mix);
    assert_vec_equal(a->hc_attn.scale, b->hc_attn.scale, 3);
    assert_linear_equal(&a->hc_ffn.fn, &b->hc_ffn.fn);
    assert_vec_equal(a->hc_ffn.base, b->hc_ffn.base, mix);
    assert_vec_equal(a->hc_ffn.scale, b->hc_ffn.scale, 3);
    assert_linear_equal(&a->attn.wq_a, &b->attn.wq_a);
    assert_vec_equal(a->attn.q_norm, b->attn.q_norm, QL);
    assert_linear_equal(&a->attn.wq_b, &b->attn.wq_b);
    assert_linear_equal(&a->attn.wkv, &b->attn.wkv);
    assert_vec_equal(a->attn.kv_norm, b->attn.kv_norm, HD);
    assert_linear_equal(&a->attn.wo_a, &b->attn.wo_a);
    assert_linear_equal(&a->attn.wo_b, &b->attn.wo_b);
    assert_vec_equal(a->attn.sink, b->attn.sink, H);
    if (a->ratio) {
        assert_compressor_equal(&a->attn.comp, &b->attn.comp);
        if (a->ratio == CSA) {
            assert_compressor_equal(&a->attn.indexer.comp, &b->attn.indexer.comp);
            assert_linear_equal(&a->attn.indexer.wq_b, &b->attn.indexer.wq_b);
            assert_linear_equal(&a->attn.indexer.weights_proj, &b->attn.indexer.weights_proj);
        }
    }
    assert_int_equal(a->ffn.type, b->ffn.type);
    assert_linear_equal(&a->ffn.gate, &b->ffn.gate);
    if (a->ffn.type == DSV4_MLP_HASH) {
        assert_null(a->ffn.gate_bias);
        assert_memory_equal(a->ffn.tid2eid, b->ffn.tid2eid, sizeof(int32_t) * V * TOPK);
    } else {
        assert_null(a->ffn.tid2eid);
        assert_vec_equal(a->ffn.gate_bias, b->ffn.gate_bias, E);
    }
    for (int e = 0; e < E; e++) {
        assert_linear_equal(&a->ffn.w1[e], &b->ffn.w1[e]);
        assert_linear_equal(&a->ffn.w3[e], &b->ffn.w3[e]);
        assert_linear_equal(&a->ffn.w2[e], &b->ffn.w2[e]);
    }
    assert_linear_equal(&a->ffn.sw1, &b->ffn.sw1);
    assert_linear_equal(&a->ffn.sw3, &b->ffn.sw3);
    assert_linear_equal(&a->ffn.sw2, &b->ffn.sw2);
}

static void assert_weights_equal(const struct dsv4_weights *a, const struct dsv4_weights *b)
{
    assert_linear_equal(&a->embed, &b->embed);
    assert_linear_equal(&a->head, &b->head);
    assert_vec_equal(a->norm, b->norm, D);
    assert_linear_equal(&a->hc_head.fn, &b->hc_head.fn);
    assert_vec_equal(a->hc_head.base, b->hc_head.base, HC);
    assert_vec_equal(a->hc_head.scale, b->hc_head.scale, 1);
    for (int i = 0; i < NL; i++)
        assert_layer_equal(&a->layers[i], &b->layers[i]);
}

/* The loaded values are the generated ones, and the three spellings agree everywhere. */
static void test_spellings_agree(void **state)
{
    struct dsv4_weights *off = make(SP_OFFICIAL, false, true, 1, NULL);
    struct dsv4_weights *hf = make(SP_HF, false, false, 1, NULL);
    struct dsv4_weights *saved = make(SP_SAVED, false, false, 1, NULL);
    struct gen ref = { .seed = test_seed };
    float row[D], *want;

    assert_int_equal(off->cfg.n_layers, NL);
    assert_int_equal(off->cfg.hc_mult, HC);
    for (int i = 0; i < NL; i++) {
        assert_int_equal(off->layers[i].ratio, layer_ratio[i]);
        assert_int_equal(off->layers[i].ffn.type, layer_hash[i] ? DSV4_MLP_HASH : DSV4_MLP_MOE);
    }
    /* spot checks against the generator: embed row 7, layer 3 expert 2's up projection row 5 (the
     * second half of transformers' gate_up_proj), layer 2's compressor position bias */
    want = fill(&ref, "embed.weight", V * D);
    dsv4_linear_row(&hf->embed, 7, row);
    assert_memory_equal(row, want + 7 * D, sizeof(row));
    free(want);
    want = fill(&ref, "layers.3.ffn.experts.2.w3.weight", I_ * D);
    dsv4_linear_row(&hf->layers[3].ffn.w3[2], 5, row);
    assert_memory_equal(row, want + 5 * D, sizeof(row));
    assert_int_equal(hf->layers[3].ffn.w3[2].row_stride, D);
    free(want);
    want = fill(&ref, "layers.2.attn.compressor.ape", CSA * 2 * HD);
    assert_memory_equal(hf->layers[2].attn.comp.ape, want, sizeof(float) * CSA * 2 * HD);
    free(want);

    assert_weights_equal(off, hf);
    assert_weights_equal(off, saved);
    assert_int_equal(off->n_unused, 0);
    assert_int_equal(hf->n_unused, 0);
    assert_int_equal(saved->n_unused, 0);
    assert_null(off->first_unused);
    assert_int_equal(off->n_mtp, 1);
    assert_int_equal(hf->n_mtp, 0);
    assert_int_equal(saved->n_mtp, 0);
    assert_int_equal(off->mtp[0].layer.ratio, 0);
    assert_int_equal(off->mtp[0].layer.ffn.type, DSV4_MLP_MOE);
    want = fill(&ref, "mtp.0.e_proj.weight", D * D);
    dsv4_linear_row(&off->mtp[0].e_proj, 3, row);
    assert_memory_equal(row, want + 3 * D, sizeof(row));
    free(want);
    assert_true(off->bytes_total > 0);
    assert_int_equal(off->bytes_quantized, 0);
    dsv4_weights_free(off);
    dsv4_weights_free(hf);
    dsv4_weights_free(saved);
}

static void test_shards(void **state)
{
    struct dsv4_weights *one = make(SP_OFFICIAL, false, true, 1, NULL);
    struct dsv4_weights *three = make(SP_OFFICIAL, false, true, 3, NULL);
    struct dsv4_weights *hf = make(SP_HF, false, false, 4, NULL);

    assert_weights_equal(one, three);
    assert_weights_equal(one, hf);
    assert_int_equal(three->n_mtp, 1);
    dsv4_weights_free(one);
    dsv4_weights_free(three);
    dsv4_weights_free(hf);
}

/* Quantized linears stay quantized and dequantize to fp8(q) * 2^(s-127) (FP8, 128x128 blocks) and
 * e2m1(nibble) * 2^(s-127) (FP4, low nibble first, 1x32 blocks). */
static void test_quantized(void **state)
{
    struct dsv4_weights *w = make(SP_OFFICIAL, true, false, 1, NULL);
    const struct dsv4_linear *q8 = &w->layers[1].attn.wq_b, *q8f = &w->layers[2].attn.wkv;
    const struct dsv4_linear *q4 = &w->layers[1].ffn.w2[1];
    struct gen g = { .sp = SP_OFFICIAL, .quant = true, .seed = test_seed };
    float row[H * HD];

    assert_int_equal(q8->fmt, DSV4_W_FP8);
    assert_int_equal(q8f->fmt, DSV4_W_FP8);
    assert_int_equal(q4->fmt, DSV4_W_FP4);
    assert_true(w->bytes_quantized > 0);
    /* regenerate the raw bytes the way the generator did and dequantize explicitly */
    gen_layer(&g, "layers.1.", 0, true);
    for (size_t t = 0; t < g.n; t++) {
        if (strcmp(g.t[t].name, "layers.1.attn.wq_b.weight") == 0) {
            const uint8_t *qb = g.t[t].data, *sc = g.t[t + 1].data;

            assert_string_equal(g.t[t + 1].name, "layers.1.attn.wq_b.scale");
            for (int r = 0; r < H * HD; r += 37) {
                dsv4_linear_row(q8, r, row);
                for (int k = 0; k < QL; k++)
                    assert_true(row[k] == dsv4_e4m3_to_f32(qb[r * QL + k]) * ldexpf(1.0f, sc[0] - 127));
            }
        }
        if (strcmp(g.t[t].name, "layers.1.ffn.experts.1.w2.weight") == 0) {
            const uint8_t *qb = g.t[t].data, *sc = g.t[t + 1].data;

            dsv4_linear_row(q4, 9, row);
            for (int k = 0; k < I_; k++) {
                uint8_t b = qb[9 * (I_ / 2) + k / 2];
                float v = dsv4_e2m1_to_f32(k % 2 ? b >> 4 : b & 0xf) * ldexpf(1.0f, sc[9 * (I_ / 32) + k / 32] - 127);

                assert_true(row[k] == v);
            }
        }
    }
    gen_free(&g);
    dsv4_weights_free(w);
}

/* Load a broken checkpoint; the error code and the message's tensor and file are checked. */
static void expect_broken(struct gen *g, int shards, void (*damage)(const char *dir), int code,
                          const char *must1, const char *must2)
{
    struct dsv4_weights *w = NULL;
    char *dir = stw_tempdir();
    int r;

    g->seed = test_seed;
    gen_model(g);
    gen_write(g, dir, shards);
    gen_free(g);
    if (damage)
        damage(dir);
    r = dsv4_weights_load(dir, &w);
    assert_null(w);
    if (r != code)
        fail_msg("expected %d, got %d: %s", code, r, dsv4_error_message());
    if (must1 && !strstr(dsv4_error_message(), must1))
        fail_msg("message lacks \"%s\": %s", must1, dsv4_error_message());
    if (must2 && !strstr(dsv4_error_message(), must2))
        fail_msg("message lacks \"%s\": %s", must2, dsv4_error_message());
    stw_rmdir(dir);
    free(dir);
}

static void test_missing_tensor(void **state)
{
    struct gen g = { .sp = SP_OFFICIAL, .skip = "layers.2.attn.indexer.weights_proj.weight" };
    struct gen h = { .sp = SP_HF, .skip = "model.layers.3.mlp.experts.down_proj" };
    struct gen m = { .sp = SP_OFFICIAL, .mtp = true, .skip = "mtp.0.ffn.gate.bias" };

    expect_broken(&g, 1, NULL, -ENOENT, "layers.2.attn.indexer.weights_proj.weight", "model.safetensors");
    expect_broken(&h, 2, NULL, -ENOENT, "model.layers.3.mlp.experts.down_proj",
                  "model.safetensors.index.json");
    expect_broken(&m, 1, NULL, -ENOENT, "mtp.0.ffn.gate.bias", "model.safetensors");
}

static void test_missing_scale(void **state)
{
    struct gen g = { .sp = SP_OFFICIAL, .quant = true, .skip = "layers.0.ffn.experts.3.w1.scale" };

    expect_broken(&g, 1, NULL, -ENOENT, "layers.0.ffn.experts.3.w1.weight", "model.safetensors");
}

static void test_wrong_dtype(void **state)
{
    struct gen g = { .sp = SP_OFFICIAL, .bad_dtype = "layers.1.attn_norm.weight" };
    struct gen h = { .sp = SP_HF, .bad_dtype = "model.layers.0.self_attn.q_b_proj.weight" };

    expect_broken(&g, 1, NULL, -EINVAL, "layers.1.attn_norm.weight", "model.safetensors");
    expect_broken(&h, 3, NULL, -EINVAL, "model.layers.0.self_attn.q_b_proj.weight", "-of-00003.safetensors");
}

static void test_wrong_shape(void **state)
{
    struct gen g = { .sp = SP_OFFICIAL, .bad_shape = "layers.3.attn.compressor.ape" };
    struct gen h = { .sp = SP_HF, .bad_shape = "model.layers.2.mlp.experts.gate_up_proj" };
    struct gen s = { .sp = SP_SAVED, .bad_shape = "model.hc_head.hc_fn" };

    expect_broken(&g, 1, NULL, -EINVAL, "layers.3.attn.compressor.ape", "[9, 32], expected [8, 32]");
    expect_broken(&h, 1, NULL, -EINVAL, "model.layers.2.mlp.experts.gate_up_proj", "model.safetensors");
    expect_broken(&s, 1, NULL, -EINVAL, "model.hc_head.hc_fn", "model.safetensors");
}

static void truncate_single(const char *dir)
{
    char p[4352];
    FILE *f;
    long size;

    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    f = fopen(p, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    size = ftell(f);
    fclose(f);
    assert_int_equal(truncate(p, size - 100), 0);
}

static void test_truncated(void **state)
{
    struct gen g = { .sp = SP_OFFICIAL };

    /* the last tensor written is layer 3's shared expert w2 */
    expect_broken(&g, 1, truncate_single, -EINVAL, "layers.3.ffn.shared_experts.w2.weight", "model.safetensors");
}

static void test_tid2eid_range(void **state)
{
    struct gen g = { .sp = SP_OFFICIAL };
    char *dir = stw_tempdir();
    struct dsv4_weights *w = NULL;
    char p[4352];
    FILE *f;
    int r;

    g.seed = test_seed;
    gen_model(&g);
    /* overwrite one id of layer 1's table with n_experts */
    for (size_t i = 0; i < g.n; i++)
        if (strcmp(g.t[i].name, "layers.1.ffn.gate.tid2eid") == 0)
            ((int32_t *)g.bufs[i])[17] = E;
    gen_write(&g, dir, 1);
    gen_free(&g);
    r = dsv4_weights_load(dir, &w);
    assert_int_equal(r, -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "layers.1.ffn.gate.tid2eid"));
    assert_non_null(strstr(dsv4_error_message(), "token 8 maps to expert 4"));
    /* a corrupt config is refused before any tensor is read */
    snprintf(p, sizeof(p), "%s/config.json", dir);
    f = fopen(p, "w");
    fputs("{\"model_type\": \"deepseek_v4\", \"num_hidden_layers\": ", f);
    fclose(f);
    r = dsv4_weights_load(dir, &w);
    assert_int_equal(r, -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "config.json"));
    stw_rmdir(dir);
    free(dir);
}

/* ---- dsv4_linear_row / matvec against an explicit dequantize-then-multiply ---- */

struct qmat {
    struct dsv4_linear W;
    void *w;
    uint8_t *scale;
    double *deq;                /* [out, in] the explicit dequantization */
};

static void qmat_make(struct qmat *m, enum dsv4_wfmt fmt, int64_t out, int64_t in, int64_t row_stride,
                      uint64_t *s)
{
    int64_t rows_alloc = out;
    size_t n = (size_t)(rows_alloc * row_stride);

    memset(m, 0, sizeof(*m));
    m->deq = malloc(sizeof(double) * (size_t)(out * in));
    m->W.fmt = fmt;
    m->W.out = out;
    m->W.in = in;
    m->W.row_stride = row_stride;
    m->W.name = "test";
    switch (fmt) {
    case DSV4_W_F32: {
        float *w = malloc(sizeof(float) * n);

        for (size_t i = 0; i < n; i++)
            w[i] = stw_uniform(s);
        for (int64_t r = 0; r < out; r++)
            for (int64_t k = 0; k < in; k++)
                m->deq[r * in + k] = w[r * row_stride + k];
        m->w = w;
        break;
    }
    case DSV4_W_BF16:
    case DSV4_W_F16: {
        uint16_t *w = malloc(sizeof(uint16_t) * n);

        for (size_t i = 0; i < n; i++) {
            float f = stw_uniform(s) * 4.0f;

            w[i] = fmt == DSV4_W_BF16 ? dsv4_f32_to_bf16(f)
                                      : (uint16_t)((0x3000 + stw_rand(s) % 0x1800) | (stw_rand(s) & 1) << 15);
        }
        for (int64_t r = 0; r < out; r++)
            for (int64_t k = 0; k < in; k++) {
                uint16_t h = w[r * row_stride + k];
                /* f16 reference by hand: sign, 5-bit exponent (bias 15), 10-bit fraction */
                double f16 = ldexp(1.0 + (h & 0x3ff) / 1024.0, ((h >> 10) & 0x1f) - 15) * ((h & 0x8000) ? -1 : 1);

                m->deq[r * in + k] = fmt == DSV4_W_BF16 ? (double)dsv4_bf16_to_f32(h) : f16;
            }
        m->w = w;
        break;
    }
    case DSV4_W_FP8: {
        int64_t sr = (out + 127) / 128, sc = (in + 127) / 128;
        uint8_t *w = malloc(n);

        m->scale = malloc((size_t)(sr * sc));
        for (size_t i = 0; i < n; i++)
            w[i] = random_e4m3(s);
        for (int64_t i = 0; i < sr * sc; i++)
            m->scale[i] = (uint8_t)(100 + stw_rand(s) % 50);
        m->W.scale_stride = sc;
        for (int64_t r = 0; r < out; r++)
            for (int64_t k = 0; k < in; k++)
                m->deq[r * in + k] = (double)dsv4_e4m3_to_f32(w[r * row_stride + k]) *
                                     ldexp(1.0, m->scale[(r / 128) * sc + k / 128] - 127);
        m->w = w;
        break;
    }
    case DSV4_W_FP4: {
        uint8_t *w = malloc(n / 2);
        static const double e2m1[8] = { 0, 0.5, 1, 1.5, 2, 3, 4, 6 };

        m->scale = malloc((size_t)(out * in / 32));
        for (size_t i = 0; i < n / 2; i++)
            w[i] = (uint8_t)stw_rand(s);
        for (int64_t i = 0; i < out * in / 32; i++)
            m->scale[i] = (uint8_t)(110 + stw_rand(s) % 30);
        m->W.scale_stride = in / 32;
        for (int64_t r = 0; r < out; r++)
            for (int64_t k = 0; k < in; k++) {
                uint8_t b = w[(r * row_stride + k) / 2], nib = k % 2 ? b >> 4 : b & 0xf;

                m->deq[r * in + k] = e2m1[nib & 7] * (nib & 8 ? -1 : 1) *
                                     ldexp(1.0, m->scale[r * (in / 32) + k / 32] - 127);
            }
        m->w = w;
        break;
    }
    }
    m->W.w = m->w;
    m->W.scale = m->scale;
}

static void qmat_free(struct qmat *m)
{
    free(m->w);
    free(m->scale);
    free(m->deq);
}

static void check_matvec(enum dsv4_wfmt fmt, int64_t out, int64_t in, int64_t row_stride, uint64_t *s)
{
    struct qmat m;
    float *x = malloc(sizeof(float) * (size_t)in), *y = malloc(sizeof(float) * (size_t)out);
    float *row = malloc(sizeof(float) * (size_t)in);
    double ymax = 0.0, ratio = 0.0;

    qmat_make(&m, fmt, out, in, row_stride, s);
    for (int64_t k = 0; k < in; k++)
        x[k] = stw_uniform(s);
    dsv4_linear_matvec(&m.W, x, y);
    for (int64_t r = 0; r < out; r++) {
        double ref = 0.0, mag = 0.0;

        dsv4_linear_row(&m.W, r, row);
        for (int64_t k = 0; k < in; k++) {
            if (!(row[k] == (float)m.deq[r * in + k]))
                fail_msg("fmt %d row %lld col %lld: %g, expected %g", fmt, (long long)r, (long long)k,
                         (double)row[k], m.deq[r * in + k]);
            ref += m.deq[r * in + k] * x[k];
            mag += fabs(m.deq[r * in + k] * x[k]);
        }
        assert_false(isnan(y[r]));
        ymax = fmax(ymax, fabs(ref));
        /* A float sum of n products is off by at most n * 2^-24 * sum |w_k x_k| (the textbook bound,
         * whatever the order); a short row that cancels can miss its own |y| by far more than
         * 1e-5 relative, so the bound is on the terms, not the result. */
        if (mag > 0.0)
            ratio = fmax(ratio, fabs(ref - y[r]) / ((double)in * 0x1p-24 * mag));
    }
    assert_true(ymax > 0.0);
    if (!(ratio <= 1.0))
        fail_msg("fmt %d [%lld, %lld]: error %g times the float summation bound", fmt, (long long)out,
                 (long long)in, ratio);
    print_message("fmt %d [%lld, %lld]: error %.3g of the bound\n", fmt, (long long)out, (long long)in, ratio);
    qmat_free(&m);
    free(x);
    free(y);
    free(row);
}

/* tie_word_embeddings: no head tensor, the head is the embedding. */
static void test_tied_head(void **state)
{
    struct gen g = { .sp = SP_HF, .skip = "lm_head.weight" };
    char *dir = stw_tempdir(), *config = malloc(sizeof(config_json) + 64);
    struct dsv4_weights *w;

    /* the same config with the flag set before the closing brace */
    snprintf(config, sizeof(config_json) + 64, "%.*s, \"tie_word_embeddings\": true}",
             (int)(strrchr(config_json, '}') - config_json), config_json);
    g.seed = test_seed;
    gen_model(&g);
    gen_write_config(&g, dir, 1, config);
    gen_free(&g);
    w = load_ok(dir);
    assert_true(w->cfg.tie_embeddings);
    assert_linear_equal(&w->head, &w->embed);
    assert_ptr_equal(w->head.w, w->embed.w);
    dsv4_weights_free(w);
    /* without the flag the missing head is an error */
    assert_int_equal(stw_write_text(dir, "config.json", config_json), 0);
    assert_int_equal(dsv4_weights_load(dir, &w), -ENOENT);
    assert_non_null(strstr(dsv4_error_message(), "lm_head.weight"));
    stw_rmdir(dir);
    free(dir);
    free(config);
}

/* Tensors the config does not ask for are counted, not silently taken: here a compressor on a
 * layer the config calls sliding-window. */
static void test_unused_counted(void **state)
{
    struct gen g = { .sp = SP_HF };
    int64_t shape[2] = { CSA, 2 * HD };
    char *dir = stw_tempdir();
    struct dsv4_weights *w;

    g.seed = test_seed;
    gen_model(&g);
    emit(&g, "model.layers.1.self_attn.compressor.position_bias", "F32", 2, shape,
         calloc(CSA * 2 * HD, sizeof(float)), sizeof(float) * CSA * 2 * HD);
    gen_write(&g, dir, 2);
    gen_free(&g);
    w = load_ok(dir);
    assert_int_equal(w->n_unused, 1);
    assert_string_equal(w->first_unused, "model.layers.1.self_attn.compressor.position_bias");
    dsv4_weights_free(w);
    stw_rmdir(dir);
    free(dir);
}

static void test_linear_formats(void **state)
{
    uint64_t s = test_seed ^ 0x9e3779b97f4a7c15ull;

    check_matvec(DSV4_W_F32, 37, 53, 53, &s);
    check_matvec(DSV4_W_F32, 20, 40, 70, &s);          /* a view: rows 70 apart */
    check_matvec(DSV4_W_BF16, 33, 65, 65, &s);
    check_matvec(DSV4_W_BF16, 16, 24, 50, &s);
    check_matvec(DSV4_W_F16, 19, 77, 77, &s);
    check_matvec(DSV4_W_FP8, 300, 200, 200, &s);       /* partial 128-blocks both ways */
    check_matvec(DSV4_W_FP8, 129, 385, 385, &s);
    check_matvec(DSV4_W_FP8, 5, 7, 7, &s);
    check_matvec(DSV4_W_FP4, 70, 96, 96, &s);
    check_matvec(DSV4_W_FP4, 3, 32, 32, &s);
}

static int setup(void **state)
{
    test_seed = dsv4_test_seed();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spellings_agree),
        cmocka_unit_test(test_shards),
        cmocka_unit_test(test_quantized),
        cmocka_unit_test(test_missing_tensor),
        cmocka_unit_test(test_missing_scale),
        cmocka_unit_test(test_wrong_dtype),
        cmocka_unit_test(test_wrong_shape),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_tid2eid_range),
        cmocka_unit_test(test_tied_head),
        cmocka_unit_test(test_unused_counted),
        cmocka_unit_test(test_linear_formats),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
