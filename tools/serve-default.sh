#!/bin/bash
# SPDX-License-Identifier: MIT
# The main job on a fresh Debian machine: install the build dependencies, build, start dsv4d
# socket-activated (systemd-socket-activate plays systemd's part) on the embedded default model,
# wait for READY, and print the answers to two questions. Usage: bash tools/serve-default.sh [QUESTION]
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive

if ! dpkg -s libjansson-dev libonig-dev libmsgpack-dev libjemalloc-dev libsystemd-dev libcmocka-dev \
        autoconf automake libtool pkg-config systemd >/dev/null 2>&1; then
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends build-essential autoconf automake libtool \
        pkg-config libjansson-dev libonig-dev libmsgpack-dev libjemalloc-dev libsystemd-dev \
        libcmocka-dev systemd >/dev/null
fi
[ -x build/dsv4d ] || {
    autoreconf -fi >/dev/null 2>&1
    mkdir -p build && (cd build && ../configure -q && make -j"$(nproc)" >/dev/null)
}

# The socket lives in a private directory removed at exit; the log stays in the build tree.
rundir=$(mktemp -d /tmp/dsv4d-serve.XXXXXX)
sock=$rundir/dsv4d.sock
log=build/serve-default.log
export DSV4_SOCKET=$sock
# systemd-socket-activate binds the socket and hands it to dsv4d as LISTEN_FDS, as dsv4d.socket does.
systemd-socket-activate -l "$sock" build/dsv4d --config "" --model models/default --backend auto \
    --max-batch 4 --max-context 1024 2>"$log" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true; rm -rf "$rundir"' EXIT
for _ in $(seq 1 600); do
    build/dsv4ctl health >/dev/null 2>&1 && break
    kill -0 $daemon 2>/dev/null || { echo "dsv4d exited during boot:" >&2; tail -20 "$log" >&2; exit 1; }
    sleep 0.1
done
build/dsv4ctl health
echo "(daemon log: $log)"

ask() { printf '%s\n  -> ' "$1"; build/dsv4ctl generate --chat --temperature 0 --max-tokens 32 "$1"; }
if [ $# -gt 0 ]; then
    ask "$*"
else
    ask "What is 17*23? Reply with the number only."
    ask "Name the capital of France in one word."
fi
