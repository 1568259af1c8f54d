/* SPDX-License-Identifier: MIT */
/* The two kernels of expert parallelism's MoE sublayer (doc/MULTIGPU.md) on either side of the
 * routed experts: a rank keeps of the gathered routing only the experts it holds, and a row's owner
 * takes each of its (row, expert) pairs' outputs from the rank holding that expert, so that the
 * unchanged moe_combine adds them as one device does. Twins: dsv4_twin_ep_mask, dsv4_twin_ep_select
 * (engine/cpu/cpu_twin_cuda.h). */
#include "kernels/cuda_util.cuh"

#define EP_THREADS 256

/* d_idx[i] = -1 where it is outside [e0, e1): the expert kernels and their combine skip such pairs */
__global__ void ep_mask_kernel(int32_t *__restrict__ idx, int n, int e0, int e1)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (idx[i] < e0 || idx[i] >= e1))
        idx[i] = -1;
}

/* g [ranks, pairs, dim]: g[i] = g[r pairs dim + i] for pair p = i / dim, r the rank holding p's expert
 * (the first r with idx[p] < e1[r]): each pair's expert output taken from the rank that computed it,
 * into block 0, in place (block 0 is this rank's own, so r = 0 leaves it). A pair with no expert
 * (idx -1) takes block 0's, which moe_combine skips. */
struct ep_bounds {
    int e1[DSV4_EP_MAX_GPUS];
};

__global__ void ep_select_kernel(float *__restrict__ g, const int32_t *__restrict__ idx, int ranks, int64_t pairs,
                                 int64_t dim, const ep_bounds b)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pairs * dim)
        return;
    const int e = idx[i / dim];
    int r = 0;
    while (r + 1 < ranks && e >= b.e1[r])
        r++;
    if (r)
        g[i] = g[(int64_t)r * pairs * dim + i];
}

extern "C" int dsv4_cuda_ep_select(float *d_g, const int32_t *d_idx, int ranks, const int *e1, int pairs, int64_t dim,
                                   void *stream)
{
    if (ranks < 1 || ranks > DSV4_EP_MAX_GPUS || pairs < 1 || dim < 1)
        return dsv4_error_set(-EINVAL, "ep_select: %d ranks (1..%d), %d pairs, dim %lld", ranks, DSV4_EP_MAX_GPUS,
                              pairs, (long long)dim);
    ep_bounds b = {};
    for (int r = 0; r < ranks; r++)
        b.e1[r] = e1[r];
    const int64_t n = (int64_t)pairs * dim;
    dsv4_launch(ep_select_kernel, (unsigned)((n + EP_THREADS - 1) / EP_THREADS), EP_THREADS, 0,
                static_cast<cudaStream_t>(stream), d_g, d_idx, ranks, (int64_t)pairs, dim, b);
    DSV4_CUDA_LAUNCHED("ep_select");
    return 0;
}

extern "C" int dsv4_cuda_ep_mask(int32_t *d_idx, int n, int e0, int e1, void *stream)
{
    if (n < 1 || e0 < 0 || e1 <= e0)
        return dsv4_error_set(-EINVAL, "ep_mask: %d pairs, experts [%d, %d)", n, e0, e1);
    dsv4_launch(ep_mask_kernel, (unsigned)((n + EP_THREADS - 1) / EP_THREADS), EP_THREADS, 0,
                static_cast<cudaStream_t>(stream), d_idx, n, e0, e1);
    DSV4_CUDA_LAUNCHED("ep_mask");
    return 0;
}
