/* SPDX-License-Identifier: MIT */
/* Routing statistics: per layer, how many tokens the router sent to each expert. The counts choose
 * which experts stay on the GPU when they do not all fit (engine/model/placement.h); the launch
 * sits in the step's graphs right after the router and reads its idx buffer. */
#include "kernels/cuda_util.cuh"

#define ROUTE_COUNT_THREADS 256

/* One thread per (row, choice); padding rows of a bucket (the extra slot) are not tokens, and a choice
 * of -1 (the router skips a pair whose scores are NaN) names no expert. */
__global__ void __launch_bounds__(ROUTE_COUNT_THREADS)
route_count_kernel(const int32_t *__restrict__ idx, int pairs, int topk, const int32_t *__restrict__ slot,
                   int pad_slot, unsigned long long *__restrict__ counts)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x * ROUTE_COUNT_THREADS + threadIdx.x;
    if (i < pairs && slot[i / topk] != pad_slot && idx[i] >= 0)
        atomicAdd(&counts[idx[i]], 1ull);
}

extern "C" int dsv4_cuda_route_count(const int32_t *d_idx, int batch, int topk, const int32_t *d_slot, int pad_slot,
                                     uint64_t *d_counts, void *stream)
{
    if (batch < 1 || topk < 1 || !d_counts)
        return dsv4_error_set(-EINVAL, "cuda: route count of %d rows x %d", batch, topk);
    const int pairs = batch * topk;
    dsv4_launch(route_count_kernel, dim3((pairs + ROUTE_COUNT_THREADS - 1) / ROUTE_COUNT_THREADS),
                dim3(ROUTE_COUNT_THREADS), 0, static_cast<cudaStream_t>(stream), d_idx, pairs, topk, d_slot, pad_slot,
                reinterpret_cast<unsigned long long *>(d_counts));
    DSV4_CUDA_LAUNCHED("route_count");
    return 0;
}
