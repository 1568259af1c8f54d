/* SPDX-License-Identifier: MIT */
/* Model configuration: the shapes and constants of one DeepSeek-V4 model, read from config.json in
 * either spelling (transformers' `deepseek_v4` or DeepSeek's own inference config). */
#ifndef DSV4_ENGINE_MODEL_CONFIG_H
#define DSV4_ENGINE_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#define DSV4_MAX_LAYERS 128     /* main layers; Pro has 61 */
#define DSV4_MAX_HC 8           /* hyper-connection streams; both releases use 4 */
#define DSV4_MAX_TOPK 16        /* experts per token; both releases use 6 */
/* Bounds on the other config fields, checked when config.json is read. */
#define DSV4_MAX_VOCAB (1 << 22)
#define DSV4_MAX_DIM (1 << 16)          /* hidden size, lora ranks (Pro: 7168) */
#define DSV4_MAX_HEADS 1024
#define DSV4_MAX_HEAD_DIM 4096
#define DSV4_MAX_EXPERTS 4096
#define DSV4_MAX_WINDOW (1 << 20)
#define DSV4_MAX_INDEX_TOPK (1 << 20)
#define DSV4_MAX_MTP 4                  /* MTP layers; both releases have 1 */
#define DSV4_MAX_SINKHORN_ITERS 1000
#define DSV4_MAX_COMPRESS_RATIO 4096

enum dsv4_mlp_type { DSV4_MLP_MOE = 0, DSV4_MLP_HASH = 1 };

struct dsv4_rope {
    double theta;
    bool yarn;                  /* YaRN frequency ramp (frequencies only, no mscale) */
    double yarn_factor;         /* 16 */
    int64_t yarn_original_max;  /* original_max_position_embeddings, 65536 */
    double beta_fast, beta_slow;/* 32, 1 */
};

struct dsv4_config {
    char model_name[128];       /* directory basename or _name_or_path, for hello/stats */
    int vocab_size;
    int dim;                    /* hidden_size D */
    int n_layers;               /* main layers, MTP excluded */
    int n_mtp_layers;           /* num_nextn_predict_layers */
    int n_heads;                /* H */
    int head_dim;               /* 512 */
    int rope_dim;               /* qk_rope_head_dim, 64: the LAST rope_dim dims of a head */
    int q_lora_rank;
    int o_groups, o_lora_rank;
    int window;                 /* sliding_window, 128 */
    int compress_ratio[DSV4_MAX_LAYERS];        /* 0 sliding, 4 CSA, 128 HCA (configurable rates) */
    enum dsv4_mlp_type mlp_type[DSV4_MAX_LAYERS];
    int csa_ratio, hca_ratio;   /* compress_rates */
    int index_n_heads, index_head_dim, index_topk;
    int n_experts, n_experts_per_tok, n_shared_experts;
    int moe_inter;              /* moe_intermediate_size */
    double routed_scaling_factor;
    bool norm_topk_prob;
    double swiglu_limit;        /* 0 = no clamp */
    int hc_mult, hc_sinkhorn_iters;
    double hc_eps;
    double rms_norm_eps;
    struct dsv4_rope rope_main;     /* sliding layers */
    struct dsv4_rope rope_compress; /* CSA/HCA layers (their window tokens too) and compressors */
    int64_t max_position;
    int bos_id, eos_id;
    bool tie_embeddings;        /* tie_word_embeddings: head shares embed's tensor */
};

/* Parse DIR/config.json into *ret. Refuses inconsistent or unsupported fields with a message
 * naming the field. Returns 0 or -errno. */
int dsv4_config_load(const char *dir, struct dsv4_config *ret);

/* Parse config JSON text (for tests); name is used in messages. */
int dsv4_config_parse(const char *json_text, const char *name, struct dsv4_config *ret);

/* Helpers derived from the config. */
static inline int dsv4_config_nope_dim(const struct dsv4_config *c) { return c->head_dim - c->rope_dim; }

#define DSV4_PREFIX_BLOCK_MAX 4096      /* tokens per prefix-cache block */
/* Tokens per prefix-cache block (engine/backend.h): the least common multiple of the window and
 * every layer's compress ratio (Flash: 128). Returns it, or -ERANGE with a message when it exceeds
 * DSV4_PREFIX_BLOCK_MAX (such a model runs only without a prefix pool). */
int dsv4_config_prefix_block(const struct dsv4_config *c);

#endif
