/* SPDX-License-Identifier: MIT */
/* dsv4-openai's log (log.h). */
#include "build-config.h"

#include <stdarg.h>
#include <stdio.h>
#include <syslog.h>

#include "openai/log.h"

#define LOG_LINE_MAX 1024       /* bytes of one line; longer messages are cut */

static bool debug_on;

void dsv4_oai_log_debug(bool on)
{
    debug_on = on;
}

void dsv4_oai_log(int priority, const char *fmt, ...)
{
    if (priority == LOG_DEBUG && !debug_on)
        return;
    char line[LOG_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "<%d>%s\n", priority, line);
}
