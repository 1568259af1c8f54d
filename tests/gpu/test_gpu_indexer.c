/* SPDX-License-Identifier: MIT */
/* GPU: the lightning indexer's scores and top-k (kernels/indexer.cu), on their own, against a double
 * reference, at V4-Flash's shape (64 heads x 128, top-512 of up to 4096 entries) and tiny ones:
 *   - keys in the official FP4 layout (fp8 numerics: the tensor-core scorer for dI 32/64/128, the
 *     FMA one for dI 16) with FP4-valued queries, and f32 keys with f32 queries (exact numerics);
 *   - scores of every complete entry within 1e-5 of the reference (f32 sums in another order);
 *   - top-k exactly what the rule (higher score first, then lower index; ascending output) gives
 *     on the kernel's own scores, which checks the selection bit for bit, ties included: each slot
 *     holds copies of one key and all-zero keys (exact ties, some across the top-k boundary);
 *   - where the reference's k-th and (k+1)-th scores are apart by more than SEP, the chosen set
 *     equals the reference's (the rows that are not are counted and printed);
 *   - rows with no more complete entries than topk take them all, in order;
 *   - rows in other slots and at other positions of the batch do not change a row's result. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"
#include "kernels/kernels_internal.h"

#define SCORE_BOUND 1e-5
/* Relative gap between the reference's k-th and (k+1)-th scores above which its top-k is the only
 * choice scores within SCORE_BOUND of it allow: every kernel score is checked within SCORE_BOUND x
 * the largest first, so past 2 x SCORE_BOUND the kernel must choose exactly the reference's set. */
#define SEP (2.0 * SCORE_BOUND)
#define MAX_ROWS 8
#define SLOTS 3
#define FP4_GROUP 32

/* kernels/indexer.cu: dsv4_cuda_indexer with C linkage. */
int dsv4_cuda_indexer_once(const struct dsv4_cuda_index_args *a, int batch, void *stream);

struct ix_case {
    const char *what;
    bool packed;
    int nI, dI, topk, ratio;
    int rows;
    int pos[MAX_ROWS];
};

static const struct ix_case cases[] = {
    { "flash fp4 keys (mma)", true, 64, 128, 512, 4, 6, { 16383, 4095, 100, 8190, 2051, 16000 } },
    { "flash f32 keys (fma)", false, 64, 128, 512, 4, 6, { 16383, 4095, 100, 8190, 12287, 14335 } },
    { "tiny fp4 keys dI 32 (mma)", true, 8, 32, 8, 4, 5, { 35, 36, 200, 3, 511 } },
    { "tiny fp4 keys dI 64, 16 heads (mma)", true, 16, 64, 8, 4, 4, { 35, 99, 511, 7 } },
    { "tiny fp4 keys dI 16 (fma)", true, 16, 16, 6, 4, 4, { 35, 99, 511, 27 } },
    { "tiny f32 keys (fma)", false, 8, 32, 8, 4, 4, { 35, 99, 511, 11 } },
};

static const float e2m1_mag[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };

/* dI random FP4 values (1x32 power-of-two scales near 2^center) into v; with key, also their
 * official packed form (codes low nibble first, then the UE8M0 scales). */
static void fp4_vector(float *v, uint8_t *key, int dI, int center)
{
    const int G = (dI + FP4_GROUP - 1) / FP4_GROUP;
    float sc[8];
    assert_true(G <= 8);
    if (key)
        memset(key, 0, (size_t)dI / 2);
    for (int g = 0; g < G; g++) {
        const int e = 127 + center + (int)(gt_u64() % 3) - 1;
        sc[g] = ldexpf(1.0f, e - 127);
        if (key)
            key[dI / 2 + g] = (uint8_t)e;
    }
    for (int i = 0; i < dI; i++) {
        const uint32_t code = (uint32_t)(gt_u64() & 15);
        v[i] = (code & 8 ? -1.0f : 1.0f) * e2m1_mag[code & 7] * sc[i / FP4_GROUP];
        if (key)
            key[i / 2] |= (uint8_t)(code << (4 * (i & 1)));
    }
}

static double ref_score(const float *q, const float *w, const float *k, int nI, int dI)
{
    const double qscale = 1.0 / sqrt((double)dI), wscale = 1.0 / sqrt((double)nI);
    double s = 0.0;
    for (int h = 0; h < nI; h++) {
        double dot = 0.0;
        for (int i = 0; i < dI; i++)
            dot += (double)q[h * dI + i] * k[i];
        s += (dot > 0.0 ? dot : 0.0) * qscale * (w[h] * wscale);
    }
    return s;
}

/* The rule on scores sc [n]: the k best (higher first, ties to the lower index), ascending. */
static const float *cmp_f;
static const double *cmp_d;
static int by_score_f(const void *a, const void *b)
{
    const int x = *(const int *)a, y = *(const int *)b;
    if (cmp_f[x] != cmp_f[y])
        return cmp_f[x] > cmp_f[y] ? -1 : 1;
    return (x > y) - (x < y);
}

static int by_score_d(const void *a, const void *b)
{
    const int x = *(const int *)a, y = *(const int *)b;
    if (cmp_d[x] != cmp_d[y])
        return cmp_d[x] > cmp_d[y] ? -1 : 1;
    return (x > y) - (x < y);
}

static int by_index(const void *a, const void *b)
{
    const int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* The first K entries of the ranking idx, ascending, must be row r's choice sel [K]. */
static void expect_choice(const struct ix_case *c, int r, const int32_t *sel, const int *idx, int *want, int K,
                          const char *whose)
{
    memcpy(want, idx, sizeof(int) * (size_t)K);
    qsort(want, (size_t)K, sizeof(int), by_index);
    for (int i = 0; i < K; i++)
        if (sel[i] != want[i])
            fail_msg("%s row %d: choice %d is entry %d, %s gives %d", c->what, r, i, sel[i], whose, want[i]);
}

static void check_case(const struct ix_case *c)
{
    const int B = c->rows, nI = c->nI, dI = c->dI, K = c->topk;
    /* the official key (doc/MODEL.md §5.2): dI/2 bytes of e2m1 codes + one UE8M0 scale per 32; or dI f32 */
    const int kb = c->packed ? dI / 2 + (dI + FP4_GROUP - 1) / FP4_GROUP : dI * (int)sizeof(float);
    int max_n = 0;
    for (int r = 0; r < B; r++)
        max_n = (c->pos[r] + 1) / c->ratio > max_n ? (c->pos[r] + 1) / c->ratio : max_n;
    const int E = max_n;                            /* max_entries */
    const size_t stride = (size_t)E * (size_t)kb;   /* bytes a slot */
    uint8_t *keys = calloc(SLOTS, stride);
    float *kv = malloc(sizeof(float) * SLOTS * (size_t)E * dI);    /* the keys' values */
    float *q = malloc(sizeof(float) * (size_t)B * nI * dI), *w = malloc(sizeof(float) * (size_t)B * nI);
    int32_t pos[MAX_ROWS], slot[MAX_ROWS];
    assert_non_null(keys);
    assert_non_null(kv);

    for (int sl = 0; sl < SLOTS; sl++)
        for (int s = 0; s < E; s++) {
            float *v = kv + ((size_t)sl * E + s) * dI;
            uint8_t *key = keys + sl * stride + (size_t)s * kb;
            const int kind = s % 11;
            if (s >= 4 && kind == 3) {                      /* a copy of entry s % 4: exact ties */
                memcpy(v, kv + ((size_t)sl * E + s % 4) * dI, sizeof(float) * dI);
                memcpy(key, keys + sl * stride + (size_t)(s % 4) * kb, (size_t)kb);
            } else if (kind == 7 || (sl == 2 && s >= K / 2)) {   /* all zero: score exactly 0 */
                memset(v, 0, sizeof(float) * dI);
                if (c->packed)
                    memset(key + dI / 2, 127, (size_t)(kb - dI / 2));
            } else if (c->packed) {
                fp4_vector(v, key, dI, -2);
            } else {
                gt_fill_normal(v, (size_t)dI, 1.0f);
                memcpy(key, v, sizeof(float) * dI);
            }
        }
    for (int r = 0; r < B; r++) {
        pos[r] = c->pos[r];
        slot[r] = r % SLOTS;
        for (int h = 0; h < nI; h++) {
            if (c->packed)
                fp4_vector(q + ((size_t)r * nI + h) * dI, NULL, dI, 0);
            else
                gt_fill_normal(q + ((size_t)r * nI + h) * dI, (size_t)dI, 1.0f);
        }
        gt_fill_normal(w + (size_t)r * nI, (size_t)nI, 1.0f);
    }

    struct dsv4_cuda_index_args a = { 0 };
    a.q = gt_dev_copy(q, sizeof(float) * (size_t)B * nI * dI);
    a.w = gt_dev_copy(w, sizeof(float) * (size_t)B * nI);
    a.nI = nI;
    a.dI = dI;
    a.ratio = c->ratio;
    a.topk = K;
    a.pos = gt_dev_copy(pos, sizeof(pos));
    a.slot = gt_dev_copy(slot, sizeof(slot));
    a.keys = gt_dev_copy(keys, SLOTS * stride);
    a.keys_slot_stride = (int64_t)stride;
    a.packed = c->packed;
    a.max_entries = E;
    a.scores = gt_dev_poisoned((size_t)B * E);
    a.sel = (int32_t *)gt_dev_poisoned((size_t)B * K);
    a.nsel = (int32_t *)gt_dev_poisoned((size_t)B);
    DSV4_OK(dsv4_cuda_indexer_once(&a, B, NULL));
    float *sc = gt_host_from(a.scores, (size_t)B * E);
    int32_t *sel = (int32_t *)gt_host_from((const float *)a.sel, (size_t)B * K);
    int32_t *nsel = (int32_t *)gt_host_from((const float *)a.nsel, (size_t)B);

    /* row 0 alone (batch 1) gives the same scores and choice */
    struct dsv4_cuda_index_args one = a;
    one.scores = gt_dev_poisoned((size_t)E);
    one.sel = (int32_t *)gt_dev_poisoned((size_t)K);
    one.nsel = (int32_t *)gt_dev_poisoned(1);
    DSV4_OK(dsv4_cuda_indexer_once(&one, 1, NULL));
    int32_t *sel1 = (int32_t *)gt_host_from((const float *)one.sel, (size_t)K);

    int *idx = malloc(sizeof(int) * (size_t)E), *want = malloc(sizeof(int) * (size_t)K);
    double *rs = malloc(sizeof(double) * (size_t)E);
    double worst = 0.0;
    int separated = 0, unseparated = 0, full_rows = 0;
    for (int r = 0; r < B; r++) {
        const int n = (pos[r] + 1) / c->ratio;
        if (n <= K) {                               /* every entry, in order, no scores needed */
            full_rows++;
            assert_int_equal(nsel[r], n);
            for (int i = 0; i < n; i++)
                assert_int_equal(sel[(size_t)r * K + i], i);
            continue;
        }
        assert_int_equal(nsel[r], K);
        const float *kr = kv + (size_t)slot[r] * E * dI;
        double num = 0.0, den = 0.0;
        for (int s = 0; s < n; s++) {
            rs[s] = ref_score(q + (size_t)r * nI * dI, w + (size_t)r * nI, kr + (size_t)s * dI, nI, dI);
            const float g = sc[(size_t)r * E + s];
            if (!isfinite(g))
                fail_msg("%s row %d: score %d is %g", c->what, r, s, g);
            num = fmax(num, fabs(g - rs[s]));
            den = fmax(den, fabs(rs[s]));
        }
        const double err = den > 0.0 ? num / den : num;
        worst = err > worst ? err : worst;
        if (!(err <= SCORE_BOUND))
            fail_msg("%s row %d: scores differ by %g of the largest (bound %g)", c->what, r, err, SCORE_BOUND);

        /* the selection, bit for bit, against the rule on the kernel's own scores */
        for (int s = 0; s < n; s++)
            idx[s] = s;
        cmp_f = sc + (size_t)r * E;
        qsort(idx, (size_t)n, sizeof(int), by_score_f);
        expect_choice(c, r, sel + (size_t)r * K, idx, want, K, "the rule on its scores");

        /* against the reference where its boundary is clear */
        cmp_d = rs;
        for (int s = 0; s < n; s++)
            idx[s] = s;
        qsort(idx, (size_t)n, sizeof(int), by_score_d);
        if (rs[idx[K - 1]] - rs[idx[K]] > SEP * den) {
            separated++;
            expect_choice(c, r, sel + (size_t)r * K, idx, want, K, "the reference");
        } else {
            unseparated++;
        }
    }
    assert_memory_equal(sel1, sel, sizeof(int32_t) * (size_t)K);   /* row 0 alone == in the batch */
    printf("# %-36s scores within %.3g (bound %.0e); %d rows chosen as the reference chose, %d rows with a "
           "boundary closer than %.0e (checked against the rule only), %d rows taking every entry\n", c->what,
           worst, SCORE_BOUND, separated, unseparated, SEP, full_rows);
    assert_true(separated + unseparated + full_rows == B);
    assert_true(separated >= 1);        /* the reference comparison ran on some row */

    cudaFree((void *)a.q); cudaFree((void *)a.w); cudaFree((void *)a.pos); cudaFree((void *)a.slot);
    cudaFree((void *)a.keys); cudaFree(a.scores); cudaFree(a.sel); cudaFree(a.nsel);
    cudaFree(one.scores); cudaFree(one.sel); cudaFree(one.nsel);
    free(keys); free(kv); free(q); free(w); free(sc); free(sel); free(nsel); free(sel1);
    free(idx); free(want); free(rs);
}

static void test_indexer(void **state)
{
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_case(&cases[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_indexer),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
