"""Rooms through one proxy: bytes stamped by the sender, checked byte for byte by the receiver."""
import errno

import pytest

import kvstage
from kvstage import EventType
from conftest import SLOT_SIZE, SLOTS, next_event as final_event


def stamp(room_id, offset, n):
    """Returns n bytes that say which room and which offset they belong to."""
    return bytes((room_id * 131 + (offset + k) * 7 + (offset + k) // 251) & 0xFF for k in range(n))


def transfer(tx, rx, nbytes, room_id=7):
    """Moves nbytes of stamped data through a room; returns (send event, recv event, received bytes)."""
    rroom, desc = rx.recv_open(nbytes, user_data=room_id)
    assert len(desc) == kvstage.KVS_ROOM_DESC_SIZE
    sroom = tx.send_open(desc, user_data=room_id + 1000)
    assert sroom.nbytes == rroom.nbytes == nbytes
    assert sroom.chunks == rroom.chunks == -(-nbytes // SLOT_SIZE)
    leases = tx.acquire(sroom.chunks)
    for i, lease in enumerate(leases):
        off, n = i * SLOT_SIZE, sroom.chunk_len(i)
        lease.view()[:n] = stamp(room_id, off, n)
        sroom.send(lease, off, n)
    sev, rev = final_event(tx), final_event(rx)
    got = b"".join(bytes(rroom.lease(i).view()[:rroom.chunk_len(i)]) for i in range(rroom.chunks))
    rroom.close()
    sroom.close()
    return sev, rev, got


@pytest.mark.parametrize("nbytes", [1, SLOT_SIZE, 3 * SLOT_SIZE + 12345, SLOTS * SLOT_SIZE],
                         ids=["one-byte", "one-slot", "several-slots", "whole-pool"])
def test_transfer(pair, nbytes):
    tx, rx = pair
    sev, rev, got = transfer(tx, rx, nbytes)
    assert (sev.type, sev.status, sev.user_data) == (EventType.SEND_DONE, 0, 1007)
    assert (rev.type, rev.status, rev.user_data) == (EventType.RECV_DONE, 0, 7)
    assert rev.bytes == nbytes
    assert got == stamp(7, 0, nbytes)


def test_one_client_both_sides(client):
    sev, rev, got = transfer(client, client, 2 * SLOT_SIZE + 1, room_id=3)
    assert {sev.type, rev.type} == {EventType.SEND_DONE, EventType.RECV_DONE}
    assert got == stamp(3, 0, 2 * SLOT_SIZE + 1)


def test_rooms_in_a_row_leave_the_pool_whole(pair):
    tx, rx = pair
    for k in range(20):
        assert transfer(tx, rx, 5 * SLOT_SIZE, room_id=k)[2] == stamp(k, 0, 5 * SLOT_SIZE)
    rx.release(rx.acquire(SLOTS)[0])  # every slot came back


def test_recv_done_names_chunk_zero(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(2 * SLOT_SIZE, 5)
    sroom = tx.send_open(desc, 6)
    for i, lease in enumerate(tx.acquire(2)):
        sroom.send(lease, i * SLOT_SIZE, SLOT_SIZE)
    rev = final_event(rx)
    first = rroom.lease(0)
    assert rev.lease == (first.slot, first.epoch) and first.readonly
    assert final_event(tx).type == EventType.SEND_DONE


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_abort(pair, side):
    tx, rx = pair
    rroom, desc = rx.recv_open(3 * SLOT_SIZE, 11)
    sroom = tx.send_open(desc, 12)
    leases = tx.acquire(3)
    sroom.send(leases[0], 0, SLOT_SIZE)  # one chunk in, then the abort
    (rroom if side == "receiver" else sroom).abort()
    (rroom if side == "receiver" else sroom).abort()  # idempotent
    sev, rev = final_event(tx), final_event(rx)
    assert (sev.type, sev.user_data) == (EventType.ABORTED, 12)
    assert (rev.type, rev.user_data) == (EventType.ABORTED, 11)
    with pytest.raises(kvstage.KvstageError) as e:
        sroom.send(leases[1], SLOT_SIZE, SLOT_SIZE)
    assert e.value.errno in (errno.ECANCELED, errno.ECONNRESET)  # the room's end
    with pytest.raises(kvstage.KvstageError):
        rroom.lease(0)
    for lease in leases[1:]:
        tx.release(lease)  # the unsent ones are still ours
    rroom.close()
    sroom.close()


def test_closing_an_unfinished_room_aborts_it(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    rroom.close()
    assert final_event(tx).type == EventType.ABORTED
    sroom.close()


def test_lease_before_complete_is_again(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(2 * SLOT_SIZE, 1)
    with pytest.raises(kvstage.Again):
        rroom.lease(0)
    sroom = tx.send_open(desc, 2)
    a, b = tx.acquire(2)
    sroom.send(a, 0, SLOT_SIZE)
    with pytest.raises(kvstage.Again):
        rroom.lease(0)
    sroom.send(b, SLOT_SIZE, SLOT_SIZE)
    assert final_event(rx).type == EventType.RECV_DONE
    with pytest.raises(kvstage.KvstageError) as e:
        rroom.lease(2)
    assert e.value.errno == errno.ERANGE


def test_send_errors(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(2 * SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    a, b, c = tx.acquire(3)
    with pytest.raises(kvstage.KvstageError) as e:
        sroom.send(a, 0, 10)  # a chunk's length is fixed
    assert e.value.errno == errno.EINVAL
    sroom.send(a, 0, SLOT_SIZE)
    with pytest.raises(kvstage.KvstageError) as e:
        sroom.send(b, 0, SLOT_SIZE)
    assert e.value.errno == errno.EEXIST
    for call in (lambda: sroom.send(a, SLOT_SIZE, SLOT_SIZE), a.view):  # a is the room's now
        with pytest.raises((kvstage.Busy, kvstage.StaleLease)):  # in flight, or handed to the receiver
            call()
    assert not hasattr(rroom, "send")
    sroom.send(b, SLOT_SIZE, SLOT_SIZE)
    assert final_event(tx).type == EventType.SEND_DONE
    for sent in (a, b):  # handed to the receiver: the sender's epoch is gone
        with pytest.raises(kvstage.StaleLease):
            tx.release(sent)
        with pytest.raises(kvstage.StaleLease):
            sent.view()
    with pytest.raises(kvstage.AlreadyDone):
        sroom.send(c, 0, SLOT_SIZE)
    sroom.close()
    with pytest.raises(kvstage.BadHandle):
        sroom.send(c, 0, SLOT_SIZE)
    sroom.close()  # idempotent
    tx.release(c)


def test_send_of_a_released_lease_is_stale(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE, 1)
    sroom = tx.send_open(desc, 2)
    (a,) = tx.acquire(1)
    tx.release(a)
    with pytest.raises(kvstage.StaleLease):
        sroom.send(a, 0, SLOT_SIZE)


def test_bad_descriptor(pair):
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE, 1)
    forged = bytearray(desc)
    forged[30] ^= 0xFF  # inside the room's token (bytes 24..39, shm/layout.h)
    with pytest.raises(kvstage.PermissionDenied):
        tx.send_open(bytes(forged))
    tx.send_open(desc).close()  # the real one still opens
    gone, desc2 = rx.recv_open(SLOT_SIZE, 2)
    gone.close()  # unfinished: aborted, and gone once its ABORTED event came
    evs = [final_event(rx), final_event(rx)]  # and the first room, aborted by its sender's close
    assert sorted((ev.type, ev.user_data) for ev in evs) == [(EventType.ABORTED, 1), (EventType.ABORTED, 2)]
    with pytest.raises(kvstage.StaleLease) as e:
        tx.send_open(desc2)  # that room is gone
    assert e.value.errno == errno.ESTALE


def test_room_context_manager_and_repr(pair):
    tx, rx = pair
    room, desc = rx.recv_open(10, 3)
    with room:
        assert "10 bytes, 1 chunks" in repr(room)
    assert room.closed
    with pytest.raises(kvstage.BadHandle):
        room.abort()


def test_a_shared_room_lands_once_for_every_reader(proxy, pair):
    """recv_open(readers=3) and two join()s: each reader reads every byte through its own room; a fourth join is
    refused; the opener's release of a slot others read is refused; the last close frees them (the C suite
    test-shared shows that nothing completes before the last reader joined)."""
    tx, rx = pair
    with kvstage.Client(proxy.socket) as r2, kvstage.Client(proxy.socket) as r3:
        nbytes = 2 * SLOT_SIZE + 99
        room, desc = rx.recv_open(nbytes, user_data=41, readers=3)
        j2 = r2.join(desc, user_data=42)
        sroom = tx.send_open(desc, user_data=40)
        for i, lease in enumerate(tx.acquire(sroom.chunks)):
            off, n = i * SLOT_SIZE, sroom.chunk_len(i)
            lease.view()[:n] = stamp(4, off, n)
            sroom.send(lease, off, n)
        j3 = r3.join(desc, user_data=43)  # the last reader: the room may complete now, not before
        with pytest.raises(kvstage.KvstageError) as e:
            r3.join(desc)
        assert e.value.errno == errno.EUSERS
        for c, r, ud in ((rx, room, 41), (r2, j2, 42), (r3, j3, 43)):
            ev = final_event(c)
            assert (ev.type, ev.user_data, ev.bytes) == (EventType.RECV_DONE, ud, nbytes)
            got = b"".join(bytes(r.lease(i).view()[:r.chunk_len(i)]) for i in range(r.chunks))
            assert got == stamp(4, 0, nbytes)
        assert final_event(tx).type == EventType.SEND_DONE
        with pytest.raises(kvstage.Busy):
            rx.release(room.lease(0))
        room.close()
        j2.close()
        assert bytes(j3.lease(1).view()[:8]) == stamp(4, SLOT_SIZE, 8)
        j3.close()
        sroom.close()
        for c in (r2, r3, tx):  # barriers: each close was taken before a later sync call of its client
            c.release(c.acquire(1)[0])
    with pytest.raises(ValueError):
        rx.recv_open(1, readers=kvstage.KVS_MAX_READERS + 1)
    rx.release(rx.acquire(SLOTS)[0])  # every slot came back
