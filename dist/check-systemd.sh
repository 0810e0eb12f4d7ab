#!/bin/sh
# SPDX-License-Identifier: MIT
# Checks the systemd files of dist/ without a running systemd (none is PID 1
# in a container; systemd-analyze and friends work offline):
#  - the configured unit (BUILD_DIR/dist/kvstaged.service) with
#    systemd-analyze verify, on a copy whose ExecStart names the build
#    tree's kvstaged (verify wants the binary to exist), failing on any word
#    about the unit, even those verify itself only warns about (unknown
#    keys, values it ignores);
#  - its hardening with systemd-analyze security --offline: an exposure
#    above 2.0 (of 10) fails, so no setting drops out unnoticed;
#  - kvstaged.sysusers with systemd-sysusers --dry-run, then for real into a
#    scratch root, and kvstaged.tmpfiles with systemd-tmpfiles --create in
#    that root (this systemd has no --dry-run for tmpfiles): /etc/kvstage
#    must come out 0750 root:kvstage;
#  - the example config through kvstaged itself: every commented setting,
#    uncommented, must be a valid option and value.
# Usage: check-systemd.sh BUILD_DIR. Exit 0: all passed; 1: a check failed
# (it says which and why); 77 (skip): only when not root, and it says so.
set -u

build=${1:?usage: check-systemd.sh BUILD_DIR}
build=$(cd "$build" && pwd) || exit 1
src=${KVSTAGE_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
unit=$build/dist/kvstaged.service
kvstaged=$build/proxy/kvstaged
failed=0
skipped=

fail() {
	echo "FAIL: $*" >&2
	failed=1
}

need() {
	command -v "$1" >/dev/null 2>&1 && return 0
	fail "$1 not found: apt install $2 (the dist checks need it)"
	return 1
}

[ -f "$unit" ] || { echo "FAIL: no configured unit at $unit (run ninja -C $build)" >&2; exit 1; }
[ -x "$kvstaged" ] || { echo "FAIL: no kvstaged at $kvstaged (run ninja -C $build)" >&2; exit 1; }

tmp=$(mktemp -d /tmp/kvstage-dist.XXXXXX) || exit 1
trap 'rm -rf "$tmp"' EXIT

# --- the unit ---------------------------------------------------------------
if need systemd-analyze systemd; then
	installed_exec=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$unit")
	case $installed_exec in
	/*/kvstaged) ;;
	*) fail "$unit: ExecStart names '$installed_exec', not an absolute path to kvstaged" ;;
	esac
	if grep -q '@[a-z_]*@' "$unit"; then
		fail "$unit: placeholders left unconfigured: $(grep -o '@[a-z_]*@' "$unit" | sort -u | tr '\n' ' ')"
	fi
	# The copy's name must stay kvstaged.service: verify judges names too.
	mkdir "$tmp/unit"
	sed "s|^ExecStart=$installed_exec |ExecStart=$kvstaged |" "$unit" >"$tmp/unit/kvstaged.service"
	grep -q "^ExecStart=$kvstaged " "$tmp/unit/kvstaged.service" ||
		fail "could not point the copy's ExecStart at $kvstaged"

	# --recursive-errors=no: other units' troubles (the host's) are not ours.
	# Verify exits 0 after parse warnings, so its words count: any line that
	# names our unit fails the check; others are shown as notes.
	out=$(systemd-analyze verify --man=no --recursive-errors=no "$tmp/unit/kvstaged.service" 2>&1)
	rc=$?
	ours=$(printf '%s\n' "$out" | grep 'kvstaged' || true)
	others=$(printf '%s\n' "$out" | grep -v 'kvstaged' | grep . || true)
	[ -n "$others" ] && printf 'note: systemd-analyze verify, about other units:\n%s\n' "$others"
	if [ $rc -ne 0 ] || [ -n "$ours" ]; then
		fail "systemd-analyze verify kvstaged.service (exit $rc):
$ours"
	else
		echo "ok: systemd-analyze verify kvstaged.service"
	fi

	out=$(systemd-analyze security --offline=yes --threshold=20 --no-pager \
		"$tmp/unit/kvstaged.service" 2>&1)
	rc=$?
	level=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for kvstaged.service: \([0-9.]*\).*/\1/p')
	if [ $rc -ne 0 ] || [ -z "$level" ]; then
		fail "systemd-analyze security: exposure ${level:-unknown} is above 2.0 (exit $rc); what it says:
$(printf '%s\n' "$out" | grep '✗')"
	else
		echo "ok: systemd-analyze security --offline: exposure $level (at most 2.0)"
	fi
fi

# --- sysusers.d and tmpfiles.d ----------------------------------------------
sysusers=$src/dist/systemd/kvstaged.sysusers
tmpfiles=$src/dist/systemd/kvstaged.tmpfiles
if need systemd-sysusers systemd; then
	out=$(systemd-sysusers --dry-run "$sysusers" 2>&1)
	rc=$?
	if [ $rc -ne 0 ] || printf '%s\n' "$out" | grep -qi 'fail\|invalid\|ignoring'; then
		fail "systemd-sysusers --dry-run $sysusers (exit $rc):
$out"
	else
		echo "ok: systemd-sysusers --dry-run kvstaged.sysusers"
	fi
	root=$tmp/root
	mkdir -p "$root/etc"
	out=$(systemd-sysusers --root="$root" "$sysusers" 2>&1)
	rc=$?
	uid=$(awk -F: '$1 == "kvstage" { print $3 }' "$root/etc/passwd" 2>/dev/null)
	gid=$(awk -F: '$1 == "kvstage" { print $3 }' "$root/etc/group" 2>/dev/null)
	pgid=$(awk -F: '$1 == "kvstage" { print $4 }' "$root/etc/passwd" 2>/dev/null)
	if [ $rc -ne 0 ] || [ -z "$uid" ] || [ -z "$gid" ] || [ "$pgid" != "$gid" ] ||
		[ "$uid" -ge 1000 ] || [ "$uid" -eq 0 ]; then
		fail "systemd-sysusers --root: no kvstage system user with its own group (exit $rc; uid '$uid', gid '$gid', primary '$pgid'):
$out"
	else
		echo "ok: systemd-sysusers makes system user kvstage (uid $uid) and group kvstage (gid $gid)"
		if [ "$(id -u)" -ne 0 ]; then
			echo "SKIP: systemd-tmpfiles --create --root: needs root to give /etc/kvstage its owner"
			skipped=1
		elif need systemd-tmpfiles systemd; then
			out=$(systemd-tmpfiles --create --root="$root" "$tmpfiles" 2>&1)
			rc=$?
			got=$(stat -c '%a %u %g' "$root/etc/kvstage" 2>/dev/null)
			if [ $rc -ne 0 ] || [ -n "$out" ] || [ "$got" != "750 0 $gid" ]; then
				fail "systemd-tmpfiles --create $tmpfiles (exit $rc): /etc/kvstage is '${got:-missing}', want '750 0 $gid' (root:kvstage):
$out"
			else
				echo "ok: systemd-tmpfiles makes /etc/kvstage 0750 root:kvstage"
			fi
		fi
	fi
fi

# --- the example config -----------------------------------------------------
# Uncommented, every "#name = value" line must be a kvstaged option with a
# valid value. Options are checked as they are read, before --help exits;
# kvstage is not a group on a build host: root stands in for it.
example=$src/dist/systemd/kvstaged.conf.example
sed -e 's/^#\([a-z][a-z-]* = \)/\1/' -e 's/^socket-group = kvstage$/socket-group = root/' \
	"$example" >"$tmp/kvstaged.conf"
n=$(grep -c '^[a-z][a-z-]* = ' "$tmp/kvstaged.conf")
out=$("$kvstaged" --config "$tmp/kvstaged.conf" --help 2>&1 >/dev/null)
rc=$?
if [ "$n" -lt 10 ] || [ $rc -ne 0 ]; then
	fail "kvstaged --config (the example's $n settings, uncommented) exits $rc:
$out"
else
	echo "ok: kvstaged takes the example config's $n settings"
fi

[ $failed -ne 0 ] && exit 1
[ -n "$skipped" ] && exit 77
exit 0
