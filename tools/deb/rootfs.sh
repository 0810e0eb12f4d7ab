# shellcheck shell=bash
# Sourced by tools/deb/check-install.sh and check-boot.sh (not run): makes
# a clean bookworm root with the .debs of DEBDIR in it.
#
# Usage: . tools/deb/rootfs.sh; deb_root ROOT DEBDIR [ROOTFS]
#    or: deb_scratch NAME DEBDIR [ROOTFS] (below: a scratch ROOT of its own)
#   ROOT: an empty directory to fill. ROOTFS: a minbase bookworm root, as a
#   directory or a tarball (copied, never changed); default: the newest
#   $KVSTAGE_CI_CACHE/base-*.tar (/var/cache/kvstage-ci,
#   tools/container/base.sh's), else debootstrap --variant=minbase bookworm
#   from $KVSTAGE_DEBIAN_MIRROR (a few minutes).
# Sets debs: the packages' paths inside ROOT (/tmp/debs/...), in the order
# kvstage libkvstage0 libkvstage-dev python3-kvstage. Uses say and die.

deb_root() {
  local root=$1 debdir=$2 rootfs=${3:-} p f
  local mirror=${KVSTAGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
  if [ -z "$rootfs" ]; then
    # shellcheck disable=SC2012 # the cache's names are base-HASH.tar
    rootfs=$(ls -t "${KVSTAGE_CI_CACHE:-/var/cache/kvstage-ci}"/base-*.tar 2>/dev/null | head -1 || true)
  fi
  if [ -z "$rootfs" ]; then
    command -v debootstrap >/dev/null || die "no ROOTFS and no debootstrap: apt-get install debootstrap"
    say "debootstrap --variant=minbase bookworm $root"
    debootstrap --variant=minbase bookworm "$root" "$mirror" > "$root.debootstrap.log" 2>&1 ||
      { tail -20 "$root.debootstrap.log" >&2; die "debootstrap failed"; }
  elif [ -d "$rootfs" ]; then
    say "copying $rootfs"
    cp -a "$rootfs/." "$root/"
  else
    say "unpacking $rootfs"
    tar -xf "$rootfs" -C "$root"
  fi

  mkdir -p "$root/tmp/debs"
  debs=()
  for p in kvstage libkvstage0 libkvstage-dev python3-kvstage; do
    f=$(ls "$debdir/${p}"_*.deb 2>/dev/null) || die "no ${p}_*.deb in $debdir"
    [ "$(echo "$f" | wc -l)" -eq 1 ] || die "more than one ${p}_*.deb in $debdir"
    cp "$f" "$root/tmp/debs/"
    debs+=("/tmp/debs/$(basename "$f")")
  done
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  # A root made for offline use (the container base) has no sources: the archive's.
  if ! grep -qs '^deb ' "$root/etc/apt/sources.list" &&
     [ -z "$(ls "$root/etc/apt/sources.list.d/" 2>/dev/null)" ]; then
    printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
      "$mirror" "$mirror" "http://deb.debian.org/debian-security" > "$root/etc/apt/sources.list"
  fi
}

# deb_scratch NAME DEBDIR [ROOTFS]: deb_root in a new /tmp/kvstage-NAME.*
# directory, removed at exit. Sets tmp, root (its root), debdir (absolute),
# t0 (the start, in seconds) and debs.
deb_scratch() {
  # shellcheck disable=SC2034 # debdir and t0 are the caller's
  debdir=$(cd "$2" && pwd)
  tmp=$(mktemp -d "/tmp/kvstage-$1.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  root=$tmp/root
  mkdir "$root"
  # shellcheck disable=SC2034 # the caller's
  t0=$(date +%s)
  deb_root "$root" "$debdir" "${3:-}"
}
