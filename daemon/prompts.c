/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/prompts.h"
#include "engine/error.h"

struct dsv4_prompt_worker {
    pthread_t thread;
    bool started;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stop;
    struct dsv4_prompt_job *todo_head, *todo_tail;  /* FIFO */
    struct dsv4_prompt_job *done_head, *done_tail;
    int event_fd;
};

static void push(struct dsv4_prompt_job **head, struct dsv4_prompt_job **tail, struct dsv4_prompt_job *job)
{
    job->next = NULL;
    if (*tail)
        (*tail)->next = job;
    else
        *head = job;
    *tail = job;
}

static struct dsv4_prompt_job *pop(struct dsv4_prompt_job **head, struct dsv4_prompt_job **tail)
{
    struct dsv4_prompt_job *job = *head;
    if (job) {
        *head = job->next;
        if (!*head)
            *tail = NULL;
        job->next = NULL;
    }
    return job;
}

static void *worker_main(void *arg)
{
    struct dsv4_prompt_worker *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->stop && !w->todo_head)
            pthread_cond_wait(&w->wake, &w->lock);
        if (w->stop)
            break;
        struct dsv4_prompt_job *job = pop(&w->todo_head, &w->todo_tail);
        pthread_mutex_unlock(&w->lock);
        job->run(job);
        job->ran = true;
        pthread_mutex_lock(&w->lock);
        push(&w->done_head, &w->done_tail, job);
        uint64_t one = 1;
        (void)!write(w->event_fd, &one, sizeof(one));   /* EAGAIN only when saturated: already readable */
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

int dsv4_prompt_worker_start(struct dsv4_prompt_worker **ret)
{
    struct dsv4_prompt_worker *w = calloc(1, sizeof(*w));
    int r;
    if (!w)
        return dsv4_error_set(-ENOMEM, "prompt worker: out of memory");
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    w->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (w->event_fd < 0) {
        r = dsv4_error_set(-errno, "prompt worker: eventfd: %s", strerror(errno));
        dsv4_prompt_worker_free(w);
        return r;
    }
    r = pthread_create(&w->thread, NULL, worker_main, w);
    if (r) {
        dsv4_prompt_worker_free(w);
        return dsv4_error_set(-r, "prompt worker: starting its thread: %s", strerror(r));
    }
    w->started = true;
    *ret = w;
    return 0;
}

int dsv4_prompt_worker_fd(const struct dsv4_prompt_worker *w)
{
    return w->event_fd;
}

void dsv4_prompt_worker_submit(struct dsv4_prompt_worker *w, struct dsv4_prompt_job *job)
{
    job->ran = false;
    pthread_mutex_lock(&w->lock);
    push(&w->todo_head, &w->todo_tail, job);
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
}

struct dsv4_prompt_job *dsv4_prompt_worker_take_done(struct dsv4_prompt_worker *w)
{
    uint64_t n;
    (void)!read(w->event_fd, &n, sizeof(n));
    pthread_mutex_lock(&w->lock);
    struct dsv4_prompt_job *job = pop(&w->done_head, &w->done_tail);
    pthread_mutex_unlock(&w->lock);
    return job;
}

void dsv4_prompt_worker_stop(struct dsv4_prompt_worker *w)
{
    if (!w || !w->started)
        return;
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    w->started = false;
    for (struct dsv4_prompt_job *job; (job = pop(&w->todo_head, &w->todo_tail));)
        push(&w->done_head, &w->done_tail, job);
}

void dsv4_prompt_worker_free(struct dsv4_prompt_worker *w)
{
    if (!w)
        return;
    if (w->event_fd >= 0)
        close(w->event_fd);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
    free(w);
}
