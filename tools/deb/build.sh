#!/usr/bin/env bash
# Builds kvstage's Debian packages (debian/) from a clean copy of this tree,
# checks them with lintian, and leaves them in OUTDIR.
#
# Usage: tools/deb/build.sh OUTDIR
#
# The copy holds the files git tracks plus the untracked ones it does not
# ignore (git ls-files -co --exclude-standard), so uncommitted work is in the
# packages but build/ and other outputs are not. It is built in a temp dir
# because dpkg-buildpackage writes its results next to the source dir.
# OUTDIR gets the four .debs, the .changes, the .buildinfo, build.log and
# lintian.txt, and the debug symbols' packages in OUTDIR/dbgsym/ (out of
# the way of "apt install OUTDIR/*.deb"). Earlier builds' files of these
# packages in OUTDIR are removed first, so that apt sees one version.
# Progress goes to stderr; the .deb paths, one a line, to stdout. Exits 1 if
# the build deps are missing, the build fails, or lintian reports any error
# (E:).
set -euo pipefail
export PATH="/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}"
export LC_ALL=C.UTF-8

say() { echo "deb-build: $*" >&2; }
die() { say "$*"; exit 1; }

[ $# -eq 1 ] || die "usage: tools/deb/build.sh OUTDIR"
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/../.."

for tool in git dpkg-buildpackage dpkg-checkbuilddeps dpkg-parsechangelog lintian; do
  command -v "$tool" >/dev/null || die "$tool not found: apt-get install git dpkg-dev lintian"
done
# dpkg-checkbuilddeps names what debian/control asks for and this host
# lacks; say it as the apt command that fixes it.
if ! unmet=$(dpkg-checkbuilddeps 2>&1); then
  say "$unmet"
  pkgs=$(printf '%s\n' "$unmet" | sed -n 's/.*Unmet build dependencies: //p' |
         sed 's/([^)]*)//g; s/\[[^]]*\]//g; s/<[^>]*>//g; s/ *| *[^ ]*//g; s/:any//g' | tr -s ' ')
  die "install them: apt-get install --no-install-recommends build-essential ${pkgs}"
fi

version=$(dpkg-parsechangelog -S Version)
arch=$(dpkg --print-architecture)
t0=$(date +%s)
tmp=$(mktemp -d /tmp/kvstage-deb.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
src="$tmp/kvstage-$version"
mkdir "$src"
# -c lists tracked files deleted in the work tree too: copy what exists.
git ls-files -z -co --exclude-standard |
  while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
  done |
  tar --null -T - -cf - | tar -xf - -C "$src"
say "copied $(git ls-files -co --exclude-standard | wc -l) files to $src"

# debhelper builds with one job unless DEB_BUILD_OPTIONS says more.
case " ${DEB_BUILD_OPTIONS:-} " in
  *" parallel="*) ;;
  *) DEB_BUILD_OPTIONS="${DEB_BUILD_OPTIONS:+$DEB_BUILD_OPTIONS }parallel=$(nproc)"
     export DEB_BUILD_OPTIONS ;;
esac
say "dpkg-buildpackage -b -us -uc (kvstage $version, $arch, DEB_BUILD_OPTIONS=$DEB_BUILD_OPTIONS)"
if ! (cd "$src" && dpkg-buildpackage -b -us -uc) > "$tmp/build.log" 2>&1; then
  tail -n 60 "$tmp/build.log" >&2
  cp "$tmp/build.log" "$out/build.log"
  die "dpkg-buildpackage failed (above; whole log: $out/build.log)"
fi
t1=$(date +%s)
# werror is off in debian/rules: warnings would not stop the build, so count them here.
warnings=$(grep -c 'warning:' "$tmp/build.log" || true)
say "built in $((t1 - t0)) s; compiler and tool warnings in the log: $warnings"

changes="$tmp/kvstage_${version}_${arch}.changes"
[ -f "$changes" ] || die "no $changes"
# Debian names debug symbols' packages PKG-dbgsym_*.deb (Ubuntu: .ddeb).
sed -n '/^Files:/,/^[^ ]/s/^ .* \([^ ]*\.d\{0,1\}deb\)$/\1/p' "$changes" > "$tmp/files"
mapfile -t debs < <(grep -v -- '-dbgsym_' "$tmp/files" || true)
mapfile -t dbgsyms < <(grep -- '-dbgsym_' "$tmp/files" || true)
[ ${#debs[@]} -gt 0 ] || die "no .deb in $changes"

# Every tag lintian has (errors, warnings, info, pedantic), so nothing hides;
# only errors fail the build.
# As root, lintian runs as nobody: it warns about root, and needs no privilege.
as_user=()
if [ "$(id -u)" -eq 0 ] && command -v runuser >/dev/null; then
  chmod 755 "$tmp"
  as_user=(runuser -u nobody -- env HOME="$tmp")
fi
# Overridden tags are shown too (O:, after their reasons, N:).
say "lintian $(basename "$changes")"
lrc=0
(cd "$tmp" && "${as_user[@]}" lintian --display-info --pedantic --show-overrides "$changes") \
  > "$tmp/lintian.txt" 2>&1 || lrc=$?
cat "$tmp/lintian.txt" >&2
# 1 is "errors found" (judged below); anything else, or a package it
# skipped, is lintian failing to check.
if [ "$lrc" -gt 1 ] || grep -q -e '^Skipping' -e 'No packages selected' "$tmp/lintian.txt"; then
  die "lintian did not check the packages (exit $lrc; above)"
fi
grep -q '^[EWIP]: ' "$tmp/lintian.txt" || say "lintian: no tags but overridden ones"

for pkg in kvstage libkvstage0 libkvstage-dev python3-kvstage; do
  rm -f "$out/${pkg}_"*.deb "$out/dbgsym/${pkg}-dbgsym_"*.*deb
done
rm -f "$out/kvstage_"*.changes "$out/kvstage_"*.buildinfo
cp "$changes" "$tmp/kvstage_${version}_${arch}.buildinfo" "$tmp/build.log" "$tmp/lintian.txt" "$out/"
for d in "${debs[@]}"; do cp "$tmp/$d" "$out/"; done
if [ ${#dbgsyms[@]} -gt 0 ]; then
  mkdir -p "$out/dbgsym"
  for d in "${dbgsyms[@]}"; do cp "$tmp/$d" "$out/dbgsym/"; done
fi

if grep -q '^E: ' "$tmp/lintian.txt"; then
  die "lintian reports errors (E: above; also in $out/lintian.txt)"
fi
say "done in $(($(date +%s) - t0)) s"
for d in "${debs[@]}"; do echo "$out/$d"; done
