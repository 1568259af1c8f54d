/* SPDX-License-Identifier: MIT */
/* The fake backend: see fake_backend.h. */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/error.h"
#include "engine/serve/philox.h"
#include "tests/unit/fake_backend.h"

#define FAKE_HASH_START 0x243F6A8885A308D3ull

struct fake_slot {
    int64_t pos;
    uint64_t h;                 /* hash of the tokens appended since the last reset */
};

struct fake_impl {
    struct fake_backend_opts fo;
    struct dsv4_backend_ops ops;    /* fake_ops, less `sample` unless device_sampling */
    struct dsv4_weights w;      /* only cfg is filled */
    struct fake_slot *slots;
    struct fake_backend_counters c;
    /* device_sampling: the backend-side penalty history and the rows of the last call */
    uint32_t *counts;           /* [slots, vocab] */
    uint8_t *seen;              /* [slots, seen_stride] */
    size_t seen_stride;
    struct dsv4_sampler *sampler;
    float *row;                 /* [vocab] */
    int *last_slots;            /* [max_batch] the last decode's slots */
    int last_rows;              /* rows the last call left to sample (0: none) */
    bool last_prefill;
};

static void mark_seen(struct fake_impl *f, int slot, int32_t tok)
{
    if (f->seen)
        f->seen[(size_t)slot * f->seen_stride + (size_t)tok / 8] |= (uint8_t)(1u << (tok % 8));
}

static uint64_t hash_step(uint64_t h, int32_t tok)
{
    /* splitmix64 finalizer over the previous state and the token */
    uint64_t z = h ^ ((uint64_t)(uint32_t)tok * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void row_from_hash(const struct fake_backend_opts *fo, uint64_t h, float *row)
{
    for (int v = 0; v < fo->vocab; v++) {
        double u = dsv4_philox_uniform(h, (uint64_t)v, 7);
        row[v] = fo->spread * (float)(u - 0.5);
        if (v == fo->eos_id)
            row[v] += fo->eos_bias;
    }
}

void fake_backend_row(const struct fake_backend_opts *fo, const int32_t *history, int n, float *row)
{
    uint64_t h = FAKE_HASH_START;
    for (int i = 0; i < n; i++)
        h = hash_step(h, history[i]);
    row_from_hash(fo, h, row);
}

static int injected_failure(const struct fake_impl *f, const char *op)
{
    if (f->fo.fail_fatal)
        return dsv4_error_set(-ENOTRECOVERABLE, "fake %s: injected device fault", op);
    return dsv4_error_set(-EIO, "fake %s: injected failure", op);
}

static int fake_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits,
                        bool all_rows)
{
    struct fake_impl *f = b->impl;
    if (slot < 0 || slot >= b->opts.max_batch)
        return dsv4_error_set(-EINVAL, "fake prefill: slot %d", slot);
    struct fake_slot *sl = &f->slots[slot];
    if (n < 1 || sl->pos + n > b->opts.max_context)
        return dsv4_error_set(-ENOSPC, "fake prefill: slot %d at %lld + %d tokens > max_context %d", slot,
                              (long long)sl->pos, n, b->opts.max_context);
    if (f->fo.fail_after > 0 && f->c.tokens_in + n > f->fo.fail_after)
        return injected_failure(f, "prefill");
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= f->fo.vocab)
            return dsv4_error_set(-EINVAL, "fake prefill: token %d", tokens[i]);
        sl->h = hash_step(sl->h, tokens[i]);
        mark_seen(f, slot, tokens[i]);
        if (logits && all_rows)
            row_from_hash(&f->fo, sl->h, logits + (size_t)i * (size_t)f->fo.vocab);
    }
    sl->pos += n;
    if (logits && !all_rows)
        row_from_hash(&f->fo, sl->h, logits);
    f->last_prefill = true;
    f->last_rows = 1;
    f->last_slots[0] = slot;
    f->c.prefill_calls++;
    f->c.tokens_in += n;
    if (n > f->c.max_prefill_chunk)
        f->c.max_prefill_chunk = n;
    f->c.last_prefill_chunk = n;
    if (f->fo.prefill_us_per_token > 0) {
        const int64_t us = (int64_t)n * f->fo.prefill_us_per_token;
        struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = us % 1000000 * 1000 };

        while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
            ;
    }
    return 0;
}

static int fake_decode(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, float *logits)
{
    struct fake_impl *f = b->impl;
    if (n < 1 || n > b->opts.max_batch)
        return dsv4_error_set(-EINVAL, "fake decode: batch %d", n);
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= b->opts.max_batch)
            return dsv4_error_set(-EINVAL, "fake decode: slot %d", slots[i]);
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i])
                return dsv4_error_set(-EINVAL, "fake decode: slot %d twice", slots[i]);
        if (f->slots[slots[i]].pos + 1 > b->opts.max_context)
            return dsv4_error_set(-ENOSPC, "fake decode: slot %d is full", slots[i]);
        if (f->slots[slots[i]].pos == 0)
            return dsv4_error_set(-EINVAL, "fake decode: slot %d has no prompt", slots[i]);
    }
    if (f->fo.fail_after > 0 && f->c.tokens_in + n > f->fo.fail_after)
        return injected_failure(f, "decode");
    for (int i = 0; i < n; i++) {
        struct fake_slot *sl = &f->slots[slots[i]];
        sl->h = hash_step(sl->h, tokens[i]);
        sl->pos++;
        mark_seen(f, slots[i], tokens[i]);
        f->last_slots[i] = slots[i];
        if (logits)
            row_from_hash(&f->fo, sl->h, logits + (size_t)i * (size_t)f->fo.vocab);
    }
    f->last_prefill = false;
    f->last_rows = n;
    f->c.decode_calls++;
    f->c.tokens_in += n;
    if (n > f->c.max_decode_batch)
        f->c.max_decode_batch = n;
    return 0;
}

/* The CUDA backend's contract (engine/backend.h): the rows of the call just made, each once. */
static int fake_sample(struct dsv4_backend *b, int n, const struct dsv4_backend_sample_req *req, struct dsv4_sample *out,
                       int *rc, char *msgs)
{
    struct fake_impl *f = b->impl;
    const int V = f->fo.vocab;
    if (n < 1 || n != f->last_rows || (f->last_prefill && n != 1))
        return dsv4_error_set(-EINVAL, "fake sample: %d rows after a %s of %d", n,
                              f->last_prefill ? "prefill" : "decode", f->last_rows);
    for (int i = 0; i < n; i++)
        if (req[i].slot != f->last_slots[i])
            return dsv4_error_set(-EINVAL, "fake sample: row %d is slot %d, the call's row was slot %d", i,
                                  req[i].slot, f->last_slots[i]);
    for (int i = 0; i < n; i++) {
        const int slot = req[i].slot;
        struct dsv4_sampler_history hist = { .counts = f->counts + (size_t)slot * (size_t)V,
                                             .seen = f->seen + (size_t)slot * f->seen_stride };
        row_from_hash(&f->fo, f->slots[slot].h, f->row);
        rc[i] = dsv4_sampler_sample(f->sampler, req[i].params, f->row, &hist, req[i].seed, req[i].index, &out[i]);
        if (rc[i] < 0) {
            snprintf(msgs + (size_t)i * DSV4_BACKEND_MSG_MAX, DSV4_BACKEND_MSG_MAX, "%s", dsv4_error_message());
            continue;
        }
        f->counts[(size_t)slot * (size_t)V + (size_t)out[i].token]++;
        mark_seen(f, slot, out[i].token);
    }
    f->last_rows = 0;
    return 0;
}

static void fake_slot_reset(struct dsv4_backend *b, int slot)
{
    struct fake_impl *f = b->impl;
    f->slots[slot].pos = 0;
    f->slots[slot].h = FAKE_HASH_START;
    f->c.resets++;
    if (f->counts) {
        memset(f->counts + (size_t)slot * (size_t)f->fo.vocab, 0, sizeof(*f->counts) * (size_t)f->fo.vocab);
        memset(f->seen + (size_t)slot * f->seen_stride, 0, f->seen_stride);
    }
}

static int64_t fake_slot_position(const struct dsv4_backend *b, int slot)
{
    const struct fake_impl *f = b->impl;
    return f->slots[slot].pos;
}

static void fake_get_stats(const struct dsv4_backend *b, struct dsv4_backend_stats *ret)
{
    memset(ret, 0, sizeof(*ret));
    strcpy(ret->variant, "fake");
}

static void fake_destroy(struct dsv4_backend *b)
{
    struct fake_impl *f = b->impl;
    free(f->slots);
    free(f->counts);
    free(f->seen);
    free(f->row);
    free(f->last_slots);
    dsv4_sampler_destroy(f->sampler);
    free(f);
    free(b);
}

static const struct dsv4_backend_ops fake_ops = {
    .name = "fake",
    .prefill = fake_prefill,
    .decode = fake_decode,
    .sample = fake_sample,
    .slot_reset = fake_slot_reset,
    .slot_position = fake_slot_position,
    .get_stats = fake_get_stats,
    .destroy = fake_destroy,
};

int fake_backend_create(const struct fake_backend_opts *fo, const struct dsv4_backend_opts *opts,
                        struct dsv4_backend **ret)
{
    struct dsv4_backend *b = calloc(1, sizeof(*b));
    struct fake_impl *f = calloc(1, sizeof(*f));
    struct fake_slot *slots = calloc((size_t)opts->max_batch, sizeof(*slots));
    int *last_slots = calloc((size_t)opts->max_batch, sizeof(*last_slots));
    if (!b || !f || !slots || !last_slots) {
        free(b);
        free(f);
        free(slots);
        free(last_slots);
        return -ENOMEM;
    }
    f->last_slots = last_slots;
    f->slots = slots;
    if (fo->device_sampling) {
        f->seen_stride = ((size_t)fo->vocab + 7) / 8;
        f->counts = calloc((size_t)opts->max_batch * (size_t)fo->vocab, sizeof(*f->counts));
        f->seen = calloc((size_t)opts->max_batch, f->seen_stride);
        f->row = calloc((size_t)fo->vocab, sizeof(*f->row));
        if (!f->counts || !f->seen || !f->row || dsv4_sampler_create(fo->vocab, &f->sampler) < 0) {
            b->impl = f;
            fake_destroy(b);
            return -ENOMEM;
        }
    }
    f->fo = *fo;
    f->w.cfg.vocab_size = fo->vocab;
    f->w.cfg.eos_id = fo->eos_id;
    f->w.cfg.bos_id = 0;
    for (int i = 0; i < opts->max_batch; i++)
        slots[i].h = FAKE_HASH_START;
    f->ops = fake_ops;
    if (!fo->device_sampling)
        f->ops.sample = NULL;
    b->ops = &f->ops;
    b->weights = &f->w;
    b->opts = *opts;
    b->slot_groups = fo->slot_groups;
    b->impl = f;
    *ret = b;
    return 0;
}

void fake_backend_counters(const struct dsv4_backend *b, struct fake_backend_counters *ret)
{
    const struct fake_impl *f = b->impl;
    *ret = f->c;
}

int64_t fake_backend_position(const struct dsv4_backend *b, int slot)
{
    return fake_slot_position(b, slot);
}

/* ids: 0 BOS, 1 EOS (no text); 2..27 'a'..'z'; 28 ' '; 29 0xC3 and 30 0xA9 (U+00E9 in two tokens);
 * 31 0xE2 0x82 and 32 0xAC (U+20AC split 2+1); 33 0xFF (never valid); 34 "STOP"; 35 "ST"; 36 "OP";
 * 37 "\n"; 38 "ab"; from 39 on two letters chosen by the id. */
int fake_token_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    static const char *const fixed[] = {
        "", "", NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, " ", "\xC3", "\xA9",
        "\xE2\x82", "\xAC", "\xFF", "STOP", "ST", "OP", "\n", "ab",
    };
    char tmp[3];
    const char *t;
    if (id < 0)
        return dsv4_error_set(-ERANGE, "fake vocab: id %d", id);
    if (id >= 2 && id <= 27) {
        tmp[0] = (char)('a' + id - 2);
        tmp[1] = '\0';
        t = tmp;
    } else if (id < (int32_t)(sizeof(fixed) / sizeof(fixed[0]))) {
        t = fixed[id];
    } else {
        tmp[0] = (char)('a' + id % 26);
        tmp[1] = (char)('a' + (id / 26) % 26);
        tmp[2] = '\0';
        t = tmp;
    }
    size_t len = strlen(t);
    if (len > cap)
        return -E2BIG;
    memcpy(buf, t, len);
    return (int)len;
}
