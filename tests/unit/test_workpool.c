/* SPDX-License-Identifier: MIT */
/* engine/workpool: every part of every job runs exactly once, on its own thread (part 0 on the
 * caller's), and run returns only after all of them; jobs back to back see no stale generation;
 * bad part counts are refused with a message. */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/workpool.h"

#define PARTS_MAX 16
#define JOBS 2000

struct job {
    atomic_int calls[PARTS_MAX];
    pthread_t self[PARTS_MAX];
    int parts_seen[PARTS_MAX];
    atomic_int done;
};

static void record(void *arg, int part, int parts)
{
    struct job *j = arg;
    atomic_fetch_add(&j->calls[part], 1);
    j->self[part] = pthread_self();
    j->parts_seen[part] = parts;
    for (volatile int spin = 0; spin < 100 * part; spin++)     /* parts finish at different times */
        ;
    atomic_fetch_add(&j->done, 1);
}

static void test_every_part_once(void **state)
{
    (void)state;
    for (int parts = 1; parts <= PARTS_MAX; parts *= 2) {
        struct dsv4_workpool *pool = NULL;
        assert_int_equal(dsv4_workpool_create(parts, "test", &pool), 0);
        assert_int_equal(dsv4_workpool_parts(pool), parts);
        for (int n = 0; n < JOBS / parts; n++) {
            struct job j;
            memset(&j, 0, sizeof(j));
            dsv4_workpool_run(pool, record, &j);
            assert_int_equal(atomic_load(&j.done), parts);      /* all finished before run returned */
            for (int p = 0; p < parts; p++) {
                assert_int_equal(atomic_load(&j.calls[p]), 1);
                assert_int_equal(j.parts_seen[p], parts);
            }
            assert_true(pthread_equal(j.self[0], pthread_self()));
            for (int p = 1; p < parts; p++)
                for (int q = 0; q < p; q++)
                    assert_false(pthread_equal(j.self[p], j.self[q]));
        }
        dsv4_workpool_free(pool);
    }
}

static void test_refuses_bad_counts(void **state)
{
    (void)state;
    struct dsv4_workpool *pool = NULL;
    assert_int_equal(dsv4_workpool_create(0, "sampler", &pool), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "sampler threads: 0 is outside"));
    assert_int_equal(dsv4_workpool_create(DSV4_WORKPOOL_MAX_PARTS + 1, "sampler", &pool), -EINVAL);
    assert_null(pool);
    dsv4_workpool_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_part_once),
        cmocka_unit_test(test_refuses_bad_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
