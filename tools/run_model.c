/* dsv4-run --model: placeholder until the module lands. */
#include "build-config.h"

#include <stdio.h>

#include "tools/run.h"

int dsv4_run_model(int argc, char **argv)
{
    fprintf(stderr, "dsv4-run: --model is not built yet\n");
    return 2;
}
