#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The folders are the architecture (README's layout): dependencies point one way. TAP output.

1. Includes, read from the sources: base/ includes nothing of the project; protocol/ only itself and
   base/; client/ only itself, protocol/ and base/; engine/ nothing of the daemon, the protocol, the
   client or the kernels; kernels/ only the engine's seam (backend.h, error.h), the model structs
   (model/) and the sampler's limits; inside protocol/, the low-level codec (codes, frame, validate, wire)
   nothing of the messages above it; inside daemon/, conn.c nothing of dispatch.c or server.c, and
   dispatch.c nothing of server.c.
2. Calls, read from the built objects with nm: within protocol/, engine/, daemon/, client/ and openai/, no two
   files call each other, directly or around a circle (a file's object defines what others use).
"""
import collections
import os
import re
import subprocess
import sys

SRC = os.environ.get("top_srcdir", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BUILD = os.environ.get("top_builddir", ".")
CALL_GRAPH_DIRS = ("protocol", "engine", "daemon", "client", "openai")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
PROJECT = ("base/", "protocol/", "client/", "daemon/", "engine/", "kernels/", "openai/", "tools/", "tests/")

results = []


def ok(cond, name, diag=()):
    results.append((bool(cond), name, list(diag)))


def sources(folder):
    root = os.path.join(SRC, folder)
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith((".c", ".h", ".cu", ".cuh")):
                path = os.path.join(d, f)
                yield os.path.relpath(path, SRC), open(path, encoding="utf-8", errors="replace").read()


def project_includes(text):
    return [i for i in INCLUDE.findall(text) if i.startswith(PROJECT)]


def check_includes(name, files, allowed):
    """Every project include of files satisfies allowed(include)."""
    bad = [f"{path}: {inc}" for path, text in files for inc in project_includes(text) if not allowed(inc)]
    ok(not bad, name, bad)


check_includes("base/ includes nothing of the project", sources("base"), lambda i: i.startswith("base/"))
check_includes("protocol/ includes only protocol/ and base/", sources("protocol"),
               lambda i: i.startswith(("protocol/", "base/")))
check_includes("client/ includes only client/, protocol/ and base/", sources("client"),
               lambda i: i.startswith(("client/", "protocol/", "base/")))
check_includes("engine/ includes only engine/ and base/", sources("engine"),
               lambda i: i.startswith(("engine/", "base/")))
check_includes("kernels/ includes of the engine only backend.h, error.h, model/ and serve/sampler.h",
               sources("kernels"),
               lambda i: not i.startswith(PROJECT) or i.startswith(("kernels/", "base/", "engine/model/")) or
               i in ("engine/backend.h", "engine/error.h", "engine/serve/sampler.h"))
LOW = ("protocol/codes.", "protocol/frame.", "protocol/validate.", "protocol/wire.")
check_includes("protocol's low-level codec includes nothing of the messages",
               [(p, t) for p, t in sources("protocol") if p.startswith(LOW)],
               lambda i: i.startswith(LOW) or i.startswith("base/"))
check_includes("daemon/conn includes neither dispatch.h nor server.h",
               [(p, t) for p, t in sources("daemon") if p.startswith("daemon/conn.")],
               lambda i: i not in ("daemon/dispatch.h", "daemon/server.h"))
check_includes("daemon/dispatch does not include server.h",
               [(p, t) for p, t in sources("daemon") if p.startswith("daemon/dispatch.")],
               lambda i: i != "daemon/server.h")


def module(path):
    """daemon/.libs/dsv4d-conn.o -> daemon/conn (automake prefixes objects with their target)."""
    d, f = os.path.split(os.path.relpath(path, BUILD))
    d = d.replace("/.libs", "").replace(".libs", "")
    return os.path.join(d, f[:-2].rsplit("-", 1)[-1])


def call_graph():
    defs, uses = {}, collections.defaultdict(set)
    for folder in CALL_GRAPH_DIRS:
        for d, _, files in os.walk(os.path.join(BUILD, folder)):
            for f in files:
                if not f.endswith(".o"):
                    continue
                path = os.path.join(d, f)
                m = module(path)
                out = subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout
                for line in out.splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "U":
                        uses[m].add(parts[1])
                    elif len(parts) == 3 and parts[1] in "TDBR":
                        defs[parts[2]] = m
    edges = collections.defaultdict(set)
    for m, syms in uses.items():
        for sym in syms:
            if sym in defs and defs[sym] != m:
                edges[m].add(defs[sym])
    return set(defs.values()) | set(uses), edges


def circles(nodes, edges):
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


nodes, edges = call_graph()
if not nodes:
    ok(True, "calls between files: no objects built here # SKIP run from the build tree after make")
else:
    found = circles(nodes, edges)
    ok(not found, f"no circle of calls among the {len(nodes)} files of {', '.join(CALL_GRAPH_DIRS)}",
       [" <-> ".join(c) for c in found])
    # The check itself must see the layering it guards: dispatch.c calls conn.c, server.c calls both.
    ok("daemon/conn" in edges.get("daemon/dispatch", ()) and "daemon/dispatch" in edges.get("daemon/server", ()),
       "the call graph sees daemon/server -> dispatch -> conn")

print(f"1..{len(results)}")
for n, (good, name, diag) in enumerate(results, 1):
    print(f"{'ok' if good else 'not ok'} {n} - {name}")
    for line in diag:
        print(f"# {line}")
sys.exit(0)
