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

#define PENDING_LOADS 16        /* partials in flight a value: one L2 round trip for up to 16 splits */
#define PENDING_VALUES 4        /* values a thread sums together (pending_at_n) */

/* Values i0 + j * stride (j < n <= PENDING_VALUES) of the dense result into v[j]: x's, or each the
 * partials' sum over splits in order from 0.0f, the one definition of that sum (gemm_reduce_kernel is
 * a reader like the others). Up to PENDING_LOADS splits of every value are loaded before any is added;
 * a split past the last is not added at all (adding 0.0f would turn a -0.0f sum into +0.0f). */
template <int NV>
static __device__ __forceinline__ void pending_at_n(const dsv4_cuda_pending &p, const float *x, int64_t i0,
                                                    int64_t stride, int n, float (&v)[NV])
{
#pragma unroll
    for (int j = 0; j < NV; j++)
        v[j] = 0.0f;
    if (p.splits == 0) {
#pragma unroll
        for (int j = 0; j < NV; j++)
            if (j < n)
                v[j] = x[i0 + j * stride];
        return;
    }
    for (int s = 0; s < p.splits; s += PENDING_LOADS) {
        float t[NV][PENDING_LOADS];
#pragma unroll
        for (int j = 0; j < NV; j++)
#pragma unroll
            for (int l = 0; l < PENDING_LOADS; l++)
                t[j][l] = j < n && s + l < p.splits ? p.part[(int64_t)(s + l) * p.plane + i0 + j * stride] : 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++)
#pragma unroll
            for (int l = 0; l < PENDING_LOADS; l++)
                if (s + l < p.splits)
                    v[j] += t[j][l];
    }
}

/* Value i of the dense result (pending_at_n for one value). */
static __device__ __forceinline__ float pending_at(const dsv4_cuda_pending &p, const float *x, int64_t i)
{
    float v[1];
    pending_at_n<1>(p, x, i, 0, 1, v);
    return v[0];
}

#endif
