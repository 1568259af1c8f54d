#!/bin/sh
# SPDX-License-Identifier: MIT
# The documentation says what the binary does: the config path dsv4d(8) names is the one dsv4d reads
# (the configured sysconfdir), `--config ""` renders with its quotes, allow_groups is described the
# same way in the man page and the installed config file, gpus in those and --help, and a --listen
# directory that does not exist or a routing_stats file that cannot be created is exit status 2, as
# dsv4d(8) says; every option each program's --help lists is in its man page. TAP output.
top_srcdir=${top_srcdir:-$(cd "$(dirname "$0")/../.." && pwd)}
top_builddir=${top_builddir:-.}
n=0; fail=0
ok() { n=$((n + 1)); if [ "$1" = 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fail=1; fi; }
man8=$top_builddir/doc/dsv4d.8
conf=$top_builddir/units/dsv4d.conf

path=$("$top_builddir/dsv4d" --help | sed -n 's/.*(default \([^;]*\); "" for none).*/\1/p')
[ -n "$path" ]; ok $? "dsv4d --help names its config file ($path)"
grep -q "^\.I $path\$" "$man8"; ok $? "dsv4d(8) names the same file"
head -1 "$conf" | grep -q "^# $path:"; ok $? "so does the installed dsv4d.conf"
others=$(grep -o "[^ ]*/dsv4d/dsv4d\.conf" "$man8" | grep -v -x -F "$path")
[ -z "$others" ]; ok $? "dsv4d(8) names no other config path ($others)"
if command -v nroff >/dev/null 2>&1; then
    nroff -man "$man8" 2>/dev/null | sed 's/.\x08//g' | tr -s ' \n' '  ' | grep -q -- '--config "" reads no file'
    ok $? 'dsv4d(8) renders --config "" with its quotes'
else
    echo "ok $((n = n + 1)) # SKIP nroff not installed"
fi
grep -q "^#allow_groups .*supplementary" "$conf"; ok $? "dsv4d.conf: allow_groups takes supplementary groups too"
tr "\n" " " <"$man8" | grep -q -E "allow.-groups.{1,200}primary or supplementary group is listed"; ok $? "dsv4d(8) says the same"
"$top_builddir/dsv4d" --help | grep -q -E -- "--gpus .*two or more split the routed experts across them"
ok $? "dsv4d --help: two or more gpus split the routed experts"
tr "\n" " " <"$man8" | grep -q "With two or more listed, each layer's routed experts are split across them"
ok $? "dsv4d(8) says the same"
grep -q "^#gpus .*two or more split the experts" "$conf"; ok $? "so does dsv4d.conf"
# Every option a program's --help lists is in its man page (dsv4-openai's when it was built).
options_in_man() {
    [ -x "$top_builddir/$1" ] || return 0
    missing=
    for o in $("$top_builddir/$1" --help | grep -o -E -- '(^|[ ,])--[a-z0-9][a-z0-9-]*' | sed 's/^[ ,]*//' | sort -u); do
        sed 's/\\-/-/g' "$2" | grep -q -E -- "$o([^a-z0-9-]|\$)" || missing="$missing $o"
    done
    [ -z "$missing" ]; ok $? "$(basename "$2") has every option $1 --help lists (missing:${missing:- none})"
}
options_in_man dsv4d "$man8"
options_in_man dsv4ctl "$top_builddir/doc/dsv4ctl.1"
options_in_man dsv4-run "$top_builddir/doc/dsv4-run.1"
options_in_man dsv4-openai "$top_builddir/doc/dsv4-openai.8"

tmp=$(mktemp -d /tmp/dsv4d-docs.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$top_builddir/dsv4d" --config "" --model "$top_srcdir/models/default" --listen "$tmp/missing/dsv4d.sock" \
    >"$tmp/log" 2>&1
rc=$?
[ $rc = 2 ]; ok $? "a --listen directory that does not exist: exit status 2 (got $rc)"
grep -q "directory does not exist" "$tmp/log"; ok $? "  and the log says so"
tr '\n' ' ' <"$man8" | grep -q "tokenizer or .B \\\\-\\\\-listen directory that does not exist"
ok $? "dsv4d(8) lists it under exit status 2"
# routing_stats where its file cannot be created is a setting to fix as well (systemd would restart an exit
# status 1 every RestartSec= for ever): a "directory" that is a file, one that does not exist, and one not
# writable (not as root).
: >"$tmp/file"
"$top_builddir/dsv4d" --config "" --model "$top_srcdir/models/default" --listen "$tmp/dsv4d.sock" \
    --routing-stats "$tmp/file/routing.json" >"$tmp/log" 2>&1
rc=$?
[ $rc = 2 ]; ok $? "routing_stats in a directory that is a file: exit status 2 (got $rc)"
grep -q "routing_stats: .*Not a directory" "$tmp/log"; ok $? "  and the log says why"
"$top_builddir/dsv4d" --config "" --model "$top_srcdir/models/default" --listen "$tmp/dsv4d.sock" \
    --routing-stats "$tmp/none/routing.json" >"$tmp/log" 2>&1
rc=$?
[ $rc = 2 ]; ok $? "routing_stats in a directory that does not exist: exit status 2 (got $rc)"
# a directory (the state directory named rather than a file in it): the file cannot be renamed over it at
# stop, so that is found at boot too (a timeout, since a dsv4d that takes it serves until stopped)
mkdir "$tmp/dir"
timeout 120 "$top_builddir/dsv4d" --config "" --model "$top_srcdir/models/default" --listen "$tmp/dsv4d.sock" \
    --routing-stats "$tmp/dir" >"$tmp/log" 2>&1
rc=$?
[ $rc = 2 ]; ok $? "routing_stats naming a directory: exit status 2 (got $rc)"
grep -q "routing_stats: .*a directory, not a file" "$tmp/log"; ok $? "  and the log says why"
# an expert_placement file that is missing or not routing statistics of the model's shape: a setting to fix,
# refused before the weights load (systemd would reload them every RestartSec= for ever)
for f in missing.json bad.json; do
    [ $f = bad.json ] && echo '{"format": "nonsense"}' >"$tmp/$f"
    "$top_builddir/dsv4d" --config "" --model "$top_srcdir/models/default" --listen "$tmp/dsv4d.sock" \
        --expert-placement "$tmp/$f" >"$tmp/log" 2>&1
    rc=$?
    [ $rc = 2 ]; ok $? "expert_placement $f: exit status 2 (got $rc)"
    grep -q "expert_placement: routing statistics $tmp/$f" "$tmp/log" && ! grep -q "loading weights\|weights loaded" "$tmp/log"
    ok $? "  the log says why, before any weight is loaded"
done
if [ "$(id -u)" != 0 ]; then
    mkdir "$tmp/ro" && chmod 0555 "$tmp/ro"
    "$top_builddir/dsv4d" --config "" --model "$top_srcdir/models/default" --listen "$tmp/dsv4d.sock" \
        --routing-stats "$tmp/ro/routing.json" >"$tmp/log" 2>&1
    rc=$?
    [ $rc = 2 ]; ok $? "routing_stats in a directory not writable: exit status 2 (got $rc)"
else
    echo "ok $((n = n + 1)) # SKIP routing_stats in a directory not writable: root writes anywhere"
fi
echo "1..$n"
exit $fail
