/* SPDX-License-Identifier: MIT */
/* The operations one engine step needs, implemented by the CPU reference backend and the CUDA
 * backend. A backend owns `max_batch` sequence slots, each sized for `max_context` tokens, all
 * allocated at create time: nothing is allocated per request or per step afterwards. */
#ifndef DSV4_ENGINE_BACKEND_H
#define DSV4_ENGINE_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/serve/sampler.h"
#include "engine/model/ep_plan.h"
#include "engine/model/placement.h"
#include "engine/model/weights.h"

enum dsv4_numerics {
    DSV4_NUMERICS_EXACT,    /* caches in f32, no rounding: what transformers' deepseek_v4 computes */
    DSV4_NUMERICS_FP8,      /* official: FP8 KV (448 non-RoPE dims, 1x64 UE8M0), Hadamard+FP4 indexer */
};

#define DSV4_PREFILL_CHUNK_DEFAULT 1024     /* prompt positions of one prefill step, unless configured */
#define DSV4_PREFILL_CHUNK_MAX 4096         /* the longest prefill step a backend takes */

#define DSV4_SPEC_TOKENS_MAX 3        /* draft tokens per speculative step */

struct dsv4_backend_opts {
    int max_batch;              /* slots */
    int max_context;            /* tokens per slot */
    enum dsv4_numerics numerics;
    int threads;                /* CPU backend worker threads; 0 = one */
    int64_t prefix_pool_bytes;  /* prefix-cache pool reserved at create (device memory on CUDA); 0 = none */
    int prefill_chunk;          /* CUDA: prompt positions one prefill step takes, 0..DSV4_PREFILL_CHUNK_MAX
                                 * (0 = DSV4_PREFILL_CHUNK_DEFAULT); its rows' workspaces are part of the
                                 * boot plan. CPU: unused */
    /* Routed experts that do not fit on the GPU live in pinned host memory (CUDA; engine/model/placement.h). */
    enum dsv4_expert_offload expert_offload;
    int expert_host_share;      /* percent; with DSV4_EXPERT_OFFLOAD_ON at least this share of each layer on the host */
    const uint64_t *expert_counts;  /* [n_layers * n_experts] routing statistics choosing the GPU's experts, or NULL */
    int spec_tokens;            /* speculative decoding: drafts per step to prepare for, 0..SPEC_TOKENS_MAX */
    /* CUDA devices by ordinal (n_gpus 0: all visible). With two or more listed, the routed experts are
     * split across them (doc/MULTIGPU.md); an ordinal listed more than once puts several ranks on one
     * device, exchanging through device copies (the loopback the tests use). */
    int n_gpus;
    int gpus[DSV4_EP_MAX_GPUS];
    /* Set by the CUDA backend for each device of an expert-parallel group, 0 otherwise: this device
     * is rank ep_rank of ep_ranks, holds the routed experts dsv4_ep_shard gives it and exchanges its
     * rows with the other ranks at every MoE sublayer. */
    int ep_rank, ep_ranks;
};

/* The prefix cache (engine/serve/prefix_cache.h) keeps slot state at block boundaries in a pool of pages
 * that the backend reserves at create and addresses by page index. Two records:
 *   block record: the compressed entries (CSA and HCA KV, indexer keys) the tokens of one block
 *     produced, every layer: block_pages pages (0 for a model without compressed layers);
 *   boundary record: the rest of what a continuation after the block needs: every layer's sliding
 *     window ring and every overlapping compressor's partial state (the last block's Ca rows):
 *     boundary_pages pages.
 * A prefix of n blocks is the block records of blocks 0..n-1 plus the boundary record at n * block.
 * Block tokens are a multiple of the window and of every compress ratio (dsv4_config_prefix_block),
 * so at a boundary no compressor holds a partial block and the window ring is whole. */
#define DSV4_PREFIX_PAGES_MAX (1 << 24)     /* pages of one pool */
struct dsv4_prefix_geom {
    int block;                  /* tokens per block */
    int64_t page_bytes;
    int32_t n_pages;            /* 0: no pool */
    int block_pages;
    int boundary_pages;
};

struct dsv4_backend_stats {
    uint64_t device_allocs;     /* allocations made since create (must stay flat after boot) */
    uint64_t graph_captures;
    uint64_t eager_steps;       /* steps launched outside the captured graphs (CUDA prefill chunks
                                 * longer than the largest bucket) */
    uint64_t bytes_reserved;    /* caches + workspaces */
    char variant[192];          /* kernels in use, for stats and logs */
    uint32_t experts_gpu, experts_host;         /* routed experts by where they live (CUDA; 0, 0 on the CPU) */
    uint64_t expert_bytes_gpu, expert_bytes_host;
    uint64_t embed_bytes_host;  /* the token embedding in pinned host memory (CUDA, with experts there too) */
    int expert_layers;                          /* layers in the arrays below (CUDA; 0 on the CPU) */
    uint16_t experts_gpu_by_layer[DSV4_MAX_LAYERS], experts_host_by_layer[DSV4_MAX_LAYERS];
    bool expert_fetch;          /* decode steps fetch predicted host experts ahead into device slots (CUDA) */
    uint64_t expert_fetch_copied, expert_fetch_used;    /* bytes copied into the slots, bytes read from them */
};

struct dsv4_backend;

/* One row for a backend that samples where its logits are (the optional `sample` op). */
struct dsv4_backend_sample_req {
    int slot;
    const struct dsv4_sampling *params;     /* validated by the caller */
    uint64_t seed;                          /* Philox key */
    uint64_t index;                         /* output index of the token (0 for the first) */
};

#define DSV4_BACKEND_MSG_MAX 160            /* a row's error message, with its terminating NUL */

/* Every op that computes returns 0 or a negative errno. -ENOTRECOVERABLE means the backend can no
 * longer compute at all (a sticky CUDA error: illegal address, uncorrectable ECC, a faulted kernel):
 * the scheduler then ends every request and stops (scheduler.h); any other error fails one call. */
struct dsv4_backend_ops {
    const char *name;           /* "cpu", "cuda" */
    /* Append n tokens to `slot` at its current position (chunked prefill: call again with the
     * next chunk). logits: [n, V] f32 when all_rows, else [V] for the last token only; may be NULL. */
    int (*prefill)(struct dsv4_backend *b, int slot, const int32_t *tokens, int n,
                   float *logits, bool all_rows);
    /* One token for each of n slots (distinct); logits [n, V] f32, row i for slots[i]. */
    int (*decode)(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens,
                  float *logits);
    /* Optional (NULL: the engine samples the copied-back logits on the host, engine/serve/sampler.c).
     * Sample the rows of the call just made, without copying logits back: after prefill, n == 1
     * and req[0].slot is that prefill's slot (its last prompt token); after decode, the decode's n
     * rows in its order. Same semantics as dsv4_sampler_sample; the backend keeps each slot's
     * penalty history itself (prefill marks prompt tokens seen, sampled tokens are counted,
     * slot_reset clears it). rc[i]: 0, or -errno with msgs + i * DSV4_BACKEND_MSG_MAX saying why
     * (a non-finite logit, ...); the return value is for failures of the whole call. */
    int (*sample)(struct dsv4_backend *b, int n, const struct dsv4_backend_sample_req *req,
                  struct dsv4_sample *out, int *rc, char *msgs);
    /* Forget slot's sequence (position 0, caches cleared logically). */
    void (*slot_reset)(struct dsv4_backend *b, int slot);
    int64_t (*slot_position)(const struct dsv4_backend *b, int slot);
    void (*get_stats)(const struct dsv4_backend *b, struct dsv4_backend_stats *ret);
    void (*destroy)(struct dsv4_backend *b);
    /* Prefix cache (NULL, or prefix.n_pages 0: no pool). Page arrays name pool pages, each record's
     * pages in record order.
     * prefix_save: copy slot's state at its position P (a positive multiple of prefix.block) into
     * the pool: block `block`'s entries (0 <= block < P / prefix.block: the compressed entries of a
     * block stay in the slot after it, so a chunk that passed several boundaries saves each) into
     * block_pages, and the window and compressor state at P into boundary_pages, which only the
     * last block (P / prefix.block - 1) may ask for; either may be NULL (not wanted). The slot is
     * unchanged.
     * prefix_load: the slot is at position 0; give it the state after n_blocks blocks: block i's
     * entries from block_pages + i * prefix.block_pages, the window and compressor state from
     * boundary_pages. Its position becomes n_blocks * block, and the tokens[n_blocks * block] that
     * led there are marked seen in its penalty history when the backend keeps one (as prefill
     * does). The MTP block's state is not part of a snapshot: it starts over (its drafts resume one
     * token after the load; what is generated does not depend on drafts, only how fast). */
    int (*prefix_save)(struct dsv4_backend *b, int slot, int block, const int32_t *block_pages,
                       const int32_t *boundary_pages);
    int (*prefix_load)(struct dsv4_backend *b, int slot, int n_blocks, const int32_t *block_pages,
                       const int32_t *boundary_pages, const int32_t *tokens);
    /* Optional: tokens routed to each expert since create, counts[n_layers * n_experts] (layer-major;
     * a token counts once for each of its top-k experts; padding rows do not count). */
    int (*routing_counts)(struct dsv4_backend *b, uint64_t *counts);
    /* Speculative decoding with the checkpoint's MTP block (b->spec_tokens > 0 only; otherwise these
     * may be NULL and the engine decodes one token per step). S = b->spec_tokens below.
     * draft: for each of n slots (distinct) at position P, tokens[i] is the token to be appended next
     *   (at P, not yet fed). Propose up to k[i] (0..S) next tokens greedily with the MTP block into
     *   drafts[i * S + j]; ret_k[i] says how many were made (fewer, 0, when the block has no state for
     *   the slot's position yet: right after position 0 or a prefix load). The slot's main state is
     *   unchanged; its MTP block keeps only what the real sequence needs.
     * verify: append rows[i] (1..S + 1) tokens tokens[i * (S + 1) + j] to each of n slots (distinct), in
     *   one batched step, logits [n, S + 1, V] f32 (row j of slot i at (i * (S + 1) + j) * V; rows past
     *   rows[i] untouched). The rows are provisional until accept; nothing else may run on a slot
     *   between its verify and its accept.
     * accept: keep the first keep rows (1..rows) of slot's verify and take the others back: the slot
     *   is then bitwise what appending only the kept rows would have left (window ring, compressor
     *   partial state, compressed entries, indexer keys, the MTP block), at position P + keep.
     * How a backend takes rows back is its own: the CPU backend records every byte the rows overwrite
     * and writes it back (engine/cpu/cpu_undo.c); a GPU backend can instead keep its window rings
     * window + S rows long (what rejected rows write then overwrites nothing a kept row needs), copy
     * the compressors' partial state and the MTP ring rows before the verify, and reset positions. */
    int (*draft)(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                 int32_t *drafts, int *ret_k);
    int (*verify)(struct dsv4_backend *b, int n, const int *slots, const int *rows, const int32_t *tokens,
                  float *logits);
    int (*accept)(struct dsv4_backend *b, int slot, int keep);
};

struct dsv4_backend {
    const struct dsv4_backend_ops *ops;
    const struct dsv4_weights *weights;
    struct dsv4_backend_opts opts;
    struct dsv4_prefix_geom prefix;     /* the prefix-cache pool, set at create */
    /* Drafts per step the backend verifies, set at create: opts.spec_tokens when the checkpoint has
     * an MTP block and the backend implements draft/verify/accept, else 0 (no speculation). */
    int spec_tokens;
    /* Devices the slots are dealt out over, set at create: slot groups of consecutive slots, group g
     * of n holding dsv4_ep_slots(max_batch, n, g) of them (doc/MULTIGPU.md, "Request placement").
     * 0 or 1: one group. A request stays in the slot, so on the device, it was admitted to. */
    int slot_groups;
    void *impl;
};

/* The CPU reference backend. */
int dsv4_backend_cpu_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                            struct dsv4_backend **ret);
/* The CUDA backend (built with --with-cuda; returns -ENODEV with a reason when no usable GPU). */
int dsv4_backend_cuda_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                             struct dsv4_backend **ret);

static inline void dsv4_backend_destroy(struct dsv4_backend *b)
{
    if (b)
        b->ops->destroy(b);
}

#endif
