/* SPDX-License-Identifier: MIT */
/* The CPU reference forward pass: sequence state and the per-token step through every layer.
 *
 * Tokens are processed one at a time through all layers. That is exact, not an approximation: the
 * token at pos depends only on earlier tokens (the window, the complete compressed blocks, the
 * compressor state), so a prefill of any length, split into chunks anywhere, computes the same
 * numbers as decode, and a row's arithmetic never depends on what else is in flight.
 *
 * Where DeepSeek's reference code and transformers' deepseek_v4 differ (doc/MODEL.md §4.3), this
 * follows transformers (the exact numerics are defined by it):
 *  - the hc residual streams stay f32 in both numerics (bf16 in the official code);
 *  - mHC and hc_head RMS-normalize the flattened streams before the fn projection, with eps =
 *    rms_norm_eps (the official code scales after the projection; same value, other rounding);
 *  - the routed weights are s / (sum s + 1e-20), normalized whatever norm_topk_prob says, and
 *    softplus returns x above 20 (torch's threshold);
 *  - YaRN: transformers multiplies cos/sin by an attention_factor that its config pins to 1.0 for
 *    V4 (the official code has no mscale); engine/model/config refuses any other attention_factor;
 *  - equal indexer or router scores keep the lower index; torch's topk leaves tie order unspecified
 *    (and its one-shot and decode paths can disagree), so the fixtures are built free of near ties. */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/error.h"

/* A bump allocator for every cache and scratch buffer of a sequence. A first pass with no base
 * only measures (and leaves NULL pointers that the second pass overwrites). */
struct arena {
    char *base;
    size_t used;
};

static void *take(struct arena *a, size_t bytes)
{
    size_t off = (a->used + 63) & ~(size_t)63;
    a->used = off + bytes;
    return a->base ? a->base + off : NULL;
}

static float *takef(struct arena *a, int64_t n)
{
    return take(a, (size_t)n * sizeof(float));
}

static int64_t max64(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

static void carve_comp(struct arena *a, const struct dsv4_compressor *cp, struct dsv4_cpu_comp_state *st)
{
    int64_t width = cp->overlap ? 2 * cp->dim : cp->dim;
    st->kv = takef(a, cp->ratio * width);
    st->gate = takef(a, cp->ratio * width);
    if (cp->overlap) {
        st->prev_kv = takef(a, (int64_t)cp->ratio * cp->dim);
        st->prev_gate = takef(a, (int64_t)cp->ratio * cp->dim);
    }
}

static void carve_layer(struct arena *a, const struct dsv4_config *cfg, const struct dsv4_layer *l,
                        int64_t max_context, struct dsv4_cpu_layer_state *ls)
{
    memset(ls, 0, sizeof(*ls));
    ls->window = takef(a, (int64_t)cfg->window * cfg->head_dim);
    if (!l->ratio)
        return;
    ls->entries = takef(a, max_context / l->ratio * cfg->head_dim);
    carve_comp(a, &l->attn.comp, &ls->comp);
    if (l->ratio == cfg->csa_ratio) {
        ls->index_keys = takef(a, max_context / l->ratio * cfg->index_head_dim);
        carve_comp(a, &l->attn.indexer.comp, &ls->index_comp);
    }
}

/* Largest input width of any linear, for the activation / row scratch. */
int64_t dsv4_cpu_max_linear_in(const struct dsv4_weights *w)
{
    const struct dsv4_config *cfg = &w->cfg;
    int64_t m = (int64_t)cfg->hc_mult * cfg->dim;
    m = max64(m, cfg->q_lora_rank);
    m = max64(m, (int64_t)cfg->n_heads * cfg->head_dim / cfg->o_groups);
    m = max64(m, (int64_t)cfg->o_groups * cfg->o_lora_rank);
    for (int i = 0; i < cfg->n_layers; i++) {
        m = max64(m, w->layers[i].ffn.sw2.in);
        if (cfg->n_experts > 0)
            m = max64(m, w->layers[i].ffn.w2[0].in);
    }
    return m;
}

static void carve(struct arena *a, const struct dsv4_weights *w, int64_t max_context, struct dsv4_cpu_seq *s)
{
    const struct dsv4_config *cfg = &w->cfg;
    int64_t D = cfg->dim, hc = cfg->hc_mult, H = cfg->n_heads, hd = cfg->head_dim;
    int64_t csa_entries = cfg->csa_ratio ? max_context / cfg->csa_ratio : 0;
    int64_t hca_entries = cfg->hca_ratio ? max_context / cfg->hca_ratio : 0;
    int64_t ffn_width = 0;
    for (int i = 0; i < cfg->n_layers; i++)
        ffn_width = max64(ffn_width, w->layers[i].ffn.sw1.out);
    ffn_width = max64(ffn_width, cfg->moe_inter);

    for (int i = 0; i < cfg->n_layers; i++)
        carve_layer(a, cfg, &w->layers[i], max_context, &s->layers[i]);
    if (s->has_mtp) {
        carve_layer(a, cfg, &w->mtp[0].layer, max_context, &s->mtp_layer);
        s->mtp_streams = takef(a, hc * D);
    }
    s->streams = takef(a, hc * D);

    struct dsv4_cpu_work *wk = s->work;
    wk->X = takef(a, hc * D);
    wk->X2 = takef(a, hc * D);
    wk->flat = takef(a, hc * D);
    wk->mix = takef(a, (2 + hc) * hc);
    wk->pre = takef(a, hc);
    wk->post = takef(a, hc);
    wk->comb = takef(a, hc * hc);
    wk->y = takef(a, D);
    wk->xn = takef(a, D);
    wk->sub = takef(a, D);
    wk->qr = takef(a, cfg->q_lora_rank);
    wk->q = takef(a, H * hd);
    wk->kv = takef(a, hd);
    wk->o = takef(a, H * hd);
    wk->z = takef(a, (int64_t)cfg->o_groups * cfg->o_lora_rank);
    wk->max_keys = (int)(cfg->window + max64(hca_entries, max64(cfg->index_topk, 0)));
    wk->scores = takef(a, wk->max_keys);
    wk->keys = take(a, sizeof(*wk->keys) * (size_t)wk->max_keys);
    wk->entry = takef(a, max64(hd, cfg->index_head_dim));
    wk->iq = takef(a, (int64_t)cfg->index_n_heads * cfg->index_head_dim);
    wk->iw = takef(a, cfg->index_n_heads);
    wk->iscore = takef(a, max64(csa_entries, 1));
    wk->isel = take(a, sizeof(int) * (size_t)max64(cfg->index_topk, 1));
    wk->iheap = take(a, sizeof(int) * (size_t)max64(cfg->index_topk, 1));
    wk->router = takef(a, cfg->n_experts);
    wk->rsel = takef(a, cfg->n_experts);
    wk->h1 = takef(a, ffn_width);
    wk->h3 = takef(a, ffn_width);
    wk->eout = takef(a, max64(cfg->n_experts_per_tok, 1) * D);
    wk->act = takef(a, dsv4_cpu_max_linear_in(w));
    wk->row = takef(a, dsv4_cpu_max_linear_in(w));
    if (s->has_mtp)
        wk->draft_logits = takef(a, cfg->vocab_size);
}

/* Checks the model shapes this backend relies on beyond what the loader validates. */
static int check_model(const struct dsv4_weights *w, int64_t max_context)
{
    const struct dsv4_config *cfg = &w->cfg;
    if (max_context < 1 || max_context > DSV4_CPU_MAX_CONTEXT)
        return dsv4_error_set(-EINVAL, "max_context %lld is outside [1, %d]", (long long)max_context,
                              DSV4_CPU_MAX_CONTEXT);
    if (cfg->rope_dim < 2 || cfg->rope_dim % 2 || cfg->rope_dim > DSV4_CPU_MAX_ROPE_DIM ||
        cfg->rope_dim > cfg->head_dim || cfg->rope_dim > cfg->index_head_dim)
        return dsv4_error_set(-EINVAL, "qk_rope_head_dim %d: must be even, at most %d and at most "
                              "head_dim %d and index_head_dim %d", cfg->rope_dim, DSV4_CPU_MAX_ROPE_DIM,
                              cfg->head_dim, cfg->index_head_dim);
    if (cfg->n_experts_per_tok > DSV4_MAX_TOPK || cfg->n_experts_per_tok > cfg->n_experts)
        return dsv4_error_set(-EINVAL, "num_experts_per_tok %d exceeds n_routed_experts %d or the limit %d",
                              cfg->n_experts_per_tok, cfg->n_experts, DSV4_MAX_TOPK);
    for (int i = 0; i < cfg->n_layers; i++) {
        const struct dsv4_ffn *f = &w->layers[i].ffn;
        if (f->type != DSV4_MLP_HASH)
            continue;
        for (int64_t t = 0; t < (int64_t)cfg->vocab_size * cfg->n_experts_per_tok; t++)
            if (f->tid2eid[t] < 0 || f->tid2eid[t] >= cfg->n_experts)
                return dsv4_error_set(-EINVAL, "layer %d tid2eid[%lld][%lld] = %d is not an expert index "
                                      "below %d", i, (long long)(t / cfg->n_experts_per_tok),
                                      (long long)(t % cfg->n_experts_per_tok), f->tid2eid[t], cfg->n_experts);
    }
    return 0;
}

int dsv4_cpu_seq_create(const struct dsv4_weights *w, int64_t max_context, struct dsv4_cpu_seq **ret)
{
    int rc = check_model(w, max_context);
    if (rc < 0)
        return rc;
    struct dsv4_cpu_seq *s = calloc(1, sizeof(*s));
    if (s) {
        s->layers = calloc((size_t)w->cfg.n_layers, sizeof(*s->layers));
        s->work = calloc(1, sizeof(*s->work));
    }
    if (!s || !s->layers || !s->work) {
        dsv4_cpu_seq_free(s);
        return dsv4_error_set(-ENOMEM, "out of memory for a CPU sequence");
    }
    s->max_context = max_context;
    s->n_layers = w->cfg.n_layers;
    s->has_mtp = w->n_mtp > 0;
    dsv4_cpu_rope_init(&s->work->rope_main, &w->cfg.rope_main, w->cfg.rope_dim);
    dsv4_cpu_rope_init(&s->work->rope_compress, &w->cfg.rope_compress, w->cfg.rope_dim);

    struct arena a = {0};
    carve(&a, w, max_context, s);              /* measure */
    size_t size = a.used;
    a = (struct arena){.base = calloc(1, size)};
    if (!a.base) {
        dsv4_cpu_seq_free(s);
        return dsv4_error_set(-ENOMEM, "out of memory for a CPU sequence of %lld tokens (%zu bytes)",
                              (long long)max_context, size);
    }
    carve(&a, w, max_context, s);
    s->arena = a.base;
    s->bytes = size;
    *ret = s;
    return 0;
}

void dsv4_cpu_seq_free(struct dsv4_cpu_seq *s)
{
    if (!s)
        return;
    dsv4_cpu_undo_free(s->undo);
    free(s->arena);
    free(s->layers);
    free(s->work);
    free(s);
}

static void reset_layer(struct dsv4_cpu_layer_state *ls)
{
    ls->start = 0;
    ls->comp.have_prev = false;
    ls->index_comp.have_prev = false;
}

void dsv4_cpu_seq_reset(struct dsv4_cpu_seq *s)
{
    s->pos = 0;
    s->mtp_pos = 0;
    if (s->undo)
        dsv4_cpu_undo_end(s->undo);
    for (int i = 0; i < s->n_layers; i++)
        reset_layer(&s->layers[i]);
    reset_layer(&s->mtp_layer);
}

/* The model's final collapse, norm and head for streams X: logits [vocab]. */
static void head(const struct dsv4_cpu_ctx *c, const struct dsv4_hc_head *hh, const float *norm,
                 const float *X, float *logits)
{
    struct dsv4_cpu_work *wk = c->wk;
    dsv4_cpu_hc_head(c, hh, X, wk->y);
    dsv4_cpu_rmsnorm(wk->xn, wk->y, norm, c->cfg->dim, c->cfg->rms_norm_eps);
    dsv4_cpu_linear(c, &c->w->head, wk->xn, logits);
}

/* One decoder block on the streams wk->X for the token at pos. */
static void block(const struct dsv4_cpu_ctx *c, const struct dsv4_layer *l, struct dsv4_cpu_layer_state *ls,
                  int32_t token, int64_t pos)
{
    const struct dsv4_config *cfg = c->cfg;
    struct dsv4_cpu_work *wk = c->wk;
    dsv4_cpu_hc_pre(c, &l->hc_attn);
    dsv4_cpu_rmsnorm(wk->xn, wk->y, l->attn_norm, cfg->dim, cfg->rms_norm_eps);
    dsv4_cpu_attention(c, l, ls, wk->xn, pos, wk->sub);
    dsv4_cpu_hc_post(c, wk->sub);
    dsv4_cpu_hc_pre(c, &l->hc_ffn);
    dsv4_cpu_rmsnorm(wk->xn, wk->y, l->ffn_norm, cfg->dim, cfg->rms_norm_eps);
    dsv4_cpu_moe(c, &l->ffn, wk->xn, token, wk->sub);
    dsv4_cpu_hc_post(c, wk->sub);
}

/* One step of the MTP block at s->mtp_pos: streams [hc, D] of that position (the main model's, or the
 * block's own output in a later draft) and the token after it. Leaves the block's output streams in
 * wk->X; logits [vocab] when not NULL. */
static void mtp_step(const struct dsv4_cpu_ctx *main_ctx, struct dsv4_cpu_seq *s, const float *streams,
                     int32_t next_token, float *logits)
{
    /* The block's routing is not the main layers': it is not counted. */
    struct dsv4_cpu_ctx ctx = *main_ctx;
    ctx.route_counts = NULL;
    const struct dsv4_cpu_ctx *c = &ctx;
    const struct dsv4_config *cfg = c->cfg;
    const struct dsv4_mtp *m = &c->w->mtp[0];
    struct dsv4_cpu_work *wk = c->wk;
    int64_t D = cfg->dim, hc = cfg->hc_mult;

    /* X_in[j] = e_proj(enorm(embed[next])) + h_proj(hnorm(streams[j])) for every stream j. */
    dsv4_linear_row(&c->w->embed, next_token, wk->y);
    dsv4_cpu_rmsnorm(wk->y, wk->y, m->enorm, (int)D, cfg->rms_norm_eps);
    dsv4_cpu_linear(c, &m->e_proj, wk->y, wk->eout);
    for (int64_t j = 0; j < hc; j++) {
        dsv4_cpu_rmsnorm(wk->xn, streams + j * D, m->hnorm, (int)D, cfg->rms_norm_eps);
        dsv4_cpu_linear(c, &m->h_proj, wk->xn, wk->X + j * D);
        for (int64_t d = 0; d < D; d++)
            wk->X[j * D + d] += wk->eout[d];
    }
    block(c, &m->layer, &s->mtp_layer, next_token, s->mtp_pos);
    s->mtp_pos++;
    if (logits)
        head(c, &m->hc_head, m->norm, wk->X, logits);
}

static int check_tokens(const struct dsv4_weights *w, enum dsv4_numerics num, const struct dsv4_cpu_seq *s,
                        const int32_t *tokens, int n)
{
    const struct dsv4_config *cfg = &w->cfg;
    if (n < 0 || s->pos + n > s->max_context)
        return dsv4_error_set(-ENOSPC, "%d more tokens at position %lld exceed max_context %lld", n,
                              (long long)s->pos, (long long)s->max_context);
    bool indexer = false;
    for (int l = 0; l < cfg->n_layers; l++)
        indexer |= w->layers[l].ratio > 0 && w->layers[l].ratio == cfg->csa_ratio;
    int dI = cfg->index_head_dim;
    if (num == DSV4_NUMERICS_FP8 && indexer && (dI < 1 || (dI & (dI - 1))))
        return dsv4_error_set(-EINVAL, "fp8 numerics rotate indexer keys with a Hadamard transform: "
                              "index_head_dim %d must be a power of two", dI);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= cfg->vocab_size)
            return dsv4_error_set(-EINVAL, "token %d (index %d) is outside the vocabulary of %d", tokens[i],
                                  i, cfg->vocab_size);
    if (s->undo && dsv4_cpu_undo_rows(s->undo) > 0)
        return dsv4_error_set(-EBUSY, "a speculative step of %d rows awaits accept", dsv4_cpu_undo_rows(s->undo));
    return 0;
}

/* Append tokens (checked); with undo, each row is marked and every write recorded. */
static void append(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                   const int32_t *tokens, int n, float *logits, bool all_rows, struct dsv4_cpu_undo *undo)
{
    const struct dsv4_config *cfg = &w->cfg;
    struct dsv4_cpu_ctx c = {.w = w, .cfg = cfg, .num = num, .wk = s->work, .pool = s->pool, .undo = undo};
    struct dsv4_cpu_work *wk = s->work;
    int64_t D = cfg->dim, hc = cfg->hc_mult;
    for (int i = 0; i < n; i++) {
        int64_t pos = s->pos;
        if (undo)
            dsv4_cpu_undo_mark(undo, s->pos, s->mtp_pos);    /* n <= the log's rows: checked by the caller */
        if (s->spec_tokens && pos > 0 && s->mtp_pos == pos - 1)
            mtp_step(&c, s, s->streams, tokens[i], NULL);
        dsv4_linear_row(&w->embed, tokens[i], wk->y);
        for (int64_t j = 0; j < hc; j++)
            memcpy(wk->X + j * D, wk->y, (size_t)D * sizeof(float));
        for (int l = 0; l < cfg->n_layers; l++) {
            c.route_counts = s->route_counts ? s->route_counts + (int64_t)l * cfg->n_experts : NULL;
            block(&c, &w->layers[l], &s->layers[l], tokens[i], pos);
        }
        dsv4_cpu_undo_save(undo, s->streams, (size_t)(hc * D) * sizeof(float));
        memcpy(s->streams, wk->X, (size_t)(hc * D) * sizeof(float));
        s->pos++;
        if (logits && (all_rows || i == n - 1))
            head(&c, &w->hc_head, w->norm, wk->X, logits + (all_rows ? (size_t)i * cfg->vocab_size : 0));
    }
}

int dsv4_cpu_forward(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                     const int32_t *tokens, int n, float *logits, bool all_rows)
{
    int rc = check_tokens(w, num, s, tokens, n);
    if (rc < 0)
        return rc;
    append(w, num, s, tokens, n, logits, all_rows, NULL);
    return 0;
}

int dsv4_cpu_mtp_forward(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                         const float *streams, int32_t next_token, float *logits)
{
    const struct dsv4_config *cfg = &w->cfg;
    if (!s->has_mtp)
        return dsv4_error_set(-ENOENT, "the checkpoint carries no MTP block");
    if (next_token < 0 || next_token >= cfg->vocab_size)
        return dsv4_error_set(-EINVAL, "token %d is outside the vocabulary of %d", next_token, cfg->vocab_size);
    if (s->mtp_pos >= s->max_context)
        return dsv4_error_set(-ENOSPC, "MTP position %lld reaches max_context %lld", (long long)s->mtp_pos,
                              (long long)s->max_context);
    struct dsv4_cpu_ctx c = {.w = w, .cfg = cfg, .num = num, .wk = s->work, .pool = s->pool};
    mtp_step(&c, s, streams, next_token, logits);
    return 0;
}

int dsv4_cpu_seq_spec_init(const struct dsv4_weights *w, struct dsv4_cpu_seq *s, int spec_tokens)
{
    if (spec_tokens < 1 || spec_tokens > DSV4_SPEC_TOKENS_MAX)
        return dsv4_error_set(-EINVAL, "spec_tokens %d is outside [1, %d]", spec_tokens, DSV4_SPEC_TOKENS_MAX);
    if (!s->has_mtp)
        return dsv4_error_set(-ENOENT, "speculative decoding drafts with the MTP block: the checkpoint has none");
    if (s->pos || s->undo)
        return dsv4_error_set(-EBUSY, "speculative decoding is set up once, on an empty sequence");
    int rc = dsv4_cpu_undo_create(w, spec_tokens + 1, &s->undo);
    if (rc < 0)
        return rc;
    s->spec_tokens = spec_tokens;
    s->bytes += dsv4_cpu_undo_bytes(s->undo);
    return 0;
}

/* Greedy: the largest logit, the lowest id on ties (as the sampler's temperature 0). */
static int32_t argmax(const float *row, int V)
{
    int32_t best = 0;
    for (int v = 1; v < V; v++)
        if (row[v] > row[best])
            best = v;
    return best;
}

int dsv4_cpu_draft(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s, int32_t token,
                   int k, int32_t *drafts, int *ret_k)
{
    const struct dsv4_config *cfg = &w->cfg;
    *ret_k = 0;
    if (!s->spec_tokens)
        return dsv4_error_set(-ENOTSUP, "the sequence does not speculate (no spec_tokens or no MTP block)");
    if (k < 0 || k > s->spec_tokens)
        return dsv4_error_set(-EINVAL, "%d drafts: outside [0, %d]", k, s->spec_tokens);
    int rc = check_tokens(w, num, s, &token, 1);
    if (rc < 0)
        return rc;
    /* The block must hold P - 1 .. back: it lags one position, and draft j sits at P - 1 + j. */
    if (k == 0 || s->pos == 0 || s->mtp_pos != s->pos - 1 || s->pos - 1 + k > s->max_context)
        return 0;

    struct dsv4_cpu_ctx c = {.w = w, .cfg = cfg, .num = num, .wk = s->work, .pool = s->pool};
    int64_t D = cfg->dim, hc = cfg->hc_mult;
    float *logits = s->work->draft_logits;
    mtp_step(&c, s, s->streams, token, logits);
    drafts[0] = argmax(logits, cfg->vocab_size);
    /* Later drafts run on the block's own streams; their window rows are taken back below, so the
     * sequence is left as the first step (the real catch-up step for P - 1) leaves it. */
    dsv4_cpu_undo_begin(s->undo);
    c.undo = s->undo;
    for (int j = 1; j < k; j++) {
        memcpy(s->mtp_streams, s->work->X, (size_t)(hc * D) * sizeof(float));
        dsv4_cpu_undo_mark(s->undo, s->pos, s->mtp_pos);
        mtp_step(&c, s, s->mtp_streams, drafts[j - 1], logits);
        drafts[j] = argmax(logits, cfg->vocab_size);
    }
    int64_t pos = s->pos;
    rc = dsv4_cpu_undo_rollback(s->undo, 0, &pos, &s->mtp_pos);
    if (rc < 0)
        return rc;
    *ret_k = k;
    return 0;
}

int dsv4_cpu_verify(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                    const int32_t *tokens, int n, float *logits)
{
    if (!s->spec_tokens)
        return dsv4_error_set(-ENOTSUP, "the sequence does not speculate (no spec_tokens or no MTP block)");
    if (n < 1 || n > s->spec_tokens + 1)
        return dsv4_error_set(-EINVAL, "a verify of %d rows: outside [1, %d]", n, s->spec_tokens + 1);
    int rc = check_tokens(w, num, s, tokens, n);
    if (rc < 0)
        return rc;
    dsv4_cpu_undo_begin(s->undo);
    append(w, num, s, tokens, n, logits, true, s->undo);
    return 0;
}

int dsv4_cpu_accept(struct dsv4_cpu_seq *s, int keep)
{
    if (!s->undo || dsv4_cpu_undo_rows(s->undo) == 0)
        return dsv4_error_set(-EINVAL, "accept without a verify before it");
    if (keep < 1)
        return dsv4_error_set(-EINVAL, "accept %d rows: a verify's first row is always kept", keep);
    return dsv4_cpu_undo_rollback(s->undo, keep, &s->pos, &s->mtp_pos);
}
