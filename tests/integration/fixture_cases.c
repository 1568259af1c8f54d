/* SPDX-License-Identifier: MIT */
/* See fixture_cases.h. */
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

#include "engine/error.h"
#include "tests/integration/fixture_cases.h"
#include "tools/greedy.h"

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

/* Every case of dir/file; the row bounds too when with_tol. Returns the number of cases. */
static int load_cases(const char *dir, const char *file, int V, bool with_tol, struct fx_case **ret)
{
    char *p = path_join(dir, file);
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
        assert_true(fc->P > 0 && fc->chunk >= 0);
        fc->tokens = malloc(sizeof(int32_t) * (size_t)fc->rows);
        assert_non_null(fc->tokens);
        if (with_tol) {
            json_t *tol = json_object_get(c, "row_tolerance");
            assert_int_equal((int)json_array_size(tol), fc->rows);
            fc->tol = malloc(sizeof(double) * (size_t)fc->rows);
            assert_non_null(fc->tol);
            for (int r = 0; r < fc->rows; r++)
                fc->tol[r] = json_number_value(json_array_get(tol, (size_t)r));
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

void fx_fixture_open(struct fx_fixture *fx, const char *dir, const char *file, bool with_tol)
{
    memset(fx, 0, sizeof(*fx));
    if (dsv4_weights_load(dir, &fx->w) < 0)
        fail_msg("%s: %s", dir, dsv4_error_message());
    fx->V = fx->w->cfg.vocab_size;
    fx->n = load_cases(dir, file, fx->V, with_tol, &fx->cs);
    assert_true(fx->n > 0);
    for (int i = 0; i < fx->n; i++)
        fx->max_rows = fx->cs[i].rows > fx->max_rows ? fx->cs[i].rows : fx->max_rows;
    assert_int_equal(dsv4_cpu_seq_create(fx->w, fx->max_rows, &fx->s), 0);
    fx->out = malloc(sizeof(float) * (size_t)fx->max_rows * fx->V);
    assert_non_null(fx->out);
}

void fx_fixture_close(struct fx_fixture *fx)
{
    for (int i = 0; i < fx->n; i++) {
        free(fx->cs[i].tokens);
        free(fx->cs[i].logits);
        free(fx->cs[i].tol);
    }
    free(fx->cs);
    free(fx->out);
    dsv4_cpu_seq_free(fx->s);
    dsv4_weights_free(fx->w);
}

void fx_forward(const struct dsv4_weights *w, enum dsv4_numerics num, struct dsv4_cpu_seq *s,
                const struct fx_case *fc, int chunk, float *out, int32_t *greedy)
{
    int V = w->cfg.vocab_size;
    int step = chunk ? chunk : fc->P;
    dsv4_cpu_seq_reset(s);
    for (int start = 0; start < fc->P; start += step) {
        int n = fc->P - start < step ? fc->P - start : step;
        if (dsv4_cpu_forward(w, num, s, fc->tokens + start, n, out + (size_t)start * V, true) < 0)
            fail_msg("%s: %s", fc->name, dsv4_error_message());
    }
    for (int i = 0; i < fc->decode; i++) {
        const int32_t *next = &fc->tokens[fc->P + i];
        if (greedy) {
            greedy[i] = dsv4_greedy_argmax(out + (size_t)(fc->P + i - 1) * V, V);
            next = &greedy[i];
        }
        if (dsv4_cpu_forward(w, num, s, next, 1, out + (size_t)(fc->P + i) * V, true) < 0)
            fail_msg("%s: %s", fc->name, dsv4_error_message());
    }
}

double fx_row_error(const float *a, const float *ref, int V)
{
    double diff = 0.0, mag = 0.0;
    for (int i = 0; i < V; i++) {
        double d = fabs((double)a[i] - ref[i]);
        diff = d == d ? fmax(diff, d) : INFINITY;
        mag = fmax(mag, fabs((double)ref[i]));
    }
    return mag > 0.0 ? diff / mag : INFINITY;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int fx_main(const char *prog, const char *group, const char *file, void (*test)(void **state))
{
    const char *top = getenv("top_srcdir");
    char *root = path_join(top ? top : ".", "tests/fixtures");
    DIR *d = opendir(root);
    if (!d) {
        fprintf(stderr, "%s: cannot open %s\n", prog, root);
        return 1;
    }
    char *dirs[FX_MAX_FIXTURES];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < FX_MAX_FIXTURES) {
        if (e->d_name[0] == '.')
            continue;
        char *dir = path_join(root, e->d_name);
        char *cases = path_join(dir, file);
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
        fprintf(stderr, "%s: no fixture (DIR/%s) under %s\n", prog, file, root);
        return 1;
    }
    qsort(dirs, (size_t)n, sizeof(char *), cmp_str);
    struct CMUnitTest tests[FX_MAX_FIXTURES];
    for (int i = 0; i < n; i++)
        tests[i] = (struct CMUnitTest){.name = strrchr(dirs[i], '/') + 1, .test_func = test,
                                       .initial_state = dirs[i]};
    int rc = _cmocka_run_group_tests(group, tests, (size_t)n, NULL, NULL);
    for (int i = 0; i < n; i++)
        free(dirs[i]);
    free(root);
    return rc;
}
