/* SPDX-License-Identifier: MIT */
/* Models (the list, one by id), health and metrics (openai/job_internal.h): what dsv4d says of itself, in OpenAI's and
 * Prometheus's forms. */
#include "build-config.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "openai/job_internal.h"
#include "openai/log.h"

#define MODEL_ID_ECHO 128       /* bytes of an unknown model id a 404 repeats */

/* The model object of the one model dsv4d serves. */
static json_t *model_object(const char *name, const struct dsv4_client_info *info)
{
    return json_pack("{s:s,s:s,s:I,s:s,s:I}", "id", name, "object", "model", "created", (json_int_t)time(NULL),
                     "owned_by", "dsv4d", "max_model_len", (json_int_t)info->max_context);
}

/* GET /v1/models (list), or GET /v1/models/{model} (one: j->body holds {model}) */
static void run_models(struct dsv4_oai_job *j, bool one)
{
    struct dsv4_client *c;
    const struct dsv4_client_info *info;
    char name[256];
    if (oai_connect_dsv4d(j, QUICK_TIMEOUT_MS, &c) < 0)
        return;
    int rc = dsv4_client_hello(c, &info);
    if (rc < 0) {
        oai_respond_client_error(j, c, rc, "hello");
    } else {
        oai_model_name(j, c, name, sizeof(name));
        if (!one) {
            oai_respond_json(j, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_object(name, info)));
        } else if (j->body_len == strlen(name) && memcmp(j->body, name, j->body_len) == 0) {
            oai_respond_json(j, 200, model_object(name, info));
        } else {
            /* the asked id in the message, its bytes outside printable ASCII as '?' (JSON wants UTF-8) */
            char asked[MODEL_ID_ECHO + 1];
            size_t n = j->body_len < MODEL_ID_ECHO ? j->body_len : MODEL_ID_ECHO;
            for (size_t i = 0; i < n; i++)
                asked[i] = (unsigned char)j->body[i] >= 0x20 && (unsigned char)j->body[i] < 0x7f ? j->body[i] : '?';
            asked[n] = 0;
            oai_respond(j, 404, dsv4_oai_error_json("invalid_request_error", "model", "model_not_found",
                                                    "the model '%s%s' does not exist; this server serves '%s'", asked,
                                                    j->body_len > n ? "..." : "", name));
        }
    }
    dsv4_client_close(c);
}

void oai_run_models(struct dsv4_oai_job *j)
{
    run_models(j, false);
}

void oai_run_model(struct dsv4_oai_job *j)
{
    run_models(j, true);
}

/* A draining dsv4d answers no request: it tells each new connection so and closes it (doc/PROTOCOL.md,
 * health). That refusal is its answer, "draining", not a dsv4d out of reach. */
static bool refused_draining(const struct dsv4_client *c)
{
    return c && strcmp(dsv4_client_code_name(dsv4_client_server_code(c)), "draining") == 0;
}

void oai_run_health(struct dsv4_oai_job *j)
{
    struct dsv4_client *c;
    struct dsv4_client_health h;
    int rc = oai_dsv4d_open(j->srv->cfg, QUICK_TIMEOUT_MS, &c);
    if (rc == 0)
        rc = dsv4_client_health(c, &h);
    if (rc < 0)
        oai_respond_json(j, 503, json_pack("{s:s,s:s}", "status", refused_draining(c) ? "draining" : "unavailable",
                                           "reason", c ? dsv4_client_error_message(c) : "out of memory"));
    else
        oai_respond_json(j, h.status == DSV4_CLIENT_HEALTH_READY ? 200 : 503,
                     json_pack("{s:s,s:s}", "status", dsv4_client_health_name(h.status), "reason", h.reason));
    dsv4_client_close(c);
}

/* s as a label value: the text format's escapes for backslash, double quote and line feed. */
static void label_value(struct dsv4_buf *b, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\' || *s == '"')
            dsv4_buf_putc(b, '\\');
        if (*s == '\n')
            dsv4_buf_puts(b, "\\n");
        else
            dsv4_buf_putc(b, *s);
    }
}

static void metric(struct dsv4_buf *b, const char *name, const char *type, const char *help, double v)
{
    dsv4_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

/* A series of a stats key that an older dsv4d leaves out: none then, rather than a 0 that reads as a count. */
static void stat_metric(struct dsv4_buf *b, const struct dsv4_client_stats *st, const char *key, const char *name,
                        const char *type, const char *help, double v)
{
    if (dsv4_client_stats_has(st, key))
        metric(b, name, type, help, v);
}

/* Speculative decoding's verifies by drafts accepted: entry a counts a accepted (a = 0 .. spec_tokens), so the
 * sum is the drafts accepted. None while off (no entries). */
static void spec_histogram(struct dsv4_buf *b, const struct dsv4_client_stats *st)
{
    if (st->n_spec_hist == 0)
        return;
    dsv4_buf_printf(b, "# HELP dsv4d_spec_accepted_drafts speculative verifies by drafted tokens accepted\n"
                    "# TYPE dsv4d_spec_accepted_drafts histogram\n");
    uint64_t cum = 0, sum = 0;
    for (size_t a = 0; a < st->n_spec_hist; a++) {
        cum += st->spec_hist[a];
        sum += a * st->spec_hist[a];
        dsv4_buf_printf(b, "dsv4d_spec_accepted_drafts_bucket{le=\"%zu\"} %" PRIu64 "\n", a, cum);
    }
    dsv4_buf_printf(b, "dsv4d_spec_accepted_drafts_bucket{le=\"+Inf\"} %" PRIu64 "\n"
                    "dsv4d_spec_accepted_drafts_sum %" PRIu64 "\n"
                    "dsv4d_spec_accepted_drafts_count %" PRIu64 "\n", cum, sum, cum);
}

/* A bucket bound as a label value: the shortest of 15 or 17 significant digits that reads back as v, so
 * distinct bounds never share a label. */
static void le_value(char *buf, size_t cap, double v)
{
    snprintf(buf, cap, "%.15g", v);
    if (strtod(buf, NULL) != v)
        snprintf(buf, cap, "%.17g", v);
}

/* One of dsv4d's latency histograms, cumulative as Prometheus counts buckets (dsv4d sends them per bucket);
 * none from a dsv4d older than them. */
static void latency_histogram(struct dsv4_buf *b, const struct dsv4_client_stats *st,
                              const struct dsv4_client_latency *h, const char *name, const char *help)
{
    if (h->n_buckets == 0)
        return;
    dsv4_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t i = 0; i < h->n_buckets; i++) {
        char le[32];
        cum += h->buckets[i];
        if (i < st->n_latency_bounds)
            le_value(le, sizeof(le), st->latency_bounds_s[i]);
        else
            snprintf(le, sizeof(le), "+Inf");
        dsv4_buf_printf(b, "%s_bucket{le=\"%s\"} %" PRIu64 "\n", name, le, cum);
    }
    dsv4_buf_printf(b, "%s_sum %.17g\n%s_count %" PRIu64 "\n", name, h->sum_s, name, cum);
}

/* Prometheus text exposition of dsv4d's stats and this front's own counters. */
void oai_run_metrics(struct dsv4_oai_job *j)
{
    struct dsv4_oai_server *s = j->srv;
    struct dsv4_client *c;
    struct dsv4_client_stats st;
    struct dsv4_client_health h;
    struct dsv4_buf b = {0};
    int rc = oai_dsv4d_open(s->cfg, QUICK_TIMEOUT_MS, &c);
    if (rc == 0)
        rc = dsv4_client_stats(c, &st);
    if (rc == 0)
        rc = dsv4_client_health(c, &h);
    bool draining = rc < 0 && refused_draining(c);
    if (draining)
        h.status = DSV4_CLIENT_HEALTH_DRAINING;
    metric(&b, "dsv4d_up", "gauge", "1 when dsv4d answered this scrape", rc == 0 || draining);
    if (rc == 0 || draining) {
        dsv4_buf_printf(&b, "# HELP dsv4d_health dsv4d's state (1 for the current one)\n# TYPE dsv4d_health gauge\n");
        /* every state, failed and unknown (one newer than this front) too: each series exists, one is 1 */
        for (int k = DSV4_CLIENT_HEALTH_READY; k <= DSV4_CLIENT_HEALTH_UNKNOWN; k++)
            dsv4_buf_printf(&b, "dsv4d_health{status=\"%s\"} %d\n", dsv4_client_health_name(k), (int)h.status == k);
    }
    if (rc == 0) {
        dsv4_buf_printf(&b, "# HELP dsv4d_info the backend and kernel variants in use\n# TYPE dsv4d_info gauge\n"
                        "dsv4d_info{backend=\"");
        label_value(&b, st.backend);
        dsv4_buf_puts(&b, "\"} 1\n");
        for (size_t k = 0; k < st.n_kernels; k++) {
            dsv4_buf_puts(&b, "dsv4d_info{kernel=\"");
            label_value(&b, st.kernels[k]);
            dsv4_buf_puts(&b, "\"} 1\n");
        }
        metric(&b, "dsv4d_uptime_seconds", "gauge", "time since dsv4d started", st.uptime_s);
        metric(&b, "dsv4d_slots", "gauge", "sequence slots", st.slots_total);
        metric(&b, "dsv4d_slots_busy", "gauge", "slots holding a sequence", st.slots_busy);
        metric(&b, "dsv4d_queue_depth", "gauge", "requests waiting for a slot", st.queue_depth);
        metric(&b, "dsv4d_connections", "gauge", "open connections to dsv4d", st.connections);
        metric(&b, "dsv4d_requests_total", "counter", "generate requests accepted", (double)st.requests_total);
        metric(&b, "dsv4d_requests_failed_total", "counter", "generate requests that failed", (double)st.requests_failed);
        metric(&b, "dsv4d_requests_cancelled_total", "counter", "generate requests cancelled",
               (double)st.requests_cancelled);
        metric(&b, "dsv4d_prompt_tokens_total", "counter", "prompt tokens accepted", (double)st.prompt_tokens_total);
        metric(&b, "dsv4d_generated_tokens_total", "counter", "tokens generated", (double)st.generated_tokens_total);
        metric(&b, "dsv4d_prefill_tokens_per_second", "gauge",
               "prompt tokens prefilled since start over the engine's busy seconds (not a recent rate)",
               st.prefill_tokens_per_s);
        stat_metric(&b, &st, "prefill_tokens_total", "dsv4d_prefill_tokens_total", "counter",
                    "prompt tokens run through the model (not those restored from the prefix cache)",
                    (double)st.prefill_tokens_total);
        stat_metric(&b, &st, "prefill_chunks_total", "dsv4d_prefill_chunks_total", "counter",
                    "prefill calls that ran them (tokens over chunks: the mean chunk)", (double)st.prefill_chunks_total);
        metric(&b, "dsv4d_decode_tokens_per_second", "gauge",
               "tokens generated since start over the engine's busy seconds (for a recent rate: "
               "rate(dsv4d_generated_tokens_total))", st.decode_tokens_per_s);
        metric(&b, "dsv4d_device_arena_bytes", "gauge",
               "memory reserved at boot for sequence caches, workspaces and the prefix-cache pool (weights not "
               "included; host memory on the cpu backend)", (double)st.device_arena_bytes);
        stat_metric(&b, &st, "device_arena_used", "dsv4d_device_arena_used_bytes", "gauge",
                    "of that, the bytes carved out at boot (all of it: it is carved whole then)",
                    (double)st.device_arena_used);
        metric(&b, "dsv4d_heap_allocated_bytes", "gauge", "heap bytes allocated", (double)st.heap_allocated);
        stat_metric(&b, &st, "heap_active", "dsv4d_heap_active_bytes", "gauge",
                    "heap bytes in active pages (jemalloc stats.active)", (double)st.heap_active);
        metric(&b, "dsv4d_heap_resident_bytes", "gauge", "heap bytes resident", (double)st.heap_resident);
        stat_metric(&b, &st, "heap_mapped", "dsv4d_heap_mapped_bytes", "gauge",
                    "heap bytes in mapped extents (jemalloc stats.mapped)", (double)st.heap_mapped);
        metric(&b, "dsv4d_device_allocs_after_boot", "gauge", "device allocations after boot (stays 0)",
               (double)st.device_allocs_after_boot);
        metric(&b, "dsv4d_graph_captures_after_boot", "gauge", "graph captures after boot (stays 0)",
               (double)st.graph_captures_after_boot);
        stat_metric(&b, &st, "sched_allocations_after_boot", "dsv4d_sched_allocations_after_boot", "gauge",
                    "scheduler heap allocations after boot (stays 0)", (double)st.sched_allocations_after_boot);
        stat_metric(&b, &st, "sched_allocations", "dsv4d_sched_allocations_total", "counter",
                    "heap allocations the scheduler made, boot included", (double)st.sched_allocations);
        stat_metric(&b, &st, "eager_steps", "dsv4d_eager_steps_total", "counter",
                    "steps launched kernel by kernel rather than as a graph captured at boot (long prefill chunks)",
                    (double)st.eager_steps);
        stat_metric(&b, &st, "prefix_cache_bytes", "dsv4d_prefix_cache_bytes", "gauge",
                    "the prefix-cache pool reserved at boot (0: off)", (double)st.prefix_cache_bytes);
        stat_metric(&b, &st, "prefix_cache_used_bytes", "dsv4d_prefix_cache_used_bytes", "gauge",
                    "of the prefix-cache pool, the bytes holding snapshots", (double)st.prefix_cache_used_bytes);
        stat_metric(&b, &st, "prefix_cache_tokens", "dsv4d_prefix_cache_tokens", "gauge",
                    "tokens whose compressed entries the prefix cache holds", (double)st.prefix_cache_tokens);
        stat_metric(&b, &st, "prefix_cache_snapshots", "dsv4d_prefix_cache_snapshots", "gauge",
                    "block boundaries in the prefix cache a request can continue from",
                    (double)st.prefix_cache_snapshots);
        stat_metric(&b, &st, "prefix_cache_lookups", "dsv4d_prefix_cache_lookups_total", "counter",
                    "generate requests that consulted the prefix cache", (double)st.prefix_cache_lookups);
        stat_metric(&b, &st, "prefix_cache_hits", "dsv4d_prefix_cache_hits_total", "counter",
                    "of those, requests that restored a prefix (misses: lookups - hits)", (double)st.prefix_cache_hits);
        stat_metric(&b, &st, "prefix_cache_hit_tokens", "dsv4d_prefix_cache_hit_tokens_total", "counter",
                    "prompt tokens restored from the prefix cache instead of prefilled",
                    (double)st.prefix_cache_hit_tokens);
        stat_metric(&b, &st, "prefix_cache_evictions", "dsv4d_prefix_cache_evictions_total", "counter",
                    "prefix-cache snapshots evicted to make room", (double)st.prefix_cache_evictions);
        stat_metric(&b, &st, "spec_tokens", "dsv4d_spec_tokens", "gauge",
                    "tokens the MTP block drafts per decode step (0: speculative decoding off)", st.spec_tokens);
        stat_metric(&b, &st, "spec_verifies", "dsv4d_spec_verifies_total", "counter",
                    "verifies of a request that had drafts", (double)st.spec_verifies);
        stat_metric(&b, &st, "spec_drafted", "dsv4d_spec_drafted_tokens_total", "counter",
                    "drafted tokens those verifies checked", (double)st.spec_drafted);
        stat_metric(&b, &st, "spec_accepted", "dsv4d_spec_accepted_tokens_total", "counter",
                    "drafted tokens accepted (the tokens speculation saved)", (double)st.spec_accepted);
        metric(&b, "dsv4d_steps_total", "counter", "engine steps that did work", (double)st.steps);
        metric(&b, "dsv4d_decode_steps_total", "counter", "steps that decoded", (double)st.decode_steps);
        metric(&b, "dsv4d_engine_busy_seconds_total", "counter", "time inside engine steps that did work",
               st.engine_busy_s);
        metric(&b, "dsv4d_engine_backend_seconds_total", "counter", "of that, inside backend calls",
               st.engine_backend_s);
        metric(&b, "dsv4d_engine_gap_seconds_total", "counter", "between a step that left requests running and the next",
               st.engine_gap_s);
        dsv4_buf_printf(&b, "# HELP dsv4d_decode_batch_size decode steps by batch size\n"
                        "# TYPE dsv4d_decode_batch_size histogram\n");
        uint64_t cum = 0;
        for (size_t k = 0; k < st.n_batch_hist; k++) {
            cum += st.batch_hist[k];
            if (k + 1 < st.n_batch_hist)
                dsv4_buf_printf(&b, "dsv4d_decode_batch_size_bucket{le=\"%llu\"} %" PRIu64 "\n", 1ull << k, cum);
        }
        dsv4_buf_printf(&b, "dsv4d_decode_batch_size_bucket{le=\"+Inf\"} %" PRIu64 "\n"
                        "dsv4d_decode_batch_size_count %" PRIu64 "\n", st.decode_steps, st.decode_steps);
        spec_histogram(&b, &st);
        latency_histogram(&b, &st, &st.ttft, "dsv4d_time_to_first_token_seconds",
                          "time from a request's submission to the engine to its first token");
        latency_histogram(&b, &st, &st.tpot, "dsv4d_time_per_output_token_seconds",
                          "a request's mean time per output token after the first (requests of two tokens or more)");
        latency_histogram(&b, &st, &st.queue, "dsv4d_request_queue_seconds",
                          "time from a request's submission to the engine to its admission into a slot");
        latency_histogram(&b, &st, &st.e2e, "dsv4d_request_e2e_seconds",
                          "time from a request's submission to the engine to its finish");
    }
    static const char *const route_names[] = {"chat_completions", "completions", "models", "models_retrieve", "health",
                                              "metrics"};
    pthread_mutex_lock(&s->lock);
    dsv4_buf_printf(&b, "# HELP dsv4_openai_requests_total HTTP requests by endpoint\n"
                    "# TYPE dsv4_openai_requests_total counter\n");
    for (int r = 0; r < DSV4_OAI_N_ROUTES; r++)
        dsv4_buf_printf(&b, "dsv4_openai_requests_total{endpoint=\"%s\"} %" PRIu64 "\n", route_names[r], s->requests[r]);
    dsv4_buf_printf(&b, "# HELP dsv4_openai_errors_total error responses by class\n"
                    "# TYPE dsv4_openai_errors_total counter\n"
                    "dsv4_openai_errors_total{class=\"4xx\"} %" PRIu64 "\n"
                    "dsv4_openai_errors_total{class=\"5xx\"} %" PRIu64 "\n", s->responses_4xx, s->responses_5xx);
    metric(&b, "dsv4_openai_generations", "gauge", "completions in flight", s->generations);
    metric(&b, "dsv4_openai_disconnects_total", "counter", "generations cancelled because the client left",
           (double)s->disconnects);
    pthread_mutex_unlock(&s->lock);
    dsv4_client_close(c);
    oai_respond(j, 200, dsv4_buf_steal(&b));
}
