/* SPDX-License-Identifier: MIT */
/* The prefix-cache pool of the CUDA backend (kernels/prefix.h): engine/backend.h's records copied
 * device to device between a slot's caches and pool pages, in the cache's own formats (FP8 KV
 * entries and FP4 indexer keys in fp8 numerics, f32 in exact), so a record is what the step stored.
 *
 * Records, for blocks of B tokens (per layer, in layer order):
 *   block k: the compressed entries [k B / r, (k+1) B / r) of each compressed layer of ratio r, and
 *     of CSA layers the indexer keys of the same entries: each one contiguous run of the slot;
 *   boundary at P = n B: the window positions P - window .. P - 1 of the slot's ring (one run, or two
 *     where the ring wraps), and of each overlapping compressor (CSA: the main one and the indexer's)
 *     the Ca half (first d values) of the rows of positions P - r .. P - 1 in its state ring, kv and
 *     gate: the part of the last block the next entry pools. The rows of the block being filled are
 *     written again before they are read, and HCA compressors carry nothing over a boundary.
 * A record is a list of segments, each one or two 2-D pieces of the slot stored densely, laid one
 * after the other (each segment 16-byte aligned) through the record's pages: a piece that reaches
 * the end of a page goes on at the start of the next, a contiguous one anywhere, a strided one
 * (compressor rows) between two rows. A page holds one block record exactly (a whole boundary
 * record in a model without compressed layers). Each part of a piece is one copy descriptor; one
 * kernel launch runs up to DSV4_CUDA_PREFIX_DESCS of them, a block of threads each. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"
#include "kernels/prefix.h"

#define PREFIX_ALIGN 16             /* segment offsets within a page: 16-byte copies */
#define PREFIX_SEGS_PER_LAYER 5     /* the window, or entries + keys; two compressors x (kv, gate) */
#define PREFIX_COPY_THREADS 256
#define PREFIX_COPY_SPLIT 8         /* blocks per descriptor */

/* A 2-D region of a slot: rows of row_bytes, pitch bytes apart, at byte offset off of the slot. */
struct piece {
    int64_t off, rows, row_bytes, pitch;
};

struct seg {
    int n;
    struct piece p[2];
};

struct copy_desc {
    const uint8_t *src;
    uint8_t *dst;
    int64_t rows, row_bytes, src_pitch, dst_pitch;
};

/* Shapes of the records, from the config alone. */
struct shape {
    const struct dsv4_config *c;
    struct dsv4_cuda_layer_cache lc[DSV4_MAX_LAYERS];
    int block, ring, eb, ikb;
};

struct dsv4_cuda_prefix {
    struct dsv4_cuda_dev *dev;
    struct shape sh;
    struct dsv4_prefix_geom g;
    int slots;                  /* max_batch */
    int max_blocks;
    uint8_t *pool;              /* [n_pages, page_bytes] */
    uint8_t *caches;            /* slot 0 */
    int64_t slot_bytes;
    int64_t *pos;               /* the step's host positions */
    const struct dsv4_sample_history *hist;
    struct copy_desc *d_desc, *h_desc;  /* [DSV4_CUDA_PREFIX_DESCS] */
    int n_desc;
    int32_t *d_tokens, *d_slots, *h_slots;  /* [DSV4_CUDA_PREFIX_TOKENS] */
};

static int64_t align_up(int64_t n, int64_t a)
{
    return (n + a - 1) / a * a;
}

static int64_t seg_bytes(const struct seg *s)
{
    int64_t b = 0;
    for (int i = 0; i < s->n; i++)
        b += s->p[i].rows * s->p[i].row_bytes;
    return b;
}

static struct seg run(int64_t off, int64_t bytes)
{
    struct seg s = {};
    s.n = 1;
    s.p[0] = { off, 1, bytes, bytes };
    return s;
}

static int block_segs(const struct shape *sh, int64_t k, struct seg *out)
{
    const struct dsv4_config *c = sh->c;
    int n = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const int r = c->compress_ratio[l];
        if (!r)
            continue;
        const int64_t first = k * sh->block / r, count = sh->block / r;
        out[n++] = run(sh->lc[l].comp + first * sh->eb, count * sh->eb);
        if (r == c->csa_ratio)
            out[n++] = run(sh->lc[l].ikeys + first * sh->ikb, count * sh->ikb);
    }
    return n;
}

/* kv and gate of the rows of positions P - r .. P - 1 in a state ring of 2r rows of 2d floats. */
static int comp_segs(int64_t state, int r, int d, int64_t P, struct seg *out)
{
    const int64_t width = 2 * (int64_t)d * 4, row0 = (P - r) % (2 * r);
    for (int k = 0; k < 2; k++) {
        out[k] = {};
        out[k].n = 1;
        out[k].p[0] = { state + (k * 2 * r + row0) * width, r, (int64_t)d * 4, width };
    }
    return 2;
}

static int boundary_segs(const struct shape *sh, int64_t P, struct seg *out)
{
    const struct dsv4_config *c = sh->c;
    const int W = c->window;
    int n = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const int64_t start = (P - W) % sh->ring, first = W < sh->ring - start ? W : sh->ring - start;
        struct seg *s = &out[n++];
        *s = run(sh->lc[l].win + start * sh->eb, first * sh->eb);
        if (first < W) {
            s->p[1] = { sh->lc[l].win, 1, (W - first) * sh->eb, (W - first) * sh->eb };
            s->n = 2;
        }
        const int r = c->compress_ratio[l];
        if (r > 0 && r == c->csa_ratio) {
            n += comp_segs(sh->lc[l].cstate, r, c->head_dim, P, out + n);
            n += comp_segs(sh->lc[l].istate, r, c->index_head_dim, P, out + n);
        }
    }
    return n;
}

static int shape_init(const struct dsv4_config *c, const struct dsv4_backend_opts *o, struct shape *sh)
{
    const int block = dsv4_config_prefix_block(c);
    if (block < 0)
        return block;
    if (block > o->max_context)
        return dsv4_error_set(-EINVAL, "prefix cache: blocks of %d tokens do not fit max_context %d (raise "
                              "max_context, or set the pool to 0)", block, o->max_context);
    if (c->n_layers > DSV4_MAX_LAYERS)
        return dsv4_error_set(-EINVAL, "prefix cache: %d layers, at most %d", c->n_layers, DSV4_MAX_LAYERS);
    sh->c = c;
    sh->block = block;
    sh->ring = dsv4_cuda_step_ring_entries(c, o);
    sh->eb = dsv4_cuda_kv_entry_bytes(c->head_dim, c->rope_dim, o->numerics == DSV4_NUMERICS_FP8 ? DSV4_KV_FP8 : DSV4_KV_F32);
    sh->ikb = dsv4_cuda_index_key_bytes(c->index_head_dim, o->numerics == DSV4_NUMERICS_FP8);
    dsv4_cuda_step_slot_layout(c, o, sh->lc);
    return 0;
}

/* Lays a record's pieces through its pages (see the top) and, with p set, queues one descriptor per
 * part (to_pool: slot to pages). Returns the pages the record takes, or -errno. */
static int lay_record(struct dsv4_cuda_prefix *p, int64_t page_bytes, int slot, const int32_t *pages,
                      const struct seg *segs, int n, bool to_pool);

static int64_t record_bytes(const struct seg *segs, int n)
{
    int64_t b = 0;
    for (int i = 0; i < n; i++)
        b += align_up(seg_bytes(&segs[i]), PREFIX_ALIGN);
    return b;
}

/* The pool's geometry (engine/backend.h) for a pool of o->prefix_pool_bytes. */
static int geometry(const struct shape *sh, const struct dsv4_backend_opts *o, struct dsv4_prefix_geom *g)
{
    struct seg segs[DSV4_MAX_LAYERS * PREFIX_SEGS_PER_LAYER];
    const int64_t block_bytes = record_bytes(segs, block_segs(sh, 0, segs));
    const int n = boundary_segs(sh, sh->block, segs);
    int64_t page = block_bytes > 0 ? block_bytes : record_bytes(segs, n);
    for (int i = 0; i < n; i++)     /* a strided piece splits between rows only */
        for (int k = 0; k < segs[i].n; k++)
            if (segs[i].p[k].rows > 1 && segs[i].p[k].row_bytes > page)
                page = segs[i].p[k].row_bytes;
    page = align_up(page, DSV4_CUDA_ARENA_ALIGN);
    *g = {};
    g->block = sh->block;
    g->page_bytes = page;
    g->block_pages = block_bytes > 0;
    g->boundary_pages = lay_record(NULL, page, 0, NULL, segs, n, false);
    const int64_t pages = o->prefix_pool_bytes / page;
    if (pages < g->block_pages + g->boundary_pages)
        return dsv4_error_set(-ENOSPC, "prefix cache: a pool of %lld bytes holds %lld pages of %lld bytes, one "
                              "snapshot takes %d (raise the pool, or set it to 0)", (long long)o->prefix_pool_bytes,
                              (long long)pages, (long long)page, g->block_pages + g->boundary_pages);
    if (pages > DSV4_PREFIX_PAGES_MAX)
        return dsv4_error_set(-E2BIG, "prefix cache: a pool of %lld bytes is %lld pages of %lld bytes, above the "
                              "limit of %d pages", (long long)o->prefix_pool_bytes, (long long)pages, (long long)page,
                              DSV4_PREFIX_PAGES_MAX);
    g->n_pages = (int32_t)pages;
    return 0;
}

static int64_t table_bytes(void)
{
    return align_up((int64_t)sizeof(struct copy_desc) * DSV4_CUDA_PREFIX_DESCS, DSV4_CUDA_ARENA_ALIGN) +
           2 * align_up((int64_t)sizeof(int32_t) * DSV4_CUDA_PREFIX_TOKENS, DSV4_CUDA_ARENA_ALIGN);
}

extern "C" int64_t dsv4_cuda_prefix_bytes(const struct dsv4_config *c, const struct dsv4_backend_opts *o)
{
    struct shape sh;
    struct dsv4_prefix_geom g;
    if (o->prefix_pool_bytes == 0)
        return 0;
    if (o->prefix_pool_bytes < 0)
        return dsv4_error_set(-EINVAL, "prefix cache: pool of %lld bytes", (long long)o->prefix_pool_bytes);
    int rc = shape_init(c, o, &sh);
    if (rc == 0)
        rc = geometry(&sh, o, &g);
    return rc < 0 ? rc : (int64_t)g.n_pages * g.page_bytes + table_bytes();
}

extern "C" int dsv4_cuda_prefix_create(struct dsv4_cuda_dev *dev, const struct dsv4_config *c,
                                       const struct dsv4_backend_opts *o, uint8_t *caches, int64_t slot_bytes,
                                       int64_t *pos, const struct dsv4_sample_history *hist,
                                       struct dsv4_prefix_geom *ret_geom, struct dsv4_cuda_prefix **ret)
{
    void *mem;
    *ret = NULL;
    *ret_geom = {};
    if (o->prefix_pool_bytes == 0)
        return 0;
    struct dsv4_cuda_prefix *p = static_cast<struct dsv4_cuda_prefix *>(calloc(1, sizeof(*p)));
    if (!p)
        return dsv4_error_set(-ENOMEM, "cuda prefix cache: out of memory");
    int rc = shape_init(c, o, &p->sh);
    if (rc == 0)
        rc = geometry(&p->sh, o, &p->g);
    const int64_t pool = (int64_t)p->g.n_pages * p->g.page_bytes;
    if (rc == 0)
        rc = dsv4_cuda_dev_carve(dev, (size_t)(pool + table_bytes()), &mem);
    p->h_desc = static_cast<struct copy_desc *>(calloc(DSV4_CUDA_PREFIX_DESCS, sizeof(*p->h_desc)));
    p->h_slots = static_cast<int32_t *>(calloc(DSV4_CUDA_PREFIX_TOKENS, sizeof(*p->h_slots)));
    if (rc == 0 && (!p->h_desc || !p->h_slots))
        rc = dsv4_error_set(-ENOMEM, "cuda prefix cache: out of memory for the copy tables");
    if (rc < 0) {
        dsv4_cuda_prefix_free(p);
        return rc;
    }
    uint8_t *m = static_cast<uint8_t *>(mem);
    p->pool = m;
    p->d_desc = reinterpret_cast<struct copy_desc *>(m + pool);
    p->d_tokens = reinterpret_cast<int32_t *>(
        m + pool + align_up((int64_t)sizeof(struct copy_desc) * DSV4_CUDA_PREFIX_DESCS, DSV4_CUDA_ARENA_ALIGN));
    p->d_slots = p->d_tokens + align_up((int64_t)sizeof(int32_t) * DSV4_CUDA_PREFIX_TOKENS, DSV4_CUDA_ARENA_ALIGN) / 4;
    p->dev = dev;
    p->slots = o->max_batch;
    p->max_blocks = o->max_context / p->sh.block;
    p->caches = caches;
    p->slot_bytes = slot_bytes;
    p->pos = pos;
    p->hist = hist;
    *ret_geom = p->g;
    *ret = p;
    return 0;
}

extern "C" void dsv4_cuda_prefix_free(struct dsv4_cuda_prefix *p)
{
    if (!p)
        return;
    free(p->h_desc);
    free(p->h_slots);
    free(p);
}

/* ---- copies ---- */

template <typename W>
static __device__ void copy_words(const struct copy_desc &d)
{
    const int64_t per_row = d.row_bytes / (int64_t)sizeof(W), n = d.rows * per_row;
    for (int64_t e = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.y * blockDim.x) {
        const int64_t r = e / per_row, w = e % per_row;
        reinterpret_cast<W *>(d.dst + r * d.dst_pitch)[w] = reinterpret_cast<const W *>(d.src + r * d.src_pitch)[w];
    }
}

/* grid (descriptors, PREFIX_COPY_SPLIT): the widest word every address and length allows. */
__global__ void __launch_bounds__(PREFIX_COPY_THREADS) prefix_copy_kernel(const struct copy_desc *desc)
{
    dsv4_pdl_enter();
    const struct copy_desc d = desc[blockIdx.x];
    const uint64_t a = (uint64_t)(uintptr_t)d.src | (uint64_t)(uintptr_t)d.dst | (uint64_t)d.row_bytes |
                       (uint64_t)d.src_pitch | (uint64_t)d.dst_pitch;
    if (a % 16 == 0)
        copy_words<uint4>(d);
    else if (a % 8 == 0)
        copy_words<uint2>(d);
    else if (a % 4 == 0)
        copy_words<uint32_t>(d);
    else    /* e.g. an FP4 indexer key of 9 or 13 bytes (dI 16 or 24) */
        copy_words<uint8_t>(d);
}

static int flush(struct dsv4_cuda_prefix *p)
{
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(p->dev));
    if (!p->n_desc)
        return 0;
    /* pageable source: the call returns once h_desc is staged, so it can be refilled at once */
    DSV4_CUDA_TRY(cudaMemcpyAsync(p->d_desc, p->h_desc, sizeof(*p->h_desc) * p->n_desc, cudaMemcpyHostToDevice, s));
    dsv4_launch(prefix_copy_kernel, dim3(p->n_desc, PREFIX_COPY_SPLIT), PREFIX_COPY_THREADS, 0, s,
                (const struct copy_desc *)p->d_desc);
    DSV4_CUDA_LAUNCHED("prefix_copy");
    p->n_desc = 0;
    return 0;
}

/* Queues one copy of rows between the slot (at `at`, pitch apart) and the record (at `rec`, dense). */
static int queue(struct dsv4_cuda_prefix *p, uint8_t *at, int64_t pitch, uint8_t *rec, int64_t rows,
                 int64_t row_bytes, bool to_pool)
{
    if (p->n_desc == DSV4_CUDA_PREFIX_DESCS) {
        int rc = flush(p);
        if (rc < 0)
            return rc;
    }
    p->h_desc[p->n_desc++] = { to_pool ? at : rec, to_pool ? rec : at, rows, row_bytes, to_pool ? pitch : row_bytes,
                               to_pool ? row_bytes : pitch };
    return 0;
}

static int lay_record(struct dsv4_cuda_prefix *p, int64_t page_bytes, int slot, const int32_t *pages,
                      const struct seg *segs, int n, bool to_pool)
{
    uint8_t *base = p ? p->caches + (int64_t)slot * p->slot_bytes : NULL;
    int page = 0;
    int64_t off = 0;
    bool used = false;
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < segs[i].n; k++) {
            const struct piece *pc = &segs[i].p[k];
            /* a contiguous piece splits where a page ends (16-byte aligned: segments start so and
             * pages are whole 256-byte units), a strided one between rows */
            const bool run = pc->rows == 1;
            int64_t rows = run ? pc->row_bytes : pc->rows, unit = run ? 1 : pc->row_bytes;
            int64_t done = 0;
            while (rows > 0) {
                if (off + unit > page_bytes) {
                    page++;
                    off = 0;
                }
                const int64_t fit = (page_bytes - off) / unit < rows ? (page_bytes - off) / unit : rows;
                if (p) {
                    uint8_t *rec = p->pool + (int64_t)pages[page] * page_bytes + off;
                    uint8_t *at = base + pc->off + (run ? done : done * pc->pitch);
                    int rc = run ? queue(p, at, fit, rec, 1, fit, to_pool)
                                 : queue(p, at, pc->pitch, rec, fit, pc->row_bytes, to_pool);
                    if (rc < 0)
                        return rc;
                }
                used = true;
                off += fit * unit;
                done += fit;
                rows -= fit;
            }
        }
        off = align_up(off, PREFIX_ALIGN);
    }
    return used ? page + 1 : 0;
}

static int check(const struct dsv4_cuda_prefix *p, int slot, const char *op)
{
    if (!p)
        return dsv4_error_set(-ENODEV, "cuda prefix %s: the backend has no prefix pool", op);
    if (slot < 0 || slot >= p->slots)
        return dsv4_error_set(-EINVAL, "cuda prefix %s: slot %d outside 0..%d", op, slot, p->slots - 1);
    return 0;
}

extern "C" int dsv4_cuda_prefix_save(struct dsv4_cuda_prefix *p, int slot, int block, const int32_t *block_pages,
                                     const int32_t *boundary_pages)
{
    struct seg segs[DSV4_MAX_LAYERS * PREFIX_SEGS_PER_LAYER];
    int rc = check(p, slot, "save");
    if (rc < 0)
        return rc;
    const int64_t P = p->pos[slot];
    if (P <= 0 || P % p->sh.block)
        return dsv4_error_set(-EINVAL, "cuda prefix save: position %lld is not a block boundary (%d tokens)",
                              (long long)P, p->sh.block);
    const int64_t last = P / p->sh.block - 1;
    if (block < 0 || block > last || (boundary_pages && block != last))
        return dsv4_error_set(-EINVAL, "cuda prefix save: block %d at position %lld (blocks 0..%lld; a boundary only "
                              "with the last)", block, (long long)P, (long long)last);
    if (block_pages && p->g.block_pages &&
        (rc = lay_record(p, p->g.page_bytes, slot, block_pages, segs, block_segs(&p->sh, block, segs), true)) < 0)
        return rc;
    if (boundary_pages &&
        (rc = lay_record(p, p->g.page_bytes, slot, boundary_pages, segs, boundary_segs(&p->sh, P, segs), true)) < 0)
        return rc;
    return flush(p);
}

extern "C" int dsv4_cuda_prefix_load(struct dsv4_cuda_prefix *p, int slot, int n_blocks, const int32_t *block_pages,
                                     const int32_t *boundary_pages, const int32_t *tokens)
{
    struct seg segs[DSV4_MAX_LAYERS * PREFIX_SEGS_PER_LAYER];
    int rc = check(p, slot, "load");
    if (rc < 0)
        return rc;
    cudaStream_t s = static_cast<cudaStream_t>(dsv4_cuda_dev_stream(p->dev));
    if (p->pos[slot] != 0)
        return dsv4_error_set(-EBUSY, "cuda prefix load: slot %d holds %lld tokens; a prefix loads into an empty slot",
                              slot, (long long)p->pos[slot]);
    if (n_blocks < 1 || n_blocks > p->max_blocks)
        return dsv4_error_set(-EINVAL, "cuda prefix load: %d blocks, 1..%d fit max_context", n_blocks, p->max_blocks);
    const int64_t P = (int64_t)n_blocks * p->sh.block;
    for (int k = 0; k < n_blocks && p->g.block_pages; k++)
        if ((rc = lay_record(p, p->g.page_bytes, slot, block_pages + (int64_t)k * p->g.block_pages, segs,
                             block_segs(&p->sh, k, segs), false)) < 0)
            return rc;
    if ((rc = lay_record(p, p->g.page_bytes, slot, boundary_pages, segs, boundary_segs(&p->sh, P, segs), false)) < 0 ||
        (rc = flush(p)) < 0)
        return rc;
    /* the restored tokens are seen by the penalties, as prefill marks them */
    for (int64_t i0 = 0; i0 < P; i0 += DSV4_CUDA_PREFIX_TOKENS) {
        const int m = (int)(P - i0 < DSV4_CUDA_PREFIX_TOKENS ? P - i0 : DSV4_CUDA_PREFIX_TOKENS);
        if (i0 == 0) {
            for (int i = 0; i < m; i++)
                p->h_slots[i] = slot;
            DSV4_CUDA_TRY(cudaMemcpyAsync(p->d_slots, p->h_slots, sizeof(int32_t) * m, cudaMemcpyHostToDevice, s));
        }
        DSV4_CUDA_TRY(cudaMemcpyAsync(p->d_tokens, tokens + i0, sizeof(int32_t) * m, cudaMemcpyHostToDevice, s));
        if ((rc = dsv4_sample_history_record(p->hist, p->d_slots, p->d_tokens, m, false, s)) < 0)
            return rc;
    }
    p->pos[slot] = P;
    return 0;
}
