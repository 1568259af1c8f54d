/* SPDX-License-Identifier: MIT */
/* A request's work against dsv4d (job.c), and the OpenAI error object every answer uses. */
#ifndef DSV4_OPENAI_JOB_H
#define DSV4_OPENAI_JOB_H

#include <stdbool.h>
#include <stddef.h>

#include "openai/server.h"

/* A job is created by http.c once the request is complete, runs on its own thread, and hands
 * its response back through the functions below. */
struct dsv4_oai_job *dsv4_oai_job_new(struct dsv4_oai_server *s, enum dsv4_oai_route route, char *body,
                                      size_t body_len);
int dsv4_oai_job_start(struct dsv4_oai_job *j, void *conn, int client_fd);
void dsv4_oai_job_ref(struct dsv4_oai_job *j);
void dsv4_oai_job_unref(struct dsv4_oai_job *j);
/* The HTTP side asks for the response: 0 and *ret_* set when the head is known, -EAGAIN when the
 * connection must wait (it is then suspended and resumed when there is news). */
int dsv4_oai_job_head(struct dsv4_oai_job *j, void *conn, unsigned *ret_status, bool *ret_stream,
                      char **ret_body, size_t *ret_len);
/* Streamed body: bytes copied into buf, 0 and the connection suspended when none yet, -1 at the end. */
long dsv4_oai_job_read(struct dsv4_oai_job *j, char *buf, size_t max);
/* The connection is finished with (response sent, or the client left): cancel work still running. */
void dsv4_oai_job_detach(struct dsv4_oai_job *j, bool client_left);
/* Cancel every job (shutdown). */
void dsv4_oai_jobs_cancel_all(struct dsv4_oai_server *s);

/* An OpenAI error object: {"error": {"message", "type", "param", "code"}}; malloc'd JSON text. */
char *dsv4_oai_error_json(const char *type, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
