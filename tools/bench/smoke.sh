#!/usr/bin/env bash
# bench-smoke: every mode of kvstage-bench runs briefly and says what it
# should. It checks the shape of the output (keys, non-zero figures, exit
# codes), never a speed: speeds are for a quiet machine and a person.
# Usage: smoke.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: smoke.sh BUILD_DIR}
bench="$build/tools/bench/kvstage-bench"
export KVSTAGED="$build/proxy/kvstaged"
tmp=$(mktemp -d /tmp/kvstage-bench-smoke.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

fail() {
  echo "bench-smoke: $*" >&2
  for f in "$tmp"/*; do [ -f "$f" ] && { echo "--- $f" >&2; head -c 4000 "$f" >&2; }; done
  exit 1
}

# Runs the bench; fails the test unless it exits with $1.
run() {
  local want=$1 out=$2; shift 2
  local rc=0
  "$bench" "$@" >"$tmp/$out" 2>"$tmp/$out.err" || rc=$?
  [ "$rc" -eq "$want" ] || fail "kvstage-bench $* exited $rc, want $want"
}

# The keys a JSON document must hold ("key": anywhere in it).
has_keys() {
  local file=$1; shift
  for k in "$@"; do
    grep -q "\"$k\":" "$file" || fail "$file: no \"$k\""
  done
}

# The first numeric value of key must be > 0.
positive() {
  local file=$1 key=$2 v
  v=$(grep -oE "\"$key\": -?[0-9][-0-9.e+]*" "$file" | head -1 | awk '{print $2}')
  [ -n "$v" ] || fail "$file: \"$key\" is missing or not a number"
  awk -v v="$v" 'BEGIN { exit !(v + 0 > 0) }' || fail "$file: \"$key\" is $v, want > 0"
}

valid_json() {
  if command -v jq >/dev/null; then
    jq -e . "$1" >/dev/null || fail "$1 is not valid JSON"
  elif command -v python3 >/dev/null; then
    python3 -m json.tool "$1" >/dev/null || fail "$1 is not valid JSON"
  fi
}

# --- the command line
run 0 help.txt --help
grep -q -- '--payload' "$tmp/help.txt" || fail "--help does not describe --payload"
run 2 bad-chunk.txt --chunk 3K local
grep -q "invalid --chunk" "$tmp/bad-chunk.txt.err" || fail "bad --chunk gave no clear message"
run 2 no-mode.txt --duration 1
grep -q "no mode" "$tmp/no-mode.txt.err" || fail "a missing mode gave no clear message"
run 2 bad-pairs.txt --senders 2 --receivers 3 local

# --- local: every byte verified, JSON
run 0 local.json -q --wset 32M --chunk 64K --duration 0.3 --payload verify --json local
valid_json "$tmp/local.json"
has_keys "$tmp/local.json" tool version mode command machine nproc cpu config proxy baselines \
  ring points chunk_bytes gbps chunks_per_s rooms_per_s chunk_latency_us room_latency_us \
  p50 p99 p999 proxy_cpu_pct clients_cpu_pct cpu_s_per_gb memcpy_gbps bound_gbps ratio gbps_vs_bound \
  errors
grep -q '"mode": "local"' "$tmp/local.json" || fail "local.json: mode is not local"
grep -q '"errors": 0' "$tmp/local.json" || fail "local.json: verify found wrong bytes"
for k in gbps chunks_per_s rooms_per_s memcpy_gbps bound_gbps pingpong_rt_per_s; do
  positive "$tmp/local.json" "$k"
done

# --- local, payload copy, two pairs, CSV
run 0 local.csv -q --wset 32M --chunk 16K --duration 0.2 --senders 2 --rooms 2 --csv local
head -1 "$tmp/local.csv" | grep -q '^mode,chunk_bytes,' || fail "local.csv: no header"
[ "$(wc -l <"$tmp/local.csv")" -eq 2 ] || fail "local.csv: want a header and one row"
awk -F, 'NR == 2 && !($13 > 0) { exit 1 }' "$tmp/local.csv" || fail "local.csv: gbps is not > 0"

# --- the table (what people read)
run 0 local.txt -q --wset 32M --chunk 4K --room-bytes 4K --duration 0.2 --payload none local
for w in 'GB/s' 'chunks/s' 'rooms/s' 'chunk latency p99.9' 'room latency p50' 'proxy CPU' \
  'rte_ring'; do
  grep -q "$w" "$tmp/local.txt" || fail "local.txt: no '$w'"
done

# --- tcp: two proxies on loopback, every byte verified
run 0 tcp.json -q --chunk 64K --duration 0.3 --payload verify --json tcp
valid_json "$tmp/tcp.json"
has_keys "$tmp/tcp.json" transport tcp_streams points gbps chunks_per_s room_latency_us \
  proxy_a_cpu_pct proxy_b_cpu_pct clients_cpu_pct raw_tcp_1_gbps raw_tcp_n_gbps gbps_vs_raw_tcp_1 \
  cpu_s_per_gb raw_tcp_cpu_s_per_gb cpu_s_per_gb_vs_raw_tcp ucx_tcp_gbps ucx_tcp_cpu_s_per_gb errors \
  syscalls_per_chunk proxy_a proxy_b sends recvs epoll
grep -q '"mode": "tcp"' "$tmp/tcp.json" || fail "tcp.json: mode is not tcp"
grep -q '"errors": 0' "$tmp/tcp.json" || fail "tcp.json: verify found wrong bytes"
for k in gbps chunks_per_s raw_tcp_1_gbps raw_tcp_n_gbps raw_tcp_cpu_s_per_gb sends recvs; do
  positive "$tmp/tcp.json" "$k"
done
run 2 tcp-socket.txt --socket /nonexistent tcp
grep -q "starts both of its proxies" "$tmp/tcp-socket.txt.err" || fail "tcp --socket gave no clear message"
# The same through two network namespaces, where this machine lets us make them.
ipbin=/usr/sbin/ip; [ -x "$ipbin" ] || ipbin=/sbin/ip
if [ "$(id -u)" -eq 0 ] && [ -x "$ipbin" ] && "$ipbin" netns list >/dev/null 2>&1; then
  run 0 tcp-netns.txt -q --netns --chunk 256K --duration 0.3 --tcp-streams 3 tcp
  for w in 'veth between two network namespaces' 'raw TCP, 1 stream' 'raw TCP, 3 streams' \
    'room latency p99' 'proxy B CPU'; do
    grep -q "$w" "$tmp/tcp-netns.txt" || fail "tcp-netns.txt: no '$w'"
  done
  ! "$ipbin" netns list | grep -q kvsbench || fail "tcp --netns left its namespaces behind"
else
  echo "bench-smoke: skipping tcp --netns: needs root and iproute2 (loopback ran above)"
fi

# --- abort: rooms aborted at random phases, every byte checked; kvstaged must count 0 wrong
run 0 abort.json -q --chunk 16K --rooms 2 --duration 0.2 --abort-rate 0.3 --json \
  --vulnerable "$build/tests/kvstaged-vulnerable" abort
valid_json "$tmp/abort.json"
has_keys "$tmp/abort.json" points path abort_rate gbps gbps_vs_reference abort_to_final_us \
  abort_to_reusable_us by_phase tombstones_reaped refused corrupt_bytes late_events pages_bad
if command -v python3 >/dev/null; then
  python3 - "$tmp/abort.json" <<'PY' || fail "abort.json: wrong bytes through kvstaged, or figures missing"
import json, sys
d = json.load(open(sys.argv[1]))
fenced = [p for p in d["points"] if p["proxy"] == "kvstaged"]
assert len(fenced) == 5, len(fenced)  # local and tcp at 0 and 0.3, the staged run
for p in fenced:
    assert p["corrupt_bytes"] == 0 and p["pages_bad"] == 0 and p["late_events"] == 0, p
    assert p["verified_bytes"] > 0, p
    assert "p50" in p["abort_to_final_us"] and "p99" in p["abort_to_reusable_us"], p
# how many rooms a short run aborts depends on the host's load: some, over three points
assert sum(p["aborted"]["send"] + p["aborted"]["recv"] for p in fenced) > 0
PY
fi
run 0 abort.csv -q --chunk 16K --rooms 2 --duration 0.1 --abort-rate 0.5 --abort-side recv \
  --vulnerable /nonexistent --csv abort
head -1 "$tmp/abort.csv" | grep -q '^mode,path,proxy,' || fail "abort.csv: no header"
[ "$(wc -l <"$tmp/abort.csv")" -eq 5 ] || fail "abort.csv: want a header and 4 rows"
grep -q "fence's baseline: skipped" "$tmp/abort.csv.err" || fail "abort: a missing vulnerable build was not said"

# A red control that cannot catch anything (the fenced kvstaged named as the
# vulnerable one) must say so: in the table, the JSON, and by --strict's exit.
run 0 abort-silent.txt -q --chunk 16K --rooms 2 --duration 0.1 --abort-rate 0.5 \
  --vulnerable "$build/proxy/kvstaged" abort
grep -q 'vuln: caught nothing' "$tmp/abort-silent.txt" || fail "abort: a silent control's row does not say so"
grep -q 'red control .* caught nothing' "$tmp/abort-silent.txt.err" || fail "abort: a silent control was not said"
run 1 abort-strict.json -q --chunk 16K --rooms 2 --duration 0.1 --abort-rate 0.5 \
  --vulnerable "$build/proxy/kvstaged" --strict --json abort
grep -q '"control_caught": *false' "$tmp/abort-strict.json" || fail "abort: no control_caught false in the JSON"

# --- latency, idle, baseline
run 0 latency.json -q --wset 32M --duration 0.2 --json latency
valid_json "$tmp/latency.json"
has_keys "$tmp/latency.json" handoffs_per_s chunk_latency_us acquire_latency_us ratio
positive "$tmp/latency.json" handoffs_per_s

run 0 idle.json -q --duration 0.2 --samples 10 --idle-gap 1 --json idle
valid_json "$tmp/idle.json"
has_keys "$tmp/idle.json" proxy_cpu_pct waiting_client_cpu_pct wake_latency_us \
  eventfd_wake_rtt_us
positive "$tmp/idle.json" window_s

run 0 baseline.json -q --wset 32M --chunk 4K,64K --baseline-sec 0.05 --json baseline
valid_json "$tmp/baseline.json"
has_keys "$tmp/baseline.json" points memcpy_gbps copy_crc_gbps copy_crc_vs_memcpy check_copy_gbps tcp_gbps ring
positive "$tmp/baseline.json" memcpy_gbps
positive "$tmp/baseline.json" copy_crc_gbps
positive "$tmp/baseline.json" check_copy_gbps
positive "$tmp/baseline.json" tcp_gbps

if command -v gnuplot >/dev/null; then
  run 0 plot.txt -q --chunk 4K,64K --baseline-sec 0.02 --plot "$tmp/b.svg" baseline
  grep -q '<svg' "$tmp/b.svg" || fail "--plot wrote no SVG"
  run 0 abort-plot.txt -q --chunk 16K --rooms 2 --duration 0.1 --abort-rate 0.2,0.5 \
    --vulnerable /nonexistent --plot "$tmp/a.svg" abort
  grep -q '<svg' "$tmp/a.svg" || fail "abort --plot wrote no SVG"
fi

# --- ab.py: two builds (here the same one twice) alternated; its table's shape
if command -v python3 >/dev/null; then
  ab="$(cd "$(dirname "$0")" && pwd)/ab.py"
  python3 "$ab" -n 2 "$build" "$build" -- --duration 0.2 --chunk 4K --payload none local \
    >"$tmp/ab.txt" 2>"$tmp/ab.err" || fail "ab.py -n 2 exited $?"
  grep -q '^host: raw rte_ring round trip' "$tmp/ab.txt" || fail "ab.py printed no round trips"
  grep -qE '^ +chunks/s +A( [0-9.e+]+){2} +median' "$tmp/ab.txt" || fail "ab.py: no chunks/s row for A"
  grep -qE 'B/A [0-9.]+ \((better|worse|same)\), pairs [0-9.]+, (pairs whose round trips agree [0-9.]+ \([12] of 2\)|no pair.s round trips agree)' \
    "$tmp/ab.txt" || fail "ab.py: no B/A, pairs and agreeing pairs"
fi

# --- gpu: the real mode or the stub, never a crash
rc=0
"$bench" gpu >"$tmp/gpu.txt" 2>&1 || rc=$?
[ "$rc" -lt 128 ] || fail "gpu mode died with signal $((rc - 128))"

echo "bench-smoke: ok"
