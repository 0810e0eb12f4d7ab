"""The KVSTAGE NIXL backend's control channel from Python (docs/nixl.md, "The control channel"): a client that
speaks it honestly or not, for the hostile tests. Independent of the C++ code: written from the protocol."""
import hashlib
import hmac
import os
import socket
import struct

MAGIC = b"KVSNIXL1"
LABEL = b"kvstage nixl v1"
MSG_REQ, MSG_DESCS, MSG_ROOM, MSG_DONE, MSG_CANCEL, MSG_NOTIF = 1, 2, 3, 4, 5, 6
OP_READ, OP_WRITE = 0, 1


def derive_key(secret):
    return hmac.new(secret, LABEL, hashlib.sha256).digest()


def mac(key, *parts):
    h = hmac.new(key, b"", hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


class Dialer:
    """An initiator's end of one connection to a backend's listener (host, port)."""

    def __init__(self, host, port, key, prove=True):
        self.key = key
        self.s = socket.create_connection((host, port), timeout=10)
        self.cn = os.urandom(16)
        self.s.sendall(MAGIC + self.cn)
        reply = _recv_exact(self.s, 48)
        self.sn, proof = reply[:16], reply[16:]
        if not hmac.compare_digest(proof, mac(key, b"L", self.cn, self.sn)):
            raise ConnectionError("the listener did not prove the secret")
        self.tx_seq = self.rx_seq = 0
        if prove:
            self.s.sendall(mac(key, b"D", self.cn, self.sn))

    def seal(self, body, seq=None, key=None):
        hdr = struct.pack(">I", len(body))
        seq = self.tx_seq if seq is None else seq
        m = mac(key or self.key, b"d", self.cn, self.sn, struct.pack(">Q", seq), hdr, body)
        self.tx_seq += 1
        return hdr + body + m

    def send(self, body, **kw):
        f = self.seal(body, **kw)
        self.s.sendall(f)
        return f

    def recv(self):
        """The next frame's body, or None if the listener closed the connection."""
        try:
            hdr = _recv_exact(self.s, 4)
            (n,) = struct.unpack(">I", hdr)
            body = _recv_exact(self.s, n)
            m = _recv_exact(self.s, 32)
        except (ConnectionError, OSError):
            return None
        want = mac(self.key, b"l", self.cn, self.sn, struct.pack(">Q", self.rx_seq), hdr, body)
        if not hmac.compare_digest(m, want):
            raise ConnectionError("a reply with a bad MAC")
        self.rx_seq += 1
        return body

    def closed(self, timeout=10):
        """True once the listener has closed the connection (reads until EOF)."""
        self.s.settimeout(timeout)
        try:
            while True:
                if not self.s.recv(65536):
                    return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def close(self):
        self.s.close()


def req(xid, op, total, ndescs, agent=b"hostile", notif=None):
    b = struct.pack("<BQBQQ", MSG_REQ, xid, op, total, ndescs) + struct.pack("<H", len(agent)) + agent
    if notif is None:
        return b + b"\x00"
    return b + b"\x01" + struct.pack("<I", len(notif)) + notif


def descs(xid, spans):
    return struct.pack("<BQI", MSG_DESCS, xid, len(spans)) + b"".join(struct.pack("<QQQ", *s) for s in spans)


def room(xid, off, length, desc):
    assert len(desc) == 128
    return struct.pack("<BQQQ", MSG_ROOM, xid, off, length) + desc


def parse_done(body):
    t, xid, status = struct.unpack("<BQi", body)
    assert t == MSG_DONE
    return xid, status
