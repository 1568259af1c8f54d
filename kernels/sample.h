/* SPDX-License-Identifier: MIT */
/* Sampling on the device: engine/serve/sampler.c's ten steps (numbered in engine/serve/sampler.h) for `rows`
 * rows of logits at once, so the CUDA backend copies back one small result per row instead of
 * [rows, V] logits. C interface: callers need no CUDA headers; pointers named d_* are device
 * pointers, `stream` is a cudaStream_t passed as void *. Launchers return 0 or -errno with
 * dsv4_error_set().
 *
 * Same steps, same order, same tie rules as the CPU sampler:
 *   - logprobs (step 1) come from log_softmax of the raw row; top-n ids are identical to the CPU's
 *     (pure comparisons of the same floats, ties to the lower id);
 *   - penalties and temperature (steps 2, 3, 5) are the CPU's float operations, rounded the same
 *     way, so the working logits l, the greedy token (step 4) and the top_k set (step 6) are
 *     bit-identical to the CPU's;
 *   - the draw u (step 10) is the same Philox4x32-10 value, keyed by (seed, index).
 * Where it can differ: probabilities are expf(l - max) from CUDA's expf, which may differ from
 * glibc's in the last bit or two (relative 2.4e-7 at most), and every sum of probabilities (the
 * log-sum-exp of step 1 and the masses of steps 7-10) is an exact integer sum in 2^-41 fixed point
 * (each probability rounded by at most 2^-42, so a sum of n differs from the CPU's double sum by at
 * most n * 2^-42 of the largest probability, under 3e-8 at V = 129280; exact integers make every sum
 * independent of order and of how a row is split over blocks). So a top_p boundary, a min_p cut or
 * the drawn token can differ from the CPU's only when the CPU's running sum (or probability) lies
 * within those error bounds of the threshold it is compared with; tests/gpu/test_gpu_sample.c
 * counts such draws. Reported logprobs differ from the CPU's by about 1e-7.
 *
 * Each row is a cluster of up to 8 thread blocks (sm_90 and later; one block on older images),
 * more blocks a row when the launch has fewer rows. A row's result depends only on that row, its
 * parameters, its history slot, its seed and its index: sums are exact integers and the other
 * reductions max / min, so a row sampled alone gives bit for bit what it gives inside any batch.
 * Per-row variations (greedy or not, truncations, penalties) live in device memory: the launch
 * shape depends only on `rows`, so one launch can be captured in a CUDA graph per batch bucket. The
 * launcher allocates nothing, synchronizes nothing, and needs no workspace: all per-row scratch
 * (coarse histograms, candidate lists, tile sums) is shared memory, DSV4_SAMPLE_SMEM_BYTES a block.
 *
 * Cost: every row reads its logits twice (max, then log-sum-exp with 2048 coarse bins of 1/64
 * logit below the row's max); top_k / top_p / logprobs gather the boundary bin's tokens in a third
 * pass and sort only them; a sampled row then makes one pass to draw. Rows whose boundary bin holds
 * more than DSV4_SAMPLE_LIST_MAX tokens (thousands of logits within 1/64 of each other) fall back
 * to a bitwise search over the bin, two key bits a pass: correct, but many passes (milliseconds at
 * V = 129280). */
#ifndef DSV4_KERNELS_SAMPLE_H
#define DSV4_KERNELS_SAMPLE_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "engine/error.h"
#include "engine/serve/sampler.h"     /* DSV4_SAMPLER_LOGPROBS_MAX, DSV4_SAMPLER_VOCAB_MAX, dsv4_sampling */

#define DSV4_SAMPLE_LIST_MAX 4096       /* boundary-bin tokens sorted in shared memory */
#define DSV4_SAMPLE_SMEM_BYTES (96 * 1024)      /* upper bound of one block's shared memory */

/* Per-row parameters, an array [rows] in device memory (dsv4_sample_row_set fills one). */
struct dsv4_sample_row {
    float temperature;          /* 0 = greedy (steps 5-9 skipped) */
    float top_p;                /* >= 1 = off */
    float min_p;                /* <= 0 = off */
    float repetition_penalty;   /* 1 = off */
    float presence_penalty;     /* 0 = off */
    float frequency_penalty;    /* 0 = off */
    int32_t top_k;              /* <= 0 or >= V = off */
    int32_t logprobs;           /* top-n alternatives, 0..DSV4_SAMPLER_LOGPROBS_MAX */
    int32_t slot;               /* history slot the penalties read; -1 = none (no penalties) */
    int32_t reserved;           /* 0 */
    uint64_t seed;              /* Philox key */
    uint64_t index;             /* output index of this token (0 for the first generated) */
};

/* One row's result, an array [rows] in device memory; the host copies it back (176 bytes a row). */
struct dsv4_sample_result {
    int32_t token;              /* -1 when status < 0 */
    float logprob;              /* step 1's log-probability of token */
    int32_t n_top;              /* min(logprobs, V) */
    int32_t status;             /* 0; -EDOM: a logit is NaN or +inf (bad_token), every logit is -inf,
                                   or no token kept a positive probability; -EINVAL: slot out of range */
    int32_t bad_token;          /* lowest id of a NaN / +inf logit, else -1 */
    int32_t top_ids[DSV4_SAMPLER_LOGPROBS_MAX];        /* most probable first, ties: lower id */
    float top_logprobs[DSV4_SAMPLER_LOGPROBS_MAX];
};

/* The penalty history on the device, one row per slot; same meaning as struct
 * dsv4_sampler_history: counts[slot, v] = times v occurs in the output so far; seen bit v of the
 * slot's row (bit v % 32 of word v / 32: the same bytes as dsv4_sampler_history.seen on a
 * little-endian machine, each row padded to whole words so it can be updated with 32-bit atomics)
 * = v occurs in the prompt or the output. The sampler reads counts[v] only where seen bit v is set;
 * dsv4_sample_history_record keeps counts[v] > 0 => seen. */
struct dsv4_sample_history {
    uint32_t *d_counts;         /* [slots, vocab] */
    uint32_t *d_seen;           /* [slots, DSV4_SAMPLE_SEEN_WORDS(vocab)] */
    int slots, vocab;
};

#define DSV4_SAMPLE_SEEN_WORDS(vocab) (((int64_t)(vocab) + 31) / 32)

/* Device bytes of the history for `slots` slots (carve once at boot, 256-byte aligned). */
size_t dsv4_sample_history_bytes(int slots, int vocab);
/* Point h at d_base (counts first, then seen bits); -EINVAL for vocab outside
 * [1, DSV4_SAMPLER_VOCAB_MAX] or slots < 1. The memory is not cleared: clear every slot once. */
int dsv4_sample_history_init(struct dsv4_sample_history *h, void *d_base, int slots, int vocab);

/* Record n tokens: token d_tokens[i] into slot d_slots[i]. Prompt tokens (output false) set the
 * seen bit only; output tokens (output true) also add one to counts. Entries with a slot or token
 * out of range are skipped, so a fixed-size launch can carry padding (-1). Order-free (atomics). */
int dsv4_sample_history_record(const struct dsv4_sample_history *h, const int32_t *d_slots,
                               const int32_t *d_tokens, int n, bool output, void *stream);
/* Zero the counts and seen bits of slots d_slots[0..n) (entries out of range skipped). */
int dsv4_sample_history_clear(const struct dsv4_sample_history *h, const int32_t *d_slots, int n,
                              void *stream);

/* Set the sampling kernel's shared-memory limit: once at boot, before any graph capture (the first
 * dsv4_sample_rows call does it too). */
int dsv4_sample_prepare(void);

/* Sample rows [0, rows): row b reads d_logits[b * ld .. b * ld + vocab) (read only), parameters
 * d_params[b] and, when hist is not NULL and d_params[b].slot >= 0, that slot's history; writes
 * d_out[b] and, when d_tokens is not NULL, d_tokens[b] = d_out[b].token (the next step's input).
 * d_logits must be 16-byte aligned and ld a multiple of 4, ld >= vocab; vocab in
 * [1, DSV4_SAMPLER_VOCAB_MAX] and equal to hist->vocab. Bad rows are reported per row in
 * d_out[b].status, never by the return value (the launch cannot know them). */
int dsv4_sample_rows(const float *d_logits, int64_t ld, int rows, int vocab,
                     const struct dsv4_sample_row *d_params, const struct dsv4_sample_history *hist,
                     struct dsv4_sample_result *d_out, int32_t *d_tokens, void *stream);

/* The row parameters for request parameters p (checked with dsv4_sampling_validate first). */
static inline void dsv4_sample_row_set(struct dsv4_sample_row *ret, const struct dsv4_sampling *p,
                                       uint64_t seed, uint64_t index, int slot)
{
    ret->temperature = p->temperature;
    ret->top_p = p->top_p;
    ret->min_p = p->min_p;
    ret->repetition_penalty = p->repetition_penalty;
    ret->presence_penalty = p->presence_penalty;
    ret->frequency_penalty = p->frequency_penalty;
    ret->top_k = p->top_k;
    ret->logprobs = p->logprobs;
    ret->slot = slot;
    ret->reserved = 0;
    ret->seed = seed;
    ret->index = index;
}

/* A copied-back result as the CPU sampler's struct; its status as a return code with a message. */
static inline int dsv4_sample_result_get(const struct dsv4_sample_result *r, struct dsv4_sample *ret)
{
    if (r->status == -EDOM && r->bad_token >= 0)
        return dsv4_error_set(-EDOM, "sampler: logit of token %d is NaN or +inf", r->bad_token);
    if (r->status == -EDOM)
        return dsv4_error_set(-EDOM, "sampler: every logit is -inf or no token has a positive probability");
    if (r->status < 0)
        return dsv4_error_set(r->status, "sampler: the row's history slot is out of range");
    ret->token = r->token;
    ret->logprob = r->logprob;
    ret->n_top = r->n_top;
    for (int i = 0; i < r->n_top && i < DSV4_SAMPLER_LOGPROBS_MAX; i++) {
        ret->top_ids[i] = r->top_ids[i];
        ret->top_logprobs[i] = r->top_logprobs[i];
    }
    return 0;
}

#ifdef __cplusplus
}
#endif

#endif
