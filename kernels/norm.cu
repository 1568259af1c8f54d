/* SPDX-License-Identifier: MIT */
/* RMSNorm, alone or followed by RoPE (a token's query heads, its kv). Twin: dsv4_twin_rmsnorm
 * (engine/cpu/cpu_twin_cuda.c) and engine/cpu/cpu_rope.c. */
#include "kernels/cuda_util.cuh"
#include "kernels/norm_row.cuh"

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

/* A row by the whole block: rmsnorm_row, then RoPE on the row's last rd values at position p0 (the
 * pairs read the normalized values every thread has written by then). xr may equal yr. */
static __device__ __forceinline__ void norm_rope_row(const float *xr, const float *w, int n, float eps, int rd,
                                                     int p0, const float *__restrict__ inv_freq, float *yr)
{
    rmsnorm_row(xr, w, n, eps, yr);
    __syncthreads();
    for (int i = threadIdx.x; i < rd / 2; i += NORM_THREADS)
        dsv4_rope_pair(&yr[n - rd + 2 * i], &yr[n - rd + 2 * i + 1], inv_freq[i], p0, false);
}

/* One block per row, at pos[row / heads]. x and y may be the same buffer. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_rope_kernel(const float *x, const float *__restrict__ w, int n, float eps, int heads, int rd,
                    const int32_t *__restrict__ pos, const float *__restrict__ inv_freq, float *y)
{
    dsv4_pdl_enter();
    const int64_t r = blockIdx.x;
    norm_rope_row(x + r * n, w, n, eps, rd, pos[r / heads], inv_freq, y + r * n);
}

/* Blocks [0, q_rows): the query heads in place, unweighted, at pos[row / heads]; blocks from
 * q_rows on: the kv rows in place with weight kv_w, at pos[row]. rmsnorm_rope_kernel's rows. */
__global__ void __launch_bounds__(NORM_THREADS)
qkv_norm_rope_kernel(float *q, int q_rows, int heads, float *kv, const float *__restrict__ kv_w, int n, float eps,
                     int rd, const int32_t *__restrict__ pos, const float *__restrict__ inv_freq)
{
    dsv4_pdl_enter();
    const int64_t r = blockIdx.x;
    if (r < q_rows)
        norm_rope_row(q + r * n, NULL, n, eps, rd, pos[r / heads], inv_freq, q + r * n);
    else
        norm_rope_row(kv + (r - q_rows) * n, kv_w, n, eps, rd, pos[r - q_rows], inv_freq, kv + (r - q_rows) * n);
}

extern "C" int dsv4_cuda_rmsnorm_rope(const float *d_x, const float *d_w, int rows, int n, float eps, int heads,
                                      int rd, const int32_t *d_pos, const float *d_inv_freq, float *d_y, void *stream)
{
    if (heads < 1 || rd < 0 || rd % 2 || rd > n)
        return dsv4_error_set(-EINVAL, "rmsnorm_rope: %d heads, rope dims %d of %d (even, at most the row)", heads, rd,
                              n);
    if (rows < 1)
        return 0;
    dsv4_launch(rmsnorm_rope_kernel, rows, NORM_THREADS, 0, static_cast<cudaStream_t>(stream), d_x, d_w, n, eps,
                heads, rd, d_pos, d_inv_freq, d_y);
    DSV4_CUDA_LAUNCHED("rmsnorm_rope");
    return 0;
}

extern "C" int dsv4_cuda_qkv_norm_rope(float *d_q, int heads, float *d_kv, const float *d_kv_w, int tokens, int n,
                                       float eps, int rd, const int32_t *d_pos, const float *d_inv_freq, void *stream)
{
    if (heads < 1 || rd < 0 || rd % 2 || rd > n)
        return dsv4_error_set(-EINVAL, "qkv_norm_rope: %d heads, rope dims %d of %d (even, at most the row)", heads,
                              rd, n);
    if (tokens < 1)
        return 0;
    dsv4_launch(qkv_norm_rope_kernel, tokens * (heads + 1), NORM_THREADS, 0, static_cast<cudaStream_t>(stream), d_q,
                tokens * heads, heads, d_kv, d_kv_w, n, eps, rd, d_pos, d_inv_freq);
    DSV4_CUDA_LAUNCHED("qkv_norm_rope");
    return 0;
}
