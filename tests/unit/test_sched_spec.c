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
 *   right again; a fatal one (-ENOTRECOVERABLE) ends everything and the step returns it;
 * random (seeded, tests/unit/seed_util.h): requests with random prompts sharing random prefixes,
 *   limits, stops, seeds and cancels through a scheduler with a batch, speculation and a tiny prefix
 *   pool give what each gives alone on a fresh scheduler with neither (below). */
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
#include "tests/unit/seed_util.h"

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

/* ---- randomized differential ----
 * Random requests through one scheduler with every feature at once (a batch, chunked prefill, speculation
 * with the MTP block's drafts or with drafts that are often right, a prefix pool of a few snapshots so that
 * eviction is constant, or of a few dozen so that hits are common, several sampler and backend threads),
 * arriving and cancelled at random steps: each request's tokens, log-probabilities, top alternatives, text,
 * finish reason and stop are those of the same request run alone on a fresh scheduler without speculation
 * or pool; a cancelled one's tokens are the start of them; at the end no slot, request or allocation is
 * left. Each round draws the model (tiny_a_mtp, tiny_b_mtp), the numerics, max_context (not always a
 * multiple of the block) and max_output_bytes. Prompts share random stems (so the cache hits, partly and
 * whole), some end exactly at the context limit; max_tokens, stop strings and stop ids, seeds, sampling
 * parameters and logprobs are random. */
#define RD_ROUNDS 4
#define RD_REQS 14
#define RD_STEMS 3
#define RD_TEXT 2048
_Static_assert(RD_REQS <= ORACLE_SEQS, "the expected sequences live in oracle.seq");

struct rd_req {
    int32_t prompt[MAX_CONTEXT];
    int n_prompt, max_tokens;
    struct dsv4_sampling sp;
    char stop[2][4];
    const char *stops[2];
    int n_stop;
    int32_t stop_ids[2];
    int n_stop_ids;
    bool ignore_eos;
    int submit_step, cancel_step;   /* steps of the shared run; cancel_step -1: never */
};

struct rd_answer {
    struct answer a;                /* first: events carry a pointer to it */
    char deltas[RD_TEXT];
    size_t deltas_len;
    char text[RD_TEXT];
    size_t text_len;
    int stop_string;
    int32_t stop_token;
    bool cancel_asked;
};

static uint64_t rd_state;
static int rd_ctx, rd_bytes;       /* a round's max_context and max_output_bytes (0: the default) */
static enum dsv4_numerics rd_num;   /* and numerics */
static int rd_vocab;                /* its model's */

static uint64_t rd_next(void)
{
    rd_state ^= rd_state << 13;
    rd_state ^= rd_state >> 7;
    rd_state ^= rd_state << 17;
    return rd_state;
}

static int rd_int(int lo, int hi)     /* [lo, hi] */
{
    return lo + (int)(rd_next() % (uint64_t)(hi - lo + 1));
}

/* Drafts that are right three times in four for requests whose answer is known: each slot's fed tokens
 * are followed through the backend's ops, and a draft is the next token of an expected sequence that
 * starts with them (any, when several do: a wrong draft costs speed only). */
static struct {
    const struct dsv4_backend_ops *inner;
    struct dsv4_backend_ops ops;
    int32_t fed[4][MAX_CONTEXT + DSV4_SPEC_TOKENS_MAX + 1];
    int64_t n_fed[4];
    int64_t verify_at[4];           /* the position a slot's verify started from */
    uint64_t counter;
} rdo;

static void rd_feed(int slot, const int32_t *t, int n)
{
    memcpy(rdo.fed[slot] + rdo.n_fed[slot], t, sizeof(int32_t) * (size_t)n);
    rdo.n_fed[slot] += n;
}

static int rd_prefill(struct dsv4_backend *b, int slot, const int32_t *tokens, int n, float *logits, bool all_rows)
{
    int r = rdo.inner->prefill(b, slot, tokens, n, logits, all_rows);
    if (r == 0)
        rd_feed(slot, tokens, n);
    return r;
}

static int rd_decode(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, float *logits)
{
    int r = rdo.inner->decode(b, n, slots, tokens, logits);
    for (int i = 0; i < n && r == 0; i++)
        rd_feed(slots[i], &tokens[i], 1);
    return r;
}

static int rd_prefix_load(struct dsv4_backend *b, int slot, int n_blocks, const int32_t *block_pages,
                          const int32_t *boundary_pages, const int32_t *tokens)
{
    int r = rdo.inner->prefix_load(b, slot, n_blocks, block_pages, boundary_pages, tokens);
    if (r == 0)
        rd_feed(slot, tokens, n_blocks * b->prefix.block);
    return r;
}

static void rd_slot_reset(struct dsv4_backend *b, int slot)
{
    rdo.inner->slot_reset(b, slot);
    rdo.n_fed[slot] = 0;
}

static int rd_verify(struct dsv4_backend *b, int n, const int *slots, const int *rows, const int32_t *tokens,
                     float *logits)
{
    int r = rdo.inner->verify(b, n, slots, rows, tokens, logits);
    for (int i = 0; i < n && r == 0; i++) {
        rdo.verify_at[slots[i]] = rdo.n_fed[slots[i]];
        rd_feed(slots[i], tokens + i * (b->spec_tokens + 1), rows[i]);
    }
    return r;
}

static int rd_accept(struct dsv4_backend *b, int slot, int keep)
{
    int r = rdo.inner->accept(b, slot, keep);
    if (r == 0)
        rdo.n_fed[slot] = rdo.verify_at[slot] + keep;
    return r;
}

static int rd_draft(struct dsv4_backend *b, int n, const int *slots, const int32_t *tokens, const int *k,
                    int32_t *drafts, int *ret_k)
{
    int r = rdo.inner->draft(b, n, slots, tokens, k, drafts, ret_k);
    for (int i = 0; i < n && r == 0; i++) {
        const int64_t P = rdo.n_fed[slots[i]];
        assert_int_equal(P, b->ops->slot_position(b, slots[i]));
        for (int q = 0; q < oracle.n_seqs; q++) {
            if (oracle.len[q] <= P || oracle.seq[q][P] != tokens[i] ||
                memcmp(oracle.seq[q], rdo.fed[slots[i]], sizeof(int32_t) * (size_t)P))
                continue;
            ret_k[i] = k[i];
            for (int j = 0; j < k[i]; j++)
                if (P + 1 + j < oracle.len[q] && rdo.counter++ % 4 != 0)
                    drafts[i * b->spec_tokens + j] = oracle.seq[q][P + 1 + j];
            break;
        }
    }
    return r;
}

static void rd_wrap(struct dsv4_backend *b)
{
    rdo.inner = b->ops;
    rdo.ops = *b->ops;
    rdo.ops.prefill = rd_prefill;
    rdo.ops.decode = rd_decode;
    rdo.ops.prefix_load = rd_prefix_load;
    rdo.ops.slot_reset = rd_slot_reset;
    rdo.ops.verify = rd_verify;
    rdo.ops.accept = rd_accept;
    rdo.ops.draft = rd_draft;
    memset(rdo.n_fed, 0, sizeof(rdo.n_fed));
    b->ops = &rdo.ops;
}

static void rd_collect(struct dsv4_sched *s)
{
    struct dsv4_sched_event ev;
    while (dsv4_sched_next_event(s, &ev) == 1) {
        struct rd_answer *r = ev.user;
        struct answer *a = &r->a;
        if (ev.type == DSV4_SCHED_EVENT_TOKEN) {
            assert_true(a->n < ANSWER_MAX_TOKENS);
            assert_false(a->finished);
            assert_int_equal(ev.index, a->n);
            a->tokens[a->n] = ev.sample.token;
            a->logprob[a->n] = ev.sample.logprob;
            a->top0[a->n] = ev.sample.n_top > 0 ? ev.sample.top_ids[0] : -1;
            a->top1[a->n] = ev.sample.n_top > 1 ? ev.sample.top_ids[1] : -1;
            a->top_lp[a->n][0] = ev.sample.n_top > 0 ? ev.sample.top_logprobs[0] : NAN;
            a->top_lp[a->n][1] = ev.sample.n_top > 1 ? ev.sample.top_logprobs[1] : NAN;
            a->n++;
            assert_true(r->deltas_len + ev.delta_len <= RD_TEXT);
            memcpy(r->deltas + r->deltas_len, ev.delta, ev.delta_len);
            r->deltas_len += ev.delta_len;
            continue;
        }
        const struct dsv4_sched_result *res = ev.result;
        if (res->finish == DSV4_FINISH_ERROR)
            fail_msg("request failed: %s", res->error_message);
        assert_false(a->finished);
        a->finished = true;
        a->finish = res->finish;
        a->cached_tokens = res->cached_tokens;
        assert_int_equal(res->n_tokens, a->n);
        assert_memory_equal(res->tokens, a->tokens, sizeof(int32_t) * (size_t)a->n);
        assert_true(res->text_len < RD_TEXT);
        memcpy(r->text, res->text, res->text_len);
        r->text_len = res->text_len;
        r->stop_string = res->stop_string;
        r->stop_token = res->stop_token;
        if (res->finish != DSV4_FINISH_CANCELLED) {
            assert_int_equal(r->deltas_len, r->text_len);
            assert_memory_equal(r->deltas, r->text, r->text_len);
        }
        assert_int_equal(dsv4_sched_release(s, ev.id), 0);
    }
}

static void rd_submit(struct dsv4_sched *s, const struct rd_req *q, struct rd_answer *r)
{
    memset(r, 0, sizeof(*r));
    struct dsv4_sched_request rq = { .prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = q->max_tokens,
                                     .sampling = q->sp, .stop = q->stops, .n_stop = q->n_stop,
                                     .stop_token_ids = q->stop_ids, .n_stop_token_ids = q->n_stop_ids,
                                     .ignore_eos = q->ignore_eos, .user = r };
    if (dsv4_sched_submit(s, &rq, &r->a.id) < 0)
        fail_msg("submit: %s", dsv4_error_message());
}

static void rd_make(struct rd_req *rq, int n)
{
    int32_t stems[RD_STEMS][MAX_CONTEXT];
    for (int k = 0; k < RD_STEMS; k++)
        for (int i = 0; i < MAX_CONTEXT; i++)
            stems[k][i] = i == 0 ? 0 : rd_int(2, rd_vocab - 1);
    for (int i = 0; i < n; i++) {
        struct rd_req *q = &rq[i];
        memset(q, 0, sizeof(*q));
        if (i > 0 && rd_int(0, 4) == 0) {
            /* an earlier prompt again, whole */
            const struct rd_req *p = &rq[rd_int(0, i - 1)];
            memcpy(q->prompt, p->prompt, sizeof(q->prompt));
            q->n_prompt = p->n_prompt;
        } else {
            int shared = rd_int(0, 3) == 0 ? 0 : rd_int(1, 5 * 16 + 8);
            int mode = rd_int(0, 7);
            q->n_prompt = mode == 0 ? rd_ctx - 1 : mode == 1 ? rd_ctx - rd_int(2, 6)
                          : mode == 2 ? rd_int(1, 3) : shared + rd_int(1, 40);
            if (q->n_prompt > rd_ctx - 1)
                q->n_prompt = rd_ctx - 1;
            if (shared > q->n_prompt)
                shared = q->n_prompt;
            memcpy(q->prompt, stems[rd_int(0, RD_STEMS - 1)], sizeof(int32_t) * (size_t)shared);
            for (int t = shared; t < q->n_prompt; t++)
                q->prompt[t] = t == 0 ? 0 : rd_int(2, rd_vocab - 1);
        }
        q->max_tokens = rd_int(0, 9) == 0 ? 0 : rd_int(1, 24);
        dsv4_sampling_defaults(&q->sp);
        if (rd_int(0, 2) == 0) {
            q->sp.temperature = 0.0f;
        } else {
            q->sp.has_seed = true;
            q->sp.seed = rd_next();
            q->sp.temperature = 0.5f + 0.25f * (float)rd_int(0, 4);
            q->sp.top_k = rd_int(0, 1) ? 0 : rd_int(1, 40);
            q->sp.top_p = rd_int(0, 1) ? 1.0f : 0.9f;
            q->sp.min_p = rd_int(0, 3) ? 0.0f : 0.02f;
            q->sp.repetition_penalty = rd_int(0, 1) ? 1.0f : 1.2f;
            q->sp.presence_penalty = rd_int(0, 1) ? 0.0f : 0.3f;
            q->sp.frequency_penalty = rd_int(0, 1) ? 0.0f : 0.2f;
        }
        q->sp.logprobs = rd_int(0, 2);
        q->n_stop = rd_int(0, 2);
        for (int k = 0; k < q->n_stop; k++) {
            int len = rd_int(1, 2);
            for (int c = 0; c < len; c++)
                q->stop[k][c] = (char)('a' + rd_int(0, 25));
            q->stops[k] = q->stop[k];
        }
        q->n_stop_ids = rd_int(0, 3) ? 0 : rd_int(1, 2);
        for (int k = 0; k < q->n_stop_ids; k++)
            q->stop_ids[k] = rd_int(1, rd_vocab - 1);
        q->ignore_eos = rd_int(0, 1);
        q->submit_step = rd_int(0, 30);
        q->cancel_step = rd_int(0, 5) ? -1 : q->submit_step + rd_int(0, 20);
    }
}

/* The request alone on a fresh scheduler: no batch, no speculation, no pool, the default prefill budget. */
static void rd_alone(struct dsv4_weights *w, const struct rd_req *q, struct rd_answer *r)
{
    struct dsv4_backend_opts bo = { .max_batch = 1, .max_context = rd_ctx, .numerics = rd_num, .threads = 1 };
    struct dsv4_backend *b;
    struct dsv4_sched *s;
    if (dsv4_backend_cpu_create(w, &bo, &b) < 0)
        fail_msg("cpu backend: %s", dsv4_error_message());
    struct dsv4_sched_limits lim = { .max_output_bytes = rd_bytes, .detok = { letter_bytes, NULL } };
    if (dsv4_sched_create(b, NULL, &lim, &s) < 0)
        fail_msg("scheduler: %s", dsv4_error_message());
    rd_submit(s, q, r);
    for (int guard = 0; !r->a.finished; guard++) {
        assert_true(guard < 10000);
        assert_true(dsv4_sched_step(s) >= 0);
        rd_collect(s);
    }
    assert_int_equal(r->a.cached_tokens, 0);
    dsv4_sched_destroy(s);
    dsv4_backend_destroy(b);
}

static void test_random_differential(void **state)
{
    (void)state;
    static struct rd_req rq[RD_REQS];
    static struct rd_answer alone[RD_REQS], got[RD_REQS];
    static int32_t expect[RD_REQS][MAX_CONTEXT + ANSWER_MAX_TOKENS];
    static const char *const models[2] = { "tiny_a_mtp", "tiny_b_mtp" };
    struct dsv4_weights *ws[2];
    struct dsv4_prefix_geom gs[2];
    rd_state = dsv4_test_seed();
    for (int m = 0; m < 2; m++) {
        char dir[PATH_MAX];
        fixture_dir(models[m], dir, sizeof(dir));
        if (dsv4_weights_load(dir, &ws[m]) < 0)
            fail_msg("%s: %s", dir, dsv4_error_message());
        struct dsv4_backend_opts probe_o = { .max_batch = 1, .max_context = MAX_CONTEXT, .threads = 1,
                                             .prefix_pool_bytes = POOL_BYTES };
        struct dsv4_backend *probe;
        assert_int_equal(dsv4_backend_cpu_create(ws[m], &probe_o, &probe), 0);
        gs[m] = probe->prefix;
        dsv4_backend_destroy(probe);
    }

    for (int round = 0; round < RD_ROUNDS; round++) {
        const int model = rd_int(0, 1);
        struct dsv4_weights *w = ws[model];
        const struct dsv4_prefix_geom g = gs[model];
        rd_vocab = w->cfg.vocab_size;
        rd_ctx = MAX_CONTEXT - rd_int(0, 40);
        rd_bytes = rd_int(0, 2) ? 0 : rd_int(8, 40);
        rd_num = rd_int(0, 1) ? DSV4_NUMERICS_EXACT : DSV4_NUMERICS_FP8;
        rd_make(rq, RD_REQS);
        for (int i = 0; i < RD_REQS; i++) {
            rd_alone(w, &rq[i], &alone[i]);
            memcpy(expect[i], rq[i].prompt, sizeof(int32_t) * (size_t)rq[i].n_prompt);
            memcpy(expect[i] + rq[i].n_prompt, alone[i].a.tokens, sizeof(int32_t) * (size_t)alone[i].a.n);
            oracle.seq[i] = expect[i];
            oracle.len[i] = rq[i].n_prompt + alone[i].a.n;
        }
        oracle.n_seqs = RD_REQS;

        const int max_batch = rd_int(1, 4), spec = rd_int(0, DSV4_SPEC_TOKENS_MAX);
        const int snapshots = rd_int(0, 2) ? rd_int(0, 4) : rd_int(8, 40);
        const bool with_oracle = spec > 0 && rd_int(0, 1);
        struct dsv4_backend_opts bo = { .max_batch = max_batch, .max_context = rd_ctx, .numerics = rd_num,
                                        .threads = rd_int(1, 2), .spec_tokens = spec,
                                        .prefix_pool_bytes = snapshots * (g.block_pages + g.boundary_pages) *
                                                             g.page_bytes };
        struct env e = { .w = w };
        if (dsv4_backend_cpu_create(w, &bo, &e.b) < 0)
            fail_msg("cpu backend: %s", dsv4_error_message());
        if (with_oracle)
            rd_wrap(e.b);
        struct dsv4_sched_limits lim = { .prefill_budget = rd_int(0, 2) ? rd_int(1, 40) : 0,
                                         .sampler_threads = rd_int(1, 3), .max_requests = RD_REQS,
                                         .max_unreleased = RD_REQS, .max_output_bytes = rd_bytes,
                                         .detok = { letter_bytes, NULL } };
        print_message("# round %d: %s, %s numerics, %d backend threads, max_context %d, max_output_bytes %d, "
                      "max_batch %d, spec_tokens %d%s, pool of %d snapshots, prefill_budget %d, %d sampler "
                      "threads\n", round, models[model], rd_num == DSV4_NUMERICS_FP8 ? "fp8" : "exact", bo.threads,
                      rd_ctx, rd_bytes, max_batch, spec, with_oracle ? " (drafts 3/4 right)" : "", snapshots,
                      lim.prefill_budget, lim.sampler_threads);
        if (dsv4_sched_create(e.b, NULL, &lim, &e.s) < 0)
            fail_msg("scheduler: %s", dsv4_error_message());
        struct dsv4_sched_stats st0;
        dsv4_sched_get_stats(e.s, &st0);
        memset(got, 0, sizeof(got));
        int finished = 0;
        for (int step = 0; finished < RD_REQS; step++) {
            assert_true(step < 20000);
            for (int i = 0; i < RD_REQS; i++) {
                if (rq[i].submit_step == step)
                    rd_submit(e.s, &rq[i], &got[i]);
                if (rq[i].cancel_step == step && !got[i].a.finished) {
                    assert_int_equal(dsv4_sched_cancel(e.s, got[i].a.id), 0);
                    got[i].cancel_asked = true;
                }
            }
            assert_true(dsv4_sched_step(e.s) >= 0);
            rd_collect(e.s);
            finished = 0;
            for (int i = 0; i < RD_REQS; i++)
                finished += got[i].a.finished;
        }
        for (int i = 0; i < RD_REQS; i++) {
            char what[96];
            const struct rd_answer *x = &got[i], *y = &alone[i];
            snprintf(what, sizeof(what), "round %d, request %d (%d prompt tokens, %d cached)", round, i,
                     rq[i].n_prompt, x->a.cached_tokens);
            if (x->a.finish == DSV4_FINISH_CANCELLED) {
                assert_true(x->cancel_asked);
                assert_true(x->a.n <= y->a.n);
                struct answer part = y->a;
                part.n = x->a.n;
                answer_expect_same(&x->a, &part, what);
                continue;
            }
            answer_expect_same(&x->a, &y->a, what);
            if (x->a.finish != y->a.finish || x->text_len != y->text_len ||
                memcmp(x->text, y->text, y->text_len) || x->stop_string != y->stop_string ||
                x->stop_token != y->stop_token)
                fail_msg("%s: finish %s, stop %d/%d, text \"%.*s\"; alone: finish %s, stop %d/%d, text \"%.*s\"",
                         what, dsv4_finish_reason_name(x->a.finish), x->stop_string, x->stop_token,
                         (int)x->text_len, x->text, dsv4_finish_reason_name(y->a.finish), y->stop_string,
                         y->stop_token, (int)y->text_len, y->text);
        }
        struct dsv4_sched_stats st;
        dsv4_sched_get_stats(e.s, &st);
        assert_int_equal(st.slots_in_use, 0);
        assert_int_equal(st.queued, 0);
        assert_int_equal(st.unreleased, 0);
        assert_int_equal(st.events_pending, 0);
        assert_int_equal(st.allocations, st0.allocations);
        assert_int_equal(st.submitted, RD_REQS);
        if (st.prefix_cache)
            assert_true(st.prefix.pages_used <= st.prefix.pages_total);
        print_message("# %llu verifies with drafts, %llu of %llu drafts accepted; prefix: %llu hits of %llu "
                      "lookups, %llu boundaries evicted\n", (unsigned long long)st.spec_steps,
                      (unsigned long long)st.spec_accepted, (unsigned long long)st.spec_drafted,
                      (unsigned long long)st.prefix.hits, (unsigned long long)st.prefix.lookups,
                      (unsigned long long)st.prefix.boundaries_evicted);
        dsv4_sched_destroy(e.s);
        if (e.b->ops == &rdo.ops)
            e.b->ops = rdo.inner;
        dsv4_backend_destroy(e.b);
    }
    dsv4_weights_free(ws[0]);
    dsv4_weights_free(ws[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_identical),
        cmocka_unit_test(test_seeded_identical),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_failures),
        cmocka_unit_test(test_no_mtp),
        cmocka_unit_test(test_random_differential),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
