#!/bin/bash
# Builds kvstage's wheel for an engine's own Python (a venv, a container image) and leaves exactly one
# kvstage-*.whl in OUTDIR, printing its path.
# Usage: tools/wheel/build.sh OUTDIR
# meson-python (pyproject.toml: -Dwheel=true and the optional parts) builds it in build-wheel/ at the
# repository's root, kept between runs so a rebuild is incremental; tools/wheel/repair.py then vendors
# the libraries it links and tags it manylinux (see its --help). Needs Debian's python3-mesonpy,
# python3-build and patchelf, and the build's -dev packages (tools/setup.sh installs them). Progress
# goes to stderr; on failure, the failing step's whole output. Exit 0: built; 1: failed; 2: usage.
set -euo pipefail
# Debian's tools ahead of a caller's (pyenv): meson must find Debian's python3 (tools/setup.sh does the same).
export PATH="/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}"
case ${1:-} in
-h | --help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
'' | -*) echo "usage: tools/wheel/build.sh OUTDIR" >&2; exit 2 ;;
esac
[ $# -eq 1 ] || { echo "usage: tools/wheel/build.sh OUTDIR" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
for t in patchelf ldd; do
	command -v $t >/dev/null || { echo "build.sh: no $t (apt-get install ${t/ldd/libc-bin})" >&2; exit 1; }
done
/usr/bin/python3 -c 'import build, mesonpy' 2>/dev/null ||
	{ echo "build.sh: /usr/bin/python3 lacks build or mesonpy (apt-get install python3-build python3-mesonpy)" >&2; exit 1; }

# meson-python 0.12 reconfigures build-wheel/ when the native file it left in the source root
# (.mesonpy-native-file.ini) is there, and sets it up afresh when not: with only one of the two, the
# first fails (no build tree) and the second finds one already set up; so both go, or neither.
if [ ! -f "$root/build-wheel/meson-private/coredata.dat" ] || [ ! -f "$root/.mesonpy-native-file.ini" ]; then
	rm -rf "$root/build-wheel" "$root/.mesonpy-native-file.ini"
fi
tmp=$(mktemp -d /tmp/kvstage-wheel.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
echo "build.sh: building (meson-python, build dir $root/build-wheel) ..." >&2
if ! /usr/bin/python3 -m build --wheel --no-isolation -C builddir="$root/build-wheel" --outdir "$tmp/raw" \
	"$root" >"$tmp/build.log" 2>&1; then
	cat "$tmp/build.log" >&2
	echo "build.sh: python3 -m build failed (above)" >&2
	exit 1
fi
raw=("$tmp"/raw/kvstage-*.whl)
[ ${#raw[@]} -eq 1 ] && [ -f "${raw[0]}" ] || { echo "build.sh: python3 -m build left no single wheel in $tmp/raw" >&2; exit 1; }
echo "build.sh: vendoring libraries and tagging (repair.py) ..." >&2
if ! whl=$(/usr/bin/python3 "$root/tools/wheel/repair.py" -q "${raw[0]}" "$tmp/fixed" 2>"$tmp/repair.log"); then
	cat "$tmp/repair.log" >&2
	echo "build.sh: repair.py failed (above)" >&2
	exit 1
fi
rm -f "$out"/kvstage-*.whl
mv "$whl" "$out/"
echo "build.sh: done in $((SECONDS - start)) s" >&2
echo "$out/$(basename "$whl")"
