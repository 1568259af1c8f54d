/* SPDX-License-Identifier: MIT */
/* Prefix cache: snapshots of slot state at block boundaries (engine/backend.h, struct
 * dsv4_prefix_geom), found again by the tokens that led to them, so a request that starts like an
 * earlier one skips that part of its prefill.
 *
 * Index. A node stands for one block of tokens following its parent's (the root is the empty
 * prefix). Nodes are found through a hash of (parent, block tokens) and then compared on both, so a
 * hit is exact whatever the hash does; the hash starts from a seed drawn at create, so prompts
 * cannot be chosen to pile their blocks into one bucket. Each node owns its block record: the compressed entries its
 * tokens produced, shared by every longer prefix through it rather than copied per prefix. It may
 * also own a boundary record (window and compressor state after its last token), which a
 * continuation from exactly that point needs.
 *
 * References. A request whose slot continues a chain (its prefix was restored from node n, or it
 * snapshotted n, and it will snapshot n's child next) holds a reference on n: n stays, and so do its
 * ancestors, since only leaves are evicted.
 *
 * Eviction, when a snapshot needs pages or a node and none are free, takes boundary records: cold
 * ones first, oldest first (those of prefill boundaries a request only passed through), then the
 * least recently used hot one; when what is missing is a node (a pool without block records can
 * run out of nodes while pages are free), only those whose node goes with them. A boundary record
 * is hot when it ends a request's prompt, marks where a prompt left the cached chain, was written
 * while decoding, or served a hit. A node left with no boundary record, no children and no
 * references (nothing can be restored from it or below it) goes at once, and so do the ancestors
 * this leaves in that state: a chain's entries live as long as some boundary record below them or
 * a request holding them.
 *
 * Memory: the backend's pool pages and host tables sized at create; nothing is allocated later.
 * Threads: one (the engine thread). */
#ifndef DSV4_ENGINE_SERVE_PREFIX_CACHE_H
#define DSV4_ENGINE_SERVE_PREFIX_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/backend.h"

#define DSV4_PREFIX_ROOT (-1)       /* the empty prefix: a miss, or a chain not yet started */

struct dsv4_prefix_cache;

struct dsv4_prefix_stats {
    int block;                      /* tokens per block */
    int64_t page_bytes, pages_total, pages_used;
    int64_t nodes;                  /* blocks whose entries are held (tokens held: nodes * block) */
    int64_t boundaries;             /* boundary records held */
    uint64_t lookups, hits, hit_tokens;
    uint64_t blocks_saved, boundaries_saved;
    uint64_t saves_skipped;         /* snapshots (or their boundary record) left out: no room */
    uint64_t nodes_evicted, boundaries_evicted;
    uint64_t allocations;           /* host allocations made at create; none afterwards */
};

struct dsv4_prefix_hit {
    int32_t node;                   /* the node restored from (a reference is held), or ROOT: miss */
    int n_blocks;                   /* blocks restored: n_blocks * block tokens */
    int matched_blocks;             /* blocks of the tokens found in the index (>= n_blocks) */
    const int32_t *block_pages;     /* [n_blocks * geom.block_pages], blocks in order */
    const int32_t *boundary_pages;  /* [geom.boundary_pages] */
};

/* Fills the pages of a new snapshot from the slot (the backend's prefix_save); either list may be NULL. */
typedef int (*dsv4_prefix_save_fn)(void *ctx, const int32_t *block_pages, const int32_t *boundary_pages);

/* Over a backend's pool geometry (g->n_pages > 0) for slots of max_context tokens. */
int dsv4_prefix_cache_create(const struct dsv4_prefix_geom *g, int max_context, struct dsv4_prefix_cache **ret);
void dsv4_prefix_cache_destroy(struct dsv4_prefix_cache *c);       /* accepts NULL */

/* The longest prefix of tokens[0, max_tokens) that ends on a block boundary with a boundary record.
 * On a hit the caller holds a reference on hit->node (dsv4_prefix_cache_release) and restores the
 * pages listed, which stay valid until the next call. */
void dsv4_prefix_cache_lookup(struct dsv4_prefix_cache *c, const int32_t *tokens, int max_tokens,
                              struct dsv4_prefix_hit *ret);

/* The slot that continues the chain at `parent` (the caller's reference, or ROOT) has just appended
 * block_tokens[block]: make or find the child node, call save() for the records it lacks, and return
 * it in *ret_node with a reference for the caller (the parent's is still the caller's to release).
 * boundary: the slot stands at the block's end, so the node may get a boundary record; false for a
 * block the slot has already gone past (a prefill chunk longer than a block saves every block it
 * passed, and the state at its end only). hot: that boundary record is worth keeping (see eviction
 * above). A boundary record that finds no room is left out (the node still continues the chain).
 * Returns 0; -ENOSPC when no node fits (nothing changed); or save()'s error (nothing changed). */
int dsv4_prefix_cache_extend(struct dsv4_prefix_cache *c, int32_t parent, const int32_t *block_tokens, bool boundary,
                             bool hot, dsv4_prefix_save_fn save, void *ctx, int32_t *ret_node);

/* The most blocks one chain can hold with the state at its end: deeper blocks could only be restored
 * from a boundary record that no longer fits beside them. */
int dsv4_prefix_cache_chain_max(const struct dsv4_prefix_cache *c);

/* The blocks of node's chain (ROOT: 0): the index of the block that extends it. */
int dsv4_prefix_cache_blocks(const struct dsv4_prefix_cache *c, int32_t node);

/* Drop the caller's reference on node (ROOT: nothing). */
void dsv4_prefix_cache_release(struct dsv4_prefix_cache *c, int32_t node);

void dsv4_prefix_cache_get_stats(const struct dsv4_prefix_cache *c, struct dsv4_prefix_stats *ret);

#endif
