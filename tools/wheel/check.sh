#!/bin/bash
# Checks a kvstage wheel the way a clean system uses it: installs it into a fresh venv and runs it from
# there, with nothing of a build tree on any path.
# Usage: tools/wheel/check.sh WHEEL [PYTHON]
# PYTHON (default /usr/bin/python3, else python3 on PATH) makes the venv, with --system-site-packages
# so that the system's numpy (Debian: python3-numpy) satisfies the wheel's one dependency and its
# pytest (python3-pytest) runs the tests; pip installs the wheel with --no-index. Then: kvstage is
# imported from the venv and loads its own libkvstage (kvstage/_libs); ldd finds every library of
# every ELF file in the package, each one not glibc's from kvstage/_libs; the SGLang plugin entry
# point is there, as python/dist-info/entry_points.txt names it; each console script runs (--help);
# kvstaged's "built without" names exactly the optional parts whose library it does not link; the
# venv's kvstaged (the script that execs kvstage/_bin/kvstaged) keeps its pid and --ready-fd, serves
# kvstage-demo and kvstage-stat, and drains on SIGTERM; kvstage-bench finds the package's kvstaged;
# and the Python suite's tests that need only the client and a kvstaged (no torch, no SGLang or vLLM)
# pass against it (CHECK_TESTS below), with KVSTAGED=<venv>/bin/kvstaged and no PYTHONPATH. Writes
# only under a temporary directory (the repository may be read-only). Needs bash, coreutils and ldd
# besides PYTHON with venv and pip.
# Exit 0: every check passed; 1: some failed (each says why); 2: usage.
set -uo pipefail
case ${1:-} in
-h | --help) sed -n '2,18s/^# \{0,1\}//p' "$0"; exit 0 ;;
'' | -*) echo "usage: tools/wheel/check.sh WHEEL [PYTHON]" >&2; exit 2 ;;
esac
[ $# -le 2 ] && [ -f "$1" ] || { echo "usage: tools/wheel/check.sh WHEEL [PYTHON] (no file $1)" >&2; exit 2; }
whl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
py=${2:-}
[ -n "$py" ] || { [ -x /usr/bin/python3 ] && py=/usr/bin/python3 || py=python3; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# The client tests that need only libkvstage, libkvstage_cuda (absent or without a device: its error
# paths) and a kvstaged: no torch, no SGLang or vLLM, no child that imports the source tree's package.
CHECK_TESTS=(test_client.py test_events.py test_rooms.py test_procs.py test_views.py test_plan.py
	test_metrics.py test_cuda.py test_structs.py)

# Nothing of a build tree or of the caller's overrides.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP KVSTAGE_LIB KVSTAGE_CUDA_LIB KVSTAGED LD_LIBRARY_PATH LD_PRELOAD
export PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvstage-wheelcheck.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1 # the current directory is on sys.path: an empty one
export HOME=$tmp/home # pip and anything else writes here, not into the caller's home
mkdir -p "$HOME"
passed=0
failed=()
ok() { echo "ok: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*" >&2; failed+=("$1"); }
closing() {
	if [ ${#failed[@]} -eq 0 ]; then
		echo "check.sh: PASS: ${passed} checks passed, 0 failed: $(basename "$whl")"
		exit 0
	fi
	echo "check.sh: FAIL: ${#failed[@]} checks failed (${failed[*]}), ${passed} passed: $(basename "$whl")"
	exit 1
}

venv=$tmp/venv
if out=$("$py" -m venv --system-site-packages "$venv" 2>&1); then
	ok "venv: $("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])') at $venv"
else
	fail venv "$py -m venv --system-site-packages: $out (Debian: apt-get install python3-venv)"
	closing
fi
if out=$("$venv/bin/python" -m pip install --no-index --no-cache-dir -q "$whl" 2>&1); then
	ok "pip install --no-index $(basename "$whl")"
else
	fail pip-install "pip install --no-index $whl: $out"
	closing
fi

# The installed package, from inside the venv's interpreter: where it is, what its ELF files load.
"$venv/bin/python" - "$venv" "$root" >"$tmp/package.log" 2>&1 <<'EOF'
import configparser
import importlib.metadata
import os
import re
import subprocess
import sys

SYSTEM = {"libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0", "libutil.so.1",
          "libresolv.so.2", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgcc_s.so.1", "linux-vdso.so.1"}
venv = os.path.realpath(sys.argv[1])
failed = 0


def report(good, what):
    global failed
    print(f"ok: {what}" if good else f"FAIL: {what}", file=sys.stdout if good else sys.stderr)
    failed += not good


import kvstage  # noqa: E402
pkg = os.path.dirname(os.path.realpath(kvstage.__file__))
report(pkg.startswith(venv + "/"), f"import kvstage: {kvstage.__file__} (venv {venv})")
report(os.path.realpath(kvstage.LIB_PATH) == os.path.join(pkg, "_libs", "libkvstage.so.0"),
       f"libkvstage loaded from {kvstage.LIB_PATH}, version {kvstage.__version__}")
if os.path.exists(os.path.join(pkg, "_libs", "libkvstage_cuda.so.0")):
    from kvstage import _lib
    try:
        _lib.cuda()
        report(True, "libkvstage_cuda.so.0 (kvstage/_libs) loads")
    except OSError as e:
        report(False, f"libkvstage_cuda.so.0 is in kvstage/_libs but does not load: {e}")
else:
    print("note: this wheel has no libkvstage_cuda (built without the CUDA toolkit)")

# Every ELF file's closure, as the loader finds it with no LD_LIBRARY_PATH: nothing missing, and every
# library that is not the host's glibc or libgcc_s comes from the package.
elves = []
for d, _, files in os.walk(pkg):
    for f in sorted(files):
        with open(os.path.join(d, f), "rb") as fh:
            if fh.read(4) == b"\x7fELF":
                elves.append(os.path.join(d, f))
bad = []
for elf in elves:
    r = subprocess.run(["ldd", elf], capture_output=True, text=True)
    rel = os.path.relpath(elf, pkg)
    if r.returncode != 0:
        bad.append(f"{rel}: ldd: {r.stderr.strip()}")
        continue
    for line in r.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (.*?)(?: \(0x[0-9a-f]+\))?$", line)
        if not m:
            continue
        name, where = m.groups()
        if where == "not found":
            bad.append(f"{rel}: {name} not found")
        elif name not in SYSTEM and not os.path.realpath(where).startswith(os.path.join(pkg, "_libs") + "/"):
            bad.append(f"{rel}: {name} from {where}, not from kvstage/_libs")
report(not bad and elves, f"ldd: {len(elves)} ELF files, every library found, all but glibc's from kvstage/_libs"
       + "".join(f"\n  {b}" for b in bad))

eps = importlib.metadata.entry_points()
group = eps.select(group="sglang.srt.plugins") if hasattr(eps, "select") else eps.get("sglang.srt.plugins", [])
mine = [ep for ep in group if ep.name == "kvstage"]
try:
    target = mine[0].load() if mine else None
except Exception as e:  # the check reports what went wrong, whatever it was
    target = e
report(callable(target), f"entry point sglang.srt.plugins: kvstage = {mine[0].value if mine else None} ({target!r})")
# The same group as a system install's (python/dist-info/entry_points.txt; pyproject.toml names it again).
system = configparser.ConfigParser()
system.read(os.path.join(sys.argv[2], "python", "dist-info", "entry_points.txt"))
want = dict(system["sglang.srt.plugins"]) if system.has_section("sglang.srt.plugins") else None
got = {ep.name: ep.value for ep in group}
report(got == want, f"sglang.srt.plugins: {got}, as python/dist-info/entry_points.txt says: {want}")
sys.exit(1 if failed else 0)
EOF
rc=$?
cat "$tmp/package.log"
passed=$((passed + $(grep -c '^ok: ' "$tmp/package.log")))
[ $rc -eq 0 ] || failed+=(package)

# Each console script runs.
bin=$venv/bin
for s in kvstaged kvstage-stat kvstage-ctl kvstage-bench kvstage-demo kvstage-trace; do
	if out=$("$bin/$s" --help 2>&1); then
		ok "$s --help"
	else
		fail "$s" "$bin/$s --help: exit $?: $out"
	fi
done

# kvstaged --help's "built without" against what kvstaged links: each optional part is missing from
# the list exactly when its library is.
pkgbin=$("$venv/bin/python" -c 'import kvstage, os; print(os.path.join(os.path.dirname(kvstage.__file__), "_bin"))')
without=$("$bin/kvstaged" --help 2>&1 | sed -n 's/^built without: //p')
links=$(ldd "$pkgbin/kvstaged" 2>&1)
wrong=
for pair in verbs:libibverbs metrics:libmicrohttpd systemd:libsystemd acl:libacl; do
	part=${pair%%:*} lib=${pair#*:}
	said=no
	case ", $without," in *", $part,"*) said=yes ;; esac
	linked=no
	grep -q "^[[:space:]]*$lib\.so" <<<"$links" && linked=yes
	[ $said = $linked ] && wrong="$wrong $part (says built without: $said; links $lib: $linked)"
done
if [ -z "$wrong" ]; then
	ok "kvstaged --help: built without: ${without:-nothing}; the same as what it links"
else
	fail built-without "kvstaged --help's \"built without: $without\" is wrong about:$wrong"
fi

# The venv's kvstaged through the Python console script: its pid and ready fd are kvstaged's own (the
# script execs it), kvstage-demo and kvstage-stat talk to it, SIGTERM drains it.
if out=$("$venv/bin/python" - "$bin" "$pkgbin" "$tmp" 2>&1 <<'EOF'
import os
import subprocess
import sys

from kvstage.daemon import spawn, stop

bin_, pkgbin, tmp = sys.argv[1:]
sock = os.path.join(tmp, "kvs.sock")
with open(os.path.join(tmp, "kvstaged.log"), "wb") as log:
    proc = spawn(os.path.join(bin_, "kvstaged"), ["--socket", sock, "--slots", "16", "--slot-size", "64K"], log)
try:
    exe = os.readlink(f"/proc/{proc.pid}/exe")
    assert exe == os.path.realpath(os.path.join(pkgbin, "kvstaged")), f"pid {proc.pid} runs {exe}"
    for cmd in (["kvstage-demo", "--socket", sock], ["kvstage-stat", "--socket", sock, "--json"]):
        r = subprocess.run([os.path.join(bin_, cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}: {r.stdout}{r.stderr}"
finally:
    rc = stop(proc)
assert rc == 0, f"kvstaged exited {rc} at SIGTERM"
print(f"pid {proc.pid} is {exe}")
EOF
); then
	ok "kvstaged (venv's script): $out; ready fd, kvstage-demo, kvstage-stat, SIGTERM drain"
else
	fail kvstaged-run "the venv's kvstaged with kvstage-demo and kvstage-stat: $out$(cat "$tmp/kvstaged.log" 2>/dev/null)"
fi

# kvstage-bench starts the package's kvstaged by itself (the script names it in $KVSTAGED).
if out=$("$bin/kvstage-bench" latency --duration 0.3 2>&1); then
	ok "kvstage-bench latency --duration 0.3 (its own kvstaged)"
else
	fail kvstage-bench "kvstage-bench latency --duration 0.3: $out"
fi

# The Python suite's client tests, against the venv's package and kvstaged; pytest writes no cache and
# no bytecode (the repository may be read-only).
tests=()
for t in "${CHECK_TESTS[@]}"; do tests+=("$root/python/tests/$t"); done
echo "check.sh: pytest ${CHECK_TESTS[*]} ..."
if KVSTAGED=$bin/kvstaged "$venv/bin/python" -m pytest -p no:cacheprovider --basetemp="$tmp/pytest" -q -rs "${tests[@]}" </dev/null \
	>"$tmp/pytest.log" 2>&1; then
	grep '^SKIPPED' "$tmp/pytest.log" # what this host cannot test, and why
	ok "pytest: $(tail -n 1 "$tmp/pytest.log")"
else
	cat "$tmp/pytest.log" >&2
	fail pytest "pytest (above): $(tail -n 1 "$tmp/pytest.log")"
fi
closing
