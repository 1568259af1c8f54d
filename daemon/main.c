/* SPDX-License-Identifier: MIT */
/* dsv4d: the DeepSeek-V4 inference daemon. Reads its settings, takes its sockets, boots the engine
 * on its own thread and serves the protocol on the io thread until SIGTERM has drained it. */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/reqmem.h"
#include "daemon/server.h"
#include "daemon/settings.h"
#include "engine/error.h"

#ifndef DSV4D_CONFIG_PATH
#define DSV4D_CONFIG_PATH "/etc/dsv4d/dsv4d.conf"
#endif

/* Exit codes: 0 clean stop, 1 failure at run time (systemd restarts it), 2 bad settings or usage
 * (RestartPreventExitStatus=2: restarting cannot help). */
#define DSV4D_EXIT_CONFIG 2

static struct dsv4_settings settings;   /* outlives main's frame: a loading engine thread reads it */
static struct dsv4_server server;

int main(int argc, char **argv)
{
    enum dsv4_settings_action action;
    int r;

    /* Not the journal (started by hand, or by a test): timestamps help. */
    dsv4_log_set_timestamps(getenv("JOURNAL_STREAM") == NULL);
    r = dsv4_settings_from_args(&settings, argc, argv, DSV4D_CONFIG_PATH, &action);
    if (r < 0) {
        dsv4_log_err("%s", dsv4_error_message());
        return DSV4D_EXIT_CONFIG;
    }
    switch (action) {
    case DSV4_SETTINGS_HELP:
        dsv4_settings_usage(stdout, DSV4D_CONFIG_PATH);
        return 0;
    case DSV4_SETTINGS_VERSION:
        printf("dsv4d %s\n", PACKAGE_VERSION);
        return 0;
    case DSV4_SETTINGS_PRINT:
        dsv4_settings_print(&settings, stdout);
        return 0;
    case DSV4_SETTINGS_RUN:
        break;
    }
    dsv4_log_set_level(settings.log_level);
    r = dsv4_settings_validate(&settings);
    if (r < 0) {
        dsv4_log_err("%s", dsv4_error_message());
        return DSV4D_EXIT_CONFIG;
    }
    r = dsv4_reqmem_init();
    if (r < 0) {
        dsv4_log_err("%s", dsv4_error_message());
        return EXIT_FAILURE;
    }
    dsv4_log_notice("dsv4d %s starting: model %s, backend %s%s%s", PACKAGE_VERSION, settings.model,
                    dsv4_settings_backend_name(settings.backend), settings.config_path[0] ? ", config " : "",
                    settings.config_path);
    struct dsv4_reqmem_stats mem;
    dsv4_reqmem_get_stats(&mem);
    if (mem.arena)
        dsv4_log_info("request memory: %s, arena %u", mem.allocator, mem.arena);
    else
        dsv4_log_info("request memory: %s", mem.allocator);

    r = dsv4_server_init(&server, &settings);
    if (r < 0) {
        dsv4_log_err("%s", dsv4_error_message());
        dsv4_notify_status("failed: %s", dsv4_error_message());
        dsv4_server_done(&server);
        return r == -EINVAL || r == -ENOENT ? DSV4D_EXIT_CONFIG : EXIT_FAILURE;
    }
    r = dsv4_server_run(&server);
    dsv4_server_done(&server);
    dsv4_log_notice("dsv4d stopped");
    return r;
}
