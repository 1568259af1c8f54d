/* SPDX-License-Identifier: MIT */
/* A job's answer (openai/job_internal.h): the whole response at once, or server-sent events, handed to
 * the HTTP thread under the job's lock; and the OpenAI error object. */
#include "build-config.h"

#include <jansson.h>
#include <microhttpd.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "openai/job_internal.h"

char *dsv4_oai_error_json(const char *type, const char *param, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    /* A message that quotes the client's text may have been cut (here or in a buffer before) inside a
     * character, and JSON strings are whole UTF-8: the message ends before it. */
    msg[dsv4_utf8_valid_prefix(msg, strlen(msg))] = 0;
    json_t *o = json_pack("{s:{s:s,s:s,s:s?,s:s?}}", "error", "message", msg, "type", type, "param", param, "code",
                          code);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* Lock held. */
void oai_job_wake(struct dsv4_oai_job *j)
{
    if (j->suspended && j->conn) {
        j->suspended = false;
        MHD_resume_connection(j->conn);
    }
}

/* Whether the client is still there. While its connection is suspended the HTTP thread does not look
 * at it, so a client that closed is seen here, at the next token. Lock held. */
bool oai_client_alive(struct dsv4_oai_job *j)
{
    if (j->gone)
        return !j->client_left;
    if (j->suspended && j->client_fd >= 0) {
        struct pollfd p = {.fd = j->client_fd, .events = POLLRDHUP};
        if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            j->client_left = true;
            return false;
        }
    }
    return true;
}

/* The whole response at once. Takes body. */
void oai_respond(struct dsv4_oai_job *j, unsigned status, char *body)
{
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->head_ready = true;
        j->stream = false;
        j->status = body ? status : 500;
        dsv4_buf_free(&j->out);
        if (body)
            dsv4_buf_puts(&j->out, body);
    }
    j->done = true;
    oai_job_wake(j);
    pthread_mutex_unlock(&j->lock);
    free(body);
}

void oai_respond_json(struct dsv4_oai_job *j, unsigned status, json_t *o)
{
    oai_respond(j, status, o ? json_dumps(o, JSON_COMPACT) : NULL);
    json_decref(o);
}

void oai_respond_error(struct dsv4_oai_job *j, unsigned status, const char *type, const char *param,
                       const char *code, const char *msg)
{
    oai_respond(j, status, dsv4_oai_error_json(type, param, code, "%s", msg));
}

/* One server-sent event (data: JSON) on the stream; the first one sends the response head. */
void oai_stream_event(struct dsv4_oai_job *j, const char *data)
{
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->head_ready = true;
        j->stream = true;
        j->status = 200;
    }
    if (j->stream && !j->gone) {
        dsv4_buf_puts(&j->out, "data: ");
        dsv4_buf_puts(&j->out, data);
        dsv4_buf_puts(&j->out, "\n\n");
    }
    oai_job_wake(j);
    pthread_mutex_unlock(&j->lock);
}

void oai_stream_json(struct dsv4_oai_job *j, json_t *o)
{
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    if (s)
        oai_stream_event(j, s);
    free(s);
    json_decref(o);
}
