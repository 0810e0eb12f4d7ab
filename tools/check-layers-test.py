#!/usr/bin/env python3
"""check-layers.py against faults planted in a copy of the tree (meson test: 'layers-planted').

  tools/check-layers-test.py SOURCE_ROOT BUILD_ROOT CC

Copies proxy/ and gives check-layers.py a build directory of its own: a compile_commands.json
naming BUILD_ROOT's objects of the daemon (and any object planted). The copy as it is must
pass; each fault, planted alone in a fresh copy, must fail it with a line naming its files:
  (a) an upward include: core/slots.c includes host/loop.h;
  (b) an upward call: a new core/planted.c calls kvsp_run, which host/poller.c defines;
  (c) a circle through a shared header: peer/zerocopy.c includes peer/session.h, while
      peer/session.c includes peer/conn.h, the header behind which zerocopy.c is one of two
      .c files. zerocopy.c has no header of its own name: a check that takes a module to be
      a .c and its .h alone sees no circle there.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "check-layers.py")

PLANTED_CALL = """/* Planted by tools/check-layers-test.py: the core calling up into host/. */
struct kvsp;
int kvsp_run(struct kvsp *p);
int kvsp_planted(struct kvsp *p);
int kvsp_planted(struct kvsp *p)
{
    return kvsp_run(p);
}
"""


def daemon_objects(root, build):
    """[(source relative to proxy/, object path)] of the daemon in BUILD_ROOT."""
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        entries = json.load(f)
    proxy = os.path.realpath(os.path.join(root, "proxy"))
    out, seen = [], set()
    for e in entries:
        src = os.path.realpath(os.path.join(e["directory"], e["file"]))
        obj = os.path.realpath(os.path.join(e["directory"], e["output"]))
        rel = os.path.relpath(src, proxy)
        if (rel.startswith("..") or not os.path.relpath(obj, os.path.realpath(build))
                .startswith("proxy" + os.sep) or rel in seen):
            continue
        seen.add(rel)
        out.append((rel, obj))
    return out


class Tree:
    """A copy of proxy/ under tmp/src and a build directory for it under tmp/build."""

    def __init__(self, tmp, root, objs):
        self.src, self.build = os.path.join(tmp, "src"), os.path.join(tmp, "build")
        shutil.copytree(os.path.join(root, "proxy"), os.path.join(self.src, "proxy"))
        os.makedirs(os.path.join(self.build, "proxy"))
        self.entries = []
        for rel, obj in objs:
            self.add_object(rel, obj)

    def add_object(self, rel, obj):
        link = os.path.join("proxy", rel.replace("/", "_") + ".o")
        os.symlink(obj, os.path.join(self.build, link))
        self.entries.append({"directory": self.build, "output": link,
                             "file": os.path.join(self.src, "proxy", rel)})

    def write(self, rel, text, append=False):
        with open(os.path.join(self.src, "proxy", rel), "a" if append else "w",
                  encoding="utf-8") as f:
            f.write(text)

    def check(self):
        with open(os.path.join(self.build, "compile_commands.json"), "w", encoding="utf-8") as f:
            json.dump(self.entries, f)
        r = subprocess.run([sys.executable, CHECK, self.src, self.build], capture_output=True,
                           text=True)
        return r.returncode, r.stdout + r.stderr


def plant_include(t, cc):
    t.write("core/slots.c", '\n#include "host/loop.h"\n', append=True)
    return [r"^check-layers: core/slots\.c:\d+ includes host/loop\.h: core/ is below host/"]


def plant_call(t, cc):
    t.write("core/planted.c", PLANTED_CALL)
    obj = os.path.join(t.build, "planted.o")
    subprocess.run([cc, "-c", "-o", obj, os.path.join(t.src, "proxy", "core", "planted.c")],
                   check=True)
    t.add_object("core/planted.c", obj)
    return [r"^check-layers: core/planted\.c calls kvsp_run, defined in host/poller\.c: core/ is "
            r"below host/"]


def plant_circle(t, cc):
    t.write("peer/zerocopy.c", '\n#include "peer/session.h"\n', append=True)
    return [r"^check-layers: a circle of modules: .*peer/conn\.h\+conn\.c\+zerocopy\.c.*"
            r"peer/zerocopy\.c:\d+ includes peer/session\.h.*"
            r"peer/session\.c(:\d+ includes peer/conn\.h| calls \w+ \(peer/(conn|zerocopy)\.c\))"]


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__.split("\n\n")[1])
    root, build, cc = sys.argv[1:]
    objs = daemon_objects(root, build)
    if not any(rel == "peer/zerocopy.c" for rel, _ in objs):
        sys.exit(f"check-layers-test: no object of peer/zerocopy.c in {build}")
    failed = 0
    for name, plant in (("the tree as it is", None), ("(a) an upward include", plant_include),
                        ("(b) an upward call", plant_call),
                        ("(c) a circle through a shared header", plant_circle)):
        with tempfile.TemporaryDirectory(prefix="check-layers-") as tmp:
            t = Tree(tmp, root, objs)
            want = plant(t, cc) if plant else []
            rc, out = t.check()
        lines = out.splitlines()
        if not plant:
            ok = rc == 0
            why = "passes" if ok else "fails:\n" + out
        else:
            missing = [w for w in want if not any(re.search(w, line) for line in lines)]
            ok = rc == 1 and not missing
            why = ("fails, saying:\n  " + "\n  ".join(
                line for line in lines if any(re.search(w, line) for w in want))
                   if ok else f"exit {rc}, no line like {missing}:\n{out}")
        print(f"{'ok' if ok else 'WRONG'}: {name}: check-layers {why}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
