/* SPDX-License-Identifier: MIT */
/* dsv4-openai's log: lines on stderr with sd-daemon priority prefixes (journald reads them). */
#ifndef DSV4_OPENAI_LOG_H
#define DSV4_OPENAI_LOG_H

#include <stdbool.h>

/* Debug lines are dropped unless debug is on (--verbose). */
void dsv4_oai_log_debug(bool on);
void dsv4_oai_log(int priority, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
