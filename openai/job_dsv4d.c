/* SPDX-License-Identifier: MIT */
/* A job's connection to dsv4d (openai/job_internal.h), and dsv4d's errors as HTTP answers. */
#include "build-config.h"

#include <errno.h>
#include <stdio.h>

#include "openai/job_internal.h"

/* HTTP status, OpenAI error type and code for a dsv4d protocol error (doc/PROTOCOL.md). */
static void map_server_code(int code, unsigned *status, const char **type, const char **ocode)
{
    *ocode = dsv4_client_code_name(code);
    if (code == 301) {
        *status = 400;
        *type = "invalid_request_error";
        *ocode = "context_length_exceeded";
    } else if (code == 401 || code == 402) {
        *status = 429;
        *type = "rate_limit_exceeded";
    } else if (code >= 200 && code < 500) {
        *status = 400;
        *type = "invalid_request_error";
    } else if (code == 500 || code == 501 || code == 503) {
        *status = 503;
        *type = "server_error";
    } else {
        *status = 500;
        *type = "server_error";
    }
}

void oai_respond_client_error(struct dsv4_oai_job *j, struct dsv4_client *c, int rc, const char *what)
{
    char msg[768];
    if (rc == -EREMOTEIO) {
        unsigned status;
        const char *type, *code;
        map_server_code(dsv4_client_server_code(c), &status, &type, &code);
        oai_respond_error(j, status, type, NULL, code, dsv4_client_error_message(c));
        return;
    }
    snprintf(msg, sizeof(msg), "%s: dsv4d: %s", what, dsv4_client_error_message(c));
    oai_respond_error(j, 503, "server_error", NULL, "dsv4d_unavailable", msg);
}

int oai_dsv4d_open(const struct dsv4_oai_config *cfg, int timeout_ms, struct dsv4_client **ret)
{
    struct dsv4_client *c = dsv4_client_new();
    *ret = c;
    if (!c)
        return -ENOMEM;
    int rc = dsv4_client_connect(c, cfg->socket, timeout_ms);
    if (rc < 0)
        return rc;
    dsv4_client_set_timeout(c, timeout_ms);
    return 0;
}

int oai_connect_dsv4d(struct dsv4_oai_job *j, int timeout_ms, struct dsv4_client **ret)
{
    struct dsv4_client *c;
    int rc = oai_dsv4d_open(j->srv->cfg, timeout_ms, &c);
    if (rc < 0) {
        if (c)
            oai_respond_client_error(j, c, rc, "connecting");
        else
            oai_respond_error(j, 500, "server_error", NULL, NULL, "out of memory");
        dsv4_client_close(c);
        return rc;
    }
    *ret = c;
    return 0;
}

/* The name requests and responses carry: configured, or dsv4d's (asked once). */
void oai_model_name(struct dsv4_oai_job *j, struct dsv4_client *c, char *out, size_t n)
{
    struct dsv4_oai_server *s = j->srv;
    if (s->cfg->model_name) {
        snprintf(out, n, "%s", s->cfg->model_name);
        return;
    }
    pthread_mutex_lock(&s->lock);
    snprintf(out, n, "%s", s->model_name);
    pthread_mutex_unlock(&s->lock);
    if (out[0])
        return;
    const struct dsv4_client_info *info;
    if (dsv4_client_hello(c, &info) == 0 && info->model_name && info->model_name[0]) {
        pthread_mutex_lock(&s->lock);
        snprintf(s->model_name, sizeof(s->model_name), "%s", info->model_name);
        pthread_mutex_unlock(&s->lock);
        snprintf(out, n, "%s", info->model_name);
    } else {
        snprintf(out, n, "dsv4");
    }
}
