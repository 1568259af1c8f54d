/* SPDX-License-Identifier: MIT */
/* Sampler: the order of operations is written in sampler.h; this file follows it step by step.
 * Exponentials are taken in float and summed in double, always over ascending ids or a fixed sorted
 * order, so one row's result never depends on anything but its inputs. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"
#include "engine/serve/philox.h"
#include "engine/serve/sampler.h"

/* Logit bins for top_k and top_p (see the sampling step): 256 bins of 1/16 logit cover the top 16
 * logits (probability ratios down to e^-16); the last bin takes the rest. */
#define SAMPLER_BINS 256
#define SAMPLER_BIN_WIDTH 0.0625f
#define SAMPLER_KEPT 0xFFFF     /* bin[] mark of a token top_p keeps */

struct dsv4_sampler {
    int vocab;
    float *l;           /* [V] working logits (steps 2-5) */
    int32_t *idx;       /* [V] candidate ids */
    double *p;          /* [V] unnormalized probabilities, indexed by id */
    uint16_t *bin;      /* [V] logit bin of each id */
    int32_t *cand;      /* [V] top_p candidates */
    uint64_t *key_a, *key_b;    /* [V] radix sort buffers */
};

void dsv4_sampling_defaults(struct dsv4_sampling *ret)
{
    memset(ret, 0, sizeof(*ret));
    ret->temperature = 1.0f;
    ret->top_p = 1.0f;
    ret->repetition_penalty = 1.0f;
}

int dsv4_sampling_validate(const struct dsv4_sampling *p)
{
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return dsv4_error_set(-EINVAL, "sampling temperature %g: must be finite and >= 0", p->temperature);
    if (p->top_k < 0)
        return dsv4_error_set(-EINVAL, "sampling top_k %d: must be >= 0 (0 = off)", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return dsv4_error_set(-EINVAL, "sampling top_p %g: must be in (0, 1]", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return dsv4_error_set(-EINVAL, "sampling min_p %g: must be in [0, 1]", p->min_p);
    if (!(p->repetition_penalty > 0.0f) || !isfinite(p->repetition_penalty))
        return dsv4_error_set(-EINVAL, "sampling repetition_penalty %g: must be finite and > 0",
                              p->repetition_penalty);
    if (!isfinite(p->presence_penalty))
        return dsv4_error_set(-EINVAL, "sampling presence_penalty: must be finite");
    if (!isfinite(p->frequency_penalty))
        return dsv4_error_set(-EINVAL, "sampling frequency_penalty: must be finite");
    if (p->logprobs < 0 || p->logprobs > DSV4_SAMPLER_LOGPROBS_MAX)
        return dsv4_error_set(-EINVAL, "sampling logprobs %d: must be in [0, %d]", p->logprobs,
                              DSV4_SAMPLER_LOGPROBS_MAX);
    return 0;
}

int dsv4_sampler_create(int vocab, struct dsv4_sampler **ret)
{
    *ret = NULL;
    if (vocab < 1 || vocab > DSV4_SAMPLER_VOCAB_MAX)
        return dsv4_error_set(-EINVAL, "sampler vocab %d: must be in [1, %d]", vocab, DSV4_SAMPLER_VOCAB_MAX);
    struct dsv4_sampler *s = calloc(1, sizeof(*s));
    if (!s)
        return dsv4_error_set(-ENOMEM, "sampler: out of memory");
    s->vocab = vocab;
    s->l = malloc(sizeof(*s->l) * (size_t)vocab);
    s->idx = malloc(sizeof(*s->idx) * (size_t)vocab);
    s->p = malloc(sizeof(*s->p) * (size_t)vocab);
    s->bin = malloc(sizeof(*s->bin) * (size_t)vocab);
    s->cand = malloc(sizeof(*s->cand) * (size_t)vocab);
    s->key_a = malloc(sizeof(*s->key_a) * (size_t)vocab);
    s->key_b = malloc(sizeof(*s->key_b) * (size_t)vocab);
    if (!s->l || !s->idx || !s->p || !s->bin || !s->cand || !s->key_a || !s->key_b) {
        dsv4_sampler_destroy(s);
        return dsv4_error_set(-ENOMEM, "sampler: out of memory for vocab %d", vocab);
    }
    *ret = s;
    return 0;
}

void dsv4_sampler_destroy(struct dsv4_sampler *s)
{
    if (!s)
        return;
    free(s->l);
    free(s->idx);
    free(s->p);
    free(s->bin);
    free(s->cand);
    free(s->key_a);
    free(s->key_b);
    free(s);
}

/* a ranks before b: larger value first, then lower id. */
static inline int ranks_before(const float *v, int32_t a, int32_t b)
{
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

/* Reorder idx[0..n) so that its first k entries are the k best by ranks_before (unordered).
 * Quickselect with a median-of-three pivot; ids are distinct so the order is strict. */
static void select_best(const float *v, int32_t *idx, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        int32_t a = idx[lo], b = idx[mid], c = idx[hi], pivot;
        if (ranks_before(v, a, b))
            pivot = ranks_before(v, b, c) ? b : (ranks_before(v, a, c) ? c : a);
        else
            pivot = ranks_before(v, a, c) ? a : (ranks_before(v, b, c) ? c : b);
        int i = lo, j = hi;
        while (i <= j) {
            while (ranks_before(v, idx[i], pivot))
                i++;
            while (ranks_before(v, pivot, idx[j]))
                j--;
            if (i <= j) {
                int32_t t = idx[i];
                idx[i] = idx[j];
                idx[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            break;
    }
}

/* Float -> unsigned key in the same order (negative floats reversed, sign bit flipped). */
static inline uint32_t float_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* Sort ids[0..n), given in ascending id, best first by ranks_before: a stable LSD radix sort on the
 * inverted value key (4 passes of 8 bits) keeps equal values in ascending id. -0 is keyed as +0
 * (adding +0 makes it so): they are equal to ranks_before. a, b: [n] scratch. */
static void sort_best_first(const float *v, int32_t *ids, int n, uint64_t *a, uint64_t *b)
{
    for (int i = 0; i < n; i++)
        a[i] = ((uint64_t)~float_key(v[ids[i]] + 0.0f) << 32) | (uint32_t)ids[i];
    for (int shift = 32; shift < 64; shift += 8) {
        int count[257] = { 0 };
        for (int i = 0; i < n; i++)
            count[((a[i] >> shift) & 0xFF) + 1]++;
        for (int d = 0; d < 256; d++)
            count[d + 1] += count[d];
        for (int i = 0; i < n; i++)
            b[count[(a[i] >> shift) & 0xFF]++] = a[i];
        uint64_t *t = a;
        a = b;
        b = t;
    }
    /* four passes: the sorted keys are back in the first buffer */
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)(uint32_t)a[i];
}

static int cmp_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Step 1: log-softmax of the raw row, the top-n and the chosen token's logprob come from it. Also
 * checks the row (no NaN, no +inf) and leaves exp(logit - max) in s->p, which step 7 reuses when
 * no step in between changed the logits. */
static int raw_logprobs(struct dsv4_sampler *s, const float *logits, int n_top, float *ret_max,
                        double *ret_sum, double *ret_lse, struct dsv4_sample *ret)
{
    int V = s->vocab;
    float m = -INFINITY;
    for (int v = 0; v < V; v++) {
        if (!(logits[v] < INFINITY))
            return dsv4_error_set(-EDOM, "sampler: logit of token %d is %g", v, logits[v]);
        if (logits[v] > m)
            m = logits[v];
    }
    if (m == -INFINITY)
        return dsv4_error_set(-EDOM, "sampler: every logit is -inf");
    double sum = 0.0;
    for (int v = 0; v < V; v++) {
        double e = expf(logits[v] - m);
        s->p[v] = e;
        sum += e;
    }
    *ret_max = m;
    *ret_sum = sum;
    *ret_lse = (double)m + log(sum);

    /* top-n by a bounded insertion into the sorted output arrays */
    int n = 0;
    for (int32_t v = 0; n_top > 0 && v < V; v++) {
        if (n == n_top && !(logits[v] > logits[ret->top_ids[n - 1]]))
            continue;
        int pos = n < n_top ? n : n - 1;
        while (pos > 0 && logits[v] > logits[ret->top_ids[pos - 1]]) {
            ret->top_ids[pos] = ret->top_ids[pos - 1];
            pos--;
        }
        ret->top_ids[pos] = v;
        if (n < n_top)
            n++;
    }
    ret->n_top = n;
    for (int i = 0; i < n; i++)
        ret->top_logprobs[i] = (float)((double)logits[ret->top_ids[i]] - *ret_lse);
    return 0;
}

int dsv4_sampler_sample(struct dsv4_sampler *s, const struct dsv4_sampling *p, const float *logits,
                        const struct dsv4_sampler_history *hist, uint64_t seed, uint64_t index,
                        struct dsv4_sample *ret)
{
    int V = s->vocab;
    float *l = s->l;

    double lse = 0.0, raw_sum = 0.0;
    float raw_max = 0.0f;
    int r = raw_logprobs(s, logits, p->logprobs, &raw_max, &raw_sum, &lse, ret);
    if (r < 0)
        return r;
    memcpy(l, logits, sizeof(*l) * (size_t)V);
    /* true while l still equals the raw logits (then s->p holds step 7's exponentials already) */
    bool raw = true;

    /* Steps 2-3: penalties from the history. */
    if (hist && p->repetition_penalty != 1.0f && hist->seen) {
        float rp = p->repetition_penalty;
        raw = false;
        for (int byte = 0; byte < (V + 7) / 8; byte++) {
            uint8_t bits = hist->seen[byte];
            for (int b = 0; bits && b < 8; b++, bits >>= 1) {
                if (!(bits & 1))
                    continue;
                int v = byte * 8 + b;
                if (v < V)
                    l[v] = l[v] > 0.0f ? l[v] / rp : l[v] * rp;
            }
        }
    }
    if (hist && hist->counts && (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f)) {
        raw = false;
        for (int v = 0; v < V; v++) {
            uint32_t c = hist->counts[v];
            if (c)
                l[v] -= (float)c * p->frequency_penalty + p->presence_penalty;
        }
    }

    int32_t chosen;
    if (p->temperature == 0.0f) {
        /* Step 4: greedy, lowest id on ties (strict > keeps the first). */
        chosen = 0;
        for (int v = 1; v < V; v++)
            if (l[v] > l[chosen])
                chosen = v;
    } else {
        /* Step 5: temperature. */
        if (p->temperature != 1.0f) {
            float inv_t = 1.0f / p->temperature;
            for (int v = 0; v < V; v++)
                l[v] *= inv_t;
            raw = false;
        }

        /* Logit bins: bin b holds the tokens with (max - l) in [b, b+1) * SAMPLER_BIN_WIDTH (the
         * last bin everything below). Every token of a bin ranks before every token of a later
         * bin, so top_k and top_p only need to rank the tokens of the bins up to the one where the
         * count (or mass) crosses the limit: usually a few hundred tokens, not V. */
        float m = raw_max;
        if (!raw) {
            m = -INFINITY;
            for (int v = 0; v < V; v++)
                if (l[v] > m)
                    m = l[v];
        }
        int32_t *idx = s->idx;
        uint16_t *bin = s->bin;
        int bin_count[SAMPLER_BINS] = { 0 };
        double bin_mass[SAMPLER_BINS] = { 0 };
        bool use_bins = (p->top_k > 0 && p->top_k < V) || p->top_p < 1.0f;
        for (int v = 0; use_bins && v < V; v++) {
            float d = (m - l[v]) * (1.0f / SAMPLER_BIN_WIDTH);
            int b = d < (float)(SAMPLER_BINS - 1) ? (int)d : SAMPLER_BINS - 1;    /* -inf: last */
            bin[v] = (uint16_t)b;
            bin_count[b]++;
        }

        /* Step 6: top_k. Candidates idx[0..n), ascending id. */
        int n = 0;
        if (p->top_k > 0 && p->top_k < V) {
            int last = 0, acc = 0;
            while (acc + bin_count[last] < p->top_k)
                acc += bin_count[last++];
            for (int v = 0; v < V; v++)
                if (bin[v] <= last)
                    idx[n++] = v;
            select_best(l, idx, n, p->top_k);
            n = p->top_k;
            qsort(idx, (size_t)n, sizeof(*idx), cmp_id);
        } else {
            for (int v = 0; v < V; v++)
                idx[v] = v;
            n = V;
        }

        /* Step 7: softmax over the candidates (unnormalized p[id], total z, summed by ascending id).
         * The largest logit is among them (top_k keeps it), so its probability is exp(0) = 1. */
        double z = 0.0;
        if (raw && n == V) {
            z = raw_sum;
        } else {
            for (int i = 0; i < n; i++) {
                double e = raw ? s->p[idx[i]] : expf(l[idx[i]] - m);
                s->p[idx[i]] = e;
                z += e;
            }
        }
        if (p->top_p < 1.0f)
            for (int i = 0; i < n; i++)
                bin_mass[bin[idx[i]]] += s->p[idx[i]];
        const double pmax = 1.0;

        /* Step 8: top_p: rank the candidates of the bins up to the one where the mass reaches
         * top_p, plus one bin of margin for rounding; if their ranked sum still falls short, rank
         * all candidates. */
        if (p->top_p < 1.0f) {
            double target = (double)p->top_p * z;
            int last = 0;
            double acc = 0.0;
            while (last < SAMPLER_BINS - 1 && acc + bin_mass[last] < target)
                acc += bin_mass[last++];
            if (last < SAMPLER_BINS - 1)
                last++;
            int32_t *cand = s->cand;
            int nc = 0;
            for (int i = 0; i < n; i++)
                if (bin[idx[i]] <= last)
                    cand[nc++] = idx[i];
            for (int pass = 0; pass < 2; pass++) {
                sort_best_first(l, cand, nc, s->key_a, s->key_b);
                acc = 0.0;
                int i;
                for (i = 0; i < nc; i++) {
                    acc += s->p[cand[i]];
                    if (acc >= target)
                        break;
                }
                if (i < nc) {
                    nc = i + 1;
                    break;
                }
                if (nc == n)
                    break;
                memcpy(cand, idx, sizeof(*cand) * (size_t)n);
                nc = n;
            }
            /* keep idx in ascending id: flag the kept ids in bin[] (no longer needed) and filter */
            for (int i = 0; i < nc; i++)
                bin[cand[i]] = SAMPLER_KEPT;
            int w = 0;
            for (int i = 0; i < n; i++)
                if (bin[idx[i]] == SAMPLER_KEPT)
                    idx[w++] = idx[i];
            n = w;
        }

        /* Step 9: min_p against the largest probability (pmax is in the kept set: it ranks first). */
        if (p->min_p > 0.0f) {
            double cut = (double)p->min_p * pmax;
            int w = 0;
            for (int i = 0; i < n; i++)
                if (s->p[idx[i]] >= cut)
                    idx[w++] = idx[i];
            n = w;
        }

        /* Step 10: the draw, over the kept tokens in ascending id. */
        double zk = z;
        if (n < V) {
            zk = 0.0;
            for (int i = 0; i < n; i++)
                zk += s->p[idx[i]];
        }
        double target = dsv4_philox_uniform(seed, index, 0) * zk;
        double acc = 0.0;
        chosen = -1;
        for (int i = 0; i < n; i++) {
            double pi = s->p[idx[i]];
            if (!(pi > 0.0))
                continue;       /* NaN too: exp(inf - inf) of an overflowed logit */
            chosen = idx[i];    /* the last positive one, if rounding leaves acc <= target */
            acc += pi;
            if (acc > target)
                break;
        }
        /* A temperature or repetition penalty small enough to carry the working logits past the
         * float range leaves every probability 0 or NaN (the device sampler fails the same rows). */
        if (chosen < 0)
            return dsv4_error_set(-EDOM, "sampler: no token has a positive probability: temperature %g and "
                                  "repetition_penalty %g take the logits out of float range (temperature 0 "
                                  "is greedy)", p->temperature, p->repetition_penalty);
    }
    ret->token = chosen;
    ret->logprob = (float)((double)logits[chosen] - lse);
    return 0;
}
