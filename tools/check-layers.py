#!/usr/bin/env python3
"""The daemon's architecture, checked from its #include lines (proxy/, a folder per part).

  tools/check-layers.py [SOURCE_ROOT]      (meson test: 'layers')

A module is a .c and its .h of one name (core/rooms.c + core/rooms.h). It fails, naming
each break, if
  - a file of proxy/core includes anything of proxy/peer or proxy/datapath (the core knows
    transports only through core/xport.h);
  - the modules include each other in a circle, within a folder or across folders;
  - a file includes a proxy header by a bare name ("rooms.h"): every one is named from
    proxy/ ("core/rooms.h"), so that this check and a reader see where it lives.
Prints the module graph's layers when it passes.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def modules(proxy):
    """{module: set of modules it includes}, e.g. {'peer/session': {'peer/conn', ...}}."""
    headers = set()
    files = []
    for folder in sorted(os.listdir(proxy)):
        path = os.path.join(proxy, folder)
        if not os.path.isdir(path):
            continue
        for name in sorted(os.listdir(path)):
            if name.endswith((".c", ".h")):
                files.append(f"{folder}/{name}")
                if name.endswith(".h"):
                    headers.add(f"{folder}/{name}")
    graph, bare = {}, []
    for rel in files:
        mod = rel.rsplit(".", 1)[0]
        deps = graph.setdefault(mod, set())
        with open(os.path.join(proxy, rel), encoding="utf-8") as f:
            text = f.read()
        for inc in INCLUDE.findall(text):
            if inc in headers:
                dep = inc.rsplit(".", 1)[0]
                if dep != mod:
                    deps.add(dep)
            elif any(h.endswith("/" + inc) for h in headers):
                bare.append(f"{rel}: #include \"{inc}\" (name it from proxy/)")
    return graph, bare


def circles(graph):
    """Every elementary circle found by a depth-first walk, as lists of modules."""
    found, state, stack = [], {}, []

    def walk(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d in graph and not state.get(d):
                walk(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            walk(m)
    return found


def layers(graph):
    """Modules by depth: 0 includes nothing of proxy/, n includes up to depth n-1."""
    depth = {}

    def d(m, seen=()):
        if m not in depth:
            depth[m] = 0 if m in seen else 1 + max((d(x, seen + (m,)) for x in graph.get(m, ())),
                                                    default=-1)
        return depth[m]

    for m in graph:
        d(m)
    out = {}
    for m, k in depth.items():
        out.setdefault(k, []).append(m)
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    proxy = os.path.join(root, "proxy")
    graph, problems = modules(proxy)
    for mod, deps in sorted(graph.items()):
        if mod.startswith("core/"):
            for d in sorted(deps):
                if d.startswith(("peer/", "datapath/")):
                    problems.append(f"{mod} includes {d}: the core may not know a transport's parts")
    for c in circles(graph):
        problems.append("a circle of includes: " + " -> ".join(c))
    if problems:
        for p in problems:
            print("check-layers: " + p)
        return 1
    for k, mods in sorted(layers(graph).items()):
        print(f"layer {k}: " + " ".join(sorted(mods)))
    print(f"check-layers: {len(graph)} modules, no circle, the core includes nothing of peer/ or "
          "datapath/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
