#!/bin/sh
# SPDX-License-Identifier: MIT
# dsv4-run --model: the command-line contract that checks outside the project rely on.
# Runs the first case of the tiny_a fixture through the binary and checks the printed greedy tokens,
# the dumped logits (rows, size, values within 1e-4 of transformers' per row), chunked == one-shot,
# fp8 numerics, and that bad invocations fail with a message on stderr. Prints TAP.
set -u
top_srcdir=${top_srcdir:-.}
top_builddir=${top_builddir:-.}
run="$top_builddir/dsv4-run"
fx="$top_srcdir/tests/fixtures/tiny_a"
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
n=0
failed=0
ok() {
    n=$((n + 1))
    if [ "$1" = 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; failed=1; fi
}

echo "1..9"

# The first case of cases.json (json.dump with indent=1: one value per line).
case_array() {
    awk -v key="\"$1\"" '
        index($0, key) && !done { grab = 1; next }
        grab && /\]/ { grab = 0; done = 1 }
        grab { gsub(/[ ,]/, ""); printf "%s%s", sep, $0; sep = "," }
    ' "$fx/cases.json"
}
tokens=$(case_array tokens)
greedy=$(case_array greedy | tr ',' ' ')
logits=$(awk -F'"' '/"logits"/ { print $4; exit }' "$fx/cases.json")
vocab=$(awk -F'[:,]' '/"vocab_size"/ { gsub(/ /, "", $2); print $2; exit }' "$fx/config.json")
decode=$(echo "$greedy" | wc -w)
prompt=$(echo "$tokens" | tr ',' ' ' | wc -w)

out=$("$run" --model "$fx" --tokens "$tokens" --decode "$decode" --dump-logits "$tmp/one.f32" 2>"$tmp/err")
ok $? "dsv4-run exits 0 on the fixture case"
[ "$out" = "$greedy" ]
ok $? "greedy tokens equal transformers' ($decode steps)"
size=$(wc -c <"$tmp/one.f32")
[ "$size" -eq $(((prompt + decode) * vocab * 4)) ]
ok $? "dump holds (P+N) rows of vocab float32 ($size bytes)"

# Per row: max |ours - transformers| / max |transformers| <= 1e-4.
od -An -v -f -w4 "$tmp/one.f32" >"$tmp/ours.txt"
od -An -v -f -w4 "$fx/$logits" >"$tmp/ref.txt"
paste "$tmp/ours.txt" "$tmp/ref.txt" | awk -v V="$vocab" '
    { d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2
      if (d > dmax) dmax = d; if (m > mmax) mmax = m
      if (NR % V == 0) { e = dmax / mmax; if (e > worst) worst = e; dmax = 0; mmax = 0 } }
    END { printf "# worst row error %.2e\n", worst; exit !(NR > 0 && worst <= 1e-4) }'
ok $? "logits within 1e-4 of transformers on every row"

out7=$("$run" --model "$fx" --tokens "$tokens" --decode "$decode" --dump-logits "$tmp/c7.f32" --chunk 7 2>>"$tmp/err")
[ $? = 0 ] && [ "$out7" = "$out" ] && cmp -s "$tmp/one.f32" "$tmp/c7.f32"
ok $? "--chunk 7 gives the same tokens and bit-identical logits"

outf=$("$run" --model "$fx" --tokens "$tokens" --decode 4 --dump-logits "$tmp/f8.f32" --numerics fp8 2>>"$tmp/err")
[ $? = 0 ] && [ "$(echo "$outf" | wc -w)" -eq 4 ] && [ "$(wc -c <"$tmp/f8.f32")" -eq $(((prompt + 4) * vocab * 4)) ]
ok $? "--numerics fp8 runs and dumps (P+4) rows"

fails=0
for args in "--tokens 1,2" "--model $fx --tokens 1,x,3" "--model $fx --tokens 1,$vocab" \
            "--model $fx --tokens 1 --numerics bf16" "--model $fx --tokens 1 --decode -2" \
            "--model $fx --tokens 1 --chunk 0" "--model $tmp/none --tokens 1" \
            "--model $fx --tokens 1 --dump-logits $tmp/no/such/dir/x.f32"; do
    # shellcheck disable=SC2086
    if "$run" $args >/dev/null 2>"$tmp/bad"; then
        echo "# accepted: $args"; fails=1
    elif [ ! -s "$tmp/bad" ]; then
        echo "# no message for: $args"; fails=1
    fi
done
ok $fails "bad invocations exit non-zero with a message"

out0=$("$run" --model "$fx" --tokens 5,17,9 --decode 0 --dump-logits "$tmp/z.f32" 2>>"$tmp/err")
[ $? = 0 ] && [ -z "$out0" ] && [ "$(wc -c <"$tmp/z.f32")" -eq $((3 * vocab * 4)) ]
ok $? "--decode 0 prints no tokens and dumps the prompt rows"

[ ! -s "$tmp/err" ]
ok $? "successful runs print nothing on stderr"
exit 0
