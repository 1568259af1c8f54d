/* SPDX-License-Identifier: MIT */
/* Linears on warpgroup MMAs, the sm_90a image only (every other image, and DSV4_CUDA_GEMM_WGMMA=0,
 * keeps gemm.cu's mma.sync path):
 *   - prefill chunks (more rows than the largest decode batch), FP8 weights with quantized or raw x;
 *   - decode batches of 9 to DSV4_CUDA_MAX_BATCH rows (DSV4_CUDA_GEMM_WGMMA_DECODE=0 turns these
 *     off), FP8 weights with either x and BF16 weights (x as bf16 hi + lo). On mma.sync a batch of
 *     64 rows ran 64 m16n8k16 MMAs a warp per k-tile behind 32 shared-memory fragment loads: the
 *     FP8 linears took ~4x their weight bytes' time at batch 64, the BF16 head 2.4x.
 *
 * Same bits as the mma.sync kernel, by construction:
 *   - a CTA owns the same 128 weight rows (one FP8 scale block), warp w the same 16 (w = 4 x
 *     warpgroup + warp in it), and builds each MMA's A operand from the weight tile exactly as
 *     gemm.cu does (16 contiguous bytes of a row per thread as k-slots: fp8_afrag for e4m3, the
 *     words as they are for bf16);
 *   - B, the activations, comes from shared memory; the activation preparation stores each 1x128
 *     (bf16: 1x64) block in the order gemm_wg_pos (gemm_wg_pos_bf16) names (gemm_tile.cuh), so k16
 *     step s of a tile reads, in each k-slot, the value that the mma.sync step of the same (h, q)
 *     feeds it;
 *   - wgmma.m64nNk16 (f16 or bf16, f32 accumulation, A from registers) gives mma.sync m16n8k16's
 *     bits for each output on the H200; each k-tile is summed from zero in the same step order (hi
 *     then lo at each step for raw x and bf16), scaled and folded exactly as gemm.cu: acc += blk *
 *     (weight scale x activation scale) per tile (bf16: acc += blk); a prefill CTA walks every split
 *     and adds tot += acc at each split boundary (gemm.cu's SEQ path), a decode CTA walks one split
 *     and stores acc as y or as its split's partials (gemm.cu's decode path, whose reduction and
 *     pending readers sum them).
 * test_gpu_linear checks prefill rows and decode batches from this kernel bit for bit against the
 * same rows alone (the one-tile decode path), and against the twin.
 *
 * Layout: a prefill grid is (64-row block of x, weight tile), row blocks of one tile neighbours in
 * launch order (the tile from memory once, then L2); a decode grid (1, weight tile, K split) with N
 * 16, 32 or 64 columns for the batch. 288 threads: two warpgroups of 64 weight rows, each a m64 x nN
 * accumulator per k-tile (blk) plus acc (and tot, prefill: 96 f32 registers a thread at N 64), and
 * one producer warp. The producer moves each k-tile into a ring of stages with TMA (the weight
 * tile, and x in 64-value halves per plane, all in the 128-byte swizzle wgmma reads) and cp.async
 * (the activation scales), counted on the stage's `full` mbarrier; each MMA warp signals the stage's
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

#define WG_TOKENS 64                /* rows of x per CTA of a prefill chunk: the wgmma N */
#define WG_MMA_THREADS 256          /* two warpgroups */
#define WG_THREADS (WG_MMA_THREADS + DSV4_CUDA_WARP)    /* and the producer warp */
#define WG_PRODUCER (WG_MMA_THREADS / DSV4_CUDA_WARP)   /* its warp index */
#define WG_STEPS 8                  /* k16 steps of a 128-wide k-tile */
#define WG_ALIGN 1024               /* the 128-byte swizzle repeats every 8 rows of 128 bytes */
#define WG_WBYTES (GEMM_ROWS * GEMM_TILE_BYTES)         /* weight tile: 16 KB */
#define WG_RING_BYTES (200 * 1024)  /* a prefill CTA's ring: one CTA an SM */
#define WG_DEC_RING_BYTES (100 * 1024)  /* a decode CTA's: two an SM */

static_assert(WG_MMA_THREADS == GEMM_THREADS, "the same warp owns the same 16 weight rows as in gemm.cu");
static_assert(WG_TOKENS <= DSV4_CUDA_WARP * 2, "the producer warp loads the scales two a lane");

/* one 64-value half of an activation k-tile of N rows (f16 or bf16: 128 bytes a row) */
static __host__ __device__ constexpr int wg_half(int n)
{
    return n * 128;
}

/* activation planes: fp8raw and bf16 hi and lo (gemm.cu's xplanes counts bf16's as one plane of
 * 64-value rows, the ring kernel's view), fp8 one */
static __host__ __device__ constexpr int wg_xplanes(int mode)
{
    return mode == GEMM_FP8 ? 1 : 2;
}

/* one plane of an activation k-tile: two halves (fp8, fp8raw: 128 values), or one (bf16: 64) */
static __host__ __device__ constexpr int wg_plane(int mode, int n)
{
    return (mode == GEMM_BF16 ? 1 : 2) * wg_half(n);
}

/* weight tile, activation planes, activation scales (fp8 modes); each stage starts on WG_ALIGN */
static __host__ __device__ constexpr size_t wg_stage_bytes(int mode, int n)
{
    return ((size_t)WG_WBYTES + (size_t)wg_xplanes(mode) * wg_plane(mode, n) +
            (mode == GEMM_BF16 ? 0 : n * sizeof(float)) + WG_ALIGN - 1) / WG_ALIGN * WG_ALIGN;
}

/* CTAs an SM: two for decode at N 16 and 32; at N 64 the 96 f32 of blk, acc and the A fragments a
 * thread would spill under two (ptxas sizes a wgmma kernel's 288 threads as three warpgroups) */
static __host__ __device__ constexpr int wg_ctas(int n, bool dec)
{
    return dec && n <= 32 ? 2 : 1;
}

/* As many stages as the CTA's ring holds: prefill (N 64) 6 of 33 KB (quantized x) or 4 of 49 KB (raw
 * x); decode 3 to 5 at N 16 and 32 (two CTAs an SM), as prefill at N 64 (bf16: 6 of 32 KB). */
static __host__ __device__ constexpr int wg_stages(int mode, int n, bool dec)
{
    return (int)((wg_ctas(n, dec) == 2 ? WG_DEC_RING_BYTES : WG_RING_BYTES) / wg_stage_bytes(mode, n));
}

/* dynamic shared memory: the ring, its mbarriers (full and empty per stage), the alignment slack */
static __host__ __device__ constexpr size_t wg_smem_bytes(int mode, int n, bool dec)
{
    return wg_stages(mode, n, dec) * wg_stage_bytes(mode, n) + 2 * wg_stages(mode, n, dec) * sizeof(uint64_t) +
           WG_ALIGN;
}

static_assert(wg_stages(GEMM_FP8, WG_TOKENS, false) == 6 && wg_stages(GEMM_FP8RAW, WG_TOKENS, false) == 4,
              "the prefill rings measured");
static_assert(wg_stages(GEMM_FP8RAW, 32, true) >= 3 && 2 * wg_smem_bytes(GEMM_FP8RAW, 32, true) <= 227 * 1024,
              "two decode CTAs an SM");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* tile row of fragment row g (0..7) of a warp's 16 rows (see the top of the file) */
static __device__ __forceinline__ int wg_rho(int g)
{
    return (g >> 1) | ((g & 1) << 2);
}

/* The A fragments of a k-tile's steps from the stage's weight tile (gemm.cu's construction), then
 * its wgmmas into blk from zero, committed as one group: fp8, 8 steps of e4m3 as f16 (raw x: hi then
 * lo at each); bf16, 4 steps of the weight words as they are, hi then lo at each. */
template <int MODE, int N>
static __device__ __forceinline__ void wg_issue(const uint8_t *st, int r0, int r1, int t, float (&blk)[N / 2])
{
    constexpr int STEPS = MODE == GEMM_BF16 ? WG_STEPS / 2 : WG_STEPS, PER_H = STEPS / 2;
    const uint8_t *xs = st + WG_WBYTES;
    uint32_t af[STEPS][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t w0v[4], w1v[4];
        load_wrows<true>(st, r0, r1, t + 4 * h, w0v, w1v);
#pragma unroll
        for (int q = 0; q < PER_H; q++)
            if (MODE == GEMM_BF16) {
                af[PER_H * h + q][0] = w0v[2 * q];
                af[PER_H * h + q][1] = w1v[2 * q];
                af[PER_H * h + q][2] = w0v[2 * q + 1];
                af[PER_H * h + q][3] = w1v[2 * q + 1];
            } else {
                fp8_afrag(w0v, w1v, q, af[PER_H * h + q]);
            }
    }
#pragma unroll
    for (int j = 0; j < N / 2; j++) {
        blk[j] = 0.0f;
        dsv4_wgmma_pin(blk[j]);
    }
    dsv4_wgmma_fence();
    const uint64_t xdesc = dsv4_wgmma_desc_sw128(xs);
#pragma unroll
    for (int s = 0; s < STEPS; s++) {
        /* fp8: steps 0-3 in the first 64-value half, 4-7 in the second; bf16: one half a plane */
        const uint32_t b = (s >> 2) * wg_half(N) + (s & 3) * 32;
        dsv4_wgmma<N, MODE == GEMM_BF16>(blk, af[s], dsv4_wgmma_desc_at(xdesc, b));
        if (MODE != GEMM_FP8)
            dsv4_wgmma<N, MODE == GEMM_BF16>(blk, af[s], dsv4_wgmma_desc_at(xdesc, b + wg_plane(MODE, N)));
    }
    dsv4_wgmma_commit();
}

/* acc += blk x (weight scale x row scale) (fp8 modes) or acc += blk (bf16) for a k-tile (gemm.cu's
 * arithmetic); at a split's end, tot += acc and acc = 0 (prefill: a CTA walks every split) */
template <int MODE, int N, bool FOLD>
static __device__ __forceinline__ void wg_fold(const float (&blk)[N / 2], const float *ss, float sw, int t,
                                               bool split_end, float (&acc)[N / 2], float (&tot)[N / 2])
{
#pragma unroll
    for (int j = 0; j < N / 8; j++) {
        if (MODE == GEMM_BF16) {
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[4 * j + q] += blk[4 * j + q];
            continue;
        }
        const float2 sr = *reinterpret_cast<const float2 *>(ss + j * 8 + 2 * t);
        const float s0 = sw * sr.x, s1 = sw * sr.y;
        acc[4 * j + 0] += blk[4 * j + 0] * s0;
        acc[4 * j + 1] += blk[4 * j + 1] * s1;
        acc[4 * j + 2] += blk[4 * j + 2] * s0;
        acc[4 * j + 3] += blk[4 * j + 3] * s1;
    }
    if (FOLD && split_end)
#pragma unroll
        for (int j = 0; j < N / 2; j++) {
            tot[j] += acc[j];
            acc[j] = 0.0f;
        }
}

/* The producer warp: for each of the CTA's nk k-tiles from kt0, once its stage is free, the TMA loads
 * (lane 0) and the N activation scales (up to two a lane; rows past a.rows read the last row, not
 * stored). */
template <int MODE, int N, bool DEC>
static __device__ __forceinline__ void wg_produce(const gemm_args &a, const CUtensorMap *tw, const CUtensorMap *tx,
                                                  uint8_t *ring, uint64_t *full, uint64_t *empty, int64_t row0,
                                                  int64_t xk0, int nb, int kt0, int nk)
{
    constexpr int ST = wg_stages(MODE, N, DEC);
    constexpr uint32_t sbytes = (uint32_t)wg_stage_bytes(MODE, N);
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    const int64_t sab = a.k / 128;     /* fp8 modes: the scales of rows nb + lane, nb + lane + 32 */
    const float *s0 = a.sa + (int64_t)min(nb + lane, a.rows - 1) * sab + xk0 / 128 + kt0;
    const float *s1 = a.sa + (int64_t)min(nb + lane + DSV4_CUDA_WARP, a.rows - 1) * sab + xk0 / 128 + kt0;
    for (int i = 0; i < nk; i++) {
        const int s = i % ST;
        uint8_t *st = ring + s * sbytes;
        if (i >= ST)
            dsv4_mbar_wait(&empty[s], (uint32_t)((i / ST) - 1) & 1);
        if (lane == 0) {
            dsv4_mbar_expect_tx(&full[s], WG_WBYTES + wg_xplanes(MODE) * wg_plane(MODE, N));
            dsv4_tma_load_2d(st, tw, &full[s], (kt0 + i) * GEMM_TILE_BYTES, (int)row0);
#pragma unroll
            for (int p = 0; p < wg_xplanes(MODE); p++)
#pragma unroll
                for (int h = 0; h < wg_plane(MODE, N) / wg_half(N); h++)
                    dsv4_tma_load_2d(st + WG_WBYTES + p * wg_plane(MODE, N) + h * wg_half(N), tx, &full[s],
                                     (int)(xk0 + (int64_t)(kt0 + i) * kvals(MODE) + h * 64), p * a.rows + nb);
        }
        if (MODE != GEMM_BF16) {
            float *ss = reinterpret_cast<float *>(st + WG_WBYTES + wg_xplanes(MODE) * wg_plane(MODE, N));
            if (lane < N)
                dsv4_cp_async4(ss + lane, s0 + i);
            if (lane + DSV4_CUDA_WARP < N)
                dsv4_cp_async4(ss + lane + DSV4_CUDA_WARP, s1 + i);
        }
        dsv4_cp_async_arrive(&full[s]);
    }
    dsv4_cp_async_wait<0>();
}
#endif

/* Prefill (!DEC): grid (64-row block of x, weight tile), every k-tile, the splits folded in order;
 * y = the sum (gemm.cu's SEQ path). Decode (DEC): grid (1, weight tile, split), all of the rows
 * (N 16, 32 or 64 of x's rows), one split's k-tiles; y, or the split's partials (gemm.cu's decode
 * path). */
template <int MODE, int N, bool DEC>
__global__ void __launch_bounds__(WG_THREADS, wg_ctas(N, DEC))
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tx, const gemm_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ST = wg_stages(MODE, N, DEC);
    constexpr uint32_t sbytes = (uint32_t)wg_stage_bytes(MODE, N);
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *ring = smem + ((WG_ALIGN - (dsv4_smem_addr(smem) & (WG_ALIGN - 1))) & (WG_ALIGN - 1));
    uint64_t *full = reinterpret_cast<uint64_t *>(ring + ST * sbytes), *empty = full + ST;
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3;
    const int64_t row0 = (int64_t)blockIdx.y * GEMM_ROWS;
    const int nb = (int)blockIdx.x * N, split = DEC ? (int)blockIdx.z : 0, kt0 = split * a.per;
    const int nk = DEC ? min(a.nkt, kt0 + a.per) - kt0 : a.nkt;
    const int64_t xk0 = (row0 / a.grp_rows) * a.nkt * 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; s++) {
            dsv4_mbar_init(&full[s], 1 + DSV4_CUDA_WARP);      /* the TMA arrival + the scale copies */
            dsv4_mbar_init(&empty[s], WG_MMA_THREADS / DSV4_CUDA_WARP);
        }
        dsv4_mbar_init_fence();
    }
    if (warp < WG_PRODUCER)
        gemm_prefetch_weights(a, row0, kt0, nk, (int)((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x));
    __syncthreads();
    dsv4_pdl_enter();
    if (warp == WG_PRODUCER) {
        wg_produce<MODE, N, DEC>(a, &tw, &tx, ring, full, empty, row0, xk0, nb, kt0, nk);
        return;
    }

    const int r0 = warp * 16 + wg_rho(g), r1 = r0 + 8;
    const uint8_t *wscale = MODE == GEMM_BF16 ? nullptr : a.wscale + (row0 / GEMM_ROWS) * a.scale_stride + kt0;
    float blk[N / 2], acc[N / 2], tot[N / 2];     /* tot: prefill only */

#pragma unroll
    for (int i = 0; i < N / 2; i++)
        acc[i] = 0.0f;
    if (!DEC)
#pragma unroll
        for (int i = 0; i < N / 2; i++)
            tot[i] = 0.0f;
    int left = a.per;                   /* k-tiles to the end of the split */
    for (int i = 0; i < nk; i++) {
        const int s = i % ST;
        const uint8_t *st = ring + s * sbytes;
        const float sw = MODE == GEMM_BF16 ? 1.0f : dsv4_ue8m0(__ldg(wscale + i));
        dsv4_mbar_wait(&full[s], (uint32_t)(i / ST) & 1);
        wg_issue<MODE, N>(st, r0, r1, t, blk);
        dsv4_wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < N / 2; j++)
            dsv4_wgmma_pin(blk[j]);
        const bool split_end = --left == 0 || i + 1 == nk;
        if (split_end)
            left = a.per;
        wg_fold<MODE, N, !DEC>(blk, reinterpret_cast<const float *>(st + WG_WBYTES + wg_xplanes(MODE) * wg_plane(MODE, N)),
                               sw, t, split_end, acc, tot);
        __syncwarp();
        if (lane == 0)
            dsv4_mbar_arrive(&empty[s]);
    }

#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int n = nb + j * 8 + 2 * t + (q & 1);
            const int64_t o = row0 + (q < 2 ? r0 : r1);
            if (n >= a.rows || o >= a.out)
                continue;
            if (!DEC)
                a.y[(int64_t)n * a.ldy + o] = tot[4 * j + q];
            else if (a.splits == 1)
                a.y[(int64_t)n * a.ldy + o] = acc[4 * j + q];
            else
                a.part[((int64_t)split * a.rows + n) * a.out + o] = acc[4 * j + q];
        }
#else
    __trap();   /* launched only where gemm_wgmma_prepare found the sm_90a image */
#endif
}

/* cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda) */
static PFN_cuTensorMapEncodeTiled_v12000 wg_encode;

template <int MODE, int N, bool DEC>
static int wg_prepare_one(void)
{
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_wgmma_kernel<MODE, N, DEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)wg_smem_bytes(MODE, N, DEC)));
    return 0;
}

template <int MODE>
static int wg_prepare_mode(void)
{
    int rc = 0;
    if constexpr (MODE != GEMM_BF16)        /* a prefill chunk's BF16 linears stay on mma.sync (gemm.cu) */
        rc = wg_prepare_one<MODE, WG_TOKENS, false>();
    rc = rc ? rc : wg_prepare_one<MODE, 16, true>();
    rc = rc ? rc : wg_prepare_one<MODE, 32, true>();
    return rc ? rc : wg_prepare_one<MODE, 64, true>();
}

/* *why_not: NULL where the wgmma kernels run here, else why not (for the boot log). */
int gemm_wgmma_prepare(int smem_optin, const char **why_not)
{
    cudaFuncAttributes fa;
    DSV4_CUDA_TRY(cudaFuncGetAttributes(&fa, gemm_wgmma_kernel<GEMM_FP8, WG_TOKENS, false>));
    if (fa.binaryVersion != 90 || fa.ptxVersion < 90) {
        *why_not = "not the sm_90a image";      /* the JIT-compiled PTX, or another GPU's cubin */
        return 0;
    }
    if ((size_t)smem_optin < wg_smem_bytes(GEMM_FP8, WG_TOKENS, false) ||
        (size_t)smem_optin < wg_smem_bytes(GEMM_FP8RAW, WG_TOKENS, false)) {
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
    int rc = wg_prepare_mode<GEMM_FP8>();
    if (rc < 0 || (rc = wg_prepare_mode<GEMM_FP8RAW>()) < 0 || (rc = wg_prepare_mode<GEMM_BF16>()) < 0)
        return rc;
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

template <int MODE, int N, bool DEC>
static void wg_launch(dim3 grid, cudaStream_t s, const CUtensorMap &tw, const CUtensorMap &tx, const gemm_args &a)
{
    dsv4_launch(gemm_wgmma_kernel<MODE, N, DEC>, grid, WG_THREADS, wg_smem_bytes(MODE, N, DEC), s, tw, tx, a);
}

template <int MODE>
static void wg_launch_mode(int n, bool dec, dim3 grid, cudaStream_t s, const CUtensorMap &tw, const CUtensorMap &tx,
                           const gemm_args &a)
{
    if (!dec) {
        if constexpr (MODE != GEMM_BF16)
            wg_launch<MODE, WG_TOKENS, false>(grid, s, tw, tx, a);
    } else if (n == 16)
        wg_launch<MODE, 16, true>(grid, s, tw, tx, a);
    else if (n == 32)
        wg_launch<MODE, 32, true>(grid, s, tw, tx, a);
    else
        wg_launch<MODE, 64, true>(grid, s, tw, tx, a);
}

int gemm_wgmma_launch(int mode, gemm_args a, int sms, int64_t prefetch, cudaStream_t s)
{
    /* a decode batch: one block of N >= rows, a CTA a (tile, split); a prefill chunk: 64-row blocks */
    const bool dec = a.rows <= DSV4_CUDA_MAX_BATCH;
    if (mode == GEMM_BF16 && !dec)
        return dsv4_error_set(-EINVAL, "gemm_wgmma: BF16 linears take the wgmma kernel for decode batches only "
                              "(%d rows)", a.rows);
    const int n = !dec ? WG_TOKENS : a.rows <= 16 ? 16 : a.rows <= 32 ? 32 : 64;
    const unsigned tiles = (unsigned)((a.out + GEMM_ROWS - 1) / GEMM_ROWS);
    const dim3 grid = dec ? dim3(1, tiles, (unsigned)a.splits) : dim3((unsigned)((a.rows + n - 1) / n), tiles);
    CUtensorMap tw, tx;
    int rc;
    /* W [out, K] e4m3 or bf16: 128 rows x 128 bytes a k-tile; x [planes x rows, k] f16 or bf16: n rows x 64
     * values a half */
    if ((rc = wg_map(&tw, a.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, (int64_t)a.nkt * GEMM_TILE_BYTES, a.out, a.row_bytes,
                     GEMM_TILE_BYTES, GEMM_ROWS)) < 0 ||
        (rc = wg_map(&tx, a.xa, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, a.k, (int64_t)wg_xplanes(mode) * a.rows, a.k * 2, 64,
                     (uint32_t)n)) < 0)
        return rc;
    gemm_set_prefetch(&a, (int64_t)grid.x * grid.y * grid.z, sms, dec ? a.per : a.nkt, prefetch);
    if (mode == GEMM_FP8)
        wg_launch_mode<GEMM_FP8>(n, dec, grid, s, tw, tx, a);
    else if (mode == GEMM_FP8RAW)
        wg_launch_mode<GEMM_FP8RAW>(n, dec, grid, s, tw, tx, a);
    else
        wg_launch_mode<GEMM_BF16>(n, dec, grid, s, tw, tx, a);
    DSV4_CUDA_LAUNCHED(mode == GEMM_FP8 ? "gemm_fp8_wgmma" : mode == GEMM_FP8RAW ? "gemm_fp8raw_wgmma" : "gemm_bf16_wgmma");
    return 0;
}
