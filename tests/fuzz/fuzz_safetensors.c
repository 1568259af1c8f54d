/* SPDX-License-Identifier: MIT */
/* libFuzzer target for the safetensors header parser (engine/model/safetensors.c). The input is the whole
 * file: written as model.safetensors into a private directory (under /dev/shm when it exists) and
 * opened with dsv4_st_open(), as the loader does. Every tensor of a file that opens must be found by
 * its name and hold the bytes its shape and dtype give, all readable. */
#include "build-config.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/model/safetensors.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64], file[96];

static void cleanup(void)
{
    unlink(file);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    snprintf(dir, sizeof(dir), "%s/fuzz-st-XXXXXX", access("/dev/shm", W_OK) ? "/tmp" : "/dev/shm");
    if (!mkdtemp(dir)) {
        perror("fuzz_safetensors: mkdtemp");
        exit(1);
    }
    snprintf(file, sizeof(file), "%s/model.safetensors", dir);
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_st *st;
    int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

    if (fd < 0 || write(fd, data, size) != (ssize_t)size)
        abort();
    close(fd);
    if (dsv4_st_open(dir, &st) < 0)
        return 0;
    /* Reading every byte of every tensor faults if one reaches past the mapping. */
    unsigned sum = 0;
    for (size_t i = 0; i < dsv4_st_count(st); i++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(st, i);
        size_t numel = 1;
        if (t->ndim < 0 || t->ndim > DSV4_ST_MAX_DIMS || dsv4_st_find(st, t->name) != t)
            abort();
        for (int d = 0; d < t->ndim; d++)
            numel *= (size_t)t->shape[d];
        if (t->nbytes != numel * dsv4_dtype_size(t->dtype) || t->nbytes > size)
            abort();
        for (size_t k = 0; k < t->nbytes; k++)
            sum += ((const uint8_t *)t->data)[k];
    }
    if (sum == 0xdeadbeef)
        fprintf(stderr, "%u\n", sum);  /* keeps the reads */
    dsv4_st_close(st);
    return 0;
}
