"""ctypes mirror of include/kvstage.h: the library, its structs and prototypes."""
import ctypes
import ctypes.util
import os
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint8, c_uint32, c_uint64, c_void_p
from pathlib import Path

KVS_ROOM_DESC_SIZE = 128
KVS_MAX_READERS = 8  # kvstage.h: readers a shared room may have, its opener included
KVS_DEFAULT_SOCKET = "/run/kvstage/kvstaged.sock"

# The package's own copies, in a wheel's install (meson -Dwheel=true: kvstage/_libs, with the libraries
# they need beside them; tools/wheel/repair.py); absent from the source tree and a system install.
_PKG_LIBS = Path(__file__).resolve().parent / "_libs"
# The build tree next to the package (python/../build/shm), when the package
# is the source tree's; an installed one loads the installed library.
_SRC = Path(__file__).resolve().parent.parent.parent
_IN_TREE = (_SRC / "python" / "kvstage").is_dir() and (_SRC / "meson.build").is_file()
_BUILD_SHM = _SRC / "build" / "shm" if _IN_TREE else None


class kvs_lease(ctypes.Structure):
    """struct kvs_lease: the right to one slot at one epoch."""
    _fields_ = [("slot", c_uint32), ("epoch", c_uint32)]


class kvs_room_desc(ctypes.Structure):
    """struct kvs_room_desc: opaque, serialisable."""
    _fields_ = [("bytes", c_uint8 * KVS_ROOM_DESC_SIZE)]


class kvs_event(ctypes.Structure):
    """struct kvs_event."""
    _fields_ = [
        ("type", c_uint32),
        ("status", ctypes.c_int32),
        ("user_data", c_uint64),
        ("bytes", c_uint64),
        ("lease", kvs_lease),
        ("rsvd", c_uint64 * 4),
    ]


def _candidates(env, name):
    """Returns the paths to try for library `name` (libNAME.so.0), in order: $ENV alone if set, else the
    package's own (a wheel's), the build tree's (a source tree's), the loader's."""
    if os.environ.get(env):
        return [os.environ[env]]
    out = [str(_PKG_LIBS / f"lib{name}.so.0")] if (_PKG_LIBS / f"lib{name}.so.0").exists() else []
    out += [str(_BUILD_SHM / f"lib{name}.so.0")] if _BUILD_SHM else []
    found = ctypes.util.find_library(name)
    if found:
        out.append(found)
    out.append(f"lib{name}.so.0")
    return out


def _open(env, name, extra=(), alone=False):
    """Returns the first candidate that loads (extra's alone if alone), raises OSError naming all tried."""
    errors = []
    for path in [*extra, *([] if alone else _candidates(env, name))]:
        if "/" in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(str(e))
    raise OSError(f"cannot load lib{name} (set ${env}): " + "; ".join(errors))


lib, lib_path = _open("KVSTAGE_LIB", "kvstage")

_P = c_void_p  # kvs_client * and kvs_room * are opaque
_L = POINTER(kvs_lease)
_PROTOS = {
    "kvs_connect": (c_int, [c_char_p, POINTER(c_void_p)]),
    "kvs_close": (None, [_P]),
    "kvs_set_sync_timeout": (c_int, [_P, c_int]),
    "kvs_slot_size": (c_size_t, [_P]),
    "kvs_slot_count": (c_uint32, [_P]),
    "kvs_max_rooms": (c_uint, [_P]),
    "kvs_acquire": (c_int, [_P, c_uint, _L]),
    "kvs_lease_ptr": (c_void_p, [_P, _L]),
    "kvs_release": (c_int, [_P, _L]),
    "kvs_recv_open": (c_int, [_P, c_uint64, c_uint64, POINTER(c_void_p), POINTER(kvs_room_desc)]),
    "kvs_send_open": (c_int, [_P, POINTER(kvs_room_desc), c_uint64, POINTER(c_void_p)]),
    "kvs_recv_open_shared": (c_int, [_P, c_uint64, c_uint, c_uint64, POINTER(c_void_p), POINTER(kvs_room_desc)]),
    "kvs_recv_join": (c_int, [_P, POINTER(kvs_room_desc), c_uint64, POINTER(c_void_p)]),
    "kvs_send": (c_int, [_P, _L, c_uint64, c_uint32]),
    "kvs_abort": (c_int, [_P]),
    "kvs_room_lease": (c_int, [_P, c_uint, _L]),
    "kvs_room_close": (c_int, [_P]),
    "kvs_room_chunks": (c_uint, [_P]),
    "kvs_room_bytes": (c_uint64, [_P]),
    "kvs_poll": (c_int, [_P, POINTER(kvs_event), c_uint]),
    "kvs_wait": (c_int, [_P, POINTER(kvs_event), c_int]),
    "kvs_event_fd": (c_int, [_P]),
    "kvs_pool_map": (c_void_p, [_P, POINTER(c_size_t)]),
    "kvs_lease_check": (c_int, [_P, _L]),
    "kvs_crc32c": (c_uint32, [c_void_p, c_size_t, c_uint32]),
    "kvs_copy_crc32c": (c_uint32, [c_void_p, c_void_p, c_size_t, c_uint32]),
    "kvs_crc32c_combine": (c_uint32, [c_uint32, c_uint32, c_size_t]),
    "kvs_strerror": (c_char_p, [c_int]),
    "kvs_version": (c_char_p, []),
}
for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype, _f.argtypes = _res, _args

_cuda = None  # (CDLL, path) once loaded, or the OSError that said why not

_CUDA_PROTOS = {
    "kvs_cuda_register": (c_int, [_P]),
    "kvs_cuda_unregister": (c_int, [_P]),
    "kvs_cuda_copy_to_slot": (c_int, [_P, _L, c_size_t, c_void_p, c_size_t, c_void_p, c_void_p]),
    "kvs_cuda_copy_from_slot": (c_int, [_P, _L, c_size_t, c_void_p, c_size_t, c_void_p, c_void_p]),
    "kvs_cuda_gather": (c_int, [_P, _L, c_size_t, POINTER(c_void_p), c_uint, c_size_t, c_void_p, c_void_p]),
    "kvs_cuda_scatter": (c_int, [_P, _L, c_size_t, POINTER(c_void_p), c_uint, c_size_t, c_void_p, c_void_p]),
    "kvs_cuda_gather_idx": (c_int, [_P, _L, c_size_t, c_void_p, POINTER(ctypes.c_int32), c_uint, c_size_t,
                                    c_void_p, c_void_p]),
    "kvs_cuda_scatter_idx": (c_int, [_P, _L, c_size_t, c_void_p, POINTER(ctypes.c_int32), c_uint, c_size_t,
                                     c_void_p, c_void_p]),
    "kvs_cuda_set_gather_mode": (c_int, [_P, c_int]),
    "kvs_cuda_last_error": (c_char_p, []),
}


def cuda():
    """Returns libkvstage_cuda (loaded once, next to libkvstage first), raises OSError saying why not.

    A wheel's libkvstage (kvstage/_libs) takes its own libkvstage_cuda or none: a wheel built without
    the CUDA toolkit has none, and another copy (the system's) would be another version's.
    """
    global _cuda
    if _cuda is None:
        sibling = () if os.environ.get("KVSTAGE_CUDA_LIB") else (
            os.path.join(os.path.dirname(lib_path), "libkvstage_cuda.so.0"),) if "/" in lib_path else ()
        own = bool(sibling) and Path(lib_path).parent == _PKG_LIBS
        try:
            cl, _ = _open("KVSTAGE_CUDA_LIB", "kvstage_cuda", sibling, alone=own)
            for name, (res, args) in _CUDA_PROTOS.items():
                f = getattr(cl, name)
                f.restype, f.argtypes = res, args
            _cuda = cl
        except (OSError, AttributeError) as e:
            _cuda = OSError(str(e))
    if isinstance(_cuda, OSError):
        raise _cuda
    return _cuda
