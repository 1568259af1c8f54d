/* SPDX-License-Identifier: MIT */
/* dsv4-run --model DIR --tokens 5,17,9 --decode N --dump-logits FILE [--numerics exact|fp8] [--chunk K]
 *
 * Prefills the tokens (in chunks of K when given) on the CPU reference backend, then decodes N greedy
 * steps, each fed the argmax of the previous row. Writes float32 little-endian logits, one row of
 * vocab_size per prompt position and then per decode step ((P+N) rows), and prints the greedy tokens
 * on stdout, space separated. Errors go to stderr with a non-zero exit. Checks outside the project
 * rely on this interface: keep it exactly. */
#include "build-config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/model/weights.h"
#include "tools/greedy.h"
#include "tools/run.h"

#define RUN_MAX_TOKENS (1 << 20)    /* prompt tokens plus decode steps */
#define RUN_MAX_THREADS 64

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "dsv4-run writes the host's float32 layout as little-endian"
#endif

struct run_args {
    const char *model, *tokens, *dump;
    long decode, chunk;
    enum dsv4_numerics numerics;
};

static int fail(const char *fmt, const char *what)
{
    fprintf(stderr, "dsv4-run: ");
    fprintf(stderr, fmt, what);
    fputc('\n', stderr);
    return 2;
}

static int parse_count(const char *flag, const char *s, long max, long *ret)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 0 || v > max) {
        fprintf(stderr, "dsv4-run: %s wants an integer in [0, %ld], got \"%s\"\n", flag, max, s);
        return -1;
    }
    *ret = v;
    return 0;
}

static int parse_args(int argc, char **argv, struct run_args *a)
{
    memset(a, 0, sizeof(*a));
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (i + 1 >= argc)
            return fail("%s needs a value", f);
        const char *v = argv[++i];
        if (!strcmp(f, "--model")) {
            a->model = v;
        } else if (!strcmp(f, "--tokens")) {
            a->tokens = v;
        } else if (!strcmp(f, "--dump-logits")) {
            a->dump = v;
        } else if (!strcmp(f, "--decode")) {
            if (parse_count(f, v, RUN_MAX_TOKENS, &a->decode) < 0)
                return 2;
        } else if (!strcmp(f, "--chunk")) {
            if (parse_count(f, v, RUN_MAX_TOKENS, &a->chunk) < 0 || a->chunk == 0)
                return fail("%s wants a positive chunk size", f);
        } else if (!strcmp(f, "--numerics")) {
            if (!strcmp(v, "exact"))
                a->numerics = DSV4_NUMERICS_EXACT;
            else if (!strcmp(v, "fp8"))
                a->numerics = DSV4_NUMERICS_FP8;
            else
                return fail("--numerics wants exact or fp8, got \"%s\"", v);
        } else {
            return fail("unknown option %s (see dsv4-run --help)", f);
        }
    }
    if (!a->model)
        return fail("%s", "--model DIR is required");
    if (!a->tokens)
        return fail("%s", "--tokens is required (comma-separated ids, e.g. 5,17,9)");
    return 0;
}

/* "5,17,9" -> ids; every id a decimal integer in [0, vocab). */
static int parse_tokens(const char *s, int vocab, int32_t *ids, int max, int *ret_n)
{
    int n = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v >= vocab) {
            fprintf(stderr, "dsv4-run: --tokens: \"%s\" is not a token id in [0, %d) at offset %td\n", s,
                    vocab, p - s);
            return -1;
        }
        if (n == max) {
            fprintf(stderr, "dsv4-run: --tokens: more than %d tokens\n", max);
            return -1;
        }
        ids[n++] = (int32_t)v;
        if (*end == '\0')
            break;
        if (*end != ',') {
            fprintf(stderr, "dsv4-run: --tokens: unexpected '%c' at offset %td\n", *end, end - s);
            return -1;
        }
        p = end + 1;
    }
    *ret_n = n;
    return 0;
}

int dsv4_run_model(int argc, char **argv)
{
    struct run_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc;

    struct dsv4_weights *w = NULL;
    if (dsv4_weights_load(a.model, &w) < 0) {
        fprintf(stderr, "dsv4-run: %s\n", dsv4_error_message());
        return 1;
    }
    int V = w->cfg.vocab_size;
    int32_t *ids = malloc(sizeof(int32_t) * RUN_MAX_TOKENS);
    int P = 0;
    int status = 1;
    float *logits = NULL;
    struct dsv4_backend *b = NULL;
    if (!ids) {
        fprintf(stderr, "dsv4-run: out of memory\n");
        goto done;
    }
    if (parse_tokens(a.tokens, V, ids, RUN_MAX_TOKENS, &P) < 0) {
        status = 2;
        goto done;
    }
    if (P + a.decode > RUN_MAX_TOKENS) {
        fprintf(stderr, "dsv4-run: %d prompt tokens + %ld decode steps exceed %d\n", P, a.decode, RUN_MAX_TOKENS);
        status = 2;
        goto done;
    }
    size_t rows = (size_t)P + (size_t)a.decode;
    logits = malloc(rows * (size_t)V * sizeof(float));
    if (!logits) {
        fprintf(stderr, "dsv4-run: out of memory for %zu rows of %d logits\n", rows, V);
        goto done;
    }
    /* Threads only split matrix rows: the logits are bitwise the same for any count. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cpus < 1 ? 1 : cpus > RUN_MAX_THREADS ? RUN_MAX_THREADS : (int)cpus;
    struct dsv4_backend_opts opts = {.max_batch = 1, .max_context = (int)rows, .numerics = a.numerics,
                                     .threads = threads};
    /* both counts are at most RUN_MAX_TOKENS (parse_count), well inside int */
    if (dsv4_backend_cpu_create(w, &opts, &b) < 0 ||
        dsv4_greedy_generate(b, 0, ids, P, (int)a.decode, (int)a.chunk, logits) != 0) {
        fprintf(stderr, "dsv4-run: %s\n", dsv4_error_message());
        goto done;
    }
    if (a.dump) {
        FILE *out = fopen(a.dump, "wb");
        bool ok = out && fwrite(logits, sizeof(float) * (size_t)V, rows, out) == rows;
        if (out && fclose(out) != 0)
            ok = false;
        if (!ok) {
            fprintf(stderr, "dsv4-run: writing %s: %s\n", a.dump, strerror(errno));
            goto done;
        }
    }
    for (long i = 0; i < a.decode; i++)
        printf("%s%d", i ? " " : "", ids[P + i]);
    printf("\n");
    status = fflush(stdout) == 0 ? 0 : 1;
done:
    dsv4_backend_destroy(b);
    free(logits);
    free(ids);
    dsv4_weights_free(w);
    return status;
}
