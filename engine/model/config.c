/* SPDX-License-Identifier: MIT */
/* config.json in its two spellings.
 *
 * transformers (model_type "deepseek_v4", DeepseekV4Config): the defaults and legacy folds of
 * configuration_deepseek_v4.py are reproduced exactly:
 *   - compress_rates default {CSA: 4, HCA: 128}; legacy compress_rate_csa / compress_rate_hca override.
 *   - layer_types: explicit > legacy compress_ratios (0/4/128 only) > [HCA, HCA] + (i % 2 ? CSA : HCA);
 *     lists longer than num_hidden_layers are truncated, shorter ones refused.
 *   - mlp_layer_types: explicit > first num_hash_layers (legacy, default 3) "hash_moe", rest "moe".
 *   - partial_rotary_factor: explicit > legacy qk_rope_head_dim / head_dim > 64/512;
 *     rope dims = int(head_dim * factor).
 *   - rope_parameters (or legacy rope_scaling): nested {main, compress} is used as is (missing
 *     rope_theta -> top-level rope_theta, missing partial_rotary_factor -> the top-level field or
 *     1.0); a flat dict becomes compress's extra fields with compress_rope_theta, rope_type
 *     default "default", and for yarn attention_factor 1.0 and original_max_position_embeddings
 *     = max_position_embeddings; main is always plain RoPE with rope_theta.
 *   - yarn: factor (null -> max_position / original), beta_fast `or` 32, beta_slow `or` 1.
 *
 * DeepSeek's inference config (ModelArgs of the release's inference/model.py): vocab_size, dim,
 * moe_inter_dim, n_layers, n_hash_layers, n_mtp_layers, n_heads, n_routed_experts,
 * n_shared_experts, n_activated_experts, score_func, route_scale, swiglu_limit, q_lora_rank,
 * head_dim, rope_head_dim, norm_eps, o_groups, o_lora_rank, window_size, compress_ratios (one per
 * layer, optionally followed by the MTP layers' 0), compress_rope_theta, original_seq_len
 * (0 disables YaRN), rope_theta, rope_factor, beta_fast, beta_slow, index_n_heads,
 * index_head_dim, index_topk, hc_mult, hc_sinkhorn_iters, hc_eps; dtype, scale_fmt,
 * expert_dtype, max_batch_size and max_seq_len describe the runtime, not the model, and are not
 * read. A ratio of 4 is CSA (the reference builds an indexer exactly then), any other non-zero
 * ratio HCA. The first n_hash_layers layers route by hash; an absent field takes the V4-Flash
 * value, which is also transformers' default.
 */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/utf8.h"
#include "engine/model/config.h"
#include "engine/error.h"

#define CSA_TYPE "compressed_sparse_attention"
#define HCA_TYPE "heavily_compressed_attention"
#define SLIDING_TYPE "sliding_attention"
#define CONFIG_MAX_BYTES (1u << 20)

struct parser {
    json_t *root;
    const char *name;           /* file name, for messages */
};

/* Field access: absent or null takes the default; wrong type or range is refused. */
static int get_int(const struct parser *p, json_t *obj, const char *key, int64_t def, int64_t min,
                   int64_t max, int64_t *ret)
{
    json_t *v = json_object_get(obj, key);

    if (!v || json_is_null(v)) {
        *ret = def;
        return 0;
    }
    if (!json_is_integer(v))
        return dsv4_error_set(-EINVAL, "%s: field %s must be an integer", p->name, key);
    if (json_integer_value(v) < min || json_integer_value(v) > max)
        return dsv4_error_set(-EINVAL, "%s: field %s = %lld outside the supported range [%lld, %lld]",
                              p->name, key, (long long)json_integer_value(v), (long long)min,
                              (long long)max);
    *ret = json_integer_value(v);
    return 0;
}

static int get_i(const struct parser *p, json_t *obj, const char *key, int def, int min, int max, int *ret)
{
    int64_t v;
    int r = get_int(p, obj, key, def, min, max, &v);

    if (r == 0)
        *ret = (int)v;
    return r;
}

static int get_num(const struct parser *p, json_t *obj, const char *key, double def, double min,
                   double max, double *ret)
{
    json_t *v = json_object_get(obj, key);

    if (!v || json_is_null(v)) {
        *ret = def;
        return 0;
    }
    if (!json_is_number(v))
        return dsv4_error_set(-EINVAL, "%s: field %s must be a number", p->name, key);
    if (!(json_number_value(v) >= min && json_number_value(v) <= max))
        return dsv4_error_set(-EINVAL, "%s: field %s = %g outside the supported range [%g, %g]",
                              p->name, key, json_number_value(v), min, max);
    *ret = json_number_value(v);
    return 0;
}

static int get_bool(const struct parser *p, json_t *obj, const char *key, bool def, bool *ret)
{
    json_t *v = json_object_get(obj, key);

    if (!v || json_is_null(v)) {
        *ret = def;
        return 0;
    }
    if (!json_is_boolean(v))
        return dsv4_error_set(-EINVAL, "%s: field %s must be true or false", p->name, key);
    *ret = json_is_true(v);
    return 0;
}

static int get_str(const struct parser *p, json_t *obj, const char *key, const char *def, const char **ret)
{
    json_t *v = json_object_get(obj, key);

    if (!v || json_is_null(v)) {
        *ret = def;
        return 0;
    }
    if (!json_is_string(v))
        return dsv4_error_set(-EINVAL, "%s: field %s must be a string", p->name, key);
    *ret = json_string_value(v);
    return 0;
}

static int require_str(const struct parser *p, json_t *obj, const char *key, const char *def,
                       const char *want, const char *why)
{
    const char *s;
    int r = get_str(p, obj, key, def, &s);

    if (r < 0)
        return r;
    if (strcmp(s, want) != 0)
        return dsv4_error_set(-ENOTSUP, "%s: field %s = \"%s\" is not supported (%s)", p->name, key, s, why);
    return 0;
}

/* bos/eos: an integer or (eos) a list whose first entry is taken. */
static int get_token(const struct parser *p, const char *key, int def, int *ret)
{
    json_t *v = json_object_get(p->root, key);

    if (json_is_array(v) && json_array_size(v) > 0)
        v = json_array_get(v, 0);
    if (!v || json_is_null(v) || (json_is_array(v) && json_array_size(v) == 0)) {
        *ret = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= DSV4_MAX_VOCAB)
        return dsv4_error_set(-EINVAL, "%s: field %s must be a token id", p->name, key);
    *ret = (int)json_integer_value(v);
    return 0;
}

/* One transformers rope dict (after the defaulting described at the top) -> *ret, *ret_factor. */
static int parse_hf_rope(const struct parser *p, json_t *d, const char *label, double def_theta,
                         double def_prf, bool yarn_attention_default, int64_t max_pos,
                         struct dsv4_rope *ret, double *ret_prf)
{
    char field[96];
    const char *type = "default";
    json_t *v, *jt = json_object_get(d, "rope_type");
    double orig;

    if (!jt || json_is_null(jt))
        jt = json_object_get(d, "type");
    if (jt && !json_is_null(jt)) {
        if (!json_is_string(jt))
            return dsv4_error_set(-EINVAL, "%s: field rope_parameters.%s.rope_type must be a string",
                                  p->name, label);
        type = json_string_value(jt);
    }
    snprintf(field, sizeof(field), "rope_parameters.%s.rope_theta", label);
    v = json_object_get(d, "rope_theta");
    ret->theta = def_theta;
    if (v && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) > 1.0))
            return dsv4_error_set(-EINVAL, "%s: field %s must be a number > 1", p->name, field);
        ret->theta = json_number_value(v);
    }
    v = json_object_get(d, "partial_rotary_factor");
    *ret_prf = def_prf;
    if (v && !json_is_null(v)) {
        if (!json_is_number(v) || !(json_number_value(v) > 0.0 && json_number_value(v) <= 1.0))
            return dsv4_error_set(-EINVAL, "%s: field rope_parameters.%s.partial_rotary_factor must "
                                  "be in (0, 1]", p->name, label);
        *ret_prf = json_number_value(v);
    }
    ret->yarn = false;
    ret->yarn_factor = 1.0;
    ret->yarn_original_max = 0;
    ret->beta_fast = 32.0;
    ret->beta_slow = 1.0;
    if (strcmp(type, "default") == 0)
        return 0;
    if (strcmp(type, "yarn") != 0)
        return dsv4_error_set(-ENOTSUP, "%s: field rope_parameters.%s.rope_type = \"%s\" is not "
                              "supported (default or yarn)", p->name, label, type);
    ret->yarn = true;
    v = json_object_get(d, "original_max_position_embeddings");
    if (v && !json_is_null(v)) {
        if (!json_is_integer(v) || json_integer_value(v) < 1)
            return dsv4_error_set(-EINVAL, "%s: field rope_parameters.%s.original_max_position_embeddings "
                                  "must be a positive integer", p->name, label);
        ret->yarn_original_max = json_integer_value(v);
    } else {
        ret->yarn_original_max = max_pos;
    }
    orig = (double)ret->yarn_original_max;
    v = json_object_get(d, "factor");
    if (!v || json_is_null(v)) {
        ret->yarn_factor = (double)max_pos / orig;
    } else {
        if (!json_is_number(v) || !(json_number_value(v) >= 1.0))
            return dsv4_error_set(-EINVAL, "%s: field rope_parameters.%s.factor must be a number >= 1",
                                  p->name, label);
        ret->yarn_factor = json_number_value(v);
    }
    /* transformers reads these with `or`: 0 and null both mean the default */
    v = json_object_get(d, "beta_fast");
    if (json_is_number(v) && json_number_value(v) != 0.0)
        ret->beta_fast = json_number_value(v);
    else if (v && !json_is_null(v) && !json_is_number(v))
        return dsv4_error_set(-EINVAL, "%s: field rope_parameters.%s.beta_fast must be a number", p->name, label);
    v = json_object_get(d, "beta_slow");
    if (json_is_number(v) && json_number_value(v) != 0.0)
        ret->beta_slow = json_number_value(v);
    else if (v && !json_is_null(v) && !json_is_number(v))
        return dsv4_error_set(-EINVAL, "%s: field rope_parameters.%s.beta_slow must be a number", p->name, label);
    if (!(ret->beta_slow > 0.0 && ret->beta_fast > ret->beta_slow))
        return dsv4_error_set(-EINVAL, "%s: fields rope_parameters.%s.beta_fast/beta_slow must satisfy "
                              "beta_fast > beta_slow > 0", p->name, label);
    /* without attention_factor transformers scales cos/sin by YaRN's mscale, which V4 never does */
    v = json_object_get(d, "attention_factor");
    if (!v || json_is_null(v)) {
        if (!yarn_attention_default)
            return dsv4_error_set(-ENOTSUP, "%s: field rope_parameters.%s.attention_factor is missing: "
                                  "transformers would scale cos/sin by YaRN's mscale; only 1.0 is "
                                  "supported", p->name, label);
    } else if (!json_is_number(v) || json_number_value(v) != 1.0) {
        return dsv4_error_set(-ENOTSUP, "%s: field rope_parameters.%s.attention_factor must be 1.0 "
                              "(V4 applies no YaRN mscale)", p->name, label);
    }
    return 0;
}

static int hf_rope(const struct parser *p, struct dsv4_config *c, double prf, bool prf_given,
                   double top_prf)
{
    json_t *rp = json_object_get(p->root, "rope_scaling");
    json_t *main_d, *comp_d;
    double rope_theta, compress_theta, prf_main, prf_comp;
    int r, dim_main, dim_comp;

    /* transformers: `rope_scaling or rope_parameters`, so an empty rope_scaling falls through */
    if (!rp || json_is_null(rp) || (json_is_object(rp) && json_object_size(rp) == 0))
        rp = json_object_get(p->root, "rope_parameters");
    if (rp && !json_is_null(rp) && !json_is_object(rp))
        return dsv4_error_set(-EINVAL, "%s: field rope_parameters must be an object", p->name);
    r = get_num(p, p->root, "rope_theta", 10000.0, 1.0, 1e12, &rope_theta);
    if (r == 0)
        r = get_num(p, p->root, "compress_rope_theta", 160000.0, 1.0, 1e12, &compress_theta);
    if (r < 0)
        return r;
    /* a base of 1 makes every frequency 1 and YaRN's ramp NaN; the nested dicts default to these */
    if (!(rope_theta > 1.0) || !(compress_theta > 1.0))
        return dsv4_error_set(-EINVAL, "%s: field %s must be a number > 1", p->name,
                              rope_theta > 1.0 ? "compress_rope_theta" : "rope_theta");
    main_d = json_object_get(rp, "main");
    comp_d = json_object_get(rp, "compress");
    if (json_is_object(main_d) && json_is_object(comp_d)) {
        double def_prf = prf_given ? top_prf : 1.0;

        r = parse_hf_rope(p, main_d, "main", rope_theta, def_prf, false, c->max_position,
                          &c->rope_main, &prf_main);
        if (r == 0)
            r = parse_hf_rope(p, comp_d, "compress", rope_theta, def_prf, false, c->max_position,
                              &c->rope_compress, &prf_comp);
    } else if (main_d || comp_d) {
        return dsv4_error_set(-EINVAL, "%s: field rope_parameters must hold both \"main\" and "
                              "\"compress\" objects, or neither", p->name);
    } else {
        json_t *flat = rp && json_is_object(rp) ? json_deep_copy(rp) : json_object();
        json_t *main_flat = json_object();

        if (!flat || !main_flat) {
            json_decref(flat);
            json_decref(main_flat);
            return dsv4_error_set(-ENOMEM, "out of memory parsing %s", p->name);
        }
        json_object_set_new(flat, "rope_theta", json_real(compress_theta));
        json_object_set_new(flat, "partial_rotary_factor", json_real(prf));
        json_object_set_new(main_flat, "rope_theta", json_real(rope_theta));
        json_object_set_new(main_flat, "partial_rotary_factor", json_real(prf));
        r = parse_hf_rope(p, main_flat, "main", rope_theta, prf, true, c->max_position,
                          &c->rope_main, &prf_main);
        if (r == 0)
            r = parse_hf_rope(p, flat, "compress", compress_theta, prf, true, c->max_position,
                              &c->rope_compress, &prf_comp);
        json_decref(flat);
        json_decref(main_flat);
    }
    if (r < 0)
        return r;
    dim_main = (int)(c->head_dim * prf_main);
    dim_comp = (int)(c->head_dim * prf_comp);
    if (dim_main != c->rope_dim || dim_comp != c->rope_dim)
        return dsv4_error_set(-ENOTSUP, "%s: field rope_parameters: partial_rotary_factor gives %d "
                              "(main) and %d (compress) rotary dims, but the model's qk_rope_head_dim "
                              "is %d", p->name, dim_main, dim_comp, c->rope_dim);
    return 0;
}

static int hf_layer_types(const struct parser *p, struct dsv4_config *c)
{
    json_t *lt = json_object_get(p->root, "layer_types");
    json_t *cr = json_object_get(p->root, "compress_ratios");
    json_t *mt = json_object_get(p->root, "mlp_layer_types");
    int n = c->n_layers;
    size_t i;
    json_t *v;

    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt))
            return dsv4_error_set(-EINVAL, "%s: field layer_types must be a list", p->name);
        if (json_array_size(lt) < (size_t)n)
            return dsv4_error_set(-EINVAL, "%s: field layer_types has %zu entries, num_hidden_layers is %d",
                                  p->name, json_array_size(lt), n);
        for (i = 0; i < (size_t)n; i++) {
            const char *s = json_string_value(json_array_get(lt, i));

            if (s && strcmp(s, SLIDING_TYPE) == 0)
                c->compress_ratio[i] = 0;
            else if (s && strcmp(s, CSA_TYPE) == 0)
                c->compress_ratio[i] = c->csa_ratio;
            else if (s && strcmp(s, HCA_TYPE) == 0)
                c->compress_ratio[i] = c->hca_ratio;
            else
                return dsv4_error_set(-EINVAL, "%s: field layer_types[%zu] must be one of "
                                      SLIDING_TYPE ", " CSA_TYPE ", " HCA_TYPE, p->name, i);
        }
    } else if (cr && !json_is_null(cr)) {
        if (!json_is_array(cr))
            return dsv4_error_set(-EINVAL, "%s: field compress_ratios must be a list", p->name);
        if (json_array_size(cr) < (size_t)n)
            return dsv4_error_set(-EINVAL, "%s: field compress_ratios has %zu entries, num_hidden_layers "
                                  "is %d", p->name, json_array_size(cr), n);
        for (i = 0; i < (size_t)n; i++) {
            json_int_t r = json_is_integer(json_array_get(cr, i)) ? json_integer_value(json_array_get(cr, i)) : -1;

            /* transformers maps exactly these three values to layer types */
            if (r == 0)
                c->compress_ratio[i] = 0;
            else if (r == 4)
                c->compress_ratio[i] = c->csa_ratio;
            else if (r == 128)
                c->compress_ratio[i] = c->hca_ratio;
            else
                return dsv4_error_set(-EINVAL, "%s: field compress_ratios[%zu] must be 0, 4 or 128",
                                      p->name, i);
        }
    } else {
        for (i = 0; i < (size_t)n; i++)
            c->compress_ratio[i] = i < 2 ? c->hca_ratio : ((i - 2) % 2 ? c->csa_ratio : c->hca_ratio);
    }

    if (mt && !json_is_null(mt)) {
        if (!json_is_array(mt))
            return dsv4_error_set(-EINVAL, "%s: field mlp_layer_types must be a list", p->name);
        if (json_array_size(mt) < (size_t)n)
            return dsv4_error_set(-EINVAL, "%s: field mlp_layer_types has %zu entries, num_hidden_layers "
                                  "is %d", p->name, json_array_size(mt), n);
        json_array_foreach(mt, i, v) {
            const char *s = json_string_value(v);

            if (i >= (size_t)n)
                break;
            if (s && strcmp(s, "hash_moe") == 0)
                c->mlp_type[i] = DSV4_MLP_HASH;
            else if (s && strcmp(s, "moe") == 0)
                c->mlp_type[i] = DSV4_MLP_MOE;
            else
                return dsv4_error_set(-EINVAL, "%s: field mlp_layer_types[%zu] must be \"hash_moe\" or "
                                      "\"moe\"", p->name, i);
        }
    } else {
        int n_hash = 0, r = get_i(p, p->root, "num_hash_layers", 3, 0, DSV4_MAX_LAYERS * 16, &n_hash);

        if (r < 0)
            return r;
        for (i = 0; i < (size_t)n; i++)
            c->mlp_type[i] = (int)i < n_hash ? DSV4_MLP_HASH : DSV4_MLP_MOE;
    }
    return 0;
}

static int parse_hf(const struct parser *p, struct dsv4_config *c)
{
    json_t *root = p->root, *rates = json_object_get(root, "compress_rates");
    int64_t qk_rope = -1;
    double prf = 0.0;
    bool prf_given, b;
    int r, kv_heads = 1;

    if ((r = get_i(p, root, "vocab_size", 129280, 1, DSV4_MAX_VOCAB, &c->vocab_size)) < 0 ||
        (r = get_i(p, root, "hidden_size", 4096, 1, DSV4_MAX_DIM, &c->dim)) < 0 ||
        (r = get_i(p, root, "moe_intermediate_size", 2048, 1, DSV4_MAX_DIM * 4, &c->moe_inter)) < 0 ||
        (r = get_i(p, root, "num_hidden_layers", 43, 1, DSV4_MAX_LAYERS, &c->n_layers)) < 0 ||
        (r = get_i(p, root, "num_attention_heads", 64, 1, DSV4_MAX_HEADS, &c->n_heads)) < 0 ||
        (r = get_i(p, root, "num_key_value_heads", 1, 0, DSV4_MAX_HEADS, &kv_heads)) < 0 ||
        (r = get_i(p, root, "head_dim", 512, 2, DSV4_MAX_HEAD_DIM, &c->head_dim)) < 0 ||
        (r = get_i(p, root, "q_lora_rank", 1024, 1, DSV4_MAX_DIM, &c->q_lora_rank)) < 0 ||
        (r = get_i(p, root, "num_experts_per_tok", 6, 1, DSV4_MAX_TOPK, &c->n_experts_per_tok)) < 0 ||
        (r = get_i(p, root, "n_routed_experts", 256, 1, DSV4_MAX_EXPERTS, &c->n_experts)) < 0 ||
        (r = get_i(p, root, "n_shared_experts", 1, 0, 1 << 10, &c->n_shared_experts)) < 0 ||
        (r = get_bool(p, root, "norm_topk_prob", true, &c->norm_topk_prob)) < 0 ||
        (r = get_num(p, root, "routed_scaling_factor", 1.5, 0.0, 1e6, &c->routed_scaling_factor)) < 0 ||
        (r = get_int(p, root, "max_position_embeddings", 1048576, 1, INT64_MAX / 2, &c->max_position)) < 0 ||
        (r = get_i(p, root, "hc_mult", 4, 1, DSV4_MAX_HC, &c->hc_mult)) < 0 ||
        (r = get_i(p, root, "hc_sinkhorn_iters", 20, 1, DSV4_MAX_SINKHORN_ITERS, &c->hc_sinkhorn_iters)) < 0 ||
        (r = get_num(p, root, "hc_eps", 1e-6, 0.0, 1.0, &c->hc_eps)) < 0 ||
        (r = get_num(p, root, "swiglu_limit", 10.0, 0.0, 1e30, &c->swiglu_limit)) < 0 ||
        (r = get_i(p, root, "sliding_window", 128, 1, DSV4_MAX_WINDOW, &c->window)) < 0 ||
        (r = get_i(p, root, "o_groups", 8, 1, DSV4_MAX_HEADS, &c->o_groups)) < 0 ||
        (r = get_i(p, root, "o_lora_rank", 1024, 1, DSV4_MAX_DIM, &c->o_lora_rank)) < 0 ||
        (r = get_i(p, root, "index_n_heads", 64, 1, DSV4_MAX_HEADS, &c->index_n_heads)) < 0 ||
        (r = get_i(p, root, "index_head_dim", 128, 2, DSV4_MAX_HEAD_DIM, &c->index_head_dim)) < 0 ||
        (r = get_i(p, root, "index_topk", 512, 1, DSV4_MAX_INDEX_TOPK, &c->index_topk)) < 0 ||
        (r = get_i(p, root, "num_nextn_predict_layers", 1, 0, DSV4_MAX_MTP, &c->n_mtp_layers)) < 0 ||
        (r = get_num(p, root, "rms_norm_eps", 1e-6, 0.0, 1.0, &c->rms_norm_eps)) < 0 ||
        (r = get_token(p, "bos_token_id", 0, &c->bos_id)) < 0 ||
        (r = get_token(p, "eos_token_id", 1, &c->eos_id)) < 0 ||
        (r = get_bool(p, root, "tie_word_embeddings", false, &c->tie_embeddings)) < 0)
        return r;
    if (kv_heads != 1)
        return dsv4_error_set(-ENOTSUP, "%s: field num_key_value_heads = %d: DeepSeek-V4 has one shared "
                              "KV head", p->name, kv_heads);
    if ((r = require_str(p, root, "scoring_func", "sqrtsoftplus", "sqrtsoftplus", "V4 routes with sqrt(softplus)")) < 0 ||
        (r = require_str(p, root, "hidden_act", "silu", "silu", "V4 experts use SwiGLU")) < 0)
        return r;
    if ((r = get_bool(p, root, "attention_bias", false, &b)) < 0)
        return r;
    if (b)
        return dsv4_error_set(-ENOTSUP, "%s: field attention_bias = true is not supported", p->name);
    if ((r = get_bool(p, root, "mlp_bias", false, &b)) < 0)
        return r;
    if (b)
        return dsv4_error_set(-ENOTSUP, "%s: field mlp_bias = true is not supported", p->name);
    if (c->swiglu_limit <= 0.0)
        return dsv4_error_set(-ENOTSUP, "%s: field swiglu_limit = %g: transformers clamps at the value "
                              "itself, so it must be positive", p->name, c->swiglu_limit);

    /* compress_rates: dict default, legacy scalars override */
    c->csa_ratio = 4;
    c->hca_ratio = 128;
    if (rates && !json_is_null(rates)) {
        if (!json_is_object(rates))
            return dsv4_error_set(-EINVAL, "%s: field compress_rates must be an object", p->name);
        if ((r = get_i(p, rates, CSA_TYPE, 4, 1, DSV4_MAX_COMPRESS_RATIO, &c->csa_ratio)) < 0 ||
            (r = get_i(p, rates, HCA_TYPE, 128, 1, DSV4_MAX_COMPRESS_RATIO, &c->hca_ratio)) < 0)
            return dsv4_error_prefix(r, "compress_rates: ");
    }
    if ((r = get_i(p, root, "compress_rate_csa", c->csa_ratio, 1, DSV4_MAX_COMPRESS_RATIO, &c->csa_ratio)) < 0 ||
        (r = get_i(p, root, "compress_rate_hca", c->hca_ratio, 1, DSV4_MAX_COMPRESS_RATIO, &c->hca_ratio)) < 0)
        return r;
    if ((r = hf_layer_types(p, c)) < 0)
        return r;

    /* partial rotary factor and qk_rope_head_dim */
    prf_given = json_is_number(json_object_get(root, "partial_rotary_factor"));
    if ((r = get_num(p, root, "partial_rotary_factor", 0.0, 0.0, 1.0, &prf)) < 0 ||
        (r = get_int(p, root, "qk_rope_head_dim", -1, 1, DSV4_MAX_HEAD_DIM, &qk_rope)) < 0)
        return r;
    if (!prf_given)
        prf = qk_rope > 0 ? (double)qk_rope / c->head_dim : 64.0 / 512.0;
    if (!(prf > 0.0))
        return dsv4_error_set(-EINVAL, "%s: field partial_rotary_factor must be > 0", p->name);
    c->rope_dim = (int)(c->head_dim * prf);
    if (qk_rope > 0 && qk_rope != c->rope_dim)
        return dsv4_error_set(-EINVAL, "%s: field qk_rope_head_dim = %lld disagrees with "
                              "partial_rotary_factor * head_dim = %d", p->name, (long long)qk_rope, c->rope_dim);
    return hf_rope(p, c, prf, prf_given, prf);
}

static int parse_official(const struct parser *p, struct dsv4_config *c)
{
    json_t *root = p->root, *cr = json_object_get(root, "compress_ratios");
    double orig_seq;
    int r, n_hash = 0;
    size_t i, len;

    if ((r = get_i(p, root, "vocab_size", 129280, 1, DSV4_MAX_VOCAB, &c->vocab_size)) < 0 ||
        (r = get_i(p, root, "dim", 4096, 1, DSV4_MAX_DIM, &c->dim)) < 0 ||
        (r = get_i(p, root, "moe_inter_dim", 2048, 1, DSV4_MAX_DIM * 4, &c->moe_inter)) < 0 ||
        (r = get_i(p, root, "n_layers", 43, 1, DSV4_MAX_LAYERS, &c->n_layers)) < 0 ||
        (r = get_i(p, root, "n_hash_layers", 3, 0, DSV4_MAX_LAYERS * 16, &n_hash)) < 0 ||
        (r = get_i(p, root, "n_mtp_layers", 1, 0, DSV4_MAX_MTP, &c->n_mtp_layers)) < 0 ||
        (r = get_i(p, root, "n_heads", 64, 1, DSV4_MAX_HEADS, &c->n_heads)) < 0 ||
        (r = get_i(p, root, "n_routed_experts", 256, 1, DSV4_MAX_EXPERTS, &c->n_experts)) < 0 ||
        (r = get_i(p, root, "n_shared_experts", 1, 0, 1 << 10, &c->n_shared_experts)) < 0 ||
        (r = get_i(p, root, "n_activated_experts", 6, 1, DSV4_MAX_TOPK, &c->n_experts_per_tok)) < 0 ||
        (r = get_num(p, root, "route_scale", 1.5, 0.0, 1e6, &c->routed_scaling_factor)) < 0 ||
        (r = get_num(p, root, "swiglu_limit", 10.0, 0.0, 1e30, &c->swiglu_limit)) < 0 ||
        (r = get_i(p, root, "q_lora_rank", 1024, 1, DSV4_MAX_DIM, &c->q_lora_rank)) < 0 ||
        (r = get_i(p, root, "head_dim", 512, 2, DSV4_MAX_HEAD_DIM, &c->head_dim)) < 0 ||
        (r = get_i(p, root, "rope_head_dim", 64, 2, DSV4_MAX_HEAD_DIM, &c->rope_dim)) < 0 ||
        (r = get_num(p, root, "norm_eps", 1e-6, 0.0, 1.0, &c->rms_norm_eps)) < 0 ||
        (r = get_i(p, root, "o_groups", 8, 1, DSV4_MAX_HEADS, &c->o_groups)) < 0 ||
        (r = get_i(p, root, "o_lora_rank", 1024, 1, DSV4_MAX_DIM, &c->o_lora_rank)) < 0 ||
        (r = get_i(p, root, "window_size", 128, 1, DSV4_MAX_WINDOW, &c->window)) < 0 ||
        (r = get_num(p, root, "rope_theta", 10000.0, 1.0, 1e12, &c->rope_main.theta)) < 0 ||
        (r = get_num(p, root, "compress_rope_theta", 160000.0, 1.0, 1e12, &c->rope_compress.theta)) < 0 ||
        (r = get_num(p, root, "original_seq_len", 65536, 0.0, 1e15, &orig_seq)) < 0 ||
        (r = get_num(p, root, "rope_factor", 16.0, 1.0, 1e9, &c->rope_compress.yarn_factor)) < 0 ||
        (r = get_num(p, root, "beta_fast", 32.0, 0.0, 1e9, &c->rope_compress.beta_fast)) < 0 ||
        (r = get_num(p, root, "beta_slow", 1.0, 0.0, 1e9, &c->rope_compress.beta_slow)) < 0 ||
        (r = get_i(p, root, "index_n_heads", 64, 1, DSV4_MAX_HEADS, &c->index_n_heads)) < 0 ||
        (r = get_i(p, root, "index_head_dim", 128, 2, DSV4_MAX_HEAD_DIM, &c->index_head_dim)) < 0 ||
        (r = get_i(p, root, "index_topk", 512, 1, DSV4_MAX_INDEX_TOPK, &c->index_topk)) < 0 ||
        (r = get_i(p, root, "hc_mult", 4, 1, DSV4_MAX_HC, &c->hc_mult)) < 0 ||
        (r = get_i(p, root, "hc_sinkhorn_iters", 20, 1, DSV4_MAX_SINKHORN_ITERS, &c->hc_sinkhorn_iters)) < 0 ||
        (r = get_num(p, root, "hc_eps", 1e-6, 0.0, 1.0, &c->hc_eps)) < 0 ||
        (r = get_token(p, "bos_token_id", 0, &c->bos_id)) < 0 ||
        (r = get_token(p, "eos_token_id", 1, &c->eos_id)) < 0 ||
        (r = require_str(p, root, "score_func", "sqrtsoftplus", "sqrtsoftplus", "V4 routes with sqrt(softplus)")) < 0)
        return r;
    /* as transformers' spelling: a base of 1 makes every frequency 1 and YaRN's ramp NaN (ln base divides) */
    if (!(c->rope_main.theta > 1.0) || !(c->rope_compress.theta > 1.0))
        return dsv4_error_set(-EINVAL, "%s: field %s must be a number > 1", p->name,
                              c->rope_main.theta > 1.0 ? "compress_rope_theta" : "rope_theta");
    c->norm_topk_prob = true;   /* the reference renormalizes every non-softmax score function */
    c->max_position = 1048576;
    c->tie_embeddings = false;
    c->rope_main.yarn = false;
    c->rope_main.yarn_factor = 1.0;
    c->rope_main.yarn_original_max = 0;
    c->rope_main.beta_fast = c->rope_compress.beta_fast;
    c->rope_main.beta_slow = c->rope_compress.beta_slow;
    c->rope_compress.yarn = orig_seq > 0;
    c->rope_compress.yarn_original_max = (int64_t)orig_seq;
    if (c->rope_compress.yarn && !(c->rope_compress.beta_slow > 0 &&
                                   c->rope_compress.beta_fast > c->rope_compress.beta_slow))
        return dsv4_error_set(-EINVAL, "%s: fields beta_fast/beta_slow must satisfy beta_fast > "
                              "beta_slow > 0", p->name);

    if (!json_is_array(cr))
        return dsv4_error_set(-EINVAL, "%s: field compress_ratios (one per layer) is required", p->name);
    len = json_array_size(cr);
    if (len != (size_t)c->n_layers && len != (size_t)(c->n_layers + c->n_mtp_layers))
        return dsv4_error_set(-EINVAL, "%s: field compress_ratios has %zu entries, expected n_layers = %d "
                              "(or n_layers + n_mtp_layers = %d)", p->name, len, c->n_layers,
                              c->n_layers + c->n_mtp_layers);
    c->csa_ratio = 4;
    c->hca_ratio = 0;
    for (i = 0; i < len; i++) {
        json_t *v = json_array_get(cr, i);
        json_int_t q = json_is_integer(v) ? json_integer_value(v) : -1;

        if (q < 0 || q > DSV4_MAX_COMPRESS_RATIO)
            return dsv4_error_set(-EINVAL, "%s: field compress_ratios[%zu] must be an integer in [0, %d]",
                                  p->name, i, DSV4_MAX_COMPRESS_RATIO);
        if (i >= (size_t)c->n_layers) {
            if (q != 0)
                return dsv4_error_set(-ENOTSUP, "%s: field compress_ratios[%zu] = %lld: the MTP layer must "
                                      "be a sliding-window layer (0)", p->name, i, (long long)q);
            continue;
        }
        if (q != 0 && q != c->csa_ratio) {
            if (c->hca_ratio && c->hca_ratio != q)
                return dsv4_error_set(-ENOTSUP, "%s: field compress_ratios[%zu] = %lld: only one HCA ratio "
                                      "per model is supported (already %d)", p->name, i, (long long)q,
                                      c->hca_ratio);
            c->hca_ratio = (int)q;
        }
        c->compress_ratio[i] = (int)q;
        c->mlp_type[i] = (int)i < n_hash ? DSV4_MLP_HASH : DSV4_MLP_MOE;
    }
    if (c->hca_ratio == 0)
        c->hca_ratio = 128;
    return 0;
}

/* Cross-field checks common to both spellings. */
static int validate(const struct parser *p, struct dsv4_config *c)
{
    if (c->rope_dim <= 0 || c->rope_dim > c->head_dim || c->rope_dim % 2)
        return dsv4_error_set(-EINVAL, "%s: rotary dims %d must be even and within head_dim %d",
                              p->name, c->rope_dim, c->head_dim);
    if (c->rope_dim > c->index_head_dim)
        return dsv4_error_set(-EINVAL, "%s: index_head_dim %d is smaller than the rotary dims %d",
                              p->name, c->index_head_dim, c->rope_dim);
    if (c->n_heads % c->o_groups)
        return dsv4_error_set(-EINVAL, "%s: o_groups %d does not divide the %d attention heads (head_dim "
                              "blocks per group)", p->name, c->o_groups, c->n_heads);
    if (c->n_experts_per_tok > c->n_experts)
        return dsv4_error_set(-EINVAL, "%s: %d experts per token but only %d routed experts",
                              p->name, c->n_experts_per_tok, c->n_experts);
    if (c->n_shared_experts != 1)
        return dsv4_error_set(-ENOTSUP, "%s: n_shared_experts = %d: exactly one shared expert is "
                              "supported (transformers sizes it moe_intermediate_size whatever the count)",
                              p->name, c->n_shared_experts);
    if (!c->norm_topk_prob)
        return dsv4_error_set(-ENOTSUP, "%s: norm_topk_prob = false is not supported: V4 always "
                              "normalizes the selected expert weights", p->name);
    if (c->csa_ratio == c->hca_ratio)
        return dsv4_error_set(-ENOTSUP, "%s: compress rates for CSA and HCA are both %d; they must differ",
                              p->name, c->csa_ratio);
    if (c->rope_compress.yarn && c->rope_compress.yarn_original_max <= 0)
        return dsv4_error_set(-EINVAL, "%s: YaRN needs a positive original length", p->name);
    return 0;
}

/* model_name from n bytes of s: the hello reply carries it as a str, which clients refuse unless it is
 * UTF-8, so whole characters only (a long name is cut between two) and a directory name in another
 * encoding gets U+FFFD for each invalid subpart. */
static void set_model_name(struct dsv4_config *c, const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, out = 0, used;

    while (i < n) {
        const bool valid = dsv4_utf8_step(p + i, n - i, &used) == DSV4_UTF8_VALID;
        const size_t len = valid ? used : DSV4_UTF8_REPLACEMENT_LEN;

        if (out + len >= sizeof(c->model_name))
            break;
        memcpy(c->model_name + out, valid ? s + i : DSV4_UTF8_REPLACEMENT, len);
        out += len;
        i += used;
    }
    c->model_name[out] = '\0';
}

int dsv4_config_parse(const char *json_text, const char *name, struct dsv4_config *ret)
{
    struct dsv4_config *c;
    struct parser p = { .name = name };
    json_error_t jerr;
    json_t *mt;
    const char *np = NULL;
    int r;

    p.root = json_loads(json_text, JSON_REJECT_DUPLICATES, &jerr);
    if (!p.root)
        return dsv4_error_set(-EINVAL, "%s: corrupt JSON at line %d: %s", name, jerr.line, jerr.text);
    c = calloc(1, sizeof(*c));
    if (!c) {
        json_decref(p.root);
        return dsv4_error_set(-ENOMEM, "out of memory parsing %s", name);
    }
    if (!json_is_object(p.root)) {
        r = dsv4_error_set(-EINVAL, "%s: not a JSON object", name);
        goto out;
    }
    mt = json_object_get(p.root, "model_type");
    if (mt) {
        if (!json_is_string(mt) || strcmp(json_string_value(mt), "deepseek_v4") != 0) {
            r = dsv4_error_set(-ENOTSUP, "%s: field model_type must be \"deepseek_v4\"", name);
            goto out;
        }
        r = parse_hf(&p, c);
    } else if (json_object_get(p.root, "n_layers") && json_object_get(p.root, "dim")) {
        r = parse_official(&p, c);
    } else {
        r = dsv4_error_set(-EINVAL, "%s: neither a transformers config (field model_type) nor DeepSeek's "
                           "inference config (fields dim, n_layers)", name);
    }
    if (r == 0)
        r = validate(&p, c);
    if (r == 0) {
        if (get_str(&p, p.root, "_name_or_path", NULL, &np) == 0 && np && *np) {
            const char *slash = strrchr(np, '/'), *base = slash && slash[1] ? slash + 1 : np;

            set_model_name(c, base, strlen(base));
        }
        *ret = *c;
    }
out:
    free(c);
    json_decref(p.root);
    return r;
}

int dsv4_config_load(const char *dir, struct dsv4_config *ret)
{
    char path[4096];
    FILE *f;
    char *text;
    long len;
    int r;

    if ((size_t)snprintf(path, sizeof(path), "%s/config.json", dir) >= sizeof(path))
        return dsv4_error_set(-ENAMETOOLONG, "model directory path too long: %s", dir);
    f = fopen(path, "rb");
    if (!f)
        return dsv4_error_set(-errno, "%s: cannot open: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) < 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) < 0) {
        r = dsv4_error_set(-EIO, "%s: cannot read", path);
        fclose(f);
        return r;
    }
    if (len > (long)CONFIG_MAX_BYTES) {
        fclose(f);
        return dsv4_error_set(-E2BIG, "%s: %ld bytes, over the limit of %u", path, len, CONFIG_MAX_BYTES);
    }
    text = malloc((size_t)len + 1);
    if (!text) {
        fclose(f);
        return dsv4_error_set(-ENOMEM, "out of memory reading %s", path);
    }
    if (fread(text, 1, (size_t)len, f) != (size_t)len) {
        free(text);
        fclose(f);
        return dsv4_error_set(-EIO, "%s: short read", path);
    }
    fclose(f);
    text[len] = '\0';
    r = dsv4_config_parse(text, path, ret);
    free(text);
    if (r == 0 && !ret->model_name[0]) {
        const char *end = dir + strlen(dir), *start;

        while (end > dir && end[-1] == '/')
            end--;
        start = end;
        while (start > dir && start[-1] != '/')
            start--;
        set_model_name(ret, start, (size_t)(end - start));
    }
    return r;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int dsv4_config_prefix_block(const struct dsv4_config *c)
{
    int64_t block = c->window > 0 ? c->window : 1;
    for (int i = 0; i < c->n_layers && block <= DSV4_PREFIX_BLOCK_MAX; i++)
        if (c->compress_ratio[i] > 0)
            block = block / gcd64(block, c->compress_ratio[i]) * c->compress_ratio[i];
    if (block > DSV4_PREFIX_BLOCK_MAX)
        return dsv4_error_set(-ERANGE, "prefix cache: the window %d and the compress ratios need blocks of more "
                              "than %d tokens (set the pool to 0)", c->window, DSV4_PREFIX_BLOCK_MAX);
    return (int)block;
}
