#!/bin/bash
# The NIXL backend's tests: tests/nixl/run.sh [--asan] [NIXL_PREFIX] [-- PYTEST_ARGS... | -- --bench BENCH_ARGS...]
#
# NIXL_PREFIX is a NIXL install made by tools/nixl/build.sh (default: the one its --print-prefix
# names; its kvstage-nixl.env is sourced). Builds kvstaged, libkvstage, libplugin_KVSTAGE.so and the
# test-only libplugin_KVSZCOPY.so into build-nixl/ (-Dnixl=enabled -Dnixl_path=NIXL_PREFIX
# -Dtests=false; the main build/ stays without NIXL), then:
#   1. NIXL's own, unmodified examples/cpp/nixl_example with the KVSTAGE backend, through a real
#      kvstaged (two agents in one process, a WRITE with a notification);
#   2. pytest tests/nixl: NIXL's Python agent API as vLLM's NixlConnector drives it, in two processes
#      on two kvstaged proxies over TCP (READ and WRITE, byte-exact, notifications), releases in
#      flight held by the backend's test gate, hostile control-channel input.
# --asan: the same again from build-nixl-asan/ (ASan+UBSan; libasan preloaded into Python and the
# engines, NIXL's own libraries uninstrumented), after the plain pass.
# With -- --bench: instead of 2., the throughput point of tests/nixl/bench.py (after 1.).
# Exit status: 0 when all passed. CI runs it (tools/run-tests.sh).
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

asan=0
if [ "${1:-}" = --asan ]; then
	asan=1
	shift
fi
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
export PYTHONPATH=$root/python:$here${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
py=/usr/bin/python3
nixl_pythonpath=$PYTHONPATH
nixl_ld_path=${LD_LIBRARY_PATH:-}

# build DIR [MESON_OPTIONS...]: configures (once) and builds what the tests use into DIR.
build() {
	local bd=$1
	shift
	if [ ! -f "$bd/build.ninja" ]; then
		local log
		log=$(mktemp /tmp/kvs-nixl-setup.XXXXXX)
		meson setup "$bd" -Dtests=false -Dnixl=enabled -Dnixl_path="$NIXL_PREFIX" "$@" \
			>"$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
		rm -f "$log"
	else
		meson configure "$bd" -Dnixl=enabled -Dnixl_path="$NIXL_PREFIX" >/dev/null
	fi
	ninja -C "$bd" proxy/kvstaged nixl/libplugin_KVSTAGE.so tests/nixl/libplugin_KVSZCOPY.so \
		shm/libkvstage.so.0.1.0 tools/bench/kvstage-bench >/dev/null
	export KVSTAGED=$bd/proxy/kvstaged
	export KVSTAGE_LIB=$bd/shm/libkvstage.so.0
	export KVSTAGE_BENCH=$bd/tools/bench/kvstage-bench
	export NIXL_PLUGIN_DIR=$bd/nixl
	export KVSTAGE_NIXL_ZCOPY=$bd/tests/nixl/libplugin_KVSZCOPY.so # test-only (tests/nixl/zcopy_backend.cpp)
}

# example: NIXL's nixl_example KVSTAGE through a kvstaged of its own.
example() {
	echo "== NIXL's nixl_example KVSTAGE ($NIXL_EXAMPLE, unmodified) through a kvstaged"
	local tmp pid ok=0
	tmp=$(mktemp -d /tmp/kvs-nixl-example.XXXXXX)
	head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/peer.secret"
	chmod 600 "$tmp/peer.secret"
	mkfifo "$tmp/ready"
	"$KVSTAGED" --socket "$tmp/kvs.sock" --slots 64 --slot-size 64K --ready-fd 3 3>"$tmp/ready" \
		>"$tmp/kvstaged.log" 2>&1 &
	pid=$!
	# --ready-fd: "ready" once it serves, EOF if it died first (tools/demo.sh's barrier), 30 s at most
	local state=
	read -r -t 30 state <"$tmp/ready" || true
	if [ "$state" != ready ]; then
		cat "$tmp/kvstaged.log"
		echo "kvstaged did not start" >&2
	elif (cd "$tmp" && KVSTAGE_SOCKET=$tmp/kvs.sock KVSTAGE_PEER_SECRET_FILE=$tmp/peer.secret \
		timeout 60 "$NIXL_EXAMPLE" KVSTAGE >"$tmp/example.log" 2>&1) &&
		grep -q "Transfer verified" "$tmp/example.log" && grep -q "Test done" "$tmp/example.log"; then
		echo "nixl_example KVSTAGE: Transfer verified, Test done"
		ok=1
	else
		cat "$tmp/example.log"
		echo "nixl_example KVSTAGE failed" >&2
	fi
	kill "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
	rm -rf "$tmp"
	[ $ok = 1 ]
}

suite() {
	local targets=(tests/nixl)
	for a in "$@"; do
		case $a in tests/nixl/* | *.py | *.py::*) targets=(); break ;; esac
	done
	"$py" -m pytest -q -p no:cacheprovider "${targets[@]}" "$@" </dev/null
}

build "$root/build-nixl" --buildtype=debugoptimized
example
if [ "${1:-}" = --bench ]; then
	shift
	echo "== the backend's throughput beside kvstage-bench's (tests/nixl/bench.py)"
	exec "$py" "$here/bench.py" "$@"
fi
echo "== pytest tests/nixl (two engine processes, two kvstaged over TCP)"
suite "$@"

if [ $asan = 1 ]; then
	echo "== the same under ASan+UBSan (build-nixl-asan/)"
	build "$root/build-nixl-asan" --buildtype=debug -Db_sanitize=address,undefined -Db_lundef=false
	libs=$(ldd "$NIXL_PLUGIN_DIR/libplugin_KVSTAGE.so" | awk '/libasan\.so|libubsan\.so/ { print $3 }' | tr '\n' ':')
	export LD_PRELOAD=${libs%:}${LD_PRELOAD:+:$LD_PRELOAD}
	export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
	export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
	export PYTHONPATH=$nixl_pythonpath LD_LIBRARY_PATH=$nixl_ld_path
	example
	suite "$@"
fi
