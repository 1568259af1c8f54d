/* SPDX-License-Identifier: MIT */
/* Warp-level tensor-core and async-copy primitives shared by the kernels that use them (gemm.cu,
 * moe.cu, indexer.cu, attention.cu): mma.sync m16n8k16 with f32 accumulation (sm_80+, so every
 * image we build has it), cp.async into shared memory, 16-byte shared loads, bf16 packing.
 * Fragment layouts are the PTX ISA's for m16n8k16: a[4] = A rows g and g+8 at k (2t, 2t+1) and
 * (2t+8, 2t+9); b0, b1 = B column g at the same k; d = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1),
 * with g = lane / 4 and t = lane % 4. */
#ifndef DSV4_KERNELS_MMA_CUH
#define DSV4_KERNELS_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* d[4] += A (16x16 bf16) B (16x8 bf16) */
static __device__ __forceinline__ void dsv4_mma_bf16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* d[4] += A (16x16 f16) B (16x8 f16) */
static __device__ __forceinline__ void dsv4_mma_f16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* (lo, hi) rounded to bf16 and packed, lo in the low half: one MMA operand register */
static __device__ __forceinline__ uint32_t dsv4_bf16x2(float lo, float hi)
{
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

static __device__ __forceinline__ uint4 dsv4_lds128(const uint8_t *p)
{
    return *reinterpret_cast<const uint4 *>(p);
}

/* 16 bytes global -> shared, bypassing L1 */
static __device__ __forceinline__ void dsv4_cp_async16(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

/* 4 bytes global -> shared (through L1: the only size .ca allows below 16) */
static __device__ __forceinline__ void dsv4_cp_async4(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

static __device__ __forceinline__ void dsv4_cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

/* wait until at most N committed groups are still in flight */
template <int N>
static __device__ __forceinline__ void dsv4_cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#endif
