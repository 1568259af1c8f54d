/* SPDX-License-Identifier: MIT */
/* Test helper shared by the prefix-cache tests of both backends (tests/unit/test_prefix_cpu.c,
 * tests/gpu/test_gpu_prefix.c): deterministic prompts, greedy argmax, and a prefill-then-decode run
 * whose every logits row is kept. Header-only so each test program includes what it needs. */
#ifndef DSV4_TESTS_PREFIX_UTIL_H
#define DSV4_TESTS_PREFIX_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/backend.h"

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

#endif
