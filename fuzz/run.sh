#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan) in build-fuzz/ and runs
# each from its corpus:
#   fuzz-ops    the proxy's core (fuzz/corpus/)
#   fuzz-frame  the wire between proxies: frames and handshake (fuzz/corpus-frame/)
#   fuzz/run.sh [SECONDS]        fuzz each target for SECONDS (default 60)
#   FUZZ_RUNS=N fuzz/run.sh      or each for exactly N executions
#   FUZZ_TARGETS="frame"         only these targets (default: "ops frame")
#   FUZZ_MERGE=1 fuzz/run.sh S   then fold new coverage back into the corpora
#   FUZZ_BUILD=DIR               build directory (default build-fuzz)
# Exit status is libFuzzer's: non-zero on any crash, leak or broken invariant
# (the input that did it is left in build-fuzz/artifacts/ as crash-*).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
build=${FUZZ_BUILD:-build-fuzz}
read -r -a targets <<< "${FUZZ_TARGETS:-ops frame}"
if [ ! -f "$build/build.ninja" ]; then
  CC=clang meson setup "$build" -Dfuzz=true -Dtests=false -Dbuildtype=debugoptimized \
    -Db_sanitize=address,undefined -Db_lundef=false > build-setup.log 2>&1 \
    || { cat build-setup.log; exit 1; }
fi
ninja -C "$build" "${targets[@]/#/fuzz/fuzz-}" > build-setup.log 2>&1 || { cat build-setup.log; exit 1; }
mkdir -p "$build/artifacts"
work=$(mktemp -d /tmp/kvstage-fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
limit=(-max_total_time="$secs")
[ -n "${FUZZ_RUNS:-}" ] && limit=(-runs="$FUZZ_RUNS")
for t in "${targets[@]}"; do
  case "$t" in
    ops) corpus=fuzz/corpus; max_len=512 ;;
    frame) corpus=fuzz/corpus-frame; max_len=4096 ;;
    *) echo "fuzz: no target $t (ops, frame)"; exit 2 ;;
  esac
  echo "== fuzz-$t"
  mkdir -p "$work/$t"
  rc=0
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$build/fuzz/fuzz-$t" "${limit[@]}" -print_final_stats=1 -max_len="$max_len" \
    -artifact_prefix="$build/artifacts/" \
    "$work/$t" "$corpus" > "$work/log" 2>&1 || rc=$?
  grep -vE '^#[0-9]+ +(NEW|REDUCE|pulse)' "$work/log" | tail -n 40
  [ "$rc" -eq 0 ] || { echo "fuzz: fuzz-$t FAILED (exit $rc)"; exit "$rc"; }
  if [ -n "${FUZZ_MERGE:-}" ]; then
    mkdir -p "$work/merged-$t"
    "$build/fuzz/fuzz-$t" -merge=1 -max_len="$max_len" "$work/merged-$t" "$corpus" "$work/$t" \
      >/dev/null 2>&1
    rm -f "$corpus"/*
    cp "$work/merged-$t"/* "$corpus"/
    echo "fuzz: $corpus now $(ls "$corpus" | wc -l) inputs"
  fi
done
