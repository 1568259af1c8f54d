/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "daemon/clock.h"
#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/server.h"
#include "engine/error.h"

static void set_reason(struct dsv4_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_reason(struct dsv4_server *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->reason, sizeof(s->reason), fmt, ap);
    va_end(ap);
}

/* A connection made while the server stops is told so, not left waiting in the backlog. */
#define DSV4_SERVER_STOPPING_MESSAGE "the server is shutting down; connect again once it has restarted"

static void server_exit(struct dsv4_server *s, int code)
{
    s->exit_code = code;
    s->state = DSV4_SERVER_EXITING;
    dsv4_conns_refuse_new(&s->conns, DSV4_PROTO_E_DRAINING, DSV4_SERVER_STOPPING_MESSAGE);
    sd_event_exit(s->event, code);
}

/* A CLOCK_MONOTONIC deadline usec from now, as sd-event timers take it. */
static uint64_t timer_in(uint64_t usec)
{
    return dsv4_now_ns() / 1000 + usec;
}

/* The connection sweep (frame_timeout, max_idle_per_uid): often enough that a stalled connection
 * goes within an eighth of the timeout past its deadline (and at least once a second), rarely enough
 * to cost nothing. */
static uint64_t sweep_period_usec(const struct dsv4_server *s)
{
    double p = s->cfg->frame_timeout > 0 ? s->cfg->frame_timeout / 8 : 1.0;
    return (uint64_t)((p > 1.0 ? 1.0 : p < 0.01 ? 0.01 : p) * 1e6);
}

static int on_sweep(sd_event_source *src, uint64_t usec, void *userdata)
{
    struct dsv4_server *s = userdata;
    dsv4_conns_sweep(&s->conns);
    sd_event_source_set_time(src, usec + sweep_period_usec(s));
    sd_event_source_set_enabled(src, SD_EVENT_ONESHOT);
    return 0;
}

/* ---- boot ---------------------------------------------------------------------------------------- */

static int on_extend(sd_event_source *src, uint64_t usec, void *userdata)
{
    struct dsv4_server *s = userdata;
    if (s->state != DSV4_SERVER_LOADING && s->state != DSV4_SERVER_WARMUP)
        return 0;
    /* A checkpoint load is one long call: as long as it runs, give it more time. */
    dsv4_notify_extend(DSV4_SERVER_EXTEND_USEC);
    if (s->state == DSV4_SERVER_LOADING)
        dsv4_notify_status("%s: %s (%.0f s)", s->reason, dsv4_host_phase_text(dsv4_host_phase(s->host)),
                           (double)(dsv4_now_ns() - s->start_ns) / 1e9);
    else
        dsv4_notify_status("%s (%.0f s)", s->reason, (double)(dsv4_now_ns() - s->start_ns) / 1e9);
    sd_event_source_set_time(src, usec + DSV4_SERVER_EXTEND_PERIOD_USEC);
    sd_event_source_set_enabled(src, SD_EVENT_ONESHOT);
    return 0;
}

/* The dispatcher's hook: the warm-up finished (ok or not): become READY or exit. */
static void on_warmup_done(void *userdata, bool ok, const char *what)
{
    struct dsv4_server *s = userdata;

    if (s->state != DSV4_SERVER_WARMUP)
        return;
    if (!ok) {
        dsv4_log_err("%s", what);
        dsv4_notify_status("failed: %s", what);
        server_exit(s, EXIT_FAILURE);
        return;
    }
    dsv4_log_info("%s", what);
    s->state = DSV4_SERVER_READY;
    s->ready_ns = dsv4_now_ns();
    set_reason(s, "serving %s on the %s backend (%s)", s->model.model_name, dsv4_host_backend_name(s->host),
               dsv4_host_backend_note(s->host));
    char status[DSV4_SERVER_REASON_MAX + 64];
    snprintf(status, sizeof(status), "ready in %.1f s: %s", (double)(s->ready_ns - s->start_ns) / 1e9, s->reason);
    dsv4_notify_ready(status);
    dsv4_dispatch_submit_pending(&s->dispatch);
}

static int on_drain_deadline(sd_event_source *src, uint64_t usec, void *userdata);
static void close_connections(struct dsv4_server *s, const char *reason);
static void check_drained(struct dsv4_server *s);

static int on_failed_linger(sd_event_source *src, uint64_t usec, void *userdata)
{
    struct dsv4_server *s = userdata;
    dsv4_log_info("engine failed: closing %d connections and exiting", s->conns.n);
    close_connections(s, "the engine failed");
    int r = sd_event_add_time(s->event, &s->drain_src, CLOCK_MONOTONIC, timer_in(DSV4_SERVER_FLUSH_USEC), 0,
                              on_drain_deadline, s);
    if (r < 0)
        dsv4_log_warning("exit deadline timer: %s", strerror(-r));
    check_drained(s);
    return 0;
}

/* The engine failed for good (a fatal backend error, a sticky GPU fault): refuse new work, let health
 * say why for DSV4_SERVER_FAILED_LINGER_USEC, then close the connections and exit 1. Once. */
static void engine_failed(struct dsv4_server *s, const char *why)
{
    int r;

    if (s->state == DSV4_SERVER_FAILED || s->state == DSV4_SERVER_EXITING)
        return;
    dsv4_log_err("%s; answering what is left, then exiting", why);
    set_reason(s, "%s", why);
    dsv4_notify_status("failed: %s", why);
    s->state = DSV4_SERVER_FAILED;
    s->exit_code = EXIT_FAILURE;
    dsv4_conns_stop_accepting(&s->conns);
    dsv4_dispatch_refuse_pending(&s->dispatch, DSV4_PROTO_E_INTERNAL, s->reason);
    r = sd_event_add_time(s->event, &s->linger_src, CLOCK_MONOTONIC, timer_in(DSV4_SERVER_FAILED_LINGER_USEC), 0,
                          on_failed_linger, s);
    if (r < 0) {
        dsv4_log_warning("linger timer: %s", strerror(-r));
        on_failed_linger(NULL, 0, s);
    }
}

static void on_engine_failed(void *userdata, const char *why)
{
    engine_failed(userdata, why);
}

static int on_boot(sd_event_source *src, int fd, uint32_t revents, void *userdata)
{
    struct dsv4_server *s = userdata;
    uint64_t n;
    int r;

    if (read(fd, &n, sizeof(n)) < 0 && errno == EAGAIN)
        return 0;
    if (s->sched) {
        /* Boot was done: the engine's step loop has failed since. */
        if (dsv4_host_phase(s->host) == DSV4_HOST_FAILED) {
            /* Usually known already from the requests' errors: their events go out first. */
            if (s->sched_src)
                dsv4_dispatch_engine_events(s->sched_src, dsv4_sched_event_fd(s->sched), EPOLLIN, &s->dispatch);
            engine_failed(s, dsv4_host_boot_error(s->host));
        }
        return 0;
    }
    if (dsv4_host_phase(s->host) != DSV4_HOST_RUNNING) {
        dsv4_log_err("boot failed: %s", dsv4_host_boot_error(s->host));
        dsv4_notify_status("failed: %s", dsv4_host_boot_error(s->host));
        server_exit(s, EXIT_FAILURE);
        return 0;
    }
    s->sched = dsv4_host_sched(s->host);
    dsv4_dispatch_engine_ready(&s->dispatch, s->sched);
    r = sd_event_add_io(s->event, &s->sched_src, dsv4_sched_event_fd(s->sched), EPOLLIN,
                        dsv4_dispatch_engine_events, &s->dispatch);
    if (r < 0) {
        dsv4_log_err("watching the engine's events: %s", strerror(-r));
        server_exit(s, EXIT_FAILURE);
        return 0;
    }
    if (s->state != DSV4_SERVER_LOADING)
        return 0;
    s->state = DSV4_SERVER_WARMUP;
    set_reason(s, "warm-up generation on the %s backend (%s)", dsv4_host_backend_name(s->host),
               dsv4_host_backend_note(s->host));
    dsv4_notify_status("%s", s->reason);
    dsv4_notify_extend(DSV4_SERVER_EXTEND_USEC);
    if (dsv4_dispatch_start_warmup(&s->dispatch) < 0) {
        dsv4_log_err("%s", dsv4_error_message());
        dsv4_notify_status("failed: %s", dsv4_error_message());
        server_exit(s, EXIT_FAILURE);
    }
    return 0;
}

/* ---- watchdog ------------------------------------------------------------------------------------ */

/* WATCHDOG=1 means "the engine makes progress": sent while booting (each boot step is bounded by the
 * start timeout instead), while idle, and while steps complete; withheld when work waits and no step
 * has completed since the last tick, so systemd restarts a wedged engine. */
static int on_watchdog(sd_event_source *src, uint64_t usec, void *userdata)
{
    struct dsv4_server *s = userdata;
    bool alive = true;

    if (s->sched && (s->state == DSV4_SERVER_READY || s->state == DSV4_SERVER_DRAINING)) {
        struct dsv4_sched_stats st;
        dsv4_sched_get_stats(s->sched, &st);
        bool busy = st.slots_in_use > 0 || st.queued > 0;
        alive = !busy || st.steps != s->watchdog_last_steps;
        if (!alive)
            dsv4_log_warning("engine: no step completed in %.1f s with %d slots busy and %d queued; "
                             "withholding the watchdog ping", (double)s->watchdog_usec / 3e6, st.slots_in_use,
                             st.queued);
        s->watchdog_last_steps = st.steps;
    }
    if (alive)
        dsv4_notify_watchdog();
    sd_event_source_set_time(src, usec + s->watchdog_usec / 3);
    sd_event_source_set_enabled(src, SD_EVENT_ONESHOT);
    return 0;
}

/* ---- stop ---------------------------------------------------------------------------------------- */

/* Each connection closes once its last response is written (or at the flush deadline); then exit. */
static void close_connections(struct dsv4_server *s, const char *reason)
{
    s->state = DSV4_SERVER_EXITING;
    for (struct dsv4_conn *c = s->conns.head, *next; c; c = next) {
        next = c->next;
        dsv4_conn_close_after_flush(c, reason);
    }
    dsv4_conns_stop_accepting(&s->conns);
}

/* After requests ended or a connection closed: ends the drain when nothing is left. */
static void check_drained(struct dsv4_server *s)
{
    if (s->state == DSV4_SERVER_DRAINING && s->dispatch.n_requests == 0) {
        dsv4_log_info("drained: every request has its answer; closing %d connections", s->conns.n);
        close_connections(s, "the server is stopping and every request on it was answered");
    }
    if (s->state == DSV4_SERVER_EXITING && s->conns.n == 0)
        sd_event_exit(s->event, s->exit_code);
}

static void on_requests_ended(void *userdata)
{
    check_drained(userdata);
}

/* The connection hooks: frames and closes go to the dispatcher. */
static void on_conn_frame(void *userdata, struct dsv4_conn *c, const uint8_t *payload, size_t len)
{
    struct dsv4_server *s = userdata;
    dsv4_dispatch_frame(&s->dispatch, c, payload, len);
}

static void on_conn_closed(void *userdata, struct dsv4_conn *c)
{
    struct dsv4_server *s = userdata;
    dsv4_dispatch_conn_gone(&s->dispatch, c);
    check_drained(s);
}

static int on_drain_deadline(sd_event_source *src, uint64_t usec, void *userdata)
{
    struct dsv4_server *s = userdata;
    dsv4_log_warning("drain: deadline passed with %d requests and %d connections left; exiting",
                     s->dispatch.n_requests, s->conns.n);
    server_exit(s, s->exit_code);
    return 0;
}

static int on_term(sd_event_source *src, const struct signalfd_siginfo *si, void *userdata)
{
    struct dsv4_server *s = userdata;
    const char *sig = si->ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT";
    int r;

    if (s->state == DSV4_SERVER_DRAINING || s->state == DSV4_SERVER_EXITING || s->state == DSV4_SERVER_FAILED) {
        dsv4_log_notice("%s %s: exiting now", sig, s->state == DSV4_SERVER_FAILED ? "after the engine failed" : "again");
        server_exit(s, s->exit_code);
        return 0;
    }
    if (s->state != DSV4_SERVER_READY) {
        dsv4_conns_stop_accepting(&s->conns);
        /* Nothing was promised yet: answer the held requests and go. */
        dsv4_notify_stopping("stopping during boot");
        dsv4_dispatch_refuse_pending(&s->dispatch, DSV4_PROTO_E_DRAINING, "the server stopped during boot");
        server_exit(s, EXIT_SUCCESS);
        return 0;
    }
    /* The scheduler's drain: queued requests end now (finish_reason cancelled, no tokens), running
     * ones get drain_grace. New connections are still accepted, to be told so (conn.c). */
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(s->sched, &st);
    s->state = DSV4_SERVER_DRAINING;
    dsv4_conns_refuse_new(&s->conns, DSV4_PROTO_E_DRAINING, DSV4_SERVER_STOPPING_MESSAGE);
    set_reason(s, "%s: finishing %d running requests within %.0f s; %d queued ones cancelled", sig,
               st.slots_in_use, s->cfg->drain_grace, st.queued);
    dsv4_notify_stopping(s->reason);   /* logs it too */
    dsv4_sched_drain(s->sched, s->cfg->drain_grace);
    r = sd_event_add_time(s->event, &s->drain_src, CLOCK_MONOTONIC,
                          timer_in((uint64_t)(s->cfg->drain_grace * 1e6) + DSV4_SERVER_FLUSH_USEC), 0,
                          on_drain_deadline, s);
    if (r < 0)
        dsv4_log_warning("drain deadline timer: %s", strerror(-r));
    check_drained(s);
    return 0;
}

static int on_hup(sd_event_source *src, const struct signalfd_siginfo *si, void *userdata)
{
    dsv4_log_notice("SIGHUP: settings are read at start only; restart dsv4d to apply changes");
    return 0;
}

/* SIGUSR1: the routing statistics written now, without a restart (expert placement calibration). */
static int on_usr1(sd_event_source *src, const struct signalfd_siginfo *si, void *userdata)
{
    struct dsv4_server *s = userdata;
    if (dsv4_host_dump_routing(s->host) < 0)
        dsv4_log_warning("SIGUSR1: routing statistics not written: %s", dsv4_error_message());
    else
        dsv4_log_notice("SIGUSR1: writing the routing statistics to %s", s->cfg->routing_stats);
    return 0;
}

/* ---- setup --------------------------------------------------------------------------------------- */

static int load_tokenizer(struct dsv4_server *s)
{
    struct dsv4_dispatch *d = &s->dispatch;
    char path[DSV4_SETTINGS_PATH_MAX + 32];
    int r;

    if (s->cfg->tokenizer[0])
        snprintf(path, sizeof(path), "%s", s->cfg->tokenizer);
    else
        snprintf(path, sizeof(path), "%s/tokenizer.json", s->cfg->model);
    r = dsv4_tokenizer_load(path, &d->tok);
    if (r < 0)
        return dsv4_error_prefix(r, "tokenizer: ");
    if (dsv4_tokenizer_vocab_size(d->tok) > (size_t)s->model.vocab_size)
        return dsv4_error_set(-EINVAL, "tokenizer %s has %zu ids but the model's vocab_size is %d", path,
                              dsv4_tokenizer_vocab_size(d->tok), s->model.vocab_size);
    d->vocab_size = (uint32_t)s->model.vocab_size;
    /* The most input text one token can stand for: its bytes, or an added token's literal content. */
    for (size_t id = 0; id < dsv4_tokenizer_vocab_size(d->tok); id++) {
        size_t len = 0;
        const char *content = dsv4_tokenizer_is_added(d->tok, (int32_t)id) ?
                              dsv4_tokenizer_token_string(d->tok, (int32_t)id) : NULL;
        if (dsv4_tokenizer_token_bytes(d->tok, (int32_t)id, &len) && len > d->max_token_bytes)
            d->max_token_bytes = len;
        if (content && strlen(content) > d->max_token_bytes)
            d->max_token_bytes = strlen(content);
    }
    d->has_chat = dsv4_chat_tags_lookup(d->tok, &d->tags) == 0;
    if (d->has_chat)
        d->bos_id = d->tags.bos;
    else if (s->model.bos_id >= 0 && s->model.bos_id < s->model.vocab_size)
        d->bos_id = s->model.bos_id;
    else
        d->bos_id = -1;
    dsv4_error_clear();
    dsv4_log_info("tokenizer %s: %zu ids (a token spans at most %zu bytes), chat format %s", path,
                  dsv4_tokenizer_vocab_size(d->tok), d->max_token_bytes,
                  d->has_chat ? "available" : "unavailable (no chat tags)");
    return 0;
}

static int open_listeners(struct dsv4_server *s)
{
    int r = dsv4_listen_activated(&s->listeners);
    if (r < 0)
        return r;
    if (s->cfg->listen[0]) {
        r = dsv4_listen_path(&s->listeners, s->cfg->listen);
        if (r < 0)
            return r;
    }
    if (s->listeners.n == 0)
        return dsv4_error_set(-EINVAL, "no socket to serve: start dsv4d through dsv4d.socket (socket activation) "
                              "or pass --listen PATH");
    for (int i = 0; i < s->listeners.n; i++) {
        r = dsv4_conns_listen(&s->conns, s->listeners.fds[i], s->listeners.names[i]);
        if (r < 0)
            return r;
        dsv4_log_info("listening on %s", s->listeners.names[i]);
    }
    return 0;
}

int dsv4_server_init(struct dsv4_server *s, const struct dsv4_settings *cfg)
{
    const struct dsv4_conn_hooks conn_hooks = { .frame = on_conn_frame, .closed = on_conn_closed, .userdata = s };
    struct dsv4_dispatch *d = &s->dispatch;
    sigset_t mask;
    int r;

    memset(s, 0, sizeof(*s));
    s->cfg = cfg;
    s->start_ns = dsv4_now_ns();
    s->state = DSV4_SERVER_LOADING;
    set_reason(s, "starting");
    d->cfg = cfg;
    d->model = &s->model;
    d->state = &s->state;
    d->reason = s->reason;
    d->start_ns = s->start_ns;
    d->conns = &s->conns;
    d->hooks = (struct dsv4_dispatch_hooks){ .warmup_done = on_warmup_done, .engine_failed = on_engine_failed,
                                             .requests_ended = on_requests_ended, .userdata = s };
    d->bos_id = -1;

    /* Signals arrive through the loop; threads started later inherit the blocked mask. */
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigaddset(&mask, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);

    r = sd_event_new(&s->event);
    if (r < 0)
        return dsv4_error_set(r, "sd_event_new: %s", strerror(-r));
    if ((r = sd_event_add_signal(s->event, NULL, SIGTERM, on_term, s)) < 0 ||
        (r = sd_event_add_signal(s->event, NULL, SIGINT, on_term, s)) < 0 ||
        (r = sd_event_add_signal(s->event, NULL, SIGHUP, on_hup, s)) < 0 ||
        (r = sd_event_add_signal(s->event, NULL, SIGUSR1, on_usr1, s)) < 0)
        return dsv4_error_set(r, "signal handlers: %s", strerror(-r));
    r = dsv4_conns_init(&s->conns, s->event, cfg, &conn_hooks);
    if (r < 0)
        return r;

    dsv4_notify_status("reading %s/config.json", cfg->model);
    r = dsv4_config_load(cfg->model, &s->model);
    if (r < 0)
        return dsv4_error_prefix(r, "model %s: ", cfg->model);
    r = load_tokenizer(s);
    if (r < 0)
        return r;
    dsv4_proto_limits_server(&d->proto_limits);
    d->proto_limits.max_frame = cfg->max_frame;

    r = dsv4_prompt_worker_start(&d->prompts);
    if (r < 0)
        return r;
    r = sd_event_add_io(s->event, &s->prompts_src, dsv4_prompt_worker_fd(d->prompts), EPOLLIN,
                        dsv4_dispatch_prompts_done, d);
    if (r < 0)
        return dsv4_error_set(r, "watching the prompt worker: %s", strerror(-r));

    r = open_listeners(s);
    if (r < 0)
        return r;

    r = dsv4_host_start(cfg, &s->model, d->tok, &s->host);
    if (r < 0)
        return r;
    d->host = s->host;
    r = sd_event_add_io(s->event, &s->boot_src, dsv4_host_boot_fd(s->host), EPOLLIN, on_boot, s);
    if (r < 0)
        return dsv4_error_set(r, "watching the engine's boot: %s", strerror(-r));
    set_reason(s, "loading %s (%s backend requested)", s->model.model_name, dsv4_settings_backend_name(cfg->backend));
    dsv4_notify_status("%s", s->reason);
    /* Each boot step starts with more time; the timer below adds more while a step lasts. */
    dsv4_notify_extend(DSV4_SERVER_EXTEND_USEC);
    r = sd_event_add_time(s->event, &s->extend_src, CLOCK_MONOTONIC, timer_in(DSV4_SERVER_EXTEND_PERIOD_USEC), 0,
                          on_extend, s);
    if (r < 0)
        return dsv4_error_set(r, "boot timer: %s", strerror(-r));

    if (cfg->frame_timeout > 0 || cfg->max_idle_per_uid > 0) {
        r = sd_event_add_time(s->event, &s->sweep_src, CLOCK_MONOTONIC, timer_in(sweep_period_usec(s)), 0,
                              on_sweep, s);
        if (r < 0)
            return dsv4_error_set(r, "connection sweep timer: %s", strerror(-r));
    }

    s->watchdog_usec = dsv4_notify_watchdog_usec();
    if (s->watchdog_usec) {
        r = sd_event_add_time(s->event, &s->watchdog_src, CLOCK_MONOTONIC, timer_in(s->watchdog_usec / 3), 0,
                              on_watchdog, s);
        if (r < 0)
            return dsv4_error_set(r, "watchdog timer: %s", strerror(-r));
        dsv4_log_info("watchdog: %.1f s, pinged while the engine makes progress", (double)s->watchdog_usec / 1e6);
    }
    return 0;
}

int dsv4_server_run(struct dsv4_server *s)
{
    int r = sd_event_loop(s->event);
    if (r < 0 && s->exit_code == 0) {
        dsv4_log_err("event loop: %s", strerror(-r));
        return EXIT_FAILURE;
    }
    return s->exit_code;
}

void dsv4_server_done(struct dsv4_server *s)
{
    struct dsv4_dispatch *d = &s->dispatch;
    bool joined = true;

    s->state = DSV4_SERVER_EXITING;
    if (s->host)
        joined = dsv4_host_stop(s->host);
    /* The engine thread is gone (or still loading and never saw a request): requests can go. */
    /* The prompt worker stops before the requests its jobs belong to are freed. */
    dsv4_prompt_worker_stop(d->prompts);
    dsv4_conns_done(&s->conns);
    while (d->prompts && dsv4_prompt_worker_take_done(d->prompts))
        ;
    dsv4_dispatch_free_all(d);
    s->prompts_src = sd_event_source_disable_unref(s->prompts_src);
    dsv4_prompt_worker_free(d->prompts);
    d->prompts = NULL;
    dsv4_listen_close(&s->listeners);
    s->boot_src = sd_event_source_disable_unref(s->boot_src);
    s->sched_src = sd_event_source_disable_unref(s->sched_src);
    s->watchdog_src = sd_event_source_disable_unref(s->watchdog_src);
    s->extend_src = sd_event_source_disable_unref(s->extend_src);
    s->drain_src = sd_event_source_disable_unref(s->drain_src);
    s->sweep_src = sd_event_source_disable_unref(s->sweep_src);
    s->linger_src = sd_event_source_disable_unref(s->linger_src);
    if (joined) {
        dsv4_host_free(s->host);
        dsv4_tokenizer_free(d->tok);
    }
    s->host = NULL;
    d->host = NULL;
    d->tok = NULL;
    s->event = sd_event_unref(s->event);
}
