/* SPDX-License-Identifier: MIT */
/* A routed expert's score from its router logit (score_func sqrtsoftplus: sqrt(log(1 + e^l)), the
 * logit itself past 20 where log1p(e^l) is l in f32): shared by the router (moe.cu) and the fetch
 * prediction (expert_fetch.cu), which must rank experts as the router will. */
#ifndef DSV4_KERNELS_ROUTE_SCORE_CUH
#define DSV4_KERNELS_ROUTE_SCORE_CUH

static __device__ __forceinline__ float dsv4_route_score(float l)
{
    return sqrtf(l > 20.0f ? l : log1pf(expf(l)));
}

#endif
