#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""dsv4ctl bench (client/ctl_bench.c), the load generator, against a running dsv4d on the endless
fixture model (greedy answers run to max_tokens, so every request's token count is known): its
JSON and table reports, the limits it checks against the server before sending, and that the
slots it used are free afterwards."""

import json
import os
import socket
import struct
import subprocess
import threading

from dsv4d_harness import TIMEOUT, Daemon, Tap, UnixServer, program

t = Tap()
import msgpack  # noqa: E402  (after the harness, which skips the test without it)


def ctl(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([program("dsv4ctl")] + list(args), capture_output=True, text=True,
                          timeout=10 * TIMEOUT, env=e)


class AdmitProxy(UnixServer):
    """dsv4d's socket passed through, except that a generate of `admit` prompt tokens with max_tokens 1
    (bench's admitted prompt) is answered here, without a token, by `finish`."""

    def __init__(self, path, upstream, admit, finish):
        self.upstream, self.admit, self.finish = upstream, admit, finish
        super().__init__(path)

    def handle(self, conn):
        up = socket.socket(socket.AF_UNIX)
        up.connect(self.upstream)
        lock = threading.Lock()
        threading.Thread(target=self.pump_down, args=(up, conn, lock), daemon=True).start()
        threading.Thread(target=self.pump_up, args=(conn, up, lock), daemon=True).start()

    @staticmethod
    def pump_down(up, conn, lock):
        while True:
            try:
                b = up.recv(65536)
                if not b:
                    break
                with lock:
                    conn.sendall(b)
            except OSError:
                break
        conn.close()

    def pump_up(self, conn, up, lock):
        buf = b""
        while True:
            try:
                b = conn.recv(65536)
            except OSError:
                b = b""
            if not b:
                up.close()
                return
            buf += b
            while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                n = struct.unpack(">I", buf[:4])[0]
                frame, buf = buf[:4 + n], buf[4 + n:]
                msg = msgpack.unpackb(frame[4:], raw=False)
                p = msg[3][0] if len(msg) == 4 and isinstance(msg[3], list) and msg[3] else {}
                if (msg[0] == 0 and msg[2] == "generate" and isinstance(p, dict) and p.get("max_tokens") == 1
                        and len(p.get("tokens", b"")) == 4 * self.admit):
                    body = msgpack.packb([1, msg[1], None, {
                        "text": "", "tokens": b"", "finish_reason": self.finish,
                        "usage": {"prompt_tokens": self.admit, "completion_tokens": 0,
                                  "total_tokens": self.admit}}], use_bin_type=True)
                    with lock:
                        conn.sendall(struct.pack(">I", len(body)) + body)
                else:
                    up.sendall(frame)


d = Daemon(args=["--max-context", "256", "--max-batch", "4"], endless=True)
try:
    t.ok(d.start(), "dsv4d is ready", d.log_text())
    sock = {"DSV4_SOCKET": d.sock_path}
    r = ctl("bench", "--concurrency", "1,3", "--prompt-tokens", "20", "--max-tokens", "6", "--requests", "6",
            "--temperature", "0", "--json", env=sock)
    levels = [json.loads(l) for l in r.stdout.splitlines()] if r.returncode == 0 else []
    t.ok(r.returncode == 0 and len(levels) == 2, "bench --json: one object per concurrency level",
         (r.returncode, r.stdout, r.stderr))
    for lv, c in zip(levels, (1, 3)):
        name = "bench C=%d: " % c
        t.eq((lv["concurrency"], lv["requests"], lv["failed"], lv["prompt_tokens"], lv["max_tokens"]),
             (c, 6, 0, 20, 6), name + "level, request count, no failure, prompt and max tokens")
        t.eq(lv["output_tokens"], 36, name + "every request streamed its 6 tokens")
        t.ok(0 < lv["ttft_ms_median"] <= lv["ttft_ms_p99"], name + "TTFT median <= p99, both positive", lv)
        t.ok(0 < lv["tpot_ms_median"] <= lv["tpot_ms_p99"], name + "TPOT median <= p99, both positive", lv)
        t.ok(abs(lv["output_tokens_per_s"] * lv["wall_s"] - 36) < 1e-6 * 36 + 1e-9,
             name + "output tokens/s is the tokens over the level's wall time", lv)
        t.ok(lv["engine_steps"] >= lv["engine_decode_steps"] >= 5 and lv["engine_backend_ms"] > 0 and
             lv["engine_host_ms"] >= 0 and lv["engine_gap_ms"] >= 0,
             name + "the engine's steps over the level and where a step's time went", lv)
        t.ok(lv["engine_prefill_tokens"] >= 6 * 20 and 1 <= lv["engine_prefill_chunks"] <= lv["engine_prefill_tokens"]
             and lv["engine_prefill_chunk_mean"] == lv["engine_prefill_tokens"] / lv["engine_prefill_chunks"],
             name + "the prompt tokens the engine ran over the level, its prefill calls and their mean", lv)
        t.ok(lv["shared_prefix"] == 0 and lv["cached_tokens_mean"] == 0,
             name + "prompts of random ids share no block: nothing restored", lv)

    # the same command again: new prompts, so the prefix cache has none of them (it kept the last run's)
    r = ctl("bench", "--concurrency", "1", "--prompt-tokens", "20", "--max-tokens", "6", "--requests", "6",
            "--temperature", "0", "--json", env=sock)
    lv = json.loads(r.stdout) if r.returncode == 0 else {}
    t.ok(lv.get("failed") == 0 and lv.get("cached_tokens_mean") == 0,
         "bench run again: its prompts are new, nothing restored", (r.stdout, r.stderr))

    # prompts that share their first 64 ids (4 blocks of the fixture's 16): after the first requests
    # have left their state there, the later ones restore it; never more than the shared part
    r = ctl("bench", "--prompt-tokens", "100", "--shared-prefix", "64", "--max-tokens", "4", "--requests", "6",
            "--temperature", "0", "--json", env=sock)
    lv = json.loads(r.stdout) if r.returncode == 0 else {}
    t.ok(lv.get("shared_prefix") == 64 and lv.get("failed") == 0 and 0 < lv.get("cached_tokens_mean", 0) <= 64,
         "bench --shared-prefix: the prefix cache restores part of the shared ids", (r.stdout, r.stderr))
    r = ctl("bench", "--prompt-tokens", "100", "--shared-prefix", "64", "--max-tokens", "4", "--requests", "2",
            "--temperature", "0", env=sock)
    t.ok(r.returncode == 0 and any(l.startswith("# cached: ") and "(mean over the finished requests; 64 shared)" in l
                                   for l in r.stdout.splitlines()),
         "bench table: the cached line under the level", (r.stdout, r.stderr))
    # every request refused (min_p outside [0, 1]): no figure for the tokens restored, as JSON's null, not "nan"
    r = ctl("bench", "--prompt-tokens", "20", "--shared-prefix", "16", "--max-tokens", "4", "--requests", "2",
            "--min-p", "2", env=sock)
    t.ok(r.returncode == 1 and "# cached: no figure: no request finished (16 shared)" in r.stdout
         and "nan of each" not in r.stdout,
         "bench table: with every request failed, the cached line says there is no figure", (r.stdout, r.stderr))
    r = ctl("bench", "--prompt-tokens", "20", "--shared-prefix", "20", env=sock)
    t.ok(r.returncode == 2 and "--shared-prefix 20 must be below --prompt-tokens 20" in r.stderr,
         "a shared prefix as long as the prompt is refused before sending", (r.returncode, r.stderr))

    r = ctl("bench", "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "3", "--temperature", "0",
            env=sock)
    rows = [l for l in r.stdout.splitlines() if l and not l.startswith("#")]
    t.ok(r.returncode == 0 and len(rows) == 2 and rows[0].split()[0] == "concurrency" and rows[1].split()[:3] ==
         ["2", "8", "0"], "bench table: header, then C=2 with the default 8 requests and no failure",
         (r.stdout, r.stderr))
    t.ok(any(l.startswith("# engine: ") and "ms host work" in l for l in r.stdout.splitlines()),
         "bench table: the engine line under the level", r.stdout)
    t.ok(any(l.startswith("# prefill: ") and " calls, " in l for l in r.stdout.splitlines()),
         "bench table: the prefill line under the level", r.stdout)

    # a 150-token prompt admitted beside 2 streams that run to max_tokens (the endless model)
    r = ctl("bench", "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "200", "--requests", "2",
            "--temperature", "0", "--admit-tokens", "150", "--json", env=sock)
    lv = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}
    t.ok(lv.get("admit_tokens") == 150 and lv.get("admit_ttft_ms") and lv["admit_ttft_ms"] > 0 and
         lv["admit_gaps"] > 0 and 0 < lv["admit_gap_ms_median"] <= lv["admit_gap_ms_p99"] <= lv["admit_gap_ms_max"],
         "bench --admit-tokens: the admitted prompt's TTFT and the streams' gaps meanwhile", (r.stdout, r.stderr))
    # an admitted prompt that ends without its token has no time to first token: no figure, and why
    for finish in ("stop", "cancelled"):
        proxy = AdmitProxy(os.path.join(d.tmp, "proxy-%s.sock" % finish), d.sock_path, 150, finish)
        r = ctl("bench", "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "200", "--requests", "2",
                "--temperature", "0", "--admit-tokens", "150", env={"DSV4_SOCKET": proxy.path})
        proxy.close()
        t.ok(r.returncode == 0 and ("# admit: no figure: it finished %s" % finish) in r.stdout
             and "ttft 0.0 ms" not in r.stdout,
             "bench --admit-tokens: an admitted prompt finished %s without a token gets no TTFT figure" % finish,
             (r.returncode, r.stdout, r.stderr))
    r = ctl("bench", "--prompt-tokens", "8", "--max-tokens", "4", "--admit-tokens", "256", env=sock)
    t.ok(r.returncode == 2 and "--admit-tokens 256" in r.stderr, "an admitted prompt past the context is refused "
         "before any request, exit 2", (r.returncode, r.stderr))
    r = ctl("bench", "--prompt-tokens", "300", "--max-tokens", "4", env=sock)
    t.ok(r.returncode == 2 and "context of 256" in r.stderr, "a prompt past the server's context is refused "
         "before any request, exit 2", (r.returncode, r.stderr))
    r = ctl("bench", "--concurrency", "0", env=sock)
    t.ok(r.returncode == 2 and "--concurrency" in r.stderr, "--concurrency 0 is a usage error", r.stderr)
    r = ctl("bench", "extra", env=sock)
    t.eq(r.returncode, 2, "bench takes no arguments")
    r = ctl("bench", env={"DSV4_SOCKET": os.path.join(d.tmp, "nobody-here.sock")})
    t.eq(r.returncode, 3, "bench exits 3 when nothing listens")

    r = ctl("stats", "--json", env=sock)
    st = json.loads(r.stdout) if r.returncode == 0 else {}
    t.ok(st.get("slots_busy") == 0 and st.get("requests_total", 0) >= 23 and st.get("requests_failed") == 0,
         "afterwards every slot is free and no request failed", (r.stdout, r.stderr))
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

t.done()
