/* SPDX-License-Identifier: MIT */
/* Warpgroup MMA (wgmma, sm_90a only): the instructions the prefill linears use, and the shared-memory
 * matrix descriptor. Callers compile these only into the sm_90a image (__CUDA_ARCH_FEAT_SM90_ALL).
 *
 * wgmma.m64nNk16 with A in registers takes each warp's A rows (16 of the warpgroup's 64) in exactly
 * mma.sync m16n8k16's fragment layout, and B from shared memory. On the H200 a chain of them gives
 * mma.sync's bits for every output (f16 operands, f32 accumulation, N 8 and 64: checked bit for bit
 * before this path was written); the e4m3 form does not (its accumulation keeps fewer bits), so the
 * FP8 linears feed e4m3 values as f16. */
#ifndef DSV4_KERNELS_WGMMA_CUH
#define DSV4_KERNELS_WGMMA_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* B operand without swizzle: core matrices of 8 rows x 16 bytes (128 contiguous bytes); lbo = bytes
 * from one core matrix to the next along K, sbo = along N. */
static __device__ __forceinline__ uint64_t dsv4_wgmma_desc(const void *smem, uint32_t lbo, uint32_t sbo)
{
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a >> 4) & 0x3fff) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32);
}

/* Before the first wgmma that reads registers written since the last one (accumulators, A) */
static __device__ __forceinline__ void dsv4_wgmma_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/* Close the wgmmas issued since the last commit into a group */
static __device__ __forceinline__ void dsv4_wgmma_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Wait until at most N committed groups are in flight */
template <int N>
static __device__ __forceinline__ void dsv4_wgmma_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Pins an accumulator register in program order: the compiler sees wgmma's outputs as written when
 * the instruction issues, so without this it could read them before the wait that makes them valid. */
static __device__ __forceinline__ void dsv4_wgmma_pin(float &r)
{
    asm volatile("" : "+f"(r)::"memory");
}

/* Shared memory written by ordinary stores or cp.async, made visible to wgmma's reads */
static __device__ __forceinline__ void dsv4_fence_proxy_async(void)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* d[32] += A (64x16 f16, this warp's 16 rows in a[4]) B (16x64 f16 at desc, K-major); the accumulator
 * layout is mma.sync's per 8 columns: d[4j..4j+3] = (g, 8j+2t), (g, 8j+2t+1), (g+8, 8j+2t), (g+8, 8j+2t+1). */
static __device__ __forceinline__ void dsv4_wgmma_f16_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

#endif

#endif
