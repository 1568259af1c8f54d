/* SPDX-License-Identifier: MIT */
/* The CUDA backend's state (kernels/step.cu), shared with the expert-parallel backend that drives
 * several of them in lockstep (kernels/ep_backend.cu): the per-device step, its buffers and lanes,
 * and the pieces of a step the lockstep interleaves across ranks. */
#ifndef DSV4_KERNELS_STEP_INTERNAL_H
#define DSV4_KERNELS_STEP_INTERNAL_H

#include <cuda_runtime.h>

#include "kernels/dsv4cuda.h"
#include "kernels/kernels_internal.h"
#include "kernels/prefix.h"
#include "kernels/sample.h"
#include "kernels/switches.h"

#define STEP_MAX_BUCKETS 8      /* 1, 2, 4, ..., 64 */
#define STEP_SLICE DSV4_CUDA_MAX_BATCH  /* rows per attention / indexer launch (their workspaces' rows) */
#define STEP_IN_FIELDS 5        /* per row: token, slot, position, first and last position of its slot in the step */
/* With speculation the in buffer holds a second STEP_IN_FIELDS x B block: the MTP block's rows (the
 * row's token, its slot or the padding slot, the block's position). */

/* A layer's device weights. */
struct step_layer {
    int ratio;
    bool csa, hash;
    struct dsv4_cuda_linear hc_attn_fn, hc_ffn_fn, wq_a, wq_b, wkv, wo_a, wo_b, gate, sw1, sw3, sw2;
    struct dsv4_cuda_linear c_wkv, c_wgate, i_wq_b, i_wproj, ic_wkv, ic_wgate;
    const float *attn_norm, *ffn_norm, *hca_base, *hca_scale, *hcf_base, *hcf_scale, *q_norm, *kv_norm, *sink;
    const float *c_ape, *c_norm, *ic_ape, *ic_norm, *gate_bias;
    const int32_t *tid2eid;
    struct dsv4_cuda_experts ex;
    uint64_t *route_counts;     /* [E] tokens routed to each expert (kernels/route_stats.cu) */
    int index;                  /* in the model (n_layers: the MTP block) */
    bool fetch;                 /* decode steps fetch its predicted host experts ahead (kernels/expert_fetch.cu) */
    struct dsv4_cuda_layer_cache cache;
};

/* Step buffers, each [rows of a step (dsv4_cuda_step_rows), ...] unless it says otherwise. */
struct step_buf {
    int32_t *in;                /* tokens [B], slots [B], pos [B], first [B], last [B] */
    float *X, *X2, *mix, *mixws, *post, *comb, *y, *xn, *xq, *xq2, *xq3, *sub;
    float *qr, *q, *kv, *o, *z, *cc, *cz, *ic, *iz, *iq, *iw;
    float *part, *iscores;      /* [slice rows, ...]: attention and indexer workspaces */
    uint8_t *kvown;             /* [B, entry bytes] (FP8 entries): a prefill chunk's own KV entries */
    int32_t *isel, *insel, *ridx;
    float *rlogits, *rw, *sg, *su, *sh, *sout, *hm;
    float *logits;              /* [max_batch, V]: the decode rows, or a prefill's last row */
    struct dsv4_cuda_moe_ws moe;
    struct dsv4_cuda_gemm_ws gemm, gemm2, gemm3;  /* the main lane's, the side lane's, the index lane's */
    void *shist;                /* device sampling: penalty history of max_batch slots */
    struct dsv4_sample_row *sparams;        /* [B] */
    struct dsv4_sample_result *sres;        /* [B] */
    int32_t *sslots, *stokens;              /* [B] slots to clear, sampled tokens */
    float *H;                   /* speculation: [B, hc, D] the MTP block's input streams */
    float *eo;                  /* speculation: [B, D] e_proj of the block's token */
    int32_t *dtok;              /* speculation: [max_batch] a draft's picks */
    struct dsv4_cuda_spec_comp *comp;       /* speculation: [2 n_layers] the compressors' save table */
    float *inv_main, *inv_comp;
    int64_t mixws_floats;       /* capacity of mixws */
    /* Expert parallelism (opts ep_ranks R > 0; NULL otherwise): a MoE sublayer's rows of every rank,
     * rank g's B rows at row g B of each [R rows, ...] array, and what comes back. moe (above) is then
     * sized for the R rows' pairs. */
    float *gx;                  /* [R rows, D] the routed experts' input rows */
    int32_t *gidx;              /* [R rows, K] their routing, then only the experts this rank holds (else -1) */
    float *gret;                /* [R, B K, D] rank h's expert outputs of this rank's B rows' pairs at h B K D */
};

/* A MoE sublayer between its phases: after the router, before the routed experts. */
struct step_moe {
    const float *x;             /* [B, D] the routed experts' input (FP8-rounded in fp8 numerics) */
    struct dsv4_cuda_experts ex;
    struct dsv4_cuda_pending psout;     /* the shared expert's output, pending on the side lane */
    bool shared;                /* the layer has a shared expert (the side lane is joined before the sum) */
};

/* One stream of the step and the scratch its linears own. The side lane runs a layer's independent
 * branches (the attention's compressor beside the query/KV path, the shared expert beside the routed
 * ones) and the index lane a CSA layer's indexer (its compressor, weights_proj, then the top-k once qr
 * is normalized), so that their small, latency-bound kernels overlap at small batches: the indexer's
 * chain on the side lane after the compressor had been the longest of a CSA layer's three (batch 1:
 * its own lane took 20 us off the 4-layer step, 350 us off the 43-layer one). Concurrent linears
 * cannot share a GEMM workspace (it remembers the x it prepared) or the quantize buffer. */
struct lane {
    cudaStream_t s;
    struct dsv4_cuda_gemm_ws *gemm;
    float *xq;                  /* [rows, the lane's widest linear input]: x through the activation quantizer (GEMV path) */
};

struct cuda_backend {
    struct dsv4_backend base;
    struct dsv4_backend_ops ops;    /* cuda_ops, less `sample` with DSV4_CUDA_SAMPLE=0 */
    struct dsv4_cuda_dev *dev;
    struct dsv4_cuda_prefix *prefix;    /* the prefix-cache pool, or NULL */
    const struct dsv4_config *cfg;
    bool fp8;
    int kvf;                    /* DSV4_KV_* */
    int slots;                  /* max_batch + 1: the last one takes padding rows */
    int rows;                   /* rows of one step: the longest prefill chunk (>= max_batch) */
    uint64_t eager_steps;       /* prefill chunks longer than the largest bucket, launched eagerly */
    int64_t slot_bytes;
    uint8_t *caches;
    struct step_layer *L;
    struct dsv4_cuda_linear embed, head, hch_fn;
    const float *norm, *hch_base, *hch_scale;
    struct step_buf b;
    struct lane ln[3];          /* main, side, index (the main stream when branches are off) */
    bool branches;              /* DSV4_CUDA_BRANCHES=0: every launch on the main stream */
    cudaStream_t side, indexer;
    cudaEvent_t ev_fork, ev_join;
    /* host experts fetched ahead: the device's slots (NULL: off), the lane that predicts and plans and
     * the lane that copies. ev_fetched marks a plan (after the prediction's read of xn): the main
     * lane waits for it before it writes xn again and before the layer's resolve; ev_copied marks a
     * copy, which the next plan waits for. fetch_lanes: this step's launches used them (joined at
     * its end). */
    const struct dsv4_cuda_fetch *fetch;
    struct lane fl, fc;
    cudaEvent_t ev_fetched, ev_copied;
    bool fetch_lanes;
    int64_t max_entries;
    int64_t *pos;               /* host: tokens in each slot */
    int32_t *h_in;
    int *h_slots;               /* [rows] a prefill chunk's slot column */
    int buckets[STEP_MAX_BUCKETS], n_buckets;
    cudaGraphExec_t graphs[STEP_MAX_BUCKETS];
    bool use_graphs;
    bool use_gemm;              /* tensor-core linears where the format allows (DSV4_CUDA_GEMM=0: GEMV only) */
    uint64_t captures;
    /* device sampling (ops->sample; DSV4_CUDA_SAMPLE=0 leaves it to the host) */
    struct dsv4_sample_history hist;            /* [max_batch slots, V] */
    struct dsv4_sample_row *h_sparams;          /* [max_batch], uploaded to b.sparams */
    struct dsv4_sample_result *h_sres;          /* [max_batch], copied back from b.sres */
    int32_t *h_sslots;                          /* [max_batch] slots whose history is cleared */
    int last_rows;              /* rows of the last prefill chunk or decode */
    int last_logit_row;         /* after a prefill: the logits row of its last token */
    const int32_t *last_sl;     /* their slots (h_in's column, until the next step) */
    const int32_t *last_d_sl;   /* the same column on the device (b.in's) */
    bool last_prefill;
    bool hist_broken;           /* a history clear failed: sampling refuses until the next create */
    /* speculative decoding (spec > 0) */
    int spec;                   /* S: drafts a verify takes at most; 0 off */
    struct step_layer mtp_L;    /* the MTP block's layer (its window at mtp_L.cache.win) */
    struct dsv4_cuda_linear mtp_e_proj, mtp_h_proj, mtp_hch_fn;
    const float *mtp_enorm, *mtp_hnorm, *mtp_norm, *mtp_hch_base, *mtp_hch_scale;
    int64_t ring_off;           /* a slot's ring of the main model's streams, S + 1 entries */
    struct dsv4_cuda_spec_comp *d_comp;     /* [n_comp] every compressor's state and save area */
    int n_comp;
    int64_t *mtp_pos;           /* host [slots]: the block holds positions below this */
    int64_t *row_mtp;           /* host [rows]: the last step's rows, each one's slot's mtp_pos before it */
    int64_t *v_pos;             /* host [slots]: a pending verify's first position, -1: none */
    int *v_rows;                /* host [slots]: its rows */
    int64_t *v_mtp;             /* host [slots, S + 1]: mtp_pos before each of its rows */
    int32_t *h_draft;           /* host [S, max_batch] */
    cudaGraphExec_t dgraphs[2][STEP_MAX_BUCKETS];   /* draft steps: the first (from the ring), later ones */
    float *X0, *X20;            /* the stream buffers as a step found them (restored at its end) */
    struct step_moe mid;        /* the current layer's MoE sublayer between its phases */
    /* expert parallelism: rank ep_rank of ep_ranks (0: none), holding experts [e0, e1) of each layer.
     * ev_routed marks its rows' expert input and routing ready to be gathered, ev_parted its partial
     * sums of every rank's rows ready to be returned (kernels/ep_backend.cu moves them). */
    int ep_rank, ep_ranks, e0, e1;
    cudaEvent_t ev_routed, ev_parted;
};

#define STEP(call)                  \
    do {                            \
        int rc_ = (call);           \
        if (rc_ < 0)                \
            return rc_;             \
    } while (0)

/* One rank of an expert-parallel group (opts->ep_ranks > 0): the CUDA backend booted on opts->gpus[0]
 * with the experts of its rank, its buckets chosen, neither warmed up nor captured nor sealed: its
 * steps run only beside the other ranks' (kernels/ep_backend.cu). */
int dsv4_step_rank_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                          const struct dsv4_cuda_switches *sw, struct cuda_backend **ret);

/* A step of B rows in pieces, each rank's launched in turn with the exchange between them:
 * begin (the lanes, the embedding), then for each layer routed (through the router: the experts'
 * input, routing and weights ready, ev_routed recorded), experts (over the gathered rows of every
 * rank: the experts this rank holds, ev_parted recorded) and finish (each returned pair output taken
 * from the rank holding its expert, the combine with the shared expert, mHC post), then end (the head
 * for rows [head_from, B)). */
int dsv4_step_begin(struct cuda_backend *cb, int B, cudaStream_t s);
int dsv4_step_routed(struct cuda_backend *cb, int layer, int B);
int dsv4_step_ep_experts(struct cuda_backend *cb, int B);
int dsv4_step_ep_finish(struct cuda_backend *cb, int B);
int dsv4_step_end(struct cuda_backend *cb, int B, int head_from);

/* A step's rows, as run_rows in kernels/step.cu takes them: stage fills and uploads the in columns of
 * bucket B (rows [n, B) padding) on the device stream, after queues the history record and the logits
 * copy, done (after the stream is synchronized) moves the positions on. */
int dsv4_step_rows_stage(struct cuda_backend *cb, int n, const int *slots, const int32_t *tokens, int B);
int dsv4_step_rows_after(struct cuda_backend *cb, int n, int B, bool eager, float *logits, bool last_only);
void dsv4_step_rows_done(struct cuda_backend *cb, int n, const int *slots, int B, bool eager);
/* The bucket index for n rows, -1 when n is past the largest. */
int dsv4_step_bucket(const struct cuda_backend *cb, int n);
int dsv4_step_check_token(const struct cuda_backend *cb, const char *op, int32_t token);


#endif
