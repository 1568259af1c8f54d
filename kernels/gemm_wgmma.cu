/* SPDX-License-Identifier: MIT */
/* FP8 linears for prefill chunks (more rows than the largest decode batch) on warpgroup MMAs: the
 * sm_90a image only; every other image, and DSV4_CUDA_GEMM_WGMMA=0, keeps gemm.cu's mma.sync path.
 *
 * Same bits as the mma.sync kernel, by construction:
 *   - a CTA owns the same 128 weight rows (one FP8 scale block), warp w the same 16 (w = 4 x
 *     warpgroup + warp in it), and builds each MMA's A operand from the weight tile exactly as
 *     gemm.cu does (load_wrows, fp8_afrag: each thread's 16 contiguous bytes as k-slots);
 *   - B, the activations, comes from shared memory; the activation preparation stores each 1x128
 *     block in the order gemm_wg_pos names (gemm_tile.cuh), so k16 step 4h+q of a tile reads, in
 *     each k-slot, the value that mma.sync step (h, q) feeds it;
 *   - wgmma.m64n64k16 (f16, f32 accumulation, A from registers) gives mma.sync m16n8k16's bits for
 *     each output on the H200; each 128-wide k-tile is summed from zero in the same step order (hi
 *     then lo at each step for raw x), scaled and folded exactly as gemm.cu's SEQ path: acc +=
 *     blk * (weight scale x activation scale) per tile, tot += acc at each split boundary.
 * test_gpu_linear checks prefill rows from this kernel bit for bit against the same rows alone
 * (decode path), and against the twin.
 *
 * Layout: grid (64-row block of x, weight tile), row blocks of one tile neighbours in launch order
 * (the tile from memory once, then L2). 256 threads: two warpgroups of 64 weight rows, each a
 * m64 x n64 accumulator per k-tile (blk) plus acc and tot (96 f32 registers a thread). Weight,
 * activation and activation-scale tiles move through a 4-deep cp.async ring. Activation tile in
 * shared memory, per plane: [k16 step 8][row group N/8][half 2][8 rows][16 bytes], the no-swizzle
 * core-matrix layout wgmma reads with lbo 128 (half to half) and sbo 256 (row group to row group). */
#include <cuda_fp16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/gemm_tile.cuh"
#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

#define WG_TOKENS 64                /* rows of x per CTA: the wgmma N */
#define WG_STAGES 4                 /* 193 KB at fp8raw (two planes) */
#define WG_THREADS 256              /* two warpgroups */
#define WG_STEPS 8                  /* k16 steps of a 128-wide k-tile */
#define WG_XPLANE (WG_TOKENS * GEMM_XROW_BYTES)     /* one plane of an activation tile: 16 KB */
#define WG_ACC (WG_TOKENS / 2)      /* accumulator floats a thread: m64 x n64 over 128 threads */

static_assert(WG_THREADS == GEMM_THREADS, "the same warp owns the same 16 weight rows as in gemm.cu");

static __host__ __device__ constexpr size_t wg_stage_bytes(int mode)
{
    return (size_t)GEMM_ROWS * GEMM_TILE_BYTES + (size_t)xplanes(mode) * WG_XPLANE + WG_TOKENS * sizeof(float);
}

/* One thread's share of a k-tile's cp.async loads, addressed once per CTA: per tile the sources
 * advance by the tile's bytes and the destinations by the stage. Weight chunk m of the thread: row
 * tid / 8 + 32 m, 16-byte chunk tid % 8 (gemm.cu's sw128 layout); activation chunk m of plane p: row
 * group tid / 128 + 2 m, row tid % 8 in it, 16-byte chunk (tid / 8) % 16 of the row's 256 bytes, in
 * core-matrix order (8 rows of one chunk land in 128 contiguous bytes). Rows past a.out or a.rows
 * load the last one (not stored). */
#define WG_WCHUNKS (GEMM_ROWS * 8 / WG_THREADS)         /* 4 */
#define WG_XCHUNKS (WG_TOKENS * 16 / WG_THREADS)        /* 4 a plane */
static_assert(WG_TOKENS / 8 == 2 * WG_XCHUNKS && WG_THREADS == 256, "row groups tid / 128 + 2 m cover the tile");

template <int MODE>
struct wg_loader {
    const uint8_t *w[WG_WCHUNKS];
    const uint8_t *x[xplanes(MODE) * WG_XCHUNKS];
    const float *s;                 /* the activation scale of row tid (tid < WG_TOKENS) */
    uint32_t wdst, xdst, sdst;      /* offsets in a stage of chunk 0 */

    __device__ __forceinline__ wg_loader(const gemm_args &a, int64_t row0, int64_t xk0, int nb)
    {
        const int tid = threadIdx.x, c = (tid >> 3) & 15, r8 = tid & 7;
#pragma unroll
        for (int m = 0; m < WG_WCHUNKS; m++) {
            const int64_t gr = min(row0 + (tid >> 3) + 32 * m, a.out - 1);
            w[m] = a.w + gr * a.row_bytes + (tid & 7) * 16;
        }
        wdst = (uint32_t)((tid >> 3) * GEMM_TILE_BYTES + sw128(tid >> 3, tid & 7) * 16);
#pragma unroll
        for (int p = 0; p < xplanes(MODE); p++)
#pragma unroll
            for (int m = 0; m < WG_XCHUNKS; m++) {
                const int gn = min(nb + ((tid >> 7) + 2 * m) * 8 + r8, a.rows - 1);
                x[p * WG_XCHUNKS + m] = a.xa + (((int64_t)p * a.rows + gn) * a.k + xk0) * 2 + c * 16;
            }
        xdst = (uint32_t)(GEMM_ROWS * GEMM_TILE_BYTES + ((c >> 1) * (WG_TOKENS / 8) + (tid >> 7)) * 256 +
                          (c & 1) * 128 + r8 * 16);
        s = a.sa + (int64_t)min(nb + tid, a.rows - 1) * (a.k / 128) + xk0 / 128;
        sdst = (uint32_t)(GEMM_ROWS * GEMM_TILE_BYTES + xplanes(MODE) * WG_XPLANE + tid * 4);
    }

    __device__ __forceinline__ void load(uint8_t *st, int kt) const
    {
#pragma unroll
        for (int m = 0; m < WG_WCHUNKS; m++)
            dsv4_cp_async16(st + wdst + m * 32 * GEMM_TILE_BYTES, w[m] + (int64_t)kt * GEMM_TILE_BYTES);
#pragma unroll
        for (int p = 0; p < xplanes(MODE); p++)
#pragma unroll
            for (int m = 0; m < WG_XCHUNKS; m++)
                dsv4_cp_async16(st + xdst + p * WG_XPLANE + m * 2 * 256, x[p * WG_XCHUNKS + m] + (int64_t)kt * 256);
        if (threadIdx.x < WG_TOKENS)
            dsv4_cp_async4(st + sdst, s + kt);
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* The A fragments of a k-tile's 8 steps from the stage's weight tile (gemm.cu's construction), then
 * the 8 (raw x: 16) wgmmas into blk from zero, committed as one group. */
template <int MODE>
static __device__ __forceinline__ void wg_issue(const uint8_t *st, int r0, int r1, int t, float (&blk)[WG_ACC])
{
    const uint8_t *xs = st + GEMM_ROWS * GEMM_TILE_BYTES;
    uint32_t af[WG_STEPS][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t w0v[4], w1v[4];
        load_wrows(st, r0, r1, t + 4 * h, w0v, w1v);
#pragma unroll
        for (int q = 0; q < 4; q++)
            fp8_afrag(w0v, w1v, q, af[4 * h + q]);
    }
#pragma unroll
    for (int j = 0; j < WG_ACC; j++) {
        blk[j] = 0.0f;
        dsv4_wgmma_pin(blk[j]);
    }
    dsv4_wgmma_fence();
#pragma unroll
    for (int s = 0; s < WG_STEPS; s++) {
        dsv4_wgmma_f16_n64(blk, af[s], dsv4_wgmma_desc(xs + s * (WG_TOKENS / 8) * 256, 128, 256));
        if (MODE == GEMM_FP8RAW)
            dsv4_wgmma_f16_n64(blk, af[s], dsv4_wgmma_desc(xs + WG_XPLANE + s * (WG_TOKENS / 8) * 256, 128, 256));
    }
    dsv4_wgmma_commit();
}

/* acc += blk x (weight scale x row scale) for k-tile kt (gemm.cu's arithmetic); at a split's end,
 * tot += acc and acc = 0 */
static __device__ __forceinline__ void wg_fold(const float (&blk)[WG_ACC], const float *ss, float sw, int t,
                                               bool split_end, float (&acc)[WG_ACC], float (&tot)[WG_ACC])
{
#pragma unroll
    for (int j = 0; j < WG_TOKENS / 8; j++) {
        const float2 sr = *reinterpret_cast<const float2 *>(ss + j * 8 + 2 * t);
        const float s0 = sw * sr.x, s1 = sw * sr.y;
        acc[4 * j + 0] += blk[4 * j + 0] * s0;
        acc[4 * j + 1] += blk[4 * j + 1] * s1;
        acc[4 * j + 2] += blk[4 * j + 2] * s0;
        acc[4 * j + 3] += blk[4 * j + 3] * s1;
    }
    if (split_end)
#pragma unroll
        for (int j = 0; j < WG_ACC; j++) {
            tot[j] += acc[j];
            acc[j] = 0.0f;
        }
}
#endif

template <int MODE>
__global__ void __launch_bounds__(WG_THREADS, 1) gemm_wgmma_kernel(const gemm_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) uint8_t smem[];
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3;
    const int64_t row0 = (int64_t)blockIdx.y * GEMM_ROWS;
    const int nb = (int)blockIdx.x * WG_TOKENS, nk = a.nkt;

    gemm_prefetch_weights(a, row0, 0, nk, (int)(blockIdx.y * gridDim.x + blockIdx.x));
    dsv4_pdl_enter();
    constexpr uint32_t sbytes = (uint32_t)wg_stage_bytes(MODE);
    const int64_t xk0 = (row0 / a.grp_rows) * a.nkt * 128;
    const wg_loader<MODE> ld(a, row0, xk0, nb);
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const uint8_t *wscale = a.wscale + (row0 / GEMM_ROWS) * a.scale_stride;
    float blk[WG_ACC], acc[WG_ACC], tot[WG_ACC];

#pragma unroll
    for (int i = 0; i < WG_ACC; i++) {
        acc[i] = 0.0f;
        tot[i] = 0.0f;
    }
#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; s++) {
        if (s < nk)
            ld.load(smem + s * sbytes, s);
        dsv4_cp_async_commit();
    }
    int left = a.per;                   /* k-tiles to the end of the split */
    for (int i = 0; i < nk; i++) {
        const float sw = dsv4_ue8m0(__ldg(wscale + i));
        dsv4_cp_async_wait<WG_STAGES - 2>();
        dsv4_fence_proxy_async();       /* this thread's copies, visible to the wgmma reads below */
        __syncthreads();
        {
            const int nx = i + WG_STAGES - 1;
            if (nx < nk)
                ld.load(smem + (nx % WG_STAGES) * sbytes, nx);
            dsv4_cp_async_commit();
        }
        const uint8_t *st = smem + (i % WG_STAGES) * sbytes;
        wg_issue<MODE>(st, r0, r1, t, blk);
        dsv4_wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < WG_ACC; j++)
            dsv4_wgmma_pin(blk[j]);
        const bool split_end = --left == 0 || i + 1 == nk;
        if (split_end)
            left = a.per;
        wg_fold(blk, reinterpret_cast<const float *>(st + GEMM_ROWS * GEMM_TILE_BYTES + xplanes(MODE) * WG_XPLANE), sw, t,
                split_end, acc, tot);
    }
    dsv4_cp_async_wait<0>();

#pragma unroll
    for (int j = 0; j < WG_TOKENS / 8; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int n = nb + j * 8 + 2 * t + (q & 1);
            const int64_t o = row0 + (q < 2 ? r0 : r1);
            if (n < a.rows && o < a.out)
                a.y[(int64_t)n * a.ldy + o] = tot[4 * j + q];
        }
#else
    __trap();   /* launched only where gemm_wgmma_prepare found the sm_90a image */
#endif
}

int gemm_wgmma_prepare(int smem_optin, bool *available)
{
    cudaFuncAttributes fa;
    *available = false;
    DSV4_CUDA_TRY(cudaFuncGetAttributes(&fa, gemm_wgmma_kernel<GEMM_FP8>));
    if (fa.binaryVersion != 90 || fa.ptxVersion < 90 || (size_t)smem_optin < WG_STAGES * wg_stage_bytes(GEMM_FP8RAW))
        return 0;       /* not the sm_90a image (the JIT-compiled PTX, another GPU's cubin), or too little memory */
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_wgmma_kernel<GEMM_FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(WG_STAGES * wg_stage_bytes(GEMM_FP8))));
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_wgmma_kernel<GEMM_FP8RAW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(WG_STAGES * wg_stage_bytes(GEMM_FP8RAW))));
    *available = true;
    return 0;
}

int gemm_wgmma_launch(int mode, gemm_args a, int sms, int64_t prefetch, cudaStream_t s)
{
    const dim3 grid((unsigned)((a.rows + WG_TOKENS - 1) / WG_TOKENS), (unsigned)((a.out + GEMM_ROWS - 1) / GEMM_ROWS));
    gemm_set_prefetch(&a, (int64_t)grid.x * grid.y, sms, a.nkt, prefetch);
    if (mode == GEMM_FP8)
        dsv4_launch(gemm_wgmma_kernel<GEMM_FP8>, grid, WG_THREADS, WG_STAGES * wg_stage_bytes(GEMM_FP8), s, a);
    else
        dsv4_launch(gemm_wgmma_kernel<GEMM_FP8RAW>, grid, WG_THREADS, WG_STAGES * wg_stage_bytes(GEMM_FP8RAW), s, a);
    DSV4_CUDA_LAUNCHED(mode == GEMM_FP8 ? "gemm_fp8_wgmma" : "gemm_fp8raw_wgmma");
    return 0;
}
