"""Connecting, geometry, leases and errors."""
import errno
import os

import pytest

import kvstage
from conftest import SLOT_SIZE, SLOTS


def test_version_is_the_librarys():
    assert kvstage.__version__ == "0.1.0"
    assert os.path.exists(kvstage.LIB_PATH) or "/" not in kvstage.LIB_PATH


def test_connect_and_close(proxy):
    c = kvstage.Client(proxy.socket)
    assert not c.closed
    c.close()
    assert c.closed
    c.close()  # idempotent
    with pytest.raises(kvstage.BadHandle) as e:
        c.acquire(1)
    assert e.value.errno == errno.EBADF


def test_context_manager_closes(proxy):
    with kvstage.Client(proxy.socket) as c:
        assert c.slot_count == SLOTS
    assert c.closed


def test_connect_to_nothing_raises_with_errno_and_message(tmp_path):
    with pytest.raises(kvstage.KvstageError) as e:
        kvstage.Client(str(tmp_path / "nobody.sock"))
    assert e.value.errno == errno.ENOENT and e.value.name == "ENOENT"
    assert e.value.func == "kvs_connect"
    assert e.value.message == kvstage.strerror(-errno.ENOENT) == "no proxy socket at that path"
    assert "no proxy socket at that path" in str(e.value)
    assert isinstance(e.value, OSError)


def test_geometry(client):
    assert client.slot_size == SLOT_SIZE
    assert client.slot_count == SLOTS
    assert client.max_rooms == 256  # kvstaged's --client-rooms default


def test_set_sync_timeout(client):
    client.set_sync_timeout(5000)
    client.set_sync_timeout(None)
    client.set_sync_timeout(-1)
    with pytest.raises(kvstage.KvstageError) as e:
        client.set_sync_timeout(0)
    assert e.value.errno == errno.EINVAL and type(e.value) is kvstage.KvstageError


def test_acquire_and_release(client):
    leases = client.acquire(3)
    assert len(leases) == 3 and len({lease.slot for lease in leases}) == 3
    assert all(0 <= lease.slot < SLOTS and not lease.readonly for lease in leases)
    for lease in leases:
        assert len(lease.view()) == SLOT_SIZE
        client.release(lease)


def test_release_twice_is_stale(client):
    (lease,) = client.acquire(1)
    client.release(lease)
    with pytest.raises(kvstage.StaleLease) as e:
        client.release(lease)
    assert e.value.errno == errno.ESTALE and e.value.func == "kvs_release"
    with pytest.raises(kvstage.StaleLease):
        lease.view()


def test_a_reused_slot_refuses_the_old_lease(client):
    # slot 0 comes back with a new epoch: the old lease names the old one
    old = client.acquire(SLOTS)
    for lease in old:
        client.release(lease)
    new = client.acquire(SLOTS)
    again = {lease.slot: lease for lease in new}
    for lease in old:
        assert again[lease.slot].epoch != lease.epoch
        with pytest.raises(kvstage.StaleLease):
            client.release(lease)
        with pytest.raises(kvstage.StaleLease):
            lease.view()


def test_pool_exhausted(client, proxy):
    first = client.acquire(SLOTS - 2)
    with pytest.raises(kvstage.PoolExhausted) as e:
        client.acquire(3)  # more than is left: none leased
    assert e.value.errno == errno.ENOBUFS
    with kvstage.Client(proxy.socket) as other:
        with pytest.raises(kvstage.PoolExhausted):
            other.acquire(3)
        assert len(other.acquire(2)) == 2  # what was left is still there
    client.release(first[0])
    assert len(client.acquire(1)) == 1


def test_more_than_the_whole_pool_is_invalid(client):
    with pytest.raises(kvstage.KvstageError) as e:
        client.acquire(SLOTS + 1)
    assert e.value.errno == errno.EINVAL  # libkvstage: n > slot_count is -EINVAL, not -ENOBUFS
    with pytest.raises(kvstage.KvstageError):
        client.acquire(0)


def test_someone_elses_lease(pair):
    tx, rx = pair
    (lease,) = tx.acquire(1)
    with pytest.raises(ValueError):
        rx.release(lease)  # refused in Python: another Client's object
    forged = kvstage.Lease(rx, lease.slot, lease.epoch)
    with pytest.raises(kvstage.PermissionDenied) as e:
        rx.release(forged)
    assert e.value.errno == errno.EPERM
    with pytest.raises(kvstage.PermissionDenied):
        forged.view()


def test_out_of_range_arguments_are_refused_in_python(client):
    with pytest.raises(ValueError):
        client.acquire(-1)
    with pytest.raises(ValueError):
        client.recv_open(1, user_data=-1)
    with pytest.raises(ValueError):
        client.send_open(b"short")


def test_error_classes():
    for code, cls in [(errno.ESTALE, kvstage.StaleLease), (errno.ENOBUFS, kvstage.PoolExhausted),
                      (errno.ENOTCONN, kvstage.NotConnected), (errno.EPERM, kvstage.PermissionDenied),
                      (errno.EACCES, kvstage.PermissionDenied), (errno.ETIMEDOUT, kvstage.Timeout),
                      (errno.EAGAIN, kvstage.Again), (errno.EBUSY, kvstage.Busy),
                      (errno.EBADF, kvstage.BadHandle), (errno.EALREADY, kvstage.AlreadyDone),
                      (errno.ECANCELED, kvstage.Aborted), (errno.ENODEV, kvstage.NoDevice),
                      (errno.EMSGSIZE, kvstage.KvstageError)]:
        e = kvstage.error(-code, "f")
        assert type(e) is cls and e.errno == code and e.name == errno.errorcode[code]
        assert str(e) == f"[Errno {code}] f: {kvstage.strerror(code)} ({errno.errorcode[code]})"
    assert isinstance(kvstage.error(-errno.ETIMEDOUT), TimeoutError)
    assert isinstance(kvstage.error(-errno.EPERM), PermissionError)
    assert isinstance(kvstage.error(-errno.ENOTCONN), ConnectionError)


def test_errors_pickle():
    import pickle
    e = pickle.loads(pickle.dumps(kvstage.error(-errno.ESTALE, "kvs_send")))
    assert type(e) is kvstage.StaleLease and e.errno == errno.ESTALE and e.func == "kvs_send"


def test_proxy_gone_is_not_connected(proxy):
    c = kvstage.Client(proxy.socket)
    proxy.stop()
    with pytest.raises(kvstage.NotConnected):
        c.acquire(1)
    with pytest.raises(kvstage.NotConnected):
        c.wait(5)
    c.close()


def test_forked_child_may_not_use_the_parents_client(client, proxy):
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            client.acquire(1)
            q.put("acquired")
        except kvstage.KvstageError as e:
            q.put(e.errno)
        with kvstage.Client(proxy.socket) as own:  # a child connects anew
            q.put(len(own.acquire(1)))

    p = ctx.Process(target=child)
    p.start()
    assert q.get(timeout=30) == errno.ECHILD
    assert q.get(timeout=30) == 1
    p.join(30)
    assert p.exitcode == 0
    assert len(client.acquire(1)) == 1  # the parent's connection goes on


def test_a_fork_child_cannot_reach_a_slot(pair):
    """An address in a slot (a sent one, a received one), inherited by a fork child, is not mapped there: the
    child's write faults instead of changing a chunk already sent and received. (The views kvstage hands out are
    released or read-only by then; a raw pointer, as ctypes or a DMA API keeps one, is what a child could use.)"""
    import ctypes
    import signal
    from conftest import next_event
    from kvstage._lib import lib
    tx, rx = pair
    rroom, desc = rx.recv_open(SLOT_SIZE)
    sroom = tx.send_open(desc)
    (lease,) = tx.acquire(1)
    lease.view()[:] = b"\x5a" * SLOT_SIZE
    sent = lib.kvs_lease_ptr(tx._h, ctypes.byref(lease._l))
    sroom.send(lease, 0, SLOT_SIZE)
    assert next_event(rx).type == kvstage.EventType.RECV_DONE
    got = rroom.lease(0)
    received = lib.kvs_lease_ptr(rx._h, ctypes.byref(got._l))
    assert sent and received
    for addr in (sent, received):
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, only the write
            try:
                import resource
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                signal.signal(signal.SIGSEGV, signal.SIG_DFL)
                ctypes.memset(addr, 0xEE, SLOT_SIZE)
            finally:
                os._exit(0)
        _, st = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGSEGV, st
    assert bytes(got.view()) == b"\x5a" * SLOT_SIZE
    rroom.close()
    sroom.close()


def test_a_wedged_proxy_times_out_and_the_connection_stays_out_of_step(client, proxy):
    import signal
    client.set_sync_timeout(200)
    proxy.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(kvstage.Timeout) as e:
            client.acquire(1)
        assert e.value.errno == errno.ETIMEDOUT and isinstance(e.value, TimeoutError)
    finally:
        proxy.proc.send_signal(signal.SIGCONT)
    with pytest.raises(kvstage.Timeout):
        client.acquire(1)  # out of step for good: close it, connect anew
    with kvstage.Client(proxy.socket) as fresh:
        assert len(fresh.acquire(1)) == 1
