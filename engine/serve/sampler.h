/* SPDX-License-Identifier: MIT */
/* Sampler: turns one row of logits [V] f32 into a token, reproducibly.
 *
 * The order, applied to every row (each step names exactly what it reads):
 *   1. logprobs: log_softmax of the RAW logits (before any step below). The chosen token's logprob
 *      and the top-n alternatives (n = params.logprobs) are reported from this distribution.
 *   2. repetition penalty r (1 = off): every token seen in the prompt or the output so far:
 *      l = l > 0 ? l / r : l * r.
 *   3. frequency f and presence p penalties (0 = off), over the OUTPUT tokens only, count c:
 *      l = l - c * f - (c > 0 ? p : 0).
 *   4. temperature == 0: greedy, the largest l (ties: the lowest token id). Steps 5-9 are skipped.
 *   5. temperature T: l = l / T.
 *   6. top_k k (0 = off): keep the k largest l (ties at the boundary: lower ids first).
 *   7. softmax over the kept tokens.
 *   8. top_p q (1 = off): keep the smallest set of most probable tokens (same tie order) whose mass
 *      reaches q; at least one token.
 *   9. min_p m (0 = off): drop kept tokens whose probability is below m * (largest probability).
 *  10. draw: u in [0, 1) from Philox4x32-10 keyed by (seed, output index); walk the kept tokens in
 *      ascending id, accumulating renormalized probability, and take the first whose running sum
 *      exceeds u (the last kept token if rounding leaves none). -EDOM when no kept token has a
 *      positive probability (a temperature or repetition penalty that carries a logit past the
 *      float range).
 * The result depends only on the row, the params, the history counts, the seed and the output index:
 * never on the batch or the slot.
 *
 * Speculative decoding verifies a draft with this same draw (engine/serve/sched_spec.c): the draft is
 * the MTP block's greedy pick, a certain proposal, for which the rejection rule accepts it with
 * probability p(draft) and otherwise draws from p without it; sampling the verified row as above and
 * accepting the draft when the draw equals it does exactly that, and leaves every token what
 * decoding without drafts draws. */
#ifndef DSV4_ENGINE_SERVE_SAMPLER_H
#define DSV4_ENGINE_SERVE_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#define DSV4_SAMPLER_LOGPROBS_MAX 20    /* top-n alternatives per token */
#define DSV4_SAMPLER_VOCAB_MAX (1 << 22)

struct dsv4_sampling {
    float temperature;          /* 0 = greedy; must be >= 0 and finite */
    int top_k;                  /* 0 = off */
    float top_p;                /* (0, 1]; 1 = off */
    float min_p;                /* [0, 1]; 0 = off */
    float repetition_penalty;   /* > 0; 1 = off */
    float presence_penalty;     /* 0 = off */
    float frequency_penalty;    /* 0 = off */
    bool has_seed;              /* false: the scheduler draws a seed and reports it */
    uint64_t seed;
    int logprobs;               /* top-n alternatives, 0..DSV4_SAMPLER_LOGPROBS_MAX */
};

/* Default parameters: temperature 1, no truncation, no penalties, no seed, no logprobs. */
void dsv4_sampling_defaults(struct dsv4_sampling *ret);

/* Check ranges; the message names the field and its allowed range. */
int dsv4_sampling_validate(const struct dsv4_sampling *p);

/* The token history the penalties read. counts[v]: times v occurs in the output so far;
 * seen[v / 8] bit (v % 8): v occurs in the prompt or the output. Both [V], owned by the caller
 * (the scheduler keeps one pair per slot and clears only the entries it set). */
struct dsv4_sampler_history {
    const uint32_t *counts;
    const uint8_t *seen;
};

struct dsv4_sample {
    int32_t token;
    float logprob;                              /* step 1's log-probability of `token` */
    int n_top;                                  /* = params.logprobs */
    int32_t top_ids[DSV4_SAMPLER_LOGPROBS_MAX]; /* most probable first (ties: lower id first) */
    float top_logprobs[DSV4_SAMPLER_LOGPROBS_MAX];
};

/* Workspace for one row at a time ([V] floats and indices), made once per engine thread. */
struct dsv4_sampler;

int dsv4_sampler_create(int vocab, struct dsv4_sampler **ret);
void dsv4_sampler_destroy(struct dsv4_sampler *s);

/* Sample one token from logits [V] (read only; steps 2-9 work on a copy). hist may be NULL
 * (no penalties possible). index: the output index of this token (0 for the first generated). */
int dsv4_sampler_sample(struct dsv4_sampler *s, const struct dsv4_sampling *p, const float *logits,
                        const struct dsv4_sampler_history *hist, uint64_t seed, uint64_t index,
                        struct dsv4_sample *ret);

#endif
