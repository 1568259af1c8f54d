#!/bin/sh
# SPDX-License-Identifier: MIT
# Skips stay skips where the optional test dependencies are absent: a cmocka test whose cases skip
# (test_chat without the V4 tokenizer.json), run as make check runs it, prints "ok N # SKIP" and no
# "not ok"; an integration test without the Python msgpack (or openai) module skips as a whole
# ("1..0 # SKIP").
top_srcdir=${top_srcdir:-$(cd "$(dirname "$0")/../.." && pwd)}
top_builddir=${top_builddir:-.}
echo "1..5"
out=$(DSV4_TOKENIZER_JSON=/nonexistent/tokenizer.json CMOCKA_MESSAGE_OUTPUT=TAP \
      sh "$top_srcdir/tests/tap-skip.sh" "$top_builddir/tests/unit/test_chat" 2>/dev/null); rc=$?
[ $rc = 0 ] && echo "ok 1 - test_chat without the V4 tokenizer exits 0" || echo "not ok 1 - test_chat exited $rc"
if echo "$out" | grep -q '^ok [0-9]* # SKIP'; then echo "ok 2 - its skipped cases are TAP skips (ok N, SKIP directive)"; else
    echo "not ok 2 - no 'ok N # SKIP' line"; echo "$out" | sed 's/^/# /'; fi
if echo "$out" | grep -q '^not ok'; then echo "not ok 3 - a 'not ok' line remains"; echo "$out" | sed 's/^/# /'; else
    echo "ok 3 - no 'not ok' line"; fi
# The harness as if msgpack were not installed (a None entry in sys.modules makes the import fail).
out=$(cd "$top_srcdir/tests/integration" && python3 -c 'import sys; sys.modules["msgpack"] = None; sys.path.insert(0, "."); import dsv4d_harness' 2>&1)
case $out in
"1..0 # SKIP python3 module msgpack not installed"*) echo "ok 4 - the integration harness skips without msgpack" ;;
*) echo "not ok 4 - the integration harness without msgpack"; echo "$out" | sed 's/^/# /' ;;
esac
# The OpenAI front's harness imports the integration harness first, which skips without msgpack:
# the openai case is then out of reach.
if ! python3 -c 'import msgpack' 2>/dev/null; then
    echo "ok 5 # SKIP python3 module msgpack not installed: the OpenAI front's harness skips for it first"
    exit 0
fi
out=$(cd "$top_srcdir/tests/integration" && python3 -c 'import sys; sys.modules["openai"] = None; sys.path.insert(0, "."); import openai_harness' 2>&1)
case $out in
"1..0 # SKIP python3 module openai not installed"*) echo "ok 5 - the OpenAI front's harness skips without openai" ;;
*) echo "not ok 5 - the OpenAI front's harness without openai"; echo "$out" | sed 's/^/# /' ;;
esac
