/* SPDX-License-Identifier: MIT */
/* Encoding throughput of the C tokenizer on one file, single thread, for comparison with
 * `tokenizers` (tests/tokenizer/bench.py runs both).
 * usage: bench_encode TOKENIZER_JSON FILE [REPEATS]
 * FILE is encoded whole; with NUL bytes in it, each NUL-separated record is encoded on its own.
 * Prints MB/s of the first (cold word cache) and the best of REPEATS runs, by thread CPU time. */
#include "build-config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/error.h"
#include "engine/text/tokenizer.h"

static double cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_encode TOKENIZER_JSON FILE [REPEATS]\n");
        return 2;
    }
    int repeats = argc > 3 ? atoi(argv[3]) : 3;
    struct dsv4_tokenizer *tok;
    double t0 = cpu_seconds();
    if (dsv4_tokenizer_load(argv[1], &tok)) {
        fprintf(stderr, "%s\n", dsv4_error_message());
        return 1;
    }
    double load = cpu_seconds() - t0;
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (!text || fread(text, 1, (size_t)len, f) != (size_t)len) {
        perror(argv[2]);
        return 1;
    }
    fclose(f);
    struct dsv4_tok_ids ids = {0};
    double first = 0, best = 1e30;
    size_t nids = 0;
    for (int rep = 0; rep < repeats; rep++) {
        ids.len = 0;
        double start = cpu_seconds();
        for (long at = 0; at <= len;) {
            const char *nul = memchr(text + at, '\0', (size_t)(len - at));
            long n = nul ? nul - (text + at) : len - at;
            if (dsv4_tokenizer_encode(tok, text + at, (size_t)n, 0, &ids)) {
                fprintf(stderr, "%s\n", dsv4_error_message());
                return 1;
            }
            at += n + 1;
        }
        double t = cpu_seconds() - start;
        if (!rep)
            first = t;
        if (t < best)
            best = t;
        nids = ids.len;
    }
    printf("dsv4 tokenizer: %ld bytes -> %zu ids; load %.3f s; encode first %.3f s (%.2f MB/s), best of %d "
           "%.3f s (%.2f MB/s)\n", len, nids, load, first, (double)len / first / 1e6, repeats, best,
           (double)len / best / 1e6);
    dsv4_tok_ids_free(&ids);
    free(text);
    dsv4_tokenizer_free(tok);
    return 0;
}
