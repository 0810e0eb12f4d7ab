#!/bin/sh
# /init of the guest's initramfs (run by busybox sh as PID 1).
#
# Its only jobs: load the modules needed to reach the host's root over 9p,
# mount it read-only at /host with the usual pseudo file systems over it,
# mount the writable "out" share at /host/run/rxe, chroot into the host root
# to run guest.sh (the real work, which lives in the out share so that this
# file, and so the cached initramfs, rarely changes), then power off.
#
# Everything it says goes to the serial console, which run.sh logs to a
# file; lines starting with "rxe-init:" are its own.

/bin/busybox mkdir -p /proc /sys /dev /host /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t devtmpfs devtmpfs /dev
exec </dev/null >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys

say() { echo "rxe-init: $*"; }
die() {
	say "FATAL: $*"
	# run.sh looks for this marker in the serial log.
	echo "RXE-GUEST-FAILED: $*"
	poweroff -f
	sleep 5
	exit 1
}

say "initramfs up (kernel $(uname -r))"

# Modules listed in dependency order by run.sh when it built this image.
while read -r mod; do
	[ -n "$mod" ] || continue
	insmod "/lib/modules/$mod" || die "insmod $mod failed"
done </modules.order

# The host's root, read-only. cache=loose makes repeated exec()s of the same
# binaries and libraries much cheaper; the guest lives for seconds, so a
# stale cache against concurrent edits on the host is not a concern.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro \
	hostroot /host || die "cannot mount the host root over 9p"

mount -t proc proc /host/proc || die "mount /proc"
mount -t sysfs sysfs /host/sys || die "mount /sys"
mount -t devtmpfs devtmpfs /host/dev || die "mount /dev"
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
mount -t tmpfs -o mode=755 tmpfs /host/run || die "mount /run"
mkdir -p /host/run/rxe

# The writable share: job description in, output and status out. No
# caching, so every write is on the host as soon as it is made.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /host/run/rxe ||
	die "cannot mount the out share over 9p"
echo booted >/host/run/rxe/stage

[ -r /host/run/rxe/guest.sh ] || die "no guest.sh in the out share"
chroot /host /bin/bash /run/rxe/guest.sh
say "guest.sh exited with $?"

sync
poweroff -f
sleep 5
