/* SPDX-License-Identifier: MIT */
/* The CPU backend's fp8 ("official") numerics against an independent oracle: transformers' deepseek_v4
 * with the official roundings added by tools/mkfixtures_fp8.py (window KV and compressed entries: the
 * non-RoPE part through FP8 e4m3 with a UE8M0 scale per 64, the RoPE part bf16; indexer keys and queries
 * Hadamard-rotated and rounded through FP4 e2m1 with a UE8M0 scale per 32; see
 * tests/fixtures/README_fp8.md).
 *
 * For every case of every tests/fixtures/<model>/cases_fp8.json: prefill the prompt in the case's chunks,
 * then decode the oracle's greedy tokens (teacher forcing, so every row is comparable), and require
 *   - every row r within the oracle's row_tolerance[r] (max |diff| / max |logit|);
 *   - the backend's argmax equal to the oracle's greedy token at every decode step whose top-1 / top-2
 *     margin is at least DSV4_FP8_MIN_GAP and more than twice the row's bound (reported otherwise).
 *
 * The bounds: FP8/FP4/bf16 rounding is a step function, so two float32 implementations that differ in
 * rounding order only (about 1e-6 relative before each rounding) round to the same values except where a
 * value sits that close to a rounding boundary, and with 1e4 to 1e5 roundings per case a few always do.
 * The oracle takes every rounding within 3e-6 of its boundary to the other side (all together, then each
 * half of a random split) and sets each row's bound to twice the largest move that causes, never below
 * the exact numerics' 1e-4.  Rows before the first such rounding keep 1e-4; the loosest bound is 2.4e-2,
 * still far below what a misplaced, missing or extra rounding does (exact and fp8 differ by 0.25 to 0.9;
 * rounding the RoPE part or not moves even the first row by 3.6e-3, against its bound 1e-4). */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/cpu/cpu_forward.h"
#include "engine/model/weights.h"
#include "tests/integration/fixture_cases.h"
#include "tools/greedy.h"

#define DSV4_FP8_MIN_TOL 1e-4     /* the exact numerics' bound */
#define DSV4_FP8_MAX_TOL 5e-2
#define DSV4_FP8_MIN_GAP 1e-3     /* (top1 - top2) / max |logit| of the oracle row */

/* (top1 - top2) / max |v| of a row. */
static double top2_gap(const float *row, int n)
{
    double a = -INFINITY, b = -INFINITY, mag = 0.0;
    for (int i = 0; i < n; i++) {
        double v = row[i];
        mag = fmax(mag, fabs(v));
        if (v > a) {
            b = a;
            a = v;
        } else if (v > b) {
            b = v;
        }
    }
    return mag > 0.0 ? (a - b) / mag : 0.0;
}

static void test_fixture(void **state)
{
    const char *dir = *state;
    struct fx_fixture fx;
    fx_fixture_open(&fx, dir, "cases_fp8.json", true);
    int V = fx.V;
    const float *out = fx.out;
    /* a bound looser than DSV4_FP8_MAX_TOL could no longer tell a misplaced rounding */
    for (int i = 0; i < fx.n; i++)
        for (int r = 0; r < fx.cs[i].rows; r++)
            assert_true(fx.cs[i].tol[r] >= DSV4_FP8_MIN_TOL && fx.cs[i].tol[r] <= DSV4_FP8_MAX_TOL);

    for (int i = 0; i < fx.n; i++) {
        const struct fx_case *fc = &fx.cs[i];
        /* teacher forcing: every row is comparable to the oracle's */
        fx_forward(fx.w, DSV4_NUMERICS_FP8, fx.s, fc, fc->chunk, fx.out, NULL);
        double worst = 0.0, base_worst = 0.0;
        int worst_row = 0, judged = 0, agree = 0, base_rows = 0;
        for (int r = 0; r < fc->rows; r++) {
            double e = fx_row_error(out + (size_t)r * V, fc->logits + (size_t)r * V, V);
            /* the worst row relative to its own bound */
            if (!(e / fc->tol[r] <= worst / fc->tol[worst_row])) {
                worst = e;
                worst_row = r;
            }
            if (fc->tol[r] <= DSV4_FP8_MIN_TOL) {
                base_rows++;
                base_worst = fmax(base_worst, e);
            }
        }
        for (int t = 0; t < fc->decode; t++) {
            int r = fc->P - 1 + t;
            const float *ref = fc->logits + (size_t)r * V;
            int32_t mine = dsv4_greedy_argmax(out + (size_t)r * V, V);
            agree += mine == fc->tokens[fc->P + t];
            /* judged where the row's own bound cannot reorder the top two */
            double gap = top2_gap(ref, V);
            if (gap < DSV4_FP8_MIN_GAP || gap <= 2.0 * fc->tol[r])
                continue;
            judged++;
            if (mine != fc->tokens[fc->P + t])
                fail_msg("%s %s fp8: greedy token %d is %d, the oracle chose %d (margin %.2e)", dir, fc->name, t,
                         mine, fc->tokens[fc->P + t], gap);
        }
        print_message("# %s %s fp8 vs oracle: worst row %d of %d error %.2e, its bound %.1e; rows with the base "
                      "bound %.0e: %d, worst %.2e; greedy %d/%d agree, %d judged\n", dir, fc->name, worst_row,
                      fc->rows, worst, fc->tol[worst_row], DSV4_FP8_MIN_TOL, base_rows, base_worst, agree,
                      fc->decode, judged);
        if (!(worst <= fc->tol[worst_row]))
            fail_msg("%s %s fp8: row %d differs from the oracle by %.3e relative, bound %.1e", dir, fc->name,
                     worst_row, worst, fc->tol[worst_row]);
    }

    fx_fixture_close(&fx);
}

int main(void)
{
    return fx_main("test_fixtures_fp8", "fixtures_fp8", "cases_fp8.json", test_fixture);
}
