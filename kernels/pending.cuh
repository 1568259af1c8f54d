/* SPDX-License-Identifier: MIT */
/* Reading a linear's result that is still its split-K partials (struct dsv4_cuda_pending, dsv4cuda.h):
 * the consumers of decode-step linears sum the splits as they load their input, in the reduction
 * launch's order, and the step needs no reduction launch of its own. */
#ifndef DSV4_KERNELS_PENDING_CUH
#define DSV4_KERNELS_PENDING_CUH

#include "kernels/dsv4cuda.h"

/* The pending struct for "read x itself" (host: NULL pointers map to this). */
static inline dsv4_cuda_pending pending_or_none(const dsv4_cuda_pending *p)
{
    if (p)
        return *p;
    dsv4_cuda_pending none = {};
    return none;
}

#define PENDING_LOADS 8         /* partials loaded before they are added: one L2 round trip each 8 splits */

/* Value i of the dense result: x[i], or the partials' sum over splits in order from 0.0f, the one
 * definition of that sum (gemm_reduce_kernel is a reader like the others). The loads of a group are
 * issued together, the adds stay in split order. */
static __device__ __forceinline__ float pending_at(const dsv4_cuda_pending &p, const float *x, int64_t i)
{
    if (p.splits == 0)
        return x[i];
    const float *q = p.part + i;
    float v = 0.0f;
    int s = 0;
    for (; s + PENDING_LOADS <= p.splits; s += PENDING_LOADS) {
        float t[PENDING_LOADS];
#pragma unroll
        for (int j = 0; j < PENDING_LOADS; j++)
            t[j] = q[(int64_t)(s + j) * p.plane];
#pragma unroll
        for (int j = 0; j < PENDING_LOADS; j++)
            v += t[j];
    }
    for (; s < p.splits; s++)
        v += q[(int64_t)s * p.plane];
    return v;
}

#endif
