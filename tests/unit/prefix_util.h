/* SPDX-License-Identifier: MIT */
/* Test helper shared by the prefix-cache tests of both backends (tests/unit/test_prefix_cpu.c,
 * tests/gpu/test_gpu_prefix.c): deterministic prompts, greedy argmax, and a prefill-then-decode run
 * whose every logits row is kept. Header-only so each test program includes what it needs. */
#ifndef DSV4_TESTS_PREFIX_UTIL_H
#define DSV4_TESTS_PREFIX_UTIL_H

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"

/* t[i] for a prompt of n tokens below vocab; salt picks one of many. */
static inline void prefix_tokens(int32_t *t, int n, int vocab, int salt)
{
    for (int i = 0; i < n; i++)
        t[i] = (int32_t)((i * 37 + salt * 101 + (i * i) % 13 + 5) % vocab);
}

/* The index of the largest value (the lowest index on ties). */
static inline int prefix_argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* Prefill rows [from, n) of t into slot (all logits), then `dec` greedy decode steps; logits of
 * every row into out [n - from + dec, V]. */
static inline void prefix_run_rest(struct dsv4_backend *b, int slot, const int32_t *t, int from, int n, int dec,
                                   float *out)
{
    const int V = b->weights->cfg.vocab_size;
    assert_int_equal(b->ops->prefill(b, slot, t + from, n - from, out, true), 0);
    float *row = out + (size_t)(n - from - 1) * V;
    for (int i = 0; i < dec; i++) {
        int32_t next = prefix_argmax(row, V);
        assert_int_equal(b->ops->decode(b, 1, &slot, &next, row + V), 0);
        row += V;
    }
}

#define PREFIX_OK(call)                                                                        \
    do {                                                                                       \
        int rc_ = (call);                                                                      \
        if (rc_ != 0)                                                                          \
            fail_msg("%s = %d: %s", #call, rc_, dsv4_error_message());                         \
    } while (0)

typedef int (*prefix_create_fn)(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                                struct dsv4_backend **ret);

/* One sequence of 4.5 blocks on a backend made by create (bo: its options, max_context set here)
 * without a pool, then on one with pool_bytes: snapshotted at every block boundary (pages taken from
 * the top of the pool down, so a record's pages are never adjacent in order), and once more at the
 * last with every block's entries saved there (as a prefill chunk past several boundaries saves
 * them), the source continued, and each snapshot restored into slot 1 and continued (prefill of the
 * rest, then 3 decode steps): every logit bit-identical to the cold run's; a save off a boundary, of
 * a block not yet reached, of a boundary with an earlier block, and a load into a busy slot refused.
 * check (or NULL) sees the pooled backend before it is destroyed. */
static inline void prefix_backend_case(struct dsv4_weights *w, const char *name, struct dsv4_backend_opts bo,
                                       int64_t pool_bytes, prefix_create_fn create,
                                       void (*check)(struct dsv4_backend *b))
{
    const int V = w->cfg.vocab_size, B = dsv4_config_prefix_block(&w->cfg), dec = 3;
    assert_true(B > 0);
    const int blocks = 4, n = blocks * B + B / 2 + 1;
    const char *num = bo.numerics == DSV4_NUMERICS_FP8 ? "fp8" : "exact";
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    float *cold = malloc(sizeof(float) * (size_t)(n + dec) * (size_t)V);
    float *warm = malloc(sizeof(float) * (size_t)(n + dec) * (size_t)V);
    assert_non_null(t);
    assert_non_null(cold);
    assert_non_null(warm);
    prefix_tokens(t, n, V, 1);

    struct dsv4_backend *plain, *b;
    bo.max_context = n + dec + B;
    bo.prefix_pool_bytes = 0;
    PREFIX_OK(create(w, &bo, &plain));
    assert_int_equal(plain->prefix.n_pages, 0);
    prefix_run_rest(plain, 0, t, 0, n, dec, cold);
    dsv4_backend_destroy(plain);

    bo.prefix_pool_bytes = pool_bytes;
    PREFIX_OK(create(w, &bo, &b));
    const struct dsv4_prefix_geom *g = &b->prefix;
    assert_int_equal(g->block, B);
    assert_true(g->n_pages >= blocks * (2 * g->block_pages + g->boundary_pages) + g->boundary_pages);
    printf("# %s, %s numerics: blocks of %d tokens, pages of %lld bytes, a block's entries %d page(s), a boundary "
           "%d\n", name, num, B, (long long)g->page_bytes, g->block_pages, g->boundary_pages);
    int32_t blk[16], bnd[16][64];
    assert_true(blocks <= 16 && g->boundary_pages <= 64 && g->block_pages <= 1);
    int32_t next_page = g->n_pages - 1;
    for (int k = 0; k < blocks; k++) {
        PREFIX_OK(b->ops->prefill(b, 0, t + k * B, B, NULL, false));
        blk[k] = next_page;
        next_page -= g->block_pages;
        for (int j = 0; j < g->boundary_pages; j++)
            bnd[k][j] = next_page--;
        PREFIX_OK(b->ops->prefix_save(b, 0, k, g->block_pages ? &blk[k] : NULL, bnd[k]));
    }
    assert_int_equal(b->ops->prefix_save(b, 1, 0, blk, bnd[0]), -EINVAL);     /* slot 1 is at 0 */
    assert_int_equal(b->ops->prefix_save(b, 0, blocks, blk, NULL), -EINVAL);  /* not reached yet */
    assert_int_equal(b->ops->prefix_save(b, 0, 0, blk, bnd[0]), -EINVAL);     /* a boundary is the last block's */
    /* every block's entries again, now that the slot has gone past them, and the state at the end */
    int32_t late_blk[16], late_bnd[64];
    for (int k = 0; k < blocks; k++) {
        late_blk[k] = next_page;
        next_page -= g->block_pages;
        PREFIX_OK(b->ops->prefix_save(b, 0, k, g->block_pages ? &late_blk[k] : NULL, NULL));
    }
    for (int j = 0; j < g->boundary_pages; j++)
        late_bnd[j] = next_page--;
    PREFIX_OK(b->ops->prefix_save(b, 0, blocks - 1, NULL, late_bnd));

    /* the source continues as if nothing was copied */
    prefix_run_rest(b, 0, t, blocks * B, n, dec, warm);
    assert_memory_equal(warm, cold + (size_t)blocks * B * V, sizeof(float) * (size_t)(n - blocks * B + dec) * V);

    for (int r = 1; r <= blocks + 1; r++) {
        const bool late = r > blocks;       /* the late saves, restored whole */
        const int k = late ? blocks : r;
        b->ops->slot_reset(b, 1);
        PREFIX_OK(b->ops->prefix_load(b, 1, k, late ? late_blk : blk, late ? late_bnd : bnd[k - 1], t));
        assert_int_equal(b->ops->slot_position(b, 1), k * B);
        assert_int_equal(b->ops->prefix_load(b, 1, k, blk, bnd[k - 1], t), -EBUSY);
        prefix_run_rest(b, 1, t, k * B, n, dec, warm);
        const size_t rows = (size_t)(n - k * B + dec);
        if (memcmp(warm, cold + (size_t)k * B * V, sizeof(float) * rows * V) != 0)
            fail_msg("%s (%s numerics): restored after %d blocks of %d%s, the logits differ from cold", name, num, k,
                     B, late ? " (saved after the slot went past them)" : "");
    }
    if (check)
        check(b);
    dsv4_backend_destroy(b);
    free(t);
    free(cold);
    free(warm);
}

#endif
