/* SPDX-License-Identifier: MIT */
/* KV compressors (HCA: ratio 128, one block per entry; CSA and the indexer: ratio 4, overlapping).
 * Fed one token at a time, they keep the rows of the block being filled, so a prefill split into
 * chunks anywhere gives the same entries as one long prefill or decode.
 *
 * Which tokens form entry i: block i is positions [i*r, (i+1)*r). Without overlap the entry is the
 * per-channel softmax(gate)-weighted sum of the block's kv rows. With overlap each token projects
 * 2d channels: Ca = [:d] belongs to the NEXT block's entry, Cb = [d:] to its own; entry i is the
 * softmax over the 2r slots {Ca of block i-1, Cb of block i} (block 0 has no Ca slots: in
 * transformers they are zero kv with -inf gate, weight 0). The gate carries the position bias
 * ape[pos % r] (both halves, each its own bias). The entry is RMSNormed with the compressor's norm
 * and RoPE'd (compress frequencies) at position i*r, and exists once block i is complete. */
#include "build-config.h"

#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"

bool dsv4_cpu_compressor_push(const struct dsv4_cpu_ctx *c, const struct dsv4_compressor *cp,
                              struct dsv4_cpu_comp_state *st, const float *xn, int64_t pos, float *out)
{
    int r = cp->ratio, d = cp->dim;
    int width = cp->overlap ? 2 * d : d;         /* coff * d */
    int slot = (int)(pos % r);
    float *kv = st->kv + (size_t)slot * width;
    float *gate = st->gate + (size_t)slot * width;

    dsv4_cpu_undo_save(c->undo, kv, (size_t)width * sizeof(float));
    dsv4_cpu_undo_save(c->undo, gate, (size_t)width * sizeof(float));
    dsv4_cpu_linear(c, &cp->wkv, xn, kv);
    dsv4_cpu_linear(c, &cp->wgate, xn, gate);
    for (int i = 0; i < width; i++)
        gate[i] += cp->ape[(size_t)slot * width + i];
    if (slot != r - 1)
        return false;

    /* Block complete: per channel, softmax over the slots. Own rows are Cb (overlap) or the whole row. */
    int own = cp->overlap ? d : 0;
    bool prev = cp->overlap && st->have_prev;
    for (int ch = 0; ch < d; ch++) {
        float m = -INFINITY;
        if (prev)
            for (int j = 0; j < r; j++)
                m = fmaxf(m, st->prev_gate[(size_t)j * d + ch]);
        for (int j = 0; j < r; j++)
            m = fmaxf(m, st->gate[(size_t)j * width + own + ch]);
        float den = 0.0f, num = 0.0f;
        if (prev) {
            for (int j = 0; j < r; j++) {
                float e = expf(st->prev_gate[(size_t)j * d + ch] - m);
                den += e;
                num += e * st->prev_kv[(size_t)j * d + ch];
            }
        }
        for (int j = 0; j < r; j++) {
            float e = expf(st->gate[(size_t)j * width + own + ch] - m);
            den += e;
            num += e * st->kv[(size_t)j * width + own + ch];
        }
        out[ch] = num / den;
    }
    dsv4_cpu_rmsnorm(out, out, cp->norm, d, c->cfg->rms_norm_eps);
    dsv4_cpu_rope_apply(&c->wk->rope_compress, out + d - c->cfg->rope_dim, pos - (r - 1), false);

    if (cp->overlap) {
        /* This block's Ca half waits for the next entry. */
        dsv4_cpu_undo_save(c->undo, st->prev_kv, (size_t)r * (size_t)d * sizeof(float));
        dsv4_cpu_undo_save(c->undo, st->prev_gate, (size_t)r * (size_t)d * sizeof(float));
        dsv4_cpu_undo_save(c->undo, &st->have_prev, sizeof(st->have_prev));
        for (int j = 0; j < r; j++) {
            memcpy(st->prev_kv + (size_t)j * d, st->kv + (size_t)j * width, (size_t)d * sizeof(float));
            memcpy(st->prev_gate + (size_t)j * d, st->gate + (size_t)j * width, (size_t)d * sizeof(float));
        }
        st->have_prev = true;
    }
    return true;
}
