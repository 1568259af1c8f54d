#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Differential test: dsv4-run's tokenizer against Hugging Face `tokenizers` on the same
tokenizer.json and the same corpus (NUL-separated records, see build_corpus.py). Prints TAP.

Checks: ids of every record (default flags, special tokens as text, all added tokens as text),
ids of freshly generated text (new seed each run, printed), ids of the whole corpus as one
string, decode(encode(corpus)) == corpus, and decoding fresh random id sequences (cut characters,
special tokens, skip_special) to the exact string `tokenizers` returns.

usage: diff_test.py DSV4_RUN TOKENIZER_JSON CORPUS
"""
import json
import os
import random
import subprocess
import sys

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_corpus  # noqa: E402  (the corpus generator, beside this file)

failures = 0
count = 0


def tap(ok, name, detail=""):
    global failures, count
    count += 1
    print(f"{'ok' if ok else 'not ok'} {count} - {name}")
    if not ok:
        failures += 1
        for line in detail.splitlines():
            print(f"# {line}")
    sys.stdout.flush()


def run(dsv4_run, tok_path, args, data):
    p = subprocess.run([dsv4_run, "--tokenizer", tok_path] + args, input=data, capture_output=True)
    if p.returncode:
        raise RuntimeError(f"dsv4-run {' '.join(args)} exited {p.returncode}: {p.stderr.decode()[:500]}")
    return p.stdout


def parse_lines(out):
    return [[int(x) for x in line.split()] for line in out.decode().split("\n")[:-1]]


def first_difference(records, want, got):
    if len(want) != len(got):
        return f"{len(want)} records expected, {len(got)} lines received"
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            k = next((j for j in range(min(len(w), len(g))) if w[j] != g[j]), min(len(w), len(g)))
            return (f"record {i} ({len(records[i])} chars): first difference at id {k}\n"
                    f"text near: {records[i][:200]!r}\n"
                    f"tokenizers: {w[max(0, k - 3):k + 5]}\ndsv4-run:   {g[max(0, k - 3):k + 5]}")
    return ""


def compare_records(dsv4_run, tok_path, hf, records, args, name):
    want = [e.ids for e in hf.encode_batch(records)]
    got = parse_lines(run(dsv4_run, tok_path, ["--encode", "--records"] + args,
                          "\0".join(records).encode()))
    diff = first_difference(records, want, got)
    tap(not diff, f"{name}: {len(records)} records, {sum(map(len, want))} ids identical", diff)


def main():
    dsv4_run, tok_path, corpus_path = sys.argv[1:4]
    data = open(corpus_path, "rb").read()
    text = data.decode("utf-8")
    records = text.split("\0")
    print(f"# corpus {corpus_path}: {len(data)} bytes, {len(records)} records")

    hf = Tokenizer.from_file(tok_path)
    added = hf.get_added_tokens_decoder()
    tap(hf.token_to_id("<think>") == 128821 and hf.token_to_id("</think>") == 128822,
        "the tokenizer file is DeepSeek-V4's (<think> 128821, </think> 128822)")

    compare_records(dsv4_run, tok_path, hf, records, [], "default encode")

    hf.encode_special_tokens = True
    compare_records(dsv4_run, tok_path, hf, records, ["--special-as-text"], "special tokens as text")
    hf.encode_special_tokens = False

    # Fresh text every run (the corpus is fixed): the corpus generator with a new seed.
    seed = random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    fresh = [r for r in build_corpus.chop(rng, build_corpus.generated(
        rng, 300_000, build_corpus.special_contents())) if r]
    compare_records(dsv4_run, tok_path, hf, fresh, [], f"fresh generated text (seed {seed})")

    # Oracle for "no added token recognised": the same file with its added tokens removed.
    spec = json.load(open(tok_path, encoding="utf-8"))
    spec["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(spec))
    compare_records(dsv4_run, tok_path, plain, records, ["--added-as-text"], "all added tokens as text")

    whole = hf.encode(text).ids
    got = run(dsv4_run, tok_path, ["--encode"], data).split()
    got = [int(x) for x in got]
    tap(whole == got, f"whole corpus as one text: {len(whole)} ids identical",
        first_difference([text], [whole], [got]))

    back = run(dsv4_run, tok_path, ["--decode"], " ".join(map(str, got)).encode())
    tap(back == data, "decode(encode(corpus)) == corpus",
        f"{len(back)} bytes back for {len(data)}" if back != data else "")

    seed = random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    print(f"# decode seed {seed}")
    vocab = hf.get_vocab_size()
    special = [i for i, t in added.items() if t.special]
    seqs = []
    # NUL separates the decoded texts, so ids whose text holds a NUL byte are left out.
    has_nul = {i for i in range(vocab) if "\0" in hf.decode([i], skip_special_tokens=False)}
    while len(seqs) < 2000:
        n = rng.randint(1, 40)
        seq = []
        for _ in range(n):
            r = rng.random()
            seq.append(rng.choice(special) if r < 0.1 else rng.randrange(vocab) if r < 0.6
                       else rng.randrange(3, 259))  # low ids: single bytes, often cut characters
        if not has_nul.intersection(seq):
            seqs.append(seq)
    seqs += [[i] for i in sorted(added) if not has_nul.intersection([i])]  # every added token alone
    for skip, args in ((False, []), (True, ["--skip-special"])):
        want = [hf.decode(seq, skip_special_tokens=skip).encode("utf-8") for seq in seqs]
        lines = "".join(" ".join(map(str, seq)) + "\n" for seq in seqs).encode()
        got_b = run(dsv4_run, tok_path, ["--decode", "--records"] + args, lines).split(b"\0")
        bad = "" if len(got_b) == len(want) else f"{len(got_b)} texts back for {len(want)}"
        for seq, w, g in zip(seqs, want, got_b):
            if w != g and not bad:
                bad = f"ids {seq}\ntokenizers {w!r}\ndsv4-run   {g!r}"
        tap(not bad, f"decode of {len(seqs)} id sequences, random and each added token "
            f"(skip_special_tokens={skip})", bad)

    print(f"1..{count}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
