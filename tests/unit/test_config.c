/* SPDX-License-Identifier: MIT */
/* engine/model/config: both spellings of config.json, transformers' defaulting and legacy folds
 * (expected values checked against DeepseekV4Config of transformers 5.17), and the refusals,
 * each of which must name the offending field. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "base/utf8.h"
#include "engine/model/config.h"
#include "engine/error.h"
#include "tests/unit/st_writer.h"

/* The config.json transformers writes for a tiny 4-layer model. */
static const char tiny_json[] =
    "{\"attention_bias\": false, \"attention_dropout\": 0.0, \"bos_token_id\": 0,"
    " \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 8},"
    " \"compress_rope_theta\": 160000.0, \"eos_token_id\": 1, \"hc_eps\": 1e-06, \"hc_mult\": 4,"
    " \"hc_sinkhorn_iters\": 20, \"head_dim\": 32, \"hidden_act\": \"silu\", \"hidden_size\": 64,"
    " \"index_head_dim\": 16, \"index_n_heads\": 4, \"index_topk\": 4, \"initializer_range\": 0.02,"
    " \"layer_types\": [\"sliding_attention\", \"sliding_attention\", \"compressed_sparse_attention\","
    "   \"heavily_compressed_attention\"],"
    " \"max_position_embeddings\": 1048576, \"mlp_bias\": false,"
    " \"mlp_layer_types\": [\"hash_moe\", \"hash_moe\", \"hash_moe\", \"moe\"],"
    " \"model_type\": \"deepseek_v4\", \"moe_intermediate_size\": 32, \"n_routed_experts\": 8,"
    " \"n_shared_experts\": 1, \"norm_topk_prob\": true, \"num_attention_heads\": 4,"
    " \"num_experts_per_tok\": 2, \"num_hidden_layers\": 4, \"num_key_value_heads\": 1,"
    " \"num_nextn_predict_layers\": 1, \"o_groups\": 2, \"o_lora_rank\": 16, \"output_router_logits\": false,"
    " \"pad_token_id\": null, \"partial_rotary_factor\": 0.125, \"q_lora_rank\": 32, \"qk_rope_head_dim\": 4,"
    " \"rms_norm_eps\": 1e-06,"
    " \"rope_parameters\": {\"compress\": {\"partial_rotary_factor\": 0.125, \"rope_theta\": 160000.0,"
    "   \"rope_type\": \"default\"}, \"main\": {\"partial_rotary_factor\": 0.125, \"rope_theta\": 10000.0,"
    "   \"rope_type\": \"default\"}},"
    " \"rope_theta\": 10000.0, \"routed_scaling_factor\": 1.5, \"router_aux_loss_coef\": 0.001,"
    " \"router_jitter_noise\": 0.0, \"scoring_func\": \"sqrtsoftplus\", \"sliding_window\": 8,"
    " \"swiglu_limit\": 10.0, \"tie_word_embeddings\": false, \"transformers_version\": \"5.17.0\","
    " \"use_cache\": true, \"vocab_size\": 300}";

static void parse_ok(const char *json, struct dsv4_config *c)
{
    int r = dsv4_config_parse(json, "config.json", c);

    if (r < 0)
        fail_msg("parse failed (%d): %s", r, dsv4_error_message());
}

static void test_transformers_tiny(void **state)
{
    struct dsv4_config c;
    const int ratios[4] = { 0, 0, 4, 8 };

    parse_ok(tiny_json, &c);
    assert_int_equal(c.vocab_size, 300);
    assert_int_equal(c.dim, 64);
    assert_int_equal(c.n_layers, 4);
    assert_int_equal(c.n_mtp_layers, 1);
    assert_int_equal(c.n_heads, 4);
    assert_int_equal(c.head_dim, 32);
    assert_int_equal(c.rope_dim, 4);
    assert_int_equal(dsv4_config_nope_dim(&c), 28);
    assert_int_equal(c.q_lora_rank, 32);
    assert_int_equal(c.o_groups, 2);
    assert_int_equal(c.o_lora_rank, 16);
    assert_int_equal(c.window, 8);
    assert_int_equal(c.csa_ratio, 4);
    assert_int_equal(c.hca_ratio, 8);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(c.compress_ratio[i], ratios[i]);
        assert_int_equal(c.mlp_type[i], i < 3 ? DSV4_MLP_HASH : DSV4_MLP_MOE);
    }
    assert_int_equal(c.index_n_heads, 4);
    assert_int_equal(c.index_head_dim, 16);
    assert_int_equal(c.index_topk, 4);
    assert_int_equal(c.n_experts, 8);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_int_equal(c.n_shared_experts, 1);
    assert_int_equal(c.moe_inter, 32);
    assert_true(c.routed_scaling_factor == 1.5);
    assert_true(c.norm_topk_prob);
    assert_true(c.swiglu_limit == 10.0);
    assert_int_equal(c.hc_mult, 4);
    assert_int_equal(c.hc_sinkhorn_iters, 20);
    assert_true(c.hc_eps == 1e-6 && c.rms_norm_eps == 1e-6);
    assert_true(c.rope_main.theta == 10000.0 && !c.rope_main.yarn);
    assert_true(c.rope_compress.theta == 160000.0 && !c.rope_compress.yarn);
    assert_int_equal(c.max_position, 1048576);
    assert_int_equal(c.bos_id, 0);
    assert_int_equal(c.eos_id, 1);
    assert_false(c.tie_embeddings);
}

/* Nothing but model_type: DeepseekV4Config()'s values, including its layer_types default
 * [HCA, HCA] + (i % 2 ? CSA : HCA) and three hash layers. */
static void test_transformers_defaults(void **state)
{
    struct dsv4_config c;

    parse_ok("{\"model_type\": \"deepseek_v4\"}", &c);
    assert_int_equal(c.vocab_size, 129280);
    assert_int_equal(c.dim, 4096);
    assert_int_equal(c.n_layers, 43);
    assert_int_equal(c.n_heads, 64);
    assert_int_equal(c.head_dim, 512);
    assert_int_equal(c.rope_dim, 64);
    assert_int_equal(c.q_lora_rank, 1024);
    assert_int_equal(c.o_groups, 8);
    assert_int_equal(c.o_lora_rank, 1024);
    assert_int_equal(c.window, 128);
    assert_int_equal(c.index_n_heads, 64);
    assert_int_equal(c.index_head_dim, 128);
    assert_int_equal(c.index_topk, 512);
    assert_int_equal(c.n_experts, 256);
    assert_int_equal(c.n_experts_per_tok, 6);
    assert_int_equal(c.moe_inter, 2048);
    assert_int_equal(c.n_mtp_layers, 1);
    assert_int_equal(c.compress_ratio[0], 128);
    assert_int_equal(c.compress_ratio[1], 128);
    assert_int_equal(c.compress_ratio[2], 128);
    assert_int_equal(c.compress_ratio[3], 4);
    assert_int_equal(c.compress_ratio[4], 128);
    assert_int_equal(c.compress_ratio[41], 4);
    assert_int_equal(c.compress_ratio[42], 128);
    for (int i = 0; i < 43; i++)
        assert_int_equal(c.mlp_type[i], i < 3 ? DSV4_MLP_HASH : DSV4_MLP_MOE);
    assert_int_equal(c.bos_id, 0);
    assert_int_equal(c.eos_id, 1);
    /* transformers' default compress rope has no YaRN unless rope_parameters asks for it */
    assert_true(c.rope_compress.theta == 160000.0 && !c.rope_compress.yarn);
    assert_true(c.rope_main.theta == 10000.0 && !c.rope_main.yarn);
}

/* Legacy fields fold in: compress_ratios (longer lists are truncated), num_hash_layers,
 * qk_rope_head_dim, rope_scaling with "type", compress_rate_csa/hca. */
static void test_transformers_legacy(void **state)
{
    struct dsv4_config c;
    const int ratios[5] = { 0, 0, 4, 64, 4 };

    parse_ok("{\"model_type\": \"deepseek_v4\", \"eos_token_id\": [7, 1], \"bos_token_id\": null,"
             " \"num_hidden_layers\": 5, \"compress_ratios\": [0, 0, 4, 128, 4, 0],"
             " \"num_hash_layers\": 1, \"qk_rope_head_dim\": 32, \"compress_rate_hca\": 64,"
             " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536}}", &c);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(c.compress_ratio[i], ratios[i]);
        assert_int_equal(c.mlp_type[i], i < 1 ? DSV4_MLP_HASH : DSV4_MLP_MOE);
    }
    assert_int_equal(c.hca_ratio, 64);
    assert_int_equal(c.eos_id, 7);      /* a list: the first id */
    assert_int_equal(c.bos_id, 0);      /* null: the default */
    assert_int_equal(c.rope_dim, 32);
    assert_true(c.rope_compress.yarn);
    assert_true(c.rope_compress.theta == 160000.0);
    assert_true(c.rope_compress.yarn_factor == 16.0);
    assert_int_equal(c.rope_compress.yarn_original_max, 65536);
    assert_true(c.rope_compress.beta_fast == 32.0 && c.rope_compress.beta_slow == 1.0);
    assert_false(c.rope_main.yarn);
    assert_true(c.rope_main.theta == 10000.0);
}

static void test_transformers_rope(void **state)
{
    struct dsv4_config c;

    /* flat yarn: original length defaults to max_position_embeddings, beta_fast 0 means 32 */
    parse_ok("{\"model_type\": \"deepseek_v4\", \"max_position_embeddings\": 4096,"
             " \"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4, \"beta_fast\": 0, \"beta_slow\": 2}}", &c);
    assert_true(c.rope_compress.yarn && c.rope_compress.yarn_factor == 4.0);
    assert_int_equal(c.rope_compress.yarn_original_max, 4096);
    assert_true(c.rope_compress.beta_fast == 32.0 && c.rope_compress.beta_slow == 2.0);
    /* an empty rope_scaling does not hide rope_parameters */
    parse_ok("{\"model_type\": \"deepseek_v4\", \"rope_scaling\": {}, \"rope_parameters\": {\"rope_type\": \"yarn\","
             " \"factor\": 8, \"original_max_position_embeddings\": 1024}}", &c);
    assert_true(c.rope_compress.yarn && c.rope_compress.yarn_factor == 8.0);
    /* factor null: max_position / original */
    parse_ok("{\"model_type\": \"deepseek_v4\", \"max_position_embeddings\": 16384,"
             " \"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": null, \"original_max_position_embeddings\": 1024}}", &c);
    assert_true(c.rope_compress.yarn_factor == 16.0);
    /* nested, as written by transformers for a YaRN model; a missing rope_theta takes the
     * top-level rope_theta */
    parse_ok("{\"model_type\": \"deepseek_v4\", \"rope_theta\": 5000,"
             " \"rope_parameters\": {\"main\": {\"rope_type\": \"default\", \"partial_rotary_factor\": 0.125},"
             " \"compress\": {\"rope_type\": \"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536,"
             " \"beta_fast\": 32, \"beta_slow\": 1, \"attention_factor\": 1.0, \"rope_theta\": 160000,"
             " \"partial_rotary_factor\": 0.125}}}", &c);
    assert_true(c.rope_main.theta == 5000.0 && !c.rope_main.yarn);
    assert_true(c.rope_compress.yarn && c.rope_compress.theta == 160000.0);
    assert_int_equal(c.rope_compress.yarn_original_max, 65536);
}

/* The config.json that ships with DeepSeek-V4-Flash: model_type deepseek_v4 with the legacy
 * fields (num_hash_layers, qk_rope_head_dim, flat rope_scaling, compress_ratios with the MTP
 * layer's 0 after the 43 layers; a later snapshot pads it to 46). */
#define RELEASE_HEAD \
    "{\"architectures\": [\"DeepseekV4ForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0," \
    " \"bos_token_id\": 0, \"eos_token_id\": 1, \"expert_dtype\": \"fp4\", \"hc_eps\": 1e-06, \"hc_mult\": 4," \
    " \"hc_sinkhorn_iters\": 20, \"head_dim\": 512, \"hidden_act\": \"silu\", \"hidden_size\": 4096," \
    " \"index_head_dim\": 128, \"index_n_heads\": 64, \"index_topk\": 512, \"initializer_range\": 0.02," \
    " \"max_position_embeddings\": 1048576, \"model_type\": \"deepseek_v4\", \"moe_intermediate_size\": 2048," \
    " \"n_routed_experts\": 256, \"n_shared_experts\": 1, \"norm_topk_prob\": true, \"num_attention_heads\": 64," \
    " \"num_experts_per_tok\": 6, \"num_hidden_layers\": 43, \"num_hash_layers\": 3, \"num_key_value_heads\": 1," \
    " \"num_nextn_predict_layers\": 1, \"o_groups\": 8, \"o_lora_rank\": 1024, \"q_lora_rank\": 1024," \
    " \"qk_rope_head_dim\": 64, \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\"," \
    " \"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\", \"weight_block_size\": [128, 128]}," \
    " \"rms_norm_eps\": 1e-06, \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 16," \
    " \"original_max_position_embeddings\": 65536, \"type\": \"yarn\"}, \"rope_theta\": 10000," \
    " \"routed_scaling_factor\": 1.5, \"scoring_func\": \"sqrtsoftplus\", \"sliding_window\": 128," \
    " \"swiglu_limit\": 10.0, \"tie_word_embeddings\": false, \"topk_method\": \"noaux_tc\"," \
    " \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.57.1\", \"use_cache\": true," \
    " \"vocab_size\": 129280, \"compress_rope_theta\": 160000, \"compress_ratios\": [0, 0, " \
    "4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, " \
    "4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0"

static void test_release_config(void **state)
{
    static const char *variants[] = { RELEASE_HEAD "]}", RELEASE_HEAD ", 0, 0]}" };

    for (int v = 0; v < 2; v++) {
        struct dsv4_config c;

        parse_ok(variants[v], &c);
        assert_int_equal(c.n_layers, 43);
        assert_int_equal(c.n_mtp_layers, 1);
        assert_int_equal(c.rope_dim, 64);
        for (int i = 0; i < 43; i++) {
            assert_int_equal(c.compress_ratio[i], i < 2 ? 0 : i % 2 ? 128 : 4);
            assert_int_equal(c.mlp_type[i], i < 3 ? DSV4_MLP_HASH : DSV4_MLP_MOE);
        }
        assert_true(c.rope_main.theta == 10000.0 && !c.rope_main.yarn);
        assert_true(c.rope_compress.theta == 160000.0 && c.rope_compress.yarn);
        assert_true(c.rope_compress.yarn_factor == 16.0);
        assert_int_equal(c.rope_compress.yarn_original_max, 65536);
        assert_true(c.rope_compress.beta_fast == 32.0 && c.rope_compress.beta_slow == 1.0);
        assert_int_equal(c.index_topk, 512);
        assert_true(c.routed_scaling_factor == 1.5);
    }
}

static void expect_refused(const char *json, int code, const char *field)
{
    struct dsv4_config c;
    int r = dsv4_config_parse(json, "config.json", &c);

    if (r != code)
        fail_msg("expected %d, got %d (%s) for %s", code, r, dsv4_error_message(), json);
    if (!strstr(dsv4_error_message(), field))
        fail_msg("message does not name %s: %s", field, dsv4_error_message());
    if (!strstr(dsv4_error_message(), "config.json"))
        fail_msg("message does not name the file: %s", dsv4_error_message());
}

#define HF "{\"model_type\": \"deepseek_v4\", "

static void test_transformers_refusals(void **state)
{
    expect_refused(HF "\"num_key_value_heads\": 2}", -ENOTSUP, "num_key_value_heads");
    expect_refused(HF "\"eos_token_id\": [\"x\"]}", -EINVAL, "eos_token_id");
    expect_refused(HF "\"scoring_func\": \"softmax\"}", -ENOTSUP, "scoring_func");
    expect_refused(HF "\"hidden_act\": \"gelu\"}", -ENOTSUP, "hidden_act");
    expect_refused(HF "\"num_hidden_layers\": 4, \"layer_types\": [\"sliding_attention\","
                   " \"sliding_attention\", \"sliding_attention\"]}", -EINVAL, "layer_types");
    expect_refused(HF "\"num_hidden_layers\": 2, \"layer_types\": [\"sliding_attention\", \"full\"]}",
                   -EINVAL, "layer_types[1]");
    expect_refused(HF "\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"moe\", \"dense\"]}", -EINVAL,
                   "mlp_layer_types[1]");
    expect_refused(HF "\"num_hidden_layers\": 2, \"compress_ratios\": [0, 16]}", -EINVAL, "compress_ratios[1]");
    expect_refused(HF "\"num_hidden_layers\": 129}", -EINVAL, "num_hidden_layers");
    expect_refused(HF "\"num_hidden_layers\": 0}", -EINVAL, "num_hidden_layers");
    expect_refused(HF "\"hidden_size\": \"4096\"}", -EINVAL, "hidden_size");
    expect_refused(HF "\"qk_rope_head_dim\": 32, \"partial_rotary_factor\": 0.125}", -EINVAL, "qk_rope_head_dim");
    expect_refused(HF "\"num_attention_heads\": 6, \"o_groups\": 4}", -EINVAL, "o_groups");
    expect_refused(HF "\"num_experts_per_tok\": 17}", -EINVAL, "num_experts_per_tok");
    expect_refused(HF "\"n_routed_experts\": 4}", -EINVAL, "routed experts");
    expect_refused(HF "\"n_shared_experts\": 2}", -ENOTSUP, "n_shared_experts");
    expect_refused(HF "\"norm_topk_prob\": false}", -ENOTSUP, "norm_topk_prob");
    expect_refused(HF "\"hc_mult\": 9}", -EINVAL, "hc_mult");
    expect_refused(HF "\"swiglu_limit\": 0}", -ENOTSUP, "swiglu_limit");
    expect_refused(HF "\"attention_bias\": true}", -ENOTSUP, "attention_bias");
    expect_refused(HF "\"compress_rates\": {\"compressed_sparse_attention\": 4, "
                   "\"heavily_compressed_attention\": 4}}", -ENOTSUP, "compress rates");
    expect_refused(HF "\"rope_parameters\": {\"rope_type\": \"llama3\", \"factor\": 8}}", -ENOTSUP,
                   "rope_parameters.compress.rope_type");
    expect_refused(HF "\"rope_parameters\": {\"main\": {\"rope_type\": \"default\"}}}", -EINVAL, "rope_parameters");
    expect_refused(HF "\"rope_parameters\": {\"main\": {\"rope_type\": \"default\", \"partial_rotary_factor\": 0.125},"
                   " \"compress\": {\"rope_type\": \"yarn\", \"factor\": 16, \"partial_rotary_factor\": 0.125}}}",
                   -ENOTSUP, "rope_parameters.compress.attention_factor");
    expect_refused(HF "\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 16, \"attention_factor\": 1.3}}",
                   -ENOTSUP, "attention_factor");
    expect_refused(HF "\"rope_parameters\": {\"main\": {\"rope_type\": \"default\"}, \"compress\": "
                   "{\"rope_type\": \"default\"}}}", -ENOTSUP, "partial_rotary_factor");
    /* a base of 1 (above) refused here too, also where the nested dicts take it from the top level */
    expect_refused(HF "\"rope_theta\": 1.0, \"rope_parameters\": {\"main\": {\"rope_type\": \"default\","
                   " \"partial_rotary_factor\": 0.125}, \"compress\": {\"rope_type\": \"default\","
                   " \"partial_rotary_factor\": 0.125, \"rope_theta\": 160000}}}", -EINVAL, "rope_theta");
    expect_refused(HF "\"rope_theta\": 1}", -EINVAL, "rope_theta");
    expect_refused(HF "\"compress_rope_theta\": 1}", -EINVAL, "compress_rope_theta");
    expect_refused("{\"model_type\": \"deepseek_v3\"}", -ENOTSUP, "model_type");
    expect_refused("{\"hidden_size\": 64}", -EINVAL, "model_type");
    expect_refused("{\"model_type\": \"deepseek_v4\", \"vocab_size\": 3", -EINVAL, "corrupt JSON");
    expect_refused("{\"model_type\": \"deepseek_v4\", \"model_type\": \"deepseek_v4\"}", -EINVAL, "corrupt JSON");
}

/* DeepSeek's inference config: compress_ratios with the MTP layer's trailing 0, ratio 4 = CSA,
 * the other non-zero ratio HCA, first n_hash_layers hash-routed, YaRN on when original_seq_len > 0. */
#define OFFICIAL_BODY \
    "\"vocab_size\": 1000, \"dim\": 256, \"moe_inter_dim\": 64, \"n_layers\": 4, \"n_hash_layers\": 2," \
    " \"n_mtp_layers\": 1, \"n_heads\": 8, \"n_routed_experts\": 16, \"n_shared_experts\": 1," \
    " \"n_activated_experts\": 2, \"score_func\": \"sqrtsoftplus\", \"route_scale\": 2.5," \
    " \"swiglu_limit\": 10.0, \"q_lora_rank\": 64, \"head_dim\": 128, \"rope_head_dim\": 32," \
    " \"norm_eps\": 1e-6, \"o_groups\": 4, \"o_lora_rank\": 32, \"window_size\": 64," \
    " \"compress_rope_theta\": 160000, \"rope_theta\": 10000, \"rope_factor\": 16, \"beta_fast\": 32," \
    " \"beta_slow\": 1, \"index_n_heads\": 8, \"index_head_dim\": 64, \"index_topk\": 16, \"hc_mult\": 4," \
    " \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-6, \"dtype\": \"fp8\", \"scale_fmt\": \"ue8m0\"," \
    " \"expert_dtype\": \"fp4\", \"max_batch_size\": 4, \"max_seq_len\": 4096"

static void test_official(void **state)
{
    struct dsv4_config c;
    const int ratios[4] = { 0, 4, 128, 4 };

    parse_ok("{" OFFICIAL_BODY ", \"original_seq_len\": 65536, \"compress_ratios\": [0, 4, 128, 4, 0]}", &c);
    assert_int_equal(c.vocab_size, 1000);
    assert_int_equal(c.dim, 256);
    assert_int_equal(c.moe_inter, 64);
    assert_int_equal(c.n_layers, 4);
    assert_int_equal(c.n_mtp_layers, 1);
    assert_int_equal(c.n_heads, 8);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.rope_dim, 32);
    assert_int_equal(c.window, 64);
    assert_int_equal(c.n_experts, 16);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_true(c.routed_scaling_factor == 2.5);
    assert_true(c.norm_topk_prob);
    assert_int_equal(c.csa_ratio, 4);
    assert_int_equal(c.hca_ratio, 128);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(c.compress_ratio[i], ratios[i]);
        assert_int_equal(c.mlp_type[i], i < 2 ? DSV4_MLP_HASH : DSV4_MLP_MOE);
    }
    assert_true(c.rope_compress.yarn && c.rope_compress.theta == 160000.0);
    assert_true(c.rope_compress.yarn_factor == 16.0);
    assert_int_equal(c.rope_compress.yarn_original_max, 65536);
    assert_false(c.rope_main.yarn);
    assert_true(c.rope_main.theta == 10000.0);

    parse_ok("{" OFFICIAL_BODY ", \"original_seq_len\": 0, \"compress_ratios\": [0, 4, 16, 0]}", &c);
    assert_false(c.rope_compress.yarn);
    assert_int_equal(c.hca_ratio, 16);

    expect_refused("{" OFFICIAL_BODY ", \"compress_ratios\": [0, 4, 128]}", -EINVAL, "compress_ratios");
    expect_refused("{" OFFICIAL_BODY ", \"compress_ratios\": [0, 4, 128, 4, 4]}", -ENOTSUP, "compress_ratios[4]");
    expect_refused("{" OFFICIAL_BODY ", \"compress_ratios\": [0, 4, 128, 64]}", -ENOTSUP, "compress_ratios[3]");
    expect_refused("{" OFFICIAL_BODY "}", -EINVAL, "compress_ratios");
    expect_refused("{\"score_func\": \"sigmoid\", \"dim\": 64, \"n_layers\": 1, \"compress_ratios\": [0]}",
                   -ENOTSUP, "score_func");
    expect_refused("{\"dim\": 64, \"n_layers\": 200, \"compress_ratios\": [0]}", -EINVAL, "n_layers");
    expect_refused("{\"dim\": 64, \"n_layers\": 1, \"rope_head_dim\": 31, \"compress_ratios\": [0]}", -EINVAL,
                   "rotary dims");
    /* a base of 1 turns every frequency into 1, and YaRN's ramp (log base in a denominator) into NaN */
    expect_refused("{\"dim\": 64, \"n_layers\": 1, \"compress_rope_theta\": 1, \"compress_ratios\": [0]}", -EINVAL,
                   "compress_rope_theta");
    expect_refused("{\"dim\": 64, \"n_layers\": 1, \"rope_theta\": 1.0, \"compress_ratios\": [0]}", -EINVAL,
                   "rope_theta");
}

static void test_load_dir(void **state)
{
    char *dir = stw_tempdir(), sub[4200];
    struct dsv4_config c;
    int r;

    assert_non_null(dir);
    snprintf(sub, sizeof(sub), "%s/", dir);
    assert_int_equal(stw_write_text(dir, "config.json", tiny_json), 0);
    assert_int_equal(dsv4_config_load(sub, &c), 0);
    /* no _name_or_path: the directory's name */
    assert_string_equal(c.model_name, strrchr(dir, '/') + 1);
    assert_int_equal(c.n_layers, 4);
    assert_int_equal(stw_write_text(dir, "config.json", "{\"model_type\": \"deepseek_v4\", "
                                    "\"_name_or_path\": \"deepseek-ai/DeepSeek-V4-Flash\"}"), 0);
    assert_int_equal(dsv4_config_load(dir, &c), 0);
    assert_string_equal(c.model_name, "DeepSeek-V4-Flash");
    stw_rmdir(dir);
    r = dsv4_config_load(dir, &c);
    assert_int_equal(r, -ENOENT);
    assert_non_null(strstr(dsv4_error_message(), "config.json"));
    free(dir);
}

/* model_name goes out in every hello reply, whose strings the client refuses unless they are UTF-8:
 * a long name is cut between characters, and a directory name that is not UTF-8 is repaired. */
static void test_model_name_utf8(void **state)
{
    char json[1024], *dir, sub[512];
    struct dsv4_config c;
    size_t off;

    (void)state;
    off = (size_t)snprintf(json, sizeof(json), "{\"model_type\": \"deepseek_v4\", \"_name_or_path\": \"org/");
    for (int i = 0; i < 100; i++)
        off += (size_t)snprintf(json + off, sizeof(json) - off, "\xc3\xa9");    /* U+00E9, 2 bytes */
    snprintf(json + off, sizeof(json) - off, "\"}");
    parse_ok(json, &c);
    assert_true(dsv4_utf8_valid(c.model_name, strlen(c.model_name)));
    assert_int_equal(strlen(c.model_name), 126);     /* 63 whole characters of the 127 bytes that fit */

    dir = stw_tempdir();
    assert_non_null(dir);
    assert_true((size_t)snprintf(sub, sizeof(sub), "%s/mod\xe8le", dir) < sizeof(sub));  /* Latin-1 */
    assert_int_equal(mkdir(sub, 0700), 0);
    assert_int_equal(stw_write_text(sub, "config.json", tiny_json), 0);
    assert_int_equal(dsv4_config_load(sub, &c), 0);
    assert_true(dsv4_utf8_valid(c.model_name, strlen(c.model_name)));
    assert_string_equal(c.model_name, "mod" DSV4_UTF8_REPLACEMENT "le");
    stw_rmdir(sub);
    stw_rmdir(dir);
    free(dir);
}

/* The prefix-cache block is the least common multiple of the window and the compress ratios; past
 * DSV4_PREFIX_BLOCK_MAX the refusal says how to boot anyway (the cache is on by default). */
static void test_prefix_block(void **state)
{
    struct dsv4_config c;

    (void)state;
    parse_ok(tiny_json, &c);
    assert_int_equal(dsv4_config_prefix_block(&c), 8);
    parse_ok("{\"model_type\": \"deepseek_v4\"}", &c);
    assert_int_equal(dsv4_config_prefix_block(&c), 128);
    parse_ok("{\"model_type\": \"deepseek_v4\", \"sliding_window\": 4097}", &c);
    assert_int_equal(dsv4_config_prefix_block(&c), -ERANGE);
    assert_non_null(strstr(dsv4_error_message(), "window 4097"));
    assert_non_null(strstr(dsv4_error_message(), "set the pool to 0"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_transformers_tiny),
        cmocka_unit_test(test_transformers_defaults),
        cmocka_unit_test(test_transformers_legacy),
        cmocka_unit_test(test_transformers_rope),
        cmocka_unit_test(test_release_config),
        cmocka_unit_test(test_transformers_refusals),
        cmocka_unit_test(test_official),
        cmocka_unit_test(test_load_dir),
        cmocka_unit_test(test_model_name_utf8),
        cmocka_unit_test(test_prefix_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
