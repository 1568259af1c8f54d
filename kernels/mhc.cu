/* SPDX-License-Identifier: MIT */
/* The manifold-constrained hyper-connections (mHC) around each sublayer and before the head: the fn
 * GEMV (split along K), pre (the RMS of the streams, the pre and post gates, the Sinkhorn-normalized
 * combine matrix, the collapsed input), post (the sublayer's output spread back into the streams),
 * and hc_head. Twins: dsv4_twin_linear_matvec (fn), dsv4_twin_mhc_pre, dsv4_twin_mhc_post
 * (engine/cpu/cpu_twin_cuda.c), dsv4_cpu_hc_head (engine/cpu/cpu_mhc.c). */
#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/norm_row.cuh"
#include "kernels/pending.cuh"

static __device__ __forceinline__ float sigmoidf_(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

/* mHC pre, split over the chip: grid (ceil(dim / MHC_COLS), batch), one column per thread. Every
 * block of a token first gathers the token's mix values m [(2 + HC) * HC] (or [HC] for the head) and
 * the sum of squares of its hc * dim stream values (for the RMS), each as a sum of the fn GEMV's
 * chunk partials in one fixed order, so every block of the token gets the same r and pre gates;
 * then it collapses its columns, y = sum_j pre_j X[j]; warp 0 of block 0 of the token also writes
 * the post gates and the combine matrix (softmax + Sinkhorn) after its own column. A token's
 * arithmetic never depends on the batch. HC is the stream count (a template so that the matrix
 * lives in registers). The sum of squares comes with the fn's partials (mhc_fn_part_kernel reads
 * the same values), so no block reads all of a token's streams: at batch 1, four blocks reading
 * 64 KB each had cost ~8.5 us a sublayer. */
#define MHC_COLS NORM_THREADS

/* The fn GEMV's chunking (grid (chunks, ceil(batch / MHC_FN_NB)), MHC_FN_ROWS weight rows a warp at
 * a time, each lane holding MHC_FN_PER_LANE float4 of x per batch row): see mhc_fn_part_kernel. */
#define MHC_FN_NB 8
#define MHC_FN_ROWS 4           /* weight rows a warp takes at once: with MHC_FN_NB tokens, 32 dots */
#define MHC_FN_PER_LANE (DSV4_CUDA_MHC_FN_CHUNK / (DSV4_CUDA_WARP * 4))

static_assert(DSV4_CUDA_MHC_FN_CHUNK % (DSV4_CUDA_WARP * 4) == 0, "a chunk is whole float4 per lane");
static_assert(MHC_FN_NB == NORM_THREADS / DSV4_CUDA_WARP, "one warp per batch row for the sums of squares");
static_assert(MHC_FN_ROWS * MHC_FN_NB == DSV4_CUDA_WARP, "one dot product a lane after the fold");

static __device__ __forceinline__ float sq4(float acc, float4 v)
{
    acc = __fmaf_rn(v.x, v.x, acc);
    acc = __fmaf_rn(v.y, v.y, acc);
    acc = __fmaf_rn(v.z, v.z, acc);
    return __fmaf_rn(v.w, v.w, acc);
}

/* The sum of squares of one fn chunk (x[k0 .. k0 + DSV4_CUDA_MHC_FN_CHUNK) of a row of n values):
 * the lanes' float4 in the fn kernel's order, then the butterfly. Every lane gets it. */
static __device__ __forceinline__ float chunk_ss(const float *__restrict__ x, int64_t k0, int64_t n)
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < MHC_FN_PER_LANE; i++) {
        const int64_t k = k0 + (int64_t)(i * DSV4_CUDA_WARP + lane) * 4;
        const float4 v = make_float4(k < n ? x[k] : 0.0f, k + 1 < n ? x[k + 1] : 0.0f, k + 2 < n ? x[k + 2] : 0.0f,
                                     k + 3 < n ? x[k + 3] : 0.0f);
        acc = sq4(acc, v);
    }
    return dsv4_warp_sum(acc);
}

/* sum over c < chunks of p[c * stride]: lane l adds chunks l, l + 32, ... in order, then the
 * butterfly. Every lane gets it. */
static __device__ __forceinline__ float chunk_total(const float *p, int chunks, int64_t stride)
{
    float acc = 0.0f;
    for (int c = threadIdx.x % DSV4_CUDA_WARP; c < chunks; c += DSV4_CUDA_WARP)
        acc += p[(int64_t)c * stride];
    return dsv4_warp_sum(acc);
}

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

/* What a launch of mhc_pre_kernel makes: everything (y, post, comb), y only, post and comb only
 * (one block a token: the Sinkhorn's ~40 dependent normalizations are the longest part, so the
 * step runs them on its side lane while the main lane goes on with y), or hc_head's y (m has HC
 * values, pre gates only). */
enum { PRE_ALL = 0, PRE_Y = 1, PRE_COMB = 2, PRE_HEAD = 3 };

/* m, or (m NULL) mparts: the fn's partials [batch, chunks, MIX + 1] whose last column is the
 * chunk's sum of squares; with m, the sums of squares are made here from X in the same chunks
 * (dynamic shared memory of chunks floats). */
template <int HC, int MODE>
__global__ void __launch_bounds__(NORM_THREADS)
mhc_pre_kernel(const float *__restrict__ X, const float *__restrict__ m, const float *__restrict__ mparts, int chunks,
               const float *__restrict__ base, const float *__restrict__ scale, int dim, int iters, float hc_eps,
               float norm_eps, float *__restrict__ y, float *__restrict__ post, float *__restrict__ comb)
{
    dsv4_pdl_enter();
    constexpr int MIX = MODE == PRE_HEAD ? HC : (2 + HC) * HC, WARPS = NORM_THREADS / DSV4_CUDA_WARP;
    __shared__ float pre[HC], m_s[MIX + 1];         /* m_s[MIX]: the token's sum of squares */
    extern __shared__ float ss_s[];                 /* without partials: [chunks] */
    const int b = blockIdx.y, lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    const int64_t n = (int64_t)HC * dim;
    const float *Xb = X + (int64_t)b * n;

    if (mparts) {
        /* the rows this launch reads: the pre gates' HC and the sum of squares for y alone, all for
         * post and comb (each row's sum is the same whichever launch makes it) */
        const float *wb = mparts + (int64_t)b * chunks * (MIX + 1);
        constexpr int ROWS = MODE == PRE_Y ? HC + 1 : MIX + 1;
        for (int i = warp; i < ROWS; i += WARPS) {
            const int r = MODE == PRE_Y && i == HC ? MIX : i;
            const float acc = chunk_total(wb + r, chunks, MIX + 1);
            if (lane == 0)
                m_s[r] = acc;
        }
    } else {
        for (int r = threadIdx.x; r < MIX; r += NORM_THREADS)
            m_s[r] = m[(int64_t)b * MIX + r];
        for (int c = warp; c < chunks; c += WARPS) {
            const float acc = chunk_ss(Xb, (int64_t)c * DSV4_CUDA_MHC_FN_CHUNK, n);
            if (lane == 0)
                ss_s[c] = acc;
        }
        __syncthreads();
        if (warp == 0) {
            const float acc = chunk_total(ss_s, chunks, 1);
            if (lane == 0)
                m_s[MIX] = acc;
        }
    }
    __syncthreads();
    const float r = 1.0f / sqrtf(m_s[MIX] / n + norm_eps);
    if (MODE != PRE_COMB) {
        if (threadIdx.x < HC)
            pre[threadIdx.x] = sigmoidf_(m_s[threadIdx.x] * r * scale[0] + base[threadIdx.x]) + hc_eps;
        __syncthreads();
        const int d = blockIdx.x * MHC_COLS + threadIdx.x;
        if (d < dim) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < HC; j++)
                acc += pre[j] * Xb[(int64_t)j * dim + d];
            y[(int64_t)b * dim + d] = acc;
        }
    }
    if (MODE == PRE_Y || MODE == PRE_HEAD || blockIdx.x != 0 || threadIdx.x >= DSV4_CUDA_WARP)
        return;
    if (threadIdx.x < HC)
        post[b * HC + threadIdx.x] = 2.0f * sigmoidf_(m_s[HC + threadIdx.x] * r * scale[1] + base[HC + threadIdx.x]);
    if constexpr (HC * HC <= DSV4_CUDA_WARP)
        mhc_comb_warp<HC>(m_s, r, scale, base, iters, hc_eps, comb + (int64_t)b * HC * HC);
    else if (threadIdx.x == 0)
        mhc_comb_serial<HC>(m_s, r, scale, base, iters, hc_eps, comb + (int64_t)b * HC * HC);
}

template <int HC, int MODE>
static void launch_mhc_pre(const float *d_X, const float *d_m, const float *d_mparts, int chunks, const float *d_base,
                           const float *d_scale, int batch, int dim, int iters, float hc_eps, float norm_eps,
                           float *d_y, float *d_post, float *d_comb, cudaStream_t s)
{
    const size_t smem = d_mparts ? 0 : (size_t)chunks * sizeof(float);
    dim3 grid(MODE == PRE_COMB ? 1u : (unsigned)((dim + MHC_COLS - 1) / MHC_COLS), (unsigned)batch);
    dsv4_launch(mhc_pre_kernel<HC, MODE>, grid, NORM_THREADS, smem, s, d_X, d_m, d_mparts, chunks, d_base, d_scale,
                dim, iters, hc_eps, norm_eps, d_y, d_post, d_comb);
}

/* Chunk count of the fn GEMV over rows of `in` values: the partials' middle dimension. */
static int fn_chunks(int64_t in)
{
    return (int)((in + DSV4_CUDA_MHC_FN_CHUNK - 1) / DSV4_CUDA_MHC_FN_CHUNK);
}

/* Without partials the sums of squares of a token's chunks sit in shared memory: at most this many. */
#define MHC_MAX_SS_CHUNKS (48 * 1024 / (int)sizeof(float))

#define MHC_LAUNCHERS(MODE)                                                                                  \
    {                                                                                                         \
        launch_mhc_pre<1, MODE>, launch_mhc_pre<2, MODE>, launch_mhc_pre<3, MODE>, launch_mhc_pre<4, MODE>,   \
            launch_mhc_pre<5, MODE>, launch_mhc_pre<6, MODE>, launch_mhc_pre<7, MODE>, launch_mhc_pre<8, MODE>, \
    }

/* d_m the fn output, or (d_m NULL) d_mparts its split-K partials [batch, chunks, mix + 1]; `mode`
 * one of PRE_*, the outputs it does not make unused. */
static int mhc_pre(const float *d_X, const float *d_m, const float *d_mparts, int chunks, const float *d_base,
                   const float *d_scale, int batch, int hc, int dim, int iters, float hc_eps, float norm_eps,
                   float *d_y, float *d_post, float *d_comb, int mode, cudaStream_t s)
{
    typedef void (*launcher)(const float *, const float *, const float *, int, const float *, const float *, int, int,
                             int, float, float, float *, float *, float *, cudaStream_t);
    static const launcher launchers[4][8] = { MHC_LAUNCHERS(PRE_ALL), MHC_LAUNCHERS(PRE_Y), MHC_LAUNCHERS(PRE_COMB),
                                              MHC_LAUNCHERS(PRE_HEAD) };
    static_assert(sizeof(launchers[0]) / sizeof(launchers[0][0]) == DSV4_MAX_HC, "one launcher per hc 1..DSV4_MAX_HC");
    const char *what = mode == PRE_HEAD ? "hc_head" : mode == PRE_COMB ? "mhc_comb" : "mhc_pre";
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "%s: hc_mult %d outside 1..%d", what, hc, DSV4_MAX_HC);
    if (batch < 1 || dim < 1)
        return 0;
    if (!d_mparts) {
        chunks = fn_chunks((int64_t)hc * dim);
        if (chunks > MHC_MAX_SS_CHUNKS)
            return dsv4_error_set(-EINVAL, "%s: %d streams of %d values exceed the %d chunks of %d values one block "
                                  "sums", what, hc, dim, MHC_MAX_SS_CHUNKS, DSV4_CUDA_MHC_FN_CHUNK);
    }
    dsv4_cuda_count_launch(DSV4_CUDA_V_MHC_PRE);
    launchers[mode][hc - 1](d_X, d_m, d_mparts, chunks, d_base, d_scale, batch, dim, iters, hc_eps, norm_eps, d_y,
                            d_post, d_comb, s);
    DSV4_CUDA_LAUNCHED(what);
    return 0;
}

extern "C" int dsv4_cuda_mhc_pre(const float *d_X, const float *d_m, const float *d_base, const float *d_scale,
                                 int batch, int hc, int dim, int iters, float hc_eps, float norm_eps,
                                 float *d_y, float *d_post, float *d_comb, void *stream)
{
    return mhc_pre(d_X, d_m, nullptr, 0, d_base, d_scale, batch, hc, dim, iters, hc_eps, norm_eps, d_y, d_post,
                   d_comb, PRE_ALL, static_cast<cudaStream_t>(stream));
}

/* The mHC fn GEMV, split along K: d_ws[b, c, r] = W[r, chunk c] . x_b[chunk c] for fixed chunks of
 * DSV4_CUDA_MHC_FN_CHUNK values, and d_ws[b, c, out] = the chunk's sum of squares of x_b (mHC pre's
 * and hc_head's RMS); then d_y[b, r] = sum over c (chunk_total). Both steps depend on row b alone:
 * batch-invariant and deterministic. grid (chunks, ceil(batch / MHC_FN_NB)), a warp per
 * MHC_FN_ROWS weight rows (groups of rows strided over the warps), warp j also summing the squares
 * of batch row j; each lane holds MHC_FN_PER_LANE float4 of x per batch row. */

/* One level of a transposing butterfly over the N values p[0 .. N) of every lane: lanes whose bit
 * N / 2 is set keep the upper half, the others the lower; each adds its partner's copy of the half
 * it keeps (own + partner, as dsv4_warp_sum adds) into p[0 .. N / 2). After the levels 32 .. 2,
 * lane j holds value j summed over the 32 lanes in dsv4_warp_sum's tree. */
template <int N>
static __device__ __forceinline__ void mhc_fold(float (&p)[DSV4_CUDA_WARP])
{
    const bool up = threadIdx.x & (N / 2);
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const float keep = up ? p[i + N / 2] : p[i], give = up ? p[i] : p[i + N / 2];
        p[i] = keep + __shfl_xor_sync(0xffffffffu, give, N / 2);
    }
}

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
#pragma unroll
    for (int b = 0; b < MHC_FN_NB; b++) {       /* chunk_ss's arithmetic on the values in registers */
        if (warp == b && b < nb) {
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < MHC_FN_PER_LANE; i++)
                acc = sq4(acc, xv[b][i]);
            acc = dsv4_warp_sum(acc);
            if (lane == 0)
                ws[((int64_t)(b0 + b) * chunks + c) * (out + 1) + out] = acc;
        }
    }
    /* A warp takes MHC_FN_ROWS weight rows against the block's MHC_FN_NB tokens: 32 dot products,
     * each lane's share of each in registers (its float4 in the order chunk_ss reads them), then one
     * transposing butterfly (mhc_fold) leaves dot j summed in lane j over the tree dsv4_warp_sum
     * builds: 31 shuffles a lane for 32 dots where a butterfly a dot took 5 a dot (the kernel was
     * shuffle-bound at prefill's 1024 rows: ~170 us for 64 MB of streams). Rows or tokens past the
     * ends hold zeros and are not stored. */
    constexpr int WARPS = NORM_THREADS / DSV4_CUDA_WARP;
    for (int r0 = warp * MHC_FN_ROWS; r0 < out; r0 += MHC_FN_ROWS * WARPS) {
        float4 wv[MHC_FN_ROWS][MHC_FN_PER_LANE];
        float p[DSV4_CUDA_WARP];
#pragma unroll
        for (int j = 0; j < MHC_FN_ROWS; j++)
#pragma unroll
            for (int i = 0; i < MHC_FN_PER_LANE; i++) {
                const int64_t k = k0 + (int64_t)(i * DSV4_CUDA_WARP + lane) * 4;
                wv[j][i] = r0 + j < out && k < in ? __ldg(reinterpret_cast<const float4 *>(W + (int64_t)(r0 + j) * ldw + k))
                                                  : zero;
            }
#pragma unroll
        for (int j = 0; j < MHC_FN_ROWS; j++)
#pragma unroll
            for (int b = 0; b < MHC_FN_NB; b++) {
                float acc = 0.0f;
                if (b < nb)
#pragma unroll
                    for (int i = 0; i < MHC_FN_PER_LANE; i++)
                        acc += wv[j][i].x * xv[b][i].x + wv[j][i].y * xv[b][i].y + wv[j][i].z * xv[b][i].z +
                               wv[j][i].w * xv[b][i].w;
                p[j * MHC_FN_NB + b] = acc;
            }
        mhc_fold<32>(p);
        mhc_fold<16>(p);
        mhc_fold<8>(p);
        mhc_fold<4>(p);
        mhc_fold<2>(p);
        const int r = r0 + lane / MHC_FN_NB, b = lane % MHC_FN_NB;
        if (r < out && b < nb)
            ws[((int64_t)(b0 + b) * chunks + c) * (out + 1) + r] = p[0];
    }
}

/* grid batch: one warp per output row of token blockIdx.x. */
__global__ void __launch_bounds__(NORM_THREADS)
mhc_fn_sum_kernel(const float *__restrict__ ws, int out, int chunks, float *__restrict__ y, int64_t ldy)
{
    dsv4_pdl_enter();
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP, b = blockIdx.x;
    const float *wb = ws + (int64_t)b * chunks * (out + 1);
    for (int r = warp; r < out; r += NORM_THREADS / DSV4_CUDA_WARP) {
        const float acc = chunk_total(wb + r, chunks, out + 1);
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
    const int chunks = fn_chunks(W->in);
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
                   d_comb, d_post || d_comb ? PRE_ALL : PRE_Y, s);
}

extern "C" int dsv4_cuda_mhc_comb(const float *d_ws, int batch, const float *d_base, const float *d_scale, int hc,
                                  int dim, int iters, float hc_eps, float norm_eps, float *d_post, float *d_comb,
                                  void *stream)
{
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "mhc_comb: hc_mult %d outside 1..%d", hc, DSV4_MAX_HC);
    return mhc_pre(nullptr, nullptr, d_ws, fn_chunks((int64_t)hc * dim), d_base, d_scale, batch, hc, dim, iters,
                   hc_eps, norm_eps, nullptr, d_post, d_comb, PRE_COMB, static_cast<cudaStream_t>(stream));
}

extern "C" int dsv4_cuda_mhc_fn_head(const struct dsv4_cuda_linear *W, const float *d_X, int batch, float *d_ws,
                                     int64_t ws_floats, const float *d_base, const float *d_scale, int hc, int dim,
                                     float hc_eps, float norm_eps, float *d_y, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (hc < 1 || hc > DSV4_MAX_HC || W->out != hc || W->in != (int64_t)hc * dim)
        return dsv4_error_set(-EINVAL, "mhc_fn_head: fn [%lld, %lld] for hc_mult %d (1..%d) and dim %d must be "
                              "[hc, hc dim]", (long long)W->out, (long long)W->in, hc, DSV4_MAX_HC, dim);
    const int chunks = mhc_fn_parts(W, d_X, (int64_t)hc * dim, batch, d_ws, ws_floats, s);
    if (chunks < 0)
        return chunks;
    return mhc_pre(d_X, nullptr, d_ws, chunks, d_base, d_scale, batch, hc, dim, 0, hc_eps, norm_eps, d_y, nullptr,
                   nullptr, PRE_HEAD, s);
}

/* One thread per (b, d): the hc stream values X[b, :, d] read once into registers, then every
 * output Xo[b, k, d] = post[b, k] f[b, d] + sum_j comb[b, j, k] X[b, j, d] summed in j order (one
 * thread per output read each X value hc times: a prefill chunk's X is 64 MiB at 1024 rows). */
__global__ void mhc_post_kernel(const float *__restrict__ X, const float *__restrict__ f, const dsv4_cuda_pending pf,
                                const float *__restrict__ post, const float *__restrict__ comb, int batch,
                                int hc, int dim, float *__restrict__ Xo)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)batch * dim)
        return;
    const int64_t d = i % dim, b = i / dim;
    const float *Xb = X + b * hc * dim, *cb = comb + b * hc * hc;
    const float fv = pending_at(pf, f, b * dim + d);
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

extern "C" int dsv4_cuda_mhc_post(const float *d_X, const float *d_f, const struct dsv4_cuda_pending *d_pf,
                                  const float *d_post, const float *d_comb, int batch, int hc, int dim, float *d_Xo,
                                  void *stream)
{
    const int threads = 256;
    const int64_t total = (int64_t)batch * dim;     /* threads: one per (row, d) */
    int rc;
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "mhc_post: hc_mult %d outside 1..%d", hc, DSV4_MAX_HC);
    if ((rc = dsv4_cuda_pending_live(d_pf, batch, dim, "mhc_post")) < 0)
        return rc;
    if (total <= 0)
        return 0;
    dsv4_launch(mhc_post_kernel, (unsigned)((total + threads - 1) / threads), threads, 0,
                static_cast<cudaStream_t>(stream), d_X, d_f, pending_or_none(d_pf), d_post, d_comb, batch, hc, dim,
                d_Xo);
    DSV4_CUDA_LAUNCHED("mhc_post");
    return 0;
}

extern "C" int dsv4_cuda_hc_head(const float *d_X, const float *d_m, const float *d_base, const float *d_scale, int batch,
                      int hc, int dim, float hc_eps, float norm_eps, float *d_y, void *stream)
{
    return mhc_pre(d_X, d_m, nullptr, 0, d_base, d_scale, batch, hc, dim, 0, hc_eps, norm_eps, d_y, nullptr, nullptr,
                   PRE_HEAD, static_cast<cudaStream_t>(stream));
}
