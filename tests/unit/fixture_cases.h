/* SPDX-License-Identifier: MIT */
/* Test helper: the committed fixture models' cases (tests/fixtures/<model>/cases.json: a prompt, the
 * prefill chunk it was run in, transformers' greedy continuation). Header-only so each test program
 * includes what it needs, after cmocka.h. */
#ifndef DSV4_TESTS_FIXTURE_CASES_H
#define DSV4_TESTS_FIXTURE_CASES_H

#include <jansson.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define FIXTURE_CASES_MAX 8
#define FIXTURE_CASE_TOKENS 256     /* prompt + greedy tokens of one case */

struct fixture_case {
    int32_t seq[FIXTURE_CASE_TOKENS];   /* the prompt, then transformers' greedy tokens */
    int n_prompt, n_greedy;
    int chunk;                          /* the prefill chunk the reference ran (0: whole prompt) */
};

/* $top_srcdir/tests/fixtures/<model> (or ./tests/... without top_srcdir). */
static inline void fixture_dir(const char *model, char *out, size_t cap)
{
    const char *top = getenv("top_srcdir");
    snprintf(out, cap, "%s/tests/fixtures/%s", top ? top : ".", model);
}

/* Up to FIXTURE_CASES_MAX cases of model into cases; returns how many. */
static inline int fixture_cases_load(const char *model, struct fixture_case *cases)
{
    char dir[PATH_MAX], path[PATH_MAX + 16];
    fixture_dir(model, dir, sizeof(dir));
    snprintf(path, sizeof(path), "%s/cases.json", dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        fail_msg("%s: %s", path, jerr.text);
    int n = 0;
    size_t i;
    json_t *c;
    json_array_foreach(root, i, c) {
        if (n == FIXTURE_CASES_MAX)
            break;
        struct fixture_case *f = &cases[n++];
        json_t *t = json_object_get(c, "tokens"), *g = json_object_get(c, "greedy");
        f->n_prompt = (int)json_array_size(t);
        f->n_greedy = (int)json_array_size(g);
        assert_true(f->n_prompt + f->n_greedy <= FIXTURE_CASE_TOKENS);
        for (int k = 0; k < f->n_prompt; k++)
            f->seq[k] = (int32_t)json_integer_value(json_array_get(t, (size_t)k));
        for (int k = 0; k < f->n_greedy; k++)
            f->seq[f->n_prompt + k] = (int32_t)json_integer_value(json_array_get(g, (size_t)k));
        f->chunk = (int)json_integer_value(json_object_get(c, "chunk"));
    }
    json_decref(root);
    return n;
}

#endif
