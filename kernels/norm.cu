/* SPDX-License-Identifier: MIT */
/* RMSNorm, alone or followed by RoPE (a token's query heads, its kv). Twin: dsv4_twin_rmsnorm
 * (engine/cpu/cpu_twin_cuda.c) and engine/cpu/cpu_rope.c. */
#include "kernels/cuda_util.cuh"
#include "kernels/norm_row.cuh"
#include "kernels/pending.cuh"

/* One block per row. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_kernel(const float *__restrict__ x, const float *__restrict__ w, int n, float eps,
               float *__restrict__ y)
{
    dsv4_pdl_enter();
    rmsnorm_row(x + (int64_t)blockIdx.x * n, w, n, eps, y + (int64_t)blockIdx.x * n);
}

extern "C" int dsv4_cuda_rmsnorm(const float *d_x, const float *d_w, int rows, int n, float eps, float *d_y,
                                 void *stream)
{
    if (rows < 1)
        return 0;
    dsv4_launch(rmsnorm_kernel, rows, NORM_THREADS, 0, static_cast<cudaStream_t>(stream), d_x, d_w, n, eps, d_y);
    DSV4_CUDA_LAUNCHED("rmsnorm");
    return 0;
}

/* One block per row: rmsnorm_row, then RoPE on the row's last rd values at
 * pos[row / heads] (the pairs read the normalized values every thread has written by then). x and y
 * may be the same buffer. With px pending, the row's sum goes to y first and is normalized there in
 * place: each thread writes the values rmsnorm_row then reads (columns t + NORM_THREADS j), so no
 * barrier is needed between. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_rope_kernel(const float *x, const dsv4_cuda_pending px, const float *__restrict__ w, int n, float eps,
                    int heads, int rd, const int32_t *__restrict__ pos, const float *__restrict__ inv_freq, float *y)
{
    dsv4_pdl_enter();
    float *yr = y + (int64_t)blockIdx.x * n;
    if (px.splits) {
        for (int i = threadIdx.x; i < n; i += NORM_THREADS)
            yr[i] = pending_at(px, nullptr, (int64_t)blockIdx.x * n + i);
        x = y;
    }
    rmsnorm_row(x + (int64_t)blockIdx.x * n, w, n, eps, yr);
    __syncthreads();
    const int p0 = pos[blockIdx.x / heads];
    for (int i = threadIdx.x; i < rd / 2; i += NORM_THREADS)
        dsv4_rope_pair(&yr[n - rd + 2 * i], &yr[n - rd + 2 * i + 1], inv_freq[i], p0, false);
}

extern "C" int dsv4_cuda_rmsnorm_rope(const float *d_x, const struct dsv4_cuda_pending *d_px, const float *d_w,
                                      int rows, int n, float eps, int heads, int rd, const int32_t *d_pos,
                                      const float *d_inv_freq, float *d_y, void *stream)
{
    int rc;
    if (heads < 1 || rd < 0 || rd % 2 || rd > n)
        return dsv4_error_set(-EINVAL, "rmsnorm_rope: %d heads, rope dims %d of %d (even, at most the row)", heads, rd,
                              n);
    if ((rc = dsv4_cuda_pending_live(d_px, rows, n, "rmsnorm_rope")) < 0)
        return rc;
    if (rows < 1)
        return 0;
    dsv4_launch(rmsnorm_rope_kernel, rows, NORM_THREADS, 0, static_cast<cudaStream_t>(stream), d_x,
                pending_or_none(d_px), d_w, n, eps, heads, rd, d_pos, d_inv_freq, d_y);
    DSV4_CUDA_LAUNCHED("rmsnorm_rope");
    return 0;
}
