/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>

#include "engine/error.h"
#include "engine/model/ep_plan.h"

#define GIB (1024.0 * 1024.0 * 1024.0)
#define FP8_ACT_BLOCK 128       /* the experts' activation quantizer: e4m3 per 1x128, one UE8M0 scale */

int dsv4_ep_shard(int n_experts, int n_ranks, int rank, int *ret_e0, int *ret_e1)
{
    if (n_ranks < 1 || n_ranks > n_experts)
        return dsv4_error_set(-EINVAL, "expert split: %d experts cannot be split over %d GPUs (1..%d)", n_experts,
                              n_ranks, n_experts);
    if (rank < 0 || rank >= n_ranks)
        return dsv4_error_set(-EINVAL, "expert split: rank %d outside 0..%d", rank, n_ranks - 1);
    const int base = n_experts / n_ranks, extra = n_experts % n_ranks;
    *ret_e0 = rank * base + (rank < extra ? rank : extra);
    *ret_e1 = *ret_e0 + base + (rank < extra);
    return 0;
}

int dsv4_ep_slots(int max_batch, int n_ranks, int rank)
{
    return max_batch / n_ranks + (rank < max_batch % n_ranks);
}

/* GPU `rank` of n: everything but the free bytes. Every rank reserves the slots of the largest
 * group (ceil(max_batch / n): the ranks run alike, kernels/ep_backend.cu) and one spare beyond them:
 * the padding rows of a bucket write there. */
static struct dsv4_ep_gpu_plan gpu_need(const struct dsv4_ep_plan_req *r, int n, int rank)
{
    struct dsv4_ep_gpu_plan g = {0};
    dsv4_ep_shard(r->n_experts, n, rank, &g.e0, &g.e1);
    g.slots = dsv4_ep_slots(r->max_batch, n, 0);
    g.dense = r->dense_bytes;
    for (int l = 0; l < r->n_layers; l++)
        g.experts += r->expert_bytes[l] * (uint64_t)(g.e1 - g.e0);
    g.caches = r->slot_bytes * (uint64_t)(g.slots + 1);
    g.fixed = r->gpu_fixed_bytes;
    g.margin = r->margin_bytes;
    g.need = g.dense + g.experts + g.caches + g.fixed + g.margin;
    return g;
}

static int check_req(const struct dsv4_ep_plan_req *r)
{
    if (r->n_gpus < 1 || r->n_gpus > DSV4_EP_MAX_GPUS)
        return dsv4_error_set(-EINVAL, "expert parallelism over %d GPUs: 1..%d are supported", r->n_gpus,
                              DSV4_EP_MAX_GPUS);
    if (r->n_layers < 1 || r->n_layers > DSV4_MAX_LAYERS || r->n_experts < 1 || r->n_experts > DSV4_MAX_EXPERTS ||
        !r->expert_bytes || !r->free_bytes)
        return dsv4_error_set(-EINVAL, "expert parallelism: %d layers of %d experts", r->n_layers, r->n_experts);
    if (r->n_gpus > r->n_experts)
        return dsv4_error_set(-EINVAL, "expert parallelism over %d GPUs: the model has %d experts a layer",
                              r->n_gpus, r->n_experts);
    if (r->max_batch < r->n_gpus)
        return dsv4_error_set(-EINVAL, "expert parallelism over %d GPUs: max_batch %d (each GPU holds a group of "
                              "the slots)", r->n_gpus, r->max_batch);
    /* Every sum below stays under 2^63: a layer's experts, the slots, each term, then their total. */
    const uint64_t cap = UINT64_C(1) << 56;
    if (r->dense_bytes > cap || r->slot_bytes > cap / ((uint64_t)r->max_batch + 1) || r->gpu_fixed_bytes > cap ||
        r->margin_bytes > cap)
        return dsv4_error_set(-EINVAL, "expert parallelism: a size beyond 2^56 bytes");
    for (int l = 0; l < r->n_layers; l++)
        if (r->expert_bytes[l] > cap / DSV4_MAX_EXPERTS / DSV4_MAX_LAYERS)
            return dsv4_error_set(-EINVAL, "expert parallelism: layer %d's experts of %llu bytes", l,
                                  (unsigned long long)r->expert_bytes[l]);
    return 0;
}

static int fewest_gpus(const struct dsv4_ep_plan_req *r, uint64_t least_free)
{
    for (int n = 1; n <= DSV4_EP_MAX_GPUS && n <= r->n_experts && n <= r->max_batch; n++) {
        bool ok = true;
        for (int g = 0; g < n && ok; g++)
            ok = gpu_need(r, n, g).need <= least_free;
        if (ok)
            return n;
    }
    return 0;
}

int dsv4_ep_plan_make(const struct dsv4_ep_plan_req *r, struct dsv4_ep_plan *ret)
{
    int rc = check_req(r);
    if (rc < 0)
        return rc;
    const int n = r->n_gpus;
    uint64_t least_free = UINT64_MAX;
    *ret = (struct dsv4_ep_plan){ .n_gpus = n, .fits = true, .short_gpu = -1 };
    for (int g = 0; g < n; g++) {
        ret->gpu[g] = gpu_need(r, n, g);
        ret->gpu[g].free = r->free_bytes[g];
        least_free = r->free_bytes[g] < least_free ? r->free_bytes[g] : least_free;
        if (ret->gpu[g].need > ret->gpu[g].free && ret->gpu[g].need - ret->gpu[g].free > ret->short_bytes) {
            ret->fits = false;
            ret->short_gpu = g;
            ret->short_bytes = ret->gpu[g].need - ret->gpu[g].free;
        }
    }
    ret->min_gpus = fewest_gpus(r, least_free);
    if (ret->fits)
        return 0;

    const struct dsv4_ep_gpu_plan *g = &ret->gpu[ret->short_gpu];
    char hint[96];
    if (ret->min_gpus > n)
        snprintf(hint, sizeof(hint), "; %d GPUs with %.2f GiB free each would hold it", ret->min_gpus,
                 least_free / GIB);
    else if (ret->min_gpus == 0)
        snprintf(hint, sizeof(hint), "; no count of GPUs up to %d with %.2f GiB free each holds it",
                 DSV4_EP_MAX_GPUS < r->n_experts ? DSV4_EP_MAX_GPUS : r->n_experts, least_free / GIB);
    else
        hint[0] = '\0';
    return dsv4_error_set(-ENOMEM, "experts split over %d GPUs: GPU %d has %.2f GiB free and needs %.2f GiB (dense "
                          "weights %.2f + routed experts %.2f for experts %d..%d of each layer + caches %.2f for %d "
                          "slots + workspaces %.2f + margin %.2f), short by %.2f GiB: lower max_batch or "
                          "max_context, or add GPUs%s",
                          n, ret->short_gpu, g->free / GIB, g->need / GIB, g->dense / GIB, g->experts / GIB, g->e0,
                          g->e1 - 1, g->caches / GIB, g->slots, g->fixed / GIB, g->margin / GIB,
                          ret->short_bytes / GIB, hint);
}

int dsv4_ep_exchange_bytes(const struct dsv4_config *c, int n_gpus, int bucket, bool fp8, struct dsv4_ep_exchange *ret)
{
    if (n_gpus < 1 || n_gpus > DSV4_EP_MAX_GPUS || bucket < 1)
        return dsv4_error_set(-EINVAL, "expert exchange: %d GPUs (1..%d), bucket %d", n_gpus, DSV4_EP_MAX_GPUS,
                              bucket);
    const uint64_t D = (uint64_t)c->dim, K = (uint64_t)c->n_experts_per_tok;
    const uint64_t peer_rows = (uint64_t)(n_gpus - 1) * (uint64_t)bucket;
    const uint64_t hidden = fp8 ? D + (D + FP8_ACT_BLOCK - 1) / FP8_ACT_BLOCK : 4 * D;
    *ret = (struct dsv4_ep_exchange){0};
    ret->gather_row = hidden + K * sizeof(int32_t);
    ret->return_row = K * sizeof(float) * D;
    ret->gather_bytes = peer_rows * ret->gather_row;
    ret->return_bytes = peer_rows * ret->return_row;
    ret->step_bytes = (ret->gather_bytes + ret->return_bytes) * (uint64_t)c->n_layers;
    return 0;
}
