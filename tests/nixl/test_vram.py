"""GPU memory (VRAM_SEG) through the KVSTAGE backend: an opt-in (vram=1, $KVSTAGE_NIXL_VRAM) until a GPU has run
it, copied between GPU pages and slots by libkvstage_cuda on the backend's own thread. Without the opt-in VRAM is
refused; with it and no GPU (or a plugin built without CUDA) the backend is not created and its log line says
why. With a GPU, a READ and a WRITE between GPU regions of two engines on two proxies, byte-exact."""
import pytest

import gpu

REGIONS, BLOCKS, BLOCK_LEN = 4, 32, 16384
NO_GPU = "no CUDA device here (gpu.devices() is 0): GPU copies through libkvstage_cuda are not run"


def test_vram_is_refused_without_the_opt_in(make_engine, two_proxies):
    """By default the backend takes DRAM only: a VRAM registration is refused before any byte is touched."""
    a, _ = two_proxies
    eng = make_engine("plain", a)
    eng.call("init", name="plain-0")
    assert eng.call("try_register", mem="DRAM") == "ok"
    assert eng.call("try_register", mem="VRAM") != "ok"


def test_the_opt_in_without_a_gpu_says_why(make_engine, two_proxies, capfd):
    """vram=1 where no GPU can be reached (or the plugin has no CUDA): no backend, and a line saying which."""
    if gpu.devices():
        pytest.skip("a CUDA device is here: test_vram_read_and_write_byte_exact runs instead")
    a, _ = two_proxies
    eng = make_engine("novram", a, KVSTAGE_NIXL_VRAM=1)
    with pytest.raises(RuntimeError):
        eng.call("init", name="novram-0")
    eng.close()
    err = capfd.readouterr().err
    assert "KVSTAGE backend: vram=1: " in err, err
    assert "no CUDA device" in err or "built without CUDA" in err, err


def test_vram_read_and_write_byte_exact(make_engine, two_proxies):
    """Both engines with vram=1 and their KV in GPU memory: decode READs 8 prefill blocks of every region, then
    prefill WRITEs 4 others into decode; every byte compared, both notifications seen."""
    if not gpu.devices():
        pytest.skip(NO_GPU)
    a, b = two_proxies
    prefill = make_engine("prefill", a, KVSTAGE_NIXL_VRAM=1)
    decode = make_engine("decode", b, KVSTAGE_NIXL_VRAM=1)
    prefill.call("init", name="prefill-0")
    decode.call("init", name="decode-0")
    pbases = prefill.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=1, mem="VRAM")
    dbases = decode.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=2, mem="VRAM")

    def ids(blocks):
        return [r * BLOCKS + k for r in range(REGIONS) for k in blocks]

    remote = decode.call("add_remote", md=prefill.call("md"))
    lh = decode.call("prep_local")
    rh = decode.call("prep_remote", agent=remote, bases=pbases, blocks=BLOCKS, block_len=BLOCK_LEN, mem="VRAM")
    src, dst = [3, 9, 10, 11, 20, 21, 30, 31], list(range(8))
    x = decode.call("xfer", kind="READ", local=lh, local_ids=ids(dst), remote=rh, remote_ids=ids(src),
                    notif=b"req-v:1")
    assert decode.call("wait", xid=x["id"]) == "DONE"
    assert decode.call("read_blocks", block_ids=dst) == prefill.call("read_blocks", block_ids=src)
    assert prefill.call("notifs", want=1) == [("decode-0", b"req-v:1")]

    remote = prefill.call("add_remote", md=decode.call("md"))
    lh = prefill.call("prep_local")
    rh = prefill.call("prep_remote", agent=remote, bases=dbases, blocks=BLOCKS, block_len=BLOCK_LEN, mem="VRAM")
    src, dst = [0, 1, 2, 3], [12, 13, 14, 15]
    x = prefill.call("xfer", kind="WRITE", local=lh, local_ids=ids(src), remote=rh, remote_ids=ids(dst),
                     notif=b"push-v")
    assert prefill.call("wait", xid=x["id"]) == "DONE"
    assert decode.call("read_blocks", block_ids=dst) == prefill.call("read_blocks", block_ids=src)
    assert decode.call("notifs", want=1) == [("prefill-0", b"push-v")]
