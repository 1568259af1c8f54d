/* SPDX-License-Identifier: MIT */
/* The switch table (kernels/switches.h): plain C, so that CPU-only builds test it too. */
#include "kernels/switches.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/error.h"

enum sw_kind {
    SW_BOOL,        /* "0" or "1" */
    SW_STAGES,      /* "2" or "4" */
    SW_KB,          /* 0..DSV4_CUDA_PREFETCH_KB_MAX */
    SW_HEADS,       /* "0" (by batch), "16", "32" or "64" */
    SW_AHEAD,       /* "0" (off) .. DSV4_CUDA_FETCH_AHEAD_SWITCH_MAX */
};

struct sw_def {
    const char *name;
    enum sw_kind kind;
    size_t off;             /* of the field in struct dsv4_cuda_switches */
};

#define SW(name, kind, field) { name, kind, offsetof(struct dsv4_cuda_switches, field) }
static const struct sw_def table[] = {
    SW("DSV4_CUDA_GRAPHS", SW_BOOL, graphs),
    SW("DSV4_CUDA_GEMM", SW_BOOL, gemm),
    SW("DSV4_CUDA_GEMM_STAGES", SW_STAGES, gemm_stages),
    SW("DSV4_CUDA_GEMM_WGMMA", SW_BOOL, gemm_wgmma),
    SW("DSV4_CUDA_GEMM_WGMMA_DECODE", SW_BOOL, gemm_wgmma_decode),
    SW("DSV4_CUDA_GEMM_DIRECT", SW_BOOL, gemm_direct),
    SW("DSV4_CUDA_GEMM_PREFETCH_KB", SW_KB, gemm_prefetch_kb),
    SW("DSV4_CUDA_PDL", SW_BOOL, pdl),
    SW("DSV4_CUDA_SAMPLE", SW_BOOL, sample),
    SW("DSV4_CUDA_MOE_MMA", SW_BOOL, moe_mma),
    SW("DSV4_CUDA_BRANCHES", SW_BOOL, branches),
    SW("DSV4_CUDA_MOE_TILES", SW_BOOL, moe_tiles),
    SW("DSV4_CUDA_MOE_WGMMA", SW_BOOL, moe_wgmma),
    SW("DSV4_CUDA_ATT_HEADS", SW_HEADS, att_heads),
    SW("DSV4_CUDA_ATT_WHOLE", SW_BOOL, att_whole),
    SW("DSV4_CUDA_EXPERT_FETCH", SW_AHEAD, expert_fetch),
    SW("DSV4_CUDA_LOG", SW_BOOL, log),
};
#undef SW
#define N_SW ((int)(sizeof(table) / sizeof(table[0])))

static const struct dsv4_cuda_switches defaults = {
    .graphs = true, .gemm = true, .gemm_stages = 4, .gemm_wgmma = true, .gemm_wgmma_decode = true,
    .gemm_direct = true, .gemm_prefetch_kb = DSV4_CUDA_PREFETCH_KB_DEFAULT,
    .pdl = true, .sample = true, .moe_mma = true, .branches = true, .moe_tiles = true, .moe_wgmma = true, .att_heads = 0,
    .att_whole = true, .expert_fetch = DSV4_CUDA_EXPERT_FETCH_DEFAULT, .log = false,
};

/* One variable's value into its field; -EINVAL naming what is allowed. */
static int parse(const struct sw_def *d, const char *v, struct dsv4_cuda_switches *sw)
{
    char *field = (char *)sw + d->off, *end;
    long long n;

    switch (d->kind) {
    case SW_BOOL:
        if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0)
            return dsv4_error_set(-EINVAL, "%s=%s: the value must be 0 or 1", d->name, v);
        *(bool *)field = v[0] == '1';
        return 0;
    case SW_STAGES:
        if (strcmp(v, "2") != 0 && strcmp(v, "4") != 0)
            return dsv4_error_set(-EINVAL, "%s=%s: the value must be 2 or 4 (4: the most stages that fit, the "
                                  "default)", d->name, v);
        *(int *)field = v[0] - '0';
        return 0;
    case SW_KB:
        errno = 0;
        n = strtoll(v, &end, 10);
        if (errno || end == v || *end || n < 0 || n > DSV4_CUDA_PREFETCH_KB_MAX)
            return dsv4_error_set(-EINVAL, "%s=%s: the value must be an integer from 0 to %d (KB)", d->name, v,
                                  DSV4_CUDA_PREFETCH_KB_MAX);
        *(int64_t *)field = n;
        return 0;
    case SW_HEADS:
        if (strcmp(v, "0") != 0 && strcmp(v, "16") != 0 && strcmp(v, "32") != 0 && strcmp(v, "64") != 0)
            return dsv4_error_set(-EINVAL, "%s=%s: the value must be 0 (chosen by batch, the default), 16, 32 or "
                                  "64", d->name, v);
        *(int *)field = atoi(v);
        return 0;
    case SW_AHEAD:
        if (strlen(v) != 1 || v[0] < '0' || v[0] > '0' + DSV4_CUDA_FETCH_AHEAD_SWITCH_MAX)
            return dsv4_error_set(-EINVAL, "%s=%s: the value must be 0 (host experts read in place only) or the "
                                  "layers one prediction covers, 1 to %d (default %d)", d->name, v,
                                  DSV4_CUDA_FETCH_AHEAD_SWITCH_MAX, DSV4_CUDA_EXPERT_FETCH_DEFAULT);
        *(int *)field = v[0] - '0';
        return 0;
    }
    return dsv4_error_set(-EINVAL, "%s: unknown switch kind", d->name);
}

int dsv4_cuda_switches_read(struct dsv4_cuda_switches *ret)
{
    struct dsv4_cuda_switches sw = defaults;
    *ret = defaults;
    for (int i = 0; i < N_SW; i++) {
        const char *v = getenv(table[i].name);
        int rc;
        if (v && (rc = parse(&table[i], v, &sw)) < 0)
            return rc;
    }
    *ret = sw;
    return 0;
}

void dsv4_cuda_switches_describe(const struct dsv4_cuda_switches *sw, char *buf, size_t len)
{
    size_t at = 0;
    if (len)
        buf[0] = '\0';
    for (int i = 0; i < N_SW && at < len; i++) {
        const char *field = (const char *)sw + table[i].off;
        long long v = table[i].kind == SW_BOOL ? *(const bool *)field
                    : table[i].kind == SW_STAGES || table[i].kind == SW_HEADS || table[i].kind == SW_AHEAD
                        ? *(const int *)field
                    : (long long)*(const int64_t *)field;
        int n = snprintf(buf + at, len - at, "%s%s=%lld", i ? " " : "", table[i].name, v);
        if (n < 0)
            break;
        at += (size_t)n;
    }
}

int dsv4_cuda_switch_count(void)
{
    return N_SW;
}

const char *dsv4_cuda_switch_name(int i)
{
    return i >= 0 && i < N_SW ? table[i].name : NULL;
}
