/* SPDX-License-Identifier: MIT */
/* The CUDA backend over several ranks with the routed experts split across them (doc/MULTIGPU.md):
 * one rank per listed GPU, each a whole CUDA backend of kernels/step.cu (its own arena, dense weights,
 * slots and caches) holding the experts dsv4_ep_shard gives it. Slots are dealt out in groups of
 * consecutive slots, group g on rank g (engine/backend.h's slot_groups); a request stays on its rank.
 *
 * Every step runs all ranks in lockstep on one bucket, the smallest that holds the most rows any rank
 * has (the others pad). At each MoE sublayer the ranks exchange by device-to-device copies, ordered by
 * events (peer copies between GPUs; within one GPU when an ordinal is listed more than once, the
 * loopback the tests run on one device):
 *   gather: every rank copies each rank's experts' input rows and routing into its own [R B rows]
 *     buffers, rank g's at row g B, once rank g's ev_routed has passed;
 *   experts: each rank runs the experts it holds over all R B rows' (row, expert) pairs, each pair's
 *     output into its own row of the pair outputs (pairs of experts held elsewhere: skipped), ev_parted;
 *   return: every rank copies its own B rows' pair outputs from each rank, takes each pair's from the
 *     rank holding its expert and combines them with its rows' routing weights and the shared
 *     expert's output as one device does (kernels/ep.cu), so the sublayer's bits do not depend on R.
 * A rank pulls from the others and writes only its own buffers, and reads another's before that rank
 * can overwrite them (a rank writes its pair outputs or its next layer's input only after waiting
 * for every rank's copies before), so the two event waits per layer are all the ordering needed.
 * Boot: the ranks boot one after another; then the launches run once eagerly on padding rows and one
 * graph per bucket is captured over every rank's streams (the whole lockstep step is one graph), and
 * every device is sealed. Not under expert parallelism yet: speculative decoding, the prefix cache and
 * fetching host experts ahead (each rank's placement still reads host experts in place). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_util.cuh"
#include "kernels/step_internal.h"

struct ep_backend {
    struct dsv4_backend base;
    struct dsv4_backend_ops ops;
    int n;                                  /* ranks */
    struct cuda_backend *rank[DSV4_EP_MAX_GPUS];
    int ordinal[DSV4_EP_MAX_GPUS];
    int g0[DSV4_EP_MAX_GPUS + 1];           /* rank g owns the caller's slots [g0[g], g0[g + 1]) */
    bool use_graphs;
    cudaGraphExec_t graphs[STEP_MAX_BUCKETS];       /* the lockstep step of each bucket, every rank's launches */
    cudaEvent_t ev_fork, ev_join[DSV4_EP_MAX_GPUS];
    uint64_t captures, eager_steps;
    /* host scratch, [max_batch] per rank: a step's rows of each rank (local slots, tokens, the caller's row) */
    int *r_slot[DSV4_EP_MAX_GPUS], *r_row[DSV4_EP_MAX_GPUS], r_n[DSV4_EP_MAX_GPUS];
    int32_t *r_tok[DSV4_EP_MAX_GPUS];
    struct dsv4_backend_sample_req *s_req;  /* [max_batch] one rank's share of a sample call */
    struct dsv4_sample *s_out;
    int *s_rc;
    char *s_msgs;                           /* [max_batch, DSV4_BACKEND_MSG_MAX] */
    uint64_t *counts;                       /* [n_layers * n_experts] one rank's routing counts */
};

static struct ep_backend *ep_impl(const struct dsv4_backend *b)
{
    return static_cast<struct ep_backend *>(b->impl);
}

static cudaStream_t rank_stream(const struct cuda_backend *cb)
{
    return static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
}

static int rank_of(const struct ep_backend *ep, int slot)
{
    int g = 0;
    while (slot >= ep->g0[g + 1])
        g++;
    return g;
}

/* ---- the lockstep step ---- */

/* Every rank's experts' input and routing into every rank's gathered buffers (B rows each). */
static int gather(struct ep_backend *ep, int B)
{
    const int64_t D = ep->rank[0]->cfg->dim, K = ep->rank[0]->cfg->n_experts_per_tok;
    for (int h = 0; h < ep->n; h++) {
        struct cuda_backend *dst = ep->rank[h];
        const cudaStream_t s = dst->ln[0].s;
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[h]));
        for (int g = 0; g < ep->n; g++) {
            const struct cuda_backend *src = ep->rank[g];
            DSV4_CUDA_TRY(cudaStreamWaitEvent(s, src->ev_routed, 0));
            DSV4_CUDA_TRY(cudaMemcpyAsync(dst->b.gx + g * B * D, src->mid.x, sizeof(float) * B * D,
                                          cudaMemcpyDeviceToDevice, s));
            DSV4_CUDA_TRY(cudaMemcpyAsync(dst->b.gidx + g * B * K, src->b.ridx, sizeof(int32_t) * B * K,
                                          cudaMemcpyDeviceToDevice, s));
        }
    }
    return 0;
}

/* Each rank's B rows' pair outputs (B K of them) from every rank into its gret, rank h's at h B K D. */
static int give_back(struct ep_backend *ep, int B)
{
    const int64_t D = ep->rank[0]->cfg->dim, K = ep->rank[0]->cfg->n_experts_per_tok;
    for (int g = 0; g < ep->n; g++) {
        struct cuda_backend *dst = ep->rank[g];
        const cudaStream_t s = dst->ln[0].s;
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[g]));
        for (int h = 0; h < ep->n; h++) {
            const struct cuda_backend *src = ep->rank[h];
            DSV4_CUDA_TRY(cudaStreamWaitEvent(s, src->ev_parted, 0));
            DSV4_CUDA_TRY(cudaMemcpyAsync(dst->b.gret + h * B * K * D, src->b.moe.d_out + g * B * K * D,
                                          sizeof(float) * B * K * D,
                                          cudaMemcpyDeviceToDevice, s));
        }
    }
    return 0;
}

/* Every rank's launches of one step of B rows on its own stream, the exchange between them; the head
 * for rows [head_from, B). */
static int lockstep_launches(struct ep_backend *ep, int B, int head_from)
{
    const int layers = ep->rank[0]->cfg->n_layers;
    int rc = 0;
    for (int r = 0; rc == 0 && r < ep->n; r++) {
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        rc = dsv4_step_begin(ep->rank[r], B, rank_stream(ep->rank[r]));
    }
    for (int l = 0; rc == 0 && l < layers; l++) {
        for (int r = 0; rc == 0 && r < ep->n; r++) {
            DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
            rc = dsv4_step_routed(ep->rank[r], l, B);
        }
        if (rc == 0)
            rc = gather(ep, B);
        for (int r = 0; rc == 0 && r < ep->n; r++) {
            DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
            rc = dsv4_step_ep_experts(ep->rank[r], B);
        }
        if (rc == 0)
            rc = give_back(ep, B);
        for (int r = 0; rc == 0 && r < ep->n; r++) {
            DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
            rc = dsv4_step_ep_finish(ep->rank[r], B);
        }
    }
    for (int r = 0; rc == 0 && r < ep->n; r++) {
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        rc = dsv4_step_end(ep->rank[r], B, head_from);
    }
    if (rc < 0)     /* the stream buffers as the step found them, for the next one */
        for (int r = 0; r < ep->n; r++) {
            ep->rank[r]->b.X = ep->rank[r]->X0;
            ep->rank[r]->b.X2 = ep->rank[r]->X20;
        }
    return rc;
}

/* Rank 0's stream waits for every other rank's (its staged rows), or every other rank's for rank 0's
 * (after a graph that ran on it). */
static int join_streams(struct ep_backend *ep, bool to_rank0)
{
    const cudaStream_t s0 = rank_stream(ep->rank[0]);
    if (!to_rank0)
        DSV4_CUDA_TRY(cudaEventRecord(ep->ev_fork, s0));
    for (int r = 1; r < ep->n; r++) {
        const cudaStream_t s = rank_stream(ep->rank[r]);
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        if (to_rank0) {
            DSV4_CUDA_TRY(cudaEventRecord(ep->ev_join[r], s));
            DSV4_CUDA_TRY(cudaStreamWaitEvent(s0, ep->ev_join[r], 0));
        } else {
            DSV4_CUDA_TRY(cudaStreamWaitEvent(s, ep->ev_fork, 0));
        }
    }
    return 0;
}

/* The staged step of bucket index bi (B rows; bi < 0: B rows eagerly, the head for the last row). */
static int run_step(struct ep_backend *ep, int bi, int B)
{
    if (ep->use_graphs && bi >= 0) {
        STEP(join_streams(ep, true));
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[0]));
        DSV4_CUDA_TRY(cudaGraphLaunch(ep->graphs[bi], rank_stream(ep->rank[0])));
        return join_streams(ep, false);
    }
    ep->eager_steps += bi < 0;
    return lockstep_launches(ep, B, bi < 0 ? B - 1 : 0);
}

static int sync_ranks(struct ep_backend *ep)
{
    for (int r = 0; r < ep->n; r++) {
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        DSV4_CUDA_TRY(cudaStreamSynchronize(rank_stream(ep->rank[r])));
    }
    return 0;
}

/* ---- backend ops ---- */

static int64_t op_slot_position(const struct dsv4_backend *b, int slot);

static int op_decode(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, float *logits)
{
    struct ep_backend *ep = ep_impl(b);
    const int V = ep->rank[0]->cfg->vocab_size;
    if (n < 1 || n > b->opts.max_batch)
        return dsv4_error_set(-EINVAL, "cuda decode: %d rows, max_batch is %d", n, b->opts.max_batch);
    int most = 1;
    for (int r = 0; r < ep->n; r++)
        ep->r_n[r] = 0;
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= b->opts.max_batch)
            return dsv4_error_set(-EINVAL, "cuda decode: slot %d outside 0..%d", slots[i], b->opts.max_batch - 1);
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return dsv4_error_set(-EINVAL, "cuda decode: slot %d appears twice in one step", slots[i]);
        STEP(dsv4_step_check_token(ep->rank[0], "decode", tokens[i]));
        if (op_slot_position(b, slots[i]) >= b->opts.max_context)
            return dsv4_error_set(-ENOSPC, "cuda decode: slot %d is full (%d tokens)", slots[i], b->opts.max_context);
        const int g = rank_of(ep, slots[i]), k = ep->r_n[g]++;
        ep->r_slot[g][k] = slots[i] - ep->g0[g];
        ep->r_tok[g][k] = tokens[i];
        ep->r_row[g][k] = i;
        most = ep->r_n[g] > most ? ep->r_n[g] : most;
    }
    const int bi = dsv4_step_bucket(ep->rank[0], most), B = ep->rank[0]->buckets[bi];
    for (int r = 0; r < ep->n; r++) {
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        STEP(dsv4_step_rows_stage(ep->rank[r], ep->r_n[r], ep->r_slot[r], ep->r_tok[r], B));
    }
    STEP(run_step(ep, bi, B));
    for (int r = 0; r < ep->n; r++) {
        struct cuda_backend *cb = ep->rank[r];
        if (!ep->r_n[r])
            continue;
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        STEP(dsv4_step_rows_after(cb, ep->r_n[r], B, false, NULL, false));
        for (int k = 0; logits && k < ep->r_n[r]; k++)    /* row k of the rank is the caller's row r_row */
            DSV4_CUDA_TRY(cudaMemcpyAsync(logits + (size_t)ep->r_row[r][k] * V, cb->b.logits + (size_t)k * V,
                                          sizeof(float) * V, cudaMemcpyDeviceToHost, rank_stream(cb)));
    }
    STEP(sync_ranks(ep));
    for (int r = 0; r < ep->n; r++)
        dsv4_step_rows_done(ep->rank[r], ep->r_n[r], ep->r_slot[r], B, false);
    return 0;
}

/* The slot's rank takes the chunks as the single-device prefill does; the other ranks run as many
 * padding rows in lockstep. */
static int op_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits, bool all_rows)
{
    struct ep_backend *ep = ep_impl(b);
    if (slot < 0 || slot >= b->opts.max_batch)
        return dsv4_error_set(-EINVAL, "cuda prefill: slot %d outside 0..%d", slot, b->opts.max_batch - 1);
    const int g = rank_of(ep, slot), local = slot - ep->g0[g];
    struct cuda_backend *cb = ep->rank[g];
    const int V = cb->cfg->vocab_size, chunk = all_rows ? cb->base.opts.max_batch : cb->rows;
    if (n < 0 || cb->pos[local] + n > b->opts.max_context)
        return dsv4_error_set(-ENOSPC, "cuda prefill: %d tokens do not fit slot %d (%lld of %d used)", n, slot,
                              (long long)cb->pos[local], b->opts.max_context);
    for (int i = 0; i < n; i++)
        STEP(dsv4_step_check_token(cb, "prefill", tokens[i]));
    for (int i = 0; i < chunk; i++)
        cb->h_slots[i] = local;
    for (int i0 = 0; i0 < n; i0 += chunk) {
        const int m = n - i0 < chunk ? n - i0 : chunk, bi = dsv4_step_bucket(cb, m);
        const int B = bi >= 0 ? cb->buckets[bi] : m;
        const bool tail = i0 + m == n, eager = bi < 0;
        float *dst = !logits ? NULL : all_rows ? logits + (size_t)i0 * V : tail ? logits : NULL;
        if (eager && dst && all_rows)
            return dsv4_error_set(-EINVAL, "cuda: every row's logits of a %d-row chunk (the largest bucket is %d)", m,
                                  cb->buckets[cb->n_buckets - 1]);
        for (int r = 0; r < ep->n; r++) {
            DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
            STEP(dsv4_step_rows_stage(ep->rank[r], r == g ? m : 0, cb->h_slots, tokens + i0, B));
        }
        STEP(run_step(ep, bi, B));
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[g]));
        STEP(dsv4_step_rows_after(cb, m, B, eager, dst, !all_rows));
        STEP(sync_ranks(ep));
        for (int r = 0; r < ep->n; r++)
            dsv4_step_rows_done(ep->rank[r], r == g ? m : 0, cb->h_slots, B, eager);
    }
    cb->last_prefill = n > 0;
    return 0;
}

/* Each rank samples its rows of the last call (their slots made local), the results put back in the
 * caller's order. */
static int op_sample(struct dsv4_backend *b, int n, const struct dsv4_backend_sample_req *req, struct dsv4_sample *out,
                     int *rc, char *msgs)
{
    struct ep_backend *ep = ep_impl(b);
    if (n < 1 || n > b->opts.max_batch)
        return dsv4_error_set(-EINVAL, "cuda sample: %d rows, max_batch is %d", n, b->opts.max_batch);
    for (int r = 0; r < ep->n; r++) {
        struct cuda_backend *cb = ep->rank[r];
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (req[i].slot < 0 || req[i].slot >= b->opts.max_batch)
                return dsv4_error_set(-EINVAL, "cuda sample: slot %d outside 0..%d", req[i].slot, b->opts.max_batch - 1);
            if (rank_of(ep, req[i].slot) != r)
                continue;
            if (k == cb->base.opts.max_batch)     /* more rows than the rank has slots: some slot twice */
                return dsv4_error_set(-EINVAL, "cuda sample: slot %d asked twice", req[i].slot);
            ep->s_req[k] = req[i];
            ep->s_req[k].slot -= ep->g0[r];
            ep->r_row[r][k++] = i;
        }
        if (!k)
            continue;
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        STEP(cb->base.ops->sample(&cb->base, k, ep->s_req, ep->s_out, ep->s_rc, ep->s_msgs));
        for (int j = 0; j < k; j++) {
            const int i = ep->r_row[r][j];
            out[i] = ep->s_out[j];
            rc[i] = ep->s_rc[j];
            memcpy(msgs + (size_t)i * DSV4_BACKEND_MSG_MAX, ep->s_msgs + (size_t)j * DSV4_BACKEND_MSG_MAX,
                   DSV4_BACKEND_MSG_MAX);
        }
    }
    return 0;
}

static void op_slot_reset(struct dsv4_backend *b, int slot)
{
    struct ep_backend *ep = ep_impl(b);
    if (slot < 0 || slot >= b->opts.max_batch)
        return;
    const int g = rank_of(ep, slot);
    if (cudaSetDevice(ep->ordinal[g]) == cudaSuccess)
        ep->rank[g]->base.ops->slot_reset(&ep->rank[g]->base, slot - ep->g0[g]);
}

static int64_t op_slot_position(const struct dsv4_backend *b, int slot)
{
    const struct ep_backend *ep = ep_impl(b);
    if (slot < 0 || slot >= b->opts.max_batch)
        return -1;
    const int g = rank_of(ep, slot);
    return ep->rank[g]->base.ops->slot_position(&ep->rank[g]->base, slot - ep->g0[g]);
}

/* Rank 0's view, with what adds up across the ranks added up. */
static void op_get_stats(const struct dsv4_backend *b, struct dsv4_backend_stats *ret)
{
    const struct ep_backend *ep = ep_impl(b);
    struct dsv4_backend_stats st;
    char v0[sizeof(ret->variant)];
    for (int r = 0; r < ep->n; r++) {
        const struct cuda_backend *cb = ep->rank[r];
        cb->base.ops->get_stats(&cb->base, r ? &st : ret);
        if (!r)
            continue;
        ret->device_allocs += st.device_allocs;
        ret->bytes_reserved += st.bytes_reserved;
        ret->experts_gpu += st.experts_gpu;
        ret->experts_host += st.experts_host;
        ret->expert_bytes_gpu += st.expert_bytes_gpu;
        ret->expert_bytes_host += st.expert_bytes_host;
        ret->embed_bytes_host += st.embed_bytes_host;
        for (int l = 0; l < ret->expert_layers && l < st.expert_layers; l++) {
            ret->experts_gpu_by_layer[l] += st.experts_gpu_by_layer[l];
            ret->experts_host_by_layer[l] += st.experts_host_by_layer[l];
        }
    }
    ret->graph_captures = ep->captures;
    ret->eager_steps = ep->eager_steps;
    memcpy(v0, ret->variant, sizeof(v0));
    snprintf(ret->variant, sizeof(ret->variant), "experts over %d ranks, %.160s", ep->n, v0);
}

static int op_routing_counts(struct dsv4_backend *b, uint64_t *counts)
{
    struct ep_backend *ep = ep_impl(b);
    const size_t n = (size_t)ep->rank[0]->cfg->n_layers * ep->rank[0]->cfg->n_experts;
    memset(counts, 0, sizeof(uint64_t) * n);
    for (int r = 0; r < ep->n; r++) {   /* each rank counts its own rows' routing, every expert */
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        STEP(dsv4_cuda_dev_read_route_counts(ep->rank[r]->dev, ep->counts));
        for (size_t i = 0; i < n; i++)
            counts[i] += ep->counts[i];
    }
    return 0;
}

static void op_destroy(struct dsv4_backend *b)
{
    struct ep_backend *ep = ep_impl(b);
    for (int i = 0; i < STEP_MAX_BUCKETS; i++)
        if (ep->graphs[i])
            cudaGraphExecDestroy(ep->graphs[i]);
    if (ep->ev_fork)
        cudaEventDestroy(ep->ev_fork);
    for (int r = 0; r < ep->n; r++) {
        if (ep->ev_join[r])
            cudaEventDestroy(ep->ev_join[r]);
        if (ep->rank[r]) {
            cudaSetDevice(ep->ordinal[r]);
            ep->rank[r]->base.ops->destroy(&ep->rank[r]->base);
        }
        free(ep->r_slot[r]);
        free(ep->r_row[r]);
        free(ep->r_tok[r]);
    }
    free(ep->s_req);
    free(ep->s_out);
    free(ep->s_rc);
    free(ep->s_msgs);
    free(ep->counts);
    free(ep);
}

/* ---- create ---- */

/* One bucket's lockstep step, captured from rank 0's stream with every other rank's forked from it. */
static int capture_bucket(struct ep_backend *ep, int B, cudaGraphExec_t *ret)
{
    const cudaStream_t s0 = rank_stream(ep->rank[0]);
    cudaGraph_t g;
    DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[0]));
    DSV4_CUDA_TRY(cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal));
    int rc = join_streams(ep, false);
    if (rc == 0)
        rc = lockstep_launches(ep, B, 0);
    if (rc == 0)
        rc = join_streams(ep, true);
    DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[0]));
    cudaError_t e = cudaStreamEndCapture(s0, &g);
    if (rc < 0)
        return rc;
    if (e != cudaSuccess)
        return dsv4_error_set(-EIO, "cuda: capturing the bucket-%d lockstep step of %d ranks: %s", B, ep->n,
                              cudaGetErrorString(e));
    e = cudaGraphInstantiate(ret, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return dsv4_error_set(-EIO, "cuda: instantiating the bucket-%d lockstep step: %s", B, cudaGetErrorString(e));
    ep->captures++;
    return 0;
}

/* The ranks booted, the launches once eagerly on padding rows (a whole prefill chunk, then the largest
 * bucket), the graphs captured, every device sealed. */
static int boot(struct ep_backend *ep, const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                const struct dsv4_cuda_switches *sw)
{
    const int n = ep->n, per = (opts->max_batch + n - 1) / n;
    struct dsv4_backend_opts ro = *opts;
    ro.n_gpus = 1;
    ro.ep_ranks = n;
    ro.max_batch = per;         /* every rank takes the same buckets, so that they step in lockstep */
    ro.spec_tokens = 0;
    ro.prefix_pool_bytes = 0;
    /* the experts see every rank's rows of a step at once */
    const int chunk = opts->prefill_chunk ? opts->prefill_chunk : DSV4_PREFILL_CHUNK_DEFAULT;
    ro.prefill_chunk = chunk * n > DSV4_CUDA_MAX_ROWS ? DSV4_CUDA_MAX_ROWS / n : chunk;
    if (ro.prefill_chunk < per)
        ro.prefill_chunk = per;
    for (int r = 0; r < n; r++) {
        ro.gpus[0] = ep->ordinal[r];
        ro.ep_rank = r;
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));     /* the kernels' attributes are set per device */
        STEP(dsv4_step_rank_create(w, &ro, sw, &ep->rank[r]));
        ep->g0[r + 1] = ep->g0[r] + dsv4_ep_slots(opts->max_batch, n, r);
        const size_t m = (size_t)per;
        ep->r_slot[r] = static_cast<int *>(calloc(m, sizeof(int)));
        ep->r_row[r] = static_cast<int *>(calloc(m, sizeof(int)));
        ep->r_tok[r] = static_cast<int32_t *>(calloc(m, sizeof(int32_t)));
        if (!ep->r_slot[r] || !ep->r_row[r] || !ep->r_tok[r])
            return dsv4_error_set(-ENOMEM, "cuda: expert-parallel row tables");
    }
    for (int a = 0; a < n; a++)     /* copies between GPUs go device to device where the pair allows */
        for (int b = 0; b < n; b++) {
            int can = 0;
            if (ep->ordinal[a] == ep->ordinal[b] || cudaDeviceCanAccessPeer(&can, ep->ordinal[a], ep->ordinal[b]) ||
                !can)
                continue;
            DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[a]));
            const cudaError_t e = cudaDeviceEnablePeerAccess(ep->ordinal[b], 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled)
                (void)cudaGetLastError();
            else if (e != cudaSuccess)
                return dsv4_error_set(-EIO, "cuda: peer access from device %d to %d: %s", ep->ordinal[a],
                                      ep->ordinal[b], cudaGetErrorString(e));
        }
    DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[0]));
    DSV4_CUDA_TRY(cudaEventCreateWithFlags(&ep->ev_fork, cudaEventDisableTiming));
    for (int r = 1; r < n; r++) {
        DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&ep->ev_join[r], cudaEventDisableTiming));
    }
    const struct cuda_backend *r0 = ep->rank[0];
    const int sizes[2] = { r0->rows, per };
    for (int k = r0->rows > per ? 0 : 1; k < 2; k++) {
        const int B = sizes[k];
        for (int r = 0; r < n; r++) {
            DSV4_CUDA_TRY(cudaSetDevice(ep->ordinal[r]));
            STEP(dsv4_step_rows_stage(ep->rank[r], 0, NULL, NULL, B));
        }
        STEP(lockstep_launches(ep, B, k == 0 ? B - 1 : 0));
        STEP(sync_ranks(ep));
    }
    ep->use_graphs = sw->graphs;
    for (int i = 0; ep->use_graphs && i < r0->n_buckets; i++)
        STEP(capture_bucket(ep, r0->buckets[i], &ep->graphs[i]));
    for (int r = 0; r < n; r++)
        dsv4_cuda_dev_seal(ep->rank[r]->dev);
    return 0;
}

static const struct dsv4_backend_ops ep_ops = {
    .name = "cuda",
    .prefill = op_prefill,
    .decode = op_decode,
    .sample = op_sample,
    .slot_reset = op_slot_reset,
    .slot_position = op_slot_position,
    .get_stats = op_get_stats,
    .destroy = op_destroy,
    .prefix_save = nullptr,     /* no prefix pool under expert parallelism yet */
    .prefix_load = nullptr,
    .routing_counts = op_routing_counts,
    .draft = nullptr,           /* nor speculation */
    .verify = nullptr,
    .accept = nullptr,
};

extern "C" int dsv4_cuda_ep_backend_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                                           struct dsv4_backend **ret)
{
    struct dsv4_cuda_switches sw;
    const struct dsv4_config *c = &w->cfg;
    const int n = opts->n_gpus, devices = dsv4_cuda_device_count();
    int rc;

    if (devices == 0)
        return -ENODEV;
    if (n < 1 || n > DSV4_EP_MAX_GPUS || n > c->n_experts)
        return dsv4_error_set(-EINVAL, "cuda: the routed experts split over %d GPUs: 1..%d, and at most the %d "
                              "experts of a layer", n, DSV4_EP_MAX_GPUS, c->n_experts);
    if (opts->max_batch < n)
        return dsv4_error_set(-EINVAL, "cuda: max_batch %d is fewer than the %d GPUs the slots are dealt over",
                              opts->max_batch, n);
    for (int r = 0; r < n; r++)
        if (opts->gpus[r] < 0 || opts->gpus[r] >= devices)
            return dsv4_error_set(-ENODEV, "cuda: device %d listed, %d present", opts->gpus[r], devices);
    if ((rc = dsv4_cuda_switches_read(&sw)) < 0)
        return rc;
    if (!sw.branches)
        return dsv4_error_set(-EINVAL, "cuda: expert parallelism needs the step's lanes (DSV4_CUDA_BRANCHES=0 is set)");
    struct ep_backend *ep = static_cast<struct ep_backend *>(calloc(1, sizeof(*ep)));
    if (!ep)
        return dsv4_error_set(-ENOMEM, "cuda: expert-parallel backend state");
    ep->n = n;
    memcpy(ep->ordinal, opts->gpus, sizeof(int) * n);
    ep->ops = ep_ops;
    if (!sw.sample)
        ep->ops.sample = nullptr;
    ep->base.ops = &ep->ops;
    ep->base.weights = w;
    ep->base.opts = *opts;
    ep->base.impl = ep;
    ep->base.slot_groups = n;
    const size_t M = (size_t)opts->max_batch;
    ep->s_req = static_cast<struct dsv4_backend_sample_req *>(calloc(M, sizeof(*ep->s_req)));
    ep->s_out = static_cast<struct dsv4_sample *>(calloc(M, sizeof(*ep->s_out)));
    ep->s_rc = static_cast<int *>(calloc(M, sizeof(int)));
    ep->s_msgs = static_cast<char *>(calloc(M, DSV4_BACKEND_MSG_MAX));
    ep->counts = static_cast<uint64_t *>(calloc((size_t)c->n_layers * c->n_experts, sizeof(uint64_t)));
    rc = !ep->s_req || !ep->s_out || !ep->s_rc || !ep->s_msgs || !ep->counts
             ? dsv4_error_set(-ENOMEM, "cuda: expert-parallel sampling tables")
             : boot(ep, w, opts, &sw);
    if (rc < 0) {
        op_destroy(&ep->base);
        return rc;
    }
    *ret = &ep->base;
    return 0;
}
