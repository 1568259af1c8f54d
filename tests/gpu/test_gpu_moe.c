/* SPDX-License-Identifier: MIT */
/* GPU: router (scored and hash), routed FP4 experts grouped over the batch, SwiGLU, against their
 * CPU twins.
 * Bounds: router indices identical, weights 1e-5 relative (expf/log1pf differ in the last bit at
 * most). Experts in fp8 numerics (tensor cores): x is FP8-rounded on both sides and the bf16 MMAs
 * multiply e4m3 x e2m1 operands exactly and add in f32, so w1/w3 agree with the twin to f32
 * summation order (~1e-6 relative); but the SwiGLU output is rounded through e4m3 again before w2,
 * and a value within that distance of a rounding boundary may land one e4m3 step (2^-3 relative to
 * it) apart, moving its expert output by up to ~2^-3 |h_i| / ||h||. So experts are held to 2e-3:
 * room for a few such values per case, far below what a decoding, pairing, scale or grouping fault
 * does (whole rows or blocks wrong: >= 1e-2). Exact numerics (FMA kernels, no rounding of h) differ
 * from the twin only in summation order: 1e-5. A row alone and the same row inside a batch of 64
 * must be bit-identical, and the grouping must be the stable sort of the pairs by expert. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"

#define ROUTER_BOUND 1e-5
#define EXPERT_BOUND 2e-3
#define EXACT_BOUND 1e-5
#define SWIGLU_BOUND 1e-5

static void check_router(int batch, int E, int topk, bool hash)
{
    const int vocab = 1000;
    float *logits = malloc((size_t)batch * E * sizeof(float)), *bias = malloc((size_t)E * sizeof(float));
    int32_t *tid2eid = malloc((size_t)vocab * topk * sizeof(int32_t)), *tokens = malloc((size_t)batch * sizeof(int32_t));
    int32_t *ref_idx = malloc((size_t)batch * topk * sizeof(int32_t)), *idx = malloc((size_t)batch * topk * sizeof(int32_t));
    float *ref_w = malloc((size_t)batch * topk * sizeof(float)), *w;
    float *dl, *db, *dw;
    int32_t *dt, *dtok, *didx;
    char what[96];

    gt_fill_normal(logits, (size_t)batch * E, 2.0f);
    gt_fill_normal(bias, (size_t)E, 0.1f);
    for (int i = 0; i < vocab; i++)         /* distinct experts per token, as the table has them */
        for (int j = 0; j < topk; j++)
            tid2eid[i * topk + j] = (int32_t)((i * 7 + j * (E / topk)) % E);
    for (int b = 0; b < batch; b++)
        tokens[b] = (int32_t)(gt_u64() % vocab);
    for (int b = 0; b < batch; b++)
        dsv4_twin_router(logits + (size_t)b * E, E, topk, hash ? NULL : bias,
                         hash ? tid2eid + (size_t)tokens[b] * topk : NULL, 1.5f, ref_idx + b * topk, ref_w + b * topk);
    dl = gt_dev_copy(logits, (size_t)batch * E * sizeof(float));
    db = gt_dev_copy(bias, (size_t)E * sizeof(float));
    dt = gt_dev_copy(tid2eid, (size_t)vocab * topk * sizeof(int32_t));
    dtok = gt_dev_copy(tokens, (size_t)batch * sizeof(int32_t));
    didx = (int32_t *)gt_dev_poisoned((size_t)batch * topk);
    dw = gt_dev_poisoned((size_t)batch * topk);
    DSV4_OK(dsv4_cuda_router(dl, NULL, batch, E, topk, hash ? NULL : db, hash ? dt : NULL, dtok, 1.5f, didx, dw, NULL));
    w = gt_host_from(dw, (size_t)batch * topk);
    CUDA_OK(cudaMemcpy(idx, didx, (size_t)batch * topk * sizeof(int32_t), cudaMemcpyDeviceToHost));
    for (int i = 0; i < batch * topk; i++)
        if (idx[i] != ref_idx[i])
            fail_msg("router %s batch %d: slot %d picks expert %d, twin %d", hash ? "hash" : "scored", batch, i,
                     idx[i], ref_idx[i]);
    snprintf(what, sizeof(what), "router %s E=%d top-%d batch %d", hash ? "hash" : "scored", E, topk, batch);
    ASSERT_REL(what, w, ref_w, (size_t)batch * topk, ROUTER_BOUND);
    cudaFree(dl); cudaFree(db); cudaFree(dt); cudaFree(dtok); cudaFree(didx); cudaFree(dw);
    free(logits); free(bias); free(tid2eid); free(tokens); free(ref_idx); free(idx); free(ref_w); free(w);
}

static void test_router(void **state)
{
    check_router(1, 256, 6, false);
    check_router(64, 256, 6, false);
    check_router(64, 384, 6, false);
    check_router(5, 8, 2, false);
    check_router(64, 256, 6, true);
    check_router(3, 8, 2, true);
}

/* E FP4 experts of shape D x I with random weights and UE8M0 scales, on the host and the device. */
struct fx {
    int E, D, I;
    struct dsv4_linear *w1, *w3, *w2;
    uint8_t **bufs;                 /* [E * 6]: w1, s1, w3, s3, w2, s2 */
    void **dev;                     /* [E * 6] device copies */
    struct dsv4_cuda_experts ex;    /* fmt FP4, clamp 10; quant_act set per run */
};

static void fx_make(struct fx *f, int E, int D, int I)
{
    const size_t sz[6] = { (size_t)I * D / 2, (size_t)I * (D / 32), (size_t)I * D / 2, (size_t)I * (D / 32),
                           (size_t)D * I / 2, (size_t)D * (I / 32) };

    f->E = E;
    f->D = D;
    f->I = I;
    f->w1 = calloc(E, sizeof(*f->w1));
    f->w3 = calloc(E, sizeof(*f->w3));
    f->w2 = calloc(E, sizeof(*f->w2));
    f->bufs = calloc((size_t)E * 6, sizeof(*f->bufs));
    f->dev = calloc((size_t)E * 6, sizeof(*f->dev));
    for (int e = 0; e < E; e++) {
        uint8_t **b = f->bufs + e * 6;
        for (int j = 0; j < 6; j++) {
            b[j] = malloc(sz[j]);
            if (j % 2 == 0)
                gt_fill_fp4(b[j], sz[j]);
            else
                gt_fill_scales(b[j], sz[j], j == 5 ? -6 : -5);
        }
        f->w1[e] = (struct dsv4_linear){ DSV4_W_FP4, I, D, D, b[0], b[1], D / 32, "w1" };
        f->w3[e] = (struct dsv4_linear){ DSV4_W_FP4, I, D, D, b[2], b[3], D / 32, "w3" };
        f->w2[e] = (struct dsv4_linear){ DSV4_W_FP4, D, I, I, b[4], b[5], I / 32, "w2" };
    }
    f->ex = (struct dsv4_cuda_experts){ .n_experts = E, .dim = D, .inter = I, .swiglu_limit = 10.0f,
                                        .fmt = DSV4_W_FP4 };
}

/* Device copies of the (possibly edited) host bytes and the device table. */
static void fx_upload(struct fx *f)
{
    const size_t sz[6] = { (size_t)f->I * f->D / 2, (size_t)f->I * (f->D / 32), (size_t)f->I * f->D / 2,
                           (size_t)f->I * (f->D / 32), (size_t)f->D * f->I / 2, (size_t)f->D * (f->I / 32) };
    struct dsv4_cuda_expert *tab = calloc(f->E, sizeof(*tab));
    const int D = f->D, I = f->I;

    for (int e = 0; e < f->E; e++) {
        void **d = f->dev + e * 6;
        for (int j = 0; j < 6; j++)
            d[j] = gt_dev_copy(f->bufs[e * 6 + j], sz[j]);
        tab[e].w1 = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = I, .in = D, .row_stride = D, .w = d[0],
                                               .scale = d[1], .scale_stride = D / 32 };
        tab[e].w3 = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = I, .in = D, .row_stride = D, .w = d[2],
                                               .scale = d[3], .scale_stride = D / 32 };
        tab[e].w2 = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = D, .in = I, .row_stride = I, .w = d[4],
                                               .scale = d[5], .scale_stride = I / 32 };
    }
    f->ex.d_table = gt_dev_copy(tab, (size_t)f->E * sizeof(*tab));
    free(tab);
}

/* A second table of the same experts, every one in k-tile blocks as the boot plan stores them: the
 * even ones in pinned, mapped host memory (dsv4_cuda_tile_fp4), the odd ones in device memory, tiled
 * there from fx_upload's row-major copies (dsv4_cuda_tile_fp4_dev), whose bytes must equal the host
 * tiling's. Returns the table (device memory); *host is the pinned allocation to free, *dev the
 * device one. */
static const struct dsv4_cuda_expert *fx_table_tiled(const struct fx *f, uint8_t **host, uint8_t **dev)
{
    const size_t wb[3] = { (size_t)f->I * f->D / 2, (size_t)f->I * f->D / 2, (size_t)f->D * f->I / 2 };
    const size_t sb[3] = { (size_t)f->I * (f->D / 32), (size_t)f->I * (f->D / 32), (size_t)f->D * (f->I / 32) };
    const size_t per = 2 * (wb[0] + sb[0]) + wb[2] + sb[2];
    struct dsv4_cuda_expert *tab = calloc(f->E, sizeof(*tab));
    uint8_t *h = NULL, *hd = NULL;

    uint8_t *dd = NULL, *back = malloc(per);
    CUDA_OK(cudaHostAlloc((void **)&h, per * (size_t)f->E, cudaHostAllocMapped | cudaHostAllocPortable));
    CUDA_OK(cudaHostGetDevicePointer((void **)&hd, h, 0));
    CUDA_OK(cudaMalloc((void **)&dd, per * (size_t)f->E));
    for (int e = 0; e < f->E; e++) {
        void **d = f->dev + e * 6;
        const struct dsv4_linear *L[3] = { &f->w1[e], &f->w3[e], &f->w2[e] };
        struct dsv4_cuda_linear *T[3] = { &tab[e].w1, &tab[e].w3, &tab[e].w2 };
        size_t at = per * (size_t)e;
        for (int m = 0; m < 3; m++) {
            *T[m] = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = L[m]->out, .in = L[m]->in,
                                               .row_stride = L[m]->in, .scale_stride = L[m]->in / 32 };
            dsv4_cuda_tile_fp4(L[m]->w, L[m]->row_stride / 2, L[m]->scale, L[m]->scale_stride, L[m]->out, L[m]->in,
                               h + at, h + at + wb[m]);
            if (e % 2) {
                assert_int_equal(dsv4_cuda_tile_fp4_dev(d[2 * m], L[m]->in / 2, d[2 * m + 1], L[m]->in / 32,
                                                        L[m]->out, L[m]->in, dd + at, dd + at + wb[m], NULL), 0);
                CUDA_OK(cudaMemcpy(back, dd + at, wb[m] + sb[m], cudaMemcpyDeviceToHost));
                assert_memory_equal(back, h + at, wb[m] + sb[m]);
            }
            T[m]->w = (e % 2 ? dd : hd) + at;
            T[m]->scale = (e % 2 ? dd : hd) + at + wb[m];
            at += wb[m] + sb[m];
        }
    }
    const struct dsv4_cuda_expert *dt = gt_dev_copy(tab, (size_t)f->E * sizeof(*tab));
    free(tab);
    free(back);
    *host = h;
    *dev = dd;
    return dt;
}

static void fx_free(struct fx *f)
{
    for (int i = 0; i < f->E * 6; i++) {
        cudaFree(f->dev[i]);
        free(f->bufs[i]);
    }
    cudaFree((void *)f->ex.d_table);
    free(f->w1); free(f->w3); free(f->w2); free(f->bufs); free(f->dev);
}

/* The experts kernel on host inputs: y [batch, D] (caller frees); the groups buffer (3 P + 2 ints)
 * is copied to groups when non-NULL. Workspace buffers start as NaN. With add [batch, D] it runs
 * as the step does: dsv4_cuda_moe_routed, then dsv4_cuda_moe_combine adding it. */
static float *fx_run_add(const struct fx *f, bool quant_act, const float *x, int batch, int topk, const int32_t *idx,
                         const float *w, int32_t *groups, const float *add)
{
    const size_t P = (size_t)batch * topk;
    struct dsv4_cuda_experts ex = f->ex;
    struct dsv4_cuda_moe_ws ws;
    float *dx, *dw, *dy, *y;
    int32_t *didx;

    ex.quant_act = quant_act;
    ws.d_groups = (int32_t *)gt_dev_poisoned(3 * P + 2);
    ws.d_h = gt_dev_poisoned(P * f->I);
    ws.d_out = gt_dev_poisoned(P * f->D);
    dx = gt_dev_copy(x, (size_t)batch * f->D * sizeof(float));
    didx = gt_dev_copy(idx, P * sizeof(int32_t));
    dw = gt_dev_copy(w, P * sizeof(float));
    dy = gt_dev_poisoned((size_t)batch * f->D);
    float *dadd = add ? gt_dev_copy(add, (size_t)batch * f->D * sizeof(float)) : NULL;
    if (add) {
        DSV4_OK(dsv4_cuda_moe_routed(&ex, dx, batch, topk, didx, &ws, NULL));
        DSV4_OK(dsv4_cuda_moe_combine(&ex, batch, topk, didx, dw, &ws, dadd, NULL, dy, NULL));
    } else {
        DSV4_OK(dsv4_cuda_moe_experts(&ex, dx, batch, topk, didx, dw, &ws, dy, NULL));
    }
    y = gt_host_from(dy, (size_t)batch * f->D);
    if (groups)
        CUDA_OK(cudaMemcpy(groups, ws.d_groups, (3 * P + 2) * sizeof(int32_t), cudaMemcpyDeviceToHost));
    cudaFree(ws.d_groups); cudaFree(ws.d_h); cudaFree(ws.d_out);
    cudaFree(dx); cudaFree(didx); cudaFree(dw); cudaFree(dy); cudaFree(dadd);
    return y;
}

static float *fx_run(const struct fx *f, bool quant_act, const float *x, int batch, int topk, const int32_t *idx,
                     const float *w, int32_t *groups)
{
    return fx_run_add(f, quant_act, x, batch, topk, idx, w, groups, NULL);
}

/* eo [nb, E, D]: every expert on every row of x [nb, D] with the twin's arithmetic (dsv4_twin_expert:
 * weights from dsv4_twin_linear_row, f32 sums in k order, the clamped SwiGLU, with fp8 the e4m3 1x128
 * rounding of h) but each weight row decoded once for all nb rows. */
static void fx_reference(const struct fx *f, const float *x, int nb, bool fp8, float *eo)
{
    const int D = f->D, I = f->I, E = f->E, K = D > I ? D : I;
    float *row = malloc((size_t)K * sizeof(float)), *xt = malloc((size_t)K * nb * sizeof(float));
    float *g = malloc((size_t)nb * I * sizeof(float)), *u = malloc((size_t)nb * I * sizeof(float));
    float *acc = malloc((size_t)nb * sizeof(float));

    for (int e = 0; e < E; e++) {
        const struct dsv4_linear *W[2] = { &f->w1[e], &f->w3[e] };
        float *out[2] = { g, u };
        for (int k = 0; k < D; k++)         /* x transposed: the nb sums of a weight row run side by side */
            for (int b = 0; b < nb; b++)
                xt[(size_t)k * nb + b] = x[(size_t)b * D + k];
        for (int m = 0; m < 2; m++)
            for (int r = 0; r < I; r++) {
                dsv4_twin_linear_row(W[m], r, row);
                for (int b = 0; b < nb; b++)
                    acc[b] = 0.0f;
                for (int k = 0; k < D; k++)
                    for (int b = 0; b < nb; b++)
                        acc[b] += row[k] * xt[(size_t)k * nb + b];
                for (int b = 0; b < nb; b++)
                    out[m][(size_t)b * I + r] = acc[b];
            }
        for (int b = 0; b < nb; b++) {
            float *h = g + (size_t)b * I;
            for (int i = 0; i < I; i++) {
                float gi = fminf(h[i], 10.0f), ui = fminf(fmaxf(u[(size_t)b * I + i], -10.0f), 10.0f);
                h[i] = gi / (1.0f + expf(-gi)) * ui;
            }
            if (fp8)
                dsv4_twin_fp8_roundtrip(h, (size_t)I, 128);
            for (int i = 0; i < I; i++)
                xt[(size_t)i * nb + b] = h[i];
        }
        for (int r = 0; r < D; r++) {
            dsv4_twin_linear_row(&f->w2[e], r, row);
            for (int b = 0; b < nb; b++)
                acc[b] = 0.0f;
            for (int k = 0; k < I; k++)
                for (int b = 0; b < nb; b++)
                    acc[b] += row[k] * xt[(size_t)k * nb + b];
            for (int b = 0; b < nb; b++)
                eo[((size_t)b * E + e) * D + r] = acc[b];
        }
    }
    free(row); free(xt); free(g); free(u); free(acc);
}

/* ref [batch, D] = sum_j w[b,j] eo[b, idx[b,j]] in j order, skipping invalid slots (as combine does) */
static void combine_ref(const struct fx *f, const float *eo, int batch, int topk, const int32_t *idx, const float *w,
                        float *ref)
{
    for (int b = 0; b < batch; b++)
        for (int d = 0; d < f->D; d++) {
            float acc = 0.0f;
            for (int j = 0; j < topk; j++) {
                const int e = idx[b * topk + j];
                if (e >= 0 && e < f->E)
                    acc += w[b * topk + j] * eo[((size_t)b * f->E + e) * f->D + d];
            }
            ref[(size_t)b * f->D + d] = acc;
        }
}

/* Relative error over the batch (bounded) and of the worst row (printed, to localize failures). */
static void check_rows(const char *what, const float *out, const float *ref, int batch, int D, double bound)
{
    double worst = 0.0;
    int wb = 0;
    for (int b = 0; b < batch; b++) {
        const double e = gt_rel_err(out + (size_t)b * D, ref + (size_t)b * D, (size_t)D);
        if (!(e <= worst)) {
            worst = e;
            wb = b;
        }
    }
    printf("# %-56s worst row %d: %.3g\n", what, wb, worst);
    ASSERT_REL(what, out, ref, (size_t)batch * D, bound);
}

/* The stable grouping: groups ascending by expert, pairs of a group in pair order. */
static void check_groups(const char *what, const int32_t *groups, int P, int E, const int32_t *idx)
{
    int ng = 0, pos = 0;
    for (int e = 0; e < E; e++) {
        int first = 1;
        for (int p = 0; p < P; p++) {
            if (idx[p] != e)
                continue;
            if (first) {
                if (groups[1 + ng] != e || groups[1 + P + ng] != pos)
                    fail_msg("%s: group %d is expert %d from %d, expected expert %d from %d", what, ng,
                             groups[1 + ng], groups[1 + P + ng], e, pos);
                ng++;
                first = 0;
            }
            if (groups[2 + 2 * P + pos] != p)
                fail_msg("%s: pair list slot %d holds %d, expected pair %d (expert %d)", what, pos,
                         groups[2 + 2 * P + pos], p, e);
            pos++;
        }
    }
    if (groups[0] != ng || groups[1 + P + ng] != pos)
        fail_msg("%s: %d groups ending at %d, expected %d ending at %d", what, groups[0], groups[1 + P + groups[0]],
                 ng, pos);
}

/* Row b of a batch run equals the same row run alone, bit for bit. */
static void check_alone(const char *what, const struct fx *f, const float *x, int topk, const int32_t *idx,
                        const float *w, int b, const float *batch_out)
{
    float *y = fx_run(f, true, x + (size_t)b * f->D, 1, topk, idx + b * topk, w + b * topk, NULL);
    if (memcmp(y, batch_out + (size_t)b * f->D, (size_t)f->D * sizeof(float)) != 0) {
        int d = 0;
        while (d < f->D - 1 && y[d] == batch_out[(size_t)b * f->D + d])
            d++;
        fail_msg("%s: row %d alone differs from the batch at %d: %.9g vs %.9g", what, b, d, y[d],
                 batch_out[(size_t)b * f->D + d]);
    }
    printf("# %-56s row %d alone: bit-identical\n", what, b);
    free(y);
}

#define MOE_ROWS 64         /* the largest step */
#define MOE_E 8
#define MOE_TOPK 6

/* Real shapes (V4-Flash: D 4096, I 2048, top-6) on 8 experts, fp8 numerics (the tensor-core path):
 * batch 1, 16, 32 and 64 with router picks (1, 2, 4 and 8 n8 tiles of tokens per expert), a
 * prefill-like chunk of 64 rows picking the same 6 experts, every slot on one expert (384 pairs:
 * several passes of 64), rows alone vs in the batch, the grouping. */
static void test_experts_flash(void **state)
{
    const int D = 4096, I = 2048, E = MOE_E, K = MOE_TOPK, B = MOE_ROWS;
    const int batches[4] = { 1, 16, 32, 64 };
    struct fx f;
    float *x = malloc((size_t)B * D * sizeof(float)), *logits = malloc((size_t)E * sizeof(float));
    float *eo = malloc((size_t)B * E * D * sizeof(float)), *ref = malloc((size_t)B * D * sizeof(float));
    float *w = malloc((size_t)B * K * sizeof(float)), *twin = malloc((size_t)D * sizeof(float)), *y, *y64;
    int32_t *idx = malloc((size_t)B * K * sizeof(int32_t)), *idx2 = malloc((size_t)B * K * sizeof(int32_t));
    int32_t *groups = malloc((3 * (size_t)B * K + 2) * sizeof(int32_t));
    const uint64_t launches = dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4);
    uint64_t runs = 0;
    char what[128];

    fx_make(&f, E, D, I);
    fx_upload(&f);
    gt_fill_normal(x, (size_t)B * D, 1.0f);
    for (int b = 0; b < B; b++) {
        dsv4_twin_fp8_roundtrip(x + (size_t)b * D, (size_t)D, 128);
        gt_fill_normal(logits, (size_t)E, 2.0f);
        dsv4_twin_router(logits, E, K, NULL, NULL, 1.5f, idx + b * K, w + b * K);
    }
    fx_reference(&f, x, B, true, eo);
    for (int c = 0; c < 2; c++) {       /* the fast reference is the twin's arithmetic */
        const int b = c ? B - 1 : 0, e = c ? E - 1 : 2;
        dsv4_twin_expert(&f.w1[e], &f.w3[e], &f.w2[e], x + (size_t)b * D, 10.0f, twin);
        snprintf(what, sizeof(what), "reference vs dsv4_twin_expert (row %d, expert %d)", b, e);
        ASSERT_REL(what, eo + ((size_t)b * E + e) * D, twin, (size_t)D, 1e-6);
    }

    for (int i = 0; i < 4; i++) {
        const int n = batches[i];
        y = fx_run(&f, true, x, n, K, idx, w, groups);
        runs++;
        combine_ref(&f, eo, n, K, idx, w, ref);
        snprintf(what, sizeof(what), "experts fp8 E=%d D=%d I=%d top-%d batch %d", E, D, I, K, n);
        check_rows(what, y, ref, n, D, EXPERT_BOUND);
        check_groups(what, groups, n * K, E, idx);
        if (n == B) {
            check_alone(what, &f, x, K, idx, w, 0, y);
            check_alone(what, &f, x, K, idx, w, 37, y);
            runs += 2;
        }
        free(y);
    }

    /* every expert in k-tile blocks, the even ones read from host memory: the same bits as row-major */
    {
        uint8_t *host, *tiled_dev;
        struct fx fh = f;
        fh.ex.d_table = fx_table_tiled(&f, &host, &tiled_dev);
        fh.ex.tiled = true;
        for (int i = 0; i < 4; i += 3) {
            const int n = batches[i];
            float *yd = fx_run(&f, true, x, n, K, idx, w, NULL), *yh = fx_run(&fh, true, x, n, K, idx, w, NULL);
            runs += 2;
            assert_memory_equal(yh, yd, (size_t)n * D * sizeof(float));
            printf("# experts fp8 batch %d, in k-tile blocks (even in host memory, odd tiled on the device): "
                   "bit-identical to row-major\n", n);
            free(yd);
            free(yh);
        }
        for (int one = 4; one <= 5; one++) {    /* one expert (host, then device), six passes of 64 */
            for (int p = 0; p < B * K; p++)
                idx2[p] = one;
            float *yd = fx_run(&f, true, x, B, K, idx2, w, NULL), *yh = fx_run(&fh, true, x, B, K, idx2, w, NULL);
            runs += 2;
            assert_memory_equal(yh, yd, (size_t)B * D * sizeof(float));
            free(yd);
            free(yh);
        }
        /* tiled experts have no FMA path: exact numerics refuse the table */
        struct dsv4_cuda_moe_ws ws = { (int32_t *)gt_dev_poisoned(3 * K + 2), gt_dev_poisoned((size_t)K * I),
                                       gt_dev_poisoned((size_t)K * D) };
        float *dx = gt_dev_copy(x, (size_t)D * sizeof(float));
        int32_t *didx = gt_dev_copy(idx, (size_t)K * sizeof(int32_t));
        fh.ex.quant_act = false;
        assert_int_equal(dsv4_cuda_moe_routed(&fh.ex, dx, 1, K, didx, &ws, NULL), -EINVAL);
        cudaFree(ws.d_groups); cudaFree(ws.d_h); cudaFree(ws.d_out); cudaFree(dx); cudaFree(didx);
        cudaFree((void *)fh.ex.d_table);
        cudaFree(tiled_dev);
        cudaFreeHost(host);
    }

    /* a prefill chunk whose 64 rows all pick experts 5, 2, 7, 4, 1, 6 (6 groups of 64 tokens) */
    for (int b = 0; b < B; b++)
        for (int j = 0; j < K; j++)
            idx2[b * K + j] = (int32_t)((5 + 5 * j) % E);
    y64 = fx_run(&f, true, x, B, K, idx2, w, groups);
    runs++;
    combine_ref(&f, eo, B, K, idx2, w, ref);
    snprintf(what, sizeof(what), "experts fp8 batch %d, every row on the same %d experts", B, K);
    check_rows(what, y64, ref, B, D, EXPERT_BOUND);
    check_groups(what, groups, B * K, E, idx2);
    check_alone(what, &f, x, K, idx2, w, 63, y64);
    runs++;
    free(y64);

    /* every slot on expert 4: one group of 384 pairs, six passes of 64 */
    for (int p = 0; p < B * K; p++)
        idx2[p] = 4;
    y = fx_run(&f, true, x, B, K, idx2, w, groups);
    runs++;
    combine_ref(&f, eo, B, K, idx2, w, ref);
    snprintf(what, sizeof(what), "experts fp8 batch %d, all %d slots on one expert", B, B * K);
    check_rows(what, y, ref, B, D, EXPERT_BOUND);
    check_groups(what, groups, B * K, E, idx2);
    free(y);

    if (dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4) - launches != runs)
        fail_msg("%llu tensor-core expert launches for %llu runs (variant %s)",
                 (unsigned long long)(dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4) - launches),
                 (unsigned long long)runs, dsv4_cuda_variant_name(DSV4_CUDA_V_EXPERTS_FP4));
    printf("# %s: %llu launches\n", dsv4_cuda_variant_name(DSV4_CUDA_V_EXPERTS_FP4), (unsigned long long)runs);
    fx_free(&f);
    free(x); free(logits); free(eo); free(ref); free(w); free(twin); free(idx); free(idx2); free(groups);
}

#define PF_ROWS 200          /* a prefill chunk: more rows than a decode step */
#define PF_REF_ROWS 16      /* rows also held to the reference (the CPU side is the slow part) */
#define PF_SLICE 50         /* decode-sized runs the chunk is compared with */

/* A prefill chunk of 200 rows at real shapes (the wgmma kernels where the image has them, and the
 * 8-warp mma.sync kernels), its 1200 pairs dealt to the 8 experts in groups of 3, 13, 20, 27, 44, 65,
 * 428 and 600 tokens (every pass shape of either kernel: wgmma's N 8, 16, 24, 32, 48 and 64 columns,
 * a pass of one token after a full one, several full passes, a last pass of 24), shuffled over the
 * rows: rows 0-15 against the reference, every row bit-identical to the same row in a run of 50 (the
 * one-tile kernels), the mma.sync prefill kernels bit-identical to the wgmma ones, and the tiled table
 * (half in host memory) bit-identical to row-major. */
static void test_experts_prefill(void **state)
{
    const int D = 4096, I = 2048, E = MOE_E, K = MOE_TOPK, R = PF_ROWS, P = PF_ROWS * MOE_TOPK;
    const int counts[MOE_E] = { 3, 13, 20, 27, 44, 65, 428, 600 };
    struct fx f;
    float *x = malloc((size_t)R * D * sizeof(float)), *w = malloc((size_t)P * sizeof(float));
    float *eo = malloc((size_t)PF_REF_ROWS * E * D * sizeof(float)), *ref = malloc((size_t)PF_REF_ROWS * D * sizeof(float));
    int32_t *idx = malloc((size_t)P * sizeof(int32_t)), *groups = malloc((3 * (size_t)P + 2) * sizeof(int32_t));
    const uint64_t launches = dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4);
    const uint64_t wg_launches = dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4_WGMMA);
    uint64_t runs = 0, wg_runs = 0;
    char what[128];

    DSV4_OK(dsv4_cuda_moe_prepare());
    const bool wg = dsv4_cuda_moe_wgmma();
    printf("# prefill experts on %s%s\n", wg ? "wgmma" : "mma.sync: ", wg ? "" : dsv4_cuda_moe_wgmma_why_not());
    fx_make(&f, E, D, I);
    fx_upload(&f);
    gt_fill_normal(x, (size_t)R * D, 1.0f);
    for (int b = 0; b < R; b++)
        dsv4_twin_fp8_roundtrip(x + (size_t)b * D, (size_t)D, 128);
    for (int e = 0, p = 0; e < E; e++)
        for (int i = 0; i < counts[e]; i++)
            idx[p++] = e;
    for (int p = P - 1; p > 0; p--) {       /* Fisher-Yates over the pairs */
        const int q = (int)(gt_u64() % (uint64_t)(p + 1));
        const int32_t t = idx[p];
        idx[p] = idx[q];
        idx[q] = t;
    }
    for (int p = 0; p < P; p++)
        w[p] = 0.05f + 0.3f * gt_uniform();

    float *y = fx_run(&f, true, x, R, K, idx, w, groups);
    runs++;
    wg_runs += wg;
    snprintf(what, sizeof(what), "experts fp8 prefill chunk of %d rows", R);
    check_groups(what, groups, P, E, idx);
    fx_reference(&f, x, PF_REF_ROWS, true, eo);
    combine_ref(&f, eo, PF_REF_ROWS, K, idx, w, ref);
    check_rows(what, y, ref, PF_REF_ROWS, D, EXPERT_BOUND);
    for (int b0 = 0; b0 < R; b0 += PF_SLICE) {
        float *ys = fx_run(&f, true, x + (size_t)b0 * D, PF_SLICE, K, idx + b0 * K, w + b0 * K, NULL);
        runs++;
        if (memcmp(ys, y + (size_t)b0 * D, (size_t)PF_SLICE * D * sizeof(float)) != 0)
            fail_msg("%s: rows %d..%d differ from the same rows in a run of %d", what, b0, b0 + PF_SLICE - 1,
                     PF_SLICE);
        free(ys);
    }
    printf("# %-56s every row == the row in a run of %d, bit for bit\n", what, PF_SLICE);
    if (wg) {       /* the kernels other GPUs take, on this one */
        setenv("DSV4_CUDA_MOE_WGMMA", "0", 1);
        DSV4_OK(dsv4_cuda_moe_prepare());
        assert_false(dsv4_cuda_moe_wgmma());
        float *ym = fx_run(&f, true, x, R, K, idx, w, NULL);
        runs++;
        unsetenv("DSV4_CUDA_MOE_WGMMA");
        DSV4_OK(dsv4_cuda_moe_prepare());
        assert_true(dsv4_cuda_moe_wgmma());
        assert_memory_equal(ym, y, (size_t)R * D * sizeof(float));
        printf("# %-56s on mma.sync: bit-identical to wgmma\n", what);
        free(ym);
    }
    {
        uint8_t *host, *tiled_dev;
        struct fx fh = f;
        fh.ex.d_table = fx_table_tiled(&f, &host, &tiled_dev);
        fh.ex.tiled = true;
        float *yt = fx_run(&fh, true, x, R, K, idx, w, NULL);
        runs++;
        wg_runs += wg;
        assert_memory_equal(yt, y, (size_t)R * D * sizeof(float));
        printf("# %-56s in k-tile blocks: bit-identical to row-major\n", what);
        free(yt);
        cudaFree((void *)fh.ex.d_table);
        cudaFree(tiled_dev);
        cudaFreeHost(host);
    }
    const uint64_t wg_seen = dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4_WGMMA) - wg_launches;
    if (dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4) - launches + wg_seen != runs || wg_seen != wg_runs)
        fail_msg("%llu tensor-core expert launches (%llu on wgmma) for %llu runs (%llu on wgmma)",
                 (unsigned long long)(dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4) - launches + wg_seen),
                 (unsigned long long)wg_seen, (unsigned long long)runs, (unsigned long long)wg_runs);
    free(y);
    fx_free(&f);
    free(x); free(w); free(eo); free(ref); free(idx); free(groups);
}

/* Small shapes (D 256, I 128, top-2, batch 5) with one slot naming no expert, a few scales above 2
 * (the second multiply of the FP4 decoder) and one of 2^-127: fp8 numerics on tensor cores against
 * dsv4_twin_expert itself, exact numerics (FMA kernels, x not rounded) against the twin's sums. */
static void test_experts_tiny(void **state)
{
    const int D = 256, I = 128, E = 4, K = 2, B = 5;
    struct fx f;
    float x[5 * 256], xq[5 * 256], logits[4], w[5 * 2], eo1[256], *eo = malloc((size_t)B * E * D * sizeof(float));
    float ref[5 * 256], *y;
    int32_t idx[5 * 2];
    uint64_t l_mma, l_fma;

    fx_make(&f, E, D, I);
    f.bufs[1 * 6 + 1][3] = 130;                 /* expert 1: w1 row 0 block 3 scaled by 8 */
    f.bufs[1 * 6 + 5][I / 32 + 1] = 129;        /* w2 row 1 block 1 by 4 */
    f.bufs[2 * 6 + 3][0] = 0;                   /* expert 2: w3 row 0 block 0 by 2^-127 */
    fx_upload(&f);
    gt_fill_normal(x, (size_t)B * D, 1.0f);
    memcpy(xq, x, sizeof(x));
    for (int b = 0; b < B; b++) {
        dsv4_twin_fp8_roundtrip(xq + b * D, (size_t)D, 128);
        gt_fill_normal(logits, (size_t)E, 2.0f);
        dsv4_twin_router(logits, E, K, NULL, NULL, 1.5f, idx + b * K, w + b * K);
    }
    idx[2 * K + 1] = -1;                        /* a slot the router left empty (NaN scores) */
    idx[0] = 1;                                 /* rows 0 and 3 use expert 1 and 2 (the odd scales) */
    idx[3 * K] = 2;
    if (idx[1] == 1)
        idx[1] = 0;
    if (idx[3 * K + 1] == 2)
        idx[3 * K + 1] = 3;

    for (int b = 0; b < B; b++)
        for (int d = 0; d < D; d++)
            ref[b * D + d] = 0.0f;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < K; j++) {
            const int e = idx[b * K + j];
            if (e < 0)
                continue;
            dsv4_twin_expert(&f.w1[e], &f.w3[e], &f.w2[e], xq + b * D, 10.0f, eo1);
            for (int d = 0; d < D; d++)
                ref[b * D + d] += w[b * K + j] * eo1[d];
        }
    l_mma = dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4);
    y = fx_run(&f, true, xq, B, K, idx, w, NULL);
    check_rows("experts fp8 tiny E=4 D=256 I=128 top-2 batch 5", y, ref, B, D, EXPERT_BOUND);
    assert_int_equal(dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4) - l_mma, 1);
    {   /* the shared expert's output added by the combine: the sum, then one f32 add, bit for bit */
        float add[5 * 256], *ya;
        gt_fill_normal(add, (size_t)B * D, 1.0f);
        ya = fx_run_add(&f, true, xq, B, K, idx, w, NULL, add);
        for (int i = 0; i < B * D; i++) {
            const float want = y[i] + add[i];
            if (memcmp(&ya[i], &want, sizeof(want)) != 0)
                fail_msg("combine + add [%d]: %.9g, want %.9g (the experts' sum then the add)", i, ya[i], want);
        }
        free(ya);
    }
    free(y);

    fx_reference(&f, x, B, false, eo);
    combine_ref(&f, eo, B, K, idx, w, ref);
    l_fma = dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4_FMA);
    y = fx_run(&f, false, x, B, K, idx, w, NULL);
    check_rows("experts exact tiny E=4 D=256 I=128 top-2 batch 5", y, ref, B, D, EXACT_BOUND);
    assert_int_equal(dsv4_cuda_variant_launches(DSV4_CUDA_V_EXPERTS_FP4_FMA) - l_fma, 1);
    free(y);
    fx_free(&f);
    free(eo);
}

/* Expert parallelism's MoE sublayer at the kernel level (kernels/ep.cu, doc/MULTIGPU.md): each of R
 * ranks masks the routing to the experts it holds (dsv4_cuda_ep_mask, against its twin) and runs
 * them over every pair into its pair outputs (the rest stay NaN); dsv4_cuda_ep_select takes each
 * pair's output from the rank holding its expert (against its twin); moe_combine over the rows' own
 * routing then gives the unsplit sublayer (routed + combine + add) bit for bit, for every R. */
#define EP_B 5
#define EP_D 256
#define EP_I 128
#define EP_E 8
#define EP_K 3
#define EP_MAX_RANKS 4

static void test_ep_split(void **state)
{
    const int B = EP_B, D = EP_D, K = EP_K, P = EP_B * EP_K;
    struct fx f;
    float x[EP_B * EP_D], xq[EP_B * EP_D], add[EP_B * EP_D], logits[EP_E], w[EP_B * EP_K];
    float *g = malloc(sizeof(float) * EP_MAX_RANKS * P * D), *g_twin = malloc(sizeof(float) * EP_MAX_RANKS * P * D);
    int32_t idx[EP_B * EP_K], mine[EP_B * EP_K], want[EP_B * EP_K];
    struct dsv4_cuda_experts ex;

    assert_true(g && g_twin);
    fx_make(&f, EP_E, D, EP_I);
    fx_upload(&f);
    ex = f.ex;
    ex.quant_act = true;
    gt_fill_normal(x, (size_t)B * D, 1.0f);
    gt_fill_normal(add, (size_t)B * D, 1.0f);
    memcpy(xq, x, sizeof(x));
    for (int b = 0; b < B; b++) {
        dsv4_twin_fp8_roundtrip(xq + b * D, (size_t)D, 128);
        gt_fill_normal(logits, (size_t)EP_E, 2.0f);
        dsv4_twin_router(logits, EP_E, K, NULL, NULL, 1.5f, idx + b * K, w + b * K);
    }
    float *whole = fx_run_add(&f, true, xq, B, K, idx, w, NULL, add);     /* the unsplit sublayer */
    float *dx = gt_dev_copy(xq, sizeof(xq)), *dw = gt_dev_copy(w, sizeof(w)), *dadd = gt_dev_copy(add, sizeof(add));
    int32_t *didx = gt_dev_copy(idx, sizeof(idx)), *dmine = gt_dev_copy(idx, sizeof(idx));
    struct dsv4_cuda_moe_ws ws = { .d_groups = (int32_t *)gt_dev_poisoned(3 * (size_t)P + 2),
                                   .d_h = gt_dev_poisoned((size_t)P * EP_I) };
    for (int R = 1; R <= EP_MAX_RANKS; R++) {
        int e0, e1[EP_MAX_RANKS];
        long spanning = 0;
        for (int r = 0; r < R; r++) {
            DSV4_OK(dsv4_ep_shard(EP_E, R, r, &e0, &e1[r]));
            memcpy(want, idx, sizeof(idx));
            dsv4_twin_ep_mask(want, P, e0, e1[r]);
            CUDA_OK(cudaMemcpy(dmine, idx, sizeof(idx), cudaMemcpyHostToDevice));
            DSV4_OK(dsv4_cuda_ep_mask(dmine, P, e0, e1[r], NULL));
            CUDA_OK(cudaMemcpy(mine, dmine, sizeof(mine), cudaMemcpyDeviceToHost));
            assert_memory_equal(mine, want, sizeof(mine));
            ws.d_out = gt_dev_poisoned((size_t)P * D);      /* pairs of other ranks' experts stay NaN */
            DSV4_OK(dsv4_cuda_moe_routed(&ex, dx, B, K, dmine, &ws, NULL));
            CUDA_OK(cudaMemcpy(g + (size_t)r * P * D, ws.d_out, sizeof(float) * P * D, cudaMemcpyDeviceToHost));
            cudaFree(ws.d_out);
        }
        for (int b = 0; b < B; b++) {    /* rows whose experts lie on two ranks or more */
            bool span = false;
            for (int j = 1; j < K; j++)
                for (int r = 0; r < R; r++)
                    span |= (idx[b * K + j] < e1[r]) != (idx[b * K] < e1[r]);
            spanning += span;
        }
        memcpy(g_twin, g, sizeof(float) * R * P * D);
        dsv4_twin_ep_select(g_twin, idx, R, e1, P, D);
        float *dg = gt_dev_copy(g, sizeof(float) * R * P * D), *dy = gt_dev_poisoned((size_t)B * D);
        DSV4_OK(dsv4_cuda_ep_select(dg, didx, R, e1, P, D, NULL));
        float *sel = gt_host_from(dg, (size_t)P * D);
        assert_memory_equal(sel, g_twin, sizeof(float) * P * D);
        for (int i = 0; i < P * D; i++)
            if (isnan(sel[i]))
                fail_msg("ep %d ranks: pair %d (expert %d) took an output its rank did not compute", R, i / D,
                         idx[i / D]);
        ws.d_out = dg;
        DSV4_OK(dsv4_cuda_moe_combine(&ex, B, K, didx, dw, &ws, dadd, NULL, dy, NULL));
        float *y = gt_host_from(dy, (size_t)B * D);
        for (int i = 0; i < B * D; i++) {
            assert_false(isnan(y[i]));
            if (memcmp(&y[i], &whole[i], sizeof(float)) != 0)
                fail_msg("ep %d ranks [%d]: %.9g, the unsplit sublayer %.9g", R, i, y[i], whole[i]);
        }
        print_message("ep split over %d ranks: mask and select == twins, the sublayer == unsplit bit for bit "
                      "(%ld of %d rows' experts on two ranks or more)\n", R, spanning, B);
        free(y);
        free(sel);
        cudaFree(dg); cudaFree(dy);
    }
    cudaFree(ws.d_groups); cudaFree(ws.d_h);
    cudaFree(dx); cudaFree(dw); cudaFree(dadd); cudaFree(didx); cudaFree(dmine);
    free(whole);
    free(g);
    free(g_twin);
    fx_free(&f);
}

static void test_swiglu(void **state)
{
    const int rows = 64;
    const int64_t n = 2048;
    const size_t N = (size_t)rows * n;
    float *g = malloc(N * sizeof(float)), *u = malloc(N * sizeof(float)), *ref = malloc(N * sizeof(float)), *out;
    float *dg, *du, *dh;
    gt_fill_normal(g, N, 8.0f);     /* wide enough that the clamp at 10 engages */
    gt_fill_normal(u, N, 8.0f);
    for (size_t i = 0; i < N; i++) {
        float gi = fminf(g[i], 10.0f), ui = fminf(fmaxf(u[i], -10.0f), 10.0f);
        ref[i] = gi / (1.0f + expf(-gi)) * ui;
    }
    dg = gt_dev_copy(g, N * sizeof(float));
    du = gt_dev_copy(u, N * sizeof(float));
    dh = gt_dev_poisoned(N);
    DSV4_OK(dsv4_cuda_swiglu(dg, NULL, du, NULL, rows, n, 10.0f, dh, NULL));
    out = gt_host_from(dh, N);
    ASSERT_REL("swiglu clamp 10 [64,2048]", out, ref, N, SWIGLU_BOUND);
    cudaFree(dg); cudaFree(du); cudaFree(dh);
    free(g); free(u); free(ref); free(out);
}

/* Routing statistics: counts[e] += the pairs choosing e, padding rows (the pad slot) and skipped
 * pairs (-1, NaN scores) left out; the counts accumulate over launches. */
static void test_route_count(void **state)
{
    const int E = 256, topk = 6, batch = 37, pad = 64;
    int32_t idx[37 * 6], slot[37];
    uint64_t want[256] = { 0 }, got[256];

    (void)state;
    for (int b = 0; b < batch; b++)
        slot[b] = b % 5 == 4 ? pad : b;
    for (int i = 0; i < batch * topk; i++)
        idx[i] = i % 11 == 3 ? -1 : (int32_t)(gt_u64() % E);
    for (int rep = 0; rep < 2; rep++)
        for (int i = 0; i < batch * topk; i++)
            if (slot[i / topk] != pad && idx[i] >= 0)
                want[idx[i]]++;
    int32_t *didx = gt_dev_copy(idx, sizeof(idx)), *dslot = gt_dev_copy(slot, sizeof(slot));
    uint64_t *dcounts = NULL;
    CUDA_OK(cudaMalloc((void **)&dcounts, (E + 2) * sizeof(uint64_t)));
    CUDA_OK(cudaMemset(dcounts, 0, (E + 2) * sizeof(uint64_t)));
    for (int rep = 0; rep < 2; rep++)   /* counts[0] and counts[E + 1] guard the table's ends */
        DSV4_OK(dsv4_cuda_route_count(didx, batch, topk, dslot, pad, dcounts + 1, NULL));
    uint64_t guard[2];
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(got, dcounts + 1, sizeof(got), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&guard[0], dcounts, sizeof(uint64_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&guard[1], dcounts + E + 1, sizeof(uint64_t), cudaMemcpyDeviceToHost));
    assert_memory_equal(got, want, sizeof(want));
    assert_int_equal(guard[0], 0);
    assert_int_equal(guard[1], 0);
    printf("# route counts: %d rows x %d twice, padding rows and skipped pairs left out, as the host counts\n",
           batch, topk);
    cudaFree(didx); cudaFree(dslot); cudaFree(dcounts);
}

/* Readers of a pending linear result (struct dsv4_cuda_pending: 13 splits): the router on the gate's
 * logits, SwiGLU on the shared expert's w1 and w3 results, the combine adding the shared expert's
 * output; each bit for bit what it makes of the reduced values. */
static void test_pending_readers(void **state)
{
    static const int rows[] = { 1, 5, 64 };
    const int E = 256, topk = 6, I = 2048, D = 4096;
    struct dsv4_cuda_gemm_ws ws, ws2;

    (void)state;
    for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
        const int B = rows[r];
        float *dsum, *dsum2;
        float *bias = malloc(sizeof(float) * E);
        gt_fill_normal(bias, (size_t)E, 0.1f);
        float *db = gt_dev_copy(bias, sizeof(float) * E);
        struct dsv4_cuda_pending p = gt_pending(&ws, 13, B, E, 2.0f, &dsum);
        int32_t *didx_ref = (int32_t *)gt_dev_poisoned((size_t)B * topk), *didx = (int32_t *)gt_dev_poisoned((size_t)B * topk);
        float *dw_ref = gt_dev_poisoned((size_t)B * topk), *dw = gt_dev_poisoned((size_t)B * topk);
        float *dl = gt_dev_poisoned((size_t)B * E);
        DSV4_OK(dsv4_cuda_router(dsum, NULL, B, E, topk, db, NULL, NULL, 1.5f, didx_ref, dw_ref, NULL));
        DSV4_OK(dsv4_cuda_router(dl, &p, B, E, topk, db, NULL, NULL, 1.5f, didx, dw, NULL));
        int32_t *idx_ref = malloc(sizeof(int32_t) * B * topk), *idx_got = malloc(sizeof(int32_t) * B * topk);
        CUDA_OK(cudaMemcpy(idx_ref, didx_ref, sizeof(int32_t) * B * topk, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(idx_got, didx, sizeof(int32_t) * B * topk, cudaMemcpyDeviceToHost));
        assert_memory_equal(idx_got, idx_ref, sizeof(int32_t) * B * topk);
        free(idx_ref);
        free(idx_got);
        gt_assert_same("router: weights from pending logits", dw, dw_ref, (size_t)B * topk);
        assert_int_equal(dsv4_cuda_router(dl, &p, B, E / 2, topk, db, NULL, NULL, 1.5f, didx, dw, NULL), -EINVAL);
        cudaFree((void *)p.part); cudaFree(dsum); cudaFree(db); cudaFree(didx_ref); cudaFree(didx);
        cudaFree(dw_ref); cudaFree(dw); cudaFree(dl);
        free(bias);

        struct dsv4_cuda_pending pg = gt_pending(&ws, 13, B, I, 8.0f, &dsum), pu = gt_pending(&ws2, 13, B, I, 8.0f, &dsum2);
        float *dh_ref = gt_dev_poisoned((size_t)B * I), *dh = gt_dev_poisoned((size_t)B * I);
        float *dg = gt_dev_poisoned((size_t)B * I), *du = gt_dev_poisoned((size_t)B * I);
        DSV4_OK(dsv4_cuda_swiglu(dsum, NULL, dsum2, NULL, B, I, 10.0f, dh_ref, NULL));
        DSV4_OK(dsv4_cuda_swiglu(dg, &pg, du, &pu, B, I, 10.0f, dh, NULL));
        gt_assert_same("swiglu of pending w1 and w3 results", dh, dh_ref, (size_t)B * I);
        cudaFree((void *)pg.part); cudaFree((void *)pu.part); cudaFree(dsum); cudaFree(dsum2);
        cudaFree(dh_ref); cudaFree(dh); cudaFree(dg); cudaFree(du);

        /* the combine: the routed rows' outputs, weights and choices are random; add is pending */
        const size_t P = (size_t)B * topk;
        struct dsv4_cuda_experts ex = { .n_experts = E, .dim = D };
        struct dsv4_cuda_moe_ws mws = { 0 };
        float *out = malloc(P * D * sizeof(float)), *w = malloc(P * sizeof(float));
        int32_t *idx = malloc(P * sizeof(int32_t));
        gt_fill_normal(out, P * D, 1.0f);
        gt_fill_normal(w, P, 1.0f);
        for (size_t i = 0; i < P; i++)
            idx[i] = (int32_t)(gt_u64() % (E + 8)) - 4;     /* a few invalid: skipped */
        mws.d_out = gt_dev_copy(out, P * D * sizeof(float));
        float *dwt = gt_dev_copy(w, P * sizeof(float));
        int32_t *di = gt_dev_copy(idx, P * sizeof(int32_t));
        float *dy_ref = gt_dev_poisoned((size_t)B * D), *dy = gt_dev_poisoned((size_t)B * D);
        float *dadd = gt_dev_poisoned((size_t)B * D);
        p = gt_pending(&ws, 13, B, D, 1.0f, &dsum);
        DSV4_OK(dsv4_cuda_moe_combine(&ex, B, topk, di, dwt, &mws, dsum, NULL, dy_ref, NULL));
        DSV4_OK(dsv4_cuda_moe_combine(&ex, B, topk, di, dwt, &mws, dadd, &p, dy, NULL));
        gt_assert_same("combine adding a pending shared-expert output", dy, dy_ref, (size_t)B * D);
        cudaFree((void *)p.part); cudaFree(dsum); cudaFree(mws.d_out); cudaFree(dwt); cudaFree(di);
        cudaFree(dy_ref); cudaFree(dy); cudaFree(dadd);
        free(out); free(w); free(idx);
    }
}

int main(void)
{
    unsetenv("DSV4_CUDA_MOE_MMA");     /* the tensor-core experts are under test: never switched off */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_experts_tiny),
        cmocka_unit_test(test_experts_flash),
        cmocka_unit_test(test_experts_prefill),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_pending_readers),
        cmocka_unit_test(test_route_count),
        cmocka_unit_test(test_ep_split),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
