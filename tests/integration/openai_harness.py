# SPDX-License-Identifier: MIT
"""Test harness for dsv4-openai: starts it under systemd-socket-activate on a free TCP port of
127.0.0.1 with an API key, in front of a dsv4d the caller started (dsv4d_harness), and speaks HTTP
with the official `openai` package, urllib or raw sockets."""

import json
import os
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
