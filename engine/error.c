/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "engine/error.h"

static _Thread_local char error_message[DSV4_ERROR_MESSAGE_MAX];

int (dsv4_error_set)(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_message, sizeof(error_message), fmt, ap);
    va_end(ap);
    return code;
}

int (dsv4_error_prefix)(int code, const char *fmt, ...)
{
    char old[DSV4_ERROR_MESSAGE_MAX];
    size_t n;
    va_list ap;

    memcpy(old, error_message, sizeof(old));
    va_start(ap, fmt);
    vsnprintf(error_message, sizeof(error_message), fmt, ap);
    va_end(ap);
    n = strlen(error_message);
    if (n < sizeof(error_message) - 1)
        snprintf(error_message + n, sizeof(error_message) - n, "%s", old);
    return code;
}

const char *dsv4_error_message(void)
{
    return error_message;
}

void dsv4_error_clear(void)
{
    error_message[0] = '\0';
}
