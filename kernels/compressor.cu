/* Compressors (decode update and entry emission), the lightning indexer's query prep,
 * and the small pieces around the layers: embedding into the streams, hc_head. CPU twins:
 * dsv4_cpu_compressor_push, dsv4_cpu_indexer_select, dsv4_cpu_hc_head (engine/cpu_*.c), checked
 * through the whole decode step (tests/gpu/test_gpu_step.c). */
#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/index_key.cuh"
#include "kernels/kv_entry.cuh"

#define COMP_THREADS 256
#define FP4_GROUP 32            /* official indexer FP4 block */
#define E2M1_MAX 6.0f
#define E2M1_AMAX_FLOOR (6.0f * 0x1p-126f)    /* as engine/quant.c: amax/6 stays a normal float */


static __device__ float block_sum_256(float v, float *red)
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    v = dsv4_warp_sum(v);
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / DSV4_CUDA_WARP) ? red[lane] : 0.0f;
    return dsv4_warp_sum(v);
}

static __device__ __forceinline__ void rope_pair(float *a, float *b, float inv_freq, int pos)
{
    const float angle = inv_freq * (float)pos;
    const float cs = cosf(angle), sn = sinf(angle), x = *a, y = *b;
    *a = x * cs - y * sn;
    *b = y * cs + x * sn;
}

/* e2m1 round to nearest even on |a| <= 6 (grid 0.5 below 2, 1 below 4, then 2). */
static __device__ __forceinline__ float e2m1_round(float v)
{
    float a = fminf(fabsf(v), E2M1_MAX);
    a = a < 2.0f ? rintf(a * 2.0f) * 0.5f : a < 4.0f ? rintf(a) : 2.0f * rintf(a * 0.5f);
    return copysignf(a, v);
}

/* Shared x[n] (n a power of two): Hadamard (butterflies h = 1, 2, 4, ... as the CPU), scaled by
 * n^-1/2, then FP4 rounded in groups of 32 with UE8M0 scales. Block-cooperative. */
static __device__ void hadamard_fp4(float *x, int n, float *sc_s)
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
    const int ng = (n + FP4_GROUP - 1) / FP4_GROUP;
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        float amax = 0.0f;
        for (int i = g * FP4_GROUP; i < min(n, (g + 1) * FP4_GROUP); i++)
            amax = fmaxf(amax, fabsf(x[i]));
        uint32_t u = __float_as_uint(fmaxf(amax, E2M1_AMAX_FLOOR) / E2M1_MAX), e = (u >> 23) & 0xff;
        if (u & 0x7fffff)
            e++;
        sc_s[g] = __uint_as_float(e << 23);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        x[i] = e2m1_round(x[i] / sc_s[i / FP4_GROUP]) * sc_s[i / FP4_GROUP];
    __syncthreads();
}

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
    float *v_s = sm, *sc_s = sm + a.d, *red = sc_s + a.d / 16 + 8;
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
    float ss = 0.0f;
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x)
        ss += v_s[ch] * v_s[ch];
    const float rs = 1.0f / sqrtf(block_sum_256(ss, red) / d + a.eps);
    for (int ch = threadIdx.x; ch < d; ch += blockDim.x)
        v_s[ch] = a.norm[ch] * (v_s[ch] * rs);
    __syncthreads();
    for (int i = threadIdx.x; i < a.rd / 2; i += blockDim.x)
        rope_pair(&v_s[d - a.rd + 2 * i], &v_s[d - a.rd + 2 * i + 1], a.inv_freq[i], q0);
    __syncthreads();
    uint8_t *dst = a.entries + a.slot[b] * a.entries_slot_stride + (int64_t)(pos / r) * a.entry_bytes;
    if (a.indexer && a.fp8) {
        hadamard_fp4(v_s, d, sc_s);
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
    const size_t smem = (size_t)(a->d + a->d / 16 + 8 + COMP_THREADS / DSV4_CUDA_WARP) * sizeof(float);
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
        rope_pair(&v_s[dI - rd + 2 * i], &v_s[dI - rd + 2 * i + 1], inv_freq[i], pos[blockIdx.x]);
    __syncthreads();
    if (fp8)
        hadamard_fp4(v_s, dI, sc_s);
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
    dsv4_launch(indexer_q_kernel, dim3(batch, nI), 128, (size_t)(dI + dI / FP4_GROUP + 2) * sizeof(float),
                static_cast<cudaStream_t>(stream), d_q, nI, dI, rd, fp8, d_pos, d_inv_freq);
    DSV4_CUDA_LAUNCHED("indexer_q");
    return 0;
}

/* One block per row. */
__global__ void __launch_bounds__(COMP_THREADS)
hc_head_kernel(const float *X, const float *m, const float *base, const float *scale, int hc, int dim,
               float hc_eps, float norm_eps, float *y)
{
    dsv4_pdl_enter();
    __shared__ float red[COMP_THREADS / DSV4_CUDA_WARP], pre[DSV4_MAX_HC];
    const int b = blockIdx.x;
    const float *Xb = X + (int64_t)b * hc * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hc * dim; i += blockDim.x)
        ss += Xb[i] * Xb[i];
    const float r = 1.0f / sqrtf(block_sum_256(ss, red) / (hc * dim) + norm_eps);
    if (threadIdx.x < hc)
        pre[threadIdx.x] = 1.0f / (1.0f + expf(-(m[b * hc + threadIdx.x] * r * scale[0] + base[threadIdx.x]))) + hc_eps;
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < hc; j++)
            acc += pre[j] * Xb[(int64_t)j * dim + d];
        y[(int64_t)b * dim + d] = acc;
    }
}

int dsv4_cuda_hc_head(const float *d_X, const float *d_m, const float *d_base, const float *d_scale, int batch,
                      int hc, int dim, float hc_eps, float norm_eps, float *d_y, void *stream)
{
    if (hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "hc_head: hc_mult %d over %d", hc, DSV4_MAX_HC);
    if (batch < 1)
        return 0;
    dsv4_launch(hc_head_kernel, batch, COMP_THREADS, 0, static_cast<cudaStream_t>(stream), d_X, d_m, d_base, d_scale,
                hc, dim, hc_eps, norm_eps, d_y);
    DSV4_CUDA_LAUNCHED("hc_head");
    return 0;
}

/* grid (B), block 256: row token_b of E dequantized into every stream. */
template <typename WF>
__global__ void embed_kernel(const struct dsv4_cuda_linear E, const int32_t *tokens, int hc, float *X)
{
    dsv4_pdl_enter();
    const int b = blockIdx.x;
    const int64_t tok = tokens[b];
    const uint8_t *row = static_cast<const uint8_t *>(E.w) + tok * wrow_bytes<WF>(E.row_stride);
    for (int64_t k = threadIdx.x; k < E.in; k += blockDim.x) {
        float v;
        if constexpr (WF::vals == wf_f32::vals)
            v = reinterpret_cast<const float *>(row)[k];
        else if constexpr (WF::vals == wf_bf16::vals)
            v = __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(row)[k] << 16);
        else if constexpr (WF::vals == wf_fp8::vals) {
            __half_raw h = __nv_cvt_fp8_to_halfraw(row[k], __NV_E4M3);
            v = __half2float(*reinterpret_cast<__half *>(&h)) * wscale<WF>(E, tok, k);
        } else
            v = dsv4_e2m1(row[k / 2] >> (4 * (k & 1))) * wscale<WF>(E, tok, k);
        for (int j = 0; j < hc; j++)
            X[((int64_t)b * hc + j) * E.in + k] = v;
    }
}

int dsv4_cuda_embed(const struct dsv4_cuda_linear *E, const int32_t *d_tokens, int batch, int hc, float *d_X,
                    void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (batch < 1)
        return 0;
    switch (E->fmt) {
    case DSV4_W_F32:
        dsv4_launch(embed_kernel<wf_f32>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    case DSV4_W_BF16:
        dsv4_launch(embed_kernel<wf_bf16>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    case DSV4_W_FP8:
        dsv4_launch(embed_kernel<wf_fp8>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    case DSV4_W_FP4:
        dsv4_launch(embed_kernel<wf_fp4>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    default: return dsv4_error_set(-ENOTSUP, "embed: weight format %d has no CUDA kernel", (int)E->fmt);
    }
    DSV4_CUDA_LAUNCHED("embed");
    return 0;
}

__global__ void hadamard_fp4_kernel(const float *x, int n, float *y)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + n;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        v_s[i] = x[(int64_t)blockIdx.x * n + i];
    __syncthreads();
    hadamard_fp4(v_s, n, sc_s);
    /* through the stored key format, as the indexer reads it back */
    uint8_t *key = reinterpret_cast<uint8_t *>(sc_s + n / FP4_GROUP + 2);
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
                (size_t)(n + n / FP4_GROUP + 2) * sizeof(float) + dsv4_index_key_bytes(n) + 16,
                static_cast<cudaStream_t>(stream), d_x, n, d_y);
    DSV4_CUDA_LAUNCHED("hadamard_fp4");
    return 0;
}
