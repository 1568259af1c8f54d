/* SPDX-License-Identifier: MIT */
/* FP8 linears for prefill chunks (more rows than the largest decode batch) on warpgroup MMAs: the
 * sm_90a image only; every other image, and DSV4_CUDA_GEMM_WGMMA=0, keeps gemm.cu's mma.sync path.
 *
 * Same bits as the mma.sync kernel, by construction:
 *   - a CTA owns the same 128 weight rows (one FP8 scale block), warp w the same 16 (w = 4 x
 *     warpgroup + warp in it), and builds each MMA's A operand from the weight tile exactly as
 *     gemm.cu does (16 contiguous bytes of a row per thread as k-slots, fp8_afrag);
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
 * (the tile from memory once, then L2). 288 threads: two warpgroups of 64 weight rows, each a
 * m64 x n64 accumulator per k-tile (blk) plus acc and tot (96 f32 registers a thread), and one
 * producer warp. The producer moves each k-tile into a ring of stages with TMA (the weight tile, and
 * x in two 64-value halves per plane, all in the 128-byte swizzle wgmma reads) and cp.async (the 64
 * activation scales), counted on the stage's `full` mbarrier; each MMA warp signals the stage's
 * `empty` mbarrier when it is done with it. No block-wide barrier inside the loop: the warpgroups
 * drift apart, so one folds and converts while the other's MMAs run.
 *
 * Weight rows in shared memory carry the swizzle too (chunk c of row r at c ^ (r % 8)). A quarter
 * warp reads chunks t (+4h) of two fragment rows; fragment row g of a warp is tile row 16w + rho(g)
 * (and + 8), rho sending g = 2i, 2i + 1 to rows i and i + 4, whose swizzles differ in bit 2, so the
 * two rows' chunks fall in different halves of the bank window. Which lane holds which output row
 * does not change any output's arithmetic. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/gemm_tile.cuh"
#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

#define WG_TOKENS 64                /* rows of x per CTA: the wgmma N */
#define WG_MMA_THREADS 256          /* two warpgroups */
#define WG_THREADS (WG_MMA_THREADS + DSV4_CUDA_WARP)    /* and the producer warp */
#define WG_PRODUCER (WG_MMA_THREADS / DSV4_CUDA_WARP)   /* its warp index */
#define WG_STEPS 8                  /* k16 steps of a 128-wide k-tile */
#define WG_HALF (WG_TOKENS * 128)   /* one 64-value half of an activation k-tile (f16): 8 KB */
#define WG_XPLANE (2 * WG_HALF)     /* one plane of an activation k-tile: 16 KB */
#define WG_ACC (WG_TOKENS / 2)      /* accumulator floats a thread: m64 x n64 over 128 threads */
#define WG_ALIGN 1024               /* the 128-byte swizzle repeats every 8 rows of 128 bytes */
#define WG_WBYTES (GEMM_ROWS * GEMM_TILE_BYTES)         /* weight tile: 16 KB */

static_assert(WG_MMA_THREADS == GEMM_THREADS, "the same warp owns the same 16 weight rows as in gemm.cu");
static_assert(WG_TOKENS <= DSV4_CUDA_WARP * 2, "the producer warp loads the scales two a lane");

/* weight tile, activation planes, activation scales; each stage starts on WG_ALIGN */
static __host__ __device__ constexpr size_t wg_stage_bytes(int mode)
{
    return ((size_t)WG_WBYTES + (size_t)xplanes(mode) * WG_XPLANE + WG_TOKENS * sizeof(float) + WG_ALIGN - 1) /
           WG_ALIGN * WG_ALIGN;
}

/* 6 stages of 33 KB (quantized x) or 4 of 49 KB (raw x, two planes): ~200 KB either way */
static __host__ __device__ constexpr int wg_stages(int mode)
{
    return mode == GEMM_FP8RAW ? 4 : 6;
}

/* dynamic shared memory: the ring, its mbarriers (full and empty per stage), the alignment slack */
static __host__ __device__ constexpr size_t wg_smem_bytes(int mode)
{
    return wg_stages(mode) * wg_stage_bytes(mode) + 2 * wg_stages(mode) * sizeof(uint64_t) + WG_ALIGN;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* tile row of fragment row g (0..7) of a warp's 16 rows (see the top of the file) */
static __device__ __forceinline__ int wg_rho(int g)
{
    return (g >> 1) | ((g & 1) << 2);
}

/* The A fragments of a k-tile's 8 steps from the stage's weight tile (gemm.cu's construction), then
 * the 8 (raw x: 16) wgmmas into blk from zero, committed as one group. */
template <int MODE>
static __device__ __forceinline__ void wg_issue(const uint8_t *st, int r0, int r1, int t, float (&blk)[WG_ACC])
{
    const uint8_t *xs = st + WG_WBYTES;
    uint32_t af[WG_STEPS][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t w0v[4], w1v[4];
        load_wrows<true>(st, r0, r1, t + 4 * h, w0v, w1v);
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
        const uint8_t *b = xs + (s >> 2) * WG_HALF + (s & 3) * 32;
        dsv4_wgmma_f16_n64(blk, af[s], dsv4_wgmma_desc_sw128(b));
        if (MODE == GEMM_FP8RAW)
            dsv4_wgmma_f16_n64(blk, af[s], dsv4_wgmma_desc_sw128(b + WG_XPLANE));
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

/* The producer warp: for each k-tile, once its stage is free, the TMA loads (lane 0) and the 64
 * activation scales (two a lane; rows past a.rows read the last row, not stored). */
template <int MODE>
static __device__ __forceinline__ void wg_produce(const gemm_args &a, const CUtensorMap *tw, const CUtensorMap *tx,
                                                  uint8_t *ring, uint64_t *full, uint64_t *empty, int64_t row0,
                                                  int64_t xk0, int nb)
{
    constexpr int ST = wg_stages(MODE);
    constexpr uint32_t sbytes = (uint32_t)wg_stage_bytes(MODE);
    const int lane = threadIdx.x % DSV4_CUDA_WARP, nk = a.nkt;
    const int64_t sab = a.k / 128;
    const float *s0 = a.sa + (int64_t)min(nb + lane, a.rows - 1) * sab + xk0 / 128;
    const float *s1 = a.sa + (int64_t)min(nb + lane + DSV4_CUDA_WARP, a.rows - 1) * sab + xk0 / 128;
    for (int i = 0; i < nk; i++) {
        const int s = i % ST;
        uint8_t *st = ring + s * sbytes;
        if (i >= ST)
            dsv4_mbar_wait(&empty[s], (uint32_t)((i / ST) - 1) & 1);
        if (lane == 0) {
            dsv4_mbar_expect_tx(&full[s], WG_WBYTES + xplanes(MODE) * WG_XPLANE);
            dsv4_tma_load_2d(st, tw, &full[s], i * GEMM_TILE_BYTES, (int)row0);
#pragma unroll
            for (int p = 0; p < xplanes(MODE); p++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    dsv4_tma_load_2d(st + WG_WBYTES + p * WG_XPLANE + h * WG_HALF, tx, &full[s],
                                     (int)(xk0 + (int64_t)i * 128 + h * 64), p * a.rows + nb);
        }
        float *ss = reinterpret_cast<float *>(st + WG_WBYTES + xplanes(MODE) * WG_XPLANE);
        dsv4_cp_async4(ss + lane, s0 + i);
        dsv4_cp_async4(ss + lane + DSV4_CUDA_WARP, s1 + i);
        dsv4_cp_async_arrive(&full[s]);
    }
    dsv4_cp_async_wait<0>();
}
#endif

template <int MODE>
__global__ void __launch_bounds__(WG_THREADS, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tx, const gemm_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ST = wg_stages(MODE);
    constexpr uint32_t sbytes = (uint32_t)wg_stage_bytes(MODE);
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *ring = smem + ((WG_ALIGN - (dsv4_smem_addr(smem) & (WG_ALIGN - 1))) & (WG_ALIGN - 1));
    uint64_t *full = reinterpret_cast<uint64_t *>(ring + ST * sbytes), *empty = full + ST;
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3;
    const int64_t row0 = (int64_t)blockIdx.y * GEMM_ROWS;
    const int nb = (int)blockIdx.x * WG_TOKENS, nk = a.nkt;
    const int64_t xk0 = (row0 / a.grp_rows) * a.nkt * 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; s++) {
            dsv4_mbar_init(&full[s], 1 + DSV4_CUDA_WARP);      /* the TMA arrival + the scale copies */
            dsv4_mbar_init(&empty[s], WG_MMA_THREADS / DSV4_CUDA_WARP);
        }
        dsv4_mbar_init_fence();
    }
    if (warp < WG_PRODUCER)
        gemm_prefetch_weights(a, row0, 0, nk, (int)(blockIdx.y * gridDim.x + blockIdx.x));
    __syncthreads();
    dsv4_pdl_enter();
    if (warp == WG_PRODUCER) {
        wg_produce<MODE>(a, &tw, &tx, ring, full, empty, row0, xk0, nb);
        return;
    }

    const int r0 = warp * 16 + wg_rho(g), r1 = r0 + 8;
    const uint8_t *wscale = a.wscale + (row0 / GEMM_ROWS) * a.scale_stride;
    float blk[WG_ACC], acc[WG_ACC], tot[WG_ACC];

#pragma unroll
    for (int i = 0; i < WG_ACC; i++) {
        acc[i] = 0.0f;
        tot[i] = 0.0f;
    }
    int left = a.per;                   /* k-tiles to the end of the split */
    for (int i = 0; i < nk; i++) {
        const int s = i % ST;
        const uint8_t *st = ring + s * sbytes;
        const float sw = dsv4_ue8m0(__ldg(wscale + i));
        dsv4_mbar_wait(&full[s], (uint32_t)(i / ST) & 1);
        wg_issue<MODE>(st, r0, r1, t, blk);
        dsv4_wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < WG_ACC; j++)
            dsv4_wgmma_pin(blk[j]);
        const bool split_end = --left == 0 || i + 1 == nk;
        if (split_end)
            left = a.per;
        wg_fold(blk, reinterpret_cast<const float *>(st + WG_WBYTES + xplanes(MODE) * WG_XPLANE), sw, t, split_end,
                acc, tot);
        __syncwarp();
        if (lane == 0)
            dsv4_mbar_arrive(&empty[s]);
    }

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

/* cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda) */
static PFN_cuTensorMapEncodeTiled_v12000 wg_encode;

/* *why_not: NULL where the wgmma kernels run here, else why not (for the boot log). */
int gemm_wgmma_prepare(int smem_optin, const char **why_not)
{
    cudaFuncAttributes fa;
    DSV4_CUDA_TRY(cudaFuncGetAttributes(&fa, gemm_wgmma_kernel<GEMM_FP8>));
    if (fa.binaryVersion != 90 || fa.ptxVersion < 90) {
        *why_not = "not the sm_90a image";      /* the JIT-compiled PTX, or another GPU's cubin */
        return 0;
    }
    if ((size_t)smem_optin < wg_smem_bytes(GEMM_FP8) || (size_t)smem_optin < wg_smem_bytes(GEMM_FP8RAW)) {
        *why_not = "too little shared memory a block";
        return 0;
    }
    cudaDriverEntryPointQueryResult q;
    void *fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || !fn) {
        (void)cudaGetLastError();
        *why_not = "a driver without cuTensorMapEncodeTiled";
        return 0;
    }
    wg_encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_wgmma_kernel<GEMM_FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)wg_smem_bytes(GEMM_FP8)));
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_wgmma_kernel<GEMM_FP8RAW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)wg_smem_bytes(GEMM_FP8RAW)));
    *why_not = nullptr;
    return 0;
}

/* A 2D tensor map of `rows` rows of `cols` elements (`esize` bytes each, rows `pitch` bytes apart),
 * boxes of bcols x brows in the 128-byte swizzle; out-of-range rows and columns read as zero. */
static int wg_map(CUtensorMap *m, const void *base, CUtensorMapDataType type, int esize, int64_t cols, int64_t rows,
                  int64_t pitch, uint32_t bcols, uint32_t brows)
{
    const cuuint64_t dim[2] = { (cuuint64_t)cols, (cuuint64_t)rows }, stride[1] = { (cuuint64_t)pitch };
    const cuuint32_t box[2] = { bcols, brows }, estride[2] = { 1, 1 };
    const CUresult r = wg_encode(m, type, 2, const_cast<void *>(base), dim, stride, box, estride,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return dsv4_error_set(-EINVAL, "gemm_wgmma: tensor map of [%lld, %lld] x %d bytes (pitch %lld, box %u x %u) "
                              "refused by the driver (CUresult %d)", (long long)rows, (long long)cols, esize,
                              (long long)pitch, bcols, brows, (int)r);
    return 0;
}

int gemm_wgmma_launch(int mode, gemm_args a, int sms, int64_t prefetch, cudaStream_t s)
{
    const dim3 grid((unsigned)((a.rows + WG_TOKENS - 1) / WG_TOKENS), (unsigned)((a.out + GEMM_ROWS - 1) / GEMM_ROWS));
    CUtensorMap tw, tx;
    int rc;
    /* W [out, K] e4m3: 128 rows x 128 bytes a k-tile; x [planes x rows, k] f16: 64 rows x 64 values a half */
    if ((rc = wg_map(&tw, a.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, (int64_t)a.nkt * GEMM_TILE_BYTES, a.out, a.row_bytes,
                     GEMM_TILE_BYTES, GEMM_ROWS)) < 0 ||
        (rc = wg_map(&tx, a.xa, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, a.k, (int64_t)xplanes(mode) * a.rows, a.k * 2, 64,
                     WG_TOKENS)) < 0)
        return rc;
    gemm_set_prefetch(&a, (int64_t)grid.x * grid.y, sms, a.nkt, prefetch);
    if (mode == GEMM_FP8)
        dsv4_launch(gemm_wgmma_kernel<GEMM_FP8>, grid, WG_THREADS, wg_smem_bytes(GEMM_FP8), s, tw, tx, a);
    else
        dsv4_launch(gemm_wgmma_kernel<GEMM_FP8RAW>, grid, WG_THREADS, wg_smem_bytes(GEMM_FP8RAW), s, tw, tx, a);
    DSV4_CUDA_LAUNCHED(mode == GEMM_FP8 ? "gemm_fp8_wgmma" : "gemm_fp8raw_wgmma");
    return 0;
}
