/* The operations one engine step needs, implemented by the CPU reference backend and the CUDA
 * backend. A backend owns `max_batch` sequence slots, each sized for `max_context` tokens, all
 * allocated at create time: nothing is allocated per request or per step afterwards. */
#ifndef DSV4_ENGINE_BACKEND_H
#define DSV4_ENGINE_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/sampler.h"
#include "engine/weights.h"

enum dsv4_numerics {
    DSV4_NUMERICS_EXACT,    /* caches in f32, no rounding: what transformers' deepseek_v4 computes */
    DSV4_NUMERICS_FP8,      /* official: FP8 KV (448 non-RoPE dims, 1x64 UE8M0), Hadamard+FP4 indexer */
};

struct dsv4_backend_opts {
    int max_batch;              /* slots */
    int max_context;            /* tokens per slot */
    enum dsv4_numerics numerics;
    int threads;                /* CPU backend worker threads; 0 = one */
};

struct dsv4_backend_stats {
    uint64_t device_allocs;     /* allocations made since create (must stay flat after boot) */
    uint64_t graph_captures;
    uint64_t bytes_reserved;    /* caches + workspaces */
    char variant[192];          /* kernels in use, for stats and logs */
};

struct dsv4_backend;

/* One row for a backend that samples where its logits are (the optional `sample` op). */
struct dsv4_backend_sample_req {
    int slot;
    const struct dsv4_sampling *params;     /* validated by the caller */
    uint64_t seed;                          /* Philox key */
    uint64_t index;                         /* output index of the token (0 for the first) */
};

#define DSV4_BACKEND_MSG_MAX 160            /* a row's error message, with its terminating NUL */

struct dsv4_backend_ops {
    const char *name;           /* "cpu", "cuda" */
    /* Append n tokens to `slot` at its current position (chunked prefill: call again with the
     * next chunk). logits: [n, V] f32 when all_rows, else [V] for the last token only; may be NULL. */
    int (*prefill)(struct dsv4_backend *b, int slot, const int32_t *tokens, int n,
                   float *logits, bool all_rows);
    /* One token for each of n slots (distinct); logits [n, V] f32, row i for slots[i]. */
    int (*decode)(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens,
                  float *logits);
    /* Optional (NULL: the engine samples the copied-back logits on the host, engine/sampler.c).
     * Sample the rows of the call just made, without copying logits back: after prefill, n == 1
     * and req[0].slot is that prefill's slot (its last prompt token); after decode, the decode's n
     * rows in its order. Same semantics as dsv4_sampler_sample; the backend keeps each slot's
     * penalty history itself (prefill marks prompt tokens seen, sampled tokens are counted,
     * slot_reset clears it). rc[i]: 0, or -errno with msgs + i * DSV4_BACKEND_MSG_MAX saying why
     * (a non-finite logit, ...); the return value is for failures of the whole call. */
    int (*sample)(struct dsv4_backend *b, int n, const struct dsv4_backend_sample_req *req,
                  struct dsv4_sample *out, int *rc, char *msgs);
    /* Forget slot's sequence (position 0, caches cleared logically). */
    void (*slot_reset)(struct dsv4_backend *b, int slot);
    int64_t (*slot_position)(const struct dsv4_backend *b, int slot);
    void (*get_stats)(const struct dsv4_backend *b, struct dsv4_backend_stats *ret);
    void (*destroy)(struct dsv4_backend *b);
};

struct dsv4_backend {
    const struct dsv4_backend_ops *ops;
    const struct dsv4_weights *weights;
    struct dsv4_backend_opts opts;
    void *impl;
};

/* The CPU reference backend. */
int dsv4_backend_cpu_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                            struct dsv4_backend **ret);
/* The CUDA backend (built with --with-cuda; returns -ENODEV with a reason when no usable GPU). */
int dsv4_backend_cuda_create(const struct dsv4_weights *w, const struct dsv4_backend_opts *opts,
                             struct dsv4_backend **ret);

static inline void dsv4_backend_destroy(struct dsv4_backend *b)
{
    if (b)
        b->ops->destroy(b);
}

#endif
