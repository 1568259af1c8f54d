/* SPDX-License-Identifier: MIT */
/* dsv4-openai's HTTP side (http.c): libmicrohttpd on the listening socket. */
#ifndef DSV4_OPENAI_HTTP_H
#define DSV4_OPENAI_HTTP_H

#include "openai/server.h"

int dsv4_oai_http_start(struct dsv4_oai_server *s, int listen_fd);
/* Stop taking connections, cancel what runs, wait (at most grace_s) and stop. */
void dsv4_oai_http_stop(struct dsv4_oai_server *s, unsigned grace_s);

#endif
