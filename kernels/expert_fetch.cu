/* SPDX-License-Identifier: MIT */
/* Host experts fetched ahead (decode steps with routed experts in pinned host memory).
 *
 * A host expert's bytes cross PCIe (~55 GB/s) while the rest of a layer streams HBM at ~4 TB/s, so at
 * batch 1 an expert read in place costs ~240 us against ~170 us for the whole of a Flash layer on the
 * GPU. The link is idle while the attention runs, and through the FFN of every layer that routes
 * nothing to the host; this module fills that time. When layer l's attention input xn is ready, a
 * lane of its own predicts the routing of layer l and of the next ones (up to dsv4_cuda_fetch.ahead
 * layers that have host experts: each router applied to xn; the residual moves little from layer to
 * layer: on random Flash weights a layer's own router on its attention input finds 74% of the experts
 * it routes to, the next layer's ~50%, two ahead ~30%), keeps or assigns each target's first
 * predicted host experts to its set's slots, and a copy lane fills those slots chunk by chunk, layer l
 * first. After layer l's router, the main lane's resolve points each routed slot expert's redirect
 * entry at the tiles already copied, and the decode expert kernels read those from the slot and the
 * rest in place from host memory. Same bytes either way, so the same bits: only where they are read
 * changes.
 *
 * Slots: DSV4_CUDA_FETCH_SLOTS per set, set l % DSV4_CUDA_FETCH_SETS for layer l. A slot holds a key
 * (layer, expert) and done[c] = the key whose bytes chunk c holds, published with release semantics
 * after them; weights never change, so chunks stay right for their key across steps, and a slot is
 * only refilled when a plan gives it another key. A chunk is one DSV4_CUDA_TILE_ROWS-row block of one
 * matrix with its scales, in k-tile blocks (the expert layout of dsv4_cuda_tile_fp4): chunks 2b and
 * 2b + 1 are block b of w1 and w3, chunk 2 (I / 32) + j is block j of w2, the order the gate/up and
 * down kernels read them.
 *
 * Order, which keeps every slot's bytes still while something reads them:
 *   - layer l's predict stops every earlier copy at its next chunk (words[CANCEL]); its plan waits for
 *     the previous copy to end (an event edge), so that plans and copies alternate on the slots;
 *   - layer l's plan writes the sets of l .. l + ahead - 1; the last reader of those sets was layer
 *     l - 1's expert kernels (SETS >= ahead), which ended before l's attention input existed;
 *   - layer l's resolve runs after l's plan (the main lane waits for it before the FFN), and the
 *     copy writes none of the chunks it found copied;
 *   - resolve marks layer l resolved (words[RESOLVED]: the copy takes no more of its chunks) and stops
 *     the copy (words[CANCEL]) when a routed host expert must still be read in place: the link is
 *     then the expert kernels'. Otherwise the copy goes on with the next layers through l's FFN.
 * The tags in CANCEL and RESOLVED (dsv4_cuda_fetch_tag: the step and the layer) grow through a step
 * and from step to step, so each is one atomicMax. */
#include <cuda_bf16.h>

#include "kernels/cuda_util.cuh"
#include "kernels/route_score.cuh"

#define FETCH_COPY_THREADS 512
#define FETCH_COPY_CTAS 8           /* 8 x 512 threads reach ~50 GB/s from host memory (the copy
                                     * engine: 55); more take SMs from the main lane for nothing */
#define FETCH_PREDICT_WARPS 8       /* experts a predict block scores, a warp each */
#define FETCH_PLAN_THREADS 256      /* a target's plan: one block */
#define FETCH_RESOLVE_THREADS 256   /* a layer's resolve: one block over the slots' tiles and the pairs */
#define FETCH_MAX_EXPERTS 1024      /* a plan block keeps a row's selection values in shared memory */

/* The chunk c of an expert: source and destination of its weights and scales, and their sizes. */
struct fetch_chunk {
    const uint8_t *w, *s;
    uint8_t *dw, *ds;
    int64_t wb, sb;
};

static __device__ fetch_chunk chunk_at(const struct dsv4_cuda_expert *src, const struct dsv4_cuda_expert *dst, int c,
                                       int up_blocks)
{
    const struct dsv4_cuda_linear *S, *D;
    int b;
    if (c < 2 * up_blocks) {
        S = c % 2 ? &src->w3 : &src->w1;
        D = c % 2 ? &dst->w3 : &dst->w1;
        b = c / 2;
    } else {
        S = &src->w2;
        D = &dst->w2;
        b = c - 2 * up_blocks;
    }
    const int64_t nk = S->in / DSV4_CUDA_TILE_KT;
    fetch_chunk k;
    k.wb = nk * DSV4_CUDA_TILE_BYTES;
    k.sb = nk * DSV4_CUDA_TILE_SCALE_BYTES;
    k.w = static_cast<const uint8_t *>(S->w) + b * k.wb;
    k.s = S->scale + b * k.sb;
    k.dw = static_cast<uint8_t *>(const_cast<void *>(D->w)) + b * k.wb;
    k.ds = const_cast<uint8_t *>(D->scale) + b * k.sb;
    return k;
}

/* n bytes (a multiple of 16, 16-byte aligned) from src to dst by the whole block, 8 loads in flight a
 * thread: PCIe reads take microseconds, so the block keeps FETCH_COPY_THREADS x 128 bytes asking. */
static __device__ __forceinline__ void copy_bytes(uint8_t *dst, const uint8_t *src, int64_t n)
{
    const uint4 *s = reinterpret_cast<const uint4 *>(src);
    uint4 *d = reinterpret_cast<uint4 *>(dst);
    const int64_t n16 = n / 16;
    for (int64_t i = threadIdx.x; i < n16; i += 8 * FETCH_COPY_THREADS) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i + u * FETCH_COPY_THREADS < n16)
                v[u] = s[i + u * FETCH_COPY_THREADS];
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (i + u * FETCH_COPY_THREADS < n16)
                d[i + u * FETCH_COPY_THREADS] = v[u];
    }
}

static __device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long *p)
{
    return *reinterpret_cast<volatile const unsigned long long *>(p);
}

/* The step counter, once per step before any fetch of it (one thread). */
__global__ void fetch_step_kernel(unsigned long long *words)
{
    dsv4_pdl_enter();
    words[DSV4_CUDA_FETCH_STEP] += 1;
}

/* Every copy launched before `layer` of this step stops at its next chunk; then logits [n, B, E] =
 * each non-hash target's gate [E, D] (bf16) . xn [B, D], B <= DSV4_CUDA_FETCH_ROWS_MAX: a warp per
 * expert (grid x) and target (grid y), each lane 8 values of the row at a time (one 16-byte load, four
 * iterations unrolled) against every row of x, so the gate row is read once. Only a prediction reads
 * the logits (which experts to copy), so f32 sums in any order will do. */
__global__ void __launch_bounds__(FETCH_PREDICT_WARPS * DSV4_CUDA_WARP)
fetch_predict_kernel(const struct dsv4_cuda_fetch_targets tg, const float *__restrict__ xn, int B, int D, int E,
                     float *__restrict__ logits, unsigned long long *words, int layer)
{
    dsv4_pdl_enter();
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        atomicMax(words + DSV4_CUDA_FETCH_CANCEL, dsv4_cuda_fetch_tag(words[DSV4_CUDA_FETCH_STEP], layer) - 1);
    const struct dsv4_cuda_fetch_target *T = &tg.t[blockIdx.y];
    const int e = blockIdx.x * FETCH_PREDICT_WARPS + threadIdx.x / DSV4_CUDA_WARP, lane = threadIdx.x % DSV4_CUDA_WARP;
    if (T->tid2eid || e >= E)       /* a hash layer's plan reads its table */
        return;
    const __nv_bfloat16 *g = static_cast<const __nv_bfloat16 *>(T->gate) + (int64_t)e * T->ldg;
    float acc[DSV4_CUDA_FETCH_ROWS_MAX] = {};
#pragma unroll 4
    for (int i = lane * 8; i < D; i += 8 * DSV4_CUDA_WARP) {
        const uint4 w = *reinterpret_cast<const uint4 *>(g + i);
        const __nv_bfloat162 *w2 = reinterpret_cast<const __nv_bfloat162 *>(&w);
        float wf[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __bfloat1622float2(w2[j]);
            wf[2 * j] = f.x;
            wf[2 * j + 1] = f.y;
        }
#pragma unroll
        for (int b = 0; b < DSV4_CUDA_FETCH_ROWS_MAX; b++) {
            if (b >= B)
                break;
            const float4 x0 = *reinterpret_cast<const float4 *>(xn + (int64_t)b * D + i);
            const float4 x1 = *reinterpret_cast<const float4 *>(xn + (int64_t)b * D + i + 4);
            acc[b] += wf[0] * x0.x + wf[1] * x0.y + wf[2] * x0.z + wf[3] * x0.w + wf[4] * x1.x + wf[5] * x1.y +
                      wf[6] * x1.z + wf[7] * x1.w;
        }
    }
    float *out = logits + (int64_t)blockIdx.y * B * E;
#pragma unroll
    for (int b = 0; b < DSV4_CUDA_FETCH_ROWS_MAX; b++) {
        if (b >= B)
            break;
        const float v = dsv4_warp_sum(acc[b]);
        if (lane == 0)
            out[(int64_t)b * E + e] = v;
    }
}

/* A block per target (layer l): each row's top-K as the router ranks them (score + bias, ties to the
 * lower index; a hash layer's table), then the first DSV4_CUDA_FETCH_SLOTS host experts by choice rank,
 * then row: a slot of l's set that already holds one keeps it, the others take the slots left (their
 * key changes, so none of their chunks counts until copied again). The job of a slot whose chunks are
 * not all there yet goes to jobs[target, rank]. */
__global__ void __launch_bounds__(FETCH_PLAN_THREADS)
fetch_plan_kernel(const struct dsv4_cuda_fetch f, const struct dsv4_cuda_fetch_targets tg,
                  const int32_t *__restrict__ tokens, int B, int K)
{
    constexpr int S = DSV4_CUDA_FETCH_SLOTS;
    __shared__ float sel[FETCH_MAX_EXPERTS];
    __shared__ int cand[DSV4_CUDA_FETCH_ROWS_MAX * DSV4_MAX_TOPK];
    __shared__ int slot_of[S];
    __shared__ uint32_t key[S];
    __shared__ int missing[S];
    dsv4_pdl_enter();
    const int a = blockIdx.x, tid = threadIdx.x, E = f.n_experts;
    const struct dsv4_cuda_fetch_target *T = &tg.t[a];
    const int l = T->layer;
    struct dsv4_cuda_fetch_slot *set = dsv4_cuda_fetch_set(&f, l);

    for (int i = tid; i < B * K; i += blockDim.x)
        cand[i] = -1;
    __syncthreads();
    for (int b = 0; b < B; b++) {
        if (T->tid2eid) {
            if (tid < K)
                cand[b * K + tid] = T->tid2eid[(int64_t)tokens[b] * K + tid];
            continue;
        }
        const float *lg = f.logits + ((int64_t)a * B + b) * E;
        for (int e = tid; e < E; e += blockDim.x) {
            const float v = dsv4_route_score(lg[e]) + (T->bias ? T->bias[e] : 0.0f);
            sel[e] = v == v ? v : -INFINITY;
        }
        __syncthreads();
        for (int e = tid; e < E; e += blockDim.x) {
            const float v = sel[e];
            int rank = 0;
            for (int j = 0; j < E && rank < K; j++)
                rank += sel[j] > v || (sel[j] == v && j < e);
            if (rank < K)
                cand[b * K + rank] = e;
        }
        __syncthreads();
    }
    __syncthreads();
    if (tid == 0) {
        int n = 0, pick[S], where[S];
        bool taken[S] = {};
        for (int k = 0; k < K && n < S; k++)
            for (int b = 0; b < B && n < S; b++) {
                const int e = cand[b * K + k];
                bool dup = false;
                for (int j = 0; j < n; j++)
                    dup |= pick[j] == e;
                if (e >= 0 && e < E && f.on_host[(int64_t)l * E + e] && !dup)
                    pick[n++] = e;
            }
        for (int p = 0; p < n; p++) {
            where[p] = -1;
            for (int s = 0; s < S && where[p] < 0; s++)
                if (!taken[s] && set[s].key == dsv4_cuda_fetch_key(l, pick[p])) {
                    taken[s] = true;
                    where[p] = s;
                }
        }
        for (int p = 0; p < n; p++)
            for (int s = 0; s < S && where[p] < 0; s++)
                if (!taken[s]) {
                    taken[s] = true;
                    where[p] = s;
                    set[s].key = dsv4_cuda_fetch_key(l, pick[p]);
                }
        for (int r = 0; r < S; r++) {
            slot_of[r] = r < n ? where[r] : -1;
            key[r] = r < n ? dsv4_cuda_fetch_key(l, pick[r]) : 0;
            missing[r] = 0;
        }
    }
    __syncthreads();
    const int chunks = dsv4_cuda_fetch_chunks(&f);
    for (int i = tid; i < S * chunks; i += blockDim.x) {
        const int r = i / chunks, c = i % chunks;
        if (slot_of[r] >= 0 && set[slot_of[r]].done[c] != key[r])
            atomicOr(&missing[r], 1);
    }
    __syncthreads();
    if (tid < S) {
        struct dsv4_cuda_fetch_job j;
        j.slot = slot_of[tid] >= 0 && missing[tid] ? (l % DSV4_CUDA_FETCH_SETS) * S + slot_of[tid] : -1;
        j.key = key[tid];
        f.jobs[a * S + tid] = j;
    }
}

/* FETCH_COPY_CTAS blocks walk the jobs in order (the nearest layer first, its likelier expert first),
 * the chunks of a job's slot strided over the blocks, skipping those already there; a chunk is
 * published once its bytes are written. Before each chunk a block looks at the stop words: the copy
 * ends once a later predict or a resolve cancelled its tag, and leaves a target once it is resolved. */
__global__ void __launch_bounds__(FETCH_COPY_THREADS)
fetch_copy_kernel(const struct dsv4_cuda_fetch f, const struct dsv4_cuda_fetch_targets tg, int layer)
{
    enum { COPY, HAVE, RESOLVED, STOP };
    __shared__ int what;
    dsv4_pdl_enter();
    const unsigned long long step = f.words[DSV4_CUDA_FETCH_STEP], tag = dsv4_cuda_fetch_tag(step, layer);
    const int chunks = dsv4_cuda_fetch_chunks(&f), up_blocks = dsv4_cuda_fetch_up_blocks(&f);
    for (int j = 0; j < tg.n * DSV4_CUDA_FETCH_SLOTS; j++) {
        const struct dsv4_cuda_fetch_job job = f.jobs[j];
        if (job.slot < 0)
            continue;
        const struct dsv4_cuda_fetch_target *T = &tg.t[j / DSV4_CUDA_FETCH_SLOTS];
        const unsigned long long ttag = dsv4_cuda_fetch_tag(step, T->layer);
        struct dsv4_cuda_fetch_slot *sl = f.slots + job.slot;
        const struct dsv4_cuda_expert *src = &T->table[job.key & 0xffffu];
        for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
            if (threadIdx.x == 0) {
                const unsigned long long cancel = load_relaxed(f.words + DSV4_CUDA_FETCH_CANCEL);
                const unsigned long long resolved = load_relaxed(f.words + DSV4_CUDA_FETCH_RESOLVED);
                const uint32_t d = *reinterpret_cast<volatile const uint32_t *>(sl->done + c);
                what = cancel >= tag ? STOP : resolved >= ttag ? RESOLVED : d == job.key ? HAVE : COPY;
            }
            __syncthreads();
            const int w = what;
            if (w == STOP)
                return;
            if (w == RESOLVED)
                break;
            fetch_chunk k = {};
            if (w == COPY) {
                k = chunk_at(src, &sl->ex, c, up_blocks);
                copy_bytes(k.dw, k.w, k.wb);
                copy_bytes(k.ds, k.s, k.sb);
            }
            __syncthreads();        /* every thread's stores of the chunk (and read of `what`) first */
            if (w == COPY && threadIdx.x == 0) {
                __threadfence();
                asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(sl->done + c), "r"(job.key) : "memory");
                atomicAdd(f.words + DSV4_CUDA_FETCH_COPIED, (unsigned long long)(k.wb + k.sb));
            }
        }
    }
}

/* The main lane, after the layer's router (idx [pairs]) and the plan that covered the layer: the copy
 * takes no more of the layer's chunks; the redirect entries this layer set last time are cleared and
 * each routed slot expert's entry names the tiles whose chunks all hold its key (acquired); the copy
 * stops when some routed host expert is not all in a slot. */
__global__ void __launch_bounds__(FETCH_RESOLVE_THREADS)
fetch_resolve_kernel(const struct dsv4_cuda_fetch f, int layer, const int32_t *__restrict__ idx, int pairs)
{
    constexpr int W = DSV4_CUDA_FETCH_TILES_MAX / 64, S = DSV4_CUDA_FETCH_SLOTS;
    __shared__ unsigned long long up[S][W], down[S][W];
    __shared__ int expert[S], n_tiles[S];
    __shared__ uint32_t key[S];
    __shared__ bool routed[S];
    __shared__ int in_place;
    dsv4_pdl_enter();
    const int tid = threadIdx.x, E = f.n_experts, tiles = f.up_tiles + f.down_tiles;
    const int up_blocks = dsv4_cuda_fetch_up_blocks(&f);
    const unsigned long long tag = dsv4_cuda_fetch_tag(f.words[DSV4_CUDA_FETCH_STEP], layer);
    const struct dsv4_cuda_fetch_slot *set = dsv4_cuda_fetch_set(&f, layer);
    struct dsv4_cuda_fetch_redirect *red = f.redirect + (int64_t)layer * E;
    int32_t *was = f.redirected + (int64_t)layer * S;

    if (tid == 0) {
        atomicMax(f.words + DSV4_CUDA_FETCH_RESOLVED, tag);
        in_place = 0;
    }
    if (tid < S) {
        const int e = was[tid];
        if (e >= 0)
            for (int i = 0; i < W; i++)
                red[e].up[i] = red[e].down[i] = 0;
        was[tid] = -1;
        routed[tid] = false;
        n_tiles[tid] = 0;
        key[tid] = set[tid].key;
        expert[tid] = key[tid] >> 16 == (uint32_t)(layer + 1) ? (int)(key[tid] & 0xffffu) : -1;
    }
    for (int i = tid; i < S * W; i += blockDim.x) {
        up[i / W][i % W] = 0;
        down[i / W][i % W] = 0;
    }
    __syncthreads();
    /* tile t of gate_up reads block t utb .. of w1 and w3 (chunks 2b, 2b + 1); of down, blocks of w2 */
    for (int i = tid; i < S * tiles; i += blockDim.x) {
        const int sl = i / tiles, t = i % tiles;
        if (expert[sl] < 0)
            continue;
        const bool is_up = t < f.up_tiles;
        const int tt = is_up ? t : t - f.up_tiles;
        const int c0 = is_up ? 2 * tt * f.up_tile_blocks : 2 * up_blocks + tt * f.down_tile_blocks;
        const int n = is_up ? 2 * f.up_tile_blocks : f.down_tile_blocks;
        bool ok = true;
        for (int c = c0; c < c0 + n; c++) {
            uint32_t v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(set[sl].done + c) : "memory");
            ok &= v == key[sl];
        }
        if (ok) {
            atomicOr(is_up ? &up[sl][tt / 64] : &down[sl][tt / 64], 1ull << (tt % 64));
            atomicAdd(&n_tiles[sl], 1);
        }
    }
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x)
        for (int sl = 0; sl < S; sl++)
            if (expert[sl] >= 0 && idx[p] == expert[sl])
                routed[sl] = true;
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x) {
        const int e = idx[p];
        bool whole = false;
        for (int sl = 0; sl < S; sl++)
            whole |= expert[sl] == e && n_tiles[sl] == tiles;
        if (e >= 0 && e < E && f.on_host[(int64_t)layer * E + e] && !whole)
            in_place = 1;
    }
    if (tid < S && routed[tid]) {
        const int e = expert[tid];
        const struct dsv4_cuda_expert *x = &set[tid].ex;
        unsigned long long n_up = 0, n_down = 0;
        for (int i = 0; i < W; i++) {
            red[e].up[i] = up[tid][i];
            red[e].down[i] = down[tid][i];
            n_up += __popcll(up[tid][i]);
            n_down += __popcll(down[tid][i]);
        }
        red[e].w[0] = x->w1.w;
        red[e].w[1] = x->w3.w;
        red[e].w[2] = x->w2.w;
        red[e].s[0] = x->w1.scale;
        red[e].s[1] = x->w3.scale;
        red[e].s[2] = x->w2.scale;
        was[tid] = e;
        const unsigned long long blk = DSV4_CUDA_TILE_BYTES + DSV4_CUDA_TILE_SCALE_BYTES;
        atomicAdd(f.words + DSV4_CUDA_FETCH_USED,
                  n_up * 2 * f.up_tile_blocks * (x->w1.in / DSV4_CUDA_TILE_KT) * blk +
                      n_down * f.down_tile_blocks * (x->w2.in / DSV4_CUDA_TILE_KT) * blk);
    }
    __syncthreads();
    if (tid == 0 && in_place)
        atomicMax(f.words + DSV4_CUDA_FETCH_CANCEL, tag);
}

static int check_layer(const struct dsv4_cuda_fetch *f, int layer)
{
    if (!f || layer < 0 || layer >= f->n_layers)
        return dsv4_error_set(-EINVAL, "cuda fetch: layer %d of %d", layer, f ? f->n_layers : 0);
    return 0;
}

/* The targets of a prediction at `layer`: 1 .. ahead of them, layers from `layer` on in order, each a
 * hash table or a BF16 gate of 16-byte rows, and an expert table. */
static int check_targets(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_fetch_targets *tg)
{
    int rc = check_layer(f, layer);
    if (rc < 0)
        return rc;
    if (tg->n < 1 || tg->n > f->ahead)
        return dsv4_error_set(-EINVAL, "cuda fetch: %d target layers at layer %d (1..%d)", tg->n, layer, f->ahead);
    for (int i = 0; i < tg->n; i++) {
        const struct dsv4_cuda_fetch_target *t = &tg->t[i];
        if (t->layer < layer || t->layer >= f->n_layers || (i && t->layer <= tg->t[i - 1].layer) || !t->table ||
            (!t->tid2eid && (!t->gate || t->ldg % 8)))
            return dsv4_error_set(-EINVAL, "cuda fetch: target %d (layer %d) of the prediction at layer %d: layers "
                                  "must rise from it, each with an expert table and a hash table or a BF16 gate "
                                  "of rows a multiple of 8 apart", i, t->layer, layer);
    }
    return 0;
}

extern "C" int dsv4_cuda_fetch_step(const struct dsv4_cuda_fetch *f, void *stream)
{
    dsv4_launch(fetch_step_kernel, dim3(1), dim3(1), 0, static_cast<cudaStream_t>(stream), f->words);
    DSV4_CUDA_LAUNCHED("fetch_step");
    return 0;
}

extern "C" int dsv4_cuda_fetch_predict(const struct dsv4_cuda_fetch *f, int layer,
                                       const struct dsv4_cuda_fetch_targets *tg, const float *d_xn, int B, int D,
                                       void *stream)
{
    const int rc = check_targets(f, layer, tg);
    if (rc < 0)
        return rc;
    if (B < 1 || B > f->rows || D < 8 || D % 8)
        return dsv4_error_set(-EINVAL, "cuda fetch: predicting %d rows (1..%d) of width %d (a multiple of 8)", B,
                              f->rows, D);
    dsv4_launch(fetch_predict_kernel, dim3((f->n_experts + FETCH_PREDICT_WARPS - 1) / FETCH_PREDICT_WARPS, tg->n),
                dim3(FETCH_PREDICT_WARPS * DSV4_CUDA_WARP), 0, static_cast<cudaStream_t>(stream), *tg, d_xn, B, D,
                f->n_experts, f->logits, f->words, layer);
    DSV4_CUDA_LAUNCHED("fetch_predict");
    return 0;
}

extern "C" int dsv4_cuda_fetch_plan(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_fetch_targets *tg,
                                    const int32_t *d_tokens, int B, int K, void *stream)
{
    const int rc = check_targets(f, layer, tg);
    if (rc < 0)
        return rc;
    if (B < 1 || B > f->rows || K < 1 || K > DSV4_MAX_TOPK || K > f->n_experts || f->n_experts > FETCH_MAX_EXPERTS ||
        !d_tokens)
        return dsv4_error_set(-EINVAL, "cuda fetch: planning %d rows (1..%d) of top-%d (1..%d) among %d experts "
                              "(at most %d), token ids %s", B, f->rows, K, DSV4_MAX_TOPK, f->n_experts,
                              FETCH_MAX_EXPERTS, d_tokens ? "given" : "missing");
    dsv4_launch(fetch_plan_kernel, dim3(tg->n), dim3(FETCH_PLAN_THREADS), 0, static_cast<cudaStream_t>(stream), *f,
                *tg, d_tokens, B, K);
    DSV4_CUDA_LAUNCHED("fetch_plan");
    return 0;
}

extern "C" int dsv4_cuda_fetch_copy(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_fetch_targets *tg,
                                    void *stream)
{
    const int rc = check_targets(f, layer, tg);
    if (rc < 0)
        return rc;
    dsv4_launch(fetch_copy_kernel, dim3(FETCH_COPY_CTAS), dim3(FETCH_COPY_THREADS), 0,
                static_cast<cudaStream_t>(stream), *f, *tg, layer);
    DSV4_CUDA_LAUNCHED("fetch_copy");
    return 0;
}

extern "C" int dsv4_cuda_fetch_resolve(const struct dsv4_cuda_fetch *f, int layer, const int32_t *d_idx, int B, int K,
                                       void *stream)
{
    const int rc = check_layer(f, layer);
    if (rc < 0)
        return rc;
    if (B < 1 || B > f->rows || K < 1 || K > DSV4_MAX_TOPK)
        return dsv4_error_set(-EINVAL, "cuda fetch: resolving %d rows (1..%d) of top-%d (1..%d)", B, f->rows, K,
                              DSV4_MAX_TOPK);
    dsv4_launch(fetch_resolve_kernel, dim3(1), dim3(FETCH_RESOLVE_THREADS), 0, static_cast<cudaStream_t>(stream), *f,
                layer, d_idx, B * K);
    DSV4_CUDA_LAUNCHED("fetch_resolve");
    return 0;
}
