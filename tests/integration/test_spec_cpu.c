/* SPDX-License-Identifier: MIT */
/* The MTP block and speculative rows on the CPU backend, over every fixture with an MTP block
 * (tests/fixtures/<model>_mtp/cases_mtp.json, tools/mkfixtures_mtp.py):
 *
 * oracle: dsv4_cpu_mtp_forward fed the main model's streams of each position p and the token at p + 1
 *   matches the PyTorch MTP block row by row (max |diff| / max |logit| <= 1e-4), with the same argmax
 *   wherever the reference's top two are apart (>= 1e-3 x max |logit|);
 * drafts: with speculation on, a draft's first token is the argmax of that same MTP row (the catch-up
 *   feeding during prefill and verify puts the block where a direct run puts it);
 * rollback: a sequence driven through drafts and verifies with rows rejected at random (real drafts,
 *   wrong tokens, every k from 0 to 3, rollbacks across window wraps and compressor block ends) keeps
 *   rows' logits bitwise those of a sequence fed the accepted tokens one at a time, and after every
 *   accept its whole state (positions, every window ring, compressor rows and overlap state, compressed
 *   entries and indexer keys over all of max_context, the MTP window, the streams) is bitwise that
 *   sequence's. Both numerics. */
#include "build-config.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <jansson.h>

#include "engine/backend.h"
#include "engine/cpu/cpu_forward.h"
#include "engine/error.h"
#include "engine/model/weights.h"
#include "tests/integration/fixture_cases.h"
#include "tools/greedy.h"

#define MTP_TOL 1e-4
#define MTP_GAP_REL 1e-3
#define ROLLBACK_SEED 0x5eedULL

struct mtp_case {
    int32_t *tokens;    /* [n] */
    int n;
    float *ref;         /* [n - 1, V] */
};

static int load_mtp_cases(const char *dir, int V, struct mtp_case **ret)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/cases_mtp.json", dir);
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root)
        fail_msg("%s:%d: %s", path, err.line, err.text);
    int n = (int)json_array_size(root);
    assert_true(n > 0);
    struct mtp_case *cs = calloc((size_t)n, sizeof(*cs));
    assert_non_null(cs);
    for (int i = 0; i < n; i++) {
        json_t *c = json_array_get(root, (size_t)i), *toks = json_object_get(c, "tokens");
        struct mtp_case *mc = &cs[i];
        mc->n = (int)json_array_size(toks);
        assert_int_equal(json_integer_value(json_object_get(c, "rows")), mc->n - 1);
        assert_int_equal(json_integer_value(json_object_get(c, "vocab")), V);
        mc->tokens = malloc(sizeof(int32_t) * (size_t)mc->n);
        mc->ref = malloc(sizeof(float) * (size_t)(mc->n - 1) * (size_t)V);
        assert_true(mc->tokens && mc->ref);
        for (int t = 0; t < mc->n; t++)
            mc->tokens[t] = (int32_t)json_integer_value(json_array_get(toks, (size_t)t));
        snprintf(path, sizeof(path), "%s/%s", dir, json_string_value(json_object_get(c, "logits")));
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        size_t want = (size_t)(mc->n - 1) * (size_t)V;
        assert_int_equal(fread(mc->ref, sizeof(float), want, f), want);
        assert_int_equal(fgetc(f), EOF);
        fclose(f);
    }
    json_decref(root);
    *ret = cs;
    return n;
}

/* (top1 - top2) / max |logit| of a row. */
static double top_gap(const float *row, int V)
{
    float a = -INFINITY, b = -INFINITY, mag = 0.0f;
    for (int v = 0; v < V; v++) {
        if (row[v] > a) {
            b = a;
            a = row[v];
        } else if (row[v] > b) {
            b = row[v];
        }
        mag = fmaxf(mag, fabsf(row[v]));
    }
    return (double)(a - b) / mag;
}

static void check_oracle(const struct dsv4_weights *w, const struct mtp_case *mc, const char *dir)
{
    int V = w->cfg.vocab_size;
    struct dsv4_cpu_seq *s;
    assert_int_equal(dsv4_cpu_seq_create(w, mc->n, &s), 0);
    float *row = malloc(sizeof(float) * (size_t)V);
    assert_non_null(row);
    double worst = 0.0;
    int compared = 0;
    for (int p = 0; p + 1 < mc->n; p++) {
        assert_int_equal(dsv4_cpu_forward(w, DSV4_NUMERICS_EXACT, s, &mc->tokens[p], 1, NULL, false), 0);
        assert_int_equal(dsv4_cpu_mtp_forward(w, DSV4_NUMERICS_EXACT, s, s->streams, mc->tokens[p + 1], row), 0);
        const float *ref = mc->ref + (size_t)p * V;
        double e = fx_row_error(row, ref, V);
        if (!(e <= MTP_TOL))
            fail_msg("%s: MTP row %d differs from the oracle by %.3g (bound %g)", dir, p, e, MTP_TOL);
        worst = fmax(worst, e);
        if (top_gap(ref, V) >= MTP_GAP_REL) {
            assert_int_equal(dsv4_greedy_argmax(row, V), dsv4_greedy_argmax(ref, V));
            compared++;
        }
    }
    assert_true(compared > (mc->n - 1) / 2);
    print_message("# %s: %d MTP rows, worst %.3g, argmax agrees on %d clear rows\n", dir, mc->n - 1, worst,
                  compared);
    free(row);
    dsv4_cpu_seq_free(s);
}

/* With speculation on: prefill a prompt, then at each position draft from the next token and verify it
 * alone; the first draft is the oracle row's argmax. */
static void check_drafts(const struct dsv4_weights *w, const struct mtp_case *mc)
{
    int V = w->cfg.vocab_size;
    struct dsv4_cpu_seq *s;
    assert_int_equal(dsv4_cpu_seq_create(w, mc->n, &s), 0);
    assert_int_equal(dsv4_cpu_seq_spec_init(w, s, DSV4_SPEC_TOKENS_MAX), 0);
    float *rows = malloc(sizeof(float) * (size_t)V);
    assert_non_null(rows);
    int prompt = mc->n / 3;
    assert_int_equal(dsv4_cpu_forward(w, DSV4_NUMERICS_EXACT, s, mc->tokens, prompt, NULL, false), 0);
    int clear = 0;
    for (int P = prompt; P + 1 < mc->n; P++) {
        int32_t drafts[DSV4_SPEC_TOKENS_MAX];
        int k = -1;
        assert_int_equal(dsv4_cpu_draft(w, DSV4_NUMERICS_EXACT, s, mc->tokens[P], 1, drafts, &k), 0);
        assert_int_equal(k, 1);
        const float *ref = mc->ref + (size_t)(P - 1) * V;
        if (top_gap(ref, V) >= MTP_GAP_REL) {
            assert_int_equal(drafts[0], dsv4_greedy_argmax(ref, V));
            clear++;
        }
        assert_int_equal(dsv4_cpu_verify(w, DSV4_NUMERICS_EXACT, s, &mc->tokens[P], 1, rows), 0);
        assert_int_equal(dsv4_cpu_accept(s, 1), 0);
        assert_int_equal(s->pos, P + 1);
    }
    assert_true(clear > 0);
    free(rows);
    dsv4_cpu_seq_free(s);
}

static void same_bytes(const void *a, const void *b, size_t bytes, const char *what, int layer, int64_t pos)
{
    if (memcmp(a, b, bytes) != 0)
        fail_msg("after accept at position %lld: %s of layer %d differs", (long long)pos, what, layer);
}

static void same_comp(const struct dsv4_compressor *cp, const struct dsv4_cpu_comp_state *a,
                      const struct dsv4_cpu_comp_state *b, int layer, int64_t pos)
{
    size_t width = (size_t)(cp->overlap ? 2 : 1) * (size_t)cp->dim;
    same_bytes(a->kv, b->kv, (size_t)cp->ratio * width * sizeof(float), "compressor kv rows", layer, pos);
    same_bytes(a->gate, b->gate, (size_t)cp->ratio * width * sizeof(float), "compressor gate rows", layer, pos);
    if (!cp->overlap)
        return;
    size_t half = (size_t)cp->ratio * (size_t)cp->dim * sizeof(float);
    same_bytes(a->prev_kv, b->prev_kv, half, "compressor prev_kv", layer, pos);
    same_bytes(a->prev_gate, b->prev_gate, half, "compressor prev_gate", layer, pos);
    assert_int_equal(a->have_prev, b->have_prev);
}

/* Every byte a later token can read. */
static void same_state(const struct dsv4_weights *w, const struct dsv4_cpu_seq *a, const struct dsv4_cpu_seq *b)
{
    const struct dsv4_config *cfg = &w->cfg;
    assert_int_equal(a->pos, b->pos);
    assert_int_equal(a->mtp_pos, b->mtp_pos);
    size_t ring = (size_t)cfg->window * (size_t)cfg->head_dim * sizeof(float);
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct dsv4_layer *ly = &w->layers[l];
        same_bytes(a->layers[l].window, b->layers[l].window, ring, "window ring", l, a->pos);
        if (!ly->ratio)
            continue;
        size_t entries = (size_t)(a->max_context / ly->ratio);
        same_bytes(a->layers[l].entries, b->layers[l].entries, entries * (size_t)cfg->head_dim * sizeof(float),
                   "compressed entries", l, a->pos);
        same_comp(&ly->attn.comp, &a->layers[l].comp, &b->layers[l].comp, l, a->pos);
        if (!a->layers[l].index_keys)
            continue;
        same_bytes(a->layers[l].index_keys, b->layers[l].index_keys,
                   entries * (size_t)cfg->index_head_dim * sizeof(float), "indexer keys", l, a->pos);
        same_comp(&ly->attn.indexer.comp, &a->layers[l].index_comp, &b->layers[l].index_comp, l, a->pos);
    }
    same_bytes(a->mtp_layer.window, b->mtp_layer.window, ring, "MTP window ring", -1, a->pos);
    same_bytes(a->streams, b->streams, (size_t)cfg->hc_mult * (size_t)cfg->dim * sizeof(float), "streams", -1,
               a->pos);
}

static uint64_t next_rand(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

struct rollback_counts {
    int steps, rows, rejected, kept_all;
};

/* s speculates over the case's tokens with random rejections; ref is fed only the accepted tokens. */
static void check_rollback(const struct dsv4_weights *w, enum dsv4_numerics num, const struct mtp_case *mc,
                           uint64_t seed, struct rollback_counts *cnt)
{
    int V = w->cfg.vocab_size, S = DSV4_SPEC_TOKENS_MAX;
    struct dsv4_cpu_seq *s, *ref;
    assert_int_equal(dsv4_cpu_seq_create(w, mc->n, &s), 0);
    assert_int_equal(dsv4_cpu_seq_create(w, mc->n, &ref), 0);
    assert_int_equal(dsv4_cpu_seq_spec_init(w, s, S), 0);
    assert_int_equal(dsv4_cpu_seq_spec_init(w, ref, S), 0);
    float *got = malloc(sizeof(float) * (size_t)(S + 1) * (size_t)V);
    float *want = malloc(sizeof(float) * (size_t)V);
    assert_true(got && want);
    uint64_t x = seed;
    int prompt = 1 + (int)(next_rand(&x) % 7);
    assert_int_equal(dsv4_cpu_forward(w, num, s, mc->tokens, prompt, NULL, false), 0);
    assert_int_equal(dsv4_cpu_forward(w, num, ref, mc->tokens, prompt, NULL, false), 0);
    int P = prompt;
    while (P < mc->n) {
        int room = mc->n - P - 1;
        int k = (int)(next_rand(&x) % (S + 1));
        k = k < room ? k : room;
        int32_t drafts[DSV4_SPEC_TOKENS_MAX], rows[DSV4_SPEC_TOKENS_MAX + 1];
        int made = 0;
        assert_int_equal(dsv4_cpu_draft(w, num, s, mc->tokens[P], k, drafts, &made), 0);
        assert_int_equal(made, k);
        /* Row j > 0: the true token, the draft, or a wrong one; the kept rows are the leading true ones. */
        rows[0] = mc->tokens[P];
        int keep = 1;
        bool leading = true;
        for (int j = 1; j <= k; j++) {
            uint64_t r = next_rand(&x) % 4;
            rows[j] = r == 0 ? drafts[j - 1] : r == 1 ? (mc->tokens[P + j] + 1 + (int32_t)(next_rand(&x) % (uint64_t)(V - 1))) % V
                                                      : mc->tokens[P + j];
            leading = leading && rows[j] == mc->tokens[P + j];
            keep += leading;
        }
        assert_int_equal(dsv4_cpu_verify(w, num, s, rows, k + 1, got), 0);
        for (int j = 0; j < keep; j++) {
            assert_int_equal(dsv4_cpu_forward(w, num, ref, &mc->tokens[P + j], 1, want, false), 0);
            if (memcmp(got + (size_t)j * V, want, sizeof(float) * (size_t)V) != 0)
                fail_msg("position %d: verified row %d differs from the plain forward", P + j, j);
        }
        assert_int_equal(dsv4_cpu_accept(s, keep), 0);
        same_state(w, s, ref);
        cnt->steps++;
        cnt->rows += k + 1;
        cnt->rejected += k + 1 - keep;
        cnt->kept_all += keep == k + 1 && k > 0;
        P += keep;
    }
    free(got);
    free(want);
    dsv4_cpu_seq_free(s);
    dsv4_cpu_seq_free(ref);
}

/* Calls out of order are refused and leave the sequence usable. */
static void check_misuse(const struct dsv4_weights *w, const struct mtp_case *mc)
{
    struct dsv4_cpu_seq *s;
    int32_t d[DSV4_SPEC_TOKENS_MAX];
    int k;
    float *lg = malloc(sizeof(float) * (size_t)(DSV4_SPEC_TOKENS_MAX + 2) * (size_t)w->cfg.vocab_size);
    assert_non_null(lg);
    assert_int_equal(dsv4_cpu_seq_create(w, mc->n, &s), 0);
    assert_int_equal(dsv4_cpu_verify(w, DSV4_NUMERICS_EXACT, s, mc->tokens, 1, lg), -ENOTSUP);
    assert_int_equal(dsv4_cpu_seq_spec_init(w, s, DSV4_SPEC_TOKENS_MAX + 1), -EINVAL);
    assert_int_equal(dsv4_cpu_seq_spec_init(w, s, 2), 0);
    assert_int_equal(dsv4_cpu_seq_spec_init(w, s, 2), -EBUSY);
    assert_int_equal(dsv4_cpu_accept(s, 1), -EINVAL);
    /* at position 0 the block has nothing to draft from */
    assert_int_equal(dsv4_cpu_draft(w, DSV4_NUMERICS_EXACT, s, mc->tokens[0], 2, d, &k), 0);
    assert_int_equal(k, 0);
    assert_int_equal(dsv4_cpu_draft(w, DSV4_NUMERICS_EXACT, s, mc->tokens[0], 3, d, &k), -EINVAL);
    assert_int_equal(dsv4_cpu_verify(w, DSV4_NUMERICS_EXACT, s, mc->tokens, 4, lg), -EINVAL);
    assert_int_equal(dsv4_cpu_verify(w, DSV4_NUMERICS_EXACT, s, mc->tokens, 3, lg), 0);
    assert_int_equal(dsv4_cpu_forward(w, DSV4_NUMERICS_EXACT, s, mc->tokens, 1, NULL, false), -EBUSY);
    assert_int_equal(dsv4_cpu_accept(s, 0), -EINVAL);
    assert_int_equal(dsv4_cpu_accept(s, 4), -EINVAL);
    assert_int_equal(dsv4_cpu_accept(s, 2), 0);
    assert_int_equal(s->pos, 2);
    assert_int_equal(dsv4_cpu_accept(s, 1), -EINVAL);
    /* a reset drops a verify in flight */
    assert_int_equal(dsv4_cpu_verify(w, DSV4_NUMERICS_EXACT, s, mc->tokens + 2, 2, lg), 0);
    dsv4_cpu_seq_reset(s);
    assert_int_equal(dsv4_cpu_forward(w, DSV4_NUMERICS_EXACT, s, mc->tokens, 1, NULL, false), 0);
    free(lg);
    dsv4_cpu_seq_free(s);
}

static void test_mtp_fixture(void **state)
{
    const char *dir = *state;
    struct dsv4_weights *w;
    if (dsv4_weights_load(dir, &w) < 0)
        fail_msg("%s: %s", dir, dsv4_error_message());
    assert_int_equal(w->n_mtp, 1);
    assert_int_equal(w->n_unused, 0);
    struct mtp_case *cs;
    int n = load_mtp_cases(dir, w->cfg.vocab_size, &cs);
    for (int i = 0; i < n; i++) {
        check_oracle(w, &cs[i], dir);
        check_drafts(w, &cs[i]);
        for (int num = 0; num < 2; num++) {
            struct rollback_counts cnt = {0};
            for (uint64_t r = 0; r < 3; r++)
                check_rollback(w, num ? DSV4_NUMERICS_FP8 : DSV4_NUMERICS_EXACT, &cs[i], ROLLBACK_SEED + 977 * r + i,
                               &cnt);
            print_message("# %s case %d %s: %d steps, %d rows, %d rejected, %d with every draft kept\n", dir, i,
                          num ? "fp8" : "exact", cnt.steps, cnt.rows, cnt.rejected, cnt.kept_all);
            assert_true(cnt.rejected > 0 && cnt.kept_all > 0);
        }
    }
    check_misuse(w, &cs[0]);
    for (int i = 0; i < n; i++) {
        free(cs[i].tokens);
        free(cs[i].ref);
    }
    free(cs);
    dsv4_weights_free(w);
}

int main(int argc, char **argv)
{
    (void)argc;
    return fx_main(argv[0], "spec_cpu", "cases_mtp.json", test_mtp_fixture);
}
