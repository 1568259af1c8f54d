/* SPDX-License-Identifier: MIT */
/* The compressors of CSA and HCA layers and of the indexer's keys: each step's rows update their
 * slot's partial state and, at a block's last position, emit the compressed entry (KV in the cache
 * layout, or the indexer's FP4 key). CPU twin: dsv4_cpu_compressor_push (engine/cpu/cpu_compressor.c),
 * checked through the whole decode step (tests/gpu/test_gpu_step.c). */
#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/index_key.cuh"
#include "kernels/kv_entry.cuh"
#include "kernels/norm_row.cuh"

#define COMP_THREADS NORM_THREADS     /* rmsnorm_row_scale's block */

/* Tokens a slot's state keeps: the block being filled and, for overlapping compressors, the one
 * before it (its first d channels pool into the next entry). */
static __host__ __device__ int comp_ring(int ratio, bool overlap)
{
    return overlap ? 2 * ratio : ratio;
}

int64_t dsv4_cuda_comp_state_floats(int ratio, int d, bool overlap)
{
    const int64_t width = overlap ? 2 * d : d;
    return 2 * (int64_t)comp_ring(ratio, overlap) * width;
}

/* Token q's projection (col of C) and score (col of Z + ape) for row b at position pos: from the
 * step's own rows when q is at or after the first position of the row's run in this step (rows of
 * one slot are consecutive and in position order), else from the slot's ring of earlier tokens. */
struct comp_src {
    const float *c, *z, *ape, *kv, *gate;
    int b, pos, first, ratio, width, ring;
};

static __device__ __forceinline__ float comp_value(const comp_src &s, int q, int col)
{
    return q >= s.first ? s.c[(int64_t)(s.b - (s.pos - q)) * s.width + col]
                        : s.kv[(int64_t)(q % s.ring) * s.width + col];
}

static __device__ __forceinline__ float comp_score(const comp_src &s, int q, int col)
{
    return q >= s.first ? s.z[(int64_t)(s.b - (s.pos - q)) * s.width + col] + s.ape[(int64_t)(q % s.ratio) * s.width + col]
                        : s.gate[(int64_t)(q % s.ring) * s.width + col];
}

/* One block per row; only rows that complete a block (pos % ratio == ratio - 1) work: entry
 * pos / ratio = softmax-pooled block (plus the previous block's first d channels when
 * overlapping), RMSNormed, RoPE'd at the block's first position, stored. */
__global__ void __launch_bounds__(COMP_THREADS) compressor_emit_kernel(const struct dsv4_cuda_comp_args a)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + a.d;
    const int b = blockIdx.x, d = a.d, r = a.ratio, width = a.overlap ? 2 * d : d;
    const int pos = a.pos[b];
    if (pos % r != r - 1)
        return;
    const float *st = a.state + a.slot[b] * a.state_slot_stride;
    const int L = comp_ring(r, a.overlap);
    const comp_src src = { a.c, a.z, a.ape, st, st + (int64_t)L * width, b, pos, a.first[b], r, width, L };
    const int own = a.overlap ? d : 0, q0 = pos - r + 1;
    const bool prev = a.overlap && pos / r >= 1;
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x) {
        float m = -INFINITY, den = 0.0f, num = 0.0f;
        if (prev)
            for (int j = 0; j < r; j++)
                m = fmaxf(m, comp_score(src, q0 - r + j, ch));
        for (int j = 0; j < r; j++)
            m = fmaxf(m, comp_score(src, q0 + j, own + ch));
        if (prev)
            for (int j = 0; j < r; j++) {
                const float e = expf(comp_score(src, q0 - r + j, ch) - m);
                den += e;
                num += e * comp_value(src, q0 - r + j, ch);
            }
        for (int j = 0; j < r; j++) {
            const float e = expf(comp_score(src, q0 + j, own + ch) - m);
            den += e;
            num += e * comp_value(src, q0 + j, own + ch);
        }
        v_s[ch] = num / den;
    }
    __syncthreads();
    const float rs = rmsnorm_row_scale(v_s, d, a.eps);
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x)
        v_s[ch] = a.norm[ch] * (v_s[ch] * rs);
    __syncthreads();
    for (int i = threadIdx.x; i < a.rd / 2; i += blockDim.x)
        dsv4_rope_pair(&v_s[d - a.rd + 2 * i], &v_s[d - a.rd + 2 * i + 1], a.inv_freq[i], q0, false);
    __syncthreads();
    uint8_t *dst = a.entries + a.slot[b] * a.entries_slot_stride + (int64_t)(pos / r) * a.entry_bytes;
    if (a.indexer && a.fp8) {
        dsv4_hadamard_fp4(v_s, d, sc_s);
        dsv4_index_key_store(v_s, sc_s, dst, d);
    } else if (a.indexer) {
        for (int ch = threadIdx.x; ch < d; ch += blockDim.x)
            reinterpret_cast<float *>(dst)[ch] = v_s[ch];
    } else {
        dsv4_entry_store(v_s, dst, d, a.rd, a.kvf, sc_s);
    }
}

/* After every emission of the step: rows among the last `ring` of their run leave their token in
 * the slot's ring (earlier rows of a long run would be overwritten anyway). */
__global__ void compressor_store_kernel(const struct dsv4_cuda_comp_args a)
{
    dsv4_pdl_enter();
    const int b = blockIdx.x, r = a.ratio, width = a.overlap ? 2 * a.d : a.d, L = comp_ring(r, a.overlap);
    const int pos = a.pos[b];
    if (pos <= a.last[b] - L)
        return;
    float *st = a.state + a.slot[b] * a.state_slot_stride;
    float *kv = st + (int64_t)(pos % L) * width, *gate = st + (int64_t)L * width + (int64_t)(pos % L) * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        kv[i] = a.c[(int64_t)b * width + i];
        gate[i] = a.z[(int64_t)b * width + i] + a.ape[(int64_t)(pos % r) * width + i];
    }
}

int dsv4_cuda_compressor(const struct dsv4_cuda_comp_args *a, int batch, void *stream)
{
    const size_t smem = (size_t)(a->d + a->d / 16 + 8) * sizeof(float);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a->indexer && (a->d & (a->d - 1)))
        return dsv4_error_set(-EINVAL, "compressor: indexer width %d must be a power of two (Hadamard)", a->d);
    if (batch < 1)
        return 0;
    dsv4_launch(compressor_emit_kernel, batch, COMP_THREADS, smem, s, *a);
    DSV4_CUDA_LAUNCHED("compressor_emit");
    dsv4_launch(compressor_store_kernel, batch, COMP_THREADS, 0, s, *a);
    DSV4_CUDA_LAUNCHED("compressor_store");
    return 0;
}
