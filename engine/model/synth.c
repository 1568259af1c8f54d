/* SPDX-License-Identifier: MIT */
/* Synthetic weights (see synth.h). The tensors are allocated and named first, in a fixed order; then
 * threads fill them in blocks of SYNTH_BLOCK elements, each block from its own counter-based random
 * stream (seed, tensor index, block index), so the values never depend on the thread count. FP8
 * and FP4 codes follow the law of a normal value quantized by its block's scale, computed here from
 * the normal CDF (dsv4-mkckpt samples the same law through a 16-bit table). */
#include "build-config.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/error.h"
#include "engine/model/quant.h"
#include "engine/model/synth.h"

#define SYNTH_BLOCK (1u << 20)      /* elements one thread fills at a time */
#define NAME_LEN 256
#define PREFIX_LEN 32               /* "layers.127." or "mtp.3.": a name's prefix, leaving room for any suffix */
/* The values' shape, as dsv4-mkckpt writes them: trained linears spread about 0.02; a 128x128 FP8
 * block's largest value sits about 4 sigma out, a 1x32 FP4 block's about 2.2 sigma, and the block
 * scale maps it to the top of the format. */
#define WEIGHT_SIGMA 0.02
#define FP8_AMAX_SIGMAS 4.0
#define FP4_AMAX_SIGMAS 2.2
#define E4M3_MAX 448.0
#define E2M1_MAX 6.0
#define FP8_BLOCK 128
#define FP4_BLOCK 32
#define NORM_MEAN 1.0f              /* RMSNorm weights sit near 1 */
#define NORM_SIGMA 0.05f
#define BIAS_SIGMA 0.01f            /* the router's selection bias */
#define APE_SIGMA 0.1f              /* compressor position bias */
#define HC_BASE_SIGMA 0.5f
#define HC_SCALE_SIGMA 0.1f

enum fill {
    FILL_FP8,           /* e4m3 codes */
    FILL_FP4,           /* bytes of two e2m1 codes */
    FILL_SCALE,         /* UE8M0 bytes: centre exponent -1, 0 or +1 */
    FILL_BF16,          /* N(mean, sigma) rounded to bf16 */
    FILL_BF16_WIDE,     /* embed/head: random sign and mantissa, exponent over 4 octaves below ~2 sigma */
    FILL_F32,           /* N(mean, sigma) */
    FILL_IDS,           /* rows of `cols` distinct experts in [0, range) */
};

struct job {
    enum fill kind;
    void *data;
    int64_t n;          /* elements (FILL_IDS: rows) */
    float mean, sigma;
    int centre;         /* FILL_SCALE: the exponent byte */
    int cols, range;    /* FILL_IDS */
    uint64_t key;       /* the tensor's stream */
};

/* Walker's alias method over the 256 values of a byte (an e4m3 code, or two e2m1 codes): a draw of
 * 32 random bits picks a slot from its top 8 and keeps it or takes its alias by the low 24, which
 * gives each byte its probability to within 2^-32 (a plain inverse-CDF table of 2^16 entries would
 * round FP8's rarest codes away). */
#define ALIAS_SLOTS 256
#define ALIAS_UNIT (1u << 24)       /* the low bits' range */

struct alias {
    uint32_t keep[ALIAS_SLOTS];     /* keep slot i when the low 24 bits are below this */
    uint8_t other[ALIAS_SLOTS];
};

struct gen {
    const struct dsv4_config *c;
    const struct dsv4_synth_recipe *rc;
    struct dsv4_st *st;
    struct job *jobs;
    size_t njobs, cap;
    uint64_t bytes;                 /* allocated so far, for messages */
    uint64_t small_stream;          /* counter for the values generated in place (router bias) */
    struct alias fp8;               /* the e4m3 code law */
    struct alias fp4;               /* bytes of two e2m1 codes (low nibble = even k) */
};

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* splitmix64: one stream per (tensor, block) */
static uint64_t next64(uint64_t *s)
{
    const uint64_t z = mix64(*s);

    *s += 0x9e3779b97f4a7c15ull;
    return z;
}

static double uniform01(uint64_t *s)        /* (0, 1] */
{
    return ((double)(next64(s) >> 11) + 1.0) * 0x1p-53;
}

/* Two independent N(0, 1) values (Box-Muller). */
static void normal2(uint64_t *s, double *a, double *b)
{
    const double r = sqrt(-2.0 * log(uniform01(s))), t = 2.0 * M_PI * uniform01(s);

    *a = r * cos(t);
    *b = r * sin(t);
}

static uint16_t f32_to_bf16(float f)        /* round to nearest even; inputs are finite */
{
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static uint8_t alias_draw(const struct alias *a, uint32_t r)
{
    const uint32_t i = r >> 24, u = r & (ALIAS_UNIT - 1u);

    return u < a->keep[i] ? (uint8_t)i : a->other[i];
}

/* p[ALIAS_SLOTS] (summing to 1) -> a (Vose's construction). */
static void alias_build(struct alias *a, const double *p)
{
    const int n = ALIAS_SLOTS;
    const double unit = (double)ALIAS_UNIT;
    double q[ALIAS_SLOTS];
    int small[ALIAS_SLOTS], large[ALIAS_SLOTS], ns = 0, nl = 0;

    for (int i = 0; i < n; i++) {
        q[i] = p[i] * n;
        if (q[i] < 1.0)
            small[ns++] = i;
        else
            large[nl++] = i;
    }
    while (ns && nl) {
        const int s = small[--ns], l = large[nl - 1];

        a->keep[s] = (uint32_t)(q[s] * unit);
        a->other[s] = (uint8_t)l;
        q[l] -= 1.0 - q[s];
        if (q[l] < 1.0) {
            nl--;
            small[ns++] = l;
        }
    }
    /* what is left holds 1 up to rounding: always kept */
    while (nl || ns) {
        const int i = nl ? large[--nl] : small[--ns];

        a->keep[i] = (uint32_t)unit;
        a->other[i] = (uint8_t)i;
    }
}

/* The code law into p (zeroed by the caller): N(0, fmt_max / amax_sigmas) rounded to the nearest of
 * mags[0..n) (ties between two magnitudes at their midpoint, clipped at the top), its sign in sign_bit. */
static void code_probs(double *p, const float *mags, int n, double fmt_max, double amax_sigmas, uint8_t sign_bit)
{
    const double k = 1.0 / (fmt_max / amax_sigmas * M_SQRT2);

    for (int m = 0; m < n; m++) {
        const double lo = m == 0 ? 0.0 : 0.5 * (mags[m - 1] + mags[m]);
        const double hi = m == n - 1 ? INFINITY : 0.5 * (mags[m] + mags[m + 1]);

        p[m] = p[m | sign_bit] = 0.5 * (erf(hi * k) - erf(lo * k));
    }
}

static void make_laws(struct gen *g)
{
    double p8[ALIAS_SLOTS] = { 0 }, nib[16] = { 0 }, pair[ALIAS_SLOTS];
    float mags[0x7f];

    for (int m = 0; m < 0x7f; m++)     /* 0x7f is NaN: probability 0 */
        mags[m] = dsv4_e4m3_to_f32((uint8_t)m);
    code_probs(p8, mags, 0x7f, E4M3_MAX, FP8_AMAX_SIGMAS, 0x80);
    alias_build(&g->fp8, p8);
    for (int m = 0; m < 8; m++)
        mags[m] = dsv4_e2m1_to_f32((uint8_t)m);
    code_probs(nib, mags, 8, E2M1_MAX, FP4_AMAX_SIGMAS, 0x8);
    /* a byte holds two independent nibbles: one draw per byte from their joint law */
    for (int b = 0; b < ALIAS_SLOTS; b++)
        pair[b] = nib[b & 15] * nib[b >> 4];
    alias_build(&g->fp4, pair);
}

/* ---- filling ---- */

static void fill_block(const struct gen *g, const struct job *j, int64_t b)
{
    const int64_t lo = b * SYNTH_BLOCK, hi = lo + SYNTH_BLOCK < j->n ? lo + SYNTH_BLOCK : j->n;
    uint64_t s = mix64(j->key ^ mix64((uint64_t)b));

    switch (j->kind) {
    case FILL_FP8:
    case FILL_FP4: {   /* one code byte per 32 random bits, from the format's law */
        const struct alias *law = j->kind == FILL_FP8 ? &g->fp8 : &g->fp4;
        uint8_t *o = j->data;

        for (int64_t i = lo; i < hi; i += 2) {
            const uint64_t r = next64(&s);

            o[i] = alias_draw(law, (uint32_t)r);
            if (i + 1 < hi)
                o[i + 1] = alias_draw(law, (uint32_t)(r >> 32));
        }
        break;
    }
    case FILL_SCALE: {
        uint8_t *o = j->data;

        for (int64_t i = lo; i < hi; i++)
            o[i] = (uint8_t)(j->centre - 1 + (int)(((next64(&s) >> 32) * 3) >> 32));
        break;
    }
    case FILL_BF16:
    case FILL_F32:
        for (int64_t i = lo; i < hi; i += 2) {
            double a, z;

            normal2(&s, &a, &z);
            for (int q = 0; q < 2 && i + q < hi; q++) {
                const float v = (float)((q ? z : a) * j->sigma + j->mean);

                if (j->kind == FILL_F32)
                    ((float *)j->data)[i + q] = v;
                else
                    ((uint16_t *)j->data)[i + q] = f32_to_bf16(v);
            }
        }
        break;
    case FILL_BF16_WIDE: {
        /* the exponent of values near 2 sigma, then 0..3 octaves below it */
        const int top = 127 + (int)floor(log2(WEIGHT_SIGMA)) + 1;
        uint16_t *o = j->data;

        for (int64_t i = lo; i < hi; i += 4) {
            const uint64_t r = next64(&s);

            for (int q = 0; q < 4 && i + q < hi; q++) {
                const unsigned v = (unsigned)(r >> (16 * q)) & 0xffffu;

                o[i + q] = (uint16_t)((v & 0x8000u) | (unsigned)(top - (int)(v & 7u) / 2) << 7 | ((v >> 3) & 0x7fu));
            }
        }
        break;
    }
    case FILL_IDS: {
        int32_t *o = j->data;

        for (int64_t row = lo; row < hi; row++)
            for (int k = 0; k < j->cols; k++) {
                int32_t e;
                bool again;

                do {    /* rejection keeps a row's experts distinct (cols <= range, checked by the config) */
                    e = (int32_t)(((next64(&s) >> 32) * (uint64_t)j->range) >> 32);
                    again = false;
                    for (int p = 0; p < k; p++)
                        again |= o[row * j->cols + p] == e;
                } while (again);
                o[row * j->cols + k] = e;
            }
        break;
    }
    }
}

struct pool {
    const struct gen *g;
    const int64_t *first;       /* [njobs + 1] first block of each job */
    atomic_llong next;
};

static void *worker(void *arg)
{
    struct pool *p = arg;
    const int64_t total = p->first[p->g->njobs];

    for (;;) {
        const int64_t b = atomic_fetch_add(&p->next, 1);
        size_t lo = 0, hi = p->g->njobs;

        if (b >= total)
            return NULL;
        while (hi - lo > 1) {   /* the job whose blocks hold b */
            const size_t mid = (lo + hi) / 2;

            if (p->first[mid] <= b)
                lo = mid;
            else
                hi = mid;
        }
        fill_block(p->g, &p->g->jobs[lo], b - p->first[lo]);
    }
}

static int fill_all(const struct gen *g)
{
    int64_t *first = malloc(sizeof(*first) * (g->njobs + 1));
    struct pool p = { .g = g, .first = first };
    pthread_t th[DSV4_SYNTH_THREADS_MAX];
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int n = cpus < 1 ? 1 : cpus > DSV4_SYNTH_THREADS_MAX ? DSV4_SYNTH_THREADS_MAX : (int)cpus, started = 0;

    if (!first)
        return dsv4_error_set(-ENOMEM, "synthetic weights: out of memory for the work list");
    first[0] = 0;
    for (size_t i = 0; i < g->njobs; i++)
        first[i + 1] = first[i] + (g->jobs[i].n + SYNTH_BLOCK - 1) / SYNTH_BLOCK;
    atomic_init(&p.next, 0);
    for (; started < n - 1; started++)
        if (pthread_create(&th[started], NULL, worker, &p) != 0)
            break;      /* fewer threads only take longer */
    worker(&p);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    free(first);
    return 0;
}

/* ---- naming and allocation ---- */

static int push_job(struct gen *g, const struct job *j)
{
    if (g->njobs == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 1024;
        struct job *nj = realloc(g->jobs, cap * sizeof(*nj));

        if (!nj)
            return dsv4_error_set(-ENOMEM, "synthetic weights: out of memory for the work list");
        g->jobs = nj;
        g->cap = cap;
    }
    g->jobs[g->njobs] = *j;
    g->jobs[g->njobs].key = mix64(g->rc->seed ^ mix64(0x5eed0000ull + g->njobs));
    g->njobs++;
    return 0;
}

/* Allocate and name one tensor; its values come with fill_all (j->data is set here). */
static int tensor(struct gen *g, const char *name, enum dsv4_dtype dt, int ndim, const int64_t *shape,
                  struct job j)
{
    size_t n = 1, bytes;
    void *data;
    int r;

    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    bytes = n * dsv4_dtype_size(dt);
    data = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!data)
        return dsv4_error_set(-ENOMEM, "synthetic weights: out of memory for %s (%zu bytes) after %.2f GB",
                              name, bytes, g->bytes / 1e9);
    if ((r = dsv4_st_add(g->st, name, dt, ndim, shape, data, true)) < 0) {
        free(data);
        return r;
    }
    g->bytes += bytes;
    j.data = data;
    j.n = j.kind == FILL_IDS ? shape[0] : (int64_t)n;
    return push_job(g, &j);
}

static int vec(struct gen *g, const char *name, enum dsv4_dtype dt, int64_t n, float mean, float sigma)
{
    return tensor(g, name, dt, 1, &n,
                  (struct job){ .kind = dt == DSV4_DT_F32 ? FILL_F32 : FILL_BF16, .mean = mean, .sigma = sigma });
}

static int mat(struct gen *g, const char *name, enum dsv4_dtype dt, int64_t out, int64_t in, float mean,
               float sigma)
{
    const int64_t shape[2] = { out, in };

    return tensor(g, name, dt, 2, shape,
                  (struct job){ .kind = dt == DSV4_DT_F32 ? FILL_F32 : FILL_BF16, .mean = mean, .sigma = sigma });
}

/* FP8 linear p.weight [out, in] e4m3 + p.scale [ceil(out/128), ceil(in/128)] UE8M0 around the scale
 * that maps a block's largest value (FP8_AMAX_SIGMAS sigma) to 448. */
static int fp8(struct gen *g, const char *p, int64_t out, int64_t in)
{
    const int64_t w[2] = { out, in }, s[2] = { (out + FP8_BLOCK - 1) / FP8_BLOCK, (in + FP8_BLOCK - 1) / FP8_BLOCK };
    const int centre = 127 + (int)ceil(log2(WEIGHT_SIGMA * FP8_AMAX_SIGMAS / E4M3_MAX));
    char n[NAME_LEN];
    int r;

    snprintf(n, sizeof(n), "%s.weight", p);
    if ((r = tensor(g, n, DSV4_DT_F8_E4M3, 2, w, (struct job){ .kind = FILL_FP8 })) < 0)
        return r;
    snprintf(n, sizeof(n), "%s.scale", p);
    return tensor(g, n, DSV4_DT_F8_E8M0, 2, s, (struct job){ .kind = FILL_SCALE, .centre = centre });
}

/* FP4 linear p.weight [out, in/2] packed (I8, low nibble = even k) + p.scale [out, in/32]. */
static int fp4(struct gen *g, const char *p, int64_t out, int64_t in)
{
    const int64_t w[2] = { out, in / 2 }, s[2] = { out, in / FP4_BLOCK };
    const int centre = 127 + (int)ceil(log2(WEIGHT_SIGMA * FP4_AMAX_SIGMAS / E2M1_MAX));
    char n[NAME_LEN];
    int r;

    snprintf(n, sizeof(n), "%s.weight", p);
    if ((r = tensor(g, n, DSV4_DT_I8, 2, w, (struct job){ .kind = FILL_FP4 })) < 0)
        return r;
    snprintf(n, sizeof(n), "%s.scale", p);
    return tensor(g, n, DSV4_DT_F8_E8M0, 2, s, (struct job){ .kind = FILL_SCALE, .centre = centre });
}

#define NAME(buf, ...) (snprintf((buf), sizeof(buf), __VA_ARGS__), (buf))

/* mHC site: fn [(2+hc)*hc, hc*D], base, scale [3]. */
static int hc(struct gen *g, const char *p, const char *site)
{
    const struct dsv4_config *c = g->c;
    const int64_t mix = (int64_t)(2 + c->hc_mult) * c->hc_mult, wide = (int64_t)c->hc_mult * c->dim;
    char n[NAME_LEN];
    int r;

    if ((r = mat(g, NAME(n, "%shc_%s_fn", p, site), DSV4_DT_F32, mix, wide, 0.0f, (float)(1.0 / sqrt((double)wide)))) < 0 ||
        (r = vec(g, NAME(n, "%shc_%s_base", p, site), DSV4_DT_F32, mix, 0.0f, HC_BASE_SIGMA)) < 0 ||
        (r = vec(g, NAME(n, "%shc_%s_scale", p, site), DSV4_DT_F32, 3, 1.0f, HC_SCALE_SIGMA)) < 0)
        return r;
    return 0;
}

static int hc_head(struct gen *g, const char *p)
{
    const struct dsv4_config *c = g->c;
    const int64_t wide = (int64_t)c->hc_mult * c->dim;
    char n[NAME_LEN];
    int r;

    if ((r = mat(g, NAME(n, "%shc_head_fn", p), DSV4_DT_F32, c->hc_mult, wide, 0.0f, (float)(1.0 / sqrt((double)wide)))) < 0 ||
        (r = vec(g, NAME(n, "%shc_head_base", p), DSV4_DT_F32, c->hc_mult, 0.0f, HC_BASE_SIGMA)) < 0 ||
        (r = vec(g, NAME(n, "%shc_head_scale", p), DSV4_DT_F32, 1, 1.0f, HC_SCALE_SIGMA)) < 0)
        return r;
    return 0;
}

static int compressor(struct gen *g, const char *p, int ratio, int d, bool overlap)
{
    const int64_t width = (overlap ? 2 : 1) * (int64_t)d, ape[2] = { ratio, width };
    char n[NAME_LEN];
    int r;

    if ((r = mat(g, NAME(n, "%swkv.weight", p), DSV4_DT_BF16, width, g->c->dim, 0.0f, WEIGHT_SIGMA)) < 0 ||
        (r = mat(g, NAME(n, "%swgate.weight", p), DSV4_DT_BF16, width, g->c->dim, 0.0f, WEIGHT_SIGMA)) < 0 ||
        (r = tensor(g, NAME(n, "%sape", p), DSV4_DT_F32, 2, ape,
                    (struct job){ .kind = FILL_F32, .sigma = APE_SIGMA })) < 0 ||
        (r = vec(g, NAME(n, "%snorm.weight", p), DSV4_DT_BF16, d, NORM_MEAN, NORM_SIGMA)) < 0)
        return r;
    return 0;
}

static int attn(struct gen *g, const char *p, int ratio)
{
    const struct dsv4_config *c = g->c;
    const int64_t hd = (int64_t)c->n_heads * c->head_dim, og = (int64_t)c->o_groups * c->o_lora_rank;
    char n[NAME_LEN];
    int r;

    if ((r = fp8(g, NAME(n, "%sattn.wq_a", p), c->q_lora_rank, c->dim)) < 0 ||
        (r = vec(g, NAME(n, "%sattn.q_norm.weight", p), DSV4_DT_BF16, c->q_lora_rank, NORM_MEAN, NORM_SIGMA)) < 0 ||
        (r = fp8(g, NAME(n, "%sattn.wq_b", p), hd, c->q_lora_rank)) < 0 ||
        (r = fp8(g, NAME(n, "%sattn.wkv", p), c->head_dim, c->dim)) < 0 ||
        (r = vec(g, NAME(n, "%sattn.kv_norm.weight", p), DSV4_DT_BF16, c->head_dim, NORM_MEAN, NORM_SIGMA)) < 0 ||
        (r = fp8(g, NAME(n, "%sattn.wo_a", p), og, hd / c->o_groups)) < 0 ||
        (r = fp8(g, NAME(n, "%sattn.wo_b", p), c->dim, og)) < 0 ||
        (r = vec(g, NAME(n, "%sattn.attn_sink", p), DSV4_DT_F32, c->n_heads, 0.0f, 1.0f)) < 0)
        return r;
    if (ratio == 0)
        return 0;
    if ((r = compressor(g, NAME(n, "%sattn.compressor.", p), ratio, c->head_dim, ratio == c->csa_ratio)) < 0)
        return r;
    if (ratio != c->csa_ratio)
        return 0;
    if ((r = fp8(g, NAME(n, "%sattn.indexer.wq_b", p), (int64_t)c->index_n_heads * c->index_head_dim,
                 c->q_lora_rank)) < 0 ||
        (r = mat(g, NAME(n, "%sattn.indexer.weights_proj.weight", p), DSV4_DT_BF16, c->index_n_heads, c->dim, 0.0f,
                 WEIGHT_SIGMA)) < 0 ||
        (r = compressor(g, NAME(n, "%sattn.indexer.compressor.", p), ratio, c->index_head_dim, true)) < 0)
        return r;
    return 0;
}

/* The scored router's selection bias [E]: N(0, BIAS_SIGMA), minus skew * ln(rank) for a random
 * popularity rank per expert. Small: generated here, from its own stream. */
static int gate_bias(struct gen *g, const char *name)
{
    const int E = g->c->n_experts;
    const int64_t shape = E;
    float *b = aligned_alloc(64, ((size_t)E * sizeof(float) + 63) / 64 * 64);
    int *rank = malloc(sizeof(int) * (size_t)E);
    uint64_t s = mix64(g->rc->seed ^ mix64(0xb1a5000000000000ull + g->small_stream++));
    int r;

    if (!b || !rank) {
        free(b);
        free(rank);
        return dsv4_error_set(-ENOMEM, "synthetic weights: out of memory for %s", name);
    }
    for (int e = 0; e < E; e++)
        rank[e] = e + 1;
    for (int e = E - 1; e > 0; e--) {       /* Fisher-Yates */
        const int k = (int)(((next64(&s) >> 32) * (uint64_t)(e + 1)) >> 32), t = rank[e];

        rank[e] = rank[k];
        rank[k] = t;
    }
    for (int e = 0; e < E; e += 2) {
        double a, z;

        normal2(&s, &a, &z);
        b[e] = (float)(a * BIAS_SIGMA - g->rc->router_skew * log(rank[e]));
        if (e + 1 < E)
            b[e + 1] = (float)(z * BIAS_SIGMA - g->rc->router_skew * log(rank[e + 1]));
    }
    free(rank);
    if ((r = dsv4_st_add(g->st, name, DSV4_DT_F32, 1, &shape, b, true)) < 0)
        free(b);
    return r;
}

static int ffn(struct gen *g, const char *p, enum dsv4_mlp_type type)
{
    const struct dsv4_config *c = g->c;
    const int64_t I = c->moe_inter, D = c->dim;
    char n[NAME_LEN];
    int r;

    if ((r = mat(g, NAME(n, "%sffn.gate.weight", p), DSV4_DT_BF16, c->n_experts, D, 0.0f, WEIGHT_SIGMA)) < 0)
        return r;
    if (type == DSV4_MLP_HASH) {
        const int64_t shape[2] = { c->vocab_size, c->n_experts_per_tok };

        r = tensor(g, NAME(n, "%sffn.gate.tid2eid", p), DSV4_DT_I32, 2, shape,
                   (struct job){ .kind = FILL_IDS, .cols = c->n_experts_per_tok, .range = c->n_experts });
    } else {
        r = gate_bias(g, NAME(n, "%sffn.gate.bias", p));
    }
    if (r < 0)
        return r;
    for (int e = 0; e < c->n_experts; e++)
        if ((r = fp4(g, NAME(n, "%sffn.experts.%d.w1", p, e), I, D)) < 0 ||
            (r = fp4(g, NAME(n, "%sffn.experts.%d.w3", p, e), I, D)) < 0 ||
            (r = fp4(g, NAME(n, "%sffn.experts.%d.w2", p, e), D, I)) < 0)
            return r;
    if ((r = fp8(g, NAME(n, "%sffn.shared_experts.w1", p), I, D)) < 0 ||
        (r = fp8(g, NAME(n, "%sffn.shared_experts.w3", p), I, D)) < 0 ||
        (r = fp8(g, NAME(n, "%sffn.shared_experts.w2", p), D, I)) < 0)
        return r;
    return 0;
}

static int layer(struct gen *g, const char *p, int ratio, enum dsv4_mlp_type type)
{
    char n[NAME_LEN];
    int r;

    if ((r = vec(g, NAME(n, "%sattn_norm.weight", p), DSV4_DT_BF16, g->c->dim, NORM_MEAN, NORM_SIGMA)) < 0 ||
        (r = vec(g, NAME(n, "%sffn_norm.weight", p), DSV4_DT_BF16, g->c->dim, NORM_MEAN, NORM_SIGMA)) < 0 ||
        (r = hc(g, p, "attn")) < 0 || (r = hc(g, p, "ffn")) < 0 ||
        (r = attn(g, p, ratio)) < 0 || (r = ffn(g, p, type)) < 0)
        return r;
    return 0;
}

/* Layer i shares the tensors of layer src (added before it): the same data under its own names. */
static int alias_layer(struct gen *g, int i, int src)
{
    char from[NAME_LEN], n[NAME_LEN];
    const size_t flen = (size_t)snprintf(from, sizeof(from), "layers.%d.", src), count = dsv4_st_count(g->st);
    int r;

    for (size_t k = 0; k < count; k++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(g->st, k);

        if (strncmp(t->name, from, flen) != 0)
            continue;
        if ((r = dsv4_st_add(g->st, NAME(n, "layers.%d.%s", i, t->name + flen), t->dtype, t->ndim, t->shape,
                             t->data, false)) < 0)
            return r;
    }
    return 0;
}

/* The last layer before rc->distinct_layers with layer i's ratio and routing kind, or -1. */
static int alias_source(const struct dsv4_config *c, int distinct, int i)
{
    for (int j = distinct - 1; j >= 0; j--)
        if (c->compress_ratio[j] == c->compress_ratio[i] && c->mlp_type[j] == c->mlp_type[i])
            return j;
    return -1;
}

static int generate(struct gen *g)
{
    const struct dsv4_config *c = g->c;
    char p[PREFIX_LEN];
    int r;

    if ((r = tensor(g, "embed.weight", DSV4_DT_BF16, 2, (int64_t[]){ c->vocab_size, c->dim },
                    (struct job){ .kind = FILL_BF16_WIDE })) < 0)
        return r;
    if (!c->tie_embeddings &&
        (r = tensor(g, "head.weight", DSV4_DT_BF16, 2, (int64_t[]){ c->vocab_size, c->dim },
                    (struct job){ .kind = FILL_BF16_WIDE })) < 0)
        return r;
    if ((r = vec(g, "norm.weight", DSV4_DT_BF16, c->dim, NORM_MEAN, NORM_SIGMA)) < 0 || (r = hc_head(g, "")) < 0)
        return r;
    for (int i = 0; i < c->n_layers; i++) {
        if (i < g->rc->distinct_layers)
            r = layer(g, NAME(p, "layers.%d.", i), c->compress_ratio[i], c->mlp_type[i]);
        else
            r = alias_layer(g, i, alias_source(c, g->rc->distinct_layers, i));
        if (r < 0)
            return r;
    }
    for (int k = 0; k < c->n_mtp_layers; k++) {
        char n[NAME_LEN];

        NAME(p, "mtp.%d.", k);
        if ((r = vec(g, NAME(n, "%senorm.weight", p), DSV4_DT_BF16, c->dim, NORM_MEAN, NORM_SIGMA)) < 0 ||
            (r = vec(g, NAME(n, "%shnorm.weight", p), DSV4_DT_BF16, c->dim, NORM_MEAN, NORM_SIGMA)) < 0 ||
            (r = fp8(g, NAME(n, "%se_proj", p), c->dim, c->dim)) < 0 ||
            (r = fp8(g, NAME(n, "%sh_proj", p), c->dim, c->dim)) < 0 ||
            (r = vec(g, NAME(n, "%snorm.weight", p), DSV4_DT_BF16, c->dim, NORM_MEAN, NORM_SIGMA)) < 0 ||
            (r = hc_head(g, p)) < 0 || (r = layer(g, p, 0, DSV4_MLP_MOE)) < 0)
            return r;
    }
    return 0;
}

int dsv4_synth_tensors(const struct dsv4_config *c, const struct dsv4_synth_recipe *rc, const char *source,
                       struct dsv4_st **ret)
{
    struct gen *g = calloc(1, sizeof(*g));
    int r;

    if (!g)
        return dsv4_error_set(-ENOMEM, "synthetic weights: out of memory");
    for (int i = rc->distinct_layers; i < c->n_layers; i++)
        if (alias_source(c, rc->distinct_layers, i) < 0) {
            free(g);
            return dsv4_error_set(-EINVAL, "%s: distinct_layers %d leaves layer %d (compress ratio %d, %s routing) "
                                  "with no earlier layer of its kind to repeat; raise distinct_layers", source,
                                  rc->distinct_layers, i, c->compress_ratio[i],
                                  c->mlp_type[i] == DSV4_MLP_HASH ? "hash" : "scored");
        }
    g->c = c;
    g->rc = rc;
    make_laws(g);
    r = dsv4_st_new(source, &g->st);
    if (r == 0)
        r = generate(g);
    if (r == 0)
        r = fill_all(g);
    if (r == 0)
        r = dsv4_st_seal(g->st);
    if (r < 0)
        dsv4_st_close(g->st);
    else
        *ret = g->st;
    free(g->jobs);
    free(g);
    return r;
}

/* ---- the recipe ---- */

static bool has_shards(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    bool found = false;

    if (!d)
        return false;
    while (!found && (e = readdir(d))) {
        const size_t n = strlen(e->d_name), s = strlen(".safetensors");

        found = n > s && strcmp(e->d_name + n - s, ".safetensors") == 0;
    }
    closedir(d);
    return found;
}

int dsv4_synth_recipe_read(const char *dir, const struct dsv4_config *c, struct dsv4_synth_recipe *ret)
{
    char path[4096];
    json_error_t err;
    json_t *root, *v;
    const char *key;
    struct stat sb;
    FILE *f;
    int r = 1;

    snprintf(path, sizeof(path), "%s/%s", dir, DSV4_SYNTH_RECIPE);
    if (!(f = fopen(path, "r")))
        return errno == ENOENT ? 0 : dsv4_error_set(-errno, "%s: %s", path, strerror(errno));
    /* the recipe is a few keys: a larger file is not one, and is not read into memory */
    if (fstat(fileno(f), &sb) == 0 && sb.st_size > DSV4_SYNTH_RECIPE_MAX_BYTES) {
        fclose(f);
        return dsv4_error_set(-E2BIG, "%s: %lld bytes, over the limit of %d", path, (long long)sb.st_size,
                              DSV4_SYNTH_RECIPE_MAX_BYTES);
    }
    fclose(f);
    if (has_shards(dir))
        return dsv4_error_set(-EINVAL, "%s holds both %s and safetensors shards: remove one (the recipe "
                              "generates random weights, the shards hold real ones)", dir, DSV4_SYNTH_RECIPE);
    root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return dsv4_error_set(-EINVAL, "%s: line %d: %s", path, err.line, err.text);
    *ret = (struct dsv4_synth_recipe){ .seed = 1, .distinct_layers = c->n_layers, .router_skew = 0.0 };
    if (!json_is_object(root))
        r = dsv4_error_set(-EINVAL, "%s: expected a JSON object", path);
    json_object_foreach(root, key, v) {
        if (r < 0)
            break;
        if (strcmp(key, "seed") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 0)
                r = dsv4_error_set(-EINVAL, "%s: seed must be an integer >= 0", path);
            else
                ret->seed = (uint64_t)json_integer_value(v);
        } else if (strcmp(key, "distinct_layers") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > c->n_layers)
                r = dsv4_error_set(-EINVAL, "%s: distinct_layers must be an integer in 1..%d (the model's layers)",
                                   path, c->n_layers);
            else
                ret->distinct_layers = (int)json_integer_value(v);
        } else if (strcmp(key, "router_skew") == 0) {
            if (!json_is_number(v) || !(json_number_value(v) >= 0.0 && json_number_value(v) <= DSV4_SYNTH_SKEW_MAX))
                r = dsv4_error_set(-EINVAL, "%s: router_skew must be a number in 0..%g", path, DSV4_SYNTH_SKEW_MAX);
            else
                ret->router_skew = json_number_value(v);
        } else {
            r = dsv4_error_set(-EINVAL, "%s: unknown key \"%s\" (known: seed, distinct_layers, router_skew)", path,
                               key);
        }
    }
    json_decref(root);
    return r;
}
