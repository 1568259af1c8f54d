/* SPDX-License-Identifier: MIT */
/* Request memory: connection buffers and per-request state live in their own jemalloc arena, so
 * their footprint is measured apart from the engine's boot-time allocations and a burst of clients
 * cannot fragment the engine's heap. Without jemalloc (sanitizer builds) this is plain malloc. */
#ifndef DSV4_DAEMON_REQMEM_H
#define DSV4_DAEMON_REQMEM_H

#include <stddef.h>
#include <stdint.h>

struct dsv4_reqmem_stats {
    const char *allocator;      /* "jemalloc <version>" or "libc" */
    unsigned arena;             /* the request arena's index (jemalloc only) */
    uint64_t arena_allocated;   /* bytes in the request arena (jemalloc only) */
    uint64_t allocated, active, resident, mapped, retained;   /* whole process (jemalloc only) */
};

/* Create the arena and bind the calling thread (the io thread) to it, so that its plain malloc()
 * calls use it too. Once, before any other call, before other threads start. Returns 0 or -errno. */
int dsv4_reqmem_init(void);

void *dsv4_reqmem_alloc(size_t size);
void *dsv4_reqmem_calloc(size_t n, size_t size);
void *dsv4_reqmem_realloc(void *p, size_t size);
void dsv4_reqmem_free(void *p);

void dsv4_reqmem_get_stats(struct dsv4_reqmem_stats *ret);

#endif
