/* SPDX-License-Identifier: MIT */
/* Where each routed expert lives when they do not all fit on the GPU: the boot plan's last step.
 * Dense weights, caches and workspaces are placed first; what is left of the GPU (less a margin)
 * takes experts, and the rest go to one pinned host allocation that the same expert kernels read
 * in place over PCIe. Placement changes where bytes are, never the arithmetic.
 *
 * Which experts stay on the GPU: the most routed ones when routing statistics are given (counts of
 * tokens routed to each expert, as dsv4d writes them from served traffic: dsv4_routing_stats_write),
 * else evenly across layers (layer l gets its share of the GPU, experts 0, 1, ... in turn). Both are
 * one rule: candidates in order of (count descending, the expert's rank within its layer by count,
 * layer), taken while they fit. With no counts every count is 0, the rank is the expert id, and the
 * order is expert 0 of every layer, then expert 1 of every layer, ...: even. */
#ifndef DSV4_ENGINE_MODEL_PLACEMENT_H
#define DSV4_ENGINE_MODEL_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/model/config.h"

/* A routing-statistics file has the model's shape, so its bounds are those of config.json; its size
 * bound gives each count 32 bytes (20 digits, a separator, indentation). */
#define DSV4_PLACEMENT_MAX_LAYERS DSV4_MAX_LAYERS
#define DSV4_PLACEMENT_MAX_EXPERTS DSV4_MAX_EXPERTS
#define DSV4_ROUTING_STATS_MAX_BYTES ((size_t)DSV4_PLACEMENT_MAX_LAYERS * DSV4_PLACEMENT_MAX_EXPERTS * 32)
#define DSV4_ROUTING_STATS_FORMAT "dsv4d-routing-stats"
#define DSV4_ROUTING_STATS_VERSION 1

enum dsv4_expert_offload {
    DSV4_EXPERT_OFFLOAD_AUTO,   /* host memory for the experts that do not fit, none when all fit */
    DSV4_EXPERT_OFFLOAD_ON,     /* as auto, and at least host_percent of each layer's experts in host memory */
    DSV4_EXPERT_OFFLOAD_OFF,    /* every expert on the GPU, or refuse to boot */
};

struct dsv4_placement_req {
    int n_layers, n_experts;
    /* [n_layers] bytes one expert of layer l takes (w1, w3, w2 and their scales, as stored); 0 for a
     * layer whose experts cannot move (they count as dense weights). */
    const uint64_t *expert_bytes;
    uint64_t gpu_budget;        /* GPU bytes left for routed experts once everything else is placed */
    enum dsv4_expert_offload mode;
    int host_percent;           /* 0..100, mode ON only: at least this share of each layer's experts on the host */
    const uint64_t *counts;     /* [n_layers * n_experts] tokens routed to each expert, or NULL: even */
};

struct dsv4_placement {
    int n_layers, n_experts;
    bool offload;               /* some expert lives in host memory */
    bool from_counts;           /* chosen by routing statistics (else evenly) */
    uint8_t *on_host;           /* [n_layers * n_experts] 1 = pinned host memory */
    int *host_experts;          /* [n_layers] experts of the layer in host memory */
    uint64_t gpu_bytes, host_bytes;     /* routed-expert bytes on each side */
};

/* Plan the placement. -ENOMEM with the numbers when mode is OFF and the experts do not fit;
 * -EINVAL for a bad request. The plan is all-GPU when everything fits (mode AUTO, or ON with
 * host_percent 0). */
int dsv4_placement_plan(const struct dsv4_placement_req *req, struct dsv4_placement **ret);
void dsv4_placement_free(struct dsv4_placement *p);     /* accepts NULL */

static inline bool dsv4_placement_on_host(const struct dsv4_placement *p, int layer, int expert)
{
    return p && p->on_host[(int64_t)layer * p->n_experts + expert];
}

/* "even" / "routing statistics", then "offload off" when nothing moved: for logs. */
const char *dsv4_placement_rule(const struct dsv4_placement *p);

/* " l:gpu/host" for layers [l0, l0 + n) of the per-layer counts into buf (truncated to size):
 * what the boot log and stats print, DSV4_PLACEMENT_LINE_LAYERS layers a line. */
#define DSV4_PLACEMENT_LINE_LAYERS 8
void dsv4_placement_layers_text(const uint16_t *gpu, const uint16_t *host, int l0, int n, char *buf, size_t size);

/* The routing-statistics file (JSON):
 *   {"format": "dsv4d-routing-stats", "version": 1, "model": NAME, "n_layers": L, "n_experts": E,
 *    "counts": [[c(0,0), ..., c(0,E-1)], ..., [c(L-1,0), ...]]}
 * write: atomically (a temporary file renamed over path). read: the file must name exactly
 * n_layers x n_experts counts (a file of another shape is refused with both shapes); a file that
 * cannot be opened gives open's -errno (-ENOENT), anything but a regular file -EISDIR or -EINVAL, one
 * over DSV4_ROUTING_STATS_MAX_BYTES or DSV4_PLACEMENT_MAX_LAYERS x _EXPERTS -E2BIG. */
int dsv4_routing_stats_write(const char *path, const char *model, int n_layers, int n_experts,
                             const uint64_t *counts);
/* Whether write can create its file: makes and removes the temporary file it would, beside path, so
 * a missing directory, one without write permission, a read-only file system or a path that is a
 * directory (-EISDIR) is found when the path is configured rather than when the statistics are due.
 * 0, or -errno with a message. */
int dsv4_routing_stats_check(const char *path);
int dsv4_routing_stats_read(const char *path, int n_layers, int n_experts, uint64_t *counts);
/* As read, and the model the file names into ret_model (cut to model_size; "" when it names none): the
 * caller says when it is not the model served, whose statistics are used all the same when the shapes
 * agree (the same model under another directory name, or quantized, routes alike). */
int dsv4_routing_stats_read_model(const char *path, int n_layers, int n_experts, uint64_t *counts, char *ret_model,
                                  size_t model_size);

#endif
