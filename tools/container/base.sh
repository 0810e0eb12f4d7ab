#!/bin/bash
# Makes the base image of kvstage's container tests, a clean Debian 12 with
# only python3, python3-venv, python3-numpy and python3-pytest (nothing of
# kvstage's build), and prints its name. No image registry is reachable: the
# root file system comes from `debootstrap --variant=minbase` off the Debian
# archive (about 1.5 minutes) and is imported with `podman import`.
#
# Usage: tools/container/base.sh          (prints e.g. localhost/kvstage-ci-base:1a2b3c4d5e6f)
#
# The root file system is kept as a tarball in $KVSTAGE_CI_CACHE (default
# /var/cache/kvstage-ci), outside the clone, with its dpkg status beside it
# (debs.sh reads it); a later run imports it again instead of debootstrapping.
# Nothing depends on that cache: without it, this makes it. Its name carries a
# hash of this script, so a change here makes a new one.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
podman=$here/podman
PKGS=python3,python3-venv,python3-numpy,python3-pytest
SUITE=bookworm
MIRROR=${KVSTAGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${KVSTAGE_CI_CACHE:-/var/cache/kvstage-ci}
key=$(sha256sum "$0" | cut -c1-12)
image=localhost/kvstage-ci-base:$key
tarball=$cache/base-$key.tar

if "$podman" image exists "$image"; then
	echo "$image"
	exit 0
fi
mkdir -p "$cache"
if [ ! -s "$tarball" ] || [ ! -s "$cache/base-$key.status" ]; then
	command -v debootstrap >/dev/null || { echo "base.sh: no debootstrap (apt-get install debootstrap)" >&2; exit 1; }
	work=$(mktemp -d "$cache/rootfs.XXXXXX")
	trap 'rm -rf "$work"' EXIT
	echo "base.sh: debootstrap --variant=minbase --include=$PKGS $SUITE (about 1.5 minutes)" >&2
	if ! debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$work/root" "$MIRROR" > "$work/log" 2>&1; then
		tail -n 30 "$work/log" >&2
		[ -f "$work/root/debootstrap/debootstrap.log" ] && tail -n 30 "$work/root/debootstrap/debootstrap.log" >&2
		echo "base.sh: debootstrap failed (above)" >&2
		exit 1
	fi
	# What the image is not: a package cache, index lists from the host's
	# mirror (each test names its own local repository), a machine id.
	rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"* "$work/root/etc/machine-id"
	: > "$work/root/etc/apt/sources.list"
	cp "$work/root/var/lib/dpkg/status" "$work/status"
	tar -C "$work/root" --numeric-owner -cf "$work/base.tar" .
	mv "$work/status" "$cache/base-$key.status"
	mv "$work/base.tar" "$tarball"
fi
echo "base.sh: podman import $tarball" >&2
"$podman" import --quiet \
	--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	--change 'ENV LANG=C.UTF-8' \
	--change 'CMD ["/bin/bash"]' \
	"$tarball" "$image" >/dev/null
echo "$image"
