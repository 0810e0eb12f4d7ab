#!/usr/bin/env bash
# Installs what kvstage needs on Debian 12 (apt), then builds it into build/.
# Safe to run again: it installs only what is missing and rebuilds incrementally.
set -euo pipefail
# Debian's directories first: the build and the tests use what setup.sh
# installs with apt (python3 with numpy and pytest, meson), never a python3
# that the caller's PATH puts ahead (pyenv). A bare environment (no PATH: gcc
# then cannot find cc1) must still build.
export PATH="/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}:/usr/local/sbin:/usr/local/bin"
cd "$(dirname "$0")/.."

PKGS=(gcc pkg-config meson ninja-build libdpdk-dev libcriterion-dev libibverbs-dev
      libsodium-dev libinih-dev libsystemd-dev libmicrohttpd-dev libacl1-dev acl systemd clang libclang-rt-14-dev gnuplot-nox ucx-utils iproute2 procps
      python3 python3-pytest python3-numpy python3-torch python3-aiohttp pycodestyle clang-format scdoc man-db groff-base perftest prometheus
      # the wheel (tools/wheel), the Debian package (debian/, tools/deb), the images and pods (tests/deploy)
      python3-venv python3-mesonpy python3-build patchelf debhelper dh-python dpkg-dev lintian systemd-container
      podman runc catatonit containernetworking-plugins golang-github-containernetworking-plugin-dnsname debootstrap
      # NIXL built offline (tools/nixl/build.sh) and the NIXL backend against it (tests/nixl); never libabsl-dev
      g++ python3-dev pybind11-dev libasio-dev xz-utils)
[ -n "${KVSTAGE_EXTRA_PKGS:-}" ] && PKGS+=(${KVSTAGE_EXTRA_PKGS})

missing=()
for p in "${PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null ||
      { echo "setup: ${missing[*]} must be installed: run this as root, or install sudo" >&2; exit 1; }
    SUDO="sudo"
  fi
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Every optional part (meson_options.txt) enabled: CI builds and tests them
# all, and a missing library stops the configure, naming its package.
FEATURES=(-Dverbs=enabled -Dmetrics=enabled -Dsystemd=enabled -Dacl=enabled)
if [ -f build/build.ninja ]; then
  meson configure build "${FEATURES[@]}"
else
  # Quiet when it works, whole when it fails (meson writes errors to stdout).
  if ! meson setup build --buildtype=debugoptimized "${FEATURES[@]}" > build-setup.log 2>&1; then
    cat build-setup.log
    [ -f build/meson-logs/meson-log.txt ] && tail -n 40 build/meson-logs/meson-log.txt
    echo "setup: meson setup failed (above)"
    exit 1
  fi
fi
ninja -C build
