# SPDX-License-Identifier: MIT
"""Integration-test harness for dsv4d: starts the daemon (socket-activated through
systemd-socket-activate, or with --listen), follows its sd_notify messages on a test NOTIFY_SOCKET,
and speaks the protocol with the PyPI `msgpack` package, an implementation independent of the
daemon's msgpack-c. Tests print TAP through the Tap class.

Timeouts are generous (sanitizer builds are slow) and every wait ends on a signal the daemon gives
(a notify message, a response, an exit), never on a fixed sleep."""

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

try:
    import msgpack
except ImportError:
    # TAP's skip (automake's tap-driver takes "1..0 # SKIP", not exit status 77): the tests need an
    # msgpack implementation independent of the daemon's.
    print("1..0 # SKIP python3 module msgpack not installed (pip install msgpack)", flush=True)
    sys.exit(0)

TIMEOUT = float(os.environ.get("DSV4_TEST_TIMEOUT", "180"))
TOP_BUILDDIR = os.environ.get("top_builddir", os.getcwd())
TOP_SRCDIR = os.environ.get("top_srcdir", os.path.join(os.path.dirname(__file__), "..", ".."))
# The fixture model with room for the chat tags and all 256 bytes in its vocabulary (288 ids): the
# test tokenizer needs 262.
FIXTURE_MODEL = os.path.join(TOP_SRCDIR, "tests", "fixtures", "tiny_c")
with open(os.path.join(FIXTURE_MODEL, "config.json")) as _f:
    FIXTURE_VOCAB = json.load(_f)["vocab_size"]
BYTE_BASE = 6           # the test tokenizer's id of byte b is BYTE_BASE + b

# Special tokens of the test tokenizer: the chat tags of doc/MODEL.md §6 at ids 0..5.
TAGS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
BOS, EOS = 0, 1
# Any prompt: on an endless_model() daemon its greedy answer runs to max_tokens.
LONG_PROMPT = [BOS, 9, 9]


class Tap:
    """TAP output for automake's tap-driver: one line per check, a plan at the end."""

    def __init__(self):
        self.n = 0
        self.failed = 0

    def ok(self, cond, name, diag=None):
        self.n += 1
        if not cond:
            self.failed += 1
        print(("ok" if cond else "not ok") + " %d - %s" % (self.n, name), flush=True)
        if not cond and diag is not None:
            for line in str(diag).splitlines()[-60:]:
                print("# " + line, flush=True)
        return cond

    def eq(self, got, want, name):
        return self.ok(got == want, name, "got  %r\nwant %r" % (got, want))

    def skip_all(self, why):
        print("1..0 # SKIP " + why, flush=True)
        sys.exit(0)

    def done(self):
        print("1..%d" % self.n, flush=True)
        sys.exit(1 if self.failed else 0)


def program(name):
    return os.path.join(TOP_BUILDDIR, name)


def byte_symbols():
    """GPT-2's byte-level alphabet: byte -> printable unicode character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def write_tokenizer(path, vocab_size=FIXTURE_VOCAB):
    """A byte-level BPE tokenizer.json covering a fixture model's vocab_size ids: the six chat tags at
    0..5, one symbol per byte at BYTE_BASE + b, and the remaining ids as merges of two equal control
    bytes, which no test text contains: printable text is exactly one id per byte."""
    sym = byte_symbols()
    vocab = {sym[b]: BYTE_BASE + b for b in range(256)}
    merges = []
    for i, b in enumerate(range(vocab_size - BYTE_BASE - 256)):
        merges.append([sym[b], sym[b]])
        vocab[sym[b] + sym[b]] = BYTE_BASE + 256 + i
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t not in ("<think>", "</think>")} for i, t in enumerate(TAGS)]
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)


def text_tokens(text):
    """The ids the test tokenizer gives for printable text: one per byte."""
    return [BYTE_BASE + b for b in text.encode("utf-8")]


def pack(obj):
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def tokens_bin(ids):
    return struct.pack("<%di" % len(ids), *ids)


def bin_tokens(b):
    return list(struct.unpack("<%di" % (len(b) // 4), b))


class UnixServer:
    """A listening Unix socket at `path` (a fake dsv4d, or a proxy in front of one): each accepted
    connection goes to self.handle(conn), on the accepting thread; close() stops accepting."""

    def __init__(self, path):
        self.path = path
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(path)
        self.srv.listen(16)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.handle(conn)

    def handle(self, conn):
        raise NotImplementedError

    def close(self):
        self.srv.close()


class Notify:
    """A NOTIFY_SOCKET: a datagram socket collecting what the daemon tells its service manager. A
    thread reads it all the time, as systemd does: sd_notify() blocks when the queue is full."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if os.path.exists(path):
            os.unlink(path)
        self.sock.bind(path)
        self.messages = []      # one dict per datagram, in arrival order
        self.cond = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self._reader, daemon=True)
        self.thread.start()

    def _reader(self):
        while not self.closing:
            r, _, _ = select.select([self.sock], [], [], 0.2)
            if not r:
                continue
            try:
                data = self.sock.recv(65536).decode("utf-8", "replace")
            except OSError:
                return
            msg = {}
            for line in data.split("\n"):
                if "=" in line:
                    k, v = line.split("=", 1)
                    msg[k] = v
            with self.cond:
                self.messages.append(msg)
                self.cond.notify_all()

    def poll(self, timeout):
        """Wait up to timeout for a new message; True when one came."""
        with self.cond:
            n = len(self.messages)
            self.cond.wait_for(lambda: len(self.messages) > n, timeout)
            return len(self.messages) > n

    def wait_for(self, key, value=None, timeout=TIMEOUT, proc=None, after=-1):
        """Return the index of the first message past index `after` with key (= value), waiting for
        it; -1 when it does not come in time or the process exits without sending it."""
        deadline = time.monotonic() + timeout
        while True:
            i = self.index(key, value, after)
            if i >= 0:
                return i
            left = deadline - time.monotonic()
            if left <= 0:
                return -1
            if proc is not None and proc.poll() is not None:
                while self.poll(0.2):   # what it sent before exiting is still being read
                    pass
                return self.index(key, value, after)
            self.poll(min(left, 0.2))

    def index(self, key, value=None, after=-1):
        with self.cond:
            for i, m in enumerate(self.messages):
                if i > after and key in m and (value is None or m[key] == value):
                    return i
        return -1

    def close(self):
        self.closing = True
        self.thread.join()
        self.sock.close()


def endless_model(tmp, model=FIXTURE_MODEL):
    """The fixture model with its EOS id moved just past the vocabulary: greedy answers then run to
    max_tokens, so a test can act on a request that is certainly still running. The weights are the
    fixture's (linked, not copied); dsv4-run computes the same tokens on it."""
    out = os.path.join(tmp, "endless-model")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = cfg["vocab_size"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in os.listdir(model):
        if name.endswith(".safetensors") or name.endswith(".json") and name != "config.json":
            dst = os.path.join(out, name)
            if not os.path.exists(dst):
                os.symlink(os.path.abspath(os.path.join(model, name)), dst)
    return out


class Daemon:
    """One dsv4d under test, in its own temporary directory. endless: serve endless_model();
    tokenizer_vocab below the model's vocab_size: ids past it have no text (a padded vocabulary)."""

    def __init__(self, args=(), activation=True, model=FIXTURE_MODEL, env=None, tokenizer=True, tmp=None,
                 endless=False, tokenizer_vocab=FIXTURE_VOCAB):
        self.tmpobj = None
        if tmp is None:
            self.tmpobj = tempfile.TemporaryDirectory(prefix="dsv4d-test-")
            tmp = self.tmpobj.name
        os.makedirs(tmp, exist_ok=True)
        self.tmp = tmp
        if endless:
            model = endless_model(tmp, model)
        self.model = model
        self.sock_path = os.path.join(tmp, "dsv4d.sock")
        self.notify = Notify(os.path.join(tmp, "notify.sock"))
        self.log_path = os.path.join(tmp, "dsv4d.log")
        self.activation = activation
        argv = [program("dsv4d"), "--config", "", "--model", model, "--backend", "cpu",
                "--max-batch", "4", "--max-context", "256", "--log-level", "debug"]
        if tokenizer:
            tok = os.path.join(tmp, "tokenizer.json")
            write_tokenizer(tok, tokenizer_vocab)
            argv += ["--tokenizer", tok]
        argv += list(args)
        if activation:
            argv = ["systemd-socket-activate", "-l", self.sock_path, "--fdname=dsv4d", "-E", "NOTIFY_SOCKET"] + \
                   [a for k in (env or {}) for a in ("-E", k)] + argv
        else:
            argv += ["--listen", self.sock_path]
        e = dict(os.environ)
        e["NOTIFY_SOCKET"] = self.notify.path
        e.update(env or {})
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        self.trigger = None
        self.stopped = False

    def wait_socket(self):
        """systemd-socket-activate binds before it execs dsv4d; --listen binds during startup."""
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(self.sock_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            self.notify.poll(0.05)
        return True

    def first_client(self):
        """The first connection after wait_socket(): systemd-socket-activate binds (the path appears)
        a moment before it listens, so a refused connect is retried. None if it never listens."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                return Client(self.sock_path)
            except ConnectionRefusedError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    return None
                self.notify.poll(0.05)

    def start(self):
        """Wait for READY=1; socket activation starts dsv4d at the first connection, made here."""
        if not self.wait_socket():
            return False
        if self.activation:
            self.trigger = self.first_client()
            if self.trigger is None:
                return False
        return self.notify.wait_for("READY", "1", proc=self.proc) >= 0

    def stop(self, sig=signal.SIGTERM):
        """Signal and reap; returns the exit status (negative: killed by a signal)."""
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        return rc

    def log_text(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def close(self):
        """Kill what is left. A daemon that died on its own (a crash, a sanitizer report) leaves its log's
        tail in the TAP output as comments."""
        rc = self.proc.poll()
        if rc is None:
            self.proc.kill()
            self.proc.wait()
        elif rc != 0 and not self.stopped:
            print("# dsv4d exited with status %d on its own; the end of its log:" % rc)
            for line in self.log_text().splitlines()[-80:]:
                print("#   " + line)
        if self.trigger:
            self.trigger.close()
        self.notify.close()
        self.log.close()
        if self.tmpobj:
            self.tmpobj.cleanup()


class Closed(Exception):
    pass


class Client:
    """A protocol client over the msgpack package."""

    def __init__(self, path, timeout=TIMEOUT):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        self.next_id = 1
        self.notifications = []

    def send_raw(self, data):
        self.sock.sendall(data)

    def send(self, obj):
        self.sock.sendall(pack(obj))

    def _read_exact(self, n):
        while len(self.buf) < n:
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise Closed()
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self):
        """The next message, or raises Closed at end of stream."""
        (n,) = struct.unpack(">I", self._read_exact(4))
        return msgpack.unpackb(self._read_exact(n), raw=False)

    def closed_by_peer(self):
        """True when the server closes the stream; messages before the end are kept."""
        try:
            while True:
                self.notifications.append(self.recv())
        except Closed:
            return True
        except socket.timeout:
            return False

    def request(self, method, params=None, msgid=None):
        if msgid is None:
            msgid = self.next_id
            self.next_id += 1
        self.send([0, msgid, method, [params if params is not None else {}]])
        return msgid

    def response(self, msgid, on_notification=None):
        """(error, result) of msgid; notifications before it go to on_notification or the list."""
        while True:
            m = self.recv()
            if m[0] == 1 and m[1] == msgid:
                return m[2], m[3]
            if on_notification:
                on_notification(m)
            else:
                self.notifications.append(m)

    def call(self, method, params=None):
        return self.response(self.request(method, params))

    def close(self):
        self.sock.close()


def generate_all(client, params, in_flight):
    """One generate per entry of params on one connection, in_flight at a time (dsv4d holds at most
    max_requests_per_conn, 16 by default); returns [(error, result)] in params' order."""
    done, pending, nxt = {}, {}, 0
    while len(done) < len(params):
        while nxt < len(params) and len(pending) < in_flight:
            pending[client.request("generate", params[nxt])] = nxt
            nxt += 1
        m = client.recv()
        if m[0] == 1 and m[1] in pending:
            done[pending.pop(m[1])] = (m[2], m[3])
    return [done[i] for i in range(len(params))]


def generated_greedy(client, tokens, n):
    """Greedy generation of n tokens from a token prompt; returns (error, result)."""
    return client.call("generate", {"tokens": tokens_bin(tokens), "max_tokens": n, "temperature": 0.0})


def run_dsv4_run(model, tokens, n):
    """dsv4-run's greedy tokens for the same prompt (the offline engine)."""
    dump = tempfile.NamedTemporaryFile(prefix="dsv4-run-", suffix=".f32", delete=False)
    dump.close()
    try:
        out = subprocess.run([program("dsv4-run"), "--model", model, "--tokens", ",".join(map(str, tokens)),
                              "--decode", str(n), "--dump-logits", dump.name],
                             capture_output=True, text=True, timeout=TIMEOUT)
    finally:
        os.unlink(dump.name)
    if out.returncode != 0:
        return None, out.stderr
    return [int(x) for x in out.stdout.split()], out.stderr

