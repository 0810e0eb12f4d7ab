#!/usr/bin/env bash
# ucx-compare.sh: kvstage's local path and UCX (what NIXL builds on) on the
# same work, side by side: one sender process and one receiver process on
# this host, the same message sizes, one table.
#
# UCX: ucx_perftest's tag_bw (UCP tag-matched send/recv bandwidth: the
# receiver learns that each message landed, as a room's receiver does) with
# UCX_TLS=posix,sysv,cma (shared memory; large messages go by rendezvous,
# one copy through CMA). kvstage: kvstage-bench local with payload copy
# (the sender copies into slots, the receiver copies out: two copies, buffer
# to buffer like UCX) and payload none (slots handed over untouched: what an
# engine that fills slots directly gets).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
usage() {
  cat <<EOF
Usage: tools/bench/ucx-compare.sh [OPTION]...
Runs ucx_perftest (server and client, two processes on this host) and
kvstage-bench local at the same message sizes and prints two tables:
size, kvstage GB/s (payload in, copy and none), UCX GB/s, ratios; and the
same in CPU seconds per GB of every process on the path.

  --build DIR        kvstage build directory (default: build, else build-bench)
  --sizes LIST       message/chunk sizes (default 64K,256K,1M,4M)
  --duration SEC     kvstage seconds per size (default 2)
  --bytes BYTES      bytes UCX moves per size, sets its iteration count
                     (default 8G; at least 1000 iterations)
  --inflight BYTES   most bytes kvstage keeps in flight: 4 rooms of
                     min(16 chunks, BYTES/4) each, at least one chunk
                     (default 32M; 0: kvstage-bench's own 4 rooms of 16
                     chunks, 256M in flight at 4M)
  --repeat N         runs of each figure, interleaved; the table shows each
                     one's median (default 3: this VM's figures move by a
                     third from run to run)
  --test NAME        ucx_perftest test: tag_bw (default) or ucp_put_bw
  --tls LIST         UCX_TLS for the shared-memory run (default posix,sysv,cma)
  --transport T      local (default): kvstage local vs UCX shared memory;
                     tcp: kvstage-bench tcp (two proxies on loopback) vs
                     ucx_perftest with UCX_TLS=tcp on loopback
  --no-pin           do not pin (default: with 2+ CPUs, UCX's server and
                     kvstaged on the last CPU, the clients on the first)
  -h, --help         this help

1 GB = 1e9 bytes. ucx_perftest prints MB/s meaning MiB/s; it is converted.
EOF
}

build=""
sizes="64K,256K,1M,4M"
duration=2
ucx_bytes=$((8 << 30))
inflight=32M
repeat=3
test=tag_bw
tls=posix,sysv,cma
transport=local
pin=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --bytes) ucx_bytes=$2; shift 2 ;;
    --inflight) inflight=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --test) test=$2; shift 2 ;;
    --tls) tls=$2; shift 2 ;;
    --transport) transport=$2; shift 2 ;;
    --no-pin) pin=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "ucx-compare: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

die() { echo "ucx-compare: $*" >&2; exit "${2:-1}"; }

to_bytes() { # 64K -> 65536
  local v=$1 n u
  n=${v%[KkMmGg]}; u=${v#"$n"}
  [[ "$n" =~ ^[0-9]+$ ]] || die "bad size '$v' (want N, NK, NM or NG)" 2
  case "$u" in
    ''): ;; [Kk]) n=$((n << 10)) ;; [Mm]) n=$((n << 20)) ;; [Gg]) n=$((n << 30)) ;;
  esac
  echo "$n"
}

case "$test" in tag_bw|ucp_put_bw) ;; *) die "--test must be tag_bw or ucp_put_bw" 2 ;; esac
case "$transport" in
  local) ;;
  tcp) tls=tcp ;;
  *) die "--transport must be local or tcp" 2 ;;
esac
[[ "$duration" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "bad --duration '$duration'" 2
[[ "$repeat" =~ ^[1-9][0-9]?$ ]] || die "bad --repeat '$repeat' (want 1 to 99)" 2
ucx_bytes=$(to_bytes "$ucx_bytes")
inflight=$(to_bytes "$inflight")

command -v ucx_perftest >/dev/null ||
  die "ucx_perftest is not installed (Debian: apt-get install ucx-utils; tools/setup.sh installs it)"
if [ -z "$build" ]; then
  for b in "$here/../../build" "$here/../../build-bench"; do
    [ -x "$b/tools/bench/kvstage-bench" ] && { build=$b; break; }
  done
fi
bench="$build/tools/bench/kvstage-bench"
[ -x "$bench" ] || die "no kvstage-bench under '${build:-build}' (build it, or pass --build DIR)"

ncpu=$(nproc)
srv_pin=() cli_pin=() kv_pin=()
if [ "$pin" = 1 ] && [ "$ncpu" -ge 2 ]; then
  srv_pin=(-c $((ncpu - 1))) cli_pin=(-c 0)
else
  kv_pin=(--no-pin)
fi

tmp=$(mktemp -d /tmp/ucx-compare.XXXXXX)
srv=""
cleanup() {
  [ -n "$srv" ] && kill "$srv" 2>/dev/null && wait "$srv" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# True once something listens on TCP port $1 (any address, v4 or v6).
listening() {
  local hex
  hex=$(printf ':%04X' "$1")
  awk -v p="$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { f = 1 } END { exit !f }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# Sets children_cpu: CPU seconds of every child this shell has waited for
# (bash's times, its second line; in $(...) it would be the subshell's).
children_cpu_now() {
  times >"$tmp/times"
  children_cpu=$(awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] }
    printf "%.3f\n", s }' "$tmp/times")
}

# One ucx_perftest run at size $1; sets gbps, and cpu (both processes' CPU
# seconds per GB moved, warm-up and start-up included). (Not in $(...): die
# must end the script, and the trap must know the server's pid.)
ucx_run() {
  local size=$1 iters warm port out i cpu0
  children_cpu_now
  cpu0=$children_cpu
  iters=$((ucx_bytes / size)); [ "$iters" -lt 1000 ] && iters=1000
  warm=$((iters / 10)); [ "$warm" -lt 100 ] && warm=100
  port=$((20000 + RANDOM % 20000))
  UCX_TLS=$tls timeout 300 ucx_perftest -t "$test" -s "$size" -n "$iters" -w "$warm" \
    -p "$port" "${srv_pin[@]}" >"$tmp/server.$size" 2>&1 &
  srv=$!
  # The server is ready once its port listens (its own "Waiting for
  # connection" line sits in a stdio buffer when redirected).
  for i in $(seq 1 200); do
    listening "$port" && break
    kill -0 "$srv" 2>/dev/null || break
    sleep 0.05
  done
  listening "$port" || { cat "$tmp/server.$size" >&2; die "ucx_perftest server did not start"; }
  if ! out=$(UCX_TLS=$tls timeout 300 ucx_perftest 127.0.0.1 -t "$test" -s "$size" \
              -n "$iters" -w "$warm" -p "$port" -f -v "${cli_pin[@]}" 2>"$tmp/client.err"); then
    cat "$tmp/client.err" "$tmp/server.$size" >&2
    die "ucx_perftest client failed at size $size (UCX_TLS=$tls)"
  fi
  wait "$srv" || true
  srv=""
  children_cpu_now
  cpu=$(awk -v a="$cpu0" -v b="$children_cpu" -v n=$(( (iters + warm) * size )) \
    'BEGIN { printf "%.4f\n", (b - a) / (n / 1e9) }')
  # CSV: iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,...
  gbps=$(echo "$out" | awk -F, '$1 ~ /^[0-9]+$/ { printf "%.4f\n", $6 * 1048576 / 1e9; found = 1 }
    END { if (!found) exit 1 }') || { echo "$out" >&2; die "cannot read ucx_perftest's output"; }
}

# One kvstage-bench run; sets gbps, and cpu (CPU seconds per GB of every
# process on the path: the proxies and the clients, over the window).
kv_run() {
  local size=$1 payload=$2 mode=$3 rc=0 b room=()
  b=$(to_bytes "$size")
  # ucx_perftest reuses one message-sized buffer on each side; give
  # kvstage's private buffers the same working set (two messages), and cap
  # the slots in flight (the pool hands the same slots out again), or the
  # comparison pits cache-resident copies against copies from DRAM.
  if [ "$inflight" -gt 0 ]; then
    local chunks=$(( inflight / 4 / b ))
    [ "$chunks" -gt 16 ] && chunks=16
    [ "$chunks" -lt 1 ] && chunks=1
    room=(--rooms 4 --room-bytes $(( chunks * b )))
  fi
  "$bench" -q "${kv_pin[@]}" --chunk "$size" --payload "$payload" --duration "$duration" \
    --wset "$(( b * 2 ))" "${room[@]}" \
    --json "$mode" >"$tmp/kv.json" 2>"$tmp/kv.err" || rc=$?
  if [ $rc -ne 0 ]; then
    cat "$tmp/kv.err" >&2
    die "kvstage-bench $mode failed at size $size"
  fi
  gbps=$(grep -oE '"gbps": [0-9][-0-9.e+]*' "$tmp/kv.json" | head -1 | awk '{printf "%.4f\n", $2}')
  [ -n "$gbps" ] || die "no GB/s in kvstage-bench's JSON ($tmp/kv.json)"
  # local: "cpu_s_per_gb": N; tcp: "cpu_s_per_gb": { ..., "all": N }
  cpu=$(awk '/"cpu_s_per_gb": [0-9]/ { v = $2 } /"all": / { v = $2 } END { if (v != "") printf "%.4f\n", v + 0 }' \
    "$tmp/kv.json")
  [ -n "$cpu" ] || cpu=-
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }

ucx_ver=$(ucx_info -v 2>/dev/null | sed -n 's/^# Version //p' | head -1)
echo "ucx-compare: kvstage $transport vs UCX ${ucx_ver:-?} $test (UCX_TLS=$tls), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $ncpu CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
if [ ${#srv_pin[@]} -gt 0 ] && [ "$transport" = tcp ]; then
  echo "  pinned: UCX server on CPU $((ncpu - 1)), UCX client on CPU 0; kvstage-bench tcp places its two proxies itself (each on a CPU of its own with 4 or more, else unpinned)"
elif [ ${#srv_pin[@]} -gt 0 ]; then
  echo "  pinned: UCX server and kvstaged on CPU $((ncpu - 1)), UCX client and kvstage clients on CPU 0"
fi
if [ "$transport" = tcp ]; then
  echo "  UCX: ${ucx_bytes} bytes per size, two processes; kvstage: ${duration} s per size, 1 sender + 1 receiver process + two kvstaged"
else
  echo "  UCX: ${ucx_bytes} bytes per size, two processes; kvstage: ${duration} s per size, 1 sender + 1 receiver process + kvstaged"
fi
echo
printf "%-6s %13s %13s %13s %13s %9s %9s %9s\n" size "kvstage in" "kvstage copy" "kvstage none" "UCX $test" "in/UCX" "copy/UCX" "none/UCX"
printf "%-6s %13s %13s %13s %13s %9s %9s %9s\n" "" "GB/s" "GB/s" "GB/s" "GB/s" "" "" ""
IFS=, read -ra list <<<"$sizes"
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
cpu_rows=()
for s in "${list[@]}"; do
  b=$(to_bytes "$s")
  us=() is=() cs=() ns=() ucpu=() icpu=() ccpu=() ncpu_=()
  for ((k = 0; k < repeat; k++)); do
    ucx_run "$b"; us+=("$gbps"); ucpu+=("$cpu")
    kv_run "$s" in "$transport"; is+=("$gbps"); icpu+=("$cpu")
    kv_run "$s" copy "$transport"; cs+=("$gbps"); ccpu+=("$cpu")
    kv_run "$s" none "$transport"; ns+=("$gbps"); ncpu_+=("$cpu")
  done
  u=$(median "${us[@]}") i=$(median "${is[@]}") c=$(median "${cs[@]}") n=$(median "${ns[@]}")
  [ "$repeat" -gt 1 ] && echo "  $s runs (GB/s): UCX ${us[*]}; in ${is[*]}; copy ${cs[*]}; none ${ns[*]}" >&2
  [ "$repeat" -gt 1 ] && echo "  $s runs (CPU s/GB): UCX ${ucpu[*]}; in ${icpu[*]}; copy ${ccpu[*]}; none ${ncpu_[*]}" >&2
  printf "%-6s %13.3f %13.3f %13.3f %13.3f %9s %9s %9s\n" "$s" "$i" "$c" "$n" "$u" "$(ratio "$i" "$u")" "$(ratio "$c" "$u")" "$(ratio "$n" "$u")"
  u=$(median "${ucpu[@]}") i=$(median "${icpu[@]}") c=$(median "${ccpu[@]}") n=$(median "${ncpu_[@]}")
  cpu_rows+=("$(printf "%-6s %13.3f %13.3f %13.3f %13.3f %9s %9s %9s" "$s" "$i" "$c" "$n" "$u" "$(ratio "$i" "$u")" "$(ratio "$c" "$u")" "$(ratio "$n" "$u")")")
done
echo
echo "CPU seconds per GB moved, every process on the path (lower is better; ratio < 1: kvstage spends less):"
printf "%-6s %13s %13s %13s %13s %9s %9s %9s\n" size "kvstage in" "kvstage copy" "kvstage none" "UCX $test" "in/UCX" "copy/UCX" "none/UCX"
printf '%s\n' "${cpu_rows[@]}"
echo
if [ "$transport" = tcp ]; then
  echo "Both cross a TCP connection on loopback: UCX from the sender's buffer to the"
  echo "receiver's; kvstage from a slot on proxy A to a slot on proxy B (--tcp-streams 2),"
  echo "authenticated, every frame MACed, every chunk landed through the fence."
  echo "in: the sender also copies its buffer into the slot; the receiver reads in place."
  echo "copy: and the receiver copies out of its slot (two copies more than UCX)."
  echo "none: slots cross untouched by the clients (the transport alone)."
else
  echo "in: kvstage's sender copies its buffer into a slot; the slot is handed to the"
  echo "receiver, who reads it in place: one copy, the like of UCX's buffer to buffer."
  echo "copy: kvstage moves buffer to buffer with two copies (into a slot, out of it);"
  echo "UCX $test moves buffer to buffer (large messages: one copy, by CMA rendezvous)."
  echo "none: kvstage hands filled slots over without touching them (zero copies)."
fi
[ "$repeat" -gt 1 ] && echo "Each figure is the median of $repeat runs, taken in turn (each run's figures on stderr)."
echo "CPU: kvstage's proxies and clients over the measured window (kvstage-bench's cpu_s_per_gb);"
echo "UCX's two processes over their whole lives (bash's times), warm-up and start-up included."
echo "Working sets match: UCX reuses one buffer per side; kvstage's clients copy from and"
echo "to private buffers of two chunks (kvstage-bench --wset), into and out of pool slots."
if [ "$inflight" -gt 0 ]; then
  echo "kvstage keeps at most $((inflight >> 20)) MiB in flight: 4 rooms of min(16 chunks, $((inflight >> 22)) MiB)"
  echo "(--inflight 0: kvstage-bench's 4 rooms of 16 chunks, 256 MiB at 4M, copies from DRAM)."
fi
