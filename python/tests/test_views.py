"""The safety rule: a slot's memory is never reachable from Python after its lease is gone."""
import pytest

import kvstage
from kvstage import EventType
from conftest import SLOT_SIZE, next_event


def assert_dead(mv):
    """Asserts that every read and write of mv raises ValueError (a released memoryview)."""
    with pytest.raises(ValueError):
        mv[0]
    with pytest.raises(ValueError):
        mv[0] = 1
    with pytest.raises(ValueError):
        bytes(mv)
    with pytest.raises(ValueError):
        mv.tobytes()


def received_room(tx, rx, payload, user_data=1):
    """Returns a completed RecvRoom holding payload (one chunk), after SEND_DONE and RECV_DONE."""
    rroom, desc = rx.recv_open(len(payload), user_data)
    sroom = tx.send_open(desc, user_data)
    (lease,) = tx.acquire(1)
    lease.view()[:len(payload)] = payload
    sroom.send(lease, 0, len(payload))
    assert next_event(tx).type == EventType.SEND_DONE
    assert next_event(rx).type == EventType.RECV_DONE
    sroom.close()
    return rroom


def test_view_dies_at_send(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    (lease,) = tx.acquire(1)
    v, w = lease.view(), lease.view()
    assert len(v) == SLOT_SIZE and not v.readonly
    v[:5] = b"hello"
    assert bytes(w[:5]) == b"hello"  # two views, one slot
    sroom.send(lease, 0, SLOT_SIZE)
    assert_dead(v)
    assert_dead(w)
    with pytest.raises((kvstage.Busy, kvstage.StaleLease)):  # the room's now, taken by the proxy or not
        lease.view()
    assert next_event(rx).type == EventType.RECV_DONE
    assert bytes(rroom.lease(0).view()[:5]) == b"hello"


def test_view_dies_at_release(client):
    (lease,) = client.acquire(1)
    v = lease.view()
    v[0] = 42
    client.release(lease)
    assert_dead(v)


def test_views_die_at_client_close(pair):
    tx, rx = pair
    rroom = received_room(tx, rx, b"x" * 100)
    rv = rroom.lease(0).view()
    (lease,) = rx.acquire(1)
    v = lease.view()
    rx.close()
    assert_dead(v)
    assert_dead(rv)
    with pytest.raises(kvstage.BadHandle):
        lease.view()
    with pytest.raises(kvstage.BadHandle):
        rroom.lease(0)


def test_received_view_is_read_only_and_dies_at_room_close(pair):
    tx, rx = pair
    rroom = received_room(tx, rx, bytes(range(256)) * 4)
    lease = rroom.lease(0)
    assert lease.readonly
    v, again = lease.view(), rroom.lease(0).view()
    assert v.readonly and bytes(v[:1024]) == bytes(range(256)) * 4
    with pytest.raises(TypeError):
        v[0] = 1
    with pytest.raises(TypeError):
        v[:4] = b"evil"
    rroom.close()
    assert_dead(v)
    assert_dead(again)
    with pytest.raises((kvstage.Busy, kvstage.StaleLease)):
        lease.view()  # the slot goes back to the pool once the proxy takes the close


def test_received_view_dies_at_release(pair):
    tx, rx = pair
    rroom = received_room(tx, rx, b"abc")
    lease = rroom.lease(0)
    v = lease.view()
    rx.release(lease)  # a receiver may give a chunk back early
    assert_dead(v)
    rroom.close()


def test_a_live_slice_blocks_the_send_and_the_lease_stays(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    (lease,) = tx.acquire(1)
    part = lease.view()[10:20]
    part[:] = b"0123456789"
    with pytest.raises(BufferError):
        sroom.send(lease, 0, SLOT_SIZE)
    with pytest.raises(BufferError):
        tx.release(lease)
    assert bytes(lease.view()[10:20]) == b"0123456789"  # still ours, nothing was sent
    del part
    sroom.send(lease, 0, SLOT_SIZE)
    assert next_event(rx).type == EventType.RECV_DONE
    assert bytes(rroom.lease(0).view()[10:20]) == b"0123456789"


def test_a_live_cast_blocks_close(pair):
    tx, rx = pair
    (lease,) = tx.acquire(1)
    as_u32 = lease.view().cast("I")
    with pytest.raises(BufferError):
        tx.close()
    assert not tx.closed
    del as_u32
    tx.close()
    assert tx.closed


def test_a_live_numpy_array_blocks_room_close(pair):
    np = pytest.importorskip("numpy")
    tx, rx = pair
    rroom = received_room(tx, rx, bytes(range(64)))
    arr = np.frombuffer(rroom.lease(0).view(), dtype=np.uint8)
    assert not arr.flags.writeable and arr[:64].tolist() == list(range(64))
    with pytest.raises(BufferError):
        rroom.close()
    assert not rroom.closed and arr[63] == 63
    del arr
    rroom.close()
    assert rroom.closed


def test_numpy_writes_then_send(pair):
    np = pytest.importorskip("numpy")
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    (lease,) = tx.acquire(1)
    arr = np.frombuffer(lease.view(), dtype=np.float32)
    arr[:] = np.arange(SLOT_SIZE // 4, dtype=np.float32)
    del arr
    sroom.send(lease, 0, SLOT_SIZE)
    assert next_event(rx).type == EventType.RECV_DONE
    got = np.frombuffer(rroom.lease(0).view(), dtype=np.float32)
    assert (got == np.arange(SLOT_SIZE // 4, dtype=np.float32)).all()
    del got
    rroom.close()


def test_no_new_view_before_the_proxy_takes_the_send(pair, proxy):
    """While the proxy is stopped the slot table still says ours: the binding itself refuses."""
    import signal
    tx, rx = pair
    rroom, desc = rx.recv_open(2 * SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    a, b = tx.acquire(2)
    proxy.proc.send_signal(signal.SIGSTOP)
    try:
        sroom.send(a, 0, SLOT_SIZE)  # queued; nobody has looked at it
        with pytest.raises(kvstage.Busy):
            a.view()
        with pytest.raises(kvstage.Busy):
            sroom.send(a, SLOT_SIZE, SLOT_SIZE)
        b.view()[0] = 1  # the other lease is still ours
    finally:
        proxy.proc.send_signal(signal.SIGCONT)
    sroom.send(b, SLOT_SIZE, SLOT_SIZE)
    assert next_event(rx).type == EventType.RECV_DONE
    leases = [rroom.lease(0), rroom.lease(1)]
    proxy.proc.send_signal(signal.SIGSTOP)
    try:
        rroom.close()  # queued as well
        for lease in leases:
            with pytest.raises(kvstage.Busy):
                lease.view()
    finally:
        proxy.proc.send_signal(signal.SIGCONT)


def test_a_lease_made_by_hand_gets_no_view_the_binding_did_not_issue(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(100, 1)
    sroom = tx.send_open(desc, 2)
    (lease,) = tx.acquire(1)
    sroom.send(lease, 0, 100)
    ev = next_event(rx)
    assert ev.type == EventType.RECV_DONE
    forged = kvstage.Lease(rx, *ev.lease)  # the slot table says rx holds it
    with pytest.raises(kvstage.Busy):
        forged.view()  # but not from room.lease(): never issued
    rroom.lease(0)
    v = forged.view()  # now issued: read-only, whatever the hand-made Lease says
    assert v.readonly
    rroom.close()
    assert_dead(v)
