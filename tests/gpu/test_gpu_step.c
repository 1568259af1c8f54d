/* SPDX-License-Identifier: MIT */
/* GPU: the whole decode step against the CPU reference backend on the committed fixtures
 * (tests/fixtures/tiny_*, F32 weights) and on the release-format default model (models/default-fp8:
 * FP8 linears on tensor cores, FP4 experts, BF16 head), in both numerics: the prompt (GPU prefill in
 * chunks of max_batch positions, 4 and 64), then 16 greedy steps, each backend fed its own argmax.
 *   - both numerics (fp8: the official KV layout, RoPE values bf16, as the CPU reference rounds them):
 *     greedy tokens identical over the 16 steps and every logits row within the bound,
 *     max |gpu - cpu| / max |cpu| (exact 1e-4: f32 summation order only, the GPU sums dots in f32 where
 *     the CPU uses double; fp8 1e-3: the same, where a value at an FP8/FP4 rounding boundary may
 *     round the other way). One exception: the trained default models (models/default, and its
 *     release-format copy models/default-fp8) in fp8 numerics on a random prompt are chaotic. The
 *     CPU reference against itself with rms_norm_eps moved by 1e-9 or 1e-8 (its exact-numerics
 *     logits then move by about 1e-6) moves their fp8 logits by up to 0.11 (default) and 0.15
 *     (default-fp8) over 166 rows, with FP4 index selection on or off: one e4m3 activation rounding
 *     the other way grows through the layers and positions. No implementation that sums in another
 *     order can stay within 1e-3 there, so those cases print their error beside that probe's and
 *     hold the rows computed from the same tokens to 0.5 (seen: up to 0.34); where the greedy paths
 *     part (a near tie of the CPU's two best logits, which chaos can flip) the steps after it are
 *     not compared (every row must still be finite). default-fp8 in exact numerics (FP8 weights,
 *     FP4 experts) keeps the 1e-4 bound and the greedy tokens;
 *   - rows of a batch bit-identical to the same rows decoded alone (batch invariance), and a prompt
 *     prefilled in chunks bit-identical to the same prompt decoded one token at a time;
 *   - graph replay bit-identical to eager launches (DSV4_CUDA_GRAPHS=0);
 *   - 1000 short requests served with the device allocation and capture counters flat and the
 *     device's free memory unchanged. */
#include "build-config.h"

#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "tests/gpu/gpu_test.h"

#define EXACT_BOUND 1e-4
#define FP8_BOUND 1e-3
#define DECODE_STEPS 16
#define MAX_CTX 512
#define BATCH 4
#define REQUESTS 1000
#define PROBE_EPS 1e-9       /* the chaos probe's change to rms_norm_eps */
#define CHAOS_CEILING 0.5    /* chaotic cases: the largest row error before greedy paths part (seen: 0.34) */

static const char *const fixtures[] = { "tiny_a", "tiny_b", "tiny_c" };

struct prompt {
    int32_t *tokens;
    int n;
};

static void load_prompt(const char *dir, int which, struct prompt *p)
{
    char path[1024];
    json_error_t err;
    snprintf(path, sizeof(path), "%s/tests/fixtures/%s/cases.json", DSV4_SRCDIR, dir);
    json_t *root = json_load_file(path, 0, &err), *c, *toks;
    if (!root)
        fail_msg("%s: %s", path, err.text);
    c = json_array_get(root, (size_t)which);
    toks = json_object_get(c, "tokens");
    assert_non_null(toks);
    p->n = (int)json_array_size(toks);
    p->tokens = malloc(sizeof(int32_t) * (size_t)p->n);
    for (int i = 0; i < p->n; i++)
        p->tokens[i] = (int32_t)json_integer_value(json_array_get(toks, (size_t)i));
    json_decref(root);
}

static int argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

static double row_err(const float *g, const float *c, int V)
{
    double num = 0.0, den = 0.0;
    for (int i = 0; i < V; i++) {
        if (!isfinite(g[i]))
            return INFINITY;
        num = fmax(num, fabs((double)g[i] - c[i]));
        den = fmax(den, fabs((double)c[i]));
    }
    return num / den;
}

/* Prompt then DECODE_STEPS greedy steps on `slot`: logits [P + steps, V], greedy [steps]. */
static void run_sequence(struct dsv4_backend *b, int slot, const struct prompt *p, int V, float *logits, int32_t *greedy)
{
    DSV4_OK(b->ops->prefill(b, slot, p->tokens, p->n, logits, true));
    for (int s = 0; s < DECODE_STEPS; s++) {
        int32_t tok = (int32_t)argmax(logits + (size_t)(p->n - 1 + s) * V, V);
        greedy[s] = tok;
        DSV4_OK(b->ops->decode(b, 1, &slot, &tok, logits + (size_t)(p->n + s) * V));
    }
}

/* A prompt of n random tokens (the default model has no fixture cases). */
static void random_prompt(int V, int n, struct prompt *p)
{
    p->n = n;
    p->tokens = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        p->tokens[i] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
}

/* dir: a fixture name (tests/fixtures/DIR, prompt from its cases) or a path under the source tree
 * (models/..., a random prompt of RANDOM_PROMPT tokens). */
#define RANDOM_PROMPT 150
/* Largest row error of a [rows, V] against c. */
static double worst_err(const float *g, const float *c, int rows, int V)
{
    double worst = 0.0;
    for (int r = 0; r < rows; r++) {
        double e = row_err(g + (size_t)r * V, c + (size_t)r * V, V);
        if (!(e <= worst))
            worst = e;
    }
    return worst;
}

/* The CPU's lead of its best logit over the second best in row c, relative to max |c|: how far apart
 * the two backends' rows must move for their argmax to differ. */
static double top2_gap(const float *c, int V)
{
    const int best = argmax(c, V);
    double second = -INFINITY, den = 0.0;
    for (int i = 0; i < V; i++) {
        den = fmax(den, fabs((double)c[i]));
        if (i != best)
            second = fmax(second, (double)c[i]);
    }
    return ((double)c[best] - second) / den;
}

/* Chaotic cases: the rows computed on the same tokens (all of them while the greedy paths agree,
 * else up to the row the first differing step picks from) within CHAOS_CEILING (an implementation
 * fault moves rows by ~1 or more). A differing step is no further evidence: two argmaxes can part
 * only where the CPU's top-two gap is at most twice the row's error, which the ceiling bounds; it
 * is printed with that gap. Later steps continue from different tokens and are not compared. */
static void check_chaotic_greedy(const char *what, const struct prompt *p, const float *lg, const float *lc,
                                 const int32_t *gg, const int32_t *gc, int V)
{
    int s = 0;
    while (s < DECODE_STEPS && gg[s] == gc[s])
        s++;
    const int last = p->n - 1 + s;      /* the last row both computed from the same tokens */
    const double same_ctx = worst_err(lg, lc, last + 1, V);
    printf("# %s: greedy paths %s; rows 0..%d (the same tokens) worst error %.3g (ceiling %.2g)\n", what,
           s < DECODE_STEPS ? "part" : "agree over every step", last, same_ctx, CHAOS_CEILING);
    if (s < DECODE_STEPS) {
        const size_t r = (size_t)last;
        printf("# %s: step %d picks %d on the GPU, %d on the CPU, whose top-two gap there is %.3g (row error "
               "%.3g)\n", what, s, gg[s], gc[s], top2_gap(lc + r * V, V), row_err(lg + r * V, lc + r * V, V));
    }
    if (!(same_ctx <= CHAOS_CEILING))
        fail_msg("%s: rows computed from the same tokens differ by %g (ceiling %g)", what, same_ctx, CHAOS_CEILING);
}

/* The chaos probe: the CPU reference against itself with rms_norm_eps moved by PROBE_EPS. */
static double cpu_probe(const char *path, const struct dsv4_backend_opts *opts, const struct prompt *p,
                        const float *ref, int V)
{
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *cpu = NULL;
    int32_t g[DECODE_STEPS];
    const int rows = p->n + DECODE_STEPS;
    float *l = malloc(sizeof(float) * (size_t)rows * V);
    DSV4_OK(dsv4_weights_load(path, &w));
    w->cfg.rms_norm_eps += PROBE_EPS;
    DSV4_OK(dsv4_backend_cpu_create(w, opts, &cpu));
    run_sequence(cpu, 0, p, V, l, g);
    const double worst = worst_err(l, ref, rows, V);
    dsv4_backend_destroy(cpu);
    dsv4_weights_free(w);
    free(l);
    return worst;
}

/* chaotic: assert the greedy tokens only, and print the logits error beside the chaos probe's. */
static void check_model(const char *dir, enum dsv4_numerics num, int max_batch, bool chaotic)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *cpu = NULL, *gpu = NULL;
    struct dsv4_backend_opts opts = { .max_batch = max_batch, .max_context = MAX_CTX, .numerics = num, .threads = 1 };
    struct prompt p;
    const double bound = num == DSV4_NUMERICS_EXACT ? EXACT_BOUND : FP8_BOUND;
    const char *nname = num == DSV4_NUMERICS_EXACT ? "exact" : "fp8";
    const bool fixture = strchr(dir, '/') == NULL;

    if (fixture)
        snprintf(path, sizeof(path), "%s/tests/fixtures/%s", DSV4_SRCDIR, dir);
    else
        snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, dir);
    DSV4_OK(dsv4_weights_load(path, &w));
    DSV4_OK(dsv4_backend_cpu_create(w, &opts, &cpu));
    DSV4_OK(dsv4_backend_cuda_create(w, &opts, &gpu));
    if (fixture)
        load_prompt(dir, 0, &p);
    else
        random_prompt(w->cfg.vocab_size, RANDOM_PROMPT, &p);
    printf("# %s %s, max_batch %d (prefill chunks of %d):\n", dir, nname, max_batch, max_batch);
    const int V = w->cfg.vocab_size, rows = p.n + DECODE_STEPS;
    float *lc = malloc(sizeof(float) * (size_t)rows * V), *lg = malloc(sizeof(float) * (size_t)rows * V);
    int32_t gc[DECODE_STEPS], gg[DECODE_STEPS];

    run_sequence(cpu, 0, &p, V, lc, gc);
    run_sequence(gpu, 0, &p, V, lg, gg);
    double worst = 0.0, prompt_worst = 0.0;
    int worst_row = 0, same = 0, over = 0, first_over = -1;
    for (int r = 0; r < rows; r++) {
        double e = row_err(lg + (size_t)r * V, lc + (size_t)r * V, V);
        if (!(e <= worst))
            worst = e, worst_row = r;
        if (r < p.n && !(e <= prompt_worst))
            prompt_worst = e;
        if (!(e <= bound)) {
            over++;
            if (first_over < 0)
                first_over = r;
        }
    }
    printf("# %s %s: %d of %d rows over %.0e, the first at row %d\n", dir, nname, over, rows, bound, first_over);
    for (int s = 0; s < DECODE_STEPS; s++)
        same += gc[s] == gg[s];
    printf("# %s %s: %d prompt + %d greedy rows, worst row error %.3g (row %d; prompt rows %.3g), bound %.0e, "
           "greedy %d/%d identical\n", dir, nname, p.n, DECODE_STEPS, worst, worst_row, prompt_worst, bound, same,
           DECODE_STEPS);
    if (chaotic) {
        const double probe = cpu_probe(path, &opts, &p, lc, V);
        printf("# %s %s: the CPU reference against itself with rms_norm_eps + %.0e: worst row error %.3g "
               "(chaotic: the GPU's %.3g is reported, not bounded)\n", dir, nname, PROBE_EPS, probe, worst);
        char what[256];
        snprintf(what, sizeof(what), "%s %s", dir, nname);
        assert_true(isfinite(worst));       /* every row, the ones after the paths part too */
        check_chaotic_greedy(what, &p, lg, lc, gg, gc, V);
    } else {
        if (!(worst <= bound))
            fail_msg("%s %s: logits row %d differs by %g (bound %g)", dir, nname, worst_row, worst, bound);
        assert_int_equal(same, DECODE_STEPS);
    }

    dsv4_backend_destroy(gpu);
    dsv4_backend_destroy(cpu);
    dsv4_weights_free(w);
    free(lc);
    free(lg);
    free(p.tokens);
}

static void test_fixtures_exact(void **state)
{
    for (size_t i = 0; i < sizeof(fixtures) / sizeof(fixtures[0]); i++) {
        check_model(fixtures[i], DSV4_NUMERICS_EXACT, BATCH, false);
        check_model(fixtures[i], DSV4_NUMERICS_EXACT, DSV4_CUDA_MAX_BATCH, false);
    }
}

static void test_fixtures_fp8(void **state)
{
    for (size_t i = 0; i < sizeof(fixtures) / sizeof(fixtures[0]); i++) {
        check_model(fixtures[i], DSV4_NUMERICS_FP8, BATCH, false);
        check_model(fixtures[i], DSV4_NUMERICS_FP8, DSV4_CUDA_MAX_BATCH, false);
    }
}

static void test_release_model_exact(void **state)
{
    check_model("models/default-fp8", DSV4_NUMERICS_EXACT, BATCH, false);
}

static void test_release_model_fp8(void **state)
{
    check_model("models/default-fp8", DSV4_NUMERICS_FP8, DSV4_CUDA_MAX_BATCH, true);
}

static void test_bf16_model_fp8(void **state)
{
    check_model("models/default", DSV4_NUMERICS_FP8, DSV4_CUDA_MAX_BATCH, true);
}

/* A prompt prefilled in chunks (max_batch 64: one chunk spans several windows and compressed
 * blocks) against the same tokens decoded one at a time: every logits row bit-identical. */
static void test_prefill_chunks_vs_tokens(void **state)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts opts = { .max_batch = DSV4_CUDA_MAX_BATCH, .max_context = MAX_CTX,
                                      .numerics = DSV4_NUMERICS_FP8 };
    const char *models[] = { "tests/fixtures/tiny_a", "tests/fixtures/tiny_c", "models/default-fp8" };

    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        struct prompt p;
        snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, models[m]);
        DSV4_OK(dsv4_weights_load(path, &w));
        DSV4_OK(dsv4_backend_cuda_create(w, &opts, &b));
        const int V = w->cfg.vocab_size, n = 200;
        random_prompt(V, n, &p);
        float *a = malloc(sizeof(float) * (size_t)n * V), *t = malloc(sizeof(float) * (size_t)n * V);
        int slot = 1;
        DSV4_OK(b->ops->prefill(b, 0, p.tokens, n, a, true));
        for (int i = 0; i < n; i++)
            DSV4_OK(b->ops->decode(b, 1, &slot, &p.tokens[i], t + (size_t)i * V));
        size_t rows_differ = 0;
        for (int i = 0; i < n; i++)
            rows_differ += memcmp(a + (size_t)i * V, t + (size_t)i * V, sizeof(float) * V) != 0;
        printf("# %s: %d-token prompt in chunks of %d vs one token at a time: %zu rows differ\n", models[m], n,
               opts.max_batch, rows_differ);
        assert_int_equal(rows_differ, 0);
        dsv4_backend_destroy(b);
        dsv4_weights_free(w);
        free(a);
        free(t);
        free(p.tokens);
    }
}

/* A prompt longer than the largest bucket (max_batch 64) in one prefill step of its own length
 * (launched eagerly, logits for its last row only) against the same prompt in calls of 64 tokens
 * (each one bucket graph): the last row's logits, the device-sampled first token and DECODE_STEPS
 * decode steps after it all bit-identical. The GEMMs fold their K splits as the decode path's
 * reduction does, attention runs the chunk's rows whole in one launch (their window keys from
 * this step read from the chunk's own entries, the ring written after) and the indexer in 64-row
 * slices, the experts group the chunk's rows by expert: the same arithmetic for every row; the
 * decode steps after it read the ring the chunk left. */
static void test_long_chunks(void **state)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts opts = { .max_batch = DSV4_CUDA_MAX_BATCH, .max_context = 1024,
                                      .numerics = DSV4_NUMERICS_FP8, .prefill_chunk = 700 };
    const char *models[] = { "tests/fixtures/tiny_a", "tests/fixtures/tiny_c", "models/default-fp8" };

    (void)state;
    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        struct prompt p;
        struct dsv4_backend_stats st0, st1;
        snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, models[m]);
        DSV4_OK(dsv4_weights_load(path, &w));
        DSV4_OK(dsv4_backend_cuda_create(w, &opts, &b));
        const int V = w->cfg.vocab_size, n = 650;
        random_prompt(V, n, &p);
        float *a = malloc(sizeof(float) * V), *t = malloc(sizeof(float) * V);
        b->ops->get_stats(b, &st0);
        DSV4_OK(b->ops->prefill(b, 0, p.tokens, n, a, false));      /* one 650-row step */
        b->ops->get_stats(b, &st1);
        assert_int_equal(st1.eager_steps, st0.eager_steps + 1);
        for (int i0 = 0; i0 < n; i0 += DSV4_CUDA_MAX_BATCH) {      /* eleven bucket steps */
            const int k = n - i0 < DSV4_CUDA_MAX_BATCH ? n - i0 : DSV4_CUDA_MAX_BATCH;
            DSV4_OK(b->ops->prefill(b, 1, p.tokens + i0, k, i0 + k == n ? t : NULL, false));
        }
        b->ops->get_stats(b, &st0);
        assert_int_equal(st0.eager_steps, st1.eager_steps);
        assert_memory_equal(a, t, sizeof(float) * V);
        /* device sampling reads the eager step's last row */
        DSV4_OK(b->ops->prefill(b, 2, p.tokens, n, NULL, false));
        struct dsv4_sampling sp;
        dsv4_sampling_defaults(&sp);
        sp.temperature = 0.0f;
        struct dsv4_backend_sample_req rq = { .slot = 2, .params = &sp, .seed = 1, .index = 0 };
        struct dsv4_sample smp;
        int rc1 = 0;
        char msg[DSV4_BACKEND_MSG_MAX];
        DSV4_OK(b->ops->sample(b, 1, &rq, &smp, &rc1, msg));
        assert_int_equal(rc1, 0);
        assert_int_equal(smp.token, argmax(a, V));
        int slots[2] = { 0, 1 };
        size_t differ = 0;
        float *two = malloc(sizeof(float) * 2 * V);
        for (int step = 0; step < DECODE_STEPS; step++) {
            int32_t tk[2];
            tk[0] = tk[1] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
            DSV4_OK(b->ops->decode(b, 2, slots, tk, two));
            differ += memcmp(two, two + V, sizeof(float) * V) != 0;
        }
        printf("# %s: %d-token prompt in one eager step vs 64-token graph steps: last row bit-identical, greedy "
               "first token %d, %zu of %d later decode steps differ\n", models[m], n, smp.token, differ,
               DECODE_STEPS);
        assert_int_equal(differ, 0);
        dsv4_backend_destroy(b);
        dsv4_weights_free(w);
        free(two);
        free(a);
        free(t);
        free(p.tokens);
    }
}

/* BATCH slots each with their own prompt (different lengths), decoded together; then the same
 * rows one at a time on a second backend: bit-identical. Also graphs against eager. */
static void test_batch_and_graphs(void **state)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *together = NULL, *alone = NULL, *eager = NULL;
    struct dsv4_backend_opts opts = { .max_batch = BATCH, .max_context = MAX_CTX, .numerics = DSV4_NUMERICS_FP8 };
    struct prompt p;
    int slots[BATCH];
    int32_t toks[BATCH];

    snprintf(path, sizeof(path), "%s/tests/fixtures/tiny_a", DSV4_SRCDIR);
    DSV4_OK(dsv4_weights_load(path, &w));
    DSV4_OK(dsv4_backend_cuda_create(w, &opts, &together));
    DSV4_OK(dsv4_backend_cuda_create(w, &opts, &alone));
    setenv("DSV4_CUDA_GRAPHS", "0", 1);
    DSV4_OK(dsv4_backend_cuda_create(w, &opts, &eager));
    unsetenv("DSV4_CUDA_GRAPHS");
    load_prompt("tiny_a", 0, &p);
    const int V = w->cfg.vocab_size;
    float *a = malloc(sizeof(float) * BATCH * V), *b = malloc(sizeof(float) * BATCH * V);
    float *e = malloc(sizeof(float) * BATCH * V);

    for (int s = 0; s < BATCH; s++) {
        const int n = 20 + 9 * s;       /* crosses compressed-block and window boundaries differently */
        slots[s] = s;
        DSV4_OK(together->ops->prefill(together, s, p.tokens, n, NULL, false));
        DSV4_OK(alone->ops->prefill(alone, s, p.tokens, n, NULL, false));
        DSV4_OK(eager->ops->prefill(eager, s, p.tokens, n, NULL, false));
    }
    size_t diff_alone = 0, diff_eager = 0;
    for (int step = 0; step < DECODE_STEPS; step++) {
        for (int s = 0; s < BATCH; s++)
            toks[s] = (int32_t)(2 + (gt_u64() % (uint64_t)(V - 2)));
        DSV4_OK(together->ops->decode(together, BATCH, slots, toks, a));
        DSV4_OK(eager->ops->decode(eager, BATCH, slots, toks, e));
        for (int s = 0; s < BATCH; s++)
            DSV4_OK(alone->ops->decode(alone, 1, &slots[s], &toks[s], b + (size_t)s * V));
        diff_alone += memcmp(a, b, sizeof(float) * BATCH * V) != 0;
        diff_eager += memcmp(a, e, sizeof(float) * BATCH * V) != 0;
    }
    printf("# batch of %d vs one row at a time: %zu of %d steps differ; graphs vs eager: %zu differ\n", BATCH,
           diff_alone, DECODE_STEPS, diff_eager);
    assert_int_equal(diff_alone, 0);
    assert_int_equal(diff_eager, 0);
    dsv4_backend_destroy(together);
    dsv4_backend_destroy(alone);
    dsv4_backend_destroy(eager);
    dsv4_weights_free(w);
    free(a);
    free(b);
    free(e);
    free(p.tokens);
}

/* REQUESTS short requests (reset, 3-token prompt, 3 decode steps) over rotating slots and batch sizes. */
static void test_no_allocation_after_ready(void **state)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts opts = { .max_batch = BATCH, .max_context = MAX_CTX, .numerics = DSV4_NUMERICS_FP8 };
    struct dsv4_backend_stats st0, st1;
    size_t free0, free1, total;

    snprintf(path, sizeof(path), "%s/tests/fixtures/tiny_b", DSV4_SRCDIR);
    DSV4_OK(dsv4_weights_load(path, &w));
    DSV4_OK(dsv4_backend_cuda_create(w, &opts, &b));
    b->ops->get_stats(b, &st0);
    CUDA_OK(cudaMemGetInfo(&free0, &total));
    const int V = w->cfg.vocab_size;
    float *logits = malloc(sizeof(float) * BATCH * V);
    for (int r = 0; r < REQUESTS; r += BATCH) {
        int slots[BATCH], n = 1 + r / BATCH % BATCH;
        int32_t prompt[3], toks[BATCH];
        for (int s = 0; s < n; s++) {
            slots[s] = s;
            b->ops->slot_reset(b, s);
            for (int i = 0; i < 3; i++)
                prompt[i] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
            DSV4_OK(b->ops->prefill(b, s, prompt, 3, logits, false));
        }
        for (int step = 0; step < 3; step++) {
            for (int s = 0; s < n; s++)
                toks[s] = (int32_t)(2 + gt_u64() % (uint64_t)(V - 2));
            DSV4_OK(b->ops->decode(b, n, slots, toks, logits));
        }
    }
    b->ops->get_stats(b, &st1);
    CUDA_OK(cudaMemGetInfo(&free1, &total));
    printf("# %d requests: device allocations %llu -> %llu, graph captures %llu -> %llu, free device memory "
           "%zu -> %zu; %s\n", REQUESTS, (unsigned long long)st0.device_allocs, (unsigned long long)st1.device_allocs,
           (unsigned long long)st0.graph_captures, (unsigned long long)st1.graph_captures, free0, free1, st1.variant);
    assert_int_equal(st0.device_allocs, 1);
    assert_int_equal(st1.device_allocs, st0.device_allocs);
    assert_int_equal(st1.graph_captures, st0.graph_captures);
    assert_true(st0.graph_captures >= 1);
    assert_int_equal(free1, free0);
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    free(logits);
}

/* One batched step from create to destroy: the compute-sanitizer target (DSV4_TEST_FILTER=test_one_step). */
static void test_one_step(void **state)
{
    char path[1024];
    struct dsv4_weights *w = NULL;
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts opts = { .max_batch = 2, .max_context = 64, .numerics = DSV4_NUMERICS_FP8 };
    int slots[2] = { 0, 1 };
    int32_t prompt[6] = { 0, 17, 33, 5, 250, 9 }, toks[2] = { 44, 45 };

    snprintf(path, sizeof(path), "%s/tests/fixtures/tiny_a", DSV4_SRCDIR);
    DSV4_OK(dsv4_weights_load(path, &w));
    DSV4_OK(dsv4_backend_cuda_create(w, &opts, &b));
    const int V = w->cfg.vocab_size;
    float *logits = malloc(sizeof(float) * 2 * V);
    DSV4_OK(b->ops->prefill(b, 0, prompt, 6, logits, false));
    DSV4_OK(b->ops->prefill(b, 1, prompt, 5, logits, false));
    DSV4_OK(b->ops->decode(b, 2, slots, toks, logits));
    for (int i = 0; i < 2 * V; i++)
        assert_true(isfinite(logits[i]));
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    free(logits);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixtures_exact),
        cmocka_unit_test(test_fixtures_fp8),
        cmocka_unit_test(test_release_model_exact),
        cmocka_unit_test(test_release_model_fp8),
        cmocka_unit_test(test_bf16_model_fp8),
        cmocka_unit_test(test_prefill_chunks_vs_tokens),
        cmocka_unit_test(test_long_chunks),
        cmocka_unit_test(test_batch_and_graphs),
        cmocka_unit_test(test_no_allocation_after_ready),
        cmocka_unit_test(test_one_step),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
