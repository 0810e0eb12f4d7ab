#!/bin/bash
# Self-test of the soft-RoCE harness: boots the guest four times.
#   1. ibv_devices and ibv_devinfo see rxe0;
#   2. a real RDMA transfer: ibv_rc_pingpong, server and client on rxe0
#      (loopback queue pairs on the one device), 200 x 64 KiB each way;
#   3. a command's exit status comes out unchanged;
#   4. --timeout kills a guest whose command hangs, and says so.
#   5. a guest hung at boot is stopped and booted again; the command's
#      status (a failing one) comes from the boot that ran it.
# Exits non-zero if any step fails. Prints the timings run.sh reports.
# Set RXE_WORKDIR to keep the built initramfs between runs.
set -euo pipefail

export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
run="$here/run.sh"

own_workdir=
if [ -z "${RXE_WORKDIR:-}" ]; then
	RXE_WORKDIR=$(mktemp -d "${TMPDIR:-/tmp}/rxe-selftest.XXXXXX")
	own_workdir=1
fi
export RXE_WORKDIR
cleanup() { [ -n "$own_workdir" ] && rm -rf "$RXE_WORKDIR"; return 0; }
trap cleanup EXIT

log=$(mktemp "${TMPDIR:-/tmp}/rxe-selftest-log.XXXXXX")
trap 'cleanup; rm -f "$log" "$times"' EXIT
times=$(mktemp "${TMPDIR:-/tmp}/rxe-selftest-times.XXXXXX")
step() { echo; echo "=== $*"; }
# Keep run.sh's timing line of each run, for the summary.
timing() { sed -n "s/^rxe: kernel [^:]*: /$1: /p" "$log" >>"$times"; }
fail() { echo "selftest: FAIL: $*" >&2; exit 1; }
t_start=$(date +%s)

step "1. devices (ibv_devices, ibv_devinfo -d rxe0)"
"$run" --timeout 300 -- sh -c 'ibv_devices && ibv_devinfo -d rxe0' 2>&1 | tee "$log" ||
	fail "run.sh for the device listing exited ${PIPESTATUS[0]}"
grep -q 'hca_id:[[:space:]]*rxe0' "$log" || fail "ibv_devinfo did not show rxe0"
grep -q 'state:[[:space:]]*PORT_ACTIVE' "$log" || fail "rxe0's port is not PORT_ACTIVE"
timing devices

step "2. RDMA transfer (ibv_rc_pingpong on rxe0, 200 x 64 KiB)"
# Runs in the guest. The GID index: the RoCE v2 GID that maps 10.79.0.1
# (::ffff:10.79.0.1), read from ibv_devinfo -v and checked against sysfs
# and against the RXE_GID_INDEX run.sh's guest side exported.
# shellcheck disable=SC2016 # expanded in the guest, not here
guest_script='
set -eu
gid=$(ibv_devinfo -v -d rxe0 | sed -n "s/.*GID\[ *\([0-9]*\)\]:[[:space:]]*::ffff:10\.79\.0\.1, RoCE v2.*/\1/p" | head -n 1)
[ -n "$gid" ] || { echo "no RoCE v2 GID for 10.79.0.1:"; ibv_devinfo -v -d rxe0 | grep GID; exit 1; }
sysfs=/sys/class/infiniband/rxe0/ports/1
[ "$(cat $sysfs/gid_attrs/types/$gid)" = "RoCE v2" ] || { echo "sysfs disagrees on GID $gid type"; exit 1; }
[ "$(cat $sysfs/gids/$gid)" = "0000:0000:0000:0000:0000:ffff:0a4f:0001" ] || { echo "sysfs disagrees on GID $gid"; exit 1; }
[ "$gid" = "$RXE_GID_INDEX" ] || { echo "RXE_GID_INDEX=$RXE_GID_INDEX but the GID is at $gid"; exit 1; }
echo "GID index $gid: ::ffff:10.79.0.1, RoCE v2"

opts="-d rxe0 -g $gid -n 200 -s 65536"
ibv_rc_pingpong $opts >/tmp/server.log 2>&1 &
server=$!
# The client connects once; wait for the server to listen (port 18515).
i=0
until ss -Hltn "sport = :18515" | grep -q .; do
	i=$((i + 1)); [ $i -le 100 ] || { echo "server never listened"; cat /tmp/server.log; exit 1; }
	sleep 0.1
done
crc=0
timeout 120 ibv_rc_pingpong $opts 127.0.0.1 >/tmp/client.log 2>&1 || crc=$?
src=0
wait $server || src=$?
echo "--- server (exit $src)"; cat /tmp/server.log
echo "--- client (exit $crc)"; cat /tmp/client.log
[ $src -eq 0 ] && [ $crc -eq 0 ]
'
"$run" --timeout 300 -- sh -c "$guest_script" 2>&1 | tee "$log" ||
	fail "the pingpong run exited ${PIPESTATUS[0]}"
[ "$(grep -c '^26214400 bytes in' "$log")" = 2 ] ||
	fail "expected 26214400 bytes (200 x 64 KiB) moved on both sides"
timing pingpong

step "3. exit status comes through"
rc=0
"$run" --timeout 300 -- sh -c 'echo about to exit 7; exit 7' 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
[ "$rc" = 7 ] || fail "run.sh exited $rc for a command that exited 7"
grep -q '^about to exit 7$' "$log" || fail "the command's output did not come through"
timing exit-status

step "4. --timeout kills a hung guest"
rc=0
"$run" --timeout 25 -- sleep 600 >"$log" 2>&1 || rc=$?
grep '^rxe: timed out' "$log" || true
[ "$rc" = 124 ] || fail "run.sh exited $rc for a command that outlived --timeout (want 124)"
grep -q 'timed out after 25s' "$log" || fail "no timeout message"

step "5. a guest that hangs at boot is booted again; one that ran its command is not"
# A qemu on PATH ahead of the real one whose first start hangs before the
# kernel runs, as a multi-threaded TCG guest on this VM once did (RCU
# stalls, then nothing): run.sh must stop it after RXE_BOOT_TIMEOUT and
# boot the real one. Test-only: it lives in this run's temporary files.
fake=$(mktemp -d "${TMPDIR:-/tmp}/rxe-fakeq.XXXXXX")
real_qemu=$(command -v qemu-system-x86_64)
cat >"$fake/qemu-system-x86_64" <<FAKE
#!/bin/sh
n=\$(cat "$fake/starts" 2>/dev/null || echo 0)
echo \$((n + 1)) >"$fake/starts"
[ "\$n" -ge 1 ] || exec sleep 600
exec "$real_qemu" "\$@"
FAKE
chmod +x "$fake/qemu-system-x86_64"
rc=0
PATH="$fake:$PATH" RXE_BOOT_TIMEOUT=20 "$run" --timeout 300 -- sh -c 'echo ran; exit 3' >"$log" 2>&1 || rc=$?
starts=$(cat "$fake/starts" 2>/dev/null || echo 0)
rm -rf "$fake"
[ "$rc" = 3 ] || { cat "$log"; fail "run.sh exited $rc after a hung first boot (want the command's 3)"; }
[ "$starts" = 2 ] || fail "qemu was started $starts times (want 2: the hung boot and one more)"
grep -q 'had not started the command after 20s' "$log" || fail "no word of the hung boot"
grep -q 'booting again (try 2 of 3)' "$log" || fail "no word of the second boot"
grep -q '^ran$' "$log" || fail "the command's output did not come through"
timing boot-again

echo
cat "$times"
echo "selftest: all 5 steps passed in $(($(date +%s) - t_start)) s"
