/* SPDX-License-Identifier: MIT */
/* The CUDA backend's environment switches: one table, read from the environment in one place
 * (kernels/switches.c), every value checked (an unknown one is refused with the values allowed),
 * named in the boot log. Each switch exists for comparisons and tests; the defaults are what
 * serving runs. README.md and dsv4d(8) list exactly these (tests/unit/test_cuda_switches.c). */
#ifndef DSV4_KERNELS_SWITCHES_H
#define DSV4_KERNELS_SWITCHES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_CUDA_PREFETCH_KB_DEFAULT 8192
#define DSV4_CUDA_PREFETCH_KB_MAX (1 << 20)     /* 1 GiB */
#define DSV4_CUDA_FETCH_AHEAD_SWITCH_MAX 3      /* = DSV4_CUDA_FETCH_AHEAD_MAX (kernels/dsv4cuda.h) */
#define DSV4_CUDA_EXPERT_FETCH_DEFAULT 3

struct dsv4_cuda_switches {
    bool graphs;                /* DSV4_CUDA_GRAPHS: replay captured graphs (0: eager launches) */
    bool gemm;                  /* DSV4_CUDA_GEMM: tensor-core linears (0: GEMV only) */
    int gemm_stages;            /* DSV4_CUDA_GEMM_STAGES: 4 (the most that fit, else 2) or 2 */
    bool gemm_wgmma;            /* DSV4_CUDA_GEMM_WGMMA: prefill chunks' FP8 linears on wgmma (sm_90a; 0: mma.sync) */
    bool gemm_wgmma_decode;     /* DSV4_CUDA_GEMM_WGMMA_DECODE: decode batches of 9-64 rows' FP8 linears on wgmma too */
    bool gemm_direct;           /* DSV4_CUDA_GEMM_DIRECT: linears of <= 8 rows with weights in registers (0: the ring) */
    int64_t gemm_prefetch_kb;   /* DSV4_CUDA_GEMM_PREFETCH_KB: a GEMM's first-wave weight prefetch, 0 off */
    bool pdl;                   /* DSV4_CUDA_PDL: programmatic dependent launch where the image has it */
    bool sample;                /* DSV4_CUDA_SAMPLE: sample on the device (0: on the host) */
    bool moe_mma;               /* DSV4_CUDA_MOE_MMA: tensor-core routed experts (0: FMA) */
    bool branches;              /* DSV4_CUDA_BRANCHES: a layer's branches on a second stream */
    bool moe_tiles;             /* DSV4_CUDA_MOE_TILES: routed experts in k-tile blocks (0: row-major) */
    bool moe_wgmma;             /* DSV4_CUDA_MOE_WGMMA: prefill chunks' routed experts on wgmma (sm_90a; 0: mma.sync) */
    int att_heads;              /* DSV4_CUDA_ATT_HEADS: heads an FP8 attention block takes (0: by batch) */
    bool att_whole;             /* DSV4_CUDA_ATT_WHOLE: prefill chunks' attention a block per row (0: splits) */
    int expert_fetch;           /* DSV4_CUDA_EXPERT_FETCH: decode steps fetch predicted host experts ahead
                                 * (kernels/expert_fetch.cu), each prediction covering this many layers
                                 * (0: host experts read in place only) */
    bool log;                   /* DSV4_CUDA_LOG: the boot log on stderr */
};

/* The switches as the environment sets them (unset: the default). -EINVAL with a message naming
 * the variable, its value and the values allowed; *ret then holds the defaults. */
int dsv4_cuda_switches_read(struct dsv4_cuda_switches *ret);

/* "DSV4_CUDA_GRAPHS=1 DSV4_CUDA_GEMM=1 ..." for the boot log; truncated to len (a buffer of
 * DSV4_CUDA_SWITCH_LINE holds it whole). */
#define DSV4_CUDA_SWITCH_LINE 512
void dsv4_cuda_switches_describe(const struct dsv4_cuda_switches *sw, char *buf, size_t len);

/* The table's variable names, for the documentation check: i in [0, dsv4_cuda_switch_count()). */
int dsv4_cuda_switch_count(void);
const char *dsv4_cuda_switch_name(int i);

#ifdef __cplusplus
}
#endif

#endif
