/* SPDX-License-Identifier: MIT */
/* The daemon's one clock: CLOCK_MONOTONIC in nanoseconds (request timings, idle and stall limits,
 * uptime). Header-only so every daemon module may use it without depending on another. */
#ifndef DSV4_DAEMON_CLOCK_H
#define DSV4_DAEMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t dsv4_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif
