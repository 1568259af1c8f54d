#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The protocol end to end, spoken by the PyPI msgpack package (independent of the daemon's
msgpack-c): hello, tokenize, detokenize, generate (blocking and streamed), greedy tokens equal to
dsv4-run's, seeds, logprobs, stop ids, cancel, 16 concurrent clients, a client killed mid-stream,
stats, health, and every configured limit with its own error code."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from dsv4d_harness import (BOS, BYTE_BASE, EOS, FIXTURE_VOCAB, LONG_PROMPT, TIMEOUT, Client, Closed, Daemon, Tap,
                           bin_tokens, run_dsv4_run, text_tokens, tokens_bin, write_tokenizer)

import msgpack  # after the harness, which skips the test when it is missing

t = Tap()
USER, ASSISTANT, THINK_START, THINK_END = 2, 3, 4, 5
PROMPTS = [[BOS] + text_tokens("The capital of France is"), [BOS, 7, 8, 9, 200, 201],
           [BOS] + text_tokens("17*23=")]


def greedy(c, prompt, n, **extra):
    params = {"tokens": tokens_bin(prompt), "max_tokens": n, "temperature": 0.0}
    params.update(extra)
    return c.call("generate", params)


def stream(c, params):
    """(deltas, token ids, error, result) of a streamed generate."""
    deltas, ids = [], []
    mid = c.request("generate", dict(params, stream=True))

    def note(m):
        if m[0] == 2 and m[1] == "token" and m[2][0]["msgid"] == mid:
            deltas.append(m[2][0]["text"])
            ids.append(m[2][0]["token"])
    err, res = c.response(mid, on_notification=note)
    return deltas, ids, err, res


d = Daemon(args=["--max-context", "4096", "--max-batch", "4"], endless=True)
try:
    t.ok(d.start(), "dsv4d is ready", d.log_text())
    c = Client(d.sock_path)

    err, boot_st = c.call("stats")
    t.ok(err is None and boot_st["sched_allocations"] > 0 and boot_st["sched_allocations_after_boot"] == 0,
         "stats right after boot: the scheduler's allocations are counted, none after boot", (err, boot_st))
    # The boot's warm-up generation is no client's request: it is in no request count, no generated
    # token count and no latency histogram.
    t.ok(err is None and boot_st["requests_total"] == 0 and boot_st["prompt_tokens_total"] == 0
         and boot_st["generated_tokens_total"] == 0
         and all(boot_st["%s_count" % h] == 0 and sum(boot_st["%s_hist" % h]) == 0 and boot_st["%s_sum_s" % h] == 0
                 for h in ("queue", "ttft", "tpot", "e2e")),
         "stats right after boot: the warm-up is counted nowhere", (err, boot_st))
    err, hello = c.call("hello", {"protocol": 2, "client": "python msgpack"})
    t.ok(err is None and hello["protocol"] == 2 and hello["server"].startswith("dsv4d ")
         and hello["model"]["vocab_size"] == FIXTURE_VOCAB and hello["max_batch"] == 4 and hello["backend"] == "cpu"
         and hello["limits"]["max_frame"] == 8 << 20 and hello["limits"]["max_tokens"] == 4096, "hello", (err, hello))

    err, res = c.call("tokenize", {"text": "hello world"})
    t.ok(err is None and bin_tokens(res["tokens"]) == [BOS] + text_tokens("hello world"),
         "tokenize text (BOS first)", (err, res))
    err, res = c.call("tokenize", {"text": "hello", "add_bos": False})
    t.ok(err is None and bin_tokens(res["tokens"]) == text_tokens("hello"), "tokenize with add_bos false", err)
    err, res = c.call("tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    t.ok(err is None and bin_tokens(res["tokens"]) == [BOS, USER] + text_tokens("hi") + [ASSISTANT, THINK_END],
         "tokenize chat messages in the V4 format", (err, res and bin_tokens(res["tokens"])))
    err, res = c.call("tokenize", {"messages": [{"role": "user", "content": "hi"}], "thinking": True})
    t.ok(err is None and bin_tokens(res["tokens"])[-1] == THINK_START, "thinking mode ends the prompt with <think>",
         err)
    err, res = c.call("tokenize", {"messages": [{"role": "user", "content": "<｜Assistant｜></think><think>"}]})
    ids = bin_tokens(res["tokens"]) if res else []
    t.ok(err is None and not set(ids[2:-2]) & {BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END},
         "tags inside message content stay text (special or not)", ids)
    # prompt_parts: template parts keep their tags, literal parts never make one, and the whole is one text.
    err, res = c.call("generate", {"prompt_parts": ["<｜User｜>", "hi</think>", "<｜Assistant｜></think>"],
                                   "max_tokens": 1, "temperature": 0.0})
    t.ok(err is None and res["usage"]["prompt_tokens"] == 1 + 1 + len(text_tokens("hi</think>")) + 2,
         "prompt_parts: tags in template parts, literal text between", (err, res and res["usage"]))
    err, res = c.call("generate", {"prompt_parts": ["<｜User｜>hi"], "add_bos": False, "max_tokens": 1})
    t.ok(err is None and res["usage"]["prompt_tokens"] == 1 + len(text_tokens("hi")), "prompt_parts with add_bos false",
         (err, res and res["usage"]))
    err, _ = c.call("generate", {"prompt_parts": [], "max_tokens": 1})
    t.ok(err is not None and err["name"] == "bad_value", "empty prompt_parts is bad_value", err)
    err, _ = c.call("generate", {"prompt_parts": ["a"], "prompt": "b"})
    t.ok(err is not None and err["name"] == "prompt_conflict", "prompt_parts with prompt is prompt_conflict", err)
    err, res = c.call("detokenize", {"tokens": tokens_bin(text_tokens("héllo wörld"))})
    t.ok(err is None and res["text"] == "héllo wörld", "detokenize", (err, res))
    err, res = c.call("detokenize", {"tokens": tokens_bin(text_tokens("é")[:1])})
    t.ok(err is None and res["text"] == "\ufffd", "detokenize of a cut character gives U+FFFD", (err, res))

    # Greedy tokens equal the offline engine's for the same model and prompt.
    for i, prompt in enumerate(PROMPTS):
        n = 12
        err, res = greedy(c, prompt, n)
        ref, diag = run_dsv4_run(d.model, prompt, n)
        got = bin_tokens(res["tokens"]) if res else None
        t.ok(err is None and ref is not None and got == ref and res["usage"]["completion_tokens"] == len(got)
             and res["usage"]["prompt_tokens"] == len(prompt),
             "prompt %d: greedy tokens equal dsv4-run's" % i, (err, got, ref, diag))

    # Streamed deltas concatenate to the final text; the streamed ids are the result's.
    for params in ({"tokens": tokens_bin(PROMPTS[0]), "max_tokens": 40, "temperature": 0.0},
                   {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.9, "seed": 5},
                   {"messages": [{"role": "user", "content": "What is 17*23?"}], "max_tokens": 30, "seed": 11}):
        deltas, ids, err, res = stream(c, params)
        t.ok(err is None and "".join(deltas) == res["text"] and ids == bin_tokens(res["tokens"]) and len(ids) > 0,
             "streamed deltas concatenate to the text (%s)" % next(iter(params)),
             (err, deltas, res and res["text"]))

    # Seeds reproduce; different seeds differ somewhere in 3 tries.
    p = {"tokens": tokens_bin(PROMPTS[1]), "max_tokens": 24, "temperature": 1.0, "seed": 1234}
    a = c.call("generate", p)[1]
    b = c.call("generate", p)[1]
    t.ok(a["tokens"] == b["tokens"] and a["text"] == b["text"], "the same seed gives the same tokens")
    others = [c.call("generate", dict(p, seed=s))[1]["tokens"] for s in (1, 2, 3)]
    t.ok(any(o != a["tokens"] for o in others), "other seeds give other tokens")

    # The prefix cache (on by default; tiny_c's blocks are 16 tokens): a prompt that shares 4 blocks
    # with an earlier one restores them, reports them as cached_tokens, and answers what dsv4-run
    # answers cold; seeded sampling is unchanged by the restore. The earlier prompt prefilled past
    # block 3 in one chunk, so a prompt leaving it there restores nothing the first time (the state
    # at 48 tokens was never held) and its own 64 the second.
    shared = [BOS] + [(i * 29 + 17) % 250 + 3 for i in range(66)]
    first, second = shared + [5, 6, 7], shared[:64] + [8, 9]
    err1, r1 = greedy(c, first, 8)
    err2, r2 = greedy(c, second, 8)
    ref2, diag = run_dsv4_run(d.model, second, 8)
    t.ok(err1 is None and err2 is None and r1["usage"]["cached_tokens"] == 0 and r2["usage"]["cached_tokens"] == 64
         and r2["usage"]["prompt_tokens"] == 66 and bin_tokens(r2["tokens"]) == ref2,
         "a shared prefix is restored from the prefix cache: cached_tokens 64, the same tokens as dsv4-run",
         (err1, err2, r1 and r1["usage"], r2 and r2["usage"], ref2, diag))
    p = {"tokens": tokens_bin(first), "max_tokens": 16, "temperature": 1.0, "seed": 77, "repetition_penalty": 1.3}
    err1, a = c.call("generate", p)
    p["tokens"] = tokens_bin(shared[:48] + [(i * 13 + 1) % 250 + 3 for i in range(21)])
    err2, b_cached = c.call("generate", p)
    err3, b_again = c.call("generate", p)
    t.ok(err1 is None and err2 is None and err3 is None and a["usage"]["cached_tokens"] == 64
         and b_cached["usage"]["cached_tokens"] == 0 and b_again["usage"]["cached_tokens"] == 64
         and b_cached["tokens"] == b_again["tokens"],
         "seeded answers do not depend on how much of the prompt was cached",
         (err1, err2, err3, a and a["usage"], b_cached and b_cached["usage"], b_again and b_again["usage"]))
    err, st = c.call("stats")
    t.ok(err is None and st["prefix_cache_bytes"] > 0 and 0 < st["prefix_cache_used_bytes"] <= st["prefix_cache_bytes"]
         and st["prefix_cache_hits"] >= 3 and st["prefix_cache_hit_tokens"] >= 64 + 64 + 64
         and st["prefix_cache_lookups"] >= st["prefix_cache_hits"] and st["prefix_cache_tokens"] >= 64
         and st["prefix_cache_snapshots"] > 0, "stats count the prefix cache's pool, lookups and hits", st)

    # logprobs: one entry per token, top alternatives most probable first, the greedy pick on top.
    err, res = greedy(c, PROMPTS[0], 8, logprobs=3)
    lps = res and res.get("logprobs")
    t.ok(err is None and lps and len(lps) == len(bin_tokens(res["tokens"]))
         and all(len(lp["top_logprobs"]) == 3 for lp in lps),
         "logprobs: one entry per token with 3 alternatives", (err, lps))
    t.ok(lps and all(lp["logprob"] <= 0 for lp in lps), "logprobs are log-probabilities", lps)

    # stop_token_ids end the answer at that token, finish_reason stop.
    err, full = greedy(c, PROMPTS[2], 10)
    ids = bin_tokens(full["tokens"])
    stop_at = next((k for k in range(1, len(ids)) if ids[k] not in ids[:k] and ids[k] != EOS), None)
    if stop_at is not None:
        err, res = greedy(c, PROMPTS[2], 10, stop_token_ids=[ids[stop_at]])
        t.ok(err is None and bin_tokens(res["tokens"]) == ids[:stop_at + 1] and res["finish_reason"] == "stop",
             "stop_token_ids stop the answer", (err, res))
    err, res = greedy(c, PROMPTS[2], 3)
    t.ok(err is None and res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 3,
         "max_tokens bounds the answer", res)
    err, res = c.call("generate", {"tokens": tokens_bin(PROMPTS[2]), "temperature": 0.0})
    t.ok(err is None and res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 1024,
         "an absent max_tokens means the default, 1024", (err, res and res["usage"]))
    err, _ = greedy(c, PROMPTS[2], 4097)
    t.ok(err is not None and err["code"] == 405, "max_tokens above max_context gets max_tokens_limit (405)", err)
    # top_p 0 is inside the protocol's range but not the sampler's (0, 1]: the scheduler refuses it and
    # the daemon answers bad_sampling, naming the parameter.
    err, _ = c.call("generate", {"tokens": tokens_bin(PROMPTS[2]), "max_tokens": 2, "top_p": 0.0})
    t.ok(err is not None and err["code"] == 302 and "top_p" in err["message"],
         "a sampling parameter the scheduler refuses gets bad_sampling (302)", err)

    # Cancel mid-stream.
    mid = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 3000, "temperature": 0.0,
                                 "stream": True})
    seen = 0
    while seen < 3:
        m = c.recv()
        seen += m[0] == 2 and m[1] == "token"
    cid = c.request("cancel", {"msgid": mid})
    results = {}
    while len(results) < 2:
        m = c.recv()
        if m[0] == 1:
            results[m[1]] = m
    t.ok(results[cid][2] is None and results[cid][3]["cancelled"] is True, "cancel answers cancelled: true",
         results[cid])
    r = results[mid][3]
    t.ok(results[mid][2] is None and r["finish_reason"] == "cancelled" and 3 <= r["usage"]["completion_tokens"] < 3000,
         "the cancelled stream ends with finish_reason cancelled", r and r["finish_reason"])
    err, res = c.call("cancel", {"msgid": 4242})
    t.ok(err is None and res["cancelled"] is False, "cancelling an unknown msgid answers cancelled: false", res)

    # 16 concurrent clients, each answer identical to the same request alone.
    prompts = [[BOS] + text_tokens("client %d says" % k) for k in range(16)]
    alone = [bin_tokens(greedy(c, p, 16)[1]["tokens"]) for p in prompts]
    together = [None] * 16
    errors = []

    def worker(k):
        try:
            cc = Client(d.sock_path)
            if k % 2:
                deltas, ids, err, res = stream(cc, {"tokens": tokens_bin(prompts[k]), "max_tokens": 16,
                                                    "temperature": 0.0})
                if "".join(deltas) != res["text"]:
                    errors.append("client %d: deltas differ from text" % k)
            else:
                err, res = greedy(cc, prompts[k], 16)
            if err:
                errors.append("client %d: %r" % (k, err))
            else:
                together[k] = bin_tokens(res["tokens"])
            cc.close()
        except Exception as e:      # reported below, never swallowed
            errors.append("client %d: %r" % (k, e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    t.ok(not errors and together == alone, "16 concurrent clients get the answers they get alone",
         (errors, together, alone))

    # A client killed mid-stream frees its slot; the daemon stays healthy.
    killer = subprocess.Popen([sys.executable, "-c", """
import os, signal, sys
sys.path.insert(0, %r)
from dsv4d_harness import Client, tokens_bin
c = Client(%r)
c.request("generate", {"tokens": tokens_bin(%r), "max_tokens": 3000, "temperature": 0.0, "stream": True})
c.recv()
print("streaming", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
""" % (os.path.dirname(os.path.abspath(__file__)), d.sock_path, LONG_PROMPT)], stdout=subprocess.PIPE, text=True)
    out, _ = killer.communicate(timeout=TIMEOUT)
    t.ok(out.strip() == "streaming" and killer.returncode == -signal.SIGKILL, "a client dies mid-stream")
    deadline = time.monotonic() + TIMEOUT
    busy = None
    while time.monotonic() < deadline:
        err, st = c.call("stats")
        busy = st["slots_busy"]
        if busy == 0:
            break
        time.sleep(0.05)
    t.eq(busy, 0, "its slot is freed")
    t.ok("client went away" in d.log_text(), "the daemon logs that the client went away", d.log_text()[-3000:])
    err, h = c.call("health")
    t.ok(err is None and h["status"] == "ready", "and stays healthy", h)
    err, res = greedy(c, PROMPTS[0], 12)
    t.ok(err is None and bin_tokens(res["tokens"]) == bin_tokens(greedy(c, PROMPTS[0], 12)[1]["tokens"]),
         "and keeps answering", err)

    # A client that half-closes its socket after sending its requests (shutdown(SHUT_WR), as `nc -N`
    # does at the end of its input) has not closed the connection: every request is answered, then the
    # server closes.
    half = Client(d.sock_path)
    h_gen = half.request("generate", {"tokens": tokens_bin(PROMPTS[1]), "max_tokens": 40, "temperature": 0.0,
                                      "stream": True})
    h_tok = half.request("tokenize", {"text": "hello"})
    half.sock.shutdown(socket.SHUT_WR)
    got, n_tokens = {}, 0
    try:
        while len(got) < 2:
            m = half.recv()
            if m[0] == 1:
                got[m[1]] = (m[2], m[3])
            elif m[0] == 2 and m[1] == "token":
                n_tokens += 1
    except Closed:
        pass
    want = greedy(c, PROMPTS[1], 40)[1]
    t.ok(h_gen in got and got[h_gen][0] is None and got[h_gen][1]["finish_reason"] == "length"
         and got[h_gen][1]["tokens"] == want["tokens"] and n_tokens == 40,
         "a half-closed connection's generate runs to the end, streamed", (got, n_tokens))
    t.ok(h_tok in got and got[h_tok][0] is None and bin_tokens(got[h_tok][1]["tokens"]) == [BOS] + text_tokens("hello"),
         "... and its tokenize is answered", got)
    t.ok(half.closed_by_peer(), "then the server closes it")
    half.close()

    # Engine counters: N sequential requests of n tokens each run alone, so each takes one prefill step
    # (which samples its first token) and n - 1 decode steps of batch size 1.
    n_req, n_tok = 5, 9
    err0, st0 = c.call("stats")
    per_req = [greedy(c, PROMPTS[k % len(PROMPTS)], n_tok) for k in range(n_req)]
    err1, st1 = c.call("stats")
    dec = st1["decode_steps"] - st0["decode_steps"]
    hist0, hist1 = st0["batch_size_hist"], st1["batch_size_hist"]
    t.ok(err0 is None and err1 is None and all(e is None and r["usage"]["completion_tokens"] == n_tok
                                               for e, r in per_req),
         "%d sequential requests of %d tokens" % (n_req, n_tok), per_req)
    t.eq(dec, n_req * (n_tok - 1), "decode_steps grew by one per token after the first")
    t.ok(st1["steps"] - st0["steps"] >= dec + n_req, "steps grew by the decode steps and a prefill step per request",
         (st0["steps"], st1["steps"]))
    t.ok(len(hist1) == len(hist0) == 9 and sum(hist1) == st1["decode_steps"]
         and hist1[0] - hist0[0] == dec and hist1[1:] == hist0[1:],
         "batch_size_hist sums to decode_steps; the new steps are all batch size 1", (hist0, hist1, st1))
    tms = [r["timings"] for _, r in per_req]
    t.ok(all(tm["decode_ms"] > 0 and abs(tm["decode_tokens_per_s"] - (n_tok - 1) * 1000.0 / tm["decode_ms"])
             <= 1e-9 * tm["decode_tokens_per_s"] for tm in tms),
         "each result's decode_tokens_per_s is (completion_tokens - 1) / decode_ms", tms)
    # Latency histograms: each of the requests is observed once in each (it got a slot and made 9
    # tokens); tpot is its decode_ms / (completion_tokens - 1); the engine's clock starts at its submit,
    # after the result's (acceptance), so its queue and e2e are at most the result's queue_ms and total_ms.
    bounds = st1.get("latency_bounds_s", [])
    t.ok(len(bounds) == 19 and all(a < b for a, b in zip(bounds, bounds[1:])) and bounds[0] == 0.001
         and bounds[-1] == 80, "latency_bounds_s: 1 ms to 80 s, increasing", bounds)
    for h in ("queue", "ttft", "tpot", "e2e"):
        b0, b1 = st0["%s_hist" % h], st1["%s_hist" % h]
        t.ok(len(b0) == len(b1) == len(bounds) + 1 and sum(b1) == st1["%s_count" % h]
             and st1["%s_count" % h] - st0["%s_count" % h] == n_req
             and all(y >= x for x, y in zip(b0, b1)),
             "%s_hist: one bucket more than the bounds, sums to %s_count, which grew by one a request" % (h, h),
             (b0, b1, st0["%s_count" % h], st1["%s_count" % h]))
    d_sum = {h: st1["%s_sum_s" % h] - st0["%s_sum_s" % h] for h in ("queue", "ttft", "tpot", "e2e")}
    tpot_want = sum(tm["decode_ms"] / 1000.0 / (n_tok - 1) for tm in tms)
    t.ok(abs(d_sum["tpot"] - tpot_want) <= 1e-6 * tpot_want, "tpot_sum_s grew by each decode_ms / (n - 1)",
         (d_sum, tms))
    t.ok(0 < d_sum["queue"] <= sum(tm["queue_ms"] for tm in tms) / 1000.0
         and 0 < d_sum["ttft"] < d_sum["e2e"] <= sum(tm["total_ms"] for tm in tms) / 1000.0,
         "queue_sum_s and e2e_sum_s within the results' queue_ms and total_ms; ttft below e2e", (d_sum, tms))

    # Four requests pipelined on one connection share decode steps: batch sizes above 1 are counted.
    mids = [c.request("generate", {"tokens": tokens_bin(p), "max_tokens": 200, "temperature": 0.0})
            for p in PROMPTS + [LONG_PROMPT]]
    piped = {}
    while len(piped) < len(mids):
        m = c.recv()
        if m[0] == 1:
            piped[m[1]] = (m[2], m[3])
    err2, st2 = c.call("stats")
    hist2 = st2["batch_size_hist"]
    t.ok(sorted(piped) == mids and all(e is None for e, _ in piped.values()) and err2 is None and sum(hist2) == st2["decode_steps"]
         and sum(hist2[1:]) > sum(hist1[1:]), "pipelined requests decode in batches; the histogram still sums "
         "to decode_steps", (hist1, hist2, st2["decode_steps"]))

    err, st = c.call("stats")
    t.ok(err is None and st["sched_allocations"] == boot_st["sched_allocations"]
         and st["sched_allocations_after_boot"] == 0,
         "the scheduler allocated nothing after boot", (boot_st["sched_allocations"], st))
    t.ok(err is None and st["slots_total"] == 4 and st["requests_total"] >= 40 and st["requests_cancelled"] >= 2
         and st["generated_tokens_total"] > 0 and st["connections"] >= 1 and st["backend"] == "cpu"
         and st["device_allocs_after_boot"] == 0 and st["uptime_s"] > 0
         and 0 < st["prefill_chunks_total"] <= st["prefill_tokens_total"], "stats", st)
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- limits, each with its own code ---------------------------------------------------------------------
d = Daemon(args=["--max-context", "4096", "--max-batch", "1", "--max-queued", "1", "--max-connections", "3",
                 "--max-requests-per-conn", "2", "--max-prompt-tokens", "16", "--max-output-buffer", "64K"],
           endless=True)
try:
    t.ok(d.start(), "dsv4d with tight limits is ready", d.log_text())
    a = Client(d.sock_path)     # the activation trigger is connection 1, a is 2
    err, _ = greedy(a, [BOS] + [9] * 16, 2)
    t.ok(err is not None and err["code"] == 301 and err["name"] == "prompt_too_long",
         "a prompt above max_prompt_tokens gets prompt_too_long (301)", err)
    err, res = greedy(a, [BOS] + [9] * 15, 2)
    t.ok(err is None, "a prompt at max_prompt_tokens is served", err)

    long = {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 4000, "temperature": 0.0, "stream": True}
    m1 = a.request("generate", long)     # runs in the only slot
    a.recv()
    m2 = a.request("generate", long)     # waits in the queue
    m3 = a.request("generate", long)     # one too many on this connection
    err, _ = a.response(m3, on_notification=lambda m: None)
    t.ok(err is not None and err["code"] == 402, "a third request on one connection gets too_many_requests (402)",
         err)
    b = Client(d.sock_path)
    err, _ = b.call("generate", long)
    t.ok(err is not None and err["code"] == 401, "a request past max_queued gets queue_full (401)", err)
    extra = Client(d.sock_path)
    t.ok(extra.closed_by_peer() and extra.notifications and extra.notifications[-1][2][0]["code"] == 400,
         "a connection past max_connections gets too_many_connections (400) and is closed", extra.notifications)
    extra.close()
    for mid in (m1, m2):
        a.request("cancel", {"msgid": mid})
    done = set()
    while len(done) < 2:
        m = a.recv()
        if m[0] == 1 and m[1] in (m1, m2):
            done.add(m[1])
    t.ok(True, "cancelled requests answer")

    # A client that streams but never reads is dropped once max_output_buffer is queued for it.
    b.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 4000, "temperature": 0.0,
                           "stream": True, "logprobs": 20})
    deadline = time.monotonic() + TIMEOUT
    while "client does not read" not in d.log_text() and time.monotonic() < deadline and d.proc.poll() is None:
        d.notify.poll(0.1)
    t.ok("client does not read" in d.log_text(), "a client that does not read is disconnected", d.log_text()[-2000:])
    err, res = greedy(a, [BOS, 13], 3)
    t.ok(err is None, "the others are still served", err)
    # A reply larger than max_output_buffer (here 2.9 MB: the BOS tag spells 29 bytes) is refused, and
    # the client, which reads, keeps its connection: the server would otherwise drop it as one that does
    # not read once the socket's own buffer is full.
    try:
        err, res = a.call("detokenize", {"tokens": tokens_bin([BOS] * 100000)})
    except Closed:
        err, res = "closed", None
    t.ok(isinstance(err, dict) and err["code"] == 406 and err["name"] == "reply_too_large" and
         "max_output_buffer (65536 bytes)" in err["message"],
         "a detokenize reply above max_output_buffer gets reply_too_large (406)", (err, res and len(res["text"])))
    err, res = a.call("detokenize", {"tokens": tokens_bin(text_tokens("still here"))}) if err != "closed" else (err, 0)
    t.ok(err is None and res["text"] == "still here", "... and the connection goes on", err)
    b.close()
    a.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- no reply above the 64 MiB frame libdsv4client accepts -----------------------------------------------
# A tokenizer whose last id spells 200 bytes: 400000 of them detokenize to 80 MB, more than a client
# takes in one frame. The server answers reply_too_large instead of a frame the client must refuse.
with tempfile.TemporaryDirectory(prefix="dsv4d-test-") as tmp:
    tok = os.path.join(tmp, "long-token.json")
    write_tokenizer(tok, FIXTURE_VOCAB - 1)
    with open(tok, encoding="utf-8") as f:
        doc = json.load(f)
    doc["added_tokens"].append({"id": FIXTURE_VOCAB - 1, "content": "=" * 200, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False})
    with open(tok, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    d = Daemon(args=["--tokenizer", tok, "--max-output-buffer", "1G"])
    try:
        t.ok(d.start(), "dsv4d with a 200-byte token and max_output_buffer = 1G is ready", d.log_text())
        c = Client(d.sock_path)
        mid = c.request("detokenize", {"tokens": tokens_bin([FIXTURE_VOCAB - 1] * 400000)})
        (n,) = struct.unpack(">I", c._read_exact(4))
        t.ok(n <= 64 << 20, "no frame above the 64 MiB a client accepts", n)
        m = msgpack.unpackb(c._read_exact(n), raw=False) if n <= 64 << 20 else None
        t.ok(m is not None and m[1] == mid and m[2] and m[2]["name"] == "reply_too_large" and
             "67108864" in m[2]["message"], "the 80 MB detokenize gets reply_too_large (406)", m)
        if m is not None:
            err, res = c.call("detokenize", {"tokens": tokens_bin([FIXTURE_VOCAB - 1] * 2)})
            t.ok(err is None and res["text"] == "=" * 400, "... and the connection goes on", err)
        c.close()
        t.eq(d.stop(), 0, "dsv4d exits 0")
    finally:
        d.close()

# ---- a model vocabulary padded past the tokenizer's: ids without text are streamed empty -----------
TOK_VOCAB = 6 + 256
d = Daemon(tokenizer_vocab=TOK_VOCAB)
try:
    t.ok(d.start(), "dsv4d with a tokenizer of %d ids for %d model ids becomes ready" % (TOK_VOCAB, FIXTURE_VOCAB),
         d.log_text())
    c = Client(d.sock_path)
    padded = 0
    for seed in range(40):
        deltas, ids, err, res = stream(c, {"tokens": tokens_bin([BOS, 7, 8]), "max_tokens": 24, "temperature": 4.0,
                                           "seed": seed})
        if err is not None or res["finish_reason"] == "error":
            break
        padded += sum(1 for i in ids if i >= TOK_VOCAB)
        if padded:
            break
    t.ok(err is None and res["finish_reason"] != "error" and padded > 0,
         "a generation that samples ids past the tokenizer goes on", (err, res, padded))
    t.ok(err is None and "".join(deltas) == res["text"] and
         all(dl == "" for dl, i in zip(deltas, ids) if i >= TOK_VOCAB),
         "those ids stream with empty text and the deltas still make the text", (deltas, ids))
    err, res = c.call("detokenize", {"tokens": tokens_bin([BYTE_BASE + ord("o"), FIXTURE_VOCAB - 1,
                                                          BYTE_BASE + ord("k")])})
    t.ok(err is None and res["text"] == "ok", "detokenize gives them no text either", (err, res))
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

t.done()
