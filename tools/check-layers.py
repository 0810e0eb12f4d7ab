#!/usr/bin/env python3
"""The daemon's layers, checked from its #include lines and its object files' symbols.

  tools/check-layers.py SOURCE_ROOT [BUILD_ROOT]      (meson test: 'layers')

proxy/ holds a folder per layer, in this order, lowest first (ORDER below;
docs/architecture.md says what each holds):

  base < core < peer < datapath < host < daemon

A file may include, call or use what its own folder or a lower one holds, never what a
higher one does. Calls are read from the build: `nm` on the daemon's objects (those that
BUILD_ROOT/compile_commands.json lists under proxy/) says which symbols each .c defines and
which it needs, so each call (or use of a global) resolves to the one file that defines it.
Without BUILD_ROOT only includes are checked, and a module is a .c with its .h alone.

A module is a header and every .c that defines what the header declares (host/loop.h is one
module with its four .c files, datapath/rdma.h one with three), joined with the .h of each
.c's own name. It fails, naming the files of each break, if
  - a file includes a header of a higher folder;
  - a file calls (or uses) a symbol defined in a higher folder;
  - a header declares what a file of another folder defines (its module would span folders);
  - modules depend on each other in a circle, by includes or calls, within a folder or
    across folders: through a header shared by several .c files, whoever includes it
    depends on every one of them;
  - a folder of proxy/ has no place in ORDER, or a file lies in proxy/ itself;
  - a file includes a proxy header by a bare name ("rooms.h"): every one is named from
    proxy/ ("core/rooms.h"), so that this check and a reader see where it lives.
When it passes it prints the modules by depth (0: needs no other module).
"""
import json
import os
import re
import shutil
import subprocess
import sys

ORDER = ("base", "core", "peer", "datapath", "host", "daemon")

INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
WORD = re.compile(r"\b[A-Za-z_]\w*\b")


def sources(proxy):
    """Every .c and .h one folder down proxy/, as 'folder/name', sorted; and stray files."""
    files, stray = [], []
    for folder in sorted(os.listdir(proxy)):
        path = os.path.join(proxy, folder)
        if not os.path.isdir(path):
            if folder.endswith((".c", ".h")):
                stray.append(folder)
            continue
        for name in sorted(os.listdir(path)):
            if name.endswith((".c", ".h")):
                files.append(f"{folder}/{name}")
    return files, stray


def folder_of(rel):
    return rel.split("/", 1)[0]


def rank(folder):
    return ORDER.index(folder) if folder in ORDER else None


def includes(proxy, files):
    """{file: [(line, header)]} for the proxy headers each file includes; bare names apart."""
    headers = {f for f in files if f.endswith(".h")}
    out, bare = {}, []
    for rel in files:
        with open(os.path.join(proxy, rel), encoding="utf-8") as f:
            text = f.read()
        out[rel] = []
        for m in INCLUDE.finditer(text):
            inc, line = m.group(1), text.count("\n", 0, m.start()) + 1
            if inc in headers:
                out[rel].append((line, inc))
            elif any(h.endswith("/" + inc) for h in headers):
                bare.append(f"{rel}:{line}: #include \"{inc}\" (name it from proxy/)")
    return out, bare


def declared(text):
    """The names a header declares: the words left once comments, strings, preprocessor lines
    and everything between braces (struct members, inline bodies) are gone."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', " ", text)
    text = re.sub(r"^\s*#(.*\\\n)*.*$", " ", text, flags=re.M)
    top, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            top.append(ch)
    return set(WORD.findall("".join(top)))


def objects(root, build, files):
    """{file.c: its object file}: the daemon's objects this build makes, as its
    compile_commands.json lists them (the outputs under BUILD/proxy/)."""
    path = os.path.join(build, "compile_commands.json")
    if not os.path.isfile(path):
        sys.exit(f"check-layers: no {path}: BUILD_ROOT is a meson build directory")
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    proxy = os.path.realpath(os.path.join(root, "proxy"))
    known, found = set(files), {}
    for e in entries:
        src = os.path.realpath(os.path.join(e["directory"], e["file"]))
        out = os.path.join(e["directory"], e["output"])
        rel = os.path.relpath(src, proxy)
        if rel in known and os.path.relpath(out, build).startswith("proxy" + os.sep):
            found.setdefault(rel, out)
    return found


def symbols(objs):
    """({symbol: file.c defining it}, {file.c: symbols it needs}, {symbol: 'call' or 'use'})."""
    defs, needs, kind = {}, {}, {}
    if not objs:
        return defs, needs, kind
    nm = shutil.which("nm")
    if not nm:
        sys.exit("check-layers: no nm (binutils) to read the object files with")
    paths = {v: k for k, v in objs.items()}
    missing = sorted(p for p in paths if not os.path.isfile(p))
    if missing:
        sys.exit(f"check-layers: {missing[0]} is not built yet: ninja -C BUILD_ROOT first")
    out = subprocess.run([nm, "-P", "-A", *sorted(paths)], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        # "PATH: SYMBOL TYPE [VALUE SIZE]"
        path, _, rest = line.partition(": ")
        f = paths.get(path)
        fields = rest.split()
        if f is None or len(fields) < 2:
            continue
        sym, t = fields[0], fields[1]
        if t == "U":
            needs.setdefault(f, set()).add(sym)
        elif t in "TDBRCGSVW":
            defs.setdefault(sym, f)
            kind[sym] = "calls" if t in "TW" else "uses"
    return defs, needs, kind


class Modules:
    """Union-find over files: a header with the .c files that define what it declares."""

    def __init__(self, files):
        self.up = {f: f for f in files}

    def find(self, f):
        while self.up[f] != f:
            self.up[f] = self.up[self.up[f]]
            f = self.up[f]
        return f

    def join(self, a, b):
        a, b = self.find(a), self.find(b)
        if a != b:
            self.up[max(a, b)] = min(a, b)

    def groups(self):
        out = {}
        for f in self.up:
            out.setdefault(self.find(f), []).append(f)
        return {min(m, key=lambda f: (not f.endswith(".h"), f)): sorted(
            m, key=lambda f: (not f.endswith(".h"), f)) for m in out.values()}


def name_of(members):
    """core/rooms.h+rooms.c+xfer.c"""
    first = members[0]
    return first + "".join("+" + (m.split("/", 1)[1] if folder_of(m) == folder_of(first) else m)
                           for m in members[1:])


def circles(graph):
    """Elementary circles found by a depth-first walk, as lists of nodes."""
    found, state, stack = [], {}, []

    def walk(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif not state.get(d):
                walk(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            walk(m)
    return found


def layers(graph):
    """Modules by depth: 0 needs no other module, n needs modules up to depth n-1."""
    depth = {}

    def d(m, seen=()):
        if m not in depth:
            if m in seen:
                return 0
            depth[m] = 1 + max((d(x, seen + (m,)) for x in graph.get(m, ())), default=-1)
        return depth[m]

    for m in graph:
        d(m)
    out = {}
    for m, k in depth.items():
        out.setdefault(k, []).append(m)
    return out


def check(root, build):
    proxy = os.path.join(root, "proxy")
    files, stray = sources(proxy)
    problems = [f"proxy/{s}: a file outside every layer's folder" for s in stray]
    order = " < ".join(ORDER)
    for folder in sorted({folder_of(f) for f in files}):
        if rank(folder) is None:
            problems.append(f"proxy/{folder}/ has no place in the folders' order ({order}): "
                            "add it to ORDER in tools/check-layers.py")
    inc, bare = includes(proxy, files)
    problems += bare

    # Folder order, includes.
    for rel in files:
        for line, h in inc[rel]:
            a, b = rank(folder_of(rel)), rank(folder_of(h))
            if a is not None and b is not None and b > a:
                problems.append(f"{rel}:{line} includes {h}: {folder_of(rel)}/ is below "
                                f"{folder_of(h)}/ ({order})")

    # Folder order, calls.
    objs = objects(root, build, files) if build else {}
    defs, needs, kind = symbols(objs)
    for rel in sorted(needs):
        for sym in sorted(needs[rel]):
            d = defs.get(sym)
            if d is None:
                continue
            a, b = rank(folder_of(rel)), rank(folder_of(d))
            if a is not None and b is not None and b > a:
                problems.append(f"{rel} {kind[sym]} {sym}, defined in {d}: {folder_of(rel)}/ is "
                                f"below {folder_of(d)}/ ({order})")

    # Modules: a header with the .c files behind it, and each .c with its .h of one name.
    mods = Modules(files)
    by_file = {}
    for sym, f in defs.items():
        by_file.setdefault(f, set()).add(sym)
    for rel in files:
        if rel.endswith(".c") and rel[:-2] + ".h" in mods.up:
            mods.join(rel, rel[:-2] + ".h")
    for h in (f for f in files if f.endswith(".h")):
        with open(os.path.join(proxy, h), encoding="utf-8") as fh:
            names = declared(fh.read())
        for c, syms in sorted(by_file.items()):
            hit = sorted(syms & names)
            if not hit:
                continue
            if folder_of(c) != folder_of(h):
                problems.append(f"{h} declares {hit[0]}, defined in {c}: what a header "
                                "declares is defined in its own folder")
            else:
                mods.join(h, c)
    groups = mods.groups()
    mod_of = {f: m for m, ms in groups.items() for f in ms}
    graph, why = {m: set() for m in groups}, {}
    for rel in files:
        for line, h in inc[rel]:
            a, b = mod_of[rel], mod_of[h]
            if a != b:
                graph[a].add(b)
                why.setdefault((a, b), f"{rel}:{line} includes {h}")
        for sym in sorted(needs.get(rel, ())):
            d = defs.get(sym)
            if d is not None and mod_of[d] != mod_of[rel]:
                a, b = mod_of[rel], mod_of[d]
                graph[a].add(b)
                why.setdefault((a, b), f"{rel} {kind[sym]} {sym} ({d})")
    names = {m: name_of(ms) for m, ms in groups.items()}
    for c in circles(graph):
        steps = "; ".join(why[(a, b)] for a, b in zip(c, c[1:]))
        problems.append("a circle of modules: " + " -> ".join(names[m] for m in c) +
                        f" ({steps})")
    return problems, graph, names, objs, files


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    root = sys.argv[1]
    build = sys.argv[2] if len(sys.argv) > 2 else None
    problems, graph, names, objs, files = check(root, build)
    if problems:
        for p in problems:
            print("check-layers: " + p)
        return 1
    for k, mods in sorted(layers(graph).items()):
        print(f"depth {k}: " + " ".join(sorted(names[m] for m in mods)))
    unbuilt = [f for f in files if f.endswith(".c") and f not in objs]
    calls = f"calls of {len(objs)} object files" if objs else "no calls (no BUILD_ROOT)"
    print(f"check-layers: {len(graph)} modules in {' < '.join(ORDER)}, no include or call up a "
          f"folder, no circle; {calls}" + (f"; not built here: {' '.join(unbuilt)}" if build and
                                           unbuilt else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
