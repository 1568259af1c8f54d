/* SPDX-License-Identifier: MIT */
/* engine/model/placement: which routed experts stay on the GPU and which go to host memory, and
 * the routing-statistics file that steers it. */
#include "build-config.h"

#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/model/config.h"
#include "engine/model/placement.h"
#include "tests/unit/seed_util.h"

static uint64_t seed;

static uint64_t rnd(void)
{
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
}

static int gpu_experts(const struct dsv4_placement *p, int l)
{
    int n = 0;
    for (int e = 0; e < p->n_experts; e++)
        n += !dsv4_placement_on_host(p, l, e);
    return n;
}

static void test_all_fit(void **state)
{
    const uint64_t bytes[3] = { 100, 100, 100 };
    struct dsv4_placement_req r = { .n_layers = 3, .n_experts = 8, .expert_bytes = bytes, .gpu_budget = 2400 };
    struct dsv4_placement *p;
    for (int mode = DSV4_EXPERT_OFFLOAD_AUTO; mode <= DSV4_EXPERT_OFFLOAD_OFF; mode++) {
        r.mode = (enum dsv4_expert_offload)mode;
        assert_int_equal(dsv4_placement_plan(&r, &p), 0);
        assert_false(p->offload);
        assert_int_equal(p->gpu_bytes, 2400);
        assert_int_equal(p->host_bytes, 0);
        for (int l = 0; l < 3; l++)
            assert_int_equal(gpu_experts(p, l), 8);
        assert_string_equal(dsv4_placement_rule(p), "every expert on the GPU");
        dsv4_placement_free(p);
    }
}

static void test_off_refuses(void **state)
{
    const uint64_t bytes[2] = { 1ull << 30, 1ull << 30 };
    struct dsv4_placement_req r = { .n_layers = 2, .n_experts = 4, .expert_bytes = bytes,
                                    .gpu_budget = 7ull << 30, .mode = DSV4_EXPERT_OFFLOAD_OFF };
    struct dsv4_placement *p = NULL;
    assert_int_equal(dsv4_placement_plan(&r, &p), -ENOMEM);
    assert_null(p);
    assert_non_null(strstr(dsv4_error_message(), "take 8.00 GiB and 7.00 GiB"));
    assert_non_null(strstr(dsv4_error_message(), "expert_offload = auto"));
}

static void test_bad_requests(void **state)
{
    const uint64_t bytes[2] = { 10, 10 };
    struct dsv4_placement_req r = { .n_layers = 2, .n_experts = 4, .expert_bytes = bytes, .gpu_budget = 1000,
                                    .host_percent = 50 };
    struct dsv4_placement *p = NULL;
    assert_int_equal(dsv4_placement_plan(&r, &p), -EINVAL);     /* a share without mode on */
    assert_non_null(strstr(dsv4_error_message(), "needs expert_offload = on"));
    r.mode = DSV4_EXPERT_OFFLOAD_ON;
    r.host_percent = 101;
    assert_int_equal(dsv4_placement_plan(&r, &p), -EINVAL);
    r.host_percent = 0;
    r.n_experts = 0;
    assert_int_equal(dsv4_placement_plan(&r, &p), -EINVAL);
    assert_null(p);
}

/* No statistics: layers share the GPU evenly, each keeping its lowest expert ids. */
static void test_even(void **state)
{
    const uint64_t bytes[4] = { 100, 100, 100, 100 };
    struct dsv4_placement_req r = { .n_layers = 4, .n_experts = 8, .expert_bytes = bytes, .gpu_budget = 1599 };
    struct dsv4_placement *p;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    assert_true(p->offload);
    assert_false(p->from_counts);
    assert_int_equal(p->gpu_bytes, 1500);
    assert_int_equal(p->host_bytes, 1700);
    const int want[4] = { 4, 4, 4, 3 };
    for (int l = 0; l < 4; l++) {
        assert_int_equal(gpu_experts(p, l), want[l]);
        assert_int_equal(p->host_experts[l], 8 - want[l]);
        for (int e = 0; e < 8; e++)
            assert_int_equal(dsv4_placement_on_host(p, l, e), e >= want[l]);
    }
    assert_string_equal(dsv4_placement_rule(p), "experts spread evenly");
    dsv4_placement_free(p);
}

/* Statistics: the most routed experts across all layers take the GPU. */
static void test_hottest_first(void **state)
{
    const uint64_t bytes[2] = { 10, 10 };
    const uint64_t counts[2 * 4] = { 5, 900, 0, 7, /* layer 1 */ 300, 300, 1000, 2 };
    struct dsv4_placement_req r = { .n_layers = 2, .n_experts = 4, .expert_bytes = bytes, .gpu_budget = 45,
                                    .counts = counts };
    struct dsv4_placement *p;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    assert_true(p->from_counts);
    /* 4 fit: 1000 (1,2), 900 (0,1), then the tie at 300 in expert order (1,0) and (1,1) */
    const uint8_t want[8] = { 1, 0, 1, 1, /* layer 1 */ 0, 0, 0, 1 };
    for (int i = 0; i < 8; i++)
        assert_int_equal(p->on_host[i], want[i]);
    assert_int_equal(p->host_experts[0], 3);
    assert_int_equal(p->host_experts[1], 1);
    assert_int_equal(p->gpu_bytes, 40);
    assert_int_equal(p->host_bytes, 40);
    dsv4_placement_free(p);
}

/* mode on with a share: at least that share of every layer on the host even when all would fit. */
static void test_forced_share(void **state)
{
    const uint64_t bytes[3] = { 64, 64, 64 };
    const uint64_t counts[3 * 6] = { 1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0, 0, 9, 1, 9, 1, 9, 1 };
    struct dsv4_placement_req r = { .n_layers = 3, .n_experts = 6, .expert_bytes = bytes, .gpu_budget = 1u << 30,
                                    .mode = DSV4_EXPERT_OFFLOAD_ON, .host_percent = 40 };
    struct dsv4_placement *p;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    for (int l = 0; l < 3; l++)
        assert_int_equal(p->host_experts[l], 3);    /* ceil(6 * 40%) = 3 */
    for (int e = 0; e < 6; e++)
        assert_int_equal(dsv4_placement_on_host(p, 0, e), e >= 3);
    dsv4_placement_free(p);
    r.counts = counts;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    const uint8_t want[18] = { 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 1 };
    for (int i = 0; i < 18; i++)
        assert_int_equal(p->on_host[i], want[i]);
    dsv4_placement_free(p);
    r.host_percent = 100;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    assert_int_equal(p->gpu_bytes, 0);
    assert_int_equal(p->host_bytes, 3 * 6 * 64);
    dsv4_placement_free(p);
}

/* A layer whose experts cannot move (bytes 0) stays on the GPU and outside the budget; layers of
 * different sizes fill what is left. */
static void test_fixed_layers_and_sizes(void **state)
{
    const uint64_t bytes[3] = { 0, 300, 100 };
    struct dsv4_placement_req r = { .n_layers = 3, .n_experts = 4, .expert_bytes = bytes, .gpu_budget = 1000 };
    struct dsv4_placement *p;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    assert_int_equal(gpu_experts(p, 0), 4);
    assert_int_equal(p->host_experts[0], 0);
    /* order (1,0) (2,0) (1,1) (2,1) (1,2) (2,2) ...: 300+100+300+100 = 800, (1,2) would make 1100:
     * skipped, (2,2) fits (900), (1,3) not, (2,3) fits (1000) */
    assert_int_equal(gpu_experts(p, 1), 2);
    assert_int_equal(gpu_experts(p, 2), 4);
    assert_int_equal(p->gpu_bytes, 1000);
    assert_int_equal(p->host_bytes, 600);
    dsv4_placement_free(p);
}

/* Random requests: the plan never exceeds the budget, accounts for every byte, keeps the share,
 * and (uniform sizes) never leaves a hotter expert on the host than one on the GPU. */
static void test_random_invariants(void **state)
{
    for (int it = 0; it < 300; it++) {
        const int L = 1 + (int)(rnd() % 12), E = 1 + (int)(rnd() % 40);
        const uint64_t eb = 1 + rnd() % 1000;
        uint64_t *bytes = calloc(L, sizeof(*bytes)), *counts = calloc((size_t)L * E, sizeof(*counts));
        assert_non_null(bytes);
        assert_non_null(counts);
        for (int l = 0; l < L; l++)
            bytes[l] = eb;
        for (int i = 0; i < L * E; i++)
            counts[i] = rnd() % 50;
        const bool with_counts = rnd() & 1;
        struct dsv4_placement_req r = { .n_layers = L, .n_experts = E, .expert_bytes = bytes,
                                        .gpu_budget = rnd() % (eb * L * E + eb), .counts = with_counts ? counts : NULL };
        if (rnd() & 1) {
            r.mode = DSV4_EXPERT_OFFLOAD_ON;
            r.host_percent = (int)(rnd() % 101);
        }
        struct dsv4_placement *p;
        assert_int_equal(dsv4_placement_plan(&r, &p), 0);
        int gpu = 0;
        uint64_t min_gpu = UINT64_MAX, max_host = 0;
        for (int l = 0; l < L; l++) {
            const int g = gpu_experts(p, l);
            gpu += g;
            assert_int_equal(p->host_experts[l], E - g);
            assert_true(E - g >= (E * r.host_percent + 99) / 100);
            for (int e = 0; e < E; e++) {
                const uint64_t cnt = counts[(size_t)l * E + e];
                if (dsv4_placement_on_host(p, l, e))
                    max_host = cnt > max_host ? cnt : max_host;
                else
                    min_gpu = cnt < min_gpu ? cnt : min_gpu;
            }
        }
        assert_true(p->gpu_bytes <= r.gpu_budget || (!p->offload && r.host_percent == 0));
        assert_int_equal(p->gpu_bytes, (uint64_t)gpu * eb);
        assert_int_equal(p->gpu_bytes + p->host_bytes, eb * L * E);
        const int fit = (int)(r.gpu_budget / eb);
        if (r.host_percent == 0)
            assert_int_equal(gpu, fit < L * E ? fit : L * E);
        if (with_counts && r.host_percent == 0 && gpu > 0 && gpu < L * E)
            assert_true(min_gpu >= max_host);
        dsv4_placement_free(p);
        free(bytes);
        free(counts);
    }
}

static char *tmp_path(char *buf, size_t n)
{
    snprintf(buf, n, "%s/dsv4-routing-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    int fd = mkstemp(buf);
    assert_true(fd >= 0);
    close(fd);
    return buf;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_stats_file(void **state)
{
    char path[256], model[16];
    const int L = 3, E = 5;
    uint64_t counts[15], back[15];
    for (int i = 0; i < L * E; i++)
        counts[i] = rnd() % 100000 + (i == 7 ? (1ull << 40) : 0);
    tmp_path(path, sizeof(path));
    assert_int_equal(dsv4_routing_stats_write(path, "tiny", L, E, counts), 0);
    memset(back, 0xff, sizeof(back));
    assert_int_equal(dsv4_routing_stats_read(path, L, E, back), 0);
    assert_memory_equal(back, counts, sizeof(counts));
    memset(back, 0xff, sizeof(back));
    assert_int_equal(dsv4_routing_stats_read_model(path, L, E, back, model, sizeof(model)), 0);
    assert_memory_equal(back, counts, sizeof(counts));
    assert_string_equal(model, "tiny");
    assert_int_equal(dsv4_routing_stats_read_model(path, L, E, back, model, 3), 0);
    assert_string_equal(model, "ti");

    assert_int_equal(dsv4_routing_stats_read(path, L, E + 1, back), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "of 3 layers x 5 experts; the model has 3 x 6"));
    write_text(path, "{\"format\": \"dsv4d-routing-stats\", \"version\": 1, \"n_layers\": 1, \"n_experts\": 2, "
                     "\"counts\": [[1, -4]]}");
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "layer 0 expert 1: not a count"));
    write_text(path, "{\"format\": \"dsv4d-routing-stats\", \"version\": 1, \"n_layers\": 1, \"n_experts\": 2, "
                     "\"counts\": [[1]]}");
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "layer 0 is not an array of 2 counts"));
    write_text(path, "{\"format\": \"dsv4d-routing-stats\", \"version\": 1, \"n_layers\": 1, \"n_experts\": 2, "
                     "\"counts\": [[1, 2]]}");
    assert_int_equal(dsv4_routing_stats_read_model(path, 1, 2, back, model, sizeof(model)), 0);
    assert_string_equal(model, "");
    write_text(path, "{\"format\": \"dsv4d-routing-stats\", \"version\": 1, \"model\": 7, \"n_layers\": 1, "
                     "\"n_experts\": 2, \"counts\": [[1, 2]]}");
    assert_int_equal(dsv4_routing_stats_read_model(path, 1, 2, back, model, sizeof(model)), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "\"model\" is not a string"));
    write_text(path, "{\"format\": \"other\"}");
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -EINVAL);
    write_text(path, "{\"format\": \"dsv4d-routing-stats\", \"version\": 2, \"n_layers\": 1, \"n_experts\": 2}");
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "version 2"));
    write_text(path, "{\"format\": ");
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -EINVAL);
    unlink(path);
    assert_int_equal(dsv4_routing_stats_write("/nonexistent-dir/x.json", "m", 1, 2, counts), -ENOENT);
}

/* A file that cannot be read is refused with the reason and the path, not as malformed JSON. */
static void test_stats_file_unreadable(void **state)
{
    char path[256], want[300];
    uint64_t back[2];

    tmp_path(path, sizeof(path));
    unlink(path);
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -ENOENT);
    snprintf(want, sizeof(want), "routing statistics %s: cannot open: %s", path, strerror(ENOENT));
    assert_string_equal(dsv4_error_message(), want);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -EISDIR);
    snprintf(want, sizeof(want), "routing statistics %s: not a regular file", path);
    assert_string_equal(dsv4_error_message(), want);
    assert_int_equal(rmdir(path), 0);
}

/* The file's shape is bounded by what config.json may say, its size by what that shape takes: a
 * larger file is refused before it is parsed. */
static void test_stats_file_limits(void **state)
{
    char path[256], text[256];
    uint64_t back[2];
    int fd;

    tmp_path(path, sizeof(path));
    assert_true(DSV4_PLACEMENT_MAX_LAYERS >= DSV4_MAX_LAYERS && DSV4_PLACEMENT_MAX_EXPERTS >= DSV4_MAX_EXPERTS);
    snprintf(text, sizeof(text), "{\"format\": \"dsv4d-routing-stats\", \"version\": 1, \"n_layers\": %d, "
             "\"n_experts\": 2, \"counts\": []}", DSV4_PLACEMENT_MAX_LAYERS + 1);
    write_text(path, text);
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -E2BIG);
    assert_non_null(strstr(dsv4_error_message(), "at most"));
    write_text(path, "{\"format\": \"dsv4d-routing-stats\", \"version\": 1, \"n_layers\": 1, \"n_experts\": 2, "
                     "\"counts\": [[1, 2]]}");
    fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)DSV4_ROUTING_STATS_MAX_BYTES + 1), 0);    /* sparse */
    close(fd);
    assert_int_equal(dsv4_routing_stats_read(path, 1, 2, back), -E2BIG);
    assert_non_null(strstr(dsv4_error_message(), "over the limit"));
    unlink(path);
}

/* A write that fails (a full disk; here the file-size limit) says why, and leaves no temporary file. */
static void test_stats_write_fails(void **state)
{
    char path[256];
    const uint64_t counts[2] = { 1, 2 };
    struct rlimit old, small = { 16, 16 };
    int r;

    tmp_path(path, sizeof(path));
    unlink(path);
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, SIG_IGN);
    small.rlim_max = old.rlim_max;
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    r = dsv4_routing_stats_write(path, "m", 1, 2, counts);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, SIG_DFL);
    assert_int_equal(r, -EFBIG);
    assert_non_null(strstr(dsv4_error_message(), strerror(EFBIG)));
    assert_int_equal(access(path, F_OK), -1);
}

/* The check at boot finds what the write at stop would fail on: a path that is a directory (the
 * state directory named instead of a file in it) cannot be renamed over, so it is refused with the
 * path, and no temporary file is left beside it; a regular file there, or none yet, is fine. */
static void test_stats_check(void **state)
{
    char path[256], want[300];
    const uint64_t counts[2] = { 1, 2 };

    tmp_path(path, sizeof(path));
    assert_int_equal(dsv4_routing_stats_check(path), 0);
    unlink(path);
    assert_int_equal(dsv4_routing_stats_check(path), 0);
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(dsv4_routing_stats_write(path, "m", 1, 2, counts), -EISDIR);
    assert_int_equal(dsv4_routing_stats_check(path), -EISDIR);
    snprintf(want, sizeof(want), "routing statistics %s: a directory, not a file (name a file in it)", path);
    assert_string_equal(dsv4_error_message(), want);
    assert_int_equal(rmdir(path), 0);
}

/* The file feeds the plan: what was written is what gets placed hottest-first. */
static void test_file_to_plan(void **state)
{
    char path[256];
    const uint64_t counts[2 * 3] = { 1, 50, 2, 40, 3, 60 }, bytes[2] = { 8, 8 };
    uint64_t back[6];
    tmp_path(path, sizeof(path));
    assert_int_equal(dsv4_routing_stats_write(path, "m", 2, 3, counts), 0);
    assert_int_equal(dsv4_routing_stats_read(path, 2, 3, back), 0);
    unlink(path);
    struct dsv4_placement_req r = { .n_layers = 2, .n_experts = 3, .expert_bytes = bytes, .gpu_budget = 24,
                                    .counts = back };
    struct dsv4_placement *p;
    assert_int_equal(dsv4_placement_plan(&r, &p), 0);
    const uint8_t want[6] = { 1, 0, 1, 0, 1, 0 };   /* 60, 50, 40 on the GPU */
    assert_memory_equal(p->on_host, want, 6);
    dsv4_placement_free(p);
}

static void test_layers_text(void **state)
{
    const uint16_t gpu[10] = { 200, 200, 199, 0, 256, 1, 2, 3, 4, 5 }, host[10] = { 56, 56, 57, 256, 0, 9, 8, 7, 6, 5 };
    char buf[160];
    dsv4_placement_layers_text(gpu, host, 1, 4, buf, sizeof(buf));
    assert_string_equal(buf, " 1:200/56 2:199/57 3:0/256 4:256/0");
    dsv4_placement_layers_text(gpu, host, 8, 2, buf, sizeof(buf));
    assert_string_equal(buf, " 8:4/6 9:5/5");
    dsv4_placement_layers_text(gpu, host, 0, 10, buf, 12);    /* truncated, terminated */
    assert_string_equal(buf, " 0:200/56 1");
}

static int setup(void **state)
{
    seed = dsv4_test_seed();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_fit),
        cmocka_unit_test(test_off_refuses),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_even),
        cmocka_unit_test(test_hottest_first),
        cmocka_unit_test(test_forced_share),
        cmocka_unit_test(test_fixed_layers_and_sizes),
        cmocka_unit_test(test_random_invariants),
        cmocka_unit_test(test_stats_file),
        cmocka_unit_test(test_stats_file_unreadable),
        cmocka_unit_test(test_stats_file_limits),
        cmocka_unit_test(test_stats_write_fails),
        cmocka_unit_test(test_stats_check),
        cmocka_unit_test(test_file_to_plan),
        cmocka_unit_test(test_layers_text),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
