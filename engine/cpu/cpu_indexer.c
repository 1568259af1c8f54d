/* SPDX-License-Identifier: MIT */
/* The lightning indexer of CSA layers: picks which complete compressed entries a query attends to.
 *
 *   qI = wq_b qr -> [nI, dI]; RoPE (compress frequencies) on each head's last rope_dim values at pos
 *   w  = weights_proj xn * nI^-0.5
 *   score_s = sum_h w_h * ReLU(qI_h . kI_s) * dI^-0.5     for the complete entries s < (pos+1)/r
 *   keep the top min(index_topk, count)
 *
 * In fp8 numerics the query heads are Hadamard-rotated and rounded through FP4 like the stored
 * keys (an orthogonal rotation of both sides leaves the exact scores unchanged). */
#include "build-config.h"

#include <math.h>
#include <stdlib.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/model/quant.h"

/* Heap order: a is "worse" than b when its score is lower, or equal with a higher index, so ties
 * keep the lower entry. The heap root is the worst of the kept entries. */
static bool worse(const float *score, int a, int b)
{
    return score[a] < score[b] || (score[a] == score[b] && a > b);
}

static void sift_down(int *h, int n, int i, const float *score)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(score, h[l], h[m]))
            m = l;
        if (r < n && worse(score, h[r], h[m]))
            m = r;
        if (m == i)
            return;
        int t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int dsv4_cpu_indexer_select(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *layer,
                            const struct dsv4_cpu_layer_state *ls, const float *xn, const float *qr,
                            int64_t pos, int n_entries)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    const struct dsv4_indexer *ix = &layer->attn.indexer;
    int nh = cfg->index_n_heads, dh = cfg->index_head_dim, k = cfg->index_topk;

    if (n_entries <= k) {
        /* Every complete entry fits: the scores cannot change the choice. */
        for (int s = 0; s < n_entries; s++)
            wk->isel[s] = s;
        return n_entries;
    }

    dsv4_cpu_linear(c, &ix->wq_b, qr, wk->iq);
    for (int h = 0; h < nh; h++) {
        float *qh = wk->iq + (size_t)h * dh;
        dsv4_cpu_rope_apply(&wk->rope_compress, qh + dh - cfg->rope_dim, pos, false);
        if (c->num == DSV4_NUMERICS_FP8) {
            dsv4_hadamard(qh, (size_t)dh);
            dsv4_fp4_roundtrip(qh, (size_t)dh, DSV4_CPU_FP4_BLOCK);
        }
    }
    dsv4_cpu_linear(c, &ix->weights_proj, xn, wk->iw);
    float wscale = 1.0f / sqrtf((float)nh), qscale = 1.0f / sqrtf((float)dh);
    for (int h = 0; h < nh; h++)
        wk->iw[h] *= wscale;

    for (int s = 0; s < n_entries; s++) {
        const float *key = ls->index_keys + (size_t)s * dh;
        float score = 0.0f;
        for (int h = 0; h < nh; h++) {
            float dot = dsv4_cpu_dot(wk->iq + (size_t)h * dh, key, dh);
            score += (dot > 0.0f ? dot : 0.0f) * qscale * wk->iw[h];
        }
        wk->iscore[s] = score;
    }

    /* Top k with a min-heap of the kept entries. */
    int *heap = wk->iheap;
    for (int s = 0; s < k; s++)
        heap[s] = s;
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_down(heap, k, i, wk->iscore);
    for (int s = k; s < n_entries; s++) {
        if (worse(wk->iscore, heap[0], s)) {
            heap[0] = s;
            sift_down(heap, k, 0, wk->iscore);
        }
    }
    for (int i = 0; i < k; i++)
        wk->isel[i] = heap[i];
    qsort(wk->isel, (size_t)k, sizeof(int), cmp_int);
    return k;
}
