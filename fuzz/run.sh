#!/usr/bin/env bash
# Builds the libFuzzer target (clang, ASan+UBSan) in build-fuzz/ and runs it
# from the corpus kept in fuzz/corpus/.
#   fuzz/run.sh [SECONDS]        fuzz for SECONDS (default 60)
#   FUZZ_RUNS=N fuzz/run.sh      or for exactly N executions
#   FUZZ_MERGE=1 fuzz/run.sh S   then fold new coverage back into fuzz/corpus/
# Exit status is libFuzzer's: non-zero on any crash, leak or broken invariant
# (the input that did it is left in build-fuzz/artifacts/ as crash-*).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
if [ ! -f build-fuzz/build.ninja ]; then
  CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=false -Dbuildtype=debugoptimized \
    -Db_sanitize=address,undefined -Db_lundef=false > build-setup.log 2>&1 \
    || { cat build-setup.log; exit 1; }
fi
ninja -C build-fuzz fuzz/fuzz-ops > build-setup.log 2>&1 || { cat build-setup.log; exit 1; }
mkdir -p build-fuzz/artifacts
work=$(mktemp -d /tmp/kvstage-fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
limit=(-max_total_time="$secs")
[ -n "${FUZZ_RUNS:-}" ] && limit=(-runs="$FUZZ_RUNS")
rc=0
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  build-fuzz/fuzz/fuzz-ops "${limit[@]}" -print_final_stats=1 -max_len=512 \
  -artifact_prefix=build-fuzz/artifacts/ \
  "$work" fuzz/corpus > "$work/log" 2>&1 || rc=$?
grep -vE '^#[0-9]+ +(NEW|REDUCE|pulse)' "$work/log" | tail -n 40
[ "$rc" -eq 0 ] || { echo "fuzz: FAILED (exit $rc)"; exit "$rc"; }
if [ -n "${FUZZ_MERGE:-}" ]; then
  mkdir -p "$work/merged"
  build-fuzz/fuzz/fuzz-ops -merge=1 "$work/merged" fuzz/corpus "$work" >/dev/null 2>&1
  rm -f fuzz/corpus/*
  cp "$work/merged"/* fuzz/corpus/
  echo "fuzz: corpus now $(ls fuzz/corpus | wc -l) inputs"
fi
