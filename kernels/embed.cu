/* SPDX-License-Identifier: MIT */
/* The embedding: row token_b of the table, dequantized from its checkpoint format, copied into
 * each of the hc residual streams. Checked through the whole decode step (tests/gpu/test_gpu_step.c). */
#include "kernels/cuda_util.cuh"
#include "kernels/kernels_internal.h"

/* grid (B), block 256: row token_b of E dequantized into every stream. */
template <typename WF>
__global__ void embed_kernel(const struct dsv4_cuda_linear E, const int32_t *tokens, int hc, float *X)
{
    dsv4_pdl_enter();
    const int b = blockIdx.x;
    const int64_t tok = tokens[b];
    const uint8_t *row = static_cast<const uint8_t *>(E.w) + tok * wrow_bytes<WF>(E.row_stride);
    for (int64_t k = threadIdx.x; k < E.in; k += blockDim.x) {
        float v;
        if constexpr (WF::vals == wf_f32::vals)
            v = reinterpret_cast<const float *>(row)[k];
        else if constexpr (WF::vals == wf_bf16::vals)
            v = __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(row)[k] << 16);
        else if constexpr (WF::vals == wf_fp8::vals) {
            __half_raw h = __nv_cvt_fp8_to_halfraw(row[k], __NV_E4M3);
            v = __half2float(*reinterpret_cast<__half *>(&h)) * wscale<WF>(E, tok, k);
        } else
            v = dsv4_e2m1(row[k / 2] >> (4 * (k & 1))) * wscale<WF>(E, tok, k);
        for (int j = 0; j < hc; j++)
            X[((int64_t)b * hc + j) * E.in + k] = v;
    }
}

int dsv4_cuda_embed(const struct dsv4_cuda_linear *E, const int32_t *d_tokens, int batch, int hc, float *d_X,
                    void *stream)
{
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (batch < 1)
        return 0;
    switch (E->fmt) {
    case DSV4_W_F32:
        dsv4_launch(embed_kernel<wf_f32>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    case DSV4_W_BF16:
        dsv4_launch(embed_kernel<wf_bf16>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    case DSV4_W_FP8:
        dsv4_launch(embed_kernel<wf_fp8>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    case DSV4_W_FP4:
        dsv4_launch(embed_kernel<wf_fp4>, batch, 256, 0, s, *E, d_tokens, hc, d_X);
        break;
    default: return dsv4_error_set(-ENOTSUP, "embed: weight format %d has no CUDA kernel", (int)E->fmt);
    }
    DSV4_CUDA_LAUNCHED("embed");
    return 0;
}
