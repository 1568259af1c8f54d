/* SPDX-License-Identifier: MIT */
/* Kernels of the decode step that only the step (kernels/step.cu) launches: attention, RoPE, the
 * KV entry codec, compressors and the lightning indexer. Device pointers throughout. */
#ifndef DSV4_KERNELS_INTERNAL_H
#define DSV4_KERNELS_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DSV4_CUDA_MAX_HEAD_DIM 512  /* widest head the attention kernels and KV codec take */
#define DSV4_CUDA_ATT_SPLITS 16     /* key runs per row, combined online in split order */
#define DSV4_CUDA_TOPK_THREADS 1024

/* Arena sizes of the decode step (kernels/step.cu): caches of max_batch + 1 slots, and buffers. */
size_t dsv4_cuda_step_cache_bytes(const struct dsv4_config *c, const struct dsv4_backend_opts *o);
size_t dsv4_cuda_step_workspace_bytes(const struct dsv4_config *c, const struct dsv4_backend_opts *o);
/* Rows of one step (a decode batch or a prefill chunk) with these options: prefill_chunk (0:
 * DSV4_PREFILL_CHUNK_DEFAULT) cut to max_context, at least max_batch; the step's buffers and the boot
 * log both take it from here. */
int dsv4_cuda_step_rows(const struct dsv4_backend_opts *o);
/* Drafts a step verifies with these options (0: no speculation; kernels/step.cu says when it runs). */
int dsv4_cuda_step_spec_tokens(const struct dsv4_config *c, const struct dsv4_backend_opts *o);

/* Per-slot cache layout of one layer: byte offsets within a slot's block. */
struct dsv4_cuda_layer_cache {
    int64_t win, comp, ikeys, cstate, istate;
};
/* Bytes of one slot's caches, and each layer's offsets (lc [n_layers], or NULL). */
int64_t dsv4_cuda_step_slot_layout(const struct dsv4_config *c, const struct dsv4_backend_opts *o,
                                   struct dsv4_cuda_layer_cache *lc);
/* Entries of a slot's window ring: position p lives at p % ring. */
int dsv4_cuda_step_ring_entries(const struct dsv4_config *c, const struct dsv4_backend_opts *o);

/* KV entry formats: f32 (exact numerics); the official FP8 entry (doc/MODEL.md §5.2: nope e4m3 in 1x64 UE8M0
 * blocks, RoPE values bf16; 584 B at head_dim 512, rope 64). */
enum { DSV4_KV_F32 = 0, DSV4_KV_FP8 = 1 };
int dsv4_cuda_kv_entry_bytes(int hd, int rd, int kvf);

/* d_v [batch, hd] into the window ring of each row's slot at entry pos % ring. The ring holds
 * window + (slice rows - 1) entries, so that a slice whose rows are consecutive positions of one
 * slot stores all its entries before any row reads its window. With d_last [batch] (the last
 * position of each row's run in the step), only a run's last `ring` rows store: a whole prefill
 * chunk stored after its rows have read their windows (dsv4_cuda_att_args.own). d_slot NULL: row b's
 * entry to d_ring + b * entry bytes instead (the step's own entries; slot_stride, ring and d_last
 * unused). */
int dsv4_cuda_kv_store(const float *d_v, int batch, int hd, int rd, int kvf, const int32_t *d_pos,
                       const int32_t *d_slot, uint8_t *d_ring, int64_t slot_stride, int ring, const int32_t *d_last,
                       void *stream);

struct dsv4_cuda_att_args {
    const float *q;             /* [B, H, hd], normed and RoPE'd */
    int H, hd, rd;
    int kvf;                    /* DSV4_KV_* */
    int entry_bytes;
    const int32_t *pos, *slot;  /* [B] */
    const uint8_t *win;         /* window rings of slot 0 of this layer; slot s at + s * win_slot_stride */
    int64_t win_slot_stride;
    int window;                 /* keys of the sliding window (the row's own included) */
    int ring;                   /* entries in the ring: position p lives at p % ring */
    const uint8_t *comp;        /* compressed entries of slot 0 (ratio > 0) */
    int64_t comp_slot_stride;
    int ratio;                  /* 0: window only */
    const int32_t *sel;         /* [B, sel_stride] indexer picks (CSA), or NULL: every complete entry */
    int sel_stride;
    const int32_t *nsel;        /* [B] */
    float scale;                /* head_dim^-0.5 */
    float *part;                /* [B, DSV4_CUDA_ATT_SPLITS, H, hd + 2] workspace */
    /* FP8 kernel: heads a block takes, 16, 32 or 64 (the same bits whichever: a head's arithmetic is
     * its own); 0: DSV4_CUDA_ATT_HEADS, or by batch (dsv4_cuda_attention) */
    int heads_per_block;
    /* FP8 kernel: each block takes every key run of its row in turn and writes the output, no
     * partials and no combine (attention_mma_whole_kernel, heads_per_block heads a block or, at 0,
     * the most the device's shared memory holds; the same bits as the splits). For the rows of a
     * prefill chunk, which fill the chip without splitting them; DSV4_CUDA_ATT_WHOLE=0 turns it off. */
    bool whole;
    /* whole rows: the step's own entries [B, entry_bytes] (dsv4_cuda_kv_store with no slots) and
     * first [B] (each row's run's first position): a window key at or after first[b] is read from
     * there, earlier ones from the ring, so a chunk of any length takes one launch, its entries
     * reaching the ring after it (a chunk longer than the ring would overwrite windows its own
     * rows read). NULL: every window key from the ring. Only where dsv4_cuda_attention_whole. */
    const uint8_t *own;
    const int32_t *first;
};

/* Whether dsv4_cuda_attention runs a's rows whole (a->whole, FP8 entries, the device and the
 * switch allowing): then a->own may be set, and a->part is not used. */
bool dsv4_cuda_attention_whole(const struct dsv4_cuda_att_args *a);
/* Heads a whole-row block takes by default on this device (64, 32 or 16; 0: rows take the splits),
 * for the head_dim last prepared: for the boot log. */
int dsv4_cuda_attention_whole_heads(void);
size_t dsv4_cuda_attention_smem(int hd);
/* Raise the attention kernel's shared-memory limit (boot, before any capture). */
int dsv4_cuda_attention_prepare(int hd);
/* d_o [B, H, hd] = attention with sinks, RoPE^-1 applied at each row's position. */
int dsv4_cuda_attention(const struct dsv4_cuda_att_args *a, int batch, const float *d_sink,
                        const float *d_inv_freq, float *d_o, void *stream);

/* kernels/compressor.cu. One compressor's update for `batch` rows: when row b completes a block (pos % ratio == ratio - 1)
 * the entry pos / ratio is pooled from the block's C = d_c and Z = d_z + ape (and the previous
 * block's first d channels when overlapping), RMSNormed, RoPE'd at pos - ratio + 1 and stored: as a
 * KV entry (main compressor, d_entries) or, for the indexer, as f32 (Hadamard + FP4 rounded in fp8
 * numerics). Rows of one slot in one step (a prefill chunk) must be consecutive in position order:
 * tokens from first[b] on come from the step's rows, earlier ones from the slot's ring of the last
 * ratio (2 ratio when overlapping) tokens, which the rows then refresh. */
struct dsv4_cuda_comp_args {
    const float *c, *z;         /* [B, coff*d] */
    const float *ape;           /* [ratio, coff*d] */
    const float *norm;          /* [d] */
    int ratio, d, rd;
    bool overlap, fp8, indexer;
    int kvf;                    /* entry format of the main compressor's output */
    float eps;
    const float *inv_freq;      /* compress frequencies [rd/2] */
    const int32_t *pos, *slot;  /* [B] */
    const int32_t *first, *last;    /* [B] first and last position of the row's slot in this step */
    float *state;               /* slot 0: kv [ring, coff*d], gate + ape [ring, coff*d] */
    int64_t state_slot_stride;  /* floats */
    uint8_t *entries;           /* slot 0 of the entry cache */
    int64_t entries_slot_stride;    /* bytes */
    int entry_bytes;
};
int dsv4_cuda_compressor(const struct dsv4_cuda_comp_args *a, int batch, void *stream);
/* floats of one slot's state for one compressor */
int64_t dsv4_cuda_comp_state_floats(int ratio, int d, bool overlap);

/* The lightning indexer (kernels/indexer.cu). q_prep: d_q [B, nI, dI] gets RoPE (compress frequencies) on each head's last
 * rd values and, in fp8 numerics, the Hadamard rotation and FP4 rounding. */
int dsv4_cuda_indexer_q(float *d_q, int batch, int nI, int dI, int rd, bool fp8, const int32_t *d_pos,
                        const float *d_inv_freq, void *stream);
/* Scores for rows whose complete-entry count n = (pos+1)/ratio exceeds topk: d_scores [B, max_entries]
 * (entries < n), score_s = sum_h (w_h nI^-0.5) ReLU(q_h . k_s) dI^-0.5, w = d_w [B, nI] (weights_proj x).
 * Then the selection: d_sel [B, topk] ascending (every entry when n <= topk), d_nsel [B]. */
struct dsv4_cuda_index_args {
    const float *q;             /* [B, nI, dI] */
    const float *w;             /* [B, nI] */
    int nI, dI, ratio, topk;
    const int32_t *pos, *slot;
    const uint8_t *keys;        /* slot 0 of this layer's indexer keys [max_entries] of
                                 * dsv4_cuda_index_key_bytes(dI, packed) bytes */
    int64_t keys_slot_stride;   /* bytes */
    bool packed;                /* keys in the official FP4 layout (fp8 numerics), else f32 */
    int max_entries;
    float *scores;              /* [B, max_entries] workspace */
    int32_t *sel;               /* [B, topk] */
    int32_t *nsel;              /* [B] */
};
int dsv4_cuda_indexer(const struct dsv4_cuda_index_args *a, int batch, void *stream);
/* Bytes of one stored indexer key: the official FP4 layout (dI/2 + ceil(dI/32); 68 at dI = 128) or
 * dI f32 values. */
int dsv4_cuda_index_key_bytes(int dI, bool packed);

/* kernels/spec.cu: speculative decoding with the MTP block. A slot's ring of the main model's last
 * streams (ring entries of hc * D floats at caches + slot * slot_bytes + ring_off, position p at
 * p % ring); the block's rows at MTP positions mpos in slots mslot (pad_slot: a row that does not
 * run the block); the step's main rows (step_slot NULL: none, a draft). */
struct dsv4_cuda_spec_rows {
    uint8_t *caches;
    int64_t slot_bytes, ring_off, hcD;
    int ring, pad_slot;
    const int32_t *mslot, *mpos;
    const int32_t *step_slot, *step_pos;
};
int dsv4_cuda_spec_gather(const struct dsv4_cuda_spec_rows *a, int batch, const float *d_X, float *d_H, void *stream);
int dsv4_cuda_spec_ring_save(const struct dsv4_cuda_spec_rows *a, const int32_t *d_last, int batch, const float *d_X,
                             void *stream);
int dsv4_cuda_spec_add(float *d_X, const float *d_e, int batch, int hc, int dim, void *stream);
int dsv4_cuda_spec_argmax(const float *d_logits, int batch, int V, int32_t *d_out, void *stream);
int dsv4_cuda_spec_tokens(const int32_t *d_src, int n, int32_t *d_in, void *stream);
/* A compressor's partial state within a slot (bytes from the slot's base): kv rows [ring, width] then
 * gate rows [ring, width]; and its save area, [DSV4_SPEC_TOKENS_MAX + 1, 2, width] floats. */
struct dsv4_cuda_spec_comp {
    int64_t state, save;
    int ring, width;
};
/* Rows of positions P + j, j in [j0, j1), of every compressor d_comp [n_comp], into the save area
 * (save) or back from it. */
int dsv4_cuda_spec_comp_copy(const struct dsv4_cuda_spec_comp *d_comp, int n_comp, uint8_t *d_slot_base, int64_t P,
                             int j0, int j1, bool save, void *stream);

/* kernels/embed.cu: d_X [B, hc, D] = embed[token_b] (any linear format) copied to every stream. */
int dsv4_cuda_embed(const struct dsv4_cuda_linear *E, const int32_t *d_tokens, int batch, int hc, float *d_X,
                    void *stream);

#endif
