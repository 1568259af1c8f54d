/* SPDX-License-Identifier: MIT */
/* Warpgroup MMA (wgmma, sm_90a only): the instructions the FP8 and BF16 linears use, and the
 * shared-memory matrix descriptor. Callers compile these only into the sm_90a image
 * (__CUDA_ARCH_FEAT_SM90_ALL).
 *
 * wgmma.m64nNk16 with A in registers takes each warp's A rows (16 of the warpgroup's 64) in exactly
 * mma.sync m16n8k16's fragment layout, and B from shared memory. On the H200 a chain of them gives
 * mma.sync's bits for every output (f16 operands, f32 accumulation, N 8 and 64: checked bit for bit
 * before this path was written; N 16 and 32, and bf16 operands, by test_gpu_linear's decode rows);
 * the e4m3 form does not (its accumulation keeps fewer bits), so the FP8 linears feed e4m3 values as
 * f16. */
#ifndef DSV4_KERNELS_WGMMA_CUH
#define DSV4_KERNELS_WGMMA_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* B operand, K-major, in the 128-byte swizzle a TMA load with CU_TENSOR_MAP_SWIZZLE_128B writes: rows
 * of 128 bytes (64 f16 along K), 8-row groups 1024 bytes apart (sbo), the 16-byte chunk c of row r at
 * chunk c ^ (r % 8) (the tile starts on 1024 bytes). A k16 step further along K starts 32 bytes further
 * in; the hardware applies the swizzle to the address it forms. Layout type 1 (bits 62-63) = 128B. */
static __device__ __forceinline__ uint64_t dsv4_wgmma_desc_sw128(const void *smem)
{
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a >> 4) & 0x3fff) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* The descriptor of the tile `off` bytes (a multiple of 16) past the one desc describes. The start
 * address field (bits 0-13) is the shared address / 16; shared addresses are below 2^18 (228 KB), so
 * a tile inside shared memory never carries out of the field and one add moves it. A k-tile's wgmmas
 * then pay an add each for their descriptors, not the conversion, shift and masks (sm_90a SASS: the
 * uniform-datapath share of the prefill expert kernel's instructions was 18%). */
static __device__ __forceinline__ uint64_t dsv4_wgmma_desc_at(uint64_t desc, uint32_t off)
{
    return desc + (off >> 4);
}

/* ---- mbarriers and TMA loads (the pipeline between a producer warp and the MMA warps) ---- */

static __device__ __forceinline__ uint32_t dsv4_smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void dsv4_mbar_init(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(dsv4_smem_addr(bar)), "r"(count) : "memory");
}

/* the inits above, visible to the async proxy (TMA) before any copy signals them */
static __device__ __forceinline__ void dsv4_mbar_init_fence(void)
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

static __device__ __forceinline__ void dsv4_mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(dsv4_smem_addr(bar)) : "memory");
}

/* one arrival that also expects `bytes` more of TMA traffic before the phase completes */
static __device__ __forceinline__ void dsv4_mbar_expect_tx(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(dsv4_smem_addr(bar)), "r"(bytes)
                 : "memory");
}

/* until the phase of the given parity has completed */
static __device__ __forceinline__ void dsv4_mbar_wait(uint64_t *bar, uint32_t parity)
{
    const uint32_t a = dsv4_smem_addr(bar);
    uint32_t done;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}\n"
                     : "=r"(done)
                     : "r"(a), "r"(parity)
                     : "memory");
    } while (!done);
}

/* TMA: the box of `map` at coordinates (c0 along the contiguous dimension, c1) into dst, counted on bar */
static __device__ __forceinline__ void dsv4_tma_load_2d(void *dst, const void *map, uint64_t *bar, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(dsv4_smem_addr(dst)), "l"(map), "r"(dsv4_smem_addr(bar)), "r"(c0), "r"(c1)
                 : "memory");
}

/* one arrival on bar once every cp.async this thread has issued so far has landed (.noinc: the
 * barrier's expected count includes these arrivals) */
static __device__ __forceinline__ void dsv4_cp_async_arrive(uint64_t *bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(dsv4_smem_addr(bar)) : "memory");
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

/* d[N / 2] += A (64x16, this warp's 16 rows in a[4]) B (16xN at desc, K-major), N 8, 16, 24, 32, 48
 * or 64, with f16 or bf16 operands: dsv4_wgmma_f16_n8 ... dsv4_wgmma_bf16_n64, each shape's operand
 * list written once (DSV4_WGMMA_FORMS) for both types. The accumulator layout is mma.sync's per 8
 * columns: d[4j..4j+3] = (g, 8j+2t), (g, 8j+2t+1), (g+8, 8j+2t), (g+8, 8j+2t+1). */
#define DSV4_WGMMA_D4(o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3])
#define DSV4_WGMMA_AB "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
#define DSV4_WGMMA_OP(n, ty) "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32." ty "." ty " "
#define DSV4_WGMMA_FORMS(name, ty)                                                                              \
    static __device__ __forceinline__ void name##_n8(float (&d)[4], const uint32_t (&a)[4], uint64_t desc)      \
    {                                                                                                           \
        asm volatile(DSV4_WGMMA_OP(8, ty) "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"               \
                     : DSV4_WGMMA_D4(0)                                                                         \
                     : DSV4_WGMMA_AB);                                                                          \
    }                                                                                                           \
    static __device__ __forceinline__ void name##_n16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc)     \
    {                                                                                                           \
        asm volatile(DSV4_WGMMA_OP(16, ty) "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, "  \
                     "1, 0;\n"                                                                                  \
                     : DSV4_WGMMA_D4(0), DSV4_WGMMA_D4(4)                                                       \
                     : DSV4_WGMMA_AB);                                                                          \
    }                                                                                                           \
    static __device__ __forceinline__ void name##_n24(float (&d)[12], const uint32_t (&a)[4], uint64_t desc)    \
    {                                                                                                           \
        asm volatile(DSV4_WGMMA_OP(24, ty) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, "    \
                     "%14, %15}, %16, 1, 1, 1, 0;\n"                                                            \
                     : DSV4_WGMMA_D4(0), DSV4_WGMMA_D4(4), DSV4_WGMMA_D4(8)                                     \
                     : DSV4_WGMMA_AB);                                                                          \
    }                                                                                                           \
    static __device__ __forceinline__ void name##_n32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc)    \
    {                                                                                                           \
        asm volatile(DSV4_WGMMA_OP(32, ty) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, " \
                     "%15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"                                           \
                     : DSV4_WGMMA_D4(0), DSV4_WGMMA_D4(4), DSV4_WGMMA_D4(8), DSV4_WGMMA_D4(12)                  \
                     : DSV4_WGMMA_AB);                                                                          \
    }                                                                                                           \
    static __device__ __forceinline__ void name##_n48(float (&d)[24], const uint32_t (&a)[4], uint64_t desc)    \
    {                                                                                                           \
        asm volatile(DSV4_WGMMA_OP(48, ty) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, " \
                     "%15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, "                           \
                     "%27}, %28, 1, 1, 1, 0;\n"                                                                 \
                     : DSV4_WGMMA_D4(0), DSV4_WGMMA_D4(4), DSV4_WGMMA_D4(8), DSV4_WGMMA_D4(12),                 \
                       DSV4_WGMMA_D4(16), DSV4_WGMMA_D4(20)                                                     \
                     : DSV4_WGMMA_AB);                                                                          \
    }                                                                                                           \
    static __device__ __forceinline__ void name##_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc)    \
    {                                                                                                           \
        asm volatile(DSV4_WGMMA_OP(64, ty) "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, " \
                     "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "                        \
                     "%28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"                            \
                     : DSV4_WGMMA_D4(0), DSV4_WGMMA_D4(4), DSV4_WGMMA_D4(8), DSV4_WGMMA_D4(12),                 \
                       DSV4_WGMMA_D4(16), DSV4_WGMMA_D4(20), DSV4_WGMMA_D4(24), DSV4_WGMMA_D4(28)               \
                     : DSV4_WGMMA_AB);                                                                          \
    }
DSV4_WGMMA_FORMS(dsv4_wgmma_f16, "f16")
DSV4_WGMMA_FORMS(dsv4_wgmma_bf16, "bf16")
#undef DSV4_WGMMA_FORMS
#undef DSV4_WGMMA_OP
#undef DSV4_WGMMA_AB
#undef DSV4_WGMMA_D4

/* The form of N (8, 16, 24, 32, 48 or 64) columns, f16 (BF false) or bf16 (BF true) operands */
template <int N, bool BF>
static __device__ __forceinline__ void dsv4_wgmma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc)
{
    if constexpr (N == 8)
        BF ? dsv4_wgmma_bf16_n8(d, a, desc) : dsv4_wgmma_f16_n8(d, a, desc);
    else if constexpr (N == 16)
        BF ? dsv4_wgmma_bf16_n16(d, a, desc) : dsv4_wgmma_f16_n16(d, a, desc);
    else if constexpr (N == 24)
        BF ? dsv4_wgmma_bf16_n24(d, a, desc) : dsv4_wgmma_f16_n24(d, a, desc);
    else if constexpr (N == 32)
        BF ? dsv4_wgmma_bf16_n32(d, a, desc) : dsv4_wgmma_f16_n32(d, a, desc);
    else if constexpr (N == 48)
        BF ? dsv4_wgmma_bf16_n48(d, a, desc) : dsv4_wgmma_f16_n48(d, a, desc);
    else {
        static_assert(N == 64, "the wgmma forms: N 8, 16, 24, 32, 48 or 64");
        BF ? dsv4_wgmma_bf16_n64(d, a, desc) : dsv4_wgmma_f16_n64(d, a, desc);
    }
}

#endif

#endif
