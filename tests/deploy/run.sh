#!/bin/bash
# kvstage installed and deployed the ways users do, each on a clean system:
#   1. the wheel, pip-installed into a fresh venv in a container that has only
#      Debian's python3, python3-venv, python3-numpy (and pytest to run the
#      client tests): tools/wheel/check.sh;
#   2. the .debs, apt-installed in a clean container: kvstaged from the unit's
#      command line, kvstage-stat, import kvstage (check-deb.sh); their
#      contents, lintian (at build), an install into a chroot and a boot under
#      systemd (tools/deb/check-*.sh);
#   3. one Kubernetes pod (deploy/k8s/engine-pod.yaml) played by podman:
#      kvstaged as a sidecar image, the engine stand-in (the wheel in a venv)
#      beside it; kvstage-demo and pd_demo.py through it, every byte checked;
#      its metrics page;
#   4. two pods, prefill and decode (deploy/k8s/prefill.yaml, decode.yaml),
#      proxies over TCP between them: rooms byte-exact, aborts from each side;
#      the decode pod lost mid-transfer, paused (silent) and deleted (kube
#      down): each time the prefill proxy loses it within --peer-timeout at
#      its default (and a tick), nothing is lost, and the pod made again
#      completes its rooms.
# Usage: tests/deploy/run.sh [--reuse] [OUTDIR]   (as root; default OUTDIR build/deploy)
#   --reuse: keep OUTDIR's wheel, .debs and repositories from an earlier run
#            (for working on the checks; CI builds them anew)
# Needs what tools/setup.sh installs (podman, runc, debootstrap, debhelper,
# python3-mesonpy, ...). Ends with "N passed, N failed"; exit 0 iff none failed.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
reuse=
[ "${1:-}" = --reuse ] && { reuse=1; shift; }
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
	# podman 4.3 plays a Secret as a volume of that name (a secret too in later ones)
	pm secret rm kvstage-peer-secret >/dev/null 2>&1 || true
	pm volume rm -f kvstage-peer-secret >/dev/null 2>&1 || true
	pm network rm -f "$net" >/dev/null 2>&1 || true
}
cleanup
trap cleanup EXIT

# ---------------------------------------------------------------- artifacts
artifacts() {
	rm -rf "$out"
	mkdir -p "$out"
	say "the wheel (tools/wheel/build.sh)"
	"$root/tools/wheel/build.sh" "$out/wheel" >&2
	say "the Debian packages (tools/deb/build.sh)"
	"$root/tools/deb/build.sh" "$out/debs" >&2
	# What the .debs need that the base lacks, as a local apt repository
	# with them; and torch with what it needs, for the engine stand-in.
	"$root/tools/container/debs.sh" "$out/repo" "$out"/debs/*.deb
	cp "$out"/debs/*.deb "$out/repo/"
	(cd "$out/repo" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null > Packages)
	"$root/tools/container/debs.sh" "$out/torch-repo" python3-torch python3-aiohttp
}
if [ -n "$reuse" ] && [ -d "$out/wheel" ] && [ -d "$out/repo" ] && [ -d "$out/torch-repo" ]; then
	say "--reuse: the wheel, .debs and repositories of $out"
else
	artifacts
fi
base=$("$root/tools/container/base.sh")
say "base image $base"
# Each image's build context holds what its Containerfile copies, no more.
ctx=$out/contexts
rm -rf "$ctx"
mkdir -p "$ctx/kvstaged" "$ctx/engine/examples/examples" "$ctx/engine/examples/tests"
cp -al "$out/repo" "$ctx/kvstaged/repo"
cp -al "$out/torch-repo" "$ctx/engine/torch-repo"
cp -al "$out/wheel" "$ctx/engine/wheel"
cp "$root"/python/examples/*.py "$ctx/engine/examples/examples/"
cp -r "$root/python/tests/sglang_stubs" "$ctx/engine/examples/tests/"
say "the sidecar image (deploy/image/kvstaged.Containerfile)"
pm build --quiet --network none --build-arg BASE="$base" -t localhost/kvstage/kvstaged:0.1.0 \
	-f "$root/deploy/image/kvstaged.Containerfile" "$ctx/kvstaged" >/dev/null
say "the engine stand-in image (deploy/image/engine.Containerfile)"
pm build --quiet --network none --build-arg BASE="$base" -t localhost/kvstage/engine-standin:0.1.0 \
	-f "$root/deploy/image/engine.Containerfile" "$ctx/engine" >/dev/null

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

say "2b. the .debs' contents, an install into a chroot, and a boot under systemd (tools/deb)"
check "deb: contents, Depends, symbols, unit and maintainer scripts (tools/deb/check-contents.sh)" \
	"$root/tools/deb/check-contents.sh" "$out/debs"
check "deb: install, conffile, -dev program, reinstall and purge in a chroot (tools/deb/check-install.sh)" \
	"$root/tools/deb/check-install.sh" "$out/debs"
check "deb: the unit under systemd as PID 1: started at boot, READY=1, access, restart, stop (tools/deb/check-boot.sh)" \
	"$root/tools/deb/check-boot.sh" "$out/debs"

# ---------------------------------------------------------------- 3. one pod
pm network create --subnet "$subnet" "$net" >/dev/null
# The test's own secret, in the manifest users edit (its value is the only change).
sed "s|peer.secret: Q0hBTkdFLU1F|peer.secret: $(head -c 32 /dev/urandom | base64 | tr -d '\n' | base64 -w0)|" \
	"$k8s/peer-secret.yaml" > "$secret_yaml"
grep -q Q0hBTkdFLU1F "$secret_yaml" && { echo "run.sh: the secret's placeholder was not replaced" >&2; exit 1; }
play "$secret_yaml"
ready() { pm exec "$1" kvstage-stat --socket /run/kvstage/kvstaged.sock >/dev/null 2>&1; }
say "3. one pod: deploy/k8s/engine-pod.yaml"
play --network "$net" "$k8s/engine-pod.yaml"
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
