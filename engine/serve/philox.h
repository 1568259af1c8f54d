/* SPDX-License-Identifier: MIT */
/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
 * counter-based generator. The output is a pure function of (counter, key), so a request's random
 * draws depend only on its seed and the draw's index, never on what ran before or beside it. */
#ifndef DSV4_ENGINE_SERVE_PHILOX_H
#define DSV4_ENGINE_SERVE_PHILOX_H

#include <stdint.h>

/* Ten rounds over a 128-bit counter with a 64-bit key. */
void dsv4_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* A uniform double in [0, 1) with 53 random bits, for draw `index` of stream `stream` under `seed`:
 * counter (index low, index high, stream, 0), key (seed low, seed high). */
double dsv4_philox_uniform(uint64_t seed, uint64_t index, uint32_t stream);

#endif
