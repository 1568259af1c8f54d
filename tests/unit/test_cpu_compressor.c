/* SPDX-License-Identifier: MIT */
/* engine/cpu/cpu_compressor: the incremental compressor against the block formula computed in double
 * from all projected rows at once (doc/MODEL.md §3.5; transformers' CSA/HCA compressors):
 *   entry_i = RMSNorm_w( sum_slots softmax_slots(gate + ape) * kv ),  RoPE at position i*r,
 *   slots = block i's rows (no overlap) or {Ca of block i-1, Cb of block i} (overlap; none before 0). */
#include "build-config.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "cpu_test_util.h"

#define D 20
#define T 45                /* tokens: several blocks and a partial one */
#define RD 4

static void oracle_entry(const struct dsv4_compressor *cp, double kv[][64], double gate[][64], int i,
                         const struct dsv4_config *cfg, double *out)
{
    int r = cp->ratio, d = cp->dim;
    for (int ch = 0; ch < d; ch++) {
        double g[16], v[16];
        int n = 0;
        if (cp->overlap && i > 0)
            for (int j = 0; j < r; j++) {
                g[n] = gate[(i - 1) * r + j][ch];
                v[n++] = kv[(i - 1) * r + j][ch];
            }
        int own = cp->overlap ? d : 0;
        for (int j = 0; j < r; j++) {
            g[n] = gate[i * r + j][own + ch];
            v[n++] = kv[i * r + j][own + ch];
        }
        double m = -INFINITY, den = 0.0, num = 0.0;
        for (int k = 0; k < n; k++)
            m = fmax(m, g[k]);
        for (int k = 0; k < n; k++) {
            den += exp(g[k] - m);
            num += exp(g[k] - m) * v[k];
        }
        out[ch] = num / den;
    }
    double ss = 0.0;
    for (int ch = 0; ch < d; ch++)
        ss += out[ch] * out[ch];
    for (int ch = 0; ch < d; ch++)
        out[ch] = cp->norm[ch] * out[ch] / sqrt(ss / d + cfg->rms_norm_eps);
    double *x = out + d - RD;
    for (int p = 0; p < RD / 2; p++) {
        double a = (double)i * r * pow(cfg->rope_compress.theta, -2.0 * p / RD);
        double x0 = x[2 * p], x1 = x[2 * p + 1];
        x[2 * p] = x0 * cos(a) - x1 * sin(a);
        x[2 * p + 1] = x1 * cos(a) + x0 * sin(a);
    }
}

static void check_compressor(int ratio, bool overlap, int d)
{
    struct dsv4_config cfg = {.dim = D, .rope_dim = RD, .rms_norm_eps = 1e-6,
                              .rope_compress = {.theta = 1000.0}};
    struct dsv4_cpu_ctx c = {.cfg = &cfg, .num = DSV4_NUMERICS_EXACT, .wk = test_work(256)};
    dsv4_cpu_rope_init(&c.wk->rope_compress, &cfg.rope_compress, RD);
    int width = overlap ? 2 * d : d;
    struct dsv4_compressor cp = {.ratio = ratio, .dim = d, .overlap = overlap,
                                 .wkv = test_linear(width, D, 0.5), .wgate = test_linear(width, D, 0.8),
                                 .ape = test_randv(ratio * width, 1.0, 0.0), .norm = test_randv(d, 0.3, 1.0)};
    struct dsv4_cpu_comp_state st = {.kv = test_alloc(sizeof(float) * (size_t)(ratio * width)),
                                     .gate = test_alloc(sizeof(float) * (size_t)(ratio * width)),
                                     .prev_kv = test_alloc(sizeof(float) * (size_t)(ratio * d)),
                                     .prev_gate = test_alloc(sizeof(float) * (size_t)(ratio * d))};
    static double kv[T][64], gate[T][64];
    int emitted = 0;
    for (int t = 0; t < T; t++) {
        float *xn = test_randv(D, 1.5, 0.0);
        test_matvec(&cp.wkv, xn, kv[t]);
        test_matvec(&cp.wgate, xn, gate[t]);
        for (int k = 0; k < width; k++)
            gate[t][k] += cp.ape[(t % ratio) * width + k];
        float out[32];
        bool done = dsv4_cpu_compressor_push(&c, &cp, &st, xn, t, out);
        assert_int_equal(done, t % ratio == ratio - 1);
        if (!done)
            continue;
        double want[32];
        oracle_entry(&cp, kv, gate, t / ratio, &cfg, want);
        assert_close(out, want, d, 2e-5);
        emitted++;
    }
    assert_int_equal(emitted, T / ratio);
    test_free_all();
}

static void test_hca_block(void **state)
{
    srand(21);
    check_compressor(8, false, 16);
}

static void test_csa_overlap(void **state)
{
    srand(22);
    check_compressor(4, true, 16);
}

static void test_indexer_width(void **state)
{
    srand(23);
    check_compressor(4, true, 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hca_block),
        cmocka_unit_test(test_csa_overlap),
        cmocka_unit_test(test_indexer_width),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
