/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "daemon/reqmem.h"
#include "engine/error.h"

#ifdef HAVE_JEMALLOC

static unsigned reqmem_arena;
static int reqmem_flags;        /* MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE; 0 before init */

int dsv4_reqmem_init(void)
{
    size_t sz = sizeof(reqmem_arena);
    int r = mallctl("arenas.create", &reqmem_arena, &sz, NULL, 0);
    if (r)
        return dsv4_error_set(-r, "jemalloc: creating the request arena: %s", strerror(r));
    /* No thread cache: a request's memory goes back to its arena when freed, whichever thread frees it. */
    reqmem_flags = MALLOCX_ARENA(reqmem_arena) | MALLOCX_TCACHE_NONE;
    /* What libraries allocate on the io thread (frame buffers, msgpack zones, prompt ids) is request
     * memory too: bind the calling thread to the arena so plain malloc() lands there. */
    r = mallctl("thread.arena", NULL, NULL, &reqmem_arena, sizeof(reqmem_arena));
    if (r)
        return dsv4_error_set(-r, "jemalloc: binding the io thread to arena %u: %s", reqmem_arena, strerror(r));
    return 0;
}

void *dsv4_reqmem_alloc(size_t size)
{
    return mallocx(size ? size : 1, reqmem_flags);
}

void *dsv4_reqmem_calloc(size_t n, size_t size)
{
    if (size && n > SIZE_MAX / size)
        return NULL;
    size_t total = n * size;
    return mallocx(total ? total : 1, reqmem_flags | MALLOCX_ZERO);
}

void *dsv4_reqmem_realloc(void *p, size_t size)
{
    if (!p)
        return dsv4_reqmem_alloc(size);
    return rallocx(p, size ? size : 1, reqmem_flags);
}

void dsv4_reqmem_free(void *p)
{
    if (p)
        dallocx(p, reqmem_flags);
}

static uint64_t ctl_size(const char *name)
{
    size_t v = 0, sz = sizeof(v);
    if (mallctl(name, &v, &sz, NULL, 0))
        return 0;
    return v;
}

void dsv4_reqmem_get_stats(struct dsv4_reqmem_stats *ret)
{
    static char allocator[64];
    const char *version = NULL;
    size_t sz = sizeof(version);
    uint64_t epoch = 1;
    size_t esz = sizeof(epoch);
    char name[96];

    memset(ret, 0, sizeof(*ret));
    mallctl("version", &version, &sz, NULL, 0);
    snprintf(allocator, sizeof(allocator), "jemalloc %s", version ? version : "");
    ret->allocator = allocator;
    /* Statistics are cached; bumping the epoch refreshes them. */
    mallctl("epoch", &epoch, &esz, &epoch, esz);
    ret->allocated = ctl_size("stats.allocated");
    ret->active = ctl_size("stats.active");
    ret->resident = ctl_size("stats.resident");
    ret->mapped = ctl_size("stats.mapped");
    ret->retained = ctl_size("stats.retained");
    if (reqmem_flags) {
        ret->arena = reqmem_arena;
        snprintf(name, sizeof(name), "stats.arenas.%u.small.allocated", reqmem_arena);
        ret->arena_allocated = ctl_size(name);
        snprintf(name, sizeof(name), "stats.arenas.%u.large.allocated", reqmem_arena);
        ret->arena_allocated += ctl_size(name);
    }
}

#else

int dsv4_reqmem_init(void)
{
    return 0;
}

void *dsv4_reqmem_alloc(size_t size)
{
    return malloc(size ? size : 1);
}

void *dsv4_reqmem_calloc(size_t n, size_t size)
{
    return calloc(n ? n : 1, size ? size : 1);
}

void *dsv4_reqmem_realloc(void *p, size_t size)
{
    return realloc(p, size ? size : 1);
}

void dsv4_reqmem_free(void *p)
{
    free(p);
}

void dsv4_reqmem_get_stats(struct dsv4_reqmem_stats *ret)
{
    memset(ret, 0, sizeof(*ret));
    ret->allocator = "libc";
}

#endif
