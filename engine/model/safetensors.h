/* SPDX-License-Identifier: MIT */
/* safetensors: memory-mapped checkpoint files, one or many shards, looked up by tensor name. */
#ifndef DSV4_ENGINE_MODEL_SAFETENSORS_H
#define DSV4_ENGINE_MODEL_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DSV4_ST_MAX_DIMS 4
#define DSV4_ST_MAX_HEADER (100u << 20)   /* refuse headers over 100 MiB */
#define DSV4_ST_MAX_SHARDS 4096u            /* files of one checkpoint */
#define DSV4_ST_MAX_TENSORS (1u << 22)      /* tensors of one checkpoint (Pro: under 200k) */

enum dsv4_dtype {
    DSV4_DT_F32, DSV4_DT_F16, DSV4_DT_BF16,
    DSV4_DT_F8_E4M3, DSV4_DT_F8_E8M0,
    DSV4_DT_I8, DSV4_DT_U8,              /* I8/U8 weights are packed FP4 (two e2m1 a byte, low nibble first) */
    DSV4_DT_I32, DSV4_DT_I64,
};

struct dsv4_st_tensor {
    const char *name;
    enum dsv4_dtype dtype;
    int ndim;
    int64_t shape[DSV4_ST_MAX_DIMS];
    const void *data;           /* into the mapping */
    size_t nbytes;
    const char *file;           /* shard basename, for messages */
};

struct dsv4_st;                 /* opaque: all shards of one checkpoint */

/* Open DIR/model.safetensors.index.json's shards, or DIR/model.safetensors, or every *.safetensors in DIR.
 * Checks each header: JSON well-formed, dtypes known, offsets inside the file, no overlaps, sizes
 * matching shape x dtype. Returns 0 or -errno with a message naming the file and tensor. */
int dsv4_st_open(const char *dir, struct dsv4_st **ret);
void dsv4_st_close(struct dsv4_st *st);     /* accepts NULL */

/* A table built in memory instead (synthetic weights): dsv4_st_add each tensor (the table frees
 * data at close when owned; it must come from malloc/aligned_alloc), then dsv4_st_seal, which sorts
 * the names for lookup and refuses a name added twice. source names the table in messages. */
int dsv4_st_new(const char *source, struct dsv4_st **ret);
int dsv4_st_add(struct dsv4_st *st, const char *name, enum dsv4_dtype dt, int ndim, const int64_t *shape,
                const void *data, bool owned);
int dsv4_st_seal(struct dsv4_st *st);

/* NULL when absent. */
const struct dsv4_st_tensor *dsv4_st_find(const struct dsv4_st *st, const char *name);
size_t dsv4_st_count(const struct dsv4_st *st);
const struct dsv4_st_tensor *dsv4_st_at(const struct dsv4_st *st, size_t i);

/* What was opened (the index file, model.safetensors or the directory), for messages. */
const char *dsv4_st_source(const struct dsv4_st *st);

size_t dsv4_dtype_size(enum dsv4_dtype dt);         /* bytes per element (FP4 packed: 1 per 2 values, size 1) */
const char *dsv4_dtype_name(enum dsv4_dtype dt);    /* "F8_E4M3", ... */

#endif
