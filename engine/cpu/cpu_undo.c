/* SPDX-License-Identifier: MIT */
/* The undo log of a sequence: how speculative rows are taken back (engine/backend.h, verify/accept).
 *
 * Design. While the log records, every write a token makes to the sequence's state first copies the
 * bytes it is about to overwrite into the log (dsv4_cpu_undo_save at each write site). A row mark
 * before each token remembers where its records start and the positions (pos, mtp_pos) it started
 * from. Rolling back to row j replays the records from the newest down to row j's first, so every byte
 * returns to what it held before row j: the state is bitwise that of a sequence that never saw rows
 * j.. (the arithmetic of rows 0..j-1 is the same either way: a row depends only on the state before it).
 *
 * What one token writes, and so what a row records (per layer; shapes in f32 values):
 *   window ring row pos % window                          [head_dim]
 *   compressed layers, for the main compressor and (CSA) the indexer's:
 *     its kv and gate rows pos % ratio                      [coff * dim] each
 *     when pos closes a block: the entry                    [head_dim] or the indexer key [index_head_dim]
 *     and, overlapping, prev_kv, prev_gate, have_prev       [ratio, dim] x 2, one byte
 *   the final streams                                       [hc, D]
 *   the MTP block's window ring row (its catch-up step)     [head_dim]
 * Nothing else a later token reads is written. The log is sized at create for max_rows tokens of the
 * worst case (every compressor closing a block at every row), so recording never allocates. */
#include "build-config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_ops.h"
#include "engine/error.h"

struct undo_rec {
    void *dst;
    size_t bytes;
    size_t off;         /* into data */
};

struct dsv4_cpu_undo {
    bool on;
    bool overflow;      /* a save found no room: the log cannot roll back (a sizing bug) */
    int max_rows;
    int rows;           /* marks since begin */
    int64_t *row_rec;   /* [max_rows] records before row j */
    int64_t *row_pos;   /* [max_rows] s->pos before row j */
    int64_t *row_mtp;   /* [max_rows] s->mtp_pos before row j */
    struct undo_rec *rec;
    int64_t n_rec, cap_rec;
    uint8_t *data;
    size_t used, cap;
};

static void comp_bound(const struct dsv4_compressor *cp, size_t *bytes, int64_t *recs)
{
    size_t width = (size_t)(cp->overlap ? 2 : 1) * (size_t)cp->dim;
    *bytes += 2 * width * sizeof(float) + (size_t)cp->dim * sizeof(float);   /* kv, gate rows; entry */
    *recs += 3;
    if (cp->overlap) {
        *bytes += 2 * (size_t)cp->ratio * (size_t)cp->dim * sizeof(float) + sizeof(bool);
        *recs += 3;
    }
}

/* What one token's records can take, at most. */
static void row_bound(const struct dsv4_weights *w, size_t *bytes, int64_t *recs)
{
    const struct dsv4_config *cfg = &w->cfg;
    size_t hd = (size_t)cfg->head_dim * sizeof(float);
    *bytes = 0;
    *recs = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct dsv4_layer *ly = &w->layers[l];
        *bytes += hd;
        *recs += 1;
        if (!ly->ratio)
            continue;
        comp_bound(&ly->attn.comp, bytes, recs);
        if (ly->ratio == cfg->csa_ratio)
            comp_bound(&ly->attn.indexer.comp, bytes, recs);
    }
    *bytes += (size_t)cfg->hc_mult * (size_t)cfg->dim * sizeof(float) + hd;   /* streams, MTP window */
    *recs += 2;
}

int dsv4_cpu_undo_create(const struct dsv4_weights *w, int max_rows, struct dsv4_cpu_undo **ret)
{
    size_t bytes;
    int64_t recs;
    row_bound(w, &bytes, &recs);
    struct dsv4_cpu_undo *u = calloc(1, sizeof(*u));
    if (u) {
        u->max_rows = max_rows;
        u->cap = bytes * (size_t)max_rows;
        u->cap_rec = recs * max_rows;
        u->row_rec = calloc((size_t)max_rows, sizeof(*u->row_rec));
        u->row_pos = calloc((size_t)max_rows, sizeof(*u->row_pos));
        u->row_mtp = calloc((size_t)max_rows, sizeof(*u->row_mtp));
        u->rec = calloc((size_t)u->cap_rec, sizeof(*u->rec));
        u->data = malloc(u->cap);
    }
    if (!u || !u->row_rec || !u->row_pos || !u->row_mtp || !u->rec || !u->data) {
        dsv4_cpu_undo_free(u);
        return dsv4_error_set(-ENOMEM, "out of memory for an undo log of %d rows", max_rows);
    }
    *ret = u;
    return 0;
}

void dsv4_cpu_undo_free(struct dsv4_cpu_undo *u)
{
    if (!u)
        return;
    free(u->row_rec);
    free(u->row_pos);
    free(u->row_mtp);
    free(u->rec);
    free(u->data);
    free(u);
}

uint64_t dsv4_cpu_undo_bytes(const struct dsv4_cpu_undo *u)
{
    return u ? u->cap + (uint64_t)u->cap_rec * sizeof(*u->rec) : 0;
}

void dsv4_cpu_undo_begin(struct dsv4_cpu_undo *u)
{
    u->on = true;
    u->overflow = false;
    u->rows = 0;
    u->n_rec = 0;
    u->used = 0;
}

int dsv4_cpu_undo_mark(struct dsv4_cpu_undo *u, int64_t pos, int64_t mtp_pos)
{
    if (u->rows >= u->max_rows)
        return dsv4_error_set(-E2BIG, "a speculative step of more than %d rows", u->max_rows);
    u->row_rec[u->rows] = u->n_rec;
    u->row_pos[u->rows] = pos;
    u->row_mtp[u->rows] = mtp_pos;
    u->rows++;
    return 0;
}

void dsv4_cpu_undo_save(struct dsv4_cpu_undo *u, void *dst, size_t bytes)
{
    if (!u || !u->on)
        return;
    if (u->n_rec >= u->cap_rec || bytes > u->cap - u->used) {
        u->overflow = true;
        return;
    }
    u->rec[u->n_rec++] = (struct undo_rec){ .dst = dst, .bytes = bytes, .off = u->used };
    memcpy(u->data + u->used, dst, bytes);
    u->used += bytes;
}

int dsv4_cpu_undo_rows(const struct dsv4_cpu_undo *u)
{
    return u->on ? u->rows : 0;
}

void dsv4_cpu_undo_end(struct dsv4_cpu_undo *u)
{
    u->on = false;
}

int dsv4_cpu_undo_rollback(struct dsv4_cpu_undo *u, int keep, int64_t *pos, int64_t *mtp_pos)
{
    if (!u->on)
        return dsv4_error_set(-EINVAL, "no speculative step to accept");
    if (keep < 0 || keep > u->rows)
        return dsv4_error_set(-EINVAL, "keep %d rows of a speculative step of %d", keep, u->rows);
    if (u->overflow)
        return dsv4_error_set(-EIO, "the undo log overflowed: the step cannot be taken back (the slot must be reset)");
    if (keep < u->rows) {
        for (int64_t i = u->n_rec - 1; i >= u->row_rec[keep]; i--)
            memcpy(u->rec[i].dst, u->data + u->rec[i].off, u->rec[i].bytes);
        *pos = u->row_pos[keep];
        *mtp_pos = u->row_mtp[keep];
    }
    u->on = false;
    return 0;
}
