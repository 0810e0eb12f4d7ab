#!/usr/bin/env bash
# The main job on a fresh machine: set up, start kvstaged with its embedded
# defaults (256 slots of 1 MiB), drive it with the demonstration and a short
# benchmark, show its counters, and stop it with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh

dir=$(mktemp -d /tmp/kvstage-demo.XXXXXX)
sock="$dir/kvstaged.sock"
cleanup() {
  [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

mkfifo "$dir/ready"
build/proxy/kvstaged --socket "$sock" --ready-fd 3 3> "$dir/ready" 2> "$dir/kvstaged.log" &
pid=$!
# --ready-fd: the proxy writes "ready" once it serves; EOF means it died
read -r state < "$dir/ready" || true
if [ "${state:-}" != ready ]; then cat "$dir/kvstaged.log"; exit 1; fi
cat "$dir/kvstaged.log"

echo "== demonstration"
build/tools/kvstage-demo --socket "$sock"
if [ -x build/tools/bench/kvstage-bench ]; then
  echo "== benchmark (short)"
  build/tools/bench/kvstage-bench --socket "$sock" --duration 2 local
fi
echo "== kvstage-stat"
build/tools/kvstage-stat --socket "$sock"
kill -TERM "$pid"
wait "$pid"
pid=""
echo "== kvstaged stopped cleanly"
