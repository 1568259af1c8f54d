/* SPDX-License-Identifier: MIT */
/* The prompt worker: one thread that tokenizes large prompts off the io thread, so a client sending
 * megabytes of text does not stall everyone else's requests (a 4 MiB prompt takes about a second to
 * encode). The io thread submits jobs and watches fd(); each job comes back through take_done() in
 * submission order, run or not (stop() hands back the ones it never ran). */
#ifndef DSV4_DAEMON_PROMPTS_H
#define DSV4_DAEMON_PROMPTS_H

#include <stdbool.h>

struct dsv4_prompt_job {
    struct dsv4_prompt_job *next;
    /* Runs on the worker thread; must touch only the job's own data and immutable server state. */
    void (*run)(struct dsv4_prompt_job *job);
    bool ran;
};

struct dsv4_prompt_worker;

/* Start the thread. Returns 0 or -errno with a message. */
int dsv4_prompt_worker_start(struct dsv4_prompt_worker **ret);
/* An eventfd, readable when jobs are done; take_done() resets it. */
int dsv4_prompt_worker_fd(const struct dsv4_prompt_worker *w);
/* Queue a job (never fails: the job is its own queue link). */
void dsv4_prompt_worker_submit(struct dsv4_prompt_worker *w, struct dsv4_prompt_job *job);
/* The oldest finished job, or NULL. */
struct dsv4_prompt_job *dsv4_prompt_worker_take_done(struct dsv4_prompt_worker *w);
/* Finish the job in progress, join the thread, and move the jobs never run to the done list
 * (job->ran false). Accepts NULL. */
void dsv4_prompt_worker_stop(struct dsv4_prompt_worker *w);
/* After stop(), with every job taken. Accepts NULL. */
void dsv4_prompt_worker_free(struct dsv4_prompt_worker *w);

#endif
