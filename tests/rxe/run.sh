#!/bin/bash
# Run a command inside a throw-away qemu guest that has a soft-RoCE device.
#
#   tests/rxe/run.sh [--timeout SEC] [--rw DIR]... [--env NAME=VALUE]... -- COMMAND [ARGS...]
#
# The guest boots Debian's packaged kernel (this machine's own kernel has no
# RDMA support), sees this machine's root filesystem read-only over 9p, and
# runs COMMAND in the directory run.sh was started from, after creating
# rxe0 on veth0 (10.79.0.1/24; its peer veth1 is 10.79.0.2/24), and a second
# link, rxe1 on veth2 (10.79.1.1/24; veth3 10.79.1.2/24). COMMAND gets a
# minimal environment plus RXE_DEV=rxe0, RXE_GID_INDEX (the RoCE v2 GID of
# 10.79.0.1) and RXE_IP=10.79.0.1, and RXE_DEV1, RXE_GID_INDEX1, RXE_IP1 for
# rxe1 (two rails: tests/test_rails.c). Writable in the guest: /tmp, /run,
# /dev/shm (all fresh tmpfs) and each --rw DIR (shared back to the host).
#
# Prints COMMAND's stdout and stderr (merged) on stdout as it runs, a timing
# line on stderr, and exits with COMMAND's exit status. If the guest does
# not boot, rxe0 cannot be made, or everything takes longer than --timeout
# (default 600 s), it says so with the tail of the serial log and exits 125
# (or 124 on timeout): it never exits 0 unless COMMAND ran and exited 0.
# A guest that has not started COMMAND within RXE_BOOT_TIMEOUT seconds
# (default 120; a boot takes 6-9 s) is stopped and booted again, three
# boots at most; one that ran COMMAND is never run again.
#
# RXE_WORKDIR: where the initramfs is cached (rebuilt when the kernel or
#   the files it is made of change) and each run's files live; default a
#   fresh temporary directory, removed afterwards unless the run failed.
# RXE_KEEP=1: keep the run's files (serial log, output) even on success.
# RXE_KERNEL: the kernel version to boot; default the newest
#   /boot/vmlinuz-*-amd64 that has its /lib/modules directory.
set -euo pipefail

export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

say() { echo "rxe: $*" >&2; }
usage() {
	sed -n '4p' "$0" | sed 's/^# */usage: /' >&2
	exit 2
}

timeout_s=600
rw_dirs=()
env_vars=()
while [ $# -gt 0 ]; do
	case "$1" in
	--timeout) [ $# -ge 2 ] || usage; timeout_s=$2; shift 2 ;;
	--timeout=*) timeout_s=${1#*=}; shift ;;
	--rw)
		[ $# -ge 2 ] || usage
		[ -d "$2" ] || { say "--rw $2: not a directory"; exit 2; }
		rw_dirs+=("$(cd "$2" && pwd)")
		shift 2
		;;
	--env) [ $# -ge 2 ] || usage; env_vars+=("$2"); shift 2 ;;
	--) shift; break ;;
	-h | --help) usage ;;
	*) say "unknown argument: $1"; usage ;;
	esac
done
[ $# -gt 0 ] || usage
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || { say "--timeout wants whole seconds, not '$timeout_s'"; exit 2; }
for e in "${env_vars[@]}"; do
	[[ $e =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { say "--env wants NAME=VALUE, not '$e'"; exit 2; }
done

# --- what to boot ----------------------------------------------------------
for tool in qemu-system-x86_64 busybox modprobe timeout setpriv; do
	command -v "$tool" >/dev/null || { say "$tool is missing: run tests/rxe/setup.sh"; exit 125; }
done
busybox=$(command -v busybox)
# The initramfs has no libc: busybox must be the static one (busybox-static).
if ldd "$busybox" >/dev/null 2>&1; then
	say "$busybox is dynamically linked; install busybox-static (tests/rxe/setup.sh)"
	exit 125
fi

pick_kernel() {
	local v best=
	for f in /boot/vmlinuz-*-amd64; do
		[ -e "$f" ] || continue
		v=${f#/boot/vmlinuz-}
		[ -d "/lib/modules/$v/kernel" ] && best+="$v"$'\n'
	done
	printf '%s' "$best" | sort -V | tail -n 1
}
kver=${RXE_KERNEL:-$(pick_kernel)}
if [ -z "$kver" ] || [ ! -r "/boot/vmlinuz-$kver" ] || [ ! -d "/lib/modules/$kver" ]; then
	say "no usable Debian kernel (/boot/vmlinuz-*-amd64 with /lib/modules): run tests/rxe/setup.sh"
	exit 125
fi
if [ ! -e "/lib/modules/$kver/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko" ]; then
	say "kernel $kver has no rdma_rxe module"
	exit 125
fi

# --- work directory and the cached initramfs ------------------------------
own_workdir=
if [ -n "${RXE_WORKDIR:-}" ]; then
	workdir=$RXE_WORKDIR
	mkdir -p "$workdir"
else
	workdir=$(mktemp -d "${TMPDIR:-/tmp}/rxe.XXXXXX")
	own_workdir=1
fi
workdir=$(cd "$workdir" && pwd)

run=
qpid=
tailpid=
ok=
# shellcheck disable=SC2317 # called by the trap
cleanup() {
	if [ -n "$qpid" ]; then kill "$qpid" 2>/dev/null || true; fi
	if [ -n "$tailpid" ]; then kill "$tailpid" 2>/dev/null || true; fi
	if [ -n "$ok" ] && [ -z "${RXE_KEEP:-}" ]; then
		rm -rf "$run"
		if [ -n "$own_workdir" ]; then rm -rf "$workdir"; fi
	elif [ -n "$own_workdir" ]; then
		# Failed: keep this run's logs, not the 70 MB of kernel and initramfs.
		rm -rf "$workdir"/vmlinux-* "$workdir"/initramfs-* "$workdir"/initrd.* "$workdir"/tmp.*
		if [ -z "$run" ]; then rm -rf "$workdir"; fi
	fi
	return 0
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM HUP

# Modules the initramfs itself needs to reach the host root: virtio-pci
# and 9p over virtio. modprobe --show-depends lists them in load order.
initrd_modules() {
	local m
	for m in virtio_pci 9pnet_virtio 9p; do
		modprobe -S "$kver" --show-depends "$m" | awk '$1 == "insmod" { print $2 }'
	done | awk '!seen[$0]++'
}

# The cache key: kernel, busybox, init script, module list.
mods=$(initrd_modules)
key=$( {
	echo "$kver"
	cat "$busybox" "$here/initramfs-init.sh" | sha256sum
	echo "$mods"
} | sha256sum | cut -c1-16)
initrd="$workdir/initramfs-$kver-$key.cpio"
if [ ! -s "$initrd" ]; then
	say "building the initramfs for $kver"
	stage=$(mktemp -d "$workdir/initrd.XXXXXX")
	mkdir -p "$stage/bin" "$stage/lib/modules" "$stage/dev"
	cp "$busybox" "$stage/bin/busybox"
	ln -s busybox "$stage/bin/sh"
	cp "$here/initramfs-init.sh" "$stage/init"
	chmod 755 "$stage/init"
	: >"$stage/modules.order"
	while read -r ko; do
		[ -n "$ko" ] || continue
		cp "$ko" "$stage/lib/modules/"
		basename "$ko" >>"$stage/modules.order"
	done <<<"$mods"
	# Uncompressed on purpose: decompressing under TCG is slow, and it is
	# a few MB. -R 0:0: everything owned by root, whoever builds it.
	(cd "$stage" && find . -mindepth 1 | sort | busybox cpio -o -H newc -R 0:0) >"$stage.cpio"
	mv "$stage.cpio" "$initrd" # atomic: runs sharing RXE_WORKDIR never see half of it
	rm -rf "$stage"
	# Drop images of other kernels or older inputs.
	find "$workdir" -maxdepth 1 -name 'initramfs-*.cpio' ! -name "${initrd##*/}" -delete
fi

# The kernel, uncompressed. qemu boots an ELF vmlinux through its PVH entry
# point (CONFIG_PVH), which skips the firmware's real-mode setup and, above
# all, the kernel's own xz decompression: under TCG that alone is ~5 s of
# every boot. Falls back to the bzImage if anything about it is unusual.
kernel="/boot/vmlinuz-$kver"
vmlinux="$workdir/vmlinux-$kver"
if [ ! -s "$vmlinux" ] && grep -qx CONFIG_PVH=y "/boot/config-$kver" 2>/dev/null &&
	command -v xz >/dev/null; then
	# bzImage header: setup sectors at 0x1f1, payload offset at 0x248
	# (from the end of the setup code); the payload is the compressed ELF.
	# (Process substitution: xz stops reading at the end of the stream, and
	# tail's SIGPIPE must not count as a failure under pipefail.)
	setup_sects=$(od -An -tu1 -j $((0x1f1)) -N1 "$kernel" | tr -d ' ')
	payload_off=$(od -An -tu4 -j $((0x248)) -N4 "$kernel" | tr -d ' ')
	skip=$(((setup_sects + 1) * 512 + payload_off))
	if [ "$(od -An -tx1 -j "$skip" -N6 "$kernel" | tr -d ' ')" = fd377a585a00 ] &&
		xz -dc --single-stream <(tail -c +"$((skip + 1))" "$kernel") >"$workdir/tmp.vmlinux.$$" 2>/dev/null &&
		[ "$(od -An -tx1 -N4 "$workdir/tmp.vmlinux.$$" | tr -d ' ')" = 7f454c46 ]; then
		mv "$workdir/tmp.vmlinux.$$" "$vmlinux"
		find "$workdir" -maxdepth 1 -name 'vmlinux-*' ! -name "${vmlinux##*/}" -delete
	else
		rm -f "$workdir/tmp.vmlinux.$$"
	fi
fi
[ -s "$vmlinux" ] && kernel=$vmlinux

# --- this run's files ------------------------------------------------------
run=$(mktemp -d "$workdir/run.XXXXXX")
cp "$here/guest.sh" "$run/guest.sh"
{
	printf 'RXE_CWD=%q\n' "$PWD"
	printf 'RXE_ENV=('; for a in "${env_vars[@]}"; do printf '%q ' "$a"; done; printf ')\n'
	printf 'RXE_CMD=('; for a in "$@"; do printf '%q ' "$a"; done; printf ')\n'
	printf 'RXE_RW=('
} >"$run/job.sh"
virtfs_rw=()
n=0
for d in "${rw_dirs[@]}"; do
	virtfs_rw+=(-virtfs "local,path=$d,mount_tag=rw$n,security_model=none")
	printf '%q ' "rw$n $d" >>"$run/job.sh"
	n=$((n + 1))
done
printf ')\n' >>"$run/job.sh"
: >"$run/output"

# --- boot ------------------------------------------------------------------
# TCG, not KVM: /dev/kvm is there, but a nested guest of this machine hangs
# right after the kernel decompresses. TCG boots in a few seconds.
# -nodefaults: no NIC (the guest needs no network), no VGA; the serial
# console goes to a file, the monitor nowhere, so stdin is never read.
# -no-reboot with panic=-1: a guest panic ends qemu instead of looping.
# Two NUMA nodes, a vCPU and 1 GiB each: every proxy in the guest splits
# its pool by node (tests/test_numa.c checks where the pages are).
# shellcheck disable=SC2054 # the commas are qemu's
qemu=(
	qemu-system-x86_64
	-accel tcg,thread=multi -cpu max -smp 2 -m 2G
	-object memory-backend-ram,id=mem0,size=1G -object memory-backend-ram,id=mem1,size=1G
	-numa node,nodeid=0,cpus=0,memdev=mem0 -numa node,nodeid=1,cpus=1,memdev=mem1
	-nodefaults -no-user-config -display none -monitor none -no-reboot
	-serial "file:$run/serial.log"
	-kernel "$kernel" -initrd "$initrd"
	-append "console=ttyS0 rdinit=/init panic=-1 loglevel=4 mitigations=off"
	-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
	-virtfs "local,path=$run,mount_tag=out,security_model=none"
	"${virtfs_rw[@]}"
)
# A guest that has not started the command within boot_s (a boot and rxe
# setup take 6-9 s here) is hung, not slow: multi-threaded TCG on this VM
# has been seen to lose a vCPU's timer during boot (RCU stalls on the
# serial console, then nothing). It is stopped and booted again, at most
# boot_tries times in all. Only a guest that never ran the command is
# retried: once it has, its verdict stands, whatever it is.
boot_s=${RXE_BOOT_TIMEOUT:-120}
boot_tries=3
[[ $boot_s =~ ^[1-9][0-9]*$ ]] || { say "RXE_BOOT_TIMEOUT wants whole seconds, not '$boot_s'"; exit 2; }

# Waits for qemu; stops it (and returns 1) if the command has not started
# within boot_s. Sets qrc to qemu's (timeout's) exit status.
watch_boot() {
	local deadline=$(($(date +%s) + boot_s)) st
	while kill -0 "$qpid" 2>/dev/null; do
		st=$(cat "$run/stage" 2>/dev/null || true)
		case $st in running | "done") break ;; esac
		if [ "$(date +%s)" -ge "$deadline" ]; then
			kill "$qpid" 2>/dev/null || true
			wait "$qpid" || true
			return 1
		fi
		sleep 0.5
	done
	qrc=0
	wait "$qpid" || qrc=$?
	return 0
}

t0=$(date +%s.%N)
qrc=0
hung=
for try in $(seq 1 "$boot_tries"); do
	# setpriv --pdeathsig: should run.sh itself be killed (even by SIGKILL),
	# timeout gets SIGTERM and passes it on to qemu; should timeout die, qemu
	# gets SIGKILL. No guest outlives the harness.
	setpriv --pdeathsig TERM timeout -k 5 "$timeout_s" \
		setpriv --pdeathsig KILL "${qemu[@]}" </dev/null >"$run/qemu.log" 2>&1 &
	qpid=$!
	# Stream the command's output as the guest writes it into the out share.
	tail -n +1 -s 0.2 -f --pid="$qpid" "$run/output" &
	tailpid=$!
	booted=1
	watch_boot || booted=
	qpid=
	wait "$tailpid" || true
	tailpid=
	[ -n "$booted" ] && break
	say "the guest had not started the command after ${boot_s}s (stage: $(cat "$run/stage" 2>/dev/null || echo none)): stopped"
	if [ "$try" -eq "$boot_tries" ]; then
		hung=1
		break
	fi
	if [ -e "$run/serial.log" ]; then
		mv "$run/serial.log" "$run/serial.log.try$try"
		say "last lines of its serial console ($run/serial.log.try$try):"
		tail -n 8 "$run/serial.log.try$try" >&2 || true
	fi
	rm -f "$run/stage" "$run/error" "$run/status" "$run/times"
	: >"$run/output"
	say "booting again (try $((try + 1)) of $boot_tries)"
done
t1=$(date +%s.%N)

# --- verdict ---------------------------------------------------------------
guest_failed() {
	say "$1"
	[ -s "$run/error" ] && say "guest: $(cat "$run/error")"
	[ -s "$run/qemu.log" ] && { say "qemu said:"; tail -n 20 "$run/qemu.log" >&2; }
	say "last lines of the serial console ($run/serial.log):"
	tail -n 40 "$run/serial.log" >&2 2>/dev/null || true
	say "run files kept in $run"
	exit "${2:-125}"
}
if [ -n "$hung" ]; then
	guest_failed "the guest did not start the command in any of $boot_tries boots (${boot_s}s each)"
fi
status=
[ -f "$run/status" ] && status=$(cat "$run/status")
if [ "$qrc" = 124 ] || [ "$qrc" = 137 ]; then
	guest_failed "timed out after ${timeout_s}s (stage: $(cat "$run/stage" 2>/dev/null || echo none)); qemu killed" 124
fi
if [ -z "$status" ]; then
	case "$(cat "$run/stage" 2>/dev/null || true)" in
	"") guest_failed "the guest did not boot (qemu exit $qrc)" ;;
	running) guest_failed "the guest died while the command ran (qemu exit $qrc)" ;;
	*) guest_failed "the guest stopped at stage '$(cat "$run/stage")' before running the command (qemu exit $qrc)" ;;
	esac
fi
[[ $status =~ ^[0-9]+$ ]] || guest_failed "bad status '$status' from the guest"

read -r g0 g1 <"$run/times"
awk -v g0="$g0" -v g1="$g1" -v t0="$t0" -v t1="$t1" -v k="$kver" 'BEGIN {
	printf "rxe: kernel %s: boot and rxe setup %.1f s, command %.1f s, %.1f s in all\n",
		k, g0, g1 - g0, t1 - t0 }' >&2
ok=1
exit "$status"
