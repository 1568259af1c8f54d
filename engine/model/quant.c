/* SPDX-License-Identifier: MIT */
/* Scalar number formats: exact bit-level conversions, no lookup tables (quant.h; what the CUDA
 * kernels are checked against: engine/cpu/cpu_twin_cuda.h). */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/model/quant.h"

#define E4M3_MAX 448.0f
#define E2M1_MAX 6.0f
#define UE8M0_AMAX_FLOOR 1e-4f      /* the official FP8 quantizer never divides by a smaller amax */
/* The official FP4 quantizer floors amax at the smallest amax whose scale amax/6 is a normal float,
 * so FP4 blocks of tiny values keep their resolution (FP8's 1e-4 floor would zero them). */
#define E2M1_AMAX_FLOOR (6.0f * 0x1p-126f)

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

float dsv4_bf16_to_f32(uint16_t v)
{
    return bits_f32((uint32_t)v << 16);
}

uint16_t dsv4_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);

    if (isnan(f))   /* keep sign and payload top bits, force a quiet NaN so it cannot become inf */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* round to nearest, ties to even: add 0x7fff plus the lowest kept bit; carries into the
     * exponent give the correctly rounded (possibly infinite) result */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float dsv4_f16_to_f32(uint16_t v)
{
    uint32_t sign = (uint32_t)(v & 0x8000u) << 16;
    int e = (v >> 10) & 0x1f;
    int m = v & 0x3ff;
    float mag;

    if (e == 0x1f)
        mag = m ? NAN : INFINITY;
    else if (e == 0)
        mag = ldexpf((float)m, -24);                    /* subnormal: m * 2^-14 / 1024 */
    else
        mag = ldexpf((float)(m | 0x400), e - 25);       /* (1024 + m) * 2^(e-15-10) */
    return bits_f32(f32_bits(mag) | sign);
}

/* e4m3fn: bias 7, no infinities; S.1111.111 is NaN, so the largest finite value is 1.75 * 2^8. */
float dsv4_e4m3_to_f32(uint8_t v)
{
    int e = (v >> 3) & 0xf;
    int m = v & 0x7;
    float mag;

    if (e == 0xf && m == 0x7)
        mag = NAN;
    else if (e == 0)
        mag = ldexpf((float)m, -9);                     /* subnormal: m/8 * 2^-6 */
    else
        mag = ldexpf((float)(m | 0x8), e - 10);         /* (8 + m)/8 * 2^(e-7) */
    return (v & 0x80) ? -mag : mag;
}

uint8_t dsv4_f32_to_e4m3(float f)
{
    uint8_t sign = signbit(f) ? 0x80 : 0x00;
    float a = fabsf(f);
    int ex, code;

    if (isnan(f))
        return sign | 0x7f;
    if (a >= E4M3_MAX)                  /* saturating cast (inf included) */
        return sign | 0x7e;
    if (a < 0x1p-6f) {
        /* subnormal grid, step 2^-9; a rounding up to 8 steps lands exactly on code 0x08,
         * the smallest normal, so the code is the step count either way */
        code = (int)rintf(a * 0x1p9f);
        return sign | (uint8_t)code;
    }
    frexpf(a, &ex);                     /* a in [2^(ex-1), 2^ex) */
    ex -= 1;
    code = (int)rintf(ldexpf(a, 3 - ex));   /* 8..16: the significand with 3 fraction bits */
    if (code == 16) {
        code = 8;
        ex += 1;
    }
    code = ((ex + 7) << 3) | (code - 8);
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

float dsv4_e8m0_to_f32(uint8_t e)
{
    if (e == 0xff)
        return NAN;
    return ldexpf(1.0f, (int)e - 127);
}

float dsv4_e2m1_to_f32(uint8_t nibble)
{
    int e = (nibble >> 1) & 0x3;
    int m = nibble & 0x1;
    float mag = e == 0 ? 0.5f * (float)m : ldexpf((float)(2 + m), e - 2);

    return (nibble & 0x8) ? -mag : mag;
}

/* e2m1 has no NaN and no infinity: NaN maps to +0 (documented in the header), inf saturates. */
uint8_t dsv4_f32_to_e2m1(float f)
{
    static const float grid[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };
    uint8_t sign = signbit(f) ? 0x8 : 0x0;
    float a = fabsf(f);
    int best = 0;

    if (isnan(f))
        return 0;
    if (a >= E2M1_MAX)
        return sign | 0x7;
    for (int c = 1; c < 8; c++) {
        float d = fabsf(a - grid[c]), db = fabsf(a - grid[best]);
        /* ties go to the even code (even mantissa bit) */
        if (d < db || (d == db && (c & 1) == 0))
            best = c;
    }
    return sign | (uint8_t)best;
}

/* Smallest power-of-two scale with max(amax, floor) / scale <= fmt_max, as a UE8M0 byte. */
static uint8_t ue8m0_scale_floored(float amax, float floor, float fmt_max)
{
    float s;
    int ex;

    if (!(amax >= floor))               /* NaN too: the floor keeps the scale finite */
        amax = floor;
    s = amax / fmt_max;
    if (!isfinite(s))
        return 254;
    /* smallest 2^k >= s: s = fr * 2^ex with fr in [0.5, 1); exact powers have fr == 0.5 */
    if (frexpf(s, &ex) == 0.5f)
        ex -= 1;
    ex += 127;
    if (ex < 0)
        ex = 0;
    if (ex > 254)
        ex = 254;
    return (uint8_t)ex;
}

uint8_t dsv4_ue8m0_scale_for(float amax, float fmt_max)
{
    return ue8m0_scale_floored(amax, UE8M0_AMAX_FLOOR, fmt_max);
}

void dsv4_fp8_roundtrip(float *x, size_t n, size_t block)
{
    for (size_t b = 0; b < n; b += block) {
        size_t len = n - b < block ? n - b : block;
        float amax = 0.0f, s;

        for (size_t i = 0; i < len; i++)
            amax = fmaxf(amax, fabsf(x[b + i]));
        s = dsv4_e8m0_to_f32(dsv4_ue8m0_scale_for(amax, E4M3_MAX));
        for (size_t i = 0; i < len; i++)
            x[b + i] = dsv4_e4m3_to_f32(dsv4_f32_to_e4m3(x[b + i] / s)) * s;
    }
}

void dsv4_fp4_roundtrip(float *x, size_t n, size_t block)
{
    for (size_t b = 0; b < n; b += block) {
        size_t len = n - b < block ? n - b : block;
        float amax = 0.0f, s;

        for (size_t i = 0; i < len; i++)
            amax = fmaxf(amax, fabsf(x[b + i]));
        s = dsv4_e8m0_to_f32(ue8m0_scale_floored(amax, E2M1_AMAX_FLOOR, E2M1_MAX));
        for (size_t i = 0; i < len; i++)
            x[b + i] = dsv4_e2m1_to_f32(dsv4_f32_to_e2m1(x[b + i] / s)) * s;
    }
}

void dsv4_hadamard(float *x, size_t n)
{
    float norm = 1.0f / sqrtf((float)n);

    for (size_t h = 1; h < n; h *= 2)
        for (size_t i = 0; i < n; i += 2 * h)
            for (size_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    for (size_t i = 0; i < n; i++)
        x[i] *= norm;
}
