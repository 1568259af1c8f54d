/* SPDX-License-Identifier: MIT */
/* A request's work against dsv4d, on its own thread: OpenAI's JSON in, dsv4d through libdsv4client,
 * OpenAI's JSON (or server-sent events) out, handed to the HTTP thread through the job (server.h). */
#include "build-config.h"

#include <errno.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "openai/job_internal.h"

void dsv4_oai_job_ref(struct dsv4_oai_job *j)
{
    pthread_mutex_lock(&j->lock);
    j->refs++;
    pthread_mutex_unlock(&j->lock);
}

void dsv4_oai_job_unref(struct dsv4_oai_job *j)
{
    if (!j)
        return;
    pthread_mutex_lock(&j->lock);
    int left = --j->refs;
    pthread_mutex_unlock(&j->lock);
    if (left)
        return;
    pthread_mutex_destroy(&j->lock);
    dsv4_buf_free(&j->out);
    free(j->body);
    free(j);
}

int dsv4_oai_job_head(struct dsv4_oai_job *j, void *conn, unsigned *ret_status, bool *ret_stream, char **ret_body,
                      size_t *ret_len)
{
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->suspended = true;
        MHD_suspend_connection(conn);
        pthread_mutex_unlock(&j->lock);
        return -EAGAIN;
    }
    *ret_status = j->status;
    *ret_stream = j->stream;
    *ret_body = NULL;
    *ret_len = 0;
    if (!j->stream) {
        *ret_len = j->out.len;
        *ret_body = dsv4_buf_steal(&j->out);
    }
    pthread_mutex_unlock(&j->lock);
    return 0;
}

long dsv4_oai_job_read(struct dsv4_oai_job *j, char *buf, size_t max)
{
    long n;
    pthread_mutex_lock(&j->lock);
    if (j->out.len) {
        size_t k = j->out.len < max ? j->out.len : max;
        memcpy(buf, j->out.p, k);
        dsv4_buf_consume(&j->out, k);
        n = (long)k;
    } else if (j->done || !j->conn) {
        n = -1;
    } else {
        j->suspended = true;
        MHD_suspend_connection(j->conn);
        n = 0;
    }
    pthread_mutex_unlock(&j->lock);
    return n;
}

/* Cancel every choice dsv4d works on for the job. Lock held. */
static void cancel_choices(struct dsv4_oai_job *j)
{
    for (unsigned i = 0; i < DSV4_OAI_MAX_CHOICES; i++)
        if (j->cli[i])
            dsv4_client_cancel(j->cli[i]);
}

void dsv4_oai_job_detach(struct dsv4_oai_job *j, bool client_left)
{
    pthread_mutex_lock(&j->lock);
    j->gone = true;
    j->conn = NULL;
    j->suspended = false;
    if (client_left && !j->done) {
        j->client_left = true;
        cancel_choices(j);
    }
    pthread_mutex_unlock(&j->lock);
}

void dsv4_oai_jobs_cancel_all(struct dsv4_oai_server *s)
{
    pthread_mutex_lock(&s->lock);
    for (struct dsv4_oai_job *j = s->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->lock);
        /* A choice not yet in dsv4_client_generate* (connecting, asking the model name) has nothing to
         * cancel: it reads this before it starts. */
        j->stopping = true;
        cancel_choices(j);
        pthread_mutex_unlock(&j->lock);
    }
    pthread_mutex_unlock(&s->lock);
}

static void *job_main(void *arg)
{
    struct dsv4_oai_job *j = arg;
    struct dsv4_oai_server *s = j->srv;
    switch (j->route) {
    case DSV4_OAI_ROUTE_CHAT: oai_run_chat(j); break;
    case DSV4_OAI_ROUTE_COMPLETIONS: oai_run_completions(j); break;
    case DSV4_OAI_ROUTE_MODELS: oai_run_models(j); break;
    case DSV4_OAI_ROUTE_MODEL: oai_run_model(j); break;
    case DSV4_OAI_ROUTE_HEALTH: oai_run_health(j); break;
    case DSV4_OAI_ROUTE_METRICS: oai_run_metrics(j); break;
    case DSV4_OAI_N_ROUTES: break;
    }
    /* Whatever path was taken, the response is complete now. */
    pthread_mutex_lock(&j->lock);
    if (!j->head_ready) {
        j->head_ready = true;
        j->status = 500;
        dsv4_buf_puts(&j->out, "{\"error\":{\"message\":\"no response\",\"type\":\"server_error\"}}");
    }
    j->done = true;
    oai_job_wake(j);
    pthread_mutex_unlock(&j->lock);

    pthread_mutex_lock(&s->lock);
    if (j->prev)
        j->prev->next = j->next;
    else
        s->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    if (j->route == DSV4_OAI_ROUTE_CHAT || j->route == DSV4_OAI_ROUTE_COMPLETIONS)
        s->generations--;
    else
        s->quick_jobs--;
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->lock);
    dsv4_oai_job_unref(j);
    return NULL;
}

struct dsv4_oai_job *dsv4_oai_job_new(struct dsv4_oai_server *s, enum dsv4_oai_route route, char *body,
                                      size_t body_len)
{
    struct dsv4_oai_job *j = calloc(1, sizeof(*j));
    if (!j) {
        free(body);
        return NULL;
    }
    j->srv = s;
    j->route = route;
    j->body = body;
    j->body_len = body_len;
    j->refs = 1;
    j->client_fd = -1;
    pthread_mutex_init(&j->lock, NULL);
    return j;
}

int dsv4_oai_job_start(struct dsv4_oai_job *j, void *conn, int client_fd)
{
    struct dsv4_oai_server *s = j->srv;
    pthread_attr_t attr;
    pthread_t t;
    j->conn = conn;
    j->client_fd = client_fd;
    j->refs++;   /* the thread's */
    pthread_mutex_lock(&s->lock);
    j->stopping = s->stopping;      /* the stop may have cancelled the others since on_request looked */
    j->next = s->jobs;
    if (s->jobs)
        s->jobs->prev = j;
    s->jobs = j;
    pthread_mutex_unlock(&s->lock);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, DSV4_OAI_WORKER_STACK);
    int rc = pthread_create(&t, &attr, job_main, j);
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return 0;
    pthread_mutex_lock(&s->lock);
    if (j->prev)
        j->prev->next = j->next;
    else
        s->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    if (j->route == DSV4_OAI_ROUTE_CHAT || j->route == DSV4_OAI_ROUTE_COMPLETIONS)
        s->generations--;
    else
        s->quick_jobs--;
    pthread_mutex_unlock(&s->lock);
    j->refs--;
    j->conn = NULL;
    return -rc;
}
