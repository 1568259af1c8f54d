#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""libdsv4client and dsv4ctl against a running dsv4d: the C checks in dsv4d_client_check.c (their TAP
lines are relayed here), then dsv4ctl's commands, output formats and exit codes."""

import json
import os
import re
import subprocess

from dsv4d_harness import (FIXTURE_VOCAB, LONG_PROMPT, TIMEOUT, Client, Daemon, Tap, bin_tokens, program,
                           text_tokens, tokens_bin)

t = Tap()


def ctl(*args, stdin=None, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([program("dsv4ctl")] + list(args), input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT, env=e)


d = Daemon(args=["--max-context", "4096", "--max-batch", "4"], endless=True)
try:
    t.ok(d.start(), "dsv4d is ready", d.log_text())
    env = dict(os.environ, DSV4_SOCKET=d.sock_path, DSV4_TEST_VOCAB=str(FIXTURE_VOCAB), CMOCKA_MESSAGE_OUTPUT="TAP")
    check = subprocess.run([program("tests/integration/dsv4d_client_check")], capture_output=True, text=True,
                           timeout=10 * TIMEOUT, env=env)
    lines = check.stdout.splitlines()
    results = [(m.group(1) is None, m.group(2)) for m in (re.match(r"(not )?ok \d+ - (.*)", l) for l in lines) if m]
    for passed, name in results:
        t.ok(passed, "libdsv4client: " + name, check.stdout + check.stderr)
    t.ok(len(results) == 8 and check.returncode == 0, "libdsv4client: all 8 checks ran and passed",
         "rc %d\n%s\n%s" % (check.returncode, check.stdout, check.stderr))

    # dsv4ctl through the same daemon: $DSV4_SOCKET, then --socket.
    sock = {"DSV4_SOCKET": d.sock_path}
    r = ctl("health", env=sock)
    t.ok(r.returncode == 0, "dsv4ctl health exits 0 when ready", r.stdout + r.stderr)
    r = ctl("--socket", d.sock_path, "info")
    t.ok(r.returncode == 0 and "cpu" in r.stdout, "dsv4ctl --socket PATH info", r.stdout + r.stderr)
    c = Client(d.sock_path)
    err, ref = c.call("generate", {"tokens": tokens_bin(LONG_PROMPT), "max_tokens": 12, "temperature": 0.0})
    r = ctl("generate", "--tokens", ",".join(map(str, LONG_PROMPT)), "--max-tokens", "12", "--temperature", "0",
            "--json", env=sock)
    last = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}
    t.ok(r.returncode == 0 and last.get("tokens") == bin_tokens(ref["tokens"]) and last.get("text") == ref["text"],
         "dsv4ctl generate --tokens --json: the last line holds the tokens and text", (r.stdout, r.stderr, ref))
    r = ctl("generate", "--tokens", ",".join(map(str, LONG_PROMPT)), "--max-tokens", "12", "--temperature", "0",
            "--stream", "--json", env=sock)
    objs = [json.loads(l) for l in r.stdout.strip().splitlines()] if r.returncode == 0 else []
    t.ok(len(objs) > 1 and objs[-1].get("tokens") == bin_tokens(ref["tokens"]),
         "dsv4ctl generate --stream --json: token lines, then the result", (r.stdout, r.stderr))
    r = ctl("generate", "--max-tokens", "5", "--temperature", "0", stdin="The capital of France is", env=sock)
    err, ref2 = c.call("generate", {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0.0})
    t.ok(r.returncode == 0 and r.stdout.rstrip("\n") == ref2["text"].rstrip("\n"),
         "dsv4ctl generate reads the prompt from stdin and prints the answer", (r.stdout, r.stderr, ref2["text"]))
    r = ctl("generate", "--chat", "--system", "Be brief.", "--max-tokens", "4", "--seed", "3", "What is 17*23?",
            env=sock)
    t.ok(r.returncode == 0, "dsv4ctl generate --chat --system PROMPT", r.stderr)
    r = ctl("tokenize", "--no-bos", "hello", env=sock)
    t.ok(r.returncode == 0 and r.stdout.strip() == ",".join(map(str, text_tokens("hello"))),
         "dsv4ctl tokenize", (r.stdout, r.stderr))
    r = ctl("detokenize", ",".join(map(str, text_tokens("hello"))), env=sock)
    t.ok(r.returncode == 0 and r.stdout.rstrip("\n") == "hello", "dsv4ctl detokenize", (r.stdout, r.stderr))
    r = ctl("stats", "--json", env=sock)
    st = json.loads(r.stdout) if r.returncode == 0 else {}
    t.ok(st.get("backend") == "cpu" and st.get("slots_total") == 4, "dsv4ctl stats --json", (r.stdout, r.stderr))
    t.ok(len(st.get("latency_bounds_s", [])) == 19
         and all(len(st.get(h + "_hist", [])) == 20 and sum(st[h + "_hist"]) == st.get(h + "_count", -1) > 0
                 for h in ("queue", "ttft", "tpot", "e2e")),
         "dsv4ctl stats --json: the latency histograms' bounds, buckets and counts", st)
    r = ctl("stats", env=sock)
    lines = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.split()}
    t.ok(r.returncode == 0 and all(lines.get(h + "_s", [""])[:2] == ["count", str(st[h + "_count"])]
                                   and lines[h + "_s"][4:10:2] == ["p50", "p90", "p99"]
                                   for h in ("queue", "ttft", "tpot", "e2e")),
         "dsv4ctl stats: each latency histogram's count, mean and percentiles", r.stdout)
    r = ctl("generate", "--tokens", ",".join(["9"] * 4096), "--max-tokens", "2", env=sock)
    t.ok(r.returncode == 1 and "301" in r.stderr or "prompt_too_long" in r.stderr,
         "dsv4ctl reports a server error with its code and exit status 1", (r.returncode, r.stderr))
    r = ctl("health", env={"DSV4_SOCKET": os.path.join(d.tmp, "nobody-here.sock")})
    t.eq(r.returncode, 3, "dsv4ctl exits 3 when nothing listens")
    c.close()
    t.eq(d.stop(), 0, "dsv4d exits 0")
finally:
    d.close()

t.done()
