/* SPDX-License-Identifier: MIT */
/* dsv4ctl bench (client/ctl_bench.h): worker threads over libdsv4client, one connection each. */
#include "build-config.h"

#include "client/ctl_bench.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PROGRESS_PERIOD_MS 250
#define MIN_REQUESTS 8
#define REQUESTS_PER_CLIENT 4
/* Prompt keys: a level's request i is keyed by (level, i), its admitted prompt by (level,
 * ADMIT_KEY), the shared prefix by SHARED_KEY alone; requests stay below 2^20 (the limit). */
#define ADMIT_KEY (1ull << 32)
#define SHARED_KEY (1ull << 33)

/* One request's measurements. */
struct sample {
    double ttft_ms;             /* send to first token, queueing included (what a user waits) */
    double tpot_ms;             /* (last token - first token) / (tokens - 1); NAN below 2 tokens */
    uint32_t tokens;
    uint32_t cached;            /* prompt tokens the server restored from its prefix cache */
    bool ok;                    /* finished by stop or length */
};

struct level {
    const struct ctl_bench_opts *o;
    int index;                  /* in o->levels */
    int concurrency;
    int32_t lo, hi;             /* prompt ids are drawn from [lo, hi) */
    uint32_t total;
    struct sample *samples;     /* [total] */
    atomic_uint next;           /* next request index to take */
    atomic_uint done;
    atomic_uint failed;
    atomic_ullong tokens;       /* every streamed token, failed requests' too: the progress line's */
    char first_error[256];      /* the first failure's message, for the report */
    pthread_mutex_t lock;
    atomic_uint streaming;      /* requests that have their first token */
    /* admit_tokens: under lock, the admission's send time and first token (0: not yet), and the
     * streams' token gaps that overlap it */
    double admit_t0, admit_t1, admit_ttft_ms;
    double *gaps;               /* [CTL_BENCH_MAX_GAPS] */
    uint32_t n_gaps;
    char admit_error[256];
};

struct stream_state {
    struct level *lv;
    double t0, first, last;
    uint32_t n;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* splitmix64: the run's seed, the level and the request index key a prompt (random_prompt) */
static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void set_err(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

static void note_failure(struct level *lv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void note_failure(struct level *lv, const char *fmt, ...)
{
    atomic_fetch_add(&lv->failed, 1);
    pthread_mutex_lock(&lv->lock);
    if (!lv->first_error[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(lv->first_error, sizeof(lv->first_error), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&lv->lock);
}

/* prompt[n]: ids from the level's [lo, hi), a function of the run's seed and what (a request
 * index, ADMIT_KEY, SHARED_KEY) alone. No two levels or runs share a prompt unless asked to
 * (shared_prefix): a server with a prefix cache would otherwise restore the later ones. */
static void random_prompt(const struct level *lv, uint64_t what, int32_t *prompt, uint32_t n)
{
    uint64_t key = mix64(lv->o->seed ^ mix64(what == SHARED_KEY ? what : what ^ (uint64_t)lv->index << 40));
    for (uint32_t k = 0; k < n; k++) {
        key = mix64(key);
        prompt[k] = lv->lo + (int32_t)(key % (uint64_t)(lv->hi - lv->lo));
    }
}

static int on_token(const struct dsv4_client_token *tok, void *user)
{
    struct stream_state *st = user;
    struct level *lv = st->lv;
    const double t = now_ms();
    (void)tok;
    if (lv->gaps && st->n > 0) {    /* a gap that overlaps the admission's prefill */
        pthread_mutex_lock(&lv->lock);
        if (lv->admit_t0 > 0 && t > lv->admit_t0 && (lv->admit_t1 == 0 || st->last < lv->admit_t1) &&
            lv->n_gaps < CTL_BENCH_MAX_GAPS)
            lv->gaps[lv->n_gaps++] = t - st->last;
        pthread_mutex_unlock(&lv->lock);
    }
    if (st->n++ == 0) {
        st->first = t;
        atomic_fetch_add(&lv->streaming, 1);
    }
    st->last = t;
    atomic_fetch_add(&lv->tokens, 1);
    return 0;
}

static int connect_client(struct dsv4_client *c, const struct ctl_bench_opts *o)
{
    int rc = dsv4_client_connect(c, o->socket, o->connect_timeout_ms);
    if (rc == 0)
        dsv4_client_set_timeout(c, o->timeout_ms);
    return rc;
}

/* The server's engine counters (stats engine_*, steps), read before and after a level: their
 * difference over the level's steps says where a step's time went. No figure when a stats call
 * failed (ok false) or the server predates the counters (they stay 0 while steps grow). */
struct engine_mark {
    bool ok;
    uint64_t steps, decode_steps;
    double busy_s, backend_s, gap_s;
    bool prefill;               /* the server sends the prefill counters */
    uint64_t prefill_tokens, prefill_chunks;
};

static struct engine_mark engine_mark(const struct ctl_bench_opts *o)
{
    struct engine_mark m = { 0 };
    struct dsv4_client *c = dsv4_client_new();
    struct dsv4_client_stats *st = malloc(sizeof(*st));
    if (c && st && connect_client(c, o) == 0 && dsv4_client_stats(c, st) == 0)
        m = (struct engine_mark){ true, st->steps, st->decode_steps, st->engine_busy_s, st->engine_backend_s,
                                  st->engine_gap_s, dsv4_client_stats_has(st, "prefill_chunks_total"),
                                  st->prefill_tokens_total, st->prefill_chunks_total };
    free(st);
    dsv4_client_close(c);
    return m;
}

static void *worker(void *arg)
{
    struct level *lv = arg;
    const struct ctl_bench_opts *o = lv->o;
    struct dsv4_client *c = dsv4_client_new();
    int32_t *prompt = malloc(sizeof(int32_t) * o->prompt_tokens);
    bool connected = false;

    for (;;) {
        const unsigned i = atomic_fetch_add(&lv->next, 1);
        if (i >= lv->total)
            break;
        struct sample *sm = &lv->samples[i];
        sm->tpot_ms = NAN;
        if (!c || !prompt) {
            note_failure(lv, "out of memory");
            atomic_fetch_add(&lv->done, 1);
            continue;
        }
        if (!connected) {
            if (connect_client(c, o) < 0) {
                note_failure(lv, "connect: %s", dsv4_client_error_message(c));
                atomic_fetch_add(&lv->done, 1);
                continue;
            }
            connected = true;
        }
        random_prompt(lv, SHARED_KEY, prompt, o->shared_prefix);
        random_prompt(lv, i, prompt + o->shared_prefix, o->prompt_tokens - o->shared_prefix);
        struct dsv4_client_generate_params p = o->gp;
        p.tokens = prompt;
        p.n_tokens = o->prompt_tokens;
        if (!p.has_seed) {
            p.has_seed = true;
            p.seed = mix64(o->seed + i);
        }
        struct stream_state st = { .lv = lv, .t0 = now_ms() };
        struct dsv4_client_result res;
        const int rc = dsv4_client_generate_stream(c, &p, on_token, &st, &res);
        if (rc < 0) {
            note_failure(lv, "request %u: %s", i, dsv4_client_error_message(c));
            if (rc != -EREMOTEIO && rc != -EINVAL)
                connected = false;      /* the library closed the connection */
        } else {
            sm->ok = res.finish_reason == DSV4_CLIENT_FINISH_STOP || res.finish_reason == DSV4_CLIENT_FINISH_LENGTH;
            if (!sm->ok)
                note_failure(lv, "request %u: finished %s%s%s", i, dsv4_client_finish_name(res.finish_reason),
                             res.error_message ? ": " : "", res.error_message ? res.error_message : "");
            sm->tokens = st.n;
            sm->cached = res.cached_tokens;
            sm->ttft_ms = st.n ? st.first - st.t0 : NAN;
            if (st.n > 1)
                sm->tpot_ms = (st.last - st.first) / (st.n - 1);
            dsv4_client_result_clear(&res);
        }
        atomic_fetch_add(&lv->done, 1);
    }
    free(prompt);
    dsv4_client_close(c);
    return NULL;
}

static int on_admit_token(const struct dsv4_client_token *tok, void *user)
{
    struct level *lv = user;
    const double t = now_ms();
    (void)tok;
    pthread_mutex_lock(&lv->lock);
    if (lv->admit_t1 == 0) {
        lv->admit_t1 = t;
        lv->admit_ttft_ms = t - lv->admit_t0;
    }
    pthread_mutex_unlock(&lv->lock);
    return 0;
}

/* admit_tokens: wait until every stream of the level (or every request, when fewer) has its first
 * token, then send the long prompt on a connection of its own. */
static void *admit_worker(void *arg)
{
    struct level *lv = arg;
    const struct ctl_bench_opts *o = lv->o;
    const unsigned want = (unsigned)lv->concurrency < lv->total ? (unsigned)lv->concurrency : lv->total;
    struct dsv4_client *c = dsv4_client_new();
    int32_t *prompt = malloc(sizeof(int32_t) * o->admit_tokens);
    struct dsv4_client_result res;

    while (atomic_load(&lv->streaming) < want && atomic_load(&lv->done) < lv->total)
        nanosleep(&(struct timespec){ 0, 1000000L }, NULL);
    if (!c || !prompt)
        snprintf(lv->admit_error, sizeof(lv->admit_error), "out of memory");
    else if (atomic_load(&lv->done) >= lv->total)
        snprintf(lv->admit_error, sizeof(lv->admit_error), "the level ended before its streams all decoded "
                 "(raise --max-tokens)");
    else if (connect_client(c, o) < 0)
        snprintf(lv->admit_error, sizeof(lv->admit_error), "connect: %s", dsv4_client_error_message(c));
    else {
        random_prompt(lv, ADMIT_KEY, prompt, o->admit_tokens);
        struct dsv4_client_generate_params p = o->gp;
        p.tokens = prompt;
        p.n_tokens = o->admit_tokens;
        p.max_tokens = 1;
        pthread_mutex_lock(&lv->lock);
        lv->admit_t0 = now_ms();
        pthread_mutex_unlock(&lv->lock);
        const int rc = dsv4_client_generate_stream(c, &p, on_admit_token, lv, &res);
        pthread_mutex_lock(&lv->lock);
        const bool got_token = lv->admit_t1 != 0;
        if (!got_token)
            lv->admit_t1 = now_ms();    /* no token came: close the window anyway */
        pthread_mutex_unlock(&lv->lock);
        /* Its time to first token is a figure only when it ended as a request should, with its token: a
         * failed one is left out as the level's failed requests are, and one without a token has none. */
        if (rc < 0) {
            snprintf(lv->admit_error, sizeof(lv->admit_error), "%s", dsv4_client_error_message(c));
        } else {
            if (res.finish_reason != DSV4_CLIENT_FINISH_STOP && res.finish_reason != DSV4_CLIENT_FINISH_LENGTH)
                snprintf(lv->admit_error, sizeof(lv->admit_error), "it finished %s%s%s",
                         dsv4_client_finish_name(res.finish_reason), res.error_message ? ": " : "",
                         res.error_message ? res.error_message : "");
            else if (!got_token)
                snprintf(lv->admit_error, sizeof(lv->admit_error), "it finished %s without a token",
                         dsv4_client_finish_name(res.finish_reason));
            dsv4_client_result_clear(&res);
        }
    }
    free(prompt);
    dsv4_client_close(c);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank quantile q of the n finite values in v (sorted in place); NAN when none. */
static double quantile(double *v, size_t n, double q)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(v[i]))
            v[m++] = v[i];
    if (m == 0)
        return NAN;
    qsort(v, m, sizeof(*v), cmp_double);
    size_t k = (size_t)ceil(q * (double)m);
    return v[k > 0 ? k - 1 : 0];
}

struct level_report {
    int concurrency;
    uint32_t requests, failed;
    uint64_t tokens;
    double cached_mean;         /* prompt tokens restored a finished request, NaN: none finished */
    double wall_s, ttft_med, ttft_p99, tpot_med, tpot_p99, out_tok_s, req_s;
    /* the server's engine over the level (its steps, those that decoded), ms a step (NaN: no figure):
     * in the backend (prefill included), the step's host work, and between steps while requests ran */
    double eng_backend_ms, eng_host_ms, eng_gap_ms;
    uint64_t eng_steps, eng_decode_steps;
    /* the prompt tokens the engine ran over the level and its prefill calls (NaN mean: no figure) */
    uint64_t eng_prefill_tokens, eng_prefill_chunks;
    double eng_prefill_mean;
    /* admit_tokens */
    double admit_ttft, gap_med, gap_p99, gap_max;
    uint32_t n_gaps;
    const char *admit_error;    /* NULL, or why there is no figure */
};

static void summarize(const struct level *lv, int concurrency, double wall_ms, const struct engine_mark *e0,
                      const struct engine_mark *e1, struct level_report *r)
{
    double *v = malloc(sizeof(double) * (lv->total ? lv->total : 1));
    memset(r, 0, sizeof(*r));
    r->eng_backend_ms = r->eng_host_ms = r->eng_gap_ms = r->eng_prefill_mean = NAN;
    if (e0->ok && e1->ok && e0->prefill && e1->prefill && e1->prefill_chunks > e0->prefill_chunks) {
        r->eng_prefill_tokens = e1->prefill_tokens - e0->prefill_tokens;
        r->eng_prefill_chunks = e1->prefill_chunks - e0->prefill_chunks;
        r->eng_prefill_mean = (double)r->eng_prefill_tokens / (double)r->eng_prefill_chunks;
    }
    if (e0->ok && e1->ok && e1->steps > e0->steps && e1->busy_s > e0->busy_s) {
        const double n = (double)(e1->steps - e0->steps);
        r->eng_steps = e1->steps - e0->steps;
        r->eng_decode_steps = e1->decode_steps - e0->decode_steps;
        r->eng_backend_ms = (e1->backend_s - e0->backend_s) * 1e3 / n;
        r->eng_host_ms = (e1->busy_s - e0->busy_s) * 1e3 / n - r->eng_backend_ms;
        r->eng_gap_ms = (e1->gap_s - e0->gap_s) * 1e3 / n;
    }
    r->concurrency = concurrency;
    r->requests = lv->total;
    r->failed = atomic_load(&lv->failed);
    /* the tokens of the requests that finished, as requests/s, TTFT and TPOT count them: what a failed
     * one streamed before it failed served no one (lv->tokens, which has them, is the progress line's) */
    uint64_t cached = 0;
    for (uint32_t i = 0; i < lv->total; i++)
        if (lv->samples[i].ok) {
            r->tokens += lv->samples[i].tokens;
            cached += lv->samples[i].cached;
        }
    r->cached_mean = r->requests > r->failed ? (double)cached / (r->requests - r->failed) : NAN;
    r->wall_s = wall_ms / 1e3;
    r->out_tok_s = r->wall_s > 0 ? (double)r->tokens / r->wall_s : 0.0;
    r->req_s = r->wall_s > 0 ? (double)(r->requests - r->failed) / r->wall_s : 0.0;
    r->ttft_med = r->ttft_p99 = r->tpot_med = r->tpot_p99 = NAN;
    if (!v)
        return;
    for (uint32_t i = 0; i < lv->total; i++)
        v[i] = lv->samples[i].ok ? lv->samples[i].ttft_ms : NAN;
    r->ttft_med = quantile(v, lv->total, 0.5);
    for (uint32_t i = 0; i < lv->total; i++)
        v[i] = lv->samples[i].ok ? lv->samples[i].ttft_ms : NAN;
    r->ttft_p99 = quantile(v, lv->total, 0.99);
    for (uint32_t i = 0; i < lv->total; i++)
        v[i] = lv->samples[i].ok ? lv->samples[i].tpot_ms : NAN;
    r->tpot_med = quantile(v, lv->total, 0.5);
    for (uint32_t i = 0; i < lv->total; i++)
        v[i] = lv->samples[i].ok ? lv->samples[i].tpot_ms : NAN;
    r->tpot_p99 = quantile(v, lv->total, 0.99);
    free(v);
    r->admit_ttft = r->gap_med = r->gap_p99 = r->gap_max = NAN;
    if (lv->gaps) {
        r->admit_error = lv->admit_error[0] ? lv->admit_error : NULL;
        r->admit_ttft = lv->admit_error[0] ? NAN : lv->admit_ttft_ms;
        r->n_gaps = lv->n_gaps;
        r->gap_max = quantile(lv->gaps, lv->n_gaps, 1.0);
        r->gap_p99 = quantile(lv->gaps, lv->n_gaps, 0.99);
        r->gap_med = quantile(lv->gaps, lv->n_gaps, 0.5);
    }
}

/* JSON has no NaN: a quantity with no sample is null. */
static json_t *num_or_null(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static void print_report(FILE *out, const struct ctl_bench_opts *o, const struct level_report *r)
{
    if (o->json) {
        json_t *j = json_pack("{s:i, s:I, s:I, s:I, s:I, s:I, s:f, s:o, s:o, s:o, s:o, s:f, s:f}",
                              "concurrency", r->concurrency, "requests", (json_int_t)r->requests, "failed",
                              (json_int_t)r->failed, "prompt_tokens", (json_int_t)o->prompt_tokens, "max_tokens",
                              (json_int_t)o->gp.max_tokens, "output_tokens", (json_int_t)r->tokens, "wall_s",
                              r->wall_s, "ttft_ms_median", num_or_null(r->ttft_med), "ttft_ms_p99",
                              num_or_null(r->ttft_p99), "tpot_ms_median", num_or_null(r->tpot_med), "tpot_ms_p99",
                              num_or_null(r->tpot_p99), "output_tokens_per_s", r->out_tok_s, "requests_per_s",
                              r->req_s);
        if (j)
            json_object_update_new(j, json_pack("{s:I, s:I, s:o, s:o, s:o}", "engine_steps", (json_int_t)r->eng_steps,
                                                "engine_decode_steps", (json_int_t)r->eng_decode_steps,
                                                "engine_backend_ms", num_or_null(r->eng_backend_ms), "engine_host_ms",
                                                num_or_null(r->eng_host_ms), "engine_gap_ms",
                                                num_or_null(r->eng_gap_ms)));
        if (j)
            json_object_update_new(j, json_pack("{s:I, s:I, s:o}", "engine_prefill_tokens",
                                                (json_int_t)r->eng_prefill_tokens, "engine_prefill_chunks",
                                                (json_int_t)r->eng_prefill_chunks, "engine_prefill_chunk_mean",
                                                num_or_null(r->eng_prefill_mean)));
        if (j)
            json_object_update_new(j, json_pack("{s:I, s:o}", "shared_prefix", (json_int_t)o->shared_prefix,
                                                "cached_tokens_mean", num_or_null(r->cached_mean)));
        if (j && o->admit_tokens)
            json_object_update_new(j, json_pack("{s:I, s:o, s:o, s:o, s:o, s:I}", "admit_tokens",
                                                (json_int_t)o->admit_tokens, "admit_ttft_ms",
                                                num_or_null(r->admit_ttft), "admit_gap_ms_median",
                                                num_or_null(r->gap_med), "admit_gap_ms_p99", num_or_null(r->gap_p99),
                                                "admit_gap_ms_max", num_or_null(r->gap_max), "admit_gaps",
                                                (json_int_t)r->n_gaps));
        if (j) {
            json_dumpf(j, out, JSON_COMPACT);
            fputc('\n', out);
            json_decref(j);
        }
        return;
    }
    fprintf(out, "%11d %8u %6u %9.1f %9.1f %9.2f %9.2f %10.1f %8.2f %7.1f\n", r->concurrency, r->requests, r->failed,
            r->ttft_med, r->ttft_p99, r->tpot_med, r->tpot_p99, r->out_tok_s, r->req_s, r->wall_s);
    if (isfinite(r->eng_backend_ms))
        fprintf(out, "# engine: %llu steps (%llu decoding); a step: %.3f ms in the backend (prefill included), "
                     "%.3f ms host work, %.3f ms until the next\n", (unsigned long long)r->eng_steps,
                (unsigned long long)r->eng_decode_steps, r->eng_backend_ms, r->eng_host_ms, r->eng_gap_ms);
    if (isfinite(r->eng_prefill_mean))
        fprintf(out, "# prefill: %llu prompt tokens in %llu calls, %.1f a call\n",
                (unsigned long long)r->eng_prefill_tokens, (unsigned long long)r->eng_prefill_chunks,
                r->eng_prefill_mean);
    if (o->shared_prefix && isfinite(r->cached_mean))
        fprintf(out, "# cached: %.1f of each prompt's %u tokens restored from the prefix cache (mean over the finished "
                     "requests; %u shared)\n", r->cached_mean, o->prompt_tokens, o->shared_prefix);
    else if (o->shared_prefix)
        fprintf(out, "# cached: no figure: no request finished (%u shared)\n", o->shared_prefix);
    if (o->admit_tokens && r->admit_error)
        fprintf(out, "# admit: no figure: %s\n", r->admit_error);
    else if (o->admit_tokens)
        fprintf(out, "# admit: a %u-token prompt beside %d streams: ttft %.1f ms; the streams' token gaps meanwhile: "
                     "median %.2f, p99 %.2f, max %.2f ms (%u gaps)\n",
                o->admit_tokens, r->concurrency, r->admit_ttft, r->gap_med, r->gap_p99, r->gap_max, r->n_gaps);
}

static void progress_line(FILE *f, int concurrency, const struct level *lv, double t0)
{
    const double s = (now_ms() - t0) / 1e3;
    const unsigned long long tok = atomic_load(&lv->tokens);
    fprintf(f, "\r[C=%d] %u/%u requests, %u failed, %llu tokens, %.0f tokens/s, %.1f s   ", concurrency,
            atomic_load(&lv->done), lv->total, atomic_load(&lv->failed), tok, s > 0 ? tok / s : 0.0, s);
    fflush(f);
}

static int run_level(const struct ctl_bench_opts *o, int index, int32_t lo, int32_t hi, FILE *out,
                     FILE *progress, bool *any_failed, char *err, size_t err_len)
{
    const int concurrency = o->levels[index];
    uint32_t total = o->requests ? o->requests : (uint32_t)concurrency * REQUESTS_PER_CLIENT;
    if (total < MIN_REQUESTS && !o->requests)
        total = MIN_REQUESTS;
    struct level lv = { .o = o, .index = index, .concurrency = concurrency, .lo = lo, .hi = hi, .total = total };
    pthread_t *th = calloc((size_t)concurrency, sizeof(*th)), admit;
    bool admitting = false;
    lv.samples = calloc(total, sizeof(*lv.samples));
    if (o->admit_tokens)
        lv.gaps = calloc(CTL_BENCH_MAX_GAPS, sizeof(*lv.gaps));
    if (!th || !lv.samples || (o->admit_tokens && !lv.gaps)) {
        free(th);
        free(lv.samples);
        free(lv.gaps);
        set_err(err, err_len, "bench: out of memory for %u requests", total);
        return -ENOMEM;
    }
    pthread_mutex_init(&lv.lock, NULL);
    const struct engine_mark e0 = engine_mark(o);
    const double t0 = now_ms();
    int started = 0, rc = 0;
    for (; started < concurrency; started++)
        if ((rc = pthread_create(&th[started], NULL, worker, &lv)) != 0)
            break;
    if (started > 0 && o->admit_tokens) {
        admitting = pthread_create(&admit, NULL, admit_worker, &lv) == 0;
        if (!admitting)
            snprintf(lv.admit_error, sizeof(lv.admit_error), "cannot start its thread");
    }
    if (started == 0) {
        set_err(err, err_len, "bench: cannot start a client thread: %s", strerror(rc));
        rc = -rc;
    } else {
        rc = 0;
        while (progress && atomic_load(&lv.done) < total) {
            progress_line(progress, concurrency, &lv, t0);
            nanosleep(&(struct timespec){ 0, PROGRESS_PERIOD_MS * 1000000L }, NULL);
        }
        for (int i = 0; i < started; i++)
            pthread_join(th[i], NULL);
        const double wall = now_ms() - t0;
        if (admitting)
            pthread_join(admit, NULL);
        if (progress) {
            progress_line(progress, concurrency, &lv, t0);
            fputc('\n', progress);
        }
        const struct engine_mark e1 = engine_mark(o);
        struct level_report r;
        summarize(&lv, concurrency, wall, &e0, &e1, &r);
        print_report(out, o, &r);
        fflush(out);
        if (r.failed) {
            *any_failed = true;
            fprintf(stderr, "dsv4ctl bench: C=%d: %u of %u requests failed; the first: %s\n", concurrency, r.failed,
                    total, lv.first_error);
        }
    }
    pthread_mutex_destroy(&lv.lock);
    free(th);
    free(lv.samples);
    free(lv.gaps);
    return rc;
}

int ctl_bench_run(const struct ctl_bench_opts *o, FILE *out, FILE *progress, char *err, size_t err_len)
{
    const struct dsv4_client_info *info;
    struct dsv4_client *c = dsv4_client_new();
    int rc;

    if (!c) {
        set_err(err, err_len, "bench: out of memory");
        return -ENOMEM;
    }
    if ((rc = connect_client(c, o)) < 0 || (rc = dsv4_client_hello(c, &info)) < 0) {
        set_err(err, err_len, "%s", dsv4_client_error_message(c));
        dsv4_client_close(c);
        return rc;
    }
    /* Prompt ids avoid the low ids (BOS, EOS, chat tags on the small models) and the top 1/16 of
     * the vocabulary, where the release keeps its special tokens and padding. */
    const int32_t V = (int32_t)info->vocab_size, lo = V >= 64 ? 16 : 1, hi = V - V / 16;
    /* 64-bit: --max-tokens goes up to 2^32 - 1, and a sum that wrapped would pass the check */
    const uint64_t need = (uint64_t)o->prompt_tokens + (o->gp.max_tokens ? o->gp.max_tokens : 1);
    if (hi <= lo) {
        set_err(err, err_len, "bench: the model's vocabulary (%d ids) is too small for random prompts", V);
        rc = -EINVAL;
    } else if (o->shared_prefix >= o->prompt_tokens) {
        set_err(err, err_len, "bench: --shared-prefix %u must be below --prompt-tokens %u (each prompt needs ids of "
                "its own)", o->shared_prefix, o->prompt_tokens);
        rc = -EINVAL;
    } else if (info->max_context && need > info->max_context) {
        set_err(err, err_len, "bench: --prompt-tokens %u plus --max-tokens %u exceed the server's context of %u tokens",
                o->prompt_tokens, o->gp.max_tokens, info->max_context);
        rc = -EINVAL;
    } else if (info->max_prompt_tokens && o->prompt_tokens > info->max_prompt_tokens) {
        set_err(err, err_len, "bench: --prompt-tokens %u exceeds the server's limit of %u", o->prompt_tokens,
                info->max_prompt_tokens);
        rc = -EINVAL;
    } else if (o->admit_tokens && ((info->max_context && o->admit_tokens + 1 > info->max_context) ||
                                   (info->max_prompt_tokens && o->admit_tokens > info->max_prompt_tokens))) {
        set_err(err, err_len, "bench: --admit-tokens %u leaves no room in the server's context of %u tokens "
                "(prompt limit %u)", o->admit_tokens, info->max_context, info->max_prompt_tokens);
        rc = -EINVAL;
    }
    if (rc < 0) {
        dsv4_client_close(c);
        return rc;
    }
    if (!o->json) {
        fprintf(out, "# %s, model %s, backend %s, max_batch %u: prompt %u random token ids (the first %u the same "
                     "in every prompt), max_tokens %u, temperature %g\n",
                info->server, info->model_name, info->backend, info->max_batch, o->prompt_tokens, o->shared_prefix,
                o->gp.max_tokens, (double)o->gp.temperature);
        fprintf(out, "# ttft: send to first token (queueing included); tpot: per request, (last - first token) / "
                     "(tokens - 1); median and p99 over requests\n");
        if (o->admit_tokens)
            fprintf(out, "# admit: once every stream of a level decodes, one %u-token prompt more (max_tokens 1); "
                         "its ttft, and the gaps between the streams' tokens that overlap its prefill\n",
                    o->admit_tokens);
        fprintf(out, "%11s %8s %6s %9s %9s %9s %9s %10s %8s %7s\n", "concurrency", "requests", "failed", "ttft_ms",
                "ttft_p99", "tpot_ms", "tpot_p99", "out_tok/s", "req/s", "wall_s");
        fflush(out);
    }
    dsv4_client_close(c);
    bool any_failed = false;
    for (int i = 0; i < o->n_levels; i++)
        if ((rc = run_level(o, i, lo, hi, out, progress, &any_failed, err, err_len)) < 0)
            return rc;
    if (any_failed) {
        set_err(err, err_len, "bench: some requests failed (counted above)");
        return -EREMOTEIO;
    }
    return 0;
}
