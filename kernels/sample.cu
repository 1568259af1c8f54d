/* SPDX-License-Identifier: MIT */
/* Sampling on the device (kernels/sample.h), engine/serve/sampler.c step by step.
 *
 * Work split: each row is a thread block cluster of C blocks (C = 16, 8, 4, 2 or 1 by the launch's
 * row count, so the chip stays full; 16 only where the device allows clusters past the portable 8,
 * as the H200 does; one block where the running image predates clusters). A row is
 * read in "tiles": SAMPLE_TILES contiguous runs of ids, split evenly over the row's blocks; tile t of
 * a block is handled by warp t % SAMPLE_WARPS, each lane loading 4 consecutive logits a step (16-byte
 * loads, a warp covers 128 ids). Reductions go over warps, then over the row's blocks through
 * distributed shared memory. Every quantity that is summed is an integer (probabilities in 2^-41
 * fixed point, counts), and the others are max / min, so a row's result is exact for any split: the
 * same bits whatever C, the batch, or the order in which blocks run.
 *
 * The passes over a row:
 *   1. validity, max of the raw logits, max and argmax of the working logits l (penalties and
 *      temperature applied on the fly, sampler.c's float operations);
 *   2. the raw row's sum of expf(x - max) (log-sum-exp for logprobs) and coarse histograms:
 *      bin = (max - logit) * 64, 2048 bins, token count and mass per bin;
 *   3. (top-n / top_k / top_p) gather the tokens of the bin where the count or mass crosses its
 *      target into block 0's shared memory, sort them there by key (each block a copy) and read the
 *      exact boundary; a bin too large for the list is searched bit by bit over the row instead;
 *   4. (sampled rows) tile sums of the kept mass (in pass 2 for rows without top_k / top_p), a
 *      scan over tiles, then one warp walks the tile holding u * mass in ascending id.
 * Rank order is the composite key (float order of the value << 32 | ~id): larger value first, then
 * lower id, exactly sampler.c's ranks_before. */
#include "kernels/cuda_util.cuh"
#include "kernels/sample.h"

#include <atomic>

#include <cooperative_groups.h>

#ifndef SAMPLE_THREADS
#define SAMPLE_THREADS 512              /* per block */
#endif
#ifndef SAMPLE_UNROLL
#define SAMPLE_UNROLL 4                 /* 16-byte loads in flight per thread */
#endif
#define SAMPLE_WARPS (SAMPLE_THREADS / DSV4_CUDA_WARP)
#define SAMPLE_STEP (DSV4_CUDA_WARP * 4)        /* ids a warp covers per load step */
#define SAMPLE_TILES 1024                       /* tiles per row, all blocks together */
#define SAMPLE_CLUSTER_MAX 16                   /* blocks per row where non-portable clusters are allowed */
#define SAMPLE_CLUSTER_PORTABLE 8               /* blocks per row elsewhere: the portable cluster size */
#define SAMPLE_BINS 2048
#define SAMPLE_BINS_PER_LOGIT 64.0f             /* 2048 bins cover 32 logits below the max */
#define SAMPLE_LIST DSV4_SAMPLE_LIST_MAX        /* sampling boundary-bin keys (a power of two) */
#define SAMPLE_RLIST 2048                       /* raw top-n candidate keys (a power of two) */
#define SAMPLE_FX_SCALE 2199023255552.0f        /* 2^41: p in [0, 1] -> fixed point; V * 2^41 < 2^64 */
#define SAMPLE_FX_LN 28.41902861118636          /* ln 2^41 */
#define SAMPLE_RED 6                            /* values one row reduction carries */
#define SAMPLE_NONE 0x7fffffff
#define SAMPLE_FULL 0xffffffffu

static_assert(SAMPLE_BINS % SAMPLE_THREADS == 0, "bins split evenly over threads");
static_assert(SAMPLE_LIST % SAMPLE_THREADS == 0 && (SAMPLE_LIST & (SAMPLE_LIST - 1)) == 0, "list size");
static_assert((SAMPLE_RLIST & (SAMPLE_RLIST - 1)) == 0, "raw list size");
static_assert(SAMPLE_TILES <= 2 * SAMPLE_THREADS, "the tile scan takes two tiles a thread");
static_assert(DSV4_SAMPLER_VOCAB_MAX <= (1 << 22), "ids fit the key's low word; V * 2^41 fits 64 bits");

struct sample_smem {
    uint64_t list[SAMPLE_LIST];         /* sampling candidates: keys of l */
    uint64_t rlist[SAMPLE_RLIST];       /* top-n candidates: keys of the raw logits */
    uint64_t hmass[SAMPLE_BINS];        /* fixed-point mass of l per coarse bin */
    uint32_t hcnt[SAMPLE_BINS];         /* tokens of l per coarse bin */
    uint32_t rcnt[SAMPLE_BINS];         /* tokens of the raw logits per coarse bin */
    uint64_t tile[SAMPLE_TILES];        /* kept mass per tile of this block (the draw) */
    uint64_t red[SAMPLE_RED][SAMPLE_WARPS];     /* per-warp values of a reduction or scan */
    uint64_t cl[SAMPLE_RED];            /* this block's values of a row reduction, read by the others */
    int32_t n_list, n_rlist;            /* gathered counts (block 0's count the row) */
    int32_t found;                      /* index found by a scan (bin, list entry, tile) */
    uint64_t found_acc;                 /* running sum through it */
    int32_t token;                      /* the drawn token */
};
static_assert(sizeof(struct sample_smem) <= DSV4_SAMPLE_SMEM_BYTES, "fits the advertised shared memory");

/* A row as one block sees it (uniform over the block; the same in every block of the row except
 * rank and the tile range). */
struct row_ctx {
    const float *x;                     /* [V] raw logits */
    const uint32_t *counts, *seen;      /* the slot's history rows, or NULL */
    int V, tile_w, ntiles;              /* tile_w: ids per tile, a multiple of SAMPLE_STEP */
    int C, rank, t_begin, t_end;        /* blocks of the row, this one's rank and tiles */
    bool rep, freq, scale;              /* step 2, step 3, step 5 active */
    float rp, fp, pp, inv_t;
    float m_raw, m_l;                   /* maxima after pass 1 */
};

/* ---- keys and numbers ---- */

/* Float -> unsigned key in the same order (sampler.c's float_key); and back. */
static __device__ __forceinline__ uint32_t fkey(float f)
{
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

static __device__ __forceinline__ float fkey_value(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

/* Rank key: larger value first, then lower id. -0 is keyed as +0 (adding +0 makes it so): they are
 * equal, so the lower id ranks first, as on the host (sampler.c's sort_best_first). */
static __device__ __forceinline__ uint64_t rank_key(float v, int id)
{
    return ((uint64_t)fkey(v + 0.0f) << 32) | (uint32_t)~(uint32_t)id;
}

static __device__ __forceinline__ float key_value(uint64_t k) { return fkey_value((uint32_t)(k >> 32)); }
static __device__ __forceinline__ int key_id(uint64_t k) { return (int)~(uint32_t)k; }

/* Coarse bin of value v below the maximum m: monotone (a larger v never lands in a later bin); -inf
 * and everything 32 logits down share the last bin. */
static __device__ __forceinline__ int coarse_bin(float m, float v)
{
    const float d = __fmul_rn(__fsub_rn(m, v), SAMPLE_BINS_PER_LOGIT);
    return d < (float)(SAMPLE_BINS - 1) ? (int)d : SAMPLE_BINS - 1;
}

/* Step 7's probability exp(l - max) (CUDA's expf), and its fixed-point mass. */
static __device__ __forceinline__ float prob(float l, float m) { return expf(__fsub_rn(l, m)); }

static __device__ __forceinline__ uint64_t fixed_mass(float p)
{
    return p > 0.0f ? __float2ull_rn(__fmul_rn(fminf(p, 1.0f), SAMPLE_FX_SCALE)) : 0;
}

/* ceil(f * z) exactly for f in [0, 1) as a float (24-bit mantissa times a power of two). */
static __device__ uint64_t ceil_mul(float f, uint64_t z)
{
    const uint32_t u = __float_as_uint(f), e = (u >> 23) & 0xff;
    const uint64_t mant = e ? (u & 0x7fffffu) | 0x800000u : u & 0x7fffffu;
    const int sh = 150 - (int)(e ? e : 1);      /* f = mant * 2^-sh, sh >= 24 for f < 1 */
    const uint64_t lo = mant * z, hi = __umul64hi(mant, z);
    if (!(f > 0.0f) || !mant)
        return 0;
    if (sh >= 128)
        return 1;
    uint64_t q, rest;
    if (sh >= 64) {
        q = hi >> (sh - 64);
        rest = (hi & ((1ull << (sh - 64)) - 1)) | lo;
    } else {
        q = (lo >> sh) | (hi << (64 - sh));
        rest = lo & ((1ull << sh) - 1);
    }
    return q + (rest != 0);
}

/* engine/serve/philox.c on the device: same constants, rounds and 53-bit construction; returns the 53
 * random bits (u = bits / 2^53). */
static __device__ uint64_t philox_bits53(uint64_t seed, uint64_t index)
{
    uint32_t c0 = (uint32_t)index, c1 = (uint32_t)(index >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n1 = (uint32_t)p1;
        const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1, n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return ((uint64_t)(c0 >> 5) << 26) | (c1 >> 6);
}

/* ---- the row's blocks ---- */

/* Barrier over the row's blocks (the cluster; the block itself where clusters do not exist). */
static __device__ __forceinline__ void row_sync(const row_ctx &r)
{
#if __CUDA_ARCH__ >= 900
    if (r.C > 1) {
        cooperative_groups::this_cluster().sync();
        return;
    }
#endif
    __syncthreads();
}

/* p, a shared-memory address of this block, in the block of rank `rank` of the row. */
template <typename T>
static __device__ __forceinline__ T *row_smem(const row_ctx &r, T *p, int rank)
{
#if __CUDA_ARCH__ >= 900
    if (r.C > 1)
        return cooperative_groups::this_cluster().map_shared_rank(p, (unsigned)rank);
#endif
    return p;
}

enum red_op { RED_ADD, RED_MAX, RED_MIN };

static __device__ __forceinline__ uint64_t red_apply(red_op op, uint64_t a, uint64_t b)
{
    return op == RED_ADD ? a + b : op == RED_MAX ? (a > b ? a : b) : (a < b ? a : b);
}

/* Reduce N values (N <= SAMPLE_RED) over the row: a butterfly in each warp, the warps in order, then
 * the row's blocks in rank order. Integer sums, max and min: exact whatever the split. */
template <int N>
static __device__ void row_reduce(sample_smem &S, const row_ctx &r, uint64_t (&v)[N], const red_op (&op)[N])
{
    static_assert(N <= SAMPLE_RED, "reduction scratch");
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
#pragma unroll
    for (int j = 0; j < N; j++)
        for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1)
            v[j] = red_apply(op[j], v[j], __shfl_xor_sync(SAMPLE_FULL, v[j], o));
    __syncthreads();
    if (lane == 0)
        for (int j = 0; j < N; j++)
            S.red[j][warp] = v[j];
    __syncthreads();
    for (int j = 0; j < N; j++) {
        uint64_t x = S.red[j][0];
        for (int w = 1; w < SAMPLE_WARPS; w++)
            x = red_apply(op[j], x, S.red[j][w]);
        v[j] = x;
    }
    if (r.C == 1)
        return;
    if (threadIdx.x == 0)
        for (int j = 0; j < N; j++)
            S.cl[j] = v[j];
    row_sync(r);
    for (int j = 0; j < N; j++) {
        uint64_t x = *row_smem(r, &S.cl[j], 0);
        for (int q = 1; q < r.C; q++)
            x = red_apply(op[j], x, *row_smem(r, &S.cl[j], q));
        v[j] = x;
    }
    row_sync(r);        /* every block read every block's values before they change */
}

/* ---- block-wide helpers (every thread of the block calls them, in the same order) ---- */

/* Inclusive scan over a warp's lanes (integers: exact). */
static __device__ __forceinline__ uint64_t warp_incl_scan(uint64_t v)
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    for (int o = 1; o < DSV4_CUDA_WARP; o <<= 1) {
        const uint64_t y = __shfl_up_sync(SAMPLE_FULL, v, o);
        if (lane >= o)
            v += y;
    }
    return v;
}

/* Exclusive scan over the block in thread order; *total gets the sum. scratch: [SAMPLE_WARPS]. */
static __device__ uint64_t block_excl_scan(uint64_t v, uint64_t *scratch, uint64_t *total)
{
    const int warp = threadIdx.x / DSV4_CUDA_WARP;
    const uint64_t incl = warp_incl_scan(v);
    __syncthreads();
    if (threadIdx.x % DSV4_CUDA_WARP == DSV4_CUDA_WARP - 1)
        scratch[warp] = incl;
    __syncthreads();
    uint64_t before = 0, sum = 0;
    for (int w = 0; w < SAMPLE_WARPS; w++) {
        before += w < warp ? scratch[w] : 0;
        sum += scratch[w];
    }
    *total = sum;
    return before + incl - v;
}

/* ---- reading a row ---- */

/* Logits v0..v0+3 as loaded (past V: 0). */
static __device__ __forceinline__ float4 load_raw4(const row_ctx &r, int v0)
{
    if (v0 + 4 <= r.V)
        return __ldg(reinterpret_cast<const float4 *>(r.x + v0));
    float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (v0 < r.V)
        q.x = __ldg(r.x + v0);
    if (v0 + 1 < r.V)
        q.y = __ldg(r.x + v0 + 1);
    if (v0 + 2 < r.V)
        q.z = __ldg(r.x + v0 + 2);
    return q;
}

/* Call f(tile, v0, q) for every load step of this block's tiles, q the 4 raw logits at v0: warp w
 * takes the block's tiles w, w + SAMPLE_WARPS, ...; within a tile, steps of SAMPLE_STEP ids in
 * ascending order, so each thread meets its ids in ascending order. The loads of SAMPLE_UNROLL steps
 * are issued before any is used (the row streams from L2 or HBM: latency needs bytes in flight).
 * Uniform per warp (lanes past V still call f, with v0 >= V), so f may use warp collectives. */
template <typename F>
static __device__ __forceinline__ void for_each_step(const row_ctx &r, F &&f)
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    const int spt = r.tile_w / SAMPLE_STEP;     /* steps per tile: 1 up to V = 131072 */
    const int nsteps = max(0, (r.t_end - r.t_begin - warp + SAMPLE_WARPS - 1) / SAMPLE_WARPS) * spt;
    /* step k: tile t_begin + warp + (k / spt) * SAMPLE_WARPS, step k % spt of it */
    auto step_v0 = [&](int k, int *t) {
        const int kt = spt == 1 ? k : k / spt, ks = spt == 1 ? 0 : k - kt * spt;
        *t = r.t_begin + warp + kt * SAMPLE_WARPS;
        return *t * r.tile_w + ks * SAMPLE_STEP + lane * 4;
    };
    for (int k0 = 0; k0 < nsteps; k0 += SAMPLE_UNROLL) {
        float4 q[SAMPLE_UNROLL];
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; u++) {
            int t;
            const int v0 = step_v0(k0 + u, &t);
            q[u] = k0 + u < nsteps ? load_raw4(r, v0) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; u++) {
            int t;
            const int v0 = step_v0(k0 + u, &t);
            if (k0 + u < nsteps)
                f(t, v0, q[u]);
        }
    }
}

/* The logits v0..v0+3 (n of them below V, returned) from their raw values q: raw x and working l.
 * Steps 2, 3 and 5 with sampler.c's float operations, each rounded on its own (no contraction).
 * counts is read only where seen is set. */
static __device__ __forceinline__ int load4(const row_ctx &r, int v0, const float4 &q, float (&x)[4], float (&l)[4])
{
    const int n = min(4, max(0, r.V - v0));
    x[0] = q.x;
    x[1] = q.y;
    x[2] = q.z;
    x[3] = q.w;
#pragma unroll
    for (int i = 0; i < 4; i++)
        l[i] = x[i];
    if (n > 0 && (r.rep || r.freq)) {
        const uint32_t bits = __ldg(r.seen + (v0 >> 5)) >> (v0 & 31);     /* v0 % 4 == 0: one word */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (i >= n || !((bits >> i) & 1u))
                continue;
            if (r.rep)
                l[i] = l[i] > 0.0f ? __fdiv_rn(l[i], r.rp) : __fmul_rn(l[i], r.rp);
            if (r.freq) {
                const uint32_t c = __ldg(r.counts + v0 + i);
                if (c)
                    l[i] = __fsub_rn(l[i], __fadd_rn(__fmul_rn(__uint2float_rn(c), r.fp), r.pp));
            }
        }
    }
    if (r.scale) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            l[i] = __fmul_rn(l[i], r.inv_t);
    }
    return n;
}

/* ---- gathering candidates into block 0 ---- */

/* Append up to 4 keys per lane (want[i]) to list[0..cap) at *count (block 0's, possibly through
 * distributed shared memory), one atomic per warp step; *count keeps counting past cap so the
 * overflow shows. Called by all 32 lanes. */
static __device__ __forceinline__ void warp_append(uint64_t *list, int cap, int32_t *count, const bool (&want)[4],
                                                   const uint64_t (&key)[4])
{
    const int lane = threadIdx.x % DSV4_CUDA_WARP;
    const int mine = want[0] + want[1] + want[2] + want[3];
    const int incl = (int)warp_incl_scan((uint64_t)mine);
    const int total = __shfl_sync(SAMPLE_FULL, incl, DSV4_CUDA_WARP - 1);
    if (!total)
        return;
    int base = 0;
    if (lane == DSV4_CUDA_WARP - 1)
        base = atomicAdd(count, total);
    int at = __shfl_sync(SAMPLE_FULL, base, DSV4_CUDA_WARP - 1) + incl - mine;
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (want[i]) {
            if (at < cap)
                list[at] = key[i];
            at++;
        }
}

/* Before a gather: block 0's count of each list gathered starts at 0 (the other list keeps its
 * candidates). */
static __device__ void gather_begin(sample_smem &S, const row_ctx &r, bool list, bool rlist)
{
    if (r.rank == 0 && threadIdx.x == 0) {
        if (list)
            S.n_list = 0;
        if (rlist)
            S.n_rlist = 0;
    }
    row_sync(r);
}

/* After a gather into block 0: every block takes the row's counts and a copy of each list that fit
 * (list / rlist chosen by the flags), so all blocks select from the same keys. */
static __device__ void gather_end(sample_smem &S, const row_ctx &r, bool list, bool rlist)
{
    row_sync(r);
    if (r.C == 1)
        return;
    const int n = *row_smem(r, &S.n_list, 0), rn = *row_smem(r, &S.n_rlist, 0);
    if (r.rank != 0) {
        if (list && n <= SAMPLE_LIST)
            for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS)
                S.list[i] = *row_smem(r, &S.list[i], 0);
        if (rlist && rn <= SAMPLE_RLIST)
            for (int i = threadIdx.x; i < rn; i += SAMPLE_THREADS)
                S.rlist[i] = *row_smem(r, &S.rlist[i], 0);
    }
    row_sync(r);        /* block 0 keeps its list unchanged until every copy is made */
    if (r.rank != 0 && threadIdx.x == 0) {
        if (list)
            S.n_list = n;
        if (rlist)
            S.n_rlist = rn;
    }
    __syncthreads();
}

/* ---- selection ---- */

/* Sort keys a[0..n) descending (bitonic, padded to a power of two with key 0, below every real key). */
static __device__ void sort_desc(uint64_t *a, int n)
{
    int p = 1;
    while (p < n)
        p <<= 1;
    for (int i = n + threadIdx.x; i < p; i += SAMPLE_THREADS)
        a[i] = 0;
    __syncthreads();
    for (int k = 2; k <= p; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < p; i += SAMPLE_THREADS) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const uint64_t u = a[i], w = a[ixj];
                    if ((i & k) == 0 ? u < w : u > w) {
                        a[i] = w;
                        a[ixj] = u;
                    }
                }
            }
            __syncthreads();
        }
}

/* Coarse bins in rank order: the first bin b whose running weight (bins 0..b) reaches target, by
 * mass (by_mass) or count. Bins after cap_bin weigh nothing and cap_bin weighs cap_c / cap_m (the
 * part of it a previous selection kept); cap_bin >= SAMPLE_BINS: no cap. Returns SAMPLE_NONE when
 * the total falls short; *before_c / *before_m: count and mass of the bins before b; *total_m: the
 * whole (capped) mass. mass NULL: no masses (raw bins). */
static __device__ int bin_find(sample_smem &S, const uint32_t *cnt, const uint64_t *mass, bool by_mass,
                               uint64_t target, int cap_bin, uint64_t cap_c, uint64_t cap_m, uint64_t *before_c,
                               uint64_t *before_m, uint64_t *total_m)
{
    constexpr int per = SAMPLE_BINS / SAMPLE_THREADS;
    const int b0 = threadIdx.x * per;
    uint64_t wc[per], wm[per], sc = 0, sm = 0;
#pragma unroll
    for (int i = 0; i < per; i++) {
        const int b = b0 + i;
        wc[i] = b > cap_bin ? 0 : b == cap_bin ? cap_c : cnt[b];
        wm[i] = !mass || b > cap_bin ? 0 : b == cap_bin ? cap_m : mass[b];
        sc += wc[i];
        sm += wm[i];
    }
    uint64_t tc, tm;
    uint64_t ac = block_excl_scan(sc, S.red[0], &tc);
    uint64_t am = block_excl_scan(sm, S.red[1], &tm);
    if (threadIdx.x == 0)
        S.found = SAMPLE_NONE;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < per; i++) {
        const uint64_t acc = by_mass ? am : ac, w = by_mass ? wm[i] : wc[i];
        if (acc < target && acc + w >= target) {
            S.found = b0 + i;
            S.red[2][0] = ac;
            S.red[2][1] = am;
        }
        ac += wc[i];
        am += wm[i];
    }
    __syncthreads();
    const int b = S.found;
    *before_c = b == SAMPLE_NONE ? 0 : S.red[2][0];
    *before_m = b == SAMPLE_NONE ? 0 : S.red[2][1];
    *total_m = tm;
    return b;
}

/* Over sorted keys a[0..n) (best first), weights w(key): the first index i where
 * base + sum_{j <= i} w(a[j]) >= target, or i == stop, whichever comes first; *acc gets that running
 * sum. n <= SAMPLE_LIST; SAMPLE_NONE for n == 0. */
template <typename W>
static __device__ int list_find(sample_smem &S, const uint64_t *a, int n, W wfn, uint64_t base, uint64_t target,
                                int stop, uint64_t *acc)
{
    constexpr int per = SAMPLE_LIST / SAMPLE_THREADS;
    const int i0 = threadIdx.x * per;
    uint64_t w[per], sum = 0, total;
#pragma unroll
    for (int k = 0; k < per; k++) {
        w[k] = i0 + k < n ? wfn(a[i0 + k]) : 0;
        sum += w[k];
    }
    uint64_t run = base + block_excl_scan(sum, S.red[0], &total);
    if (threadIdx.x == 0)
        S.found = SAMPLE_NONE;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < per; k++) {
        const int i = i0 + k;
        const bool prev_hit = i > 0 && (run >= target || i - 1 >= stop);
        run += w[k];
        if (i < n && !prev_hit && (run >= target || i >= stop)) {
            S.found = i;
            S.found_acc = run;
        }
    }
    __syncthreads();
    *acc = S.found_acc;
    return S.found;
}

/* The fallback when a boundary bin holds more tokens than the shared lists: among the tokens of
 * coarse bin b (of the raw logits if RAW, else of l) with key >= floor, find the key where the
 * running count (or fixed-point mass, if by_mass) in rank order first reaches target, by a bitwise
 * search over the 64-bit key, two bits a pass over the row, from the highest bit where the bin's
 * keys differ; it stops once one token is left in the range. Returns a threshold t with
 * {key >= t} = exactly the tokens up to and including that one (t >= the bin's smallest key, so no
 * token of a later bin passes), and in *mass_ge the mass of the bin's tokens with key >= t. */
template <bool RAW>
static __device__ uint64_t select_bitwise(sample_smem &S, const row_ctx &r, int b, uint64_t floor, bool by_mass,
                                          uint64_t target, uint64_t *mass_ge)
{
    const float m = RAW ? r.m_raw : r.m_l;
    auto member = [&](float x, float l, int v, uint64_t *key, uint64_t *w) {
        const float val = RAW ? x : l;
        *key = rank_key(val, v);
        *w = RAW ? 0 : fixed_mass(prob(l, m));
        return coarse_bin(m, val) == b && *key >= floor;
    };
    uint64_t st[4] = { ~0ull, 0, 0, 0 };        /* min key, max key, count, mass */
    for_each_step(r, [&](int, int v0, const float4 &q) {
        float x[4], l[4];
        const int n = load4(r, v0, q, x, l);
        for (int i = 0; i < n; i++) {
            uint64_t key, w;
            if (member(x[i], l[i], v0 + i, &key, &w)) {
                st[0] = min(st[0], key);
                st[1] = max(st[1], key);
                st[2]++;
                st[3] += w;
            }
        }
    });
    row_reduce(S, r, st, { RED_MIN, RED_MAX, RED_ADD, RED_ADD });
    const uint64_t kmin = st[0], kmax = st[1];
    if (kmin >= kmax) {         /* one token (or none) */
        *mass_ge = st[3];
        return kmax;
    }
    const int hb = 63 - __clzll((long long)(kmin ^ kmax));
    uint64_t t = kmax & ~((2ull << hb) - 1);    /* common prefix; hb == 63: 2 << 63 wraps to 0 */
    uint64_t wc = st[2], wm = st[3], up_c = 0;  /* count and mass >= t; count >= the range's end */
    for (int s = hb; s >= 0 && wc - up_c > 1; s -= 2) {
        const int lo = s > 0 ? s - 1 : 0, nc = s > 0 ? 3 : 1;
        uint64_t c[6] = { 0, 0, 0, 0, 0, 0 };   /* count >= t | j << lo for j = 1..3, then masses */
        for_each_step(r, [&](int, int v0, const float4 &q) {
            float x[4], l[4];
            const int n = load4(r, v0, q, x, l);
            for (int i = 0; i < n; i++) {
                uint64_t key, w;
                if (!member(x[i], l[i], v0 + i, &key, &w))
                    continue;
#pragma unroll
                for (int j = 0; j < 3; j++)
                    if (j < nc && key >= (t | ((uint64_t)(j + 1) << lo))) {
                        c[j]++;
                        c[3 + j] += w;
                    }
            }
        });
        row_reduce(S, r, c, { RED_ADD, RED_ADD, RED_ADD, RED_ADD, RED_ADD, RED_ADD });
        int pick = 0;
        for (int j = nc; j >= 1; j--)
            if ((by_mass ? c[3 + j - 1] : c[j - 1]) >= target) {
                pick = j;
                break;
            }
        if (pick < nc)
            up_c = c[pick];     /* the range now ends at the next candidate */
        if (pick) {
            t |= (uint64_t)pick << lo;
            wc = c[pick - 1];
            wm = c[3 + pick - 1];
        }
    }
    *mass_ge = wm;
    return t > kmin ? t : kmin;
}

/* Gather into the row's rlist the raw keys >= floor (the top-n fallback's second pass). */
static __device__ void gather_raw_ge(sample_smem &S, const row_ctx &r, uint64_t floor)
{
    gather_begin(S, r, false, true);
    uint64_t *rlist = row_smem(r, S.rlist, 0);
    int32_t *count = row_smem(r, &S.n_rlist, 0);
    for_each_step(r, [&](int, int v0, const float4 &q) {
        float x[4], l[4];
        bool want[4];
        uint64_t key[4];
        const int n = load4(r, v0, q, x, l);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            key[i] = rank_key(x[i], v0 + i);
            want[i] = i < n && key[i] >= floor;
        }
        warp_append(rlist, SAMPLE_RLIST, count, want, key);
    });
    gather_end(S, r, false, true);
}

/* Gather into the row's list the keys of l in coarse bin b. */
static __device__ void gather_bin(sample_smem &S, const row_ctx &r, int b)
{
    gather_begin(S, r, true, false);
    uint64_t *list = row_smem(r, S.list, 0);
    int32_t *count = row_smem(r, &S.n_list, 0);
    for_each_step(r, [&](int, int v0, const float4 &q) {
        float x[4], l[4];
        bool want[4];
        uint64_t key[4];
        const int n = load4(r, v0, q, x, l);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            key[i] = rank_key(l[i], v0 + i);
            want[i] = i < n && coarse_bin(r.m_l, l[i]) == b;
        }
        warp_append(list, SAMPLE_LIST, count, want, key);
    });
    gather_end(S, r, true, false);
}

/* The threshold key of a selection inside coarse bin b of l: from the list when the bin fit (sorted
 * here unless already), else by the bitwise fallback over the row. target counts from the bin's
 * start; only the first n_eligible sorted keys (those >= floor) take part; *mass_ge: the mass of the
 * bin's tokens from its best through the threshold. */
static __device__ uint64_t select_in_bin(sample_smem &S, const row_ctx &r, int b, uint64_t floor, bool by_mass,
                                         uint64_t target, bool *sorted, int n_eligible, uint64_t *mass_ge)
{
    if (S.n_list > SAMPLE_LIST)
        return select_bitwise<false>(S, r, b, floor, by_mass, target, mass_ge);
    if (!*sorted) {
        sort_desc(S.list, S.n_list);
        *sorted = true;
    }
    const float m = r.m_l;
    auto wfn = [m](uint64_t k) { return fixed_mass(prob(key_value(k), m)); };
    const int n = min(n_eligible, S.n_list);
    const int i = by_mass ? list_find(S, S.list, n, wfn, 0, target, n - 1, mass_ge)
                          : list_find(S, S.list, n, wfn, 0, ~0ull, (int)target - 1, mass_ge);
    return i == SAMPLE_NONE ? ~0ull : S.list[i];       /* none: an empty bin, never chosen; keep the best */
}

/* ---- the kernel ---- */

struct sample_args {
    const float *logits;
    int64_t ld;
    int vocab;
    int C;                              /* blocks per row (the cluster size, 1 without clusters) */
    const struct dsv4_sample_row *params;
    struct dsv4_sample_history hist;    /* d_counts NULL: none */
    struct dsv4_sample_result *out;
    int32_t *tokens;
};

/* Block 0 of the row reports the status; top arrays are written where they are known. */
static __device__ void put_status(const sample_args &a, const row_ctx &r, int row, int status, int bad, int n_top)
{
    if (r.rank == 0 && threadIdx.x == 0) {
        struct dsv4_sample_result *o = a.out + row;
        o->n_top = n_top;
        o->status = status;
        o->bad_token = bad;
        if (status < 0) {
            o->token = -1;
            o->logprob = 0.0f;
            if (a.tokens)
                a.tokens[row] = -1;
        }
    }
}

/* The block that knows the token writes it (thread 0). */
static __device__ void put_token(const sample_args &a, const row_ctx &r, int row, int token, double lse)
{
    if (threadIdx.x == 0) {
        a.out[row].token = token;
        a.out[row].logprob = token >= 0 ? (float)((double)__ldg(r.x + token) - lse) : 0.0f;
        if (a.tokens)
            a.tokens[row] = token;
    }
}

/* grid (rows * C) in clusters of C, block SAMPLE_THREADS, dynamic shared memory sizeof(sample_smem).
 * Every decision below comes from row-wide reductions, so all blocks of a row take the same branches. */
__global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_kernel(const sample_args a)
{
    dsv4_pdl_enter();
    extern __shared__ __align__(16) uint8_t smem_bytes[];
    sample_smem &S = *reinterpret_cast<sample_smem *>(smem_bytes);
    const int row = blockIdx.x / a.C;
    const struct dsv4_sample_row P = a.params[row];
    const int V = a.vocab;
    row_ctx r;

    r.x = a.logits + (int64_t)row * a.ld;
    r.V = V;
    r.tile_w = SAMPLE_STEP * ((V + SAMPLE_STEP * SAMPLE_TILES - 1) / (SAMPLE_STEP * SAMPLE_TILES));
    r.ntiles = (V + r.tile_w - 1) / r.tile_w;
    r.C = a.C;
    r.rank = blockIdx.x % a.C;
    const int per_block = (r.ntiles + r.C - 1) / r.C;
    r.t_begin = min(r.ntiles, r.rank * per_block);
    r.t_end = min(r.ntiles, r.t_begin + per_block);
    const bool have_hist = a.hist.d_counts && P.slot >= 0;
    if (have_hist && P.slot >= a.hist.slots) {
        put_status(a, r, row, -EINVAL, -1, 0);
        return;
    }
    r.counts = have_hist ? a.hist.d_counts + (int64_t)P.slot * V : nullptr;
    r.seen = have_hist ? a.hist.d_seen + (int64_t)P.slot * DSV4_SAMPLE_SEEN_WORDS(V) : nullptr;
    r.rep = have_hist && P.repetition_penalty != 1.0f;
    r.freq = have_hist && (P.frequency_penalty != 0.0f || P.presence_penalty != 0.0f);
    r.rp = P.repetition_penalty;
    r.fp = P.frequency_penalty;
    r.pp = P.presence_penalty;
    const bool sampling = P.temperature != 0.0f;
    r.scale = sampling && P.temperature != 1.0f;
    r.inv_t = __fdiv_rn(1.0f, P.temperature);
    const bool transformed = r.rep || r.freq || r.scale;
    const int n_top = min(max(P.logprobs, 0), min(DSV4_SAMPLER_LOGPROBS_MAX, V));
    const bool topk = sampling && P.top_k > 0 && P.top_k < V;
    const bool topp = sampling && P.top_p < 1.0f;
    const bool minp = sampling && P.min_p > 0.0f;
    const bool lhist = topk || topp;
    const bool rhist = n_top > 0 && !(lhist && !transformed);  /* else the raw counts are l's */

    for (int i = threadIdx.x; i < SAMPLE_BINS; i += SAMPLE_THREADS) {
        S.hmass[i] = 0;
        S.hcnt[i] = 0;
        S.rcnt[i] = 0;
    }

    /* Pass 1: NaN / +inf (lowest id, as sampler.c reports the first), raw max, l's max and argmax
     * (each thread meets its ids in ascending order, so strict > keeps the lowest id of a tie). */
    int chosen;
    {
        float rmax = -INFINITY, bv = -INFINITY;
        int bi = -1;
        uint64_t v[3] = { ~0ull, 0, 0 };
        for_each_step(r, [&](int, int v0, const float4 &q) {
            float x[4], l[4];
            const int n = load4(r, v0, q, x, l);
            for (int i = 0; i < n; i++) {
                if (!(x[i] < INFINITY))
                    v[0] = min(v[0], (uint64_t)(v0 + i));
                rmax = fmaxf(rmax, x[i]);
                if (l[i] > bv || bi < 0) {
                    bv = l[i];
                    bi = v0 + i;
                }
            }
        });
        v[1] = fkey(rmax);
        v[2] = bi < 0 ? 0 : rank_key(bv, bi);
        row_reduce(S, r, v, { RED_MIN, RED_MAX, RED_MAX });
        r.m_raw = fkey_value((uint32_t)v[1]);
        r.m_l = key_value(v[2]);
        if (v[0] != ~0ull || r.m_raw == -INFINITY) {
            put_status(a, r, row, -EDOM, v[0] != ~0ull ? (int)v[0] : -1, 0);
            return;
        }
        chosen = key_id(v[2]);  /* greedy (step 4): the largest l, lowest id on ties */
    }

    /* Pass 2: the raw row's mass (log-sum-exp, in fixed point) and the coarse histograms; rows
     * without top_k / top_p also take the draw's tile sums here (every token with p >= min_p is
     * kept), which saves them a pass. */
    const bool tiles_in_p2 = sampling && !topk && !topp;
    const int lane = threadIdx.x % DSV4_CUDA_WARP, spt = r.tile_w / SAMPLE_STEP;
    auto kept_p = [&](float p) -> uint64_t { return minp && !(p >= P.min_p) ? 0 : fixed_mass(p); };
    double lse;
    {
        uint64_t v[4] = { 0, 0, 0, 0 };         /* raw mass, last bin: count, mass, raw count */
        uint64_t tsum = 0;
        int step = 0;
        for_each_step(r, [&](int t, int v0, const float4 &q) {
            float x[4], l[4];
            const int n = load4(r, v0, q, x, l);
            for (int i = 0; i < n; i++) {
                const float pr = prob(x[i], r.m_raw);
                const uint64_t wr = fixed_mass(pr);
                v[0] += wr;
                if (tiles_in_p2)
                    tsum += kept_p(transformed ? prob(l[i], r.m_l) : pr);
                if (rhist) {
                    const int b = coarse_bin(r.m_raw, x[i]);
                    if (b < SAMPLE_BINS - 1)
                        atomicAdd(&S.rcnt[b], 1u);
                    else
                        v[3]++;
                }
                if (lhist) {
                    const int b = coarse_bin(r.m_l, l[i]);
                    const uint64_t w = transformed ? fixed_mass(prob(l[i], r.m_l)) : wr;
                    if (b < SAMPLE_BINS - 1) {
                        atomicAdd(&S.hcnt[b], 1u);
                        atomicAdd((unsigned long long *)&S.hmass[b], (unsigned long long)w);
                    } else {
                        v[1]++;
                        v[2] += w;
                    }
                }
            }
            if (tiles_in_p2 && ++step == spt) {     /* the tile's last step */
                for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1)
                    tsum += __shfl_xor_sync(SAMPLE_FULL, tsum, o);
                if (lane == 0)
                    S.tile[t - r.t_begin] = tsum;
                tsum = 0;
                step = 0;
            }
        });
        if (r.C > 1 && (lhist || rhist)) {
            /* every block's histograms become the row's: sum the blocks' partial counts */
            constexpr int per = SAMPLE_BINS / SAMPLE_THREADS;
            uint32_t hc[per], rc[per];
            uint64_t hm[per];
            row_sync(r);
            for (int i = 0; i < per; i++) {
                const int b = threadIdx.x + i * SAMPLE_THREADS;
                hc[i] = rc[i] = 0;
                hm[i] = 0;
                for (int q = 0; q < r.C; q++) {
                    hc[i] += *row_smem(r, &S.hcnt[b], q);
                    hm[i] += *row_smem(r, &S.hmass[b], q);
                    rc[i] += *row_smem(r, &S.rcnt[b], q);
                }
            }
            row_sync(r);
            for (int i = 0; i < per; i++) {
                const int b = threadIdx.x + i * SAMPLE_THREADS;
                S.hcnt[b] = hc[i];
                S.hmass[b] = hm[i];
                S.rcnt[b] = rc[i];
            }
        }
        row_reduce(S, r, v, { RED_ADD, RED_ADD, RED_ADD, RED_ADD });
        if (threadIdx.x == 0) {
            S.hcnt[SAMPLE_BINS - 1] = (uint32_t)v[1];
            S.hmass[SAMPLE_BINS - 1] = v[2];
            S.rcnt[SAMPLE_BINS - 1] = (uint32_t)v[3];
        }
        __syncthreads();
        lse = (double)r.m_raw + (log((double)v[0]) - SAMPLE_FX_LN);
    }
    const uint32_t *rcnt = rhist ? S.rcnt : S.hcnt;

    /* Coarse boundaries: top-n (raw), then top_k, or top_p when there is no top_k. */
    uint64_t bc, bm, ztot;
    int bn = SAMPLE_NONE, bk = SAMPLE_NONE, bp = SAMPLE_NONE;
    uint64_t n_above = 0, k_above_c = 0, k_above_m = 0, p_above_m = 0, z = 0, tp = 0;
    if (n_top > 0)
        bn = bin_find(S, rcnt, nullptr, false, (uint64_t)n_top, SAMPLE_BINS, 0, 0, &n_above, &bm, &ztot);
    if (topk)
        bk = bin_find(S, S.hcnt, S.hmass, false, (uint64_t)P.top_k, SAMPLE_BINS, 0, 0, &k_above_c, &k_above_m,
                      &ztot);
    if (topp && !topk) {
        bin_find(S, S.hcnt, S.hmass, true, ~0ull, SAMPLE_BINS, 0, 0, &bc, &bm, &z);     /* z: the whole mass */
        tp = max(ceil_mul(P.top_p, z), (uint64_t)1);
        bp = bin_find(S, S.hcnt, S.hmass, true, tp, SAMPLE_BINS, 0, 0, &bc, &p_above_m, &ztot);
    }
    const int bg = topk ? bk : bp;

    /* Pass 3: gather the raw top-n candidates (every bin up to bn: fewer than n_top above it) and
     * the sampling boundary bin's tokens. */
    if (bn != SAMPLE_NONE || bg != SAMPLE_NONE) {
        gather_begin(S, r, bg != SAMPLE_NONE, bn != SAMPLE_NONE);
        uint64_t *list = row_smem(r, S.list, 0), *rlist = row_smem(r, S.rlist, 0);
        int32_t *count = row_smem(r, &S.n_list, 0), *rcount = row_smem(r, &S.n_rlist, 0);
        for_each_step(r, [&](int, int v0, const float4 &q) {
            float x[4], l[4];
            bool want[4], rwant[4];
            uint64_t key[4], rkey[4];
            const int n = load4(r, v0, q, x, l);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                rkey[i] = rank_key(x[i], v0 + i);
                key[i] = rank_key(l[i], v0 + i);
                rwant[i] = i < n && bn != SAMPLE_NONE && coarse_bin(r.m_raw, x[i]) <= bn;
                want[i] = i < n && bg != SAMPLE_NONE && coarse_bin(r.m_l, l[i]) == bg;
            }
            if (bn != SAMPLE_NONE)
                warp_append(rlist, SAMPLE_RLIST, rcount, rwant, rkey);
            if (bg != SAMPLE_NONE)
                warp_append(list, SAMPLE_LIST, count, want, key);
        });
        gather_end(S, r, bg != SAMPLE_NONE, bn != SAMPLE_NONE);
    }

    /* Step 1's top-n: sorted candidates, or the fallback (threshold, then gather exactly n_top). */
    if (n_top > 0) {
        if (S.n_rlist > SAMPLE_RLIST) {
            uint64_t unused;
            const uint64_t t = select_bitwise<true>(S, r, bn, 0, false, n_top - n_above, &unused);
            gather_raw_ge(S, r, t);
        }
        sort_desc(S.rlist, min(S.n_rlist, SAMPLE_RLIST));
        if (r.rank == 0 && (int)threadIdx.x < DSV4_SAMPLER_LOGPROBS_MAX) {
            const int i = threadIdx.x;
            const uint64_t k = S.rlist[i];
            a.out[row].top_ids[i] = i < n_top ? key_id(k) : -1;
            a.out[row].top_logprobs[i] = i < n_top ? (float)((double)key_value(k) - lse) : 0.0f;
        }
    } else if (r.rank == 0 && (int)threadIdx.x < DSV4_SAMPLER_LOGPROBS_MAX) {
        a.out[row].top_ids[threadIdx.x] = -1;
        a.out[row].top_logprobs[threadIdx.x] = 0.0f;
    }

    if (sampling) {
        /* Steps 6 and 8: one threshold key tau, kept = {key >= tau}. */
        uint64_t tau = 0, mass;
        bool sorted = false;
        int k_in_bin = SAMPLE_LIST;     /* tokens of bin bk that top_k keeps */
        if (topk) {
            k_in_bin = (int)(P.top_k - k_above_c);
            tau = select_in_bin(S, r, bk, 0, false, (uint64_t)k_in_bin, &sorted, SAMPLE_LIST, &mass);
            z = k_above_m + mass;
        }
        if (topp) {
            if (topk) {
                tp = max(ceil_mul(P.top_p, z), (uint64_t)1);
                bp = bin_find(S, S.hcnt, S.hmass, true, tp, bk, (uint64_t)k_in_bin, z - k_above_m, &bc, &p_above_m,
                              &ztot);
                if (bp != bk && bp != SAMPLE_NONE) {
                    gather_bin(S, r, bp);
                    sorted = false;
                    k_in_bin = SAMPLE_LIST;
                }
            }
            if (bp != SAMPLE_NONE) {
                const uint64_t t = select_in_bin(S, r, bp, bp == bk ? tau : 0, true, tp - p_above_m, &sorted,
                                                 k_in_bin, &mass);
                tau = max(tau, t);
            }
        }

        /* Steps 9-10: kept = key >= tau and (min_p) p >= min_p; a lone kept token needs no draw.
         * Tile sums of the kept mass, a scan over the row's tiles, then the tile holding the target
         * is walked by one warp of the block that has it. */
        if (tau < rank_key(r.m_l, chosen)) {
            const float m = r.m_l;
            auto kept_mass = [&](float l, int v) -> uint64_t {
                return tau && rank_key(l, v) < tau ? 0 : kept_p(prob(l, m));
            };
            if (!tiles_in_p2) {
                uint64_t tsum = 0;
                int step = 0;
                for_each_step(r, [&](int t, int v0, const float4 &q) {
                    float x[4], l[4];
                    const int n = load4(r, v0, q, x, l);
                    for (int i = 0; i < n; i++)
                        tsum += kept_mass(l[i], v0 + i);
                    if (++step == spt) {    /* the tile's last step */
                        for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1)
                            tsum += __shfl_xor_sync(SAMPLE_FULL, tsum, o);
                        if (lane == 0)
                            S.tile[t - r.t_begin] = tsum;
                        tsum = 0;
                        step = 0;
                    }
                });
            }
            for (int t = r.t_end - r.t_begin + threadIdx.x; t < SAMPLE_TILES; t += SAMPLE_THREADS)
                S.tile[t] = 0;
            __syncthreads();
            const int t0 = 2 * threadIdx.x;
            const uint64_t w0 = t0 < SAMPLE_TILES ? S.tile[t0] : 0, w1 = t0 + 1 < SAMPLE_TILES ? S.tile[t0 + 1] : 0;
            uint64_t btotal;
            const uint64_t before = block_excl_scan(w0 + w1, S.red[0], &btotal);
            /* the row's total zk, and the mass of the tiles of the blocks before this one */
            uint64_t offset = 0, zk = btotal;
            if (r.C > 1) {
                if (threadIdx.x == 0)
                    S.cl[0] = btotal;
                row_sync(r);
                zk = 0;
                for (int q = 0; q < r.C; q++) {
                    const uint64_t bt = *row_smem(r, &S.cl[0], q);
                    offset += q < r.rank ? bt : 0;
                    zk += bt;
                }
                row_sync(r);
            }
            if (zk == 0) {
                put_status(a, r, row, -EDOM, -1, n_top);
                return;
            }
            /* target = floor(u * zk), u = bits / 2^53: the kept token whose running sum first exceeds it */
            const uint64_t bits = philox_bits53(P.seed, P.index);
            const uint64_t target = (__umul64hi(bits, zk) << 11) | ((bits * zk) >> 53);
            if (threadIdx.x == 0) {
                S.found = -1;
                S.token = -1;
            }
            __syncthreads();
            const uint64_t at = offset + before;
            if (at <= target && target < at + w0) {
                S.found = t0;
                S.found_acc = at;
            } else if (at + w0 <= target && target < at + w0 + w1) {
                S.found = t0 + 1;
                S.found_acc = at + w0;
            }
            __syncthreads();
            const int lt = S.found;
            if (lt >= 0 && threadIdx.x < DSV4_CUDA_WARP) {
                const int t = r.t_begin + lt;
                uint64_t acc = S.found_acc;
                for (int s = 0; s < spt; s++) {
                    const int v0 = t * r.tile_w + s * SAMPLE_STEP + lane * 4;
                    float x[4], l[4];
                    uint64_t w[4], sum = 0;
                    const int n = load4(r, v0, load_raw4(r, v0), x, l);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        w[i] = i < n ? kept_mass(l[i], v0 + i) : 0;
                        sum += w[i];
                    }
                    const uint64_t incl = warp_incl_scan(sum);
                    uint64_t run = acc + incl - sum;
                    if (run <= target && target < acc + incl)
                        for (int i = 0; i < 4; i++) {
                            run += w[i];
                            if (run > target) {
                                S.token = v0 + i;
                                break;
                            }
                        }
                    acc += __shfl_sync(SAMPLE_FULL, incl, DSV4_CUDA_WARP - 1);
                    if (acc > target)
                        break;
                }
            }
            __syncthreads();
            put_status(a, r, row, 0, -1, n_top);
            if (lt >= 0)
                put_token(a, r, row, S.token, lse);
            return;
        }
    }
    put_status(a, r, row, 0, -1, n_top);
    if (r.rank == 0)
        put_token(a, r, row, chosen, lse);
}

/* ---- history ---- */

/* grid (ceil(n / 256)), block 256: one token per thread. */
__global__ void history_record_kernel(const struct dsv4_sample_history h, const int32_t *slots, const int32_t *tokens,
                                      int n, bool output)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    const int s = slots[i], v = tokens[i];
    if (s < 0 || s >= h.slots || v < 0 || v >= h.vocab)
        return;
    atomicOr(h.d_seen + (int64_t)s * DSV4_SAMPLE_SEEN_WORDS(h.vocab) + v / 32, 1u << (v % 32));
    if (output)
        atomicAdd(h.d_counts + (int64_t)s * h.vocab + v, 1u);
}

/* grid (chunks, n), block 256: chunk x of slot slots[y]'s counts and seen words. */
__global__ void history_clear_kernel(const struct dsv4_sample_history h, const int32_t *slots)
{
    dsv4_pdl_enter();
    const int s = slots[blockIdx.y];
    const int64_t words = DSV4_SAMPLE_SEEN_WORDS(h.vocab);
    if (s < 0 || s >= h.slots)
        return;
    uint32_t *counts = h.d_counts + (int64_t)s * h.vocab, *seen = h.d_seen + (int64_t)s * words;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < h.vocab + words;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (i < h.vocab)
            counts[i] = 0;
        else
            seen[i - h.vocab] = 0;
    }
}

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

extern "C" size_t dsv4_sample_history_bytes(int slots, int vocab)
{
    if (slots < 1 || vocab < 1)
        return 0;
    return align256((size_t)slots * (size_t)vocab * sizeof(uint32_t)) +
           align256((size_t)slots * (size_t)DSV4_SAMPLE_SEEN_WORDS(vocab) * sizeof(uint32_t));
}

extern "C" int dsv4_sample_history_init(struct dsv4_sample_history *h, void *d_base, int slots, int vocab)
{
    if (vocab < 1 || vocab > DSV4_SAMPLER_VOCAB_MAX)
        return dsv4_error_set(-EINVAL, "sample history: vocab %d must be in [1, %d]", vocab, DSV4_SAMPLER_VOCAB_MAX);
    if (slots < 1)
        return dsv4_error_set(-EINVAL, "sample history: slots %d must be >= 1", slots);
    if (!d_base || (uintptr_t)d_base % 256)
        return dsv4_error_set(-EINVAL, "sample history: base must be a 256-byte aligned device pointer");
    h->d_counts = static_cast<uint32_t *>(d_base);
    h->d_seen = reinterpret_cast<uint32_t *>(static_cast<uint8_t *>(d_base) +
                                             align256((size_t)slots * (size_t)vocab * sizeof(uint32_t)));
    h->slots = slots;
    h->vocab = vocab;
    return 0;
}

extern "C" int dsv4_sample_history_record(const struct dsv4_sample_history *h, const int32_t *d_slots,
                                          const int32_t *d_tokens, int n, bool output, void *stream)
{
    if (n < 0 || (n > 0 && (!h || !h->d_counts || !d_slots || !d_tokens)))
        return dsv4_error_set(-EINVAL, "sample history record: %d tokens need a history, slots and tokens", n);
    if (n == 0)
        return 0;
    dsv4_launch(history_record_kernel, (n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream), *h, d_slots,
                d_tokens, n, output);
    DSV4_CUDA_LAUNCHED("sample_history_record");
    return 0;
}

#define HISTORY_CLEAR_CHUNKS 64     /* blocks per slot: 64 x 256 threads over V + V/32 words */
#define HISTORY_CLEAR_MAX_SLOTS 65535   /* grid y limit */

extern "C" int dsv4_sample_history_clear(const struct dsv4_sample_history *h, const int32_t *d_slots, int n,
                                         void *stream)
{
    if (n < 0 || n > HISTORY_CLEAR_MAX_SLOTS || (n > 0 && (!h || !h->d_counts || !d_slots)))
        return dsv4_error_set(-EINVAL, "sample history clear: %d slots (at most %d) need a history and a slot list",
                              n, HISTORY_CLEAR_MAX_SLOTS);
    if (n == 0)
        return 0;
    dsv4_launch(history_clear_kernel, dim3(HISTORY_CLEAR_CHUNKS, n), 256, 0, static_cast<cudaStream_t>(stream), *h,
                d_slots);
    DSV4_CUDA_LAUNCHED("sample_history_clear");
    return 0;
}

/* ---- launchers ---- */

static std::atomic<bool> sample_prepared{ false };
static std::atomic<int> sample_cluster_max{ 1 };   /* blocks per row the device and image allow */

extern "C" int dsv4_sample_prepare(void)
{
    cudaFuncAttributes fa;
    int dev, cluster_launch = 0;

    DSV4_CUDA_TRY(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)sizeof(struct sample_smem)));
    DSV4_CUDA_TRY(cudaFuncGetAttributes(&fa, sample_kernel));
    DSV4_CUDA_TRY(cudaGetDevice(&dev));
    DSV4_CUDA_TRY(cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, dev));
    /* clusters need the device's support and an image built for sm_90 or later (not the compute_80
     * PTX, whose kernel uses one block per row) */
    int cmax = 1;
    if (cluster_launch && fa.ptxVersion >= 90) {
        /* past the portable size only where the device takes it (cudaOccupancyMaxActiveClusters
         * below says whether such a cluster fits at all) */
        const bool big = cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
                         cudaSuccess;
        (void)cudaGetLastError();
        for (int c = big ? SAMPLE_CLUSTER_MAX : SAMPLE_CLUSTER_PORTABLE; c > 1 && cmax == 1; c /= 2) {
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute at;
            int n = 0;
            cfg.gridDim = dim3(c);
            cfg.blockDim = dim3(SAMPLE_THREADS);
            cfg.dynamicSmemBytes = sizeof(struct sample_smem);
            at.id = cudaLaunchAttributeClusterDimension;
            at.val.clusterDim.x = c;
            at.val.clusterDim.y = at.val.clusterDim.z = 1;
            cfg.attrs = &at;
            cfg.numAttrs = 1;
            if (cudaOccupancyMaxActiveClusters(&n, sample_kernel, &cfg) == cudaSuccess && n > 0)
                cmax = c;
            (void)cudaGetLastError();
        }
    }
    sample_cluster_max = cmax;
    sample_prepared = true;
    return 0;
}

#define SAMPLE_MAX_ROWS 65535       /* far above any batch; keeps the grid and indices small */

/* Blocks per row for a launch of `rows` rows: about 128 blocks in all (one a multiprocessor), at most
 * the cluster limit. A function of rows only: the same launch shape for the same bucket. */
static int sample_blocks_per_row(int rows)
{
    int c = 1;
    while (c < sample_cluster_max && rows * c * 2 <= 128)
        c *= 2;
    return c;
}

extern "C" int dsv4_sample_rows(const float *d_logits, int64_t ld, int rows, int vocab,
                                const struct dsv4_sample_row *d_params, const struct dsv4_sample_history *hist,
                                struct dsv4_sample_result *d_out, int32_t *d_tokens, void *stream)
{
    if (vocab < 1 || vocab > DSV4_SAMPLER_VOCAB_MAX)
        return dsv4_error_set(-EINVAL, "sample: vocab %d must be in [1, %d]", vocab, DSV4_SAMPLER_VOCAB_MAX);
    if (rows < 0 || rows > SAMPLE_MAX_ROWS)
        return dsv4_error_set(-EINVAL, "sample: rows %d must be in [0, %d]", rows, SAMPLE_MAX_ROWS);
    if (ld < vocab || ld % 4 || (uintptr_t)d_logits % 16)
        return dsv4_error_set(-EINVAL, "sample: logits rows %lld apart for vocab %d: need ld >= vocab, ld a "
                              "multiple of 4 and 16-byte aligned logits (16-byte loads)", (long long)ld, vocab);
    if (hist && hist->d_counts && hist->vocab != vocab)
        return dsv4_error_set(-EINVAL, "sample: history vocab %d differs from the logits' %d", hist->vocab, vocab);
    if (rows == 0)
        return 0;
    if (!d_logits || !d_params || !d_out)
        return dsv4_error_set(-EINVAL, "sample: logits, parameters and results must be device pointers");
    if (!sample_prepared) {
        int r = dsv4_sample_prepare();
        if (r < 0)
            return r;
    }
    sample_args a;
    a.logits = d_logits;
    a.ld = ld;
    a.vocab = vocab;
    a.C = sample_blocks_per_row(rows);
    a.params = d_params;
    if (hist && hist->d_counts)
        a.hist = *hist;
    else
        a.hist = dsv4_sample_history{ nullptr, nullptr, 0, vocab };
    a.out = d_out;
    a.tokens = d_tokens;

    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[2];
    cfg.gridDim = dim3((unsigned)(rows * a.C));
    cfg.blockDim = dim3(SAMPLE_THREADS);
    cfg.dynamicSmemBytes = sizeof(struct sample_smem);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cfg.attrs = at;
    cfg.numAttrs = dsv4_pdl_attr(&at[0]);
    if (a.C > 1) {
        at[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
        at[cfg.numAttrs].val.clusterDim.x = (unsigned)a.C;
        at[cfg.numAttrs].val.clusterDim.y = at[cfg.numAttrs].val.clusterDim.z = 1;
        cfg.numAttrs++;
    }
    DSV4_CUDA_TRY(cudaLaunchKernelEx(&cfg, sample_kernel, a));
    DSV4_CUDA_LAUNCHED("sample");
    return 0;
}
