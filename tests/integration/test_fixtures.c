/* The CPU reference backend against transformers' deepseek_v4: every case of every fixture under
 * tests/fixtures/ (see tests/fixtures/README.md and tools/mkfixtures.py).
 *
 * exact numerics: every row within DSV4_FIXTURE_TOL (max |diff| / max |logit|) of transformers' logits,
 *   greedy tokens identical; chunked prefill bitwise equal to one-shot prefill; the backend ops
 *   (prefill + decode) bitwise equal to the direct forward.
 * fp8 numerics: the deviation from the exact fixture and the greedy agreement are reported as TAP
 *   comments; only sanity (finite logits, same rows) is asserted, since FP8/FP4 rounding is a
 *   different model of the numbers, not an error. */
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

#define DSV4_FIXTURE_TOL 1e-4
#define MAX_FIXTURES 32

struct fx_case {
    char name[64];
    int32_t *tokens;    /* [P + decode]: the prompt, then the fixture's greedy tokens */
    int P, decode, chunk, rows;
    float *logits;      /* [rows, V] transformers' */
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
    char *p = path_join(dir, "cases.json");
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
        struct fx_case *fc = &cs[i];
        snprintf(fc->name, sizeof(fc->name), "%s", json_string_value(json_object_get(c, "name")));
        fc->P = (int)json_array_size(toks);
        fc->decode = (int)json_integer_value(json_object_get(c, "decode"));
        fc->chunk = (int)json_integer_value(json_object_get(c, "chunk"));
        fc->rows = (int)json_integer_value(json_object_get(c, "rows"));
        assert_int_equal(json_integer_value(json_object_get(c, "vocab")), V);
        assert_int_equal(fc->rows, fc->P + fc->decode);
        assert_int_equal((int)json_array_size(greedy), fc->decode);
        assert_true(fc->P > 0);
        fc->tokens = malloc(sizeof(int32_t) * (size_t)fc->rows);
        assert_non_null(fc->tokens);
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

/* Prefill (one shot when chunk == 0) then greedy decode; out [rows, V], greedy [decode]. */
static void run(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                const struct fx_case *fc, int chunk, float *out, int32_t *greedy)
{
    int V = w->cfg.vocab_size;
    int step = chunk ? chunk : fc->P;
    dsv4_cpu_seq_reset(s);
    for (int start = 0; start < fc->P; start += step) {
        int n = fc->P - start < step ? fc->P - start : step;
        int rc = dsv4_cpu_forward(w, num, s, fc->tokens + start, n, out + (size_t)start * V, true);
        if (rc < 0)
            fail_msg("%s: %s", fc->name, dsv4_error_message());
    }
    for (int i = 0; i < fc->decode; i++) {
        greedy[i] = argmax(out + (size_t)(fc->P + i - 1) * V, V);
        int rc = dsv4_cpu_forward(w, num, s, &greedy[i], 1, out + (size_t)(fc->P + i) * V, true);
        if (rc < 0)
            fail_msg("%s: %s", fc->name, dsv4_error_message());
    }
}

/* max over rows of max |a - ref| / max |ref|; NaN propagates as a failure (returns INFINITY). */
static double worst_row_error(const float *a, const float *ref, int rows, int V, int *ret_row)
{
    double worst = 0.0;
    *ret_row = 0;
    for (int r = 0; r < rows; r++) {
        double diff = 0.0, mag = 0.0;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)a[(size_t)r * V + i] - ref[(size_t)r * V + i]);
            if (!(d == d))
                d = INFINITY;
            diff = fmax(diff, d);
            mag = fmax(mag, fabs((double)ref[(size_t)r * V + i]));
        }
        double e = mag > 0.0 ? diff / mag : INFINITY;
        if (!(e <= worst)) {
            worst = e;
            *ret_row = r;
        }
    }
    return worst;
}

/* The backend ops for the same case: prefill in the case's chunks, then decode. */
static void run_backend(const struct dsv4_weights *w, const struct fx_case *fc, float *out)
{
    int V = w->cfg.vocab_size;
    struct dsv4_backend_opts opts = {.max_batch = 2, .max_context = fc->rows, .numerics = DSV4_NUMERICS_EXACT};
    struct dsv4_backend *b = NULL;
    if (dsv4_backend_cpu_create(w, &opts, &b) < 0)
        fail_msg("backend: %s", dsv4_error_message());
    int slot = 1, step = fc->chunk ? fc->chunk : fc->P;
    for (int start = 0; start < fc->P; start += step) {
        int n = fc->P - start < step ? fc->P - start : step;
        assert_int_equal(b->ops->prefill(b, slot, fc->tokens + start, n, out + (size_t)start * V, true), 0);
    }
    for (int i = 0; i < fc->decode; i++) {
        int32_t next = argmax(out + (size_t)(fc->P + i - 1) * V, V);
        assert_int_equal(b->ops->decode(b, 1, &slot, &next, out + (size_t)(fc->P + i) * V), 0);
    }
    assert_int_equal(b->ops->slot_position(b, slot), fc->rows);
    assert_int_equal(b->ops->slot_position(b, 0), 0);
    dsv4_backend_destroy(b);
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
    float *oneshot = malloc(sizeof(float) * (size_t)max_rows * V);
    int32_t *greedy = malloc(sizeof(int32_t) * (size_t)max_rows);
    assert_true(out && oneshot && greedy);

    for (int i = 0; i < n; i++) {
        const struct fx_case *fc = &cs[i];
        size_t bytes = sizeof(float) * (size_t)fc->rows * V;
        int row;

        run(w, DSV4_NUMERICS_EXACT, s, fc, fc->chunk, out, greedy);
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
        run(w, DSV4_NUMERICS_EXACT, s, fc, 0, oneshot, greedy);
        if (memcmp(out, oneshot, bytes) != 0)
            fail_msg("%s %s: chunk %d differs from one-shot prefill", dir, fc->name, fc->chunk);
        run_backend(w, fc, out);
        if (memcmp(out, oneshot, bytes) != 0)
            fail_msg("%s %s: the backend ops differ from the direct forward", dir, fc->name);

        run(w, DSV4_NUMERICS_FP8, s, fc, fc->chunk, out, greedy);
        for (size_t k = 0; k < (size_t)fc->rows * V; k++)
            if (!isfinite(out[k]))
                fail_msg("%s %s fp8: non-finite logit at row %zu", dir, fc->name, k / V);
        /* Prompt rows only: decode rows follow fp8's own greedy choices once they differ. */
        double ferr = worst_row_error(out, fc->logits, fc->P, V, &row), mean = 0.0;
        for (int r = 0; r < fc->P; r++) {
            int unused;
            mean += worst_row_error(out + (size_t)r * V, fc->logits + (size_t)r * V, 1, V, &unused) / fc->P;
        }
        int agree = 0, prefix = 0;
        for (int t = 0; t < fc->decode; t++) {
            agree += greedy[t] == fc->tokens[fc->P + t];
            prefix += prefix == t && greedy[t] == fc->tokens[fc->P + t];
        }
        print_message("# %s %s fp8: prompt-row deviation mean %.2e, worst %.2e (row %d); greedy agreement "
                      "%d/%d, first %d identical\n", dir, fc->name, mean, ferr, row, agree, fc->decode, prefix);
    }

    for (int i = 0; i < n; i++) {
        free(cs[i].tokens);
        free(cs[i].logits);
    }
    free(cs);
    free(out);
    free(oneshot);
    free(greedy);
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
        fprintf(stderr, "test_fixtures: cannot open %s\n", root);
        return 1;
    }
    char *dirs[MAX_FIXTURES];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < MAX_FIXTURES) {
        if (e->d_name[0] == '.')
            continue;
        char *dir = path_join(root, e->d_name);
        char *cases = path_join(dir, "cases.json");
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
        fprintf(stderr, "test_fixtures: no fixture (DIR/cases.json) under %s\n", root);
        return 1;
    }
    qsort(dirs, (size_t)n, sizeof(char *), cmp_str);
    struct CMUnitTest tests[MAX_FIXTURES];
    for (int i = 0; i < n; i++)
        tests[i] = (struct CMUnitTest){.name = strrchr(dirs[i], '/') + 1, .test_func = test_fixture,
                                       .initial_state = dirs[i]};
    int rc = _cmocka_run_group_tests("fixtures", tests, (size_t)n, NULL, NULL);
    for (int i = 0; i < n; i++)
        free(dirs[i]);
    free(root);
    return rc;
}
