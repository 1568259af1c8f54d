/* SPDX-License-Identifier: MIT */
/* Speculative decoding's small kernels (the step's use of them: kernels/step.cu): the MTP block's
 * input streams gathered from the step's rows or the slot's ring of the main model's last streams,
 * that ring's update, the broadcast add of the block's token projection, the greedy pick of a draft,
 * and the save/restore of the compressors' ring rows around a verify. */
#include "engine/backend.h"
#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"

#define SPEC_THREADS 256
#define SPEC_ARGMAX_THREADS 1024

/* Row i's streams of MTP position m = mpos[i] (mslot[i] the padding slot: zeros): the step's row
 * i - 1 when it is the main model's row at m of the same slot (step_rows), else the slot's ring entry
 * m % ring. H [B, hcD]. */
__global__ void __launch_bounds__(SPEC_THREADS)
spec_gather_kernel(const struct dsv4_cuda_spec_rows a, const float *__restrict__ X, float *__restrict__ H)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x, sl = a.mslot[i], m = a.mpos[i];
    float *dst = H + (int64_t)i * a.hcD;
    const float *src = nullptr;
    if (sl != a.pad_slot) {
        if (a.step_slot && i > 0 && a.step_slot[i - 1] == sl && a.step_pos[i - 1] == m)
            src = X + (int64_t)(i - 1) * a.hcD;
        else
            src = reinterpret_cast<const float *>(a.caches + (int64_t)sl * a.slot_bytes + a.ring_off) +
                  (int64_t)(m % a.ring) * a.hcD;
    }
    for (int64_t k = threadIdx.x; k < a.hcD; k += SPEC_THREADS)
        dst[k] = src ? src[k] : 0.0f;
}

/* The main model's output streams X [B, hcD] of each row into its slot's ring at pos % ring; of a
 * run longer than the ring only its last `ring` rows (the others would be overwritten). */
__global__ void __launch_bounds__(SPEC_THREADS)
spec_ring_save_kernel(const struct dsv4_cuda_spec_rows a, const int32_t *__restrict__ last, const float *__restrict__ X)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x, pos = a.step_pos[i];
    if (pos <= last[i] - a.ring)
        return;
    float *dst = reinterpret_cast<float *>(a.caches + (int64_t)a.step_slot[i] * a.slot_bytes + a.ring_off) +
                 (int64_t)(pos % a.ring) * a.hcD;
    const float *src = X + (int64_t)i * a.hcD;
    for (int64_t k = threadIdx.x; k < a.hcD; k += SPEC_THREADS)
        dst[k] = src[k];
}

/* X [B, hc, D] += e [B, D] on every stream (the block's input: h_proj of the streams plus e_proj of
 * the token, one rounding). */
__global__ void __launch_bounds__(SPEC_THREADS)
spec_add_kernel(float *__restrict__ X, const float *__restrict__ e, int hc, int dim)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x;
    const float *er = e + (int64_t)i * dim;
    float *xr = X + (int64_t)i * hc * dim;
    for (int k = threadIdx.x; k < hc * dim; k += SPEC_THREADS)
        xr[k] = xr[k] + er[k % dim];
}

/* out[i] = the largest logit of row i, the lowest id on ties (the sampler's temperature 0). */
__global__ void __launch_bounds__(SPEC_ARGMAX_THREADS)
spec_argmax_kernel(const float *__restrict__ logits, int V, int32_t *__restrict__ out)
{
    dsv4_pdl_enter();
    __shared__ float bv_s[SPEC_ARGMAX_THREADS / DSV4_CUDA_WARP];
    __shared__ int bi_s[SPEC_ARGMAX_THREADS / DSV4_CUDA_WARP];
    const float *row = logits + (int64_t)blockIdx.x * V;
    float bv = -INFINITY;
    int bi = V;
    for (int v = threadIdx.x; v < V; v += SPEC_ARGMAX_THREADS)
        if (row[v] > bv || bi == V) {   /* ascending: a tie keeps the lower id */
            bv = row[v];
            bi = v;
        }
    for (int o = DSV4_CUDA_WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    if (lane == 0) {
        bv_s[warp] = bv;
        bi_s[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SPEC_ARGMAX_THREADS / DSV4_CUDA_WARP; w++)
            if (bv_s[w] > bv_s[0] || (bv_s[w] == bv_s[0] && bi_s[w] < bi_s[0])) {
                bv_s[0] = bv_s[w];
                bi_s[0] = bi_s[w];
            }
        out[blockIdx.x] = bi_s[0] < V ? bi_s[0] : 0;    /* a row of NaNs: id 0, a draft that fails */
    }
}

/* in[i] = src[i] for i < n (a later draft's tokens: the previous draft's picks). */
__global__ void spec_tokens_kernel(const int32_t *__restrict__ src, int n, int32_t *__restrict__ in)
{
    dsv4_pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        in[i] = src[i];
}

/* Block c: compressor c's ring rows of positions P + j, j in [j0, j1), between the slot's state and
 * its save area (row j of the area), kv then gate; save or restore. */
__global__ void __launch_bounds__(SPEC_THREADS)
spec_comp_copy_kernel(const struct dsv4_cuda_spec_comp *comp, uint8_t *slot_base, int64_t P, int j0, int j1, bool save)
{
    dsv4_pdl_enter();
    const struct dsv4_cuda_spec_comp c = comp[blockIdx.x];
    float *st = reinterpret_cast<float *>(slot_base + c.state), *sv = reinterpret_cast<float *>(slot_base + c.save);
    for (int j = j0; j < j1; j++) {
        const int64_t idx = (P + j) % c.ring;
        for (int half = 0; half < 2; half++) {  /* kv rows, then gate rows */
            float *s = st + ((int64_t)half * c.ring + idx) * c.width;
            float *v = sv + ((int64_t)j * 2 + half) * c.width;     /* the area: [rows, kv | gate, width] */
            for (int k = threadIdx.x; k < c.width; k += SPEC_THREADS) {
                if (save)
                    v[k] = s[k];
                else
                    s[k] = v[k];
            }
        }
    }
}

int dsv4_cuda_spec_gather(const struct dsv4_cuda_spec_rows *a, int batch, const float *d_X, float *d_H,
                          void *stream)
{
    dsv4_launch(spec_gather_kernel, batch, SPEC_THREADS, 0, static_cast<cudaStream_t>(stream), *a, d_X, d_H);
    DSV4_CUDA_LAUNCHED("spec_gather");
    return 0;
}

int dsv4_cuda_spec_ring_save(const struct dsv4_cuda_spec_rows *a, const int32_t *d_last, int batch,
                             const float *d_X, void *stream)
{
    dsv4_launch(spec_ring_save_kernel, batch, SPEC_THREADS, 0, static_cast<cudaStream_t>(stream), *a, d_last, d_X);
    DSV4_CUDA_LAUNCHED("spec_ring_save");
    return 0;
}

int dsv4_cuda_spec_add(float *d_X, const float *d_e, int batch, int hc, int dim, void *stream)
{
    dsv4_launch(spec_add_kernel, batch, SPEC_THREADS, 0, static_cast<cudaStream_t>(stream), d_X, d_e, hc, dim);
    DSV4_CUDA_LAUNCHED("spec_add");
    return 0;
}

int dsv4_cuda_spec_argmax(const float *d_logits, int batch, int V, int32_t *d_out, void *stream)
{
    dsv4_launch(spec_argmax_kernel, batch, SPEC_ARGMAX_THREADS, 0, static_cast<cudaStream_t>(stream), d_logits, V,
                d_out);
    DSV4_CUDA_LAUNCHED("spec_argmax");
    return 0;
}

int dsv4_cuda_spec_tokens(const int32_t *d_src, int n, int32_t *d_in, void *stream)
{
    dsv4_launch(spec_tokens_kernel, (n + SPEC_THREADS - 1) / SPEC_THREADS, SPEC_THREADS, 0,
                static_cast<cudaStream_t>(stream), d_src, n, d_in);
    DSV4_CUDA_LAUNCHED("spec_tokens");
    return 0;
}

int dsv4_cuda_spec_comp_copy(const struct dsv4_cuda_spec_comp *d_comp, int n_comp, uint8_t *d_slot_base,
                             int64_t P, int j0, int j1, bool save, void *stream)
{
    if (n_comp < 1 || j0 >= j1)
        return 0;
    if (j0 < 0 || j1 > DSV4_SPEC_TOKENS_MAX + 1)
        return dsv4_error_set(-EINVAL, "spec: compressor rows %d..%d outside a verify's %d", j0, j1,
                              DSV4_SPEC_TOKENS_MAX + 1);
    dsv4_launch(spec_comp_copy_kernel, n_comp, SPEC_THREADS, 0, static_cast<cudaStream_t>(stream), d_comp, d_slot_base,
                P, j0, j1, save);
    DSV4_CUDA_LAUNCHED("spec_comp_copy");
    return 0;
}
