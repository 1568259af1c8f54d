/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <systemd/sd-daemon.h>

#include "daemon/log.h"
#include "daemon/notify.h"

void dsv4_notify_status(const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    dsv4_log_info("%s", text);
    sd_notifyf(0, "STATUS=%s", text);
}

void dsv4_notify_extend(uint64_t usec)
{
    sd_notifyf(0, "EXTEND_TIMEOUT_USEC=%" PRIu64, usec);
}

void dsv4_notify_ready(const char *status)
{
    dsv4_log_notice("%s", status);
    sd_notifyf(0, "READY=1\nSTATUS=%s", status);
}

void dsv4_notify_stopping(const char *status)
{
    dsv4_log_notice("%s", status);
    sd_notifyf(0, "STOPPING=1\nSTATUS=%s", status);
}

void dsv4_notify_watchdog(void)
{
    sd_notify(0, "WATCHDOG=1");
}

uint64_t dsv4_notify_watchdog_usec(void)
{
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) <= 0)
        return 0;
    return usec;
}
