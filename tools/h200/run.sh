#!/usr/bin/env bash
# On the lent H200 machine, from the repository root, with build-h200/bundle
# carried (made here by tools/h200/bundle.sh):
#
#   run(command="tools/h200/run.sh", carry=["build-h200/bundle"], timeout_s=540)
#
# Prints the GPU and its PCIe link, runs the CUDA tests (every device test:
# bytes through a room, gather/scatter round trips in every mode,
# registration), the Python binding's device paths (py_gpu_check.py, when
# the machine has python3), then the GPU bench (slot copies and
# gather/scatter of 4K..64K pages, each beside cudaMemcpy to cudaMallocHost),
# first on the pool's normal pages, then once more on 2 MiB hugepages if the
# machine gives some. Then, for the proxy on real cores: kvstage-bench local
# at 1, 4 and 8 sender/receiver pairs, tcp at 1 and 4, latency and idle (and
# verbs if the machine has an RDMA device). Everything goes to $OUT (h200.log
# with all of it, test-cuda.log, bench-*.json, cpu.csv: seven files, the tool
# brings back eight); the summary is printed last. Each step has its own
# timeout; the whole takes about three minutes and stays under eight.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=$PWD/build-h200/bundle
OUT=${OUT:-$(mktemp -d /tmp/kvstage-h200.XXXXXX)}
mkdir -p "$OUT"
TXT=$(mktemp -d /tmp/kvstage-h200-txt.XXXXXX) # the tables: in h200.log already
exec > >(tee -a "$OUT/h200.log") 2>&1
status=0
step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%T)"; }

step "machine"
if [ ! -x "$BUNDLE/tests/test-cuda" ]; then
  echo "no bundle at $BUNDLE: run tools/h200/bundle.sh first and carry build-h200/bundle"
  exit 1
fi
cat "$BUNDLE/BUILD-INFO"
uname -a
ldd --version | head -1
timeout 30 nvidia-smi || echo "nvidia-smi failed"
timeout 30 nvidia-smi -q | grep -A 12 -i 'PCI$' | grep -i -E 'gen|width|bus id' || true
grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || true

# Our binaries (and the kvstaged they start) get the carried libraries first;
# glibc and the driver's libcuda are the machine's own. The machine's own
# tools (grep, tee, nvidia-smi) keep its libraries: only kv sets the path.
kv() { LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"; }
export KVSTAGE_BUILD_DIR=$BUNDLE
export KVSTAGE_CUDA_DEBUG=1
missing=$(for b in "$BUNDLE"/proxy/kvstaged "$BUNDLE"/tools/bench/kvstage-bench "$BUNDLE"/tests/test-cuda; do
  kv ldd "$b" | grep 'not found'; done)
if [ -n "$missing" ]; then
  echo "libraries missing on this machine:"
  echo "$missing"
  exit 1
fi

step "CUDA tests"
kv timeout 240 "$BUNDLE/tests/test-cuda" --verbose --jobs=1 2>&1 | tee "$OUT/test-cuda.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "test-cuda exited $rc"; status=1; }
grep -q '^\[SKIP\].*no CUDA device here' "$OUT/test-cuda.log" && { echo "some device tests SKIPPED (see above)"; status=1; }

step "Python binding on the device"
if command -v python3 > /dev/null; then
  KVSTAGE_LIB=$BUNDLE/lib/libkvstage.so.0 kv timeout 60 python3 tools/h200/py_gpu_check.py "$BUNDLE/proxy/kvstaged"
  rc=$?
  [ "$rc" -ne 0 ] && { echo "py_gpu_check exited $rc"; status=1; }
else
  echo "no python3 on this machine: the binding's device paths are not run"
fi

bench() { # name, args...
  local name=$1
  shift
  step "bench $name: kvstage-bench gpu $*"
  kv timeout 120 "$BUNDLE/tools/bench/kvstage-bench" gpu "$@" | tee "$TXT/bench-$name.txt"
  local r=${PIPESTATUS[0]}
  [ "$r" -ne 0 ] && { echo "bench $name exited $r"; status=1; return "$r"; }
  kv timeout 120 "$BUNDLE/tools/bench/kvstage-bench" gpu --json -q "$@" > "$OUT/bench-$name.json" ||
    { echo "bench $name --json failed"; status=1; }
}

# 4 MiB copies and gathers of 4K..64K pages, every gather mode. Exit 2: no
# device (said above), and no other run will find one.
bench 4m --size 4M
if [ $? -ne 2 ]; then
  # the proxy's default slot size
  bench 1m --size 1M --page-size 4K,16K,64K
  # where the kernel and the copy engines cross, above the issue's sizes
  bench 16m --size 16M --page-size 16K,256K,1M,4M --modes copy,kernel
  gpu=1
fi

# The same on 2 MiB hugepages, if the machine will reserve some (restored after).
hp=/proc/sys/vm/nr_hugepages
if [ -n "${gpu:-}" ] && [ -w "$hp" ]; then
  old=$(cat "$hp")
  echo $((old + 32)) > "$hp" 2>/dev/null || true
  if [ "$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)" -ge 8 ]; then
    bench 4m-hugepages --size 4M
  else
    step "no hugepages could be reserved: the hugepage pass is skipped"
  fi
  echo "$old" > "$hp" 2>/dev/null || true
fi

# The proxy on this machine's cores (not the GPU): every CPU mode, one CSV.
cpu() { # name, mode, args...
  local name=$1
  shift
  step "cpu $name: kvstage-bench $*"
  kv timeout 120 "$BUNDLE/tools/bench/kvstage-bench" "$@" --csv | tee "$TXT/cpu-$name.csv"
  local r=${PIPESTATUS[0]}
  [ "$r" -ne 0 ] && { echo "cpu $name exited $r"; status=1; }
  { echo "# $name: kvstage-bench $*"; cat "$TXT/cpu-$name.csv"; } >> "$OUT/cpu.csv"
}
# (H200_PAIRS / H200_TCP_PAIRS: for a dry run on a small machine, e.g. "1")
for n in ${H200_PAIRS:-1 4 8}; do
  cpu "local-$n" local --senders "$n" --chunk 256K,1M,4M --duration 1
done
for n in ${H200_TCP_PAIRS:-1 4}; do
  cpu "tcp-$n" tcp --senders "$n" --chunk 256K,1M,4M --duration 1
done
cpu latency latency --chunk 4K --duration 1
cpu idle idle --duration 1
rdma=$(ls /sys/class/infiniband 2>/dev/null | head -1)
if [ -n "$rdma" ]; then
  cpu verbs verbs --rdma-device "$rdma" --chunk 1M,4M --duration 1
else
  step "no RDMA device (/sys/class/infiniband is empty): kvstage-bench verbs not run"
fi

step "summary"
grep -h -E '^(kvstage-bench gpu:|pool:|targets:)' "$TXT"/bench-*.txt 2>/dev/null
grep -h "py_gpu_check: " "$OUT/h200.log" | tail -4
grep -E '^\[====\] Synthesis' "$OUT/test-cuda.log" || echo "test-cuda printed no synthesis"
echo "files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
echo "h200 check: $([ $status -eq 0 ] && echo PASSED || echo FAILED) (speed targets are the 'targets:' lines)"
exit $status
