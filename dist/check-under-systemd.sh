#!/bin/sh
# SPDX-License-Identifier: MIT
# The installed unit under a real systemd, where systemd is not PID 1 (a
# container, a CI VM): a manual check, root only, not in the test suites.
# It runs systemd as PID 1 of new pid, mount, uts, net and cgroup
# namespaces (a child cgroup of the host's cgroup2 mount, removed after;
# /etc overlaid; /run, /proc/sys and /sys private or read-only), with only
# the units it needs, and checks what the unit promises:
#  - sysusers.d and tmpfiles.d make the kvstage user and /etc/kvstage;
#  - the unit starts (Type=notify: active only after READY=1, StatusText
#    from kvstaged's STATUS), with the credential accepted, the pool locked,
#    --listen on loopback: every hardening setting applied;
#  - root and a member of group kvstage get a room through; others are
#    refused;
#  - systemctl stop with a room open: the drain aborts it after the grace
#    and kvstaged exits 0 well within TimeoutStopSec (STATUS=draining);
#  - a crash is restarted; a bad config (exit 2) and a missing secret (243)
#    are not.
# Usage: check-under-systemd.sh BUILD_DIR. Exit 0: all passed; 1: says what.
set -u

build=${1:?usage: check-under-systemd.sh BUILD_DIR}
build=$(cd "$build" && pwd) || exit 1
src=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "FAIL: needs root (namespaces, mounts, a cgroup)" >&2; exit 1; }
for t in meson python3 unshare nsenter setpriv cc; do
	command -v $t >/dev/null 2>&1 || { echo "FAIL: $t not found" >&2; exit 1; }
done
sd=
for d in /lib/systemd /usr/lib/systemd; do
	[ -x $d/systemd ] && [ -f $d/system/sysinit.target ] && { sd=$d; break; }
done
[ -n "$sd" ] || { echo "FAIL: no systemd (apt install systemd)" >&2; exit 1; }
cg=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
[ -n "$cg" ] || { echo "FAIL: no cgroup2 mount to make a child cgroup in" >&2; exit 1; }

work=$(mktemp -d /tmp/kvstage-systemd.XXXXXX) || exit 1
cgdir=$cg/kvstage-check.$$
outer=
pid1=
failed=0
cleanup() {
	if [ -n "$outer" ]; then
		# PID 1 of the namespace first: everything in it dies with it.
		[ -n "$pid1" ] && kill -9 "$pid1" 2>/dev/null
		wait "$outer" 2>/dev/null
	fi
	n=0 # the cgroups go once the last process in them is gone
	while [ -d "$cgdir" ] && [ $n -lt 50 ]; do
		find "$cgdir" -depth -type d -exec rmdir {} \; 2>/dev/null
		n=$((n + 1))
		[ -d "$cgdir" ] && sleep 0.1
	done
	[ -d "$cgdir" ] && echo "warning: could not remove $cgdir" >&2
	rm -rf "$work"
}
trap cleanup EXIT
fail() {
	echo "FAIL: $*" >&2
	failed=1
}

dest=$work/dest
meson install -C "$build" --destdir "$dest" --no-rebuild --quiet || exit 1
eval "$(meson introspect --buildoptions "$build" | python3 -c '
import json, sys
o = {x["name"]: x["value"] for x in json.load(sys.stdin)}
p = o["prefix"]
print("prefix=%s libdir=%s/%s bindir=%s/%s" % (p, p, o["libdir"], p, o["bindir"]))')"
unitdir=$(meson introspect --installed "$build" | python3 -c '
import json, os, sys
print("".join(os.path.dirname(d) for d in json.load(sys.stdin).values() if d.endswith("/kvstaged.service")))')
case $unitdir in "$prefix"/*) ;; *) echo "FAIL: the unit ($unitdir) is not under $prefix" >&2; exit 1 ;; esac

# Clients: check-install.c, and one that holds a room open until it ends.
inc=$dest$prefix/include
cc -o "$work/client" "$src/dist/check-install.c" -I"$inc" "$dest$libdir/libkvstage.a" || exit 1
cat >"$work/holder.c" <<'EOF'
#include <kvstage.h>
#include <stdio.h>
int main(int argc, char **argv)
{
	kvs_client *c;
	kvs_room *r;
	struct kvs_room_desc d;
	struct kvs_event ev;
	if (argc != 2 || kvs_connect(argv[1], &c) || kvs_recv_open(c, 1000, 1, &r, &d))
		return 1;
	printf("open\n");
	fflush(stdout);
	if (kvs_wait(c, &ev, 60000) != 1)
		return 2;
	printf("%s %d\n", ev.type == KVS_EV_ABORTED ? "aborted" : "other", ev.status);
	return 0;
}
EOF
cc -o "$work/holder" "$work/holder.c" -I"$inc" "$dest$libdir/libkvstage.a" || exit 1

# Units: ours (installed), the targets a service needs, one that pulls it in,
# and a drop-in that sends its output to a file (no journald here).
mkdir -p "$work/units/kvstaged.service.d"
for u in sysinit.target basic.target shutdown.target; do cp "$sd/system/$u" "$work/units/"; done
printf '[Unit]\nWants=kvstaged.service\nAfter=kvstaged.service\n' >"$work/units/kvs-check.target"
printf '[Service]\nStandardOutput=append:%s/kvstaged.log\nStandardError=inherit\n' "$work" \
	>"$work/units/kvstaged.service.d/log.conf"

cat >"$work/inner.sh" <<EOF
#!/bin/sh
set -e
mount -t proc proc /proc
mount --bind /proc/sys /proc/sys; mount -o remount,bind,ro /proc/sys
mount -t tmpfs -o mode=755 tmpfs /run
mount --bind /sys /sys; mount -o remount,bind,ro /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p $work/etc-upper $work/etc-work
mount -t overlay overlay -o lowerdir=/etc,upperdir=$work/etc-upper,workdir=$work/etc-work /etc
mount --bind $dest$prefix $prefix
[ -d /var/log/journal ] && mount -t tmpfs tmpfs /var/log/journal
systemd-sysusers $prefix/lib/sysusers.d/kvstaged.conf
systemd-tmpfiles --create $prefix/lib/tmpfiles.d/kvstaged.conf
head -c 32 /dev/urandom | base64 >/etc/kvstage/peer.secret
chmod 600 /etc/kvstage/peer.secret
sed -e 's/^#slots = .*/slots = 8/' -e 's/^#slot-size = .*/slot-size = 64K/' \
	-e 's/^#listen = .*/listen = 127.0.0.1:0/' $prefix/share/doc/kvstage/kvstaged.conf.example \
	>/etc/kvstage/kvstaged.conf
chgrp kvstage /etc/kvstage/kvstaged.conf
chmod 0640 /etc/kvstage/kvstaged.conf
# As a system's PID 1 makes it (systemd leaves it to container managers):
# mounts shared, so credential mounts reach the service's namespace.
mount --make-rshared /
exec env -i container=other SYSTEMD_UNIT_PATH=$work/units:$unitdir $sd/systemd --system --unit=kvs-check.target
EOF
chmod +x "$work/inner.sh"

mkdir "$cgdir" || exit 1
unshare --mount --propagation private --pid --net --uts --fork \
	sh -c 'echo $$ >"$1/cgroup.procs" && exec unshare --cgroup "$2"' sh "$cgdir" "$work/inner.sh" \
	>"$work/systemd.log" 2>&1 &
outer=$!
n=0
while [ -z "$pid1" ] && [ $n -lt 100 ]; do
	pid1=$(cat "/proc/$outer/task/$outer/children" 2>/dev/null | tr -d ' ')
	n=$((n + 1))
	sleep 0.1
done
[ -n "$pid1" ] || { echo "FAIL: systemd did not start:" >&2; cat "$work/systemd.log" >&2; exit 1; }
in_ns() {
	nsenter -t "$pid1" -m -p -n -u "$@"
}
prop() {
	in_ns systemctl show kvstaged -p "$1" --value 2>/dev/null
}
# Until the service settles in want (active, failed, inactive).
settle() {
	n=0
	until [ "$(prop ActiveState)" = "$1" ] || [ $n -ge 150 ]; do
		n=$((n + 1))
		sleep 0.2
	done
	[ "$(prop ActiveState)" = "$1" ]
}

sock=/run/kvstage/kvstaged.sock
if ! settle active; then
	fail "kvstaged.service is $(prop ActiveState) ($(prop Result), exit $(prop ExecMainStatus)):
$(cat "$work/systemd.log" "$work/kvstaged.log" 2>/dev/null | tail -n 30)"
else
	st=$(prop StatusText)
	[ "$st" = "serving $sock: 8 slots x 64 KiB" ] || fail "StatusText '$st'"
	grep -q 'pool (hugepages [a-z]*, locked)' "$work/kvstaged.log" ||
		fail "the pool is not locked (LimitMEMLOCK=):
$(cat "$work/kvstaged.log")"
	grep -q 'tcp: listening' "$work/kvstaged.log" || fail "no tcp listener (the credential?)"
	echo "ok: kvstaged.service active: $st"
	# The sandbox is there: no new privileges, a seccomp filter, no
	# capability, a read-only /etc and /usr in its mount namespace.
	main=$(prop MainPID)
	status=$(in_ns cat "/proc/$main/status")
	for want in 'NoNewPrivs:	1' 'Seccomp:	2' 'CapEff:	0000000000000000' 'CapBnd:	0000000000000000'; do
		printf '%s\n' "$status" | grep -q "^$want\$" || fail "kvstaged's /proc status lacks '$want'"
	done
	for d in /etc /usr; do
		if in_ns nsenter -t "$main" -m touch "$d/.kvstage-probe" 2>/dev/null; then
			in_ns nsenter -t "$main" -m rm -f "$d/.kvstage-probe"
			fail "$d is writable in kvstaged's mount namespace (ProtectSystem=strict?)"
		fi
	done
	[ $failed -eq 0 ] && echo "ok: sandboxed: NoNewPrivs, seccomp, no capabilities, /etc and /usr read-only"

	out=$(in_ns "$work/client" $sock 2>&1) || fail "a client as root: $out"
	gid=$(in_ns getent group kvstage | cut -d: -f3)
	out=$(in_ns setpriv --reuid=65534 --regid=65534 --groups="$gid" "$work/client" $sock 2>&1) ||
		fail "a client in group kvstage: $out"
	if out=$(in_ns setpriv --reuid=65534 --regid=65534 --clear-groups "$work/client" $sock 2>&1); then
		fail "a client outside group kvstage got in"
	fi
	[ $failed -eq 0 ] && echo "ok: root and group kvstage get rooms through, others are refused"

	in_ns "$work/holder" $sock >"$work/holder.out" 2>&1 &
	holder=$!
	n=0
	until grep -q open "$work/holder.out" || [ $n -ge 100 ]; do n=$((n + 1)); sleep 0.1; done
	t0=$(date +%s)
	in_ns systemctl stop kvstaged
	t1=$(date +%s)
	wait $holder
	st=$(prop StatusText)
	if [ "$(prop Result)" != success ] || [ "$(prop ExecMainStatus)" != 0 ] ||
		! grep -q '^aborted -108$' "$work/holder.out" || [ $((t1 - t0)) -ge 30 ]; then
		fail "stop with a room open: $(prop Result), exit $(prop ExecMainStatus), $((t1 - t0)) s, the room: $(cat "$work/holder.out")"
	fi
	case $st in draining:*) ;; *) fail "StatusText after the drain began: '$st'" ;; esac
	[ $failed -eq 0 ] && echo "ok: stop drains (a held room aborted after the grace), exit 0 in $((t1 - t0)) s; status '$st'"

	in_ns systemctl start kvstaged
	in_ns kill -SEGV "$(prop MainPID)"
	n=0
	until [ "$(prop NRestarts)" = 1 ] && [ "$(prop ActiveState)" = active ] || [ $n -ge 100 ]; do
		n=$((n + 1))
		sleep 0.1
	done
	[ "$(prop NRestarts)" = 1 ] && [ "$(prop ActiveState)" = active ] ||
		fail "a crash was not restarted: $(prop ActiveState), $(prop NRestarts) restarts"
	in_ns sh -c 'echo "slots = 0" >>/etc/kvstage/kvstaged.conf'
	in_ns systemctl restart kvstaged 2>/dev/null
	settle failed
	[ "$(prop ExecMainStatus)" = 2 ] && [ "$(prop NRestarts)" = 0 ] ||
		fail "a bad config: $(prop ActiveState), exit $(prop ExecMainStatus), $(prop NRestarts) restarts"
	in_ns sh -c 'sed -i "/^slots = 0$/d" /etc/kvstage/kvstaged.conf; rm /etc/kvstage/peer.secret'
	in_ns systemctl reset-failed kvstaged
	in_ns systemctl start kvstaged 2>/dev/null
	settle failed
	[ "$(prop ExecMainStatus)" = 243 ] && [ "$(prop NRestarts)" = 0 ] ||
		fail "no peer secret: $(prop ActiveState), exit $(prop ExecMainStatus), $(prop NRestarts) restarts"
	[ $failed -eq 0 ] && echo "ok: a crash is restarted; a bad config (exit 2) and a missing secret (243) are not"

	# The fallback dist/README.md gives for systemd whose credentials carry
	# ACLs: the secret file itself, kvstage's, 0400, named by a drop-in.
	in_ns sh -c "set -e
		head -c 32 /dev/urandom | base64 >/etc/kvstage/peer.secret
		chown kvstage:kvstage /etc/kvstage/peer.secret
		chmod 0400 /etc/kvstage/peer.secret
		mkdir -p /etc/systemd/system/kvstaged.service.d
		printf '[Service]\nLoadCredential=\nExecStart=\nExecStart=%s --config /etc/kvstage/kvstaged.conf --peer-secret-file /etc/kvstage/peer.secret\n' \
			$bindir/kvstaged >/etc/systemd/system/kvstaged.service.d/secret-file.conf
		systemctl daemon-reload
		systemctl reset-failed kvstaged"
	: >"$work/kvstaged.log"
	in_ns systemctl start kvstaged 2>/dev/null
	if settle active && grep -q 'tcp: listening' "$work/kvstaged.log"; then
		echo "ok: the secret-file drop-in: active, $(prop StatusText)"
	else
		fail "the secret-file drop-in: $(prop ActiveState), exit $(prop ExecMainStatus):
$(cat "$work/kvstaged.log")"
	fi
fi

[ $failed -eq 0 ] || exit 1
echo "ok: kvstaged.service under systemd $($sd/systemd --version | head -n 1 | cut -d' ' -f2)"
