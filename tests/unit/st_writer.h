/* SPDX-License-Identifier: MIT */
/* Test helper: write small safetensors files and model directories in a temporary directory,
 * well-formed or deliberately broken. Header-only so each test program includes what it needs. */
#ifndef DSV4_TESTS_ST_WRITER_H
#define DSV4_TESTS_ST_WRITER_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct stw_tensor {
    const char *name;
    const char *dtype;          /* safetensors spelling: "F32", "F8_E4M3", ... */
    int ndim;
    int64_t shape[4];
    const void *data;
    size_t nbytes;
};

/* A fresh empty directory under TMPDIR (or /tmp); the caller frees the string. */
static inline char *stw_tempdir(void)
{
    const char *base = getenv("TMPDIR");
    char *path = malloc(4096);

    if (!path)
        return NULL;
    snprintf(path, 4096, "%s/dsv4-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(path)) {
        free(path);
        return NULL;
    }
    return path;
}

/* Remove every file in dir (flat) and dir itself. */
static inline void stw_rmdir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    char p[4352];

    if (!d)
        return;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
            snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
}

static inline int stw_write_text(const char *dir, const char *name, const char *text)
{
    char p[4352];
    FILE *f;

    snprintf(p, sizeof(p), "%s/%s", dir, name);
    f = fopen(p, "wb");
    if (!f)
        return -1;
    fputs(text, f);
    return fclose(f);
}

/* Raw file: 8-byte little-endian header length `hlen` (may lie), header text, data bytes. */
static inline int stw_write_raw(const char *dir, const char *name, uint64_t hlen, const char *header,
                                const void *data, size_t nbytes)
{
    char p[4352];
    uint8_t len[8];
    FILE *f;

    snprintf(p, sizeof(p), "%s/%s", dir, name);
    f = fopen(p, "wb");
    if (!f)
        return -1;
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)(hlen >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(header, 1, strlen(header), f);
    if (nbytes)
        fwrite(data, 1, nbytes, f);
    return fclose(f);
}

/* A well-formed file holding ts[0..n), packed in order; the header is padded with spaces to a
 * multiple of 8 as the reference writer does. */
static inline int stw_write(const char *dir, const char *name, const struct stw_tensor *ts, size_t n)
{
    size_t cap = 256 + n * 256, len = 0, off = 0, total = 0;
    char *h = malloc(cap);
    uint8_t *data;
    int r;

    if (!h)
        return -1;
    len += (size_t)snprintf(h + len, cap - len, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", ts[i].name, ts[i].dtype);
        for (int d = 0; d < ts[i].ndim; d++)
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", d ? "," : "", (long long)ts[i].shape[d]);
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%zu,%zu]}", off, off + ts[i].nbytes);
        off += ts[i].nbytes;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    while (len % 8)
        h[len++] = ' ';
    h[len] = '\0';
    total = off;
    data = malloc(total ? total : 1);
    if (!data) {
        free(h);
        return -1;
    }
    off = 0;
    for (size_t i = 0; i < n; i++) {
        if (ts[i].nbytes)
            memcpy(data + off, ts[i].data, ts[i].nbytes);
        off += ts[i].nbytes;
    }
    r = stw_write_raw(dir, name, len, h, data, total);
    free(h);
    free(data);
    return r;
}

/* xorshift64*: fresh, reproducible test data without libc rand(). */
static inline uint64_t stw_rand(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

/* Uniform in [-1, 1). */
static inline float stw_uniform(uint64_t *s)
{
    return (float)((double)(stw_rand(s) >> 11) * 0x1p-52 - 1.0);
}

#endif
