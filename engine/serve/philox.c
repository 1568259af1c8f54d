/* SPDX-License-Identifier: MIT */
/* Philox4x32-10: four 32-bit lanes, two multiplications per round, ten rounds, key bumped by the
 * Weyl constants between rounds. */
#include "build-config.h"

#include "engine/serve/philox.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u   /* golden ratio */
#define PHILOX_W1 0xBB67AE85u   /* sqrt(3) - 1 */
#define PHILOX_ROUNDS 10

void dsv4_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];

    for (int r = 0; r < PHILOX_ROUNDS; r++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

double dsv4_philox_uniform(uint64_t seed, uint64_t index, uint32_t stream)
{
    const uint32_t ctr[4] = { (uint32_t)index, (uint32_t)(index >> 32), stream, 0 };
    const uint32_t key[2] = { (uint32_t)seed, (uint32_t)(seed >> 32) };
    uint32_t out[4];

    dsv4_philox4x32_10(ctr, key, out);
    /* 53 bits: 27 from out[0], 26 from out[1] -> [0, 2^53) / 2^53 */
    uint64_t bits = ((uint64_t)(out[0] >> 5) << 26) | (out[1] >> 6);
    return (double)bits * (1.0 / 9007199254740992.0);
}
