#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Malformed and hostile input: each case gets its documented error (an error response to its
msgid, the connection staying usable) or, for framing errors, an `error` notification and a closed
connection, while a witness client on another connection keeps being served."""

import socket
import struct
import threading

import msgpack

from dsv4d_harness import BOS, LONG_PROMPT, TIMEOUT, Client, Closed, Daemon, Tap, tokens_bin

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

t.done()
