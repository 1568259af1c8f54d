/* SPDX-License-Identifier: MIT */
/* dsv4-sched-bench: step latency of the scheduler when a long prompt arrives while other sequences
 * decode. With the CPU backend on a model directory (default: the tiny fixture tiny_a), D decoders
 * run alone for a while, then a P-token prompt arrives; every step's wall time and every decoder's
 * gap between tokens are measured, before and during the long prefill.
 *
 *   dsv4-sched-bench [--model DIR] [--prompt P] [--decoders D] [--budget B] [--threads T]
 *
 * With --sampler V it instead times the sampler alone on rows of V Gaussian logits (standard
 * deviation 3, like a language model's spread) for a few parameter sets, in CPU time per row.
 */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/serve/philox.h"
#include "engine/serve/sampler.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"

#define BENCH_WARM_STEPS 20         /* decode-only steps before the long prompt arrives */
#define BENCH_DECODERS_MAX 64
#define BENCH_STEPS_MAX 100000

struct decoder {
    uint64_t id;
    uint64_t last_ns;
    double max_gap_s;               /* largest gap between two of its tokens during the prefill */
    int n;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The engine thread's own CPU time: step costs without the noise of a shared machine. */
static uint64_t thread_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int letter_bytes(void *ctx, int32_t id, char *buf, size_t cap)
{
    if (cap < 1)
        return -E2BIG;
    buf[0] = (char)('a' + id % 26);
    return 1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *what, double *t, int n)
{
    if (n == 0) {
        printf("%-34s no steps\n", what);
        return;
    }
    qsort(t, (size_t)n, sizeof(*t), cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += t[i];
    printf("%-34s steps %5d  mean %8.3f ms  p50 %8.3f ms  p99 %8.3f ms  max %8.3f ms\n", what, n,
           sum / n * 1e3, t[n / 2] * 1e3, t[(int)((double)(n - 1) * 0.99)] * 1e3, t[n - 1] * 1e3);
}

static void usage(void)
{
    fprintf(stderr, "usage: dsv4-sched-bench [--model DIR] [--prompt P] [--decoders D] [--budget B] "
                    "[--threads T]\n       dsv4-sched-bench --sampler VOCAB\n");
}

#define BENCH_SAMPLER_ROWS 200

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int bench_sampler(int vocab)
{
    struct dsv4_sampler *sm;
    if (dsv4_sampler_create(vocab, &sm) < 0) {
        fprintf(stderr, "dsv4-sched-bench: %s\n", dsv4_error_message());
        return 1;
    }
    float *row = malloc(sizeof(*row) * (size_t)vocab);
    uint32_t *counts = calloc((size_t)vocab, sizeof(*counts));
    uint8_t *seen = calloc(((size_t)vocab + 7) / 8, 1);
    if (!row || !counts || !seen) {
        fprintf(stderr, "dsv4-sched-bench: out of memory\n");
        free(row);
        free(counts);
        free(seen);
        dsv4_sampler_destroy(sm);
        return 1;
    }
    for (int v = 0; v < vocab; v++) {
        /* Box-Muller from two Philox uniforms */
        double u1 = 1.0 - dsv4_philox_uniform(1, (uint64_t)v, 1), u2 = dsv4_philox_uniform(1, (uint64_t)v, 2);
        row[v] = (float)(3.0 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    for (int i = 0; i < 64; i++) {
        int v = (int)((uint64_t)i * 2654435761u % (uint64_t)vocab);
        counts[v] = 1;
        seen[v / 8] |= (uint8_t)(1u << (v % 8));
    }
    struct dsv4_sampler_history hist = { counts, seen };
    static const char *const names[] = { "greedy", "defaults (T=1)", "T=0.7 top_p=0.95",
                                         "T=0.7 top_k=50 top_p=0.9", "penalties + top_p=0.9 + logprobs 5" };
    for (int c = 0; c < 5; c++) {
        struct dsv4_sampling p;
        dsv4_sampling_defaults(&p);
        switch (c) {
        case 0: p.temperature = 0.0f; break;
        case 1: break;
        case 2: p.temperature = 0.7f; p.top_p = 0.95f; break;
        case 3: p.temperature = 0.7f; p.top_k = 50; p.top_p = 0.9f; break;
        default:
            p.top_p = 0.9f;
            p.repetition_penalty = 1.1f;
            p.frequency_penalty = 0.2f;
            p.presence_penalty = 0.2f;
            p.logprobs = 5;
        }
        struct dsv4_sample smp;
        uint64_t t0 = cpu_ns();
        for (int i = 0; i < BENCH_SAMPLER_ROWS; i++)
            dsv4_sampler_sample(sm, &p, row, &hist, 7, (uint64_t)i, &smp);
        double ms = (double)(cpu_ns() - t0) * 1e-6 / BENCH_SAMPLER_ROWS;
        printf("sampler, vocab %d, %-36s %7.3f ms CPU per row\n", vocab, names[c], ms);
    }
    free(row);
    free(counts);
    free(seen);
    dsv4_sampler_destroy(sm);
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = "tests/fixtures/tiny_a";
    int prompt_len = 4096, n_dec = 8, budget = 256, threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) {
            usage();
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--prompt"))
            prompt_len = atoi(v);
        else if (!strcmp(a, "--decoders"))
            n_dec = atoi(v);
        else if (!strcmp(a, "--budget"))
            budget = atoi(v);
        else if (!strcmp(a, "--threads"))
            threads = atoi(v);
        else if (!strcmp(a, "--sampler"))
            return bench_sampler(atoi(v) > 1 ? atoi(v) : 129280);
        else {
            usage();
            return 2;
        }
    }
    if (prompt_len < 1 || n_dec < 1 || n_dec > BENCH_DECODERS_MAX || budget < 1) {
        fprintf(stderr, "dsv4-sched-bench: --prompt >= 1, --decoders in [1, %d], --budget >= 1\n",
                BENCH_DECODERS_MAX);
        return 2;
    }

    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    struct dsv4_sched *s = NULL;
    int32_t *prompt = NULL;
    double *warm = NULL, *during = NULL, *warm_cpu = NULL, *during_cpu = NULL;
    int rc = 1;
    if (dsv4_weights_load(model, &w) < 0) {
        fprintf(stderr, "dsv4-sched-bench: %s\n", dsv4_error_message());
        goto out;
    }
    int vocab = w->cfg.vocab_size;
    int max_context = prompt_len + 1;
    /* decoders must outlive the prefill: give them room for every step it can take */
    int dec_tokens = BENCH_WARM_STEPS + prompt_len / budget + 64;
    if (dec_tokens + 16 > max_context)
        max_context = dec_tokens + 16;
    struct dsv4_backend_opts bo = { .max_batch = n_dec + 1, .max_context = max_context,
                                    .numerics = DSV4_NUMERICS_EXACT, .threads = threads };
    if (dsv4_backend_cpu_create(w, &bo, &b) < 0) {
        fprintf(stderr, "dsv4-sched-bench: %s\n", dsv4_error_message());
        goto out;
    }
    struct dsv4_sched_limits lim = { .prefill_budget = budget, .detok = { letter_bytes, NULL } };
    if (dsv4_sched_create(b, NULL, &lim, &s) < 0) {
        fprintf(stderr, "dsv4-sched-bench: %s\n", dsv4_error_message());
        goto out;
    }
    prompt = malloc(sizeof(*prompt) * (size_t)prompt_len);
    warm = malloc(sizeof(*warm) * BENCH_STEPS_MAX);
    during = malloc(sizeof(*during) * BENCH_STEPS_MAX);
    warm_cpu = malloc(sizeof(*warm_cpu) * BENCH_STEPS_MAX);
    during_cpu = malloc(sizeof(*during_cpu) * BENCH_STEPS_MAX);
    if (!prompt || !warm || !during || !warm_cpu || !during_cpu) {
        fprintf(stderr, "dsv4-sched-bench: out of memory\n");
        goto out;
    }
    uint64_t st = 12345;
    for (int i = 0; i < prompt_len; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = i == 0 ? w->cfg.bos_id : 2 + (int32_t)((st >> 33) % (uint64_t)(vocab - 2));
    }

    struct decoder dec[BENCH_DECODERS_MAX];
    struct dsv4_sampling greedy;
    dsv4_sampling_defaults(&greedy);
    greedy.temperature = 0.0f;
    for (int d = 0; d < n_dec; d++) {
        memset(&dec[d], 0, sizeof(dec[d]));
        struct dsv4_sched_request rq = { .prompt = prompt + 1 + d, .n_prompt = 8, .max_tokens = dec_tokens,
                                         .sampling = greedy, .ignore_eos = true, .user = &dec[d] };
        if (dsv4_sched_submit(s, &rq, &dec[d].id) < 0) {
            fprintf(stderr, "dsv4-sched-bench: %s\n", dsv4_error_message());
            goto out;
        }
    }
    int n_warm = 0, n_during = 0;
    bool long_done = false, long_started = false;
    uint64_t long_submit = 0, long_first = 0, long_id = 0;
    int long_user;
    for (int step = 0; step < BENCH_STEPS_MAX && !long_done; step++) {
        if (step == BENCH_WARM_STEPS) {
            struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = prompt_len, .max_tokens = 1,
                                             .sampling = greedy, .user = &long_user };
            if (dsv4_sched_submit(s, &rq, &long_id) < 0) {
                fprintf(stderr, "dsv4-sched-bench: %s\n", dsv4_error_message());
                goto out;
            }
            long_submit = now_ns();
            long_started = true;
            for (int d = 0; d < n_dec; d++)
                dec[d].max_gap_s = 0;
        }
        uint64_t t0 = now_ns(), c0 = thread_ns();
        int r = dsv4_sched_step(s);
        uint64_t t1 = now_ns(), c1 = thread_ns();
        if (r < 0) {
            fprintf(stderr, "dsv4-sched-bench: step: %d\n", r);
            goto out;
        }
        if (step >= 2 && !long_started) {
            warm_cpu[n_warm] = (double)(c1 - c0) * 1e-9;
            warm[n_warm++] = (double)(t1 - t0) * 1e-9;
        } else if (long_started) {
            during_cpu[n_during] = (double)(c1 - c0) * 1e-9;
            during[n_during++] = (double)(t1 - t0) * 1e-9;
        }
        struct dsv4_sched_event ev;
        while (dsv4_sched_next_event(s, &ev) == 1) {
            if (ev.user == &long_user) {
                if (ev.type == DSV4_SCHED_EVENT_TOKEN)
                    long_first = t1;
                else {
                    long_done = true;
                    dsv4_sched_release(s, ev.id);
                }
                continue;
            }
            struct decoder *d = ev.user;
            if (ev.type == DSV4_SCHED_EVENT_FINISH) {
                fprintf(stderr, "dsv4-sched-bench: a decoder finished early (%s)\n",
                        dsv4_finish_reason_name(ev.result->finish));
                dsv4_sched_release(s, ev.id);
                goto out;
            }
            if (d->n > 0 && long_started) {
                double gap = (double)(t1 - d->last_ns) * 1e-9;
                if (gap > d->max_gap_s)
                    d->max_gap_s = gap;
            }
            d->last_ns = t1;
            d->n++;
        }
    }
    printf("model %s, %d decoders, %d-token prompt, prefill budget %d tokens/step, %d thread(s)\n", model,
           n_dec, prompt_len, budget, threads);
    report("decode only, wall:", warm, n_warm);
    report("decode only, engine CPU:", warm_cpu, n_warm);
    report("during the prefill, wall:", during, n_during);
    report("during the prefill, engine CPU:", during_cpu, n_during);
    double worst_gap = 0;
    for (int d = 0; d < n_dec; d++)
        if (dec[d].max_gap_s > worst_gap)
            worst_gap = dec[d].max_gap_s;
    printf("largest gap between two tokens of a decoder during the prefill: %.3f ms\n", worst_gap * 1e3);
    printf("long prompt: first token %.1f ms after submit\n", (double)(long_first - long_submit) * 1e-6);
    rc = 0;
out:
    free(prompt);
    free(warm);
    free(during);
    free(warm_cpu);
    free(during_cpu);
    dsv4_sched_destroy(s);
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    return rc;
}
