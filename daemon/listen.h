/* SPDX-License-Identifier: MIT */
/* The listening sockets: handed over by systemd (socket activation) or bound by hand with --listen. */
#ifndef DSV4_DAEMON_LISTEN_H
#define DSV4_DAEMON_LISTEN_H

#define DSV4_LISTEN_MAX 16      /* sockets accepted from socket activation */
#define DSV4_LISTEN_BACKLOG 128

struct dsv4_listeners {
    int n;
    int fds[DSV4_LISTEN_MAX];
    char names[DSV4_LISTEN_MAX][192];   /* the path (and FileDescriptorName=), for the log */
    char bound_path[108];               /* set when we bound it ourselves: unlinked at exit */
};

/* Take the sockets systemd passed (LISTEN_FDS), each checked to be a listening AF_UNIX stream
 * socket. Returns the count (0 when not socket-activated) or -errno. */
int dsv4_listen_activated(struct dsv4_listeners *l);

/* Bind PATH (mode 0660). Refuses a live socket (another daemon answers there) and anything that
 * is not a socket; replaces a stale socket file. */
int dsv4_listen_path(struct dsv4_listeners *l, const char *path);

/* Close the sockets; unlink the path we bound. */
void dsv4_listen_close(struct dsv4_listeners *l);

#endif
