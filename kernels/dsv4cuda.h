/* SPDX-License-Identifier: MIT */
/* The CUDA backend's C interface: the per-device state (one arena, streams, cuBLASLt, graphs) and
 * the kernel launchers, each checked in tests/gpu against its CPU twin (engine/cpu/cpu_twin_cuda.h).
 * Pointers named d_* are device pointers; `stream` is a cudaStream_t passed as void * so that C
 * callers need no CUDA headers. Launchers return 0 or -errno with dsv4_error_set(). */
#ifndef DSV4_KERNELS_DSV4CUDA_H
#define DSV4_KERNELS_DSV4CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "engine/backend.h"
#include "engine/model/weights.h"

#define DSV4_CUDA_MAX_BATCH 64          /* decode rows per step: the largest graph bucket */
#define DSV4_CUDA_MAX_ROWS DSV4_PREFILL_CHUNK_MAX     /* rows of one step: the longest prefill chunk */
#define DSV4_CUDA_ARENA_ALIGN 256       /* bytes; every arena carve-out starts on this boundary */
#define DSV4_CUDA_LT_WORKSPACE (32u << 20)   /* cuBLASLt workspace bytes (prefill GEMMs) */
#define DSV4_CUDA_ACT_BLOCK 128         /* official activation quantization block along K */
#define DSV4_CUDA_GPU_MARGIN ((size_t)512 << 20)    /* device bytes the boot plan leaves free (graphs, the
                                                     * runtime's own needs) before placing routed experts */

/* A linear layer as it lives on the device: same meaning as struct dsv4_linear (engine/model/weights.h),
 * with w and scale pointing into the device arena. */
struct dsv4_cuda_linear {
    enum dsv4_wfmt fmt;
    int64_t out, in;
    int64_t row_stride;         /* elements (FP4: values) between rows */
    const void *w;
    const uint8_t *scale;       /* FP8: [ceil(out/128), ceil(in/128)]; FP4: [out, in/32]; else NULL */
    int64_t scale_stride;       /* bytes between scale rows */
    int64_t scale_row0;         /* FP8: rows of the 128x128 scale grid above row 0 (a view starting
                                 * mid-block, e.g. one group of wo_a); 0 otherwise */
};

/* Rows [r0, r0 + n) of the whole linear W as a linear of their own (one group of wo_a). An FP8 view
 * may start mid scale block (scale_row0). */
static inline struct dsv4_cuda_linear dsv4_cuda_linear_rows(const struct dsv4_cuda_linear *W, int64_t r0, int64_t n)
{
    struct dsv4_cuda_linear v = *W;
    v.out = n;
    if (v.fmt == DSV4_W_FP8) {
        v.scale += (r0 / 128) * v.scale_stride;
        v.scale_row0 = r0 % 128;
    } else if (v.fmt == DSV4_W_FP4) {
        v.scale += r0 * v.scale_stride;
    }
    v.w = (const uint8_t *)v.w + r0 * (v.fmt == DSV4_W_F32 ? 4 * v.row_stride : v.fmt == DSV4_W_BF16 ? 2 * v.row_stride :
                                       v.fmt == DSV4_W_FP8 ? v.row_stride : v.row_stride / 2);
    return v;
}

/* One layer's routed experts on the device: a table of E entries of three linears, w1/w3 [I, D]
 * and w2 [D, I], all in one format (FP4 in the release; F32/BF16/FP8 in other checkpoints).
 *
 * An FP4 expert linear [out, in] may be stored in k-tile blocks, the order the tensor-core expert
 * kernel reads it in, so that each of its reads is 2 KB contiguous instead of 64 bytes of each of
 * 32 rows (from host memory over PCIe that is most of the link's rate; from the GPU's own memory,
 * fewer DRAM pages opened per byte read): with nk = in / 128, rows r..r+31 (r a multiple of 32) of
 * k-tile kt are the block at ((r / 32) * nk + kt) * 2048 bytes, row by row (64 bytes each), and
 * their scales (4 UE8M0 bytes a row) the block at ((r / 32) * nk + kt) * 128. Each 32-bit word of a
 * row's bytes holds its 8 values with their bits in the order the kernel decodes fastest
 * (fp4_tile_word in moe.cu), not the checkpoint's nibbles. */
#define DSV4_CUDA_TILE_ROWS 32
#define DSV4_CUDA_TILE_BYTES (DSV4_CUDA_TILE_ROWS * 64)
#define DSV4_CUDA_TILE_SCALE_BYTES (DSV4_CUDA_TILE_ROWS * 4)

#define DSV4_CUDA_TILE_KT 128      /* K values of a k-tile: 64 bytes of a row */

struct dsv4_cuda_expert {
    struct dsv4_cuda_linear w1, w3, w2;
};

/* Host experts fetched ahead into device slots in decode steps (kernels/expert_fetch.cu has the
 * protocol). When a layer's attention input is ready, the routers of that layer and of the next
 * dsv4_cuda_fetch.ahead - 1 ones predict their routing from it, and up to DSV4_CUDA_FETCH_SLOTS
 * predicted host experts of each are copied into that layer's set of slots (set l % SETS for layer l;
 * one expert is the common case at batch 1: 6 of 256 experts routed and ~7% on the host for the whole
 * Flash; each slot costs an expert's bytes of GPU memory). A slot keeps what it holds until a later
 * prediction needs it, so an expert routed again finds its bytes still there. */
#define DSV4_CUDA_FETCH_SLOTS 2
#define DSV4_CUDA_FETCH_AHEAD_MAX 3         /* layers one prediction covers, at most (the switch's range) */
#define DSV4_CUDA_FETCH_SETS DSV4_CUDA_FETCH_AHEAD_MAX  /* a layer's prediction writes the sets of its targets,
                                                         * none of which the expert kernels still read */
#define DSV4_CUDA_FETCH_LAYERS_MAX 255      /* the copy tags keep the layer in 8 bits */
#define DSV4_CUDA_FETCH_TILES_MAX 128       /* decode expert tiles of a matrix the masks hold (Flash 64, Pro 112) */
/* Steps of up to this many rows fetch ahead. A larger batch routes to several of a layer's host
 * experts and reads them through the whole MoE sublayer, so the link is busy anyway, and the union of
 * its rows' predictions is spread over more experts than the slots hold, so copies of the wrong ones
 * take the link from the reads: on the 4-layer Flash with 10% of its experts on the host a step of 8
 * rows was 0.7-2.1% slower fetching than reading in place, and 2.0-2.7% slower fetching three layers
 * ahead than one, in two runs each; 4 rows and fewer gain (kernels/NOTES.md). */
#define DSV4_CUDA_FETCH_ROWS_MAX 4

struct dsv4_cuda_fetch_slot {
    struct dsv4_cuda_expert ex;     /* the slot's device copy: the host experts' shapes, k-tile blocks */
    uint32_t *done;                 /* [chunks]: the key (dsv4_cuda_fetch_key) whose bytes chunk c holds, 0 none */
    uint32_t key;                   /* the layer and expert the slot holds or is being filled with, 0 none */
};

/* A copy's work item: slot (index into dsv4_cuda_fetch.slots, -1 none) to fill with key's expert. */
struct dsv4_cuda_fetch_job {
    int32_t slot;
    uint32_t key;
};

/* One layer a prediction covers: its router (BF16 gate [E, D], row stride ldg; the selection bias, or
 * the hash table for a hash layer) and its expert table (sources of the copy). */
struct dsv4_cuda_fetch_target {
    const void *gate;
    int64_t ldg;
    const float *bias;
    const int32_t *tid2eid;
    const struct dsv4_cuda_expert *table;
    int layer;
};

struct dsv4_cuda_fetch_targets {
    struct dsv4_cuda_fetch_target t[DSV4_CUDA_FETCH_AHEAD_MAX];
    int n;
};

/* One expert of a layer, as the decode expert kernels find it: tiles whose bit is set read the slot's
 * bytes (w1, w3, w2 and their scales, the table's layout), the others where the table points. */
struct dsv4_cuda_fetch_redirect {
    const void *w[3];
    const uint8_t *s[3];
    uint64_t up[DSV4_CUDA_FETCH_TILES_MAX / 64];        /* gate_up tiles */
    uint64_t down[DSV4_CUDA_FETCH_TILES_MAX / 64];      /* down tiles */
};

/* dsv4_cuda_fetch.words */
enum {
    DSV4_CUDA_FETCH_STEP,           /* decode steps so far that fetched */
    DSV4_CUDA_FETCH_COPIED,         /* bytes copied into slots */
    DSV4_CUDA_FETCH_USED,           /* bytes the resolves pointed the expert kernels at */
    DSV4_CUDA_FETCH_CANCEL,         /* copies launched with a tag up to this one stop at their next chunk */
    DSV4_CUDA_FETCH_RESOLVED,       /* layers whose tag is up to this one are resolved: no more chunks for them */
    DSV4_CUDA_FETCH_WORDS
};

struct dsv4_cuda_fetch {
    struct dsv4_cuda_fetch_slot *slots;     /* device [DSV4_CUDA_FETCH_SETS * DSV4_CUDA_FETCH_SLOTS] */
    struct dsv4_cuda_fetch_job *jobs;       /* device [DSV4_CUDA_FETCH_AHEAD_MAX * DSV4_CUDA_FETCH_SLOTS]: the
                                             * current copy's, target by target */
    const uint8_t *on_host;                 /* device [n_layers, n_experts]: 1 where the expert lives on the host */
    unsigned long long *words;              /* device [DSV4_CUDA_FETCH_WORDS] */
    float *logits;                          /* device [ahead, rows, n_experts]: the predictions' router logits */
    struct dsv4_cuda_fetch_redirect *redirect;  /* device [n_layers, n_experts], all clear but what resolve set */
    int32_t *redirected;                    /* device [n_layers, DSV4_CUDA_FETCH_SLOTS]: the experts it set, -1 */
    int n_layers, n_experts;
    int ahead;                              /* layers one prediction covers (DSV4_CUDA_EXPERT_FETCH) */
    int rows;                               /* the most rows a step fetches for: max_batch, at most
                                             * DSV4_CUDA_FETCH_ROWS_MAX */
    int up_tile_blocks, down_tile_blocks;   /* blocks a decode gate_up / down tile reads (of each matrix) */
    int up_tiles, down_tiles;               /* tiles of a decode gate_up / down launch, <= DSV4_CUDA_FETCH_TILES_MAX */
};

#ifdef __CUDACC__
/* DSV4_CUDA_TILE_ROWS-row blocks of w1 (and of w3): I / 32 */
static inline __host__ __device__ int dsv4_cuda_fetch_up_blocks(const struct dsv4_cuda_fetch *f)
{
    return f->up_tiles * f->up_tile_blocks;
}

/* an expert's chunks: 2 up_blocks + D / 32 */
static inline __host__ __device__ int dsv4_cuda_fetch_chunks(const struct dsv4_cuda_fetch *f)
{
    return 2 * dsv4_cuda_fetch_up_blocks(f) + f->down_tiles * f->down_tile_blocks;
}

/* A step's tag for layer l: the step (words[STEP]) and the layer, increasing through a step and from
 * one step to the next, so that "stop everything up to here" is one atomicMax; 0 is no layer's. */
static inline __host__ __device__ unsigned long long dsv4_cuda_fetch_tag(unsigned long long step, int layer)
{
    return step << 8 | (unsigned long long)(layer + 1);
}

/* What a slot holds: the layer and expert (weights never change, so bytes once copied for a key stay
 * right for it until the slot takes another key); 0 is nothing. */
static inline __host__ __device__ uint32_t dsv4_cuda_fetch_key(int layer, int expert)
{
    return (uint32_t)(layer + 1) << 16 | (uint32_t)expert;
}

static inline __host__ __device__ struct dsv4_cuda_fetch_slot *dsv4_cuda_fetch_set(const struct dsv4_cuda_fetch *f,
                                                                                   int layer)
{
    return f->slots + (layer % DSV4_CUDA_FETCH_SETS) * DSV4_CUDA_FETCH_SLOTS;
}
#endif

struct dsv4_cuda_experts {
    int n_experts, dim, inter;  /* E, D, I */
    float swiglu_limit;         /* 0 = no clamp */
    enum dsv4_wfmt fmt;         /* of every expert linear */
    bool quant_act;             /* round the SwiGLU output through e4m3 1x128 before w2 (fp8 numerics, quantized fmt) */
    bool tiled;                 /* every expert of the table in k-tile blocks, none otherwise: only the
                                 * tensor-core path may run them */
    const struct dsv4_cuda_expert *d_table;     /* [E], in device memory */
    /* decode steps of a layer that fetches host experts ahead (the caller sets it; NULL: none): [E]
     * where the decode expert kernels read each expert's tiles (dsv4_cuda_fetch_resolve) */
    const struct dsv4_cuda_fetch_redirect *fetch_redirect;
};

/* Whether experts of this format and shape, with activations quantized (fp8 numerics) or not, run on
 * the tensor-core kernel, which is the one that reads tiled experts; DSV4_CUDA_MOE_TILES=0 says no. */
bool dsv4_cuda_moe_tiles(enum dsv4_wfmt fmt, int dim, int inter, bool quant_act);
/* Write the FP4 linear [out, in] (rows `pitch` bytes apart, scale rows `scale_pitch` apart) in k-tile
 * blocks: out * in / 2 bytes to w, out * in / 32 to scale. out a multiple of 32, in of 128. */
void dsv4_cuda_tile_fp4(const uint8_t *src, int64_t pitch, const uint8_t *src_scale, int64_t scale_pitch, int64_t out,
                        int64_t in, uint8_t *w, uint8_t *scale);
/* The same blocks written on the device: d_src and d_src_scale a device copy of the row-major
 * linear, d_w and d_scale device memory that does not overlap it. */
int dsv4_cuda_tile_fp4_dev(const uint8_t *d_src, int64_t pitch, const uint8_t *d_src_scale, int64_t scale_pitch,
                           int64_t out, int64_t in, uint8_t *d_w, uint8_t *d_scale, void *stream);

/* Scratch the expert launcher needs, carved from the arena for up to max_pairs = batch * topk. */
struct dsv4_cuda_moe_ws {
    int32_t *d_groups;          /* [3 * max_pairs + 2] expert ids, group starts, pair list, count */
    float *d_h;                 /* [max_pairs, I] SwiGLU output, FP8-rounded */
    float *d_out;               /* [max_pairs, D] per-pair expert outputs */
};

/* ---- per-device state ---- */

/* Kernel variants, counted per launch (a captured graph counts its launches once, at capture). */
enum dsv4_cuda_variant {
    DSV4_CUDA_V_GEMV_F32,
    DSV4_CUDA_V_GEMV_BF16,
    DSV4_CUDA_V_GEMV_FP8,
    DSV4_CUDA_V_GEMV_FP4,
    DSV4_CUDA_V_EXPERTS_FP4,        /* FP4 experts with fp8 numerics on tensor cores (bf16 MMA) */
    DSV4_CUDA_V_EXPERTS_OTHER,      /* F32/BF16/FP8 experts (small test models) */
    DSV4_CUDA_V_MHC_FN_SPLITK,      /* the mHC fn GEMV split along K (dsv4_cuda_mhc_fn) */
    DSV4_CUDA_V_MHC_PRE,            /* mHC pre: norm, gates, Sinkhorn, collapse */
    DSV4_CUDA_V_GEMM_FP8_MMA,       /* FP8 weights x 1x128 e4m3 activations on tensor cores (dsv4_cuda_gemm) */
    DSV4_CUDA_V_GEMM_BF16_MMA,      /* BF16 weights x f32 activations as bf16 hi + lo on tensor cores */
    DSV4_CUDA_V_GEMM_FP8RAW_MMA,    /* FP8 weights x raw f32 activations as f16 hi + lo on tensor cores */
    DSV4_CUDA_V_ATTENTION_MMA,      /* decode attention over FP8 KV entries on tensor cores (bf16 hi + lo) */
    DSV4_CUDA_V_ATTENTION_F32,      /* decode attention over f32 KV entries (exact numerics), FMA */
    DSV4_CUDA_V_INDEXER_MMA,        /* indexer scores over FP4 keys on tensor cores */
    DSV4_CUDA_V_INDEXER_FMA,        /* indexer scores, thread per entry (f32 keys, other FP4 widths) */
    DSV4_CUDA_V_EXPERTS_FP4_FMA,    /* FP4 experts without activation quantization (exact numerics), FMA */
    DSV4_CUDA_V_GEMM_FP8_WGMMA,     /* FP8 linears of prefill chunks on warpgroup MMAs (sm_90a; same bits) */
    DSV4_CUDA_V_ATTENTION_WHOLE,    /* prefill attention over FP8 KV entries, a block per row's runs (same bits) */
    DSV4_CUDA_V_GEMM_DIRECT,        /* linears of <= 8 rows, weights streamed into registers (same bits) */
    DSV4_CUDA_V_GEMM_WGMMA_DECODE,  /* FP8 and BF16 linears of decode batches of 9-64 rows on warpgroup MMAs (same bits) */
    DSV4_CUDA_V_EXPERTS_FP4_WGMMA,  /* FP4 experts of prefill chunks on warpgroup MMAs (sm_90a; same bits) */
    DSV4_CUDA_V_COUNT,
};
const char *dsv4_cuda_variant_name(enum dsv4_cuda_variant v);
/* Launch counts per variant since process start (all devices). */
uint64_t dsv4_cuda_variant_launches(enum dsv4_cuda_variant v);


struct dsv4_cuda_dev;

struct dsv4_cuda_dev_stats {
    uint64_t device_allocs;     /* cudaMalloc calls since create (the arena: 1) */
    uint64_t graph_captures;
    uint64_t arena_bytes;       /* total arena */
    uint64_t weight_bytes;      /* weights as uploaded (checkpoint formats) */
    uint64_t cache_bytes;       /* per-slot caches */
    uint64_t workspace_bytes;   /* activations, scratch, cuBLASLt workspace */
    uint64_t prefix_bytes;      /* the prefix-cache pool and its copy tables (kernels/prefix.cu) */
    uint64_t host_allocs;       /* pinned host allocations (1 when routed experts live in host memory, else 0) */
    uint64_t gpu_expert_bytes;  /* routed experts on the device (part of weight_bytes) */
    uint64_t host_expert_bytes; /* routed experts in pinned host memory, read in place over PCIe */
    uint64_t host_embed_bytes;  /* the token embedding there too (when experts are): a row read per token */
    uint32_t experts_gpu, experts_host;     /* routed experts by where they live, all layers */
    uint64_t launches[DSV4_CUDA_V_COUNT];  /* per-variant launch counters (process-wide) */
    char device_name[96];
    int cc_major, cc_minor;
    int sm_count;
    char kernel_build[48];      /* which compiled kernel image runs: "sm_90a cubin", "compute_80 PTX (JIT)" */
};

/* The CUDA backend over opts->gpus[0 .. n_gpus) with the routed experts split across them
 * (kernels/ep_backend.cu); dsv4_backend_cuda_create takes this path for two or more GPUs. One GPU
 * listed runs the same path as a single rank (the tests compare it with the plain backend). */
int dsv4_cuda_ep_backend_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                                struct dsv4_backend **ret);

/* Count usable GPUs; 0 with a reason in dsv4_error_message() when none. */
int dsv4_cuda_device_count(void);

/* Boot one device: one cudaMalloc sized for weights + caches (opts->max_batch + 1 slots of
 * opts->max_context tokens, the last for padding rows) + the decode step's workspace, weights uploaded in their checkpoint formats, streams and
 * the cuBLASLt handle made, kernel variants chosen and logged through `log` (may be NULL). */
int dsv4_cuda_dev_create(int ordinal, const struct dsv4_weights *w,
                         const struct dsv4_backend_opts *opts,
                         void (*log)(void *ctx, const char *line), void *log_ctx,
                         struct dsv4_cuda_dev **ret);
void dsv4_cuda_dev_destroy(struct dsv4_cuda_dev *dev);     /* accepts NULL */
void dsv4_cuda_dev_get_stats(const struct dsv4_cuda_dev *dev, struct dsv4_cuda_dev_stats *ret);
/* Device copies of the weights: the model's linears, looked up by checkpoint name; NULL if absent. */
const struct dsv4_cuda_linear *dsv4_cuda_dev_linear(const struct dsv4_cuda_dev *dev, const char *name);
/* Device copy of a host linear of w (matched by its checkpoint bytes and shape); NULL if absent. */
const struct dsv4_cuda_linear *dsv4_cuda_dev_linear_for(const struct dsv4_cuda_dev *dev, const struct dsv4_linear *host);
/* Host experts fetched ahead in decode steps (kernels/expert_fetch.cu): NULL when off (no expert on the
 * host, or what fetch_plan_bytes in device.cu refuses, named in the boot log). fetch_counts: bytes
 * copied into slots and bytes the expert kernels read from them, over the steps finished so far. */
const struct dsv4_cuda_fetch *dsv4_cuda_dev_fetch(const struct dsv4_cuda_dev *dev);
int dsv4_cuda_dev_fetch_counts(const struct dsv4_cuda_dev *dev, uint64_t *copied, uint64_t *used);
/* Where each routed expert lives (engine/model/placement.h), decided at create. */
const struct dsv4_placement *dsv4_cuda_dev_placement(const struct dsv4_cuda_dev *dev);
/* The backend stats' expert fields: experts and bytes on each side, and per layer. */
void dsv4_cuda_dev_expert_stats(const struct dsv4_cuda_dev *dev, struct dsv4_backend_stats *ret);
/* Layer's device counters of tokens routed to each expert [n_experts] (dsv4_cuda_route_count adds
 * to them); NULL for a layer out of range. */
uint64_t *dsv4_cuda_dev_route_counts(const struct dsv4_cuda_dev *dev, int layer);
/* Copy every layer's counters to counts [n_layers * n_experts] (the steps finished so far). */
int dsv4_cuda_dev_read_route_counts(const struct dsv4_cuda_dev *dev, uint64_t *counts);
/* The per-slot caches ((max_batch + 1) slots; the step lays them out). */
void *dsv4_cuda_dev_caches(const struct dsv4_cuda_dev *dev);
/* Carve `bytes` of workspace from the arena's free tail (boot only: fails after dsv4_cuda_dev_seal). */
int dsv4_cuda_dev_carve(struct dsv4_cuda_dev *dev, size_t bytes, void **ret);
/* After this, carving and capture are refused: the READY state. */
void dsv4_cuda_dev_seal(struct dsv4_cuda_dev *dev);
void *dsv4_cuda_dev_stream(const struct dsv4_cuda_dev *dev);
/* Device copy of a small host vector of the weights (norm weights, biases, hc base/scale, sinks,
 * ape, tid2eid), found by its host address; NULL if it was not uploaded. */
const void *dsv4_cuda_dev_vector(const struct dsv4_cuda_dev *dev, const void *host);
/* Layer's routed experts (one format for all; quant_act false: the caller sets it per numerics);
 * -ENOENT when they are absent or mixed. */
int dsv4_cuda_dev_experts(const struct dsv4_cuda_dev *dev, int layer, struct dsv4_cuda_experts *ret);
/* One line per op: the variant chosen at boot (also written to the boot log). */
const char *dsv4_cuda_dev_variants(const struct dsv4_cuda_dev *dev);

/* ---- kernels (tests/gpu/test_gpu_*.c check each against its twin) ---- */


/* d_y[b, i] = round through e4m3 of d_x[b, i] in 1x`block` groups with a UE8M0 scale (the official
 * activation quantizer), b < rows, i < k; when block does not divide k the last group of a row is
 * shorter (as engine/model/quant.c; only small test models have such widths). d_y may equal d_x. */
int dsv4_cuda_fp8_roundtrip(const float *d_x, int rows, int64_t k, int block, float *d_y, void *stream);

/* d_y[b, n] = sum_k W[n, k] d_x[b, k] for b < batch (<= DSV4_CUDA_MAX_ROWS), f32 accumulation,
 * weights dequantized on the fly. FP8/FP4 weights expect d_x already FP8-rounded (the caller runs
 * dsv4_cuda_fp8_roundtrip, as the official code quantizes activations). Rows are ldx/ldy apart. */
int dsv4_cuda_gemv(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int batch,
                   float *d_y, int64_t ldy, void *stream);

/* Tensor-core linears (kernels/gemm.cu) for 1..DSV4_CUDA_MAX_ROWS rows: FP8 weights with the
 * official 1x128 e4m3 activation quantization done inside (quant_act; d_x is the raw f32 input) or
 * with raw f32 activations (f16 hi + lo per power-of-two-scaled 1x128 block), or BF16 weights with
 * raw f32 activations (bf16 hi + lo); both raw forms represent x to ~2^-17, and the results
 * measure 3e-7 to 1e-5 from f32 math (BF16 at K 4096 in one split up to 1.9e-5: the tensor-core
 * accumulator is not round-to-nearest; kernels/NOTES.md). F32 and FP4
 * linears stay on dsv4_cuda_gemv. Up to DSV4_CUDA_MAX_BATCH rows the weights are streamed once per
 * call; above it (prefill chunks) each block of 64 rows is a CTA of its own beside the others that
 * share its weight tile (read once from memory, then from L2). K is split by a count that depends
 * only on W's shape and the splits' partial sums are added in a fixed order (by a reduction launch,
 * by the kernel that reads a result left pending (struct dsv4_cuda_pending below), or above
 * DSV4_CUDA_MAX_BATCH rows inside the CTA that walks every split), so each row's result is
 * the same bits whatever the batch. The workspace is carved once at boot for `rows` rows of width
 * up to `max_k`. */
#define DSV4_CUDA_GEMM_PART_FLOATS_PER_ROW 65536   /* split-K partials per row: splits x out */
struct dsv4_cuda_gemm_ws {
    void *xa;                   /* [rows, K] f16 e4m3 values, or hi [rows, K] + lo [rows, K] (f16 or bf16) */
    float *sa;                  /* [rows, K/128] activation scales */
    float *part[2];             /* each [splits, min(rows, DSV4_CUDA_MAX_BATCH), out]: linears that split K
                                 * take them in turn, so one linear's partials can wait for their reader
                                 * (struct dsv4_cuda_pending) while the next linear writes its own */
    uint32_t part_seq;          /* linears that wrote partials so far; the last one used part[part_seq & 1] */
    int rows;
    int64_t max_k;
    struct {                    /* what xa and sa hold: the x, its rows and width, the form (set by each call) */
        const float *x;
        int64_t ldx, k;
        int rows, mode;
        bool wg_order;          /* 1x128 blocks in the wgmma kernel's order (kernels/gemm_wgmma.cu) */
    } prepared;
};
/* A linear's result left as its split-K partials instead of reduced by a launch of its own
 * (dsv4_cuda_gemm_deferred): value i of the dense result [rows, out] is the sum of part[s * plane + i]
 * over s < splits, in split order from 0.0f. That is the reduction launch's arithmetic, so a kernel that
 * reads its input this way (the consumers that take a pending input) gets the bits the reduction would
 * have written, one launch earlier. splits 0: nothing is pending, the linear wrote y itself. The
 * partials stay valid until the second linear after this one on the same workspace writes partials
 * (dsv4_cuda_pending_live says whether they still are). */
struct dsv4_cuda_pending {
    const float *part;          /* [splits, rows, out] */
    int64_t plane;              /* rows * out */
    int64_t out;
    int rows;
    int splits;
    const struct dsv4_cuda_gemm_ws *ws;     /* whose buffer holds them, */
    uint32_t seq;                           /* and its part_seq when they were written */
};
/* 0 when p is NULL or nothing pends, or its partials are still there and of the shape [rows, out]
 * that `reader` reads; -EINVAL for another shape, -EFAULT once a later linear has reused the buffer
 * (an ordering fault in the caller), each with a message naming `reader`. */
int dsv4_cuda_pending_live(const struct dsv4_cuda_pending *p, int rows, int64_t out, const char *reader);
/* The reduction launch for a pending result: d_y[n * ldy + o] = the sum (nothing when none pends). */
int dsv4_cuda_pending_flush(const struct dsv4_cuda_pending *p, float *d_y, int64_t ldy, void *stream);
size_t dsv4_cuda_gemm_ws_bytes(int rows, int64_t max_k);
void dsv4_cuda_gemm_ws_init(struct dsv4_cuda_gemm_ws *ws, void *base, int rows, int64_t max_k);
/* Choose the pipeline depth for the current device (4 stages, or 2 where a block's shared memory is
 * under 192 KB; DSV4_CUDA_GEMM_STAGES=2 forces 2), the weight bytes a launch's first wave prefetches
 * while the previous kernel drains (8 MiB; DSV4_CUDA_GEMM_PREFETCH_KB sets it, 0 turns it off) and
 * set the kernels' shared-memory limits (boot, before any capture). */
int dsv4_cuda_gemm_prepare(void);
int dsv4_cuda_gemm_stages(void);
int64_t dsv4_cuda_gemm_prefetch_bytes(void);
/* Whether dsv4_cuda_gemm_prepare put the FP8 linears of prefill chunks (more than DSV4_CUDA_MAX_BATCH
 * rows, quantized or raw x) on the wgmma kernel (kernels/gemm_wgmma.cu: the sm_90a image, enough
 * shared memory, a driver that encodes TMA descriptors, DSV4_CUDA_GEMM_WGMMA not 0); false: on the
 * mma.sync kernel, for the reason dsv4_cuda_gemm_wgmma_why_not gives (NULL when it runs). */
bool dsv4_cuda_gemm_wgmma(void);
const char *dsv4_cuda_gemm_wgmma_why_not(void);
/* Whether the FP8 and BF16 linears of decode batches of 9 to DSV4_CUDA_MAX_BATCH rows take the wgmma
 * kernel too (one CTA a weight tile and K split, the splits' partials as the mma.sync path leaves them;
 * DSV4_CUDA_GEMM_WGMMA_DECODE=0 keeps mma.sync there). */
bool dsv4_cuda_gemm_wgmma_decode(void);
/* Whether steps of up to 8 rows whose K is split stream their weights into registers
 * (kernels/gemm_direct.cu; DSV4_CUDA_GEMM_DIRECT not 0) */
bool dsv4_cuda_gemm_direct(void);
bool dsv4_cuda_gemm_supports(const struct dsv4_cuda_linear *W, bool quant_act);
int dsv4_cuda_gemm(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int rows, bool quant_act,
                   struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy, void *stream);
/* The same, for a linear that reads the x of the previous call on ws (wkv after wq_a, w3 after w1,
 * the compressor's gate after its kv): the caller promises that x has not changed since that call,
 * and the activation preparation (quantize or split: one launch) is skipped when that call prepared
 * this x in the same form, rows and width. Otherwise x is prepared as dsv4_cuda_gemm does. */
int dsv4_cuda_gemm_same_x(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int rows, bool quant_act,
                          struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy, void *stream);
/* dsv4_cuda_gemm or dsv4_cuda_gemm_same_x (same_x), with two differences for decode steps:
 * - d_px (may be NULL): x is the pending result of an earlier linear (d_x [rows, K] dense, where that
 *   linear would have written it), read from its partials by the launch that prepares x;
 * - d_py (may be NULL): where K is split (and ldy == W->out), no reduction is launched: the partials
 *   are left in ws and *d_py says where (d_y is then not written); otherwise d_py->splits is 0. */
int dsv4_cuda_gemm_deferred(const struct dsv4_cuda_linear *W, const float *d_x, const struct dsv4_cuda_pending *d_px,
                            int64_t ldx, int rows, bool quant_act, bool same_x, struct dsv4_cuda_gemm_ws *ws,
                            float *d_y, int64_t ldy, struct dsv4_cuda_pending *d_py, void *stream);
/* RMSNorm of d_x [rows, W->in] (or of d_px's pending result there, when d_px is not NULL) into d_y,
 * bit for bit as dsv4_cuda_rmsnorm writes it, and in the same launch d_y prepared in ws for W, so that
 * dsv4_cuda_gemm_same_x(W, d_y, W->in, rows, quant_act, ws, ...) skips its own preparation launch. W:
 * FP8 with quantized activations, or BF16 (dsv4_cuda_gemm_norm_supports). */
bool dsv4_cuda_gemm_norm_supports(const struct dsv4_cuda_linear *W, bool quant_act);
int dsv4_cuda_gemm_norm(const struct dsv4_cuda_linear *W, bool quant_act, const float *d_x,
                        const struct dsv4_cuda_pending *d_px, const float *d_w, int rows, float eps,
                        struct dsv4_cuda_gemm_ws *ws, float *d_y, void *stream);
/* The grouped output projection in one launch: W [groups R, K] FP8 with raw activations,
 * d_y[n, g R + r] = sum_k W[g R + r, k] d_x[n, g K + k]; R a multiple of 128 (one scale block). */
bool dsv4_cuda_gemm_grouped_supports(const struct dsv4_cuda_linear *W, int groups);
int dsv4_cuda_gemm_grouped(const struct dsv4_cuda_linear *W, int groups, const float *d_x, int64_t ldx, int rows,
                           struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy, void *stream);
/* The same, its result left pending as dsv4_cuda_gemm_deferred leaves it (d_py). */
int dsv4_cuda_gemm_grouped_deferred(const struct dsv4_cuda_linear *W, int groups, const float *d_x, int64_t ldx,
                                    int rows, struct dsv4_cuda_gemm_ws *ws, float *d_y, int64_t ldy,
                                    struct dsv4_cuda_pending *d_py, void *stream);

/* RMSNorm: d_y[b] = w * x / sqrt(mean(x^2) + eps) per row of n values; d_w NULL = no weight. */
int dsv4_cuda_rmsnorm(const float *d_x, const float *d_w, int rows, int n, float eps, float *d_y,
                      void *stream);
/* The same, then RoPE on the last rd values of row r at d_pos[r / heads] with frequencies
 * d_inv_freq [rd/2], in one launch (a token's query heads, or its kv): the normalized values are
 * rotated in f32 as engine/cpu/cpu_rope.c rotates them. d_x may equal d_y. d_px (may be NULL): x
 * pending there (struct dsv4_cuda_pending, [rows, n]), not in d_x; d_y gets the sum, then is
 * normalized and rotated in place. */
int dsv4_cuda_rmsnorm_rope(const float *d_x, const struct dsv4_cuda_pending *d_px, const float *d_w, int rows, int n,
                           float eps, int heads, int rd, const int32_t *d_pos, const float *d_inv_freq, float *d_y,
                           void *stream);

/* Router for `batch` tokens: d_logits [batch, E] (gate output; or, d_plogits not NULL, pending there
 * as struct dsv4_cuda_pending). Scored layers (d_tid2eid NULL): s = sqrt(softplus(l)), idx = top-k of
 * s + bias (ties to the lower index), Hash layers: idx = tid2eid[token]. Weights w = s[idx] /
 * sum(s[idx]) * route_scale (norm_topk_prob). */
int dsv4_cuda_router(const float *d_logits, const struct dsv4_cuda_pending *d_plogits, int batch, int n_experts,
                     int topk, const float *d_bias, const int32_t *d_tid2eid, const int32_t *d_tokens,
                     float route_scale, int32_t *d_idx, float *d_w, void *stream);

/* Routed experts: d_y[b] = sum_j w[b,j] expert_{idx[b,j]}(x_b), expert(x) = w2(silu(min(w1 x, L)) *
 * clamp(w3 x, -L, L)), grouped by expert over the batch. With ex->quant_act, d_x [batch, D] must be
 * FP8-rounded and the SwiGLU output is FP8-rounded (1x128) before w2, as the official code does. */
int dsv4_cuda_moe_experts(const struct dsv4_cuda_experts *ex, const float *d_x, int batch, int topk,
                          const int32_t *d_idx, const float *d_w, const struct dsv4_cuda_moe_ws *ws,
                          float *d_y, void *stream);
/* The same in two launches' worth of calls, so that other work can join before the sum: routed runs
 * every expert on its rows into ws; combine then writes d_y[b] = sum_j w[b,j] out[b,j] (j order)
 * + d_add[b] when d_add (the shared expert's output) is not NULL: the sum rounded, then the add
 * rounded, as a separate add of the two would give. */
int dsv4_cuda_moe_routed(const struct dsv4_cuda_experts *ex, const float *d_x, int batch, int topk,
                         const int32_t *d_idx, const struct dsv4_cuda_moe_ws *ws, void *stream);
/* d_padd (may be NULL): d_add pending there (struct dsv4_cuda_pending). */
int dsv4_cuda_moe_combine(const struct dsv4_cuda_experts *ex, int batch, int topk, const int32_t *d_idx,
                          const float *d_w, const struct dsv4_cuda_moe_ws *ws, const float *d_add,
                          const struct dsv4_cuda_pending *d_padd, float *d_y, void *stream);
/* Batches of more than DSV4_CUDA_MAX_BATCH rows (prefill chunks) take expert kernels of 8 warps a CTA
 * whose ring (~88 KB) needs the current device's opt-in: call once per process and device before
 * them (boot, before any capture); -ENOTSUP where the device offers less. */
int dsv4_cuda_moe_prepare(void);
/* Whether dsv4_cuda_moe_prepare put the routed experts of prefill chunks on the wgmma kernels
 * (kernels/moe_wgmma.cu: the sm_90a image, enough shared memory, DSV4_CUDA_MOE_WGMMA not 0); false:
 * on the 8-warp mma.sync kernels, for the reason dsv4_cuda_moe_wgmma_why_not gives (NULL when they run). */
bool dsv4_cuda_moe_wgmma(void);
const char *dsv4_cuda_moe_wgmma_why_not(void);

/* Expert parallelism (kernels/ep.cu, doc/MULTIGPU.md). ep_mask: d_idx[i] = -1 for i < n where it is
 * outside [e0, e1) (the experts this rank holds; moe_routed and moe_combine skip -1). ep_select: d_g
 * [ranks, pairs, dim] holds each rank's expert outputs of the same pairs (rank r's block at r pairs
 * dim); pair p's row in block 0 becomes that of the rank holding expert d_idx[p] (the first r with
 * d_idx[p] < e1[r]; e1 the ranks' shard ends, increasing), in place: block 0 is then what one device's
 * moe_routed leaves for moe_combine. */
int dsv4_cuda_ep_mask(int32_t *d_idx, int n, int e0, int e1, void *stream);
int dsv4_cuda_ep_select(float *d_g, const int32_t *d_idx, int ranks, const int *e1, int pairs, int64_t dim,
                        void *stream);

/* Routing statistics (kernels/route_stats.cu): d_counts[e] += the rows b < batch whose d_slot[b] is
 * not pad_slot (a bucket's padding rows) with e among d_idx[b, 0..topk). */
int dsv4_cuda_route_count(const int32_t *d_idx, int batch, int topk, const int32_t *d_slot, int pad_slot,
                          uint64_t *d_counts, void *stream);

/* Host experts fetched ahead (kernels/expert_fetch.cu; f from dsv4_cuda_dev_fetch). fetch_step: the
 * step counter, once per step before its first fetch. fetch_predict, on the fetch lane when layer's
 * attention input d_xn [B, D] is ready: stops every earlier copy at its next chunk, and writes the
 * router logits of each target (tg: layer and the next ones that fetch, up to f->ahead) into
 * f->logits. fetch_plan: each target's top-K from those logits (or its hash table on d_tokens [B]),
 * its first DSV4_CUDA_FETCH_SLOTS host experts kept in or assigned to its set's slots, the slots still
 * to fill as the jobs. fetch_copy, on the copy lane after the plan: the jobs' chunks, target by
 * target. fetch_resolve: on the main lane after the layer's router made d_idx [B, K] (and after the
 * plan that covered the layer): the layer's chunks no longer copied, its redirect entries pointed at
 * the routed slot experts' tiles already copied, and the copy stopped when a routed host expert must
 * still be read in place (the link is then the layer's). */
int dsv4_cuda_fetch_step(const struct dsv4_cuda_fetch *f, void *stream);
int dsv4_cuda_fetch_predict(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_fetch_targets *tg,
                            const float *d_xn, int B, int D, void *stream);
int dsv4_cuda_fetch_plan(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_fetch_targets *tg,
                         const int32_t *d_tokens, int B, int K, void *stream);
int dsv4_cuda_fetch_copy(const struct dsv4_cuda_fetch *f, int layer, const struct dsv4_cuda_fetch_targets *tg,
                         void *stream);
int dsv4_cuda_fetch_resolve(const struct dsv4_cuda_fetch *f, int layer, const int32_t *d_idx, int B, int K,
                            void *stream);
/* The rows of one decode expert tile (moe.cu's one-tile kernels): gate_up tiles take up_rows rows of w1
 * and of w3, down tiles down_rows rows of w2. */
void dsv4_cuda_moe_decode_tiles(int *up_rows, int *down_rows);

/* d_h[b, i] = silu(min(g, L)) * clamp(u, -L, L) for g = d_gate[b, i], u = d_up[b, i] (shared expert);
 * d_pgate / d_pup (may be NULL): g / u pending there (struct dsv4_cuda_pending). */
int dsv4_cuda_swiglu(const float *d_gate, const struct dsv4_cuda_pending *d_pgate, const float *d_up,
                     const struct dsv4_cuda_pending *d_pup, int rows, int64_t n, float limit, float *d_h,
                     void *stream);

/* mHC pre for `batch` tokens with hc streams: d_X [batch, hc, D], d_m [batch, (2+hc)*hc] the fn
 * GEMV output (unnormalized). Writes d_y [batch, D] = sum_j pre_j X[j], d_post [batch, hc],
 * d_comb [batch, hc, hc] (C after Sinkhorn). */
int dsv4_cuda_mhc_pre(const float *d_X, const float *d_m, const float *d_base, const float *d_scale,
                      int batch, int hc, int dim, int iters, float hc_eps, float norm_eps,
                      float *d_y, float *d_post, float *d_comb, void *stream);
/* The mHC fn GEMV (hc_attn/hc_ffn/hc_head fn, F32 [out <= DSV4_CUDA_MHC_FN_MAX_OUT, hc * D]) split
 * along K over the chip: d_y[b, r] = sum_k W[r, k] d_x[b, k], partial sums of fixed chunks of
 * DSV4_CUDA_MHC_FN_CHUNK values in d_ws (with each chunk's sum of squares of x beside them, for the
 * RMS that mHC pre and hc_head take), added in a fixed order (deterministic, batch-invariant).
 * d_ws holds at least dsv4_cuda_mhc_fn_ws_floats(batch, out, in) floats: [batch, chunks, out + 1]. */
#define DSV4_CUDA_MHC_FN_CHUNK 256
#define DSV4_CUDA_MHC_FN_MAX_OUT ((2 + DSV4_MAX_HC) * DSV4_MAX_HC)
static inline int64_t dsv4_cuda_mhc_fn_ws_floats(int batch, int64_t out, int64_t in)
{
    return (int64_t)batch * (out + 1) * ((in + DSV4_CUDA_MHC_FN_CHUNK - 1) / DSV4_CUDA_MHC_FN_CHUNK);
}
int dsv4_cuda_mhc_fn(const struct dsv4_cuda_linear *W, const float *d_x, int64_t ldx, int batch,
                     float *d_ws, int64_t ws_floats, float *d_y, int64_t ldy, void *stream);
/* dsv4_cuda_mhc_fn on d_X [batch, hc * dim] followed by dsv4_cuda_mhc_pre, with the fn's sums and
 * the streams' sum of squares made inside mHC pre from the fn's partials (one launch fewer, and no
 * block of pre reads all of a token's streams; the same sums in the same order, so the same results).
 * With d_post and d_comb NULL it makes d_y alone, and dsv4_cuda_mhc_comb makes them from the
 * partials left in d_ws, on another stream if the caller likes (the bits of the one-launch form). */
int dsv4_cuda_mhc_fn_pre(const struct dsv4_cuda_linear *W, const float *d_X, int batch, float *d_ws,
                         int64_t ws_floats, const float *d_base, const float *d_scale, int hc, int dim, int iters,
                         float hc_eps, float norm_eps, float *d_y, float *d_post, float *d_comb, void *stream);
/* post [batch, hc] and comb [batch, hc, hc] of mHC pre from the partials dsv4_cuda_mhc_fn_pre left
 * in d_ws (which must stay untouched until this has run). */
int dsv4_cuda_mhc_comb(const float *d_ws, int batch, const float *d_base, const float *d_scale, int hc, int dim,
                       int iters, float hc_eps, float norm_eps, float *d_post, float *d_comb, void *stream);
/* hc_head before the final norm: d_y [batch, D] = sum_j pre_j X[j] with pre = sigmoid(m rsqrt(mean(X^2)
 * + norm_eps) scale[0] + base) + hc_eps, d_m [batch, hc] the fn GEMV output. */
int dsv4_cuda_hc_head(const float *d_X, const float *d_m, const float *d_base, const float *d_scale, int batch,
                      int hc, int dim, float hc_eps, float norm_eps, float *d_y, void *stream);
/* The split-K fn GEMV (F32 [hc, hc * dim], as dsv4_cuda_mhc_fn) and hc_head from its partials, as
 * dsv4_cuda_mhc_fn_pre does for mHC pre: the bits of dsv4_cuda_mhc_fn then dsv4_cuda_hc_head. */
int dsv4_cuda_mhc_fn_head(const struct dsv4_cuda_linear *W, const float *d_X, int batch, float *d_ws,
                          int64_t ws_floats, const float *d_base, const float *d_scale, int hc, int dim,
                          float hc_eps, float norm_eps, float *d_y, void *stream);
/* mHC post: d_Xo[b, k] = post_k * f_b + sum_j comb[j, k] X[b, j]; d_Xo must not alias d_X. d_pf (may
 * be NULL): f pending there (struct dsv4_cuda_pending), not in d_f. */
int dsv4_cuda_mhc_post(const float *d_X, const float *d_f, const struct dsv4_cuda_pending *d_pf,
                       const float *d_post, const float *d_comb, int batch, int hc, int dim, float *d_Xo,
                       void *stream);

/* The official numerics' cache codecs, exposed for their tests (the step fuses them):
 * d_y[r] = decode(encode(d_x[r])) of one KV entry per row of hd values (kv_format 1: e4m3 1x64
 * + bf16 RoPE values, 0: f32), and the indexer's rotation: d_y[r] =
 * FP4(1x32)(Hadamard(d_x[r]) / sqrt(n)) for n a power of two. */
int dsv4_cuda_kv_entry_roundtrip(const float *d_x, int rows, int hd, int rd, int kv_format, float *d_y, void *stream);
int dsv4_cuda_hadamard_fp4(const float *d_x, int rows, int n, float *d_y, void *stream);

#ifdef __cplusplus
}
#endif

#endif
