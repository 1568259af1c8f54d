/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "daemon/listen.h"
#include "daemon/log.h"
#include "engine/error.h"

#define DSV4_LISTEN_MODE 0660

/* What the log calls a passed socket: the path it is bound to, and its FileDescriptorName= when
 * systemd gave one ("unknown" is what sd_listen_fds_with_names() says when none was). */
static void activated_name(int fd, const char *fd_name, char *out, size_t size)
{
    struct sockaddr_un addr = { 0 };
    socklen_t len = sizeof(addr);
    bool named = fd_name && *fd_name && strcmp(fd_name, "unknown") != 0;
    if (getsockname(fd, (struct sockaddr *)&addr, &len) == 0 && addr.sun_family == AF_UNIX &&
        len > offsetof(struct sockaddr_un, sun_path) && addr.sun_path[0]) {
        size_t plen = strnlen(addr.sun_path, len - offsetof(struct sockaddr_un, sun_path));
        if (named)
            snprintf(out, size, "%.*s (%s)", (int)plen, addr.sun_path, fd_name);
        else
            snprintf(out, size, "%.*s", (int)plen, addr.sun_path);
    } else if (named) {
        snprintf(out, size, "%s (fd %d)", fd_name, fd);
    } else {
        snprintf(out, size, "passed fd %d", fd);
    }
}

int dsv4_listen_activated(struct dsv4_listeners *l)
{
    char **names = NULL;
    int n = sd_listen_fds_with_names(1, &names);

    if (n < 0)
        return dsv4_error_set(n, "socket activation: %s", strerror(-n));
    if (n > DSV4_LISTEN_MAX) {
        for (int i = 0; i < n; i++)
            free(names ? names[i] : NULL);
        free(names);
        return dsv4_error_set(-E2BIG, "socket activation passed %d sockets, at most %d are served", n,
                              DSV4_LISTEN_MAX);
    }
    int r = n;
    for (int i = 0; i < n; i++) {
        int fd = SD_LISTEN_FDS_START + i;
        const char *name = names && names[i] ? names[i] : "unknown";
        if (r >= 0 && sd_is_socket(fd, AF_UNIX, SOCK_STREAM, 1) <= 0)
            r = dsv4_error_set(-ENOTSOCK, "socket activation: fd %d (%s) is not a listening AF_UNIX stream "
                               "socket (ListenStream= must name a path)", fd, name);
        if (r >= 0) {
            l->fds[l->n] = fd;
            activated_name(fd, names ? names[i] : NULL, l->names[l->n], sizeof(l->names[l->n]));
            l->n++;
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        }
        free(names ? names[i] : NULL);
    }
    free(names);
    return r;
}

/* Is someone accepting at addr? 1 live, 0 stale (nobody listening), <0 error. The connect does not
 * block: on a live server whose listen backlog is full a blocking one waits for an accept that may
 * never come, and AF_UNIX answers a non-blocking one EAGAIN then, which means live as well. */
static int socket_is_live(const struct sockaddr_un *addr)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), r;
    if (fd < 0)
        return -errno;
    r = connect(fd, (const struct sockaddr *)addr, sizeof(*addr));
    r = r == 0 || errno == EAGAIN || errno == EINPROGRESS ? 1
        : (errno == ECONNREFUSED || errno == ENOENT) ? 0 : -errno;
    close(fd);
    return r;
}

int dsv4_listen_path(struct dsv4_listeners *l, const char *path)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    struct stat st;
    mode_t old_umask;
    int fd, r;

    if (l->n >= DSV4_LISTEN_MAX)
        return dsv4_error_set(-E2BIG, "--listen %s: too many sockets", path);
    if (strlen(path) >= sizeof(addr.sun_path) || strlen(path) >= sizeof(l->bound_path))
        return dsv4_error_set(-ENAMETOOLONG, "--listen %s: path longer than %zu bytes", path,
                              sizeof(addr.sun_path) - 1);
    strcpy(addr.sun_path, path);

    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            return dsv4_error_set(-EEXIST, "--listen %s: exists and is not a socket; not replacing it", path);
        r = socket_is_live(&addr);
        if (r > 0)
            return dsv4_error_set(-EADDRINUSE, "--listen %s: another server is accepting connections there", path);
        if (r < 0)
            return dsv4_error_set(r, "--listen %s: cannot tell whether the socket is in use: %s", path,
                                  strerror(-r));
        if (unlink(path) < 0 && errno != ENOENT)
            return dsv4_error_set(-errno, "--listen %s: removing the stale socket: %s", path, strerror(errno));
        dsv4_log_notice("replaced stale socket %s", path);
    }

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return dsv4_error_set(-errno, "socket: %s", strerror(errno));
    /* The socket file is created with mode 0660 from the start: no window where others may connect. */
    old_umask = umask(0777 & ~DSV4_LISTEN_MODE);
    r = bind(fd, (struct sockaddr *)&addr, sizeof(addr));
    umask(old_umask);
    if (r < 0) {
        r = -errno;
        close(fd);
        if (r == -ENOENT)   /* exit status 2 (main.c): a setting to fix, not a failure to retry */
            return dsv4_error_set(r, "--listen %s: its directory does not exist", path);
        return dsv4_error_set(r, "--listen %s: bind: %s", path, strerror(-r));
    }
    if (chmod(path, DSV4_LISTEN_MODE) < 0 || listen(fd, DSV4_LISTEN_BACKLOG) < 0) {
        r = -errno;
        unlink(path);
        close(fd);
        return dsv4_error_set(r, "--listen %s: %s", path, strerror(-r));
    }
    l->fds[l->n] = fd;
    snprintf(l->names[l->n], sizeof(l->names[l->n]), "%s", path);
    l->n++;
    strcpy(l->bound_path, path);
    return 0;
}

void dsv4_listen_close(struct dsv4_listeners *l)
{
    for (int i = 0; i < l->n; i++)
        close(l->fds[i]);
    l->n = 0;
    if (l->bound_path[0])
        unlink(l->bound_path);
    l->bound_path[0] = '\0';
}
