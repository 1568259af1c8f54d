/* Attention for the decode step: interleaved RoPE, the KV entry codec of SPEC §5, the window-ring
 * store, and sparse MQA over window + compressed entries with per-head sinks, split over keys with a
 * log-sum-exp combine that also undoes RoPE on the output. The CPU twin is dsv4_cpu_attention
 * (engine/cpu_attention.c), checked through the whole decode step (tests/gpu/test_gpu_step.c).
 *
 * KV entry (one vector of head_dim values; keys and values are the same vectors):
 *   fp8 numerics: [nope e4m3][rope_dim bf16][ceil(nope/64) UE8M0][pad to 8 bytes] = 584 B at 512/64;
 *   exact numerics: head_dim f32. */
#include <cuda_bf16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/kv_entry.cuh"

#define ATT_TILE 16             /* keys per shared-memory tile */
#define ATT_HB 32               /* heads per block: their queries stay in shared memory */
#define ATT_THREADS 256
#define ATT_CHUNKS (ATT_THREADS / ATT_HB)           /* dim chunks per head in the value sum */
#define ATT_MAX_PER (DSV4_CUDA_MAX_HEAD_DIM / ATT_CHUNKS)
#define ATT_PAD 4               /* floats of padding per shared row (bank spread, float4 alignment) */

int dsv4_cuda_kv_entry_bytes(int hd, int rd, int kvf)
{
    if (kvf == DSV4_KV_F32)
        return hd * (int)sizeof(float);
    const int nope = hd - rd, nsc = (nope + KV_GROUP - 1) / KV_GROUP;
    return (nope + 2 * rd + nsc + 7) / 8 * 8;
}

static __device__ __forceinline__ void dsv4_rope_pair(float *a, float *b, float inv_freq, int pos, bool inverse)
{
    const float angle = inv_freq * (float)pos;
    float cs = cosf(angle), sn = sinf(angle);
    if (inverse)
        sn = -sn;
    const float x = *a, y = *b;
    *a = x * cs - y * sn;
    *b = y * cs + x * sn;
}

/* x [rows, heads, hd]: RoPE on the last rd values of each head at pos[row / rows_per_pos]. */
__global__ void rope_kernel(float *x, int rows, int heads, int hd, int rd, const int32_t *pos, int rows_per_pos,
                            const float *inv_freq, bool inverse)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = rd / 2;
    if (i >= (int64_t)rows * heads * half)
        return;
    const int p = (int)(i % half);
    const int64_t rh = i / half, row = rh / heads;
    float *v = x + rh * hd + (hd - rd) + 2 * p;
    dsv4_rope_pair(v, v + 1, inv_freq[p], pos[row / rows_per_pos], inverse);
}

int dsv4_cuda_rope(float *d_x, int rows, int heads, int hd, int rd, const int32_t *d_pos, int rows_per_pos,
                   const float *d_inv_freq, bool inverse, void *stream)
{
    const int threads = 256;
    const int64_t n = (int64_t)rows * heads * (rd / 2);
    if (rd % 2 || rd > hd || rd < 2)
        return dsv4_error_set(-EINVAL, "rope: rope dims %d must be even and within head dim %d", rd, hd);
    if (n == 0)
        return 0;
    rope_kernel<<<(unsigned)((n + threads - 1) / threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
        d_x, rows, heads, hd, rd, d_pos, rows_per_pos, d_inv_freq, inverse);
    DSV4_CUDA_LAUNCHED("rope");
    return 0;
}

/* One block per batch row: v [B, hd] -> ring entry pos % ring of the row's slot. */
__global__ void kv_store_kernel(const float *__restrict__ v, int hd, int rd, int kvf, int entry_bytes,
                                const int32_t *__restrict__ pos, const int32_t *__restrict__ slot, uint8_t *entries,
                                int64_t slot_stride, int ring)
{
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + hd;
    const int b = blockIdx.x;
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        v_s[d] = v[(int64_t)b * hd + d];
    __syncthreads();
    dsv4_entry_store(v_s, entries + slot[b] * slot_stride + (int64_t)(pos[b] % ring) * entry_bytes, hd, rd, kvf, sc_s);
}

int dsv4_cuda_kv_store(const float *d_v, int batch, int hd, int rd, int kvf, const int32_t *d_pos,
                       const int32_t *d_slot, uint8_t *d_ring, int64_t slot_stride, int ring, void *stream)
{
    const size_t smem = (size_t)(hd + hd / KV_GROUP + 1) * sizeof(float);
    if (batch < 1)
        return 0;
    kv_store_kernel<<<batch, 128, smem, static_cast<cudaStream_t>(stream)>>>(
        d_v, hd, rd, kvf, dsv4_cuda_kv_entry_bytes(hd, rd, kvf), d_pos, d_slot, d_ring, slot_stride, ring);
    DSV4_CUDA_LAUNCHED("kv_store");
    return 0;
}

/* grid (B, DSV4_CUDA_ATT_SPLITS, ceil(H / ATT_HB)): the keys of row b split in equal runs; each
 * block keeps its heads' queries in shared memory, streams its run of keys through a tile shared
 * by all those heads, and leaves (max, sum, unnormalized output) per head for the combine. */
__global__ void __launch_bounds__(ATT_THREADS)
attention_kernel(const struct dsv4_cuda_att_args a)
{
    extern __shared__ float sm[];
    const int hd = a.hd, row = hd + ATT_PAD;
    float *q_s = sm, *k_s = q_s + ATT_HB * row, *p_s = k_s + ATT_TILE * row;
    float *m_s = p_s + ATT_HB * ATT_TILE, *l_s = m_s + ATT_HB, *a_s = l_s + ATT_HB;
    const int b = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * ATT_HB, tid = threadIdx.x;
    const int pos = a.pos[b];
    const int64_t slot = a.slot[b];
    const int nw = min(pos + 1, a.window), first = pos - nw + 1;
    const int nc = a.ratio ? (a.sel ? a.nsel[b] : (pos + 1) / a.ratio) : 0;
    const int nk = nw + nc, per = (nk + gridDim.y - 1) / gridDim.y;
    const int k0 = split * per, k1 = min(nk, k0 + per);
    const int per_d = hd / ATT_CHUNKS, hh = tid / ATT_CHUNKS, dc = tid % ATT_CHUNKS;
    float acc[ATT_MAX_PER];

    for (int i = tid; i < ATT_HB * hd; i += ATT_THREADS) {
        const int h = i / hd, d = i % hd;
        q_s[h * row + d] = h0 + h < a.H ? a.q[((int64_t)b * a.H + h0 + h) * hd + d] : 0.0f;
    }
    if (tid < ATT_HB) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < ATT_MAX_PER; i++)
        acc[i] = 0.0f;
    __syncthreads();

    for (int t0 = k0; t0 < k1; t0 += ATT_TILE) {
        const int nt = min(ATT_TILE, k1 - t0);
        for (int i = tid; i < nt * hd; i += ATT_THREADS) {
            const int j = i / hd, d = i % hd, kidx = t0 + j;
            const uint8_t *e;
            if (kidx < nw)
                e = a.win + slot * a.win_slot_stride + (int64_t)((first + kidx) % a.ring) * a.entry_bytes;
            else
                e = a.comp + slot * a.comp_slot_stride +
                    (int64_t)(a.sel ? a.sel[(int64_t)b * a.sel_stride + kidx - nw] : kidx - nw) * a.entry_bytes;
            k_s[j * row + d] = dsv4_entry_load(e, d, hd, a.rd, a.kvf);
        }
        __syncthreads();
        for (int p = tid; p < ATT_HB * ATT_TILE; p += ATT_THREADS) {
            const int h = p / ATT_TILE, j = p % ATT_TILE;
            float s = -INFINITY;
            if (j < nt && h0 + h < a.H) {
                const float4 *qv = reinterpret_cast<const float4 *>(q_s + h * row);
                const float4 *kv = reinterpret_cast<const float4 *>(k_s + j * row);
                float dot = 0.0f;
                for (int d = 0; d < hd / 4; d++) {
                    const float4 x = qv[d], y = kv[d];
                    dot += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
                }
                s = dot * a.scale;
            }
            p_s[h * ATT_TILE + j] = s;
        }
        __syncthreads();
        if (tid < ATT_HB) {
            float mx = m_s[tid];
            for (int j = 0; j < ATT_TILE; j++)
                mx = fmaxf(mx, p_s[tid * ATT_TILE + j]);
            float alpha = 1.0f, sum = 0.0f;
            if (mx != -INFINITY) {
                alpha = expf(m_s[tid] - mx);
                for (int j = 0; j < ATT_TILE; j++) {
                    const float e = expf(p_s[tid * ATT_TILE + j] - mx);
                    p_s[tid * ATT_TILE + j] = e;
                    sum += e;
                }
            } else {
                for (int j = 0; j < ATT_TILE; j++)
                    p_s[tid * ATT_TILE + j] = 0.0f;
            }
            l_s[tid] = l_s[tid] * alpha + sum;
            m_s[tid] = mx;
            a_s[tid] = alpha;
        }
        __syncthreads();
        const float alpha = a_s[hh];
#pragma unroll
        for (int i = 0; i < ATT_MAX_PER; i++) {
            if (i < per_d) {
                const int d = dc * per_d + i;
                float v = acc[i] * alpha;
                for (int j = 0; j < nt; j++)
                    v += p_s[hh * ATT_TILE + j] * k_s[j * row + d];
                acc[i] = v;
            }
        }
        __syncthreads();
    }

    if (h0 + hh < a.H) {
        float *out = a.part + (((int64_t)b * gridDim.y + split) * a.H + h0 + hh) * (hd + 2);
#pragma unroll
        for (int i = 0; i < ATT_MAX_PER; i++)
            if (i < per_d)
                out[dc * per_d + i] = acc[i];
        if (dc == 0) {
            out[hd] = m_s[hh];
            out[hd + 1] = l_s[hh];
        }
    }
}

/* grid (B, H): o_h = sum_s acc_s e^(m_s - M) / (e^(sink - M) + sum_s l_s e^(m_s - M)), then RoPE^-1
 * on its last rd values at the row's position. */
__global__ void attention_combine_kernel(const float *__restrict__ part, int splits, int H, int hd, int rd,
                                         const float *__restrict__ sink, const int32_t *__restrict__ pos,
                                         const float *__restrict__ inv_freq, float *__restrict__ o)
{
    extern __shared__ float o_s[];
    const int b = blockIdx.x, h = blockIdx.y;
    const float *p0 = part + ((int64_t)b * splits * H + h) * (hd + 2);
    const int64_t sstride = (int64_t)H * (hd + 2);
    float M = sink[h], L;

    for (int s = 0; s < splits; s++)
        M = fmaxf(M, p0[s * sstride + hd]);
    L = expf(sink[h] - M);
    for (int s = 0; s < splits; s++) {
        const float ms = p0[s * sstride + hd];
        if (ms != -INFINITY)
            L += p0[s * sstride + hd + 1] * expf(ms - M);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float ms = p0[s * sstride + hd];
            if (ms != -INFINITY)
                v += p0[s * sstride + d] * expf(ms - M);
        }
        o_s[d] = v / L;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rd / 2; i += blockDim.x)
        dsv4_rope_pair(&o_s[hd - rd + 2 * i], &o_s[hd - rd + 2 * i + 1], inv_freq[i], pos[b], true);
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        o[((int64_t)b * H + h) * hd + d] = o_s[d];
}

size_t dsv4_cuda_attention_smem(int hd)
{
    return (size_t)((ATT_HB + ATT_TILE) * (hd + ATT_PAD) + ATT_HB * ATT_TILE + 3 * ATT_HB) * sizeof(float);
}

int dsv4_cuda_attention_prepare(int hd)
{
    if (hd % (4 * ATT_CHUNKS) || hd > DSV4_CUDA_MAX_HEAD_DIM)
        return dsv4_error_set(-EINVAL, "attention: head_dim %d must be a multiple of %d and at most %d", hd,
                              4 * ATT_CHUNKS, DSV4_CUDA_MAX_HEAD_DIM);
    DSV4_CUDA_TRY(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)dsv4_cuda_attention_smem(hd)));
    return 0;
}

int dsv4_cuda_attention(const struct dsv4_cuda_att_args *a, int batch, const float *d_sink,
                        const float *d_inv_freq, float *d_o, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (batch < 1)
        return 0;
    attention_kernel<<<dim3(batch, DSV4_CUDA_ATT_SPLITS, (a->H + ATT_HB - 1) / ATT_HB), ATT_THREADS,
                       dsv4_cuda_attention_smem(a->hd), s>>>(*a);
    DSV4_CUDA_LAUNCHED("attention");
    attention_combine_kernel<<<dim3(batch, a->H), 128, a->hd * sizeof(float), s>>>(
        a->part, DSV4_CUDA_ATT_SPLITS, a->H, a->hd, a->rd, d_sink, a->pos, d_inv_freq, d_o);
    DSV4_CUDA_LAUNCHED("attention_combine");
    return 0;
}

/* One block per row: encode into a scratch entry in shared memory, decode back. */
__global__ void kv_entry_roundtrip_kernel(const float *x, int hd, int rd, int kvf, int eb, float *y)
{
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + hd;
    uint8_t *e = reinterpret_cast<uint8_t *>(sc_s + hd / KV_GROUP + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        v_s[d] = x[(int64_t)blockIdx.x * hd + d];
    __syncthreads();
    dsv4_entry_store(v_s, e, hd, rd, kvf, sc_s);
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        y[(int64_t)blockIdx.x * hd + d] = dsv4_entry_load(e, d, hd, rd, kvf);
}

extern "C" int dsv4_cuda_kv_entry_roundtrip(const float *d_x, int rows, int hd, int rd, int kv_format, float *d_y,
                                            void *stream)
{
    const int eb = dsv4_cuda_kv_entry_bytes(hd, rd, kv_format);
    const size_t smem = (size_t)(hd + hd / KV_GROUP + 2) * sizeof(float) + (size_t)eb + 16;
    if (kv_format < DSV4_KV_F32 || kv_format > DSV4_KV_FP8 || rd > hd || rd % 2)
        return dsv4_error_set(-EINVAL, "kv entry: format %d, rope %d of head %d", kv_format, rd, hd);
    if (rows < 1)
        return 0;
    kv_entry_roundtrip_kernel<<<rows, 128, smem, static_cast<cudaStream_t>(stream)>>>(d_x, hd, rd, kv_format, eb, d_y);
    DSV4_CUDA_LAUNCHED("kv_entry_roundtrip");
    return 0;
}
