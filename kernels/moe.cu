/* SPDX-License-Identifier: MIT */
/* MoE on the device: router (sqrtsoftplus, biased top-k or hash table), routed experts grouped by
 * expert over the batch with the SwiGLU clamp fused, the weighted combine, and the elementwise
 * SwiGLU of the shared expert. Twins: dsv4_twin_router, dsv4_twin_expert.
 *
 * Experts run in five launches with grids fixed by the shapes, batch and topk (graph-capturable):
 *   prep     block 0 sorts the batch*topk (token, expert) pairs by expert, stable by pair; for the
 *            tensor-core path the other blocks write x as bf16 MMA operands;
 *   gate_up  FP4 with fp8 numerics: bf16 MMAs, CTA (64 weight rows = 32 rows of I of w1 and of w3,
 *            group), the clamped SwiGLU in registers (see "tensor-core path" below; prefill chunks
 *            on sm_90a take moe_wgmma.cu's warpgroup-MMA kernels, the same bits); otherwise
 *            block (group, 8 rows of I), warps reading w1 and w3 rows once per 8 tokens;
 *   quant    (fp8 numerics) the SwiGLU output goes through the 1x128 e4m3 activation quantizer
 *            (in place into bf16 operands on the tensor-core path);
 *   down     over w2, CTA (64 rows of D, group) on tensor cores, else block (group, 8 rows of D);
 *   combine  y[b] = sum_j w[b,j] out[b*topk+j] in j order, so a row's result never depends on the
 *            rest of the batch. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_util.cuh"
#include "kernels/mma.cuh"
#include "kernels/moe_tile.cuh"
#include "kernels/pending.cuh"
#include "kernels/route_score.cuh"
#include "kernels/switches.h"

#define MOE_ROWS 8              /* warps (weight rows) per block */
#define MOE_NB 8                /* tokens per pass over a weight row */
#define MOE_MAX_EXPERTS 1024    /* router and grouping keep per-expert arrays in shared memory */
#define ROUTER_THREADS_PENDING 256   /* a token's scores from pending logits (sums over up to 32 splits):
                                     * one logit a thread; else one warp reads them */

/* One block per token (a warp, or ROUTER_THREADS_PENDING threads for pending logits). Shared: scores
 * [E], selection values [E], made by the whole block; then warp 0 chooses. Lane j keeps the j-th choice
 * in a register and writes its index and weight: nothing is read back from global memory (a serial
 * round trip per choice was most of this kernel's time at batch 1). */
__global__ void __launch_bounds__(ROUTER_THREADS_PENDING)
router_kernel(const float *__restrict__ logits, const dsv4_cuda_pending pl, int n_experts, int topk,
              const float *__restrict__ bias, const int32_t *__restrict__ tid2eid,
              const int32_t *__restrict__ tokens, float route_scale, int32_t *__restrict__ idx,
              float *__restrict__ w)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    float *score = sm, *sel = sm + n_experts;
    const int b = blockIdx.x, lane = threadIdx.x;
    float sum = 0.0f;
    int mine = -1;          /* lane j < topk: choice j */

    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
        score[e] = dsv4_route_score(pending_at(pl, logits, (int64_t)b * n_experts + e));
        sel[e] = score[e] + (bias ? bias[e] : 0.0f);
    }
    __syncthreads();
    if (threadIdx.x >= DSV4_CUDA_WARP)
        return;
    for (int j = 0; j < topk; j++) {
        int best;
        if (tid2eid) {
            best = tid2eid[(int64_t)tokens[b] * topk + j];
        } else {
            float bv = -INFINITY;
            best = n_experts;
            for (int e = lane; e < n_experts; e += DSV4_CUDA_WARP)
                if (sel[e] > bv) {      /* lanes scan ascending: ties keep the lower index */
                    bv = sel[e];
                    best = e;
                }
            for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oe = __shfl_xor_sync(0xffffffffu, best, o);
                if (ov > bv || (ov == bv && oe < best)) {
                    bv = ov;
                    best = oe;
                }
            }
            __syncwarp();
            if (lane == 0 && best < n_experts)
                sel[best] = -INFINITY;
            __syncwarp();
        }
        if (best < 0 || best >= n_experts)
            best = -1;      /* NaN scores or a bad table entry: the pair is skipped downstream */
        if (lane == j)
            mine = best;
        sum += best >= 0 ? score[best] : 0.0f;      /* every lane: the same sum in the same order */
    }
    if (lane < topk) {
        idx[(int64_t)b * topk + lane] = mine;
        w[(int64_t)b * topk + lane] = mine >= 0 ? score[mine] / (sum + 1e-20f) * route_scale : 0.0f;
    }
}

extern "C" int dsv4_cuda_router(const float *d_logits, const struct dsv4_cuda_pending *d_plogits, int batch,
                                int n_experts, int topk, const float *d_bias, const int32_t *d_tid2eid,
                                const int32_t *d_tokens, float route_scale, int32_t *d_idx, float *d_w, void *stream)
{
    int rc;
    if (n_experts < 1 || n_experts > MOE_MAX_EXPERTS || topk < 1 || topk > DSV4_MAX_TOPK || topk > n_experts)
        return dsv4_error_set(-EINVAL, "router: %d experts (max %d), top-%d (max %d)", n_experts,
                              MOE_MAX_EXPERTS, topk, DSV4_MAX_TOPK);
    if (d_tid2eid && !d_tokens)
        return dsv4_error_set(-EINVAL, "router: hash routing needs the batch's token ids");
    if ((rc = dsv4_cuda_pending_live(d_plogits, batch, n_experts, "router")) < 0)
        return rc;
    if (batch < 1)
        return 0;
    const int threads = d_plogits && d_plogits->splits ? ROUTER_THREADS_PENDING : DSV4_CUDA_WARP;
    dsv4_launch(router_kernel, batch, threads, 2 * n_experts * sizeof(float), static_cast<cudaStream_t>(stream),
                d_logits, pending_or_none(d_plogits), n_experts, topk, d_bias, d_tid2eid, d_tokens, route_scale, d_idx,
                d_w);
    DSV4_CUDA_LAUNCHED("router");
    return 0;
}

/* ---- grouping, and the activations in bf16 for the tensor-core path ---- */

/* groups layout (int32, P = pairs): [0] group count G; [1 + g] expert of group g, ascending;
 * [1 + P + g] start of group g in the pair list (G + 1 entries); [2 + 2P + i] pair list, the pairs
 * of one expert in pair order. Pairs naming no valid expert join no group; combine skips them. */
#define MOE_PREP_THREADS 256

static __device__ __forceinline__ bool moe_valid(int e, int n_experts)
{
    return e >= 0 && e < n_experts;
}

/* Block 0 of moe_prep_kernel: per-expert counts (integer atomics: the same counts in any order),
 * group starts from a scan over 32 lanes, then warp 0 places the pairs 32 at a time, each ranked
 * among the equal experts of its chunk by __match_any_sync, which keeps pair order within a group.
 * The expert ids are read from idx twice rather than staged in shared memory, so a prefill chunk's
 * pairs (up to DSV4_CUDA_MAX_ROWS x top-k) need no pair-sized buffer. */
static __device__ __forceinline__ int moe_eid(const int32_t *__restrict__ idx, int p, int n_experts)
{
    return moe_valid(idx[p], n_experts) ? idx[p] : -1;
}

static __device__ void moe_group(const int32_t *__restrict__ idx, int pairs, int n_experts, int32_t *__restrict__ groups)
{
    __shared__ int32_t pos[MOE_MAX_EXPERTS];    /* count, then the next free list slot, per expert */
    int32_t *expert = groups + 1, *start = groups + 1 + pairs, *list = groups + 2 + 2 * pairs;
    const int tid = threadIdx.x, lane = tid % DSV4_CUDA_WARP;
    const unsigned full = 0xffffffffu;

    for (int e = tid; e < n_experts; e += blockDim.x)
        pos[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x) {
        const int e = moe_eid(idx, p, n_experts);
        if (e >= 0)
            atomicAdd(&pos[e], 1);
    }
    __syncthreads();
    if (tid >= DSV4_CUDA_WARP)
        return;
    /* lane l owns experts [lo, hi): its pair and group totals, scanned across the warp */
    const int per = (n_experts + DSV4_CUDA_WARP - 1) / DSV4_CUDA_WARP;
    const int lo = min(n_experts, lane * per), hi = min(n_experts, lo + per);
    int mine = 0, mine_g = 0, off, ng;
    for (int e = lo; e < hi; e++) {
        mine += pos[e];
        mine_g += pos[e] > 0;
    }
    off = mine;
    ng = mine_g;
    for (int o = 1; o < DSV4_CUDA_WARP; o <<= 1) {
        const int a = __shfl_up_sync(full, off, o), b = __shfl_up_sync(full, ng, o);
        if (lane >= o) {
            off += a;
            ng += b;
        }
    }
    off -= mine;
    ng -= mine_g;
    for (int e = lo; e < hi; e++) {
        const int c = pos[e];
        pos[e] = off;
        if (c) {
            expert[ng] = e;
            start[ng++] = off;
            off += c;
        }
    }
    if (lane == DSV4_CUDA_WARP - 1) {
        start[ng] = off;
        groups[0] = ng;
    }
    __syncwarp();
    for (int p0 = 0; p0 < pairs; p0 += DSV4_CUDA_WARP) {
        const int p = p0 + lane, e = p < pairs ? moe_eid(idx, p, n_experts) : -1;
        const bool ok = e >= 0;
        const unsigned same = __match_any_sync(full, e);
        const int rank = __popc(same & ((1u << lane) - 1u));
        if (ok)
            list[pos[e] + rank] = p;
        __syncwarp();
        if (ok && rank == 0)
            pos[e] += __popc(same);
        __syncwarp();
    }
}

/* grid 1 + ceil(n8 / MOE_PREP_THREADS): block 0 groups the pairs; the others write x [batch, D]
 * (already FP8-rounded) as bf16 operands xa in the order of the kernels that read them (wg: the wgmma
 * kernels), 8 values a thread (n8 = batch * D / 8; 0 = none). */
__global__ void __launch_bounds__(MOE_PREP_THREADS)
moe_prep_kernel(const int32_t *__restrict__ idx, int pairs, int n_experts, int32_t *__restrict__ groups,
                const float *__restrict__ x, int64_t n8, bool wg, uint32_t *__restrict__ xa)
{
    dsv4_pdl_enter();
    if (blockIdx.x == 0) {
        moe_group(idx, pairs, n_experts, groups);
        return;
    }
    const int64_t q = (int64_t)(blockIdx.x - 1) * blockDim.x + threadIdx.x;
    if (q >= n8)
        return;
    const float4 a = reinterpret_cast<const float4 *>(x)[2 * q], b = reinterpret_cast<const float4 *>(x)[2 * q + 1];
    const float v[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
    moe_store_operand(xa, q, bf16x8_operand(v), wg);
}

/* ---- FMA path: F32/BF16/FP8 experts, and FP4 without activation quantization ---- */

/* NW weight rows [K] (one format) against up to MOE_NB activation rows: a lane covers 16 weight
 * bytes a step; acc[r][t] ends warp-reduced in every lane. */
template <typename WF, int NW>
static __device__ __forceinline__ void rows_dot(const struct dsv4_cuda_linear *const (&W)[NW], int64_t row,
                                                const float *const (&xr)[MOE_NB], int nt, float (&acc)[NW][MOE_NB])
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    const uint8_t *wrow[NW];
#pragma unroll
    for (int r = 0; r < NW; r++) {
        wrow[r] = static_cast<const uint8_t *>(W[r]->w) + row * wrow_bytes<WF>(W[r]->row_stride);
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            acc[r][t] = 0.0f;
    }
    const int64_t K = W[0]->in;
    for (int64_t k = (int64_t)lane * WF::vals; k < K; k += (int64_t)DSV4_CUDA_WARP * WF::vals) {
        uint4 wv[NW];
        float s[NW];
#pragma unroll
        for (int r = 0; r < NW; r++) {
            wv[r] = __ldg(reinterpret_cast<const uint4 *>(wrow[r] + k / WF::vals * 16));
            s[r] = wscale<WF>(*W[r], row, k);
        }
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            if (t < nt)
#pragma unroll
                for (int r = 0; r < NW; r++)
                    acc[r][t] += s[r] * wdot<WF>::dot(wv[r], xr[t] + k);
    }
#pragma unroll
    for (int r = 0; r < NW; r++)
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            acc[r][t] = dsv4_warp_sum(acc[r][t]);
}

/* grid (pairs, ceil(I / MOE_ROWS)): h[pair, i] = swiglu(w1_e[i] . x_tok, w3_e[i] . x_tok). */
template <typename WF>
__global__ void __launch_bounds__(MOE_ROWS * DSV4_CUDA_WARP)
moe_gate_up_kernel(const struct dsv4_cuda_experts ex, const float *__restrict__ x, int topk, int pairs,
                   const int32_t *__restrict__ groups, float *__restrict__ h)
{
    dsv4_pdl_enter();
    const int g = blockIdx.x, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int64_t i = (int64_t)blockIdx.y * MOE_ROWS + threadIdx.x / DSV4_CUDA_WARP;
    if (g >= groups[0] || i >= ex.inter)
        return;
    const struct dsv4_cuda_expert *e = &ex.d_table[groups[1 + g]];
    const int beg = groups[1 + pairs + g], end = groups[2 + pairs + g];
    const int32_t *list = groups + 2 + 2 * pairs;
    const struct dsv4_cuda_linear *const W[2] = { &e->w1, &e->w3 };

    for (int t0 = beg; t0 < end; t0 += MOE_NB) {
        const int nt = min(MOE_NB, end - t0);
        const float *xr[MOE_NB];
        float acc[2][MOE_NB];
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            xr[t] = x + (int64_t)(list[t0 + min(t, nt - 1)] / topk) * ex.dim;
        rows_dot<WF, 2>(W, i, xr, nt, acc);
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            if (lane == 0 && t < nt)
                h[(int64_t)list[t0 + t] * ex.inter + i] = swiglu(acc[0][t], acc[1][t], ex.swiglu_limit);
    }
}

/* grid (pairs, ceil(D / MOE_ROWS)): out[pair, d] = w2_e[d] . h[pair]. */
template <typename WF>
__global__ void __launch_bounds__(MOE_ROWS * DSV4_CUDA_WARP)
moe_down_kernel(const struct dsv4_cuda_experts ex, const float *__restrict__ h, int pairs,
                const int32_t *__restrict__ groups, float *__restrict__ out)
{
    dsv4_pdl_enter();
    const int g = blockIdx.x, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int64_t d = (int64_t)blockIdx.y * MOE_ROWS + threadIdx.x / DSV4_CUDA_WARP;
    if (g >= groups[0] || d >= ex.dim)
        return;
    const struct dsv4_cuda_expert *e = &ex.d_table[groups[1 + g]];
    const int beg = groups[1 + pairs + g], end = groups[2 + pairs + g];
    const int32_t *list = groups + 2 + 2 * pairs;
    const struct dsv4_cuda_linear *const W[1] = { &e->w2 };

    for (int t0 = beg; t0 < end; t0 += MOE_NB) {
        const int nt = min(MOE_NB, end - t0);
        const float *hr[MOE_NB];
        float acc[1][MOE_NB];
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            hr[t] = h + (int64_t)list[t0 + min(t, nt - 1)] * ex.inter;
        rows_dot<WF, 1>(W, d, hr, nt, acc);
#pragma unroll
        for (int t = 0; t < MOE_NB; t++)
            if (lane == 0 && t < nt)
                out[(int64_t)list[t0 + t] * ex.dim + d] = acc[0][t];
    }
}

template <typename WF>
static int launch_experts_fma(const struct dsv4_cuda_experts *ex, const float *d_x, int topk, int pairs,
                              const struct dsv4_cuda_moe_ws *ws, cudaStream_t s, void *stream)
{
    dsv4_launch(moe_gate_up_kernel<WF>, dim3(pairs, (ex->inter + MOE_ROWS - 1) / MOE_ROWS), MOE_ROWS * DSV4_CUDA_WARP,
                0, s, *ex, d_x, topk, pairs, ws->d_groups, ws->d_h);
    DSV4_CUDA_LAUNCHED("moe_gate_up");
    if (ex->quant_act) {
        int rc = dsv4_cuda_fp8_roundtrip(ws->d_h, pairs, ex->inter, DSV4_CUDA_ACT_BLOCK, ws->d_h, stream);
        if (rc < 0)
            return rc;
    }
    dsv4_launch(moe_down_kernel<WF>, dim3(pairs, (ex->dim + MOE_ROWS - 1) / MOE_ROWS), MOE_ROWS * DSV4_CUDA_WARP, 0, s,
                *ex, ws->d_h, pairs, ws->d_groups, ws->d_out);
    DSV4_CUDA_LAUNCHED("moe_down");
    return 0;
}

/* ---- tensor-core path: FP4 experts with fp8 numerics ----
 *
 * Operands. The activations entering w1/w3 are e4m3 x a power-of-two scale (the caller rounded x
 * through the 1x128 quantizer), as are the SwiGLU outputs entering w2 after moe_quant_kernel: exact
 * in bf16. An FP4 weight e2m1 x UE8M0 is exact in bf16 too. So m16n8k16 bf16 MMAs with f32
 * accumulation form exact products and f32 sums: the twin's arithmetic up to summation order.
 *
 * Decoding e2m1 (no hardware convert before sm_100): a nibble s|e1 e0|m moved to bf16 bits 15|8 7|6
 * is the value x 2^-126 (e = 0 lands on the bf16 subnormals 0 and 2^-127, which bf16 multiplies keep),
 * so one bf16x2 multiply by 2^126 x scale = 2^(s - 1) decodes two values and applies their scale
 * exactly, for UE8M0 s <= 128 (scale <= 2); larger scales take a second multiply by 2^(s - 128).
 * The decoder pairs nibbles (3, 7), (2, 6), (1, 5), (0, 4) of each 32-bit word; the activations are
 * stored in that order (bf16x8_operand), so MMA fragments come straight from 16-byte loads. Row-major
 * weights (the checkpoint's nibbles) take 15 integer operations a word before the 4 multiplies (sm_90a
 * SASS); tiled weights have each word's bits moved at boot (fp4_tile_word) so that they take 9.
 *
 * Fragment trick (as kernels/gemm.cu): a dot product does not care in which order k runs, so each
 * thread takes 16 contiguous weight bytes of its row (32 values, one scale block) per k-tile and
 * feeds them to 8 consecutive MMAs as if they were the k indices the PTX fragment layout names; its
 * activation loads cover the same 32 values of its token row.
 *
 * Layout. A CTA of W warps owns 16 W weight rows (one m16 tile a warp) of one group's expert and all
 * of the group's tokens (up to 64 a pass, n8 tiles; beyond that, further passes). Decode steps take
 * CTAs of 4 warps (64 rows), prefill chunks CTAs of 8 (128 rows): a chunk's groups hold tens of
 * tokens, whose activation tile (256 bytes a token a k-tile) outweighs the 64 rows' weights (68
 * bytes a row), so twice the rows a CTA halve the activation bytes moved from L2. A warp's own
 * arithmetic does not depend on W: the same bits either way. gate_up interleaves
 * w1 and w3: a warp's fragment rows g are w1 row i and rows g + 8 are w3 row i, so each thread holds
 * gate and up of the same (i, token) and applies the clamped SwiGLU in registers. k-tiles of 128
 * values (a thread's 32, four threads a quad) move through a cp.async ring in shared memory: 64 rows
 * x 64 weight bytes, 64 x 4 scale bytes, tokens x 256 activation bytes (swizzled so the fragment
 * loads are conflict-free). The ring is 2..7 stages deep, as many as fit its budget (47 KB for 4
 * warps, 96 KB for 8) for the pass's n8 tile count. Grid (output rows / CTA rows, min(pairs, E)) is
 * fixed by the shapes and batch; CTAs past the group count exit. Every output is one CTA's
 * fixed-order sum: batch-invariant, no atomics.
 * Weight rows must start on 16 bytes and scale rows on 4 (device.cu uploads rows contiguously from
 * 256-byte carve-outs; K is a multiple of 128). */
#define MOE_TC_WARPS 4                          /* warps a CTA in decode steps */
#define MOE_TC_PF_WARPS 8                       /* warps a CTA in prefill chunks */
#define MOE_TC_MAX_INTER 8192                   /* moe_quant_kernel: one thread per 8 values of a row */

/* A CTA of `warps` warps: its ring budget (4 warps: static shared memory, the pass tables taking the
 * rest of 48 KB, 4 CTAs an SM; 8 warps: dynamic, 2 CTAs an SM, within the 99 KB a block of
 * sm_86/89/120 may opt in to) and CTAs an SM (both 128 registers a thread at most). */
static __host__ __device__ constexpr int tc_budget(int warps) { return warps == MOE_TC_WARPS ? 47 * 1024 : 96 * 1024; }
static __host__ __device__ constexpr int tc_ctas_per_sm(int warps) { return warps == MOE_TC_WARPS ? 4 : 2; }

static __host__ __device__ constexpr int tc_stage_bytes(int nt, int warps)
{
    return tc_rows(warps) * MOE_TC_WROW + tc_rows(warps) * 4 + nt * 8 * MOE_TC_XROW;
}

static __host__ __device__ constexpr int tc_stages(int nt, int warps)
{
    return tc_budget(warps) / tc_stage_bytes(nt, warps) < MOE_TC_MAX_STAGES ? tc_budget(warps) / tc_stage_bytes(nt, warps)
                                                                             : MOE_TC_MAX_STAGES;
}

static __host__ __device__ constexpr int cmax(int a, int b)
{
    return a > b ? a : b;
}

/* the ring of one pass shape (NT n8 tiles) */
static __host__ __device__ constexpr int tc_pass_ring(int nt, int warps)
{
    return tc_stages(nt, warps) * tc_stage_bytes(nt, warps);
}

/* the ring of the widest pass a kernel compiles: the largest of its pass shapes 1, 2, 4 .. MAXNT */
static __host__ __device__ constexpr int tc_ring_bytes(int maxnt, int warps)
{
    return maxnt == 1 ? tc_pass_ring(1, warps) : cmax(tc_pass_ring(maxnt, warps), tc_ring_bytes(maxnt / 2, warps));
}

/* decode steps (MAXNT 1, every group in passes of 8 tokens) on CTAs of 4 warps, prefill on 8 */
static __host__ __device__ constexpr int tc_warps(int maxnt)
{
    return maxnt == 1 ? MOE_TC_WARPS : MOE_TC_PF_WARPS;
}

static_assert(tc_stages(8, MOE_TC_PF_WARPS) >= 3 && tc_stages(1, MOE_TC_WARPS) >= 3, "the rings' depths");
static_assert(tc_ring_bytes(1, MOE_TC_WARPS) <= 47 * 1024, "a decode CTA's ring fits static shared memory");

/* Activation tiles: 16 chunks of 16 bytes per token row; thread (g, t) reads chunk 4t + i of rows
 * g + 8j. XORing the chunk's bits 1 and 0 with t's bit 1 and the row's bit 0 spreads the 8 reads of
 * a quarter warp (rows g, g + 1, t = 0..3) over all 8 bank groups. */
static __device__ __forceinline__ int tc_xswz(int row, int c)
{
    return c ^ ((c >> 2) & 2) ^ (row & 1);
}

/* One k-tile of a warp's m16 tile against NT n8 tiles: st is the stage, xo[i] this thread's
 * activation offsets (word i of its 32 values, n8 tile 0). BIG: a scale of the tile exceeds 2. */
template <int NT, bool BIG, bool TILED>
static __device__ __forceinline__ void tc_tile(const uint8_t *st, int wo0, int wo1, int so0, int so1, const int (&xo)[4],
                                               float (&acc)[NT][4])
{
    const uint4 w0 = dsv4_lds128(st + wo0), w1 = dsv4_lds128(st + wo1);
    const uint32_t s0 = st[so0], s1 = st[so1];
    const uint32_t w0v[4] = { w0.x, w0.y, w0.z, w0.w }, w1v[4] = { w1.x, w1.y, w1.z, w1.w };
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t p0[4], p1[4];
        tc_decode_rows<TILED>(w0v[i], w1v[i], s0, s1, BIG, p0, p1);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 b = dsv4_lds128(st + xo[i] + j * 8 * MOE_TC_XROW);
            /* a0/a2: row g, k (2t, 2t+1) / (2t+8, 2t+9); a1/a3: row g + 8; b0/b1 the same k */
            const uint32_t a0[4] = { p0[0], p1[0], p0[1], p1[1] }, a1[4] = { p0[2], p1[2], p0[3], p1[3] };
            dsv4_mma_bf16(acc[j], a0, b.x, b.y);
            dsv4_mma_bf16(acc[j], a1, b.z, b.w);
        }
    }
}

/* One pass of a CTA of WARPS warps: n (<= 8 NT) tokens of the group, rows rowoff[] of the
 * activations, outputs to pairs pid[]; TILED: the table's experts are in k-tile blocks
 * (dsv4_cuda_experts.tiled), else row-major; ov: the tile's bytes in a fetch slot instead. */
template <int MODE, int NT, bool TILED, int WARPS>
static __device__ __forceinline__ void tc_pass(const moe_tc_args &a, const struct dsv4_cuda_expert *ex,
                                               const tc_over &ov, int n, uint8_t *smem, const int64_t *rowoff,
                                               const int32_t *pid)
{
    constexpr int STAGES = tc_stages(NT, WARPS), SB = tc_stage_bytes(NT, WARPS), THREADS = tc_threads(WARPS);
    constexpr int ROWS = tc_rows(WARPS), WB = ROWS * MOE_TC_WROW, XOFF = WB + ROWS * 4;
    const int tid = threadIdx.x, warp = tid / DSV4_CUDA_WARP, lane = tid % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3, tile = blockIdx.x, nk = a.nk;
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const tc_wsrc wsrc = tc_weight_src<MODE, WARPS, TILED>(ex, tile, nk, ov);
    int xo[4];
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        xo[i] = XOFF + g * MOE_TC_XROW + tc_xswz(g, 4 * t + i) * 16;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int q = 0; q < 4; q++)
            acc[j][q] = 0.0f;

    /* stage s <- k-tile kt: weights, scales, and the n token rows (rows past n keep stale bytes,
     * which only reach MMA columns that are never stored) */
    auto load = [&](int s, int kt) {
        uint8_t *st = smem + s * SB;
        tc_load_weights<WARPS>(wsrc, st, st + WB, kt);
#pragma unroll
        for (int q = 0; q < (NT * 8 * 16 + THREADS - 1) / THREADS; q++) {     /* 16 chunks a token row */
            const int i = tid + q * THREADS, r = i >> 4, c = i & 15;
            if (r < n)
                dsv4_cp_async16(st + XOFF + r * MOE_TC_XROW + tc_xswz(r, c) * 16,
                           a.xa + rowoff[r] + (int64_t)kt * MOE_TC_XROW + c * 16);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk)
            load(s, s);
        dsv4_cp_async_commit();
    }
    int rs = 0, ls = STAGES - 1;    /* stages read and loaded this iteration */
#pragma unroll 1
    for (int kt = 0; kt < nk; kt++) {
        dsv4_cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < nk)
            load(ls, kt + STAGES - 1);
        dsv4_cp_async_commit();
        const uint8_t *st = smem + rs * SB;
        const int wo0 = r0 * MOE_TC_WROW + t * 16, wo1 = r1 * MOE_TC_WROW + t * 16;
        /* warp-uniform: mma.sync needs every lane at the same instruction, so one lane's large
         * scale sends the whole warp down the BIG path (a factor of 1 for the others) */
        if (__any_sync(0xffffffffu, st[WB + r0 * 4 + t] > 128u || st[WB + r1 * 4 + t] > 128u))
            tc_tile<NT, true, TILED>(st, wo0, wo1, WB + r0 * 4 + t, WB + r1 * 4 + t, xo, acc);
        else
            tc_tile<NT, false, TILED>(st, wo0, wo1, WB + r0 * 4 + t, WB + r1 * 4 + t, xo, acc);
        rs = rs + 1 == STAGES ? 0 : rs + 1;
        ls = ls + 1 == STAGES ? 0 : ls + 1;
    }
    dsv4_cp_async_wait<0>();

    /* c0 (row g, token 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1) of each m16n8 tile */
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int nn = j * 8 + 2 * t + h;
            if (nn >= n)
                continue;
            float *y = a.y + (int64_t)pid[nn] * a.ldy;
            if (MODE == MOE_UP) {
                y[(int64_t)tile * tc_up_rows(WARPS) + warp * 8 + g] = swiglu(acc[j][h], acc[j][2 + h], a.limit);
            } else {
                y[(int64_t)tile * ROWS + r0] = acc[j][h];
                y[(int64_t)tile * ROWS + r1] = acc[j][2 + h];
            }
        }
}

/* Where a decode CTA reads its expert's tile from: the fetch slot the layer's resolve found this
 * tile's bytes copied to (kernels/expert_fetch.cu), else where the table points (host memory for a
 * host expert). Read with the table entry, in the same round: no latency before the weights. */
template <int MODE>
static __device__ __forceinline__ tc_over tc_redirect(const struct dsv4_cuda_fetch_redirect *r, int tile)
{
    tc_over ov;
    const uint64_t *mask = MODE == MOE_UP ? r->up : r->down;
    ov.on = mask[tile / 64] >> (tile % 64) & 1;
#pragma unroll
    for (int m = 0; m < 3; m++) {
        ov.w[m] = static_cast<const uint8_t *>(r->w[m]);
        ov.s[m] = r->s[m];
    }
    return ov;
}

/* grid (I / tc_up_rows or D / tc_rows, min(pairs, E)), tc_threads(tc_warps(MAXNT)) threads; the ring
 * (tc_ring_bytes) in static shared memory for MAXNT 1, else in dynamic shared memory of the size
 * dsv4_cuda_moe_prepare allowed. MAXNT 1 (decode steps): only the one-tile pass is
 * compiled and a group takes passes of 8 tokens (a decode group seldom has more; a larger one reads
 * its weights again, from L2): the batch-1 kernel was issue-bound with a fifth of its stalls
 * waiting for instructions, its code spanning all four pass shapes, and the full kernel takes 128
 * registers with spills. A token's outputs are the same code either way: the same bits. */
template <int MODE, int MAXNT, bool TILED>
__global__ void __launch_bounds__(tc_threads(tc_warps(MAXNT)), tc_ctas_per_sm(tc_warps(MAXNT)))
moe_tc_kernel(const moe_tc_args a)
{
    constexpr int WARPS = tc_warps(MAXNT);
    dsv4_pdl_enter();
    /* decode CTAs: the ring in static shared memory (fixed addresses); prefill CTAs: dynamic, past 48 KB */
    __shared__ __align__(16) uint8_t ring_static[MAXNT == 1 ? tc_ring_bytes(1, WARPS) : 16];
    extern __shared__ __align__(16) uint8_t ring_dynamic[];
    uint8_t *const smem = MAXNT == 1 ? ring_static : ring_dynamic;
    __shared__ int64_t rowoff[MOE_TC_PASS];
    __shared__ int32_t pid[MOE_TC_PASS];
    const int gi = blockIdx.y;

    if (gi >= a.groups[0])
        return;
    const int e = a.groups[1 + gi];
    const struct dsv4_cuda_expert *ex = &a.table[e];
    const tc_over ov = MAXNT == 1 && a.redirect ? tc_redirect<MODE>(a.redirect + e, blockIdx.x) : tc_over{};
    const int32_t *list = a.groups + 2 + 2 * a.pairs;
    const int beg = a.groups[1 + a.pairs + gi], end = a.groups[2 + a.pairs + gi];

    constexpr int PASS = MAXNT * 8;     /* tokens a pass: n8 tiles of the widest pass compiled */
    static_assert(PASS <= MOE_TC_PASS, "the pass tables hold MOE_TC_PASS tokens");
    for (int p0 = beg; p0 < end; p0 += PASS) {
        const int n = min(PASS, end - p0);
        __syncthreads();        /* the previous pass is done with the tables and the ring */
        if (threadIdx.x < n) {
            const int p = list[p0 + threadIdx.x];
            pid[threadIdx.x] = p;
            rowoff[threadIdx.x] = (int64_t)(MODE == MOE_UP ? p / a.topk : p) * a.lda;
        }
        __syncthreads();
        if (MAXNT == 1 || n <= 8)
            tc_pass<MODE, 1, TILED, WARPS>(a, ex, ov, n, smem, rowoff, pid);
        else if (n <= 16)
            tc_pass<MODE, 2, TILED, WARPS>(a, ex, ov, n, smem, rowoff, pid);
        else if (n <= 32)
            tc_pass<MODE, 4, TILED, WARPS>(a, ex, ov, n, smem, rowoff, pid);
        else
            tc_pass<MODE, 8, TILED, WARPS>(a, ex, ov, n, smem, rowoff, pid);
    }
}

/* One CTA per pair row of h [pairs, I] (the SwiGLU output, f32), one thread per 8 values, 16 threads
 * per 1x128 block: the official quantizer (the arithmetic of fp8_roundtrip_kernel), the e4m3 values
 * x scale written back in place as bf16 operands (bf16x8_operand, in the wgmma kernels' order where
 * wg). Row p's bf16 values fill the first half of its own f32 row, so every thread reads before any
 * writes. */
__global__ void moe_quant_kernel(float *__restrict__ h, int inter, bool wg)
{
    dsv4_pdl_enter();
    const int q = threadIdx.x;
    const bool on = q < inter / 8;
    float *row = h + (int64_t)blockIdx.x * inter;
    float v[8] = {}, amax = 0.0f;

    if (on) {
        const float4 a = reinterpret_cast<const float4 *>(row)[2 * q], b = reinterpret_cast<const float4 *>(row)[2 * q + 1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 8; o > 0; o >>= 1)     /* the 16 threads of this 128-block (aligned half warp) */
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = dsv4_act_scale(amax), inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        __nv_fp8_storage_t e = __nv_cvt_float_to_fp8(v[i] * inv, __NV_SATFINITE, __NV_E4M3);
        __half_raw hr = __nv_cvt_fp8_to_halfraw(e, __NV_E4M3);
        v[i] = __half2float(*reinterpret_cast<__half *>(&hr)) * s;
    }
    __syncthreads();
    if (on)
        moe_store_operand(reinterpret_cast<uint32_t *>(row), q, bf16x8_operand(v), wg);
}

/* The tensor-core path is the default where the shapes allow; DSV4_CUDA_MOE_MMA=0 (read once, from
 * the switch table: the backend refuses a bad value before any launch) keeps the FMA kernels. */
static bool tc_enabled(void)
{
    static int on = -1;
    if (on < 0) {
        struct dsv4_cuda_switches sw;
        on = dsv4_cuda_switches_read(&sw) < 0 || sw.moe_mma;
    }
    return on;
}

static bool tc_supported(const struct dsv4_cuda_experts *ex)
{
    return tc_enabled() && ex->fmt == DSV4_W_FP4 && ex->quant_act && ex->dim % MOE_TC_KT == 0 &&
           ex->inter % MOE_TC_KT == 0 && ex->inter <= MOE_TC_MAX_INTER;
}

extern "C" bool dsv4_cuda_moe_tiles(enum dsv4_wfmt fmt, int dim, int inter, bool quant_act)
{
    static int on = -1;
    if (on < 0) {
        struct dsv4_cuda_switches sw;
        on = dsv4_cuda_switches_read(&sw) < 0 || sw.moe_tiles;
    }
    struct dsv4_cuda_experts ex = {};
    ex.fmt = fmt;
    ex.dim = dim;
    ex.inter = inter;
    ex.quant_act = quant_act;
    return on && tc_supported(&ex);     /* tc: dim and inter multiples of 128, so of the 32-row blocks */
}

extern "C" void dsv4_cuda_tile_fp4(const uint8_t *src, int64_t pitch, const uint8_t *src_scale, int64_t scale_pitch,
                                   int64_t out, int64_t in, uint8_t *w, uint8_t *scale)
{
    const int64_t nk = in / MOE_TC_KT;
    for (int64_t r = 0; r < out; r++) {
        const int64_t blk = r / DSV4_CUDA_TILE_ROWS, rr = r % DSV4_CUDA_TILE_ROWS;
        for (int64_t kt = 0; kt < nk; kt++) {
            uint32_t v[MOE_TC_WROW / 4];
            memcpy(v, src + r * pitch + kt * MOE_TC_WROW, MOE_TC_WROW);
            for (int i = 0; i < MOE_TC_WROW / 4; i++)
                v[i] = fp4_tile_word(v[i]);
            memcpy(w + (blk * nk + kt) * DSV4_CUDA_TILE_BYTES + rr * MOE_TC_WROW, v, MOE_TC_WROW);
            memcpy(scale + (blk * nk + kt) * DSV4_CUDA_TILE_SCALE_BYTES + rr * 4, src_scale + r * scale_pitch + kt * 4,
                   4);
        }
    }
}

/* grid ceil(out * nk * 4 / 256), 256 threads: one thread per 16 bytes of the blocks, in their order
 * (block, k-tile, row, 16-byte chunk), which makes the writes contiguous, each word in
 * fp4_tile_word's order; the chunk-0 thread of a row also moves that row's 4 scale bytes of the k-tile. */
__global__ void tile_fp4_kernel(const uint8_t *__restrict__ src, int64_t pitch, const uint8_t *__restrict__ ssrc,
                                int64_t spitch, int64_t out, int64_t nk, uint4 *__restrict__ w,
                                uint32_t *__restrict__ scale)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out * nk * 4)
        return;
    const int c = (int)(i % 4), rr = (int)(i / 4 % DSV4_CUDA_TILE_ROWS);
    const int64_t bk = i / (4 * DSV4_CUDA_TILE_ROWS), kt = bk % nk, r = bk / nk * DSV4_CUDA_TILE_ROWS + rr;
    const uint4 v = *reinterpret_cast<const uint4 *>(src + r * pitch + kt * MOE_TC_WROW + c * 16);
    w[i] = make_uint4(fp4_tile_word(v.x), fp4_tile_word(v.y), fp4_tile_word(v.z), fp4_tile_word(v.w));
    if (c == 0)
        scale[bk * DSV4_CUDA_TILE_ROWS + rr] = *reinterpret_cast<const uint32_t *>(ssrc + r * spitch + kt * 4);
}

extern "C" int dsv4_cuda_tile_fp4_dev(const uint8_t *d_src, int64_t pitch, const uint8_t *d_src_scale,
                                      int64_t scale_pitch, int64_t out, int64_t in, uint8_t *d_w, uint8_t *d_scale,
                                      void *stream)
{
    if (out % DSV4_CUDA_TILE_ROWS || in % MOE_TC_KT || pitch % 16 || scale_pitch % 4)
        return dsv4_error_set(-EINVAL, "tile_fp4: [%lld, %lld] (pitch %lld, scale pitch %lld): out must be a multiple "
                              "of %d, in of %d, the pitches of 16 and 4 bytes", (long long)out, (long long)in,
                              (long long)pitch, (long long)scale_pitch, DSV4_CUDA_TILE_ROWS, MOE_TC_KT);
    const int64_t n = out * (in / MOE_TC_KT) * 4;
    tile_fp4_kernel<<<(unsigned)((n + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        d_src, pitch, d_src_scale, scale_pitch, out, in / MOE_TC_KT, reinterpret_cast<uint4 *>(d_w),
        reinterpret_cast<uint32_t *>(d_scale));
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : dsv4_error_set(-EIO, "tile_fp4: launch: %s", cudaGetErrorString(e));
}

typedef void (*tc_kernel_fn)(const moe_tc_args);

/* The kernel of a launch: decode steps (one: the one-tile kernel) or a prefill chunk, tiled experts
 * or row-major. */
template <int MODE>
static tc_kernel_fn tc_kernel(bool tiled, bool one)
{
    return tiled ? (one ? moe_tc_kernel<MODE, 1, true> : moe_tc_kernel<MODE, 8, true>)
                 : (one ? moe_tc_kernel<MODE, 1, false> : moe_tc_kernel<MODE, 8, false>);
}

/* Set by dsv4_cuda_moe_prepare: the prefill kernels' ring is past the 48 KB a block gets unasked;
 * tc_wg: prefill chunks take the wgmma kernels (moe_wgmma.cu), else tc_wg_why_not says why not. */
static bool tc_prefill_ready;
static bool tc_wg;
static const char *tc_wg_why_not = "dsv4_cuda_moe_prepare not run";

extern "C" int dsv4_cuda_moe_prepare(void)
{
    const int ring = tc_ring_bytes(8, MOE_TC_PF_WARPS);
    int dev = 0, optin = 0, rc;
    struct dsv4_cuda_switches sw;
    if ((rc = dsv4_cuda_switches_read(&sw)) < 0)
        return rc;
    DSV4_CUDA_TRY(cudaGetDevice(&dev));
    DSV4_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (optin < ring + MOE_TC_PASS * (int)(sizeof(int64_t) + sizeof(int32_t)))
        return dsv4_error_set(-ENOTSUP, "moe: the prefill expert kernels need %d bytes of shared memory a block, "
                              "device %d allows %d", ring + MOE_TC_PASS * (int)(sizeof(int64_t) + sizeof(int32_t)),
                              dev, optin);
    for (int tiled = 0; tiled < 2; tiled++) {
        DSV4_CUDA_TRY(cudaFuncSetAttribute(tc_kernel<MOE_UP>(tiled, false), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           ring));
        DSV4_CUDA_TRY(cudaFuncSetAttribute(tc_kernel<MOE_DOWN>(tiled, false),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, ring));
    }
    tc_wg_why_not = "DSV4_CUDA_MOE_WGMMA=0";
    if (sw.moe_wgmma && (rc = moe_wgmma_prepare(optin, &tc_wg_why_not)) < 0)
        return rc;
    tc_wg = sw.moe_wgmma && !tc_wg_why_not;
    tc_prefill_ready = true;
    return 0;
}

extern "C" bool dsv4_cuda_moe_wgmma(void)
{
    return tc_wg;
}

extern "C" const char *dsv4_cuda_moe_wgmma_why_not(void)
{
    return tc_wg ? nullptr : tc_wg_why_not;
}

/* A launch of `pairs` on the tensor-core kernels takes the wgmma ones: a prefill chunk, where they run,
 * whose groups hold MOE_WG_MIN_GROUP tokens or more on average. Passes of a few tokens (N 8) run
 * slower there than on mma.sync: an 8192-token prefill of the 4-layer Flash (256 experts), wgmma
 * against mma.sync in one run, was 5% slower in 256-row chunks (6 tokens an expert), 1% in 512-row
 * ones (12), 3.5% faster in 1024-row ones (24). The same bits either way. */
#define MOE_WG_MIN_GROUP 16
static bool tc_wgmma(int pairs, int topk, int n_experts)
{
    return tc_wg && pairs > DSV4_CUDA_MAX_BATCH * topk && pairs >= MOE_WG_MIN_GROUP * n_experts;
}

/* d_out holds x as bf16 operands (moe_prep_kernel) until down overwrites it; h goes f32 -> bf16 in d_h
 * (both in the wgmma order where wg: the caller's tc_wgmma, which moe_prep_kernel wrote x for). */
static int launch_experts_tc(const struct dsv4_cuda_experts *ex, int topk, int pairs, bool wg,
                             const struct dsv4_cuda_moe_ws *ws, cudaStream_t s)
{
    const unsigned slots = (unsigned)min(pairs, ex->n_experts);     /* groups <= distinct experts */
    const bool one = pairs <= DSV4_CUDA_MAX_BATCH * topk;      /* a decode step: the one-tile kernels */
    const int warps = tc_warps(one ? 1 : 8), threads = tc_threads(warps);
    const size_t ring = one ? 0 : (size_t)tc_ring_bytes(8, warps);      /* dynamic shared memory */
    moe_tc_args a = {};

    if (!one && !tc_prefill_ready)
        return dsv4_error_set(-EINVAL, "moe_experts: %d pairs take the prefill expert kernels, whose shared memory "
                              "dsv4_cuda_moe_prepare sets (at boot, before the first step)", pairs);
    a.table = ex->d_table;
    a.groups = ws->d_groups;
    a.pairs = pairs;
    a.topk = topk;
    a.limit = ex->swiglu_limit;
    a.xa = reinterpret_cast<const uint8_t *>(ws->d_out);
    a.lda = (int64_t)ex->dim * 2;
    a.nk = ex->dim / MOE_TC_KT;
    a.y = ws->d_h;
    a.ldy = ex->inter;
    if (one)
        a.redirect = ex->fetch_redirect;
    if (wg)
        moe_wgmma_launch(MOE_UP, ex->tiled, dim3(ex->inter / tc_up_rows(warps), slots), a, s);
    else
        dsv4_launch(tc_kernel<MOE_UP>(ex->tiled, one), dim3(ex->inter / tc_up_rows(warps), slots), threads, ring, s, a);
    DSV4_CUDA_LAUNCHED("moe_gate_up_mma");
    dsv4_launch(moe_quant_kernel, pairs, (ex->inter / 8 + DSV4_CUDA_WARP - 1) / DSV4_CUDA_WARP * DSV4_CUDA_WARP, 0, s,
                ws->d_h, ex->inter, wg);
    DSV4_CUDA_LAUNCHED("moe_quant");
    a.xa = reinterpret_cast<const uint8_t *>(ws->d_h);
    a.lda = (int64_t)ex->inter * 4;
    a.nk = ex->inter / MOE_TC_KT;
    a.y = ws->d_out;
    a.ldy = ex->dim;
    if (wg)
        moe_wgmma_launch(MOE_DOWN, ex->tiled, dim3(ex->dim / tc_rows(warps), slots), a, s);
    else
        dsv4_launch(tc_kernel<MOE_DOWN>(ex->tiled, one), dim3(ex->dim / tc_rows(warps), slots), threads, ring, s, a);
    DSV4_CUDA_LAUNCHED("moe_down_mma");
    return 0;
}

/* add (the shared expert's output, or NULL) joins the sum last: acc + add[i], one rounding, the
 * result the separate add kernel gave. */
__global__ void moe_combine_kernel(const float *__restrict__ out, const int32_t *__restrict__ idx,
                                   const float *__restrict__ w, int batch, int topk, int n_experts,
                                   int64_t dim, const float *__restrict__ add, const dsv4_cuda_pending padd,
                                   float *__restrict__ y)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * dim)
        return;
    const int64_t b = i / dim, d = i % dim;
    float acc = 0.0f;
    for (int j = 0; j < topk; j++) {
        const int64_t p = b * topk + j;
        if (idx[p] >= 0 && idx[p] < n_experts)
            acc += w[p] * out[p * dim + d];
    }
    y[i] = add ? acc + pending_at(padd, add, i) : acc;
}

extern "C" void dsv4_cuda_moe_decode_tiles(int *up_rows, int *down_rows)
{
    *up_rows = tc_up_rows(MOE_TC_WARPS);
    *down_rows = tc_rows(MOE_TC_WARPS);
}

extern "C" int dsv4_cuda_moe_routed(const struct dsv4_cuda_experts *ex, const float *d_x, int batch, int topk,
                                    const int32_t *d_idx, const struct dsv4_cuda_moe_ws *ws, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int pairs = batch * topk;
    int rc;

    if (batch < 1 || batch > DSV4_CUDA_MAX_ROWS || topk < 1 || topk > DSV4_MAX_TOPK)
        return dsv4_error_set(-EINVAL, "moe_experts: batch %d (max %d), top-%d (max %d)", batch,
                              DSV4_CUDA_MAX_ROWS, topk, DSV4_MAX_TOPK);
    const int vals = ex->fmt == DSV4_W_FP4 ? wf_fp4::vals : ex->fmt == DSV4_W_FP8 ? wf_fp8::vals :
                     ex->fmt == DSV4_W_BF16 ? wf_bf16::vals : wf_f32::vals;
    /* an inter that is not a multiple of the 1x128 activation block (small test models) takes the
     * FMA path, whose quantizer ends each row in a short block as engine/model/quant.c does */
    if (ex->n_experts < 1 || ex->n_experts > MOE_MAX_EXPERTS || ex->dim % vals || ex->inter % vals)
        return dsv4_error_set(-EINVAL, "moe_experts: %d experts (max %d), dim %d and inter %d must be multiples "
                              "of %d", ex->n_experts, MOE_MAX_EXPERTS, ex->dim, ex->inter, vals);
    const bool tc = tc_supported(ex);
    if (ex->tiled && !tc)
        return dsv4_error_set(-EINVAL, "moe_experts: experts stored in k-tile blocks need the tensor-core path (FP4, "
                              "fp8 numerics, dim and inter multiples of %d, DSV4_CUDA_MOE_MMA=1)", MOE_TC_KT);
    const int64_t n8 = tc ? (int64_t)batch * ex->dim / 8 : 0;
    const bool wg = tc && tc_wgmma(pairs, topk, ex->n_experts);     /* the operand order and the kernels */
    dsv4_launch(moe_prep_kernel, (unsigned)(1 + (n8 + MOE_PREP_THREADS - 1) / MOE_PREP_THREADS), MOE_PREP_THREADS, 0, s,
                d_idx, pairs, ex->n_experts, ws->d_groups, d_x, n8, wg,
                reinterpret_cast<uint32_t *>(ws->d_out));
    DSV4_CUDA_LAUNCHED("moe_prep");
    if (tc) {
        dsv4_cuda_count_launch(wg ? DSV4_CUDA_V_EXPERTS_FP4_WGMMA : DSV4_CUDA_V_EXPERTS_FP4);
        rc = launch_experts_tc(ex, topk, pairs, wg, ws, s);
    } else {
        switch (ex->fmt) {
        case DSV4_W_FP4:
            dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_FP4_FMA);
            rc = launch_experts_fma<wf_fp4>(ex, d_x, topk, pairs, ws, s, stream);
            break;
        case DSV4_W_FP8:
            dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_OTHER);
            rc = launch_experts_fma<wf_fp8>(ex, d_x, topk, pairs, ws, s, stream);
            break;
        case DSV4_W_BF16:
            dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_OTHER);
            rc = launch_experts_fma<wf_bf16>(ex, d_x, topk, pairs, ws, s, stream);
            break;
        case DSV4_W_F32:
            dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_OTHER);
            rc = launch_experts_fma<wf_f32>(ex, d_x, topk, pairs, ws, s, stream);
            break;
        default:
            return dsv4_error_set(-ENOTSUP, "moe_experts: expert weight format %d has no CUDA kernel", (int)ex->fmt);
        }
    }
    return rc;
}

extern "C" int dsv4_cuda_moe_combine(const struct dsv4_cuda_experts *ex, int batch, int topk, const int32_t *d_idx,
                                     const float *d_w, const struct dsv4_cuda_moe_ws *ws, const float *d_add,
                                     const struct dsv4_cuda_pending *d_padd, float *d_y, void *stream)
{
    const int threads = 256;
    int rc;
    if (batch < 1 || batch > DSV4_CUDA_MAX_ROWS || topk < 1 || topk > DSV4_MAX_TOPK)
        return dsv4_error_set(-EINVAL, "moe_combine: batch %d (max %d), top-%d (max %d)", batch,
                              DSV4_CUDA_MAX_ROWS, topk, DSV4_MAX_TOPK);
    if (d_padd && d_padd->splits && !d_add)
        return dsv4_error_set(-EINVAL, "moe_combine: a pending add needs the buffer it stands for");
    if ((rc = dsv4_cuda_pending_live(d_padd, batch, ex->dim, "moe_combine")) < 0)
        return rc;
    dsv4_launch(moe_combine_kernel, (unsigned)(((int64_t)batch * ex->dim + threads - 1) / threads), threads, 0,
                static_cast<cudaStream_t>(stream), ws->d_out, d_idx, d_w, batch, topk, ex->n_experts, ex->dim, d_add,
                pending_or_none(d_padd), d_y);
    DSV4_CUDA_LAUNCHED("moe_combine");
    return 0;
}

extern "C" int dsv4_cuda_moe_experts(const struct dsv4_cuda_experts *ex, const float *d_x, int batch,
                                     int topk, const int32_t *d_idx, const float *d_w,
                                     const struct dsv4_cuda_moe_ws *ws, float *d_y, void *stream)
{
    const int rc = dsv4_cuda_moe_routed(ex, d_x, batch, topk, d_idx, ws, stream);
    return rc < 0 ? rc : dsv4_cuda_moe_combine(ex, batch, topk, d_idx, d_w, ws, nullptr, nullptr, d_y, stream);
}

__global__ void swiglu_kernel(const float *__restrict__ g, const dsv4_cuda_pending pg, const float *__restrict__ u,
                              const dsv4_cuda_pending pu, int64_t n, float limit, float *__restrict__ h)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        h[i] = swiglu(pending_at(pg, g, i), pending_at(pu, u, i), limit);
}

extern "C" int dsv4_cuda_swiglu(const float *d_gate, const struct dsv4_cuda_pending *d_pgate, const float *d_up,
                                const struct dsv4_cuda_pending *d_pup, int rows, int64_t n, float limit, float *d_h,
                                void *stream)
{
    const int threads = 256;
    const int64_t total = (int64_t)rows * n;
    int rc;
    if ((rc = dsv4_cuda_pending_live(d_pgate, rows, n, "swiglu")) < 0 ||
        (rc = dsv4_cuda_pending_live(d_pup, rows, n, "swiglu")) < 0)
        return rc;
    if (total <= 0)
        return 0;
    dsv4_launch(swiglu_kernel, (unsigned)((total + threads - 1) / threads), threads, 0,
                static_cast<cudaStream_t>(stream), d_gate, pending_or_none(d_pgate), d_up, pending_or_none(d_pup),
                total, limit, d_h);
    DSV4_CUDA_LAUNCHED("swiglu");
    return 0;
}
