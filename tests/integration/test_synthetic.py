#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A model directory with synthetic.json instead of safetensors shards (engine/model/synth.h), end to
end: tools/dsv4-mkckpt --synthetic writes the recipe; dsv4d serves the default model's shape from a
recipe (its config and tokenizer beside it), says in its log that the weights are synthetic, and
answers the same tokens in two processes (the values are a function of the seed); a bad recipe stops
the boot with a message naming the key."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsv4d_harness import TIMEOUT, TOP_SRCDIR, Client, Daemon, Tap, bin_tokens, tokens_bin  # noqa: E402

DEFAULT = os.path.join(TOP_SRCDIR, "models", "default-fp8")
MKCKPT = os.path.join(TOP_SRCDIR, "tools", "dsv4-mkckpt")


def recipe_dir(root, name, recipe):
    d = os.path.join(root, name)
    os.makedirs(d)
    for f in ("config.json", "tokenizer.json"):
        shutil.copyfile(os.path.join(DEFAULT, f), os.path.join(d, f))
    with open(os.path.join(d, "synthetic.json"), "w") as f:
        f.write(recipe)
    return d


def answer(t, model, label):
    """Greedy tokens of one prompt from a dsv4d on model, or None."""
    d = Daemon(args=["--max-batch", "2", "--max-context", "128"], model=model, tokenizer=False)
    try:
        if not t.ok(d.start(), "%s: dsv4d is ready" % label, d.log_text()):
            return None
        c = Client(d.sock_path)
        err, res = c.call("generate", {"tokens": tokens_bin([0, 100, 200, 300, 400]), "max_tokens": 8,
                                       "temperature": 0.0})
        c.close()
        t.ok(err is None and res["finish_reason"] in ("stop", "length") and len(res["tokens"]) > 0,
             "%s: it answers" % label, (err, res))
        t.ok("synthetic: random values generated at load" in d.log_text(), "%s: the boot log says the weights "
             "are synthetic" % label)
        t.eq(d.stop(), 0, "%s: dsv4d exits 0" % label)
        return bin_tokens(res["tokens"]) if err is None else None
    finally:
        d.close()


def main():
    t = Tap()
    root = tempfile.mkdtemp(prefix="dsv4-synth-")
    try:
        # the tool writes a recipe (no numpy needed for that) and refuses to put one beside shards
        out = os.path.join(root, "flash")
        r = subprocess.run([sys.executable, MKCKPT, "--synthetic", "--preset", "flash", "--layers", "8",
                            "--router-skew", "0.25", "--mtp", "--out", out], capture_output=True, text=True,
                           timeout=TIMEOUT)
        ok = r.returncode == 0
        if ok:
            with open(os.path.join(out, "synthetic.json")) as f:
                rec = json.load(f)
            with open(os.path.join(out, "config.json")) as f:
                cfg = json.load(f)
            ok = rec == {"seed": 1, "distinct_layers": 6, "router_skew": 0.25} and \
                cfg["num_hidden_layers"] == 8 and cfg["num_nextn_predict_layers"] == 1 and \
                not any(n.endswith(".safetensors") for n in os.listdir(out))
        t.ok(ok, "dsv4-mkckpt --synthetic writes config.json and the recipe, no weights", (r.stdout, r.stderr))
        open(os.path.join(out, "model.safetensors"), "wb").close()
        r = subprocess.run([sys.executable, MKCKPT, "--synthetic", "--preset", "flash", "--layers", "4", "--out", out],
                           capture_output=True, text=True, timeout=TIMEOUT)
        t.ok(r.returncode != 0 and "already holds weights" in r.stderr, "dsv4-mkckpt --synthetic refuses a "
             "directory with shards", r.stderr)

        good = '{"seed": 3, "distinct_layers": 5, "router_skew": 0.5}'
        a = answer(t, recipe_dir(root, "a", good), "recipe")
        b = answer(t, recipe_dir(root, "b", good), "same recipe, another process")
        t.ok(a is not None and a == b, "the same recipe gives the same tokens in two processes", (a, b))

        d = Daemon(args=["--max-batch", "2", "--max-context", "128"], tokenizer=False,
                   model=recipe_dir(root, "bad", '{"seed": 3, "layers": 5}'))
        try:
            started = d.start()
            rc = d.proc.wait(timeout=TIMEOUT)
            t.ok(not started and rc != 0 and 'unknown key "layers"' in d.log_text(),
                 "a recipe with an unknown key stops the boot, and the log names it", (rc, d.log_text()[-2000:]))
        finally:
            d.stopped = True
            d.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t.done()


if __name__ == "__main__":
    main()
