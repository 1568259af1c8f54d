/* SPDX-License-Identifier: MIT */
/* Linears of decode steps of at most 8 rows (one n8 tile) with the weights streamed straight into
 * registers: the same CTAs, warps, MMAs and splits as gemm.cu's mma.sync kernel, without its shared
 * memory ring for the weights.
 *
 * Why: in gemm.cu each warp reads only its own 16 weight rows from the ring, so staging the weights
 * through shared memory buys nothing at one n8 tile, and its per-k-tile barrier holds every warp of a
 * CTA to the slowest load. Here each thread loads the 4 x 16 weight bytes its fragments need (chunks t
 * and t + 4 of rows r0 and r1) DIRECT_DEPTH k-tiles ahead into registers, the first ones before the
 * kernel waits for its inputs (weights are constant after boot), and no barrier follows the one that
 * publishes x.
 *
 * Same bits as gemm.cu, by construction: the same fragments and MMAs (load_wrows' bytes,
 * gemm_chunk_mma in gemm_tile.cuh), the same MMA order within a k-tile (chunk h, then q; hi then lo),
 * each k-tile summed from zero and folded as acc += blk * (weight scale x activation scale) (fp8,
 * fp8raw) or acc += blk (bf16), the same K splits and the same partial/output stores; the reduction is
 * gemm.cu's. test_gpu_linear checks rows of this kernel (batch 1 to 8) bit for bit against the same
 * rows in batches of 16 to 64 (the ring kernel).
 *
 * Where (measured on the H200, dsv4-bench --batch 1, us a launch, ring kernel -> this one): every
 * V4-Flash linear whose K is split, wo_b 15.9 -> 14.0, wo_a (8 groups, raw x) 15.7 -> 15.2, shared
 * w2 6.5 -> 6.2, wq_a 5.4 -> 5.2, wkv 4.9 -> 4.6, the BF16 compressor wkv 7.0 -> 6.7 and gate 4.8 ->
 * 4.6. Where one CTA walks all of K it lost (wq_b 12.2 -> 12.6, the head 273 -> 281), so launches of
 * one split keep the ring.
 *
 * x: the CTA's k-range of the R = min(rows, 8) distinct activation rows moves to shared memory once
 * (cp.async, one barrier), [k-tile][plane][R rows][256 bytes] with gemm.cu's swizzles (sw256, sw128
 * in gemm_tile.cuh); fragment row g reads row min(g, R - 1), as the ring kernel loads row
 * min(g, rows - 1): columns past the batch are computed on a copy of the last row and never stored.
 * The activation scales of the range sit beside it. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/gemm_tile.cuh"
#include "kernels/mma.cuh"

#define DIRECT_DEPTH 4              /* k-tiles of weights in flight a thread: 64 bytes each */
#define DIRECT_ROWS 8               /* batch rows: one n8 tile */
#define DIRECT_MAX_SMEM (64 * 1024) /* x of a CTA's k-range; above it gemm.cu's ring kernel runs */

/* x bytes of one k-tile: two planes (hi, lo) or one, of R rows */
static __host__ __device__ constexpr int direct_xtile(int mode, int r)
{
    return (mode == GEMM_FP8 ? 1 : 2) * r * gemm_xrow(mode);
}

/* Weight loads bypass L1 (each byte is read once) */
static __device__ __forceinline__ uint4 ldg_stream(const uint8_t *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* The 16-byte chunks (t, t + 4) of rows r0 and r1 of k-tile kt, and its weight scale (fp8 modes). */
struct direct_wtile {
    uint4 c[4];                 /* row r0 chunk t, r0 chunk t + 4, r1 chunk t, r1 chunk t + 4 */
    uint8_t sw;
};

template <int MODE>
static __device__ __forceinline__ void direct_load(direct_wtile &d, const uint8_t *w0, const uint8_t *w1,
                                                   const uint8_t *ws, int kt, int t)
{
    const int64_t o = (int64_t)kt * GEMM_TILE_BYTES + t * 16;
    d.c[0] = ldg_stream(w0 + o);
    d.c[1] = ldg_stream(w0 + o + 64);
    d.c[2] = ldg_stream(w1 + o);
    d.c[3] = ldg_stream(w1 + o + 64);
    if (MODE != GEMM_BF16)
        d.sw = __ldg(ws + kt);
}

/* One k-tile of warp rows r0/r1 against x tile xs (this CTA's local k-tile), folded into acc. */
template <int MODE>
static __device__ __forceinline__ void direct_tile(const direct_wtile &d, const uint8_t *xs, int r, int n,
                                                   float s0, float s1, float (&acc)[4])
{
    const uint8_t *xl = xs + r * gemm_xrow(MODE);    /* lo plane: fp8raw, bf16 */
    float blk[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int c = (threadIdx.x & 3) + 4 * h;
        const uint32_t w0v[4] = { d.c[h].x, d.c[h].y, d.c[h].z, d.c[h].w };
        const uint32_t w1v[4] = { d.c[2 + h].x, d.c[2 + h].y, d.c[2 + h].z, d.c[2 + h].w };
        gemm_chunk_mma<MODE>(w0v, w1v, xs, xl, n, c, blk);
    }
    if (MODE != GEMM_BF16) {
        acc[0] += blk[0] * s0;
        acc[1] += blk[1] * s1;
        acc[2] += blk[2] * s0;
        acc[3] += blk[3] * s1;
    } else {
#pragma unroll
        for (int q = 0; q < 4; q++)
            acc[q] += blk[q];
    }
}

/* grid (weight tile, split), GEMM_THREADS threads; dynamic shared memory: the k-range's x tiles, then
 * its activation scales [k-tile][R]. */
template <int MODE>
__global__ void __launch_bounds__(GEMM_THREADS, 2) gemm_direct_kernel(const gemm_args a)
{
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3;
    const int64_t row0 = (int64_t)blockIdx.x * GEMM_ROWS;
    const int split = blockIdx.y, kt0 = split * a.per, nk = min(a.nkt, kt0 + a.per) - kt0;
    const int R = min(a.rows, DIRECT_ROWS), xtile = direct_xtile(MODE, R);
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const uint8_t *w0 = a.w + min(row0 + r0, a.out - 1) * a.row_bytes;    /* rows past out: a valid row, not stored */
    const uint8_t *w1 = a.w + min(row0 + r1, a.out - 1) * a.row_bytes;
    const uint8_t *wsc = a.wscale + (row0 / GEMM_ROWS) * a.scale_stride;
    direct_wtile wt[DIRECT_DEPTH];

#pragma unroll
    for (int d = 0; d < DIRECT_DEPTH; d++)
        if (d < nk)
            direct_load<MODE>(wt[d], w0, w1, wsc, kt0 + d, t);
    if (nk > DIRECT_DEPTH)
        gemm_prefetch_weights(a, row0, kt0 + DIRECT_DEPTH, nk - DIRECT_DEPTH, (int)(blockIdx.y * gridDim.x + blockIdx.x));
    dsv4_pdl_enter();

    /* x and its scales for k-tiles [kt0, kt0 + nk) */
    const int64_t xk0 = (row0 / a.grp_rows) * a.nkt * 128;     /* grouped: this tile's slice of x */
    float *ssm = reinterpret_cast<float *>(smem + (size_t)nk * xtile);
    if (MODE != GEMM_BF16) {
        for (int i = threadIdx.x; i < nk * xplanes(MODE) * R * 16; i += GEMM_THREADS) {
            const int c = i & 15, n = (i >> 4) % R, p = (i / (16 * R)) % xplanes(MODE), kt = i / (16 * R * xplanes(MODE));
            dsv4_cp_async16(smem + kt * xtile + (p * R + n) * gemm_xrow(MODE) + sw256(n, c) * 16,
                            a.xa + (((int64_t)p * a.rows + n) * a.k + xk0 + (int64_t)(kt0 + kt) * 128) * 2 + c * 16);
        }
        const int64_t sab = a.k / 128, sk = xk0 / 128 + kt0;
        for (int i = threadIdx.x; i < nk * R; i += GEMM_THREADS)
            ssm[i] = a.sa[(int64_t)(i % R) * sab + sk + i / R];
    } else {
        for (int i = threadIdx.x; i < nk * 2 * R * 8; i += GEMM_THREADS) {
            const int c = i & 7, n = (i >> 3) % R, p = (i / (8 * R)) % 2, kt = i / (16 * R);
            dsv4_cp_async16(smem + kt * xtile + (p * R + n) * gemm_xrow(MODE) + sw128(n, c) * 16,
                            a.xa + (((int64_t)p * a.rows + n) * a.k + (int64_t)(kt0 + kt) * 64) * 2 + c * 16);
        }
    }
    dsv4_cp_async_commit();
    dsv4_cp_async_wait<0>();
    __syncthreads();

    const int n = min(g, R - 1), n0 = min(2 * t, R - 1), n1 = min(2 * t + 1, R - 1);
    float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll 1
    for (int i0 = 0; i0 < nk; i0 += DIRECT_DEPTH) {
#pragma unroll
        for (int d = 0; d < DIRECT_DEPTH; d++) {
            const int i = i0 + d;
            if (i < nk) {
                float s0 = 0.0f, s1 = 0.0f;
                if (MODE != GEMM_BF16) {
                    const float sw = dsv4_ue8m0(wt[d].sw);
                    s0 = sw * ssm[i * R + n0];
                    s1 = sw * ssm[i * R + n1];
                }
                direct_tile<MODE>(wt[d], smem + i * xtile, R, n, s0, s1, acc);
                if (i + DIRECT_DEPTH < nk)
                    direct_load<MODE>(wt[d], w0, w1, wsc, kt0 + i + DIRECT_DEPTH, t);
            }
        }
    }

    /* c0 (row r0, batch row 2t), c1 (r0, 2t + 1), c2 (r1, 2t), c3 (r1, 2t + 1) */
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int nn = 2 * t + (q & 1);
        const int64_t o = row0 + (q < 2 ? r0 : r1);
        if (nn >= a.rows || o >= a.out)
            continue;
        if (a.splits == 1)
            a.y[(int64_t)nn * a.ldy + o] = acc[q];
        else
            a.part[((int64_t)split * a.rows + nn) * a.out + o] = acc[q];
    }
}

static size_t direct_smem(int mode, const gemm_args &a)
{
    const int r = a.rows < DIRECT_ROWS ? a.rows : DIRECT_ROWS;
    return (size_t)a.per * (size_t)direct_xtile(mode, r) + (size_t)a.per * (size_t)r * sizeof(float);
}

int gemm_direct_prepare(void)
{
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_direct_kernel<GEMM_FP8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       DIRECT_MAX_SMEM));
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_direct_kernel<GEMM_FP8RAW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       DIRECT_MAX_SMEM));
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_direct_kernel<GEMM_BF16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       DIRECT_MAX_SMEM));
    return 0;
}

bool gemm_direct_fits(int mode, const gemm_args &a)
{
    return a.rows <= DIRECT_ROWS && a.splits > 1 && direct_smem(mode, a) <= DIRECT_MAX_SMEM;
}

int gemm_direct_launch(int mode, gemm_args a, int sms, int64_t prefetch, cudaStream_t s)
{
    const dim3 grid((unsigned)((a.out + GEMM_ROWS - 1) / GEMM_ROWS), (unsigned)a.splits);
    const size_t smem = direct_smem(mode, a);
    gemm_set_prefetch(&a, (int64_t)grid.x * grid.y, sms, a.per > DIRECT_DEPTH ? a.per - DIRECT_DEPTH : 0, prefetch);
    if (mode == GEMM_FP8)
        dsv4_launch(gemm_direct_kernel<GEMM_FP8>, grid, GEMM_THREADS, smem, s, a);
    else if (mode == GEMM_FP8RAW)
        dsv4_launch(gemm_direct_kernel<GEMM_FP8RAW>, grid, GEMM_THREADS, smem, s, a);
    else
        dsv4_launch(gemm_direct_kernel<GEMM_BF16>, grid, GEMM_THREADS, smem, s, a);
    DSV4_CUDA_LAUNCHED(mode == GEMM_FP8 ? "gemm_fp8_direct" : mode == GEMM_FP8RAW ? "gemm_fp8raw_direct"
                                                                                   : "gemm_bf16x2_direct");
    return 0;
}
