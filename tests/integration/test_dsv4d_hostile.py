#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Malformed and hostile input: each case gets its documented error (an error response to its
msgid, the connection staying usable) or, for framing errors, an `error` notification and a closed
connection, while a witness client on another connection keeps being served."""

import os
import resource
import socket
import struct
import threading
import time

from dsv4d_harness import (BOS, LONG_PROMPT, TAGS, TIMEOUT, Client, Closed, Daemon, Tap, bin_tokens, text_tokens,
                           tokens_bin)

import msgpack  # after the harness, which skips the test when it is missing

t = Tap()


def frame(payload):
    return struct.pack(">I", len(payload)) + payload


def raw(obj):
    return msgpack.packb(obj, use_bin_type=True)


def request(method, params, msgid=7):
    return frame(raw([0, msgid, method, [params]]))


def gen(params, msgid=7):
    return request("generate", params, msgid)


# Fatal cases: (name, bytes sent, code of the error notification before the close).
FATAL = [
    ("length prefix 0", struct.pack(">I", 0), 101),
    ("length prefix 4 GiB - 1", struct.pack(">I", 0xFFFFFFFF), 100),
    ("length prefix just above max_frame", struct.pack(">I", (8 << 20) + 1), 100),
    ("reserved byte 0xc1", frame(b"\x94\x00\x01\xc1\x90"), 103),
    ("ext type", frame(b"\x94\x00\x01\xa6health\xd4\x01\x00"), 103),
    ("array32 claiming 4 billion elements", frame(b"\xdd\xff\xff\xff\xff"), 102),
    ("map32 claiming 4 billion entries", frame(b"\xdf\xff\xff\xff\xff\x00"), 102),
    ("str32 claiming 4 GiB", frame(b"\x94\x00\x01\xdb\xff\xff\xff\xff"), 102),
    ("bin32 claiming 4 GiB", frame(b"\x94\x00\x01\xa8generate\x91\x81\xa6tokens\xc6\xff\xff\xff\xf0"), 102),
    ("array16 claiming more than the frame", frame(b"\xdc\xff\xff\x00"), 102),
    ("two values in one frame", frame(raw([0, 1, "health", []]) + b"\xc0"), 104),
    ("value cut short inside the frame", frame(b"\x94\x00\x01"), 102),
    ("arrays nested 100 deep", frame(b"\x94\x00\x01\xa6health" + b"\x91" * 100 + b"\xc0"), 105),
    ("70000 objects in one frame", frame(b"\x94\x00\x01\xa6health\xdd" + struct.pack(">I", 70000) + b"\xc0" * 70000),
     106),
    ("a 5 MiB string", frame(raw([0, 1, "generate", [{"prompt": "x" * (5 << 20)}]])), 107),
    ("a 5 MiB bin", frame(raw([0, 1, "generate", [{"tokens": b"\x00" * (5 << 20)}]])), 108),
    ("top level is a map", frame(raw({"method": "health"})), 109),
    ("array of 2", frame(raw([0, 1])), 109),
    ("message type 3", frame(raw([3, 1, "health", []])), 109),
    ("request with 3 elements", frame(raw([0, 1, "health"])), 109),
    ("msgid -1", frame(raw([0, -1, "health", []])), 110),
    ("msgid 2^32", frame(raw([0, 1 << 32, "health", []])), 110),
    ("msgid a string", frame(raw([0, "one", "health", []])), 110),
    ("a response sent to the server", frame(raw([1, 1, None, {}])), 111),
    ("a notification sent to the server", frame(raw([2, "token", [{}]])), 111),
]

# Per-request errors: (name, bytes, code of the error response to msgid 7).
ERRORS = [
    ("unknown method", request("frobnicate", {}), 200),
    ("method not a string", frame(raw([0, 7, 5, []])), 201),
    ("params a number", frame(raw([0, 7, "generate", 5])), 201),
    ("prompt a number", gen({"prompt": 5}), 201),
    ("temperature a string", gen({"prompt": "hi", "temperature": "hot"}), 201),
    ("hello without protocol", request("hello", {}), 202),
    ("generate without a prompt", gen({"max_tokens": 3}), 202),
    ("cancel without msgid", request("cancel", {}), 202),
    ("misspelt field", gen({"prompt": "hi", "temprature": 0.5}), 203),
    ("stats with a field", request("stats", {"verbose": True}), 203),
    ("invalid UTF-8 in the prompt", frame(b"\x94\x00\x07\xa8generate\x91\x81\xa6prompt\xa2\xc3\x28"), 204),
    ("invalid UTF-8 in a message", gen({"messages": [{"role": "user", "content": b"\xff".decode("latin-1")}]})
     .replace(b"\xc3\xbf", b"\xff\xfe"), 204),
    ("duplicate field", frame(b"\x94\x00\x07\xa8generate\x91\x82\xa6prompt\xa1a\xa6prompt\xa1b"), 205),
    ("prompt and tokens", gen({"prompt": "hi", "tokens": tokens_bin([BOS])}), 206),
    ("tokens of 5 bytes", gen({"tokens": b"\x00" * 5}), 207),
    ("empty tokens", gen({"tokens": b""}), 207),
    ("role wizard", gen({"messages": [{"role": "wizard", "content": "hi"}]}), 208),
    ("hello protocol 0", request("hello", {"protocol": 0}), 209),
    ("token id out of the vocabulary", gen({"tokens": tokens_bin([BOS, 999999])}), 300),
    ("negative token id", gen({"tokens": tokens_bin([BOS, -5])}), 300),
    ("stop_token_ids out of the vocabulary", gen({"tokens": tokens_bin([BOS]), "stop_token_ids": [4096]}), 300),
    ("detokenize an id out of the vocabulary", request("detokenize", {"tokens": tokens_bin([1 << 30])}), 300),
    ("prompt longer than the context", gen({"tokens": tokens_bin([BOS] * 300)}), 301),
    ("text prompt longer than the context", gen({"prompt": "y" * 400}), 301),
    ("temperature NaN", gen({"prompt": "hi", "temperature": float("nan")}), 302),
    ("temperature -1", gen({"prompt": "hi", "temperature": -1.0}), 302),
    ("temperature infinite", gen({"prompt": "hi", "temperature": float("inf")}), 302),
    ("top_p 2", gen({"prompt": "hi", "top_p": 2.0}), 302),
    ("min_p -0.5", gen({"prompt": "hi", "min_p": -0.5}), 302),
    ("repetition_penalty 0", gen({"prompt": "hi", "repetition_penalty": 0.0}), 302),
    ("presence_penalty 1e30", gen({"prompt": "hi", "presence_penalty": 1e30}), 302),
    ("max_tokens 0", gen({"prompt": "hi", "max_tokens": 0}), 302),
    ("logprobs 1000", gen({"prompt": "hi", "logprobs": 1000}), 302),
    ("17 stop strings", gen({"prompt": "hi", "stop": ["s%d" % i for i in range(17)]}), 403),
    ("a 1000-byte stop string", gen({"prompt": "hi", "stop": ["z" * 1000]}), 403),
    ("65 stop_token_ids", gen({"prompt": "hi", "stop_token_ids": list(range(65))}), 403),
    ("5000 chat messages", gen({"messages": [{"role": "user", "content": "a"}] * 5000}), 404),
]

d = Daemon(args=["--max-context", "256"], endless=True)
try:
    t.ok(d.start(), "dsv4d is ready", d.log_text())
    witness = Client(d.sock_path)

    def witness_ok(case):
        try:
            err, h = witness.call("health")
            return t.ok(err is None and h["status"] == "ready", "  and the daemon serves others after: " + case)
        except (Closed, OSError) as e:
            return t.ok(False, "  and the daemon serves others after: " + case, e)

    for name, data, code in FATAL:
        c = Client(d.sock_path)
        try:
            c.send_raw(data)
        except (BrokenPipeError, ConnectionResetError):
            pass    # the server may close before reading all of a huge frame
        closed = c.closed_by_peer()
        notes = [m for m in c.notifications if m[0] == 2 and m[1] == "error"]
        got = notes[-1][2][0]["code"] if notes else None
        t.ok(closed and got == code, "%s: error notification %d, then the connection closes" % (name, code),
             "closed=%s notifications=%r" % (closed, [repr(m)[:200] for m in c.notifications]))
        c.close()
        witness_ok(name)

    c = Client(d.sock_path)
    for name, data, code in ERRORS:
        c.send_raw(data)
        try:
            m = c.recv()
            ok = m[0] == 1 and m[1] == 7 and m[2] is not None and m[2]["code"] == code and m[2]["message"]
        except Closed:
            m, ok = "connection closed", False
        t.ok(ok, "%s: error %d to its msgid" % (name, code), repr(m)[:400])
        if ok is False and m == "connection closed":
            c = Client(d.sock_path)
    err, h = c.call("health")
    t.ok(err is None and h["status"] == "ready", "the connection that sent every bad request is still served")

    # Client text reaches the log (hello's client name; at debug level the field names of refused
    # requests): a line break in it must not start a line of its own, which journald would file as
    # an entry at the priority the client wrote.
    forged = "<0>forged emergency"
    err, _ = c.call("hello", {"protocol": 1, "client": "probe\n" + forged + "\r\n<3>forged error"})
    c.send_raw(gen({"prompt": "hi", "x\n" + forged: 1}, msgid=8))
    c.response(8)
    lines = d.log_text().splitlines()
    t.ok(err is None and not any(line.startswith(("<0>forged", "<3>forged")) for line in lines) and
         sum("forged emergency" in line for line in lines) == 2,
         "client text with line breaks stays on its log line", [line for line in lines if "forged" in line])

    # A second request with the msgid of one still in flight.
    mid = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 200, "temperature": 0.0,
                                 "stream": True})
    c.request("generate", {"tokens": tokens_bin([BOS, 9]), "max_tokens": 2}, msgid=mid)
    dup = None
    while True:
        m = c.recv()
        if m[0] == 1 and m[2] is not None:
            dup = m[2]["code"]
        if m[0] == 1 and m[2] is None:
            break
    t.eq(dup, 210, "a msgid already in flight gets duplicate_msgid (210)")

    # A frame that never completes (slow or stuck client) holds no one else up.
    stuck = Client(d.sock_path)
    stuck.send_raw(struct.pack(">I", 1000) + b"\x94\x00")
    witness_ok("a frame that never completes")
    # A truncated frame at end of stream: the connection just ends.
    cut = Client(d.sock_path)
    cut.send_raw(struct.pack(">I", 1000) + b"\x94\x00\x01")
    cut.sock.shutdown(socket.SHUT_WR)
    t.ok(cut.closed_by_peer(), "a frame cut by the end of the stream closes that connection")
    witness_ok("a truncated frame")
    # A frame of garbage.
    spray = Client(d.sock_path)
    try:
        spray.send_raw(frame(bytes((i * 97 + 13) % 256 for i in range(4096))))
    except OSError:
        pass
    t.ok(spray.closed_by_peer(), "a frame of garbage gets the connection closed")
    witness_ok("a frame of garbage")

    # Clients that send a request the daemon refuses after tokenizing it (or accepts) and leave at
    # once, without reading: the answer meets a closed socket.
    for k in range(64):
        quitter = Client(d.sock_path)
        params = {"prompt": "y" * 400} if k % 2 else {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 50,
                                                        "stream": True}
        quitter.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        quitter.send_raw(gen(params, msgid=k))
        quitter.close()
    witness_ok("64 clients that leave right after their request")

    # A client pipelining 20000 requests while reading slowly: the daemon stops reading it while its
    # answers back up (bounded memory), serves others meanwhile, and answers every request in order.
    flood = Client(d.sock_path)
    N = 20000
    burst = b"".join(request("health", {}, msgid=i) for i in range(N))
    sender = threading.Thread(target=flood.send_raw, args=(burst,))
    sender.start()
    witness_ok("a client flooding requests")
    ids = []
    try:
        while len(ids) < N:
            m = flood.recv()
            ids.append(m[1] if m[0] == 1 and m[2] is None else None)
    except Closed:
        pass
    sender.join(TIMEOUT)
    t.ok(ids == list(range(N)), "all %d pipelined requests are answered, in order" % N,
         "%d answers, first bad at %r" % (len(ids), next((i for i, x in enumerate(ids) if x != i), None)))
    flood.close()

    err, res = witness.call("generate", {"tokens": tokens_bin([BOS, 20, 21]), "max_tokens": 4, "temperature": 0.0})
    t.ok(err is None and res["usage"]["completion_tokens"] >= 1, "generation still works after all of it", err)
    stuck.close()
    c.close()
    witness.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- a client stalled inside a frame is dropped; idle connections per uid are bounded --------------
# frame_timeout 2 s: the frame paused for 0.5 s below stays partial across two sweep periods (an eighth
# of the timeout each) and still has 1.5 s of slack for a loaded machine to deliver its second half.
d = Daemon(activation=False, args=["--max-context", "256", "--frame-timeout", "2", "--max-idle-per-uid", "4"],
           endless=True)
try:
    t.ok(d.start(), "dsv4d with frame_timeout = 2 s and max_idle_per_uid = 4 becomes ready", d.log_text())
    stalled = Client(d.sock_path, timeout=30)
    stalled.send_raw(struct.pack(">I", 1000) + b"\x94\x00")
    start = time.monotonic()
    closed = stalled.closed_by_peer()
    waited = time.monotonic() - start
    t.ok(closed and 1.9 <= waited < 10, "a connection holding half a frame is closed after frame_timeout "
         "(%.1f s)" % waited, d.log_text()[-2000:])
    t.ok("held a partial frame (6 bytes) for more than 2 s (frame_timeout)" in d.log_text(), "  and the log says why",
         d.log_text()[-2000:])
    stalled.close()
    slow = Client(d.sock_path)
    whole = request("health", {}, msgid=3)
    slow.send_raw(whole[:5])
    time.sleep(0.5)
    slow.send_raw(whole[5:])
    err, h = slow.response(3)
    t.ok(err is None and h["status"] == "ready", "a frame that completes within frame_timeout is served", err)

    # Six fresh connections are let in (a fresh one is not idle); once idle for a second, the two idle
    # longest are told and closed, and a new one is refused at once.
    idle = [slow] + [Client(d.sock_path) for _ in range(5)]
    for c in idle[1:]:
        c.call("health")
    time.sleep(2.5)
    gone = []
    for c in idle:
        c.sock.settimeout(0.5)
        if c.closed_by_peer():
            gone.append(c)
        c.sock.settimeout(TIMEOUT)
    t.ok(len(gone) == 2 and all(c.notifications and c.notifications[-1][2][0]["code"] == 400 for c in gone) and
         idle[0] in gone and idle[1] in gone,
         "past max_idle_per_uid the connections idle longest get too_many_connections (400) and are closed",
         [(idle.index(c), c.notifications) for c in gone])
    idle = [c for c in idle if c not in gone]
    extra = Client(d.sock_path)
    t.ok(extra.closed_by_peer() and extra.notifications and extra.notifications[-1][2][0]["code"] == 400 and
         "max_idle_per_uid = 4" in extra.notifications[-1][2][0]["message"],
         "a new connection of a uid holding 4 idle ones gets too_many_connections (400)", extra.notifications)
    extra.close()
    busy = idle[0].request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 200, "stream": True})
    idle[0].recv()
    extra = Client(d.sock_path)
    err, h = extra.call("health")
    t.ok(err is None, "a connection with a request in flight is not idle: a new one is served", err)
    idle[0].request("cancel", {"msgid": busy})
    for c in idle + [extra]:
        c.close()

    # A connection being closed (here after a fatal frame) whose client takes none of its last messages
    # is not idle, and was never closed: one uid could hold every max_connections slot that way. It
    # goes once it has taken nothing for frame_timeout.
    watch = Client(d.sock_path)
    err, st = watch.call("stats")
    alone = st["connections"]
    deaf = []
    start = time.monotonic()
    for _ in range(3):
        c = Client(d.sock_path)
        c.send_raw(b"".join(request("health", {}, msgid=i) for i in range(3000)) + struct.pack(">I", 0))
        deaf.append(c)
    counts = []
    while time.monotonic() - start < 10:
        counts.append(watch.call("stats")[1]["connections"])
        if counts[-1] == alone and len(counts) > 1:
            break
        time.sleep(0.2)
    waited = time.monotonic() - start
    t.ok(max(counts) == alone + 3 and counts[-1] == alone and 1.9 <= waited < 10,
         "connections closing with output their clients never take are closed after frame_timeout (%.1f s)" % waited,
         (alone, counts, d.log_text()[-2000:]))
    t.ok("took none of its last" in d.log_text(), "  and the log says why", d.log_text()[-2000:])
    for c in deaf + [watch]:
        c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- huge prompts: refused by their size before tokenizing; large ones tokenized off the io thread ---
d = Daemon(activation=False, args=["--max-context", "65536", "--max-batch", "2"], endless=True)
try:
    t.ok(d.start(), "dsv4d with max_context = 65536 becomes ready", d.log_text())
    c = Client(d.sock_path)
    err, _ = c.call("generate", {"prompt": "x" * (4 << 20), "max_tokens": 1})
    t.ok(err is not None and err["code"] == 301 and "bytes of text are at least" in err["message"],
         "a 4 MiB prompt is prompt_too_long by its size, before it is tokenized", err)
    err, _ = c.call("generate", {"messages": [{"role": "user", "content": "y" * (3 << 20)}]})
    t.ok(err is not None and err["code"] == 301 and "bytes of text are at least" in err["message"],
         "so are 3 MiB of chat messages", err)

    # Eight 1 MiB prompts (each 1 Mi tokens: too long only once tokenized) pipelined on one connection;
    # a witness on another connection is answered while they are being tokenized.
    N = 8
    big = Client(d.sock_path)
    done_at = {}

    def read_big():
        try:
            while len(done_at) < N:
                m = big.recv()
                if m[0] == 1:
                    done_at[m[1]] = (time.monotonic(), m[2])
        except (Closed, OSError):
            pass
    reader = threading.Thread(target=read_big)
    reader.start()
    big.send_raw(b"".join(gen({"prompt": chr(ord("a") + k) * (1 << 20), "max_tokens": 1}, msgid=100 + k)
                          for k in range(N)))
    time.sleep(0.05)
    witness2 = Client(d.sock_path)
    err, res = witness2.call("generate", {"prompt": "hello", "max_tokens": 2, "temperature": 0.0})
    witness_at = time.monotonic()
    reader.join(TIMEOUT)
    t.ok(err is None and res["usage"]["completion_tokens"] == 2, "the witness is served", err)
    t.ok(len(done_at) == N and all(e is not None and e["code"] == 301 for _, e in done_at.values()),
         "each large prompt is answered prompt_too_long once tokenized", done_at)
    t.ok(len(done_at) == N and witness_at < max(at for at, _ in done_at.values()),
         "the witness did not wait for the large prompts to be tokenized",
         (witness_at, sorted(at for at, _ in done_at.values())))
    big.close()

    # tokenize of a large text is answered from the worker too, exactly.
    err, res = c.call("tokenize", {"text": "ab" * (40 << 10), "add_bos": False})
    t.ok(err is None and bin_tokens(res["tokens"]) == text_tokens("ab" * (40 << 10)),
         "tokenize of 80 KiB (on the prompt worker) gives the ids", err)

    # Cancelled while tokenizing, and a client leaving while its prompt is tokenized.
    _, st0 = c.call("stats")
    mid = c.request("generate", {"prompt": "z" * (1 << 20), "max_tokens": 1})
    err, res = c.call("cancel", {"msgid": mid})
    t.ok(err is None and res["cancelled"], "a request being tokenized can be cancelled", (err, res))
    err, res = c.response(mid)
    t.ok(err is None and res["finish_reason"] == "cancelled", "  and answers cancelled", (err, res))
    _, st1 = c.call("stats")
    t.ok(st1["requests_cancelled"] == st0["requests_cancelled"] + 1
         and st1["requests_total"] == st0["requests_total"] + 1,
         "  and counts in stats as a request, and a cancelled one (never more cancelled than requests)", (st0, st1))
    for k in range(4):
        q = Client(d.sock_path)
        q.send_raw(gen({"prompt": "q" * (1 << 20), "max_tokens": 1}, msgid=k))
        q.close()
    err, res = witness2.call("generate", {"prompt": "hello", "max_tokens": 2, "temperature": 0.0})
    t.ok(err is None, "clients leaving while their prompts are tokenized harm no one", err)
    witness2.close()
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- a tokenize encoded on the prompt worker is a request in flight --------------------------------
# It holds its text until the worker is done: without the per-connection bound a client pipelining
# large texts made the daemon hold every one of them at once (40 x 4 MiB: 200 MB with a bound of 2).
d = Daemon(activation=False, args=["--max-context", "256", "--max-requests-per-conn", "2"], endless=True)
try:
    t.ok(d.start(), "dsv4d with max_requests_per_conn = 2 becomes ready", d.log_text())
    c = Client(d.sock_path)
    busy = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 200, "stream": True})
    c.recv()
    err, res = c.response(c.request("tokenize", {"text": "w" * (64 << 10)}, msgid=busy))
    t.ok(err is not None and err["code"] == 210,
         "a large tokenize with the msgid of a generate in flight gets duplicate_msgid (210)", (err, res and "ids"))
    c.request("cancel", {"msgid": busy})

    tag = TAGS[2]
    text = tag * ((1 << 20) // len(tag.encode("utf-8")))
    N = 16
    flood = Client(d.sock_path)
    answers = {}

    def read_flood():
        try:
            while len(answers) < N:
                m = flood.recv()
                if m[0] == 1:
                    answers[m[1]] = m[2] if m[2] is not None else len(bin_tokens(m[3]["tokens"]))
        except (Closed, OSError):
            pass
    reader = threading.Thread(target=read_flood)
    reader.start()
    flood.send_raw(b"".join(request("tokenize", {"text": text, "add_bos": False}, msgid=100 + k) for k in range(N)))
    reader.join(TIMEOUT)
    refused = [e for e in answers.values() if isinstance(e, dict)]
    served = [n for n in answers.values() if not isinstance(n, dict)]
    t.ok(len(answers) == N and refused and all(e["code"] == 402 and "max_requests_per_conn = 2" in e["message"]
                                               for e in refused),
         "%d large tokenize texts pipelined: those past max_requests_per_conn get too_many_requests (402)" % N,
         {k: v if isinstance(v, dict) else "%d ids" % v for k, v in answers.items()})
    t.ok(served and all(n == len(text) // len(tag) for n in served), "  and the ones taken are encoded exactly",
         served)
    flood.close()
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- max_queued holds for prompts tokenized on the worker ----------------------------------------
# A prompt of more than 16 KiB is tokenized off the io thread, and the queue may fill meanwhile: each
# one ready to queue is counted against max_queued then, not only when it arrived.
d = Daemon(activation=False, args=["--max-context", "4096", "--max-batch", "1", "--max-queued", "1"], endless=True)
try:
    t.ok(d.start(), "dsv4d with max_batch = 1 and max_queued = 1 becomes ready", d.log_text())
    c = Client(d.sock_path)
    busy = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 4000, "stream": True})
    c.recv()                                # its first token: it holds the only slot
    N = 6
    text = TAGS[0] * 600                    # 17400 bytes, 600 tokens: tokenized on the worker
    big = Client(d.sock_path)
    big.send_raw(b"".join(gen({"prompt": text, "max_tokens": 1}, msgid=100 + k) for k in range(N)))
    refused = []
    while len(refused) < N - 2:
        m = big.recv()
        if m[0] == 1:
            refused.append(m[2])
    watcher = Client(d.sock_path)
    err, st = watcher.call("stats")
    t.ok(err is None and st["queue_depth"] <= 1, "no more than max_queued requests wait for the slot",
         (err, st and st["queue_depth"]))
    if err is None and st["queue_depth"] <= 1:
        m = big.recv()
        refused.append(m[2] if m[0] == 1 else m)
    t.ok(len(refused) == N - 1 and all(e and e["code"] == 401 and "max_queued = 1" in e["message"] for e in refused),
         "the large prompts past it get queue_full (401), naming max_queued", refused)
    c.request("cancel", {"msgid": busy})
    big.close()
    watcher.close()
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# ---- out of file descriptors with no connection open: accepting resumes once there are some --------
d = Daemon(activation=False, args=["--max-context", "256"])
try:
    t.ok(d.start(), "dsv4d becomes ready", d.log_text())
    # Its descriptor limit lowered to the lowest free descriptor: the next accept fails with EMFILE, as
    # when the shortage is someone else's (ENFILE) and no connection of dsv4d's own can close.
    used = {int(fd) for fd in os.listdir("/proc/%d/fd" % d.proc.pid)}
    limits = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (min(set(range(len(used) + 1)) - used), limits[1]))
    c = Client(d.sock_path, timeout=30)
    c.request("health", {}, msgid=5)
    deadline = time.monotonic() + TIMEOUT
    while "accept: Too many open files" not in d.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    t.ok("accept: Too many open files" in d.log_text(), "with no descriptor left the accept fails and is logged",
         d.log_text()[-1000:])
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, limits)
    try:
        err, h = c.response(5)
    except (Closed, OSError) as e:
        err, h = e, None
    t.ok(err is None and h["status"] == "ready", "once descriptors are available again, the waiting client is served",
         (err, d.log_text()[-1000:]))
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

t.done()
