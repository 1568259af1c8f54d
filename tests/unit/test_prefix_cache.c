/* SPDX-License-Identifier: MIT */
/* engine/serve/prefix_cache on its own, over a host array standing in for a backend's pool: what a lookup
 * finds (longest prefix with a boundary record, partial matches, the same block under different
 * parents), that every page a lookup lists holds what was saved for that prefix (also after pages
 * were evicted and reused), references (a held chain is never evicted; ENOSPC when everything is
 * held), blocks a chunk passed (their entries without the slot's state), the eviction order (cold boundary records first, then least recently used; in a pool
 * without block records, only those that free a node when a node is missing), failed saves, and
 * the page and node counts against a walk of what is reachable. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "engine/serve/prefix_cache.h"

#define B 4                 /* tokens per block */
#define CTX 64              /* max_context: 16 blocks */
#define PAGE_WORDS 3        /* a page: [kind, depth, hash of the prefix] */
#define MAX_PAGES 64

struct pool {
    int32_t page[MAX_PAGES][PAGE_WORDS];
    const int32_t *prefix;  /* the tokens being snapshotted: their first `depth` blocks */
    int depth;
    int calls, fail;
    const int32_t *last_blk, *last_bnd;
};

static int32_t prefix_hash(const int32_t *t, int depth)
{
    uint32_t h = 2166136261u;
    for (int i = 0; i < depth * B; i++)
        h = (h ^ (uint32_t)t[i]) * 16777619u;
    return (int32_t)(h & 0x7fffffff);
}

/* The backend stand-in: a block page records its block, a boundary page the whole prefix. */
static int save(void *ctx, const int32_t *blk, const int32_t *bnd)
{
    struct pool *p = ctx;
    p->calls++;
    p->last_blk = blk;
    p->last_bnd = bnd;
    if (p->fail)
        return -EIO;
    if (blk) {
        p->page[blk[0]][0] = 'b';
        p->page[blk[0]][1] = p->depth;
        p->page[blk[0]][2] = prefix_hash(p->prefix + (p->depth - 1) * B, 1);
    }
    for (int k = 0; bnd && k < 2; k++) {
        p->page[bnd[k]][0] = 'w' + k;
        p->page[bnd[k]][1] = p->depth;
        p->page[bnd[k]][2] = prefix_hash(p->prefix, p->depth);
    }
    return 0;
}

static struct dsv4_prefix_cache *make(int pages)
{
    struct dsv4_prefix_geom g = { .block = B, .page_bytes = sizeof(int32_t) * PAGE_WORDS, .n_pages = pages,
                                  .block_pages = 1, .boundary_pages = 2 };
    struct dsv4_prefix_cache *c;
    assert_int_equal(dsv4_prefix_cache_create(&g, CTX, &c), 0);
    return c;
}

/* Snapshot blocks [from, to) of t along a chain starting at node `at` (held, or ROOT); returns the
 * last node (held) or ROOT when a save found no room. */
static int32_t chain(struct dsv4_prefix_cache *c, struct pool *p, const int32_t *t, int32_t at, int from, int to,
                     bool hot)
{
    for (int d = from; d < to; d++) {
        int32_t next;
        p->prefix = t;
        p->depth = d + 1;
        int r = dsv4_prefix_cache_extend(c, at, t + d * B, true, hot || d == to - 1, save, p, &next);
        dsv4_prefix_cache_release(c, at);
        if (r < 0)
            return DSV4_PREFIX_ROOT;
        at = next;
    }
    return at;
}

/* Every page a hit lists holds what was saved for exactly that prefix. */
static void check_hit(const struct pool *p, const int32_t *t, const struct dsv4_prefix_hit *h)
{
    for (int d = 0; d < h->n_blocks; d++) {
        const int32_t *pg = p->page[h->block_pages[d]];
        assert_int_equal(pg[0], 'b');
        assert_int_equal(pg[1], d + 1);
        assert_int_equal(pg[2], prefix_hash(t + d * B, 1));
    }
    for (int k = 0; k < 2; k++) {
        const int32_t *pg = p->page[h->boundary_pages[k]];
        assert_int_equal(pg[0], 'w' + k);
        assert_int_equal(pg[1], h->n_blocks);
        assert_int_equal(pg[2], prefix_hash(t, h->n_blocks));
    }
}

static void tokens(int32_t *t, int n, int salt)
{
    for (int i = 0; i < n; i++)
        t[i] = (int32_t)((i * 7 + salt * 13 + 1) % 97);
}

static void test_lookup(void **state)
{
    (void)state;
    struct pool p = { 0 };
    struct dsv4_prefix_cache *c = make(MAX_PAGES);
    struct dsv4_prefix_hit h;
    int32_t t[6 * B], u[6 * B];
    tokens(t, 6 * B, 1);

    dsv4_prefix_cache_lookup(c, t, 6 * B, &h);
    assert_int_equal(h.node, DSV4_PREFIX_ROOT);
    assert_int_equal(h.n_blocks, 0);

    int32_t end = chain(c, &p, t, DSV4_PREFIX_ROOT, 0, 4, true);
    assert_true(end >= 0);
    assert_int_equal(p.calls, 4);
    dsv4_prefix_cache_release(c, end);

    /* every boundary, and never the block that holds the last token asked for */
    for (int n = 0; n <= 6 * B; n++) {
        dsv4_prefix_cache_lookup(c, t, n, &h);
        int want = n / B < 4 ? n / B : 4;
        assert_int_equal(h.n_blocks, want);
        if (want) {
            check_hit(&p, t, &h);
            dsv4_prefix_cache_release(c, h.node);
        } else {
            assert_int_equal(h.node, DSV4_PREFIX_ROOT);
        }
    }

    /* a prompt that leaves the chain inside block 2 finds blocks 0..1 and reports the match */
    memcpy(u, t, sizeof(u));
    u[2 * B + 1] ^= 1;
    dsv4_prefix_cache_lookup(c, u, 6 * B, &h);
    assert_int_equal(h.n_blocks, 2);
    assert_int_equal(h.matched_blocks, 2);
    check_hit(&p, u, &h);

    /* the same block after another parent is another node */
    int32_t v[3 * B];
    tokens(v, 3 * B, 2);
    memcpy(v + B, t + B, sizeof(int32_t) * B);
    dsv4_prefix_cache_release(c, chain(c, &p, v, DSV4_PREFIX_ROOT, 0, 2, true));
    dsv4_prefix_cache_lookup(c, v, 3 * B, &h);
    assert_int_equal(h.n_blocks, 2);
    check_hit(&p, v, &h);
    dsv4_prefix_cache_release(c, h.node);

    /* extending through blocks another chain wrote copies nothing */
    int calls = p.calls;
    int32_t again = chain(c, &p, t, DSV4_PREFIX_ROOT, 0, 4, true);
    assert_int_equal(p.calls, calls);
    dsv4_prefix_cache_release(c, again);

    struct dsv4_prefix_stats st;
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.nodes, 6);
    assert_int_equal(st.boundaries, 6);
    assert_int_equal(st.pages_used, 6 * 3);
    assert_int_equal(st.blocks_saved, 6);
    assert_int_equal(st.nodes_evicted, 0);
    dsv4_prefix_cache_destroy(c);
}

/* A hit past a boundary record that was evicted falls back to the deepest one left; a chain
 * continues from a restored node and its new blocks hang below it. */
static void test_partial_and_continue(void **state)
{
    (void)state;
    struct pool p = { 0 };
    struct dsv4_prefix_cache *c = make(MAX_PAGES);
    struct dsv4_prefix_hit h;
    int32_t t[8 * B];
    tokens(t, 8 * B, 3);

    /* blocks 0..2 cold except the last: all three are found while the pool has room */
    dsv4_prefix_cache_release(c, chain(c, &p, t, DSV4_PREFIX_ROOT, 0, 3, false));
    dsv4_prefix_cache_lookup(c, t, 2 * B + 1, &h);
    assert_int_equal(h.n_blocks, 2);
    check_hit(&p, t, &h);
    /* continue from the restored node: block 2 exists (no copy), blocks 3..5 are new */
    int calls = p.calls;
    int32_t end = chain(c, &p, t, h.node, 2, 6, false);
    assert_int_equal(p.calls, calls + 3);
    dsv4_prefix_cache_release(c, end);
    dsv4_prefix_cache_lookup(c, t, 8 * B, &h);
    assert_int_equal(h.n_blocks, 6);
    check_hit(&p, t, &h);
    dsv4_prefix_cache_release(c, h.node);
    dsv4_prefix_cache_destroy(c);
}

/* Cold boundary records go first, then the least recently used; a held chain's nodes stay. */
static void test_eviction(void **state)
{
    (void)state;
    struct pool p = { 0 };
    /* 13 pages: 4 snapshots of 3 pages and one spare */
    struct dsv4_prefix_cache *c = make(13);
    struct dsv4_prefix_hit h;
    struct dsv4_prefix_stats st;
    int32_t a[4 * B], b[4 * B], d[4 * B];
    tokens(a, 4 * B, 4);
    tokens(b, 4 * B, 5);
    tokens(d, 4 * B, 6);

    /* a: 2 blocks, its first boundary cold; b: 2 blocks, both hot */
    dsv4_prefix_cache_release(c, chain(c, &p, a, DSV4_PREFIX_ROOT, 0, 2, false));
    dsv4_prefix_cache_release(c, chain(c, &p, b, DSV4_PREFIX_ROOT, 0, 2, true));
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.pages_used, 12);

    /* d's first block needs 3 pages: a's cold boundary at block 1 goes, the rest stays */
    int32_t dn = chain(c, &p, d, DSV4_PREFIX_ROOT, 0, 1, true);
    assert_true(dn >= 0);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.boundaries_evicted, 1);
    assert_int_equal(st.nodes_evicted, 0);
    dsv4_prefix_cache_lookup(c, a, B + 1, &h);
    assert_int_equal(h.node, DSV4_PREFIX_ROOT);
    assert_int_equal(h.matched_blocks, 1);
    dsv4_prefix_cache_lookup(c, a, 4 * B, &h);
    assert_int_equal(h.n_blocks, 2);
    check_hit(&p, a, &h);
    dsv4_prefix_cache_release(c, h.node);
    /* b's first boundary is used after a's: b's leaf is now the least recently used */
    dsv4_prefix_cache_lookup(c, b, B + 1, &h);
    assert_int_equal(h.n_blocks, 1);
    dsv4_prefix_cache_release(c, h.node);

    /* d's second block: b's leaf goes with its boundary; b's first block and a stay */
    int32_t dn2 = chain(c, &p, d, dn, 1, 2, true);
    assert_true(dn2 >= 0);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.boundaries_evicted, 2);
    assert_int_equal(st.nodes_evicted, 1);
    dsv4_prefix_cache_lookup(c, b, 4 * B, &h);
    assert_int_equal(h.n_blocks, 1);
    assert_int_equal(h.matched_blocks, 1);
    check_hit(&p, b, &h);
    dsv4_prefix_cache_release(c, h.node);
    dsv4_prefix_cache_lookup(c, a, 4 * B, &h);
    assert_int_equal(h.n_blocks, 2);
    check_hit(&p, a, &h);
    dsv4_prefix_cache_release(c, h.node);

    /* a long chain fills the pool: every boundary record may go, but d's held nodes stay, and the
     * chain stops with ENOSPC once block records of held nodes fill the pages */
    int32_t e[16 * B];
    tokens(e, 16 * B, 7);
    int32_t en = chain(c, &p, e, DSV4_PREFIX_ROOT, 0, 16, true);
    assert_int_equal(en, DSV4_PREFIX_ROOT);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_true(st.saves_skipped >= 1);
    dsv4_prefix_cache_lookup(c, d, 4 * B, &h);
    assert_int_equal(h.matched_blocks, 2);
    if (h.node != DSV4_PREFIX_ROOT) {
        check_hit(&p, d, &h);
        dsv4_prefix_cache_release(c, h.node);
    }
    dsv4_prefix_cache_release(c, dn2);

    /* nothing held: every count consistent, and every chain left still restores what it saved */
    dsv4_prefix_cache_get_stats(c, &st);
    assert_true(st.pages_used <= 13);
    assert_int_equal(st.pages_used, st.nodes + 2 * st.boundaries);
    for (int n = B; n <= 16 * B; n += B) {
        dsv4_prefix_cache_lookup(c, e, n, &h);
        if (h.node != DSV4_PREFIX_ROOT) {
            check_hit(&p, e, &h);
            dsv4_prefix_cache_release(c, h.node);
        }
    }
    dsv4_prefix_cache_destroy(c);
}

/* A failed save leaves nothing behind; a pool too small for one snapshot is refused at create. */
static void test_failures(void **state)
{
    (void)state;
    struct pool p = { 0 };
    struct dsv4_prefix_cache *c = make(6);
    struct dsv4_prefix_stats st;
    struct dsv4_prefix_hit h;
    int32_t t[2 * B], node;
    tokens(t, 2 * B, 8);
    p.fail = 1;
    p.prefix = t;
    p.depth = 1;
    assert_int_equal(dsv4_prefix_cache_extend(c, DSV4_PREFIX_ROOT, t, true, true, save, &p, &node), -EIO);
    assert_int_equal(node, DSV4_PREFIX_ROOT);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.pages_used, 0);
    assert_int_equal(st.nodes, 0);
    dsv4_prefix_cache_lookup(c, t, 2 * B, &h);
    assert_int_equal(h.node, DSV4_PREFIX_ROOT);
    p.fail = 0;
    dsv4_prefix_cache_release(c, chain(c, &p, t, DSV4_PREFIX_ROOT, 0, 2, true));
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.pages_used, 6);
    dsv4_prefix_cache_destroy(c);

    struct dsv4_prefix_geom g = { .block = B, .page_bytes = 8, .n_pages = 2, .block_pages = 1, .boundary_pages = 2 };
    assert_int_equal(dsv4_prefix_cache_create(&g, CTX, &c), -EINVAL);
    g.n_pages = 3;
    assert_int_equal(dsv4_prefix_cache_create(&g, B - 1, &c), -EINVAL);
}

/* A chain that found room only for block records (its boundary records evicted to make that room)
 * is pruned whole once released: nothing could be restored from it. */
static void test_prune(void **state)
{
    (void)state;
    struct pool p = { 0 };
    struct dsv4_prefix_cache *c = make(4);
    struct dsv4_prefix_stats st;
    struct dsv4_prefix_hit h;
    int32_t t[4 * B];
    tokens(t, 4 * B, 9);
    int32_t held = chain(c, &p, t, DSV4_PREFIX_ROOT, 0, 3, true);
    assert_true(held >= 0);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.nodes, 3);
    assert_int_equal(st.boundaries, 0);
    assert_int_equal(st.boundaries_evicted, 2);
    assert_int_equal(st.saves_skipped, 1);
    assert_int_equal(st.pages_used, 3);
    dsv4_prefix_cache_lookup(c, t, 4 * B, &h);
    assert_int_equal(h.node, DSV4_PREFIX_ROOT);
    assert_int_equal(h.matched_blocks, 3);
    dsv4_prefix_cache_release(c, held);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.nodes, 0);
    assert_int_equal(st.pages_used, 0);
    dsv4_prefix_cache_destroy(c);
}

/* A model without compressed layers has no block records (block_pages 0): a node holds no page, so
 * every node can be taken while pages are free. Evicting a boundary record then makes room for a
 * node only where it frees one (a leaf no request holds); the others are kept rather than lost for
 * nothing. */
static int save_window(void *ctx, const int32_t *blk, const int32_t *bnd)
{
    struct pool *p = ctx;
    p->calls++;
    assert_null(blk);
    p->page[bnd[0]][0] = 'w';
    p->page[bnd[0]][1] = p->depth;
    p->page[bnd[0]][2] = prefix_hash(p->prefix, p->depth);
    return 0;
}

static void test_no_block_pages(void **state)
{
    (void)state;
    struct pool p = { 0 };
    struct dsv4_prefix_geom g = { .block = B, .page_bytes = 8, .n_pages = 4, .block_pages = 0, .boundary_pages = 1 };
    struct dsv4_prefix_cache *c;
    struct dsv4_prefix_stats st;
    struct dsv4_prefix_hit h;
    int32_t t[5 * B], u[B], at = DSV4_PREFIX_ROOT, node;
    tokens(t, 5 * B, 10);
    tokens(u, B, 11);
    assert_int_equal(dsv4_prefix_cache_create(&g, CTX, &c), 0);
    assert_int_equal(dsv4_prefix_cache_chain_max(c), 4);     /* a node a block */

    /* 4 blocks take every node (and page); the chain's end is held, so nothing can make a node */
    p.prefix = t;
    for (int d = 0; d < 4; d++) {
        p.depth = d + 1;
        assert_int_equal(dsv4_prefix_cache_extend(c, at, t + d * B, true, d == 3, save_window, &p, &node), 0);
        dsv4_prefix_cache_release(c, at);
        at = node;
    }
    p.depth = 5;
    assert_int_equal(dsv4_prefix_cache_extend(c, at, t + 4 * B, true, true, save_window, &p, &node), -ENOSPC);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.boundaries_evicted, 0);
    assert_int_equal(st.boundaries, 4);
    dsv4_prefix_cache_release(c, at);
    dsv4_prefix_cache_lookup(c, t, 5 * B, &h);
    assert_int_equal(h.n_blocks, 4);
    assert_int_equal(p.page[h.boundary_pages[0]][2], prefix_hash(t, 4));
    dsv4_prefix_cache_release(c, h.node);

    /* another prompt's block: the leaf goes (its node is the one freed), the older records above it stay */
    p.prefix = u;
    p.depth = 1;
    assert_int_equal(dsv4_prefix_cache_extend(c, DSV4_PREFIX_ROOT, u, true, true, save_window, &p, &node), 0);
    dsv4_prefix_cache_release(c, node);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.boundaries_evicted, 1);
    assert_int_equal(st.nodes_evicted, 1);
    assert_int_equal(st.nodes, 4);
    assert_int_equal(st.pages_used, st.boundaries);
    dsv4_prefix_cache_lookup(c, t, 5 * B, &h);
    assert_int_equal(h.n_blocks, 3);
    assert_int_equal(p.page[h.boundary_pages[0]][2], prefix_hash(t, 3));
    dsv4_prefix_cache_release(c, h.node);
    dsv4_prefix_cache_lookup(c, u, B + 1, &h);
    assert_int_equal(h.n_blocks, 1);
    assert_int_equal(p.page[h.boundary_pages[0]][2], prefix_hash(u, 1));
    dsv4_prefix_cache_release(c, h.node);
    dsv4_prefix_cache_destroy(c);
}

/* A prefill chunk that passes several boundaries saves each block it passed without the slot's
 * state (boundary false) and the state at its end only: the passed blocks serve a longer hit
 * through them but are no place to resume, and leaving their boundary records out is no skip. */
static void test_passed_blocks(void **state)
{
    (void)state;
    struct pool p = { 0 };
    struct dsv4_prefix_cache *c = make(MAX_PAGES);
    struct dsv4_prefix_hit h;
    struct dsv4_prefix_stats st;
    int32_t t[5 * B];
    tokens(t, 5 * B, 5);
    /* a chain's depth: max_context's 16 blocks here; 9 pages hold 7 blocks and a boundary record */
    assert_int_equal(dsv4_prefix_cache_chain_max(c), CTX / B);
    struct dsv4_prefix_cache *small = make(9);
    assert_int_equal(dsv4_prefix_cache_chain_max(small), 7);
    dsv4_prefix_cache_destroy(small);

    int32_t at = DSV4_PREFIX_ROOT, next;
    p.prefix = t;
    for (int d = 0; d < 4; d++) {
        p.depth = d + 1;
        assert_int_equal(dsv4_prefix_cache_extend(c, at, t + d * B, d == 3, d == 3, save, &p, &next), 0);
        if (d < 3)
            assert_null(p.last_bnd);    /* passed: the block's entries only */
        else
            assert_non_null(p.last_bnd);
        assert_non_null(p.last_blk);
        dsv4_prefix_cache_release(c, at);
        at = next;
    }
    dsv4_prefix_cache_release(c, at);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.nodes, 4);
    assert_int_equal(st.boundaries, 1);
    assert_int_equal(st.saves_skipped, 0);

    /* 3 blocks then other tokens: found in the index, but no state to resume from before block 4 */
    int32_t u[5 * B];
    memcpy(u, t, sizeof(u));
    u[3 * B] += 1;
    dsv4_prefix_cache_lookup(c, u, 5 * B, &h);
    assert_int_equal(h.node, DSV4_PREFIX_ROOT);
    assert_int_equal(h.matched_blocks, 3);
    /* the whole chain: restored from block 4's state with every block's entries */
    dsv4_prefix_cache_lookup(c, t, 5 * B, &h);
    assert_int_not_equal(h.node, DSV4_PREFIX_ROOT);
    assert_int_equal(h.n_blocks, 4);
    check_hit(&p, t, &h);
    dsv4_prefix_cache_release(c, h.node);

    /* a later request stopping at block 2 gives that passed node its state */
    p.depth = 1;
    assert_int_equal(dsv4_prefix_cache_extend(c, DSV4_PREFIX_ROOT, t, false, false, save, &p, &at), 0);
    p.depth = 2;
    assert_int_equal(dsv4_prefix_cache_extend(c, at, t + B, true, true, save, &p, &next), 0);
    dsv4_prefix_cache_release(c, at);
    dsv4_prefix_cache_release(c, next);
    dsv4_prefix_cache_lookup(c, u, 5 * B, &h);
    assert_int_equal(h.n_blocks, 2);
    check_hit(&p, t, &h);
    dsv4_prefix_cache_release(c, h.node);
    dsv4_prefix_cache_get_stats(c, &st);
    assert_int_equal(st.nodes, 4);
    assert_int_equal(st.boundaries, 2);
    dsv4_prefix_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lookup),
        cmocka_unit_test(test_passed_blocks),
        cmocka_unit_test(test_partial_and_continue),
        cmocka_unit_test(test_eviction),
        cmocka_unit_test(test_failures),
        cmocka_unit_test(test_prune),
        cmocka_unit_test(test_no_block_pages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
