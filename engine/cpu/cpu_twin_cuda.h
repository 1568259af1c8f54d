/* SPDX-License-Identifier: MIT */
/* CPU twins of the CUDA kernels that the reference backend does not expose as functions of their
 * own: plain scalar C, fp32 accumulation in index order, written from doc/MODEL.md §2-3.
 *
 * What each kernel in kernels/ is checked against (tests/gpu, fresh random inputs), stated here once:
 *   - linears (GEMV, GEMM, the FP8 activation quantizer), router, routed experts, RMSNorm, mHC
 *     fn/pre/post: the twins below (test_gpu_linear, test_gpu_moe, test_gpu_norm, test_gpu_device).
 *     Their number formats are a second implementation kept apart from engine/model/quant.c, and
 *     test_cpu_twin checks them against it on every code, and the matvec against engine/model/linear.c;
 *   - the KV entry and indexer-key codecs of the official numerics: engine/model/quant.c, bit for bit
 *     (test_gpu_codec);
 *   - RoPE: engine/cpu/cpu_rope.c (test_gpu_norm); sampling: engine/serve/sampler.c (test_gpu_sample);
 *   - attention and the indexer's scores and top-k: a double-precision reference in their tests
 *     (test_gpu_attention, test_gpu_indexer);
 *   - everything else (compressors, hc_head, embedding) and the ops together: the CPU reference
 *     backend, engine/cpu/, through the whole decode step and serving (test_gpu_step, test_gpu_serve).
 * Built for the tests only (engine/cpu/local.mk): dsv4d does not carry them. */
#ifndef DSV4_ENGINE_CPU_TWIN_CUDA_H
#define DSV4_ENGINE_CPU_TWIN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/weights.h"

#define DSV4_TWIN_E4M3_MAX 448.0f
#define DSV4_TWIN_E2M1_MAX 6.0f

/* Number formats, exact (no tables). */
float dsv4_twin_e4m3_to_f32(uint8_t v);
uint8_t dsv4_twin_f32_to_e4m3(float f);         /* round to nearest even, saturate to +-448 */
float dsv4_twin_e2m1_to_f32(uint8_t nibble);
uint8_t dsv4_twin_f32_to_e2m1(float f);         /* round to nearest even, saturate to +-6 */
float dsv4_twin_bf16_to_f32(uint16_t v);
uint16_t dsv4_twin_f32_to_bf16(float f);        /* round to nearest even */
/* UE8M0 exponent of the power of two at or above max(amax, 1e-4) / fmt_max (the official "round up"). */
uint8_t dsv4_twin_ue8m0_for(float amax, float fmt_max);

/* x <- dq(q(x)) through e4m3 in 1x`block` groups, each with its UE8M0 scale (a short last group
 * has its own). */
void dsv4_twin_fp8_roundtrip(float *x, size_t n, size_t block);

/* Row r of W dequantized into out[W->in]. */
void dsv4_twin_linear_row(const struct dsv4_linear *W, int64_t r, float *out);
/* y[out] = W x, dequantizing W on the fly (F32, BF16, FP8 128x128, FP4 1x32). */
void dsv4_twin_linear_matvec(const struct dsv4_linear *W, const float *x, float *y);

void dsv4_twin_rmsnorm(const float *x, const float *w, int n, float eps, float *y);

/* One token's router: logits [E]; bias NULL with tid2eid_row non-NULL for hash layers. */
void dsv4_twin_router(const float *logits, int n_experts, int topk, const float *bias,
                      const int32_t *tid2eid_row, float route_scale, int32_t *idx, float *w);

/* One expert on an FP8-rounded x: y[D] = w2(fp8(silu(min(w1 x, L)) * clamp(w3 x, -L, L))). */
void dsv4_twin_expert(const struct dsv4_linear *w1, const struct dsv4_linear *w3,
                      const struct dsv4_linear *w2, const float *x, float limit, float *y);

/* Expert parallelism's two steps around the routed experts (kernels/ep.cu): idx[i] = -1 where it is
 * outside [e0, e1); g [ranks, pairs, dim]: pair p's row of block 0 becomes that of the first rank r
 * with idx[p] < e1[r] (the rank holding its expert), in place. */
void dsv4_twin_ep_mask(int32_t *idx, int n, int e0, int e1);
void dsv4_twin_ep_select(float *g, const int32_t *idx, int ranks, const int *e1, int pairs, int64_t dim);

/* mHC pre for one token: X [hc, D], m [(2+hc)*hc] = fn @ flatten(X) (not yet normalized).
 * y [D], post [hc], comb [hc, hc] (row j, column k: C[j,k]). */
void dsv4_twin_mhc_pre(const float *X, const float *m, const float *base, const float *scale,
                       int hc, int dim, int iters, float hc_eps, float norm_eps,
                       float *y, float *post, float *comb);
/* mHC post for one token: Xo[k] = post_k * f + sum_j comb[j,k] X[j]. */
void dsv4_twin_mhc_post(const float *X, const float *f, const float *post, const float *comb,
                        int hc, int dim, float *Xo);

#endif
