/* SPDX-License-Identifier: MIT */
/* The server's lifecycle state: server.c moves it from boot to exit; dispatch.c obeys it (new work
 * held, refused) and reports it (health). */
#ifndef DSV4_DAEMON_LIFECYCLE_H
#define DSV4_DAEMON_LIFECYCLE_H

#define DSV4_SERVER_REASON_MAX 512

enum dsv4_server_state {
    DSV4_SERVER_LOADING,        /* engine thread booting */
    DSV4_SERVER_WARMUP,         /* warm-up generation in flight */
    DSV4_SERVER_READY,
    DSV4_SERVER_DRAINING,       /* SIGTERM: finishing in-flight work, no new work */
    DSV4_SERVER_FAILED,         /* the engine failed: answering what is left, then exit 1 */
    DSV4_SERVER_EXITING,
};

#endif
