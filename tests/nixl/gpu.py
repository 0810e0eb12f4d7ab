"""GPU memory for the VRAM tests, through the CUDA runtime by ctypes (no torch: Debian's is CPU-only).
libcudart.so from $CUDA_HOME/lib64, /usr/local/cuda/lib64, else the loader's path."""
import ctypes
import os

_rt = None


def runtime():
    """The CUDA runtime library, or None where there is none."""
    global _rt
    if _rt is None:
        for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if d and os.path.exists(os.path.join(d, "lib64", "libcudart.so")):
                _rt = ctypes.CDLL(os.path.join(d, "lib64", "libcudart.so"))
                break
        else:
            try:
                _rt = ctypes.CDLL("libcudart.so")
            except OSError:
                _rt = False
    return _rt or None


def devices():
    """How many CUDA devices this process sees (0 without a runtime, a driver or a device)."""
    rt = runtime()
    if not rt:
        return 0
    n = ctypes.c_int(0)
    return n.value if rt.cudaGetDeviceCount(ctypes.byref(n)) == 0 else 0


class Buffer:
    """n bytes of device memory on the current device: .ptr, write(bytes), read() -> bytes."""

    def __init__(self, n):
        self.rt, self.n = runtime(), n
        p = ctypes.c_void_p()
        if self.rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) != 0:
            raise RuntimeError(f"cudaMalloc({n}) failed")
        self.ptr = p.value

    def write(self, data, offset=0):
        rc = self.rt.cudaMemcpy(ctypes.c_void_p(self.ptr + offset), ctypes.c_char_p(bytes(data)),
                                ctypes.c_size_t(len(data)), 1)  # cudaMemcpyHostToDevice
        assert rc == 0, f"cudaMemcpy to the device: {rc}"

    def read(self, offset=0, n=None):
        n = self.n - offset if n is None else n
        out = ctypes.create_string_buffer(n)
        rc = self.rt.cudaMemcpy(out, ctypes.c_void_p(self.ptr + offset), ctypes.c_size_t(n), 2)  # DeviceToHost
        assert rc == 0, f"cudaMemcpy from the device: {rc}"
        return out.raw
