/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_backend and the sequence state, on the tiny_a fixture model: batch invariance of decode,
 * slot reset, chunk invariance in fp8 numerics, refused inputs, and the MTP step. The MTP block
 * cannot be checked against transformers (it does not implement one); its test gives tiny_a a
 * random MTP block and checks shapes, finiteness, determinism and that its inputs matter. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/model/weights.h"
#include "cpu_test_util.h"

#define CTX 64

static struct dsv4_weights *model;

static int setup(void **state)
{
    const char *top = getenv("top_srcdir");
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/tests/fixtures/tiny_a", top ? top : ".");
    if (dsv4_weights_load(dir, &model) < 0) {
        fprintf(stderr, "loading %s: %s\n", dir, dsv4_error_message());
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    dsv4_weights_free(model);
    return 0;
}

static void prompt(int32_t *t, int n, int salt)
{
    for (int i = 0; i < n; i++)
        t[i] = (int32_t)((i * 37 + salt * 11 + 3) % model->cfg.vocab_size);
}

/* Decoding slots together gives each the logits it gets alone, bit for bit. */
static void test_batch_invariance(void **state)
{
    int V = model->cfg.vocab_size;
    struct dsv4_backend_opts opts = {.max_batch = 3, .max_context = CTX};
    struct dsv4_backend *b, *alone;
    assert_int_equal(dsv4_backend_cpu_create(model, &opts, &b), 0);
    opts.max_batch = 1;
    assert_int_equal(dsv4_backend_cpu_create(model, &opts, &alone), 0);
    int32_t p0[20], p2[33];
    prompt(p0, 20, 1);
    prompt(p2, 33, 2);
    float *got = test_alloc(sizeof(float) * 2 * V), *want = test_alloc(sizeof(float) * V);
    assert_int_equal(b->ops->prefill(b, 0, p0, 20, NULL, false), 0);
    assert_int_equal(b->ops->prefill(b, 2, p2, 33, NULL, false), 0);
    int slots[2] = {2, 0};
    int32_t toks[2] = {5, 9};
    assert_int_equal(b->ops->decode(b, 2, slots, toks, got), 0);
    assert_int_equal(b->ops->slot_position(b, 2), 34);
    assert_int_equal(b->ops->slot_position(b, 1), 0);

    assert_int_equal(alone->ops->prefill(alone, 0, p2, 33, NULL, false), 0);
    assert_int_equal(alone->ops->decode(alone, 1, (int[]){0}, &toks[0], want), 0);
    assert_memory_equal(got, want, sizeof(float) * V);
    alone->ops->slot_reset(alone, 0);
    assert_int_equal(alone->ops->slot_position(alone, 0), 0);
    assert_int_equal(alone->ops->prefill(alone, 0, p0, 20, NULL, false), 0);
    assert_int_equal(alone->ops->decode(alone, 1, (int[]){0}, &toks[1], want), 0);
    assert_memory_equal(got + V, want, sizeof(float) * V);

    struct dsv4_backend_stats st;
    b->ops->get_stats(b, &st);
    assert_true(st.bytes_reserved > 0);
    assert_int_equal(st.device_allocs, 0);
    dsv4_backend_destroy(b);
    dsv4_backend_destroy(alone);
    test_free_all();
}

/* Out-of-range tokens, a full context, bad or repeated slots are refused and change nothing. */
static void test_refusals(void **state)
{
    struct dsv4_backend_opts opts = {.max_batch = 2, .max_context = 8};
    struct dsv4_backend *b;
    assert_int_equal(dsv4_backend_cpu_create(model, &opts, &b), 0);
    int32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    int32_t bad[2] = {1, model->cfg.vocab_size};
    assert_int_equal(b->ops->prefill(b, 0, bad, 2, NULL, false), -EINVAL);
    assert_int_equal(b->ops->prefill(b, 0, t, 9, NULL, false), -ENOSPC);
    assert_int_equal(b->ops->slot_position(b, 0), 0);
    assert_int_equal(b->ops->prefill(b, 0, t, 8, NULL, false), 0);
    assert_int_equal(b->ops->decode(b, 1, (int[]){0}, t, NULL), -ENOSPC);
    assert_int_equal(b->ops->prefill(b, 2, t, 1, NULL, false), -EINVAL);
    assert_int_equal(b->ops->decode(b, 2, (int[]){1, 1}, t, NULL), -EINVAL);
    assert_int_equal(b->ops->slot_position(b, 1), 0);
    /* A batch with one bad member advances none of them. */
    assert_int_equal(b->ops->decode(b, 2, (int[]){1, 0}, t, NULL), -ENOSPC);
    assert_int_equal(b->ops->decode(b, 2, (int[]){1, 0}, (int32_t[]){3, -1}, NULL), -ENOSPC);
    b->ops->slot_reset(b, 0);
    assert_int_equal(b->ops->decode(b, 2, (int[]){1, 0}, (int32_t[]){3, -1}, NULL), -EINVAL);
    assert_int_equal(b->ops->slot_position(b, 1), 0);
    assert_int_equal(b->ops->slot_position(b, 0), 0);
    dsv4_backend_destroy(b);

    opts.max_batch = 0;
    assert_int_equal(dsv4_backend_cpu_create(model, &opts, &b), -EINVAL);
    opts.max_batch = 1;
    opts.max_context = 0;
    assert_int_equal(dsv4_backend_cpu_create(model, &opts, &b), -EINVAL);
}

/* fp8 numerics round the caches as they are written: chunk boundaries still change nothing. */
static void test_fp8_chunks(void **state)
{
    int V = model->cfg.vocab_size, n = 45;
    struct dsv4_cpu_seq *s;
    assert_int_equal(dsv4_cpu_seq_create(model, CTX, &s), 0);
    int32_t t[45];
    prompt(t, n, 3);
    float *one = test_alloc(sizeof(float) * (size_t)n * V), *chunked = test_alloc(sizeof(float) * (size_t)n * V);
    assert_int_equal(dsv4_cpu_forward(model, DSV4_NUMERICS_FP8, s, t, n, one, true), 0);
    dsv4_cpu_seq_reset(s);
    for (int i = 0; i < n; i += 6)
        assert_int_equal(dsv4_cpu_forward(model, DSV4_NUMERICS_FP8, s, t + i, n - i < 6 ? n - i : 6,
                                          chunked + (size_t)i * V, true), 0);
    assert_memory_equal(one, chunked, sizeof(float) * (size_t)n * V);
    for (size_t i = 0; i < (size_t)n * V; i++)
        assert_true(isfinite(one[i]));
    /* The last-row-only form returns the same last row. */
    float *last = test_alloc(sizeof(float) * V);
    dsv4_cpu_seq_reset(s);
    assert_int_equal(dsv4_cpu_forward(model, DSV4_NUMERICS_FP8, s, t, n, last, false), 0);
    assert_memory_equal(last, one + (size_t)(n - 1) * V, sizeof(float) * V);
    dsv4_cpu_seq_free(s);
    test_free_all();
}

static void test_mtp(void **state)
{
    const struct dsv4_config *cfg = &model->cfg;
    int D = cfg->dim, V = cfg->vocab_size;
    struct dsv4_cpu_seq *s;
    assert_int_equal(dsv4_cpu_seq_create(model, CTX, &s), 0);
    float *logits = test_alloc(sizeof(float) * V);
    assert_int_equal(dsv4_cpu_mtp_forward(model, DSV4_NUMERICS_EXACT, s, s->streams, 3, logits), -ENOENT);
    dsv4_cpu_seq_free(s);

    /* A random MTP block around tiny_a's sliding layer 0, sharing its embed and head. */
    srand(41);
    int layer0 = -1;
    for (int i = 0; i < cfg->n_layers && layer0 < 0; i++)
        if (model->layers[i].ratio == 0)
            layer0 = i;
    assert_true(layer0 >= 0);
    struct dsv4_mtp m = {.enorm = test_randv(D, 0.2, 1.0), .hnorm = test_randv(D, 0.2, 1.0),
                         .e_proj = test_linear(D, D, 0.3), .h_proj = test_linear(D, D, 0.3),
                         .layer = model->layers[layer0], .hc_head = model->hc_head,
                         .norm = test_randv(D, 0.2, 1.0)};
    int saved_n = model->n_mtp;
    struct dsv4_mtp *saved = model->mtp;
    model->n_mtp = 1;
    model->mtp = &m;

    int32_t t[12];
    prompt(t, 12, 4);
    float *a = test_alloc(sizeof(float) * V * 3), *streams = test_alloc(sizeof(float) * cfg->hc_mult * D);
    for (int run = 0; run < 2; run++) {
        assert_int_equal(dsv4_cpu_seq_create(model, CTX, &s), 0);
        for (int i = 0; i < 12; i++) {
            assert_int_equal(dsv4_cpu_forward(model, DSV4_NUMERICS_EXACT, s, &t[i], 1, NULL, false), 0);
            memcpy(streams, s->streams, sizeof(float) * cfg->hc_mult * D);
            int32_t next = i + 1 < 12 ? t[i + 1] : 7;
            assert_int_equal(dsv4_cpu_mtp_forward(model, DSV4_NUMERICS_EXACT, s, streams, next, logits), 0);
            assert_int_equal(s->mtp_pos, i + 1);
        }
        for (int k = 0; k < V; k++)
            assert_true(isfinite(logits[k]));
        memcpy(a + (size_t)run * V, logits, sizeof(float) * V);
        if (run == 1) {
            /* Another next token at the same position gives other logits. */
            s->mtp_pos--;
            assert_int_equal(dsv4_cpu_mtp_forward(model, DSV4_NUMERICS_EXACT, s, streams, 8, a + 2 * V), 0);
        }
        dsv4_cpu_seq_free(s);
    }
    assert_memory_equal(a, a + V, sizeof(float) * V);
    assert_memory_not_equal(a, a + 2 * V, sizeof(float) * V);

    model->n_mtp = saved_n;
    model->mtp = saved;
    test_free_all();
}

/* Routing counts: every token counts once for each of its top-k experts in every layer; hash layers
 * count exactly the experts tid2eid names for the tokens fed, prefill and decode alike. */
static void test_routing_counts(void **state)
{
    const struct dsv4_config *c = &model->cfg;
    const int L = c->n_layers, E = c->n_experts, K = c->n_experts_per_tok;
    struct dsv4_backend_opts opts = {.max_batch = 2, .max_context = CTX};
    struct dsv4_backend *b;
    assert_int_equal(dsv4_backend_cpu_create(model, &opts, &b), 0);
    uint64_t *got = test_alloc(sizeof(uint64_t) * L * E), *want = test_alloc(sizeof(uint64_t) * E);
    assert_non_null(b->ops->routing_counts);
    assert_int_equal(b->ops->routing_counts(b, got), 0);
    for (int i = 0; i < L * E; i++)
        assert_int_equal(got[i], 0);

    int32_t p0[13], p1[7];
    prompt(p0, 13, 3);
    prompt(p1, 7, 4);
    assert_int_equal(b->ops->prefill(b, 0, p0, 13, NULL, false), 0);
    assert_int_equal(b->ops->prefill(b, 1, p1, 7, NULL, false), 0);
    const int32_t toks[2] = {11, 200};
    assert_int_equal(b->ops->decode(b, 2, (int[]){1, 0}, toks, NULL), 0);
    const int n = 13 + 7 + 2;
    assert_int_equal(b->ops->routing_counts(b, got), 0);
    int hash_layers = 0;
    for (int l = 0; l < L; l++) {
        uint64_t sum = 0;
        for (int e = 0; e < E; e++) {
            sum += got[l * E + e];
            assert_true(got[l * E + e] <= (uint64_t)n);     /* an expert at most once per token */
        }
        assert_int_equal(sum, (uint64_t)n * K);
        const struct dsv4_ffn *f = &model->layers[l].ffn;
        if (f->type != DSV4_MLP_HASH)
            continue;
        hash_layers++;
        memset(want, 0, sizeof(uint64_t) * E);
        for (int i = 0; i < n; i++) {
            const int32_t t = i < 13 ? p0[i] : i < 20 ? p1[i - 13] : toks[i - 20];
            for (int k = 0; k < K; k++)
                want[f->tid2eid[(size_t)t * K + k]]++;
        }
        assert_memory_equal(got + l * E, want, sizeof(uint64_t) * E);
    }
    assert_int_equal(hash_layers, 2);
    dsv4_backend_destroy(b);
    test_free_all();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_fp8_chunks),
        cmocka_unit_test(test_mtp),
        cmocka_unit_test(test_routing_counts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
