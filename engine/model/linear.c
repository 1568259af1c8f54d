/* SPDX-License-Identifier: MIT */
/* y = W x for every weight format, dequantizing on use: the CPU backend's linears (what the GPU's
 * are checked against: engine/cpu/cpu_twin_cuda.h). */
#include "build-config.h"

#include <pthread.h>
#include <string.h>

#include "engine/model/quant.h"
#include "engine/model/weights.h"

#define FP8_BLOCK 128
#define FP4_BLOCK 32
#define E4M3_CODES 256
#define E2M1_CODES 16

/* Every e4m3 byte and e2m1 nibble decoded once by quant.c's exact converters: a lookup returns the
 * very float the converter would, so results stay bit-identical while the GEMV skips a call and an
 * ldexpf per weight. Filled under pthread_once because the row jobs run on a thread pool. */
static float e4m3_table[E4M3_CODES];
static float e2m1_table[E2M1_CODES];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void tables_fill(void)
{
    for (int v = 0; v < E4M3_CODES; v++)
        e4m3_table[v] = dsv4_e4m3_to_f32((uint8_t)v);
    for (int v = 0; v < E2M1_CODES; v++)
        e2m1_table[v] = dsv4_e2m1_to_f32((uint8_t)v);
}

static void tables_init(void)
{
    pthread_once(&tables_once, tables_fill);
}

/* Same bits as dsv4_bf16_to_f32 (bf16 is the top half of an f32), but inlined into the loops. */
static inline float bf16_widen(uint16_t v)
{
    uint32_t u = (uint32_t)v << 16;
    float f;

    memcpy(&f, &u, sizeof(f));
    return f;
}

void dsv4_linear_row(const struct dsv4_linear *W, int64_t r, float *out)
{
    int64_t in = W->in;

    tables_init();
    switch (W->fmt) {
    case DSV4_W_F32:
        memcpy(out, (const float *)W->w + r * W->row_stride, (size_t)in * sizeof(float));
        break;
    case DSV4_W_BF16: {
        const uint16_t *row = (const uint16_t *)W->w + r * W->row_stride;

        for (int64_t k = 0; k < in; k++)
            out[k] = bf16_widen(row[k]);
        break;
    }
    case DSV4_W_F16: {
        const uint16_t *row = (const uint16_t *)W->w + r * W->row_stride;

        for (int64_t k = 0; k < in; k++)
            out[k] = dsv4_f16_to_f32(row[k]);
        break;
    }
    case DSV4_W_FP8: {
        /* [out, in] e4m3, scale [ceil(out/128), ceil(in/128)]: block (r/128, k/128) */
        const uint8_t *row = (const uint8_t *)W->w + r * W->row_stride;
        const uint8_t *srow = W->scale + (r / FP8_BLOCK) * W->scale_stride;

        for (int64_t k = 0; k < in; k++)
            out[k] = e4m3_table[row[k]] * dsv4_e8m0_to_f32(srow[k / FP8_BLOCK]);
        break;
    }
    case DSV4_W_FP4: {
        /* [out, in/2] bytes, value k in byte k/2 (low nibble for even k), scale [out, in/32] */
        const uint8_t *row = (const uint8_t *)W->w + r * W->row_stride / 2;
        const uint8_t *srow = W->scale + r * W->scale_stride;

        for (int64_t k = 0; k < in; k++) {
            uint8_t b = row[k / 2];

            out[k] = e2m1_table[k % 2 ? b >> 4 : b & 0xf] * dsv4_e8m0_to_f32(srow[k / FP4_BLOCK]);
        }
        break;
    }
    }
}

void dsv4_linear_matvec(const struct dsv4_linear *W, const float *x, float *y)
{
    int64_t in = W->in;

    tables_init();
    if (W->fmt == DSV4_W_F32) {
        for (int64_t r = 0; r < W->out; r++) {
            const float *row = (const float *)W->w + r * W->row_stride;
            float acc = 0.0f;

            for (int64_t k = 0; k < in; k++)
                acc += row[k] * x[k];
            y[r] = acc;
        }
        return;
    }
    if (W->fmt == DSV4_W_BF16) {
        for (int64_t r = 0; r < W->out; r++) {
            const uint16_t *row = (const uint16_t *)W->w + r * W->row_stride;
            float acc = 0.0f;

            for (int64_t k = 0; k < in; k++)
                acc += bf16_widen(row[k]) * x[k];
            y[r] = acc;
        }
        return;
    }
    /* the rest convert each element on the fly; block formats apply each scale once per block */
    for (int64_t r = 0; r < W->out; r++) {
        float acc = 0.0f;

        if (W->fmt == DSV4_W_F16) {
            const uint16_t *row = (const uint16_t *)W->w + r * W->row_stride;

            for (int64_t k = 0; k < in; k++)
                acc += dsv4_f16_to_f32(row[k]) * x[k];
        } else if (W->fmt == DSV4_W_FP8) {
            const uint8_t *row = (const uint8_t *)W->w + r * W->row_stride;
            const uint8_t *srow = W->scale + (r / FP8_BLOCK) * W->scale_stride;

            for (int64_t k0 = 0; k0 < in; k0 += FP8_BLOCK) {
                int64_t k1 = k0 + FP8_BLOCK < in ? k0 + FP8_BLOCK : in;
                float part = 0.0f;

                for (int64_t k = k0; k < k1; k++)
                    part += e4m3_table[row[k]] * x[k];
                acc += part * dsv4_e8m0_to_f32(srow[k0 / FP8_BLOCK]);
            }
        } else {
            const uint8_t *row = (const uint8_t *)W->w + r * W->row_stride / 2;
            const uint8_t *srow = W->scale + r * W->scale_stride;

            for (int64_t k0 = 0; k0 < in; k0 += FP4_BLOCK) {
                float part = 0.0f;

                for (int64_t k = k0; k < k0 + FP4_BLOCK; k += 2) {
                    uint8_t b = row[k / 2];

                    part += e2m1_table[b & 0xf] * x[k] + e2m1_table[b >> 4] * x[k + 1];
                }
                acc += part * dsv4_e8m0_to_f32(srow[k0 / FP4_BLOCK]);
            }
        }
        y[r] = acc;
    }
}
