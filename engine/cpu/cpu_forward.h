/* SPDX-License-Identifier: MIT */
/* The CPU reference forward pass: one sequence's state and the step that appends tokens to it.
 * Plain C, fp32 math. The CUDA backend's decode step is checked against it (which kernel is checked
 * against what on its own: engine/cpu/cpu_twin_cuda.h).
 *
 * exact: caches in f32, nothing rounded: what transformers' deepseek_v4 computes.
 * fp8 (official, doc/MODEL.md §4.2, §5.2): the window and compressed KV entries are rounded as the FP8 cache
 *   stores them (the first head_dim - rope_dim values e4m3 with a UE8M0 scale per 64, the RoPE
 *   part bf16); indexer keys and queries are Hadamard-rotated and rounded through FP4 e2m1 with a
 *   UE8M0 scale per 32; activations entering an FP8/FP4 matrix are rounded through e4m3 per 1x128
 *   (not wo_a's, which the official code runs in BF16). Everything else stays f32. */
#ifndef DSV4_ENGINE_CPU_FORWARD_H
#define DSV4_ENGINE_CPU_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/model/weights.h"

#define DSV4_CPU_MAX_CONTEXT (1 << 24)  /* positions stay exact in the f32 RoPE angle */
#define DSV4_CPU_MAX_ROPE_DIM 256       /* qk_rope_head_dim */
#define DSV4_CPU_MAX_THREADS 256

/* A compressor's running state: the rows of the block being filled, and for the overlapping
 * (CSA) compressor the Ca half of the previous complete block, which the next entry needs. */
struct dsv4_cpu_comp_state {
    float *kv;          /* [ratio, coff*d]: row pos % ratio of the current block */
    float *gate;        /* [ratio, coff*d]: gate logits with the position bias already added */
    float *prev_kv;     /* [ratio, d] overlap only: Ca of the previous complete block */
    float *prev_gate;   /* [ratio, d] */
    bool have_prev;     /* false until one block has completed (block 0 has no Ca slots) */
};

/* One layer's caches. */
struct dsv4_cpu_layer_state {
    float *window;      /* [window, head_dim] ring: slot pos % window holds the kv of pos */
    int64_t start;      /* first position the ring holds: 0, or where the MTP block started over */
    float *entries;     /* [max_context / ratio, head_dim] compressed entries (ratio > 0) */
    float *index_keys;  /* [max_context / ratio, index_head_dim] indexer keys (CSA layers) */
    struct dsv4_cpu_comp_state comp;        /* main compressor (ratio > 0) */
    struct dsv4_cpu_comp_state index_comp;  /* indexer compressor (CSA layers) */
};

struct dsv4_cpu_work;
struct dsv4_cpu_pool;
struct dsv4_cpu_undo;

/* Worker threads that split the rows of big matrix-vector products (results are bitwise those of
 * one thread). max_in: the widest matrix input, dsv4_cpu_max_linear_in(). */
int dsv4_cpu_pool_create(int threads, int64_t max_in, struct dsv4_cpu_pool **ret);
void dsv4_cpu_pool_free(struct dsv4_cpu_pool *pool);   /* accepts NULL */
int64_t dsv4_cpu_max_linear_in(const struct dsv4_weights *w);

/* Everything one sequence needs, allocated once at create for max_context tokens. */
struct dsv4_cpu_seq {
    int64_t pos;                        /* tokens appended so far */
    int64_t max_context;
    int n_layers;
    struct dsv4_cpu_layer_state *layers;    /* [n_layers] */
    bool has_mtp;
    struct dsv4_cpu_layer_state mtp_layer;  /* the MTP block's window ring */
    int64_t mtp_pos;                    /* positions the MTP block has been fed: it holds 0 .. mtp_pos - 1 */
    float *streams;                     /* [hc, D]: final streams of the last token, MTP input */
    /* Speculative decoding (dsv4_cpu_seq_spec_init; spec_tokens 0: off). While on, the MTP block follows
     * the main model one position behind: before the token at pos is appended, the MTP block is fed
     * position pos - 1 (the streams of pos - 1 and that token), so a draft always finds it ready. */
    int spec_tokens;
    struct dsv4_cpu_undo *undo;         /* the rows of a draft or a verify, until accepted */
    float *mtp_streams;                 /* [hc, D]: the MTP block's output streams, a later draft's input */
    struct dsv4_cpu_work *work;         /* scratch for one token */
    struct dsv4_cpu_pool *pool;         /* borrowed worker threads, or NULL for one */
    uint64_t *route_counts;             /* borrowed [n_layers * n_experts] routed-token counts, or NULL */
    void *arena;                        /* the one block every cache and scratch buffer lives in */
    uint64_t bytes;                     /* caches + scratch */
};

/* Allocate a sequence for w's shapes and max_context tokens. Returns 0 or -errno. */
int dsv4_cpu_seq_create(const struct dsv4_weights *w, int64_t max_context, struct dsv4_cpu_seq **ret);
void dsv4_cpu_seq_free(struct dsv4_cpu_seq *s);        /* accepts NULL */
/* Back to position 0 (the caches are overwritten before they are read again). */
void dsv4_cpu_seq_reset(struct dsv4_cpu_seq *s);

/* Append tokens[n] at s->pos (prefill of any length, a later chunk, or a decode step).
 * logits: [n, vocab] when all_rows, else [vocab] for the last token; may be NULL.
 * Returns 0, or -errno (bad token id, context full) with nothing appended. */
int dsv4_cpu_forward(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                     const int32_t *tokens, int n, float *logits, bool all_rows);

/* Prefix-cache records of a sequence (engine/cpu/cpu_prefix.c; engine/backend.h says what they hold).
 * geom: the record layout for s's shapes and a pool of pool_bytes (0: n_pages 0), or -errno when
 * the pool cannot hold one snapshot. save: block `block`'s entries and s's boundary state at its
 * position (a block boundary; only with block the last) into the pages given (either list may be
 * NULL). load: s (at position 0) continues after n_blocks blocks. */
int dsv4_cpu_prefix_geom(const struct dsv4_weights *w, const struct dsv4_cpu_seq *s, int64_t pool_bytes,
                         struct dsv4_prefix_geom *ret);
int dsv4_cpu_prefix_save(const struct dsv4_weights *w, const struct dsv4_cpu_seq *s, uint8_t *pool,
                         const struct dsv4_prefix_geom *g, int block, const int32_t *block_pages,
                         const int32_t *boundary_pages);
int dsv4_cpu_prefix_load(const struct dsv4_weights *w, struct dsv4_cpu_seq *s, uint8_t *pool,
                         const struct dsv4_prefix_geom *g, int n_blocks, const int32_t *block_pages,
                         const int32_t *boundary_pages);

/* One step of the (first) MTP block: the main model's final streams for position p (s->streams after the
 * forward of token p) and the token at p+1 give logits [vocab] for the token at p+2. The block's
 * window advances by one position per call (s->mtp_pos). Returns 0, or -errno (-ENOENT when the
 * checkpoint carries no MTP block). */
int dsv4_cpu_mtp_forward(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                         const float *streams, int32_t next_token, float *logits);

/* Speculative decoding over one sequence (engine/backend.h's draft, verify and accept).
 *
 * spec_init: make s speculate with up to spec_tokens drafts per step (1..DSV4_SPEC_TOKENS_MAX): the undo
 *   log for spec_tokens + 1 rows; -ENOENT when the checkpoint has no MTP block. Call before any token.
 * draft: s is at position P and `token` is the one to be appended next (at P). The MTP block is fed
 *   position P - 1 (the streams of P - 1 and `token`: what the catch-up would feed anyway) and its
 *   greedy argmax is draft 0; draft j > 0 feeds the block its own output streams and draft j - 1 at
 *   P - 1 + j. Those later steps are taken back before returning: the sequence is left as the first
 *   step leaves it. *ret_k: drafts made, k or 0 when the block has no state for P - 1 (position 0,
 *   or the first token after a prefix load).
 * verify: append tokens[n] (1..spec_tokens + 1) like dsv4_cpu_forward with logits [n, vocab], recording
 *   in the undo log; accept(keep) then keeps rows 0..keep-1 and takes the others back, bitwise. */
int dsv4_cpu_seq_spec_init(const struct dsv4_weights *w, struct dsv4_cpu_seq *s, int spec_tokens);
int dsv4_cpu_draft(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s, int32_t token,
                   int k, int32_t *drafts, int *ret_k);
int dsv4_cpu_verify(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                    const int32_t *tokens, int n, float *logits);
int dsv4_cpu_accept(struct dsv4_cpu_seq *s, int keep);

/* The undo log (engine/cpu/cpu_undo.c): sized at create for max_rows tokens. */
int dsv4_cpu_undo_create(const struct dsv4_weights *w, int max_rows, struct dsv4_cpu_undo **ret);
void dsv4_cpu_undo_free(struct dsv4_cpu_undo *u);       /* accepts NULL */
uint64_t dsv4_cpu_undo_bytes(const struct dsv4_cpu_undo *u);

#endif
