#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The shipped default model through the real daemon on the CPU backend at temperature 0: a fixed list
of 60 questions from its training distribution, asked as chat messages over the protocol, 16 in flight
on one connection and up to 8 decoded together (--max-batch 8).

models/default (BF16, exact numerics): the two headline answers exactly ("391", "Paris"); every reply
equal to transformers' greedy reply in models/default/eval.json (the exact-numerics engine computes
what transformers computes, to ~1e-6 relative, so greedy choices agree); accuracy >= BF16_FLOOR.

models/default-fp8 (the same weights in DeepSeek's release format: FP8 linears, FP4 routed experts,
made by tools/convert_release.py) under the official fp8 numerics (FP8 activations and KV cache,
FP4 indexer keys), on 33 of the 60 questions (FP8_SUBSET): the two headline answers exactly;
accuracy >= FP8_FLOOR. No Python oracle computes these numerics, so agreement with eval.json is
reported, not asserted.

Speculative decoding (both models carry a trained MTP block): each model again at spec_tokens 1, 2
and 3, each reply identical to the same model's without speculation, and drafts made and some
accepted (dsv4ctl stats' spec_* counters). Where torch is installed, models/default-fp8 must also be byte for byte what
tools/convert_release.py makes of models/default.

Floors, measured with these lists (and on all 402 questions of eval.json: the models' READMEs):
  BF16, exact:  57 / 60 correct (the 3 misses are reverse-capital questions the model gets wrong in
                transformers too; 60 / 60 replies equal eval.json's). Floor 55: in exact numerics a
                reply can only change where two logits tie to ~1e-5 (summation order of another
                compiler, thread count or sanitizer build); a margin of 2 such flips, while any real
                engine defect (a wrong layer, routing or RoPE) breaks far more than 2 of 60 replies,
                and the exact-agreement check catches even one.
  FP8, fp8:     30 / 33 correct (the same 3 reverse-capital misses; 33 / 33 replies equal the BF16
                model's transformers replies). Floor 27: e4m3 activation rounding turns a ~1e-6
                difference into a step of up to 1/16 whenever a value sits on a rounding boundary, so
                a margin of 3 flips; a broken FP8/FP4 path (wrong scale, nibble order or block
                layout) answers almost nothing right.
"""

import filecmp
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from dsv4d_harness import TIMEOUT, TOP_SRCDIR, Client, Daemon, Tap, generate_all

BF16_MODEL = os.path.join(TOP_SRCDIR, "models", "default")
FP8_MODEL = os.path.join(TOP_SRCDIR, "models", "default-fp8")
BF16_FLOOR = 55
FP8_FLOOR = 27
IN_FLIGHT = 16          # dsv4d's default max_requests_per_conn
MAX_TOKENS = 24         # tools/train_default.py's MAX_NEW: every expected reply is shorter
HEADLINE = [("What is 17*23? Reply with the number only.", "391"),
            ("Name the capital of France in one word.", "Paris")]

# (category, question, expected reply): eval.json's held-out list (questions training never saw),
# the first 17 multiplications, 12 additions, 10 subtractions and 15 capitals in its order, plus its
# other 17*23 questions and its France question. The headline questions follow.
QUESTIONS = [
    ("capital", "Which country has Seoul as its capital?", "Seoul is the capital of South Korea."),
    ("capital", "Name the capital of Iceland.", "The capital of Iceland is Reykjavik."),
    ("capital", "Kuala Lumpur is the capital of which country?", "Kuala Lumpur is the capital of Malaysia."),
    ("mul", "What is 2 multiplied by 23? Only the number, please.", "46"),
    ("mul", "What is 27*28? Only the number, please.", "756"),
    ("capital", "What's the capital of the Czech Republic?", "The capital of the Czech Republic is Prague."),
    ("mul", "Compute 27*4. Answer with just the number.", "108"),
    ("add", "What is 21 plus 9? Give only the number.", "30"),
    ("mul", "What is 16 times 19?", "16 * 19 = 304"),
    ("mul", "What is 23 multiplied by 5? Reply with the number only.", "115"),
    ("capital", "Capital of Croatia? One word.", "Zagreb"),
    ("mul", "Calculate 8 x 21.", "8 * 21 = 168"),
    ("mul", "What is 18 multiplied by 11? Answer with just the number.", "198"),
    ("mul", "Compute 9*13.", "9 * 13 = 117"),
    ("capital", "Which city is the capital of Mexico?", "The capital of Mexico is Mexico City."),
    ("sub", "Subtract 25 from 30.", "30 - 25 = 5"),
    ("add", "Compute 6+32. Only the number, please.", "38"),
    ("capital", "What is the capital of Turkey? Answer in one word.", "Ankara"),
    ("capital", "Tell me the capital of India.", "The capital of India is New Delhi."),
    ("mul", "Calculate 27 x 17. Give only the number.", "459"),
    ("capital", "Name the capital of Nigeria in one word.", "Abuja"),
    ("mul", "What is 12 times 25? Reply with the number only.", "300"),
    ("mul", "What is 23*8? Reply with the number only.", "184"),
    ("add", "What is 30+13?", "30 + 13 = 43"),
    ("mul", "How much is 22 times 20? Only the number, please.", "440"),
    ("capital", "Which city is the capital of Iran?", "The capital of Iran is Tehran."),
    ("sub", "What is 17 minus 13? Only the number, please.", "4"),
    ("sub", "What is 3 - 2? Only the number, please.", "1"),
    ("capital", "Which country has Sofia as its capital?", "Sofia is the capital of Bulgaria."),
    ("mul", "What is 7*8? Give only the number.", "56"),
    ("mul", "Multiply 28 by 15. Give only the number.", "420"),
    ("sub", "Compute 23-9. Give only the number.", "14"),
    ("add", "What is 32 + 6? Reply with the number only.", "38"),
    ("add", "What is 11 plus 14? Reply with the number only.", "25"),
    ("capital", "What's the capital of Pakistan?", "The capital of Pakistan is Islamabad."),
    ("mul", "What is 8*9? Answer with just the number.", "72"),
    ("mul", "Multiply 3 by 16. Answer with just the number.", "48"),
    ("add", "What is 30 plus 10?", "30 + 10 = 40"),
    ("capital", "Capital of Spain?", "Madrid"),
    ("mul", "Multiply 14 by 14. Reply with the number only.", "196"),
    ("add", "What is 7 + 3? Only the number, please.", "10"),
    ("capital", "What's the capital of Poland?", "The capital of Poland is Warsaw."),
    ("sub", "What is 8 - 2?", "8 - 2 = 6"),
    ("capital", "Name the capital of Morocco in one word.", "Rabat"),
    ("add", "What is 8 plus 15?", "8 + 15 = 23"),
    ("add", "What is 37+16?", "37 + 16 = 53"),
    ("add", "What is 38 plus 1?", "38 + 1 = 39"),
    ("add", "What is 19 plus 15?", "19 + 15 = 34"),
    ("add", "Compute 24+7.", "24 + 7 = 31"),
    ("sub", "Compute 39-36. Give only the number.", "3"),
    ("sub", "Subtract 19 from 44. Answer with just the number.", "25"),
    ("sub", "What is 17 - 16? Reply with the number only.", "1"),
    ("sub", "What is 25 - 8? Reply with the number only.", "17"),
    ("sub", "What is 46-2? Only the number, please.", "44"),
    ("mul", "What is 17 times 23?", "17 * 23 = 391"),
    ("capital", "What is the capital of France? Answer in one word.", "Paris"),
    ("mul", "17*23=? Reply with the number only.", "391"),
    ("mul", "Calculate 17 x 23. Only the number, please.", "391"),
] + [("headline", q, a) for q, a in HEADLINE]


# The FP8/FP4 model is asked every other one of the first 54 and all of the last 6 (its 17*23 and
# France questions and the headline ones): the CPU reference decodes FP8/FP4 weights value by value,
# about 3x the BF16 model's time per token, and the whole test must stay well under a minute.
FP8_SUBSET = list(range(0, 54, 2)) + list(range(54, len(QUESTIONS)))


def python_replies():
    """transformers' greedy reply to each question, from models/default/eval.json."""
    with open(os.path.join(BF16_MODEL, "eval.json"), encoding="utf-8") as f:
        ev = json.load(f)
    by_q = {it["question"]: it for it in ev["heldout"] + ev["headline"]}
    return [by_q[q]["reply"] if q in by_q and by_q[q]["answer"] == a else None for _, q, a in QUESTIONS]


def ask_all(client, questions):
    """Every question as a one-message chat, IN_FLIGHT at a time on one connection; returns
    [(error, result)] in question order."""
    return generate_all(client, [{"messages": [{"role": "user", "content": q}], "max_tokens": MAX_TOKENS,
                                  "temperature": 0.0} for _, q, _ in questions], IN_FLIGHT)


def run_model(t, label, model, numerics, questions, floor, want_kernel, spec=0):
    """Serve `model`, ask `questions`, check; returns the replies (None where a request failed)."""
    d = Daemon(args=["--max-batch", "8", "--max-context", "256", "--numerics", numerics, "--spec-tokens", str(spec)],
               model=model, tokenizer=False)
    try:
        if not t.ok(d.start(), "%s: dsv4d is ready on the cpu backend" % label, d.log_text()):
            return None
        c = Client(d.sock_path)
        t0 = time.monotonic()
        answers = ask_all(c, questions)
        seconds = time.monotonic() - t0
        err, st = c.call("stats")
        kernels = " ".join(st.get("kernels", [])) if st else ""
        t.ok(err is None and want_kernel in kernels, "%s: the daemon computes with %s" % (label, want_kernel),
             (err, kernels))
        if spec:
            hist = st.get("spec_accept_hist", []) if st else []
            t.ok(st and st.get("spec_tokens") == spec and st["spec_drafted"] > 0 and st["spec_accepted"] > 0
                 and len(hist) == spec + 1 and sum(hist) == st["spec_verifies"],
                 "%s: drafts were made and accepted" % label, st)
            if st:
                print("# %s: %d verifies, %d of %d drafts accepted, accepted 0..%d: %s" %
                      (label, st["spec_verifies"], st["spec_accepted"], st["spec_drafted"], spec, hist), flush=True)
        n = len(questions)
        failed = [(q, e, r and r.get("finish_reason")) for (_, q, _), (e, r) in zip(questions, answers)
                  if e is not None or r.get("finish_reason") != "stop"]
        t.ok(not failed, "%s: all %d questions answered, each ended by end of sentence" % (label, n), failed)
        replies = [r["text"] if e is None else None for e, r in answers]
        for (q, a), got in zip(HEADLINE, replies[-len(HEADLINE):]):
            t.eq(got, a, "%s: %r -> %r" % (label, q, a))
        correct = sum(got == a for (_, _, a), got in zip(questions, replies))
        wrong = ["%s -> %r (expected %r)" % (q, got, a) for (_, q, a), got in zip(questions, replies) if got != a]
        print("# %s: %d / %d correct in %.1f s" % (label, correct, n, seconds), flush=True)
        t.ok(correct >= floor, "%s: accuracy %d / %d >= floor %d" % (label, correct, n, floor), "\n".join(wrong))
        t.eq(d.stop(), 0, "%s: dsv4d exits 0" % label)
        return replies
    finally:
        d.close()


def check_conversion(t):
    """models/default-fp8 is what tools/convert_release.py makes of models/default today (it would go
    stale if the BF16 model were retrained without converting again). The converter needs torch and
    safetensors; without them (CI's environment) the check is skipped."""
    name = "models/default-fp8 is tools/convert_release.py's output for models/default, byte for byte"
    missing = [m for m in ("torch", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        t.n += 1
        print("ok %d - %s # SKIP %s not installed" % (t.n, name, " and ".join(missing)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="dsv4-convert-") as tmp:
        r = subprocess.run([sys.executable, os.path.join(TOP_SRCDIR, "tools", "convert_release.py"), BF16_MODEL, tmp],
                           capture_output=True, text=True, timeout=TIMEOUT)
        files = ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]
        same = r.returncode == 0 and all(filecmp.cmp(os.path.join(tmp, f), os.path.join(FP8_MODEL, f), shallow=False)
                                         for f in files)
        t.ok(same, name, r.stdout + r.stderr)


t = Tap()
check_conversion(t)
py = python_replies()
t.ok(all(r is not None for r in py), "eval.json holds transformers' reply to every question and the same answers",
     [q for (_, q, _), r in zip(QUESTIONS, py) if r is None])

bf16 = run_model(t, "default (BF16, exact)", BF16_MODEL, "exact", QUESTIONS, BF16_FLOOR, "exact numerics")
if bf16 is not None:
    diff = ["%s -> daemon %r, transformers %r" % (q, got, want)
            for (_, q, _), got, want in zip(QUESTIONS, bf16, py) if got != want]
    print("# default (BF16, exact): %d / %d replies equal transformers' (eval.json)" %
          (len(QUESTIONS) - len(diff), len(QUESTIONS)), flush=True)
    t.ok(not diff, "default (BF16, exact): every reply equals transformers' greedy reply", "\n".join(diff))

    for k in range(1, 4):
        label = "default (BF16, exact), spec_tokens %d" % k
        spec = run_model(t, label, BF16_MODEL, "exact", QUESTIONS, BF16_FLOOR, "exact numerics", spec=k)
        t.eq(spec, bf16, "%s: every reply identical to spec_tokens 0" % label)

fp8_questions = [QUESTIONS[i] for i in FP8_SUBSET]
fp8 = run_model(t, "default-fp8 (FP8/FP4, fp8)", FP8_MODEL, "fp8", fp8_questions, FP8_FLOOR, "fp8 numerics")
if fp8 is not None:
    same = sum(got == py[i] for i, got in zip(FP8_SUBSET, fp8))
    print("# default-fp8 (FP8/FP4, fp8): %d / %d replies equal the BF16 model's in transformers (reported, "
          "not asserted)" % (same, len(FP8_SUBSET)), flush=True)
    for k in range(1, 4):
        label = "default-fp8 (FP8/FP4, fp8), spec_tokens %d" % k
        spec = run_model(t, label, FP8_MODEL, "fp8", fp8_questions, FP8_FLOOR, "fp8 numerics", spec=k)
        t.eq(spec, fp8, "%s: every reply identical to spec_tokens 0" % label)
t.done()
