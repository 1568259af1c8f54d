/* SPDX-License-Identifier: MIT */
/* engine/error: messages are per thread, formatted, and prefixable. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>
#include <cmocka.h>

#include "engine/error.h"

static void test_set_and_prefix(void **state)
{
    assert_int_equal(dsv4_error_set(-EINVAL, "tensor %s: bad shape", "embed.weight"), -EINVAL);
    assert_string_equal(dsv4_error_message(), "tensor embed.weight: bad shape");
    assert_int_equal(dsv4_error_prefix(-EIO, "loading %s: ", "/m"), -EIO);
    assert_string_equal(dsv4_error_message(), "loading /m: tensor embed.weight: bad shape");
    dsv4_error_clear();
    assert_string_equal(dsv4_error_message(), "");
}

static void test_truncates(void **state)
{
    char big[4 * DSV4_ERROR_MESSAGE_MAX];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    dsv4_error_set(-E2BIG, "%s", big);
    assert_int_equal(strlen(dsv4_error_message()), DSV4_ERROR_MESSAGE_MAX - 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_set_and_prefix),
        cmocka_unit_test(test_truncates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
