/* SPDX-License-Identifier: MIT */
/* A backend for scheduler tests: no model, logits are a pure function of the slot's own token
 * history (a rolling hash) and the token id, so they are batch-invariant by construction. It checks
 * the calls a scheduler makes (distinct slots, positions within max_context) and records what a
 * test needs to see (largest prefill chunk, calls per slot). */
#ifndef DSV4_TESTS_FAKE_BACKEND_H
#define DSV4_TESTS_FAKE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"

struct fake_backend_opts {
    int vocab;                  /* logits row width */
    int eos_id;                 /* written into the fake model config */
    float eos_bias;             /* added to the EOS logit (negative: long answers) */
    float spread;               /* logits are spread * (uniform - 0.5); larger: peakier rows */
    int64_t fail_after;         /* > 0: a call that would take tokens_in past this fails with -EIO */
    bool device_sampling;       /* offer ops->sample as the CUDA backend does: the fake keeps each
                                 * slot's penalty history and samples its own rows (engine/serve/sampler.c) */
    bool fail_fatal;            /* fail_after's failure is -ENOTRECOVERABLE (a sticky device error, as
                                 * the CUDA backend reports one), and every call after it fails too */
    int prefill_us_per_token;   /* > 0: a prefill call sleeps that long per token (a measurable rate) */
    int slot_groups;            /* dsv4_backend.slot_groups: devices the slots are dealt out over (0: one) */
};

int fake_backend_create(const struct fake_backend_opts *fo, const struct dsv4_backend_opts *opts,
                        struct dsv4_backend **ret);

/* The logits the fake gives after a history (for oracles that run no backend): row [vocab]. */
void fake_backend_row(const struct fake_backend_opts *fo, const int32_t *history, int n, float *row);

struct fake_backend_counters {
    int64_t prefill_calls, decode_calls, resets;
    int max_prefill_chunk;      /* largest n in one prefill call */
    int last_prefill_chunk;     /* n of the latest prefill call */
    int max_decode_batch;
    int64_t tokens_in;          /* tokens appended, prefill and decode together */
};

void fake_backend_counters(const struct dsv4_backend *b, struct fake_backend_counters *ret);
/* Tokens currently held by slot (its position). */
int64_t fake_backend_position(const struct dsv4_backend *b, int slot);

/* The test vocabulary's text: ids 0 and 1 are special (no text), then letters, a space, UTF-8
 * pieces that only form characters together, an invalid byte, and multi-letter pieces. */
int fake_token_bytes(void *ctx, int32_t id, char *buf, size_t cap);

#endif
