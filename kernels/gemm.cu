/* SPDX-License-Identifier: MIT */
/* Tensor-core linears for a step's rows (decode batches of up to DSV4_CUDA_MAX_BATCH rows, prefill
 * chunks of up to DSV4_CUDA_MAX_ROWS): y[b] = W x[b] with W in its checkpoint format, through
 * mma.sync (sm_80+, so every image we build runs it).
 *
 * Three modes:
 *   fp8: e4m3 weights (128x128 UE8M0 scales) times activations quantized by the official 1x128
 *        e4m3 quantizer. Both operands are e4m3 values, exact in f16, so each 128-wide k-tile is an
 *        f16 MMA with f32 accumulation, then scaled by (weight scale x activation scale) and added:
 *        the official fp8_gemm's arithmetic, in f32.
 *   fp8raw: the same weights times unquantized f32 activations (wo_a, which the reference runs in
 *        BF16, and every FP8 linear in exact numerics): each 1x128 block of x is divided by the
 *        power of two at or below its amax and split into f16 hi + lo, two MMAs per tile; the
 *        split loses at most 2^-22 of the block's amax per value, so the result stays within ~1e-6
 *        of f32 math. The grouped form (dsv4_cuda_gemm_grouped) runs all o_groups of wo_a in one
 *        launch, each 128-row tile reading its group's slice of x.
 *   bf16: bf16 weights times f32 activations split into hi = bf16(x) and lo = bf16(x - hi), two
 *        MMAs per tile: |x - hi - lo| <= 2^-17 |x|. Each k-tile is summed in its own MMA
 *        accumulator and added in f32 on the CUDA cores, as the fp8 path does (the accumulator does
 *        not round to nearest: one accumulator over the head's 64 k-tiles reached 1.9e-5).
 * Twin: dsv4_twin_fp8_roundtrip + dsv4_twin_linear_row (engine/cpu/cpu_twin_cuda.c), checked in
 * tests/gpu/test_gpu_linear.c.
 *
 * Layout: a CTA owns GEMM_ROWS output rows (one FP8 scale block) and a run of k-tiles; each of its
 * 8 warps owns 16 rows (one m16 tile) and every batch row (n8 tiles). Weight and activation tiles
 * move through a cp.async ring in shared memory (GEMM_STAGES_MAX deep, or GEMM_STAGES_MIN where the
 * device's shared memory is smaller: sm_86/89/120 have 99 KB a block), swizzled so the fragment
 * loads are conflict-free. K is split over CTAs until the grid covers the chip; the split count
 * depends only on W's shape, and splits are added in a fixed order, so a row's result is the same
 * whatever else is in the batch.
 *
 * Above DSV4_CUDA_MAX_BATCH rows (a prefill chunk) the grid is (64-row block, weight tile) instead
 * (8-, 16- or 32-row blocks where 64 would leave SMs idle: small weights such as the router gate):
 * the row blocks of one tile are neighbours in launch order, so the tile comes from memory once and
 * from L2 for the rest, and the chunk's rows fill the chip without splitting K. Each such CTA walks
 * all of K and folds its sum at the split boundaries the shape defines (total += split sum, from
 * zero, in split order): the reduction launch's arithmetic, so a prefill row gets the bits a decode
 * row would.
 *
 * Fragment trick: a dot product does not care in which order k runs, so each thread takes 16
 * contiguous bytes of its weight row and feeds them to consecutive MMAs as if they were the k
 * indices the PTX fragment layout names; the activation fragments use the same permutation. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/gemm_tile.cuh"
#include "kernels/mma.cuh"
#include "kernels/norm_row.cuh"
#include "kernels/pending.cuh"
#include "kernels/switches.h"

#define GEMM_STAGES_MAX 4           /* 192 KB at fp8raw x 64 rows: sm_90 / sm_100 (227 KB a block) */
#define GEMM_STAGES_MIN 2           /* 96 KB: every device with 99 KB or more */
#define GEMM_WALK_TILES 16          /* k-tiles a CTA walks from which walk_stages applies (the head: 64) */
#define GEMM_TARGET_CTAS 256        /* split K until tiles x splits reaches this */
#define GEMM_MIN_TILES_PER_SPLIT 2  /* keep the pipeline busy in every CTA */
#define GEMM_MAX_NT (DSV4_CUDA_MAX_BATCH / 8)

static __host__ __device__ constexpr size_t stage_bytes(int mode, int nt)
{
    return (size_t)GEMM_ROWS * GEMM_TILE_BYTES + (size_t)xplanes(mode) * nt * 8 * GEMM_XROW_BYTES;
}

/* Issue the cp.async loads of k-tile kt into stage s; xk0 is the group's first column of x, nb the
 * CTA's first batch row. */
template <int MODE, int NT>
static __device__ __forceinline__ void load_tile(const gemm_args &a, uint8_t *ws, uint8_t *xs, int kt, int64_t row0,
                                                 int64_t xk0, int nb)
{
    const int tid = threadIdx.x;
    for (int i = tid; i < GEMM_ROWS * 8; i += GEMM_THREADS) {
        const int r = i >> 3, c = i & 7;
        const int64_t gr = min(row0 + r, a.out - 1);   /* rows past out load a valid row; not stored */
        dsv4_cp_async16(ws + r * GEMM_TILE_BYTES + sw128(r, c) * 16, a.w + gr * a.row_bytes + (int64_t)kt * GEMM_TILE_BYTES + c * 16);
    }
    if (MODE != GEMM_BF16) {
        for (int i = tid; i < xplanes(MODE) * NT * 8 * 16; i += GEMM_THREADS) {
            const int p = i / (NT * 128), n = (i >> 4) % (NT * 8), c = i & 15, gn = min(nb + n, a.rows - 1);
            const uint8_t *src = a.xa + (((int64_t)p * a.rows + gn) * a.k + xk0 + (int64_t)kt * 128) * 2 + c * 16;
            dsv4_cp_async16(xs + p * (NT * 8 * gemm_xrow(MODE)) + n * gemm_xrow(MODE) + sw256(n, c) * 16, src);
        }
    } else {
        for (int i = tid; i < 2 * NT * 8 * 8; i += GEMM_THREADS) {
            const int p = i / (NT * 64), n = (i >> 3) % (NT * 8), c = i & 7, gn = min(nb + n, a.rows - 1);
            const uint8_t *src = a.xa + (((int64_t)p * a.rows + gn) * a.k + (int64_t)kt * 64) * 2 + c * 16;
            dsv4_cp_async16(xs + p * (NT * 8 * gemm_xrow(MODE)) + n * gemm_xrow(MODE) + sw128(n, c) * 16, src);
        }
    }
}

/* SEQ: grid (row block, tile), every k-tile, splits folded in order (see the top of the file);
 * otherwise grid (tile, split), all rows. */
template <int MODE, int NT, int STAGES, bool SEQ>
__global__ void __launch_bounds__(GEMM_THREADS) gemm_kernel(const gemm_args a)
{
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3;
    const int64_t row0 = (int64_t)(SEQ ? blockIdx.y : blockIdx.x) * GEMM_ROWS;
    const int nb = SEQ ? (int)blockIdx.x * NT * 8 : 0;
    const int split = SEQ ? 0 : blockIdx.y, kt0 = split * a.per;
    const int nk = SEQ ? a.nkt : min(a.nkt, kt0 + a.per) - kt0;

    gemm_prefetch_weights(a, row0, kt0, nk, (int)(blockIdx.y * gridDim.x + blockIdx.x));
    dsv4_pdl_enter();
    constexpr size_t sbytes = stage_bytes(MODE, NT);
    const int64_t xk0 = (row0 / a.grp_rows) * a.nkt * 128;     /* grouped: this tile's slice of x */
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    float acc[NT][4], blk[NT][4], tot[NT][4];

#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[j][i] = 0.0f;
            tot[j][i] = 0.0f;
        }

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk)
            load_tile<MODE, NT>(a, smem + s * sbytes, smem + s * sbytes + GEMM_ROWS * GEMM_TILE_BYTES, kt0 + s, row0, xk0,
                                nb);
        dsv4_cp_async_commit();
    }
    for (int i = 0; i < nk; i++) {
        dsv4_cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int nx = i + STAGES - 1, s = nx % STAGES;
            if (nx < nk)
                load_tile<MODE, NT>(a, smem + s * sbytes, smem + s * sbytes + GEMM_ROWS * GEMM_TILE_BYTES, kt0 + nx,
                                    row0, xk0, nb);
            dsv4_cp_async_commit();
        }
        const uint8_t *ws = smem + (i % STAGES) * sbytes, *xs = ws + GEMM_ROWS * GEMM_TILE_BYTES;
        const uint8_t *xl = xs + NT * 8 * gemm_xrow(MODE);      /* lo plane: fp8raw, bf16 */
        const int kt = kt0 + i;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                blk[j][q] = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int c = t + 4 * h;
            uint32_t w0v[4], w1v[4];
            load_wrows(ws, r0, r1, c, w0v, w1v);
#pragma unroll
            for (int j = 0; j < NT; j++)
                gemm_chunk_mma<MODE>(w0v, w1v, xs, xl, j * 8 + g, c, blk[j]);
        }
        if (MODE != GEMM_BF16) {
            const float sw = dsv4_ue8m0(__ldg(a.wscale + (row0 / GEMM_ROWS) * a.scale_stride + kt));
            const int64_t sab = a.k / 128, sk = xk0 / 128 + kt;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int n0 = min(nb + j * 8 + 2 * t, a.rows - 1), n1 = min(nb + j * 8 + 2 * t + 1, a.rows - 1);
                const float s0 = sw * __ldg(a.sa + (int64_t)n0 * sab + sk), s1 = sw * __ldg(a.sa + (int64_t)n1 * sab + sk);
                acc[j][0] += blk[j][0] * s0;
                acc[j][1] += blk[j][1] * s1;
                acc[j][2] += blk[j][2] * s0;
                acc[j][3] += blk[j][3] * s1;
            }
        } else {
            /* Each 64-wide k-tile is summed from zero and added on the CUDA cores (round to nearest):
             * the MMA accumulator does not round to nearest, and across all 64 k-tiles of the head
             * (K 4096, one split) its error reached 1.9e-5 of f32 math. */
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int q = 0; q < 4; q++)
                    acc[j][q] += blk[j][q];
        }
        if (SEQ && ((i + 1) % a.per == 0 || i + 1 == nk)) {     /* the end of a split: fold it in */
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    tot[j][q] += acc[j][q];
                    acc[j][q] = 0.0f;
                }
        }
    }
    dsv4_cp_async_wait<0>();

    /* c0 (row g, col 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1) of each m16n8 tile */
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int n = nb + j * 8 + 2 * t + (q & 1);
            const int64_t o = row0 + (q < 2 ? r0 : r1);
            if (n >= a.rows || o >= a.out)
                continue;
            if (SEQ)
                a.y[(int64_t)n * a.ldy + o] = tot[j][q];
            else if (a.splits == 1)
                a.y[(int64_t)n * a.ldy + o] = acc[j][q];
            else
                a.part[((int64_t)split * a.rows + n) * a.out + o] = acc[j][q];
        }
    }
}

/* y[n, o] = sum over splits in order (pending_at: the sum every reader of pending partials makes) */
__global__ void gemm_reduce_kernel(const dsv4_cuda_pending p, float *__restrict__ y, int64_t ldy)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.plane)
        return;
    y[(i / p.out) * ldy + i % p.out] = pending_at(p, nullptr, i);
}

/* Warp w of the grid takes (row n, 128-block kb) of x f32 [rows, ldx] (k columns; or pending in px,
 * where ldx == k): its four values a lane and the block's amax. False for warps past the last block. */
static __device__ __forceinline__ bool prep_block(const float *__restrict__ x, const dsv4_cuda_pending &px,
                                                  int64_t ldx, int rows, int64_t k, int64_t *n, int64_t *kb,
                                                  float (&v)[4], float *amax)
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    const int64_t nkb = k / 128, blk = (int64_t)blockIdx.x * (blockDim.x / DSV4_CUDA_WARP) + threadIdx.x / DSV4_CUDA_WARP;
    if (blk >= rows * nkb)
        return false;
    *n = blk / nkb;
    *kb = blk % nkb;
    const int64_t src = *n * ldx + *kb * 128;
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[i] = pending_at(px, x, src + i * DSV4_CUDA_WARP + lane);
        m = fmaxf(m, fabsf(v[i]));
    }
    *amax = dsv4_warp_max(m);
    return true;
}

/* Where value v (0..127) of a 1x128 block goes in xa: in place, or in the wgmma kernel's order */
static __device__ __forceinline__ int xa_pos(int v, bool wg)
{
    return wg ? gemm_wg_pos(v) : v;
}

/* One warp per (row, 128-block): the official quantizer (as fp8_roundtrip_kernel), written as the
 * e4m3 values in f16 [rows, K] (each block in place, or in wgmma order) and the scale [rows, K/128]. */
__global__ void gemm_quant_kernel(const float *__restrict__ x, const dsv4_cuda_pending px, int64_t ldx, int rows,
                                  int64_t k, bool wg, __half *__restrict__ xa, float *__restrict__ sa)
{
    dsv4_pdl_enter();
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    int64_t n, kb;
    float v[4], amax;
    if (!prep_block(x, px, ldx, rows, k, &n, &kb, v, &amax))
        return;
    const float s = dsv4_act_scale(amax), inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v[i] * inv, __NV_SATFINITE, __NV_E4M3);
        __half_raw h = __nv_cvt_fp8_to_halfraw(q, __NV_E4M3);
        xa[n * k + kb * 128 + xa_pos(i * DSV4_CUDA_WARP + lane, wg)] = *reinterpret_cast<__half *>(&h);
    }
    if (lane == 0)
        sa[n * (k / 128) + kb] = s;
}

/* One warp per (row, 128-block) of x f32 [rows, ldx] (k columns): the block divided by s, the power
 * of two at or below its amax (1 for a zero, subnormal or non-finite amax), as f16 hi [rows, k]
 * then lo [rows, k] with hi + lo = x / s to 2^-22 (each block in place, or in wgmma order); s -> sa
 * [rows, k / 128]. */
__global__ void gemm_split16_kernel(const float *__restrict__ x, const dsv4_cuda_pending px, int64_t ldx, int rows,
                                    int64_t k, bool wg, __half *__restrict__ xa, float *__restrict__ sa)
{
    dsv4_pdl_enter();
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    int64_t n, kb;
    float v[4], amax;
    if (!prep_block(x, px, ldx, rows, k, &n, &kb, v, &amax))
        return;
    const uint32_t e = __float_as_uint(amax) & 0x7f800000u;
    const float s = e == 0u || e == 0x7f800000u ? 1.0f : __uint_as_float(e), inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float u = v[i] * inv;
        const __half hi = __float2half_rn(u);
        const int64_t o = n * k + kb * 128 + xa_pos(i * DSV4_CUDA_WARP + lane, wg);
        xa[o] = hi;
        xa[(int64_t)rows * k + o] = __float2half_rn(u - __half2float(hi));
    }
    if (lane == 0)
        sa[n * (k / 128) + kb] = s;
}

/* Where value i of a bf16 row goes in xa: in place, or each 64-value block in the wgmma kernel's order */
static __device__ __forceinline__ int64_t xa_pos_bf16(int64_t i, bool wg)
{
    return wg ? (i & ~(int64_t)63) + gemm_wg_pos_bf16((int)(i & 63)) : i;
}

/* x f32 [rows, ldx] (or pending in px, where ldx == k) -> hi [rows, K], lo [rows, K] bf16 (each 64-value
 * block in place, or in wgmma order) */
__global__ void gemm_split_kernel(const float *__restrict__ x, const dsv4_cuda_pending px, int64_t ldx, int rows,
                                  int64_t k, bool wg, __nv_bfloat16 *__restrict__ xa)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)rows * k)
        return;
    const float v = pending_at(px, x, (i / k) * ldx + i % k);
    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
    const int64_t o = (i / k) * k + xa_pos_bf16(i % k, wg);
    xa[o] = hi;
    xa[(int64_t)rows * k + o] = __float2bfloat16_rn(v - __bfloat162float(hi));
}

/* grid (ceil(k / GEMM_NORM_PART), rows): y = RMSNorm(x) [rows, k] as rmsnorm_kernel writes it, then
 * y prepared for a linear of MODE in the same launch: fp8, the 1x128 quantizer with
 * gemm_quant_kernel's arithmetic (each warp a 128-block, each lane the values i * 32 + lane, as
 * prep_block reads them); bf16, hi and lo planes as gemm_split_kernel writes them. Every block of a
 * row stages the row in shared memory and takes r from it with rmsnorm_row_scale (norm_row.cuh,
 * the sum of squares rmsnorm_row uses), so each gets rmsnorm_kernel's r; then it normalizes and
 * prepares its part of GEMM_NORM_PART columns from shared memory (at batch 1 one block had made
 * the whole row, reading its normalized values back from memory). */
#define GEMM_NORM_PART 1024                         /* columns a block prepares: a 128-block a warp */
#define GEMM_NORM_MAX_K (48 * 1024 / (int)sizeof(float))    /* the row in the default shared memory */
static_assert(GEMM_NORM_PART == 128 * (NORM_THREADS / DSV4_CUDA_WARP), "one 128-block a warp");

template <int MODE>
__global__ void __launch_bounds__(NORM_THREADS)
gemm_norm_prep_kernel(const float *__restrict__ x, const dsv4_cuda_pending px, const float *__restrict__ w, int rows,
                      int k, float eps, float *y, bool wg, void *__restrict__ xa, float *__restrict__ sa)
{
    dsv4_pdl_enter();
    extern __shared__ float xs[];       /* [k]: the row */
    const int64_t n = blockIdx.y;
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    float *yr = y + n * k;

    for (int i = threadIdx.x; i < k; i += NORM_THREADS)
        xs[i] = pending_at(px, x, n * k + i);
    __syncthreads();
    const float r = rmsnorm_row_scale(xs, k, eps);

    /* warp: the 128-block kb of this block's part, lane: values kb * 128 + i * 32 + lane */
    const int kb = blockIdx.x * (GEMM_NORM_PART / 128) + warp;
    if (kb >= k / 128)
        return;
    float v[4], m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int e = kb * 128 + i * DSV4_CUDA_WARP + lane;
        v[i] = (w ? w[e] : 1.0f) * (xs[e] * r);
        yr[e] = v[i];
        m = fmaxf(m, fabsf(v[i]));
    }
    if (MODE == GEMM_BF16) {
        __nv_bfloat16 *hi = static_cast<__nv_bfloat16 *>(xa) + n * k, *lo = hi + (int64_t)rows * k;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int e = kb * 128 + i * DSV4_CUDA_WARP + lane;
            const int64_t o = xa_pos_bf16(e, wg);
            const __nv_bfloat16 h = __float2bfloat16_rn(v[i]);
            hi[o] = h;
            lo[o] = __float2bfloat16_rn(v[i] - __bfloat162float(h));
        }
        return;
    }
    __half *q = static_cast<__half *>(xa) + n * k;
    const float s = dsv4_act_scale(dsv4_warp_max(m)), inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __nv_fp8_storage_t e = __nv_cvt_float_to_fp8(v[i] * inv, __NV_SATFINITE, __NV_E4M3);
        __half_raw h = __nv_cvt_fp8_to_halfraw(e, __NV_E4M3);
        q[kb * 128 + xa_pos(i * DSV4_CUDA_WARP + lane, wg)] = *reinterpret_cast<__half *>(&h);
    }
    if (lane == 0)
        sa[n * (k / 128) + kb] = s;
}

extern "C" size_t dsv4_cuda_gemm_ws_bytes(int rows, int64_t max_k)
{
    const size_t xa = (size_t)rows * (size_t)max_k * 4;         /* f16 values or bf16 hi + lo */
    const size_t sa = (size_t)rows * (size_t)((max_k + 127) / 128) * 4;
    const size_t part = (size_t)min(rows, DSV4_CUDA_MAX_BATCH) * DSV4_CUDA_GEMM_PART_FLOATS_PER_ROW * 4;
    return (xa + 255) / 256 * 256 + (sa + 255) / 256 * 256 + 2 * part;
}

extern "C" void dsv4_cuda_gemm_ws_init(struct dsv4_cuda_gemm_ws *ws, void *base, int rows, int64_t max_k)
{
    uint8_t *p = static_cast<uint8_t *>(base);
    const size_t xa = (size_t)rows * (size_t)max_k * 4, sa = (size_t)rows * (size_t)((max_k + 127) / 128) * 4;
    ws->xa = p;
    ws->sa = reinterpret_cast<float *>(p + (xa + 255) / 256 * 256);
    const size_t part = (size_t)min(rows, DSV4_CUDA_MAX_BATCH) * DSV4_CUDA_GEMM_PART_FLOATS_PER_ROW;
    ws->part[0] = reinterpret_cast<float *>(p + (xa + 255) / 256 * 256 + (sa + 255) / 256 * 256);
    ws->part[1] = ws->part[0] + part;
    ws->part_seq = 0;
    ws->rows = rows;
    ws->max_k = max_k;
    ws->prepared.x = nullptr;
}

static int gemm_mode(const struct dsv4_cuda_linear *W, bool quant_act)
{
    return W->fmt == DSV4_W_FP8 ? (quant_act ? GEMM_FP8 : GEMM_FP8RAW) : GEMM_BF16;
}

extern "C" bool dsv4_cuda_gemm_supports(const struct dsv4_cuda_linear *W, bool quant_act)
{
    const int64_t vb = W->fmt == DSV4_W_FP8 ? 1 : 2;
    if (W->fmt != DSV4_W_FP8 && (W->fmt != DSV4_W_BF16 || quant_act))
        return false;
    return W->out >= 1 && W->scale_row0 % GEMM_ROWS == 0 && W->in % kvals(gemm_mode(W, quant_act)) == 0 &&
           (W->row_stride * vb) % 16 == 0 && (uintptr_t)W->w % 16 == 0;
}

extern "C" bool dsv4_cuda_gemm_grouped_supports(const struct dsv4_cuda_linear *W, int groups)
{
    return W->fmt == DSV4_W_FP8 && groups >= 1 && W->out % groups == 0 && (W->out / groups) % GEMM_ROWS == 0 &&
           dsv4_cuda_gemm_supports(W, false);
}

/* Splits of K: depends only on W's shape (batch invariance). */
static void gemm_splits(int64_t out, int nkt, int *per, int *splits)
{
    const int64_t tiles = (out + GEMM_ROWS - 1) / GEMM_ROWS;
    int64_t s = (GEMM_TARGET_CTAS + tiles - 1) / tiles;
    s = s < nkt / GEMM_MIN_TILES_PER_SPLIT ? s : nkt / GEMM_MIN_TILES_PER_SPLIT;
    s = s < DSV4_CUDA_GEMM_PART_FLOATS_PER_ROW / out ? s : DSV4_CUDA_GEMM_PART_FLOATS_PER_ROW / out;
    s = s < 1 ? 1 : s;
    *per = (int)((nkt + s - 1) / s);
    *splits = (nkt + *per - 1) / *per;
}

static int gemm_stages = GEMM_STAGES_MAX;     /* chosen by dsv4_cuda_gemm_prepare */
static bool gemm_wg = false;                    /* prefill chunks' FP8 linears on wgmma (gemm_wgmma.cu) */
static bool gemm_wg_decode = false;             /* and decode batches of more than GEMM_WG_DECODE_MIN rows */
static const char *gemm_wg_why_not = "dsv4_cuda_gemm_prepare not run";     /* when gemm_wg is false */
static bool gemm_direct = true;                 /* launches of <= 8 rows with weights in registers (gemm_direct.cu) */

/* Where the image has the wgmma kernels, the linears that take them (x then prepared in their order):
 * an FP8 linear of a prefill chunk, and an FP8 or BF16 one of a decode batch of more than
 * GEMM_WG_DECODE_MIN rows. Up to GEMM_WG_DECODE_MIN rows (one n8 tile) the register kernel
 * (gemm_direct.cu) and the ring stay; so do a prefill chunk's BF16 linears, small weights (the router
 * gate, the compressors) whose 64-row blocks would leave SMs idle where the ring takes narrower ones. */
#define GEMM_WG_DECODE_MIN 8
static bool use_wgmma(int mode, int rows)
{
    if (!gemm_wg)
        return false;
    if (rows > DSV4_CUDA_MAX_BATCH)
        return mode != GEMM_BF16;
    return gemm_wg_decode && rows > GEMM_WG_DECODE_MIN;
}

static int gemm_sms = 1;                        /* the device's SMs: CTAs of a launch's first wave, at least */
static int64_t gemm_prefetch = (int64_t)DSV4_CUDA_PREFETCH_KB_DEFAULT << 10;   /* bytes; well inside L2 */

template <int MODE, int NT, int STAGES, bool SEQ = false>
static int prepare_one()
{
    DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_kernel<MODE, NT, STAGES, SEQ>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(STAGES * stage_bytes(MODE, NT))));
    return 0;
}

/* Ring depth of a CTA walking all of a long K (one split of GEMM_WALK_TILES or more: the head) with NT
 * n8 tiles, where GEMM_STAGES_MAX would allow fewer CTAs an SM. Measured on the H200 (dsv4-bench, the
 * BF16 head [129280, 4096]): at batch 1 3 stages (4 CTAs an SM) 264 us against 275 with 4; at batch 64
 * 2 stages (64 KB, 3 CTAs an SM) made the 4-layer step 2% faster than 3 (96 KB, 2 CTAs), at batch 16
 * 3 stages (60 KB, 3 CTAs) 0.6% faster than 2. */
static constexpr int walk_stages(int nt)
{
    return nt == GEMM_MAX_NT ? 2 : 3;
}

/* the kernels of MODE for long single-split walks of 1, 2, 4 and 8 n8 tiles */
template <int MODE>
static int prepare_walk()
{
    int rc = prepare_one<MODE, 1, walk_stages(1)>();
    rc = rc ? rc : prepare_one<MODE, 2, walk_stages(2)>();
    rc = rc ? rc : prepare_one<MODE, 4, walk_stages(4)>();
    return rc ? rc : prepare_one<MODE, GEMM_MAX_NT, walk_stages(GEMM_MAX_NT)>();
}

/* the prefill (SEQ) kernels of MODE: row blocks of 8, 16, 32 and 64 */
template <int MODE, int STAGES>
static int prepare_seq()
{
    int rc = prepare_one<MODE, 1, STAGES, true>();
    rc = rc ? rc : prepare_one<MODE, 2, STAGES, true>();
    rc = rc ? rc : prepare_one<MODE, 4, STAGES, true>();
    return rc ? rc : prepare_one<MODE, GEMM_MAX_NT, STAGES, true>();
}

template <int STAGES>
static int prepare_stages()
{
    int rc = 0;
    rc = rc ? rc : prepare_one<GEMM_FP8, 1, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8, 2, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8, 4, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8, GEMM_MAX_NT, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_BF16, 1, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_BF16, 2, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_BF16, 4, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_BF16, GEMM_MAX_NT, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8RAW, 1, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8RAW, 2, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8RAW, 4, STAGES>();
    rc = rc ? rc : prepare_one<GEMM_FP8RAW, GEMM_MAX_NT, STAGES>();
    rc = rc ? rc : prepare_seq<GEMM_FP8, STAGES>();
    rc = rc ? rc : prepare_seq<GEMM_BF16, STAGES>();
    rc = rc ? rc : prepare_seq<GEMM_FP8RAW, STAGES>();
    return rc;
}

/* The ring depth: GEMM_STAGES_MAX where the current device's opt-in shared memory per block holds
 * its largest stage set, else GEMM_STAGES_MIN; DSV4_CUDA_GEMM_STAGES=2 forces the short ring (to
 * test on a large device the path small ones take). */
extern "C" int dsv4_cuda_gemm_prepare(void)
{
    int dev = 0, optin = 0;
    struct dsv4_cuda_switches sw;
    int rc = dsv4_cuda_switches_read(&sw);
    if (rc < 0)
        return rc;
    DSV4_CUDA_TRY(cudaGetDevice(&dev));
    DSV4_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    DSV4_CUDA_TRY(cudaDeviceGetAttribute(&gemm_sms, cudaDevAttrMultiProcessorCount, dev));
    gemm_prefetch = sw.gemm_prefetch_kb << 10;
    const size_t big = stage_bytes(GEMM_FP8RAW, GEMM_MAX_NT);
    if ((size_t)optin < GEMM_STAGES_MIN * big)
        return dsv4_error_set(-ENOTSUP, "gemm: device %d offers %d bytes of shared memory a block; the tensor-core "
                              "linears need %zu", dev, optin, GEMM_STAGES_MIN * big);
    gemm_stages = (size_t)optin >= GEMM_STAGES_MAX * big && sw.gemm_stages != GEMM_STAGES_MIN ? GEMM_STAGES_MAX
                                                                                              : GEMM_STAGES_MIN;
    gemm_wg_why_not = "DSV4_CUDA_GEMM_WGMMA=0";
    if (sw.gemm_wgmma && (rc = gemm_wgmma_prepare(optin, &gemm_wg_why_not)) < 0)
        return rc;
    gemm_wg = sw.gemm_wgmma && !gemm_wg_why_not;
    gemm_wg_decode = gemm_wg && sw.gemm_wgmma_decode;
    gemm_direct = sw.gemm_direct;
    if ((rc = prepare_walk<GEMM_FP8>()) < 0 || (rc = prepare_walk<GEMM_FP8RAW>()) < 0 ||
        (rc = prepare_walk<GEMM_BF16>()) < 0)
        return rc;
    if ((rc = gemm_direct_prepare()) < 0)
        return rc;
    return gemm_stages == GEMM_STAGES_MAX ? prepare_stages<GEMM_STAGES_MAX>() : prepare_stages<GEMM_STAGES_MIN>();
}

extern "C" int dsv4_cuda_gemm_stages(void)
{
    return gemm_stages;
}

extern "C" int64_t dsv4_cuda_gemm_prefetch_bytes(void)
{
    return gemm_prefetch;
}

extern "C" bool dsv4_cuda_gemm_wgmma(void)
{
    return gemm_wg;
}

extern "C" const char *dsv4_cuda_gemm_wgmma_why_not(void)
{
    return gemm_wg ? nullptr : gemm_wg_why_not;
}

extern "C" bool dsv4_cuda_gemm_wgmma_decode(void)
{
    return gemm_wg_decode;
}

extern "C" bool dsv4_cuda_gemm_direct(void)
{
    return gemm_direct;
}

template <int MODE, int NT, bool SEQ = false>
static int launch(gemm_args a, cudaStream_t s, const char *name)
{
    const unsigned tiles = (unsigned)((a.out + GEMM_ROWS - 1) / GEMM_ROWS);
    const dim3 grid = SEQ ? dim3((unsigned)((a.rows + NT * 8 - 1) / (NT * 8)), tiles)
                          : dim3(tiles, (unsigned)a.splits);
    gemm_set_prefetch(&a, (int64_t)grid.x * grid.y, gemm_sms, SEQ ? a.nkt : a.per, gemm_prefetch);
    /* the shorter walks were as fast or faster with GEMM_STAGES_MAX */
    if (!SEQ && gemm_stages == GEMM_STAGES_MAX && a.splits == 1 && a.per >= GEMM_WALK_TILES)
        dsv4_launch(gemm_kernel<MODE, NT, walk_stages(NT), false>, grid, GEMM_THREADS,
                    walk_stages(NT) * stage_bytes(MODE, NT), s, a);
    else if (gemm_stages == GEMM_STAGES_MAX)
        dsv4_launch(gemm_kernel<MODE, NT, GEMM_STAGES_MAX, SEQ>, grid, GEMM_THREADS,
                    GEMM_STAGES_MAX * stage_bytes(MODE, NT), s, a);
    else
        dsv4_launch(gemm_kernel<MODE, NT, GEMM_STAGES_MIN, SEQ>, grid, GEMM_THREADS,
                    GEMM_STAGES_MIN * stage_bytes(MODE, NT), s, a);
    DSV4_CUDA_LAUNCHED(name);
    return 0;
}

template <int MODE>
static int launch_nt(const gemm_args &a, bool wg, cudaStream_t s)
{
    if (wg) {
        dsv4_cuda_count_launch(a.rows > DSV4_CUDA_MAX_BATCH ? DSV4_CUDA_V_GEMM_FP8_WGMMA
                                                            : DSV4_CUDA_V_GEMM_WGMMA_DECODE);
        return gemm_wgmma_launch(MODE, a, gemm_sms, gemm_prefetch, s);
    }
    if (gemm_direct && gemm_direct_fits(MODE, a)) {
        dsv4_cuda_count_launch(DSV4_CUDA_V_GEMM_DIRECT);
        return gemm_direct_launch(MODE, a, gemm_sms, gemm_prefetch, s);
    }
    /* one variant a launch: the wgmma and direct kernels above count as themselves only */
    dsv4_cuda_count_launch(MODE == GEMM_FP8 ? DSV4_CUDA_V_GEMM_FP8_MMA : MODE == GEMM_FP8RAW ? DSV4_CUDA_V_GEMM_FP8RAW_MMA
                                                                                         : DSV4_CUDA_V_GEMM_BF16_MMA);
    const char *name = MODE == GEMM_FP8 ? "gemm_fp8_mma" : MODE == GEMM_FP8RAW ? "gemm_fp8raw_mma" : "gemm_bf16x2_mma";
    if (a.rows <= 8)
        return launch<MODE, 1>(a, s, name);
    if (a.rows <= 16)
        return launch<MODE, 2>(a, s, name);
    if (a.rows <= 32)
        return launch<MODE, 4>(a, s, name);
    if (a.rows <= DSV4_CUDA_MAX_BATCH)
        return launch<MODE, GEMM_MAX_NT>(a, s, name);
    /* a prefill chunk: blocks of 64 rows, or narrower where a small weight would leave SMs idle (the
     * router gate [256, 4096] at 1024 rows made 32 CTAs of 64); a row's arithmetic does not depend
     * on its block's width */
    const int64_t tiles = (a.out + GEMM_ROWS - 1) / GEMM_ROWS;
    const auto ctas = [&](int nt) { return tiles * ((a.rows + nt * 8 - 1) / (nt * 8)); };
    if (ctas(GEMM_MAX_NT) >= gemm_sms)
        return launch<MODE, GEMM_MAX_NT, true>(a, s, name);
    if (ctas(4) >= gemm_sms)
        return launch<MODE, 4, true>(a, s, name);
    if (ctas(2) >= gemm_sms)
        return launch<MODE, 2, true>(a, s, name);
    return launch<MODE, 1, true>(a, s, name);
}

/* Record that ws's xa and sa now hold x [rows, ldx] (k columns) prepared for `mode` (wg: in the wgmma
 * kernel's order), for dsv4_cuda_gemm_same_x. */
static void mark_prepared(struct dsv4_cuda_gemm_ws *ws, const float *x, int64_t ldx, int64_t k, int rows, int mode,
                          bool wg)
{
    ws->prepared.x = x;
    ws->prepared.ldx = ldx;
    ws->prepared.k = k;
    ws->prepared.rows = rows;
    ws->prepared.mode = mode;
    ws->prepared.wg_order = wg;
}

/* groups > 1: fp8raw only (checked by the callers). px: x pending (NULL: read d_x); py: leave the
 * result pending there where K is split (NULL: reduce it into d_y). */
static int gemm_run(const struct dsv4_cuda_linear *W, int groups, const float *d_x, const dsv4_cuda_pending *px,
                    int64_t ldx, int rows, bool quant_act, bool same_x, struct dsv4_cuda_gemm_ws *ws, float *d_y,
                    int64_t ldy, dsv4_cuda_pending *py, cudaStream_t s)
{
    const int mode = gemm_mode(W, quant_act);
    const int64_t k = W->in * groups;
    const bool wg = use_wgmma(mode, rows);
    const bool pend_x = px && px->splits;
    const bool prepared = same_x && !pend_x && ws->prepared.x == d_x && ws->prepared.ldx == ldx &&
                          ws->prepared.k == k && ws->prepared.rows == rows && ws->prepared.mode == mode &&
                          ws->prepared.wg_order == wg;
    const dsv4_cuda_pending xp = pending_or_none(px);
    gemm_args a = {};
    int rc;

    if (py)
        *py = dsv4_cuda_pending{};
    if (!prepared)
        ws->prepared.x = nullptr;     /* xa is rewritten below: it holds this x only once that succeeded */
    if (rows < 1 || rows > ws->rows || k > ws->max_k)
        return dsv4_error_set(-EINVAL, "gemm: %d rows of width %lld exceed the workspace (%d rows, width %lld)", rows,
                              (long long)k, ws->rows, (long long)ws->max_k);
    if (pend_x && ldx != k)
        return dsv4_error_set(-EINVAL, "gemm: a pending x is read densely (row stride %lld for width %lld)",
                              (long long)ldx, (long long)k);
    if ((rc = dsv4_cuda_pending_live(px, rows, k, "gemm")) < 0)
        return rc;
    a.w = static_cast<const uint8_t *>(W->w);
    a.row_bytes = W->row_stride * (mode == GEMM_BF16 ? 2 : 1);
    a.wscale = W->scale + (W->scale_row0 / GEMM_ROWS) * W->scale_stride;
    a.scale_stride = W->scale_stride;
    a.out = W->out;
    a.nkt = (int)(W->in / kvals(mode));
    a.rows = rows;
    a.xa = static_cast<const uint8_t *>(ws->xa);
    a.k = k;
    a.grp_rows = W->out / groups;
    a.sa = ws->sa;
    a.y = d_y;
    a.ldy = ldy;
    gemm_splits(W->out, a.nkt, &a.per, &a.splits);
    /* above DSV4_CUDA_MAX_BATCH rows the CTAs fold the splits themselves (no partials) */
    const bool parts = a.splits > 1 && rows <= DSV4_CUDA_MAX_BATCH;
    a.part = ws->part[(ws->part_seq + (parts ? 1 : 0)) & 1];

    if (mode == GEMM_BF16) {
        const int64_t n = (int64_t)rows * W->in;
        if (!prepared) {
            dsv4_launch(gemm_split_kernel, (unsigned)((n + 255) / 256), 256, 0, s, d_x, xp, ldx, rows, W->in, wg,
                        static_cast<__nv_bfloat16 *>(ws->xa));
            DSV4_CUDA_LAUNCHED("gemm_split");
        }
        rc = launch_nt<GEMM_BF16>(a, wg, s);
    } else {
        const int warps = 8;
        const int64_t nblk = (int64_t)rows * (k / 128);
        const unsigned grid = (unsigned)((nblk + warps - 1) / warps);
        if (mode == GEMM_FP8) {
            if (!prepared) {
                dsv4_launch(gemm_quant_kernel, grid, warps * DSV4_CUDA_WARP, 0, s, d_x, xp, ldx, rows, k, wg,
                            static_cast<__half *>(ws->xa), ws->sa);
                DSV4_CUDA_LAUNCHED("gemm_quant");
            }
            rc = launch_nt<GEMM_FP8>(a, wg, s);
        } else {
            if (!prepared) {
                dsv4_launch(gemm_split16_kernel, grid, warps * DSV4_CUDA_WARP, 0, s, d_x, xp, ldx, rows, k, wg,
                            static_cast<__half *>(ws->xa), ws->sa);
                DSV4_CUDA_LAUNCHED("gemm_split16");
            }
            rc = launch_nt<GEMM_FP8RAW>(a, wg, s);
        }
    }
    if (rc < 0)
        return rc;
    if (!pend_x)        /* xa holds a sum that no pointer names: no later call takes it as prepared */
        mark_prepared(ws, d_x, ldx, k, rows, mode, wg);
    if (!parts)
        return 0;
    ws->part_seq++;
    dsv4_cuda_pending p = {};
    p.part = a.part;
    p.plane = (int64_t)rows * W->out;
    p.out = W->out;
    p.rows = rows;
    p.splits = a.splits;
    p.ws = ws;
    p.seq = ws->part_seq;
    if (py && ldy == W->out) {
        *py = p;
        return 0;
    }
    return dsv4_cuda_pending_flush(&p, d_y, ldy, s);
}

extern "C" int dsv4_cuda_pending_live(const struct dsv4_cuda_pending *p, int rows, int64_t out, const char *reader)
{
    if (!p || !p->splits)
        return 0;
    if (p->rows != rows || p->out != out)
        return dsv4_error_set(-EINVAL, "%s: a pending result of [%d, %lld] read as [%d, %lld]", reader, p->rows,
                              (long long)p->out, rows, (long long)out);
    if (p->ws->part_seq - p->seq <= 1)
        return 0;
    return dsv4_error_set(-EFAULT, "%s: the pending split-K partials it reads [%d, %lld] were overwritten by %u later "
                          "linears on the same workspace (a linear's result must be read before the second linear "
                          "after it)", reader, p->rows, (long long)p->out, p->ws->part_seq - p->seq - 1);
}

extern "C" int dsv4_cuda_pending_flush(const struct dsv4_cuda_pending *p, float *d_y, int64_t ldy, void *stream)
{
    if (!p || !p->splits)
        return 0;
    const int rc = dsv4_cuda_pending_live(p, p->rows, p->out, "gemm_reduce");
    if (rc < 0)
        return rc;
    dsv4_launch(gemm_reduce_kernel, (unsigned)((p->plane + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream), *p,
                d_y, ldy);
    DSV4_CUDA_LAUNCHED("gemm_reduce");
    return 0;
}

static int gemm_one(const struct dsv4_cuda_linear *W, const float *d_x, const dsv4_cuda_pending *px, int64_t ldx,
                    int rows, bool quant_act, bool same_x, struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy,
                    dsv4_cuda_pending *py, void *stream)
{
    if (!dsv4_cuda_gemm_supports(W, quant_act))
        return dsv4_error_set(-EINVAL, "gemm: a %s linear [%lld, %lld] (row stride %lld) with %s activations has no "
                              "tensor-core path (FP8 takes either, BF16 raw ones only; K a multiple of %d, rows "
                              "16-byte aligned)", W->fmt == DSV4_W_FP8 ? "FP8" : W->fmt == DSV4_W_BF16 ? "BF16" :
                              "F32/FP4", (long long)W->out, (long long)W->in, (long long)W->row_stride,
                              quant_act ? "quantized" : "raw", kvals(gemm_mode(W, quant_act)));
    return gemm_run(W, 1, d_x, px, ldx, rows, quant_act, same_x, ws, d_y, ldy, py, static_cast<cudaStream_t>(stream));
}

extern "C" int dsv4_cuda_gemm(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int rows, bool quant_act,
                              struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy, void *stream)
{
    return gemm_one(W, d_x, nullptr, ldx, rows, quant_act, false, ws, d_y, ldy, nullptr, stream);
}

extern "C" int dsv4_cuda_gemm_same_x(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int rows,
                                     bool quant_act, struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy,
                                     void *stream)
{
    return gemm_one(W, d_x, nullptr, ldx, rows, quant_act, true, ws, d_y, ldy, nullptr, stream);
}

extern "C" int dsv4_cuda_gemm_deferred(const struct dsv4_cuda_linear *W, const float *d_x,
                                       const struct dsv4_cuda_pending *d_px, int64_t ldx, int rows, bool quant_act,
                                       bool same_x, struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy,
                                       struct dsv4_cuda_pending *d_py, void *stream)
{
    return gemm_one(W, d_x, d_px, ldx, rows, quant_act, same_x, ws, d_y, ldy, d_py, stream);
}

extern "C" bool dsv4_cuda_gemm_norm_supports(const struct dsv4_cuda_linear *W, bool quant_act)
{
    const int mode = gemm_mode(W, quant_act);
    return (mode == GEMM_FP8 || mode == GEMM_BF16) && dsv4_cuda_gemm_supports(W, quant_act) && W->in % 128 == 0 &&
           W->in <= GEMM_NORM_MAX_K;
}

extern "C" int dsv4_cuda_gemm_norm(const struct dsv4_cuda_linear *W, bool quant_act, const float *d_x,
                                   const struct dsv4_cuda_pending *d_px, const float *d_w, int rows, float eps,
                                   struct dsv4_cuda_gemm_ws *ws, float *d_y, void *stream)
{
    const int mode = gemm_mode(W, quant_act);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int k = (int)W->in;
    const dsv4_cuda_pending xp = pending_or_none(d_px);
    int rc;

    ws->prepared.x = nullptr;
    if (!dsv4_cuda_gemm_norm_supports(W, quant_act))
        return dsv4_error_set(-EINVAL, "gemm_norm: a linear [%lld, %lld] of format %d with %s activations has no "
                              "fused preparation (FP8 quantized or BF16, K a multiple of 128 up to %d)",
                              (long long)W->out, (long long)W->in, (int)W->fmt, quant_act ? "quantized" : "raw",
                              GEMM_NORM_MAX_K);
    if (rows < 1 || rows > ws->rows || k > ws->max_k)
        return dsv4_error_set(-EINVAL, "gemm_norm: %d rows of width %d exceed the workspace (%d rows, width %lld)",
                              rows, k, ws->rows, (long long)ws->max_k);
    if ((rc = dsv4_cuda_pending_live(d_px, rows, k, "gemm_norm")) < 0)
        return rc;
    if (d_x == d_y && !xp.splits && k > GEMM_NORM_PART)
        return dsv4_error_set(-EINVAL, "gemm_norm: in place only for rows of at most %d values or a pending x (a "
                              "row of %d is read by %d blocks while they write it)", GEMM_NORM_PART, k,
                              (k + GEMM_NORM_PART - 1) / GEMM_NORM_PART);
    const bool wg = use_wgmma(mode, rows);
    const dim3 grid((unsigned)((k + GEMM_NORM_PART - 1) / GEMM_NORM_PART), (unsigned)rows);
    const size_t smem = (size_t)k * sizeof(float);
    if (mode == GEMM_FP8)
        dsv4_launch(gemm_norm_prep_kernel<GEMM_FP8>, grid, NORM_THREADS, smem, s, d_x, xp, d_w, rows, k, eps, d_y, wg,
                    ws->xa, ws->sa);
    else
        dsv4_launch(gemm_norm_prep_kernel<GEMM_BF16>, grid, NORM_THREADS, smem, s, d_x, xp, d_w, rows, k, eps, d_y,
                    wg, ws->xa, ws->sa);
    DSV4_CUDA_LAUNCHED("gemm_norm_prep");
    mark_prepared(ws, d_y, k, k, rows, mode, wg);
    return 0;
}

extern "C" int dsv4_cuda_gemm_grouped(const struct dsv4_cuda_linear *W, int groups, const float *d_x, int64_t ldx,
                                      int rows, struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy,
                                      void *stream)
{
    return dsv4_cuda_gemm_grouped_deferred(W, groups, d_x, ldx, rows, ws, d_y, ldy, nullptr, stream);
}

extern "C" int dsv4_cuda_gemm_grouped_deferred(const struct dsv4_cuda_linear *W, int groups, const float *d_x,
                                               int64_t ldx, int rows, struct dsv4_cuda_gemm_ws *ws, float *d_y,
                                               int64_t ldy, struct dsv4_cuda_pending *d_py, void *stream)
{
    if (!dsv4_cuda_gemm_grouped_supports(W, groups))
        return dsv4_error_set(-EINVAL, "gemm: linear [%lld, %lld] in %d groups has no grouped tensor-core path (FP8, "
                              "%d-row multiples per group, K a multiple of 128)", (long long)W->out, (long long)W->in,
                              groups, GEMM_ROWS);
    return gemm_run(W, groups, d_x, nullptr, ldx, rows, false, false, ws, d_y, ldy, d_py,
                    static_cast<cudaStream_t>(stream));
}
