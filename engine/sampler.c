/* Sampler: the order of operations is written in sampler.h; this file follows it step by step.
 * Probabilities are computed in double, always over ascending ids or a fixed sorted order, so one
 * row's result never depends on anything but its inputs. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"
#include "engine/philox.h"
#include "engine/sampler.h"

/* First nucleus guess for top_p: sort this many of the most probable tokens, grow by 8x when their
 * mass is short of top_p. Sorting the whole vocabulary each step would cost ~V log V per row. */
#define SAMPLER_NUCLEUS_FIRST 256
#define SAMPLER_NUCLEUS_GROWTH 8

struct dsv4_sampler {
    int vocab;
    float *l;           /* [V] working logits (steps 2-5) */
    int32_t *idx;       /* [V] candidate ids */
    double *p;          /* [V] unnormalized probabilities, indexed by id */
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
    if (!s->l || !s->idx || !s->p) {
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

/* Insertion-free sort of idx[0..n) by ranks_before (heap sort: no recursion, no allocation). */
static void sift_down(const float *v, int32_t *idx, int root, int n)
{
    for (;;) {
        int child = 2 * root + 1;
        if (child >= n)
            return;
        /* a max-heap of "worst first" so the sorted result is best first */
        if (child + 1 < n && ranks_before(v, idx[child], idx[child + 1]))
            child++;
        if (!ranks_before(v, idx[root], idx[child]))
            return;
        int32_t t = idx[root];
        idx[root] = idx[child];
        idx[child] = t;
        root = child;
    }
}

static void sort_best_first(const float *v, int32_t *idx, int n)
{
    /* Heap ordered so that the root is the WORST element; popping it to the end leaves best first. */
    for (int i = n / 2 - 1; i >= 0; i--)
        sift_down(v, idx, i, n);
    for (int end = n - 1; end > 0; end--) {
        int32_t t = idx[0];
        idx[0] = idx[end];
        idx[end] = t;
        sift_down(v, idx, 0, end);
    }
}

static int cmp_id(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Step 1: log-softmax of the raw row, the top-n and the chosen token's logprob come from it. */
static void raw_logprobs(struct dsv4_sampler *s, const float *logits, int n_top, double *ret_lse,
                         struct dsv4_sample *ret)
{
    int V = s->vocab;
    double m = -INFINITY;
    for (int v = 0; v < V; v++)
        if (logits[v] > m)
            m = logits[v];
    double sum = 0.0;
    for (int v = 0; v < V; v++)
        sum += exp((double)logits[v] - m);
    *ret_lse = m + log(sum);

    /* top-n by a bounded insertion into the sorted output arrays */
    int n = 0;
    for (int32_t v = 0; v < V; v++) {
        if (n == n_top && !(n_top > 0 && logits[v] > logits[ret->top_ids[n - 1]]))
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
}

int dsv4_sampler_sample(struct dsv4_sampler *s, const struct dsv4_sampling *p, const float *logits,
                        const struct dsv4_sampler_history *hist, uint64_t seed, uint64_t index,
                        struct dsv4_sample *ret)
{
    int V = s->vocab;
    float *l = s->l;

    for (int v = 0; v < V; v++) {
        if (isnan(logits[v]) || logits[v] == INFINITY)
            return dsv4_error_set(-EDOM, "sampler: logit of token %d is %g", v, logits[v]);
    }
    double lse;
    raw_logprobs(s, logits, p->logprobs, &lse, ret);
    if (!isfinite(lse))
        return dsv4_error_set(-EDOM, "sampler: every logit is -inf");
    memcpy(l, logits, sizeof(*l) * (size_t)V);

    /* Steps 2-3: penalties from the history. */
    if (hist && p->repetition_penalty != 1.0f && hist->seen) {
        float r = p->repetition_penalty;
        for (int byte = 0; byte < (V + 7) / 8; byte++) {
            uint8_t bits = hist->seen[byte];
            for (int b = 0; bits && b < 8; b++, bits >>= 1) {
                if (!(bits & 1))
                    continue;
                int v = byte * 8 + b;
                if (v < V)
                    l[v] = l[v] > 0.0f ? l[v] / r : l[v] * r;
            }
        }
    }
    if (hist && hist->counts && (p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f)) {
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
        float inv_t = 1.0f / p->temperature;
        for (int v = 0; v < V; v++)
            l[v] *= inv_t;

        /* Step 6: top_k. Candidates idx[0..n). */
        int32_t *idx = s->idx;
        int n = V;
        for (int v = 0; v < V; v++)
            idx[v] = v;
        bool sorted = false;
        if (p->top_k > 0 && p->top_k < V) {
            select_best(l, idx, V, p->top_k);
            n = p->top_k;
            qsort(idx, (size_t)n, sizeof(*idx), cmp_id);    /* sum in ascending id: a fixed order */
        }

        /* Step 7: softmax over the candidates (unnormalized p[id], total z). */
        float m = -INFINITY;
        for (int i = 0; i < n; i++)
            if (l[idx[i]] > m)
                m = l[idx[i]];
        double z = 0.0;
        double pmax = 0.0;
        for (int i = 0; i < n; i++) {
            double e = exp((double)l[idx[i]] - m);
            s->p[idx[i]] = e;
            z += e;
            if (e > pmax)
                pmax = e;
        }

        /* Step 8: top_p over the candidates sorted best first; grow the sorted head until the
         * mass reaches top_p (the head is exactly the prefix a full sort would give). */
        if (p->top_p < 1.0f) {
            double target = (double)p->top_p * z;
            int head = n < SAMPLER_NUCLEUS_FIRST ? n : SAMPLER_NUCLEUS_FIRST;
            int keep = n;
            for (;;) {
                select_best(l, idx, n, head);
                sort_best_first(l, idx, head);
                double acc = 0.0;
                int i;
                for (i = 0; i < head; i++) {
                    acc += s->p[idx[i]];
                    if (acc >= target)
                        break;
                }
                if (i < head) {
                    keep = i + 1;
                    break;
                }
                if (head == n)
                    break;
                head = (int)((int64_t)head * SAMPLER_NUCLEUS_GROWTH < n ? head * SAMPLER_NUCLEUS_GROWTH : n);
            }
            n = keep;
            sorted = true;
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
        if (sorted)
            qsort(idx, (size_t)n, sizeof(*idx), cmp_id);
        double zk = 0.0;
        for (int i = 0; i < n; i++)
            zk += s->p[idx[i]];
        double target = dsv4_philox_uniform(seed, index, 0) * zk;
        double acc = 0.0;
        chosen = -1;
        for (int i = 0; i < n; i++) {
            double pi = s->p[idx[i]];
            if (pi <= 0.0)
                continue;
            chosen = idx[i];    /* the last positive one, if rounding leaves acc <= target */
            acc += pi;
            if (acc > target)
                break;
        }
    }
    ret->token = chosen;
    ret->logprob = (float)((double)logits[chosen] - lse);
    return 0;
}
