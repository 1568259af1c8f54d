/* SPDX-License-Identifier: MIT */
/* The scheduler's use of the prefix cache (engine/serve/sched_internal.h): restore a request's longest
 * cached prefix before its first prefill, save each block its slot completes and the slot's state
 * where a step leaves it on a block boundary. */
#include "build-config.h"

#include <stdint.h>

#include "engine/serve/sched_internal.h"

struct save_ctx {
    struct dsv4_sched *s;
    int slot;
    int block;                  /* the block whose entries are saved */
};

static int save_slot(void *ctx, const int32_t *block_pages, const int32_t *boundary_pages)
{
    const struct save_ctx *x = ctx;
    struct dsv4_backend *b = x->s->backend;
    const uint64_t t0 = sched_now_ns();
    const int r = b->ops->prefix_save(b, x->slot, x->block, block_pages, boundary_pages);
    sched_backend_time(x->s, t0);
    return r;
}

/* Before q's first prefill: restore the longest cached prefix of its prompt, all but the last token
 * (prefill makes that one's logits). Returns 0, or the backend's error (q is then finished). */
int sched_prefix_restore(struct dsv4_sched *s, struct sched_req *q)
{
    struct dsv4_backend *b = s->backend;
    struct dsv4_prefix_hit hit;
    q->cache_looked = true;
    if (!s->prefix)
        return 0;
    q->caching = true;
    dsv4_prefix_cache_lookup(s->prefix, q->prompt, q->n_prompt - 1, &hit);
    q->cache_match = hit.matched_blocks;
    if (hit.node == DSV4_PREFIX_ROOT)
        return 0;
    q->cache_node = hit.node;       /* released with the slot, also when the load fails */
    const uint64_t t0 = sched_now_ns();
    int r = b->ops->prefix_load(b, q->slot, hit.n_blocks, hit.block_pages, hit.boundary_pages, q->prompt);
    sched_backend_time(s, t0);
    if (r < 0) {
        sched_fail_request(s, q, r, "restoring the cached prefix");
        return r;
    }
    const int n = hit.n_blocks * s->block;
    uint8_t *seen = s->seen + (size_t)q->slot * s->seen_stride;
    for (int i = 0; i < n; i++)
        seen[q->prompt[i] / 8] |= (uint8_t)(1u << (q->prompt[i] % 8));
    q->n_prefilled = n;
    q->position = n;
    q->result.cached_tokens = n;
    return 0;
}

/* The tokens of q's block k: prompt, then the generated tokens fed since. */
static const int32_t *seq_block(struct dsv4_sched *s, const struct sched_req *q, int64_t k)
{
    const int64_t start = k * s->block;
    if (start + s->block <= q->n_prompt)
        return q->prompt + start;
    const int32_t *gen = s->outs[q->out].tokens;
    for (int i = 0; i < s->block; i++)
        s->block_tokens[i] = start + i < q->n_prompt ? q->prompt[start + i] : gen[start + i - q->n_prompt];
    return s->block_tokens;
}

bool sched_prefix_hot(const struct dsv4_sched *s, const struct sched_req *q, int64_t boundary)
{
    const int64_t k = boundary / s->block;
    return boundary + s->block >= q->n_prompt || k == q->cache_match || k == s->chain_max;
}

void sched_prefix_advance(struct dsv4_sched *s, struct sched_req *q)
{
    if (q->position % s->block)
        return;
    for (int64_t k = dsv4_prefix_cache_blocks(s->prefix, q->cache_node); q->caching; k++) {
        const int64_t end = (k + 1) * s->block;
        if (end > q->position)
            break;
        /* a deeper block would evict the others for a chain that no boundary record could end */
        if (k == s->chain_max) {
            q->caching = false;
            break;
        }
        struct save_ctx ctx = { s, q->slot, (int)k };
        int32_t node;
        int r = dsv4_prefix_cache_extend(s->prefix, q->cache_node, seq_block(s, q, k), end == q->position,
                                         sched_prefix_hot(s, q, end), save_slot, &ctx, &node);
        if (sched_backend_fatal(s, r, "saving a prefix"))
            return;
        dsv4_prefix_cache_release(s->prefix, q->cache_node);
        q->cache_node = r == 0 ? node : DSV4_PREFIX_ROOT;
        q->caching = r == 0;
    }
}
