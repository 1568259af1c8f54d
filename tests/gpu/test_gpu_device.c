/* SPDX-License-Identifier: MIT */
/* GPU: boot of one device from a small model in checkpoint formats: one allocation, weights uploaded
 * byte for byte (FP8/FP4 stay quantized), the FP4 expert tables usable by the expert kernel (checked
 * against the twin), every op's variant named, the build image identified, and no carving after the
 * device is sealed. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"

#define D 256
#define HC 4
#define QL 128
#define E 4
#define TOPK 2
#define INTER 128
#define VOCAB 64
#define LAYERS 2
#define BATCH 4

struct model {
    struct dsv4_weights w;
    struct dsv4_layer layers[LAYERS];
    struct dsv4_linear w1[LAYERS][E], w3[LAYERS][E], w2[LAYERS][E];
    void *bufs[256];
    int nbufs;
};

static void *buf(struct model *m, size_t bytes)
{
    void *p = malloc(bytes);
    assert_non_null(p);
    m->bufs[m->nbufs++] = p;
    return p;
}

static const float *vec(struct model *m, size_t n)
{
    float *v = buf(m, n * sizeof(float));
    gt_fill_normal(v, n, 1.0f);
    return v;
}

static struct dsv4_linear lin(struct model *m, enum dsv4_wfmt fmt, int64_t out, int64_t in, const char *name)
{
    struct dsv4_linear l = { .fmt = fmt, .out = out, .in = in, .row_stride = in, .name = name };
    if (fmt == DSV4_W_BF16) {
        l.w = buf(m, (size_t)(out * in) * 2);
        gt_fill_bf16((uint16_t *)l.w, (size_t)(out * in));
    } else if (fmt == DSV4_W_F32) {
        l.w = vec(m, (size_t)(out * in));
    } else if (fmt == DSV4_W_FP8) {
        uint8_t *s;
        l.w = buf(m, (size_t)(out * in));
        gt_fill_fp8((uint8_t *)l.w, (size_t)(out * in));
        l.scale_stride = (in + 127) / 128;
        s = buf(m, (size_t)((out + 127) / 128 * l.scale_stride));
        gt_fill_scales(s, (size_t)((out + 127) / 128 * l.scale_stride), -9);
        l.scale = s;
    } else {
        uint8_t *s;
        l.w = buf(m, (size_t)(out * in) / 2);
        gt_fill_fp4((uint8_t *)l.w, (size_t)(out * in) / 2);
        l.scale_stride = in / 32;
        s = buf(m, (size_t)(out * l.scale_stride));
        gt_fill_scales(s, (size_t)(out * l.scale_stride), -5);
        l.scale = s;
    }
    return l;
}

static void make_model(struct model *m)
{
    struct dsv4_config *c = &m->w.cfg;
    memset(m, 0, sizeof(*m));
    c->vocab_size = VOCAB;
    c->dim = D;
    c->n_layers = LAYERS;
    c->n_heads = 2;
    c->head_dim = 64;
    c->rope_dim = 16;
    c->q_lora_rank = QL;
    c->o_groups = 1;
    c->o_lora_rank = 64;
    c->window = 128;
    c->csa_ratio = 4;
    c->hca_ratio = 128;
    c->index_n_heads = 2;
    c->index_head_dim = 32;
    c->index_topk = 8;
    c->n_experts = E;
    c->n_experts_per_tok = TOPK;
    c->moe_inter = INTER;
    c->routed_scaling_factor = 1.5;
    c->norm_topk_prob = true;
    c->swiglu_limit = 10.0;
    c->hc_mult = HC;
    c->hc_sinkhorn_iters = 20;
    c->hc_eps = 1e-6;
    c->rms_norm_eps = 1e-6;
    m->w.embed = lin(m, DSV4_W_BF16, VOCAB, D, "embed.weight");
    m->w.head = lin(m, DSV4_W_BF16, VOCAB, D, "head.weight");
    m->w.norm = vec(m, D);
    m->w.hc_head.fn = lin(m, DSV4_W_F32, HC, HC * D, "hc_head_fn");
    m->w.hc_head.base = vec(m, HC);
    m->w.hc_head.scale = vec(m, 1);
    m->w.layers = m->layers;
    for (int i = 0; i < LAYERS; i++) {
        struct dsv4_layer *L = &m->layers[i];
        L->attn_norm = vec(m, D);
        L->ffn_norm = vec(m, D);
        L->hc_attn.fn = lin(m, DSV4_W_F32, (2 + HC) * HC, HC * D, "hc_attn_fn");
        L->hc_attn.base = vec(m, (2 + HC) * HC);
        L->hc_attn.scale = vec(m, 3);
        L->attn.wq_a = lin(m, DSV4_W_FP8, QL, D, i ? "layers.1.attn.wq_a.weight" : "layers.0.attn.wq_a.weight");
        L->attn.q_norm = vec(m, QL);
        L->ffn.gate = lin(m, DSV4_W_BF16, E, D, "gate");
        L->ffn.gate_bias = vec(m, E);
        for (int e = 0; e < E; e++) {
            m->w1[i][e] = lin(m, DSV4_W_FP4, INTER, D, "w1");
            m->w3[i][e] = lin(m, DSV4_W_FP4, INTER, D, "w3");
            m->w2[i][e] = lin(m, DSV4_W_FP4, D, INTER, "w2");
        }
        L->ffn.w1 = m->w1[i];
        L->ffn.w3 = m->w3[i];
        L->ffn.w2 = m->w2[i];
    }
}

static void free_model(struct model *m)
{
    for (int i = 0; i < m->nbufs; i++)
        free(m->bufs[i]);
}

static void log_line(void *ctx, const char *line)
{
    printf("# %s\n", line);
}

static void test_boot_and_experts(void **state)
{
    struct model *m = calloc(1, sizeof(*m));
    struct dsv4_backend_opts opts = { .max_batch = BATCH, .max_context = 1024, .numerics = DSV4_NUMERICS_FP8 };
    struct dsv4_cuda_dev *dev = NULL;
    struct dsv4_cuda_dev_stats st;
    struct dsv4_cuda_experts ex;
    struct dsv4_cuda_moe_ws ws;
    const struct dsv4_cuda_linear *dl;
    uint8_t *back;
    float *x, *ref, *eo, *out, *dx, *dy, *dw;
    int32_t idx[BATCH * TOPK], *didx;
    float wts[BATCH * TOPK], logits[E];
    void *p;

    assert_non_null(m);
    make_model(m);
    DSV4_OK(dsv4_cuda_dev_create(0, &m->w, &opts, log_line, NULL, &dev));
    dsv4_cuda_dev_get_stats(dev, &st);
    printf("# arena %llu B, weights %llu B, caches %llu B, workspace %llu B, build %s\n",
           (unsigned long long)st.arena_bytes, (unsigned long long)st.weight_bytes,
           (unsigned long long)st.cache_bytes, (unsigned long long)st.workspace_bytes, st.kernel_build);
    assert_int_equal(st.device_allocs, 1);
    assert_true(st.weight_bytes > 0 && st.cache_bytes > 0 && st.workspace_bytes > 0);
    if (st.cc_major == 9)
        assert_string_equal(st.kernel_build, "sm_90a cubin");
    assert_non_null(strstr(dsv4_cuda_dev_variants(dev), "op experts: experts_fp4_grouped_swiglu"));
    /* each line whole: the ends of the longest ones name their last kernel in full */
    assert_non_null(strstr(dsv4_cuda_dev_variants(dev), "K not a multiple of 128: gemv_fp8_b128_warprow\n"));
    assert_non_null(strstr(dsv4_cuda_dev_variants(dev), "whose K is split (FP8 and BF16): "
                                                        "gemm_mma_rows128_batch8_weights_in_registers\n"));

    /* FP8 stays FP8: the device holds the checkpoint bytes and scales */
    dl = dsv4_cuda_dev_linear(dev, "layers.1.attn.wq_a.weight");
    assert_non_null(dl);
    assert_int_equal(dl->fmt, DSV4_W_FP8);
    back = malloc(QL * D);
    CUDA_OK(cudaMemcpy(back, dl->w, QL * D, cudaMemcpyDeviceToHost));
    assert_memory_equal(back, m->layers[1].attn.wq_a.w, QL * D);
    CUDA_OK(cudaMemcpy(back, dl->scale, 2, cudaMemcpyDeviceToHost));
    assert_memory_equal(back, m->layers[1].attn.wq_a.scale, 2);
    CUDA_OK(cudaMemcpy(back, dsv4_cuda_dev_vector(dev, m->layers[0].ffn_norm), D * sizeof(float),
                       cudaMemcpyDeviceToHost));
    assert_memory_equal(back, m->layers[0].ffn_norm, D * sizeof(float));
    free(back);

    /* the uploaded expert table drives the expert kernel; workspace carved from the arena */
    DSV4_OK(dsv4_cuda_dev_experts(dev, 1, &ex));
    assert_int_equal(ex.n_experts, E);
    assert_int_equal(ex.fmt, DSV4_W_FP4);
    ex.quant_act = true;        /* fp8 numerics */
    DSV4_OK(dsv4_cuda_dev_carve(dev, (3 * BATCH * TOPK + 2) * sizeof(int32_t), &p));
    ws.d_groups = p;
    DSV4_OK(dsv4_cuda_dev_carve(dev, BATCH * TOPK * INTER * sizeof(float), &p));
    ws.d_h = p;
    DSV4_OK(dsv4_cuda_dev_carve(dev, BATCH * TOPK * D * sizeof(float), &p));
    ws.d_out = p;
    dsv4_cuda_dev_seal(dev);
    assert_int_equal(dsv4_cuda_dev_carve(dev, 16, &p), -EPERM);

    x = malloc(BATCH * D * sizeof(float));
    ref = calloc(BATCH * D, sizeof(float));
    eo = malloc(D * sizeof(float));
    gt_fill_normal(x, BATCH * D, 1.0f);
    for (int b = 0; b < BATCH; b++) {
        dsv4_twin_fp8_roundtrip(x + b * D, D, 128);
        gt_fill_normal(logits, E, 2.0f);
        dsv4_twin_router(logits, E, TOPK, NULL, NULL, 1.5f, idx + b * TOPK, wts + b * TOPK);
        for (int j = 0; j < TOPK; j++) {
            int e = idx[b * TOPK + j];
            dsv4_twin_expert(&m->w1[1][e], &m->w3[1][e], &m->w2[1][e], x + b * D, 10.0f, eo);
            for (int d = 0; d < D; d++)
                ref[b * D + d] += wts[b * TOPK + j] * eo[d];
        }
    }
    dx = gt_dev_copy(x, BATCH * D * sizeof(float));
    didx = gt_dev_copy(idx, sizeof(idx));
    dw = gt_dev_copy(wts, sizeof(wts));
    dy = gt_dev_poisoned(BATCH * D);
    DSV4_OK(dsv4_cuda_moe_experts(&ex, dx, BATCH, TOPK, didx, dw, &ws, dy, dsv4_cuda_dev_stream(dev)));
    CUDA_OK(cudaStreamSynchronize(dsv4_cuda_dev_stream(dev)));
    out = gt_host_from(dy, BATCH * D);
    ASSERT_REL("experts from the uploaded table", out, ref, BATCH * D, 2e-3);

    dsv4_cuda_dev_get_stats(dev, &st);
    assert_int_equal(st.device_allocs, 1);
    /* FP4 experts: the tensor-core variant unless DSV4_CUDA_MOE_MMA=0, else the FMA one */
    assert_true(st.launches[DSV4_CUDA_V_EXPERTS_FP4] + st.launches[DSV4_CUDA_V_EXPERTS_FP4_FMA] >= 1);
    assert_int_equal(st.graph_captures, 0);

    cudaFree(dx); cudaFree(didx); cudaFree(dw); cudaFree(dy);
    free(x); free(ref); free(eo); free(out);
    dsv4_cuda_dev_destroy(dev);
    free_model(m);
    free(m);
}

/* A plan larger than the device fails before allocating, with the numbers: 65 slots of 2^30 tokens
 * (about 27 GB of caches each at this shape) exceed any single GPU. */
static void test_too_big(void **state)
{
    struct model *m = calloc(1, sizeof(*m));
    struct dsv4_backend_opts opts = { .max_batch = DSV4_CUDA_MAX_BATCH, .max_context = 1 << 30,
                                      .numerics = DSV4_NUMERICS_FP8 };
    struct dsv4_cuda_dev *dev = NULL;
    assert_non_null(m);
    make_model(m);
    m->w.cfg.compress_ratio[0] = 4;
    assert_int_equal(dsv4_cuda_dev_create(0, &m->w, &opts, NULL, NULL, &dev), -ENOMEM);
    printf("# %s\n", dsv4_error_message());
    assert_non_null(strstr(dsv4_error_message(), "lower max_batch, max_context or prefix_cache"));
    free_model(m);
    free(m);
}

/* A model missing the attention linears is refused with a message naming what is missing. */
static void test_backend_refuses_incomplete(void **state)
{
    struct model *m = calloc(1, sizeof(*m));
    struct dsv4_backend_opts opts = { .max_batch = 1, .max_context = 64 };
    struct dsv4_backend *b = NULL;
    assert_non_null(m);
    make_model(m);
    assert_int_equal(dsv4_backend_cuda_create(&m->w, &opts, &b), -ENOENT);
    assert_null(b);
    printf("# %s\n", dsv4_error_message());
    assert_non_null(strstr(dsv4_error_message(), "not on the device"));
    free_model(m);
    free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_boot_and_experts),
        cmocka_unit_test(test_too_big),
        cmocka_unit_test(test_backend_refuses_incomplete),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
