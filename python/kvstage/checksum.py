"""End-to-end checksums of a room's bytes, between the engine that copies them into slots and the engine that
copies them out: CRC32C (libkvstage's kvs_crc32c, the proxy's chunk CRC), one per slot-sized chunk of the
payload, carried in the room itself after the payload. No proxy and no transport computes or reads them, so
they cover every hop: both engines' slots, both proxies, the wire, RDMA.

A room with checksums is payload + trailer bytes; the trailer, little-endian:
    magic u32 ("KVSC"), count u32 (the payload's chunks: ceil(payload / slot size)), count x CRC32C u32
chunk i being the payload's bytes [i * slot size, min((i + 1) * slot size, payload)). The sending side computes
each chunk's CRC as it copies into slots (fused with the copy on the CPU path: kvs_copy_crc32c, pieces combined
with kvs_crc32c_combine; a device piece's over the slot once the copy landed); the receiving side checks every
chunk against the slots before it copies anything out, and a mismatch fails the request (ChecksumMismatch)
without a byte of it delivered. Opt-in, and both sides must agree (a room's size says which): the decode side
names it in its request, the prefill side refuses a request that differs.
"""
from __future__ import annotations

import ctypes
import struct

from ._lib import lib

MAGIC = 0x4353564B  # "KVSC" as bytes
_HEAD = struct.Struct("<II")


class ChecksumMismatch(Exception):
    """A room's bytes differ from what the sending engine copied into its slots."""


def setting(value, what):
    """Whether a setting turns checksums on (True, 1, "1", "true", "yes", "on"; off: False, 0, "", None, "0",
    "false", "no", "off"); raises ValueError naming what for anything else."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{what} must be true or false, not {value!r}")


def chunks(payload, slot_size):
    """The payload's chunks (each one CRC)."""
    return -(-int(payload) // int(slot_size))


def trailer_size(payload, slot_size):
    """Bytes the trailer adds to a room of payload bytes."""
    return _HEAD.size + 4 * chunks(payload, slot_size)


def trailer(crcs):
    """The trailer's bytes for the chunks' CRCs, in order."""
    return _HEAD.pack(MAGIC, len(crcs)) + struct.pack(f"<{len(crcs)}I", *crcs)


def crc32c(addr, n, crc=0):
    """CRC32C of n bytes of host memory at addr, continuing crc."""
    return lib.kvs_crc32c(ctypes.c_void_p(addr), n, crc)


def copy_crc32c(dst, src, n):
    """Copies n bytes from host address src to dst; returns their CRC32C (one pass over memory)."""
    return lib.kvs_copy_crc32c(ctypes.c_void_p(dst), ctypes.c_void_p(src), n, 0)


def combine(pieces, length):
    """The CRC of one chunk of length bytes from its pieces [(offset in the chunk, nbytes, crc)], which must
    tile it exactly; raises ValueError when they do not."""
    crc, at = 0, 0
    for off, n, c in sorted(pieces):
        if off != at:
            raise ValueError(f"the pieces of a chunk leave a gap or overlap at byte {at} (next piece at {off})")
        crc = lib.kvs_crc32c_combine(crc, c, n) if at else c
        at += n
    if at != length:
        raise ValueError(f"the pieces of a chunk cover {at} of its {length} bytes")
    return crc


def verify(room, first, payload, slot_size):
    """Checks the room's chunks from slot `first` on (a share's part of a stage room: 0) against its trailer;
    raises ChecksumMismatch naming the first chunk that differs (or a trailer that is not one)."""
    n = chunks(payload, slot_size)
    want = _read(room, first, payload, _HEAD.size + 4 * n, slot_size)
    magic, count = _HEAD.unpack_from(want)
    if magic != MAGIC or count != n:
        raise ChecksumMismatch(f"the room's checksum trailer is damaged (magic {magic:#x}, {count} chunks; "
                               f"expected {MAGIC:#x}, {n})")
    crcs = struct.unpack_from(f"<{n}I", want, _HEAD.size)
    for i in range(n):
        ln = min(slot_size, payload - i * slot_size)
        got = crc32c(room.lease(first + i).address, ln)
        if got != crcs[i]:
            raise ChecksumMismatch(f"chunk {i} of {n}: CRC32C {got:#010x}, the sending engine's {crcs[i]:#010x}")


def _read(room, first, off, n, slot_size):
    """n bytes of the room from byte off (of its part from slot `first`), across slots."""
    out = bytearray()
    while n:
        s, so = divmod(off, slot_size)
        m = min(n, slot_size - so)
        out += ctypes.string_at(room.lease(first + s).address + so, m)
        off, n = off + m, n - m
    return bytes(out)
