/* SPDX-License-Identifier: MIT */
/* dsv4d logging: one line per message on stderr, prefixed with the sd-daemon priority ("<3>") so
 * journald files it at the right level; lines below the configured level are dropped. Safe to call
 * from any thread (each line is one write). */
#ifndef DSV4_DAEMON_LOG_H
#define DSV4_DAEMON_LOG_H

#include <syslog.h>

#define DSV4_LOG_LINE_MAX 2048

/* LOG_ERR .. LOG_DEBUG from <syslog.h>. */
void dsv4_log_set_level(int level);
/* "err", "warning", "notice", "info", "debug" (or 3..7) -> level; -EINVAL when unknown. */
int dsv4_log_parse_level(const char *s);
/* Prefix lines with a monotonic timestamp (when stderr is not the journal). */
void dsv4_log_set_timestamps(int on);

void dsv4_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define dsv4_log_err(...) dsv4_log(LOG_ERR, __VA_ARGS__)
#define dsv4_log_warning(...) dsv4_log(LOG_WARNING, __VA_ARGS__)
#define dsv4_log_notice(...) dsv4_log(LOG_NOTICE, __VA_ARGS__)
#define dsv4_log_info(...) dsv4_log(LOG_INFO, __VA_ARGS__)
#define dsv4_log_debug(...) dsv4_log(LOG_DEBUG, __VA_ARGS__)

#endif
