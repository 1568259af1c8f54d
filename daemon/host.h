/* SPDX-License-Identifier: MIT */
/* The engine host: the engine thread that loads the model, builds the backend and the scheduler,
 * and then runs the scheduler's step loop until told to stop. The io thread watches boot_fd to learn
 * when boot has finished (successfully or not), then talks to the scheduler directly. */
#ifndef DSV4_DAEMON_HOST_H
#define DSV4_DAEMON_HOST_H

#include <stdbool.h>

#include "daemon/settings.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"

enum dsv4_host_phase {
    DSV4_HOST_LOADING_WEIGHTS,
    DSV4_HOST_CREATING_BACKEND,
    DSV4_HOST_CREATING_SCHEDULER,
    DSV4_HOST_RUNNING,          /* boot done: the step loop runs */
    DSV4_HOST_FAILED,           /* boot or the step loop failed: dsv4_host_boot_error() says why */
    DSV4_HOST_STOPPED,
};

struct dsv4_host;

/* Start the engine thread; it boots in the background. tok is borrowed (it must outlive the host).
 * model: the model's config.json, against whose shape cfg's expert_placement file is read here,
 * before the weights load: a file missing, unreadable or of another shape is -EINVAL with the
 * reason (a setting to fix: exit status 2), as is a routing_stats path where no file can be made. */
int dsv4_host_start(const struct dsv4_settings *cfg, const struct dsv4_config *model,
                    const struct dsv4_tokenizer *tok, struct dsv4_host **ret);

/* An eventfd, readable once boot has finished (phase RUNNING or FAILED), and again if the step loop
 * fails later (phase FAILED). */
int dsv4_host_boot_fd(const struct dsv4_host *h);
enum dsv4_host_phase dsv4_host_phase(const struct dsv4_host *h);
const char *dsv4_host_phase_text(enum dsv4_host_phase p);
/* After FAILED: the message naming what failed. */
const char *dsv4_host_boot_error(const struct dsv4_host *h);

/* Valid once RUNNING. */
struct dsv4_sched *dsv4_host_sched(const struct dsv4_host *h);
const char *dsv4_host_backend_name(const struct dsv4_host *h);     /* "cpu", "cuda"; "" before */
/* Why this backend: "requested", or for auto without a usable GPU the reason ("" before). */
const char *dsv4_host_backend_note(const struct dsv4_host *h);
int dsv4_host_max_output_tokens(const struct dsv4_host *h);

/* Stop the step loop (after its current step) and join the thread. When boot is still running the
 * thread is left to finish it and exit on its own (a checkpoint load cannot be interrupted); returns
 * false in that case, and the caller must not free the host. */
/* Write the routing_stats file now (the counts since boot), from the engine thread between two steps;
 * its log line says when it is done. -ENOENT without a configured file, -EAGAIN before the engine
 * runs, -EBUSY while an earlier dump is pending. io thread. */
int dsv4_host_dump_routing(struct dsv4_host *h);
bool dsv4_host_stop(struct dsv4_host *h);
void dsv4_host_free(struct dsv4_host *h);

#endif
