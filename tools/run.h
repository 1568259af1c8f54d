/* SPDX-License-Identifier: MIT */
/* dsv4-run's two modes, each in its own file. */
#ifndef DSV4_TOOLS_RUN_H
#define DSV4_TOOLS_RUN_H

/* dsv4-run --model DIR --tokens 5,17,9 --decode N --dump-logits FILE [--numerics exact|fp8] [--chunk K] */
int dsv4_run_model(int argc, char **argv);
/* dsv4-run --tokenizer FILE --encode|--decode */
int dsv4_run_tokenizer(int argc, char **argv);

#endif
