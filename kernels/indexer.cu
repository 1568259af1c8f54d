/* SPDX-License-Identifier: MIT */
/* The lightning indexer's scores and top-k selection (doc/MODEL.md §3.6): for each row, over the complete
 * compressed entries n = (pos+1)/ratio of its slot (the sequence's actual length),
 *   score_s = sum_h ReLU(q_h . k_s) dI^-0.5 (w_h nI^-0.5),
 * then the topk largest (ties: lower index) in ascending order. Rows with n <= topk take every entry
 * and skip the scores. Twin: dsv4_cpu_indexer_select (engine/cpu/cpu_indexer.c), checked through the
 * whole decode step (tests/gpu/test_gpu_step.c); the key codec in tests/gpu/test_gpu_codec.c.
 *
 * Score variants, chosen per layer shape and numerics (each counted):
 *   mma  fp8 numerics (keys stored in the official FP4 layout, kernels/index_key.cuh; queries FP4
 *        rounded after the Hadamard rotation): both operands are exact in bf16, so a bf16 MMA with
 *        f32 accumulation gives exact products and f32 sums. M = heads (padded to 16), N = 8 entries,
 *        K = dI in {32, 64, 128}. Each thread decodes one quarter of one entry's key per n8 tile, so
 *        an entry's bytes are read once for all heads.
 *   fma  one thread per entry, f32 FMA over heads and dims: exact numerics (f32 keys) and FP4 keys
 *        of other widths. */
#include <cuda_bf16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/index_key.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/mma.cuh"

#define IDX_FMA_THREADS 256
#define IDX_MMA_WARPS 8
#define IDX_MMA_TILES 16            /* n8 tiles of entries per warp */
#define IDX_MMA_ENTRIES (IDX_MMA_WARPS * IDX_MMA_TILES * 8)   /* entries per CTA */
#define IDX_MMA_MAX_HEADS 128
#define IDX_QPAD 4                  /* bf16 of padding per query row in shared memory */

int dsv4_cuda_index_key_bytes(int dI, bool packed)
{
    return packed ? dsv4_index_key_bytes(dI) : dI * (int)sizeof(float);
}

static bool mma_shape(const struct dsv4_cuda_index_args *a)
{
    return a->packed && (a->dI == 32 || a->dI == 64 || a->dI == 128) && a->nI <= IDX_MMA_MAX_HEADS;
}

template <bool PACKED>
static __device__ __forceinline__ float key_value(const uint8_t *key, int i, int dI)
{
    if constexpr (PACKED)
        return dsv4_index_key_load(key, i, dI);
    else
        return reinterpret_cast<const float *>(key)[i];
}

/* grid (B, ceil(max_entries / IDX_FMA_THREADS)): one thread per entry; the row's queries in shared
 * memory. */
template <bool PACKED>
__global__ void indexer_scores_fma_kernel(const struct dsv4_cuda_index_args a)
{
    dsv4_pdl_enter();
    extern __shared__ float q_s[];
    const int b = blockIdx.x, n = (a.pos[b] + 1) / a.ratio;
    const int s = blockIdx.y * blockDim.x + threadIdx.x;
    if (n <= a.topk || blockIdx.y * blockDim.x >= n)
        return;
    for (int i = threadIdx.x; i < a.nI * a.dI; i += blockDim.x)
        q_s[i] = a.q[(int64_t)b * a.nI * a.dI + i];
    __syncthreads();
    if (s >= n)
        return;
    const int kb = PACKED ? dsv4_index_key_bytes(a.dI) : a.dI * (int)sizeof(float);
    const uint8_t *k = a.keys + a.slot[b] * a.keys_slot_stride + (int64_t)s * kb;
    const float qscale = 1.0f / sqrtf((float)a.dI), wscale = 1.0f / sqrtf((float)a.nI);
    float score = 0.0f;
    for (int h = 0; h < a.nI; h++) {
        float dot = 0.0f;
        for (int i = 0; i < a.dI; i++)
            dot += q_s[h * a.dI + i] * key_value<PACKED>(k, i, a.dI);
        score += (dot > 0.0f ? dot : 0.0f) * qscale * (a.w[(int64_t)b * a.nI + h] * wscale);
    }
    a.scores[(int64_t)b * a.max_entries + s] = score;
}

/* grid (B, ceil(max_entries / IDX_MMA_ENTRIES)), IDX_MMA_WARPS warps. Thread (g = lane/4, t = lane%4)
 * of a warp decodes values [t dI/4, (t+1) dI/4) of entry g of each n8 tile (one FP4 scale: dI/4 <= 32
 * values never straddle a group) and feeds them as the B fragment's k indices of dI/16 MMAs; the
 * query fragments use the same permutation of k. Accumulator (head g or g+8, entry 2t or 2t+1) goes
 * through ReLU and the head weight, and the 8 lanes of one t add their heads in a fixed tree. */
template <int DI>
__global__ void __launch_bounds__(IDX_MMA_WARPS * DSV4_CUDA_WARP) indexer_scores_mma_kernel(const struct dsv4_cuda_index_args a)
{
    dsv4_pdl_enter();
    extern __shared__ __align__(16) uint8_t smem[];
    constexpr int KS = DI / 16, PER = DI / 4, ROW = DI + IDX_QPAD;
    const int b = blockIdx.x, n = (a.pos[b] + 1) / a.ratio, e0 = blockIdx.y * IDX_MMA_ENTRIES;
    if (n <= a.topk || e0 >= n)
        return;
    const int MT = (a.nI + 15) / 16, warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int g = lane >> 2, t = lane & 3;
    __nv_bfloat16 *q_s = reinterpret_cast<__nv_bfloat16 *>(smem);
    float *w_s = reinterpret_cast<float *>(smem + (size_t)MT * 16 * ROW * 2);
    const float qscale = 1.0f / sqrtf((float)DI), wscale = 1.0f / sqrtf((float)a.nI);

    for (int i = threadIdx.x; i < MT * 16 * DI; i += blockDim.x) {
        const int h = i / DI, d = i % DI;
        q_s[h * ROW + d] = __float2bfloat16_rn(h < a.nI ? a.q[((int64_t)b * a.nI + h) * DI + d] : 0.0f);
    }
    for (int h = threadIdx.x; h < MT * 16; h += blockDim.x)
        w_s[h] = h < a.nI ? a.w[(int64_t)b * a.nI + h] * wscale : 0.0f;
    __syncthreads();

    const int kb = dsv4_index_key_bytes(DI);
    const uint8_t *keys = a.keys + a.slot[b] * a.keys_slot_stride;
    for (int j = 0; j < IDX_MMA_TILES; j++) {
        const int tile = e0 + (j * IDX_MMA_WARPS + warp) * 8;
        if (tile >= n)
            break;
        /* this thread's quarter of entry tile + g, as bf16 pairs: PER values, PER / 2 registers */
        const uint8_t *key = keys + (int64_t)min(tile + g, n - 1) * kb;
        const float sc = dsv4_ue8m0(key[DI / 2 + t * PER / DSV4_INDEX_KEY_GROUP]);
        uint32_t kf[PER / 2];
#pragma unroll
        for (int i = 0; i < PER / 2; i++) {
            const uint32_t byte = key[t * PER / 2 + i];
            kf[i] = dsv4_bf16x2(dsv4_e2m1(byte) * sc, dsv4_e2m1(byte >> 4) * sc);
        }
        float part[2] = { 0.0f, 0.0f };
        for (int mt = 0; mt < MT; mt++) {
            float d[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
            const __nv_bfloat16 *q0 = q_s + (mt * 16 + g) * ROW + t * PER, *q1 = q0 + 8 * ROW;
#pragma unroll
            for (int s = 0; s < KS; s++) {
                const uint2 x0 = *reinterpret_cast<const uint2 *>(q0 + 4 * s);
                const uint2 x1 = *reinterpret_cast<const uint2 *>(q1 + 4 * s);
                const uint32_t qa[4] = { x0.x, x1.x, x0.y, x1.y };
                dsv4_mma_bf16(d, qa, kf[2 * s], kf[2 * s + 1]);
            }
            const float w0 = w_s[mt * 16 + g], w1 = w_s[mt * 16 + g + 8];
            part[0] += fmaxf(d[0], 0.0f) * qscale * w0 + fmaxf(d[2], 0.0f) * qscale * w1;
            part[1] += fmaxf(d[1], 0.0f) * qscale * w0 + fmaxf(d[3], 0.0f) * qscale * w1;
        }
#pragma unroll
        for (int o = 4; o < DSV4_CUDA_WARP; o <<= 1) {
            part[0] += __shfl_xor_sync(0xffffffffu, part[0], o);
            part[1] += __shfl_xor_sync(0xffffffffu, part[1], o);
        }
        if (g == 0)
#pragma unroll
            for (int c = 0; c < 2; c++)
                if (tile + 2 * t + c < n)
                    a.scores[(int64_t)b * a.max_entries + tile + 2 * t + c] = part[c];
    }
}

/* Order-preserving key of a float: larger float, larger key. -0 and +0 share a key, as the twin's
 * float comparisons make them a tie (broken by the lower index). The score sums start at +0, so
 * a -0 score should not arise; this keeps the two orders equal if one ever does. */
static __device__ __forceinline__ uint32_t fkey(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u << 1) == 0)
        u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Block-wide exclusive scan of one int per thread (DSV4_CUDA_TOPK_THREADS threads); returns the total. */
static __device__ int block_scan(int v, int *excl, int *buf)
{
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int off = 1; off < (int)blockDim.x; off *= 2) {
        const int t = threadIdx.x >= (unsigned)off ? buf[threadIdx.x - off] : 0;
        __syncthreads();
        buf[threadIdx.x] += t;
        __syncthreads();
    }
    *excl = buf[threadIdx.x] - v;
    const int total = buf[blockDim.x - 1];
    __syncthreads();
    return total;
}

/* One block per row: the topk largest scores (ties: lower index), written in ascending index
 * order. The threshold key is found bit by bit (32 counting passes over the row's n scores). */
__global__ void __launch_bounds__(DSV4_CUDA_TOPK_THREADS) indexer_topk_kernel(const struct dsv4_cuda_index_args a)
{
    dsv4_pdl_enter();
    __shared__ int buf[DSV4_CUDA_TOPK_THREADS];
    __shared__ int cnt;
    const int b = blockIdx.x, n = (a.pos[b] + 1) / a.ratio, k = a.topk, T = blockDim.x;
    const float *sc = a.scores + (int64_t)b * a.max_entries;
    int32_t *sel = a.sel + (int64_t)b * k;

    if (n <= k) {
        for (int i = threadIdx.x; i < n; i += T)
            sel[i] = i;
        if (threadIdx.x == 0)
            a.nsel[b] = n;
        return;
    }
    uint32_t thr = 0;
    for (int bit = 31; bit >= 0; bit--) {
        const uint32_t cand = thr | (1u << bit);
        int c = 0;
        for (int i = threadIdx.x; i < n; i += T)
            c += fkey(sc[i]) >= cand;
        if (threadIdx.x == 0)
            cnt = 0;
        __syncthreads();
        atomicAdd(&cnt, c);
        __syncthreads();
        if (cnt >= k)
            thr = cand;
        __syncthreads();
    }
    /* each thread owns a contiguous run of indices, so scans give ascending order */
    const int per = (n + T - 1) / T, beg = min(n, threadIdx.x * per), end = min(n, beg + per);
    int gt = 0, eq = 0, gt_total, eq_before, sel_before;
    for (int i = beg; i < end; i++) {
        const uint32_t key = fkey(sc[i]);
        gt += key > thr;
        eq += key == thr;
    }
    int dummy;
    gt_total = block_scan(gt, &dummy, buf);
    block_scan(eq, &eq_before, buf);
    const int need = k - gt_total;      /* ties taken, lowest indices first */
    int take = gt, e = eq_before;
    for (int i = beg; i < end; i++)
        if (fkey(sc[i]) == thr && e++ < need)
            take++;
    block_scan(take, &sel_before, buf);
    e = eq_before;
    for (int i = beg, o = sel_before; i < end; i++) {
        const uint32_t key = fkey(sc[i]);
        if (key > thr || (key == thr && e++ < need))
            sel[o++] = i;
    }
    if (threadIdx.x == 0)
        a.nsel[b] = k;
}

int dsv4_cuda_indexer(const struct dsv4_cuda_index_args *a, int batch, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (batch < 1)
        return 0;
    if (mma_shape(a)) {
        const int MT = (a->nI + 15) / 16;
        const size_t smem = (size_t)MT * 16 * (a->dI + IDX_QPAD) * 2 + (size_t)MT * 16 * sizeof(float);
        const dim3 grid(batch, (a->max_entries + IDX_MMA_ENTRIES - 1) / IDX_MMA_ENTRIES);
        dsv4_cuda_count_launch(DSV4_CUDA_V_INDEXER_MMA);
        if (a->dI == 32)
            dsv4_launch(indexer_scores_mma_kernel<32>, grid, IDX_MMA_WARPS * DSV4_CUDA_WARP, smem, s, *a);
        else if (a->dI == 64)
            dsv4_launch(indexer_scores_mma_kernel<64>, grid, IDX_MMA_WARPS * DSV4_CUDA_WARP, smem, s, *a);
        else
            dsv4_launch(indexer_scores_mma_kernel<128>, grid, IDX_MMA_WARPS * DSV4_CUDA_WARP, smem, s, *a);
        DSV4_CUDA_LAUNCHED("indexer_scores_mma");
    } else {
        const size_t qsmem = (size_t)a->nI * a->dI * sizeof(float);
        const dim3 grid(batch, (a->max_entries + IDX_FMA_THREADS - 1) / IDX_FMA_THREADS);
        if (qsmem > 48 * 1024)
            return dsv4_error_set(-EINVAL, "indexer: %d heads x %d dims exceed the 48 KiB query tile", a->nI, a->dI);
        dsv4_cuda_count_launch(DSV4_CUDA_V_INDEXER_FMA);
        if (a->packed)
            dsv4_launch(indexer_scores_fma_kernel<true>, grid, IDX_FMA_THREADS, qsmem, s, *a);
        else
            dsv4_launch(indexer_scores_fma_kernel<false>, grid, IDX_FMA_THREADS, qsmem, s, *a);
        DSV4_CUDA_LAUNCHED("indexer_scores_fma");
    }
    dsv4_launch(indexer_topk_kernel, batch, DSV4_CUDA_TOPK_THREADS, 0, s, *a);
    DSV4_CUDA_LAUNCHED("indexer_topk");
    return 0;
}

/* For C callers (tests/gpu/test_gpu_indexer.c; kernels_internal.h has C++ linkage). */
extern "C" int dsv4_cuda_indexer_once(const struct dsv4_cuda_index_args *a, int batch, void *stream)
{
    return dsv4_cuda_indexer(a, batch, stream);
}

/* ---- the indexer's queries: RoPE, then (fp8) the Hadamard rotation and FP4, as the keys ---- */

/* grid (B, nI), block 128: RoPE then (fp8) Hadamard + FP4 on one query head. */
__global__ void indexer_q_kernel(float *q, int nI, int dI, int rd, bool fp8, const int32_t *pos, const float *inv_freq)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + dI;
    float *qh = q + ((int64_t)blockIdx.x * nI + blockIdx.y) * dI;
    for (int i = threadIdx.x; i < dI; i += blockDim.x)
        v_s[i] = qh[i];
    __syncthreads();
    for (int i = threadIdx.x; i < rd / 2; i += blockDim.x)
        dsv4_rope_pair(&v_s[dI - rd + 2 * i], &v_s[dI - rd + 2 * i + 1], inv_freq[i], pos[blockIdx.x], false);
    __syncthreads();
    if (fp8)
        dsv4_hadamard_fp4(v_s, dI, sc_s);
    for (int i = threadIdx.x; i < dI; i += blockDim.x)
        qh[i] = v_s[i];
}

int dsv4_cuda_indexer_q(float *d_q, int batch, int nI, int dI, int rd, bool fp8, const int32_t *d_pos,
                        const float *d_inv_freq, void *stream)
{
    if (fp8 && (dI & (dI - 1)))
        return dsv4_error_set(-EINVAL, "indexer: head dim %d must be a power of two (Hadamard)", dI);
    if (batch < 1)
        return 0;
    dsv4_launch(indexer_q_kernel, dim3(batch, nI), 128, (size_t)(dI + dI / DSV4_INDEX_KEY_GROUP + 2) * sizeof(float),
                static_cast<cudaStream_t>(stream), d_q, nI, dI, rd, fp8, d_pos, d_inv_freq);
    DSV4_CUDA_LAUNCHED("indexer_q");
    return 0;
}

/* The Hadamard + FP4 rounding alone, through the stored key format: the codec's test entry. */
__global__ void hadamard_fp4_kernel(const float *x, int n, float *y)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + n;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        v_s[i] = x[(int64_t)blockIdx.x * n + i];
    __syncthreads();
    dsv4_hadamard_fp4(v_s, n, sc_s);
    /* through the stored key format, as the indexer reads it back */
    uint8_t *key = reinterpret_cast<uint8_t *>(sc_s + n / DSV4_INDEX_KEY_GROUP + 2);
    dsv4_index_key_store(v_s, sc_s, key, n);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        y[(int64_t)blockIdx.x * n + i] = dsv4_index_key_load(key, i, n);
}

extern "C" int dsv4_cuda_hadamard_fp4(const float *d_x, int rows, int n, float *d_y, void *stream)
{
    if (n < 2 || (n & (n - 1)))
        return dsv4_error_set(-EINVAL, "hadamard_fp4: n %d must be a power of two", n);
    if (rows < 1)
        return 0;
    dsv4_launch(hadamard_fp4_kernel, rows, 128,
                (size_t)(n + n / DSV4_INDEX_KEY_GROUP + 2) * sizeof(float) + dsv4_index_key_bytes(n) + 16,
                static_cast<cudaStream_t>(stream), d_x, n, d_y);
    DSV4_CUDA_LAUNCHED("hadamard_fp4");
    return 0;
}
