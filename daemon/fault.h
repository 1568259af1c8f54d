/* SPDX-License-Identifier: MIT */
/* Test-only fault injection: with DSV4_TEST_FAULT_AFTER_DECODES=N in the environment, the backend is
 * wrapped so that its decode calls after the first N fail the way a GPU with a sticky error does:
 * -ENOTRECOVERABLE, and from then on every compute call fails the same way. It exercises the
 * daemon's handling of a dead device (every request answered with an error, health "failed", exit
 * status 1) on any backend, the CPU one included. Unset, nothing is wrapped. */
#ifndef DSV4_DAEMON_FAULT_H
#define DSV4_DAEMON_FAULT_H

#include "engine/backend.h"

/* Replace *b by the wrapper when the variable is set (the wrapper owns the original). Returns 0, or
 * -EINVAL for a value that is not a count, -ENOMEM. */
int dsv4_fault_wrap_from_env(struct dsv4_backend **b);

#endif
