/* SPDX-License-Identifier: MIT */
/* Shared by the kernel files: checked CUDA calls, launch checks, number-format helpers. */
#ifndef DSV4_KERNELS_CUDA_UTIL_CUH
#define DSV4_KERNELS_CUDA_UTIL_CUH

#include <errno.h>
#include <stdint.h>

#include <utility>

#include <cuda_fp8.h>
#include <cuda_runtime.h>

extern "C" {
#include "engine/error.h"
}

#include "kernels/cuda_fault.cuh"
#include "kernels/dsv4cuda.h"

#define DSV4_CUDA_WARP 32
#define DSV4_CUDA_FP8_BLOCK 128         /* weight scale block, both axes */
#define DSV4_CUDA_FP4_BLOCK 32          /* FP4 scale block along K */
#define DSV4_CUDA_E4M3_MAX 448.0f
#define DSV4_CUDA_AMAX_FLOOR 1e-4f

/* Return -EIO (-ENOTRECOVERABLE for a sticky error, cuda_fault.cuh) with the CUDA error text when
 * `call` fails. */
#define DSV4_CUDA_TRY(call)                                                                    \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            return dsv4_error_set(dsv4_cuda_errno(e_), "%s: %s (%s:%d)", #call,               \
                                  cudaGetErrorString(e_), __FILE__, __LINE__);                 \
    } while (0)

/* After a launch: configuration errors surface here; asynchronous faults at the next sync. */
#define DSV4_CUDA_LAUNCHED(name)                                                               \
    do {                                                                                       \
        cudaError_t e_ = cudaGetLastError();                                                   \
        if (e_ != cudaSuccess)                                                                 \
            return dsv4_error_set(dsv4_cuda_errno(e_), "launching %s: %s", name,              \
                                  cudaGetErrorString(e_));                                     \
    } while (0)

/* Per-variant launch counters (device.cu). */
void dsv4_cuda_count_launch(enum dsv4_cuda_variant v);

/* Programmatic dependent launch (sm_90 and later). When dsv4_cuda_pdl() is on, every kernel of this
 * library is launched with programmatic stream serialization: its blocks are scheduled as soon as every
 * block of the kernel before it in the stream has started, so each launch's latency hides behind the
 * tail of the kernel before. The rule that keeps this exact: every kernel calls dsv4_pdl_enter(), which
 * waits until the previous kernel has finished and its writes are visible (griddepcontrol.wait), before
 * it touches any global memory a kernel writes; only weights, constant after boot, may be read (or
 * prefetched) earlier. Both instructions are no-ops in a kernel launched without the attribute. */
bool dsv4_cuda_pdl(void);

static __device__ __forceinline__ void dsv4_pdl_enter(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Hint the 128-byte line holding p into L2 (no register result, so it never stalls the thread). */
static __device__ __forceinline__ void dsv4_prefetch_l2(const void *p)
{
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/* The same into L1 (and L2), for data a block reads again soon in small pieces. */
static __device__ __forceinline__ void dsv4_prefetch_l1(const void *p)
{
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

/* Fills `at` with the programmatic-serialization attribute; returns how many attributes it wrote (0 or 1). */
static inline unsigned dsv4_pdl_attr(cudaLaunchAttribute *at)
{
    if (!dsv4_cuda_pdl())
        return 0;
    at->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at->val.programmaticStreamSerializationAllowed = 1;
    return 1;
}

/* kernel<<<grid, block, smem, s>>>(args...), with the attribute above. Errors surface through
 * DSV4_CUDA_LAUNCHED, which follows every launch (the runtime records them as the last error). */
template <typename... P, typename... A>
static inline void dsv4_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A &&...args)
{
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.numAttrs = dsv4_pdl_attr(&at);
    cfg.attrs = cfg.numAttrs ? &at : nullptr;
    (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

static __device__ __forceinline__ float dsv4_warp_sum(float v)
{
    for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float dsv4_warp_max(float v)
{
    for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* 2^(e-127) for a UE8M0 byte (0xff, NaN in the format, never appears in valid scales). */
static __device__ __forceinline__ float dsv4_ue8m0(uint8_t e)
{
    return e ? __uint_as_float((uint32_t)e << 23) : 5.877471754e-39f;   /* 2^-127, subnormal */
}

/* The official activation scale: max(amax, 1e-4) / 448 rounded up to a power of two. */
static __device__ __forceinline__ float dsv4_act_scale(float amax)
{
    uint32_t u = __float_as_uint(fmaxf(amax, DSV4_CUDA_AMAX_FLOOR) / DSV4_CUDA_E4M3_MAX);
    uint32_t exp = (u >> 23) & 0xff;
    if (u & 0x7fffff)
        exp++;
    return __uint_as_float(exp << 23);
}

/* One interleaved RoPE pair (a, b) rotated by pos * inv_freq (inverse: by its negative), as
 * engine/cpu/cpu_rope.c does it: a' = a cos - b sin, b' = b cos + a sin. Every product is an
 * explicit round-to-nearest operation, a' = fma(-b, sin, a cos) and b' = fma(a, sin, b cos), so
 * each kernel that rotates (norm, compressor, indexer queries, attention output) gets the same
 * bits from the same inputs, whatever the compiler would contract in each. The inverse only
 * negates sin, so its a' = fma(b, sin, a cos) and b' = fma(-a, sin, b cos) exactly. */
static __device__ __forceinline__ void dsv4_rope_pair(float *a, float *b, float inv_freq, int pos, bool inverse)
{
    const float angle = __fmul_rn(inv_freq, (float)pos);
    float cs = cosf(angle), sn = sinf(angle);
    if (inverse)
        sn = -sn;
    const float x = *a, y = *b;
    *a = __fmaf_rn(-y, sn, __fmul_rn(x, cs));
    *b = __fmaf_rn(x, sn, __fmul_rn(y, cs));
}

/* Two e4m3 bytes (low byte first) to floats, exactly. */
static __device__ __forceinline__ float2 dsv4_e4m3x2(uint16_t v)
{
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    return __half22float2(*reinterpret_cast<__half2 *>(&h));
}

/* One e2m1 nibble to float by building the bits: magnitude codes 1..7 are 0.5,1,1.5,2,3,4,6. */
static __device__ __forceinline__ float dsv4_e2m1(uint32_t nib)
{
    uint32_t m = nib & 7u, bits;
    bits = m < 2 ? m * 0x3f000000u : ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22));
    return __uint_as_float(bits | ((nib & 8u) << 28));
}

/* Dot 16 weight bytes (4 f32, 8 bf16, 16 e4m3 or 32 e2m1 values, low first) with as many floats of
 * x (16-byte aligned), unscaled. */
static __device__ __forceinline__ float dsv4_dot_f32(const uint4 &w, const float *x)
{
    float4 xv = *reinterpret_cast<const float4 *>(x);
    return __uint_as_float(w.x) * xv.x + __uint_as_float(w.y) * xv.y +
           __uint_as_float(w.z) * xv.z + __uint_as_float(w.w) * xv.w;
}

static __device__ __forceinline__ float dsv4_dot_bf16(const uint4 &w, const float *x)
{
    const uint32_t u[4] = { w.x, w.y, w.z, w.w };
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 xv = *reinterpret_cast<const float2 *>(x + 2 * i);
        acc += __uint_as_float(u[i] << 16) * xv.x + __uint_as_float(u[i] & 0xffff0000u) * xv.y;
    }
    return acc;
}

static __device__ __forceinline__ float dsv4_dot_fp8(const uint4 &w, const float *x)
{
    const uint32_t u[4] = { w.x, w.y, w.z, w.w };
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float4 xv = *reinterpret_cast<const float4 *>(x + 4 * i);
        float2 lo = dsv4_e4m3x2((uint16_t)(u[i] & 0xffff)), hi = dsv4_e4m3x2((uint16_t)(u[i] >> 16));
        acc += lo.x * xv.x + lo.y * xv.y + hi.x * xv.z + hi.y * xv.w;
    }
    return acc;
}

static __device__ __forceinline__ float dsv4_dot_fp4(const uint4 &w, const float *x)
{
    const uint32_t u[4] = { w.x, w.y, w.z, w.w };
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float4 xv = *reinterpret_cast<const float4 *>(x + 8 * i + 4 * j);
            uint32_t b = u[i] >> (16 * j);
            acc += dsv4_e2m1(b) * xv.x + dsv4_e2m1(b >> 4) * xv.y + dsv4_e2m1(b >> 8) * xv.z +
                   dsv4_e2m1(b >> 12) * xv.w;
        }
    }
    return acc;
}

/* Weight formats as kernel template tags: values per 16-byte load and the dequantizing dot. */
struct wf_f32 { static constexpr int vals = 4; };
struct wf_bf16 { static constexpr int vals = 8; };
struct wf_fp8 { static constexpr int vals = 16; };
struct wf_fp4 { static constexpr int vals = 32; };

template <typename WF> struct wdot;
template <> struct wdot<wf_f32> {
    static __device__ __forceinline__ float dot(const uint4 &w, const float *x) { return dsv4_dot_f32(w, x); }
};
template <> struct wdot<wf_bf16> {
    static __device__ __forceinline__ float dot(const uint4 &w, const float *x) { return dsv4_dot_bf16(w, x); }
};
template <> struct wdot<wf_fp8> {
    static __device__ __forceinline__ float dot(const uint4 &w, const float *x) { return dsv4_dot_fp8(w, x); }
};
template <> struct wdot<wf_fp4> {
    static __device__ __forceinline__ float dot(const uint4 &w, const float *x) { return dsv4_dot_fp4(w, x); }
};

/* Scale of the 16 weight bytes at (row, k): FP8 one per 128x128 block, FP4 one per 1x32. */
template <typename WF>
static __device__ __forceinline__ float wscale(const struct dsv4_cuda_linear &W, int64_t row, int64_t k)
{
    if constexpr (WF::vals == wf_fp8::vals)
        return dsv4_ue8m0(W.scale[((W.scale_row0 + row) / DSV4_CUDA_FP8_BLOCK) * W.scale_stride + k / DSV4_CUDA_FP8_BLOCK]);
    else if constexpr (WF::vals == wf_fp4::vals)
        return dsv4_ue8m0(W.scale[row * W.scale_stride + k / DSV4_CUDA_FP4_BLOCK]);
    else
        return 1.0f;
}

/* Bytes of one weight row stored contiguously: FP4 packs two values a byte. */
template <typename WF>
static __device__ __forceinline__ int64_t wrow_bytes(int64_t row_stride)
{
    return WF::vals == wf_fp4::vals ? row_stride / 2 : row_stride * (16 / WF::vals);
}

#endif
