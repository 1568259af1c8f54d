#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Encoding throughput, single thread: the C tokenizer (tests/tokenizer/bench_encode) against
Hugging Face `tokenizers` on the same tokenizer.json and the same text.

Two shapes of the same corpus: "records" (each NUL-separated record encoded on its own) and
"whole" (the corpus, NULs turned into newlines, encoded as one string). `tokenizers` runs with
RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false, one encode() call at a time; its time is the
process CPU time. Best of REPEATS runs for both.

usage: bench.py BENCH_ENCODE TOKENIZER_JSON CORPUS [REPEATS]
"""
import os
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402  (after the thread settings)


def main():
    bench, tok_path, corpus = sys.argv[1:4]
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    data = open(corpus, "rb").read()
    whole = data.replace(b"\0", b"\n")
    with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
        f.write(whole)
        whole_path = f.name
    hf = Tokenizer.from_file(tok_path)
    records = data.decode().split("\0")
    text = whole.decode()
    for shape, path, inputs in (("records", corpus, records), ("whole", whole_path, [text])):
        out = subprocess.run([bench, tok_path, path, str(repeats)], capture_output=True, text=True, check=True)
        print(f"{shape:8s} C:          {out.stdout.strip()}")
        best = None
        for _ in range(repeats):
            start = time.process_time()
            n = sum(len(hf.encode(s).ids) for s in inputs)
            t = time.process_time() - start
            best = t if best is None else min(best, t)
        print(f"{shape:8s} tokenizers: {len(data)} bytes -> {n} ids; best of {repeats} {best:.3f} s "
              f"({len(data) / best / 1e6:.2f} MB/s)")
    os.unlink(whole_path)


if __name__ == "__main__":
    main()
