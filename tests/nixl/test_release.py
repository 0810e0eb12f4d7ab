"""Releases of in-flight transfers, held at every phase with the backend's test gate (test_gate: the progress
thread stops before its Nth copy step of a phase and tells a FIFO; the test opens it with another; no sleeps):
release_xfer_handle returns NIXL's SUCCESS at once, and from then on nothing of the request touches the
initiator's pages; deregister_memory and the forget hook are the same fence on the target's side."""
import os
import select
import threading
import time

import pytest

REGIONS, BLOCKS, BLOCK_LEN = 8, 64, 16384
CHUNK = 65536  # the proxies' slot size (conftest.SLOT_SIZE): one copy step
CANARY = 0xEE


class Gate:
    """The FIFOs of a test_gate DIR:PHASE:N."""

    def __init__(self, tmp_path, phase, n):
        self.dir = tmp_path / f"gate-{phase}-{n}"
        self.dir.mkdir()
        os.mkfifo(self.dir / "reached")
        os.mkfifo(self.dir / "open")
        self.spec = f"{self.dir}:{phase}:{n}"
        self.fd = os.open(self.dir / "reached", os.O_RDONLY | os.O_NONBLOCK)
        self.buf = b""

    def _line(self, timeout):
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                pytest.fail(f"gate {self.spec}: nothing within {timeout} s")
            got = os.read(self.fd, 256)
            if not got and b"\n" not in self.buf:
                pytest.fail(f"gate {self.spec}: closed early ({self.buf!r})")
            self.buf += got
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def reached(self, timeout=60):
        return self._line(timeout)

    def open(self, timeout=30):
        done = []
        t = threading.Thread(target=lambda: done.append(os.open(self.dir / "open", os.O_WRONLY)), daemon=True)
        t.start()
        t.join(timeout)
        assert done, f"gate {self.spec}: the engine never waited on it"
        os.write(done[0], b"x")
        os.close(done[0])

    def passed(self, timeout=60):
        return self._line(timeout)

    def close(self):
        os.close(self.fd)


def _ids(block_ids):
    return [r * BLOCKS + b for r in range(REGIONS) for b in block_ids]


def _setup(make_engine, two_proxies, prefill_env=None, decode_env=None, push=False):
    a, b = two_proxies
    prefill = make_engine("prefill", a, **(prefill_env or {}))
    decode = make_engine("decode", b, **(decode_env or {}))
    prefill.call("init", name="prefill-0")
    decode.call("init", name="decode-0")
    pbases = prefill.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=1)
    dbases = decode.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=None)
    decode.call("fill", block_ids=list(range(BLOCKS)), value=CANARY)
    if push:
        remote = prefill.call("add_remote", md=decode.call("md"))
        lh = prefill.call("prep_local")
        rh = prefill.call("prep_remote", agent=remote, bases=dbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    else:
        remote = decode.call("add_remote", md=prefill.call("md"))
        lh = decode.call("prep_local")
        rh = decode.call("prep_remote", agent=remote, bases=pbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    return prefill, decode, lh, rh


def _changed(eng, blocks):
    """Bytes of blocks (every region) that are no longer the canary."""
    data = eng.call("read_blocks", block_ids=blocks)
    return len(data) - data.count(bytes([CANARY]))


SRC, DST = [3 * i + 1 for i in range(16)], list(range(16))  # 2 MiB: 32 copy steps, two rooms


@pytest.mark.parametrize("n", [1, 3, 17])
def test_read_released_mid_scatter(make_engine, two_proxies, tmp_path, n):
    """decode is held before its Nth scatter step (slots landed, N-1 chunks copied into its pages); the release
    returns SUCCESS at once; the held step is skipped; after everything has stopped, exactly N-1 chunks of its
    pages changed: nothing landed after the release."""
    gate = Gate(tmp_path, "scatter", n)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, decode_env={"KVSTAGE_NIXL_TEST_GATE": gate.spec})
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"req-1:1")
    assert gate.reached() == f"reached scatter {n}"
    r = decode.call("release", xid=x["id"])
    assert r["before"] == "PROC" and r["seconds"] < 0.5, r
    gate.open()
    assert gate.passed() == "passed skipped"
    st = decode.wait_stats(lambda s: s["released_in_flight"] == 1 and s["xfers_ended"] == 1)
    assert st["xfers"] == 0 and st["rooms"] == 0
    assert st["chunks_scattered"] == n - 1 and st["steps_refused"] == 1
    prefill.wait_stats(lambda s: s["serves_ended"] == 1)
    assert _changed(decode, DST) == (n - 1) * CHUNK
    assert _changed(decode, list(range(16, BLOCKS))) == 0
    gate.close()


def test_read_released_before_anything_landed(make_engine, two_proxies, tmp_path):
    """The target (prefill) is held before its first gather step: nothing has reached decode's proxy; decode
    releases (SUCCESS at once); the target then copies and sends into a room that is gone: not a byte lands in
    decode's pages, and the target gets no notification (the transfer did not complete)."""
    gate = Gate(tmp_path, "gather", 1)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, prefill_env={"KVSTAGE_NIXL_TEST_GATE": gate.spec})
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"req-2:1")
    assert gate.reached() == "reached gather 1"
    r = decode.call("release", xid=x["id"])
    assert r["before"] == "PROC" and r["seconds"] < 0.5, r
    st = decode.wait_stats(lambda s: s["released_in_flight"] == 1 and s["xfers_ended"] == 1)
    assert st["rooms"] == 0
    gate.open()
    gate.passed()
    st = prefill.wait_stats(lambda s: s["serves_ended"] == 1)
    assert st["serves"] == 0 and st["rooms"] == 0 and st["served_read"] == 0
    assert decode.stats()["chunks_scattered"] == 0
    assert _changed(decode, list(range(BLOCKS))) == 0
    assert prefill.call("notifs", want=1, timeout=0) == []
    gate.close()


@pytest.mark.parametrize("n", [1, 5])
def test_write_released_mid_gather(make_engine, two_proxies, tmp_path, n):
    """A push (prefill WRITEs decode) held before the initiator's Nth gather step; its release returns SUCCESS at
    once; the room never completes, so the target scatters nothing (all or nothing) and gets no notification."""
    gate = Gate(tmp_path, "gather", n)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, prefill_env={"KVSTAGE_NIXL_TEST_GATE": gate.spec},
                                     push=True)
    src, dst = [5, 9, 11, 20, 21, 22, 40, 63], [1, 2, 3, 4, 10, 11, 12, 13]  # 1 MiB: one room
    x = prefill.call("xfer", kind="WRITE", local=lh, local_ids=_ids(src), remote=rh, remote_ids=_ids(dst),
                     notif=b"push-1")
    assert gate.reached() == f"reached gather {n}"
    r = prefill.call("release", xid=x["id"])
    assert r["before"] == "PROC" and r["seconds"] < 0.5, r
    gate.open()
    assert gate.passed() == "passed skipped"
    st = prefill.wait_stats(lambda s: s["released_in_flight"] == 1 and s["xfers_ended"] == 1)
    assert st["xfers"] == 0 and st["rooms"] == 0 and st["chunks_gathered"] == n - 1
    st = decode.wait_stats(lambda s: s["serves_ended"] == 1)
    assert st["serves"] == 0 and st["rooms"] == 0 and st["served_write"] == 0
    assert decode.stats()["chunks_scattered"] == 0
    assert _changed(decode, list(range(BLOCKS))) == 0
    assert decode.call("notifs", want=1, timeout=0) == []
    gate.close()


def test_target_deregisters_mid_scatter(make_engine, two_proxies, tmp_path):
    """The target of a push (decode) deregisters its memory while held before its 3rd scatter step:
    deregister_memory returns (the fence), the held step is skipped, 2 chunks and not a byte more changed in
    its pages, the initiator's transfer ends in ERR and no notification is given."""
    gate = Gate(tmp_path, "scatter", 3)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, decode_env={"KVSTAGE_NIXL_TEST_GATE": gate.spec},
                                     push=True)
    src, dst = [5, 9, 11, 20, 21, 22, 40, 63], [1, 2, 3, 4, 10, 11, 12, 13]
    x = prefill.call("xfer", kind="WRITE", local=lh, local_ids=_ids(src), remote=rh, remote_ids=_ids(dst),
                     notif=b"push-2")
    assert gate.reached() == "reached scatter 3"
    t = time.monotonic()
    assert decode.call("dereg") is True
    assert time.monotonic() - t < 0.5
    gate.open()
    assert gate.passed() == "passed skipped"
    assert prefill.call("wait", xid=x["id"]) == "ERR"
    st = decode.wait_stats(lambda s: s["serves_ended"] == 1)
    assert st["serves"] == 0 and st["rooms"] == 0 and st["served_write"] == 0
    assert _changed(decode, list(range(BLOCKS))) == 2 * CHUNK
    assert decode.call("notifs", want=1, timeout=0) == []
    gate.close()


def test_target_forgets_mid_gather(make_engine, two_proxies, tmp_path):
    """The target of a pull (prefill) forgets the request (kvstage_nixl_forget with the request id's prefix, as
    vLLM would at its abort timeout) while held before its 2nd gather step: the hook returns, the held step is
    skipped, decode's READ ends in ERR; a later READ carrying that request id is refused before any copy."""
    gate = Gate(tmp_path, "gather", 2)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, prefill_env={"KVSTAGE_NIXL_TEST_GATE": gate.spec})
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"req-5:1")
    assert gate.reached() == "reached gather 2"
    f = prefill.call("forget", prefix=b"req-5:")
    assert f["rc"] == 0 and f["seconds"] < 0.5, f
    gate.open()
    assert gate.passed() == "passed skipped"
    assert decode.call("wait", xid=x["id"]) == "ERR"
    st = prefill.wait_stats(lambda s: s["serves_ended"] == 1)
    assert st["serves"] == 0 and st["rooms"] == 0
    assert st["chunks_gathered"] == 1 and st["serves_stopped"] == 1
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"req-5:1")
    assert decode.call("wait", xid=x["id"]) == "ERR"
    st = prefill.wait_stats(lambda s: s["refused_forgotten"] == 1)
    assert st["chunks_gathered"] == 1
    assert prefill.call("notifs", want=1, timeout=0) == []
    # another request is served as ever
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids([20]), remote=rh, remote_ids=_ids([20]),
                    notif=b"req-6:1")
    assert decode.call("wait", xid=x["id"]) == "DONE"
    assert prefill.call("notifs", want=1) == [("decode-0", b"req-6:1")]


def test_many_releases_in_flight(make_engine, two_proxies):
    """20 READs released while in flight, without a gate (wherever they are): each release returns at once and
    SUCCESS; afterwards every page outside the ones a completed chunk was copied to holds its canary, and the
    engine and both proxies serve the next request as ever."""
    prefill, decode, lh, rh = _setup(make_engine, two_proxies)
    for k in range(20):
        x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                        notif=f"r{k}:1".encode())
        r = decode.call("release", xid=x["id"])
        assert r["seconds"] < 0.5, r
    st = decode.wait_stats(lambda s: s["xfers_ended"] == 20)
    assert st["xfers"] == 0 and st["rooms"] == 0
    assert _changed(decode, list(range(16, BLOCKS))) == 0
    assert _changed(decode, DST) == 0 or st["chunks_scattered"] > 0
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"after:1")
    assert decode.call("wait", xid=x["id"]) == "DONE"
    assert decode.call("read_blocks", block_ids=DST) == prefill.call("read_blocks", block_ids=SRC)


@pytest.mark.parametrize("backend", ["KVSTAGE", "KVSZCOPY"])
def test_release_against_a_zero_copy_backend(make_engine, two_proxies, tmp_path, both_plugins, backend):
    """The same transfer through KVSTAGE and through a test-only backend that writes straight into the registered
    pages (KVSZCOPY, as a NIC's DMA would; tests/nixl/zcopy_backend.cpp), held by the same gate before the 3rd
    64 KiB step that writes into the initiator's pages, then released: both releases return SUCCESS at once; the
    zero-copy backend's posted transfer goes on and writes into pages its engine was told were released (the
    gate reports the held step copied, and more than the two chunks from before the release changed); KVSTAGE
    skips the step and exactly two chunks changed. (A loopback READ in one agent: region 0's blocks 0..15 into
    its blocks 16..31, and region 1's likewise; 64 KiB blocks, 32 steps.)"""
    a, _ = two_proxies
    gate = Gate(tmp_path, "scatter", 3)
    eng = make_engine(f"solo-{backend}", a, KVSTAGE_NIXL_TEST_GATE=gate.spec, NIXL_PLUGIN_DIR=both_plugins)
    eng.call("init", name="solo-0", backend=backend)
    blocks, blen = 32, 65536
    bases = eng.call("alloc", regions=2, blocks=blocks, block_len=blen, seed=9)
    dst, src = list(range(16, 32)), list(range(16))
    eng.call("fill", block_ids=dst, value=CANARY)
    lh = eng.call("prep_local")
    sh = eng.call("prep_remote", agent="solo-0", bases=bases, blocks=blocks, block_len=blen)

    def ids(bl):
        return [r * blocks + b for r in range(2) for b in bl]

    x = eng.call("xfer", kind="READ", local=lh, local_ids=ids(dst), remote=sh, remote_ids=ids(src))
    assert gate.reached() == "reached scatter 3"
    r = eng.call("release", xid=x["id"])
    assert r["before"] == "PROC" and r["seconds"] < 0.5, r
    gate.open()
    if backend == "KVSZCOPY":
        assert gate.passed() == "passed copied"  # the held step ran after the release
        data = eng.call("read_blocks", block_ids=dst)
        changed = len(data) - data.count(bytes([CANARY]))
        assert changed >= 3 * 65536, changed
    else:
        assert gate.passed() == "passed skipped"
        st = eng.wait_stats(lambda s: s["released_in_flight"] == 1 and s["xfers_ended"] == 1 and s["serves_ended"] == 1)
        assert st["xfers"] == 0 and st["serves"] == 0 and st["rooms"] == 0
        data = eng.call("read_blocks", block_ids=dst)
        assert len(data) - data.count(bytes([CANARY])) == 2 * 65536
    gate.close()


def test_notif_on_abort_tells_the_target_its_pages_are_free(make_engine, two_proxies, tmp_path):
    """With notif_on_abort (KVSTAGE_NIXL_NOTIF_ON_ABORT=1) a READ target is notified also when its copy-out stopped
    short: decode releases the READ while prefill is held before its 2nd gather step; once prefill has stopped,
    its engine gets the request's notification (vLLM would free the blocks then, instead of at its timeout)."""
    gate = Gate(tmp_path, "gather", 2)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, prefill_env={
        "KVSTAGE_NIXL_TEST_GATE": gate.spec, "KVSTAGE_NIXL_NOTIF_ON_ABORT": "1"})
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"req-8:1")
    assert gate.reached() == "reached gather 2"
    decode.call("release", xid=x["id"])
    decode.wait_stats(lambda s: s["xfers_ended"] == 1)
    gate.open()
    gate.passed()
    st = prefill.wait_stats(lambda s: s["serves_ended"] == 1)
    assert st["served_read"] == 0
    assert prefill.call("notifs", want=1) == [("decode-0", b"req-8:1")]
    assert _changed(decode, list(range(BLOCKS))) == 0  # no room completed: nothing was scattered
    gate.close()


def test_serve_deadline_stops_a_late_copy_out(make_engine, two_proxies, tmp_path):
    """serve_deadline_ms (KVSTAGE_NIXL_SERVE_DEADLINE_MS=1000): a target does not copy out of its pages for a
    request that came longer ago than that. prefill is held before its 2nd gather step until the deadline has
    passed on the test's clock (the deadline's own clock, not a race); the step is then skipped, the READ fails,
    and a request within its deadline is served."""
    gate = Gate(tmp_path, "gather", 2)
    prefill, decode, lh, rh = _setup(make_engine, two_proxies, prefill_env={
        "KVSTAGE_NIXL_TEST_GATE": gate.spec, "KVSTAGE_NIXL_SERVE_DEADLINE_MS": "1000"})
    t = time.monotonic()
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids(DST), remote=rh, remote_ids=_ids(SRC),
                    notif=b"req-9:1")
    assert gate.reached() == "reached gather 2"
    time.sleep(max(0.0, 1.2 - (time.monotonic() - t)))  # the condition is the deadline's clock itself
    gate.open()
    assert gate.passed() == "passed skipped"
    assert decode.call("wait", xid=x["id"]) == "ERR"
    st = prefill.wait_stats(lambda s: s["serves_ended"] == 1)
    assert st["chunks_gathered"] == 1 and st["serves_stopped"] == 1
    assert prefill.call("notifs", want=1, timeout=0) == []
    x = decode.call("xfer", kind="READ", local=lh, local_ids=_ids([20]), remote=rh, remote_ids=_ids([20]),
                    notif=b"req-10:1")
    assert decode.call("wait", xid=x["id"]) == "DONE"
    gate.close()
