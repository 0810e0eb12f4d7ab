#!/bin/sh
# SPDX-License-Identifier: MIT
# meson install, checked: installs BUILD_DIR into a scratch DESTDIR, then
#  - every file meson says it installs is there, and the usual places hold
#    kvstaged, the tools, libkvstage.so.0 (its SONAME, and exactly the
#    kvs_* functions of the installed kvstage.h exported, all at KVSTAGE_0),
#    libkvstage.a, libkvstage.pc, kvstage.h, the man pages, the systemd
#    unit (ExecStart naming the installed kvstaged), sysusers.d, tmpfiles.d
#    and the example config; no installed program or library keeps a path
#    into the build tree;
#  - the Python package (every module of python/kvstage) under the
#    interpreter's directory for the prefix, with its kvstage-VERSION.dist-info
#    (importlib.metadata finds the SGLang plugin entry point through it);
#  - a program (check-install.c) built with nothing but the installed
#    pkg-config file and header (-std=c11 -pedantic -Werror), linked to the
#    installed libkvstage.so.0, runs against the installed kvstaged: one
#    room, one chunk, every byte checked; then kvstaged drains on SIGTERM
#    and exits 0; before that, the installed Python package (loading the
#    installed libkvstage.so.0 through the loader) moves a room through it.
# Usage: check-install.sh BUILD_DIR (built: meson test builds first; this
# installs with --no-rebuild). Exit 0: all passed; 1: says what failed.
set -u

build=${1:?usage: check-install.sh BUILD_DIR}
build=$(cd "$build" && pwd) || exit 1
src=${KVSTAGE_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
failed=0

fail() {
	echo "FAIL: $*" >&2
	failed=1
}

# The build's compiler and sanitizers (meson passes them), else cc, none.
cc=${KVSTAGE_CC:-cc}
san=${KVSTAGE_SANITIZE:-none}
sanflags=
[ "$san" != none ] && sanflags="-fsanitize=$san"
for t in meson python3 readelf nm pkg-config "$cc"; do
	command -v $t >/dev/null 2>&1 || { echo "FAIL: $t not found (the install check needs it)" >&2; exit 1; }
done

tmp=$(mktemp -d /tmp/kvstage-install.XXXXXX) || exit 1
pid=
cleanup() {
	[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT
# Running, not exited (an exited child stays a zombie until waited for).
alive() {
	[ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}
dest=$tmp/dest

if ! out=$(meson install -C "$build" --destdir "$dest" --no-rebuild --quiet 2>&1); then
	printf 'FAIL: meson install -C %s --destdir %s:\n%s\n' "$build" "$dest" "$out" >&2
	exit 1
fi

# Where things go, from the build's own options.
eval "$(meson introspect --buildoptions "$build" | python3 -c '
import json, sys
opts = {o["name"]: o["value"] for o in json.load(sys.stdin)}
for k in ("prefix", "bindir", "libdir", "includedir", "mandir", "datadir"):
    v = opts[k]
    if k != "prefix" and not v.startswith("/"):
        v = opts["prefix"].rstrip("/") + "/" + v
    print("%s=%s" % (k, v))
')"
[ -n "${prefix:-}" ] && [ -n "${libdir:-}" ] || { echo "FAIL: no install dirs from meson introspect" >&2; exit 1; }

# Every file meson installs (the list it would install) is in DESTDIR.
missing=$(meson introspect --installed "$build" | python3 -c '
import json, os, sys
dest = sys.argv[1]
for src, dst in sorted(json.load(sys.stdin).items()):
    if not os.path.lexists(dest + dst):
        print(dst)
' "$dest")
[ -n "$missing" ] && fail "meson introspect --installed lists files DESTDIR lacks:
$missing"

D=$dest
# Programs.
for p in kvstaged kvstage-stat kvstage-ctl kvstage-demo kvstage-bench; do
	[ -x "$D$bindir/$p" ] || fail "no program $bindir/$p"
done
# The library: name, SONAME, the link for -lkvstage, the static archive.
so=$D$libdir/libkvstage.so.0
if [ ! -e "$so" ]; then
	fail "no $libdir/libkvstage.so.0"
else
	soname=$(readelf -d "$so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
	[ "$soname" = libkvstage.so.0 ] || fail "$libdir/libkvstage.so.0: SONAME '$soname', want libkvstage.so.0"
	[ -e "$D$libdir/libkvstage.so" ] || fail "no $libdir/libkvstage.so (for -lkvstage)"
	# Exported: exactly the functions the installed header declares, versioned.
	nm -D --defined-only "$so" | awk '$2 ~ /^[TWiDB]$/ { print $3 }' | sort >"$tmp/exported"
	# A declaration starts its line with its type; comments start with " *".
	sed -n 's/^[a-z][^(]*[ *]\(kvs_[a-z0-9_]*\)(.*/\1@@KVSTAGE_0/p' "$D$includedir/kvstage.h" 2>/dev/null |
		sort -u >"$tmp/declared"
	if [ ! -s "$tmp/declared" ]; then
		fail "no kvs_* functions read from $includedir/kvstage.h"
	elif ! cmp -s "$tmp/exported" "$tmp/declared"; then
		fail "libkvstage.so.0 exports other symbols than kvstage.h declares (< exported, > declared):
$(diff "$tmp/exported" "$tmp/declared" | grep '^[<>]')"
	fi
fi
[ -e "$D$libdir/libkvstage.a" ] || fail "no $libdir/libkvstage.a"
pc=$D$libdir/pkgconfig/libkvstage.pc
[ -f "$pc" ] || fail "no $libdir/pkgconfig/libkvstage.pc"
[ -f "$D$includedir/kvstage.h" ] || fail "no $includedir/kvstage.h"
# Man pages (built by scdoc: without it none are installed, which fails here).
for m in man8/kvstaged.8 man1/kvstage-stat.1 man1/kvstage-ctl.1 man1/kvstage-bench.1 man3/kvstage.3; do
	[ -f "$D$mandir/$m" ] || fail "no man page $mandir/$m$(command -v scdoc >/dev/null || echo ' (scdoc is missing: apt install scdoc)')"
done
# systemd: the unit wherever dist/meson.build put it, naming our kvstaged.
unit=$(meson introspect --installed "$build" | python3 -c '
import json, sys
print("".join(d for d in json.load(sys.stdin).values() if d.endswith("/kvstaged.service")))')
case $unit in
*/lib/systemd/system/kvstaged.service) ;;
*) fail "the unit is installed as '$unit', not in a lib/systemd/system" ;;
esac
if [ -f "$D$unit" ]; then
	grep -q "^ExecStart=$bindir/kvstaged " "$D$unit" ||
		fail "$unit: ExecStart does not name $bindir/kvstaged: $(grep '^ExecStart=' "$D$unit")"
else
	fail "no unit $unit"
fi
# The Python package: every module of the source's python/kvstage, its subpackages' included.
pydir=$(meson introspect --installed "$build" | python3 -c '
import json, sys
d = [v for v in json.load(sys.stdin).values() if v.endswith("/kvstage/__init__.py")]
print(d[0][:-len("/kvstage/__init__.py")] if d else "")')
if [ -z "$pydir" ]; then
	fail "the Python package (kvstage/__init__.py) is not installed"
else
	for m in "$src"/python/kvstage/*.py "$src"/python/kvstage/*/*.py; do
		[ -f "$m" ] || continue
		rel=${m#"$src"/python/}
		[ -f "$D$pydir/$rel" ] || fail "python/$rel is not installed (list it in python/meson.build)"
	done
	# Its distribution metadata next to it: SGLang finds kvstage's plugin (entry point group
	# sglang.srt.plugins) through importlib.metadata, in every process it starts (python/SGLANG.md).
	ver=$(meson introspect --projectinfo "$build" | python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])')
	if [ ! -f "$D$pydir/kvstage-$ver.dist-info/METADATA" ]; then
		fail "no $pydir/kvstage-$ver.dist-info/METADATA (python/meson.build installs it)"
	elif ! out=$(env PYTHONPATH="$D$pydir" "${KVSTAGE_PYTHON:-python3}" -c '
import importlib.metadata as md, sys
ver, where = sys.argv[1], sys.argv[2]
d = md.distribution("kvstage")
assert str(d.locate_file("")).rstrip("/") == where.rstrip("/"), ("not the installed kvstage", d.locate_file(""))
assert d.version == ver, ("version", d.version, ver)
try:
    eps = md.entry_points(group="sglang.srt.plugins")
except TypeError:  # Python < 3.10
    eps = md.entry_points().get("sglang.srt.plugins", [])
ours = [(e.name, e.value) for e in eps if e.name == "kvstage"]
assert ours == [("kvstage", "kvstage.sglang_plugin:register")], ours
print("kvstage", d.version, "entry point", ours[0][0], "=", ours[0][1])
' "$ver" "$D$pydir" 2>&1); then
		fail "the installed kvstage-$ver.dist-info: importlib.metadata does not find the SGLang plugin entry point: $out"
	else
		echo "ok: $out"
	fi
fi
for f in "$prefix/lib/sysusers.d/kvstaged.conf" "$prefix/lib/tmpfiles.d/kvstaged.conf" \
	"$datadir/doc/kvstage/kvstaged.conf.example"; do
	[ -f "$D$f" ] || fail "no $f"
done
# Nothing installed may still look for libraries in the build tree.
for f in "$D$bindir"/kvstage* "$D$libdir"/libkvstage*.so.*; do
	[ -f "$f" ] || continue
	rp=$(readelf -d "$f" | grep -E '\((RPATH|RUNPATH)\)' || true)
	case $rp in
	*"$build"* | *"$src"*) fail "${f#"$D"} keeps a path into the tree: $rp" ;;
	esac
done

# --- a program built from the installed files alone --------------------------
# PKG_CONFIG_LIBDIR: only the DESTDIR's .pc files; PKG_CONFIG_SYSROOT_DIR:
# its -I and -L paths resolved inside DESTDIR.
if [ -f "$pc" ]; then
	if ! flags=$(PKG_CONFIG_LIBDIR=$D$libdir/pkgconfig PKG_CONFIG_SYSROOT_DIR=$D \
		pkg-config --cflags --libs libkvstage 2>&1); then
		fail "pkg-config --cflags --libs libkvstage (in DESTDIR): $flags"
	else
		case $flags in
		*"-I$D$includedir"*"-L$D$libdir"* | *"-L$D$libdir"*"-I$D$includedir"*) ;;
		*) fail "pkg-config gives '$flags', not DESTDIR's include and lib dirs" ;;
		esac
		# shellcheck disable=SC2086 # the flags are words
		if ! out=$("$cc" -std=c11 -pedantic -Wall -Wextra -Werror $sanflags -o "$tmp/check-install" \
			"$src/dist/check-install.c" $flags 2>&1); then
			fail "cc check-install.c \$(pkg-config --cflags --libs libkvstage):
$out"
		fi
	fi
fi
if [ -x "$tmp/check-install" ]; then
	readelf -d "$tmp/check-install" | grep -q 'NEEDED.*\[libkvstage\.so\.0\]' ||
		fail "check-install is not linked to libkvstage.so.0"
	resolved=$(LD_LIBRARY_PATH=$D$libdir ldd "$tmp/check-install" | sed -n 's/.*libkvstage\.so\.0 => \([^ ]*\).*/\1/p')
	[ "$resolved" = "$so" ] || fail "check-install finds libkvstage.so.0 at '$resolved', not $so"

	sock=$tmp/kvs.sock
	# Not under this shell's service manager, if any: the test is the only listener.
	env -u NOTIFY_SOCKET "$D$bindir/kvstaged" --socket "$sock" --slots 4 --slot-size 64K --no-lock \
		--ready-fd 1 >"$tmp/ready" 2>"$tmp/kvstaged.log" </dev/null &
	pid=$!
	n=0
	until grep -q '^ready$' "$tmp/ready" 2>/dev/null; do
		if ! alive "$pid" || [ $n -ge 200 ]; then
			fail "the installed kvstaged did not start:
$(cat "$tmp/kvstaged.log")"
			break
		fi
		n=$((n + 1))
		sleep 0.1
	done
	if [ $failed -eq 0 ]; then
		if out=$(LD_LIBRARY_PATH=$D$libdir "$tmp/check-install" "$sock" 2>&1); then
			echo "ok: $out"
		else
			fail "check-install against the installed kvstaged: $out
kvstaged's log:
$(cat "$tmp/kvstaged.log")"
		fi
		out=$("$D$bindir/kvstage-stat" --socket "$sock" 2>&1) ||
			fail "the installed kvstage-stat: $out"
	fi
	# The installed Python package, on the installed libkvstage (found by
	# the loader, as on a host where the prefix is in ld.so.conf).
	if [ $failed -eq 0 ] && [ -n "$pydir" ]; then
		# An ASan build's library needs its runtime loaded first, into
		# Python itself, whose own allocations LeakSanitizer would report.
		asan=$(ldd "$so" | awk '/libasan\.so/ { print $3; exit }')
		py=${KVSTAGE_PYTHON:-python3}
		if ! "$py" -c 'import numpy' 2>/dev/null; then
			fail "$py, the interpreter meson installed the Python package for, has no numpy, which kvstage.sglang and kvstage.vllm import: install it for that interpreter (Debian: python3-numpy), or configure the build with Debian's python3 first in PATH"
		elif out=$(cd "$tmp" && env -u KVSTAGE_LIB PYTHONPATH="$D$pydir" LD_LIBRARY_PATH="$D$libdir" \
			${asan:+LD_PRELOAD="$asan" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1} \
			"$py" -c '
import sys, kvstage
assert kvstage.__file__.startswith(sys.argv[2]), kvstage.__file__
import kvstage.sglang
try:
    import kvstage.vllm  # a vLLM connector: without vLLM it must say so, and nothing else
except ImportError as e:
    assert "needs vLLM" in str(e), e
with kvstage.Client(sys.argv[1]) as tx, kvstage.Client(sys.argv[1]) as rx:
    rroom, desc = rx.recv_open(5000)
    sroom = tx.send_open(desc)
    (lease,) = tx.acquire(1)
    lease.view()[:5000] = bytes(k % 251 for k in range(5000))
    sroom.send(lease, 0, 5000)
    for c in (tx, rx):
        while not any(e.final and e.status == 0 for e in c.wait(10)):
            pass
    assert bytes(rroom.lease(0).view()[:5000]) == bytes(k % 251 for k in range(5000))
libs = {l.split()[-1] for l in open("/proc/self/maps") if "/libkvstage.so" in l}
assert libs and all(l.startswith(sys.argv[2]) for l in libs), ("not the installed libkvstage", libs)
print("python: kvstage from", kvstage.__file__.replace(sys.argv[2], ""), "moved 5000 bytes, every one right")
' "$sock" "$D" 2>&1); then
			echo "ok: $out"
		else
			fail "the installed Python package against the installed kvstaged: $out"
		fi
	fi
	if alive "$pid"; then
		kill -TERM "$pid"
		n=0
		while alive "$pid" && [ $n -lt 200 ]; do # a drain that hangs is killed after 20 s
			n=$((n + 1))
			sleep 0.1
		done
		kill -9 "$pid" 2>/dev/null
		wait "$pid"
		rc=$?
		pid=
		[ $rc -eq 0 ] || fail "the installed kvstaged exited $rc after SIGTERM:
$(cat "$tmp/kvstaged.log")"
	fi
fi

if [ $failed -ne 0 ]; then
	echo "installed tree (DESTDIR $dest, kept no longer):" >&2
	(cd "$dest" && find . -type f -o -type l | sort) >&2
	exit 1
fi
echo "ok: meson install: programs, libkvstage.so.0 (SONAME, exports), .a, .pc, header, man pages, systemd files, the Python package"
exit 0
