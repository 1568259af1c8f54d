#!/bin/bash
# SPDX-License-Identifier: MIT
# Speculative decoding on a model with an MTP block, through dsv4d: for each spec_tokens k (0 = off),
# boot dsv4d, ask the model's held-out questions (eval.json, greedy, chat format), then run
# `dsv4ctl bench` at concurrency 1, and print the replies' agreement with k = 0, the drafts
# accepted and the tokens per decode step (dsv4ctl stats), and the bench's line.
#
#   tools/measure-spec.sh BUILD_DIR MODEL_DIR [K...]        (default K: 0 1 2 3)
#
# BUILD_DIR holds dsv4d and dsv4ctl. Questions: QUESTIONS (default 100) of eval.json's held-out list.
# Bench: BENCH_ARGS (default: 16 requests, 64 prompt tokens, 64 output tokens, temperature 0).
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR MODEL_DIR [K...]}
model=${2:?usage: $0 BUILD_DIR MODEL_DIR [K...]}
shift 2
ks=("$@")
[ ${#ks[@]} -gt 0 ] || ks=(0 1 2 3)
questions=${QUESTIONS:-100}
bench_args=${BENCH_ARGS:---requests 16 --prompt-tokens 64 --max-tokens 64 --temperature 0}
work=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
pid=

python3 -c 'import json, sys
for it in json.load(open(sys.argv[1]))["heldout"][:int(sys.argv[2])]:
    print(it["question"])' "$model/eval.json" "$questions" > "$work/questions"

for k in "${ks[@]}"; do
    sock=$work/d.sock
    "$build/dsv4d" --config "" --listen "$sock" --model "$model" --backend cpu --threads 1 --max-batch 1 \
        --spec-tokens "$k" --prefix-cache 0 > "$work/dsv4d.$k.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do DSV4_SOCKET=$sock "$build/dsv4ctl" health > /dev/null 2>&1 && break; sleep 0.1; done
    base=$(DSV4_SOCKET=$sock "$build/dsv4ctl" stats --json)
    while IFS= read -r q; do
        DSV4_SOCKET=$sock "$build/dsv4ctl" generate --chat --temperature 0 "$q"
        echo
    done < "$work/questions" > "$work/replies.$k"
    after=$(DSV4_SOCKET=$sock "$build/dsv4ctl" stats --json)
    bench=$(DSV4_SOCKET=$sock "$build/dsv4ctl" bench --concurrency 1 $bench_args)
    final=$(DSV4_SOCKET=$sock "$build/dsv4ctl" stats --json)
    kill "$pid"
    wait "$pid" 2> /dev/null || true
    pid=
    same=$(cmp -s "$work/replies.$k" "$work/replies.${ks[0]}" && echo identical || echo DIFFERENT)
    python3 - "$k" "$questions" "$same" "$base" "$after" "$final" "$bench" <<'EOF'
import json, sys
k, n, same = sys.argv[1], sys.argv[2], sys.argv[3]
base, after, final = (json.loads(a) for a in sys.argv[4:7])
def part(a, b, what):
    v, d, acc = (b[x] - a[x] for x in ("spec_verifies", "spec_drafted", "spec_accepted"))
    hist = [y - x for x, y in zip(a.get("spec_accept_hist") or [0] * 4, b.get("spec_accept_hist") or [])]
    if not v:
        return "%s: no drafts" % what
    return ("%s: %d verifies, %d of %d drafts accepted (%.1f %%), %.2f tokens per decode step, accepted 0..k: %s"
            % (what, v, acc, d, 100.0 * acc / d, 1.0 + acc / v, hist))
print("spec_tokens %s: %s questions, replies %s to spec_tokens's first value" % (k, n, same))
print("  " + part(base, after, "questions"))
print("  " + part(after, final, "bench"))
print("  bench: " + sys.argv[7].strip().replace("\n", "\n  bench: "))
EOF
done
