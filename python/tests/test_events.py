"""Events: poll, wait with and without a timeout, and the event fd in selectors and asyncio."""
import asyncio
import errno
import selectors
import threading
import time

import pytest

import kvstage
from kvstage import EventType
from conftest import SLOT_SIZE


def send_one(tx, desc, user_data=9):
    """Opens the sending side of desc and sends one stamped slot; returns the SendRoom."""
    sroom = tx.send_open(desc, user_data)
    (lease,) = tx.acquire(1)
    lease.view()[:4] = b"ping"
    sroom.send(lease, 0, sroom.chunk_len(0))
    return sroom


def test_poll_without_events_is_empty(client):
    assert client.poll() == []
    assert client.poll(0) == []


@pytest.mark.parametrize("timeout", [0, 0.2])
def test_wait_times_out_empty(client, timeout):
    t0 = time.monotonic()
    assert client.wait(timeout) == []
    took = time.monotonic() - t0
    assert timeout - 0.01 <= took < timeout + 1.0, took


def test_wait_returns_every_waiting_event(pair):
    tx, rx = pair
    rooms = [rx.recv_open(10, 100 + k) for k in range(3)]
    for room, _ in rooms:
        room.abort()
    got = []
    while len(got) < 3:
        evs = rx.wait(10)
        assert evs, "no event within 10 s"
        got += evs
    assert sorted(ev.user_data for ev in got) == [100, 101, 102]
    assert {ev.type for ev in got} == {EventType.ABORTED}
    ev = got[0]
    assert ev.final and ev.status == -errno.ECANCELED
    assert isinstance(ev.error, kvstage.Aborted)


def test_wait_for_ever_returns_when_the_event_comes(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(4, 5)
    t = threading.Thread(target=lambda: send_one(tx, desc))  # tx is used by this thread only
    t.start()
    evs = rx.wait(None)
    t.join()
    assert [(ev.type, ev.user_data, ev.bytes) for ev in evs] == [(EventType.RECV_DONE, 5, 4)]
    assert bytes(rroom.lease(0).view()[:4]) == b"ping"


def test_fileno_with_selectors(pair):
    tx, rx = pair
    fd = rx.fileno()
    assert fd == rx.fileno() and fd >= 0
    assert rx.poll() == []  # drains the fd
    with selectors.DefaultSelector() as sel:
        sel.register(rx, selectors.EVENT_READ)  # a Client has fileno()
        assert sel.select(0.05) == [], "nothing to say yet"
        rroom, desc = rx.recv_open(SLOT_SIZE, 77)
        send_one(tx, desc)
        got, woke = [], 0
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            for key, mask in sel.select(deadline - time.monotonic()):
                assert key.fileobj is rx and mask & selectors.EVENT_READ
                woke += 1
                got += rx.poll()
        assert woke >= 1 and [(ev.type, ev.user_data) for ev in got] == [(EventType.RECV_DONE, 77)]
        assert rx.poll() == []
        assert sel.select(0.05) == [], "read out: the fd is quiet again"


def test_fileno_with_asyncio(pair):
    tx, rx = pair

    async def main():
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(rx.fileno(), ready.set)
        try:
            rroom, desc = rx.recv_open(100, 3)
            send_one(tx, desc)
            got = []
            while not got:
                await asyncio.wait_for(ready.wait(), 10)
                ready.clear()
                got += rx.poll()
            return got
        finally:
            loop.remove_reader(rx.fileno())

    got = asyncio.run(main())
    assert [(ev.type, ev.user_data) for ev in got] == [(EventType.RECV_DONE, 3)]


def test_event_final_and_error():
    ok = kvstage.Event(EventType.SEND_DONE, 0, 2, 10, kvstage.LeaseId(0, 0))
    assert ok.final and ok.error is None
    rej = kvstage.Event(EventType.REJECTED, -errno.ESTALE, 2, 0, kvstage.LeaseId(3, 1))
    assert not rej.final and isinstance(rej.error, kvstage.StaleLease)
