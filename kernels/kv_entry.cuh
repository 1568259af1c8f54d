/* SPDX-License-Identifier: MIT */
/* The KV entry codec of doc/MODEL.md §5.2, shared by the window store, the compressors and attention. */
#ifndef DSV4_KERNELS_KV_ENTRY_CUH
#define DSV4_KERNELS_KV_ENTRY_CUH

#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"

#define KV_GROUP 64             /* official KV quantization block */

/* Block-cooperative store of v_s[hd] (shared) as one entry at dst. sc_s: shared scratch of
 * ceil(nope/64) floats. Every thread of the block must call it. */
static __device__ void dsv4_entry_store(const float *v_s, uint8_t *dst, int hd, int rd, int kvf, float *sc_s)
{
    if (kvf == DSV4_KV_F32) {
        float *o = reinterpret_cast<float *>(dst);
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
            o[d] = v_s[d];
        return;
    }
    const int nope = hd - rd, nsc = (nope + KV_GROUP - 1) / KV_GROUP;
    for (int g = threadIdx.x; g < nsc; g += blockDim.x) {
        float amax = 0.0f;
        for (int d = g * KV_GROUP; d < min(nope, (g + 1) * KV_GROUP); d++)
            amax = fmaxf(amax, fabsf(v_s[d]));
        sc_s[g] = dsv4_act_scale(amax);
        dst[nope + 2 * rd + g] = (uint8_t)(__float_as_uint(sc_s[g]) >> 23);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        if (d < nope) {
            dst[d] = __nv_cvt_float_to_fp8(v_s[d] / sc_s[d / KV_GROUP], __NV_SATFINITE, __NV_E4M3);
        } else {
            /* bf16, round to nearest even, as one aligned 16-bit store (nope is even) */
            uint32_t u = __float_as_uint(v_s[d]);
            u += 0x7fffu + ((u >> 16) & 1u);
            reinterpret_cast<uint16_t *>(dst + nope)[d - nope] = (uint16_t)(u >> 16);
        }
    }
    __syncthreads();
}

static __device__ __forceinline__ float dsv4_entry_load(const uint8_t *e, int d, int hd, int rd, int kvf)
{
    if (kvf == DSV4_KV_F32)
        return reinterpret_cast<const float *>(e)[d];
    const int nope = hd - rd;
    if (d < nope) {
        __half_raw h = __nv_cvt_fp8_to_halfraw(e[d], __NV_E4M3);
        return __half2float(*reinterpret_cast<__half *>(&h)) * dsv4_ue8m0(e[nope + 2 * rd + d / KV_GROUP]);
    }
    return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(e + nope)[d - nope] << 16);
}

#endif
