#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""dsv4-openai under stress: a client that leaves mid-stream (or mid-wait) frees its dsv4d slot (every slot
of a request of several choices);
hostile HTTP (a huge Content-Length, a chunked body without end, bodies that are not JSON, wrong types
in every field, 500 idle connections, a header sent one byte a second, an oversized header) leaves it
serving; and DSML tool calls, whole and streamed, from a scripted dsv4d that also shows the prompt
parts the front sends and cancels a generation as a draining dsv4d does, or holds its hello while the front
stops."""

import errno
import json
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time

from dsv4d_harness import TIMEOUT, Client, Daemon, Tap, UnixServer, program, tokens_bin

t = Tap()
if not os.path.exists(program("dsv4-openai")):
    t.skip_all("dsv4-openai was not built (configure found no libmicrohttpd)")
import msgpack  # noqa: E402
from openai_harness import FIXTURE, KEY, MODEL, Q391, Front, chat, exposition, http, raw, sample  # noqa: E402

REQUEST_TIMEOUT = 3


def wait_stats(c, cond, timeout=20):
    """dsv4d's stats once cond(stats) holds, or the last ones after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        err, st = c.call("stats")
        if err is None and cond(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def post(front, body, path="/v1/chat/completions"):
    data = json.dumps(body).encode()
    return ("POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
            "Content-Length: %d\r\n\r\n" % (path, KEY, len(data))).encode() + data


def leave_mid_request(t, front, c, stream, n=1):
    """Send a long generation of n choices, leave once dsv4d works on them, check the slots are freed early."""
    st0 = wait_stats(c, lambda s: s["slots_busy"] == 0)
    s = socket.create_connection(("127.0.0.1", front.port), timeout=TIMEOUT)
    s.sendall(post(front, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3000, "stream": stream,
                           "n": n}))
    if stream:
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
    st1 = wait_stats(c, lambda x: x["slots_busy"] == n)
    s.close()
    st2 = wait_stats(c, lambda x: x["slots_busy"] == 0)
    what = ("streamed" if stream else "whole") + ("" if n == 1 else " %d-choice" % n)
    t.ok(st1["slots_busy"] == n and st2["slots_busy"] == 0
         and st2["requests_cancelled"] == st0["requests_cancelled"] + n
         and st2["generated_tokens_total"] - st0["generated_tokens_total"] < 3000 * n,
         "a client leaving a %s request cancels it in dsv4d: the slots are free, %d of %d tokens made" %
         (what, st2["generated_tokens_total"] - st0["generated_tokens_total"], 3000 * n),
         (st0, st1, st2, front.log_text()))


def status_of(response):
    line = response.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


# ---- a scripted dsv4d: answers with DSML tool calls, records what it was sent -----------------------

REPLY = ("Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
         "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
         "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
         "<｜DSML｜invoke name=\"get_weather\">\n"
         "<｜DSML｜parameter name=\"city\" string=\"true\">Tōkyō \"east\"</｜DSML｜parameter>\n"
         "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


STATS = {"uptime_s": 12.5, "backend": "cpu", "slots_total": 4, "slots_busy": 1, "queue_depth": 0, "connections": 2,
         "requests_total": 7, "requests_failed": 0, "requests_cancelled": 1, "prompt_tokens_total": 90,
         "generated_tokens_total": 60, "prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 100.0,
         "prefill_tokens_total": 84, "prefill_chunks_total": 3,
         "device_arena_bytes": 4096, "device_arena_used": 4096, "heap_allocated": 1024, "heap_active": 1024,
         "heap_resident": 2048, "heap_mapped": 4096, "device_allocs_after_boot": 0, "graph_captures_after_boot": 0,
         "eager_steps": 0, "kernels": ["cpu reference fp32"], "steps": 30, "decode_steps": 20,
         "batch_size_hist": [15, 5, 0], "engine_busy_s": 0.5, "engine_backend_s": 0.4, "engine_gap_s": 0.01,
         "sched_allocations": 37, "sched_allocations_after_boot": 0, "prefix_cache_bytes": 1 << 20,
         "prefix_cache_used_bytes": 65536, "prefix_cache_tokens": 512, "prefix_cache_snapshots": 8,
         "prefix_cache_lookups": 6, "prefix_cache_hits": 4, "prefix_cache_hit_tokens": 256, "prefix_cache_evictions": 2,
         "spec_tokens": 2, "spec_verifies": 10, "spec_drafted": 20, "spec_accepted": 13, "spec_accept_hist": [2, 3, 5],
         "latency_bounds_s": [0.001, 0.0025, 0.1], "queue_hist": [3, 1, 0, 0], "queue_count": 4, "queue_sum_s": 0.004,
         "ttft_hist": [0, 1, 2, 1], "ttft_count": 4, "ttft_sum_s": 0.625, "tpot_hist": [2, 1, 0, 0], "tpot_count": 3,
         "tpot_sum_s": 0.003, "e2e_hist": [0, 0, 1, 3], "e2e_count": 4, "e2e_sum_s": 2.5}
# dsv4d's latency histograms (sent per bucket) as /metrics shows them: cumulative buckets by le, _sum, _count.
LATENCY_SERIES = {
    "dsv4d_request_queue_seconds": {"0.001": 3, "0.0025": 4, "0.1": 4, "+Inf": 4, "_sum": 0.004, "_count": 4},
    "dsv4d_time_to_first_token_seconds": {"0.001": 0, "0.0025": 1, "0.1": 3, "+Inf": 4, "_sum": 0.625, "_count": 4},
    "dsv4d_time_per_output_token_seconds": {"0.001": 2, "0.0025": 3, "0.1": 3, "+Inf": 3, "_sum": 0.003, "_count": 3},
    "dsv4d_request_e2e_seconds": {"0.001": 0, "0.0025": 0, "0.1": 1, "+Inf": 4, "_sum": 2.5, "_count": 4},
}
LATENCY_KEYS = ["latency_bounds_s"] + ["%s_%s" % (h, k) for h in ("queue", "ttft", "tpot", "e2e")
                                      for k in ("hist", "count", "sum_s")]


def latency_series(types, samples):
    """{family: {le or _sum/_count: value}} of the latency histograms in exposition()'s samples, and whether each
    is typed histogram."""
    got = {}
    for (name, labels), v in samples.items():
        for fam in LATENCY_SERIES:
            if name == fam + "_bucket":
                got.setdefault(fam, {})[dict(labels)["le"]] = v
            elif name in (fam + "_sum", fam + "_count"):
                got.setdefault(fam, {})[name[len(fam):]] = v
    return got, all(types.get(fam) == "histogram" for fam in got)
# The /metrics series of the stats keys a version 1 dsv4d may leave out (doc/PROTOCOL.md, section 7), and the
# scripted values they show.
OPTIONAL_SERIES = {"dsv4d_device_arena_used_bytes": 4096, "dsv4d_heap_active_bytes": 1024,
                   "dsv4d_heap_mapped_bytes": 4096, "dsv4d_sched_allocations_after_boot": 0,
                   "dsv4d_sched_allocations_total": 37, "dsv4d_eager_steps_total": 0,
                   "dsv4d_prefill_tokens_total": 84, "dsv4d_prefill_chunks_total": 3,
                   "dsv4d_prefix_cache_bytes": 1 << 20, "dsv4d_prefix_cache_used_bytes": 65536,
                   "dsv4d_prefix_cache_tokens": 512, "dsv4d_prefix_cache_snapshots": 8,
                   "dsv4d_prefix_cache_lookups_total": 6, "dsv4d_prefix_cache_hits_total": 4,
                   "dsv4d_prefix_cache_hit_tokens_total": 256, "dsv4d_prefix_cache_evictions_total": 2,
                   "dsv4d_spec_tokens": 2, "dsv4d_spec_verifies_total": 10, "dsv4d_spec_drafted_tokens_total": 20,
                   "dsv4d_spec_accepted_tokens_total": 13}


class ScriptedDsv4d(UnixServer):
    """Answers stats (self.stats) and health (self.health); while self.draining, tells each new connection so
    and closes it, as dsv4d does during a drain."""

    def __init__(self, path, hello_gate=None):
        self.requests = []
        self.hello_gate = hello_gate            # when given, a hello is answered only once it is set
        self.hello_asked = threading.Event()
        self.stats = dict(STATS)
        self.health = "ready"
        self.draining = False
        super().__init__(path)

    def handle(self, conn):
        threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    @staticmethod
    def send(conn, obj):
        body = msgpack.packb(obj, use_bin_type=True)
        conn.sendall(struct.pack(">I", len(body)) + body)

    def serve(self, conn):
        if self.draining:
            self.send(conn, [2, "error", [{"code": 501, "name": "draining", "message": "dsv4d is shutting down"}]])
            conn.close()
            return
        buf = b""
        held = []
        while True:
            while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
                b = conn.recv(65536)
                if not b:
                    return
                buf += b
            n = struct.unpack(">I", buf[:4])[0]
            msg = msgpack.unpackb(buf[4:4 + n], raw=False)
            buf = buf[4 + n:]
            _, msgid, method, params = msg
            p = params[0] if isinstance(params, list) and params else params
            if method == "hello" and self.hello_gate:
                self.hello_asked.set()
                self.hello_gate.wait(TIMEOUT)
            if method == "cancel" and isinstance(p, dict) and p.get("msgid") in held:
                held.remove(p["msgid"])
                self.send(conn, [1, p["msgid"], None, {"text": "", "tokens": tokens_bin([]), "finish_reason":
                                                       "cancelled", "usage": {"prompt_tokens": 42,
                                                                              "completion_tokens": 0,
                                                                              "total_tokens": 42}}])
            if method in ("stats", "health"):
                self.send(conn, [1, msgid, None, self.stats if method == "stats" else
                                 {"status": self.health, "reason": "scripted"}])
                continue
            if method != "generate":
                self.send(conn, [1, msgid, {"code": 200, "name": "unknown_method", "message": "scripted"}, None])
                continue
            self.requests.append(p)
            if any("HOLD" in x for x in p.get("prompt_parts", [])):
                held.append(msgid)      # a generation that runs until it is cancelled
                continue
            # The reply in pieces that cut its markers anywhere, as tokens do. A user saying DRAIN gets what
            # a draining dsv4d gives: half the reply, then finish_reason cancelled.
            pieces = [REPLY[i:i + 7] for i in range(0, len(REPLY), 7)]
            finish = "stop"
            if any("DRAIN" in x for x in p.get("prompt_parts", [])):
                pieces, finish = pieces[:len(pieces) // 2], "cancelled"
            if p.get("stream"):
                for i, piece in enumerate(pieces):
                    self.send(conn, [2, "token", [{"msgid": msgid, "token": i, "text": piece}]])
            self.send(conn, [1, msgid, None, {"text": "".join(pieces), "tokens": tokens_bin(list(range(len(pieces)))),
                                              "finish_reason": finish,
                                              "usage": {"prompt_tokens": 42, "completion_tokens": len(pieces),
                                                        "total_tokens": 42 + len(pieces)}}])


tmp = tempfile.TemporaryDirectory(prefix="dsv4-openai-hostile-")
d = Daemon(args=["--max-batch", "4", "--max-context", "4096"], model=MODEL, tokenizer=False, endless=True)
front = fake_front = fake = idle_front = gated_front = d2 = None
try:
    t.ok(d.start(), "dsv4d is ready (models/default, end of sentence disabled: answers run to max_tokens)",
         d.log_text())
    c = Client(d.sock_path)
    front = Front(d.sock_path, tmp.name, ["--request-timeout", str(REQUEST_TIMEOUT), "--max-body", "65536",
                                          "--max-header", "16384"])
    t.ok(front.wait_ready(), "dsv4-openai is up", front.log_text())

    # ---- leaving
    leave_mid_request(t, front, c, stream=True)
    leave_mid_request(t, front, c, stream=False)
    leave_mid_request(t, front, c, stream=True, n=3)
    _, _, body = http(front, "GET", "/metrics")
    t.ok("dsv4_openai_disconnects_total 3" in body.decode(), "metrics count the three clients that left (a request "
         "of several choices once)", body)

    # ---- a method the path does not take: 405 with the Allow header HTTP requires (RFC 9110 15.5.6)
    wrong_method = []
    for method, path, allow in [("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"),
                                ("POST", "/v1/models", "GET, HEAD"), ("DELETE", "/v1/models/default", "GET, HEAD"),
                                ("POST", "/health", "GET, HEAD"), ("PATCH", "/metrics", "GET, HEAD")]:
        status, headers, out = http(front, method, path, b"{}" if method != "GET" else None)
        if status != 405 or headers.get("Allow") != allow or b'"code":"method_not_allowed"' not in out:
            wrong_method.append((method, path, status, headers.get("Allow"), out))
    t.ok(not wrong_method, "a method the path does not take: 405 with Allow naming the methods it takes",
         wrong_method)

    # HEAD wherever GET goes: GET's status and headers, no body (raw: urllib would not show a stray body).
    # The metrics change between the two requests, so only their Content-Length's presence is compared.
    wrong_head = []
    for path in ["/health", "/v1/models", "/v1/models/default", "/v1/models/nope", "/metrics"]:
        status, headers, _ = http(front, "GET", path)
        r = raw(front, ("HEAD %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nConnection: close\r\n\r\n"
                        % (path, KEY)).encode())
        head, _, rest = r.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        got = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if (status_of(r) != status or rest != b"" or got.get("content-type") != headers.get("Content-Type")
                or not (got.get("content-length") or "").isdigit()
                or path != "/metrics" and got.get("content-length") != headers.get("Content-Length")):
            wrong_head.append((path, status, r[:300]))
    r = raw(front, b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    if status_of(r) != 405 or b"\r\nAllow: POST\r\n" not in r:
        wrong_head.append(("/v1/chat/completions", 405, r[:300]))
    t.ok(not wrong_head, "HEAD on the GET endpoints: GET's status and headers without a body; on POST ones 405",
         wrong_head)

    # ---- hostile HTTP
    r = raw(front, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Length: 99999999999999\r\n\r\n")
    t.ok(status_of(r) == 413 and b'"code":"body_too_large"' in r, "a huge Content-Length: 413 before any body", r)
    r = raw(front, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Length: 70000\r\n\r\n" + b"x" * 70000)
    t.ok(status_of(r) == 413, "a body above --max-body: 413", r[:300])

    s = socket.create_connection(("127.0.0.1", front.port), timeout=TIMEOUT)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    t0 = time.monotonic()
    status, _, _ = http(front, "GET", "/health")
    t.ok(status == 200, "serving while a chunked body has no end", status)
    s.settimeout(REQUEST_TIMEOUT + 5)
    try:
        got = s.recv(4096)
    except (socket.timeout, ConnectionError):
        got = None
    t.ok(got == b"" and time.monotonic() - t0 < REQUEST_TIMEOUT + 4,
         "a chunked body without end is cut off after --request-timeout (%.1f s)" % (time.monotonic() - t0), got)
    s.close()

    for body in [b"{", b"[1, 2]", b"\xff\xfe{}", b"", b'{"messages": [{"role": "user", "content": "x"}]'
                 + b"}" * 3, b"null"]:
        status, _, out = http(front, "POST", "/v1/chat/completions", body)
        t.ok(status == 400 and json.loads(out)["error"]["type"] == "invalid_request_error",
             "not a JSON object (%r): 400" % body[:20], out)

    base = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    wrong = {
        "model": 5, "messages": "hi", "stream": "yes", "stream_options": [], "max_tokens": "10",
        "max_completion_tokens": 1.5, "temperature": "hot", "top_p": [], "top_k": 0.5, "min_p": {}, "seed": "42",
        "presence_penalty": True, "frequency_penalty": "0", "repetition_penalty": [1], "stop": 7, "logprobs": 1,
        "top_logprobs": "3", "n": "1", "tools": {}, "tool_choice": 3, "chat_template_kwargs": "thinking",
        "reasoning_effort": 2, "response_format": "json", "stop_token_ids": "1", "user": 9, "logit_bias": [],
        "best_of": "1",
    }
    bad_fields = []
    for field, value in wrong.items():
        status, _, out = http(front, "POST", "/v1/chat/completions", dict(base, **{field: value}))
        err = json.loads(out).get("error", {}) if out else {}
        if not (status == 400 and (err.get("param") or "").split(".")[0] == field):
            bad_fields.append((field, status, err))
    t.ok(not bad_fields, "a wrong type in each of %d fields: 400 naming the field" % len(wrong), bad_fields)
    # A refusal that quotes the value: cut to the message's room (512 bytes) whichever byte of a character
    # that falls on.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad_fields = []
    for pad in ("", "x"):
        long_value = pad + "\u00e9" * 400
        quoted = {"reasoning_effort": long_value, "tool_choice": long_value,
                  "messages": [{"role": long_value, "content": "x"}]}
        for field, value in quoted.items():
            status, _, out = http(front, "POST", "/v1/chat/completions", dict(base, tools=[tool], **{field: value}))
            err = json.loads(out).get("error", {}) if out.startswith(b"{") else {}
            if not (status == 400 and err.get("param") == field and long_value[:50] in err.get("message", "")):
                bad_fields.append((field, len(pad), status, out[:200]))
    t.ok(not bad_fields, "a refusal quoting a long non-ASCII value: 400 naming the field, not a 500 without a body",
         bad_fields)
    bad_msgs = [[{"role": 5, "content": "x"}], [{"role": "user", "content": {"a": 1}}], [7], [{"content": "x"}],
                [{"role": "assistant", "content": "x", "tool_calls": "f"}], [{"role": "tool", "content": "x",
                                                                                "tool_call_id": 3}],
                [{"role": "assistant", "reasoning_content": 1}], [{"role": "user", "content": [{"type": "image_url"}]}]]
    bad_fields = []
    for m in bad_msgs:
        status, _, out = http(front, "POST", "/v1/chat/completions", dict(base, messages=m))
        err = json.loads(out).get("error", {})
        if not (status == 400 and err.get("param") == "messages" and "messages" in err.get("message", "")):
            bad_fields.append((m, status, err))
    t.ok(not bad_fields, "a wrong type inside messages: 400 naming the message", bad_fields)
    for field, value in {"prompt": {"a": 1}, "echo": "no", "logprobs": True, "suffix": 3}.items():
        status, _, out = http(front, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, field: value})
        t.ok(status == 400 and json.loads(out)["error"]["param"] == field, "completions: wrong %s: 400" % field, out)

    idle = [socket.create_connection(("127.0.0.1", front.port), timeout=TIMEOUT) for _ in range(500)]
    r = chat(front, Q391, temperature=0, max_tokens=3)
    status, _, _ = http(front, "GET", "/health")
    t.ok(r.choices[0].message.content.startswith("391") and status == 200,
         "500 idle connections open: still answering", r.choices[0].message)
    for s in idle:
        s.close()

    drip = socket.create_connection(("127.0.0.1", front.port), timeout=TIMEOUT)
    header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64
    closed_after = None
    served = []

    def other():
        time.sleep(1.5)
        served.append(http(front, "GET", "/health")[0])
    th = threading.Thread(target=other)
    th.start()
    t0 = time.monotonic()
    for i in range(len(header)):
        try:
            drip.sendall(header[i:i + 1])
            drip.settimeout(1.0)
            if drip.recv(1) == b"":
                closed_after = time.monotonic() - t0
                break
        except socket.timeout:
            continue
        except ConnectionError:
            closed_after = time.monotonic() - t0
            break
    th.join()
    drip.close()
    t.ok(closed_after is not None and closed_after < REQUEST_TIMEOUT + 3 and served == [200],
         "a header sent one byte a second is cut off after --request-timeout (%s s), others served meanwhile" %
         (closed_after and "%.1f" % closed_after), (closed_after, served))

    r = raw(front, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 40000 + b"\r\n\r\n")
    t.ok(r == b"" or status_of(r) in (400, 413, 431), "a header above --max-header is refused", r[:200])

    r = chat(front, Q391, temperature=0, max_tokens=3)
    t.ok(r.choices[0].message.content.startswith("391") and front.proc.poll() is None,
         "after all of it the front still serves", r.choices[0].message)

    # ---- stopping (SIGTERM) with a whole and a streamed request in flight: each ends cleanly with an error
    # (the stream with its error event, [DONE] and the chunked body's end) before the connections close
    whole = socket.create_connection(("127.0.0.1", front.port), timeout=TIMEOUT)
    streamed = socket.create_connection(("127.0.0.1", front.port), timeout=TIMEOUT)
    msgs = [{"role": "user", "content": "Hello"}]
    whole.sendall(post(front, {"messages": msgs, "max_tokens": 3000}))
    streamed.sendall(post(front, {"messages": msgs, "max_tokens": 3000, "stream": True}))
    got = {whole: b"", streamed: b""}
    while b"data: " not in got[streamed]:
        got[streamed] += streamed.recv(4096)
    wait_stats(c, lambda x: x["slots_busy"] == 2)
    front.proc.terminate()
    for s in (whole, streamed):
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                got[s] += b
        except (socket.timeout, ConnectionError):
            pass
        s.close()
    t.ok(status_of(got[whole]) == 503 and b'"code":"cancelled"' in got[whole],
         "stopping: a whole request in flight gets 503 cancelled", got[whole][-400:])
    t.ok(b'"code":"cancelled"' in got[streamed] and got[streamed].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"),
         "stopping: a stream in flight ends with an error event, [DONE] and the chunked body's end",
         got[streamed][-400:])
    rc = front.proc.wait(timeout=TIMEOUT)
    t.ok(rc == 0, "dsv4-openai stops cleanly with requests in flight", (rc, front.log_text()[-3000:]))
    front = None

    # ---- DSML tool calls from a scripted dsv4d
    fake = ScriptedDsv4d(os.path.join(tmp.name, "scripted.sock"))
    # --api-key-file given three times: the last key counts, and the ones it replaces are wiped and freed
    # (under ASan a leaked key fails "dsv4-openai stops cleanly" below).
    old_key = os.path.join(tmp.name, "old-key")
    with open(old_key, "w", encoding="utf-8") as f:
        f.write("sk-old\n")
    fake_front = Front(fake.path, tmp.name, ["--model-name", "scripted", "--api-key-file", old_key,
                                             "--api-key-file", os.path.join(tmp.name, "key")])
    status, _, _ = http(fake_front, "GET", "/v1/models", key="sk-old")
    t.ok(status == 401, "a repeated --api-key-file: the last one counts, an earlier key is refused", status)
    p = subprocess.run([program("dsv4-openai"), "--api-key-file", tmp.name, "--listen", "127.0.0.1:0"],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=TIMEOUT)
    t.ok(p.returncode == 1 and os.strerror(errno.EISDIR) in p.stderr.decode(),
         "an --api-key-file that cannot be read: the error says why", p.stderr)
    case = next(x for x in FIXTURE["encode"] if x["name"] == "tools, chat")
    r = fake_front.client.chat.completions.create(model="scripted", messages=case["messages"], tools=case["tools"])
    m = r.choices[0].message
    want = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Tōkyō \\"east\\""}')]
    t.ok(r.choices[0].finish_reason == "tool_calls" and m.content == "Let me check."
         and [(x.function.name, x.function.arguments) for x in m.tool_calls] == want
         and all(x.id.startswith("call_") and x.type == "function" for x in m.tool_calls)
         and len({x.id for x in m.tool_calls}) == 2 and r.usage.prompt_tokens == 42,
         "tool calls: the DSML reply comes back as tool_calls, finish_reason tool_calls", r)
    p = fake.requests[-1]
    parts = p.get("prompt_parts", [])
    t.ok("".join(parts) == case["prompt"] and p.get("add_bos") is False
         and any("Weather in Paris?" == x for x in parts[1::2]) and not any("<｜" in x for x in parts[1::2])
         and "<｜User｜>" in "".join(parts[0::2]),
         "tool calls: dsv4d is sent DeepSeek's encoding as parts, message text only in literal parts", p)
    stream = list(fake_front.client.chat.completions.create(model="scripted", messages=case["messages"],
                                                            tools=case["tools"], stream=True))
    calls = {}
    deltas = 0
    for ch in stream:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            deltas += 1
            e = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
            if tc.id:
                e["id"] = tc.id
            if tc.function and tc.function.name:
                e["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                e["args"] += tc.function.arguments
    content = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
    t.ok([(calls[i]["name"], calls[i]["args"]) for i in sorted(calls)] == want and content == "Let me check."
         and finish == ["tool_calls"] and deltas >= 5 and all(calls[i]["id"] for i in calls),
         "tool calls streamed: name first, then the arguments a parameter at a time (%d deltas)" % deltas,
         [str(x) for x in stream])
    r = fake_front.client.chat.completions.create(model="scripted", messages=case["messages"])
    t.ok(r.choices[0].message.tool_calls is None and r.choices[0].message.content == REPLY
         and r.choices[0].finish_reason == "stop", "without tools, DSML in the reply is only text", r)

    # ---- dsv4d cancelling a generation nobody asked to stop (it drains): an error, never a reply cut short
    drain = [{"role": "user", "content": "DRAIN"}]
    status, _, out = http(fake_front, "POST", "/v1/chat/completions", {"model": "scripted", "messages": drain})
    err = json.loads(out).get("error", {}) if out.startswith(b"{") else {}
    t.ok(status == 503 and err.get("type") == "server_error" and err.get("code") == "cancelled"
         and "dsv4d" in err.get("message", ""), "dsv4d cancels a whole request (draining): 503, not a reply cut short",
         (status, out))
    status, _, out = http(fake_front, "POST", "/v1/chat/completions", {"model": "scripted", "messages": drain,
                                                                       "stream": True})
    events = [e[6:] for e in out.decode().split("\n\n") if e.startswith("data: ")]
    last = json.loads(events[-2]) if len(events) >= 2 and events[-2].startswith("{") else {}
    t.ok(status == 200 and events[-1] == "[DONE]" and last.get("error", {}).get("code") == "cancelled"
         and '"finish_reason":"stop"' not in out.decode(),
         "dsv4d cancels a streamed request (draining): the stream ends with an error, no finish_reason stop", out)

    # ---- stopping while a request is still on its way to dsv4d (here waiting for dsv4d's model name): the
    # stop's cancel holds for it too, it is not sent after, and its client gets 503 cancelled, not a connection
    # cut after the stop's grace
    gate = threading.Event()
    gated = ScriptedDsv4d(os.path.join(tmp.name, "gated.sock"), hello_gate=gate)
    gated_front = Front(gated.path, tmp.name)     # no --model-name: the first request asks dsv4d's hello
    s = socket.create_connection(("127.0.0.1", gated_front.port), timeout=TIMEOUT)
    s.sendall(post(gated_front, {"messages": [{"role": "user", "content": "HOLD"}]}))
    asked = gated.hello_asked.wait(TIMEOUT)
    began = time.monotonic()
    gated_front.proc.terminate()
    while "stopping" not in gated_front.log_text() and time.monotonic() < began + TIMEOUT:
        time.sleep(0.05)
    time.sleep(0.5)     # the stop has cancelled what was in flight
    gate.set()
    got = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
    except (socket.timeout, ConnectionError):
        pass
    s.close()
    rc = gated_front.proc.wait(timeout=TIMEOUT)
    took = time.monotonic() - began
    log = gated_front.log_text()
    gated_front = None
    gated.close()
    t.ok(asked and status_of(got) == 503 and b'"code":"cancelled"' in got and b"shutting down" in got
         and "still running" not in log and rc == 0,
         "stopping while a request waits for dsv4d's hello: it gets 503 cancelled (stopped in %.1f s)" % took,
         (asked, got[-400:], rc, log[-2000:]))
    # ---- /metrics from what dsv4d says of itself: every stat, an older dsv4d's, odd strings, every state, a drain,
    # no dsv4d
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, types, samples = exposition(body.decode())
    spec = {dict(k[1]).get("le", k[0]): v for k, v in samples.items() if k[0].startswith("dsv4d_spec_accepted_drafts")}
    t.ok(status == 200 and not problems
         and {k: sample(samples, k) for k in OPTIONAL_SERIES} == OPTIONAL_SERIES
         and all(types[k] == ("counter" if k.endswith("_total") else "gauge") for k in OPTIONAL_SERIES)
         and spec == {"0": 2, "1": 5, "2": 10, "+Inf": 10, "dsv4d_spec_accepted_drafts_sum": 13,
                      "dsv4d_spec_accepted_drafts_count": 10},
         "/metrics: the allocation, prefix-cache, speculation and heap stats, as dsv4d's stats say",
         (problems, body))
    lat, typed = latency_series(types, samples)
    t.ok(lat == LATENCY_SERIES and typed and "# HELP dsv4d_time_to_first_token_seconds " in body.decode(),
         "/metrics: dsv4d's latency histograms, cumulative by le with +Inf, _sum and _count, typed histogram",
         (lat, body))
    fake.stats["ttft_hist"] = [1] * 5
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, _, samples = exposition(body.decode())
    t.ok(status == 200 and not problems and sample(samples, "dsv4d_up") == 0 and not latency_series({}, samples)[0],
         "/metrics of a dsv4d whose histogram does not match its bounds: refused as malformed (dsv4d_up 0)",
         (problems, body))
    fake.stats = dict(STATS)
    for key in ["device_arena_used", "heap_active", "heap_mapped", "eager_steps", "prefill_tokens_total",
                "prefill_chunks_total"] + \
            [k for k in STATS if k.startswith(("sched_", "prefix_cache_", "spec_"))] + LATENCY_KEYS:
        del fake.stats[key]
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, _, samples = exposition(body.decode())
    t.ok(status == 200 and not problems and sample(samples, "dsv4d_slots") == 4
         and not [k for k in samples if k[0] in OPTIONAL_SERIES or k[0].startswith("dsv4d_spec_")]
         and not latency_series({}, samples)[0],
         "/metrics of a dsv4d that predates a stats key: that key's series is left out, not shown as 0",
         (problems, body))
    fake.stats = dict(STATS)
    fake.stats["backend"] = 'cpu "x"\\'
    fake.stats["kernels"] = ['variant "a"\\b\nc']
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, _, samples = exposition(body.decode())
    t.ok(status == 200 and not problems and sample(samples, "dsv4d_info", backend='cpu "x"\\') == 1
         and sample(samples, "dsv4d_info", kernel='variant "a"\\b\nc') == 1,
         "/metrics: dsv4d's backend and kernel names with quotes, backslashes and newlines are label values "
         "escaped, read back as dsv4d sent them", (problems, body))
    fake.health = "failed"
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, _, samples = exposition(body.decode())
    states = {dict(k[1])["status"]: v for k, v in samples.items() if k[0] == "dsv4d_health"}
    t.ok(status == 200 and not problems
         and states == {"ready": 0, "loading": 0, "draining": 0, "failed": 1, "unknown": 0},
         "/metrics of a failed dsv4d: dsv4d_health{status=\"failed\"} 1, every other state 0", (problems, body))
    fake.health = "ready"
    fake.draining = True
    status, _, body = http(fake_front, "GET", "/health", key=None)
    health = json.loads(body)
    t.ok(status == 503 and health["status"] == "draining" and "shutting down" in health["reason"],
         "/health while dsv4d drains: 503 draining, with dsv4d's reason", body)
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, _, samples = exposition(body.decode())
    t.ok(status == 200 and not problems and sample(samples, "dsv4d_up") == 1
         and sample(samples, "dsv4d_health", status="draining") == 1
         and sample(samples, "dsv4d_health", status="ready") == 0 and sample(samples, "dsv4d_slots") is None,
         "/metrics while dsv4d drains: dsv4d_up 1 and dsv4d_health{status=\"draining\"} 1 (it answers no stats)",
         (problems, body))
    os.unlink(fake.path)    # no socket to connect to (closing the listener leaves its pending accept serving)
    status, _, body = http(fake_front, "GET", "/metrics")
    problems, _, samples = exposition(body.decode())
    t.ok(status == 200 and not problems and sample(samples, "dsv4d_up") == 0
         and not any(k[0] == "dsv4d_health" for k in samples)
         and sample(samples, "dsv4_openai_requests_total", endpoint="metrics") is not None,
         "/metrics with no dsv4d: 200, dsv4d_up 0 and the front's own counters", (problems, body))

    # ---- logprobs' second connection (it detokenizes the alternatives) has no generate in flight: dsv4d
    # closes it as one idle connection too many (max_idle_per_uid), and the choice fails rather than
    # answer token texts that are "". Not socket-activated: the activating connection would be idle too.
    d2 = Daemon(args=["--max-batch", "4", "--max-context", "2048", "--max_idle_per_uid", "1"], model=MODEL,
                tokenizer=False, endless=True, activation=False)
    t.ok(d2.start(), "a dsv4d with max_idle_per_uid 1 is ready", d2.log_text())
    idle_front = Front(d2.sock_path, tmp.name)
    t.ok(idle_front.wait_ready(), "dsv4-openai is up in front of it", idle_front.log_text())
    status, _, out = http(idle_front, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1500, "n": 2,
                           "logprobs": True, "top_logprobs": 1})
    body = json.loads(out) if out.startswith(b"{") else {}
    empty = [sum(1 for e in (c.get("logprobs") or {}).get("content", []) if e["token"] == "")
             for c in body.get("choices", [])]
    t.ok(status == 503 and "max_idle_per_uid" in body.get("error", {}).get("message", ""),
         "dsv4d closing a choice's logprobs connection: 503 naming why, not logprobs with empty tokens (%s)" % empty,
         (status, out[:600]))
finally:
    for f in (front, fake_front, idle_front, gated_front):
        if f:
            rc = f.stop()
            t.ok(rc == 0, "dsv4-openai stops cleanly", (rc, f.log_text()[-3000:]))
    if fake:
        fake.close()
    if d2:
        d2.stop()
        d2.close()
    d.stop()
    d.close()
t.done()
