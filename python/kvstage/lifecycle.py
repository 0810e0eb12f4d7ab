"""Per-request lifecycle events, in the schema of vLLM's KV connector lifecycle trace (`vllm-kv-connector-v1`,
vLLM #52859), with kvstage's own points added; both connectors emit them, `kvstage-trace` joins them.

A record is one JSON object a line: vLLM's fields (schema, event, wall_ns, monotonic_ns, connector,
transfer_mode, component, role, request_id_hash, request_group_id_hash, remote_request_id_hash, block_count),
hashed and sampled exactly as vLLM does (BLAKE2b, 8 bytes, its personalisations; the sample decided by the
request id without vLLM's random suffix, so related ids share it), and kvstage's: room (the room's key,
"INSTANCE.ROOM.GEN" of its receiving proxy, which kvstaged's --trace-file lines name too; never its token),
bytes, chunks, tp_rank, final, status, phase, elapsed_ns. Request ids never leave the process unhashed.

Off unless the sample rate is above 0. emit() never blocks: it puts the record in a bounded queue and returns;
a writer thread of the sink's own formats and writes; a full queue drops the record and counts it (dropped).
Sinks: "log" (vLLM's way: logger "kvstage.lifecycle", info, each line after "KV_CONNECTOR_LIFECYCLE "), a file
path (appended, one write a batch of whole lines; "{pid}" in it becomes the process's id), "unix:PATH" (a
datagram a line to a unix socket; a line it refuses is dropped and counted).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import re
import socket
import struct
import threading
import time

SCHEMA = "vllm-kv-connector-v1"
SAMPLE_RATE_KEY = "kv_connector_lifecycle_trace_sample_rate"  # vLLM's kv_connector_extra_config key
LOG_PREFIX = "KV_CONNECTOR_LIFECYCLE "
DEFAULT_CAPACITY = 8192

# vLLM's events (KVConnectorLifecycleEvent)
TRANSFER_STAGED = "transfer_staged"
REGISTRATION_STAGED = "registration_staged"
REGISTRATION_QUEUED = "registration_queued"
REGISTRATION_SENT = "registration_sent"
REGISTRATION_RECEIVED = "registration_received"
REGISTRATION_FAILED = "registration_failed"
BLOCKS_MATCHED = "blocks_matched"
TRANSFER_STARTED = "transfer_started"
TRANSFER_COMPLETED = "transfer_completed"
TRANSFER_FAILED = "transfer_failed"
# kvstage's own points
SLOTS_LEASED = "slots_leased"        # the request's slots leased (producer; chunks)
COPY_IN_DONE = "copy_in_done"        # every byte copied from the blocks into slots (producer)
ROOM_OPEN = "room_open"              # a room of the request open on this side's proxy (room)
ROOM_FINAL = "room_final"            # a room's final event (final: send_done, recv_done, aborted, failed; status)
COPY_OUT_DONE = "copy_out_done"      # a room's bytes copied from slots into the blocks (consumer)
ABORT = "abort"                      # the engine aborted or preempted the request (phase: where it was)
ABORT_TO_FINAL = "abort_to_final"    # the last room's final after an abort (elapsed_ns since the abort)
ABORT_TO_REUSABLE = "abort_to_reusable"  # its blocks free for the engine after an abort (elapsed_ns)

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
_DESC = struct.Struct("<IHHQII")  # struct kvs_desc_wire's head: magic, version, flags, instance, room, gen
_DESC_MAGIC = 0x4B565344  # KVS_MAGIC_DESC


def request_group_id(request_id):
    """vLLM's: the request id without its trailing random suffix ("-" and 8 hex digits)."""
    return _RANDOM_SUFFIX.sub("", request_id)


def hash_request_id(request_id):
    """vLLM's hash of a request id: BLAKE2b, 8 bytes, personalised "vllm-kv-trace", as hex."""
    return hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8, person=b"vllm-kv-trace",
                           usedforsecurity=False).hexdigest()


def is_sampled(request_id, sample_rate):
    """vLLM's sampling decision: by the request's group id, so related ids share it."""
    if sample_rate <= 0.0:
        return False
    if sample_rate >= 1.0:
        return True
    d = hashlib.blake2b(request_group_id(str(request_id)).encode("utf-8"), digest_size=8, person=b"vllm-kv-sample",
                        usedforsecurity=False).digest()
    return int.from_bytes(d, "big") / (1 << 64) < sample_rate


def room_key(desc):
    """The key kvstaged's trace names a room by, from its 128-byte descriptor: "INSTANCE.ROOM.GEN" (the receiving
    proxy's instance in 16 hex digits, the room's index and generation there); None for bytes that are no
    descriptor. The token is not in it."""
    try:
        magic, _, _, instance, room, gen = _DESC.unpack_from(bytes(desc))
    except (struct.error, TypeError, ValueError):
        return None
    if magic != _DESC_MAGIC:
        return None
    return f"{instance:016x}.{room}.{gen}"


_FINALS = {1: "send_done", 2: "recv_done", 3: "aborted", 4: "failed"}  # KVS_EV_*


def final_name(event_type):
    """A final event's name in a record (KVS_EV_SEND_DONE: "send_done", ...)."""
    return _FINALS.get(int(event_type), str(event_type))


def sample_rate_of(value, what=SAMPLE_RATE_KEY):
    """value as a sample rate in [0, 1]; raises ValueError saying why."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(rate) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"{what} must be between 0.0 and 1.0, got {value!r}")
    return rate


class NoOpSink:
    """Tracing off: emit returns at once; nothing is kept per request."""
    enabled = False
    dropped = written = 0

    def emit(self, event, request_id, **fields):
        return

    def flush(self, timeout=None):
        return True

    def close(self):
        return


NOOP = NoOpSink()


class LifecycleSink:
    """A sampled, privacy-safe lifecycle sink writing on a thread of its own; emit never blocks (see the module)."""
    enabled = True

    def __init__(self, *, connector, transfer_mode, component, sample_rate, sink="log", capacity=DEFAULT_CAPACITY):
        self.sample_rate = sample_rate_of(sample_rate)
        if component not in ("scheduler", "worker"):
            raise ValueError(f"component must be scheduler or worker, got {component!r}")
        capacity = int(capacity)
        if capacity < 1:
            raise ValueError(f"the trace buffer must hold at least 1 record, got {capacity}")
        self.connector, self.transfer_mode, self.component = connector, transfer_mode, component
        self.sink = sink
        self._q = queue.Queue(capacity)
        self.dropped = self.written = 0  # dropped: emit's (queue full) and the socket's; written: by the writer only
        self._pending = 0  # records put, not yet written or dropped by the writer (flush)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._out = self._open(sink)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvstage-lifecycle", daemon=True)
        self._thread.start()

    def _open(self, sink):
        if sink == "log":
            self._log = logging.getLogger("kvstage.lifecycle")
            return None
        if sink.startswith("unix:"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            s.setblocking(False)
            try:
                s.connect(sink[5:])
            except OSError as e:
                s.close()
                raise ValueError(f"lifecycle trace sink {sink}: {e.strerror}") from None
            return s
        path = sink.replace("{pid}", str(os.getpid()))
        try:
            return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as e:
            raise ValueError(f"lifecycle trace file {path}: {e.strerror}") from None

    def emit(self, event, request_id, *, role, remote_request_id=None, block_count=None, **fields):
        """Queues one record of event for request_id, if sampled; drops and counts it when the queue is full."""
        if not is_sampled(request_id, self.sample_rate):
            return
        rec = (event, time.time_ns(), time.monotonic_ns(), role, str(request_id),
               None if remote_request_id is None else str(remote_request_id), block_count, fields)
        with self._lock:
            self._pending += 1
        try:
            self._q.put_nowait(rec)
        except queue.Full:
            with self._lock:
                self._pending -= 1
                self.dropped += 1
                self._idle.notify_all()

    def _line(self, rec):
        event, wall, mono, role, rid, remote, blocks, fields = rec
        d = {"schema": SCHEMA, "event": event, "wall_ns": wall, "monotonic_ns": mono, "connector": self.connector,
             "transfer_mode": self.transfer_mode, "component": self.component, "role": role,
             "request_id_hash": hash_request_id(rid), "request_group_id_hash": hash_request_id(request_group_id(rid))}
        if remote is not None:
            d["remote_request_id_hash"] = hash_request_id(remote)
        if blocks is not None:
            d["block_count"] = int(blocks)
        for k, v in fields.items():
            if v is not None:
                d[k] = v
        return json.dumps(d, separators=(",", ":"))

    def _run(self):
        while True:
            rec = self._q.get()
            if rec is None:
                return
            batch = [rec]
            while len(batch) < 256:
                try:
                    rec = self._q.get_nowait()
                except queue.Empty:
                    break
                if rec is None:
                    self._q.put(None)  # after this batch
                    break
                batch.append(rec)
            lost = self._write([self._line(r) for r in batch])
            with self._lock:
                self._pending -= len(batch)
                self.dropped += lost
                self.written += len(batch) - lost
                self._idle.notify_all()

    def _write(self, lines):
        """Writes lines; returns how many were lost. The writer thread's only blocking call."""
        if self._out is None:
            for ln in lines:
                self._log.info("%s%s", LOG_PREFIX, ln)
            return 0
        if isinstance(self._out, socket.socket):
            lost = 0
            for ln in lines:
                try:
                    self._out.send(ln.encode())
                except OSError:
                    lost += 1
            return lost
        data = ("\n".join(lines) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._out, data):]
        except OSError:
            return len(lines)
        return 0

    def flush(self, timeout=None):
        """Waits until every record emitted so far is written or dropped; returns False on timeout (tests, close)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout=5.0):
        """Writes what is queued (for at most timeout), stops the writer, closes the sink."""
        if self._closing:
            return
        self._closing = True
        self.flush(timeout)
        self._q.put(None)
        self._thread.join(timeout)
        if isinstance(self._out, socket.socket):
            self._out.close()
        elif self._out is not None:
            os.close(self._out)
        self._out = None


def create(*, connector, transfer_mode, component, sample_rate=None, sink=None, capacity=None):
    """The sink a connector's settings ask for: NOOP when the sample rate (else $KVSTAGE_TRACE_SAMPLE_RATE, else 0)
    is 0; the sink is sink, else $KVSTAGE_TRACE, else "log"; capacity, else $KVSTAGE_TRACE_BUFFER, else 8192.
    Raises ValueError for a bad value."""
    if sample_rate is None:
        sample_rate = os.environ.get("KVSTAGE_TRACE_SAMPLE_RATE", 0.0)
    rate = sample_rate_of(sample_rate)
    if rate == 0.0:
        return NOOP
    sink = sink or os.environ.get("KVSTAGE_TRACE") or "log"
    if capacity is None:
        capacity = os.environ.get("KVSTAGE_TRACE_BUFFER", DEFAULT_CAPACITY)
    try:
        capacity = int(capacity)
    except (TypeError, ValueError):
        raise ValueError(f"the trace buffer must be a number of records, got {capacity!r}") from None
    return LifecycleSink(connector=connector, transfer_mode=transfer_mode, component=component, sample_rate=rate,
                         sink=sink, capacity=capacity)
