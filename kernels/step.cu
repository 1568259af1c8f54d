/* SPDX-License-Identifier: MIT */
/* The CUDA backend (engine/backend.h): the whole decode step of doc/MODEL.md §3 batched over slots, one CUDA
 * graph per batch bucket captured at create, caches in the official layout.
 *
 * Boot: the device arena holds the weights, (max_batch + 1) slots of caches (the extra slot takes
 * the padding rows of a bucket larger than the batch) and the step's workspace; then one graph per
 * bucket 1, 2, 4, ..., max_batch is captured. A decode call uploads the rows' tokens, slots and
 * positions into a fixed device buffer, replays the bucket's graph and copies the logits back: no
 * allocation, no capture. DSV4_CUDA_GRAPHS=0 runs the same launches eagerly (for comparison);
 * DSV4_CUDA_LOG=1 prints the boot log (every op's variant) to stderr. stats.variant names the KV
 * format and the graph count in use.
 *
 * Prefill runs in chunks of up to `rows` (opts->prefill_chunk, at least max_batch) consecutive
 * positions of one slot, each chunk one step: the chunk's rows are a batch for every linear (tensor
 * cores) and for the experts, and the compressors take the chunk's earlier tokens from its own
 * rows. A chunk that fits a bucket replays its graph; a longer one launches the same kernels eagerly
 * for exactly its rows (counted in stats), the head for its last row only. Attention and the
 * indexer go through a chunk in slices of up to DSV4_CUDA_MAX_BATCH rows: each slice stores its KV,
 * then reads its windows, so the window ring needs only window + slice - 1 entries.
 *
 * Speculative decoding (opts->spec_tokens S > 0, the checkpoint's MTP block, spec_tokens_for): the
 * block lags the main model by one position, as the CPU backend's does. Every step, after the head,
 * each row whose slot's block stands at its position - 1 runs the block there (the catch-up) on the
 * main model's streams of that position (the step's previous row, or the slot's ring of the last S + 1
 * rows' streams) and the row's token; rows that do not go to the padding slot. Then every row's
 * streams enter the ring. draft replays a graph of the block plus the head and an argmax, once per
 * draft; verify is a step of each slot's rows with every row's logits, after a save of the ring rows
 * its positions overwrite in every compressor's partial state; accept writes back those of rejected
 * positions. The window rings (window + S rows or more) and the compressed entries and indexer keys
 * need no undo: what rejected rows wrote is overwritten before anything reads it. With speculation
 * on, sampling runs on the host (the scheduler samples a verify's rows there). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_util.cuh"
#include "kernels/step_internal.h"

/* ---- sizes shared with the device boot ---- */

static int64_t a256(int64_t n)
{
    return (n + 255) / 256 * 256;
}

static int kv_format(const struct dsv4_backend_opts *o)
{
    return o->numerics == DSV4_NUMERICS_FP8 ? DSV4_KV_FP8 : DSV4_KV_F32;
}

/* Rows of one step: a decode batch (max_batch) or a prefill chunk (opts->prefill_chunk, default
 * DSV4_PREFILL_CHUNK_DEFAULT), no longer than a slot. dsv4_cuda_dev_create checks the range. */
int dsv4_cuda_step_rows(const struct dsv4_backend_opts *o)
{
    int chunk = o->prefill_chunk > 0 ? o->prefill_chunk : DSV4_PREFILL_CHUNK_DEFAULT;
    chunk = chunk < o->max_context ? chunk : o->max_context;
    return chunk > o->max_batch ? chunk : o->max_batch;
}

/* Rows of one attention slice: a whole decode batch, or STEP_SLICE rows of a longer chunk. */
static int slice_rows(const struct dsv4_backend_opts *o)
{
    const int r = dsv4_cuda_step_rows(o);
    return r < STEP_SLICE ? r : STEP_SLICE;
}

/* Window ring entries: a slice's rows may be consecutive positions of one slot (a prefill chunk),
 * all stored before the first of them reads its window. */
static int ring_entries(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    return c->window + slice_rows(o) - 1;
}

int dsv4_cuda_step_ring_entries(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    return ring_entries(c, o);
}

/* The compressors' partial states keep comp_ring rows (compressor.cu): 2 ratio when overlapping
 * (CSA's and every indexer's), else ratio. */
static int comp_ring_rows(int ratio, bool overlap)
{
    return overlap ? 2 * ratio : ratio;
}

/* S drafts when speculation can run here: asked for, an MTP block in the config, every compressor's
 * ring at least S + 1 rows (a verify's positions then land on distinct rows, which accept restores),
 * and a bucket that takes a slot's S + 1 rows. The create also needs the block's weights (a
 * sliding-window layer); without them the caches' share for it stays unused. */
static int spec_tokens_for(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    const int S = o->spec_tokens;
    if (S < 1 || c->n_mtp_layers < 1 || o->max_batch < S + 1)
        return 0;
    for (int i = 0; i < c->n_layers; i++) {
        const int r = c->compress_ratio[i];
        if (r > 0 && comp_ring_rows(r, r == c->csa_ratio) < S + 1)
            return 0;
    }
    return S;
}

int dsv4_cuda_step_spec_tokens(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    return spec_tokens_for(c, o);
}

/* A slot's speculation share, from byte off on: the MTP block's window ring, the ring of the main
 * model's streams, then each compressor's save area (main, then the indexer's, layer by layer).
 * Returns the end; with comp, fills [n] descriptors against lc (n returned in *n_comp). */
static int64_t spec_layout(const struct dsv4_config *c, const struct dsv4_backend_opts *o, int64_t off,
                           const struct dsv4_cuda_layer_cache *lc, int64_t *mtp_win, int64_t *ring,
                           struct dsv4_cuda_spec_comp *comp, int *n_comp)
{
    const int S = spec_tokens_for(c, o), eb = dsv4_cuda_kv_entry_bytes(c->head_dim, c->rope_dim, kv_format(o));
    int n = 0;
    if (!S)
        return off;
    if (mtp_win)
        *mtp_win = off;
    off += a256((int64_t)ring_entries(c, o) * eb);
    if (ring)
        *ring = off;
    off += a256((int64_t)(S + 1) * c->hc_mult * c->dim * 4);
    for (int i = 0; i < c->n_layers; i++) {
        const int r = c->compress_ratio[i];
        const bool csa = r > 0 && r == c->csa_ratio;
        for (int k = 0; r > 0 && k < (csa ? 2 : 1); k++) {
            const int width = k ? 2 * c->index_head_dim : (csa ? 2 : 1) * c->head_dim;
            if (comp)
                comp[n] = { lc ? (k ? lc[i].istate : lc[i].cstate) : 0, off, comp_ring_rows(r, k || csa), width };
            n++;
            off += a256((int64_t)(DSV4_SPEC_TOKENS_MAX + 1) * 2 * width * 4);
        }
    }
    if (n_comp)
        *n_comp = n;
    return off;
}

/* The slot layout (dsv4_cuda_step_slot_layout), and with speculation its share (spec_layout). */
static int64_t slot_layout(const struct dsv4_config *c, const struct dsv4_backend_opts *o,
                           struct dsv4_cuda_layer_cache *lc, int64_t *mtp_win, int64_t *ring,
                           struct dsv4_cuda_spec_comp *comp, int *n_comp)
{
    const int eb = dsv4_cuda_kv_entry_bytes(c->head_dim, c->rope_dim, kv_format(o));
    int64_t off = 0;
    for (int i = 0; i < c->n_layers; i++) {
        const int r = c->compress_ratio[i];
        struct dsv4_cuda_layer_cache l = {};
        l.win = off;
        off += a256((int64_t)ring_entries(c, o) * eb);
        if (r > 0) {
            const int64_t n = (o->max_context + r - 1) / r;
            const bool csa = r == c->csa_ratio;
            l.comp = off;
            off += a256(n * eb);
            l.cstate = off;
            off += a256(dsv4_cuda_comp_state_floats(r, c->head_dim, csa) * 4);
            if (csa) {
                l.ikeys = off;
                off += a256(n * dsv4_cuda_index_key_bytes(c->index_head_dim, o->numerics == DSV4_NUMERICS_FP8));
                l.istate = off;
                off += a256(dsv4_cuda_comp_state_floats(r, c->index_head_dim, true) * 4);
            }
        }
        if (lc)
            lc[i] = l;
    }
    return spec_layout(c, o, off, lc, mtp_win, ring, comp, n_comp);
}

int64_t dsv4_cuda_step_slot_layout(const struct dsv4_config *c, const struct dsv4_backend_opts *o,
                                   struct dsv4_cuda_layer_cache *lc)
{
    return slot_layout(c, o, lc, NULL, NULL, NULL, NULL);
}

size_t dsv4_cuda_step_cache_bytes(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    return (size_t)dsv4_cuda_step_slot_layout(c, o, NULL) * (size_t)(o->max_batch + 1);
}

static int64_t max_linear_in(const struct dsv4_config *c)
{
    int64_t m = (int64_t)c->hc_mult * c->dim;
    const int64_t cand[] = { c->q_lora_rank, (int64_t)c->n_heads * c->head_dim,
                             (int64_t)c->o_groups * c->o_lora_rank, c->moe_inter,
                             (int64_t)c->moe_inter * (c->n_shared_experts ? c->n_shared_experts : 1) };
    for (int64_t v : cand)
        m = v > m ? v : m;
    return m;
}

/* The widest input of the index lane's linears: the indexer's compressor and weights_proj read xn
 * [dim], its wq_b reads qr [q_lora_rank]. */
static int64_t index_lane_in(const struct dsv4_config *c)
{
    return c->dim > c->q_lora_rank ? c->dim : c->q_lora_rank;
}

static int64_t max_csa_entries(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    return c->csa_ratio > 0 ? (o->max_context + c->csa_ratio - 1) / c->csa_ratio : 1;
}

/* Carve (or, with base NULL, size) the step buffers: B rows of a step, Bd decode rows, Bs slice rows. */
static int64_t buffers(const struct dsv4_config *c, const struct dsv4_backend_opts *o, uint8_t *base, struct step_buf *sb)
{
    const int64_t B = dsv4_cuda_step_rows(o), Bd = o->max_batch, Bs = slice_rows(o);
    const int64_t D = c->dim, hc = c->hc_mult, H = c->n_heads, hd = c->head_dim;
    const int64_t E = c->n_experts, K = c->n_experts_per_tok, I = c->moe_inter;
    const int64_t Is = (int64_t)c->moe_inter * (c->n_shared_experts ? c->n_shared_experts : 1);
    const int64_t nI = c->index_n_heads, dI = c->index_head_dim;
    int64_t off = 0;
    auto take = [&](int64_t bytes) -> void * {
        void *p = base ? base + off : NULL;
        off += a256(bytes);
        return p;
    };
    auto f = [&](int64_t n) { return static_cast<float *>(take(n * 4)); };
    auto i32 = [&](int64_t n) { return static_cast<int32_t *>(take(n * 4)); };
    struct step_buf t = {};
    const bool spec = spec_tokens_for(c, o) > 0;
    t.in = i32(STEP_IN_FIELDS * B * (spec ? 2 : 1));
    t.X = f(B * hc * D);
    t.X2 = f(B * hc * D);
    t.mix = f(B * (2 + hc) * hc);
    t.mixws_floats = dsv4_cuda_mhc_fn_ws_floats((int)B, (2 + hc) * hc, hc * D);  /* covers hc_head's hc rows */
    t.mixws = f(t.mixws_floats);
    t.post = f(B * hc);
    t.comb = f(B * hc * hc);
    t.y = f(B * D);
    t.xn = f(B * D);
    t.xq = f(B * max_linear_in(c));
    t.xq2 = f(B * max_linear_in(c));
    t.xq3 = f(B * index_lane_in(c));
    t.sub = f(B * D);
    t.qr = f(B * c->q_lora_rank);
    t.q = f(B * H * hd);
    t.kv = f(B * hd);
    t.o = f(B * H * hd);
    t.z = f(B * (int64_t)c->o_groups * c->o_lora_rank);
    t.part = f(Bs * DSV4_CUDA_ATT_SPLITS * H * (hd + 2));
    t.kvown = static_cast<uint8_t *>(
        take(kv_format(o) == DSV4_KV_FP8 ? B * dsv4_cuda_kv_entry_bytes((int)hd, c->rope_dim, DSV4_KV_FP8) : 0));
    t.cc = f(B * 2 * hd);
    t.cz = f(B * 2 * hd);
    t.ic = f(B * 2 * dI);
    t.iz = f(B * 2 * dI);
    t.iq = f(B * nI * dI);
    t.iw = f(B * nI);
    t.iscores = f(Bs * max_csa_entries(c, o));
    t.isel = i32(B * (c->index_topk > 0 ? c->index_topk : 1));
    t.insel = i32(B);
    t.rlogits = f(B * E);
    t.ridx = i32(B * K);
    t.rw = f(B * K);
    /* the routed experts run over every rank's rows under expert parallelism */
    const int64_t R = o->ep_ranks > 0 ? o->ep_ranks : 1, Bg = R * B;
    t.moe.d_groups = i32(3 * Bg * K + 2);
    t.moe.d_h = f(Bg * K * I);
    t.moe.d_out = f(Bg * K * D);
    if (o->ep_ranks > 0) {
        t.gx = f(Bg * D);
        t.gidx = i32(Bg * K);
        t.gret = f(Bg * K * D);
    }
    t.sg = f(B * Is);
    t.su = f(B * Is);
    t.sh = f(B * Is);
    t.sout = f(B * D);
    t.hm = f(B * hc);
    t.logits = f(Bd * c->vocab_size);
    void *g = take((int64_t)dsv4_cuda_gemm_ws_bytes((int)B, max_linear_in(c)));
    void *g2 = take((int64_t)dsv4_cuda_gemm_ws_bytes((int)B, max_linear_in(c)));
    void *g3 = take((int64_t)dsv4_cuda_gemm_ws_bytes((int)B, index_lane_in(c)));
    if (base) {
        dsv4_cuda_gemm_ws_init(&t.gemm, g, (int)B, max_linear_in(c));
        dsv4_cuda_gemm_ws_init(&t.gemm2, g2, (int)B, max_linear_in(c));
        dsv4_cuda_gemm_ws_init(&t.gemm3, g3, (int)B, index_lane_in(c));
    }
    t.shist = take((int64_t)dsv4_sample_history_bytes((int)Bd, c->vocab_size));
    t.sparams = static_cast<struct dsv4_sample_row *>(take(Bd * (int64_t)sizeof(struct dsv4_sample_row)));
    t.sres = static_cast<struct dsv4_sample_result *>(take(Bd * (int64_t)sizeof(struct dsv4_sample_result)));
    t.sslots = i32(Bd);
    t.stokens = i32(Bd);
    t.H = f(spec ? B * hc * D : 0);
    t.eo = f(spec ? B * D : 0);
    t.dtok = i32(spec ? Bd : 0);
    t.comp = static_cast<struct dsv4_cuda_spec_comp *>(
        take(spec ? 2 * (int64_t)c->n_layers * (int64_t)sizeof(struct dsv4_cuda_spec_comp) : 0));
    t.inv_main = f(c->rope_dim / 2);
    t.inv_comp = f(c->rope_dim / 2);
    if (sb)
        *sb = t;
    return off;
}

size_t dsv4_cuda_step_workspace_bytes(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    return (size_t)buffers(c, o, NULL, NULL) + DSV4_CUDA_ARENA_ALIGN;
}

/* Inverse frequencies as transformers computes them in f32 (doc/MODEL.md §3.1: YaRN ramp, no mscale). */
static void inv_freq(const struct dsv4_rope *p, int rd, float *out)
{
    const float base = (float)p->theta;
    double low = 0.0, high = 0.0;
    if (p->yarn) {
        const double l0 = (double)p->yarn_original_max;
        low = floor(rd * log(l0 / (p->beta_fast * 2.0 * M_PI)) / (2.0 * log(p->theta)));
        high = ceil(rd * log(l0 / (p->beta_slow * 2.0 * M_PI)) / (2.0 * log(p->theta)));
        low = low < 0.0 ? 0.0 : low;
        high = high > rd - 1 ? rd - 1 : high;
        if (low == high)
            high += 0.001;
    }
    for (int i = 0; i < rd / 2; i++) {
        const float pos_freq = powf(base, (float)(2 * i) / (float)rd), extrap = 1.0f / pos_freq;
        if (!p->yarn) {
            out[i] = extrap;
            continue;
        }
        const float interp = 1.0f / ((float)p->yarn_factor * pos_freq);
        float ramp = ((float)i - (float)low) / (float)(high - low);
        ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
        const float extrap_w = 1.0f - ramp;
        out[i] = interp * (1.0f - extrap_w) + extrap * extrap_w;
    }
}

/* ---- the step ---- */

static bool quantized(const struct dsv4_cuda_linear *W)
{
    return W->fmt == DSV4_W_FP8 || W->fmt == DSV4_W_FP4;
}

/* y = W x for B rows; fp8 numerics round x through the 1x128 activation quantizer first when W is
 * quantized and `raw` is false (the CPU reference's dsv4_cpu_linear_rows). */
/* same_x: x is the previous linear's x, unchanged since, so the tensor-core path need not prepare it
 * again (dsv4_cuda_gemm_same_x). */
static bool lin_quant(const struct cuda_backend *cb, const struct dsv4_cuda_linear *W, bool raw)
{
    return cb->fp8 && !raw && quantized(W);
}

static int lin_x(const struct cuda_backend *cb, const struct dsv4_cuda_linear *W, const float *x, int64_t ldx, int B,
                 float *y, int64_t ldy, bool raw, bool same_x, const struct lane *ln)
{
    const bool quant = lin_quant(cb, W, raw);
    if (cb->use_gemm && dsv4_cuda_gemm_supports(W, quant))
        return (same_x ? dsv4_cuda_gemm_same_x : dsv4_cuda_gemm)(W, x, ldx, B, quant, ln->gemm, y, ldy, ln->s);
    if (quant) {
        if (ldx != W->in)
            return dsv4_error_set(-EINVAL, "cuda step: quantized linear input must be dense");
        STEP(dsv4_cuda_fp8_roundtrip(x, B, W->in, DSV4_CUDA_ACT_BLOCK, ln->xq, ln->s));
        x = ln->xq;
        ldx = W->in;
    }
    return dsv4_cuda_gemv(W, x, ldx, B, y, ldy, ln->s);
}

static int lin(const struct cuda_backend *cb, const struct dsv4_cuda_linear *W, const float *x, int64_t ldx, int B,
               float *y, int64_t ldy, bool raw, const struct lane *ln)
{
    return lin_x(cb, W, x, ldx, B, y, ldy, raw, false, ln);
}

/* lin_x for the decode chains: where K is split, y may stay pending in *py (struct dsv4_cuda_pending)
 * for a reader that sums it, and x may be pending in px (NULL: none) in the buffer x names, which the
 * GEMV path has reduced first. */
static int lin_pend(const struct cuda_backend *cb, const struct dsv4_cuda_linear *W, float *x,
                    const struct dsv4_cuda_pending *px, int64_t ldx, int B, float *y, int64_t ldy, bool same_x,
                    const struct lane *ln, struct dsv4_cuda_pending *py)
{
    const bool quant = lin_quant(cb, W, false);
    *py = dsv4_cuda_pending{};
    if (cb->use_gemm && dsv4_cuda_gemm_supports(W, quant))
        return dsv4_cuda_gemm_deferred(W, x, px, ldx, B, quant, same_x, ln->gemm, y, ldy, py, ln->s);
    STEP(dsv4_cuda_pending_flush(px, x, ldx, ln->s));
    return lin_x(cb, W, x, ldx, B, y, ldy, false, same_x && !(px && px->splits), ln);
}

/* lin() for a linear whose x the previous lin() call on the same lane read, unchanged since. */
static int lin_same_x(const struct cuda_backend *cb, const struct dsv4_cuda_linear *W, const float *x, int64_t ldx,
                      int B, float *y, int64_t ldy, const struct lane *ln)
{
    return lin_x(cb, W, x, ldx, B, y, ldy, false, true, ln);
}

/* `to` waits for everything issued so far on `from` (an event edge in the captured graph). */
static int lane_wait(const struct cuda_backend *cb, const struct lane *to, const struct lane *from, cudaEvent_t ev)
{
    if (!cb->branches)
        return 0;
    DSV4_CUDA_TRY(cudaEventRecord(ev, from->s));
    DSV4_CUDA_TRY(cudaStreamWaitEvent(to->s, ev, 0));
    return 0;
}

/* The compressor arguments common to a layer's two compressors, for B rows of t->in. */
static struct dsv4_cuda_comp_args comp_args(const struct cuda_backend *cb, int B)
{
    const struct step_buf *t = &cb->b;
    struct dsv4_cuda_comp_args ca = {};
    ca.rd = cb->cfg->rope_dim;
    ca.fp8 = cb->fp8;
    ca.kvf = cb->kvf;
    ca.eps = (float)cb->cfg->rms_norm_eps;
    ca.inv_freq = t->inv_comp;
    ca.pos = t->in + 2 * B;
    ca.slot = t->in + B;
    ca.first = t->in + 3 * B;
    ca.last = t->in + 4 * B;
    ca.state_slot_stride = cb->slot_bytes / 4;
    ca.entries_slot_stride = cb->slot_bytes;
    return ca;
}

/* The compressor of a CSA or HCA layer (its entries into the slot's compressed cache), from xn on
 * lane `ln`. */
static int compress(const struct cuda_backend *cb, const struct step_layer *L, int B, const struct lane *ln)
{
    const struct dsv4_config *c = cb->cfg;
    const struct step_buf *t = &cb->b;
    const int hd = c->head_dim, coff = L->csa ? 2 : 1;
    struct dsv4_cuda_comp_args ca = comp_args(cb, B);

    STEP(lin(cb, &L->c_wkv, t->xn, c->dim, B, t->cc, coff * hd, false, ln));
    STEP(lin_same_x(cb, &L->c_wgate, t->xn, c->dim, B, t->cz, coff * hd, ln));
    ca.c = t->cc;
    ca.z = t->cz;
    ca.ape = L->c_ape;
    ca.norm = L->c_norm;
    ca.ratio = L->ratio;
    ca.d = hd;
    ca.overlap = L->csa;
    ca.indexer = false;
    ca.state = reinterpret_cast<float *>(cb->caches + L->cache.cstate);
    ca.entries = cb->caches + L->cache.comp;
    ca.entry_bytes = dsv4_cuda_kv_entry_bytes(hd, c->rope_dim, cb->kvf);
    return dsv4_cuda_compressor(&ca, B, ln->s);
}

/* A CSA layer's indexer compressor (its keys into the slot's key cache) and weights_proj, from xn on
 * lane `ln`: independent of compress(), so the two run on lanes of their own. */
static int compress_index(const struct cuda_backend *cb, const struct step_layer *L, int B, const struct lane *ln)
{
    const struct dsv4_config *c = cb->cfg;
    const struct step_buf *t = &cb->b;
    const int nI = c->index_n_heads, dI = c->index_head_dim;
    struct dsv4_cuda_comp_args ca = comp_args(cb, B);

    STEP(lin(cb, &L->ic_wkv, t->xn, c->dim, B, t->ic, 2 * dI, false, ln));
    STEP(lin_same_x(cb, &L->ic_wgate, t->xn, c->dim, B, t->iz, 2 * dI, ln));
    ca.c = t->ic;
    ca.z = t->iz;
    ca.ape = L->ic_ape;
    ca.norm = L->ic_norm;
    ca.ratio = L->ratio;
    ca.d = dI;
    ca.overlap = true;
    ca.indexer = true;
    ca.state = reinterpret_cast<float *>(cb->caches + L->cache.istate);
    ca.entries = cb->caches + L->cache.ikeys;
    ca.entry_bytes = dsv4_cuda_index_key_bytes(dI, cb->fp8);
    STEP(dsv4_cuda_compressor(&ca, B, ln->s));
    return lin(cb, &L->i_wproj, t->xn, c->dim, B, t->iw, nI, false, ln);
}

/* The indexer's query from the normalized qr, its scores over the slot's keys and the top-k
 * selection the CSA attention reads (t->isel, t->insel), on lane `ln`; the scores a slice of rows
 * at a time (their workspace holds a slice). */
static int index_select(const struct cuda_backend *cb, const struct step_layer *L, int B, const struct lane *ln)
{
    const struct dsv4_config *c = cb->cfg;
    const struct step_buf *t = &cb->b;
    const int nI = c->index_n_heads, dI = c->index_head_dim, topk = c->index_topk, S = slice_rows(&cb->base.opts);
    const int32_t *pos = t->in + 2 * B;
    struct dsv4_cuda_index_args ia = {};

    STEP(lin(cb, &L->i_wq_b, t->qr, c->q_lora_rank, B, t->iq, (int64_t)nI * dI, false, ln));
    STEP(dsv4_cuda_indexer_q(t->iq, B, nI, dI, c->rope_dim, cb->fp8, pos, t->inv_comp, ln->s));
    ia.nI = nI;
    ia.dI = dI;
    ia.ratio = L->ratio;
    ia.topk = topk;
    ia.keys = cb->caches + L->cache.ikeys;
    ia.keys_slot_stride = cb->slot_bytes;
    ia.packed = cb->fp8;
    ia.max_entries = (int)cb->max_entries;
    ia.scores = t->iscores;
    for (int r0 = 0; r0 < B; r0 += S) {
        ia.q = t->iq + (int64_t)r0 * nI * dI;
        ia.w = t->iw + (int64_t)r0 * nI;
        ia.pos = pos + r0;
        ia.slot = t->in + B + r0;
        ia.sel = t->isel + (int64_t)r0 * topk;
        ia.nsel = t->insel + r0;
        STEP(dsv4_cuda_indexer(&ia, B - r0 < S ? B - r0 : S, ln->s));
    }
    return 0;
}

/* qr = q_norm(wq_a's result, pending in pqr); *prepared: the same launch prepared qr for wq_b (in decode
 * steps, where wq_a's result is its partials: the reduction, the norm and the quantization in one
 * launch). */
static int norm_qr(struct cuda_backend *cb, const struct step_layer *L, int B, const struct dsv4_cuda_pending *pqr,
                   bool *prepared)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    const struct lane *m = &cb->ln[0];
    const bool quant = lin_quant(cb, &L->wq_b, false);
    const float eps = (float)c->rms_norm_eps;
    *prepared = pqr->splits && cb->use_gemm && dsv4_cuda_gemm_norm_supports(&L->wq_b, quant);
    if (*prepared)
        return dsv4_cuda_gemm_norm(&L->wq_b, quant, t->qr, pqr, L->q_norm, B, eps, m->gemm, t->qr, m->s);
    STEP(dsv4_cuda_pending_flush(pqr, t->qr, c->q_lora_rank, m->s));
    return dsv4_cuda_rmsnorm(t->qr, L->q_norm, B, c->q_lora_rank, eps, t->qr, m->s);
}

/* Main lane: q (wq_a, norm, wq_b, RoPE) and this position's KV into the window. Side lane, from xn:
 * compress(). Index lane (CSA layers), from xn: compress_index(), then index_select() once the main
 * lane has normalized qr. Attention joins them. The output projection's result is left pending in
 * *psub for sublayer_post. */
/* prepared: sublayer_pre left xn prepared for wq_a in the main lane's workspace. */
static int attention(struct cuda_backend *cb, const struct step_layer *L, int B, bool prepared,
                     struct dsv4_cuda_pending *psub)
{
    const struct lane *m = &cb->ln[0], *sd = &cb->ln[1], *ix = &cb->ln[2];
    const cudaStream_t s = m->s;
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    const int H = c->n_heads, hd = c->head_dim, rd = c->rope_dim;
    const int32_t *pos = t->in + 2 * B, *slot = t->in + B;
    const float *inv = L->ratio ? t->inv_comp : t->inv_main;
    const float eps = (float)c->rms_norm_eps;
    struct dsv4_cuda_pending pqr, pkv, pz;      /* wq_a's, wkv's and wo_a's results (two at a time) */
    bool qb_prepared;

    if (L->ratio) {
        STEP(lane_wait(cb, sd, m, cb->ev_fork));
        STEP(compress(cb, L, B, sd));
    }
    if (L->csa) {
        STEP(lane_wait(cb, ix, m, cb->ev_fork));
        STEP(compress_index(cb, L, B, ix));
    }
    STEP(lin_pend(cb, &L->wq_a, t->xn, NULL, c->dim, B, t->qr, c->q_lora_rank, prepared, m, &pqr));
    STEP(lin_pend(cb, &L->wkv, t->xn, NULL, c->dim, B, t->kv, hd, true, m, &pkv));
    STEP(norm_qr(cb, L, B, &pqr, &qb_prepared));
    if (L->csa) {
        STEP(lane_wait(cb, ix, m, cb->ev_fork));
        STEP(index_select(cb, L, B, ix));
    }
    STEP(lin_x(cb, &L->wq_b, t->qr, c->q_lora_rank, B, t->q, (int64_t)H * hd, false, qb_prepared, m));
    STEP(dsv4_cuda_rmsnorm_rope(t->q, NULL, NULL, B * H, hd, eps, H, rd, pos, inv, t->q, s));
    STEP(dsv4_cuda_rmsnorm_rope(t->kv, &pkv, L->kv_norm, B, hd, eps, 1, rd, pos, inv, t->kv, s));
    if (L->ratio)
        STEP(lane_wait(cb, m, sd, cb->ev_join));
    if (L->csa)
        STEP(lane_wait(cb, m, ix, cb->ev_join));

    struct dsv4_cuda_att_args a = {};
    a.H = H;
    a.hd = hd;
    a.rd = rd;
    a.kvf = cb->kvf;
    a.entry_bytes = dsv4_cuda_kv_entry_bytes(hd, rd, cb->kvf);
    a.win = cb->caches + L->cache.win;
    a.win_slot_stride = cb->slot_bytes;
    a.window = c->window;
    a.ring = ring_entries(c, &cb->base.opts);
    a.scale = 1.0f / sqrtf((float)hd);
    a.part = t->part;
    /* a prefill chunk's rows fill the chip without splitting each row's keys, so a block takes all
     * of a row's runs (no partials, no combine; the same bits as the decode launches) */
    a.whole = B > DSV4_CUDA_MAX_BATCH;
    if (L->ratio) {
        a.comp = cb->caches + L->cache.comp;
        a.comp_slot_stride = cb->slot_bytes;
        a.ratio = L->ratio;
    }
    if (L->csa)
        a.sel_stride = c->index_topk;
    const int ring = ring_entries(c, &cb->base.opts);
    if (dsv4_cuda_attention_whole(&a)) {
        /* a prefill chunk in one launch: its rows' own entries first, read from t->kvown (a row's
         * window past its run's first position); the ring gets the chunk's last entries after every
         * row has read its window from it */
        STEP(dsv4_cuda_kv_store(t->kv, B, hd, rd, cb->kvf, pos, NULL, t->kvown, 0, 0, NULL, s));
        a.own = t->kvown;
        a.first = t->in + 3 * B;
        a.q = t->q;
        a.pos = pos;
        a.slot = slot;
        if (L->csa) {
            a.sel = t->isel;
            a.nsel = t->insel;
        }
        STEP(dsv4_cuda_attention(&a, B, L->sink, inv, t->o, s));
        STEP(dsv4_cuda_kv_store(t->kv, B, hd, rd, cb->kvf, pos, slot, cb->caches + L->cache.win, cb->slot_bytes, ring,
                                t->in + 4 * B, s));
    } else {
        /* a slice stores its KV before its rows read their windows; a later slice's entries land
         * where this one's windows no longer look (ring_entries) */
        const int S = slice_rows(&cb->base.opts);
        for (int r0 = 0; r0 < B; r0 += S) {
            const int n = B - r0 < S ? B - r0 : S;
            STEP(dsv4_cuda_kv_store(t->kv + (int64_t)r0 * hd, n, hd, rd, cb->kvf, pos + r0, slot + r0,
                                    cb->caches + L->cache.win, cb->slot_bytes, ring, NULL, s));
            a.q = t->q + (int64_t)r0 * H * hd;
            a.pos = pos + r0;
            a.slot = slot + r0;
            if (L->csa) {
                a.sel = t->isel + (int64_t)r0 * c->index_topk;
                a.nsel = t->insel + r0;
            }
            STEP(dsv4_cuda_attention(&a, n, L->sink, inv, t->o + (int64_t)r0 * H * hd, s));
        }
    }

    /* grouped output projection: group g maps heads [g H/G, (g+1) H/G) through rows [g R, (g+1) R) of
     * wo_a (run unquantized, as the reference runs wo_a in BF16); one launch where R is whole scale
     * blocks, else a view per group */
    const int G = c->o_groups, R = c->o_lora_rank;
    const int64_t gin = (int64_t)H * hd / G;
    pz = dsv4_cuda_pending{};
    if (cb->use_gemm && dsv4_cuda_gemm_grouped_supports(&L->wo_a, G))
        STEP(dsv4_cuda_gemm_grouped_deferred(&L->wo_a, G, t->o, (int64_t)H * hd, B, m->gemm, t->z, (int64_t)G * R,
                                             &pz, s));
    else
        for (int g = 0; g < G; g++) {
            const struct dsv4_cuda_linear v = dsv4_cuda_linear_rows(&L->wo_a, (int64_t)g * R, R);
            STEP(lin(cb, &v, t->o + g * gin, (int64_t)H * hd, B, t->z + (int64_t)g * R, (int64_t)G * R, true, m));
        }
    return lin_pend(cb, &L->wo_b, t->z, &pz, (int64_t)G * R, B, t->sub, c->dim, false, m, psub);
}

/* Main lane: gate, router and the routed experts. Side lane, from xn: the shared expert into sout,
 * which the routed experts' combine adds as it writes sub. The linears' results pending in decode
 * steps are summed by their readers: the router, SwiGLU, the combine. */
/* prepared: sublayer_pre left xn prepared for the gate in the main lane's workspace. */
/* fetch: the layer fetched ahead (fetch_ahead): after the router, resolve stops the copy and points the
 * expert kernels at what it copied. */
/* A MoE sublayer up to its routed experts: the shared expert on the side lane, the router, the
 * routing counts, the fetched experts resolved, the experts' input rounded (fp8 numerics): cb->mid. */
static int moe_route(struct cuda_backend *cb, const struct step_layer *L, int B, bool prepared, bool fetch)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    struct step_moe *m = &cb->mid;
    const struct lane *ml = &cb->ln[0], *sd = &cb->ln[1];
    const cudaStream_t s = ml->s;
    const int D = c->dim, K = c->n_experts_per_tok;
    struct dsv4_cuda_pending psg, psu, plogits;

    m->ex = L->ex;
    m->psout = dsv4_cuda_pending{};
    m->shared = L->sw1.w != NULL;
    if (m->shared) {
        const int64_t Is = L->sw1.out;
        STEP(lane_wait(cb, sd, ml, cb->ev_fork));
        STEP(lin_pend(cb, &L->sw1, t->xn, NULL, D, B, t->sg, Is, false, sd, &psg));
        STEP(lin_pend(cb, &L->sw3, t->xn, NULL, D, B, t->su, Is, true, sd, &psu));
        STEP(dsv4_cuda_swiglu(t->sg, &psg, t->su, &psu, B, Is, (float)c->swiglu_limit, t->sh, sd->s));
        STEP(lin_pend(cb, &L->sw2, t->sh, NULL, Is, B, t->sout, D, false, sd, &m->psout));
    }
    STEP(lin_pend(cb, &L->gate, t->xn, NULL, D, B, t->rlogits, c->n_experts, prepared, ml, &plogits));
    STEP(dsv4_cuda_router(t->rlogits, &plogits, B, c->n_experts, K, L->hash ? NULL : L->gate_bias,
                          L->hash ? L->tid2eid : NULL, t->in, (float)c->routed_scaling_factor, t->ridx, t->rw, s));
    if (L->route_counts)    /* the MTP block's routing is not counted */
        STEP(dsv4_cuda_route_count(t->ridx, B, K, t->in + B, cb->slots - 1, L->route_counts, s));
    if (fetch) {
        STEP(dsv4_cuda_fetch_resolve(cb->fetch, L->index, t->ridx, B, K, s));
        m->ex.fetch_redirect = cb->fetch->redirect + (int64_t)L->index * c->n_experts;
    }
    m->ex.quant_act = cb->fp8 && (m->ex.fmt == DSV4_W_FP8 || m->ex.fmt == DSV4_W_FP4);
    m->x = t->xn;
    if (m->ex.quant_act) {
        STEP(dsv4_cuda_fp8_roundtrip(t->xn, B, D, DSV4_CUDA_ACT_BLOCK, t->xq, s));
        m->x = t->xq;
    }
    return 0;
}

/* The rest of a MoE sublayer on one device: the routed experts, then their weighted sum and the
 * shared expert's output into t->sub. */
static int moe_local(struct cuda_backend *cb, int B)
{
    struct step_buf *t = &cb->b;
    const struct step_moe *m = &cb->mid;
    const cudaStream_t s = cb->ln[0].s;
    const int K = cb->cfg->n_experts_per_tok;
    STEP(dsv4_cuda_moe_routed(&m->ex, m->x, B, K, t->ridx, &t->moe, s));
    if (m->shared)
        STEP(lane_wait(cb, &cb->ln[0], &cb->ln[1], cb->ev_join));
    return dsv4_cuda_moe_combine(&m->ex, B, K, t->ridx, t->rw, &t->moe, m->shared ? t->sout : NULL, &m->psout, t->sub,
                                 s);
}

/* F32 mHC fn weights (both releases) take the split-K kernel; other formats (converted test
 * checkpoints) the generic GEMV. The choice depends on the weight alone, never on the batch. */
static bool fn_split_k(const struct dsv4_cuda_linear *fn)
{
    return fn->fmt == DSV4_W_F32;
}

/* An mHC fn GEMV over the streams X [B, hc, D], on the path fn_split_k chooses. */
static int hc_fn(struct cuda_backend *cb, const struct dsv4_cuda_linear *fn, const float *X, int B, float *y,
                 cudaStream_t s)
{
    struct step_buf *t = &cb->b;
    const int64_t ldx = (int64_t)cb->cfg->hc_mult * cb->cfg->dim;
    if (fn_split_k(fn))
        return dsv4_cuda_mhc_fn(fn, X, ldx, B, t->mixws, t->mixws_floats, y, fn->out, s);
    return dsv4_cuda_gemv(fn, X, ldx, B, y, fn->out, s);
}

/* xn = RMSNorm(y) with weight w; where `next`, the first linear to read xn on the main lane, allows,
 * the same launch prepares xn for it (*prepared: the linear then skips its own preparation). */
static int norm_xn(struct cuda_backend *cb, const float *w, const struct dsv4_cuda_linear *next, int B, cudaStream_t s,
                   bool *prepared)
{
    struct step_buf *t = &cb->b;
    const float eps = (float)cb->cfg->rms_norm_eps;
    const bool quant = lin_quant(cb, next, false);
    *prepared = cb->use_gemm && dsv4_cuda_gemm_norm_supports(next, quant);
    if (*prepared)
        return dsv4_cuda_gemm_norm(next, quant, t->y, NULL, w, B, eps, cb->ln[0].gemm, t->xn, s);
    return dsv4_cuda_rmsnorm(t->y, w, B, cb->cfg->dim, eps, t->xn, s);
}

/* mHC pre, then the sublayer's RMSNorm into xn (norm_xn, for `next`). */
static int sublayer_pre(struct cuda_backend *cb, const struct dsv4_cuda_linear *fn, const float *base,
                        const float *scale, const float *norm, const struct dsv4_cuda_linear *next, int B,
                        cudaStream_t s, bool *prepared)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    const int hc = c->hc_mult, D = c->dim, iters = c->hc_sinkhorn_iters > 0 ? c->hc_sinkhorn_iters : 1;
    if (fn_split_k(fn)) {           /* the split-K fn, its sums made inside mHC pre */
        /* y on the main lane; post and comb (the Sinkhorn, ~4 us of dependent steps at batch 1) on
         * the side lane from the fn's partials, joined in sublayer_post, the first to read them */
        STEP(dsv4_cuda_mhc_fn_pre(fn, t->X, B, t->mixws, t->mixws_floats, base, scale, hc, D, iters,
                                  (float)c->hc_eps, (float)c->rms_norm_eps, t->y, NULL, NULL, s));
        STEP(lane_wait(cb, &cb->ln[1], &cb->ln[0], cb->ev_fork));
        STEP(dsv4_cuda_mhc_comb(t->mixws, B, base, scale, hc, D, iters, (float)c->hc_eps, (float)c->rms_norm_eps,
                                t->post, t->comb, cb->ln[1].s));
    } else {
        STEP(hc_fn(cb, fn, t->X, B, t->mix, s));
        STEP(dsv4_cuda_mhc_pre(t->X, t->mix, base, scale, B, hc, D, iters, (float)c->hc_eps, (float)c->rms_norm_eps,
                               t->y, t->post, t->comb, s));
    }
    return norm_xn(cb, norm, next, B, s, prepared);
}

/* psub: the sublayer's output pending (NULL: in t->sub) */
static int sublayer_post(struct cuda_backend *cb, int B, const struct dsv4_cuda_pending *psub, cudaStream_t s)
{
    struct step_buf *t = &cb->b;
    STEP(lane_wait(cb, &cb->ln[0], &cb->ln[1], cb->ev_join));      /* post and comb (sublayer_pre) */
    STEP(dsv4_cuda_mhc_post(t->X, t->sub, psub, t->post, t->comb, B, cb->cfg->hc_mult, cb->cfg->dim, t->X2, s));
    float *tmp = t->X;
    t->X = t->X2;
    t->X2 = tmp;
    return 0;
}

/* Whether a step of B rows fetches ahead: up to the fetch's rows (DSV4_CUDA_FETCH_ROWS_MAX). */
static bool step_fetches(const struct cuda_backend *cb, int B)
{
    return cb->fetch && B <= cb->fetch->rows;
}

static bool fetching(const struct cuda_backend *cb, const struct step_layer *L, int B)
{
    return step_fetches(cb, B) && L->fetch;
}

/* The fetch lanes at layer l, from the attention's xn: the routers of l and of the next layers that
 * fetch (up to f->ahead from l) predict on xn, the plan keeps or assigns their slots, and the copy
 * lane fills them (kernels/expert_fetch.cu has the order that keeps slots still while read).
 * *launched: false when no layer in reach has host experts. */
static int fetch_ahead(struct cuda_backend *cb, int l, int B, bool *launched)
{
    const struct dsv4_cuda_fetch *f = cb->fetch;
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    struct dsv4_cuda_fetch_targets tg = {};
    *launched = false;
    for (int i = l; i < l + f->ahead && i < c->n_layers; i++) {
        const struct step_layer *T = &cb->L[i];
        if (!T->fetch)
            continue;
        struct dsv4_cuda_fetch_target *x = &tg.t[tg.n++];
        x->gate = T->gate.w;
        x->ldg = T->gate.row_stride;
        x->bias = T->hash ? NULL : T->gate_bias;
        x->tid2eid = T->hash ? T->tid2eid : NULL;
        x->table = T->ex.d_table;
        x->layer = i;
    }
    if (!tg.n)
        return 0;
    STEP(lane_wait(cb, &cb->fl, &cb->ln[0], cb->ev_fork));
    STEP(dsv4_cuda_fetch_predict(f, l, &tg, t->xn, B, c->dim, cb->fl.s));
    if (cb->fetch_lanes)    /* the last copy, stopped by the prediction: the plan rewrites its jobs */
        DSV4_CUDA_TRY(cudaStreamWaitEvent(cb->fl.s, cb->ev_copied, 0));
    STEP(dsv4_cuda_fetch_plan(f, l, &tg, t->in, B, c->n_experts_per_tok, cb->fl.s));
    STEP(lane_wait(cb, &cb->fc, &cb->fl, cb->ev_fetched));
    STEP(dsv4_cuda_fetch_copy(f, l, &tg, cb->fc.s));
    DSV4_CUDA_TRY(cudaEventRecord(cb->ev_copied, cb->fc.s));
    cb->fetch_lanes = true;
    *launched = true;
    return 0;
}

/* One layer's launches for B rows (t->in as they read it) up to its routed experts (cb->mid). */
static int layer_routed(struct cuda_backend *cb, const struct step_layer *L, int B, cudaStream_t s)
{
    bool pa, pf;    /* xn prepared for wq_a, for the gate */
    struct dsv4_cuda_pending psub;      /* the attention's output */
    const bool fetch = fetching(cb, L, B);
    bool planned = false;
    STEP(sublayer_pre(cb, &L->hc_attn_fn, L->hca_base, L->hca_scale, L->attn_norm, &L->wq_a, B, s, &pa));
    if (step_fetches(cb, B) && L->index < cb->cfg->n_layers)
        STEP(fetch_ahead(cb, L->index, B, &planned));
    STEP(attention(cb, L, B, pa, &psub));
    STEP(sublayer_post(cb, B, &psub, s));
    if (planned)
        DSV4_CUDA_TRY(cudaStreamWaitEvent(s, cb->ev_fetched, 0));
    STEP(sublayer_pre(cb, &L->hc_ffn_fn, L->hcf_base, L->hcf_scale, L->ffn_norm, &L->gate, B, s, &pf));
    return moe_route(cb, L, B, pf, fetch);
}

/* One layer's launches for B rows on one device. */
static int layer_launches(struct cuda_backend *cb, const struct step_layer *L, int B, cudaStream_t s)
{
    STEP(layer_routed(cb, L, B, s));
    STEP(moe_local(cb, B));
    return sublayer_post(cb, B, NULL, s);
}

/* A head on B rows of streams X [B, hc, D]: hc_head (fn, base, scale), the final norm (w), the logits
 * [B, V] into t->logits. The main model's and the MTP block's heads differ only in those weights. */
static int head_launches(struct cuda_backend *cb, const float *X, int B, const struct dsv4_cuda_linear *fn,
                         const float *base, const float *scale, const float *norm, cudaStream_t s)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    bool ph = false;
    if (fn_split_k(fn))             /* the split-K fn, its sums made inside hc_head */
        STEP(dsv4_cuda_mhc_fn_head(fn, X, B, t->mixws, t->mixws_floats, base, scale, c->hc_mult, c->dim,
                                   (float)c->hc_eps, (float)c->rms_norm_eps, t->y, s));
    else {
        STEP(hc_fn(cb, fn, X, B, t->hm, s));
        STEP(dsv4_cuda_hc_head(X, t->hm, base, scale, B, c->hc_mult, c->dim, (float)c->hc_eps,
                               (float)c->rms_norm_eps, t->y, s));
    }
    STEP(norm_xn(cb, norm, &cb->head, B, s, &ph));
    return lin_x(cb, &cb->head, t->xn, c->dim, B, t->logits, c->vocab_size, false, ph, &cb->ln[0]);
}

/* The MTP block on B rows whose streams are in t->H: min, the block's in columns (its tokens,
 * slots, positions). X [b, j] = h_proj(hnorm(H [b, j])) + e_proj(enorm(embed(token b))), then the
 * block's layer; its output streams are left in t->X. */
static int mtp_block(struct cuda_backend *cb, int B, int32_t *min, cudaStream_t s)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    const int D = c->dim, hc = c->hc_mult;
    const float eps = (float)c->rms_norm_eps;
    STEP(dsv4_cuda_embed(&cb->embed, min, B, 1, t->y, s));
    STEP(dsv4_cuda_rmsnorm(t->y, cb->mtp_enorm, B, D, eps, t->xn, s));
    STEP(lin(cb, &cb->mtp_e_proj, t->xn, D, B, t->eo, D, false, &cb->ln[0]));
    STEP(dsv4_cuda_rmsnorm(t->H, cb->mtp_hnorm, B * hc, D, eps, t->H, s));
    /* the hc streams of every row are B hc rows of D: h_proj in pieces of a step's rows at most */
    for (int r0 = 0; r0 < B * hc; r0 += cb->rows) {
        const int n = B * hc - r0 < cb->rows ? B * hc - r0 : cb->rows;
        STEP(lin(cb, &cb->mtp_h_proj, t->H + (int64_t)r0 * D, D, n, t->X + (int64_t)r0 * D, D, false, &cb->ln[0]));
    }
    STEP(dsv4_cuda_spec_add(t->X, t->eo, B, hc, D, s));
    int32_t *in0 = t->in;
    t->in = min;
    const int rc = layer_launches(cb, &cb->mtp_L, B, s);
    t->in = in0;
    return rc;
}

/* The slot rows' ring and the block's rows as the speculation kernels read them. */
static struct dsv4_cuda_spec_rows spec_rows(const struct cuda_backend *cb, const int32_t *min, const int32_t *main_in,
                                            int B)
{
    struct dsv4_cuda_spec_rows a = {};
    a.caches = cb->caches;
    a.slot_bytes = cb->slot_bytes;
    a.ring_off = cb->ring_off;
    a.hcD = (int64_t)cb->cfg->hc_mult * cb->cfg->dim;
    a.ring = cb->spec + 1;
    a.pad_slot = cb->slots - 1;
    a.mslot = min + B;
    a.mpos = min + 2 * B;
    a.step_slot = main_in ? main_in + B : NULL;
    a.step_pos = main_in ? main_in + 2 * B : NULL;
    return a;
}

/* After a step's head: the catch-up rows run the block (their streams from the step's previous row
 * or the ring, gathered before the ring takes this step's rows), then every row's streams enter the
 * ring. */
static int mtp_catch_up(struct cuda_backend *cb, int B, cudaStream_t s)
{
    struct step_buf *t = &cb->b;
    int32_t *min = t->in + STEP_IN_FIELDS * B;
    const struct dsv4_cuda_spec_rows a = spec_rows(cb, min, t->in, B);
    STEP(dsv4_cuda_spec_gather(&a, B, t->X, t->H, s));
    STEP(dsv4_cuda_spec_ring_save(&a, t->in + 4 * B, B, t->X, s));
    return mtp_block(cb, B, min, s);
}

/* One draft for B rows (t->in: the block's rows): the first from the ring's streams and the uploaded
 * tokens, a later one from the block's own output streams and the previous draft's picks; then the
 * block's head and the greedy pick into t->dtok. */
static int draft_launches(struct cuda_backend *cb, int B, bool later, cudaStream_t s)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    float *X0 = t->X, *X20 = t->X2;
    cb->ln[0].s = s;
    cb->ln[1].s = cb->branches ? cb->side : s;
    cb->ln[2].s = cb->branches ? cb->indexer : s;
    int rc;
    if (later) {
        rc = dsv4_cuda_spec_tokens(t->dtok, B, t->in, s);
        if (rc == 0 && cudaMemcpyAsync(t->H, t->X, sizeof(float) * (size_t)B * c->hc_mult * c->dim,
                                       cudaMemcpyDeviceToDevice, s) != cudaSuccess)
            rc = dsv4_error_set(-EIO, "cuda draft: copying the block's streams");
    } else {
        const struct dsv4_cuda_spec_rows a = spec_rows(cb, t->in, NULL, B);
        rc = dsv4_cuda_spec_gather(&a, B, t->X, t->H, s);
    }
    if (rc == 0)
        rc = mtp_block(cb, B, t->in, s);
    if (rc == 0)
        rc = head_launches(cb, t->X, B, &cb->mtp_hch_fn, cb->mtp_hch_base, cb->mtp_hch_scale, cb->mtp_norm, s);
    if (rc == 0)
        rc = dsv4_cuda_spec_argmax(t->logits, B, c->vocab_size, t->dtok, s);
    t->X = X0;
    t->X2 = X20;
    return rc;
}

/* Every launch of one step for B rows (a bucket, or a prefill chunk), reading t->in; the head
 * (hc_head, final norm, logits) for rows [head_from, B) only, their logits in rows 0.. of t->logits;
 * with speculation, the block's catch-up and the streams ring after it (mtp_catch_up). */
static int step_launches(struct cuda_backend *cb, int B, int head_from, cudaStream_t s)
{
    int rc = dsv4_step_begin(cb, B, s);
    for (int l = 0; rc == 0 && l < cb->cfg->n_layers; l++)
        rc = layer_launches(cb, &cb->L[l], B, s);
    if (rc == 0)
        return dsv4_step_end(cb, B, head_from);
    cb->b.X = cb->X0;
    cb->b.X2 = cb->X20;
    return rc;
}

/* The lanes of a step of B rows on stream s, the fetch's step counter and the embedding. */
int dsv4_step_begin(struct cuda_backend *cb, int B, cudaStream_t s)
{
    struct step_buf *t = &cb->b;
    cb->X0 = t->X;
    cb->X20 = t->X2;
    cb->ln[0].s = s;
    cb->ln[1].s = cb->branches ? cb->side : s;
    cb->ln[2].s = cb->branches ? cb->indexer : s;
    cb->fetch_lanes = false;
    if (step_fetches(cb, B))
        STEP(dsv4_cuda_fetch_step(cb->fetch, s));
    return dsv4_cuda_embed(&cb->embed, t->in, B, cb->cfg->hc_mult, t->X, s);
}

/* The fetch lanes joined, the head, the MTP catch-up; the stream buffers as the step found them. */
int dsv4_step_end(struct cuda_backend *cb, int B, int head_from)
{
    const struct dsv4_config *c = cb->cfg;
    struct step_buf *t = &cb->b;
    const cudaStream_t s = cb->ln[0].s;
    /* the last copy's targets are all resolved by now: it has left them, so this joins at once */
    int rc = cb->fetch_lanes ? lane_wait(cb, &cb->ln[0], &cb->fl, cb->ev_join) : 0;
    if (rc == 0 && cb->fetch_lanes)
        rc = lane_wait(cb, &cb->ln[0], &cb->fc, cb->ev_join);
    /* the head's rows: from head_from on (a prefill chunk's last row, or every row) */
    const int Bh = B - head_from;
    const float *Xh = t->X + (int64_t)head_from * c->hc_mult * c->dim;
    if (rc == 0)
        rc = head_launches(cb, Xh, Bh, &cb->hch_fn, cb->hch_base, cb->hch_scale, cb->norm, s);
    if (rc == 0 && cb->spec)
        rc = mtp_catch_up(cb, B, s);
    /* the stream buffers swap per sublayer; an even count of swaps leaves them in place, but restore
     * them so every bucket's launches (and graph) see the same assignment */
    t->X = cb->X0;
    t->X2 = cb->X20;
    return rc;
}

/* ---- a step's pieces under expert parallelism (kernels/ep_backend.cu interleaves the ranks') ---- */

int dsv4_step_routed(struct cuda_backend *cb, int layer, int B)
{
    STEP(layer_routed(cb, &cb->L[layer], B, cb->ln[0].s));
    DSV4_CUDA_TRY(cudaEventRecord(cb->ev_routed, cb->ln[0].s));
    return 0;
}

/* The gathered rows of every rank (b.gx, b.gidx: R B rows) through the experts this rank holds: each
 * of their pairs' expert outputs into b.moe.d_out [R B K, D] (rank g's rows' pairs from g B K on),
 * the pairs of experts held elsewhere left unwritten. */
int dsv4_step_ep_experts(struct cuda_backend *cb, int B)
{
    struct step_buf *t = &cb->b;
    const struct step_moe *m = &cb->mid;
    const cudaStream_t s = cb->ln[0].s;
    const int K = cb->cfg->n_experts_per_tok, Bg = cb->ep_ranks * B;
    STEP(dsv4_cuda_ep_mask(t->gidx, Bg * K, cb->e0, cb->e1, s));
    STEP(dsv4_cuda_moe_routed(&m->ex, t->gx, Bg, K, t->gidx, &t->moe, s));
    DSV4_CUDA_TRY(cudaEventRecord(cb->ev_parted, s));
    return 0;
}

/* This rank's rows' pair outputs from every rank (b.gret) selected by the rank holding each pair's
 * expert, then moe_combine over the rows' own routing (b.ridx, b.rw) and the shared expert's output,
 * into t->sub; mHC post. The combine sees what one device's moe_routed leaves, so any number of
 * ranks gives the unsplit sublayer's bits. */
int dsv4_step_ep_finish(struct cuda_backend *cb, int B)
{
    struct step_buf *t = &cb->b;
    const struct step_moe *m = &cb->mid;
    const cudaStream_t s = cb->ln[0].s;
    if (m->shared)
        STEP(lane_wait(cb, &cb->ln[0], &cb->ln[1], cb->ev_join));
    int e1[DSV4_EP_MAX_GPUS], e0;
    for (int r = 0; r < cb->ep_ranks; r++)
        STEP(dsv4_ep_shard(cb->cfg->n_experts, cb->ep_ranks, r, &e0, &e1[r]));
    const int K = cb->cfg->n_experts_per_tok;
    STEP(dsv4_cuda_ep_select(t->gret, t->ridx, cb->ep_ranks, e1, B * K, cb->cfg->dim, s));
    struct dsv4_cuda_moe_ws ws = t->moe;
    ws.d_out = t->gret;
    STEP(dsv4_cuda_moe_combine(&m->ex, B, K, t->ridx, t->rw, &ws, m->shared ? t->sout : NULL, &m->psout, t->sub, s));
    return sublayer_post(cb, B, NULL, s);
}

/* ---- backend ops ---- */

static struct cuda_backend *impl(const struct dsv4_backend *b)
{
    return static_cast<struct cuda_backend *>(b->impl);
}

int dsv4_step_bucket(const struct cuda_backend *cb, int n)
{
    for (int i = 0; i < cb->n_buckets; i++)
        if (cb->buckets[i] >= n)
            return i;
    return -1;
}

/* The MTP block's rows of a step of n rows (h_in's main columns filled, B the bucket): row i runs the
 * block's catch-up at pos - 1 when its slot's block stands there (the slot's mtp_pos, advanced row
 * by row through a run), else goes to the padding slot. row_mtp keeps each row's mtp_pos before it
 * (what accept goes back to). First and last are those of each row's run of consecutive rows of
 * one slot at consecutive positions (a prefill chunk's catch-up; a padding row is a run of its
 * own), as the main rows': a chunk's attention reads its run's own entries and stores the ring
 * from its last rows after. */
static void spec_catch_up_rows(struct cuda_backend *cb, int n, int B)
{
    const int32_t *tok = cb->h_in, *sl = tok + B, *pos = sl + B;
    int32_t *mt = cb->h_in + STEP_IN_FIELDS * B, *ms = mt + B, *mp = ms + B, *mf = mp + B, *ml = mf + B;
    int64_t cur = 0;
    for (int i = 0; i < B; i++) {
        const bool run = i > 0 && i < n && sl[i] == sl[i - 1];
        if (i < n && !run)
            cur = cb->mtp_pos[sl[i]];
        const bool up = i < n && pos[i] > 0 && cur == pos[i] - 1;
        if (i < n)
            cb->row_mtp[i] = cur;
        mt[i] = tok[i];
        ms[i] = up ? sl[i] : cb->slots - 1;
        mp[i] = up ? pos[i] - 1 : 0;
        if (up)
            cur = pos[i];
    }
    const int pad = cb->slots - 1;
    for (int i = 0; i < B; i++)
        mf[i] = i > 0 && ms[i] != pad && ms[i] == ms[i - 1] && mp[i] == mp[i - 1] + 1 ? mf[i - 1] : mp[i];
    for (int i = B - 1; i >= 0; i--)
        ml[i] = i + 1 < B && ms[i] != pad && ms[i + 1] == ms[i] && mp[i + 1] == mp[i] + 1 ? ml[i + 1] : mp[i];
}

/* Rows [0, n) are the caller's: row i appends tokens[i] to slots[i]. Rows of one slot (a prefill
 * chunk) are consecutive and take consecutive positions. Up to the largest bucket the bucket's graph
 * replays, rows [n, bucket) on the padding slot at position 0, every row's logits computed; a longer
 * chunk (only prefill makes one) launches its n rows eagerly, with logits for its last row only.
 * logits (NULL: none) gets every row's logits, or with last_only the last row's. */
static int run_rows(struct cuda_backend *cb, int n, const int *slots, const int32_t *tokens, float *logits,
                    bool last_only)
{
    const int bi = dsv4_step_bucket(cb, n), B = bi >= 0 ? cb->buckets[bi] : n;
    const bool eager = bi < 0;
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    if (eager && logits && !last_only)
        return dsv4_error_set(-EINVAL, "cuda: every row's logits of a %d-row chunk (the largest bucket is %d)", n,
                              cb->buckets[cb->n_buckets - 1]);
    STEP(dsv4_step_rows_stage(cb, n, slots, tokens, B));
    if (cb->use_graphs && !eager) {
        DSV4_CUDA_TRY(cudaGraphLaunch(cb->graphs[bi], s));
    } else {
        STEP(step_launches(cb, B, eager ? n - 1 : 0, s));
        cb->eager_steps += eager;
    }
    STEP(dsv4_step_rows_after(cb, n, B, eager, logits, last_only));
    DSV4_CUDA_TRY(cudaStreamSynchronize(s));
    dsv4_step_rows_done(cb, n, slots, B, eager);
    return 0;
}

int dsv4_step_rows_stage(struct cuda_backend *cb, int n, const int *slots, const int32_t *tokens, int B)
{
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    int32_t *tok = cb->h_in, *sl = tok + B, *pos = sl + B, *first = pos + B, *last = first + B;

    for (int i = 0; i < B; i++) {
        const bool run = i > 0 && i < n && slots[i] == slots[i - 1];
        tok[i] = i < n ? tokens[i] : 0;
        sl[i] = i < n ? slots[i] : cb->slots - 1;
        pos[i] = i >= n ? 0 : run ? pos[i - 1] + 1 : (int32_t)cb->pos[slots[i]];
        first[i] = run ? first[i - 1] : pos[i];
    }
    for (int i = B - 1; i >= 0; i--)
        last[i] = i + 1 < n && slots[i + 1] == slots[i] ? last[i + 1] : pos[i];
    const int fields = STEP_IN_FIELDS * (cb->spec ? 2 : 1);
    if (cb->spec)
        spec_catch_up_rows(cb, n, B);
    /* the buffer a bucket's launches read: t->in holds the STEP_IN_FIELDS arrays of B rows (twice
     * with speculation: the MTP block's rows after them) */
    DSV4_CUDA_TRY(cudaMemcpyAsync(cb->b.in, cb->h_in, sizeof(int32_t) * fields * B, cudaMemcpyHostToDevice, s));
    return 0;
}

int dsv4_step_rows_after(struct cuda_backend *cb, int n, int B, bool eager, float *logits, bool last_only)
{
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    const int last_row = eager ? 0 : n - 1;     /* the logits row of row n - 1 */
    /* every row's token is now in its slot's history (prompt tokens: seen; a decode row's token was
     * counted when it was sampled); padding rows name no history slot and are skipped */
    STEP(dsv4_sample_history_record(&cb->hist, cb->b.in + B, cb->b.in, n, false, s));
    if (logits)
        DSV4_CUDA_TRY(cudaMemcpyAsync(logits, cb->b.logits + (size_t)(last_only ? last_row : 0) * cb->cfg->vocab_size,
                                      sizeof(float) * (last_only ? 1 : n) * cb->cfg->vocab_size,
                                      cudaMemcpyDeviceToHost, s));
    return 0;
}

void dsv4_step_rows_done(struct cuda_backend *cb, int n, const int *slots, int B, bool eager)
{
    const int32_t *pos = cb->h_in + 2 * B;
    for (int i = 0; i < n; i++) {
        cb->pos[slots[i]] = pos[i] + 1;
        if (cb->spec && cb->h_in[STEP_IN_FIELDS * B + B + i] != cb->slots - 1)
            cb->mtp_pos[slots[i]] = pos[i];     /* the row's catch-up ran the block at pos - 1 */
    }
    cb->last_rows = n;
    cb->last_logit_row = eager ? 0 : n - 1;
    cb->last_sl = cb->h_in + B;
    cb->last_d_sl = cb->b.in + B;
    cb->last_prefill = false;
}

int dsv4_step_check_token(const struct cuda_backend *cb, const char *op, int32_t token)
{
    if (token < 0 || token >= cb->cfg->vocab_size)
        return dsv4_error_set(-EINVAL, "cuda %s: token %d outside the vocabulary of %d", op, token, cb->cfg->vocab_size);
    return 0;
}

static int check_rows(struct cuda_backend *cb, int n, const int *slots, const int32_t *tokens)
{
    const struct dsv4_backend_opts *o = &cb->base.opts;
    if (n < 1 || n > o->max_batch)
        return dsv4_error_set(-EINVAL, "cuda decode: %d rows, max_batch is %d", n, o->max_batch);
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= o->max_batch)
            return dsv4_error_set(-EINVAL, "cuda decode: slot %d outside 0..%d", slots[i], o->max_batch - 1);
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return dsv4_error_set(-EINVAL, "cuda decode: slot %d appears twice in one step", slots[i]);
        STEP(dsv4_step_check_token(cb, "decode", tokens[i]));
        if (cb->pos[slots[i]] >= o->max_context)
            return dsv4_error_set(-ENOSPC, "cuda decode: slot %d is full (%d tokens)", slots[i], o->max_context);
    }
    return 0;
}

static int op_decode(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, float *logits)
{
    struct cuda_backend *cb = impl(b);
    int rc = check_rows(cb, n, slots, tokens);
    if (rc == 0)    /* test-only: a real sticky fault when DSV4_TEST_CUDA_FAULT_AFTER_DECODES says so */
        rc = dsv4_cuda_test_fault(static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev)));
    return rc < 0 ? rc : run_rows(cb, n, slots, tokens, logits, false);
}

/* Chunks of up to cb->rows consecutive positions (max_batch when every row's logits are wanted:
 * the logits buffer holds a bucket's rows), each one step: every linear sees the chunk as a batch of
 * rows (tensor cores), attention and the compressors read the chunk's own earlier rows (see
 * run_rows). */
static int op_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits, bool all_rows)
{
    struct cuda_backend *cb = impl(b);
    const int V = cb->cfg->vocab_size, chunk = all_rows ? b->opts.max_batch : cb->rows;
    if (slot < 0 || slot >= b->opts.max_batch)
        return dsv4_error_set(-EINVAL, "cuda prefill: slot %d outside 0..%d", slot, b->opts.max_batch - 1);
    if (n < 0 || cb->pos[slot] + n > b->opts.max_context)
        return dsv4_error_set(-ENOSPC, "cuda prefill: %d tokens do not fit slot %d (%lld of %d used)", n, slot,
                              (long long)cb->pos[slot], b->opts.max_context);
    for (int i = 0; i < n; i++)
        STEP(dsv4_step_check_token(cb, "prefill", tokens[i]));
    for (int i = 0; i < chunk; i++)
        cb->h_slots[i] = slot;
    for (int i0 = 0; i0 < n; i0 += chunk) {
        const int m = n - i0 < chunk ? n - i0 : chunk;
        const bool tail = i0 + m == n;
        float *dst = !logits ? NULL : all_rows ? logits + (size_t)i0 * V : tail ? logits : NULL;
        STEP(run_rows(cb, m, cb->h_slots, tokens + i0, dst, !all_rows));
    }
    cb->last_prefill = n > 0;
    return 0;
}

/* Sample the rows of the last call on the device (engine/backend.h): one launch over the rows'
 * logits in the step buffer, the sampled tokens counted into their slots' histories, and only the
 * small per-row results copied back. */
static int op_sample(struct dsv4_backend *b, int n, const struct dsv4_backend_sample_req *req, struct dsv4_sample *out,
                     int *rc, char *msgs)
{
    struct cuda_backend *cb = impl(b);
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    const int V = cb->cfg->vocab_size;
    const float *rows = cb->b.logits;
    const int32_t *d_slots = cb->last_d_sl;     /* the sampled rows' slot column */

    if (cb->hist_broken)
        return dsv4_error_set(-EIO, "cuda sample: clearing a slot's penalty history failed earlier");
    if (cb->last_prefill) {
        /* the prefill's last row: every row of its last chunk names its slot */
        if (n != 1 || req[0].slot != cb->last_sl[0])
            return dsv4_error_set(-EINVAL, "cuda sample: after a prefill of slot %d, sample that one slot "
                                  "(asked %d rows, slot %d)", cb->last_sl[0], n, n > 0 ? req[0].slot : -1);
        rows += (size_t)cb->last_logit_row * V;
        d_slots += cb->last_rows - 1;
    } else if (n < 1 || n != cb->last_rows) {
        return dsv4_error_set(-EINVAL, "cuda sample: %d rows asked after a decode of %d", n, cb->last_rows);
    }
    for (int i = 0; i < n; i++) {
        if (!cb->last_prefill && req[i].slot != cb->last_sl[i])
            return dsv4_error_set(-EINVAL, "cuda sample: row %d names slot %d, the decode's row %d was slot %d", i,
                                  req[i].slot, i, cb->last_sl[i]);
        dsv4_sample_row_set(&cb->h_sparams[i], req[i].params, req[i].seed, req[i].index, req[i].slot);
    }
    DSV4_CUDA_TRY(cudaMemcpyAsync(cb->b.sparams, cb->h_sparams, sizeof(*cb->h_sparams) * n, cudaMemcpyHostToDevice, s));
    STEP(dsv4_sample_rows(rows, V, n, V, cb->b.sparams, &cb->hist, cb->b.sres, cb->b.stokens, s));
    STEP(dsv4_sample_history_record(&cb->hist, d_slots, cb->b.stokens, n, true, s));
    DSV4_CUDA_TRY(cudaMemcpyAsync(cb->h_sres, cb->b.sres, sizeof(*cb->h_sres) * n, cudaMemcpyDeviceToHost, s));
    DSV4_CUDA_TRY(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i++) {
        rc[i] = dsv4_sample_result_get(&cb->h_sres[i], &out[i]);
        if (rc[i] < 0)
            snprintf(msgs + (size_t)i * DSV4_BACKEND_MSG_MAX, DSV4_BACKEND_MSG_MAX, "%s", dsv4_error_message());
    }
    cb->last_prefill = false;
    cb->last_rows = 0;      /* a row is sampled once */
    return 0;
}

static void op_slot_reset(struct dsv4_backend *b, int slot)
{
    struct cuda_backend *cb = impl(b);
    if (slot < 0 || slot >= b->opts.max_batch)
        return;
    cb->pos[slot] = 0;
    if (cb->spec) {
        cb->mtp_pos[slot] = 0;
        cb->v_pos[slot] = -1;
    }
    /* the penalty history starts empty; the copy reads h_sslots before it returns (pageable memory) */
    cb->h_sslots[0] = slot;
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    if (cudaMemcpyAsync(cb->b.sslots, cb->h_sslots, sizeof(int32_t), cudaMemcpyHostToDevice, s) != cudaSuccess ||
        dsv4_sample_history_clear(&cb->hist, cb->b.sslots, 1, s) < 0)
        cb->hist_broken = true;     /* reported by the next sample call */
}

static int64_t op_slot_position(const struct dsv4_backend *b, int slot)
{
    return slot >= 0 && slot < b->opts.max_batch ? impl(b)->pos[slot] : -1;
}

static void op_get_stats(const struct dsv4_backend *b, struct dsv4_backend_stats *ret)
{
    struct cuda_backend *cb = impl(b);
    struct dsv4_cuda_dev_stats st;
    dsv4_cuda_dev_get_stats(cb->dev, &st);
    memset(ret, 0, sizeof(*ret));
    ret->device_allocs = st.device_allocs;
    ret->graph_captures = cb->captures;
    ret->bytes_reserved = st.cache_bytes + st.workspace_bytes + st.prefix_bytes;
    dsv4_cuda_dev_expert_stats(cb->dev, ret);
    ret->expert_fetch = cb->fetch != NULL;
    if (cb->fetch && dsv4_cuda_dev_fetch_counts(cb->dev, &ret->expert_fetch_copied, &ret->expert_fetch_used) < 0)
        ret->expert_fetch_copied = ret->expert_fetch_used = 0;
    snprintf(ret->variant, sizeof(ret->variant),
             "cuda %.24s, %.32s, %s numerics, KV %s, %d graphs, %d streams, sampling on %s, prefill chunk %d%s",
             st.kernel_build, st.device_name, cb->fp8 ? "fp8" : "exact",
             cb->kvf == DSV4_KV_FP8 ? "fp8 e4m3+bf16 (584 B at 512/64)" : "f32",
             cb->use_graphs ? cb->n_buckets * (cb->spec ? 3 : 1) : 0, cb->branches ? 2 : 1,
             b->ops->sample ? "device" : "host", cb->rows, cb->spec ? ", MTP drafts" : "");
    ret->eager_steps = cb->eager_steps;
}

static int op_routing_counts(struct dsv4_backend *b, uint64_t *counts)
{
    return dsv4_cuda_dev_read_route_counts(impl(b)->dev, counts);
}

static void op_destroy(struct dsv4_backend *b)
{
    struct cuda_backend *cb = impl(b);
    for (int i = 0; i < cb->n_buckets; i++) {
        if (cb->graphs[i])
            cudaGraphExecDestroy(cb->graphs[i]);
        for (int later = 0; later < 2; later++)
            if (cb->dgraphs[later][i])
                cudaGraphExecDestroy(cb->dgraphs[later][i]);
    }
    if (cb->ev_routed)
        cudaEventDestroy(cb->ev_routed);
    if (cb->ev_parted)
        cudaEventDestroy(cb->ev_parted);
    if (cb->ev_fork)
        cudaEventDestroy(cb->ev_fork);
    if (cb->ev_join)
        cudaEventDestroy(cb->ev_join);
    if (cb->side)
        cudaStreamDestroy(cb->side);
    if (cb->indexer)
        cudaStreamDestroy(cb->indexer);
    if (cb->fl.s)
        cudaStreamDestroy(cb->fl.s);
    if (cb->fc.s)
        cudaStreamDestroy(cb->fc.s);
    if (cb->ev_fetched)
        cudaEventDestroy(cb->ev_fetched);
    if (cb->ev_copied)
        cudaEventDestroy(cb->ev_copied);
    dsv4_cuda_prefix_free(cb->prefix);
    dsv4_cuda_dev_destroy(cb->dev);
    free(cb->L);
    free(cb->pos);
    free(cb->h_in);
    free(cb->h_slots);
    free(cb->h_sparams);
    free(cb->h_sres);
    free(cb->h_sslots);
    free(cb->mtp_pos);
    free(cb->row_mtp);
    free(cb->v_pos);
    free(cb->v_rows);
    free(cb->v_mtp);
    free(cb->h_draft);
    free(cb);
}

static int op_prefix_save(struct dsv4_backend *b, int slot, int block, const int32_t *block_pages,
                          const int32_t *boundary_pages)
{
    return dsv4_cuda_prefix_save(impl(b)->prefix, slot, block, block_pages, boundary_pages);
}

/* The MTP block's state is not part of a snapshot: it resumes at the load point (engine/backend.h),
 * its window there holding what the slot's previous sequence left (drafts may suffer, never output). */
static int op_prefix_load(struct dsv4_backend *b, int slot, int n_blocks, const int32_t *block_pages,
                          const int32_t *boundary_pages, const int32_t *tokens)
{
    struct cuda_backend *cb = impl(b);
    const int rc = dsv4_cuda_prefix_load(cb->prefix, slot, n_blocks, block_pages, boundary_pages, tokens);
    if (rc == 0 && cb->spec)
        cb->mtp_pos[slot] = cb->pos[slot];
    return rc;
}

/* ---- speculative decoding (engine/backend.h's draft, verify, accept) ---- */

static int spec_check_slots(const struct cuda_backend *cb, const char *op, int n, const int *slots)
{
    const int max = cb->base.opts.max_batch;
    if (n < 1 || n > max)
        return dsv4_error_set(-EINVAL, "cuda %s: %d slots, max_batch is %d", op, n, max);
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= max)
            return dsv4_error_set(-EINVAL, "cuda %s: slot %d outside 0..%d", op, slots[i], max - 1);
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return dsv4_error_set(-EINVAL, "cuda %s: slot %d appears twice", op, slots[i]);
        if (cb->v_pos[slots[i]] >= 0)
            return dsv4_error_set(-EBUSY, "cuda %s: slot %d has a verify awaiting accept", op, slots[i]);
    }
    return 0;
}

/* Draft j of every drafting slot in one replay (rows in the slots' order, the others on the padding
 * slot); the first kept as the catch-up at P - 1, the later ones' window rows left to be overwritten. */
static int op_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                    int32_t *drafts, int *ret_k)
{
    struct cuda_backend *cb = impl(b);
    const int S = cb->spec, max_ctx = b->opts.max_context;
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    STEP(spec_check_slots(cb, "draft", n, slots));
    int kmax = 0;
    for (int i = 0; i < n; i++) {
        const int64_t P = cb->pos[slots[i]];
        if (k[i] < 0 || k[i] > S)
            return dsv4_error_set(-EINVAL, "cuda draft: %d drafts outside 0..%d", k[i], S);
        STEP(dsv4_step_check_token(cb, "draft", tokens[i]));
        ret_k[i] = k[i] > 0 && P > 0 && cb->mtp_pos[slots[i]] == P - 1 && P - 1 + k[i] <= max_ctx ? k[i] : 0;
        kmax = ret_k[i] > kmax ? ret_k[i] : kmax;
    }
    if (kmax == 0)
        return 0;
    const int bi = dsv4_step_bucket(cb, n), B = cb->buckets[bi];
    for (int j = 0; j < kmax; j++) {
        int32_t *tok = cb->h_in, *sl = tok + B, *pos = sl + B, *first = pos + B, *last = first + B;
        for (int i = 0; i < B; i++) {
            const bool on = i < n && ret_k[i] > j;
            tok[i] = on && j == 0 ? tokens[i] : 0;
            sl[i] = on ? slots[i] : cb->slots - 1;
            pos[i] = on ? (int32_t)(cb->pos[slots[i]] - 1 + j) : 0;
            first[i] = last[i] = pos[i];
        }
        DSV4_CUDA_TRY(cudaMemcpyAsync(cb->b.in, cb->h_in, sizeof(int32_t) * STEP_IN_FIELDS * B, cudaMemcpyHostToDevice,
                                      s));
        if (cb->use_graphs)
            DSV4_CUDA_TRY(cudaGraphLaunch(cb->dgraphs[j > 0][bi], s));
        else
            STEP(draft_launches(cb, B, j > 0, s));
        DSV4_CUDA_TRY(cudaMemcpyAsync(cb->h_draft + (size_t)j * B, cb->b.dtok, sizeof(int32_t) * B,
                                      cudaMemcpyDeviceToHost, s));
    }
    DSV4_CUDA_TRY(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < ret_k[i]; j++)
            drafts[(size_t)i * S + j] = cb->h_draft[(size_t)j * B + i];
        if (ret_k[i] > 0)
            cb->mtp_pos[slots[i]] = cb->pos[slots[i]];
    }
    cb->last_rows = 0;      /* nothing to sample: a draft's logits are not the main model's */
    return 0;
}

/* Every slot's rows in one step while they fit the largest bucket (else in several), every row's
 * logits to logits [n, S + 1, V]; first each slot's compressor rows that the rows will overwrite are
 * saved, for accept. */
static int op_verify(struct dsv4_backend *b, int n, const int *slots, const int *rows, const int32_t *tokens,
                     float *logits)
{
    struct cuda_backend *cb = impl(b);
    const int S = cb->spec, V = cb->cfg->vocab_size, max_rows = cb->buckets[cb->n_buckets - 1];
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    STEP(spec_check_slots(cb, "verify", n, slots));
    for (int i = 0; i < n; i++) {
        if (rows[i] < 1 || rows[i] > S + 1)
            return dsv4_error_set(-EINVAL, "cuda verify: slot %d: %d rows outside 1..%d", slots[i], rows[i], S + 1);
        if (cb->pos[slots[i]] + rows[i] > b->opts.max_context)
            return dsv4_error_set(-ENOSPC, "cuda verify: slot %d: %d rows do not fit (%lld of %d used)", slots[i],
                                  rows[i], (long long)cb->pos[slots[i]], b->opts.max_context);
        for (int j = 0; j < rows[i]; j++)
            STEP(dsv4_step_check_token(cb, "verify", tokens[(size_t)i * (S + 1) + j]));
    }
    for (int i = 0; i < n; i++)
        STEP(dsv4_cuda_spec_comp_copy(cb->d_comp, cb->n_comp, cb->caches + (int64_t)slots[i] * cb->slot_bytes,
                                      cb->pos[slots[i]], 0, rows[i], true, s));
    int32_t *vtok = cb->h_draft;    /* the step's token column: S * max_batch >= a bucket's rows */
    for (int i0 = 0; i0 < n;) {
        int m = 0, i1 = i0;
        while (i1 < n && m + rows[i1] <= max_rows) {
            for (int j = 0; j < rows[i1]; j++) {
                cb->h_slots[m + j] = slots[i1];
                vtok[m + j] = tokens[(size_t)i1 * (S + 1) + j];
            }
            m += rows[i1++];
        }
        for (int i = i0; i < i1; i++)
            cb->v_pos[slots[i]] = cb->pos[slots[i]];
        STEP(run_rows(cb, m, cb->h_slots, vtok, NULL, false));
        for (int i = i0, r = 0; i < i1; r += rows[i++]) {
            const int sl = slots[i];
            cb->v_rows[sl] = rows[i];
            for (int j = 0; j < rows[i]; j++)
                cb->v_mtp[(size_t)sl * (S + 1) + j] = cb->row_mtp[r + j];
            if (logits)
                DSV4_CUDA_TRY(cudaMemcpyAsync(logits + (size_t)i * (S + 1) * V, cb->b.logits + (size_t)r * V,
                                              sizeof(float) * (size_t)rows[i] * V, cudaMemcpyDeviceToHost, s));
        }
        DSV4_CUDA_TRY(cudaStreamSynchronize(s));
        i0 = i1;
    }
    cb->last_rows = 0;
    return 0;
}

/* Keep the first keep rows of slot's verify: the compressor rows of the others back from the save
 * area, the positions (main and the block's) back to what feeding only the kept rows leaves. */
static int op_accept(struct dsv4_backend *b, int slot, int keep)
{
    struct cuda_backend *cb = impl(b);
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    if (slot < 0 || slot >= b->opts.max_batch || cb->v_pos[slot] < 0)
        return dsv4_error_set(-EINVAL, "cuda accept: slot %d has no verify to accept", slot);
    const int rows = cb->v_rows[slot];
    if (keep < 1 || keep > rows)
        return dsv4_error_set(-EINVAL, "cuda accept: keep %d of a verify of %d rows (at least its first)", keep, rows);
    const int64_t P = cb->v_pos[slot];
    if (keep < rows) {
        STEP(dsv4_cuda_spec_comp_copy(cb->d_comp, cb->n_comp, cb->caches + (int64_t)slot * cb->slot_bytes, P, keep,
                                      rows, false, s));
        DSV4_CUDA_TRY(cudaStreamSynchronize(s));
        cb->mtp_pos[slot] = cb->v_mtp[(size_t)slot * (cb->spec + 1) + keep];
    }
    cb->pos[slot] = P + keep;
    cb->v_pos[slot] = -1;
    return 0;
}

static const struct dsv4_backend_ops cuda_ops = {
    .name = "cuda", .prefill = op_prefill, .decode = op_decode, .sample = op_sample, .slot_reset = op_slot_reset,
    .slot_position = op_slot_position, .get_stats = op_get_stats, .destroy = op_destroy,
    .prefix_save = op_prefix_save, .prefix_load = op_prefix_load, .routing_counts = op_routing_counts,
    .draft = nullptr, .verify = nullptr, .accept = nullptr,     /* set by create when it speculates */
};

/* ---- create ---- */

static int dev_lin(struct cuda_backend *cb, const struct dsv4_linear *h, struct dsv4_cuda_linear *ret, bool required)
{
    const struct dsv4_cuda_linear *d = dsv4_cuda_dev_linear_for(cb->dev, h);
    if (!d) {
        memset(ret, 0, sizeof(*ret));
        return required ? dsv4_error_set(-ENOENT, "cuda: linear %s is not on the device", h->name ? h->name : "?") : 0;
    }
    *ret = *d;
    return 0;
}

static const float *dev_vec(struct cuda_backend *cb, const void *h)
{
    return static_cast<const float *>(h ? dsv4_cuda_dev_vector(cb->dev, h) : NULL);
}

static int map_layer(struct cuda_backend *cb, int i, const struct dsv4_layer *h, struct step_layer *L)
{
    const struct dsv4_config *c = cb->cfg;
    const struct dsv4_attn *a = &h->attn;
    const struct dsv4_ffn *f = &h->ffn;
    L->ratio = h->ratio;
    L->index = i;
    L->csa = h->ratio > 0 && h->ratio == c->csa_ratio;
    L->hash = f->type == DSV4_MLP_HASH;
    STEP(dev_lin(cb, &h->hc_attn.fn, &L->hc_attn_fn, true));
    STEP(dev_lin(cb, &h->hc_ffn.fn, &L->hc_ffn_fn, true));
    STEP(dev_lin(cb, &a->wq_a, &L->wq_a, true));
    STEP(dev_lin(cb, &a->wq_b, &L->wq_b, true));
    STEP(dev_lin(cb, &a->wkv, &L->wkv, true));
    STEP(dev_lin(cb, &a->wo_a, &L->wo_a, true));
    STEP(dev_lin(cb, &a->wo_b, &L->wo_b, true));
    STEP(dev_lin(cb, &f->gate, &L->gate, true));
    STEP(dev_lin(cb, &f->sw1, &L->sw1, false));
    STEP(dev_lin(cb, &f->sw3, &L->sw3, L->sw1.w != NULL));
    STEP(dev_lin(cb, &f->sw2, &L->sw2, L->sw1.w != NULL));
    if (h->ratio > 0) {
        STEP(dev_lin(cb, &a->comp.wkv, &L->c_wkv, true));
        STEP(dev_lin(cb, &a->comp.wgate, &L->c_wgate, true));
        L->c_ape = dev_vec(cb, a->comp.ape);
        L->c_norm = dev_vec(cb, a->comp.norm);
    }
    if (L->csa) {
        STEP(dev_lin(cb, &a->indexer.wq_b, &L->i_wq_b, true));
        STEP(dev_lin(cb, &a->indexer.weights_proj, &L->i_wproj, true));
        STEP(dev_lin(cb, &a->indexer.comp.wkv, &L->ic_wkv, true));
        STEP(dev_lin(cb, &a->indexer.comp.wgate, &L->ic_wgate, true));
        L->ic_ape = dev_vec(cb, a->indexer.comp.ape);
        L->ic_norm = dev_vec(cb, a->indexer.comp.norm);
    }
    L->attn_norm = dev_vec(cb, h->attn_norm);
    L->ffn_norm = dev_vec(cb, h->ffn_norm);
    L->hca_base = dev_vec(cb, h->hc_attn.base);
    L->hca_scale = dev_vec(cb, h->hc_attn.scale);
    L->hcf_base = dev_vec(cb, h->hc_ffn.base);
    L->hcf_scale = dev_vec(cb, h->hc_ffn.scale);
    L->q_norm = dev_vec(cb, a->q_norm);
    L->kv_norm = dev_vec(cb, a->kv_norm);
    L->sink = dev_vec(cb, a->sink);
    L->gate_bias = dev_vec(cb, f->gate_bias);
    L->tid2eid = static_cast<const int32_t *>(f->tid2eid ? dsv4_cuda_dev_vector(cb->dev, f->tid2eid) : NULL);
    if (!L->attn_norm || !L->ffn_norm || !L->hca_base || !L->hcf_base || !L->q_norm || !L->kv_norm || !L->sink ||
        (L->hash && !L->tid2eid) || (h->ratio > 0 && (!L->c_ape || !L->c_norm)) ||
        (L->csa && (!L->ic_ape || !L->ic_norm)))
        return dsv4_error_set(-ENOENT, "cuda: layer %d: a norm, bias, sink or table is missing on the device", i);
    L->route_counts = dsv4_cuda_dev_route_counts(cb->dev, i);
    return dsv4_cuda_dev_experts(cb->dev, i, &L->ex);
}

/* The boot's warm-up input: B rows in `blocks` STEP_IN_FIELDS blocks of t->in (2 with speculation: the
 * MTP block's rows after the main ones), every row on the padding slot at position 0. */
static int upload_padding_rows(struct cuda_backend *cb, int B, int blocks, cudaStream_t s)
{
    memset(cb->h_in, 0, sizeof(int32_t) * STEP_IN_FIELDS * blocks * B);
    for (int k = 0; k < blocks; k++)
        for (int i = 0; i < B; i++)
            cb->h_in[STEP_IN_FIELDS * k * B + B + i] = cb->slots - 1;
    DSV4_CUDA_TRY(cudaMemcpyAsync(cb->b.in, cb->h_in, sizeof(int32_t) * STEP_IN_FIELDS * blocks * B,
                                  cudaMemcpyHostToDevice, s));
    return 0;
}

/* One bucket's graph, instantiated into *ret: B rows of a step (draft < 0) or of a draft (0: the first,
 * from the ring; 1: a later one). */
static int capture_graph(struct cuda_backend *cb, int B, int draft, cudaGraphExec_t *ret)
{
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    const char *what = draft < 0 ? "step" : "draft";
    cudaGraph_t g;
    DSV4_CUDA_TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    const int rc = draft < 0 ? step_launches(cb, B, 0, s) : draft_launches(cb, B, draft > 0, s);
    cudaError_t e = cudaStreamEndCapture(s, &g);
    if (rc < 0)
        return rc;
    if (e != cudaSuccess)
        return dsv4_error_set(-EIO, "cuda: capturing the bucket-%d %s: %s", B, what, cudaGetErrorString(e));
    e = cudaGraphInstantiate(ret, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return dsv4_error_set(-EIO, "cuda: instantiating the bucket-%d %s: %s", B, what, cudaGetErrorString(e));
    cb->captures++;
    return 0;
}

static int capture(struct cuda_backend *cb)
{
    for (int i = 0; i < cb->n_buckets; i++) {
        STEP(capture_graph(cb, cb->buckets[i], -1, &cb->graphs[i]));
        for (int later = 0; cb->spec && later < 2; later++)
            STEP(capture_graph(cb, cb->buckets[i], later, &cb->dgraphs[later][i]));
    }
    return 0;
}

/* Device sampling state (carved with the step buffers): the penalty history of every slot,
 * cleared; per-row parameters, results and token/slot columns. */
static int sampling_boot(struct cuda_backend *cb)
{
    const int B = cb->base.opts.max_batch, V = cb->cfg->vocab_size;
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    STEP(dsv4_sample_prepare());
    STEP(dsv4_sample_history_init(&cb->hist, cb->b.shist, B, V));
    for (int i = 0; i < B; i++)
        cb->h_sslots[i] = i;
    DSV4_CUDA_TRY(cudaMemcpyAsync(cb->b.sslots, cb->h_sslots, sizeof(int32_t) * B, cudaMemcpyHostToDevice, s));
    STEP(dsv4_sample_history_clear(&cb->hist, cb->b.sslots, B, s));
    DSV4_CUDA_TRY(cudaStreamSynchronize(s));
    return 0;
}

static void log_stderr(void *ctx, const char *line)
{
    fprintf(stderr, "%s\n", line);
}

static int create(struct cuda_backend *cb, const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                  const struct dsv4_cuda_switches *sw)
{
    const struct dsv4_config *c = &w->cfg;
    float inv[2][DSV4_CUDA_MAX_HEAD_DIM / 2];
    void *p;

    if (c->rope_dim < 2 || c->rope_dim % 2 || c->rope_dim > c->head_dim || c->head_dim > DSV4_CUDA_MAX_HEAD_DIM)
        return dsv4_error_set(-EINVAL, "cuda: head_dim %d (max %d) with rope dims %d", c->head_dim,
                              DSV4_CUDA_MAX_HEAD_DIM, c->rope_dim);
    cb->cfg = c;
    /* speculation needs the block's weights too, a sliding-window layer (device.cu uploads them then) */
    cb->spec = w->n_mtp > 0 && w->mtp[0].layer.ratio == 0 ? spec_tokens_for(c, opts) : 0;
    cb->fp8 = opts->numerics == DSV4_NUMERICS_FP8;
    cb->kvf = kv_format(opts);
    cb->slots = opts->max_batch + 1;
    cb->rows = dsv4_cuda_step_rows(opts);
    cb->use_graphs = sw->graphs;
    cb->use_gemm = sw->gemm;
    cb->branches = sw->branches;
    STEP(dsv4_cuda_attention_prepare(c->head_dim));
    STEP(dsv4_cuda_gemm_prepare());
    STEP(dsv4_cuda_moe_prepare());
    /* the first listed GPU (gpus =), else device 0: one device until the experts are split */
    STEP(dsv4_cuda_dev_create(opts->n_gpus > 0 ? opts->gpus[0] : 0, w, opts, sw->log ? log_stderr : NULL, NULL,
                              &cb->dev));
    cb->L = static_cast<struct step_layer *>(calloc(c->n_layers, sizeof(*cb->L)));
    cb->pos = static_cast<int64_t *>(calloc(cb->slots, sizeof(*cb->pos)));
    cb->h_in = static_cast<int32_t *>(calloc(STEP_IN_FIELDS * 2 * (size_t)cb->rows, sizeof(*cb->h_in)));
    cb->h_slots = static_cast<int *>(calloc((size_t)cb->rows, sizeof(*cb->h_slots)));
    cb->h_sparams = static_cast<struct dsv4_sample_row *>(calloc((size_t)opts->max_batch, sizeof(*cb->h_sparams)));
    cb->h_sres = static_cast<struct dsv4_sample_result *>(calloc((size_t)opts->max_batch, sizeof(*cb->h_sres)));
    cb->h_sslots = static_cast<int32_t *>(calloc((size_t)opts->max_batch, sizeof(*cb->h_sslots)));
    if (!cb->L || !cb->pos || !cb->h_in || !cb->h_slots || !cb->h_sparams || !cb->h_sres || !cb->h_sslots)
        return dsv4_error_set(-ENOMEM, "cuda: backend tables");
    if (cb->spec) {
        const int S = cb->spec;
        cb->mtp_pos = static_cast<int64_t *>(calloc(cb->slots, sizeof(*cb->mtp_pos)));
        cb->row_mtp = static_cast<int64_t *>(calloc((size_t)cb->rows, sizeof(*cb->row_mtp)));
        cb->v_pos = static_cast<int64_t *>(malloc(sizeof(*cb->v_pos) * cb->slots));
        cb->v_rows = static_cast<int *>(calloc(cb->slots, sizeof(*cb->v_rows)));
        cb->v_mtp = static_cast<int64_t *>(calloc((size_t)cb->slots * (S + 1), sizeof(*cb->v_mtp)));
        cb->h_draft = static_cast<int32_t *>(calloc((size_t)S * opts->max_batch, sizeof(*cb->h_draft)));
        if (!cb->mtp_pos || !cb->row_mtp || !cb->v_pos || !cb->v_rows || !cb->v_mtp || !cb->h_draft)
            return dsv4_error_set(-ENOMEM, "cuda: speculation tables");
        for (int i = 0; i < cb->slots; i++)
            cb->v_pos[i] = -1;
    }
    struct dsv4_cuda_layer_cache *lc = static_cast<struct dsv4_cuda_layer_cache *>(calloc(c->n_layers, sizeof(*lc)));
    struct dsv4_cuda_spec_comp *comp =
        static_cast<struct dsv4_cuda_spec_comp *>(calloc(2 * (size_t)c->n_layers + 1, sizeof(*comp)));
    if (!lc || !comp) {
        free(lc);
        free(comp);
        return dsv4_error_set(-ENOMEM, "cuda: cache layout");
    }
    int64_t mtp_win = 0;
    cb->slot_bytes = slot_layout(c, opts, lc, &mtp_win, &cb->ring_off, comp, &cb->n_comp);
    for (int i = 0; i < c->n_layers; i++)
        cb->L[i].cache = lc[i];
    cb->mtp_L.cache.win = mtp_win;
    free(lc);
    const int carved = dsv4_cuda_dev_carve(cb->dev, (size_t)buffers(c, opts, NULL, NULL), &p);
    if (carved < 0) {
        free(comp);
        return carved;
    }
    buffers(c, opts, static_cast<uint8_t *>(p), &cb->b);
    cb->d_comp = cb->b.comp;
    if (cb->spec && cb->n_comp > 0 &&
        cudaMemcpy(cb->d_comp, comp, sizeof(*comp) * (size_t)cb->n_comp, cudaMemcpyHostToDevice) != cudaSuccess) {
        free(comp);
        return dsv4_error_set(-EIO, "cuda: uploading the compressors' save table");
    }
    free(comp);
    cb->caches = static_cast<uint8_t *>(dsv4_cuda_dev_caches(cb->dev));
    cb->max_entries = max_csa_entries(c, opts);
    cb->ln[0].gemm = &cb->b.gemm;
    cb->ln[0].xq = cb->b.xq;
    cb->ln[1].gemm = &cb->b.gemm2;
    cb->ln[1].xq = cb->b.xq2;
    cb->ln[2].gemm = &cb->b.gemm3;
    cb->ln[2].xq = cb->b.xq3;
    if (cb->branches) {
        DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&cb->side, cudaStreamNonBlocking));
        DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&cb->indexer, cudaStreamNonBlocking));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&cb->ev_fork, cudaEventDisableTiming));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&cb->ev_join, cudaEventDisableTiming));
    }
    STEP(sampling_boot(cb));
    STEP(dsv4_cuda_prefix_create(cb->dev, c, opts, cb->caches, cb->slot_bytes, cb->pos, &cb->hist, &cb->base.prefix,
                                 &cb->prefix));
    inv_freq(&c->rope_main, c->rope_dim, inv[0]);
    inv_freq(&c->rope_compress, c->rope_dim, inv[1]);
    DSV4_CUDA_TRY(cudaMemcpy(cb->b.inv_main, inv[0], sizeof(float) * c->rope_dim / 2, cudaMemcpyHostToDevice));
    DSV4_CUDA_TRY(cudaMemcpy(cb->b.inv_comp, inv[1], sizeof(float) * c->rope_dim / 2, cudaMemcpyHostToDevice));

    STEP(dev_lin(cb, &w->embed, &cb->embed, true));
    STEP(dev_lin(cb, &w->head, &cb->head, true));
    STEP(dev_lin(cb, &w->hc_head.fn, &cb->hch_fn, true));
    cb->norm = dev_vec(cb, w->norm);
    cb->hch_base = dev_vec(cb, w->hc_head.base);
    cb->hch_scale = dev_vec(cb, w->hc_head.scale);
    if (!cb->norm || !cb->hch_base || !cb->hch_scale)
        return dsv4_error_set(-ENOENT, "cuda: the final norm or hc_head vectors are missing on the device");
    for (int i = 0; i < c->n_layers; i++)
        STEP(map_layer(cb, i, &w->layers[i], &cb->L[i]));
    cb->fetch = cb->branches ? dsv4_cuda_dev_fetch(cb->dev) : NULL;
    if (cb->fetch) {
        const struct dsv4_placement *pl = dsv4_cuda_dev_placement(cb->dev);
        DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&cb->fl.s, cudaStreamNonBlocking));
        DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&cb->fc.s, cudaStreamNonBlocking));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&cb->ev_fetched, cudaEventDisableTiming));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&cb->ev_copied, cudaEventDisableTiming));
        for (int i = 0; i < c->n_layers; i++) {     /* the prediction reads a BF16 router [E, D] (the release's) */
            const struct dsv4_cuda_linear *g = &cb->L[i].gate;
            cb->L[i].fetch = pl->host_experts[i] > 0 && cb->L[i].ex.tiled && g->fmt == DSV4_W_BF16 &&
                             g->out == c->n_experts && g->in == c->dim;
        }
    }
    if (cb->spec) {     /* the MTP block: its layer's tables at index n_layers, not counted */
        const struct dsv4_mtp *m = &w->mtp[0];
        const int64_t win = cb->mtp_L.cache.win;
        STEP(map_layer(cb, c->n_layers, &m->layer, &cb->mtp_L));
        cb->mtp_L.cache = {};
        cb->mtp_L.cache.win = win;
        STEP(dev_lin(cb, &m->e_proj, &cb->mtp_e_proj, true));
        STEP(dev_lin(cb, &m->h_proj, &cb->mtp_h_proj, true));
        STEP(dev_lin(cb, &m->hc_head.fn, &cb->mtp_hch_fn, true));
        cb->mtp_enorm = dev_vec(cb, m->enorm);
        cb->mtp_hnorm = dev_vec(cb, m->hnorm);
        cb->mtp_norm = dev_vec(cb, m->norm);
        cb->mtp_hch_base = dev_vec(cb, m->hc_head.base);
        cb->mtp_hch_scale = dev_vec(cb, m->hc_head.scale);
        if (!cb->mtp_enorm || !cb->mtp_hnorm || !cb->mtp_norm || !cb->mtp_hch_base || !cb->mtp_hch_scale)
            return dsv4_error_set(-ENOENT, "cuda: the MTP block's norms or hc_head vectors are missing on the device");
    }

    if (opts->ep_ranks > 0) {
        cb->ep_rank = opts->ep_rank;
        cb->ep_ranks = opts->ep_ranks;
        STEP(dsv4_ep_shard(c->n_experts, cb->ep_ranks, cb->ep_rank, &cb->e0, &cb->e1));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&cb->ev_routed, cudaEventDisableTiming));
        DSV4_CUDA_TRY(cudaEventCreateWithFlags(&cb->ev_parted, cudaEventDisableTiming));
    }
    for (int bsz = 1; bsz < opts->max_batch && cb->n_buckets < STEP_MAX_BUCKETS - 1; bsz *= 2)
        cb->buckets[cb->n_buckets++] = bsz;
    cb->buckets[cb->n_buckets++] = opts->max_batch;
    return 0;
}

/* The launches once eagerly on padding rows (errors surface outside a capture): a whole prefill
 * chunk, then the largest bucket; then the graphs, and the device sealed (READY). */
static int boot_steps(struct cuda_backend *cb)
{
    const struct dsv4_backend_opts *opts = &cb->base.opts;
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(cb->dev));
    const int sizes[2] = { cb->rows, opts->max_batch };
    for (int k = cb->rows > opts->max_batch ? 0 : 1; k < 2; k++) {
        const int B = sizes[k];
        STEP(upload_padding_rows(cb, B, cb->spec ? 2 : 1, s));
        STEP(step_launches(cb, B, k == 0 ? B - 1 : 0, s));
        DSV4_CUDA_TRY(cudaStreamSynchronize(s));
    }
    for (int later = 0; cb->spec && later < 2; later++) {     /* the draft's launches, on padding rows */
        STEP(upload_padding_rows(cb, opts->max_batch, 1, s));
        STEP(draft_launches(cb, opts->max_batch, later, s));
        DSV4_CUDA_TRY(cudaStreamSynchronize(s));
    }
    if (cb->use_graphs)
        STEP(capture(cb));
    dsv4_cuda_dev_seal(cb->dev);
    return 0;
}

/* The backend state booted on opts->gpus[0] (device 0 when none is listed), up to its buckets. */
static int backend_new(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                       const struct dsv4_cuda_switches *sw, struct cuda_backend **ret)
{
    struct cuda_backend *cb = static_cast<struct cuda_backend *>(calloc(1, sizeof(*cb)));
    if (!cb)
        return dsv4_error_set(-ENOMEM, "cuda: backend state");
    /* DSV4_CUDA_SAMPLE=0: no sample op, so the engine samples copied-back logits on the host */
    cb->ops = cuda_ops;
    if (!sw->sample)
        cb->ops.sample = nullptr;
    cb->base.ops = &cb->ops;
    cb->base.weights = w;
    cb->base.opts = *opts;
    cb->base.impl = cb;
    const int rc = create(cb, w, opts, sw);
    if (rc < 0) {
        op_destroy(&cb->base);
        return rc;
    }
    *ret = cb;
    return 0;
}

int dsv4_step_rank_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                          const struct dsv4_cuda_switches *sw, struct cuda_backend **ret)
{
    if (opts->ep_ranks < 1 || opts->spec_tokens || opts->prefix_pool_bytes)
        return dsv4_error_set(-EINVAL, "cuda: an expert-parallel rank takes neither drafts nor a prefix pool "
                              "(ep_ranks %d, spec_tokens %d, prefix pool %lld bytes)", opts->ep_ranks,
                              opts->spec_tokens, (long long)opts->prefix_pool_bytes);
    return backend_new(w, opts, sw, ret);
}

extern "C" int dsv4_backend_cuda_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                                        struct dsv4_backend **ret)
{
    struct dsv4_cuda_switches sw;
    struct cuda_backend *cb;
    int rc;

    if (dsv4_cuda_device_count() == 0)
        return -ENODEV;
    if ((rc = dsv4_cuda_switches_read(&sw)) < 0)
        return rc;
    if (opts->n_gpus > 1)       /* the routed experts split across them */
        return dsv4_cuda_ep_backend_create(w, opts, ret);
    if ((rc = backend_new(w, opts, &sw, &cb)) < 0)
        return rc;
    if ((rc = boot_steps(cb)) < 0) {
        op_destroy(&cb->base);
        return rc;
    }
    if (cb->spec) {     /* the scheduler samples a verify's rows on the host, so every row */
        cb->base.spec_tokens = cb->spec;
        cb->ops.sample = nullptr;
        cb->ops.draft = op_draft;
        cb->ops.verify = op_verify;
        cb->ops.accept = op_accept;
    }
    *ret = &cb->base;
    return 0;
}
