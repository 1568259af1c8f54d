/* SPDX-License-Identifier: MIT */
#include "build-config.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/error.h"
#include "engine/model/placement.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

struct cand {
    uint64_t count;
    int rank;                   /* place of the expert in its layer's order by count (ties: lower id first) */
    int layer, expert;
};

static int by_count_then_id(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    return x->expert - y->expert;
}

static int by_count_rank_layer(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    if (x->rank != y->rank)
        return x->rank - y->rank;
    return x->layer - y->layer;
}

void dsv4_placement_free(struct dsv4_placement *p)
{
    if (!p)
        return;
    free(p->on_host);
    free(p->host_experts);
    free(p);
}

const char *dsv4_placement_rule(const struct dsv4_placement *p)
{
    if (!p || !p->offload)
        return "every expert on the GPU";
    return p->from_counts ? "the most routed experts on the GPU (routing statistics)" : "experts spread evenly";
}

static int check_req(const struct dsv4_placement_req *r)
{
    if (r->n_layers < 1 || r->n_experts < 1 || !r->expert_bytes)
        return dsv4_error_set(-EINVAL, "expert placement: %d layers of %d experts", r->n_layers, r->n_experts);
    if ((int64_t)r->n_layers * r->n_experts > INT_MAX)
        return dsv4_error_set(-EINVAL, "expert placement: %d layers x %d experts is too many", r->n_layers,
                              r->n_experts);
    if (r->host_percent < 0 || r->host_percent > 100)
        return dsv4_error_set(-EINVAL, "expert_host_share = %d outside [0, 100]", r->host_percent);
    if (r->host_percent > 0 && r->mode != DSV4_EXPERT_OFFLOAD_ON)
        return dsv4_error_set(-EINVAL, "expert_host_share = %d needs expert_offload = on", r->host_percent);
    for (int l = 0; l < r->n_layers; l++)
        if (r->expert_bytes[l] > UINT64_MAX / 2 / (uint64_t)r->n_experts / (uint64_t)r->n_layers)
            return dsv4_error_set(-EINVAL, "expert placement: layer %d's experts of %llu bytes", l,
                                  (unsigned long long)r->expert_bytes[l]);
    return 0;
}

/* Candidates in placement order: every expert of every layer whose experts can move. */
static struct cand *order(const struct dsv4_placement_req *r, int *ret_n)
{
    const int E = r->n_experts;
    struct cand *c = calloc((size_t)r->n_layers * E, sizeof(*c));
    int n = 0;
    if (!c)
        return NULL;
    for (int l = 0; l < r->n_layers; l++) {
        if (!r->expert_bytes[l])
            continue;
        struct cand *row = c + n;
        for (int e = 0; e < E; e++)
            row[e] = (struct cand){ r->counts ? r->counts[(int64_t)l * E + e] : 0, 0, l, e };
        qsort(row, E, sizeof(*row), by_count_then_id);
        for (int i = 0; i < E; i++)
            row[i].rank = i;
        n += E;
    }
    qsort(c, n, sizeof(*c), by_count_rank_layer);
    *ret_n = n;
    return c;
}

int dsv4_placement_plan(const struct dsv4_placement_req *r, struct dsv4_placement **ret)
{
    const int L = r->n_layers, E = r->n_experts;
    uint64_t total = 0;
    int rc = check_req(r);
    if (rc < 0)
        return rc;
    for (int l = 0; l < L; l++)
        total += r->expert_bytes[l] * (uint64_t)E;

    struct dsv4_placement *p = calloc(1, sizeof(*p));
    if (!p)
        return dsv4_error_set(-ENOMEM, "expert placement");
    p->n_layers = L;
    p->n_experts = E;
    p->on_host = calloc((size_t)L * E, 1);
    p->host_experts = calloc((size_t)L, sizeof(*p->host_experts));
    if (!p->on_host || !p->host_experts) {
        dsv4_placement_free(p);
        return dsv4_error_set(-ENOMEM, "expert placement of %d x %d experts", L, E);
    }
    if (total <= r->gpu_budget && r->host_percent == 0) {
        p->gpu_bytes = total;
        *ret = p;
        return 0;
    }
    if (r->mode == DSV4_EXPERT_OFFLOAD_OFF) {
        dsv4_placement_free(p);
        return dsv4_error_set(-ENOMEM, "the routed experts take %.2f GiB and %.2f GiB of the GPU is left for them "
                              "after the dense weights, caches, workspaces and margin; expert_offload = auto puts "
                              "the rest in host memory", total / GIB, r->gpu_budget / GIB);
    }

    /* The per-layer cap keeps the forced host share; the budget keeps the GPU from overflowing. */
    const int cap = E - (int)(((int64_t)E * r->host_percent + 99) / 100);
    int *gpu_n = calloc((size_t)L, sizeof(*gpu_n)), n = 0;
    struct cand *c = order(r, &n);
    if (!gpu_n || !c) {
        free(gpu_n);
        free(c);
        dsv4_placement_free(p);
        return dsv4_error_set(-ENOMEM, "expert placement of %d x %d experts", L, E);
    }
    memset(p->on_host, 1, (size_t)L * E);
    for (int l = 0; l < L; l++)
        if (!r->expert_bytes[l])
            memset(p->on_host + (int64_t)l * E, 0, (size_t)E);
    uint64_t used = 0;
    for (int i = 0; i < n; i++) {
        const uint64_t b = r->expert_bytes[c[i].layer];
        if (gpu_n[c[i].layer] >= cap || used + b > r->gpu_budget)
            continue;
        used += b;
        gpu_n[c[i].layer]++;
        p->on_host[(int64_t)c[i].layer * E + c[i].expert] = 0;
    }
    for (int l = 0; l < L; l++) {
        if (!r->expert_bytes[l])
            continue;
        p->host_experts[l] = E - gpu_n[l];
        p->host_bytes += (uint64_t)p->host_experts[l] * r->expert_bytes[l];
    }
    p->gpu_bytes = used;
    p->offload = p->host_bytes > 0;
    p->from_counts = r->counts != NULL;
    free(gpu_n);
    free(c);
    *ret = p;
    return 0;
}

void dsv4_placement_layers_text(const uint16_t *gpu, const uint16_t *host, int l0, int n, char *buf, size_t size)
{
    size_t used = 0;
    if (size)
        buf[0] = '\0';
    for (int l = l0; l < l0 + n && used < size; l++) {
        int w = snprintf(buf + used, size - used, " %d:%u/%u", l, (unsigned)gpu[l], (unsigned)host[l]);
        if (w < 0)
            break;
        used += (size_t)w;
    }
}

/* ---- the routing-statistics file ---- */

/* The temporary file beside path that is renamed over it once written; its name into tmp. */
static int create_beside(const char *path, char tmp[PATH_MAX])
{
    if (snprintf(tmp, PATH_MAX, "%s.XXXXXX", path) >= PATH_MAX)
        return dsv4_error_set(-ENAMETOOLONG, "routing statistics %s: path too long", path);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        int rc = -errno;
        return dsv4_error_set(rc, "routing statistics: creating a file beside %s: %s", path, strerror(-rc));
    }
    return fd;
}

int dsv4_routing_stats_check(const char *path)
{
    char tmp[PATH_MAX];
    struct stat sb;
    /* the temporary file is made beside a directory as well, but cannot be renamed over it */
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return dsv4_error_set(-EISDIR, "routing statistics %s: a directory, not a file (name a file in it)", path);
    int fd = create_beside(path, tmp);
    if (fd < 0)
        return fd;
    close(fd);
    unlink(tmp);
    return 0;
}

int dsv4_routing_stats_write(const char *path, const char *model, int n_layers, int n_experts,
                             const uint64_t *counts)
{
    json_t *root = json_object(), *rows = json_array();
    char tmp[PATH_MAX];
    int rc = 0;

    if (!root || !rows) {
        json_decref(root);
        json_decref(rows);
        return dsv4_error_set(-ENOMEM, "routing statistics");
    }
    json_object_set_new(root, "format", json_string(DSV4_ROUTING_STATS_FORMAT));
    json_object_set_new(root, "version", json_integer(DSV4_ROUTING_STATS_VERSION));
    json_object_set_new(root, "model", json_string(model ? model : ""));
    json_object_set_new(root, "n_layers", json_integer(n_layers));
    json_object_set_new(root, "n_experts", json_integer(n_experts));
    json_object_set_new(root, "counts", rows);
    for (int l = 0; l < n_layers && rc == 0; l++) {
        json_t *row = json_array();
        if (!row || json_array_append_new(rows, row) < 0) {
            rc = -ENOMEM;
            break;
        }
        for (int e = 0; e < n_experts && rc == 0; e++)
            if (json_array_append_new(row, json_integer((json_int_t)counts[(int64_t)l * n_experts + e])) < 0)
                rc = -ENOMEM;
    }
    if (rc < 0) {
        json_decref(root);
        return dsv4_error_set(rc, "routing statistics of %d x %d experts", n_layers, n_experts);
    }
    int fd = create_beside(path, tmp);
    if (fd < 0) {
        json_decref(root);
        return fd;
    }
    /* One buffer written to the end: json_dumpfd takes a short write (a full disk) as a failure with
     * no errno, and the reason is what the operator can act on. */
    char *text = json_dumps(root, JSON_COMPACT);
    size_t len = text ? strlen(text) : 0, off = 0;
    if (!text)
        rc = dsv4_error_set(-ENOMEM, "routing statistics of %d x %d experts", n_layers, n_experts);
    while (rc == 0 && off <= len) {
        ssize_t w = off < len ? write(fd, text + off, len - off) : write(fd, "\n", 1);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            rc = dsv4_error_set(w < 0 ? -errno : -EIO, "routing statistics: writing %s: %s", tmp,
                                w < 0 ? strerror(errno) : "no progress");
        else
            off += (size_t)w;
    }
    free(text);
    if (rc == 0 && fsync(fd) < 0)
        rc = dsv4_error_set(-errno, "routing statistics: %s: %s", tmp, strerror(errno));
    if (close(fd) < 0 && rc == 0)
        rc = dsv4_error_set(-errno, "routing statistics: %s: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) < 0)
        rc = dsv4_error_set(-errno, "routing statistics: renaming %s to %s: %s", tmp, path, strerror(errno));
    if (rc < 0)
        unlink(tmp);
    json_decref(root);
    return rc;
}

static int get_int(const json_t *root, const char *key, const char *path, json_int_t *ret)
{
    const json_t *v = json_object_get(root, key);
    if (!json_is_integer(v))
        return dsv4_error_set(-EINVAL, "routing statistics %s: \"%s\" is missing or not an integer", path, key);
    *ret = json_integer_value(v);
    return 0;
}

int dsv4_routing_stats_read(const char *path, int n_layers, int n_experts, uint64_t *counts)
{
    return dsv4_routing_stats_read_model(path, n_layers, n_experts, counts, NULL, 0);
}

int dsv4_routing_stats_read_model(const char *path, int n_layers, int n_experts, uint64_t *counts, char *ret_model,
                                  size_t model_size)
{
    json_error_t jerr;
    json_t *root;
    json_int_t version = 0, L = 0, E = 0;
    struct stat sb;
    FILE *f;
    int rc, fd = open(path, O_RDONLY | O_CLOEXEC);

    /* Opened here rather than by jansson, whose failure to open reads as malformed JSON at line -1. */
    if (fd < 0)
        return dsv4_error_set(-errno, "routing statistics %s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &sb) < 0) {
        rc = -errno;
        close(fd);
        return dsv4_error_set(rc, "routing statistics %s: cannot stat: %s", path, strerror(-rc));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return dsv4_error_set(S_ISDIR(sb.st_mode) ? -EISDIR : -EINVAL, "routing statistics %s: not a regular file",
                              path);
    }
    if ((uint64_t)sb.st_size > DSV4_ROUTING_STATS_MAX_BYTES) {
        close(fd);
        return dsv4_error_set(-E2BIG, "routing statistics %s: %lld bytes, over the limit of %zu (%d layers x %d "
                              "experts)", path, (long long)sb.st_size, DSV4_ROUTING_STATS_MAX_BYTES,
                              DSV4_PLACEMENT_MAX_LAYERS, DSV4_PLACEMENT_MAX_EXPERTS);
    }
    if (!(f = fdopen(fd, "r"))) {
        rc = -errno;
        close(fd);
        return dsv4_error_set(rc, "routing statistics %s: %s", path, strerror(-rc));
    }
    root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root)
        return dsv4_error_set(-EINVAL, "routing statistics %s: line %d: %s", path, jerr.line, jerr.text);
    const json_t *fmt = json_object_get(root, "format");
    if (!json_is_string(fmt) || strcmp(json_string_value(fmt), DSV4_ROUTING_STATS_FORMAT) != 0) {
        rc = dsv4_error_set(-EINVAL, "routing statistics %s: \"format\" is not \"%s\" (dsv4d's routing_stats file)",
                            path, DSV4_ROUTING_STATS_FORMAT);
        goto out;
    }
    if ((rc = get_int(root, "version", path, &version)) < 0 || (rc = get_int(root, "n_layers", path, &L)) < 0 ||
        (rc = get_int(root, "n_experts", path, &E)) < 0)
        goto out;
    if (version != DSV4_ROUTING_STATS_VERSION) {
        rc = dsv4_error_set(-EINVAL, "routing statistics %s: version %lld, this dsv4d reads %d", path,
                            (long long)version, DSV4_ROUTING_STATS_VERSION);
        goto out;
    }
    const json_t *model = json_object_get(root, "model");
    if (model && !json_is_string(model)) {
        rc = dsv4_error_set(-EINVAL, "routing statistics %s: \"model\" is not a string", path);
        goto out;
    }
    if (L > DSV4_PLACEMENT_MAX_LAYERS || E > DSV4_PLACEMENT_MAX_EXPERTS) {
        rc = dsv4_error_set(-E2BIG, "routing statistics %s are of %lld layers x %lld experts; a model has at most "
                            "%d x %d", path, (long long)L, (long long)E, DSV4_PLACEMENT_MAX_LAYERS,
                            DSV4_PLACEMENT_MAX_EXPERTS);
        goto out;
    }
    if (L != n_layers || E != n_experts) {
        rc = dsv4_error_set(-EINVAL, "routing statistics %s are of %lld layers x %lld experts; the model has %d x %d",
                            path, (long long)L, (long long)E, n_layers, n_experts);
        goto out;
    }
    const json_t *rows = json_object_get(root, "counts");
    if (!json_is_array(rows) || json_array_size(rows) != (size_t)n_layers) {
        rc = dsv4_error_set(-EINVAL, "routing statistics %s: \"counts\" is not an array of %d layers", path, n_layers);
        goto out;
    }
    for (int l = 0; l < n_layers; l++) {
        const json_t *row = json_array_get(rows, (size_t)l);
        if (!json_is_array(row) || json_array_size(row) != (size_t)n_experts) {
            rc = dsv4_error_set(-EINVAL, "routing statistics %s: layer %d is not an array of %d counts", path, l,
                                n_experts);
            goto out;
        }
        for (int e = 0; e < n_experts; e++) {
            const json_t *v = json_array_get(row, (size_t)e);
            if (!json_is_integer(v) || json_integer_value(v) < 0) {
                rc = dsv4_error_set(-EINVAL, "routing statistics %s: layer %d expert %d: not a count", path, l, e);
                goto out;
            }
            counts[(int64_t)l * n_experts + e] = (uint64_t)json_integer_value(v);
        }
    }
    if (model_size)
        snprintf(ret_model, model_size, "%s", model ? json_string_value(model) : "");
    rc = 0;
out:
    json_decref(root);
    return rc;
}
