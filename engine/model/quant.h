/* SPDX-License-Identifier: MIT */
/* Number formats of the checkpoints and caches: bf16, f16, FP8 e4m3fn, UE8M0 scales, FP4 e2m1, and
 * the activation/cache quantizers of the official numerics. Scalar, exact and table-free where
 * possible, so that any other implementation can be checked against them (engine/cpu/cpu_twin_cuda.h
 * says which CUDA kernels are). */
#ifndef DSV4_ENGINE_MODEL_QUANT_H
#define DSV4_ENGINE_MODEL_QUANT_H

#include <stddef.h>
#include <stdint.h>

float dsv4_bf16_to_f32(uint16_t v);
uint16_t dsv4_f32_to_bf16(float f);         /* round to nearest even; NaN stays NaN */
float dsv4_f16_to_f32(uint16_t v);
float dsv4_e4m3_to_f32(uint8_t v);          /* e4m3fn: no inf, 0x7f/0xff NaN, subnormals */
uint8_t dsv4_f32_to_e4m3(float f);          /* round to nearest even, saturate to +-448 */
float dsv4_e8m0_to_f32(uint8_t e);          /* 2^(e-127); 0xff is NaN */
float dsv4_e2m1_to_f32(uint8_t nibble);     /* low 4 bits: sign, 2 exponent, 1 mantissa */
uint8_t dsv4_f32_to_e2m1(float f);          /* round to nearest even, saturate to +-6; NaN -> +0 */

/* Smallest power-of-two scale s with amax/s <= fmt_max, amax floored at 1e-4 (the official
 * activation quantizer's "round up"). Returns the UE8M0 exponent byte. */
uint8_t dsv4_ue8m0_scale_for(float amax, float fmt_max);

/* Round x[n] through FP8 e4m3 in blocks of `block` values, each with a UE8M0 scale: x <- dq(q(x)).
 * This is the official cache numerics (block 64) and activation quantization (block 128). */
void dsv4_fp8_roundtrip(float *x, size_t n, size_t block);
/* Same through FP4 e2m1 (max 6) in blocks of `block` (32); amax floored at 6 * 2^-126 (the official
 * FP4 quantizer), not 1e-4. */
void dsv4_fp4_roundtrip(float *x, size_t n, size_t block);

/* In-place fast Walsh-Hadamard transform of n (power of two) values, scaled by 1/sqrt(n). */
void dsv4_hadamard(float *x, size_t n);

#endif
