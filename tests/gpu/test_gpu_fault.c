/* SPDX-License-Identifier: MIT */
/* GPU: a sticky device fault at run time. DSV4_TEST_CUDA_FAULT_AFTER_DECODES makes the CUDA backend
 * launch a kernel that writes to an invalid address after the given number of decode steps (a real
 * cudaErrorIllegalAddress, which poisons the context); the backend must report it as the fatal
 * -ENOTRECOVERABLE, from that call and every later one, and the scheduler must end every request,
 * running and queued, with that error and return it from its loop instead of hanging.
 * Run it alone (make check-gpu runs each program in its own process): the fault ends the context. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"
#include "tests/gpu/gpu_test.h"

#define MAX_CONTEXT 128
#define FAULT_AFTER "3"         /* decode steps that run before the fault */

/* The fixture vocabularies have no tokenizer: each id reads as one letter. */
static int letter_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    if (cap < 1)
        return -E2BIG;
    buf[0] = (char)('a' + id % 26);
    return 1;
}

static void test_sticky_fault_fails_everything(void **state)
{
    char dir[1024];
    struct { struct dsv4_weights *w; struct dsv4_backend *b; struct dsv4_sched *s; } e = { 0 };
    snprintf(dir, sizeof(dir), "%s/tests/fixtures/tiny_a", DSV4_SRCDIR);
    DSV4_OK(dsv4_weights_load(dir, &e.w));
    struct dsv4_backend_opts bo = { .max_batch = 2, .max_context = MAX_CONTEXT, .numerics = DSV4_NUMERICS_FP8,
                                    .threads = 1 };
    setenv("DSV4_TEST_CUDA_FAULT_AFTER_DECODES", FAULT_AFTER, 1);
    DSV4_OK(dsv4_backend_cuda_create(e.w, &bo, &e.b));
    struct dsv4_sched_limits lim = { .detok = { letter_bytes, NULL } };
    DSV4_OK(dsv4_sched_create(e.b, NULL, &lim, &e.s));

    /* two run, two wait for a slot; all ask for more tokens than the fault leaves them */
    int32_t prompt[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    uint64_t ids[4];
    for (int i = 0; i < 4; i++) {
        struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = 8, .max_tokens = 40, .ignore_eos = true };
        dsv4_sampling_defaults(&rq.sampling);
        rq.sampling.temperature = 0;
        DSV4_OK(dsv4_sched_submit(e.s, &rq, &ids[i]));
    }
    int rc = 0, ended = 0, fatal_errors = 0;
    for (int guard = 0; guard < 1000 && ended < 4; guard++) {
        rc = dsv4_sched_step(e.s);
        assert_true(rc >= 0 || rc == -ENOTRECOVERABLE || rc == -EAGAIN);
        struct dsv4_sched_event ev;
        while (dsv4_sched_next_event(e.s, &ev) == 1) {
            if (ev.type != DSV4_SCHED_EVENT_FINISH)
                continue;
            ended++;
            assert_int_equal(ev.result->finish, DSV4_FINISH_ERROR);
            fatal_errors += ev.result->error == -ENOTRECOVERABLE;
            printf("# request %llu: %s\n", (unsigned long long)ev.id, ev.result->error_message);
            assert_int_equal(dsv4_sched_release(e.s, ev.id), 0);
        }
    }
    assert_int_equal(ended, 4);
    assert_int_equal(fatal_errors, 4);
    assert_int_equal(rc, -ENOTRECOVERABLE);
    /* the context stays poisoned: the backend keeps saying so, and the scheduler refuses new work */
    int slot = 0;
    int32_t tok = 1;
    assert_int_equal(e.b->ops->decode(e.b, 1, &slot, &tok, NULL), -ENOTRECOVERABLE);
    struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = 8, .max_tokens = 4 };
    dsv4_sampling_defaults(&rq.sampling);
    uint64_t id;
    assert_int_equal(dsv4_sched_submit(e.s, &rq, &id), -ENOTRECOVERABLE);
    unsetenv("DSV4_TEST_CUDA_FAULT_AFTER_DECODES");
    dsv4_sched_destroy(e.s);
    dsv4_backend_destroy(e.b);
    dsv4_weights_free(e.w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sticky_fault_fails_everything),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
