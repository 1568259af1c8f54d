/* SPDX-License-Identifier: MIT */
/* Prefix-cache records of a CPU sequence (engine/backend.h says what a block record and a boundary
 * record hold). A record is a list of segments, each a span of the sequence's f32 caches, laid one
 * after the other through the record's pages. A page holds one block record exactly (a whole
 * boundary record in a model without compressed layers); a boundary record spans as many pages as
 * its bytes need.
 *
 * Block record of block k (positions [k B, (k+1) B)), per compressed layer of ratio r:
 *   entries [k B / r, (k+1) B / r) x head_dim; CSA layers also the indexer keys of those entries.
 * Boundary record at P = n B, per layer: the window ring [window, head_dim] (P is a multiple of the
 *   window, so the ring holds positions P - window .. P - 1 in order); for each overlapping
 *   compressor its prev_kv and prev_gate [ratio, d] (the Ca half of block n - 1, which the next
 *   entry pools). Nothing else carries over a boundary: the rows of the block being filled are
 *   all written again before they are read. */
#include "build-config.h"

#include <errno.h>
#include <string.h>

#include "engine/cpu/cpu_forward.h"
#include "engine/error.h"

#define CPU_PREFIX_ALIGN 64
/* A layer's segments in one record: the window or (entries, index keys), two compressors x (kv, gate). */
#define CPU_PREFIX_SEGS_PER_LAYER 5

struct seg {
    float *mem;
    int64_t bytes;
};

static int64_t align_up(int64_t n)
{
    return (n + CPU_PREFIX_ALIGN - 1) / CPU_PREFIX_ALIGN * CPU_PREFIX_ALIGN;
}

/* Segments of block k's record. */
static int block_segs(const struct dsv4_weights *w, const struct dsv4_cpu_seq *s, int block, int64_t k,
                      struct seg *out)
{
    const struct dsv4_config *cfg = &w->cfg;
    int n = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct dsv4_cpu_layer_state *ls = &s->layers[l];
        const int r = w->layers[l].ratio;
        if (!r)
            continue;
        const int64_t first = k * block / r, count = block / r;
        out[n++] = (struct seg){ ls->entries + first * cfg->head_dim, count * cfg->head_dim * (int64_t)sizeof(float) };
        if (ls->index_keys)
            out[n++] = (struct seg){ ls->index_keys + first * cfg->index_head_dim,
                                     count * cfg->index_head_dim * (int64_t)sizeof(float) };
    }
    return n;
}

static int comp_segs(const struct dsv4_compressor *cp, const struct dsv4_cpu_comp_state *st, struct seg *out)
{
    if (!cp->overlap)
        return 0;
    const int64_t bytes = (int64_t)cp->ratio * cp->dim * (int64_t)sizeof(float);
    out[0] = (struct seg){ st->prev_kv, bytes };
    out[1] = (struct seg){ st->prev_gate, bytes };
    return 2;
}

/* Segments of the boundary record. */
static int boundary_segs(const struct dsv4_weights *w, const struct dsv4_cpu_seq *s, struct seg *out)
{
    const struct dsv4_config *cfg = &w->cfg;
    int n = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct dsv4_cpu_layer_state *ls = &s->layers[l];
        out[n++] = (struct seg){ ls->window, (int64_t)cfg->window * cfg->head_dim * (int64_t)sizeof(float) };
        if (w->layers[l].ratio)
            n += comp_segs(&w->layers[l].attn.comp, &ls->comp, out + n);
        if (ls->index_keys)
            n += comp_segs(&w->layers[l].attn.indexer.comp, &ls->index_comp, out + n);
    }
    return n;
}

/* A record's bytes: its segments one after the other, each starting CPU_PREFIX_ALIGN-aligned. */
static int64_t record_bytes(const struct seg *g, int n)
{
    int64_t b = 0;
    for (int i = 0; i < n; i++)
        b += align_up(g[i].bytes);
    return b;
}

/* The record's bytes run through its pages in order: a segment that reaches the end of a page
 * goes on at the start of the next. */
static void copy_record(uint8_t *pool, int64_t page_bytes, const int32_t *pages, const struct seg *g, int n,
                        bool to_pool)
{
    int page = 0;
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        uint8_t *mem = (uint8_t *)g[i].mem;
        for (int64_t left = g[i].bytes; left > 0;) {
            if (off == page_bytes) {
                page++;
                off = 0;
            }
            const int64_t k = left < page_bytes - off ? left : page_bytes - off;
            uint8_t *p = pool + (int64_t)pages[page] * page_bytes + off;
            memcpy(to_pool ? p : mem, to_pool ? mem : p, (size_t)k);
            mem += k;
            left -= k;
            off += k;
        }
        off = align_up(off);
    }
}

int dsv4_cpu_prefix_geom(const struct dsv4_weights *w, const struct dsv4_cpu_seq *s, int64_t pool_bytes,
                         struct dsv4_prefix_geom *ret)
{
    struct seg g[DSV4_MAX_LAYERS * CPU_PREFIX_SEGS_PER_LAYER];
    memset(ret, 0, sizeof(*ret));
    if (pool_bytes == 0)
        return 0;
    if (pool_bytes < 0)
        return dsv4_error_set(-EINVAL, "prefix cache: pool of %lld bytes", (long long)pool_bytes);
    int block = dsv4_config_prefix_block(&w->cfg);
    if (block < 0)
        return block;
    if (block > s->max_context)
        return dsv4_error_set(-EINVAL, "prefix cache: blocks of %d tokens do not fit max_context %lld (raise "
                              "max_context, or set the pool to 0)", block, (long long)s->max_context);
    const int64_t block_bytes = record_bytes(g, block_segs(w, s, block, 0, g));
    const int64_t boundary_bytes = record_bytes(g, boundary_segs(w, s, g));
    const int64_t page = block_bytes > 0 ? block_bytes : boundary_bytes;
    ret->block = block;
    ret->page_bytes = page;
    ret->block_pages = block_bytes > 0;
    ret->boundary_pages = (int)((boundary_bytes + page - 1) / page);
    int64_t pages = pool_bytes / page;
    if (pages < ret->block_pages + ret->boundary_pages)
        return dsv4_error_set(-ENOSPC, "prefix cache: a pool of %lld bytes holds %lld pages of %lld bytes, one "
                              "snapshot takes %d (raise the pool, or set it to 0)", (long long)pool_bytes,
                              (long long)pages, (long long)page, ret->block_pages + ret->boundary_pages);
    if (pages > DSV4_PREFIX_PAGES_MAX)
        return dsv4_error_set(-E2BIG, "prefix cache: a pool of %lld bytes is %lld pages of %lld bytes, above the "
                              "limit of %d pages", (long long)pool_bytes, (long long)pages, (long long)page,
                              DSV4_PREFIX_PAGES_MAX);
    ret->n_pages = (int32_t)pages;
    return 0;
}

int dsv4_cpu_prefix_save(const struct dsv4_weights *w, const struct dsv4_cpu_seq *s, uint8_t *pool,
                         const struct dsv4_prefix_geom *g, int block, const int32_t *block_pages,
                         const int32_t *boundary_pages)
{
    struct seg segs[DSV4_MAX_LAYERS * CPU_PREFIX_SEGS_PER_LAYER];
    if (s->pos <= 0 || s->pos % g->block)
        return dsv4_error_set(-EINVAL, "prefix save: position %lld is not a block boundary (%d tokens)",
                              (long long)s->pos, g->block);
    const int64_t last = s->pos / g->block - 1;
    if (block < 0 || block > last || (boundary_pages && block != last))
        return dsv4_error_set(-EINVAL, "prefix save: block %d at position %lld (blocks 0..%lld; a boundary only with "
                              "the last)", block, (long long)s->pos, (long long)last);
    if (block_pages && g->block_pages)
        copy_record(pool, g->page_bytes, block_pages, segs, block_segs(w, s, g->block, block, segs), true);
    if (boundary_pages)
        copy_record(pool, g->page_bytes, boundary_pages, segs, boundary_segs(w, s, segs), true);
    return 0;
}

static void set_have_prev(const struct dsv4_compressor *cp, struct dsv4_cpu_comp_state *st)
{
    st->have_prev = cp->overlap;
}

int dsv4_cpu_prefix_load(const struct dsv4_weights *w, struct dsv4_cpu_seq *s, uint8_t *pool,
                         const struct dsv4_prefix_geom *g, int n_blocks, const int32_t *block_pages,
                         const int32_t *boundary_pages)
{
    struct seg segs[DSV4_MAX_LAYERS * CPU_PREFIX_SEGS_PER_LAYER];
    if (s->pos != 0)
        return dsv4_error_set(-EBUSY, "prefix load: the slot holds %lld tokens; a prefix loads into an empty slot",
                              (long long)s->pos);
    if (n_blocks < 1 || (int64_t)n_blocks * g->block > s->max_context)
        return dsv4_error_set(-EINVAL, "prefix load: %d blocks of %d tokens do not fit max_context %lld", n_blocks,
                              g->block, (long long)s->max_context);
    for (int k = 0; k < n_blocks && g->block_pages; k++)
        copy_record(pool, g->page_bytes, block_pages + (int64_t)k * g->block_pages, segs,
                    block_segs(w, s, g->block, k, segs), false);
    copy_record(pool, g->page_bytes, boundary_pages, segs, boundary_segs(w, s, segs), false);
    for (int l = 0; l < s->n_layers; l++) {
        if (w->layers[l].ratio)
            set_have_prev(&w->layers[l].attn.comp, &s->layers[l].comp);
        if (s->layers[l].index_keys)
            set_have_prev(&w->layers[l].attn.indexer.comp, &s->layers[l].index_comp);
    }
    s->pos = (int64_t)n_blocks * g->block;
    /* The MTP block is not in the records: it starts over here, its window empty, and is first fed
     * position pos once the token after it is known (its drafts wait until then). */
    s->mtp_pos = s->pos;
    s->mtp_layer.start = s->pos;
    return 0;
}
