/* SPDX-License-Identifier: MIT */
/* Greedy generation over a backend's ops: dsv4-run's --model mode, and the fixture tests, which check
 * this same loop bitwise against the direct CPU forward. Header-only so both include it. */
#ifndef DSV4_TOOLS_GREEDY_H
#define DSV4_TOOLS_GREEDY_H

#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"

/* First index of the largest value, like torch.argmax (the fixtures' greedy tokens are torch's). */
static inline int32_t dsv4_greedy_argmax(const float *row, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (row[i] > row[best])
            best = i;
    return best;
}

/* Prefill ids[0, P) into slot in chunks of chunk tokens (one shot when 0), then decode steps, step i fed
 * the argmax of the previous row and stored in ids[P + i]. ids: [P + decode]; logits: [P + decode, V].
 * Returns 0, or the first nonzero status of a backend op (a negative errno; dsv4_error_message() says why). */
static inline int dsv4_greedy_generate(struct dsv4_backend *b, int slot, int32_t *ids, int P, int decode,
                                       int chunk, float *logits)
{
    int V = b->weights->cfg.vocab_size;
    int step = chunk ? chunk : P;
    for (int start = 0; start < P; start += step) {
        int n = P - start < step ? P - start : step;
        int rc = b->ops->prefill(b, slot, ids + start, n, logits + (size_t)start * V, true);
        if (rc)
            return rc;
    }
    for (int i = 0; i < decode; i++) {
        int32_t next = dsv4_greedy_argmax(logits + (size_t)(P + i - 1) * V, V);
        ids[P + i] = next;
        int rc = b->ops->decode(b, 1, &slot, &next, logits + (size_t)(P + i) * V);
        if (rc)
            return rc;
    }
    return 0;
}

#endif
