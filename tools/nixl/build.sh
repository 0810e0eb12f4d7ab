#!/bin/bash
# Builds NIXL offline from subprojects/ into a prefix keyed by its inputs (docs/nixl.md).
#   tools/nixl/build.sh [-j N] [--force] [--keep-build] [--workdir DIR] [PREFIX]
#   tools/nixl/build.sh --print-prefix
# NIXL 1.4.0 (github.com/ai-dynamo/nixl 8770b655a6b1) and the wraps it takes from us (Abseil
# 20250814.1, toml++ 3.4.0, Taskflow 3.10.0) come from subprojects/packagecache/ with meson's
# --wrap-mode=nodownload; everything else from Debian 12 (apt): no network. Built: libnixl and
# its libraries, the POSIX plugin, the Python package, examples/cpp/nixl_example, the headers,
# and what an out-of-tree plugin compiles against (install-extras.sh: nixl-plugin.pc, NIXL's
# source headers, Abseil's headers and archives). Not built: other plugins (UCX, GDS, ...),
# NIXL's tests, nixlbench. CUDA is hidden from the build (a CPU-only NIXL).
#
# PREFIX defaults to /var/cache/kvstage-ci/nixl-<hash>; <hash> covers the wraps, their tarballs
# and packagefiles, these scripts, and the Debian packages the build uses (their versions). A
# PREFIX holding a finished install of the same hash is reused (nothing built; --force rebuilds);
# one of another hash is refused. The install is staged and moved into PREFIX at the end:
# PREFIX is complete or absent. PREFIX/kvstage-nixl.env sets what later steps need
# (PKG_CONFIG_PATH, LD_LIBRARY_PATH, PYTHONPATH, NIXL_PREFIX, NIXL_EXAMPLE, ...). Progress goes
# to stderr: a line a step, and a compile line every 20 steps or 30 s; on failure the logs' last lines, and the
# scratch directory (--workdir, default /var/tmp/kvstage-nixl-build) is kept.
set -euo pipefail
# Debian's tools only (a pyenv python breaks meson), nothing of the caller's build flags.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
unset PKG_CONFIG_PATH PKG_CONFIG_LIBDIR PKG_CONFIG_SYSROOT_DIR
umask 022

ME=kvstage-nixl
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SUB=$(cd "$HERE/../.." && pwd)/subprojects
NIXL_COMMIT=8770b655a6b17b5cdf7d2b56b6e0be5392496df5
NIXL_VERSION=1.4.0
# our wraps in NIXL's subprojects/; its other wraps removed (asio: Debian's libasio-dev with
# the asio.pc written below; liburing: Debian's liburing-dev if installed, else the POSIX
# plugin goes without io_uring; prometheus-cpp: the telemetry exporter, not built)
WRAPS="abseil-cpp tomlplusplus taskflow"
DROP_WRAPS="asio liburing prometheus-cpp"
# what the build uses from Debian 12; their versions are part of the hash
DEBS="g++ meson ninja-build pkg-config python3-dev pybind11-dev libasio-dev xz-utils"

say() { printf '%s: %s\n' "$ME" "$*" >&2; }
die() { printf '%s: error: %s\n' "$ME" "$*" >&2; exit 1; }

JOBS=$(nproc 2>/dev/null || echo 1)
[ "$JOBS" -le 2 ] || JOBS=2
WORKDIR=/var/tmp/kvstage-nixl-build
KEEP=0 FORCE=0 PRINT=0 PREFIX=
while [ $# -gt 0 ]; do
	case $1 in
	-j | --jobs) [ $# -ge 2 ] || die "$1 needs a number"; JOBS=$2; shift ;;
	--workdir) [ $# -ge 2 ] || die "$1 needs a directory"; WORKDIR=$2; shift ;;
	--keep-build) KEEP=1 ;;
	--force) FORCE=1 ;;
	--print-prefix) PRINT=1 ;;
	-h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	-*) die "unknown option $1 (--help)" ;;
	*) [ -z "$PREFIX" ] || die "one PREFIX only"; PREFIX=$1 ;;
	esac
	shift
done
case $JOBS in '' | *[!0-9]* | 0) die "-j wants a positive number, not '$JOBS'" ;; esac

# ---- inputs, their hash, the prefix --------------------------------------------------
wrap_key() { sed -n "s/^$2 *= *//p" "$SUB/$1.wrap"; }
for w in nixl $WRAPS; do
	[ -f "$SUB/$w.wrap" ] || die "missing subprojects/$w.wrap (is this a complete kvstage checkout?)"
done
debs() { for p in $DEBS liburing-dev; do echo "$p $(dpkg-query -W -f='${Version}' "$p" 2>/dev/null || echo none)"; done; }
INPUT_HASH=$({
	for w in nixl $WRAPS; do echo "== $w.wrap"; cat "$SUB/$w.wrap"; done
	(cd "$SUB" && find packagefiles -type f | LC_ALL=C sort | xargs sha256sum)
	sha256sum "$HERE/build.sh" "$HERE/install-extras.sh" | cut -c1-64
	debs
	uname -m
} | sha256sum | cut -c1-12)
DEFAULT_PREFIX=/var/cache/kvstage-ci/nixl-$INPUT_HASH
if [ $PRINT = 1 ]; then echo "$DEFAULT_PREFIX"; exit 0; fi
PREFIX=${PREFIX:-$DEFAULT_PREFIX}
case $PREFIX in /*) ;; *) PREFIX=$PWD/$PREFIX ;; esac
PREFIX=${PREFIX%/}
[ -n "$PREFIX" ] || die "PREFIX must not be /"

MARKER=$PREFIX/.kvstage-nixl-inputs
if [ -f "$MARKER" ]; then
	old=$(sed -n 's/^hash //p' "$MARKER")
	if [ "$old" = "$INPUT_HASH" ] && [ -f "$PREFIX/kvstage-nixl.env" ] && [ $FORCE = 0 ]; then
		say "NIXL ${NIXL_COMMIT:0:12} of these inputs ($INPUT_HASH) is already in $PREFIX: not rebuilt (--force rebuilds)"
		echo "$PREFIX"
		exit 0
	fi
	[ "$old" = "$INPUT_HASH" ] || [ $FORCE = 1 ] ||
		die "$PREFIX holds a NIXL of other inputs ($old, now $INPUT_HASH): --force replaces it, or give another PREFIX"
elif [ -e "$PREFIX" ]; then
	[ -d "$PREFIX" ] && [ -z "$(ls -A "$PREFIX")" ] ||
		die "$PREFIX exists and is not an empty directory nor an install of this script"
fi

# ---- what the build needs from Debian 12 ---------------------------------------------
missing=
for p in $DEBS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; done
[ -z "$missing" ] || die "Debian packages missing:$missing; install them with: apt-get install -y$missing (or run tools/setup.sh)"
if pkg-config --exists absl_base; then
	die "a system Abseil is installed (pkg-config absl_base $(pkg-config --modversion absl_base)): NIXL then refuses its own (Debian 12's lacks absl_log); apt-get remove libabsl-dev, then run again"
fi
for w in nixl $WRAPS; do
	t=$(wrap_key "$w" source_filename)
	(cd "$SUB/packagecache" && echo "$(wrap_key "$w" source_hash)  $t" | sha256sum -c --quiet >/dev/null 2>&1) ||
		die "subprojects/packagecache/$t is missing or does not match subprojects/$w.wrap's source_hash"
done

# ---- scratch directory ---------------------------------------------------------------
mkdir -p "$WORKDIR" || die "cannot create the workdir $WORKDIR"
W=$(cd "$WORKDIR" && pwd)/$INPUT_HASH-$$
SRC=$W/$(wrap_key nixl directory)
BUILD=$W/build
STEP=start LOG=
T0=$(date +%s)
on_exit() {
	local rc=$?
	if [ $rc -ne 0 ]; then
		say "FAILED during: $STEP (exit $rc); the scratch directory $W is kept"
		[ -z "$LOG" ] || [ ! -f "$LOG" ] || { say "---- the last lines of $LOG"; tail -n 25 "$LOG" >&2; }
	elif [ $KEEP = 0 ]; then
		rm -rf "$W"
	fi
}
trap on_exit EXIT
rm -rf "$W"
mkdir -p "$W/logs" "$W/pkgconfig" "$W/stage"
exec </dev/null
# step WHAT [LOG]: says what runs now and where its log is; a failure shows that log's end
step() {
	STEP=$1 LOG=${2:+$W/logs/$2}
	say "$(($(date +%s) - T0)) s: $1${LOG:+ (log: $LOG)}"
}

say "NIXL $NIXL_VERSION (${NIXL_COMMIT:0:12}), inputs $INPUT_HASH, into $PREFIX, $JOBS jobs, scratch $W"
step "unpacking NIXL and placing its wraps ($WRAPS from subprojects/; dropping $DROP_WRAPS)"
tar -C "$W" -xJf "$SUB/packagecache/$(wrap_key nixl source_filename)"
[ -f "$SRC/meson.build" ] || die "the NIXL tarball did not unpack into $SRC"
mkdir -p "$SRC/subprojects/packagecache" "$SRC/subprojects/packagefiles"
for w in $WRAPS; do
	cp "$SUB/$w.wrap" "$SRC/subprojects/"
	cp "$SUB/packagecache/$(wrap_key "$w" source_filename)" "$SRC/subprojects/packagecache/"
done
for d in "$SUB"/packagefiles/*/; do
	rm -rf "$SRC/subprojects/packagefiles/$(basename "$d")"
	cp -r "$d" "$SRC/subprojects/packagefiles/"
done
for w in $DROP_WRAPS; do rm -f "$SRC/subprojects/$w.wrap"; done

# Debian's libasio-dev has no asio.pc; NIXL asks pkg-config for it.
v=$(sed -n 's|^#define ASIO_VERSION \([0-9]*\).*|\1|p' /usr/include/asio/version.hpp)
[ -n "$v" ] || die "no ASIO_VERSION in /usr/include/asio/version.hpp"
printf 'Name: asio\nDescription: Debian libasio-dev (headers)\nVersion: %s\nCflags:\n' \
	"$((v / 100000)).$((v / 100 % 1000)).$((v % 100))" >"$W/pkgconfig/asio.pc"

# What meson sees: no user flags, our asio.pc, no CUDA (NIXL has no option to turn it off:
# CUDA_PATH/CUDA_HOME name a directory that does not exist, so /usr/local/cuda is not taken),
# and no git repository above the scratch directory (NIXL's version string asks git).
NOCUDA=$W/no-cuda-here
run_env=(env -u CFLAGS -u CXXFLAGS -u CPPFLAGS -u LDFLAGS -u CC -u CXX -u CUDA_ROOT
	-u PYTHONPATH -u PYTHONHOME -u LD_LIBRARY_PATH -u MESON_PACKAGE_CACHE_DIR
	PKG_CONFIG_PATH="$W/pkgconfig" CUDA_PATH="$NOCUDA" CUDA_HOME="$NOCUDA"
	GIT_CEILING_DIRECTORIES="$W" LC_ALL=C.UTF-8)
PYSITE=$PREFIX/lib/python3/dist-packages

step "meson setup" setup.log
"${run_env[@]}" meson setup "$BUILD" "$SRC" --prefix="$PREFIX" --libdir=lib --buildtype=release \
	--wrap-mode=nodownload -Dforce_fallback_for=tomlplusplus -Dwerror=false -Denable_plugins=POSIX \
	-Dbuild_tests=false -Dbuild_examples=true -Dinstall_headers=true -Drust=false -Dbuild_docs=false \
	-Dpython.platlibdir="$PYSITE" -Dpython.purelibdir="$PYSITE" >"$W/logs/setup.log" 2>&1 ||
	die "meson setup failed (log: $W/logs/setup.log, and $BUILD/meson-logs/meson-log.txt)"
grep -q 'Abseil source *: *subproject' "$W/logs/setup.log" || die "NIXL did not take the Abseil subproject"
! grep -q -E 'nvcc version|Found CUDA' "$W/logs/setup.log" || die "meson found CUDA although it is hidden"
sed -n '/^nixl [0-9]/,/User defined options/p' "$W/logs/setup.log" | sed '$d; /^ *$/d; s/^/    /' >&2

step "compiling: ninja -j$JOBS" compile.log
"${run_env[@]}" ninja -C "$BUILD" -j "$JOBS" 2>&1 | tee "$W/logs/compile.log" |
	awk -v me="$ME" '
		/^\[[0-9]+\/[0-9]+\]/ { split(substr($1, 2), a, /[\/\]]/); now = systime()
			if (n++ % 20 == 0 || a[1] == a[2] || now - t >= 30) {
				printf "%s:   [%s/%s] %s\n", me, a[1], a[2], $NF; fflush(); t = now }
			next }
		/error|FAILED/ { print; fflush() }' >&2

step "meson install into the staging directory" install.log
"${run_env[@]}" DESTDIR="$W/stage" meson install -C "$BUILD" --no-rebuild >"$W/logs/install.log" 2>&1
STAGED=$W/stage$PREFIX
[ -f "$STAGED/lib/libnixl.so" ] || die "meson install left no lib/libnixl.so in $STAGED"

step "adding the Python 'nixl' package, plugin headers, Abseil archives, .pc and env files" extras.log
"${run_env[@]}" bash "$HERE/install-extras.sh" "$SRC" "$BUILD" "$STAGED" "$PREFIX" \
	"$(wrap_key abseil-cpp directory)" "$NIXL_COMMIT" "$NIXL_VERSION" "$INPUT_HASH" >"$W/logs/extras.log" 2>&1

step "moving the install into $PREFIX"
mkdir -p "$(dirname "$PREFIX")"
rm -rf "$PREFIX.new-$$" "$PREFIX.old-$$"
mv "$STAGED" "$PREFIX.new-$$" 2>/dev/null || cp -a "$STAGED" "$PREFIX.new-$$"
[ ! -e "$PREFIX" ] || mv -T "$PREFIX" "$PREFIX.old-$$"
mv -T "$PREFIX.new-$$" "$PREFIX"
rm -rf "$PREFIX.old-$$"

STEP=done
say "NIXL $NIXL_VERSION in $PREFIX, built in $(($(date +%s) - T0)) s; use it with: . $PREFIX/kvstage-nixl.env"
echo "$PREFIX"
