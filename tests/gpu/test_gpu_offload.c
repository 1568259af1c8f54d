/* SPDX-License-Identifier: MIT */
/* GPU: routed experts in pinned host memory (expert_offload = on with a forced host share) give the
 * logits of the all-GPU step bit for bit, at batch 1 and 64, prefill and decode: the expert kernels
 * read the host bytes in place through the same table, so nothing in the arithmetic moves.
 *   - models/default-fp8 in fp8 numerics (FP4 experts on tensor cores) and exact numerics (FP4 FMA
 *     experts), half of each layer's experts on the host; tests/fixtures/tiny_a (F32 experts) with
 *     every expert on the host;
 *   - the placement reported in stats (experts and bytes on each side) is what the rule gives;
 *   - the routing counts of both backends are equal, sum to tokens x top-k per layer, and show that
 *     rows really were routed to host experts;
 *   - the counts written to a routing-statistics file and read back place the most routed experts on
 *     the GPU: same logits again, and no more routed pairs reach host memory than with the even
 *     placement on the same traffic;
 *   - host experts fetched ahead into device slots (a synthetic model whose experts run on the tensor-core
 *     kernels), predictions of one layer and of three: the same logits again through steps of 1, 4
 *     and 64 rows, and the expert kernels read from the slots;
 *   - expert_offload = off with a host share is refused. */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <unistd.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"
#include "tests/unit/st_writer.h"

#define MAX_CTX 256
#define BATCH 64                /* the largest decode bucket */
#define PROMPT_MIN 5
#define PROMPT_MAX 70           /* past one 64-row prefill chunk */
#define STEPS 3                 /* decode steps at batch 1, then at batch 64 */

struct traffic {
    int32_t *prompts[BATCH];
    int lens[BATCH];
    uint64_t tokens;            /* rows the model ran, all slots */
};

static void make_traffic(struct traffic *t, int V)
{
    t->tokens = 0;
    for (int s = 0; s < BATCH; s++) {
        t->lens[s] = PROMPT_MIN + (int)(gt_u64() % (PROMPT_MAX - PROMPT_MIN + 1));
        t->prompts[s] = malloc(sizeof(int32_t) * (size_t)t->lens[s]);
        assert_non_null(t->prompts[s]);
        for (int i = 0; i < t->lens[s]; i++)
            t->prompts[s][i] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
    }
}

static void free_traffic(struct traffic *t)
{
    for (int s = 0; s < BATCH; s++)
        free(t->prompts[s]);
}

static int argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

static void same_logits(const float *a, const float *b, size_t n, const char *what, int step)
{
    if (memcmp(a, b, sizeof(float) * n) != 0) {
        size_t i = 0;
        while (i < n && memcmp(&a[i], &b[i], sizeof(float)) == 0)
            i++;
        fail_msg("%s %d: logits differ first at value %zu: %.9g (all on the GPU) vs %.9g (offloaded)", what, step, i,
                 a[i], b[i]);
    }
}

/* The same traffic through both backends, fed the all-GPU backend's greedy tokens: slot 0 prompt (every
 * row's logits) and STEPS decode steps alone, then the other slots' prompts and STEPS steps of all 64. */
static void run_both(struct dsv4_backend *a, struct dsv4_backend *b, struct traffic *t, int V)
{
    float *la = malloc(sizeof(float) * (size_t)PROMPT_MAX * V), *lb = malloc(sizeof(float) * (size_t)PROMPT_MAX * V);
    int32_t tok[BATCH];
    int slots[BATCH];
    assert_non_null(la);
    assert_non_null(lb);

    DSV4_OK(a->ops->prefill(a, 0, t->prompts[0], t->lens[0], la, true));
    DSV4_OK(b->ops->prefill(b, 0, t->prompts[0], t->lens[0], lb, true));
    same_logits(la, lb, (size_t)t->lens[0] * V, "batch 1 prompt rows", t->lens[0]);
    tok[0] = (int32_t)argmax(la + (size_t)(t->lens[0] - 1) * V, V);
    slots[0] = 0;
    for (int s = 0; s < STEPS; s++) {
        DSV4_OK(a->ops->decode(a, 1, slots, tok, la));
        DSV4_OK(b->ops->decode(b, 1, slots, tok, lb));
        same_logits(la, lb, (size_t)V, "batch 1 decode step", s);
        tok[0] = (int32_t)argmax(la, V);
    }
    t->tokens = (uint64_t)t->lens[0] + STEPS;

    for (int i = 1; i < BATCH; i++) {
        DSV4_OK(a->ops->prefill(a, i, t->prompts[i], t->lens[i], la, false));
        DSV4_OK(b->ops->prefill(b, i, t->prompts[i], t->lens[i], lb, false));
        same_logits(la, lb, (size_t)V, "slot prompt", i);
        tok[i] = (int32_t)argmax(la, V);
        slots[i] = i;
        t->tokens += (uint64_t)t->lens[i];
    }
    free(la);
    free(lb);
    la = malloc(sizeof(float) * (size_t)BATCH * V);
    lb = malloc(sizeof(float) * (size_t)BATCH * V);
    assert_non_null(la);
    assert_non_null(lb);
    for (int s = 0; s < STEPS; s++) {
        DSV4_OK(a->ops->decode(a, BATCH, slots, tok, la));
        DSV4_OK(b->ops->decode(b, BATCH, slots, tok, lb));
        same_logits(la, lb, (size_t)BATCH * V, "batch 64 decode step", s);
        for (int i = 0; i < BATCH; i++)
            tok[i] = (int32_t)argmax(la + (size_t)i * V, V);
        t->tokens += BATCH;
    }
    free(la);
    free(lb);
}

/* Routed pairs that reached host memory, by the placement's rule for even placement: the lowest
 * E - ceil(E * share / 100) expert ids of every layer stay on the GPU. */
static uint64_t host_pairs_even(const uint64_t *counts, int L, int E, int share)
{
    const int gpu = E - (E * share + 99) / 100;
    uint64_t n = 0;
    for (int l = 0; l < L; l++)
        for (int e = gpu; e < E; e++)
            n += counts[(size_t)l * E + e];
    return n;
}

static void check_counts(const uint64_t *ca, const uint64_t *cb, const struct dsv4_config *c, uint64_t tokens)
{
    const int L = c->n_layers, E = c->n_experts;
    assert_memory_equal(ca, cb, sizeof(uint64_t) * (size_t)L * E);
    for (int l = 0; l < L; l++) {
        uint64_t sum = 0;
        for (int e = 0; e < E; e++)
            sum += ca[(size_t)l * E + e];
        if (sum != tokens * (uint64_t)c->n_experts_per_tok)
            fail_msg("layer %d: %llu routed pairs for %llu tokens x top-%d", l, (unsigned long long)sum,
                     (unsigned long long)tokens, c->n_experts_per_tok);
    }
}

static void load(const char *dir, struct dsv4_weights **w)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, dir);
    DSV4_OK(dsv4_weights_load(path, w));
}

/* The options of the backend with share % of each layer's experts forced into host memory (placed by
 * counts where given, else evenly). */
static struct dsv4_backend_opts host_opts(enum dsv4_numerics num, int share, const uint64_t *counts)
{
    const struct dsv4_backend_opts o = { .max_batch = BATCH, .max_context = MAX_CTX, .numerics = num,
                                         .expert_offload = DSV4_EXPERT_OFFLOAD_ON, .expert_host_share = share,
                                         .expert_counts = counts };
    return o;
}

/* The pair each test compares: *a with every expert on the GPU, *b as host_opts places them. */
static void boot_pair(const struct dsv4_weights *w, enum dsv4_numerics num, int share, const uint64_t *counts,
                      struct dsv4_backend **a, struct dsv4_backend **b)
{
    const struct dsv4_backend_opts oa = { .max_batch = BATCH, .max_context = MAX_CTX, .numerics = num,
                                          .expert_offload = DSV4_EXPERT_OFFLOAD_OFF };
    const struct dsv4_backend_opts ob = host_opts(num, share, counts);
    DSV4_OK(dsv4_backend_cuda_create(w, &oa, a));
    DSV4_OK(dsv4_backend_cuda_create(w, &ob, b));
}

static void check_offload(const char *dir, enum dsv4_numerics num, int share)
{
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *a = NULL, *b = NULL;
    struct dsv4_backend_stats sa, sb;
    struct traffic t;

    load(dir, &w);
    const struct dsv4_config *c = &w->cfg;
    const int L = c->n_layers, E = c->n_experts;
    boot_pair(w, num, share, NULL, &a, &b);
    a->ops->get_stats(a, &sa);
    b->ops->get_stats(b, &sb);
    const uint32_t want_host = (uint32_t)(L * ((E * share + 99) / 100));
    printf("# %s %s: %u experts on the GPU (%llu bytes), %u in host memory (%llu bytes)\n", dir,
           num == DSV4_NUMERICS_FP8 ? "fp8" : "exact", sb.experts_gpu, (unsigned long long)sb.expert_bytes_gpu,
           sb.experts_host, (unsigned long long)sb.expert_bytes_host);
    assert_int_equal(sa.experts_host, 0);
    assert_int_equal(sa.experts_gpu, (uint32_t)(L * E));
    assert_int_equal(sb.experts_host, want_host);
    assert_int_equal(sb.experts_gpu + sb.experts_host, (uint32_t)(L * E));
    assert_true(sb.expert_bytes_host > 0);
    assert_int_equal(sb.expert_bytes_gpu + sb.expert_bytes_host, sa.expert_bytes_gpu);
    /* with experts on the host the embedding goes there too (its rows are read from there below) */
    assert_int_equal(sa.embed_bytes_host, 0);
    assert_true(sb.embed_bytes_host >= (uint64_t)c->vocab_size * (uint64_t)c->dim);

    make_traffic(&t, c->vocab_size);
    run_both(a, b, &t, c->vocab_size);
    uint64_t *ca = calloc((size_t)L * E, sizeof(*ca)), *cb = calloc((size_t)L * E, sizeof(*cb));
    assert_non_null(ca);
    assert_non_null(cb);
    DSV4_OK(a->ops->routing_counts(a, ca));
    DSV4_OK(b->ops->routing_counts(b, cb));
    check_counts(ca, cb, c, t.tokens);
    const uint64_t host = host_pairs_even(cb, L, E, share);
    printf("# %s: %llu tokens, %llu of %llu routed pairs computed from host memory\n", dir,
           (unsigned long long)t.tokens, (unsigned long long)host,
           (unsigned long long)(t.tokens * (uint64_t)c->n_experts_per_tok * (uint64_t)L));
    assert_true(host > 0);

    dsv4_backend_destroy(a);
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    free_traffic(&t);
    free(ca);
    free(cb);
}

static void test_release_fp8(void **state)
{
    check_offload("models/default-fp8", DSV4_NUMERICS_FP8, 50);
}

static void test_release_exact(void **state)
{
    check_offload("models/default-fp8", DSV4_NUMERICS_EXACT, 50);
}

static void test_f32_all_host(void **state)
{
    check_offload("tests/fixtures/tiny_a", DSV4_NUMERICS_EXACT, 100);
}

/* Calibrate on one run's traffic, write the file, boot with it: the hot experts take the GPU. */
static void test_hot_placement(void **state)
{
    const int share = 50;
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *a = NULL, *b = NULL, *h = NULL;
    struct traffic t;
    char path[256];

    load("models/default-fp8", &w);
    const struct dsv4_config *c = &w->cfg;
    const int L = c->n_layers, E = c->n_experts;
    boot_pair(w, DSV4_NUMERICS_FP8, share, NULL, &a, &b);
    make_traffic(&t, c->vocab_size);
    run_both(a, b, &t, c->vocab_size);
    uint64_t *cal = calloc((size_t)L * E, sizeof(*cal)), *back = calloc((size_t)L * E, sizeof(*back));
    assert_non_null(cal);
    assert_non_null(back);
    DSV4_OK(b->ops->routing_counts(b, cal));
    dsv4_backend_destroy(b);

    snprintf(path, sizeof(path), "/tmp/dsv4-test-routing-%d.json", (int)getpid());
    DSV4_OK(dsv4_routing_stats_write(path, c->model_name, L, E, cal));
    DSV4_OK(dsv4_routing_stats_read(path, L, E, back));
    unlink(path);
    assert_memory_equal(cal, back, sizeof(uint64_t) * (size_t)L * E);

    struct dsv4_placement *p = NULL;
    uint64_t *eb = calloc((size_t)L, sizeof(*eb));
    assert_non_null(eb);
    for (int l = 0; l < L; l++)
        eb[l] = 1;
    struct dsv4_placement_req req = { .n_layers = L, .n_experts = E, .expert_bytes = eb, .gpu_budget = UINT64_MAX / 4,
                                      .mode = DSV4_EXPERT_OFFLOAD_ON, .host_percent = share, .counts = back };
    DSV4_OK(dsv4_placement_plan(&req, &p));
    uint64_t hot_host = 0;
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++)
            hot_host += dsv4_placement_on_host(p, l, e) ? cal[(size_t)l * E + e] : 0;
    const uint64_t even_host = host_pairs_even(cal, L, E, share);
    printf("# routed pairs from host memory on the calibration traffic: %llu with the hot placement, %llu even\n",
           (unsigned long long)hot_host, (unsigned long long)even_host);
    assert_true(hot_host <= even_host);
    dsv4_placement_free(p);

    /* the same traffic on a fresh pair: the all-GPU backend again, and one placed by the counts */
    dsv4_backend_destroy(a);
    boot_pair(w, DSV4_NUMERICS_FP8, share, back, &a, &h);
    struct dsv4_backend_stats sh;
    h->ops->get_stats(h, &sh);
    assert_int_equal(sh.experts_host, (uint32_t)(L * ((E * share + 99) / 100)));
    run_both(a, h, &t, c->vocab_size);

    dsv4_backend_destroy(a);
    dsv4_backend_destroy(h);
    dsv4_weights_free(w);
    free_traffic(&t);
    free(cal);
    free(back);
    free(eb);
}

/* A fresh directory (the caller frees its name and removes it with stw_rmdir) holding default-fp8's
 * config with experts twice as wide (moe_inter 256: a multiple of 128, so fp8 numerics run them on
 * the tensor-core kernels in k-tile blocks, which fetching ahead needs) and synthetic weights. */
static char *write_synthetic(void)
{
    char path[1024], cfg[8192];
    char *dir = stw_tempdir();
    assert_non_null(dir);
    snprintf(path, sizeof(path), "%s/models/default-fp8/config.json", DSV4_SRCDIR);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    const size_t n = fread(cfg, 1, sizeof(cfg) - 1, f);
    fclose(f);
    cfg[n] = 0;
    char *at = strstr(cfg, "\"moe_inter_dim\": 96,");
    assert_non_null(at);
    memcpy(at, "\"moe_inter_dim\":256,", strlen("\"moe_inter_dim\":256,"));
    assert_int_equal(stw_write_text(dir, "config.json", cfg), 0);
    assert_int_equal(stw_write_text(dir, "synthetic.json", "{\"seed\": 7}\n"), 0);
    return dir;
}

/* `steps` decode steps of slots 0 .. rows - 1 through both backends from random tokens on, then each
 * backend's greedy token: steps small enough to fetch ahead, and enough of them that slots are kept,
 * reassigned and found again. */
static void decode_rows_both(struct dsv4_backend *a, struct dsv4_backend *b, int V, int rows, int steps)
{
    float *la = malloc(sizeof(float) * (size_t)rows * V), *lb = malloc(sizeof(float) * (size_t)rows * V);
    int32_t tok[BATCH];
    int slots[BATCH];
    assert_non_null(la);
    assert_non_null(lb);
    for (int i = 0; i < rows; i++) {
        slots[i] = i;
        tok[i] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
    }
    for (int s = 0; s < steps; s++) {
        DSV4_OK(a->ops->decode(a, rows, slots, tok, la));
        DSV4_OK(b->ops->decode(b, rows, slots, tok, lb));
        same_logits(la, lb, (size_t)rows * V, rows == 1 ? "fetching decode step, 1 row" : "fetching decode step, 4 rows",
                    s);
        for (int i = 0; i < rows; i++)
            tok[i] = (int32_t)argmax(la + (size_t)i * V, V);
    }
    free(la);
    free(lb);
}

/* Host experts fetched ahead into device slots (kernels/expert_fetch.cu), each prediction covering one
 * layer (DSV4_CUDA_EXPERT_FETCH=1) and the default (the layer and the next two): the logits stay those
 * of the all-GPU step bit for bit, and the expert kernels really read from the slots (stats count the
 * bytes copied and the bytes read there); with DSV4_CUDA_EXPERT_FETCH=0 nothing is copied. */
static void test_fetch_ahead(void **state)
{
    const int share = 50;
    static const char *const ahead[] = { "1", NULL };      /* NULL: the default */
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *a = NULL, *b = NULL;
    const struct dsv4_backend_opts ob = host_opts(DSV4_NUMERICS_FP8, share, NULL);
    struct dsv4_backend_stats sa, sb;
    struct traffic t;

    char *dir = write_synthetic();
    DSV4_OK(dsv4_weights_load(dir, &w));
    const struct dsv4_config *c = &w->cfg;
    assert_int_equal(c->moe_inter, 256);
    for (size_t v = 0; v < sizeof(ahead) / sizeof(ahead[0]); v++) {
        if (ahead[v])
            setenv("DSV4_CUDA_EXPERT_FETCH", ahead[v], 1);
        boot_pair(w, DSV4_NUMERICS_FP8, share, NULL, &a, &b);
        unsetenv("DSV4_CUDA_EXPERT_FETCH");
        a->ops->get_stats(a, &sa);
        b->ops->get_stats(b, &sb);
        assert_false(sa.expert_fetch);
        assert_true(sb.expert_fetch);
        assert_true(sb.experts_host > 0);
        make_traffic(&t, c->vocab_size);
        run_both(a, b, &t, c->vocab_size);
        decode_rows_both(a, b, c->vocab_size, 1, 12);
        decode_rows_both(a, b, c->vocab_size, 4, 12);
        b->ops->get_stats(b, &sb);
        printf("# fetched ahead, DSV4_CUDA_EXPERT_FETCH=%s: %llu bytes copied into slots, %llu read from them\n",
               ahead[v] ? ahead[v] : "(default)", (unsigned long long)sb.expert_fetch_copied,
               (unsigned long long)sb.expert_fetch_used);
        assert_true(sb.expert_fetch_copied > 0);
        assert_true(sb.expert_fetch_used > 0);
        dsv4_backend_destroy(b);
        dsv4_backend_destroy(a);
        free_traffic(&t);
    }

    setenv("DSV4_CUDA_EXPERT_FETCH", "0", 1);
    DSV4_OK(dsv4_backend_cuda_create(w, &ob, &b));
    unsetenv("DSV4_CUDA_EXPERT_FETCH");
    b->ops->get_stats(b, &sb);
    assert_false(sb.expert_fetch);
    dsv4_backend_destroy(b);

    dsv4_weights_free(w);
    stw_rmdir(dir);
    free(dir);
}

static void test_off_with_share_refused(void **state)
{
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts o = { .max_batch = 4, .max_context = 64, .numerics = DSV4_NUMERICS_EXACT,
                                   .expert_offload = DSV4_EXPERT_OFFLOAD_OFF, .expert_host_share = 10 };
    load("tests/fixtures/tiny_a", &w);
    assert_int_equal(dsv4_backend_cuda_create(w, &o, &b), -EINVAL);
    assert_null(b);
    assert_non_null(strstr(dsv4_error_message(), "needs expert_offload = on"));
    dsv4_weights_free(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_release_fp8),
        cmocka_unit_test(test_release_exact),
        cmocka_unit_test(test_f32_all_host),
        cmocka_unit_test(test_hot_placement),
        cmocka_unit_test(test_fetch_ahead),
        cmocka_unit_test(test_off_with_share_refused),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
