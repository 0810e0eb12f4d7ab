#!/usr/bin/env bash
# Installs the .debs that tools/deb/build.sh left in DEBDIR into a clean
# Debian 12 chroot where systemd is not running (as in a container), with
# apt from the Debian archive, and checks what the packages promise: the
# install succeeds; the kvstage user and group exist; /etc/kvstage is 0750
# root:kvstage; the unit is enabled (its link) but nothing was started;
# kvstaged, run as kvstage with the shipped /etc/kvstage/kvstaged.conf,
# serves; kvstage-demo and kvstage-stat work against it; a program built
# from libkvstage-dev (pkg-config, shared and static) moves a room through
# it; the Python package imports from /usr/lib/python3/dist-packages, loads
# libkvstage0, moves a room, and its SGLang entry point is found; then a
# reinstall keeps an edited conffile and /etc/kvstage's owner and mode, and
# a purge removes the unit's link, the conffile and __pycache__.
#
# Usage: tools/deb/check-install.sh DEBDIR [ROOTFS]
#   ROOTFS: a minbase bookworm root, a directory or a tarball; default:
#   tools/container/base.sh's cached one, else debootstrap (rootfs.sh).
# Needs root (chroot, mounts in a private mount namespace), network to the
# Debian archive, and about 1 GB in /tmp. Progress on stderr; exits 1 on a
# failed check.
set -euo pipefail
export LC_ALL=C.UTF-8
say() { echo "deb-install: $*" >&2; }
die() { say "$*"; exit 1; }

if [ $# -lt 1 ] || [ $# -gt 2 ]; then die "usage: tools/deb/check-install.sh DEBDIR [ROOTFS]"; fi
[ "$(id -u)" -eq 0 ] || die "needs root (chroot)"
src=$(cd "$(dirname "$0")/../.." && pwd)
. "$src/tools/deb/rootfs.sh"
deb_scratch debinst "$1" "${2:-}"
mkdir -p "$root/tmp/src"
cp "$src/dist/check-install.c" "$root/tmp/src/"

# What runs inside: every check prints "ok: ..." or "FAIL: ..." and counts.
cat > "$root/tmp/inside.sh" <<'INSIDE'
#!/bin/bash
set -uo pipefail
export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin
fails=0
ok() { echo "  ok: $*" >&2; }
bad() { echo "  FAIL: $*" >&2; fails=$((fails + 1)); }
check() { local what=$1; shift; if "$@" > /tmp/check.out 2>&1; then ok "$what"; else bad "$what: $(tail -5 /tmp/check.out)"; fi; }
step() { echo "deb-install: $*" >&2; }

step "apt-get update"
apt-get update -qq > /tmp/apt.log 2>&1 || { cat /tmp/apt.log >&2; exit 1; }
[ -d /run/systemd/system ] && { echo "systemd runs here: not the case under test" >&2; exit 1; }
step "apt-get install --no-install-recommends $*"
if apt-get install -y --no-install-recommends "$@" > /tmp/install.log 2>&1; then
  ok "apt-get install ($(grep -c '^Setting up' /tmp/install.log) packages set up)"
else
  cat /tmp/install.log >&2; echo "FAIL: install" >&2; exit 1
fi
grep -iE '^(E|W):|warning|error' /tmp/install.log | grep -v '^Selecting' >&2 || true
for p in kvstage libkvstage0 libkvstage-dev python3-kvstage; do
  check "$p installed" sh -c "dpkg-query -W -f='\${Status}' $p | grep -qx 'install ok installed'"
done

step "user, /etc/kvstage, the unit"
check "user kvstage: system uid, no login shell" sh -c \
  'u=$(getent passwd kvstage) && uid=$(echo "$u" | cut -d: -f3) && [ "$uid" -lt 1000 ] &&
   case $(echo "$u" | cut -d: -f7) in */nologin|*/false) true;; *) false;; esac'
check "group kvstage" getent group kvstage
check "/etc/kvstage 750 root:kvstage" sh -c '[ "$(stat -c "%a %U:%G" /etc/kvstage)" = "750 root:kvstage" ]'
check "unit enabled (multi-user.target.wants link)" sh -c \
  '[ "$(readlink /etc/systemd/system/multi-user.target.wants/kvstaged.service)" = /lib/systemd/system/kvstaged.service ]'
check "nothing started at install" sh -c '! pgrep -x kvstaged'

step "kvstaged as kvstage, with the shipped config"
mkdir -p /run/kvstage && chown kvstage:kvstage /run/kvstage
sock=/run/kvstage/kvstaged.sock
# setpriv execs kvstaged itself (runuser would stay its parent and SIGKILL it
# 2 s after passing on a SIGTERM, cutting the drain).
setpriv --reuid kvstage --regid kvstage --init-groups -- kvstaged --config /etc/kvstage/kvstaged.conf --socket "$sock" \
  --slots 32 --slot-size 256K --hugepages off --no-lock > /tmp/kvstaged.log 2>&1 &
kpid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
check "kvstaged serves $sock" test -S "$sock"
check "kvstage-demo" kvstage-demo -s "$sock" -r 16
check "kvstage-stat" kvstage-stat -s "$sock"
check "kvstage-bench --help" kvstage-bench --help

step "libkvstage-dev: a program built from pkg-config (and man-db for the pages)"
if apt-get install -y --no-install-recommends gcc libc6-dev pkg-config man-db > /tmp/gcc.log 2>&1; then
  for page in kvstaged.8 kvstage-stat.1 kvstage-ctl.1 kvstage-bench.1 kvstage-demo.1 kvstage.3; do
    check "man ${page%.*}" sh -c "man -w ${page##*.} ${page%.*} | grep -q '^/usr/share/man/'"
  done
  # Its Documentation= runs man, hence after man-db; a warning naming the unit fails.
  check "systemd-analyze verify kvstaged.service" sh -c \
    'systemd-analyze verify /lib/systemd/system/kvstaged.service 2>&1 | tee /dev/stderr | { ! grep -q kvstaged; }'
  check "cc \$(pkg-config libkvstage) (shared)" sh -c \
    'cc -std=c11 -pedantic -Wall -Werror $(pkg-config --cflags libkvstage) -o /tmp/ci /tmp/src/check-install.c $(pkg-config --libs libkvstage)'
  check "links the installed libkvstage.so.0" sh -c 'ldd /tmp/ci | grep -E "libkvstage.so.0 => (/usr)?/lib/'"$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)"'/libkvstage.so.0"'
  check "shared program moves a room" /tmp/ci "$sock"
  check "cc with libkvstage.a (static)" sh -c \
    'cc -std=c11 $(pkg-config --cflags libkvstage) -o /tmp/ci-static /tmp/src/check-install.c $(pkg-config --variable=libdir libkvstage)/libkvstage.a -lpthread'
  check "static program moves a room" /tmp/ci-static "$sock"
else
  tail -5 /tmp/gcc.log >&2; bad "apt-get install gcc libc6-dev pkg-config man-db"
fi

step "python3-kvstage"
cat > /tmp/py.py <<'PY'
import importlib.metadata as md, sys
import kvstage
assert kvstage.__file__.startswith("/usr/lib/python3/dist-packages/kvstage/"), kvstage.__file__
from kvstage import _lib
assert "libkvstage.so.0" in _lib.lib_path and "/_libs/" not in _lib.lib_path, _lib.lib_path
eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "kvstage"]
assert eps and eps[0].value == "kvstage.sglang_plugin:register", eps
assert md.version("kvstage") == sys.argv[2], md.version("kvstage")
data = bytes(range(256)) * 1000
with kvstage.Client(sys.argv[1]) as rx, kvstage.Client(sys.argv[1]) as tx:
    room, desc = rx.recv_open(len(data), user_data=1)
    sroom = tx.send_open(desc, user_data=2)
    for i, lease in enumerate(tx.acquire(sroom.chunks)):
        n = sroom.chunk_len(i)
        lease.view()[:n] = data[i * tx.slot_size:][:n]
        sroom.send(lease, i * tx.slot_size, n)
    tx.wait(10)
    rx.wait(10)
    got = b"".join(bytes(room.lease(i).view()[:room.chunk_len(i)]) for i in range(sroom.chunks))
    assert got == data, "bytes differ"
    room.close()
print("python: library", _lib.lib_path, "entry point", eps[0].value)
PY
version=$(dpkg-query -W -f='${Version}' python3-kvstage)
check "python3: import, entry point, one room" python3 /tmp/py.py "$sock" "$version"
cat /tmp/check.out >&2
check "byte-compiled at install" sh -c 'ls /usr/lib/python3/dist-packages/kvstage/__pycache__/*.pyc >/dev/null'
kill -TERM "$kpid"; wait "$kpid"; krc=$?
check "kvstaged drains on SIGTERM, exit 0" test "$krc" -eq 0
[ "$krc" -eq 0 ] || tail -20 /tmp/kvstaged.log >&2

step "reinstall: an edited conffile and /etc/kvstage stay"
echo "# edited" >> /etc/kvstage/kvstaged.conf
if dpkg -i /tmp/debs/kvstage_*.deb > /tmp/reinstall.log 2>&1; then ok "dpkg -i again"; else cat /tmp/reinstall.log >&2; bad "dpkg -i again"; fi
check "edited conffile kept" sh -c 'tail -1 /etc/kvstage/kvstaged.conf | grep -qx "# edited"'
check "/etc/kvstage still 750 root:kvstage" sh -c '[ "$(stat -c "%a %U:%G" /etc/kvstage)" = "750 root:kvstage" ]'

step "purge"
if apt-get purge -y kvstage python3-kvstage libkvstage-dev > /tmp/purge.log 2>&1; then ok "apt-get purge"; else cat /tmp/purge.log >&2; bad "apt-get purge"; fi
check "enable link gone" test ! -e /etc/systemd/system/multi-user.target.wants/kvstaged.service
check "conffile gone" test ! -e /etc/kvstage/kvstaged.conf
check "python package and __pycache__ gone" test ! -e /usr/lib/python3/dist-packages/kvstage
check "user kvstage kept (as Debian does)" getent passwd kvstage

[ $fails -eq 0 ] || { echo "deb-install: $fails failure(s)" >&2; exit 1; }
echo "deb-install: every check passed" >&2
INSIDE
chmod +x "$root/tmp/inside.sh"

# A private mount namespace: /proc, /dev and /sys for the chroot vanish
# with it, whatever happens.
say "chroot $root (no systemd running)"
rc=0
# shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
unshare --mount --fork /bin/bash -c '
  set -e
  root=$1; shift
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount -t sysfs sysfs "$root/sys"
  mount -t tmpfs tmpfs "$root/run"
  exec chroot "$root" /tmp/inside.sh "$@"' _ "$root" "${debs[@]}" || rc=$?
say "$(($(date +%s) - t0)) s"
exit "$rc"
