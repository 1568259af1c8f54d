/* dsv4-run --tokenizer: placeholder until the module lands. */
#include "build-config.h"

#include <stdio.h>

#include "tools/run.h"

int dsv4_run_tokenizer(int argc, char **argv)
{
    fprintf(stderr, "dsv4-run: --tokenizer is not built yet\n");
    return 2;
}
