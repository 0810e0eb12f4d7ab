#!/usr/bin/env bash
# Every test: the plain build, then the same suites under ASan+UBSan.
# This is what CI runs (.ci/run) and what the README gives.
set -euo pipefail
# Debian's directories first: the build and the tests use what setup.sh
# installs with apt (python3 with numpy and pytest, meson), never a python3
# that the caller's PATH puts ahead (pyenv). A bare environment (no PATH: gcc
# then cannot find cc1) must still build.
export PATH="/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}:/usr/local/sbin:/usr/local/bin"
cd "$(dirname "$0")/.."
echo "== $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores, uid $(id -u), in $PWD"
tools/setup.sh

echo "== C style (tools/check-format.sh: clang-format, .clang-format)"
tools/check-format.sh
echo "== tests (build/)"
meson test -C build --print-errorlogs

echo "== the Python binding (python/, pytest against build/), and its style (python/lint.sh: pycodestyle)"
python/lint.sh
python/run-tests.sh build

echo "== the NIXL backend: NIXL 8770b655a6b1 built offline from subprojects/, then tests/nixl (vLLM-like READs, releases in flight, hostile control channel, NIXL's own nixl_example KVSTAGE), also under ASan+UBSan"
# build.sh prints its progress on stderr and the prefix (/var/cache/kvstage-ci/nixl-<hash of its
# inputs>) on stdout; it builds nothing when that prefix already holds the same install. run.sh
# --asan runs the plain pass (build-nixl/), then the same under ASan+UBSan (build-nixl-asan/).
nixl_prefix=$(tools/nixl/build.sh)
tools/nixl/check.sh "$nixl_prefix"
tests/nixl/run.sh --asan "$nixl_prefix"

echo "== installed and deployed as users do, each on a clean system (tests/deploy/run.sh): the wheel in a venv, the .debs with apt, the sidecar image, Kubernetes pods under podman kube play"
tests/deploy/run.sh build/deploy

echo "== the minimal build (build-min/): without verbs, metrics, systemd and acl, -Werror; its quick suites"
# What a host without those libraries builds (meson_options.txt): it must
# compile warning-free, and say and refuse what it lacks (test-cli), while
# the wire, the hello and the peer plane behave as in the full build.
if [ ! -f build-min/build.ninja ]; then
  meson setup build-min --buildtype=debugoptimized --werror -Dverbs=disabled -Dmetrics=disabled \
    -Dsystemd=disabled -Dacl=disabled -Dcuda=disabled > build-setup.log 2>&1 || { cat build-setup.log; exit 1; }
fi
ninja -C build-min
meson test -C build-min --print-errorlogs layers layers-planted slots frame core rooms cli errors peers local conformance

echo "== tests under ASan+UBSan (build-asan/)"
if [ ! -f build-asan/build.ninja ]; then
  meson setup build-asan --buildtype=debug -Db_sanitize=address,undefined \
    -Db_lundef=false -Dverbs=enabled -Dmetrics=enabled -Dsystemd=enabled -Dacl=enabled \
    > build-setup.log 2>&1 || { cat build-setup.log; exit 1; }
fi
ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  meson test -C build-asan --print-errorlogs
python/run-tests.sh build-asan
echo "== conformance, tcp and hostile again under ASan+UBSan, every proxy sending payloads with MSG_ZEROCOPY (--tcp-zerocopy: on loopback the kernel copies at delivery and says so; this checks its answers' bookkeeping, not a speed)"
for suite in conformance tcp hostile; do
  KVSTAGE_TEST_PROXY_ARGS=--tcp-zerocopy KVSTAGE_BUILD_DIR="$PWD/build-asan" ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 "build-asan/tests/test-$suite" --jobs=1
done
echo "== soft-RoCE in a qemu guest (tests/rxe: Debian's kernel, rdma_rxe, a real RC transfer)"
tests/rxe/setup.sh
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/selftest.sh
echo "== the verbs suite on rxe0 in that guest (on this host it skips: no RDMA device)"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 -- build/tests/test-verbs --jobs=1 --verbose
echo "== the transport conformance suite in that guest, verbs included (two proxies, --rdma-device rxe0)"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 --env KVSTAGE_TEST_RDMA_DEVICE=rxe0 \
  --env KVSTAGE_BUILD_DIR="$PWD/build" -- build/tests/test-conformance --jobs=1
echo "== the tcp suite again with chunks by RDMA READ (every proxy --rdma-device rxe0) in that guest"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 --env "KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe0" \
  --env KVSTAGE_BUILD_DIR="$PWD/build" -- build/tests/test-tcp --jobs=1
echo "== hostile peers against proxies with --rdma-device rxe0 in that guest (the wire, then the control plane)"
for suite in peers hostile; do
  RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 --env "KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe0" \
    --env KVSTAGE_BUILD_DIR="$PWD/build" -- "build/tests/test-$suite" --jobs=1
done
echo "== a hostile RDMA peer READing what it was not sent, against a proxy serving an honest one, in that guest"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 --env KVSTAGE_BUILD_DIR="$PWD/build" -- \
  build/tests/test-hostile-rdma --jobs=1
echo "== under ASan+UBSan in that guest: verbs, conformance's verbs cases (the rest ran under ASan above), tcp, peers, hostile and hostile-rdma with rxe0"
asan_env=(--env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 --env UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1)
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 "${asan_env[@]}" -- build-asan/tests/test-verbs --jobs=1
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 "${asan_env[@]}" --env KVSTAGE_TEST_RDMA_DEVICE=rxe0 \
  --env KVSTAGE_TEST_ONLY_KIND=verbs --env KVSTAGE_BUILD_DIR="$PWD/build-asan" -- build-asan/tests/test-conformance --jobs=1
for suite in tcp peers hostile; do
  RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 "${asan_env[@]}" --env "KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe0" \
    --env KVSTAGE_BUILD_DIR="$PWD/build-asan" -- "build-asan/tests/test-$suite" --jobs=1
done
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 "${asan_env[@]}" --env KVSTAGE_BUILD_DIR="$PWD/build-asan" -- \
  build-asan/tests/test-hostile-rdma --jobs=1
echo "== two rails in that guest (rxe0 and rxe1 on two links, every proxy --rdma-device rxe0 --rdma-device rxe1): chunks spread, a link cut mid-room; then conformance's verbs cases and the hostile RDMA peer against two-rail proxies"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 --env KVSTAGE_BUILD_DIR="$PWD/build" -- \
  build/tests/test-rails --jobs=1
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 --env KVSTAGE_TEST_RDMA_DEVICE=rxe0 \
  --env KVSTAGE_TEST_ONLY_KIND=verbs --env "KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe1" \
  --env KVSTAGE_BUILD_DIR="$PWD/build" -- build/tests/test-conformance --jobs=1
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 900 --env "KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe1" \
  --env KVSTAGE_BUILD_DIR="$PWD/build" -- build/tests/test-hostile-rdma --jobs=1
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 "${asan_env[@]}" --env KVSTAGE_BUILD_DIR="$PWD/build-asan" -- \
  build-asan/tests/test-rails --jobs=1
echo "== the pool split by NUMA node in that guest (qemu gives it two nodes): pages placed, clients lease on their node"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 --env KVSTAGE_BUILD_DIR="$PWD/build" -- \
  build/tests/test-numa --jobs=1
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 600 "${asan_env[@]}" --env KVSTAGE_BUILD_DIR="$PWD/build-asan" -- \
  build-asan/tests/test-numa --jobs=1
echo "== kvstage-bench verbs in that guest (the output's shape; no speed means anything there)"
RXE_WORKDIR="$PWD/build/rxe" tests/rxe/run.sh --timeout 300 -- tools/bench/smoke-verbs.sh build
echo "== short fuzz pass (fuzz/run.sh: libFuzzer, clang, ASan+UBSan; see docs/testing.md for the long run)"
FUZZ_RUNS=${FUZZ_RUNS:-100000} fuzz/run.sh
echo "== all tests passed"
