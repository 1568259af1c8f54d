/* SPDX-License-Identifier: MIT */
/* dsv4ctl bench: a load generator through the real daemon. For each concurrency level C it runs
 * C client threads, each with its own connection, that send streamed requests with random token-id
 * prompts back to back until the level's request count is reached, and reports time to first
 * token, time per output token (median and p99 over requests) and output tokens/s over the level's
 * wall time, each of the requests that finished (a failed request is counted, its tokens are not).
 * With admit_tokens, once every stream of a level has its first token, one more connection sends a
 * prompt of that many tokens (max_tokens 1): the report adds its time to first token and the token
 * gaps the running streams saw while it was prefilled (what a long prompt arriving costs the users
 * already being served). With shared_prefix, every prompt of a run starts with the same ids (a
 * system prompt, the prefix cache's case) and the report adds the tokens the server restored
 * rather than prefilled. */
#ifndef DSV4_CLIENT_CTL_BENCH_H
#define DSV4_CLIENT_CTL_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "client/dsv4client.h"

#define CTL_BENCH_MAX_LEVELS 16
#define CTL_BENCH_MAX_CONCURRENCY 1024      /* client threads (and connections) of one level */
#define CTL_BENCH_MAX_REQUESTS 1000000      /* requests of one level */
#define CTL_BENCH_MAX_PROMPT (1u << 20)     /* prompt tokens of one request */
#define CTL_BENCH_MAX_GAPS (1u << 16)       /* stream token gaps kept during an admission */

struct ctl_bench_opts {
    const char *socket;         /* NULL: $DSV4_SOCKET, then the default */
    int connect_timeout_ms;
    int timeout_ms;             /* per answer frame, <= 0 none */
    int levels[CTL_BENCH_MAX_LEVELS];
    int n_levels;
    uint32_t prompt_tokens;
    uint32_t requests;          /* per level; 0: 4 x C, at least 8 */
    uint64_t seed;              /* prompt ids and sampling seeds derive from it, the level and the request
                                 * index: a fresh one for each run keeps a prefix cache from serving
                                 * one run's prompts to the next */
    uint32_t admit_tokens;      /* 0: none; else the prompt admitted beside each level's streams */
    uint32_t shared_prefix;     /* the first ids every prompt shares; below prompt_tokens */
    bool json;                  /* one JSON object a level on out instead of the table */
    /* sampling: every field but the prompt, which each request fills in */
    struct dsv4_client_generate_params gp;
};

/* 0 when every request of every level finished (stop or length); -EREMOTEIO when some failed or
 * were refused (counted in the report); another -errno when the daemon could not be reached or
 * described (message in err, err_len bytes). progress: a line redrawn while a level runs, or NULL. */
int ctl_bench_run(const struct ctl_bench_opts *o, FILE *out, FILE *progress, char *err, size_t err_len);

#endif
