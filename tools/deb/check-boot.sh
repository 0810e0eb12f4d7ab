#!/usr/bin/env bash
# Boots a clean Debian 12 root with the .debs of DEBDIR installed, under
# systemd as its PID 1 (systemd-nspawn --boot), and checks the unit as
# packaged: installed while systemd was not running, enabled, and with the
# peer secret in place started at boot (Type=notify: active once kvstaged
# said READY=1) with the credential; root, and a member of group kvstage,
# get through the socket, others are refused; a reinstall (an upgrade's
# postinst) restarts it; apt-get remove stops it (debian/kvstage.prerm).
#
# Usage: tools/deb/check-boot.sh DEBDIR [ROOTFS]
#   ROOTFS as for check-install.sh (tools/deb/rootfs.sh).
# Needs root, systemd-nspawn (apt-get install systemd-container), network
# to the Debian archive. Progress on stderr; exits 1 on a failed check.
set -euo pipefail
export LC_ALL=C.UTF-8
say() { echo "deb-boot: $*" >&2; }
die() { say "$*"; exit 1; }

if [ $# -lt 1 ] || [ $# -gt 2 ]; then die "usage: tools/deb/check-boot.sh DEBDIR [ROOTFS]"; fi
[ "$(id -u)" -eq 0 ] || die "needs root"
command -v systemd-nspawn >/dev/null || die "no systemd-nspawn: apt-get install systemd-container"
src=$(cd "$(dirname "$0")/../.." && pwd)
. "$src/tools/deb/rootfs.sh"
deb_scratch debboot "$1" "${2:-}"

say "apt-get install ${debs[*]} (in a chroot, no systemd running)"
# shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
unshare --mount --fork /bin/bash -c '
  set -e
  root=$1; shift
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount -t tmpfs tmpfs "$root/run"
  exec chroot "$root" /bin/sh -c "apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends procps \"\$@\"" _ "$@"
  ' _ "$root" "${debs[@]}" > "$tmp/install.log" 2>&1 || { cat "$tmp/install.log" >&2; die "install failed"; }
[ -L "$root/etc/systemd/system/multi-user.target.wants/kvstaged.service" ] ||
  die "kvstaged.service not enabled at install"

# Booted, /tmp is a fresh tmpfs: the reinstall takes its package from here.
mkdir -p "$root/root/debs"
cp "$root"/tmp/debs/kvstage_*.deb "$root/root/debs/"

# The admin's part (README.Debian): the deployment's secret.
head -c 32 /dev/urandom | base64 > "$root/etc/kvstage/peer.secret"
chmod 600 "$root/etc/kvstage/peer.secret"

# The checks run at boot, as a unit after kvstaged's, and power the machine off.
cat > "$root/usr/local/sbin/kvstage-boot-check" <<'INSIDE'
#!/bin/bash
# Run by kvstage-boot-check.service inside the booted root (tools/deb/check-boot.sh).
exec > /root/boot-check.log 2>&1
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
ok() { echo "  ok: $*"; }
bad() { echo "  FAIL: $*"; }
check() { local what=$1; shift; if "$@" > /tmp/check.out 2>&1; then ok "$what"; else bad "$what: $(tail -3 /tmp/check.out)"; fi; }
active() { [ "$(systemctl is-active kvstaged)" = active ]; }

for _ in $(seq 60); do active && break; sleep 0.5; done
check "kvstaged.service enabled" sh -c '[ "$(systemctl is-enabled kvstaged)" = enabled ]'
check "kvstaged.service active (started at boot)" active
check "Type=notify, status from kvstaged" sh -c \
  'systemctl show -p Type,StatusText kvstaged | tee /dev/stderr | grep -q "^StatusText=serving /run/kvstage/kvstaged.sock"'
check "runs as kvstage" sh -c '[ "$(ps -o user= -p "$(systemctl show -p MainPID --value kvstaged)")" = kvstage ]'
check "the credential given as the secret file" sh -c \
  'tr "\0" " " < /proc/$(systemctl show -p MainPID --value kvstaged)/cmdline | grep -q -- "--peer-secret-file /run/credentials/kvstaged.service/peer.secret"'
check "socket 0660 kvstage:kvstage" sh -c '[ "$(stat -c "%a %U:%G" /run/kvstage/kvstaged.sock)" = "660 kvstage:kvstage" ]'
check "kvstage-demo as root" kvstage-demo -r 8
useradd -m -G kvstage member
useradd -m other
check "python3 kvstage.Client() as a member of kvstage" setpriv --reuid member --regid member --init-groups \
  python3 -c 'import kvstage; c = kvstage.Client(); print(c.slot_size); c.close()'
check "a user outside kvstage refused" sh -c '! setpriv --reuid other --regid other --init-groups kvstage-stat'
pid=$(systemctl show -p MainPID --value kvstaged)
check "reinstall (dpkg -i)" sh -c "dpkg -i /root/debs/kvstage_*.deb"
for _ in $(seq 40); do active && break; sleep 0.5; done
check "restarted by the postinst, active" sh -c \
  "[ \"\$(systemctl show -p MainPID --value kvstaged)\" != $pid ] && systemctl is-active kvstaged"
check "apt-get remove kvstage" env DEBIAN_FRONTEND=noninteractive apt-get remove -y kvstage
check "stopped at removal" sh -c '! systemctl is-active kvstaged && ! pgrep -x kvstaged'
journalctl -u kvstaged --no-pager | tail -12 | sed 's/^/  journal: /'
echo DONE
# No logind or D-Bus here: systemctl says so, then powers off directly.
systemctl --no-wall poweroff 2>/dev/null
INSIDE
chmod +x "$root/usr/local/sbin/kvstage-boot-check"
cat > "$root/etc/systemd/system/kvstage-boot-check.service" <<'EOF'
[Unit]
Description=tools/deb/check-boot.sh's checks
After=multi-user.target kvstaged.service
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/kvstage-boot-check
[Install]
WantedBy=multi-user.target
EOF
ln -s /etc/systemd/system/kvstage-boot-check.service \
  "$root/etc/systemd/system/multi-user.target.wants/kvstage-boot-check.service"

say "systemd-nspawn --boot"
# --register=no --keep-unit: no machined or system bus needed on this host.
timeout 240 systemd-nspawn --boot -D "$root" --register=no --keep-unit --console=pipe -q \
  > "$tmp/boot.log" 2>&1 || say "systemd-nspawn: exit $? (log below)"
[ -f "$root/root/boot-check.log" ] || { tail -30 "$tmp/boot.log" >&2; die "the checks did not run"; }
cat "$root/root/boot-check.log" >&2
say "$(($(date +%s) - t0)) s"
grep -q '^DONE$' "$root/root/boot-check.log" || die "the checks did not finish"
! grep -q 'FAIL' "$root/root/boot-check.log" || die "failures above"
say "every check passed"
