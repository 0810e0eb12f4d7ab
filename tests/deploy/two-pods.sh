# shellcheck shell=bash disable=SC2154 # sourced: run.sh sets out, net, k8s, here
# Sourced by run.sh (lib.sh's helpers, $net, $k8s): two pods, prefill and
# decode, each an engine with kvstaged as its sidecar; the proxies talk over
# TCP between the pods, at their defaults (--peer-timeout 10 s).
decode_run() { # ARGS...: pd_hosts.py decode in the decode pod's engine container
	pm exec kvstage-decode-engine python3 /opt/kvstage/python/examples/pd_hosts.py decode \
		--prefill kvstage-prefill:7700 "$@"
}
report_has() { # LOG PYEXPR: the decode side's JSON report (r) holds PYEXPR
	grep '^decode: {' "$1" | tail -n 1 | cut -d' ' -f2- |
		python3 -c "import json, sys; r = json.load(sys.stdin); sys.exit(0 if ($2) else 1)"
}
play_decode() {
	play --network "$net" "$k8s/decode.yaml" &&
		wait_until 60 ready kvstage-decode-kvstaged
}
pools_free() {
	stat_is kvstage-prefill-kvstaged 'd["slots"]["free"] == d["slot_count"]' &&
		stat_is kvstage-decode-kvstaged 'd["slots"]["free"] == d["slot_count"]'
}
# lose_decode_pod HOW: the decode pod goes mid-transfer (a long run, its
# first room ended: the barrier), HOW:
#   paused:  every process of the pod frozen: its sockets stay open and say
#            nothing, as a host that hangs or drops off the network;
#   deleted: podman kube down, as kubectl delete (SIGTERM: its kvstaged
#            drains, then it and the pod are gone).
# The prefill proxy must lose the session within --peer-timeout and one tick
# of its peer plane (every --peer-timeout / 8), nothing may be lost there,
# and the pod made again must serve 200 rooms byte-exact.
lose_decode_pod() {
	local how=$1 log=$out/decode-$1.log runner took_ms lost0 t0
	lost0=$(stat_json kvstage-prefill-kvstaged | python3 -c 'import json, sys; d = json.load(sys.stdin)
print(d["tcp"]["lost"] + d["tcp"]["closed"])')
	decode_run --requests 1000000 --concurrency 16 --abort-fraction 0 --timeout 600 > "$log" 2>&1 &
	runner=$!
	if wait_until 60 grep -q '^decode: 1 requests ended' "$log" &&
		wait_until 30 stat_is kvstage-prefill-kvstaged 'd["rooms"]["open"] > 0'; then
		t0=$(date +%s%N)
		if [ "$how" = paused ]; then
			pm pod pause kvstage-decode >/dev/null
		else
			pm kube down "$k8s/decode.yaml" >/dev/null 2>&1 &
		fi
		if wait_until $((PEER_TIMEOUT_S + 10)) stat_is kvstage-prefill-kvstaged \
			"d['tcp']['lost'] + d['tcp']['closed'] > $lost0 and d['tcp']['peers'] == 0"; then
			# When: the proxy's own log line of the session's end, against
			# the start (each look above is a podman exec: too coarse).
			took_ms=$(pm logs kvstage-prefill-kvstaged 2>&1 | grep -E 'kvstaged [a-z]+: peer .* (lost|closed): ' |
				tail -n 1 | python3 -c 'import datetime as dt, sys
t0 = dt.datetime.fromtimestamp(int(sys.argv[1]) / 1e9, dt.timezone.utc)
line = sys.stdin.read().split()
t = dt.datetime.combine(t0.date(), dt.time.fromisoformat(line[0]), dt.timezone.utc) if line else None
print(round((t - t0).total_seconds() * 1000) if t and t >= t0 else "no-line")  # HH:MM:SS.uuuuuu, UTC' "$t0")
			say "the prefill proxy lost the $how decode pod ${took_ms} ms after (--peer-timeout ${PEER_TIMEOUT_S} s)"
			# Its deadline: --peer-timeout of silence, looked at on the peer plane's
			# tick (every --peer-timeout / 8): at most 11.25 s after the pod's last
			# word. t0 is taken before podman is asked, and a pause takes a few
			# hundred ms to freeze the pod (it talks meanwhile): 750 ms for that.
			check "two pods: the prefill proxy lost the $how decode pod within its --peer-timeout and one tick (${took_ms} ms)" \
				test "$took_ms" -le $((PEER_TIMEOUT_S * 1000 * 9 / 8 + 750))
		else
			fail "two pods: the prefill proxy did not lose the $how decode pod within $((PEER_TIMEOUT_S + 10)) s"
			stat_json kvstage-prefill-kvstaged >&2 || true
		fi
		# Its rooms failed at the loss; the engine closes each at its final.
		check "two pods: nothing lost on the prefill side, decode pod $how (every slot free, no tombstone, every room closed)" \
			wait_until 10 stat_is kvstage-prefill-kvstaged \
			'd["slots"]["free"] == d["slot_count"] and d["slots"]["tombstone"] == 0 and d["rooms"]["open"] == 0'
		check "two pods: the prefill engine still runs, decode pod $how" \
			test "$(pm inspect --format '{{.State.Status}}' kvstage-prefill-engine)" = running
	else
		fail "two pods: the long decode run never got going ($how)"
		cat "$log" >&2
	fi
	if [ "$how" = paused ]; then
		pm kube down "$k8s/decode.yaml" >/dev/null 2>&1 || pm pod rm -f kvstage-decode >/dev/null 2>&1 || true
	fi
	kill "$runner" 2>/dev/null || true
	wait # the runner, and a kube down still under way
	pm pod rm -f kvstage-decode >/dev/null 2>&1 || true

	say "the decode pod made again ($how)"
	if play_decode; then
		log=$out/decode-$how-again.log
		decode_run --requests 200 --abort-fraction 0 > "$log" 2>&1 || true
		cat "$log" >&2
		check "two pods: the decode pod made again ($how) serves 200 rooms, byte-exact" \
			report_has "$log" 'r["exact"] == 200 and r["wrong"] == 0 and r["failed"] == 0'
		check "two pods: both pools end free ($how)" wait_until 10 pools_free
	else
		fail "two pods: the decode pod made again ($how) never served"
	fi
}
PEER_TIMEOUT_S=10 # kvstaged's default --peer-timeout, which the manifests keep

play --network "$net" "$k8s/prefill.yaml"
if ! wait_until 60 ready kvstage-prefill-kvstaged || ! play_decode; then
	fail "two pods: a sidecar never served"
	pm logs kvstage-prefill-kvstaged 2>&1 | tail -n 20 >&2 || true
	pm logs kvstage-decode-kvstaged 2>&1 | tail -n 20 >&2 || true
else
	pass "two pods: both sidecars serve"
	log=$out/decode-1.log
	decode_run --requests 300 --abort-fraction 0.1 > "$log" 2>&1 || true
	cat "$log" >&2
	check "two pods: 300 requests decode <- prefill over TCP, every completed one byte-exact" \
		report_has "$log" 'r["wrong"] == 0 and r["failed"] == 0 and r["unfinished"] == 0 and r["exact"] > 0'
	check "two pods: aborts from each side ended their rooms (ABORTED on the decode side)" \
		report_has "$log" 'r["aborted_here"] > 0 and r["aborted_by_prefill"] > 0'
	check "two pods: the rooms went by TCP between the proxies (the prefill proxy's peer session, bytes sent)" \
		stat_is kvstage-prefill-kvstaged 'd["tcp"]["peers"] == 1 and d["tcp"]["bytes_tx"] > 0'

	lose_decode_pod paused
	lose_decode_pod deleted
fi
pm kube down "$k8s/decode.yaml" >/dev/null 2>&1 || true
pm kube down "$k8s/prefill.yaml" >/dev/null 2>&1 || true
