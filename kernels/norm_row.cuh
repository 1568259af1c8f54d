/* SPDX-License-Identifier: MIT */
/* The RMSNorm of one row by a whole block, shared by the norm kernels (norm.cu), the linears that
 * normalize their input in the launch that prepares it (gemm.cu) and the compressors' emission
 * (compressor.cu): one definition, so all give the same bits. */
#ifndef DSV4_KERNELS_NORM_ROW_CUH
#define DSV4_KERNELS_NORM_ROW_CUH

#include "kernels/cuda_util.cuh"

#define NORM_THREADS 256

/* Block-wide sum over NORM_THREADS threads; every thread gets the result. */
static __device__ float block_sum(float v)
{
    __shared__ float part[NORM_THREADS / DSV4_CUDA_WARP];
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    v = dsv4_warp_sum(v);
    __syncthreads();            /* part[] may still be read by a previous call */
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    v = lane < NORM_THREADS / DSV4_CUDA_WARP ? part[lane] : 0.0f;
    return dsv4_warp_sum(v);
}

/* r = 1 / sqrt(mean(xr^2) + eps) over n values (global or shared memory), by the whole block: thread
 * t sums the squares of values t + NORM_THREADS j in order of j, then block_sum; every thread gets
 * r. rmsnorm_row, gemm.cu's norm + preparation and the compressors' emission take r from here, so
 * they get the same bits. */
static __device__ __forceinline__ float rmsnorm_row_scale(const float *xr, int n, float eps)
{
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS)
        ss += xr[i] * xr[i];
    return 1.0f / sqrtf(block_sum(ss) / n + eps);
}

/* yr = w * xr / sqrt(mean(xr^2) + eps) over n values, by the whole block (w NULL: no weight). */
static __device__ __forceinline__ void rmsnorm_row(const float *xr, const float *w, int n, float eps, float *yr)
{
    const float r = rmsnorm_row_scale(xr, n, eps);
    for (int i = threadIdx.x; i < n; i += NORM_THREADS)
        yr[i] = (w ? w[i] : 1.0f) * (xr[i] * r);
}

#endif
