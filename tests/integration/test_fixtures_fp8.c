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

#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <jansson.h>

#include "engine/backend.h"
#include "engine/cpu_forward.h"
#include "engine/error.h"
#include "engine/weights.h"

#define DSV4_FP8_MIN_TOL 1e-4     /* the exact numerics' bound */
#define DSV4_FP8_MAX_TOL 5e-2
#define DSV4_FP8_MIN_GAP 1e-3     /* (top1 - top2) / max |logit| of the oracle row */
#define MAX_FIXTURES 32

struct fx_case {
    char name[64];
    int32_t *tokens;    /* [P + decode]: the prompt, then the oracle's greedy tokens */
    int P, decode, chunk, rows;
    float *logits;      /* [rows, V] the oracle's */
    double *tol;        /* [rows] the oracle's bound on max |diff| / max |logit| of each row */
};

static char *path_join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = malloc(n);
    assert_non_null(p);
    snprintf(p, n, "%s/%s", a, b);
    return p;
}

static float *read_f32(const char *path, size_t n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    float *v = malloc(n * sizeof(float));
    assert_non_null(v);
    size_t got = fread(v, sizeof(float), n, f);
    int extra = fgetc(f);
    fclose(f);
    if (got != n || extra != EOF)
        fail_msg("%s: expected exactly %zu float32 values", path, n);
    return v;
}

static int load_cases(const char *dir, int V, struct fx_case **ret)
{
    char *p = path_join(dir, "cases_fp8.json");
    json_error_t err;
    json_t *root = json_load_file(p, 0, &err);
    if (!root)
        fail_msg("%s:%d: %s", p, err.line, err.text);
    assert_true(json_is_array(root));
    int n = (int)json_array_size(root);
    struct fx_case *cs = calloc((size_t)n, sizeof(*cs));
    assert_non_null(cs);
    for (int i = 0; i < n; i++) {
        json_t *c = json_array_get(root, (size_t)i);
        json_t *toks = json_object_get(c, "tokens"), *greedy = json_object_get(c, "greedy");
        json_t *tol = json_object_get(c, "row_tolerance");
        struct fx_case *fc = &cs[i];
        snprintf(fc->name, sizeof(fc->name), "%s", json_string_value(json_object_get(c, "name")));
        fc->P = (int)json_array_size(toks);
        fc->decode = (int)json_integer_value(json_object_get(c, "decode"));
        fc->chunk = (int)json_integer_value(json_object_get(c, "chunk"));
        fc->rows = (int)json_integer_value(json_object_get(c, "rows"));
        assert_int_equal(json_integer_value(json_object_get(c, "vocab")), V);
        assert_int_equal(fc->rows, fc->P + fc->decode);
        assert_int_equal((int)json_array_size(greedy), fc->decode);
        assert_true(fc->P > 0 && fc->chunk >= 0);
        assert_int_equal((int)json_array_size(tol), fc->rows);
        fc->tokens = malloc(sizeof(int32_t) * (size_t)fc->rows);
        fc->tol = malloc(sizeof(double) * (size_t)fc->rows);
        assert_true(fc->tokens && fc->tol);
        for (int r = 0; r < fc->rows; r++) {
            fc->tol[r] = json_number_value(json_array_get(tol, (size_t)r));
            /* a bound looser than DSV4_FP8_MAX_TOL could no longer tell a misplaced rounding */
            assert_true(fc->tol[r] >= DSV4_FP8_MIN_TOL && fc->tol[r] <= DSV4_FP8_MAX_TOL);
        }
        for (int t = 0; t < fc->P; t++)
            fc->tokens[t] = (int32_t)json_integer_value(json_array_get(toks, (size_t)t));
        for (int t = 0; t < fc->decode; t++)
            fc->tokens[fc->P + t] = (int32_t)json_integer_value(json_array_get(greedy, (size_t)t));
        char *lp = path_join(dir, json_string_value(json_object_get(c, "logits")));
        fc->logits = read_f32(lp, (size_t)fc->rows * V);
        free(lp);
    }
    json_decref(root);
    free(p);
    *ret = cs;
    return n;
}

static int32_t argmax(const float *row, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (row[i] > row[best])
            best = i;
    return best;
}

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

/* Prefill the prompt (one shot when chunk == 0), then one step per oracle greedy token: out [rows, V]. */
static void run(const struct dsv4_weights *w, struct dsv4_cpu_seq *s, const struct fx_case *fc, float *out)
{
    int V = w->cfg.vocab_size;
    int step = fc->chunk ? fc->chunk : fc->P;
    dsv4_cpu_seq_reset(s);
    for (int start = 0; start < fc->P; start += step) {
        int n = fc->P - start < step ? fc->P - start : step;
        if (dsv4_cpu_forward(w, DSV4_NUMERICS_FP8, s, fc->tokens + start, n, out + (size_t)start * V, true) < 0)
            fail_msg("%s: %s", fc->name, dsv4_error_message());
    }
    for (int i = 0; i < fc->decode; i++)
        if (dsv4_cpu_forward(w, DSV4_NUMERICS_FP8, s, &fc->tokens[fc->P + i], 1, out + (size_t)(fc->P + i) * V,
                             true) < 0)
            fail_msg("%s: %s", fc->name, dsv4_error_message());
}

/* Row r's max |a - ref| / max |ref|; NaN gives INFINITY. */
static double row_error(const float *a, const float *ref, int V)
{
    double diff = 0.0, mag = 0.0;
    for (int i = 0; i < V; i++) {
        double d = fabs((double)a[i] - ref[i]);
        diff = d == d ? fmax(diff, d) : INFINITY;
        mag = fmax(mag, fabs((double)ref[i]));
    }
    return mag > 0.0 ? diff / mag : INFINITY;
}

static void test_fixture(void **state)
{
    const char *dir = *state;
    struct dsv4_weights *w = NULL;
    if (dsv4_weights_load(dir, &w) < 0)
        fail_msg("%s: %s", dir, dsv4_error_message());
    int V = w->cfg.vocab_size;
    struct fx_case *cs;
    int n = load_cases(dir, V, &cs);
    assert_true(n > 0);

    int max_rows = 0;
    for (int i = 0; i < n; i++)
        max_rows = cs[i].rows > max_rows ? cs[i].rows : max_rows;
    struct dsv4_cpu_seq *s = NULL;
    assert_int_equal(dsv4_cpu_seq_create(w, max_rows, &s), 0);
    float *out = malloc(sizeof(float) * (size_t)max_rows * V);
    assert_non_null(out);

    for (int i = 0; i < n; i++) {
        const struct fx_case *fc = &cs[i];
        run(w, s, fc, out);
        double worst = 0.0, base_worst = 0.0;
        int worst_row = 0, judged = 0, agree = 0, base_rows = 0;
        for (int r = 0; r < fc->rows; r++) {
            double e = row_error(out + (size_t)r * V, fc->logits + (size_t)r * V, V);
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
            int32_t mine = argmax(out + (size_t)r * V, V);
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

    for (int i = 0; i < n; i++) {
        free(cs[i].tokens);
        free(cs[i].logits);
        free(cs[i].tol);
    }
    free(cs);
    free(out);
    dsv4_cpu_seq_free(s);
    dsv4_weights_free(w);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(void)
{
    const char *top = getenv("top_srcdir");
    char *root = path_join(top ? top : ".", "tests/fixtures");
    DIR *d = opendir(root);
    if (!d) {
        fprintf(stderr, "test_fixtures_fp8: cannot open %s\n", root);
        return 1;
    }
    char *dirs[MAX_FIXTURES];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < MAX_FIXTURES) {
        if (e->d_name[0] == '.')
            continue;
        char *dir = path_join(root, e->d_name);
        char *cases = path_join(dir, "cases_fp8.json");
        FILE *f = fopen(cases, "r");
        free(cases);
        if (f) {
            fclose(f);
            dirs[n++] = dir;
        } else {
            free(dir);
        }
    }
    closedir(d);
    if (n == 0) {
        fprintf(stderr, "test_fixtures_fp8: no fixture (DIR/cases_fp8.json) under %s\n", root);
        return 1;
    }
    qsort(dirs, (size_t)n, sizeof(char *), cmp_str);
    struct CMUnitTest tests[MAX_FIXTURES];
    for (int i = 0; i < n; i++)
        tests[i] = (struct CMUnitTest){.name = strrchr(dirs[i], '/') + 1, .test_func = test_fixture,
                                       .initial_state = dirs[i]};
    int rc = _cmocka_run_group_tests("fixtures_fp8", tests, (size_t)n, NULL, NULL);
    for (int i = 0; i < n; i++)
        free(dirs[i]);
    free(root);
    return rc;
}
