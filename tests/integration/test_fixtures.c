/* SPDX-License-Identifier: MIT */
/* The CPU reference backend against transformers' deepseek_v4: every case of every fixture under
 * tests/fixtures/ (see tests/fixtures/README.md and tools/mkfixtures.py).
 *
 * exact numerics: every row within DSV4_FIXTURE_TOL (max |diff| / max |logit|) of transformers' logits,
 *   greedy tokens identical; chunked prefill bitwise equal to one-shot prefill; the backend ops
 *   (prefill + decode) bitwise equal to the direct forward.
 * fp8 numerics against these exact logits: only sanity (finite logits) is asserted here, and the
 *   deviation and greedy agreement are reported as TAP comments, since FP8/FP4 rounding is a different
 *   model of the numbers, not an error. The fp8 numerics themselves are asserted row by row against
 *   their own oracle (transformers with the official roundings) by test_fixtures_fp8.c
 *   (tests/fixtures/README_fp8.md). */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/cpu/cpu_forward.h"
#include "engine/error.h"
#include "engine/model/weights.h"
#include "tests/integration/fixture_cases.h"
#include "tools/greedy.h"

#define DSV4_FIXTURE_TOL 1e-4

/* max over rows of fx_row_error, and which row; NaN propagates as a failure (INFINITY). */
static double worst_row_error(const float *a, const float *ref, int rows, int V, int *ret_row)
{
    double worst = 0.0;
    *ret_row = 0;
    for (int r = 0; r < rows; r++) {
        double e = fx_row_error(a + (size_t)r * V, ref + (size_t)r * V, V);
        if (!(e <= worst)) {
            worst = e;
            *ret_row = r;
        }
    }
    return worst;
}

/* The backend ops for the same case, through dsv4-run's loop: prefill in the case's chunks, then decode
 * greedily (slot 1 of 2, so slot 0 must stay empty). */
static void run_backend(const struct dsv4_weights *w, const struct fx_case *fc, float *out)
{
    struct dsv4_backend_opts opts = {.max_batch = 2, .max_context = fc->rows, .numerics = DSV4_NUMERICS_EXACT};
    struct dsv4_backend *b = NULL;
    if (dsv4_backend_cpu_create(w, &opts, &b) < 0)
        fail_msg("backend: %s", dsv4_error_message());
    int slot = 1;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)fc->rows);
    assert_non_null(ids);
    memcpy(ids, fc->tokens, sizeof(int32_t) * (size_t)fc->P);
    assert_int_equal(dsv4_greedy_generate(b, slot, ids, fc->P, fc->decode, fc->chunk, out), 0);
    assert_int_equal(b->ops->slot_position(b, slot), fc->rows);
    assert_int_equal(b->ops->slot_position(b, 0), 0);
    free(ids);
    dsv4_backend_destroy(b);
}

static void test_fixture(void **state)
{
    const char *dir = *state;
    struct fx_fixture fx;
    fx_fixture_open(&fx, dir, "cases.json", false);
    const struct dsv4_weights *w = fx.w;
    struct dsv4_cpu_seq *s = fx.s;
    int V = fx.V;
    float *out = fx.out;
    float *oneshot = malloc(sizeof(float) * (size_t)fx.max_rows * V);
    int32_t *greedy = malloc(sizeof(int32_t) * (size_t)fx.max_rows);
    assert_true(oneshot && greedy);

    for (int i = 0; i < fx.n; i++) {
        const struct fx_case *fc = &fx.cs[i];
        size_t bytes = sizeof(float) * (size_t)fc->rows * V;
        int row;

        fx_forward(w, DSV4_NUMERICS_EXACT, s, fc, fc->chunk, out, greedy);
        double err = worst_row_error(out, fc->logits, fc->rows, V, &row);
        print_message("# %s %s exact: worst row error %.2e (row %d of %d), tolerance %.0e\n", dir, fc->name,
                      err, row, fc->rows, DSV4_FIXTURE_TOL);
        if (!(err <= DSV4_FIXTURE_TOL))
            fail_msg("%s %s: row %d differs from transformers by %.3e relative", dir, fc->name, row, err);
        for (int t = 0; t < fc->decode; t++)
            if (greedy[t] != fc->tokens[fc->P + t])
                fail_msg("%s %s: greedy token %d is %d, transformers chose %d", dir, fc->name, t, greedy[t],
                         fc->tokens[fc->P + t]);

        /* Chunked prefill carries every state across the boundary: bitwise the one-shot result. */
        fx_forward(w, DSV4_NUMERICS_EXACT, s, fc, 0, oneshot, greedy);
        if (memcmp(out, oneshot, bytes) != 0)
            fail_msg("%s %s: chunk %d differs from one-shot prefill", dir, fc->name, fc->chunk);
        run_backend(w, fc, out);
        if (memcmp(out, oneshot, bytes) != 0)
            fail_msg("%s %s: the backend ops differ from the direct forward", dir, fc->name);

        fx_forward(w, DSV4_NUMERICS_FP8, s, fc, fc->chunk, out, greedy);
        for (size_t k = 0; k < (size_t)fc->rows * V; k++)
            if (!isfinite(out[k]))
                fail_msg("%s %s fp8: non-finite logit at row %zu", dir, fc->name, k / V);
        /* Prompt rows only: decode rows follow fp8's own greedy choices once they differ. */
        double ferr = worst_row_error(out, fc->logits, fc->P, V, &row), mean = 0.0;
        for (int r = 0; r < fc->P; r++)
            mean += fx_row_error(out + (size_t)r * V, fc->logits + (size_t)r * V, V) / fc->P;
        int agree = 0, prefix = 0;
        for (int t = 0; t < fc->decode; t++) {
            agree += greedy[t] == fc->tokens[fc->P + t];
            prefix += prefix == t && greedy[t] == fc->tokens[fc->P + t];
        }
        print_message("# %s %s fp8: prompt-row deviation mean %.2e, worst %.2e (row %d); greedy agreement "
                      "%d/%d, first %d identical\n", dir, fc->name, mean, ferr, row, agree, fc->decode, prefix);
    }

    free(oneshot);
    free(greedy);
    fx_fixture_close(&fx);
}

int main(void)
{
    return fx_main("test_fixtures", "fixtures", "cases.json", test_fixture);
}
