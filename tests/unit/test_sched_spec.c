/* SPDX-License-Identifier: MIT */
/* Speculative decoding through engine/serve/scheduler on the CPU backend, over the fixtures with an MTP
 * block (tests/fixtures/tiny_{a,b}_mtp: the tiny_a and tiny_b models plus a random MTP block):
 *
 * greedy: every case's tokens are transformers' greedy tokens at spec_tokens 0, 1, 2 and 3, alone, batched
 *   with chunked prefill, and through the prefix cache (the second run of a prompt restores it); once with
 *   the MTP block's own drafts (random weights: nearly all rejected) and once with drafts that are right
 *   three times in four (a draft op that knows the answer), so that full acceptance, partial acceptance
 *   and a request ending on an accepted draft all happen;
 * sampling: seeded requests with truncation and penalties give the same tokens with and without drafts
 *   and again on a second run (a seed reproduces exactly);
 * distribution: over many seeds the first three sampled tokens follow the model's distribution (computed
 *   here from the logits), while drafts that are right about half the time are accepted and rejected:
 *   a chi-square test at significance 0.001;
 * failures: a draft that fails costs speed only (same tokens, no drafts counted); a verify or accept
 *   that fails ends the requests of that call with an error and the next request in the slot is
 *   right again; a fatal one (-ENOTRECOVERABLE) ends everything and the step returns it. */
#include "build-config.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/backend.h"
#include "engine/cpu/cpu_forward.h"
#include "engine/error.h"
#include "engine/model/weights.h"
#include "engine/serve/scheduler.h"
#include "tests/unit/fixture_cases.h"
#include "tests/unit/sched_harness.h"

#define MAX_CONTEXT 160
#define POOL_BYTES (64 << 20)

/* ---- a draft op that knows the answer ----
 * The backend as created, with its draft op wrapped: the MTP block still drafts (its state must move as
 * in real use), then each draft is replaced by the expected token at that position three times in four.
 * A slot's expected sequence is found from the tokens of its first prefill (or prefix load). */
#define ORACLE_SEQS 16
static struct {
    const struct dsv4_backend_ops *inner;
    struct dsv4_backend_ops ops;
    const int32_t *seq[ORACLE_SEQS];    /* expected prompt + output */
    int len[ORACLE_SEQS];
    int n_seqs;
    int slot_seq[64];                   /* slot -> seq index, -1 unknown */
    uint64_t counter;
} oracle;

static void oracle_bind(int slot, const int32_t *tokens, int n)
{
    for (int i = 0; i < oracle.n_seqs; i++)
        if (n <= oracle.len[i] && memcmp(oracle.seq[i], tokens, sizeof(int32_t) * (size_t)n) == 0) {
            oracle.slot_seq[slot] = i;
            return;
        }
    oracle.slot_seq[slot] = -1;
}

static int oracle_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits,
                          bool all_rows)
{
    if (b->ops->slot_position(b, slot) == 0)
        oracle_bind(slot, tokens, n);
    return oracle.inner->prefill(b, slot, tokens, n, logits, all_rows);
}

static int oracle_prefix_load(struct dsv4_backend *b, int slot, int n_blocks, const int32_t *block_pages,
                              const int32_t *boundary_pages, const int32_t *tokens)
{
    oracle_bind(slot, tokens, n_blocks * b->prefix.block);
    return oracle.inner->prefix_load(b, slot, n_blocks, block_pages, boundary_pages, tokens);
}

static int oracle_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                        int32_t *drafts, int *ret_k)
{
    int r = oracle.inner->draft(b, n, slots, tokens, k, drafts, ret_k);
    if (r < 0)
        return r;
    for (int i = 0; i < n; i++) {
        int q = oracle.slot_seq[slots[i]];
        int64_t P = b->ops->slot_position(b, slots[i]);
        if (q < 0)
            continue;
        assert_int_equal(tokens[i], oracle.seq[q][P]);
        ret_k[i] = k[i];    /* even where the block had no state yet */
        for (int j = 0; j < k[i]; j++)
            if (P + 1 + j < oracle.len[q] && oracle.counter++ % 4 != 0)
                drafts[i * b->spec_tokens + j] = oracle.seq[q][P + 1 + j];
    }
    return 0;
}

static void oracle_wrap(struct dsv4_backend *b)
{
    oracle.inner = b->ops;
    oracle.ops = *b->ops;
    oracle.ops.prefill = oracle_prefill;
    oracle.ops.prefix_load = oracle_prefix_load;
    oracle.ops.draft = oracle_draft;
    b->ops = &oracle.ops;
    for (int i = 0; i < 64; i++)
        oracle.slot_seq[i] = -1;
}

static void env_open(struct env *e, const char *model, int max_batch, int prefill_budget, int spec, bool prefix,
                     bool with_oracle)
{
    char dir[PATH_MAX];
    fixture_dir(model, dir, sizeof(dir));
    if (dsv4_weights_load(dir, &e->w) < 0)
        fail_msg("%s: %s", dir, dsv4_error_message());
    assert_int_equal(e->w->n_mtp, 1);
    struct dsv4_backend_opts bo = { .max_batch = max_batch, .max_context = MAX_CONTEXT,
                                    .numerics = DSV4_NUMERICS_EXACT, .threads = 1, .spec_tokens = spec,
                                    .prefix_pool_bytes = prefix ? POOL_BYTES : 0 };
    if (dsv4_backend_cpu_create(e->w, &bo, &e->b) < 0)
        fail_msg("cpu backend: %s", dsv4_error_message());
    assert_int_equal(e->b->spec_tokens, spec);
    if (with_oracle)
        oracle_wrap(e->b);
    struct dsv4_sched_limits lim = { .prefill_budget = prefill_budget, .detok = { letter_bytes, NULL } };
    if (dsv4_sched_create(e->b, NULL, &lim, &e->s) < 0)
        fail_msg("scheduler: %s", dsv4_error_message());
}

/* Restores the backend's own ops before it is destroyed. */
static void env_done(struct env *e)
{
    if (e->b->ops == &oracle.ops)
        e->b->ops = oracle.inner;
    env_close(e);
}

static void submit(struct env *e, const int32_t *prompt, int n, int max_tokens, const struct dsv4_sampling *sp,
                   struct answer *a)
{
    memset(a, 0, sizeof(*a));
    struct dsv4_sched_request rq = { .prompt = prompt, .n_prompt = n, .max_tokens = max_tokens,
                                     .sampling = *sp, .user = a };
    if (dsv4_sched_submit(e->s, &rq, &a->id) < 0)
        fail_msg("submit: %s", dsv4_error_message());
}

struct spec_totals {
    uint64_t steps, drafted, accepted, full;
};

static void add_stats(struct env *e, int spec, struct spec_totals *t)
{
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(e->s, &st);
    assert_int_equal(st.spec_tokens, spec);
    uint64_t hist = 0, acc = 0;
    for (int a = 0; a <= DSV4_SPEC_TOKENS_MAX; a++) {
        hist += st.spec_accept_hist[a];
        acc += (uint64_t)a * st.spec_accept_hist[a];
        if (a > spec)
            assert_int_equal(st.spec_accept_hist[a], 0);
    }
    assert_int_equal(hist, st.spec_steps);
    assert_int_equal(acc, st.spec_accepted);
    assert_true(st.spec_accepted <= st.spec_drafted && st.spec_drafted <= (uint64_t)spec * st.spec_steps);
    if (spec == 0)
        assert_int_equal(st.spec_steps, 0);
    t->steps += st.spec_steps;
    t->drafted += st.spec_drafted;
    t->accepted += st.spec_accepted;
    t->full += spec ? st.spec_accept_hist[spec] : 0;
}

static void check_answer(const struct answer *a, const struct fixture_case *c, int max_tokens)
{
    assert_true(a->finished);
    assert_int_equal(a->n, max_tokens);
    assert_memory_equal(a->tokens, c->seq + c->n_prompt, sizeof(int32_t) * (size_t)max_tokens);
}

static void greedy_model(const char *model, const char *base, bool with_oracle)
{
    static struct fixture_case cases[FIXTURE_CASES_MAX];
    static struct answer a[FIXTURE_CASES_MAX], again;
    struct dsv4_sampling greedy;
    dsv4_sampling_defaults(&greedy);
    greedy.temperature = 0.0f;
    int nc = fixture_cases_load(base, cases);
    assert_true(nc >= 2);
    oracle.n_seqs = nc;
    for (int c = 0; c < nc; c++) {
        oracle.seq[c] = cases[c].seq;
        oracle.len[c] = cases[c].n_prompt + cases[c].n_greedy;
    }
    for (int spec = 0; spec <= DSV4_SPEC_TOKENS_MAX; spec++) {
        struct spec_totals t = {0};
        /* alone, in the case's chunks; max_tokens short of the greedy run in one case in two */
        for (int c = 0; c < nc; c++) {
            struct env e;
            int max_tokens = c % 2 ? cases[c].n_greedy - 3 : cases[c].n_greedy;
            env_open(&e, model, 1, cases[c].chunk ? cases[c].chunk : 512, spec, false, with_oracle);
            submit(&e, cases[c].seq, cases[c].n_prompt, max_tokens, &greedy, &a[c]);
            run_until(&e, &a[c], 1);
            assert_int_equal(a[c].finish, DSV4_FINISH_LENGTH);
            check_answer(&a[c], &cases[c], max_tokens);
            add_stats(&e, spec, &t);
            env_done(&e);
        }
        /* all together, arriving a step apart, 7-token prefill budget, prefix cache on: then the first
         * case again, restored from the cache */
        struct env e;
        env_open(&e, model, 4, 7, spec, true, with_oracle);
        for (int c = 0; c < nc; c++) {
            submit(&e, cases[c].seq, cases[c].n_prompt, cases[c].n_greedy, &greedy, &a[c]);
            assert_true(dsv4_sched_step(e.s) >= 0);
            collect(e.s);
        }
        run_until(&e, a, nc);
        for (int c = 0; c < nc; c++)
            check_answer(&a[c], &cases[c], cases[c].n_greedy);
        submit(&e, cases[0].seq, cases[0].n_prompt, cases[0].n_greedy, &greedy, &again);
        run_until(&e, &again, 1);
        assert_true(again.cached_tokens > 0);
        check_answer(&again, &cases[0], cases[0].n_greedy);
        add_stats(&e, spec, &t);
        env_done(&e);
        print_message("# %s%s spec_tokens %d: %llu verifies with drafts, %llu drafted, %llu accepted, %llu with "
                      "all accepted\n", model, with_oracle ? " (drafts 3/4 right)" : "", spec,
                      (unsigned long long)t.steps, (unsigned long long)t.drafted, (unsigned long long)t.accepted,
                      (unsigned long long)t.full);
        if (spec > 0) {
            assert_true(t.drafted > 0);
            if (with_oracle)
                assert_true(t.accepted > t.drafted / 2 && t.full > 0 && t.accepted < t.drafted);
        }
    }
}

static void test_greedy_identical(void **state)
{
    (void)state;
    greedy_model("tiny_a_mtp", "tiny_a", false);
    greedy_model("tiny_b_mtp", "tiny_b", false);
    greedy_model("tiny_a_mtp", "tiny_a", true);
    greedy_model("tiny_b_mtp", "tiny_b", true);
}

/* ---- sampling ---- */

enum { NS = 5, NS_TOKENS = 24 };

static void sampled(int spec, bool with_oracle, const int32_t (*prompts)[64], const struct dsv4_sampling *sp,
                    struct answer *out)
{
    struct env e;
    env_open(&e, "tiny_a_mtp", 3, 9, spec, false, with_oracle);
    int next = 0;
    for (int t = 0; next < NS; t++) {
        if (t % 2 == 0) {
            submit(&e, prompts[next], 10 + 7 * next, NS_TOKENS, &sp[next], &out[next]);
            next++;
        }
        assert_true(dsv4_sched_step(e.s) >= 0);
        collect(e.s);
    }
    run_until(&e, out, NS);
    env_done(&e);
}

/* Seeded requests: the same tokens at every spec_tokens, with the block's drafts and with drafts taken
 * from the answer without speculation (so that many are accepted), and on a second run. */
static void test_seeded_identical(void **state)
{
    (void)state;
    static int32_t prompts[NS][64];
    static int32_t expect[NS][64 + NS_TOKENS];
    struct dsv4_sampling sp[NS];
    uint64_t st = 77;
    for (int i = 0; i < NS; i++) {
        harness_prompt(&st, prompts[i], 64);
        dsv4_sampling_defaults(&sp[i]);
        sp[i].has_seed = true;
        sp[i].seed = 900 + (uint64_t)i;
        sp[i].temperature = 0.6f + 0.2f * (float)i;
        sp[i].top_p = 0.95f;
        sp[i].top_k = i % 2 ? 30 : 0;
        sp[i].min_p = i == 3 ? 0.05f : 0.0f;
        sp[i].repetition_penalty = 1.1f;
        sp[i].frequency_penalty = i == 2 ? 0.4f : 0.0f;
        sp[i].presence_penalty = 0.3f;
        sp[i].logprobs = 2;
    }
    static struct answer base[NS], got[NS];
    sampled(0, false, prompts, sp, base);
    for (int i = 0; i < NS; i++) {
        assert_int_equal(base[i].n, NS_TOKENS);
        memcpy(expect[i], prompts[i], sizeof(int32_t) * (size_t)(10 + 7 * i));
        memcpy(expect[i] + 10 + 7 * i, base[i].tokens, sizeof(int32_t) * NS_TOKENS);
        oracle.seq[i] = expect[i];
        oracle.len[i] = 10 + 7 * i + NS_TOKENS;
    }
    oracle.n_seqs = NS;
    for (int spec = 1; spec <= DSV4_SPEC_TOKENS_MAX; spec++)
        for (int o = 0; o < 2; o++)
            for (int run = 0; run < 2; run++) {
                sampled(spec, o, prompts, sp, got);
                for (int i = 0; i < NS; i++) {
                    assert_int_equal(got[i].n, base[i].n);
                    assert_memory_equal(got[i].tokens, base[i].tokens, sizeof(int32_t) * (size_t)base[i].n);
                    assert_memory_equal(got[i].logprob, base[i].logprob, sizeof(float) * (size_t)base[i].n);
                    assert_memory_equal(got[i].top0, base[i].top0, sizeof(int32_t) * (size_t)base[i].n);
                }
            }
}

/* ---- the distribution ---- */

#define DIST_DRAWS 800
#define DIST_PROMPT 12
#define DIST_TEMP 1.5f
/* chi-square, 7 degrees of freedom, upper 0.001 point */
#define CHI2_7_P001 24.322

/* The two kept tokens of a row under top_k 2 and DIST_TEMP, and their probabilities. */
static void top2(const float *row, int V, int32_t *id, double *p)
{
    id[0] = id[1] = -1;
    for (int v = 0; v < V; v++) {
        if (id[0] < 0 || row[v] > row[id[0]]) {
            id[1] = id[0];
            id[0] = v;
        } else if (id[1] < 0 || row[v] > row[id[1]]) {
            id[1] = v;
        }
    }
    double e1 = exp(((double)row[id[1]] - row[id[0]]) / DIST_TEMP);
    p[0] = 1.0 / (1.0 + e1);
    p[1] = e1 / (1.0 + e1);
}

static struct {
    int32_t t1[2], t2[2][2], t3[2][2][2];
    double p1[2], p2[2][2], p3[2][2][2];
    uint64_t pick;
} tree;

/* Drafts for the distribution test: at the first decode (position = prompt, pending t1) d1 and d2 are
 * each one of the two tokens top_k keeps there, chosen by a counter; no drafts elsewhere. Requests ask
 * for 4 tokens, so that the first verify may take both drafts. */
static int tree_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                      int32_t *drafts, int *ret_k)
{
    int r = oracle.inner->draft(b, n, slots, tokens, k, drafts, ret_k);
    for (int i = 0; i < n && r == 0; i++) {
        ret_k[i] = 0;
        if (b->ops->slot_position(b, slots[i]) != DIST_PROMPT || k[i] < 2)
            continue;
        int a = tokens[i] == tree.t1[0] ? 0 : 1;
        assert_int_equal(tokens[i], tree.t1[a]);
        int c2 = (int)(tree.pick++ % 2), c3 = (int)((tree.pick / 2) % 2);
        drafts[i * b->spec_tokens] = tree.t2[a][c2];
        drafts[i * b->spec_tokens + 1] = tree.t3[a][c2][c3];
        ret_k[i] = 2;
    }
    return r;
}

static void row_after(const struct dsv4_weights *w, const int32_t *seq, int n, float *row)
{
    struct dsv4_cpu_seq *s;
    assert_int_equal(dsv4_cpu_seq_create(w, n, &s), 0);
    assert_int_equal(dsv4_cpu_forward(w, DSV4_NUMERICS_EXACT, s, seq, n, row, false), 0);
    dsv4_cpu_seq_free(s);
}

static void test_distribution(void **state)
{
    (void)state;
    int32_t seq[DIST_PROMPT + 3];
    uint64_t st = 4242;
    harness_prompt(&st, seq, DIST_PROMPT);
    struct env e;
    env_open(&e, "tiny_a_mtp", 4, 64, 2, false, false);
    int V = e.w->cfg.vocab_size;
    float *row = malloc(sizeof(float) * (size_t)V);
    assert_non_null(row);
    /* The exact distribution of (t1, t2, t3) under top_k 2: every token kept has two successors. */
    row_after(e.w, seq, DIST_PROMPT, row);
    top2(row, V, tree.t1, tree.p1);
    for (int a = 0; a < 2; a++) {
        seq[DIST_PROMPT] = tree.t1[a];
        row_after(e.w, seq, DIST_PROMPT + 1, row);
        top2(row, V, tree.t2[a], tree.p2[a]);
        for (int b2 = 0; b2 < 2; b2++) {
            seq[DIST_PROMPT + 1] = tree.t2[a][b2];
            row_after(e.w, seq, DIST_PROMPT + 2, row);
            top2(row, V, tree.t3[a][b2], tree.p3[a][b2]);
        }
    }
    free(row);
    oracle.inner = e.b->ops;
    oracle.ops = *e.b->ops;
    oracle.ops.draft = tree_draft;
    e.b->ops = &oracle.ops;

    struct dsv4_sampling sp;
    dsv4_sampling_defaults(&sp);
    sp.has_seed = true;
    sp.temperature = DIST_TEMP;
    sp.top_k = 2;
    static struct answer a[4];
    uint64_t count[8] = {0};
    for (int d = 0; d < DIST_DRAWS; d += 4) {
        for (int i = 0; i < 4; i++) {
            sp.seed = 1000003ull * (uint64_t)(d + i) + 17;
            submit(&e, seq, DIST_PROMPT, 4, &sp, &a[i]);
        }
        run_until(&e, a, 4);
        for (int i = 0; i < 4; i++) {
            assert_int_equal(a[i].n, 4);
            int x = a[i].tokens[0] == tree.t1[0] ? 0 : 1;
            assert_int_equal(a[i].tokens[0], tree.t1[x]);
            int y = a[i].tokens[1] == tree.t2[x][0] ? 0 : 1;
            assert_int_equal(a[i].tokens[1], tree.t2[x][y]);
            int z = a[i].tokens[2] == tree.t3[x][y][0] ? 0 : 1;
            assert_int_equal(a[i].tokens[2], tree.t3[x][y][z]);
            count[x * 4 + y * 2 + z]++;
        }
    }
    double chi2 = 0.0;
    for (int c = 0; c < 8; c++) {
        double expect = DIST_DRAWS * tree.p1[c / 4] * tree.p2[c / 4][(c / 2) % 2] * tree.p3[c / 4][(c / 2) % 2][c % 2];
        assert_true(expect >= 5.0);     /* the test's own validity: no sparse cell */
        chi2 += (count[c] - expect) * (count[c] - expect) / expect;
        print_message("# (t1, t2, t3) cell %d: %llu drawn, %.1f expected\n", c, (unsigned long long)count[c], expect);
    }
    struct dsv4_sched_stats stt;
    dsv4_sched_get_stats(e.s, &stt);
    print_message("# chi-square %.2f (7 degrees of freedom, 0.001 point %.3f); %llu verifies with drafts, %llu of "
                  "%llu drafts accepted, all accepted %llu times\n", chi2, CHI2_7_P001,
                  (unsigned long long)stt.spec_steps, (unsigned long long)stt.spec_accepted,
                  (unsigned long long)stt.spec_drafted, (unsigned long long)stt.spec_accept_hist[2]);
    assert_true(chi2 < CHI2_7_P001);
    assert_int_equal(stt.spec_steps, DIST_DRAWS);
    assert_true(stt.spec_accept_hist[0] > 0 && stt.spec_accept_hist[1] > 0 && stt.spec_accept_hist[2] > 0);
    e.b->ops = oracle.inner;
    env_close(&e);
}

/* ---- failures ---- */

struct injection {
    int draft_rc, verify_rc, accept_rc;     /* what the failing call returns (0: none fails) */
    int verify_fail_at, accept_fail_at;     /* 1-based call that fails */
    int verifies, accepts;
};
static struct injection inject;

static int failing_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                         int32_t *drafts, int *ret_k)
{
    if (inject.draft_rc)
        return dsv4_error_set(inject.draft_rc, "injected draft failure");
    return oracle.inner->draft(b, n, slots, tokens, k, drafts, ret_k);
}

static int failing_verify(struct dsv4_backend *b, int n, const int *slots, const int *rows, const int32_t *tokens,
                          float *logits)
{
    if (++inject.verifies == inject.verify_fail_at)
        return dsv4_error_set(inject.verify_rc, "injected verify failure");
    return oracle.inner->verify(b, n, slots, rows, tokens, logits);
}

static int failing_accept(struct dsv4_backend *b, int slot, int keep)
{
    if (++inject.accepts == inject.accept_fail_at)
        return dsv4_error_set(inject.accept_rc, "injected accept failure");
    return oracle.inner->accept(b, slot, keep);
}

/* Events into answers like collect(), but a request may fail: its answer's finish says so. */
static void collect_any(struct dsv4_sched *s)
{
    struct dsv4_sched_event ev;
    while (dsv4_sched_next_event(s, &ev) == 1) {
        struct answer *a = ev.user;
        if (ev.type == DSV4_SCHED_EVENT_TOKEN) {
            a->tokens[a->n++] = ev.sample.token;
            continue;
        }
        a->finished = true;
        a->finish = ev.result->finish;
        assert_int_equal(dsv4_sched_release(s, ev.id), 0);
    }
}

static int run_any(struct env *e, struct answer *a, int n)
{
    for (int guard = 0; guard < 10000; guard++) {
        int done = 0;
        for (int i = 0; i < n; i++)
            done += a[i].finished;
        if (done == n)
            return 0;
        int r = dsv4_sched_step(e->s);
        collect_any(e->s);
        if (r < 0)
            return r;
    }
    fail_msg("requests did not finish");
    return -ETIMEDOUT;
}

static void test_failures(void **state)
{
    (void)state;
    static struct fixture_case cases[FIXTURE_CASES_MAX];
    static struct answer a[2], again;
    int nc = fixture_cases_load("tiny_a", cases);
    assert_true(nc >= 4);
    const struct fixture_case *c0 = &cases[0], *c1 = &cases[3];    /* two prompts */
    struct dsv4_sampling greedy;
    dsv4_sampling_defaults(&greedy);
    greedy.temperature = 0.0f;
    for (int mode = 0; mode < 4; mode++) {
        memset(&inject, 0, sizeof(inject));
        struct env e;
        env_open(&e, "tiny_a_mtp", 2, 512, 2, false, false);
        oracle.inner = e.b->ops;
        oracle.ops = *e.b->ops;
        oracle.ops.draft = failing_draft;
        oracle.ops.verify = failing_verify;
        oracle.ops.accept = failing_accept;
        e.b->ops = &oracle.ops;
        if (mode == 0)
            inject.draft_rc = -EIO;
        else if (mode == 1)
            inject = (struct injection){ .verify_rc = -EIO, .verify_fail_at = 3 };
        else if (mode == 2)
            inject = (struct injection){ .accept_rc = -EIO, .accept_fail_at = 4 };
        else
            inject = (struct injection){ .verify_rc = -ENOTRECOVERABLE, .verify_fail_at = 3 };
        submit(&e, c0->seq, c0->n_prompt, c0->n_greedy, &greedy, &a[0]);
        submit(&e, c1->seq, c1->n_prompt, c1->n_greedy, &greedy, &a[1]);
        int r = run_any(&e, a, 2);
        struct dsv4_sched_stats st;
        dsv4_sched_get_stats(e.s, &st);
        if (mode == 0) {
            assert_int_equal(r, 0);
            check_answer(&a[0], c0, c0->n_greedy);
            check_answer(&a[1], c1, c1->n_greedy);
            assert_int_equal(st.spec_steps, 0);
        } else if (mode == 3) {
            assert_int_equal(r, -ENOTRECOVERABLE);
            assert_int_equal(a[0].finish, DSV4_FINISH_ERROR);
            assert_int_equal(a[1].finish, DSV4_FINISH_ERROR);
            assert_int_equal(dsv4_sched_step(e.s), -ENOTRECOVERABLE);
        } else {
            /* the failed call's requests end with an error (both share the verify; one accept fails) */
            assert_int_equal(r, 0);
            int errors = (a[0].finish == DSV4_FINISH_ERROR) + (a[1].finish == DSV4_FINISH_ERROR);
            assert_int_equal(errors, mode == 1 ? 2 : 1);
            for (int i = 0; i < 2; i++)
                if (a[i].finish != DSV4_FINISH_ERROR)
                    check_answer(&a[i], i ? c1 : c0, (i ? c1 : c0)->n_greedy);
            /* the slots are whole again: a new request gets the greedy tokens */
            submit(&e, c0->seq, c0->n_prompt, c0->n_greedy, &greedy, &again);
            assert_int_equal(run_any(&e, &again, 1), 0);
            check_answer(&again, c0, c0->n_greedy);
        }
        e.b->ops = oracle.inner;
        env_close(&e);
    }
}

/* A backend without the ops (or a checkpoint without MTP) decodes one token per step. */
static void test_no_mtp(void **state)
{
    (void)state;
    char dir[PATH_MAX];
    fixture_dir("tiny_a", dir, sizeof(dir));
    struct env e;
    assert_int_equal(dsv4_weights_load(dir, &e.w), 0);
    struct dsv4_backend_opts bo = { .max_batch = 1, .max_context = 64, .threads = 1, .spec_tokens = 2 };
    assert_int_equal(dsv4_backend_cpu_create(e.w, &bo, &e.b), 0);
    assert_int_equal(e.b->spec_tokens, 0);
    struct dsv4_sched_limits lim = { .detok = { letter_bytes, NULL } };
    assert_int_equal(dsv4_sched_create(e.b, NULL, &lim, &e.s), 0);
    struct dsv4_sched_stats st;
    dsv4_sched_get_stats(e.s, &st);
    assert_int_equal(st.spec_tokens, 0);
    env_close(&e);
    bo.spec_tokens = DSV4_SPEC_TOKENS_MAX + 1;
    assert_int_equal(dsv4_weights_load(dir, &e.w), 0);
    assert_int_equal(dsv4_backend_cpu_create(e.w, &bo, &e.b), -EINVAL);
    dsv4_weights_free(e.w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_identical),
        cmocka_unit_test(test_seeded_identical),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_failures),
        cmocka_unit_test(test_no_mtp),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
