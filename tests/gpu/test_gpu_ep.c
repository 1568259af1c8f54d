/* SPDX-License-Identifier: MIT */
/* GPU: the routed experts split across ranks (kernels/ep_backend.cu, doc/MULTIGPU.md), every rank on
 * this one device (the loopback: an ordinal listed once per rank), against the plain CUDA backend on
 * the same traffic (prompts with every row's logits, decode steps alone and of every slot):
 *   - bit for bit, fp8 and exact numerics: models/default-fp8 (top-2) over 1, 2 and 4 ranks,
 *     tests/fixtures/tiny_b (top-3, 6 experts) over 2 and 3 ranks: each pair's expert output comes
 *     from the rank holding the expert and the row's own rank combines them as one device does, so
 *     the rank count changes no bit;
 *   - a slot decoded alone on 2 ranks gives the logits it gets in a full batch, bit for bit;
 *   - the same with every launch eager (no graphs), 1 and 2 ranks, before the graphs are in play;
 *   - no device allocation and no capture after boot; slots dealt in groups;
 *   - the routing counts of all ranks add up to tokens x top-k a layer, as the plain backend's do. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"

#define MAX_CTX 256
#define BATCH 16
#define PROMPT_MIN 5
#define PROMPT_MAX 70
#define STEPS 3
static int argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* a (one device) and b (ranks) bit for bit, and no NaN */
static void compare(const float *a, const float *b, size_t n, const char *what, int step)
{
    for (size_t i = 0; i < n; i++) {
        assert_false(isnan(a[i]));
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
            fail_msg("%s %d: logits differ first at value %zu: %.9g (one device) vs %.9g (ranks)", what, step, i,
                     a[i], b[i]);
    }
}

struct traffic {
    int32_t *prompts[BATCH];
    int lens[BATCH];
    uint64_t tokens;
};

static void make_traffic(struct traffic *t, int V)
{
    for (int s = 0; s < BATCH; s++) {
        t->lens[s] = PROMPT_MIN + (int)(gt_u64() % (PROMPT_MAX - PROMPT_MIN + 1));
        t->prompts[s] = malloc(sizeof(int32_t) * (size_t)t->lens[s]);
        assert_non_null(t->prompts[s]);
        for (int i = 0; i < t->lens[s]; i++)
            t->prompts[s][i] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
    }
    t->tokens = 0;
}

static void free_traffic(struct traffic *t)
{
    for (int s = 0; s < BATCH; s++)
        free(t->prompts[s]);
}

/* The same traffic through a (one device) and b (ranks), fed a's greedy tokens and required to give
 * the same tokens: slot 0's prompt (every row's logits, in pieces of `piece` rows: a rank's largest
 * bucket, so that both cut it into the same chunks) and STEPS steps alone, then every slot's prompt
 * and STEPS steps of all BATCH. solo (may be NULL): a second backend of b's kind that runs only slot 0,
 * whose logits must be those slot 0 gets in b's full batch. */
static void run(struct dsv4_backend *a, struct dsv4_backend *b, struct dsv4_backend *solo, struct traffic *t, int V,
                int piece)
{
    float *la = malloc(sizeof(float) * (size_t)PROMPT_MAX * V), *lb = malloc(sizeof(float) * (size_t)PROMPT_MAX * V);
    float *ls = malloc(sizeof(float) * (size_t)V);
    int32_t tok[BATCH];
    int slots[BATCH];
    assert_true(la && lb && ls);

    for (int i0 = 0; i0 < t->lens[0]; i0 += piece) {
        const int m = t->lens[0] - i0 < piece ? t->lens[0] - i0 : piece;
        DSV4_OK(a->ops->prefill(a, 0, t->prompts[0] + i0, m, la + (size_t)i0 * V, true));
        DSV4_OK(b->ops->prefill(b, 0, t->prompts[0] + i0, m, lb + (size_t)i0 * V, true));
    }
    compare(la, lb, (size_t)t->lens[0] * V, "batch 1 prompt rows", t->lens[0]);
    if (solo) {
        DSV4_OK(solo->ops->prefill(solo, 0, t->prompts[0], t->lens[0], ls, false));
        compare(lb + (size_t)(t->lens[0] - 1) * V, ls, (size_t)V, "slot 0 alone, prompt", 0);
    }
    tok[0] = (int32_t)argmax(la + (size_t)(t->lens[0] - 1) * V, V);
    assert_int_equal(tok[0], argmax(lb + (size_t)(t->lens[0] - 1) * V, V));
    slots[0] = 0;
    for (int s = 0; s < STEPS; s++) {
        DSV4_OK(a->ops->decode(a, 1, slots, tok, la));
        DSV4_OK(b->ops->decode(b, 1, slots, tok, lb));
        compare(la, lb, (size_t)V, "batch 1 decode step", s);
        if (solo) {
            DSV4_OK(solo->ops->decode(solo, 1, slots, tok, ls));
            compare(lb, ls, (size_t)V, "slot 0 alone, step", s);
        }
        tok[0] = (int32_t)argmax(la, V);
        assert_int_equal(tok[0], argmax(lb, V));
    }
    t->tokens = (uint64_t)t->lens[0] + STEPS;
    for (int i = 1; i < BATCH; i++) {
        DSV4_OK(a->ops->prefill(a, i, t->prompts[i], t->lens[i], la, false));
        DSV4_OK(b->ops->prefill(b, i, t->prompts[i], t->lens[i], lb, false));
        compare(la, lb, (size_t)V, "slot prompt", i);
        tok[i] = (int32_t)argmax(la, V);
        assert_int_equal(tok[i], argmax(lb, V));
        slots[i] = i;
        t->tokens += (uint64_t)t->lens[i];
    }
    free(la);
    free(lb);
    la = malloc(sizeof(float) * (size_t)BATCH * V);
    lb = malloc(sizeof(float) * (size_t)BATCH * V);
    assert_true(la && lb);
    for (int s = 0; s < STEPS; s++) {
        DSV4_OK(a->ops->decode(a, BATCH, slots, tok, la));
        DSV4_OK(b->ops->decode(b, BATCH, slots, tok, lb));
        compare(la, lb, (size_t)BATCH * V, "full batch decode step", s);
        if (solo) {     /* slot 0 alone takes the 1-row bucket, its row on rank 0 beside padding rows */
            DSV4_OK(solo->ops->decode(solo, 1, slots, tok, ls));
            compare(lb, ls, (size_t)V, "slot 0 alone beside a full batch, step", s);
        }
        for (int i = 0; i < BATCH; i++) {
            tok[i] = (int32_t)argmax(la + (size_t)i * V, V);
            assert_int_equal(tok[i], argmax(lb + (size_t)i * V, V));
        }
        t->tokens += BATCH;
    }
    free(la);
    free(lb);
    free(ls);
}

static void check_counts(struct dsv4_backend *a, struct dsv4_backend *b, const struct dsv4_config *c, uint64_t tokens)
{
    const int L = c->n_layers, E = c->n_experts;
    uint64_t *ca = calloc((size_t)L * E, sizeof(*ca)), *cb = calloc((size_t)L * E, sizeof(*cb));
    assert_true(ca && cb);
    DSV4_OK(a->ops->routing_counts(a, ca));
    DSV4_OK(b->ops->routing_counts(b, cb));
    for (int l = 0; l < L; l++) {
        uint64_t sa = 0, sb = 0;
        for (int e = 0; e < E; e++) {
            sa += ca[(size_t)l * E + e];
            sb += cb[(size_t)l * E + e];
        }
        assert_int_equal(sa, tokens * (uint64_t)c->n_experts_per_tok);
        assert_int_equal(sb, sa);
    }
    free(ca);
    free(cb);
}

static void check_ranks(const char *dir, enum dsv4_numerics num, int ranks, bool solo_check)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *a = NULL, *b = NULL, *solo = NULL;
    struct dsv4_backend_stats sa, s0, s1;
    struct traffic t;

    snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, dir);
    DSV4_OK(dsv4_weights_load(path, &w));
    const struct dsv4_config *c = &w->cfg;
    struct dsv4_backend_opts o = { .max_batch = BATCH, .max_context = MAX_CTX, .numerics = num };
    DSV4_OK(dsv4_backend_cuda_create(w, &o, &a));
    o.n_gpus = ranks;       /* every rank on device 0 */
    DSV4_OK(dsv4_cuda_ep_backend_create(w, &o, &b));
    if (solo_check)
        DSV4_OK(dsv4_cuda_ep_backend_create(w, &o, &solo));
    assert_int_equal(b->slot_groups, ranks);
    b->ops->get_stats(b, &s0);
    printf("# %s %s over %d ranks: %s\n", dir, num == DSV4_NUMERICS_FP8 ? "fp8" : "exact", ranks, s0.variant);
    assert_int_equal(s0.device_allocs, (uint64_t)ranks);     /* one arena a rank */
    const char *graphs = getenv("DSV4_CUDA_GRAPHS");
    assert_int_equal(s0.graph_captures > 0, !graphs || strcmp(graphs, "0") != 0);
    a->ops->get_stats(a, &sa);
    assert_int_equal(s0.experts_gpu, sa.experts_gpu);      /* each expert on one rank */
    assert_int_equal(s0.expert_bytes_gpu, sa.expert_bytes_gpu);

    make_traffic(&t, c->vocab_size);
    run(a, b, solo, &t, c->vocab_size, (BATCH + ranks - 1) / ranks);
    check_counts(a, b, c, t.tokens);
    b->ops->get_stats(b, &s1);
    assert_int_equal(s1.device_allocs, s0.device_allocs);
    assert_int_equal(s1.graph_captures, s0.graph_captures);
    printf("# %s over %d ranks: %llu tokens, %llu steps launched eagerly\n", dir, ranks,
           (unsigned long long)t.tokens, (unsigned long long)s1.eager_steps);

    dsv4_backend_destroy(a);
    dsv4_backend_destroy(b);
    dsv4_backend_destroy(solo);
    dsv4_weights_free(w);
    free_traffic(&t);
}

/* Both backends launching eagerly (no graphs): the lockstep's launches and exchange alone, before the
 * capture of every rank's streams into one graph is in play. */
static void test_two_ranks_eager(void **state)
{
    setenv("DSV4_CUDA_GRAPHS", "0", 1);
    check_ranks("models/default-fp8", DSV4_NUMERICS_FP8, 1, false);
    check_ranks("models/default-fp8", DSV4_NUMERICS_FP8, 2, false);
    unsetenv("DSV4_CUDA_GRAPHS");
}

static void test_one_rank_fp8(void **state)
{
    check_ranks("models/default-fp8", DSV4_NUMERICS_FP8, 1, false);
}

static void test_one_rank_exact(void **state)
{
    check_ranks("models/default-fp8", DSV4_NUMERICS_EXACT, 1, false);
}

static void test_top2_ranks(void **state)
{
    check_ranks("models/default-fp8", DSV4_NUMERICS_FP8, 2, true);
    check_ranks("models/default-fp8", DSV4_NUMERICS_FP8, 4, false);
}

static void test_top3_ranks(void **state)
{
    check_ranks("tests/fixtures/tiny_b", DSV4_NUMERICS_EXACT, 2, true);
    check_ranks("tests/fixtures/tiny_b", DSV4_NUMERICS_EXACT, 3, false);
}

static void test_refused(void **state)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, "tests/fixtures/tiny_b");
    DSV4_OK(dsv4_weights_load(path, &w));
    struct dsv4_backend_opts o = { .max_batch = 4, .max_context = MAX_CTX, .numerics = DSV4_NUMERICS_EXACT,
                                   .n_gpus = 7 };     /* more ranks than the layer's 6 experts */
    assert_int_equal(dsv4_cuda_ep_backend_create(w, &o, &b), -EINVAL);
    o.n_gpus = 5;                                     /* more ranks than max_batch's slots */
    assert_int_equal(dsv4_cuda_ep_backend_create(w, &o, &b), -EINVAL);
    o.n_gpus = 2;
    o.gpus[1] = 4096;                                 /* no such device */
    assert_int_equal(dsv4_cuda_ep_backend_create(w, &o, &b), -ENODEV);
    assert_null(b);
    dsv4_weights_free(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_ranks_eager),
        cmocka_unit_test(test_one_rank_fp8),
        cmocka_unit_test(test_one_rank_exact),
        cmocka_unit_test(test_top2_ranks),
        cmocka_unit_test(test_top3_ranks),
        cmocka_unit_test(test_refused),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
