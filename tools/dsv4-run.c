/* SPDX-License-Identifier: MIT */
/* dsv4-run: the engine without the daemon. Dispatches on --model (forward pass) or --tokenizer. */
#include "build-config.h"

#include <stdio.h>
#include <string.h>

#include "tools/run.h"

static void usage(FILE *f)
{
    fputs("usage: dsv4-run --model DIR --tokens 5,17,9 [--decode N] [--dump-logits FILE]\n"
          "                [--numerics exact|fp8] [--chunk K]\n"
          "       dsv4-run --tokenizer FILE --encode   (stdin: UTF-8 text; stdout: ids)\n"
          "       dsv4-run --tokenizer FILE --decode   (stdin: ids; stdout: text)\n", f);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model"))
            return dsv4_run_model(argc, argv);
        if (!strcmp(argv[i], "--tokenizer"))
            return dsv4_run_tokenizer(argc, argv);
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
    }
    usage(stderr);
    return 2;
}
