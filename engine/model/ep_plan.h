/* SPDX-License-Identifier: MIT */
/* Expert parallelism within one host (doc/MULTIGPU.md): which routed experts each GPU holds, whether
 * the model fits when they are split that way, and how many bytes the GPUs exchange at each MoE
 * layer. Pure arithmetic on sizes, no device: the boot plan and the tests share it.
 *
 * Every GPU keeps a copy of the dense weights (attention, shared expert, router, embeddings, head)
 * and the caches of the slots it owns; the routed experts of every layer are split by contiguous
 * expert ranges, the same ranges in every layer. */
#ifndef DSV4_ENGINE_MODEL_EP_PLAN_H
#define DSV4_ENGINE_MODEL_EP_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/model/config.h"

#define DSV4_EP_MAX_GPUS 16     /* GPUs of one host dsv4d spreads the experts over */

/* The experts rank `rank` of n_ranks holds: [*ret_e0, *ret_e1), contiguous; the first
 * n_experts % n_ranks ranks hold one more than the others. -EINVAL (with a message) unless
 * 1 <= n_ranks <= n_experts and 0 <= rank < n_ranks. */
int dsv4_ep_shard(int n_experts, int n_ranks, int rank, int *ret_e0, int *ret_e1);

/* Slots GPU `rank` of n_ranks owns when max_batch slots are dealt out the same way. */
int dsv4_ep_slots(int max_batch, int n_ranks, int rank);

struct dsv4_ep_plan_req {
    int n_gpus;                 /* 1..DSV4_EP_MAX_GPUS */
    int n_layers, n_experts;
    const uint64_t *expert_bytes;   /* [n_layers] bytes of one routed expert of layer l, as stored */
    uint64_t dense_bytes;       /* every other weight: replicated on each GPU */
    const uint64_t *free_bytes; /* [n_gpus] device memory free at boot */
    int max_batch;              /* slots of the whole host */
    uint64_t slot_bytes;        /* caches of one slot at max_context */
    uint64_t gpu_fixed_bytes;   /* per GPU: workspaces, exchange buffers, the prefix-cache pool */
    uint64_t margin_bytes;      /* per GPU: left free */
};

struct dsv4_ep_gpu_plan {
    int e0, e1;                 /* routed experts [e0, e1) of every layer */
    int slots;                  /* the slots its caches hold: the largest group's, as every rank reserves */
    uint64_t dense, experts, caches, fixed, margin;
    uint64_t need;              /* the sum of the five above */
    uint64_t free;
};

struct dsv4_ep_plan {
    int n_gpus;
    bool fits;
    int short_gpu;              /* the GPU short by the most, -1 when everything fits */
    uint64_t short_bytes;
    /* The fewest GPUs (each as free as the least free of these) the model fits on, or 0 when none up
     * to DSV4_EP_MAX_GPUS, n_experts and max_batch would do: what the refusal suggests. */
    int min_gpus;
    struct dsv4_ep_gpu_plan gpu[DSV4_EP_MAX_GPUS];
};

/* Fill *ret. Returns 0 when every GPU fits; -ENOMEM when one does not, the message naming that GPU's
 * numbers (free, dense, experts, caches, workspaces, margin, short by) and the GPU count that would
 * fit; -EINVAL for a request out of range. *ret is filled in both first cases. */
int dsv4_ep_plan_make(const struct dsv4_ep_plan_req *req, struct dsv4_ep_plan *ret);

/* What one GPU receives at one MoE layer of one decode step when each GPU runs `bucket` rows (the
 * padded batch bucket every rank runs, in lockstep):
 *   gather: the other GPUs' rows, each the normed hidden row the experts read plus the token's K
 *     expert ids (int32; the weights stay with the row's own GPU, which combines). In fp8 numerics
 *     the experts read the row rounded through e4m3 per 1x128, so it travels that way (D bytes + one
 *     UE8M0 scale per 128), which changes nothing in the arithmetic; in exact numerics as f32 (4 D
 *     bytes).
 *   return: for each of its own rows, the K (row, expert) pair outputs from every other GPU, f32
 *     (4 K D bytes a row; fixed sizes, as graph capture needs: a pair whose expert the sender does
 *     not hold travels unused). The row's GPU takes each pair's from the GPU holding its expert and
 *     combines them as one GPU does, so the split changes no bit.
 * Each is (n_gpus - 1) * bucket rows. -EINVAL for n_gpus outside 1..DSV4_EP_MAX_GPUS or bucket < 1. */
struct dsv4_ep_exchange {
    uint64_t gather_row, return_row;        /* bytes of one row of each */
    uint64_t gather_bytes, return_bytes;    /* into one GPU at one MoE layer */
    uint64_t step_bytes;                    /* both, times the MoE layers: into one GPU per step */
};
int dsv4_ep_exchange_bytes(const struct dsv4_config *c, int n_gpus, int bucket, bool fp8, struct dsv4_ep_exchange *ret);

#endif
