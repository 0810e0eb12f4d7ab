"""A sender process and a receiver process, each with its own connection, a descriptor through a pipe."""
import hashlib
import multiprocessing as mp
import os
import traceback

import kvstage
from kvstage import EventType
from conftest import SLOT_SIZE, next_event

NBYTES = 5 * SLOT_SIZE + 999


def payload(n):
    """Returns n bytes every one of which depends on its offset."""
    return b"".join(hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(-(-n // 32)))[:n]


def receiver(sock, desc_w, other, results):
    """Opens a room, writes its descriptor to desc_w, checks every byte that arrives."""
    os.close(other)
    try:
        with kvstage.Client(sock) as c:
            room, desc = c.recv_open(NBYTES, user_data=os.getpid())
            os.write(desc_w, desc)
            os.close(desc_w)
            ev = next_event(c, 30)
            assert (ev.type, ev.status, ev.bytes) == (EventType.RECV_DONE, 0, NBYTES), ev
            got = b"".join(bytes(room.lease(i).view()[:room.chunk_len(i)]) for i in range(room.chunks))
            assert got == payload(NBYTES), "bytes differ"
            room.close()
        results.put(("receiver", "ok"))
    except BaseException:
        results.put(("receiver", traceback.format_exc()))
        raise


def sender(sock, desc_r, other, results):
    """Reads a descriptor from desc_r and sends the payload into its room."""
    os.close(other)  # so a receiver that dies unwritten means EOF here
    try:
        desc = b""
        while len(desc) < kvstage.KVS_ROOM_DESC_SIZE:
            chunk = os.read(desc_r, kvstage.KVS_ROOM_DESC_SIZE - len(desc))
            assert chunk, "the receiver closed the pipe without a descriptor"
            desc += chunk
        data = payload(NBYTES)
        with kvstage.Client(sock) as c:
            room = c.send_open(desc, user_data=os.getpid())
            for i, lease in enumerate(c.acquire(room.chunks)):
                off, n = i * SLOT_SIZE, room.chunk_len(i)
                lease.view()[:n] = data[off:off + n]
                room.send(lease, off, n)
            ev = next_event(c, 30)
            assert (ev.type, ev.status) == (EventType.SEND_DONE, 0), ev
            room.close()
        results.put(("sender", "ok"))
    except BaseException:
        results.put(("sender", traceback.format_exc()))
        raise


def test_two_processes_through_a_pipe(proxy):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    r, w = os.pipe()
    procs = [ctx.Process(target=receiver, args=(proxy.socket, w, r, results)),
             ctx.Process(target=sender, args=(proxy.socket, r, w, results))]
    for p in procs:
        p.start()
    os.close(r)
    os.close(w)
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == {"receiver": "ok", "sender": "ok"}, got
    assert [p.exitcode for p in procs] == [0, 0]
