#!/bin/bash
# Downloads, on the host, the Debian packages that installing PKG... (names,
# or paths of .deb files whose dependencies are wanted) needs on top of the
# base image (base.sh), into OUTDIR, and makes OUTDIR a local apt repository
# (a Packages index). A container then installs from it with no network:
#   echo 'deb [trusted=yes] file:/repo ./' > /etc/apt/sources.list
#   apt-get update && apt-get install ./kvstage_*.deb
# which resolves the dependencies exactly as apt would from the archive.
#
# Usage: tools/container/debs.sh OUTDIR PKG|FILE.deb...
# The host's own apt lists are used (apt-get update once first); the closure is
# computed against the base image's dpkg status, not the host's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
out=$1
shift
cache=${KVSTAGE_CI_CACHE:-/var/cache/kvstage-ci}
"$here/base.sh" >/dev/null
key=$(sha256sum "$here/base.sh" | cut -c1-12)
status=$cache/base-$key.status
mkdir -p "$out/partial"
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
cp "$status" "$state/status"
# A .deb's own dependencies: apt takes the file and resolves what it needs.
args=()
for p in "$@"; do
	case $p in *.deb) args+=("$(realpath "$p")") ;; *) args+=("$p") ;; esac
done
apt-get -q -y --no-install-recommends --download-only \
	-o Dir::State::status="$state/status" -o Dir::Cache::archives="$(realpath "$out")" \
	-o Debug::NoLocking=1 -o APT::Get::AllowUnauthenticated=false \
	install "${args[@]}" > "$state/log" 2>&1 || { cat "$state/log" >&2; exit 1; }
rmdir "$out/partial" 2>/dev/null || true
rm -f "$out/lock"
# The .debs given as files are not copied: the test installs them by path.
(cd "$out" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null > Packages)
echo "debs.sh: $(ls "$out"/*.deb 2>/dev/null | wc -l) packages, $(du -sh "$out" | cut -f1), in $out" >&2
