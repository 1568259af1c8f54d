/* SPDX-License-Identifier: MIT */
/* GPU: the device sampler (kernels/sample.cu) against the CPU sampler (engine/serve/sampler.c) on fresh
 * random logits: V 129280 (rows 1 and 64), 1000 and 999 (a row length that is not a multiple of 4,
 * ld 1000), every parameter combination of the sampler's ten steps, logits shaped like a language
 * model's, flat, tied, masked with -inf, one sharp token, constant, and packed within 1/64 logit
 * (the last two overflow the shared candidate lists and take the bitwise fallback).
 * Bounds:
 *   - greedy tokens, top-n ids, n_top and status: identical to the CPU's, always (the same float
 *     operations and comparisons on both sides);
 *   - sampled tokens: identical, except draws whose top_p boundary, min_p cut or drawn interval
 *     lies, by the CPU's own numbers, within NEAR_SLACK (2) times the two sides' error bound of its
 *     threshold: per probability 3 ulp (CUDA expf <= 2 ulp, glibc <= 1; 0 where p = 1 on both) plus
 *     the device's 2^-42 fixed-point rounding, summed along the running sum. Only those can flip;
 *     they are counted and printed (expected ~0 a run) and not compared;
 *   - logprobs (chosen and top-n): within 1e-5 absolute of the CPU's;
 *   - a row alone and the same row inside its batch of 64: bit-identical results;
 *   - the history record / clear kernels: equal to a host model, bit for bit. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "engine/serve/philox.h"
#include "engine/serve/sampler.h"
#include "kernels/sample.h"
#include "tests/gpu/gpu_test.h"

#define V_FLASH 129280
#define ROWS_MAX 64
#define LOGPROB_BOUND 1e-5              /* on logprob_error: absolute below 1, relative above */
#define EXPF_REL 3.6e-7                 /* 3 ulp of a float, relative: CUDA expf 2 ulp, glibc's 1 */
#define FX_ONE 2199023255552.0          /* the device's fixed point: 2^41 */
#define NEAR_SLACK 2.0                  /* margin over the error bounds */

/* ---- random logits ---- */

enum kind { K_LLM, K_FLAT, K_TIES, K_MASKED, K_SHARP, K_CONST, K_NARROW, K_COUNT };
static const char *const kind_names[K_COUNT] = { "llm", "flat", "ties", "masked", "sharp", "const", "narrow" };

static void fill_logits(float *x, int V, enum kind k)
{
    switch (k) {
    case K_LLM:         /* a bulk around 0 and a few dozen tokens well above it */
    case K_MASKED:
        gt_fill_normal(x, (size_t)V, 2.5f);
        for (int i = 0; i < 40; i++)
            x[gt_u64() % (uint64_t)V] += 5.0f + 8.0f * gt_uniform();
        if (k == K_MASKED)
            for (int v = 0; v < V; v++)
                if (gt_u64() % 10 < 3)
                    x[v] = -INFINITY;
        break;
    case K_FLAT:
        gt_fill_normal(x, (size_t)V, 1.0f);
        break;
    case K_TIES:        /* quarter-logit grid: many exact ties, the top ones included */
        for (int v = 0; v < V; v++)
            x[v] = roundf(gt_normal() * 8.0f) * 0.25f + 0.125f;
        break;
    case K_SHARP:
        gt_fill_normal(x, (size_t)V, 1.0f);
        x[gt_u64() % (uint64_t)V] = 30.0f;
        break;
    case K_CONST: {
        const float c = 1.0f + gt_uniform();
        for (int v = 0; v < V; v++)
            x[v] = c;
        break;
    }
    default:            /* thousands of logits inside one 1/64 bin */
        for (int v = 0; v < V; v++)
            x[v] = 3.0f + 0.004f * gt_normal();
        break;
    }
}

/* ---- parameter variants: every step alone and together ---- */

struct variant {
    const char *name;
    float t, top_p, min_p, rep, pres, freq;
    int top_k, logprobs;
};

static const struct variant variants[] = {
    { "greedy", 0.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 5 },
    { "greedy+penalties", 0.0f, 1.0f, 0.0f, 1.3f, 0.6f, 0.4f, 0, 3 },
    { "T=1", 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0 },
    { "T=0.7", 0.7f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 1 },
    { "T=1.3 logprobs=20", 1.3f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 20 },
    { "top_k=1", 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1, 2 },
    { "top_k=40 T=0.8", 0.8f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 40, 0 },
    { "top_k=2000", 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 2000, 0 },
    { "top_p=0.9", 1.0f, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 4 },
    { "top_p=0.5 T=0.6", 0.6f, 0.5f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0 },
    { "top_p=0.99", 1.0f, 0.99f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0 },
    { "min_p=0.05", 1.0f, 1.0f, 0.05f, 1.0f, 0.0f, 0.0f, 0, 0 },
    { "min_p=0.2 T=1.5", 1.5f, 1.0f, 0.2f, 1.0f, 0.0f, 0.0f, 0, 0 },
    { "all", 0.8f, 0.9f, 0.02f, 1.0f, 0.0f, 0.0f, 100, 4 },
    { "all+penalties", 0.9f, 0.95f, 0.01f, 1.1f, 0.2f, 0.3f, 500, 7 },
    { "T=1 rep=1.5", 1.0f, 1.0f, 0.0f, 1.5f, 0.0f, 0.0f, 0, 0 },
    { "freq/pres only", 1.0f, 1.0f, 0.0f, 1.0f, 0.5f, -0.25f, 0, 2 },
    { "top_p=1e-6", 1.0f, 1e-6f, 0.0f, 1.0f, 0.0f, 0.0f, 0, 0 },
    { "top_k=3 top_p=0.999", 1.0f, 0.999f, 0.0f, 1.0f, 0.0f, 0.0f, 3, 0 },
    { "top_k=60000 top_p=0.8", 1.2f, 0.8f, 0.0f, 1.0f, 0.0f, 0.0f, 60000, 0 },
    { "top_k=V-1 min_p", 1.0f, 1.0f, 0.1f, 1.0f, 0.0f, 0.0f, -1, 0 },      /* -1: V - 1 */
    { "top_p=0.7 penalties", 0.5f, 0.7f, 0.0f, 0.8f, 0.1f, 0.1f, 0, 6 },
};
#define N_VARIANTS (int)(sizeof(variants) / sizeof(variants[0]))

static void variant_params(const struct variant *w, int V, struct dsv4_sampling *p)
{
    dsv4_sampling_defaults(p);
    p->temperature = w->t;
    p->top_p = w->top_p;
    p->min_p = w->min_p;
    p->repetition_penalty = w->rep;
    p->presence_penalty = w->pres;
    p->frequency_penalty = w->freq;
    p->top_k = w->top_k < 0 ? V - 1 : w->top_k;
    p->logprobs = w->logprobs;
    p->has_seed = true;
}

static bool has_penalties(const struct dsv4_sampling *p)
{
    return p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
}

/* ---- the CPU side's margins: would expf's last bits or fixed-point sums flip this draw? ---- */

static const float *rank_cmp_vals;    /* qsort has no context argument */

static int rank_cmp(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    const float u = rank_cmp_vals[x], w = rank_cmp_vals[y];
    if (u != w)
        return u > w ? -1 : 1;
    return (x > y) - (x < y);
}

/* Error bound of one probability between the two sides: expf differs by at most 2 ulp (CUDA) + 1 ulp
 * (glibc) unless its argument is 0 (p = 1 on both), and the device rounds p to 2^-41 fixed point
 * (exact when p * 2^41 is an integer). */
static double p_err(double p)
{
    const double s = p * FX_ONE;
    return (p == 1.0 ? 0.0 : EXPF_REL * p) + (s == floor(s) ? 0.0 : 0.5 / FX_ONE);
}

/* Replays sampler.c's steps 2-10 in double with the CPU's probabilities and says whether a compared
 * quantity lies within the two sides' error bounds (p_err summed along, NEAR_SLACK times) of its
 * threshold: a top_p boundary, a min_p cut or the drawn interval; *why names which. */
static bool cpu_near(int V, const float *logits, const struct dsv4_sampling *p, const struct dsv4_sampler_history *h,
                     uint64_t seed, uint64_t index, const char **why)
{
    if (p->temperature == 0.0f)
        return false;   /* greedy: pure comparisons, never near */
    float *l = malloc(sizeof(float) * (size_t)V);
    double *pr = malloc(sizeof(double) * (size_t)V);
    int32_t *ord = malloc(sizeof(int32_t) * (size_t)V);
    bool *keep = malloc(sizeof(bool) * (size_t)V), near = false;
    assert_true(l && pr && ord && keep);

    *why = "";
    memcpy(l, logits, sizeof(float) * (size_t)V);
    if (h && p->repetition_penalty != 1.0f)
        for (int v = 0; v < V; v++)
            if (h->seen[v / 8] >> (v % 8) & 1)
                l[v] = l[v] > 0.0f ? l[v] / p->repetition_penalty : l[v] * p->repetition_penalty;
    if (h && (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f))
        for (int v = 0; v < V; v++)
            if (h->counts[v])
                l[v] -= (float)h->counts[v] * p->frequency_penalty + p->presence_penalty;
    if (p->temperature != 1.0f) {
        const float inv_t = 1.0f / p->temperature;
        for (int v = 0; v < V; v++)
            l[v] *= inv_t;
    }
    float m = -INFINITY;
    for (int v = 0; v < V; v++)
        m = l[v] > m ? l[v] : m;
    for (int v = 0; v < V; v++) {
        pr[v] = expf(l[v] - m);
        keep[v] = true;
        ord[v] = v;
    }
    const bool topk = p->top_k > 0 && p->top_k < V, topp = p->top_p < 1.0f;
    int n = V;
    if (topk || topp) {
        rank_cmp_vals = l;
        qsort(ord, (size_t)V, sizeof(*ord), rank_cmp);
    }
    if (topk) {
        n = p->top_k;
        for (int i = n; i < V; i++)
            keep[ord[i]] = false;
    }
    double z = 0.0, ez = 0.0;
    for (int v = 0; v < V; v++)
        if (keep[v]) {
            z += pr[v];
            ez += p_err(pr[v]);
        }
    if (topp) {
        const double target = (double)p->top_p * z, et = (double)p->top_p * ez + 1.0 / FX_ONE;
        double acc = 0.0, prev = 0.0, ea = 0.0, eprev = 0.0;
        int i = 0;
        for (; i < n; i++) {
            prev = acc;
            eprev = ea;
            acc += pr[ord[i]];
            ea += p_err(pr[ord[i]]);
            if (acc >= target)
                break;
        }
        /* acc (through the boundary token) may fall short on the device, or prev (before it) reach
         * the target; the first token is always kept */
        if (acc - target <= NEAR_SLACK * (ea + et) || (i > 0 && target - prev <= NEAR_SLACK * (eprev + et))) {
            near = true;
            *why = "top_p";
        }
        for (int j = i + 1; j < n; j++)
            keep[ord[j]] = false;
    }
    if (p->min_p > 0.0f)
        for (int v = 0; v < V; v++) {
            if (!keep[v])
                continue;
            if (fabs(pr[v] - p->min_p) <= NEAR_SLACK * (pr[v] == 1.0 ? 0.0 : EXPF_REL * pr[v])) {
                near = true;
                *why = "min_p";
            }
            if (pr[v] < p->min_p)
                keep[v] = false;
        }
    double zk = 0.0, ezk = 0.0;
    for (int v = 0; v < V; v++)
        if (keep[v]) {
            zk += pr[v];
            ezk += p_err(pr[v]);
        }
    const double u = dsv4_philox_uniform(seed, index, 0), target = u * zk, et = u * ezk + 1.0 / FX_ONE;
    double acc = 0.0, ea = 0.0;
    for (int v = 0; v < V; v++) {
        if (!keep[v] || pr[v] <= 0.0)
            continue;
        const double prev = acc, eprev = ea;
        acc += pr[v];
        ea += p_err(pr[v]);
        if (acc > target) {
            if (target - prev <= NEAR_SLACK * (eprev + et) || acc - target <= NEAR_SLACK * (ea + et)) {
                near = true;
                *why = "draw";
            }
            break;
        }
    }
    free(l);
    free(pr);
    free(ord);
    free(keep);
    return near;
}

/* ---- device buffers for one shape ---- */

struct rig {
    int V, rows;
    int64_t ld;
    float *x;                           /* [rows, ld] host logits */
    float *dx;
    struct dsv4_sampling p[ROWS_MAX];
    enum kind kinds[ROWS_MAX];
    int var[ROWS_MAX];
    struct dsv4_sample_row prm[ROWS_MAX];
    struct dsv4_sample_row *dprm;
    struct dsv4_sample_result *dout;
    int32_t *dtok;
    struct dsv4_sample_history hist;    /* slots = ROWS_MAX, row b uses slot b */
    void *dhist;
    uint32_t *counts;                   /* host model [ROWS_MAX, V] */
    uint8_t *seen;                      /* host model [ROWS_MAX, seen bytes of a device row] */
    size_t seen_row;                    /* bytes per slot: 4 * DSV4_SAMPLE_SEEN_WORDS(V) */
};

static void rig_open(struct rig *g, int V, int64_t ld)
{
    memset(g, 0, sizeof(*g));
    g->V = V;
    g->ld = ld;
    g->x = malloc(sizeof(float) * (size_t)(ROWS_MAX * ld));
    assert_non_null(g->x);
    for (size_t i = 0; i < (size_t)(ROWS_MAX * ld); i++)
        g->x[i] = NAN;          /* the padding between rows is never read */
    g->dx = gt_dev_copy(g->x, sizeof(float) * (size_t)(ROWS_MAX * ld));
    CUDA_OK(cudaMalloc((void **)&g->dprm, sizeof(*g->dprm) * ROWS_MAX));
    CUDA_OK(cudaMalloc((void **)&g->dout, sizeof(*g->dout) * ROWS_MAX));
    CUDA_OK(cudaMalloc((void **)&g->dtok, sizeof(*g->dtok) * ROWS_MAX));
    CUDA_OK(cudaMalloc(&g->dhist, dsv4_sample_history_bytes(ROWS_MAX, V)));
    DSV4_OK(dsv4_sample_history_init(&g->hist, g->dhist, ROWS_MAX, V));
    g->seen_row = 4 * (size_t)DSV4_SAMPLE_SEEN_WORDS(V);
    g->counts = calloc((size_t)ROWS_MAX * (size_t)V, sizeof(uint32_t));
    g->seen = calloc((size_t)ROWS_MAX, g->seen_row);
    assert_true(g->counts && g->seen);
}

static void rig_close(struct rig *g)
{
    cudaFree(g->dx);
    cudaFree(g->dprm);
    cudaFree(g->dout);
    cudaFree(g->dtok);
    cudaFree(g->dhist);
    free(g->x);
    free(g->counts);
    free(g->seen);
}

/* The device history must equal the host model, bit for bit. */
static void check_history(const struct rig *g)
{
    const size_t nc = (size_t)ROWS_MAX * (size_t)g->V, ns = (size_t)ROWS_MAX * g->seen_row;
    uint32_t *c = malloc(nc * sizeof(uint32_t));
    uint8_t *s = malloc(ns);
    assert_true(c && s);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(c, g->hist.d_counts, nc * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(s, g->hist.d_seen, ns, cudaMemcpyDeviceToHost));
    assert_memory_equal(c, g->counts, nc * sizeof(uint32_t));
    assert_memory_equal(s, g->seen, ns);
    free(c);
    free(s);
}

/* Clear every slot, then record for each penalized row a prompt (random tokens and some of its top
 * logits, seen only) and an output (its top logits repeated, counts), through the device kernels,
 * with padding entries that must be skipped; the host model follows. */
static void build_history(struct rig *g)
{
    int32_t all[ROWS_MAX];
    for (int s = 0; s < ROWS_MAX; s++)
        all[s] = s;
    int32_t *dall = gt_dev_copy(all, sizeof(all));
    DSV4_OK(dsv4_sample_history_clear(&g->hist, dall, ROWS_MAX, NULL));
    memset(g->counts, 0, (size_t)ROWS_MAX * (size_t)g->V * sizeof(uint32_t));
    memset(g->seen, 0, (size_t)ROWS_MAX * g->seen_row);

    const int cap = 4 * 600 * ROWS_MAX;
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)cap), *toks = malloc(sizeof(int32_t) * (size_t)cap);
    int32_t *oslots = malloc(sizeof(int32_t) * (size_t)cap), *otoks = malloc(sizeof(int32_t) * (size_t)cap);
    int np = 0, no = 0;
    assert_true(slots && toks && oslots && otoks);
    for (int b = 0; b < g->rows; b++) {
        if (!has_penalties(&g->p[b]))
            continue;
        const float *x = g->x + (size_t)b * (size_t)g->ld;
        int top[16], nt = 0;    /* 16 of the row's largest logits, so the penalties move the top */
        for (int v = 0; v < g->V && nt < 16; v++)
            if (x[v] > 2.0f * 2.5f || (g->kinds[b] != K_LLM && gt_u64() % 64 == 0))
                top[nt++] = v;
        for (int i = 0; i < 300; i++) {
            slots[np] = b;
            toks[np++] = i % 3 == 0 && nt ? top[gt_u64() % (uint64_t)nt] : (int32_t)(gt_u64() % (uint64_t)g->V);
        }
        for (int i = 0; i < 200; i++) {
            oslots[no] = b;
            otoks[no++] = i % 2 == 0 && nt ? top[gt_u64() % (uint64_t)nt] : (int32_t)(gt_u64() % 50);
        }
        slots[np] = -1;         /* padding */
        toks[np++] = 5;
        oslots[no] = b;
        otoks[no++] = g->V;     /* out of range */
    }
    for (int i = 0; i < np; i++)
        if (slots[i] >= 0 && toks[i] >= 0 && toks[i] < g->V)
            g->seen[(size_t)slots[i] * g->seen_row + (size_t)toks[i] / 8] |= (uint8_t)(1u << (toks[i] % 8));
    for (int i = 0; i < no; i++)
        if (oslots[i] >= 0 && otoks[i] >= 0 && otoks[i] < g->V) {
            g->seen[(size_t)oslots[i] * g->seen_row + (size_t)otoks[i] / 8] |= (uint8_t)(1u << (otoks[i] % 8));
            g->counts[(size_t)oslots[i] * (size_t)g->V + (size_t)otoks[i]]++;
        }
    int32_t *ds = gt_dev_copy(slots, sizeof(int32_t) * (size_t)np);
    int32_t *dt = gt_dev_copy(toks, sizeof(int32_t) * (size_t)np);
    int32_t *dos = gt_dev_copy(oslots, sizeof(int32_t) * (size_t)no);
    int32_t *dot = gt_dev_copy(otoks, sizeof(int32_t) * (size_t)no);
    DSV4_OK(dsv4_sample_history_record(&g->hist, ds, dt, np, false, NULL));
    DSV4_OK(dsv4_sample_history_record(&g->hist, dos, dot, no, true, NULL));
    check_history(g);
    cudaFree(dall);
    cudaFree(ds);
    cudaFree(dt);
    cudaFree(dos);
    cudaFree(dot);
    free(slots);
    free(toks);
    free(oslots);
    free(otoks);
}

/* ---- one batch against the CPU ---- */

struct tally {
    int rows, greedy, sampled, near, near_differ, fallback_rows;
    double worst_logprob;
};

static void run_gpu(const struct rig *g, int first, int rows, struct dsv4_sample_result *out)
{
    CUDA_OK(cudaMemset(g->dout, 0xff, sizeof(*g->dout) * ROWS_MAX));
    CUDA_OK(cudaMemset(g->dtok, 0xff, sizeof(*g->dtok) * ROWS_MAX));
    DSV4_OK(dsv4_sample_rows(g->dx + (size_t)first * (size_t)g->ld, g->ld, rows, g->V, g->dprm + first, &g->hist,
                             g->dout, g->dtok, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out, g->dout, sizeof(*out) * (size_t)rows, cudaMemcpyDeviceToHost));
    int32_t tok[ROWS_MAX];
    CUDA_OK(cudaMemcpy(tok, g->dtok, sizeof(int32_t) * (size_t)rows, cudaMemcpyDeviceToHost));
    for (int b = 0; b < rows; b++)
        assert_int_equal(tok[b], out[b].token);
}

/* A logprob's error, absolute where |logprob| <= 1 and relative beyond: floats near -144 are spaced
 * 1.5e-5 apart, so no absolute bound under that spacing can hold for the far tail of a distribution. */
static double logprob_error(double gpu, double cpu)
{
    return gpu == cpu ? 0.0 : fabs(gpu - cpu) / fmax(1.0, fabs(cpu));   /* equal: -inf on both sides too */
}

static void compare_row(const struct rig *g, struct dsv4_sampler *cpu, int b, const struct dsv4_sample_result *r,
                        struct tally *t)
{
    const float *x = g->x + (size_t)b * (size_t)g->ld;
    const struct dsv4_sampling *p = &g->p[b];
    struct dsv4_sampler_history h = { g->counts + (size_t)b * (size_t)g->V, g->seen + (size_t)b * g->seen_row };
    struct dsv4_sample ref;
    const uint64_t seed = g->prm[b].seed, index = g->prm[b].index;
    const int rc = dsv4_sampler_sample(cpu, p, x, &h, seed, index, &ref);

    t->rows++;
    if (rc < 0 || r->status < 0) {
        if (rc != r->status)
            fail_msg("row %d (%s, %s): CPU status %d, GPU %d", b, kind_names[g->kinds[b]], variants[g->var[b]].name, rc,
                     r->status);
        return;
    }
    assert_int_equal(r->n_top, ref.n_top);
    for (int i = 0; i < ref.n_top; i++) {
        if (r->top_ids[i] != ref.top_ids[i])
            fail_msg("row %d (%s, %s): top %d id GPU %d CPU %d", b, kind_names[g->kinds[b]], variants[g->var[b]].name,
                     i, r->top_ids[i], ref.top_ids[i]);
        const double e = logprob_error(r->top_logprobs[i], ref.top_logprobs[i]);
        t->worst_logprob = e > t->worst_logprob ? e : t->worst_logprob;
        if (!(e <= LOGPROB_BOUND))
            fail_msg("row %d: top %d logprob GPU %.9g CPU %.9g", b, i, r->top_logprobs[i], ref.top_logprobs[i]);
    }
    if (p->temperature == 0.0f) {
        t->greedy++;
        if (r->token != ref.token)
            fail_msg("row %d (%s, %s): greedy token GPU %d CPU %d", b, kind_names[g->kinds[b]],
                     variants[g->var[b]].name, r->token, ref.token);
    } else {
        const char *why;
        t->sampled++;
        if (cpu_near(g->V, x, p, &h, seed, index, &why)) {
            t->near++;
            t->near_differ += r->token != ref.token;
            printf("# near a boundary (%s), not compared: row %d (%s, %s) GPU %d CPU %d\n", why, b,
                   kind_names[g->kinds[b]], variants[g->var[b]].name, r->token, ref.token);
            return;
        }
        if (r->token != ref.token)
            fail_msg("row %d (%s, %s): sampled token GPU %d CPU %d (seed %llu index %llu)", b, kind_names[g->kinds[b]],
                     variants[g->var[b]].name, r->token, ref.token, (unsigned long long)seed,
                     (unsigned long long)index);
    }
    const double e = logprob_error(r->logprob, ref.logprob);
    t->worst_logprob = e > t->worst_logprob ? e : t->worst_logprob;
    if (!(e <= LOGPROB_BOUND))
        fail_msg("row %d: logprob GPU %.9g CPU %.9g", b, r->logprob, ref.logprob);
}

/* A fresh batch: logits of the given kinds (kind < 0: cycle), variants from `var0` on, history for
 * the penalized rows; GPU against CPU, and `alone` rows re-run as batches of one (bit-identical). */
static void run_batch(struct rig *g, struct dsv4_sampler *cpu, int rows, int kind, int var0, int alone,
                      struct tally *t)
{
    struct dsv4_sample_result out[ROWS_MAX], one;
    g->rows = rows;
    for (int b = 0; b < rows; b++) {
        g->kinds[b] = kind >= 0 ? (enum kind)kind : (enum kind)((b + var0) % K_COUNT);
        g->var[b] = (var0 + b) % N_VARIANTS;
        fill_logits(g->x + (size_t)b * (size_t)g->ld, g->V, g->kinds[b]);
        variant_params(&variants[g->var[b]], g->V, &g->p[b]);
        g->p[b].seed = gt_u64();
        dsv4_sample_row_set(&g->prm[b], &g->p[b], g->p[b].seed, gt_u64() % 100000, has_penalties(&g->p[b]) ? b : -1);
    }
    CUDA_OK(cudaMemcpy(g->dx, g->x, sizeof(float) * (size_t)(rows * g->ld), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(g->dprm, g->prm, sizeof(*g->prm) * (size_t)rows, cudaMemcpyHostToDevice));
    build_history(g);
    run_gpu(g, 0, rows, out);
    for (int b = 0; b < rows; b++)
        compare_row(g, cpu, b, &out[b], t);
    for (int i = 0; i < alone && i < rows; i++) {
        const int b = (int)(gt_u64() % (uint64_t)rows);
        run_gpu(g, b, 1, &one);
        if (memcmp(&one, &out[b], sizeof(one)))
            fail_msg("row %d alone differs from the same row in its batch of %d", b, rows);
    }
}

static void print_tally(const char *what, const struct tally *t)
{
    printf("# %-34s rows %4d: greedy %3d, sampled %4d, near a boundary %d (differing %d); worst logprob %.2g "
           "(bound %.0e)\n", what, t->rows, t->greedy, t->sampled, t->near, t->near_differ, t->worst_logprob,
           LOGPROB_BOUND);
}

static void check_shape(int V, int64_t ld, int rows, int rounds)
{
    struct rig g;
    struct dsv4_sampler *cpu;
    struct tally t = { 0 };
    char what[80];

    rig_open(&g, V, ld);
    DSV4_OK(dsv4_sampler_create(V, &cpu));
    for (int round = 0; round < rounds; round++)
        run_batch(&g, cpu, rows, -1, (int)(gt_u64() % 1000), rows > 1 ? 4 : 0, &t);
    snprintf(what, sizeof(what), "V %d ld %lld rows %d x %d", V, (long long)ld, rows, rounds);
    print_tally(what, &t);
    dsv4_sampler_destroy(cpu);
    rig_close(&g);
}

static void test_flash_batch64(void **state)
{
    DSV4_OK(dsv4_sample_prepare());
    check_shape(V_FLASH, V_FLASH, 64, 3);
}

static void test_flash_rows1(void **state)
{
    check_shape(V_FLASH, V_FLASH, 1, 2 * N_VARIANTS);
}

static void test_small_vocab(void **state)
{
    check_shape(1000, 1000, 64, 12);
    check_shape(999, 1000, 64, 12);
    check_shape(5, 8, 64, 4);
}

/* Every variant on every kind of logits at V 129280, so each path (lists and the bitwise fallback of
 * top-n, top_k and top_p) runs. */
static void test_every_kind(void **state)
{
    struct rig g;
    struct dsv4_sampler *cpu;
    struct tally t = { 0 };

    rig_open(&g, V_FLASH, V_FLASH);
    DSV4_OK(dsv4_sampler_create(V_FLASH, &cpu));
    for (int k = 0; k < K_COUNT; k++)
        run_batch(&g, cpu, N_VARIANTS, k, 0, 2, &t);
    print_tally("V 129280, every kind x variant", &t);
    dsv4_sampler_destroy(cpu);
    rig_close(&g);
}

/* Rows the CPU refuses (NaN, +inf, every logit -inf) report the same status and the lowest bad id;
 * a slot out of range is -EINVAL; bad launch arguments are refused; the same seed and index give the
 * same token, and a sweep of indices moves it (printed). */
static void test_bad_rows(void **state)
{
    struct rig g;
    struct dsv4_sampler *cpu;
    struct tally t = { 0 };
    struct dsv4_sample_result out[ROWS_MAX];

    rig_open(&g, 1000, 1000);
    DSV4_OK(dsv4_sampler_create(1000, &cpu));
    g.rows = 5;
    for (int b = 0; b < g.rows; b++) {
        g.kinds[b] = K_LLM;
        g.var[b] = 2;
        fill_logits(g.x + (size_t)b * 1000, 1000, K_LLM);
        variant_params(&variants[2], 1000, &g.p[b]);
        dsv4_sample_row_set(&g.prm[b], &g.p[b], 7, 0, -1);
    }
    g.x[0 * 1000 + 17] = NAN;
    g.x[0 * 1000 + 900] = INFINITY;
    g.x[1 * 1000 + 3] = INFINITY;
    for (int v = 0; v < 1000; v++)
        g.x[2 * 1000 + v] = -INFINITY;
    g.prm[3].slot = ROWS_MAX;   /* out of range */
    CUDA_OK(cudaMemcpy(g.dx, g.x, sizeof(float) * 5000, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(g.dprm, g.prm, sizeof(*g.prm) * 5, cudaMemcpyHostToDevice));
    run_gpu(&g, 0, 5, out);
    assert_int_equal(out[0].status, -EDOM);
    assert_int_equal(out[0].bad_token, 17);
    assert_int_equal(out[1].status, -EDOM);
    assert_int_equal(out[1].bad_token, 3);
    assert_int_equal(out[2].status, -EDOM);
    assert_int_equal(out[2].bad_token, -1);
    assert_int_equal(out[3].status, -EINVAL);
    assert_int_equal(out[4].status, 0);
    for (int b = 0; b < 3; b++)
        compare_row(&g, cpu, b, &out[b], &t);
    struct dsv4_sample s = { 0 };
    assert_int_equal(dsv4_sample_result_get(&out[0], &s), -EDOM);
    printf("# bad row message: %s\n", dsv4_error_message());
    assert_int_equal(dsv4_sample_result_get(&out[4], &s), 0);
    assert_int_equal(s.token, out[4].token);

    /* refusals at the launch */
    assert_int_equal(dsv4_sample_rows(g.dx, 1000, 1, DSV4_SAMPLER_VOCAB_MAX + 1, g.dprm, NULL, g.dout, NULL, NULL),
                     -EINVAL);
    assert_int_equal(dsv4_sample_rows(g.dx, 1002, 1, 1000, g.dprm, NULL, g.dout, NULL, NULL), -EINVAL);
    assert_int_equal(dsv4_sample_rows(g.dx + 1, 1000, 1, 1000, g.dprm, NULL, g.dout, NULL, NULL), -EINVAL);
    assert_int_equal(dsv4_sample_rows(g.dx, 996, 1, 1000, g.dprm, NULL, g.dout, NULL, NULL), -EINVAL);
    struct dsv4_sample_history other = g.hist;
    other.vocab = 999;
    assert_int_equal(dsv4_sample_rows(g.dx, 1000, 1, 1000, g.dprm, &other, g.dout, NULL, NULL), -EINVAL);
    assert_int_equal(dsv4_sample_history_init(&other, g.dhist, 1, 0), -EINVAL);
    assert_int_equal(dsv4_sample_rows(g.dx, 1000, 0, 1000, g.dprm, NULL, g.dout, NULL, NULL), 0);

    /* the same seed and index give the same token; a sweep of indices follows the distribution */
    enum { DRAWS = 64 };
    int hits = 0;
    for (int rep = 0; rep < 2; rep++) {
        run_gpu(&g, 4, 1, out + rep);
    }
    assert_int_equal(out[0].token, out[1].token);
    for (int i = 0; i < DRAWS; i++) {
        g.prm[4].index = (uint64_t)i;
        CUDA_OK(cudaMemcpy(g.dprm + 4, g.prm + 4, sizeof(*g.prm), cudaMemcpyHostToDevice));
        run_gpu(&g, 4, 1, out);
        hits += out[0].token == out[1].token;
    }
    printf("# %d of %d draws of one row hit the first draw's token\n", hits, DRAWS);
    dsv4_sampler_destroy(cpu);
    rig_close(&g);
}

/* -0 and +0 are a tie, so the lower id ranks first, on the device as on the host: greedy, top_k 1,
 * top_p and the top logprobs, the two zeros the largest logits of the row. */
static void test_signed_zero_ties(void **state)
{
    struct rig g;
    struct dsv4_sampler *cpu;
    struct tally t = { 0 };
    struct dsv4_sample_result out[4];

    rig_open(&g, 1000, 1000);
    DSV4_OK(dsv4_sampler_create(1000, &cpu));
    g.rows = 4;
    for (int b = 0; b < g.rows; b++) {
        float *x = g.x + (size_t)b * 1000;
        for (int v = 0; v < 1000; v++)
            x[v] = -4.0f - (float)(v % 7);
        x[5] = b % 2 ? 0.0f : -0.0f;    /* ids 5 and 9 tie, in either sign order */
        x[9] = b % 2 ? -0.0f : 0.0f;
        g.kinds[b] = K_LLM;
        g.var[b] = 0;
        dsv4_sampling_defaults(&g.p[b]);
        g.p[b].logprobs = 2;
        g.p[b].has_seed = true;
        g.p[b].seed = 11;
    }
    g.p[0].temperature = 0.0f;
    g.p[1].top_k = 1;
    g.p[2].top_p = 0.1f;                /* the first-ranked token alone (p 0.16) */
    g.p[3].temperature = 0.0f;
    for (int b = 0; b < g.rows; b++)
        dsv4_sample_row_set(&g.prm[b], &g.p[b], g.p[b].seed, 0, -1);
    CUDA_OK(cudaMemcpy(g.dx, g.x, sizeof(float) * 4000, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(g.dprm, g.prm, sizeof(*g.prm) * 4, cudaMemcpyHostToDevice));
    run_gpu(&g, 0, 4, out);
    for (int b = 0; b < g.rows; b++) {
        assert_int_equal(out[b].status, 0);
        assert_int_equal(out[b].token, 5);
        assert_int_equal(out[b].top_ids[0], 5);
        assert_int_equal(out[b].top_ids[1], 9);
        compare_row(&g, cpu, b, &out[b], &t);
    }
    dsv4_sampler_destroy(cpu);
    rig_close(&g);
}

/* History record / clear against the host model, including slots cleared alone. */
static void test_history(void **state)
{
    struct rig g;
    rig_open(&g, 1000, 1000);
    g.rows = ROWS_MAX;
    for (int b = 0; b < ROWS_MAX; b++) {
        variant_params(&variants[14], 1000, &g.p[b]);
        g.kinds[b] = K_FLAT;
        fill_logits(g.x + (size_t)b * 1000, 1000, K_FLAT);
    }
    build_history(&g);
    const int32_t clear[3] = { 5, -1, 63 };
    int32_t *dc = gt_dev_copy(clear, sizeof(clear));
    DSV4_OK(dsv4_sample_history_clear(&g.hist, dc, 3, NULL));
    for (int i = 0; i < 3; i++)
        if (clear[i] >= 0) {
            memset(g.counts + (size_t)clear[i] * 1000, 0, 1000 * sizeof(uint32_t));
            memset(g.seen + (size_t)clear[i] * g.seen_row, 0, g.seen_row);
        }
    check_history(&g);
    printf("# history record/clear: equal to the host model\n");
    cudaFree(dc);
    rig_close(&g);
}

/* Launch time at the Flash vocab: batch 64 and 1, LLM-like rows with common settings, and flat rows
 * with top_p (the larger boundary bins). Reported, not asserted. */
static void test_timing(void **state)
{
    struct rig g;
    cudaEvent_t e0, e1;
    const int reps = 100;
    rig_open(&g, V_FLASH, V_FLASH);
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    static const struct { const char *name; enum kind kind; int var; } mixes[] = {
        { "llm greedy", K_LLM, 0 }, { "llm T=1", K_LLM, 2 }, { "llm top_k=40", K_LLM, 6 },
        { "llm top_p=0.9", K_LLM, 8 }, { "llm all", K_LLM, 13 }, { "llm all+penalties", K_LLM, 14 },
        { "flat top_p=0.9", K_FLAT, 8 },
    };
    for (size_t mi = 0; mi < sizeof(mixes) / sizeof(mixes[0]); mi++) {
        for (int b = 0; b < ROWS_MAX; b++) {
            g.kinds[b] = mixes[mi].kind;
            fill_logits(g.x + (size_t)b * V_FLASH, V_FLASH, mixes[mi].kind);
            variant_params(&variants[mixes[mi].var], V_FLASH, &g.p[b]);
            dsv4_sample_row_set(&g.prm[b], &g.p[b], gt_u64(), (uint64_t)b, has_penalties(&g.p[b]) ? b : -1);
        }
        g.rows = ROWS_MAX;
        CUDA_OK(cudaMemcpy(g.dx, g.x, sizeof(float) * (size_t)ROWS_MAX * V_FLASH, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(g.dprm, g.prm, sizeof(g.prm), cudaMemcpyHostToDevice));
        build_history(&g);
        for (int rows = ROWS_MAX; rows >= 1; rows = rows == ROWS_MAX ? 1 : 0) {
            float ms;
            for (int i = 0; i < 4 * reps; i++)  /* warm-up: clocks up from idle */
                DSV4_OK(dsv4_sample_rows(g.dx, V_FLASH, rows, V_FLASH, g.dprm, &g.hist, g.dout, g.dtok, NULL));
            CUDA_OK(cudaEventRecord(e0, NULL));
            for (int i = 0; i < reps; i++)
                DSV4_OK(dsv4_sample_rows(g.dx, V_FLASH, rows, V_FLASH, g.dprm, &g.hist, g.dout, g.dtok, NULL));
            CUDA_OK(cudaEventRecord(e1, NULL));
            CUDA_OK(cudaEventSynchronize(e1));
            CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
            printf("# time %-30s rows %2d: %7.1f us a launch\n", mixes[mi].name, rows, 1000.0 * ms / reps);
        }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    rig_close(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flash_batch64),
        cmocka_unit_test(test_flash_rows1),
        cmocka_unit_test(test_small_vocab),
        cmocka_unit_test(test_every_kind),
        cmocka_unit_test(test_bad_rows),
        cmocka_unit_test(test_signed_zero_ties),
        cmocka_unit_test(test_history),
        cmocka_unit_test(test_timing),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
