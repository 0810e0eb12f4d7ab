"""The engines' side channel: authenticated, length-prefixed JSON messages over TCP, engine-neutral.

The SGLang backend (decode -> prefill rank: ``meta``, ``abort``) and the vLLM connector (decode worker ->
prefill worker: ``pull``, ``drop``) carry kvstage room descriptors over it. Every connection proves, both
ways, that its two ends hold the deployment's peer secret (the one the kvstaged proxies use), and every
frame is authenticated and sequenced, so nobody without the secret can abort a request or steer its KV.

The secret: $KVSTAGE_PEER_SECRET_FILE (a path; a regular file of 16 to 4096 bytes after one trailing newline
is stripped, readable or writable by nobody but its owner: judged like kvstaged's --peer-secret-file, ACLs
aside), else $KVSTAGE_PEER_SECRET (16 to 4096 bytes); the vLLM connector also takes kv_connector_extra_config
``kvstage_peer_secret_file``. Without one the side channel refuses to start (NO_SECRET, at the engine's
start-up). key = HMAC-SHA256(secret, b"kvstage side channel v1").

Protocol (one connection; cn, sn: 16 random bytes each; MAC = HMAC-SHA256(key, ...), 32 bytes):
  1. connector -> listener: b"KVSCHAN1" + cn
  2. listener -> connector: sn + MAC(b"L" + cn + sn); the connector checks it (or drops the connection: a
     listener without the secret never gets a descriptor)
  3. connector -> listener, every frame: len (4 bytes, big-endian, at most 1 MiB) + JSON body
     + MAC(b"C" + cn + sn + seq (8 bytes, big-endian, from 0) + len + body)
The listener never replies after step 2 (there are no replies; a reply would be MACed with b"R" and a
sequence of its own). It drops a connection on a bad magic, a bad MAC (tampered, replayed from another
connection, reordered, dropped frames all land here: the MAC covers the nonces and the sequence), a bad
length or a message valid() refuses; each is counted (FrameListener.stats()) and logged at most once per
LOG_EVERY_S seconds with the number suppressed.

The listener (FrameListener) is one thread running a selectors loop over every connection: at most
max_conns (64) serving at once. A newcomer past that takes the place of the oldest connection not yet proven, else
of the proven one heard from longest ago, which retires: the listener shuts its side (the connector sees the FIN
and its next message takes a new connection, as Peers does before every send) and still reads it for
RETIRE_GRACE_S (2 s), so a frame written before the FIN arrived still lands. A newcomer is never refused for want
of room: a holder of the secret cannot lock a listener by keeping max_conns connections alive (issue 39), it only
makes them take turns. At most max_conns more may be retiring at once (past that the oldest is closed). Deadlines:
5 s for the handshake, 60 s without a complete frame. accept() errors never end it: they are logged (rate-limited)
and, for EMFILE/ENFILE/ENOBUFS/ENOMEM, accepting pauses briefly while the loop keeps serving the connections it has.
"""
from __future__ import annotations

import base64
import collections
import errno as _errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import selectors
import socket
import stat as _stat
import struct
import threading
import time

logger = logging.getLogger(__name__)

MAGIC = b"KVSCHAN1"
NONCE_SIZE = 16
MAC_SIZE = 32
KEY_LABEL = b"kvstage side channel v1"
SECRET_MIN, SECRET_MAX = 16, 4096
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 60.0
MAX_CONNS = 64
RETIRE_GRACE_S = 2.0  # a retiring connection is still read this long: well above a frame's time in flight
LOG_EVERY_S = 5.0
ACCEPT_PAUSE_S = 0.25

_MAX_MSG = 1 << 20
_HDR = struct.Struct("!I")
_SEQ = struct.Struct("!Q")

NO_SECRET = ("kvstage side channel: no peer secret: set KVSTAGE_PEER_SECRET_FILE to a file only this user can read "
             "(16-4096 bytes; the deployment's peer secret, as kvstaged's --peer-secret-file), or KVSTAGE_PEER_SECRET")


class SecretError(RuntimeError):
    """No peer secret, or one that is refused; the message says which and what to do."""


class HandshakeError(ConnectionError):
    """The other end did not complete the side channel's handshake (no or another peer secret, or not a
    kvstage side channel); an OSError, so a connector treats it as a failed send."""


# ---------------------------------------------------------------------------------------------
# The secret and the key.
# ---------------------------------------------------------------------------------------------

def _strip_one_newline(raw):
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    if raw.endswith(b"\n"):
        return raw[:-1]
    return raw


_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_OTHER = 0x02, 0x04, 0x08, 0x20


def _acl_lets_only_us(fd, path):
    """kvstaged's rule (proxy/peer/secret.c): True if the file has a POSIX ACL whose entries let in only its owner
    and our uid (no group, no others, nobody else named); False if it has none (its mode means what it says);
    raises SecretError naming whom an ACL lets in. Read from the xattr the kernel keeps it in: version 2, then
    8-byte entries (tag, perm, id), little-endian."""
    try:
        x = os.getxattr(fd, "system.posix_acl_access")
    except OSError:
        return False  # none, or a file system without ACLs
    if len(x) < 4 or (len(x) - 4) % 8 or struct.unpack_from("<I", x)[0] != 2:
        raise SecretError(f"kvstage side channel: peer secret file {path}: an ACL this reader cannot parse; "
                          f"chmod 600 it and drop the ACL (setfacl -b)")
    for off in range(4, len(x), 8):
        tag, perm, uid = struct.unpack_from("<HHI", x, off)
        if not perm & 7:
            continue
        if tag == _ACL_USER and uid != os.geteuid():
            raise SecretError(f"kvstage side channel: peer secret file {path}: its ACL lets uid {uid} in; only ours "
                              f"(uid {os.geteuid()}) may be named")
        if tag in (_ACL_GROUP_OBJ, _ACL_GROUP, _ACL_OTHER):
            who = "others" if tag == _ACL_OTHER else "a group"
            raise SecretError(f"kvstage side channel: peer secret file {path}: its ACL lets {who} in; chmod 600 it "
                              f"and drop the ACL (setfacl -b)")
    return True


def read_secret_file(path):
    """Returns the secret in the file at path, or raises SecretError saying why it is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SecretError(f"kvstage side channel: peer secret file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise SecretError(f"kvstage side channel: peer secret file {path}: not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise SecretError(f"kvstage side channel: peer secret file {path}: owned by uid {st.st_uid}; it must be "
                              f"ours (uid {os.geteuid()}) or root's")
        m = st.st_mode & 0o077
        # Group bits and no others': maybe an ACL's mask (systemd's LoadCredential= copy: 0400 plus our uid).
        if m and (m & 0o007 or not _acl_lets_only_us(fd, path)):
            who = "its group and others" if (m & 0o070) and (m & 0o007) else "its group" if m & 0o070 else "others"
            raise SecretError(f"kvstage side channel: peer secret file {path}: {who} can read or write it "
                              f"(mode {st.st_mode & 0o777:04o}); chmod 600 it")
        if st.st_size > SECRET_MAX + 2:
            raise SecretError(f"kvstage side channel: peer secret file {path}: {st.st_size} bytes; "
                              f"a secret is {SECRET_MIN} to {SECRET_MAX} bytes")
        raw = b""
        while True:
            got = os.read(fd, SECRET_MAX + 3 - len(raw))
            if not got:
                break
            raw += got
    finally:
        os.close(fd)
    secret = _strip_one_newline(raw)
    if not SECRET_MIN <= len(secret) <= SECRET_MAX:
        raise SecretError(f"kvstage side channel: peer secret file {path}: {len(secret)} bytes; "
                          f"a secret is {SECRET_MIN} to {SECRET_MAX} bytes")
    return secret


def load_secret(path=None):
    """The peer secret: the file at path if given, else $KVSTAGE_PEER_SECRET_FILE, else $KVSTAGE_PEER_SECRET.
    Raises SecretError (NO_SECRET when there is none)."""
    path = path or os.environ.get("KVSTAGE_PEER_SECRET_FILE")
    if path:
        return read_secret_file(path)
    v = os.environ.get("KVSTAGE_PEER_SECRET")
    if v:
        secret = os.fsencode(v)
        if not SECRET_MIN <= len(secret) <= SECRET_MAX:
            raise SecretError(f"kvstage side channel: $KVSTAGE_PEER_SECRET is {len(secret)} bytes; "
                              f"a secret is {SECRET_MIN} to {SECRET_MAX} bytes")
        return secret
    raise SecretError(NO_SECRET)


def derive_key(secret):
    return hmac.new(bytes(secret), KEY_LABEL, hashlib.sha256).digest()


def load_key(path=None):
    """derive_key(load_secret(path)): what the engines call at start-up."""
    return derive_key(load_secret(path))


def _mac(key, *parts):
    h = hmac.new(key, b"", hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def listener_proof(key, cn, sn):
    return _mac(key, b"L", cn, sn)


def frame_mac(key, cn, sn, seq, hdr, body):
    return _mac(key, b"C", cn, sn, _SEQ.pack(seq), hdr, body)


# ---------------------------------------------------------------------------------------------
# Frames and the connector's end.
# ---------------------------------------------------------------------------------------------

def _frame(msg):
    """length + JSON body of one message (unauthenticated: SideConnection.send adds the MAC)."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > _MAX_MSG:
        raise ValueError("side-channel message too large")
    return _HDR.pack(len(body)) + body


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return bytes(buf)


def desc_bytes(d):
    """Returns the room descriptor a message's desc (a base64 str) carries, or raises ValueError: the one check of
    it, for both engines."""
    from ._lib import KVS_ROOM_DESC_SIZE
    if not isinstance(d, str) or len(d) > 4 * KVS_ROOM_DESC_SIZE:
        raise ValueError("desc is not a base64 string of a room descriptor")
    try:
        raw = base64.b64decode(d, validate=True)
    except (ValueError, TypeError):
        raise ValueError("desc is not valid base64") from None
    if len(raw) != KVS_ROOM_DESC_SIZE:
        raise ValueError(f"desc is {len(raw)} bytes, a room descriptor {KVS_ROOM_DESC_SIZE}")
    return raw


class SideConnection:
    """The connector's end of one authenticated connection: send(msg) frames, MACs and sends one message."""

    def __init__(self, sock, key, cn, sn):
        self.sock, self._key, self._cn, self._sn = sock, key, cn, sn
        self._seq = 0

    def seal(self, msg):
        """The bytes of msg as the next frame (advances the sequence)."""
        data = _frame(msg)
        mac = frame_mac(self._key, self._cn, self._sn, self._seq, data[:_HDR.size], data[_HDR.size:])
        self._seq += 1
        return data + mac

    def send(self, msg):
        self.sock.sendall(self.seal(msg))

    def fileno(self):
        return self.sock.fileno()

    def close(self):
        self.sock.close()


class Peers:
    """A connector's cached connections, one per listener: send(host, port, msg) reuses one while it is fresh and
    the listener has not hung up, else connects anew, once. A connection quiet for half the listener's idle deadline
    is replaced before use: the listener may be closing it as we write, and a frame written into that close would be
    lost without an error. After a failure the endpoint is given up on for DEAD_S, so a dead listener costs one
    connect timeout, not one per message. For one thread."""

    DEAD_S = 5.0

    def __init__(self, key, idle_timeout=IDLE_TIMEOUT_S):
        self._key, self._fresh_s = key, idle_timeout / 2
        self._conns, self._last, self._dead_until = {}, {}, {}

    def _usable(self, ep, now):
        c = self._conns.get(ep)
        if c is None:
            return None
        # The listener never writes after its hello: readable means it hung up.
        if now - self._last[ep] < self._fresh_s and not select.select([c], [], [], 0)[0]:
            return c
        self._forget(ep)
        return None

    def _forget(self, ep):
        c = self._conns.pop(ep, None)
        self._last.pop(ep, None)
        if c is not None:
            c.close()

    def send(self, host, port, msg, timeout=5.0):
        """Sends msg; raises ValueError (too large, before anything is sent) or OSError (HandshakeError when the
        listener did not prove it holds the secret)."""
        _frame(msg)
        ep = (str(host), int(port))
        now = time.monotonic()
        if now < self._dead_until.get(ep, 0):
            raise OSError(_errno.EHOSTUNREACH, f"{host}:{port} failed moments ago")
        for attempt in (0, 1):
            c = self._usable(ep, now)
            fresh = c is None
            try:
                if fresh:
                    c = self._conns[ep] = connect(host, port, self._key, timeout=timeout)
                c.send(msg)
                self._last[ep] = time.monotonic()
                return
            except OSError:
                self._forget(ep)
                if attempt or fresh:  # a fresh connection failed: no second try
                    self._dead_until[ep] = time.monotonic() + self.DEAD_S
                    raise

    def close(self):
        for ep in list(self._conns):
            self._forget(ep)


class _Sender:
    """One endpoint's queue and thread (AsyncPeers): its messages, in order, through a Peers of its own."""

    def __init__(self, owner, ep):
        self.owner, self.ep = owner, ep
        self.q = collections.deque()  # (msg, on_error)
        self.cv = threading.Condition(owner._lock)
        self.alive, self.dead_until = True, 0.0
        self.thread = threading.Thread(target=self._run, name=f"kvstage-side-{ep[0]}:{ep[1]}", daemon=True)
        self.thread.start()

    def put(self, msg, on_error):
        """Queues msg (the owner's lock held); raises OSError while the endpoint is given up on or its queue full."""
        if time.monotonic() < self.dead_until:
            raise OSError(_errno.EHOSTUNREACH, f"{self.ep[0]}:{self.ep[1]} failed moments ago")
        if len(self.q) >= self.owner.QUEUE_MAX:
            raise OSError(_errno.ENOBUFS, f"{len(self.q)} messages already wait for {self.ep[0]}:{self.ep[1]}")
        self.q.append((msg, on_error))
        self.cv.notify()

    def _run(self):
        peers = Peers(self.owner._key, self.owner._idle_timeout)
        try:
            while True:
                with self.cv:
                    if not self.q and not self.owner._closed:
                        self.cv.wait(self.owner.IDLE_S)
                    if not self.q or self.owner._closed:  # idle, or closing: this endpoint's thread ends
                        self.alive = False
                        if self.owner._senders.get(self.ep) is self:
                            del self.owner._senders[self.ep]
                        failed, self.q = list(self.q), collections.deque()
                        break
                    msg, on_error = self.q.popleft()
                try:
                    peers.send(self.ep[0], self.ep[1], msg)
                except OSError as e:
                    with self.cv:  # what waits behind it would fail the same way: now, not one timeout each
                        self.dead_until = time.monotonic() + Peers.DEAD_S
                        failed, self.q = [(msg, on_error), *self.q], collections.deque()
                    _report(failed, e)
            _report(failed, OSError(_errno.ESHUTDOWN, "the side channel is closing"))
        finally:
            peers.close()


def _report(failed, exc):
    for _, on_error in failed:
        if on_error is not None:
            try:
                on_error(exc)
            except Exception:
                logger.exception("kvstage side channel: a send's error callback failed")


class AsyncPeers:
    """Peers for an engine's scheduler or worker thread, which must never wait on a peer: send() only queues the
    message (microseconds); a thread per endpoint connects, proves the secret and writes, in order, so a slow or
    silent endpoint delays only the messages addressed to it (issue 39: one silent prefill rank froze SGLang's
    decode scheduler for 5 s a request, and a vLLM worker's loads for honest prefills waited behind it). A message
    that cannot be delivered goes to its on_error(exc), called on that endpoint's thread: it must only hand work to
    the engine's own thread. send() raises at once, without queuing, ValueError (too large), or OSError while the
    endpoint is given up on (Peers.DEAD_S after a failure), when QUEUE_MAX messages already wait for it, or when
    MAX_ENDPOINTS endpoints have threads. A thread idle for IDLE_S ends; the next message starts another."""

    QUEUE_MAX = 1024
    MAX_ENDPOINTS = 256
    IDLE_S = 30.0

    def __init__(self, key, idle_timeout=IDLE_TIMEOUT_S):
        self._key, self._idle_timeout = key, idle_timeout
        self._lock = threading.Lock()
        self._senders = {}  # (host, port) -> _Sender
        self._closed = False

    def send(self, host, port, msg, on_error=None):
        """Queues msg for (host, port); raises ValueError or OSError (see the class) without queuing it."""
        _frame(msg)
        ep = (str(host), int(port))
        with self._lock:
            if self._closed:
                raise OSError(_errno.ESHUTDOWN, "the side channel is closed")
            s = self._senders.get(ep)
            if s is None:
                if len(self._senders) >= self.MAX_ENDPOINTS:
                    raise OSError(_errno.EMFILE, f"{len(self._senders)} side-channel endpoints have threads already")
                s = self._senders[ep] = _Sender(self, ep)
            s.put(msg, on_error)

    def close(self, timeout=5.0):
        """Stops every endpoint's thread; what still waits goes to its on_error (ESHUTDOWN). Returns within about
        timeout seconds (a thread inside a connect ends when that does)."""
        with self._lock:
            self._closed = True
            senders = list(self._senders.values())
            for s in senders:
                s.cv.notify_all()
        end = time.monotonic() + timeout
        for s in senders:
            s.thread.join(max(0.0, end - time.monotonic()))


def handshake(sock, key):
    """The connector's half of the handshake on a connected socket; returns a SideConnection, or raises
    HandshakeError (the listener did not prove it holds the secret) or OSError."""
    cn = secrets.token_bytes(NONCE_SIZE)
    try:
        sock.sendall(MAGIC + cn)
        reply = _recv_exact(sock, NONCE_SIZE + MAC_SIZE)
    except (ConnectionResetError, BrokenPipeError):
        reply = None
    if reply is None:
        raise HandshakeError(_errno.ECONNRESET, "side-channel handshake failed: the listener closed the connection "
                             "(not a kvstage side channel, or it is full)")
    sn, proof = reply[:NONCE_SIZE], reply[NONCE_SIZE:]
    if not hmac.compare_digest(proof, listener_proof(key, cn, sn)):
        raise HandshakeError(_errno.EACCES, "side-channel handshake failed: the listener did not prove it holds "
                             "the peer secret (a different KVSTAGE_PEER_SECRET?)")
    return SideConnection(sock, key, cn, sn)


def connect(host, port, key, timeout=5.0):
    """Opens an authenticated connection to a listener; raises OSError (HandshakeError for a failed handshake)."""
    s = socket.create_connection((str(host).strip("[]"), int(port)), timeout=timeout)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return handshake(s, key)
    except BaseException:
        s.close()
        raise


# ---------------------------------------------------------------------------------------------
# The listener.
# ---------------------------------------------------------------------------------------------

class _RateLog:
    """At most one line per every seconds for each kind; the next line says how many were suppressed."""

    def __init__(self, every=LOG_EVERY_S):
        self.every = every
        self._last, self._suppressed = {}, {}
        self.lines = 0

    def __call__(self, kind, fmt, *args):
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        n = self._suppressed.pop(kind, 0)
        self.lines += 1
        logger.warning(fmt + (" (%d more like it suppressed)" if n else ""), *(args + ((n,) if n else ())))


class _Conn:
    __slots__ = ("sock", "buf", "cn", "sn", "seq", "since", "peer", "retire_at")

    def __init__(self, sock, peer, now):
        self.sock, self.peer, self.since = sock, peer, now
        self.buf = bytearray()
        self.cn = self.sn = None  # sn set: the listener has answered the hello
        self.seq = 0  # frames that passed their MAC: > 0, the connector is proven to hold the secret
        self.retire_at = None  # retiring: our side shut, still read until then


_PAUSE_ERRNOS = (_errno.EMFILE, _errno.ENFILE, _errno.ENOBUFS, _errno.ENOMEM)


class FrameListener:
    """A side channel's listening end on (host, port): authenticates every connection with key, and hands every
    message that valid(msg) accepts to deliver(msg) (on the listener's one thread); anything else drops its
    connection, counted in stats() and logged (rate-limited). Shared by the SGLang backend and the vLLM
    connector. wait_stats(pred, timeout) waits until pred(stats()) (tests use it as a barrier)."""

    COUNTERS = ("accepted", "handshakes", "frames", "bad_magic", "bad_mac", "bad_length", "malformed",
                "handshake_timeouts", "idle_timeouts", "evicted", "retired", "accept_errors", "accept_pauses",
                "closed_by_peer")

    def __init__(self, host, port, deliver, valid, name, key=None, *, max_conns=MAX_CONNS,
                 handshake_timeout=HANDSHAKE_TIMEOUT_S, idle_timeout=IDLE_TIMEOUT_S, log_every=LOG_EVERY_S):
        if key is None:
            key = load_key()
        self._key = bytes(key)
        self._deliver, self._valid, self._name = deliver, valid, name
        self.max_conns, self.handshake_timeout, self.idle_timeout = max_conns, handshake_timeout, idle_timeout
        self._log = _RateLog(log_every)
        self._cond = threading.Condition()
        self._stats = dict.fromkeys(self.COUNTERS, 0)
        self._stats["open"] = self._stats["max_open"] = 0
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(fam, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host.strip("[]"), port))
            self._sock.listen(128)
            self._sock.setblocking(False)
            self.port = self._sock.getsockname()[1]
            self._sel = selectors.DefaultSelector()
            self._wr, self._ww = socket.socketpair()
            self._wr.setblocking(False)
            self._sel.register(self._wr, selectors.EVENT_READ, None)
            self._sel.register(self._sock, selectors.EVENT_READ, "listen")
        except BaseException:
            self._sock.close()
            raise
        self._conns = {}  # fileno -> _Conn
        self._paused_until = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvstage-{name}-listen", daemon=True)
        self._thread.start()

    # -- counters -------------------------------------------------------------------------------
    def _count(self, k, n=1):
        with self._cond:
            self._stats[k] += n
            self._stats["open"] = len(self._conns)
            self._stats["max_open"] = max(self._stats["max_open"], len(self._conns))
            self._cond.notify_all()

    def stats(self):
        with self._cond:
            return dict(self._stats, log_lines=self._log.lines)

    def wait_stats(self, pred, timeout):
        """Waits until pred(stats()) holds; returns whether it did within timeout seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(dict(self._stats, log_lines=self._log.lines)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self):
        try:
            while not self._closed:
                try:
                    self._step()
                except Exception as e:  # never let the loop die of one surprise
                    self._log("loop", "kvstage %s side channel: %r", self._name, e)
        finally:
            for c in list(self._conns.values()):
                self._drop(c, None)
            try:
                self._sel.close()
            except Exception:
                pass

    def _step(self):
        now = time.monotonic()
        timeout = self._expire(now)
        if self._paused_until is not None:
            if now >= self._paused_until:
                self._paused_until = None
                self._sel.register(self._sock, selectors.EVENT_READ, "listen")
            else:
                timeout = min(timeout, self._paused_until - now)
        for k, _ in self._sel.select(max(timeout, 0)):
            if self._closed:
                return
            if k.data is None:
                try:
                    self._wr.recv(4096)
                except OSError:
                    pass
            elif k.data == "listen":
                self._accept()
            else:
                self._readable(k.data)

    def _expire(self, now):
        """Drops connections past their deadline; returns the seconds until the next deadline."""
        nxt = 1.0
        for c in list(self._conns.values()):
            if c.retire_at is not None:
                if now >= c.retire_at:
                    self._drop(c, None)
                else:
                    nxt = min(nxt, c.retire_at - now)
                continue
            # The hello alone proves nothing (anyone can send 24 bytes): until a frame passes its MAC a connection
            # stays on the handshake deadline from its accept, and evictable.
            if c.seq == 0:
                left = c.since + self.handshake_timeout - now
                kind = "handshake_timeouts"
            else:
                left = c.since + self.idle_timeout - now
                kind = "idle_timeouts"
            if left <= 0:
                self._drop(c, kind)
            else:
                nxt = min(nxt, left)
        return nxt

    def _accept(self):
        for _ in range(64):
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if self._closed:
                    return
                self._count("accept_errors")
                self._log("accept", "kvstage %s side channel: accept failed: %s", self._name, e)
                if e.errno in _PAUSE_ERRNOS:  # pause accepting; the loop keeps serving what it has
                    self._count("accept_pauses")
                    self._sel.unregister(self._sock)
                    self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    return
                continue  # ECONNABORTED, EPROTO, ...: that one connection is gone
            now = time.monotonic()
            serving = [c for c in self._conns.values() if c.retire_at is None]
            if len(serving) >= self.max_conns:
                half = [c for c in serving if c.seq == 0]
                if half:
                    self._drop(min(half, key=lambda c: c.since), "evicted")
                else:
                    self._retire(min(serving, key=lambda c: c.since), now)
            sock.setblocking(False)
            c = _Conn(sock, peer, now)
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
            self._count("accepted")

    def _retire(self, c, now):
        """Makes way for a newcomer without losing a frame: shuts our side of c (its connector sees the FIN and
        connects anew for its next message) and keeps reading it for RETIRE_GRACE_S."""
        retiring = [r for r in self._conns.values() if r.retire_at is not None]
        if len(retiring) >= self.max_conns:
            self._drop(min(retiring, key=lambda r: r.retire_at), None)
        try:
            c.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._drop(c, "closed_by_peer")
        c.retire_at = now + RETIRE_GRACE_S
        self._count("retired")

    def _drop(self, c, kind, why=None):
        if self._conns.get(c.sock.fileno()) is c:
            del self._conns[c.sock.fileno()]
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        if kind is not None:
            self._count(kind)
            if why is not None:
                self._log(kind, "kvstage %s side channel: dropped a connection from %s: %s", self._name, c.peer, why)
        else:
            self._count("closed_by_peer", 0)
        c.sock.close()

    def _readable(self, c):
        try:
            got = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = b""
        if not got:
            return self._drop(c, "closed_by_peer")
        c.buf += got
        if c.sn is None:
            if len(c.buf) < len(MAGIC) + NONCE_SIZE:
                if not MAGIC.startswith(bytes(c.buf[:len(MAGIC)])):
                    return self._drop(c, "bad_magic", "not a kvstage side channel handshake")
                return
            if bytes(c.buf[:len(MAGIC)]) != MAGIC:
                return self._drop(c, "bad_magic", "not a kvstage side channel handshake")
            c.cn = bytes(c.buf[len(MAGIC):len(MAGIC) + NONCE_SIZE])
            del c.buf[:len(MAGIC) + NONCE_SIZE]
            sn = secrets.token_bytes(NONCE_SIZE)
            try:
                sent = c.sock.send(sn + listener_proof(self._key, c.cn, sn))
            except OSError:
                sent = 0
            if sent != NONCE_SIZE + MAC_SIZE:
                return self._drop(c, "closed_by_peer")
            c.sn = sn
            self._count("handshakes")
        while len(c.buf) >= _HDR.size:
            (n,) = _HDR.unpack_from(c.buf)
            if n > _MAX_MSG:
                return self._drop(c, "bad_length", f"a {n}-byte message")
            end = _HDR.size + n + MAC_SIZE
            if len(c.buf) < end:
                return
            hdr, body = bytes(c.buf[:_HDR.size]), bytes(c.buf[_HDR.size:_HDR.size + n])
            mac = bytes(c.buf[_HDR.size + n:end])
            if not hmac.compare_digest(mac, frame_mac(self._key, c.cn, c.sn, c.seq, hdr, body)):
                return self._drop(c, "bad_mac", "a frame with a bad MAC (another secret, tampered, replayed or "
                                  "out of order)")
            del c.buf[:end]
            c.seq += 1
            c.since = time.monotonic()
            try:
                msg = json.loads(body)
            except ValueError:
                msg = None
            if not isinstance(msg, dict) or not self._valid(msg):
                return self._drop(c, "malformed", "not a kvstage message")
            self._count("frames")
            try:
                self._deliver(msg)
            except Exception as e:
                self._log("deliver", "kvstage %s side channel: delivering a message failed: %r", self._name, e)

    def close(self):
        """Stops the loop and closes every connection and the listening socket; returns once the thread ended
        (at most a few seconds)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ww.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        try:
            self._sel.unregister(self._sock)
        except Exception:
            pass
        self._sock.close()
        self._wr.close()
        self._ww.close()
