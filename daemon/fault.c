/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>

#include "daemon/fault.h"
#include "daemon/log.h"
#include "engine/error.h"

#define DSV4_FAULT_ENV "DSV4_TEST_FAULT_AFTER_DECODES"

struct fault_impl {
    struct dsv4_backend *inner;
    struct dsv4_backend_ops ops;
    long long decodes_left;
    bool faulted;
};

static int fault(struct fault_impl *f)
{
    f->faulted = true;
    return dsv4_error_set(-ENOTRECOVERABLE, "injected device fault (%s)", DSV4_FAULT_ENV);
}

static int f_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits, bool all_rows)
{
    struct fault_impl *f = b->impl;
    return f->faulted ? fault(f) : f->inner->ops->prefill(f->inner, slot, tokens, n, logits, all_rows);
}

static int f_decode(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, float *logits)
{
    struct fault_impl *f = b->impl;
    if (f->faulted || f->decodes_left-- <= 0)
        return fault(f);
    return f->inner->ops->decode(f->inner, n, slots, tokens, logits);
}

/* Speculative decoding: a verify is the decode of its step and counts as one. */
static int f_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k, int32_t *drafts,
                   int *ret_k)
{
    struct fault_impl *f = b->impl;
    return f->faulted ? fault(f) : f->inner->ops->draft(f->inner, n, slots, tokens, k, drafts, ret_k);
}

static int f_verify(struct dsv4_backend *b, int n, const int *slots, const int *rows, const int32_t *tokens,
                    float *logits)
{
    struct fault_impl *f = b->impl;
    if (f->faulted || f->decodes_left-- <= 0)
        return fault(f);
    return f->inner->ops->verify(f->inner, n, slots, rows, tokens, logits);
}

static int f_accept(struct dsv4_backend *b, int slot, int keep)
{
    struct fault_impl *f = b->impl;
    return f->faulted ? fault(f) : f->inner->ops->accept(f->inner, slot, keep);
}

static int f_sample(struct dsv4_backend *b, int n, const struct dsv4_backend_sample_req *req, struct dsv4_sample *out,
                    int *rc, char *msgs)
{
    struct fault_impl *f = b->impl;
    return f->faulted ? fault(f) : f->inner->ops->sample(f->inner, n, req, out, rc, msgs);
}

static int f_prefix_save(struct dsv4_backend *b, int slot, int block, const int32_t *block_pages,
                         const int32_t *boundary_pages)
{
    struct fault_impl *f = b->impl;
    return f->faulted ? fault(f) : f->inner->ops->prefix_save(f->inner, slot, block, block_pages, boundary_pages);
}

static int f_prefix_load(struct dsv4_backend *b, int slot, int n_blocks, const int32_t *block_pages,
                         const int32_t *boundary_pages, const int32_t *tokens)
{
    struct fault_impl *f = b->impl;
    return f->faulted ? fault(f)
                      : f->inner->ops->prefix_load(f->inner, slot, n_blocks, block_pages, boundary_pages, tokens);
}

static void f_slot_reset(struct dsv4_backend *b, int slot)
{
    struct fault_impl *f = b->impl;
    f->inner->ops->slot_reset(f->inner, slot);
}

static int64_t f_slot_position(const struct dsv4_backend *b, int slot)
{
    const struct fault_impl *f = b->impl;
    return f->inner->ops->slot_position(f->inner, slot);
}

static void f_get_stats(const struct dsv4_backend *b, struct dsv4_backend_stats *ret)
{
    const struct fault_impl *f = b->impl;
    f->inner->ops->get_stats(f->inner, ret);
}

static int f_routing_counts(struct dsv4_backend *b, uint64_t *counts)
{
    struct fault_impl *f = b->impl;
    return f->inner->ops->routing_counts(f->inner, counts);
}

static void f_destroy(struct dsv4_backend *b)
{
    struct fault_impl *f = b->impl;
    dsv4_backend_destroy(f->inner);
    free(f);
    free(b);
}

int dsv4_fault_wrap_from_env(struct dsv4_backend **b)
{
    const char *v = getenv(DSV4_FAULT_ENV);
    char *end;
    if (!v || !*v)
        return 0;
    long long n = strtoll(v, &end, 10);
    if (*end || n < 0)
        return dsv4_error_set(-EINVAL, "%s=%s: not a count of decode calls", DSV4_FAULT_ENV, v);
    struct dsv4_backend *w = calloc(1, sizeof(*w));
    struct fault_impl *f = calloc(1, sizeof(*f));
    if (!w || !f) {
        free(w);
        free(f);
        return dsv4_error_set(-ENOMEM, "%s: out of memory", DSV4_FAULT_ENV);
    }
    const struct dsv4_backend_ops *in = (*b)->ops;
    f->inner = *b;
    f->decodes_left = n;
    /* Optional ops stay absent when the wrapped backend has none. */
    f->ops = (struct dsv4_backend_ops){
        .name = in->name,
        .prefill = f_prefill,
        .decode = f_decode,
        .sample = in->sample ? f_sample : NULL,
        .slot_reset = f_slot_reset,
        .slot_position = f_slot_position,
        .get_stats = f_get_stats,
        .routing_counts = in->routing_counts ? f_routing_counts : NULL,
        .destroy = f_destroy,
        .prefix_save = in->prefix_save ? f_prefix_save : NULL,
        .prefix_load = in->prefix_load ? f_prefix_load : NULL,
        .draft = in->draft ? f_draft : NULL,
        .verify = in->verify ? f_verify : NULL,
        .accept = in->accept ? f_accept : NULL,
    };
    *w = **b;
    w->ops = &f->ops;
    w->impl = f;
    *b = w;
    dsv4_log_warning("%s=%lld: the %s backend fails as a faulted GPU after %lld decode calls (a test switch)",
                     DSV4_FAULT_ENV, n, in->name, n);
    return 0;
}
