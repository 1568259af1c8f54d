/* MoE on the device: router (sqrtsoftplus, biased top-k or hash table), routed experts from FP4
 * weights grouped by expert over the batch with the SwiGLU clamp fused, the weighted combine, and
 * the elementwise SwiGLU of the shared expert. Twins: dsv4_twin_router, dsv4_twin_expert.
 *
 * Experts run in five launches with grids fixed by batch and topk only (graph-capturable):
 *   group    one thread sorts the batch*topk (token, expert) pairs by expert, stable by pair;
 *   gate_up  block (group, 8 rows of I): warps read w1 and w3 rows once per 8 tokens of the group;
 *   quant    (fp8 numerics) the SwiGLU output goes through the 1x128 e4m3 activation quantizer;
 *   down     block (group, 8 rows of D) over w2;
 *   combine  y[b] = sum_j w[b,j] out[b*topk+j] in j order, so a row's result never depends on the
 *            rest of the batch. */
#include "kernels/cuda_util.cuh"

#define MOE_ROWS 8              /* warps (weight rows) per block */
#define MOE_NB 8                /* tokens per pass over a weight row */
#define MOE_MAX_EXPERTS 1024    /* router and grouping keep per-expert arrays in shared memory */

static __device__ __forceinline__ float sqrt_softplus(float l)
{
    return sqrtf(l > 20.0f ? l : log1pf(expf(l)));
}

static __device__ __forceinline__ float swiglu(float g, float u, float limit)
{
    if (limit > 0.0f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

/* One warp per token. Shared: scores [E], selection values [E]. */
__global__ void router_kernel(const float *__restrict__ logits, int n_experts, int topk,
                              const float *__restrict__ bias, const int32_t *__restrict__ tid2eid,
                              const int32_t *__restrict__ tokens, float route_scale,
                              int32_t *__restrict__ idx, float *__restrict__ w)
{
    extern __shared__ float sm[];
    float *score = sm, *sel = sm + n_experts;
    const int b = blockIdx.x, lane = threadIdx.x;
    const float *l = logits + (int64_t)b * n_experts;
    float sum = 0.0f;

    for (int e = lane; e < n_experts; e += DSV4_CUDA_WARP) {
        score[e] = sqrt_softplus(l[e]);
        sel[e] = score[e] + (bias ? bias[e] : 0.0f);
    }
    __syncwarp();
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
        if (lane == 0)
            idx[(int64_t)b * topk + j] = best;
        sum += best >= 0 ? score[best] : 0.0f;
    }
    if (lane == 0)
        for (int j = 0; j < topk; j++) {
            const int e = idx[(int64_t)b * topk + j];
            w[(int64_t)b * topk + j] = e >= 0 ? score[e] / (sum + 1e-20f) * route_scale : 0.0f;
        }
}

extern "C" int dsv4_cuda_router(const float *d_logits, int batch, int n_experts, int topk,
                                const float *d_bias, const int32_t *d_tid2eid, const int32_t *d_tokens,
                                float route_scale, int32_t *d_idx, float *d_w, void *stream)
{
    if (n_experts < 1 || n_experts > MOE_MAX_EXPERTS || topk < 1 || topk > DSV4_MAX_TOPK || topk > n_experts)
        return dsv4_error_set(-EINVAL, "router: %d experts (max %d), top-%d (max %d)", n_experts,
                              MOE_MAX_EXPERTS, topk, DSV4_MAX_TOPK);
    if (d_tid2eid && !d_tokens)
        return dsv4_error_set(-EINVAL, "router: hash routing needs the batch's token ids");
    if (batch < 1)
        return 0;
    router_kernel<<<batch, DSV4_CUDA_WARP, 2 * n_experts * sizeof(float), static_cast<cudaStream_t>(stream)>>>(
        d_logits, n_experts, topk, d_bias, d_tid2eid, d_tokens, route_scale, d_idx, d_w);
    DSV4_CUDA_LAUNCHED("router");
    return 0;
}

/* groups layout (int32, P = pairs): [0] group count G; [1 + g] expert of group g; [1 + P + g]
 * start of group g in the pair list (G + 1 entries); [2 + 2P + i] pair list. Pairs naming no valid
 * expert join no group; combine skips them. */
__global__ void moe_group_kernel(const int32_t *__restrict__ idx, int pairs, int n_experts,
                                 int32_t *__restrict__ groups)
{
    extern __shared__ int32_t pos[];    /* [E] */
    int32_t *expert = groups + 1, *start = groups + 1 + pairs, *list = groups + 2 + 2 * pairs;
    int ng = 0, off = 0;

    if (threadIdx.x != 0)
        return;
    for (int e = 0; e < n_experts; e++)
        pos[e] = 0;
    for (int p = 0; p < pairs; p++)
        if (idx[p] >= 0 && idx[p] < n_experts)
            pos[idx[p]]++;
    for (int e = 0; e < n_experts; e++) {
        int c = pos[e];
        pos[e] = off;
        if (c) {
            expert[ng] = e;
            start[ng++] = off;
            off += c;
        }
    }
    start[ng] = off;
    groups[0] = ng;
    for (int p = 0; p < pairs; p++)
        if (idx[p] >= 0 && idx[p] < n_experts)
            list[pos[idx[p]]++] = p;
}

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
static int launch_experts(const struct dsv4_cuda_experts *ex, const float *d_x, int topk, int pairs,
                          const struct dsv4_cuda_moe_ws *ws, cudaStream_t s, void *stream)
{
    moe_gate_up_kernel<WF><<<dim3(pairs, (ex->inter + MOE_ROWS - 1) / MOE_ROWS), MOE_ROWS * DSV4_CUDA_WARP, 0, s>>>(
        *ex, d_x, topk, pairs, ws->d_groups, ws->d_h);
    DSV4_CUDA_LAUNCHED("moe_gate_up");
    if (ex->quant_act) {
        int rc = dsv4_cuda_fp8_roundtrip(ws->d_h, pairs, ex->inter, DSV4_CUDA_ACT_BLOCK, ws->d_h, stream);
        if (rc < 0)
            return rc;
    }
    moe_down_kernel<WF><<<dim3(pairs, (ex->dim + MOE_ROWS - 1) / MOE_ROWS), MOE_ROWS * DSV4_CUDA_WARP, 0, s>>>(
        *ex, ws->d_h, pairs, ws->d_groups, ws->d_out);
    DSV4_CUDA_LAUNCHED("moe_down");
    return 0;
}

__global__ void moe_combine_kernel(const float *__restrict__ out, const int32_t *__restrict__ idx,
                                   const float *__restrict__ w, int batch, int topk, int n_experts,
                                   int64_t dim, float *__restrict__ y)
{
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
    y[i] = acc;
}

extern "C" int dsv4_cuda_moe_experts(const struct dsv4_cuda_experts *ex, const float *d_x, int batch,
                                     int topk, const int32_t *d_idx, const float *d_w,
                                     const struct dsv4_cuda_moe_ws *ws, float *d_y, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int pairs = batch * topk;
    const int threads = 256;
    int rc;

    if (batch < 1 || batch > DSV4_CUDA_MAX_BATCH || topk < 1 || topk > DSV4_MAX_TOPK)
        return dsv4_error_set(-EINVAL, "moe_experts: batch %d (max %d), top-%d (max %d)", batch,
                              DSV4_CUDA_MAX_BATCH, topk, DSV4_MAX_TOPK);
    const int vals = ex->fmt == DSV4_W_FP4 ? wf_fp4::vals : ex->fmt == DSV4_W_FP8 ? wf_fp8::vals :
                     ex->fmt == DSV4_W_BF16 ? wf_bf16::vals : wf_f32::vals;
    if (ex->n_experts < 1 || ex->n_experts > MOE_MAX_EXPERTS || ex->dim % vals || ex->inter % vals ||
        (ex->quant_act && ex->inter % DSV4_CUDA_ACT_BLOCK))
        return dsv4_error_set(-EINVAL, "moe_experts: %d experts (max %d), dim %d and inter %d must be multiples "
                              "of %d (inter of %d with activation quantization)", ex->n_experts, MOE_MAX_EXPERTS,
                              ex->dim, ex->inter, vals, DSV4_CUDA_ACT_BLOCK);
    moe_group_kernel<<<1, DSV4_CUDA_WARP, ex->n_experts * sizeof(int32_t), s>>>(d_idx, pairs, ex->n_experts,
                                                                                 ws->d_groups);
    DSV4_CUDA_LAUNCHED("moe_group");
    switch (ex->fmt) {
    case DSV4_W_FP4:
        dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_FP4);
        rc = launch_experts<wf_fp4>(ex, d_x, topk, pairs, ws, s, stream);
        break;
    case DSV4_W_FP8:
        dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_OTHER);
        rc = launch_experts<wf_fp8>(ex, d_x, topk, pairs, ws, s, stream);
        break;
    case DSV4_W_BF16:
        dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_OTHER);
        rc = launch_experts<wf_bf16>(ex, d_x, topk, pairs, ws, s, stream);
        break;
    case DSV4_W_F32:
        dsv4_cuda_count_launch(DSV4_CUDA_V_EXPERTS_OTHER);
        rc = launch_experts<wf_f32>(ex, d_x, topk, pairs, ws, s, stream);
        break;
    default:
        return dsv4_error_set(-ENOTSUP, "moe_experts: expert weight format %d has no CUDA kernel", (int)ex->fmt);
    }
    if (rc < 0)
        return rc;
    moe_combine_kernel<<<(unsigned)(((int64_t)batch * ex->dim + threads - 1) / threads), threads, 0, s>>>(
        ws->d_out, d_idx, d_w, batch, topk, ex->n_experts, ex->dim, d_y);
    DSV4_CUDA_LAUNCHED("moe_combine");
    return 0;
}

__global__ void swiglu_kernel(const float *__restrict__ g, const float *__restrict__ u, int64_t n,
                              float limit, float *__restrict__ h)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        h[i] = swiglu(g[i], u[i], limit);
}

extern "C" int dsv4_cuda_swiglu(const float *d_gate, const float *d_up, int rows, int64_t n, float limit,
                                float *d_h, void *stream)
{
    const int threads = 256;
    const int64_t total = (int64_t)rows * n;
    if (total <= 0)
        return 0;
    swiglu_kernel<<<(unsigned)((total + threads - 1) / threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
        d_gate, d_up, total, limit, d_h);
    DSV4_CUDA_LAUNCHED("swiglu");
    return 0;
}
