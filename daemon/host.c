/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/fault.h"
#include "daemon/host.h"
#include "daemon/log.h"
#include "engine/backend.h"
#include "engine/error.h"
#include "engine/model/weights.h"

/* threads = 0 takes the online CPUs, up to this many. */
#define DSV4_HOST_THREADS_MAX 64
/* The device the CUDA backend runs on with gpus = all (only listed GPUs split the routed experts,
 * doc/MULTIGPU.md). */
#define DSV4_HOST_CUDA_DEVICE 0

struct dsv4_host {
    const struct dsv4_settings *cfg;
    const struct dsv4_tokenizer *tok;
    pthread_t thread;
    int boot_fd;
    atomic_int phase;
    atomic_bool stop_requested;
    char error[DSV4_ERROR_MESSAGE_MAX];
    char backend_name[16];
    char backend_note[DSV4_ERROR_MESSAGE_MAX + 64];
    const char *numerics;
    int max_output_tokens;
    struct dsv4_weights *weights;
    struct dsv4_backend *backend;
    struct dsv4_sched *sched;
    uint64_t *expert_counts;    /* expert_placement's routing statistics [n_layers * n_experts], or NULL */
};

const char *dsv4_host_phase_text(enum dsv4_host_phase p)
{
    switch (p) {
    case DSV4_HOST_LOADING_WEIGHTS: return "loading weights";
    case DSV4_HOST_CREATING_BACKEND: return "creating the backend (caches, workspaces)";
    case DSV4_HOST_CREATING_SCHEDULER: return "creating the scheduler";
    case DSV4_HOST_RUNNING: return "running";
    case DSV4_HOST_FAILED: return "boot failed";
    case DSV4_HOST_STOPPED: return "stopped";
    }
    return "?";
}

static void set_phase(struct dsv4_host *h, enum dsv4_host_phase p)
{
    atomic_store(&h->phase, (int)p);
    if (p != DSV4_HOST_RUNNING && p != DSV4_HOST_FAILED && p != DSV4_HOST_STOPPED)
        dsv4_log_info("boot: %s", dsv4_host_phase_text(p));
}

/* --backend: cpu and cuda are what they say; auto takes the GPU when there is a usable one and says
 * so when there is not (with gpus = all: listed GPUs must be there). */
static int create_backend(struct dsv4_host *h, const struct dsv4_backend_opts *opts)
{
    const struct dsv4_settings *cfg = h->cfg;
    int r;

    if (cfg->backend == DSV4_BACKEND_CUDA || cfg->backend == DSV4_BACKEND_AUTO) {
#ifdef HAVE_CUDA
        r = dsv4_backend_cuda_create(h->weights, opts, &h->backend);
        if (r == 0) {
            snprintf(h->backend_name, sizeof(h->backend_name), "cuda");
            snprintf(h->backend_note, sizeof(h->backend_note), "%s",
                     cfg->backend == DSV4_BACKEND_AUTO ? "auto: CUDA device found" : "requested");
            return 0;
        }
        if (cfg->backend == DSV4_BACKEND_CUDA || r != -ENODEV)
            return dsv4_error_prefix(r, "CUDA backend: ");
        /* GPUs named in gpus are asked for: serving on the CPU instead would only hide a wrong list */
        if (opts->n_gpus > 0)
            return dsv4_error_prefix(r, "gpus lists devices, so backend = auto does not fall back to the CPU: ");
        /* The CUDA backend's -ENODEV message says "no usable GPU: why" itself. */
        snprintf(h->backend_note, sizeof(h->backend_note), "auto: %s; using the CPU backend", dsv4_error_message());
#else
        if (cfg->backend == DSV4_BACKEND_CUDA)
            return dsv4_error_set(-ENOTSUP, "backend = cuda, but this dsv4d was built without the CUDA backend "
                                  "(configure --with-cuda)");
        snprintf(h->backend_note, sizeof(h->backend_note),
                 "auto: no usable GPU (this build has no CUDA backend: configured without --with-cuda); "
                 "using the CPU backend");
#endif
        dsv4_log_warning("%s", h->backend_note);
    } else {
        snprintf(h->backend_note, sizeof(h->backend_note), "requested");
    }
    r = dsv4_backend_cpu_create(h->weights, opts, &h->backend);
    if (r < 0)
        return r;       /* the backend's message names it */
    snprintf(h->backend_name, sizeof(h->backend_name), "cpu");
    return 0;
}

/* What `gpus` got: one device, or the routed experts split across the listed ones (doc/MULTIGPU.md). */
static void log_gpus(const struct dsv4_host *h, const struct dsv4_backend_opts *opts)
{
    char list[DSV4_SETTINGS_GPUS_TEXT_MAX];

    dsv4_settings_gpus_text(opts->gpus, opts->n_gpus, list);
    if (strcmp(h->backend_name, "cuda") != 0) {
        if (opts->n_gpus > 0)
            dsv4_log_notice("gpus = %s: no effect on the %s backend", list, h->backend_name);
        return;
    }
    if (opts->n_gpus == 1)
        dsv4_log_info("gpus = %s: the CUDA backend runs on device %d", list, opts->gpus[0]);
    else if (opts->n_gpus == 0)
        dsv4_log_notice("gpus = all: the CUDA backend runs on device %d; list the GPUs (gpus = 0,1) to split the "
                        "routed experts across them", DSV4_HOST_CUDA_DEVICE);
    else
        dsv4_log_info("gpus = %s: the routed experts split across %d GPUs, the slots dealt out among them; no prefix "
                      "cache and no speculation across GPUs yet", list, opts->n_gpus);
}

/* Where routed experts live (expert_offload, expert_host_share, expert_placement) is the CUDA
 * backend's choice; another backend says these settings have no effect, as for gpus, rather than
 * ignoring them in silence. */
static void log_placement_unused(const struct dsv4_host *h)
{
    const struct dsv4_settings *cfg = h->cfg;

    if (strcmp(h->backend_name, "cuda") == 0)
        return;
    if (cfg->expert_offload != DSV4_EXPERT_OFFLOAD_AUTO)
        dsv4_log_notice("expert_offload = %s: no effect on the %s backend",
                        cfg->expert_offload == DSV4_EXPERT_OFFLOAD_ON ? "on" : "off", h->backend_name);
    if (cfg->expert_host_share > 0)
        dsv4_log_notice("expert_host_share = %d: no effect on the %s backend", cfg->expert_host_share,
                        h->backend_name);
    if (cfg->expert_placement[0])
        dsv4_log_notice("expert_placement %s: no effect on the %s backend", cfg->expert_placement, h->backend_name);
}

static int boot(struct dsv4_host *h)
{
    const struct dsv4_settings *cfg = h->cfg;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cfg->threads;
    if (threads == 0)
        threads = cpus < 1 ? 1 : cpus > DSV4_HOST_THREADS_MAX ? DSV4_HOST_THREADS_MAX : (int)cpus;
    struct dsv4_backend_opts opts = {
        .max_batch = cfg->max_batch,
        .max_context = cfg->max_context,
        .threads = threads,
        .prefix_pool_bytes = (int64_t)cfg->prefix_cache,
        .prefill_chunk = cfg->prefill_chunk ? cfg->prefill_chunk : DSV4_PREFILL_CHUNK_DEFAULT,
        .spec_tokens = cfg->spec_tokens,
    };
    struct dsv4_sched_limits limits = { 0 };
    int r;

    set_phase(h, DSV4_HOST_LOADING_WEIGHTS);
    r = dsv4_weights_load(cfg->model, &h->weights);
    if (r < 0)
        return dsv4_error_prefix(r, "model %s: ", cfg->model);
    dsv4_log_info("model %s: %d layers, dim %d, vocab %d, %.1f MiB of weights%s", h->weights->cfg.model_name,
                  h->weights->cfg.n_layers, h->weights->cfg.dim, h->weights->cfg.vocab_size,
                  (double)h->weights->bytes_total / (1 << 20),
                  h->weights->synthetic ? " (synthetic: random values generated at load, for measuring)" : "");

    switch (cfg->numerics) {
    case DSV4_NUMERICS_CHOICE_EXACT: opts.numerics = DSV4_NUMERICS_EXACT; break;
    case DSV4_NUMERICS_CHOICE_FP8: opts.numerics = DSV4_NUMERICS_FP8; break;
    default:
        /* A quantized release checkpoint was trained for the FP8 cache; BF16 test models for exact. */
        opts.numerics = h->weights->bytes_quantized ? DSV4_NUMERICS_FP8 : DSV4_NUMERICS_EXACT;
    }
    h->numerics = opts.numerics == DSV4_NUMERICS_FP8 ? "fp8" : "exact";
    opts.expert_offload = cfg->expert_offload;
    opts.expert_host_share = cfg->expert_host_share;
    opts.expert_counts = h->expert_counts;     /* read at the start (read_placement) */

    opts.n_gpus = cfg->n_gpus;
    memcpy(opts.gpus, cfg->gpus, sizeof(opts.gpus));

    set_phase(h, DSV4_HOST_CREATING_BACKEND);
    r = create_backend(h, &opts);
    if (r == 0)
        r = dsv4_fault_wrap_from_env(&h->backend);
    if (r < 0)
        return r;
    log_gpus(h, &opts);
    log_placement_unused(h);
    struct dsv4_backend_stats bs;
    h->backend->ops->get_stats(h->backend, &bs);
    dsv4_log_info("backend %s (%s), numerics %s, %d threads, %d slots x %d tokens, %.1f MiB reserved%s%s",
                  h->backend_name, h->backend_note, h->numerics, threads, cfg->max_batch, cfg->max_context,
                  (double)bs.bytes_reserved / (1 << 20), bs.variant[0] ? ", kernels: " : "", bs.variant);
    if (bs.experts_host > 0 || bs.embed_bytes_host > 0)    /* or only the embedding moved */
        dsv4_log_info("routed experts: %u on the GPU (%.2f GiB), %u in pinned host memory (%.2f GiB, and the "
                      "embedding's %.2f GiB), %s", bs.experts_gpu, bs.expert_bytes_gpu / 1073741824.0, bs.experts_host,
                      bs.expert_bytes_host / 1073741824.0, bs.embed_bytes_host / 1073741824.0,
                      cfg->expert_placement[0] ? "the most routed on the GPU (expert_placement)" : "spread evenly");
    for (int l0 = 0; bs.experts_host > 0 && l0 < bs.expert_layers; l0 += DSV4_PLACEMENT_LINE_LAYERS) {
        char line[160];
        const int n = bs.expert_layers - l0 < DSV4_PLACEMENT_LINE_LAYERS ? bs.expert_layers - l0
                                                                        : DSV4_PLACEMENT_LINE_LAYERS;
        dsv4_placement_layers_text(bs.experts_gpu_by_layer, bs.experts_host_by_layer, l0, n, line, sizeof(line));
        dsv4_log_info("routed experts gpu/host by layer:%s", line);
    }
    const struct dsv4_prefix_geom *pg = &h->backend->prefix;
    if (pg->n_pages > 0)
        dsv4_log_info("prefix cache: %.1f MiB in %d pages of %.1f KiB, blocks of %d tokens; a block's compressed "
                      "entries take %d page%s, the window and compressor state at its end %d",
                      (double)pg->n_pages * (double)pg->page_bytes / (1 << 20), pg->n_pages,
                      (double)pg->page_bytes / 1024, pg->block, pg->block_pages, pg->block_pages == 1 ? "" : "s",
                      pg->boundary_pages);
    else
        dsv4_log_info("prefix cache: off");

    set_phase(h, DSV4_HOST_CREATING_SCHEDULER);
    /* The scheduler holds every request from submit to release: queued, running, and the finished
     * ones whose results the io thread is still sending (dsv4_settings_validate keeps the sum within
     * DSV4_SCHED_REQUESTS_MAX). */
    limits.max_unreleased = cfg->max_batch;
    limits.max_requests = cfg->max_batch + cfg->max_queued + limits.max_unreleased;
    limits.max_output_tokens = cfg->max_context;
    limits.prefill_budget = opts.prefill_chunk;
    limits.decode_stall_ms = cfg->decode_stall_ms;
    limits.sampler_threads = threads;
    r = dsv4_sched_create(h->backend, h->tok, &limits, &h->sched);
    if (r < 0)
        return dsv4_error_prefix(r, "scheduler: ");
    h->max_output_tokens = limits.max_output_tokens;
    struct dsv4_sched_stats ss;
    dsv4_sched_get_stats(h->sched, &ss);
    if (ss.spec_tokens > 0)
        dsv4_log_info("speculative decoding: %d draft token%s per step from the MTP block", ss.spec_tokens,
                      ss.spec_tokens == 1 ? "" : "s");
    else if (cfg->spec_tokens == 0)
        dsv4_log_info("speculative decoding: off (spec_tokens 0)");
    else if (h->weights->n_mtp == 0)
        dsv4_log_notice("speculative decoding: off: the checkpoint has no MTP block (spec_tokens %d asked)",
                        cfg->spec_tokens);
    else if (cfg->n_gpus > 1 && strcmp(h->backend_name, "cuda") == 0)
        dsv4_log_notice("speculative decoding: off: not yet built for the routed experts split across GPUs "
                        "(gpus lists %d; spec_tokens %d asked)", cfg->n_gpus, cfg->spec_tokens);
    else
        dsv4_log_notice("speculative decoding: off: the %s backend cannot draft and verify (spec_tokens %d asked)",
                        h->backend_name, cfg->spec_tokens);
    return 0;
}

static void wake_io(struct dsv4_host *h)
{
    uint64_t one = 1;
    if (write(h->boot_fd, &one, sizeof(one)) < 0)
        dsv4_log_err("engine: waking the io thread: %m");
}

/* routing_stats: the backend's counts since boot, written when the step loop ends (engine thread). */
static void write_routing_stats(struct dsv4_host *h)
{
    const struct dsv4_config *c = &h->weights->cfg;
    const char *path = h->cfg->routing_stats;
    if (!path[0] || !h->backend->ops->routing_counts)
        return;
    uint64_t *counts = calloc((size_t)c->n_layers * (size_t)c->n_experts, sizeof(*counts)), tokens = 0;
    int r = counts ? h->backend->ops->routing_counts(h->backend, counts)
                   : dsv4_error_set(-ENOMEM, "counts of %d x %d experts", c->n_layers, c->n_experts);
    if (r == 0)
        r = dsv4_routing_stats_write(path, c->model_name, c->n_layers, c->n_experts, counts);
    if (r == 0) {
        for (int e = 0; e < c->n_experts; e++)
            tokens += counts[e];
        dsv4_log_info("routing statistics of %llu routed tokens written to %s",
                      (unsigned long long)(tokens / (uint64_t)c->n_experts_per_tok), path);
    } else {
        dsv4_log_err("routing_stats %s: %s", path, dsv4_error_message());
    }
    free(counts);
}

static void write_routing_stats_between(void *arg)
{
    write_routing_stats(arg);
}

int dsv4_host_dump_routing(struct dsv4_host *h)
{
    if (!h->cfg->routing_stats[0])
        return dsv4_error_set(-ENOENT, "no routing_stats file is configured (routing_stats = FILE)");
    if (dsv4_host_phase(h) != DSV4_HOST_RUNNING || !h->sched)
        return dsv4_error_set(-EAGAIN, "the engine is not running (%s)", dsv4_host_phase_text(dsv4_host_phase(h)));
    if (!h->backend->ops->routing_counts)
        return dsv4_error_set(-ENOTSUP, "the %s backend keeps no routing counts", h->backend_name);
    return dsv4_sched_run_between(h->sched, write_routing_stats_between, h);
}

static void *engine_thread(void *arg)
{
    struct dsv4_host *h = arg;
    int r = boot(h);

    if (r < 0) {
        snprintf(h->error, sizeof(h->error), "%s", dsv4_error_message());
        set_phase(h, DSV4_HOST_FAILED);
        wake_io(h);
        return NULL;
    }
    set_phase(h, DSV4_HOST_RUNNING);
    wake_io(h);
    if (atomic_load(&h->stop_requested))
        return NULL;
    r = dsv4_sched_run(h->sched);
    write_routing_stats(h);
    if (r < 0) {
        /* The io thread exits on this (systemd restarts the service): requests would hang otherwise. */
        snprintf(h->error, sizeof(h->error), "step loop failed: %s", dsv4_error_message());
        set_phase(h, DSV4_HOST_FAILED);
        wake_io(h);
    }
    return NULL;
}

/* expert_placement's routing statistics into h->expert_counts, against the model's shape: read before
 * the weights load, so that a file missing, unreadable or of another shape is a setting to fix
 * (-EINVAL: exit status 2) found at once, not after the load (exit 1, which systemd would retry). */
static int read_placement(struct dsv4_host *h, const struct dsv4_config *model)
{
    const char *path = h->cfg->expert_placement;
    char stats_model[sizeof(model->model_name)];
    h->expert_counts = calloc((size_t)model->n_layers * (size_t)model->n_experts, sizeof(*h->expert_counts));
    if (!h->expert_counts)
        return dsv4_error_set(-ENOMEM, "expert_placement: counts of %d x %d experts", model->n_layers,
                              model->n_experts);
    int r = dsv4_routing_stats_read_model(path, model->n_layers, model->n_experts, h->expert_counts, stats_model,
                                          sizeof(stats_model));
    if (r < 0) {
        dsv4_error_prefix(r, "expert_placement: ");
        return r == -ENOMEM ? r : -EINVAL;
    }
    if (strcmp(stats_model, model->model_name) != 0)
        dsv4_log_notice("expert_placement %s: routing statistics of model \"%s\", serving \"%s\"; used, as their "
                        "shapes agree", path, stats_model, model->model_name);
    return 0;
}

int dsv4_host_start(const struct dsv4_settings *cfg, const struct dsv4_config *model,
                    const struct dsv4_tokenizer *tok, struct dsv4_host **ret)
{
    struct dsv4_host *h = calloc(1, sizeof(*h));
    int r;

    if (!h)
        return dsv4_error_set(-ENOMEM, "engine host: out of memory");
    h->cfg = cfg;
    h->tok = tok;
    h->numerics = "";
    h->boot_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (h->boot_fd < 0) {
        r = -errno;
        free(h);
        return dsv4_error_set(r, "eventfd: %s", strerror(-r));
    }
    /* Written at stop or on SIGUSR1, maybe days from now: a path where it cannot be is refused at once,
     * as a bad setting (-EINVAL: exit status 2) when the path itself is at fault, since a directory that
     * is missing, is a file or is not writable, or a path that is a directory, stays so however often
     * systemd restarts dsv4d. */
    if (cfg->routing_stats[0] && (r = dsv4_routing_stats_check(cfg->routing_stats)) < 0) {
        close(h->boot_fd);
        free(h);
        dsv4_error_prefix(r, "routing_stats: ");
        return r == -ENOENT || r == -ENOTDIR || r == -EACCES || r == -EPERM || r == -EROFS || r == -ENAMETOOLONG ||
               r == -ELOOP || r == -EISDIR ? -EINVAL : r;
    }
    if (cfg->expert_placement[0] && (r = read_placement(h, model)) < 0) {
        close(h->boot_fd);
        free(h->expert_counts);
        free(h);
        return r;
    }
    atomic_store(&h->phase, DSV4_HOST_LOADING_WEIGHTS);
    r = pthread_create(&h->thread, NULL, engine_thread, h);
    if (r) {
        close(h->boot_fd);
        free(h);
        return dsv4_error_set(-r, "starting the engine thread: %s", strerror(r));
    }
    *ret = h;
    return 0;
}

int dsv4_host_boot_fd(const struct dsv4_host *h)
{
    return h->boot_fd;
}

enum dsv4_host_phase dsv4_host_phase(const struct dsv4_host *h)
{
    return (enum dsv4_host_phase)atomic_load(&((struct dsv4_host *)h)->phase);
}

const char *dsv4_host_boot_error(const struct dsv4_host *h)
{
    return h->error;
}

struct dsv4_sched *dsv4_host_sched(const struct dsv4_host *h)
{
    return h->sched;
}

const char *dsv4_host_backend_name(const struct dsv4_host *h)
{
    return h->backend_name;
}

const char *dsv4_host_backend_note(const struct dsv4_host *h)
{
    return h->backend_note;
}

int dsv4_host_max_output_tokens(const struct dsv4_host *h)
{
    return h->max_output_tokens;
}

bool dsv4_host_stop(struct dsv4_host *h)
{
    enum dsv4_host_phase p;

    /* Set before reading the phase: a thread that reaches RUNNING afterwards sees it and returns. */
    atomic_store(&h->stop_requested, true);
    p = dsv4_host_phase(h);
    if (p != DSV4_HOST_RUNNING && p != DSV4_HOST_FAILED && p != DSV4_HOST_STOPPED) {
        pthread_detach(h->thread);
        return false;
    }
    if (p == DSV4_HOST_RUNNING)
        dsv4_sched_stop(h->sched);
    if (p != DSV4_HOST_STOPPED)
        pthread_join(h->thread, NULL);
    atomic_store(&h->phase, DSV4_HOST_STOPPED);
    return true;
}

void dsv4_host_free(struct dsv4_host *h)
{
    if (!h)
        return;
    dsv4_sched_destroy(h->sched);
    dsv4_backend_destroy(h->backend);
    dsv4_weights_free(h->weights);
    free(h->expert_counts);
    close(h->boot_fd);
    free(h);
}
