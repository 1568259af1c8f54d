/* SPDX-License-Identifier: MIT */
/* Synthetic weights: a model directory that holds config.json and synthetic.json (a recipe) instead
 * of safetensors shards. At load every tensor the config implies is generated in memory, in the
 * release's formats (FP8 e4m3 linears with 128x128 UE8M0 scales, FP4 e2m1 routed experts with 1x32
 * scales, BF16 embedding, head, norms, compressors, router and indexer weights, F32 mHC tensors) and
 * with values distributed as tools/dsv4-mkckpt writes them: what a real-shape benchmark needs, at
 * memory speed and with no checkpoint on disk. The values are random: the model answers nothing.
 *
 * synthetic.json: {"seed": 1, "distinct_layers": 6, "router_skew": 0.0}, every key optional.
 *   seed             the values are a function of it (and of nothing else: not the thread count)
 *   distinct_layers  layers 0..K-1 get values of their own (default: all); each later layer shares
 *                    the tensors of the last of those with its compress ratio and routing kind, so a
 *                    43-layer Flash holds ~6 layers in host memory (the device still gets a copy per
 *                    layer) and a layer's time does not depend on its values
 *   router_skew      s >= 0: the scored layers' selection bias of the expert whose popularity rank
 *                    is r (a random permutation per layer) gets -s ln r added, so routing follows a
 *                    Zipf-like law (trained routers are skewed; random ones route nearly uniformly).
 *                    0 keeps the plain N(0, 0.01) bias. Hash layers route by their table, unskewed.
 *                    At Flash's shapes (256 experts, top 6; the router alone on N(0, 1) inputs)
 *                    the most routed tenth of the experts takes 12% of the tokens at s = 0, 32% at
 *                    0.1, 62% at 0.2 and 98% at 0.5, where 182 experts are never routed to. */
#ifndef DSV4_ENGINE_MODEL_SYNTH_H
#define DSV4_ENGINE_MODEL_SYNTH_H

#include <stdint.h>

#include "engine/model/config.h"
#include "engine/model/safetensors.h"

#define DSV4_SYNTH_RECIPE "synthetic.json"
#define DSV4_SYNTH_RECIPE_MAX_BYTES 4096
#define DSV4_SYNTH_SKEW_MAX 64.0
#define DSV4_SYNTH_THREADS_MAX 64

struct dsv4_synth_recipe {
    uint64_t seed;
    int distinct_layers;        /* 1..n_layers */
    double router_skew;         /* 0..DSV4_SYNTH_SKEW_MAX */
};

/* Read DIR/synthetic.json for the model c: 1 with *ret filled when DIR holds one, 0 when it does not,
 * -errno with a message naming the key on a bad recipe (or on shards beside it: which one is meant
 * would be a guess). */
int dsv4_synth_recipe_read(const char *dir, const struct dsv4_config *c, struct dsv4_synth_recipe *ret);

/* Every tensor of c (main layers, then c->n_mtp_layers MTP blocks) in DeepSeek's spelling, generated
 * into a new in-memory table named source, sealed. Returns 0 or -errno (-ENOMEM names the bytes). */
int dsv4_synth_tensors(const struct dsv4_config *c, const struct dsv4_synth_recipe *rc, const char *source,
                       struct dsv4_st **ret);

#endif
