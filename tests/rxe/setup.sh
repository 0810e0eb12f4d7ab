#!/bin/bash
# Installs what tests/rxe/run.sh needs, with apt only. Idempotent: prints
# nothing and exits 0 when everything is already there. Run as root.
#
#   qemu-system-x86     the emulator (TCG)
#   linux-image-amd64   Debian's kernel with rdma_rxe, veth, 9p as modules;
#                       installing it only adds /boot/*-amd64 and
#                       /lib/modules/<version>: this machine keeps its kernel
#   busybox-static      the initramfs's only program (no libc in there)
#   kmod                modprobe: load-order of the initramfs's modules, and
#                       modprobe inside the guest
#   iproute2            ip (veth), rdma (rxe link), ss
#   ibverbs-utils       ibv_devices, ibv_devinfo, ibv_rc_pingpong
#   ibverbs-providers   librxe, the user-space half of soft-RoCE (only a
#                       Recommends of libibverbs1, so named here)
#   xz-utils            unpacks the kernel for a faster boot (see run.sh)
set -euo pipefail

export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"
packages=(qemu-system-x86 linux-image-amd64 busybox-static kmod iproute2
	ibverbs-utils ibverbs-providers xz-utils)

installed() {
	[ "$(dpkg-query -W -f '${db:Status-Status}' "$1" 2>/dev/null)" = installed ]
}

# The kernel run.sh will boot: the newest /boot/vmlinuz-*-amd64 that has its
# modules directory and rdma_rxe in it (run.sh makes the same choice).
kernel_ok() {
	local f v
	for f in /boot/vmlinuz-*-amd64; do
		[ -e "$f" ] || continue
		v=${f#/boot/vmlinuz-}
		[ -e "/lib/modules/$v/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko" ] && return 0
	done
	return 1
}

missing=()
for p in "${packages[@]}"; do
	installed "$p" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ] && kernel_ok; then
	exit 0
fi

if [ "$(id -u)" != 0 ]; then
	echo "tests/rxe/setup.sh: needs root to install: ${missing[*]}" >&2
	exit 1
fi

log=$(mktemp "${TMPDIR:-/tmp}/rxe-setup.XXXXXX.log")
echo "tests/rxe/setup.sh: installing ${missing[*]:-linux-image-amd64} (log: $log)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >>"$log" 2>&1 || echo "tests/rxe/setup.sh: apt-get update failed; trying the install anyway" >&2
# A kernel package's postinst hooks (initramfs, bootloader) may complain in a
# container or VM that boots some other way: that is not fatal here, as long
# as the files run.sh uses are in place afterwards, which is checked below.
apt_rc=0
apt-get install -y -q --no-install-recommends \
	-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
	"${packages[@]}" >>"$log" 2>&1 || apt_rc=$?

still=()
for p in "${packages[@]}"; do
	[ "$p" = linux-image-amd64 ] && continue # judged by its files, below
	installed "$p" || still+=("$p")
done
if [ ${#still[@]} -gt 0 ]; then
	tail -n 20 "$log" >&2
	echo "tests/rxe/setup.sh: could not install: ${still[*]} (apt-get exit $apt_rc; log: $log)" >&2
	exit 1
fi
if ! kernel_ok; then
	tail -n 20 "$log" >&2
	echo "tests/rxe/setup.sh: no /boot/vmlinuz-*-amd64 with rdma_rxe in /lib/modules after installing linux-image-amd64 (log: $log)" >&2
	exit 1
fi
if [ "$apt_rc" != 0 ]; then
	echo "tests/rxe/setup.sh: apt-get exited $apt_rc (a kernel postinst hook?), but everything run.sh needs is installed; log: $log" >&2
else
	rm -f "$log"
fi
echo "tests/rxe/setup.sh: done"
