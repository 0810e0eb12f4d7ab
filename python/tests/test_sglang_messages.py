"""Side-channel messages (decode -> prefill rank) are checked field by field: a malformed one
is refused - the decode room it names, if its descriptor can be read, is aborted so the decode side fails at once -
and no exception reaches SGLang's scheduler (the prefill manager's pump(), called from every poll()).

Ordering: after each malformed message, a well-formed abort for a sentinel room goes down the same connection;
once the prefill rank has the sentinel (a tombstone), it has handled the message before it (one connection, one
inbox, in order) - and the connection survived it."""
import base64

import pytest

pytest.importorskip("numpy", reason="kvstage.sglang needs numpy (Debian: python3-numpy)")
pytest.importorskip("torch", reason="the SGLang engine tests keep their KV caches in torch tensors")

from conftest import next_event  # noqa: E402
from sglang_common import assert_pool_free, engines, kv_proxy  # noqa: E402,F401

import kvstage  # noqa: E402
from kvstage import sglang as ks  # noqa: E402
from kvstage.client import EventType  # noqa: E402
from kvstage.sglang import KVPoll  # noqa: E402


def good_meta(P, room, desc):
    return {"t": "meta", "room": room, "npages": 2, "aux": True, "state_counts": [1], "nbytes": 4096,
            "prefix_len": 0, "layout": P.mem.fingerprint(), "from": "test:1",
            "desc": base64.b64encode(desc).decode()}


def drop(d, k):
    d = dict(d)
    del d[k]
    return d


def with_(d, **kw):
    return dict(d, **kw)


def with_layout(d, **kw):
    return dict(d, layout=dict(d["layout"], **kw))


B64_SHORT = base64.b64encode(b"x" * 10).decode()
CASES = {
    # missing fields
    "no t": lambda m: drop(m, "t"), "no room": lambda m: drop(m, "room"), "no npages": lambda m: drop(m, "npages"),
    "no aux": lambda m: drop(m, "aux"), "no state_counts": lambda m: drop(m, "state_counts"),
    "no nbytes": lambda m: drop(m, "nbytes"), "no layout": lambda m: drop(m, "layout"),
    "no kv_item_lens": lambda m: dict(m, layout=drop(m["layout"], "kv_item_lens")),
    "no state_item_lens": lambda m: dict(m, layout=drop(m["layout"], "state_item_lens")),
    # wrong types
    "t number": lambda m: with_(m, t=1), "t unknown": lambda m: with_(m, t="bogus"),
    "room str": lambda m: with_(m, room=str(m["room"])), "room float": lambda m: with_(m, room=float(m["room"])),
    "room bool": lambda m: with_(m, room=True), "npages str": lambda m: with_(m, npages="2"),
    "npages float": lambda m: with_(m, npages=2.0), "npages null": lambda m: with_(m, npages=None),
    "aux int": lambda m: with_(m, aux=1), "state_counts str": lambda m: with_(m, state_counts="1"),
    "state_counts mixed": lambda m: with_(m, state_counts=[1, "2"]), "nbytes list": lambda m: with_(m, nbytes=[4096]),
    "prefix_len str": lambda m: with_(m, prefix_len="0"), "layout list": lambda m: with_(m, layout=[]),
    "kv_item_lens str": lambda m: with_layout(m, kv_item_lens="384"),
    "state_item_lens flat": lambda m: with_layout(m, state_item_lens=[96, 20]),
    "state_types ints": lambda m: with_layout(m, state_types=[1]), "from int": lambda m: with_(m, **{"from": 5}),
    # bad base64 / descriptor
    "desc not base64": lambda m: with_(m, desc="!!!not base64!!!"), "desc short": lambda m: with_(m, desc=B64_SHORT),
    "desc int": lambda m: with_(m, desc=123), "desc null with bytes": lambda m: with_(m, desc=None),
    "desc huge": lambda m: with_(m, desc="A" * 100000),
    # huge values
    "npages huge": lambda m: with_(m, npages=1 << 40), "nbytes huge": lambda m: with_(m, nbytes=1 << 60),
    "state_counts huge": lambda m: with_(m, state_counts=[1 << 40]), "room huge": lambda m: with_(m, room=1 << 70),
    "prefix_len huge": lambda m: with_(m, prefix_len=1 << 62),
    "kv_item_lens huge": lambda m: with_layout(m, kv_item_lens=[1 << 60] * 6),
    "state_counts long": lambda m: with_(m, state_counts=[0] * 100000),
    # negative ids and counts
    "room negative": lambda m: with_(m, room=-1), "npages negative": lambda m: with_(m, npages=-1),
    "nbytes negative": lambda m: with_(m, nbytes=-4096), "state_counts negative": lambda m: with_(m, state_counts=[-1]),
    "prefix_len negative": lambda m: with_(m, prefix_len=-3),
    "kv_item_lens negative": lambda m: with_layout(m, kv_item_lens=[-384] * 6),
    # the rank pair (attention-TP sizes that differ)
    "tp list": lambda m: with_(m, tp=[0, 1]), "tp no decode_rank": lambda m: with_(m, tp=drop(TP, "decode_rank")),
    "tp rank past size": lambda m: with_(m, tp=dict(TP, decode_rank=2)),
    "tp size huge": lambda m: with_(m, tp=dict(TP, decode_tp=1 << 40)),
    "tp slices flat": lambda m: with_(m, tp=dict(TP, slices=[0, 384])),
    "tp slices triple": lambda m: with_(m, tp=dict(TP, slices=[[0, 1, 2]])),
    "tp dummy int": lambda m: with_(m, tp=dict(TP, dummy=1)), "dtype int": lambda m: with_(m, kv_cache_dtype=8),
}
TP = {"prefill_rank": 0, "prefill_tp": 1, "decode_rank": 1, "decode_tp": 2, "slices": [[0, 96]] * 6, "dummy": False}
DESC_UNREADABLE = {"desc not base64", "desc short", "desc int", "desc null with bytes", "desc huge"}


class Peer:
    """One side-channel connection to the prefill rank, with the sentinel barrier."""

    def __init__(self, P):
        from kvstage import sidechannel
        self.P, self.conn = P, sidechannel.connect("127.0.0.1", P.rank_port, P._side_key, timeout=10)
        self.sock = self.conn.sock  # authenticated: what these messages test is what comes after the MAC
        self.sentinel = 10 ** 9

    def send(self, msg):
        self.conn.send(msg)

    def handled(self):
        """Sends the sentinel and pumps until the prefill rank has it (so everything before it is handled)."""
        self.sentinel += 1
        self.send({"t": "abort", "room": self.sentinel})
        assert self.P.wait_until(lambda: self.sentinel in self.P.tombstones, 10), "the connection was dropped"

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_meta_is_refused(engines, kv_proxy, case):
    pc, dc, P, D, addr = engines
    room = 4242
    s = ks.KvstageKVSender(P, addr, room, [0], 0)  # the prefill request the message claims to be for
    s.init(2, 1)
    with kvstage.Client(kv_proxy.socket) as rx:
        rroom, desc = rx.recv_open(4096, user_data=1)
        peer = Peer(P)
        try:
            peer.send(CASES[case](good_meta(P, room, desc)))
            peer.handled()  # pump() ran over the message: nothing was raised
            assert s.poll() == KVPoll.Bootstrapping, s  # the message was not adopted
            assert room not in P.pending_meta
            if case in DESC_UNREADABLE:
                rroom.abort()  # nothing could reach this room; the test ends it
            ev = next_event(rx)
            assert ev.type == EventType.ABORTED, ev  # refused: the decode room was aborted
            # and the channel still works: the well-formed message for that request is handled as before
            peer.send({"t": "abort", "room": room})
            peer.handled()
            assert s.poll() == KVPoll.Failed, s
        finally:
            peer.close()
            rroom.close()
    s.clear()


def test_malformed_abort_and_non_objects_are_refused(engines):
    pc, dc, P, D, addr = engines
    peer = Peer(P)
    try:
        for msg in ({"t": "abort"}, {"t": "abort", "room": "1"}, {"t": "abort", "room": -1},
                    {"t": "abort", "room": 1 << 64}, {"t": "abort", "room": None}, {"room": 5}, {}):
            peer.send(msg)
            peer.handled()
            assert not any(k in P.tombstones for k in (1, -1, 5, 1 << 64)), msg
    finally:
        peer.close()


def test_check_side_message_accepts_what_the_receiver_sends(engines):
    pc, dc, P, D, addr = engines
    m = good_meta(P, 1, b"\0" * 128)
    assert ks.check_side_message(m) is None
    assert ks.check_side_message(with_(m, desc=None, nbytes=0)) is None
    assert ks.check_side_message({"t": "abort", "room": 0}) is None
    assert "room" in ks.check_side_message(with_(m, room=-1))
