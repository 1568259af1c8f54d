/* SPDX-License-Identifier: MIT */
/* dsv4-bench: time each CUDA kernel at real V4-Flash shapes (batch 1 and 64 by default) beside the
 * bytes it must move over the measured device copy bandwidth: the floor no version can beat.
 *
 *   dsv4-bench [--batch 1,64] [--reps N]
 *   dsv4-bench --model DIR [--batch 1,16,64] [--context N] [--prefill N] [--layers N] [--chunk N] [--profile]
 *              [--profile-decode] [--expert-host-share P]      (the whole step, prefill)
 *   dsv4-bench --model DIR --spec S [--batch 1,16]              (speculative decoding's cycle: bench_spec)
 *
 * Each kernel is captured REPS times into one CUDA graph (launch gaps out of the numbers), reading
 * rotating copies of its weights that together exceed the L2 several times over, so the numbers
 * are HBM numbers; the graph is replayed and the median replay over REPS is reported. Weights hold
 * random values in their checkpoint formats (no NaN codes, scales near real ones), never zeros.
 *
 * With --model (a checkpoint from dsv4-mkckpt, or a directory its --synthetic wrote, whose weights are
 * generated in memory at load) it times the CUDA backend's decode step instead:
 * every slot of the batch holds a short prompt, each step is timed on the host around what the
 * daemon calls (input upload, graph replay, sampling on the device, the sampled tokens back: the
 * serving path), median of BENCH_STEPS; then the same step with the [B, V] f32 logits copied to
 * the host instead of sampled there (what dsv4-run and host sampling do). The floor counts the
 * weights every step reads (everything but the routed experts and the MTP block, plus the experts the
 * batch routes to, estimated for uniform routing as E (1 - (1 - k/E)^B) per layer; of the embedding
 * and the tid2eid tables a row per token), and at a long context the cache the step attends, over the
 * copy bandwidth (tools/bench_floor.h). The backend has DSV4_CUDA_MAX_BATCH slots whatever --batch is (so every prefill step
 * timed below has its bucket graph): with experts in host memory, a daemon with fewer slots keeps
 * more of them on the GPU.
 * A verify-shaped step follows: one slot appends 1 to 1 + DSV4_SPEC_TOKENS_MAX rows in one step with
 * every row's logits to the host, beside one row (the cost side of speculative decoding).
 * --chunk N sets the backend's prefill chunk (the longest prefill step timed); --profile brackets the
 * second step of the longest prefill timing with cudaProfilerStart/Stop, for
 * `ncu --profile-from-start off` (per-kernel time of one chunk); --profile-decode brackets one
 * serving-path decode step of the first --batch instead (per-kernel time of a step: their sum beside
 * the step's time says how much of it is kernels and how much the gaps between them).
 * --layers N deepens the model to N layers by repeating the checkpoint's last two (a CSA and an HCA
 * layer with scored routing, as dsv4-mkckpt writes from layer 4 on), so that a deep model is timed
 * from a short checkpoint: the repeats alias the checkpoint's host tensors, the device holds a copy
 * per layer as usual, and a layer's values do not change its time. Routed experts that do not fit the
 * GPU live in pinned host memory (expert_offload = auto, dsv4d(8)); --expert-host-share P puts at
 * least P percent of each layer's there even when they fit, to time the PCIe path on a model that
 * fits. The placement is printed after the boot line, the pinned host-to-device copy bandwidth
 * before it, and under each step the share of its bytes that comes from host memory (the host
 * experts the batch routes to, uniform routing) beside that bandwidth.
 *
 * The peer: each BF16 shape is also run through cuBLASLt (bf16 x bf16 -> f32, f32 compute, its own
 * heuristic choice), the vendor GEMM a user would otherwise call, in the same run and graph
 * harness. It reads x already in bf16 (no hi/lo split: half the math of ours, not the same
 * precision), so it is a throughput peer, not a numerics one. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"    /* cublasLt.h declares f() in C */
#include <cublasLt.h>
#pragma GCC diagnostic pop
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/model/weights.h"
#include "kernels/dsv4cuda.h"
#include "tools/bench_floor.h"

#define BENCH_ROTATE_BYTES (512u << 20)     /* rotate weight copies until they span 512 MiB */
#define BENCH_MAX_COPIES 64
#define BENCH_REPLAYS 7
#define BENCH_MAX_BATCHES 8
#define BENCH_COPY_BYTES (2ull << 30)       /* device-to-device copy for the bandwidth ceiling */
#define BENCH_H2D_BYTES (256ull << 20)      /* pinned host-to-device copy: the host link's rate */
#define BENCH_STEPS 21                      /* decode steps timed per batch size (--model) */
#define BENCH_PROMPT 8                      /* tokens each slot holds before the timed steps */
#define BENCH_PREFILL 1024                  /* default prompt tokens of the timed prefill (--model --prefill N) */

#define TRY(call)                                                                              \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "dsv4-bench: %s: %s\n", #call, cudaGetErrorString(e_));            \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define OK(call)                                                                               \
    do {                                                                                       \
        if ((call) < 0) {                                                                      \
            fprintf(stderr, "dsv4-bench: %s: %s\n", #call, dsv4_error_message());             \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_u64(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
}

/* A random token id of a vocabulary of V, past the two lowest (BOS and EOS on the small models). */
static int32_t random_token(int V)
{
    return (int32_t)(2 + next_u64() % (uint64_t)(V - 2));
}

/* Slot `slot` reset, then holding BENCH_PROMPT random tokens: where every timed step starts from. */
static void fill_slot(struct dsv4_backend *b, int slot, int V)
{
    int32_t prompt[BENCH_PROMPT];
    b->ops->slot_reset(b, slot);
    for (int t = 0; t < BENCH_PROMPT; t++)
        prompt[t] = random_token(V);
    OK(b->ops->prefill(b, slot, prompt, BENCH_PROMPT, NULL, false));
}

enum fill { FILL_FP8, FILL_FP4, FILL_BF16, FILL_F32, FILL_SCALE, FILL_ACT };

/* Device buffer of `bytes` with random contents of the given kind. */
static void *dev_random(size_t bytes, enum fill kind)
{
    const size_t chunk = 16u << 20;
    uint8_t *h = malloc(chunk);
    void *d;
    if (!h) {
        fprintf(stderr, "dsv4-bench: out of host memory\n");
        exit(1);
    }
    for (size_t i = 0; i < chunk; i += 4) {
        uint32_t r = (uint32_t)next_u64(), v;
        switch (kind) {
        case FILL_FP8: v = r & 0x7e7e7e7eu; v |= r & 0x80808080u; break;     /* no 0x7f/0xff codes */
        case FILL_FP4: v = r; break;
        case FILL_BF16: v = (r & 0x807f807fu) | 0x3c003c00u; break;          /* |v| in [2^-7, 2^-6) */
        case FILL_SCALE: v = 0x77777777u + (r & 0x03030303u); break;         /* 2^-8 .. 2^-5 */
        default: {
            float f = ((float)(r >> 8) / 16777216.0f - 0.5f) * (kind == FILL_F32 ? 0.05f : 4.0f);
            memcpy(&v, &f, 4);
            break;
        }
        }
        memcpy(h + i, &v, 4);
    }
    TRY(cudaMalloc(&d, bytes));
    for (size_t off = 0; off < bytes; off += chunk)
        TRY(cudaMemcpy((uint8_t *)d + off, h, bytes - off < chunk ? bytes - off : chunk, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

struct linear_set {
    struct dsv4_cuda_linear l[BENCH_MAX_COPIES];
    int n;
    size_t bytes;               /* one copy: weights + scales */
};

static void make_linears(struct linear_set *s, enum dsv4_wfmt fmt, int64_t out, int64_t in)
{
    size_t wb, sb = 0;
    int64_t ss = 0;
    switch (fmt) {
    case DSV4_W_F32: wb = (size_t)(out * in) * 4; break;
    case DSV4_W_BF16: wb = (size_t)(out * in) * 2; break;
    case DSV4_W_FP8: wb = (size_t)(out * in); ss = (in + 127) / 128; sb = (size_t)((out + 127) / 128 * ss); break;
    default: wb = (size_t)(out * in) / 2; ss = in / 32; sb = (size_t)(out * ss); break;
    }
    s->bytes = wb + sb;
    s->n = (int)(BENCH_ROTATE_BYTES / s->bytes) + 1;
    if (s->n > BENCH_MAX_COPIES)
        s->n = BENCH_MAX_COPIES;
    for (int i = 0; i < s->n; i++) {
        s->l[i] = (struct dsv4_cuda_linear){ .fmt = fmt, .out = out, .in = in, .row_stride = in, .scale_stride = ss };
        s->l[i].w = dev_random(wb, fmt == DSV4_W_FP8 ? FILL_FP8 : fmt == DSV4_W_FP4 ? FILL_FP4 :
                                   fmt == DSV4_W_BF16 ? FILL_BF16 : FILL_F32);
        s->l[i].scale = sb ? dev_random(sb, FILL_SCALE) : NULL;
    }
}

static void free_linears(struct linear_set *s)
{
    for (int i = 0; i < s->n; i++) {
        cudaFree((void *)s->l[i].w);
        cudaFree((void *)s->l[i].scale);
    }
}

/* What one timed launch runs; rep picks the weight copy. */
struct job {
    int (*run)(struct job *j, int rep, cudaStream_t s);
    struct linear_set *ls;
    float *x, *y;
    int batch;
    int groups;                 /* wo_a: output groups, each reading its own slice of x */
    struct dsv4_cuda_experts ex[BENCH_MAX_COPIES];
    int n_ex;
    int32_t *idx;
    float *w, *aux1, *aux2, *aux3;
    struct dsv4_cuda_moe_ws ws;
};

static double copy_gbs;         /* measured device copy bandwidth, bytes read + written */
static double h2d_gbs;          /* measured pinned host-to-device copy bandwidth (--model) */

static float median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            float t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

/* Microseconds per launch: REPS launches captured in one graph, median of BENCH_REPLAYS replays. */
static double time_job(struct job *j, int reps)
{
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaEvent_t a, b;
    float ms[BENCH_REPLAYS];

    TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TRY(cudaEventCreate(&a));
    TRY(cudaEventCreate(&b));
    TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int r = 0; r < reps; r++)
        OK(j->run(j, r, s));
    TRY(cudaStreamEndCapture(s, &g));
    TRY(cudaGraphInstantiate(&ge, g, 0));
    TRY(cudaGraphLaunch(ge, s));        /* warm-up */
    TRY(cudaStreamSynchronize(s));
    for (int i = 0; i < BENCH_REPLAYS; i++) {
        TRY(cudaEventRecord(a, s));
        TRY(cudaGraphLaunch(ge, s));
        TRY(cudaEventRecord(b, s));
        TRY(cudaEventSynchronize(b));
        TRY(cudaEventElapsedTime(&ms[i], a, b));
    }
    TRY(cudaGraphExecDestroy(ge));
    TRY(cudaGraphDestroy(g));
    TRY(cudaEventDestroy(a));
    TRY(cudaEventDestroy(b));
    TRY(cudaStreamDestroy(s));
    return median(ms, BENCH_REPLAYS) * 1000.0 / reps;
}

static void report(const char *what, int batch, double us, double bytes)
{
    const double floor_us = bytes / (copy_gbs * 1e3);
    printf("%-34s %5d %10.2f %12.3f %10.2f %7.2f %8.0f\n", what, batch, us, bytes / 1e6, floor_us, us / floor_us,
           bytes / (us * 1e3));
}

static struct dsv4_cuda_gemm_ws gemm_ws;

/* The tensor-core linear: FP8 with the 1x128 activation quantizer inside, BF16 with hi/lo x. */
static int run_gemm(struct job *j, int rep, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = &j->ls->l[rep % j->ls->n];
    return dsv4_cuda_gemm(l, j->x, l->in, j->batch, l->fmt == DSV4_W_FP8, &gemm_ws, j->y, l->out, s);
}

static int run_gemv(struct job *j, int rep, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = &j->ls->l[rep % j->ls->n];
    return dsv4_cuda_gemv(l, j->x, l->in, j->batch, j->y, l->out, s);
}

/* wo_a as the step ran it before the grouped launch: one GEMV per group over a view of the rows
 * (whole 128-row scale blocks here) and that group's slice of x (raw activations). */
static int run_gemv_groups(struct job *j, int rep, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = &j->ls->l[rep % j->ls->n];
    const int64_t R = l->out / j->groups, xw = l->in * j->groups;
    for (int g = 0; g < j->groups; g++) {
        const struct dsv4_cuda_linear v = dsv4_cuda_linear_rows(l, g * R, R);
        int rc = dsv4_cuda_gemv(&v, j->x + g * l->in, xw, j->batch, j->y + g * R, l->out, s);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* The cuBLASLt peer: y^T [out, batch] = W [out, K] (column-major [K, out], transposed) x^T [K, batch],
 * bf16 inputs, f32 output and compute. */
#define PEER_WS_BYTES (32u << 20)
static cublasLtHandle_t peer_lt;
static void *peer_ws, *peer_xb;     /* workspace; x as bf16 [DSV4_CUDA_MAX_BATCH, 32768] */

static int run_peer(struct job *j, int rep, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = &j->ls->l[rep % j->ls->n];
    const float one = 1.0f, zero = 0.0f;
    const cublasOperation_t tr = CUBLAS_OP_T;
    const cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
    const cudaDataType_t st = CUDA_R_32F;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasStatus_t e = cublasLtMatmulDescCreate(&op, ct, st);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof(tr));
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, (uint64_t)l->in, (uint64_t)l->out, l->row_stride);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, (uint64_t)l->in, (uint64_t)j->batch, l->in);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, (uint64_t)l->out, (uint64_t)j->batch, l->out);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmul(peer_lt, op, &one, l->w, a, peer_xb, b, &zero, j->y, c, j->y, c, NULL, peer_ws,
                           PEER_WS_BYTES, s);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    return e == CUBLAS_STATUS_SUCCESS ? 0 : dsv4_error_set(-EIO, "cuBLASLt peer: status %d", (int)e);
}

static int run_gemm_grouped(struct job *j, int rep, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = &j->ls->l[rep % j->ls->n];
    return dsv4_cuda_gemm_grouped(l, j->groups, j->x, l->in * j->groups, j->batch, &gemm_ws, j->y, l->out, s);
}

/* The mHC fn through its split-K launcher; j->aux1 is the partial-sum workspace. */
static int run_mhc_fn(struct job *j, int rep, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = &j->ls->l[rep % j->ls->n];
    return dsv4_cuda_mhc_fn(l, j->x, l->in, j->batch, j->aux1, dsv4_cuda_mhc_fn_ws_floats(j->batch, l->out, l->in),
                            j->y, l->out, s);
}

static int run_roundtrip(struct job *j, int rep, cudaStream_t s)
{
    return dsv4_cuda_fp8_roundtrip(j->x, j->batch, 4096, DSV4_CUDA_ACT_BLOCK, j->y, s);
}

static int run_rmsnorm(struct job *j, int rep, cudaStream_t s)
{
    return dsv4_cuda_rmsnorm(j->x, j->w, j->batch, 4096, 1e-6f, j->y, s);
}

static int run_router(struct job *j, int rep, cudaStream_t s)
{
    return dsv4_cuda_router(j->x, NULL, j->batch, 256, 6, j->w, NULL, NULL, 1.5f, j->idx, j->y, s);
}

static int run_mhc_pre(struct job *j, int rep, cudaStream_t s)
{
    return dsv4_cuda_mhc_pre(j->x, j->aux1, j->w, j->w, j->batch, 4, 4096, 20, 1e-6f, 1e-6f, j->y, j->aux2, j->aux3, s);
}

static int run_mhc_post(struct job *j, int rep, cudaStream_t s)
{
    return dsv4_cuda_mhc_post(j->x, j->aux1, NULL, j->aux2, j->aux3, j->batch, 4, 4096, j->y, s);
}

static int run_experts(struct job *j, int rep, cudaStream_t s)
{
    return dsv4_cuda_moe_experts(&j->ex[rep % j->n_ex], j->x, j->batch, 6, j->idx, j->w, &j->ws, j->y, s);
}

/* ---- prefill GEMMs: many rows, compute-bound; TFLOP/s beside cuBLASLt's FP8 in the same run ---- */

struct big_gemm {
    const struct dsv4_cuda_linear *w;   /* FP8 [out, in] with 128x128 UE8M0 scales */
    const float *x;                     /* [rows, in] f32 (ours quantizes it inside, 1x128) */
    float *y;                           /* [rows, out] f32 */
    int rows;
    struct dsv4_cuda_gemm_ws *ws;
    const void *x8;                     /* cuBLASLt: [rows, in] e4m3 */
    void *y16;                          /* cuBLASLt: [rows, out] bf16 */
    const float *sw, *sx;               /* cuBLASLt block scales: weights [out/128, in/128], x [rows, in/128] */
    bool block;                         /* cuBLASLt with the block scales, else one scale per tensor */
};

static int big_ours(const struct big_gemm *g, cudaStream_t s)
{
    return dsv4_cuda_gemm(g->w, g->x, g->w->in, g->rows, true, g->ws, g->y, g->w->out, s);
}

/* D^T [out, rows] = W [out, K] (column-major [K, out], transposed) x^T [K, rows]: the TN form FP8
 * needs, e4m3 in, bf16 out, f32 compute. */
static int big_lt(const struct big_gemm *g, cudaStream_t s)
{
    const struct dsv4_cuda_linear *l = g->w;
    const float one = 1.0f, zero = 0.0f;
    const cublasOperation_t tr = CUBLAS_OP_T;
    const int32_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a = NULL, b = NULL, c = NULL;
    cublasStatus_t e = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (e != CUBLAS_STATUS_SUCCESS)
        return dsv4_error_set(-EIO, "cuBLASLt fp8: status %d", (int)e);
    e = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof(tr));
    if (e == CUBLAS_STATUS_SUCCESS && g->block)
        e = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &blk, sizeof(blk));
    if (e == CUBLAS_STATUS_SUCCESS && g->block)
        e = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof(vec));
    if (e == CUBLAS_STATUS_SUCCESS && g->block)
        e = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g->sw, sizeof(g->sw));
    if (e == CUBLAS_STATUS_SUCCESS && g->block)
        e = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g->sx, sizeof(g->sx));
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, (uint64_t)l->in, (uint64_t)l->out, l->in);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, (uint64_t)l->in, (uint64_t)g->rows, l->in);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, (uint64_t)l->out, (uint64_t)g->rows, l->out);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmul(peer_lt, op, &one, l->w, a, g->x8, b, &zero, g->y16, c, g->y16, c, NULL, peer_ws,
                           PEER_WS_BYTES, s);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    return e == CUBLAS_STATUS_SUCCESS ? 0 : dsv4_error_set(-EIO, "cuBLASLt fp8%s: status %d", g->block ?
                                                           " block-scaled" : "", (int)e);
}

/* Milliseconds of one call: `reps` calls timed with events after a warm-up (each takes long enough
 * that launch gaps do not matter); negative when the call fails (reported, not fatal). */
static double big_time(int (*fn)(const struct big_gemm *, cudaStream_t), const struct big_gemm *g, int reps)
{
    cudaStream_t s;
    cudaEvent_t a, b;
    float ms;
    TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TRY(cudaEventCreate(&a));
    TRY(cudaEventCreate(&b));
    int rc = fn(g, s);
    if (rc == 0) {
        TRY(cudaEventRecord(a, s));
        for (int r = 0; r < reps && rc == 0; r++)
            rc = fn(g, s);
        TRY(cudaEventRecord(b, s));
        TRY(cudaEventSynchronize(b));
        TRY(cudaEventElapsedTime(&ms, a, b));
    }
    TRY(cudaStreamSynchronize(s));
    TRY(cudaEventDestroy(a));
    TRY(cudaEventDestroy(b));
    TRY(cudaStreamDestroy(s));
    return rc == 0 ? ms / reps : -1.0;
}

/* Ours (the step's FP8 linear, activation quantizer included) against cuBLASLt FP8 at prefill row
 * counts on V4-Flash shapes, and the dense FP8 rate (8192^3, cuBLASLt) that bounds prefill. */
static void bench_big_gemms(void)
{
    static const struct { const char *what; int64_t out, in; } shapes[] = {
        { "wq_b fp8 [32768,1024]", 32768, 1024 },
        { "wo_b fp8 [4096,8192]", 4096, 8192 },
        { "wq_a fp8 [1024,4096]", 1024, 4096 },
        { "dense fp8 [8192,8192]", 8192, 8192 },
    };
    static const int rows[] = { 1024, 4096, 8192 };
    const int RMAX = 8192;
    const int64_t KMAX = 8192;
    struct dsv4_cuda_gemm_ws ws;
    void *wsm;
    TRY(cudaMalloc(&wsm, dsv4_cuda_gemm_ws_bytes(DSV4_CUDA_MAX_ROWS, KMAX)));
    dsv4_cuda_gemm_ws_init(&ws, wsm, DSV4_CUDA_MAX_ROWS, KMAX);
    float *x = dev_random((size_t)RMAX * KMAX * sizeof(float), FILL_ACT);
    float *y = dev_random((size_t)RMAX * 32768 * sizeof(float), FILL_ACT);
    void *x8 = dev_random((size_t)RMAX * KMAX, FILL_FP8), *y16 = dev_random((size_t)RMAX * 32768 * 2, FILL_BF16);
    const size_t nsc = (size_t)RMAX * (KMAX / 128) + (size_t)(32768 / 128) * (KMAX / 128);
    float *hsc = malloc(sizeof(float) * nsc), *dsc;
    for (size_t i = 0; i < nsc; i++)
        hsc[i] = 1.0f / (float)(1 << (next_u64() % 4));
    TRY(cudaMalloc((void **)&dsc, sizeof(float) * nsc));
    TRY(cudaMemcpy(dsc, hsc, sizeof(float) * nsc, cudaMemcpyHostToDevice));
    free(hsc);
    printf("%-34s %5s %10s %10s  %s\n", "prefill GEMM", "rows", "ms", "TFLOP/s", "x cuBLASLt fp8 (tensor scale)");
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        struct linear_set ls;
        make_linears(&ls, DSV4_W_FP8, shapes[i].out, shapes[i].in);
        for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
            const bool dense = shapes[i].out == 8192;
            if (dense != (rows[r] == 8192))
                continue;
            struct big_gemm g = { .w = &ls.l[0], .x = x, .y = y, .rows = rows[r], .ws = &ws, .x8 = x8, .y16 = y16,
                                  .sw = dsc + (size_t)RMAX * (KMAX / 128), .sx = dsc };
            const double flop = 2.0 * rows[r] * (double)shapes[i].out * (double)shapes[i].in;
            const int reps = 5;
            const double lt = big_time(big_lt, &g, reps);
            g.block = true;
            const double ltb = big_time(big_lt, &g, reps);
            const double ours = rows[r] <= DSV4_CUDA_MAX_ROWS ? big_time(big_ours, &g, reps) : -1.0;
            char what[96];
            if (ours > 0) {
                snprintf(what, sizeof(what), "%s ours", shapes[i].what);
                printf("%-34s %5d %10.3f %10.1f  %.2f\n", what, rows[r], ours, flop / (ours * 1e9),
                       lt > 0 ? ours / lt : 0.0);
            }
            snprintf(what, sizeof(what), "%s cublasLt", shapes[i].what);
            if (lt > 0)
                printf("%-34s %5d %10.3f %10.1f\n", what, rows[r], lt, flop / (lt * 1e9));
            else
                printf("%-34s %5d  failed: %s\n", what, rows[r], dsv4_error_message());
            snprintf(what, sizeof(what), "%s cublasLt block", shapes[i].what);
            if (ltb > 0)
                printf("%-34s %5d %10.3f %10.1f\n", what, rows[r], ltb, flop / (ltb * 1e9));
            else
                printf("%-34s %5d  unsupported here: %s\n", what, rows[r], dsv4_error_message());
        }
        free_linears(&ls);
    }
    cudaFree(wsm);
    cudaFree(x);
    cudaFree(y);
    cudaFree(x8);
    cudaFree(y16);
    cudaFree(dsc);
}

struct lshape {
    const char *what;
    enum dsv4_wfmt fmt;
    int64_t out, in;
    int groups;                 /* > 0: raw activations, `groups` slices of x (wo_a) */
};

static const struct lshape lshapes[] = {
    { "fp8 wq_a [1024,4096]", DSV4_W_FP8, 1024, 4096, 0 },
    { "fp8 wq_b [32768,1024]", DSV4_W_FP8, 32768, 1024, 0 },
    { "fp8 wkv [512,4096]", DSV4_W_FP8, 512, 4096, 0 },
    { "fp8 wo_b [4096,8192]", DSV4_W_FP8, 4096, 8192, 0 },
    { "fp8 idx wq_b [8192,1024]", DSV4_W_FP8, 8192, 1024, 0 },
    { "fp8 shared w1 [2048,4096]", DSV4_W_FP8, 2048, 4096, 0 },
    { "fp8 shared w2 [4096,2048]", DSV4_W_FP8, 4096, 2048, 0 },
    { "fp8 wo_a [8192,4096] x8 raw", DSV4_W_FP8, 8192, 4096, 8 },
    { "bf16 wo_a [8192,4096]", DSV4_W_BF16, 8192, 4096, 0 },
    { "bf16 comp wkv [1024,4096]", DSV4_W_BF16, 1024, 4096, 0 },
    { "bf16 gate [256,4096]", DSV4_W_BF16, 256, 4096, 0 },
    { "bf16 head [129280,4096]", DSV4_W_BF16, 129280, 4096, 0 },
    { "f32 hc fn [24,16384]", DSV4_W_F32, 24, 16384, 0 },
    { "fp4 expert w1 [2048,4096]", DSV4_W_FP4, 2048, 4096, 0 },
};

/* Median milliseconds of BENCH_REPLAYS copies of bytes from src to dst (after one to warm up). */
static float time_copies(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
    cudaEvent_t e0, e1;
    float ms[BENCH_REPLAYS];
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    TRY(cudaMemcpy(dst, src, bytes, kind));
    for (int i = 0; i < BENCH_REPLAYS; i++) {
        TRY(cudaEventRecord(e0, 0));
        TRY(cudaMemcpyAsync(dst, src, bytes, kind, 0));
        TRY(cudaEventRecord(e1, 0));
        TRY(cudaEventSynchronize(e1));
        TRY(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return median(ms, BENCH_REPLAYS);
}

static void measure_copy(void)
{
    void *a, *b;
    TRY(cudaMalloc(&a, BENCH_COPY_BYTES));
    TRY(cudaMalloc(&b, BENCH_COPY_BYTES));
    TRY(cudaMemset(a, 0x5a, BENCH_COPY_BYTES));
    copy_gbs = 2.0 * BENCH_COPY_BYTES / (time_copies(b, a, BENCH_COPY_BYTES, cudaMemcpyDeviceToDevice) * 1e6);
    printf("# device copy bandwidth: %.0f GB/s (read + write of %.1f GiB, median of %d)\n", copy_gbs,
           BENCH_COPY_BYTES / 1073741824.0, BENCH_REPLAYS);
    cudaFree(a);
    cudaFree(b);
}

/* The host link's rate, for routed experts that live in host memory: a pinned buffer copied to the
 * device by the copy engine (what the link gives large transfers; the expert kernels read host
 * memory in place, in smaller requests). */
static void measure_host_link(void)
{
    void *h, *d;
    TRY(cudaHostAlloc(&h, BENCH_H2D_BYTES, cudaHostAllocDefault));
    TRY(cudaMalloc(&d, BENCH_H2D_BYTES));
    memset(h, 0x5a, BENCH_H2D_BYTES);
    h2d_gbs = BENCH_H2D_BYTES / (time_copies(d, h, BENCH_H2D_BYTES, cudaMemcpyHostToDevice) * 1e6);
    printf("# host-to-device copy bandwidth: %.1f GB/s (pinned, %llu MiB, median of %d)\n", h2d_gbs,
           BENCH_H2D_BYTES >> 20, BENCH_REPLAYS);
    cudaFreeHost(h);
    cudaFree(d);
}

static int parse_batches(const char *arg, int *out)
{
    int n = 0;
    char *end;
    while (*arg) {
        long v = strtol(arg, &end, 10);
        if (n == BENCH_MAX_BATCHES || end == arg || v < 1 || v > DSV4_CUDA_MAX_BATCH)
            return -1;
        out[n++] = (int)v;
        arg = *end == ',' ? end + 1 : end;
    }
    return n;
}

/* --gpus 0,1 (0,0 puts two ranks on device 0): ordinals into gpus, their count, or -1 */
static int parse_gpus(const char *arg, int *gpus)
{
    int n = 0;
    char *end;
    while (*arg) {
        long v = strtol(arg, &end, 10);
        if (end == arg || v < 0 || v > 255 || n == DSV4_EP_MAX_GPUS)
            return -1;
        gpus[n++] = (int)v;
        arg = *end == ',' ? end + 1 : end;
    }
    return n;
}

/* The slot of a step's row s when the slots are dealt over n ranks in groups (engine/backend.h's
 * slot_groups): row s on rank s % n, so a batch spreads over the ranks as the scheduler places it. */
static int row_slot(int s, int max_batch, int n)
{
    int g0 = 0;
    for (int g = 0; g < s % n; g++)
        g0 += dsv4_ep_slots(max_batch, n, g);
    return g0 + s / n;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* BENCH_STEPS decode steps of B slots with their logits copied to the host, after one to warm up:
 * the microseconds of each into us. Each step feeds fresh random tokens into toks [B] (drawn before
 * its clock starts), as sampled tokens would be: one token fed again and again routes alike every
 * step, which serving never does, and with host experts measured ~1 ms faster a step than the
 * serving path on the 43-layer Flash, fetching off. */
static void time_decode_to_host(struct dsv4_backend *b, int B, const int *slots, int32_t *toks, int V, float *logits,
                                float *us)
{
    for (int step = 0; step < BENCH_STEPS + 1; step++) {
        for (int s = 0; s < B; s++)
            toks[s] = random_token(V);
        double a = now_us();
        OK(b->ops->decode(b, B, slots, toks, logits));
        if (step > 0)
            us[step - 1] = (float)(now_us() - a);
    }
}

/* --layers n: w's layers become n, the last two repeated in turn (see the header). The original
 * array is returned in *saved for restore_layers, which must run before dsv4_weights_free. */
static int extend_layers(struct dsv4_weights *w, int n, struct dsv4_layer **saved)
{
    struct dsv4_config *c = &w->cfg;
    const int n0 = c->n_layers, a = n0 - 2, b = n0 - 1;
    *saved = NULL;
    if (n <= n0)
        return 0;
    if (n > DSV4_MAX_LAYERS)
        return dsv4_error_set(-EINVAL, "--layers %d: at most %d", n, DSV4_MAX_LAYERS);
    if (n0 < 2 || c->mlp_type[a] == DSV4_MLP_HASH || c->mlp_type[b] == DSV4_MLP_HASH ||
        !((c->compress_ratio[a] == c->csa_ratio && c->compress_ratio[b] == c->hca_ratio) ||
          (c->compress_ratio[a] == c->hca_ratio && c->compress_ratio[b] == c->csa_ratio)))
        return dsv4_error_set(-EINVAL, "--layers %d: the checkpoint must end with a CSA and an HCA layer with scored "
                              "routing (dsv4-mkckpt --layers 6 or more)", n);
    struct dsv4_layer *L = malloc(sizeof(*L) * (size_t)n);
    if (!L)
        return dsv4_error_set(-ENOMEM, "--layers %d: layer table", n);
    memcpy(L, w->layers, sizeof(*L) * (size_t)n0);
    for (int i = n0; i < n; i++) {
        const int src = (i - n0) % 2 == 0 ? a : b;
        L[i] = w->layers[src];
        c->compress_ratio[i] = c->compress_ratio[src];
        c->mlp_type[i] = c->mlp_type[src];
        w->bytes_total += (uint64_t)dsv4_bench_layer_bytes(c, &w->layers[src]);
    }
    *saved = w->layers;
    w->layers = L;
    c->n_layers = n;
    return 0;
}

static void restore_layers(struct dsv4_weights *w, struct dsv4_layer *saved, int n0, uint64_t bytes0)
{
    if (!saved)
        return;
    free(w->layers);
    w->layers = saved;
    w->cfg.n_layers = n0;
    w->bytes_total = bytes0;
}

/* --spec S: the backend speculates with the checkpoint's MTP block (S drafts a step). For each batch,
 * every slot holds a short prompt; then a plain decode step (logits to the host, as a speculating
 * backend samples there) and a speculative cycle (draft S tokens, verify the S + 1 rows of every
 * slot, accept them all) are timed, medians of BENCH_STEPS. A cycle that keeps a tokens of its S + 1
 * gains a x t(decode) / t(cycle). */
static int bench_spec(const char *dir, const int *batches, int nb, int context, int spec)
{
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    int max_batch = spec + 1;
    for (int i = 0; i < nb; i++)
        max_batch = batches[i] > max_batch ? batches[i] : max_batch;
    struct dsv4_backend_opts opts = { .max_batch = max_batch, .max_context = context,
                                      .numerics = DSV4_NUMERICS_FP8, .spec_tokens = spec };
    const double t0 = now_us();
    OK(dsv4_weights_load(dir, &w));
    OK(dsv4_backend_cuda_create(w, &opts, &b));
    if (b->spec_tokens != spec) {
        fprintf(stderr, "dsv4-bench: --spec %d: the backend does not speculate (no MTP block, or max_batch under "
                "%d)\n", spec, spec + 1);
        exit(1);
    }
    printf("# %s: %d layers, speculation with %d drafts, boot %.1f s\n", dir, w->cfg.n_layers, spec,
           (now_us() - t0) / 1e6);
    const int V = w->cfg.vocab_size, S = spec;
    float *logits = malloc(sizeof(float) * (size_t)max_batch * (S + 1) * V);
    int32_t *rows_tok = malloc(sizeof(int32_t) * (size_t)max_batch * (S + 1)), drafts[DSV4_CUDA_MAX_BATCH *
                                                                                        DSV4_SPEC_TOKENS_MAX];
    int slots[DSV4_CUDA_MAX_BATCH], k[DSV4_CUDA_MAX_BATCH], made[DSV4_CUDA_MAX_BATCH], rows[DSV4_CUDA_MAX_BATCH];
    int32_t toks[DSV4_CUDA_MAX_BATCH];
    if (!logits || !rows_tok) {
        fprintf(stderr, "dsv4-bench: out of memory\n");
        exit(1);
    }
    printf("%-34s %5s %10s %10s %10s\n", "speculative cycle", "batch", "us", "x decode", "rows");
    for (int i = 0; i < nb; i++) {
        const int B = batches[i];
        float dec[BENCH_STEPS], cyc[BENCH_STEPS];
        for (int s = 0; s < B; s++) {
            slots[s] = s;
            k[s] = S;
            fill_slot(b, s, V);
            toks[s] = random_token(V);
        }
        time_decode_to_host(b, B, slots, toks, V, logits, dec);
        int total_rows = 0;
        for (int step = 0; step < BENCH_STEPS + 1; step++) {
            double a = now_us();
            OK(b->ops->draft(b, B, slots, toks, k, drafts, made));
            for (int s = 0; s < B; s++) {
                rows[s] = 1 + made[s];
                rows_tok[(size_t)s * (S + 1)] = toks[s];
                memcpy(rows_tok + (size_t)s * (S + 1) + 1, drafts + (size_t)s * S, sizeof(int32_t) * (size_t)made[s]);
            }
            OK(b->ops->verify(b, B, slots, rows, rows_tok, logits));
            for (int s = 0; s < B; s++)
                OK(b->ops->accept(b, s, rows[s]));
            if (step > 0) {
                cyc[step - 1] = (float)(now_us() - a);
                for (int s = 0; s < B; s++)
                    total_rows += rows[s];
            }
        }
        const float td = median(dec, BENCH_STEPS), tc = median(cyc, BENCH_STEPS);
        char what[64];
        snprintf(what, sizeof(what), "decode step, logits to the host");
        printf("%-34s %5d %10.2f %10.2f %10d\n", what, B, td, 1.0, 1);
        snprintf(what, sizeof(what), "draft %d + verify + accept", S);
        printf("%-34s %5d %10.2f %10.2f %10.2f\n", what, B, tc, tc / td, (double)total_rows / (BENCH_STEPS * B));
        printf("# batch %d: at an acceptance of 2.5 tokens a cycle, speculation gains %.2fx\n", B, 2.5 * td / tc);
    }
    free(logits);
    free(rows_tok);
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    return 0;
}

/* What the profiler (ncu --profile-from-start off) sees: one prefill step of the largest size, or one
 * decode step of the first batch. */
enum bench_profile { PROFILE_NONE, PROFILE_PREFILL, PROFILE_DECODE };

static int bench_model(const char *dir, const int *batches, int nb, int context, int prefill, int layers, int chunk,
                       int host_share, const int *gpus, int n_gpus, enum bench_profile profile)
{
    struct dsv4_weights *w = NULL;
    struct dsv4_layer *saved;
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts opts = { .max_batch = DSV4_CUDA_MAX_BATCH, .max_context = context,
                                      .numerics = DSV4_NUMERICS_FP8, .prefill_chunk = chunk,
                                      .expert_offload = host_share ? DSV4_EXPERT_OFFLOAD_ON : DSV4_EXPERT_OFFLOAD_AUTO,
                                      .expert_host_share = host_share, .n_gpus = n_gpus };
    struct dsv4_backend_stats st;
    double t0 = now_us();
    const int ranks = n_gpus > 1 ? n_gpus : 1;

    memcpy(opts.gpus, gpus, sizeof(int) * (size_t)n_gpus);

    OK(dsv4_weights_load(dir, &w));
    const int n0 = w->cfg.n_layers;
    const uint64_t bytes0 = w->bytes_total;
    OK(extend_layers(w, layers, &saved));
    const struct dsv4_config *c = &w->cfg;
    OK(dsv4_backend_cuda_create(w, &opts, &b));
    b->ops->get_stats(b, &st);
    printf("# %s: %d layers, %.2f GB of %s weights, boot %.1f s (load, upload, %llu graphs), %s\n", dir, c->n_layers,
           w->bytes_total / 1e9, w->synthetic ? "synthetic" : "checkpoint", (now_us() - t0) / 1e6,
           (unsigned long long)st.graph_captures, st.variant);
    printf("# routed experts: %u on the GPU (%.2f GB), %u in pinned host memory (%.2f GB); embedding in host memory: "
           "%.2f GB\n", st.experts_gpu, st.expert_bytes_gpu / 1e9, st.experts_host, st.expert_bytes_host / 1e9,
           st.embed_bytes_host / 1e9);
    if (ranks > 1)
        printf("# the experts split over %d ranks, a batch's rows dealt over them; the floors below are of one GPU "
               "reading every byte of the step\n", ranks);

    struct dsv4_bench_floor fl;
    dsv4_bench_floor_init(w, &fl);
    const int V = c->vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)DSV4_CUDA_MAX_BATCH * V);
    int slots[DSV4_CUDA_MAX_BATCH], row_rc[DSV4_CUDA_MAX_BATCH];
    int32_t toks[DSV4_CUDA_MAX_BATCH];
    struct dsv4_sampling sp;
    struct dsv4_backend_sample_req req[DSV4_CUDA_MAX_BATCH];
    struct dsv4_sample smp[DSV4_CUDA_MAX_BATCH];
    char *msgs = malloc((size_t)DSV4_CUDA_MAX_BATCH * DSV4_BACKEND_MSG_MAX);
    if (!logits || !msgs || !b->ops->sample) {
        fprintf(stderr, "dsv4-bench: %s\n", !b->ops->sample ? "the backend samples on the host (DSV4_CUDA_SAMPLE=0): "
                                                               "the serving path needs device sampling" : "out of memory");
        exit(1);
    }
    dsv4_sampling_defaults(&sp);
    sp.has_seed = true;
    printf("%-34s %5s %10s %12s %10s %7s %8s\n", "decode step", "batch", "us", "MB moved", "floor us", "x floor",
           "GB/s");
    for (int i = 0; i < nb; i++) {
        const int B = batches[i];
        float us[BENCH_STEPS];
        for (int s = 0; s < B; s++) {
            slots[s] = row_slot(s, opts.max_batch, ranks);
            fill_slot(b, slots[s], V);
        }
        for (int s = 0; s < B; s++) {
            sp.seed = (uint64_t)s + 1;
            req[s] = (struct dsv4_backend_sample_req){ .slot = slots[s], .params = &sp, .seed = sp.seed };
        }
        /* the serving path: each step's tokens are the ones it sampled, as in the daemon */
        for (int s = 0; s < B; s++)
            toks[s] = random_token(V);
        struct dsv4_backend_stats f0, f1;
        b->ops->get_stats(b, &f0);
        for (int step = 0; step < BENCH_STEPS + 1; step++) {
            const bool prof = profile == PROFILE_DECODE && i == 0 && step == BENCH_STEPS / 2;
            if (prof)
                TRY(cudaProfilerStart());
            double a = now_us();
            OK(b->ops->decode(b, B, slots, toks, NULL));
            OK(b->ops->sample(b, B, req, smp, row_rc, msgs));
            if (prof)
                TRY(cudaProfilerStop());
            if (step > 0)           /* the first step warms up */
                us[step - 1] = (float)(now_us() - a);
            for (int s = 0; s < B; s++) {
                if (row_rc[s] < 0) {
                    fprintf(stderr, "dsv4-bench: sampling row %d: %s\n", s, msgs + (size_t)s * DSV4_BACKEND_MSG_MAX);
                    exit(1);
                }
                toks[s] = smp[s].token;
                req[s].index++;
            }
        }
        const double K = c->n_experts_per_tok, E = c->n_experts;
        const double distinct = dsv4_bench_distinct_experts(c, B), bytes = dsv4_bench_step_bytes(c, &fl, B);
        char what[64];
        snprintf(what, sizeof(what), "%d-layer step (%.0f experts/layer)", c->n_layers, distinct);
        const double step_us = median(us, BENCH_STEPS);
        report(what, B, step_us, bytes);
        if (st.experts_host > 0) {  /* the host experts the batch routes to, over the host link's rate */
            double host = 0.0;
            for (int l = 0; l < st.expert_layers; l++)
                host += st.experts_host_by_layer[l] * (1.0 - pow(1.0 - K / E, B)) * fl.expert;
            printf("%-34s %5d %10s %12.3f %10.2f %7.2f %8.0f\n", "  of which from host memory", B, "", host / 1e6,
                   host / (h2d_gbs * 1e3), step_us / (host / (h2d_gbs * 1e3)), host / (step_us * 1e3));
            b->ops->get_stats(b, &f1);
            if (f1.expert_fetch)    /* kernels/expert_fetch.cu; DSV4_CUDA_EXPERT_FETCH=0 turns it off */
                printf("# fetched ahead a step: %.3f MB copied into device slots, %.3f MB of them read there\n",
                       (double)(f1.expert_fetch_copied - f0.expert_fetch_copied) / (BENCH_STEPS + 1) / 1e6,
                       (double)(f1.expert_fetch_used - f0.expert_fetch_used) / (BENCH_STEPS + 1) / 1e6);
        }
        time_decode_to_host(b, B, slots, toks, V, logits, us);
        snprintf(what, sizeof(what), "  the same, logits to the host");
        report(what, B, median(us, BENCH_STEPS), bytes);
    }
    /* Speculative decoding's verify, shaped: one slot appends 1 + k rows in one step (what a verify of
     * k drafts computes, less the MTP block's catch-up) with every row's logits to the host, as the
     * scheduler samples them there. Beside one row, the step's cost per token: at an acceptance of a
     * tokens a verify, speculation gains a x t(1) / t(1 + k). */
    {
        float vs[BENCH_STEPS], t1 = 0.0f;
        int32_t rows_tok[DSV4_SPEC_TOKENS_MAX + 1];
        printf("%-34s %5s %10s %12s\n", "verify-shaped step (1 slot)", "rows", "us", "x one row");
        for (int r = 1; r <= DSV4_SPEC_TOKENS_MAX + 1; r++) {
            for (int step = 0; step < BENCH_STEPS + 1; step++) {
                fill_slot(b, 0, V);
                for (int j = 0; j < r; j++)
                    rows_tok[j] = random_token(V);
                double a = now_us();
                OK(b->ops->prefill(b, 0, rows_tok, r, logits, true));
                if (step > 0)
                    vs[step - 1] = (float)(now_us() - a);
            }
            const float m = median(vs, BENCH_STEPS);
            if (r == 1)
                t1 = m;
            printf("%-34s %5d %10.1f %12.2f\n", "  rows, every row's logits", r, m, m / t1);
            if (r > 1)
                printf("# %d drafts: speculation gains %.2fx at an acceptance of 2.5 tokens a verify\n", r - 1,
                       2.5 * t1 / m);
        }
    }
    /* prefill: one slot, `prefill` tokens in calls of `step` tokens, each call one step of that many
     * rows (64: a bucket graph, what every prefill was before longer chunks; more: one eager step of
     * up to the backend's chunk). The floor reads the weights once per step (the experts a step
     * routes to, uniform estimate); prefill is compute-bound from a few hundred rows on. */
    {
        int32_t *p = malloc(sizeof(int32_t) * (size_t)prefill);
        const int steps[] = { DSV4_CUDA_MAX_BATCH, 256, 512, 1024, 2048, 4096 };
        const int maxstep = chunk ? chunk : DSV4_PREFILL_CHUNK_DEFAULT;
        float us[3];
        for (int i = 0; i < prefill; i++)
            p[i] = random_token(V);
        for (size_t k = 0; k < sizeof(steps) / sizeof(steps[0]) && steps[k] <= maxstep; k++) {
            const int step = steps[k], nsteps = (prefill + step - 1) / step;
            const double distinct = dsv4_bench_distinct_experts(c, step);
            for (int r = 0; r < 4; r++) {
                b->ops->slot_reset(b, 0);
                double a = now_us();
                const bool last = k + 1 == sizeof(steps) / sizeof(steps[0]) || steps[k + 1] > maxstep;
                const bool prof = profile == PROFILE_PREFILL && r == 0 && last;
                for (int i0 = 0; i0 < prefill; i0 += step) {
                    const int m = prefill - i0 < step ? prefill - i0 : step;
                    if (prof && i0 == step)     /* the second step: it reads a context of one step */
                        TRY(cudaProfilerStart());
                    OK(b->ops->prefill(b, 0, p + i0, m, i0 + m == prefill ? logits : NULL, false));
                    if (prof && i0 == step)
                        TRY(cudaProfilerStop());
                }
                if (r > 0)
                    us[r - 1] = (float)(now_us() - a);
            }
            char what[64];
            snprintf(what, sizeof(what), "prefill %d tokens, %d-row steps", prefill, step);
            report(what, prefill, median(us, 3), nsteps * (fl.dense + c->n_layers * distinct * fl.expert));
            printf("# prefill %d tokens in %d-row steps: %.0f tokens/s\n", prefill, step,
                   prefill / (median(us, 3) / 1e6));
        }
        float ds[BENCH_STEPS];
        int slot = 0;
        for (int step = 0; step < BENCH_STEPS; step++) {
            int32_t tok = random_token(V);
            double a = now_us();
            OK(b->ops->decode(b, 1, &slot, &tok, logits));
            ds[step] = (float)(now_us() - a);
        }
        char what[64];
        snprintf(what, sizeof(what), "%d-layer step at context %d", c->n_layers, prefill);
        report(what, 1, median(ds, BENCH_STEPS), dsv4_bench_context_step_bytes(c, &fl, prefill));
        free(p);
    }
    free(logits);
    free(msgs);
    dsv4_backend_destroy(b);
    restore_layers(w, saved, n0, bytes0);
    dsv4_weights_free(w);
    return 0;
}

int main(int argc, char **argv)
{
    int batches[BENCH_MAX_BATCHES] = { 1, 64 }, nb = 2, reps = 20, context = 4096, prefill = BENCH_PREFILL, layers = 0;
    int chunk = 0, host_share = 0, spec = 0, gpus[DSV4_EP_MAX_GPUS], n_gpus = 0;
    enum bench_profile profile = PROFILE_NONE;
    const char *model = NULL;
    const int topk = 6, E = 256, D = 4096, I = 2048;
    struct job j;
    struct dsv4_cuda_expert *tab;
    float *x, *y, *w, *a1, *a2, *a3;
    int32_t *idx;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batch") && i + 1 < argc) {
            nb = parse_batches(argv[++i], batches);
            if (nb <= 0) {
                fprintf(stderr, "dsv4-bench: --batch takes a list like 1,64 of at most %d values 1..%d\n",
                        BENCH_MAX_BATCHES, DSV4_CUDA_MAX_BATCH);
                return 2;
            }
        } else if (!strcmp(argv[i], "--model") && i + 1 < argc) {
            model = argv[++i];
        } else if (!strcmp(argv[i], "--context") && i + 1 < argc) {
            context = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--prefill") && i + 1 < argc) {
            prefill = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--layers") && i + 1 < argc) {
            layers = atoi(argv[++i]);
            if (layers < 1 || layers > DSV4_MAX_LAYERS) {
                fprintf(stderr, "dsv4-bench: --layers 1..%d\n", DSV4_MAX_LAYERS);
                return 2;
            }
        } else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) {
            chunk = atoi(argv[++i]);
            if (chunk < 1 || chunk > DSV4_PREFILL_CHUNK_MAX) {
                fprintf(stderr, "dsv4-bench: --chunk 1..%d\n", DSV4_PREFILL_CHUNK_MAX);
                return 2;
            }
        } else if (!strcmp(argv[i], "--spec") && i + 1 < argc) {
            spec = atoi(argv[++i]);
            if (spec < 1 || spec > DSV4_SPEC_TOKENS_MAX) {
                fprintf(stderr, "dsv4-bench: --spec 1..%d\n", DSV4_SPEC_TOKENS_MAX);
                return 2;
            }
        } else if (!strcmp(argv[i], "--expert-host-share") && i + 1 < argc) {
            host_share = atoi(argv[++i]);
            if (host_share < 1 || host_share > 100) {
                fprintf(stderr, "dsv4-bench: --expert-host-share 1..100\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--gpus") && i + 1 < argc) {
            n_gpus = parse_gpus(argv[++i], gpus);
            if (n_gpus < 1) {
                fprintf(stderr, "dsv4-bench: --gpus takes up to %d ordinals like 0,1 (0,0: two ranks on device 0)\n",
                        DSV4_EP_MAX_GPUS);
                return 2;
            }
        } else if (!strcmp(argv[i], "--profile")) {
            profile = PROFILE_PREFILL;
        } else if (!strcmp(argv[i], "--profile-decode")) {
            profile = PROFILE_DECODE;
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
            if (reps < 1 || reps > BENCH_MAX_COPIES * 4) {
                fprintf(stderr, "dsv4-bench: --reps 1..%d\n", BENCH_MAX_COPIES * 4);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: dsv4-bench [--batch 1,64] [--reps N] | --model DIR [--batch 1,16,64] [--context N] "
                            "[--prefill N] [--layers N] [--chunk N] [--expert-host-share P]\n"
                            "                  [--gpus N,...] [--profile | --profile-decode] [--spec S]\n");
            return 2;
        }
    }
    /* a slot's tokens: its prompt, then the warm-up and timed steps of the serving path and of the
     * logits copy (--spec: of the plain decode, then cycles of up to S + 1 rows) */
    const int need = BENCH_PROMPT + (BENCH_STEPS + 1) * (spec ? spec + 2 : 2);
    if (model && context < need) {
        fprintf(stderr, "dsv4-bench: --context %d: the timed steps need at least %d\n", context, need);
        return 2;
    }
    if (dsv4_cuda_device_count() == 0) {
        fprintf(stderr, "dsv4-bench: %s\n", dsv4_error_message());
        return 1;
    }
    measure_copy();
    if (model) {
        if (prefill < 1 || prefill + BENCH_STEPS > context) {
            fprintf(stderr, "dsv4-bench: --prefill %d must leave %d tokens of the context %d\n", prefill, BENCH_STEPS,
                    context);
            return 2;
        }
        if (spec)
            return bench_spec(model, batches, nb, context, spec);
        measure_host_link();
        return bench_model(model, batches, nb, context, prefill, layers, chunk, host_share, gpus, n_gpus, profile);
    }

    {
        void *g;
        OK(dsv4_cuda_gemm_prepare());
        TRY(cudaMalloc(&g, dsv4_cuda_gemm_ws_bytes(DSV4_CUDA_MAX_BATCH, 32768)));
        dsv4_cuda_gemm_ws_init(&gemm_ws, g, DSV4_CUDA_MAX_BATCH, 32768);
        if (cublasLtCreate(&peer_lt) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "dsv4-bench: cublasLtCreate failed\n");
            return 1;
        }
        TRY(cudaMalloc(&peer_ws, PEER_WS_BYTES));
        peer_xb = dev_random((size_t)DSV4_CUDA_MAX_BATCH * 32768 * 2, FILL_BF16);
    }
    /* activations and scratch for the largest batch */
    x = dev_random((size_t)DSV4_CUDA_MAX_BATCH * 32768 * sizeof(float), FILL_ACT);
    y = dev_random((size_t)DSV4_CUDA_MAX_BATCH * 129280 * sizeof(float), FILL_ACT);
    w = dev_random(4096 * sizeof(float), FILL_ACT);
    a1 = dev_random((size_t)DSV4_CUDA_MAX_BATCH * 4096 * sizeof(float), FILL_ACT);
    a2 = dev_random((size_t)DSV4_CUDA_MAX_BATCH * 64 * sizeof(float), FILL_ACT);
    a3 = dev_random((size_t)DSV4_CUDA_MAX_BATCH * 64 * sizeof(float), FILL_ACT);
    TRY(cudaMalloc((void **)&idx, (size_t)DSV4_CUDA_MAX_BATCH * topk * sizeof(int32_t)));

    printf("%-34s %5s %10s %12s %10s %7s %8s\n", "kernel", "batch", "us", "MB moved", "floor us", "x floor", "GB/s");
    for (size_t s = 0; s < sizeof(lshapes) / sizeof(lshapes[0]); s++) {
        struct linear_set ls;
        make_linears(&ls, lshapes[s].fmt, lshapes[s].out, lshapes[s].in);
        for (int b = 0; b < nb; b++) {
            const int G = lshapes[s].groups;
            memset(&j, 0, sizeof(j));
            j.run = G ? run_gemv_groups : run_gemv;
            j.ls = &ls;
            j.x = x;
            j.y = y;
            j.batch = batches[b];
            j.groups = G;
            if (G) {
                const double bytes = (double)ls.bytes + (double)batches[b] * 4 * (lshapes[s].in * G + lshapes[s].out);
                char what[64];
                report(lshapes[s].what, batches[b], time_job(&j, reps), bytes);
                if (dsv4_cuda_gemm_grouped_supports(&ls.l[0], G)) {
                    j.run = run_gemm_grouped;
                    snprintf(what, sizeof(what), "%s mma", lshapes[s].what);
                    report(what, batches[b], time_job(&j, reps), bytes);
                }
                continue;
            }
            report(lshapes[s].what, batches[b], time_job(&j, reps),
                   (double)ls.bytes + (double)batches[b] * 4 * (lshapes[s].in + lshapes[s].out));
            if (dsv4_cuda_gemm_supports(&ls.l[0], lshapes[s].fmt == DSV4_W_FP8)) {
                char what[64];
                j.run = run_gemm;
                snprintf(what, sizeof(what), "%s mma", lshapes[s].what);
                report(what, batches[b], time_job(&j, reps),
                       (double)ls.bytes + (double)batches[b] * 4 * (lshapes[s].in + lshapes[s].out));
                j.run = run_gemv;
            }
            if (lshapes[s].fmt == DSV4_W_BF16) {
                char what[64];
                j.run = run_peer;
                snprintf(what, sizeof(what), "%s cublasLt", lshapes[s].what);
                report(what, batches[b], time_job(&j, reps),
                       (double)ls.bytes + (double)batches[b] * (2 * lshapes[s].in + 4 * lshapes[s].out));
                j.run = run_gemv;
            }
            if (lshapes[s].fmt == DSV4_W_F32 && lshapes[s].out <= DSV4_CUDA_MHC_FN_MAX_OUT) {
                char what[64];
                TRY(cudaMalloc((void **)&j.aux1,
                               dsv4_cuda_mhc_fn_ws_floats(batches[b], lshapes[s].out, lshapes[s].in) * sizeof(float)));
                j.run = run_mhc_fn;
                snprintf(what, sizeof(what), "%s split-K", lshapes[s].what);
                report(what, batches[b], time_job(&j, reps),
                       (double)ls.bytes + (double)batches[b] * 4 * (lshapes[s].in + lshapes[s].out));
                cudaFree(j.aux1);
            }
        }
        free_linears(&ls);
    }

    /* routed experts: E FP4 experts at the real shape, each token's top-6 drawn at random */
    {
        const size_t w13 = (size_t)I * D / 2, s13 = (size_t)I * (D / 32);
        const size_t w2b = (size_t)D * I / 2, s2b = (size_t)D * (I / 32), per = 2 * (w13 + s13) + w2b + s2b;
        uint8_t *blob = dev_random(per * E, FILL_FP4);
        int32_t hidx[DSV4_CUDA_MAX_BATCH * 6];
        float hw[DSV4_CUDA_MAX_BATCH * 6];
        tab = malloc(sizeof(*tab) * E);
        for (int e = 0; e < E; e++) {
            uint8_t *p = blob + per * e;
            tab[e].w1 = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = I, .in = D, .row_stride = D, .w = p,
                                                   .scale = p + w13, .scale_stride = D / 32 };
            tab[e].w3 = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = I, .in = D, .row_stride = D,
                                                   .w = p + w13 + s13, .scale = p + 2 * w13 + s13,
                                                   .scale_stride = D / 32 };
            tab[e].w2 = (struct dsv4_cuda_linear){ .fmt = DSV4_W_FP4, .out = D, .in = I, .row_stride = I,
                                                   .w = p + 2 * (w13 + s13), .scale = p + 2 * (w13 + s13) + w2b,
                                                   .scale_stride = I / 32 };
        }
        /* scales of every expert set to plausible exponents */
        for (int e = 0; e < E; e++) {
            uint8_t *sc = malloc(s13 > s2b ? s13 : s2b);
            for (size_t i = 0; i < (s13 > s2b ? s13 : s2b); i++)
                sc[i] = (uint8_t)(0x7a + next_u64() % 4);
            TRY(cudaMemcpy((void *)tab[e].w1.scale, sc, s13, cudaMemcpyHostToDevice));
            TRY(cudaMemcpy((void *)tab[e].w3.scale, sc, s13, cudaMemcpyHostToDevice));
            TRY(cudaMemcpy((void *)tab[e].w2.scale, sc, s2b, cudaMemcpyHostToDevice));
            free(sc);
        }
        memset(&j, 0, sizeof(j));
        j.n_ex = 1;
        j.ex[0] = (struct dsv4_cuda_experts){ .n_experts = E, .dim = D, .inter = I, .swiglu_limit = 10.0f,
                                              .fmt = DSV4_W_FP4, .quant_act = true };
        TRY(cudaMalloc((void **)&j.ex[0].d_table, sizeof(*tab) * E));
        TRY(cudaMemcpy((void *)j.ex[0].d_table, tab, sizeof(*tab) * E, cudaMemcpyHostToDevice));
        TRY(cudaMalloc((void **)&j.ws.d_groups, sizeof(int32_t) * (3 * DSV4_CUDA_MAX_BATCH * 6 + 2)));
        TRY(cudaMalloc((void **)&j.ws.d_h, sizeof(float) * DSV4_CUDA_MAX_BATCH * 6 * I));
        TRY(cudaMalloc((void **)&j.ws.d_out, sizeof(float) * DSV4_CUDA_MAX_BATCH * 6 * D));
        j.run = run_experts;
        j.x = x;
        j.y = y;
        j.idx = idx;
        j.w = a1;
        for (int b = 0; b < nb; b++) {
            bool used[256] = { false };
            int distinct = 0;
            for (int t = 0; t < batches[b]; t++)
                for (int k = 0; k < topk; k++) {
                    int e;
                    bool dup;
                    do {    /* distinct experts within a token */
                        e = (int)(next_u64() % E);
                        dup = false;
                        for (int q = 0; q < k; q++)
                            dup |= hidx[t * topk + q] == e;
                    } while (dup);
                    hidx[t * topk + k] = e;
                    hw[t * topk + k] = 0.25f;
                    distinct += !used[e];
                    used[e] = true;
                }
            TRY(cudaMemcpy(idx, hidx, sizeof(int32_t) * batches[b] * topk, cudaMemcpyHostToDevice));
            TRY(cudaMemcpy(a1, hw, sizeof(float) * batches[b] * topk, cudaMemcpyHostToDevice));
            j.batch = batches[b];
            /* one launch set re-reads the same experts: few repetitions, the L2 (60 MB) holds at most
             * ~14 experts, so at batch 64 (about 200 distinct) this is an HBM number; at batch 1 the 6
             * experts (25 MB) may stay in L2 between repetitions: reported as such. */
            char what[64];
            snprintf(what, sizeof(what), "experts fp4 top-6 (%d distinct)", distinct);
            report(what, batches[b], time_job(&j, reps), (double)distinct * per + (double)batches[b] * 4 * D * 2);
        }
        cudaFree(blob);
        cudaFree((void *)j.ex[0].d_table);
        cudaFree(j.ws.d_groups);
        cudaFree(j.ws.d_h);
        cudaFree(j.ws.d_out);
        free(tab);
    }

    for (int b = 0; b < nb; b++) {
        const double B = batches[b];
        memset(&j, 0, sizeof(j));
        j.x = x;
        j.y = y;
        j.w = w;
        j.idx = idx;
        j.aux1 = a1;
        j.aux2 = a2;
        j.aux3 = a3;
        j.batch = batches[b];
        j.run = run_roundtrip;
        report("act quant 1x128 [B,4096]", batches[b], time_job(&j, reps), B * 4096 * 8);
        j.run = run_rmsnorm;
        report("rmsnorm [B,4096]", batches[b], time_job(&j, reps), B * 4096 * 8 + 4096 * 4);
        j.run = run_router;
        report("router sqrtsoftplus top-6 [B,256]", batches[b], time_job(&j, reps), B * 256 * 4 + 256 * 4 + B * 48);
        j.run = run_mhc_pre;
        report("mhc pre hc=4 [B,4,4096]", batches[b], time_job(&j, reps), B * (4 * 4096 + 4096 + 24 + 24) * 4);
        j.run = run_mhc_post;
        report("mhc post hc=4 [B,4,4096]", batches[b], time_job(&j, reps), B * (2 * 4 * 4096 + 4096 + 20) * 4);
    }
    bench_big_gemms();
    printf("# the whole decode step: dsv4-bench --model DIR (a dsv4-mkckpt checkpoint) --batch 1,16,64\n");
    return 0;
}
