#!/usr/bin/env python3
"""The Python binding's device paths on a real GPU, without torch or pytest.

Usage: py_gpu_check.py KVSTAGED
Starts KVSTAGED (4 slots of 1 MiB), then through one room: device memory into
slots (kvstage.copy_in_device, cuda.gather, cuda.gather_idx), and out of the
received slots into other device memory (copy_out_device, scatter,
scatter_idx); every byte is checked on the host. Device memory comes from the
CUDA runtime (libcudart.so, found as the binding finds it: on the loader's path).
Exit 0 all matched, 1 a mismatch or an error, 2 no device.
"""
import ctypes
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import kvstage  # noqa: E402
from kvstage import cuda, daemon  # noqa: E402

MIB = 1 << 20
PAGE = 16 << 10


def rt():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    sys.exit("py_gpu_check: no libcudart on the loader's path")


def start(exe, sock):
    try:
        return daemon.spawn(exe, ["--socket", sock, "--slots", "8", "--slot-size", str(MIB)], None)
    except daemon.DaemonError as e:
        sys.exit(f"py_gpu_check: {e}")


def final_ok(client):
    """Waits for client's final room event; raises unless it is a success."""
    while True:
        evs = client.wait(timeout=20)
        assert evs, "no room event within 20 s"
        for ev in evs:
            if ev.final:
                assert ev.status == 0, f"room ended {ev}"
                return


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    cr = rt()
    n = ctypes.c_int(0)
    if cr.cudaGetDeviceCount(ctypes.byref(n)) != 0 or n.value == 0:
        print("py_gpu_check: no CUDA device")
        return 2

    def dmalloc(nbytes):
        p = ctypes.c_void_p()
        assert cr.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)) == 0, "cudaMalloc"
        return p.value

    def h2d(dst, data):
        assert cr.cudaMemcpy(ctypes.c_void_p(dst), data, ctypes.c_size_t(len(data)), 1) == 0, "cudaMemcpy H2D"

    def d2h(src, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        assert cr.cudaMemcpy(buf, ctypes.c_void_p(src), ctypes.c_size_t(nbytes), 2) == 0, "cudaMemcpy D2H"
        return buf.raw

    def sync():
        assert cr.cudaDeviceSynchronize() == 0, "cudaDeviceSynchronize"

    d = tempfile.mkdtemp(prefix="kvs-h200-py-")
    proc = start(sys.argv[1], os.path.join(d, "kvs.sock"))
    failures = 0
    try:
        with kvstage.Client(os.path.join(d, "kvs.sock")) as tx, kvstage.Client(os.path.join(d, "kvs.sock")) as rx:
            cuda.register(tx)
            cuda.register(rx)
            src = bytes((k * 7 + k // 4093) & 0xFF for k in range(3 * MIB))
            dsrc, ddst = dmalloc(3 * MIB), dmalloc(3 * MIB)
            h2d(dsrc, src)
            rroom, desc = rx.recv_open(3 * MIB)
            sroom = tx.send_open(desc)
            a, b, c = tx.acquire(3)
            kvstage.copy_in_device(a, dsrc, MIB)  # chunk 0: one copy
            pages = [dsrc + MIB + k * PAGE for k in reversed(range(MIB // PAGE))]
            cuda.gather(b, pages, PAGE)  # chunk 1: pages in reverse order
            idx = [(k * 37) % (MIB // PAGE) for k in range(MIB // PAGE)]
            cuda.gather_idx(c, dsrc + 2 * MIB, idx, PAGE)  # chunk 2: shuffled pages
            sync()
            for i, lease in enumerate((a, b, c)):
                sroom.send(lease, i * MIB, MIB)
            for cl in (tx, rx):
                final_ok(cl)
            kvstage.copy_out_device(rroom.lease(0), ddst, MIB)
            dpages = [ddst + MIB + k * PAGE for k in reversed(range(MIB // PAGE))]
            cuda.scatter(rroom.lease(1), dpages, PAGE)  # undoes the reverse...
            cuda.scatter_idx(rroom.lease(2), ddst + 2 * MIB, idx, PAGE)  # ...and the shuffle
            sync()
            got = d2h(ddst, 3 * MIB)
            for i, what in enumerate(("copy_in/copy_out", "gather/scatter", "gather_idx/scatter_idx")):
                ok = got[i * MIB:(i + 1) * MIB] == src[i * MIB:(i + 1) * MIB]
                failures += not ok
                print(f"py_gpu_check: {what}: {'bytes match' if ok else 'BYTES DIFFER'}")
            rroom.close()
            sroom.close()
            cuda.unregister(tx)
            cuda.unregister(rx)
    finally:
        daemon.stop(proc, grace=20)
    print(f"py_gpu_check: {'PASSED' if failures == 0 else 'FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
