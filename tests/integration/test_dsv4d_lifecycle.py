#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""dsv4d's life with systemd: socket activation, READY only after the warm-up, the watchdog, the
drain on SIGTERM with STOPPING=1; by hand with --listen: socket mode, live and stale sockets;
--backend auto without a GPU says so; the uid allowlist; the routing statistics written at stop and
read back as an expert placement."""

import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

from dsv4d_harness import (BOS, FIXTURE_MODEL, FIXTURE_VOCAB, LONG_PROMPT, TIMEOUT, TOP_BUILDDIR, Client, Closed, Daemon,
                           Tap, program, text_tokens, tokens_bin, write_tokenizer)

t = Tap()


def have_cuda():
    with open(os.path.join(TOP_BUILDDIR, "build-config.h")) as f:
        return "#define HAVE_CUDA 1" in f.read()


def run_dsv4d(tmp, listen, *extra, model=FIXTURE_MODEL, timeout=TIMEOUT):
    """dsv4d --listen PATH in the foreground, for the cases where it must refuse to start."""
    return subprocess.run([program("dsv4d"), "--config", "", "--model", model, "--backend", "cpu",
                           "--tokenizer", os.path.join(tmp, "tokenizer.json"), "--listen", listen] + list(extra),
                          capture_output=True, text=True, timeout=timeout)


# ---- socket activation, readiness, watchdog, drain --------------------------------------------------
d = Daemon(activation=True, args=["--max-context", "4096", "--drain-grace", "600"], env={"WATCHDOG_USEC": "900000"},
           endless=True)
try:
    t.ok(d.wait_socket(), "systemd-socket-activate listens", d.log_text())
    # The first connection starts dsv4d; its request waits for READY instead of failing.
    first = d.first_client()
    mid = first.request("generate", {"tokens": tokens_bin([BOS] + text_tokens("hi")), "max_tokens": 3,
                                     "temperature": 0.0})
    err, res = first.response(mid)
    t.ok(err is None and res["usage"]["completion_tokens"] >= 1,
         "a request sent while dsv4d boots is answered once it is ready", (err, res, d.log_text()))
    tm = res["timings"] if res else {}
    parts = tm["queue_ms"] + tm["prefill_ms"] + tm["decode_ms"] if tm else 0
    t.ok(err is None and tm["total_ms"] - parts < 0.1 * tm["total_ms"] + 20,
         "  its queue_ms counts the wait for READY (queue, prefill and decode make up total_ms)", tm)
    ready = d.notify.wait_for("READY", "1", proc=d.proc)
    t.ok(ready >= 0, "READY=1 is sent", d.notify.messages)
    warm = [i for i, m in enumerate(d.notify.messages) if "warm-up" in m.get("STATUS", "")]
    t.ok(warm and warm[0] < ready, "STATUS announces the warm-up before READY=1", d.notify.messages)
    log = d.log_text()
    t.ok(0 <= log.find("warm-up generated") < log.find("ready in"),
         "the warm-up generation completed before readiness", log)
    t.ok(any("loading" in m.get("STATUS", "") for m in d.notify.messages[:ready]),
         "STATUS reports loading progress during boot", d.notify.messages)
    t.ok(any(int(m.get("EXTEND_TIMEOUT_USEC", "0")) > 0 for m in d.notify.messages[:ready]),
         "EXTEND_TIMEOUT_USEC extends the start timeout during boot", d.notify.messages)
    t.ok(all(line[:3] in ("<3>", "<4>", "<5>", "<6>", "<7>") for line in log.splitlines()
             if line and not line.startswith(("Listening on", "Communication attempt", "Execing"))),
         "every log line carries an sd-daemon priority prefix", log)
    t.ok("listening on %s (dsv4d)" % d.sock_path in log,
         "under socket activation the log names the socket's path and its name", log)
    # Pings may also come while it boots (a slow sanitizer build): the check is for one after READY.
    t.ok(d.notify.wait_for("WATCHDOG", "1", timeout=30, proc=d.proc, after=ready) > ready,
         "WATCHDOG=1 is sent when WATCHDOG_USEC is set", d.notify.messages)

    err, h = first.call("health")
    t.ok(err is None and h["status"] == "ready", "health says ready", (err, h))
    err, hello = first.call("hello", {"protocol": 1, "client": "lifecycle test"})
    t.ok(err is None and hello["protocol"] == 1 and hello["backend"] == "cpu" and hello["max_context"] == 4096
         and hello["model"]["vocab_size"] == FIXTURE_VOCAB, "hello reports the protocol, model and backend",
         (err, hello))

    # Drain: a long request streaming on one connection is let finish after SIGTERM; a new request
    # on another connection meanwhile is refused with `draining`.
    other = Client(d.sock_path)
    err, _ = other.call("health")
    long_id = first.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 1000,
                                         "temperature": 0.0, "stream": True})
    note = first.recv()
    t.ok(note[0] == 2 and note[1] == "token", "the long request streams", note)
    d.proc.send_signal(signal.SIGTERM)
    stopping = d.notify.wait_for("STOPPING", "1", proc=d.proc)
    t.ok(stopping > ready, "STOPPING=1 follows SIGTERM", d.notify.messages)
    err, _ = other.call("generate", {"tokens": tokens_bin([BOS, 7]), "max_tokens": 2})
    t.ok(err is not None and err["code"] == 501 and err["name"] == "draining",
         "a new request during the drain gets `draining` (501)", err)
    err, res = first.response(long_id, on_notification=lambda m: None)
    t.ok(err is None and res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == 1000,
         "the in-flight request finishes within the grace period", (err, res and res.get("finish_reason")))
    t.ok(first.closed_by_peer(), "connections close after the drain")
    rc = d.stop()
    t.eq(rc, 0, "dsv4d exits 0 after the drain")
    other.close()
    first.close()
finally:
    d.close()

# ---- a drain: queued requests cancelled at once, running ones finish, as the log says ---------------
DRAIN_TOKENS = 3000     # the running request's answer: seconds of decoding on the fixture model
d = Daemon(activation=True, args=["--max-context", "4096", "--max-batch", "1", "--drain-grace", "600"],
           endless=True)
try:
    t.ok(d.start(), "dsv4d (max_batch = 1) becomes ready", d.log_text())
    c = Client(d.sock_path)
    # long enough that it is still running when the late connection below is made, on a loaded machine too
    running = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": DRAIN_TOKENS, "temperature": 0.0,
                                     "stream": True})
    c.recv()
    queued = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 5, "temperature": 0.0})
    err, st = c.call("stats")
    t.ok(err is None and st["slots_busy"] == 1 and st["queue_depth"] == 1, "one request runs, one is queued",
         (err, st))
    d.proc.send_signal(signal.SIGTERM)
    d.notify.wait_for("STOPPING", "1", proc=d.proc)
    err, res = c.response(queued, on_notification=lambda m: None)
    t.ok(err is None and res["finish_reason"] == "cancelled" and res["usage"]["completion_tokens"] == 0,
         "the queued request ends cancelled with no tokens", (err, res))
    late = Client(d.sock_path)
    try:
        note = late.recv()
        t.ok(note[0] == 2 and note[1] == "error" and note[2][0]["code"] == 501 and late.closed_by_peer(),
             "a connection made during the drain gets the error notification `draining` and is closed", note)
    except (Closed, OSError) as e:
        t.ok(False, "a connection made during the drain gets the error notification `draining`", repr(e))
    late.close()
    err, res = c.response(running, on_notification=lambda m: None)
    t.ok(err is None and res["finish_reason"] == "length" and res["usage"]["completion_tokens"] == DRAIN_TOKENS,
         "the running request finishes", (err, res and res.get("finish_reason")))
    t.eq(d.stop(), 0, "dsv4d exits 0 after the drain")
    log = d.log_text()
    t.ok(log.count("SIGTERM: finishing 1 running requests within 600 s; 1 queued ones cancelled") == 1,
         "the log says what the drain does, once", log)
    t.ok(any("SIGTERM: finishing 1 running" in m.get("STATUS", "") for m in d.notify.messages),
         "and so does STATUS=", d.notify.messages)
    t.ok("after a protocol error" not in log, "no close of the drain is logged as a protocol error", log)
    c.close()
finally:
    d.close()

# ---- a drain while accepting is paused for want of descriptors: new clients are still told ----------
d = Daemon(activation=False, args=["--max-context", "32768", "--max-batch", "1", "--drain-grace", "600",
                                   "--max-idle-per-uid", "0"], endless=True)
fillers = []
try:
    t.ok(d.start(), "dsv4d (max_batch = 1, --listen) becomes ready", d.log_text())
    c = Client(d.sock_path)
    # still running when the drain starts (the second SIGTERM below ends it)
    c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 30000, "temperature": 0.0, "stream": True})
    c.recv()
    # Room for a few more descriptors: the connections after those wait in the backlog, accepting paused.
    top = max(int(fd) for fd in os.listdir("/proc/%d/fd" % d.proc.pid))
    hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (top + 4, hard))
    deadline = time.monotonic() + TIMEOUT
    while "not accepting" not in d.log_text() and len(fillers) < 64 and time.monotonic() < deadline:
        fillers.append(Client(d.sock_path))
        for _ in range(10):
            if "not accepting" in d.log_text():
                break
            d.notify.poll(0.05)
    t.ok("not accepting" in d.log_text(), "out of descriptors, dsv4d pauses accepting", d.log_text()[-2000:])
    d.proc.send_signal(signal.SIGTERM)
    # The log, not STOPPING=1: sd_notify needs a descriptor too.
    while "SIGTERM: finishing" not in d.log_text() and d.proc.poll() is None and time.monotonic() < deadline:
        d.notify.poll(0.05)
    late = Client(d.sock_path, timeout=min(TIMEOUT, 30))
    fillers.pop(0).close()      # an accepted connection closes: a descriptor is free again
    try:
        note = late.recv()
        t.ok(note[0] == 2 and note[1] == "error" and note[2][0]["code"] == 501 and late.closed_by_peer(),
             "a connection that waited in the backlog during the drain is told `draining` once a descriptor is "
             "free", note)
    except (Closed, OSError) as e:
        t.ok(False, "a connection that waited in the backlog during the drain is told `draining`", repr(e))
    late.close()
    d.stop()                    # a second SIGTERM: exits now
    c.close()
finally:
    for f in fillers:
        f.close()
    d.close()

# ---- a device fault at run time (injected): every request answered, health says so, exit 1 ---------
d = Daemon(activation=True, args=["--max-context", "4096", "--max-batch", "2"], endless=True,
           env={"DSV4_TEST_FAULT_AFTER_DECODES": "40"})
try:
    t.ok(d.start(), "dsv4d with an injected device fault after 40 decode calls becomes ready", d.log_text())
    c = Client(d.sock_path)
    other = Client(d.sock_path)
    other.call("health")
    ids = [c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 500, "temperature": 0.0,
                                  "stream": True}) for _ in range(3)]
    answers = {}
    for mid in ids:
        answers[mid] = c.response(mid, on_notification=lambda m: None)
    t.ok(all(e is None and r["finish_reason"] == "error" and "injected device fault" in r.get("error", "")
             for e, r in answers.values()),
         "the running and the queued requests all end with the device error", answers)
    err, h = other.call("health")
    t.ok(err is None and h["status"] == "failed" and "engine failed" in h["reason"],
         "health says the engine failed", (err, h))
    err, _ = other.call("generate", {"tokens": tokens_bin([BOS, 7]), "max_tokens": 2})
    t.ok(err is not None and err["code"] == 502 and "engine failed" in err["message"],
         "a new request gets internal (502) naming the failure", err)
    t.ok(c.closed_by_peer() and other.closed_by_peer(), "then the connections close")
    try:
        rc = d.proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        rc = None
    d.stopped = True
    t.eq(rc, 1, "dsv4d exits 1 (systemd restarts it: Restart=on-failure)")
    t.ok(any(m.get("STATUS", "").startswith("failed: the engine failed (decode: injected device fault") for m in d.notify.messages),
         "STATUS= says why", d.notify.messages)
    t.ok("injected device fault" in d.log_text(), "and so does the log", d.log_text()[-2000:])
    c.close()
    other.close()
finally:
    d.close()

# ---- a drain with no grace cancels ----------------------------------------------------------------------
d = Daemon(activation=True, args=["--max-context", "4096", "--drain-grace", "0"], endless=True)
try:
    t.ok(d.start(), "dsv4d (drain_grace = 0) becomes ready", d.log_text())
    c = Client(d.sock_path)
    mid = c.request("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 3000, "temperature": 0.0,
                                 "stream": True})
    c.recv()
    d.proc.send_signal(signal.SIGTERM)
    err, res = c.response(mid, on_notification=lambda m: None)
    t.ok(err is None and res["finish_reason"] == "cancelled", "with no grace, the drain cancels in-flight work",
         (err, res and res.get("finish_reason")))
    t.eq(d.stop(), 0, "and dsv4d exits 0")
    c.close()
finally:
    d.close()

# ---- --listen: mode 0660, refuses a live socket, replaces a stale one; --backend auto ------------------
d = Daemon(activation=False, args=["--backend", "auto"])
try:
    t.ok(d.start(), "dsv4d --listen becomes ready", d.log_text())
    mode = stat.S_IMODE(os.stat(d.sock_path).st_mode)
    t.eq(oct(mode), oct(0o660), "the --listen socket has mode 0660")
    c = Client(d.sock_path)
    err, h = c.call("health")
    if have_cuda():
        # With a GPU auto takes it; without one it says why. Either way health names the choice.
        t.ok(err is None and h["status"] == "ready" and "auto:" in (h.get("reason") or ""),
             "--backend auto says what it chose in health", h)
    else:
        t.ok(err is None and h["status"] == "ready" and "no usable GPU" in (h.get("reason") or ""),
             "--backend auto without a GPU says so in health", h)
        t.ok("no usable GPU" in d.log_text() and "<4>" in d.log_text(), "... and in the log, as a warning")
        t.ok((h.get("reason") or "").count("no usable GPU") == 1 and
             all(line.count("no usable GPU") <= 1 for line in d.log_text().splitlines()),
             "... once, not 'no usable GPU (no usable GPU: ...)'", (h, d.log_text()[-1500:]))
    # A second daemon on the same path must refuse to take it over.
    out = run_dsv4d(d.tmp, d.sock_path)
    t.ok(out.returncode != 0 and "another server" in out.stderr, "a live socket is refused", out.stderr)
    err, h = c.call("health")
    t.ok(err is None and h["status"] == "ready", "the first daemon keeps serving", h)
    c.close()
    d.stopped = True
    d.proc.kill()       # leaves its socket file behind: stale
    d.proc.wait()
    t.ok(os.path.exists(d.sock_path), "a killed daemon leaves a stale socket file")
    d2 = Daemon(activation=False, tmp=d.tmp)
    try:
        t.ok(d2.start(), "a new daemon replaces the stale socket", d2.log_text())
        t.ok("replaced stale socket" in d2.log_text(), "... and logs it")
        c = Client(d2.sock_path)
        err, h = c.call("health")
        t.ok(err is None and h["status"] == "ready", "... and serves on it", h)
        c.close()
        t.eq(d2.stop(), 0, "dsv4d --listen exits 0 on SIGTERM")
        t.ok(not os.path.exists(d2.sock_path), "and removes the socket it bound")
    finally:
        d2.close()
finally:
    d.close()

# A path that is not a socket is never replaced.
with tempfile.TemporaryDirectory(prefix="dsv4d-test-") as tmp:
    path = os.path.join(tmp, "not-a-socket")
    with open(path, "w") as f:
        f.write("keep me\n")
    write_tokenizer(os.path.join(tmp, "tokenizer.json"))
    out = run_dsv4d(tmp, path)
    with open(path) as f:
        kept = f.read() == "keep me\n"
    t.ok(out.returncode != 0 and "not a socket" in out.stderr and kept,
         "--listen refuses a path that is not a socket and leaves it alone", out.stderr)

# A server whose listen backlog is full is live too: dsv4d refuses its path at once instead of waiting
# in connect() for an accept that may never come.
with tempfile.TemporaryDirectory(prefix="dsv4d-test-") as tmp:
    write_tokenizer(os.path.join(tmp, "tokenizer.json"))
    path = os.path.join(tmp, "busy.sock")
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(path)
    busy.listen(0)
    fillers = []
    while True:     # connections nobody accepts, until the backlog refuses one
        f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        f.setblocking(False)
        try:
            f.connect(path)
        except BlockingIOError:
            f.close()
            break
        fillers.append(f)
    try:
        out = run_dsv4d(tmp, path, timeout=min(TIMEOUT, 60))
        refused, why = out.returncode != 0 and "another server" in out.stderr, out.stderr
    except subprocess.TimeoutExpired:
        refused, why = False, "dsv4d still starting after 60 s"
    t.ok(refused and os.path.exists(path), "--listen refuses a live socket whose backlog is full, at once", why)
    for f in fillers:
        f.close()
    busy.close()

# Failures at start: the exit status says whether a restart can help (2: settings, 1: run time).
with tempfile.TemporaryDirectory(prefix="dsv4d-test-") as tmp:
    write_tokenizer(os.path.join(tmp, "tokenizer.json"))
    sock = os.path.join(tmp, "s.sock")
    out = run_dsv4d(tmp, sock, model=os.path.join(tmp, "no-such-model"))
    t.ok(out.returncode == 2 and "no-such-model" in out.stderr, "a missing model directory exits 2, named",
         (out.returncode, out.stderr))
    out = run_dsv4d(tmp, sock, "--max-batch", "0")
    t.ok(out.returncode == 2 and "max_batch" in out.stderr, "a bad setting exits 2, named",
         (out.returncode, out.stderr))
    if not have_cuda():
        out = run_dsv4d(tmp, sock, "--backend", "cuda")
        t.ok(out.returncode == 1 and "<3>" in out.stderr and "built without the CUDA backend" in out.stderr,
             "--backend cuda on a build without CUDA fails at boot (exit 1), saying why", (out.returncode, out.stderr))
    t.ok(not os.path.exists(sock), "a daemon that failed removes the socket it bound")

# ---- routing statistics: written when dsv4d stops, read back by expert_placement at the next boot --------
with tempfile.TemporaryDirectory(prefix="dsv4d-test-") as tmp:
    stats = os.path.join(tmp, "routing.json")
    with open(os.path.join(FIXTURE_MODEL, "config.json")) as f:
        mcfg = json.load(f)
    L, E, K = mcfg["num_hidden_layers"], mcfg["n_routed_experts"], mcfg["num_experts_per_tok"]
    prompt = [BOS] + text_tokens("routing")
    d = Daemon(activation=False, args=["--routing-stats", stats])
    try:
        t.ok(d.start(), "dsv4d with routing_stats becomes ready", d.log_text())
        c = Client(d.sock_path)
        err, res = c.call("generate", {"tokens": tokens_bin(prompt), "max_tokens": 4, "temperature": 0.0})
        t.ok(err is None, "it serves a request", err)
        # SIGUSR1: written now, while it keeps serving (the engine thread writes between two steps)
        d.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(stats) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(stats) as f:
            live = json.load(f)
        t.ok(live["n_layers"] == L and sum(live["counts"][0]) > 0,
             "SIGUSR1 writes the routing statistics without stopping dsv4d", d.log_text())
        err2, res2 = c.call("generate", {"tokens": tokens_bin(prompt), "max_tokens": 4, "temperature": 0.0})
        t.ok(err2 is None and d.proc.poll() is None, "and it serves the next request", err2)
        c.close()
        t.eq(d.stop(), 0, "dsv4d exits 0")
        with open(stats) as f:
            data = json.load(f)
        t.ok(sum(data["counts"][0]) > sum(live["counts"][0]),
             "the file written at stop counts the request served after SIGUSR1", (data["counts"][0], live["counts"][0]))
        sums = [sum(row) for row in data["counts"]]
        t.ok(data["format"] == "dsv4d-routing-stats" and data["n_layers"] == L and data["n_experts"] == E and
             len(sums) == L and all(len(row) == E for row in data["counts"]),
             "the routing statistics file has the model's %d layers x %d experts" % (L, E), data)
        # every token ran every layer: the warm-up, the prompt and all but the last generated token
        served = sum(len(prompt) + r["usage"]["completion_tokens"] - 1 for r in (res, res2))
        t.ok(len(set(sums)) == 1 and sums[0] % K == 0 and sums[0] // K >= served,
             "each layer counts top-%d experts for every token run (%d served)" % (K, served), sums)
        t.ok("routing statistics of %d routed tokens written to %s" % (sums[0] // K, stats) in d.log_text(),
             "the log says how many tokens and where", d.log_text())
    finally:
        d.close()
    d = Daemon(activation=False, args=["--expert-placement", stats])
    try:
        t.ok(d.start(), "dsv4d boots with expert_placement naming that file", d.log_text())
        t.eq(d.stop(), 0, "dsv4d exits 0")
    finally:
        d.close()
    # Where experts live is the CUDA backend's choice: on the CPU backend these settings are said to
    # have no effect, as gpus is, not ignored in silence.
    d = Daemon(activation=False, args=["--expert-offload", "on", "--expert-host-share", "25",
                                       "--expert-placement", stats])
    try:
        t.ok(d.start(), "dsv4d (cpu) boots with expert_offload, expert_host_share and expert_placement", d.log_text())
        log = d.log_text()
        t.ok("expert_offload = on: no effect on the cpu backend" in log and
             "expert_host_share = 25: no effect on the cpu backend" in log and
             "expert_placement %s: no effect on the cpu backend" % stats in log,
             "the log says each has no effect on the cpu backend", log)
        t.eq(d.stop(), 0, "dsv4d exits 0")
    finally:
        d.close()
    # the same shape from another model is used, and the log says whose statistics they are
    served_model = data["model"]
    data["model"] = "another-model"
    renamed = os.path.join(tmp, "renamed.json")
    with open(renamed, "w") as f:
        json.dump(data, f)
    d = Daemon(activation=False, args=["--expert-placement", renamed])
    try:
        t.ok(d.start(), "dsv4d boots with expert_placement naming another model's file of its shape", d.log_text())
        t.ok('routing statistics of model "another-model", serving "%s"' % served_model in d.log_text(),
             "the log names the file's model and the one served", d.log_text())
        t.eq(d.stop(), 0, "dsv4d exits 0")
    finally:
        d.close()
    data["model"] = served_model
    data["n_experts"] = E + 1
    data["counts"] = [row + [0] for row in data["counts"]]
    other = os.path.join(tmp, "other.json")
    with open(other, "w") as f:
        json.dump(data, f)
    write_tokenizer(os.path.join(tmp, "tokenizer.json"))
    out = run_dsv4d(tmp, os.path.join(tmp, "s.sock"), "--expert-placement", other)
    t.ok(out.returncode == 2 and "expert_placement" in out.stderr and
         "of %d layers x %d experts; the model has %d x %d" % (L, E + 1, L, E) in out.stderr
         and "loading weights" not in out.stderr,
         "a routing statistics file of another shape is refused before the weights load (exit 2: a setting to "
         "fix), with both shapes",
         (out.returncode, out.stderr))
    # routing_stats is written at stop or on SIGUSR1, maybe days later: where no file can be created,
    # dsv4d refuses to boot, as for any path it must write, instead of finding out then.
    nowhere = os.path.join(tmp, "missing", "routing.json")
    try:
        out = run_dsv4d(tmp, os.path.join(tmp, "s.sock"), "--routing-stats", nowhere, timeout=min(TIMEOUT, 60))
        refused, why = out.returncode == 2 and "routing_stats" in out.stderr and nowhere in out.stderr, out.stderr
    except subprocess.TimeoutExpired:
        refused, why = False, "dsv4d still running after 60 s"
    t.ok(refused, "a routing_stats file in a directory that does not exist is refused at boot (exit 2), named", why)

# ---- allowlist ----------------------------------------------------------------------------------------
other_uid = 4242 if os.getuid() != 4242 else 4243
d = Daemon(activation=False, args=["--allow-users", str(other_uid)])
try:
    t.ok(d.start(), "dsv4d with allow_users becomes ready", d.log_text())
    c = Client(d.sock_path)
    try:
        c.request("health")
        refused = c.closed_by_peer() and not c.notifications
    except (BrokenPipeError, ConnectionResetError):
        refused = True
    t.ok(refused, "a peer outside allow_users is disconnected unanswered")
    t.ok("not in allow_users" in d.log_text() and "uid %d" % os.getuid() in d.log_text(),
         "the refusal is logged with the peer's uid", d.log_text())
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

d = Daemon(activation=False, args=["--allow-users", str(other_uid), "--allow-groups", str(os.getgid())])
try:
    t.ok(d.start(), "dsv4d allowing our group becomes ready", d.log_text())
    c = Client(d.sock_path)
    err, h = c.call("health")
    t.ok(err is None and h["status"] == "ready", "a peer whose group is in allow_groups is served", (err, h))
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

# A peer in more supplementary groups than the first buffer holds (256), the allowed one past them:
# served all the same. Setting a child's groups takes root.
name = "a peer in 300 supplementary groups, the allowed one last, is served"
if os.geteuid() != 0:
    t.n += 1
    print("ok %d - %s # SKIP setting supplementary groups takes root" % (t.n, name), flush=True)
else:
    groups = list(range(70000, 70300))
    d = Daemon(activation=False, args=["--allow-groups", str(groups[-1])])
    try:
        t.ok(d.start(), "dsv4d allowing group %d becomes ready" % groups[-1], d.log_text())
        peer = subprocess.run([sys.executable, "-c", """
import sys
sys.path.insert(0, %r)
from dsv4d_harness import Client
err, h = Client(%r).call("health")
print(h["status"])
""" % (os.path.dirname(os.path.abspath(__file__)), d.sock_path)], capture_output=True, text=True, timeout=TIMEOUT,
                              group=65534, extra_groups=groups)
        t.ok(peer.stdout.strip() == "ready", name, (peer.stdout, peer.stderr[-1500:], d.log_text()[-1500:]))
        t.eq(d.stop(), 0, "dsv4d exits 0")
    finally:
        d.close()

d = Daemon(activation=False, args=["--allow-users", "%d,%d" % (other_uid, os.getuid())])
try:
    t.ok(d.start(), "dsv4d allowing our uid becomes ready", d.log_text())
    c = Client(d.sock_path)
    err, h = c.call("health")
    t.ok(err is None and h["status"] == "ready", "a peer in allow_users is served", (err, h))
    t.ok("connection 1: pid %d uid %d" % (os.getpid(), os.getuid()) in d.log_text(),
         "SO_PEERCRED pid and uid are logged per connection", d.log_text())
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

t.done()
