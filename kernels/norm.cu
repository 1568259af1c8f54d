/* RMSNorm and the manifold-constrained hyper-connections (mHC) around each sublayer.
 * Twins: dsv4_twin_rmsnorm, dsv4_twin_mhc_pre, dsv4_twin_mhc_post (engine/cpu_twin_cuda.c). */
#include "kernels/cuda_util.cuh"

#define NORM_THREADS 256

/* Block-wide sum over NORM_THREADS threads; every thread gets the result. */
static __device__ float block_sum(float v)
{
    __shared__ float part[NORM_THREADS / DSV4_CUDA_WARP];
    const int lane = threadIdx.x % DSV4_CUDA_WARP, warp = threadIdx.x / DSV4_CUDA_WARP;
    v = dsv4_warp_sum(v);
    __syncthreads();            /* part[] may still be read by a previous call */
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    v = lane < NORM_THREADS / DSV4_CUDA_WARP ? part[lane] : 0.0f;
    return dsv4_warp_sum(v);
}

/* One block per row. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_kernel(const float *__restrict__ x, const float *__restrict__ w, int n, float eps,
               float *__restrict__ y)
{
    const float *xr = x + (int64_t)blockIdx.x * n;
    float *yr = y + (int64_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS)
        ss += xr[i] * xr[i];
    const float r = 1.0f / sqrtf(block_sum(ss) / n + eps);
    for (int i = threadIdx.x; i < n; i += NORM_THREADS)
        yr[i] = (w ? w[i] : 1.0f) * (xr[i] * r);
}

extern "C" int dsv4_cuda_rmsnorm(const float *d_x, const float *d_w, int rows, int n, float eps, float *d_y,
                                 void *stream)
{
    if (rows < 1)
        return 0;
    rmsnorm_kernel<<<rows, NORM_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(d_x, d_w, n, eps, d_y);
    DSV4_CUDA_LAUNCHED("rmsnorm");
    return 0;
}

static __device__ __forceinline__ float sigmoidf_(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

/* One block per token: the streams' RMS, pre/post gates, the combine matrix through Sinkhorn (one
 * thread: hc x hc is 16 values), then y = sum_j pre_j X[j] across the block. */
__global__ void __launch_bounds__(NORM_THREADS)
mhc_pre_kernel(const float *__restrict__ X, const float *__restrict__ m, const float *__restrict__ base,
               const float *__restrict__ scale, int hc, int dim, int iters, float hc_eps, float norm_eps,
               float *__restrict__ y, float *__restrict__ post, float *__restrict__ comb)
{
    __shared__ float pre[DSV4_MAX_HC], C[DSV4_MAX_HC * DSV4_MAX_HC];
    const int b = blockIdx.x;
    const float *Xb = X + (int64_t)b * hc * dim, *mb = m + (int64_t)b * (2 + hc) * hc;
    float ss = 0.0f;

    for (int i = threadIdx.x; i < hc * dim; i += NORM_THREADS)
        ss += Xb[i] * Xb[i];
    const float r = 1.0f / sqrtf(block_sum(ss) / (hc * dim) + norm_eps);
    if (threadIdx.x == 0) {
        for (int j = 0; j < hc; j++) {
            pre[j] = sigmoidf_(mb[j] * r * scale[0] + base[j]) + hc_eps;
            post[b * hc + j] = 2.0f * sigmoidf_(mb[hc + j] * r * scale[1] + base[hc + j]);
        }
        for (int j = 0; j < hc; j++) {
            float mx = -INFINITY, sum = 0.0f;
            for (int k = 0; k < hc; k++) {
                C[j * hc + k] = mb[2 * hc + j * hc + k] * r * scale[2] + base[2 * hc + j * hc + k];
                mx = fmaxf(mx, C[j * hc + k]);
            }
            for (int k = 0; k < hc; k++) {
                C[j * hc + k] = expf(C[j * hc + k] - mx);
                sum += C[j * hc + k];
            }
            for (int k = 0; k < hc; k++)
                C[j * hc + k] = C[j * hc + k] / sum + hc_eps;
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0)
                for (int j = 0; j < hc; j++) {
                    float s = 0.0f;
                    for (int k = 0; k < hc; k++)
                        s += C[j * hc + k];
                    for (int k = 0; k < hc; k++)
                        C[j * hc + k] /= s + hc_eps;
                }
            for (int k = 0; k < hc; k++) {
                float s = 0.0f;
                for (int j = 0; j < hc; j++)
                    s += C[j * hc + k];
                for (int j = 0; j < hc; j++)
                    C[j * hc + k] /= s + hc_eps;
            }
        }
        for (int i = 0; i < hc * hc; i++)
            comb[(int64_t)b * hc * hc + i] = C[i];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += NORM_THREADS) {
        float acc = 0.0f;
        for (int j = 0; j < hc; j++)
            acc += pre[j] * Xb[(int64_t)j * dim + d];
        y[(int64_t)b * dim + d] = acc;
    }
}

extern "C" int dsv4_cuda_mhc_pre(const float *d_X, const float *d_m, const float *d_base, const float *d_scale,
                                 int batch, int hc, int dim, int iters, float hc_eps, float norm_eps,
                                 float *d_y, float *d_post, float *d_comb, void *stream)
{
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "mhc_pre: hc_mult %d outside 1..%d", hc, DSV4_MAX_HC);
    if (batch < 1)
        return 0;
    mhc_pre_kernel<<<batch, NORM_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
        d_X, d_m, d_base, d_scale, hc, dim, iters, hc_eps, norm_eps, d_y, d_post, d_comb);
    DSV4_CUDA_LAUNCHED("mhc_pre");
    return 0;
}

/* One thread per output value Xo[b, k, d]. */
__global__ void mhc_post_kernel(const float *__restrict__ X, const float *__restrict__ f,
                                const float *__restrict__ post, const float *__restrict__ comb, int batch,
                                int hc, int dim, float *__restrict__ Xo)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)batch * hc * dim)
        return;
    const int64_t d = i % dim, k = i / dim % hc, b = i / ((int64_t)hc * dim);
    const float *Xb = X + b * hc * dim, *cb = comb + b * hc * hc;
    float acc = post[b * hc + k] * f[b * dim + d];
    for (int j = 0; j < hc; j++)
        acc += cb[j * hc + k] * Xb[(int64_t)j * dim + d];
    Xo[i] = acc;
}

extern "C" int dsv4_cuda_mhc_post(const float *d_X, const float *d_f, const float *d_post, const float *d_comb,
                                  int batch, int hc, int dim, float *d_Xo, void *stream)
{
    const int threads = 256;
    const int64_t total = (int64_t)batch * hc * dim;
    if (hc < 1 || hc > DSV4_MAX_HC)
        return dsv4_error_set(-EINVAL, "mhc_post: hc_mult %d outside 1..%d", hc, DSV4_MAX_HC);
    if (total <= 0)
        return 0;
    mhc_post_kernel<<<(unsigned)((total + threads - 1) / threads), threads, 0, static_cast<cudaStream_t>(stream)>>>(
        d_X, d_f, d_post, d_comb, batch, hc, dim, d_Xo);
    DSV4_CUDA_LAUNCHED("mhc_post");
    return 0;
}
