/* SPDX-License-Identifier: MIT */
/* The two kernels of expert parallelism's MoE sublayer (doc/MULTIGPU.md) on either side of the
 * routed experts: a rank keeps of the gathered routing only the experts it holds, and a row's owner
 * adds the partial sums every rank returned, in rank order, then the shared expert's output.
 * Twins: dsv4_twin_ep_mask, dsv4_twin_ep_sum (engine/cpu/cpu_twin_cuda.h). */
#include "kernels/cuda_util.cuh"
#include "kernels/pending.cuh"

#define EP_THREADS 256

/* d_idx[i] = -1 where it is outside [e0, e1): the expert kernels and their combine skip such pairs */
__global__ void ep_mask_kernel(int32_t *__restrict__ idx, int n, int e0, int e1)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (idx[i] < e0 || idx[i] >= e1))
        idx[i] = -1;
}

/* y[i] = ((ret[0][i] + ret[1][i]) + ...) + add[i]: the ranks' partial sums in rank order from rank
 * 0's (not from 0.0f: with one rank that is moe_combine's acc + add, the same bits), then the add */
__global__ void ep_sum_kernel(const float *__restrict__ ret, int ranks, int64_t n, const float *__restrict__ add,
                              const dsv4_cuda_pending padd, float *__restrict__ y)
{
    dsv4_pdl_enter();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float acc = ret[i];
    for (int h = 1; h < ranks; h++)
        acc += ret[(int64_t)h * n + i];
    y[i] = add ? acc + pending_at(padd, add, i) : acc;
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

extern "C" int dsv4_cuda_ep_sum(const float *d_ret, int ranks, int rows, int64_t dim, const float *d_add,
                                const struct dsv4_cuda_pending *d_padd, float *d_y, void *stream)
{
    int rc;
    if (ranks < 1 || ranks > DSV4_EP_MAX_GPUS || rows < 1 || rows > DSV4_CUDA_MAX_ROWS || dim < 1)
        return dsv4_error_set(-EINVAL, "ep_sum: %d ranks (1..%d), %d rows (1..%d), dim %lld", ranks,
                              DSV4_EP_MAX_GPUS, rows, DSV4_CUDA_MAX_ROWS, (long long)dim);
    if (d_padd && d_padd->splits && !d_add)
        return dsv4_error_set(-EINVAL, "ep_sum: a pending add needs the buffer it stands for");
    if ((rc = dsv4_cuda_pending_live(d_padd, rows, dim, "ep_sum")) < 0)
        return rc;
    const int64_t n = (int64_t)rows * dim;
    dsv4_launch(ep_sum_kernel, (unsigned)((n + EP_THREADS - 1) / EP_THREADS), EP_THREADS, 0,
                static_cast<cudaStream_t>(stream), d_ret, ranks, n, d_add, pending_or_none(d_padd), d_y);
    DSV4_CUDA_LAUNCHED("ep_sum");
    return 0;
}
