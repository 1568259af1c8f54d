/* SPDX-License-Identifier: MIT */
/* Internal pieces of the CPU reference forward pass (engine/cpu/cpu_*.c): the per-token scratch, the
 * context every piece receives, and the building blocks. All math is fp32 unless noted. */
#ifndef DSV4_ENGINE_CPU_OPS_H
#define DSV4_ENGINE_CPU_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/cpu/cpu_forward.h"
#include "engine/model/weights.h"

#define DSV4_CPU_ACT_BLOCK 128      /* official activation quantization: 1x128 e4m3 */
#define DSV4_CPU_KV_BLOCK 64        /* official KV cache: 1x64 e4m3 */
#define DSV4_CPU_FP4_BLOCK 32       /* official indexer keys/queries: 1x32 e2m1 */
#define DSV4_CPU_PAR_MIN (1 << 16)  /* weights in a matvec before it is split among threads */

/* Inverse RoPE frequencies of one rope type ("main" or "compress"), f32 as transformers keeps them. */
struct dsv4_cpu_rope {
    int dim;                                    /* rope_dim: the last `dim` values of a head */
    float inv_freq[DSV4_CPU_MAX_ROPE_DIM / 2];  /* one per interleaved pair */
};

/* Scratch for one token, sized from the config and max_context at create. */
struct dsv4_cpu_work {
    struct dsv4_cpu_rope rope_main, rope_compress;
    float *X;           /* [hc, D] residual streams */
    float *X2;          /* [hc, D] streams being built by hc_post */
    float *flat;        /* [hc*D] normalized streams (mHC input) */
    float *mix;         /* [(2+hc)*hc] */
    float *pre, *post;  /* [hc] */
    float *comb;        /* [hc, hc] */
    float *y;           /* [D] collapsed sublayer input */
    float *xn;          /* [D] normed sublayer input */
    float *sub;         /* [D] sublayer output */
    float *qr;          /* [q_lora_rank] */
    float *q;           /* [H, head_dim] */
    float *kv;          /* [head_dim] */
    float *o;           /* [H, head_dim] */
    float *z;           /* [o_groups * o_lora_rank] */
    float *scores;      /* [max_keys] attention logits of one head */
    const float **keys; /* [max_keys] the vectors one query attends to */
    float *entry;       /* [max(head_dim, index_head_dim)] compressor output */
    float *iq;          /* [index_n_heads, index_head_dim] */
    float *iw;          /* [index_n_heads] */
    float *iscore;      /* [max_context / csa_ratio] */
    int *isel;          /* [index_topk] selected entries, ascending */
    int *iheap;         /* [index_topk] top-k heap */
    float *router;      /* [n_experts] scores */
    float *rsel;        /* [n_experts] selection keys (score + bias) */
    float *h1, *h3;     /* [max expert width] */
    float *eout;        /* [max(topk, 1), D] the routed experts' outputs by slot; row 0 also other [D] results */
    float *act;         /* [max linear in] quantized activation / dequantized row */
    float *row;         /* [max linear in] dequantized row for unaligned views */
    float *draft_logits;    /* [vocab] the MTP block's logits of one draft (a checkpoint with MTP) */
    int max_keys;
};

/* What every piece needs: the model, the numerics, the scratch and the threads (NULL: one); undo: the
 * log every write to the sequence's state goes through first (NULL, or not recording: none). */
struct dsv4_cpu_ctx {
    const struct dsv4_weights *w;
    const struct dsv4_config *cfg;
    enum dsv4_numerics num;
    struct dsv4_cpu_work *wk;
    struct dsv4_cpu_pool *pool;
    uint64_t *route_counts;     /* [n_experts] of the layer being run: tokens routed to each, or NULL */
    struct dsv4_cpu_undo *undo;
};

/* --- cpu_undo.c ----------------------------------------------------------------------------- */

/* Copy the bytes at dst into the log before they are overwritten (nothing when u is NULL or idle). */
void dsv4_cpu_undo_save(struct dsv4_cpu_undo *u, void *dst, size_t bytes);
/* Start recording (forgets an earlier step); mark before each row with the positions it starts from. */
void dsv4_cpu_undo_begin(struct dsv4_cpu_undo *u);
int dsv4_cpu_undo_mark(struct dsv4_cpu_undo *u, int64_t pos, int64_t mtp_pos);
int dsv4_cpu_undo_rows(const struct dsv4_cpu_undo *u);     /* rows marked; 0 when idle */
void dsv4_cpu_undo_end(struct dsv4_cpu_undo *u);           /* stop recording, keep every row */
/* Take back every row from `keep` on (restoring the positions row `keep` started from) and stop. */
int dsv4_cpu_undo_rollback(struct dsv4_cpu_undo *u, int keep, int64_t *pos, int64_t *mtp_pos);

/* --- cpu_pool.c ----------------------------------------------------------------------------- */

/* Run fn(arg, part, nparts) for every part 0..nparts-1 at once, the caller taking part 0. */
void dsv4_cpu_pool_run(struct dsv4_cpu_pool *pool, void (*fn)(void *arg, int part, int nparts), void *arg);
int dsv4_cpu_pool_size(const struct dsv4_cpu_pool *pool);         /* 1 for NULL */
float *dsv4_cpu_pool_row(const struct dsv4_cpu_pool *pool, int part);  /* [max_in] scratch of a part */

/* --- cpu_ops.c ------------------------------------------------------------------------------ */

/* y[n] = w * x / sqrt(mean(x^2) + eps); w NULL for the unweighted norm. y may alias x. */
void dsv4_cpu_rmsnorm(float *y, const float *x, const float *w, int n, double eps);
/* y[nrows] = W[r0 : r0+nrows] x. In fp8 numerics an FP8/FP4 matrix first sees x rounded through
 * e4m3 per 1x128 (the official activation quantizer) unless raw_act is set. */
void dsv4_cpu_linear_rows(const struct dsv4_cpu_ctx *c, const struct dsv4_linear *W, int64_t r0,
                          int64_t nrows, const float *x, float *y, bool raw_act);
static inline void dsv4_cpu_linear(const struct dsv4_cpu_ctx *c, const struct dsv4_linear *W,
                                   const float *x, float *y)
{
    dsv4_cpu_linear_rows(c, W, 0, W->out, x, y, false);
}
float dsv4_cpu_dot(const float *a, const float *b, int n);
float dsv4_cpu_sigmoid(float x);
float dsv4_cpu_silu(float x);

/* --- cpu_rope.c ----------------------------------------------------------------------------- */

void dsv4_cpu_rope_init(struct dsv4_cpu_rope *r, const struct dsv4_rope *p, int rope_dim);
/* Rotate the interleaved pairs of x[r->dim] (a head's last rope_dim values) by pos * f_i;
 * inverse rotates by -pos * f_i (undoes RoPE on the attention output). */
void dsv4_cpu_rope_apply(const struct dsv4_cpu_rope *r, float *x, int64_t pos, bool inverse);

/* --- cpu_mhc.c ------------------------------------------------------------------------------ */

/* From streams wk->X: wk->pre/post/comb and the collapsed input wk->y. */
void dsv4_cpu_hc_pre(const struct dsv4_cpu_ctx *c, const struct dsv4_hc *hc);
/* wk->X[k] <- post[k] * out + sum_j comb[j,k] * X[j]. */
void dsv4_cpu_hc_post(const struct dsv4_cpu_ctx *c, const float *out);
/* The final collapse of streams X [hc, D] into y [D] (before the model's norm). */
void dsv4_cpu_hc_head(const struct dsv4_cpu_ctx *c, const struct dsv4_hc_head *hh, const float *X,
                      float *y);

/* --- cpu_compressor.c ----------------------------------------------------------------------- */

/* Feed the normed sublayer input xn of the token at pos to compressor cp. When pos closes a block
 * (pos % ratio == ratio-1) writes entry (pos / ratio) to out [cp->dim] (normed, RoPE at the block's
 * first position, not yet rounded) and returns true. */
bool dsv4_cpu_compressor_push(const struct dsv4_cpu_ctx *c, const struct dsv4_compressor *cp,
                              struct dsv4_cpu_comp_state *st, const float *xn, int64_t pos, float *out);

/* --- cpu_indexer.c -------------------------------------------------------------------------- */

/* The lightning indexer of CSA layer `layer` for the query at pos (entries 0 .. n_entries-1 are
 * complete): writes the chosen entries, ascending, to wk->isel and returns their count. */
int dsv4_cpu_indexer_select(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *layer,
                            const struct dsv4_cpu_layer_state *ls, const float *xn, const float *qr,
                            int64_t pos, int n_entries);

/* --- cpu_attention.c ------------------------------------------------------------------------ */

/* The attention sublayer of `layer` for normed input xn at pos, updating ls's caches; out [D]. */
void dsv4_cpu_attention(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *layer,
                        struct dsv4_cpu_layer_state *ls, const float *xn, int64_t pos, float *out);

/* --- cpu_moe.c ------------------------------------------------------------------------------ */

/* The MoE sublayer (routed experts + shared expert) for normed input xn of `token`; out [D]:
 * route, experts over [0, E), combine over [0, E), shared. */
void dsv4_cpu_moe(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn,
                  int32_t token, float *out);
/* The router: the token's top-k experts idx[K] and their weights wt[K] (counted in c->route_counts). */
void dsv4_cpu_moe_route(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn, int32_t token,
                        int *idx, float *wt);
/* rows [K, D]: row k = expert idx[k](xn), unweighted, for the slots whose expert lies in [e0, e1) (the
 * experts one GPU holds); the other rows are left as they are. */
void dsv4_cpu_moe_experts(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn,
                          const int *idx, int e0, int e1, float *rows);
/* out [D] = sum of wt[k] * rows[k] over the slots whose expert lies in [e0, e1), in ascending expert
 * order (then slot order), starting from zero. Over [0, E) this is the routed part of the sublayer. */
void dsv4_cpu_moe_combine(const struct dsv4_config *cfg, const int *idx, const float *wt, const float *rows,
                          int e0, int e1, float *out);
/* out [D] += the shared expert of xn. */
void dsv4_cpu_moe_shared(const struct dsv4_cpu_ctx *c, const struct dsv4_ffn *ffn, const float *xn, float *out);

#endif
