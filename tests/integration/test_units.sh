#!/bin/bash
# SPDX-License-Identifier: MIT
# The systemd units as CI checks them: `systemd-analyze verify` must be clean and
# `systemd-analyze security --offline=true` must rate dsv4d.service at most 2.0 ("OK" or better);
# the score is printed. TAP output. The service's ExecStart points at the dsv4d just built.
set -u
builddir=${top_builddir:-.}
srcdir=${top_srcdir:-$(dirname "$0")/../..}
n=0
fail=0
ok() { n=$((n + 1)); if [ "$1" = 0 ]; then echo "ok $n - $2"; else echo "not ok $n - $2"; fail=1; fi; }

if ! command -v systemd-analyze >/dev/null; then
    echo "1..0 # SKIP systemd-analyze not installed"
    exit 0
fi
tmp=$(mktemp -d /tmp/dsv4d-units.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
dsv4d=$(cd "$builddir" && pwd)/dsv4d
sed -e "s|@sbindir@/dsv4d|$dsv4d|" -e "s|@sysconfdir@|/etc|" "$srcdir/units/dsv4d.service.in" > "$tmp/dsv4d.service"
cp "$srcdir/units/dsv4d.socket" "$tmp/dsv4d.socket"

out=$(cd "$tmp" && systemd-analyze verify --man=no ./dsv4d.socket ./dsv4d.service 2>&1)
rc=$?
[ -z "$out" ] || echo "$out" | sed 's/^/# /'
ok $rc "systemd-analyze verify dsv4d.socket dsv4d.service"
[ -z "$out" ]; ok $? "  with no warnings"

out=$(cd "$tmp" && systemd-analyze security --offline=true ./dsv4d.service 2>&1)
rc=$?
score=$(echo "$out" | sed -n 's/.*Overall exposure level for dsv4d.service: \([0-9.]*\).*/\1/p')
echo "# exposure: ${score:-unknown}"
echo "$out" | grep '✗' | sed 's/  */ /g; s/^/# /'
ok $rc "systemd-analyze security --offline=true dsv4d.service"
[ -n "$score" ] && awk -v s="$score" 'BEGIN { exit !(s <= 2.0) }'; ok $? "exposure $score is at most 2.0"

for key in "Type=notify" "NotifyAccess=main" "WatchdogSec=" "Restart=on-failure" "DevicePolicy=closed" \
           "DeviceAllow=char-nvidia-frontend rw" "NoNewPrivileges=yes" "ProtectSystem=strict" "ProtectHome=yes" \
           "PrivateTmp=yes" "RestrictAddressFamilies=AF_UNIX" "RestartPreventExitStatus=2"; do
    grep -q "^$key" "$tmp/dsv4d.service"; ok $? "dsv4d.service sets $key"
done
for key in "ListenStream=/run/dsv4d/dsv4d.sock" "SocketMode=0660" "SocketGroup=dsv4"; do
    grep -q "^$key" "$tmp/dsv4d.socket"; ok $? "dsv4d.socket sets $key"
done
# dsv4-openai's units, when it was built.
if [ -x "$builddir/dsv4-openai" ]; then
    front=$(cd "$builddir" && pwd)/dsv4-openai
    sed -e "s|@bindir@/dsv4-openai|$front|" "$srcdir/units/dsv4-openai.service.in" > "$tmp/dsv4-openai.service"
    cp "$srcdir/units/dsv4-openai.socket" "$tmp/dsv4-openai.socket"
    out=$(cd "$tmp" && systemd-analyze verify --man=no ./dsv4-openai.socket ./dsv4-openai.service 2>&1)
    rc=$?
    [ -z "$out" ] || echo "$out" | sed 's/^/# /'
    [ $rc = 0 ] && [ -z "$out" ]; ok $? "systemd-analyze verify dsv4-openai.socket dsv4-openai.service, no warnings"
    out=$(cd "$tmp" && systemd-analyze security --offline=true ./dsv4-openai.service 2>&1)
    score=$(echo "$out" | sed -n 's/.*Overall exposure level for dsv4-openai.service: \([0-9.]*\).*/\1/p')
    echo "# dsv4-openai exposure: ${score:-unknown}"
    echo "$out" | grep '✗' | sed 's/  */ /g; s/^/# /'
    [ -n "$score" ] && awk -v s="$score" 'BEGIN { exit !(s <= 2.0) }'; ok $? "dsv4-openai exposure $score is at most 2.0"
    for key in "ListenStream=127.0.0.1:8000"; do
        grep -q "^$key" "$tmp/dsv4-openai.socket"; ok $? "dsv4-openai.socket sets $key"
    done
    for key in "Type=notify" "Wants=dsv4d.socket" "After=dsv4-openai.socket dsv4d.socket" "SupplementaryGroups=dsv4" \
               "RestrictAddressFamilies=AF_UNIX" "PrivateNetwork=yes" "IPAddressDeny=any"; do
        grep -q "^$key" "$tmp/dsv4-openai.service"; ok $? "dsv4-openai.service sets $key"
    done
fi
grep -q '^g dsv4 ' "$srcdir/units/sysusers.d/dsv4d.conf" && grep -q '^u dsv4d ' "$srcdir/units/sysusers.d/dsv4d.conf"
ok $? "sysusers.d creates the dsv4d user and the dsv4 group"
# ProtectSystem=strict leaves the service no writable path but those it declares: routing_stats
# (dsv4d(8)) needs one that outlives a restart, the state directory, which is the dsv4d user's home.
grep -q "^StateDirectory=dsv4d$" "$tmp/dsv4d.service"; ok $? "dsv4d.service sets StateDirectory=dsv4d"
home=$(sed -n 's/^u dsv4d - "[^"]*" \([^ ]*\).*/\1/p' "$srcdir/units/sysusers.d/dsv4d.conf")
[ "$home" = /var/lib/dsv4d ]; ok $? "  the dsv4d user's home, $home"
grep -q "^#.*routing_stats = /var/lib/dsv4d/" "$builddir/units/dsv4d.conf"; ok $? "  where dsv4d.conf says routing_stats goes"

# make install keeps an installed dsv4d.conf that differs from the shipped one (the operator's edits:
# the model above all) and puts the shipped one beside it; make uninstall leaves the edited one.
path=$("$builddir/dsv4d" --help | sed -n 's/.*(default \([^;]*\); "" for none).*/\1/p')
dest=$tmp/dest
conf=$dest$path
run_make() { env -u MAKEFLAGS -u MFLAGS make -s -C "$builddir" "$@" DESTDIR="$dest" >"$tmp/make.log" 2>&1; }
run_make install && cmp -s "$conf" "$builddir/units/dsv4d.conf"
ok $? "make install puts dsv4d.conf at $path"
echo "model = /srv/models/DeepSeek-V4-Flash" >>"$conf"
cp "$conf" "$tmp/edited.conf"
run_make install
cmp -s "$conf" "$tmp/edited.conf"; ok $? "  and keeps it, edited, when installing again"
cmp -s "$conf.new" "$builddir/units/dsv4d.conf"; ok $? "  with the shipped one beside it as dsv4d.conf.new"
run_make uninstall
cmp -s "$conf" "$tmp/edited.conf" && [ ! -e "$conf.new" ]; ok $? "make uninstall leaves the edited dsv4d.conf only"
# make clean removes the generated units/dsv4d.conf (CLEANFILES) that uninstall compares with: from such a
# tree (a copy of the build tree's makefile and configuration, without it) uninstall still removes an
# installed dsv4d.conf that is the shipped one, rather than keep it as edited.
rm -f "$conf"
run_make install
mkdir "$tmp/clean" && cp -p "$builddir/Makefile" "$builddir/config.status" "$builddir/libtool" "$tmp/clean/"
abs_srcdir=$(cd "$srcdir" && pwd)
env -u MAKEFLAGS -u MFLAGS make -s -C "$tmp/clean" uninstall DESTDIR="$dest" srcdir="$abs_srcdir" \
    top_srcdir="$abs_srcdir" VPATH="$abs_srcdir" >"$tmp/make.log" 2>&1
[ ! -e "$conf" ] && ! grep -q "keeping the edited" "$tmp/make.log"
ok $? "make uninstall after make clean removes the shipped dsv4d.conf"
echo "1..$n"
exit $fail
