/* SPDX-License-Identifier: MIT */
/* Error reporting: functions return 0 or a negative errno-style code; the message a user can act
 * on is kept per thread and read with dsv4_error_message(). */
#ifndef DSV4_ENGINE_ERROR_H
#define DSV4_ENGINE_ERROR_H

#define DSV4_ERROR_MESSAGE_MAX 1024

/* Store a formatted message for the calling thread and return code (a negative errno value),
 * so call sites can write `return dsv4_error_set(-EINVAL, "...", ...);`. */
int dsv4_error_set(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prefix the current message with more context ("loading model: " + old message); returns code. */
int dsv4_error_prefix(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The calling thread's last message ("" when none). Valid until the next dsv4_error_* call. */
const char *dsv4_error_message(void);

void dsv4_error_clear(void);

#ifdef __clang_analyzer__
/* scan-build sees neither into error.c nor through a variadic call, so it would go on down the
 * success path after `return dsv4_error_set(...)`; tell it the code that comes back is negative.
 * error.c defines the functions under parenthesized names, which these macros leave alone. */
static inline int dsv4_error_negative(int code)
{
    __builtin_assume(code < 0);
    return code;
}
#define dsv4_error_set(...) dsv4_error_negative(dsv4_error_set(__VA_ARGS__))
#define dsv4_error_prefix(...) dsv4_error_negative(dsv4_error_prefix(__VA_ARGS__))
#endif

#endif
