"""libkvstage_cuda wrappers: the clear errors when the library or a device is absent (no GPU is assumed)."""
import errno

import pytest

import kvstage
from kvstage import _lib, cuda

BOGUS = 0xDEAD0000  # no copy may ever use it: every call below is refused first


def test_without_the_library_every_call_says_so(client, monkeypatch):
    monkeypatch.setattr(_lib, "_cuda", None)  # forget what was loaded; restored after the test
    monkeypatch.setenv("KVSTAGE_CUDA_LIB", "/nonexistent/libkvstage_cuda.so.0")
    (lease,) = client.acquire(1)
    assert not cuda.available()
    for call in (lambda: kvstage.copy_in_device(lease, BOGUS, 4096),
                 lambda: kvstage.copy_out_device(lease, BOGUS, 4096),
                 lambda: cuda.register(client),
                 lambda: cuda.gather(lease, [BOGUS], 4096)):
        with pytest.raises(kvstage.NoDevice) as e:
            call()
        assert e.value.errno == errno.ENODEV
        assert "libkvstage_cuda not available" in str(e.value) and "/nonexistent" in str(e.value)


@pytest.fixture
def no_device(client):
    """Skips unless libkvstage_cuda loads and finds no CUDA device; returns the Client."""
    if not cuda.available():
        pytest.skip("libkvstage_cuda is not built here (no CUDA toolkit): only the missing-library path is tested")
    try:
        cuda.register(client)
    except kvstage.NoDevice:
        return client
    pytest.skip("a CUDA device is present: the no-device path cannot be tested here")


def test_without_a_device_every_call_says_so(no_device):
    c = no_device
    (lease,) = c.acquire(1)
    calls = {
        "kvs_cuda_register": lambda: cuda.register(c),
        "kvs_cuda_copy_to_slot": lambda: kvstage.copy_in_device(lease, BOGUS, 4096),
        "kvs_cuda_copy_from_slot": lambda: kvstage.copy_out_device(lease, BOGUS, 4096, slot_off=4096),
        "kvs_cuda_gather": lambda: cuda.gather(lease, [BOGUS, BOGUS], 4096),
        "kvs_cuda_scatter": lambda: cuda.scatter(lease, [BOGUS], 4096),
        "kvs_cuda_gather_idx": lambda: cuda.gather_idx(lease, BOGUS, [1, 0], 4096),
        "kvs_cuda_scatter_idx": lambda: cuda.scatter_idx(lease, BOGUS, [0], 4096),
        "kvs_cuda_set_gather_mode": lambda: cuda.set_gather_mode(c, cuda.GatherMode.KERNEL),
    }
    for func, call in calls.items():
        with pytest.raises(kvstage.NoDevice) as e:
            call()
        assert e.value.errno == errno.ENODEV and e.value.func == func
        assert "no CUDA device" in str(e.value)
    assert cuda.last_error() != ""  # what CUDA answered
    cuda.unregister(c)  # nothing registered: 0, device or not


def test_refusals_come_before_the_device(no_device, pair):
    c = no_device
    (lease,) = c.acquire(1)
    with pytest.raises(kvstage.KvstageError) as e:
        kvstage.copy_in_device(lease, BOGUS, c.slot_size + 1)  # past the slot's end
    assert e.value.errno == errno.EINVAL
    with pytest.raises(kvstage.KvstageError) as e:
        kvstage.copy_in_device(lease, 0, 16)  # a NULL device pointer
    assert e.value.errno == errno.EINVAL
    c.release(lease)
    with pytest.raises(kvstage.StaleLease):
        kvstage.copy_in_device(lease, BOGUS, 4096)
    other, _ = pair
    (theirs,) = other.acquire(1)
    with pytest.raises(kvstage.PermissionDenied):
        kvstage.copy_in_device(kvstage.Lease(c, theirs.slot, theirs.epoch), BOGUS, 4096)


def test_received_leases_are_not_written(client):
    lease = kvstage.Lease(client, 0, 0, readonly=True)
    with pytest.raises(ValueError):
        kvstage.copy_in_device(lease, BOGUS, 16)
    with pytest.raises(ValueError):
        cuda.gather(lease, [BOGUS], 16)
    with pytest.raises(TypeError):
        kvstage.copy_in_device("not a lease", BOGUS, 16)
