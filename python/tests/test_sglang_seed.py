"""The seed bug replayed through SGLang's engine interface, as a red/green pair.

The bug: an engine aborts a request, gives its decode pages back at once and reuses them; a copy still
owed to the aborted request lands afterwards and overwrites memory that belongs to someone else now.
With kvstage the transport only ever writes slots, so the one writer of decode pages is the backend's
copy-out. Green (the backend as built): abort cancels a queued copy-out and ignores a RECV_DONE that
raced the abort, and clear() returns only after the room's final event, so pages reused after clear()
are never written. Red (VulnerableReceiver, test only): pages given back at abort, the queued copy-out
kept, the late RECV_DONE copied out; the test must see the corruption, or the green half proves nothing.

Both halves run in one process, prefill and decode managers each with its own connection to one real
kvstaged, and are ordered by the test alone: the decode manager takes events only when the test polls
it, and copy-outs run only when the test releases them (GatedCopier). No sleeps.

The same pair through attention TP 1 -> 2 (one room per rank pair): decode rank 0 has its share in its pages
while rank 1's is still to land (its RECV_DONE unread, or its copy-out queued) when the engine aborts, its
all-reduced poll says Failed and it reuses the pages on both ranks."""
import pytest

from kvstage import sglang as ks
from kvstage.plan import CopyHandle, CpuCopier
from kvstage.sglang import KVPoll
from sglang_common import NEED_TORCH, assert_pool_free, engines, kv_proxy, sender_done, start  # noqa: F401 (fixtures)

pytestmark = NEED_TORCH

A, B = 0xA11CE, 0xB0B


class VulnerableReceiver(ks.KvstageKVReceiver):
    """TEST ONLY - the seed bug: abort() gives the pages back at once (no wait for the room's end), the queued
    copy-out is not cancelled, and a RECV_DONE that comes after the abort is still copied out."""

    def abort(self):
        self._status = self.conclude_state = KVPoll.Failed
        self._reason = "Aborted by AbortReq."
        if self._room is not None and self._final is None:
            try:
                self._room.abort()
            except ks.KvstageError:
                pass

    def poll(self):
        super().poll()
        return self._status  # Failed at once, though a copy-out is still queued

    @property
    def pages_released(self):
        return self._status in (KVPoll.Success, KVPoll.Failed)

    def clear(self):
        pass  # returns at once; whatever is owed to the room still lands


class GatedCopier(CpuCopier):
    """Holds every copy-out until the test runs it, as a busy copy stream would."""

    def __init__(self):
        self.handles = []

    def submit(self, job):
        h = CopyHandle(job)
        h.room = job.bootstrap_room
        self.handles.append(h)
        return h

    def queued(self, room):
        return [h for h in self.handles if h.room == room and h.state == "queued"]

    def run(self, room=None):
        for h in list(self.handles):
            if room is None or h.room == room:
                h.run()


PP_A, PP_B = [9, 10, 11, 40, 41, 2, 3, 4, 5], [20, 21, 22, 23, 50, 51, 52, 7, 8]
DP = [30, 31, 12, 13, 14, 60, 61, 62, 1]  # the decode pages A had and B gets


@pytest.mark.parametrize("variant", ["green", "red"])
def test_late_recv_done_after_abort(engines, variant):
    """A's room completes at the proxy; the decode engine aborts A before its manager has read the event and,
    as SGLang does once a request has failed, takes the pages back at once and writes its own data (a marker)
    into them; only then does the decode manager take its events (poll, clear). Green: the marker stays, and a
    new request B that reuses the pages is whole. Red: A's late copy-out overwrites the marker."""
    pc, dc, P, D, addr = engines
    cls = ks.KvstageKVReceiver if variant == "green" else VulnerableReceiver
    s, r = start(engines, A, PP_A, DP, 5, cls)
    sender_done(s)
    r.abort()
    dc.mark(DP, 5, 0xEE)  # the engine owns the pages again and writes them
    assert r.poll() == KVPoll.Failed  # the decode manager takes A's RECV_DONE here
    r.clear()
    assert r.pages_released and r._final is not None and r._final.type == ks.EventType.RECV_DONE
    if variant == "green":
        assert dc.marked(DP, 5, 0xEE) is None, "decode pages written after abort()"
        sb, rb = start(engines, B, PP_B, DP, 5)  # B reuses A's pages and rows
        sender_done(sb)
        assert D.wait_until(lambda: rb.poll() == KVPoll.Success, 10), rb
        assert dc.check(B, DP, 5) is None
        rb.clear()
        sb.clear()
    else:
        assert dc.marked(DP, 5, 0xEE) is not None, "the vulnerable variant should have corrupted the marker"
        assert dc.check(A, DP, 5) is None  # ... with exactly A's bytes: the late copy landed
    s.clear()


@pytest.mark.parametrize("variant", ["green", "red"])
def test_queued_copy_out_after_abort(engines, variant):
    """A's RECV_DONE is taken and its copy-out queued (a copy stream behind); the engine aborts A, gives its pages
    to B; B's copy-out runs and B is Success and whole; then whatever is still queued runs. Green: B stays whole
    (A's copy was cancelled by the abort). Red: A's late copy lands in B's pages."""
    pc, dc, P, D, addr = engines
    gate = D.copier = GatedCopier()
    cls = ks.KvstageKVReceiver if variant == "green" else VulnerableReceiver
    s, r = start(engines, A, PP_A, DP, 5, cls)
    sender_done(s)
    assert D.wait_until(lambda: gate.queued(A), 10)
    assert r.poll() == KVPoll.Transferring  # received, not copied out: not Success
    r.abort()
    assert r.poll() == KVPoll.Failed  # at once
    r.clear()
    assert r.pages_released
    sb, rb = start(engines, B, PP_B, DP, 5)  # B gets A's pages and rows
    sender_done(sb)
    assert D.wait_until(lambda: gate.queued(B), 10)
    gate.run(B)
    assert rb.poll() == KVPoll.Success
    assert dc.check(B, DP, 5) is None
    gate.run()  # the copy stream drains
    if variant == "green":
        assert not gate.queued(A) and all(h.state == "cancelled" for h in gate.handles if h.room == A)
        assert dc.check(B, DP, 5) is None, "B's pages were written after A's clear()"
    else:
        assert dc.check(B, DP, 5) is not None, "the vulnerable variant should have corrupted B"
        assert dc.check(A, DP, 5) is None  # B's pages hold A's bytes
    rb.clear()
    sb.clear()
    s.clear()
    if variant == "red":
        r._close_room()  # the vulnerable variant never closes its room itself


# ------------------------------------------------------------------------------------ through attention TP 1 -> 2
class OneToTwo:
    """Prefill at attention TP 1, decode at attention TP 2, 4 KV heads (test_sglang_topology's engines): one room per
    rank pair, decode rank r taking heads 2r, 2r + 1 of every token from the one prefill rank. Each decode rank's
    manager takes its events only when the test polls it (SGLang's ranks are separate schedulers)."""

    def __init__(self, socket_path, receiver_cls):
        from test_sglang_topology import Engine
        self.cls, self.server = receiver_cls, ks.bootstrap_server_on_a_free_port()
        self.addr = f"127.0.0.1:{self.server.port}"
        self.P = self.D = None
        self.P = Engine(ks.DisaggregationMode.PREFILL, socket_path, 1, 1, 4, self.server.port, 64)
        self.D = Engine(ks.DisaggregationMode.DECODE, socket_path, 2, 1, 4, 0, 64)
        self.kv = {}

    def close(self):
        for e in (self.P, self.D):
            if e is not None:
                e.close()
        self.server.close()

    def start(self, room, ppages, dpages, row):
        """Both engines' ranks on one request up to its last chunk handed to the rooms; returns (sender, [receiver
        of decode rank 0, of decode rank 1]). The decode ranks use the same pages and row (SPMD schedulers)."""
        import torch
        from test_sglang_topology import global_kv, heads_of, tokens
        s = ks.KvstageKVSender(self.P.mgrs[0, 0], self.addr, room, [0], 0)
        rs = [self.cls(self.D.mgrs[0, r], self.addr, room) for r in range(2)]
        for r in rs:
            r.init(0)
            r.send_metadata(dpages, row, None)
        assert s.kv_mgr.wait_until(lambda: s.poll() == KVPoll.WaitingForInput, 10), s  # both shares adopted
        kv = self.kv[room] = global_kv(torch, room, len(ppages), 4)
        cache, idx = self.P.caches[0, 0], tokens(torch, ppages)
        for b, t in enumerate(cache.kv):
            t[idx] = kv[b][:, heads_of(0, 1, 4)]
        cache.fill_rows(room, row)
        s.init(len(ppages), row)
        s.send(ppages)
        return s, rs

    def holds(self, rank, room, dpages):
        """Whether decode rank `rank`'s pages dpages hold request room's heads of that rank."""
        import torch
        from test_sglang_topology import heads_of, tokens
        idx, hs = tokens(torch, dpages), heads_of(rank, 2, 4)
        return all(torch.equal(t[idx].view(torch.int16), self.kv[room][b][:, hs].view(torch.int16))
                   for b, t in enumerate(self.D.caches[0, rank].kv))


def engine_poll(receivers):
    """SGLang's poll_and_all_reduce over the decode engine's attention-TP ranks: the lowest KVPoll."""
    return min(int(r.poll()) for r in receivers)


@pytest.fixture
def one_to_two(kv_proxy, request):
    made = []

    def make(cls):
        made.append(OneToTwo(kv_proxy.socket, cls))
        return made[-1]
    yield make
    for e in made:
        e.close()
    assert_pool_free(kv_proxy.socket)


@pytest.mark.parametrize("variant", ["green", "red"])
def test_tp_1to2_late_share_after_abort(one_to_two, variant):
    """1 -> 2: A's two shares complete at the proxy; decode rank 0 takes its event and copies its heads out (its own
    poll Success), decode rank 1 has not yet taken its event (its share still to land in its pages: the engine's
    all-reduced poll is not final). The engine aborts A on both ranks, takes the pages back at once and writes its
    marker into them on both ranks; only then does decode rank 1 take its events. Green: both markers stay. Red:
    rank 1's late share overwrites its marker with A's heads."""
    e = one_to_two(ks.KvstageKVReceiver if variant == "green" else VulnerableReceiver)
    s, (r0, r1) = e.start(A, PP_A, DP, 5)
    sender_done(s)
    assert e.D.mgrs[0, 0].wait_until(lambda: r0.poll() == KVPoll.Success, 10), r0
    assert e.holds(0, A, DP)
    r0.abort()
    r1.abort()  # rank 1's manager has not polled since send_metadata: its RECV_DONE is unread
    for rank in (0, 1):
        e.D.caches[0, rank].mark(DP, 5, 0xEE)  # the engine owns the pages again and writes them
    assert engine_poll([r0, r1]) == KVPoll.Failed  # rank 1 takes A's RECV_DONE here
    for r in (r0, r1):
        r.clear()
        assert r.pages_released
    assert r1._final is not None and r1._final.type == ks.EventType.RECV_DONE  # it did come, after the abort
    assert e.D.caches[0, 0].marked(DP, 5, 0xEE) is None  # rank 0 was done before the abort either way
    if variant == "green":
        assert e.D.caches[0, 1].marked(DP, 5, 0xEE) is None, "decode rank 1's pages written after abort()"
    else:
        assert e.D.caches[0, 1].marked(DP, 5, 0xEE) is not None, "the vulnerable variant should have corrupted rank 1"
        assert e.holds(1, A, DP)  # ... with exactly A's heads of rank 1: the late share landed
    s.clear()


@pytest.mark.parametrize("variant", ["green", "red"])
def test_tp_1to2_queued_share_after_abort(one_to_two, variant):
    """1 -> 2: decode rank 0 has A's heads in its pages (its poll Success); decode rank 1 took its RECV_DONE and
    its copy-out is queued behind a busy copy stream (its poll Transferring: the engine's all-reduced poll too).
    The engine aborts A on both ranks and gives the pages to B, whose shares land on both ranks (B Success, whole);
    then the copy stream drains. Green: A's copy-out on rank 1 was cancelled, B stays whole on both ranks. Red: A's
    heads land in B's pages on rank 1."""
    e = one_to_two(ks.KvstageKVReceiver if variant == "green" else VulnerableReceiver)
    gate = e.D.mgrs[0, 1].copier = GatedCopier()
    s, (r0, r1) = e.start(A, PP_A, DP, 5)
    sender_done(s)
    assert e.D.mgrs[0, 0].wait_until(lambda: r0.poll() == KVPoll.Success, 10), r0
    assert e.D.mgrs[0, 1].wait_until(lambda: gate.queued(A), 10)
    assert (r0.poll(), r1.poll(), engine_poll([r0, r1])) == (KVPoll.Success, KVPoll.Transferring,
                                                             KVPoll.Transferring)
    r0.abort()
    r1.abort()
    assert engine_poll([r0, r1]) == KVPoll.Failed  # at once
    for r in (r0, r1):
        r.clear()
        assert r.pages_released
    sb, (rb0, rb1) = e.start(B, PP_B, DP, 5)  # B gets A's pages and row on both ranks
    sender_done(sb)
    assert e.D.mgrs[0, 0].wait_until(lambda: rb0.poll() == KVPoll.Success, 10), rb0
    assert e.D.mgrs[0, 1].wait_until(lambda: gate.queued(B), 10)
    gate.run(B)
    assert engine_poll([rb0, rb1]) == KVPoll.Success
    assert e.holds(0, B, DP) and e.holds(1, B, DP)
    gate.run()  # the copy stream drains
    assert e.holds(0, B, DP)
    if variant == "green":
        assert not gate.queued(A) and all(h.state == "cancelled" for h in gate.handles if h.room == A)
        assert e.holds(1, B, DP), "B's pages on decode rank 1 were written after A's clear()"
    else:
        assert not e.holds(1, B, DP), "the vulnerable variant should have corrupted B on decode rank 1"
        assert e.holds(1, A, DP)  # B's pages on rank 1 hold A's heads
    for r in (rb0, rb1, sb, s):
        r.clear()
    if variant == "red":
        for r in (r0, r1):
            r._close_room()  # the vulnerable variant never closes its room itself
