/* SPDX-License-Identifier: MIT */
/* Talking to the service manager (sd_notify): boot progress, readiness after warm-up, the watchdog
 * and the stop. Every call is a no-op without $NOTIFY_SOCKET. */
#ifndef DSV4_DAEMON_NOTIFY_H
#define DSV4_DAEMON_NOTIFY_H

#include <stdbool.h>
#include <stdint.h>

/* STATUS=<text>, also logged at info level. */
void dsv4_notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* EXTEND_TIMEOUT_USEC=: the current boot step needs up to usec more. */
void dsv4_notify_extend(uint64_t usec);
void dsv4_notify_ready(const char *status);
void dsv4_notify_stopping(const char *status);
void dsv4_notify_watchdog(void);
/* WATCHDOG_USEC for this process (0 when the watchdog is off). */
uint64_t dsv4_notify_watchdog_usec(void);

#endif
