"""kvstage.plan, the copy planner both engine modules use: extents cut at slot boundaries into plain copies and
gathers (every byte once, at its room offset, in room order), the one tie rule, strided buffers, and the CPU
copier and copy_room_out on host memory."""
import ctypes

import pytest

from kvstage.plan import Copy, CopyHandle, CpuCopier, Extent, Gather, copy_room_out, needs_view, plan, runs

pytest.importorskip("numpy", reason="kvstage.plan needs numpy (Debian: python3-numpy)")

B = 0x10000


def dev(room_off, base, item, idx):
    """A device extent of a buffer whose items are item bytes apart."""
    return Extent(room_off, base, item, item, tuple(idx), True)


def gather(slot, off, base, item, idx):
    return Gather(slot, off, base, item, item, tuple(idx))


def test_runs():
    assert runs([5, 6, 7, 10, 11, 3]) == [(0, 5, 3), (3, 10, 2), (5, 3, 1)]
    assert runs([]) == [] and runs([4]) == [(0, 4, 1)]
    assert runs((2, 1, 0)) == [(0, 2, 1), (1, 1, 1), (2, 0, 1)]


def test_host_extents_are_runs_cut_at_slots():
    """A host extent: one copy per run of adjacent items, cut at slot boundaries, never a gather."""
    assert plan([Extent(4090, 0x1000, 10, 10, (0, 1), False)], 4096) == [Copy(0, 4090, 0x1000, 6, False),
                                                                         Copy(1, 0, 0x1006, 14, False)]
    assert plan([Extent(0, B, 30, 30, (7, 3, 9, 1, 5, 0, 8), False)], 128) == [
        Copy(0, 0, B + 7 * 30, 30, False), Copy(0, 30, B + 3 * 30, 30, False), Copy(0, 60, B + 9 * 30, 30, False),
        Copy(0, 90, B + 30, 30, False), Copy(0, 120, B + 5 * 30, 8, False), Copy(1, 0, B + 5 * 30 + 8, 22, False),
        Copy(1, 22, B, 30, False), Copy(1, 52, B + 8 * 30, 30, False)]
    assert plan([], 64) == [] and plan([Extent(0, B, 8, 8, (), False)], 64) == []


def test_device_extents_fewer_calls_and_the_tie():
    """A device extent, per slot, in whichever form takes fewer calls: whole items as one Gather in the request's
    order plus a plain copy for each part of an item a slot boundary cuts, or one plain copy per run of adjacent
    items; on a tie the plain copies. Every byte once, at its room offset."""
    ext = dev(50, B, 30, (7, 3, 4, 9, 0))
    assert plan([ext], 64) == [
        Copy(0, 50, B + 7 * 30, 14, True),      # item 7: 14 bytes in slot 0, 16 in slot 1
        Copy(1, 0, B + 7 * 30 + 14, 16, True),
        Copy(1, 16, B + 3 * 30, 48, True),      # slot 1: items 3 and 4 are adjacent: 2 copies, or 3 calls gathered
        Copy(2, 0, B + 4 * 30 + 18, 12, True),  # slot 2: three runs, as many calls as gathered: the tie, copies
        Copy(2, 12, B + 9 * 30, 30, True),
        Copy(2, 42, B, 22, True),               # item 0 across slots 2 and 3
        Copy(3, 0, B + 22, 8, True)]
    assert plan([dev(0, B, 30, (7, 3, 9, 1, 5, 0, 8))], 128) == [
        gather(0, 0, B, 30, (7, 3, 9, 1)),      # five runs, or a gather and a cut: the gather
        Copy(0, 120, B + 5 * 30, 8, True),
        Copy(1, 0, B + 5 * 30 + 8, 22, True),   # slot 1: three runs, or the cut and a gather of 0, 8: the gather
        gather(1, 22, B, 30, (0, 8))]
    assert plan([dev(0, B, 30, (0, 1, 2, 3, 4))], 64) == [  # adjacent items: one copy a slot, cut items and all
        Copy(0, 0, B, 64, True), Copy(1, 0, B + 64, 64, True), Copy(2, 0, B + 128, 22, True)]
    assert plan([dev(128, 0, 32, (5, 1, 2, 8, 6))], 64) == [
        gather(2, 0, 0, 32, (5, 1)), gather(3, 0, 0, 32, (2, 8)), Copy(4, 0, 6 * 32, 32, True)]  # one item: a copy
    assert plan([dev(0, 0, 32, (4, 5))], 64) == [Copy(0, 0, 4 * 32, 64, True)]  # 1 call either way: the copy
    assert plan([dev(10, 0, 100, (2,))], 64) == [Copy(0, 10, 200, 54, True), Copy(1, 0, 254, 46, True)]
    assert plan([Extent(60, 0x9000, 8, 8, (0,), False), dev(68, 0, 32, (1,))], 64) == [
        Copy(0, 60, 0x9000, 4, False), Copy(1, 0, 0x9004, 4, False), Copy(1, 4, 32, 32, True)]


def test_strided_items_are_never_merged():
    """Items stride bytes apart (stride > item: a block-first cache's K or V part) are never adjacent: a copy each
    on the host, a Gather with the stride on a device (one copy for a lone item)."""
    host = Extent(0, B, 64, 32, (1, 2, 3), False)
    assert plan([host], 4096) == [Copy(0, 0, B + 64, 32, False), Copy(0, 32, B + 128, 32, False),
                                  Copy(0, 64, B + 192, 32, False)]
    assert plan([host._replace(device=True)], 4096) == [Gather(0, 0, B, 64, 32, (1, 2, 3))]
    assert plan([host._replace(device=True, idx=(2,))], 4096) == [Copy(0, 0, B + 128, 32, True)]


def test_every_byte_once_in_room_order():
    """Whatever the items, slot size and offset: the pieces tile the extent's room bytes exactly, in order, each
    inside one slot, and each byte comes from its item."""
    import random
    rng = random.Random(9)
    for _ in range(300):
        item, ss = rng.choice([8, 24, 30, 64, 100]), rng.choice([32, 64, 96, 256])
        stride = item * rng.choice([1, 1, 2])
        n = rng.randint(1, 20)
        idx = rng.sample(range(40), n) if rng.random() < 0.5 else list(range(3, 3 + n))
        ext = Extent(rng.randrange(300), B, stride, item, tuple(idx), rng.random() < 0.7)
        at = ext.room_off
        for p in plan([ext], ss):
            assert p.slot * ss + p.off == at and p.off + p.nbytes <= ss
            src = ([B + i * stride + b for i in p.idx for b in range(item)] if isinstance(p, Gather)
                   else list(range(p.addr, p.addr + p.nbytes)))
            k = at - ext.room_off
            assert src == [B + idx[(k + j) // item] * stride + (k + j) % item for j in range(p.nbytes)]
            at += p.nbytes
        assert at == ext.room_off + ext.nbytes


class _Room:
    """Slots of host memory standing in for a received room (lease(s) -> a lease whose view is the slot)."""

    class Lease:
        def __init__(self, buf):
            self.buf = buf

        def view(self):
            return memoryview(self.buf)

    def __init__(self, n, ss):
        self.slots = [bytearray(ss) for _ in range(n)]
        self.asked = []

    def lease(self, s):
        self.asked.append(s)
        return self.Lease(self.slots[s])


def test_cpu_copier_round_trip():
    """Host memory into slots by the plan (copy_in), then out of them into other items (copy_room_out, each slot's
    lease taken once): the items hold the bytes, nothing else is written."""
    item, ss = 24, 64
    src, dst = (ctypes.c_ubyte * (item * 16))(), (ctypes.c_ubyte * (item * 16))()
    for i in range(len(src)):
        src[i] = (i * 7 + 1) & 0xFF
    ext_in = Extent(20, ctypes.addressof(src), item, item, (9, 3, 4, 5, 12), False)
    room, cp = _Room(3, ss), CpuCopier()
    for p in plan([ext_in], ss):
        assert needs_view(p)
        cp.copy_in(None, memoryview(room.slots[p.slot]), p)
    copy_room_out(room, plan([ext_in._replace(base=ctypes.addressof(dst), idx=(0, 1, 2, 14, 15))], ss), cp)
    assert room.asked == [0, 1, 2]
    got, want = bytes(dst), bytes(src)
    for k, (a, b) in enumerate(zip((9, 3, 4, 5, 12), (0, 1, 2, 14, 15))):
        assert got[b * item:(b + 1) * item] == want[a * item:(a + 1) * item], k
    assert got[3 * item:14 * item] == bytes(11 * item)


def test_copy_handle():
    ran = []
    h = CpuCopier().submit(lambda: ran.append(1))
    assert ran == [1] and h.done() and h.error is None and not h.cancel()
    q = CopyHandle(lambda: ran.append(2))
    assert q.cancel() and q.done()
    q.run()
    assert ran == [1]
    bad = CopyHandle(lambda: 1 / 0)
    bad.run()
    assert bad.done() and isinstance(bad.error, ZeroDivisionError)
