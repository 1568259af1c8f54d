/* SPDX-License-Identifier: MIT */
/* The manifold-constrained hyper-connections (mHC) around each sublayer and before the head: the fn
 * GEMV (split along K), pre (the RMS of the streams, the pre and post gates, the Sinkhorn-normalized
 * combine matrix, the collapsed input), post (the sublayer's output spread back into the streams),
 * and hc_head. Twins: dsv4_twin_linear_matvec (fn), dsv4_twin_mhc_pre, dsv4_twin_mhc_post
 * (engine/cpu/cpu_twin_cuda.c), dsv4_cpu_hc_head (engine/cpu/cpu_mhc.c). */
#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/norm_row.cuh"

static __device__ __forceinline__ float sigmoidf_(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

/* mHC pre, split over the chip: grid (ceil(dim / MHC_COLS), batch). Every block of a token computes
 * the same RMS of its hc * dim stream values (same threads, same order: identical r in every block)
 * and the pre gates, then collapses its MHC_COLS columns, y = sum_j pre_j X[j]; warp 0 of block 0 of
 * the token also writes the post gates and the combine matrix (softmax + Sinkhorn) after its own
 * columns. A token's arithmetic never depends on the batch. HC is the stream count (a template so
 * that the matrix lives in registers). */
#define MHC_COLS 1024

/* The combine matrix [HC, HC] of one token, one lane per element (e = j * HC + k) while HC * HC fits
 * a warp: softmax along each row, then iters Sinkhorn rounds (rows from the second round on, then
 * columns). Every row/column sum is gathered by shuffles and added serially from 0 in the twin's
 * order (k = 0.. along a row, j = 0.. down a column), so each element is computed exactly as the
 * one-thread loop computed it. Lanes past HC * HC mirror the last element and write nothing. */
template <int HC>
static __device__ __forceinline__ void mhc_comb_warp(const float *__restrict__ mb, float r,
                                                     const float *__restrict__ scale,
                                                     const float *__restrict__ base, int iters, float hc_eps,
                                                     float *__restrict__ comb)
{
    static_assert(HC * HC <= DSV4_CUDA_WARP, "one lane per combine element");
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x % DSV4_CUDA_WARP, e = min(lane, HC * HC - 1), j = e / HC, k = e % HC;
    float c = mb[2 * HC + e] * r * scale[2] + base[2 * HC + e], mx = -INFINITY, sum = 0.0f;

#pragma unroll
    for (int q = 0; q < HC; q++)
        mx = fmaxf(mx, __shfl_sync(all, c, j * HC + q));
    c = expf(c - mx);
#pragma unroll
    for (int q = 0; q < HC; q++)
        sum += __shfl_sync(all, c, j * HC + q);
    c = c / sum + hc_eps;
    for (int it = 0; it < iters; it++) {
        float s = 0.0f;
        if (it > 0) {
#pragma unroll
            for (int q = 0; q < HC; q++)
                s += __shfl_sync(all, c, j * HC + q);
            c /= s + hc_eps;
            s = 0.0f;
        }
#pragma unroll
        for (int q = 0; q < HC; q++)
            s += __shfl_sync(all, c, q * HC + k);
        c /= s + hc_eps;
    }
    if (lane < HC * HC)
        comb[lane] = c;
}

/* The same matrix in one thread's registers, for HC * HC past a warp (the twin's loops verbatim). */
template <int HC>
static __device__ __forceinline__ void mhc_comb_serial(const float *__restrict__ mb, float r,
                                                       const float *__restrict__ scale,
                                                       const float *__restrict__ base, int iters, float hc_eps,
                                                       float *__restrict__ comb)
{
    float C[HC * HC];
#pragma unroll
    for (int j = 0; j < HC; j++) {
        float mx = -INFINITY, sum = 0.0f;
#pragma unroll
        for (int k = 0; k < HC; k++) {
            C[j * HC + k] = mb[2 * HC + j * HC + k] * r * scale[2] + base[2 * HC + j * HC + k];
            mx = fmaxf(mx, C[j * HC + k]);
        }
#pragma unroll
        for (int k = 0; k < HC; k++) {
            C[j * HC + k] = expf(C[j * HC + k] - mx);
            sum += C[j * HC + k];
        }
#pragma unroll
        for (int k = 0; k < HC; k++)
            C[j * HC + k] = C[j * HC + k] / sum + hc_eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
#pragma unroll
            for (int j = 0; j < HC; j++) {
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < HC; k++)
                    s += C[j * HC + k];
#pragma unroll
                for (int k = 0; k < HC; k++)
                    C[j * HC + k] /= s + hc_eps;
            }
        }
#pragma unroll
        for (int k = 0; k < HC; k++) {
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < HC; j++)
                s += C[j * HC + k];
#pragma unroll
            for (int j = 0; j < HC; j++)
                C[j * HC + k] /= s + hc_eps;
        }
    }
#pragma unroll
    for (int i = 0; i < HC * HC; i++)
        comb[i] = C[i];
}

template <int HC>
__global__ void __launch_bounds__(NORM_THREADS)
mhc_pre_kernel(const float *__restrict__ X, const float *__restrict__ m, const float *__restrict__ mparts, int chunks,
               const float *__restrict__ base, const float *__restrict__ scale, int dim, int iters, float hc_eps,
               float norm_eps, bool vec4, float *__restrict__ y, float *__restrict__ post, float *__restrict__ comb)
{
    dsv4_pdl_enter();
    constexpr int MIX = (2 + HC) * HC;
    __shared__ float pre[HC], m_s[MIX];
    const int b = blockIdx.y;
    const int64_t n = (int64_t)HC * dim;
    const float *Xb = X + (int64_t)b * n, *mb = mparts ? m_s : m + (int64_t)b * MIX;
    float ss = 0.0f;

    if (mparts) {   /* the fn's split-K partials: mhc_fn_sum_kernel's sums, same lanes, same order */
        const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
        const float *wb = mparts + (int64_t)b * chunks * MIX;
        for (int r = warp; r < MIX; r += NORM_THREADS / DSV4_CUDA_WARP) {
            float acc = 0.0f;
            for (int c = lane; c < chunks; c += DSV4_CUDA_WARP)
                acc += wb[(int64_t)c * MIX + r];
            acc = dsv4_warp_sum(acc);
            if (lane == 0)
                m_s[r] = acc;       /* read after block_sum's barriers */
        }
    }

    if (vec4) {
        const float4 *X4 = reinterpret_cast<const float4 *>(Xb);
#pragma unroll 4
        for (int64_t i = threadIdx.x; i < n / 4; i += NORM_THREADS) {
            const float4 v = X4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
#pragma unroll 4
        for (int64_t i = threadIdx.x; i < n; i += NORM_THREADS)
            ss += Xb[i] * Xb[i];
    }
    const float r = 1.0f / sqrtf(block_sum(ss) / n + norm_eps);
    if (threadIdx.x < HC)
        pre[threadIdx.x] = sigmoidf_(mb[threadIdx.x] * r * scale[0] + base[threadIdx.x]) + hc_eps;
    __syncthreads();
    const int d_end = min(dim, (int)(blockIdx.x + 1) * MHC_COLS);
    for (int d = blockIdx.x * MHC_COLS + threadIdx.x; d < d_end; d += NORM_THREADS) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < HC; j++)
            acc += pre[j] * Xb[(int64_t)j * dim + d];
        y[(int64_t)b * dim + d] = acc;
    }
    if (blockIdx.x != 0 || threadIdx.x >= DSV4_CUDA_WARP)
        return;
    if (threadIdx.x < HC)
        post[b * HC + threadIdx.x] = 2.0f * sigmoidf_(mb[HC + threadIdx.x] * r * scale[1] + base[HC + threadIdx.x]);
    if constexpr (HC * HC <= DSV4_CUDA_WARP)
        mhc_comb_warp<HC>(mb, r, scale, base, iters, hc_eps, comb + (int64_t)b * HC * HC);
    else if (threadIdx.x == 0)
        mhc_comb_serial<HC>(mb, r, scale, base, iters, hc_eps, comb + (int64_t)b * HC * HC);
}

template <int HC>
static void launch_mhc_pre(const float *d_X, const float *d_m, const float *d_mparts, int chunks, const float *d_base,
                           const float *d_scale, int batch, int dim, int iters, float hc_eps, float norm_eps,
                           float *d_y, float *d_post, float *d_comb, cudaStream_t s)
{
    const bool vec4 = ((int64_t)HC * dim) % 4 == 0 && (uintptr_t)d_X % 16 == 0;
    dim3 grid((unsigned)((dim + MHC_COLS - 1) / MHC_COLS), (unsigned)batch);
    dsv4_launch(mhc_pre_kernel<HC>, grid, NORM_THREADS, 0, s, d_X, d_m, d_mparts, chunks, d_base, d_scale, dim, iters,
                hc_eps, norm_eps, vec4, d_y, d_post, d_comb);
}

/* d_m the fn output, or (d_m NULL) d_mparts its split-K partials [batch, chunks, (2+hc)*hc] */
static int mhc_pre(const float *d_X, const float *d_m, const float *d_mparts, int chunks, const float *d_base,
                   const float *d_scale, int batch, int hc, int dim, int iters, float hc_eps, float norm_eps,
                   float *d_y, float *d_post, float *d_comb, cudaStream_t s)
{
    static void (*const launchers[])(const float *, const float *, const float *, int, const float *, const float *,
                                     int, int, int, float, float, float *, float *, float *, cudaStream_t) = {
        launch_mhc_pre<1>, launch_mhc_pre<2>, launch_mhc_pre<3>, launch_mhc_pre<4>,
        launch_mhc_pre<5>, launch_mhc_pre<6>, launch_mhc_pre<7>, launch_mhc_pre<8>,
    };
    static_assert(sizeof(launchers) / sizeof(launchers[0]) == DSV4_MAX_HC, "one launcher per hc 1..DSV4_MAX_HC");
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "mhc_pre: hc_mult %d outside 1..%d", hc, DSV4_MAX_HC);
    if (batch < 1 || dim < 1)
        return 0;
    dsv4_cuda_count_launch(DSV4_CUDA_V_MHC_PRE);
    launchers[hc - 1](d_X, d_m, d_mparts, chunks, d_base, d_scale, batch, dim, iters, hc_eps, norm_eps, d_y, d_post,
                      d_comb, s);
    DSV4_CUDA_LAUNCHED("mhc_pre");
    return 0;
}

extern "C" int dsv4_cuda_mhc_pre(const float *d_X, const float *d_m, const float *d_base, const float *d_scale,
                                 int batch, int hc, int dim, int iters, float hc_eps, float norm_eps,
                                 float *d_y, float *d_post, float *d_comb, void *stream)
{
    return mhc_pre(d_X, d_m, nullptr, 0, d_base, d_scale, batch, hc, dim, iters, hc_eps, norm_eps, d_y, d_post,
                   d_comb, static_cast<cudaStream_t>(stream));
}

/* The mHC fn GEMV, split along K: d_ws[b, c, r] = W[r, chunk c] . x_b[chunk c] for fixed chunks of
 * DSV4_CUDA_MHC_FN_CHUNK values, then d_y[b, r] = sum over c (lane c % 32 sums its chunks in order,
 * then a fixed butterfly). Both steps depend on row b alone: batch-invariant and deterministic.
 * grid (chunks, ceil(batch / MHC_FN_NB)), one warp per weight row (rows strided over the warps);
 * each lane holds MHC_FN_PER_LANE float4 of x per batch row. */
#define MHC_FN_NB 8
#define MHC_FN_PER_LANE (DSV4_CUDA_MHC_FN_CHUNK / (DSV4_CUDA_WARP * 4))

static_assert(DSV4_CUDA_MHC_FN_CHUNK % (DSV4_CUDA_WARP * 4) == 0, "a chunk is whole float4 per lane");

__global__ void __launch_bounds__(NORM_THREADS)
mhc_fn_part_kernel(const float *__restrict__ W, int64_t ldw, int out, int64_t in, const float *__restrict__ x,
                   int64_t ldx, int batch, int chunks, float *__restrict__ ws)
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    const int c = blockIdx.x, b0 = blockIdx.y * MHC_FN_NB, nb = min(MHC_FN_NB, batch - b0);
    const int64_t k0 = (int64_t)c * DSV4_CUDA_MHC_FN_CHUNK;
    constexpr int LINES = DSV4_CUDA_MHC_FN_CHUNK * (int)sizeof(float) / 128;   /* 128-byte lines of a row's chunk */

    /* the weights are constant: start this chunk's rows toward L2 while the kernel that writes x drains */
    for (int i = threadIdx.x; i < out * LINES; i += NORM_THREADS) {
        const int64_t k = k0 + (int64_t)(i % LINES) * (128 / sizeof(float));
        if (k < in)
            dsv4_prefetch_l2(W + (int64_t)(i / LINES) * ldw + k);
    }
    dsv4_pdl_enter();
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 xv[MHC_FN_NB][MHC_FN_PER_LANE];

#pragma unroll
    for (int b = 0; b < MHC_FN_NB; b++)
#pragma unroll
        for (int i = 0; i < MHC_FN_PER_LANE; i++) {
            const int64_t k = k0 + (int64_t)(i * DSV4_CUDA_WARP + lane) * 4;
            xv[b][i] = b < nb && k < in ? *reinterpret_cast<const float4 *>(x + (int64_t)(b0 + b) * ldx + k) : zero;
        }
    for (int r = warp; r < out; r += NORM_THREADS / DSV4_CUDA_WARP) {
        float4 wv[MHC_FN_PER_LANE];
#pragma unroll
        for (int i = 0; i < MHC_FN_PER_LANE; i++) {
            const int64_t k = k0 + (int64_t)(i * DSV4_CUDA_WARP + lane) * 4;
            wv[i] = k < in ? __ldg(reinterpret_cast<const float4 *>(W + (int64_t)r * ldw + k)) : zero;
        }
#pragma unroll
        for (int b = 0; b < MHC_FN_NB; b++) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < MHC_FN_PER_LANE; i++)
                acc += wv[i].x * xv[b][i].x + wv[i].y * xv[b][i].y + wv[i].z * xv[b][i].z + wv[i].w * xv[b][i].w;
            acc = dsv4_warp_sum(acc);
            if (lane == 0 && b < nb)
                ws[((int64_t)(b0 + b) * chunks + c) * out + r] = acc;
        }
    }
}

/* grid batch: one warp per output row of token blockIdx.x. */
__global__ void __launch_bounds__(NORM_THREADS)
mhc_fn_sum_kernel(const float *__restrict__ ws, int out, int chunks, float *__restrict__ y, int64_t ldy)
{
    dsv4_pdl_enter();
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP, b = blockIdx.x;
    const float *wb = ws + (int64_t)b * chunks * out;
    for (int r = warp; r < out; r += NORM_THREADS / DSV4_CUDA_WARP) {
        float acc = 0.0f;
        for (int c = lane; c < chunks; c += DSV4_CUDA_WARP)
            acc += wb[(int64_t)c * out + r];
        acc = dsv4_warp_sum(acc);
        if (lane == 0)
            y[(int64_t)b * ldy + r] = acc;
    }
}

/* The partials of the fn GEMV into d_ws; returns the chunk count, or a negative errno. */
static int mhc_fn_parts(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int batch, float *d_ws,
                        int64_t ws_floats, cudaStream_t s)
{
    if (batch < 1 || batch > DSV4_CUDA_MAX_ROWS)
        return dsv4_error_set(-EINVAL, "mhc_fn: batch %d outside 1..%d", batch, DSV4_CUDA_MAX_ROWS);
    if (W->fmt != DSV4_W_F32 || W->out < 1 || W->out > DSV4_CUDA_MHC_FN_MAX_OUT)
        return dsv4_error_set(-EINVAL, "mhc_fn: the fn weight must be F32 with 1..%d rows (format %d, %lld rows)",
                              DSV4_CUDA_MHC_FN_MAX_OUT, (int)W->fmt, (long long)W->out);
    /* 16-byte loads of weights and x */
    if (W->in % 4 || W->row_stride % 4 || ldx % 4 || ((uintptr_t)W->w | (uintptr_t)d_x) % 16)
        return dsv4_error_set(-EINVAL, "mhc_fn: in %lld, row stride %lld and ldx %lld must be multiples of 4, "
                              "with 16-byte aligned pointers", (long long)W->in, (long long)W->row_stride,
                              (long long)ldx);
    if (dsv4_cuda_mhc_fn_ws_floats(batch, W->out, W->in) > ws_floats)
        return dsv4_error_set(-EINVAL, "mhc_fn: workspace of %lld floats is short of the %lld that batch %d of a "
                              "[%lld, %lld] fn needs", (long long)ws_floats,
                              (long long)dsv4_cuda_mhc_fn_ws_floats(batch, W->out, W->in), batch,
                              (long long)W->out, (long long)W->in);
    const int chunks = (int)((W->in + DSV4_CUDA_MHC_FN_CHUNK - 1) / DSV4_CUDA_MHC_FN_CHUNK);
    dsv4_cuda_count_launch(DSV4_CUDA_V_MHC_FN_SPLITK);
    dim3 grid((unsigned)chunks, (unsigned)((batch + MHC_FN_NB - 1) / MHC_FN_NB));
    dsv4_launch(mhc_fn_part_kernel, grid, NORM_THREADS, 0, s, static_cast<const float *>(W->w), W->row_stride,
                (int)W->out, W->in, d_x, ldx, batch, chunks, d_ws);
    DSV4_CUDA_LAUNCHED("mhc_fn_part");
    return chunks;
}

extern "C" int dsv4_cuda_mhc_fn(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int batch,
                                float *d_ws, int64_t ws_floats, float *d_y, int64_t ldy, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int chunks = mhc_fn_parts(W, d_x, ldx, batch, d_ws, ws_floats, s);
    if (chunks < 0)
        return chunks;
    dsv4_launch(mhc_fn_sum_kernel, batch, NORM_THREADS, 0, s, d_ws, (int)W->out, chunks, d_y, ldy);
    DSV4_CUDA_LAUNCHED("mhc_fn_sum");
    return 0;
}

extern "C" int dsv4_cuda_mhc_fn_pre(const struct dsv4_cuda_linear *W, const float *d_X, int batch, float *d_ws,
                                    int64_t ws_floats, const float *d_base, const float *d_scale, int hc, int dim,
                                    int iters, float hc_eps, float norm_eps, float *d_y, float *d_post, float *d_comb,
                                    void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (hc < 1 || hc > DSV4_MAX_HC || W->out != (int64_t)(2 + hc) * hc || W->in != (int64_t)hc * dim)
        return dsv4_error_set(-EINVAL, "mhc_fn_pre: fn [%lld, %lld] for hc_mult %d (1..%d) and dim %d must be "
                              "[(2 + hc) hc, hc dim]", (long long)W->out, (long long)W->in, hc, DSV4_MAX_HC, dim);
    const int chunks = mhc_fn_parts(W, d_X, (int64_t)hc * dim, batch, d_ws, ws_floats, s);
    if (chunks < 0)
        return chunks;
    return mhc_pre(d_X, nullptr, d_ws, chunks, d_base, d_scale, batch, hc, dim, iters, hc_eps, norm_eps, d_y, d_post,
                   d_comb, s);
}

/* One thread per (b, d): the hc stream values X[b, :, d] read once into registers, then every
 * output Xo[b, k, d] = post[b, k] f[b, d] + sum_j comb[b, j, k] X[b, j, d] summed in j order (one
 * thread per output read each X value hc times: a prefill chunk's X is 64 MiB at 1024 rows). */
__global__ void mhc_post_kernel(const float *__restrict__ X, const float *__restrict__ f,
                                const float *__restrict__ post, const float *__restrict__ comb, int batch,
                                int hc, int dim, float *__restrict__ Xo)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)batch * dim)
        return;
    const int64_t d = i % dim, b = i / dim;
    const float *Xb = X + b * hc * dim, *cb = comb + b * hc * hc;
    const float fv = f[b * dim + d];
    float xv[DSV4_MAX_HC];
#pragma unroll
    for (int j = 0; j < DSV4_MAX_HC; j++)
        xv[j] = j < hc ? Xb[(int64_t)j * dim + d] : 0.0f;
    for (int k = 0; k < hc; k++) {
        float acc = post[b * hc + k] * fv;
#pragma unroll
        for (int j = 0; j < DSV4_MAX_HC; j++)
            if (j < hc)
                acc += cb[j * hc + k] * xv[j];
        Xo[(b * hc + k) * dim + d] = acc;
    }
}

extern "C" int dsv4_cuda_mhc_post(const float *d_X, const float *d_f, const float *d_post, const float *d_comb,
                                  int batch, int hc, int dim, float *d_Xo, void *stream)
{
    const int threads = 256;
    const int64_t total = (int64_t)batch * dim;     /* threads: one per (row, d) */
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "mhc_post: hc_mult %d outside 1..%d", hc, DSV4_MAX_HC);
    if (total <= 0)
        return 0;
    dsv4_launch(mhc_post_kernel, (unsigned)((total + threads - 1) / threads), threads, 0,
                static_cast<cudaStream_t>(stream), d_X, d_f, d_post, d_comb, batch, hc, dim, d_Xo);
    DSV4_CUDA_LAUNCHED("mhc_post");
    return 0;
}

/* hc_head: one block per row collapses the hc streams with sigmoid gates (no Sinkhorn). */
__global__ void __launch_bounds__(NORM_THREADS)
hc_head_kernel(const float *X, const float *m, const float *base, const float *scale, int hc, int dim,
               float hc_eps, float norm_eps, float *y)
{
    dsv4_pdl_enter();
    __shared__ float pre[DSV4_MAX_HC];
    const int b = blockIdx.x;
    const float *Xb = X + (int64_t)b * hc * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hc * dim; i += blockDim.x)
        ss += Xb[i] * Xb[i];
    const float r = 1.0f / sqrtf(block_sum(ss) / (hc * dim) + norm_eps);
    if (threadIdx.x < hc)
        pre[threadIdx.x] = 1.0f / (1.0f + expf(-(m[b * hc + threadIdx.x] * r * scale[0] + base[threadIdx.x]))) + hc_eps;
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < hc; j++)
            acc += pre[j] * Xb[(int64_t)j * dim + d];
        y[(int64_t)b * dim + d] = acc;
    }
}

int dsv4_cuda_hc_head(const float *d_X, const float *d_m, const float *d_base, const float *d_scale, int batch,
                      int hc, int dim, float hc_eps, float norm_eps, float *d_y, void *stream)
{
    if (hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "hc_head: hc_mult %d over %d", hc, DSV4_MAX_HC);
    if (batch < 1)
        return 0;
    dsv4_launch(hc_head_kernel, batch, NORM_THREADS, 0, static_cast<cudaStream_t>(stream), d_X, d_m, d_base, d_scale,
                hc, dim, hc_eps, norm_eps, d_y);
    DSV4_CUDA_LAUNCHED("hc_head");
    return 0;
}
