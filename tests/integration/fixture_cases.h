/* SPDX-License-Identifier: MIT */
/* Test helper shared by test_fixtures (exact numerics against transformers) and test_fixtures_fp8 (fp8
 * numerics against tools/mkfixtures_fp8.py's oracle): loading a fixture's cases, running the CPU forward
 * over a case, the per-row error, and a main() that runs one test per fixture model directory. */
#ifndef DSV4_TESTS_FIXTURE_CASES_H
#define DSV4_TESTS_FIXTURE_CASES_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/cpu/cpu_forward.h"
#include "engine/model/weights.h"

#define FX_MAX_FIXTURES 32

struct fx_case {
    char name[64];
    int32_t *tokens;    /* [P + decode]: the prompt, then the reference's greedy tokens */
    int P, decode, chunk, rows;
    float *logits;      /* [rows, V] the reference's */
    double *tol;        /* [rows] the reference's bound on max |diff| / max |logit| of each row, or NULL */
};

/* One fixture model directory opened for a test: its weights, the cases of one case file (a JSON array,
 * tests/fixtures/README.md; the row bounds from "row_tolerance" when with_tol), a CPU sequence and an
 * output buffer sized for the longest case. */
struct fx_fixture {
    struct dsv4_weights *w;
    int V;                      /* vocab_size */
    struct fx_case *cs;
    int n;                      /* cases, at least 1 */
    int max_rows;
    struct dsv4_cpu_seq *s;
    float *out;                 /* [max_rows, V] */
};

/* Fails the test on any error (a malformed case included). */
void fx_fixture_open(struct fx_fixture *fx, const char *dir, const char *file, bool with_tol);
void fx_fixture_close(struct fx_fixture *fx);

/* Prefill the case's prompt in chunks of chunk (one shot when 0), then decode: with greedy, each step is
 * fed the argmax (dsv4_greedy_argmax) of the previous row, stored in greedy [decode]; without (NULL), the case's own greedy
 * tokens (teacher forcing). out [rows, V]. */
void fx_forward(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                const struct fx_case *fc, int chunk, float *out, int32_t *greedy);

/* One row's max |a - ref| / max |ref| over V logits; NaN (or an all-zero reference) gives INFINITY. */
double fx_row_error(const float *a, const float *ref, int V);

/* One cmocka test per directory under $top_srcdir/tests/fixtures that holds `file`, in name order, each
 * given its directory as *state. Returns main()'s status. */
int fx_main(const char *prog, const char *group, const char *file, void (*test)(void **state));

#endif
