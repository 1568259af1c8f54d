/* SPDX-License-Identifier: MIT */
/* The CUDA backend's prefix-cache pool (kernels/prefix.cu): engine/backend.h's block and boundary
 * records, copied device to device between a slot's caches (the layout kernels/step.cu gives them)
 * and pages of a pool carved from the device arena at boot. C interface; pointers named d_* and the
 * caches are device pointers, `stream` is a cudaStream_t passed as void *. */
#ifndef DSV4_KERNELS_PREFIX_H
#define DSV4_KERNELS_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"
#include "engine/model/config.h"
#include "kernels/dsv4cuda.h"
#include "kernels/sample.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_CUDA_PREFIX_DESCS 4096     /* copies per launch (a restore of more launches again) */
#define DSV4_CUDA_PREFIX_TOKENS 4096    /* prompt tokens marked seen per history launch */

struct dsv4_cuda_prefix;

/* Arena bytes of the pool (opts->prefix_pool_bytes rounded down to whole pages) and its copy
 * tables; 0 when the pool is 0. -errno (as a negative value) when the pool cannot hold one
 * snapshot. */
int64_t dsv4_cuda_prefix_bytes(const struct dsv4_config *c, const struct dsv4_backend_opts *o);

/* Boot (before the arena is sealed): carve the pool and its tables, fill *ret_geom (n_pages 0 and
 * *ret NULL when the pool is 0). caches: slot 0 of the step's caches, slots of slot_bytes; pos: the
 * step's host positions per slot, which load and save read and load sets; hist: the slots' penalty
 * histories, where load marks the restored tokens seen. */
int dsv4_cuda_prefix_create(struct dsv4_cuda_dev *dev, const struct dsv4_config *c, const struct dsv4_backend_opts *o,
                            uint8_t *caches, int64_t slot_bytes, int64_t *pos, const struct dsv4_sample_history *hist,
                            struct dsv4_prefix_geom *ret_geom, struct dsv4_cuda_prefix **ret);
void dsv4_cuda_prefix_free(struct dsv4_cuda_prefix *p);    /* accepts NULL; the arena keeps the memory */

/* engine/backend.h's prefix_save and prefix_load, on the device's stream. */
int dsv4_cuda_prefix_save(struct dsv4_cuda_prefix *p, int slot, int block, const int32_t *block_pages,
                          const int32_t *boundary_pages);
int dsv4_cuda_prefix_load(struct dsv4_cuda_prefix *p, int slot, int n_blocks, const int32_t *block_pages,
                          const int32_t *boundary_pages, const int32_t *tokens);

#ifdef __cplusplus
}
#endif

#endif
