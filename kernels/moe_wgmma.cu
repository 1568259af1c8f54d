/* SPDX-License-Identifier: MIT */
/* Routed experts of a prefill chunk on warpgroup MMAs, the sm_90a image only (every other image, and
 * DSV4_CUDA_MOE_WGMMA=0, keeps moe.cu's 8-warp mma.sync kernels; decode steps keep the one-tile
 * kernels everywhere).
 *
 * Why: a 1024-row chunk of V4-Flash gives each of 256 experts ~24 tokens. On mma.sync a warp's
 * k-tile is 8 FP4 words decoded into A fragments, then 4 x NT m16n8k16 MMAs each behind a 16-byte
 * fragment load of activations from shared memory: at 32 tokens 48 of the ~170 instructions, and the
 * tensor pipe at mma.sync's rate. Here a warpgroup issues 8 m64nNk16 wgmmas a k-tile that read the
 * activations from shared memory themselves, and N takes 8, 16, 24, 32, 48 or 64 columns (a pass of
 * 20 tokens computes 24 columns, not 32).
 *
 * Same bits as moe.cu's kernels, by construction (test_gpu_moe's prefill chunk: every row against the
 * same row in a decode-sized run, which takes the one-tile mma.sync kernels):
 *   - a CTA of 8 warps owns the same 128 weight rows (tc_row, the 8-warp prefill tiles), warp w the
 *     same 16 (w = 4 x warpgroup + warp in it; a wgmma's A rows of a warp are mma.sync's m16 rows);
 *   - each thread decodes the same 16 weight bytes of its two rows a k-tile with the same decoder
 *     (fp4x8_bf16, and the second multiply where a scale of the tile exceeds 2), into the same A
 *     fragments, and feeds them to the 8 k16 steps in the same order;
 *   - the activations are stored in the wgmma order (moe_store_operand), so every k-slot of a step
 *     meets the value the mma.sync step feeds it;
 *   - the accumulators chain every step of the whole K from zero, as mma.sync's do, and wgmma bf16
 *     with A from registers rounds each k16 step as m16n8k16 does on the H200 (gemm_wgmma.cu found
 *     it for f16 and bf16); the SwiGLU and the stores are moe.cu's.
 *
 * Layout: grid and rows as moe.cu's prefill kernels (gate_up: 64 rows of I of w1 and w3, down: 128
 * rows of D; a group of tokens in passes of up to 64). A stage holds the pass's activations (two
 * 64-value halves of N token rows, 128 bytes a row, in the 128-byte swizzle a K-major wgmma operand
 * wants: chunk c of row r at c ^ (r % 8)), then the 128 rows' weights (64 bytes each, as moe.cu lays
 * them out) and scale bytes. cp.async fills a ring of up to 8 stages (108 KB: two CTAs an SM); each
 * warp waits for its warpgroup's wgmmas before the barrier that lets the slot they read be refilled,
 * so the tensor work of one k-tile overlaps the wait for the next.
 *
 * Measured (H200, a 1024-row chunk of the 4-layer Flash, ncu): gate_up 4.59 -> 4.11 ms, down 2.37 ->
 * 2.07 for the chunk's 4 launches each against the mma.sync kernels. The kernel is bound by issue
 * (SM throughput 63%, DRAM 37%): the FP4 decode, 13 operations a word of 8 weights, is most of a
 * warp's instructions now. ptxas serializes the wgmmas here ("insufficient register resources"):
 * one kernel holding the six pass shapes needs ~205 registers for unserialized wgmmas (any single
 * shape alone needs 89-121), and one CTA an SM at that size ran 6% slower than two serialized. */
#include <cuda_bf16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/mma.cuh"
#include "kernels/moe_tile.cuh"
#include "kernels/wgmma.cuh"

#define MW_WARPS 8
#define MW_THREADS (MW_WARPS * DSV4_CUDA_WARP)
#define MW_ROWS (MW_WARPS * 16)                 /* weight rows a CTA: tc_rows(8) */
#define MW_WBYTES (MW_ROWS * MOE_TC_WROW)       /* a stage's weights: 8 KB */
#define MW_SBYTES (MW_ROWS * 4)                 /* and their scale bytes */
#define MW_ALIGN 1024                           /* the 128-byte swizzle repeats every 8 rows of 128 bytes */
#define MW_RING_BYTES (108 * 1024)              /* two CTAs an SM with their pass tables */
#define MW_MAX_STAGES 8

/* one 64-value half of an activation k-tile of n token rows */
static __host__ __device__ constexpr int mw_half(int n)
{
    return n * 128;
}

static __host__ __device__ constexpr int mw_stage_bytes(int n)
{
    return (2 * mw_half(n) + MW_WBYTES + MW_SBYTES + MW_ALIGN - 1) / MW_ALIGN * MW_ALIGN;
}

static __host__ __device__ constexpr int mw_stages(int n)
{
    return MW_RING_BYTES / mw_stage_bytes(n) < MW_MAX_STAGES ? MW_RING_BYTES / mw_stage_bytes(n) : MW_MAX_STAGES;
}

/* dynamic shared memory: the ring and the slack that puts it on MW_ALIGN */
static __host__ __device__ constexpr int mw_smem_bytes(void)
{
    return MW_RING_BYTES + MW_ALIGN;
}

static_assert(mw_stages(64) >= 4 && mw_stages(32) >= 6, "the rings' depths");
static_assert(tc_rows(MW_WARPS) == MW_ROWS, "a CTA's rows are moe.cu's prefill tile");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* One pass of N columns (n <= N tokens of the group: rows rowoff[] of the activations, outputs to pairs
 * pid[]) over every k-tile. */
template <int MODE, int N, bool TILED>
static __device__ __forceinline__ void mw_pass(const moe_tc_args &a, const struct dsv4_cuda_expert *ex, int n,
                                               uint8_t *ring, const int64_t *rowoff, const int32_t *pid)
{
    constexpr int STAGES = mw_stages(N), SB = mw_stage_bytes(N), WOFF = 2 * mw_half(N), SOFF = WOFF + MW_WBYTES;
    const int tid = threadIdx.x, warp = tid / DSV4_CUDA_WARP, lane = tid % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3, tile = blockIdx.x, nk = a.nk;
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const tc_wsrc wsrc = tc_weight_src<MODE, MW_WARPS, TILED>(ex, tile, nk);     /* moe.cu's weight tile */
    float acc[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; j++)
        acc[j] = 0.0f;

    /* stage s <- k-tile kt: the n token rows (16 chunks each, into their half and swizzled slot; rows
     * n .. N - 1 keep stale bytes, which reach only MMA columns that are never stored), the weights,
     * the scales */
    auto load = [&](int s, int kt) {
        uint8_t *st = ring + s * SB;
#pragma unroll
        for (int q = 0; q < (N * 16 + MW_THREADS - 1) / MW_THREADS; q++) {
            const int i = tid + q * MW_THREADS, r = i >> 4, c = i & 15;
            if (r < n)
                dsv4_cp_async16(st + (c >> 3) * mw_half(N) + r * 128 + (((c & 7) ^ (r & 7)) << 4),
                                a.xa + rowoff[r] + (int64_t)kt * MOE_TC_XROW + c * 16);
        }
        tc_load_weights<MW_WARPS>(wsrc, st + WOFF, st + SOFF, kt);
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk)
            load(s, s);
        dsv4_cp_async_commit();
    }
    int rs = 0, ls = STAGES - 1;    /* stages read and loaded this iteration */
#pragma unroll 1
    for (int kt = 0; kt < nk; kt++) {
        dsv4_cp_async_wait<STAGES - 2>();
        dsv4_wgmma_wait<0>();       /* the previous k-tile's wgmmas, which read slot ls */
        __syncthreads();
        if (kt + STAGES - 1 < nk)
            load(ls, kt + STAGES - 1);
        dsv4_cp_async_commit();
        const uint8_t *st = ring + rs * SB;
        const uint64_t xdesc = dsv4_wgmma_desc_sw128(st);
        const uint4 w0 = dsv4_lds128(st + WOFF + r0 * MOE_TC_WROW + t * 16);
        const uint4 w1 = dsv4_lds128(st + WOFF + r1 * MOE_TC_WROW + t * 16);
        const uint32_t s0 = st[SOFF + r0 * 4 + t], s1 = st[SOFF + r1 * 4 + t];
        const uint32_t w0v[4] = { w0.x, w0.y, w0.z, w0.w }, w1v[4] = { w1.x, w1.y, w1.z, w1.w };
        /* warp-uniform, as moe.cu's: one lane's large scale sends the warp through the second multiply */
        const bool big = __any_sync(0xffffffffu, s0 > 128u || s1 > 128u);
        /* word i: steps 2i and 2i + 1, committed as a group; its A fragments in af[i & 1], written once
         * the group two words back (the last reader of those registers) has completed */
        uint32_t af[2][2][4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t p0[4], p1[4];
            tc_decode_rows<TILED>(w0v[i], w1v[i], s0, s1, big, p0, p1);
            if (i >= 2)
                dsv4_wgmma_wait<1>();
            uint32_t (&fa)[2][4] = af[i & 1];
            /* rows g (p0) and g + 8 (p1), k-slots (2t, 2t+1) then (2t+8, 2t+9) */
            fa[0][0] = p0[0];
            fa[0][1] = p1[0];
            fa[0][2] = p0[1];
            fa[0][3] = p1[1];
            fa[1][0] = p0[2];
            fa[1][1] = p1[2];
            fa[1][2] = p0[3];
            fa[1][3] = p1[3];
            dsv4_wgmma_fence();
            /* steps 0-3 in the first 64-value half, 4-7 in the second */
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const int step = 2 * i + m;
                dsv4_wgmma<N, true>(acc, fa[m], dsv4_wgmma_desc_at(xdesc, (step >> 2) * mw_half(N) + (step & 3) * 32));
            }
            dsv4_wgmma_commit();
        }
        rs = rs + 1 == STAGES ? 0 : rs + 1;
        ls = ls + 1 == STAGES ? 0 : ls + 1;
    }
    dsv4_wgmma_wait<0>();
    dsv4_cp_async_wait<0>();
#pragma unroll
    for (int j = 0; j < N / 2; j++)
        dsv4_wgmma_pin(acc[j]);

    /* acc[4j ..]: (row g, token 8j + 2t), (g, 8j + 2t + 1), (g + 8, 8j + 2t), (g + 8, 8j + 2t + 1) */
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int nn = j * 8 + 2 * t + h;
            if (nn >= n)
                continue;
            float *y = a.y + (int64_t)pid[nn] * a.ldy;
            if (MODE == MOE_UP) {
                y[(int64_t)tile * tc_up_rows(MW_WARPS) + warp * 8 + g] = swiglu(acc[4 * j + h], acc[4 * j + 2 + h], a.limit);
            } else {
                y[(int64_t)tile * MW_ROWS + r0] = acc[4 * j + h];
                y[(int64_t)tile * MW_ROWS + r1] = acc[4 * j + 2 + h];
            }
        }
}
#endif

/* grid (I / tc_up_rows(8) or D / tc_rows(8), min(pairs, E)), MW_THREADS threads, mw_smem_bytes of
 * dynamic shared memory: moe.cu's prefill launch with a wgmma pass of the narrowest N that holds
 * each pass's tokens. */
template <int MODE, bool TILED>
__global__ void __launch_bounds__(MW_THREADS, 2) moe_wgmma_kernel(const moe_tc_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *ring = smem + ((MW_ALIGN - (dsv4_smem_addr(smem) & (MW_ALIGN - 1))) & (MW_ALIGN - 1));
    __shared__ int64_t rowoff[MOE_TC_PASS];
    __shared__ int32_t pid[MOE_TC_PASS];
    const int gi = blockIdx.y;

    dsv4_pdl_enter();
    if (gi >= a.groups[0])
        return;
    const struct dsv4_cuda_expert *ex = &a.table[a.groups[1 + gi]];
    const int32_t *list = a.groups + 2 + 2 * a.pairs;
    const int beg = a.groups[1 + a.pairs + gi], end = a.groups[2 + a.pairs + gi];

    for (int p0 = beg; p0 < end; p0 += MOE_TC_PASS) {
        const int n = min(MOE_TC_PASS, end - p0);
        __syncthreads();        /* the previous pass is done with the tables and the ring */
        if (threadIdx.x < n) {
            const int p = list[p0 + threadIdx.x];
            pid[threadIdx.x] = p;
            rowoff[threadIdx.x] = (int64_t)(MODE == MOE_UP ? p / a.topk : p) * a.lda;
        }
        __syncthreads();
        if (n <= 8)
            mw_pass<MODE, 8, TILED>(a, ex, n, ring, rowoff, pid);
        else if (n <= 16)
            mw_pass<MODE, 16, TILED>(a, ex, n, ring, rowoff, pid);
        else if (n <= 24)
            mw_pass<MODE, 24, TILED>(a, ex, n, ring, rowoff, pid);
        else if (n <= 32)
            mw_pass<MODE, 32, TILED>(a, ex, n, ring, rowoff, pid);
        else if (n <= 48)
            mw_pass<MODE, 48, TILED>(a, ex, n, ring, rowoff, pid);
        else
            mw_pass<MODE, 64, TILED>(a, ex, n, ring, rowoff, pid);
    }
#else
    __trap();   /* launched only where moe_wgmma_prepare found the sm_90a image */
#endif
}

typedef void (*mw_kernel_fn)(const moe_tc_args);

static mw_kernel_fn mw_kernel(int mode, bool tiled)
{
    return mode == MOE_UP ? (tiled ? moe_wgmma_kernel<MOE_UP, true> : moe_wgmma_kernel<MOE_UP, false>)
                          : (tiled ? moe_wgmma_kernel<MOE_DOWN, true> : moe_wgmma_kernel<MOE_DOWN, false>);
}

int moe_wgmma_prepare(int smem_optin, const char **why_not)
{
    cudaFuncAttributes fa;
    DSV4_CUDA_TRY(cudaFuncGetAttributes(&fa, mw_kernel(MOE_UP, true)));
    if (fa.binaryVersion != 90 || fa.ptxVersion < 90) {
        *why_not = "not the sm_90a image";      /* the JIT-compiled PTX, or another GPU's cubin */
        return 0;
    }
    if (smem_optin < mw_smem_bytes() + (int)fa.sharedSizeBytes) {
        *why_not = "too little shared memory a block";
        return 0;
    }
    for (int mode = MOE_UP; mode <= MOE_DOWN; mode++)
        for (int tiled = 0; tiled < 2; tiled++)
            DSV4_CUDA_TRY(cudaFuncSetAttribute(mw_kernel(mode, tiled), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               mw_smem_bytes()));
    *why_not = nullptr;
    return 0;
}

void moe_wgmma_launch(int mode, bool tiled, dim3 grid, const moe_tc_args &a, cudaStream_t s)
{
    dsv4_launch(mw_kernel(mode, tiled), grid, MW_THREADS, (size_t)mw_smem_bytes(), s, a);
}
