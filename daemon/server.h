/* SPDX-License-Identifier: MIT */
/* The io thread: one sd-event loop owning the listening sockets, the connections, the protocol and
 * the tokenizer; it hands generate requests to the scheduler and turns the scheduler's events into
 * token notifications and results. server.c (loop, lifecycle, systemd) sits on dispatch.c (methods,
 * engine events; dispatch.h), which sits on conn.c (sockets, frames, bounded buffers; conn.h). Calls go
 * down only: conn.c and dispatch.c reach the layer above through the hooks server.c registers. */
#ifndef DSV4_DAEMON_SERVER_H
#define DSV4_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "daemon/conn.h"
#include "daemon/dispatch.h"
#include "daemon/host.h"
#include "daemon/lifecycle.h"
#include "daemon/listen.h"
#include "daemon/settings.h"
#include "engine/model/config.h"

/* After the engine failed, how long health and hello still answer "failed" before the connections
 * close and the process exits (systemd restarts it): clients polling health learn why. */
#define DSV4_SERVER_FAILED_LINGER_USEC (1 * 1000000ull)
/* After the drain, how long the last responses may take to reach slow clients. */
#define DSV4_SERVER_FLUSH_USEC (2 * 1000000ull)
/* Boot steps extend systemd's start timeout by this much, each time the boot timer fires. */
#define DSV4_SERVER_EXTEND_USEC (60 * 1000000ull)
#define DSV4_SERVER_EXTEND_PERIOD_USEC (20 * 1000000ull)

struct dsv4_server {
    const struct dsv4_settings *cfg;
    sd_event *event;
    enum dsv4_server_state state;
    char reason[DSV4_SERVER_REASON_MAX];    /* health's reason */
    int exit_code;

    struct dsv4_listeners listeners;
    struct dsv4_conns conns;                /* conn.c: its hooks go to the dispatcher */
    struct dsv4_dispatch dispatch;          /* dispatch.c: its hooks come back here */

    struct dsv4_config model;               /* config.json, read before boot */
    sd_event_source *prompts_src;

    struct dsv4_host *host;
    struct dsv4_sched *sched;               /* once booted */
    sd_event_source *boot_src, *sched_src;
    sd_event_source *watchdog_src, *extend_src, *drain_src;
    sd_event_source *linger_src;            /* engine failed: DSV4_SERVER_FAILED_LINGER_USEC */
    sd_event_source *sweep_src;             /* frame_timeout and max_idle_per_uid (conn.c) */
    uint64_t watchdog_usec, watchdog_last_steps;

    uint64_t start_ns, ready_ns;
};

int dsv4_server_init(struct dsv4_server *s, const struct dsv4_settings *cfg);
int dsv4_server_run(struct dsv4_server *s);
void dsv4_server_done(struct dsv4_server *s);

#endif
