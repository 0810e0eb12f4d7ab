#!/bin/sh
# Runs inside a clean Debian 12 container (tests/deploy/run.sh): installs
# kvstage's packages with apt from /repo (a local repository of them and of
# what they need, since the container has no network), then starts kvstaged
# from the systemd unit's own command line as the unit would (its user, its
# credential, its runtime directory), asks it with kvstage-stat, moves rooms
# through it with kvstage-demo, imports the Python package, and stops it.
set -eu
echo 'deb [trusted=yes] file:/repo ./' > /etc/apt/sources.list
apt-get update -qq
cd /repo
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	./kvstage_*.deb ./libkvstage0_*.deb ./libkvstage-dev_*.deb ./python3-kvstage_*.deb > /tmp/apt.log 2>&1 ||
	{ cat /tmp/apt.log; exit 1; }
cd /
dpkg -l 'kvstage' 'libkvstage*' 'python3-kvstage' | grep '^ii'
unit=$(ls /lib/systemd/system/kvstaged.service /usr/lib/systemd/system/kvstaged.service 2>/dev/null | head -n 1)
[ -n "$unit" ] || { echo "check-deb: no kvstaged.service installed"; exit 1; }
execstart=$(sed -n 's/^ExecStart=//p' "$unit")
user=$(sed -n 's/^User=//p' "$unit")
echo "check-deb: the unit runs, as $user: $execstart"
# No systemd here (a container): what it would do at start, by hand. The
# user comes from the package's sysusers.d file where systemd-sysusers ran;
# without systemd, as that file says.
getent passwd "$user" >/dev/null || useradd --system --user-group --no-create-home --home-dir /nonexistent "$user"
install -d -m 0755 -o "$user" -g "$user" /run/kvstage            # RuntimeDirectory=kvstage
export CREDENTIALS_DIRECTORY=/run/credentials/kvstaged.service      # LoadCredential=peer.secret:...
install -d -m 0500 -o "$user" "$CREDENTIALS_DIRECTORY"
head -c 32 /dev/urandom | base64 > "$CREDENTIALS_DIRECTORY/peer.secret"
chown "$user" "$CREDENTIALS_DIRECTORY/peer.secret"
chmod 0400 "$CREDENTIALS_DIRECTORY/peer.secret"
[ -e /etc/kvstage/kvstaged.conf ] || { echo "check-deb: the unit's --config /etc/kvstage/kvstaged.conf is not installed"; exit 1; }
eval "set -- $execstart"
setpriv --reuid="$user" --regid="$user" --init-groups -- "$@" > /tmp/kvstaged.log 2>&1 &
pid=$!
i=0
until kvstage-stat > /tmp/stat.txt 2>&1; do
	i=$((i + 1))
	if [ $i -gt 100 ] || ! kill -0 $pid 2>/dev/null; then
		cat /tmp/stat.txt /tmp/kvstaged.log
		echo "check-deb: kvstaged did not serve /run/kvstage/kvstaged.sock"
		exit 1
	fi
	sleep 0.1
done
head -n 3 /tmp/stat.txt
kvstage-demo --rooms 20
python3 -c 'import kvstage, sys; print("kvstage", kvstage.__version__, kvstage.__file__, kvstage.LIB_PATH)
assert kvstage.__file__.startswith("/usr/lib/python3/dist-packages/"), kvstage.__file__'
python3 -c 'import importlib.metadata as m, sys
eps = [e for e in m.entry_points(group="sglang.srt.plugins") if e.name == "kvstage"]
print("entry point:", eps); sys.exit(0 if eps else 1)'
kill -TERM $pid
wait $pid && echo "check-deb: kvstaged exited 0 at SIGTERM" || { st=$?; cat /tmp/kvstaged.log; echo "check-deb: kvstaged exited $st"; exit 1; }
echo "check-deb: ok"
