/* SPDX-License-Identifier: MIT */
/* safetensors reader. File layout: u64 little-endian header length N, N bytes of JSON
 * {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data
 * area, offsets relative to its start. Every header field is bounded and checked before it is
 * used; the data stays in a read-only private mapping. */
#include "build-config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/error.h"
#include "engine/model/safetensors.h"

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"
#define ST_SUFFIX ".safetensors"
#define ST_MAX_INDEX_BYTES (64u << 20)  /* the index lists names only; Pro's is a few MiB */

struct st_file {
    char *path;                 /* for messages */
    const char *base;           /* into path */
    void *map;
    size_t size;
};

struct dsv4_st {
    char *source;               /* what was opened, for messages */
    struct st_file *files;
    size_t nfiles;
    struct dsv4_st_tensor *tensors;     /* sorted by name */
    size_t ntensors, cap;
    void **owned;               /* a table built in memory: the buffers it frees at close */
    size_t nowned, capowned;
};

static const struct {
    const char *name;
    enum dsv4_dtype dt;
    size_t size;
} dtypes[] = {
    { "F32", DSV4_DT_F32, 4 }, { "F16", DSV4_DT_F16, 2 }, { "BF16", DSV4_DT_BF16, 2 },
    { "F8_E4M3", DSV4_DT_F8_E4M3, 1 }, { "F8_E8M0", DSV4_DT_F8_E8M0, 1 },
    { "I8", DSV4_DT_I8, 1 }, { "U8", DSV4_DT_U8, 1 },
    { "I32", DSV4_DT_I32, 4 }, { "I64", DSV4_DT_I64, 8 },
};

size_t dsv4_dtype_size(enum dsv4_dtype dt)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (dtypes[i].dt == dt)
            return dtypes[i].size;
    return 0;
}

const char *dsv4_dtype_name(enum dsv4_dtype dt)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (dtypes[i].dt == dt)
            return dtypes[i].name;
    return "?";
}

static int dtype_parse(const char *s, enum dsv4_dtype *ret)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (strcmp(dtypes[i].name, s) == 0) {
            *ret = dtypes[i].dt;
            return 0;
        }
    return -EINVAL;
}

static char *path_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);

    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int tensor_push(struct dsv4_st *st, const struct dsv4_st_tensor *t)
{
    if (st->ntensors == st->cap) {
        size_t cap = st->cap ? 2 * st->cap : 256;
        struct dsv4_st_tensor *nt;

        if (cap > DSV4_ST_MAX_TENSORS)
            cap = DSV4_ST_MAX_TENSORS;
        if (st->ntensors >= cap)
            return dsv4_error_set(-E2BIG, "%s: more than %u tensors", st->source, DSV4_ST_MAX_TENSORS);
        nt = realloc(st->tensors, cap * sizeof(*nt));
        if (!nt)
            return dsv4_error_set(-ENOMEM, "out of memory reading %s", st->source);
        st->tensors = nt;
        st->cap = cap;
    }
    st->tensors[st->ntensors++] = *t;
    return 0;
}

/* One header entry -> t (name already set). Sizes are checked against data_size. */
static int parse_entry(const struct st_file *f, const char *name, json_t *e, const uint8_t *data,
                       uint64_t data_size, struct dsv4_st_tensor *t)
{
    json_t *jd = json_object_get(e, "dtype"), *js = json_object_get(e, "shape");
    json_t *jo = json_object_get(e, "data_offsets");
    uint64_t numel = 1, begin, end;
    size_t idx;
    json_t *v;

    if (!json_is_object(e) || !json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) ||
        json_array_size(jo) != 2)
        return dsv4_error_set(-EINVAL, "%s: tensor %s: header entry needs dtype, shape and "
                              "data_offsets [begin, end]", f->path, name);
    if (dtype_parse(json_string_value(jd), &t->dtype) < 0)
        return dsv4_error_set(-EINVAL, "%s: tensor %s: unknown dtype '%s' (known: F32 F16 BF16 "
                              "F8_E4M3 F8_E8M0 I8 U8 I32 I64)", f->path, name, json_string_value(jd));
    if (json_array_size(js) > DSV4_ST_MAX_DIMS)
        return dsv4_error_set(-EINVAL, "%s: tensor %s: %zu dimensions, at most %d supported",
                              f->path, name, json_array_size(js), DSV4_ST_MAX_DIMS);
    t->ndim = (int)json_array_size(js);
    json_array_foreach(js, idx, v) {
        json_int_t d = json_is_integer(v) ? json_integer_value(v) : -1;

        if (d < 0)
            return dsv4_error_set(-EINVAL, "%s: tensor %s: shape[%zu] is not a non-negative integer",
                                  f->path, name, idx);
        /* the element count can never exceed the data area's byte count */
        if (d > 0 && numel > data_size / (uint64_t)d)
            return dsv4_error_set(-EINVAL, "%s: tensor %s: shape larger than the file's data area "
                                  "(%" PRIu64 " bytes)", f->path, name, data_size);
        numel *= (uint64_t)d;
        t->shape[idx] = d;
    }
    for (int i = 0; i < 2; i++) {
        v = json_array_get(jo, (size_t)i);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return dsv4_error_set(-EINVAL, "%s: tensor %s: data_offsets[%d] is not a non-negative "
                                  "integer", f->path, name, i);
    }
    begin = (uint64_t)json_integer_value(json_array_get(jo, 0));
    end = (uint64_t)json_integer_value(json_array_get(jo, 1));
    if (begin > end || end > data_size)
        return dsv4_error_set(-EINVAL, "%s: tensor %s: data_offsets [%" PRIu64 ", %" PRIu64 "] outside "
                              "the data area of %" PRIu64 " bytes (truncated file?)",
                              f->path, name, begin, end, data_size);
    if (end - begin != numel * dsv4_dtype_size(t->dtype))
        return dsv4_error_set(-EINVAL, "%s: tensor %s: %" PRIu64 " bytes for %" PRIu64 " elements of %s "
                              "(expected %" PRIu64 ")", f->path, name, end - begin, numel,
                              dsv4_dtype_name(t->dtype), numel * dsv4_dtype_size(t->dtype));
    t->data = data + begin;
    t->nbytes = (size_t)(end - begin);
    t->file = f->base;
    return 0;
}

static int cmp_by_offset(const void *a, const void *b)
{
    const struct dsv4_st_tensor *x = a, *y = b;

    if (x->data != y->data)
        return (uintptr_t)x->data < (uintptr_t)y->data ? -1 : 1;
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

static int cmp_by_name(const void *a, const void *b)
{
    const struct dsv4_st_tensor *x = a, *y = b;

    return strcmp(x->name, y->name);
}

/* Map one file and append its tensors. */
static int load_file(struct dsv4_st *st, size_t fi)
{
    struct st_file *f = &st->files[fi];
    size_t first = st->ntensors;
    uint8_t lenbuf[8];
    uint64_t hlen = 0;
    struct stat sb;
    json_error_t jerr;
    json_t *root, *e;
    const char *key;
    int fd, r = 0;

    fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return dsv4_error_set(-errno, "%s: cannot open: %s", f->path, strerror(errno));
    if (fstat(fd, &sb) < 0) {
        r = dsv4_error_set(-errno, "%s: cannot stat: %s", f->path, strerror(errno));
        close(fd);
        return r;
    }
    if (!S_ISREG(sb.st_mode) || sb.st_size < 8) {
        close(fd);
        return dsv4_error_set(-EINVAL, "%s: not a safetensors file (%lld bytes, need at least an "
                              "8-byte header length)", f->path, (long long)sb.st_size);
    }
    f->size = (size_t)sb.st_size;
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        return dsv4_error_set(-errno, "%s: mmap failed: %s", f->path, strerror(errno));
    }
    memcpy(lenbuf, f->map, 8);
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | lenbuf[i];
    if (hlen > DSV4_ST_MAX_HEADER)
        return dsv4_error_set(-EINVAL, "%s: header length %" PRIu64 " exceeds the limit of %u bytes",
                              f->path, hlen, DSV4_ST_MAX_HEADER);
    if (hlen > f->size - 8)
        return dsv4_error_set(-EINVAL, "%s: header length %" PRIu64 " is longer than the file "
                              "(%zu bytes): truncated or not a safetensors file", f->path, hlen, f->size);
    root = json_loadb((const char *)f->map + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return dsv4_error_set(-EINVAL, "%s: corrupt header JSON at byte %d: %s", f->path,
                              jerr.position, jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return dsv4_error_set(-EINVAL, "%s: header is not a JSON object", f->path);
    }
    json_object_foreach(root, key, e) {
        struct dsv4_st_tensor t = { 0 };

        if (strcmp(key, "__metadata__") == 0)
            continue;
        r = parse_entry(f, key, e, (const uint8_t *)f->map + 8 + hlen, f->size - 8 - hlen, &t);
        if (r < 0)
            break;
        t.name = strdup(key);
        if (!t.name) {
            r = dsv4_error_set(-ENOMEM, "out of memory reading %s", f->path);
            break;
        }
        r = tensor_push(st, &t);
        if (r < 0) {
            free((char *)t.name);
            break;
        }
    }
    json_decref(root);
    if (r < 0)
        return r;

    /* overlap: in offset order, every non-empty tensor must start at or after the previous end */
    if (st->ntensors - first > 1)   /* a file of no tensors may leave st->tensors NULL: qsort takes none */
        qsort(st->tensors + first, st->ntensors - first, sizeof(*st->tensors), cmp_by_offset);
    for (size_t i = first + 1, prev = first; i < st->ntensors; i++) {
        const struct dsv4_st_tensor *a = &st->tensors[prev], *b = &st->tensors[i];

        if (b->nbytes == 0)
            continue;
        if (a->nbytes && (const uint8_t *)b->data < (const uint8_t *)a->data + a->nbytes)
            return dsv4_error_set(-EINVAL, "%s: tensors %s and %s overlap in the data area",
                                  f->path, a->name, b->name);
        prev = i;
    }
    return 0;
}

static int add_file(struct dsv4_st *st, const char *dir, const char *name)
{
    struct st_file *nf;

    if (st->nfiles >= DSV4_ST_MAX_SHARDS)
        return dsv4_error_set(-E2BIG, "%s: more than %u shards", st->source, DSV4_ST_MAX_SHARDS);
    for (size_t i = 0; i < st->nfiles; i++)
        if (strcmp(st->files[i].base, name) == 0)
            return 0;
    nf = realloc(st->files, (st->nfiles + 1) * sizeof(*nf));
    if (!nf)
        return dsv4_error_set(-ENOMEM, "out of memory opening %s", dir);
    st->files = nf;
    nf = &st->files[st->nfiles];
    memset(nf, 0, sizeof(*nf));
    nf->path = path_join(dir, name);
    if (!nf->path)
        return dsv4_error_set(-ENOMEM, "out of memory opening %s", dir);
    nf->base = nf->path + strlen(dir) + 1;
    st->nfiles++;
    return 0;
}

/* The index: {"weight_map": {tensor: file}}. Files must be plain names inside dir. */
static int read_index(struct dsv4_st *st, const char *dir, const char *path, json_t **ret_map)
{
    json_error_t jerr;
    json_t *root, *map, *v;
    const char *key;
    struct stat sb;
    FILE *f;
    int r = 0, fd = open(path, O_RDONLY | O_CLOEXEC);

    /* Opened here rather than by jansson, whose failure to open (a model directory the daemon's
     * user may not read) reads as corrupt JSON at line -1. */
    if (fd < 0)
        return dsv4_error_set(-errno, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &sb) < 0) {
        r = dsv4_error_set(-errno, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return r;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return dsv4_error_set(-EINVAL, "%s: not a regular file", path);
    }
    if (sb.st_size > (off_t)ST_MAX_INDEX_BYTES) {
        close(fd);
        return dsv4_error_set(-E2BIG, "%s: %lld bytes, over the limit of %u", path,
                              (long long)sb.st_size, ST_MAX_INDEX_BYTES);
    }
    if (!(f = fdopen(fd, "r"))) {
        r = dsv4_error_set(-errno, "%s: %s", path, strerror(errno));
        close(fd);
        return r;
    }
    root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root)
        return dsv4_error_set(-EINVAL, "%s: corrupt JSON at line %d: %s", path, jerr.line, jerr.text);
    map = json_object_get(root, "weight_map");
    if (!json_is_object(map)) {
        json_decref(root);
        return dsv4_error_set(-EINVAL, "%s: no \"weight_map\" object", path);
    }
    json_object_foreach(map, key, v) {
        const char *file = json_string_value(v);

        if (!file || !*file || strchr(file, '/') || strcmp(file, ".") == 0 || strcmp(file, "..") == 0) {
            r = dsv4_error_set(-EINVAL, "%s: tensor %s: shard must be a file name in the model "
                               "directory", path, key);
            break;
        }
        r = add_file(st, dir, file);
        if (r < 0)
            break;
    }
    if (r < 0) {
        json_decref(root);
        return r;
    }
    json_incref(map);
    json_decref(root);
    *ret_map = map;
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* No index and no model.safetensors: every *.safetensors in dir, in name order. */
static int scan_dir(struct dsv4_st *st, const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    char **names = NULL;
    size_t n = 0;
    int r = 0;

    if (!d)
        return dsv4_error_set(-errno, "%s: cannot open directory: %s", dir, strerror(errno));
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name), sl = strlen(ST_SUFFIX);
        char **nn;

        if (len <= sl || strcmp(de->d_name + len - sl, ST_SUFFIX) != 0)
            continue;
        if (n >= DSV4_ST_MAX_SHARDS) {
            r = dsv4_error_set(-E2BIG, "%s: more than %u shards", dir, DSV4_ST_MAX_SHARDS);
            break;
        }
        nn = realloc(names, (n + 1) * sizeof(*names));
        if (!nn || !(nn[n] = strdup(de->d_name))) {
            names = nn ? nn : names;
            r = dsv4_error_set(-ENOMEM, "out of memory listing %s", dir);
            break;
        }
        names = nn;
        n++;
    }
    closedir(d);
    if (r == 0 && n == 0)
        r = dsv4_error_set(-ENOENT, "%s: no %s, %s or *%s", dir, ST_INDEX_NAME, ST_SINGLE_NAME, ST_SUFFIX);
    if (r == 0)
        qsort(names, n, sizeof(*names), cmp_str);
    for (size_t i = 0; i < n; i++) {
        if (r == 0)
            r = add_file(st, dir, names[i]);
        free(names[i]);
    }
    free(names);
    return r;
}

int dsv4_st_open(const char *dir, struct dsv4_st **ret)
{
    struct dsv4_st *st = calloc(1, sizeof(*st));
    json_t *weight_map = NULL;
    char *index = path_join(dir, ST_INDEX_NAME), *single = path_join(dir, ST_SINGLE_NAME);
    int r = 0;

    if (!st || !index || !single) {
        r = dsv4_error_set(-ENOMEM, "out of memory opening %s", dir);
        goto out;
    }
    if (access(index, F_OK) == 0) {
        st->source = strdup(index);
        r = st->source ? read_index(st, dir, index, &weight_map) : -ENOMEM;
    } else if (access(single, F_OK) == 0) {
        st->source = strdup(single);
        r = st->source ? add_file(st, dir, ST_SINGLE_NAME) : -ENOMEM;
    } else {
        st->source = strdup(dir);
        r = st->source ? scan_dir(st, dir) : -ENOMEM;
    }
    if (r == -ENOMEM && !st->source)
        dsv4_error_set(r, "out of memory opening %s", dir);
    for (size_t i = 0; r == 0 && i < st->nfiles; i++)
        r = load_file(st, i);
    if (r < 0 || (r = dsv4_st_seal(st)) < 0)
        goto out;
    if (weight_map) {
        const char *key;
        json_t *v;

        json_object_foreach(weight_map, key, v) {
            const struct dsv4_st_tensor *t = dsv4_st_find(st, key);

            if (!t) {
                r = dsv4_error_set(-EINVAL, "%s lists tensor %s in %s, which does not contain it",
                                   index, key, json_string_value(v));
                goto out;
            }
            if (strcmp(t->file, json_string_value(v)) != 0) {
                r = dsv4_error_set(-EINVAL, "%s lists tensor %s in %s, but it is in %s",
                                   index, key, json_string_value(v), t->file);
                goto out;
            }
        }
    }
out:
    json_decref(weight_map);
    free(index);
    free(single);
    if (r < 0) {
        dsv4_st_close(st);
        return r;
    }
    *ret = st;
    return 0;
}

int dsv4_st_seal(struct dsv4_st *st)
{
    if (st->ntensors > 1)
        qsort(st->tensors, st->ntensors, sizeof(*st->tensors), cmp_by_name);
    for (size_t i = 1; i < st->ntensors; i++)
        if (strcmp(st->tensors[i - 1].name, st->tensors[i].name) == 0)
            return dsv4_error_set(-EINVAL, "tensor %s appears in both %s and %s", st->tensors[i].name,
                                  st->tensors[i - 1].file, st->tensors[i].file);
    return 0;
}

int dsv4_st_new(const char *source, struct dsv4_st **ret)
{
    struct dsv4_st *st = calloc(1, sizeof(*st));

    if (!st || !(st->source = strdup(source))) {
        free(st);
        return dsv4_error_set(-ENOMEM, "out of memory building %s", source);
    }
    *ret = st;
    return 0;
}

int dsv4_st_add(struct dsv4_st *st, const char *name, enum dsv4_dtype dt, int ndim, const int64_t *shape,
                const void *data, bool owned)
{
    struct dsv4_st_tensor t = { .dtype = dt, .ndim = ndim, .data = data, .file = st->source };
    size_t n = 1;
    int r;

    if (ndim < 0 || ndim > DSV4_ST_MAX_DIMS)
        return dsv4_error_set(-EINVAL, "%s: tensor %s has %d dimensions, at most %d", st->source, name, ndim,
                              DSV4_ST_MAX_DIMS);
    for (int i = 0; i < ndim; i++) {
        t.shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    t.nbytes = n * dsv4_dtype_size(dt);
    if (owned && st->nowned == st->capowned) {
        size_t cap = st->capowned ? 2 * st->capowned : 256;
        void **no = realloc(st->owned, cap * sizeof(*no));

        if (!no)
            return dsv4_error_set(-ENOMEM, "out of memory building %s", st->source);
        st->owned = no;
        st->capowned = cap;
    }
    if (!(t.name = strdup(name)))
        return dsv4_error_set(-ENOMEM, "out of memory building %s", st->source);
    if ((r = tensor_push(st, &t)) < 0) {
        free((char *)t.name);
        return r;
    }
    if (owned)
        st->owned[st->nowned++] = (void *)data;
    return 0;
}

void dsv4_st_close(struct dsv4_st *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->ntensors; i++)
        free((char *)st->tensors[i].name);
    free(st->tensors);
    for (size_t i = 0; i < st->nowned; i++)
        free(st->owned[i]);
    free(st->owned);
    for (size_t i = 0; i < st->nfiles; i++) {
        if (st->files[i].map)
            munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->source);
    free(st);
}

const struct dsv4_st_tensor *dsv4_st_find(const struct dsv4_st *st, const char *name)
{
    struct dsv4_st_tensor key = { .name = name };

    if (st->ntensors == 0)  /* no array to search (NULL): bsearch takes none */
        return NULL;
    return bsearch(&key, st->tensors, st->ntensors, sizeof(key), cmp_by_name);
}

size_t dsv4_st_count(const struct dsv4_st *st)
{
    return st->ntensors;
}

const struct dsv4_st_tensor *dsv4_st_at(const struct dsv4_st *st, size_t i)
{
    return i < st->ntensors ? &st->tensors[i] : NULL;
}

const char *dsv4_st_source(const struct dsv4_st *st)
{
    return st->source;
}
