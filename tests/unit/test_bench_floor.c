/* SPDX-License-Identifier: MIT */
/* tools/bench_floor.h, dsv4-bench's floor, without a GPU: on models/default-fp8 (DeepSeek's release
 * format: FP8 linears, FP4 experts, hash layers, an MTP block) every linear's bytes and a decode
 * step's against the tensors' sizes in the checkpoint file, the expected distinct experts of a step
 * against an exact count over every routing of a few rows, and the cache a step at a context reads
 * against V4-Flash's figures worked out by hand from doc/MODEL.md section 5. */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/weights.h"
#include "tools/bench_floor.h"

static struct dsv4_weights *load_default_fp8(void)
{
    const char *top = getenv("top_srcdir");
    char dir[4096];
    struct dsv4_weights *w = NULL;
    snprintf(dir, sizeof(dir), "%s/models/default-fp8", top ? top : ".");
    if (dsv4_weights_load(dir, &w) < 0)
        fail_msg("%s", dsv4_error_message());
    return w;
}

/* The file's bytes of a linear: its weight tensor and, when quantized, its scale. */
static double file_bytes(const struct dsv4_weights *w, const struct dsv4_linear *l)
{
    char scale[512];
    const struct dsv4_st_tensor *t = dsv4_st_find(w->st, l->name);
    assert_non_null(t);
    double b = (double)t->nbytes;
    if (l->scale) {
        const size_t n = strlen(l->name);
        assert_true(n > 7 && strcmp(l->name + n - 7, ".weight") == 0);
        snprintf(scale, sizeof(scale), "%.*s.scale", (int)(n - 7), l->name);
        const struct dsv4_st_tensor *s = dsv4_st_find(w->st, scale);
        assert_non_null(s);
        b += (double)s->nbytes;
    }
    return b;
}

static void test_linear_bytes(void **state)
{
    struct dsv4_weights *w = load_default_fp8();
    const struct dsv4_config *c = &w->cfg;
    int fp8 = 0, fp4 = 0;
    assert_true(dsv4_bench_linear_bytes(&w->head) == file_bytes(w, &w->head));
    for (int i = 0; i < c->n_layers; i++) {
        const struct dsv4_layer *L = &w->layers[i];
        const struct dsv4_attn *a = &L->attn;
        const struct dsv4_linear *lin[] = { &L->hc_attn.fn, &a->wq_a, &a->wq_b, &a->wkv, &a->wo_a, &a->wo_b,
                                            &L->ffn.gate, &L->ffn.sw1, &L->ffn.sw2, &L->ffn.sw3 };
        double sum = 0.0;
        for (size_t k = 0; k < sizeof(lin) / sizeof(lin[0]); k++) {
            assert_true(dsv4_bench_linear_bytes(lin[k]) == file_bytes(w, lin[k]));
            fp8 += lin[k]->fmt == DSV4_W_FP8;
        }
        for (int e = 0; e < c->n_experts; e++) {
            const double eb = file_bytes(w, &L->ffn.w1[e]) + file_bytes(w, &L->ffn.w2[e]) + file_bytes(w, &L->ffn.w3[e]);
            assert_true(dsv4_bench_linear_bytes(&L->ffn.w1[e]) + dsv4_bench_linear_bytes(&L->ffn.w2[e]) +
                        dsv4_bench_linear_bytes(&L->ffn.w3[e]) == eb);
            fp4 += L->ffn.w1[e].fmt == DSV4_W_FP4;
        }
        /* the layer's linears: every tensor of the layer of two dimensions but ape and tid2eid */
        char prefix[64];
        const int np = snprintf(prefix, sizeof(prefix), "layers.%d.", i);
        for (size_t k = 0; k < dsv4_st_count(w->st); k++) {
            const struct dsv4_st_tensor *t = dsv4_st_at(w->st, k);
            if (strncmp(t->name, prefix, (size_t)np) == 0 && t->ndim == 2 && !strstr(t->name, ".ape") &&
                !strstr(t->name, "tid2eid"))
                sum += (double)t->nbytes;
        }
        assert_true(dsv4_bench_layer_bytes(c, L) == sum);
    }
    /* the checkpoint is what the test means it to be: FP8 linears, FP4 experts */
    assert_true(fp8 > 0 && fp4 == c->n_layers * c->n_experts);
    dsv4_weights_free(w);
}

/* The expected number of distinct experts rows routings reach, each row k distinct of E uniformly:
 * every combination of every row counted. */
static double exact_distinct(int E, int k, int rows)
{
    int combos[64], n = 0;
    for (int m = 0; m < 1 << E; m++)
        if (__builtin_popcount((unsigned)m) == k)
            combos[n++] = m;
    double total = 0.0;
    long count = 0;
    int idx[4] = { 0 };
    for (;;) {
        unsigned u = 0;
        for (int r = 0; r < rows; r++)
            u |= (unsigned)combos[idx[r]];
        total += __builtin_popcount(u);
        count++;
        int r = 0;
        while (r < rows && ++idx[r] == n)
            idx[r++] = 0;
        if (r == rows)
            break;
    }
    return total / (double)count;
}

static void test_distinct_experts(void **state)
{
    struct dsv4_config c = { 0 };
    for (int E = 4; E <= 8; E += 2)
        for (int k = 1; k <= 3; k++)
            for (int rows = 1; rows <= 3; rows++) {
                c.n_experts = E;
                c.n_experts_per_tok = k;
                const double want = exact_distinct(E, k, rows), got = dsv4_bench_distinct_experts(&c, rows);
                if (fabs(got - want) > 1e-9)
                    fail_msg("E %d, k %d, %d rows: %.12f distinct experts, exactly %.12f", E, k, rows, got, want);
            }
    /* V4-Flash: 6 of 256, at batch 1 exactly the 6 */
    c.n_experts = 256;
    c.n_experts_per_tok = 6;
    assert_true(fabs(dsv4_bench_distinct_experts(&c, 1) - 6.0) < 1e-9);
}

/* A decode step reads every tensor of the main model once, but for the routed experts (those the rows
 * route to), the MTP block's matrices (no decode step runs it), the embedding and the hash layers'
 * tid2eid tables (a row of each per token: int32 on the device), plus each row's f32 logits. */
static void test_step_bytes(void **state)
{
    struct dsv4_weights *w = load_default_fp8();
    const struct dsv4_config *c = &w->cfg;
    struct dsv4_bench_floor f;
    double dense = 0.0, expert = 0.0;
    int tables = 0;
    for (size_t k = 0; k < dsv4_st_count(w->st); k++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(w->st, k);
        if (strncmp(t->name, "layers.0.ffn.experts.0.", 23) == 0)
            expert += (double)t->nbytes;
        if (strstr(t->name, "tid2eid"))
            tables++;
        else if (!strstr(t->name, ".experts.") && !(strncmp(t->name, "mtp.", 4) == 0 && t->ndim == 2) &&
                 strcmp(t->name, "embed.weight") != 0)
            dense += (double)t->nbytes;
    }
    assert_int_equal(tables, 3);
    assert_true(w->n_mtp == 1 && expert > 0);
    dsv4_bench_floor_init(w, &f);
    for (int rows = 1; rows <= 64; rows *= 4) {
        const double want = dense + c->n_layers * dsv4_bench_distinct_experts(c, rows) * expert +
                            (double)rows * (tables * c->n_experts_per_tok * 4 + c->dim * 2 + 4.0 * c->vocab_size);
        const double got = dsv4_bench_step_bytes(c, &f, rows);
        if (fabs(got - want) > 1e-9 * want)
            fail_msg("%d rows: %.0f bytes, the checkpoint says %.0f", rows, got, want);
    }
    dsv4_weights_free(w);
}

/* V4-Flash in fp8 numerics, a row at position `context` (doc/MODEL.md 5.1, 5.2): every layer reads
 * its window (min(context + 1, 128) KV entries of 584 bytes); a CSA layer its n = (context + 1) / 4
 * complete indexer keys (68 bytes) and the min(512, n) entries they pick; an HCA layer its
 * (context + 1) / 128 complete entries. 21 CSA and 20 HCA layers after 2 sliding ones. At 8192:
 * 43 x 128 x 584 + 21 x (512 x 584 + 2048 x 68) + 20 x 64 x 584 = 13165568. */
static void test_context_bytes(void **state)
{
    static const struct { int context; double bytes; } want[] = {
        { 0, 25112 }, { 100, 2878612 }, { 8192, 13165568 }, { 1048575, 479517696 },
    };
    char json[1024];
    int n = snprintf(json, sizeof(json), "{\"dim\": 4096, \"n_layers\": 43, \"compress_ratios\": [0, 0");
    for (int i = 2; i < 43; i++)
        n += snprintf(json + n, sizeof(json) - (size_t)n, ", %d", i % 2 ? 128 : 4);
    snprintf(json + n, sizeof(json) - (size_t)n, "]}");
    struct dsv4_config c;
    if (dsv4_config_parse(json, "flash", &c) < 0)
        fail_msg("%s", dsv4_error_message());
    assert_int_equal(c.window, 128);
    assert_int_equal(c.index_topk, 512);
    const struct dsv4_bench_floor f = { .dense = 1e9, .expert = 13369344 };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        const double got = dsv4_bench_context_step_bytes(&c, &f, want[i].context) - dsv4_bench_step_bytes(&c, &f, 1);
        if (fabs(got - want[i].bytes) > 1e-3)
            fail_msg("context %d: %.0f cache bytes, doc/MODEL.md gives %.0f", want[i].context, got, want[i].bytes);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_bytes),
        cmocka_unit_test(test_distinct_experts),
        cmocka_unit_test(test_step_bytes),
        cmocka_unit_test(test_context_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
