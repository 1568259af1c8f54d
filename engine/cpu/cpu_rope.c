/* SPDX-License-Identifier: MIT */
/* Interleaved-pair RoPE on the last rope_dim values of a head, with optional YaRN frequencies.
 * The frequencies and angles are computed in f32 the way transformers computes them, so the CPU
 * backend reproduces its cos/sin to the last bit or two. */
#include "build-config.h"

#include <math.h>

#include "engine/cpu/cpu_ops.h"

void dsv4_cpu_rope_init(struct dsv4_cpu_rope *r, const struct dsv4_rope *p, int rope_dim)
{
    r->dim = rope_dim;
    int half = rope_dim / 2;
    float base = (float)p->theta;
    /* YaRN correction range: low = floor(d ln(L0/(2 pi beta_fast)) / (2 ln theta)),
     * high = ceil(... beta_slow ...), clamped to [0, d-1]; computed in double like transformers. */
    double low = 0.0, high = 0.0;
    if (p->yarn) {
        double l0 = (double)p->yarn_original_max;
        low = floor(rope_dim * log(l0 / (p->beta_fast * 2.0 * M_PI)) / (2.0 * log(p->theta)));
        high = ceil(rope_dim * log(l0 / (p->beta_slow * 2.0 * M_PI)) / (2.0 * log(p->theta)));
        if (low < 0.0)
            low = 0.0;
        if (high > rope_dim - 1)
            high = rope_dim - 1;
        if (low == high)
            high += 0.001;      /* transformers' guard against a zero-width ramp */
    }
    for (int i = 0; i < half; i++) {
        float pos_freq = powf(base, (float)(2 * i) / (float)rope_dim);
        float extrap = 1.0f / pos_freq;
        if (!p->yarn) {
            r->inv_freq[i] = extrap;
            continue;
        }
        float interp = 1.0f / ((float)p->yarn_factor * pos_freq);
        float ramp = ((float)i - (float)low) / (float)(high - low);
        ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
        /* f' = f/factor * ramp + f * (1 - ramp); no mscale on cos/sin (attention_factor 1) */
        float extrap_w = 1.0f - ramp;
        r->inv_freq[i] = interp * (1.0f - extrap_w) + extrap * extrap_w;
    }
}

void dsv4_cpu_rope_apply(const struct dsv4_cpu_rope *r, float *x, int64_t pos, bool inverse)
{
    float p = (float)pos;
    for (int i = 0; i < r->dim / 2; i++) {
        float angle = r->inv_freq[i] * p;
        float cs = cosf(angle), sn = sinf(angle);
        if (inverse)
            sn = -sn;
        float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * cs - b * sn;
        x[2 * i + 1] = b * cs + a * sn;
    }
}
