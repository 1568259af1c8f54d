/* SPDX-License-Identifier: MIT */
/* Prefix cache: the index, references and eviction of engine/serve/prefix_cache.h over the pages of a
 * backend's pool. Every table is an array of int32 indices allocated at create:
 *   nodes[max_nodes]      the tree; free nodes are chained through hnext
 *   tokens[max_nodes, B]  each node's block of tokens, compared on every match
 *   buckets[pow2]         hash chains through nodes[].hnext
 *   page_next[n_pages]    each record's pages (and the free pages) chained in record order
 * The nodes with a boundary record are on one of two intrusive doubly linked lists, `hot` and
 * `cold`, newest at the head; eviction takes from the tails. */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "engine/error.h"
#include "engine/serve/prefix_cache.h"

#define HASH_MUL 0x9e3779b97f4a7c15ull

enum { LIST_HOT, LIST_COLD, N_LISTS };

struct node {
    uint64_t hash;                  /* of (parent's hash, tokens) */
    int32_t parent;
    int32_t hnext;                  /* bucket chain, or the free list */
    int32_t prev, next;             /* the hot or cold list, while the node has a boundary record */
    int32_t blk_page, bnd_page;     /* first page of each record, -1 when absent */
    int32_t children, refs;
    int32_t depth;                  /* blocks from the root, this one included */
    bool live, hot;
};

struct list {
    int32_t head, tail;
};

struct dsv4_prefix_cache {
    struct dsv4_prefix_geom g;
    uint64_t root_hash;             /* drawn at create: clients who send the tokens cannot aim at one bucket */
    int max_blocks;                 /* max_context / block */
    int32_t max_nodes;
    struct node *nodes;
    int32_t *tokens;
    int32_t *buckets;
    uint64_t bucket_mask;
    int32_t *page_next;
    int32_t free_page, free_node;
    int64_t n_free_pages, n_free_nodes;
    struct list lists[N_LISTS];
    int32_t *hit_blk, *hit_bnd;     /* lookup results [max_blocks * block_pages], [boundary_pages] */
    int32_t *save_blk, *save_bnd;   /* a snapshot's new pages */
    struct dsv4_prefix_stats st;
};

/* ---- lists ---- */

static void list_unlink(struct dsv4_prefix_cache *c, int list, int32_t i)
{
    struct node *n = &c->nodes[i];
    if (n->prev >= 0)
        c->nodes[n->prev].next = n->next;
    else
        c->lists[list].head = n->next;
    if (n->next >= 0)
        c->nodes[n->next].prev = n->prev;
    else
        c->lists[list].tail = n->prev;
}

static void list_push_head(struct dsv4_prefix_cache *c, int list, int32_t i)
{
    struct node *n = &c->nodes[i];
    n->prev = -1;
    n->next = c->lists[list].head;
    if (n->next >= 0)
        c->nodes[n->next].prev = i;
    else
        c->lists[list].tail = i;
    c->lists[list].head = i;
}

/* The boundary record of i becomes the newest of the hot or the cold list. */
static void place_boundary(struct dsv4_prefix_cache *c, int32_t i, bool hot, bool linked)
{
    struct node *n = &c->nodes[i];
    if (linked)
        list_unlink(c, n->hot ? LIST_HOT : LIST_COLD, i);
    n->hot = hot;
    list_push_head(c, hot ? LIST_HOT : LIST_COLD, i);
}

/* ---- pages ---- */

static int32_t pages_alloc(struct dsv4_prefix_cache *c, int n, int32_t *out)
{
    int32_t head = c->free_page;
    for (int k = 0; k < n; k++) {
        out[k] = c->free_page;
        c->free_page = c->page_next[c->free_page];
    }
    if (n > 0)
        c->page_next[out[n - 1]] = -1;
    c->n_free_pages -= n;
    c->st.pages_used += n;
    return n > 0 ? head : -1;
}

static void pages_free(struct dsv4_prefix_cache *c, int32_t head)
{
    while (head >= 0) {
        int32_t next = c->page_next[head];
        c->page_next[head] = c->free_page;
        c->free_page = head;
        c->n_free_pages++;
        c->st.pages_used--;
        head = next;
    }
}

/* A record's pages into out[], in record order. */
static void pages_list(const struct dsv4_prefix_cache *c, int32_t head, int32_t *out)
{
    for (int k = 0; head >= 0; head = c->page_next[head])
        out[k++] = head;
}

/* ---- the index ---- */

static uint64_t block_hash(uint64_t h, const int32_t *t, int n)
{
    for (int i = 0; i < n; i++) {
        h = (h ^ (uint32_t)t[i]) * HASH_MUL;
        h ^= h >> 29;
    }
    return h;
}

static uint64_t hash_of(const struct dsv4_prefix_cache *c, int32_t i)
{
    return i == DSV4_PREFIX_ROOT ? c->root_hash : c->nodes[i].hash;
}

static const int32_t *tokens_of(const struct dsv4_prefix_cache *c, int32_t i)
{
    return c->tokens + (int64_t)i * c->g.block;
}

static int32_t find(const struct dsv4_prefix_cache *c, int32_t parent, uint64_t h, const int32_t *t)
{
    for (int32_t i = c->buckets[h & c->bucket_mask]; i >= 0; i = c->nodes[i].hnext)
        if (c->nodes[i].hash == h && c->nodes[i].parent == parent &&
            memcmp(tokens_of(c, i), t, sizeof(int32_t) * (size_t)c->g.block) == 0)
            return i;
    return -1;
}

static void bucket_remove(struct dsv4_prefix_cache *c, int32_t i)
{
    int32_t *p = &c->buckets[c->nodes[i].hash & c->bucket_mask];
    while (*p != i)
        p = &c->nodes[*p].hnext;
    *p = c->nodes[i].hnext;
}

/* ---- eviction ---- */

static void drop_node(struct dsv4_prefix_cache *c, int32_t i);

static bool useless(const struct node *n)
{
    return n->live && n->children == 0 && n->refs == 0 && n->bnd_page < 0;
}

/* Node i and then its ancestors go while nothing can be restored from them. */
static void prune(struct dsv4_prefix_cache *c, int32_t i)
{
    while (i != DSV4_PREFIX_ROOT && useless(&c->nodes[i])) {
        int32_t parent = c->nodes[i].parent;
        drop_node(c, i);
        i = parent;
    }
}

static void drop_boundary(struct dsv4_prefix_cache *c, int32_t i)
{
    struct node *n = &c->nodes[i];
    list_unlink(c, n->hot ? LIST_HOT : LIST_COLD, i);
    pages_free(c, n->bnd_page);
    n->bnd_page = -1;
    c->st.boundaries--;
}

static void drop_node(struct dsv4_prefix_cache *c, int32_t i)
{
    struct node *n = &c->nodes[i];
    pages_free(c, n->blk_page);
    bucket_remove(c, i);
    if (n->parent != DSV4_PREFIX_ROOT)
        c->nodes[n->parent].children--;
    n->live = false;
    n->hnext = c->free_node;
    c->free_node = i;
    c->n_free_nodes++;
    c->st.nodes--;
    c->st.nodes_evicted++;
}

/* The boundary record to evict next: cold ones first, oldest first. When a node is wanted, the first
 * in that order whose node goes with it (a leaf no request holds): no other eviction frees a node.
 * Only a pool without block records (block_pages 0) runs out of nodes while pages are free; there
 * evicting an inner record would lose it for nothing, and the scan past such records is the price. */
static int32_t pick_victim(const struct dsv4_prefix_cache *c, bool want_node)
{
    static const int order[N_LISTS] = { LIST_COLD, LIST_HOT };
    for (int k = 0; k < N_LISTS; k++)
        for (int32_t i = c->lists[order[k]].tail; i >= 0; i = c->nodes[i].prev)
            if (!want_node || (c->nodes[i].children == 0 && c->nodes[i].refs == 0))
                return i;
    return -1;
}

/* Evict until `pages` pages (and a node, when `node`) are free; -ENOSPC when that cannot be done.
 * Only boundary records are evicted: a leaf without one (and without references) goes with it,
 * and so do the ancestors that this leaves useless. */
static int make_room(struct dsv4_prefix_cache *c, int pages, bool node)
{
    while (c->n_free_pages < pages || (node && c->n_free_nodes == 0)) {
        int32_t victim = pick_victim(c, node && c->n_free_nodes == 0);
        if (victim < 0)
            return -ENOSPC;
        drop_boundary(c, victim);
        c->st.boundaries_evicted++;
        prune(c, victim);
    }
    return 0;
}

/* ---- API ---- */

int dsv4_prefix_cache_create(const struct dsv4_prefix_geom *g, int max_context, struct dsv4_prefix_cache **ret)
{
    *ret = NULL;
    if (g->block < 1 || g->block > DSV4_PREFIX_BLOCK_MAX || g->n_pages < 1 || g->n_pages > DSV4_PREFIX_PAGES_MAX ||
        g->block_pages < 0 || g->boundary_pages < 1 || g->block_pages + g->boundary_pages > g->n_pages)
        return dsv4_error_set(-EINVAL, "prefix cache: geometry of %d-token blocks, %d pages, records of %d + %d "
                              "pages", g->block, g->n_pages, g->block_pages, g->boundary_pages);
    if (max_context < g->block)
        return dsv4_error_set(-EINVAL, "prefix cache: max_context %d is below one block of %d tokens", max_context,
                              g->block);
    struct dsv4_prefix_cache *c = calloc(1, sizeof(*c));
    if (!c)
        return dsv4_error_set(-ENOMEM, "prefix cache: out of memory");
    c->g = *g;
    if (getrandom(&c->root_hash, sizeof(c->root_hash), 0) != sizeof(c->root_hash)) {
        const int e = errno;
        free(c);
        return dsv4_error_set(-EIO, "prefix cache: drawing the hash seed: %s", strerror(e));
    }
    c->max_blocks = max_context / g->block;
    c->max_nodes = g->n_pages;      /* a node holds a page, except in models without compressed layers */
    uint64_t nb = 1;
    while (nb < (uint64_t)c->max_nodes)
        nb *= 2;
    c->bucket_mask = nb - 1;
    c->nodes = calloc((size_t)c->max_nodes, sizeof(*c->nodes));
    c->tokens = calloc((size_t)c->max_nodes * (size_t)g->block, sizeof(*c->tokens));
    c->buckets = malloc(nb * sizeof(*c->buckets));
    c->page_next = malloc((size_t)g->n_pages * sizeof(*c->page_next));
    c->hit_blk = calloc((size_t)c->max_blocks * (size_t)g->block_pages + 1, sizeof(int32_t));
    c->hit_bnd = calloc((size_t)g->boundary_pages, sizeof(int32_t));
    c->save_blk = calloc((size_t)g->block_pages + 1, sizeof(int32_t));
    c->save_bnd = calloc((size_t)g->boundary_pages, sizeof(int32_t));
    c->st.allocations = 9;
    if (!c->nodes || !c->tokens || !c->buckets || !c->page_next || !c->hit_blk || !c->hit_bnd || !c->save_blk ||
        !c->save_bnd) {
        dsv4_prefix_cache_destroy(c);
        return dsv4_error_set(-ENOMEM, "prefix cache: out of memory for the tables of %d pages", g->n_pages);
    }
    for (uint64_t i = 0; i < nb; i++)
        c->buckets[i] = -1;
    for (int32_t i = 0; i < g->n_pages; i++)
        c->page_next[i] = i + 1 < g->n_pages ? i + 1 : -1;
    for (int32_t i = 0; i < c->max_nodes; i++)
        c->nodes[i].hnext = i + 1 < c->max_nodes ? i + 1 : -1;
    for (int l = 0; l < N_LISTS; l++)
        c->lists[l] = (struct list){ -1, -1 };
    c->n_free_pages = g->n_pages;
    c->n_free_nodes = c->max_nodes;
    c->st.block = g->block;
    c->st.page_bytes = g->page_bytes;
    c->st.pages_total = g->n_pages;
    *ret = c;
    return 0;
}

void dsv4_prefix_cache_destroy(struct dsv4_prefix_cache *c)
{
    if (!c)
        return;
    free(c->nodes);
    free(c->tokens);
    free(c->buckets);
    free(c->page_next);
    free(c->hit_blk);
    free(c->hit_bnd);
    free(c->save_blk);
    free(c->save_bnd);
    free(c);
}

void dsv4_prefix_cache_lookup(struct dsv4_prefix_cache *c, const int32_t *tokens, int max_tokens,
                              struct dsv4_prefix_hit *ret)
{
    const int B = c->g.block;
    int32_t parent = DSV4_PREFIX_ROOT, best = DSV4_PREFIX_ROOT;
    int d = 0;
    for (; d < c->max_blocks && (int64_t)(d + 1) * B <= max_tokens; d++) {
        const int32_t *t = tokens + (int64_t)d * B;
        int32_t i = find(c, parent, block_hash(hash_of(c, parent), t, B), t);
        if (i < 0)
            break;
        if (c->nodes[i].bnd_page >= 0)
            best = i;
        parent = i;
    }
    *ret = (struct dsv4_prefix_hit){ .node = best, .matched_blocks = d, .block_pages = c->hit_blk,
                                     .boundary_pages = c->hit_bnd };
    c->st.lookups++;
    if (best == DSV4_PREFIX_ROOT)
        return;
    struct node *n = &c->nodes[best];
    ret->n_blocks = n->depth;
    for (int32_t i = best; i != DSV4_PREFIX_ROOT; i = c->nodes[i].parent)
        pages_list(c, c->nodes[i].blk_page, c->hit_blk + (int64_t)(c->nodes[i].depth - 1) * c->g.block_pages);
    pages_list(c, n->bnd_page, c->hit_bnd);
    n->refs++;
    place_boundary(c, best, true, true);
    c->st.hits++;
    c->st.hit_tokens += (uint64_t)n->depth * (uint64_t)B;
}

/* Give node i (which has none) a boundary record filled by save(); false when there is no room or
 * save() failed (*rc says which: 0 or its error). */
static bool add_boundary(struct dsv4_prefix_cache *c, int32_t i, bool hot, dsv4_prefix_save_fn save, void *ctx,
                         int *rc)
{
    *rc = 0;
    if (make_room(c, c->g.boundary_pages, false) < 0) {
        c->st.saves_skipped++;
        return false;
    }
    int32_t head = pages_alloc(c, c->g.boundary_pages, c->save_bnd);
    *rc = save(ctx, NULL, c->save_bnd);
    if (*rc < 0) {
        pages_free(c, head);
        return false;
    }
    c->nodes[i].bnd_page = head;
    place_boundary(c, i, hot, false);
    c->st.boundaries++;
    c->st.boundaries_saved++;
    return true;
}

int dsv4_prefix_cache_extend(struct dsv4_prefix_cache *c, int32_t parent, const int32_t *block_tokens, bool boundary,
                             bool hot, dsv4_prefix_save_fn save, void *ctx, int32_t *ret_node)
{
    const uint64_t h = block_hash(hash_of(c, parent), block_tokens, c->g.block);
    const int depth = parent == DSV4_PREFIX_ROOT ? 1 : c->nodes[parent].depth + 1;
    int32_t i = find(c, parent, h, block_tokens);
    int rc = 0;

    *ret_node = DSV4_PREFIX_ROOT;
    if (depth > c->max_blocks)
        return dsv4_error_set(-EINVAL, "prefix cache: block %d is past max_context", depth);
    if (i >= 0) {
        /* another request wrote this block: its entries serve this chain as they are */
        c->nodes[i].refs++;     /* held while room is made, so i itself stays */
        if (c->nodes[i].bnd_page >= 0) {
            if (boundary && hot)
                place_boundary(c, i, true, true);
        } else if (boundary && !add_boundary(c, i, hot, save, ctx, &rc) && rc < 0) {
            dsv4_prefix_cache_release(c, i);
            return rc;
        }
        *ret_node = i;
        return 0;
    }

    bool with_boundary = boundary && make_room(c, c->g.block_pages + c->g.boundary_pages, true) == 0;
    if (!with_boundary && make_room(c, c->g.block_pages, true) < 0) {
        c->st.saves_skipped++;
        return -ENOSPC;
    }
    if (boundary && !with_boundary)
        c->st.saves_skipped++;
    int32_t blk = pages_alloc(c, c->g.block_pages, c->save_blk);
    int32_t bnd = with_boundary ? pages_alloc(c, c->g.boundary_pages, c->save_bnd) : -1;
    rc = save(ctx, c->g.block_pages ? c->save_blk : NULL, with_boundary ? c->save_bnd : NULL);
    if (rc < 0) {
        pages_free(c, blk);
        pages_free(c, bnd);
        return rc;
    }
    i = c->free_node;
    struct node *n = &c->nodes[i];
    c->free_node = n->hnext;
    c->n_free_nodes--;
    *n = (struct node){ .hash = h, .parent = parent, .blk_page = blk, .bnd_page = bnd, .refs = 1,
                        .depth = depth, .live = true };
    memcpy(c->tokens + (int64_t)i * c->g.block, block_tokens, sizeof(int32_t) * (size_t)c->g.block);
    n->hnext = c->buckets[h & c->bucket_mask];
    c->buckets[h & c->bucket_mask] = i;
    if (parent != DSV4_PREFIX_ROOT)
        c->nodes[parent].children++;
    if (with_boundary) {
        place_boundary(c, i, hot, false);
        c->st.boundaries++;
        c->st.boundaries_saved++;
    }
    c->st.nodes++;
    c->st.blocks_saved++;
    *ret_node = i;
    return 0;
}

int dsv4_prefix_cache_chain_max(const struct dsv4_prefix_cache *c)
{
    /* without block records a chain is bound by the nodes, one a block */
    const int64_t fit = c->g.block_pages ? (c->g.n_pages - c->g.boundary_pages) / c->g.block_pages : c->max_nodes;
    return fit < c->max_blocks ? (int)fit : c->max_blocks;
}

int dsv4_prefix_cache_blocks(const struct dsv4_prefix_cache *c, int32_t node)
{
    return node == DSV4_PREFIX_ROOT ? 0 : c->nodes[node].depth;
}

void dsv4_prefix_cache_release(struct dsv4_prefix_cache *c, int32_t node)
{
    if (node == DSV4_PREFIX_ROOT)
        return;
    c->nodes[node].refs--;
    prune(c, node);
}

void dsv4_prefix_cache_get_stats(const struct dsv4_prefix_cache *c, struct dsv4_prefix_stats *ret)
{
    *ret = c->st;
}
