/* SPDX-License-Identifier: MIT */
/* engine/model/safetensors: every dtype read back in place, the three ways to find the shards, and
 * every malformed file refused with a message naming the file and, where there is one, the
 * tensor. */
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
#include <unistd.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/model/safetensors.h"
#include "tests/unit/seed_util.h"
#include "tests/unit/st_writer.h"

static uint64_t seed;

static void random_bytes(uint8_t *p, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)stw_rand(s);
}

static void test_dtypes(void **state)
{
    static const struct { const char *name; enum dsv4_dtype dt; size_t size; int ndim; int64_t shape[4]; } cases[] = {
        { "F32", DSV4_DT_F32, 4, 2, { 2, 3 } },
        { "F16", DSV4_DT_F16, 2, 2, { 2, 2 } },
        { "BF16", DSV4_DT_BF16, 2, 1, { 5 } },
        { "F8_E4M3", DSV4_DT_F8_E4M3, 1, 3, { 2, 3, 4 } },
        { "F8_E8M0", DSV4_DT_F8_E8M0, 1, 2, { 1, 1 } },
        { "I8", DSV4_DT_I8, 1, 2, { 3, 8 } },
        { "U8", DSV4_DT_U8, 1, 4, { 1, 2, 3, 2 } },
        { "I32", DSV4_DT_I32, 4, 1, { 7 } },
        { "I64", DSV4_DT_I64, 8, 2, { 3, 2 } },
        { "F32", DSV4_DT_F32, 4, 2, { 0, 5 } },      /* empty tensors are legal */
        { "F32", DSV4_DT_F32, 4, 0, { 0 } },         /* so are scalars */
    };
    enum { N = sizeof(cases) / sizeof(cases[0]) };
    struct stw_tensor ts[N];
    uint8_t *bufs[N];
    char names[N][32];
    uint64_t s = seed;
    char *dir = stw_tempdir();
    struct dsv4_st *st;

    for (size_t i = 0; i < N; i++) {
        size_t n = cases[i].size;

        for (int d = 0; d < cases[i].ndim; d++)
            n *= (size_t)cases[i].shape[d];
        bufs[i] = malloc(n + 1);
        random_bytes(bufs[i], n, &s);
        snprintf(names[i], sizeof(names[i]), "t%zu.%s", i, cases[i].name);
        ts[i] = (struct stw_tensor){ names[i], cases[i].name, cases[i].ndim, { 0 }, bufs[i], n };
        memcpy(ts[i].shape, cases[i].shape, sizeof(ts[i].shape));
    }
    assert_int_equal(stw_write(dir, "model.safetensors", ts, N), 0);
    if (dsv4_st_open(dir, &st) < 0)
        fail_msg("%s", dsv4_error_message());
    assert_int_equal(dsv4_st_count(st), N);
    assert_non_null(strstr(dsv4_st_source(st), "model.safetensors"));
    for (size_t i = 0; i < N; i++) {
        const struct dsv4_st_tensor *t = dsv4_st_find(st, names[i]);

        assert_non_null(t);
        assert_string_equal(t->name, names[i]);
        assert_int_equal(t->dtype, cases[i].dt);
        assert_int_equal(dsv4_dtype_size(t->dtype), cases[i].size);
        assert_string_equal(dsv4_dtype_name(t->dtype), cases[i].name);
        assert_int_equal(t->ndim, cases[i].ndim);
        for (int d = 0; d < t->ndim; d++)
            assert_int_equal(t->shape[d], cases[i].shape[d]);
        assert_int_equal(t->nbytes, ts[i].nbytes);
        if (t->nbytes)
            assert_memory_equal(t->data, bufs[i], t->nbytes);
        assert_string_equal(t->file, "model.safetensors");
    }
    /* dsv4_st_at walks the sorted table */
    for (size_t i = 1; i < N; i++)
        assert_true(strcmp(dsv4_st_at(st, i - 1)->name, dsv4_st_at(st, i)->name) < 0);
    assert_null(dsv4_st_at(st, N));
    assert_null(dsv4_st_find(st, "absent"));
    dsv4_st_close(st);
    dsv4_st_close(NULL);
    for (size_t i = 0; i < N; i++)
        free(bufs[i]);
    stw_rmdir(dir);
    free(dir);
}

/* Two shards named by an index, and a directory without index or model.safetensors. */
static void test_shards(void **state)
{
    float a[6], b[4];
    uint64_t s = seed ^ 7;
    struct stw_tensor ta[] = { { "w.a", "F32", 2, { 2, 3 }, a, sizeof(a) } };
    struct stw_tensor tb[] = { { "w.b", "F32", 1, { 4 }, b, sizeof(b) } };
    char *dir = stw_tempdir();
    struct dsv4_st *st;

    for (int i = 0; i < 6; i++)
        a[i] = stw_uniform(&s);
    for (int i = 0; i < 4; i++)
        b[i] = stw_uniform(&s);
    assert_int_equal(stw_write(dir, "part-1.safetensors", ta, 1), 0);
    assert_int_equal(stw_write(dir, "part-2.safetensors", tb, 1), 0);
    /* no index: every *.safetensors */
    assert_int_equal(dsv4_st_open(dir, &st), 0);
    assert_int_equal(dsv4_st_count(st), 2);
    assert_string_equal(dsv4_st_find(st, "w.b")->file, "part-2.safetensors");
    assert_memory_equal(dsv4_st_find(st, "w.a")->data, a, sizeof(a));
    dsv4_st_close(st);
    /* with an index */
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json",
                                    "{\"metadata\": {\"total_size\": 40}, \"weight_map\": "
                                    "{\"w.a\": \"part-1.safetensors\", \"w.b\": \"part-2.safetensors\"}}"), 0);
    assert_int_equal(dsv4_st_open(dir, &st), 0);
    assert_int_equal(dsv4_st_count(st), 2);
    assert_string_equal(dsv4_st_find(st, "w.a")->file, "part-1.safetensors");
    assert_memory_equal(dsv4_st_find(st, "w.b")->data, b, sizeof(b));
    assert_non_null(strstr(dsv4_st_source(st), "model.safetensors.index.json"));
    dsv4_st_close(st);
    stw_rmdir(dir);
    free(dir);
}

/* dsv4_st_open(dir) fails with `code` and a message holding each non-NULL string. */
static void expect_error3(const char *dir, int code, const char *must1, const char *must2, const char *must3)
{
    const char *must[3] = { must1, must2, must3 };
    struct dsv4_st *st = NULL;
    int r = dsv4_st_open(dir, &st);

    assert_null(st);
    if (r != code)
        fail_msg("expected %d, got %d: %s", code, r, dsv4_error_message());
    for (int i = 0; i < 3; i++)
        if (must[i] && !strstr(dsv4_error_message(), must[i]))
            fail_msg("message lacks \"%s\": %s", must[i], dsv4_error_message());
}

static void expect_error(const char *dir, int code, const char *must1, const char *must2)
{
    expect_error3(dir, code, must1, must2, NULL);
}

/* One model.safetensors with a hand-written header and `data` bytes of data area. */
static void expect_bad_header(const char *header, size_t data, const char *must1, const char *must2)
{
    char *dir = stw_tempdir();
    uint8_t *zeros = calloc(1, data + 1);

    assert_int_equal(stw_write_raw(dir, "model.safetensors", strlen(header), header, zeros, data), 0);
    expect_error3(dir, -EINVAL, "model.safetensors", must1, must2);
    free(zeros);
    stw_rmdir(dir);
    free(dir);
}

static void test_bad_headers(void **state)
{
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]", 8,
                      "corrupt header JSON", NULL);
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                      " \"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}", 16,
                      "corrupt header JSON", NULL);
    expect_bad_header("[1, 2]", 0, "not a JSON object", NULL);
    expect_bad_header("{\"w\": {\"dtype\": \"F64\", \"shape\": [2], \"data_offsets\": [0, 16]}}", 16,
                      "tensor w:", "unknown dtype 'F64'");
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}", 12,
                      "tensor w:", "12 bytes for 4 elements");
    /* offsets past the end of the data area: what a truncated file looks like */
    expect_bad_header("{\"w.trunc\": {\"dtype\": \"F32\", \"shape\": [16], \"data_offsets\": [0, 64]}}", 40,
                      "tensor w.trunc", "outside the data area");
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 4]}}", 8,
                      "tensor w:", "outside");
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [-2], \"data_offsets\": [0, 8]}}", 8,
                      "tensor w:", "shape[0]");
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 8]}}", 8,
                      "tensor w:", "shape[0]");
    expect_bad_header("{\"w\": {\"dtype\": \"U8\", \"shape\": [1, 1, 1, 1, 1], \"data_offsets\": [0, 1]}}", 1,
                      "tensor w:", "5 dimensions");
    expect_bad_header("{\"w\": {\"dtype\": \"U8\", \"shape\": [4294967296, 4294967296, 4294967296],"
                      " \"data_offsets\": [0, 1]}}", 1, "tensor w:", "larger than");
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2]}}", 8, "tensor w:", "data_offsets");
    expect_bad_header("{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, -8]}}", 8,
                      "tensor w:", "data_offsets[1]");
    expect_bad_header("{\"w\": 3}", 0, "tensor w:", NULL);
    /* overlap: [0, 16) and [8, 24) */
    expect_bad_header("{\"first\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
                      " \"second\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}}", 24,
                      "first", "second");
    /* identical ranges overlap too */
    expect_bad_header("{\"a\": {\"dtype\": \"I32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                      " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8, "overlap", NULL);
}

/* A header with only metadata is a file of no tensors (it once sorted a NULL array: UBSan). */
static void test_no_tensors(void **state)
{
    char *dir = stw_tempdir();
    const char *h = "{\"__metadata__\": {\"format\": \"pt\"}}";
    struct dsv4_st *st;
    assert_int_equal(stw_write_raw(dir, "model.safetensors", strlen(h), h, NULL, 0), 0);
    assert_int_equal(dsv4_st_open(dir, &st), 0);
    assert_int_equal(dsv4_st_count(st), 0);
    assert_null(dsv4_st_find(st, "w"));
    dsv4_st_close(st);
    stw_rmdir(dir);
    free(dir);
}

static void test_bad_lengths(void **state)
{
    char *dir = stw_tempdir();
    const char *h = "{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}";
    uint8_t four[4] = { 0 };

    /* header length longer than the file */
    assert_int_equal(stw_write_raw(dir, "model.safetensors", 1000, h, four, 4), 0);
    expect_error(dir, -EINVAL, "model.safetensors", "longer than the file");
    /* over the limit, before anything is allocated */
    assert_int_equal(stw_write_raw(dir, "model.safetensors", (uint64_t)DSV4_ST_MAX_HEADER + 1, h, four, 4), 0);
    expect_error(dir, -EINVAL, "model.safetensors", "exceeds the limit");
    assert_int_equal(stw_write_raw(dir, "model.safetensors", UINT64_MAX, h, four, 4), 0);
    expect_error(dir, -EINVAL, "model.safetensors", "exceeds the limit");
    /* too short for a length */
    assert_int_equal(stw_write_text(dir, "model.safetensors", "abc"), 0);
    expect_error(dir, -EINVAL, "model.safetensors", "8-byte");
    stw_rmdir(dir);
    /* nothing to open */
    assert_int_equal(mkdir(dir, 0700), 0);
    expect_error(dir, -ENOENT, dir, "*.safetensors");
    stw_rmdir(dir);
    free(dir);
}

static void test_bad_shards(void **state)
{
    float x[2] = { 1.0f, 2.0f };
    struct stw_tensor t1[] = { { "dup", "F32", 1, { 2 }, x, sizeof(x) } };
    struct stw_tensor t2[] = { { "dup", "F32", 1, { 2 }, x, sizeof(x) }, { "other", "F32", 1, { 2 }, x, sizeof(x) } };
    struct stw_tensor t3[] = { { "dup", "F32", 1, { 2 }, x, sizeof(x) }, { "extra", "F32", 1, { 2 }, x, sizeof(x) } };
    char *dir = stw_tempdir(), path[4200];

    assert_int_equal(stw_write(dir, "a.safetensors", t1, 1), 0);
    assert_int_equal(stw_write(dir, "b.safetensors", t2, 2), 0);
    expect_error(dir, -EINVAL, "tensor dup", "a.safetensors and b.safetensors");
    /* the index names a file that lacks the tensor */
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json",
                                    "{\"weight_map\": {\"dup\": \"a.safetensors\", \"other\": \"a.safetensors\"}}"), 0);
    snprintf(path, sizeof(path), "%s/b.safetensors", dir);
    assert_int_equal(unlink(path), 0);
    expect_error(dir, -EINVAL, "tensor other", "a.safetensors");
    /* the index lists a tensor in a file it is not in */
    assert_int_equal(stw_write(dir, "a.safetensors", t3, 2), 0);
    assert_int_equal(stw_write(dir, "b.safetensors", t2 + 1, 1), 0);
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json",
                                    "{\"weight_map\": {\"extra\": \"a.safetensors\", \"dup\": \"b.safetensors\","
                                    " \"other\": \"b.safetensors\"}}"), 0);
    expect_error(dir, -EINVAL, "tensor dup", "but it is in a.safetensors");
    /* a shard outside the directory, a missing shard, a broken index */
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json",
                                    "{\"weight_map\": {\"dup\": \"../a.safetensors\"}}"), 0);
    expect_error(dir, -EINVAL, "tensor dup", "model.safetensors.index.json");
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json",
                                    "{\"weight_map\": {\"dup\": \"c.safetensors\"}}"), 0);
    expect_error(dir, -ENOENT, "c.safetensors", NULL);
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json", "{\"weight_map\": "), 0);
    expect_error(dir, -EINVAL, "model.safetensors.index.json", "corrupt JSON");
    assert_int_equal(stw_write_text(dir, "model.safetensors.index.json", "{\"metadata\": {}}"), 0);
    expect_error(dir, -EINVAL, "model.safetensors.index.json", "weight_map");
    /* an index that cannot be read is not called corrupt JSON: the reason is what the operator acts on */
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    if (geteuid() != 0) {
        assert_int_equal(chmod(path, 0), 0);
        expect_error(dir, -EACCES, "model.safetensors.index.json: cannot open", strerror(EACCES));
    }
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkdir(path, 0700), 0);
    expect_error(dir, -EINVAL, "model.safetensors.index.json: not a regular file", NULL);
    assert_int_equal(rmdir(path), 0);
    stw_rmdir(dir);
    free(dir);
}

/* Random damage to a valid file (flipped header bytes, truncation): the reader either refuses
 * with a message or returns tensors that satisfy every invariant it promises. ASan watches the
 * rest. */
static void test_mutations(void **state)
{
    uint8_t payload[96];
    struct stw_tensor ts[] = {
        { "a", "F32", 2, { 2, 3 }, payload, 24 },
        { "b", "BF16", 1, { 8 }, payload + 24, 16 },
        { "c", "I64", 1, { 4 }, payload + 40, 32 },
        { "d", "U8", 2, { 4, 6 }, payload + 72, 24 },
    };
    uint64_t s = seed ^ 0xabcdef;
    char *dir = stw_tempdir(), path[4200];
    uint8_t *orig;
    long size;
    FILE *f;

    random_bytes(payload, sizeof(payload), &s);
    assert_int_equal(stw_write(dir, "model.safetensors", ts, 4), 0);
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    size = ftell(f);
    fseek(f, 0, SEEK_SET);
    orig = malloc((size_t)size);
    assert_int_equal(fread(orig, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    for (int it = 0; it < 600; it++) {
        uint8_t *buf = malloc((size_t)size);
        long len = size, hdr = size - (long)sizeof(payload);
        struct dsv4_st *st = NULL;
        int r;

        memcpy(buf, orig, (size_t)size);
        if (it % 5 == 4) {
            len = (long)(stw_rand(&s) % (uint64_t)size);
        } else {
            for (int k = 0, n = 1 + (int)(stw_rand(&s) % 4); k < n; k++) {
                static const char alphabet[] = "0123456789{}[],:\" -eE.F";

                buf[stw_rand(&s) % (uint64_t)hdr] = (uint8_t)(k % 2 ? stw_rand(&s)
                                                              : (uint64_t)alphabet[stw_rand(&s) % (sizeof(alphabet) - 1)]);
            }
        }
        f = fopen(path, "wb");
        fwrite(buf, 1, (size_t)len, f);
        fclose(f);
        dsv4_error_clear();
        r = dsv4_st_open(dir, &st);
        if (r < 0) {
            assert_null(st);
            assert_true(strlen(dsv4_error_message()) > 0);
        } else {
            const uint8_t *lo = NULL, *hi = NULL;

            for (size_t i = 0; i < dsv4_st_count(st); i++) {
                const struct dsv4_st_tensor *t = dsv4_st_at(st, i);
                size_t n = dsv4_dtype_size(t->dtype);

                for (int d = 0; d < t->ndim; d++)
                    n *= (size_t)t->shape[d];
                assert_int_equal(n, t->nbytes);
                if (!lo || (const uint8_t *)t->data < lo)
                    lo = t->data;
                if (!hi || (const uint8_t *)t->data + t->nbytes > hi)
                    hi = (const uint8_t *)t->data + t->nbytes;
                for (size_t j = 0; j < i; j++) {
                    const struct dsv4_st_tensor *u = dsv4_st_at(st, j);
                    const uint8_t *a = t->data, *b = u->data;

                    if (t->nbytes && u->nbytes)
                        assert_true(a + t->nbytes <= b || b + u->nbytes <= a);
                }
            }
            /* all data lies within one file-sized window */
            if (lo)
                assert_true(hi - lo <= len);
            dsv4_st_close(st);
        }
        free(buf);
    }
    free(orig);
    stw_rmdir(dir);
    free(dir);
}

static int setup(void **state)
{
    seed = dsv4_test_seed();
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_shards),
        cmocka_unit_test(test_bad_headers),
        cmocka_unit_test(test_no_tensors),
        cmocka_unit_test(test_bad_lengths),
        cmocka_unit_test(test_bad_shards),
        cmocka_unit_test(test_mutations),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
