/* SPDX-License-Identifier: MIT */
/* Skinny-batch linears: y[b] = W x[b] for up to DSV4_CUDA_MAX_ROWS rows, weights in their
 * checkpoint format (F32, BF16, FP8 e4m3 128x128 UE8M0, FP4 e2m1 1x32 UE8M0) dequantized in
 * registers, f32 accumulation. One warp per output row; each lane loads 16 weight bytes a step, so
 * a warp streams 512 contiguous bytes of its row. A block covers GEMV_ROWS rows and GEMV_NB batch
 * rows; larger batches launch more blocks along y and re-read the weights (from L2 when they fit).
 * Twin: dsv4_twin_linear_matvec (engine/cpu/cpu_twin_cuda.c), dsv4_linear_matvec in the CPU backend.
 * Plus the official activation quantizer (1x128 e4m3, UE8M0), twin dsv4_twin_fp8_roundtrip. */
#include "kernels/cuda_util.cuh"

#define GEMV_ROWS 8             /* warps (output rows) per block */
#define GEMV_NB 8               /* batch rows per block: accumulators per lane */
#define GEMV_VEC_BYTES 16       /* weight bytes a lane loads per step */

/* grid (ceil(out / GEMV_ROWS), ceil(batch / GEMV_NB)), block GEMV_ROWS warps. */
template <typename WF>
__global__ void __launch_bounds__(GEMV_ROWS * DSV4_CUDA_WARP)
gemv_kernel(const struct dsv4_cuda_linear W, const float *__restrict__ x, int64_t ldx, int batch,
            float *__restrict__ y, int64_t ldy)
{
    dsv4_pdl_enter();
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    const int64_t row = (int64_t)blockIdx.x * GEMV_ROWS + threadIdx.x / DSV4_CUDA_WARP;
    const int b0 = blockIdx.y * GEMV_NB;
    const int nb = min(GEMV_NB, batch - b0);
    /* bytes per row; FP4 packs two values a byte */
    const int64_t row_bytes = WF::vals == wf_fp4::vals ? W.row_stride / 2 : W.row_stride * (GEMV_VEC_BYTES / WF::vals);
    float acc[GEMV_NB];

    if (row >= W.out)
        return;
#pragma unroll
    for (int b = 0; b < GEMV_NB; b++)
        acc[b] = 0.0f;
    const uint8_t *wrow = static_cast<const uint8_t *>(W.w) + row * row_bytes;
#pragma unroll 2
    for (int64_t k = (int64_t)lane * WF::vals; k < W.in; k += (int64_t)DSV4_CUDA_WARP * WF::vals) {
        const uint4 wv = __ldg(reinterpret_cast<const uint4 *>(wrow + k / WF::vals * GEMV_VEC_BYTES));
        const float s = wscale<WF>(W, row, k);
#pragma unroll
        for (int b = 0; b < GEMV_NB; b++)
            if (b < nb)
                acc[b] += s * wdot<WF>::dot(wv, x + (int64_t)(b0 + b) * ldx + k);
    }
#pragma unroll
    for (int b = 0; b < GEMV_NB; b++) {
        float v = dsv4_warp_sum(acc[b]);
        if (lane == 0 && b < nb)
            y[(int64_t)(b0 + b) * ldy + row] = v;
    }
}

template <typename WF>
static int launch_gemv(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int batch,
                       float *d_y, int64_t ldy, cudaStream_t s, const char *name)
{
    dim3 grid((unsigned)((W->out + GEMV_ROWS - 1) / GEMV_ROWS), (unsigned)((batch + GEMV_NB - 1) / GEMV_NB));
    dsv4_launch(gemv_kernel<WF>, grid, GEMV_ROWS * DSV4_CUDA_WARP, 0, s, *W, d_x, ldx, batch, d_y, ldy);
    DSV4_CUDA_LAUNCHED(name);
    return 0;
}

extern "C" int dsv4_cuda_gemv(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx,
                              int batch, float *d_y, int64_t ldy, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    int vals;

    if (batch < 1 || batch > DSV4_CUDA_MAX_ROWS)
        return dsv4_error_set(-EINVAL, "gemv: batch %d outside 1..%d", batch, DSV4_CUDA_MAX_ROWS);
    switch (W->fmt) {
    case DSV4_W_F32: vals = wf_f32::vals; break;
    case DSV4_W_BF16: vals = wf_bf16::vals; break;
    case DSV4_W_FP8: vals = wf_fp8::vals; break;
    case DSV4_W_FP4: vals = wf_fp4::vals; break;
    default:
        return dsv4_error_set(-ENOTSUP, "gemv: weight format %d has no CUDA kernel (F16 linears are "
                              "not in either release)", (int)W->fmt);
    }
    /* 16-byte loads of weights and x: every row and every x row must start 16-byte aligned */
    if (W->in % vals || W->row_stride % vals || ldx % 4 || ((uintptr_t)W->w | (uintptr_t)d_x) % 16)
        return dsv4_error_set(-EINVAL, "gemv: in %lld / row stride %lld must be multiples of %d and "
                              "ldx %lld of 4, with 16-byte aligned pointers", (long long)W->in,
                              (long long)W->row_stride, vals, (long long)ldx);
    switch (W->fmt) {
    case DSV4_W_F32:
        dsv4_cuda_count_launch(DSV4_CUDA_V_GEMV_F32);
        return launch_gemv<wf_f32>(W, d_x, ldx, batch, d_y, ldy, s, "gemv_f32");
    case DSV4_W_BF16:
        dsv4_cuda_count_launch(DSV4_CUDA_V_GEMV_BF16);
        return launch_gemv<wf_bf16>(W, d_x, ldx, batch, d_y, ldy, s, "gemv_bf16");
    case DSV4_W_FP8:
        dsv4_cuda_count_launch(DSV4_CUDA_V_GEMV_FP8);
        return launch_gemv<wf_fp8>(W, d_x, ldx, batch, d_y, ldy, s, "gemv_fp8");
    default:
        dsv4_cuda_count_launch(DSV4_CUDA_V_GEMV_FP4);
        return launch_gemv<wf_fp4>(W, d_x, ldx, batch, d_y, ldy, s, "gemv_fp4");
    }
}

/* One warp per block of `block` values (block a multiple of 32, at most 32 * ROUNDTRIP_PER_LANE);
 * a row of k values ends in a shorter block when block does not divide k (as engine/model/quant.c). */
#define ROUNDTRIP_PER_LANE 8

__global__ void fp8_roundtrip_kernel(const float *__restrict__ x, int64_t nblocks, int64_t k, int block,
                                     float *__restrict__ y)
{
    dsv4_pdl_enter();
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    const int64_t blk = (int64_t)blockIdx.x * (blockDim.x / DSV4_CUDA_WARP) + threadIdx.x / DSV4_CUDA_WARP;
    const int64_t per_row = (k + block - 1) / block;
    float v[ROUNDTRIP_PER_LANE], amax = 0.0f;

    if (blk >= nblocks)
        return;
    const int64_t row = blk / per_row, k0 = blk % per_row * block;
    const int len = (int)(k - k0 < block ? k - k0 : block);
    const float *src = x + row * k + k0;
#pragma unroll
    for (int i = 0; i < ROUNDTRIP_PER_LANE; i++) {
        const int j = i * DSV4_CUDA_WARP + lane;
        v[i] = j < len ? src[j] : 0.0f;
        amax = fmaxf(amax, fabsf(v[i]));
    }
    const float s = dsv4_act_scale(dsv4_warp_max(amax)), inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < ROUNDTRIP_PER_LANE; i++) {
        const int j = i * DSV4_CUDA_WARP + lane;
        if (j < len) {
            __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v[i] * inv, __NV_SATFINITE, __NV_E4M3);
            __half_raw h = __nv_cvt_fp8_to_halfraw(q, __NV_E4M3);
            y[row * k + k0 + j] = __half2float(*reinterpret_cast<__half *>(&h)) * s;
        }
    }
}

extern "C" int dsv4_cuda_fp8_roundtrip(const float *d_x, int rows, int64_t k, int block, float *d_y,
                                       void *stream)
{
    const int warps = 8;
    int64_t nblocks;

    if (block <= 0 || block % DSV4_CUDA_WARP || block > DSV4_CUDA_WARP * ROUNDTRIP_PER_LANE || k < 1)
        return dsv4_error_set(-EINVAL, "fp8_roundtrip: block %d must be a multiple of 32 up to %d (k %lld)", block,
                              DSV4_CUDA_WARP * ROUNDTRIP_PER_LANE, (long long)k);
    nblocks = (int64_t)rows * ((k + block - 1) / block);
    if (nblocks == 0)
        return 0;
    dsv4_launch(fp8_roundtrip_kernel, (unsigned)((nblocks + warps - 1) / warps), warps * DSV4_CUDA_WARP, 0,
                static_cast<cudaStream_t>(stream), d_x, nblocks, k, block, d_y);
    DSV4_CUDA_LAUNCHED("fp8_roundtrip");
    return 0;
}
