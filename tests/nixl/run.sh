#!/bin/bash
# The NIXL backend's tests: tests/nixl/run.sh [NIXL_PREFIX] [-- PYTEST_ARGS... | -- --bench BENCH_ARGS...]
#
# NIXL_PREFIX is a NIXL install made by tools/nixl/build.sh (default: the one its --print-prefix
# names; its kvstage-nixl.env is sourced). Builds kvstaged, libkvstage and libplugin_KVSTAGE.so
# into build-nixl/ (-Dnixl=enabled -Dnixl_path=NIXL_PREFIX -Dtests=false; the main build/ stays
# without NIXL), then:
#   1. NIXL's own, unmodified examples/cpp/nixl_example with the KVSTAGE backend, through a real
#      kvstaged (two agents in one process, a WRITE with a notification);
#   2. pytest tests/nixl: NIXL's Python agent API as vLLM's NixlConnector drives it, in two processes
#      on two kvstaged proxies over TCP (READ and WRITE, byte-exact, notifications), releases in
#      flight held by the backend's test gate, hostile control-channel input.
# With -- --bench: instead of 2., the throughput point of tests/nixl/bench.py (after 1.).
# Exit status: 0 when all passed. CI runs it (tools/run-tests.sh).
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

prefix=
if [ $# -gt 0 ] && [ "$1" != -- ]; then
	prefix=$1
	shift
fi
[ "${1:-}" = -- ] && shift
if [ -z "$prefix" ]; then
	prefix=$(tools/nixl/build.sh --print-prefix)
fi
envf=$prefix/kvstage-nixl.env
[ -f "$envf" ] || { echo "tests/nixl/run.sh: no NIXL install at $prefix ($envf missing): run tools/nixl/build.sh first" >&2; exit 2; }
# shellcheck disable=SC1090
. "$envf"

bd=$root/build-nixl
if [ ! -f "$bd/build.ninja" ]; then
	log=$(mktemp /tmp/kvs-nixl-setup.XXXXXX)
	meson setup "$bd" --buildtype=debugoptimized -Dtests=false -Dnixl=enabled -Dnixl_path="$NIXL_PREFIX" \
		>"$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
	rm -f "$log"
else
	meson configure "$bd" -Dnixl=enabled -Dnixl_path="$NIXL_PREFIX" >/dev/null
fi
ninja -C "$bd" proxy/kvstaged nixl/libplugin_KVSTAGE.so tests/nixl/libplugin_KVSZCOPY.so \
	shm/libkvstage.so.0.1.0 >/dev/null

export KVSTAGED=$bd/proxy/kvstaged
export KVSTAGE_LIB=$bd/shm/libkvstage.so.0
export NIXL_PLUGIN_DIR=$bd/nixl
export KVSTAGE_NIXL_ZCOPY=$bd/tests/nixl/libplugin_KVSZCOPY.so # test-only (tests/nixl/zcopy_backend.cpp)
export PYTHONPATH=$root/python:$here${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1

echo "== NIXL's nixl_example KVSTAGE ($NIXL_EXAMPLE, unmodified) through a kvstaged"
tmp=$(mktemp -d /tmp/kvs-nixl-example.XXXXXX)
pid=
cleanup() {
	[ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/peer.secret"
chmod 600 "$tmp/peer.secret"
exec 3>"$tmp/ready"
"$KVSTAGED" --socket "$tmp/kvs.sock" --slots 64 --slot-size 64K --ready-fd 3 >"$tmp/kvstaged.log" 2>&1 &
pid=$!
exec 3>&-
for _ in $(seq 200); do grep -q ready "$tmp/ready" && break; sleep 0.05; done
grep -q ready "$tmp/ready" || { cat "$tmp/kvstaged.log"; echo "kvstaged did not start" >&2; exit 1; }
if ! (cd "$tmp" && KVSTAGE_SOCKET=$tmp/kvs.sock KVSTAGE_PEER_SECRET_FILE=$tmp/peer.secret \
	timeout 60 "$NIXL_EXAMPLE" KVSTAGE >"$tmp/example.log" 2>&1); then
	cat "$tmp/example.log"
	echo "nixl_example KVSTAGE failed" >&2
	exit 1
fi
grep -q "Transfer verified" "$tmp/example.log" && grep -q "Test done" "$tmp/example.log" ||
	{ cat "$tmp/example.log"; echo "nixl_example KVSTAGE did not verify its transfer" >&2; exit 1; }
echo "nixl_example KVSTAGE: Transfer verified, Test done"
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=

if [ "${1:-}" = --bench ]; then
	shift
	ninja -C "$bd" tools/bench/kvstage-bench >/dev/null
	export KVSTAGE_BENCH=$bd/tools/bench/kvstage-bench
	echo "== the backend's throughput beside kvstage-bench's (tests/nixl/bench.py)"
	exec /usr/bin/python3 "$here/bench.py" "$@"
fi

echo "== pytest tests/nixl (two engine processes, two kvstaged over TCP)"
py=/usr/bin/python3
targets=(tests/nixl)
for a in "$@"; do
	case $a in tests/nixl/* | *.py | *.py::*) targets=(); break ;; esac
done
"$py" -m pytest -q -p no:cacheprovider "${targets[@]}" "$@" </dev/null
