/* SPDX-License-Identifier: MIT */
/* The CPU reference backend: engine/backend.h's operations over dsv4_cpu_forward. Every slot's
 * caches and scratch, and the worker threads (opts.threads > 1), are set up at create; steps
 * allocate nothing. Slots run one after another, the threads splitting the rows of each big
 * matrix-vector product, so each row's arithmetic is the same whatever the batch or thread count. */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/cpu/cpu_forward.h"
#include "engine/error.h"

#define DSV4_CPU_MAX_BATCH 4096

struct cpu_impl {
    struct dsv4_cpu_pool *pool;     /* NULL with one thread */
    int n_slots;
    struct dsv4_cpu_seq **slots;    /* [max_batch] */
    uint8_t *prefix_pool;           /* [prefix.n_pages, prefix.page_bytes] host memory, or NULL */
    uint64_t *route_counts;         /* [n_layers * n_experts] tokens routed to each expert (slots run in turn) */
    uint64_t bytes;
};

static struct cpu_impl *impl_of(const struct dsv4_backend *b)
{
    return b->impl;
}

static int check_slot(const struct dsv4_backend *b, int slot)
{
    if (slot < 0 || slot >= impl_of(b)->n_slots)
        return dsv4_error_set(-EINVAL, "slot %d is outside [0, %d)", slot, impl_of(b)->n_slots);
    return 0;
}

static int cpu_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits,
                       bool all_rows)
{
    int rc = check_slot(b, slot);
    if (rc < 0)
        return rc;
    return dsv4_cpu_forward(b->weights, b->opts.numerics, impl_of(b)->slots[slot], tokens, n, logits,
                            all_rows);
}

/* A decode batch is checked whole before any slot advances: all of it runs or none. */
static int cpu_decode(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, float *logits)
{
    int64_t V = b->weights->cfg.vocab_size;
    for (int i = 0; i < n; i++) {
        int rc = check_slot(b, slots[i]);
        if (rc < 0)
            return rc;
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return dsv4_error_set(-EINVAL, "slot %d appears twice in one decode batch", slots[i]);
        const struct dsv4_cpu_seq *s = impl_of(b)->slots[slots[i]];
        if (s->pos >= s->max_context)
            return dsv4_error_set(-ENOSPC, "slot %d is full: %lld tokens of max_context %lld", slots[i],
                                  (long long)s->pos, (long long)s->max_context);
        if (tokens[i] < 0 || tokens[i] >= V)
            return dsv4_error_set(-EINVAL, "slot %d: token %d is outside the vocabulary of %lld", slots[i],
                                  tokens[i], (long long)V);
    }
    for (int i = 0; i < n; i++) {
        int rc = dsv4_cpu_forward(b->weights, b->opts.numerics, impl_of(b)->slots[slots[i]], &tokens[i], 1,
                                  logits ? logits + i * V : NULL, false);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* Slots of one speculative call: valid and distinct. */
static int check_slots(const struct dsv4_backend *b, int n, const int *slots, const char *what)
{
    if (!b->spec_tokens)
        return dsv4_error_set(-ENOTSUP, "%s: the backend does not speculate (spec_tokens 0 or no MTP block)", what);
    for (int i = 0; i < n; i++) {
        int rc = check_slot(b, slots[i]);
        if (rc < 0)
            return rc;
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return dsv4_error_set(-EINVAL, "slot %d appears twice in one %s", slots[i], what);
    }
    return 0;
}

static int cpu_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                     int32_t *drafts, int *ret_k)
{
    int rc = check_slots(b, n, slots, "draft");
    for (int i = 0; i < n; i++)
        ret_k[i] = 0;
    for (int i = 0; i < n && rc == 0; i++)
        rc = dsv4_cpu_draft(b->weights, b->opts.numerics, impl_of(b)->slots[slots[i]], tokens[i], k[i],
                            drafts + (size_t)i * (size_t)b->spec_tokens, &ret_k[i]);
    return rc;
}

/* Like decode, the batch is checked whole (slots, rows, room) before any slot advances. */
static int cpu_verify(struct dsv4_backend *b, int n, const int *slots, const int *rows, const int32_t *tokens,
                      float *logits)
{
    int64_t V = b->weights->cfg.vocab_size;
    int stride = b->spec_tokens + 1;
    int rc = check_slots(b, n, slots, "verify");
    if (rc < 0)
        return rc;
    for (int i = 0; i < n; i++) {
        const struct dsv4_cpu_seq *s = impl_of(b)->slots[slots[i]];
        if (rows[i] < 1 || rows[i] > stride)
            return dsv4_error_set(-EINVAL, "slot %d: a verify of %d rows, outside [1, %d]", slots[i], rows[i],
                                  stride);
        if (s->pos + rows[i] > s->max_context)
            return dsv4_error_set(-ENOSPC, "slot %d: %d rows at position %lld exceed max_context %lld", slots[i],
                                  rows[i], (long long)s->pos, (long long)s->max_context);
        for (int j = 0; j < rows[i]; j++)
            if (tokens[i * stride + j] < 0 || tokens[i * stride + j] >= V)
                return dsv4_error_set(-EINVAL, "slot %d: token %d is outside the vocabulary of %lld", slots[i],
                                      tokens[i * stride + j], (long long)V);
    }
    for (int i = 0; i < n; i++) {
        rc = dsv4_cpu_verify(b->weights, b->opts.numerics, impl_of(b)->slots[slots[i]], tokens + i * stride,
                             rows[i], logits + (size_t)i * (size_t)stride * (size_t)V);
        if (rc < 0)
            return rc;
    }
    return 0;
}

static int cpu_accept(struct dsv4_backend *b, int slot, int keep)
{
    int rc = check_slots(b, 1, &slot, "accept");
    return rc < 0 ? rc : dsv4_cpu_accept(impl_of(b)->slots[slot], keep);
}

static void cpu_slot_reset(struct dsv4_backend *b, int slot)
{
    if (check_slot(b, slot) == 0)
        dsv4_cpu_seq_reset(impl_of(b)->slots[slot]);
}

static int64_t cpu_slot_position(const struct dsv4_backend *b, int slot)
{
    int rc = check_slot(b, slot);
    return rc < 0 ? rc : impl_of(b)->slots[slot]->pos;
}

static int cpu_prefix_save(struct dsv4_backend *b, int slot, int block, const int32_t *block_pages,
                           const int32_t *boundary_pages)
{
    int rc = check_slot(b, slot);
    if (rc < 0)
        return rc;
    if (!impl_of(b)->prefix_pool)
        return dsv4_error_set(-ENODEV, "prefix save: the backend has no prefix pool");
    return dsv4_cpu_prefix_save(b->weights, impl_of(b)->slots[slot], impl_of(b)->prefix_pool, &b->prefix, block,
                                block_pages, boundary_pages);
}

/* The scheduler keeps the CPU backend's penalty history itself: tokens are not needed here. */
static int cpu_prefix_load(struct dsv4_backend *b, int slot, int n_blocks, const int32_t *block_pages,
                           const int32_t *boundary_pages, const int32_t *tokens)
{
    (void)tokens;
    int rc = check_slot(b, slot);
    if (rc < 0)
        return rc;
    if (!impl_of(b)->prefix_pool)
        return dsv4_error_set(-ENODEV, "prefix load: the backend has no prefix pool");
    return dsv4_cpu_prefix_load(b->weights, impl_of(b)->slots[slot], impl_of(b)->prefix_pool, &b->prefix, n_blocks,
                                block_pages, boundary_pages);
}

static void cpu_get_stats(const struct dsv4_backend *b, struct dsv4_backend_stats *ret)
{
    memset(ret, 0, sizeof(*ret));       /* no device, no graphs, no routed expert off the host */
    ret->bytes_reserved = impl_of(b)->bytes;
    snprintf(ret->variant, sizeof(ret->variant), "cpu reference fp32, %s numerics, %d thread%s",
             b->opts.numerics == DSV4_NUMERICS_FP8 ? "fp8" : "exact", b->opts.threads > 1 ? b->opts.threads : 1,
             b->opts.threads > 1 ? "s" : "");
}

static int cpu_routing_counts(struct dsv4_backend *b, uint64_t *counts)
{
    const struct dsv4_config *c = &b->weights->cfg;
    memcpy(counts, impl_of(b)->route_counts, sizeof(*counts) * (size_t)c->n_layers * (size_t)c->n_experts);
    return 0;
}

static void cpu_destroy(struct dsv4_backend *b)
{
    struct cpu_impl *im = impl_of(b);
    if (im) {
        for (int i = 0; i < im->n_slots; i++)
            dsv4_cpu_seq_free(im->slots[i]);
        free(im->slots);
        free(im->prefix_pool);
        free(im->route_counts);
        dsv4_cpu_pool_free(im->pool);
        free(im);
    }
    free(b);
}

static const struct dsv4_backend_ops cpu_ops = {
    .name = "cpu",
    .prefill = cpu_prefill,
    .decode = cpu_decode,
    .slot_reset = cpu_slot_reset,
    .slot_position = cpu_slot_position,
    .get_stats = cpu_get_stats,
    .routing_counts = cpu_routing_counts,
    .destroy = cpu_destroy,
    .prefix_save = cpu_prefix_save,
    .prefix_load = cpu_prefix_load,
    .draft = cpu_draft,
    .verify = cpu_verify,
    .accept = cpu_accept,
};

static int cpu_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts, struct dsv4_backend **ret)
{
    if (opts->max_batch < 1 || opts->max_batch > DSV4_CPU_MAX_BATCH)
        return dsv4_error_set(-EINVAL, "max_batch %d is outside [1, %d]", opts->max_batch, DSV4_CPU_MAX_BATCH);
    if (opts->threads < 0 || opts->threads > DSV4_CPU_MAX_THREADS)
        return dsv4_error_set(-EINVAL, "threads %d is outside [0, %d]", opts->threads, DSV4_CPU_MAX_THREADS);
    if (opts->numerics != DSV4_NUMERICS_EXACT && opts->numerics != DSV4_NUMERICS_FP8)
        return dsv4_error_set(-EINVAL, "unknown numerics %d", (int)opts->numerics);
    if (opts->spec_tokens < 0 || opts->spec_tokens > DSV4_SPEC_TOKENS_MAX)
        return dsv4_error_set(-EINVAL, "spec_tokens %d is outside [0, %d]", opts->spec_tokens, DSV4_SPEC_TOKENS_MAX);
    struct dsv4_backend *b = calloc(1, sizeof(*b));
    struct cpu_impl *im = calloc(1, sizeof(*im));
    if (b)
        b->impl = im;
    if (!b || !im || !(im->slots = calloc((size_t)opts->max_batch, sizeof(*im->slots)))) {
        free(im);
        free(b);
        return dsv4_error_set(-ENOMEM, "out of memory");
    }
    b->ops = &cpu_ops;
    b->weights = w;
    b->opts = *opts;
    b->spec_tokens = w->n_mtp > 0 ? opts->spec_tokens : 0;
    im->route_counts = calloc((size_t)w->cfg.n_layers * (size_t)w->cfg.n_experts, sizeof(*im->route_counts));
    if (!im->route_counts) {
        cpu_destroy(b);
        return dsv4_error_set(-ENOMEM, "out of memory for the routing counts");
    }
    if (opts->threads > 1) {
        int rc = dsv4_cpu_pool_create(opts->threads, dsv4_cpu_max_linear_in(w), &im->pool);
        if (rc < 0) {
            cpu_destroy(b);
            return rc;
        }
    }
    for (int i = 0; i < opts->max_batch; i++) {
        int rc = dsv4_cpu_seq_create(w, opts->max_context, &im->slots[i]);
        if (rc < 0) {
            cpu_destroy(b);
            return dsv4_error_prefix(rc, "slot %d: ", i);
        }
        im->slots[i]->pool = im->pool;
        im->slots[i]->route_counts = im->route_counts;
        im->n_slots = i + 1;
        if (b->spec_tokens && (rc = dsv4_cpu_seq_spec_init(w, im->slots[i], b->spec_tokens)) < 0) {
            cpu_destroy(b);
            return dsv4_error_prefix(rc, "slot %d: ", i);
        }
        im->bytes += im->slots[i]->bytes;
    }
    int rc = dsv4_cpu_prefix_geom(w, im->slots[0], opts->prefix_pool_bytes, &b->prefix);
    if (rc == 0 && b->prefix.n_pages > 0) {
        /* calloc: the pages stay untouched (not resident) until snapshots fill them */
        size_t bytes = (size_t)b->prefix.n_pages * (size_t)b->prefix.page_bytes;
        im->prefix_pool = calloc(1, bytes);
        if (!im->prefix_pool)
            rc = dsv4_error_set(-ENOMEM, "out of memory for a prefix pool of %zu bytes", bytes);
        im->bytes += bytes;
    }
    if (rc < 0) {
        cpu_destroy(b);
        return rc;
    }
    *ret = b;
    return 0;
}

int dsv4_backend_cpu_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                            struct dsv4_backend **ret)
{
    int rc = cpu_create(w, opts, ret);

    return rc < 0 ? dsv4_error_prefix(rc, "CPU backend: ") : 0;
}
