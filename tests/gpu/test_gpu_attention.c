/* SPDX-License-Identifier: MIT */
/* GPU: decode attention (kernels/attention.cu: the tensor-core kernel over FP8 KV entries, the f32
 * kernel over exact-numerics entries, the split combine with sinks and inverse RoPE) against a
 * double-precision reference computed here from the entries' decoded values, on fresh random caches:
 *   - V4-Flash shapes (64 heads, head_dim 512, rope 64, window 128), B = 1 and 8: sliding layers with
 *     positions inside the window and past the ring (it wraps), HCA (every complete entry, runs long
 *     enough for two key tiles a split), CSA (indexer picks, unpicked entries left as decoys);
 *     V4-Pro's 128 heads with top-1024; 48 heads at head_dim 192 (partial tiles); the tiny fixtures'
 *     and the default model's shapes; the f32 kernel on exact-numerics entries.
 *   - bound, per row: max |gpu - ref| / max |ref| <= 1e-5, NaN fails. The MMA kernel is meant to
 *     match f32 math: keys are exact in bf16, queries enter as three bf16 terms (2^-24), probabilities
 *     as two (2^-16); measured on an H200 over several seeds: <= 1.4e-6, the f32 kernel <= 2.6e-6.
 *   - every row of a batch bit-identical to the same row run alone (batch invariance).
 *   - whole rows (a.whole, the prefill chunks' path: one block takes all of a row's runs and folds
 *     them as the combine does) bit-identical to the split launch and its combine on the same rows,
 *     for every case above (FP8 entries: sliding, HCA with up to 16 runs of two tiles, CSA, 4 to
 *     128 heads, head_dim 32 to 512); hence within the bound too, and equal to every grouping of
 *     heads of the split launch and to each row alone; so is every grouping of heads a whole-row
 *     block takes (16, 32, 64: the device's largest by default). f32 entries ignore a.whole.
 *     Whole rows reading their own position from the step's own entries (a.own) give the same bits
 *     with the rings' copies of those entries replaced by decoys (which, read, change every row).
 *   - the launch counted under the variant that ran (FP8 entries: DSV4_CUDA_V_ATTENTION_MMA, whole
 *     rows DSV4_CUDA_V_ATTENTION_WHOLE).
 *   - shapes the kernels cannot take refused with -EINVAL.
 * Entries are written with the CPU reference's quantizers (engine/model/quant.c) in the layout of doc/MODEL.md §5.2,
 * which tests/gpu/test_gpu_codec.c checks against the GPU's own store. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "engine/model/quant.h"
#include "tests/gpu/gpu_test.h"
#include "kernels/kernels_internal.h"

#define ATT_BOUND 1e-5
#define RING_EXTRA 7                /* ring = window + 7: the step's ring at max_batch 8 */
#define COMP_DECOYS 4               /* entries past the last complete one in each slot */
#define DECOY_POOL 16               /* distinct random entries copied into every unread place */
#define KV_GROUP 64
#define E4M3_MAX 448.0f
#define MAX_ROWS 8

/* kernels/attention.cu: dsv4_cuda_attention_prepare(a->hd), then dsv4_cuda_attention, with C linkage. */
int dsv4_cuda_attention_once(const struct dsv4_cuda_att_args *a, int batch, const float *d_sink,
                             const float *d_inv_freq, float *d_o, void *stream);

struct att_case {
    const char *what;
    int kvf;                    /* DSV4_KV_* */
    int H, hd, rd, window;
    int ratio;                  /* 0: window only */
    int topk;                   /* > 0: CSA, the indexer picks up to topk entries; 0: every complete one */
    int B;
    int pos[MAX_ROWS];
};

static const struct att_case cases[] = {
    { "flash sliding, B 1, pos < window", DSV4_KV_FP8, 64, 512, 64, 128, 0, 0, 1, { 5 } },
    { "flash sliding, B 8, ring wraps", DSV4_KV_FP8, 64, 512, 64, 128, 0, 0, 8,
      { 0, 1, 6, 127, 128, 134, 135, 999 } },
    { "flash HCA, B 8", DSV4_KV_FP8, 64, 512, 64, 128, 128, 0, 8,
      { 5, 127, 128, 300, 4000, 20000, 65535, 140000 } },
    { "flash CSA top-512, B 8", DSV4_KV_FP8, 64, 512, 64, 128, 4, 512, 8,
      { 2, 3, 100, 135, 2047, 2048, 5000, 9000 } },
    { "flash CSA top-512, B 1", DSV4_KV_FP8, 64, 512, 64, 128, 4, 512, 1, { 9000 } },
    { "pro CSA top-1024, 128 heads, B 2", DSV4_KV_FP8, 128, 512, 64, 128, 4, 1024, 2, { 300, 9000 } },
    { "48 heads, head_dim 192, CSA top-16, B 3", DSV4_KV_FP8, 48, 192, 64, 32, 4, 16, 3, { 3, 40, 500 } },
    { "tiny_a shape (4 heads, 32/8), CSA top-8, B 8", DSV4_KV_FP8, 4, 32, 8, 16, 4, 8, 8,
      { 0, 3, 15, 16, 22, 23, 60, 200 } },
    { "default model shape (8 heads, 64/16), HCA, B 4", DSV4_KV_FP8, 8, 64, 16, 64, 128, 0, 4,
      { 1, 70, 300, 2000 } },
    { "flash HCA, f32 entries, B 8", DSV4_KV_F32, 64, 512, 64, 128, 128, 0, 8,
      { 5, 127, 128, 300, 4000, 20000, 65535, 140000 } },
    { "tiny_a shape, f32 entries, CSA top-8, B 8", DSV4_KV_F32, 4, 32, 8, 16, 4, 8, 8,
      { 0, 3, 15, 16, 22, 23, 60, 200 } },
};

/* MODEL.md §5.2: [nope e4m3][rd bf16][ceil(nope/64) UE8M0], padded to 8 bytes; f32: hd values. */
static int entry_bytes(int hd, int rd, int kvf)
{
    const int nope = hd - rd;
    return kvf == DSV4_KV_F32 ? hd * 4 : (nope + 2 * rd + (nope + KV_GROUP - 1) / KV_GROUP + 7) / 8 * 8;
}

/* Encode v[hd] as an entry at e, the values the entry holds into dec[hd] (NULL: not wanted). */
static void encode_entry(const float *v, int hd, int rd, int kvf, uint8_t *e, float *dec)
{
    const int nope = hd - rd, eb = entry_bytes(hd, rd, kvf);
    if (kvf == DSV4_KV_F32) {
        memcpy(e, v, (size_t)hd * sizeof(float));
        if (dec)
            memcpy(dec, v, (size_t)hd * sizeof(float));
        return;
    }
    memset(e, 0, (size_t)eb);
    for (int g = 0; g * KV_GROUP < nope; g++) {
        const int end = (g + 1) * KV_GROUP < nope ? (g + 1) * KV_GROUP : nope;
        float amax = 0.0f;
        for (int d = g * KV_GROUP; d < end; d++)
            amax = fmaxf(amax, fabsf(v[d]));
        const uint8_t sb = dsv4_ue8m0_scale_for(amax, E4M3_MAX);
        const float s = dsv4_e8m0_to_f32(sb);
        e[nope + 2 * rd + g] = sb;
        for (int d = g * KV_GROUP; d < end; d++) {
            e[d] = dsv4_f32_to_e4m3(v[d] / s);
            if (dec)
                dec[d] = dsv4_e4m3_to_f32(e[d]) * s;
        }
    }
    for (int d = nope; d < hd; d++) {
        const uint16_t h = dsv4_f32_to_bf16(v[d]);
        e[nope + 2 * (d - nope)] = (uint8_t)(h & 0xff);
        e[nope + 2 * (d - nope) + 1] = (uint8_t)(h >> 8);
        if (dec)
            dec[d] = dsv4_bf16_to_f32(h);
    }
}

/* A key like kv_norm's output: N(0, 1) with each 64-value group scaled by 2^-1, 1 or 2, so the
 * groups' UE8M0 scales differ. */
static void random_key(float *v, int hd)
{
    for (int g = 0; g < hd; g += KV_GROUP) {
        const float s = ldexpf(1.0f, (int)(gt_u64() % 3) - 1);
        for (int d = g; d < hd && d < g + KV_GROUP; d++)
            v[d] = s * gt_normal();
    }
}

/* Host and device copies of one case's inputs; keys [b] lists the decoded keys row b attends to. */
struct fixture {
    const struct att_case *c;
    int eb, ring, nslots, cap, sel_stride;
    int64_t win_stride, comp_stride;
    uint8_t *win, *comp;        /* [nslots, ...] */
    float *q, *sink, *inv_freq;
    int32_t slot[MAX_ROWS], nsel[MAX_ROWS], *sel;
    float *keys[MAX_ROWS];
    int nk[MAX_ROWS];
    uint8_t *d_win, *d_comp;
    float *d_q, *d_sink, *d_inv, *d_part;
    int32_t *d_pos, *d_slot, *d_sel, *d_nsel;
};

static void fill_decoys(uint8_t *dst, size_t n_entries, const uint8_t *pool, int eb)
{
    for (size_t i = 0; i < n_entries; i++)
        memcpy(dst + i * eb, pool + (gt_u64() % DECOY_POOL) * eb, (size_t)eb);
}

/* Ascending random pick of k of 0 .. n-1 into out. */
static void pick_sorted(int n, int k, int32_t *out)
{
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    assert_non_null(idx);
    for (int i = 0; i < n; i++)
        idx[i] = i;
    for (int i = 0; i < k; i++) {
        const int j = i + (int)(gt_u64() % (uint64_t)(n - i));
        const int32_t x = idx[i];
        idx[i] = idx[j];
        idx[j] = x;
    }
    for (int i = 0; i < k; i++) {       /* insertion sort of the picks (k <= topk) */
        int32_t x = idx[i];
        int j = i;
        while (j > 0 && out[j - 1] > x) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = x;
    }
    free(idx);
}

static void make_fixture(struct fixture *f, const struct att_case *c)
{
    const int H = c->H, hd = c->hd, B = c->B;
    float *v = malloc(sizeof(float) * (size_t)hd);
    uint8_t *pool;

    memset(f, 0, sizeof(*f));
    f->c = c;
    f->eb = entry_bytes(hd, c->rd, c->kvf);
    f->ring = c->window + RING_EXTRA;
    f->nslots = B + 1;
    for (int b = 0; b < B; b++) {
        const int n = c->ratio ? (c->pos[b] + 1) / c->ratio : 0;
        if (n + COMP_DECOYS > f->cap)
            f->cap = n + COMP_DECOYS;
        f->slot[b] = B - b;             /* rows in reverse slot order; slot 0 unused */
    }
    f->win_stride = (int64_t)f->ring * f->eb;
    f->comp_stride = (int64_t)f->cap * f->eb;
    f->win = malloc((size_t)(f->nslots * f->win_stride));
    f->comp = malloc((size_t)(f->nslots * f->comp_stride));
    pool = malloc((size_t)DECOY_POOL * f->eb);
    assert_true(v && f->win && f->comp && pool);
    for (int i = 0; i < DECOY_POOL; i++) {
        random_key(v, hd);
        encode_entry(v, hd, c->rd, c->kvf, pool + (size_t)i * f->eb, NULL);
    }
    fill_decoys(f->win, (size_t)f->nslots * f->ring, pool, f->eb);
    fill_decoys(f->comp, (size_t)f->nslots * f->cap, pool, f->eb);

    f->sel_stride = c->topk > 0 ? c->topk : 1;
    f->sel = calloc((size_t)B * f->sel_stride, sizeof(int32_t));
    assert_non_null(f->sel);
    for (int b = 0; b < B; b++) {
        const int pos = c->pos[b], nw = pos + 1 < c->window ? pos + 1 : c->window;
        const int n = c->ratio ? (pos + 1) / c->ratio : 0;
        uint8_t *ring = f->win + f->slot[b] * f->win_stride, *comp = f->comp + f->slot[b] * f->comp_stride;
        int ns = n;
        if (c->topk > 0) {
            ns = n < c->topk ? n : c->topk;
            pick_sorted(n, ns, f->sel + (size_t)b * f->sel_stride);
            for (int i = ns; i < f->sel_stride; i++)    /* unused picks: valid decoy indices */
                f->sel[(size_t)b * f->sel_stride + i] = (int32_t)(gt_u64() % (uint64_t)f->cap);
        }
        f->nsel[b] = ns;
        f->nk[b] = nw + ns;
        f->keys[b] = malloc(sizeof(float) * (size_t)f->nk[b] * hd);
        assert_non_null(f->keys[b]);
        /* the ring holds the last `ring` positions; the row attends to the last nw of them */
        for (int p = pos - f->ring + 1 > 0 ? pos - f->ring + 1 : 0; p <= pos; p++) {
            const int k = p - (pos - nw + 1);
            random_key(v, hd);
            encode_entry(v, hd, c->rd, c->kvf, ring + (int64_t)(p % f->ring) * f->eb,
                         k >= 0 ? f->keys[b] + (size_t)k * hd : NULL);
        }
        for (int i = 0; i < ns; i++) {
            const int e = c->topk > 0 ? f->sel[(size_t)b * f->sel_stride + i] : i;
            random_key(v, hd);
            encode_entry(v, hd, c->rd, c->kvf, comp + (int64_t)e * f->eb, f->keys[b] + (size_t)(nw + i) * hd);
        }
    }

    /* queries like the per-head RMSNormed ones, some rows 3x sharper; sinks around the scores */
    f->q = malloc(sizeof(float) * (size_t)B * H * hd);
    f->sink = malloc(sizeof(float) * (size_t)H);
    f->inv_freq = malloc(sizeof(float) * (size_t)(c->rd / 2));
    assert_true(f->q && f->sink && f->inv_freq);
    for (int b = 0; b < B; b++)
        gt_fill_normal(f->q + (size_t)b * H * hd, (size_t)H * hd, b % 3 == 1 ? 3.0f : 1.0f);
    gt_fill_normal(f->sink, (size_t)H, 2.0f);
    for (int i = 0; i < c->rd / 2; i++)
        f->inv_freq[i] = 1.0f / powf(10000.0f, (float)(2 * i) / (float)c->rd);

    f->d_win = gt_dev_copy(f->win, (size_t)(f->nslots * f->win_stride));
    f->d_comp = gt_dev_copy(f->comp, (size_t)(f->nslots * f->comp_stride));
    f->d_q = gt_dev_copy(f->q, sizeof(float) * (size_t)B * H * hd);
    f->d_sink = gt_dev_copy(f->sink, sizeof(float) * (size_t)H);
    f->d_inv = gt_dev_copy(f->inv_freq, sizeof(float) * (size_t)(c->rd / 2));
    f->d_pos = gt_dev_copy(c->pos, sizeof(int32_t) * (size_t)B);
    f->d_slot = gt_dev_copy(f->slot, sizeof(int32_t) * (size_t)B);
    f->d_sel = gt_dev_copy(f->sel, sizeof(int32_t) * (size_t)B * f->sel_stride);
    f->d_nsel = gt_dev_copy(f->nsel, sizeof(int32_t) * (size_t)B);
    f->d_part = gt_dev_poisoned((size_t)B * DSV4_CUDA_ATT_SPLITS * H * (hd + 2));
    free(pool);
    free(v);
}

static void free_fixture(struct fixture *f)
{
    for (int b = 0; b < f->c->B; b++)
        free(f->keys[b]);
    free(f->win);
    free(f->comp);
    free(f->q);
    free(f->sink);
    free(f->inv_freq);
    free(f->sel);
    cudaFree(f->d_win);
    cudaFree(f->d_comp);
    cudaFree(f->d_q);
    cudaFree(f->d_sink);
    cudaFree(f->d_inv);
    cudaFree(f->d_pos);
    cudaFree(f->d_slot);
    cudaFree(f->d_sel);
    cudaFree(f->d_nsel);
    cudaFree(f->d_part);
}

/* The launch arguments for rows row0 .. row0 + B - 1 of the fixture. */
static struct dsv4_cuda_att_args args_for(const struct fixture *f, int row0)
{
    const struct att_case *c = f->c;
    struct dsv4_cuda_att_args a = {
        .q = f->d_q + (size_t)row0 * c->H * c->hd, .H = c->H, .hd = c->hd, .rd = c->rd, .kvf = c->kvf,
        .entry_bytes = f->eb, .pos = f->d_pos + row0, .slot = f->d_slot + row0, .win = f->d_win,
        .win_slot_stride = f->win_stride, .window = c->window, .ring = f->ring, .comp = f->d_comp,
        .comp_slot_stride = f->comp_stride, .ratio = c->ratio,
        .sel = c->topk > 0 ? f->d_sel + (size_t)row0 * f->sel_stride : NULL, .sel_stride = f->sel_stride,
        .nsel = f->d_nsel + row0, .scale = 1.0f / sqrtf((float)c->hd), .part = f->d_part,
    };
    return a;
}

/* o [H, hd] of row b in double: softmax over the keys and the sink, then RoPE^-1 at pos with the
 * angle rounded to f32 as the kernels (and the CPU backend) compute it. */
static void reference_row(const struct fixture *f, int b, double *o)
{
    const struct att_case *c = f->c;
    const int H = c->H, hd = c->hd, rd = c->rd, nk = f->nk[b], pos = c->pos[b];
    const double scale = (double)(1.0f / sqrtf((float)hd));
    double *s = malloc(sizeof(double) * (size_t)(nk > 0 ? nk : 1));
    assert_non_null(s);
    for (int h = 0; h < H; h++) {
        const float *q = f->q + ((size_t)b * H + h) * hd;
        double *oh = o + (size_t)h * hd, m = f->sink[h], den;
        for (int t = 0; t < nk; t++) {
            const float *k = f->keys[b] + (size_t)t * hd;
            double dot = 0.0;
            for (int d = 0; d < hd; d++)
                dot += (double)q[d] * k[d];
            s[t] = dot * scale;
            m = s[t] > m ? s[t] : m;
        }
        den = exp(f->sink[h] - m);
        memset(oh, 0, sizeof(double) * (size_t)hd);
        for (int t = 0; t < nk; t++) {
            const float *k = f->keys[b] + (size_t)t * hd;
            const double w = exp(s[t] - m);
            den += w;
            for (int d = 0; d < hd; d++)
                oh[d] += w * k[d];
        }
        for (int d = 0; d < hd; d++)
            oh[d] /= den;
        for (int i = 0; i < rd / 2; i++) {
            const float angle = f->inv_freq[i] * (float)pos;
            const double cs = cos((double)angle), sn = sin((double)angle);
            double *x = oh + hd - rd + 2 * i;
            const double x0 = x[0], x1 = x[1];
            x[0] = x0 * cs + x1 * sn;
            x[1] = x1 * cs - x0 * sn;
        }
    }
    free(s);
}

/* max |gpu - ref| / max |ref| over one row's [H, hd]; INFINITY on NaN/Inf. *at: worst index. */
static double row_error(const float *gpu, const double *ref, size_t n, size_t *at)
{
    double num = 0.0, den = 0.0;
    *at = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(gpu[i])) {
            *at = i;
            return INFINITY;
        }
        const double e = fabs((double)gpu[i] - ref[i]);
        if (e > num) {
            num = e;
            *at = i;
        }
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return den > 0.0 ? num / den : num;
}

/* Whole rows reading the step's own entries (a.own, the prefill chunks' path) with first = pos, so
 * each row's own position comes from there: a copy of the rings whose entry at each row's position
 * is replaced by a fresh random one must give the bits of the rings themselves (`out`), and without
 * the own entries must not (the decoys are read, so the check is not vacuous). Returns the rows that
 * differ. */
static int check_own_entries(const struct fixture *f, const struct dsv4_cuda_att_args *aw, const float *out)
{
    const struct att_case *c = f->c;
    const int B = c->B;
    const size_t row_n = (size_t)c->H * c->hd, win_bytes = (size_t)(f->nslots * f->win_stride);
    uint8_t *own = malloc((size_t)B * f->eb), *win = malloc(win_bytes);
    float *v = malloc(sizeof(float) * (size_t)c->hd);
    assert_true(own && win && v);
    memcpy(win, f->win, win_bytes);
    for (int b = 0; b < B; b++) {
        const int64_t at = f->slot[b] * f->win_stride + (int64_t)(c->pos[b] % f->ring) * f->eb;
        memcpy(own + (size_t)b * f->eb, f->win + at, (size_t)f->eb);
        random_key(v, c->hd);
        encode_entry(v, c->hd, c->rd, c->kvf, win + at, NULL);
    }
    uint8_t *d_own = gt_dev_copy(own, (size_t)B * f->eb), *d_win = gt_dev_copy(win, win_bytes);
    int32_t *d_first = gt_dev_copy(c->pos, sizeof(int32_t) * (size_t)B);
    float *d_out = gt_dev_poisoned((size_t)B * row_n);
    struct dsv4_cuda_att_args ao = *aw;
    ao.win = d_win;
    DSV4_OK(dsv4_cuda_attention_once(&ao, B, f->d_sink, f->d_inv, d_out, NULL));
    float *dec = gt_host_from(d_out, (size_t)B * row_n);
    ao.own = d_own;
    ao.first = d_first;
    DSV4_OK(dsv4_cuda_attention_once(&ao, B, f->d_sink, f->d_inv, d_out, NULL));
    float *got = gt_host_from(d_out, (size_t)B * row_n);
    int differ = 0, decoyed = 0;
    for (int b = 0; b < B; b++) {
        differ += memcmp(got + (size_t)b * row_n, out + (size_t)b * row_n, row_n * sizeof(float)) != 0;
        decoyed += memcmp(dec + (size_t)b * row_n, out + (size_t)b * row_n, row_n * sizeof(float)) != 0;
    }
    assert_int_equal(decoyed, B);
    free(own);
    free(win);
    free(v);
    free(dec);
    free(got);
    cudaFree(d_own);
    cudaFree(d_win);
    cudaFree(d_first);
    cudaFree(d_out);
    return differ;
}

static void check_case(const struct att_case *c)
{
    struct fixture f;
    const int H = c->H, hd = c->hd, B = c->B;
    const size_t row_n = (size_t)H * hd;
    const enum dsv4_cuda_variant ran = c->kvf == DSV4_KV_FP8 ? DSV4_CUDA_V_ATTENTION_MMA : DSV4_CUDA_V_ATTENTION_F32;
    const enum dsv4_cuda_variant other = c->kvf == DSV4_KV_FP8 ? DSV4_CUDA_V_ATTENTION_F32 : DSV4_CUDA_V_ATTENTION_MMA;
    double *ref = malloc(sizeof(double) * row_n), worst = 0.0;
    float *d_o = gt_dev_poisoned((size_t)B * row_n), *d_o1 = gt_dev_poisoned(row_n), *out, *out1;
    float *d_og = gt_dev_poisoned((size_t)B * row_n), *d_ow = gt_dev_poisoned((size_t)B * row_n), *outw;
    int worst_row = 0, bad_rows = 0, differ_rows = 0, differ_groups = 0, differ_whole = 0, differ_own = 0;

    make_fixture(&f, c);
    const uint64_t n_ran = dsv4_cuda_variant_launches(ran), n_other = dsv4_cuda_variant_launches(other);
    struct dsv4_cuda_att_args a = args_for(&f, 0);
    DSV4_OK(dsv4_cuda_attention_once(&a, B, f.d_sink, f.d_inv, d_o, NULL));
    out = gt_host_from(d_o, (size_t)B * row_n);
    assert_int_equal(dsv4_cuda_variant_launches(ran), n_ran + 1);
    assert_int_equal(dsv4_cuda_variant_launches(other), n_other);

    for (int b = 0; b < B; b++) {
        size_t at;
        reference_row(&f, b, ref);
        const double e = row_error(out + (size_t)b * row_n, ref, row_n, &at);
        if (!(e <= ATT_BOUND)) {
            printf("#   row %d (pos %d, %d keys): error %.3g at head %zu dim %zu: gpu %.9g ref %.9g\n", b,
                   c->pos[b], f.nk[b], e, at / hd, at % hd, out[(size_t)b * row_n + at], ref[at]);
            bad_rows++;
        }
        if (!(e <= worst)) {
            worst = e;
            worst_row = b;
        }
    }
    /* FP8: every grouping of heads into blocks gives the same bits as the launcher's choice */
    for (int g = 16; c->kvf == DSV4_KV_FP8 && g <= 64; g *= 2) {
        struct dsv4_cuda_att_args ag = a;
        ag.heads_per_block = g;
        DSV4_OK(dsv4_cuda_attention_once(&ag, B, f.d_sink, f.d_inv, d_og, NULL));
        float *outg = gt_host_from(d_og, (size_t)B * row_n);
        if (memcmp(outg, out, (size_t)B * row_n * sizeof(float)) != 0) {
            printf("#   %d heads a block differ from the launcher's choice\n", g);
            differ_groups++;
        }
        free(outg);
    }
    /* whole rows: the split launch's bits (f32 entries: the whole flag changes nothing), with the
     * launcher's grouping of heads (0) and each one a whole-row block can take */
    const enum dsv4_cuda_variant whole = c->kvf == DSV4_KV_FP8 ? DSV4_CUDA_V_ATTENTION_WHOLE : DSV4_CUDA_V_ATTENTION_F32;
    struct dsv4_cuda_att_args aw = a;
    aw.whole = true;
    for (int g = 0; g <= 64; g = g ? 2 * g : 16) {
        const uint64_t n_whole = dsv4_cuda_variant_launches(whole);
        aw.heads_per_block = g;
        DSV4_OK(dsv4_cuda_attention_once(&aw, B, f.d_sink, f.d_inv, d_ow, NULL));
        assert_int_equal(dsv4_cuda_variant_launches(whole), n_whole + 1);
        outw = gt_host_from(d_ow, (size_t)B * row_n);
        for (int b = 0; b < B; b++) {
            if (memcmp(outw + (size_t)b * row_n, out + (size_t)b * row_n, row_n * sizeof(float)) != 0) {
                size_t at = 0;
                while (memcmp(outw + (size_t)b * row_n + at, out + (size_t)b * row_n + at, sizeof(float)) == 0)
                    at++;
                printf("#   row %d (pos %d, %d keys) whole (%d heads a block) differs from the splits: head %zu "
                       "dim %zu: %.9g against %.9g\n", b, c->pos[b], f.nk[b], g, at / hd, at % hd,
                       outw[(size_t)b * row_n + at], out[(size_t)b * row_n + at]);
                differ_whole++;
            }
        }
        free(outw);
    }
    aw.heads_per_block = 0;
    if (c->kvf == DSV4_KV_FP8)
        differ_own = check_own_entries(&f, &aw, out);
    /* each row alone: bit-identical to its place in the batch */
    for (int b = 0; B > 1 && b < B; b++) {
        struct dsv4_cuda_att_args a1 = args_for(&f, b);
        DSV4_OK(dsv4_cuda_attention_once(&a1, 1, f.d_sink, f.d_inv, d_o1, NULL));
        out1 = gt_host_from(d_o1, row_n);
        if (memcmp(out1, out + (size_t)b * row_n, row_n * sizeof(float)) != 0) {
            printf("#   row %d (pos %d) alone differs from the batch\n", b, c->pos[b]);
            differ_rows++;
        }
        free(out1);
    }
    printf("# %-46s %s: worst row %d (pos %d, %d keys) error %.3g (bound %.0e); %d/%d rows over; "
           "%d rows differ alone, %d head groupings differ, %d rows differ whole, %d with own entries\n", c->what,
           dsv4_cuda_variant_name(ran), worst_row, c->pos[worst_row], f.nk[worst_row], worst, ATT_BOUND, bad_rows,
           B, differ_rows, differ_groups, differ_whole, differ_own);
    assert_int_equal(bad_rows, 0);
    assert_int_equal(differ_rows, 0);
    assert_int_equal(differ_groups, 0);
    assert_int_equal(differ_whole, 0);
    assert_int_equal(differ_own, 0);
    free(out);
    free(ref);
    cudaFree(d_o);
    cudaFree(d_o1);
    cudaFree(d_og);
    cudaFree(d_ow);
    free_fixture(&f);
}

static void test_attention(void **state)
{
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_case(&cases[i]);
}

/* Shapes outside the kernels' reach are refused before any launch. */
static void test_refusals(void **state)
{
    struct dsv4_cuda_att_args a = { .H = 64, .hd = 512, .rd = 64, .kvf = DSV4_KV_FP8, .window = 128, .ring = 135 };
    float *d = gt_dev_poisoned(16);
    int32_t *d_i = (int32_t *)gt_dev_poisoned(16);

    a.q = a.part = d;
    a.pos = a.slot = a.nsel = d_i;
    a.win = a.comp = (const uint8_t *)d;
    a.entry_bytes = entry_bytes(512, 64, DSV4_KV_FP8);
    assert_int_equal(a.entry_bytes, 584);
    a.hd = 520;                                         /* past DSV4_CUDA_MAX_HEAD_DIM */
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.hd = 40;                                          /* not whole MMA k-steps */
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.hd = 64;
    a.rd = 4;                                           /* FP8: rope dims in chunks of 8 */
    a.entry_bytes = entry_bytes(64, 4, DSV4_KV_FP8);
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.rd = 16;
    a.entry_bytes = 584;                                /* not this shape's entry */
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.hd = 48;                                          /* f32 kernel: multiples of 32 */
    a.kvf = DSV4_KV_F32;
    a.entry_bytes = entry_bytes(48, 16, DSV4_KV_F32);
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.hd = 64;
    a.entry_bytes = entry_bytes(64, 16, DSV4_KV_F32);
    a.ring = 100;                                       /* ring shorter than the window */
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.kvf = DSV4_KV_FP8;                                /* FP8: 16, 32 or 64 heads a block */
    a.hd = 512;
    a.rd = 64;
    a.ring = 135;
    a.entry_bytes = 584;
    a.heads_per_block = 48;
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.heads_per_block = 0;                              /* own entries: whole rows only, with first */
    a.own = (const uint8_t *)d;
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    a.whole = true;
    assert_int_equal(dsv4_cuda_attention_once(&a, 1, d, d, d, NULL), -EINVAL);
    printf("# refusals: %s\n", dsv4_error_message());
    cudaFree(d);
    cudaFree(d_i);
}

int main(void)
{
    setenv("DSV4_CUDA_ATT_WHOLE", "1", 1);     /* a.whole is honoured, whatever the environment says */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_refusals),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
