# shellcheck shell=bash disable=SC2154 # sourced: run.sh sets out, net, k8s, here
# Sourced by tests/deploy/*.sh: counting checks, waiting on a condition, and
# podman with kvstage's test configuration.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
pm() { "$root/tools/container/podman" "$@"; }
passed=0 failed=0
failures=()
say() { echo "deploy: $*" >&2; }
pass() { passed=$((passed + 1)); echo "PASS: $*"; }
fail() { failed=$((failed + 1)); failures+=("$*"); echo "FAIL: $*"; }
# check NAME CMD...: CMD's status is the check's.
check() {
	local name=$1
	shift
	if "$@"; then pass "$name"; else fail "$name"; fi
}
# wait_until SECONDS CMD...: runs CMD every 0.2 s until it succeeds (0) or
# SECONDS pass (1). What it waits on is a state (a proxy serving, a peer
# lost), read each time: a barrier, never a guess at how long something takes.
wait_until() {
	local end=$((SECONDS + $1))
	shift
	until "$@" >/dev/null 2>&1; do
		[ $SECONDS -lt $end ] || return 1
		sleep 0.2
	done
}
# stat_json CONTAINER: kvstage-stat --json of the kvstaged in CONTAINER.
stat_json() { pm exec "$1" kvstage-stat --socket /run/kvstage/kvstaged.sock --json; }
# stat_is CONTAINER PYEXPR: PYEXPR holds of that JSON (as d), e.g. 'd["rooms"]["open"] == 0'.
stat_is() {
	stat_json "$1" | python3 -c "import json, sys; d = json.load(sys.stdin); sys.exit(0 if ($2) else 1)"
}
summary() {
	echo "deploy: ${#failures[@]} failure(s)${failures:+: ${failures[*]}}" >&2
	echo "$passed passed, $failed failed"
	[ "$failed" -eq 0 ]
}
# play [--network NET] YAML: podman kube play, its chatter kept in $out/podman.log
# (podman 4.3 logs at level=error that it cannot add systemd timers for the
# probes where systemd is not PID 1, and goes on).
play() {
	pm kube play --quiet "$@" >/dev/null 2>>"$out/podman.log" || { tail -n 20 "$out/podman.log" >&2; return 1; }
}
