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
it, and copy-outs run only when the test releases them (GatedCopier). No sleeps."""
import pytest

from kvstage import sglang as ks
from kvstage.plan import CopyHandle, CpuCopier
from kvstage.sglang import KVPoll
from sglang_common import NEED_TORCH, engines, kv_proxy, sender_done, start  # noqa: F401 (fixtures)

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
