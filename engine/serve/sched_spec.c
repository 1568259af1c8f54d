/* SPDX-License-Identifier: MIT */
/* Speculative decoding in the scheduler (engine/serve/sched_internal.h): drafts, one verify, the
 * rows sampled as plain decode samples them, accept. */
#include "build-config.h"

#include <string.h>

#include "engine/serve/sched_internal.h"

/* Drafts worth asking for q at this step: what its output, its context and (while its state is being
 * snapshotted) its next block boundary leave room for. A verify of k drafts feeds k + 1 rows at
 * positions P..P+k and can give k + 1 tokens. */
static int spec_room(const struct dsv4_sched *s, const struct sched_req *q)
{
    int k = s->spec;
    int out_left = q->max_tokens - q->result.n_tokens - 1;
    int64_t ctx_left = (int64_t)s->max_context - q->position - 1;
    if (k > out_left)
        k = out_left;
    if (k > ctx_left)
        k = (int)ctx_left;
    if (q->caching) {
        int to_boundary = s->block - (int)(q->position % s->block) - 1;
        if (k > to_boundary)
            k = to_boundary;
    }
    return k > 0 ? k : 0;
}

/* The decode of n rows (dec_reqs, dec_slots, dec_tokens) with drafts. Each row's slot gets drafts from
 * the backend's MTP block, then one verify feeds the pending token and the drafts; the rows' logits
 * are sampled in order, exactly as plain decode would sample them (same history, same seed and
 * output index), and a draft is accepted when the token sampled before it equals it. That is the
 * rejection rule for a draft that is certain (the MTP block's greedy pick): accepted with probability
 * p(draft), and on rejection the token comes from p without the draft, renormalized. Sampling with
 * the same Philox draw as plain decode makes the tokens identical to decoding without drafts, so the
 * output never depends on the drafts, the batch or the prefix cache: only the speed does. The first
 * rejected (or finishing) row ends the slot's step; accept() takes back the rows after it. */
void sched_spec_decode(struct dsv4_sched *s, int n)
{
    struct dsv4_backend *b = s->backend;
    int S = s->spec, V = s->vocab;
    for (int k = 0; k < n; k++)
        s->spec_k[k] = spec_room(s, &s->reqs[s->dec_reqs[k]]);
    uint64_t t0 = sched_now_ns();
    int r = b->ops->draft(b, n, s->dec_slots, s->dec_tokens, s->spec_k, s->spec_drafts, s->spec_made);
    sched_backend_time(s, t0);
    if (sched_backend_fatal(s, r, "draft"))
        return;
    for (int k = 0; k < n; k++) {
        if (r < 0)
            s->spec_made[k] = 0;    /* a failed draft costs speed only */
        int32_t *row = s->spec_rows + (size_t)k * (size_t)(S + 1);
        row[0] = s->dec_tokens[k];
        memcpy(row + 1, s->spec_drafts + (size_t)k * (size_t)S, (size_t)s->spec_made[k] * sizeof(int32_t));
        s->spec_k[k] = s->spec_made[k] + 1;     /* from here on: the rows of each verify */
    }
    t0 = sched_now_ns();
    r = b->ops->verify(b, n, s->dec_slots, s->spec_k, s->spec_rows, s->logits);
    sched_backend_time(s, t0);
    if (sched_backend_fatal(s, r, "verify"))
        return;
    for (int k = 0; k < n; k++) {
        struct sched_req *q = &s->reqs[s->dec_reqs[k]];
        if (r < 0) {
            sched_fail_request(s, q, r, "verify");
            continue;
        }
        if (q->done)
            continue;
        const int32_t *draft = s->spec_rows + (size_t)k * (size_t)(S + 1) + 1;
        int rows = s->spec_k[k], made = rows - 1, accepted = 0;
        for (int j = 0; j < rows; j++) {
            const float *lg = s->logits + ((size_t)k * (size_t)(S + 1) + (size_t)j) * (size_t)V;
            struct dsv4_sample smp;
            if (sched_sample(s, q, lg, &smp) < 0)
                break;
            /* Row j's input is kept: its position is fed, as plain decode would have fed it. */
            if (j == rows - 1 || smp.token != draft[j]) {
                const int keep = j + 1;
                t0 = sched_now_ns();
                r = b->ops->accept(b, q->slot, keep);
                sched_backend_time(s, t0);
                if (sched_backend_fatal(s, r, "accept"))
                    return;
                if (r < 0) {
                    sched_fail_request(s, q, r, "accept");
                    break;
                }
                q->position += keep;
                if (q->caching)
                    sched_prefix_advance(s, q);
                if (!q->done)
                    sched_take_token(s, q, &smp);
                break;
            }
            accepted++;
            sched_take_token(s, q, &smp);
            if (q->done)
                break;      /* finished on an accepted draft: the slot is reset, nothing to accept */
        }
        if (made > 0) {
            s->step_spec.steps++;
            s->step_spec.drafted += (uint64_t)made;
            s->step_spec.accepted += (uint64_t)accepted;
            s->step_spec.hist[accepted]++;
        }
    }
}
