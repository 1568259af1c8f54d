/* SPDX-License-Identifier: MIT */
/* Attention for the decode step: interleaved RoPE, the KV entry codec of doc/MODEL.md §5.2, the window-ring
 * store, and sparse MQA over window + compressed entries with per-head sinks, split over keys with an
 * online combine (in split order) that also undoes RoPE on the output. The CPU twin is dsv4_cpu_attention
 * (engine/cpu/cpu_attention.c), checked through the whole decode step (tests/gpu/test_gpu_step.c); the
 * attention itself against a double-precision reference in tests/gpu/test_gpu_attention.c.
 *
 * KV entry (one vector of head_dim values; keys and values are the same vectors):
 *   fp8 numerics: [nope e4m3][rope_dim bf16][ceil(nope/64) UE8M0][pad to 8 bytes] = 584 B at 512/64;
 *   exact numerics: head_dim f32.
 *
 * Two attention kernels write the same per-split partials, merged by one combine kernel:
 *   attention_mma_kernel (FP8 entries, DSV4_CUDA_V_ATTENTION_MMA): tensor cores, all heads of a row
 *     (up to 64 per block) sharing one decode of each entry; see the comment above it.
 *   attention_f32_kernel (f32 entries, DSV4_CUDA_V_ATTENTION_F32): FMA dot products, 32 heads per
 *     block. Exact numerics keep it: their keys are f32 and would need bf16 terms of their own (several
 *     times the MMAs and the key tile), for the numerics of the test fixtures.
 * The slices of a prefill chunk (FP8 entries) skip the partials: attention_mma_whole_kernel
 * (DSV4_CUDA_V_ATTENTION_WHOLE) computes a row's runs one after another as the split blocks do and
 * folds them as the combine does, the same bits. */
#include <cuda_bf16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/kv_entry.cuh"
#include "kernels/mma.cuh"
#include "kernels/switches.h"

#define ATT_MIN_RUN 64          /* keys: a split's run is at least one tensor-core tile (ATT_MMA_KEYS) */
#define ATT_TILE 12             /* keys per shared-memory tile: 92.7 KB at hd 512, within the 99 KB of sm_86/89/120 */
#define ATT_HB 32               /* heads per block: their queries stay in shared memory */
#define ATT_THREADS 256
#define ATT_CHUNKS (ATT_THREADS / ATT_HB)           /* dim chunks per head in the value sum */
#define ATT_MAX_PER (DSV4_CUDA_MAX_HEAD_DIM / ATT_CHUNKS)
#define ATT_PAD 4               /* floats of padding per shared row (bank spread, float4 alignment) */
#define ATT_F32_HD_ALIGN (4 * ATT_CHUNKS)           /* f32 kernel: float4 dots, ATT_CHUNKS dim chunks */

int dsv4_cuda_kv_entry_bytes(int hd, int rd, int kvf)
{
    if (kvf == DSV4_KV_F32)
        return hd * (int)sizeof(float);
    const int nope = hd - rd, nsc = (nope + KV_GROUP - 1) / KV_GROUP;
    return (nope + 2 * rd + nsc + 7) / 8 * 8;
}

/* One block per batch row: v [B, hd] -> ring entry pos % ring of the row's slot (with last, only a
 * run's last `ring` rows), or with no slots -> entry b of entries. */
__global__ void kv_store_kernel(const float *__restrict__ v, int hd, int rd, int kvf, int entry_bytes,
                                const int32_t *__restrict__ pos, const int32_t *__restrict__ slot, uint8_t *entries,
                                int64_t slot_stride, int ring, const int32_t *__restrict__ last)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    float *v_s = sm, *sc_s = sm + hd;
    const int b = blockIdx.x;
    if (slot && last && pos[b] <= last[b] - ring)
        return;
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        v_s[d] = v[(int64_t)b * hd + d];
    __syncthreads();
    uint8_t *dst = slot ? entries + slot[b] * slot_stride + (int64_t)(pos[b] % ring) * entry_bytes
                        : entries + (int64_t)b * entry_bytes;
    dsv4_entry_store(v_s, dst, hd, rd, kvf, sc_s);
}

int dsv4_cuda_kv_store(const float *d_v, int batch, int hd, int rd, int kvf, const int32_t *d_pos,
                       const int32_t *d_slot, uint8_t *d_ring, int64_t slot_stride, int ring, const int32_t *d_last,
                       void *stream)
{
    const size_t smem = (size_t)(hd + hd / KV_GROUP + 1) * sizeof(float);
    if (batch < 1)
        return 0;
    dsv4_launch(kv_store_kernel, batch, 128, smem, static_cast<cudaStream_t>(stream), d_v, hd, rd, kvf,
                dsv4_cuda_kv_entry_bytes(hd, rd, kvf), d_pos, d_slot, d_ring, slot_stride, ring, d_last);
    DSV4_CUDA_LAUNCHED("kv_store");
    return 0;
}

/* The keys row b attends to, in order: the window (positions first .. pos, entry p at p % ring of
 * the row's slot) then the compressed entries (the indexer's picks, or every complete one). Split
 * `split` of `splits` takes the run [k0, k1) of length max(ATT_MIN_RUN, ceil(nk / splits)): a row
 * with few keys fills a few whole runs and leaves the other splits empty (they exit at once, and
 * the combine skips them), rather than giving every split a sliver. A run depends on the row alone,
 * so a row's result never depends on the batch. */
struct att_run {
    int nw, first, k0, k1;
    int64_t slot;
};

static __device__ __forceinline__ att_run att_key_run(const struct dsv4_cuda_att_args &a, int b, int split,
                                                       int splits)
{
    att_run r;
    const int pos = a.pos[b];
    r.slot = a.slot[b];
    r.nw = min(pos + 1, a.window);
    r.first = pos - r.nw + 1;
    const int nc = a.ratio ? (a.sel ? a.nsel[b] : (pos + 1) / a.ratio) : 0;
    const int nk = r.nw + nc, per = max(ATT_MIN_RUN, (nk + splits - 1) / splits);
    r.k0 = min(nk, split * per);
    r.k1 = min(nk, r.k0 + per);
    return r;
}

/* Entry of key kidx (< nw + nc) of row b. */
static __device__ __forceinline__ const uint8_t *att_entry(const struct dsv4_cuda_att_args &a, const att_run &r,
                                                           int b, int kidx)
{
    if (kidx < r.nw) {
        const int p = r.first + kidx;
        if (a.own && p >= a.first[b])   /* this step's own entry: row b - (pos - p) */
            return a.own + (int64_t)(b - (a.pos[b] - p)) * a.entry_bytes;
        return a.win + r.slot * a.win_slot_stride + (int64_t)(p % a.ring) * a.entry_bytes;
    }
    const int c = kidx - r.nw;
    return a.comp + r.slot * a.comp_slot_stride + (int64_t)(a.sel ? a.sel[(int64_t)b * a.sel_stride + c] : c) * a.entry_bytes;
}

/* The combine of a row's runs, per head, online: (M, L, acc) start from the sink (M = sink, L =
 * e^0 = 1, acc = 0; a sink is a learned, finite logit) and each non-empty run (m, l, o) folds in, in
 * split order, as
 *   M' = max(M, m), ca = e^(M - M'), cr = e^(m - M'), L' = L ca + l cr, acc' = acc ca + o cr;
 * the output is acc / L' after the last run. attention_combine_kernel folds a row's partials with
 * these helpers and attention_mma_whole_kernel folds its runs as it computes them: every product and
 * sum is an explicit round-to-nearest operation (nothing left to the compiler's contraction), so the
 * two give the same bits. */
static __device__ __forceinline__ void att_fold_scales(float &M, float &L, float m, float l, float &ca, float &cr)
{
    const float Mn = fmaxf(M, m);
    ca = expf(__fsub_rn(M, Mn));
    cr = expf(__fsub_rn(m, Mn));
    L = __fmaf_rn(l, cr, __fmul_rn(L, ca));
    M = Mn;
}

static __device__ __forceinline__ float att_fold_value(float acc, float o, float ca, float cr)
{
    return __fmaf_rn(o, cr, __fmul_rn(acc, ca));
}

/* Output dims (d, d + 1) of a head, d even: acc / L, then, for a RoPE pair (d >= hd - rd), RoPE^-1
 * at the row's position (dsv4_rope_pair, inverse: x' = fma(y, sin, x cos), y' = fma(-x, sin, y cos),
 * every operation rounded explicitly, so the combine and the whole-row kernel round alike). */
static __device__ __forceinline__ float2 att_out_pair(float x, float y, float L, int d, int hd, int rd,
                                                      const float *__restrict__ inv_freq, int pos)
{
    x = __fdiv_rn(x, L);
    y = __fdiv_rn(y, L);
    if (d >= hd - rd)
        dsv4_rope_pair(&x, &y, inv_freq[(d - (hd - rd)) / 2], pos, true);
    return make_float2(x, y);
}

/* grid (B, DSV4_CUDA_ATT_SPLITS, ceil(H / ATT_HB)): the keys of row b split in equal runs; each
 * block keeps its heads' queries in shared memory, streams its run of keys through a tile shared
 * by all those heads, and leaves (max, sum, unnormalized output) per head for the combine. */
__global__ void __launch_bounds__(ATT_THREADS, 1)   /* one block per SM: 12-key tiles spilled at 128 registers */
attention_f32_kernel(const struct dsv4_cuda_att_args a)
{
    dsv4_pdl_enter();
    extern __shared__ float sm[];
    const int hd = a.hd, row = hd + ATT_PAD;
    float *q_s = sm, *k_s = q_s + ATT_HB * row, *p_s = k_s + ATT_TILE * row;
    float *m_s = p_s + ATT_HB * ATT_TILE, *l_s = m_s + ATT_HB, *a_s = l_s + ATT_HB;
    const int b = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * ATT_HB, tid = threadIdx.x;
    const att_run r = att_key_run(a, b, split, gridDim.y);
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

    for (int t0 = r.k0; t0 < r.k1; t0 += ATT_TILE) {
        const int nt = min(ATT_TILE, r.k1 - t0);
        for (int i = tid; i < nt * hd; i += ATT_THREADS) {
            const int j = i / hd, d = i % hd;
            k_s[j * row + d] = dsv4_entry_load(att_entry(a, r, b, t0 + j), d, hd, a.rd, a.kvf);
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
            if (i < per_d && r.k0 < r.k1)      /* an empty run leaves only m = -inf: the combine skips it */
                out[dc * per_d + i] = acc[i];
        if (dc == 0) {
            out[hd] = m_s[hh];
            out[hd + 1] = l_s[hh];
        }
    }
}

/* ---- tensor-core attention over FP8 KV entries ----
 *
 * grid (B, DSV4_CUDA_ATT_SPLITS, ceil(H / G)), 8 warps (16 when G = 16). A block takes row b's run of keys for up
 * to G = a.heads_per_block heads (16, 32 or 64: one to four m16 tiles; a head count that is not a
 * multiple of 16 gets zero queries in its last tile) and streams the run through shared memory
 * ATT_MMA_KEYS keys at a time. G = 64 makes V4-Flash's 64 heads one block, which decodes each key
 * tile once for all of them; at small batches that leaves most SMs idle (a short row's run is one
 * tile), so there G = 16 takes four blocks a run, each decoding the tile again and computing a
 * quarter of the scores and P V with its warps less shared. A head's arithmetic is the same in any
 * G (its m16 tile's warps, the same halves of head_dim in the same order), so the choice never
 * changes a bit. A G = 16 block is a single dependent chain per SM (decode, scores, softmax, P V),
 * so it runs on 16 warps, each with half of an 8-warp block's share of every phase and the same
 * arithmetic per value (att_scores_wide; measured on the H200: a 4-layer V4-Flash step at batch 1
 * 1.3-1.8% faster than on 8 warps):
 *   1. decode: the tile's entries -> k_s [64 keys, hd] bf16, once for all the block's heads. Every
 *      value of an FP8 entry is exact in bf16 (e4m3 times a power-of-two scale >= 2^-117, or a bf16
 *      RoPE value), so the keys (= values) lose nothing.
 *   2. scores: S [heads, keys] = scale * Q K^T with m16n8k16 bf16 MMAs, f32 accumulation (M = heads,
 *      N = keys, K = hd); warp w: an m16 tile x a share of the tile's key pairs x half w / 4 of
 *      head_dim, the two halves added in a fixed order.
 *   3. online softmax per head in f32 (4 threads a head); P = e^(s - m) goes to shared memory as
 *      bf16 terms (over S, once every score is in registers).
 *   4. O [heads, hd] = alpha O + P V with MMAs (M = heads, N = hd, K = keys): warp w owns output dims
 *      8 (w + 8 i) of every head, 4 x 8 x 4 = 128 f32 accumulators a thread at hd 512.
 *
 * Precision (f32 operands through bf16 MMAs): an f32 x is split into bf16 terms, each rounding what
 * the previous left (exact in f32), |x - sum| <= 2^(-8 terms) |x|, one MMA per term. Queries take
 * three terms (2^-24): with two, the 2^-16 error per query value moves the logits by up to ~1e-5
 * of |q||k| and measured 1.2e-5 relative on the H200, over the test's bound. Probabilities take two
 * (2^-16 each, not amplified; a third changed nothing measurable). The tensor cores' running f32
 * accumulation does not round to nearest, which over a 512-long dot cost 7e-6; so each k-step's
 * MMAs start from zero and are added to the score in an ordinary f32 add (<= 1.4e-6 over several
 * seeds; the f32 kernel's FMA dots: <= 2.6e-6). The P V sums are at most ATT_MMA_KEYS long per tile
 * and need no such care.
 *
 * Memory: a block of up to ATT_QS_HEADS heads splits its queries into their bf16 terms once and
 * keeps them in shared memory beside the key tile (att_stage_q: 50 KB at 16 heads, 100 KB at 32)
 * where the device's blocks hold that (sm_90: 227 KB); 64 heads (192 KB of terms), and every block on
 * 99 KB parts (sm_86/89/120), load the query fragments from global memory (L1/L2) per k-step instead,
 * each warp splitting what it loads. A split's run of up to ATT_MMA_KEYS keys is
 * one tile and reads them once, as the f32 kernel did; that covers 1024 keys a row (CSA's 128 + 512,
 * HCA below ~115k tokens). Shared memory at hd 512: keys 66.5 KB + S/P 18 KB + 1.3 KB = 86.3 KB.
 * 253-255 registers a thread (no spills on sm_90a/100a/120a; the 16-warp blocks 124-128) allow one block per SM, so within a
 * block nothing overlaps (a run is one or two tiles); the other SMs' blocks carry the traffic.
 * Entries are read with plain loads: the decode needs them in registers anyway, and cp.async would
 * need a raw staging tile (37 KB) that does not fit beside the rest.
 * The partials [B, SPLITS, H, hd + 2] are those of the f32 kernel; attention_combine_kernel merges
 * them. They are the largest traffic left (131 KB a block, written and read back: 134 MB each way
 * at B 64) next to the per-block fixed cost; on an H200 the whole attention (with the combine) took
 * 31/40/231 us at B 1 and 250/349/2281 us at B 64 for 128/640/8320 keys, 2.5x-16x faster than the
 * f32 kernel on the same FP8 entries. */
#define ATT_MMA_HEADS 64            /* heads per block: four m16 tiles */
#define ATT_MMA_MT (ATT_MMA_HEADS / 16)
#define ATT_MMA_KEYS 64             /* keys per shared tile */
static_assert(ATT_MIN_RUN == ATT_MMA_KEYS, "a short row's run fills one tile");
#define ATT_MMA_WARPS 8
#define ATT_MMA_THREADS (ATT_MMA_WARPS * DSV4_CUDA_WARP)
#define ATT_MMA_HD_ALIGN 16         /* head_dim: whole MMA k-steps */
#define ATT_MMA_RD_ALIGN 8          /* rope_dim (and nope): whole 8-value decode chunks */
#define ATT_MMA_VEC 8               /* entry values a thread decodes at once: 16 bytes of bf16 */
#define ATT_MMA_KPAD 8              /* bf16 padding of a key row: stride an odd multiple of 16 B (ldmatrix) */
#define ATT_MMA_SSTR (ATT_MMA_KEYS + 8)     /* floats per score row: conflict-free float2 stores */
#define ATT_MMA_PSTR (ATT_MMA_KEYS + 8)     /* bf16 per probability row: 144 B, odd multiple of 16 B */
#define ATT_MMA_OWN (DSV4_CUDA_MAX_HEAD_DIM / 8 / ATT_MMA_WARPS)  /* n8 tiles of output dims a warp */
#define ATT_MMA_QTERMS 3            /* bf16 terms of a query: 2^-24, f32's own precision */
#define ATT_MMA_QPF 2               /* k-steps of query loads issued ahead (4 spills on sm_100a) */
#define ATT_MMA_PAIRS (ATT_MMA_KEYS / 16)   /* pairs of n8 key tiles in a key tile */
#define ATT_MMA_PTERMS 2            /* bf16 terms of a probability: 2^-16, not amplified */
#define ATT_MMA_ENTRY_ALIGN 8       /* bytes: entries and slot strides, for 8-byte loads */
#define ATT_MMA_DEC_BATCH 8         /* entry chunks a thread has in flight while decoding a tile */
#define ATT_COMB_THREADS 256        /* combine: dims a thread <= MAX_HEAD_DIM / this; rope pairs <= this */
#define ATT_QS_HEADS 32             /* most heads a split block stages the queries of (att_stage_q) */
#define ATT_MMA_WIDE_WARPS 16       /* a 16-head split block (small batches): twice the warps, half the work each */

/* n8 tiles of output dims a warp of a block of `warps` owns in P V (head_dim up to the maximum) */
static __host__ __device__ constexpr int att_own(int warps)
{
    return DSV4_CUDA_MAX_HEAD_DIM / 8 / warps;
}

static_assert(ATT_MMA_OWN % 2 == 0 && att_own(ATT_MMA_WIDE_WARPS) % 2 == 0,
              "value fragments are loaded for pairs of n8 tiles");
static_assert(ATT_MMA_WIDE_WARPS == 2 * ATT_MMA_KEYS / 8, "wide scores: a warp per n8 key tile and half of head_dim");
static_assert(ATT_MMA_THREADS == 4 * ATT_MMA_HEADS, "softmax: four threads a head");
static_assert(ATT_MMA_WARPS == 2 * ATT_MMA_MT, "scores: two warps (halves of head_dim) per m16 tile");

static __host__ __device__ size_t att_mma_kbytes(int hd)
{
    return (size_t)ATT_MMA_KEYS * (hd + ATT_MMA_KPAD) * sizeof(__nv_bfloat16);
}

static __host__ __device__ constexpr size_t att_mma_spbytes()
{
    return (size_t)ATT_MMA_HEADS * ATT_MMA_SSTR * sizeof(float) >
                   (size_t)ATT_MMA_PTERMS * ATT_MMA_HEADS * ATT_MMA_PSTR * sizeof(__nv_bfloat16)
               ? (size_t)ATT_MMA_HEADS * ATT_MMA_SSTR * sizeof(float)
               : (size_t)ATT_MMA_PTERMS * ATT_MMA_HEADS * ATT_MMA_PSTR * sizeof(__nv_bfloat16);
}

/* keys [64, hd + 8] bf16 | S [64, SSTR] f32, later P [PTERMS, 64, PSTR] bf16 | entry pointers [64] |
 * m, l, alpha [64] f32 */
static __host__ __device__ size_t att_mma_smem(int hd)
{
    return att_mma_kbytes(hd) + att_mma_spbytes() + ATT_MMA_KEYS * sizeof(void *) +
           3 * ATT_MMA_HEADS * sizeof(float);
}

/* A block that stages its queries (att_stage_q): attention_mma_smem's, then the queries' bf16 terms
 * q_s [QTERMS, heads, hd + 8] (16 heads: +50 KB at hd 512, 136 KB; 32: 186 KB; past the 99 KB of
 * sm_86/89/120, where no block stages them and rows take the split launch). */
static __host__ __device__ size_t att_qs_smem(int hd, int heads)
{
    return att_mma_smem(hd) + (size_t)ATT_MMA_QTERMS * heads * (hd + ATT_MMA_KPAD) * sizeof(__nv_bfloat16);
}

static __device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v)
{
    return *reinterpret_cast<uint32_t *>(&v);
}

/* (x, y) -> TERMS bf16x2 terms t[0] + t[1] + ...: each rounds what the previous ones left (exact in
 * f32), so |x - sum| <= 2^(-8 TERMS) |x|. */
template <int TERMS>
static __device__ __forceinline__ void att_split(float x, float y, uint32_t *t)
{
#pragma unroll
    for (int i = 0; i < TERMS; i++) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        const float2 hf = __bfloat1622float2(h);
        t[i] = bf16x2_bits(h);
        x -= hf.x;
        y -= hf.y;
    }
}

static __device__ __forceinline__ void att_ldsm_x4(uint32_t *r, const __nv_bfloat16 *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

static __device__ __forceinline__ void att_ldsm_x2(uint32_t *r, const __nv_bfloat16 *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s));
}

static __device__ __forceinline__ void att_ldsm_x4_trans(uint32_t *r, const __nv_bfloat16 *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* The 16 bytes a decode chunk (values d .. d+7 of an FP8 entry) reads, and its scale byte. nope and
 * rd are multiples of 8, so a chunk is all e4m3 (the first 8 bytes, one UE8M0 scale: 64 is a
 * multiple of 8) or all bf16 (16 bytes). Every address stays inside the entry, so the loads need no
 * branch, and they are explicitly global and read-only: nothing then keeps the compiler from
 * issuing a whole batch of them before the shared-memory stores of the decoded values. */
struct att_chunk {
    uint2 x, y;
    uint8_t scale;
};

static __device__ __forceinline__ att_chunk att_load8(const uint8_t *e, int d, int hd, int rd)
{
    const int nope = hd - rd;
    const uint2 *p = reinterpret_cast<const uint2 *>(d >= nope ? e + nope + 2 * (d - nope) : e + d);
    att_chunk c;
    c.x = __ldg(p);
    c.y = __ldg(p + 1);
    c.scale = __ldg(nope ? e + nope + 2 * rd + min(d, nope - 1) / KV_GROUP : e);
    return c;
}

/* The chunk as 8 bf16 (exact). */
static __device__ __forceinline__ uint4 att_decode8(const att_chunk &c, bool rope)
{
    if (rope)
        return make_uint4(c.x.x, c.x.y, c.y.x, c.y.y);
    const float s = dsv4_ue8m0(c.scale);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t word = i < 2 ? c.x.x : c.x.y;
        const float2 f = dsv4_e4m3x2((uint16_t)(word >> (16 * (i & 1))));
        w[i] = dsv4_bf16x2(f.x * s, f.y * s);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* (key, chunk) of the chunk a block's threads further on (dj keys and dcol chunks), cpr chunks a key */
static __device__ __forceinline__ void att_step_chunk(int &j, int &col, int dj, int dcol, int cpr)
{
    j += dj;
    col += dcol;
    if (col >= cpr) {
        col -= cpr;
        j++;
    }
}

/* Phase 1: keys [ntp, hd] bf16 of the tile's nt entries; rows nt .. ntp-1 zero (P is 0 there, and
 * 0 x garbage could be NaN). Bound by load latency when a split has one tile: each of the block's
 * THREADS threads loads ATT_MMA_DEC_BATCH chunks (clamped to valid entries), then decodes and stores
 * them. */
template <int THREADS>
static __device__ __forceinline__ void att_decode_tile(const struct dsv4_cuda_att_args &a, const uint8_t *const *e_s,
                                                       int nt, int ntp, __nv_bfloat16 *k_s, int kstr)
{
    const int cpr = a.hd / ATT_MMA_VEC, n = ntp * cpr, nope = a.hd - a.rd;
    /* chunk c (this thread's: tid, tid + THREADS, ...) is chunk `col` of key j; both are stepped
     * along (dcol < cpr, so one carry a step), not divided out of c for every chunk */
    const int dj = THREADS / cpr, dcol = THREADS % cpr;
    int j = threadIdx.x / cpr, col = threadIdx.x % cpr;
    for (int c0 = threadIdx.x; c0 < n; c0 += ATT_MMA_DEC_BATCH * THREADS) {
        att_chunk ch[ATT_MMA_DEC_BATCH];
        int js = j, cs = col;
#pragma unroll
        for (int u = 0; u < ATT_MMA_DEC_BATCH; u++) {
            ch[u] = att_load8(e_s[min(js, nt - 1)], cs * ATT_MMA_VEC, a.hd, a.rd);
            att_step_chunk(js, cs, dj, dcol, cpr);
        }
#pragma unroll
        for (int u = 0; u < ATT_MMA_DEC_BATCH; u++) {
            const int d = col * ATT_MMA_VEC;
            if (c0 + u * THREADS < n)
                *reinterpret_cast<uint4 *>(k_s + j * kstr + d) =
                    j < nt ? att_decode8(ch[u], d >= nope) : make_uint4(0u, 0u, 0u, 0u);
            att_step_chunk(j, col, dj, dcol, cpr);
        }
    }
}

/* KU consecutive k-steps from k of att_scores' warp: its NP = ATT_MMA_PAIRS / G key pairs (the
 * first at kl, the next G pairs on), each step's query terms from xq[u] or (QS) from q_s at ql. Each
 * step's MMAs accumulate from zero in term order and are added to acc in step order; the MMAs are
 * issued term by term across all steps and pairs, so that none waits on the one before it. */
template <bool QS, int G, int KU>
static __device__ __forceinline__ void att_score_steps(int k, const float2 (*xq)[4], const __nv_bfloat16 *kl,
                                                       const __nv_bfloat16 *ql, int q_heads, int kstr,
                                                       float (&acc)[ATT_MMA_PAIRS / G][2][4])
{
    constexpr int NP = ATT_MMA_PAIRS / G;
    uint32_t kf[KU][NP][4], qf[KU][ATT_MMA_QTERMS][4];
#pragma unroll
    for (int u = 0; u < KU; u++) {
#pragma unroll
        for (int i = 0; i < NP; i++)
            att_ldsm_x4(kf[u][i], kl + i * G * 16 * kstr + k + 16 * u);
        if constexpr (QS) {
#pragma unroll
            for (int x = 0; x < ATT_MMA_QTERMS; x++)
                att_ldsm_x4(qf[u][x], ql + x * q_heads * kstr + k + 16 * u);
        } else {
            uint32_t t[4][ATT_MMA_QTERMS];
#pragma unroll
            for (int f = 0; f < 4; f++)
                att_split<ATT_MMA_QTERMS>(xq[u][f].x, xq[u][f].y, t[f]);
#pragma unroll
            for (int x = 0; x < ATT_MMA_QTERMS; x++)
#pragma unroll
                for (int f = 0; f < 4; f++)
                    qf[u][x][f] = t[f][x];
        }
    }
    float part[KU][NP][2][4] = {};
#pragma unroll
    for (int x = 0; x < ATT_MMA_QTERMS; x++)
#pragma unroll
        for (int u = 0; u < KU; u++)
#pragma unroll
            for (int i = 0; i < NP; i++) {
                dsv4_mma_bf16(part[u][i][0], qf[u][x], kf[u][i][0], kf[u][i][1]);
                dsv4_mma_bf16(part[u][i][1], qf[u][x], kf[u][i][2], kf[u][i][3]);
            }
#pragma unroll
    for (int u = 0; u < KU; u++)
#pragma unroll
        for (int i = 0; i < NP; i++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                acc[i][0][c] += part[u][i][0][c];
                acc[i][1][c] += part[u][i][1][c];
            }
}

/* Phase 2: s_s [16 mts, ntp] = scale * Q K^T. Warp w: heads [16 mt, +16) (mt = (w % 4) % mts), the
 * key pairs (two n8 tiles) of its group (w % 4) / mts, over half kh = w / 4 of head_dim's k-steps:
 * a split's run is mostly a few dozen keys, so halving the keys would idle half the warps, while
 * halving head_dim halves every warp's query loads and splits (measured ~10% faster at V4-Flash
 * shapes). G = ATT_MMA_MT / mts groups share the tile's ATT_MMA_PAIRS pairs, group pg taking pairs
 * pg, pg + G, ... (at 64 heads a block one group takes every pair; at 16, four take one each); a
 * pair's arithmetic is the same whichever warp does it. G is a template argument so that a warp's
 * pairs are a fixed, unrolled set: their fragment loads and MMA chains interleave, where a runtime
 * test per pair (pr % G, pr < pairs) made each pair a branch of its own and serialized the chains
 * (ncu: 46% of a whole-row block's samples in this phase, mostly dependency waits). A warp computes
 * all its pairs whatever the tile's length (key rows past ntp hold an earlier tile's keys or
 * nothing, and their scores are never stored). Half kh = 0 is stored first and half kh = 1 added to
 * it after a barrier: a fixed order. Query fragments come from global memory ATT_MMA_QPF k-steps
 * ahead, split into ATT_MMA_QTERMS bf16 terms, or with QS by ldmatrix from those terms staged once
 * in q_s [QTERMS, q_heads, kstr] by att_stage_q, the same values (so one split of each value a
 * block, where the warps of a half would each split what they share, every tile); each k-step's
 * MMAs accumulate from zero, in term order, and are added to the score with a rounded f32 add.
 * Every thread must call it. */
template <bool QS, int G>
static __device__ __forceinline__ void att_scores(const struct dsv4_cuda_att_args &a, int b, int h0, int mts,
                                                  int ntp, const __nv_bfloat16 *k_s, int kstr,
                                                  const __nv_bfloat16 *q_s, int q_heads, float *s_s)
{
    constexpr int NP = ATT_MMA_PAIRS / G;      /* pairs a warp */
    constexpr int KU = NP >= ATT_MMA_PAIRS ? 1 : ATT_MMA_QPF;     /* k-steps whose MMAs interleave */
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int wq = warp % ATT_MMA_MT, kh = warp / ATT_MMA_MT;
    const int g = lane / 4, t = lane % 4, mt = wq % mts, pg = wq / mts;
    const int hd = a.hd, nks = hd / 16, half = (nks + 1) / 2;
    const int k_lo = 16 * kh * half, k_hi = 16 * min(nks, (kh + 1) * half), pairs = ntp / 16;
    const bool act = pg < G;
    const int ha = h0 + 16 * mt + g, hb = ha + 8;
    const bool va = act && ha < a.H, vb = act && hb < a.H;
    /* A fragment: rows g and g + 8 of the m16 tile, dims 2t, 2t+1 and 2t+8, 2t+9 of each k-step */
    const float *qa = a.q + ((int64_t)b * a.H + (va ? ha : 0)) * hd + 2 * t;
    const float *qb = a.q + ((int64_t)b * a.H + (vb ? hb : 0)) * hd + 2 * t;
    /* B fragments by ldmatrix: matrices (keys +0..7, dims +0..7), (+0..7, +8..15), (+8..15, +0..7),
     * (+8..15, +8..15) of a pair; lane l addresses row l % 8 of matrix l / 8; this warp's first pair */
    const __nv_bfloat16 *kl = k_s + (16 * (act ? pg : 0) + (lane & 7) + ((lane >> 4) << 3)) * kstr + ((lane >> 3) & 1) * 8;
    /* QS: A fragments by ldmatrix from the staged terms: matrices (heads +0..7, dims +0..7), (+8..15,
     * +0..7), (+0..7, +8..15), (+8..15, +8..15), the register path's t0, t1, t2, t3 */
    const __nv_bfloat16 *ql = q_s + (16 * mt + (lane & 15)) * kstr + (lane >> 4) * 8;
    const float2 zero = make_float2(0.0f, 0.0f);
    float acc[NP][2][4];
#pragma unroll
    for (int i = 0; i < NP; i++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[i][0][c] = acc[i][1][c] = 0.0f;

    for (int k0 = act ? k_lo : k_hi; k0 < k_hi; k0 += 16 * ATT_MMA_QPF) {
        float2 xq[ATT_MMA_QPF][4];      /* without QS: the query values of the next k-steps */
        if constexpr (!QS) {
#pragma unroll
            for (int u = 0; u < ATT_MMA_QPF; u++) {
                const int k = k0 + 16 * u;
                const bool in = k < k_hi;
                xq[u][0] = in && va ? __ldg(reinterpret_cast<const float2 *>(qa + k)) : zero;
                xq[u][1] = in && vb ? __ldg(reinterpret_cast<const float2 *>(qb + k)) : zero;
                xq[u][2] = in && va ? __ldg(reinterpret_cast<const float2 *>(qa + k + 8)) : zero;
                xq[u][3] = in && vb ? __ldg(reinterpret_cast<const float2 *>(qb + k + 8)) : zero;
            }
        }
        if (KU > 1 && k0 + 16 * ATT_MMA_QPF <= k_hi) {
            att_score_steps<QS, G, KU>(k0, xq, kl, ql, q_heads, kstr, acc);
        } else {
#pragma unroll
            for (int u = 0; u < ATT_MMA_QPF; u++) {
                if (k0 + 16 * u >= k_hi)
                    break;
                att_score_steps<QS, G, 1>(k0 + 16 * u, xq + u, kl, ql, q_heads, kstr, acc);
            }
        }
    }
    /* C fragment: rows g, g + 8, keys 2t, 2t+1 of each n8 tile; half 0 stores, half 1 adds and scales */
    for (int h = 0; h < 2; h++) {
        if (act && kh == h) {
#pragma unroll
            for (int i = 0; i < NP; i++) {
                const int pr = pg + G * i;
                if (pr >= pairs)
                    continue;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float2 *s0 = reinterpret_cast<float2 *>(s_s + (16 * mt + g) * ATT_MMA_SSTR + 8 * (2 * pr + j) + 2 * t);
                    float2 *s1 = reinterpret_cast<float2 *>(reinterpret_cast<float *>(s0) + 8 * ATT_MMA_SSTR);
                    const float *c = acc[i][j];
                    if (h == 0) {
                        *s0 = make_float2(c[0], c[1]);
                        *s1 = make_float2(c[2], c[3]);
                    } else {
                        const float2 x0 = *s0, x1 = *s1;
                        *s0 = make_float2((x0.x + c[0]) * a.scale, (x0.y + c[1]) * a.scale);
                        *s1 = make_float2((x1.x + c[2]) * a.scale, (x1.y + c[3]) * a.scale);
                    }
                }
            }
        }
        if (h == 0)
            __syncthreads();
    }
}

/* att_scores for the block's mts m16 tiles: G = ATT_MMA_MT / mts (1, 2 or 4; mts = 3 leaves one
 * warp of each half idle), at least MIN_G (a block of MT m16 tiles never has more). */
template <bool QS, int MIN_G>
static __device__ __forceinline__ void att_scores_for(const struct dsv4_cuda_att_args &a, int b, int h0, int mts,
                                                      int ntp, const __nv_bfloat16 *k_s, int kstr,
                                                      const __nv_bfloat16 *q_s, int q_heads, float *s_s)
{
    const int G = ATT_MMA_MT / mts;
    if constexpr (MIN_G <= 1) {
        if (G == 1) {
            att_scores<QS, 1>(a, b, h0, mts, ntp, k_s, kstr, q_s, q_heads, s_s);
            return;
        }
    }
    if constexpr (MIN_G <= 2) {
        if (G == 2) {
            att_scores<QS, 2>(a, b, h0, mts, ntp, k_s, kstr, q_s, q_heads, s_s);
            return;
        }
    }
    att_scores<QS, ATT_MMA_MT>(a, b, h0, mts, ntp, k_s, kstr, q_s, q_heads, s_s);
}

/* Phase 2 in a wide block (ATT_MMA_WIDE_WARPS warps, one m16 tile: 16 heads, small batches): warp w
 * takes n8 key tile w % 8 over half w / 8 of head_dim's k-steps, where att_scores' 8 warps take a
 * pair of n8 tiles each. A score's arithmetic is att_scores': each k-step's MMAs accumulate from zero
 * in term order and are added in step order, half 0 is stored and half 1 added to it and scaled, so
 * the same bits. A warp's KU k-steps issue their MMAs term by term, interleaving the chains. Warps
 * whose n8 tile lies past ntp compute nothing. Every thread must call it. */
template <bool QS>
static __device__ __forceinline__ void att_scores_wide(const struct dsv4_cuda_att_args &a, int b, int h0, int ntp,
                                                       const __nv_bfloat16 *k_s, int kstr, const __nv_bfloat16 *q_s,
                                                       int q_heads, float *s_s)
{
    constexpr int KU = QS ? 1 : ATT_MMA_QPF, N8 = ATT_MMA_KEYS / 8;
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    const int j8 = warp % N8, kh = warp / N8, g = lane / 4, t = lane % 4;
    const int hd = a.hd, nks = hd / 16, half = (nks + 1) / 2;
    const int k_lo = 16 * kh * half, k_hi = 16 * min(nks, (kh + 1) * half);
    const bool act = 8 * j8 < ntp;
    const int ha = h0 + g, hb = ha + 8;
    const bool va = act && ha < a.H, vb = act && hb < a.H;
    const float *qa = a.q + ((int64_t)b * a.H + (va ? ha : 0)) * hd + 2 * t;
    const float *qb = a.q + ((int64_t)b * a.H + (vb ? hb : 0)) * hd + 2 * t;
    /* B fragment by ldmatrix.x2: matrices (keys 8 j8 + 0..7, dims +0..7), (+0..7, +8..15); lanes 0-15
     * address row l % 8 of matrix l / 8, lanes 16-31 the same rows (their addresses are not used) */
    const __nv_bfloat16 *kl = k_s + (8 * j8 + (lane & 7)) * kstr + ((lane >> 3) & 1) * 8;
    const __nv_bfloat16 *ql = q_s + (lane & 15) * kstr + (lane >> 4) * 8;
    const float2 zero = make_float2(0.0f, 0.0f);
    float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

    for (int k0 = act ? k_lo : k_hi; k0 < k_hi; k0 += 16 * KU) {
        uint32_t kf[KU][2], qf[KU][ATT_MMA_QTERMS][4];
#pragma unroll
        for (int u = 0; u < KU; u++) {
            const int k = k0 + 16 * u;
            if (k >= k_hi)
                break;
            att_ldsm_x2(kf[u], kl + k);
            if constexpr (QS) {
#pragma unroll
                for (int x = 0; x < ATT_MMA_QTERMS; x++)
                    att_ldsm_x4(qf[u][x], ql + x * q_heads * kstr + k);
            } else {
                const float2 xq[4] = { va ? __ldg(reinterpret_cast<const float2 *>(qa + k)) : zero,
                                       vb ? __ldg(reinterpret_cast<const float2 *>(qb + k)) : zero,
                                       va ? __ldg(reinterpret_cast<const float2 *>(qa + k + 8)) : zero,
                                       vb ? __ldg(reinterpret_cast<const float2 *>(qb + k + 8)) : zero };
                uint32_t tq[4][ATT_MMA_QTERMS];
#pragma unroll
                for (int f = 0; f < 4; f++)
                    att_split<ATT_MMA_QTERMS>(xq[f].x, xq[f].y, tq[f]);
#pragma unroll
                for (int x = 0; x < ATT_MMA_QTERMS; x++)
#pragma unroll
                    for (int f = 0; f < 4; f++)
                        qf[u][x][f] = tq[f][x];
            }
        }
        float part[KU][4] = {};
#pragma unroll
        for (int x = 0; x < ATT_MMA_QTERMS; x++)
#pragma unroll
            for (int u = 0; u < KU; u++)
                if (k0 + 16 * u < k_hi)
                    dsv4_mma_bf16(part[u], qf[u][x], kf[u][0], kf[u][1]);
#pragma unroll
        for (int u = 0; u < KU; u++)
            if (k0 + 16 * u < k_hi)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    acc[c] += part[u][c];
    }
    /* C fragment: heads g, g + 8, keys 8 j8 + 2t, +1; half 0 stores, half 1 adds and scales */
    float2 *s0 = reinterpret_cast<float2 *>(s_s + g * ATT_MMA_SSTR + 8 * j8 + 2 * t);
    float2 *s1 = reinterpret_cast<float2 *>(reinterpret_cast<float *>(s0) + 8 * ATT_MMA_SSTR);
    if (act && kh == 0) {
        *s0 = make_float2(acc[0], acc[1]);
        *s1 = make_float2(acc[2], acc[3]);
    }
    __syncthreads();
    if (act && kh == 1) {
        const float2 x0 = *s0, x1 = *s1;
        *s0 = make_float2((x0.x + acc[0]) * a.scale, (x0.y + acc[1]) * a.scale);
        *s1 = make_float2((x1.x + acc[2]) * a.scale, (x1.y + acc[3]) * a.scale);
    }
}

/* Phase 3: online softmax over the tile's nt keys, four threads a head (keys 2q + 8i, +1). Leaves
 * P = e^(s - m_new) as ATT_MMA_PTERMS bf16 terms [PTERMS, 64, PSTR] (zero past nt) over the scores,
 * and per head the new max, the running sum (of the f32 P) and alpha = e^(m_old - m_new) for
 * rescaling the output. Every thread must call it. */
static __device__ __forceinline__ void att_softmax(int nt, int ntp, int mts, float *s_s, __nv_bfloat16 *p_s,
                                                   float *m_s, float *l_s, float *al_s)
{
    const int hl = threadIdx.x / 4, q = threadIdx.x % 4;
    const bool act = hl < 16 * mts;
    float v[ATT_MMA_KEYS / 4];
    float mx = -INFINITY, m_old = -INFINITY, m_new = -INFINITY, sum = 0.0f;

#pragma unroll
    for (int i = 0; i < ATT_MMA_KEYS / 8; i++) {
        const int j = 2 * q + 8 * i;
        float2 s = make_float2(-INFINITY, -INFINITY);
        if (act && j < ntp)
            s = *reinterpret_cast<const float2 *>(s_s + hl * ATT_MMA_SSTR + j);
        v[2 * i] = j < nt ? s.x : -INFINITY;
        v[2 * i + 1] = j + 1 < nt ? s.y : -INFINITY;
        mx = fmaxf(mx, fmaxf(v[2 * i], v[2 * i + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (act) {
        m_old = m_s[hl];
        m_new = fmaxf(m_old, mx);       /* finite: the tile has a key */
#pragma unroll
        for (int i = 0; i < ATT_MMA_KEYS / 4; i++) {
            v[i] = 2 * q + 8 * (i / 2) + (i & 1) < nt ? expf(v[i] - m_new) : 0.0f;
            sum += v[i];
        }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    __syncthreads();                    /* every score is in registers: P may overwrite them */
    if (act) {
#pragma unroll
        for (int i = 0; i < ATT_MMA_KEYS / 8; i++) {
            const int j = 2 * q + 8 * i;
            if (j < ntp) {
                uint32_t pt[ATT_MMA_PTERMS];
                att_split<ATT_MMA_PTERMS>(v[2 * i], v[2 * i + 1], pt);
#pragma unroll
                for (int x = 0; x < ATT_MMA_PTERMS; x++)
                    *reinterpret_cast<uint32_t *>(p_s + (x * ATT_MMA_HEADS + hl) * ATT_MMA_PSTR + j) = pt[x];
            }
        }
        if (q == 0) {
            const float alpha = expf(m_old - m_new);    /* 0 on the first tile (m_old = -inf) */
            l_s[hl] = l_s[hl] * alpha + sum;
            m_s[hl] = m_new;
            al_s[hl] = alpha;
        }
    }
    __syncthreads();
}

/* Phase 4: o = alpha o + P V for the warp's output dims 8 (w + 8 i), i < nown, every m16 tile.
 * Value fragments by ldmatrix.trans from the key tile (keys [keys, dims] row-major is the
 * column-major B the MMA wants for V); probability fragments by ldmatrix from P's terms. A k-step
 * issues term 0's MMAs for all of an m16 tile's n8 tiles, then term 1's: each output's order is the
 * same (term 0, then term 1), and consecutive MMAs do not wait on each other. MTS > 0: the block's
 * m16 tiles are known (mts = MTS) and nown = att_own(W) (head_dim 512: V4's shapes), so no MMA is
 * predicated; predicated ones (MTS = 0, other shapes) let ptxas route every accumulation through one
 * temporary register, which chains them all. */
template <int MT, int MTS, int W>
static __device__ __forceinline__ void att_pv_tiles(float (&o)[MT][att_own(W)][4], int nown, int ntp, int mts,
                                                    const __nv_bfloat16 *k_s, int kstr, const __nv_bfloat16 *p_s,
                                                    const float *al_s)
{
    constexpr bool FULL = MTS > 0;
    constexpr int OWN = att_own(W);
    const int warp = threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP, g = lane / 4;
#pragma unroll
    for (int mt = 0; mt < (FULL ? MTS : MT); mt++) {
        if (FULL || mt < mts) {
            const float aa = al_s[16 * mt + g], ab = al_s[16 * mt + g + 8];
#pragma unroll
            for (int i = 0; i < OWN; i++) {
                o[mt][i][0] *= aa;
                o[mt][i][1] *= aa;
                o[mt][i][2] *= ab;
                o[mt][i][3] *= ab;
            }
        }
    }
    /* matrices (keys +0..7, tile i), (+8..15, tile i), (+0..7, tile i+1), (+8..15, tile i+1) */
    const __nv_bfloat16 *vl = k_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * kstr + 8 * warp;
    const int second = lane >> 4;
    /* matrices (heads +0..7, keys +0..7), (+8..15, +0..7), (+0..7, +8..15), (+8..15, +8..15) */
    const int prow = (lane & 15) * ATT_MMA_PSTR + (lane >> 4) * 8;

    for (int k = 0; k < ntp; k += 16) {
        uint32_t vf[OWN][2];
#pragma unroll
        for (int i = 0; i < OWN; i += 2) {
            if (FULL || i < nown) {
                const int ti = FULL || (second && i + 1 < nown) ? i + second : i;
                uint32_t r[4];
                att_ldsm_x4_trans(r, vl + k * kstr + 8 * W * ti);
                vf[i][0] = r[0];
                vf[i][1] = r[1];
                vf[i + 1][0] = r[2];
                vf[i + 1][1] = r[3];
            }
        }
#pragma unroll
        for (int mt = 0; mt < (FULL ? MTS : MT); mt++) {
            if (FULL || mt < mts) {
                uint32_t pf[ATT_MMA_PTERMS][4];
#pragma unroll
                for (int x = 0; x < ATT_MMA_PTERMS; x++)
                    att_ldsm_x4(pf[x], p_s + (x * ATT_MMA_HEADS + 16 * mt) * ATT_MMA_PSTR + prow + k);
#pragma unroll
                for (int x = 0; x < ATT_MMA_PTERMS; x++)
#pragma unroll
                    for (int i = 0; i < OWN; i++)
                        if (FULL || i < nown)
                            dsv4_mma_bf16(o[mt][i], pf[x], vf[i][0], vf[i][1]);
            }
        }
    }
}

template <int MT, bool QS, int W>
static __device__ __forceinline__ void att_pv(float (&o)[MT][att_own(W)][4], int hd, int ntp, int mts,
                                              const __nv_bfloat16 *k_s, int kstr, const __nv_bfloat16 *p_s,
                                              const float *al_s)
{
    constexpr int OWN = att_own(W);
    const int warp = threadIdx.x / DSV4_CUDA_WARP;
    const int nown = (hd / 8 - warp + W - 1) / W;
    if (nown == OWN && mts == MT)
        att_pv_tiles<MT, MT, W>(o, nown, ntp, mts, k_s, kstr, p_s, al_s);
    else if (QS && nown == OWN && mts == 1)     /* the 16-head split blocks of small batches */
        att_pv_tiles<MT, 1, W>(o, nown, ntp, mts, k_s, kstr, p_s, al_s);
    else
        att_pv_tiles<MT, 0, W>(o, nown, ntp, mts, k_s, kstr, p_s, al_s);
}

/* The shared-memory carve of attention_mma_smem (and of att_qs_smem: q_s past it, q_heads heads). */
struct att_mma_smem_ptrs {
    __nv_bfloat16 *k_s, *p_s, *q_s;
    int q_heads;
    float *s_s, *m_s, *l_s, *al_s;
    const uint8_t **e_s;
};

static __device__ __forceinline__ att_mma_smem_ptrs att_mma_carve(uint8_t *sm, int hd, int q_heads)
{
    att_mma_smem_ptrs p;
    p.k_s = reinterpret_cast<__nv_bfloat16 *>(sm);
    p.s_s = reinterpret_cast<float *>(sm + att_mma_kbytes(hd));
    p.p_s = reinterpret_cast<__nv_bfloat16 *>(p.s_s);
    p.e_s = reinterpret_cast<const uint8_t **>(sm + att_mma_kbytes(hd) + att_mma_spbytes());
    p.m_s = reinterpret_cast<float *>(p.e_s + ATT_MMA_KEYS);
    p.l_s = p.m_s + ATT_MMA_HEADS;
    p.al_s = p.l_s + ATT_MMA_HEADS;
    p.q_s = reinterpret_cast<__nv_bfloat16 *>(sm + att_mma_smem(hd));
    p.q_heads = q_heads;
    return p;
}

/* The block's queries [heads, hd] are contiguous; att_scores reads them a few k-steps at a time, so
 * pull them into L1 first: one round of L2 latency instead of one per batch of k-steps. */
template <int THREADS>
static __device__ __forceinline__ void att_prefetch_q(const struct dsv4_cuda_att_args &a, int b, int h0)
{
    const char *qb = reinterpret_cast<const char *>(a.q + ((int64_t)b * a.H + h0) * a.hd);
    const int lines = (int)(((int64_t)min(a.heads_per_block, a.H - h0) * a.hd * (int)sizeof(float) + 127) / 128);
    for (int i = threadIdx.x; i < lines; i += THREADS)
        dsv4_prefetch_l1(qb + (int64_t)i * 128);
}

/* A block's queries, split once for all of its tiles and warps: head h0 + h's values (d, d + 1) as
 * att_scores splits them, term i at q_s[(i * heads + h) * kstr + d]; heads past H zero (a last
 * tile's zero queries). The first barrier of att_mma_run orders these stores before any read. */
template <int THREADS>
static __device__ __forceinline__ void att_stage_q(const struct dsv4_cuda_att_args &a, int b, int h0, int heads,
                                                   __nv_bfloat16 *q_s)
{
    const int hd = a.hd, kstr = hd + ATT_MMA_KPAD, n = heads * hd / 2;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        const int h = i / (hd / 2), d = 2 * (i % (hd / 2));
        const float2 x = h0 + h < a.H ? __ldg(reinterpret_cast<const float2 *>(a.q + ((int64_t)b * a.H + h0 + h) * hd + d))
                                      : make_float2(0.0f, 0.0f);
        uint32_t t[ATT_MMA_QTERMS];
        att_split<ATT_MMA_QTERMS>(x.x, x.y, t);
#pragma unroll
        for (int j = 0; j < ATT_MMA_QTERMS; j++)
            *reinterpret_cast<uint32_t *>(q_s + (j * heads + h) * kstr + d) = t[j];
    }
}

/* One run [r.k0, r.k1) of row b for the block's heads, from scratch: o, m and l reset, then the run's
 * tiles through phases 1-4. Leaves o (C fragments: heads g, g + 8 of each m16 tile, dims 2t, 2t+1
 * of each n8 tile) and each head's m, l in m_s, l_s (a non-empty run's: valid to every thread on
 * return, att_softmax's last barrier having passed). A split's
 * block runs it once, a whole-row block once per run, so a run's (m, l, o) is the same bits in
 * both. The caller makes sure no thread still reads m_s, l_s from a previous run. Every thread must
 * call it. */
template <int MT, bool QS, int W>
static __device__ __forceinline__ void att_mma_run(const struct dsv4_cuda_att_args &a, int b, int h0, int mts,
                                                   const att_run &r, const att_mma_smem_ptrs &p,
                                                   float (&o)[MT][att_own(W)][4])
{
    const int kstr = a.hd + ATT_MMA_KPAD, tid = threadIdx.x;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < att_own(W); i++)
            o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    if (tid < ATT_MMA_HEADS) {
        p.m_s[tid] = -INFINITY;
        p.l_s[tid] = 0.0f;
    }
    for (int t0 = r.k0; t0 < r.k1; t0 += ATT_MMA_KEYS) {
        const int nt = min(ATT_MMA_KEYS, r.k1 - t0), ntp = (nt + 15) / 16 * 16;
        if (tid < nt)
            p.e_s[tid] = att_entry(a, r, b, t0 + tid);
        __syncthreads();                /* also: the last tile's P V is done with k_s and P */
        att_decode_tile<W * DSV4_CUDA_WARP>(a, p.e_s, nt, ntp, p.k_s, kstr);
        __syncthreads();
        if constexpr (W == ATT_MMA_WIDE_WARPS)
            att_scores_wide<QS>(a, b, h0, ntp, p.k_s, kstr, p.q_s, p.q_heads, p.s_s);
        else
            att_scores_for<QS, ATT_MMA_MT / MT>(a, b, h0, mts, ntp, p.k_s, kstr, p.q_s, p.q_heads, p.s_s);
        __syncthreads();
        att_softmax(nt, ntp, mts, p.s_s, p.p_s, p.m_s, p.l_s, p.al_s);
        att_pv<MT, QS, W>(o, a.hd, ntp, mts, p.k_s, kstr, p.p_s, p.al_s);
    }
}

/* QS: the block's heads_per_block (at most ATT_QS_HEADS) queries staged in shared memory
 * (att_qs_smem), else loaded per k-step. W warps: ATT_MMA_WARPS, or ATT_MMA_WIDE_WARPS for blocks of
 * 16 heads (MT 1), which split each phase's work over twice the warps (att_scores_wide, P V's output
 * dims, the decode's chunks) with the same arithmetic per value: the same bits. MT: the m16 tiles its
 * registers hold (heads_per_block / 16 at most). */
template <bool QS, int W, int MT>
__global__ void __launch_bounds__(W * DSV4_CUDA_WARP, 1)
attention_mma_kernel(const struct dsv4_cuda_att_args a)
{
    static_assert(W == ATT_MMA_WARPS || (W == ATT_MMA_WIDE_WARPS && MT == 1), "wide blocks take one m16 tile");
    constexpr int OWN = att_own(W);
    dsv4_pdl_enter();
    extern __shared__ __align__(16) uint8_t att_sm[];
    const att_mma_smem_ptrs p = att_mma_carve(att_sm, a.hd, a.heads_per_block);
    const int hd = a.hd, b = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * a.heads_per_block, tid = threadIdx.x;
    const int mts = min(a.heads_per_block / 16, (a.H - h0 + 15) / 16);
    const att_run r = att_key_run(a, b, split, gridDim.y);
    float o[MT][OWN][4];

    if (QS && r.k0 < r.k1)
        att_stage_q<W * DSV4_CUDA_WARP>(a, b, h0, a.heads_per_block, p.q_s);
    else if (r.k0 < r.k1)
        att_prefetch_q<W * DSV4_CUDA_WARP>(a, b, h0);
    att_mma_run<MT, QS, W>(a, b, h0, mts, r, p, o);
    __syncthreads();

    /* partials: o (C fragments: heads g, g + 8 of each m16 tile, dims 2t, 2t+1 of each n8 tile), m, l */
    const int warp = tid / DSV4_CUDA_WARP, lane = tid % DSV4_CUDA_WARP, g = lane / 4, t = lane % 4;
    const int nown = (hd / 8 - warp + W - 1) / W;
    float *part = a.part + ((int64_t)b * gridDim.y + split) * a.H * (hd + 2);
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int ha = h0 + 16 * mt + g, hb = ha + 8;
#pragma unroll
        for (int i = 0; i < OWN; i++) {
            if (mt < mts && i < nown && r.k0 < r.k1) {     /* an empty run leaves only m = -inf */
                const int d = 8 * (warp + W * i) + 2 * t;
                if (ha < a.H)
                    *reinterpret_cast<float2 *>(part + (int64_t)ha * (hd + 2) + d) = make_float2(o[mt][i][0], o[mt][i][1]);
                if (hb < a.H)
                    *reinterpret_cast<float2 *>(part + (int64_t)hb * (hd + 2) + d) = make_float2(o[mt][i][2], o[mt][i][3]);
            }
        }
    }
    if (tid < 16 * mts && h0 + tid < a.H) {
        part[(int64_t)(h0 + tid) * (hd + 2) + hd] = p.m_s[tid];
        part[(int64_t)(h0 + tid) * (hd + 2) + hd + 1] = p.l_s[tid];
    }
}

/* grid (B, 1, ceil(H / (16 MT))), for the rows of a prefill chunk: a block takes 16 MT heads of row
 * b and every one of the row's DSV4_CUDA_ATT_SPLITS runs in split order (att_key_run, the partition
 * of the split launch), computes each exactly as a split's block does (att_mma_run: a head's
 * arithmetic is that of any grouping), folds it into (M, L, acc) as the combine folds the partials
 * (att_fold_scales, att_fold_value) and writes the output as the combine does (att_out_pair): the
 * split launch's bits with no partials and no combine launch. A row has at most 2 runs (sliding), 10
 * (CSA: 128 window + 512 picks) or 2 plus one per 8k tokens up to 16 (HCA).
 *
 * Why MT up to 4 (all 64 heads of V4-Flash a block): a tile's entries are decoded once for every head
 * of the block, and the value fragments of P V serve MT m16 tiles, so 64 heads a block decode and
 * load a row's keys once where 16 did four times. The queries come from global memory per k-step
 * (as the split kernel's 64-head blocks load them); o is MT x 32 floats a thread in registers, and
 * the running acc the same count in shared memory, each thread its own words (no conflicts, no
 * barrier): [MT x ATT_MMA_OWN x 4][ATT_MMA_THREADS] f32, after att_mma_smem's carve. A head's fold
 * state (M, L) and a run's scales (ca, cr) are computed once a head by thread h and read by the
 * threads holding its fragments (the function of the same inputs, so the same bits as each thread
 * folding its own copy). One block an SM. Shared memory att_whole_smem(hd, MT). */
static __host__ __device__ size_t att_whole_accbytes(int mt)
{
    return (size_t)mt * ATT_MMA_OWN * 4 * ATT_MMA_THREADS * sizeof(float);
}

static __host__ __device__ size_t att_whole_smem(int hd, int mt)
{
    return att_mma_smem(hd) + att_whole_accbytes(mt) + 4 * ATT_MMA_HEADS * sizeof(float);
}

template <int MT>
__global__ void __launch_bounds__(ATT_MMA_THREADS, 1)
attention_mma_whole_kernel(const struct dsv4_cuda_att_args a, const float *__restrict__ sink,
                           const float *__restrict__ inv_freq, float *__restrict__ out)
{
    dsv4_pdl_enter();
    extern __shared__ __align__(16) uint8_t att_sm[];
    const att_mma_smem_ptrs p = att_mma_carve(att_sm, a.hd, 0);
    float *acc_s = reinterpret_cast<float *>(att_sm + att_mma_smem(a.hd));
    float *M_s = acc_s + att_whole_accbytes(MT) / sizeof(float), *L_s = M_s + ATT_MMA_HEADS;
    float *ca_s = L_s + ATT_MMA_HEADS, *cr_s = ca_s + ATT_MMA_HEADS;
    const int hd = a.hd, b = blockIdx.x, h0 = blockIdx.z * 16 * MT, tid = threadIdx.x;
    const int mts = min(MT, (a.H - h0 + 15) / 16);
    const int warp = tid / DSV4_CUDA_WARP, lane = tid % DSV4_CUDA_WARP, g = lane / 4, t = lane % 4;
    const int nown = (hd / 8 - warp + ATT_MMA_WARPS - 1) / ATT_MMA_WARPS;
    float o[MT][ATT_MMA_OWN][4];

    /* acc word (mt, i, c) of this thread */
#define ACC(mt, i, c) acc_s[(((mt) * ATT_MMA_OWN + (i)) * 4 + (c)) * ATT_MMA_THREADS + tid]
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < ATT_MMA_OWN; i++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                ACC(mt, i, c) = 0.0f;
    /* a head's fold starts from its sink; heads past H (a last tile's zero queries) fold a 0 sink */
    if (tid < 16 * MT) {
        M_s[tid] = h0 + tid < a.H ? sink[h0 + tid] : 0.0f;
        L_s[tid] = 1.0f;
    }
    att_prefetch_q<ATT_MMA_THREADS>(a, b, h0);
#pragma unroll 1
    for (int split = 0; split < DSV4_CUDA_ATT_SPLITS; split++) {
        const att_run r = att_key_run(a, b, split, DSV4_CUDA_ATT_SPLITS);
        if (r.k0 >= r.k1)               /* an empty run: the combine skips its m = -inf */
            continue;
        att_mma_run<MT, false, ATT_MMA_WARPS>(a, b, h0, mts, r, p, o);    /* its barriers also publish M_s, L_s */
        if (tid < 16 * mts)
            att_fold_scales(M_s[tid], L_s[tid], p.m_s[tid], p.l_s[tid], ca_s[tid], cr_s[tid]);
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            if (mt < mts) {
                const float caa = ca_s[16 * mt + g], cra = cr_s[16 * mt + g];
                const float cab = ca_s[16 * mt + g + 8], crb = cr_s[16 * mt + g + 8];
#pragma unroll
                for (int i = 0; i < ATT_MMA_OWN; i++) {
                    ACC(mt, i, 0) = att_fold_value(ACC(mt, i, 0), o[mt][i][0], caa, cra);
                    ACC(mt, i, 1) = att_fold_value(ACC(mt, i, 1), o[mt][i][1], caa, cra);
                    ACC(mt, i, 2) = att_fold_value(ACC(mt, i, 2), o[mt][i][2], cab, crb);
                    ACC(mt, i, 3) = att_fold_value(ACC(mt, i, 3), o[mt][i][3], cab, crb);
                }
            }
        }
        __syncthreads();                /* m_s, l_s, ca_s, cr_s read: the next run may reset them */
    }

    const int ps = a.pos[b];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int ha = h0 + 16 * mt + g, hb = ha + 8;
        if (mt >= mts)
            continue;
        const float La = L_s[16 * mt + g], Lb = L_s[16 * mt + g + 8];
#pragma unroll
        for (int i = 0; i < ATT_MMA_OWN; i++) {
            if (i < nown) {
                const int d = 8 * (warp + ATT_MMA_WARPS * i) + 2 * t;
                if (ha < a.H)
                    *reinterpret_cast<float2 *>(out + ((int64_t)b * a.H + ha) * hd + d) =
                        att_out_pair(ACC(mt, i, 0), ACC(mt, i, 1), La, d, hd, a.rd, inv_freq, ps);
                if (hb < a.H)
                    *reinterpret_cast<float2 *>(out + ((int64_t)b * a.H + hb) * hd + d) =
                        att_out_pair(ACC(mt, i, 2), ACC(mt, i, 3), Lb, d, hd, a.rd, inv_freq, ps);
            }
        }
    }
#undef ACC
}

/* grid (B, H), ATT_COMB_THREADS threads, thread i the output dims (2i, 2i + 1) (a RoPE pair when
 * 2i >= hd - rd): the splits' partials folded in split order from the sink (att_fold_scales), then
 * acc / L and RoPE^-1 at the row's position (att_out_pair). Bound by load latency at small batches
 * (one block per head), so every load a thread needs is issued before any result is waited on: lane
 * s of each warp reads split s's (m, l), and each thread its two values of every split (an empty
 * split writes only its m = -inf: its values are loaded stale with the rest and skipped). */
static_assert(DSV4_CUDA_ATT_SPLITS <= DSV4_CUDA_WARP, "one lane per split");
static_assert(DSV4_CUDA_MAX_HEAD_DIM / 2 <= ATT_COMB_THREADS, "one thread per pair of dims");
__global__ void __launch_bounds__(ATT_COMB_THREADS)
attention_combine_kernel(const float *__restrict__ part, int H, int hd, int rd, const float *__restrict__ sink,
                         const int32_t *__restrict__ pos, const float *__restrict__ inv_freq, float *__restrict__ o)
{
    dsv4_pdl_enter();
    constexpr int S = DSV4_CUDA_ATT_SPLITS;
    const int b = blockIdx.x, h = blockIdx.y, lane = threadIdx.x % DSV4_CUDA_WARP, d = 2 * threadIdx.x;
    const float *p0 = part + ((int64_t)b * S * H + h) * (hd + 2);
    const int64_t sstride = (int64_t)H * (hd + 2);
    float2 pv[S];

    const float ms = lane < S ? p0[lane * sstride + hd] : -INFINITY;
    const float ls = lane < S ? p0[lane * sstride + hd + 1] : 0.0f;
#pragma unroll
    for (int k = 0; k < S; k++)
        pv[k] = d < hd ? *reinterpret_cast<const float2 *>(p0 + k * sstride + d) : make_float2(0.0f, 0.0f);
    const int ps = pos[b];

    float M = sink[h], L = 1.0f, x = 0.0f, y = 0.0f;
#pragma unroll
    for (int k = 0; k < S; k++) {        /* in split order, as the whole kernel folds its runs */
        const float mk = __shfl_sync(0xffffffffu, ms, k), lk = __shfl_sync(0xffffffffu, ls, k);
        if (mk != -INFINITY) {
            float ca, cr;
            att_fold_scales(M, L, mk, lk, ca, cr);
            x = att_fold_value(x, pv[k].x, ca, cr);
            y = att_fold_value(y, pv[k].y, ca, cr);
        }
    }
    if (d < hd)
        *reinterpret_cast<float2 *>(o + ((int64_t)b * H + h) * hd + d) = att_out_pair(x, y, L, d, hd, rd, inv_freq, ps);
}

static size_t att_f32_smem(int hd)
{
    return (size_t)((ATT_HB + ATT_TILE) * (hd + ATT_PAD) + ATT_HB * ATT_TILE + 3 * ATT_HB) * sizeof(float);
}

size_t dsv4_cuda_attention_smem(int hd)
{
    const size_t f = att_f32_smem(hd), m = att_mma_smem(hd);
    return f > m ? f : m;
}

/* For the head_dim last prepared (dsv4_cuda_attention_prepare): the most heads a split block stages
 * the queries of on this device (ATT_QS_HEADS, 16, or 0 where att_qs_smem fits neither), and the m16
 * tiles of a whole-row block (ATT_MMA_MT, 2 or 1: the most whose att_whole_smem fits; 0: none, rows
 * take the splits). */
static int att_qs_heads, att_whole_mt;

/* The whole-row kernel of mt m16 tiles (1, 2 or ATT_MMA_MT), for both its shared-memory attribute
 * and its launch */
typedef void (*att_whole_fn)(const struct dsv4_cuda_att_args, const float *, const float *, float *);
static att_whole_fn att_whole_kernel(int mt)
{
    static_assert(ATT_MMA_MT == 4, "the whole-row kernels are instantiated for 1, 2 and 4 m16 tiles");
    return mt == ATT_MMA_MT ? attention_mma_whole_kernel<ATT_MMA_MT>
           : mt == 2        ? attention_mma_whole_kernel<2>
                            : attention_mma_whole_kernel<1>;
}

/* The split kernel: staged queries or not, wide (16-head blocks) or not */
typedef void (*att_split_fn)(const struct dsv4_cuda_att_args);
static att_split_fn att_split_kernel(bool qs, bool wide)
{
    return wide ? (qs ? attention_mma_kernel<true, ATT_MMA_WIDE_WARPS, 1> : attention_mma_kernel<false, ATT_MMA_WIDE_WARPS, 1>)
                : (qs ? attention_mma_kernel<true, ATT_MMA_WARPS, ATT_MMA_MT>
                      : attention_mma_kernel<false, ATT_MMA_WARPS, ATT_MMA_MT>);
}

int dsv4_cuda_attention_prepare(int hd)
{
    int dev, optin;
    if (hd < ATT_MMA_HD_ALIGN || hd % ATT_MMA_HD_ALIGN || hd > DSV4_CUDA_MAX_HEAD_DIM)
        return dsv4_error_set(-EINVAL, "attention: head_dim %d must be a multiple of %d and at most %d", hd,
                              ATT_MMA_HD_ALIGN, DSV4_CUDA_MAX_HEAD_DIM);
    DSV4_CUDA_TRY(cudaGetDevice(&dev));
    DSV4_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (dsv4_cuda_attention_smem(hd) > (size_t)optin)
        return dsv4_error_set(-ENOTSUP, "attention: head_dim %d needs %zu bytes of shared memory per block, "
                              "device %d allows %d", hd, dsv4_cuda_attention_smem(hd), dev, optin);
    DSV4_CUDA_TRY(cudaFuncSetAttribute(attention_f32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)att_f32_smem(hd)));
    for (att_split_fn f : { att_split_kernel(false, false), att_split_kernel(false, true) })
        DSV4_CUDA_TRY(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)att_mma_smem(hd)));
    att_qs_heads = att_qs_smem(hd, ATT_QS_HEADS) <= (size_t)optin ? ATT_QS_HEADS
                   : att_qs_smem(hd, 16) <= (size_t)optin ? 16 : 0;
    if (att_qs_heads) {
        DSV4_CUDA_TRY(cudaFuncSetAttribute(att_split_kernel(true, false), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)att_qs_smem(hd, att_qs_heads)));
        DSV4_CUDA_TRY(cudaFuncSetAttribute(att_split_kernel(true, true), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)att_qs_smem(hd, 16)));
    }
    att_whole_mt = 0;
    for (int mt : { ATT_MMA_MT, 2, 1 })
        if (!att_whole_mt && att_whole_smem(hd, mt) <= (size_t)optin)
            att_whole_mt = mt;
    for (int mt : { 1, 2, ATT_MMA_MT })
        if (mt <= att_whole_mt)
            DSV4_CUDA_TRY(cudaFuncSetAttribute(att_whole_kernel(mt), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)att_whole_smem(hd, mt)));
    return 0;
}

/* The shapes and alignment each kernel relies on; -EINVAL with what to change. */
static int att_check(const struct dsv4_cuda_att_args *a)
{
    const int hd = a->hd, rd = a->rd;
    if (a->H < 1 || hd < 1 || hd > DSV4_CUDA_MAX_HEAD_DIM || rd < 2 || rd % 2 || rd > hd)
        return dsv4_error_set(-EINVAL, "attention: %d heads of head_dim %d (max %d) with rope dims %d", a->H, hd,
                              DSV4_CUDA_MAX_HEAD_DIM, rd);
    if (a->kvf != DSV4_KV_F32 && a->kvf != DSV4_KV_FP8)
        return dsv4_error_set(-EINVAL, "attention: unknown KV entry format %d", a->kvf);
    if (a->entry_bytes != dsv4_cuda_kv_entry_bytes(hd, rd, a->kvf))
        return dsv4_error_set(-EINVAL, "attention: entries of %d bytes, format %d at head_dim %d rope %d has %d",
                              a->entry_bytes, a->kvf, hd, rd, dsv4_cuda_kv_entry_bytes(hd, rd, a->kvf));
    if (a->window < 1 || a->ring < a->window)
        return dsv4_error_set(-EINVAL, "attention: ring of %d entries for a window of %d", a->ring, a->window);
    if (a->kvf == DSV4_KV_F32) {
        if (hd % ATT_F32_HD_ALIGN)
            return dsv4_error_set(-EINVAL, "attention (f32 entries): head_dim %d must be a multiple of %d", hd,
                                  ATT_F32_HD_ALIGN);
        return 0;
    }
    if (hd % ATT_MMA_HD_ALIGN || rd % ATT_MMA_RD_ALIGN)
        return dsv4_error_set(-EINVAL, "attention (FP8 entries): head_dim %d must be a multiple of %d and rope "
                              "dims %d of %d", hd, ATT_MMA_HD_ALIGN, rd, ATT_MMA_RD_ALIGN);
    if (a->heads_per_block != 0 && a->heads_per_block != 16 && a->heads_per_block != 32 &&
        a->heads_per_block != ATT_MMA_HEADS)
        return dsv4_error_set(-EINVAL, "attention (FP8 entries): %d heads a block; 16, 32 or %d (0: by batch)",
                              a->heads_per_block, ATT_MMA_HEADS);
    if ((uintptr_t)a->q % sizeof(float2) || (uintptr_t)a->part % sizeof(float2) ||
        (uintptr_t)a->win % ATT_MMA_ENTRY_ALIGN || a->win_slot_stride % ATT_MMA_ENTRY_ALIGN ||
        (a->ratio && ((uintptr_t)a->comp % ATT_MMA_ENTRY_ALIGN || a->comp_slot_stride % ATT_MMA_ENTRY_ALIGN)))
        return dsv4_error_set(-EINVAL, "attention (FP8 entries): queries and partials must be 8-byte aligned, "
                              "entry caches and their slot strides multiples of %d bytes", ATT_MMA_ENTRY_ALIGN);
    return 0;
}

/* Heads a block of the FP8 kernel takes: the caller's, else DSV4_CUDA_ATT_HEADS, else by batch:
 * the largest of 64, 32, 16 that still gives every split of every row ATT_MIN_GROUPS blocks (at
 * V4-Flash's 64 heads: 16 at batch 1, 32 at 2-3, 64 from 4). */
#define ATT_MIN_GROUPS 4
static int att_heads_per_block(const struct dsv4_cuda_att_args *a, int batch)
{
    static int forced = -1;
    if (a->heads_per_block)
        return a->heads_per_block;
    if (forced < 0) {
        struct dsv4_cuda_switches sw;
        forced = dsv4_cuda_switches_read(&sw) < 0 ? 0 : sw.att_heads;
    }
    if (forced)
        return forced;
    for (int g = ATT_MMA_HEADS; g > 16; g /= 2)
        if ((int64_t)batch * ((a->H + g - 1) / g) >= ATT_MIN_GROUPS)
            return g;
    return 16;
}

/* Whether a launch asking for whole rows (a->whole) gets them: DSV4_CUDA_ATT_WHOLE=0 keeps the
 * splits and their combine for every launch, to compare the two; a device whose blocks cannot hold
 * att_whole_smem(hd, 1) keeps them too (the same bits either way). */
static bool att_whole_allowed(void)
{
    static int allowed = -1;
    if (allowed < 0) {
        struct dsv4_cuda_switches sw;
        allowed = dsv4_cuda_switches_read(&sw) < 0 ? 1 : sw.att_whole;
    }
    return allowed && att_whole_mt > 0;
}

int dsv4_cuda_attention_whole_heads(void)
{
    return att_whole_allowed() ? 16 * att_whole_mt : 0;
}

bool dsv4_cuda_attention_whole(const struct dsv4_cuda_att_args *a)
{
    return a->kvf == DSV4_KV_FP8 && a->whole && att_whole_allowed();
}

int dsv4_cuda_attention(const struct dsv4_cuda_att_args *a, int batch, const float *d_sink,
                        const float *d_inv_freq, float *d_o, void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    int rc;
    if (batch < 1)
        return 0;
    if ((rc = att_check(a)) < 0)
        return rc;
    if ((uintptr_t)a->part % sizeof(float2) || (uintptr_t)d_o % sizeof(float2))
        return dsv4_error_set(-EINVAL, "attention: the partials and the output must be 8-byte aligned");
    if (a->own && (!dsv4_cuda_attention_whole(a) || !a->first || (uintptr_t)a->own % ATT_MMA_ENTRY_ALIGN))
        return dsv4_error_set(-EINVAL, "attention: the step's own entries are read by whole rows only, with "
                              "each row's first position, %d-byte aligned", ATT_MMA_ENTRY_ALIGN);
    if (dsv4_cuda_attention_whole(a)) {
        /* the caller's grouping (a test's), at most what the device holds; else the most it holds */
        const int want = a->heads_per_block ? a->heads_per_block / 16 : ATT_MMA_MT;
        const int mt = want < att_whole_mt ? want : att_whole_mt;
        struct dsv4_cuda_att_args k = *a;
        k.heads_per_block = 16 * mt;
        const dim3 grid(batch, 1, (a->H + k.heads_per_block - 1) / k.heads_per_block);
        const size_t smem = att_whole_smem(a->hd, mt);
        dsv4_launch(att_whole_kernel(mt), grid, ATT_MMA_THREADS, smem, s, k, d_sink, d_inv_freq, d_o);
        DSV4_CUDA_LAUNCHED("attention_mma_whole");
        dsv4_cuda_count_launch(DSV4_CUDA_V_ATTENTION_WHOLE);
        return 0;
    }
    if (a->kvf == DSV4_KV_FP8) {
        struct dsv4_cuda_att_args k = *a;
        k.heads_per_block = att_heads_per_block(a, batch);
        const bool qs = k.heads_per_block <= att_qs_heads;     /* the same bits either way */
        const bool wide = k.heads_per_block == 16;             /* and so */
        dsv4_launch(att_split_kernel(qs, wide),
                    dim3(batch, DSV4_CUDA_ATT_SPLITS, (a->H + k.heads_per_block - 1) / k.heads_per_block),
                    (wide ? ATT_MMA_WIDE_WARPS : ATT_MMA_WARPS) * DSV4_CUDA_WARP,
                    qs ? att_qs_smem(a->hd, k.heads_per_block) : att_mma_smem(a->hd), s, k);
        DSV4_CUDA_LAUNCHED("attention_mma");
        dsv4_cuda_count_launch(DSV4_CUDA_V_ATTENTION_MMA);
    } else {
        dsv4_launch(attention_f32_kernel, dim3(batch, DSV4_CUDA_ATT_SPLITS, (a->H + ATT_HB - 1) / ATT_HB), ATT_THREADS,
                    att_f32_smem(a->hd), s, *a);
        DSV4_CUDA_LAUNCHED("attention_f32");
        dsv4_cuda_count_launch(DSV4_CUDA_V_ATTENTION_F32);
    }
    dsv4_launch(attention_combine_kernel, dim3(batch, a->H), ATT_COMB_THREADS, 0, s, a->part, a->H, a->hd, a->rd,
                d_sink, a->pos, d_inv_freq, d_o);
    DSV4_CUDA_LAUNCHED("attention_combine");
    return 0;
}

/* For C callers (tests/gpu/test_gpu_attention.c; kernels_internal.h has C++ linkage): prepare for
 * a->hd, then dsv4_cuda_attention. Not for use under graph capture. */
extern "C" int dsv4_cuda_attention_once(const struct dsv4_cuda_att_args *a, int batch, const float *d_sink,
                                        const float *d_inv_freq, float *d_o, void *stream)
{
    const int rc = dsv4_cuda_attention_prepare(a->hd);
    return rc < 0 ? rc : dsv4_cuda_attention(a, batch, d_sink, d_inv_freq, d_o, stream);
}

/* One block per row: encode into a scratch entry in shared memory, decode back. */
__global__ void kv_entry_roundtrip_kernel(const float *x, int hd, int rd, int kvf, int eb, float *y)
{
    dsv4_pdl_enter();
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
    dsv4_launch(kv_entry_roundtrip_kernel, rows, 128, smem, static_cast<cudaStream_t>(stream), d_x, hd, rd, kv_format,
                eb, d_y);
    DSV4_CUDA_LAUNCHED("kv_entry_roundtrip");
    return 0;
}
