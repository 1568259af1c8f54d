/* SPDX-License-Identifier: MIT */
/* dsv4-openai: the OpenAI-compatible HTTP front of dsv4d. One libmicrohttpd daemon (its internal
 * epoll thread owns every socket) and one worker thread per request that talks to dsv4d through
 * libdsv4client; a connection waits suspended while its worker has nothing for it, so the HTTP
 * thread never blocks on dsv4d.
 *
 *   server.h   configuration, limits, the shared server state
 *   http.c     libmicrohttpd: routing, body and header limits, deadlines, auth, suspended responses
 *   job.c      a request's work against dsv4d: chat and text completions (streamed as server-sent
 *              events or whole), models, health, metrics; OpenAI's JSON in and out
 *   render.c, reply.c   the V4 chat format and the parsing of the model's reply (tool calls)
 *   log.c      log lines for journald
 *   main.c     options, socket activation, signals
 * Calls go one way: main -> http -> job -> render/reply, each of them -> log. */
#ifndef DSV4_OPENAI_SERVER_H
#define DSV4_OPENAI_SERVER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "openai/buf.h"

/* Defaults of the limits a client controls (each is an option of dsv4-openai(8)). */
#define DSV4_OAI_DEFAULT_MAX_BODY (8u << 20)        /* request body bytes */
#define DSV4_OAI_DEFAULT_MAX_HEADER (32u << 10)     /* request line + headers (libmicrohttpd's per-connection memory) */
#define DSV4_OAI_DEFAULT_REQUEST_TIMEOUT 30u        /* s to deliver a whole request (headers and body) */
#define DSV4_OAI_DEFAULT_IDLE_TIMEOUT 60u           /* s a silent connection is kept */
#define DSV4_OAI_DEFAULT_MAX_CONNECTIONS 1024u
#define DSV4_OAI_DEFAULT_MAX_GENERATIONS 64u        /* completions in flight (each holds a thread and a dsv4d request) */
#define DSV4_OAI_MAX_QUICK_JOBS 16u                 /* /health, /metrics, /v1/models in flight */
#define DSV4_OAI_DEFAULT_DSV4D_TIMEOUT_MS 600000    /* longest wait for one answer frame of dsv4d */
#define DSV4_OAI_MAX_MESSAGES 4096u                 /* chat messages (dsv4d's own limit on messages) */
#define DSV4_OAI_MAX_CHOICES 16u                    /* n: choices a request asks for (a dsv4d request and a thread each) */
#define DSV4_OAI_MAX_API_KEY 4096u

struct dsv4_oai_config {
    const char *socket;          /* dsv4d's socket; NULL: $DSV4_SOCKET, then the library default */
    const char *listen;          /* HOST:PORT when not socket-activated */
    char *api_key;               /* NULL: no authentication */
    size_t api_key_len;
    const char *model_name;      /* NULL: the name dsv4d reports */
    size_t max_body;
    size_t max_header;
    unsigned request_timeout;
    unsigned idle_timeout;
    unsigned max_connections;
    unsigned max_generations;
    int dsv4d_timeout_ms;
};

void dsv4_oai_config_defaults(struct dsv4_oai_config *cfg);

enum dsv4_oai_route {
    DSV4_OAI_ROUTE_CHAT,
    DSV4_OAI_ROUTE_COMPLETIONS,
    DSV4_OAI_ROUTE_MODELS,
    DSV4_OAI_ROUTE_MODEL,       /* GET /v1/models/{model}: the job's body holds {model} */
    DSV4_OAI_ROUTE_HEALTH,
    DSV4_OAI_ROUTE_METRICS,
    DSV4_OAI_N_ROUTES,
};

struct dsv4_oai_job;
struct MHD_Daemon;

struct dsv4_oai_server {
    const struct dsv4_oai_config *cfg;
    struct MHD_Daemon *mhd;
    pthread_mutex_t lock;             /* everything below */
    pthread_cond_t idle;              /* signalled when a job or a job's response ends */
    struct dsv4_oai_job *jobs;        /* running jobs (for shutdown) */
    unsigned responding;              /* requests with a job whose response has not ended (shutdown waits) */
    unsigned generations, quick_jobs; /* in flight, against the limits */
    bool stopping;
    uint64_t requests[DSV4_OAI_N_ROUTES];
    uint64_t responses_4xx, responses_5xx;
    uint64_t disconnects;             /* generations cancelled because the client left */
    char model_name[256];             /* dsv4d's, once known */
};

#endif
