/* SPDX-License-Identifier: MIT */
/* GPU: speculative decoding on the CUDA backend (kernels/step.cu's draft, verify, accept with the MTP
 * block), on tiny_a_mtp (exact numerics), models/default-fp8 (fp8 numerics, a trained block) and, for
 * the greedy check, tiny_b_mtp and models/default (BF16, exact numerics, the same trained block):
 *   - rollback: one slot drafts, verifies and accepts a random share of its rows, again and again;
 *     a second slot is fed only the kept tokens, one decode at a time. Every kept row's verify
 *     logits equal the second slot's decode logits bit for bit, and both slots draft the same tokens
 *     at every step (so the block's state, the compressors' and the streams ring were taken back
 *     exactly);
 *   - a prompt longer than the largest bucket in one step against the same prompt in small steps:
 *     the same drafts and verify logits after (the block's catch-up over a whole chunk);
 *   - through the scheduler: greedy answers with speculation (S = 1, 2, 3) equal the answers without
 *     it (host sampling on both sides: DSV4_CUDA_SAMPLE=0), tokens and logprobs bit for bit; on the
 *     trained model drafts are accepted (the acceptance is printed). */
#include "build-config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/serve/scheduler.h"
#include "engine/model/weights.h"
#include "tests/gpu/gpu_test.h"
#include "tests/unit/sched_harness.h"

#define MAX_CONTEXT 512
#define PROMPT 40
#define LONG_PROMPT 300             /* past the largest bucket (64): one eager step, whole-row attention */
#define LONG_ROUNDS 8
#define ROUNDS 40
#define N_REQ 4
#define GEN 48

static void load(const char *dir, struct dsv4_weights **w)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", DSV4_SRCDIR, dir);
    DSV4_OK(dsv4_weights_load(path, w));
}

static struct dsv4_backend *open_backend(const struct dsv4_weights *w, enum dsv4_numerics num, int spec, int max_batch)
{
    struct dsv4_backend *b = NULL;
    struct dsv4_backend_opts o = { .max_batch = max_batch, .max_context = MAX_CONTEXT, .numerics = num,
                                   .threads = 1, .spec_tokens = spec };
    setenv("DSV4_CUDA_SAMPLE", "0", 1);     /* host sampling with and without speculation */
    DSV4_OK(dsv4_backend_cuda_create(w, &o, &b));
    unsetenv("DSV4_CUDA_SAMPLE");
    assert_int_equal(b->spec_tokens, spec);
    assert_true(!spec || (b->ops->draft && b->ops->verify && b->ops->accept && !b->ops->sample));
    return b;
}

static void expect_same_row(const float *a, const float *b, int V, const char *what, int round, int j)
{
    if (memcmp(a, b, sizeof(float) * (size_t)V) != 0) {
        int v = 0;
        while (v < V - 1 && a[v] == b[v])
            v++;
        fail_msg("%s round %d row %d: the verify's logits differ from the decode's at id %d: %.9g vs %.9g", what,
                 round, j, v, a[v], b[v]);
    }
}

static void check_rollback(const char *dir, enum dsv4_numerics num)
{
    struct dsv4_weights *w;
    load(dir, &w);
    const int S = DSV4_SPEC_TOKENS_MAX, V = w->cfg.vocab_size;
    struct dsv4_backend *b = open_backend(w, num, S, S + 1);
    float *vl = malloc(sizeof(float) * (size_t)(S + 1) * V), *dl = malloc(sizeof(float) * (size_t)V);
    int32_t prompt[PROMPT], rows_tok[DSV4_SPEC_TOKENS_MAX + 1], drafts[2][DSV4_SPEC_TOKENS_MAX];
    uint64_t st = gt_u64();
    int kept = 0, verifies = 0, hist[DSV4_SPEC_TOKENS_MAX + 2] = { 0 };

    harness_prompt(&st, prompt, PROMPT);
    for (int slot = 0; slot < 2; slot++)
        DSV4_OK(b->ops->prefill(b, slot, prompt, PROMPT, NULL, false));
    for (int round = 0; round < ROUNDS; round++) {
        const int sl[2] = { 0, 1 }, want = S;
        int made[2];
        const int32_t t = (int32_t)(2 + gt_u64() % 250);
        for (int k = 0; k < 2; k++)     /* each slot alone: the same state must draft the same tokens */
            DSV4_OK(b->ops->draft(b, 1, &sl[k], &t, &want, drafts[k], &made[k]));
        assert_int_equal(made[0], made[1]);
        assert_memory_equal(drafts[0], drafts[1], sizeof(int32_t) * (size_t)made[0]);
        /* rows: t, then the drafts, the later ones now and then replaced (as a rejection would see) */
        const int rows = 1 + made[0];
        rows_tok[0] = t;
        for (int j = 1; j < rows; j++)
            rows_tok[j] = gt_u64() % 3 ? drafts[0][j - 1] : (int32_t)(2 + gt_u64() % 250);
        DSV4_OK(b->ops->verify(b, 1, &sl[0], &rows, rows_tok, vl));
        const int keep = 1 + (int)(gt_u64() % (uint64_t)rows);
        DSV4_OK(b->ops->accept(b, 0, keep));
        for (int j = 0; j < keep; j++) {
            DSV4_OK(b->ops->decode(b, 1, &sl[1], &rows_tok[j], dl));
            expect_same_row(vl + (size_t)j * V, dl, V, dir, round, j);
        }
        assert_int_equal(b->ops->slot_position(b, 0), b->ops->slot_position(b, 1));
        kept += keep;
        verifies++;
        hist[keep]++;
    }
    printf("# %s: %d verifies of up to %d rows, %d rows kept (keep 1..%d: %d %d %d %d); verify rows == decode rows "
           "and both slots drafted alike every round\n", dir, verifies, S + 1, kept, S + 1, hist[1], hist[2], hist[3],
           hist[4]);
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    free(vl);
    free(dl);
}

static void test_rollback_tiny(void **state)
{
    check_rollback("tests/fixtures/tiny_a_mtp", DSV4_NUMERICS_EXACT);
}

static void test_rollback_default_fp8(void **state)
{
    check_rollback("models/default-fp8", DSV4_NUMERICS_FP8);
}

/* A prompt longer than the largest bucket prefilled in one eager step (the block's catch-up rows run
 * whole, reading their run's own window entries and storing the ring from the run's last rows)
 * against the same prompt in steps of max_batch rows (bucket graphs, each step one slice that stores
 * into the ring before its rows read it): both slots then draft the same tokens and verify to the
 * same logits, round after round. */
static void check_long_prompt(const char *dir, enum dsv4_numerics num)
{
    struct dsv4_weights *w;
    load(dir, &w);
    const int S = DSV4_SPEC_TOKENS_MAX, V = w->cfg.vocab_size, MB = S + 1;
    struct dsv4_backend *b = open_backend(w, num, S, MB);
    float *vl[2] = { malloc(sizeof(float) * (size_t)(S + 1) * V), malloc(sizeof(float) * (size_t)(S + 1) * V) };
    int32_t prompt[LONG_PROMPT], drafts[2][DSV4_SPEC_TOKENS_MAX];
    uint64_t st = gt_u64();
    assert_true(vl[0] && vl[1]);
    harness_prompt(&st, prompt, LONG_PROMPT);
    DSV4_OK(b->ops->prefill(b, 0, prompt, LONG_PROMPT, NULL, false));
    for (int i0 = 0; i0 < LONG_PROMPT; i0 += MB)
        DSV4_OK(b->ops->prefill(b, 1, prompt + i0, LONG_PROMPT - i0 < MB ? LONG_PROMPT - i0 : MB, NULL, false));
    for (int round = 0; round < LONG_ROUNDS; round++) {
        const int sl[2] = { 0, 1 }, want = S;
        int made[2];
        const int32_t t = (int32_t)(2 + gt_u64() % 250);
        for (int k = 0; k < 2; k++)
            DSV4_OK(b->ops->draft(b, 1, &sl[k], &t, &want, drafts[k], &made[k]));
        assert_int_equal(made[0], made[1]);
        assert_memory_equal(drafts[0], drafts[1], sizeof(int32_t) * (size_t)made[0]);
        int32_t rows_tok[DSV4_SPEC_TOKENS_MAX + 1];
        const int rows = 1 + made[0];
        rows_tok[0] = t;
        memcpy(rows_tok + 1, drafts[0], sizeof(int32_t) * (size_t)made[0]);
        for (int k = 0; k < 2; k++) {
            DSV4_OK(b->ops->verify(b, 1, &sl[k], &rows, rows_tok, vl[k]));
            DSV4_OK(b->ops->accept(b, sl[k], rows));
        }
        for (int j = 0; j < rows; j++)
            expect_same_row(vl[0] + (size_t)j * V, vl[1] + (size_t)j * V, V, dir, round, j);
    }
    printf("# %s: a %d-token prompt in one step and in steps of %d: the same drafts and verify logits for %d "
           "rounds\n", dir, LONG_PROMPT, MB, LONG_ROUNDS);
    dsv4_backend_destroy(b);
    dsv4_weights_free(w);
    free(vl[0]);
    free(vl[1]);
}

static void test_long_prompt_default_fp8(void **state)
{
    check_long_prompt("models/default-fp8", DSV4_NUMERICS_FP8);
}

static void generate(const char *dir, enum dsv4_numerics num, int spec, struct answer *a, struct dsv4_sched_stats *st)
{
    struct env e = {};
    load(dir, &e.w);
    e.b = open_backend(e.w, num, spec, N_REQ);
    struct dsv4_sched_limits lim = { .prefill_budget = 64, .detok = { letter_bytes, NULL } };
    DSV4_OK(dsv4_sched_create(e.b, NULL, &lim, &e.s));
    uint64_t seed = 77;
    static int32_t prompts[N_REQ][PROMPT];
    for (int i = 0; i < N_REQ; i++) {
        harness_prompt(&seed, prompts[i], 8 + 8 * i);
        struct dsv4_sampling sp;
        dsv4_sampling_defaults(&sp);
        sp.temperature = 0.0f;
        sp.logprobs = 2;
        memset(&a[i], 0, sizeof(a[i]));
        struct dsv4_sched_request rq = { .prompt = prompts[i], .n_prompt = 8 + 8 * i, .max_tokens = GEN,
                                         .sampling = sp, .ignore_eos = true, .user = &a[i] };
        DSV4_OK(dsv4_sched_submit(e.s, &rq, &a[i].id));
    }
    run_until(&e, a, N_REQ);
    dsv4_sched_get_stats(e.s, st);
    env_close(&e);
}

static void check_greedy(const char *dir, enum dsv4_numerics num, bool trained)
{
    struct answer plain[N_REQ], fast[N_REQ];
    struct dsv4_sched_stats st;
    generate(dir, num, 0, plain, &st);
    for (int S = 1; S <= DSV4_SPEC_TOKENS_MAX; S++) {
        generate(dir, num, S, fast, &st);
        for (int i = 0; i < N_REQ; i++) {
            char what[160];
            snprintf(what, sizeof(what), "%s S=%d request %d", dir, S, i);
            answer_expect_same(&fast[i], &plain[i], what);
        }
        assert_int_equal(st.spec_tokens, S);
        assert_true(st.spec_steps > 0);
        printf("# %s S=%d: greedy answers identical; %llu verifies with drafts, %llu of %llu drafts accepted "
               "(%.2f tokens a verify)\n", dir, S, (unsigned long long)st.spec_steps,
               (unsigned long long)st.spec_accepted, (unsigned long long)st.spec_drafted,
               st.spec_steps ? 1.0 + (double)st.spec_accepted / (double)st.spec_steps : 0.0);
        if (trained)
            assert_true(st.spec_accepted > 0);
    }
}

static void test_greedy_tiny(void **state)
{
    check_greedy("tests/fixtures/tiny_a_mtp", DSV4_NUMERICS_EXACT, false);
    check_greedy("tests/fixtures/tiny_b_mtp", DSV4_NUMERICS_EXACT, false);
}

static void test_greedy_default_fp8(void **state)
{
    check_greedy("models/default-fp8", DSV4_NUMERICS_FP8, true);
}

static void test_greedy_default_bf16(void **state)
{
    check_greedy("models/default", DSV4_NUMERICS_EXACT, true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rollback_tiny),
        cmocka_unit_test(test_rollback_default_fp8),
        cmocka_unit_test(test_long_prompt_default_fp8),
        cmocka_unit_test(test_greedy_tiny),
        cmocka_unit_test(test_greedy_default_fp8),
        cmocka_unit_test(test_greedy_default_bf16),
    };
    return gt_main(tests, sizeof(tests) / sizeof(tests[0]));
}
