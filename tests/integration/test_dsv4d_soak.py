#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A soak of dsv4d with everything on at once: speculative decoding (spec_tokens 3, the default model's
trained MTP block), the prefix cache (prompts share 64- and 128-token prefixes, the model's block
being 64), prefill in small chunks beside decoding streams (decode_stall_ms 1), a full batch, and
clients that stream, cancel, drop their connection mid-stream and send bad requests, from CLIENTS
threads at once.

The oracle is a second dsv4d on the same model with neither speculation nor the prefix cache, asked
each distinct request once: every request the soak lets finish must give exactly its tokens (same
seed, prompt and parameters give the same tokens whatever the batch, the drafts or the cache), a
cancelled one a prefix of them. At the end nothing is left busy or queued, the counters add up, the
scheduler allocated nothing after boot, and dsv4d exits 0.

DSV4_SOAK_REQUESTS sets the soak's request count (default 240, a minute or two; CI runs it under the
sanitizers too); DSV4_SOAK_SEED the choice of requests (printed)."""

import os
import random
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsv4d_harness import (TIMEOUT, TOP_SRCDIR, Client, Closed, Daemon, Tap, bin_tokens, generate_all,  # noqa: E402
                           tokens_bin)

MODEL = os.path.join(TOP_SRCDIR, "models", "default-fp8")
REQUESTS = int(os.environ.get("DSV4_SOAK_REQUESTS", "240"))
SEED = int(os.environ.get("DSV4_SOAK_SEED", str(random.randrange(1 << 30))))
CLIENTS = 8
DISTINCT = 24           # distinct requests the soak draws from
VOCAB = 1536            # the default model's
BLOCK = 64              # its prefix-cache block: lcm(window 64, compress ratios 4 and 16)
ARGS = ["--max-batch", "4", "--max-context", "256", "--numerics", "fp8"]


def make_requests(rng):
    """DISTINCT generate params: prompts of 70-150 tokens over three shared 128-token stems (so the
    cache holds 64- and 128-token prefixes), greedy or seeded sampling, 4 to 40 new tokens."""
    stems = [[0] + [rng.randrange(2, VOCAB) for _ in range(2 * BLOCK - 1)] for _ in range(3)]
    reqs = []
    for i in range(DISTINCT):
        stem = stems[i % 3][:BLOCK if i % 2 else 2 * BLOCK]
        prompt = stem + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(6, 150 - len(stem) + 7))]
        p = {"tokens": tokens_bin(prompt), "max_tokens": rng.randrange(4, 41)}
        if i % 3 == 0:
            p["temperature"] = 0.0
        else:
            p.update({"temperature": 0.9, "top_p": 0.95, "seed": rng.randrange(1 << 32)})
            if i % 4 == 1:
                p["repetition_penalty"] = 1.2
        reqs.append(p)
    return reqs


def references(t, reqs):
    """Each request's tokens from a dsv4d with no speculation and no prefix cache."""
    d = Daemon(args=ARGS + ["--spec-tokens", "0", "--prefix-cache", "0"], model=MODEL, tokenizer=False)
    try:
        if not t.ok(d.start(), "reference dsv4d (no speculation, no prefix cache) is ready", d.log_text()):
            return None
        c = Client(d.sock_path)
        out = [None if err else bin_tokens(res["tokens"]) for err, res in generate_all(c, reqs, 8)]
        c.close()
        t.ok(all(o is not None for o in out), "the reference answers all %d requests" % len(reqs))
        t.eq(d.stop(), 0, "reference dsv4d exits 0")
        return out
    finally:
        d.close()


class Soak:
    def __init__(self, path, reqs, refs):
        self.path, self.reqs, self.refs = path, reqs, refs
        self.lock = threading.Lock()
        self.problems = []
        self.kinds = {"plain": 0, "stream": 0, "cancel": 0, "drop": 0, "bad": 0}
        self.finished = 0       # generate results received (any finish_reason)

    def problem(self, what):
        with self.lock:
            self.problems.append(what)

    def count(self, kind):
        with self.lock:
            self.kinds[kind] += 1

    def check_tokens(self, i, kind, res, cancelled_ok):
        got, want = bin_tokens(res["tokens"]), self.refs[i]
        fr = res["finish_reason"]
        with self.lock:
            self.finished += 1
        if fr == "cancelled" and cancelled_ok:
            if got != want[:len(got)]:
                self.problem("request %d (%s, cancelled): %s is not a prefix of %s" % (i, kind, got, want))
        elif fr not in ("stop", "length") or got != want:
            self.problem("request %d (%s): finish %s, %s != %s" % (i, kind, fr, got, want))

    def stream_tokens(self, c, mid, stop_after=None, cancel=False):
        """Follow mid's token notifications; after stop_after of them cancel (cancel) or return None
        (the caller drops the connection). Returns (streamed ids, error, result)."""
        streamed, sent_cancel, cid = [], False, None
        while True:
            m = c.recv()
            if m[0] == 2 and m[1] == "token" and m[2][0]["msgid"] == mid:
                streamed.append(m[2][0]["token"])
                if stop_after is not None and len(streamed) >= stop_after:
                    if not cancel:
                        return streamed, None, None
                    if not sent_cancel:
                        cid = c.request("cancel", {"msgid": mid})
                        sent_cancel = True
            elif m[0] == 1 and m[1] == mid:
                if cid is not None:     # the cancel's own answer comes after, or came before: drain it
                    while True:
                        a = c.recv()
                        if a[0] == 1 and a[1] == cid:
                            break
                return streamed, m[2], m[3]
            elif m[0] == 1 and m[1] == cid:
                cid = None
                if m[2] is not None:
                    self.problem("cancel of %d answered error %s" % (mid, m[2]))

    def worker(self, wid, n):
        rng = random.Random(SEED * 1000 + wid)
        c = Client(self.path)
        try:
            for _ in range(n):
                i = rng.randrange(len(self.reqs))
                kind = rng.choice(["plain", "plain", "stream", "stream", "cancel", "drop", "bad"])
                self.count(kind)
                p = dict(self.reqs[i])
                if kind == "plain":
                    err, res = c.call("generate", p)
                    if err:
                        self.problem("request %d (plain): error %s" % (i, err))
                    else:
                        self.check_tokens(i, kind, res, False)
                elif kind in ("stream", "cancel"):
                    cancel = kind == "cancel"
                    p["stream"] = True
                    mid = c.request("generate", p)
                    streamed, err, res = self.stream_tokens(c, mid, stop_after=rng.randrange(1, 4) if cancel else None,
                                                            cancel=cancel)
                    if err:
                        self.problem("request %d (%s): error %s" % (i, kind, err))
                        continue
                    self.check_tokens(i, kind, res, cancel)
                    if streamed != bin_tokens(res["tokens"]):
                        self.problem("request %d (%s): streamed %s, result %s" % (i, kind, streamed,
                                                                                bin_tokens(res["tokens"])))
                elif kind == "drop":
                    p["stream"] = True
                    mid = c.request("generate", p)
                    self.stream_tokens(c, mid, stop_after=rng.randrange(1, 3))
                    c.sock.shutdown(socket.SHUT_RDWR)      # abruptly, with the generation in flight
                    c.close()
                    c = Client(self.path)
                else:
                    p["temperature"] = -1.0
                    err, _ = c.call("generate", p)
                    if not err:
                        self.problem("request %d (bad): temperature -1 was accepted" % i)
        except (Closed, OSError) as e:
            self.problem("worker %d: connection failed: %r" % (wid, e))
        finally:
            c.close()


def main():
    t = Tap()
    if not os.path.exists(os.path.join(MODEL, "model.safetensors")):
        t.skip_all("models/default-fp8 is not there")
        return
    print("# seed %d (DSV4_SOAK_SEED reproduces), %d requests from %d clients" % (SEED, REQUESTS, CLIENTS),
          flush=True)
    reqs = make_requests(random.Random(SEED))
    refs = references(t, reqs)
    if refs is None or any(r is None for r in refs):
        t.done()
        return
    # decode_stall_ms 1: while streams decode, prompts advance in small chunks of whatever size the
    # measured rate gives, which the answers must not notice either
    d = Daemon(args=ARGS + ["--spec-tokens", "3", "--prefix-cache", "16M", "--decode-stall-ms", "1"], model=MODEL,
               tokenizer=False)
    try:
        if not t.ok(d.start(), "soak dsv4d (spec_tokens 3, prefix cache) is ready", d.log_text()):
            t.done()
            return
        s = Soak(d.sock_path, reqs, refs)
        threads = [threading.Thread(target=s.worker, args=(w, REQUESTS // CLIENTS)) for w in range(CLIENTS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print("# requests by kind: %s; %d results checked" % (s.kinds, s.finished), flush=True)
        t.ok(not s.problems, "every finished request gave the reference's tokens, every cancelled one a prefix "
             "of them, streams matched results, bad requests were refused", "\n".join(s.problems[:40]))
        t.ok(s.finished >= REQUESTS // 3, "at least a third of the requests ran to a result (%d)" % s.finished)
        # A dropped connection's request ends when dsv4d sees the hang-up, a step or so after the client
        # is gone: wait for that, bounded.
        c = Client(d.sock_path)
        deadline = time.monotonic() + TIMEOUT
        while True:
            err, st = c.call("stats")
            settled = err is None and st["slots_busy"] == 0 and st["queue_depth"] == 0
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        c.close()
        t.ok(settled, "nothing busy or queued at the end", st)
        if err is None:
            print("# stats: %d requests, %d cancelled, %d failed; prefix cache %d hits of %d lookups (%d tokens); "
                  "spec %d of %d drafts accepted" % (st["requests_total"], st["requests_cancelled"],
                                                     st["requests_failed"], st["prefix_cache_hits"],
                                                     st["prefix_cache_lookups"], st["prefix_cache_hit_tokens"],
                                                     st["spec_accepted"], st["spec_drafted"]), flush=True)
            ran = s.kinds["plain"] + s.kinds["stream"] + s.kinds["cancel"] + s.kinds["drop"]
            t.ok(st["requests_total"] >= ran and st["prefix_cache_hits"] > 0 and st["spec_accepted"] > 0 and
                 sum(st["spec_accept_hist"]) == st["spec_verifies"],
                 "the counters add up: every request counted, prefixes restored, drafts accepted", st)
            t.eq(st["sched_allocations_after_boot"], 0, "the scheduler allocated nothing after boot")
        t.eq(d.stop(), 0, "soak dsv4d exits 0")
    finally:
        d.close()
    t.done()


if __name__ == "__main__":
    main()
