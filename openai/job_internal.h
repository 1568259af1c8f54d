/* SPDX-License-Identifier: MIT */
/* The pieces of a job (openai/job.h): its state, and what the pieces call of each other. The calls
 * point one way: job.c (the hand-over with the HTTP thread, the job's thread) runs the routes of
 * job_generate.c (chat and completions) and job_info.c (models, health, metrics); those use
 * job_fields.c (the request's fields), job_dsv4d.c (the connection to dsv4d) and job_respond.c
 * (the answer, whole or streamed), which calls none of them. */
#ifndef DSV4_OPENAI_JOB_INTERNAL_H
#define DSV4_OPENAI_JOB_INTERNAL_H

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "client/dsv4client.h"
#include "openai/buf.h"
#include "openai/job.h"
#include "openai/render.h"
#include "openai/server.h"

/* A job's thread, and each further choice's: JSON parsing recurses at most jansson's depth limit. */
#define DSV4_OAI_WORKER_STACK (2u << 20)

/* How long a health, metrics or models request waits for dsv4d. */
#define QUICK_TIMEOUT_MS 5000

struct dsv4_oai_job {
    struct dsv4_oai_server *srv;
    enum dsv4_oai_route route;
    char *body;
    size_t body_len;

    pthread_mutex_t lock;        /* everything below */
    int refs;
    struct MHD_Connection *conn; /* NULL once the HTTP side is done with the job */
    int client_fd;
    bool suspended;              /* the connection waits for news from this job */
    bool head_ready;             /* status and kind of response are known */
    bool stream;                 /* the response is server-sent events from out */
    bool done;                   /* nothing more will be added to out */
    bool gone;                   /* the HTTP side is finished */
    bool client_left;
    bool stopping;               /* the server stops: no generation starts, those running are cancelled */
    unsigned status;
    struct dsv4_buf out;
    struct dsv4_client *cli[DSV4_OAI_MAX_CHOICES];  /* while dsv4d works for a choice: what cancel needs */
    struct dsv4_oai_job *prev, *next;
};

/* job_respond.c. Lock held: */
void oai_job_wake(struct dsv4_oai_job *j);         /* resume the connection waiting for news */
bool oai_client_alive(struct dsv4_oai_job *j);     /* false once the client has gone */
/* The whole response at once (takes body), or as JSON (takes o), or an OpenAI error object. */
void oai_respond(struct dsv4_oai_job *j, unsigned status, char *body);
void oai_respond_json(struct dsv4_oai_job *j, unsigned status, json_t *o);
void oai_respond_error(struct dsv4_oai_job *j, unsigned status, const char *type, const char *param,
                       const char *code, const char *msg);
/* One server-sent event on the stream (the first sends the head); as JSON (takes o). */
void oai_stream_event(struct dsv4_oai_job *j, const char *data);
void oai_stream_json(struct dsv4_oai_job *j, json_t *o);

/* job_dsv4d.c */
/* Answer the error rc of a libdsv4client call doing `what` (a dsv4d code maps to its HTTP status). */
void oai_respond_client_error(struct dsv4_oai_job *j, struct dsv4_client *c, int rc, const char *what);
/* A connection to dsv4d, its answers waited for up to timeout_ms, into *ret: 0, or -errno with *ret
 * the client whose message says why (NULL when there was no memory for one; the caller closes it). */
int oai_dsv4d_open(const struct dsv4_oai_config *cfg, int timeout_ms, struct dsv4_client **ret);
/* The same, or an answered error and -errno. */
int oai_connect_dsv4d(struct dsv4_oai_job *j, int timeout_ms, struct dsv4_client **ret);
/* The model name requests and responses carry: configured, or dsv4d's (asked once). */
void oai_model_name(struct dsv4_oai_job *j, struct dsv4_client *c, char *out, size_t n);

/* job_fields.c */
struct oai_bad {
    const char *param;
    char msg[512];
};

/* Set b (the field and a message) and return -EINVAL. */
int oai_bad(struct oai_bad *b, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Optional fields: absent or null leaves *v; given (may be NULL) says whether it was there. */
int oai_opt_number(const json_t *root, const char *key, double lo, double hi, double *v, bool *given,
                   struct oai_bad *b);
int oai_opt_int(const json_t *root, const char *key, json_int_t lo, json_int_t hi, json_int_t *v, bool *given,
                struct oai_bad *b);
int oai_opt_bool(const json_t *root, const char *key, bool *v, struct oai_bad *b);

/* What both completion endpoints take. */
struct oai_gen_request {
    json_t *root;
    bool stream, include_usage;
    int n;                         /* choices, 1 .. DSV4_OAI_MAX_CHOICES: choice i samples with seed + i */
    int logprobs;                  /* -1 off; else top alternatives per token */
    struct dsv4_client_generate_params p;
    const char *stop[DSV4_CLIENT_MAX_STOP];
    int32_t stop_ids[DSV4_CLIENT_MAX_STOP_TOKEN_IDS];
};

/* The fields both endpoints take, into g (g->root set). */
int oai_parse_common(struct oai_gen_request *g, uint32_t default_max_tokens, struct oai_bad *b);
/* The body as a JSON object, or NULL with the error answered. */
json_t *oai_parse_body(struct dsv4_oai_job *j);
void oai_respond_bad(struct dsv4_oai_job *j, const struct oai_bad *b);
int oai_parse_thinking(const json_t *root, struct dsv4_render_opts *o, struct oai_bad *b);
int oai_parse_tools(const json_t *root, json_t **ret_tools, struct oai_bad *b);

/* job_generate.c and job_info.c: the routes, each answering its job */
void oai_run_chat(struct dsv4_oai_job *j);
void oai_run_completions(struct dsv4_oai_job *j);
void oai_run_models(struct dsv4_oai_job *j);
void oai_run_model(struct dsv4_oai_job *j);
void oai_run_health(struct dsv4_oai_job *j);
void oai_run_metrics(struct dsv4_oai_job *j);

#endif
