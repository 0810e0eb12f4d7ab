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
# queue pairs are loopback ones on each device. Two links, a device on
# each: rxe0 over veth0 (10.79.0.1) and rxe1 over veth2 (10.79.1.1), the
# two rails of a proxy given both (--rdma-device rxe0 --rdma-device rxe1).
ip link set lo up
# rail N: vethN*2 (10.79.N.1) and its peer (10.79.N.2), rxeN on the first.
make_rail() {
	local n=$1 a=veth$(($1 * 2)) b=veth$(($1 * 2 + 1))
	ip link add "$a" type veth peer name "$b"
	ip addr add "10.79.$n.1/24" dev "$a"
	ip addr add "10.79.$n.2/24" dev "$b"
	ip link set "$a" up
	ip link set "$b" up
	rdma link add "rxe$n" type rxe netdev "$a" || fail "rdma link add rxe$n failed"
}

# ib_core fills the GID table from the netdev's addresses asynchronously;
# wait for rxeN's RoCE v2 GID of 10.79.N.1 (IPv4-mapped, ::ffff:10.79.N.1)
# and an ACTIVE port; its index (what ibv_*_pingpong -g wants) in gid_index.
rail_gid() {
	local n=$1 port=/sys/class/infiniband/rxe$1/ports/1
	local want f i
	want=$(printf '0000:0000:0000:0000:0000:ffff:0a4f:%02x01' "$n")
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
	[ -n "$gid_index" ] || fail "rxe$n has no RoCE v2 GID for 10.79.$n.1"
	grep -q ACTIVE "$port/state" || fail "rxe$n port 1 is not ACTIVE: $(cat "$port/state")"
}

make_rail 0
rail_gid 0
gid_index0=$gid_index
make_rail 1
rail_gid 1
gid_index1=$gid_index
gid_index=$gid_index0
echo "rxe-guest: rxe0 up on veth0, RoCE v2 GID index $gid_index"
echo "rxe-guest: rxe1 up on veth2, RoCE v2 GID index $gid_index1"

stage running
cd "$RXE_CWD" || fail "cannot enter $RXE_CWD in the guest"
ulimit -l unlimited # registered memory is pinned
read -r start _ </proc/uptime
trap - ERR # from here on a failure is the command's, not ours
rc=0
# A minimal environment, plus what the caller passed with run.sh --env.
env -i PATH="$PATH" HOME=/root LANG=C.UTF-8 TERM=dumb TMPDIR=/tmp \
	RXE_DEV=rxe0 RXE_GID_INDEX="$gid_index" RXE_IP=10.79.0.1 \
	RXE_DEV1=rxe1 RXE_GID_INDEX1="$gid_index1" RXE_IP1=10.79.1.1 RXE_NETDEV1=veth2 \
	"${RXE_ENV[@]}" "${RXE_CMD[@]}" </dev/null >"$OUT/output" 2>&1 || rc=$?
read -r end _ </proc/uptime
echo "$start $end" >"$OUT/times"
echo "$rc" >"$OUT/status.tmp"
mv "$OUT/status.tmp" "$OUT/status"
stage "done"
