/* SPDX-License-Identifier: MIT */
/* engine/model/synth: a directory with config.json and synthetic.json loads as a model whose tensors
 * are generated in memory. Checked here: every tensor the config implies is there and nothing else,
 * layers past distinct_layers share their source layer's tensors, the values are a function of the
 * seed alone, the codes follow the quantized normal law they are drawn from (chi-square against
 * probabilities computed here from the normal CDF, at p = 1e-6 so a fresh seed never fails by chance),
 * the CPU backend runs the model to finite logits, router_skew concentrates the routing on the
 * experts it favours, and bad recipes are refused with a message naming the key. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/error.h"
#include "engine/model/quant.h"
#include "engine/model/synth.h"
#include "engine/model/weights.h"
#include "seed_util.h"
#include "st_writer.h"

/* Release-spelled config at small shapes: 2 sliding layers, then CSA (4) and HCA (128) in turn, the
 * first 3 layers hash-routed, one MTP block; D = 256 so the FP8 blocks are whole and partial. */
static const char config_json[] =
    "{\"architectures\": [\"DeepseekV4ForCausalLM\"], \"model_type\": \"deepseek_v4\", \"vocab_size\": 320, "
    "\"hidden_size\": 256, \"num_hidden_layers\": 6, \"num_attention_heads\": 4, \"num_key_value_heads\": 1, "
    "\"head_dim\": 64, \"qk_rope_head_dim\": 16, \"q_lora_rank\": 96, \"o_groups\": 2, \"o_lora_rank\": 48, "
    "\"sliding_window\": 8, \"compress_ratios\": [0, 0, 4, 128, 4, 128], "
    "\"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 128}, "
    "\"index_n_heads\": 4, \"index_head_dim\": 32, \"index_topk\": 8, \"n_routed_experts\": 8, "
    "\"num_experts_per_tok\": 2, \"n_shared_experts\": 1, \"moe_intermediate_size\": 64, \"num_hash_layers\": 3, "
    "\"scoring_func\": \"sqrtsoftplus\", \"routed_scaling_factor\": 1.5, \"norm_topk_prob\": true, "
    "\"swiglu_limit\": 10.0, \"hidden_act\": \"silu\", \"hc_mult\": 4, \"hc_sinkhorn_iters\": 20, "
    "\"hc_eps\": 1e-6, \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"compress_rope_theta\": 160000.0, "
    "\"max_position_embeddings\": 4096, \"num_nextn_predict_layers\": 1, \"bos_token_id\": 0, "
    "\"eos_token_id\": 1, \"tie_word_embeddings\": false}";

#define CTX 64
#define CHI2_Z 4.753    /* the normal quantile of 1 - 1e-6 */

static uint64_t test_seed;

/* A directory holding config_json and the recipe text; the caller removes and frees it. */
static char *recipe_dir(const char *recipe)
{
    char *dir = stw_tempdir();

    assert_non_null(dir);
    assert_int_equal(stw_write_text(dir, "config.json", config_json), 0);
    assert_int_equal(stw_write_text(dir, DSV4_SYNTH_RECIPE, recipe), 0);
    return dir;
}

static struct dsv4_weights *load(uint64_t seed, int distinct, double skew)
{
    char recipe[256], *dir;
    struct dsv4_weights *w = NULL;

    snprintf(recipe, sizeof(recipe), "{\"seed\": %llu, \"distinct_layers\": %d, \"router_skew\": %g}",
             (unsigned long long)seed, distinct, skew);
    dir = recipe_dir(recipe);
    if (dsv4_weights_load(dir, &w) < 0)
        fail_msg("loading %s: %s", dir, dsv4_error_message());
    stw_rmdir(dir);
    free(dir);
    return w;
}

static void test_tensors_and_repeats(void **state)
{
    struct dsv4_weights *w = load(test_seed, 5, 0.0);
    const struct dsv4_layer *L = w->layers;

    assert_int_equal(w->cfg.n_layers, 6);
    assert_int_equal(w->n_unused, 0);       /* nothing generated that the loader did not take */
    assert_int_equal(w->n_mtp, 1);
    assert_true(w->bytes_quantized > 0);
    assert_true(w->synthetic);
    assert_int_equal(L[0].attn.wq_a.fmt, DSV4_W_FP8);
    assert_int_equal(L[3].ffn.w1[0].fmt, DSV4_W_FP4);
    assert_int_equal(w->embed.fmt, DSV4_W_BF16);
    /* layer 5 (HCA, scored) repeats layer 3; layer 4 has values of its own */
    assert_ptr_equal(L[5].attn.wq_a.w, L[3].attn.wq_a.w);
    assert_ptr_equal(L[5].attn.comp.wkv.w, L[3].attn.comp.wkv.w);
    assert_ptr_equal(L[5].ffn.w2[7].w, L[3].ffn.w2[7].w);
    assert_memory_equal(L[5].ffn.gate_bias, L[3].ffn.gate_bias, sizeof(float) * 8);  /* small vectors are copied */
    assert_ptr_not_equal(L[4].attn.wq_a.w, L[2].attn.wq_a.w);
    assert_ptr_not_equal(L[4].ffn.w1[0].w, L[3].ffn.w1[0].w);
    assert_non_null(L[2].ffn.tid2eid);
    assert_null(L[3].ffn.tid2eid);
    dsv4_weights_free(w);
}

static void test_seed_decides(void **state)
{
    struct dsv4_weights *a = load(test_seed, 6, 0.5), *b = load(test_seed, 6, 0.5), *c = load(test_seed + 1, 6, 0.5);
    size_t n = dsv4_st_count(a->st), differ = 0;

    assert_int_equal(dsv4_st_count(b->st), n);
    assert_int_equal(dsv4_st_count(c->st), n);
    for (size_t i = 0; i < n; i++) {
        const struct dsv4_st_tensor *x = dsv4_st_at(a->st, i), *y = dsv4_st_at(b->st, i), *z = dsv4_st_at(c->st, i);

        assert_string_equal(x->name, y->name);
        assert_int_equal(x->nbytes, y->nbytes);
        if (memcmp(x->data, y->data, x->nbytes) != 0)
            fail_msg("%s differs between two loads of seed %llu", x->name, (unsigned long long)test_seed);
        /* another seed: every tensor of more than a handful of values changes */
        if (z->nbytes >= 64 && memcmp(x->data, z->data, x->nbytes) != 0)
            differ++;
        else if (z->nbytes >= 64)
            fail_msg("%s is the same for seeds %llu and %llu", x->name, (unsigned long long)test_seed,
                     (unsigned long long)test_seed + 1);
    }
    assert_true(differ > 100);
    dsv4_weights_free(a);
    dsv4_weights_free(b);
    dsv4_weights_free(c);
}

/* Upper chi-square critical value at p = 1e-6 (Wilson-Hilferty). */
static double chi2_critical(int df)
{
    const double k = 2.0 / (9.0 * df), t = 1.0 - k + CHI2_Z * sqrt(k);

    return df * t * t * t;
}

/* Chi-square of magnitude counts cnt[n] (codes with both signs) against a normal of this sigma rounded
 * to the nearest magnitude (mids halfway, the top open), bins with under 20 expected merged upwards. */
static void chi2_check(const char *what, const double *cnt, const float *mags, int n, double sigma)
{
    double total = 0.0, chi2 = 0.0, e_acc = 0.0, o_acc = 0.0;
    int df = -1;

    for (int m = 0; m < n; m++)
        total += cnt[m];
    for (int m = 0; m < n; m++) {
        const double lo = m == 0 ? 0.0 : 0.5 * (mags[m - 1] + mags[m]);
        const double hi = m == n - 1 ? INFINITY : 0.5 * (mags[m] + mags[m + 1]);
        const double p = erf(hi / (sigma * M_SQRT2)) - erf(lo / (sigma * M_SQRT2));

        e_acc += p * total;
        o_acc += cnt[m];
        if (e_acc >= 20.0 || m == n - 1) {
            chi2 += (o_acc - e_acc) * (o_acc - e_acc) / (e_acc > 0.0 ? e_acc : 1e-300);
            e_acc = o_acc = 0.0;
            df++;
        }
    }
    print_message("%s: %.0f codes, chi-square %.1f with %d degrees of freedom (critical %.1f at p = 1e-6)\n", what,
                  total, chi2, df, chi2_critical(df));
    assert_true(df >= 5);
    if (!(chi2 <= chi2_critical(df)))
        fail_msg("%s: chi-square %g over %g", what, chi2, chi2_critical(df));
}

struct moments {
    double n, s, s2;
};

static void add_moments(struct moments *m, const struct dsv4_linear *W)
{
    float *row = malloc(sizeof(float) * (size_t)W->in);

    assert_non_null(row);
    for (int64_t r = 0; r < W->out; r++) {
        dsv4_linear_row(W, r, row);
        for (int64_t k = 0; k < W->in; k++) {
            assert_true(isfinite(row[k]));
            m->n++;
            m->s += row[k];
            m->s2 += (double)row[k] * row[k];
        }
    }
    free(row);
}

/* Mean and spread of the dequantized values of W[n], pooled. */
static void moments(const struct dsv4_linear *const *W, int n, double *mean, double *sd)
{
    struct moments m = { 0 };

    for (int i = 0; i < n; i++)
        add_moments(&m, W[i]);
    *mean = m.s / m.n;
    *sd = sqrt(m.s2 / m.n - *mean * *mean);
}

static void test_value_law(void **state)
{
    struct dsv4_weights *w = load(test_seed, 6, 0.0);
    double fp8[0x7f] = { 0 }, fp4[8] = { 0 }, mean, sd;
    float mags8[0x7f], mags4[8];
    size_t scales = 0;

    for (int m = 0; m < 0x7f; m++)
        mags8[m] = dsv4_e4m3_to_f32((uint8_t)m);
    for (int m = 0; m < 8; m++)
        mags4[m] = dsv4_e2m1_to_f32((uint8_t)m);
    for (size_t i = 0; i < dsv4_st_count(w->st); i++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(w->st, i);
        const uint8_t *b = t->data;

        for (size_t k = 0; k < t->nbytes && t->dtype == DSV4_DT_F8_E4M3; k++) {
            if ((b[k] & 0x7f) == 0x7f)
                fail_msg("%s holds the NaN code at %zu", t->name, k);
            fp8[b[k] & 0x7f]++;
        }
        for (size_t k = 0; k < t->nbytes && t->dtype == DSV4_DT_I8; k++) {
            fp4[b[k] & 7]++;
            fp4[(b[k] >> 4) & 7]++;
        }
        /* block scales: the exponent near the one that puts a block's largest value at the format's top */
        for (size_t k = 0; k < t->nbytes && t->dtype == DSV4_DT_F8_E8M0; k++, scales++)
            assert_true(b[k] >= 114 && b[k] <= 121);
    }
    assert_true(scales > 1000);
    /* codes: a block's largest value at FP8 4 sigma -> 448, FP4 2.2 sigma -> 6 */
    chi2_check("fp8 magnitudes", fp8, mags8, 0x7f, 448.0 / 4.0);
    chi2_check("fp4 magnitudes", fp4, mags4, 8, 6.0 / 2.2);
    /* Dequantized, the spread of trained linears. A block's codes have spread 448 / 4 (FP8) or 6 / 2.2
     * (FP4) and its scale is 2^-12 (FP8) or 2^-7 (FP4) times 1/2, 1 or 2, so the pooled spread is
     * ~0.036 (FP8) and ~0.028 (FP4); pooled over ~80 FP8 blocks of this model and 3072 FP4 blocks,
     * each stays well inside the bounds below whatever the scales drawn. */
    const struct dsv4_linear *f8[6 * 9], *f4[6];
    int n8 = 0;

    for (int l = 0; l < 6; l++) {
        const struct dsv4_layer *L = &w->layers[l];
        const struct dsv4_linear *all[] = { &L->attn.wq_a, &L->attn.wq_b, &L->attn.wkv, &L->attn.wo_a,
                                            &L->attn.wo_b, &L->ffn.sw1, &L->ffn.sw3, &L->ffn.sw2 };

        for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
            f8[n8++] = all[i];
        if (L->ratio == w->cfg.csa_ratio)
            f8[n8++] = &L->attn.indexer.wq_b;
        f4[l] = &L->ffn.w2[l];
    }
    moments(f8, n8, &mean, &sd);
    print_message("fp8 linears: mean %.2g, sd %.4f\n", mean, sd);
    assert_true(fabs(mean) < 0.003 && sd > 0.02 && sd < 0.06);
    moments(f4, 6, &mean, &sd);
    print_message("fp4 experts: mean %.2g, sd %.4f\n", mean, sd);
    assert_true(fabs(mean) < 0.002 && sd > 0.02 && sd < 0.04);
    moments((const struct dsv4_linear *[]){ &w->layers[4].attn.comp.wgate }, 1, &mean, &sd);
    assert_true(fabs(mean) < 0.002 && fabs(sd - 0.02) < 0.002);
    moments((const struct dsv4_linear *[]){ &w->embed }, 1, &mean, &sd);
    assert_true(fabs(mean) < 0.002 && sd > 0.005 && sd < 0.05);
    for (int d = 0; d < w->cfg.dim; d++)
        assert_true(fabsf(w->layers[1].attn_norm[d] - 1.0f) < 0.4f);
    for (int i = 0; i < w->cfg.vocab_size * w->cfg.n_experts_per_tok; i += w->cfg.n_experts_per_tok) {
        const int32_t *e = &w->layers[0].ffn.tid2eid[i];

        assert_true(e[0] >= 0 && e[0] < w->cfg.n_experts && e[1] >= 0 && e[1] < w->cfg.n_experts && e[0] != e[1]);
    }
    dsv4_weights_free(w);
}

static void run_logits(const struct dsv4_weights *w, enum dsv4_numerics num, float *out)
{
    const int V = w->cfg.vocab_size;
    struct dsv4_backend_opts opts = { .max_batch = 1, .max_context = CTX, .numerics = num };
    struct dsv4_backend *b;
    int32_t t[16];

    for (int i = 0; i < 16; i++)
        t[i] = (int32_t)((i * 37 + 5) % V);
    assert_int_equal(dsv4_backend_cpu_create(w, &opts, &b), 0);
    assert_int_equal(b->ops->prefill(b, 0, t, 12, NULL, false), 0);
    for (int i = 12; i < 16; i++)
        assert_int_equal(b->ops->decode(b, 1, (int[]){ 0 }, &t[i], out), 0);
    b->ops->destroy(b);
}

static void test_cpu_forward(void **state)
{
    struct dsv4_weights *w = load(test_seed, 5, 0.0), *again = load(test_seed, 5, 0.0);
    const int V = w->cfg.vocab_size;
    float *x = malloc(sizeof(float) * (size_t)V), *y = malloc(sizeof(float) * (size_t)V);

    assert_non_null(x);
    assert_non_null(y);
    for (int num = 0; num < 2; num++) {
        const enum dsv4_numerics nm = num ? DSV4_NUMERICS_FP8 : DSV4_NUMERICS_EXACT;
        float lo = INFINITY, hi = -INFINITY;

        run_logits(w, nm, x);
        run_logits(again, nm, y);
        for (int v = 0; v < V; v++) {
            assert_true(isfinite(x[v]));
            lo = fminf(lo, x[v]);
            hi = fmaxf(hi, x[v]);
        }
        assert_true(hi - lo > 1e-3f);
        assert_memory_equal(x, y, sizeof(float) * (size_t)V);
    }
    free(x);
    free(y);
    dsv4_weights_free(w);
    dsv4_weights_free(again);
}

/* Routing counts of the scored layers over a 48-token prompt. */
static void route(const struct dsv4_weights *w, uint64_t *counts)
{
    struct dsv4_backend_opts opts = { .max_batch = 1, .max_context = CTX };
    struct dsv4_backend *b;
    int32_t t[48];

    for (int i = 0; i < 48; i++)
        t[i] = (int32_t)((i * 53 + 7) % w->cfg.vocab_size);
    assert_int_equal(dsv4_backend_cpu_create(w, &opts, &b), 0);
    assert_int_equal(b->ops->prefill(b, 0, t, 48, NULL, false), 0);
    assert_int_equal(b->ops->routing_counts(b, counts), 0);
    b->ops->destroy(b);
}

static void test_router_skew(void **state)
{
    const int E = 8;
    uint64_t counts[6 * 8];

    /* skew 4: the favourite's bias leads the second's by 4 ln 2 = 2.8 and the third's by 4 ln 3 = 4.4, far
     * past the random scores' spread (~0.3): the two favourites take every token */
    struct dsv4_weights *w = load(test_seed, 6, 4.0);
    route(w, counts);
    for (int l = 3; l < 6; l++) {
        const float *bias = w->layers[l].ffn.gate_bias;
        int first = 0, second = -1;

        for (int e = 1; e < E; e++)
            if (bias[e] > bias[first])
                first = e;
        for (int e = 0; e < E; e++)
            if (e != first && (second < 0 || bias[e] > bias[second]))
                second = e;
        for (int e = 0; e < E; e++)
            assert_int_equal(counts[l * E + e], e == first || e == second ? 48 : 0);
    }
    dsv4_weights_free(w);
    /* no skew: a 48-token prompt reaches at least 4 of the 8 experts of every scored layer */
    w = load(test_seed, 6, 0.0);
    route(w, counts);
    for (int l = 3; l < 6; l++) {
        int used = 0;

        for (int e = 0; e < E; e++)
            used += counts[l * E + e] > 0;
        assert_true(used >= 4);
    }
    dsv4_weights_free(w);
}

static void refused(const char *recipe, const char *needle)
{
    char *dir = recipe_dir(recipe);
    struct dsv4_weights *w = NULL;

    assert_int_equal(dsv4_weights_load(dir, &w), -EINVAL);
    assert_null(w);
    if (!strstr(dsv4_error_message(), needle))
        fail_msg("recipe %s: message \"%s\" lacks \"%s\"", recipe, dsv4_error_message(), needle);
    stw_rmdir(dir);
    free(dir);
}

static void test_bad_recipes(void **state)
{
    char *dir;
    struct dsv4_weights *w = NULL;

    refused("{\"seed\": 1, \"layers\": 3}", "unknown key \"layers\"");
    refused("{\"seed\": -1}", "seed must be");
    refused("{\"seed\": 1.5}", "seed must be");
    refused("{\"distinct_layers\": 0}", "distinct_layers must be an integer in 1..6");
    refused("{\"distinct_layers\": 7}", "distinct_layers must be an integer in 1..6");
    refused("{\"router_skew\": -0.5}", "router_skew must be");
    refused("{\"router_skew\": \"high\"}", "router_skew must be");
    refused("[1, 2]", "expected a JSON object");
    refused("{\"seed\": 1,", "line 1");
    refused("{\"seed\": 1, \"seed\": 2}", "duplicate");
    /* layer 3 is the first HCA layer with scored routing: nothing before it to repeat */
    refused("{\"distinct_layers\": 3}", "leaves layer 3 (compress ratio 128, scored routing)");
    /* layer 4 (CSA, scored): layer 2 is CSA but hash-routed */
    refused("{\"distinct_layers\": 4}", "leaves layer 4 (compress ratio 4, scored routing)");
    /* a recipe is a few keys: one over DSV4_SYNTH_RECIPE_MAX_BYTES is refused before it is parsed */
    {
        char big[DSV4_SYNTH_RECIPE_MAX_BYTES + 64];

        memset(big, ' ', sizeof(big) - 1);
        big[0] = '{';
        big[sizeof(big) - 2] = '}';
        big[sizeof(big) - 1] = '\0';
        dir = recipe_dir(big);
        assert_int_equal(dsv4_weights_load(dir, &w), -E2BIG);
        assert_null(w);
        if (!strstr(dsv4_error_message(), "synthetic.json") || !strstr(dsv4_error_message(), "4096"))
            fail_msg("message \"%s\" names neither the file nor the limit", dsv4_error_message());
        stw_rmdir(dir);
        free(dir);
    }
    /* shards beside the recipe: which weights are meant would be a guess */
    dir = recipe_dir("{}");
    assert_int_equal(stw_write_text(dir, "model.safetensors", "x"), 0);
    assert_int_equal(dsv4_weights_load(dir, &w), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "both synthetic.json and safetensors"));
    stw_rmdir(dir);
    free(dir);
    /* {} is every default: all layers distinct */
    dir = recipe_dir("{}");
    assert_int_equal(dsv4_weights_load(dir, &w), 0);
    assert_ptr_not_equal(w->layers[5].attn.wq_a.w, w->layers[3].attn.wq_a.w);
    dsv4_weights_free(w);
    stw_rmdir(dir);
    free(dir);
}

static int setup(void **state)
{
    test_seed = dsv4_test_seed();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tensors_and_repeats),
        cmocka_unit_test(test_seed_decides),
        cmocka_unit_test(test_value_law),
        cmocka_unit_test(test_cpu_forward),
        cmocka_unit_test(test_router_skew),
        cmocka_unit_test(test_bad_recipes),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
