/* SPDX-License-Identifier: MIT */
/* Test helper: the seed of a randomized test program. Header-only so each test program includes what it
 * needs. */
#ifndef DSV4_TESTS_SEED_UTIL_H
#define DSV4_TESTS_SEED_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

/* DSV4_TEST_SEED when set, else fresh from the time and pid (never 0, which the xorshift generators
 * cannot leave); printed so a failing run can be reproduced. */
static inline uint64_t dsv4_test_seed(void)
{
    const char *env = getenv("DSV4_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid();

    if (!seed)
        seed = 1;
    print_message("seed %llu (DSV4_TEST_SEED reproduces)\n", (unsigned long long)seed);
    return seed;
}

#endif
