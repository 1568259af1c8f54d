#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write tests/tokenizer/golden/tokenizer_golden.json: encodings and decodings computed by Hugging
Face `tokenizers` on the DeepSeek-V4 tokenizer.json, so the C unit test can check the tokenizer
without Python. Inputs: a sample of the corpus (see build_corpus.py) plus hand-made edge cases.

  {"tokenizers": VERSION,
   "encode": [{"text": STR, "flags": 0|1|2, "ids": [...]}, ...],   flags as enum dsv4_tok_encode_flags
   "decode": [{"ids": [...], "skip_special": BOOL, "text": STR}, ...]}

usage: make_golden.py TOKENIZER_JSON CORPUS OUT.json
"""
import json
import random
import sys

import tokenizers
from tokenizers import Tokenizer

SAMPLE_BYTES = 100_000
EDGE = [
    "", " ", "  ", "\n", "\r\n", "\r", "\n\n\n", " \n ", "\t\t", "a", "ab", "hello world",
    "Hello, world! How's it going?", "don't won't they'll I'm", "123", "1234567", "12,345.678",
    "٣٤٥٦", "x1y22z333", "你好，世界！", "こんにちは世界", "カタカナとひらがな", "한국어 텍스트",
    "Привет, мир!", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก", "e\u0301\u0301\u0301",
    "👨‍👩‍👧‍👦🇺🇸🏳️‍🌈", "a\u00a0b\u2003c\u3000d", "x \u2028 y \u2029 z \x85 w",
    "<think>reasoning</think>answer", "<｜User｜>hi<｜Assistant｜>", "<｜begin▁of▁sentence｜>x",
    "<｜end▁of▁sentence｜><｜end▁of▁sentence｜>", "<<think>>", "<｜User", "<think", "｜DSML｜<dsml:x",
    "    def f(x):\n        return x  # comment\n", "a" * 3000, " " * 1000 + "x", "!!!???...",
    "\u1b4e\u1c89 \U00016d70", "\ufeffBOM", "tab\there", "\x0b\x0c\x1c",
]


def main():
    tok_path, corpus_path, out_path = sys.argv[1:4]
    hf = Tokenizer.from_file(tok_path)
    spec = json.load(open(tok_path, encoding="utf-8"))
    spec["added_tokens"] = []
    plain = Tokenizer.from_str(json.dumps(spec))
    records = open(corpus_path, "rb").read().decode("utf-8").split("\0")
    rng = random.Random(99)
    texts = list(EDGE)
    total = 0
    while total < SAMPLE_BYTES:
        r = rng.choice(records)
        if len(r.encode()) > 4000:
            start = rng.randrange(len(r) - 1000)
            r = r[start:start + rng.randint(1, 1000)]
        texts.append(r)
        total += len(r.encode())
    enc = []
    for i, t in enumerate(texts):
        flags = i % 3 if i >= len(EDGE) else 0
        if flags == 0:
            ids = hf.encode(t).ids
        elif flags == 1:
            hf.encode_special_tokens = True
            ids = hf.encode(t).ids
            hf.encode_special_tokens = False
        else:
            ids = plain.encode(t).ids
        enc.append({"text": t, "flags": flags, "ids": ids})
    for t in EDGE:  # the edge cases under every flag
        hf.encode_special_tokens = True
        enc.append({"text": t, "flags": 1, "ids": hf.encode(t).ids})
        hf.encode_special_tokens = False
        enc.append({"text": t, "flags": 2, "ids": plain.encode(t).ids})
    vocab = hf.get_vocab_size()
    special = sorted(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
    dec = []
    for _ in range(400):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(vocab) if rng.random() < 0.5
               else rng.randrange(3, 259) for _ in range(rng.randint(1, 30))]
        skip = rng.random() < 0.5
        dec.append({"ids": ids, "skip_special": skip, "text": hf.decode(ids, skip_special_tokens=skip)})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"tokenizers": tokenizers.__version__, "encode": enc, "decode": dec}, f,
                  ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
