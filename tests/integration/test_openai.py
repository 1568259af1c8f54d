#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""dsv4-openai end to end, with the official `openai` package as the client, on dsv4d serving
models/default on the CPU backend: models (the list and one by id), health, chat (whole and streamed, usage in the stream, stop
strings, seeds, logprobs, thinking mode, n choices), completions (text and token ids, n), errors, the bearer key,
metrics, raw SSE framing through `curl -N`, prompt token counts against DeepSeek's encoding fixtures,
DSML tool calls (whole and streamed) from a scripted dsv4d, a client leaving mid-stream (the slot is
freed), 16 concurrent streams against one at a time, and hostile HTTP (huge Content-Length, a chunked
body without end, wrong types in every field, 500 idle connections, a header one byte a second)."""

import json
import os
import subprocess
import tempfile
import threading

from dsv4d_harness import TIMEOUT, Client, Daemon, Tap, bin_tokens, program, tokens_bin

t = Tap()
if not os.path.exists(program("dsv4-openai")):
    t.skip_all("dsv4-openai was not built (configure found no libmicrohttpd)")
try:
    import openai  # noqa: E402  (after the skip: a build without the front needs no openai package)
except ImportError:
    t.skip_all("python3 module openai not installed (pip install openai)")
from openai_harness import (FIXTURE, KEY, MODEL, Q391, Front, chat, direct, exposition, http, sample,  # noqa: E402
                            stream_chat)

tmp = tempfile.TemporaryDirectory(prefix="dsv4-openai-test-")
d = Daemon(args=["--max-batch", "8", "--max-context", "2048"], model=MODEL, tokenizer=False)
front = None
try:
    t.ok(d.start(), "dsv4d is ready on models/default", d.log_text())
    c = Client(d.sock_path)
    front = Front(d.sock_path, tmp.name, ["--request-timeout", "3", "--max-generations", "32"])
    t.ok(front.wait_ready(), "dsv4-openai answers /health once socket-activated", front.log_text())

    # ---- models, health, auth, metrics
    models = front.client.models.list()
    t.ok([m.id for m in models.data] == ["default"], "GET /v1/models lists the model dsv4d serves", models)
    m = front.client.models.retrieve("default")
    t.ok(m.id == "default" and m.object == "model" and m.owned_by == "dsv4d",
         "GET /v1/models/default: the model object", m)
    for other in ["gpt-4o", "deepseek-ai/DeepSeek-V4-Flash"]:
        try:
            front.client.models.retrieve(other)
            t.ok(False, "GET /v1/models/%s is refused" % other)
        except openai.NotFoundError as e:
            t.ok(e.status_code == 404 and e.body["code"] == "model_not_found" and other in e.body["message"]
                 and "'default'" in e.body["message"],
                 "GET /v1/models/%s: 404 model_not_found naming the model served" % other, e.body)
    status, _, body = http(front, "GET", "/v1/models/%FF%C3%A9x")
    t.ok(status == 404 and "'???x'" in json.loads(body)["error"]["message"],
         "an id that is not UTF-8 is repeated with its odd bytes as '?'", body)
    status, _, _ = http(front, "POST", "/v1/models/default")
    t.ok(status == 405, "POST /v1/models/default: 405", status)
    status, _, body = http(front, "GET", "/health", key=None)
    t.ok(status == 200 and json.loads(body)["status"] == "ready", "GET /health needs no key and says ready", body)
    bad_client = openai.OpenAI(base_url=front.base + "/v1", api_key="sk-wrong", max_retries=0)
    try:
        bad_client.models.list()
        t.ok(False, "a wrong API key is refused")
    except openai.AuthenticationError as e:
        t.ok(e.status_code == 401 and e.body["code"] == "invalid_api_key", "a wrong API key is refused with 401",
             e.body)
    status, _, _ = http(front, "GET", "/v1/models", key=KEY[:-1])
    t.ok(status == 401, "a key that is a prefix of the right one is refused", status)

    # ---- chat, whole: the answer and exact usage against dsv4d's own chat format
    r = chat(front, Q391, temperature=0)
    err, ref = direct(c, {"messages": [{"role": "user", "content": Q391}], "temperature": 0.0})
    err2, tok = c.call("tokenize", {"messages": [{"role": "user", "content": Q391}]})
    t.ok(r.choices[0].message.content == "391" and r.choices[0].finish_reason == "stop" and r.object == "chat.completion",
         "chat: 17*23 -> 391", r)
    t.ok(err is None and err2 is None and r.usage.prompt_tokens == len(bin_tokens(tok["tokens"]))
         and r.usage.completion_tokens == len(bin_tokens(ref["tokens"]))
         and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
         and 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens,
         "chat: usage counts the prompt and completion tokens exactly", (r.usage, ref and ref["usage"]))

    # ---- streamed, with usage
    chunks, text, _, finish = stream_chat(front, Q391, temperature=0, stream_options={"include_usage": True})
    t.ok(text == "391" and finish == ["stop"] and chunks[0].choices[0].delta.role == "assistant",
         "stream: the deltas make the same answer, role first, one finish_reason", [str(x) for x in chunks])
    t.ok(chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
         and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
         and all(x.usage is None for x in chunks[:-1]), "stream: include_usage sends the usage last",
         [str(x) for x in chunks[-2:]])

    # ---- stop strings
    q = "What is 17 times 23?"
    full = chat(front, q, temperature=0).choices[0].message.content
    cut = chat(front, q, temperature=0, stop=["="])
    t.ok("=" in full and cut.choices[0].message.content == full.split("=")[0] and cut.choices[0].finish_reason == "stop",
         "stop: the reply ends before the stop string", (full, cut.choices[0].message.content))
    cut2 = chat(front, q, temperature=0, stop="23")
    t.ok(cut2.choices[0].message.content == full.split("23")[0], "stop as a single string", cut2.choices[0].message.content)

    # ---- seeds
    a = chat(front, "Hello", temperature=1.0, seed=1234, max_tokens=24, logprobs=True)
    b = chat(front, "Hello", temperature=1.0, seed=1234, max_tokens=24, logprobs=True)
    t.ok(a.choices[0].message.content == b.choices[0].message.content
         and [x.logprob for x in a.choices[0].logprobs.content] == [x.logprob for x in b.choices[0].logprobs.content],
         "seed: the same seed gives the same reply and log-probabilities", (a.choices[0].message, b.choices[0].message))

    # ---- logprobs against dsv4d's own
    r = chat(front, Q391, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    err, ref = direct(c, {"messages": [{"role": "user", "content": Q391}], "temperature": 0.0, "logprobs": 3})
    t.ok(len(lp) == r.usage.completion_tokens and all(len(x.top_logprobs) == 3 for x in lp)
         and all(x.token == x.top_logprobs[0].token and x.logprob == x.top_logprobs[0].logprob for x in lp),
         "logprobs: one entry per token, 3 alternatives, the greedy choice first", lp)
    t.ok(err is None and [x.logprob for x in lp] == [e["logprob"] for e in ref["logprobs"]]
         and "".join(x.token for x in lp[:-1]) == "391" and bytes(lp[0].bytes).decode() == lp[0].token,
         "logprobs: the values are dsv4d's, the token texts spell the reply", (lp, ref and ref["logprobs"]))

    # ---- thinking mode: the reply is reasoning until </think>
    msgs = [{"role": "user", "content": "What is 2*3?"}]
    err, ref = direct(c, {"messages": msgs, "thinking": True, "temperature": 0.0, "max_tokens": 12})
    want_r, _, want_c = ref["text"].partition("</think>")
    r = front.client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=12,
                                             extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    t.ok(err is None and getattr(m, "reasoning_content", None) == want_r and (m.content or "") == want_c
         and want_r != "", "thinking: chat_template_kwargs gives reasoning_content as dsv4d's thinking mode writes it",
         (m, ref))
    r2 = front.client.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=12,
                                              reasoning_effort="high")
    t.ok(getattr(r2.choices[0].message, "reasoning_content", None) == want_r and r2.usage.prompt_tokens == r.usage.prompt_tokens,
         "thinking: reasoning_effort turns it on too", r2.choices[0].message)
    _, text, reasoning, _ = stream_chat(front, "What is 2*3?", temperature=0, max_tokens=12,
                                        extra_body={"chat_template_kwargs": {"thinking": True}})
    t.ok(reasoning == want_r and text == want_c, "thinking: streamed as reasoning_content deltas", (reasoning, text))

    # ---- completions
    err, ref = direct(c, {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.0})
    r = front.client.completions.create(model="default", prompt="The capital of France is", max_tokens=6, temperature=0)
    t.ok(err is None and r.choices[0].text == ref["text"] and r.usage.completion_tokens == len(bin_tokens(ref["tokens"]))
         and r.object == "text_completion", "completions: a text prompt, as dsv4d completes it", (r, ref))
    ids = [0, 2, 100, 200, 300, 3, 5]
    err, ref = direct(c, {"tokens": tokens_bin(ids), "max_tokens": 4, "temperature": 0.0})
    r = front.client.completions.create(model="default", prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    t.ok(err is None and r.choices[0].text == ref["text"] and r.usage.prompt_tokens == len(ids)
         and len(r.choices[0].logprobs.tokens) == 4 and len(r.choices[0].logprobs.top_logprobs[0]) == 2,
         "completions: a token-id prompt, with logprobs", (r, ref))
    chunks = list(front.client.completions.create(model="default", prompt=ids, max_tokens=4, temperature=0, stream=True))
    t.ok("".join(x.choices[0].text for x in chunks) == ref["text"], "completions: streamed", chunks)

    # ---- n choices: choice i is the reply a request with seed + i gets; usage counts the prompt once
    kw = dict(temperature=1.0, seed=4242, max_tokens=12)
    r = chat(front, "Hello", n=3, logprobs=True, **kw)
    singles = [chat(front, "Hello", temperature=1.0, seed=4242 + i, max_tokens=12, logprobs=True) for i in range(3)]
    texts = [x.choices[0].message.content for x in singles]
    t.ok([x.index for x in r.choices] == [0, 1, 2] and [x.message.content for x in r.choices] == texts
         and [x.finish_reason for x in r.choices] == [x.choices[0].finish_reason for x in singles]
         and len(set(texts)) > 1, "n=3: choice i is the reply of seed + i (the three differ)",
         (r.choices, [x.choices[0] for x in singles]))
    t.ok([[y.logprob for y in x.logprobs.content] for x in r.choices]
         == [[y.logprob for y in x.choices[0].logprobs.content] for x in singles],
         "n=3: each choice has its own logprobs", r.choices)
    t.ok(r.usage.prompt_tokens == singles[0].usage.prompt_tokens
         and r.usage.completion_tokens == sum(x.usage.completion_tokens for x in singles)
         and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens,
         "n=3: usage counts the prompt once and every choice's completion tokens", (r.usage, [x.usage for x in singles]))
    chunks = list(front.client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello"}],
                                                       n=3, stream=True, stream_options={"include_usage": True}, **kw))
    got, finishes, first = ["", "", ""], [[], [], []], [None, None, None]
    for x in chunks[:-1]:
        for ch in x.choices:
            if first[ch.index] is None:
                first[ch.index] = ch.delta.role
            got[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    t.ok(got == texts and finishes == [[x.choices[0].finish_reason] for x in singles] and first == ["assistant"] * 3,
         "n=3 streamed: each index's deltas make its reply, role first, one finish_reason each", (got, finishes, first))
    t.ok(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
         and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens and all(x.usage is None for x in chunks[:-1]),
         "n=3 streamed: one usage chunk last, for every choice", [str(x) for x in chunks[-2:]])
    p = "The capital of France is"
    r = front.client.completions.create(model="default", prompt=p, max_tokens=6, temperature=1.0, seed=99, n=2)
    singles = [front.client.completions.create(model="default", prompt=p, max_tokens=6, temperature=1.0, seed=99 + i)
               for i in range(2)]
    t.ok([x.index for x in r.choices] == [0, 1] and [x.text for x in r.choices] == [x.choices[0].text for x in singles],
         "completions, n=2: choice i is the completion of seed + i", (r.choices, [x.choices[0] for x in singles]))

    # ---- errors
    try:
        chat(front, "x", n=17)
        t.ok(False, "n=17 is refused")
    except openai.BadRequestError as e:
        t.ok(e.status_code == 400 and e.body["param"] == "n" and "[1, 16]" in e.body["message"],
             "n above 16 is refused with 400 naming n and the range", e.body)
    try:
        front.client.completions.create(model="default", prompt="x", max_tokens=2, best_of=2)
        t.ok(False, "best_of=2 is refused")
    except openai.BadRequestError as e:
        t.ok(e.status_code == 400 and e.body["param"] == "best_of", "best_of other than 1 is refused", e.body)
    try:
        chat(front, "word " * 3000)
        t.ok(False, "a prompt longer than the context is refused")
    except openai.BadRequestError as e:
        t.ok(e.body["code"] == "context_length_exceeded", "a prompt longer than the context: 400 context_length_exceeded",
             e.body)
    try:
        chat(front, "word " * 3000, n=4)
        t.ok(False, "a prompt longer than the context is refused for 4 choices")
    except openai.BadRequestError as e:
        t.ok(e.body["code"] == "context_length_exceeded", "4 choices of a prompt longer than the context: one 400 "
             "context_length_exceeded", e.body)

    # ---- prompt tokens of V4 renderings (tools, tool results, thinking) = the model tokenizer on DeepSeek's string
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json"))
    for case in FIXTURE["encode"]:
        if "<｜DSML｜invoke>" in json.dumps(case["messages"], ensure_ascii=False) or "<｜Assistant｜>" in \
                json.dumps(case["messages"], ensure_ascii=False):
            continue   # tag text in content is text here, a tag in DeepSeek's string: counts differ by design
        extra = {}
        if case.get("thinking"):
            extra["chat_template_kwargs"] = {"thinking": True}
        if case.get("reasoning_effort"):
            extra["reasoning_effort"] = case["reasoning_effort"]
        kw = {"tools": case["tools"]} if case.get("tools") else {}
        r = front.client.chat.completions.create(model="default", messages=case["messages"], max_tokens=1,
                                                 temperature=0, extra_body=extra, **kw)
        want = len(hf.encode(case["prompt"], add_special_tokens=False).ids)
        t.ok(r.usage.prompt_tokens == want, "V4 rendering '%s': %d prompt tokens, as DeepSeek's string" %
             (case["name"], want), (r.usage.prompt_tokens, want))

    # ---- raw SSE framing through curl -N
    req = json.dumps({"model": "default", "messages": [{"role": "user", "content": Q391}], "temperature": 0,
                      "stream": True})
    out = subprocess.run(["curl", "-sN", "-i", front.base + "/v1/chat/completions", "-H", "Authorization: Bearer " + KEY,
                          "-H", "Content-Type: application/json", "-d", req], capture_output=True, timeout=TIMEOUT)
    head, _, sse = out.stdout.decode().partition("\r\n\r\n")
    events = sse.split("\n\n")
    t.ok(out.returncode == 0 and "content-type: text/event-stream" in head.lower() and events[-1] == ""
         and events[-2] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-2])
         and all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in events[:-2]),
         "curl -N: text/event-stream, one 'data: {json}' per event, blank-line separated, ending in data: [DONE]",
         out.stdout.decode())

    # ---- metrics
    status, hdrs, body = http(front, "GET", "/metrics")
    text = body.decode()
    problems, types, before = exposition(text)
    t.ok(status == 200 and hdrs["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8" and not problems
         and sample(before, "dsv4d_up") == 1 and sample(before, "dsv4d_slots") == 8
         and sample(before, "dsv4d_health", status="ready") == 1
         and sample(before, "dsv4_openai_requests_total", endpoint="chat_completions") is not None
         and sample(before, "dsv4d_engine_backend_seconds_total") is not None,
         "GET /metrics: Prometheus text format 0.0.4 with dsv4d's stats and the front's counters", (problems, text))
    chat(front, Q391, max_tokens=4, temperature=0)
    _, _, body = http(front, "GET", "/metrics")
    err, st = c.call("stats")
    problems, _, after = exposition(body.decode())
    counters = [k for k in after if types.get(k[0]) == "counter"]
    t.ok(not problems and err is None and sample(after, "dsv4d_requests_total") == st["requests_total"]
         and sample(after, "dsv4d_requests_total") == sample(before, "dsv4d_requests_total") + 1
         and sample(after, "dsv4d_generated_tokens_total") == st["generated_tokens_total"]
         and sample(after, "dsv4d_prompt_tokens_total") == st["prompt_tokens_total"]
         and sample(after, "dsv4_openai_requests_total", endpoint="chat_completions")
         == sample(before, "dsv4_openai_requests_total", endpoint="chat_completions") + 1
         and counters and all(after[k] >= before.get(k, 0) for k in counters),
         "/metrics after one chat: dsv4d's counters as its stats say, one request more, no counter went down",
         (problems, st, body))
    t.ok(not problems and all(sample(after, k) == 0 for k in ["dsv4d_device_allocs_after_boot",
                                                              "dsv4d_graph_captures_after_boot",
                                                              "dsv4d_sched_allocations_after_boot"])
         and sample(after, "dsv4d_sched_allocations_total") == st["sched_allocations"]
         and sample(after, "dsv4d_prefix_cache_lookups_total") == st["prefix_cache_lookups"]
         and sample(after, "dsv4d_prefix_cache_bytes") == st["prefix_cache_bytes"]
         and sample(after, "dsv4d_heap_mapped_bytes") is not None,
         "/metrics after one chat: no device or scheduler allocation and no graph capture after boot; the "
         "scheduler's and prefix cache's counts as dsv4d's stats say", (problems, st, body))

    # ---- 16 concurrent streams give what one at a time gives (greedy and seeded)
    questions = ["What is %d*%d?" % (a, b) for a, b in [(2, 3), (4, 5), (6, 7), (8, 9), (11, 12), (13, 3), (14, 2),
                                                       (15, 6)]] + \
                ["Name the capital of %s in one word." % x for x in ["France", "Japan", "Italy", "Spain", "Egypt",
                                                                     "Peru", "Kenya", "Chile"]]
    params = [dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=100 + i) for i in range(16)]
    alone = [chat(front, q, max_tokens=16, **p).choices[0].message.content for q, p in zip(questions, params)]
    together = [None] * 16

    def one(i):
        together[i] = stream_chat(front, questions[i], max_tokens=16, **params[i])[1]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.ok(together == alone, "16 concurrent streams give the answers each gives alone", list(zip(alone, together)))
finally:
    if front:
        rc = front.stop()
        t.ok(rc == 0, "dsv4-openai stops cleanly on SIGTERM", (rc, front.log_text()[-3000:]))
    d.stop()
    d.close()
t.done()
