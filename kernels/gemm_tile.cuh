/* SPDX-License-Identifier: MIT */
/* What the tensor-core linear kernels share (gemm.cu: mma.sync for every image, any row count;
 * gemm_direct.cu: mma.sync with the weights in registers, up to 8 rows; gemm_wgmma.cu: wgmma for
 * prefill chunks on sm_90a): the launch arguments, the weight tile in shared memory, the A fragments
 * made from it and the mma.sync kernels' MMAs of a weight chunk. Every kernel builds each MMA's A
 * operand from a weight tile the same way, so a row gets the same bits from any of them (see
 * gemm_direct.cu, gemm_wgmma.cu). */
#ifndef DSV4_KERNELS_GEMM_TILE_CUH
#define DSV4_KERNELS_GEMM_TILE_CUH

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/cuda_util.cuh"
#include "kernels/mma.cuh"

#define GEMM_ROWS 128               /* output rows per CTA: one FP8 scale block */
#define GEMM_WARPS 8                /* one m16 tile of rows each */
#define GEMM_THREADS (GEMM_WARPS * DSV4_CUDA_WARP)
#define GEMM_TILE_BYTES 128         /* weight bytes per row per k-tile: 128 e4m3 or 64 bf16 values */
#define GEMM_PREFETCH_TILES 8       /* most k-tiles a CTA prefetches before its inputs are ready (128 KB) */

enum { GEMM_FP8 = 0, GEMM_BF16 = 1, GEMM_FP8RAW = 2 };

/* Activation tile bytes per batch row and plane: 128 f16 (fp8: one plane; fp8raw: hi and lo
 * planes) or 64 bf16 hi + 64 bf16 lo (bf16: one plane holding both halves). */
#define GEMM_XROW_BYTES 256

static __host__ __device__ constexpr int kvals(int mode)
{
    return mode == GEMM_BF16 ? 64 : 128;
}

static __host__ __device__ constexpr int xplanes(int mode)
{
    return mode == GEMM_FP8RAW ? 2 : 1;
}

/* Bytes of one row of one x plane as the ring and register kernels address it: 128 f16 values (fp8;
 * fp8raw's hi and lo planes) or 64 bf16 values (bf16: the hi plane's rows, then the lo plane's, which
 * together fill GEMM_XROW_BYTES a row) */
static __host__ __device__ constexpr int gemm_xrow(int mode)
{
    return mode == GEMM_BF16 ? GEMM_XROW_BYTES / 2 : GEMM_XROW_BYTES;
}

struct gemm_args {
    const uint8_t *w;           /* [out, row_bytes] */
    int64_t row_bytes;
    const uint8_t *wscale;      /* fp8: [ceil(out/128), scale_stride] UE8M0 */
    int64_t scale_stride;
    int64_t out;
    int nkt;                    /* k-tiles of K */
    int per;                    /* k-tiles per split */
    int rows;
    const uint8_t *xa;          /* fp8: [rows, k] f16; fp8raw: hi [rows, k] then lo [rows, k] f16;
                                 * bf16: hi [rows, k] then lo [rows, k] bf16 */
    int64_t k;                  /* width of x: K, or groups x K (grouped) */
    int64_t grp_rows;           /* output rows per group (multiple of GEMM_ROWS); out when ungrouped */
    const float *sa;            /* fp8, fp8raw: [rows, k / 128] activation scales */
    float *y;                   /* splits == 1: y[n * ldy + o] */
    int64_t ldy;
    float *part;                /* splits > 1: [splits, rows, out] */
    int splits;
    int pf_ctas, pf_tiles;      /* CTAs below pf_ctas prefetch their first pf_tiles k-tiles before waiting */
};

/* two e4m3 bytes (low first) -> f16x2, exact */
static __device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t v)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

/* 16-byte chunk c of a 128-byte weight (or bf16 activation) row in shared memory: a quarter warp
 * reads rows g and g+1 at chunks t (+4h), so odd rows move their chunks to the other half of the
 * bank window. */
static __device__ __forceinline__ int sw128(int row, int c)
{
    return c ^ ((row & 1) << 2);
}

/* f16 activation rows are 256 bytes; a quarter warp reads rows g and g+1 at chunks 2c, 2c+1, so odd
 * rows swap the two (sw128 above does the same for 128-byte rows) */
static __device__ __forceinline__ int sw256(int row, int c)
{
    return c ^ (row & 1);
}

/* The tensor memory accelerator's 128-byte swizzle (the wgmma kernel's tiles): chunk c of row r at
 * c ^ (r % 8) */
static __device__ __forceinline__ int sw128_tma(int row, int c)
{
    return c ^ (row & 7);
}

/* Chunk c of weight rows r0 and r1 (128-byte rows) of a stage, as words; TMA: the tile is in
 * sw128_tma's order, else in sw128's. */
template <bool TMA = false>
static __device__ __forceinline__ void load_wrows(const uint8_t *ws, int r0, int r1, int c, uint32_t (&w0v)[4],
                                                  uint32_t (&w1v)[4])
{
    const uint4 w0 = dsv4_lds128(ws + r0 * GEMM_TILE_BYTES + (TMA ? sw128_tma(r0, c) : sw128(r0, c)) * 16);
    const uint4 w1 = dsv4_lds128(ws + r1 * GEMM_TILE_BYTES + (TMA ? sw128_tma(r1, c) : sw128(r1, c)) * 16);
    w0v[0] = w0.x; w0v[1] = w0.y; w0v[2] = w0.z; w0v[3] = w0.w;
    w1v[0] = w1.x; w1v[1] = w1.y; w1v[2] = w1.z; w1v[3] = w1.w;
}

/* The A fragment of MMA q (0..3) of a weight chunk: rows r0 and r1 (words w0v, w1v), bytes 4q, 4q+1 as
 * k (2t, 2t+1) and 4q+2, 4q+3 as (2t+8, 2t+9) (the fragment trick: gemm.cu's header). */
static __device__ __forceinline__ void fp8_afrag(const uint32_t (&w0v)[4], const uint32_t (&w1v)[4], int q,
                                                 uint32_t (&af)[4])
{
    af[0] = e4m3x2_f16x2(w0v[q]);
    af[1] = e4m3x2_f16x2(w1v[q]);
    af[2] = e4m3x2_f16x2(w0v[q] >> 16);
    af[3] = e4m3x2_f16x2(w1v[q] >> 16);
}

/* The MMAs of weight chunk c (words w0v, w1v of rows r0 and r1, as load_wrows gives them) against
 * batch row n of a k-tile's x, added into the m16n8 accumulator blk in a fixed order (q, then hi
 * before lo): gemm.cu's ring kernel and gemm_direct.cu's register kernel both run these, so they give
 * the same bits. x is one or two planes, xs then xl, each [rows][row bytes] swizzled:
 *   fp8, fp8raw: 256-byte rows of f16 (sw256), the chunk's 16 values at chunks 2c and 2c+1; MMA q
 *   takes weight bytes 4q..4q+3 (fp8_afrag) and f16 values 4q..4q+3 of them, hi (xs), then for
 *   fp8raw lo (xl; fp8 never reads xl);
 *   bf16: 128-byte rows of bf16 (sw128), hi in xs and lo in xl, the chunk's 8 values at chunk c; the
 *   weight words are the A fragments as they are.
 * Which k each register stands for is the fragment trick (gemm.cu's header). */
template <int MODE>
static __device__ __forceinline__ void gemm_chunk_mma(const uint32_t (&w0v)[4], const uint32_t (&w1v)[4],
                                                      const uint8_t *xs, const uint8_t *xl, int n, int c,
                                                      float (&blk)[4])
{
    if (MODE != GEMM_BF16) {
        const uint4 b0 = dsv4_lds128(xs + n * GEMM_XROW_BYTES + sw256(n, 2 * c) * 16);
        const uint4 b1 = dsv4_lds128(xs + n * GEMM_XROW_BYTES + sw256(n, 2 * c + 1) * 16);
        const uint32_t bv[8] = { b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w };
        uint32_t lv[8] = {};
        if (MODE == GEMM_FP8RAW) {      /* the lo plane */
            const uint4 l0 = dsv4_lds128(xl + n * GEMM_XROW_BYTES + sw256(n, 2 * c) * 16);
            const uint4 l1 = dsv4_lds128(xl + n * GEMM_XROW_BYTES + sw256(n, 2 * c + 1) * 16);
            lv[0] = l0.x; lv[1] = l0.y; lv[2] = l0.z; lv[3] = l0.w;
            lv[4] = l1.x; lv[5] = l1.y; lv[6] = l1.z; lv[7] = l1.w;
        }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            uint32_t af[4];
            fp8_afrag(w0v, w1v, q, af);
            dsv4_mma_f16(blk, af, bv[2 * q], bv[2 * q + 1]);
            if (MODE == GEMM_FP8RAW)
                dsv4_mma_f16(blk, af, lv[2 * q], lv[2 * q + 1]);
        }
    } else {
        const uint4 bh = dsv4_lds128(xs + n * gemm_xrow(GEMM_BF16) + sw128(n, c) * 16);
        const uint4 bl = dsv4_lds128(xl + n * gemm_xrow(GEMM_BF16) + sw128(n, c) * 16);
        const uint32_t hv[4] = { bh.x, bh.y, bh.z, bh.w }, lv[4] = { bl.x, bl.y, bl.z, bl.w };
#pragma unroll
        for (int q = 0; q < 2; q++) {
            /* values 4q..4q+3 of each row's 8: (4q, 4q+1) as k (2t, 2t+1), (4q+2, 4q+3) as (2t+8, 2t+9) */
            const uint32_t af[4] = { w0v[2 * q], w1v[2 * q], w0v[2 * q + 1], w1v[2 * q + 1] };
            dsv4_mma_bf16(blk, af, hv[2 * q], hv[2 * q + 1]);
            dsv4_mma_bf16(blk, af, lv[2 * q], lv[2 * q + 1]);
        }
    }
}

/* Where the wgmma path stores value k (0..127) of each 1x128 activation block (gemm_wgmma.cu): MMA
 * q of weight chunk c = t + 4h feeds k-slot 2t+e the value 16c + 4q + e and slot 8+2t+e the value
 * 16c + 4q + 2 + e; the wgmma kernel reads a k16 step's B operand as two 16-byte core-matrix rows
 * per activation row (slots 0-7, then 8-15), so value k goes to step 4h+q, half j, place 2t+e. */
static __host__ __device__ constexpr int gemm_wg_pos(int k)
{
    return ((4 * ((k >> 4) >> 2) + ((k & 15) >> 2)) * 2 + ((k >> 1) & 1)) * 8 + 2 * ((k >> 4) & 3) + (k & 1);
}

/* The same for value v (0..63) of each 64-value bf16 block (hi and lo planes alike): MMA q of weight
 * chunk c = t + 4h (8 values) feeds k-slot 2t+e the value 8c + 4q + e and slot 8+2t+e the value
 * 8c + 4q + 2 + e (gemm_chunk_mma's bf16 form), so v goes to step 2h+q, half j, place 2t+e. */
static __host__ __device__ constexpr int gemm_wg_pos_bf16(int v)
{
    return ((2 * ((v >> 3) >> 2) + ((v >> 2) & 1)) * 2 + ((v >> 1) & 1)) * 8 + 2 * ((v >> 3) & 3) + (v & 1);
}

/* Weights are constant after boot: the first a.pf_ctas CTAs of a launch, which start while the
 * previous kernel drains, pull their first k-tiles from kt0 (one 128-byte line per weight row each) of
 * output rows [row0, row0 + GEMM_ROWS) toward L2 before waiting for x. Both kernels run GEMM_THREADS. */
static __device__ __forceinline__ void gemm_prefetch_weights(const gemm_args &a, int64_t row0, int kt0, int nk, int cta)
{
    if (cta < a.pf_ctas)
        for (int i = threadIdx.x; i < min(nk, a.pf_tiles) * GEMM_ROWS; i += GEMM_THREADS) {
            const int64_t gr = min(row0 + i % GEMM_ROWS, a.out - 1);
            dsv4_prefetch_l2(a.w + gr * a.row_bytes + (int64_t)(kt0 + i / GEMM_ROWS) * GEMM_TILE_BYTES);
        }
}

/* The prefetching CTAs of a launch of ctas CTAs (its first wave: at most sms) and the k-tiles each
 * takes: at most its run of kts and GEMM_PREFETCH_TILES, and `prefetch` bytes in all. */
static inline void gemm_set_prefetch(gemm_args *a, int64_t ctas, int sms, int kts, int64_t prefetch)
{
    a->pf_ctas = (int)min(ctas, (int64_t)sms);
    a->pf_tiles = (int)min(min((int64_t)kts, (int64_t)GEMM_PREFETCH_TILES),
                           prefetch / ((int64_t)a->pf_ctas * GEMM_ROWS * GEMM_TILE_BYTES));
}

/* gemm_wgmma.cu: whether the running image has the wgmma kernels, the device the shared memory they
 * take and the driver TMA descriptors (then their limits are set; else *why_not says which is
 * missing), and a launch for a.rows > DSV4_CUDA_MAX_BATCH with x prepared in gemm_wg_pos order. */
int gemm_wgmma_prepare(int smem_optin, const char **why_not);
int gemm_wgmma_launch(int mode, gemm_args a, int sms, int64_t prefetch, cudaStream_t s);

/* gemm_direct.cu: launches of at most 8 rows whose K is split, with the weights streamed into
 * registers (the same bits as gemm.cu's kernel); fits says whether a launch is one (and x of a CTA's
 * k-range fits its shared memory). */
int gemm_direct_prepare(void);
bool gemm_direct_fits(int mode, const gemm_args &a);
int gemm_direct_launch(int mode, gemm_args a, int sms, int64_t prefetch, cudaStream_t s);

#endif
