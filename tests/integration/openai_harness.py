# SPDX-License-Identifier: MIT
"""Test harness for dsv4-openai: starts it under systemd-socket-activate on a free TCP port of
127.0.0.1 with an API key, in front of a dsv4d the caller started (dsv4d_harness), and speaks HTTP
with the official `openai` package, urllib or raw sockets."""

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

from dsv4d_harness import TIMEOUT, TOP_SRCDIR, program

try:
    import openai
except ImportError:
    # As dsv4d_harness does for msgpack: TAP's skip, with the reason.
    print("1..0 # SKIP python3 module openai not installed (pip install openai)", flush=True)
    raise SystemExit(0)

MODEL = os.path.join(TOP_SRCDIR, "models", "default")
KEY = "sk-test-0123456789abcdef"
Q391 = "What is 17*23? Reply with the number only."
with open(os.path.join(TOP_SRCDIR, "tests", "fixtures", "openai", "dsml.json"), encoding="utf-8") as f:
    FIXTURE = json.load(f)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Front:
    """dsv4-openai under systemd-socket-activate on a TCP port of 127.0.0.1."""

    def __init__(self, sock_path, tmp, args=()):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.log_path = os.path.join(tmp, "front-%d.log" % self.port)
        key_file = os.path.join(tmp, "key")
        with open(key_file, "w", encoding="utf-8") as f:
            f.write(KEY + "\n")
        argv = ["systemd-socket-activate", "-l", "127.0.0.1:%d" % self.port, program("dsv4-openai"),
                "--socket", sock_path, "--api-key-file", key_file] + list(args)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)

    def wait_ready(self):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status, _, _ = http(self, "GET", "/health")
                if status == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def log_text(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self):
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def http(front, method, path, body=None, key=KEY, headers=None):
    """(status, headers, body bytes) of one plain HTTP request."""
    h = {"Authorization": "Bearer " + key} if key else {}
    h.update(headers or {})
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(front.base + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def chat(front, content, **kw):
    return front.client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                                **kw)


def stream_chat(front, content, **kw):
    chunks = list(chat(front, content, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, reasoning, finish


def raw(front, data, timeout=TIMEOUT):
    """Send bytes on a fresh connection; what comes back until the server closes it (or timeout)."""
    s = socket.create_connection(("127.0.0.1", front.port), timeout=timeout)
    out = b""
    try:
        s.sendall(data)
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except (socket.timeout, ConnectionError):
        pass
    s.close()
    return out


def direct(c, params):
    """dsv4d's own answer (through the msgpack protocol)."""
    return c.call("generate", params)


METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)( -?[0-9]+)?\Z")
LABEL_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def parse_labels(text):
    """{name: value} of a sample's '{a="x",b="y"}' (the braces included), with the format's escapes undone;
    ValueError on anything else."""
    labels, i = {}, 1
    while text[i] != "}":
        eq = text.index("=", i)
        name = text[i:eq]
        if not LABEL_NAME.match(name) or name in labels or text[eq + 1] != '"':
            raise ValueError("label at %r" % text[i:])
        i, value = eq + 2, ""
        while text[i] != '"':
            if text[i] == "\\":
                if text[i + 1] not in LABEL_ESCAPES:
                    raise ValueError("escape \\%s" % text[i + 1])
                value += LABEL_ESCAPES[text[i + 1]]
                i += 2
            else:
                value += text[i]
                i += 1
        labels[name] = value
        i += 1
        if text[i] == ",":
            i += 1
    if i + 1 != len(text):
        raise ValueError("after the labels: %r" % text[i:])
    return labels


def exposition(text):
    """Check text against the Prometheus text format 0.0.4 (HELP and TYPE once a family, before its samples, a
    family's samples together, counters named *_total, label values escaped, numbers Go parses, no series
    twice, a histogram's buckets cumulative up to le="+Inf" = _count). Returns (problems, types, samples):
    types {family: type}, samples {(name, ((label, value), ...)): value}. The `prometheus_client` package's
    parser, when installed, must read it too."""
    problems, types, helps, samples, done, sampled = [], {}, set(), {}, set(), set()
    current = None
    if not text.endswith("\n"):
        problems.append("the text does not end with a newline")

    def family_of(name):
        for suffix in ("_bucket", "_count", "_sum"):
            base = name[:-len(suffix)]
            if name.endswith(suffix) and types.get(base) == "histogram":
                return base
        return name

    def enter(fam, line):
        nonlocal current
        if fam != current:
            if fam in done:
                problems.append("family %s is not together: %r" % (fam, line))
            if current:
                done.add(current)
            current = fam

    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            parts = line.split(" ", 3)
            if len(parts) < 4 or not METRIC_NAME.match(parts[2]):
                problems.append("malformed %r" % line)
                continue
            fam = parts[2]
            enter(fam, line)
            seen = helps if parts[1] == "HELP" else types
            if fam in seen:
                problems.append("a second %s for %s" % (parts[1], fam))
            if parts[1] == "HELP":
                helps.add(fam)
                if re.search(r"\\[^\\n]", parts[3]):
                    problems.append("HELP text with a bad escape: %r" % line)
            else:
                if fam in sampled:
                    problems.append("TYPE of %s after its samples" % fam)
                if parts[3] not in ("counter", "gauge", "histogram", "summary", "untyped"):
                    problems.append("unknown type %r" % line)
                types[fam] = parts[3]
                if parts[3] == "counter" and not fam.endswith("_total"):
                    problems.append("counter %s is not named *_total" % fam)
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        if not m:
            problems.append("malformed sample %r" % line)
            continue
        name, fam = m.group(1), family_of(m.group(1))
        enter(fam, line)
        sampled.add(fam)
        if fam not in types or fam not in helps:
            problems.append("sample of %s before its HELP and TYPE (or without them)" % fam)
        try:
            labels = parse_labels(m.group(2)) if m.group(2) else {}
        except (ValueError, IndexError) as e:
            problems.append("labels of %r: %s" % (line, e))
            continue
        v = m.group(3)
        if not re.match(r"[-+]?([0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?|[0-9]+\.)\Z|[-+]?Inf\Z|NaN\Z", v):
            problems.append("value %r is not a number the format allows" % line)
            continue
        key = (name, tuple(sorted(labels.items())))
        if key in samples:
            problems.append("series twice: %r" % line)
        samples[key] = float(v)
    for fam, kind in types.items():
        if kind != "histogram":
            continue
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == fam + "_bucket")
        count = samples.get((fam + "_count", ()))
        if not buckets or buckets[-1][0] != float("inf") or buckets[-1][1] != count:
            problems.append("histogram %s: no le=\"+Inf\" bucket equal to _count" % fam)
        if any(a[1] > b[1] for a, b in zip(buckets, buckets[1:])):
            problems.append("histogram %s: buckets not cumulative" % fam)
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        pass
    else:
        try:
            list(text_string_to_metric_families(text))
        except Exception as e:  # noqa: BLE001  (whatever the parser raises is the problem)
            problems.append("prometheus_client cannot parse it: %r" % e)
    return problems, types, samples


def sample(samples, name, **labels):
    """The value of one series of exposition()'s samples, None when absent."""
    return samples.get((name, tuple(sorted(labels.items()))))
