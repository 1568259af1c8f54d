/* SPDX-License-Identifier: MIT */
/* daemon/settings: config file and flags. The file form and the flag form of every key agree,
 * flags win whatever their order, a printed configuration reads back to the same settings, and
 * every bad line is refused with a message naming the file, the line and the key. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "daemon/settings.h"
#include "engine/error.h"
#include "engine/serve/scheduler.h"

static char *write_temp(const char *text)
{
    static char path[64];
    strcpy(path, "/tmp/dsv4d-settings-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static int from_args(struct dsv4_settings *s, int argc, const char **argv, enum dsv4_settings_action *action)
{
    return dsv4_settings_from_args(s, argc, (char **)argv, NULL, action);
}

static void test_file_forms(void **state)
{
    struct dsv4_settings s;
    char *path = write_temp("# comment\n"
                            "; also a comment\n"
                            "\n"
                            "model = /srv/models/flash   # trailing comment\n"
                            "  max_batch=12\n"
                            "max-context = 8192\n"
                            "backend = cpu\n"
                            "max_frame = 16M\n"
                            "max_output_buffer = 128KiB\n"
                            "drain_grace = 2.5\n"
                            "allow_users = 0, 4242\n"
                            "allow_groups = 0\n"
                            "log_level = debug\n"
                            "expert_offload = on\n"
                            "expert_host_share = 30\n"
                            "expert_placement = /var/lib/dsv4d/routing.json\n"
                            "routing_stats = /var/lib/dsv4d/routing.json\n"
                            "gpus = 2, 0,1\n");
    dsv4_settings_defaults(&s);
    assert_int_equal(dsv4_settings_load_file(&s, path, true), 0);
    assert_string_equal(s.model, "/srv/models/flash");
    assert_int_equal(s.max_batch, 12);
    assert_int_equal(s.max_context, 8192);
    assert_int_equal(s.backend, DSV4_BACKEND_CPU);
    assert_int_equal(s.max_frame, 16u << 20);
    assert_int_equal(s.max_output_buffer, 128u << 10);
    assert_true(s.drain_grace == 2.5);
    assert_int_equal(s.n_allow_users, 2);
    assert_int_equal(s.allow_users[0], 0);
    assert_int_equal(s.allow_users[1], 4242);
    assert_int_equal(s.n_allow_groups, 1);
    assert_int_equal(s.log_level, 7);
    assert_int_equal(s.expert_offload, DSV4_EXPERT_OFFLOAD_ON);
    assert_int_equal(s.expert_host_share, 30);
    assert_string_equal(s.expert_placement, "/var/lib/dsv4d/routing.json");
    assert_string_equal(s.routing_stats, "/var/lib/dsv4d/routing.json");
    assert_int_equal(s.n_gpus, 3);
    assert_int_equal(s.gpus[0], 2);
    assert_int_equal(s.gpus[1], 0);
    assert_int_equal(s.gpus[2], 1);
    assert_string_equal(s.config_path, path);
    unlink(path);
}

static void test_flags_override_file(void **state)
{
    struct dsv4_settings s;
    enum dsv4_settings_action action;
    char *path = write_temp("max_batch = 3\nmodel = /from/file\nbackend = cuda\n");
    char config_flag[80];
    snprintf(config_flag, sizeof(config_flag), "--config=%s", path);
    /* The flag comes before --config and still wins. */
    const char *argv[] = { "dsv4d", "--max-batch", "5", config_flag, "--backend=auto", "--listen", "/tmp/x.sock" };
    assert_int_equal(from_args(&s, 7, argv, &action), 0);
    assert_int_equal(action, DSV4_SETTINGS_RUN);
    assert_int_equal(s.max_batch, 5);
    assert_string_equal(s.model, "/from/file");
    assert_int_equal(s.backend, DSV4_BACKEND_AUTO);
    assert_string_equal(s.listen, "/tmp/x.sock");
    unlink(path);

    const char *help[] = { "dsv4d", "--model", "/m", "--help" };
    assert_int_equal(from_args(&s, 4, help, &action), 0);
    assert_int_equal(action, DSV4_SETTINGS_HELP);
    const char *print[] = { "dsv4d", "--print-config", "--model", "/m" };
    assert_int_equal(from_args(&s, 4, print, &action), 0);
    assert_int_equal(action, DSV4_SETTINGS_PRINT);
}

/* Random valid values for the numeric keys, given as flags: each lands in its field, and the printed
 * configuration reads back to the same settings. */
static void test_print_reads_back(void **state)
{
    static const struct { const char *flag; int lo, range; size_t offset; } keys[] = {
        { "--max-batch", 1, 1024, offsetof(struct dsv4_settings, max_batch) },
        { "--max-context", 16, 100000, offsetof(struct dsv4_settings, max_context) },
        { "--max-connections", 1, 65536, offsetof(struct dsv4_settings, max_connections) },
        { "--max-queued", 1, 100000, offsetof(struct dsv4_settings, max_queued) },
        { "--max-requests-per-conn", 1, 65536, offsetof(struct dsv4_settings, max_requests_per_conn) },
        { "--threads", 1, 64, offsetof(struct dsv4_settings, threads) },
        { "--warmup-tokens", 1, 1024, offsetof(struct dsv4_settings, warmup_tokens) },
    };
    enum { N = sizeof(keys) / sizeof(keys[0]) };

    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    for (int round = 0; round < 50; round++) {
        struct dsv4_settings a, b;
        enum dsv4_settings_action action;
        char values[N + 4][DSV4_EP_MAX_GPUS * 4 + 1];
        int want[N];
        const char *argv[2 * N + 11];
        int argc = 0;

        argv[argc++] = "dsv4d";
        for (int k = 0; k < N; k++) {
            want[k] = keys[k].lo + rand() % keys[k].range;
            snprintf(values[k], sizeof(values[k]), "%d", want[k]);
            argv[argc++] = keys[k].flag;
            argv[argc++] = values[k];
        }
        int frame = 1024 + rand() % (1 << 29), grace = rand() % 86400, uid = rand() % 100000;
        snprintf(values[N], sizeof(values[N]), "%d", frame);
        snprintf(values[N + 1], sizeof(values[N + 1]), "%d", grace);
        snprintf(values[N + 2], sizeof(values[N + 2]), "%d", uid);
        argv[argc++] = "--max-frame";
        argv[argc++] = values[N];
        argv[argc++] = "--drain-grace";
        argv[argc++] = values[N + 1];
        argv[argc++] = "--allow-users";
        argv[argc++] = values[N + 2];
        /* a random set of distinct devices in random order, or all */
        int n_gpus = rand() % (DSV4_EP_MAX_GPUS + 1), gpus[DSV4_EP_MAX_GPUS], pos = 0;
        for (int i = 0; i < n_gpus; i++) {
            bool dup;
            do {
                gpus[i] = rand() % (DSV4_SETTINGS_GPU_ORDINAL_MAX + 1);
                dup = false;
                for (int j = 0; j < i; j++)
                    dup |= gpus[j] == gpus[i];
            } while (dup);
            pos += snprintf(values[N + 3] + pos, sizeof(values[N + 3]) - (size_t)pos, "%s%d", i ? "," : "", gpus[i]);
        }
        if (n_gpus == 0)
            strcpy(values[N + 3], "all");
        argv[argc++] = "--gpus";
        argv[argc++] = values[N + 3];
        argv[argc++] = "--model";
        argv[argc++] = "/some/model dir";
        assert_int_equal(from_args(&a, argc, argv, &action), 0);
        assert_int_equal(a.n_gpus, n_gpus);
        for (int i = 0; i < n_gpus; i++)
            assert_int_equal(a.gpus[i], gpus[i]);
        for (int k = 0; k < N; k++)
            assert_int_equal(*(const int *)((const char *)&a + keys[k].offset), want[k]);
        assert_int_equal(a.max_frame, (uint64_t)frame);
        assert_true(a.drain_grace == grace);
        assert_int_equal(a.n_allow_users, 1);
        assert_int_equal(a.allow_users[0], (uid_t)uid);
        assert_string_equal(a.model, "/some/model dir");

        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        dsv4_settings_print(&a, f);
        fclose(f);
        char *path = write_temp(text);
        dsv4_settings_defaults(&b);
        assert_int_equal(dsv4_settings_load_file(&b, path, true), 0);
        memset(b.config_path, 0, sizeof(b.config_path));
        assert_memory_equal(&a, &b, sizeof(a));
        unlink(path);
        free(text);
    }
}

struct bad_case {
    const char *text;
    int code;
    const char *needle;     /* must appear in the message */
};

static void test_bad_lines(void **state)
{
    static const struct bad_case cases[] = {
        { "max_batch = 4\nmax_bacth = 4\n", -EINVAL, ":2: unknown setting 'max_bacth'" },
        { "max_batch = four\n", -EINVAL, ":1: max_batch = 'four' is not an integer" },
        { "max_batch = 4x\n", -EINVAL, "is not an integer" },
        { "max_batch = 0\n", -ERANGE, "max_batch = 0 outside [1, 1024]" },
        { "max_context = 99999999999\n", -ERANGE, "outside" },
        { "max_frame = 8Q\n", -EINVAL, "is not a size" },
        { "max_frame = 100\n", -ERANGE, "max_frame = 100 outside" },
        { "backend = tpu\n", -EINVAL, "expected cpu, cuda or auto" },
        { "numerics = fp4\n", -EINVAL, "expected exact, fp8 or auto" },
        { "drain_grace = -1\n", -EINVAL, "seconds" },
        { "drain_grace = nan\n", -EINVAL, "seconds" },
        { "log_level = loud\n", -EINVAL, "log_level = 'loud'" },
        { "expert_offload = maybe\n", -EINVAL, "expected auto, on or off" },
        { "expert_host_share = 101\n", -ERANGE, "expert_host_share = 101 outside [0, 100]" },
        { "just words\n", -EINVAL, ":1: expected 'key = value'" },
        { "allow_users = no-such-user-here\n", -ENOENT, "no such user 'no-such-user-here'" },
        { "allow_groups = no-such-group-here\n", -ENOENT, "no such group 'no-such-group-here'" },
        { "allow_users = 4294967295\n", -ERANGE, "out of range" },
        { "gpus = 0,1,0\n", -EINVAL, "gpus: device 0 listed twice" },
        { "gpus = -1\n", -ERANGE, "gpus: device -1 outside [0, 255]" },
        { "gpus = 0,256\n", -ERANGE, "gpus: device 256 outside [0, 255]" },
        { "gpus = 0,99999999999999999999\n", -ERANGE, "gpus: device 99999999999999999999 outside [0, 255]" },
        { "gpus = -99999999999999999999\n", -ERANGE, "gpus: device -99999999999999999999 outside [0, 255]" },
        { "gpus = 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16\n", -E2BIG, "gpus: more than 16 devices" },
        { "gpus = 0,,1\n", -EINVAL, "gpus = '0,,1': expected all or device ordinals" },
        { "gpus = 0,1,\n", -EINVAL, "expected all or device ordinals" },
        { "gpus = 1x\n", -EINVAL, "expected all or device ordinals" },
        { "gpus = \n", -EINVAL, "expected all or device ordinals" },
        { "gpus = any\n", -EINVAL, "expected all or device ordinals" },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct dsv4_settings s;
        char *path = write_temp(cases[i].text);
        dsv4_settings_defaults(&s);
        int r = dsv4_settings_load_file(&s, path, true);
        if (r != cases[i].code || !strstr(dsv4_error_message(), cases[i].needle) ||
            !strstr(dsv4_error_message(), path))
            fail_msg("case %zu: got %d '%s', want %d containing '%s'", i, r, dsv4_error_message(), cases[i].code,
                     cases[i].needle);
        unlink(path);
    }
}

static void test_files_and_validation(void **state)
{
    struct dsv4_settings s;
    enum dsv4_settings_action action;

    dsv4_settings_defaults(&s);
    /* The default file may be absent; a file named explicitly must exist. */
    assert_int_equal(dsv4_settings_load_file(&s, "/nonexistent/dsv4d.conf", false), 0);
    assert_int_equal(dsv4_settings_load_file(&s, "/nonexistent/dsv4d.conf", true), -ENOENT);
    const char *argv[] = { "dsv4d", "--config", "/nonexistent/dsv4d.conf" };
    assert_int_equal(from_args(&s, 3, argv, &action), -ENOENT);
    const char *unknown[] = { "dsv4d", "--max-bach", "3" };
    assert_int_equal(from_args(&s, 3, unknown, &action), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "--max-bach"));
    const char *novalue[] = { "dsv4d", "--model" };
    assert_int_equal(from_args(&s, 2, novalue, &action), -EINVAL);
    const char *stray[] = { "dsv4d", "model" };
    assert_int_equal(from_args(&s, 2, stray, &action), -EINVAL);

    dsv4_settings_defaults(&s);
    assert_int_equal(dsv4_settings_validate(&s), -EINVAL);     /* no model */
    strcpy(s.model, "/m");
    assert_int_equal(dsv4_settings_validate(&s), 0);
    s.max_context = 100;
    s.max_prompt_tokens = 100;
    assert_int_equal(dsv4_settings_validate(&s), -EINVAL);
    s.max_prompt_tokens = 0;
    assert_int_equal(dsv4_settings_prompt_limit(&s), 99);
    s.max_prompt_tokens = 10;
    assert_int_equal(dsv4_settings_prompt_limit(&s), 10);
    s.expert_host_share = 20;
    assert_int_equal(dsv4_settings_validate(&s), -EINVAL);     /* a host share needs expert_offload = on */
    assert_non_null(strstr(dsv4_error_message(), "expert_host_share = 20 needs expert_offload = on"));
    s.expert_offload = DSV4_EXPERT_OFFLOAD_ON;
    assert_int_equal(dsv4_settings_validate(&s), 0);
    /* Each listed GPU owns a group of the slots: fewer slots than GPUs is refused before the weights
     * load, not by the CUDA backend after. */
    s.max_batch = 2;
    s.n_gpus = 3;
    s.gpus[0] = 0;
    s.gpus[1] = 1;
    s.gpus[2] = 2;
    assert_int_equal(dsv4_settings_validate(&s), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "max_batch = 2 with gpus = 0,1,2"));
    s.max_batch = 3;
    assert_int_equal(dsv4_settings_validate(&s), 0);
    s.n_gpus = 0;
    /* The engine holds the queued requests besides a running and a finishing one a slot: a queue it
     * cannot hold is refused, not cut short with an error naming no setting. */
    s.max_batch = 8;
    s.max_queued = DSV4_SCHED_REQUESTS_MAX - 16;
    assert_int_equal(dsv4_settings_validate(&s), 0);
    s.max_queued++;
    assert_int_equal(dsv4_settings_validate(&s), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "max_queued = 65521"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_file_forms),
        cmocka_unit_test(test_flags_override_file),
        cmocka_unit_test(test_print_reads_back),
        cmocka_unit_test(test_bad_lines),
        cmocka_unit_test(test_files_and_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
