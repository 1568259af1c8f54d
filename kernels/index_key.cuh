/* SPDX-License-Identifier: MIT */
/* The official indexer key (doc/MODEL.md §5.2): dI values in e2m1 (two a byte, low nibble first) followed by
 * ceil(dI/32) UE8M0 scales, one per 32 values: 68 bytes at dI = 128. Written by the indexer
 * compressor (kernels/compressor.cu) after the Hadamard rotation and FP4 rounding
 * (dsv4_hadamard_fp4, which the indexer's queries take too), read by the indexer scores
 * (kernels/indexer.cu). */
#ifndef DSV4_KERNELS_INDEX_KEY_CUH
#define DSV4_KERNELS_INDEX_KEY_CUH

#include "kernels/cuda_util.cuh"

#define DSV4_INDEX_KEY_GROUP 32
#define DSV4_E2M1_MAX 6.0f
#define DSV4_E2M1_AMAX_FLOOR (6.0f * 0x1p-126f)  /* as engine/model/quant.c: amax/6 stays a normal float */

/* e2m1 round to nearest even on |a| <= 6 (grid 0.5 below 2, 1 below 4, then 2). */
static __device__ __forceinline__ float dsv4_e2m1_round(float v)
{
    float a = fminf(fabsf(v), DSV4_E2M1_MAX);
    a = a < 2.0f ? rintf(a * 2.0f) * 0.5f : a < 4.0f ? rintf(a) : 2.0f * rintf(a * 0.5f);
    return copysignf(a, v);
}

/* Shared x[n] (n a power of two): Hadamard (butterflies h = 1, 2, 4, ... as the CPU), scaled by
 * n^-1/2, then FP4 rounded in groups of 32 with UE8M0 scales sc_s [ceil(n/32)]. Block-cooperative. */
static __device__ void dsv4_hadamard_fp4(float *x, int n, float *sc_s)
{
    for (int h = 1; h < n; h *= 2) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            const int i = (p / h) * 2 * h + p % h;
            const float a = x[i], b = x[i + h];
            x[i] = a + b;
            x[i + h] = a - b;
        }
        __syncthreads();
    }
    const float norm = 1.0f / sqrtf((float)n);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        x[i] *= norm;
    __syncthreads();
    const int ng = (n + DSV4_INDEX_KEY_GROUP - 1) / DSV4_INDEX_KEY_GROUP;
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        float amax = 0.0f;
        for (int i = g * DSV4_INDEX_KEY_GROUP; i < min(n, (g + 1) * DSV4_INDEX_KEY_GROUP); i++)
            amax = fmaxf(amax, fabsf(x[i]));
        uint32_t u = __float_as_uint(fmaxf(amax, DSV4_E2M1_AMAX_FLOOR) / DSV4_E2M1_MAX), e = (u >> 23) & 0xff;
        if (u & 0x7fffff)
            e++;
        sc_s[g] = __uint_as_float(e << 23);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        x[i] = dsv4_e2m1_round(x[i] / sc_s[i / DSV4_INDEX_KEY_GROUP]) * sc_s[i / DSV4_INDEX_KEY_GROUP];
    __syncthreads();
}

static __host__ __device__ __forceinline__ int dsv4_index_key_bytes(int dI)
{
    return dI / 2 + (dI + DSV4_INDEX_KEY_GROUP - 1) / DSV4_INDEX_KEY_GROUP;
}

/* e2m1 code of x, an exact e2m1 value (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6). */
static __device__ __forceinline__ uint32_t dsv4_e2m1_code(float x)
{
    const float a = fabsf(x);
    const uint32_t m = a < 2.0f ? (uint32_t)(a * 2.0f) : a < 4.0f ? 2u + (uint32_t)a : a < 6.0f ? 6u : 7u;
    return m | (signbit(x) ? 8u : 0u);
}

/* Block-cooperative: v [dI] already FP4-rounded with scales sc [ceil(dI/32)] (powers of two). */
static __device__ void dsv4_index_key_store(const float *v, const float *sc, uint8_t *dst, int dI)
{
    for (int i = threadIdx.x; i < dI / 2; i += blockDim.x) {
        const float s = sc[2 * i / DSV4_INDEX_KEY_GROUP];
        dst[i] = (uint8_t)(dsv4_e2m1_code(v[2 * i] / s) | (dsv4_e2m1_code(v[2 * i + 1] / s) << 4));
    }
    for (int g = threadIdx.x; g < (dI + DSV4_INDEX_KEY_GROUP - 1) / DSV4_INDEX_KEY_GROUP; g += blockDim.x)
        dst[dI / 2 + g] = (uint8_t)(__float_as_uint(sc[g]) >> 23);
}

/* Value i of a stored key. */
static __device__ __forceinline__ float dsv4_index_key_load(const uint8_t *key, int i, int dI)
{
    return dsv4_e2m1(key[i / 2] >> (4 * (i & 1))) * dsv4_ue8m0(key[dI / 2 + i / DSV4_INDEX_KEY_GROUP]);
}

#endif
