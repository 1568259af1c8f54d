/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "daemon/log.h"

static atomic_int log_level = LOG_INFO;
static atomic_int log_timestamps;

void dsv4_log_set_level(int level)
{
    atomic_store(&log_level, level);
}

void dsv4_log_set_timestamps(int on)
{
    atomic_store(&log_timestamps, on);
}

int dsv4_log_parse_level(const char *s)
{
    static const char *const names[] = { "emerg", "alert", "crit", "err", "warning", "notice", "info", "debug" };
    for (int i = 0; i < 8; i++)
        if (!strcasecmp(s, names[i]))
            return i;
    if (!strcasecmp(s, "error"))
        return LOG_ERR;
    if (!strcasecmp(s, "warn"))
        return LOG_WARNING;
    if (s[0] >= '0' && s[0] <= '7' && s[1] == '\0')
        return s[0] - '0';
    return -EINVAL;
}

void dsv4_log(int level, const char *fmt, ...)
{
    char line[DSV4_LOG_LINE_MAX];
    size_t n = 0;
    va_list ap;
    int r;

    if (level > atomic_load(&log_level))
        return;
    r = snprintf(line, sizeof(line), "<%d>", level);
    n = (size_t)r;
    if (atomic_load(&log_timestamps)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        r = snprintf(line + n, sizeof(line) - n, "[%5ld.%03ld] ", (long)ts.tv_sec, ts.tv_nsec / 1000000);
        n += (size_t)r;
    }
    va_start(ap, fmt);
    r = vsnprintf(line + n, sizeof(line) - n, fmt, ap);
    va_end(ap);
    if (r < 0)
        return;
    size_t text = n;
    n += (size_t)r;
    /* Truncated lines keep their newline; one write keeps concurrent lines whole. */
    if (n > sizeof(line) - 2)
        n = sizeof(line) - 2;
    /* Messages quote client text (a hello's client name, a refused field's name): a control character
     * in it must not end the line, or journald files what follows as an entry of the client's chosen
     * priority ("\n<0>..."). */
    for (size_t i = text; i < n; i++)
        if ((unsigned char)line[i] < 0x20 || line[i] == 0x7f)
            line[i] = ' ';
    line[n++] = '\n';
    for (size_t off = 0; off < n;) {
        ssize_t w = write(STDERR_FILENO, line + off, n - off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        off += (size_t)w;
    }
}
