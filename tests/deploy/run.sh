#!/bin/bash
# kvstage installed and deployed the ways users do, each on a clean system:
#   1. the wheel, pip-installed into a fresh venv in a container that has only
#      Debian's python3, python3-venv, python3-numpy (and pytest to run the
#      client tests): tools/wheel/check.sh;
#   2. the .debs, apt-installed in a clean container: kvstaged from the unit's
#      command line, kvstage-stat, import kvstage (check-deb.sh);
#   3. one Kubernetes pod (deploy/k8s/engine-pod.yaml) played by podman:
#      kvstaged as a sidecar image, the engine stand-in (the wheel in a venv)
#      beside it; kvstage-demo and pd_demo.py through it, every byte checked;
#      its metrics page;
#   4. two pods, prefill and decode (deploy/k8s/prefill.yaml, decode.yaml),
#      proxies over TCP between them: rooms byte-exact, aborts from each side;
#      the decode pod silenced mid-transfer (paused), the prefill proxy losing
#      it within --peer-timeout at its default, nothing lost, the pod deleted
#      and made again, and its rooms complete.
# Usage: tests/deploy/run.sh [OUTDIR]   (as root; default OUTDIR build/deploy)
# Needs what tools/setup.sh installs (podman, runc, debootstrap, debhelper,
# python3-mesonpy, ...). Ends with "N passed, N failed"; exit 0 iff none failed.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
out=${1:-$root/build/deploy}
case $out in /*) ;; *) out=$PWD/$out ;; esac
[ "$(id -u)" -eq 0 ] || { echo "run.sh: podman's networks and pods need root" >&2; exit 2; }
net=kvstage-ci-$$
subnet=10.89.$((RANDOM % 200 + 20)).0/24
k8s=$root/deploy/k8s
secret_yaml=$out/peer-secret.yaml

cleanup() {
	for y in "$k8s/engine-pod.yaml" "$k8s/prefill.yaml" "$k8s/decode.yaml"; do
		pm kube down "$y" >/dev/null 2>&1 || true
	done
	pm secret rm kvstage-peer-secret >/dev/null 2>&1 || true
	pm network rm -f "$net" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# ---------------------------------------------------------------- artifacts
rm -rf "$out"
mkdir -p "$out"
say "the wheel (tools/wheel/build.sh)"
"$root/tools/wheel/build.sh" "$out/wheel" >&2
say "the Debian packages (tools/deb/build.sh)"
"$root/tools/deb/build.sh" "$out/debs" >&2
base=$("$root/tools/container/base.sh")
say "base image $base"
# What the .debs need that the base lacks, as a local apt repository beside them.
"$root/tools/container/debs.sh" "$out/repo" "$out"/debs/*.deb
cp "$out"/debs/*.deb "$out/repo/"
(cd "$out/repo" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null > Packages)
"$root/tools/container/debs.sh" "$out/torch-repo" python3-torch

say "the sidecar image (deploy/image/kvstaged.Containerfile)"
pm build --quiet --network none --build-arg BASE="$base" -t localhost/kvstage/kvstaged:0.1.0 \
	-f "$root/deploy/image/kvstaged.Containerfile" "$out" >/dev/null
say "the engine stand-in image (deploy/image/engine.Containerfile)"
ctx=$out/engine-context
mkdir -p "$ctx/examples/examples" "$ctx/examples/tests"
cp -al "$out/torch-repo" "$ctx/torch-repo"
cp -al "$out/wheel" "$ctx/wheel"
cp "$root"/python/examples/*.py "$ctx/examples/examples/"
cp -r "$root/python/tests/sglang_stubs" "$ctx/examples/tests/"
pm build --quiet --network none --build-arg BASE="$base" -t localhost/kvstage/engine-standin:0.1.0 \
	-f "$root/deploy/image/engine.Containerfile" "$ctx" >/dev/null

# ---------------------------------------------------------------- 1. the wheel
wheel=$(ls "$out"/wheel/kvstage-*.whl)
say "1. the wheel in a clean container: $(basename "$wheel")"
check "wheel: pip install --no-index into a venv, kvstaged serves, the client tests pass" \
	pm run --rm --network none -v "$root:/src:ro" -v "$out/wheel:/wheel:ro" "$base" \
	/src/tools/wheel/check.sh "/wheel/$(basename "$wheel")"

# ---------------------------------------------------------------- 2. the .debs
say "2. the .debs in a clean container"
check "deb: apt install, kvstaged from the unit's command line, kvstage-stat, import kvstage" \
	pm run --rm --network none -v "$root/tests/deploy:/t:ro" -v "$out/repo:/repo:ro" "$base" /t/check-deb.sh

# ---------------------------------------------------------------- 3. one pod
pm network create --subnet "$subnet" "$net" >/dev/null
# The test's own secret, in the manifest users edit (its value is the only change).
sed "s|CHANGE-ME-openssl-rand-base64-32|$(head -c 32 /dev/urandom | base64)|" "$k8s/peer-secret.yaml" > "$secret_yaml"
pm kube play --quiet "$secret_yaml" >/dev/null
ready() { pm exec "$1" kvstage-stat --socket /run/kvstage/kvstaged.sock >/dev/null 2>&1; }
say "3. one pod: deploy/k8s/engine-pod.yaml"
pm kube play --quiet --network "$net" "$k8s/engine-pod.yaml" >/dev/null
if wait_until 60 ready kvstage-engine-kvstaged; then
	pass "pod: the sidecar serves (kvstage-stat, the readiness probe's command)"
	check "pod: kvstage-demo in the engine's container, through the sidecar" \
		pm exec kvstage-engine-engine kvstage-demo --rooms 50
	check "pod: pd_demo.py in the engine's container (200 requests, a fifth aborted), every byte checked" \
		pm exec kvstage-engine-engine python3 /opt/kvstage/python/examples/pd_demo.py \
		--socket /run/kvstage/kvstaged.sock --requests 200 --quiet
	check "pod: the metrics page on :9464 (kvstage_* samples)" \
		pm exec kvstage-engine-engine python3 -c 'import sys, urllib.request as u
page = u.urlopen("http://127.0.0.1:9464/metrics", timeout=5).read().decode()
sys.exit(0 if "\nkvstage_rooms_done_total " in page else 1)'
	check "pod: the sidecar's pool ends free, no room open" \
		stat_is kvstage-engine-kvstaged 'd["slots"]["free"] == d["slot_count"] and d["rooms"]["open"] == 0'
else
	fail "pod: the sidecar never served"
	pm logs kvstage-engine-kvstaged 2>&1 | tail -n 20 >&2 || true
fi
pm kube down "$k8s/engine-pod.yaml" >/dev/null

# ---------------------------------------------------------------- 4. two pods
say "4. two pods: deploy/k8s/prefill.yaml and decode.yaml, proxies over TCP"
. "$here/two-pods.sh"
summary
