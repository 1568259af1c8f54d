/* SPDX-License-Identifier: MIT */
/* The CUDA backend's switch table (kernels/switches.c): defaults, every accepted value, refused
 * values with a message naming the variable, and README.md and dsv4d(8) listing exactly the
 * table's switches. Needs no GPU. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/error.h"
#include "kernels/switches.h"

#define MAX_NAMES 64

static void clear_env(void)
{
    for (int i = 0; i < dsv4_cuda_switch_count(); i++)
        unsetenv(dsv4_cuda_switch_name(i));
}

static void test_defaults(void **state)
{
    struct dsv4_cuda_switches sw;
    char line[512];
    (void)state;
    clear_env();
    assert_int_equal(dsv4_cuda_switches_read(&sw), 0);
    assert_true(sw.graphs && sw.gemm && sw.gemm_wgmma && sw.pdl && sw.sample && sw.moe_mma && sw.branches && sw.moe_tiles &&
                sw.att_whole && sw.expert_fetch);
    assert_false(sw.log);
    assert_int_equal(sw.gemm_stages, 4);
    assert_int_equal(sw.gemm_prefetch_kb, DSV4_CUDA_PREFETCH_KB_DEFAULT);
    assert_int_equal(sw.att_heads, 0);
    dsv4_cuda_switches_describe(&sw, line, sizeof(line));
    for (int i = 0; i < dsv4_cuda_switch_count(); i++)
        assert_non_null(strstr(line, dsv4_cuda_switch_name(i)));
    assert_non_null(strstr(line, "DSV4_CUDA_GRAPHS=1"));
    assert_non_null(strstr(line, "DSV4_CUDA_GEMM_PREFETCH_KB=8192"));
}

static void test_values(void **state)
{
    struct dsv4_cuda_switches sw;
    (void)state;
    clear_env();
    setenv("DSV4_CUDA_GRAPHS", "0", 1);
    setenv("DSV4_CUDA_BRANCHES", "0", 1);
    setenv("DSV4_CUDA_LOG", "1", 1);
    setenv("DSV4_CUDA_GEMM_STAGES", "2", 1);
    setenv("DSV4_CUDA_GEMM_PREFETCH_KB", "0", 1);
    setenv("DSV4_CUDA_ATT_HEADS", "16", 1);
    setenv("DSV4_CUDA_GEMM_WGMMA", "0", 1);
    setenv("DSV4_CUDA_ATT_WHOLE", "0", 1);
    setenv("DSV4_CUDA_EXPERT_FETCH", "0", 1);
    assert_int_equal(dsv4_cuda_switches_read(&sw), 0);
    assert_false(sw.expert_fetch);
    assert_false(sw.gemm_wgmma);
    assert_false(sw.att_whole);
    assert_int_equal(sw.att_heads, 16);
    assert_false(sw.graphs);
    assert_false(sw.branches);
    assert_true(sw.log && sw.gemm && sw.pdl);
    assert_int_equal(sw.gemm_stages, 2);
    assert_int_equal(sw.gemm_prefetch_kb, 0);
    setenv("DSV4_CUDA_GEMM_PREFETCH_KB", "1048576", 1);
    setenv("DSV4_CUDA_EXPERT_FETCH", "2", 1);
    assert_int_equal(dsv4_cuda_switches_read(&sw), 0);
    assert_int_equal(sw.gemm_prefetch_kb, 1048576);
    assert_int_equal(sw.expert_fetch, 2);
    clear_env();
}

/* What used to be ignored or clamped silently is refused, and the message says what is allowed. */
static void test_refused(void **state)
{
    static const struct { const char *name, *value, *says; } bad[] = {
        { "DSV4_CUDA_GRAPHS", "off", "0 or 1" },     { "DSV4_CUDA_PDL", "", "0 or 1" },
        { "DSV4_CUDA_SAMPLE", "2", "0 or 1" },       { "DSV4_CUDA_GEMM_STAGES", "3", "2 or 4" },
        { "DSV4_CUDA_GEMM_PREFETCH_KB", "-1", "0 to" }, { "DSV4_CUDA_GEMM_PREFETCH_KB", "1048577", "0 to" },
        { "DSV4_CUDA_GEMM_PREFETCH_KB", "8M", "0 to" }, { "DSV4_CUDA_LOG", "yes", "0 or 1" },
        { "DSV4_CUDA_GEMM_WGMMA", "on", "0 or 1" },
        { "DSV4_CUDA_ATT_HEADS", "8", "16, 32 or 64" }, { "DSV4_CUDA_ATT_HEADS", "128", "16, 32 or 64" },
        { "DSV4_CUDA_EXPERT_FETCH", "4", "1 to 3" },   { "DSV4_CUDA_EXPERT_FETCH", "on", "1 to 3" },
        { "DSV4_CUDA_EXPERT_FETCH", "", "1 to 3" },
    };
    struct dsv4_cuda_switches sw;
    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        clear_env();
        setenv(bad[i].name, bad[i].value, 1);
        assert_int_equal(dsv4_cuda_switches_read(&sw), -EINVAL);
        if (!strstr(dsv4_error_message(), bad[i].name) || !strstr(dsv4_error_message(), bad[i].says))
            fail_msg("%s=%s: message '%s' should name the variable and say '%s'", bad[i].name, bad[i].value,
                     dsv4_error_message(), bad[i].says);
        assert_true(sw.graphs && sw.gemm_stages == 4);     /* the defaults on refusal */
    }
    clear_env();
}

/* The distinct DSV4_CUDA_* names a document of the source tree mentions, into names[max]. */
static int doc_names(const char *rel, char names[][48], int max)
{
    static char text[1 << 20];
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, rel);
    FILE *f = fopen(path, "r");
    if (!f)
        fail_msg("cannot read %s", path);
    const size_t tl = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[tl] = '\0';
    int n = 0;
    for (const char *p = strstr(text, "DSV4_CUDA_"); p; p = strstr(p + 1, "DSV4_CUDA_")) {
        char cur[48];
        size_t k = 0;
        while (k + 1 < sizeof(cur) && ((p[k] >= 'A' && p[k] <= 'Z') || (p[k] >= '0' && p[k] <= '9') || p[k] == '_')) {
            cur[k] = p[k];
            k++;
        }
        while (k > 0 && p[k - 1] == '_')       /* "DSV4_CUDA_*" in prose */
            k--;
        cur[k] = '\0';
        if (k <= strlen("DSV4_CUDA"))           /* the prefix alone, in prose */
            continue;
        bool dup = false;
        for (int i = 0; i < n; i++)
            dup = dup || strcmp(names[i], cur) == 0;
        if (!dup && n < max)
            strcpy(names[n++], cur);
    }
    return n;
}

static bool in_table(const char *name)
{
    for (int i = 0; i < dsv4_cuda_switch_count(); i++)
        if (strcmp(dsv4_cuda_switch_name(i), name) == 0)
            return true;
    return false;
}

/* Names that the CUDA code defines as constants, not switches, and that documents may mention. */
static bool is_constant(const char *name)
{
    return strcmp(name, "DSV4_CUDA_MAX_BATCH") == 0;
}

static void check_doc(const char *rel)
{
    char names[MAX_NAMES][48];
    const int n = doc_names(rel, names, MAX_NAMES);
    for (int i = 0; i < n; i++)
        if (!in_table(names[i]) && !is_constant(names[i]))
            fail_msg("%s names %s, which is not a switch of the table (kernels/switches.c)", rel, names[i]);
    for (int t = 0; t < dsv4_cuda_switch_count(); t++) {
        bool found = false;
        for (int i = 0; i < n; i++)
            found = found || strcmp(names[i], dsv4_cuda_switch_name(t)) == 0;
        if (!found)
            fail_msg("%s does not document %s", rel, dsv4_cuda_switch_name(t));
    }
}

static void test_documented(void **state)
{
    char path[4096];
    (void)state;
    check_doc("README.md");
    /* dsv4d(8) is a template where configure fills in paths, or the page itself */
    snprintf(path, sizeof(path), "%s/doc/dsv4d.8.in", DSV4_SRCDIR);
    FILE *f = fopen(path, "r");
    if (f) {
        fclose(f);
        check_doc("doc/dsv4d.8.in");
    } else {
        check_doc("doc/dsv4d.8");
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_values),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_documented),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
