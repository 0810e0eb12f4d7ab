#!/bin/bash
# Runs inside the qemu guest, chrooted into the host's root (read-only 9p),
# started by the initramfs /init. run.sh copies it into the out share (seen
# here as /run/rxe) next to job.sh, which describes the command to run.
#
# It sets up soft-RoCE and runs the command. What it writes to /run/rxe:
#   stage    how far it got (booted, setup, modules, rxe, running, done)
#   error    why it stopped, when it failed before the command ran
#   output   the command's stdout and stderr
#   status   the command's exit status: written only once the command ran
#   times    guest uptime at the start of the command and at its end
set -euo pipefail

OUT=/run/rxe
stage() {
	echo "$1" >"$OUT/stage"
	echo "rxe-guest: stage $1 at $(cut -d' ' -f1 /proc/uptime) s"
}
fail() {
	echo "$*" >"$OUT/error"
	echo "RXE-GUEST-FAILED: $*"
	echo "rxe-guest: last kernel messages:"
	dmesg | tail -n 30 || true
	exit 1
}
trap 'fail "guest.sh: command failed at line $LINENO: $BASH_COMMAND"' ERR

stage setup
# shellcheck source=/dev/null
. "$OUT/job.sh" # RXE_CWD, RXE_ENV=(), RXE_RW=() ("tag path"), RXE_CMD=()

export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# The root is read-only. /tmp becomes a fresh tmpfs; the host's own /tmp
# stays reachable (read-only) at /run/host-tmp, and a working directory
# under /tmp is bound back at its own path so relative paths keep working.
mkdir -p /run/host-tmp
mount --bind /tmp /run/host-tmp
mount -t tmpfs -o mode=1777 tmpfs /tmp
case "$RXE_CWD/" in
/tmp/*)
	mkdir -p "$RXE_CWD"
	mount --bind "/run/host-tmp/${RXE_CWD#/tmp/}" "$RXE_CWD"
	;;
esac
# Writable host directories asked for with run.sh --rw, at their own paths.
for rw in "${RXE_RW[@]}"; do
	tag=${rw%% *} dir=${rw#* }
	mkdir -p "$dir" 2>/dev/null || true # only possible under /tmp or /run
	mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 "$tag" "$dir" ||
		fail "cannot mount the writable share $dir"
done

stage modules
# rdma_rxe computes its ICRC with the crypto API's "crc32" and asks for it
# only when a link is created; load a provider up front. rdma_ucm brings the
# rdma_cm stack for programs that use librdmacm.
for m in crc32_generic veth ib_uverbs rdma_rxe rdma_ucm; do
	modprobe "$m" || fail "modprobe $m failed"
done

stage rxe
# Everything stays in the initial network namespace: on this kernel an rxe
# device made on a netdev in another namespace does not receive, so all
# queue pairs are loopback ones on the one device rxe0, over veth0.
ip link set lo up
ip link add veth0 type veth peer name veth1
ip addr add 10.79.0.1/24 dev veth0
ip addr add 10.79.0.2/24 dev veth1
ip link set veth0 up
ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0 || fail "rdma link add rxe0 failed"

# ib_core fills the GID table from the netdev's addresses asynchronously;
# wait for the RoCE v2 GID of 10.79.0.1 (IPv4-mapped, ::ffff:10.79.0.1)
# and an ACTIVE port. Its index is what ibv_*_pingpong -g and the like want.
port=/sys/class/infiniband/rxe0/ports/1
want=0000:0000:0000:0000:0000:ffff:0a4f:0001
gid_index=
for _ in $(seq 100); do
	for f in "$port"/gids/*; do
		i=${f##*/}
		if [ "$(cat "$f" 2>/dev/null)" = "$want" ] &&
			[ "$(cat "$port/gid_attrs/types/$i" 2>/dev/null)" = "RoCE v2" ]; then
			gid_index=$i
			break
		fi
	done
	if [ -n "$gid_index" ] && grep -q ACTIVE "$port/state"; then
		break
	fi
	sleep 0.1
done
[ -n "$gid_index" ] || fail "rxe0 has no RoCE v2 GID for 10.79.0.1"
grep -q ACTIVE "$port/state" || fail "rxe0 port 1 is not ACTIVE: $(cat "$port/state")"
echo "rxe-guest: rxe0 up on veth0, RoCE v2 GID index $gid_index"

stage running
cd "$RXE_CWD" || fail "cannot enter $RXE_CWD in the guest"
ulimit -l unlimited # registered memory is pinned
read -r start _ </proc/uptime
trap - ERR # from here on a failure is the command's, not ours
rc=0
# A minimal environment, plus what the caller passed with run.sh --env.
env -i PATH="$PATH" HOME=/root LANG=C.UTF-8 TERM=dumb TMPDIR=/tmp \
	RXE_DEV=rxe0 RXE_GID_INDEX="$gid_index" RXE_IP=10.79.0.1 \
	"${RXE_ENV[@]}" "${RXE_CMD[@]}" </dev/null >"$OUT/output" 2>&1 || rc=$?
read -r end _ </proc/uptime
echo "$start $end" >"$OUT/times"
echo "$rc" >"$OUT/status.tmp"
mv "$OUT/status.tmp" "$OUT/status"
stage "done"
