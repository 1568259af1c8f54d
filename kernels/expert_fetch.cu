/* SPDX-License-Identifier: MIT */
/* Host experts fetched ahead (decode steps with routed experts in pinned host memory).
 *
 * A host expert's bytes cross PCIe (~55 GB/s) while the rest of a layer streams HBM at ~4 TB/s, so at
 * batch 1 an expert read in place costs ~240 us against ~170 us for the whole of a Flash layer on the
 * GPU. The link is idle while the attention sublayer runs; this module fills that time. When a layer's
 * attention input xn is ready, a lane of its own predicts the layer's routing from it (the layer's
 * router on the attention input instead of the FFN input: the residual moves little in between; on
 * random Flash weights 74% of the routed experts are found) and copies the first predicted host
 * experts into device slots, chunk by chunk, while the main lane runs the attention. After the
 * router, the main lane's resolve stops the copy and points each routed slot expert's redirect entry
 * at the tiles already copied; the decode expert kernels read those from the slot and the rest in
 * place from host memory. Same bytes either way, so the same bits: only where they are read changes.
 *
 * Slots: DSV4_CUDA_FETCH_SLOTS per set, two sets (layer parity), so that layer l's copy never
 * overwrites what layer l - 1's expert kernels read; layer l + 2's copy starts after layer l's experts
 * on the main lane (its fork follows them). A chunk is one DSV4_CUDA_TILE_ROWS-row block of one
 * matrix with its scales, in k-tile blocks (the expert layout of dsv4_cuda_tile_fp4): chunks 2b and
 * 2b + 1 are block b of w1 and w3, chunk 2 (I / 32) + j is block j of w2, the order the gate/up and
 * down kernels read them. A chunk copied for the tag t (dsv4_cuda_fetch_tag: the step and the layer)
 * holds done[c] = t, published with release semantics after its bytes; resolve acquires the flags
 * before it reads which expert the slot holds. The step counter in the tag keeps an earlier step's
 * chunks from being taken for this one. */
#include <cuda_bf16.h>

#include "kernels/cuda_util.cuh"

#define FETCH_COPY_THREADS 512
#define FETCH_COPY_CTAS 8           /* 8 x 512 threads reach ~50 GB/s from host memory (the copy
                                     * engine: 55); more take SMs from the main lane for nothing */
#define FETCH_PREDICT_WARPS 8       /* experts a predict block scores, a warp each */
#define FETCH_RESOLVE_THREADS 256   /* a layer's resolve: one block over the slots' tiles and the pairs */

/* The chunk c of an expert: source and destination of its weights and scales, and their sizes. */
struct fetch_chunk {
    const uint8_t *w, *s;
    uint8_t *dw, *ds;
    int64_t wb, sb;
};

static __device__ fetch_chunk chunk_at(const struct dsv4_cuda_expert *src, const struct dsv4_cuda_expert *dst, int c,
                                       int up_blocks)
{
    const struct dsv4_cuda_linear *S, *D;
    int b;
    if (c < 2 * up_blocks) {
        S = c % 2 ? &src->w3 : &src->w1;
        D = c % 2 ? &dst->w3 : &dst->w1;
        b = c / 2;
    } else {
        S = &src->w2;
        D = &dst->w2;
        b = c - 2 * up_blocks;
    }
    const int64_t nk = S->in / DSV4_CUDA_TILE_KT;
    fetch_chunk k;
    k.wb = nk * DSV4_CUDA_TILE_BYTES;
    k.sb = nk * DSV4_CUDA_TILE_SCALE_BYTES;
    k.w = static_cast<const uint8_t *>(S->w) + b * k.wb;
    k.s = S->scale + b * k.sb;
    k.dw = static_cast<uint8_t *>(const_cast<void *>(D->w)) + b * k.wb;
    k.ds = const_cast<uint8_t *>(D->scale) + b * k.sb;
    return k;
}

/* n bytes (a multiple of 16, 16-byte aligned) from src to dst by the whole block, 8 loads in flight a
 * thread: PCIe reads take microseconds, so the block keeps FETCH_COPY_THREADS x 128 bytes asking. */
static __device__ __forceinline__ void copy_bytes(uint8_t *dst, const uint8_t *src, int64_t n)
{
    const uint4 *s = reinterpret_cast<const uint4 *>(src);
    uint4 *d = reinterpret_cast<uint4 *>(dst);
    const int64_t n16 = n / 16;
    for (int64_t i = threadIdx.x; i < n16; i += 8 * FETCH_COPY_THREADS) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i + u * FETCH_COPY_THREADS < n16)
                v[u] = s[i + u * FETCH_COPY_THREADS];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i + u * FETCH_COPY_THREADS < n16)
                d[i + u * FETCH_COPY_THREADS] = v[u];
    }
}

/* The step counter, once per step before any fetch of it (one thread). */
__global__ void fetch_step_kernel(uint64_t *step)
{
    dsv4_pdl_enter();
    *step += 1;
}

/* logits [B, E] = gate [E, D] (bf16) . xn [B, D], B <= DSV4_CUDA_FETCH_ROWS_MAX: a warp per expert,
 * each lane 8 values of the row at a time (one 16-byte load, four iterations unrolled) against every
 * row of x, so the gate row is read once. Only a prediction reads the logits (which experts to copy),
 * so f32 sums in any order will do. */
__global__ void __launch_bounds__(FETCH_PREDICT_WARPS * DSV4_CUDA_WARP)
fetch_predict_kernel(const __nv_bfloat16 *__restrict__ gate, int64_t ldg, const float *__restrict__ xn, int B, int D,
                     int E, float *__restrict__ logits)
{
    dsv4_pdl_enter();
    const int e = blockIdx.x * FETCH_PREDICT_WARPS + threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    if (e >= E)
        return;
    const __nv_bfloat16 *g = gate + (int64_t)e * ldg;
    float acc[DSV4_CUDA_FETCH_ROWS_MAX] = {};
#pragma unroll 4
    for (int i = lane * 8; i < D; i += 8 * DSV4_CUDA_WARP) {
        const uint4 w = *reinterpret_cast<const uint4 *>(g + i);
        const __nv_bfloat162 *w2 = reinterpret_cast<const __nv_bfloat162 *>(&w);
        float wf[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __bfloat1622float2(w2[j]);
            wf[2 * j] = f.x;
            wf[2 * j + 1] = f.y;
        }
#pragma unroll
        for (int b = 0; b < DSV4_CUDA_FETCH_ROWS_MAX; b++) {
            if (b >= B)
                break;
            const float4 x0 = *reinterpret_cast<const float4 *>(xn + (int64_t)b * D + i);
            const float4 x1 = *reinterpret_cast<const float4 *>(xn + (int64_t)b * D + i + 4);
            acc[b] += wf[0] * x0.x + wf[1] * x0.y + wf[2] * x0.z + wf[3] * x0.w + wf[4] * x1.x + wf[5] * x1.y +
                      wf[6] * x1.z + wf[7] * x1.w;
        }
    }
#pragma unroll
    for (int b = 0; b < DSV4_CUDA_FETCH_ROWS_MAX; b++) {
        if (b >= B)
            break;
        const float v = dsv4_warp_sum(acc[b]);
        if (lane == 0)
            logits[(int64_t)b * E + e] = v;
    }
}

/* One thread: the predicted host experts of the layer, by choice rank then row, the first
 * DSV4_CUDA_FETCH_SLOTS of them into the set's slots (-1: an empty slot). */
__global__ void fetch_pick_kernel(const int32_t *__restrict__ pidx, int B, int K, const uint8_t *__restrict__ on_host,
                                  int E, struct dsv4_cuda_fetch_slot *set)
{
    dsv4_pdl_enter();
    int n = 0, pick[DSV4_CUDA_FETCH_SLOTS];
    for (int k = 0; k < K && n < DSV4_CUDA_FETCH_SLOTS; k++)
        for (int b = 0; b < B && n < DSV4_CUDA_FETCH_SLOTS; b++) {
            const int e = pidx[b * K + k];
            bool dup = false;
            for (int j = 0; j < n; j++)
                dup |= pick[j] == e;
            if (e >= 0 && e < E && on_host[e] && !dup)
                pick[n++] = e;
        }
    for (int s = 0; s < DSV4_CUDA_FETCH_SLOTS; s++)
        set[s].expert = s < n ? pick[s] : -1;
}

/* FETCH_COPY_CTAS blocks walk the chunks of the set's slots in order (slot 0's first: its expert is the
 * likelier), each chunk published once its bytes are written; a block stops at its next chunk once
 * the layer's resolve has cancelled the tag. */
__global__ void __launch_bounds__(FETCH_COPY_THREADS)
fetch_copy_kernel(const struct dsv4_cuda_expert *__restrict__ table, struct dsv4_cuda_fetch_slot *set,
                  const uint64_t *step, int layer, int chunks, int up_blocks, unsigned long long *copied)
{
    dsv4_pdl_enter();
    __shared__ bool stop;
    const uint64_t tag = dsv4_cuda_fetch_tag(*step, layer);
    for (int s = 0; s < DSV4_CUDA_FETCH_SLOTS; s++) {
        const int e = set[s].expert;
        if (e < 0)
            continue;
        for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
            if (threadIdx.x == 0)
                stop = *reinterpret_cast<volatile const uint64_t *>(&set[s].cancel) == tag;
            __syncthreads();
            if (stop)
                return;
            const fetch_chunk k = chunk_at(&table[e], &set[s].ex, c, up_blocks);
            copy_bytes(k.dw, k.w, k.wb);
            copy_bytes(k.ds, k.s, k.sb);
            __syncthreads();        /* every thread's stores of the chunk before its flag */
            if (threadIdx.x == 0) {
                __threadfence();
                asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(set[s].done + c), "l"(tag) : "memory");
                atomicAdd(copied, (unsigned long long)(k.wb + k.sb));
            }
        }
    }
}

/* The main lane, after the layer's router (idx [pairs]): every copy of this tag stops at its next
 * chunk, then the redirect entries this layer set last time are cleared and each routed slot expert's
 * entry names the tiles whose chunks all hold the tag. Flags are acquired before the slot's expert is
 * read (past the barrier): a chunk copied for this tag means the pick of this tag wrote that expert. */
__global__ void __launch_bounds__(FETCH_RESOLVE_THREADS)
fetch_resolve_kernel(const struct dsv4_cuda_fetch f, int layer, const int32_t *__restrict__ idx, int pairs)
{
    constexpr int W = DSV4_CUDA_FETCH_TILES_MAX / 64, S = DSV4_CUDA_FETCH_SLOTS;
    __shared__ unsigned long long up[S][W], down[S][W];
    __shared__ int expert[S];
    __shared__ bool routed[S];
    dsv4_pdl_enter();
    const int tid = threadIdx.x;
    const uint64_t tag = dsv4_cuda_fetch_tag(*f.step, layer);
    struct dsv4_cuda_fetch_slot *set = dsv4_cuda_fetch_set(&f, layer);
    struct dsv4_cuda_fetch_redirect *red = f.redirect + (int64_t)layer * f.n_experts;
    int32_t *was = f.redirected + (int64_t)layer * S;

    if (tid < S) {
        *reinterpret_cast<volatile uint64_t *>(&set[tid].cancel) = tag;
        const int e = was[tid];
        if (e >= 0)
            for (int i = 0; i < W; i++)
                red[e].up[i] = red[e].down[i] = 0;
        was[tid] = -1;
        routed[tid] = false;
    }
    for (int i = tid; i < S * W; i += blockDim.x) {
        up[i / W][i % W] = 0;
        down[i / W][i % W] = 0;
    }
    __syncthreads();
    /* tile t of gate_up reads block t utb .. of w1 and w3 (chunks 2b, 2b + 1); of down, blocks of w2 */
    for (int i = tid; i < S * (f.up_tiles + f.down_tiles); i += blockDim.x) {
        const int sl = i / (f.up_tiles + f.down_tiles), t = i % (f.up_tiles + f.down_tiles);
        const bool is_up = t < f.up_tiles;
        const int tt = is_up ? t : t - f.up_tiles;
        const int c0 = is_up ? 2 * tt * f.up_tile_blocks : 2 * f.up_blocks + tt * f.down_tile_blocks;
        const int n = is_up ? 2 * f.up_tile_blocks : f.down_tile_blocks;
        bool ok = true;
        for (int c = c0; c < c0 + n; c++) {
            uint64_t v;
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(set[sl].done + c) : "memory");
            ok &= v == tag;
        }
        if (ok)
            atomicOr(is_up ? &up[sl][tt / 64] : &down[sl][tt / 64], 1ull << (tt % 64));
    }
    __syncthreads();
    if (tid < S)
        expert[tid] = *reinterpret_cast<volatile const int32_t *>(&set[tid].expert);
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x)
        for (int sl = 0; sl < S; sl++)
            if (expert[sl] >= 0 && idx[p] == expert[sl])
                routed[sl] = true;
    __syncthreads();
    if (tid < S && routed[tid]) {
        const int e = expert[tid];
        const struct dsv4_cuda_expert *x = &set[tid].ex;
        unsigned long long n_up = 0, n_down = 0;
        for (int i = 0; i < W; i++) {
            red[e].up[i] = up[tid][i];
            red[e].down[i] = down[tid][i];
            n_up += __popcll(up[tid][i]);
            n_down += __popcll(down[tid][i]);
        }
        red[e].w[0] = x->w1.w;
        red[e].w[1] = x->w3.w;
        red[e].w[2] = x->w2.w;
        red[e].s[0] = x->w1.scale;
        red[e].s[1] = x->w3.scale;
        red[e].s[2] = x->w2.scale;
        was[tid] = e;
        const unsigned long long blk = DSV4_CUDA_TILE_BYTES + DSV4_CUDA_TILE_SCALE_BYTES;
        atomicAdd(f.counters + 1, n_up * 2 * f.up_tile_blocks * (x->w1.in / DSV4_CUDA_TILE_KT) * blk +
                                      n_down * f.down_tile_blocks * (x->w2.in / DSV4_CUDA_TILE_KT) * blk);
    }
}

static int check_layer(const struct dsv4_cuda_fetch *f, int layer)
{
    if (!f || layer < 0 || layer >= f->n_layers)
        return dsv4_error_set(-EINVAL, "cuda fetch: layer %d of %d", layer, f ? f->n_layers : 0);
    return 0;
}

extern "C" int dsv4_cuda_fetch_step(const struct dsv4_cuda_fetch *f, void *stream)
{
    dsv4_launch(fetch_step_kernel, dim3(1), dim3(1), 0, static_cast<cudaStream_t>(stream), f->step);
    DSV4_CUDA_LAUNCHED("fetch_step");
    return 0;
}

extern "C" int dsv4_cuda_fetch_predict(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_linear *gate,
                                       const float *d_xn, int B, float *d_logits, void *stream)
{
    const int rc = check_layer(f, layer);
    if (rc < 0)
        return rc;
    if (gate->fmt != DSV4_W_BF16 || gate->out != f->n_experts || gate->in % 8 || gate->row_stride % 8 || B < 1 ||
        B > f->rows)
        return dsv4_error_set(-EINVAL, "cuda fetch: the router of layer %d is not a BF16 [%d, D] linear with D a "
                              "multiple of 8, or %d rows (1..%d)", layer, f->n_experts, B, f->rows);
    dsv4_launch(fetch_predict_kernel, dim3((f->n_experts + FETCH_PREDICT_WARPS - 1) / FETCH_PREDICT_WARPS),
                dim3(FETCH_PREDICT_WARPS * DSV4_CUDA_WARP), 0, static_cast<cudaStream_t>(stream),
                static_cast<const __nv_bfloat16 *>(gate->w), gate->row_stride, d_xn, B, (int)gate->in,
                f->n_experts, d_logits);
    DSV4_CUDA_LAUNCHED("fetch_predict");
    return 0;
}

extern "C" int dsv4_cuda_fetch_copy(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_experts *ex,
                                    const int32_t *d_pidx, int B, int K, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int rc = check_layer(f, layer);
    if (rc < 0)
        return rc;
    if (B < 1 || B > f->rows || K < 1 || K > DSV4_MAX_TOPK || !ex->tiled)
        return dsv4_error_set(-EINVAL, "cuda fetch: %d rows (1..%d) of top-%d (1..%d) from layer %d%s", B, f->rows, K,
                              DSV4_MAX_TOPK, layer, ex->tiled ? "" : ", whose experts are not in k-tile blocks");
    struct dsv4_cuda_fetch_slot *set = dsv4_cuda_fetch_set(f, layer);
    dsv4_launch(fetch_pick_kernel, dim3(1), dim3(1), 0, s, d_pidx, B, K, f->on_host + (int64_t)layer * f->n_experts,
                f->n_experts, set);
    DSV4_CUDA_LAUNCHED("fetch_pick");
    dsv4_launch(fetch_copy_kernel, dim3(FETCH_COPY_CTAS), dim3(FETCH_COPY_THREADS), 0, s, ex->d_table, set,
                (const uint64_t *)f->step, layer, f->chunks, f->up_blocks, f->counters);
    DSV4_CUDA_LAUNCHED("fetch_copy");
    return 0;
}

extern "C" int dsv4_cuda_fetch_resolve(const struct dsv4_cuda_fetch *f, int layer, const int32_t *d_idx, int B, int K,
                                       void *stream)
{
    const int rc = check_layer(f, layer);
    if (rc < 0)
        return rc;
    if (B < 1 || B > f->rows || K < 1 || K > DSV4_MAX_TOPK)
        return dsv4_error_set(-EINVAL, "cuda fetch: resolving %d rows (1..%d) of top-%d (1..%d)", B, f->rows, K,
                              DSV4_MAX_TOPK);
    dsv4_launch(fetch_resolve_kernel, dim3(1), dim3(FETCH_RESOLVE_THREADS), 0, static_cast<cudaStream_t>(stream), *f,
                layer, d_idx, B * K);
    DSV4_CUDA_LAUNCHED("fetch_resolve");
    return 0;
}
