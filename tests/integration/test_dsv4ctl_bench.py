#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""dsv4ctl bench (client/ctl_bench.c), the load generator, against a running dsv4d on the endless
fixture model (greedy answers run to max_tokens, so every request's token count is known): its
JSON and table reports, the limits it checks against the server before sending, and that the
slots it used are free afterwards."""

import json
import os
import subprocess

from dsv4d_harness import TIMEOUT, Daemon, Tap, program

t = Tap()


def ctl(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([program("dsv4ctl")] + list(args), capture_output=True, text=True,
                          timeout=10 * TIMEOUT, env=e)


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

    r = ctl("bench", "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "3", "--temperature", "0",
            env=sock)
    rows = [l for l in r.stdout.splitlines() if l and not l.startswith("#")]
    t.ok(r.returncode == 0 and len(rows) == 2 and rows[0].split()[0] == "concurrency" and rows[1].split()[:3] ==
         ["2", "8", "0"], "bench table: header, then C=2 with the default 8 requests and no failure",
         (r.stdout, r.stderr))
    t.ok(any(l.startswith("# engine: ") and "ms host work" in l for l in r.stdout.splitlines()),
         "bench table: the engine line under the level", r.stdout)

    # a 150-token prompt admitted beside 2 streams that run to max_tokens (the endless model)
    r = ctl("bench", "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "200", "--requests", "2",
            "--temperature", "0", "--admit-tokens", "150", "--json", env=sock)
    lv = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}
    t.ok(lv.get("admit_tokens") == 150 and lv.get("admit_ttft_ms") and lv["admit_ttft_ms"] > 0 and
         lv["admit_gaps"] > 0 and 0 < lv["admit_gap_ms_median"] <= lv["admit_gap_ms_p99"] <= lv["admit_gap_ms_max"],
         "bench --admit-tokens: the admitted prompt's TTFT and the streams' gaps meanwhile", (r.stdout, r.stderr))
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
